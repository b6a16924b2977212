//! The checkpoint executor: container → published artifact.
//!
//! Order (each step timed): resolve and check the container, plan its mounts, record its
//! stdio, stage, CRIU dump (the tree is frozen for the dump and resumed after it unless the
//! caller asked to stop it), capture the overlay upper directory as an OCI layer diff, then
//! publish (hash, manifest, fsync, rename, completion marker). A failure at any step leaves no
//! published artifact; the staging directory is removed (or, after a crash, swept).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use thiserror::Error;
use warmstart_shared::artifact::{
    CriuInfo, CriuOptions, MANIFEST_FORMAT_VERSION, Manifest, SourceInfo,
};
use warmstart_shared::names::{
    ARTIFACT_CRIU_DIR as CRIU_DIR, ARTIFACT_DUMP_LOG as DUMP_LOG,
    ARTIFACT_ROOTFS_DIFF as ROOTFS_DIFF,
};

use crate::clock::now_rfc3339;
use crate::criu::{CriuError, DumpOpts, ExtMount, ManageCgroupsMode, NETNS_KEY};
use crate::gpu::{self, GpuError};
use crate::gpu_assignment::{self, Assignment, GpuAssignmentError};
use crate::mounts;
use crate::progress::Operation;
use crate::publish::{HandedOver, PublishError, Recovery, Sealed, Staging};
use crate::rootfs::{self, RootfsError};
use crate::runtime::stat::start_time;
use crate::runtime::{ContainerInfo, ResolveError, mountinfo};
use crate::seams::criu::CriuDriver;
use crate::seams::cuda::CudaSlot;
use crate::timings::Timings;

/// What to checkpoint and where.
#[derive(Clone, Debug)]
pub struct CheckpointRequest {
    /// The container.
    pub container: ContainerInfo,
    /// The final artifact directory (must not exist).
    pub output: PathBuf,
    /// Identity hash recorded in the manifest.
    pub identity_hash: String,
    /// Where it runs (pod, namespace, node, container name).
    pub source: SourceInfo,
    /// Keep the workload running after the checkpoint (default); `false` kills it once the
    /// artifact is published (never before: a failed or interrupted checkpoint keeps it).
    pub leave_running: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
}

/// A finished checkpoint.
#[derive(Clone, Debug)]
pub struct CheckpointReport {
    /// The published artifact.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Phase timings.
    pub timings: Timings,
    /// Whether the workload was killed after publication (`--stop`).
    pub stopped: bool,
}

/// Why a checkpoint failed.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// The container is not running.
    #[error("container {0} is not running")]
    NotRunning(String),
    /// The container could not be inspected.
    #[error("cannot inspect container {id}")]
    Inspect {
        /// The container.
        id: String,
        /// Why.
        #[source]
        source: ResolveError,
    },
    /// A namespace or fd could not be read.
    #[error("cannot read {path} of container {id}")]
    Proc {
        /// The container.
        id: String,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Staging or publication failed.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// CRIU failed.
    #[error("CRIU dump of container {id} failed")]
    Dump {
        /// The container.
        id: String,
        /// CRIU's error (log path and key lines included).
        #[source]
        source: CriuError,
    },
    /// The workload could not be stopped after a successful checkpoint (the artifact is
    /// published).
    #[error("checkpoint of container {id} is published, but stopping the workload failed")]
    Stop {
        /// The container.
        id: String,
        /// The errno of kill(2).
        #[source]
        source: nix::Error,
    },
    /// An earlier checkpoint to the same output was interrupted after its workload was killed;
    /// its sealed capture was verified and published there now, so nothing new is captured.
    #[error(
        "an interrupted checkpoint had sealed a capture for {}: it is verified and published there now; checkpoint to another output to capture again",
        output.display()
    )]
    Finished {
        /// The output, now a published artifact.
        output: PathBuf,
    },
    /// The post-dump hook was not called although CRIU reported a successful dump.
    #[error("CRIU finished the dump of container {0} without handing it over for publication")]
    Hook(String),
    /// The GPU state could not be taken before the dump (every process was given back the
    /// state it was found in).
    #[error("cannot checkpoint the GPU state of container {id}")]
    Cuda {
        /// The container.
        id: String,
        /// What failed.
        #[source]
        source: Box<GpuError>,
    },
    /// Which GPUs the container was given cannot be told (nothing was held or dumped).
    #[error("cannot checkpoint container {id}")]
    Gpus {
        /// The container.
        id: String,
        /// Why.
        #[source]
        source: Box<GpuAssignmentError>,
    },
    /// The rootfs diff could not be captured.
    #[error("cannot capture the root filesystem changes of container {id}")]
    Rootfs {
        /// The container.
        id: String,
        /// Why.
        #[source]
        source: RootfsError,
    },
}

