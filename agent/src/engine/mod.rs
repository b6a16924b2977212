//! The node engine: the one core that the command line, the DaemonSet and the tests drive.
//!
//! An [`Engine`] holds the CRIU driver ([`criu::CriuDriver`]: the RPC client in production, a
//! recording double in the ordering tests), the CUDA driver's slot ([`cuda::CudaSlot`], opened
//! on first use), the container runtime resolvers ([`container::Runtimes`]) and the settings.
//! Its operations are
//! async and run their blocking work (CRIU, hashing, copies, `/proc` walks) on tokio's
//! blocking pool behind one boundary, [`blocking`]; the `*_blocking` variants run on the
//! calling thread for callers that have no runtime.
//!
//! The steps themselves live in `checkpoint.rs` (container → published artifact) and
//! `restore.rs` (artifact → a running copy in a placeholder), which take the drivers from
//! here.

pub mod container;
use crate::seams::{criu, cuda};
#[cfg(test)]
pub(crate) mod recording;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use thiserror::Error;
use warmstart_shared::artifact::SourceInfo;

use crate::checkpoint::{CheckpointError, CheckpointReport, CheckpointRequest};
use crate::progress::Operation;
use crate::restore::{RestoreError, RestoreReport, RestoreRequest};
use crate::runtime::ResolveError;
use crate::timings::Timings;

pub use container::{ContainerRef, Runtimes};

pub use crate::progress::Reporter as Progress;

/// Runs blocking work on tokio's blocking pool: the engine's one boundary between async and
/// blocking code. The work runs in the caller's tracing span (its lines carry the operation's
/// pod, namespace and hash in cluster mode). A panic in `work` resumes in the caller.
pub async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    let span = tracing::Span::current();
    let work = move || span.in_scope(work);
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => value,
        Err(err) => match err.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // The runtime is shutting down; nothing to return to.
            Err(err) => panic!("blocking engine task cancelled: {err}"),
        },
    }
}

/// Why an engine operation failed.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The container could not be found.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The checkpoint failed (nothing published).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The restore was refused or failed.
    #[error(transparent)]
    Restore(#[from] RestoreError),
}

/// What to checkpoint, besides the container.
#[derive(Clone, Debug)]
pub struct CheckpointOptions {
    /// The artifact directory to create (absolute; must not exist).
    pub output: PathBuf,
    /// The identity hash to record; `None` derives a local one from the container and time.
    pub identity_hash: Option<String>,
    /// Where the source runs (pod, namespace, container name); the node defaults to this
    /// host's name.
    pub source: SourceInfo,
    /// Kill the workload once the artifact is published (`--stop`).
    pub stop: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
}

#[derive(Debug)]
struct Inner {
    criu: Arc<dyn criu::CriuDriver>,
    cuda: cuda::CudaSlot,
    runtimes: Runtimes,
    /// The CRIU version, when the engine's user told it ([`Engine::knowing_criu`]).
    criu_version: std::sync::OnceLock<crate::criu::CriuVersion>,
}

/// What [`Engine::restore`] restores, into what.
#[derive(Clone, Debug)]
pub struct RestoreOrder {
    /// The published artifact directory.
    pub artifact: PathBuf,
    /// The placeholder container.
    pub into: ContainerRef,
    /// Where CRIU's restore log goes ([`RestoreRequest::log_dir`]).
    pub log_dir: PathBuf,
    /// The manifest digest the restore was validated against, if any
    /// ([`RestoreRequest::manifest_digest`]).
    pub manifest_digest: Option<String>,
    /// Where the restore's claim and answers go ([`RestoreRequest::control`]).
    pub control: crate::restore::ControlDir,
}

