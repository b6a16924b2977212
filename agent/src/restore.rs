//! The restore executor: published artifact → a running copy inside a placeholder container.
//!
//! Everything that can refuse runs first and changes nothing in the placeholder: the artifact
//! path (no symlinks), manifest digest, completion marker, nothing unlisted, the private view
//! every file is then read through ([`crate::artifact_view`]), every file's SHA-256 but the
//! page images', the placeholder (running, has a GPU when the artifact holds GPU state, provides
//! every external mount, has the stdio the dump recorded), and the rootfs diff (parsed in full).
//! Only then is the diff applied and the restore helper run (it enters the placeholder's PID
//! namespace and cgroups and drives `criu restore` on the view's images). The page images, the
//! bulk of an artifact, are checked beside CRIU: the restored tree is left stopped until every
//! one matched, and killed, never run, if one does not. The GPU state is restored while the
//! tree is still stopped (each process's CUDA restore thread woken alone, as CRIU's CUDA
//! plugin does), and a tree whose GPU restore fails is killed, never run. Then the tree
//! resumes, and `restore-complete` is written into the placeholder's control directory, last.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;
use warmstart_shared::artifact::{
    ArtifactDir, FileError, GpuSource, Manifest, ManifestError, MountTreatment, PathError,
    PublishedError, open_published, resolve_dir, verify_checksums,
};
use warmstart_shared::names::{
    ARTIFACT_CRIU_DIR as CRIU_DIR, ARTIFACT_ROOTFS_DIFF as ROOTFS_DIFF, MOUNT_CONTROL,
};

use crate::artifact_view::{View, ViewError, is_page_image};
use crate::cgroups::{self, CgroupError};
use crate::criu::NETNS_KEY;
use crate::gpu::{self, GpuError, GpuRefusal};
use crate::gpu_assignment::{self, GpuAssignmentError};
use crate::mounts::DEV_NULL;
use crate::placeholder::{self, Occupied};
use crate::progress::Meter;
use crate::restore_helper::{HelperError, HelperPlan};
use crate::rootfs::{self, RootfsError};
use crate::runtime::ContainerInfo;
use crate::runtime::stat::start_time;
use crate::seams::criu::CriuDriver;
use crate::seams::cuda::CudaSlot;
use crate::timings::Timings;

/// What to restore, into what.
#[derive(Clone, Debug)]
pub struct RestoreRequest {
    /// The published artifact directory.
    pub artifact: PathBuf,
    /// The running placeholder container.
    pub placeholder: ContainerInfo,
    /// Where CRIU's restore log goes (created private if missing, refused if another user can
    /// change it: [`crate::logdir::prepare`]; the artifact is never written).
    pub log_dir: PathBuf,
    /// The manifest digest the restore was validated against (in cluster mode the one the
    /// pod's checkpoint binding pins): an artifact whose verified manifest has another is
    /// refused ([`RestoreError::Replaced`]) before the placeholder is claimed. `None` restores
    /// whatever verified artifact is at [`RestoreRequest::artifact`].
    pub manifest_digest: Option<String>,
    /// Where the restore's claim and answers go.
    pub control: ControlDir,
}

/// Where a restore's control directory is: the one place its claim, `restore-failed` and
/// `restore-complete` go, derived one way per restore ([`ControlDir::of`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ControlDir {
    /// The host source of the placeholder's `/warmstart-control` bind mount: a restore ordered
    /// on the command line, where no pod layout is known.
    #[default]
    OfPlaceholder,
    /// This directory, from the pod's layout below the kubelet root (cluster mode: where the
    /// agent also looks for `restore-complete` and answers refusals). The placeholder's bind
    /// mount must be this very directory, else the restore is refused before the claim.
    Pod(PathBuf),
}

impl ControlDir {
    /// The control directory of `placeholder`, unchecked: where a refusal is answered.
    pub fn of(&self, placeholder: &ContainerInfo) -> Option<PathBuf> {
        match self {
            Self::OfPlaceholder => placeholder_control_mount(placeholder),
            Self::Pod(dir) => Some(dir.clone()),
        }
    }

    /// [`ControlDir::of`], checked: a pod's control directory must be what the placeholder
    /// mounts at `/warmstart-control`.
    ///
    /// # Errors
    /// [`RestoreError::ControlMismatch`].
    pub fn checked(&self, placeholder: &ContainerInfo) -> Result<Option<PathBuf>, RestoreError> {
        let Self::Pod(dir) = self else {
            return Ok(placeholder_control_mount(placeholder));
        };
        let mounted = placeholder_control_mount(placeholder);
        let same = mounted.as_deref().is_some_and(|source| {
            let pod = crate::podfiles::PodDir::open(dir).and_then(|d| d.identity());
            let mount = crate::podfiles::PodDir::open(source).and_then(|d| d.identity());
            matches!((pod, mount), (Ok(a), Ok(b)) if a == b)
        });
        if same {
            Ok(Some(dir.clone()))
        } else {
            Err(RestoreError::ControlMismatch {
                container: placeholder.uri(),
                expected: dir.clone(),
                mounted,
            })
        }
    }
}

