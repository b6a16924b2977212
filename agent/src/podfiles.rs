//! Files in directories a workload can write too (a pod's signal directory, a target's control
//! directory): the agent runs as root there, so it treats every entry as planted by an attacker.
//!
//! - The directory is reached without following a link the workload could have made: the part
//!   of its path that the agent's configuration or the container runtime names is opened as
//!   given; each component below it, the directory itself included, is opened with
//!   `O_DIRECTORY | O_NOFOLLOW` relative to the one above (`..` is refused outright).
//! - A file is read through that directory's descriptor: opened `O_PATH | O_NOFOLLOW` (which
//!   opens nothing: no FIFO blocks, no device driver runs), checked with `fstat` to be a regular
//!   file, only then reopened for reading through `/proc/self/fd` (the same inode, so nothing
//!   can be swapped in between), and read up to [`READ_LIMIT`] bytes; a larger file is refused.
//! - Whether a file is there is asked with `fstatat(AT_SYMLINK_NOFOLLOW)`: following a link
//!   would make the agent an oracle for which host paths exist.
//! - A file is written under a fresh name with `O_EXCL | O_NOFOLLOW`, synced, then renamed over
//!   the final name (`renameat` replaces a link planted there instead of writing through it).
//!   Readers see the old content or the new, never a part.
//! - What the workload wrote is never put raw into a message, an Event or a log: [`quote`]
//!   bounds it and escapes control characters; errors name the file and what is wrong with it,
//!   never its content.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};
use thiserror::Error;

/// The most bytes read from a file a workload can write: the files of the protocol (claims,
/// `restore-failed`, signals) are a few hundred bytes of JSON.
pub const READ_LIMIT: u64 = 4096;

/// The most characters of a workload's text quoted in a message.
pub const QUOTE_LIMIT: usize = 200;

/// Why a file in a workload's directory cannot be used.
#[derive(Debug, Error)]
pub enum PodFileError {
    /// The directory (or a component below the trusted part of its path) is not a directory.
    #[error("{} is {kind}, not a directory", path.display())]
    NotDirectory {
        /// The path.
        path: PathBuf,
        /// What is there.
        kind: &'static str,
    },
    /// The file is not a regular file.
    #[error("{} is {kind}, not a regular file", path.display())]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What is there.
        kind: &'static str,
    },
    /// The file is larger than a protocol file can be.
    #[error(
        "{} holds {size} bytes, more than the {READ_LIMIT} read from a file the workload can write",
        path.display()
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least this much).
        size: u64,
    },
    /// A path below the trusted directory that is not a plain relative path.
    #[error("{} is not a plain path below {}", below.display(), root.display())]
    NotBelow {
        /// The trusted directory.
        root: PathBuf,
        /// The path that should be below it.
        below: PathBuf,
    },
    /// A system call failed.
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        /// What.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

impl PodFileError {
    /// The I/O error kind this error corresponds to (`AlreadyExists` for an exclusive create
    /// that lost, `NotFound` for a missing directory).
    pub fn kind(&self) -> std::io::ErrorKind {
        match self {
            Self::Io { source, .. } => source.kind(),
            Self::NotDirectory { .. } => std::io::ErrorKind::NotADirectory,
            Self::NotRegular { .. } => std::io::ErrorKind::InvalidData,
            Self::TooLarge { .. } => std::io::ErrorKind::FileTooLarge,
            Self::NotBelow { .. } => std::io::ErrorKind::InvalidInput,
        }
    }
}

