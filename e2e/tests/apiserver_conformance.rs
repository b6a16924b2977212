//! warmstart's own API objects on a real kube-apiserver (the tests' control plane): the
//! Checkpoint CRD of `deploy/crd` (structural schema, defaults, strict field validation, the
//! CEL rule, printer columns, the status subresource), `deploy/` applied server-side (and a
//! second apply changing nothing), the users' aggregated ClusterRoles of `deploy/rbac`, and Pod
//! Security on warmstart's own pods (the controller's passes `restricted`, the agent's needs
//! the `privileged` namespace `deploy/storage` makes). The admission webhooks' decisions are
//! tested with the real controller in `controller.rs`; the programs' least privilege in
//! `controller.rs`, `agent_cluster.rs` and `full_loop.rs`. Each test has its own control plane.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use warmstart_e2e::cluster::{enforce_pod_security, install_crd, render_deploy, repo, yaml_docs};
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_shared::Checkpoint;

/// Runs kubectl as the cluster admin; (success, stdout, stderr).
fn kubectl(plane: &ControlPlane, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    use std::io::Write;
    let mut child = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(plane.kubeconfig())
        .args(args)
        .current_dir(repo())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl (make setup installs it)");
    let mut input = child.stdin.take().unwrap();
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// kubectl that must succeed; its stdout.
fn ok(plane: &ControlPlane, args: &[&str], stdin: Option<&str>) -> String {
    let (success, out, err) = kubectl(plane, args, stdin);
    assert!(success, "kubectl {args:?}: {err}");
    out
}

/// A control plane with the Checkpoint CRD served and namespace `default` ready.
async fn with_crd() -> ControlPlane {
    let mut plane = ControlPlane::start().await.unwrap();
    install_crd(&mut plane, &["default"]).await.unwrap();
    plane
}

fn example_checkpoint() -> Value {
    yaml_docs(&repo().join("deploy/examples/checkpoint.yaml"))
        .unwrap()
        .into_iter()
        .find(|d| d["kind"] == "Checkpoint")
        .unwrap()
}

#[tokio::test]
async fn the_example_checkpoint_is_admitted_and_defaulted_by_the_crd_schema() {
    let plane = with_crd().await;
    let mut doc = example_checkpoint();
    doc["metadata"]["namespace"] = json!("default");
    ok(&plane, &["apply", "-f", "-"], Some(&doc.to_string()));
    let name = doc["metadata"]["name"].as_str().unwrap();
    let out = ok(
        &plane,
        &[
            "get",
            "ckpt",
            name,
            "-o",
            "jsonpath={.spec.deletionPolicy} {.spec.job.backoffLimit} {.metadata.generation}",
        ],
        None,
    );
    assert_eq!(out, "Delete 3 1", "schema defaults");
}

#[tokio::test]
async fn unknown_checkpoint_fields_are_refused_under_strict_field_validation() {
    let plane = with_crd().await;
    let mut doc = example_checkpoint();
    doc["metadata"]["namespace"] = json!("default");
    doc["spec"]["deletionPolicyy"] = json!("Retain");
    // kubectl asks for strict field validation by default.
    let (success, _, err) = kubectl(&plane, &["create", "-f", "-"], Some(&doc.to_string()));
    assert!(!success, "a misspelt field is refused");
    assert!(
        err.contains("unknown field \"spec.deletionPolicyy\""),
        "{err}"
    );
}

#[tokio::test]
async fn the_identity_of_a_checkpoint_is_immutable_by_its_cel_rule() {
    let plane = with_crd().await;
    let mut doc = example_checkpoint();
    doc["metadata"]["namespace"] = json!("default");
    ok(&plane, &["apply", "-f", "-"], Some(&doc.to_string()));
    let name = doc["metadata"]["name"].as_str().unwrap();
    let (success, _, err) = kubectl(
        &plane,
        &[
            "patch",
            "ckpt",
            name,
            "--type=merge",
            "-p",
            r#"{"spec":{"identity":{"model":"other"}}}"#,
        ],
        None,
    );
    assert!(
        !success && err.contains("spec.identity is immutable"),
        "the CEL rule holds: {err}"
    );
    // Other spec fields may change.
    ok(
        &plane,
        &[
            "patch",
            "ckpt",
            name,
            "--type=merge",
            "-p",
            r#"{"spec":{"deletionPolicy":"Retain"}}"#,
        ],
        None,
    );
}

#[tokio::test]
async fn the_status_subresource_isolates_status_and_printer_columns_show_it() {
    let plane = with_crd().await;
    let checkpoints: Api<Checkpoint> = Api::namespaced(plane.client(), "default");
    let mut doc = example_checkpoint();
    doc["metadata"]["namespace"] = json!("default");
    doc["status"] = json!({"phase": "Ready"});
    let name = doc["metadata"]["name"].as_str().unwrap().to_owned();
    let created = checkpoints
        .create(
            &PostParams::default(),
            &serde_json::from_value(doc).unwrap(),
        )
        .await
        .unwrap();
    assert!(
        created.status.is_none(),
        "status is dropped on create: {:?}",
        created.status
    );
    // An artifact status without what a restore checks against is refused, naming the fields.
    let incomplete = json!({"status": {"phase": "Ready", "artifact": {"sizeBytes": 8192}}});
    let err = checkpoints
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&incomplete))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("status.artifact.criuVersion: Required value"),
        "{err}"
    );
    let status = json!({"status": {"phase": "Ready", "identityHash": "96429b2725761a09",
        "message": "artifact verified", "artifact": {"sizeBytes": 8192, "size": "8.0 KiB",
        "criuVersion": "4.2.1", "kernelVersion": "6.18.0", "manifestDigest": "sha256:00"}}});
    let patched = checkpoints
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    assert_eq!(
        patched.metadata.generation,
        Some(1),
        "a status change is no spec change"
    );
    let out = ok(&plane, &["get", "ckpt", &name, "-n", "default"], None);
    let header: Vec<&str> = out.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME", "MODEL", "BACKEND", "PHASE", "HASH", "READY", "SIZE", "PROGRESS", "AGE"
        ],
        "{out}"
    );
    let row = out.lines().nth(1).unwrap();
    assert!(
        row.contains("Ready") && row.contains("96429b2725761a09") && row.contains("8.0 KiB"),
        "{out}"
    );
    let wide = ok(
        &plane,
        &["get", "ckpt", &name, "-n", "default", "-o", "wide"],
        None,
    );
    assert!(
        wide.contains("BYTES")
            && wide.contains("8192")
            && wide.contains("MESSAGE")
            && wide.contains("artifact verified"),
        "{wide}"
    );
}

