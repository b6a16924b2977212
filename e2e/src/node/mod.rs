//! A simulated Kubernetes node for end-to-end tests against a real API server (the tests'
//! [`ControlPlane`](crate::control_plane::ControlPlane), whose controller-manager runs the Jobs):
//! pods become real runc containers on this machine, or, with
//! [`NodeConfig::cri`], real containers of a containerd driven over CRI as kubelet drives it
//! (`containerd://` ids; sandboxes, containers, exits, `ExecSync` probes, logs in kubelet's
//! `/var/log/pods` layout under [`NodeConfig::pod_logs_dir`]: see `cri.rs`). What follows
//! describes the runc backend; the CRI backend differs where containerd does the work (the pod
//! sandbox instead of a pause container, its own network namespace from the test containerd's
//! loopback CNI plugin, containerd's own overlay).
//!
//! [`SimNode::start`] registers a `Node`, binds pending pods to itself (a one-node scheduler),
//! and runs each pod bound to it like a kubelet:
//!
//! - **Sandbox**: a pause container (`sleep` from [`NodeConfig::pause_image`]) holds the pod's
//!   network namespace; every container of the pod joins it
//!   ([`Network::Join`](crate::fixture::Network::Join)), so they share
//!   `localhost`. That namespace has only a loopback interface: `status.podIP` (and `hostIP`) is
//!   `127.0.0.1` ([`POD_IP`]), reachable from inside the pod only. `hostNetwork: true` pods use
//!   the host's namespace and get no pause container. IPC and PID namespaces are not shared.
//! - **Containers**: one runc container per container, its own overlay root over the image
//!   directory ([`NodeImages`]): `command` + `args` (or `args` alone: images carry no entrypoint),
//!   with `$(VAR)` expansion; `env` and `envFrom` (ConfigMap and Secret keys, Downward API
//!   `fieldRef`s: `metadata.name`, `.namespace`, `.uid`, `.labels['k']`, `.annotations['k']`,
//!   `spec.nodeName`, `spec.serviceAccountName`, `status.podIP`, `status.hostIP`); `workingDir`;
//!   `runAsUser`/`runAsGroup`, capabilities `add`/`drop`, `privileged`,
//!   `readOnlyRootFilesystem`. Init containers run first, in order.
//! - **Volumes**, each a host directory bind-mounted into the containers that mount it (with
//!   `readOnly`, `subPath` and `subPathExpr`, the sub-directory created as the kubelet does):
//!   `emptyDir` (`<state_dir>/pods/<uid>/volumes/kubernetes.io~empty-dir/<name>`, as the kubelet lays it out, also for `medium: Memory`:
//!   no tmpfs, no size limit); `hostPath` (`<host_root>/<path>`, [`NodeConfig::host_root`]: never
//!   the real host path, so tests do not write into this machine's `/var/lib`; `type` honoured;
//!   [`SimNode::host_path`] says where); `persistentVolumeClaim` (`<pvc_root>/<namespace>/<claim>`,
//!   created when missing, no PVC object needed); `configMap`, `secret`, `downwardAPI`,
//!   `projected` (ConfigMap, Secret, Downward API and placeholder service-account-token sources):
//!   files written by the node under `<state_dir>/pods/<uid>/volumes/`, mounted read-only, Downward
//!   API files rewritten when labels or annotations change.
//! - **Probes**: startup, liveness and readiness probes, `exec` (`runc exec`), `tcpSocket` and
//!   `httpGet` (into the pod's namespace), on their `initialDelaySeconds`/`periodSeconds` with
//!   their thresholds. A failed startup or liveness probe kills the container (SIGKILL).
//! - **Restarts**: `restartPolicy` `Always`, `OnFailure`, `Never`; an exited container's status
//!   is `terminated` with its exit code (the node is a child subreaper so it learns exit codes);
//!   restarts count in `restartCount` and `lastState`, the first at once, later ones after a
//!   doubling back-off ([`NodeConfig::restart_backoff`], shorter than the kubelet's 10 s).
//! - **Status**: `phase`, conditions (`PodScheduled`, `PodReadyToStartContainers`,
//!   `Initialized`, `ContainersReady`, `Ready`), `containerStatuses` and
//!   `initContainerStatuses` with `containerID: runc://<id>`, `podIP`, `hostIP`, `startTime`.
//! - **Deletion**: a pod with `deletionTimestamp` gets SIGTERM, then within its grace period is
//!   removed (SIGKILL, `runc delete`, overlay, state), and its object is deleted with grace
//!   period 0, as the kubelet does; a pod deleted outright is removed at once.
//! - **Events**: `Scheduled`, `Pulled`, `Created`, `Started`, `Killing`, `Unhealthy`, `BackOff`,
//!   `Failed`, `FailedMount` (core/v1 Events).
//!
//! Not supported: image pulls, image configuration, resource limits and requests (no cgroup
//! limits; `resourceFieldRef`), `preStop`/`postStart` hooks, sidecar init containers, ephemeral
//! containers, `terminationMessagePath`, `/etc/hosts` and `/etc/resolv.conf` management, seccomp
//! and AppArmor profiles, `shareProcessNamespace`, gRPC and HTTPS probes, taints, tolerations and
//! affinity (binding honours `nodeSelector`, `schedulerName` and scheduling gates only; a failed binding is not
//! retried), node leases, `kubectl exec` and, with runc, `kubectl logs` (use
//! [`SimNode::container`] and [`SimNode::container_log`] instead).
//!
//! # Why a simulated node and not a kubelet
//! The API server, admission, RBAC, the Job controller and garbage collection are the real
//! ones; the node stays simulated because a real kubelet cannot give the tests what they need:
//! - **The live container in the test's hands.** [`SimNode::container`] gives the running
//!   container of a pod (its PID, `exec`, HTTP into its network namespace, its log), so a test
//!   can inspect the restored process tree, kill the agent at a fault point and check that
//!   nothing was restored twice; through a kubelet the test would only see the API's view.
//! - **Pods as plain runc containers** (`runc://` ids under a runc root the test owns), the
//!   agent's runc path, next to the containerd-over-CRI path; a kubelet drives only CRI.
//! - **One node per test, side by side, in a temporary directory**: a kubelet wants root-wide
//!   state (`/var/lib/kubelet`, port 10250, its cgroup root, a CNI bridge), one per machine or
//!   per mount namespace, and `make cluster-up` already runs two (the real-cluster test,
//!   `e2e/tests/real_cluster.rs`).
//!   hostPath volumes land under [`NodeConfig::host_root`], never in this machine's `/var/lib`.
//! - **Speed**: pods start in milliseconds and restart after [`NodeConfig::restart_backoff`]
//!   instead of the kubelet's 10 s floor and sync periods, so fault-injection tests stay short.

