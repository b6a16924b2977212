//! The three modes of the entrypoint, one main loop each (README "Unchanged servers", "Standby, fallback and
//! unchanged servers"):
//!
//! - **checkpoint source**: runs the command, runs its readiness probe, writes `ready`, waits for
//!   `<hash>.done`; a copy of this loop restored by CRIU notices `restore-complete` and only
//!   supervises from then on;
//! - **standby**: runs nothing; waits for `restore-complete` (then it is the init of the restored
//!   tree) or for `restore-failed` or its timeout (then it claims the placeholder and cold-starts
//!   the command);
//! - **plain**: runs the command and supervises it.
//!
//! In every mode the loop reaps every child (it is usually PID 1), forwards SIGTERM, SIGINT,
//! SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the supervised process, and exits with that
//! process's status (128 + signal number when a signal ended it).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::WaitStatus;
use nix::unistd::{Pid, getpid};
use thiserror::Error;
use tracing::{debug, error, info, warn};
use warmstart_shared::control::ClaimedBy;
use warmstart_shared::names;

use crate::control::{self, Claim, ControlDir, ControlError, Done};
use crate::probe::{ProbeEvent, ProbeSpec, Runner, Transition};
use crate::reaper::{Reaper, exit_code};
use crate::signals::{FORWARDED, Signals};
use crate::spawn::{SpawnSpec, spawn};

/// How often the loops look at the protocol files when no signal wakes them.
const TICK: Duration = Duration::from_millis(50);
/// How long after `restore-complete` the restored tree has to show up as a child.
const ADOPT_TIMEOUT: Duration = Duration::from_secs(30);
/// Exit status when the checkpoint failed or the entrypoint itself failed.
const EXIT_FAILURE: i32 = 1;

/// What to do.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Run the command and supervise it.
    Plain,
    /// A checkpoint source: run the command, decide readiness, wait for the checkpoint.
    Source {
        /// Where to write `ready`.
        ready_file: PathBuf,
        /// The `<hash>.done` file to wait for, if the pod has one.
        done_file: Option<PathBuf>,
        /// The container's own readiness probe.
        probe: ProbeSpec,
    },
    /// A restore pod's target: wait to be restored, or fall back to a cold start.
    Standby {
        /// How long to wait for a restore before cold-starting.
        timeout: Duration,
    },
}

/// Everything the entrypoint needs, parsed.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The command and its arguments.
    pub command: Vec<OsString>,
    /// The mode.
    pub mode: Mode,
    /// The control directory, if the container has one.
    pub control_dir: Option<PathBuf>,
    /// SIGTERM-to-SIGKILL grace when the entrypoint stops its command itself.
    pub stop_grace: Duration,
}

/// Why the entrypoint could not do its job.
#[derive(Debug, Error)]
pub enum SuperviseError {
    /// The signal mask or signalfd.
    #[error("cannot set up signal handling")]
    Signals(#[source] nix::Error),
    /// The command could not be started.
    #[error("cannot start {command:?}")]
    Spawn {
        /// The program.
        command: OsString,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The probe thread could not be started.
    #[error("cannot start the readiness probe")]
    Probe(#[source] std::io::Error),
    /// A protocol file.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Standby needs the control directory.
    #[error(
        "standby needs the control directory: set {} (the restore pod builder does)",
        names::ENV_CONTROL_DIR
    )]
    NoControlDir,
    /// `restore-complete` appeared, but no restored process became our child.
    #[error(
        "restore-complete appeared but no restored process was adopted within {}s: this entrypoint must be the container's PID 1",
        ADOPT_TIMEOUT.as_secs()
    )]
    NotAdopted,
    /// No command was given.
    #[error("no command given: usage is warmstart-entrypoint -- <command> [args…]")]
    NoCommand,
}

