//! Root filesystem diffs: the container's file changes, which CRIU does not carry.
//!
//! This module owns the *rootfs diff* of an artifact: at checkpoint, [`capture_diff`] turns the
//! source container's overlay upper directory into a layer tarball; at restore, [`read_plan`]
//! validates that tarball without touching anything and [`apply_diff`] applies it into the
//! placeholder container's root filesystem (a host path to its merged overlay mount) before the
//! CRIU restore runs.
//!
//! # Format
//!
//! The tarball is an OCI image layer changeset (the format Docker, containerd and runc use for
//! image layers), written with GNU headers plus PAX records:
//!
//! - Paths are relative (`a/b/c`, no leading `/` or `./`), parents before children, names sorted
//!   within a directory. The upper directory's root itself is not an entry.
//! - Directories, regular files, symbolic links, hard links (a `Link` entry naming an earlier
//!   regular file of the same layer) and FIFOs carry their permission bits (including
//!   setuid/setgid/sticky), numeric uid/gid and mtime. The mtime is also written as a PAX `mtime`
//!   record with nanoseconds when the header's whole seconds would lose precision, symbolic link
//!   targets longer than the header field go into a PAX `linkpath` record byte for byte, and
//!   extended attributes of directories and regular files (except overlayfs's own
//!   `trusted.overlay.*` / `user.overlay.*`, and the SELinux label `security.selinux`, which must
//!   come from the placeholder's own labelling) are `SCHILY.xattr.<name>` PAX records. Applying
//!   sets atime = mtime.
//! - An overlayfs whiteout (a character device 0:0 in the upper directory, or an empty file
//!   carrying the `overlay.whiteout` xattr) of `dir/name` becomes an empty regular file
//!   `dir/.wh.name`: "remove `name` from the layers below".
//! - An opaque directory (xattr `trusted.overlay.opaque=y` or `user.overlay.opaque=y`: the
//!   directory was removed and recreated, so nothing from below shows through) becomes the
//!   directory entry followed by an empty regular file `dir/.wh..wh..opq`.
//! - Within a directory the opaque marker and the (kernel, character device) whiteouts come
//!   before the other entries; applying does not depend on that order.
//! - Sockets and device nodes other than whiteouts are left out (a socket is meaningless without
//!   its process, which CRIU restores with its own state; a container has no business creating
//!   device nodes in its root filesystem); they are counted in [`DiffStats::skipped`].
//!
//! Capture refuses upper directories the format cannot express faithfully: a name starting with
//! `.wh.`, a directory carrying overlayfs's `redirect` xattr (a renamed lower directory, only with
//! `redirect_dir=on`), a file carrying `metacopy` (its data lives in the lower layer).
//!
//! # Safety of applying
//!
//! The target root belongs to another container, which may have planted symbolic links anywhere
//! (`/etc -> /`). Every path in the target is resolved from a descriptor of the root with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)`, so resolution never
//! follows a symbolic link, never leaves the root and never enters another mount; every
//! operation on the final name is an `*at` call relative to the resolved parent that does not
//! follow it (`unlinkat`, `mkdirat`, `symlinkat`, `linkat` without `AT_SYMLINK_FOLLOW`,
//! `O_CREAT | O_EXCL | O_NOFOLLOW` opens, `AT_SYMLINK_NOFOLLOW`). What an entry replaces is
//! removed first (recursively for a directory), so a planted symbolic link at an entry's own path
//! is replaced by the entry, never written through. A whiteout below a path that is not a
//! directory in the target removes nothing. A parent directory that the layer does not carry
//! itself but that is a symbolic link in the target makes [`apply_diff`] fail.

#![deny(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2, readlinkat};
use nix::sys::stat::{
    FileStat, Mode, SFlag, UtimensatFlags, fchmod, fstatat, futimens, mkdirat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{
    Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, mkfifoat, symlinkat, unlinkat,
};
use tar::{Archive, Builder, EntryType, Header};
use thiserror::Error;
use xattr::FileExt;

/// Prefix of a whiteout entry's name.
pub const WHITEOUT_PREFIX: &str = ".wh.";
/// Name of the opaque-directory marker entry.
pub const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// Prefixes of overlayfs's own extended attributes (never carried by a layer).
const OVERLAY_XATTR_PREFIXES: [&str; 2] = ["trusted.overlay.", "user.overlay."];
/// The SELinux label attribute (never carried; see [`is_carried_xattr`]).
const SELINUX_XATTR: &str = "security.selinux";
/// PAX record prefix of an extended attribute.
const PAX_XATTR_PREFIX: &str = "SCHILY.xattr.";
/// How often `openat2` is retried when the kernel reports a concurrent rename (`EAGAIN`).
const OPENAT2_RETRIES: usize = 16;

/// Why capturing, reading or applying a rootfs diff failed.
#[derive(Debug, Error)]
pub enum RootfsError {
    /// A file operation failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path (in the upper directory, the tarball or the target root).
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An extended attribute could not be read or written.
    #[error("{op} extended attribute {name} of {path}")]
    Xattr {
        /// `list`, `read` or `write`.
        op: &'static str,
        /// The attribute's name (`*` when listing).
        name: String,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The upper directory holds something the layer format cannot express faithfully.
    #[error("cannot capture {path}: {what}")]
    Unsupported {
        /// The offending path in the upper directory.
        path: PathBuf,
        /// What it is.
        what: String,
    },
    /// The tarball is not a readable tar archive (corrupt header, truncated data, no end marker).
    #[error("layer {tar} is corrupt or truncated (at entry #{index})")]
    Corrupt {
        /// The tarball.
        tar: PathBuf,
        /// The index of the entry being read (0-based).
        index: usize,
        /// What the tar reader reported.
        #[source]
        source: io::Error,
    },
    /// An entry of the tarball is unsafe or not allowed in a rootfs diff.
    #[error("layer {tar}: entry #{index} {entry:?} is refused: {reason}")]
    UnsafeEntry {
        /// The tarball.
        tar: PathBuf,
        /// The index of the entry (0-based).
        index: usize,
        /// The entry's path as written in the tarball (lossy).
        entry: String,
        /// Why it is refused.
        reason: String,
    },
    /// The target root holds something that applying would have to go through.
    #[error("refusing to apply into {root}: {path}: {reason}")]
    UnsafeTarget {
        /// The target root.
        root: PathBuf,
        /// The path (relative to the root) being resolved.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The tarball's content differs between validation and application.
    #[error("layer {tar} changed while it was being applied (entry #{index})")]
    Changed {
        /// The tarball.
        tar: PathBuf,
        /// The index of the first differing entry.
        index: usize,
    },
}

fn io_err<'a, E: Into<io::Error>>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(E) -> RootfsError + 'a {
    move |source| RootfsError::Io {
        op,
        path: path.to_path_buf(),
        source: source.into(),
    }
}

/// What a rootfs diff holds (counts of entries of each kind).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiffStats {
    /// Regular files (with their data; hard links are counted in `hardlinks`).
    pub files: u64,
    /// Directories.
    pub dirs: u64,
    /// Symbolic links.
    pub symlinks: u64,
    /// Hard links to an earlier file of the layer.
    pub hardlinks: u64,
    /// FIFOs.
    pub fifos: u64,
    /// Whiteouts (paths removed from below).
    pub whiteouts: u64,
    /// Opaque directories (everything below hidden).
    pub opaque_dirs: u64,
    /// Bytes of regular file data.
    pub bytes: u64,
    /// Upper-directory entries left out at capture (sockets, device nodes).
    pub skipped: u64,
}

/// A modification time, with nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MTime {
    /// Seconds since the Unix epoch.
    pub secs: i64,
    /// Nanoseconds (0..1e9).
    pub nanos: u32,
}

impl MTime {
    fn timespec(self) -> TimeSpec {
        TimeSpec::new(self.secs, i64::from(self.nanos))
    }
}

/// What one entry of a rootfs diff does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    /// Create the directory (or keep an existing one) and set its metadata.
    Dir,
    /// Replace the path with a regular file of `size` bytes.
    File {
        /// Data size in bytes.
        size: u64,
    },
    /// Replace the path with a symbolic link (created, never followed).
    Symlink {
        /// The link's target, byte for byte.
        target: PathBuf,
    },
    /// Replace the path with a hard link to an earlier file of this layer.
    Hardlink {
        /// The earlier entry's path (relative).
        target: PathBuf,
    },
    /// Replace the path with a FIFO.
    Fifo,
    /// Remove the path (recursively) from the target (`.wh.<name>`).
    Whiteout,
    /// Remove every existing child of the directory at the path (`.wh..wh..opq`).
    Opaque,
}

