//! The restore executor: published artifact → a running copy inside a placeholder container.
//!
//! Everything that can refuse runs first and changes nothing: the artifact path (no symlinks),
//! manifest digest, completion marker, every file's SHA-256, the placeholder (running, has a GPU
//! when the artifact holds GPU state, provides every external mount, has the stdio the dump
//! recorded), and the rootfs diff (parsed in full). Only then is the diff applied, the restore
//! helper run (it enters the placeholder's PID namespace and cgroups and drives `criu restore`),
//! and `restore-complete` written into the placeholder's control directory, last.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use warmstart_shared::artifact::{
    FileError, Manifest, ManifestError, MountTreatment, PublishedError, Verification,
    read_published,
};
use warmstart_shared::names::{FILE_RESTORE_COMPLETE, MOUNT_CONTROL};

use crate::cgroups::{self, CgroupError};
use crate::checkpoint::{CRIU_DIR, NETNS_KEY, ROOTFS_DIFF};
use crate::mounts::DEV_NULL;
use crate::rootfs::{self, RootfsError};
use crate::runtime::ContainerInfo;
use crate::runtime::stat::start_time;
use crate::timings::Timings;

/// What to restore, into what.
#[derive(Clone, Debug)]
pub struct RestoreRequest {
    /// The published artifact directory.
    pub artifact: PathBuf,
    /// The running placeholder container.
    pub placeholder: ContainerInfo,
    /// The `warmstart-agent` binary that runs the restore helper.
    pub helper: PathBuf,
    /// The CRIU binary.
    pub criu: PathBuf,
    /// Where CRIU's restore log goes (created if missing; the artifact is never written).
    pub log_dir: PathBuf,
}

/// A finished restore.
#[derive(Clone, Debug)]
pub struct RestoreReport {
    /// PID of the restored tree's root, in the placeholder's PID namespace.
    pub pid: i32,
    /// CRIU's restore log.
    pub log: PathBuf,
    /// Phase timings.
    pub timings: Timings,
    /// Whether `restore-complete` was written into a control directory.
    pub signalled: bool,
}

/// Why a restore was refused or failed.
#[derive(Debug, Error)]
pub enum RestoreError {
    /// The artifact path is unsafe.
    #[error("artifact path {path} is unsafe: {reason}")]
    UnsafePath {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// No complete artifact there.
    #[error("{path} is not a complete artifact: {reason}")]
    Incomplete {
        /// The path.
        path: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// The manifest or marker is invalid (edited, other version, other manifest).
    #[error("artifact {path} is invalid")]
    Manifest {
        /// The artifact.
        path: PathBuf,
        /// Why.
        #[source]
        source: ManifestError,
    },
    /// A file is missing or differs.
    #[error("artifact {path} failed verification")]
    Files {
        /// The artifact.
        path: PathBuf,
        /// Which file and how.
        #[source]
        source: FileError,
    },
    /// The placeholder is not running.
    #[error("placeholder container {0} is not running")]
    NotRunning(String),
    /// GPU state but no GPU.
    #[error(
        "artifact holds GPU state ({gpus} GPU(s)), but placeholder container {container} has no GPU (no /dev/nvidiactl)"
    )]
    NoGpu {
        /// The placeholder.
        container: String,
        /// GPUs in the artifact.
        gpus: usize,
    },
    /// External mounts the placeholder lacks.
    #[error("placeholder container {container} lacks mounts the checkpoint needs: {}", missing.join(", "))]
    MissingMounts {
        /// The placeholder.
        container: String,
        /// Destinations.
        missing: Vec<String>,
    },
    /// The dumped stdio cannot be wired to the placeholder's.
    #[error("placeholder container {container} has no fd {fd} to take the checkpoint's {target}")]
    Stdio {
        /// The placeholder.
        container: String,
        /// The fd number.
        fd: usize,
        /// The dumped target.
        target: String,
    },
    /// cgroups of the placeholder.
    #[error("cannot place the restore in the cgroups of placeholder {container}")]
    Cgroups {
        /// The placeholder.
        container: String,
        /// Why.
        #[source]
        source: CgroupError,
    },
    /// The rootfs diff is unusable or could not be applied.
    #[error("root filesystem changes of artifact {path}")]
    Rootfs {
        /// The artifact.
        path: PathBuf,
        /// Why.
        #[source]
        source: RootfsError,
    },
    /// A file operation.
    #[error("{op} {path}")]
    Io {
        /// What.
        op: &'static str,
        /// Where.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The restore helper or CRIU failed.
    #[error("restore into placeholder {container} failed: {message} (CRIU log: {})", log.display())]
    Helper {
        /// The placeholder.
        container: String,
        /// The helper's message (with CRIU's key log lines).
        message: String,
        /// CRIU's restore log.
        log: PathBuf,
    },
}

/// The plan handed to the restore helper process (JSON on its standard input).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HelperPlan {
    /// Host PID of the placeholder's init.
    pub placeholder_pid: i32,
    /// Its start time (field 22 of `/proc/<pid>/stat`): guards against PID reuse.
    pub placeholder_start_time: u64,
    /// The CRIU binary.
    pub criu: PathBuf,
    /// CRIU images (read only).
    pub images_dir: PathBuf,
    /// Where CRIU writes its log.
    pub work_dir: PathBuf,
    /// The placeholder's root filesystem (host path).
    pub root: PathBuf,
    /// cgroup directories to join.
    pub cgroups: Vec<PathBuf>,
    /// External mount key → host path.
    pub ext_mounts: Vec<(String, String)>,
    /// Inherit-fd key → fd number of the placeholder's init to pass.
    pub stdio: Vec<(String, u8)>,
    /// Whether the network namespace is external (inherit the placeholder's).
    pub netns: bool,
    /// Dump-time options to replay.
    pub options: warmstart_shared::artifact::CriuOptions,
}