/// The GPUs the runtime gave `container` (its allocation, CDI devices, then its init's
/// `NVIDIA_VISIBLE_DEVICES`), mapped to the node's GPUs when the driver is open.
///
/// # Errors
/// [`CheckpointError::Gpus`] when they cannot be told.
pub fn assigned_gpus(
    container: &ContainerInfo,
    cuda: &CudaSlot,
    tree: &[u32],
) -> Result<Option<Assignment>, CheckpointError> {
    let pid = u32::try_from(container.pid).unwrap_or_default();
    let env = gpu::environ_var(pid, gpu_assignment::VISIBLE_DEVICES_ENV).map_err(|source| {
        CheckpointError::Gpus {
            id: container.uri(),
            source: Box::new(GpuAssignmentError::Environment {
                container: container.uri(),
                source,
            }),
        }
    })?;
    let evidence = gpu_assignment::Evidence {
        container: &container.uri(),
        runtime: &container.gpus,
        env: env.as_deref(),
        device_nodes: gpu::has_gpu_device(Path::new(&format!("/proc/{pid}/root"))),
    };
    gpu_assignment::determine(&evidence, gpu::inventory_for(cuda, tree).as_ref()).map_err(
        |source| CheckpointError::Gpus {
            id: container.uri(),
            source: Box::new(source),
        },
    )
}

