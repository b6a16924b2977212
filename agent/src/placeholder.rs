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
//!
//! The control directory is the workload's: its files are read and written through
//! [`crate::podfiles`] (no link followed, regular files only, a few KiB at most), and what they
//! say is quoted, bounded and escaped, never echoed raw.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use thiserror::Error;
use warmstart_shared::control::{ClaimedBy, RestoreClaim};
use warmstart_shared::names::{FILE_RESTORE_CLAIM, FILE_RESTORE_COMPLETE, FILE_RESTORE_FAILED};
use warmstart_shared::signal::RestoreFailed;

use crate::podfiles::{PodDir, PodFileError, quote};
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
    #[error(
        "placeholder {container} already fell back to a cold start (its restore-claim, which the workload writes, gives the time {at} and the reason {reason})"
    )]
    ColdStarted {
        /// The placeholder.
        container: String,
        /// When, as the claim says ([`quote`]d).
        at: String,
        /// Why it did, as the claim says ([`quote`]d).
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
        /// When, as the claim says ([`quote`]d).
        at: String,
        /// Whether `restore-complete` exists.
        complete: bool,
    },
    /// A restore claimed it and failed.
    #[error(
        "a restore into placeholder {container} already failed: restore-failed in its control directory, which the workload can write too, {recorded}"
    )]
    Failed {
        /// The placeholder.
        container: String,
        /// What `restore-failed` says: its reason [`quote`]d, or that it is not valid JSON.
        recorded: String,
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
        /// When it claimed, as the claim says ([`quote`]d).
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
    /// The control directory or a file in it cannot be used (the error names which).
    #[error("cannot use the control directory {} of placeholder {container}", path.display())]
    Control {
        /// The placeholder.
        container: String,
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: PodFileError,
    },
    /// The placeholder's root filesystem cannot be locked.
    #[error("cannot lock the root filesystem {} of placeholder {container}", path.display())]
    Lock {
        /// The placeholder.
        container: String,
        /// Its root filesystem.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// `restore-complete` could not be written, so the restored tree was killed: a tree left
/// serving while the pod is told (by `restore-failed`) that the restore failed would run
/// beside the cold start that follows.
#[derive(Debug, Error)]
#[error(
    "cannot announce the restore into placeholder {container}, so the restored tree (host pids {killed:?}) was killed rather than left running unannounced"
)]
pub struct Unannounced {
    /// The placeholder.
    pub container: String,
    /// Host PIDs of the restored tree that was killed.
    pub killed: Vec<i32>,
    /// Why `restore-complete` could not be written (names the file).
    #[source]
    pub source: PodFileError,
}

