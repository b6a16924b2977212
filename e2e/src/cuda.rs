//! A simulated GPU node for the CUDA stand-in (`e2e/cuda-standin`): a state directory with the
//! node's driver version and GPUs (`config.json`), fault knobs (`faults.json`), the recording
//! (`calls.jsonl`), the stand-in installed as `lib/libcuda.so.1`, and the "GPU" itself: a
//! device server holding every process's device memory, outside the processes, reached over
//! `device.sock`, the GPUs' device nodes (`dev/nvidiactl`, `dev/nvidia<ordinal>`: character
//! devices of the NVIDIA major, never opened for I/O) unless the node is told to use each
//! process's own `/dev` (containers, given their nodes as the NVIDIA runtime gives them), and
//! the kernel module's description of each GPU (`driver/gpus/<n>/information`, what
//! `/proc/driver/nvidia` holds: UUID and device minor). The directory can be bind-mounted into
//! containers at the same path.
//! Dropping the node stops the server and removes the directory.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::Deserialize;
use serde_json::json;

use crate::fixture::{FixtureError, Result};

/// The environment variable the stand-in reads its state directory from.
pub const ENV_STANDIN_DIR: &str = "WARMSTART_CUDA_STANDIN_DIR";

/// One simulated GPU.
#[derive(Clone, Debug)]
pub struct SimGpu {
    /// `GPU-…`, or `MIG-…` for a MIG instance.
    pub uuid: String,
    /// Marketing name.
    pub name: String,
    /// Device memory.
    pub memory_bytes: u64,
    /// For a MIG instance: the GPU (`GPU-…`) it is a slice of.
    pub parent: Option<String>,
}

impl SimGpu {
    /// A GPU whose UUID ends with `n`.
    pub fn numbered(n: u8, memory_bytes: u64) -> Self {
        Self {
            uuid: format!("GPU-5a5a5a5a-0000-4000-8000-0000000000{n:02x}"),
            name: "NVIDIA Stand-in 80GB".into(),
            memory_bytes,
            parent: None,
        }
    }

    /// A MIG instance whose UUID ends with `n`, a slice of GPU `parent`.
    pub fn mig(n: u8, parent: &SimGpu, memory_bytes: u64) -> Self {
        Self {
            uuid: format!("MIG-7b7b7b7b-0000-4000-8000-0000000000{n:02x}"),
            name: format!("{} MIG 1g.10gb", parent.name),
            memory_bytes,
            parent: Some(parent.uuid.clone()),
        }
    }
}

/// One recorded driver call.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CallRecord {
    /// The calling process.
    pub pid: u32,
    /// The entry point.
    pub call: String,
    /// The target process of a checkpoint-API call.
    pub target: Option<i32>,
    /// Arguments.
    pub args: serde_json::Value,
    /// Start, ns since the epoch.
    pub start_ns: u128,
    /// End, ns since the epoch.
    pub end_ns: u128,
    /// The `CUresult`.
    pub rc: i32,
}

/// The simulated node. See the module doc.
#[derive(Debug)]
pub struct GpuNode {
    // Fields drop in order: the server (whose socket is in the directory) before the directory.
    server: DeviceServer,
    dir: tempfile::TempDir,
    library: PathBuf,
    workload: PathBuf,
    /// `None`: the node's own `dev/`; `Some`: that directory in each process's view.
    device_dir: std::sync::Mutex<Option<String>>,
}

