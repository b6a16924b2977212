//! Cluster mode, `warmstart-agent run`: the DaemonSet's per-node agent. Watches the pods bound
//! to its node and the signal directories of checkpoint sources, decides what a pod calls for
//! ([`plan`]), validates before acting ([`validate`]), checkpoints and restores through the node engine ([`ops`]), reports through
//! `.done`, `restore-failed`, pod annotations, Events and metrics, labels its node ready, and
//! pre-stages the artifacts of Checkpoints that select its node into its cache ([`prestage`]).

pub mod journal;
pub mod metrics;
pub mod node;
pub mod ops;
pub mod plan;
pub mod podvols;
mod prestage;
pub mod readiness;
pub mod report;
pub mod signals;
pub mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kube::Client;
use kube::runtime::events::{Recorder, Reporter};
use thiserror::Error;
use tokio::sync::watch;
use tracing::{info, warn};
use warmstart_shared::names::DEFAULT_ARTIFACT_ROOT;

use self::metrics::Metrics;
use self::node::{FIELD_MANAGER, Settings};
use self::ops::NodeTools;
use self::readiness::Requirements;
use warmstart_shell::admin::{self, Health};
use warmstart_shell::shutdown;

/// Flags of `run` (every one also readable from the environment).
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// This node's name (the Downward API's `spec.nodeName`).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The kubelet's root directory: pods' emptyDir volumes are found below it.
    #[arg(
        long,
        env = "WARMSTART_KUBELET_ROOT",
        default_value = "/var/lib/kubelet"
    )]
    pub kubelet_root: PathBuf,
    /// Root of the artifact volume (the RWX PVC).
    #[arg(long, env = "WARMSTART_ARTIFACT_ROOT", default_value = DEFAULT_ARTIFACT_ROOT)]
    pub artifact_root: PathBuf,
    /// A directory on the node's own disk where restores read artifacts from: each is copied
    /// there from the artifact volume once (verified in full), and later restores on this node
    /// read local disk. Unset: restores read the artifact volume.
    #[arg(long, env = "WARMSTART_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The most the cache may hold, in GiB: least recently used artifacts no restore reads are
    /// evicted to make room.
    #[arg(long, env = "WARMSTART_CACHE_MAX_GIB", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub cache_max_gib: u64,
    /// The object store (S3-compatible) artifacts are uploaded to once published, and restores
    /// fetch them from into the node cache (`--cache-dir`, required with it).
    #[command(flatten)]
    pub s3: warmstart_objstore::Args,
    /// The CRI socket (containerd or CRI-O).
    #[arg(
        long,
        env = "WARMSTART_CRI_SOCKET",
        default_value = "/run/containerd/containerd.sock"
    )]
    pub cri_socket: PathBuf,
    /// containerd's state directory as the agent sees it: where the root filesystems of
    /// `containerd://` containers are (`<dir>/io.containerd.runtime.v2.task/k8s.io/<id>/rootfs`).
    #[arg(
        long,
        env = "WARMSTART_CONTAINERD_STATE_DIR",
        default_value = crate::runtime::cri::CONTAINERD_STATE_DIR
    )]
    pub containerd_state_dir: PathBuf,
    /// The agent's own state: operation journal and restore logs.
    #[arg(
        long,
        env = "WARMSTART_STATE_DIR",
        default_value = "/var/lib/warmstart/agent"
    )]
    pub state_dir: PathBuf,
    /// Checkpoints at once on this node.
    #[arg(long, env = "WARMSTART_MAX_CHECKPOINTS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub max_checkpoints: u16,
    /// Restores at once on this node.
    #[arg(long, env = "WARMSTART_MAX_RESTORES", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub max_restores: u16,
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    #[arg(long, env = "WARMSTART_ADMIN_LISTEN", default_value = "0.0.0.0:9090")]
    pub admin_listen: SocketAddr,
    /// Seconds between looks at every pod of the node (covers missed events).
    #[arg(long, env = "WARMSTART_RESYNC_SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub resync_seconds: u64,
    /// Seconds running operations may take to finish after SIGTERM (keep it below the pod's
    /// terminationGracePeriodSeconds).
    #[arg(long, env = "WARMSTART_SHUTDOWN_GRACE_SECONDS", default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub shutdown_grace_seconds: u64,
    /// `uid:gid` given to published artifacts: the controller's user, which removes them.
    #[arg(long, env = "WARMSTART_ARTIFACT_OWNER", default_value = "65532:65532", value_parser = parse_owner)]
    pub artifact_owner: (u32, u32),
    /// How often the node's preflight runs again, in seconds: a failure removes the node's
    /// `warmstart.dev/agent-ready` label and says why in its `WarmstartAgentReady` condition.
    #[arg(long, env = "WARMSTART_READINESS_CHECK_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(5..=3600))]
    pub readiness_check_seconds: u64,
    /// Pods on this node run through CRI: the node is ready only while `--cri-socket` answers.
    /// (`false` only for nodes whose pods run as runc containers of the agent's own.)
    #[arg(long, env = "WARMSTART_REQUIRE_CRI", default_value_t = true, action = clap::ArgAction::Set)]
    pub require_cri: bool,
    /// The node is ready only with a usable CUDA driver (`false` for nodes without GPUs).
    #[arg(long, env = "WARMSTART_REQUIRE_CUDA", default_value_t = true, action = clap::ArgAction::Set)]
    pub require_cuda: bool,
}

fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (uid, gid) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not uid:gid"))?;
    let id = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("{v:?} in {s:?} is not a numeric id"))
    };
    Ok((id(uid)?, id(gid)?))
}

/// Why the agent stopped with an error.
#[derive(Debug, Error)]
pub enum RunError {
    /// The object store settings are unusable.
    #[error("object store settings")]
    StoreSettings(#[from] warmstart_objstore::ConfigError),
    /// The object store client cannot be made.
    #[error("object store")]
    Store(#[from] warmstart_objstore::StoreError),
    /// The node's artifact cache cannot be opened.
    #[error("cannot open the artifact cache (--cache-dir)")]
    Cache(#[from] crate::cache::CacheError),
    /// A flag's value is unusable.
    #[error("{flag} {path}: {reason}")]
    Setting {
        /// The flag.
        flag: &'static str,
        /// Its value.
        path: PathBuf,
        /// What is wrong.
        reason: &'static str,
    },
    /// The node name is empty.
    #[error("--node-name (NODE_NAME) is empty")]
    NodeName,
    /// No usable kubeconfig or in-cluster configuration.
    #[error("cannot configure the Kubernetes client (in-cluster or KUBECONFIG)")]
    Client(#[source] kube::Error),
    /// The async runtime could not start.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The admin endpoint could not be served.
    #[error(transparent)]
    Admin(#[from] warmstart_shell::admin::AdminError),
    /// Installing the signal handlers failed.
    #[error("cannot install the signal handlers")]
    Signals(#[source] std::io::Error),
    /// The node loop could not start.
    #[error(transparent)]
    Node(#[from] node::NodeError),
    /// This program's path is unknown (it runs the restore helper).
    #[error("cannot find this program's path")]
    Exe(#[source] std::io::Error),
}

impl RunArgs {
    fn check(&self) -> Result<(), RunError> {
        if self.node_name.trim().is_empty() {
            return Err(RunError::NodeName);
        }
        for (flag, path) in [
            ("--kubelet-root", &self.kubelet_root),
            ("--artifact-root", &self.artifact_root),
        ] {
            if !path.is_absolute() {
                return Err(RunError::Setting {
                    flag,
                    path: path.clone(),
                    reason: "must be an absolute path",
                });
            }
            if !path.is_dir() {
                return Err(RunError::Setting {
                    flag,
                    path: path.clone(),
                    reason: "is not a directory",
                });
            }
        }
        if let Some(dir) = &self.cache_dir
            && !dir.is_absolute()
        {
            return Err(RunError::Setting {
                flag: "--cache-dir",
                path: dir.clone(),
                reason: "must be an absolute path",
            });
        }
        if self.s3.endpoint.is_some() && self.cache_dir.is_none() {
            return Err(RunError::Setting {
                flag: "--s3-endpoint",
                path: PathBuf::from(self.s3.endpoint.clone().unwrap_or_default()),
                reason: "needs --cache-dir: restores read artifacts from the object store through the node's cache",
            });
        }
        if !self.state_dir.is_absolute() {
            return Err(RunError::Setting {
                flag: "--state-dir",
                path: self.state_dir.clone(),
                reason: "must be an absolute path",
            });
        }
        Ok(())
    }
}

/// Runs the agent until SIGTERM or SIGINT; exits cleanly after letting running operations
/// finish within the grace period.
///
/// # Errors
/// [`RunError`] for start-up problems.
pub fn run_blocking(
    args: &RunArgs,
    cuda: crate::seams::cuda::CudaSlot,
    criu: PathBuf,
    runc: PathBuf,
    runc_root: PathBuf,
    limits: crate::limits::Limits,
) -> Result<(), RunError> {
    args.check()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("warmstart-agent")
        .build()
        .map_err(RunError::Runtime)?;
    let tools = NodeTools {
        runc,
        runc_root,
        cri_socket: args.cri_socket.clone(),
        cri: crate::runtime::cri::CriOptions {
            containerd_state_dir: args.containerd_state_dir.clone(),
            pod_resources: Some(crate::podresources::socket_under(&args.kubelet_root)),
            ..crate::runtime::cri::CriOptions::default()
        },
        helper: std::env::current_exe().map_err(RunError::Exe)?,
        cuda,
        // Asked once, here: a restore never waits on CRIU for it.
        criu_version: crate::criu::Criu::new(&criu)
            .with_timeout(Duration::from_secs(30))
            .version()
            .ok(),
        criu,
        limits,
    };
    runtime.block_on(run(args.clone(), tools))
}

async fn run(args: RunArgs, tools: NodeTools) -> Result<(), RunError> {
    let client = Client::try_default().await.map_err(RunError::Client)?;
    let metrics = Arc::new(Metrics::default());
    let health = Arc::new(Health::default());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    shutdown::on_signals(shutdown_tx).map_err(RunError::Signals)?;
    let admin = admin::serve(
        args.admin_listen,
        health.clone(),
        metrics.clone(),
        shutdown_rx.clone(),
    )
    .await?;
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: Some(args.node_name.clone()),
        },
    );
    let settings = Settings {
        node: args.node_name.clone(),
        kubelet_root: args.kubelet_root.clone(),
        artifact_root: args.artifact_root.clone(),
        state_dir: args.state_dir.clone(),
        artifact_owner: args.artifact_owner,
        max_checkpoints: usize::from(args.max_checkpoints),
        max_restores: usize::from(args.max_restores),
        resync: Duration::from_secs(args.resync_seconds),
        shutdown_grace: Duration::from_secs(args.shutdown_grace_seconds),
        readiness: Requirements {
            criu: tools.criu.clone(),
            kubelet_root: args.kubelet_root.clone(),
            cri: args
                .require_cri
                .then(|| (tools.cri_socket.clone(), tools.cri.clone())),
            cuda: args.require_cuda.then(|| tools.cuda.clone()),
        },
        readiness_interval: Duration::from_secs(args.readiness_check_seconds),
        limits: tools.limits,
        ops: Arc::new(tools),
        store: match args.s3.config()? {
            Some(config) => Some(warmstart_objstore::Store::new(config)?),
            None => None,
        },
        cache: match &args.cache_dir {
            Some(dir) => Some(Arc::new(crate::cache::Cache::open(
                dir,
                args.cache_max_gib.saturating_mul(1 << 30),
            )?)),
            None => None,
        },
    };
    info!(node = %args.node_name, admin = %args.admin_listen, kubelet_root = %args.kubelet_root.display(), artifact_root = %args.artifact_root.display(), "agent starting");
    let result = node::run(settings, client, metrics, recorder, health, shutdown_rx).await;
    match admin.await {
        Ok(Err(e)) => warn!(error = %e, "admin endpoint failed"),
        Err(e) => warn!(error = %e, "admin endpoint task failed"),
        Ok(Ok(())) => {}
    }
    result.map_err(RunError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_numeric_uid_gid_pairs() {
        assert_eq!(parse_owner("65532:65532"), Ok((65532, 65532)));
        assert_eq!(parse_owner("0:1"), Ok((0, 1)));
        for bad in ["65532", "a:b", "1:", ":1", "-1:0"] {
            assert!(parse_owner(bad).is_err(), "{bad}");
        }
    }
}