/// Whether the page images' checksums were computed with the rest of the artifact, or are
/// still to be computed beside CRIU's restore (which then leaves the tree stopped until they
/// all matched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageCheck {
    /// Every page image was verified before the restore.
    Done,
    /// The page images are verified beside CRIU.
    BesideCriu,
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
    /// The artifact path is unsafe (relative, `..`, a symbolic link, not a directory).
    #[error("artifact path {path} is unsafe")]
    UnsafePath {
        /// The path.
        path: PathBuf,
        /// Which component and why.
        #[source]
        source: PathError,
    },
    /// No artifact directory there.
    #[error("no artifact at {0}")]
    Absent(PathBuf),
    /// The artifact on disk is not the one the restore was validated against: a different
    /// (valid, sealed) artifact was put at its path since.
    #[error(
        "artifact {path} was replaced since the restore was validated: its manifest digest is {found}, the restore was validated against {expected}"
    )]
    Replaced {
        /// The artifact.
        path: PathBuf,
        /// The digest the restore was validated against.
        expected: String,
        /// The digest of the manifest verified now.
        found: String,
    },
    /// The manifest or the completion marker is missing or unreadable.
    #[error("{path} is not a complete artifact")]
    Incomplete {
        /// The artifact.
        path: PathBuf,
        /// Which file.
        #[source]
        source: PublishedError,
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
    /// A page image does not hold what its pagemap says CRIU will read from it (CRIU would
    /// misread it, and its restorer can spin forever on that).
    #[error(
        "artifact {path} is inconsistent: {file} holds {recorded} bytes, its pagemap needs {expected}"
    )]
    PageImageSize {
        /// The artifact.
        path: PathBuf,
        /// The page image.
        file: String,
        /// What the pagemap needs.
        expected: u64,
        /// What the manifest records (and the file holds).
        recorded: u64,
    },
    /// A pagemap image cannot be read.
    #[error("artifact {path}: pagemap {file} is unreadable")]
    Pagemap {
        /// The artifact.
        path: PathBuf,
        /// The pagemap image.
        file: String,
        /// Why.
        #[source]
        source: crate::criu::pagemap::PagemapError,
    },
    /// CRIU's log directory cannot be used.
    #[error(transparent)]
    LogDir(crate::logdir::LogDirError),
    /// The restore's private view of the artifact could not be made.
    #[error("artifact {path} cannot be read safely")]
    View {
        /// The artifact.
        path: PathBuf,
        /// Which file or directory and why.
        #[source]
        source: ViewError,
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
    /// Which GPUs the placeholder was given cannot be told.
    #[error("the placeholder's GPUs cannot be told")]
    PlaceholderGpus {
        /// Why.
        #[source]
        source: Box<GpuAssignmentError>,
    },
    /// The placeholder was given fewer GPUs than the captured container.
    #[error(
        "the artifact was captured from a container given {needed} GPU(s) ({captured}); placeholder container {container} was given {found} ({given})"
    )]
    FewerGpus {
        /// The placeholder.
        container: String,
        /// The captured container's GPU count.
        needed: usize,
        /// The captured container's GPUs.
        captured: String,
        /// The placeholder's GPU count.
        found: usize,
        /// The placeholder's GPUs.
        given: String,
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
    /// `restore-complete` could not be written; the restored tree was killed.
    #[error(transparent)]
    Unannounced(#[from] placeholder::Unannounced),
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
    #[error("restore into placeholder {container} failed{}", fmt_log(source.log()))]
    Helper {
        /// The placeholder.
        container: String,
        /// What the helper reported (step, errno, CRIU's key log lines).
        #[source]
        source: Box<HelperError>,
    },
    /// The placeholder does not take a restore (in flight, done, cold-started, occupied).
    #[error(transparent)]
    Occupied(#[from] Occupied),
    /// This node's kernel or CRIU cannot restore the artifact (checked before the claim).
    #[error("this node cannot restore artifact {path}")]
    OtherNode {
        /// The artifact.
        path: PathBuf,
        /// What differs.
        #[source]
        source: crate::node_match::Mismatch,
    },
    /// The placeholder does not mount its pod's control directory at `/warmstart-control`, so
    /// whoever reads the pod's control directory would never learn the outcome.
    #[error(
        "placeholder container {container} mounts {} at /warmstart-control, not its pod's control directory {}",
        mounted.as_ref().map_or_else(|| "nothing".to_owned(), |m| m.display().to_string()),
        expected.display()
    )]
    ControlMismatch {
        /// The placeholder.
        container: String,
        /// The pod's control directory.
        expected: PathBuf,
        /// What it mounts there, if anything.
        mounted: Option<PathBuf>,
    },
    /// The artifact's GPU state cannot go into this placeholder on this node (checked before
    /// the claim: nothing was restored).
    #[error("placeholder container {container} cannot take the artifact's GPU state")]
    GpuRefused {
        /// The placeholder.
        container: String,
        /// What is missing.
        #[source]
        source: Box<GpuRefusal>,
    },
    /// A CUDA call on the restored tree failed (the tree was killed: nothing is restored).
    #[error("cannot restore the GPU state of the tree restored into placeholder {container}")]
    Cuda {
        /// The placeholder.
        container: String,
        /// What failed.
        #[source]
        source: Box<GpuError>,
    },
}

