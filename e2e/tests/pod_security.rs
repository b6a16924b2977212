//! Pod Security `baseline` for what warmstart puts into users' namespaces: the pods of the
//! checkpoint Job and the restore pods the controller renders (its own command line, from the
//! examples in `deploy/examples/` and the test data) are admitted by a real kube-apiserver's
//! Pod Security admission in a namespace that enforces `baseline` (server-side dry run), and a
//! pod that fails it is refused there (the whole-loop tests run their workloads in such a
//! namespace).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use warmstart_e2e::binaries;
use warmstart_e2e::cluster::{enforce_pod_security, install_crd};
use warmstart_e2e::control_plane::ControlPlane;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn controller(args: &[&str], files: &[PathBuf]) -> Value {
    let out = Command::new(binaries::controller().unwrap())
        .args(args)
        .args(files)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "warmstart-controller {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_norway::from_slice(&out.stdout).unwrap()
}

/// The pod a Job's template makes, named `name`.
fn job_pod(job: &Value, name: &str) -> Value {
    let mut pod = json!({"metadata": job["spec"]["template"]["metadata"], "spec": job["spec"]["template"]["spec"]});
    pod["metadata"]["name"] = json!(name);
    pod
}

/// A control plane with namespace `workloads` enforcing Pod Security `baseline`; pods there.
async fn baseline_namespace() -> (ControlPlane, Api<Pod>) {
    let mut plane = ControlPlane::start().await.unwrap();
    install_crd(&mut plane, &["workloads"]).await.unwrap();
    enforce_pod_security(&plane.client(), "workloads", "baseline")
        .await
        .unwrap();
    let pods = Api::namespaced(plane.client(), "workloads");
    (plane, pods)
}

/// Why the API server refuses to create `pod` (dry run: nothing is stored), if it does.
async fn refusal(pods: &Api<Pod>, pod: &Value) -> Option<String> {
    let mut pod = pod.clone();
    pod["metadata"]["namespace"] = json!("workloads");
    let pod: Pod = serde_json::from_value(pod).unwrap();
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    pods.create(&params, &pod)
        .await
        .err()
        .map(|e| e.to_string())
}

#[tokio::test]
async fn rendered_checkpoint_jobs_and_restore_pods_pass_baseline() {
    let (_plane, pods) = baseline_namespace().await;
    let data = repo().join("controller/tests/data");
    let jobs = [
        repo().join("deploy/examples/checkpoint.yaml"),
        data.join("checkpoint.yaml"),
    ];
    for checkpoint in &jobs {
        let job = controller(
            &[
                "render-job",
                "--uid",
                "00000000-0000-4000-8000-000000000001",
                "-f",
            ],
            std::slice::from_ref(checkpoint),
        );
        let pod = job_pod(&job, "checkpoint-pod");
        assert!(pod["spec"]["containers"].is_array(), "{job}");
        if let Some(refused) = refusal(&pods, &pod).await {
            panic!(
                "the Job of {} fails baseline: {refused}",
                checkpoint.display()
            );
        }
    }
    let pod = controller(
        &["render-restore-pod", "--checkpoint"],
        &[
            data.join("checkpoint.yaml"),
            PathBuf::from("-f"),
            data.join("restore-pod.yaml"),
        ],
    );
    assert!(
        pod["metadata"]["annotations"]["warmstart.dev/checkpoint-binding"].is_string(),
        "{pod}"
    );
    if let Some(refused) = refusal(&pods, &pod).await {
        panic!("the restore pod fails baseline: {refused}");
    }
}

#[tokio::test]
async fn a_baseline_namespace_refuses_a_pod_that_fails_it() {
    let (_plane, pods) = baseline_namespace().await;
    let pod = |name: &str, privileged: bool| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox",
                "securityContext": {"privileged": privileged}}]}
        }))
        .unwrap()
    };
    pods.create(&PostParams::default(), &pod("plain", false))
        .await
        .unwrap();
    let err = pods
        .create(&PostParams::default(), &pod("privileged", true))
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err}");
    };
    assert_eq!(status.code, 403);
    assert!(
        status.message.contains(
            "violates PodSecurity \"baseline:latest\": privileged (container \"main\" must not set securityContext.privileged=true)"
        ),
        "{}",
        status.message
    );
}