impl From<PodFileError> for std::io::Error {
    fn from(err: PodFileError) -> Self {
        Self::new(err.kind(), err.to_string())
    }
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl Fn(Errno) -> PodFileError + 'a {
    move |e| PodFileError::Io {
        op,
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// What a file mode says the entry is, in words.
fn kind_of(mode: u32) -> &'static str {
    match SFlag::from_bits_truncate(mode) & SFlag::S_IFMT {
        SFlag::S_IFREG => "a regular file",
        SFlag::S_IFDIR => "a directory",
        SFlag::S_IFLNK => "a symbolic link (never followed)",
        SFlag::S_IFIFO => "a FIFO",
        SFlag::S_IFSOCK => "a socket",
        SFlag::S_IFCHR => "a character device",
        SFlag::S_IFBLK => "a block device",
        _ => "of an unknown type",
    }
}

fn is_regular(stat: &FileStat) -> bool {
    SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG
}

/// Checks that `name` is one plain file name (no `/`, not `.` or `..`).
fn plain_name<'a>(dir: &Path, name: &'a str) -> Result<&'a str, PodFileError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(PodFileError::NotBelow {
            root: dir.to_path_buf(),
            below: PathBuf::from(name),
        });
    }
    Ok(name)
}

/// A directory a workload can write in, opened without following a link it planted.
#[derive(Debug)]
pub struct PodDir {
    fd: OwnedFd,
    path: PathBuf,
}

const DIR_FLAGS: OFlag = OFlag::O_DIRECTORY
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_RDONLY)
    .union(OFlag::O_NONBLOCK)
    .union(OFlag::O_CLOEXEC);

impl PodDir {
    /// Opens the directory `path`: its parent as given (a path the container runtime or the
    /// agent's configuration chose), the directory itself without following a link.
    ///
    /// # Errors
    /// [`PodFileError::NotDirectory`] when `path` is a link or not a directory; the I/O error
    /// otherwise (`NotFound` when it is missing).
    pub fn open(path: &Path) -> Result<Self, PodFileError> {
        match (path.parent(), path.file_name()) {
            (Some(parent), Some(name)) if parent.as_os_str().is_empty() => {
                Self::open_below(Path::new("."), Path::new(name))
            }
            (Some(parent), Some(name)) => Self::open_below(parent, Path::new(name)),
            _ => Self::open_below(path, Path::new("")),
        }
    }

    /// Opens `root/below`: `root` as given (the agent's configuration names it), every
    /// component of `below` without following a link, each relative to the one above.
    ///
    /// # Errors
    /// As [`PodDir::open`]; [`PodFileError::NotBelow`] when `below` is absolute or holds `..`.
    pub fn open_below(root: &Path, below: &Path) -> Result<Self, PodFileError> {
        let fd = nix::fcntl::open(
            root,
            OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io("open directory", root))?;
        let mut dir = Self {
            fd,
            path: root.to_path_buf(),
        };
        for component in below.components() {
            let name = match component {
                Component::Normal(name) => name,
                Component::CurDir => continue,
                Component::RootDir | Component::ParentDir | Component::Prefix(_) => {
                    return Err(PodFileError::NotBelow {
                        root: root.to_path_buf(),
                        below: below.to_path_buf(),
                    });
                }
            };
            let path = dir.path.join(name);
            let fd = match openat(dir.fd.as_fd(), name, DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
                    let kind = fstatat(dir.fd.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .map_or("not a directory", |s| kind_of(s.st_mode));
                    return Err(if kind == "a directory" {
                        io("open directory", &path)(e)
                    } else {
                        PodFileError::NotDirectory { path, kind }
                    });
                }
                Err(e) => return Err(io("open directory", &path)(e)),
            };
            dir = Self { fd, path };
        }
        Ok(dir)
    }

    /// The directory's path (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory's device and inode: which directory this is, whatever path led to it.
    ///
    /// # Errors
    /// [`PodFileError::Io`] when it cannot be inspected.
    pub fn identity(&self) -> Result<(u64, u64), PodFileError> {
        let stat = fstat(self.fd.as_fd()).map_err(io("inspect", &self.path))?;
        #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
        Ok((stat.st_dev as u64, stat.st_ino as u64))
    }

