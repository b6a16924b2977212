//! The whole loop with every program real but the kubelet ([`LocalCluster`]: a real
//! kube-apiserver and kube-controller-manager with the CRD, RBAC and webhook configurations
//! applied from `deploy/`, a simulated node running pods as runc containers,
//! `warmstart-controller run` and `warmstart-agent run` with their ServiceAccounts' tokens). A Checkpoint of the
//! sample worker goes Pending → Creating → Ready because the agent checkpointed the Job's pod
//! and the worker got its `.done`; a pod annotated `restore-from` is shaped by the controller's
//! webhook, restored by the agent, passes its startup gate and serves the checkpointed state.
//! The workload namespace enforces Pod Security `baseline`, so every checkpoint Job pod and
//! restore pod is admitted only if it passes it. The sample-worker and unmodified-server round
//! trips run twice: on a node of runc containers and on a node whose pods run through containerd
//! over CRI. Needs root, runc, containerd and CRIU (`make setup`) and the Kubernetes binaries
//! (`make k8s-build`).

#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use warmstart_e2e::binaries::WORKER_IN_IMAGE;
use warmstart_e2e::cluster::{DEPLOY_NAMESPACE, requests_outside_rbac, wait_for};
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_e2e::local_cluster::{self, LocalCluster, NAMESPACE, NodeRuntime, PORT, WAIT};
use warmstart_shared::artifact::{Verification, read_published};
use warmstart_shared::names;
use warmstart_shared::v1alpha1::{Checkpoint, CheckpointPhase};

/// The local cluster, its steps unwrapped (a failure fails the test with the programs' logs).
struct Loop(LocalCluster);

impl std::ops::Deref for Loop {
    type Target = LocalCluster;
    fn deref(&self) -> &LocalCluster {
        &self.0
    }
}

impl Loop {
    async fn start() -> Self {
        Self(LocalCluster::start().await.unwrap())
    }

    async fn start_with(runtime: NodeRuntime) -> Self {
        Self(LocalCluster::start_with(runtime).await.unwrap())
    }

    async fn checkpoint(
        &self,
        name: &str,
        container: &Value,
        job_extra: &Value,
    ) -> (Checkpoint, Duration) {
        self.0.checkpoint(name, container, job_extra).await.unwrap()
    }

    async fn restore_pod(&self, name: &str, checkpoint: &str, container: &Value) -> Pod {
        self.0
            .restore_pod(name, checkpoint, container)
            .await
            .unwrap()
    }

    async fn restored_and_ready(&self, pod: &str) {
        self.0.restored_and_ready(pod).await.unwrap();
    }

    /// Waits until the agent refused the restore into `pod` (`restore-status` `failed`) and
    /// the worker in standby cold-started (serving, not restored, no restored tree beside it);
    /// the notes of the pod's Events.
    async fn refused_and_cold_started(&self, pod: &str) -> Vec<String> {
        let pods = self.pods();
        let status_key = names::restore_status_annotation("main");
        wait_for(
            &format!("the agent to refuse the restore into {pod}"),
            WAIT,
            || self.logs(),
            || async {
                let p = pods.get(pod).await.ok()?;
                (p.annotations().get(&status_key).map(String::as_str) == Some("failed"))
                    .then_some(())
            },
        )
        .await;
        let state = wait_for(
            &format!("{pod} to cold start"),
            WAIT,
            || self.logs(),
            || async { self.worker_state(pod) },
        )
        .await;
        assert_eq!(state["restored"], json!(false), "{state}");
        let container = self.container(pod).unwrap();
        assert!(
            warmstart_agent::placeholder::restored_tree(i32::try_from(container.pid()).unwrap())
                .is_empty(),
            "nothing restored"
        );
        pod_event_notes(self, pod).await
    }

    async fn stop(mut self) {
        self.0.shutdown().await.unwrap();
        // Least privilege: the programs ran with their ServiceAccounts' tokens, and whatever
        // they asked of the API, from start to shutdown, the RBAC that deploy/ grants allowed
        // (the API server's audit log says who asked what and what RBAC decided).
        for sa in ["warmstart-controller", "warmstart-agent"] {
            let user = ControlPlane::service_account_user(DEPLOY_NAMESPACE, sa);
            let made: std::collections::BTreeSet<String> = self
                .plane
                .audit_events()
                .unwrap()
                .iter()
                .filter(|e| e["user"]["username"] == user.as_str())
                .map(|e| {
                    let o = &e["objectRef"];
                    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                    format!(
                        "{} {}/{}/{}",
                        s(&e["verb"]),
                        s(&o["apiGroup"]),
                        s(&o["resource"]),
                        s(&o["subresource"])
                    )
                })
                .collect();
            assert!(!made.is_empty(), "no request was recorded as {user}");
            eprintln!("{sa} made: {made:#?}");
            let refused = requests_outside_rbac(&self.plane, sa).unwrap();
            assert!(
                refused.is_empty(),
                "{sa} made requests that deploy/rbac does not allow:\n{}",
                refused.join("\n")
            );
        }
    }
}

