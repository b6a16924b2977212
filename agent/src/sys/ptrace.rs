//! Waking one thread of a stopped process, and only that one: what a CUDA restore needs
//! while the restored tree stays stopped (the driver's restore thread does the work of
//! `cuCheckpointProcessRestore`, so it must run while the application's threads must not,
//! since their access to device-backed memory would fault before it is back).
//!
//! The thread is seized with `PTRACE_SEIZE`: a seized thread of a process in group-stop
//! enters a ptrace-stop, and `PTRACE_CONT` then runs that thread alone, the rest of the
//! group staying stopped. While it runs every signal but `SIGTRAP` is blocked on it, so no
//! signal of the application is handled on it meanwhile; [`Woken::stop`] interrupts it,
//! gives it back its signal mask and detaches, and the thread rejoins the group-stop (the
//! kernel re-arms it on detach while the group is stopped). This is the ptrace sequence
//! CRIU's CUDA plugin runs around its restore, on a tree it has seized itself.
//!
//! Every ptrace request of a tracee must come from the thread that seized it, so a
//! [`Woken`] cannot leave the thread that made it (`!Send`).

use std::io;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// How long a seized or interrupted thread may take to report its stop.
const STOP_DEADLINE: Duration = Duration::from_secs(10);

/// How long a thread seized in group-stop may take to report its trap.
const SEIZED_TRAP: Duration = Duration::from_millis(200);

/// The kernel's `sigset_t` as ptrace reads and writes it (64 signals on Linux).
type KernelSigset = u64;

/// Every signal blocked but `SIGTRAP` (and `SIGKILL`/`SIGSTOP`, which cannot be blocked).
const BLOCK_ALL_BUT_TRAP: KernelSigset = !(1 << (libc::SIGTRAP - 1));

/// One thread of a stopped process, seized and running alone.
#[derive(Debug)]
pub struct Woken {
    tid: Pid,
    /// Its signal mask before it was woken.
    mask: KernelSigset,
    stopped: bool,
    /// Bound to the seizing thread.
    _not_send: PhantomData<*const ()>,
}

