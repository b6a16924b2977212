//! The stand-in's state directory (`$WARMSTART_CUDA_STANDIN_DIR`), shared by the workload,
//! the controller and the test: `config.json` (driver version and GPUs: "the node"),
//! `faults.json` (fault knobs), `calls.jsonl` (the recording), `device.sock` (the "GPU":
//! device memory, served by the test harness), `req/<pid-ns inode>-<ns pid>/` (requests to
//! one workload's restore thread). Files are read at every call, so a test can change the
//! node or a fault between two calls.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The environment variable naming the state directory.
pub const ENV_DIR: &str = "WARMSTART_CUDA_STANDIN_DIR";

/// The state directory: `$WARMSTART_CUDA_STANDIN_DIR` when set, else the directory above
/// the one this library was loaded from (`<dir>/lib/libcuda.so.1`), so neither the agent nor
/// a container needs the variable; `None` when neither applies.
pub fn dir() -> Option<PathBuf> {
    static FROM_PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    if let Some(dir) = std::env::var_os(ENV_DIR) {
        return Some(PathBuf::from(dir));
    }
    FROM_PATH
        .get_or_init(|| {
            let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
            let lib = maps
                .lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .find(|p| p.ends_with("/lib/libcuda.so.1"))?;
            Some(Path::new(lib).parent()?.parent()?.to_owned())
        })
        .clone()
}

/// `config.json`.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// What `cuDriverGetVersion` answers; also selects the restore-args layout.
    pub driver_version: i32,
    /// The GPUs, ordinal order.
    pub gpus: Vec<Gpu>,
}

/// One simulated GPU.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpu {
    /// `GPU-…`.
    pub uuid: String,
    /// Marketing name.
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
}

/// `faults.json`; every knob off by default.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Faults {
    /// Lock waits for its whole timeout, then fails (the process stays running).
    pub lock_timeout: bool,
    /// The restore thread never answers this call (`lock`, `checkpoint`, `restore`, `unlock`).
    pub hang: Option<String>,
    /// Checkpoint fails with this `CUresult` (the process stays locked).
    pub checkpoint_error: Option<i32>,
    /// Restore fails with out-of-memory, and the process is stuck: later restores answer 304,
    /// unlocks 401 (NVIDIA/cuda-checkpoint#44).
    pub restore_oom: bool,
    /// Each checkpoint and restore takes at least this long (a transfer of device memory).
    pub transfer_delay_ms: u64,
}

fn read_json<T: serde::de::DeserializeOwned>(name: &str) -> Option<T> {
    let text = std::fs::read_to_string(dir()?.join(name)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The node's configuration; `None` when the state directory or the file is missing (no GPU).
pub fn config() -> Option<Config> {
    read_json("config.json")
}

/// The fault knobs now.
pub fn faults() -> Faults {
    read_json("faults.json").unwrap_or_default()
}

/// Nanoseconds since the epoch (comparable across processes).
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// One line of `calls.jsonl`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Record<'a> {
    /// The calling process.
    pub pid: u32,
    /// The entry point.
    pub call: &'a str,
    /// The target process of a checkpoint-API call.
    pub target: Option<i32>,
    /// The arguments worth seeing.
    pub args: serde_json::Value,
    /// When the call started and ended (ns since the epoch).
    pub start_ns: u128,
    /// See `start_ns`.
    pub end_ns: u128,
    /// The `CUresult`.
    pub rc: i32,
}

/// Appends a record (one `write` on an `O_APPEND` file, so concurrent writers do not mix).
pub fn record(record: &Record<'_>) {
    let Some(dir) = dir() else { return };
    let Ok(mut line) = serde_json::to_vec(record) else {
        return;
    };
    line.push(b'\n');
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("calls.jsonl"))
    {
        let _ = file.write_all(&line);
    }
}
