//! `warmstart-agent run` as a whole program: a real kube-apiserver and controller-manager (the
//! tests' control plane, its Job controller running the checkpoint Jobs), a simulated node
//! running pods as real runc containers (the agent resolves their `runc://` ids), and the agent
//! process with its node's kubelet root, as ServiceAccount `warmstart-system/warmstart-agent`
//! with exactly the RBAC of `deploy/rbac` (each test ends by checking RBAC refused it nothing).
//! The test plays the controller and the webhook (it sets Checkpoint status and shapes pods
//! with the contract's builders); the agent is the real program. Needs root, runc and CRIU (CI
//! has them: `make setup`) and the Kubernetes binaries (`make k8s-build`).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tempfile::TempDir;
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::cluster::{
    Program, agent_kubeconfig, free_addr, install_crd, install_rbac, requests_outside_rbac,
};
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_e2e::cuda::{GpuNode, SimGpu};
use warmstart_e2e::fixture::ImageStore;
use warmstart_e2e::node::{NodeConfig, NodeImages, SimNode};
use warmstart_shared::Checkpoint;
use warmstart_shared::artifact::{ArtifactLayout, Manifest, Verification, read_published};
use warmstart_shared::binding::Binding;
use warmstart_shared::names;
use warmstart_shared::signal::{DoneSignal, RestoreFailed};

const WAIT: Duration = Duration::from_secs(90);
const NS: &str = "default";
const NODE: &str = "gpu-sim-1";
const PORT: u16 = 8000;

/// The control plane, a node, and a running agent.
struct Cluster {
    node: Option<SimNode>,
    state: TempDir,
    artifacts: TempDir,
    agent_state: TempDir,
    dir: TempDir,
    _images: ImageStore,
    agent: Option<Program>,
    admin: SocketAddr,
    agent_runs: u32,
    /// The CUDA stand-in the agent loads, on a simulated GPU node.
    cuda_library: Option<PathBuf>,
    /// The fault point the next agent started pauses at (`WARMSTART_FAULT_PAUSE`).
    fault: Option<&'static str>,
    /// The node cache the next agent started restores through (`--cache-dir`).
    cache: Option<PathBuf>,
    /// The object store the next agent started uploads to and restores from (`--s3-*`).
    s3: Option<Vec<String>>,
    kubeconfig: PathBuf,
    // Dropped after the node and the agent that use it.
    plane: ControlPlane,
}

/// A test that panics still ends its agent (the node ends with the test's runtime, the control
/// plane when dropped; the agent is a separate process).
impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_agent();
    }
}

