//! Driving a sample-worker container from the demo and the benchmark: waiting until it serves,
//! reading its state, and running `warmstart-agent` against a runc root.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::fixture::{Container, Runtime};

/// The port the sample worker serves on in the demo and the benchmark.
pub const PORT: u16 = 8000;

/// Waits until `c` answers `GET /health` with 200, at most `timeout`.
///
/// # Errors
/// When it does not, with the container's log.
pub fn wait_serving(c: &Container, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = c.http_get(PORT, "/health") {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{} did not serve HTTP within {timeout:?}; log:\n{}",
                c.id(),
                c.read_log()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `GET /state` of the worker.
///
/// # Errors
/// A failed request, a non-200 answer or unparsable JSON.
pub fn get_state(c: &Container) -> Result<Value> {
    let (status, body) = c.http_get(PORT, "/state").context("GET /state")?;
    ensure!(status == 200, "GET /state answered {status}: {body}");
    serde_json::from_str(&body).context("parse /state")
}

/// Runs `agent --runc-root <rt> <args> <path>`; its standard output.
///
/// # Errors
/// When it cannot run or exits non-zero (with its output).
pub fn run_agent(agent: &Path, rt: &Runtime, args: &[&str], path: &Path) -> Result<String> {
    let out = Command::new(agent)
        .arg("--runc-root")
        .arg(rt.runc_root())
        .args(args)
        .arg(path)
        .output()
        .with_context(|| format!("run {}", agent.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "warmstart-agent {args:?} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}
