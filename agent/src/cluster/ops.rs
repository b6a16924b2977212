//! The node operations cluster mode drives, behind [`NodeOps`]: a container id from a pod's
//! status resolved to its runtime, then the node engine's checkpoint or restore, through the
//! engine's async API (its blocking work runs on tokio's blocking pool,
//! [`crate::engine::blocking`]); and what recovery does to a container an interrupted operation
//! left behind. [`NodeTools`] is the node's real implementation; the node loop knows only the
//! trait, so its decisions and reports are tested without root against a double.

use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use thiserror::Error;
use warmstart_shared::artifact::{Manifest, SourceInfo};

use super::metrics::FailureCause;
use crate::checkpoint::{CheckpointError, CheckpointRequest};
use crate::engine::{ContainerRef, Engine, EngineError, RestoreOrder, Runtimes};
use crate::progress::Reporter;
use crate::restore::{ControlDir, RestoreError};
use crate::runtime::cri::CriOptions;
use crate::runtime::runc::RuncResolver;
use crate::runtime::{ContainerInfo, ResolveError};
use crate::seams::criu::RpcCriu;
use crate::seams::cuda::CudaSlot;
use crate::timings::Timings;

/// Where the node's runtimes and tools are.
#[derive(Clone, Debug)]
pub struct NodeTools {
    /// The CRIU binary.
    pub criu: PathBuf,
    /// The runc binary (for `runc://` ids).
    pub runc: PathBuf,
    /// runc's state root.
    pub runc_root: PathBuf,
    /// The CRI socket (for `containerd://` and `cri-o://` ids).
    pub cri_socket: PathBuf,
    /// How CRI containers are found on the node (containerd's state directory).
    pub cri: CriOptions,
    /// This program, run as the restore helper.
    pub helper: PathBuf,
    /// The CUDA driver, opened when a GPU workload first needs it.
    pub cuda: CudaSlot,
    /// Deadlines, log cap and staging age.
    pub limits: crate::limits::Limits,
    /// The CRIU's version, asked once at start-up (restores check it against the dump's).
    pub criu_version: Option<crate::criu::CriuVersion>,
}

/// Why an operation failed.
#[derive(Debug, Error)]
pub enum OpError {
    /// The id names no runtime the agent knows.
    #[error("container id {0:?} names no known runtime (containerd://, cri-o://, runc://)")]
    UnknownRuntime(String),
    /// The container could not be resolved.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The restore failed or was refused.
    #[error(transparent)]
    Restore(#[from] RestoreError),
}

impl OpError {
    /// What failed, for the failures counter.
    pub fn cause(&self) -> FailureCause {
        match self {
            Self::UnknownRuntime(_) | Self::Resolve(_) => FailureCause::Container,
            Self::Checkpoint(e) => checkpoint_cause(e),
            Self::Restore(e) => restore_cause(e),
        }
    }
}

fn checkpoint_cause(err: &CheckpointError) -> FailureCause {
    match err {
        CheckpointError::NotRunning(_)
        | CheckpointError::Inspect { .. }
        | CheckpointError::Proc { .. } => FailureCause::Container,
        CheckpointError::Dump { .. } | CheckpointError::Stop { .. } | CheckpointError::Hook(_) => {
            FailureCause::Criu
        }
        CheckpointError::Cuda { .. } | CheckpointError::Gpus { .. } => FailureCause::Gpu,
        CheckpointError::Rootfs { .. } => FailureCause::Rootfs,
        CheckpointError::Publish(_) | CheckpointError::Finished { .. } => FailureCause::Publish,
    }
}

fn restore_cause(err: &RestoreError) -> FailureCause {
    match err {
        RestoreError::UnsafePath { .. }
        | RestoreError::Absent(_)
        | RestoreError::Replaced { .. }
        | RestoreError::Incomplete { .. }
        | RestoreError::Manifest { .. }
        | RestoreError::Files { .. }
        | RestoreError::PageImageSize { .. }
        | RestoreError::Pagemap { .. }
        | RestoreError::View { .. } => FailureCause::Artifact,
        RestoreError::NotRunning(_)
        | RestoreError::NoGpu { .. }
        | RestoreError::PlaceholderGpus { .. }
        | RestoreError::FewerGpus { .. }
        | RestoreError::MissingMounts { .. }
        | RestoreError::Stdio { .. }
        | RestoreError::Cgroups { .. }
        | RestoreError::Occupied(_)
        | RestoreError::ControlMismatch { .. }
        | RestoreError::Unannounced(_) => FailureCause::Placeholder,
        RestoreError::Helper { .. } => FailureCause::Criu,
        RestoreError::GpuRefused { .. } | RestoreError::Cuda { .. } => FailureCause::Gpu,
        RestoreError::Rootfs { .. } => FailureCause::Rootfs,
        RestoreError::LogDir(_) | RestoreError::Io { .. } | RestoreError::OtherNode { .. } => {
            FailureCause::Node
        }
    }
}

/// A published checkpoint.
#[derive(Debug)]
pub struct Checkpointed {
    /// Its manifest.
    pub manifest: Manifest,
    /// Phase timings.
    pub timings: Timings,
}

/// A finished restore.
#[derive(Debug)]
pub struct Restored {
    /// PID of the restored tree's root in the placeholder's PID namespace.
    pub pid: i32,
    /// CRIU's restore log.
    pub log: PathBuf,
    /// Phase timings.
    pub timings: Timings,
}

/// What the node loop asks of its node. Container ids are a pod status's
/// (`<runtime>://<id>`).
pub trait NodeOps: std::fmt::Debug + Send + Sync {
    /// Checkpoints the container into `output` (which must not exist). The workload keeps
    /// running: it learns the outcome from `<hash>.done` and exits by itself.
    fn checkpoint<'a>(
        &'a self,
        container_id: &'a str,
        output: &'a Path,
        hash: &'a str,
        source: SourceInfo,
        progress: Reporter,
    ) -> BoxFuture<'a, Result<Checkpointed, OpError>>;