/// One validated entry of a rootfs diff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanEntry {
    /// The index of the entry in the tarball (0-based, extension headers not counted).
    pub index: usize,
    /// The normalised relative path the entry acts on (for a whiteout: the path it removes; for
    /// an opaque marker: its directory).
    pub path: PathBuf,
    /// What it does.
    pub kind: EntryKind,
    /// Permission bits (`0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time.
    pub mtime: MTime,
    /// Extended attributes to set (name, value).
    pub xattrs: Vec<(OsString, Vec<u8>)>,
}

/// A whole rootfs diff, validated: what [`apply_diff`] will do, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiffPlan {
    /// The entries in tarball order.
    pub entries: Vec<PlanEntry>,
    /// Counts by kind.
    pub stats: DiffStats,
}

// ---------------------------------------------------------------------------------------------
// Path resolution

/// `openat2` below `dir`: no symbolic link (anywhere, including the last component), no `..`
/// escape, no mount crossing. An empty `rel` opens `dir` itself.
fn open_beneath(dir: BorrowedFd<'_>, rel: &Path, flags: OFlag, mode: Mode) -> nix::Result<OwnedFd> {
    let rel: &Path = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .mode(mode)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS
                | ResolveFlag::RESOLVE_NO_XDEV,
        );
    let mut tries = 0;
    loop {
        match openat2(dir, rel, how) {
            Err(Errno::EAGAIN) if tries < OPENAT2_RETRIES => tries += 1,
            other => return other,
        }
    }
}

fn open_dir_beneath(dir: BorrowedFd<'_>, rel: &Path) -> nix::Result<OwnedFd> {
    open_beneath(
        dir,
        rel,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        Mode::empty(),
    )
}

fn file_type(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

fn is_dir(st: &FileStat) -> bool {
    file_type(st) == SFlag::S_IFDIR
}

/// The names in a directory (without `.` and `..`), sorted.
fn list_dir(dir: BorrowedFd<'_>, shown: &Path) -> Result<Vec<OsString>, RootfsError> {
    let fd = open_dir_beneath(dir, Path::new("")).map_err(io_err("open directory", shown))?;
    let mut handle = Dir::from_fd(fd).map_err(io_err("read directory", shown))?;
    let mut names = Vec::new();
    for entry in handle.iter() {
        let entry = entry.map_err(io_err("read directory", shown))?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        names.push(OsStr::from_bytes(name).to_os_string());
    }
    names.sort();
    Ok(names)
}

fn mtime_of(st: &FileStat) -> MTime {
    MTime {
        secs: st.st_mtime,
        nanos: u32::try_from(st.st_mtime_nsec).unwrap_or(0),
    }
}

fn overlay_xattr<'a>(xattrs: &'a [(OsString, Vec<u8>)], suffix: &str) -> Option<&'a [u8]> {
    OVERLAY_XATTR_PREFIXES.iter().find_map(|prefix| {
        let wanted = format!("{prefix}{suffix}");
        xattrs
            .iter()
            .find(|(name, _)| name.as_bytes() == wanted.as_bytes())
            .map(|(_, value)| value.as_slice())
    })
}

fn is_overlay_xattr(name: &OsStr) -> bool {
    OVERLAY_XATTR_PREFIXES
        .iter()
        .any(|prefix| name.as_bytes().starts_with(prefix.as_bytes()))
}

/// Whether an extended attribute travels in the layer: not overlayfs's own, and not the SELinux
/// label (the source container's MCS categories would lock the placeholder out of its files; the
/// target's own labelling applies).
fn is_carried_xattr(name: &OsStr) -> bool {
    !is_overlay_xattr(name) && name.as_bytes() != SELINUX_XATTR.as_bytes()
}

/// Every extended attribute of an open file.
fn read_xattrs(file: &File, shown: &Path) -> Result<Vec<(OsString, Vec<u8>)>, RootfsError> {
    let names = match file.list_xattr() {
        Ok(names) => names,
        // A filesystem without extended attributes: nothing to carry.
        Err(err) if err.raw_os_error() == Some(Errno::EOPNOTSUPP as i32) => return Ok(Vec::new()),
        Err(source) => {
            return Err(RootfsError::Xattr {
                op: "list",
                name: "*".to_owned(),
                path: shown.to_path_buf(),
                source,
            });
        }
    };
    let mut out = Vec::new();
    for name in names {
        let value = file.get_xattr(&name).map_err(|source| RootfsError::Xattr {
            op: "read",
            name: name.to_string_lossy().into_owned(),
            path: shown.to_path_buf(),
            source,
        })?;
        if let Some(value) = value {
            out.push((name, value));
        }
    }
    out.sort();
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Capture

/// Writes the overlay upper directory `upper` as an OCI layer tarball to `out` (created or
/// truncated) and fsyncs it.
///
/// Symbolic links in `upper` are never followed: the walk uses descriptors and `openat2` with
/// `RESOLVE_NO_SYMLINKS`. On failure the partial `out` is removed.
pub fn capture_diff(upper: &Path, out: &Path) -> Result<DiffStats, RootfsError> {
    let upper_fd = nix::fcntl::open(
        upper,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err("open upper directory", upper))?;
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(out)
        .map_err(io_err("create layer", out))?;
    let mut capture = Capture {
        upper,
        out,
        builder: Builder::new(BufWriter::new(file)),
        stats: DiffStats::default(),
        links: HashMap::new(),
    };
    let walked = capture.walk(upper_fd.as_fd(), Path::new(""));
    let Capture { builder, stats, .. } = capture;
    let result = walked
        .and_then(|()| builder.into_inner().map_err(io_err("write layer", out)))
        .and_then(|writer| {
            writer
                .into_inner()
                .map_err(|err| io_err("write layer", out)(err.into_error()))
        })
        .and_then(|file| file.sync_all().map_err(io_err("fsync layer", out)));
    match result {
        Ok(()) => Ok(stats),
        Err(err) => {
            let _ = fs::remove_file(out);
            Err(err)
        }
    }
}

struct Capture<'a> {
    upper: &'a Path,
    out: &'a Path,
    builder: Builder<BufWriter<File>>,
    stats: DiffStats,
    /// (dev, ino) of multiply-linked regular files already written → their path.
    links: HashMap<(u64, u64), PathBuf>,
}