/// Runs a checkpoint. Blocking: call from a blocking thread (the engine does).
///
/// # Errors
/// [`CheckpointError`]; nothing is published on error.
///
/// # Guarantees
/// - Without `leave_running` (`--stop`), the tree does not run after the state it hands over
///   was taken: CRIU holds it stopped from the dump until the artifact is sealed (every file
///   hashed, manifest written, fsynced), then kills it; only then is the artifact renamed into
///   place and marked complete. Any failure before that resumes it (CRIU resumes the tree when
///   the post-dump hook refuses), and so does the agent's death: CRIU reads the closed socket
///   as a refusal, resumes the tree, unlocks its network and exits.
/// - Without `--stop`, the tree is frozen only for the dump, as before.
/// - CUDA processes of the tree are locked and checkpointed before the dump, and restored and
///   unlocked again unless the tree is killed after publication.
///
/// - A crash never loses both the workload and its capture: the sealed staging directory
///   records the hand-over (`publish::HANDED_OVER`) before CRIU is told to kill the tree, and
///   the next run that finds it abandoned ([`recover_interrupted`]: the next checkpoint to the
///   same output, `inspect` or `restore` of it, the cluster agent's restart) verifies and
///   publishes it once the workload is gone. A workload CRIU resumed (the agent died before
///   the answer reached it) runs on, and its capture is removed: never both running and
///   published from a `--stop` checkpoint, and never neither.
pub fn checkpoint(
    criu: &dyn CriuDriver,
    cuda: &CudaSlot,
    request: &CheckpointRequest,
    progress: &crate::progress::Reporter,
) -> Result<CheckpointReport, CheckpointError> {
    let container = &request.container;
    let id = container.uri();
    let mut timings = Timings::default();
    let span = tracing::info_span!("checkpoint", container.id = %id, pid = container.pid,
        checkpoint.hash = %request.identity_hash);
    let _enter = span.enter();

    let prepared = timings.measure("prepare", || prepare(criu, request, &id))?;
    // Asked before the dump: nothing but the dump runs while the tree is held.
    let criu_version = criu.version().map(|v| v.to_string()).unwrap_or_default();
    let opts = dump_opts(request, &prepared);

    let tree: Vec<u32> = crate::runtime::stat::descendants(container.pid)
        .into_iter()
        .filter_map(|p| u32::try_from(p).ok())
        .collect();
    // Decided before anything is held: a container whose GPUs cannot be told is refused.
    let assigned = assigned_gpus(container, cuda, &tree)?;
    if let Some(a) = &assigned {
        tracing::info!(gpus = %a.recorded, "the container's GPUs");
    }
    let gpu = gpu::Hold::take(cuda, &tree, assigned.as_ref(), &mut timings).map_err(|source| {
        CheckpointError::Cuda {
            id: id.clone(),
            source: Box::new(source),
        }
    })?;
    let Prepared {
        staging,
        plan,
        stdio,
        root_start,
        ..
    } = prepared;
    let base = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        identity_hash: request.identity_hash.clone(),
        created_at: now_rfc3339(),
        source: SourceInfo {
            container_id: id.clone(),
            image: container.image.clone(),
            ..request.source.clone()
        },
        criu: CriuInfo {
            version: criu_version,
            kernel_version: crate::node_match::kernel_release(),
            options: recorded_options(&opts, stdio),
        },
        mounts: plan,
        cuda: gpu.section(),
        assigned_gpus: assigned.map(|a| a.recorded),
        timings: std::collections::BTreeMap::new(),
        chunk_bytes: warmstart_shared::filehash::CHUNK_BYTES,
        files: Vec::new(),
        digest: String::new(),
    };
    let output = staging.final_dir().to_path_buf();
    tracing::info!(
        external = opts.external.len(),
        stop = !request.leave_running,
        "dump starting"
    );
    let stopped = !request.leave_running;
    let dump = Dump {
        criu,
        opts: &opts,
        container,
        id: &id,
        progress,
        base,
        root_start,
    };
    let manifest = if stopped {
        dump.held(staging, gpu, &mut timings)?
    } else {
        dump.left_running(staging, gpu, &mut timings)?
    };
    tracing::info!(artifact = %output.display(), bytes = manifest.total_size(), stopped, "artifact published");
    Ok(CheckpointReport {
        dir: output,
        manifest,
        timings,
        stopped,
    })
}

/// What is read and created before anything is held.
struct Prepared {
    staging: Staging,
    plan: Vec<warmstart_shared::artifact::MountPlanEntry>,
    stdio: Vec<String>,
    netns: Option<u64>,
    root_start: u64,
}

/// Checks the container runs, reads its mounts, standard streams and network namespace, and
/// creates the staging directory (refusing an output a finished checkpoint holds).
fn prepare(
    criu: &dyn CriuDriver,
    request: &CheckpointRequest,
    id: &str,
) -> Result<Prepared, CheckpointError> {
    let container = &request.container;
    if !container.running {
        return Err(CheckpointError::NotRunning(id.to_owned()));
    }
    let root_start =
        start_time(container.pid).ok_or_else(|| CheckpointError::NotRunning(id.to_owned()))?;
    let table = mountinfo::read(container.pid).map_err(|source| CheckpointError::Inspect {
        id: id.to_owned(),
        source,
    })?;
    let plan = mounts::plan(container, &table);
    let stdio = stdio_targets(container.pid, id)?;
    let netns = private_netns(container.pid, id)?;
    refuse_if_finished(&request.output, criu.limits().staging_max_age())?;
    let staging = Staging::create(&request.output)?;
    let images = staging.path().join(CRIU_DIR);
    std::fs::create_dir(&images).map_err(|source| CheckpointError::Proc {
        id: id.to_owned(),
        path: images.clone(),
        source,
    })?;
    Ok(Prepared {
        staging,
        plan,
        stdio,
        netns,
        root_start,
    })
}

