//! Artifact publication: a capture is written into a staging directory beside the final one,
//! every file is hashed into the manifest while the disk writes it back, everything is fsynced,
//! the staging directory is renamed into place in one `renameat2(RENAME_NOREPLACE)`, and the
//! completion marker is written last. A published artifact is therefore always complete; a crash
//! leaves only a staging directory (`.staging-*`), which nothing reads.
//!
//! Staging directories may sit on storage shared by nodes, so who owns one is judged by what is
//! true there: its name carries the creating node's boot id and process id
//! (`.staging-<name>-<boot id>-<pid>-<unix nanos>`), and its creator holds an exclusive `flock`
//! on it while it is in use. [`recover_abandoned`] touches only a directory that is unlocked and
//! either this boot's with its creator gone, or older than a maximum age. A sealed one (every file
//! hashed into a durable manifest) whose capture may have been the only copy (the workload was
//! handed over to be killed, see [`Sealed::hand_over`]) is verified and published instead of
//! removed.
//!
//! Every published file is read-only (mode 0444, owned by the agent's user, root): whoever may
//! later own the artifact's directories (the controller's user, which deletes artifacts) can
//! remove or rename files but never write one in place.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{AT_FDCWD, Flock, FlockArg, RenameFlags, renameat2};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use warmstart_shared::artifact::{
    ArtifactDir, CompletionMarker, FileEntry, Manifest, resolve_dir, validate_path_element,
    validate_relative_file, verify_checksums,
};
use warmstart_shared::filehash;
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST, STAGING_PREFIX};

/// Why publication failed.
#[derive(Debug, Error)]
pub enum PublishError {
    /// An artifact already exists at the final path.
    #[error("an artifact already exists at {0}: remove it or choose another output")]
    Exists(PathBuf),
    /// The output path cannot hold an artifact.
    #[error("output {path} is not usable")]
    Output {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: warmstart_shared::artifact::PathError,
    },
    /// The staging directory holds something other than a regular file or directory.
    #[error("{0}: artifacts hold only regular files and directories")]
    NotAFile(PathBuf),
    /// A file operation failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A staged file has a name the manifest cannot carry.
    #[error("staged file {0} has an unsafe name")]
    UnsafeName(String, #[source] warmstart_shared::artifact::PathError),
    /// The manifest could not be serialised.
    #[error("cannot serialise the manifest")]
    Manifest(#[source] warmstart_shared::artifact::ManifestError),
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> PublishError + 'a {
    move |source| PublishError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The file in a sealed staging directory that records the workload handed over to be killed
/// (`--stop`): written, durably, before CRIU is told to kill it, removed once the artifact is
/// renamed into place. Never part of the manifest.
pub const HANDED_OVER: &str = ".handed-over";

/// Where this boot's id comes from: it tells this node's staging directories from other nodes'
/// (and from this node's before a reboot) on shared storage.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This boot's id as staging names carry it: 32 lowercase hex digits (the dashes dropped).
///
/// # Errors
/// The kernel's boot id cannot be read or is malformed.
pub fn boot_id() -> io::Result<String> {
    let text = fs::read_to_string(BOOT_ID)?;
    let compact: String = text.trim().chars().filter(|c| *c != '-').collect();
    if is_boot_id(&compact) {
        Ok(compact.to_ascii_lowercase())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{BOOT_ID} holds no boot id"),
        ))
    }
}

fn host_name() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn is_boot_id(value: &str) -> bool {
    value.len() == 32 && value.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The process a `--stop` checkpoint hands over to be killed, as the handed-over record names
/// it: with the boot id, PID and start time it is one process, wherever the record is read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HandedOver {
    /// The node (host name) it ran on.
    pub node: String,
    /// The boot id of the node it ran on (see [`boot_id`]).
    pub boot_id: String,
    /// Its PID there.
    pub pid: i32,
    /// Its start time (field 22 of `/proc/<pid>/stat`).
    pub start_time: u64,
}

impl HandedOver {
    /// The process `pid` (started at `start_time`) of this boot on this node.
    ///
    /// # Errors
    /// The boot id cannot be read.
    pub fn here(pid: i32, start_time: u64) -> io::Result<Self> {
        Ok(Self {
            node: host_name(),
            boot_id: boot_id()?,
            pid,
            start_time,
        })
    }

