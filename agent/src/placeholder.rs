//! Who owns a placeholder container: one restore per placeholder, and nothing restored
//! unseen.
//!
//! - The restore lock: an exclusive `flock` on the placeholder's root filesystem directory,
//!   held by the agent for the whole restore. It goes with the agent's death (as do the
//!   restore helper and CRIU, by their parent-death signal), so a held lock means a restore is
//!   in flight in a live agent.
//! - The restore claim (placeholders with a control directory): `restore-claim`, created once
//!   with `O_EXCL` before anything in the placeholder changes; the standby entrypoint races for
//!   the same file before a cold start. A claim whose agent is gone is recognised: the next
//!   attempt reports what it left (a restored tree, or nothing, in which case it writes
//!   `restore-failed` so the entrypoint can cold start) instead of restoring again.
//! - The restored tree: processes below the placeholder's init in a nested PID namespace.
//!   A placeholder holding one is never restored into again.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use warmstart_shared::names::{FILE_RESTORE_CLAIM, FILE_RESTORE_COMPLETE, FILE_RESTORE_FAILED};
use warmstart_shared::signal::RestoreFailed;

use crate::runtime::ContainerInfo;

/// Why a placeholder does not take a restore.
#[derive(Debug, Error)]
pub enum Occupied {
    /// Another restore holds the restore lock.
    #[error("a restore into placeholder {container} is already in flight")]
    InFlight {
        /// The placeholder.
        container: String,
    },
    /// The standby entrypoint claimed the placeholder for a cold start.
    #[error("placeholder {container} already fell back to a cold start at {at}: {reason}")]
    ColdStarted {
        /// The placeholder.
        container: String,
        /// When.
        at: String,
        /// Why it did.
        reason: String,
    },
    /// A restore by a live agent claimed it (in flight) or finished.
    #[error(
        "a restore into placeholder {container} is already in flight or done (claimed by agent pid {pid} at {at}{})",
        if *complete { "; restore-complete is written" } else { "" }
    )]
    Claimed {
        /// The placeholder.
        container: String,
        /// The claiming agent.
        pid: u32,
        /// When.
        at: String,
        /// Whether `restore-complete` exists.
        complete: bool,
    },
    /// A restore claimed it and failed.
    #[error("a restore into placeholder {container} already failed: {reason}")]
    Failed {
        /// The placeholder.
        container: String,
        /// The recorded reason.
        reason: String,
    },
    /// The agent of an earlier restore died before finishing it.
    #[error(
        "the restore into placeholder {container} claimed by agent pid {pid} at {at} ended with that agent, unfinished: {}",
        describe_left(restored, *failed_written)
    )]
    Interrupted {
        /// The placeholder.
        container: String,
        /// The dead agent.
        pid: u32,
        /// When it claimed.
        at: String,
        /// Host PIDs of the tree it left in the placeholder (empty: nothing).
        restored: Vec<i32>,
        /// Whether `restore-failed` was written now (nothing was left).
        failed_written: bool,
    },
    /// The placeholder already holds a restored tree.
    #[error("placeholder {container} already holds a restored process tree (host pids {pids:?})")]
    HoldsTree {
        /// The placeholder.
        container: String,
        /// Host PIDs of the restored tree.
        pids: Vec<i32>,
    },
    /// The control directory cannot be used.
    #[error("cannot use the control directory {} of placeholder {container}", path.display())]
    Control {
        /// The placeholder.
        container: String,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn describe_left(restored: &[i32], failed_written: bool) -> String {
    if restored.is_empty() {
        format!(
            "nothing was restored{}",
            if failed_written {
                " (restore-failed written)"
            } else {
                ""
            }
        )
    } else {
        format!(
            "the tree it left (host pids {restored:?}) was killed{}; not restoring again",
            if failed_written {
                " (restore-failed written)"
            } else {
                ""
            }
        )
    }
}

/// SIGKILLs the restored tree below the placeholder's init `init` (stopped or running) and
/// waits, at most a few seconds, until it is gone. Returns the host PIDs it killed.
pub fn kill_restored_tree(init: i32) -> Vec<i32> {
    let tree = restored_tree(init);
    for pid in &tree {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !restored_tree(init).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    tree
}

/// The claim file's content (PROTOCOL: restore claim).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Claim {
    by: String,
    pid: u32,
    at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

/// A placeholder held for one restore: the lock and, with a control directory, the claim.
#[derive(Debug)]
pub struct Hold {
    _lock: Flock<File>,
    control: Option<PathBuf>,
    container: String,
}

impl Hold {
    /// Writes `restore-failed` with `reason` (the restore this hold was for restored nothing).
    pub fn fail(&self, reason: &str) {
        if let Some(dir) = &self.control {
            write_failed(dir, reason, &self.container);
        }
    }
}

/// Checks, changing nothing, that `placeholder` takes a restore: not locked, not claimed,
/// holding no restored tree. A claim left by a dead agent is reported (and, when it left
/// nothing, answered with `restore-failed`).
///
/// # Errors
/// [`Occupied`].
pub fn check_vacant(placeholder: &ContainerInfo, control: Option<&Path>) -> Result<(), Occupied> {
    drop(lock(placeholder)?);
    inspect(placeholder, control)
}

/// Takes `placeholder` for a restore: its lock, then (with a control directory) its claim.
///
/// # Errors
/// [`Occupied`].
pub fn take(placeholder: &ContainerInfo, control: Option<&Path>) -> Result<Hold, Occupied> {
    let container = placeholder.uri();
    let lock = lock(placeholder)?;
    inspect(placeholder, control)?;
    if let Some(dir) = control {
        let path = dir.join(FILE_RESTORE_CLAIM);
        let claim = Claim {
            by: "restore".to_owned(),
            pid: std::process::id(),
            at: crate::clock::now_rfc3339(),
            reason: None,
        };
        match create_exclusive(&path, &claim) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // Lost the race (to the entrypoint's cold start): report who won.
                inspect(placeholder, control)?;
                return Err(Occupied::InFlight { container });
            }
            Err(source) => {
                return Err(Occupied::Control {
                    container,
                    path,
                    source,
                });
            }
        }
    }
    Ok(Hold {
        _lock: lock,
        control: control.map(Path::to_path_buf),
        container,
    })
}