/// Runs the entrypoint; the exit status it should end with.
///
/// # Errors
/// See [`SuperviseError`]; the command's own failure is an exit status, not an error.
pub fn run(settings: &Settings) -> Result<i32, SuperviseError> {
    if settings.command.is_empty() {
        return Err(SuperviseError::NoCommand);
    }
    // Before any thread starts, so that every thread has the signals blocked.
    let signals = Signals::install().map_err(SuperviseError::Signals)?;
    let reaper = Arc::new(Reaper::new());
    let control = settings.control_dir.clone().map(ControlDir::new);
    let sv = Supervisor {
        signals,
        reaper,
        command: settings.command.clone(),
        stop_grace: settings.stop_grace,
    };
    match &settings.mode {
        Mode::Plain => {
            let child = sv.spawn(&[])?;
            Ok(sv.supervise(child))
        }
        Mode::Source {
            ready_file,
            done_file,
            probe,
        } => sv.source(
            ready_file,
            done_file.as_deref(),
            probe.clone(),
            control.as_ref(),
        ),
        Mode::Standby { timeout } => {
            let control = control.ok_or(SuperviseError::NoControlDir)?;
            sv.standby(*timeout, &control)
        }
    }
}

#[derive(Debug)]
struct Supervisor {
    signals: Signals,
    reaper: Arc<Reaper>,
    command: Vec<OsString>,
    stop_grace: Duration,
}

impl Supervisor {
    /// Starts the command, without the variables in `unset`.
    fn spawn(&self, unset: &[&str]) -> Result<Pid, SuperviseError> {
        let program = self.command.first().ok_or(SuperviseError::NoCommand)?;
        let spec = SpawnSpec {
            argv: self.command.clone(),
            unset: unset.iter().map(|u| (*u).to_owned()).collect(),
            null_stdio: false,
        };
        // The main loop is the only reaper of the command: no registration needed.
        let pid = spawn(&spec).map_err(|e| SuperviseError::Spawn {
            command: program.clone(),
            source: e.into(),
        })?;
        info!(pid = pid.as_raw(), command = ?self.command, "command started");
        Ok(pid)
    }

    /// Waits for a tick; forwards signals to `to` (when known); the status of `child` when it
    /// was reaped.
    fn step(&self, to: Option<Pid>, child: Option<Pid>) -> (Vec<Signal>, Option<WaitStatus>) {
        let signals: Vec<Signal> = self
            .signals
            .wait(TICK)
            .into_iter()
            .filter(|s| FORWARDED.contains(s))
            .collect();
        if let Some(pid) = to {
            for signal in &signals {
                info!(pid = pid.as_raw(), signal = %signal, "forwarding signal");
                if let Err(e) = kill(pid, *signal) {
                    debug!(pid = pid.as_raw(), signal = %signal, error = %e, "cannot forward signal");
                }
            }
        }
        let ended = self
            .reaper
            .reap()
            .into_iter()
            .find(|status| status.pid().is_some() && status.pid() == child);
        (signals, ended)
    }

    /// Supervises `child` until it ends; its exit status.
    fn supervise(&self, child: Pid) -> i32 {
        loop {
            if let (_, Some(status)) = self.step(Some(child), Some(child)) {
                return ended(child, status);
            }
        }
    }

    /// SIGTERM, then SIGKILL after the grace period; then `code`.
    fn stop(&self, child: Pid, code: i32) -> i32 {
        info!(
            pid = child.as_raw(),
            grace_seconds = self.stop_grace.as_secs(),
            "stopping the command"
        );
        let _ = kill(child, Signal::SIGTERM);
        let deadline = Instant::now() + self.stop_grace;
        let mut killed = false;
        loop {
            if let (_, Some(status)) = self.step(Some(child), Some(child)) {
                info!(
                    pid = child.as_raw(),
                    status = exit_code(status),
                    "command stopped"
                );
                return code;
            }
            if !killed && Instant::now() >= deadline {
                warn!(
                    pid = child.as_raw(),
                    "command ignored SIGTERM for its grace period, killing it"
                );
                let _ = kill(child, Signal::SIGKILL);
                killed = true;
            }
        }
    }

