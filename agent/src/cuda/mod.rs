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
pub use types::{
    CudaInventory, CudaProcessState, GpuDevice, device_uuid_text, format_uuid, parse_uuid,
};

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

/// Thread `tid` of `pid` as this process sees it: the driver's id when it is one of `pid`'s
/// threads here, else the thread whose id in `pid`'s own PID namespace is `tid` (a driver
/// asked from another PID namespace than its target's may name it so); `None` when neither.
pub fn host_tid(pid: u32, tid: i32) -> Option<i32> {
    if std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
        return Some(tid);
    }
    let ns_tid = |t: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/task/{t}/status"))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))?
            .split_whitespace()
            .last()?
            .parse::<i32>()
            .ok()
    };
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|t| ns_tid(*t) == Some(tid))
}

/// Where the NVIDIA kernel module describes each GPU (`gpus/<PCI address>/information`).
pub const DEFAULT_NVIDIA_DRIVER_DIR: &str = "/proc/driver/nvidia";

/// The device node minor of each GPU, by lowercase UUID, from the kernel module's
/// `<dir>/gpus/*/information` (its `Device Minor:` and `GPU UUID:` lines); empty when there
/// is none.
pub fn device_minors(dir: &std::path::Path) -> std::collections::BTreeMap<String, u32> {
    let Ok(entries) = std::fs::read_dir(dir.join("gpus")) else {
        return std::collections::BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let text = std::fs::read_to_string(entry.path().join("information")).ok()?;
            let field = |name: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .and_then(|rest| rest.trim_start().strip_prefix(':'))
                    .map(|v| v.trim().to_owned())
            };
            let minor = field("Device Minor")?.parse().ok()?;
            Some((field("GPU UUID")?.to_lowercase(), minor))
        })
        .collect()
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
    /// Where the NVIDIA kernel module describes the GPUs (their device node minors, which
    /// tell the GPUs a process holds from its open `/dev/nvidia<minor>`).
    #[arg(
        long,
        global = true,
        env = "WARMSTART_NVIDIA_DRIVER_DIR",
        default_value = DEFAULT_NVIDIA_DRIVER_DIR
    )]
    pub nvidia_driver_dir: std::path::PathBuf,
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
            nvidia_driver_dir: self.nvidia_driver_dir.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_is_found_by_its_id_here_or_in_its_own_pid_namespace() {
        let me = std::process::id();
        let own = i32::try_from(me).unwrap();
        assert_eq!(super::host_tid(me, own), Some(own));
        assert_eq!(super::host_tid(me, i32::MAX), None);
        if !crate::testing::root("a PID namespace of its own") {
            return;
        }
        // `sleep` is PID 1 of a PID namespace of its own.
        let mut unshare = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "sleep", "100"])
            .spawn()
            .unwrap();
        let parent = unshare.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let child = loop {
            let children =
                std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
                    .unwrap_or_default();
            if let Some(c) = children.split_whitespace().next() {
                break c.parse::<u32>().unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "no child of unshare");
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let found = super::host_tid(child, 1);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = unshare.wait();
        assert_eq!(found, Some(i32::try_from(child).unwrap()));
    }

    #[test]
    fn device_minors_are_read_from_the_kernel_modules_gpu_files() {
        let dir = tempfile::tempdir().unwrap();
        let gpu = dir.path().join("gpus/0000:3b:00.0");
        std::fs::create_dir_all(&gpu).unwrap();
        std::fs::write(
            gpu.join("information"),
            "Model: \t\t NVIDIA H200\nIRQ:   \t\t 95\nGPU UUID: \t GPU-AB-cd\nDevice Minor: \t 3\n",
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("gpus/garbage")).unwrap();
        let minors = super::device_minors(dir.path());
        assert_eq!(
            minors.into_iter().collect::<Vec<_>>(),
            [("gpu-ab-cd".to_owned(), 3)]
        );
        assert!(super::device_minors(std::path::Path::new("/nonexistent")).is_empty());
    }
}
