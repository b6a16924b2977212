//! `--install <dir>`: the init container copies this very binary into the emptyDir that the
//! wrapped container mounts read-only, so the entrypoint image needs nothing else (no shell,
//! no `cp`).

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use warmstart_shared::names;

/// Copies the running executable to `<dir>/warmstart-entrypoint` (mode 0755, through a
/// temporary file and a rename, so a reader never sees half a binary); the path written.
///
/// # Errors
/// The executable cannot be read, or the directory written.
pub fn install(dir: &Path) -> io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    fs::create_dir_all(dir)?;
    let dest = dir.join(names::ENTRYPOINT_BINARY);
    let tmp = dir.join(format!(".{}.tmp", names::ENTRYPOINT_BINARY));
    fs::copy(&exe, &tmp)?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))?;
    fs::File::open(&tmp)?.sync_all()?;
    fs::rename(&tmp, &dest)?;
    Ok(dest)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn installs_an_executable_copy_of_itself() {
        let dir = tempfile::tempdir().unwrap();
        let dest = install(&dir.path().join("bin")).unwrap();
        assert_eq!(dest, dir.path().join("bin/warmstart-entrypoint"));
        let meta = fs::metadata(&dest).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o755);
        assert_eq!(
            meta.len(),
            fs::metadata(std::env::current_exe().unwrap())
                .unwrap()
                .len()
        );
        assert_eq!(fs::read_dir(dir.path().join("bin")).unwrap().count(), 1);
    }
}