    /// Restores the artifact into the placeholder container, provided its verified manifest
    /// has the digest the restore was validated against.
    fn restore<'a>(
        &'a self,
        order: Restore<'a>,
        progress: Reporter,
    ) -> BoxFuture<'a, Result<Restored, OpError>>;

    /// Gives back the GPU state an interrupted checkpoint may have left held in the container's
    /// process tree (locked or checkpointed processes restored and unlocked); the processes
    /// given back, or why that failed.
    fn give_back_gpu<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u32>, String>>;

    /// Kills what an interrupted restore left in the placeholder container; the host pids
    /// killed (none when the container cannot be resolved).
    fn kill_restored<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Vec<i32>>;
}

/// One restore as the node loop orders it.
#[derive(Clone, Copy, Debug)]
pub struct Restore<'a> {
    /// The published artifact.
    pub artifact: &'a Path,
    /// The placeholder container.
    pub container_id: &'a str,
    /// The manifest digest the restore was validated against.
    pub manifest_digest: &'a str,
    /// Where CRIU's logs go.
    pub log_dir: &'a Path,
    /// The placeholder's control directory in its pod's layout below the kubelet root
    /// ([`super::podvols::control_path`]): the restore claims and answers there, and refuses a
    /// placeholder that mounts anything else.
    pub control_dir: &'a Path,
}

impl NodeOps for NodeTools {
    fn checkpoint<'a>(
        &'a self,
        container_id: &'a str,
        output: &'a Path,
        hash: &'a str,
        source: SourceInfo,
        progress: Reporter,
    ) -> BoxFuture<'a, Result<Checkpointed, OpError>> {
        Box::pin(NodeTools::checkpoint(
            self,
            container_id,
            output,
            hash,
            source,
            progress,
        ))
    }

    fn restore<'a>(
        &'a self,
        order: Restore<'a>,
        progress: Reporter,
    ) -> BoxFuture<'a, Result<Restored, OpError>> {
        Box::pin(NodeTools::restore(self, order, progress))
    }

    fn give_back_gpu<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u32>, String>> {
        Box::pin(async move {
            let info = self
                .resolve(container_id)
                .await
                .map_err(|e| e.to_string())?;
            let cuda = self.cuda.clone();
            crate::engine::blocking(move || {
                let tree: Vec<u32> = crate::runtime::stat::descendants(info.pid)
                    .into_iter()
                    .filter_map(|p| u32::try_from(p).ok())
                    .collect();
                crate::gpu::reclaim(&cuda, &tree).map_err(|e| crate::report::error_chain(&e))
            })
            .await
        })
    }

    fn kill_restored<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Vec<i32>> {
        Box::pin(async move {
            match self.resolve(container_id).await {
                Ok(info) => {
                    crate::engine::blocking(move || {
                        crate::placeholder::kill_restored_tree(info.pid)
                    })
                    .await
                }
                Err(_) => Vec::new(),
            }
        })
    }
}

