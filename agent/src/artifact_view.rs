//! The private view a restore reads an artifact through, so that the bytes CRIU and the rootfs
//! apply read are the bytes that were verified, and CRIU sees only the files the manifest lists.
//!
//! Whoever can write artifact storage (in cluster mode the controller's user owns the artifact's
//! directories, so it can rename and create entries there) could otherwise swap a file between
//! its checksum and CRIU's open, or add an image CRIU would read unverified. The view is a
//! directory only root can enter (`0700`, created exclusively, under `<artifact parent>/.views/`
//! on the artifact's filesystem) holding hard links to exactly the listed files: each link is
//! made from the descriptor opened (without following links) and checked, so it is that inode,
//! and each inode is immutable to everyone but root (root-owned, no write bit for group or
//! others; a file that is not is re-owned, and refused while anyone holds it open for writing).
//! The checksums are computed through the view, CRIU gets its `criu/` (the restore helper checks
//! it opened that very directory), the rootfs diff is read from it. A rename in the artifact
//! after the view is made no longer reaches the restore.
//!
//! A live view holds an exclusive `flock` on its directory; views nobody holds (an agent killed
//! mid-restore) are swept when the next view is made beside them.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, Flock, FlockArg, OFlag, openat};
use nix::sys::stat::{Mode, fchmod, mkdirat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, linkat, unlinkat};
use thiserror::Error;
use warmstart_shared::artifact::{ArtifactDir, FileError, Manifest, Published};
use warmstart_shared::names::ARTIFACT_CRIU_DIR;

/// The directory beside an artifact that holds the views of its restores.
pub const VIEWS_DIR: &str = ".views";

/// A view nobody holds is swept only once it is this old (one just created is locked a moment
/// after it appears).
const SWEEP_MIN_AGE: Duration = Duration::from_secs(60);

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// Why a view could not be made.
#[derive(Debug, Error)]
pub enum ViewError {
    /// The view (or the directory of views) could not be created or filled.
    #[error("cannot {op} {}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// Where.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A file of the artifact could be written by someone other than root and is open for
    /// writing: its bytes could change after they were verified.
    #[error(
        "artifact file {} is open for writing by another process (it was owned by uid {uid} with mode {mode:o}): its content could change after verification",
        path.display()
    )]
    Writable {
        /// The file.
        path: PathBuf,
        /// Its owner before it was re-owned.
        uid: u32,
        /// Its mode before.
        mode: u32,
    },
    /// A listed file is missing, not a regular file or of another size.
    #[error(transparent)]
    File(#[from] FileError),
}

/// A restore's private view of an artifact; removed when dropped.
#[derive(Debug)]
pub struct View {
    /// `<parent>/.views`, held open.
    views: OwnedFd,
    /// The view's name in it.
    name: String,
    /// The view, held open and locked for as long as it lives.
    lock: Flock<OwnedFd>,
    /// Its path.
    path: PathBuf,
    /// The view as a directory to read files from, named as the artifact in messages (its
    /// files are the artifact's, as they were verified).
    dir: ArtifactDir,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> ViewError + 'a {
    move |errno| ViewError::Io {
        op,
        path: path.to_path_buf(),
        source: errno.into(),
    }
}

/// This boot's id without dashes (names views for whoever looks at the directory).
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().replace('-', ""))
        .unwrap_or_else(|_| "unknown".to_owned())
}

