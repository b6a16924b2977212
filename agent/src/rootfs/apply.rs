//! Applying a validated plan into another container's root filesystem.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{
    FileStat, Mode, UtimensatFlags, fchmod, fstatat, futimens, mkdirat, utimensat,
};
use nix::unistd::{
    Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, mkfifoat, symlinkat, unlinkat,
};
use xattr::FileExt;

use super::plan::*;
use super::walk::*;
use super::*;

/// Applies the layer tarball `tar` onto `root` (the placeholder's root filesystem: a host path to
/// its merged overlay mount) with OCI semantics.
///
/// The whole tarball is validated first ([`read_plan`]); nothing is changed if it is refused.
/// Then: every opaque marker removes every existing child of its directory and every whiteout
/// removes its path (recursively), all before any entry is added; then the entries are created in
/// tarball order (a directory over an existing directory keeps it, anything else replaces what is
/// there) with mode, owner, extended attributes and mtime; directory mtimes are set last. See the
/// module documentation for how the target is resolved without following its symbolic links.
///
/// A failure after validation leaves the target partly changed; the caller must then treat the
/// placeholder as unusable.
pub fn apply_diff(tar: &Path, root: &Path) -> Result<DiffStats, RootfsError> {
    apply_diff_keeping(tar, root, &[])
}

/// [`apply_diff`], leaving alone every path at or below one of `keep` (relative to `root`): no
/// entry there is removed, replaced or added. The restore passes the placeholder's mount points:
/// in the source, the upper directory holds only the runtime's empty stubs there (`etc/hosts`,
/// `etc/resolv.conf`, …, hidden under the mounts), and in the placeholder the same paths are
/// mount points in *its* mount namespace, invisible here: replacing such a stub unlinks the
/// dentry the placeholder's mount sits on, and the kernel then silently detaches that mount.
/// Entries are still validated and counted as with [`apply_diff`].
pub fn apply_diff_keeping(
    tar: &Path,
    root: &Path,
    keep: &[PathBuf],
) -> Result<DiffStats, RootfsError> {
    let kept = |path: &Path| keep.iter().any(|k| path.starts_with(k));
    let plan = read_plan(tar)?;
    let root_fd = nix::fcntl::open(
        root,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err("open target root", root))?;
    let target = Target {
        root,
        fd: root_fd.as_fd(),
    };

    // Removals first.
    for entry in plan.entries.iter().filter(|e| !kept(&e.path)) {
        match entry.kind {
            EntryKind::Opaque => target.clear_dir(&entry.path)?,
            EntryKind::Whiteout => target.remove_path(&entry.path)?,
            _ => {}
        }
    }

    // Additions, streaming the data.
    let mut dir_times = Vec::new();
    let mut next = plan.entries.iter().peekable();
    for_each_entry(tar, |index, parsed, data| {
        let Some(parsed) = parsed else {
            return Ok(());
        };
        match next.next() {
            Some(expected) if *expected == parsed => {}
            _ => {
                return Err(RootfsError::Changed {
                    tar: tar.to_path_buf(),
                    index,
                });
            }
        }
        if kept(&parsed.path) {
            return Ok(());
        }
        if let Some(mtime) = target.add(&parsed, data, tar)? {
            dir_times.push((parsed.path.clone(), mtime));
        }
        Ok(())
    })?;
    if next.next().is_some() {
        return Err(RootfsError::Changed {
            tar: tar.to_path_buf(),
            index: plan.entries.len(),
        });
    }

    // Directory times last: adding children changed them.
    for (path, mtime) in dir_times.iter().rev() {
        let shown = root.join(path);
        let fd = target.open_existing_dir(path)?;
        let time = mtime.timespec();
        futimens(&fd, &time, &time).map_err(io_err("set mtime of", &shown))?;
    }
    Ok(plan.stats)
}

struct Target<'a> {
    root: &'a Path,
    fd: BorrowedFd<'a>,
}