impl Capture<'_> {
    fn write_err(&self) -> impl FnOnce(io::Error) -> RootfsError + '_ {
        io_err("write layer", self.out)
    }

    fn header(entry_type: EntryType, st: &FileStat, size: u64) -> Header {
        let mut header = Header::new_gnu();
        header.set_entry_type(entry_type);
        header.set_size(size);
        header.set_mode(st.st_mode & 0o7777);
        header.set_uid(u64::from(st.st_uid));
        header.set_gid(u64::from(st.st_gid));
        header.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
        header
    }

    /// PAX records for an entry: exact mtime and extended attributes.
    fn pax(
        &mut self,
        st: &FileStat,
        xattrs: &[(OsString, Vec<u8>)],
        extra: Option<(&str, &[u8])>,
    ) -> Result<(), RootfsError> {
        let mtime = mtime_of(st);
        let mtime_text = format_mtime(mtime);
        let mut records: Vec<(String, &[u8])> = Vec::new();
        if mtime.nanos != 0 || mtime.secs < 0 {
            records.push(("mtime".to_owned(), mtime_text.as_bytes()));
        }
        for (name, value) in xattrs {
            if !is_carried_xattr(name) {
                continue;
            }
            match name.to_str() {
                Some(name) => records.push((format!("{PAX_XATTR_PREFIX}{name}"), value)),
                None => tracing::warn!(
                    name = %name.to_string_lossy(),
                    "rootfs diff: extended attribute with a non-UTF-8 name left out"
                ),
            }
        }
        if let Some((key, value)) = extra {
            records.push((key.to_owned(), value));
        }
        if records.is_empty() {
            return Ok(());
        }
        let out = self.out;
        self.builder
            .append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))
            .map_err(io_err("write layer", out))
    }

    fn walk(&mut self, dir: BorrowedFd<'_>, rel: &Path) -> Result<(), RootfsError> {
        let shown_dir = self.upper.join(rel);
        let names = list_dir(dir, &shown_dir)?;
        let mut whiteouts = Vec::new();
        let mut others = Vec::new();
        for name in names {
            let path = rel.join(&name);
            let shown = self.upper.join(&path);
            if name.as_bytes().starts_with(WHITEOUT_PREFIX.as_bytes()) {
                return Err(RootfsError::Unsupported {
                    path: shown,
                    what: format!(
                        "a name starting with {WHITEOUT_PREFIX} cannot be carried by an OCI layer"
                    ),
                });
            }
            let st = fstatat(dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
                .map_err(io_err("stat", &shown))?;
            if file_type(&st) == SFlag::S_IFCHR && st.st_rdev == 0 {
                whiteouts.push((path, st));
            } else {
                others.push((name, path, st));
            }
        }
        for (path, st) in whiteouts {
            self.whiteout(&path, &st)?;
        }
        for (name, path, st) in others {
            let shown = self.upper.join(&path);
            let kind = file_type(&st);
            if kind == SFlag::S_IFDIR {
                self.dir(dir, &name, &path, &st)?;
            } else if kind == SFlag::S_IFREG {
                self.regular(dir, &name, &path, &st)?;
            } else if kind == SFlag::S_IFLNK {
                let target =
                    readlinkat(dir, name.as_os_str()).map_err(io_err("readlink", &shown))?;
                self.symlink(&path, &st, &target)?;
            } else if kind == SFlag::S_IFIFO {
                let mut header = Self::header(EntryType::Fifo, &st, 0);
                self.pax(&st, &[], None)?;
                let out = self.out;
                self.builder
                    .append_data(&mut header, &path, io::empty())
                    .map_err(io_err("write layer", out))?;
                self.stats.fifos += 1;
            } else {
                tracing::warn!(
                    path = %shown.display(),
                    "rootfs diff: socket or device node left out"
                );
                self.stats.skipped += 1;
            }
        }
        Ok(())
    }

    fn whiteout(&mut self, path: &Path, st: &FileStat) -> Result<(), RootfsError> {
        let Some(name) = path.file_name() else {
            return Ok(());
        };
        let mut marker = OsString::from(WHITEOUT_PREFIX);
        marker.push(name);
        let entry = path.with_file_name(marker);
        let mut header = Self::header(EntryType::Regular, st, 0);
        header.set_mode(0);
        let out = self.out;
        self.builder
            .append_data(&mut header, &entry, io::empty())
            .map_err(io_err("write layer", out))?;
        self.stats.whiteouts += 1;
        Ok(())
    }

    fn dir(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        path: &Path,
        st: &FileStat,
    ) -> Result<(), RootfsError> {
        let shown = self.upper.join(path);
        let fd =
            open_dir_beneath(parent, Path::new(name)).map_err(io_err("open directory", &shown))?;
        let file = File::from(fd);
        same_inode(&file, st, &shown)?;
        let xattrs = read_xattrs(&file, &shown)?;
        if overlay_xattr(&xattrs, "redirect").is_some() {
            return Err(RootfsError::Unsupported {
                path: shown,
                what: "the directory is a renamed lower directory (overlay redirect_dir); mount \
                       overlays with redirect_dir=off"
                    .to_owned(),
            });
        }
        let opaque = overlay_xattr(&xattrs, "opaque") == Some(b"y".as_slice());
        let mut header = Self::header(EntryType::Directory, st, 0);
        self.pax(st, &xattrs, None)?;
        self.builder
            .append_data(&mut header, path, io::empty())
            .map_err(self.write_err())?;
        self.stats.dirs += 1;
        if opaque {
            let mut marker = Self::header(EntryType::Regular, st, 0);
            marker.set_mode(0);
            let out = self.out;
            self.builder
                .append_data(&mut marker, path.join(OPAQUE_MARKER), io::empty())
                .map_err(io_err("write layer", out))?;
            self.stats.opaque_dirs += 1;
        }
        self.walk(file.as_fd(), path)
    }

    fn regular(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        path: &Path,
        st: &FileStat,
    ) -> Result<(), RootfsError> {
        let shown = self.upper.join(path);
        let fd = open_beneath(parent, Path::new(name), OFlag::O_RDONLY, Mode::empty())
            .map_err(io_err("open", &shown))?;
        let file = File::from(fd);
        same_inode(&file, st, &shown)?;
        let xattrs = read_xattrs(&file, &shown)?;
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if overlay_xattr(&xattrs, "whiteout").is_some() && size == 0 {
            return self.whiteout(path, st);
        }
        if overlay_xattr(&xattrs, "metacopy").is_some() {
            return Err(RootfsError::Unsupported {
                path: shown,
                what: "the file is a metadata-only copy-up (overlay metacopy); mount overlays \
                       with metacopy=off"
                    .to_owned(),
            });
        }
        if st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key).cloned() {
                let mut header = Self::header(EntryType::Link, st, 0);
                let out = self.out;
                self.builder
                    .append_link(&mut header, path, &first)
                    .map_err(io_err("write layer", out))?;
                self.stats.hardlinks += 1;
                return Ok(());
            }
            self.links.insert(key, path.to_path_buf());
        }
        let mut header = Self::header(EntryType::Regular, st, size);
        self.pax(st, &xattrs, None)?;
        let reader = ExactReader {
            inner: file,
            remaining: size,
        };
        self.builder
            .append_data(&mut header, path, reader)
            .map_err(io_err("archive into the layer", &shown))?;
        self.stats.files += 1;
        self.stats.bytes += size;
        Ok(())
    }

    fn symlink(&mut self, path: &Path, st: &FileStat, target: &OsStr) -> Result<(), RootfsError> {
        let bytes = target.as_bytes();
        let mut header = Self::header(EntryType::Symlink, st, 0);
        let slot = &mut header.as_old_mut().linkname;
        let n = bytes.len().min(slot.len());
        slot[..n].copy_from_slice(&bytes[..n]);
        let extra = (bytes.len() > slot.len()).then_some(("linkpath", bytes));
        self.pax(st, &[], extra)?;
        let out = self.out;
        self.builder
            .append_data(&mut header, path, io::empty())
            .map_err(io_err("write layer", out))?;
        self.stats.symlinks += 1;
        Ok(())
    }
}

fn same_inode(file: &File, st: &FileStat, shown: &Path) -> Result<(), RootfsError> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata().map_err(io_err("stat", shown))?;
    if meta.dev() != st.st_dev || meta.ino() != st.st_ino {
        return Err(RootfsError::Io {
            op: "capture (the upper directory changed during the walk)",
            path: shown.to_path_buf(),
            source: io::Error::other("inode changed between stat and open"),
        });
    }
    Ok(())
}

fn format_mtime(mtime: MTime) -> String {
    if mtime.nanos == 0 {
        mtime.secs.to_string()
    } else if mtime.secs >= 0 {
        format!("{}.{:09}", mtime.secs, mtime.nanos)
    } else {
        // PAX times are a decimal number: -1.25 is 1.25 s before the epoch, i.e. secs = -2,
        // nanos = 0.75e9.
        let whole = -(mtime.secs + 1);
        format!("-{}.{:09}", whole, 1_000_000_000 - mtime.nanos)
    }
}

