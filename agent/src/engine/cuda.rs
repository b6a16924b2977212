//! The engine's seam for the CUDA driver's process-checkpoint API (`cuCheckpointProcess*`):
//! what the engine asks of it, and when. The real driver lives in `crate::cuda` (loaded at
//! run time from `libcuda.so.1`); tests use a recording double.
//!
//! Order the engine keeps (see `notes/cuda-checkpoint.md`): on checkpoint, lock then
//! checkpoint every CUDA process of the tree before the CRIU dump, and restore then unlock them
//! on any failure before publication; on restore, restore then unlock every CUDA process of
//! the restored tree after the CRIU restore and before `restore-complete`.

use std::time::Duration;

/// The CUDA driver as the engine uses it.
pub trait Cuda: Send + Sync + std::fmt::Debug {
    /// Driver version (e.g. 12080 = 12.8) and the node's GPUs.
    ///
    /// # Errors
    /// [`CudaError`].
    fn inventory(&self) -> Result<CudaInventory, CudaError>;
    /// The CUDA checkpoint state of one process; `Ok(None)` when it holds no CUDA state.
    ///
    /// # Errors
    /// [`CudaError`].
    fn process_state(&self, pid: u32) -> Result<Option<CudaProcessState>, CudaError>;
    /// Blocks new CUDA calls of `pid` (RUNNING → LOCKED) within `timeout`.
    ///
    /// # Errors
    /// [`CudaError`]; on a timeout the process stays RUNNING.
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CudaError>;
    /// Moves the GPU state of `pid` into host memory (LOCKED → CHECKPOINTED).
    ///
    /// # Errors
    /// [`CudaError`].
    fn checkpoint(&self, pid: u32) -> Result<(), CudaError>;
    /// Brings the GPU state of `pid` back (CHECKPOINTED → LOCKED). `gpu_map`: (source GPU UUID,
    /// target GPU UUID) pairs; empty = no remapping.
    ///
    /// # Errors
    /// [`CudaError`].
    fn restore(&self, pid: u32, gpu_map: &[(String, String)]) -> Result<(), CudaError>;
    /// Lets `pid` make CUDA calls again (LOCKED → RUNNING).
    ///
    /// # Errors
    /// [`CudaError`].
    fn unlock(&self, pid: u32) -> Result<(), CudaError>;
}

/// The driver and the node's GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaInventory {
    /// `cuDriverGetVersion` (e.g. 12080 = 12.8).
    pub driver_version: i32,
    /// The GPUs, in device order.
    pub gpus: Vec<GpuDevice>,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDevice {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
}

/// `CUprocessState`, read as an integer and mapped (never transmuted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaProcessState {
    /// 0: running.
    Running,
    /// 1: locked (new CUDA calls block).
    Locked,
    /// 2: GPU state in host memory; the process holds no GPU handle.
    Checkpointed,
    /// 3: an unrecoverable error during checkpoint or restore.
    Failed,
    /// A value this build does not know.
    Other(i32),
}

impl CudaProcessState {
    /// Maps the driver's integer.
    pub fn from_raw(value: i32) -> Self {
        match value {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            other => Self::Other(other),
        }
    }
}

/// Why a CUDA call failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver returned an error code.
    #[error("{call} of pid {pid} failed: {name} ({code}): {message}")]
    Driver {
        /// The driver entry point (`cuCheckpointProcessLock`, …).
        call: &'static str,
        /// The process.
        pid: u32,
        /// The `CUresult`.
        code: i32,
        /// `cuGetErrorName`.
        name: String,
        /// `cuGetErrorString`.
        message: String,
    },
    /// The call did not finish in time.
    #[error("{call} of pid {pid} did not finish within {after:?}")]
    Timeout {
        /// The driver entry point.
        call: &'static str,
        /// The process.
        pid: u32,
        /// The deadline that passed.
        after: Duration,
    },
    /// No usable driver on this node.
    #[error("the CUDA driver is unavailable: {reason}")]
    Unavailable {
        /// Why (library missing, symbol missing, too old).
        reason: String,
    },
}

#[cfg(test)]
pub(crate) mod recording {
    //! A recording double of [`Cuda`] for the engine's ordering tests.

    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex, PoisonError};

    use super::*;
    use crate::engine::recording::Journal;

    /// Records every call into a shared journal; `states` says which PIDs hold CUDA state.
    #[derive(Debug)]
    pub struct RecordingCuda {
        pub journal: Arc<Journal>,
        pub states: Mutex<BTreeMap<u32, CudaProcessState>>,
    }

    impl RecordingCuda {
        pub fn new(journal: Arc<Journal>, cuda_pids: &[u32]) -> Self {
            Self {
                journal,
                states: Mutex::new(
                    cuda_pids
                        .iter()
                        .map(|p| (*p, CudaProcessState::Running))
                        .collect(),
                ),
            }
        }

        fn set(&self, pid: u32, state: CudaProcessState) {
            self.states
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(pid, state);
        }
    }

    impl Cuda for RecordingCuda {
        fn inventory(&self) -> Result<CudaInventory, CudaError> {
            self.journal.push("cuda inventory");
            Ok(CudaInventory {
                driver_version: 12080,
                gpus: Vec::new(),
            })
        }
        fn process_state(&self, pid: u32) -> Result<Option<CudaProcessState>, CudaError> {
            Ok(self
                .states
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&pid)
                .copied())
        }
        fn lock(&self, pid: u32, _timeout: Duration) -> Result<(), CudaError> {
            self.journal.push(format!("cuda lock {pid}"));
            self.set(pid, CudaProcessState::Locked);
            Ok(())
        }
        fn checkpoint(&self, pid: u32) -> Result<(), CudaError> {
            self.journal.push(format!("cuda checkpoint {pid}"));
            self.set(pid, CudaProcessState::Checkpointed);
            Ok(())
        }
        fn restore(&self, pid: u32, _gpu_map: &[(String, String)]) -> Result<(), CudaError> {
            self.journal.push(format!("cuda restore {pid}"));
            self.set(pid, CudaProcessState::Locked);
            Ok(())
        }
        fn unlock(&self, pid: u32) -> Result<(), CudaError> {
            self.journal.push(format!("cuda unlock {pid}"));
            self.set(pid, CudaProcessState::Running);
            Ok(())
        }
    }
}
