//! Fault points for the crash tests: debug builds only. With `WARMSTART_FAULT_PAUSE=<name>`
//! in the environment, the process reaching point `<name>` writes `fault-<name>` into the
//! directory it names and then waits forever, so a test can kill it at exactly that point.
//! [`point_until_resumed`] waits instead until the test writes `resume-<name>` there, so it can
//! change something at exactly that point and let the process go on. Release builds compile
//! every point to nothing.

use std::path::Path;

/// The environment variable naming the point to pause at.
pub const ENV_FAULT_PAUSE: &str = "WARMSTART_FAULT_PAUSE";

/// Pauses here (forever) when this debug build was asked to; see the module docs.
pub fn point(name: &str, dir: &Path) {
    if cfg!(debug_assertions) && std::env::var_os(ENV_FAULT_PAUSE).is_some_and(|v| v == name) {
        let marker = dir.join(format!("fault-{name}"));
        if let Err(err) = std::fs::write(&marker, b"") {
            tracing::error!(path = %marker.display(), error = %err, "cannot mark the fault point");
        }
        tracing::warn!(fault = name, "paused at a fault point");
        loop {
            std::thread::park();
        }
    }
}

/// Pauses here when this debug build was asked to (`WARMSTART_FAULT_PAUSE=<name>`): writes
/// `fault-<name>` into `dir` and waits until `resume-<name>` appears there.
pub fn point_until_resumed(name: &str, dir: &Path) {
    if cfg!(debug_assertions) && std::env::var_os(ENV_FAULT_PAUSE).is_some_and(|v| v == name) {
        let marker = dir.join(format!("fault-{name}"));
        if let Err(err) = std::fs::write(&marker, b"") {
            tracing::error!(path = %marker.display(), error = %err, "cannot mark the fault point");
        }
        tracing::warn!(fault = name, "paused at a fault point until resumed");
        let resume = dir.join(format!("resume-{name}"));
        while !resume.exists() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
