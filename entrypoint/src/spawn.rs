//! Starting programs with a clean signal state.
//!
//! The entrypoint blocks the signals it forwards (see [`crate::signals`]) and the Rust runtime
//! ignores SIGPIPE; both are inherited across `exec`, and `std::process::Command` does not
//! reset the mask on every path. A server started with SIGTERM blocked never stops, so
//! children are started with `posix_spawnp` and an explicit empty mask and default
//! dispositions.

use std::ffi::{CString, OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::spawn::{PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags, posix_spawnp};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::stat::Mode;
use nix::unistd::Pid;

/// What to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnSpec {
    /// argv; `argv[0]` is looked up in `PATH` when it has no `/`.
    pub argv: Vec<OsString>,
    /// Variables removed from this process's environment for the child.
    pub unset: Vec<String>,
    /// stdin, stdout and stderr on `/dev/null` (probes) instead of inherited (the server).
    pub null_stdio: bool,
}

fn cstring(bytes: &[u8]) -> Result<CString, Errno> {
    CString::new(bytes).map_err(|_| Errno::EINVAL)
}

/// Starts `spec` with an empty signal mask and every signal at its default disposition.
///
/// # Errors
/// An argument or variable with a NUL byte (`EINVAL`), an empty argv, or `posix_spawnp`'s
/// error (`ENOENT` for a missing program, `EACCES`, …).
pub fn spawn(spec: &SpawnSpec) -> Result<Pid, Errno> {
    let program = spec.argv.first().ok_or(Errno::EINVAL)?;
    let argv = spec
        .argv
        .iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<Result<Vec<_>, _>>()?;
    let env = std::env::vars_os()
        .filter(|(k, _)| !spec.unset.iter().any(|u| OsStr::new(u) == k))
        .map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            cstring(&kv)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut attr = PosixSpawnAttr::init()?;
    attr.set_flags(
        PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF,
    )?;
    attr.set_sigmask(&SigSet::empty())?;
    let mut defaults = SigSet::empty();
    for signal in Signal::iterator().filter(|s| !matches!(s, Signal::SIGKILL | Signal::SIGSTOP)) {
        defaults.add(signal);
    }
    attr.set_sigdefault(&defaults)?;
    let mut actions = PosixSpawnFileActions::init()?;
    if spec.null_stdio {
        for fd in 0..3 {
            let flags = if fd == 0 {
                OFlag::O_RDONLY
            } else {
                OFlag::O_WRONLY
            };
            actions.add_open(fd, "/dev/null", flags, Mode::empty())?;
        }
    }
    posix_spawnp(&cstring(program.as_bytes())?, &actions, &attr, &argv, &env)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::PoisonError;
    use std::time::Duration;

    use super::*;
    use crate::reaper::{CHILDREN_LOCK, Reaper, exit_code};
    use crate::signals::Signals;

    #[test]
    fn children_start_with_no_blocked_or_ignored_signal_and_without_unset_variables() {
        let _serial = CHILDREN_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        // Block like the entrypoint does (this test thread only).
        let _signals = Signals::install().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("status");
        let script = format!(
            "grep -E '^Sig(Blk|Ign)' /proc/self/status > {0}; echo \"x=${{HOME-unset}}\" >> {0}",
            out.display()
        );
        let spec = SpawnSpec {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            unset: vec!["HOME".to_owned()],
            null_stdio: true,
        };
        let reaper = Reaper::new();
        let pid = reaper
            .spawn(|| spawn(&spec).map_err(std::io::Error::from))
            .unwrap();
        let status = reaper.wait_timeout(pid, Duration::from_secs(10)).unwrap();
        assert_eq!(exit_code(status), 0);
        let text = std::fs::read_to_string(out).unwrap();
        assert!(text.contains("SigBlk:\t0000000000000000"), "{text}");
        // Standard signals only: glibc keeps its two internal real-time signals to itself.
        let ignored = text
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:\t"))
            .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
            .unwrap();
        assert_eq!(ignored & 0x7fff_ffff, 0, "{text}");
        assert!(text.contains("x=unset"), "{text}");
        let missing = SpawnSpec {
            argv: vec!["/does/not/exist".into()],
            unset: Vec::new(),
            null_stdio: true,
        };
        assert_eq!(spawn(&missing), Err(Errno::ENOENT));
    }
}
