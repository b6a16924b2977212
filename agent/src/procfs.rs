//! Reads of a workload's `/proc/<pid>/…` files, bounded in bytes. These files are the workload's
//! to shape: a process with no privilege can make its environment as large as its address space
//! (`prctl(PR_SET_MM, PR_SET_MM_MAP)` points it at an untouched mapping of any size), and the
//! kernel hands all of it to a reader that asks. The agent, root and shared by every workload of
//! the node, reads at most the cap plus one byte and says when a file was longer.

use std::io::Read;
use std::path::PathBuf;

/// The most of a process's environment read: execve lets a program start with about 2 MiB of
/// arguments and environment under the default stack limit.
pub const ENVIRON_MAX_BYTES: u64 = 4 << 20;

/// Why a `/proc` file was not read.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// It could not be opened or read (the process is gone, or the file is not readable).
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// It is longer than the cap: nothing of it is used.
    #[error(
        "{path} is longer than {cap} bytes, the most read of it (a process can make it as large as its memory)"
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The cap.
        cap: u64,
    },
}

/// Reads `/proc/<pid>/<file>` whole when it is at most `cap` bytes.
///
/// # Errors
/// [`ProcError::Io`] when it cannot be read, [`ProcError::TooLarge`] when it is longer than
/// `cap` (of which at most `cap + 1` bytes were read).
pub fn read(pid: u32, file: &str, cap: u64) -> Result<Vec<u8>, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/{file}"));
    let io = |source| ProcError::Io {
        path: path.clone(),
        source,
    };
    let opened = std::fs::File::open(&path).map_err(io)?;
    let mut bytes = Vec::new();
    opened
        .take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > cap {
        return Err(ProcError::TooLarge { path, cap });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child whose environment holds `size` bytes in one variable.
    fn child_with_env(size: usize) -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .env_clear()
            .env("BIG", "x".repeat(size))
            .spawn()
            .unwrap()
    }

    #[test]
    fn a_file_within_its_cap_is_read_whole() {
        let mut child = child_with_env(1000);
        let environ = read(child.id(), "environ", 4096).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(environ.len(), "BIG=".len() + 1000 + 1);
    }

    #[test]
    fn a_file_longer_than_its_cap_is_refused_naming_the_file_and_the_cap() {
        let mut child = child_with_env(100_000);
        let err = read(child.id(), "environ", 4096).unwrap_err();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            matches!(err, ProcError::TooLarge { cap: 4096, .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("/proc/{}/environ", child.id())) && text.contains("4096"),
            "{text}"
        );
    }

    #[test]
    fn a_process_that_is_gone_is_an_io_error() {
        let mut child = child_with_env(10);
        let pid = child.id();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(
            read(pid, "environ", 4096),
            Err(ProcError::Io { .. })
        ));
    }
}
