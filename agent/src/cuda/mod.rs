//! GPU state through the CUDA driver's process-checkpoint API (driver r570+): the binding
//! ([`ffi`]), the GPU inventory and per-process states, discovery of the CUDA processes of a
//! tree, and [`CudaDriver`], which runs every driver call where it can be killed (a short-lived
//! `warmstart-agent cuda-helper` process under a deadline), because a blocking FFI call cannot
//! be cancelled and a driver call can hang on a stopped or wedged target.
//!
//! The library is opened at run time, so the agent starts on GPU-less nodes. Which `CUresult`
//! codes mean what, and the order of calls around CRIU, follow NVIDIA's `cuda.h`,
//! `cuda-checkpoint` and CRIU's CUDA plugin.

mod driver;
mod error;
pub mod ffi;
pub mod helper;
mod types;

pub use driver::{CudaDriver, CudaOptions, Isolation, ProbedProcess};
pub use error::{Call, CudaError};
pub use types::{CudaInventory, CudaProcessState, GpuDevice, format_uuid, parse_uuid};

/// Where `libcuda.so.1` is found when nothing else is said: the dynamic loader's search path
/// (the NVIDIA container toolkit mounts the host driver's libraries there).
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// Whether `pid` maps the CUDA driver library: only then can it hold CUDA state, and only
/// such processes are asked about it. Read from `/proc/<pid>/maps`, without any driver.
pub fn maps_cuda_driver(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|maps| {
        maps.lines().any(|line| {
            line.rsplit('/')
                .next()
                .is_some_and(|file| file.starts_with("libcuda.so"))
        })
    })
}

/// Command-line flags for the CUDA driver.
#[derive(Clone, Debug, clap::Args)]
pub struct CudaArgs {
    /// The CUDA driver library (a name the dynamic loader searches for, or a path).
    #[arg(long, global = true, env = "WARMSTART_CUDA_LIBRARY", default_value = DEFAULT_LIBRARY)]
    pub cuda_library: std::path::PathBuf,
    /// Deadline of one CUDA checkpoint or restore call, in seconds (they move all device memory).
    #[arg(
        long,
        global = true,
        env = "WARMSTART_CUDA_CALL_TIMEOUT",
        default_value_t = 300
    )]
    pub cuda_call_timeout: u64,
    /// How long a CUDA lock waits for the workload's in-flight GPU work, in seconds; past it
    /// the checkpoint fails and the workload keeps running.
    #[arg(
        long,
        global = true,
        env = "WARMSTART_CUDA_LOCK_TIMEOUT",
        default_value_t = 30
    )]
    pub cuda_lock_timeout: u64,
}

impl CudaArgs {
    /// Options that run every call in this executable's `cuda-helper` subcommand.
    ///
    /// # Errors
    /// When the running executable's path cannot be read.
    pub fn options(&self) -> std::io::Result<CudaOptions> {
        Ok(CudaOptions {
            library: self.cuda_library.clone(),
            isolation: Isolation::current_exe()?,
            call_timeout: std::time::Duration::from_secs(self.cuda_call_timeout),
            lock_timeout: std::time::Duration::from_secs(self.cuda_lock_timeout),
        })
    }
}
