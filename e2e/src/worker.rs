//! Driving a sample-worker container from the demo, the benchmark and the tests: the host
//! directories that stand in for its pod's volumes, waiting until it serves, reading its state,
//! and running `warmstart-agent` against a runc root.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::fixture::{Container, Runtime};

/// The port the sample worker serves on in the demo and the benchmark.
pub const PORT: u16 = 8000;

/// Host directories standing in for a pod's volumes: the signal and control directories, a data
/// volume, and the entrypoint's `bin`. Removed when dropped.
#[derive(Debug)]
pub struct PodVolumes {
    _tmp: tempfile::TempDir,
    /// The signal directory (`/warmstart/signal` in the container).
    pub signal: PathBuf,
    /// The control directory (`/warmstart/control`).
    pub control: PathBuf,
    /// A data volume the workload writes to.
    pub data: PathBuf,
    /// The entrypoint volume (what the install init container fills).
    pub bin: PathBuf,
}

impl PodVolumes {
    /// Empty volumes.
    ///
    /// # Errors
    /// When the directories cannot be made.
    pub fn new() -> Result<Self> {
        let tmp = tempfile::tempdir().context("create a volumes directory")?;
        let mk = |name: &str| -> Result<PathBuf> {
            let p = tmp.path().join(name);
            std::fs::create_dir(&p).with_context(|| format!("create {}", p.display()))?;
            Ok(p)
        };
        Ok(Self {
            signal: mk("signal")?,
            control: mk("control")?,
            data: mk("data")?,
            bin: mk("bin")?,
            _tmp: tmp,
        })
    }

    /// Volumes whose `bin` holds the static `warmstart-entrypoint`, as the install init container
    /// leaves it in a pod.
    ///
    /// # Errors
    /// When the entrypoint has not been built, or the copy fails.
    pub fn with_entrypoint() -> Result<Self> {
        let v = Self::new()?;
        let entrypoint = crate::binaries::static_entrypoint()?;
        let installed = v.bin.join(warmstart_shared::names::ENTRYPOINT_BINARY);
        std::fs::copy(&entrypoint, &installed)
            .with_context(|| format!("copy {} to {}", entrypoint.display(), installed.display()))?;
        Ok(v)
    }
}

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