/// Writes `restore-complete` into the control directory `control` of `placeholder`, the last
/// step of a restore; when it cannot be written, kills the restored tree.
///
/// # Errors
/// [`Unannounced`], after the tree was killed.
pub fn announce(placeholder: &ContainerInfo, control: &Path) -> Result<(), Unannounced> {
    PodDir::open(control)
        .and_then(|dir| dir.write(FILE_RESTORE_COMPLETE, b"ok\n"))
        .map_err(|source| {
            let killed = kill_restored_tree(placeholder.pid);
            tracing::error!(?killed, error = %source, "cannot write restore-complete: the restored tree was killed");
            Unannounced {
                container: placeholder.uri(),
                killed,
                source,
            }
        })
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

/// What `restore-failed` says, fit for a message: its reason quoted (whoever wrote it, the
/// workload could have), or only its size when it is not the contract's JSON.
pub fn describe_failed(bytes: &[u8]) -> String {
    match serde_json::from_slice::<RestoreFailed>(bytes) {
        Ok(failed) => format!("says {}", quote(&failed.reason)),
        Err(_) => format!("is not valid JSON ({} bytes)", bytes.len()),
    }
}

/// This agent's restore claim (the restore claim: README "The agent's command line"), now.
fn our_claim() -> RestoreClaim {
    RestoreClaim::new(
        ClaimedBy::Restore,
        std::process::id(),
        crate::clock::now_rfc3339(),
    )
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

/// Checks that `placeholder` takes a restore: not locked, not claimed, holding no restored tree.
/// A claim left by a dead agent is finished off, not ignored: the tree it restored (never told
/// `restore-complete`) is killed and `restore-failed` written, and the placeholder is reported
/// as taken. Otherwise nothing is changed.
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
    if let Some(path) = control {
        let claim = our_claim();
        match open_control(path, &container).and_then(|dir| {
            create_claim(&dir, &claim).map_err(|source| Occupied::Control {
                container: container.clone(),
                path: path.to_path_buf(),
                source,
            })
        }) {
            Ok(()) => {}
            Err(Occupied::Control { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                // Lost the race (to the entrypoint's cold start): report who won.
                inspect(placeholder, control)?;
                return Err(Occupied::InFlight { container });
            }
            Err(err) => return Err(err),
        }
    }
    Ok(Hold {
        _lock: lock,
        control: control.map(Path::to_path_buf),
        container,
    })
}

/// How a refusal was answered in a control directory ([`answer_refusal`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `restore-failed` was written.
    Written,
    /// A `restore-failed` was there already (the first answer stands).
    AlreadyFailed,
    /// The standby entrypoint claimed the placeholder for a cold start: nothing to answer.
    ColdStarted,
}

/// The one answer to a restore that restored nothing: claims the control directory `dir` for
/// the restore (unless someone did: this restore itself, a dead agent's, the entrypoint's cold
/// start), then writes `restore-failed` with `reason` — unless the entrypoint's cold start
/// holds the claim, which needs no answer. `restore-failed` guarantees nothing was restored:
/// the standby entrypoint cold starts on it, whoever holds the claim.
///
/// # Errors
/// Why the claim or the answer could not be read or written (the file and the cause).
pub fn answer_refusal(dir: &PodDir, reason: &str) -> Result<Answer, PodFileError> {
    match create_claim(dir, &our_claim()) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            let claim = dir
                .read(FILE_RESTORE_CLAIM)?
                .and_then(|bytes| serde_json::from_slice::<RestoreClaim>(&bytes).ok());
            if claim.is_some_and(|c| c.by == ClaimedBy::ColdStart) {
                return Ok(Answer::ColdStarted);
            }
        }
        Err(err) => return Err(err),
    }
    Ok(if write_failed_in(dir, reason)? {
        Answer::Written
    } else {
        Answer::AlreadyFailed
    })
}

/// Answers a restore of `placeholder` refused before it claimed anything ([`answer_refusal`]
/// in its control directory `control`), so a standby entrypoint cold starts instead of waiting
/// for nothing; the outcome is logged.
pub fn refuse(placeholder: &ContainerInfo, control: &Path, reason: &str) {
    write_failed(control, reason, &placeholder.uri());
}

/// Opens the control directory `path` of `container` without following a link.
fn open_control(path: &Path, container: &str) -> Result<PodDir, Occupied> {
    PodDir::open(path).map_err(|source| Occupied::Control {
        container: container.to_owned(),
        path: path.to_path_buf(),
        source,
    })
}

fn lock(placeholder: &ContainerInfo) -> Result<Flock<File>, Occupied> {
    let container = placeholder.uri();
    let dir = File::open(&placeholder.rootfs).map_err(|source| Occupied::Lock {
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
            Occupied::Lock {
                container: container.clone(),
                path: placeholder.rootfs.clone(),
                source: errno.into(),
            }
        }
    })
}

