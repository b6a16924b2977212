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
    /// Where a process looks for the NVIDIA device nodes (`nvidiactl`, `nvidia<minor>`), in
    /// its own mount namespace: `/dev` unless said otherwise (host tests use a directory of
    /// their own, not the host's `/dev`).
    #[serde(default)]
    pub device_dir: Option<String>,
}

impl Config {
    /// The device node directory (see [`Config::device_dir`]).
    pub fn device_dir(&self) -> &str {
        self.device_dir.as_deref().unwrap_or("/dev")
    }

    /// The device node minor of the GPU `uuid` (its own, or its ordinal).
    pub fn minor(&self, uuid: &str) -> Option<u32> {
        self.gpus.iter().enumerate().find_map(|(i, g)| {
            (g.uuid == uuid).then(|| g.minor.unwrap_or(u32::try_from(i).unwrap_or(u32::MAX)))
        })
    }

    /// Opens the control node and the node of every GPU in `uuids` in this process's view,
    /// as the driver does to use a GPU (at context creation and at restore); `None` when one
    /// is missing. The descriptors are `O_PATH` (a device node of a GPU that is not there
    /// cannot be opened for I/O), kept while the process holds the GPUs: they show which
    /// GPUs it holds, as a real CUDA process's open `/dev/nvidia<minor>` do.
    pub fn open_device_nodes<'a>(
        &self,
        uuids: impl IntoIterator<Item = &'a String>,
    ) -> Option<Vec<std::fs::File>> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::path::Path::new(self.device_dir());
        let open = |name: String| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH)
                .open(dir.join(name))
                .ok()
        };
        let mut nodes = vec![open("nvidiactl".to_owned())?];
        for uuid in uuids {
            nodes.push(open(format!("nvidia{}", self.minor(uuid)?))?);
        }
        Some(nodes)
    }
}

/// One simulated GPU, or MIG instance of one.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpu {
    /// `GPU-…`, or `MIG-…` for a MIG instance.
    pub uuid: String,
    /// For a MIG instance: the `GPU-…` UUID of the GPU it is a slice of.
    #[serde(default)]
    pub parent: Option<String>,
    /// Marketing name.
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// The minor number of its device node `nvidia<minor>`; the ordinal when absent.
    #[serde(default)]
    pub minor: Option<u32>,
}

/// `faults.json`; every knob off by default.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Faults {
    /// Every application call (allocation, copy, free) keeps the GPU busy this long: GPU
    /// work in flight, which a lock waits for (and times out on, the process staying
    /// running).
    pub call_delay_ms: u64,
    /// This checkpoint-API call (`checkpoint` or `restore`) fails with an uncorrectable error
    /// and leaves the process in the FAILED state, where every later checkpoint-API call but
    /// the state query answers `CUDA_ERROR_ILLEGAL_STATE` and application calls fail.
    pub fail: Option<String>,
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
