//! One pod on the simulated node, driven by its own task: volumes, the sandbox (a pause
//! container holding the pod's network namespace), init containers in order, app containers,
//! probes, restarts with back-off, the pod's status, and its removal.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::join_all;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container as K8sContainer, ContainerState, ContainerStateRunning,
    ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, HostIP, Pod, PodCondition,
    PodIP, PodStatus, Secret,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::fixture::{ContainerExit, ContainerSpec, Image, Network, Runtime};

use super::container::NodeContainer;
use super::cri::{CriNode, CriSandbox};

use super::env::{PodFacts, Sources, container_env};
use super::error::{Context, NodeError, is_not_found};
use super::events::{EventType, Recorder};
use super::images::NodeImages;
use super::probe::{self, ProbeKind, ProbeState, Verdict};
use super::spec::{container_spec, pod_hostname};
use super::volumes::{self, PodVolumes, VolumeRoots};

/// The standby command of a pod's pause container (and of containerd's sandbox image).
pub(crate) const PAUSE_ARGS: [&str; 2] = ["/bin/sleep", "2147483647"];

/// What every pod task of a node shares.
pub(crate) struct NodeCtx {
    /// The API client.
    pub(crate) client: Client,
    /// The node's name.
    pub(crate) node_name: String,
    /// Where the node's runc containers live.
    pub(crate) runtime: Runtime,
    /// containerd over CRI, when the node runs its pods there instead of with runc.
    pub(crate) cri: Option<CriNode>,
    /// Image references to root filesystems.
    pub(crate) images: NodeImages,
    /// The image of pause containers.
    pub(crate) pause_image: Image,
    /// `<state dir>/pods`: one directory per pod UID.
    pub(crate) pods_dir: PathBuf,
    /// Stands in for the host's `/` for `hostPath` volumes.
    pub(crate) host_root: PathBuf,
    /// Holds PVC directories.
    pub(crate) pvc_root: PathBuf,
    /// How often a pod task looks at its containers.
    pub(crate) tick: Duration,
    /// The first restart delay after the immediate first restart.
    pub(crate) restart_backoff: Duration,
    /// The longest restart delay.
    pub(crate) max_restart_backoff: Duration,
    /// The kubelet's event recorder.
    pub(crate) recorder: Recorder,
    /// The address reported as every pod's `podIP` and the node's `hostIP`.
    pub(crate) ip: String,
    /// The containers currently known, by (namespace, pod, container).
    pub(crate) registry: Mutex<BTreeMap<(String, String, String), Arc<NodeContainer>>>,
}

impl std::fmt::Debug for NodeCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCtx")
            .field("node_name", &self.node_name)
            .field("runtime", &self.runtime)
            .field("pods_dir", &self.pods_dir)
            .finish_non_exhaustive()
    }
}

/// What the node's watch loop tells a pod task.
#[derive(Debug)]
pub(crate) enum PodMsg {
    /// The pod object changed.
    Update(Box<Pod>),
    /// The pod object is gone from the API.
    Deleted,
    /// The node shuts down: remove everything, touch nothing in the API.
    Shutdown,
}

/// How a pod task ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// `deletionTimestamp` is set: stop containers within the grace period, then delete the pod
    /// object with grace period 0, as the kubelet does.
    Graceful,
    /// The object is already gone: kill at once.
    Gone,
    /// The node shuts down.
    Shutdown,
}

/// Runs pod `pod` until it is deleted or the node shuts down; returns what its removal left
/// behind, if anything.
pub(crate) async fn run(
    ctx: Arc<NodeCtx>,
    pod: Pod,
    mut rx: UnboundedReceiver<PodMsg>,
) -> Result<(), NodeError> {
    let mut worker = PodWorker::new(ctx, pod);
    let mut interval = tokio::time::interval(worker.ctx.tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(PodMsg::Update(pod)) => worker.update(*pod),
                Some(PodMsg::Deleted) => return worker.terminate(Ending::Gone, &mut rx).await,
                Some(PodMsg::Shutdown) | None => {
                    return worker.terminate(Ending::Shutdown, &mut rx).await;
                }
            },
            _ = interval.tick() => {}
        }
        if worker.pod.metadata.deletion_timestamp.is_some() {
            return worker.terminate(Ending::Graceful, &mut rx).await;
        }
        worker.sync().await;
        worker.push_status().await;
    }
}

/// How a container instance ended.
#[derive(Debug, Clone)]
struct Finished {
    code: i32,
    signal: Option<i32>,
    reason: String,
    message: Option<String>,
    started_at: Timestamp,
    finished_at: Timestamp,
    container_id: Option<String>,
}

/// One start of a container.
#[derive(Debug)]
struct Instance {
    /// The container; `None` when it failed to start.
    container: Option<Arc<NodeContainer>>,
    started_at: Timestamp,
    /// Whether the startup probe passed (or there is none).
    startup_passed: bool,
    ready: bool,
    probes: Vec<ProbeState>,
    exit: Option<Finished>,
}

impl Instance {
    fn container_id(&self) -> Option<String> {
        self.container.as_ref().map(|c| c.status_id())
    }
}

/// One container of the pod spec and its history.
#[derive(Debug)]
struct Slot {
    spec: K8sContainer,
    init: bool,
    current: Option<Instance>,
    /// How the instance before `current` ended: the kubelet's `lastState.terminated` while
    /// `current` runs (or has ended for good). Moved here when a restart replaces the exited
    /// instance, in the same step that counts the restart, so no status shows a restart
    /// without the exit that caused it.
    last_exit: Option<Finished>,
    restart_count: i32,
    /// When the next start may happen (restart back-off, or a retry after a setup error).
    next_start_at: Option<Instant>,
    /// Why it is not running, when it is not (kubelet's waiting reason and message).
    waiting: Option<(String, String)>,
    /// An init container that completed, or an app container that will not run again.
    done: bool,
}