fn inspect(placeholder: &ContainerInfo, control: Option<&Path>) -> Result<(), Occupied> {
    let container = placeholder.uri();
    if let Some(path) = control {
        let dir = open_control(path, &container)?;
        let unusable = |source| Occupied::Control {
            container: container.clone(),
            path: path.to_path_buf(),
            source,
        };
        // A claim or answer that is a link, a FIFO, a device or too large refuses the restore,
        // naming the file: the placeholder's state cannot be told.
        if let Some(bytes) = dir.read(FILE_RESTORE_CLAIM).map_err(unusable)? {
            // A claim that does not parse is an unknown claimant's, long gone.
            let claim = serde_json::from_slice::<RestoreClaim>(&bytes)
                .unwrap_or_else(|_| RestoreClaim::new(ClaimedBy::Restore, 0, "an unknown time"));
            // The claim's words are the workload's as far as the agent can tell.
            let at = quote(&claim.at);
            if claim.by == ClaimedBy::ColdStart {
                return Err(Occupied::ColdStarted {
                    container,
                    at,
                    reason: quote(claim.reason.as_deref().unwrap_or_default()),
                });
            }
            if let Some(failed) = dir.read(FILE_RESTORE_FAILED).map_err(unusable)? {
                return Err(Occupied::Failed {
                    container,
                    recorded: describe_failed(&failed),
                });
            }
            let complete = dir.has_file(FILE_RESTORE_COMPLETE).map_err(unusable)?;
            if complete || claimant_alive(claim.pid, &claim.at) {
                return Err(Occupied::Claimed {
                    container,
                    pid: claim.pid,
                    at,
                    complete,
                });
            }
            // A tree the dead agent left is killed: it never got `restore-complete` (and may
            // still be stopped, its page images unverified): never a half-restored worker.
            let restored = kill_restored_tree(placeholder.pid);
            let failed_written = write_failed(
                path,
                &format!(
                    "the restore claimed by agent pid {} at {at} ended with that agent, unfinished; {}",
                    claim.pid,
                    if restored.is_empty() {
                        "nothing was restored".to_owned()
                    } else {
                        format!("the tree it left (host pids {restored:?}) was killed")
                    }
                ),
                &container,
            );
            return Err(Occupied::Interrupted {
                container,
                pid: claim.pid,
                at,
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

/// Creates `restore-claim` with `claim`, only if nothing of that name is there.
fn create_claim(dir: &PodDir, claim: &RestoreClaim) -> Result<(), PodFileError> {
    let bytes = serde_json::to_vec(claim).map_err(|e| PodFileError::Io {
        op: "encode",
        path: dir.path().join(FILE_RESTORE_CLAIM),
        source: e.into(),
    })?;
    dir.create_new(FILE_RESTORE_CLAIM, &bytes)
}

/// Writes `restore-failed` with `reason` into the control directory `dir`, unless a regular
/// file of that name is there already (the first answer stands; anything else planted there is
/// replaced).
///
/// Returns whether it wrote.
///
/// # Errors
/// Why it could not be written: the file and the cause.
fn write_failed_in(dir: &PodDir, reason: &str) -> Result<bool, PodFileError> {
    if dir.has_file(FILE_RESTORE_FAILED)? {
        return Ok(false);
    }
    let failure = RestoreFailed {
        reason: reason.to_owned(),
        at: crate::clock::now_rfc3339(),
    };
    let bytes = serde_json::to_vec(&failure).map_err(|e| PodFileError::Io {
        op: "encode",
        path: dir.path().join(FILE_RESTORE_FAILED),
        source: e.into(),
    })?;
    dir.write(FILE_RESTORE_FAILED, &bytes)?;
    Ok(true)
}

/// [`answer_refusal`] in the control directory `dir` of `container`, the outcome logged;
/// whether `restore-failed` is there afterwards.
fn write_failed(dir: &Path, reason: &str, container: &str) -> bool {
    match PodDir::open(dir).and_then(|d| answer_refusal(&d, reason)) {
        Ok(Answer::Written) => {
            tracing::info!(container.id = %container, reason, "restore-failed written");
            true
        }
        Ok(Answer::AlreadyFailed) => true,
        Ok(Answer::ColdStarted) => {
            tracing::debug!(container.id = %container, "placeholder cold-started: restore-failed not written");
            false
        }
        Err(err) => {
            tracing::error!(container.id = %container, error = %err, "cannot write restore-failed");
            false
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::symlink;
    use std::process::{Child, Command};
    use std::time::{Duration, Instant};

    use nix::sys::stat::Mode;

    use super::*;
    use crate::podfiles::tests::promptly;
    use crate::report::error_chain;
    use crate::runtime::RuntimeKind;

    const SECRET: &str = "root-only-secret-0123456789";

    /// A placeholder (its init a `sleep` of ours, holding no restored tree), its control
    /// directory, and a secret file beside it the workload must not get to read.
    struct Fixture {
        _tmp: tempfile::TempDir,
        _init: Reaped,
        info: ContainerInfo,
        control: PathBuf,
        secret: PathBuf,
    }

    /// A child process killed and reaped when the test ends, however it ends.
    struct Reaped(Child);

    impl Reaped {
        fn spawn(command: &mut Command) -> Self {
            Self(command.spawn().unwrap())
        }

        fn pid(&self) -> u32 {
            self.0.id()
        }
    }

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn info(rootfs: PathBuf, pid: u32) -> ContainerInfo {
        ContainerInfo {
            id: "placeholder".to_owned(),
            runtime: RuntimeKind::Runc,
            pid: i32::try_from(pid).unwrap(),
            running: true,
            rootfs,
            upper_dir: None,
            mounts: Vec::new(),
            masked_paths: Vec::new(),
            image: String::new(),
            gpus: Default::default(),
        }
    }

    fn fixture() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        let rootfs = tmp.path().join("rootfs");
        let control = tmp.path().join("control");
        let secret = tmp.path().join("secret");
        std::fs::create_dir(&rootfs).unwrap();
        std::fs::create_dir(&control).unwrap();
        std::fs::write(&secret, SECRET).unwrap();
        let init = Reaped::spawn(Command::new("sleep").arg("1000"));
        let info = info(rootfs, init.pid());
        Fixture {
            _tmp: tmp,
            _init: init,
            info,
            control,
            secret,
        }
    }

    impl Fixture {
        fn file(&self, name: &str) -> PathBuf {
            self.control.join(name)
        }

        /// A claim by an agent (pid 1, long dead by its start time) that failed.
        fn claimed(&self) {
            std::fs::write(
                self.file(FILE_RESTORE_CLAIM),
                br#"{"by":"restore","pid":1,"at":"2001-01-01T00:00:00Z"}"#,
            )
            .unwrap();
        }

        /// `check_vacant`, failing the test if it blocks.
        fn check(&self) -> Result<(), Occupied> {
            let (info, control) = (self.info.clone(), self.control.clone());
            promptly(move || check_vacant(&info, Some(&control)))
        }

        /// `check_vacant` refused with [`Occupied::Control`]; its message.
        fn refused(&self) -> String {
            let err = self.check().unwrap_err();
            let text = error_chain(&err);
            assert!(matches!(err, Occupied::Control { .. }), "{text}");
            assert!(!text.contains(SECRET), "{text}");
            text
        }
    }

    #[test]
    fn a_restore_failed_linked_to_a_secret_is_refused_unread() {
        let f = fixture();
        f.claimed();
        symlink(&f.secret, f.file(FILE_RESTORE_FAILED)).unwrap();
        let text = f.refused();
        assert!(text.contains("restore-failed is a symbolic link"), "{text}");
    }

    #[test]
    fn a_claim_a_dead_agent_left_is_answered_with_restore_failed() {
        let f = fixture();
        f.claimed();
        let err = f.check().unwrap_err();
        let text = error_chain(&err);
        assert!(matches!(err, Occupied::Interrupted { .. }), "{text}");
        assert!(text.contains("(restore-failed written)"), "{text}");
        assert!(f.file(FILE_RESTORE_FAILED).is_file());
    }

    /// Undoes `chattr +i` of a directory when dropped.
    struct Immutable(PathBuf);

    impl Drop for Immutable {
        fn drop(&mut self) {
            let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
        }
    }

    #[test]
    fn a_restore_failed_that_cannot_be_written_is_not_said_to_be() {
        let f = fixture();
        f.claimed();
        // An immutable control directory: nothing can be created in it, even by root.
        let out = Command::new("chattr")
            .arg("+i")
            .arg(&f.control)
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!(
                "skipped: chattr +i is not supported here: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        let _undo = Immutable(f.control.clone());
        let err = f.check().unwrap_err();
        let text = error_chain(&err);
        assert!(matches!(err, Occupied::Interrupted { .. }), "{text}");
        assert!(!text.contains("restore-failed written"), "{text}");
        assert!(!f.file(FILE_RESTORE_FAILED).exists());
    }

    #[test]
    fn a_restore_claim_linked_to_a_secret_is_refused_unread() {
        let f = fixture();
        symlink(&f.secret, f.file(FILE_RESTORE_CLAIM)).unwrap();
        let text = f.refused();
        assert!(text.contains("restore-claim is a symbolic link"), "{text}");
        assert!(
            !f.file(FILE_RESTORE_FAILED).exists(),
            "nothing answered on the strength of an unread claim"
        );
    }

    #[test]
    fn a_fifo_in_place_of_claim_or_answer_is_refused_promptly() {
        let f = fixture();
        nix::unistd::mkfifo(&f.file(FILE_RESTORE_CLAIM), Mode::from_bits_truncate(0o600)).unwrap();
        let text = f.refused();
        assert!(text.contains("restore-claim is a FIFO"), "{text}");

        let f = fixture();
        f.claimed();
        nix::unistd::mkfifo(
            &f.file(FILE_RESTORE_FAILED),
            Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let text = f.refused();
        assert!(text.contains("restore-failed is a FIFO"), "{text}");
    }

    #[test]
    fn a_link_to_dev_zero_is_refused_unread() {
        for claimed in [false, true] {
            let f = fixture();
            let name = if claimed {
                f.claimed();
                FILE_RESTORE_FAILED
            } else {
                FILE_RESTORE_CLAIM
            };
            symlink("/dev/zero", f.file(name)).unwrap();
            let text = f.refused();
            assert!(
                text.contains(&format!("{name} is a symbolic link")),
                "{text}"
            );
        }
    }

    #[test]
    fn a_huge_claim_or_answer_is_refused_by_its_size() {
        for claimed in [false, true] {
            let f = fixture();
            let name = if claimed {
                f.claimed();
                FILE_RESTORE_FAILED
            } else {
                FILE_RESTORE_CLAIM
            };
            // Sparse: 16 GiB of zeros that take no disk (a plain read would take the memory).
            File::create(f.file(name))
                .unwrap()
                .set_len(16 << 30)
                .unwrap();
            let text = f.refused();
            assert!(
                text.contains(&format!("{name} holds 17179869184 bytes")),
                "{text}"
            );
        }
    }

    #[test]
    fn a_directory_in_place_of_claim_or_answer_is_refused() {
        for claimed in [false, true] {
            let f = fixture();
            let name = if claimed {
                f.claimed();
                FILE_RESTORE_FAILED
            } else {
                FILE_RESTORE_CLAIM
            };
            std::fs::create_dir(f.file(name)).unwrap();
            let text = f.refused();
            assert!(text.contains(&format!("{name} is a directory")), "{text}");
        }
    }

    #[test]
    fn a_linked_control_directory_is_refused() {
        let f = fixture();
        // The link leads to a directory saying the placeholder cold started.
        let elsewhere = f.control.with_file_name("elsewhere");
        std::fs::rename(&f.control, &elsewhere).unwrap();
        std::fs::write(
            elsewhere.join(FILE_RESTORE_CLAIM),
            br#"{"by":"cold-start","pid":7,"at":"2001-01-01T00:00:00Z","reason":"x"}"#,
        )
        .unwrap();
        symlink(&elsewhere, &f.control).unwrap();
        let text = f.refused();
        assert!(text.contains("control is a symbolic link"), "{text}");
        // Nor is a claim created through it.
        let err = take(&f.info, Some(&f.control)).unwrap_err();
        assert!(matches!(err, Occupied::Control { .. }), "{err}");
    }

    #[test]
    fn a_restore_failed_that_is_not_json_is_described_not_echoed() {
        let f = fixture();
        f.claimed();
        let content = format!("{SECRET}\nsecond line\n");
        std::fs::write(f.file(FILE_RESTORE_FAILED), &content).unwrap();
        let err = f.check().unwrap_err();
        let text = error_chain(&err);
        assert!(matches!(err, Occupied::Failed { .. }), "{text}");
        assert!(
            text.contains(&format!("is not valid JSON ({} bytes)", content.len())),
            "{text}"
        );
        assert!(text.contains("already failed"), "{text}");
        assert!(!text.contains(SECRET) && !text.contains("second"), "{text}");
    }

    #[test]
    fn a_json_reason_is_quoted_bounded_and_escaped() {
        let f = fixture();
        f.claimed();
        let reason = format!("criu failed\n\u{1b}[2J{}", "x".repeat(3000));
        std::fs::write(
            f.file(FILE_RESTORE_FAILED),
            serde_json::to_vec(&RestoreFailed {
                reason,
                at: "now".to_owned(),
            })
            .unwrap(),
        )
        .unwrap();
        let text = error_chain(&f.check().unwrap_err());
        assert!(
            text.contains("which the workload can write too, says \"criu failed\\n\\u{1b}[2Jxxx"),
            "{text}"
        );
        assert!(!text.chars().any(char::is_control), "{text:?}");
        assert!(text.len() < 600, "bounded: {} bytes", text.len());
    }

    #[test]
    fn a_cold_start_claim_is_quoted_and_escaped() {
        let f = fixture();
        std::fs::write(
            f.file(FILE_RESTORE_CLAIM),
            br#"{"by":"cold-start","pid":7,"at":"2001\n\u001b[1m","reason":"no agent\r\nFAKE: restored"}"#,
        )
        .unwrap();
        let err = f.check().unwrap_err();
        let text = error_chain(&err);
        assert!(matches!(err, Occupied::ColdStarted { .. }), "{text}");
        assert!(!text.chars().any(char::is_control), "{text:?}");
        assert!(
            text.contains(r#"the reason "no agent\r\nFAKE: restored""#),
            "{text}"
        );
    }

    #[test]
    fn a_refusal_is_answered_once_unless_the_placeholder_cold_started() {
        let f = fixture();
        let dir = PodDir::open(&f.control).unwrap();
        // Unclaimed: claimed for the restore, then answered.
        assert_eq!(answer_refusal(&dir, "first").unwrap(), Answer::Written);
        let claim: RestoreClaim =
            serde_json::from_slice(&std::fs::read(f.file(FILE_RESTORE_CLAIM)).unwrap()).unwrap();
        assert_eq!(
            (claim.by, claim.pid),
            (ClaimedBy::Restore, std::process::id())
        );
        // The first answer stands.
        assert_eq!(
            answer_refusal(&dir, "second").unwrap(),
            Answer::AlreadyFailed
        );
        let failed: RestoreFailed =
            serde_json::from_slice(&std::fs::read(f.file(FILE_RESTORE_FAILED)).unwrap()).unwrap();
        assert_eq!(failed.reason, "first");
        // A dead agent's claim is answered; the entrypoint's cold start is not.
        std::fs::remove_file(f.file(FILE_RESTORE_FAILED)).unwrap();
        f.claimed();
        assert_eq!(answer_refusal(&dir, "dead").unwrap(), Answer::Written);
        std::fs::remove_file(f.file(FILE_RESTORE_FAILED)).unwrap();
        std::fs::write(
            f.file(FILE_RESTORE_CLAIM),
            br#"{"by":"cold-start","pid":7,"at":"2001-01-01T00:00:00Z","reason":"x"}"#,
        )
        .unwrap();
        assert_eq!(answer_refusal(&dir, "late").unwrap(), Answer::ColdStarted);
        assert!(!f.file(FILE_RESTORE_FAILED).exists());
    }

    #[test]
    fn a_clean_control_directory_is_vacant_and_claimed_once() {
        let f = fixture();
        check_vacant(&f.info, Some(&f.control)).unwrap();
        let hold = take(&f.info, Some(&f.control)).unwrap();
        drop(hold);
        let claim: RestoreClaim =
            serde_json::from_slice(&std::fs::read(f.file(FILE_RESTORE_CLAIM)).unwrap()).unwrap();
        assert_eq!(claim.by, ClaimedBy::Restore);
        assert!(matches!(
            take(&f.info, Some(&f.control)).unwrap_err(),
            Occupied::Claimed { .. }
        ));
    }

    /// A placeholder init (`unshare`, in our PID namespace) with a restored tree (its `sleep`
    /// child, in a nested one).
    fn placeholder_with_tree() -> Option<(Reaped, i32, Vec<i32>)> {
        if !crate::testing::root("a placeholder in PID namespaces of its own") {
            return None;
        }
        let init = Reaped::spawn(Command::new("unshare").args([
            "--pid",
            "--fork",
            "--kill-child",
            "sleep",
            "1000",
        ]));
        let pid = i32::try_from(init.pid()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let tree = restored_tree(pid);
            if !tree.is_empty() {
                return Some((init, pid, tree));
            }
            assert!(Instant::now() < deadline, "no nested tree below {pid}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_restore_that_cannot_be_announced_kills_the_restored_tree() {
        let Some((init, pid, tree)) = placeholder_with_tree() else {
            return;
        };
        let tmp = tempfile::tempdir().unwrap();
        let control = tmp.path().join("control");
        // The workload made `restore-complete` a directory: the rename onto it fails.
        std::fs::create_dir_all(control.join(FILE_RESTORE_COMPLETE).join("inside")).unwrap();
        let placeholder = info(tmp.path().to_path_buf(), init.pid());
        let err = announce(&placeholder, &control).unwrap_err();
        let text = error_chain(&err);
        assert_eq!(err.killed, tree, "{text}");
        assert!(restored_tree(pid).is_empty(), "the tree is gone: {text}");
        assert!(
            text.contains("control/restore-complete") && text.contains("was killed"),
            "{text}"
        );
    }

    #[test]
    fn an_announced_restore_keeps_its_tree() {
        let Some((init, pid, tree)) = placeholder_with_tree() else {
            return;
        };
        let tmp = tempfile::tempdir().unwrap();
        let placeholder = info(tmp.path().to_path_buf(), init.pid());
        announce(&placeholder, tmp.path()).unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join(FILE_RESTORE_COMPLETE)).unwrap(),
            b"ok\n"
        );
        assert_eq!(restored_tree(pid), tree);
    }

    #[test]
    fn a_live_claimant_is_the_process_that_claimed() {
        let me = std::process::id();
        assert!(claimant_alive(me, &crate::clock::now_rfc3339()));
        // A claim written before this process started is not ours (PID reuse).
        assert!(!claimant_alive(me, "2001-01-01T00:00:00Z"));
        assert!(!claimant_alive(0, "2001-01-01T00:00:00Z"));
    }

    #[test]
    fn children_in_the_same_namespace_are_no_restored_tree() {
        // A shell of ours with a child (tests beside this one may have nested namespaces
        // below this process: the shell is the placeholder init here).
        let init = Reaped::spawn(Command::new("sh").args(["-c", "sleep 100 & wait"]));
        let pid = i32::try_from(init.pid()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while crate::runtime::stat::descendants(pid).len() < 2 {
            assert!(Instant::now() < deadline, "the shell started no child");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(restored_tree(pid).is_empty());
    }
}
