//! `warmstart-controller run`: the cluster controller. Serves the admin endpoint and the
//! admission webhook on every replica; campaigns for the leader Lease and, while leader, runs
//! the Checkpoint reconciler (owning and watching checkpoint Jobs) and the staging sweeper.
//! SIGTERM or SIGINT stops everything gracefully (the lease is released).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE;

use clap::Args;
use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use kube::Client;
use kube::api::Api;
use kube::runtime::controller::Controller;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher;
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};
use warmstart_shared::names::{DEFAULT_ARTIFACT_ROOT, LABEL_CHECKPOINT_NAME};
use warmstart_shared::{Checkpoint, CheckpointPhase};

use crate::leader::{self, LeaderConfig};
use crate::metrics::Metrics;
use crate::reconcile::{self, Context, FIELD_MANAGER};
use warmstart_shell::admin::{self, Health};
use warmstart_shell::shutdown;

/// Flags of `run` (every one also readable from the environment).
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Root of the artifact volume (the RWX PVC).
    #[arg(long, env = "WARMSTART_ARTIFACT_ROOT", default_value = DEFAULT_ARTIFACT_ROOT)]
    pub artifact_root: PathBuf,
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    #[arg(long, env = "WARMSTART_ADMIN_LISTEN", default_value = "0.0.0.0:8080")]
    pub admin_listen: SocketAddr,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "warmstart-system")]
    pub leader_election_namespace: String,
    /// Name of the leader Lease.
    #[arg(
        long,
        env = "WARMSTART_LEASE_NAME",
        default_value = "warmstart-controller"
    )]
    pub lease_name: String,
    /// This replica's identity in the Lease (its pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Lease duration in seconds.
    #[arg(long, env = "WARMSTART_LEASE_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub lease_seconds: u64,
    /// Staging directories older than this many seconds are removed.
    #[arg(long, env = "WARMSTART_STAGING_MAX_AGE_SECONDS", default_value_t = 6 * 3600, value_parser = clap::value_parser!(u64).range(60..))]
    pub staging_max_age_seconds: u64,
    /// How often the sweeper runs, in seconds.
    #[arg(long, env = "WARMSTART_SWEEP_INTERVAL_SECONDS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    pub sweep_interval_seconds: u64,
    /// Image of the init container that copies `warmstart-entrypoint` into pods of checkpoints
    /// with `spec.job.entrypoint: Wrap` (the agent image ships it).
    #[arg(long, env = "WARMSTART_ENTRYPOINT_IMAGE", default_value = DEFAULT_ENTRYPOINT_IMAGE)]
    pub entrypoint_image: String,
    /// The admission webhook.
    #[command(flatten)]
    pub webhook: crate::webhook::WebhookArgs,
    /// The object store (S3-compatible) the agents upload artifacts to: artifacts are verified
    /// there before a Checkpoint is Ready, deleted there by policy, and uploads left unfinished
    /// longer than the staging age are aborted.
    #[command(flatten)]
    pub s3: warmstart_objstore::Args,
}