/// CRIU's dump options for this request.
fn dump_opts(request: &CheckpointRequest, prepared: &Prepared) -> DumpOpts {
    let external: Vec<String> = prepared
        .netns
        .iter()
        .map(|inode| format!("net[{inode}]:{NETNS_KEY}"))
        .collect();
    let ext_mounts: Vec<ExtMount> = mounts::externals(&prepared.plan)
        .map(|e| ExtMount {
            key: e.destination.clone(),
            value: e.destination.clone(),
        })
        .collect();
    DumpOpts {
        log_file: DUMP_LOG.to_owned(),
        // With `--stop`, CRIU kills the tree only once the post-dump hook (publication up to
        // the rename) has succeeded; otherwise it resumes it.
        leave_running: request.leave_running,
        tcp_established: request.tcp_established,
        file_locks: true,
        link_remap: true,
        ext_unix_sk: true,
        shell_job: false,
        manage_cgroups_mode: ManageCgroupsMode::Ignore,
        external,
        ext_mounts,
        ..DumpOpts::new(
            nix::unistd::Pid::from_raw(request.container.pid),
            prepared.staging.path().join(CRIU_DIR),
        )
    }
}

/// The dump options as the manifest records them (a restore repeats them).
fn recorded_options(opts: &DumpOpts, stdio: Vec<String>) -> CriuOptions {
    CriuOptions {
        leave_running: opts.leave_running,
        tcp_established: opts.tcp_established,
        file_locks: opts.file_locks,
        link_remap: opts.link_remap,
        ext_unix_sk: opts.ext_unix_sk,
        shell_job: opts.shell_job,
        manage_cgroups_mode: opts.manage_cgroups_mode.into(),
        network_lock: opts.network_lock.into(),
        external: opts.external.clone(),
        ext_mount_keys: opts.ext_mounts.iter().map(|m| m.value.clone()).collect(),
        stdio,
        log_level: i32::try_from(opts.log_level).unwrap_or(i32::MAX),
    }
}

/// The dump itself and the publication after it.
struct Dump<'a> {
    criu: &'a dyn CriuDriver,
    opts: &'a DumpOpts,
    container: &'a ContainerInfo,
    id: &'a str,
    progress: &'a crate::progress::Reporter,
    /// The manifest but for its timings and files.
    base: Manifest,
    root_start: u64,
}