impl GpuNode {
    /// Builds the stand-in, lays out the state directory and starts the device server.
    ///
    /// # Errors
    /// Build or I/O errors.
    pub fn start(driver_version: i32, gpus: &[SimGpu]) -> Result<Self> {
        let (so, workload) = crate::binaries::cuda_standin()?;
        let dir = tempfile::Builder::new()
            .prefix("warmstart-gpu-")
            .tempdir()
            .map_err(|e| FixtureError::Invalid(format!("tempdir: {e}")))?;
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).map_err(io(&lib))?;
        let library = lib.join("libcuda.so.1");
        std::fs::copy(&so, &library).map_err(io(&so))?;
        let server = DeviceServer::start(&dir.path().join("device.sock"))?;
        let node = Self {
            dir,
            library,
            workload,
            server,
            device_dir: std::sync::Mutex::new(None),
        };
        node.set_node(driver_version, gpus)?;
        Ok(node)
    }

    /// Changes the node's driver version and GPUs (as if the process moved to another node).
    ///
    /// # Errors
    /// I/O errors.
    pub fn set_node(&self, driver_version: i32, gpus: &[SimGpu]) -> Result<()> {
        let device_dir = self
            .device_dir
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let device_dir = match device_dir {
            Some(dir) => dir,
            None => {
                let dev = self.dir.path().join("dev");
                std::fs::create_dir_all(&dev).map_err(io(&dev))?;
                self.add_device_node("nvidiactl", 255)?;
                for i in 0..gpus.len() {
                    let minor = u64::try_from(i).unwrap_or(0);
                    self.add_device_node(&format!("nvidia{i}"), minor)?;
                }
                dev.display().to_string()
            }
        };
        let driver = self.nvidia_driver_dir().join("gpus");
        if driver.exists() {
            std::fs::remove_dir_all(&driver).map_err(io(&driver))?;
        }
        for (i, g) in gpus.iter().enumerate() {
            let gpu = driver.join(format!("0000:{:02x}:00.0", i + 0x3b));
            std::fs::create_dir_all(&gpu).map_err(io(&gpu))?;
            let info = gpu.join("information");
            std::fs::write(
                &info,
                format!(
                    "Model: \t\t {}\nGPU UUID: \t {}\nDevice Minor: \t {i}\n",
                    g.name,
                    g.parent.as_ref().unwrap_or(&g.uuid)
                ),
            )
            .map_err(io(&info))?;
        }
        let gpus: Vec<_> = gpus
            .iter()
            .map(|g| {
                json!({"uuid": g.uuid, "name": g.name, "memoryBytes": g.memory_bytes, "parent": g.parent})
            })
            .collect();
        self.write(
            "config.json",
            &json!({"driverVersion": driver_version, "gpus": gpus, "deviceDir": device_dir}),
        )
    }

    /// From now on each process looks for the device nodes in its own `/dev` (for workloads
    /// in containers that get `/dev/nvidia*` as the NVIDIA runtime gives them), as the real
    /// driver does; `set_node` must follow.
    pub fn use_process_dev(&self) {
        *self
            .device_dir
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some("/dev".to_owned());
    }

    /// Where the node's GPUs are described as the kernel module does in `/proc/driver/nvidia`
    /// (what the agent's `--nvidia-driver-dir` must name).
    pub fn nvidia_driver_dir(&self) -> PathBuf {
        self.dir.path().join("driver")
    }

    /// Creates device node `name` of the node's own `dev/` (NVIDIA major, `minor`), unless
    /// it exists.
    ///
    /// # Errors
    /// I/O errors (creating a device node needs root).
    pub fn add_device_node(&self, name: &str, minor: u64) -> Result<()> {
        let node = self.dir.path().join("dev").join(name);
        if node.exists() {
            return Ok(());
        }
        nix::sys::stat::mknod(
            &node,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(195, minor),
        )
        .map_err(|e| FixtureError::Invalid(format!("mknod {}: {e}", node.display())))
    }

    /// Removes device node `name` (`nvidia1`) of the node's own `dev/`.
    ///
    /// # Errors
    /// I/O errors.
    pub fn remove_device_node(&self, name: &str) -> Result<()> {
        let node = self.dir.path().join("dev").join(name);
        std::fs::remove_file(&node).map_err(io(&node))
    }

    /// Sets the fault knobs (`callDelayMs`, `hang`, `checkpointError`, `fail`, `restoreOom`,
    /// `transferDelayMs`); `json!({})` clears them.
    ///
    /// # Errors
    /// I/O errors.
    pub fn set_faults(&self, faults: &serde_json::Value) -> Result<()> {
        self.write("faults.json", faults)
    }

    fn write(&self, name: &str, value: &serde_json::Value) -> Result<()> {
        let path = self.dir.path().join(name);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, value.to_string()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))
    }

    /// The state directory (also what [`ENV_STANDIN_DIR`] must name).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The stand-in, installed as `libcuda.so.1`.
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// The driver-API workload binary.
    pub fn workload(&self) -> &Path {
        &self.workload
    }

    /// Every recorded call so far, in the order they were written.
    ///
    /// # Errors
    /// I/O or parse errors.
    pub fn calls(&self) -> Result<Vec<CallRecord>> {
        let path = self.dir.path().join("calls.jsonl");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(&path)(e)),
        };
        text.lines()
            .map(|l| {
                serde_json::from_str(l)
                    .map_err(|e| FixtureError::Invalid(format!("calls.jsonl: {e}: {l}")))
            })
            .collect()
    }

    /// Bytes of device memory held on the "GPU" now, by all processes.
    pub fn resident_bytes(&self) -> u64 {
        self.server.resident.load(Ordering::SeqCst)
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FixtureError + '_ {
    move |e| FixtureError::Invalid(format!("{}: {e}", path.display()))
}