fn worker_container(weights_mib: u32) -> Value {
    local_cluster::worker_container(weights_mib, 300)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_becomes_ready_and_a_restore_pod_serves_its_state() {
    checkpoint_and_restore_the_sample_worker(NodeRuntime::Runc).await;
}

/// The same through containerd over CRI, as kubelet runs pods: the agent resolves
/// `containerd://` ids over CRI, and the restored worker's output lands in the placeholder's CRI
/// log (what `kubectl logs` reads).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_and_a_restore_through_containerd_over_cri() {
    checkpoint_and_restore_the_sample_worker(NodeRuntime::Containerd).await;
}

/// The id scheme pods' container ids have on a node of `runtime`.
fn id_scheme(runtime: NodeRuntime) -> &'static str {
    match runtime {
        NodeRuntime::Runc => "runc://",
        NodeRuntime::Containerd => "containerd://",
    }
}

/// The container id of `main` in `pod`'s status.
async fn status_container_id(cluster: &Loop, pod: &str) -> String {
    let pod = cluster.pods().get(pod).await.unwrap();
    pod.status
        .and_then(|s| s.container_statuses)
        .and_then(|c| c.into_iter().find(|c| c.name == "main"))
        .and_then(|c| c.container_id)
        .unwrap_or_default()
}

