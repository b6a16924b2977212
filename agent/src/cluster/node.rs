//! The per-node loop of cluster mode: wakes up for the node's pods (API watch, `ready` files,
//! periodic resync), validates before acting, and runs checkpoints and restores within the
//! node's limits — never two operations on one pod or container, never two checkpoints of one
//! hash at once.
//!
//! Restart safety: each operation is journalled in the state directory before it starts and
//! the entry removed once its outcome is recorded (`.done`, restore status). An entry found
//! with no operation running belongs to an agent that died mid-way: its outcome is decided from
//! what is on disk (a published artifact of this pod, a `restore-complete`) and reported, and
//! the operation is never run a second time.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::{Instrument, error, info, info_span, warn};
use warmstart_shared::Checkpoint;
use warmstart_shared::artifact::{ArtifactLayout, Verification, read_published};
use warmstart_shared::control::RestoreStatus;
use warmstart_shared::names;
use warmstart_shared::signal::DoneSignal;

use super::journal::{Journal, JournalEntry, JournalOperation};
use super::metrics::{CacheResult, Ended, FailureCause, FallbackReason, Metrics};
use super::ops::{NodeOps, OpError, Restore};
use super::plan::{self, OnRefusal, Pending, RestorePlan, Role};
use super::podvols;
use super::readiness::{self, Requirements, Verdict};
use super::report::{self, Report};
use super::signals::{SignalWatcher, Wake};
use super::validate::{self, Refusal};
use crate::progress::Operation;
use crate::timings::Timings;

/// Field manager of the agent's patches.
pub const FIELD_MANAGER: &str = "warmstart-agent";

/// What the node loop needs to know.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// The kubelet's root directory (pods' volumes live below it).
    pub kubelet_root: PathBuf,
    /// Root of the artifact volume.
    pub artifact_root: PathBuf,
    /// The agent's own state: operation journal and restore logs.
    pub state_dir: PathBuf,
    /// Owner given to published artifacts (the controller removes them by policy).
    pub artifact_owner: (u32, u32),
    /// Checkpoints at once on this node.
    pub max_checkpoints: usize,
    /// Restores at once on this node.
    pub max_restores: usize,
    /// How often every pod is looked at again.
    pub resync: Duration,
    /// How long running operations may take to finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// What the loop asks of the node: the engine and recovery.
    pub ops: Arc<dyn NodeOps>,
    /// Deadlines, log cap and staging age.
    pub limits: crate::limits::Limits,
    /// The node's artifact cache, when restores read artifacts through one.
    pub cache: Option<Arc<crate::cache::Cache>>,
    /// The object store artifacts are uploaded to once published, and restores fetch them from
    /// into the cache.
    pub store: Option<warmstart_objstore::Store>,
    /// What must work for the node to be labelled ready.
    pub readiness: Requirements,
    /// How often the preflight runs again.
    pub readiness_interval: Duration,
}

/// Readiness of the agent, for `/readyz`: ready once the pod watch has synced and the node's
/// last preflight passed (it is labelled).
pub use warmstart_shell::admin::Health;

#[derive(Debug, Default)]
struct Busy {
    pods: HashSet<String>,
    hashes: HashSet<String>,
}

struct Agent {
    settings: Settings,
    journal: Journal,
    client: Client,
    metrics: Arc<Metrics>,
    report: Report,
    store: Store<Pod>,
    signals: SignalWatcher,
    busy: Mutex<Busy>,
    /// Restore pods whose time to Ready is recorded.
    ready_seen: Mutex<HashSet<String>>,
    checkpoints: Semaphore,
    restores: Semaphore,
    accepting: AtomicBool,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("node", &self.settings.node)
            .finish_non_exhaustive()
    }
}

/// Why the node loop could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// inotify could not be set up.
    #[error("cannot watch signal directories")]
    Inotify(#[source] std::io::Error),
    /// The state directory is unusable.
    #[error("cannot use state directory {path}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Runs the node loop until `shutdown` turns true, then lets running operations finish within
/// the grace period and removes the node's ready label.
///
/// # Errors
/// [`NodeError`] for start-up problems; later failures are logged, reported on the pods, and
/// retried.
pub async fn run(
    settings: Settings,
    client: Client,
    metrics: Arc<Metrics>,
    recorder: Recorder,
    health: Arc<Health>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), NodeError> {
    for dir in [journal_dir(&settings), settings.state_dir.join("restores")] {
        std::fs::create_dir_all(&dir).map_err(|source| NodeError::StateDir {
            path: dir.clone(),
            source,
        })?;
    }
    let (wake_tx, mut wake_rx) = mpsc::unbounded_channel();
    let signals = SignalWatcher::start(wake_tx.clone()).map_err(NodeError::Inotify)?;
    let (store, writer) = reflector::store();
    let report = Report::new(
        client.clone(),
        recorder,
        metrics.clone(),
        settings.kubelet_root.clone(),
    );
    let agent = Arc::new(Agent {
        journal: Journal::new(journal_dir(&settings)),
        checkpoints: Semaphore::new(settings.max_checkpoints),
        restores: Semaphore::new(settings.max_restores),
        settings,
        client: client.clone(),
        report,
        metrics,
        store,
        signals,
        busy: Mutex::default(),
        ready_seen: Mutex::default(),
        accepting: AtomicBool::new(true),
    });

    let (synced_tx, mut synced_rx) = watch::channel(false);
    let watch_task = spawn_pod_watch(&agent, writer, wake_tx.clone(), synced_tx);
    let ticker = spawn_ticker(agent.settings.resync, wake_tx.clone());

    // Ready (and labelled) only once the watch has synced: before, pods are not yet known.
    tokio::select! {
        _ = synced_rx.wait_for(|s| *s) => {}
        _ = shutdown.wait_for(|s| *s) => {}
    }
    let readiness = (!*shutdown.borrow()).then(|| {
        tokio::spawn(keep_readiness(
            agent.clone(),
            health.clone(),
            shutdown.clone(),
        ))
    });

    let prestager = (!*shutdown.borrow()).then(|| {
        let settings = &agent.settings;
        let prestager = Arc::new(super::prestage::Prestager {
            node: settings.node.clone(),
            artifact_root: settings.artifact_root.clone(),
            cache: settings.cache.clone(),
            store: settings.store.clone(),
            client: agent.client.clone(),
            metrics: agent.metrics.clone(),
            fetching: Mutex::default(),
            failed: Mutex::default(),
        });
        tokio::spawn(prestager.run(shutdown.clone()))
    });

    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            wake = wake_rx.recv() => match wake {
                Some(Wake::Pod(uid)) => {
                    if let Some(pod) = agent.pod_by_uid(&uid) {
                        agent.consider(&pod, &mut tasks);
                    }
                }
                Some(Wake::Resync) => agent.resync(&mut tasks),
                None => break,
            },
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                if let Err(e) = done {
                    error!(error = %e, "operation task failed");
                }
            }
            _ = shutdown.wait_for(|s| *s) => break,
        }
    }

    agent.accepting.store(false, Ordering::Relaxed);
    if let Some(task) = readiness {
        let _ = task.await;
    }
    if let Some(task) = prestager {
        task.abort();
    }
    health.ready.store(false, Ordering::Relaxed);
    drain(&agent, tasks).await;
    watch_task.abort();
    ticker.abort();
    info!("agent stopped");
    Ok(())
}

