//! An artifact directory read as hostile input. Whoever can write artifact storage can plant
//! links, FIFOs, huge files and files no manifest lists; this is the one way the controller, the
//! CLI and a restore open what is there: the directory through every component from `/` without
//! following a link, each file relative to it the same way (no link followed at any element),
//! non-blocking (a FIFO never holds the reader), regular files only, small files read with a
//! bound, and a listing that finds every entry the manifest does not list.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, fstatat};

use super::{FileError, Manifest, PathError, UNLISTED_RESTORE_OUTPUTS};
use crate::names::{FILE_COMPLETE, FILE_MANIFEST};

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);
const FILE_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_NONBLOCK)
    .union(OFlag::O_NOCTTY)
    .union(OFlag::O_CLOEXEC);

/// An artifact directory, held open: every file is opened relative to this descriptor, so the
/// directory cannot be swapped for another under the reader.
#[derive(Debug)]
pub struct ArtifactDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// Whether `name` (an entry of `dir`) is a symbolic link, without following it.
fn is_symlink(dir: BorrowedFd<'_>, name: &str) -> bool {
    fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|st| st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFLNK)
}

impl ArtifactDir {
    /// Opens the directory `path` (absolute, no `.` or `..`) one component at a time from `/`,
    /// never following a link. `None` when a component does not exist.
    ///
    /// # Errors
    /// [`PathError::NotNormal`], [`PathError::Symlink`], [`PathError::NotDirectory`] or
    /// [`PathError::Inspect`] naming the component.
    pub fn open(path: &Path) -> Result<Option<Self>, PathError> {
        let normal = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !normal {
            return Err(PathError::NotNormal(path.to_path_buf()));
        }
        let inspect = |path: &Path, errno: Errno| PathError::Inspect {
            path: path.to_path_buf(),
            source: io::Error::from(errno),
        };
        let root = Path::new("/");
        let mut fd =
            nix::fcntl::open(root, DIR_FLAGS, Mode::empty()).map_err(|e| inspect(root, e))?;
        let mut current = PathBuf::from("/");
        for component in path.components() {
            let Component::Normal(part) = component else {
                continue;
            };
            current.push(part);
            fd = match openat(&fd, part, DIR_FLAGS, Mode::empty()) {
                Ok(next) => next,
                Err(Errno::ENOENT) => return Ok(None),
                Err(Errno::ELOOP) => return Err(PathError::Symlink(current)),
                Err(Errno::ENOTDIR) => {
                    let linked = part.to_str().is_some_and(|p| is_symlink(fd.as_fd(), p));
                    return Err(if linked {
                        PathError::Symlink(current)
                    } else {
                        PathError::NotDirectory(current)
                    });
                }
                Err(errno) => return Err(inspect(&current, errno)),
            };
        }
        Ok(Some(Self {
            path: path.to_path_buf(),
            fd,
        }))
    }

    /// A directory the caller opened itself (without following links), shown as `path`.
    pub fn from_fd(path: PathBuf, fd: OwnedFd) -> Self {
        Self { path, fd }
    }

    /// The path it was opened as (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `relative` (a path the manifest validated, `a/b.img`) for reading: every element
    /// relative to the one before, none followed if it is a link, non-blocking, and only a
    /// regular file is returned.
    ///
    /// # Errors
    /// [`FileError::Missing`], [`FileError::NotRegular`] (a link, directory, FIFO, device, or
    /// an element on the way that is not a real directory) or [`FileError::Read`].
    pub fn open_file(&self, relative: &str) -> Result<File, FileError> {
        let full = self.path.join(relative);
        let mut elements: Vec<&str> = relative.split('/').collect();
        let Some(last) = elements.pop() else {
            return Err(FileError::Missing(full));
        };
        let mut dir: Option<OwnedFd> = None;
        let mut walked = self.path.clone();
        for element in elements {
            walked.push(element);
            let parent = dir.as_ref().map_or(self.fd.as_fd(), AsFd::as_fd);
            dir = Some(match openat(parent, element, DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => return Err(FileError::Missing(full)),
                Err(Errno::ELOOP | Errno::ENOTDIR) => return Err(FileError::NotRegular(walked)),
                Err(errno) => {
                    return Err(FileError::Read {
                        path: walked,
                        source: errno.into(),
                    });
                }
            });
        }
        let parent = dir.as_ref().map_or(self.fd.as_fd(), AsFd::as_fd);
        let file = match openat(parent, last, FILE_FLAGS, Mode::empty()) {
            Ok(fd) => File::from(fd),
            Err(Errno::ENOENT) => return Err(FileError::Missing(full)),
            // O_NOFOLLOW on a link.
            Err(Errno::ELOOP | Errno::ENOTDIR) => return Err(FileError::NotRegular(full)),
            Err(errno) => {
                return Err(FileError::Read {
                    path: full,
                    source: errno.into(),
                });
            }
        };
        let meta = file.metadata().map_err(|source| FileError::Read {
            path: full.clone(),
            source,
        })?;
        if !meta.file_type().is_file() {
            return Err(FileError::NotRegular(full));
        }
        Ok(file)
    }

