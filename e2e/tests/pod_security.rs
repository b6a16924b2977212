//! Pod Security `baseline` for what warmstart puts into users' namespaces: the checkpoint Job
//! and the restore pod the controller renders (its own command line, from the examples in
//! `deploy/examples/` and the test data) pass every baseline check, and the API server double
//! enforces the level where a namespace asks for it (the whole-loop tests run their workloads
//! in such a namespace).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use warmstart_e2e::apiserver::ApiServer;
use warmstart_e2e::apiserver::podsecurity::baseline_violations;
use warmstart_e2e::binaries;
use warmstart_e2e::cluster::{enforce_pod_security, install_crd};

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

/// The pod a Job's template makes.
fn job_pod(job: &Value) -> Value {
    json!({"metadata": job["spec"]["template"]["metadata"], "spec": job["spec"]["template"]["spec"]})
}

#[test]
fn rendered_checkpoint_jobs_and_restore_pods_pass_baseline() {
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
        let pod = job_pod(&job);
        assert!(pod["spec"]["containers"].is_array(), "{job}");
        let violations = baseline_violations(&pod);
        assert!(
            violations.is_empty(),
            "the Job of {} fails baseline: {violations:?}",
            checkpoint.display()
        );
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
    let violations = baseline_violations(&pod);
    assert!(
        violations.is_empty(),
        "the restore pod fails baseline: {violations:?}"
    );
}

#[tokio::test]
async fn a_baseline_namespace_refuses_a_pod_that_fails_it() {
    let api = ApiServer::start().await.unwrap();
    let client = api.client();
    install_crd(&client, &["workloads"]).await.unwrap();
    enforce_pod_security(&client, "workloads", "baseline")
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client, "workloads");
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