mod container;
mod cri;
mod env;
mod error;
mod events;
mod images;
mod pod;
mod probe;
mod spec;
mod volumes;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    Binding, Node, NodeAddress, NodeCondition, NodeStatus, NodeSystemInfo, ObjectReference, Pod,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::fixture::{Runtime, become_child_subreaper};

pub use container::NodeContainer;
pub use cri::{CriConfig, CriContainer};
pub use error::NodeError;
pub use images::NodeImages;

use error::{Context, is_conflict};
use events::{EventType, Recorder};
use pod::{NodeCtx, PodMsg};

/// The address of every simulated pod (`status.podIP`) and node (`InternalIP`, `hostIP`): each
/// pod's network namespace has only its loopback interface.
pub const POD_IP: &str = "127.0.0.1";

/// The label every simulated node carries (value `true`).
pub const SIMULATED_LABEL: &str = "warmstart.dev/simulated-node";

/// How a simulated node is set up. [`NodeConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's name (and `kubernetes.io/hostname` label).
    pub name: String,
    /// Where images come from.
    pub images: NodeImages,
    /// The node's own state: `runtime/` (runc root and container state, see
    /// [`Runtime`]) and `pods/<uid>/` (volumes). Must not contain `,` or `:` (overlay options).
    pub state_dir: PathBuf,
    /// Stands in for the host's `/` for `hostPath` volumes: `hostPath: /var/lib/x` is
    /// `<host_root>/var/lib/x`, so tests never write into the machine's real directories.
    /// Default `<state_dir>/host`.
    pub host_root: PathBuf,
    /// Holds one directory per PersistentVolumeClaim: `<pvc_root>/<namespace>/<claim>`. Default
    /// `<state_dir>/pvcs`.
    pub pvc_root: PathBuf,
    /// Extra node labels.
    pub labels: BTreeMap<String, String>,
    /// Extra capacity (and allocatable), for example `nvidia.com/gpu: 1`.
    pub capacity: BTreeMap<String, String>,
    /// Whether the node binds pending pods (no `nodeName`, default scheduler, `nodeSelector`
    /// matching its labels) to itself. Default true.
    pub bind_pending_pods: bool,
    /// The image reference of pause containers. Default `busybox`.
    pub pause_image: String,
    /// How often each pod's containers are looked at. Default 100 ms.
    pub tick: Duration,
    /// The delay of a container's second restart, doubling for each one after. Default 1 s.
    pub restart_backoff: Duration,
    /// The longest restart delay. Default 30 s.
    pub max_restart_backoff: Duration,
    /// How often the node's `Ready` condition is renewed. Default 10 s.
    pub heartbeat: Duration,
    /// The runc binary. Default `runc` from `PATH`.
    pub runc: Option<PathBuf>,
    /// Run pods through this containerd over CRI instead of runc. Default none (runc).
    pub cri: Option<CriConfig>,
}

