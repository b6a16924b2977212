//! Loopback ports handed to the programs the tests start.
//!
//! A port found by binding `127.0.0.1:0` and closing the socket is in the kernel's ephemeral
//! range, the same range every outgoing connection takes its source port from: between the
//! close and the child's own bind, a client connection of any parallel test (an API server
//! talking to its etcd) can take it, and the child fails with "address already in use". So
//! ports come from below the ephemeral range, which the kernel never hands out by itself, and
//! each is reserved for the test processes of this machine's user by an exclusive `flock` held for the
//! life of the process that took it, and for that process by a set of the ports it gave out.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};

/// The lowest port handed out: above the well-known and most registered services' ports.
const LOWEST: u16 = 20000;
/// How many ports a range must offer to be used.
const ENOUGH: u16 = 1000;

/// Why no port could be reserved.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// The lock directory could not be made or a lock file opened.
    #[error("{path}: {source}")]
    Lock {
        /// The directory or file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Every candidate is taken.
    #[error("no free loopback port in {0:?}: every one is reserved or bound")]
    Exhausted(std::ops::Range<u16>),
}

/// Locks held, and ports given out, by this process; never released before it exits, so a
/// port is never handed out twice while a program of this process may still listen on it.
static RESERVED: Mutex<Reservations> = Mutex::new(Reservations {
    given: Vec::new(),
    locks: Vec::new(),
});

/// Ports given out and the locks that keep them.
struct Reservations {
    given: Vec<u16>,
    locks: Vec<Flock<File>>,
}

impl Reservations {
    /// The first of `candidates` not given out here, not locked in `dir` by another process and
    /// not bound by anyone.
    fn take(
        &mut self,
        dir: &Path,
        candidates: impl IntoIterator<Item = u16>,
    ) -> Result<Option<u16>, PortError> {
        std::fs::create_dir_all(dir).map_err(|source| PortError::Lock {
            path: dir.to_owned(),
            source,
        })?;
        for port in candidates {
            if self.given.contains(&port) {
                continue;
            }
            let path = dir.join(format!("{port}.lock"));
            let file = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|source| PortError::Lock { path, source })?;
            let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
                continue;
            };
            // A program left over from an earlier run may still listen there.
            if TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            self.given.push(port);
            self.locks.push(lock);
            return Ok(Some(port));
        }
        Ok(None)
    }
}

/// The ports to pick from: below the ephemeral range when that leaves [`ENOUGH`] of them, else
/// above it.
fn candidates() -> std::ops::Range<u16> {
    let (low, high) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut fields = text.split_whitespace().map(str::parse::<u16>);
            Some((fields.next()?.ok()?, fields.next()?.ok()?))
        })
        .unwrap_or((32768, 60999));
    if low.saturating_sub(LOWEST) >= ENOUGH {
        LOWEST..low
    } else {
        high.saturating_add(1)..u16::MAX
    }
}

/// One directory per user: another user's lock files are not this user's to open.
fn lock_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "warmstart-test-ports-{}",
        nix::unistd::getuid().as_raw()
    ))
}

/// A loopback port no other test process of this machine holds and nothing listens on, kept
/// for this process until it exits.
///
/// # Errors
/// An unusable lock directory, or no candidate left.
pub fn reserve() -> Result<u16, PortError> {
    let range = candidates();
    // Start where the process id points and stride by a prime, so that parallel processes
    // rarely try the same ports.
    let span = u32::from(range.end - range.start);
    let start = std::process::id() % span;
    let order = (0..span).filter_map(|step| {
        let offset = u16::try_from((start + step * 7919) % span).ok()?;
        Some(range.start + offset)
    });
    RESERVED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take(&lock_dir(), order)?
        .ok_or(PortError::Exhausted(range))
}

/// [`reserve`] as a loopback socket address.
///
/// # Errors
/// As [`reserve`].
pub fn reserve_addr() -> Result<SocketAddr, PortError> {
    reserve().map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let range = candidates();
        let ports: Vec<u16> = (0..50).map(|_| reserve().unwrap()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        for port in &ports {
            assert!(range.contains(port), "{port} is outside {range:?}");
            TcpListener::bind(("127.0.0.1", *port)).unwrap();
        }
    }

    #[test]
    fn a_port_locked_by_another_process_or_bound_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        // Three ports nobody else uses: this process's own reservations.
        let ports: Vec<u16> = (0..3).map(|_| reserve().unwrap()).collect();
        let locked = dir.path().join(format!("{}.lock", ports[0]));
        std::fs::write(&locked, "").unwrap();
        let mut holder = std::process::Command::new("flock")
            .arg(&locked)
            .args(["sleep", "30"])
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while let Ok(free) = Flock::lock(
            File::options().write(true).open(&locked).unwrap(),
            FlockArg::LockExclusiveNonblock,
        ) {
            drop(free);
            assert!(
                std::time::Instant::now() < deadline,
                "flock never took the lock"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let listening = TcpListener::bind(("127.0.0.1", ports[1])).unwrap();

        let mut fresh = Reservations {
            given: Vec::new(),
            locks: Vec::new(),
        };
        let first = fresh.take(dir.path(), ports.clone()).unwrap();
        let second = fresh.take(dir.path(), ports.clone()).unwrap();
        let _ = holder.kill();
        let _ = holder.wait();
        drop(listening);
        assert_eq!(
            first,
            Some(ports[2]),
            "the locked and the bound port are passed over"
        );
        assert_eq!(second, None, "a port is handed out once");
    }
}
