//! Directories that hold CRIU's logs, which nobody but this user can plant or swap.
//!
//! CRIU (running as root) opens its log by name inside the directory it is given, following
//! links: a directory another user could create first, or whose entries another user could
//! replace, lets that user make root overwrite any file. So a log directory is either a new,
//! private one (random name, mode 0700, created exclusively: [`private`]) or one an operator
//! named, created the same way when missing and, when it exists, refused unless it is a real
//! directory owned by this user that no one else can write, reached through directories only
//! root or this user can change ([`prepare`]).

use std::fs::{self, DirBuilder, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::criu::CriuError;

/// Mode of the log directories this module creates.
const PRIVATE_MODE: u32 = 0o700;

/// Why a log directory cannot be used.
#[derive(Debug, Error)]
pub enum LogDirError {
    /// Creating or inspecting it failed.
    #[error("cannot {op} log directory {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// It, or a directory above it, could be changed by another user: CRIU's log there could be
    /// replaced by a link to any file.
    #[error("log directory {dir} is unsafe: {path} {why}; choose a directory only root can change")]
    Unsafe {
        /// The log directory.
        dir: PathBuf,
        /// The offending path (the directory or one above it).
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// A new private directory under the system temporary directory: `<prefix><random>`, mode
/// 0700, created exclusively (an existing path of that name is never reused).
///
/// # Errors
/// [`LogDirError::Io`].
pub fn private(prefix: &str) -> Result<PathBuf, LogDirError> {
    let base = std::env::temp_dir();
    tempfile::Builder::new()
        .prefix(prefix)
        .permissions(Permissions::from_mode(PRIVATE_MODE))
        .tempdir_in(&base)
        .map(tempfile::TempDir::keep)
        .map_err(|source| LogDirError::Io {
            op: "create a private",
            path: base,
            source,
        })
}

/// Makes `dir` ready to receive a log: created with mode 0700 when missing (its missing
/// parents too), refused when it, or a directory above it, could be changed by another user.
///
/// # Errors
/// [`LogDirError`].
pub fn prepare(dir: &Path) -> Result<(), LogDirError> {
    let io_err = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| LogDirError::Io { op, path, source }
    };
    let dir = std::path::absolute(dir).map_err(io_err("resolve", dir))?;
    if let Some(parent) = dir.parent() {
        DirBuilder::new()
            .recursive(true)
            .create(parent)
            .map_err(io_err("create the parent of", &dir))?;
        check_ancestors(&dir, parent)?;
    }
    match DirBuilder::new().mode(PRIVATE_MODE).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err("create", &dir)(e)),
    }
    // Judged after creation: whoever made it, it is used only if it is ours and private.
    let meta = fs::symlink_metadata(&dir).map_err(io_err("inspect", &dir))?;
    let unsafe_because = |why: String| LogDirError::Unsafe {
        dir: dir.clone(),
        path: dir.clone(),
        why,
    };
    if !meta.file_type().is_dir() {
        return Err(unsafe_because(
            "is not a directory (a symbolic link or a file)".to_owned(),
        ));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(unsafe_because(format!(
            "is owned by uid {}, not by this user (uid {me})",
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(unsafe_because(format!(
            "is writable by other users (mode {:o})",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Moves the log a failed CRIU request names out of a directory that is about to be removed
/// (a checkpoint's staging directory) into a new [`private`] directory, and points `err` at the
/// copy, so that the error names a log that still exists. The log stays where it was (and the
/// error unchanged) when the copy fails; that is logged.
pub fn keep_failed_log(mut err: CriuError) -> CriuError {
    let Some(log) = err.log().map(Path::to_path_buf) else {
        return err;
    };
    if !fs::symlink_metadata(&log).is_ok_and(|m| m.file_type().is_file()) {
        return err;
    }
    let name = log.file_name().unwrap_or(log.as_os_str()).to_owned();
    let kept = private("warmstart-dump-").and_then(|dir| {
        let kept = dir.join(&name);
        fs::copy(&log, &kept)
            .map(|_| kept)
            .map_err(|source| LogDirError::Io {
                op: "copy the CRIU log into",
                path: dir,
                source,
            })
    });
    match kept {
        Ok(kept) => err.set_log(kept),
        Err(copy) => {
            tracing::warn!(log = %log.display(), error = %crate::report::error_chain(&copy), "cannot keep the failed request's CRIU log");
        }
    }
    err
}

/// Every directory from `/` to `parent` (links resolved) can be changed only by root or this
/// user, or is sticky (as `/tmp`), where others cannot rename or remove what is ours.
fn check_ancestors(dir: &Path, parent: &Path) -> Result<(), LogDirError> {
    let real = fs::canonicalize(parent).map_err(|source| LogDirError::Io {
        op: "resolve the parent of",
        path: dir.to_path_buf(),
        source,
    })?;
    let me = nix::unistd::geteuid().as_raw();
    for ancestor in real.ancestors() {
        let meta = fs::metadata(ancestor).map_err(|source| LogDirError::Io {
            op: "inspect a directory above",
            path: dir.to_path_buf(),
            source,
        })?;
        let unsafe_because = |why: String| LogDirError::Unsafe {
            dir: dir.to_path_buf(),
            path: ancestor.to_path_buf(),
            why,
        };
        if meta.uid() != 0 && meta.uid() != me {
            return Err(unsafe_because(format!("is owned by uid {}", meta.uid())));
        }
        let sticky = meta.mode() & 0o1000 != 0;
        let others_write = meta.mode() & 0o002 != 0;
        let group_write = meta.mode() & 0o020 != 0 && meta.gid() != 0;
        if (others_write || group_write) && !sticky {
            return Err(unsafe_because(format!(
                "is writable by other users and not sticky (mode {:o})",
                meta.mode() & 0o7777
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn private_directories_are_new_random_and_0700() {
        let a = private("warmstart-test-").unwrap();
        let b = private("warmstart-test-").unwrap();
        assert_ne!(a, b);
        for dir in [&a, &b] {
            assert_eq!(mode(dir), 0o700, "{}", dir.display());
            assert!(dir.starts_with(std::env::temp_dir()));
            fs::remove_dir(dir).unwrap();
        }
    }

    #[test]
    fn a_missing_directory_is_created_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/logs");
        prepare(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        // Again: it is ours now.
        prepare(&dir).unwrap();
    }

    #[test]
    fn a_planted_link_or_a_directory_others_can_write_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("elsewhere");
        fs::create_dir(&target).unwrap();
        let link = tmp.path().join("logs");
        symlink(&target, &link).unwrap();
        let err = prepare(&link).unwrap_err();
        assert!(err.to_string().contains("is not a directory"), "{err}");

        let open = tmp.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, Permissions::from_mode(0o777)).unwrap();
        let err = prepare(&open).unwrap_err();
        assert!(err.to_string().contains("writable by other users"), "{err}");
        // Below a directory everyone can write that is not sticky, nothing is safe.
        let err = prepare(&open.join("logs")).unwrap_err();
        assert!(err.to_string().contains("not sticky"), "{err}");
    }

    #[test]
    fn a_failed_request_names_a_copy_of_its_log_that_outlives_the_directory() {
        let staging = tempfile::tempdir().unwrap();
        let log = staging.path().join("dump.log");
        fs::write(&log, "Error (criu/seize.c:1): Can't seize 7\n").unwrap();
        let err = keep_failed_log(CriuError::Failed {
            op: crate::criu::CriuOp::Dump,
            cr_errno: None,
            message: String::new(),
            log: Some(log.clone()),
            key_lines: vec!["Error (criu/seize.c:1): Can't seize 7".to_owned()],
        });
        drop(staging);
        let kept = err.log().unwrap().to_path_buf();
        assert_ne!(kept, log);
        assert!(
            err.to_string().contains(&kept.display().to_string()),
            "{err}"
        );
        assert_eq!(
            fs::read_to_string(&kept).unwrap(),
            "Error (criu/seize.c:1): Can't seize 7\n"
        );
        assert_eq!(mode(kept.parent().unwrap()), 0o700);
        fs::remove_dir_all(kept.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        if !crate::testing::root("giving a directory away") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        fs::set_permissions(&theirs, Permissions::from_mode(0o700)).unwrap();
        nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
        let err = prepare(&theirs).unwrap_err();
        assert!(err.to_string().contains("owned by uid 65534"), "{err}");
    }
}