    fn source(
        &self,
        ready_file: &Path,
        done_file: Option<&Path>,
        probe: ProbeSpec,
        control: Option<&ControlDir>,
    ) -> Result<i32, SuperviseError> {
        let child = self.spawn(&[])?;
        let (tx, rx) = mpsc::channel();
        let mut runner = Some(
            Runner::start(probe, Arc::clone(&self.reaper), tx).map_err(SuperviseError::Probe)?,
        );
        let mut ready = false;
        let mut unparsable_before = false;
        loop {
            if let (_, Some(status)) = self.step(Some(child), Some(child)) {
                return Ok(ended(child, status));
            }
            // restore-complete first: a restored copy may still see the source pod's done file.
            if let Some(control) = control
                && control.restore_complete().is_some()
            {
                if let Some(runner) = runner.take() {
                    runner.stop();
                }
                info!(control_dir = %control.path().display(), "restored, supervising the restored command");
                return Ok(self.supervise(child));
            }
            if !ready && self.probe_events(&rx, &mut runner) {
                control::write_ready(ready_file)?;
                ready = true;
                info!(ready_file = %ready_file.display(), "ready, waiting for the checkpoint");
            }
            let Some(done_file) = done_file else {
                continue;
            };
            match control::read_done(done_file) {
                Ok(None) => unparsable_before = false,
                Ok(Some(Done::Success)) => {
                    info!(done_file = %done_file.display(), "checkpoint done");
                    return Ok(self.stop(child, 0));
                }
                Ok(Some(Done::Failure(reason))) => {
                    error!(done_file = %done_file.display(), reason, "checkpoint failed");
                    return Ok(self.stop(child, EXIT_FAILURE));
                }
                Err(reason) if unparsable_before => {
                    error!(reason, "done file unusable");
                    return Ok(self.stop(child, EXIT_FAILURE));
                }
                Err(_) => unparsable_before = true,
            }
        }
    }

    /// Drains probe events; `true` once the probe said ready (the runner is then stopped, so no
    /// probe thread is left when the process is checkpointed).
    fn probe_events(&self, rx: &Receiver<ProbeEvent>, runner: &mut Option<Runner>) -> bool {
        while let Ok(event) = rx.try_recv() {
            match event {
                ProbeEvent::Failed(reason) => debug!(reason, "readiness probe failed"),
                ProbeEvent::Transition(Transition::NotReady { failures, reason }) => {
                    warn!(failures, reason, "readiness probe failing");
                }
                ProbeEvent::Transition(Transition::Ready) => {
                    if let Some(runner) = runner.take() {
                        runner.stop();
                    }
                    return true;
                }
            }
        }
        false
    }

    fn standby(&self, timeout: Duration, control: &ControlDir) -> Result<i32, SuperviseError> {
        let me = getpid();
        if me.as_raw() != 1 {
            warn!(
                pid = me.as_raw(),
                "not the container's PID 1: a restored process would not be adopted by this entrypoint"
            );
        }
        // A restarted container finds the gate already open: whatever ran before is gone.
        let gate_at_start = control.restore_complete();
        if let Some(gate) = &gate_at_start
            && gate.cold_start
        {
            let reason = format!(
                "restarted after a cold start ({})",
                gate.reason.as_deref().unwrap_or("no reason recorded")
            );
            return self.cold_start(control, &reason);
        }
        info!(control_dir = %control.path().display(), timeout_seconds = timeout.as_secs(), "standby, waiting for a restore");
        let started = Instant::now();
        let mut claim_lost = false;
        // Signals that came while a restore held the placeholder: for the restored process.
        let mut pending: Vec<Signal> = Vec::new();
        let mut signalled_at: Option<Instant> = None;
        loop {
            let (signals, _) = self.step(None, None);
            if let Some(gate) = control.restore_complete() {
                pending.extend(signals);
                info!(
                    cold_start = gate.cold_start,
                    "restore complete, adopting the restored process"
                );
                return self.adopt(control, gate_at_start.is_some(), pending);
            }
            if let Some(signal) = signals.first().or(pending.first()) {
                // A restore that holds the claim may already have resumed the restored process
                // (it writes restore-complete just after): the signal is for that process, so
                // wait for the restore's outcome, at most the grace period.
                let restoring = control.claim().is_some_and(|c| c.by == ClaimedBy::Restore)
                    && control.restore_failed().is_none();
                let waited = signalled_at.get_or_insert_with(Instant::now).elapsed();
                if !restoring || waited >= self.stop_grace {
                    info!(signal = %signal, "signalled in standby, nothing to stop");
                    return Ok(0);
                }
                if pending.is_empty() {
                    info!(signal = %signal, "signalled while a restore holds the placeholder: waiting for it");
                }
                pending.extend(signals);
                continue;
            }
            if let Some(reason) = control.restore_failed() {
                let reason = format!("restore failed: {reason}");
                // restore-failed guarantees nothing was restored: cold-start even if the agent
                // holds the claim.
                match control.claim_cold_start(std::process::id(), &reason)? {
                    Claim::Won | Claim::Lost(_) => return self.cold_start(control, &reason),
                }
            }
            if !claim_lost && started.elapsed() >= timeout {
                let reason = format!("no restore within {}s", timeout.as_secs());
                match control.claim_cold_start(std::process::id(), &reason)? {
                    Claim::Won => return self.cold_start(control, &reason),
                    Claim::Lost(winner) => {
                        claim_lost = true;
                        warn!(
                            claimed_by = winner.as_ref().map_or("unknown", |c| c.by.as_str()),
                            claimed_at = winner.as_ref().map_or("", |c| c.at.as_str()),
                            "timed out, but a restore is in flight: waiting for restore-complete or restore-failed"
                        );
                    }
                }
            }
        }
    }