/// Serves device memory: one connection per CUDA process, its allocations freed when the
/// connection closes (as a GPU frees a process's memory when its handles go).
#[derive(Debug)]
struct DeviceServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    resident: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DeviceServer {
    fn start(path: &Path) -> Result<Self> {
        let listener = UnixListener::bind(path).map_err(io(path))?;
        let stop = Arc::new(AtomicBool::new(false));
        let resident = Arc::new(AtomicU64::new(0));
        let (s, r) = (stop.clone(), resident.clone());
        let thread = std::thread::Builder::new()
            .name("gpu-device-server".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let r = r.clone();
                    let _ = std::thread::Builder::new()
                        .name("gpu-device-conn".into())
                        .spawn(move || serve(conn, &r));
                }
            })
            .map_err(|e| FixtureError::Invalid(format!("device server thread: {e}")))?;
        Ok(Self {
            path: path.to_owned(),
            stop,
            resident,
            thread: Some(thread),
        })
    }
}

impl Drop for DeviceServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag; if the socket cannot be reached the
        // thread is left blocked in accept (detached) rather than hanging the test.
        if UnixStream::connect(&self.path).is_ok()
            && let Some(t) = self.thread.take()
        {
            let _ = t.join();
        }
    }
}

/// One process's device memory; freed (and uncounted) when the connection ends.
fn serve(mut conn: UnixStream, resident: &AtomicU64) {
    let mut allocs: HashMap<u64, Vec<u8>> = HashMap::new();
    let _ = serve_requests(&mut conn, &mut allocs, resident);
    let held: u64 = allocs.values().map(|v| v.len() as u64).sum();
    resident.fetch_sub(held, Ordering::SeqCst);
}

fn serve_requests(
    conn: &mut UnixStream,
    allocs: &mut HashMap<u64, Vec<u8>>,
    resident: &AtomicU64,
) -> std::io::Result<()> {
    loop {
        let mut header = [0u8; 17];
        conn.read_exact(&mut header)?;
        let op = header[0];
        let ptr = u64::from_le_bytes(header[1..9].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(header[9..17].try_into().unwrap_or_default());
        let len_usize = usize::try_from(len).map_err(std::io::Error::other)?;
        // The allocation holding [ptr, ptr + len), and the offset in it.
        let find = |allocs: &HashMap<u64, Vec<u8>>| {
            allocs.iter().find_map(|(&base, bytes)| {
                let end = base + bytes.len() as u64;
                (ptr >= base && ptr + len <= end)
                    .then(|| (base, usize::try_from(ptr - base).unwrap_or(0)))
            })
        };
        match op {
            1 if !allocs.contains_key(&ptr) => {
                allocs.insert(ptr, vec![0; len_usize]);
                resident.fetch_add(len, Ordering::SeqCst);
                conn.write_all(&[0])?;
            }
            2 => {
                let mut data = vec![0u8; len_usize];
                conn.read_exact(&mut data)?;
                match find(allocs) {
                    Some((base, at)) => {
                        if let Some(bytes) = allocs.get_mut(&base) {
                            bytes[at..at + len_usize].copy_from_slice(&data);
                        }
                        conn.write_all(&[0])?;
                    }
                    None => conn.write_all(&[1])?,
                }
            }
            3 => match find(allocs) {
                Some((base, at)) => {
                    conn.write_all(&[0])?;
                    if let Some(bytes) = allocs.get(&base) {
                        conn.write_all(&bytes[at..at + len_usize])?;
                    }
                }
                None => conn.write_all(&[1])?,
            },
            4 => match allocs.remove(&ptr) {
                Some(bytes) => {
                    resident.fetch_sub(bytes.len() as u64, Ordering::SeqCst);
                    conn.write_all(&[0])?;
                }
                None => conn.write_all(&[1])?,
            },
            _ => conn.write_all(&[1])?,
        }
    }
}
