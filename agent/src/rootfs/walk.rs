//! Resolution below a directory descriptor that never follows a symbolic link, leaves the
//! directory or crosses a mount, and the reads (listings, stats, xattrs) both directions share.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag};
use xattr::FileExt;

use super::*;

/// `openat2` below `dir`: no symbolic link (anywhere, including the last component), no `..`
/// escape, no mount crossing. An empty `rel` opens `dir` itself.
pub(super) fn open_beneath(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: OFlag,
    mode: Mode,
) -> nix::Result<OwnedFd> {
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

pub(super) fn open_dir_beneath(dir: BorrowedFd<'_>, rel: &Path) -> nix::Result<OwnedFd> {
    open_beneath(
        dir,
        rel,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        Mode::empty(),
    )
}

pub(super) fn file_type(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

pub(super) fn is_dir(st: &FileStat) -> bool {
    file_type(st) == SFlag::S_IFDIR
}

/// The names in a directory (without `.` and `..`), sorted.
pub(super) fn list_dir(dir: BorrowedFd<'_>, shown: &Path) -> Result<Vec<OsString>, RootfsError> {
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

pub(super) fn mtime_of(st: &FileStat) -> MTime {
    MTime {
        secs: st.st_mtime,
        nanos: u32::try_from(st.st_mtime_nsec).unwrap_or(0),
    }
}

pub(super) fn overlay_xattr<'a>(
    xattrs: &'a [(OsString, Vec<u8>)],
    suffix: &str,
) -> Option<&'a [u8]> {
    OVERLAY_XATTR_PREFIXES.iter().find_map(|prefix| {
        let wanted = format!("{prefix}{suffix}");
        xattrs
            .iter()
            .find(|(name, _)| name.as_bytes() == wanted.as_bytes())
            .map(|(_, value)| value.as_slice())
    })
}

pub(super) fn is_overlay_xattr(name: &OsStr) -> bool {
    OVERLAY_XATTR_PREFIXES
        .iter()
        .any(|prefix| name.as_bytes().starts_with(prefix.as_bytes()))
}

/// Whether an extended attribute travels in the layer: not overlayfs's own, and not the SELinux
/// label (the source container's MCS categories would lock the placeholder out of its files; the
/// target's own labelling applies).
pub(super) fn is_carried_xattr(name: &OsStr) -> bool {
    !is_overlay_xattr(name) && name.as_bytes() != SELINUX_XATTR.as_bytes()
}

/// Every extended attribute of an open file.
pub(super) fn read_xattrs(
    file: &File,
    shown: &Path,
) -> Result<Vec<(OsString, Vec<u8>)>, RootfsError> {
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