/// Polls `check` every 100 ms until it gives a value, at most `timeout`.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Cluster {
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// With `gpu`: the agent loads its CUDA stand-in, the node has the cuda workload image as
    /// `cuda`, and `hostPath` volumes are this machine's paths (so a pod can mount the
    /// stand-in's directory where the agent sees it).
    async fn start_with(gpu: Option<&GpuNode>) -> Self {
        let mut plane = ControlPlane::start().await.unwrap();
        let client = plane.client();
        install_crd(&mut plane, &[NS]).await.unwrap();
        install_rbac(&mut plane).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = agent_kubeconfig(&plane, dir.path()).await.unwrap();
        let images = ImageStore::temporary().unwrap();
        images.busybox().unwrap();
        let worker = binaries::worker_image(&images).unwrap();
        let state = tempfile::Builder::new()
            .prefix("warmstart-node-")
            .tempdir()
            .unwrap();
        let mut node_images = NodeImages::from_store(&images).with_image("worker", worker);
        if gpu.is_some() {
            node_images =
                node_images.with_image("cuda", binaries::cuda_workload_image(&images).unwrap());
        }
        let mut config = NodeConfig::new(NODE, node_images, state.path());
        config.restart_backoff = Duration::from_millis(500);
        if gpu.is_some() {
            config.host_root = PathBuf::from("/");
        }
        let node = SimNode::start(client.clone(), config).await.unwrap();
        let mut cluster = Self {
            node: Some(node),
            state,
            artifacts: tempfile::tempdir().unwrap(),
            agent_state: tempfile::tempdir().unwrap(),
            dir,
            _images: images,
            agent: None,
            admin: free_addr().unwrap(),
            agent_runs: 0,
            cuda_library: gpu.map(|g| g.library().to_owned()),
            fault: None,
            cache: None,
            s3: None,
            kubeconfig,
            plane,
        };
        cluster.start_agent();
        cluster.wait_agent_ready().await;
        cluster
    }

    fn client(&self) -> Client {
        self.plane.client()
    }

    fn node(&self) -> &SimNode {
        self.node.as_ref().unwrap()
    }

    fn agent_log(&self) -> String {
        (1..=self.agent_runs)
            .map(|n| {
                std::fs::read_to_string(self.dir.path().join(format!("agent-{n}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n--- agent restarted ---\n")
    }

    fn start_agent(&mut self) {
        self.agent_runs += 1;
        let mut command = Command::new(binaries::agent().unwrap());
        if let Some(library) = &self.cuda_library {
            command.arg("--cuda-library").arg(library).args([
                "--cuda-call-timeout",
                "20",
                "--cuda-lock-timeout",
                "1",
            ]);
        }
        command
            .arg("run")
            .arg("--kubelet-root")
            .arg(self.state.path())
            .arg("--artifact-root")
            .arg(self.artifacts.path())
            .arg("--runc-root")
            .arg(self.node().runtime().runc_root())
            .arg("--state-dir")
            .arg(self.agent_state.path())
            .arg("--admin-listen")
            .arg(self.admin.to_string())
            .args(["--resync-seconds", "1", "--max-restores", "4"])
            // Pods run as runc containers of the simulated node's own; a GPU only with the
            // stand-in.
            .arg("--require-cri=false")
            .arg(format!("--require-cuda={}", self.cuda_library.is_some()))
            .env("KUBECONFIG", &self.kubeconfig)
            .env("NODE_NAME", NODE)
            .env("RUST_LOG", "info");
        if let Some(point) = self.fault {
            command.env("WARMSTART_FAULT_PAUSE", point);
        }
        if let Some(cache) = &self.cache {
            command.arg("--cache-dir").arg(cache);
        }
        if let Some(s3) = &self.s3 {
            command.args(s3);
        }
        let log = self
            .dir
            .path()
            .join(format!("agent-{}.log", self.agent_runs));
        self.agent = Some(Program::spawn_shimmed(&command, log).unwrap());
    }

    async fn wait_agent_ready(&self) {
        let nodes: Api<Node> = Api::all(self.client());
        wait_for("the agent to label its node ready", WAIT, || async {
            let node = nodes.get(NODE).await.unwrap();
            (node
                .labels()
                .get(names::LABEL_AGENT_READY)
                .map(String::as_str)
                == Some("true"))
            .then_some(())
        })
        .await;
    }

    fn kill_agent(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            agent.kill();
        }
    }

    /// Sends SIGTERM and waits for it to end.
    fn stop_agent(&mut self) -> std::process::ExitStatus {
        let mut agent = self.agent.take().unwrap();
        agent
            .signal_and_wait(nix::sys::signal::Signal::SIGTERM)
            .unwrap()
    }

    fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(self.admin).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    async fn stop(mut self) {
        self.kill_agent();
        let refused = requests_outside_rbac(&self.plane, "warmstart-agent").unwrap();
        assert!(
            refused.is_empty(),
            "RBAC refused the agent: {refused:#?}\nagent log:\n{}",
            self.agent_log()
        );
        // The Jobs first, so the Job controller makes no pods again.
        let jobs: Api<Job> = Api::namespaced(self.client(), NS);
        let _ = jobs
            .delete_collection(&DeleteParams::background(), &ListParams::default())
            .await;
        let pods: Api<Pod> = Api::namespaced(self.client(), NS);
        let _ = pods
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        if let Some(node) = self.node.take() {
            node.shutdown().await.unwrap();
        }
    }

    /// A Checkpoint of the sample worker, in phase Creating as the controller sets it, with its
    /// Job created from the contract's builder.
    async fn checkpoint(&self, name: &str, weights_mib: u32) -> (Checkpoint, String) {
        let pod_spec = json!({"containers": [{
            "name": "main", "image": "worker",
            "command": [WORKER_IN_IMAGE, "--weights-mib", weights_mib.to_string(),
                        "--warmup-ms", "200", "--port", PORT.to_string()]
        }]});
        self.checkpoint_of(name, &pod_spec).await
    }

    /// A Checkpoint `name` of the pod `pod_spec` (identity `sample-<name>`), in phase Creating
    /// as the controller sets it, with its Job created from the contract's builder.
    async fn checkpoint_of(&self, name: &str, pod_spec: &Value) -> (Checkpoint, String) {
        let client = self.client();
        let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), NS);
        let ck: Checkpoint = serde_json::from_value(json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "identity": {"model": format!("sample-{name}"), "backendFramework": "vllm"},
                "job": {"podTemplateSpec": {"spec": pod_spec}}
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
        let jobs: Api<Job> = Api::namespaced(client, NS);
        jobs.create(&PostParams::default(), &job).await.unwrap();
        (ck, hash)
    }

    async fn job_pod(&self, job: &str) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.client(), NS);
        wait_for(&format!("a pod of job {job}"), WAIT, || async {
            pods.list(&ListParams::default().labels(&format!("job-name={job}")))
                .await
                .unwrap()
                .items
                .into_iter()
                .next()
        })
        .await
    }

    async fn wait_job(&self, job: &str, condition: &str) -> Job {
        let jobs: Api<Job> = Api::namespaced(self.client(), NS);
        let log = || self.agent_log();
        let deadline = Instant::now() + WAIT;
        loop {
            let j = jobs.get(job).await.unwrap();
            let found = j
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == condition && c.status == "True"));
            if found {
                return j;
            }
            assert!(
                Instant::now() < deadline,
                "job {job} never got {condition}: {:?}\nagent log:\n{}",
                j.status,
                log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Marks the Checkpoint Ready with the artifact's manifest digest, as the controller does
    /// after verifying it.
    async fn mark_ready(&self, name: &str, manifest: &Manifest) -> Checkpoint {
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.client(), NS);
        checkpoints
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Ready", "artifact": {
                    "sizeBytes": manifest.total_size(), "manifestDigest": manifest.digest,
                    "criuVersion": manifest.criu.version, "kernelVersion": manifest.criu.kernel_version}}})),
            )
            .await
            .unwrap()
    }

    /// A restore pod for `ck` shaped as the webhook shapes it: the Job's pod template, the
    /// target's command replaced by a placeholder that only waits.
    async fn restore_pod(&self, name: &str, ck: &Checkpoint, binding: Option<String>) -> Pod {
        let template = &ck.spec.job.pod_template_spec;
        let mut spec = template.spec.clone().unwrap();
        spec.containers[0].command = Some(vec!["sleep".into(), "100000".into()]);
        let mut pod = Pod {
            metadata: serde_json::from_value(json!({
                "name": name, "namespace": NS,
                "annotations": {
                    names::ANNOTATION_RESTORE_FROM: ck.name_any(),
                    names::ANNOTATION_TARGET_CONTAINERS: "main",
                    names::ANNOTATION_CHECKPOINT_BINDING:
                        binding.unwrap_or_else(|| Binding::for_checkpoint(ck).unwrap().to_string()),
                }
            }))
            .unwrap(),
            spec: Some(spec),
            status: None,
        };
        pod = warmstart_shared::restore_pod::build_restore_pod(&pod, &["main".to_owned()]).unwrap();
        let pods: Api<Pod> = Api::namespaced(self.client(), NS);
        pods.create(&PostParams::default(), &pod).await.unwrap()
    }

    async fn restore_status(&self, pod: &str, what: &str) -> Pod {
        let pods: Api<Pod> = Api::namespaced(self.client(), NS);
        let key = names::restore_status_annotation("main");
        let deadline = Instant::now() + WAIT;
        loop {
            let p = pods.get(pod).await.unwrap();
            let status = p.annotations().get(&key).cloned();
            if status.as_deref() == Some(what) {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "pod {pod} restore status stayed {status:?} (want {what}); events: {:?}\nagent log:\n{}",
                self.events(pod).await,
                self.agent_log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn events(&self, pod: &str) -> Vec<(String, String)> {
        let events: Api<Event> = Api::namespaced(self.client(), NS);
        let mut out: Vec<(String, String)> = events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(pod))
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect();
        let new: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(self.client(), NS);
        out.extend(
            new.list(&ListParams::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod))
                .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default())),
        );
        out
    }

    fn signal_dir(&self, pod: &Pod) -> PathBuf {
        names::empty_dir_on_host(self.state.path(), &pod.uid().unwrap(), names::VOLUME_SIGNAL)
    }

    fn control_dir(&self, pod: &Pod) -> PathBuf {
        names::empty_dir_on_host(
            self.state.path(),
            &pod.uid().unwrap(),
            names::VOLUME_CONTROL,
        )
        .join("main")
    }

    fn layout(&self, hash: &str) -> ArtifactLayout {
        ArtifactLayout::new(self.artifacts.path(), NS, hash).unwrap()
    }

    /// The worker's state once it has noticed `restore-complete` (it polls for it).
    async fn restored_state(&self, pod: &str) -> Value {
        wait_for(
            &format!("the worker in {pod} to see itself restored"),
            WAIT,
            || async {
                let state = self.worker_state(pod);
                (state["restored"] == json!(true)).then_some(state)
            },
        )
        .await
    }

    fn worker_state(&self, pod: &str) -> Value {
        let container = self.node().container(NS, pod, "main").unwrap();
        let (code, body) = container.http_get(PORT, "/state").unwrap();
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

/// Checkpoints a Checkpoint's Job through the agent; returns the published manifest.
async fn checkpointed(c: &Cluster, name: &str, weights_mib: u32) -> (Checkpoint, Manifest) {
    let (_, hash) = c.checkpoint(name, weights_mib).await;
    let job = names::job_name(name);
    let pod = c.job_pod(&job).await;
    c.wait_job(&job, "Complete").await;
    let done: DoneSignal = serde_json::from_slice(
        &std::fs::read(c.signal_dir(&pod).join(names::done_file_name(&hash))).unwrap(),
    )
    .unwrap();
    assert!(done.success, "{done:?}");
    assert_eq!(done.location, format!("{NS}/{hash}"));
    let manifest = read_published(&c.layout(&hash).dir(), Verification::Checksums).unwrap();
    assert_eq!(manifest.source.pod, pod.name_any());
    assert_eq!(manifest.source.container, "main");
    assert_eq!(manifest.source.node, NODE);
    assert!(manifest.source.container_id.starts_with("runc://"));
    let ck = c.mark_ready(name, &manifest).await;
    (ck, manifest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn checkpoint_then_restore_through_the_agent() {
    let mut c = Cluster::start().await;
    let (ck, manifest) = checkpointed(&c, "worker", 32).await;
    let source_pod = c.job_pod(&names::job_name("worker")).await;
    let events = c.events(&source_pod.name_any()).await;
    assert!(
        events.iter().any(|(r, _)| r == "Checkpointed"),
        "{events:?}"
    );
    let metrics = c.metrics();
    assert!(
        metrics.contains(
            "warmstart_agent_operations_total{operation=\"checkpoint\",result=\"success\"} 1"
        ),
        "{metrics}"
    );
    // The capture's progress reached its Checkpoint (the agent's merge patch of its status,
    // within its RBAC), and its share of the progress gauges went back once it ended.
    let progress = ck
        .status
        .as_ref()
        .and_then(|s| s.progress.clone())
        .unwrap_or_else(|| {
            panic!(
                "no progress on the Checkpoint: {:?}\n{}",
                ck.status,
                c.agent_log()
            )
        });
    assert!(
        ["dumping ", "hashing "]
            .iter()
            .any(|verb| progress.message.starts_with(verb))
            && progress.message.contains(" at ")
            && progress.bytes_done > 0
            && progress.bytes_total > 0,
        "{progress:?}"
    );
    assert!(progress.updated_at.is_some(), "{progress:?}");
    // The engine's own lines carry the pod and namespace of the operation (journal fields
    // POD, NAMESPACE, CHECKPOINT_HASH where the journal is written).
    let log = c.agent_log();
    let pod_name = source_pod.name_any();
    let dump = log
        .lines()
        .find(|l| l.contains("dump starting"))
        .unwrap_or_else(|| panic!("no dump line:\n{log}"));
    assert!(
        dump.contains(&format!("pod={pod_name}"))
            && dump.contains(&format!("namespace={NS}"))
            && dump.contains("checkpoint.hash="),
        "{dump}"
    );
    for gauge in [
        "warmstart_agent_operation_bytes_done{operation=\"checkpoint\"} 0",
        "warmstart_agent_operation_bytes_total{operation=\"checkpoint\"} 0",
    ] {
        assert!(metrics.contains(gauge), "{gauge} missing from:\n{metrics}");
    }

    c.restore_pod("replica", &ck, None).await;
    let pod = c.restore_status("replica", "completed").await;
    let state = c.restored_state("replica").await;
    assert_eq!(state["weightsMib"], json!(32));
    assert!(
        c.control_dir(&pod)
            .join(names::FILE_RESTORE_COMPLETE)
            .exists()
    );
    let events = c.events("replica").await;
    assert!(events.iter().any(|(r, _)| r == "Restored"), "{events:?}");
    let log = c.agent_log();
    let restored = log
        .lines()
        .find(|l| l.contains("page images verified"))
        .unwrap_or_else(|| panic!("no restore line:\n{log}"));
    assert!(
        restored.contains("pod=replica")
            && restored.contains(&format!("namespace={NS}"))
            && restored.contains(&format!(
                "checkpoint.hash={}",
                ck.status
                    .as_ref()
                    .unwrap()
                    .identity_hash
                    .as_deref()
                    .unwrap()
            )),
        "{restored}"
    );
    assert!(manifest.files.iter().any(|f| f.path.starts_with("criu/")));

    // SIGTERM: the agent stops cleanly and takes its label off the node.
    let status = c.stop_agent();
    assert!(status.success(), "{status:?}\n{}", c.agent_log());
    let nodes: Api<Node> = Api::all(c.client());
    let node = nodes.get(NODE).await.unwrap();
    assert_eq!(node.labels().get(names::LABEL_AGENT_READY), None);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_restores_leave_nothing_restored_and_say_why() {
    let c = Cluster::start().await;
    let (ck, _) = checkpointed(&c, "worker", 16).await;

    // A binding of another incarnation: stale.
    let mut stale = Binding::for_checkpoint(&ck).unwrap();
    stale.uid = "00000000-0000-0000-0000-000000000000".into();
    let pod = c.restore_pod("stale", &ck, Some(stale.to_string())).await;
    c.restore_status("stale", "failed").await;
    let failed: RestoreFailed = serde_json::from_slice(
        &std::fs::read(c.control_dir(&pod).join(names::FILE_RESTORE_FAILED)).unwrap(),
    )
    .unwrap();
    assert!(failed.reason.contains("stale"), "{failed:?}");
    assert!(
        !c.control_dir(&pod)
            .join(names::FILE_RESTORE_COMPLETE)
            .exists()
    );
    let events = c.events("stale").await;
    assert!(
        events
            .iter()
            .any(|(r, m)| r == "RestoreFailed" && m.contains("uid")),
        "{events:?}"
    );

    // A tampered artifact: one byte of a page image changed.
    let layout = c.layout(&ck.status.as_ref().unwrap().identity_hash.clone().unwrap());
    let pages = std::fs::read_dir(layout.dir().join("criu"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("pages-")
        })
        .unwrap();
    let mut bytes = std::fs::read(&pages).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&pages, &bytes).unwrap();
    let pod = c.restore_pod("tampered", &ck, None).await;
    c.restore_status("tampered", "failed").await;
    let failed: RestoreFailed = serde_json::from_slice(
        &std::fs::read(c.control_dir(&pod).join(names::FILE_RESTORE_FAILED)).unwrap(),
    )
    .unwrap();
    assert!(failed.reason.contains("sha256"), "{failed:?}");
    let container = c.node().container(NS, "tampered", "main").unwrap();
    let ps = container.exec_ok(["ps"]).unwrap();
    assert!(
        !ps.contains("warmstart-sample-worker"),
        "something was restored:\n{ps}"
    );
    // Both pods fall back to a cold start, counted by why.
    let metrics = c.metrics();
    for counted in [
        "warmstart_agent_restore_fallbacks_total{reason=\"refused\"} 1",
        "warmstart_agent_restore_fallbacks_total{reason=\"failed\"} 1",
    ] {
        assert!(
            metrics.contains(counted),
            "{counted} missing from:\n{metrics}"
        );
    }
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ready_file_in_a_pod_that_is_no_checkpoint_source_is_ignored() {
    let c = Cluster::start().await;
    // A pod that writes `ready` into an emptyDir named like the signal volume, unlabelled.
    let pods: Api<Pod> = Api::namespaced(c.client(), NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "spoof", "namespace": NS,
                     "labels": {names::LABEL_CHECKPOINT_HASH: "0123456789abcdef"}},
        "spec": {"containers": [{"name": "main", "image": "busybox",
            "command": ["sh", "-c", "touch /checkpoint-signal/ready; sleep 100000"],
            "volumeMounts": [{"name": names::VOLUME_SIGNAL, "mountPath": names::MOUNT_SIGNAL}]}],
            "volumes": [{"name": names::VOLUME_SIGNAL, "emptyDir": {}}]}
    }))
    .unwrap();
    let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
    let dir = c.signal_dir(&pod);
    wait_for("the spoofed ready file", WAIT, || async {
        dir.join(names::FILE_READY).exists().then_some(())
    })
    .await;
    // A few resyncs later: nothing checkpointed, nothing written.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from(names::FILE_READY)]);
    assert!(
        std::fs::read_dir(c.artifacts.path())
            .unwrap()
            .next()
            .is_none()
    );
    assert!(
        c.metrics()
            .contains("warmstart_agent_operations_in_flight{operation=\"checkpoint\"} 0")
    );
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_restores_all_complete() {
    let c = Cluster::start().await;
    let (ck, _) = checkpointed(&c, "worker", 8).await;
    let count = std::env::var("WARMSTART_TEST_CONCURRENT_RESTORES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let started = Instant::now();
    for i in 0..count {
        c.restore_pod(&format!("replica-{i}"), &ck, None).await;
    }
    for i in 0..count {
        c.restore_status(&format!("replica-{i}"), "completed").await;
    }
    eprintln!(
        "{count} restores completed in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    for i in 0..count {
        c.restored_state(&format!("replica-{i}")).await;
    }
    c.stop().await;
}

/// Waits until the agent journals an operation of `kind` (`checkpoint` or a container name).
async fn wait_journal(c: &Cluster, kind: &str) {
    let dir = c.agent_state.path().join("journal");
    wait_for(&format!("a journalled {kind} operation"), WAIT, || async {
        std::fs::read_dir(&dir)
            .ok()?
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .ends_with(&format!(".{kind}.json"))
            })
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_mid_checkpoint_reports_it_and_the_job_still_completes() {
    let mut c = Cluster::start().await;
    let (_, hash) = c.checkpoint("big", 256).await;
    wait_journal(&c, "checkpoint").await;
    c.kill_agent();
    let first = c.job_pod(&names::job_name("big")).await;
    c.start_agent();
    c.wait_agent_ready().await;
    let job = c.wait_job(&names::job_name("big"), "Complete").await;
    let done: DoneSignal = serde_json::from_slice(
        &std::fs::read(c.signal_dir(&first).join(names::done_file_name(&hash))).unwrap(),
    )
    .unwrap();
    if done.success {
        assert_eq!(job.status.as_ref().unwrap().failed.unwrap_or(0), 0);
    } else {
        assert!(
            done.error
                .as_deref()
                .unwrap_or_default()
                .contains("restarted"),
            "{done:?}"
        );
        assert!(job.status.as_ref().unwrap().failed.unwrap_or(0) >= 1);
    }
    // One complete artifact, no leftovers beside it.
    let manifest = read_published(&c.layout(&hash).dir(), Verification::Checksums).unwrap();
    assert_eq!(manifest.identity_hash, hash);
    let leftovers: Vec<_> = std::fs::read_dir(c.layout(&hash).namespace_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != &hash)
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_mid_restore_never_restores_twice() {
    let mut c = Cluster::start().await;
    let (ck, _) = checkpointed(&c, "worker", 256).await;
    c.restore_pod("replica", &ck, None).await;
    wait_journal(&c, "main").await;
    c.kill_agent();
    c.start_agent();
    c.wait_agent_ready().await;
    let pods: Api<Pod> = Api::namespaced(c.client(), NS);
    let key = names::restore_status_annotation("main");
    let pod = wait_for("a final restore status", WAIT, || async {
        let p = pods.get("replica").await.unwrap();
        matches!(
            p.annotations().get(&key).map(String::as_str),
            Some("completed" | "failed")
        )
        .then_some(p)
    })
    .await;
    let container = c.node().container(NS, "replica", "main").unwrap();
    let ps = container.exec_ok(["ps"]).unwrap();
    let workers = ps.matches("warmstart-sample-worker").count();
    match pod.annotations()[&key].as_str() {
        "completed" => {
            assert_eq!(workers, 1, "{ps}");
            c.restored_state("replica").await;
        }
        _ => {
            assert_eq!(workers, 0, "a failed restore left a worker:\n{ps}");
            assert!(
                c.control_dir(&pod)
                    .join(names::FILE_RESTORE_FAILED)
                    .exists()
            );
        }
    }
    // Later resyncs change nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ps = container.exec_ok(["ps"]).unwrap();
    assert_eq!(
        ps.matches("warmstart-sample-worker").count(),
        workers,
        "{ps}"
    );
    c.stop().await;
}

/// An agent SIGKILLed while it holds the GPU state of a checkpoint Job's workload (locked and
/// being checkpointed through the CUDA stand-in) gives that state back when it restarts: the
/// workload's CUDA processes are running again, not left frozen, and the pod's Events say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_gives_back_gpu_state_an_interrupted_checkpoint_held() {
    let gpu = GpuNode::start(12080, &[SimGpu::numbered(0, 80 << 30)]).unwrap();
    std::fs::create_dir(gpu.dir().join("reports")).unwrap();
    // Each checkpoint call takes 3 s: long enough to kill the agent during one.
    gpu.set_faults(&json!({"transferDelayMs": 3000})).unwrap();
    let mut c = Cluster::start_with(Some(&gpu)).await;
    let dir = gpu.dir().display().to_string();
    let report = format!("{dir}/reports/job");
    let pod_spec = json!({
        "containers": [{
            "name": "main", "image": "cuda",
            "command": [binaries::CUDA_WORKLOAD_IN_IMAGE, "--library",
                        gpu.library().display().to_string(), "--mib", "8",
                        "--piece-mib", "4", "--report", report.clone()],
            "volumeMounts": [{"name": "gpu", "mountPath": dir.clone()}]
        }],
        "volumes": [{"name": "gpu", "hostPath": {"path": dir.clone()}}]
    });
    c.checkpoint_of("gpu", &pod_spec).await;

    // Once the workload holds its GPU state, it says it is ready (as a worker does).
    let pod = c.job_pod(&names::job_name("gpu")).await;
    wait_for("the workload to be READY", WAIT, || async {
        std::fs::read_to_string(&report)
            .ok()
            .filter(|r| r.starts_with("READY"))
    })
    .await;
    let signal_dir = c.signal_dir(&pod);
    wait_for("the signal volume", WAIT, || async {
        signal_dir.is_dir().then_some(())
    })
    .await;
    std::fs::write(signal_dir.join(names::FILE_READY), b"").unwrap();

    // The agent locks the workload, then asks for its checkpoint: killed during it.
    let log = || c.agent_log();
    let locked = || {
        gpu.calls()
            .unwrap()
            .iter()
            .any(|r| r.call == "cuCheckpointProcessLock")
    };
    let deadline = Instant::now() + WAIT;
    let pods: Api<Pod> = Api::namespaced(c.client(), NS);
    while !locked() {
        if Instant::now() >= deadline {
            let listed = pods.list(&ListParams::default()).await.unwrap();
            let mut events = Vec::new();
            for p in &listed.items {
                events.extend(c.events(&p.name_any()).await);
            }
            panic!(
                "the agent never locked the workload:\n{}\npods: {:?}\nevents: {events:?}",
                log(),
                listed
                    .items
                    .iter()
                    .map(|p| (&p.metadata.name, &p.status))
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.kill_agent();
    let container = c.node().container(NS, &pod.name_any(), "main").unwrap();
    let state = |expected: &'static str| {
        let out = Command::new(binaries::agent().unwrap())
            .arg("--cuda-library")
            .arg(gpu.library())
            .args(["cuda", "state", "--json", "--pid"])
            .arg(container.pid().to_string())
            .output()
            .unwrap();
        let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        !list.is_empty() && list.iter().all(|p| p["state"] == expected)
    };
    wait_for(
        "the dead agent's checkpoint to leave the workload checkpointed",
        WAIT,
        || async { state("checkpointed").then_some(()) },
    )
    .await;

    c.start_agent();
    c.wait_agent_ready().await;
    wait_for(
        "the restarted agent to give the GPU state back",
        WAIT,
        || async { state("running").then_some(()) },
    )
    .await;
    let events = c.events(&pod.name_any()).await;
    assert!(
        events
            .iter()
            .any(|(reason, note)| reason == "GpuStateReleased"
                && note.contains("gave the GPU state")),
        "{events:?}\n{}",
        c.agent_log()
    );
    drop(container);
    c.stop().await;
}

/// The artifact a restore restores is the one its validation checked against the pod's
/// binding: another valid, sealed artifact put at its path between the agent's validation and
/// the restore is refused (the digests named), nothing is restored, and the pod is told to
/// cold start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_artifact_replaced_after_validation_is_refused_not_restored() {
    let mut c = Cluster::start().await;
    let (ck, manifest) = checkpointed(&c, "worker", 32).await;
    let (_, other) = checkpointed(&c, "other", 16).await;
    assert_ne!(manifest.digest, other.digest);
    c.kill_agent();
    c.fault = Some("restore-after-validation");
    c.start_agent();
    c.wait_agent_ready().await;

    let pod = c.restore_pod("replica", &ck, None).await;
    let paused = c.agent_state.path().join("fault-restore-after-validation");
    wait_for("the agent to validate the restore", WAIT, || async {
        paused.exists().then_some(())
    })
    .await;
    // Between validation and restore: the other Checkpoint's artifact takes this one's place.
    let validated = c.layout(&manifest.identity_hash).dir();
    let aside = validated.with_file_name(format!("{}-validated", manifest.identity_hash));
    std::fs::rename(&validated, &aside).unwrap();
    std::fs::rename(c.layout(&other.identity_hash).dir(), &validated).unwrap();
    std::fs::write(
        c.agent_state.path().join("resume-restore-after-validation"),
        b"",
    )
    .unwrap();

    let pods: Api<Pod> = Api::namespaced(c.client(), NS);
    let key = names::restore_status_annotation("main");
    let status = wait_for("a final restore status", WAIT, || async {
        let p = pods.get("replica").await.unwrap();
        p.annotations()
            .get(&key)
            .filter(|s| matches!(s.as_str(), "completed" | "failed"))
            .cloned()
    })
    .await;
    assert_eq!(status, "failed", "the replaced artifact was restored");
    let failed: RestoreFailed = serde_json::from_slice(
        &std::fs::read(c.control_dir(&pod).join(names::FILE_RESTORE_FAILED)).unwrap(),
    )
    .unwrap();
    assert!(
        failed.reason.contains("replaced")
            && failed.reason.contains(&manifest.digest)
            && failed.reason.contains(&other.digest),
        "{failed:?}"
    );
    assert!(
        !c.control_dir(&pod)
            .join(names::FILE_RESTORE_COMPLETE)
            .exists()
    );
    let container = c.node().container(NS, "replica", "main").unwrap();
    let ps = container.exec_ok(["ps"]).unwrap();
    assert!(
        !ps.contains("warmstart-sample-worker"),
        "something was restored:\n{ps}"
    );
    let events = c.events("replica").await;
    assert!(
        events
            .iter()
            .any(|(r, m)| r == "RestoreFailed" && m.contains("replaced")),
        "{events:?}"
    );
    // Counted as a failure of the artifact.
    let metrics = c.metrics();
    assert!(
        metrics
            .contains("warmstart_agent_failures_total{operation=\"restore\",cause=\"artifact\"} 1"),
        "{metrics}"
    );
    c.stop().await;
}

/// What a checkpoint Job captures is the target resolved when the Job was built: an edit of
/// the Checkpoint's `spec.job.targetContainerName` while the Job runs changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn editing_the_target_while_the_job_runs_does_not_change_what_is_captured() {
    let c = Cluster::start().await;
    let pod_spec = json!({"containers": [
        {"name": "main", "image": "worker",
         "command": [WORKER_IN_IMAGE, "--weights-mib", "8",
                     "--warmup-ms", "5000", "--port", PORT.to_string()]},
        {"name": "side", "image": "busybox", "command": ["sleep", "100000"]}
    ]});
    let (_, hash) = c.checkpoint_of("edited", &pod_spec).await;
    let checkpoints: Api<Checkpoint> = Api::namespaced(c.client(), NS);
    checkpoints
        .patch(
            "edited",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"job": {"targetContainerName": "side"}}})),
        )
        .await
        .unwrap();
    let job = names::job_name("edited");
    let pod = c.job_pod(&job).await;
    assert_eq!(
        pod.annotations()
            .get(names::ANNOTATION_CHECKPOINT_TARGET)
            .map(String::as_str),
        Some("main")
    );
    // The side container runs on: the capture's outcome is its done signal.
    let done_file = c.signal_dir(&pod).join(names::done_file_name(&hash));
    let done: DoneSignal = wait_for("the checkpoint's done signal", WAIT, || async {
        std::fs::read(&done_file)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
    })
    .await;
    assert!(done.success, "{done:?}\n{}", c.agent_log());
    let manifest = read_published(&c.layout(&hash).dir(), Verification::Checksums).unwrap();
    assert_eq!(manifest.source.container, "main");
    assert_eq!(manifest.source.pod, pod.name_any());
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restore_through_the_node_cache_restores_the_worker_from_the_local_copy() {
    let mut c = Cluster::start().await;
    let (ck, manifest) = checkpointed(&c, "worker", 16).await;
    // The agent restarted with a node cache.
    let cache = tempfile::tempdir().unwrap();
    c.kill_agent();
    c.cache = Some(cache.path().to_owned());
    c.start_agent();
    c.wait_agent_ready().await;

    c.restore_pod("replica", &ck, None).await;
    c.restore_status("replica", "completed").await;
    let state = c.restored_state("replica").await;
    assert_eq!(state["weightsMib"], json!(16));
    let copy = cache.path().join(NS).join(&manifest.identity_hash);
    let cached = read_published(&copy, Verification::Checksums).unwrap();
    assert_eq!(cached.digest, manifest.digest);
    let log = c.agent_log();
    assert!(log.contains("restoring from the node's cache"), "{log}");
    assert!(
        c.metrics()
            .contains("warmstart_agent_cache_reads_total{result=\"fetched\"} 1"),
        "{}",
        c.metrics()
    );
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_goes_to_the_object_store_and_restores_from_it_without_the_volume_copy() {
    let server = warmstart_e2e::s3_server::S3Server::start("artifacts").unwrap();
    let store = warmstart_objstore::Store::new(server.store_config()).unwrap();
    let mut c = Cluster::start().await;
    let cache = tempfile::tempdir().unwrap();
    c.kill_agent();
    c.cache = Some(cache.path().to_owned());
    c.s3 = Some(vec![
        format!("--s3-endpoint={}", server.endpoint()),
        format!("--s3-bucket={}", server.bucket()),
        "--s3-prefix=warm".to_owned(),
        format!(
            "--s3-access-key-id-file={}",
            server.access_key_file().display()
        ),
        format!(
            "--s3-secret-access-key-file={}",
            server.secret_key_file().display()
        ),
    ]);
    c.start_agent();
    c.wait_agent_ready().await;

    let (ck, manifest) = checkpointed(&c, "worker", 16).await;
    // In the bucket, complete, before the checkpoint was reported done.
    let stored = store.verify(NS, &manifest.identity_hash).await.unwrap();
    assert_eq!(stored.digest, manifest.digest);
    // The volume's copy gone (as on a node that does not mount it): the restore reads the
    // bucket through the node's cache.
    let local = c.layout(&manifest.identity_hash).dir();
    std::fs::remove_dir_all(&local).unwrap();
    c.restore_pod("replica", &ck, None).await;
    c.restore_status("replica", "completed").await;
    let state = c.restored_state("replica").await;
    assert_eq!(state["weightsMib"], json!(16));
    let cached = cache.path().join(NS).join(&manifest.identity_hash);
    assert_eq!(
        read_published(&cached, Verification::Checksums)
            .unwrap()
            .digest,
        manifest.digest
    );
    let log = c.agent_log();
    assert!(
        log.contains("artifact uploaded to the object store"),
        "{log}"
    );
    assert!(
        !log.contains(&server.secret().to_string()),
        "the secret is never logged"
    );
    c.stop().await;
    drop(server);
}