impl View {
    /// Makes the view of `published` beside it: every listed file opened without following
    /// links, checked (regular, size, immutable to all but root) and linked in; the page images
    /// are asked to be read ahead. Views left by dead restores beside it are swept first.
    ///
    /// # Errors
    /// [`ViewError`] naming the file or directory.
    pub fn create(published: &Published) -> Result<Self, ViewError> {
        let artifact = published.dir().path();
        let (Some(parent), Some(artifact_name)) = (artifact.parent(), artifact.file_name()) else {
            return Err(ViewError::Io {
                op: "find the directory above",
                path: artifact.to_path_buf(),
                source: io::Error::from(io::ErrorKind::InvalidInput),
            });
        };
        let parent_dir = ArtifactDir::open(parent)
            .map_err(|e| ViewError::Io {
                op: "open",
                path: parent.to_path_buf(),
                source: io::Error::other(e),
            })?
            .ok_or_else(|| ViewError::Io {
                op: "open",
                path: parent.to_path_buf(),
                source: io::Error::from(io::ErrorKind::NotFound),
            })?;
        let views_path = parent.join(VIEWS_DIR);
        match mkdirat(&parent_dir, VIEWS_DIR, Mode::S_IRWXU) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(errno) => return Err(io_err("create", &views_path)(errno)),
        }
        let views = openat(&parent_dir, VIEWS_DIR, DIR_FLAGS, Mode::empty())
            .map_err(io_err("open", &views_path))?;
        sweep_at(&views, &views_path);
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{}-{}-{}-{}",
            boot_id(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            artifact_name.to_string_lossy()
        );
        let path = views_path.join(&name);
        mkdirat(&views, name.as_str(), Mode::S_IRWXU).map_err(io_err("create", &path))?;
        let created = openat(&views, name.as_str(), DIR_FLAGS, Mode::empty())
            .map_err(io_err("open", &path))
            .and_then(|fd| {
                Flock::lock(fd, FlockArg::LockExclusiveNonblock)
                    .map_err(|(_, errno)| io_err("lock", &path)(errno))
            });
        let lock = match created {
            Ok(lock) => lock,
            Err(err) => {
                let _ = unlinkat(&views, name.as_str(), UnlinkatFlags::RemoveDir);
                return Err(err);
            }
        };
        let dup = nix::unistd::dup(lock.as_fd()).map_err(io_err("open", &path))?;
        let view = Self {
            views,
            name,
            lock,
            path: path.clone(),
            dir: ArtifactDir::from_fd(artifact.to_path_buf(), dup),
        };
        // The directory was created by this process a moment ago; check that the one held is
        // it (root's, private, empty) before anything is linked into it.
        let meta =
            File::from(nix::unistd::dup(view.lock.as_fd()).map_err(io_err("inspect", &path))?)
                .metadata()
                .map_err(|source| ViewError::Io {
                    op: "inspect",
                    path: path.clone(),
                    source,
                })?;
        if meta.uid() != nix::unistd::geteuid().as_raw()
            || meta.mode() & 0o7777 != 0o700
            || meta.nlink() != 2
        {
            return Err(ViewError::Io {
                op: "take as a private view",
                path,
                source: io::Error::other("not the empty private directory just created"),
            });
        }
        view.fill(published)?;
        Ok(view)
    }

    fn fill(&self, published: &Published) -> Result<(), ViewError> {
        let manifest: &Manifest = published.manifest();
        let mut made: Vec<&str> = Vec::new();
        for entry in &manifest.files {
            for (at, _) in entry.path.match_indices('/') {
                let sub = &entry.path[..at];
                if !made.contains(&sub) {
                    let shown = self.path.join(sub);
                    mkdirat(self.lock.as_fd(), sub, Mode::S_IRWXU)
                        .map_err(io_err("create", &shown))?;
                    made.push(sub);
                }
            }
            let file = published.dir().open_file(&entry.path)?;
            let shown = published.dir().path().join(&entry.path);
            let meta = file.metadata().map_err(|source| FileError::Read {
                path: shown.clone(),
                source,
            })?;
            if meta.len() != entry.size {
                return Err(FileError::Size {
                    path: shown,
                    expected: entry.size,
                    actual: meta.len(),
                }
                .into());
            }
            make_immutable(&file, &meta, &shown)?;
            // The link is made from the descriptor: the inode checked above, whatever the
            // artifact's directory entry points to by now.
            let source = format!("/proc/self/fd/{}", file.as_raw_fd());
            linkat(
                nix::fcntl::AT_FDCWD,
                source.as_str(),
                self.lock.as_fd(),
                entry.path.as_str(),
                AtFlags::AT_SYMLINK_FOLLOW,
            )
            .map_err(io_err("link", &self.path.join(&entry.path)))?;
            if is_page_image(entry) {
                let _ = nix::fcntl::posix_fadvise(
                    &file,
                    0,
                    0,
                    nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
                );
            }
        }
        Ok(())
    }

    /// The view's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The view, to open files in (it holds exactly the listed files; messages name them as
    /// the artifact's).
    pub fn dir(&self) -> &ArtifactDir {
        &self.dir
    }

    /// Another handle on the view's directory, for a thread of its own.
    ///
    /// # Errors
    /// The errno of `dup`.
    pub fn dir_handle(&self) -> io::Result<ArtifactDir> {
        let fd = nix::unistd::dup(self.lock.as_fd())?;
        Ok(ArtifactDir::from_fd(self.dir.path().to_path_buf(), fd))
    }

    /// A path to a file of the view that resolves through this process's descriptor of it
    /// (`/proc/self/fd/<n>/<relative>`), so a rename of the view's path cannot redirect it.
    pub fn pinned_path(&self, relative: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.lock.as_raw_fd())).join(relative)
    }

    /// The view's CRIU images directory by path (for the restore helper, another process) and
    /// its identity (device, inode), which the helper checks after opening it.
    ///
    /// # Errors
    /// When it cannot be opened or inspected.
    pub fn images_dir(&self) -> Result<(PathBuf, (u64, u64)), ViewError> {
        let path = self.path.join(ARTIFACT_CRIU_DIR);
        let fd = openat(
            self.lock.as_fd(),
            ARTIFACT_CRIU_DIR,
            DIR_FLAGS,
            Mode::empty(),
        )
        .map_err(io_err("open", &path))?;
        let st = nix::sys::stat::fstat(&fd).map_err(io_err("inspect", &path))?;
        Ok((path, (st.st_dev, st.st_ino)))
    }
}

