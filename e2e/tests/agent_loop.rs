//! The cluster agent's node loop (`warmstart_agent::cluster::node::run`) in this process, against
//! a real kube-apiserver (the tests' control plane, without a Job controller: the tests create a
//! Job's pod themselves and set pod status as a kubelet would), with a temporary kubelet root and
//! [`FakeNode`], a double of the node's engine (`NodeOps`). Nothing here needs root, CRIU or a
//! container: what is tested is the loop's part, that is which operation it starts for which pod
//! and container, and what it then tells the user (the `.done` signal, `restore-failed`, status
//! annotations, Events, metrics). The engine itself is tested on real containers elsewhere
//! (`agent_cluster.rs`, `containers.rs`).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Recorder, Reporter as EventReporter};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::watch;
use warmstart_agent::cache::Cache;
use warmstart_agent::checkpoint::CheckpointError;
use warmstart_agent::cluster::metrics::Metrics;
use warmstart_agent::cluster::node::{self, Health, Settings};
use warmstart_agent::cluster::ops::{Checkpointed, NodeOps, OpError, Restore, Restored};
use warmstart_agent::cluster::readiness::Requirements;
use warmstart_agent::progress::Reporter;
use warmstart_agent::publish::Staging;
use warmstart_agent::restore::RestoreError;
use warmstart_agent::seams::cuda::CudaSlot;
use warmstart_agent::timings::Timings;
use warmstart_e2e::cluster::install_crd;
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_e2e::s3_server::S3Server;
use warmstart_e2e::watch_hold::WatchHold;
use warmstart_objstore::Store;
use warmstart_shared::Checkpoint;
use warmstart_shared::artifact::{
    CriuInfo, MANIFEST_FORMAT_VERSION, Manifest, SourceInfo, Verification, read_published,
};
use warmstart_shared::binding::Binding;
use warmstart_shared::control::RestoreStatus;
use warmstart_shared::names;
use warmstart_shared::signal::{DoneSignal, RestoreFailed};

const WAIT: Duration = Duration::from_secs(60);
const NS: &str = "default";
const NODE: &str = "loop-node-1";

/// A double of the node's engine: records every call, publishes a real (small) artifact for a
/// checkpoint, and fails as told by the container id (`…-fails`), with the engine's own error
/// types, so the loop's reports of a failure are the ones a real failure gets.
#[derive(Debug, Default)]
struct FakeNode {
    calls: Mutex<Vec<String>>,
}

impl FakeNode {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }
}

impl NodeOps for FakeNode {
    fn checkpoint<'a>(
        &'a self,
        container_id: &'a str,
        output: &'a Path,
        hash: &'a str,
        source: SourceInfo,
        _progress: Reporter,
    ) -> BoxFuture<'a, Result<Checkpointed, OpError>> {
        Box::pin(async move {
            self.record(format!("checkpoint {container_id} {}", output.display()));
            if container_id.ends_with("-fails") {
                return Err(OpError::Checkpoint(CheckpointError::NotRunning(
                    container_id.to_owned(),
                )));
            }
            let manifest = publish(output, hash, source);
            let mut timings = Timings::default();
            timings.record("dump", Duration::from_millis(250));
            Ok(Checkpointed { manifest, timings })
        })
    }

    fn restore<'a>(
        &'a self,
        order: Restore<'a>,
        _progress: Reporter,
    ) -> BoxFuture<'a, Result<Restored, OpError>> {
        Box::pin(async move {
            self.record(format!(
                "restore {} {} {}",
                order.container_id,
                order.artifact.display(),
                order.manifest_digest
            ));
            if order.container_id.ends_with("-fails") {
                return Err(OpError::Restore(RestoreError::Replaced {
                    path: order.artifact.to_owned(),
                    expected: order.manifest_digest.to_owned(),
                    found: "sha256:0000".to_owned(),
                }));
            }
            Ok(Restored {
                pid: 1,
                log: order.log_dir.join("restore.log"),
                timings: Timings::default(),
            })
        })
    }

    fn give_back_gpu<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u32>, String>> {
        Box::pin(async move {
            self.record(format!("give-back-gpu {container_id}"));
            Ok(Vec::new())
        })
    }

    fn kill_restored<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Vec<i32>> {
        Box::pin(async move {
            self.record(format!("kill-restored {container_id}"));
            vec![4242]
        })
    }
}