impl NodeConfig {
    /// Where a node keeping its state in `state_dir` logs its pods' containers when it runs them
    /// through containerd: kubelet's `/var/log/pods` layout,
    /// `<dir>/<namespace>_<pod>_<uid>/<container>/<restart>.log` (CRI format).
    #[must_use]
    pub fn pod_logs_dir(state_dir: &std::path::Path) -> PathBuf {
        state_dir.join("logs")
    }

    /// The defaults for node `name` with `images`, keeping its state in `state_dir`.
    pub fn new(name: impl Into<String>, images: NodeImages, state_dir: impl Into<PathBuf>) -> Self {
        let state_dir = state_dir.into();
        Self {
            name: name.into(),
            images,
            host_root: state_dir.join("host"),
            pvc_root: state_dir.join("pvcs"),
            state_dir,
            labels: BTreeMap::new(),
            capacity: BTreeMap::new(),
            bind_pending_pods: true,
            pause_image: "busybox".to_owned(),
            tick: Duration::from_millis(100),
            restart_backoff: Duration::from_secs(1),
            max_restart_backoff: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            runc: None,
            cri: None,
        }
    }
}

/// A running simulated node. Call [`SimNode::shutdown`] at the end: it stops the node and
/// removes every container it started. Dropping it instead only asks the node to stop; what
/// the node's tasks do not finish before the async runtime ends is removed by the containers'
/// own `Drop` (and stale state by the fixture's next run).
#[derive(Debug)]
pub struct SimNode {
    ctx: Arc<NodeCtx>,
    stop: watch::Sender<bool>,
    pods_task: Option<JoinHandle<Result<(), NodeError>>>,
    heartbeat_task: Option<JoinHandle<()>>,
}