/// Answers a restore refused before it claimed anything: claims the placeholder (unless
/// someone else did) and writes `restore-failed`, so a standby entrypoint cold starts instead
/// of waiting for nothing.
pub fn refuse(placeholder: &ContainerInfo, control: &Path, reason: &str) {
    let container = placeholder.uri();
    let claim = Claim {
        by: "restore".to_owned(),
        pid: std::process::id(),
        at: crate::clock::now_rfc3339(),
        reason: None,
    };
    match create_exclusive(&control.join(FILE_RESTORE_CLAIM), &claim) {
        Ok(()) => write_failed(control, reason, &container),
        Err(err) => {
            tracing::debug!(container.id = %container, error = %err, "placeholder claimed by another party: restore-failed not written");
        }
    }
}

fn lock(placeholder: &ContainerInfo) -> Result<Flock<File>, Occupied> {
    let container = placeholder.uri();
    let dir = File::open(&placeholder.rootfs).map_err(|source| Occupied::Control {
        container: container.clone(),
        path: placeholder.rootfs.clone(),
        source,
    })?;
    Flock::lock(dir, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        if errno == nix::errno::Errno::EWOULDBLOCK {
            Occupied::InFlight {
                container: container.clone(),
            }
        } else {
            Occupied::Control {
                container: container.clone(),
                path: placeholder.rootfs.clone(),
                source: errno.into(),
            }
        }
    })
}

