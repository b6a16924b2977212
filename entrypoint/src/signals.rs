//! Signals as data: the forwarded signals and SIGCHLD are blocked in every thread and read
//! from a signalfd, so the main loop handles them without handlers, also as a PID 1 (a
//! namespace's init gets a signal only if it has a handler, or has it blocked) and also when
//! restored by CRIU (which restores the signalfd and the mask).

use std::os::fd::AsFd;
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// Signals passed on to the supervised process.
pub const FORWARDED: [Signal; 6] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// The blocked signals and the signalfd that reads them.
#[derive(Debug)]
pub struct Signals {
    fd: SignalFd,
}

impl Signals {
    /// Blocks [`FORWARDED`] and SIGCHLD in the calling thread (and every thread it starts
    /// afterwards) and opens a signalfd for them. Call it before starting any thread.
    /// Children started with `std::process::Command` get an empty mask again.
    ///
    /// # Errors
    /// The mask or the signalfd cannot be set up.
    pub fn install() -> nix::Result<Self> {
        let mut set = SigSet::empty();
        for signal in FORWARDED {
            set.add(signal);
        }
        set.add(Signal::SIGCHLD);
        pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None)?;
        let fd = SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)?;
        Ok(Self { fd })
    }

    /// Waits up to `timeout` for a signal, then returns every pending one (SIGCHLD included).
    pub fn wait(&self, timeout: Duration) -> Vec<Signal> {
        let millis = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(millis)) {
            Ok(_) | Err(Errno::EINTR) => {}
            // A broken poll must not spin: fall back to sleeping.
            Err(_) => std::thread::sleep(timeout),
        }
        let mut signals = Vec::new();
        while let Ok(Some(info)) = self.fd.read_signal() {
            if let Ok(signal) = i32::try_from(info.ssi_signo)
                .map_err(|_| Errno::EINVAL)
                .and_then(Signal::try_from)
            {
                signals.push(signal);
            }
        }
        signals
    }
}