/// Why the controller stopped with an error.
#[derive(Debug, Error)]
pub enum RunError {
    /// No usable kubeconfig or in-cluster configuration.
    #[error("cannot configure the Kubernetes client")]
    Client(#[source] kube::Error),
    /// The admin endpoint could not be served.
    #[error(transparent)]
    Admin(#[from] warmstart_shell::admin::AdminError),
    /// The artifact root is unusable.
    #[error("artifact root {0} must be an absolute path to a directory")]
    ArtifactRoot(PathBuf),
    /// Installing the signal handler failed.
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
    /// The webhook certificate could not be issued or installed.
    #[error("cannot set up the webhook certificate")]
    Certs(#[source] crate::certs::CertError),
    /// The webhook server failed.
    #[error("admission webhook failed")]
    Webhook(#[source] crate::webhook::WebhookError),
    /// The object store settings cannot be used.
    #[error("cannot use the object store")]
    Store(#[source] warmstart_objstore::StoreError),
}

/// Runs the controller until SIGTERM/SIGINT.
///
/// # Errors
/// [`RunError`] for start-up problems.
pub async fn run(args: RunArgs) -> Result<(), RunError> {
    if !args.artifact_root.is_absolute() || !args.artifact_root.is_dir() {
        return Err(RunError::ArtifactRoot(args.artifact_root.clone()));
    }
    let store = match args.s3.config() {
        Ok(Some(config)) => Some(warmstart_objstore::Store::new(config).map_err(RunError::Store)?),
        Ok(None) => None,
        Err(e) => return Err(RunError::Store(e.into())),
    };
    let client = Client::try_default().await.map_err(RunError::Client)?;
    let identity = args.identity.clone().unwrap_or_else(|| {
        nix_hostname().unwrap_or_else(|| format!("warmstart-controller-{}", std::process::id()))
    });
    let metrics = Arc::new(Metrics::default());
    let health = Arc::new(Health::default());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    shutdown::on_signals(shutdown_tx.clone()).map_err(RunError::Signals)?;
    let admin = admin::serve(
        args.admin_listen,
        health.clone(),
        metrics.clone(),
        shutdown_rx.clone(),
    )
    .await?;
    let (certs_task, webhook) =
        start_webhook(&args, &client, &metrics, shutdown_tx, &shutdown_rx).await?;
    health.ready.store(true, Ordering::Relaxed);
    info!(identity = %identity, admin = %args.admin_listen, webhook = %args.webhook.listen, "controller started");

    let (leader_tx, leader_rx) = watch::channel(false);
    let cfg = LeaderConfig {
        namespace: args.leader_election_namespace.clone(),
        name: args.lease_name.clone(),
        identity: identity.clone(),
        lease_duration: Duration::from_secs(args.lease_seconds),
        retry_period: Duration::from_secs((args.lease_seconds / 3).max(1)),
    };
    let election = tokio::spawn(leader::run(
        client.clone(),
        cfg,
        leader_tx,
        shutdown_rx.clone(),
    ));
    let ctx = Arc::new(Context {
        client: client.clone(),
        artifact_root: args.artifact_root.clone(),
        store,
        entrypoint_image: args.entrypoint_image.clone(),
        metrics: metrics.clone(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.to_owned(),
                instance: Some(identity.clone()),
            },
        ),
        failures: std::sync::Mutex::default(),
    });
    lead_while_elected(&client, &ctx, &args, leader_rx, shutdown_rx).await;
    let _ = election.await;
    if let Some(task) = certs_task {
        let _ = task.await;
    }
    match webhook.await {
        Ok(Err(e)) => return Err(RunError::Webhook(e)),
        Err(e) => warn!(error = %e, "webhook task failed"),
        Ok(Ok(())) => {}
    }
    match admin.await {
        Ok(Err(e)) => warn!(error = %e, "admin endpoint failed"),
        Err(e) => warn!(error = %e, "admin endpoint task failed"),
        Ok(Ok(())) => {}
    }
    info!("controller stopped");
    Ok(())
}

/// The webhook's serving task and, with `--webhook-self-signed`, the task rotating its
/// certificate.
type WebhookTasks = (
    Option<JoinHandle<()>>,
    JoinHandle<Result<(), crate::webhook::WebhookError>>,
);

/// Starts the admission webhook (every replica serves it). With `--webhook-self-signed` the
/// certificate comes from (and is rotated in) a Secret, else from files mounted by
/// cert-manager or the operator. A webhook that stops serving stops the whole controller.
async fn start_webhook(
    args: &RunArgs,
    client: &Client,
    metrics: &Arc<Metrics>,
    shutdown_tx: watch::Sender<bool>,
    shutdown_rx: &watch::Receiver<bool>,
) -> Result<WebhookTasks, RunError> {
    let mut certs_task = None;
    if args.webhook.certs.self_signed {
        let settings = args.webhook.cert_settings();
        crate::certs::ensure(client, &settings)
            .await
            .map_err(RunError::Certs)?;
        certs_task = Some(tokio::spawn(crate::certs::maintain(
            client.clone(),
            settings,
            Duration::from_secs(60),
            shutdown::requested(shutdown_rx.clone()),
        )));
    }
    let admission = crate::webhook::Admission::new(
        Arc::new(crate::webhook::ApiCheckpointSource::new(client.clone())),
        metrics.clone(),
    )
    .with_entrypoint_image(args.entrypoint_image.clone());
    let webhook_listener = tokio::net::TcpListener::bind(args.webhook.listen)
        .await
        .map_err(|source| {
            RunError::Webhook(crate::webhook::WebhookError::Bind {
                addr: args.webhook.listen,
                source,
            })
        })?;
    let serving = crate::webhook::serve_listener(
        webhook_listener,
        args.webhook.tls_source(),
        admission,
        shutdown::requested(shutdown_rx.clone()),
    );
    // A webhook that cannot serve (no certificate) stops the whole controller: pods asking for
    // a restore would otherwise be refused by a replica that reports itself ready.
    let webhook = tokio::spawn(async move {
        let result = serving.await;
        if let Err(e) = &result {
            warn!(error = %crate::errors::error_chain(e), "admission webhook stopped");
            shutdown_tx.send_replace(true);
        }
        result
    });
    Ok((certs_task, webhook))
}

/// Reconciles while this replica holds the Lease, waits while it does not, until shutdown.
async fn lead_while_elected(
    client: &Client,
    ctx: &Arc<Context>,
    args: &RunArgs,
    mut leader_rx: watch::Receiver<bool>,
    shutdown_rx: watch::Receiver<bool>,
) {
    loop {
        if *shutdown_rx.borrow() {
            break;
        }
        if !*leader_rx.borrow() {
            let mut stop = shutdown_rx.clone();
            tokio::select! {
                _ = leader_rx.changed() => continue,
                _ = stop.changed() => break,
            }
        }
        info!("leading: reconciling checkpoints");
        lead(
            client,
            ctx.clone(),
            args,
            leader_rx.clone(),
            shutdown_rx.clone(),
        )
        .await;
        info!("stopped reconciling");
    }
}

/// Runs the reconciler, the phase gauge and the sweeper until leadership is lost or shutdown.
async fn lead(
    client: &Client,
    ctx: Arc<Context>,
    args: &RunArgs,
    leader_rx: watch::Receiver<bool>,
    shutdown_rx: watch::Receiver<bool>,
) {
    let stop = {
        let (mut leader_rx, mut shutdown_rx) = (leader_rx, shutdown_rx);
        async move {
            loop {
                if !*leader_rx.borrow() || *shutdown_rx.borrow() {
                    return;
                }
                tokio::select! {
                    r = leader_rx.changed() => if r.is_err() { return },
                    r = shutdown_rx.changed() => if r.is_err() { return },
                }
            }
        }
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let checkpoints: Api<Checkpoint> = Api::all(client.clone());
    let jobs: Api<Job> = Api::all(client.clone());
    let controller = Controller::new(checkpoints, watcher::Config::default()).owns(
        jobs,
        watcher::Config::default().labels(LABEL_CHECKPOINT_NAME),
    );
    let store = controller.store();
    let metrics = ctx.metrics.clone();
    let storage = if ctx.store.is_some() { "s3" } else { "pvc" };
    let gauge_stop = shutdown::requested(stop_rx.clone());
    let gauge = tokio::spawn(async move {
        tokio::pin!(gauge_stop);
        loop {
            let checkpoints = store.state();
            metrics.set_phases(&phase_counts(&checkpoints));
            metrics.set_artifact_bytes(storage, artifact_bytes(&checkpoints));
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(5)) => {}
                () = &mut gauge_stop => return,
            }
        }
    });
    let root = args.artifact_root.clone();
    let bucket = ctx.store.clone();
    let max_age = Duration::from_secs(args.staging_max_age_seconds);
    let interval = Duration::from_secs(args.sweep_interval_seconds);
    let sweep_stop = shutdown::requested(stop_rx.clone());
    let sweeper = tokio::spawn(async move {
        tokio::pin!(sweep_stop);
        loop {
            sweep(&root, bucket.as_ref(), max_age).await;
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = &mut sweep_stop => return,
            }
        }
    });
    controller
        .graceful_shutdown_on(stop)
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|_| async {})
        .await;
    stop_tx.send_replace(true);
    let _ = gauge.await;
    let _ = sweeper.await;
}

/// Checkpoints per phase.
fn phase_counts(checkpoints: &[Arc<Checkpoint>]) -> Vec<(CheckpointPhase, usize)> {
    let mut counts: Vec<(CheckpointPhase, usize)> = Vec::new();
    for phase in checkpoints
        .iter()
        .filter_map(|ck| ck.status.as_ref().and_then(|s| s.phase))
    {
        match counts.iter_mut().find(|(p, _)| *p == phase) {
            Some((_, n)) => *n += 1,
            None => counts.push((phase, 1)),
        }
    }
    counts
}

/// Bytes of the Ready Checkpoints' artifacts, each artifact (namespace and identity hash) once:
/// Checkpoints of one identity share it.
fn artifact_bytes(checkpoints: &[Arc<Checkpoint>]) -> u64 {
    let mut seen = std::collections::HashSet::new();
    checkpoints
        .iter()
        .filter_map(|ck| {
            let status = ck.status.as_ref()?;
            let artifact = status.artifact.as_ref()?;
            let hash = status.identity_hash.as_ref()?;
            (status.phase == Some(CheckpointPhase::Ready)
                && seen.insert((ck.metadata.namespace.clone(), hash.clone())))
            .then_some(artifact.size_bytes)
        })
        .sum()
}

/// Removes what crashed captures and uploads left: staging directories on the artifact volume
/// and multipart uploads in the bucket older than `max_age`.
async fn sweep(
    root: &std::path::Path,
    bucket: Option<&warmstart_objstore::Store>,
    max_age: Duration,
) {
    let dir = root.to_path_buf();
    match tokio::task::spawn_blocking(move || crate::artifact::sweep_staging(&dir, max_age)).await {
        Ok(Ok(removed)) if !removed.is_empty() => {
            info!(removed = removed.len(), "swept stale staging directories");
        }
        Ok(Err(e)) => warn!(error = %crate::errors::error_chain(&e), "staging sweep failed"),
        _ => {}
    }
    if let Some(bucket) = bucket {
        match bucket.sweep_stale_uploads(max_age).await {
            Ok(0) => {}
            Ok(aborted) => info!(
                aborted,
                "aborted stale multipart uploads in the object store"
            ),
            Err(e) => {
                warn!(error = %crate::errors::error_chain(&e), "object store upload sweep failed");
            }
        }
    }
}

fn nix_hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}
