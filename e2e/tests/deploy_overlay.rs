//! An overlay that names other images (`images:`, as the local cluster's `e2e/cluster/overlay`
//! does, and as a user pins a release or a mirror) reaches every place `deploy/` names
//! warmstart's images: the containers, and the agent image the controller gives
//! `spec.job.entrypoint: Wrap` pods to copy warmstart-entrypoint from. Rendered with the real
//! `kubectl kustomize`; nothing is contacted.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use serde_json::Value;

fn render(dir: &str) -> Vec<Value> {
    warmstart_e2e::manifests::kustomize(dir).unwrap()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind} {name} not rendered"))
}

#[test]
fn an_overlays_agent_image_is_the_image_wrap_pods_copy_the_entrypoint_from() {
    let objects = render("e2e/cluster/overlay");
    let agent = &find(&objects, "DaemonSet", "warmstart-agent")["spec"]["template"]["spec"];
    let agent_image = agent["containers"][0]["image"].as_str().unwrap();
    assert_eq!(agent_image, "docker.io/warmstart/agent:dev");
    let controller = &find(&objects, "Deployment", "warmstart-controller")["spec"]["template"]["spec"]
        ["containers"][0];
    let env = controller["env"].as_array().unwrap();
    let entrypoint_image = env
        .iter()
        .find(|e| e["name"] == "WARMSTART_ENTRYPOINT_IMAGE")
        .and_then(|e| e["value"].as_str());
    assert_eq!(
        entrypoint_image,
        Some(agent_image),
        "the controller's entrypoint image follows the overlay: {env:?}"
    );
    // And nothing else still names the images the overlay replaced.
    let text = serde_json::to_string(&objects).unwrap();
    assert!(
        !text.contains("ghcr.io/warmstart/"),
        "an image left unreplaced"
    );
}

/// The agent writes the node's journal where there is one: the DaemonSet mounts the journal's
/// socket directory (created empty on a node without systemd-journald, so the agent still
/// starts there) at the path the agent writes to, with the journal chosen automatically, and
/// the agent may write its Checkpoints' progress (their status alone).
#[test]
fn the_agent_mounts_the_nodes_journal_and_may_write_checkpoint_progress() {
    let objects = render("deploy");
    let agent = &find(&objects, "DaemonSet", "warmstart-agent")["spec"]["template"]["spec"];
    let volume = agent["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["hostPath"]["path"] == "/run/systemd/journal")
        .unwrap_or_else(|| panic!("no journal volume: {}", agent["volumes"]));
    assert_eq!(volume["hostPath"]["type"], "DirectoryOrCreate");
    let container = &agent["containers"][0];
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .unwrap_or_else(|| panic!("journal not mounted: {}", container["volumeMounts"]));
    assert_eq!(mount["mountPath"], "/run/systemd/journal");
    let env = container["env"].as_array().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == "WARMSTART_LOG_JOURNAL" && e["value"] == "auto"),
        "{env:?}"
    );
    let role = find(&objects, "ClusterRole", "warmstart-agent");
    let status_rule = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| {
            r["resources"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|x| x == "checkpoints/status"))
        })
        .unwrap_or_else(|| panic!("no checkpoints/status rule: {}", role["rules"]));
    assert_eq!(status_rule["verbs"], serde_json::json!(["patch"]));
}