impl Dump<'_> {
    /// `--stop`: everything up to the rename happens while CRIU holds the tree (post-dump
    /// hook); CRIU kills it once the sealed capture is handed over, and resumes it otherwise.
    fn held(
        &self,
        staging: Staging,
        mut gpu: gpu::Hold,
        timings: &mut Timings,
    ) -> Result<Manifest, CheckpointError> {
        let id = self.id.to_owned();
        let dump_started = std::time::Instant::now();
        // Reports how far the dump is every few seconds; stops when the dump returns.
        let mut watch = Some(crate::dump_progress::watch(
            self.progress,
            staging.path().join(CRIU_DIR),
            self.container.pid,
        ));
        let output = staging.final_dir().to_path_buf();
        let mut staging = Some(staging);
        let mut sealed: Option<Result<Sealed, CheckpointError>> = None;
        let mut hook_left = None;
        let dumped = self.criu.dump(
            self.opts,
            Some(&mut || {
                drop(watch.take());
                timings.record("dump", dump_started.elapsed());
                tracing::info!("dump finished, tree held");
                if let Some(dir) = staging.as_ref().map(Staging::path) {
                    crate::fault::point("post-dump", dir);
                }
                let result = staging
                    .take()
                    .ok_or_else(|| CheckpointError::Hook(id.clone()))
                    .and_then(|staging| self.seal(staging, timings));
                let ok = result.is_ok();
                if let Err(err) = &result {
                    tracing::warn!(error = %crate::report::error_chain(err), "publication failed: resuming the workload");
                }
                sealed = Some(result);
                hook_left = Some(std::time::Instant::now());
                ok
            }),
        );
        let mut sealed = match (dumped, sealed) {
            (Ok(()), Some(Ok(sealed))) => sealed,
            (_, Some(Err(err))) => {
                gpu.release();
                return Err(err);
            }
            (Err(source), _) => {
                gpu.release();
                // The staging directory, log included, goes when this returns.
                let source = crate::logdir::keep_failed_log(source);
                return Err(CheckpointError::Dump { id, source });
            }
            (Ok(()), None) => {
                gpu.release();
                return Err(CheckpointError::Hook(id));
            }
        };
        if let Some(left) = hook_left {
            timings.record("stop", left.elapsed());
        }
        // Belt and braces for bare process trees: anything CRIU did not kill goes now (only
        // if the root is still the process that was dumped).
        if start_time(self.container.pid) == Some(self.root_start) {
            kill_tree(self.container.pid).map_err(|source| CheckpointError::Stop {
                id: id.clone(),
                source,
            })?;
        }
        gpu.disarm();
        if let Some(parent) = output.parent() {
            crate::fault::point("pre-place", parent);
        }
        // CRIU finished its log (and wrote its statistics) after handing over.
        let log = format!("{CRIU_DIR}/{DUMP_LOG}");
        let placed = timings.measure("place", || {
            sealed.refresh(&[log.as_str()])?;
            sealed.place()
        })?;
        Ok(placed)
    }

    /// In the post-dump hook: the root filesystem's changes, every file hashed, the manifest
    /// written, and the hand-over recorded. From the yes that follows, the sealed capture may
    /// be the workload's only copy: a run that finds it abandoned publishes it instead of
    /// removing it.
    fn seal(&self, staging: Staging, timings: &mut Timings) -> Result<Sealed, CheckpointError> {
        capture_rootfs(self.container, &staging, self.id, timings)?;
        let manifest = Manifest {
            timings: timings.as_seconds(),
            ..self.base.clone()
        };
        let (hashed, _hashing) = self.progress.meter(Operation::Checkpoint, "hashing");
        let sealed = timings.measure("publish", || staging.seal(manifest, &hashed))?;
        let source = HandedOver::here(self.container.pid, self.root_start).map_err(|source| {
            CheckpointError::Proc {
                id: self.id.to_owned(),
                path: PathBuf::from("/proc/sys/kernel/random/boot_id"),
                source,
            }
        })?;
        sealed.hand_over(&source)?;
        Ok(sealed)
    }

    /// Without `--stop`: the tree is frozen for the dump only, its GPU state given back right
    /// after, then the capture is published.
    fn left_running(
        self,
        staging: Staging,
        mut gpu: gpu::Hold,
        timings: &mut Timings,
    ) -> Result<Manifest, CheckpointError> {
        let watch = crate::dump_progress::watch(
            self.progress,
            staging.path().join(CRIU_DIR),
            self.container.pid,
        );
        let dumped = timings.measure("dump", || self.criu.dump(self.opts, None));
        drop(watch);
        if gpu.is_holding() {
            timings.measure("cuda-release", || gpu.release());
        }
        dumped.map_err(|source| CheckpointError::Dump {
            id: self.id.to_owned(),
            source: crate::logdir::keep_failed_log(source),
        })?;
        tracing::info!("dump finished");
        capture_rootfs(self.container, &staging, self.id, timings)?;
        let manifest = Manifest {
            timings: timings.as_seconds(),
            ..self.base
        };
        let (hashed, _hashing) = self.progress.meter(Operation::Checkpoint, "hashing");
        let published = timings.measure("publish", || staging.publish(manifest, &hashed))?;
        Ok(published)
    }
}

/// Files CRIU writes into a dump's images after handing them over (the end of its log, its
/// statistics): a sealed capture finished later hashes them again.
const LATE_FILES: [&str; 2] = ["criu/dump.log", "criu/stats-dump"];

/// Deals with what interrupted checkpoints left beside `output` (see
/// [`crate::publish::recover_abandoned`]): abandoned staging directories are removed, and a
/// sealed capture that may be the only copy of its workload is verified and published at
/// `output`.
pub fn recover_interrupted(output: &Path, max_age: std::time::Duration) -> Recovery {
    let recovery = crate::publish::recover_abandoned(output, &LATE_FILES, max_age);
    for (dir, why) in &recovery.kept {
        tracing::warn!(staging = %dir.display(), reason = %why, "left a sealed capture of an interrupted checkpoint in place");
    }
    recovery
}

