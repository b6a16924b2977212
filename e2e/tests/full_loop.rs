//! The whole loop with every program real: the API server double (CRD and webhook
//! configurations applied from `deploy/`), a simulated node running pods as runc containers,
//! the Job controller, `warmstart-controller run` and `warmstart-agent run`. A Checkpoint of the
//! sample worker goes Pending → Creating → Ready because the agent checkpointed the Job's pod
//! and the worker got its `.done`; a pod annotated `restore-from` is shaped by the controller's
//! webhook, restored by the agent, passes its startup gate and serves the checkpointed state.
//! The workload namespace enforces Pod Security `baseline`, so every checkpoint Job pod and
//! restore pod is admitted only if it passes it. Needs root, runc and CRIU (`make setup`).

#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use warmstart_e2e::apiserver::ApiServer;
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::cluster::{
    AgentSetup, DEPLOY_NAMESPACE, Program, enforce_pod_security, free_addr, install_crd,
    install_webhooks, requests_outside_rbac, start_agent, start_controller, wait_for,
};
use warmstart_e2e::fixture::ImageStore;
use warmstart_e2e::node::{JobController, NodeConfig, NodeImages, SimNode};
use warmstart_e2e::rbac::service_account_user;
use warmstart_shared::names;
use warmstart_shared::v1alpha1::{Checkpoint, CheckpointPhase};

const WAIT: Duration = Duration::from_secs(120);
const NS: &str = "default";
const NODE: &str = "gpu-sim-1";
const PORT: u16 = 8000;

struct Loop {
    api: ApiServer,
    node: Option<SimNode>,
    jobs: Option<JobController>,
    controller: Program,
    agent: Program,
    artifact_root: std::path::PathBuf,
    _dirs: Vec<tempfile::TempDir>,
    _images: ImageStore,
}

