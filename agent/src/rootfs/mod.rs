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

mod apply;
mod capture;
mod plan;
#[cfg(test)]
mod tests;
mod walk;

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

use nix::sys::time::TimeSpec;
use thiserror::Error;

pub use apply::{apply_diff, apply_diff_keeping};
pub use capture::capture_diff;
pub use plan::read_plan;

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