fn fmt_log(log: Option<&Path>) -> String {
    log.map(|l| format!(" (CRIU log: {})", l.display()))
        .unwrap_or_default()
}

/// A restore that passed every check and is ready to run.
#[derive(Debug)]
pub struct Prepared {
    request: RestoreRequest,
    manifest: Manifest,
    /// The private view every file is read through (removed when the restore ends).
    view: View,
    plan: HelperPlan,
    control_dir: Option<PathBuf>,
    gpu: Option<gpu::RestorePlan>,
    /// The page images' checksums are still to be computed, alongside CRIU's restore.
    pages_pending: bool,
    /// Counts the bytes verified.
    progress: Arc<Meter>,
}

impl Prepared {
    /// The verified manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Counts the page images' bytes verified beside CRIU into `meter`.
    pub fn count_into(&mut self, meter: Arc<Meter>) {
        self.progress = meter;
    }
}

/// Checks everything a restore depends on: the artifact (every file's checksum, page images
/// included) and the placeholder ([`prepare_verified`]). Nothing of the artifact or the
/// placeholder is changed, except that a claim a dead agent left on the placeholder is finished
/// off ([`placeholder::check_vacant`]).
///
/// # Errors
/// The first [`RestoreError`] found.
pub fn prepare(
    request: &RestoreRequest,
    cuda: &CudaSlot,
    timings: &mut Timings,
    progress: &Meter,
) -> Result<Prepared, RestoreError> {
    let verified = timings.measure("verify", || {
        let verified = verify_artifact_but_pages(&request.artifact, progress)?;
        verify_pages(
            verified.view.dir(),
            &verified.manifest,
            warmstart_shared::filehash::threads(),
            progress,
        )?;
        Ok::<_, RestoreError>(verified)
    })?;
    prepare_verified(request, cuda, verified, PageCheck::Done, timings)
}

/// An artifact verified for a restore (but maybe its page images' checksums): the manifest, and
/// the private view holding exactly the files that were checked.
#[derive(Debug)]
pub struct Verified {
    /// The verified manifest.
    pub manifest: Manifest,
    view: View,
}

/// [`prepare`] of an artifact already verified (from [`verify_artifact_but_pages`]): the
/// verified manifest must be the one the request expects ([`RestoreRequest::manifest_digest`]),
/// then the placeholder is checked.
///
/// # Errors
/// The first [`RestoreError`] found; nothing was changed.
pub fn prepare_verified(
    request: &RestoreRequest,
    cuda: &CudaSlot,
    verified: Verified,
    pages: PageCheck,
    timings: &mut Timings,
) -> Result<Prepared, RestoreError> {
    check_expected(request, &verified.manifest)?;
    timings.measure("check-placeholder", || {
        let mut prepared = check_placeholder(request, cuda, verified)?;
        prepared.pages_pending = pages == PageCheck::BesideCriu;
        prepared.plan.leave_stopped = prepared.pages_pending;
        placeholder::check_vacant(
            &prepared.request.placeholder,
            prepared.control_dir.as_deref(),
        )?;
        Ok(prepared)
    })
}

/// The verified `manifest` is the one `request` was validated against, if it names one: what
/// the agent checked against the pod's binding is exactly what is restored.
fn check_expected(request: &RestoreRequest, manifest: &Manifest) -> Result<(), RestoreError> {
    match &request.manifest_digest {
        Some(expected) if *expected != manifest.digest => Err(RestoreError::Replaced {
            path: request.artifact.clone(),
            expected: expected.clone(),
            found: manifest.digest.clone(),
        }),
        _ => Ok(()),
    }
}

/// The host source of a placeholder's `/warmstart-control` bind mount.
fn placeholder_control_mount(placeholder: &ContainerInfo) -> Option<PathBuf> {
    placeholder
        .mount_at(MOUNT_CONTROL)
        .filter(|m| m.is_bind())
        .map(|m| PathBuf::from(&m.source))
}