impl SimNode {
    /// Registers node `config.name` (created, or its labels and status updated when it exists),
    /// makes this process a child subreaper (to learn containers' exit codes), and starts
    /// watching pods. Must be called inside a multi-threaded tokio runtime.
    ///
    /// # Errors
    /// The pause image does not resolve, the state directories cannot be created, or the Node
    /// cannot be registered.
    pub async fn start(client: Client, config: NodeConfig) -> Result<Self, NodeError> {
        become_child_subreaper().ctx(|| format!("node {}: start", config.name))?;
        let pause_image = config.images.resolve(&config.pause_image)?;
        let pods_dir = config.state_dir.join("pods");
        for dir in [&pods_dir, &config.host_root, &config.pvc_root] {
            fs::create_dir_all(dir).ctx(|| format!("create {}", dir.display()))?;
        }
        let mut runtime = Runtime::new(config.state_dir.join("runtime"));
        if let Some(runc) = &config.runc {
            runtime = runtime.with_runc_binary(runc);
        }
        let cri = match config.cri.clone() {
            Some(cri) => Some(
                cri::CriNode::connect(cri, &config.state_dir, &pause_image)
                    .await
                    .ctx(|| format!("node {}: connect to containerd", config.name))?,
            ),
            None => None,
        };
        let ctx = Arc::new(NodeCtx {
            cri,
            recorder: Recorder::new(client.clone(), "kubelet", Some(&config.name)),
            client: client.clone(),
            node_name: config.name.clone(),
            runtime,
            images: config.images.clone(),
            pause_image,
            pods_dir,
            host_root: config.host_root.clone(),
            pvc_root: config.pvc_root.clone(),
            tick: config.tick,
            restart_backoff: config.restart_backoff,
            max_restart_backoff: config.max_restart_backoff,
            ip: POD_IP.to_owned(),
            registry: std::sync::Mutex::new(BTreeMap::new()),
        });
        let labels = node_labels(&config);
        register_node(&client, &config, &labels).await?;
        let (stop, stopped) = watch::channel(false);
        let pods_task = tokio::spawn(watch_pods(
            Arc::clone(&ctx),
            config.bind_pending_pods.then_some(labels),
            stopped.clone(),
        ));
        let heartbeat_task = tokio::spawn(heartbeat(
            client,
            config.name.clone(),
            config.heartbeat,
            stopped,
        ));
        Ok(Self {
            ctx,
            stop,
            pods_task: Some(pods_task),
            heartbeat_task: Some(heartbeat_task),
        })
    }

    /// The node's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.ctx.node_name
    }

    /// The runc runtime of the node's containers (`runtime().runc_root()` is what a
    /// `runc://<id>` container id is resolved under).
    #[must_use]
    pub fn runtime(&self) -> &Runtime {
        &self.ctx.runtime
    }

    /// Where `hostPath` `path` of a pod is on this machine.
    ///
    /// # Errors
    /// `path` is not absolute or contains `..`.
    pub fn host_path(&self, path: &str) -> Result<PathBuf, NodeError> {
        volumes::host_path(&self.ctx.host_root, path).map_err(NodeError::Invalid)
    }

    /// Where PersistentVolumeClaim `claim` of `namespace` is on this machine.
    #[must_use]
    pub fn pvc_path(&self, namespace: &str, claim: &str) -> PathBuf {
        self.ctx.pvc_root.join(namespace).join(claim)
    }

    /// The current container of `container` in pod `namespace/pod` (also a stopped one whose
    /// pod has not been deleted): exec into it, read its log, find its PID or root. Do not hold
    /// it across the pod's deletion: its overlay and state directory are removed only when the
    /// last holder drops it.
    #[must_use]
    pub fn container(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Option<Arc<NodeContainer>> {
        let registry = self
            .ctx
            .registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        registry
            .get(&(namespace.to_owned(), pod.to_owned(), container.to_owned()))
            .cloned()
    }

    /// What the current container of `container` in pod `namespace/pod` wrote so far.
    #[must_use]
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> Option<String> {
        self.container(namespace, pod, container)
            .map(|c| c.read_log())
    }

    /// Stops the node: stops watching, removes every container and pod directory (touching no
    /// pod in the API), and marks the Node not ready.
    ///
    /// # Errors
    /// A [`NodeError::Cleanup`] listing what could not be removed, or a failed task.
    pub async fn shutdown(mut self) -> Result<(), NodeError> {
        let _ = self.stop.send(true);
        let mut result = Ok(());
        if let Some(task) = self.pods_task.take() {
            result = task
                .await
                .ctx(|| format!("node {}: the pod task", self.ctx.node_name))
                .and_then(|r| r);
        }
        if let Some(task) = self.heartbeat_task.take() {
            let _ = task.await;
        }
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        let patch = json!({"status": {"conditions": [ready_condition(false)]}});
        if let Err(e) = api
            .patch_status(
                &self.ctx.node_name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            tracing::debug!(node = %self.ctx.node_name, "mark the node not ready: {e}");
        }
        result
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The node's labels: `kubernetes.io/hostname`, `kubernetes.io/os`, `kubernetes.io/arch`,
/// [`SIMULATED_LABEL`], then the configured ones.
fn node_labels(config: &NodeConfig) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_owned(), config.name.clone()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), arch().to_owned()),
        (SIMULATED_LABEL.to_owned(), "true".to_owned()),
    ]);
    labels.extend(config.labels.clone());
    labels
}