/// resourceVersion of every object `kubectl get` lists from the rendered `deploy/`.
fn versions(plane: &ControlPlane) -> Vec<String> {
    let mut versions: Vec<String> = render_deploy()
        .unwrap()
        .iter()
        .map(|doc| {
            let kind = doc["kind"].as_str().unwrap();
            let name = doc["metadata"]["name"].as_str().unwrap();
            let mut args = vec![
                "get",
                kind,
                name,
                "-o",
                "jsonpath={.metadata.resourceVersion}",
            ];
            if let Some(ns) = doc["metadata"]["namespace"].as_str() {
                args.extend(["-n", ns]);
            }
            format!("{kind}/{name}={}", ok(plane, &args, None))
        })
        .collect();
    versions.sort();
    versions
}

#[tokio::test]
async fn deploy_applies_server_side_and_a_second_apply_changes_nothing() {
    let plane = ControlPlane::start().await.unwrap();
    ok(
        &plane,
        &["apply", "--server-side", "-k", "deploy/storage"],
        None,
    );
    ok(
        &plane,
        &["apply", "--server-side", "-k", "deploy/crd"],
        None,
    );
    ok(
        &plane,
        &[
            "wait",
            "--for=condition=Established",
            "crd/checkpoints.warmstart.dev",
        ],
        None,
    );
    ok(&plane, &["apply", "--server-side", "-k", "deploy"], None);
    let first = versions(&plane);
    ok(&plane, &["apply", "--server-side", "-k", "deploy"], None);
    assert_eq!(versions(&plane), first, "a second apply is a no-op");
}

