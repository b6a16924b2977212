//! Starting a helper program that must not outlive the thread that started it: CRIU and the
//! restore helper. The child gets exactly the descriptors the caller lays out, and
//! `PR_SET_PDEATHSIG`, so a SIGKILLed agent takes its CRIU (and, through the restore helper's
//! own children, the whole restore) with it instead of leaving it to finish unseen.
//!
//! # Caveats
//! The parent-death signal fires when the *thread* that spawned the child exits, not only the
//! process: spawn from a thread that outlives the child (the callers wait for the child on the
//! spawning thread).

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::signal::Signal;
use nix::unistd::{ForkResult, Pid};

/// The most descriptors one spawn lays out (the child has no allocator to count more).
const MAX_FDS: usize = 64;

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
    /// The most bytes the child may write into any one file (the soft `RLIMIT_FSIZE`; the hard
    /// limit is left as it is, so what the child starts can raise it again, as a restored tree
    /// restoring its own limits does).
    pub file_size_limit: Option<u64>,
}

/// Starts `spec.program`; returns its PID. The caller must reap it (`waitpid`).
///
/// Every descriptor of this process that is not laid out is closed in the child, including
/// inherited ones without close-on-exec; the child starts with no blocked signals and SIGPIPE
/// at its default, as from a shell.
///
/// # Errors
/// The program could not be started (its `execve` errno), or this process died while it was
/// being started.
pub fn spawn(spec: &SpawnSpec<'_>) -> io::Result<Pid> {
    let program = c_string(spec.program.as_os_str())?;
    let mut argv = vec![program.clone()];
    for arg in spec.args {
        argv.push(c_string(arg)?);
    }
    let envp: Vec<CString> = std::env::vars_os()
        .filter_map(|(key, value)| {
            let mut entry = key.as_bytes().to_vec();
            entry.push(b'=');
            entry.extend_from_slice(value.as_bytes());
            CString::new(entry).ok()
        })
        .collect();
    let argv_ptrs = null_terminated(&argv);
    let envp_ptrs = null_terminated(&envp);
    if spec.fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("at most {MAX_FDS} descriptors can be laid out"),
        ));
    }
    let layout: Vec<(RawFd, RawFd)> = spec
        .fds
        .iter()
        .map(|(fd, target)| (fd.as_raw_fd(), *target))
        .collect();
    let strays: Vec<RawFd> = inheritable_fds()
        .into_iter()
        .filter(|fd| *fd > 2 && !layout.iter().any(|&(source, _)| source == *fd))
        .collect();
    let above_layout = layout
        .iter()
        .flat_map(|&(source, target)| [source, target])
        .max()
        .unwrap_or(2)
        .max(2)
        + 1;
    // The exec-error pipe sits above every number the child lays out, so placing the
    // descriptors cannot overwrite it; close-on-exec makes a successful exec close it.
    let (read_end, write_end) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let report = dup_cloexec_above(&write_end, above_layout)?;
    drop(write_end);
    let child = ChildPlan {
        strays: &strays,
        layout: &layout,
        staging_base: report.as_raw_fd() + 1,
        has_stdin: layout.iter().any(|&(_, target)| target == 0),
        death: spec.parent_death_signal.map(|s| s as libc::c_int),
        parent: nix::unistd::getpid().as_raw(),
        file_size: file_size_limit(spec.file_size_limit)?,
        program: &program,
        argv: &argv_ptrs,
        envp: &envp_ptrs,
        report: report.as_raw_fd(),
    };

    // SAFETY: the child runs only async-signal-safe system calls ([`ChildPlan::exec`]) on values
    // prepared before the fork, allocates nothing and never returns into Rust code; this is
    // what `std::process::Command` does between fork and exec.
    match unsafe { nix::unistd::fork() }? {
        // SAFETY: in the child of a fork, as `exec` requires.
        ForkResult::Child => unsafe { child.exec() },
        ForkResult::Parent { child } => {
            drop(report);
            exec_outcome(child, read_end)
        }
    }
}

/// The pointers of `strings`, then a null pointer, as `execve` takes its vectors.
fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// The child's `RLIMIT_FSIZE`: `limit`, within this process's hard limit.
fn file_size_limit(limit: Option<u64>) -> io::Result<Option<libc::rlimit>> {
    let Some(limit) = limit else {
        return Ok(None);
    };
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the value it is handed, which lives for the
    // call.
    if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &raw mut current) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(libc::rlimit {
        rlim_cur: limit.min(current.rlim_max),
        rlim_max: current.rlim_max,
    }))
}

/// Everything the child does between fork and exec, prepared in the parent.
struct ChildPlan<'a> {
    strays: &'a [RawFd],
    layout: &'a [(RawFd, RawFd)],
    staging_base: RawFd,
    has_stdin: bool,
    death: Option<libc::c_int>,
    parent: libc::pid_t,
    file_size: Option<libc::rlimit>,
    program: &'a CString,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    report: RawFd,
}