impl Drop for View {
    fn drop(&mut self) {
        if let Err(err) = remove_contents(self.lock.as_fd(), &self.path) {
            tracing::warn!(view = %self.path.display(), error = %err, "cannot empty a restore's view of its artifact");
        }
        if let Err(err) = unlinkat(&self.views, self.name.as_str(), UnlinkatFlags::RemoveDir) {
            tracing::warn!(view = %self.path.display(), error = %err, "cannot remove a restore's view of its artifact");
        }
    }
}

/// Makes `file` immutable to everyone but root: a file already root's without write bits for
/// group and others is left as it is; another (published before artifacts were kept so, or put
/// there by the artifact's owner) is given to root with mode 0444, then refused if anyone holds
/// it open for writing (a descriptor opened while it was writable would outlive the change).
fn make_immutable(file: &File, meta: &std::fs::Metadata, path: &Path) -> Result<(), ViewError> {
    if meta.uid() == 0 && meta.mode() & 0o022 == 0 {
        return Ok(());
    }
    let failed = |op| {
        move |errno: Errno| ViewError::Io {
            op,
            path: path.to_path_buf(),
            source: errno.into(),
        }
    };
    // Owner first: the former owner can no longer change the mode once root owns it.
    fchown(file, Some(Uid::from_raw(0)), Some(Gid::from_raw(0))).map_err(failed("re-own"))?;
    fchmod(file, Mode::from_bits_truncate(0o444)).map_err(failed("make read-only"))?;
    let writers = crate::sys::lease::open_for_writing(file).map_err(|source| ViewError::Io {
        op: "check for writers of",
        path: path.to_path_buf(),
        source,
    })?;
    if writers {
        return Err(ViewError::Writable {
            path: path.to_path_buf(),
            uid: meta.uid(),
            mode: meta.mode() & 0o7777,
        });
    }
    tracing::info!(file = %path.display(), uid = meta.uid(), mode = format!("{:o}", meta.mode() & 0o7777), "artifact file made root's and read-only");
    Ok(())
}

/// Removes everything inside the directory `dir` (never following a link), not `dir` itself.
fn remove_contents(dir: BorrowedFd<'_>, shown: &Path) -> io::Result<()> {
    let listing = openat(dir, ".", DIR_FLAGS, Mode::empty())?;
    let mut names = Vec::new();
    let mut list = nix::dir::Dir::from_fd(listing)?;
    for entry in list.iter() {
        let entry = entry?;
        let name = entry.file_name().to_owned();
        if name.as_bytes() != b"." && name.as_bytes() != b".." {
            names.push(name);
        }
    }
    for name in names {
        match unlinkat(dir, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) => {}
            Err(Errno::EISDIR) => {
                let sub = openat(dir, name.as_c_str(), DIR_FLAGS, Mode::empty())?;
                remove_contents(sub.as_fd(), &shown.join(name.to_string_lossy().as_ref()))?;
                unlinkat(dir, name.as_c_str(), UnlinkatFlags::RemoveDir)?;
            }
            Err(errno) => return Err(errno.into()),
        }
    }
    Ok(())
}

/// Removes the views in `views` that no live restore holds (its lock is free) and that are old
/// enough not to be one being made. Best effort.
fn sweep_at(views: &OwnedFd, shown: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(listing) = openat(views, ".", DIR_FLAGS, Mode::empty()) else {
        return removed;
    };
    let Ok(mut list) = nix::dir::Dir::from_fd(listing) else {
        return removed;
    };
    let names: Vec<String> = list
        .iter()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "." && n != "..")
        .collect();
    let now = SystemTime::now();
    for name in names {
        let Ok(fd) = openat(views, name.as_str(), DIR_FLAGS, Mode::empty()) else {
            continue;
        };
        let old = File::from(match nix::unistd::dup(&fd) {
            Ok(dup) => dup,
            Err(_) => continue,
        })
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| now.duration_since(t).ok())
        .is_some_and(|age| age >= SWEEP_MIN_AGE);
        if !old {
            continue;
        }
        let Ok(lock) = Flock::lock(fd, FlockArg::LockExclusiveNonblock) else {
            continue;
        };
        let path = shown.join(&name);
        match remove_contents(lock.as_fd(), &path).and_then(|()| {
            unlinkat(views, name.as_str(), UnlinkatFlags::RemoveDir).map_err(Into::into)
        }) {
            Ok(()) => {
                tracing::info!(view = %path.display(), "removed a view left by a restore that ended");
                removed.push(path);
            }
            Err(err) => {
                tracing::warn!(view = %path.display(), error = %err, "cannot remove a view left by a restore")
            }
        }
    }
    removed
}