/// Watches the pods bound to the agent's node into the store: each change wakes the loop for
/// its pod, a deletion forgets what the agent kept for it, the first complete listing says
/// `synced` and wakes a resync.
fn spawn_pod_watch(
    agent: &Arc<Agent>,
    writer: reflector::store::Writer<Pod>,
    tx: mpsc::UnboundedSender<Wake>,
    synced_tx: watch::Sender<bool>,
) -> tokio::task::JoinHandle<()> {
    let pods: Api<Pod> = Api::all(agent.client.clone());
    let config =
        watcher::Config::default().fields(&format!("spec.nodeName={}", agent.settings.node));
    let cleanup = agent.clone();
    tokio::spawn(async move {
        let stream = reflector::reflector(writer, watcher(pods, config).default_backoff());
        tokio::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                    if let Some(uid) = pod.uid() {
                        let _ = tx.send(Wake::Pod(uid));
                    }
                }
                Ok(watcher::Event::Delete(pod)) => {
                    if let Some(uid) = pod.uid() {
                        cleanup.forget_pod(&uid);
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    synced_tx.send_replace(true);
                    let _ = tx.send(Wake::Resync);
                }
                Ok(watcher::Event::Init) => {}
                Err(e) => warn!(error = %e, "pod watch failed; retrying"),
            }
        }
    })
}

/// Wakes the loop for a resync every `period` (covers missed events).
fn spawn_ticker(period: Duration, tx: mpsc::UnboundedSender<Wake>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if tx.send(Wake::Resync).is_err() {
                return;
            }
        }
    })
}

/// At shutdown: takes the node's label and condition off, then lets the running operations
/// finish within the grace period (the next agent reports those still running).
async fn drain(agent: &Agent, mut tasks: JoinSet<()>) {
    info!(running = tasks.len(), "shutting down: taking no new work");
    agent.label_node(false).await;
    agent
        .node_condition(&readiness::stopped(), &crate::clock::now_rfc3339())
        .await;
    let grace = agent.settings.shutdown_grace;
    let drained = tokio::time::timeout(grace, async {
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done {
                error!(error = %e, "operation task failed");
            }
        }
    })
    .await;
    if drained.is_err() {
        warn!(
            running = tasks.len(),
            grace_seconds = grace.as_secs(),
            "operations still running at the end of the grace period; the next agent reports them"
        );
    }
}

fn journal_dir(settings: &Settings) -> PathBuf {
    settings.state_dir.join("journal")
}

fn now() -> String {
    crate::clock::now_rfc3339()
}