fn inspect(placeholder: &ContainerInfo, control: Option<&Path>) -> Result<(), Occupied> {
    let container = placeholder.uri();
    if let Some(dir) = control {
        let read = |name: &str| std::fs::read(dir.join(name)).ok();
        if let Some(bytes) = read(FILE_RESTORE_CLAIM) {
            let claim: Option<Claim> = serde_json::from_slice(&bytes).ok();
            let claim = claim.unwrap_or(Claim {
                by: "unknown".to_owned(),
                pid: 0,
                at: "an unknown time".to_owned(),
                reason: None,
            });
            if claim.by == "cold-start" {
                return Err(Occupied::ColdStarted {
                    container,
                    at: claim.at,
                    reason: claim.reason.unwrap_or_default(),
                });
            }
            if let Some(failed) = read(FILE_RESTORE_FAILED) {
                let reason = serde_json::from_slice::<RestoreFailed>(&failed)
                    .map(|f| f.reason)
                    .unwrap_or_else(|_| String::from_utf8_lossy(&failed).trim().to_owned());
                return Err(Occupied::Failed { container, reason });
            }
            let complete = dir.join(FILE_RESTORE_COMPLETE).exists();
            if complete || claimant_alive(claim.pid, &claim.at) {
                return Err(Occupied::Claimed {
                    container,
                    pid: claim.pid,
                    at: claim.at,
                    complete,
                });
            }
            // A tree the dead agent left is killed: it never got `restore-complete` (and may
            // still be stopped, its page images unverified): never a half-restored worker.
            let restored = kill_restored_tree(placeholder.pid);
            write_failed(
                dir,
                &format!(
                    "the restore claimed by agent pid {} at {} ended with that agent, unfinished; {}",
                    claim.pid,
                    claim.at,
                    if restored.is_empty() {
                        "nothing was restored".to_owned()
                    } else {
                        format!("the tree it left (host pids {restored:?}) was killed")
                    }
                ),
                &container,
            );
            let failed_written = true;
            return Err(Occupied::Interrupted {
                container,
                pid: claim.pid,
                at: claim.at,
                restored,
                failed_written,
            });
        }
    }
    let pids = restored_tree(placeholder.pid);
    if pids.is_empty() {
        Ok(())
    } else {
        Err(Occupied::HoldsTree { container, pids })
    }
}

/// Host PIDs of the processes below the placeholder's init that live in a PID namespace
/// nested in the placeholder's: a restored tree (the placeholder's own processes share its
/// namespace).
pub fn restored_tree(init: i32) -> Vec<i32> {
    let ns = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let Some(own) = ns(init) else {
        return Vec::new();
    };
    crate::runtime::stat::descendants(init)
        .into_iter()
        .skip(1)
        .filter(|pid| ns(*pid).is_some_and(|theirs| theirs != own))
        .filter(|pid| {
            // Zombies awaiting the placeholder's init are not a tree.
            crate::runtime::stat::fields(*pid)
                .and_then(|f| f.first().cloned())
                .is_some_and(|state| state != "Z")
        })
        .collect()
}

/// Whether the agent `pid` that claimed at `at` still runs (the same process: started before
/// its claim).
fn claimant_alive(pid: u32, at: &str) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    let Some(started) = crate::runtime::stat::started_at(pid) else {
        return false;
    };
    match at.parse::<jiff::Timestamp>() {
        // Clock ticks and second-rounded claims: allow a little slack.
        Ok(claimed) => started <= claimed + jiff::SignedDuration::from_secs(2),
        Err(_) => true,
    }
}

fn create_exclusive(path: &Path, claim: &Claim) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(claim).map_err(std::io::Error::other)?;
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(path)?;
    file.write_all(&bytes)?;
    file.sync_all()
}

fn write_failed(dir: &Path, reason: &str, container: &str) {
    let path = dir.join(FILE_RESTORE_FAILED);
    if path.exists() {
        return;
    }
    let failure = RestoreFailed {
        reason: reason.to_owned(),
        at: crate::clock::now_rfc3339(),
    };
    let result = serde_json::to_vec(&failure)
        .map_err(std::io::Error::other)
        .and_then(|bytes| crate::podfiles::write_file(dir, FILE_RESTORE_FAILED, &bytes));
    match result {
        Ok(()) => tracing::info!(container.id = %container, reason, "restore-failed written"),
        Err(err) => {
            tracing::error!(container.id = %container, error = %err, path = %path.display(), "cannot write restore-failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_claimant_is_the_process_that_claimed() {
        let me = std::process::id();
        assert!(claimant_alive(me, &crate::clock::now_rfc3339()));
        // A claim written before this process started is not ours (PID reuse).
        assert!(!claimant_alive(me, "2001-01-01T00:00:00Z"));
        assert!(!claimant_alive(0, "2001-01-01T00:00:00Z"));
    }

    #[test]
    fn our_own_process_holds_no_restored_tree() {
        let me = i32::try_from(std::process::id()).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        // A child in our own PID namespace is not a restored tree.
        assert!(restored_tree(me).is_empty());
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