    /// Whether that process still runs (it can only on this boot).
    fn still_runs(&self, our_boot: Option<&str>) -> bool {
        our_boot == Some(self.boot_id.as_str())
            && crate::runtime::stat::start_time(self.pid) == Some(self.start_time)
            && crate::runtime::stat::fields(self.pid)
                .and_then(|f| f.first().cloned())
                .is_some_and(|state| state != "Z" && state != "X")
    }
}

/// A staging directory for one capture, locked (`flock`) while this value lives. Dropped
/// unpublished, it removes itself.
#[derive(Debug)]
pub struct Staging {
    final_dir: PathBuf,
    dir: PathBuf,
    published: bool,
    _lock: Option<Flock<File>>,
}

impl Staging {
    /// Creates `<parent>/.staging-<final name>-<unique>` for `final_dir`.
    ///
    /// # Errors
    /// [`PublishError::Exists`] when `final_dir` exists; [`PublishError::Output`] for an unsafe
    /// path; I/O errors.
    pub fn create(final_dir: &Path) -> Result<Self, PublishError> {
        let output_err = |source| PublishError::Output {
            path: final_dir.to_path_buf(),
            source,
        };
        // A path ending in `..` or `/` has no final element: refused as an empty name.
        let name = final_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        validate_path_element("output directory name", name).map_err(output_err)?;
        let parent = final_dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        match fs::symlink_metadata(final_dir) {
            Ok(_) => return Err(PublishError::Exists(final_dir.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("inspect", final_dir)(e)),
        }
        fs::create_dir_all(parent).map_err(io_err("create", parent))?;
        let parent = std::path::absolute(parent).map_err(io_err("resolve", parent))?;
        resolve_dir(&parent).map_err(output_err)?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let boot = boot_id().map_err(io_err("read the boot id for", final_dir))?;
        let dir = parent.join(format!(
            "{STAGING_PREFIX}{name}-{boot}-{}-{nanos}",
            std::process::id()
        ));
        fs::create_dir(&dir).map_err(io_err("create staging directory", &dir))?;
        let lock = lock_dir(&dir);
        if lock.is_none() {
            tracing::debug!(staging = %dir.display(), "no flock on the staging directory (not supported here): its name alone tells its owner");
        }
        Ok(Self {
            final_dir: final_dir.to_path_buf(),
            dir,
            published: false,
            _lock: lock,
        })
    }

    /// The staging directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The final directory.
    pub fn final_dir(&self) -> &Path {
        &self.final_dir
    }

    /// Hashes every staged file into `manifest`, seals it, writes it, fsyncs, renames the
    /// staging directory into place and writes the completion marker.
    ///
    /// # Errors
    /// [`PublishError`]; on error the final directory does not exist (or, if the failure came
    /// after the rename, has no completion marker, which readers treat as absent).
    ///
    /// # Guarantees
    /// The marker is written only after every file and the manifest are durable.
    pub fn publish(
        self,
        manifest: Manifest,
        progress: &crate::progress::Meter,
    ) -> Result<Manifest, PublishError> {
        self.seal(manifest, progress)?.place()
    }

    /// The first half of [`Staging::publish`]: hashes every staged file into `manifest`, seals
    /// it, writes it and fsyncs the staging directory. Nothing is published yet; dropping the
    /// result removes the staging directory.
    ///
    /// # Errors
    /// [`PublishError`].
    pub fn seal(
        self,
        mut manifest: Manifest,
        progress: &crate::progress::Meter,
    ) -> Result<Sealed, PublishError> {
        if manifest.format_version >= 2 && manifest.chunk_bytes == 0 {
            manifest.chunk_bytes = warmstart_shared::filehash::CHUNK_BYTES;
        }
        let files = list_tree(&self.dir)?;
        progress.set_total(files.iter().map(|(_, _, size)| size).sum());
        // The disk writes the staged files back while they are hashed (out of the page cache),
        // so sealing takes the longer of the two rather than both. The fsync below, after the
        // manifest is written, is what makes the staging durable; this one only starts it early.
        let (digests, flushed) = std::thread::scope(|scope| {
            let flush = std::thread::Builder::new()
                .name("fsync-staging".to_owned())
                .spawn_scoped(scope, || fsync_tree(&self.dir));
            let digests = digest_files(&manifest, files, &|n| progress.add(n));
            let flushed = match flush {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                Err(err) => {
                    tracing::debug!(error = %err, "no thread to fsync beside the hashing");
                    Ok(())
                }
            };
            (digests, flushed)
        });
        manifest.files = digests?;
        flushed?;
        manifest.seal();
        let manifest_path = self.dir.join(FILE_MANIFEST);
        write_durable(
            &manifest_path,
            &manifest.to_json().map_err(PublishError::Manifest)?,
        )?;
        fsync_tree(&self.dir)?;
        Ok(Sealed {
            staging: self,
            manifest,
        })
    }
}

/// A staging directory whose files and manifest are durable: one rename and the completion
/// marker away from published.
#[derive(Debug)]
pub struct Sealed {
    staging: Staging,
    manifest: Manifest,
}

impl Sealed {
    /// The sealed manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Brings the sealed manifest up to date with what was written after sealing: files that
    /// are new or changed size, and the files in `always` (logs that may have grown), are
    /// hashed again; the others keep their entries. For logs a tool finishes after handing the
    /// artifact over (CRIU writes the end of its dump log and `stats-dump` after `post-dump`).
    ///
    /// # Errors
    /// [`PublishError`].
    pub fn refresh(&mut self, always: &[&str]) -> Result<(), PublishError> {
        let known = &self.manifest.files;
        let listed = list_tree(&self.staging.dir)?;
        let (kept, stale): (Vec<_>, Vec<_>) = listed.into_iter().partition(|(rel, _, size)| {
            known
                .iter()
                .any(|f| f.path == *rel && f.size == *size && !always.contains(&rel.as_str()))
        });
        if stale.is_empty() && kept.len() == known.len() {
            return Ok(());
        }
        let mut files: Vec<FileEntry> = known
            .iter()
            .filter(|f| kept.iter().any(|(rel, _, _)| *rel == f.path))
            .cloned()
            .collect();
        files.extend(digest_files(&self.manifest, stale, &|_| {})?);
        self.manifest.files = files;
        self.manifest.seal();
        write_durable(
            &self.staging.dir.join(FILE_MANIFEST),
            &self.manifest.to_json().map_err(PublishError::Manifest)?,
        )?;
        fsync_tree(&self.staging.dir)
    }

