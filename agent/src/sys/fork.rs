//! `fork(2)` for the restore helper. Forking a multi-threaded process is unsound (only the
//! calling thread survives in the child, with other threads' locks possibly held), so the
//! wrapper refuses unless the process has exactly one thread.

use std::io;

use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid};

/// Which side of a fork we are on.
#[derive(Debug)]
pub enum Forked {
    /// The child.
    Child,
    /// The parent, with the child's PID.
    Parent(Pid),
}

/// Number of threads of this process, from `/proc/self/status`.
fn thread_count() -> io::Result<usize> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| io::Error::other("no Threads: line in /proc/self/status"))
}

/// Forks this process.
///
/// # Errors
/// Refuses (`io::ErrorKind::Unsupported`) when the process has more than one thread; the
/// errno of `fork` otherwise.
pub fn fork() -> io::Result<Forked> {
    let threads = thread_count()?;
    if threads != 1 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("refusing to fork a process with {threads} threads"),
        ));
    }
    // SAFETY: the process is single-threaded (checked just above, and nothing in this call
    // path spawns threads), so the child gets a consistent copy of every lock and allocator
    // state; the child only runs ordinary Rust code and leaves through `exit_child`.
    match unsafe { nix::unistd::fork() } {
        Ok(ForkResult::Child) => Ok(Forked::Child),
        Ok(ForkResult::Parent { child }) => Ok(Forked::Parent(child)),
        Err(errno) => Err(io::Error::from(errno)),
    }
}

/// Waits for a child and returns its exit code (128 + signal when killed).
///
/// # Errors
/// The errno of `waitpid`.
pub fn wait(child: Pid) -> io::Result<i32> {
    loop {
        match waitpid(child, None).map_err(io::Error::from)? {
            WaitStatus::Exited(_, code) => return Ok(code),
            WaitStatus::Signaled(_, signal, _) => return Ok(128 + signal as i32),
            _ => {}
        }
    }
}

/// Ends a forked child without running the parent's exit handlers or destructors twice.
pub fn exit_child(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` is async-signal-safe and takes no pointers; it ends the child at once,
    // which is what a forked child that shares the parent's buffered state must do.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multi_threaded_process_is_not_forked() {
        // The test harness runs tests on worker threads, so this process has several.
        let keep = std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(200)));
        let err = fork().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::Unsupported);
        assert!(err.to_string().contains("threads"));
        keep.join().unwrap();
    }
}