impl Loop {
    async fn start() -> Self {
        let api = ApiServer::start().await.unwrap();
        let client = api.client();
        install_crd(&client, &[NS, "warmstart-system"])
            .await
            .unwrap();
        // Checkpoint Jobs' pods and restore pods must pass Pod Security `baseline`: the
        // workload namespace enforces it, so a pod that needed more is refused by the API.
        enforce_pod_security(&client, NS, "baseline").await.unwrap();
        let webhook = free_addr().unwrap();
        install_webhooks(&api, webhook).await.unwrap();
        let images = ImageStore::temporary().unwrap();
        images.busybox().unwrap();
        let worker = binaries::worker_image(&images).unwrap();
        let kubelet = tempfile::Builder::new()
            .prefix("warmstart-node-")
            .tempdir()
            .unwrap();
        let artifacts = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let logs = tempfile::tempdir().unwrap();
        // The entrypoint's image, as the controller's --entrypoint-image names it: the static
        // binary where the install init container copies it from.
        let entrypoint = images
            .get_or_build("warmstart-agent-image", |image| {
                image
                    .add_file(
                        binaries::static_entrypoint()?,
                        names::ENTRYPOINT_IN_IMAGE,
                        0o755,
                    )
                    .map(|_| ())
            })
            .unwrap();
        let node_images = NodeImages::from_store(&images)
            .with_image("worker", worker)
            .with_image(warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE, entrypoint);
        let mut config = NodeConfig::new(NODE, node_images, kubelet.path());
        config.restart_backoff = Duration::from_millis(500);
        let node = SimNode::start(client.clone(), config).await.unwrap();
        let jobs = JobController::start(client.clone());
        let controller = start_controller(&api, logs.path(), artifacts.path(), webhook).unwrap();
        let agent = start_agent(
            &api,
            logs.path(),
            &AgentSetup {
                node: NODE.to_owned(),
                kubelet_root: kubelet.path().to_owned(),
                runc_root: node.runtime().runc_root(),
                artifact_root: artifacts.path().to_owned(),
                state_dir: state.path().to_owned(),
            },
        )
        .unwrap();
        let deadline = Instant::now() + WAIT;
        while std::net::TcpStream::connect(webhook).is_err() {
            assert!(
                Instant::now() < deadline,
                "the webhook never listened:\n{}",
                controller.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Self {
            api,
            node: Some(node),
            jobs: Some(jobs),
            controller,
            agent,
            artifact_root: artifacts.path().to_owned(),
            _dirs: vec![kubelet, artifacts, state, logs],
            _images: images,
        }
    }

    fn logs(&self) -> String {
        format!(
            "controller log:\n{}\nagent log:\n{}",
            self.controller.log(),
            self.agent.log()
        )
    }

    fn worker_state(&self, pod: &str) -> Option<Value> {
        let container = self.node.as_ref()?.container(NS, pod, "main")?;
        let (code, body) = container.http_get(PORT, "/state").ok()?;
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }

    async fn stop(mut self) {
        let pods: Api<Pod> = Api::namespaced(self.api.client(), NS);
        let _ = pods
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        self.agent.kill();
        self.controller.kill();
        if let Some(jobs) = self.jobs.take() {
            jobs.shutdown().await.unwrap();
        }
        if let Some(node) = self.node.take() {
            node.shutdown().await.unwrap();
        }
        // Least privilege: whatever the programs asked of the API, from start to shutdown, the
        // RBAC that deploy/ grants their ServiceAccounts allows.
        for sa in ["warmstart-controller", "warmstart-agent"] {
            let user = service_account_user(DEPLOY_NAMESPACE, sa);
            let made: std::collections::BTreeSet<String> = self
                .api
                .requests()
                .iter()
                .filter(|r| r.user == user)
                .map(|r| format!("{} {}/{}/{}", r.verb, r.group, r.resource, r.subresource))
                .collect();
            assert!(!made.is_empty(), "no request was recorded as {user}");
            eprintln!("{sa} made: {made:#?}");
            let refused = requests_outside_rbac(&self.api, sa).unwrap();
            assert!(
                refused.is_empty(),
                "{sa} made requests that deploy/rbac does not allow:\n{}",
                refused.join("\n")
            );
        }
    }
}

impl Loop {
    /// Creates a Checkpoint of `container` and waits until it is Ready; how long that took.
    async fn checkpoint(
        &self,
        name: &str,
        container: &Value,
        job_extra: &Value,
    ) -> (Checkpoint, Duration) {
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.api.client(), NS);
        let mut job = json!({"podTemplateSpec": {"spec": {"containers": [container]}}});
        if let (Some(job), Some(extra)) = (job.as_object_mut(), job_extra.as_object()) {
            job.extend(extra.clone());
        }
        let ck: Checkpoint = serde_json::from_value(json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"identity": {"model": format!("model-{name}"), "backendFramework": "vllm"},
                     "job": job}
        }))
        .unwrap();
        let created = Instant::now();
        checkpoints
            .create(&PostParams::default(), &ck)
            .await
            .unwrap();
        let ready = wait_for(
            &format!("Checkpoint {name} to become Ready"),
            WAIT,
            || self.logs(),
            || async {
                let ck = checkpoints.get(name).await.ok()?;
                let status = ck.status.as_ref()?;
                assert_ne!(
                    status.phase,
                    Some(CheckpointPhase::Failed),
                    "failed: {status:?}\n{}",
                    self.logs()
                );
                (status.phase == Some(CheckpointPhase::Ready)).then_some(ck)
            },
        )
        .await;
        (ready, created.elapsed())
    }

    /// Creates a pod of `container` annotated to restore from `checkpoint`.
    async fn restore_pod(&self, name: &str, checkpoint: &str, container: &Value) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.api.client(), NS);
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NS, "annotations": {
                names::ANNOTATION_RESTORE_FROM: checkpoint,
                names::ANNOTATION_TARGET_CONTAINERS: "main",
            }},
            "spec": {"containers": [container]}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap()
    }

    /// Waits until the agent says the restore of `pod` completed and the pod is Ready.
    async fn restored_and_ready(&self, pod: &str) {
        let pods: Api<Pod> = Api::namespaced(self.api.client(), NS);
        let status_key = names::restore_status_annotation("main");
        wait_for(
            &format!("{pod} to be restored and Ready"),
            WAIT,
            || self.logs(),
            || async {
                let p = pods.get(pod).await.ok()?;
                let status = p.annotations().get(&status_key).cloned();
                assert_ne!(
                    status.as_deref(),
                    Some("failed"),
                    "restore of {pod} failed: {:?}\n{}",
                    p.annotations(),
                    self.logs()
                );
                let ready = p
                    .status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                (status.as_deref() == Some("completed") && ready).then_some(())
            },
        )
        .await;
    }
}