fn parse_mtime(text: &str) -> Option<MTime> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs: i64 = whole.parse().ok()?;
    let mut digits: String = frac.chars().take(9).collect();
    while digits.len() < 9 {
        digits.push('0');
    }
    let nanos: u32 = digits.parse().ok()?;
    if !negative {
        return Some(MTime { secs, nanos });
    }
    if nanos == 0 {
        Some(MTime {
            secs: -secs,
            nanos: 0,
        })
    } else {
        Some(MTime {
            secs: -secs - 1,
            nanos: 1_000_000_000 - nanos,
        })
    }
}

/// A reader that yields exactly `remaining` bytes of `inner`, failing if it ends early (a file
/// that shrank while being archived would otherwise corrupt the archive).
struct ExactReader {
    inner: File,
    remaining: u64,
}

impl Read for ExactReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 {
            return Ok(0);
        }
        let want = usize::try_from(self.remaining)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while being archived",
            ));
        }
        self.remaining -= n as u64;
        Ok(n)
    }
}

// ---------------------------------------------------------------------------------------------
// Reading and validating

/// A reader that remembers whether it ever reached end of file (a tar archive that ends without
/// its end-of-archive marker was truncated).
struct EofWatch<R> {
    inner: R,
    hit_eof: bool,
}

impl<R: Read> Read for EofWatch<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.hit_eof = true;
        }
        Ok(n)
    }
}

/// Calls `each` with every entry of the tarball, parsed (`None` for an ignored root directory
/// entry), then checks that the archive ended with its end-of-archive marker.
fn for_each_entry(
    tar: &Path,
    mut each: impl FnMut(
        usize,
        Option<PlanEntry>,
        &mut tar::Entry<'_, EofWatch<BufReader<File>>>,
    ) -> Result<(), RootfsError>,
) -> Result<(), RootfsError> {
    let file = File::open(tar).map_err(io_err("open layer", tar))?;
    let mut archive = Archive::new(EofWatch {
        inner: BufReader::new(file),
        hit_eof: false,
    });
    let corrupt = |index: usize| {
        move |source: io::Error| RootfsError::Corrupt {
            tar: tar.to_path_buf(),
            index,
            source,
        }
    };
    let mut count = 0;
    {
        let entries = archive.entries().map_err(corrupt(0))?;
        for (index, entry) in entries.enumerate() {
            count = index + 1;
            let mut entry = entry.map_err(corrupt(index))?;
            let parsed = parse_entry(tar, index, &mut entry)?;
            each(index, parsed, &mut entry)?;
            // Read whatever `each` left, so truncated data is noticed here.
            io::copy(&mut entry, &mut io::sink()).map_err(corrupt(index))?;
        }
    }
    if archive.into_inner().hit_eof {
        return Err(RootfsError::Corrupt {
            tar: tar.to_path_buf(),
            index: count,
            source: io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the archive ends without its end-of-archive marker",
            ),
        });
    }
    Ok(())
}

/// Normalises an archive path: relative, no `..`, no NUL; `.` and empty components dropped.
fn normalize(bytes: &[u8]) -> Result<PathBuf, String> {
    if bytes.contains(&0) {
        return Err("the path contains a NUL byte".to_owned());
    }
    if bytes.first() == Some(&b'/') {
        return Err("absolute path".to_owned());
    }
    let mut out = PathBuf::new();
    for component in bytes.split(|b| *b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return Err("the path contains `..`".to_owned()),
            name => out.push(OsStr::from_bytes(name)),
        }
    }
    Ok(out)
}

fn parse_entry<R: Read>(
    tar: &Path,
    index: usize,
    entry: &mut tar::Entry<'_, R>,
) -> Result<Option<PlanEntry>, RootfsError> {
    if entry.header().entry_type() == EntryType::XGlobalHeader {
        // A PAX global header (`git archive` writes one): nothing to apply.
        return Ok(None);
    }
    let raw_path = entry.path_bytes().into_owned();
    let shown = String::from_utf8_lossy(&raw_path).into_owned();
    let refuse = |reason: String| RootfsError::UnsafeEntry {
        tar: tar.to_path_buf(),
        index,
        entry: shown.clone(),
        reason,
    };
    let corrupt = |source: io::Error| RootfsError::Corrupt {
        tar: tar.to_path_buf(),
        index,
        source,
    };
    let path = normalize(&raw_path).map_err(&refuse)?;
    let header = entry.header();
    let entry_type = header.entry_type();
    let mode = header.mode().map_err(corrupt)? & 0o7777;
    let uid = u32::try_from(header.uid().map_err(corrupt)?)
        .map_err(|_| refuse("uid out of range".to_owned()))?;
    let gid = u32::try_from(header.gid().map_err(corrupt)?)
        .map_err(|_| refuse("gid out of range".to_owned()))?;
    let header_mtime = header.mtime().map_err(corrupt)?;
    let mut mtime = MTime {
        secs: i64::try_from(header_mtime).map_err(|_| refuse("mtime out of range".to_owned()))?,
        nanos: 0,
    };
    let link = entry.link_name_bytes().map(|b| b.into_owned());
    let mut xattrs = Vec::new();
    if let Some(pax) = entry.pax_extensions().map_err(corrupt)? {
        for record in pax {
            let record = record.map_err(corrupt)?;
            let key = record
                .key()
                .map_err(|_| refuse("a PAX record key is not UTF-8".to_owned()))?;
            if key == "mtime" {
                let value = record
                    .value()
                    .ok()
                    .and_then(parse_mtime)
                    .ok_or_else(|| refuse("malformed PAX mtime".to_owned()))?;
                mtime = value;
            } else if let Some(name) = key.strip_prefix(PAX_XATTR_PREFIX) {
                let name = OsString::from(name);
                if name.is_empty() || name.as_bytes().contains(&0) {
                    return Err(refuse("malformed extended attribute name".to_owned()));
                }
                if is_overlay_xattr(&name) {
                    return Err(refuse(format!(
                        "carries overlayfs's private extended attribute {}",
                        name.to_string_lossy()
                    )));
                }
                if is_carried_xattr(&name) {
                    xattrs.push((name, record.value_bytes().to_vec()));
                }
            }
        }
    }
    let name = path.file_name().map(OsStr::as_bytes).unwrap_or_default();
    let is_marker = name.starts_with(WHITEOUT_PREFIX.as_bytes());
    let (path, kind) = match entry_type {
        EntryType::Regular | EntryType::Continuous if is_marker => {
            let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
            if name == OPAQUE_MARKER.as_bytes() {
                if parent.as_os_str().is_empty() {
                    return Err(refuse("opaque marker on the root directory".to_owned()));
                }
                (parent, EntryKind::Opaque)
            } else {
                let hidden = &name[WHITEOUT_PREFIX.len()..];
                if hidden.starts_with(WHITEOUT_PREFIX.as_bytes()) {
                    return Err(refuse("unsupported whiteout meta-entry".to_owned()));
                }
                if hidden.is_empty() || hidden == b"." || hidden == b".." {
                    return Err(refuse("whiteout of an invalid name".to_owned()));
                }
                (parent.join(OsStr::from_bytes(hidden)), EntryKind::Whiteout)
            }
        }
        _ if is_marker => {
            return Err(refuse(
                "a whiteout name on an entry that is not a regular file".to_owned(),
            ));
        }
        EntryType::Regular | EntryType::Continuous => {
            (path, EntryKind::File { size: entry.size() })
        }
        EntryType::Directory => {
            if path.as_os_str().is_empty() {
                return Ok(None);
            }
            (path, EntryKind::Dir)
        }
        EntryType::Symlink => {
            let target = link.ok_or_else(|| refuse("symbolic link without a target".to_owned()))?;
            if target.is_empty() || target.contains(&0) {
                return Err(refuse("invalid symbolic link target".to_owned()));
            }
            (
                path,
                EntryKind::Symlink {
                    target: PathBuf::from(OsString::from_vec(target)),
                },
            )
        }
        EntryType::Link => {
            let target = link.ok_or_else(|| refuse("hard link without a target".to_owned()))?;
            let target = normalize(&target)
                .map_err(|reason| refuse(format!("hard link target: {reason}")))?;
            (path, EntryKind::Hardlink { target })
        }
        EntryType::Fifo => (path, EntryKind::Fifo),
        EntryType::Char | EntryType::Block => {
            return Err(refuse("device node".to_owned()));
        }
        EntryType::GNUSparse => return Err(refuse("sparse entries are not supported".to_owned())),
        other => return Err(refuse(format!("unsupported entry type {other:?}"))),
    };
    if path.as_os_str().is_empty() {
        return Err(refuse("the entry names the root itself".to_owned()));
    }
    Ok(Some(PlanEntry {
        index,
        path,
        kind,
        mode,
        uid,
        gid,
        mtime,
        xattrs,
    }))
}