/// [`recover_interrupted`] before a checkpoint to `output`: a capture it publishes there ends
/// this checkpoint ([`CheckpointError::Finished`]).
///
/// # Errors
/// [`CheckpointError::Finished`].
pub fn refuse_if_finished(
    output: &Path,
    max_age: std::time::Duration,
) -> Result<(), CheckpointError> {
    if recover_interrupted(output, max_age).published.is_some() {
        return Err(CheckpointError::Finished {
            output: output.to_path_buf(),
        });
    }
    Ok(())
}

/// Captures the overlay upper directory (the container's file changes) into the staging
/// directory, when the container has one.
fn capture_rootfs(
    container: &ContainerInfo,
    staging: &Staging,
    id: &str,
    timings: &mut Timings,
) -> Result<(), CheckpointError> {
    if let Some(upper) = &container.upper_dir {
        let out = staging.path().join(ROOTFS_DIFF);
        timings
            .measure("rootfs-diff", || rootfs::capture_diff(upper, &out))
            .map_err(|source| CheckpointError::Rootfs {
                id: id.to_owned(),
                source,
            })?;
    }
    Ok(())
}

/// SIGKILLs `root` and every descendant (a container's init takes its PID namespace with it;
/// a bare process tree needs each process killed).
fn kill_tree(root: i32) -> Result<(), nix::Error> {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for pid in crate::runtime::stat::descendants(root) {
        match kill(Pid::from_raw(pid), Signal::SIGKILL) {
            Ok(()) | Err(nix::Error::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Targets of fds 0, 1, 2 of `pid` (`pipe:[123]`, `/dev/null`, …): restore rewires pipes.
fn stdio_targets(pid: i32, id: &str) -> Result<Vec<String>, CheckpointError> {
    (0..3)
        .map(|fd| {
            let path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
            match std::fs::read_link(&path) {
                Ok(target) => Ok(target.to_string_lossy().into_owned()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
                Err(source) => Err(CheckpointError::Proc {
                    id: id.to_owned(),
                    path,
                    source,
                }),
            }
        })
        .collect()
}

/// The inode of the container's network namespace when it is not the host's (which CRIU
/// cannot and need not dump: it stays where it is).
fn private_netns(pid: i32, id: &str) -> Result<Option<u64>, CheckpointError> {
    let inode = |path: &Path| {
        std::fs::metadata(path)
            .map(|m| m.ino())
            .map_err(|source| CheckpointError::Proc {
                id: id.to_owned(),
                path: path.to_path_buf(),
                source,
            })
    };
    let theirs = inode(Path::new(&format!("/proc/{pid}/ns/net")))?;
    let ours = inode(Path::new("/proc/self/ns/net"))?;
    Ok((theirs != ours).then_some(theirs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc_seconds() {
        let now = now_rfc3339();
        assert_eq!(now.len(), 20);
        assert!(now.ends_with('Z'));
    }

    #[test]
    fn kill_tree_kills_a_process_and_its_children() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 1000 & sleep 1000 & wait"])
            .spawn()
            .unwrap();
        let root = i32::try_from(child.id()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let kids = || crate::runtime::stat::descendants(root).split_off(1);
        while kids().len() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let grandchildren = kids();
        assert_eq!(grandchildren.len(), 2);
        kill_tree(root).unwrap();
        assert!(!child.wait().unwrap().success());
        for pid in grandchildren {
            // Reparented and killed: gone, or a zombie awaiting its new parent. Signal delivery
            // is asynchronous, so give the kernel a moment.
            let dead = || {
                let state =
                    std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                state.is_empty() || state.contains(") Z") || state.contains(") X")
            };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !dead() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            assert!(dead(), "{pid} still alive after SIGKILL");
        }
    }

    #[test]
    fn our_stdio_and_netns_are_readable() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert_eq!(stdio_targets(me, "self").unwrap().len(), 3);
        assert_eq!(
            private_netns(me, "self").unwrap(),
            None,
            "we share our own netns"
        );
    }
}