/// Publishes a small artifact at `output` the way the engine does.
fn publish(output: &Path, hash: &str, source: SourceInfo) -> Manifest {
    let staging = Staging::create(output).unwrap();
    std::fs::create_dir(staging.path().join("criu")).unwrap();
    std::fs::write(staging.path().join("criu/pages-1.img"), vec![7u8; 8192]).unwrap();
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        identity_hash: hash.into(),
        created_at: "2026-12-05T18:00:00Z".into(),
        source,
        criu: CriuInfo {
            version: "4.2.1".into(),
            kernel_version: "6.18.0".into(),
            ..Default::default()
        },
        mounts: vec![],
        cuda: None,
        assigned_gpus: None,
        timings: Default::default(),
        chunk_bytes: 0,
        files: vec![],
        digest: String::new(),
    };
    staging
        .publish(manifest, &warmstart_agent::progress::Meter::default())
        .unwrap()
}

/// A Checkpoint's identity hash, as its status records it.
fn hash_of(ck: &Checkpoint) -> String {
    ck.status.as_ref().unwrap().identity_hash.clone().unwrap()
}

/// A Ready Checkpoint's manifest digest.
fn digest_of(ck: &Checkpoint) -> String {
    ck.status
        .as_ref()
        .unwrap()
        .artifact
        .as_ref()
        .unwrap()
        .manifest_digest
        .clone()
}

/// Polls `check` every 100 ms until it gives a value, at most [`WAIT`].
async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The control plane, a kubelet root, an artifact root and the node loop running on them.
struct Loop {
    plane: ControlPlane,
    kubelet_root: TempDir,
    artifacts: TempDir,
    _state: TempDir,
    fake: Arc<FakeNode>,
    metrics: Arc<Metrics>,
    shutdown: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Loop {
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// With `cache`: restores read artifacts through a node cache there.
    async fn start_with(cache: Option<&Path>) -> Self {
        Self::start_with_store(cache, None).await
    }

    /// With `store` too: published artifacts are uploaded there and restores fetch them from it.
    async fn start_with_store(cache: Option<&Path>, store: Option<Store>) -> Self {
        Self::start_full(cache, store, None).await
    }

    /// The loop's watches held by `hold` when it says so.
    async fn start_held(hold: &WatchHold) -> Self {
        Self::start_full(None, None, Some(hold)).await
    }

    async fn start_full(
        cache: Option<&Path>,
        store: Option<Store>,
        hold: Option<&WatchHold>,
    ) -> Self {
        let mut plane = ControlPlane::start_with(false).await.unwrap();
        install_crd(&mut plane, &[NS]).await.unwrap();
        let kubelet_root = tempfile::tempdir().unwrap();
        let artifacts = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeNode::default());
        let metrics = Arc::new(Metrics::default());
        let owner = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        let settings = Settings {
            node: NODE.to_owned(),
            kubelet_root: kubelet_root.path().to_owned(),
            artifact_root: artifacts.path().to_owned(),
            state_dir: state.path().to_owned(),
            artifact_owner: owner,
            max_checkpoints: 2,
            max_restores: 4,
            resync: Duration::from_millis(500),
            shutdown_grace: Duration::from_secs(5),
            ops: fake.clone(),
            limits: warmstart_agent::limits::Limits::default(),
            cache: cache.map(|dir| Arc::new(Cache::open(dir, 1 << 30).unwrap())),
            store,
            // The preflight's verdict is not what these tests look at: checked once, rarely.
            readiness: Requirements {
                criu: PathBuf::from("/nonexistent/criu"),
                kubelet_root: kubelet_root.path().to_owned(),
                cri: None,
                cuda: None::<CudaSlot>,
            },
            readiness_interval: Duration::from_secs(3600),
        };
        let client = match hold {
            Some(hold) => hold.client(plane.kubeconfig()).await.unwrap(),
            None => plane.client(),
        };
        let recorder = Recorder::new(
            client.clone(),
            EventReporter {
                controller: node::FIELD_MANAGER.to_owned(),
                instance: Some(NODE.to_owned()),
            },
        );
        let (shutdown, shutdown_rx) = watch::channel(false);
        let task = tokio::spawn({
            let metrics = metrics.clone();
            async move {
                node::run(
                    settings,
                    client,
                    metrics,
                    recorder,
                    Arc::new(Health::default()),
                    shutdown_rx,
                )
                .await
                .unwrap();
            }
        });
        Self {
            plane,
            kubelet_root,
            artifacts,
            _state: state,
            fake,
            metrics,
            shutdown,
            task: Some(task),
        }
    }

