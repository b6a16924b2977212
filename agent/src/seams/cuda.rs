//! The engine's seam for the CUDA driver's process-checkpoint API (`cuCheckpointProcess*`):
//! what the engine asks of it ([`Cuda`]), and where it gets it ([`CudaSlot`]: opened on first
//! use, so nodes and containers without a GPU never load a driver). The real driver is
//! [`crate::cuda::CudaDriver`] (loaded at run time from `libcuda.so.1`, every call in a
//! killable helper); tests use a recording double or the stand-in library.
//!
//! The steps built on it (parallel lock/checkpoint with rollback, restore/unlock, the GPU
//! checks of a restore) live in [`crate::gpu`].

use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use crate::cuda::{CudaError, CudaInventory, CudaProcessState, GpuDevice, ProbedProcess};

/// The CUDA driver as the engine uses it.
pub trait Cuda: Send + Sync + std::fmt::Debug {
    /// Driver version and the node's GPUs (read once, when the driver was opened).
    fn inventory(&self) -> CudaInventory;
    /// Whether `pid` maps the driver: only such processes are probed.
    fn maps_driver(&self, pid: u32) -> bool {
        crate::cuda::maps_cuda_driver(pid)
    }
    /// The restore thread and state of each of `pids` (processes that map the driver), in
    /// `pids` order.
    ///
    /// # Errors
    /// [`CudaError`], for the first process the driver has no CUDA state for.
    fn probe(&self, pids: &[u32]) -> Result<Vec<ProbedProcess>, CudaError>;
    /// The CUDA state of one process.
    ///
    /// # Errors
    /// [`CudaError`], also when it holds none.
    fn process_state(&self, pid: u32) -> Result<CudaProcessState, CudaError> {
        self.probe(&[pid])?
            .first()
            .map(|p| p.state)
            .ok_or(CudaError::NotCuda { pid })
    }
    /// How long a checkpoint's locks wait for in-flight work.
    fn lock_timeout(&self) -> Duration {
        Duration::from_secs(30)
    }
    /// Blocks new CUDA calls of `pid` (RUNNING → LOCKED) within `timeout`.
    ///
    /// # Errors
    /// [`CudaError`]; on the driver's lock timeout the process stays RUNNING.
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

impl Cuda for crate::cuda::CudaDriver {
    fn inventory(&self) -> CudaInventory {
        crate::cuda::CudaDriver::inventory(self)
    }
    fn process_state(&self, pid: u32) -> Result<CudaProcessState, CudaError> {
        crate::cuda::CudaDriver::process_state(self, pid)
    }
    fn probe(&self, pids: &[u32]) -> Result<Vec<ProbedProcess>, CudaError> {
        crate::cuda::CudaDriver::probe(self, pids)
    }
    fn lock_timeout(&self) -> Duration {
        crate::cuda::CudaDriver::lock_timeout(self)
    }
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CudaError> {
        crate::cuda::CudaDriver::lock(self, pid, timeout)
    }
    fn checkpoint(&self, pid: u32) -> Result<(), CudaError> {
        crate::cuda::CudaDriver::checkpoint(self, pid)
    }
    fn restore(&self, pid: u32, gpu_map: &[(String, String)]) -> Result<(), CudaError> {
        crate::cuda::CudaDriver::restore(self, pid, gpu_map)
    }
    fn unlock(&self, pid: u32) -> Result<(), CudaError> {
        crate::cuda::CudaDriver::unlock(self, pid)
    }
}

type Opener = Box<dyn Fn() -> Result<Arc<dyn Cuda>, CudaError> + Send + Sync>;

/// Where the engine's CUDA driver comes from: none, one given, or one opened on first use and
/// kept (opening runs `cuInit`, which costs seconds on a real GPU node). Cheap to clone: clones
/// share the one driver.
#[derive(Clone)]
pub struct CudaSlot(Arc<Slot>);

struct Slot {
    opener: Option<Opener>,
    opened: OnceLock<Result<Arc<dyn Cuda>, CudaError>>,
}

impl std::fmt::Debug for CudaSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaSlot")
            .field("lazy", &self.0.opener.is_some())
            .field("opened", &self.0.opened.get())
            .finish()
    }
}

fn without_driver() -> CudaError {
    CudaError::Unavailable {
        reason: "this agent runs without a CUDA driver".to_owned(),
    }
}

impl CudaSlot {
    fn settled(result: Result<Arc<dyn Cuda>, CudaError>) -> Self {
        let opened = OnceLock::new();
        let _ = opened.set(result);
        Self(Arc::new(Slot {
            opener: None,
            opened,
        }))
    }

    /// No driver: a workload that uses CUDA is refused.
    pub fn none() -> Self {
        Self::settled(Err(without_driver()))
    }

    /// This driver, already open.
    pub fn with(driver: Arc<dyn Cuda>) -> Self {
        Self::settled(Ok(driver))
    }

    /// A driver opened by `open` the first time one is needed; its error is kept too.
    pub fn lazy(
        open: impl Fn() -> Result<Arc<dyn Cuda>, CudaError> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(Slot {
            opener: Some(Box::new(open)),
            opened: OnceLock::new(),
        }))
    }

    /// `libcuda.so.1` through [`crate::cuda::CudaDriver`], opened on first use.
    pub fn driver(options: crate::cuda::CudaOptions) -> Self {
        Self::lazy(move || {
            crate::cuda::CudaDriver::open(options.clone()).map(|d| Arc::new(d) as Arc<dyn Cuda>)
        })
    }

    /// Whether asking for the driver costs nothing (it is open, or known to be missing).
    pub fn is_settled(&self) -> bool {
        self.0.opened.get().is_some()
    }

    /// The driver, opening it if this is the first use.
    ///
    /// # Errors
    /// Why there is no usable driver (the same answer every time).
    pub fn get(&self) -> Result<Arc<dyn Cuda>, CudaError> {
        self.0
            .opened
            .get_or_init(|| match &self.0.opener {
                Some(open) => open(),
                None => Err(without_driver()),
            })
            .clone()
    }
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
        fn inventory(&self) -> CudaInventory {
            CudaInventory {
                driver_version: 12080,
                gpus: vec![GpuDevice {
                    uuid: "GPU-00000000-0000-0000-0000-000000000001".to_owned(),
                    name: "Recording GPU".to_owned(),
                    memory_bytes: 1 << 30,
                    minor: Some(0),
                }],
            }
        }
        /// The test processes do not load a driver: the ones given as CUDA processes stand
        /// for processes that map it.
        fn maps_driver(&self, pid: u32) -> bool {
            self.states
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(&pid)
        }
        fn probe(&self, pids: &[u32]) -> Result<Vec<ProbedProcess>, CudaError> {
            let states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
            pids.iter()
                .map(|pid| {
                    states
                        .get(pid)
                        .map(|state| ProbedProcess {
                            pid: *pid,
                            restore_tid: i32::try_from(*pid).unwrap_or(0),
                            state: *state,
                        })
                        .ok_or(CudaError::NotCuda { pid: *pid })
                })
                .collect()
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