/// Cross-entry checks: duplicates, parents, hard link targets.
#[derive(Default)]
struct Validator {
    /// Paths added by the layer → whether they are directories.
    added: HashMap<PathBuf, bool>,
    /// Paths the layer adds as regular files (hard link targets).
    files: HashSet<PathBuf>,
    /// Every proper ancestor of every added path.
    implied_dirs: HashSet<PathBuf>,
}

impl Validator {
    fn check(&mut self, entry: &PlanEntry) -> Result<(), String> {
        let is_dir = match &entry.kind {
            EntryKind::Whiteout | EntryKind::Opaque => return Ok(()),
            EntryKind::Dir => true,
            EntryKind::Hardlink { target } => {
                if !self.files.contains(target) {
                    return Err(format!(
                        "hard link to {}, which is not an earlier regular file of this layer",
                        target.display()
                    ));
                }
                false
            }
            EntryKind::File { .. } | EntryKind::Symlink { .. } | EntryKind::Fifo => false,
        };
        if self.added.contains_key(&entry.path) {
            return Err("the path appears twice in the layer".to_owned());
        }
        if !is_dir && self.implied_dirs.contains(&entry.path) {
            return Err("the layer has entries below this non-directory".to_owned());
        }
        for ancestor in entry.path.ancestors().skip(1) {
            if ancestor.as_os_str().is_empty() {
                break;
            }
            if self.added.get(ancestor) == Some(&false) {
                return Err(format!(
                    "its parent {} is not a directory in this layer",
                    ancestor.display()
                ));
            }
            self.implied_dirs.insert(ancestor.to_path_buf());
        }
        self.added.insert(entry.path.clone(), is_dir);
        if matches!(
            entry.kind,
            EntryKind::File { .. } | EntryKind::Hardlink { .. }
        ) {
            self.files.insert(entry.path.clone());
        }
        Ok(())
    }
}