fn worker_container(weights_mib: u32) -> Value {
    json!({
        "name": "main", "image": "worker",
        "command": [WORKER_IN_IMAGE, "--weights-mib", weights_mib.to_string(),
                    "--warmup-ms", "300", "--port", PORT.to_string()],
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_becomes_ready_and_a_restore_pod_serves_its_state() {
    let cluster = Loop::start().await;
    let worker = worker_container(48);
    let (ready, checkpoint_took) = cluster.checkpoint("sample", &worker, &json!({})).await;
    let status = ready.status.as_ref().unwrap();
    let artifact = status.artifact.as_ref().unwrap();
    assert!(artifact.size_bytes > 48 << 20, "{artifact:?}");
    assert_eq!(artifact.container.as_deref(), Some("main"));
    assert!(status.timings.contains_key("dump"), "{status:?}");
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True"),
        "{status:?}"
    );

    // A replica: the user's pod, annotated; the webhook shapes it, the agent restores into it.
    let created = Instant::now();
    let pod = cluster.restore_pod("replica", "sample", &worker).await;
    assert!(
        pod.annotations()
            .contains_key(names::ANNOTATION_CHECKPOINT_BINDING),
        "the webhook bound the pod to the checkpoint: {:?}",
        pod.annotations()
    );
    cluster.restored_and_ready("replica").await;
    let restore_took = created.elapsed();
    let state = wait_for(
        "the restored worker to see itself restored",
        WAIT,
        || cluster.logs(),
        || async {
            let state = cluster.worker_state("replica")?;
            (state["restored"] == json!(true)).then_some(state)
        },
    )
    .await;
    assert_eq!(state["weightsMib"], json!(48));
    assert!(state["requests"].as_u64().unwrap() >= 1, "{state}");
    eprintln!(
        "checkpoint created → Ready {:.1} s; restore pod created → Ready {:.1} s",
        checkpoint_took.as_secs_f64(),
        restore_took.as_secs_f64()
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unmodified_server_under_the_entrypoint_is_checkpointed_and_restored() {
    let cluster = Loop::start().await;
    // busybox httpd: a server that knows nothing of warmstart.
    let server = json!({
        "name": "main", "image": "busybox",
        "command": ["httpd", "-f", "-p", PORT.to_string(), "-h", "/etc"],
        "readinessProbe": {"httpGet": {"path": "/hostname", "port": PORT}, "periodSeconds": 1}
    });
    let (ck, took) = cluster
        .checkpoint("httpd", &server, &json!({"entrypoint": "Wrap"}))
        .await;
    let status = ck.status.as_ref().unwrap();
    assert_eq!(
        status.entrypoint,
        Some(warmstart_shared::v1alpha1::EntrypointMode::Wrap)
    );
    eprintln!(
        "httpd checkpoint created → Ready {:.1} s",
        took.as_secs_f64()
    );
    cluster.restore_pod("httpd-replica", "httpd", &server).await;
    cluster.restored_and_ready("httpd-replica").await;
    let container = cluster
        .node
        .as_ref()
        .unwrap()
        .container(NS, "httpd-replica", "main")
        .unwrap();
    let (code, _) = container.http_get(PORT, "/hostname").unwrap();
    assert_eq!(code, 200);
    // The server that answers is the restored one: it runs in a PID namespace nested in the
    // placeholder's, below the entrypoint that waited in standby.
    let restored =
        warmstart_agent::placeholder::restored_tree(i32::try_from(container.pid()).unwrap());
    assert!(!restored.is_empty(), "no restored tree in the replica");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_restore_pods_created_at_once_all_become_ready() {
    let cluster = Loop::start().await;
    let worker = worker_container(16);
    cluster.checkpoint("fleet", &worker, &json!({})).await;
    let created = Instant::now();
    let names: Vec<String> = (0..10).map(|i| format!("fleet-{i}")).collect();
    for name in &names {
        cluster.restore_pod(name, "fleet", &worker).await;
    }
    let mut ready_after = Vec::new();
    for name in &names {
        cluster.restored_and_ready(name).await;
        ready_after.push(created.elapsed().as_secs_f64());
    }
    for name in &names {
        let state = wait_for(
            &format!("{name} to see itself restored"),
            WAIT,
            || cluster.logs(),
            || async {
                let state = cluster.worker_state(name)?;
                (state["restored"] == json!(true)).then_some(state)
            },
        )
        .await;
        assert_eq!(state["weightsMib"], json!(16));
    }
    eprintln!(
        "10 restore pods: all Ready {:.1} s after creation (each seen Ready at {:?} s)",
        created.elapsed().as_secs_f64(),
        ready_after
            .iter()
            .map(|s| (s * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tampered_artifact_is_refused_and_the_replica_cold_starts() {
    let cluster = Loop::start().await;
    let worker = worker_container(16);
    let (ck, _) = cluster.checkpoint("tamper", &worker, &json!({})).await;
    let location = ck.status.as_ref().unwrap().location.clone().unwrap();
    let images = cluster.artifact_root.join(&location).join("criu");
    let page = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("pages-")
        })
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(&page).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&page, bytes).unwrap();

    cluster.restore_pod("tampered", "tamper", &worker).await;
    let pods: Api<Pod> = Api::namespaced(cluster.api.client(), NS);
    let status_key = names::restore_status_annotation("main");
    wait_for(
        "the agent to refuse the tampered artifact",
        WAIT,
        || cluster.logs(),
        || async {
            let p = pods.get("tampered").await.ok()?;
            (p.annotations().get(&status_key).map(String::as_str) == Some("failed")).then_some(())
        },
    )
    .await;
    // The worker in standby saw restore-failed and cold-started: Ready, serving its own state.
    let state = wait_for(
        "the replica to cold start",
        WAIT,
        || cluster.logs(),
        || async { cluster.worker_state("tampered") },
    )
    .await;
    assert_eq!(state["restored"], json!(false), "{state}");
    let container = cluster
        .node
        .as_ref()
        .unwrap()
        .container(NS, "tampered", "main")
        .unwrap();
    assert!(
        warmstart_agent::placeholder::restored_tree(i32::try_from(container.pid()).unwrap())
            .is_empty(),
        "nothing restored"
    );
    // Events of either API group (the agent records events.k8s.io/v1).
    let core: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(cluster.api.client(), NS);
    let new: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(cluster.api.client(), NS);
    let mut reasons: Vec<String> = core
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some("tampered"))
        .filter_map(|e| e.message)
        .collect();
    reasons.extend(
        new.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("tampered"))
            .filter_map(|e| e.note),
    );
    assert!(
        reasons
            .iter()
            .any(|m| m.contains("pages-") && m.contains("chunk")),
        "the pod's events name the changed page image: {reasons:?}\n{}",
        cluster.logs()
    );
    cluster.stop().await;
}