impl Target<'_> {
    fn unsafe_target(&self, path: &Path, reason: impl Into<String>) -> RootfsError {
        RootfsError::UnsafeTarget {
            root: self.root.to_path_buf(),
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// Maps a resolution error to a refusal (symbolic link, non-directory, mount crossing) or an
    /// I/O error.
    fn resolve_err(&self, path: &Path, errno: Errno) -> RootfsError {
        match errno {
            Errno::ELOOP => {
                self.unsafe_target(path, "a component is a symbolic link in the target")
            }
            Errno::ENOTDIR => {
                self.unsafe_target(path, "a component is not a directory in the target")
            }
            Errno::EXDEV => self.unsafe_target(path, "a component is a mount point in the target"),
            other => RootfsError::Io {
                op: "resolve in target",
                path: self.root.join(path),
                source: other.into(),
            },
        }
    }

    /// Opens an existing directory of the target, refusing symbolic links and mount points.
    fn open_existing_dir(&self, path: &Path) -> Result<OwnedFd, RootfsError> {
        open_dir_beneath(self.fd, path).map_err(|errno| self.resolve_err(path, errno))
    }

    /// Opens the directory at `path` if it exists as a directory reachable without symbolic links;
    /// `None` when anything on the way is missing or not a directory.
    fn open_dir_if_present(&self, path: &Path) -> Result<Option<OwnedFd>, RootfsError> {
        match open_dir_beneath(self.fd, path) {
            Ok(fd) => Ok(Some(fd)),
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => Ok(None),
            Err(errno) => Err(self.resolve_err(path, errno)),
        }
    }

    /// `.wh..wh..opq`: removes every child of the directory (nothing if it is not a directory
    /// in the target).
    fn clear_dir(&self, path: &Path) -> Result<(), RootfsError> {
        let Some(dir) = self.open_dir_if_present(path)? else {
            return Ok(());
        };
        let shown = self.root.join(path);
        for name in list_dir(dir.as_fd(), &shown)? {
            remove_tree(dir.as_fd(), &name, &shown.join(&name))?;
        }
        Ok(())
    }

    /// `.wh.<name>`: removes the path recursively (nothing if it or a parent is missing, or a
    /// parent is not a directory in the target).
    fn remove_path(&self, path: &Path) -> Result<(), RootfsError> {
        let (parent, name) = split(path);
        let Some(dir) = self.open_dir_if_present(parent)? else {
            return Ok(());
        };
        remove_tree(dir.as_fd(), name, &self.root.join(path))
    }

    /// Opens the parent directory of `path`, creating missing ancestors (`0755`, owned by the
    /// caller); refuses symbolic links, non-directories and mount points on the way.
    fn parent_dir(&self, path: &Path) -> Result<OwnedFd, RootfsError> {
        let (parent, _) = split(path);
        match open_dir_beneath(self.fd, parent) {
            Ok(fd) => return Ok(fd),
            Err(Errno::ENOENT) => {}
            Err(errno) => return Err(self.resolve_err(parent, errno)),
        }
        let mut current = open_dir_beneath(self.fd, Path::new(""))
            .map_err(|errno| self.resolve_err(Path::new(""), errno))?;
        let mut walked = PathBuf::new();
        for component in parent.iter() {
            walked.push(component);
            let name = Path::new(component);
            let next = match open_dir_beneath(current.as_fd(), name) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => {
                    let shown = self.root.join(&walked);
                    mkdirat(current.as_fd(), name, Mode::from_bits_truncate(0o755))
                        .map_err(io_err("create directory", &shown))?;
                    let fd = open_dir_beneath(current.as_fd(), name)
                        .map_err(|errno| self.resolve_err(&walked, errno))?;
                    fchmod(&fd, Mode::from_bits_truncate(0o755))
                        .map_err(io_err("chmod", &shown))?;
                    fd
                }
                Err(errno) => return Err(self.resolve_err(&walked, errno)),
            };
            current = next;
        }
        Ok(current)
    }

    /// Creates one entry; returns the directory's mtime for a directory (set at the end).
    fn add<R: Read>(
        &self,
        entry: &PlanEntry,
        data: &mut R,
        tar: &Path,
    ) -> Result<Option<MTime>, RootfsError> {
        let Placed {
            shown,
            name,
            owner,
            mode,
            time,
        } = Placed::of(self.root, entry);
        match &entry.kind {
            EntryKind::Whiteout | EntryKind::Opaque => Ok(None),
            EntryKind::Dir => {
                let parent = self.parent_dir(&entry.path)?;
                let existing = stat_if_present(parent.as_fd(), name, &shown)?;
                if !existing.as_ref().is_some_and(is_dir) {
                    if existing.is_some() {
                        remove_tree(parent.as_fd(), name, &shown)?;
                    }
                    mkdirat(parent.as_fd(), name, Mode::from_bits_truncate(0o700))
                        .map_err(io_err("create directory", &shown))?;
                }
                let fd = open_dir_beneath(parent.as_fd(), Path::new(name))
                    .map_err(|errno| self.resolve_err(&entry.path, errno))?;
                fchown(&fd, owner.0, owner.1).map_err(io_err("chown", &shown))?;
                fchmod(&fd, mode).map_err(io_err("chmod", &shown))?;
                set_xattrs(&File::from(fd), &entry.xattrs, &shown)?;
                Ok(Some(entry.mtime))
            }
            EntryKind::File { size } => {
                self.add_file(entry, *size, data, tar)?;
                Ok(None)
            }
            EntryKind::Symlink { target } => {
                let parent = self.parent_dir(&entry.path)?;
                remove_tree(parent.as_fd(), name, &shown)?;
                symlinkat(target.as_path(), parent.as_fd(), name)
                    .map_err(io_err("create symbolic link", &shown))?;
                fchownat(
                    parent.as_fd(),
                    name,
                    owner.0,
                    owner.1,
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(io_err("chown", &shown))?;
                utimensat(
                    parent.as_fd(),
                    name,
                    &time,
                    &time,
                    UtimensatFlags::NoFollowSymlink,
                )
                .map_err(io_err("set mtime of", &shown))?;
                Ok(None)
            }
            EntryKind::Hardlink { target } => {
                let parent = self.parent_dir(&entry.path)?;
                remove_tree(parent.as_fd(), name, &shown)?;
                let (target_parent, target_name) = split(target);
                let target_dir = self.open_existing_dir(target_parent)?;
                linkat(
                    target_dir.as_fd(),
                    target_name,
                    parent.as_fd(),
                    name,
                    AtFlags::empty(),
                )
                .map_err(io_err("create hard link", &shown))?;
                Ok(None)
            }
            EntryKind::Fifo => {
                let parent = self.parent_dir(&entry.path)?;
                remove_tree(parent.as_fd(), name, &shown)?;
                mkfifoat(parent.as_fd(), name, Mode::from_bits_truncate(0o600))
                    .map_err(io_err("create fifo", &shown))?;
                let fd = open_beneath(
                    parent.as_fd(),
                    Path::new(name),
                    OFlag::O_RDONLY | OFlag::O_NONBLOCK,
                    Mode::empty(),
                )
                .map_err(io_err("open fifo", &shown))?;
                fchown(&fd, owner.0, owner.1).map_err(io_err("chown", &shown))?;
                fchmod(&fd, mode).map_err(io_err("chmod", &shown))?;
                futimens(&fd, &time, &time).map_err(io_err("set mtime of", &shown))?;
                Ok(None)
            }
        }
    }

    /// Creates a regular file with `size` bytes of `data` (the tarball's entry), its owner,
    /// mode, extended attributes and mtime.
    fn add_file<R: Read>(
        &self,
        entry: &PlanEntry,
        size: u64,
        data: &mut R,
        tar: &Path,
    ) -> Result<(), RootfsError> {
        let Placed {
            shown,
            name,
            owner,
            mode,
            time,
        } = Placed::of(self.root, entry);
        let parent = self.parent_dir(&entry.path)?;
        remove_tree(parent.as_fd(), name, &shown)?;
        let fd = open_beneath(
            parent.as_fd(),
            Path::new(name),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(io_err("create", &shown))?;
        let mut file = File::from(fd);
        let copied = io::copy(&mut data.take(size), &mut file).map_err(|source| {
            // Reading the tarball or writing the target: say which.
            if source.kind() == io::ErrorKind::UnexpectedEof {
                RootfsError::Corrupt {
                    tar: tar.to_path_buf(),
                    index: entry.index,
                    source,
                }
            } else {
                RootfsError::Io {
                    op: "write",
                    path: shown.clone(),
                    source,
                }
            }
        })?;
        if copied != size {
            return Err(RootfsError::Corrupt {
                tar: tar.to_path_buf(),
                index: entry.index,
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the entry's data is shorter than its size",
                ),
            });
        }
        fchown(&file, owner.0, owner.1).map_err(io_err("chown", &shown))?;
        fchmod(&file, mode).map_err(io_err("chmod", &shown))?;
        set_xattrs(&file, &entry.xattrs, &shown)?;
        futimens(&file, &time, &time).map_err(io_err("set mtime of", &shown))?;
        Ok(())
    }
}

/// Where an entry goes and what it gets: its path (for messages), its name in its parent, owner,
/// mode and mtime.
struct Placed<'a> {
    shown: PathBuf,
    name: &'a OsStr,
    owner: (Option<Uid>, Option<Gid>),
    mode: Mode,
    time: TimeSpec,
}