impl Slot {
    fn new(spec: K8sContainer, init: bool) -> Self {
        Self {
            spec,
            init,
            current: None,
            last_exit: None,
            restart_count: 0,
            next_start_at: None,
            waiting: Some(("ContainerCreating".to_owned(), String::new())),
            done: false,
        }
    }

    fn running(&self) -> bool {
        self.current
            .as_ref()
            .is_some_and(|i| i.exit.is_none() && i.container.is_some())
    }

    fn field_path(&self) -> String {
        if self.init {
            format!("spec.initContainers{{{}}}", self.spec.name)
        } else {
            format!("spec.containers{{{}}}", self.spec.name)
        }
    }
}

/// The pod task's state.
struct PodWorker {
    ctx: Arc<NodeCtx>,
    pod: Pod,
    namespace: String,
    name: String,
    dir: PathBuf,
    facts: PodFacts,
    sources: Option<Sources>,
    volumes: Option<PodVolumes>,
    next_setup_at: Instant,
    setup_error: Option<(String, String)>,
    sandbox: Option<PodSandbox>,
    slots: Vec<Slot>,
    start_time: Timestamp,
    /// `Succeeded` or `Failed` once reached: nothing runs any more.
    terminal: Option<&'static str>,
    transitions: BTreeMap<String, (String, Timestamp)>,
    last_status: Option<serde_json::Value>,
}