/// The architecture in Kubernetes' (Go's) spelling.
fn arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

fn ready_condition(ready: bool) -> NodeCondition {
    let now = Time(jiff::Timestamp::now());
    NodeCondition {
        type_: "Ready".to_owned(),
        status: if ready { "True" } else { "Unknown" }.to_owned(),
        reason: Some(
            if ready {
                "KubeletReady"
            } else {
                "NodeStatusUnknown"
            }
            .to_owned(),
        ),
        message: Some(
            if ready {
                "kubelet is posting ready status (warmstart node simulator)"
            } else {
                "the node simulator stopped"
            }
            .to_owned(),
        ),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now),
    }
}

fn node_status(config: &NodeConfig) -> NodeStatus {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let memory_kib = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(8 << 20);
    let mut capacity = BTreeMap::from([
        ("cpu".to_owned(), Quantity(cpus.to_string())),
        ("memory".to_owned(), Quantity(format!("{memory_kib}Ki"))),
        ("pods".to_owned(), Quantity("110".to_owned())),
        ("ephemeral-storage".to_owned(), Quantity("100Gi".to_owned())),
    ]);
    for (name, value) in &config.capacity {
        capacity.insert(name.clone(), Quantity(value.clone()));
    }
    let condition = |kind: &str, reason: &str| NodeCondition {
        type_: kind.to_owned(),
        status: "False".to_owned(),
        reason: Some(reason.to_owned()),
        ..ready_condition(true)
    };
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    NodeStatus {
        allocatable: Some(capacity.clone()),
        capacity: Some(capacity),
        conditions: Some(vec![
            condition("MemoryPressure", "KubeletHasSufficientMemory"),
            condition("DiskPressure", "KubeletHasNoDiskPressure"),
            condition("PIDPressure", "KubeletHasSufficientPID"),
            ready_condition(true),
        ]),
        addresses: Some(vec![
            NodeAddress {
                type_: "InternalIP".to_owned(),
                address: POD_IP.to_owned(),
            },
            NodeAddress {
                type_: "Hostname".to_owned(),
                address: config.name.clone(),
            },
        ]),
        node_info: Some(NodeSystemInfo {
            architecture: arch().to_owned(),
            container_runtime_version: if config.cri.is_some() {
                "containerd://1.6"
            } else {
                "runc://1"
            }
            .to_owned(),
            kernel_version: kernel.trim().to_owned(),
            kubelet_version: "v1.33.0-warmstart-sim".to_owned(),
            operating_system: "linux".to_owned(),
            os_image: "warmstart node simulator".to_owned(),
            machine_id: config.name.clone(),
            system_uuid: config.name.clone(),
            boot_id: config.name.clone(),
            ..NodeSystemInfo::default()
        }),
        ..NodeStatus::default()
    }
}

