//! The whole loop on this machine, every program real but the kubelet: a real control plane
//! ([`ControlPlane`]: etcd, kube-apiserver, kube-controller-manager with its Job controller)
//! with warmstart installed from `deploy/` (the CRD, RBAC, the webhook configurations), a
//! simulated node running pods as runc containers or through a containerd of its own over CRI
//! ([`NodeRuntime`]), `warmstart-controller run` and `warmstart-agent run`, each with its
//! ServiceAccount's token. The workload namespace enforces Pod Security `baseline`. Used by the
//! whole-loop tests and by `make cluster-demo`; needs root, runc, containerd, CRIU (`make
//! setup`) and the Kubernetes binaries (`make k8s-build`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use warmstart_shared::names;
use warmstart_shared::v1alpha1::{Checkpoint, CheckpointPhase};

use crate::binaries;
use crate::cluster::{
    AgentSetup, Program, agent_kubeconfig, enforce_pod_security, free_addr, install_crd,
    install_rbac, install_webhooks, start_agent, start_controller,
};
use crate::control_plane::ControlPlane;
use crate::fixture::ImageStore;
use crate::fixture::containerd::Containerd;
use crate::node::{CriConfig, NodeConfig, NodeContainer, NodeImages, SimNode};

/// The namespace workloads run in.
pub const NAMESPACE: &str = "default";
/// The simulated node's name.
pub const NODE: &str = "gpu-sim-1";
/// The sample worker's port.
pub const PORT: u16 = 8000;
/// How long one step of the loop may take.
pub const WAIT: Duration = Duration::from_secs(120);
/// The image name the simulated node maps to the sample worker image.
pub const WORKER_IMAGE: &str = "worker";

/// How the simulated node runs pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRuntime {
    /// runc containers of the node's own (`runc://` ids): quick to start.
    Runc,
    /// A containerd of the cluster's own over CRI (`containerd://` ids), as kubelet runs pods:
    /// the agent resolves containers over CRI, its production path.
    Containerd,
}

/// A running local cluster. Stop it with [`LocalCluster::shutdown`], which waits until the node
/// has removed its containers; a cluster dropped without it still kills the controller and the
/// agent (their [`Program`]s) and tells the node to stop.
#[derive(Debug)]
pub struct LocalCluster {
    node: Option<SimNode>,
    /// `warmstart-controller run`.
    pub controller: Program,
    /// `warmstart-agent run`.
    pub agent: Program,
    /// Where artifacts are published.
    pub artifact_root: PathBuf,
    agent_setup: AgentSetup,
    agent_kubeconfig: PathBuf,
    logs_dir: PathBuf,
    _dirs: Vec<tempfile::TempDir>,
    _images: ImageStore,
    /// The control plane (dropped after the node and the programs that use it).
    pub plane: ControlPlane,
    // Declared last: dropped after everything that uses it.
    containerd: Option<Containerd>,
}

/// Polls `check` every `every` until it returns a value, for at most `timeout`.
///
/// # Errors
/// What `check` returned as an error, or a timeout naming `what` with `context()`.
pub async fn poll<T, F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    context: impl Fn() -> String,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out waiting for {what}\n{}", context());
        }
        tokio::time::sleep(every).await;
    }
}

/// The sample worker as a container of a pod: `weights_mib` of weights, `warmup_ms` of
/// warm-up, ready when it serves `/health`.
pub fn worker_container(weights_mib: u32, warmup_ms: u32) -> Value {
    json!({
        "name": "main", "image": WORKER_IMAGE,
        "command": [binaries::WORKER_IN_IMAGE, "--weights-mib", weights_mib.to_string(),
                    "--warmup-ms", warmup_ms.to_string(), "--port", PORT.to_string()],
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1}
    })
}

/// Whether `pod` has condition `Ready=True`.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

impl LocalCluster {
    /// Starts every part, the node over runc, and waits until the controller's webhook
    /// listens.
    ///
    /// # Errors
    /// When a part cannot start.
    pub async fn start() -> Result<Self> {
        Self::start_with(NodeRuntime::Runc).await
    }