fn check_placeholder(
    request: &RestoreRequest,
    cuda: &CudaSlot,
    verified: Verified,
) -> Result<Prepared, RestoreError> {
    let Verified { manifest, view } = verified;
    let p = &request.placeholder;
    let name = p.uri();
    let proc_dir = PathBuf::from(format!("/proc/{}", p.pid));
    if !p.running || !proc_dir.exists() {
        return Err(RestoreError::NotRunning(name));
    }
    let placeholder_gpus = placeholder_gpus(&manifest, p, cuda, &name, &proc_dir)?;
    let gpu = match &manifest.cuda {
        Some(section) => {
            if !gpu::has_gpu_device(&proc_dir.join("root")) {
                return Err(RestoreError::NoGpu {
                    container: name,
                    gpus: section.gpus.len(),
                });
            }
            Some(
                gpu::plan_restore(cuda, section, placeholder_gpus.as_ref()).map_err(|source| {
                    RestoreError::GpuRefused {
                        container: name.clone(),
                        source: Box::new(source),
                    }
                })?,
            )
        }
        None => None,
    };
    let cgroup_dirs = cgroups::of_pid(p.pid).map_err(|source| RestoreError::Cgroups {
        container: name.clone(),
        source,
    })?;
    let ext_mounts = external_mounts(&manifest, p, &cgroup_dirs, &name)?;
    let stdio = stdio_pipes(&manifest, &proc_dir, &name)?;
    let diff = view.pinned_path(ROOTFS_DIFF);
    if manifest.files.iter().any(|f| f.path == ROOTFS_DIFF) {
        rootfs::read_plan(&diff).map_err(|source| RestoreError::Rootfs {
            path: request.artifact.clone(),
            source,
        })?;
    }
    let control_dir = request.control.checked(p)?;
    // CRIU reads the view's images, never the artifact's directory: only the listed files,
    // each the inode that was verified. The helper checks it opened that very directory.
    let (images_dir, images_dir_id) = view.images_dir().map_err(|source| RestoreError::View {
        path: request.artifact.clone(),
        source,
    })?;
    let plan = HelperPlan {
        placeholder_pid: p.pid,
        placeholder_start_time: start_time(p.pid)
            .ok_or_else(|| RestoreError::NotRunning(name.clone()))?,
        // Filled in by the CRIU driver that runs the helper.
        criu: PathBuf::new(),
        images_dir,
        images_dir_id: Some(images_dir_id),
        work_dir: request.log_dir.clone(),
        root: p.rootfs.clone(),
        cgroups: cgroup_dirs.into_iter().map(|d| d.dir).collect(),
        ext_mounts,
        stdio,
        leave_stopped: false,
        netns: manifest
            .criu
            .options
            .external
            .iter()
            .any(|e| e.ends_with(&format!(":{NETNS_KEY}"))),
        options: manifest.criu.options.clone(),
        // Filled in by the CRIU driver that runs the helper (its limits).
        agent_pid: 0,
        deadline_ms: 0,
        log_limit_bytes: 0,
    };
    Ok(Prepared {
        request: request.clone(),
        manifest,
        view,
        plan,
        control_dir,
        gpu,
        pages_pending: false,
        progress: Arc::default(),
    })
}

/// The GPUs the runtime gave the placeholder, when the artifact needs any: with CUDA state,
/// what its processes held is what the placeholder needs (checked by `plan_restore`); without,
/// at least as many GPUs as the captured container was given by name (the GPUs a container
/// merely saw through its device nodes are no requirement).
fn placeholder_gpus(
    manifest: &Manifest,
    p: &ContainerInfo,
    cuda: &CudaSlot,
    name: &str,
    proc_dir: &Path,
) -> Result<Option<gpu_assignment::Assignment>, RestoreError> {
    let captured_gpus = manifest
        .assigned_gpus
        .as_ref()
        .filter(|a| a.count() != Some(0) && a.source != GpuSource::DeviceNodes);
    if manifest.cuda.is_some() || captured_gpus.is_some() {
        let pid = u32::try_from(p.pid).map_err(|_| RestoreError::NotRunning(name.to_owned()))?;
        let env = gpu::environ_var(pid, gpu_assignment::VISIBLE_DEVICES_ENV).map_err(|source| {
            RestoreError::PlaceholderGpus {
                source: Box::new(gpu_assignment::GpuAssignmentError::Environment {
                    container: name.to_owned(),
                    source,
                }),
            }
        })?;
        let evidence = gpu_assignment::Evidence {
            container: name,
            runtime: &p.gpus,
            env: env.as_deref(),
            device_nodes: gpu::has_gpu_device(&proc_dir.join("root")),
        };
        // GPU state needs the driver anyway (refused below without it); otherwise it is not
        // opened for a placeholder that does not use it.
        let inventory = if manifest.cuda.is_some() {
            cuda.get().ok().map(|driver| driver.inventory())
        } else {
            gpu::inventory_for(cuda, &[pid])
        };
        let assigned =
            gpu_assignment::determine(&evidence, inventory.as_ref()).map_err(|source| {
                RestoreError::PlaceholderGpus {
                    source: Box::new(source),
                }
            })?;
        let needed = captured_gpus.and_then(|c| c.count().map(|n| (c, n)));
        if let (None, Some((captured, needed))) = (&manifest.cuda, needed) {
            let given = assigned.as_ref().map_or(Some(0), |a| a.recorded.count());
            if let Some(found) = given.filter(|n| *n < needed) {
                return Err(RestoreError::FewerGpus {
                    container: name.to_owned(),
                    needed,
                    captured: captured.to_string(),
                    found,
                    given: assigned.map_or_else(|| "none".to_owned(), |a| a.recorded.to_string()),
                });
            }
        }
        if let Some(a) = &assigned {
            tracing::info!(gpus = %a.recorded, "the placeholder's GPUs");
        }
        Ok(assigned)
    } else {
        Ok(None)
    }
}

