//! Capture: an overlay upper directory turned into the layer tarball.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{AtFlags, OFlag, readlinkat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat};
use tar::{Builder, EntryType, Header};

use super::walk::*;
use super::*;

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

pub(super) struct Capture<'a> {
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

pub(super) fn format_mtime(mtime: MTime) -> String {
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