    /// What `name` is, without following a link; `None` when there is nothing.
    ///
    /// # Errors
    /// The `fstatat` error other than `ENOENT`.
    pub fn entry_kind(&self, name: &str) -> Result<Option<&'static str>, PodFileError> {
        let path = self.path.join(name);
        let name = plain_name(&self.path, name)?;
        match fstatat(self.fd.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some(kind_of(stat.st_mode))),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(io("inspect", &path)(e)),
        }
    }

    /// Whether `name` is a regular file (a link, even to one, is not).
    ///
    /// # Errors
    /// As [`PodDir::entry_kind`].
    pub fn has_file(&self, name: &str) -> Result<bool, PodFileError> {
        Ok(self.entry_kind(name)? == Some("a regular file"))
    }

    /// Reads `name`, a regular file of at most [`READ_LIMIT`] bytes; `None` when there is
    /// nothing of that name.
    ///
    /// # Errors
    /// [`PodFileError::NotRegular`] (a link, a FIFO, a device, a directory…),
    /// [`PodFileError::TooLarge`], or the I/O error. None of them holds the file's content.
    pub fn read(&self, name: &str) -> Result<Option<Vec<u8>>, PodFileError> {
        let path = self.path.join(name);
        let name = plain_name(&self.path, name)?;
        // O_PATH opens no file: a FIFO's open would block, a device's would run its driver.
        let handle = match openat(
            self.fd.as_fd(),
            name,
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(e) => return Err(io("open", &path)(e)),
        };
        let stat = fstat(handle.as_fd()).map_err(io("inspect", &path))?;
        if !is_regular(&stat) {
            return Err(PodFileError::NotRegular {
                path,
                kind: kind_of(stat.st_mode),
            });
        }
        let size = u64::try_from(stat.st_size).unwrap_or(u64::MAX);
        if size > READ_LIMIT {
            return Err(PodFileError::TooLarge { path, size });
        }
        // Reopening the O_PATH descriptor through its /proc link opens exactly the inode just
        // checked, whatever the name points to by now.
        let fd = openat(
            AT_FDCWD,
            format!("/proc/self/fd/{}", handle.as_raw_fd()).as_str(),
            OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(io("open", &path))?;
        let reopened = fstat(fd.as_fd()).map_err(io("inspect", &path))?;
        if (reopened.st_dev, reopened.st_ino) != (stat.st_dev, stat.st_ino) {
            return Err(PodFileError::NotRegular {
                path,
                kind: "replaced while it was opened",
            });
        }
        let mut bytes = Vec::new();
        // One byte more than the limit tells a file that grew after the check.
        std::fs::File::from(fd)
            .take(READ_LIMIT + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| PodFileError::Io {
                op: "read",
                path: path.clone(),
                source,
            })?;
        if bytes.len() as u64 > READ_LIMIT {
            return Err(PodFileError::TooLarge {
                path,
                size: bytes.len() as u64,
            });
        }
        Ok(Some(bytes))
    }

    /// Writes `bytes` to `name` atomically and durably, following no link: a link or file
    /// planted there is replaced, never written through.
    ///
    /// # Errors
    /// The I/O error, naming the file (a directory planted at `name` makes the rename fail).
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<(), PodFileError> {
        let path = self.path.join(name);
        let name = plain_name(&self.path, name)?;
        let tmp = format!(".{name}.{}.tmp", std::process::id());
        // A leftover of a crashed writer with the same pid: ours to replace.
        let _ = nix::unistd::unlinkat(
            self.fd.as_fd(),
            tmp.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        let fd = openat(
            self.fd.as_fd(),
            tmp.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map_err(io("create a temporary file for", &path))?;
        let mut file = std::fs::File::from(fd);
        let written = file.write_all(bytes).and_then(|()| file.sync_all());
        if let Err(source) = written {
            self.remove_tmp(&tmp);
            return Err(PodFileError::Io {
                op: "write",
                path,
                source,
            });
        }
        if let Err(e) = renameat(self.fd.as_fd(), tmp.as_str(), self.fd.as_fd(), name) {
            self.remove_tmp(&tmp);
            return Err(io("rename into place", &path)(e));
        }
        // The rename is durable once the directory is.
        nix::unistd::fsync(self.fd.as_fd()).map_err(io("sync the directory of", &path))
    }

    /// Creates `name` with `bytes`, only if nothing of that name exists (`O_EXCL`: not even a
    /// link), and syncs it and the directory.
    ///
    /// # Errors
    /// The I/O error, naming the file; [`PodFileError::kind`] is `AlreadyExists` when
    /// something is there.
    pub fn create_new(&self, name: &str, bytes: &[u8]) -> Result<(), PodFileError> {
        let path = self.path.join(name);
        let name = plain_name(&self.path, name)?;
        let fd = openat(
            self.fd.as_fd(),
            name,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map_err(io("create", &path))?;
        let mut file = std::fs::File::from(fd);
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(|source| PodFileError::Io {
                op: "write",
                path: path.clone(),
                source,
            })?;
        nix::unistd::fsync(self.fd.as_fd()).map_err(io("sync the directory of", &path))
    }

    fn remove_tmp(&self, tmp: &str) {
        let _ = nix::unistd::unlinkat(
            self.fd.as_fd(),
            tmp,
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
}

/// Writes `bytes` to `<dir>/<name>` atomically and durably, following no link
/// ([`PodDir::open`], then [`PodDir::write`]).
///
/// # Errors
/// The I/O error, with `dir` and `name` in its message; `dir` being a symbolic link is one.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    PodDir::open(dir)?.write(name, bytes)?;
    Ok(())
}

/// Text a workload wrote, fit to quote in a message, an Event or a log: in double quotes, with
/// control and other unprintable characters escaped, cut after [`QUOTE_LIMIT`] characters (the
/// cut says how many bytes there were).
pub fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(QUOTE_LIMIT) + 2);
    out.push('"');
    for (i, c) in text.chars().enumerate() {
        if i == QUOTE_LIMIT {
            out.push_str(&format!("\"… ({} bytes in all)", text.len()));
            return out;
        }
        out.extend(c.escape_debug());
    }
    out.push('"');
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use std::os::unix::fs::symlink;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    const SECRET: &str = "root-only-secret-0123456789";

    /// A control directory beside a secret file the workload must not get to read.
    fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, SECRET).unwrap();
        let dir = tmp.path().join("control");
        std::fs::create_dir(&dir).unwrap();
        (tmp, dir, secret)
    }

    /// Runs `f` on its own thread and fails the test (instead of hanging it) when it does
    /// not return within a few seconds.
    pub(crate) fn promptly<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("did not return within 5 s (blocked)")
    }

    fn read_err(dir: &Path, name: &'static str) -> PodFileError {
        let dir = dir.to_path_buf();
        promptly(move || PodDir::open(&dir).unwrap().read(name)).unwrap_err()
    }

    #[test]
    fn a_small_regular_file_is_read() {
        let (_tmp, dir, _) = setup();
        std::fs::write(dir.join("restore-failed"), b"{}").unwrap();
        let d = PodDir::open(&dir).unwrap();
        assert_eq!(d.read("restore-failed").unwrap().unwrap(), b"{}");
        assert_eq!(d.read("restore-claim").unwrap(), None);
        assert!(d.has_file("restore-failed").unwrap());
        assert!(!d.has_file("restore-claim").unwrap());
    }

    #[test]
    fn a_link_to_a_secret_is_refused_and_the_secret_never_shown() {
        let (_tmp, dir, secret) = setup();
        symlink(&secret, dir.join("restore-claim")).unwrap();
        let err = read_err(&dir, "restore-claim");
        let text = err.to_string();
        assert!(
            matches!(err, PodFileError::NotRegular { .. }),
            "refused: {text}"
        );
        assert!(
            text.contains("restore-claim") && text.contains("symbolic link"),
            "{text}"
        );
        assert!(!text.contains(SECRET), "{text}");
        assert!(
            !text.contains("secret"),
            "not even the link's target: {text}"
        );
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let (_tmp, dir, _) = setup();
        nix::unistd::mkfifo(&dir.join("restore-failed"), Mode::from_bits_truncate(0o600)).unwrap();
        let err = read_err(&dir, "restore-failed");
        assert!(err.to_string().contains("is a FIFO"), "{err}");
    }

    #[test]
    fn a_link_to_dev_zero_is_refused() {
        let (_tmp, dir, _) = setup();
        symlink("/dev/zero", dir.join("restore-failed")).unwrap();
        let err = read_err(&dir, "restore-failed");
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }

    #[test]
    fn a_huge_file_is_refused_by_its_size_unread() {
        let (_tmp, dir, _) = setup();
        // Sparse: 64 GiB that take no disk.
        let file = std::fs::File::create(dir.join("restore-claim")).unwrap();
        file.set_len(64 << 30).unwrap();
        let err = read_err(&dir, "restore-claim");
        assert!(
            matches!(err, PodFileError::TooLarge { size, .. } if size == 64 << 30),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("restore-claim") && text.contains("68719476736 bytes"),
            "{text}"
        );
    }

    #[test]
    fn a_file_one_byte_over_the_limit_is_refused() {
        let (_tmp, dir, _) = setup();
        let limit = usize::try_from(READ_LIMIT).unwrap();
        std::fs::write(dir.join("ok"), vec![b'x'; limit]).unwrap();
        std::fs::write(dir.join("over"), vec![b'x'; limit + 1]).unwrap();
        let d = PodDir::open(&dir).unwrap();
        assert_eq!(d.read("ok").unwrap().unwrap().len(), limit);
        assert!(matches!(
            d.read("over").unwrap_err(),
            PodFileError::TooLarge { .. }
        ));
    }

    #[test]
    fn a_directory_in_place_of_the_file_is_refused() {
        let (_tmp, dir, _) = setup();
        std::fs::create_dir(dir.join("restore-failed")).unwrap();
        let err = read_err(&dir, "restore-failed");
        assert!(err.to_string().contains("is a directory"), "{err}");
    }

    #[test]
    fn a_device_node_is_refused() {
        if !crate::testing::root("making a device node") {
            return;
        }
        let (_tmp, dir, _) = setup();
        // /dev/zero's numbers (1:5), made in the directory itself: no link to refuse.
        nix::sys::stat::mknod(
            &dir.join("restore-failed"),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o600),
            nix::sys::stat::makedev(1, 5),
        )
        .unwrap();
        let err = read_err(&dir, "restore-failed");
        assert!(err.to_string().contains("character device"), "{err}");
    }

    #[test]
    fn a_linked_directory_is_refused() {
        let (tmp, dir, _) = setup();
        std::fs::write(dir.join("restore-failed"), b"{}").unwrap();
        let link = tmp.path().join("link");
        symlink(&dir, &link).unwrap();
        let err = PodDir::open(&link).unwrap_err();
        assert!(matches!(err, PodFileError::NotDirectory { .. }), "{err:?}");
        assert!(err.to_string().contains("link is a symbolic link"), "{err}");
    }

    #[test]
    fn a_linked_component_below_the_trusted_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("elsewhere/control");
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("ready"), b"").unwrap();
        std::fs::create_dir(tmp.path().join("pods")).unwrap();
        symlink(tmp.path().join("elsewhere"), tmp.path().join("pods/uid")).unwrap();
        let err = PodDir::open_below(tmp.path(), Path::new("pods/uid/control")).unwrap_err();
        assert!(
            matches!(&err, PodFileError::NotDirectory { path, kind: "a symbolic link (never followed)" } if path.ends_with("pods/uid")),
            "{err:?}"
        );
        // The same path without the link opens.
        std::fs::remove_file(tmp.path().join("pods/uid")).unwrap();
        std::fs::rename(tmp.path().join("elsewhere"), tmp.path().join("pods/uid")).unwrap();
        let dir = PodDir::open_below(tmp.path(), Path::new("pods/uid/control")).unwrap();
        assert!(dir.has_file("ready").unwrap());
        assert!(matches!(
            PodDir::open_below(tmp.path(), Path::new("pods/../pods/uid")).unwrap_err(),
            PodFileError::NotBelow { .. }
        ));
    }

    #[test]
    fn a_link_or_fifo_is_no_file_there() {
        let (_tmp, dir, secret) = setup();
        symlink(&secret, dir.join("ready")).unwrap();
        nix::unistd::mkfifo(&dir.join("x.done"), Mode::from_bits_truncate(0o600)).unwrap();
        let d = PodDir::open(&dir).unwrap();
        assert!(!d.has_file("ready").unwrap());
        assert_eq!(
            d.entry_kind("ready").unwrap(),
            Some("a symbolic link (never followed)")
        );
        assert!(!d.has_file("x.done").unwrap());
        assert_eq!(d.entry_kind("x.done").unwrap(), Some("a FIFO"));
    }

    #[test]
    fn names_are_single_components() {
        let (_tmp, dir, _) = setup();
        let d = PodDir::open(&dir).unwrap();
        for name in ["../secret", "..", "a/b", ""] {
            assert!(
                matches!(d.read(name), Err(PodFileError::NotBelow { .. })),
                "{name}"
            );
        }
    }

    #[test]
    fn quoting_escapes_control_characters_and_bounds_the_text() {
        assert_eq!(quote("plain words"), "\"plain words\"");
        let hostile = "line\n\x1b[31mred\r\u{202e}\"";
        let quoted = quote(hostile);
        assert!(
            !quoted.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{quoted:?}"
        );
        assert_eq!(quoted, r#""line\n\u{1b}[31mred\r\u{202e}\"""#);
        let long = "x".repeat(10_000);
        let quoted = quote(&long);
        assert!(quoted.len() < QUOTE_LIMIT + 40, "{}", quoted.len());
        assert!(quoted.ends_with("(10000 bytes in all)"), "{quoted}");
    }

    #[test]
    fn writes_replace_the_file_whole() {
        let tmp = tempfile::tempdir().unwrap();
        write_file(tmp.path(), "ready", b"one").unwrap();
        write_file(tmp.path(), "ready", b"two").unwrap();
        assert_eq!(std::fs::read(tmp.path().join("ready")).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("ready")],
            "no temporary file left"
        );
    }

    #[test]
    fn a_planted_link_is_replaced_not_followed() {
        let (_tmp, dir, victim) = setup();
        symlink(&victim, dir.join("restore-failed")).unwrap();
        symlink(
            &victim,
            dir.join(format!(".restore-failed.{}.tmp", std::process::id())),
        )
        .unwrap();
        write_file(&dir, "restore-failed", b"{}").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), SECRET.as_bytes());
        assert!(
            !std::fs::symlink_metadata(dir.join("restore-failed"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }

    #[test]
    fn a_planted_directory_fails_the_write_naming_the_file() {
        let (_tmp, dir, _) = setup();
        std::fs::create_dir_all(dir.join("restore-complete/inside")).unwrap();
        let err = write_file(&dir, "restore-complete", b"ok\n").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("control/restore-complete") && text.contains("rename"),
            "{text}"
        );
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("restore-complete")]);
    }

    #[test]
    fn a_write_into_a_linked_directory_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        symlink(&real, &link).unwrap();
        let err = write_file(&link, "x", b"x").unwrap_err();
        assert!(err.to_string().contains("link"), "{err}");
        assert!(!real.join("x").exists());
    }

    #[test]
    fn create_new_never_replaces_nor_follows() {
        let (_tmp, dir, secret) = setup();
        let d = PodDir::open(&dir).unwrap();
        d.create_new("restore-claim", b"mine").unwrap();
        let err = d.create_new("restore-claim", b"again").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
        symlink(&secret, dir.join("other")).unwrap();
        let err = d.create_new("other", b"x").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(std::fs::read(&secret).unwrap(), SECRET.as_bytes());
        assert_eq!(std::fs::read(dir.join("restore-claim")).unwrap(), b"mine");
    }
}
