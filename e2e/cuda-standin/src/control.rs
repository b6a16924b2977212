//! The controller side of the checkpoint API: argument checks (reserved bytes, `cuInit`,
//! remapping only from driver 13000), then a request to the target's restore thread through
//! its request directory, waiting for the answer as long as it takes (a real driver call
//! blocks too; the agent's deadline is what ends it). The state and the restore thread's id
//! are read from the target's memory instead ([`published`]), so they are answered while
//! every thread of the target is stopped, and the thread id is the caller's view of it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::codes::*;
use crate::config;
use crate::process::{Request, Response, key};

/// Whether this process called `cuInit`.
pub static INITIALISED: AtomicBool = AtomicBool::new(false);
static SEQ: AtomicU64 = AtomicU64::new(0);

/// The last `NSpid` field of `/proc/<pid>[/task/<tid>]/status`: the id in its own namespace.
fn ns_id(status_path: &str) -> Option<i32> {
    std::fs::read_to_string(status_path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The start of the first mapping (file offset 0) of the file `maps` names by `matches`.
fn base_of(maps: &str, matches: impl Fn(&str) -> bool) -> Option<(u64, String)> {
    maps.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let path = *fields.get(5)?;
        if fields.get(2) != Some(&"00000000") || !matches(path) {
            return None;
        }
        let start = u64::from_str_radix(fields.first()?.split('-').next()?, 16).ok()?;
        Some((start, path.to_owned()))
    })
}

/// `[state, restore thread id in its namespace]` of `pid`, read from its memory at the
/// offset of [`crate::process::PUBLISHED`] in this library; `None` when it does not map the
/// library or cannot be read.
fn published(pid: i32) -> Option<[i32; 2]> {
    use std::os::unix::fs::FileExt;
    let own = std::ptr::addr_of!(crate::process::PUBLISHED) as u64;
    let own_maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let own_path = own_maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        );
        (a <= own && own < b).then(|| rest.split_whitespace().nth(4).map(str::to_owned))?
    })?;
    let (own_base, _) = base_of(&own_maps, |p| p == own_path)?;
    let name = Path::new(&own_path).file_name()?.to_str()?.to_owned();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let (base, _) = base_of(&maps, |p| p.ends_with(&format!("/{name}")))?;
    let mut bytes = [0u8; 8];
    std::fs::File::open(format!("/proc/{pid}/mem"))
        .ok()?
        .read_exact_at(&mut bytes, base + (own - own_base))
        .ok()?;
    let word = |i: usize| i32::from_ne_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    Some([word(0), word(4)])
}

/// The state and restore thread (as the caller sees its id) of `pid`; `None` when it holds
/// no CUDA state.
pub fn target(pid: i32) -> Option<(i32, i32)> {
    let [state, ns_tid] = published(pid)?;
    if ns_tid == 0 {
        return None;
    }
    let tid = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|tid| ns_id(&format!("/proc/{pid}/task/{tid}/status")) == Some(ns_tid))?;
    Some((state, tid))
}

/// The request directory of host PID `pid` (created when its restore thread has not yet:
/// a restored process whose threads are stopped); `None` when it holds no CUDA state.
fn target_dir(pid: i32) -> Option<PathBuf> {
    target(pid)?;
    let ns_pid = u32::try_from(ns_id(&format!("/proc/{pid}/status"))?).ok()?;
    let key = key(Path::new(&format!("/proc/{pid}/ns/pid")), ns_pid)?;
    let dir = config::dir()?.join("req").join(key);
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
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