    /// Records, durably, that the capture's workload `source` is about to be killed (`--stop`):
    /// from here on, this sealed directory may be the only copy of it, and a run that finds it
    /// abandoned publishes it (once `source` is gone) instead of removing it.
    ///
    /// # Errors
    /// [`PublishError`]: nothing may be killed then.
    pub fn hand_over(&self, source: &HandedOver) -> Result<(), PublishError> {
        let bytes = serde_json::to_vec(source).map_err(|e| {
            io_err("serialise the hand-over record for", &self.staging.dir)(io::Error::other(e))
        })?;
        write_durable(&self.staging.dir.join(HANDED_OVER), &bytes)?;
        fsync_dir(&self.staging.dir)
    }

    /// The second half of [`Staging::publish`]: renames the staging directory into place and
    /// writes the completion marker.
    ///
    /// # Errors
    /// [`PublishError`]; as for [`Staging::publish`].
    pub fn place(self) -> Result<Manifest, PublishError> {
        let Self {
            mut staging,
            manifest,
        } = self;
        read_only_tree(&staging.dir)?;
        renameat2(
            AT_FDCWD,
            &staging.dir,
            AT_FDCWD,
            &staging.final_dir,
            RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|errno| {
            if errno == nix::errno::Errno::EEXIST || errno == nix::errno::Errno::ENOTEMPTY {
                PublishError::Exists(staging.final_dir.clone())
            } else {
                io_err("rename staging directory to", &staging.final_dir)(io::Error::from(errno))
            }
        })?;
        staging.published = true;
        let final_dir = staging.final_dir.clone();
        fsync_dir(final_dir.parent().unwrap_or(Path::new(".")))?;
        // The record was only needed while the capture could be lost; a published artifact
        // holds the listed files alone.
        match fs::remove_file(final_dir.join(HANDED_OVER)) {
            Ok(()) => fsync_dir(&final_dir)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", &final_dir.join(HANDED_OVER))(e)),
        }
        let marker =
            serde_json::to_vec(&CompletionMarker::for_manifest(&manifest)).map_err(|e| {
                io_err("serialise completion marker for", &final_dir)(io::Error::other(e))
            })?;
        write_durable(&final_dir.join(FILE_COMPLETE), &marker)?;
        fsync_dir(&final_dir)?;
        Ok(manifest)
    }
}

/// What [`recover_abandoned`] did with the abandoned staging directories of one output.
#[derive(Debug, Default)]
pub struct Recovery {
    /// The sealed capture it verified and published at the output (with its manifest).
    pub published: Option<Manifest>,
    /// The directories it removed.
    pub removed: Vec<PathBuf>,
    /// Sealed captures it left alone, and why (never removed: they may be the only copy).
    pub kept: Vec<(PathBuf, String)>,
}

/// Who a staging directory's name says created it.
#[derive(Debug, PartialEq, Eq)]
enum Creator {
    /// `<boot id>-<pid>-<nanos>`.
    Named { boot: String, pid: u32, nanos: u128 },
    /// `<pid>-<nanos>`, written before names carried the boot id: judged by age only.
    Legacy { nanos: u128 },
}

/// The creator of the staging directory `file_name` of output `name`, or `None` when it is not
/// one of that output's (another output's name may start with this one's).
fn creator(file_name: &str, name: &str) -> Option<Creator> {
    let rest = file_name
        .strip_prefix(STAGING_PREFIX)?
        .strip_prefix(name)?
        .strip_prefix('-')?;
    let parts: Vec<&str> = rest.split('-').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match parts.as_slice() {
        [boot, pid, nanos] if is_boot_id(boot) && digits(pid) && digits(nanos) => {
            Some(Creator::Named {
                boot: boot.to_ascii_lowercase(),
                pid: pid.parse().ok()?,
                nanos: nanos.parse().ok()?,
            })
        }
        [pid, nanos] if digits(pid) && digits(nanos) => Some(Creator::Legacy {
            nanos: nanos.parse().ok()?,
        }),
        _ => None,
    }
}

/// Whether the creator is certainly gone: this boot's, and its PID is free or taken by a process
/// started after the directory was (PID reuse); or the directory is older than `max_age`.
fn abandoned(creator: &Creator, our_boot: Option<&str>, now: u128, max_age: Duration) -> bool {
    let (nanos, ours) = match creator {
        Creator::Named { boot, pid, nanos } => {
            (*nanos, (our_boot == Some(boot.as_str())).then_some(*pid))
        }
        Creator::Legacy { nanos } => (*nanos, None),
    };
    if now.saturating_sub(nanos) >= max_age.as_nanos() {
        return true;
    }
    let Some(pid) = ours.and_then(|p| i32::try_from(p).ok()) else {
        return false;
    };
    match crate::runtime::stat::started_at(pid) {
        None => true,
        Some(started) => {
            let created = i128::try_from(nanos).unwrap_or(i128::MAX);
            // A second of slack for the clock-tick rounding of start times.
            started.as_nanosecond() > created + 1_000_000_000
        }
    }
}

/// An exclusive, non-blocking `flock` on a directory; `None` when it is held elsewhere or the
/// file system has no such locks.
fn lock_dir(dir: &Path) -> Option<Flock<File>> {
    let file = File::open(dir).ok()?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).ok()
}

/// Whether another open file description holds a `flock` on `dir` (its creator, alive).
fn locked_elsewhere(dir: &Path) -> Result<Option<Flock<File>>, ()> {
    let Ok(file) = File::open(dir) else {
        return Ok(None);
    };
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(()),
        // No flock here (some network file systems): the name and age decide.
        Err(_) => Ok(None),
    }
}