#[tokio::test]
async fn the_users_aggregated_roles_let_editors_manage_and_viewers_read_checkpoints() {
    let plane = with_crd().await;
    for doc in yaml_docs(&repo().join("deploy/rbac/users.yaml")).unwrap() {
        ok(&plane, &["apply", "-f", "-"], Some(&doc.to_string()));
    }
    ok(
        &plane,
        &[
            "create",
            "rolebinding",
            "alice-edits",
            "--clusterrole=edit",
            "--user=alice",
        ],
        None,
    );
    ok(
        &plane,
        &[
            "create",
            "rolebinding",
            "bob-views",
            "--clusterrole=view",
            "--user=bob",
        ],
        None,
    );
    // The controller-manager aggregates the labelled rules into edit and view.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let can = |user: &str, verb: &str| {
        let (_, out, _) = kubectl(
            &plane,
            &[
                "auth",
                "can-i",
                verb,
                "checkpoints.warmstart.dev",
                "--as",
                user,
            ],
            None,
        );
        out.trim() == "yes"
    };
    while !(can("alice", "create") && can("bob", "list")) {
        assert!(
            std::time::Instant::now() < deadline,
            "edit and view never got the checkpoint rules"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(can("alice", "delete"));
    assert!(can("bob", "watch"));
    assert!(!can("bob", "create"), "viewers do not create checkpoints");
    assert!(!can("bob", "delete"));
}

/// The pod of the rendered `deploy/` workload `kind`.
fn workload_pod(kind: &str, namespace: &str) -> Pod {
    let doc = render_deploy()
        .unwrap()
        .into_iter()
        .find(|d| d["kind"] == kind)
        .unwrap();
    let template = &doc["spec"]["template"];
    serde_json::from_value(json!({
        "metadata": {"name": format!("{}-pod", kind.to_lowercase()), "namespace": namespace,
                     "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    }))
    .unwrap()
}

/// Why the API server refuses to create `pod` (dry run), if it does.
async fn refusal(plane: &ControlPlane, pod: &Pod) -> Option<String> {
    let ns = pod.metadata.namespace.clone().unwrap();
    let pods: Api<Pod> = Api::namespaced(plane.client(), &ns);
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    pods.create(&params, pod).await.err().map(|e| e.to_string())
}

#[tokio::test]
async fn the_controller_pod_passes_restricted_and_the_agent_pod_needs_privileged() {
    let mut plane = ControlPlane::start().await.unwrap();
    ok(
        &plane,
        &["apply", "--server-side", "-k", "deploy/storage"],
        None,
    );
    install_crd(&mut plane, &["strict", "warmstart-system"])
        .await
        .unwrap();
    ok(&plane, &["apply", "--server-side", "-k", "deploy"], None);
    enforce_pod_security(&plane.client(), "strict", "restricted")
        .await
        .unwrap();
    // The pods are tried where deploy/ puts them (their ServiceAccounts are there) and in a
    // namespace enforcing `restricted`, whose ServiceAccounts are made to match.
    for sa in ["warmstart-controller", "warmstart-agent"] {
        ok(
            &plane,
            &["create", "serviceaccount", sa, "-n", "strict"],
            None,
        );
    }
    for kind in ["Deployment", "DaemonSet"] {
        let pod = workload_pod(kind, "warmstart-system");
        if let Some(refused) = refusal(&plane, &pod).await {
            panic!("the {kind}'s pod is refused in warmstart-system: {refused}");
        }
    }
    let controller = workload_pod("Deployment", "strict");
    if let Some(refused) = refusal(&plane, &controller).await {
        panic!("the controller's pod fails restricted: {refused}");
    }
    let agent = workload_pod("DaemonSet", "strict");
    let refused = refusal(&plane, &agent)
        .await
        .expect("the agent's pod is privileged");
    assert!(
        refused.contains("violates PodSecurity \"restricted:latest\"")
            && refused.contains("privileged"),
        "{refused}"
    );
}
