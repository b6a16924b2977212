//! Running `warmstart-agent` commands as the end-to-end tests do: against a test runtime's runc
//! root and the CRIU under test, bounded in time (only the agent's own PID is killed when it
//! overruns), its output captured and echoed into the test's log.

use std::fs::File;
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::binaries;
use crate::fixture::{FixtureError, Result, Runtime};

/// How long an agent command may run unless a test says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// `warmstart-agent --runc-root <rt's root> --criu <criu>`, standard input closed, ready for a
/// subcommand and its arguments.
///
/// # Errors
/// When the agent has not been built.
pub fn command(rt: &Runtime) -> Result<Command> {
    let mut command = Command::new(binaries::agent()?);
    command
        .arg("--runc-root")
        .arg(rt.runc_root())
        .arg("--criu")
        .arg(binaries::criu())
        .stdin(Stdio::null());
    Ok(command)
}

/// Runs `command` to its end within `timeout` and returns what it did; its output is also
/// printed (shown when the test fails). Output goes through files, so a grandchild that keeps
/// a pipe open cannot hold the test.
///
/// # Errors
/// When it cannot start, or runs past `timeout` (it is then killed, by its PID only).
pub fn run(mut command: Command, timeout: Duration) -> Result<Output> {
    let what = format!("{command:?}");
    let io = |context: &str| {
        let context = format!("{context} for {what}");
        move |source| FixtureError::Io { context, source }
    };
    let out = tempfile::NamedTempFile::new().map_err(io("create stdout file"))?;
    let err = tempfile::NamedTempFile::new().map_err(io("create stderr file"))?;
    let mut child = command
        .stdout(out.reopen().map_err(io("open stdout file"))?)
        .stderr(err.reopen().map_err(io("open stderr file"))?)
        .spawn()
        .map_err(io("start"))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(io("wait"))? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(FixtureError::Invalid(format!(
                "{what} ran longer than {timeout:?}; stderr: {}",
                std::fs::read_to_string(err.path()).unwrap_or_default()
            )));
        }
        thread::sleep(Duration::from_millis(20));
    };
    let read = |file: &tempfile::NamedTempFile| {
        let mut bytes = Vec::new();
        File::open(file.path())
            .and_then(|mut f| std::io::Read::read_to_end(&mut f, &mut bytes))
            .map(|_| bytes)
    };
    let output = Output {
        status,
        stdout: read(&out).map_err(io("read stdout of"))?,
        stderr: read(&err).map_err(io("read stderr of"))?,
    };
    eprintln!(
        "{what}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output)
}