fn ptrace(request: libc::c_uint, tid: Pid, addr: usize, data: usize) -> io::Result<libc::c_long> {
    Errno::clear();
    // SAFETY: every request made here (SEIZE, INTERRUPT, CONT, DETACH, SETOPTIONS,
    // GETSIGMASK, SETSIGMASK) takes integers, or for the two mask requests `addr` = the size
    // of the set and `data` = a pointer to a live `KernelSigset` of exactly that size, owned
    // by the caller for the duration of the call.
    let rc = unsafe {
        libc::ptrace(
            request,
            tid.as_raw(),
            addr as *mut libc::c_void,
            data as *mut libc::c_void,
        )
    };
    if rc == -1 && Errno::last_raw() != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

/// Waits (polling, for `within` at most) until seized thread `tid` reports a ptrace-stop;
/// `false` when it did not.
fn stopped_within(tid: Pid, within: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + within;
    loop {
        match waitpid(tid, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) => {
                return Err(io::Error::other(format!("thread {tid} ended")));
            }
            Ok(_) => return Ok(true),
            Err(errno) => return Err(io::Error::from(errno)),
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// [`stopped_within`] the deadline, or an error.
fn wait_stop(tid: Pid) -> io::Result<()> {
    if stopped_within(tid, STOP_DEADLINE)? {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("thread {tid} reported no stop within {STOP_DEADLINE:?}"),
    ))
}

fn mask_request(request: libc::c_uint, tid: Pid, mask: &mut KernelSigset) -> io::Result<()> {
    let size = std::mem::size_of::<KernelSigset>();
    ptrace(request, tid, size, std::ptr::from_mut(mask) as usize).map(drop)
}

/// Seizes thread `tid` (a host TID) of a stopped process and lets it alone run.
///
/// # Errors
/// The errno of the first ptrace request that failed (`EPERM` without the right to trace
/// it, `ESRCH` when it is gone), or a timeout when it never reported its stop; the thread is
/// detached again on every error after the seize.
pub fn wake_alone(tid: i32) -> io::Result<Woken> {
    let tid = Pid::from_raw(tid);
    ptrace(libc::PTRACE_SEIZE, tid, 0, 0)?;
    let mut woken = Woken {
        tid,
        mask: 0,
        stopped: true,
        _not_send: PhantomData,
    };
    // A thread seized in group-stop traps at once (the seize waits for that); only one that
    // was running is interrupted: a second trap request on a trapped thread would stay
    // pending and trap it again as soon as it is let go.
    if !stopped_within(tid, SEIZED_TRAP)? {
        ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0)?;
        wait_stop(tid)?;
    }
    mask_request(libc::PTRACE_GETSIGMASK, tid, &mut woken.mask)?;
    let mut block = BLOCK_ALL_BUT_TRAP;
    mask_request(libc::PTRACE_SETSIGMASK, tid, &mut block)?;
    ptrace(libc::PTRACE_CONT, tid, 0, 0)?;
    woken.stopped = false;
    Ok(woken)
}

impl Woken {
    /// Stops the thread again, gives it back its signal mask and detaches: it rejoins its
    /// process's group-stop.
    ///
    /// # Errors
    /// The errno of the request that failed (the thread is detached anyway when it can be).
    pub fn stop(mut self) -> io::Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> io::Result<()> {
        if !self.stopped {
            self.stopped = true;
            ptrace(libc::PTRACE_INTERRUPT, self.tid, 0, 0)?;
            wait_stop(self.tid)?;
        }
        let mut mask = self.mask;
        let restored = mask_request(libc::PTRACE_SETSIGMASK, self.tid, &mut mask);
        let detached = ptrace(libc::PTRACE_DETACH, self.tid, 0, 0).map(drop);
        // Detach once only, even when Drop follows an error.
        self.mask = 0;
        self.tid = Pid::from_raw(-1);
        restored.and(detached)
    }
}

impl Drop for Woken {
    fn drop(&mut self) {
        if self.tid.as_raw() > 0
            && let Err(err) = self.finish()
        {
            tracing::warn!(error = %err, "cannot stop a woken thread again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    /// `T` (stopped), `t` (traced) or a running state, of `pid`'s only thread.
    fn state(pid: u32) -> char {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.chars().next().unwrap()
    }

    fn wait_state(pid: u32, want: impl Fn(char) -> bool) -> char {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = state(pid);
            if want(s) {
                return s;
            }
            assert!(Instant::now() < deadline, "pid {pid} stays in state {s}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A shell that appends a line to `file` every few thousand turns of a loop while it runs
    /// (no child process: only its own thread does the work).
    fn ticking(file: &std::path::Path) -> Killed {
        Killed(
            Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "i=0; while :; do i=$((i + 1)); [ $((i % 5000)) = 0 ] && echo x >> {}; done",
                    file.display()
                ))
                .spawn()
                .unwrap(),
        )
    }

    fn signal(pid: u32, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(Pid::from_raw(i32::try_from(pid).unwrap()), signal).unwrap();
    }

    fn lines(file: &std::path::Path) -> usize {
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .count()
    }

    #[test]
    fn a_woken_thread_runs_alone_and_rejoins_the_group_stop() {
        if !crate::testing::root("tracing another process") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("ticks");
        let child = ticking(&file);
        let pid = child.0.id();
        wait_state(pid, |_| lines(&file) > 0);
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        wait_state(pid, |s| s == 'T');
        let before = lines(&file);

        let woken = wake_alone(i32::try_from(pid).unwrap()).unwrap();
        // It runs: its ticks go on while the process is in group-stop.
        let deadline = Instant::now() + Duration::from_secs(10);
        while lines(&file) < before + 3 {
            assert!(Instant::now() < deadline, "the woken thread does not run");
            std::thread::sleep(Duration::from_millis(5));
        }
        woken.stop().unwrap();
        // Back in the group-stop, untraced: no more ticks until SIGCONT.
        wait_state(pid, |s| s == 'T');
        let stopped_at = lines(&file);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            lines(&file),
            stopped_at,
            "it ran after it was stopped again"
        );
        assert_eq!(state(pid), 'T');
        signal(pid, nix::sys::signal::Signal::SIGCONT);
        let deadline = Instant::now() + Duration::from_secs(10);
        while lines(&file) <= stopped_at {
            assert!(Instant::now() < deadline, "SIGCONT did not resume it");
            std::thread::sleep(Duration::from_millis(5));
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(
            status.contains("TracerPid:\t0"),
            "still traced after stop: {status}"
        );
    }

    #[test]
    fn a_dropped_woken_thread_is_stopped_and_detached() {
        if !crate::testing::root("tracing another process") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("ticks");
        let child = ticking(&file);
        let pid = child.0.id();
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        wait_state(pid, |s| s == 'T');
        drop(wake_alone(i32::try_from(pid).unwrap()).unwrap());
        wait_state(pid, |s| s == 'T');
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert!(status.contains("TracerPid:\t0"), "{status}");
    }

    #[test]
    fn a_thread_that_is_not_there_is_an_error() {
        let err = wake_alone(i32::MAX).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH), "{err}");
    }
}