/// Deals with the staging directories of `final_dir` that their creator abandoned (an agent
/// killed mid-checkpoint), judged by what is true on shared storage: a directory locked by its
/// creator is in use; an unlocked one is abandoned when this boot created it and its process is
/// gone, or when it is older than `max_age` (another node's, or one named before names carried
/// the boot id). Unparseable names are never touched.
///
/// An abandoned directory is removed, unless it is sealed and its capture may be the only copy:
/// written by a checkpoint that left the workload running, or handed over to be killed
/// ([`Sealed::hand_over`]) by a workload that is gone. Such a capture is verified completely
/// (manifest digest, every listed file present with its size and checksums, nothing unlisted
/// but the files in `late`, which CRIU finishes after handing the capture over and which are
/// hashed again) and published at `final_dir` when nothing is there yet; one that fails
/// verification is removed.
pub fn recover_abandoned(final_dir: &Path, late: &[&str], max_age: Duration) -> Recovery {
    let mut recovery = Recovery::default();
    let (Some(parent), Some(name)) = (final_dir.parent(), final_dir.file_name()) else {
        return recovery;
    };
    let name = name.to_string_lossy().into_owned();
    let Ok(entries) = fs::read_dir(parent) else {
        return recovery;
    };
    let our_boot = boot_id().ok();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut candidates: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    // Newest first: when two captures could be published, the latest is.
    candidates.sort_by_key(|(file_name, _)| match creator(file_name, &name) {
        Some(Creator::Named { nanos, .. } | Creator::Legacy { nanos }) => std::cmp::Reverse(nanos),
        None => std::cmp::Reverse(0),
    });
    for (file_name, path) in candidates {
        let Some(creator) = creator(&file_name, &name) else {
            continue;
        };
        let Ok(lock) = locked_elsewhere(&path) else {
            continue;
        };
        if !abandoned(&creator, our_boot.as_deref(), now, max_age) {
            continue;
        }
        match publishable(&path, our_boot.as_deref()) {
            Publishable::No => {}
            Publishable::Yes(manifest) => {
                // A death inside `write_durable` leaves its temporary file beside the real one.
                for temporary in [FILE_MANIFEST, HANDED_OVER] {
                    let _ = fs::remove_file(path.join(Path::new(temporary).with_extension("tmp")));
                }
                if let Err(why) = verify_sealed(&path, &manifest, late) {
                    tracing::warn!(staging = %path.display(), error = %why, "a sealed capture an interrupted checkpoint left does not verify: removing it");
                } else if fs::symlink_metadata(final_dir).is_ok() {
                    recovery
                        .kept
                        .push((path, format!("{} exists already", final_dir.display())));
                    continue;
                } else {
                    match finish(final_dir, &path, *manifest, late, lock) {
                        Ok(manifest) => {
                            tracing::warn!(staging = %path.display(), artifact = %final_dir.display(), "published the sealed capture an interrupted checkpoint left");
                            recovery.published = Some(manifest);
                        }
                        Err(err) => {
                            let why = crate::report::error_chain(&err);
                            tracing::error!(staging = %path.display(), error = %why, "cannot publish the sealed capture an interrupted checkpoint left");
                            recovery.kept.push((path, why));
                        }
                    }
                    continue;
                }
            }
            Publishable::Unsure(why) => {
                recovery.kept.push((path, why));
                continue;
            }
        }
        match fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::info!(staging = %path.display(), "removed an abandoned staging directory");
                recovery.removed.push(path);
            }
            Err(err) => {
                tracing::warn!(staging = %path.display(), error = %err, "cannot remove an abandoned staging directory");
            }
        }
    }
    recovery
}

/// Whether an abandoned staging directory holds a capture to publish.
enum Publishable {
    /// Not sealed, or its workload runs on (resumed by CRIU): nothing is lost by removing it.
    No,
    /// Sealed, and possibly the only copy.
    Yes(Box<Manifest>),
    /// Handed over on another node, whose workload this node cannot see.
    Unsure(String),
}

fn publishable(dir: &Path, our_boot: Option<&str>) -> Publishable {
    let Ok(bytes) = fs::read(dir.join(FILE_MANIFEST)) else {
        return Publishable::No;
    };
    let Ok(manifest) = Manifest::from_json(&bytes) else {
        return Publishable::No;
    };
    if manifest.criu.options.leave_running {
        // Sealed only after CRIU's dump succeeded: a complete capture of a running workload.
        return Publishable::Yes(Box::new(manifest));
    }
    let record: Option<HandedOver> = fs::read(dir.join(HANDED_OVER))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    match record {
        // Never handed over: CRIU resumed the workload.
        None => Publishable::No,
        Some(source) if source.still_runs(our_boot) => Publishable::No,
        // Another boot's on another node (a shared volume): its workload may run on there. Left
        // for that node (or an operator) to publish. This node's before a reboot is gone.
        Some(source) if our_boot != Some(source.boot_id.as_str()) && source.node != host_name() => {
            Publishable::Unsure(format!(
                "its workload (pid {}) was handed over on node {}, which this node cannot check",
                source.pid, source.node
            ))
        }
        Some(_) => Publishable::Yes(Box::new(manifest)),
    }
}

