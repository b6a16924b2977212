//! The controller side of the checkpoint API: argument checks (reserved bytes, `cuInit`,
//! remapping only from driver 13000), then a request to the target's restore thread through
//! its request directory, waiting for the answer as long as it takes (a real driver call
//! blocks too; the agent's deadline is what ends it).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::codes::*;
use crate::config;
use crate::process::{Request, Response, key};

/// Whether this process called `cuInit`.
pub static INITIALISED: AtomicBool = AtomicBool::new(false);
static SEQ: AtomicU64 = AtomicU64::new(0);

/// The request directory of host PID `pid`; `None` when it never created a CUDA context.
fn target_dir(pid: i32) -> Option<PathBuf> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let ns_pid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()?;
    let key = key(Path::new(&format!("/proc/{pid}/ns/pid")), ns_pid)?;
    let dir = config::dir()?.join("req").join(key);
    dir.is_dir().then_some(dir)
}

/// Sends one request to `pid`'s restore thread and waits for the answer.
pub fn call(pid: i32, request: &Request) -> Response {
    let fail = |rc| Response { rc, value: 0 };
    let Some(dir) = target_dir(pid) else {
        return fail(CUDA_ERROR_INVALID_VALUE);
    };
    let name = format!(
        "{:020}-{}-{}",
        config::now_ns(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let Ok(json) = serde_json::to_vec(request) else {
        return fail(CUDA_ERROR_INVALID_VALUE);
    };
    let tmp = dir.join(format!("{name}.tmp"));
    if std::fs::write(&tmp, json).is_err()
        || std::fs::rename(&tmp, dir.join(format!("{name}.req"))).is_err()
    {
        return fail(CUDA_ERROR_OPERATING_SYSTEM);
    }
    let answer = dir.join(format!("{name}.resp"));
    loop {
        if let Ok(text) = std::fs::read_to_string(&answer) {
            let _ = std::fs::remove_file(&answer);
            return serde_json::from_str(&text).unwrap_or(Response {
                rc: CUDA_ERROR_UNKNOWN,
                value: 0,
            });
        }
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return fail(CUDA_ERROR_INVALID_VALUE);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Checks the 64 bytes of an argument struct: `allowed` is the range a caller may set.
pub fn reserved_ok(bytes: &[u8; 64], allowed: std::ops::Range<usize>) -> bool {
    bytes
        .iter()
        .enumerate()
        .all(|(i, b)| allowed.contains(&i) || *b == 0)
}

/// The driver version the node claims.
pub fn driver_version() -> i32 {
    config::config().map_or(0, |c| c.driver_version)
}