/// What the helper prints on success.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HelperResult {
    /// Restored root PID in the placeholder's PID namespace.
    pub pid: i32,
}

/// A restore that passed every check and is ready to run.
#[derive(Debug)]
pub struct Prepared {
    request: RestoreRequest,
    manifest: Manifest,
    plan: HelperPlan,
    control_dir: Option<PathBuf>,
}

impl Prepared {
    /// The verified manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}

/// Checks everything a restore depends on, changing nothing.
///
/// # Errors
/// The first [`RestoreError`] found; nothing was changed.
pub fn prepare(
    request: &RestoreRequest,
    timings: &mut Timings,
    progress: &mut dyn FnMut(u64),
) -> Result<Prepared, RestoreError> {
    let manifest = timings.measure("verify", || verify_artifact(&request.artifact, progress))?;
    timings.measure("check-placeholder", || check_placeholder(request, manifest))
}

fn check_placeholder(
    request: &RestoreRequest,
    manifest: Manifest,
) -> Result<Prepared, RestoreError> {
    let p = &request.placeholder;
    let name = p.uri();
    let proc_dir = PathBuf::from(format!("/proc/{}", p.pid));
    if !p.running || !proc_dir.exists() {
        return Err(RestoreError::NotRunning(name));
    }
    if let Some(cuda) = &manifest.cuda
        && !proc_dir.join("root/dev/nvidiactl").exists()
    {
        return Err(RestoreError::NoGpu {
            container: name,
            gpus: cuda.gpus.len(),
        });
    }
    let cgroup_dirs = cgroups::of_pid(p.pid).map_err(|source| RestoreError::Cgroups {
        container: name.clone(),
        source,
    })?;
    let mut ext_mounts = Vec::new();
    let mut missing = Vec::new();
    for entry in manifest
        .mounts
        .iter()
        .filter(|e| e.treatment == MountTreatment::External)
    {
        let host = if entry.fstype == "cgroup" || entry.fstype == "cgroup2" {
            cgroups::dir_for_container_mount(&cgroup_dirs, &entry.destination)
                .map(|d| d.display().to_string())
        } else if entry.source == DEV_NULL {
            Some(DEV_NULL.to_owned())
        } else {
            p.mount_at(&entry.destination)
                .filter(|m| m.is_bind())
                .map(|m| m.source.clone())
        };
        match host {
            Some(host) => ext_mounts.push((entry.destination.clone(), host)),
            None => missing.push(entry.destination.clone()),
        }
    }
    if !missing.is_empty() {
        return Err(RestoreError::MissingMounts {
            container: name,
            missing,
        });
    }
    let mut stdio = Vec::new();
    for (fd, target) in manifest.criu.options.stdio.iter().enumerate() {
        if !target.starts_with("pipe:") || stdio.iter().any(|(k, _)| k == target) {
            continue;
        }
        let fd_u8 = u8::try_from(fd).unwrap_or(u8::MAX);
        if std::fs::read_link(proc_dir.join(format!("fd/{fd}"))).is_err() {
            return Err(RestoreError::Stdio {
                container: name,
                fd,
                target: target.clone(),
            });
        }
        stdio.push((target.clone(), fd_u8));
    }
    let diff = request.artifact.join(ROOTFS_DIFF);
    if manifest.files.iter().any(|f| f.path == ROOTFS_DIFF) {
        rootfs::read_plan(&diff).map_err(|source| RestoreError::Rootfs {
            path: request.artifact.clone(),
            source,
        })?;
    }
    let control_dir = p
        .mount_at(MOUNT_CONTROL)
        .filter(|m| m.is_bind())
        .map(|m| PathBuf::from(&m.source));
    let plan = HelperPlan {
        placeholder_pid: p.pid,
        placeholder_start_time: start_time(p.pid)
            .ok_or_else(|| RestoreError::NotRunning(name.clone()))?,
        criu: request.criu.clone(),
        images_dir: request.artifact.join(CRIU_DIR),
        work_dir: request.log_dir.clone(),
        root: p.rootfs.clone(),
        cgroups: cgroup_dirs.into_iter().map(|d| d.dir).collect(),
        ext_mounts,
        stdio,
        netns: manifest
            .criu
            .options
            .external
            .iter()
            .any(|e| e.ends_with(&format!(":{NETNS_KEY}"))),
        options: manifest.criu.options.clone(),
    };
    Ok(Prepared {
        request: request.clone(),
        manifest,
        plan,
        control_dir,
    })
}

/// Applies the rootfs diff, runs the restore helper, then writes `restore-complete`.
///
/// # Errors
/// [`RestoreError`]; CRIU failures carry the log path.
pub fn execute(prepared: Prepared, timings: &mut Timings) -> Result<RestoreReport, RestoreError> {
    let Prepared {
        request,
        manifest,
        plan,
        control_dir,
    } = prepared;
    let name = request.placeholder.uri();
    let span = tracing::info_span!("restore", container.id = %name, checkpoint.hash = %manifest.identity_hash);
    let _enter = span.enter();
    if manifest.files.iter().any(|f| f.path == ROOTFS_DIFF) {
        let keep = mount_points(&request.placeholder, &manifest);
        tracing::debug!(
            ?keep,
            "rootfs diff: leaving the placeholder's mount points alone"
        );
        timings
            .measure("rootfs-apply", || {
                rootfs::apply_diff_keeping(
                    &request.artifact.join(ROOTFS_DIFF),
                    &request.placeholder.rootfs,
                    &keep,
                )
            })
            .map_err(|source| RestoreError::Rootfs {
                path: request.artifact.clone(),
                source,
            })?;
    }
    std::fs::create_dir_all(&request.log_dir).map_err(|source| RestoreError::Io {
        op: "create log directory",
        path: request.log_dir.clone(),
        source,
    })?;
    let log = request.log_dir.join(crate::checkpoint::RESTORE_LOG);
    let result = timings.measure("criu-restore", || run_helper(&request.helper, &plan));
    let pid = result.map_err(|message| RestoreError::Helper {
        container: name.clone(),
        message,
        log: log.clone(),
    })?;
    tracing::info!(pid, "restored");
    let mut signalled = false;
    if let Some(dir) = control_dir {
        let file = dir.join(FILE_RESTORE_COMPLETE);
        timings
            .measure("signal", || crate::publish::write_durable(&file, b"ok\n"))
            .map_err(|e| RestoreError::Io {
                op: "write",
                path: file.clone(),
                source: std::io::Error::other(e.to_string()),
            })?;
        signalled = true;
    }
    Ok(RestoreReport {
        pid,
        log,
        timings: timings.clone(),
        signalled,
    })
}

/// The placeholder's mount points (its runtime's mounts, and the dump's external mounts it
/// provides), relative to its root: the rootfs diff must not touch them. Replacing the stub file
/// under a file bind mount (`/etc/hosts`, `/etc/resolv.conf`, `/etc/hostname`, subPath files)
/// from the host unlinks the dentry the mount sits on in the placeholder's mount namespace, and
/// the kernel then detaches that mount: the placeholder's other processes (probes, `exec`) would
/// see the source's empty stub instead of their pod's file. The restored tree gets its own mounts
/// from CRIU either way.
fn mount_points(placeholder: &ContainerInfo, manifest: &Manifest) -> Vec<PathBuf> {
    let externals = manifest
        .mounts
        .iter()
        .filter(|e| e.treatment == MountTreatment::External)
        .map(|e| e.destination.as_str());
    relative_paths(
        placeholder
            .mounts
            .iter()
            .map(|m| m.destination.as_str())
            .chain(externals),
    )
}

/// Absolute container paths as paths relative to the root, sorted and deduplicated; the root
/// itself and paths with `..` are left out.
fn relative_paths<'a>(paths: impl Iterator<Item = &'a str>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = paths
        .filter_map(|d| {
            Path::new(d)
                .components()
                .filter_map(|c| match c {
                    Component::Normal(part) => Some(Some(part)),
                    Component::RootDir | Component::CurDir => None,
                    Component::ParentDir | Component::Prefix(_) => Some(None),
                })
                .collect::<Option<PathBuf>>()
        })
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    out.sort();
    out.dedup();
    out
}