/// Creates the Node (or updates its labels when it exists), then writes its status.
async fn register_node(
    client: &Client,
    config: &NodeConfig,
    labels: &BTreeMap<String, String>,
) -> Result<(), NodeError> {
    let api: Api<Node> = Api::all(client.clone());
    let status = node_status(config);
    let node = Node {
        metadata: ObjectMeta {
            name: Some(config.name.clone()),
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        },
        status: Some(status.clone()),
        ..Node::default()
    };
    match api.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(e) if is_conflict(&e) => {
            let patch = json!({"metadata": {"labels": labels}});
            api.patch(&config.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .ctx(|| format!("update the labels of node {}", config.name))?;
        }
        Err(e) => return Err(e).ctx(|| format!("register node {}", config.name)),
    }
    let patch = json!({"status": status});
    api.patch_status(&config.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .ctx(|| format!("write the status of node {}", config.name))?;
    Ok(())
}

/// Renews the node's `Ready` condition every `period` until stopped.
async fn heartbeat(
    client: Client,
    name: String,
    period: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let api: Api<Node> = Api::all(client);
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            () = tokio::time::sleep(period) => {}
        }
        let patch = json!({"status": {"conditions": [ready_condition(true)]}});
        if let Err(e) = api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::debug!(node = %name, "heartbeat: {e}");
        }
    }
}

/// A pod task and its mailbox.
struct Worker {
    tx: mpsc::UnboundedSender<PodMsg>,
    task: JoinHandle<Result<(), NodeError>>,
}

/// The node's main loop: watches all pods, binds pending ones (when `bind_labels` is given, the
/// node's labels), and hands pods bound to this node to their tasks.
async fn watch_pods(
    ctx: Arc<NodeCtx>,
    bind_labels: Option<BTreeMap<String, String>>,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), NodeError> {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let mut stream = pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    let mut workers: HashMap<String, Worker> = HashMap::new();
    let mut ended: HashSet<String> = HashSet::new();
    let mut binding: HashSet<String> = HashSet::new();
    let mut relist: Option<HashSet<String>> = None;
    let mut reap = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            _ = reap.tick() => reap_workers(&mut workers, &mut ended).await,
            event = stream.next() => {
                let Some(event) = event else { break };
                let event = match event {
                    Ok(event) => event,
                    Err(e) => {
                        tracing::warn!(node = %ctx.node_name, "pod watch: {e}");
                        continue;
                    }
                };
                match event {
                    Event::Init => relist = Some(HashSet::new()),
                    Event::InitApply(pod) => {
                        if let (Some(seen), Some(uid)) = (relist.as_mut(), pod.uid()) {
                            seen.insert(uid);
                        }
                        on_pod(&ctx, pod, bind_labels.as_ref(), &mut workers, &ended, &mut binding);
                    }
                    Event::InitDone => {
                        if let Some(seen) = relist.take() {
                            for (uid, worker) in &workers {
                                if !seen.contains(uid) {
                                    let _ = worker.tx.send(PodMsg::Deleted);
                                }
                            }
                        }
                    }
                    Event::Apply(pod) => {
                        on_pod(&ctx, pod, bind_labels.as_ref(), &mut workers, &ended, &mut binding);
                    }
                    Event::Delete(pod) => {
                        if let Some(worker) = pod.uid().and_then(|uid| workers.get(&uid)) {
                            let _ = worker.tx.send(PodMsg::Deleted);
                        }
                    }
                }
            }
        }
    }
    for worker in workers.values() {
        let _ = worker.tx.send(PodMsg::Shutdown);
    }
    let mut problems = Vec::new();
    for (uid, worker) in workers {
        match worker.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(e.to_string()),
            Err(e) => problems.push(format!("pod {uid}: its task failed: {e}")),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(NodeError::Cleanup {
            what: format!("node {}", ctx.node_name),
            problems,
        })
    }
}