/// Runs the preflight now and every `readiness_interval` until shutdown; labels the node, sets
/// its `WarmstartAgentReady` condition and the agent's readiness from each verdict, and on a
/// change records an Event on the Node and a log line saying why.
async fn keep_readiness(
    agent: Arc<Agent>,
    health: Arc<Health>,
    mut shutdown: watch::Receiver<bool>,
) {
    // The verdict the node shows (label applied), and since when.
    let mut shown: Option<Verdict> = None;
    let mut since = crate::clock::now_rfc3339();
    loop {
        let items = readiness::probe(&agent.settings.readiness).await;
        let verdict = readiness::verdict(&items);
        if *shutdown.borrow() {
            return;
        }
        if shown.as_ref() != Some(&verdict) {
            if shown.as_ref().map(|v| v.ready) != Some(verdict.ready) {
                since = crate::clock::now_rfc3339();
            }
            if verdict.ready {
                info!(node = %agent.settings.node, checks = %verdict.message, "agent ready");
            } else {
                error!(node = %agent.settings.node, reason = %verdict.message, "this node cannot serve checkpoints and restores: not ready");
            }
            // Not ready: unlabelled before anything else, so no new pod is sent here.
            if agent.label_node(verdict.ready).await {
                agent
                    .report
                    .node_event(&agent.settings.node, &verdict)
                    .await;
                shown = Some(verdict.clone());
            }
        }
        agent.node_condition(&verdict, &since).await;
        health.ready.store(
            verdict.ready && shown.as_ref().is_some_and(|v| v.ready),
            Ordering::Relaxed,
        );
        tokio::select! {
            () = tokio::time::sleep(agent.settings.readiness_interval) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

impl Agent {
    fn pod_by_uid(&self, uid: &str) -> Option<Arc<Pod>> {
        self.store
            .state()
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(uid))
    }

    fn signal_dir(&self, uid: &str) -> PathBuf {
        podvols::signal_path(&self.settings.kubelet_root, uid)
    }

    fn resync(self: &Arc<Self>, tasks: &mut JoinSet<()>) {
        let pods = self.store.state();
        let live: HashSet<String> = pods.iter().filter_map(|p| p.uid()).collect();
        for uid in self.signals.watched() {
            if !live.contains(&uid) {
                self.forget_pod(&uid);
            }
        }
        self.sweep_state(&live);
        for pod in pods {
            self.consider(&pod, tasks);
        }
    }

    /// Drops what the agent keeps for a pod that no longer exists.
    fn forget_pod(&self, uid: &str) {
        self.signals.forget(uid);
        self.ready_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
        self.report.forget(uid);
        let logs = self.settings.state_dir.join("restores").join(uid);
        // remove_dir_all never follows symlinks; the directory is the agent's own.
        if let Err(e) = std::fs::remove_dir_all(&logs)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(pod.uid = uid, error = %e, "cannot remove restore logs");
        }
    }

    fn sweep_state(&self, live: &HashSet<String>) {
        // Journal entries of pods that are gone: nothing is left to report them on.
        self.journal
            .sweep(|uid| live.contains(uid), |uid| self.is_busy_pod(uid));
        let Ok(entries) = std::fs::read_dir(self.settings.state_dir.join("restores")) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !live.contains(&name) && !self.is_busy_pod(&name) {
                self.forget_pod(&name);
            }
        }
    }

    fn is_busy_pod(&self, uid: &str) -> bool {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .contains(uid)
    }

    /// Looks at one pod and starts what it needs, if anything.
    fn consider(self: &Arc<Self>, pod: &Arc<Pod>, tasks: &mut JoinSet<()>) {
        if !self.accepting.load(Ordering::Relaxed) {
            return;
        }
        let Some(uid) = pod.uid() else { return };
        match plan::role(pod) {
            Role::Source { hash } => self.consider_source(pod, &uid, hash, tasks),
            Role::Restore => self.consider_restore(pod, &uid, tasks),
            Role::Other => {}
        }
    }

    fn consider_source(
        self: &Arc<Self>,
        pod: &Arc<Pod>,
        uid: &str,
        hash: &str,
        tasks: &mut JoinSet<()>,
    ) {
        let dir = self.signal_dir(uid);
        // Missing until the kubelet sets up the pod's volumes: the next wake-up retries.
        let _ = self.signals.watch(uid, &dir);
        let interrupted = self.journal.has_checkpoint(uid);
        // The signal directory is the workload's: no link there is followed.
        let signals = podvols::source_signals(&self.settings.kubelet_root, uid, hash);
        if plan::checkpoint_due(pod, interrupted, signals) && self.claim_pod(uid) {
            let uid = uid.to_owned();
            let agent = self.clone();
            let pod = pod.clone();
            let span = info_span!("checkpoint", pod = %pod.name_any(), namespace = %pod.namespace().unwrap_or_default(), checkpoint.hash = %hash);
            tasks.spawn(
                async move {
                    agent.checkpoint_pod(&pod, interrupted).await;
                    agent.release_pod(&uid);
                }
                .instrument(span),
            );
        }
    }

    fn consider_restore(self: &Arc<Self>, pod: &Arc<Pod>, uid: &str, tasks: &mut JoinSet<()>) {
        let plan = plan::restore_plan(
            pod,
            |c| self.journal.has_restore(uid, c),
            |c| self.report.settled(uid, c),
        );
        match plan {
            RestorePlan::Ended => {
                // The view shows every outcome: nothing more to remember for it.
                self.report.forget_settled(uid);
                self.observe_ready(uid, pod);
            }
            RestorePlan::Wait => {}
            RestorePlan::Start(pending) if self.claim_pod(uid) => {
                let uid = uid.to_owned();
                let agent = self.clone();
                let pod = pod.clone();
                // The checkpoint's hash is recorded once its Checkpoint is read.
                let span = info_span!("restore", pod = %pod.name_any(), namespace = %pod.namespace().unwrap_or_default(), checkpoint.hash = tracing::field::Empty);
                tasks.spawn(
                    async move {
                        agent.restore_pod(&pod, pending).await;
                        agent.release_pod(&uid);
                    }
                    .instrument(span),
                );
            }
            RestorePlan::Start(_) => {}
        }
    }

    /// Records, once per pod, how long a restore pod whose restores all ended took from its
    /// creation to Ready.
    fn observe_ready(&self, uid: &str, pod: &Pod) {
        let Some((outcome, after)) = plan::ready_after(pod) else {
            return;
        };
        if self
            .ready_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(uid.to_owned())
        {
            info!(outcome, seconds = after.as_secs_f64(), "restore pod Ready");
            self.metrics.pod_ready(outcome, after);
        }
    }

    fn claim_pod(&self, uid: &str) -> bool {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .insert(uid.to_owned())
    }

    fn release_pod(&self, uid: &str) {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .remove(uid);
    }

    /// Sets or removes the node's ready label; whether the node now shows it.
    async fn label_node(&self, ready: bool) -> bool {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let value = if ready {
            serde_json::Value::String(names::LABEL_AGENT_READY_VALUE.to_owned())
        } else {
            serde_json::Value::Null
        };
        let patch = serde_json::json!({"metadata": {"labels": {names::LABEL_AGENT_READY: value}}});
        match nodes
            .patch(
                &self.settings.node,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {
                info!(node = %self.settings.node, ready, label = names::LABEL_AGENT_READY, "node label updated");
                true
            }
            Err(e) => {
                warn!(node = %self.settings.node, error = %e, "cannot update the node's ready label");
                false
            }
        }
    }

    /// Sets the node's `WarmstartAgentReady` condition to `verdict`, changed at `since`.
    async fn node_condition(&self, verdict: &Verdict, since: &str) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let patch = readiness::condition_patch(verdict, since, &crate::clock::now_rfc3339());
        if let Err(e) = nodes
            .patch_status(
                &self.settings.node,
                &PatchParams::default(),
                &Patch::Strategic(&patch),
            )
            .await
        {
            warn!(node = %self.settings.node, error = %e, "cannot set the node's {} condition", readiness::CONDITION);
        }
    }

    // ------------------------------------------------------------------------------------
    // Checkpoint
    // ------------------------------------------------------------------------------------

    /// Validates a checkpoint source before its checkpoint: the pod, its Job and Checkpoint,
    /// the artifact's place; the target, where it goes, and the Checkpoint to mirror Events on.
    /// `None` when there is nothing to checkpoint now (refused, waiting, or an interrupted
    /// checkpoint that was finished instead).
    async fn validated_source(&self, pod: &Pod, interrupted: bool) -> Option<Source> {
        let namespace = pod.namespace().unwrap_or_default();
        let claims = match validate::source_claims(&self.settings.node, pod) {
            Ok(claims) => claims,
            Err(r) => {
                match plan::on_refusal(&r, interrupted) {
                    OnRefusal::Wait => {}
                    OnRefusal::FinishInterrupted => {
                        self.finish_interrupted_checkpoint(pod, None).await;
                    }
                    OnRefusal::Refuse => self.report.refused(pod, Operation::Checkpoint, &r).await,
                }
                return None;
            }
        };
        let layout =
            match ArtifactLayout::new(&self.settings.artifact_root, &namespace, &claims.hash) {
                Ok(layout) => layout,
                Err(source) => {
                    let r = Refusal::ArtifactPath {
                        checkpoint: claims.checkpoint.clone(),
                        source,
                    };
                    self.report.refused(pod, Operation::Checkpoint, &r).await;
                    return None;
                }
            };
        if interrupted {
            self.finish_interrupted_checkpoint(pod, Some((&layout, &claims.hash)))
                .await;
            return None;
        }
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &namespace);
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.client.clone(), &namespace);
        let (job, checkpoint) = match tokio::try_join!(
            jobs.get_opt(&claims.job),
            checkpoints.get_opt(&claims.checkpoint)
        ) {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %e, "cannot read the pod's Job or Checkpoint; retrying later");
                return None;
            }
        };
        let target =
            match validate::checkpoint_target(pod, &claims, job.as_ref(), checkpoint.as_ref()) {
                Ok(target) => target,
                Err(r) => {
                    if plan::on_refusal(&r, false) == OnRefusal::Refuse {
                        self.report.refused(pod, Operation::Checkpoint, &r).await;
                    }
                    return None;
                }
            };
        // The agent's Events of this checkpoint go on the Checkpoint too, where its user looks.
        let mirror = checkpoint.as_ref().map(|c| c.object_ref(&()));
        if target.location != layout.relative() {
            let r = Refusal::CheckpointMismatch {
                checkpoint: target.checkpoint.clone(),
                field: "location",
                expected: layout.relative(),
                found: target.location.clone(),
            };
            self.report.refused(pod, Operation::Checkpoint, &r).await;
            return None;
        }
        Some(Source {
            target,
            layout,
            mirror,
        })
    }

    async fn checkpoint_pod(&self, pod: &Pod, interrupted: bool) {
        let Some(Source {
            target,
            layout,
            mirror,
        }) = self.validated_source(pod, interrupted).await
        else {
            return;
        };
        let uid = pod.uid().unwrap_or_default();
        let namespace = pod.namespace().unwrap_or_default();
        if !self
            .busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .hashes
            .insert(target.hash.clone())
        {
            info!("another checkpoint of this hash runs on this node; waiting");
            return;
        }
        let Ok(_permit) = self.checkpoints.acquire().await else {
            return;
        };
        let _in_flight = self.metrics.start(Operation::Checkpoint);
        let entry = JournalEntry {
            operation: JournalOperation::Checkpoint,
            pod: pod.name_any(),
            namespace: namespace.clone(),
            container: target.container.clone(),
            started_at: now(),
        };
        let journalled = match self.journal.record(&uid, &entry) {
            Ok(journalled) => journalled,
            Err(e) => {
                error!(error = %e, journal = %self.journal.dir().display(), "cannot journal the checkpoint; not starting it");
                self.release_hash(&target.hash);
                return;
            }
        };
        info!(container = %target.container, container.id = %target.container_id, "checkpoint started");
        self.report
            .checkpoint_event(
                pod,
                mirror.as_ref(),
                EventType::Normal,
                "Checkpointing",
                &format!(
                    "checkpointing container {} of pod {} into {}",
                    target.container,
                    pod.name_any(),
                    layout.relative()
                ),
            )
            .await;
        let outcome = if layout.dir().exists() {
            // Published by an earlier attempt of this pod (its agent died before `.done`), or
            // by someone else: never overwritten either way.
            self.published_by(pod, &layout)
                .await
                .map_err(|message| CheckpointFailed {
                    cause: FailureCause::Artifact,
                    message,
                })
        } else {
            self.capture(pod, &target, &layout).await
        };
        let outcome = match (outcome, &self.settings.store) {
            (Ok(published), Some(store)) => self.upload(store, &layout, published).await,
            (outcome, _) => outcome,
        };
        self.report_checkpoint(pod, mirror.as_ref(), &layout, &target.hash, outcome)
            .await;
        drop(journalled);
        self.release_hash(&target.hash);
    }

    /// Captures `target` of `pod` into `layout` and hands the artifact to its owner, the
    /// capture's progress going onto its Checkpoint's status.
    async fn capture(
        &self,
        pod: &Pod,
        target: &validate::CheckpointTarget,
        layout: &ArtifactLayout,
    ) -> Result<Published, CheckpointFailed> {
        let namespace = pod.namespace().unwrap_or_default();
        let ops = self.settings.ops.clone();
        let output = layout.dir();
        let source = warmstart_shared::artifact::SourceInfo {
            pod: pod.name_any(),
            namespace: namespace.clone(),
            node: self.settings.node.clone(),
            container: target.container.clone(),
            container_id: target.container_id.clone(),
            image: String::new(),
        };
        let (id, hash) = (target.container_id.clone(), target.hash.clone());
        let owner = self.settings.artifact_owner;
        let ns_dir = layout.namespace_dir();
        // How far the capture is goes onto the Checkpoint's status every few seconds.
        let (updates, updated) = watch::channel(None);
        let status = tokio::spawn(
            report::report_progress(
                Api::namespaced(self.client.clone(), &namespace),
                target.checkpoint.clone(),
                updated,
            )
            .in_current_span(),
        );
        let progress = self.report.progress(Operation::Checkpoint, Some(updates));
        // The engine's lines carry the operation's pod, namespace and hash: its blocking
        // work runs in this span.
        let captured = async {
            let done = ops
                .checkpoint(&id, &output, &hash, source, progress)
                .await?;
            crate::engine::blocking(move || give_to(&ns_dir, &output, owner)).await;
            Ok::<_, OpError>(done)
        }
        .in_current_span()
        .await;
        // The reporter is gone with the capture: the last progress is written before the
        // done signal, so the controller's Ready (which removes it) comes after.
        let _ = status.await;
        match captured {
            Ok(done) => Ok(Published {
                bytes: done.manifest.total_size(),
                timings: done.timings,
                gpus: done.manifest.assigned_gpus,
            }),
            Err(e) => Err(CheckpointFailed {
                cause: e.cause(),
                message: crate::report::error_chain(&e),
            }),
        }
    }

    /// Uploads the artifact published at `layout` to the object store (nothing is sent when the
    /// bucket holds it complete already), before the checkpoint is reported done.
    async fn upload(
        &self,
        store: &warmstart_objstore::Store,
        layout: &ArtifactLayout,
        published: Published,
    ) -> Result<Published, CheckpointFailed> {
        let progress = warmstart_objstore::Progress::new();
        match store
            .upload(&layout.dir(), layout.namespace(), layout.hash(), &progress)
            .in_current_span()
            .await
        {
            Ok(report) => {
                info!(?report, store = %store.config().describe(), "artifact uploaded to the object store");
                Ok(published)
            }
            Err(e) => Err(CheckpointFailed {
                cause: FailureCause::Publish,
                message: format!(
                    "published {} on the artifact volume, but cannot upload it to the object store {}: {}",
                    layout.relative(),
                    store.config().describe(),
                    crate::report::error_chain(&e)
                ),
            }),
        }
    }

    fn release_hash(&self, hash: &str) {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .hashes
            .remove(hash);
    }

    /// Whether the artifact at `layout` is complete and was captured from `pod`.
    async fn published_by(&self, pod: &Pod, layout: &ArtifactLayout) -> Result<Published, String> {
        let dir = layout.dir();
        let read =
            tokio::task::spawn_blocking(move || read_published(&dir, Verification::Sizes)).await;
        match read {
            Ok(Ok(m))
                if m.source.pod == pod.name_any()
                    && m.source.namespace == pod.namespace().unwrap_or_default() =>
            {
                Ok(Published {
                    bytes: m.total_size(),
                    timings: Timings::default(),
                    gpus: m.assigned_gpus,
                })
            }
            Ok(Ok(m)) => Err(format!(
                "an artifact is already published at {} (captured from pod {}/{}); a published artifact is never overwritten",
                layout.relative(),
                m.source.namespace,
                m.source.pod
            )),
            Ok(Err(e)) => Err(format!(
                "{} exists but is not a complete artifact: {}; it is not overwritten",
                layout.relative(),
                crate::report::error_chain(&e)
            )),
            Err(e) => Err(format!("artifact check failed: {e}")),
        }
    }

    async fn finish_interrupted_checkpoint(
        &self,
        pod: &Pod,
        layout: Option<(&ArtifactLayout, &str)>,
    ) {
        let uid = pod.uid().unwrap_or_default();
        warn!("found a checkpoint interrupted by an agent restart");
        self.give_back_gpu(pod).await;
        if let Some((layout, hash)) = layout {
            // A capture the dead agent sealed is finished (verified, published), not lost.
            let (dir, max_age) = (layout.dir(), self.settings.limits.staging_max_age());
            let _ = tokio::task::spawn_blocking(move || {
                crate::checkpoint::recover_interrupted(&dir, max_age)
            })
            .await;
            let outcome = self
                .published_by(pod, layout)
                .await
                .map_err(|_| CheckpointFailed {
                    cause: FailureCause::Interrupted,
                    message: "the agent restarted during the checkpoint; nothing was published"
                        .to_owned(),
                });
            self.report_checkpoint(pod, None, layout, hash, outcome)
                .await;
        }
        self.journal.remove_checkpoint(&uid);
    }

    /// Gives back the GPU state an interrupted checkpoint may have left held: every CUDA process
    /// of the journalled container found locked or checkpointed is restored and unlocked, so the
    /// workload is not left frozen on its GPU (the dead agent's hold died with it).
    async fn give_back_gpu(&self, pod: &Pod) {
        let uid = pod.uid().unwrap_or_default();
        let Some(entry) = self.journal.checkpoint_entry(&uid) else {
            return;
        };
        // A container no longer running holds no GPU state.
        let Ok(id) = validate::running_container_id(pod, &entry.container) else {
            return;
        };
        match self.settings.ops.give_back_gpu(&id).await {
            Ok(pids) if pids.is_empty() => {}
            Ok(pids) => {
                warn!(?pids, container = %entry.container, "gave back the GPU state the interrupted checkpoint held");
                let note = format!(
                    "the agent restarted during a checkpoint of container {}; gave the GPU state of process(es) {pids:?} back",
                    entry.container
                );
                self.report
                    .event(pod, EventType::Warning, "GpuStateReleased", &note)
                    .await;
            }
            Err(e) => {
                error!(error = %e, container = %entry.container, "cannot give back the GPU state an interrupted checkpoint held");
                let note = format!(
                    "the agent restarted during a checkpoint of container {} and cannot give its GPU state back: {e}",
                    entry.container
                );
                self.report
                    .event(pod, EventType::Warning, "GpuStateHeld", &note)
                    .await;
            }
        }
    }

    async fn report_checkpoint(
        &self,
        pod: &Pod,
        mirror: Option<&ObjectReference>,
        layout: &ArtifactLayout,
        hash: &str,
        outcome: Result<Published, CheckpointFailed>,
    ) {
        let uid = pod.uid().unwrap_or_default();
        let (success, error, timings) = match &outcome {
            Ok(p) => (true, None, p.timings.clone()),
            Err(e) => (false, Some(e.message.clone()), Timings::default()),
        };
        let done = DoneSignal {
            hash: hash.to_owned(),
            location: layout.relative(),
            success,
            error: error.clone(),
            timings: timings.as_seconds(),
            timestamp: now(),
        };
        let name = names::done_file_name(hash);
        let written = serde_json::to_vec(&done)
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                podvols::signal_dir(&self.settings.kubelet_root, &uid)
                    .and_then(|dir| dir.write(&name, &bytes))
                    .map_err(std::io::Error::from)
            });
        if let Err(e) = &written {
            error!(error = %e, "cannot write the done signal");
        }
        match outcome {
            Ok(Published {
                bytes,
                timings,
                gpus,
            }) => {
                info!(bytes, location = %layout.relative(), "checkpoint published");
                self.metrics
                    .finished(Operation::Checkpoint, Ended::Success, Some(&timings));
                self.metrics.published(bytes);
                self.report
                    .checkpoint_event(
                        pod,
                        mirror,
                        EventType::Normal,
                        "Checkpointed",
                        &format!(
                            "published {} ({bytes} bytes) in {:.2}s; GPUs: {}",
                            layout.relative(),
                            timings.total().as_secs_f64(),
                            gpus.map_or_else(|| "none".to_owned(), |g| g.to_string())
                        ),
                    )
                    .await;
            }
            Err(CheckpointFailed { cause, message }) => {
                warn!(error = %message, cause = cause.as_str(), "checkpoint failed");
                self.metrics
                    .finished(Operation::Checkpoint, Ended::Failure(cause), None);
                self.report
                    .checkpoint_event(
                        pod,
                        mirror,
                        EventType::Warning,
                        "CheckpointFailed",
                        &message,
                    )
                    .await;
            }
        }
    }

    // ------------------------------------------------------------------------------------
    // Restore
    // ------------------------------------------------------------------------------------

    async fn restore_pod(self: &Arc<Self>, pod: &Pod, pending: Vec<Pending>) {
        let uid = pod.uid().unwrap_or_default();
        // Interrupted first: an in-progress status (or a journal entry) with no operation
        // running here is the work of an agent that died; it is reported, never redone.
        let (interrupted, fresh) =
            plan::split_interrupted(pending, |c| self.journal.has_restore(&uid, c));
        for container in &interrupted {
            self.finish_interrupted_restore(pod, container).await;
        }
        if fresh.is_empty() {
            return;
        }
        let intent = match validate::restore_intent(&self.settings.node, pod) {
            Ok(Some(intent)) => intent,
            Ok(None) => return,
            Err(r) => {
                if plan::on_refusal(&r, false) == OnRefusal::Refuse {
                    self.report.restore_refused(pod, &fresh, &r).await;
                }
                return;
            }
        };
        let Some((checkpoint, layout)) = self.restore_checkpoint(pod, &fresh, &intent).await else {
            return;
        };
        let ck = &checkpoint;
        // Held (never evicted) until every restore of the pod ended.
        let pinned = ck
            .status
            .as_ref()
            .and_then(|s| s.artifact.as_ref())
            .map(|a| a.manifest_digest.clone());
        let Some((dir, _cached)) = self
            .artifact_to_read(pod, &fresh, &layout, pinned.as_deref())
            .await
        else {
            return;
        };
        let read_from = dir.clone();
        let manifest = match tokio::task::spawn_blocking(move || {
            read_published(&read_from, Verification::Sizes)
        })
        .await
        {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => {
                let message = format!(
                    "artifact {} is unusable: {}",
                    layout.relative(),
                    crate::report::error_chain(&e)
                );
                self.report
                    .restore_unusable(pod, &fresh, "artifact", FallbackReason::Artifact, &message)
                    .await;
                return;
            }
            Err(e) => {
                warn!(error = %e, "artifact check task failed; retrying later");
                return;
            }
        };
        let valid = match validate::restore_targets(pod, &intent, Some(&checkpoint), &manifest) {
            Ok(valid) => valid,
            Err(r) => {
                if plan::on_refusal(&r, false) == OnRefusal::Refuse {
                    self.report.restore_refused(pod, &fresh, &r).await;
                }
                return;
            }
        };
        // Debug builds pause here when asked (the tests change the artifact at this point).
        if cfg!(debug_assertions) {
            let state_dir = self.settings.state_dir.clone();
            crate::engine::blocking(move || {
                crate::fault::point_until_resumed("restore-after-validation", &state_dir);
            })
            .await;
        }
        let mut restores = JoinSet::new();
        for target in valid
            .targets
            .into_iter()
            .filter(|t| fresh.contains(&t.container))
        {
            let pod = pod.clone();
            let artifact = Validated {
                dir: dir.clone(),
                manifest_digest: valid.manifest_digest.clone(),
            };
            let agent = self.clone();
            restores.spawn(
                async move { agent.restore_container(&pod, &artifact, &target).await }
                    .instrument(tracing::Span::current()),
            );
        }
        while restores.join_next().await.is_some() {}
    }

    /// The live Checkpoint a restore pod asks for and where its artifact is; `None` when it
    /// cannot be read now (retried later) or is refused (reported).
    async fn restore_checkpoint(
        &self,
        pod: &Pod,
        fresh: &[String],
        intent: &validate::RestoreIntent,
    ) -> Option<(Checkpoint, ArtifactLayout)> {
        let namespace = pod.namespace().unwrap_or_default();
        let checkpoints: Api<Checkpoint> = Api::namespaced(self.client.clone(), &namespace);
        let checkpoint = match checkpoints.get_opt(&intent.checkpoint).await {
            Ok(found) => found,
            Err(e) => {
                warn!(error = %e, "cannot read the Checkpoint; retrying later");
                return None;
            }
        };
        let Some(ck) = checkpoint else {
            let r = Refusal::CheckpointMissing(intent.checkpoint.clone());
            self.report.restore_refused(pod, fresh, &r).await;
            return None;
        };
        let hash = ck
            .status
            .as_ref()
            .and_then(|s| s.identity_hash.clone())
            .unwrap_or_default();
        tracing::Span::current().record("checkpoint.hash", hash.as_str());
        match ArtifactLayout::new(&self.settings.artifact_root, &namespace, &hash) {
            Ok(layout) => Some((ck, layout)),
            Err(source) => {
                let r = Refusal::ArtifactPath {
                    checkpoint: intent.checkpoint.clone(),
                    source,
                };
                self.report.restore_refused(pod, fresh, &r).await;
                None
            }
        }
    }

    /// Where the restores of `pod` read the artifact at `layout` whose manifest the Checkpoint
    /// pins with `digest`: the artifact volume, or the node's cache (fetched there first when
    /// missing, from the object store when there is one, else from the artifact volume). `None`
    /// when the cache cannot give it: the restores are then answered (`restore-failed`) and the
    /// pod cold starts. Without a pinned digest the artifact volume's copy is validated (and
    /// refused: the Checkpoint is not Ready).
    async fn artifact_to_read(
        &self,
        pod: &Pod,
        fresh: &[String],
        layout: &ArtifactLayout,
        digest: Option<&str>,
    ) -> Option<(PathBuf, Option<crate::cache::Held>)> {
        let (Some(cache), Some(digest)) = (&self.settings.cache, digest) else {
            return Some((layout.dir(), None));
        };
        let namespace = layout.namespace();
        let source = crate::store_source::for_artifact(self.settings.store.as_ref(), layout);
        let got = cache
            .get(namespace, layout.hash(), digest, source.as_ref())
            .await;
        match got {
            Ok(held) => {
                let result = if held.fetched() {
                    CacheResult::Fetched
                } else {
                    CacheResult::Hit
                };
                info!(artifact = %held.dir().display(), result = result.as_str(), "restoring from the node's cache");
                self.count_cache_read(cache, result).await;
                Some((held.dir().to_path_buf(), Some(held)))
            }
            Err(e) => {
                self.count_cache_read(cache, CacheResult::Failed).await;
                let message = format!(
                    "artifact {} cannot be read through the node's cache: {}",
                    layout.relative(),
                    crate::report::error_chain(&e)
                );
                self.report
                    .restore_unusable(pod, fresh, "artifact", FallbackReason::Artifact, &message)
                    .await;
                None
            }
        }
    }

    /// Counts a read of the node's cache (`hit`, `fetched`, `failed`); after a fetch or a
    /// failure, which may have evicted or added artifacts, the cache's size too (a walk of its
    /// manifests, off the executor; a hit changes nothing).
    async fn count_cache_read(&self, cache: &Arc<crate::cache::Cache>, result: CacheResult) {
        let bytes = if result == CacheResult::Hit {
            None
        } else {
            let cache = cache.clone();
            tokio::task::spawn_blocking(move || cache.bytes())
                .await
                .ok()
        };
        self.metrics.cache_read(result, bytes);
    }

    async fn restore_container(
        &self,
        pod: &Pod,
        artifact: &Validated,
        target: &validate::RestoreTarget,
    ) {
        let (container, container_id) = (target.container.as_str(), target.container_id.as_str());
        let uid = pod.uid().unwrap_or_default();
        let Ok(_permit) = self.restores.acquire().await else {
            return;
        };
        let _in_flight = self.metrics.start(Operation::Restore);
        let entry = JournalEntry {
            operation: JournalOperation::Restore,
            pod: pod.name_any(),
            namespace: pod.namespace().unwrap_or_default(),
            container: container.to_owned(),
            started_at: now(),
        };
        // Removed when this restore's outcome is recorded (or it is abandoned unstarted).
        let _journalled = match self.journal.record(&uid, &entry) {
            Ok(journalled) => journalled,
            Err(e) => {
                error!(error = %e, journal = %self.journal.dir().display(), "cannot journal the restore; not starting it");
                return;
            }
        };
        if let Err(e) = self
            .report
            .set_restore_status(pod, container, RestoreStatus::InProgress)
            .await
        {
            warn!(error = %e, "cannot set the restore status; not starting the restore");
            return;
        }
        info!(container, container.id = container_id, "restore started");
        self.report
            .event(
                pod,
                EventType::Normal,
                "Restoring",
                &format!(
                    "restoring container {container} from {}",
                    artifact.dir.display()
                ),
            )
            .await;
        let log_dir = self
            .settings
            .state_dir
            .join("restores")
            .join(&uid)
            .join(container);
        let progress = self.report.progress(Operation::Restore, None);
        let control_dir = podvols::control_path(&self.settings.kubelet_root, &uid, container);
        let order = Restore {
            artifact: &artifact.dir,
            container_id,
            manifest_digest: &artifact.manifest_digest,
            log_dir: &log_dir,
            control_dir: &control_dir,
        };
        let result = self.settings.ops.restore(order, progress).await;
        match result {
            Ok(restored) => {
                info!(container, pid = restored.pid, "restore completed");
                self.metrics
                    .finished(Operation::Restore, Ended::Success, Some(&restored.timings));
                let _ = self
                    .report
                    .set_restore_status(pod, container, RestoreStatus::Completed)
                    .await;
                self.report
                    .event(
                        pod,
                        EventType::Normal,
                        "Restored",
                        &format!(
                            "restored container {container} in {:.2}s",
                            restored.timings.total().as_secs_f64()
                        ),
                    )
                    .await;
            }
            Err(e) => {
                let message = crate::report::error_chain(&e);
                self.metrics
                    .finished(Operation::Restore, Ended::Failure(e.cause()), None);
                self.report
                    .restore_failed(pod, container, FallbackReason::Failed, &message)
                    .await;
            }
        }
    }

    async fn finish_interrupted_restore(&self, pod: &Pod, container: &str) {
        let uid = pod.uid().unwrap_or_default();
        let complete = podvols::control_dir(&self.settings.kubelet_root, &uid, container)
            .and_then(|dir| dir.has_file(names::FILE_RESTORE_COMPLETE))
            .unwrap_or_else(|e| {
                warn!(container, error = %e, "cannot look for restore-complete: taken as missing");
                false
            });
        if complete {
            info!(
                container,
                "restore interrupted by an agent restart had completed"
            );
            let _ = self
                .report
                .set_restore_status(pod, container, RestoreStatus::Completed)
                .await;
            self.report.event(
                pod,
                EventType::Normal,
                "Restored",
                &format!(
                    "restore of container {container} completed (recorded after an agent restart)"
                ),
            )
            .await;
        } else {
            warn!(
                container,
                "restore interrupted by an agent restart: reported failed"
            );
            // Whatever the dead agent left in the placeholder never got `restore-complete` (it
            // may even be stopped, its memory unverified): it goes, so the pod can cold start.
            let killed = match validate::running_container_id(pod, container) {
                Ok(id) => self.settings.ops.kill_restored(&id).await,
                Err(_) => Vec::new(),
            };
            self.metrics.finished(
                Operation::Restore,
                Ended::Failure(FailureCause::Interrupted),
                None,
            );
            let reason = if killed.is_empty() {
                "the agent restarted during the restore; nothing was restored".to_owned()
            } else {
                format!(
                    "the agent restarted during the restore; the unfinished restored tree (host pids {killed:?}) was killed"
                )
            };
            self.report
                .restore_failed(pod, container, FallbackReason::Interrupted, &reason)
                .await;
        }
        self.journal.remove_restore(&uid, container);
    }
}

