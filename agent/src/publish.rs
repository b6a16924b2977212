//! Artifact publication: a capture is written into a staging directory beside the final one,
//! every file is hashed into the manifest while the disk writes it back, everything is fsynced,
//! the staging directory is renamed into place in one `renameat2(RENAME_NOREPLACE)`, and the
//! completion marker is written last. A published artifact is therefore always complete; a crash
//! leaves only a staging directory (`.staging-*`), which nothing reads and the sweeper removes.
//! Every published file is read-only (mode 0444, owned by the agent's user, root): whoever may
//! later own the artifact's directories (the controller's user, which deletes artifacts) can
//! remove or rename files but never write one in place.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
use thiserror::Error;
use warmstart_shared::artifact::{
    CompletionMarker, FileEntry, Manifest, resolve_dir, validate_path_element,
    validate_relative_file,
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

/// A staging directory for one capture. Dropped unpublished, it removes itself.
#[derive(Debug)]
pub struct Staging {
    final_dir: PathBuf,
    dir: PathBuf,
    published: bool,
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
        let dir = parent.join(format!(
            "{STAGING_PREFIX}{name}-{}-{nanos}",
            std::process::id()
        ));
        fs::create_dir(&dir).map_err(io_err("create staging directory", &dir))?;
        Ok(Self {
            final_dir: final_dir.to_path_buf(),
            dir,
            published: false,
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
        progress: &mut dyn FnMut(u64),
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
        progress: &mut dyn FnMut(u64),
    ) -> Result<Sealed, PublishError> {
        if manifest.format_version >= 2 && manifest.chunk_bytes == 0 {
            manifest.chunk_bytes = warmstart_shared::filehash::CHUNK_BYTES;
        }
        let files = list_tree(&self.dir)?;
        // The disk writes the staged files back while they are hashed (out of the page cache),
        // so sealing takes the longer of the two rather than both. The fsync below, after the
        // manifest is written, is what makes the staging durable; this one only starts it early.
        let (digests, flushed) = std::thread::scope(|scope| {
            let flush = std::thread::Builder::new()
                .name("fsync-staging".to_owned())
                .spawn_scoped(scope, || fsync_tree(&self.dir));
            let digests = digest_files(&manifest, files);
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
        progress(manifest.total_size());
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
        files.extend(digest_files(&self.manifest, stale)?);
        self.manifest.files = files;
        self.manifest.seal();
        write_durable(
            &self.staging.dir.join(FILE_MANIFEST),
            &self.manifest.to_json().map_err(PublishError::Manifest)?,
        )?;
        fsync_tree(&self.staging.dir)
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
        let marker =
            serde_json::to_vec(&CompletionMarker::for_manifest(&manifest)).map_err(|e| {
                io_err("serialise completion marker for", &final_dir)(io::Error::other(e))
            })?;
        write_durable(&final_dir.join(FILE_COMPLETE), &marker)?;
        fsync_dir(&final_dir)?;
        Ok(manifest)
    }
}

/// Removes staging directories of `final_dir` whose creating process is gone (an agent killed
/// mid-checkpoint): they are never read, and a dump can be gigabytes. Returns what it removed.
/// Staging directories of live processes are left alone.
pub fn sweep_abandoned(final_dir: &Path) -> Vec<PathBuf> {
    let (Some(parent), Some(name)) = (final_dir.parent(), final_dir.file_name()) else {
        return Vec::new();
    };
    let prefix = format!("{STAGING_PREFIX}{}-", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(owner) = file_name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && !Path::new(&format!("/proc/{owner}")).exists() {
            let path = entry.path();
            if fs::remove_dir_all(&path).is_ok() {
                tracing::info!(staging = %path.display(), "removed an abandoned staging directory");
                removed.push(path);
            }
        }
    }
    removed
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
) -> Result<Vec<FileEntry>, PublishError> {
    let paths: Vec<(PathBuf, u64)> = files.iter().map(|(_, p, s)| (p.clone(), *s)).collect();
    let threads = filehash::threads();
    let hash_err = |e: filehash::ReadError| io_err("hash", &e.path)(e.source);
    if manifest.format_version >= 2 {
        let chunks = filehash::chunk_digests(&paths, manifest.chunk_bytes, threads, &|_| {})
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
        let digests = filehash::whole_digests(&paths, threads, &|_| {}).map_err(hash_err)?;
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
            if rel_str == FILE_MANIFEST || rel_str == FILE_COMPLETE {
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

fn fsync_tree(dir: &Path) -> Result<(), PublishError> {
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
        let mut seen = 0;
        let m = staging.publish(manifest(), &mut |n| seen += n).unwrap();
        assert_eq!(seen, 4099);
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
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root (files handed to another user)");
            return;
        }
        const OWNER: u32 = 65532;
        let tmp = tempfile::tempdir().unwrap();
        let ns = tmp.path().join("ns");
        let out = ns.join("0123456789abcdef");
        let staging = Staging::create(&out).unwrap();
        fs::create_dir(staging.path().join("criu")).unwrap();
        fs::write(staging.path().join("criu/pages-1.img"), vec![7u8; 4096]).unwrap();
        staging.publish(manifest(), &mut |_| {}).unwrap();
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
            staging.publish(manifest(), &mut |_| {}),
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

    #[test]
    fn abandoned_staging_directories_of_dead_processes_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("art");
        let dead = tmp.path().join(".staging-art-999999999-1");
        let mine = tmp
            .path()
            .join(format!(".staging-art-{}-2", std::process::id()));
        let other = tmp.path().join(".staging-other-999999999-3");
        for d in [&dead, &mine, &other] {
            fs::create_dir(d).unwrap();
        }
        assert_eq!(sweep_abandoned(&out), vec![dead.clone()]);
        assert!(!dead.exists() && mine.exists() && other.exists());
    }

    #[test]
    fn staged_links_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = Staging::create(&tmp.path().join("d")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", staging.path().join("link")).unwrap();
        let err = staging.publish(manifest(), &mut |_| {}).unwrap_err();
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