    fn client(&self) -> Client {
        self.plane.client()
    }

    /// Stops the loop as SIGTERM does and waits for it to end.
    async fn stop(mut self) {
        self.shutdown.send_replace(true);
        if let Some(task) = self.task.take() {
            tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        }
    }

    fn signal_dir(&self, uid: &str) -> PathBuf {
        names::empty_dir_on_host(self.kubelet_root.path(), uid, names::VOLUME_SIGNAL)
    }

    fn control_dir(&self, uid: &str, container: &str) -> PathBuf {
        names::empty_dir_on_host(self.kubelet_root.path(), uid, names::VOLUME_CONTROL)
            .join(container)
    }

    /// Creates `pod`, sets up its volumes as the kubelet would and sets its status to Running
    /// with container `main` running as `container_id`, then binds it to this node, as a
    /// scheduler does (the loop sees only the pods bound to its node: it sees this one ready).
    async fn run_pod(&self, pod: Pod, container_id: &str) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.client(), NS);
        let created = pods.create(&PostParams::default(), &pod).await.unwrap();
        let uid = created.uid().unwrap();
        std::fs::create_dir_all(self.signal_dir(&uid)).unwrap();
        std::fs::create_dir_all(self.control_dir(&uid, "main")).unwrap();
        let status = json!({"status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{
                "name": "main", "image": "worker", "imageID": "", "ready": false,
                "restartCount": 0, "containerID": container_id,
                "state": {"running": {"startedAt": "2026-12-05T18:00:00Z"}}
            }]
        }});
        let name = created.name_any();
        pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
        let binding = json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": NS},
            "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}
        });
        let _: Value = pods
            .create_subresource("binding", &name, &PostParams::default(), &binding)
            .await
            .unwrap();
        pods.get(&name).await.unwrap()
    }

    /// A Checkpoint `name` in phase Creating, as the controller sets it, its Job (from the
    /// contract's builder) and the Job's pod running as `container_id`.
    async fn checkpoint_source(&self, name: &str, container_id: &str) -> (Pod, String) {
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.client(), NS);
        let ck: Checkpoint = serde_json::from_value(json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "identity": {"model": format!("sample-{name}"), "backendFramework": "vllm"},
                "job": {"podTemplateSpec": {"spec": {"containers": [
                    {"name": "main", "image": "worker", "command": ["/worker"]}]}}}
            }
        }))
        .unwrap();
        let ck = checkpoints
            .create(&PostParams::default(), &ck)
            .await
            .unwrap();
        let hash = warmstart_shared::identity::identity_hash(&ck.spec.identity).unwrap();
        let location = format!("{NS}/{hash}");
        let job_name = names::job_name(name);
        let ck = checkpoints
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Creating", "identityHash": hash,
                    "jobName": job_name, "location": location, "storageType": "pvc"}})),
            )
            .await
            .unwrap();
        let job = warmstart_shared::job::build_checkpoint_job(
            &ck,
            &hash,
            &location,
            warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE,
        )
        .unwrap();
        let jobs: Api<Job> = Api::namespaced(self.client(), NS);
        let job = jobs.create(&PostParams::default(), &job).await.unwrap();
        let template = job.spec.as_ref().unwrap().template.clone();
        let mut metadata = template.metadata.unwrap_or_default();
        metadata.name = Some(format!("{job_name}-pod"));
        metadata.namespace = Some(NS.to_owned());
        metadata.owner_references = Some(vec![
            serde_json::from_value(json!({
                "apiVersion": "batch/v1", "kind": "Job", "name": job_name,
                "uid": job.uid().unwrap(), "controller": true
            }))
            .unwrap(),
        ]);
        let pod = Pod {
            metadata,
            spec: template.spec,
            status: None,
        };
        (self.run_pod(pod, container_id).await, hash)
    }

    /// A published artifact and its Checkpoint marked Ready, as the controller leaves it.
    async fn ready_checkpoint(&self, name: &str) -> Checkpoint {
        let (source, hash) = self
            .checkpoint_source(name, "containerd://unused-source")
            .await;
        // The source pod is not signalled: its artifact is published here, not by the loop.
        let _ = source;
        let out = self.artifacts.path().join(NS).join(&hash);
        let source = SourceInfo {
            container: "main".to_owned(),
            ..SourceInfo::default()
        };
        let manifest = publish(&out, &hash, source);
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.client(), NS);
        checkpoints
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Ready", "artifact": {
                    "sizeBytes": manifest.total_size(), "manifestDigest": manifest.digest,
                    "criuVersion": manifest.criu.version,
                    "kernelVersion": manifest.criu.kernel_version}}})),
            )
            .await
            .unwrap()
    }

    /// Changes the page image of the artifact `hash` on the artifact volume, its size kept, so
    /// only a checksum tells.
    fn change_pages(&self, hash: &str) {
        let pages = self
            .artifacts
            .path()
            .join(NS)
            .join(hash)
            .join("criu/pages-1.img");
        std::fs::set_permissions(&pages, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        std::fs::write(&pages, vec![8u8; 8192]).unwrap();
    }

    /// A restore pod for `ck` shaped as the webhook shapes it, running as `container_id`, with
    /// the annotations in `extra` besides.
    async fn restore_pod(
        &self,
        name: &str,
        ck: &Checkpoint,
        container_id: &str,
        extra: Value,
    ) -> Pod {
        let mut spec = ck.spec.job.pod_template_spec.spec.clone().unwrap();
        spec.containers[0].command = Some(vec!["sleep".into(), "100000".into()]);
        let mut annotations = json!({
            names::ANNOTATION_RESTORE_FROM: ck.name_any(),
            names::ANNOTATION_TARGET_CONTAINERS: "main",
            names::ANNOTATION_CHECKPOINT_BINDING: Binding::for_checkpoint(ck).unwrap().to_string(),
        });
        annotations
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let pod = Pod {
            metadata: serde_json::from_value(
                json!({"name": name, "namespace": NS, "annotations": annotations}),
            )
            .unwrap(),
            spec: Some(spec),
            status: None,
        };
        let pod =
            warmstart_shared::restore_pod::build_restore_pod(&pod, &["main".to_owned()]).unwrap();
        self.run_pod(pod, container_id).await
    }

    async fn restore_status(&self, pod: &str, want: RestoreStatus) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.client(), NS);
        let key = names::restore_status_annotation("main");
        let deadline = Instant::now() + WAIT;
        loop {
            let p = pods.get(pod).await.unwrap();
            let status = p.annotations().get(&key).cloned();
            if status.as_deref() == Some(want.as_str()) {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "{pod}'s restore status stayed {status:?} (want {}); events: {:?}; engine calls: {:?}",
                want.as_str(),
                self.events(pod).await,
                self.fake.calls()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The reasons and messages of the Events about object `name`.
    async fn events(&self, name: &str) -> Vec<(String, String)> {
        let events: Api<Event> = Api::namespaced(self.client(), NS);
        let mut out: Vec<(String, String)> = events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect();
        let new: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(self.client(), NS);
        out.extend(
            new.list(&ListParams::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default())),
        );
        out
    }

    async fn event(&self, name: &str, reason: &str) -> String {
        wait_for(&format!("a {reason} Event on {name}"), || async {
            self.events(name)
                .await
                .into_iter()
                .find(|(r, _)| r == reason)
                .map(|(_, message)| message)
        })
        .await
    }

    async fn done_signal(&self, uid: &str, hash: &str) -> DoneSignal {
        let path = self.signal_dir(uid).join(names::done_file_name(hash));
        wait_for(&format!("{}", path.display()), || async {
            let bytes = std::fs::read(&path).ok()?;
            Some(serde_json::from_slice(&bytes).unwrap())
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ready_source_is_checkpointed_once_and_answered_with_its_published_artifact() {
    let l = Loop::start().await;
    let (pod, hash) = l.checkpoint_source("ok", "containerd://source-ok").await;
    let uid = pod.uid().unwrap();
    // Not ready yet: nothing is asked of the engine.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(l.fake.calls().is_empty(), "{:?}", l.fake.calls());

    std::fs::write(l.signal_dir(&uid).join(names::FILE_READY), "").unwrap();
    let done = l.done_signal(&uid, &hash).await;
    assert!(done.success, "{done:?}");
    assert_eq!(done.location, format!("{NS}/{hash}"));
    assert_eq!(done.timings.get("dump"), Some(&0.25), "{done:?}");
    let artifact = l.artifacts.path().join(NS).join(&hash);
    let manifest = read_published(&artifact, Verification::Checksums).unwrap();
    assert_eq!(
        manifest.source.pod,
        pod.name_any(),
        "the source recorded is the pod"
    );
    assert_eq!(manifest.source.node, NODE);
    let checkpointed = l.event(&pod.name_any(), "Checkpointed").await;
    assert!(
        checkpointed.contains(&format!("{NS}/{hash}")),
        "{checkpointed}"
    );
    // The user looks at the Checkpoint: the Events are there too.
    l.event("ok", "Checkpointed").await;

    // The signals stay; resyncs pass; the checkpoint is never taken again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        l.fake.calls(),
        vec![format!(
            "checkpoint containerd://source-ok {}",
            artifact.display()
        )]
    );
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains(
            "warmstart_agent_operations_total{operation=\"checkpoint\",result=\"success\"} 1"
        ),
        "{metrics}"
    );
    l.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_checkpoint_is_answered_with_the_engines_reason_and_counted_by_cause() {
    let l = Loop::start().await;
    let (pod, hash) = l
        .checkpoint_source("bad", "containerd://source-fails")
        .await;
    let uid = pod.uid().unwrap();
    std::fs::write(l.signal_dir(&uid).join(names::FILE_READY), "").unwrap();
    let done = l.done_signal(&uid, &hash).await;
    assert!(!done.success, "{done:?}");
    let error = done.error.unwrap_or_default();
    assert!(
        error.contains("container containerd://source-fails is not running"),
        "{error}"
    );
    let event = l.event("bad", "CheckpointFailed").await;
    assert!(event.contains("is not running"), "{event}");
    assert!(
        !l.artifacts.path().join(NS).join(&hash).exists(),
        "nothing is published for a failed checkpoint"
    );
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains(
            "warmstart_agent_failures_total{operation=\"checkpoint\",cause=\"container\"} 1"
        ),
        "{metrics}"
    );
    l.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restores_are_ordered_with_the_validated_digest_and_their_outcomes_reported() {
    let l = Loop::start().await;
    let ck = l.ready_checkpoint("model").await;
    let (digest, hash) = (digest_of(&ck), hash_of(&ck));
    let artifact = l.artifacts.path().join(NS).join(&hash);

    let good = l
        .restore_pod("good", &ck, "containerd://good", json!({}))
        .await;
    let bad = l
        .restore_pod("bad", &ck, "containerd://bad-fails", json!({}))
        .await;
    l.restore_status("good", RestoreStatus::Completed).await;
    l.event("good", "Restored").await;
    l.restore_status("bad", RestoreStatus::Failed).await;
    let failed = l.event("bad", "RestoreFailed").await;
    assert!(failed.contains("container main"), "{failed}");

    // The standby entrypoint of the failed one reads why, and cold starts.
    let written = std::fs::read(
        l.control_dir(&bad.uid().unwrap(), "main")
            .join(names::FILE_RESTORE_FAILED),
    )
    .unwrap();
    let written: RestoreFailed = serde_json::from_slice(&written).unwrap();
    assert!(written.reason.contains(&digest), "{}", written.reason);
    assert!(
        !l.control_dir(&good.uid().unwrap(), "main")
            .join(names::FILE_RESTORE_FAILED)
            .exists()
    );
    let mut calls = l.fake.calls();
    calls.sort();
    assert_eq!(
        calls,
        vec![
            format!(
                "restore containerd://bad-fails {} {digest}",
                artifact.display()
            ),
            format!("restore containerd://good {} {digest}", artifact.display()),
        ]
    );
    let metrics = l.metrics.encode();
    assert!(
        metrics
            .contains("warmstart_agent_failures_total{operation=\"restore\",cause=\"artifact\"} 1"),
        "{metrics}"
    );
    l.stop().await;
}

/// The loop decides from its watch of pods, which can lag behind its own writes (under load it
/// did): a restore it completed, seen again while its view still shows it in progress, is not a
/// dead agent's unfinished restore to kill and answer with `restore-failed`, and not one to
/// start again. The watch is held from the moment it delivered the in-progress status until
/// the loop has looked at the pod again several times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_completed_restore_stays_completed_while_the_watch_still_shows_it_in_progress() {
    let hold = WatchHold::default();
    let l = Loop::start_held(&hold).await;
    let ck = l.ready_checkpoint("model").await;
    let in_progress = format!(
        "\"{}\":\"{}\"",
        names::restore_status_annotation("main"),
        RestoreStatus::InProgress.as_str()
    );
    hold.hold_after(&in_progress);
    let pod = l
        .restore_pod("lagging", &ck, "containerd://lagging", json!({}))
        .await;
    hold.holding().await;
    l.restore_status("lagging", RestoreStatus::Completed).await;
    l.event("lagging", "Restored").await;
    // The loop looks at every pod every 500 ms: several passes over the stale view.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let control = l.control_dir(&pod.uid().unwrap(), "main");
    let engine_calls = || -> Vec<String> {
        l.fake
            .calls()
            .into_iter()
            .map(|c| c.split(' ').take(2).collect::<Vec<_>>().join(" "))
            .collect()
    };
    let one_restore = vec!["restore containerd://lagging".to_owned()];
    assert_eq!(
        engine_calls(),
        one_restore,
        "while the view lagged: one restore, nothing killed"
    );
    assert!(!control.join(names::FILE_RESTORE_FAILED).exists());
    let events = l.events("lagging").await;
    assert!(
        !events.iter().any(|(reason, _)| reason == "RestoreFailed"),
        "{events:?}"
    );

    // Once the watch catches up, nothing changes either.
    hold.release();
    tokio::time::sleep(Duration::from_secs(1)).await;
    l.restore_status("lagging", RestoreStatus::Completed).await;
    assert_eq!(engine_calls(), one_restore);
    assert!(!control.join(names::FILE_RESTORE_FAILED).exists());
    let metrics = l.metrics.encode();
    assert!(!metrics.contains("cause=\"interrupted\""), "{metrics}");
    l.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restore_a_dead_agent_left_in_progress_is_killed_and_reported_never_redone() {
    let l = Loop::start().await;
    let ck = l.ready_checkpoint("model").await;
    let in_progress = json!({
        names::restore_status_annotation("main"): RestoreStatus::InProgress.as_str()
    });
    let pod = l
        .restore_pod("orphan", &ck, "containerd://orphan", in_progress)
        .await;
    l.restore_status("orphan", RestoreStatus::Failed).await;
    let failed = l.event("orphan", "RestoreFailed").await;
    assert!(
        failed.contains("the agent restarted during the restore") && failed.contains("4242"),
        "{failed}"
    );
    assert!(
        l.control_dir(&pod.uid().unwrap(), "main")
            .join(names::FILE_RESTORE_FAILED)
            .exists(),
        "the standby entrypoint is told to cold start"
    );
    assert_eq!(
        l.fake.calls(),
        vec!["kill-restored containerd://orphan".to_owned()]
    );
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains(
            "warmstart_agent_failures_total{operation=\"restore\",cause=\"interrupted\"} 1"
        ),
        "{metrics}"
    );
    l.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_node_cache_restores_read_a_verified_local_copy_fetched_once() {
    let cache = tempfile::tempdir().unwrap();
    let l = Loop::start_with(Some(cache.path())).await;
    let ck = l.ready_checkpoint("model").await;
    let (digest, hash) = (digest_of(&ck), hash_of(&ck));
    let cached = cache.path().join(NS).join(&hash);

    for pod in ["one", "two"] {
        l.restore_pod(pod, &ck, &format!("containerd://{pod}"), json!({}))
            .await;
        l.restore_status(pod, RestoreStatus::Completed).await;
    }
    let mut calls = l.fake.calls();
    calls.sort();
    assert_eq!(
        calls,
        vec![
            format!("restore containerd://one {} {digest}", cached.display()),
            format!("restore containerd://two {} {digest}", cached.display()),
        ],
        "both restores read the node's copy"
    );
    let copy = read_published(&cached, Verification::Checksums).unwrap();
    assert_eq!(copy.digest, digest);
    let metrics = l.metrics.encode();
    for line in [
        "warmstart_agent_cache_reads_total{result=\"fetched\"} 1",
        "warmstart_agent_cache_reads_total{result=\"hit\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    assert!(
        metrics.contains(&format!(
            "warmstart_agent_cache_bytes {}",
            copy.total_size()
        )),
        "{metrics}"
    );

    // A copy that does not verify (a page image changed on the artifact volume, its size kept,
    // so only a checksum tells) is no restore: the pod is told why and cold starts.
    let other = l.ready_checkpoint("broken").await;
    let other_hash = hash_of(&other);
    l.change_pages(&other_hash);
    let pod = l
        .restore_pod("three", &other, "containerd://three", json!({}))
        .await;
    l.restore_status("three", RestoreStatus::Failed).await;
    let failed = l.event("three", "RestoreFailed").await;
    assert!(
        failed.contains("node's cache") && failed.contains("pages-1.img"),
        "{failed}"
    );
    assert!(
        l.control_dir(&pod.uid().unwrap(), "main")
            .join(names::FILE_RESTORE_FAILED)
            .exists()
    );
    assert!(!cache.path().join(NS).join(&other_hash).exists());
    assert_eq!(
        l.fake.calls().len(),
        2,
        "nothing restored from a broken artifact"
    );
    l.stop().await;
}

/// Adds `spec.prestage` with `selector` to Checkpoint `name`, as a user edits it.
async fn prestage(l: &Loop, name: &str, selector: Value) {
    let checkpoints: Api<Checkpoint> = Api::namespaced(l.client(), NS);
    checkpoints
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"prestage": {"nodeSelector": selector}}})),
        )
        .await
        .unwrap();
}