/// Forgets pod tasks that ended (their pods were deleted), logging what their removal left.
async fn reap_workers(workers: &mut HashMap<String, Worker>, ended: &mut HashSet<String>) {
    let done: Vec<String> = workers
        .iter()
        .filter(|(_, w)| w.task.is_finished())
        .map(|(uid, _)| uid.clone())
        .collect();
    for uid in done {
        if let Some(worker) = workers.remove(&uid) {
            match worker.task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("{e}"),
                Err(e) => tracing::warn!(pod = %uid, "pod task failed: {e}"),
            }
            ended.insert(uid);
        }
    }
}

/// Routes a pod event: bind it, start its task, or pass it on to its task.
fn on_pod(
    ctx: &Arc<NodeCtx>,
    pod: Pod,
    bind_labels: Option<&BTreeMap<String, String>>,
    workers: &mut HashMap<String, Worker>,
    ended: &HashSet<String>,
    binding: &mut HashSet<String>,
) {
    let Some(uid) = pod.uid() else {
        return;
    };
    if ended.contains(&uid) {
        return;
    }
    let node_name = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    if node_name.is_empty() {
        if let Some(labels) = bind_labels
            && schedulable(&pod, labels)
            && binding.insert(uid)
        {
            tokio::spawn(bind(Arc::clone(ctx), pod));
        }
        return;
    }
    if node_name != ctx.node_name {
        return;
    }
    if let Some(worker) = workers.get(&uid) {
        let _ = worker.tx.send(PodMsg::Update(Box::new(pod)));
        return;
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    let finished = matches!(phase, Some("Succeeded" | "Failed"));
    if finished && pod.metadata.deletion_timestamp.is_none() {
        // Finished before this node saw it (an earlier node of the same name): nothing to run.
        return;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(pod::run(Arc::clone(ctx), pod, rx));
    workers.insert(uid, Worker { tx, task });
}

/// Whether this node would schedule `pod`: unbound, not being deleted, not finished, no
/// scheduling gates left, for the default scheduler, and its `nodeSelector` matches the node's
/// labels.
fn schedulable(pod: &Pod, labels: &BTreeMap<String, String>) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    let scheduler_ok = spec
        .scheduler_name
        .as_deref()
        .is_none_or(|s| s.is_empty() || s == "default-scheduler");
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(key, value)| labels.get(key) == Some(value));
    // A gated pod waits until its gates are removed, as with kube-scheduler.
    let ungated = spec.scheduling_gates.as_ref().is_none_or(Vec::is_empty);
    pod.metadata.deletion_timestamp.is_none() && !finished && ungated && scheduler_ok && selector_ok
}

/// Binds `pod` to the node (`pods/binding`), as the scheduler does, and records `Scheduled`.
async fn bind(ctx: Arc<NodeCtx>, pod: Pod) {
    let namespace = pod.namespace().unwrap_or_else(|| "default".to_owned());
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            uid: pod.uid(),
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(ctx.node_name.clone()),
            ..ObjectReference::default()
        },
    };
    let result: Result<serde_json::Value, kube::Error> = api
        .create_subresource("binding", &name, &PostParams::default(), &binding)
        .await;
    match result {
        Ok(_) => {
            let scheduler = Recorder::new(ctx.client.clone(), "default-scheduler", None);
            scheduler.emit(
                &pod,
                None,
                EventType::Normal,
                "Scheduled",
                format!(
                    "Successfully assigned {namespace}/{name} to {}",
                    ctx.node_name
                ),
            );
        }
        Err(e) => tracing::debug!(pod = %name, "bind to {}: {e}", ctx.node_name),
    }
}