impl ChildPlan<'_> {
    /// Lays out the descriptors, resets the signal mask and SIGPIPE, sets the parent-death
    /// signal and the file size limit, and execs; on any failure writes the errno to the report
    /// pipe and exits 127.
    ///
    /// # Safety
    /// Call only in the child of a fork, of a parent that prepared `self`: it runs only
    /// async-signal-safe system calls (close, fcntl, dup2, open, sigprocmask, signal, prctl,
    /// getppid, setrlimit, execve, write, _exit), allocates nothing and never returns.
    unsafe fn exec(&self) -> ! {
        // SAFETY: see above; every pointer handed to the kernel outlives the call (they point
        // into vectors of the parent's copy of memory, which the child shares).
        unsafe {
            for stray in self.strays {
                libc::close(*stray);
            }
            let mut failed = !self.lay_out();
            if !failed && !self.has_stdin {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
                if null < 0 || (null != 0 && libc::dup2(null, 0) < 0) {
                    failed = true;
                } else if null != 0 {
                    libc::close(null);
                }
            }
            if !failed {
                let mut empty: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&raw mut empty);
                libc::sigprocmask(libc::SIG_SETMASK, &raw const empty, std::ptr::null_mut());
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                if let Some(signal) = self.death {
                    let arg = libc::c_ulong::try_from(signal).unwrap_or(9);
                    if libc::prctl(libc::PR_SET_PDEATHSIG, arg, 0, 0, 0) < 0
                        || libc::getppid() != self.parent
                    {
                        failed = true;
                    }
                }
            }
            if !failed
                && let Some(limit) = &self.file_size
                && libc::setrlimit(libc::RLIMIT_FSIZE, limit) < 0
            {
                failed = true;
            }
            if !failed {
                libc::execve(
                    self.program.as_ptr(),
                    self.argv.as_ptr(),
                    self.envp.as_ptr(),
                );
            }
            let errno = *libc::__errno_location();
            let bytes = errno.to_ne_bytes();
            libc::write(self.report, bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127)
        }
    }

    /// Puts every laid-out descriptor at its number; false when one cannot be.
    ///
    /// # Safety
    /// As [`Self::exec`]: in the forked child only.
    unsafe fn lay_out(&self) -> bool {
        // SAFETY: fcntl, dup2 and close on descriptor numbers only; nothing is allocated.
        unsafe {
            let mut staging = self.staging_base;
            // Copy every source above every number in use first (F_DUPFD takes the lowest free
            // number at or above the base), then move the copies into place.
            let mut copies = [0 as RawFd; MAX_FDS];
            for (i, &(source, _)) in self.layout.iter().enumerate().take(copies.len()) {
                let copy = libc::fcntl(source, libc::F_DUPFD, staging);
                if copy < 0 {
                    return false;
                }
                copies[i] = copy;
                staging = copy + 1;
            }
            for (i, &(_, target)) in self.layout.iter().enumerate().take(copies.len()) {
                if libc::dup2(copies[i], target) < 0 {
                    return false;
                }
                libc::close(copies[i]);
            }
            true
        }
    }
}

/// Waits for the exec: the report pipe closes on success (close-on-exec) or carries the
/// child's errno, in which case the child is reaped and the errno returned.
fn exec_outcome(child: Pid, read_end: OwnedFd) -> io::Result<Pid> {
    let mut buf = [0_u8; 4];
    let mut read = 0;
    let mut reader = std::fs::File::from(read_end);
    while read < buf.len() {
        match std::io::Read::read(&mut reader, &mut buf[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if read == 0 {
        return Ok(child);
    }
    // The child failed before or at exec: reap it and report its errno.
    let _ = nix::sys::wait::waitpid(child, None);
    let errno = i32::from_ne_bytes(buf);
    Err(if errno == 0 {
        io::Error::other("the spawned process could not set up its descriptors")
    } else {
        io::Error::from_raw_os_error(errno)
    })
}

fn dup_cloexec_above(fd: &OwnedFd, min: RawFd) -> io::Result<OwnedFd> {
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(min))?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn c_string(value: &OsStr) -> io::Result<CString> {
    CString::new(value.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} contains a NUL byte", value.to_string_lossy()),
        )
    })
}

/// Sets this process's parent-death signal and checks that its parent is still `expected`
/// (for a forked child: the process that forked it; `Pid 0` for a child forked into another
/// PID namespace, where its parent has no PID: it would read as 1, the namespace's init, once
/// reparented).
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

/// Asks the kernel to SIGKILL a `std::process::Command`'s child when the spawning thread exits
/// (`PR_SET_PDEATHSIG`); the caller must wait for the child on that same thread. For helpers
/// that need no descriptor layout (the CUDA call helper).
pub fn kill_with_parent(command: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls `prctl`, which
    // is async-signal-safe and touches no memory of the parent; it allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    }
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
            file_size_limit: None,
        })
        .unwrap();
        drop(write);
        let mut listed = String::new();
        read.read_to_string(&mut listed).unwrap();
        assert!(matches!(
            waitpid(pid, None).unwrap(),
            WaitStatus::Exited(_, 0)
        ));
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
                file_size_limit: None,
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
            file_size_limit: None,
        });
        assert!(missing.is_err());
    }

    #[test]
    fn the_childs_writes_stop_at_its_file_size_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("log");
        let script = format!("head -c 1000000 /dev/zero > {}", file.display());
        let pid = spawn(&SpawnSpec {
            program: Path::new("/bin/sh"),
            args: &[OsStr::new("-c"), OsStr::new(&script)],
            fds: &[],
            parent_death_signal: None,
            file_size_limit: Some(4096),
        })
        .unwrap();
        waitpid(pid, None).unwrap();
        assert_eq!(std::fs::metadata(&file).unwrap().len(), 4096);
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

    #[test]
    #[allow(clippy::zombie_processes)] // reaped below with waitpid, by PID
    fn a_command_child_is_killed_when_its_spawning_thread_exits() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let child = kill_with_parent(std::process::Command::new("sleep").arg("1000"))
                .spawn()
                .unwrap();
            tx.send(child.id()).unwrap();
            // The thread ends here without waiting: the kernel kills the child.
        })
        .join()
        .unwrap();
        let pid = rx.recv().unwrap();
        let status = nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            None,
        )
        .unwrap();
        assert!(
            matches!(
                status,
                nix::sys::wait::WaitStatus::Signaled(_, nix::sys::signal::Signal::SIGKILL, _)
            ),
            "{status:?}"
        );
    }
}