/// This node's entry of Checkpoint `name`'s `status.prestage`, once it is in `state`.
async fn prestage_entry(
    l: &Loop,
    name: &str,
    state: warmstart_shared::PrestageState,
) -> warmstart_shared::PrestageStatus {
    let checkpoints: Api<Checkpoint> = Api::namespaced(l.client(), NS);
    wait_for(&format!("{name}'s prestage entry {state:?}"), || async {
        let ck = checkpoints.get(name).await.ok()?;
        ck.status?
            .prestage
            .into_iter()
            .find(|e| e.node == NODE && e.state == state)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_selecting_the_node_is_warmed_into_its_cache_before_any_restore() {
    let cache = tempfile::tempdir().unwrap();
    let l = Loop::start_with(Some(cache.path())).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(l.client());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": NODE, "labels": {"pool": "h100"}}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();

    // Selecting other nodes: this one leaves it alone.
    let elsewhere = l.ready_checkpoint("elsewhere").await;
    prestage(&l, "elsewhere", json!({"pool": "a100"})).await;
    // Selecting this node: fetched into its cache and reported, with no restore asking.
    let ck = l.ready_checkpoint("warm").await;
    prestage(&l, "warm", json!({"pool": "h100"})).await;
    let digest = digest_of(&ck);
    let entry = prestage_entry(&l, "warm", warmstart_shared::PrestageState::Warmed).await;
    assert_eq!(entry.manifest_digest, digest);
    let cached = cache.path().join(NS).join(hash_of(&ck));
    let copy = read_published(&cached, Verification::Checksums).unwrap();
    assert_eq!(copy.digest, digest);
    assert_eq!(entry.size_bytes, Some(copy.total_size()));
    assert!(
        l.fake.calls().is_empty(),
        "nothing restored: {:?}",
        l.fake.calls()
    );
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains("warmstart_agent_prestages_total{result=\"fetched\"} 1"),
        "{metrics}"
    );
    let elsewhere_now = Api::<Checkpoint>::namespaced(l.client(), NS)
        .get("elsewhere")
        .await
        .unwrap();
    assert!(elsewhere_now.status.unwrap().prestage.is_empty());
    assert!(!cache.path().join(NS).join(hash_of(&elsewhere)).exists());

    // The first restore here reads the warmed copy: a cache hit, nothing fetched.
    l.restore_pod("first", &ck, "containerd://first", json!({}))
        .await;
    l.restore_status("first", RestoreStatus::Completed).await;
    assert_eq!(
        l.fake.calls(),
        vec![format!(
            "restore containerd://first {} {digest}",
            cached.display()
        )]
    );
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains("warmstart_agent_cache_reads_total{result=\"hit\"} 1")
            && !metrics.contains("warmstart_agent_cache_reads_total{result=\"fetched\"}"),
        "{metrics}"
    );

    // An artifact whose copy does not verify is reported Failed with the reason, never cached.
    let broken = l.ready_checkpoint("broken").await;
    l.change_pages(&hash_of(&broken));
    prestage(&l, "broken", json!({})).await;
    let entry = prestage_entry(&l, "broken", warmstart_shared::PrestageState::Failed).await;
    let message = entry.message.unwrap_or_default();
    assert!(message.contains("pages-1.img"), "{message}");
    assert!(!cache.path().join(NS).join(hash_of(&broken)).exists());
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains("warmstart_agent_prestages_total{result=\"failed\"} 1"),
        "{metrics}"
    );
    l.stop().await;
}