/// Parses and validates the whole tarball without touching any target: every path relative and
/// free of `..` and NUL, no device nodes, hard links only to earlier regular files of the layer,
/// no duplicate paths, no entry below a non-directory of the layer, a readable archive with its
/// end marker. A restore calls this first so it can refuse before changing anything.
///
/// A directory entry for the root itself (`./`) and PAX global headers are ignored;
/// `security.selinux` attributes are dropped.
pub fn read_plan(tar: &Path) -> Result<DiffPlan, RootfsError> {
    let mut plan = DiffPlan::default();
    let mut validator = Validator::default();
    for_each_entry(tar, |index, parsed, _entry| {
        let Some(entry) = parsed else {
            return Ok(());
        };
        validator
            .check(&entry)
            .map_err(|reason| RootfsError::UnsafeEntry {
                tar: tar.to_path_buf(),
                index,
                entry: entry.path.to_string_lossy().into_owned(),
                reason,
            })?;
        let stats = &mut plan.stats;
        match &entry.kind {
            EntryKind::Dir => stats.dirs += 1,
            EntryKind::File { size } => {
                stats.files += 1;
                stats.bytes += size;
            }
            EntryKind::Symlink { .. } => stats.symlinks += 1,
            EntryKind::Hardlink { .. } => stats.hardlinks += 1,
            EntryKind::Fifo => stats.fifos += 1,
            EntryKind::Whiteout => stats.whiteouts += 1,
            EntryKind::Opaque => stats.opaque_dirs += 1,
        }
        plan.entries.push(entry);
        Ok(())
    })?;
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// Applying

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
        let shown = self.root.join(&entry.path);
        let (_, name) = split(&entry.path);
        let owner = (
            Some(Uid::from_raw(entry.uid)),
            Some(Gid::from_raw(entry.gid)),
        );
        let mode = Mode::from_bits_truncate(entry.mode);
        let time = entry.mtime.timespec();
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
                let copied = io::copy(&mut data.take(*size), &mut file).map_err(|source| {
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
                if copied != *size {
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
}

/// Splits a relative path into its parent (possibly empty) and last component.
fn split(path: &Path) -> (&Path, &OsStr) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::fs::FileTimes;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, chown, symlink};
    use std::os::unix::net::UnixListener;
    use std::time::{Duration, UNIX_EPOCH};

    use nix::mount::{MntFlags, MsFlags, mount, umount2};
    use tempfile::TempDir;

    // ---- helpers ------------------------------------------------------------------------------

    /// Whether overlay tests can run. CI sets `WARMSTART_REQUIRE_ROOT=1`, so there a missing
    /// privilege fails the test instead of skipping it.
    fn is_root() -> bool {
        if Uid::effective().is_root() {
            return true;
        }
        assert!(
            std::env::var_os("WARMSTART_REQUIRE_ROOT").is_none(),
            "WARMSTART_REQUIRE_ROOT is set but this test does not run as root"
        );
        eprintln!("skipped: mounting overlays needs root");
        false
    }

    /// Unmounts on drop, also when the test panics.
    struct MountGuard(PathBuf);

    impl Drop for MountGuard {
        fn drop(&mut self) {
            let _ = umount2(&self.0, MntFlags::MNT_DETACH);
        }
    }

    struct Overlay {
        upper: PathBuf,
        merged: PathBuf,
        _guard: MountGuard,
    }

    fn mount_overlay(base: &Path, name: &str, lower: &Path) -> Overlay {
        let dir = base.join(name);
        let upper = dir.join("upper");
        let work = dir.join("work");
        let merged = dir.join("merged");
        for d in [&upper, &work, &merged] {
            fs::create_dir_all(d).expect("create overlay dirs");
        }
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        mount(
            Some("overlay"),
            &merged,
            Some("overlay"),
            MsFlags::empty(),
            Some(options.as_str()),
        )
        .expect("mount overlay");
        Overlay {
            upper,
            merged: merged.clone(),
            _guard: MountGuard(merged),
        }
    }

    fn write(path: &Path, data: &str) {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create parent");
        }
        fs::write(path, data).expect("write file");
    }

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[derive(Debug, PartialEq, Eq)]
    struct Node {
        kind: &'static str,
        mode: u32,
        uid: u32,
        gid: u32,
        mtime: (i64, i64),
        content: Option<Vec<u8>>,
        target: Option<PathBuf>,
        xattrs: Vec<(OsString, Vec<u8>)>,
    }

    /// Every path below `root` with its type, content, mode, owner, mtime, link target and
    /// `user.*` xattrs (the root's own mtime is left out: applying changes it).
    fn snapshot(root: &Path) -> BTreeMap<PathBuf, Node> {
        let mut out = BTreeMap::new();
        snapshot_into(root, Path::new(""), &mut out);
        out
    }

    fn snapshot_into(root: &Path, rel: &Path, out: &mut BTreeMap<PathBuf, Node>) {
        let full = root.join(rel);
        let meta = fs::symlink_metadata(&full).expect("lstat");
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_file() {
            "file"
        } else if ft.is_fifo() {
            "fifo"
        } else if ft.is_socket() {
            "socket"
        } else {
            "other"
        };
        let mut xattrs = Vec::new();
        if !ft.is_symlink() {
            for name in xattr::list(&full).expect("list xattrs") {
                if name.as_bytes().starts_with(b"user.") {
                    let value = xattr::get(&full, &name)
                        .expect("get xattr")
                        .unwrap_or_default();
                    xattrs.push((name, value));
                }
            }
            xattrs.sort();
        }
        let node = Node {
            kind,
            mode: meta.mode() & 0o7777,
            uid: meta.uid(),
            gid: meta.gid(),
            mtime: if rel.as_os_str().is_empty() {
                (0, 0)
            } else {
                (meta.mtime(), meta.mtime_nsec())
            },
            content: ft.is_file().then(|| fs::read(&full).expect("read")),
            target: ft
                .is_symlink()
                .then(|| fs::read_link(&full).expect("readlink")),
            xattrs,
        };
        out.insert(rel.to_path_buf(), node);
        if ft.is_dir() {
            let mut names: Vec<OsString> = fs::read_dir(&full)
                .expect("read_dir")
                .map(|e| e.expect("dir entry").file_name())
                .collect();
            names.sort();
            for name in names {
                snapshot_into(root, &rel.join(name), out);
            }
        }
    }

    struct Raw<'a> {
        kind: EntryType,
        name: &'a [u8],
        link: Option<&'a [u8]>,
        data: &'a [u8],
    }

    fn raw(kind: EntryType, name: &'static str) -> Raw<'static> {
        Raw {
            kind,
            name: name.as_bytes(),
            link: None,
            data: b"",
        }
    }

    /// Writes a tar whose names are copied byte for byte (no validation by the tar crate).
    fn raw_tar(path: &Path, entries: &[Raw<'_>]) {
        let mut builder = Builder::new(Vec::new());
        for e in entries {
            let mut header = Header::new_gnu();
            header.set_entry_type(e.kind);
            header.set_size(e.data.len() as u64);
            header.set_mode(if e.kind == EntryType::Directory {
                0o755
            } else {
                0o644
            });
            header.set_uid(u64::from(Uid::effective().as_raw()));
            header.set_gid(u64::from(Gid::effective().as_raw()));
            header.set_mtime(1_700_000_000);
            header.as_old_mut().name[..e.name.len()].copy_from_slice(e.name);
            if let Some(link) = e.link {
                header.as_old_mut().linkname[..link.len()].copy_from_slice(link);
            }
            header.set_cksum();
            builder.append(&header, e.data).expect("append");
        }
        fs::write(path, builder.into_inner().expect("finish")).expect("write tar");
    }

    fn names_tar(err: &RootfsError, tar: &Path) {
        let text = err.to_string();
        assert!(
            text.contains(&tar.display().to_string()),
            "error {text:?} does not name {}",
            tar.display()
        );
    }

    // ---- round trip through real overlays -----------------------------------------------------

    #[test]
    fn round_trip_through_real_overlays() {
        if !is_root() {
            return;
        }
        let base = TempDir::new().expect("tempdir");
        let lower = base.path().join("lower");
        write(&lower.join("a/keep"), "keep");
        write(&lower.join("a/delete-me"), "bye");
        write(&lower.join("b/dir/x"), "x");
        write(&lower.join("c/file"), "lower c\n");
        write(&lower.join("opaque-dir/old"), "old");
        write(&lower.join("opaque-dir/sub/older"), "older");

        let src = mount_overlay(base.path(), "src", &lower);
        let m = &src.merged;
        // New files and directories, with an xattr, a nanosecond mtime and a hard link.
        fs::create_dir_all(m.join("new-dir/empty-dir")).expect("mkdir");
        write(&m.join("new-dir/new-file"), "new");
        xattr::set(m.join("new-dir/new-file"), "user.test", b"value").expect("setxattr");
        File::options()
            .write(true)
            .open(m.join("new-dir/new-file"))
            .expect("open")
            .set_times(
                FileTimes::new()
                    .set_modified(UNIX_EPOCH + Duration::new(1_600_000_000, 123_456_789)),
            )
            .expect("set times");
        fs::hard_link(m.join("new-dir/new-file"), m.join("new-dir/hard")).expect("link");
        // Modify a lower file, change a lower directory's mode.
        fs::write(m.join("c/file"), "lower c\nappended\n").expect("append");
        chmod(&m.join("a"), 0o700);
        // Delete a lower file and a lower directory (whiteouts).
        fs::remove_file(m.join("a/delete-me")).expect("rm");
        fs::remove_dir_all(m.join("b/dir")).expect("rm -rf");
        // rm -rf a lower directory and recreate it (opaque directory).
        fs::remove_dir_all(m.join("opaque-dir")).expect("rm -rf");
        fs::create_dir(m.join("opaque-dir")).expect("mkdir");
        write(&m.join("opaque-dir/new"), "fresh");
        // Symbolic links (absolute, relative, dangling, long target): never followed.
        fs::create_dir(m.join("links")).expect("mkdir");
        symlink("/etc/passwd", m.join("links/abs")).expect("symlink");
        symlink("../c/file", m.join("links/rel")).expect("symlink");
        symlink("nowhere/at/all", m.join("links/dangling")).expect("symlink");
        let long_target = format!("{}/{}", "t".repeat(120), "u".repeat(80));
        symlink(&long_target, m.join("links/long")).expect("symlink");
        // Ownership and special modes.
        write(&m.join("secret"), "s3cr3t");
        chown(m.join("secret"), Some(1234), Some(5678)).expect("chown");
        chmod(&m.join("secret"), 0o600);
        write(&m.join("suid"), "#!/bin/true\n");
        chown(m.join("suid"), Some(1000), Some(1000)).expect("chown");
        chmod(&m.join("suid"), 0o4755);
        // /dev/shm-like nested directories, a FIFO, a socket, a long path.
        write(&m.join("dev/shm/nested/deep/file"), "shm");
        fs::create_dir(m.join("run")).expect("mkdir");
        nix::unistd::mkfifo(&m.join("run/fifo"), Mode::from_bits_truncate(0o600)).expect("mkfifo");
        chmod(&m.join("run/fifo"), 0o640);
        let listener = UnixListener::bind(m.join("run/sock")).expect("bind");
        drop(listener);
        let long_path = PathBuf::from("long")
            .join("x".repeat(120))
            .join("y".repeat(150));
        write(&m.join(&long_path), "long");

        // The kernel really produced a whiteout and an opaque directory.
        let wh = fs::symlink_metadata(src.upper.join("a/delete-me")).expect("whiteout");
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
        assert_eq!(
            xattr::get(src.upper.join("opaque-dir"), "trusted.overlay.opaque").expect("xattr"),
            Some(b"y".to_vec())
        );

        let layer = base.path().join("layer.tar");
        let captured = capture_diff(&src.upper, &layer).expect("capture");
        assert_eq!(captured.whiteouts, 2, "{captured:?}");
        assert_eq!(captured.opaque_dirs, 1, "{captured:?}");
        assert_eq!(captured.hardlinks, 1, "{captured:?}");
        assert_eq!(captured.symlinks, 4, "{captured:?}");
        assert_eq!(captured.fifos, 1, "{captured:?}");
        assert_eq!(captured.skipped, 1, "{captured:?}");

        let plan = read_plan(&layer).expect("plan");
        assert_eq!(
            plan.stats,
            DiffStats {
                skipped: 0,
                ..captured
            }
        );
        let opaque = plan
            .entries
            .iter()
            .position(|e| e.kind == EntryKind::Opaque)
            .expect("opaque marker");
        assert_eq!(plan.entries[opaque].path, Path::new("opaque-dir"));
        assert_eq!(plan.entries[opaque - 1].path, Path::new("opaque-dir"));
        assert!(
            plan.entries
                .iter()
                .any(|e| e.kind == EntryKind::Whiteout && e.path == Path::new("a/delete-me"))
        );

        let placeholder = mount_overlay(base.path(), "placeholder", &lower);
        let applied = apply_diff(&layer, &placeholder.merged).expect("apply");
        assert_eq!(applied, plan.stats);

        let mut expected = snapshot(&src.merged);
        assert_eq!(
            expected.remove(Path::new("run/sock")).map(|n| n.kind),
            Some("socket")
        );
        let got = snapshot(&placeholder.merged);
        let expected_keys: Vec<_> = expected.keys().collect();
        let got_keys: Vec<_> = got.keys().collect();
        assert_eq!(expected_keys, got_keys);
        for (path, node) in &expected {
            assert_eq!(Some(node), got.get(path), "{}", path.display());
        }

        let p = &placeholder.merged;
        for gone in ["a/delete-me", "b/dir", "opaque-dir/old", "opaque-dir/sub"] {
            assert!(
                fs::symlink_metadata(p.join(gone)).is_err(),
                "{gone} still exists"
            );
        }
        assert_eq!(fs::read(p.join("a/keep")).expect("read"), b"keep");
        let first = fs::metadata(p.join("new-dir/new-file")).expect("stat");
        let second = fs::metadata(p.join("new-dir/hard")).expect("stat");
        assert_eq!(first.ino(), second.ino(), "hard link lost");
        assert_eq!(first.mtime_nsec(), 123_456_789);
    }

    #[test]
    fn planted_symlinks_in_the_target_are_replaced_never_followed() {
        if !is_root() {
            return;
        }
        let base = TempDir::new().expect("tempdir");
        let lower = base.path().join("lower");
        write(&lower.join("a/keep"), "keep");
        write(&lower.join("a/delete-me"), "bye");
        write(&lower.join("c/file"), "lower c");

        let src = mount_overlay(base.path(), "src", &lower);
        fs::remove_file(src.merged.join("a/delete-me")).expect("rm");
        write(&src.merged.join("a/new"), "new");
        fs::write(src.merged.join("c/file"), "changed").expect("write");
        let layer = base.path().join("layer.tar");
        capture_diff(&src.upper, &layer).expect("capture");

        let outside = base.path().join("outside");
        write(&outside.join("delete-me"), "must survive");
        write(&outside.join("keep"), "outside keep");
        write(&outside.join("target"), "outside target");
        let before = snapshot(&outside);

        let placeholder = mount_overlay(base.path(), "placeholder", &lower);
        let p = &placeholder.merged;
        fs::remove_dir_all(p.join("a")).expect("rm -rf");
        symlink(&outside, p.join("a")).expect("plant a");
        fs::remove_file(p.join("c/file")).expect("rm");
        symlink(outside.join("target"), p.join("c/file")).expect("plant c/file");

        apply_diff(&layer, p).expect("apply");

        assert_eq!(
            snapshot(&outside),
            before,
            "something was written outside the root"
        );
        assert!(fs::symlink_metadata(p.join("a")).expect("lstat").is_dir());
        assert_eq!(fs::read(p.join("a/new")).expect("read"), b"new");
        let c = fs::symlink_metadata(p.join("c/file")).expect("lstat");
        assert!(c.file_type().is_file());
        assert_eq!(fs::read(p.join("c/file")).expect("read"), b"changed");
    }

    #[test]
    fn a_symlinked_parent_not_carried_by_the_layer_is_refused() {
        let base = TempDir::new().expect("tempdir");
        let outside = base.path().join("outside");
        write(&outside.join("victim"), "must survive");
        let root = base.path().join("root");
        fs::create_dir(&root).expect("mkdir");
        symlink(&outside, root.join("x")).expect("plant");

        let layer = base.path().join("layer.tar");
        raw_tar(
            &layer,
            &[
                raw(EntryType::Regular, "x/.wh.victim"),
                Raw {
                    data: b"data",
                    ..raw(EntryType::Regular, "x/y/file")
                },
            ],
        );
        read_plan(&layer).expect("the layer itself is fine");
        let before = snapshot(&outside);
        let err = apply_diff(&layer, &root).expect_err("must refuse");
        assert!(
            matches!(&err, RootfsError::UnsafeTarget { path, .. } if path == Path::new("x/y")),
            "{err}"
        );
        assert_eq!(snapshot(&outside), before);
    }

    #[test]
    fn kept_paths_are_left_alone() {
        use std::os::unix::fs::MetadataExt as _;
        let base = TempDir::new().expect("tempdir");
        let root = base.path().join("root");
        write(&root.join("etc/hosts"), "the pod's hosts");
        write(&root.join("data/keepme"), "volume");
        write(&root.join("etc/motd"), "image");
        let hosts_ino = fs::metadata(root.join("etc/hosts")).expect("stat").ino();

        let layer = base.path().join("layer.tar");
        raw_tar(
            &layer,
            &[
                raw(EntryType::Directory, "etc/"),
                raw(EntryType::Regular, "etc/.wh.motd"),
                raw(EntryType::Regular, "etc/hosts"),
                Raw {
                    data: b"new",
                    ..raw(EntryType::Regular, "etc/new")
                },
                raw(EntryType::Regular, "data/.wh.keepme"),
                Raw {
                    data: b"below",
                    ..raw(EntryType::Regular, "data/sub/file")
                },
            ],
        );
        let keep = [PathBuf::from("etc/hosts"), PathBuf::from("data")];
        apply_diff_keeping(&layer, &root, &keep).expect("apply");

        assert_eq!(fs::read(root.join("etc/new")).expect("read"), b"new");
        assert!(!root.join("etc/motd").exists(), "whiteouts elsewhere apply");
        let hosts = fs::metadata(root.join("etc/hosts")).expect("stat");
        assert_eq!(hosts.ino(), hosts_ino, "a kept file is not replaced");
        assert_eq!(
            fs::read(root.join("etc/hosts")).expect("read"),
            b"the pod's hosts"
        );
        assert_eq!(fs::read(root.join("data/keepme")).expect("read"), b"volume");
        assert!(
            !root.join("data/sub").exists(),
            "nothing added below a kept path"
        );
    }

    // ---- validation ---------------------------------------------------------------------------

    #[test]
    fn read_plan_refuses_unsafe_entries() {
        let base = TempDir::new().expect("tempdir");
        let cases: Vec<(&str, Vec<Raw<'_>>)> = vec![
            ("parent escape", vec![raw(EntryType::Regular, "../escape")]),
            ("absolute", vec![raw(EntryType::Regular, "/etc/passwd")]),
            ("inner escape", vec![raw(EntryType::Regular, "a/../../x")]),
            ("char device", vec![raw(EntryType::Char, "dev/evil")]),
            ("block device", vec![raw(EntryType::Block, "dev/sda")]),
            (
                "hard link outside",
                vec![Raw {
                    link: Some(b"../../etc/shadow"),
                    ..raw(EntryType::Link, "shadow")
                }],
            ),
            (
                "hard link to a file not in the layer",
                vec![Raw {
                    link: Some(b"etc/shadow"),
                    ..raw(EntryType::Link, "shadow")
                }],
            ),
            (
                "absolute hard link",
                vec![Raw {
                    link: Some(b"/etc/shadow"),
                    ..raw(EntryType::Link, "shadow")
                }],
            ),
            ("opaque root", vec![raw(EntryType::Regular, ".wh..wh..opq")]),
            ("aufs meta", vec![raw(EntryType::Regular, "a/.wh..wh.plnk")]),
            ("whiteout dir", vec![raw(EntryType::Directory, "a/.wh.b")]),
            (
                "duplicate",
                vec![raw(EntryType::Regular, "f"), raw(EntryType::Regular, "./f")],
            ),
            (
                "below a file",
                vec![raw(EntryType::Regular, "f"), raw(EntryType::Regular, "f/g")],
            ),
        ];
        for (what, entries) in cases {
            let tar = base.path().join(format!("{}.tar", what.replace(' ', "-")));
            raw_tar(&tar, &entries);
            let err = read_plan(&tar).expect_err(what);
            assert!(
                matches!(err, RootfsError::UnsafeEntry { .. }),
                "{what}: {err}"
            );
            names_tar(&err, &tar);
        }

        // A NUL byte can only hide in a PAX path.
        let tar = base.path().join("nul.tar");
        let mut builder = Builder::new(Vec::new());
        builder
            .append_pax_extensions([("path", b"a\0b".as_slice())])
            .expect("pax");
        let mut header = Header::new_gnu();
        header.set_size(0);
        builder
            .append_data(&mut header, "cover", io::empty())
            .expect("append");
        fs::write(&tar, builder.into_inner().expect("finish")).expect("write");
        let err = read_plan(&tar).expect_err("nul");
        assert!(matches!(err, RootfsError::UnsafeEntry { .. }), "{err}");
        assert!(
            err.to_string().contains("NUL") || format!("{err:?}").contains("NUL"),
            "{err}"
        );

        // overlayfs's private attributes are never accepted from a layer.
        let tar = base.path().join("overlay-xattr.tar");
        let mut builder = Builder::new(Vec::new());
        builder
            .append_pax_extensions([("SCHILY.xattr.trusted.overlay.opaque", b"y".as_slice())])
            .expect("pax");
        let mut header = Header::new_gnu();
        header.set_entry_type(EntryType::Directory);
        header.set_size(0);
        header.set_mode(0o755);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        builder
            .append_data(&mut header, "d", io::empty())
            .expect("append");
        fs::write(&tar, builder.into_inner().expect("finish")).expect("write");
        let err = read_plan(&tar).expect_err("overlay xattr");
        assert!(matches!(err, RootfsError::UnsafeEntry { .. }), "{err}");

        // What is fine: "./" prefixes, trailing slashes, absolute symlink targets, hard links to
        // earlier files, a root directory entry.
        let tar = base.path().join("fine.tar");
        raw_tar(
            &tar,
            &[
                Raw {
                    data: b"13 comment=x\n",
                    ..raw(EntryType::XGlobalHeader, "pax_global_header")
                },
                raw(EntryType::Directory, "./"),
                raw(EntryType::Directory, "./d/"),
                raw(EntryType::Regular, "./d/f"),
                Raw {
                    link: Some(b"d/f"),
                    ..raw(EntryType::Link, "d/g")
                },
                Raw {
                    link: Some(b"/etc/passwd"),
                    ..raw(EntryType::Symlink, "d/abs")
                },
                raw(EntryType::Regular, "d/.wh.gone"),
                raw(EntryType::Regular, "d/.wh..wh..opq"),
            ],
        );
        let plan = read_plan(&tar).expect("fine");
        let paths: Vec<_> = plan.entries.iter().map(|e| e.path.clone()).collect();
        assert_eq!(
            paths,
            ["d", "d/f", "d/g", "d/abs", "d/gone", "d"].map(PathBuf::from)
        );
        assert_eq!(plan.stats.whiteouts, 1);
        assert_eq!(plan.stats.opaque_dirs, 1);
        assert_eq!(
            plan.entries[3].kind,
            EntryKind::Symlink {
                target: PathBuf::from("/etc/passwd")
            }
        );
    }

    #[test]
    fn corrupt_and_truncated_tars_are_refused_naming_the_file() {
        let base = TempDir::new().expect("tempdir");
        let good = base.path().join("good.tar");
        let data = vec![7u8; 2000];
        raw_tar(
            &good,
            &[
                Raw {
                    data: &data,
                    ..raw(EntryType::Regular, "big")
                },
                raw(EntryType::Regular, "small"),
            ],
        );
        read_plan(&good).expect("good");
        let bytes = fs::read(&good).expect("read");

        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("mid-header", bytes[..300].to_vec()),
            ("mid-data", bytes[..512 + 1000].to_vec()),
            // Header + 4 data blocks + the second header, but no end marker.
            ("no end marker", bytes[..512 * 6].to_vec()),
            ("bad checksum", {
                let mut b = bytes.clone();
                b[0] ^= 0x20;
                b
            }),
        ];
        for (what, content) in cases {
            let tar = base.path().join(format!("{}.tar", what.replace(' ', "-")));
            fs::write(&tar, content).expect("write");
            let err = read_plan(&tar).expect_err(what);
            assert!(matches!(err, RootfsError::Corrupt { .. }), "{what}: {err}");
            names_tar(&err, &tar);

            let target = base
                .path()
                .join(format!("target-{}", what.replace(' ', "-")));
            fs::create_dir(&target).expect("mkdir");
            apply_diff(&tar, &target).expect_err(what);
            assert_eq!(
                fs::read_dir(&target).expect("ls").count(),
                0,
                "{what}: target touched"
            );
        }

        let missing = base.path().join("missing.tar");
        let err = read_plan(&missing).expect_err("missing");
        assert!(matches!(err, RootfsError::Io { .. }), "{err}");
        names_tar(&err, &missing);
    }

    #[test]
    fn apply_refuses_before_changing_anything() {
        let base = TempDir::new().expect("tempdir");
        let tar = base.path().join("layer.tar");
        raw_tar(
            &tar,
            &[
                raw(EntryType::Directory, "etc"),
                Raw {
                    data: b"fine",
                    ..raw(EntryType::Regular, "etc/ok")
                },
                raw(EntryType::Regular, "lost/.wh.keep"),
                raw(EntryType::Regular, "../escape"),
            ],
        );
        let root = base.path().join("root");
        write(&root.join("lost/keep"), "still here");
        let before = snapshot(&root);
        let err = apply_diff(&tar, &root).expect_err("unsafe");
        assert!(
            matches!(err, RootfsError::UnsafeEntry { index: 3, .. }),
            "{err}"
        );
        assert_eq!(snapshot(&root), before);
        assert!(!base.path().join("escape").exists());
    }

    #[test]
    fn capture_refuses_names_the_format_cannot_carry() {
        let base = TempDir::new().expect("tempdir");
        let upper = base.path().join("upper");
        write(&upper.join("d/.wh.looks-like-a-whiteout"), "");
        let out = base.path().join("layer.tar");
        let err = capture_diff(&upper, &out).expect_err("unsupported");
        assert!(matches!(err, RootfsError::Unsupported { .. }), "{err}");
        assert!(!out.exists(), "partial layer left behind");
    }

    #[test]
    fn capture_never_follows_symlinks_in_the_upper_dir() {
        let base = TempDir::new().expect("tempdir");
        let outside = base.path().join("outside");
        write(&outside.join("secret"), "not yours");
        let upper = base.path().join("upper");
        fs::create_dir(&upper).expect("mkdir");
        symlink(&outside, upper.join("etc")).expect("symlink");
        symlink(outside.join("secret"), upper.join("file")).expect("symlink");
        let out = base.path().join("layer.tar");
        let stats = capture_diff(&upper, &out).expect("capture");
        assert_eq!(stats.symlinks, 2);
        assert_eq!(stats.files, 0);
        assert_eq!(stats.bytes, 0);
        let plan = read_plan(&out).expect("plan");
        assert!(
            plan.entries
                .iter()
                .all(|e| matches!(e.kind, EntryKind::Symlink { .. }))
        );
    }

    #[test]
    fn pax_mtime_round_trips() {
        for (secs, nanos) in [
            (0, 0),
            (1_600_000_000, 123_456_789),
            (5, 1),
            (-2, 750_000_000),
            (-3, 0),
        ] {
            let m = MTime { secs, nanos };
            assert_eq!(
                parse_mtime(&format_mtime(m)),
                Some(m),
                "{m:?} -> {}",
                format_mtime(m)
            );
        }
        assert_eq!(
            parse_mtime("1.5"),
            Some(MTime {
                secs: 1,
                nanos: 500_000_000
            })
        );
        assert_eq!(
            parse_mtime("-1.25"),
            Some(MTime {
                secs: -2,
                nanos: 750_000_000
            })
        );
        assert_eq!(parse_mtime("x"), None);
        assert_eq!(parse_mtime(""), None);
    }
}