fn run_helper(helper: &Path, plan: &HelperPlan) -> Result<i32, String> {
    let input =
        serde_json::to_vec(plan).map_err(|e| format!("cannot encode the helper plan: {e}"))?;
    let mut child = Command::new(helper)
        .arg(HELPER_COMMAND)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the restore helper {}: {e}", helper.display()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(&input)
            .map_err(|e| format!("cannot send the plan to the restore helper: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("restore helper did not finish: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        return Err(if stderr.is_empty() {
            format!("restore helper exited with {}", out.status)
        } else {
            stderr
        });
    }
    serde_json::from_slice::<HelperResult>(&out.stdout)
        .map(|r| r.pid)
        .map_err(|e| format!("restore helper answered something unreadable: {e}"))
}

/// The hidden subcommand of `warmstart-agent` that runs the helper.
pub const HELPER_COMMAND: &str = "restore-helper";

/// Verifies a published artifact: safe path, manifest, marker, every checksum.
///
/// # Errors
/// [`RestoreError`] naming the artifact and what failed.
pub fn verify_artifact(
    dir: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<Manifest, RestoreError> {
    check_path(dir)?;
    let manifest = read_published(dir, Verification::Checksums).map_err(|e| match e {
        PublishedError::Missing { path, source } => RestoreError::Incomplete {
            path: dir.to_path_buf(),
            reason: format!(
                "{}: {source}",
                path.file_name().unwrap_or_default().to_string_lossy()
            ),
        },
        PublishedError::Manifest(source) => RestoreError::Manifest {
            path: dir.to_path_buf(),
            source,
        },
        PublishedError::Files(source) => RestoreError::Files {
            path: dir.to_path_buf(),
            source,
        },
    })?;
    progress(manifest.total_size());
    Ok(manifest)
}

/// An artifact path must be absolute, free of `.`/`..`, and no component may be a symlink.
fn check_path(dir: &Path) -> Result<(), RestoreError> {
    let unsafe_path = |reason: &str| RestoreError::UnsafePath {
        path: dir.to_path_buf(),
        reason: reason.to_owned(),
    };
    if !dir.is_absolute() {
        return Err(unsafe_path("it must be absolute"));
    }
    let mut current = PathBuf::new();
    for component in dir.components() {
        match component {
            Component::RootDir => current.push("/"),
            Component::Normal(part) => {
                current.push(part);
                match std::fs::symlink_metadata(&current) {
                    Ok(m) if m.file_type().is_symlink() => {
                        return Err(unsafe_path(&format!(
                            "{} is a symbolic link",
                            current.display()
                        )));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        return Err(RestoreError::Incomplete {
                            path: dir.to_path_buf(),
                            reason: format!("{}: {e}", current.display()),
                        });
                    }
                }
            }
            _ => return Err(unsafe_path("it contains '.' or '..'")),
        }
    }
    Ok(())
}

/// Summary of an artifact for `inspect`.
pub fn summary(manifest: &Manifest) -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("identity hash", manifest.identity_hash.clone()),
        ("created", manifest.created_at.clone()),
        ("source", manifest.source.container_id.clone()),
        ("criu", manifest.criu.version.clone()),
        ("kernel", manifest.criu.kernel_version.clone()),
        ("files", manifest.files.len().to_string()),
        ("bytes", manifest.total_size().to_string()),
        ("digest", manifest.digest.clone()),
        (
            "gpu state",
            if manifest.cuda.is_some() { "yes" } else { "no" }.to_owned(),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_relative_and_never_the_root() {
        let got = relative_paths(
            [
                "/",
                "/etc/hosts",
                "/data/",
                "/proc",
                "/a/../b",
                "/data",
                "",
                "./x",
            ]
            .into_iter(),
        );
        assert_eq!(
            got,
            ["data", "etc/hosts", "proc", "x"]
                .map(PathBuf::from)
                .to_vec()
        );
    }

    #[test]
    fn artifact_paths_must_be_absolute_and_link_free() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("link")).unwrap();
        check_path(&real).unwrap();
        assert!(matches!(
            check_path(&tmp.path().join("link")),
            Err(RestoreError::UnsafePath { .. })
        ));
        assert!(matches!(
            check_path(Path::new("relative")),
            Err(RestoreError::UnsafePath { .. })
        ));
        assert!(matches!(
            check_path(&real.join("..").join("real")),
            Err(RestoreError::UnsafePath { .. })
        ));
        let err = verify_artifact(&real, &mut |_| {}).unwrap_err();
        assert!(
            err.to_string().contains("is not a complete artifact"),
            "{err}"
        );
    }
}