impl<'a> Placed<'a> {
    fn of(root: &Path, entry: &'a PlanEntry) -> Self {
        Self {
            shown: root.join(&entry.path),
            name: split(&entry.path).1,
            owner: (
                Some(Uid::from_raw(entry.uid)),
                Some(Gid::from_raw(entry.gid)),
            ),
            mode: Mode::from_bits_truncate(entry.mode),
            time: entry.mtime.timespec(),
        }
    }
}

/// Splits a relative path into its parent (possibly empty) and last component.
pub(super) fn split(path: &Path) -> (&Path, &OsStr) {
    (
        path.parent().unwrap_or(Path::new("")),
        path.file_name().unwrap_or_default(),
    )
}

fn stat_if_present(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    shown: &Path,
) -> Result<Option<FileStat>, RootfsError> {
    match fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(errno) => Err(io_err("stat", shown)(errno)),
    }
}

/// Removes `name` in `dir`, recursively for a directory, never following symbolic links and
/// never entering another mount. A missing name is not an error.
fn remove_tree(dir: BorrowedFd<'_>, name: &OsStr, shown: &Path) -> Result<(), RootfsError> {
    let Some(st) = stat_if_present(dir, name, shown)? else {
        return Ok(());
    };
    if is_dir(&st) {
        // RESOLVE_NO_XDEV: a mount point fails with EXDEV instead of being emptied.
        let child = open_dir_beneath(dir, Path::new(name)).map_err(io_err(
            "open directory (not crossing mounts) to remove it",
            shown,
        ))?;
        for entry in list_dir(child.as_fd(), shown)? {
            remove_tree(child.as_fd(), &entry, &shown.join(&entry))?;
        }
        unlinkat(dir, name, UnlinkatFlags::RemoveDir).map_err(io_err("remove directory", shown))
    } else {
        unlinkat(dir, name, UnlinkatFlags::NoRemoveDir).map_err(io_err("remove", shown))
    }
}

fn set_xattrs(
    file: &File,
    xattrs: &[(OsString, Vec<u8>)],
    shown: &Path,
) -> Result<(), RootfsError> {
    for (name, value) in xattrs {
        match file.set_xattr(name, value) {
            Ok(()) => {}
            Err(err) if err.raw_os_error() == Some(Errno::EOPNOTSUPP as i32) => {
                tracing::warn!(
                    path = %shown.display(),
                    name = %name.to_string_lossy(),
                    "rootfs diff: the target filesystem does not support this extended attribute"
                );
            }
            Err(source) => {
                return Err(RootfsError::Xattr {
                    op: "write",
                    name: name.to_string_lossy().into_owned(),
                    path: shown.to_path_buf(),
                    source,
                });
            }
        }
    }
    Ok(())
}