async fn checkpoint_and_restore_the_sample_worker(runtime: NodeRuntime) {
    let cluster = Loop::start_with(runtime).await;
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
    let id = status_container_id(&cluster, "replica").await;
    assert!(id.starts_with(id_scheme(runtime)), "{id}");
    // The restored process writes to the placeholder's stdout: the pod's log shows it.
    let container = cluster.container("replica").unwrap();
    wait_for(
        "the restored worker's output in the pod's log",
        WAIT,
        || container.read_log(),
        || async {
            container
                .read_log()
                .contains("restored, continuing")
                .then_some(())
        },
    )
    .await;
    eprintln!(
        "checkpoint created → Ready {:.1} s; restore pod created → Ready {:.1} s",
        checkpoint_took.as_secs_f64(),
        restore_took.as_secs_f64()
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unmodified_server_under_the_entrypoint_is_checkpointed_and_restored() {
    entrypoint_round_trip(NodeRuntime::Runc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unmodified_server_is_restored_through_containerd_over_cri() {
    entrypoint_round_trip(NodeRuntime::Containerd).await;
}

async fn entrypoint_round_trip(runtime: NodeRuntime) {
    let cluster = Loop::start_with(runtime).await;
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
    let container = cluster.container("httpd-replica").unwrap();
    let (code, _) = container.http_get(PORT, "/hostname").unwrap();
    assert_eq!(code, 200);
    // The server that answers is the restored one: it runs in a PID namespace nested in the
    // placeholder's, below the entrypoint that waited in standby.
    let restored =
        warmstart_agent::placeholder::restored_tree(i32::try_from(container.pid()).unwrap());
    assert!(!restored.is_empty(), "no restored tree in the replica");
    let id = status_container_id(&cluster, "httpd-replica").await;
    assert!(id.starts_with(id_scheme(runtime)), "{id}");
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
    // The worker in standby saw restore-failed and cold-started: Ready, serving its own state.
    let reasons = cluster.refused_and_cold_started("tampered").await;
    assert!(
        reasons
            .iter()
            .any(|m| m.contains("pages-") && m.contains("chunk")),
        "the pod's events name the changed page image: {reasons:?}\n{}",
        cluster.logs()
    );
    cluster.stop().await;
}

/// Refusals around the binding the webhook stamps: a target container the checkpoint did not
/// capture is refused at admission (the pod is never created), and a pod bound to a Checkpoint
/// that was deleted and recreated under the same name is refused by the agent: nothing is
/// restored, the pod says why, and the worker in standby cold-starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restores_bound_to_the_wrong_checkpoint_or_container_are_refused() {
    let cluster = Loop::start().await;
    let worker = worker_container(16);
    let (first, _) = cluster.checkpoint("rebound", &worker, &json!({})).await;
    let pods = cluster.pods();

    // A target container the checkpoint did not capture: refused when the pod is created.
    let mut sidecar = worker.clone();
    sidecar["name"] = json!("sidecar");
    let foreign: Pod = serde_json::from_value(json!({
        "metadata": {"name": "foreign", "namespace": NAMESPACE, "annotations": {
            names::ANNOTATION_RESTORE_FROM: "rebound",
            names::ANNOTATION_TARGET_CONTAINERS: "sidecar",
        }},
        "spec": {"containers": [sidecar]}
    }))
    .unwrap();
    let err = pods
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("target container \"sidecar\" was not captured by checkpoint"),
        "{err}"
    );
    assert!(pods.get_opt("foreign").await.unwrap().is_none());

    // A pod bound to the first Checkpoint, held back from scheduling while the Checkpoint is
    // deleted and recreated under the same name (another uid).
    let mut held: Value =
        serde_json::to_value(LocalCluster::pod("held", Some("rebound"), &worker).unwrap()).unwrap();
    held["spec"]["schedulingGates"] = json!([{"name": "example.com/hold"}]);
    let held = pods
        .create(
            &PostParams::default(),
            &serde_json::from_value(held).unwrap(),
        )
        .await
        .unwrap();
    let binding = held.annotations()[names::ANNOTATION_CHECKPOINT_BINDING].clone();
    let first_uid = first.uid().unwrap();
    assert!(binding.contains(&first_uid), "{binding}");
    let checkpoints: Api<Checkpoint> = Api::namespaced(cluster.plane.client(), NAMESPACE);
    checkpoints
        .delete("rebound", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        "the Checkpoint to be gone",
        WAIT,
        || cluster.logs(),
        || async {
            checkpoints
                .get_opt("rebound")
                .await
                .unwrap()
                .is_none()
                .then_some(())
        },
    )
    .await;
    let (second, _) = cluster.checkpoint("rebound", &worker, &json!({})).await;
    assert_ne!(second.uid(), Some(first_uid));
    pods.patch(
        "held",
        &PatchParams::default(),
        &Patch::Json::<()>(
            serde_json::from_value(json!([
                {"op": "remove", "path": "/spec/schedulingGates"}
            ]))
            .unwrap(),
        ),
    )
    .await
    .unwrap();

    let notes = cluster.refused_and_cold_started("held").await;
    assert!(
        notes.iter().any(|m| m.contains("binding")),
        "the pod's events say the binding is stale: {notes:?}\n{}",
        cluster.logs()
    );
    cluster.stop().await;
}

/// The agent SIGKILLed while it dumps a Checkpoint's pod and started again: the Checkpoint
/// still ends Ready (the interrupted attempt is reported and the Job's retry, or the finished
/// dump, completes it), with one complete artifact and nothing half-written beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_mid_checkpoint_still_ends_with_a_ready_checkpoint() {
    let mut cluster = Loop::start().await;
    let worker = worker_container(256);
    let checkpoints: Api<Checkpoint> = Api::namespaced(cluster.plane.client(), NAMESPACE);
    cluster
        .create_checkpoint("interrupted", &worker, &json!({}))
        .await
        .unwrap();
    cluster.operation_in_flight("checkpoint").await.unwrap();
    cluster.0.kill_agent();
    cluster.0.restart_agent().unwrap();
    let ready = wait_for(
        "the Checkpoint to end Ready after the agent restarted",
        WAIT,
        || cluster.logs(),
        || async {
            let ck = checkpoints.get("interrupted").await.ok()?;
            let phase = ck.status.as_ref()?.phase?;
            (phase == CheckpointPhase::Ready).then_some(ck)
        },
    )
    .await;
    let status = ready.status.unwrap();
    let location = status.location.unwrap();
    let artifact = cluster.artifact_root.join(&location);
    read_published(&artifact, Verification::Checksums).unwrap();
    let beside: Vec<String> = std::fs::read_dir(artifact.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(beside.len(), 1, "one artifact and nothing else: {beside:?}");
    cluster.stop().await;
}

/// The agent SIGKILLed while it restores into a replica and started again: the replica ends
/// Ready with exactly one worker, restored (the restart recognised the finished restore) or
/// cold-started (the restart reported the interrupted one as failed); never two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_mid_restore_never_restores_twice() {
    let mut cluster = Loop::start().await;
    let worker = worker_container(256);
    cluster
        .checkpoint("kill-restore", &worker, &json!({}))
        .await;
    cluster
        .restore_pod("replica", "kill-restore", &worker)
        .await;
    cluster.operation_in_flight("main").await.unwrap();
    cluster.0.kill_agent();
    cluster.0.restart_agent().unwrap();
    let pods = cluster.pods();
    let key = names::restore_status_annotation("main");
    let outcome = wait_for(
        "a final restore status and a Ready replica",
        WAIT,
        || cluster.logs(),
        || async {
            let p = pods.get("replica").await.ok()?;
            let status = p.annotations().get(&key).cloned()?;
            (matches!(status.as_str(), "completed" | "failed") && local_cluster::is_ready(&p))
                .then_some(status)
        },
    )
    .await;
    eprintln!("restore interrupted by the agent's death ended {outcome}");
    let state = wait_for(
        "the replica to serve",
        WAIT,
        || cluster.logs(),
        || async { cluster.worker_state("replica") },
    )
    .await;
    assert_eq!(
        state["restored"],
        json!(outcome == "completed"),
        "{outcome}: {state}"
    );
    let container = cluster.container("replica").unwrap();
    let count = || {
        container
            .exec_ok(["ps"])
            .unwrap()
            .matches(WORKER_IN_IMAGE)
            .count()
    };
    // Restored: the standby worker supervising its one restored copy; failed: the standby
    // worker cold-started itself. Never a second restored copy.
    let workers = count();
    assert_eq!(
        workers,
        if outcome == "completed" { 2 } else { 1 },
        "{outcome}: {}",
        container.exec_ok(["ps"]).unwrap()
    );
    let restored =
        warmstart_agent::placeholder::restored_tree(i32::try_from(container.pid()).unwrap());
    assert_eq!(
        usize::from(!restored.is_empty()),
        usize::from(outcome == "completed"),
        "{outcome}: restored tree {restored:?}"
    );
    // Later resyncs change nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(count(), workers);
    cluster.stop().await;
}

/// A pod that is no checkpoint source (no Checkpoint's Job owns it) writing `ready` into a
/// volume named like the signal volume, labelled with a real Checkpoint's hash, is ignored:
/// nothing is checkpointed, nothing written into its volume, no artifact appears beside the
/// real one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ready_file_in_a_pod_that_is_no_checkpoint_source_is_ignored() {
    let cluster = Loop::start().await;
    let (ck, _) = cluster
        .checkpoint("genuine", &worker_container(16), &json!({}))
        .await;
    let hash = ck.status.unwrap().identity_hash.unwrap();
    let spoof: Pod = serde_json::from_value(json!({
        "metadata": {"name": "spoof", "namespace": NAMESPACE,
                     "labels": {names::LABEL_CHECKPOINT_HASH: hash}},
        "spec": {"containers": [{"name": "main", "image": "busybox",
            "command": ["sh", "-c", format!("touch {}; sleep 100000", names::ready_file_path())],
            "volumeMounts": [{"name": names::VOLUME_SIGNAL, "mountPath": names::MOUNT_SIGNAL}]}],
            "volumes": [{"name": names::VOLUME_SIGNAL, "emptyDir": {}}]}
    }))
    .unwrap();
    let spoof = cluster
        .pods()
        .create(&PostParams::default(), &spoof)
        .await
        .unwrap();
    let dir = cluster.empty_dir(&spoof, names::VOLUME_SIGNAL).unwrap();
    wait_for(
        "the spoofed ready file",
        WAIT,
        || cluster.logs(),
        || async { dir.join(names::FILE_READY).exists().then_some(()) },
    )
    .await;
    let artifacts = |cluster: &LocalCluster| -> Vec<String> {
        let ns = cluster.artifact_root.join(NAMESPACE);
        std::fs::read_dir(ns)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    let before = artifacts(&cluster);
    // Several of the agent's resyncs later: nothing checkpointed, nothing written.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let entries: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries, [names::FILE_READY], "{}", cluster.logs());
    assert_eq!(artifacts(&cluster), before);
    assert_eq!(before, [hash]);
    cluster.stop().await;
}

/// A checkpoint Job whose pod the namespace's Pod Security refuses (a privileged worker) is
/// reported on the Checkpoint at once: its Ready condition says `JobFailedCreate` with the
/// admission's words, instead of the Checkpoint waiting for the Job's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_whose_pod_is_refused_is_reported_on_the_checkpoint() {
    let cluster = Loop::start().await;
    let mut worker = worker_container(16);
    worker["securityContext"] = json!({"privileged": true});
    let checkpoints: Api<Checkpoint> = Api::namespaced(cluster.plane.client(), NAMESPACE);
    cluster
        .create_checkpoint("privileged", &worker, &json!({}))
        .await
        .unwrap();
    let condition = wait_for(
        "the Checkpoint to report that its Job cannot create its pod",
        WAIT,
        || cluster.logs(),
        || async {
            let ck = checkpoints.get("privileged").await.ok()?;
            ck.status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Ready" && c.reason == "JobFailedCreate")
        },
    )
    .await;
    assert_eq!(condition.status, "False");
    assert!(
        condition
            .message
            .contains("violates PodSecurity \"baseline:latest\"")
            && condition.message.contains("privileged"),
        "{}",
        condition.message
    );
    cluster.stop().await;
}

/// The notes of the Events about pod `name`, of either API group.
async fn pod_event_notes(cluster: &LocalCluster, name: &str) -> Vec<String> {
    let core: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(cluster.plane.client(), NAMESPACE);
    let new: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(cluster.plane.client(), NAMESPACE);
    let mut notes: Vec<String> = core
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .filter_map(|e| e.message)
        .collect();
    notes.extend(
        new.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .filter_map(|e| e.note),
    );
    notes
}