/// A node without a cache says so once per Checkpoint: every node's entry is a Checkpoint event
/// for every node, and answering each event with the same entry again grew with the square of
/// the nodes (a tenant's `spec.prestage: {}` stormed the API server).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_without_a_cache_reports_a_prestage_once_however_often_the_checkpoint_changes() {
    let l = Loop::start().await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(l.client());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NODE}})).unwrap(),
        )
        .await
        .unwrap();
    l.ready_checkpoint("everywhere").await;
    prestage(&l, "everywhere", json!({})).await;
    let entry = prestage_entry(&l, "everywhere", warmstart_shared::PrestageState::Failed).await;
    let message = entry.message.unwrap_or_default();
    assert!(message.contains("without a node cache"), "{message}");

    // Each change is an event for the pre-stager, as another node's entry is.
    let checkpoints: Api<Checkpoint> = Api::namespaced(l.client(), NS);
    for n in 0..5 {
        checkpoints
            .patch(
                "everywhere",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"example.com/touched": n.to_string()}}}),
                ),
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let metrics = l.metrics.encode();
    assert!(
        metrics.contains("warmstart_agent_prestages_total{result=\"failed\"} 1"),
        "one report, not one per event: {metrics}"
    );
    let now = checkpoints.get("everywhere").await.unwrap();
    let entries = now.status.unwrap().prestage;
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].updated_at, entry.updated_at, "{entries:?}");
    l.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_an_object_store_down_a_checkpoint_fails_and_a_restore_cold_starts_saying_why() {
    let mut server = S3Server::start("artifacts").unwrap();
    let store = Store::new(server.store_config()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let l = Loop::start_with_store(Some(cache.path()), Some(store.clone())).await;

    // The store down while a checkpoint is taken: it fails, saying where it could not upload;
    // nothing is in the bucket.
    server.stop();
    let (pod, hash) = l.checkpoint_source("up", "containerd://source-up").await;
    let uid = pod.uid().unwrap();
    std::fs::write(l.signal_dir(&uid).join(names::FILE_READY), "").unwrap();
    let done = l.done_signal(&uid, &hash).await;
    assert!(!done.success, "{done:?}");
    let error = done.error.unwrap_or_default();
    assert!(
        error.contains("cannot upload it to the object store") && error.contains(server.bucket()),
        "{error}"
    );
    assert!(!error.contains(server.secret()), "{error}");
    l.event("up", "CheckpointFailed").await;
    server.restart().unwrap();
    assert!(matches!(
        store.verify(NS, &hash).await,
        Err(warmstart_objstore::StoreError::NotFound { .. })
    ));

    // A Ready artifact in the bucket, the store down when a restore asks: the pod is told why
    // (restore-failed: it cold starts) and nothing is cached.
    let ck = l.ready_checkpoint("model").await;
    let ready_hash = hash_of(&ck);
    let local = l.artifacts.path().join(NS).join(&ready_hash);
    store
        .upload(
            &local,
            NS,
            &ready_hash,
            &warmstart_objstore::Progress::new(),
        )
        .await
        .unwrap();
    server.stop();
    let cold = l
        .restore_pod("cold", &ck, "containerd://cold", json!({}))
        .await;
    l.restore_status("cold", RestoreStatus::Failed).await;
    let failed = l.event("cold", "RestoreFailed").await;
    assert!(
        failed.contains("node's cache") && failed.contains(server.bucket()),
        "{failed}"
    );
    assert!(
        l.control_dir(&cold.uid().unwrap(), "main")
            .join(names::FILE_RESTORE_FAILED)
            .exists()
    );
    assert!(!cache.path().join(NS).join(&ready_hash).exists());
    assert!(l.fake.calls().iter().all(|c| !c.starts_with("restore")));

    // The store back: the next restore fetches from the bucket and restores the cached copy.
    server.restart().unwrap();
    l.restore_pod("warm", &ck, "containerd://warm", json!({}))
        .await;
    l.restore_status("warm", RestoreStatus::Completed).await;
    let cached = cache.path().join(NS).join(&ready_hash);
    assert!(
        l.fake.calls().contains(&format!(
            "restore containerd://warm {} {}",
            cached.display(),
            digest_of(&ck)
        )),
        "{:?}",
        l.fake.calls()
    );
    l.stop().await;
}