impl PodWorker {
    fn new(ctx: Arc<NodeCtx>, pod: Pod) -> Self {
        let spec = pod.spec.clone().unwrap_or_default();
        let mut slots: Vec<Slot> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| Slot::new(c.clone(), true))
            .collect();
        slots.extend(spec.containers.iter().map(|c| Slot::new(c.clone(), false)));
        let uid = pod.uid().unwrap_or_else(|| pod.name_any());
        let facts = PodFacts {
            node_name: ctx.node_name.clone(),
            pod_ip: ctx.ip.clone(),
            host_ip: ctx.ip.clone(),
        };
        Self {
            namespace: pod.namespace().unwrap_or_else(|| "default".to_owned()),
            name: pod.name_any(),
            dir: ctx.pods_dir.join(uid),
            facts,
            sources: None,
            volumes: None,
            next_setup_at: Instant::now(),
            setup_error: None,
            sandbox: None,
            slots,
            start_time: Timestamp::now(),
            terminal: None,
            transitions: BTreeMap::new(),
            last_status: None,
            ctx,
            pod,
        }
    }

    fn update(&mut self, pod: Pod) {
        let relabelled = pod.metadata.labels != self.pod.metadata.labels
            || pod.metadata.annotations != self.pod.metadata.annotations;
        self.pod = pod;
        if relabelled
            && let Some(volumes) = &self.volumes
            && let Err(e) = volumes::refresh_downward_api(&self.pod, volumes, &self.facts)
        {
            tracing::warn!(pod = %self.name, "refresh Downward API volumes: {e}");
        }
    }

    fn restart_policy(&self) -> &str {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.as_deref())
            .unwrap_or("Always")
    }

    fn host_network(&self) -> bool {
        self.pod.spec.as_ref().and_then(|s| s.host_network) == Some(true)
    }

    fn event(&self, field_path: Option<String>, kind: EventType, reason: &str, message: String) {
        self.ctx
            .recorder
            .emit(&self.pod, field_path, kind, reason, message);
    }

    /// One round: set up what is missing, start what is due, notice exits, run due probes.
    async fn sync(&mut self) {
        if self.terminal.is_some() {
            return;
        }
        if self.volumes.is_none() && !self.set_up().await {
            return;
        }
        // A runc pod on the host's network needs no pause container; CRI always has a sandbox.
        if (!self.host_network() || self.ctx.cri.is_some())
            && self.sandbox.is_none()
            && (Instant::now() < self.next_setup_at || !self.start_sandbox().await)
        {
            return;
        }
        self.notice_exits();
        let initialized = self.step_init_containers().await;
        if initialized && self.terminal.is_none() {
            self.step_app_containers().await;
        }
        self.run_probes().await;
        if self.terminal.is_none()
            && let Some(phase) = self.phase().filter(|p| *p == "Succeeded" || *p == "Failed")
        {
            self.terminal = Some(phase);
            if let Some(sandbox) = self.sandbox.take() {
                remove_sandbox(&self.ctx, sandbox).await;
            }
        }
    }

    /// Reads the ConfigMaps and Secrets the pod refers to and prepares its volumes. `false`
    /// while that fails (retried every second; the containers wait).
    async fn set_up(&mut self) -> bool {
        if Instant::now() < self.next_setup_at {
            return false;
        }
        let result = self.try_set_up().await;
        match result {
            Ok(()) => {
                self.setup_error = None;
                true
            }
            Err(message) => {
                if self.setup_error.as_ref().map(|(_, m)| m) != Some(&message) {
                    self.event(None, EventType::Warning, "FailedMount", message.clone());
                }
                self.setup_error = Some(("ContainerCreating".to_owned(), message));
                self.next_setup_at = Instant::now() + Duration::from_secs(1);
                false
            }
        }
    }

    async fn try_set_up(&mut self) -> Result<(), String> {
        let sources = self.read_sources().await?;
        let roots = VolumeRoots {
            pod_dir: self.dir.clone(),
            host_root: self.ctx.host_root.clone(),
            pvc_root: self.ctx.pvc_root.clone(),
        };
        let pod = self.pod.clone();
        let facts = self.facts.clone();
        let for_volumes = sources.clone();
        let volumes = tokio::task::spawn_blocking(move || {
            volumes::prepare(&pod, &roots, &facts, &for_volumes)
        })
        .await
        .map_err(|e| format!("prepare volumes: {e}"))??;
        self.sources = Some(sources);
        self.volumes = Some(volumes);
        Ok(())
    }

    /// Every ConfigMap and Secret named by the pod's volumes and containers' environments.
    async fn read_sources(&self) -> Result<Sources, String> {
        let mut config_maps: Vec<String> = Vec::new();
        let mut secrets: Vec<String> = Vec::new();
        let spec = self.pod.spec.clone().unwrap_or_default();
        for volume in spec.volumes.iter().flatten() {
            if let Some(cm) = &volume.config_map {
                config_maps.push(cm.name.clone());
            }
            if let Some(secret) = volume.secret.as_ref().and_then(|s| s.secret_name.clone()) {
                secrets.push(secret);
            }
            for source in volume
                .projected
                .iter()
                .flat_map(|p| p.sources.iter().flatten())
            {
                if let Some(cm) = &source.config_map {
                    config_maps.push(cm.name.clone());
                }
                if let Some(secret) = &source.secret {
                    secrets.push(secret.name.clone());
                }
            }
        }
        for container in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            for from in container.env_from.iter().flatten() {
                if let Some(cm) = &from.config_map_ref {
                    config_maps.push(cm.name.clone());
                }
                if let Some(secret) = &from.secret_ref {
                    secrets.push(secret.name.clone());
                }
            }
            for var in container.env.iter().flatten() {
                let Some(from) = &var.value_from else {
                    continue;
                };
                if let Some(key) = &from.config_map_key_ref {
                    config_maps.push(key.name.clone());
                }
                if let Some(key) = &from.secret_key_ref {
                    secrets.push(key.name.clone());
                }
            }
        }
        let mut sources = Sources::default();
        let cm_api: Api<ConfigMap> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        for name in config_maps {
            if sources.config_maps.contains_key(&name) {
                continue;
            }
            let found = cm_api
                .get_opt(&name)
                .await
                .map_err(|e| format!("read configmap {name:?}: {e}"))?;
            sources.config_maps.insert(name, found);
        }
        let secret_api: Api<Secret> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        for name in secrets {
            if sources.secrets.contains_key(&name) {
                continue;
            }
            let found = secret_api
                .get_opt(&name)
                .await
                .map_err(|e| format!("read secret {name:?}: {e}"))?;
            sources.secrets.insert(name, found);
        }
        Ok(sources)
    }

    /// Starts the pod's sandbox: a pause container whose network namespace the pod's containers
    /// join, or containerd's pod sandbox.
    async fn start_sandbox(&mut self) -> bool {
        let started = if let Some(cri) = &self.ctx.cri {
            cri.run_sandbox(&self.pod, self.host_network())
                .await
                .map(|sandbox| PodSandbox::Cri(Box::new(sandbox)))
        } else {
            let name = format!("{}-pause", self.name);
            let mut spec = ContainerSpec::new(&name, &self.ctx.pause_image, PAUSE_ARGS)
                .with_hostname(pod_hostname(&self.pod));
            spec.capabilities.clear();
            let runtime = self.ctx.runtime.clone();
            match tokio::task::spawn_blocking(move || runtime.start(&spec)).await {
                Ok(Ok(container)) => Ok(PodSandbox::Pause(Arc::new(NodeContainer::Runc(
                    Box::new(container),
                )))),
                Ok(Err(e)) => Err(format!("start the pause container: {e}")),
                Err(e) => Err(format!("start the pause container: {e}")),
            }
        };
        match started {
            Ok(sandbox) => {
                self.sandbox = Some(sandbox);
                self.setup_error = None;
                true
            }
            Err(message) => {
                self.fail_setup("FailedCreatePodSandBox", message);
                false
            }
        }
    }

    fn fail_setup(&mut self, reason: &str, message: String) {
        if self.setup_error.as_ref().map(|(_, m)| m) != Some(&message) {
            self.event(None, EventType::Warning, reason, message.clone());
        }
        self.setup_error = Some(("ContainerCreating".to_owned(), message));
        self.next_setup_at = Instant::now() + Duration::from_secs(1);
    }

    /// Records the exits of running containers.
    fn notice_exits(&mut self) {
        for slot in &mut self.slots {
            let Some(instance) = slot.current.as_mut() else {
                continue;
            };
            if instance.exit.is_some() {
                continue;
            }
            let Some(container) = &instance.container else {
                continue;
            };
            let exit = match container.try_wait() {
                Ok(Some(exit)) => exit,
                Ok(None) => continue,
                Err(e) => {
                    // Not our child (something undid the subreaper): once the process is
                    // gone, report it ended, with no known code.
                    if std::path::Path::new(&format!("/proc/{}", container.pid())).exists() {
                        continue;
                    }
                    tracing::warn!("{e}");
                    ContainerExit::Code(255)
                }
            };
            instance.exit = Some(Finished {
                code: exit.code(),
                signal: match exit {
                    ContainerExit::Signal(signal) => Some(signal),
                    ContainerExit::Code(_) => None,
                },
                reason: if exit.success() { "Completed" } else { "Error" }.to_owned(),
                message: None,
                started_at: instance.started_at,
                finished_at: Timestamp::now(),
                container_id: instance.container_id(),
            });
            instance.ready = false;
        }
    }

    /// Runs init containers one after the other; `true` once all completed.
    async fn step_init_containers(&mut self) -> bool {
        let never = self.restart_policy() == "Never";
        for index in 0..self.slots.len() {
            if !self.slots[index].init || self.slots[index].done {
                continue;
            }
            let exit = self.slots[index]
                .current
                .as_ref()
                .map(|i| i.exit.as_ref().map(|f| f.code));
            match exit {
                None => self.start_when_due(index).await,
                Some(None) => {}
                Some(Some(0)) => {
                    self.slots[index].done = true;
                    continue;
                }
                Some(Some(_)) if never => {
                    self.slots[index].done = true;
                    self.terminal = Some("Failed");
                    if let Some(sandbox) = self.sandbox.take() {
                        remove_sandbox(&self.ctx, sandbox).await;
                    }
                }
                Some(Some(_)) => self.restart_when_due(index).await,
            }
            return false;
        }
        true
    }

    /// Starts app containers that have not started, and restarts exited ones as the restart
    /// policy says.
    async fn step_app_containers(&mut self) {
        let policy = self.restart_policy().to_owned();
        for index in 0..self.slots.len() {
            if self.slots[index].init || self.slots[index].done {
                continue;
            }
            let exit = self.slots[index]
                .current
                .as_ref()
                .map(|i| i.exit.as_ref().map(|f| f.code));
            match exit {
                None => self.start_when_due(index).await,
                Some(None) => {}
                Some(Some(code)) => {
                    let restart = policy == "Always" || (policy == "OnFailure" && code != 0);
                    if restart {
                        self.restart_when_due(index).await;
                    } else {
                        self.slots[index].done = true;
                    }
                }
            }
        }
    }

    /// The restart delay after `restarts` restarts: none for the first, then the back-off
    /// doubling up to its maximum.
    fn backoff(&self, restarts: i32) -> Duration {
        if restarts == 0 {
            return Duration::ZERO;
        }
        let doublings = u32::try_from(restarts - 1).unwrap_or(0).min(16);
        self.ctx
            .restart_backoff
            .saturating_mul(1 << doublings)
            .min(self.ctx.max_restart_backoff)
    }

    async fn restart_when_due(&mut self, index: usize) {
        let now = Instant::now();
        let delay = self.backoff(self.slots[index].restart_count);
        match self.slots[index].next_start_at {
            None => {
                let name = self.slots[index].spec.name.clone();
                let field = self.slots[index].field_path();
                self.slots[index].next_start_at = Some(now + delay);
                self.slots[index].waiting = Some((
                    "CrashLoopBackOff".to_owned(),
                    format!(
                        "back-off {delay:?} restarting failed container={name} pod={}_{}",
                        self.name, self.namespace
                    ),
                ));
                if !delay.is_zero() {
                    let message = format!(
                        "Back-off restarting failed container {name} in pod {}_{}",
                        self.name, self.namespace
                    );
                    self.event(Some(field), EventType::Warning, "BackOff", message);
                    return;
                }
            }
            Some(due) if now < due => return,
            Some(_) => {}
        }
        let key = self.slot_key(&self.slots[index]);
        let old = self.slots[index]
            .current
            .as_mut()
            .and_then(|i| i.container.take());
        if let Some(old) = old {
            self.unregister(&key, &old);
            remove_container(&self.ctx, old).await;
        }
        self.slots[index].restart_count += 1;
        self.start(index).await;
    }

    async fn start_when_due(&mut self, index: usize) {
        if self.slots[index]
            .next_start_at
            .is_some_and(|at| Instant::now() < at)
        {
            return;
        }
        self.start(index).await;
    }

    /// Starts the container of slot `index` (which has no running instance). Configuration
    /// errors leave it waiting (retried after a second); a failure of runc itself counts as an
    /// exit with code 128 (`StartError`), as the kubelet reports it.
    async fn start(&mut self, index: usize) {
        let spec = self.slots[index].spec.clone();
        let field = Some(self.slots[index].field_path());
        let planned = self.plan(&spec);
        let container_spec = match planned {
            Ok(spec) => spec,
            Err((reason, message)) => {
                let slot = &mut self.slots[index];
                if slot.waiting.as_ref().map(|(_, m)| m) != Some(&message) {
                    self.event(
                        field,
                        EventType::Warning,
                        "Failed",
                        format!("Error: {message}"),
                    );
                }
                let slot = &mut self.slots[index];
                slot.waiting = Some((reason, message));
                slot.next_start_at = Some(Instant::now() + Duration::from_secs(1));
                return;
            }
        };
        let image = spec.image.clone().unwrap_or_default();
        self.event(
            field.clone(),
            EventType::Normal,
            "Pulled",
            format!("Container image {image:?} already present on machine"),
        );
        let started_at = Timestamp::now();
        let result = match (&self.ctx.cri, &self.sandbox) {
            (Some(cri), Some(PodSandbox::Cri(sandbox))) => {
                let attempt = u32::try_from(self.slots[index].restart_count).unwrap_or(0);
                // The image `plan` resolved, imported into containerd on first use.
                match cri.ensure_image(&image, &container_spec.image, &[]).await {
                    Ok(()) => cri
                        .start_container(sandbox, &self.pod, &spec, &container_spec, attempt)
                        .await
                        .map(NodeContainer::Cri),
                    Err(e) => Err(e),
                }
            }
            (Some(_), _) => Err("the pod sandbox is not running".to_owned()),
            (None, _) => {
                let runtime = self.ctx.runtime.clone();
                match tokio::task::spawn_blocking(move || runtime.start(&container_spec)).await {
                    Ok(result) => result
                        .map(|c| NodeContainer::Runc(Box::new(c)))
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(format!("the start task failed: {e}")),
                }
            }
        };
        let slot_label = self.slot_key(&self.slots[index]);
        let instance = match result {
            Ok(container) => {
                let container = Arc::new(container);
                self.register(&slot_label, &container);
                self.event(
                    field.clone(),
                    EventType::Normal,
                    "Created",
                    format!("Created container: {}", spec.name),
                );
                self.event(
                    field,
                    EventType::Normal,
                    "Started",
                    format!("Started container {}", spec.name),
                );
                let now = Instant::now();
                let mut probes = Vec::new();
                if let Some(p) = &spec.startup_probe {
                    probes.push(ProbeState::new(ProbeKind::Startup, p, &spec, now));
                }
                if let Some(p) = &spec.liveness_probe {
                    probes.push(ProbeState::new(ProbeKind::Liveness, p, &spec, now));
                }
                if let Some(p) = &spec.readiness_probe {
                    probes.push(ProbeState::new(ProbeKind::Readiness, p, &spec, now));
                }
                Instance {
                    container: Some(container),
                    started_at,
                    startup_passed: spec.startup_probe.is_none(),
                    ready: false,
                    probes,
                    exit: None,
                }
            }
            Err(message) => {
                self.event(
                    field,
                    EventType::Warning,
                    "Failed",
                    format!(
                        "Error: failed to start container {:?}: {message}",
                        spec.name
                    ),
                );
                Instance {
                    container: None,
                    started_at,
                    startup_passed: false,
                    ready: false,
                    probes: Vec::new(),
                    exit: Some(Finished {
                        code: 128,
                        signal: None,
                        reason: "StartError".to_owned(),
                        message: Some(message),
                        started_at,
                        finished_at: Timestamp::now(),
                        container_id: None,
                    }),
                }
            }
        };
        let slot = &mut self.slots[index];
        if let Some(previous) = slot.current.replace(instance).and_then(|i| i.exit) {
            slot.last_exit = Some(previous);
        }
        slot.next_start_at = None;
        slot.waiting = None;
    }

    /// The runc container spec of `container`, or the waiting reason and message.
    fn plan(&self, container: &K8sContainer) -> Result<ContainerSpec, (String, String)> {
        let config_error = |message: String| ("CreateContainerConfigError".to_owned(), message);
        let image_ref = container.image.clone().unwrap_or_default();
        let image = self
            .ctx
            .images
            .resolve(&image_ref)
            .map_err(|e| ("ErrImagePull".to_owned(), e.to_string()))?;
        let sources = self.sources.clone().unwrap_or_default();
        let env =
            container_env(&self.pod, container, &self.facts, &sources).map_err(config_error)?;
        let volumes = self.volumes.clone().unwrap_or_default();
        let mounts = volumes::container_mounts(container, &volumes, &env).map_err(config_error)?;
        let network = match &self.sandbox {
            // containerd puts the container in its sandbox's namespaces itself.
            Some(PodSandbox::Cri(_)) => Network::Host,
            _ if self.host_network() => Network::Host,
            Some(PodSandbox::Pause(pause)) => {
                Network::Join(PathBuf::from(format!("/proc/{}/ns/net", pause.pid())))
            }
            None => return Err(config_error("the pod sandbox is not running".to_owned())),
        };
        container_spec(&self.pod, container, &image, &env, mounts, network).map_err(config_error)
    }

    fn register(&self, key: &(String, String, String), container: &Arc<NodeContainer>) {
        let mut registry = self
            .ctx
            .registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        registry.insert(key.clone(), Arc::clone(container));
    }

    fn unregister(&self, key: &(String, String, String), container: &Arc<NodeContainer>) {
        let mut registry = self
            .ctx
            .registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if registry.get(key).is_some_and(|c| Arc::ptr_eq(c, container)) {
            registry.remove(key);
        }
    }

    /// Runs the probes that are due, all at once, and applies their verdicts: a startup probe
    /// that passes lets liveness and readiness run; one that fails, or a failing liveness probe,
    /// kills the container (the restart policy decides what follows); readiness sets `ready`.
    async fn run_probes(&mut self) {
        if self.terminal.is_some() {
            return;
        }
        let now = Instant::now();
        let mut runs = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Some(instance) = slot.current.as_mut() else {
                continue;
            };
            let Some(container) = instance.container.clone() else {
                continue;
            };
            if instance.exit.is_some() {
                continue;
            }
            if instance.probes.is_empty() || !instance.startup_passed {
                instance.ready = instance.startup_passed
                    && !instance
                        .probes
                        .iter()
                        .any(|p| p.kind == ProbeKind::Readiness);
            }
            let startup_passed = instance.startup_passed;
            for (probe_index, state) in instance.probes.iter_mut().enumerate() {
                let active = match state.kind {
                    ProbeKind::Startup => !startup_passed,
                    ProbeKind::Liveness | ProbeKind::Readiness => startup_passed,
                };
                if !active || !state.due(now) {
                    continue;
                }
                state.schedule(now);
                let action = state.action.clone();
                let timeout = state.timeout();
                let container = Arc::clone(&container);
                runs.push(async move {
                    let result = tokio::task::spawn_blocking(move || {
                        probe::run(&container, &action, timeout)
                    })
                    .await
                    .unwrap_or_else(|e| Err(format!("the probe task failed: {e}")));
                    (index, probe_index, result)
                });
            }
        }
        if runs.is_empty() {
            return;
        }
        for (index, probe_index, result) in join_all(runs).await {
            self.apply_probe(index, probe_index, result).await;
        }
    }

    async fn apply_probe(&mut self, index: usize, probe_index: usize, result: Result<(), String>) {
        let field = self.slots[index].field_path();
        let name = self.slots[index].spec.name.clone();
        let Some(instance) = self.slots[index].current.as_mut() else {
            return;
        };
        if instance.exit.is_some() {
            return;
        }
        let Some(state) = instance.probes.get_mut(probe_index) else {
            return;
        };
        let kind = state.kind;
        let verdict = state.record(result.is_ok());
        let container = instance.container.clone();
        let mut kill = false;
        match (kind, verdict) {
            (ProbeKind::Startup, Verdict::Passed) => {
                instance.startup_passed = true;
                instance.ready = !instance
                    .probes
                    .iter()
                    .any(|p| p.kind == ProbeKind::Readiness);
            }
            (ProbeKind::Readiness, Verdict::Passed) => instance.ready = true,
            (ProbeKind::Readiness, Verdict::Failed) => instance.ready = false,
            (ProbeKind::Startup | ProbeKind::Liveness, Verdict::Failed) => {
                state.reset();
                kill = true;
            }
            _ => {}
        }
        if let Err(message) = &result {
            self.event(
                Some(field.clone()),
                EventType::Warning,
                "Unhealthy",
                format!("{} probe failed: {message}", kind.label()),
            );
        }
        if kill && let Some(container) = container {
            self.event(
                Some(field),
                EventType::Normal,
                "Killing",
                format!(
                    "Container {name} failed {} probe, will be restarted",
                    kind.label().to_ascii_lowercase()
                ),
            );
            let killed = tokio::task::spawn_blocking(move || container.signal("KILL")).await;
            if let Ok(Err(e)) = killed {
                tracing::debug!("kill after a failed probe: {e}");
            }
        }
    }

    /// The pod's phase from its containers, as the kubelet computes it.
    fn phase(&self) -> Option<&'static str> {
        if let Some(terminal) = self.terminal {
            return Some(terminal);
        }
        if self.slots.iter().any(|s| s.init && !s.done) {
            return Some("Pending");
        }
        let policy = self.restart_policy();
        let mut running = 0;
        let mut waiting = 0;
        let mut failed = 0;
        let mut succeeded = 0;
        for slot in self.slots.iter().filter(|s| !s.init) {
            match slot
                .current
                .as_ref()
                .map(|i| i.exit.as_ref().map(|f| f.code))
            {
                None => waiting += 1,
                Some(None) => running += 1,
                Some(Some(code)) => {
                    let restarts = policy == "Always" || (policy == "OnFailure" && code != 0);
                    if restarts {
                        running += 1;
                    } else if code == 0 {
                        succeeded += 1;
                    } else {
                        failed += 1;
                    }
                }
            }
        }
        Some(if waiting > 0 {
            "Pending"
        } else if running > 0 {
            "Running"
        } else if failed > 0 {
            "Failed"
        } else if succeeded > 0 {
            "Succeeded"
        } else {
            "Pending"
        })
    }

    fn container_status(&self, slot: &Slot) -> ContainerStatus {
        let time = |t: Timestamp| Some(Time(t));
        let terminated = |f: &Finished| ContainerState {
            terminated: Some(ContainerStateTerminated {
                container_id: f.container_id.clone(),
                exit_code: f.code,
                finished_at: time(f.finished_at),
                message: f.message.clone(),
                reason: Some(f.reason.clone()),
                signal: f.signal,
                started_at: time(f.started_at),
            }),
            ..ContainerState::default()
        };
        let waiting = |reason: &str, message: &str| ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some(reason.to_owned()),
                message: (!message.is_empty()).then(|| message.to_owned()),
            }),
            ..ContainerState::default()
        };
        let instance = slot.current.as_ref();
        let previous = slot.last_exit.as_ref().map(terminated);
        let (state, last_state) = match instance {
            Some(i) if i.exit.is_none() => (
                ContainerState {
                    running: Some(ContainerStateRunning {
                        started_at: time(i.started_at),
                    }),
                    ..ContainerState::default()
                },
                previous,
            ),
            Some(i) => {
                let finished = i.exit.as_ref();
                match (&slot.waiting, finished) {
                    // Waiting to restart: the exit it waits after is the last state.
                    (Some((reason, message)), Some(f)) if !slot.done => {
                        (waiting(reason, message), Some(terminated(f)))
                    }
                    (_, Some(f)) => (terminated(f), previous),
                    (_, None) => (waiting("ContainerCreating", ""), previous),
                }
            }
            None => {
                let initializing = !slot.init && self.slots.iter().any(|s| s.init && !s.done);
                let specific = slot.waiting.clone().filter(|(reason, message)| {
                    reason != "ContainerCreating" || !message.is_empty()
                });
                let (reason, message) = specific
                    .or_else(|| self.setup_error.clone())
                    .or_else(|| initializing.then(|| ("PodInitializing".to_owned(), String::new())))
                    .unwrap_or_else(|| ("ContainerCreating".to_owned(), String::new()));
                (waiting(&reason, &message), None)
            }
        };
        let image = slot.spec.image.clone().unwrap_or_default();
        let image_id = self
            .ctx
            .images
            .resolve(&image)
            .map(|i| format!("sim://{}", i.root().display()))
            .unwrap_or_default();
        ContainerStatus {
            name: slot.spec.name.clone(),
            image,
            image_id,
            container_id: instance.and_then(|i| {
                i.container_id()
                    .or_else(|| i.exit.as_ref().and_then(|f| f.container_id.clone()))
            }),
            ready: instance.is_some_and(|i| i.exit.is_none() && i.ready),
            started: Some(instance.is_some_and(|i| i.exit.is_none() && i.startup_passed)),
            restart_count: slot.restart_count,
            state: Some(state),
            last_state,
            ..ContainerStatus::default()
        }
    }

    /// A condition, with `lastTransitionTime` kept from when its status last changed.
    fn condition(
        &mut self,
        kind: &str,
        ok: bool,
        reason: Option<String>,
        message: Option<String>,
    ) -> PodCondition {
        let status = if ok { "True" } else { "False" }.to_owned();
        let entry = self
            .transitions
            .entry(kind.to_owned())
            .or_insert_with(|| (status.clone(), Timestamp::now()));
        if entry.0 != status {
            *entry = (status.clone(), Timestamp::now());
        }
        PodCondition {
            type_: kind.to_owned(),
            status,
            last_transition_time: Some(Time(entry.1)),
            reason: if ok { None } else { reason },
            message: if ok { None } else { message },
            ..PodCondition::default()
        }
    }

    fn status(&mut self) -> PodStatus {
        let phase = self.phase().unwrap_or("Pending");
        let init_statuses: Vec<ContainerStatus> = self
            .slots
            .iter()
            .filter(|s| s.init)
            .map(|s| self.container_status(s))
            .collect();
        let statuses: Vec<ContainerStatus> = self
            .slots
            .iter()
            .filter(|s| !s.init)
            .map(|s| self.container_status(s))
            .collect();
        let unready: Vec<String> = statuses
            .iter()
            .filter(|s| !s.ready)
            .map(|s| s.name.clone())
            .collect();
        let incomplete: Vec<String> = self
            .slots
            .iter()
            .filter(|s| s.init && !s.done)
            .map(|s| s.spec.name.clone())
            .collect();
        let completed = phase == "Succeeded" || phase == "Failed";
        let not_ready_reason = Some(
            if completed {
                "PodCompleted"
            } else {
                "ContainersNotReady"
            }
            .to_owned(),
        );
        let not_ready_message = (!completed)
            .then(|| format!("containers with unready status: [{}]", unready.join(" ")));
        let sandbox_ready = self.host_network() || self.sandbox.is_some();
        let conditions = vec![
            self.condition("PodReadyToStartContainers", sandbox_ready, None, None),
            self.condition(
                "Initialized",
                incomplete.is_empty(),
                Some("ContainersNotInitialized".to_owned()),
                Some(format!(
                    "containers with incomplete status: [{}]",
                    incomplete.join(" ")
                )),
            ),
            self.condition(
                "Ready",
                unready.is_empty() && !completed,
                not_ready_reason.clone(),
                not_ready_message.clone(),
            ),
            self.condition(
                "ContainersReady",
                unready.is_empty() && !completed,
                not_ready_reason,
                not_ready_message,
            ),
            self.condition("PodScheduled", true, None, None),
        ];
        PodStatus {
            phase: Some(phase.to_owned()),
            conditions: Some(conditions),
            host_ip: Some(self.ctx.ip.clone()),
            host_ips: Some(vec![HostIP {
                ip: self.ctx.ip.clone(),
            }]),
            pod_ip: Some(self.ctx.ip.clone()),
            pod_ips: Some(vec![PodIP {
                ip: self.ctx.ip.clone(),
            }]),
            start_time: Some(Time(self.start_time)),
            init_container_statuses: (!init_statuses.is_empty()).then_some(init_statuses),
            container_statuses: Some(statuses),
            ..PodStatus::default()
        }
    }

    /// Writes the pod's status when it changed since the last write.
    async fn push_status(&mut self) {
        let status = self.status();
        let value = match serde_json::to_value(&status) {
            Ok(value) => value,
            Err(e) => {
                tracing::warn!(pod = %self.name, "serialise the pod status: {e}");
                return;
            }
        };
        if self.last_status.as_ref() == Some(&value) {
            return;
        }
        let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        let patch = json!({"status": value});
        match api
            .patch_status(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => self.last_status = Some(value),
            Err(e) if is_not_found(&e) => {}
            Err(e) => tracing::warn!(pod = %self.name, "update the pod status: {e}"),
        }
    }

    /// Stops and removes everything of the pod; for a graceful deletion, first signals the
    /// containers (SIGTERM), waits up to the grace period for them to exit, and finally deletes
    /// the pod object with grace period 0, once the containers are gone: as the kubelet, the
    /// node reports a pod deleted only after its containers (runc state, overlay, state
    /// directory) are removed.
    async fn terminate(
        &mut self,
        mut ending: Ending,
        rx: &mut UnboundedReceiver<PodMsg>,
    ) -> Result<(), NodeError> {
        if ending == Ending::Graceful {
            ending = self.stop_gracefully(rx).await;
        }
        let problems = self.remove_everything().await;
        if ending == Ending::Graceful {
            let api: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    uid: self.pod.uid(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match api.delete(&self.name, &params).await {
                Ok(_) => {}
                Err(e) if is_not_found(&e) || super::error::is_conflict(&e) => {}
                Err(e) => {
                    return Err(e).ctx(|| {
                        format!(
                            "delete pod {}/{} after stopping it",
                            self.namespace, self.name
                        )
                    });
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(NodeError::Cleanup {
                what: format!("pod {}/{}", self.namespace, self.name),
                problems,
            })
        }
    }

    /// Sends SIGTERM to the running containers and waits up to the grace period for them to
    /// exit; returns how the pod ends (the object may go, or the node shut down, meanwhile).
    ///
    /// The containers are held here only while waiting: a container still held when
    /// [`remove_container`] runs is only killed and deleted from runc, its overlay and state
    /// directory staying until the last holder drops it, which would then be after the pod
    /// object is deleted.
    async fn stop_gracefully(&mut self, rx: &mut UnboundedReceiver<PodMsg>) -> Ending {
        let running: Vec<(Arc<NodeContainer>, String, String)> = self
            .slots
            .iter()
            .filter(|s| s.running())
            .filter_map(|s| {
                let container = s.current.as_ref()?.container.clone()?;
                Some((container, s.spec.name.clone(), s.field_path()))
            })
            .collect();
        if running.is_empty() {
            return Ending::Graceful;
        }
        let grace = self
            .pod
            .metadata
            .deletion_grace_period_seconds
            .or_else(|| {
                self.pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.termination_grace_period_seconds)
            })
            .unwrap_or(30);
        let grace = Duration::from_secs(u64::try_from(grace.max(0)).unwrap_or(0));
        for (container, name, field) in &running {
            self.event(
                Some(field.clone()),
                EventType::Normal,
                "Killing",
                format!("Stopping container {name}"),
            );
            let container = Arc::clone(container);
            let _ = tokio::task::spawn_blocking(move || container.signal("TERM")).await;
        }
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let all_exited = running
                .iter()
                .all(|(c, _, _)| !matches!(c.try_wait(), Ok(None)));
            if all_exited || tokio::time::Instant::now() >= deadline {
                return Ending::Graceful;
            }
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(PodMsg::Update(pod)) => self.pod = *pod,
                    Some(PodMsg::Deleted) => return Ending::Gone,
                    Some(PodMsg::Shutdown) | None => return Ending::Shutdown,
                },
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }

    /// Removes every container (app, init, sandbox) and the pod's directory.
    async fn remove_everything(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut containers = Vec::new();
        for index in 0..self.slots.len() {
            let key = self.slot_key(&self.slots[index]);
            if let Some(container) = self.slots[index]
                .current
                .as_mut()
                .and_then(|i| i.container.take())
            {
                self.unregister(&key, &container);
                containers.push(container);
            }
        }
        for container in containers {
            if let Some(problem) = remove_container(&self.ctx, container).await {
                problems.push(problem);
            }
        }
        if let Some(sandbox) = self.sandbox.take()
            && let Some(problem) = remove_sandbox(&self.ctx, sandbox).await
        {
            problems.push(problem);
        }
        let dir = self.dir.clone();
        let removed = tokio::task::spawn_blocking(move || match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(format!("remove {}: {e}", dir.display()))
            }
            _ => Ok(()),
        })
        .await;
        match removed {
            Ok(Ok(())) => {}
            Ok(Err(problem)) => problems.push(problem),
            Err(e) => problems.push(format!("remove the pod directory: {e}")),
        }
        problems
    }

    fn slot_key(&self, slot: &Slot) -> (String, String, String) {
        (
            self.namespace.clone(),
            self.name.clone(),
            slot.spec.name.clone(),
        )
    }
}

