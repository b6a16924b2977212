//! A stand-in for the container runtime's shim (containerd-shim-runc-v2) that a real node runs
//! the agent's DaemonSet pod under, for the tests that run the agent as a process of this
//! machine. Test infrastructure only.
//!
//! What it keeps of the shim is what the agent relies on: it is a child subreaper that reaps
//! every orphan of the program it runs. When the agent is SIGKILLed, its restore helper and the
//! helper's child (which lives in a placeholder's PID namespace) die with it; on a node the shim
//! reaps them, and the placeholder's PID namespace can end. A test process that adopted them
//! without reaping them (it is a subreaper itself, for its containers' exit codes) would keep that
//! namespace, and so the placeholder container, from ever ending.
//!
//! `warmstart-shim PROGRAM [ARGS...]` runs the program, forwards SIGTERM and SIGINT to it, and
//! once it ended, reaps the orphans it left (for at most [`ORPHANS_GRACE`]), then exits with the
//! program's exit code (128 + the signal when it was killed).

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};

/// How long orphans get to end once the program ended (they die with it: parent-death signals).
const ORPHANS_GRACE: Duration = Duration::from_secs(10);

/// How often the reaping loop wakes without a signal.
const TICK: Duration = Duration::from_millis(50);

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("warmstart-shim: start the runtime: {err}");
            return ExitCode::from(125);
        }
    };
    match runtime.block_on(run()) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("warmstart-shim: {err:#}");
            ExitCode::from(125)
        }
    }
}

async fn run() -> Result<u8> {
    let mut args = std::env::args_os().skip(1);
    let Some(program) = args.next() else {
        bail!("usage: warmstart-shim PROGRAM [ARGS...]");
    };
    nix::sys::prctl::set_child_subreaper(true).context("become a child subreaper")?;
    let mut term = signal(SignalKind::terminate()).context("handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("handle SIGINT")?;
    let mut child_ended = signal(SignalKind::child()).context("handle SIGCHLD")?;
    let child = Command::new(&program)
        .args(args)
        .spawn()
        .with_context(|| format!("start {}", program.to_string_lossy()))?;
    let main = Pid::from_raw(i32::try_from(child.id()).context("pid")?);
    let mut ended: Option<(u8, Instant)> = None;
    loop {
        let forward = tokio::select! {
            _ = term.recv() => Some(Signal::SIGTERM),
            _ = int.recv() => Some(Signal::SIGINT),
            _ = child_ended.recv() => None,
            () = tokio::time::sleep(TICK) => None,
        };
        if let Some(signal) = forward
            && ended.is_none()
        {
            let _ = kill(main, signal);
        }
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(WaitStatus::Exited(pid, code)) if pid == main => {
                    ended = Some((u8::try_from(code).unwrap_or(1), Instant::now()));
                }
                Ok(WaitStatus::Signaled(pid, signal, _)) if pid == main => {
                    let code = 128 + u8::try_from(signal as i32).unwrap_or(0);
                    ended = Some((code, Instant::now()));
                }
                Ok(_) => {}
                Err(Errno::ECHILD) => return Ok(ended.map_or(1, |(code, _)| code)),
                Err(errno) => bail!("waitpid: {errno}"),
            }
        }
        if let Some((code, at)) = ended
            && at.elapsed() > ORPHANS_GRACE
        {
            eprintln!(
                "warmstart-shim: orphans still running {ORPHANS_GRACE:?} after the program ended"
            );
            return Ok(code);
        }
    }
}
