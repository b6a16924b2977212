//! Starting a helper program that must not outlive the thread that started it: CRIU and the
//! restore helper. The child gets exactly the descriptors the caller lays out, and
//! `PR_SET_PDEATHSIG`, so a SIGKILLed agent takes its CRIU (and, through the restore helper's
//! own children, the whole restore) with it instead of leaving it to finish unseen.
//!
//! # Caveats
//! The parent-death signal fires when the *thread* that spawned the child exits, not only the
//! process: spawn from a thread that outlives the child (the callers wait for the child on the
//! spawning thread).

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// What to start and with which descriptors.
#[derive(Debug)]
pub struct SpawnSpec<'a> {
    /// The program (a path, used as given).
    pub program: &'a Path,
    /// Its arguments (without the program name).
    pub args: &'a [&'a OsStr],
    /// `(descriptor here, number in the child)`; standard input is `/dev/null` unless laid out.
    pub fds: &'a [(BorrowedFd<'a>, RawFd)],
    /// Signal the child gets when the spawning thread dies.
    pub parent_death_signal: Option<Signal>,
}

/// Starts `spec.program`; returns its PID. The caller must reap it (`waitpid`).
///
/// Every descriptor of this process that is not laid out is closed in the child, including
/// inherited ones without close-on-exec.
///
/// # Errors
/// The program could not be started, or this process died while it was being started.
pub fn spawn(spec: &SpawnSpec<'_>) -> io::Result<Pid> {
    let layout: Vec<(RawFd, RawFd)> = spec
        .fds
        .iter()
        .map(|(fd, target)| (fd.as_raw_fd(), *target))
        .collect();
    let high = layout
        .iter()
        .flat_map(|&(source, target)| [source, target])
        .max()
        .unwrap_or(2)
        .max(2)
        + 1;
    let strays: Vec<RawFd> = inheritable_fds()
        .into_iter()
        .filter(|fd| *fd > 2 && !layout.iter().any(|&(source, _)| source == *fd))
        .collect();
    let death = spec.parent_death_signal;
    let parent = nix::unistd::getpid();
    let mut command = Command::new(spec.program);
    command
        .args(spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    let pre_exec = move || -> io::Result<()> {
        // Runs between fork and exec: only async-signal-safe calls, no allocation.
        for stray in &strays {
            // SAFETY: closing a descriptor number is async-signal-safe; the numbers were
            // listed before the fork and belong to no Rust object in this child that will
            // run again (the child only execs or exits).
            unsafe { libc::close(*stray) };
        }
        // Copy every source above every source and target first, so that moving them into
        // place cannot overwrite a source still needed.
        for (staging, &(source, _)) in (high..).zip(layout.iter()) {
            // SAFETY: dup2 on two plain descriptor numbers is async-signal-safe.
            if unsafe { libc::dup2(source, staging) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        for (staging, &(_, target)) in (high..).zip(layout.iter()) {
            // SAFETY: as above; dup2 clears close-on-exec on `target`.
            if unsafe { libc::dup2(staging, target) } < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: the staging copy is ours alone.
            unsafe { libc::close(staging) };
        }
        if let Some(signal) = death {
            nix::sys::prctl::set_pdeathsig(signal).map_err(io::Error::from)?;
            // The parent may have died before the prctl: then nobody would signal us.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::other("the spawning process died"));
            }
        }
        Ok(())
    };
    // SAFETY: the closure only makes async-signal-safe system calls (close, dup2, prctl,
    // getppid) on values captured before the fork, and allocates nothing.
    unsafe { command.pre_exec(pre_exec) };
    let child = command.spawn()?;
    let pid = Pid::from_raw(i32::try_from(child.id()).map_err(io::Error::other)?);
    // `Child` only owns the PID (no pipes); the caller reaps it by PID.
    drop(child);
    Ok(pid)
}

/// Sets this process's parent-death signal and checks that its parent is still `expected`
/// (for a forked child: the process that forked it).
///
/// # Errors
/// `prctl` failed, or the parent is already gone.
pub fn die_with_parent(expected: Pid) -> io::Result<()> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
    if nix::unistd::getppid() == expected {
        Ok(())
    } else {
        Err(io::Error::other("the parent process is gone"))
    }
}

/// Descriptors of this process without close-on-exec, from `/proc/self/fdinfo` (empty when
/// `/proc` cannot be read: the strays are then inherited, which the programs tolerate).
pub fn inheritable_fds() -> Vec<RawFd> {
    let Ok(entries) = std::fs::read_dir("/proc/self/fdinfo") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
        .filter(|fd| {
            std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
                .ok()
                .and_then(|info| {
                    let flags = info.lines().find_map(|line| line.strip_prefix("flags:"))?;
                    i64::from_str_radix(flags.trim(), 8).ok()
                })
                .is_some_and(|flags| flags & i64::from(libc::O_CLOEXEC) == 0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsFd;

    use nix::sys::wait::{WaitStatus, waitpid};

    use super::*;

    #[test]
    fn the_child_gets_exactly_the_laid_out_descriptors() {
        let (mut read, write) = std::io::pipe().unwrap();
        let (_stray_read, _stray_write) = nix::unistd::pipe().unwrap();
        let pid = spawn(&SpawnSpec {
            program: Path::new("/bin/sh"),
            args: &[OsStr::new("-c"), OsStr::new("ls /proc/self/fd >&5")],
            fds: &[(write.as_fd(), 5)],
            parent_death_signal: Some(Signal::SIGKILL),
        })
        .unwrap();
        drop(write);
        let mut listed = String::new();
        read.read_to_string(&mut listed).unwrap();
        assert!(matches!(waitpid(pid, None).unwrap(), WaitStatus::Exited(_, 0)));
        let mut fds: Vec<i32> = listed
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        fds.sort_unstable();
        // 0-2, 5, and the directory `ls` itself opened (the lowest free number, 3): the
        // stray pipe without close-on-exec is not inherited.
        assert_eq!(fds, [0, 1, 2, 3, 5], "{listed}");
    }

    #[test]
    fn the_child_dies_with_the_thread_that_started_it() {
        let pid = std::thread::spawn(|| {
            spawn(&SpawnSpec {
                program: Path::new("/bin/sleep"),
                args: &[OsStr::new("1000")],
                fds: &[],
                parent_death_signal: Some(Signal::SIGKILL),
            })
            .unwrap()
        })
        .join()
        .unwrap();
        // The spawning thread has exited: the kernel sent the child its parent-death signal.
        assert_eq!(
            waitpid(pid, None).unwrap(),
            WaitStatus::Signaled(pid, Signal::SIGKILL, false)
        );
        let missing = spawn(&SpawnSpec {
            program: Path::new("/nonexistent/warmstart-program"),
            args: &[],
            fds: &[],
            parent_death_signal: None,
        });
        assert!(missing.is_err());
    }

    #[test]
    fn inheritable_fds_lists_descriptors_without_cloexec_only() {
        let (plain_read, plain_write) = nix::unistd::pipe().expect("pipe");
        let (cloexec_read, _cloexec_write) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe2");
        let fds = inheritable_fds();
        assert!(fds.contains(&plain_read.as_raw_fd()), "{fds:?}");
        assert!(fds.contains(&plain_write.as_raw_fd()), "{fds:?}");
        assert!(!fds.contains(&cloexec_read.as_raw_fd()), "{fds:?}");
    }
}