/// A pod's sandbox.
#[derive(Debug)]
enum PodSandbox {
    /// A runc pause container holding the pod's network namespace.
    Pause(Arc<NodeContainer>),
    /// containerd's pod sandbox.
    Cri(Box<CriSandbox>),
}

/// Removes `sandbox`; returns what could not be removed.
async fn remove_sandbox(ctx: &NodeCtx, sandbox: PodSandbox) -> Option<String> {
    match sandbox {
        PodSandbox::Pause(pause) => remove_container(ctx, pause).await,
        PodSandbox::Cri(sandbox) => match &ctx.cri {
            Some(cri) => cri.remove_sandbox(&sandbox).await.err(),
            None => Some(format!("pod sandbox {}: no CRI runtime", sandbox.id)),
        },
    }
}

/// Removes `container`: a runc container (kill, `runc delete`, overlay, state directory) off
/// the async threads, or a CRI container (`StopContainer`, `RemoveContainer`). When someone else
/// still holds a runc container (a test), it is killed and deleted now and the rest is removed
/// when the last holder drops it. Returns what could not be removed.
async fn remove_container(ctx: &NodeCtx, container: Arc<NodeContainer>) -> Option<String> {
    if let NodeContainer::Cri(c) = container.as_ref() {
        return match &ctx.cri {
            Some(cri) => cri.remove_container(c.id()).await.err(),
            None => Some(format!("container {}: no CRI runtime", c.id())),
        };
    }
    let result = tokio::task::spawn_blocking(move || match Arc::try_unwrap(container) {
        Ok(NodeContainer::Runc(container)) => container.destroy().map_err(|e| e.to_string()),
        Ok(NodeContainer::Cri(_)) => Ok(()),
        Err(shared) => match shared.as_ref() {
            NodeContainer::Runc(c) => c
                .runtime()
                .remove_runc_container(c.id())
                .map_err(|e| e.to_string()),
            NodeContainer::Cri(_) => Ok(()),
        },
    })
    .await;
    match result {
        Ok(Ok(())) => None,
        Ok(Err(problem)) => Some(problem),
        Err(e) => Some(format!("remove a container: {e}")),
    }
}