/// The node engine. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// An engine with these drivers and resolvers.
    pub fn new(criu: Arc<dyn criu::CriuDriver>, cuda: cuda::CudaSlot, runtimes: Runtimes) -> Self {
        Self {
            inner: Arc::new(Inner {
                criu,
                cuda,
                runtimes,
                criu_version: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The CRIU driver.
    pub fn criu(&self) -> &dyn criu::CriuDriver {
        self.inner.criu.as_ref()
    }

    /// The same engine, told the version of its CRIU (asked once where the engine's user
    /// starts, never during a restore: a CRIU that does not answer would hold the restore, and
    /// its process would not end with the agent). Without it, restores check the kernel alone.
    #[must_use]
    pub fn knowing_criu(self, version: Option<crate::criu::CriuVersion>) -> Self {
        if let Some(version) = version {
            let _ = self.inner.criu_version.set(version);
        }
        self
    }

    /// What a restore needs to know of this node: its kernel and, when told, its CRIU's version.
    fn node_facts(&self) -> crate::node_match::NodeFacts {
        crate::node_match::NodeFacts::here(self.inner.criu_version.get().cloned())
    }

    /// Where the CUDA driver comes from (opened on first use).
    pub fn cuda(&self) -> &cuda::CudaSlot {
        &self.inner.cuda
    }

    /// The runtime resolvers.
    pub fn runtimes(&self) -> &Runtimes {
        &self.inner.runtimes
    }

    /// Resolves a container reference.
    ///
    /// # Errors
    /// [`ResolveError`].
    pub async fn resolve(
        &self,
        reference: &ContainerRef,
    ) -> Result<crate::runtime::ContainerInfo, ResolveError> {
        self.inner.runtimes.resolve(reference).await
    }

    /// Checkpoints `target` (see [`crate::checkpoint::checkpoint`] for the order of steps and
    /// what `--stop` guarantees).
    ///
    /// # Errors
    /// [`EngineError`]; nothing is published on error.
    pub async fn checkpoint(
        &self,
        target: &ContainerRef,
        options: CheckpointOptions,
        progress: Progress,
    ) -> Result<CheckpointReport, EngineError> {
        // Before the container is looked at: a checkpoint interrupted after its workload was
        // killed is finished even when that workload is gone.
        let (output, max_age) = (
            options.output.clone(),
            self.criu().limits().staging_max_age(),
        );
        blocking(move || crate::checkpoint::refuse_if_finished(&output, max_age)).await?;
        let container = self.resolve(target).await?;
        let identity_hash = options
            .identity_hash
            .unwrap_or_else(|| local_hash(&container.uri()));
        let node = if options.source.node.is_empty() {
            nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default()
        } else {
            options.source.node.clone()
        };
        let request = CheckpointRequest {
            output: options.output,
            identity_hash,
            source: SourceInfo {
                node,
                container: if options.source.container.is_empty() {
                    container.id.clone()
                } else {
                    options.source.container.clone()
                },
                ..options.source
            },
            leave_running: !options.stop,
            tcp_established: options.tcp_established,
            container,
        };
        let engine = self.clone();
        blocking(move || engine.checkpoint_blocking(&request, &progress))
            .await
            .map_err(EngineError::from)
    }

    /// [`Engine::checkpoint`] of a resolved container, on the calling thread.
    ///
    /// # Errors
    /// [`CheckpointError`].
    pub fn checkpoint_blocking(
        &self,
        request: &CheckpointRequest,
        progress: &Progress,
    ) -> Result<CheckpointReport, CheckpointError> {
        crate::checkpoint::checkpoint(self.criu(), self.cuda(), request, progress)
    }

    /// Restores the artifact of `order` into its placeholder: the artifact is verified first
    /// (every file CRIU interprets; the page images' checksums run alongside CRIU's restore,
    /// which leaves the tree stopped until they all matched, and a mismatch kills it unrun) and
    /// must be the one the order expects ([`RestoreOrder::manifest_digest`]), then the
    /// placeholder is resolved and checked, claimed and restored into (see [`crate::restore`]).
    /// A refusal once the placeholder's control directory is known writes `restore-failed`
    /// there (unless another party claimed the placeholder). CRIU's log goes into the order's
    /// `log_dir`, prepared by [`crate::logdir::prepare`] once the restore is about to run.
    ///
    /// # Errors
    /// [`EngineError`].
    pub async fn restore(
        &self,
        order: RestoreOrder,
        progress: Progress,
    ) -> Result<RestoreReport, EngineError> {
        let RestoreOrder {
            artifact,
            into,
            log_dir,
            manifest_digest,
            control,
        } = order;
        let mut timings = Timings::default();
        // Bytes verified of the artifact: its page images are hashed beside CRIU's restore,
        // which holds the restored tree until they all matched.
        let (meter, watch) = progress.meter(Operation::Restore, "verifying");
        let (manifest, timings) = {
            let dir = artifact.clone();
            let meter = meter.clone();
            blocking(move || {
                let manifest = timings.measure("verify", || {
                    crate::restore::verify_artifact_but_pages(&dir, &meter)
                });
                (manifest, timings)
            })
            .await
        };
        let placeholder = match manifest {
            Ok(manifest) => (manifest, self.resolve(&into).await?),
            Err(err) => {
                // The artifact is refused before the placeholder is looked at; a placeholder
                // that can be found still gets its answer (restore-failed).
                if let Ok(placeholder) = self.resolve(&into).await {
                    let request = RestoreRequest {
                        artifact,
                        placeholder,
                        log_dir: PathBuf::new(),
                        manifest_digest,
                        control,
                    };
                    return Err(blocking(move || refused(&request, err)).await.into());
                }
                return Err(err.into());
            }
        };
        let (manifest, placeholder) = placeholder;
        let request = RestoreRequest {
            artifact,
            placeholder,
            log_dir,
            manifest_digest,
            control,
        };
        let engine = self.clone();
        let restored = blocking(move || {
            let mut timings = timings;
            engine.restore_verified(&request, manifest, &mut timings, meter)
        })
        .await;
        drop(watch);
        restored.map_err(EngineError::from)
    }

    /// [`Engine::restore`] of a resolved placeholder, on the calling thread.
    ///
    /// # Errors
    /// [`RestoreError`].
    pub fn restore_blocking(
        &self,
        request: &RestoreRequest,
        timings: &mut Timings,
        progress: &Progress,
    ) -> Result<RestoreReport, RestoreError> {
        let (meter, _watch) = progress.meter(Operation::Restore, "verifying");
        let manifest = timings.measure("verify", || {
            crate::restore::verify_artifact_but_pages(&request.artifact, &meter)
        });
        match manifest {
            Ok(manifest) => self.restore_verified(request, manifest, timings, meter),
            Err(err) => Err(refused(request, err)),
        }
    }

    fn restore_verified(
        &self,
        request: &RestoreRequest,
        manifest: crate::restore::Verified,
        timings: &mut Timings,
        meter: Arc<crate::progress::Meter>,
    ) -> Result<RestoreReport, RestoreError> {
        crate::node_match::check(&manifest.manifest, &self.node_facts()).map_err(|source| {
            refused(
                request,
                RestoreError::OtherNode {
                    path: request.artifact.clone(),
                    source,
                },
            )
        })?;
        let mut prepared = crate::restore::prepare_verified(
            request,
            self.cuda(),
            manifest,
            crate::restore::PageCheck::BesideCriu,
            timings,
        )
        .map_err(|err| refused(request, err))?;
        prepared.count_into(meter);
        crate::restore::execute(self.criu(), prepared, timings)
    }
}

/// Answers a refusal before the claim with `restore-failed` (the restore claim: README "The agent's command line"), except
/// when the placeholder is taken by someone else.
fn refused(request: &RestoreRequest, err: RestoreError) -> RestoreError {
    if !matches!(err, RestoreError::Occupied(_))
        && let Some(control) = request.control.of(&request.placeholder)
    {
        crate::placeholder::refuse(
            &request.placeholder,
            &control,
            &crate::report::error_chain(&err),
        );
    }
    err
}

/// A stand-in identity hash for local checkpoints (no Checkpoint object): derived from the
/// container reference and the time, so two local checkpoints never share one.
pub fn local_hash(uri: &str) -> String {
    let mut h = Sha256::new();
    h.update(uri.as_bytes());
    h.update(crate::clock::now_rfc3339().as_bytes());
    let mut hex = hex::encode(h.finalize());
    hex.truncate(16);
    hex
}