impl NodeTools {
    /// The node engine over these tools.
    pub fn engine(&self) -> Engine {
        Engine::new(
            std::sync::Arc::new(RpcCriu::new(&self.criu, &self.helper).with_limits(self.limits)),
            self.cuda.clone(),
            Runtimes {
                runc: RuncResolver::new(&self.runc, &self.runc_root),
                cri_socket: self.cri_socket.clone(),
                cri: self.cri.clone(),
            },
        )
        .knowing_criu(self.criu_version.clone())
    }

    /// The engine's reference to a pod-status container id (`<runtime>://<id>`).
    ///
    /// # Errors
    /// [`OpError::UnknownRuntime`].
    fn reference(container_id: &str) -> Result<ContainerRef, OpError> {
        container_id
            .parse()
            .ok()
            .filter(|r| !matches!(r, ContainerRef::Pid(_)))
            .ok_or_else(|| OpError::UnknownRuntime(container_id.to_owned()))
    }

    /// Resolves a pod-status container id (`<runtime>://<id>`).
    ///
    /// # Errors
    /// [`OpError::UnknownRuntime`] or the resolver's error.
    pub async fn resolve(&self, container_id: &str) -> Result<ContainerInfo, OpError> {
        let reference = Self::reference(container_id)?;
        Ok(self.engine().resolve(&reference).await?)
    }

    /// Checkpoints the container into `output` (which must not exist). The workload keeps
    /// running: it learns the outcome from `<hash>.done` and exits by itself.
    ///
    /// # Errors
    /// [`OpError`].
    pub async fn checkpoint(
        &self,
        container_id: &str,
        output: &Path,
        hash: &str,
        source: SourceInfo,
        progress: Reporter,
    ) -> Result<Checkpointed, OpError> {
        let container = self.resolve(container_id).await?;
        let request = CheckpointRequest {
            container,
            output: output.to_path_buf(),
            identity_hash: hash.to_owned(),
            source,
            leave_running: true,
            tcp_established: false,
        };
        let engine = self.engine();
        let report =
            crate::engine::blocking(move || engine.checkpoint_blocking(&request, &progress))
                .await?;
        Ok(Checkpointed {
            manifest: report.manifest,
            timings: report.timings,
        })
    }

    /// Restores the order's artifact into its placeholder container, provided the verified
    /// manifest has the digest the restore was validated against.
    ///
    /// # Errors
    /// [`OpError`]; [`RestoreError::Replaced`] when the artifact is no longer the one validated.
    pub async fn restore(
        &self,
        restore: Restore<'_>,
        progress: Reporter,
    ) -> Result<Restored, OpError> {
        let order = RestoreOrder {
            artifact: restore.artifact.to_path_buf(),
            into: Self::reference(restore.container_id)?,
            log_dir: restore.log_dir.to_path_buf(),
            manifest_digest: Some(restore.manifest_digest.to_owned()),
            control: ControlDir::Pod(restore.control_dir.to_path_buf()),
        };
        let report = self
            .engine()
            .restore(order, progress)
            .await
            .map_err(|err| match err {
                EngineError::Resolve(e) => OpError::Resolve(e),
                EngineError::Checkpoint(e) => OpError::Checkpoint(e),
                EngineError::Restore(e) => OpError::Restore(e),
            })?;
        Ok(Restored {
            pid: report.pid,
            log: report.log,
            timings: report.timings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> NodeTools {
        NodeTools {
            criu: "criu".into(),
            runc: "runc".into(),
            runc_root: "/nonexistent-runc-root".into(),
            cri_socket: "/nonexistent.sock".into(),
            cri: CriOptions::default(),
            helper: "/proc/self/exe".into(),
            cuda: CudaSlot::none(),
            limits: crate::limits::Limits::default(),
            criu_version: None,
        }
    }

    #[test]
    fn a_replaced_artifact_fails_as_the_artifact_and_an_unknown_id_as_the_container() {
        let replaced = OpError::Restore(RestoreError::Replaced {
            path: "/a".into(),
            expected: "sha256:a".into(),
            found: "sha256:b".into(),
        });
        assert_eq!(replaced.cause(), FailureCause::Artifact);
        assert_eq!(
            OpError::UnknownRuntime("docker://x".into()).cause(),
            FailureCause::Container
        );
    }

    #[tokio::test]
    async fn ids_of_unknown_runtimes_are_refused_by_name() {
        for id in ["docker://abc", "abc", "://abc", "pid://1"] {
            let err = tools().resolve(id).await.unwrap_err();
            assert!(
                matches!(err, OpError::UnknownRuntime(ref s) if s == id),
                "{err}"
            );
        }
    }
}
