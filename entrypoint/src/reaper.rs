//! Reaping children when this process is a container's PID 1 (or a subreaper) and probe
//! threads wait for their own children too.
//!
//! PID 1 must `waitpid(-1)`, or orphans stay zombies; but a plain `waitpid(-1)` would steal the
//! exit status of an `exec` probe's child from the thread waiting for it. So children that
//! somebody waits for are spawned through the [`Reaper`], registered under its lock before the
//! main loop can reap them, and their status is parked for their waiter. Everything else the
//! main loop reaps is handed back to it.

use std::collections::HashMap;
use std::io;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// How often a waiter looks for its child when nobody else reaps (unit tests, no main loop).
const SELF_REAP_INTERVAL: Duration = Duration::from_millis(10);

/// Parks the exit status of registered children for the threads that wait for them.
#[derive(Debug, Default)]
pub struct Reaper {
    /// Registered children: `None` while running, the status once reaped.
    children: Mutex<HashMap<i32, Option<WaitStatus>>>,
    reaped: Condvar,
}

impl Reaper {
    /// A reaper with no registered child.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<i32, Option<WaitStatus>>> {
        self.children.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a child with `start` and registers its pid before anyone can reap it.
    ///
    /// # Errors
    /// What `start` returned.
    pub fn spawn(&self, start: impl FnOnce() -> io::Result<Pid>) -> io::Result<Pid> {
        let mut children = self.lock();
        let pid = start()?;
        children.insert(pid.as_raw(), None);
        Ok(pid)
    }

    /// Waits up to `timeout` for the registered child `pid`; `None` when it is still running.
    /// The child is forgotten once its status is returned.
    pub fn wait_timeout(&self, pid: Pid, timeout: Duration) -> Option<WaitStatus> {
        let deadline = Instant::now() + timeout;
        let mut children = self.lock();
        loop {
            if let Some(Some(status)) = children.get(&pid.as_raw()) {
                let status = *status;
                children.remove(&pid.as_raw());
                return Some(status);
            }
            // Reap it ourselves too: the main loop may not run (or not yet have seen SIGCHLD).
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::EINTR) => {}
                Ok(status @ (WaitStatus::Exited(..) | WaitStatus::Signaled(..))) => {
                    children.remove(&pid.as_raw());
                    return Some(status);
                }
                Ok(_) => {}
                // Not our child (any more): it was reaped elsewhere without being parked.
                Err(_) => {
                    children.remove(&pid.as_raw());
                    return Some(WaitStatus::Exited(pid, -1));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            children = self
                .reaped
                .wait_timeout(children, left.min(SELF_REAP_INTERVAL))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Reaps every child that has ended (`waitpid(-1, WNOHANG)` until none is left), parks the
    /// status of registered ones and returns the others.
    pub fn reap(&self) -> Vec<WaitStatus> {
        let mut children = self.lock();
        let mut others = Vec::new();
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                Err(Errno::EINTR) => {}
                Err(_) => break,
                Ok(status @ (WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _))) => {
                    match children.get_mut(&pid.as_raw()) {
                        Some(slot) => *slot = Some(status),
                        None => others.push(status),
                    }
                }
                Ok(_) => {}
            }
        }
        self.reaped.notify_all();
        others
    }
}

/// The exit code a shell would report for `status`: the code, or 128 + the signal number.
pub fn exit_code(status: WaitStatus) -> i32 {
    match status {
        WaitStatus::Exited(_, code) => code,
        WaitStatus::Signaled(_, signal, _) => 128 + signal as i32,
        _ => 1,
    }
}

/// Held by every unit test that starts children: one that calls [`Reaper::reap`]
/// (`waitpid(-1)`) would otherwise reap the children of tests running beside it.
#[cfg(test)]
pub(crate) static CHILDREN_LOCK: Mutex<()> = Mutex::new(());

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::process::Command;

    use super::*;

    fn start(command: &mut Command) -> io::Result<Pid> {
        let child = command.spawn()?;
        Ok(Pid::from_raw(i32::try_from(child.id()).unwrap()))
    }

    #[test]
    fn a_registered_child_is_waited_for_even_when_the_main_loop_reaps_it() {
        let _serial = CHILDREN_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let reaper = Reaper::new();
        let pid = reaper
            .spawn(|| start(Command::new("/bin/sh").args(["-c", "exit 7"])))
            .unwrap();
        // The main loop reaps first: the status is parked, not lost.
        let mut others = Vec::new();
        while reaper.lock().get(&pid.as_raw()) == Some(&None) {
            others.extend(reaper.reap());
            std::thread::sleep(SELF_REAP_INTERVAL);
        }
        assert!(others.iter().all(|s| s.pid() != Some(pid)), "{others:?}");
        let status = reaper.wait_timeout(pid, Duration::from_secs(5)).unwrap();
        assert_eq!(exit_code(status), 7);
    }

    #[test]
    fn a_waiter_reaps_by_itself_and_reports_a_running_child() {
        let _serial = CHILDREN_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let reaper = Reaper::new();
        let pid = reaper
            .spawn(|| start(Command::new("/bin/sh").args(["-c", "kill -TERM $$"])))
            .unwrap();
        let status = reaper.wait_timeout(pid, Duration::from_secs(5)).unwrap();
        assert_eq!(exit_code(status), 128 + 15);
        let sleeper = reaper
            .spawn(|| start(Command::new("/bin/sleep").arg("5")))
            .unwrap();
        assert_eq!(reaper.wait_timeout(sleeper, Duration::ZERO), None);
        nix::sys::signal::kill(sleeper, nix::sys::signal::Signal::SIGKILL).unwrap();
        let status = reaper
            .wait_timeout(sleeper, Duration::from_secs(5))
            .unwrap();
        assert_eq!(exit_code(status), 128 + 9);
    }
}