    /// Opens the startup gate and runs the command itself.
    fn cold_start(&self, control: &ControlDir, reason: &str) -> Result<i32, SuperviseError> {
        control.open_gate_cold(reason)?;
        warn!(reason, "cold start");
        // The command must not wait in standby itself (a server that honours the convention).
        let child = self.spawn(&[
            names::ENV_RESTORE_STANDBY,
            names::ENV_SNAPSHOT_RESTORE_STANDBY,
        ])?;
        Ok(self.supervise(child))
    }

    /// After `restore-complete`: the restored tree's root is re-parented to this process (the
    /// placeholder's init); find it, forward signals to it, exit with its status.
    /// `pending`: signals received before, forwarded to the restored process once found.
    fn adopt(
        &self,
        control: &ControlDir,
        restarted: bool,
        mut pending: Vec<Signal>,
    ) -> Result<i32, SuperviseError> {
        let me = getpid();
        let since = Instant::now();
        let root = loop {
            if let Some(root) = children_of(me).into_iter().next() {
                break root;
            }
            if since.elapsed() >= ADOPT_TIMEOUT {
                if restarted {
                    // The gate was open before this container started: it restarted after a
                    // restore, and the restored process died with the previous one.
                    return self.cold_start(control, "restarted after a restore");
                }
                return Err(SuperviseError::NotAdopted);
            }
            let (signals, _) = self.step(None, None);
            pending.extend(signals);
        };
        info!(pid = root.as_raw(), "supervising the restored process");
        for signal in pending {
            let _ = kill(root, signal);
        }
        Ok(self.supervise(root))
    }
}

fn ended(child: Pid, status: WaitStatus) -> i32 {
    let code = exit_code(status);
    info!(pid = child.as_raw(), status = code, "command exited");
    code
}

/// The children of `parent`, oldest first (from `/proc/<pid>/stat` in this PID namespace).
fn children_of(parent: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: Vec<Pid> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| parent_of(&stat))
                == Some(parent.as_raw())
        })
        .map(Pid::from_raw)
        .collect();
    children.sort();
    children
}

/// The parent pid in a `/proc/<pid>/stat` line (the field after the state, after the command
/// name in parentheses, which may itself hold spaces and parentheses).
fn parent_of(stat: &str) -> Option<i32> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parent_is_read_after_the_command_name() {
        assert_eq!(parent_of("42 (python3) S 1 42 42 0"), Some(1));
        assert_eq!(parent_of("7 (a) b (c)) R 5 7 7"), Some(5));
        assert_eq!(parent_of("garbage"), None);
    }
}