/// Checks a sealed staging directory completely against its manifest: every listed file
/// present with its size and checksums, nothing unlisted but the files in `late` (which are
/// hashed again when it is published). Returns what differs.
fn verify_sealed(dir: &Path, manifest: &Manifest, late: &[&str]) -> Result<(), String> {
    let listed = list_tree(dir).map_err(|e| crate::report::error_chain(&e))?;
    for entry in &manifest.files {
        if !late.contains(&entry.path.as_str())
            && !listed.iter().any(|(rel, _, _)| *rel == entry.path)
        {
            return Err(format!("{} is missing", entry.path));
        }
    }
    for (rel, _, size) in &listed {
        if late.contains(&rel.as_str()) {
            continue;
        }
        match manifest.files.iter().find(|f| f.path == *rel) {
            Some(f) if f.size == *size => {}
            Some(f) => {
                return Err(format!(
                    "{rel} holds {size} bytes, the manifest says {}",
                    f.size
                ));
            }
            None => return Err(format!("{rel} is not in the manifest")),
        }
    }
    let handle = ArtifactDir::open(dir)
        .map_err(|e| crate::report::error_chain(&e))?
        .ok_or_else(|| format!("{} is gone", dir.display()))?;
    verify_checksums(
        &handle,
        manifest,
        &|f: &FileEntry| !late.contains(&f.path.as_str()),
        filehash::threads(),
        &|_| {},
    )
    .map_err(|e| crate::report::error_chain(&e))
}

