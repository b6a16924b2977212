//! Child processes that die with the thread that started them, so a helper blocked in a
//! driver call never outlives an agent that crashed while waiting for it.

use std::process::Command;

/// Asks the kernel to SIGKILL the child when the spawning thread exits
/// (`PR_SET_PDEATHSIG`); the caller must wait for the child on that same thread.
pub fn kill_with_parent(command: &mut Command) -> &mut Command {
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
    use super::*;

    #[test]
    #[allow(clippy::zombie_processes)] // reaped below with waitpid, by PID
    fn the_child_is_killed_when_its_spawning_thread_exits() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let child = kill_with_parent(Command::new("sleep").arg("1000"))
                .spawn()
                .unwrap();
            tx.send(child.id()).unwrap();
            // The thread ends here without waiting: the kernel kills the child.
        })
        .join()
        .unwrap();
        let pid = rx.recv().unwrap();
        // The child is (or is about to be) killed; it stays a zombie of this process until
        // reaped, so wait for it through waitpid.
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
