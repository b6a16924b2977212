//! Writing files into directories a workload can write too (a pod's signal directory, a
//! target's control directory): the agent runs as root there, so it never follows a link the
//! workload planted. The directory is opened with `O_NOFOLLOW`, the file created under a fresh
//! name with `O_EXCL | O_NOFOLLOW`, synced, then renamed over the final name (`renameat` replaces
//! a link planted there instead of writing through it). Readers see the old content or the new,
//! never a part.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::Path;

use nix::fcntl::{OFlag, openat, renameat};
use nix::sys::stat::Mode;

/// Writes `bytes` to `<dir>/<name>` atomically and durably, following no link.
///
/// # Errors
/// The I/O error, with `dir` and `name` in its message; `ELOOP` (or `ENOTDIR`) when `dir` is a
/// symbolic link.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let context = |op: &str, e: nix::errno::Errno| {
        std::io::Error::new(
            std::io::Error::from(e).kind(),
            format!("{op} {}/{name}: {e}", dir.display()),
        )
    };
    let dir_fd = nix::fcntl::open(
        dir,
        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY,
        Mode::empty(),
    )
    .map_err(|e| context("open directory of", e))?;
    let tmp = format!(".{name}.{}.tmp", std::process::id());
    // A leftover of a crashed writer with the same pid: ours to replace.
    let _ = nix::unistd::unlinkat(
        dir_fd.as_fd(),
        tmp.as_str(),
        nix::unistd::UnlinkatFlags::NoRemoveDir,
    );
    let fd = openat(
        dir_fd.as_fd(),
        tmp.as_str(),
        OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .map_err(|e| context("create", e))?;
    let mut file = std::fs::File::from(fd);
    let written = file.write_all(bytes).and_then(|()| file.sync_all());
    if let Err(e) = written {
        let _ = nix::unistd::unlinkat(
            dir_fd.as_fd(),
            tmp.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        return Err(std::io::Error::new(
            e.kind(),
            format!("write {}/{name}: {e}", dir.display()),
        ));
    }
    renameat(dir_fd.as_fd(), tmp.as_str(), dir_fd.as_fd(), name)
        .map_err(|e| context("rename into place", e))?;
    // The rename is durable once the directory is.
    nix::unistd::fsync(dir_fd.as_fd()).map_err(|e| context("fsync directory of", e))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

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
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let dir = tmp.path().join("control");
        std::fs::create_dir(&dir).unwrap();
        symlink(&victim, dir.join("restore-failed")).unwrap();
        symlink(
            &victim,
            dir.join(format!(".restore-failed.{}.tmp", std::process::id())),
        )
        .unwrap();
        write_file(&dir, "restore-failed", b"{}").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(
            !std::fs::symlink_metadata(dir.join("restore-failed"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }

    #[test]
    fn a_linked_directory_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        symlink(&real, &link).unwrap();
        let err = write_file(&link, "x", b"x").unwrap_err();
        assert!(err.to_string().contains("link/x"), "{err}");
        assert!(!real.join("x").exists());
    }
}