/// Publishes a verified sealed staging directory at `final_dir`. On failure the directory is
/// left where it is (it may be the only copy).
fn finish(
    final_dir: &Path,
    dir: &Path,
    manifest: Manifest,
    late: &[&str],
    lock: Option<Flock<File>>,
) -> Result<Manifest, PublishError> {
    let mut sealed = Sealed {
        staging: Staging {
            final_dir: final_dir.to_path_buf(),
            dir: dir.to_path_buf(),
            // Never removed on a failure here.
            published: true,
            _lock: lock,
        },
        manifest,
    };
    sealed.refresh(late)?;
    sealed.place()
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            // Best effort: a leftover is harmless (never read) and swept later.
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Digests of `files` (relative path, path, size) as `manifest`'s format records them: chunk
/// digests (format 2) or whole-file digests (format 1), every core hashing.
fn digest_files(
    manifest: &Manifest,
    files: Vec<(String, PathBuf, u64)>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<FileEntry>, PublishError> {
    let paths: Vec<(PathBuf, u64)> = files.iter().map(|(_, p, s)| (p.clone(), *s)).collect();
    let threads = filehash::threads();
    let hash_err = |e: filehash::ReadError| io_err("hash", &e.path)(e.source);
    if manifest.format_version >= 2 {
        let chunks = filehash::chunk_digests(&paths, manifest.chunk_bytes, threads, progress)
            .map_err(hash_err)?;
        Ok(files
            .into_iter()
            .zip(chunks)
            .map(|((path, _, size), chunks)| FileEntry {
                path,
                size,
                sha256: String::new(),
                chunks,
            })
            .collect())
    } else {
        let digests = filehash::whole_digests(&paths, threads, progress).map_err(hash_err)?;
        Ok(files
            .into_iter()
            .zip(digests)
            .map(|((path, _, size), sha256)| FileEntry {
                path,
                size,
                sha256,
                chunks: Vec::new(),
            })
            .collect())
    }
}

/// Every regular file below `dir` but the manifest and marker: (relative path, path, size),
/// sorted by relative path.
fn list_tree(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>, PublishError> {
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        for entry in fs::read_dir(&abs).map_err(io_err("list", &abs))? {
            let entry = entry.map_err(io_err("list", &abs))?;
            let rel_path = rel.join(entry.file_name());
            let rel_str = rel_path.to_string_lossy().into_owned();
            let kind = entry
                .file_type()
                .map_err(io_err("inspect", &entry.path()))?;
            if kind.is_dir() {
                stack.push(rel_path);
                continue;
            }
            if !kind.is_file() {
                return Err(PublishError::NotAFile(entry.path()));
            }
            if rel_str == FILE_MANIFEST || rel_str == FILE_COMPLETE || rel_str == HANDED_OVER {
                continue;
            }
            validate_relative_file(&rel_str)
                .map_err(|e| PublishError::UnsafeName(rel_str.clone(), e))?;
            let path = entry.path();
            let size = entry.metadata().map_err(io_err("inspect", &path))?.len();
            files.push((rel_str, path, size));
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// Hands a published artifact's directories (and its namespace directory) to `owner`, the
/// controller's user, which deletes artifacts by policy: owning the directories is what removing
/// their entries needs. The files stay root's and read-only (as published), so that user can
/// never write one in place; what it can still do in the directories (rename, add) never reaches
/// a restore, which reads only the listed files, through its own view. Never follows a link.
///
/// # Errors
/// The first `chown` or listing that failed.
pub fn give_directories_to(
    namespace_dir: &Path,
    artifact: &Path,
    owner: (u32, u32),
) -> io::Result<()> {
    fn walk(path: &Path, owner: (u32, u32)) -> io::Result<()> {
        if !fs::symlink_metadata(path)?.is_dir() {
            return Ok(());
        }
        std::os::unix::fs::lchown(path, Some(owner.0), Some(owner.1))?;
        for entry in fs::read_dir(path)? {
            walk(&entry?.path(), owner)?;
        }
        Ok(())
    }
    std::os::unix::fs::lchown(namespace_dir, Some(owner.0), Some(owner.1))?;
    walk(artifact, owner)
}

/// Makes every file below `dir` read-only for everyone (0444), never following a link.
fn read_only_tree(dir: &Path) -> Result<(), PublishError> {
    use std::os::unix::fs::PermissionsExt;
    for entry in fs::read_dir(dir).map_err(io_err("list", dir))? {
        let entry = entry.map_err(io_err("list", dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io_err("inspect", &path))?;
        if kind.is_dir() {
            read_only_tree(&path)?;
        } else if kind.is_file() {
            fs::set_permissions(&path, fs::Permissions::from_mode(0o444))
                .map_err(io_err("make read-only", &path))?;
        } else {
            return Err(PublishError::NotAFile(path));
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` (read-only, 0444) through a temporary file, fsyncs it, and renames
/// it into place.
///
/// # Errors
/// [`PublishError::Io`].
pub fn write_durable(path: &Path, bytes: &[u8]) -> Result<(), PublishError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    // A leftover of an interrupted write is replaced, not reopened (it is read-only).
    let _ = fs::remove_file(&tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(&tmp)
        .map_err(io_err("create", &tmp))?;
    file.write_all(bytes).map_err(io_err("write", &tmp))?;
    file.sync_all().map_err(io_err("fsync", &tmp))?;
    fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
    Ok(())
}

fn fsync_dir(dir: &Path) -> Result<(), PublishError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync", dir))
}

pub(crate) fn fsync_tree(dir: &Path) -> Result<(), PublishError> {
    for entry in fs::read_dir(dir).map_err(io_err("list", dir))? {
        let entry = entry.map_err(io_err("list", dir))?;
        let path = entry.path();
        if entry
            .file_type()
            .map_err(io_err("inspect", &path))?
            .is_dir()
        {
            fsync_tree(&path)?;
        } else {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io_err("fsync", &path))?;
        }
    }
    fsync_dir(dir)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use warmstart_shared::artifact::{
        CriuInfo, MANIFEST_FORMAT_VERSION, SourceInfo, Verification, verify_files,
    };
    use warmstart_shared::names::STAGING_PREFIX;

    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: "0123456789abcdef".into(),
            created_at: "2026-12-02T00:00:00Z".into(),
            source: SourceInfo::default(),
            criu: CriuInfo::default(),
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: Default::default(),
            chunk_bytes: warmstart_shared::filehash::CHUNK_BYTES,
            files: vec![],
            digest: String::new(),
        }
    }

    #[test]
    fn publication_is_complete_verified_and_leaves_no_staging() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ns").join("0123456789abcdef");
        let staging = Staging::create(&out).unwrap();
        fs::create_dir(staging.path().join("criu")).unwrap();
        fs::write(staging.path().join("criu/pages-1.img"), vec![7u8; 4096]).unwrap();
        fs::write(staging.path().join("rootfs-diff.tar"), b"tar").unwrap();
        let seen = crate::progress::Meter::default();
        let m = staging.publish(manifest(), &seen).unwrap();
        assert_eq!(seen.get(), (4099, 4099), "hashed bytes of the staged bytes");
        assert_eq!(m.files.len(), 2);
        assert_eq!(m.files[0].path, "criu/pages-1.img");
        let read = Manifest::from_json(&fs::read(out.join(FILE_MANIFEST)).unwrap()).unwrap();
        assert_eq!(read, m);
        CompletionMarker::check(&fs::read(out.join(FILE_COMPLETE)).unwrap(), &read).unwrap();
        verify_files(&out, &read, Verification::Checksums).unwrap();
        let leftovers: Vec<_> = fs::read_dir(tmp.path().join("ns"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            leftovers,
            vec![std::ffi::OsString::from("0123456789abcdef")]
        );
    }

    #[test]
    fn the_artifacts_owner_cannot_write_a_published_file_in_place() {
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::process::CommandExt;
        if !crate::testing::root("files handed to another user") {
            return;
        }
        const OWNER: u32 = 65532;
        let tmp = tempfile::tempdir().unwrap();
        let ns = tmp.path().join("ns");
        let out = ns.join("0123456789abcdef");
        let staging = Staging::create(&out).unwrap();
        fs::create_dir(staging.path().join("criu")).unwrap();
        fs::write(staging.path().join("criu/pages-1.img"), vec![7u8; 4096]).unwrap();
        staging
            .publish(manifest(), &crate::progress::Meter::default())
            .unwrap();
        // The temporary directory above must be enterable by that user.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        give_directories_to(&ns, &out, (OWNER, OWNER)).unwrap();
        for file in ["criu/pages-1.img", FILE_MANIFEST, FILE_COMPLETE] {
            let meta = fs::metadata(out.join(file)).unwrap();
            assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o444), "{file}");
        }
        assert_eq!(fs::metadata(out.join("criu")).unwrap().uid(), OWNER);
        // As the controller's user: an in-place write is refused by permissions.
        let page = out.join("criu/pages-1.img");
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg("printf x >> \"$1\"")
            .arg("sh")
            .arg(&page)
            .uid(OWNER)
            .gid(OWNER)
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!status.success(), "the owner wrote into a published file");
        assert_eq!(fs::read(&page).unwrap(), vec![7u8; 4096]);
        // It can still delete the artifact (what its deletion policy needs).
        let status = std::process::Command::new("rm")
            .arg("-rf")
            .arg(&out)
            .uid(OWNER)
            .gid(OWNER)
            .status()
            .unwrap();
        assert!(
            status.success() && !out.exists(),
            "the owner can remove the artifact"
        );
    }

    #[test]
    fn an_existing_artifact_is_never_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("a");
        fs::create_dir(&out).unwrap();
        assert!(matches!(
            Staging::create(&out),
            Err(PublishError::Exists(_))
        ));

        // Appearing between staging and publication: the rename refuses, staging is removed.
        let out2 = tmp.path().join("b");
        let staging = Staging::create(&out2).unwrap();
        let staged = staging.path().to_path_buf();
        fs::create_dir(&out2).unwrap();
        fs::write(out2.join("x"), b"other").unwrap();
        assert!(matches!(
            staging.publish(manifest(), &crate::progress::Meter::default()),
            Err(PublishError::Exists(_))
        ));
        assert!(!staged.exists());
        assert_eq!(fs::read(out2.join("x")).unwrap(), b"other");
    }

    #[test]
    fn an_abandoned_staging_directory_removes_itself() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = Staging::create(&tmp.path().join("c")).unwrap();
        let path = staging.path().to_path_buf();
        assert!(
            path.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".staging-c-")
        );
        drop(staging);
        assert!(!path.exists());
        assert!(!tmp.path().join("c").exists());
    }

    /// A PID above any `pid_max`: never a live process.
    const DEAD_PID: u32 = 999_999_999;

    fn now_nanos() -> u128 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    }

    fn staging_named(parent: &Path, output: &str, boot: &str, pid: u32, nanos: u128) -> PathBuf {
        let dir = parent.join(format!("{STAGING_PREFIX}{output}-{boot}-{pid}-{nanos}"));
        fs::create_dir(&dir).unwrap();
        dir
    }

    const DAY: Duration = Duration::from_secs(24 * 3600);

    #[test]
    fn staging_names_carry_this_boot_and_process_and_are_locked_while_in_use() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = Staging::create(&tmp.path().join("out")).unwrap();
        let name = staging
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert_eq!(
            creator(&name, "out"),
            Some(Creator::Named {
                boot: boot_id().unwrap(),
                pid: std::process::id(),
                nanos: match creator(&name, "out") {
                    Some(Creator::Named { nanos, .. }) => nanos,
                    other => panic!("{other:?}"),
                },
            }),
            "{name}"
        );
        // Held: another open file description cannot take the lock, and a sweep leaves it.
        assert!(lock_dir(staging.path()).is_none());
        let swept = recover_abandoned(&tmp.path().join("out"), &[], Duration::ZERO);
        assert!(swept.removed.is_empty(), "{swept:?}");
        assert!(staging.path().exists());
    }

    #[test]
    fn another_boots_staging_with_a_pid_absent_here_is_not_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let other_boot = "0123456789abcdef0123456789abcdef";
        assert_ne!(boot_id().unwrap(), other_boot);
        let theirs = staging_named(tmp.path(), "art", other_boot, DEAD_PID, now_nanos());
        let swept = recover_abandoned(&tmp.path().join("art"), &[], DAY);
        assert!(swept.removed.is_empty(), "{swept:?}");
        assert!(
            theirs.exists(),
            "another node's capture in progress is left alone"
        );
        // Past the maximum age it is abandoned wherever it came from.
        let old = staging_named(tmp.path(), "art", other_boot, DEAD_PID, 1);
        let swept = recover_abandoned(&tmp.path().join("art"), &[], DAY);
        assert_eq!(swept.removed, vec![old]);
        assert!(theirs.exists());
    }

    #[test]
    fn ours_with_a_dead_pid_is_removed_unless_locked() {
        let tmp = tempfile::tempdir().unwrap();
        let boot = boot_id().unwrap();
        let dead = staging_named(tmp.path(), "art", &boot, DEAD_PID, now_nanos());
        let locked = staging_named(tmp.path(), "art", &boot, DEAD_PID, now_nanos() + 1);
        let held = lock_dir(&locked).expect("flock a directory");
        let mine = staging_named(tmp.path(), "art", &boot, std::process::id(), now_nanos());
        // Our PID, but this process started after the directory was named: a reused PID.
        let an_hour_ago = now_nanos() - 3600 * 1_000_000_000;
        let reused = staging_named(tmp.path(), "art", &boot, std::process::id(), an_hour_ago);
        // Another output whose name begins with this one's.
        let other = staging_named(tmp.path(), "art-1", &boot, DEAD_PID, now_nanos());
        let legacy = tmp
            .path()
            .join(format!("{STAGING_PREFIX}art-{DEAD_PID}-{}", now_nanos()));
        fs::create_dir(&legacy).unwrap();
        let swept = recover_abandoned(&tmp.path().join("art"), &[], DAY);
        let mut removed = swept.removed.clone();
        removed.sort();
        let mut expected = vec![dead.clone(), reused.clone()];
        expected.sort();
        assert_eq!(removed, expected);
        assert!(locked.exists() && mine.exists() && other.exists() && legacy.exists());
        drop(held);
        let swept = recover_abandoned(&tmp.path().join("art"), &[], DAY);
        assert_eq!(swept.removed, vec![locked]);
    }

    /// A sealed staging directory as an interrupted `--stop` checkpoint leaves it: files and
    /// manifest durable, the workload `source` handed over (when given), the log grown after
    /// sealing.
    fn interrupted_capture(
        output: &Path,
        source: Option<&HandedOver>,
        leave_running: bool,
    ) -> PathBuf {
        let staging = Staging::create(output).unwrap();
        let dir = staging.path().to_path_buf();
        fs::create_dir(dir.join("criu")).unwrap();
        fs::write(dir.join("criu/pages-1.img"), vec![7u8; 8192]).unwrap();
        fs::write(dir.join("criu/dump.log"), b"dumping\n").unwrap();
        let mut m = manifest();
        m.criu.options.leave_running = leave_running;
        let sealed = staging.seal(m, &crate::progress::Meter::default()).unwrap();
        if let Some(source) = source {
            sealed.hand_over(source).unwrap();
        }
        // CRIU finishes its log after the hand-over.
        fs::write(dir.join("criu/dump.log"), b"dumping\ndone\n").unwrap();
        fs::write(dir.join("criu/stats-dump"), b"stats").unwrap();
        // The agent dies here: its lock goes, nothing removes or publishes the directory.
        let mut sealed = sealed;
        sealed.staging.published = true;
        sealed.staging._lock = None;
        drop(sealed);
        // Its process is gone: renamed as a dead PID of this boot would have named it.
        let name = dir.file_name().unwrap().to_string_lossy().replace(
            &format!("-{}-", std::process::id()),
            &format!("-{DEAD_PID}-"),
        );
        let moved = dir.with_file_name(name);
        fs::rename(&dir, &moved).unwrap();
        moved
    }

    const LATE: &[&str] = &["criu/dump.log", "criu/stats-dump"];

    #[test]
    fn a_sealed_capture_whose_workload_was_killed_is_published_not_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("art");
        // A process that is gone: a child, reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        child.wait().unwrap();
        let gone = HandedOver::here(pid, 1).unwrap();
        let staging = interrupted_capture(&out, Some(&gone), false);
        let recovery = recover_abandoned(&out, LATE, DAY);
        assert!(recovery.removed.is_empty(), "{recovery:?}");
        let published = recovery.published.expect("published");
        assert!(!staging.exists());
        let read = warmstart_shared::artifact::read_published(&out, Verification::Checksums)
            .expect("a complete, verified artifact");
        assert_eq!(read, published);
        assert!(read.files.iter().any(|f| f.path == "criu/stats-dump"));
        assert!(
            !out.join(HANDED_OVER).exists(),
            "the record is not published"
        );
        let names: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("art")]);
    }

    #[test]
    fn a_sealed_capture_whose_workload_runs_on_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("art");
        let me = i32::try_from(std::process::id()).unwrap();
        let running = HandedOver::here(me, crate::runtime::stat::start_time(me).unwrap()).unwrap();
        let resumed = interrupted_capture(&out, Some(&running), false);
        let never_handed_over = interrupted_capture(&tmp.path().join("art2"), None, false);
        assert_eq!(recover_abandoned(&out, LATE, DAY).removed, vec![resumed]);
        assert_eq!(
            recover_abandoned(&tmp.path().join("art2"), LATE, DAY).removed,
            vec![never_handed_over]
        );
        assert!(!out.exists() && !tmp.path().join("art2").exists());
    }

    #[test]
    fn a_sealed_capture_of_a_running_checkpoint_is_published() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("art");
        interrupted_capture(&out, None, true);
        assert!(recover_abandoned(&out, LATE, DAY).published.is_some());
        warmstart_shared::artifact::read_published(&out, Verification::Checksums).unwrap();
    }

    #[test]
    fn a_sealed_capture_that_does_not_verify_is_removed_and_another_nodes_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("art");
        let gone = HandedOver::here(i32::try_from(DEAD_PID).unwrap(), 1).unwrap();
        let flipped = interrupted_capture(&out, Some(&gone), false);
        fs::write(flipped.join("criu/pages-1.img"), vec![8u8; 8192]).unwrap();
        let recovery = recover_abandoned(&out, LATE, DAY);
        assert_eq!(recovery.removed, vec![flipped]);
        assert!(recovery.published.is_none() && !out.exists());

        let elsewhere = HandedOver {
            node: "another-node".to_owned(),
            boot_id: "0123456789abcdef0123456789abcdef".to_owned(),
            ..gone
        };
        let theirs = interrupted_capture(&out, Some(&elsewhere), false);
        let recovery = recover_abandoned(&out, LATE, DAY);
        assert_eq!(recovery.kept.len(), 1, "{recovery:?}");
        assert!(theirs.exists() && !out.exists());
    }

    #[test]
    fn staged_links_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = Staging::create(&tmp.path().join("d")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", staging.path().join("link")).unwrap();
        let err = staging
            .publish(manifest(), &crate::progress::Meter::default())
            .unwrap_err();
        assert!(err.to_string().contains("only regular files"), "{err}");
        assert!(!tmp.path().join("d").exists());
    }

    #[test]
    fn unsafe_output_names_are_refused() {
        assert!(matches!(
            Staging::create(Path::new("/tmp/bad name")),
            Err(PublishError::Output { .. })
        ));
        assert!(Staging::create(Path::new("/")).is_err());
    }
}
