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