/// The placeholder's source of every external mount the dump recorded (cgroups from its own
/// cgroups, `/dev/null`, binds from its mounts); a missing one refuses the restore, naming all.
fn external_mounts(
    manifest: &Manifest,
    p: &ContainerInfo,
    cgroup_dirs: &[cgroups::CgroupDir],
    name: &str,
) -> Result<Vec<(String, String)>, RestoreError> {
    let mut ext_mounts = Vec::new();
    let mut missing = Vec::new();
    for entry in manifest
        .mounts
        .iter()
        .filter(|e| e.treatment == MountTreatment::External)
    {
        let host = if entry.fstype == "cgroup" || entry.fstype == "cgroup2" {
            cgroups::dir_for_container_mount(cgroup_dirs, &entry.destination)
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
    // Every key the dump recorded an external mount under needs a source here.
    for key in &manifest.criu.options.ext_mount_keys {
        if !ext_mounts.iter().any(|(k, _)| k == key) && !missing.contains(key) {
            missing.push(key.clone());
        }
    }
    if !missing.is_empty() {
        return Err(RestoreError::MissingMounts {
            container: name.to_owned(),
            missing,
        });
    }
    Ok(ext_mounts)
}

/// The placeholder's descriptors standing in for the pipes the dump's standard streams were
/// (CRIU's `inherit_fd`); a pipe the placeholder lacks refuses the restore.
fn stdio_pipes(
    manifest: &Manifest,
    proc_dir: &Path,
    name: &str,
) -> Result<Vec<(String, u8)>, RestoreError> {
    let mut stdio = Vec::new();
    for (fd, target) in manifest.criu.options.stdio.iter().enumerate() {
        if !target.starts_with("pipe:") || stdio.iter().any(|(k, _)| k == target) {
            continue;
        }
        let fd_u8 = u8::try_from(fd).unwrap_or(u8::MAX);
        if std::fs::read_link(proc_dir.join(format!("fd/{fd}"))).is_err() {
            return Err(RestoreError::Stdio {
                container: name.to_owned(),
                fd,
                target: target.clone(),
            });
        }
        stdio.push((target.clone(), fd_u8));
    }
    Ok(stdio)
}

/// Takes the placeholder (restore lock, then `restore-claim`), applies the rootfs diff, runs
/// the CRIU restore through `criu` (leaving the tree stopped while page images are verified
/// or GPU state is to come back), restores and unlocks the GPU state of the stopped tree,
/// resumes it, then writes `restore-complete`.
///
/// # Errors
/// [`RestoreError`]; CRIU failures carry the log path.
///
/// # Guarantees
/// Nothing in the placeholder changes before the claim. A failure after it leaves no restored
/// tree (one restored before a CUDA failure is killed) and writes `restore-failed` into the
/// control directory, so a standby entrypoint can cold start.
pub fn execute(
    criu: &dyn CriuDriver,
    prepared: Prepared,
    timings: &mut Timings,
) -> Result<RestoreReport, RestoreError> {
    let name = prepared.request.placeholder.uri();
    let span = tracing::info_span!("restore", container.id = %name, checkpoint.hash = %prepared.manifest.identity_hash);
    let _enter = span.enter();
    let hold = timings.measure("claim", || {
        placeholder::take(
            &prepared.request.placeholder,
            prepared.control_dir.as_deref(),
        )
    })?;
    let result = execute_claimed(criu, prepared, timings);
    if let Err(err) = &result {
        hold.fail(&crate::report::error_chain(err));
    }
    result
}

fn execute_claimed(
    criu: &dyn CriuDriver,
    prepared: Prepared,
    timings: &mut Timings,
) -> Result<RestoreReport, RestoreError> {
    let Prepared {
        request,
        manifest,
        view,
        mut plan,
        control_dir,
        gpu,
        pages_pending,
        progress,
    } = prepared;
    // With GPU state the tree stays stopped through the CUDA restore too.
    plan.leave_stopped |= gpu.is_some();
    let name = request.placeholder.uri();
    // CRIU opens its log there as root, following links: a directory another user can plant
    // or change is refused, before anything in the placeholder changes.
    crate::logdir::prepare(&request.log_dir).map_err(RestoreError::LogDir)?;
    // The page images are hashed while the rootfs diff is applied and CRIU restores; the
    // restored tree stays stopped until every checksum matched.
    let mut pages = if pages_pending {
        PagesCheck::start(&view, &manifest, &progress, timings)?
    } else {
        PagesCheck(None)
    };
    if manifest.files.iter().any(|f| f.path == ROOTFS_DIFF) {
        let keep = mount_points(&request.placeholder, &manifest);
        tracing::debug!(
            ?keep,
            "rootfs diff: leaving the placeholder's mount points alone"
        );
        timings
            .measure("rootfs-apply", || {
                rootfs::apply_diff_keeping(
                    &view.pinned_path(ROOTFS_DIFF),
                    &request.placeholder.rootfs,
                    &keep,
                )
            })
            .map_err(|source| RestoreError::Rootfs {
                path: request.artifact.clone(),
                source,
            })?;
    }
    let log = request.log_dir.join(warmstart_shared::names::RESTORE_LOG);
    crate::fault::point_until_resumed("restore-before-criu", &request.log_dir);
    let pid = timings
        .measure("criu-restore", || criu.restore(&plan))
        .map_err(|source| RestoreError::Helper {
            container: name.clone(),
            source: Box::new(source),
        })?;
    tracing::info!(pid, "restored");
    let tree = placeholder::restored_tree(request.placeholder.pid);
    pages.finish(&tree, timings)?;
    if let Some(gpu) = gpu {
        // The tree is still stopped: only each process's CUDA restore thread runs until its
        // device memory is back and it is unlocked.
        let pids: Vec<u32> = tree.iter().filter_map(|p| u32::try_from(*p).ok()).collect();
        let placeholder_pid = u32::try_from(request.placeholder.pid).unwrap_or(0);
        gpu.restore(placeholder_pid, &pids, timings).map_err(|source| {
            tracing::error!(?tree, error = %source, "GPU restore failed: killing the restored tree, which never ran");
            placeholder::kill_restored_tree(request.placeholder.pid);
            RestoreError::Cuda {
                container: name.clone(),
                source: Box::new(source),
            }
        })?;
    }
    if plan.leave_stopped {
        signal_tree(&tree, nix::sys::signal::Signal::SIGCONT);
        tracing::info!(?tree, "the restored tree runs");
    }
    let mut signalled = false;
    if let Some(dir) = control_dir {
        // The control directory is the workload's to write: no link it planted is followed,
        // and a tree that cannot be announced is killed, never left serving.
        timings.measure("signal", || {
            placeholder::announce(&request.placeholder, &dir)
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

/// Sends `signal` to every process of `tree` (host PIDs).
fn signal_tree(tree: &[i32], signal: nix::sys::signal::Signal) {
    for pid in tree {
        if let Err(err) = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), signal) {
            tracing::warn!(pid, ?signal, error = %err, "cannot signal a restored process");
        }
    }
}

/// The page-image check running beside a restore; joined (never left running) on every path.
struct PagesCheck(Option<std::thread::JoinHandle<(Result<(), RestoreError>, std::time::Duration)>>);

impl PagesCheck {
    /// Starts hashing the page images on a thread of their own; where no thread can be
    /// started, hashes them here first.
    fn start(
        view: &View,
        manifest: &Manifest,
        progress: &Arc<Meter>,
        timings: &mut Timings,
    ) -> Result<Self, RestoreError> {
        let spawned = view.dir_handle().and_then(|dir| {
            let manifest = manifest.clone();
            let progress = progress.clone();
            std::thread::Builder::new()
                .name("verify-pages".to_owned())
                .spawn(move || {
                    let started = std::time::Instant::now();
                    (
                        verify_pages(&dir, &manifest, threads_beside_criu(), &progress),
                        started.elapsed(),
                    )
                })
        });
        match spawned {
            Ok(handle) => Ok(Self(Some(handle))),
            Err(err) => {
                tracing::warn!(error = %err, "cannot hash the page images alongside the restore: hashing them first");
                timings.measure("verify-pages", || {
                    verify_pages(
                        view.dir(),
                        manifest,
                        warmstart_shared::filehash::threads(),
                        progress,
                    )
                })?;
                Ok(Self(None))
            }
        }
    }

    /// Waits for the check; a page image that differs kills the restored `tree`, which never
    /// ran, and fails the restore naming it.
    fn finish(&mut self, tree: &[i32], timings: &mut Timings) -> Result<(), RestoreError> {
        let Some(handle) = self.0.take() else {
            return Ok(());
        };
        let waited = std::time::Instant::now();
        let (checked, took) = handle
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        timings.record_beside("verify-pages", took);
        timings.record("verify-wait", waited.elapsed());
        if let Err(err) = checked {
            tracing::error!(?tree, error = %err, "a page image differs from the manifest: killing the restored tree, which never ran");
            signal_tree(tree, nix::sys::signal::Signal::SIGKILL);
            return Err(err);
        }
        tracing::info!(?tree, "page images verified");
        Ok(())
    }
}

impl Drop for PagesCheck {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            let _ = handle.join();
        }
    }
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

/// Verifies a published artifact without changing anything (what `inspect --verify` does):
/// safe path, manifest, marker, nothing unlisted, every checksum.
///
/// # Errors
/// [`RestoreError`] naming the artifact and what failed.
pub fn verify_artifact(dir: &Path, progress: &Meter) -> Result<Manifest, RestoreError> {
    check_path(dir)?;
    let (opened, manifest) = open_artifact(dir)?.into_parts();
    progress.set_total(manifest.total_size());
    verify_checksums(
        &opened,
        &manifest,
        &|_| true,
        warmstart_shared::filehash::threads(),
        &|n| progress.add(n),
    )
    .map_err(|source| RestoreError::Files {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(manifest)
}

fn open_artifact(dir: &Path) -> Result<warmstart_shared::artifact::Published, RestoreError> {
    open_published(dir).map_err(|e| match e {
        e @ PublishedError::Missing { .. } => RestoreError::Incomplete {
            path: dir.to_path_buf(),
            source: e,
        },
        PublishedError::Path(source) => RestoreError::UnsafePath {
            path: dir.to_path_buf(),
            source,
        },
        PublishedError::Manifest(source) => RestoreError::Manifest {
            path: dir.to_path_buf(),
            source,
        },
        PublishedError::Files(source) => RestoreError::Files {
            path: dir.to_path_buf(),
            source,
        },
    })
}

/// Verifies a published artifact for a restore, except the page images' checksums (their
/// presence and sizes are checked): the manifest, the marker, nothing unlisted, then the
/// private view of the listed files is made (see [`crate::artifact_view`]) and every file CRIU
/// interprets is hashed through it, before CRIU reads any. The page images are asked to be read
/// ahead.
///
/// # Errors
/// [`RestoreError`] naming the artifact and what failed.
pub fn verify_artifact_but_pages(dir: &Path, progress: &Meter) -> Result<Verified, RestoreError> {
    check_path(dir)?;
    let published = open_artifact(dir)?;
    let view = View::create(&published).map_err(|source| match source {
        ViewError::File(source) => RestoreError::Files {
            path: dir.to_path_buf(),
            source,
        },
        source => RestoreError::View {
            path: dir.to_path_buf(),
            source,
        },
    })?;
    let (_, manifest) = published.into_parts();
    progress.set_total(manifest.total_size());
    verify_checksums(
        view.dir(),
        &manifest,
        &|f| !is_page_image(f),
        warmstart_shared::filehash::threads(),
        &|n| progress.add(n),
    )
    .map_err(|source| RestoreError::Files {
        path: dir.to_path_buf(),
        source,
    })?;
    check_page_image_sizes(dir, view.dir(), &manifest)?;
    Ok(Verified { manifest, view })
}

/// The largest pagemap image read to check its page image's size (they are a few KiB).
const MAX_PAGEMAP_BYTES: u64 = 64 << 20;

/// Every page image holds exactly the bytes its (verified) pagemap says CRIU reads from it:
/// checked before CRIU runs, from the sizes the manifest records (and the files were found to
/// have). A pagemap that refers to pages elsewhere (a parent dump, lazy pages) is not judged.
/// The pagemaps are read in `view` (the restore's private view, whose files were verified);
/// errors name the artifact `dir`.
fn check_page_image_sizes(
    dir: &Path,
    view: &ArtifactDir,
    manifest: &Manifest,
) -> Result<(), RestoreError> {
    let page_size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(4096);
    let prefix = format!("{CRIU_DIR}/pagemap-");
    for entry in manifest.files.iter().filter(|f| {
        f.path
            .strip_prefix(&prefix)
            .is_some_and(|rest| rest.ends_with(".img") && !rest.contains('/'))
    }) {
        if entry.size > MAX_PAGEMAP_BYTES {
            tracing::debug!(file = %entry.path, "pagemap too large to check its page image's size");
            continue;
        }
        let bytes = view
            .read_bounded(&entry.path, MAX_PAGEMAP_BYTES)
            .map_err(|source| RestoreError::Files {
                path: dir.to_path_buf(),
                source,
            })?;
        let expected =
            crate::criu::pagemap::expected_pages(&bytes, page_size).map_err(|source| {
                RestoreError::Pagemap {
                    path: dir.to_path_buf(),
                    file: entry.path.clone(),
                    source,
                }
            })?;
        let Some(needed) = expected.bytes else {
            continue;
        };
        let file = format!("{CRIU_DIR}/pages-{}.img", expected.pages_id);
        let recorded = manifest
            .files
            .iter()
            .find(|f| f.path == file)
            .map_or(0, |f| f.size);
        if recorded != needed {
            return Err(RestoreError::PageImageSize {
                path: dir.to_path_buf(),
                file,
                expected: needed,
                recorded,
            });
        }
    }
    Ok(())
}

/// The page images' checksums, hashed on `threads` threads in `dir` (the restore's view).
///
/// # Errors
/// [`RestoreError::Files`] naming the file (and chunk) that differs.
pub fn verify_pages(
    dir: &ArtifactDir,
    manifest: &Manifest,
    threads: usize,
    progress: &Meter,
) -> Result<(), RestoreError> {
    verify_checksums(dir, manifest, &is_page_image, threads, &|n| progress.add(n)).map_err(
        |source| RestoreError::Files {
            path: dir.path().to_path_buf(),
            source,
        },
    )
}

/// Threads that hash the page images while CRIU restores: every core but one, which is left to
/// CRIU (its page restore is one thread, bound by copying memory), so the two overlap instead of
/// taking turns on a small node.
fn threads_beside_criu() -> usize {
    warmstart_shared::filehash::threads()
        .saturating_sub(1)
        .max(1)
}

/// An artifact path must be absolute, free of `.`/`..`, and no component may be a symlink.
fn check_path(dir: &Path) -> Result<(), RestoreError> {
    match resolve_dir(dir) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(RestoreError::Absent(dir.to_path_buf())),
        Err(source) => Err(RestoreError::UnsafePath {
            path: dir.to_path_buf(),
            source,
        }),
    }
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

    /// A placeholder whose `/warmstart-control` is a bind mount of `source`.
    fn mounting(source: &Path) -> ContainerInfo {
        ContainerInfo {
            id: "placeholder".to_owned(),
            runtime: crate::runtime::RuntimeKind::Runc,
            pid: 1,
            running: true,
            rootfs: PathBuf::from("/nonexistent"),
            upper_dir: None,
            mounts: vec![crate::runtime::RuntimeMount {
                destination: MOUNT_CONTROL.to_owned(),
                source: source.display().to_string(),
                kind: "bind".to_owned(),
                options: vec!["rbind".to_owned()],
            }],
            masked_paths: Vec::new(),
            image: String::new(),
            gpus: Default::default(),
        }
    }

    #[test]
    fn a_pods_control_directory_must_be_the_one_the_placeholder_mounts() {
        let tmp = tempfile::tempdir().unwrap();
        let pod_dir = tmp.path().join("pods/uid/volumes/warmstart-control/main");
        let other = tmp.path().join("elsewhere");
        std::fs::create_dir_all(&pod_dir).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        // The kubelet mounts a subPath through another path to the same directory.
        let alias = tmp.path().join("volume-subpaths");
        std::os::unix::fs::symlink(pod_dir.parent().unwrap(), &alias).unwrap();
        let control = ControlDir::Pod(pod_dir.clone());

        let same = mounting(&alias.join("main"));
        assert_eq!(control.checked(&same).unwrap(), Some(pod_dir.clone()));

        let err = control.checked(&mounting(&other)).unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, RestoreError::ControlMismatch { .. }),
            "{err:?}"
        );
        assert!(
            message.contains(&other.display().to_string())
                && message.contains(&pod_dir.display().to_string()),
            "{message}"
        );
        // A link where the mounted directory should be is not followed.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&pod_dir, &link).unwrap();
        assert!(control.checked(&mounting(&link)).is_err());
        let mut unmounted = mounting(&pod_dir);
        unmounted.mounts.clear();
        let err = control.checked(&unmounted).unwrap_err();
        assert!(err.to_string().contains("mounts nothing"), "{err}");
        // Refusals are answered where the pod's control directory is, checked or not.
        assert_eq!(control.of(&unmounted), Some(pod_dir.clone()));

        // A restore ordered on the command line takes what the placeholder mounts.
        assert_eq!(
            ControlDir::OfPlaceholder
                .checked(&mounting(&other))
                .unwrap(),
            Some(other.clone())
        );
    }

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
        let err = verify_artifact(&real, &Meter::default()).unwrap_err();
        assert!(
            err.to_string().contains("is not a complete artifact"),
            "{err}"
        );
    }
}