    /// Starts every part, the node over `runtime`, and waits until the controller's webhook
    /// listens.
    ///
    /// # Errors
    /// When a part cannot start.
    pub async fn start_with(runtime: NodeRuntime) -> Result<Self> {
        let kubelet = tempfile::Builder::new()
            .prefix("warmstart-node-")
            .tempdir()
            .context("kubelet directory")?;
        let mut plane = ControlPlane::start()
            .await
            .context("start the control plane")?;
        let client = plane.client();
        install_crd(&mut plane, &[NAMESPACE]).await?;
        install_rbac(&mut plane).await?;
        // Checkpoint Jobs' pods and restore pods must pass Pod Security `baseline`: the
        // workload namespace enforces it, so a pod that needed more is refused by the API.
        enforce_pod_security(&client, NAMESPACE, "baseline").await?;
        let webhook = free_addr()?;
        install_webhooks(&plane, webhook).await?;
        let images = ImageStore::temporary()?;
        images.busybox()?;
        let worker = binaries::worker_image(&images)?;
        let artifacts = tempfile::tempdir().context("artifact directory")?;
        let state = tempfile::tempdir().context("agent state directory")?;
        let logs = tempfile::tempdir().context("log directory")?;
        // The entrypoint's image, as the controller's --entrypoint-image names it: the static
        // binary where the install init container copies it from.
        let entrypoint = images.get_or_build("warmstart-agent-image", |image| {
            image
                .add_file(
                    binaries::static_entrypoint()?,
                    names::ENTRYPOINT_IN_IMAGE,
                    0o755,
                )
                .map(|_| ())
        })?;
        let node_images = NodeImages::from_store(&images)
            .with_image(WORKER_IMAGE, worker)
            .with_image(warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE, entrypoint);
        let mut config = NodeConfig::new(NODE, node_images, kubelet.path());
        config.restart_backoff = Duration::from_millis(500);
        let containerd = (runtime == NodeRuntime::Containerd).then(Containerd::start);
        if let Some(containerd) = &containerd {
            config.cri = Some(CriConfig::for_containerd(containerd));
        }
        let node = SimNode::start(client.clone(), config)
            .await
            .context("start the simulated node")?;
        let controller = start_controller(&plane, logs.path(), artifacts.path(), webhook).await?;
        let agent_setup = AgentSetup {
            node: NODE.to_owned(),
            kubelet_root: kubelet.path().to_owned(),
            runc_root: node.runtime().runc_root(),
            artifact_root: artifacts.path().to_owned(),
            state_dir: state.path().to_owned(),
            containerd: containerd
                .as_ref()
                .map(|c| (c.socket.clone(), c.options().containerd_state_dir)),
        };
        let agent_kubeconfig = agent_kubeconfig(&plane, logs.path()).await?;
        let agent = start_agent(&agent_kubeconfig, logs.path(), &agent_setup)?;
        let cluster = Self {
            plane,
            node: Some(node),
            controller,
            agent,
            artifact_root: artifacts.path().to_owned(),
            agent_setup,
            agent_kubeconfig,
            logs_dir: logs.path().to_owned(),
            _dirs: vec![kubelet, artifacts, state, logs],
            _images: images,
            containerd,
        };
        poll(
            "the controller's webhook to listen",
            WAIT,
            Duration::from_millis(50),
            || cluster.logs(),
            || async { Ok(std::net::TcpStream::connect(webhook).is_ok().then_some(())) },
        )
        .await?;
        Ok(cluster)
    }

    /// The node's containerd, when its pods run there.
    pub fn containerd(&self) -> Option<&Containerd> {
        self.containerd.as_ref()
    }

    /// SIGKILLs the agent (what an OOM kill or a node problem does to the DaemonSet's pod).
    pub fn kill_agent(&mut self) {
        self.agent.kill();
    }

    /// Starts the agent again with the same node, directories and journal.
    ///
    /// # Errors
    /// When it cannot be started.
    pub fn restart_agent(&mut self) -> Result<()> {
        self.agent.kill();
        self.agent = start_agent(&self.agent_kubeconfig, &self.logs_dir, &self.agent_setup)?;
        Ok(())
    }

    /// Waits until the agent journals an operation of `kind` (`checkpoint`, or the container
    /// name of a restore): it is then in flight.
    ///
    /// # Errors
    /// When none shows up in time.
    pub async fn operation_in_flight(&self, kind: &str) -> Result<()> {
        let dir = self.agent_setup.state_dir.join("journal");
        let suffix = format!(".{kind}.json");
        poll(
            &format!("a journalled {kind} operation"),
            WAIT,
            Duration::from_millis(5),
            || self.logs(),
            || async {
                let found = std::fs::read_dir(&dir).ok().is_some_and(|entries| {
                    entries
                        .flatten()
                        .any(|e| e.file_name().to_string_lossy().ends_with(&suffix))
                });
                Ok(found.then_some(()))
            },
        )
        .await
    }

    /// Runs `kubectl` with `args` as the cluster admin; its stdout.
    ///
    /// # Errors
    /// kubectl is missing or fails (its stderr in the error).
    pub async fn kubectl(&self, args: &[&str]) -> Result<String> {
        let out = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.plane.kubeconfig())
            .args(args)
            .output()
            .await
            .context("run kubectl (make setup installs it)")?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The controller's and the agent's logs.
    pub fn logs(&self) -> String {
        format!(
            "controller log:\n{}\nagent log:\n{}",
            self.controller.log(),
            self.agent.log()
        )
    }

    /// The running container `main` of pod `pod` (while the node runs).
    pub fn container(&self, pod: &str) -> Option<Arc<NodeContainer>> {
        self.node.as_ref()?.container(NAMESPACE, pod, "main")
    }

    /// `GET /state` of the sample worker in pod `pod`, when it answers.
    pub fn worker_state(&self, pod: &str) -> Option<Value> {
        let container = self.container(pod)?;
        let (code, body) = container.http_get(PORT, "/state").ok()?;
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }

    /// Where the emptyDir volume `volume` of `pod` lies on the node, as kubelet lays it out.
    pub fn empty_dir(&self, pod: &Pod, volume: &str) -> Option<PathBuf> {
        Some(names::empty_dir_on_host(
            &self.agent_setup.kubelet_root,
            &pod.uid()?,
            volume,
        ))
    }

    /// Pods of the workload namespace.
    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.plane.client(), NAMESPACE)
    }

    /// Creates a Checkpoint `name` of `container` (`job_extra` merged into `spec.job`), its
    /// identity `model-<name>`.
    ///
    /// # Errors
    /// When the API (or the validating webhook) refuses it.
    pub async fn create_checkpoint(
        &self,
        name: &str,
        container: &Value,
        job_extra: &Value,
    ) -> Result<()> {
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.plane.client(), NAMESPACE);
        let mut job = json!({"podTemplateSpec": {"spec": {"containers": [container]}}});
        if let (Some(job), Some(extra)) = (job.as_object_mut(), job_extra.as_object()) {
            job.extend(extra.clone());
        }
        let ck: Checkpoint = serde_json::from_value(json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"identity": {"model": format!("model-{name}"), "backendFramework": "vllm"},
                     "job": job}
        }))
        .context("the Checkpoint")?;
        checkpoints
            .create(&PostParams::default(), &ck)
            .await
            .with_context(|| format!("create Checkpoint {name}"))?;
        Ok(())
    }

    /// [`Self::create_checkpoint`], then waits until it is Ready; the Checkpoint and how long
    /// that took.
    ///
    /// # Errors
    /// When it fails (with its status and the logs) or does not become Ready in time.
    pub async fn checkpoint(
        &self,
        name: &str,
        container: &Value,
        job_extra: &Value,
    ) -> Result<(Checkpoint, Duration)> {
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.plane.client(), NAMESPACE);
        let created = Instant::now();
        self.create_checkpoint(name, container, job_extra).await?;
        let ready = poll(
            &format!("Checkpoint {name} to become Ready"),
            WAIT,
            Duration::from_millis(100),
            || self.logs(),
            || async {
                let Ok(ck) = checkpoints.get(name).await else {
                    return Ok(None);
                };
                let Some(status) = ck.status.as_ref() else {
                    return Ok(None);
                };
                if status.phase == Some(CheckpointPhase::Failed) {
                    return Err(anyhow!(
                        "Checkpoint {name} failed: {status:?}\n{}",
                        self.logs()
                    ));
                }
                Ok((status.phase == Some(CheckpointPhase::Ready)).then_some(ck))
            },
        )
        .await?;
        Ok((ready, created.elapsed()))
    }

    /// The pod `name` of `container`; annotated to restore from `checkpoint` when given.
    pub fn pod(name: &str, checkpoint: Option<&str>, container: &Value) -> Result<Pod> {
        let annotations = checkpoint.map_or_else(
            || json!({}),
            |ck| {
                json!({
                    names::ANNOTATION_RESTORE_FROM: ck,
                    names::ANNOTATION_TARGET_CONTAINERS: "main",
                })
            },
        );
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": NAMESPACE, "annotations": annotations},
            "spec": {"containers": [container]}
        }))
        .context("the pod")
    }

    /// Creates a pod of `container` annotated to restore from `checkpoint`.
    ///
    /// # Errors
    /// When the API (or the webhook) refuses it.
    pub async fn restore_pod(
        &self,
        name: &str,
        checkpoint: &str,
        container: &Value,
    ) -> Result<Pod> {
        self.pods()
            .create(
                &PostParams::default(),
                &Self::pod(name, Some(checkpoint), container)?,
            )
            .await
            .with_context(|| format!("create restore pod {name}"))
    }

    /// Waits until the agent says the restore of `pod` completed and the pod is Ready.
    ///
    /// # Errors
    /// When the restore failed, or it does not happen in time.
    pub async fn restored_and_ready(&self, pod: &str) -> Result<()> {
        let pods = self.pods();
        let status_key = names::restore_status_annotation("main");
        poll(
            &format!("{pod} to be restored and Ready"),
            WAIT,
            Duration::from_millis(100),
            || self.logs(),
            || async {
                let Ok(p) = pods.get(pod).await else {
                    return Ok(None);
                };
                let status = p.annotations().get(&status_key).cloned();
                if status.as_deref() == Some("failed") {
                    return Err(anyhow!(
                        "restore of {pod} failed: {:?}\n{}",
                        p.annotations(),
                        self.logs()
                    ));
                }
                Ok((status.as_deref() == Some("completed") && is_ready(&p)).then_some(()))
            },
        )
        .await
    }

    /// Deletes the workload pods, kills the controller and the agent, stops the node (its
    /// containers removed). The control plane keeps serving (its audit log stays readable)
    /// until the cluster is dropped.
    ///
    /// # Errors
    /// When the node cannot stop cleanly.
    pub async fn shutdown(&mut self) -> Result<()> {
        let _ = self
            .pods()
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await;
        self.agent.kill();
        self.controller.kill();
        if let Some(node) = self.node.take() {
            node.shutdown().await.context("stop the simulated node")?;
        }
        Ok(())
    }
}
