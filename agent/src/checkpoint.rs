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

use crate::criu::{Criu, CriuError, DumpOpts, ExtMount, ManageCgroupsMode};
use crate::mounts;
use crate::publish::{PublishError, Staging};
use crate::rootfs::{self, RootfsError};
use crate::runtime::{ContainerInfo, ResolveError, mountinfo};
use crate::timings::Timings;

/// Directory of CRIU images inside an artifact.
pub const CRIU_DIR: &str = "criu";
/// The rootfs diff inside an artifact.
pub const ROOTFS_DIFF: &str = "rootfs-diff.tar";
/// CRIU's dump log inside [`CRIU_DIR`].
pub const DUMP_LOG: &str = "dump.log";
/// CRIU's restore log inside [`CRIU_DIR`] (of a copy; artifacts are never written to).
pub const RESTORE_LOG: &str = "restore.log";
/// Key under which the container's network namespace is external.
pub const NETNS_KEY: &str = "extRootNetNS";

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

/// Runs a checkpoint. Blocking: call from a blocking thread.
///
/// # Errors
/// [`CheckpointError`]; nothing is published on error.
pub fn checkpoint(
    criu: &Criu,
    request: &CheckpointRequest,
    progress: &mut dyn FnMut(u64),
) -> Result<CheckpointReport, CheckpointError> {
    let container = &request.container;
    let id = container.uri();
    let mut timings = Timings::default();
    let span = tracing::info_span!("checkpoint", container.id = %id, pid = container.pid,
        checkpoint.hash = %request.identity_hash);
    let _enter = span.enter();

    let (staging, plan, stdio, netns) = timings.measure("prepare", || {
        if !container.running {
            return Err(CheckpointError::NotRunning(id.clone()));
        }
        let table = mountinfo::read(container.pid).map_err(|source| CheckpointError::Inspect {
            id: id.clone(),
            source,
        })?;
        let plan = mounts::plan(container, &table);
        let stdio = stdio_targets(container.pid, &id)?;
        let netns = private_netns(container.pid, &id)?;
        crate::publish::sweep_abandoned(&request.output);
        let staging = Staging::create(&request.output)?;
        let images = staging.path().join(CRIU_DIR);
        std::fs::create_dir(&images).map_err(|source| CheckpointError::Proc {
            id: id.clone(),
            path: images.clone(),
            source,
        })?;
        Ok((staging, plan, stdio, netns))
    })?;

    let external: Vec<String> = netns
        .iter()
        .map(|inode| format!("net[{inode}]:{NETNS_KEY}"))
        .collect();
    let ext_mounts: Vec<ExtMount> = mounts::externals(&plan)
        .map(|e| ExtMount {
            key: e.destination.clone(),
            value: e.destination.clone(),
        })
        .collect();
    let opts = DumpOpts {
        log_file: DUMP_LOG.to_owned(),
        // Always resumed by CRIU: `--stop` kills the tree only after publication, so an agent
        // that dies mid-checkpoint never takes the workload with it.
        leave_running: true,
        tcp_established: request.tcp_established,
        file_locks: true,
        link_remap: true,
        ext_unix_sk: true,
        shell_job: false,
        manage_cgroups_mode: ManageCgroupsMode::Ignore,
        external: external.clone(),
        ext_mounts,
        ..DumpOpts::new(
            nix::unistd::Pid::from_raw(container.pid),
            staging.path().join(CRIU_DIR),
        )
    };
    tracing::info!(external = external.len(), "dump starting");
    timings
        .measure("dump", || criu.dump(&opts))
        .map_err(|source| CheckpointError::Dump {
            id: id.clone(),
            source,
        })?;
    tracing::info!("dump finished");

    if let Some(upper) = &container.upper_dir {
        let out = staging.path().join(ROOTFS_DIFF);
        timings
            .measure("rootfs-diff", || rootfs::capture_diff(upper, &out))
            .map_err(|source| CheckpointError::Rootfs {
                id: id.clone(),
                source,
            })?;
    }

    let criu_version = criu.version().map(|v| v.to_string()).unwrap_or_default();
    let manifest = Manifest {
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
            kernel_version: kernel_release(),
            options: CriuOptions {
                leave_running: opts.leave_running,
                tcp_established: opts.tcp_established,
                file_locks: opts.file_locks,
                link_remap: opts.link_remap,
                ext_unix_sk: opts.ext_unix_sk,
                shell_job: opts.shell_job,
                manage_cgroups_mode: "ignore".to_owned(),
                external,
                stdio,
                log_level: i32::try_from(opts.log_level).unwrap_or(i32::MAX),
            },
        },
        mounts: plan,
        cuda: None,
        timings: timings.as_seconds(),
        files: Vec::new(),
        digest: String::new(),
    };
    let output = staging.final_dir().to_path_buf();
    let manifest = timings.measure("publish", || staging.publish(manifest, progress))?;
    tracing::info!(artifact = %output.display(), bytes = manifest.total_size(), "artifact published");
    let stopped = !request.leave_running;
    if stopped {
        timings
            .measure("stop", || kill_tree(container.pid))
            .map_err(|source| CheckpointError::Stop {
                id: id.clone(),
                source,
            })?;
    }
    Ok(CheckpointReport {
        dir: output,
        manifest,
        timings,
        stopped,
    })
}

/// SIGKILLs `root` and every descendant (a container's init takes its PID namespace with it;
/// a bare process tree needs each process killed).
fn kill_tree(root: i32) -> Result<(), nix::Error> {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let mut tree = vec![root];
    let mut i = 0;
    let parents = parent_map();
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    for pid in tree {
        match kill(Pid::from_raw(pid), Signal::SIGKILL) {
            Ok(()) | Err(nix::Error::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// (pid, ppid) of every process.
fn parent_map() -> Vec<(i32, i32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, crate::runtime::stat::parent(pid)?)))
        .collect()
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

/// The running kernel's release.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Now as RFC 3339 (UTC, seconds).
pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .map_or_else(|_| jiff::Timestamp::now().to_string(), |t| t.to_string())
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
        let kids = || parent_map().into_iter().filter(|(_, p)| *p == root).count();
        while kids() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let grandchildren: Vec<i32> = parent_map()
            .into_iter()
            .filter(|(_, p)| *p == root)
            .map(|(c, _)| c)
            .collect();
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