/// Hands a published artifact to `owner`, the controller's user, which deletes artifacts by
/// policy (see [`crate::publish::give_directories_to`]: its files stay root's and read-only).
fn give_to(namespace_dir: &Path, artifact: &Path, owner: (u32, u32)) {
    if let Err(e) = crate::publish::give_directories_to(namespace_dir, artifact, owner) {
        warn!(error = %e, artifact = %artifact.display(), uid = owner.0, gid = owner.1, "cannot hand the artifact to its owner");
    }
}

/// The artifact a validated restore restores: where it is, and the manifest digest it was
/// validated against (the engine refuses one whose verified manifest has another).
#[derive(Clone, Debug)]
struct Validated {
    /// The artifact directory.
    dir: PathBuf,
    /// `status.artifact.manifestDigest` of the Checkpoint, which the pod's binding pins.
    manifest_digest: String,
}

/// A validated checkpoint source: what to capture, where it goes, and the Checkpoint its
/// Events are mirrored on.
#[derive(Debug)]
struct Source {
    target: validate::CheckpointTarget,
    layout: ArtifactLayout,
    mirror: Option<ObjectReference>,
}

/// A checkpoint that published nothing: why, for the done signal and the Events, and its cause
/// for the failures counter.
#[derive(Debug)]
struct CheckpointFailed {
    cause: FailureCause,
    message: String,
}

/// A published artifact, as a checkpoint reports it.
#[derive(Debug)]
struct Published {
    /// Its size.
    bytes: u64,
    /// Phase timings (none for one found published).
    timings: Timings,
    /// The GPUs its container was given.
    gpus: Option<warmstart_shared::artifact::AssignedGpus>,
}