    /// Reads the small file `relative` whole, refusing one larger than `cap` bytes (before
    /// reading it, and again while reading, should it grow).
    ///
    /// # Errors
    /// As [`ArtifactDir::open_file`], and [`FileError::TooLarge`].
    pub fn read_bounded(&self, relative: &str, cap: u64) -> Result<Vec<u8>, FileError> {
        let full = || self.path.join(relative);
        let file = self.open_file(relative)?;
        let size = file
            .metadata()
            .map_err(|source| FileError::Read {
                path: full(),
                source,
            })?
            .len();
        if size > cap {
            return Err(FileError::TooLarge {
                path: full(),
                size,
                cap,
            });
        }
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        file.take(cap.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|source| FileError::Read {
                path: full(),
                source,
            })?;
        if bytes.len() as u64 > cap {
            return Err(FileError::TooLarge {
                path: full(),
                size: bytes.len() as u64,
                cap,
            });
        }
        Ok(bytes)
    }

    /// Checks that the directory holds nothing the manifest does not list: every entry is the
    /// manifest, the marker, a listed file, or a directory on the way to one.
    ///
    /// # Errors
    /// [`FileError::Unlisted`] naming the first such entry (in name order, depth first), or
    /// [`FileError::Read`].
    pub fn check_listing(&self, manifest: &Manifest) -> Result<(), FileError> {
        let mut files: BTreeSet<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
        files.extend([FILE_MANIFEST, FILE_COMPLETE]);
        files.extend(UNLISTED_RESTORE_OUTPUTS);
        let dirs: BTreeSet<&str> = manifest
            .files
            .iter()
            .flat_map(|f| {
                f.path
                    .match_indices('/')
                    .map(|(at, _)| &f.path[..at])
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut stack = vec![(String::new(), self.reopen(".", &self.path)?)];
        while let Some((prefix, fd)) = stack.pop() {
            let shown = self.path.join(&prefix);
            let list_error = |errno: Errno| FileError::Read {
                path: shown.clone(),
                source: errno.into(),
            };
            let mut dir = nix::dir::Dir::from_fd(fd).map_err(list_error)?;
            let mut names = Vec::new();
            for entry in dir.iter() {
                let entry = entry.map_err(list_error)?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name != "." && name != ".." {
                    names.push(name);
                }
            }
            names.sort();
            for name in names {
                let rel = if prefix.is_empty() {
                    name.clone()
                } else {
                    format!("{prefix}/{name}")
                };
                if files.contains(rel.as_str()) {
                    // Its type and size are checked when it is opened.
                    continue;
                }
                if !dirs.contains(rel.as_str()) {
                    return Err(FileError::Unlisted(self.path.join(&rel)));
                }
                let path = self.path.join(&rel);
                match openat(dir.as_fd(), name.as_str(), DIR_FLAGS, Mode::empty()) {
                    Ok(fd) => stack.push((rel, fd)),
                    // Not a real directory: opening the files below it says so.
                    Err(Errno::ELOOP | Errno::ENOTDIR) => {}
                    Err(errno) => {
                        return Err(FileError::Read {
                            path,
                            source: errno.into(),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// A new descriptor of the directory `relative` (`.` for this one), for a listing with its
    /// own position.
    fn reopen(&self, relative: &str, shown: &Path) -> Result<OwnedFd, FileError> {
        openat(&self.fd, relative, DIR_FLAGS, Mode::empty()).map_err(|errno| FileError::Read {
            path: shown.to_path_buf(),
            source: errno.into(),
        })
    }
}

impl AsFd for ArtifactDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