/// Sweeps the views beside the artifact `artifact` (see [`View`]); returns what it removed.
pub fn sweep(artifact: &Path) -> Vec<PathBuf> {
    let Some(parent) = artifact.parent() else {
        return Vec::new();
    };
    let views_path = parent.join(VIEWS_DIR);
    let Ok(Some(parent_dir)) = ArtifactDir::open(parent) else {
        return Vec::new();
    };
    match openat(&parent_dir, VIEWS_DIR, DIR_FLAGS, Mode::empty()) {
        Ok(views) => sweep_at(&views, &views_path),
        Err(_) => Vec::new(),
    }
}

/// Whether a file of the artifact is a CRIU page image: raw memory that CRIU copies into the
/// restored tree without interpreting it, so its checksum can still be running while CRIU
/// restores (the tree stays stopped until it matched).
pub fn is_page_image(entry: &warmstart_shared::artifact::FileEntry) -> bool {
    entry
        .path
        .strip_prefix(&format!(
            "{}/pages-",
            warmstart_shared::names::ARTIFACT_CRIU_DIR
        ))
        .is_some_and(|rest| rest.ends_with(".img") && !rest.contains('/'))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use sha2::{Digest, Sha256};
    use warmstart_shared::artifact::{
        CompletionMarker, CriuInfo, FileEntry, SourceInfo, open_published, verify_checksums,
    };
    use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

    use super::*;

    /// The controller's user in cluster mode.
    const OWNER: u32 = 65532;

    fn is_root() -> bool {
        crate::testing::root("re-owning files, links through /proc/self/fd")
    }

    /// A published artifact `<tmp>/ns/art` as the agent publishes it: root's files, read-only.
    fn publish(tmp: &Path, files: &[(&str, &[u8])]) -> PathBuf {
        let dir = tmp.join("ns").join("art");
        let mut m = Manifest {
            format_version: 2,
            identity_hash: "0123456789abcdef".into(),
            created_at: "2026-12-05T00:00:00Z".into(),
            source: SourceInfo::default(),
            criu: CriuInfo::default(),
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: Default::default(),
            chunk_bytes: 4096,
            files: vec![],
            digest: String::new(),
        };
        for (path, content) in files {
            let full = dir.join(path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(&full, content).unwrap();
            std::fs::set_permissions(&full, std::fs::Permissions::from_mode(0o444)).unwrap();
            m.files.push(FileEntry {
                path: (*path).into(),
                size: content.len() as u64,
                sha256: String::new(),
                chunks: content
                    .chunks(4096)
                    .map(|c| hex::encode(Sha256::digest(c)))
                    .collect(),
            });
        }
        m.seal();
        std::fs::write(dir.join(FILE_MANIFEST), m.to_json().unwrap()).unwrap();
        std::fs::write(
            dir.join(FILE_COMPLETE),
            serde_json::to_vec(&CompletionMarker::for_manifest(&m)).unwrap(),
        )
        .unwrap();
        dir
    }

    fn views_of(artifact: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(artifact.parent().unwrap().join(VIEWS_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_file_swapped_after_the_view_is_made_never_reaches_the_reader() {
        if !is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let pages = vec![7u8; 3 * 4096];
        let artifact = publish(
            tmp.path(),
            &[("criu/pages-1.img", &pages), ("rootfs-diff.tar", b"tar")],
        );
        let published = open_published(&artifact).unwrap();
        let view = View::create(&published).unwrap();
        // Private to root, on the artifact's filesystem, holding exactly the listed files.
        let meta = std::fs::metadata(view.path()).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o700);
        assert_eq!(meta.uid(), 0);
        assert!(
            view.path()
                .starts_with(artifact.parent().unwrap().join(VIEWS_DIR))
        );
        let mut listed: Vec<String> = Vec::new();
        for entry in walk(view.path()) {
            listed.push(entry);
        }
        assert_eq!(listed, ["criu", "criu/pages-1.img", "rootfs-diff.tar"]);
        // The owner of the artifact's directories renames a tampered copy over the page image.
        let mut tampered = pages.clone();
        tampered[5000] ^= 1;
        let swap = artifact.join("criu/.swap");
        std::fs::write(&swap, &tampered).unwrap();
        std::fs::rename(&swap, artifact.join("criu/pages-1.img")).unwrap();
        // What the restore reads (checksums, CRIU, the rootfs apply) is what was verified.
        verify_checksums(view.dir(), published.manifest(), &|_| true, 2, &|_| {}).unwrap();
        assert_eq!(
            std::fs::read(view.path().join("criu/pages-1.img")).unwrap(),
            pages
        );
        assert_eq!(
            std::fs::read(view.pinned_path("rootfs-diff.tar")).unwrap(),
            b"tar"
        );
        let (images, (dev, ino)) = view.images_dir().unwrap();
        let st = nix::sys::stat::stat(&images).unwrap();
        assert_eq!((st.st_dev, st.st_ino), (dev, ino));
        // The artifact itself now differs: a new view sees it.
        let err = verify_checksums(
            open_published(&artifact).unwrap().dir(),
            published.manifest(),
            &|_| true,
            2,
            &|_| {},
        )
        .unwrap_err();
        assert!(
            matches!(err, FileError::ChunkChecksum { chunk: 1, .. }),
            "{err}"
        );
        let path = view.path().to_path_buf();
        drop(view);
        assert!(!path.exists(), "the view is removed with the restore");
        assert!(views_of(&artifact).is_empty());
    }

    fn walk(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            for entry in std::fs::read_dir(dir.join(&rel)).unwrap() {
                let entry = entry.unwrap();
                let path = rel.join(entry.file_name());
                if entry.file_type().unwrap().is_dir() {
                    stack.push(path.clone());
                }
                out.push(path.to_string_lossy().into_owned());
            }
        }
        out.sort();
        out
    }

    #[test]
    fn files_another_user_could_write_are_made_roots_or_refused_while_open_for_writing() {
        if !is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let artifact = publish(tmp.path(), &[("criu/pages-1.img", b"pages")]);
        let file = artifact.join("criu/pages-1.img");
        // As artifacts were handed over before: the controller's user owns the file.
        std::os::unix::fs::chown(&file, Some(OWNER), Some(OWNER)).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let published = open_published(&artifact).unwrap();
        let view = View::create(&published).unwrap();
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (0, 0, 0o444)
        );
        drop(view);

        // Its owner kept a descriptor open for writing from when it could: refused, since the
        // content could change after it was verified.
        std::os::unix::fs::chown(&file, Some(OWNER), Some(OWNER)).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let writer = std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .unwrap();
        let err = View::create(&published).unwrap_err();
        assert!(
            matches!(&err, ViewError::Writable { path, uid: OWNER, mode: 0o644 } if *path == file),
            "{err}"
        );
        assert!(err.to_string().contains("open for writing"), "{err}");
        assert!(views_of(&artifact).is_empty(), "a refused view is removed");
        drop(writer);
    }

    #[test]
    fn views_no_restore_holds_are_swept_and_held_ones_are_not() {
        if !is_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let artifact = publish(tmp.path(), &[("criu/pages-1.img", b"pages")]);
        let published = open_published(&artifact).unwrap();
        let held = View::create(&published).unwrap();
        // A view left by a restore that died (nobody holds its lock), with CRIU's output in it.
        let views = artifact.parent().unwrap().join(VIEWS_DIR);
        let left = views.join("deadbeef-1-0-art");
        std::fs::create_dir_all(left.join("criu")).unwrap();
        std::fs::write(left.join("criu/stats-restore"), b"x").unwrap();
        let old = nix::sys::time::TimeSpec::new(1, 0);
        for dir in [&left, &held.path().to_path_buf()] {
            nix::sys::stat::utimensat(
                nix::fcntl::AT_FDCWD,
                dir.as_path(),
                &old,
                &old,
                nix::sys::stat::UtimensatFlags::NoFollowSymlink,
            )
            .unwrap();
        }
        assert_eq!(sweep(&artifact), vec![left.clone()]);
        assert!(!left.exists());
        assert!(
            held.path().join("criu/pages-1.img").exists(),
            "a held view stays"
        );
        // A fresh leftover is left alone (it may be a view being made).
        std::fs::create_dir(&left).unwrap();
        assert!(sweep(&artifact).is_empty());
        drop(held);
        assert_eq!(views_of(&artifact), ["deadbeef-1-0-art"]);
    }
}
