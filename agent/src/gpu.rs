//! The GPU steps of a checkpoint and a restore, over the engine's [`Cuda`] seam: finding a
//! tree's CUDA processes, holding them for a dump (lock, then checkpoint, every process in
//! parallel) and giving them back on every path, the GPU checks a restore makes before it
//! claims a placeholder (driver, GPU count, model, memory, remapping), and restoring then
//! unlocking a restored tree's processes in parallel while the tree stays stopped, each
//! process's restore thread woken alone for its calls ([`restore_then_unlock`]).
//!
//! Order and rollback follow CRIU's CUDA plugin (`plugins/cuda/` in CRIU's sources): only processes
//! found RUNNING are taken; a process is counted as changed *before* each call, so a call that
//! fails or times out half-way is rolled back too; rollback re-reads each state and acts on it
//! (CHECKPOINTED → restore, LOCKED → unlock), keeps going past a failed process and reports
//! every one.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use thiserror::Error;
use warmstart_shared::artifact::{CudaProcess, CudaSection, GpuInfo};

use crate::cuda::Call;
use crate::gpu_assignment::Assignment;
use crate::seams::cuda::{
    Cuda, CudaError, CudaInventory, CudaProcessState, CudaSlot, GpuDevice, ProbedProcess,
};
use crate::timings::Timings;

/// How the manifest says the GPU state was captured.
pub const METHOD: &str = "driver-api";

pub use crate::gpu_assignment::VISIBLE_DEVICES_ENV;

/// Why the GPU state of a tree could not be taken or given back.
#[derive(Debug, Error)]
pub enum GpuError {
    /// The tree uses CUDA but the node has no usable driver.
    #[error("pid {pid} maps the CUDA driver, but there is no usable CUDA driver here")]
    NoDriver {
        /// A process that maps `libcuda.so`.
        pid: u32,
        /// Why the driver could not be opened.
        source: CudaError,
    },
    /// A process maps the CUDA driver, but the driver has no CUDA state for it. It is not
    /// skipped: no result code is documented to mean "this process uses no GPU", and a
    /// skipped CUDA process would make the dump fail later on its device mappings.
    #[error(
        "pid {pid} maps the CUDA driver, but the driver gives no CUDA state for it, so it is not known to be safe to dump: {source}"
    )]
    NoCudaState {
        /// The process.
        pid: u32,
        /// The driver's answer.
        source: CudaError,
    },
    /// A process is in the driver's FAILED state: an earlier checkpoint or restore of it
    /// failed beyond repair.
    #[error(
        "pid {pid} is in the CUDA driver's FAILED state: its GPU state was lost by an earlier checkpoint or restore that failed; only restarting it helps"
    )]
    Failed {
        /// The process.
        pid: u32,
    },
    /// A process was found locked or checkpointed (or in a transient state of a newer
    /// driver): another controller holds it, and only processes found running are taken
    /// (their state is the other party's to give back).
    #[error("pid {pid} is already {state}: another controller holds its GPU state")]
    Busy {
        /// The process.
        pid: u32,
        /// Its state.
        state: CudaProcessState,
    },
    /// A driver call failed for one or more processes.
    #[error("{step} failed for {failed} of {total} CUDA process(es); first: {first}")]
    Calls {
        /// `lock`, `checkpoint`, `restore` or `unlock`.
        step: &'static str,
        /// How many failed.
        failed: usize,
        /// How many were asked.
        total: usize,
        /// The first failure (in PID order).
        first: CudaError,
    },
    /// Probing the tree failed.
    #[error("cannot read the CUDA state of the tree")]
    Probe(#[source] CudaError),
    /// A call succeeded but left a process in another state than it should have.
    #[error("after {step}, pid {pid} is {found} instead of {expected}")]
    UnexpectedState {
        /// The step.
        step: &'static str,
        /// The process.
        pid: u32,
        /// What it should be.
        expected: CudaProcessState,
        /// What it is.
        found: String,
    },
    /// The placeholder's GPU device nodes could not be put into the restored tree's `/dev`.
    #[error("pid {pid}: {source}")]
    DeviceNodes {
        /// A restored process in that mount namespace.
        pid: u32,
        /// What failed.
        source: crate::mounts::GpuNodesError,
    },
    /// The CUDA restore thread of a stopped process could not be woken alone, or stopped
    /// again after its restore.
    #[error(
        "pid {pid}: cannot {step} its CUDA restore thread {tid} while the rest of the restored tree stays stopped: {source}"
    )]
    RestoreThread {
        /// The process.
        pid: u32,
        /// The driver's restore thread (host TID).
        tid: i32,
        /// `find`, `wake` or `stop again`.
        step: &'static str,
        /// The ptrace error.
        source: std::io::Error,
    },
    /// The restored tree holds fewer CUDA processes than the checkpoint did.
    #[error("the checkpoint held {expected} CUDA process(es), the restored tree {found}")]
    MissingProcesses {
        /// In the manifest.
        expected: usize,
        /// Found checkpointed in the restored tree.
        found: usize,
    },
}

/// Why a restore's GPU state cannot go into this placeholder (checked before the claim:
/// nothing was restored).
#[derive(Debug, Error)]
pub enum GpuRefusal {
    /// No usable driver on this node.
    #[error("the artifact holds GPU state but this node has no usable CUDA driver: {0}")]
    NoDriver(#[source] CudaError),
    /// The driver is older than the one that made the checkpoint.
    #[error(
        "the artifact was captured with CUDA driver {needed}; this node's driver is {found}, older"
    )]
    DriverTooOld {
        /// The source's driver (text as in the manifest).
        needed: String,
        /// This node's.
        found: String,
    },
    /// The manifest's driver version is not `major.minor`.
    #[error("the artifact's CUDA driver version {0:?} is not major.minor")]
    BadDriverVersion(String),
    /// The placeholder sees fewer GPUs than the checkpoint used.
    #[error("the artifact used {needed} GPU(s); the placeholder sees {found} ({visible})")]
    TooFewGpus {
        /// In the manifest.
        needed: usize,
        /// Visible to the placeholder.
        found: usize,
        /// How the visible set was decided.
        visible: String,
    },
    /// A placeholder GPU is another model.
    #[error("GPU {index} of the artifact is a {needed}; the placeholder's is a {found} ({uuid})")]
    OtherModel {
        /// Position in the checkpoint's GPU list.
        index: usize,
        /// The checkpoint's model.
        needed: String,
        /// The placeholder's model.
        found: String,
        /// The placeholder's GPU.
        uuid: String,
    },
    /// A placeholder GPU has less memory than the checkpoint's.
    #[error(
        "GPU {index} of the artifact has {needed} bytes of memory; the placeholder's {uuid} has {found}"
    )]
    LessMemory {
        /// Position in the checkpoint's GPU list.
        index: usize,
        /// The checkpoint GPU's memory.
        needed: u64,
        /// The placeholder GPU's memory.
        found: u64,
        /// The placeholder's GPU.
        uuid: String,
    },
    /// The GPUs differ and the driver cannot remap.
    #[error(
        "the placeholder's GPUs ({targets}) are not the checkpoint's ({sources}), and restoring onto other GPUs needs CUDA driver 13.0 (r580) or newer; this node has {driver}"
    )]
    RemapUnsupported {
        /// The checkpoint's UUIDs.
        sources: String,
        /// The placeholder's UUIDs.
        targets: String,
        /// This node's driver.
        driver: String,
    },
    /// The GPUs differ, and the manifest does not say which GPUs each process held (it was
    /// written before that was recorded): the pairs each process needs are unknown.
    #[error(
        "the placeholder's GPUs ({targets}) are not the checkpoint's ({sources}), and the artifact does not record which GPUs each CUDA process held (it was captured by an older warmstart): it can be restored only onto the GPUs it was captured on; capture it again to restore it elsewhere"
    )]
    NoProcessGpus {
        /// The checkpoint's UUIDs.
        sources: String,
        /// The placeholder's UUIDs.
        targets: String,
    },
}

pub use crate::cuda::maps_cuda_driver;

/// The processes of `tree` that map the driver, in tree order: the only ones probed.
fn cuda_users(driver: &dyn Cuda, tree: &[u32]) -> Vec<u32> {
    tree.iter()
        .copied()
        .filter(|pid| driver.maps_driver(*pid))
        .collect()
}

/// Probes `users` (processes that map the driver); one the driver has no state for stops
/// the operation, named.
fn probe_users(driver: &dyn Cuda, users: &[u32]) -> Result<Vec<ProbedProcess>, GpuError> {
    driver.probe(users).map_err(|source| match &source {
        CudaError::Driver {
            call: Call::GetRestoreThreadId | Call::GetState,
            pid: Some(pid),
            ..
        } => GpuError::NoCudaState { pid: *pid, source },
        CudaError::NotCuda { pid } => GpuError::NoCudaState { pid: *pid, source },
        _ => GpuError::Probe(source),
    })
}

/// Refuses a process that is not RUNNING: FAILED is lost, anything else is held elsewhere.
fn require_running(probed: &[ProbedProcess]) -> Result<(), GpuError> {
    for p in probed {
        match p.state {
            CudaProcessState::Running => {}
            CudaProcessState::Failed => return Err(GpuError::Failed { pid: p.pid }),
            state => return Err(GpuError::Busy { pid: p.pid, state }),
        }
    }
    Ok(())
}

/// Runs `call` for every PID at once (a thread each: every call blocks on its own helper
/// process), results in `pids` order.
fn each<T: Send>(
    pids: &[u32],
    call: impl Fn(u32) -> Result<T, CudaError> + Sync,
) -> Vec<(u32, Result<T, CudaError>)> {
    if let [pid] = pids {
        return vec![(*pid, call(*pid))];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = pids
            .iter()
            .map(|pid| {
                let call = &call;
                (*pid, scope.spawn(move || call(*pid)))
            })
            .collect();
        handles
            .into_iter()
            .map(|(pid, handle)| {
                let result = handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (pid, result)
            })
            .collect()
    })
}

/// The first failure of a parallel step, logged with every other.
fn failures<T>(
    step: &'static str,
    results: Vec<(u32, Result<T, CudaError>)>,
) -> Result<(), GpuError> {
    let total = results.len();
    let errors: Vec<(u32, CudaError)> = results
        .into_iter()
        .filter_map(|(pid, r)| r.err().map(|e| (pid, e)))
        .collect();
    for (pid, err) in &errors {
        tracing::error!(pid, step, error = %err, "CUDA call failed");
    }
    let failed = errors.len();
    match errors.into_iter().next() {
        None => Ok(()),
        Some((_, first)) => Err(GpuError::Calls {
            step,
            failed,
            total,
            first,
        }),
    }
}

/// The CUDA processes of a tree, held (locked and checkpointed) for its dump. Given back
/// (restored and unlocked) on every path — drop included — unless disarmed after the tree was
/// killed.
#[derive(Debug)]
pub struct Hold {
    driver: Option<Arc<dyn Cuda>>,
    inventory: Option<CudaInventory>,
    gpus: Vec<GpuDevice>,
    /// Processes this hold changed (or may have changed).
    pids: Vec<u32>,
    /// Processes held, for the manifest.
    held: Vec<u32>,
    /// Each held process and the GPUs it held, for the manifest.
    processes: Vec<CudaProcess>,
}

impl Hold {
    /// Nothing held.
    pub fn empty() -> Self {
        Self {
            driver: None,
            inventory: None,
            gpus: Vec::new(),
            pids: Vec::new(),
            held: Vec::new(),
            processes: Vec::new(),
        }
    }

    /// Locks, then checkpoints, every CUDA process of `tree` (host PIDs, root first), each step
    /// for all processes in parallel. Opens the driver only when a process of the tree maps
    /// it, unless it is open already.
    ///
    /// # Errors
    /// [`GpuError`]; every process is back in the state it was found in.
    ///
    /// `assigned` is what the container was given (see [`crate::gpu_assignment`]): a process
    /// whose open device nodes name no known GPU is recorded as holding all of those (every
    /// GPU of the node when the container's are not known).
    pub fn take(
        slot: &CudaSlot,
        tree: &[u32],
        assigned: Option<&Assignment>,
        timings: &mut Timings,
    ) -> Result<Self, GpuError> {
        let user = tree.iter().copied().find(|pid| maps_cuda_driver(*pid));
        if !slot.is_settled() && user.is_none() {
            return Ok(Self::empty());
        }
        let driver = match (slot.get(), user) {
            (Ok(driver), _) => driver,
            (Err(source), Some(pid)) => return Err(GpuError::NoDriver { pid, source }),
            (Err(_), None) => return Ok(Self::empty()),
        };
        let users = cuda_users(driver.as_ref(), tree);
        if users.is_empty() {
            return Ok(Self::empty());
        }
        let probed = probe_users(driver.as_ref(), &users)?;
        require_running(&probed)?;
        let inventory = driver.inventory();
        let visible = assigned
            .and_then(|a| a.gpus.clone())
            .unwrap_or_else(|| inventory.gpus.clone());
        let pids: Vec<u32> = probed.iter().map(|p| p.pid).collect();
        // Read before the checkpoint, which closes the device nodes.
        let processes: Vec<CudaProcess> = pids
            .iter()
            .map(|pid| held_by(*pid, &inventory, &visible))
            .collect();
        let gpus = inventory
            .gpus
            .iter()
            .filter(|g| processes.iter().any(|p| p.gpus.contains(&g.uuid)))
            .cloned()
            .collect();
        let mut hold = Self {
            driver: Some(driver.clone()),
            inventory: Some(inventory),
            gpus,
            // Counted before the calls: a lock that times out half-way is undone too.
            pids: pids.clone(),
            held: pids.clone(),
            processes,
        };
        if pids.is_empty() {
            return Ok(hold);
        }
        let lock_timeout = driver.lock_timeout();
        tracing::info!(
            ?pids,
            ?lock_timeout,
            "locking and checkpointing the GPU state"
        );
        let locked = timings.measure("cuda-lock", || {
            failures("lock", each(&pids, |pid| driver.lock(pid, lock_timeout)))
        });
        let checkpointed = locked.and_then(|()| {
            timings.measure("cuda-checkpoint", || {
                failures("checkpoint", each(&pids, |pid| driver.checkpoint(pid)))
            })
        });
        let verified = checkpointed.and_then(|()| {
            expect_states(
                driver.as_ref(),
                &pids,
                "checkpoint",
                CudaProcessState::Checkpointed,
            )
        });
        if let Err(err) = verified {
            hold.release();
            return Err(err);
        }
        Ok(hold)
    }

    /// The manifest's CUDA section, when the tree held CUDA state.
    pub fn section(&self) -> Option<CudaSection> {
        let inventory = self.inventory.as_ref()?;
        if self.held.is_empty() {
            return None;
        }
        Some(CudaSection {
            driver_version: inventory.driver_version_text(),
            gpus: self
                .gpus
                .iter()
                .map(|g| GpuInfo {
                    uuid: g.uuid.clone(),
                    model: g.name.clone(),
                    memory_bytes: g.memory_bytes,
                })
                .collect(),
            pids: self.held.clone(),
            method: METHOD.to_owned(),
            processes: self.processes.clone(),
        })
    }

    /// Whether processes are held (and would be given back).
    pub fn is_holding(&self) -> bool {
        !self.pids.is_empty()
    }

    /// After the tree was killed: nothing left to give back.
    pub fn disarm(&mut self) {
        self.pids.clear();
    }

    /// Gives every process back: restore (if checkpointed), then unlock (if locked), all in
    /// parallel, each acting on the state it finds. Failures are logged and returned.
    pub fn release(&mut self) -> Vec<(u32, CudaError)> {
        let pids = std::mem::take(&mut self.pids);
        let Some(driver) = &self.driver else {
            return Vec::new();
        };
        if pids.is_empty() {
            return Vec::new();
        }
        let results = each(&pids, |pid| give_back(driver.as_ref(), pid));
        let errors: Vec<(u32, CudaError)> = results
            .into_iter()
            .filter_map(|(pid, r)| r.err().map(|e| (pid, e)))
            .collect();
        for (pid, err) in &errors {
            tracing::error!(pid, error = %err, "cannot give a process its GPU state back");
        }
        errors
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

/// Gives back the GPU state of every process of `tree` (host PIDs) found locked or
/// checkpointed, restoring then unlocking each, all at once: what a checkpoint interrupted by
/// the agent's death leaves behind (its workload frozen on the GPU). Processes found running
/// are not touched. Returns the processes given back.
///
/// # Errors
/// [`GpuError::Probe`], or [`GpuError::Calls`] for the processes that could not be given back
/// (every other one was).
pub fn give_back_tree(driver: &dyn Cuda, tree: &[u32]) -> Result<Vec<u32>, GpuError> {
    let users = cuda_users(driver, tree);
    let mut held = Vec::new();
    let mut results = Vec::new();
    for (pid, state) in each(&users, |pid| driver.process_state(pid)) {
        match state {
            Ok(CudaProcessState::Locked | CudaProcessState::Checkpointed) => held.push(pid),
            Ok(CudaProcessState::Failed) => {
                tracing::error!(
                    pid,
                    "a process left in the CUDA driver's FAILED state cannot be given its GPU state back"
                );
            }
            Ok(_) => {}
            // Each process that cannot be read is reported; the others are still given back.
            Err(err) => results.push((pid, Err(err))),
        }
    }
    if !held.is_empty() {
        tracing::warn!(?held, "giving back GPU state left held");
        results.extend(each(&held, |pid| give_back(driver, pid)));
    }
    failures("give back", results)?;
    Ok(held)
}

/// [`give_back_tree`] through the node's driver slot, opened only when a process of `tree`
/// maps the driver (a CPU workload never costs a `cuInit`).
///
/// # Errors
/// [`GpuError::NoDriver`] when a process maps the driver but none opens, and those of
/// [`give_back_tree`].
pub fn reclaim(slot: &CudaSlot, tree: &[u32]) -> Result<Vec<u32>, GpuError> {
    let Some(user) = tree.iter().copied().find(|pid| maps_cuda_driver(*pid)) else {
        return Ok(Vec::new());
    };
    let driver = slot
        .get()
        .map_err(|source| GpuError::NoDriver { pid: user, source })?;
    give_back_tree(driver.as_ref(), tree)
}

/// Restores then unlocks one process, from whatever state it is in.
fn give_back(driver: &dyn Cuda, pid: u32) -> Result<(), CudaError> {
    let mut state = driver.process_state(pid)?;
    if state == CudaProcessState::Checkpointed {
        // A failed restore may still have left it LOCKED: unlock it then (notes §4).
        let restored = driver.restore(pid, &[]);
        state = driver.process_state(pid)?;
        if state != CudaProcessState::Locked {
            return restored;
        }
    }
    if state == CudaProcessState::Locked {
        driver.unlock(pid)?;
    }
    Ok(())
}

fn expect_states(
    driver: &dyn Cuda,
    pids: &[u32],
    step: &'static str,
    expected: CudaProcessState,
) -> Result<(), GpuError> {
    let found: BTreeMap<u32, CudaProcessState> = probe_users(driver, pids)?
        .into_iter()
        .map(|p| (p.pid, p.state))
        .collect();
    for pid in pids {
        match found.get(pid) {
            Some(state) if *state == expected => {}
            other => {
                return Err(GpuError::UnexpectedState {
                    step,
                    pid: *pid,
                    expected,
                    found: other
                        .map_or_else(|| "without CUDA state".to_owned(), ToString::to_string),
                });
            }
        }
    }
    Ok(())
}

/// The node's GPUs, when the driver is open or a process of `tree` maps it (a CPU workload
/// never costs a `cuInit`); `None` without a usable driver.
pub fn inventory_for(slot: &CudaSlot, tree: &[u32]) -> Option<CudaInventory> {
    if !slot.is_settled() && !tree.iter().any(|pid| maps_cuda_driver(*pid)) {
        return None;
    }
    slot.get().ok().map(|driver| driver.inventory())
}

/// The minors of the GPU device nodes `pid` has open (`/dev/nvidia<minor>`: character
/// devices of the NVIDIA major below its control minors), whatever their names in its mount
/// namespace.
pub fn held_gpu_minors(pid: u32) -> std::collections::BTreeSet<u32> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return std::collections::BTreeSet::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            // Follows the descriptor's link: the node itself, in whatever namespace.
            let meta = std::fs::metadata(fd.path()).ok()?;
            let rdev = meta.rdev();
            let minor = nix::sys::stat::minor(rdev);
            (meta.file_type().is_char_device()
                && nix::sys::stat::major(rdev) == crate::mounts::NVIDIA_MAJOR
                && minor < NVIDIA_FIRST_CONTROL_MINOR)
                .then(|| u32::try_from(minor).ok())
                .flatten()
        })
        .collect()
}

/// The NVIDIA minors from here up are control devices (`nvidia-modeset` 254, `nvidiactl` 255).
const NVIDIA_FIRST_CONTROL_MINOR: u64 = 254;

/// `pid`'s PID in its own PID namespace (the last `NSpid` field).
pub fn ns_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The GPUs `pid` holds, from its open device nodes. When none of a known GPU is open (the
/// kernel module lists no minors here, or the process opened none), every GPU its container
/// sees is recorded instead: a restore then pairs them all, as before per-process GPUs were
/// recorded.
fn held_by(pid: u32, inventory: &CudaInventory, visible: &[GpuDevice]) -> CudaProcess {
    let minors = held_gpu_minors(pid);
    let mut gpus: Vec<String> = inventory
        .gpus
        .iter()
        .filter(|g| g.minor.is_some_and(|m| minors.contains(&m)))
        .map(|g| g.uuid.clone())
        .collect();
    if gpus.is_empty() {
        tracing::warn!(
            pid,
            ?minors,
            "no open device node of a known GPU in this CUDA process: recording every GPU its container sees"
        );
        gpus = visible.iter().map(|g| g.uuid.clone()).collect();
    }
    CudaProcess {
        pid,
        ns_pid: ns_pid(pid).unwrap_or(pid),
        gpus,
    }
}

/// One variable of a process's environment; `None` when it is unset or the environment cannot
/// be read (the process is gone).
///
/// # Errors
/// [`crate::procfs::ProcError::TooLarge`]: the environment is longer than
/// [`crate::procfs::ENVIRON_MAX_BYTES`] (a workload made it so), and nothing of it is trusted.
pub fn environ_var(pid: u32, name: &str) -> Result<Option<String>, crate::procfs::ProcError> {
    let environ = match crate::procfs::read(pid, "environ", crate::procfs::ENVIRON_MAX_BYTES) {
        Ok(environ) => environ,
        Err(crate::procfs::ProcError::Io { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(environ.split(|b| *b == 0).find_map(|entry| {
        let text = std::str::from_utf8(entry).ok()?;
        let (key, value) = text.split_once('=')?;
        (key == name).then(|| value.to_owned())
    }))
}

/// `12.8` → 12080.
fn parse_driver_version(text: &str) -> Option<i32> {
    let (major, minor) = text.split_once('.')?;
    Some(major.parse::<i32>().ok()? * 1000 + minor.parse::<i32>().ok()? * 10)
}

/// What a restore does with the GPU state, decided before the claim.
#[derive(Clone, Debug)]
pub struct RestorePlan {
    driver: Arc<dyn Cuda>,
    /// (checkpoint GPU, placeholder GPU) UUID pairs; empty when they are the same GPUs.
    pub gpu_map: Vec<(String, String)>,
    /// How many CUDA processes the checkpoint held.
    pub processes: usize,
    /// Each checkpointed process and its GPUs (empty for manifests without them).
    held: Vec<CudaProcess>,
}

/// Checks that the GPU state of `section` can go into a placeholder given the GPUs
/// `assigned` (`None`: none) on this node, and decides the GPU remapping.
///
/// # Errors
/// [`GpuRefusal`], naming what is missing.
pub fn plan_restore(
    slot: &CudaSlot,
    section: &CudaSection,
    assigned: Option<&Assignment>,
) -> Result<RestorePlan, GpuRefusal> {
    let driver = slot.get().map_err(GpuRefusal::NoDriver)?;
    let inventory = driver.inventory();
    let needed = parse_driver_version(&section.driver_version)
        .ok_or_else(|| GpuRefusal::BadDriverVersion(section.driver_version.clone()))?;
    if inventory.driver_version < needed {
        return Err(GpuRefusal::DriverTooOld {
            needed: section.driver_version.clone(),
            found: inventory.driver_version_text(),
        });
    }
    let (targets, visible) = match assigned {
        Some(a) => (a.gpus.clone().unwrap_or_default(), a.recorded.to_string()),
        None => (Vec::new(), "given no GPU".to_owned()),
    };
    if targets.len() < section.gpus.len() {
        return Err(GpuRefusal::TooFewGpus {
            needed: section.gpus.len(),
            found: targets.len(),
            visible,
        });
    }
    let mut gpu_map = Vec::new();
    for (index, (source, target)) in section.gpus.iter().zip(&targets).enumerate() {
        if !source.model.is_empty() && source.model != target.name {
            return Err(GpuRefusal::OtherModel {
                index,
                needed: source.model.clone(),
                found: target.name.clone(),
                uuid: target.uuid.clone(),
            });
        }
        if target.memory_bytes < source.memory_bytes {
            return Err(GpuRefusal::LessMemory {
                index,
                needed: source.memory_bytes,
                found: target.memory_bytes,
                uuid: target.uuid.clone(),
            });
        }
        gpu_map.push((source.uuid.clone(), target.uuid.clone()));
    }
    if gpu_map.iter().all(|(s, t)| s.eq_ignore_ascii_case(t)) {
        gpu_map.clear();
    } else if inventory.driver_version < crate::cuda::ffi::REMAP_MIN_DRIVER {
        let (sources, targets) = map_sides(&gpu_map);
        return Err(GpuRefusal::RemapUnsupported {
            sources,
            targets,
            driver: inventory.driver_version_text(),
        });
    }
    if !gpu_map.is_empty() && section.processes.is_empty() && !section.pids.is_empty() {
        let (sources, targets) = map_sides(&gpu_map);
        return Err(GpuRefusal::NoProcessGpus { sources, targets });
    }
    Ok(RestorePlan {
        driver,
        gpu_map,
        processes: section.pids.len(),
        held: section.processes.clone(),
    })
}

impl RestorePlan {
    /// Restores, then unlocks, every checkpointed CUDA process of a restored tree (host PIDs),
    /// each step for all processes in parallel.
    ///
    /// # Errors
    /// [`GpuError`]; the caller kills the tree (a half-restored worker must not look alive).
    ///
    /// First the placeholder's (host PID `placeholder`) NVIDIA device nodes replace the
    /// checkpoint's in `/dev` of the restored processes' mount namespace: the driver reopens
    /// the GPUs' nodes there. Each process is then given the pairs of its own GPUs only.
    pub fn restore(
        &self,
        placeholder: u32,
        tree: &[u32],
        timings: &mut Timings,
    ) -> Result<Vec<u32>, GpuError> {
        let driver = self.driver.as_ref();
        let probed = probe_users(driver, &cuda_users(driver, tree))?;
        if let Some(failed) = probed.iter().find(|p| p.state == CudaProcessState::Failed) {
            return Err(GpuError::Failed { pid: failed.pid });
        }
        let pids: Vec<u32> = probed
            .iter()
            .filter(|p| p.state == CudaProcessState::Checkpointed)
            .map(|p| p.pid)
            .collect();
        if pids.len() < self.processes {
            return Err(GpuError::MissingProcesses {
                expected: self.processes,
                found: pids.len(),
            });
        }
        let mut namespaces = std::collections::BTreeSet::new();
        for pid in &pids {
            let ns = std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
            if namespaces.insert(ns) {
                let changes = crate::mounts::install_gpu_nodes(placeholder, *pid)
                    .map_err(|source| GpuError::DeviceNodes { pid: *pid, source })?;
                if !changes.is_empty() {
                    tracing::info!(
                        pid,
                        ?changes,
                        "the placeholder's GPU device nodes are in place"
                    );
                }
            }
        }
        tracing::info!(
            ?pids,
            remapped = !self.gpu_map.is_empty(),
            "restoring the GPU state"
        );
        let tids: BTreeMap<u32, i32> = probed.iter().map(|p| (p.pid, p.restore_tid)).collect();
        restore_then_unlock(driver, &pids, &tids, |pid| self.pairs_for(pid), timings)?;
        expect_states(driver, &pids, "unlock", CudaProcessState::Running)?;
        Ok(pids)
    }
}

/// What one process's restore thread did: woken (or it was not stopped), restore, unlock.
#[derive(Debug, Default)]
struct Steps {
    wake: Option<GpuError>,
    restore: Option<Result<(), CudaError>>,
    unlock: Option<Result<(), CudaError>>,
    restore_took: std::time::Duration,
    unlock_took: std::time::Duration,
}

/// Restores, then unlocks, every one of `pids`, each step for all at once (every restore
/// has ended before the first unlock; none is unlocked when one restore failed). A process
/// whose restore thread (`tids`, as the driver named it) is stopped, as a restored tree's
/// is, has that thread alone woken around its calls and stopped again after them, as CRIU's
/// CUDA plugin does: the restore thread does the driver's work, while the application's
/// threads must not run before their device memory is back.
///
/// # Errors
/// [`GpuError::RestoreThread`] first, then [`GpuError::Calls`] for the restores, then for
/// the unlocks.
pub fn restore_then_unlock(
    driver: &dyn Cuda,
    pids: &[u32],
    tids: &BTreeMap<u32, i32>,
    pairs: impl Fn(u32) -> Vec<(String, String)> + Sync,
    timings: &mut Timings,
) -> Result<(), GpuError> {
    let both = Phases {
        restored: std::sync::Barrier::new(pids.len()),
        restore_failed: std::sync::atomic::AtomicBool::new(false),
    };
    let results: Vec<(u32, Steps)> = std::thread::scope(|scope| {
        let handles: Vec<_> = pids
            .iter()
            .map(|pid| {
                let (both, pairs) = (&both, &pairs);
                let tid = tids.get(pid).copied();
                (
                    *pid,
                    scope.spawn(move || both.run(driver, *pid, tid, pairs(*pid))),
                )
            })
            .collect();
        handles
            .into_iter()
            .map(|(pid, handle)| {
                let steps = handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                (pid, steps)
            })
            .collect()
    });
    let longest = |took: fn(&Steps) -> std::time::Duration| {
        results
            .iter()
            .map(|(_, s)| took(s))
            .max()
            .unwrap_or_default()
    };
    timings.record("cuda-restore", longest(|s| s.restore_took));
    if results.iter().any(|(_, s)| s.unlock.is_some()) {
        timings.record("cuda-unlock", longest(|s| s.unlock_took));
    }
    let mut restores = Vec::new();
    let mut unlocks = Vec::new();
    let mut wake = None;
    for (pid, steps) in results {
        if let Some(err) = steps.wake {
            tracing::error!(pid, error = %err, "CUDA restore thread");
            wake.get_or_insert(err);
        }
        restores.extend(steps.restore.map(|r| (pid, r)));
        unlocks.extend(steps.unlock.map(|r| (pid, r)));
    }
    if let Some(err) = wake {
        return Err(err);
    }
    failures("restore", restores)?;
    failures("unlock", unlocks)
}

/// What the processes of one [`restore_then_unlock`] share: every restore ends before the
/// first unlock, and none is unlocked when one restore failed.
struct Phases {
    restored: std::sync::Barrier,
    restore_failed: std::sync::atomic::AtomicBool,
}

impl Phases {
    /// One process, on a thread of its own (the one that wakes its restore thread must make
    /// every ptrace request on it).
    fn run(
        &self,
        driver: &dyn Cuda,
        pid: u32,
        tid: Option<i32>,
        pairs: Vec<(String, String)>,
    ) -> Steps {
        use std::sync::atomic::Ordering;
        let mut steps = Steps::default();
        let woken = match wake_if_stopped(pid, tid) {
            Ok(woken) => Some(woken),
            Err(err) => {
                steps.wake = Some(err);
                None
            }
        };
        if woken.is_some() {
            let started = std::time::Instant::now();
            steps.restore = Some(driver.restore(pid, &pairs));
            steps.restore_took = started.elapsed();
        }
        if !matches!(steps.restore, Some(Ok(()))) {
            self.restore_failed.store(true, Ordering::SeqCst);
        }
        self.restored.wait();
        if !self.restore_failed.load(Ordering::SeqCst) {
            let started = std::time::Instant::now();
            steps.unlock = Some(driver.unlock(pid));
            steps.unlock_took = started.elapsed();
        }
        if let Some(Some((tid, thread))) = woken
            && let Err(source) = thread.stop()
        {
            steps.wake.get_or_insert(GpuError::RestoreThread {
                pid,
                tid,
                step: "stop again",
                source,
            });
        }
        steps
    }
}

/// Wakes `pid`'s restore thread `tid` alone when it is stopped (`Some`); `None` when it is
/// not (the process runs: nothing to do).
fn wake_if_stopped(
    pid: u32,
    tid: Option<i32>,
) -> Result<Option<(i32, crate::sys::ptrace::Woken)>, GpuError> {
    let stopped = |tid: i32| thread_state(pid, tid) == Some('T');
    let pid_tid = i32::try_from(pid).unwrap_or(i32::MAX);
    let Some(tid) = tid.and_then(|tid| crate::cuda::host_tid(pid, tid)) else {
        // A stopped process whose restore thread cannot be found would hang its restore.
        return match tid {
            Some(raw) if stopped(pid_tid) => Err(GpuError::RestoreThread {
                pid,
                tid: raw,
                step: "find",
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the driver named no thread of this process",
                ),
            }),
            _ => Ok(None),
        };
    };
    if !stopped(tid) {
        return Ok(None);
    }
    tracing::debug!(pid, tid, "waking the CUDA restore thread alone");
    crate::sys::ptrace::wake_alone(tid)
        .map(|woken| Some((tid, woken)))
        .map_err(|source| GpuError::RestoreThread {
            pid,
            tid,
            step: "wake",
            source,
        })
}

/// The state letter of thread `tid` of `pid` (`T`: stopped by a signal).
fn thread_state(pid: u32, tid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

impl RestorePlan {
    /// The pairs of restored process `pid`'s own GPUs (found by its PID in the container,
    /// which CRIU restores); every pair when the manifest does not say.
    fn pairs_for(&self, pid: u32) -> Vec<(String, String)> {
        if self.gpu_map.is_empty() {
            return Vec::new();
        }
        let ns = ns_pid(pid);
        match self.held.iter().find(|p| Some(p.ns_pid) == ns) {
            Some(process) => self
                .gpu_map
                .iter()
                .filter(|(source, _)| process.gpus.iter().any(|g| g.eq_ignore_ascii_case(source)))
                .cloned()
                .collect(),
            None => self.gpu_map.clone(),
        }
    }
}

/// The source and the target GPUs of a GPU map, each comma-separated, for a refusal.
fn map_sides(gpu_map: &[(String, String)]) -> (String, String) {
    let side = |pick: fn(&(String, String)) -> &str| {
        gpu_map.iter().map(pick).collect::<Vec<_>>().join(",")
    };
    (side(|p| &p.0), side(|p| &p.1))
}

/// Whether `root` (a path to a process's root) has the NVIDIA control device.
pub fn has_gpu_device(root: &Path) -> bool {
    root.join("dev/nvidiactl").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory(driver_version: i32, gpus: &[(&str, &str, u64)]) -> CudaInventory {
        CudaInventory {
            driver_version,
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(minor, (uuid, name, memory_bytes))| GpuDevice {
                    uuid: (*uuid).to_owned(),
                    name: (*name).to_owned(),
                    memory_bytes: *memory_bytes,
                    minor: u32::try_from(minor).ok(),
                })
                .collect(),
        }
    }

    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    #[test]
    fn driver_versions_read_as_the_manifest_writes_them() {
        assert_eq!(parse_driver_version("12.8"), Some(12080));
        assert_eq!(parse_driver_version("13.0"), Some(13000));
        assert_eq!(
            parse_driver_version(&inventory(12090, &[]).driver_version_text()),
            Some(12090)
        );
        assert_eq!(parse_driver_version("580"), None);
    }

    #[test]
    fn only_processes_that_map_the_driver_can_hold_cuda_state() {
        // This test process does not load libcuda.
        assert!(!maps_cuda_driver(std::process::id()));
        assert!(!maps_cuda_driver(u32::MAX));
    }

    /// A driver with a fixed set of processes: `answers` holds every process that maps it,
    /// with its state or the driver's error; calls move the states as the driver does, and
    /// every probed PID and call is recorded.
    #[derive(Debug, Default)]
    struct FixedDriver {
        answers: std::sync::Mutex<BTreeMap<u32, Result<CudaProcessState, CudaError>>>,
        probed: std::sync::Mutex<Vec<u32>>,
        calls: std::sync::Mutex<Vec<String>>,
        /// A process whose restore fails.
        fail_restore: Option<u32>,
    }

    impl FixedDriver {
        fn step(&self, call: &str, pid: u32, to: CudaProcessState) -> Result<(), CudaError> {
            self.calls.lock().unwrap().push(format!("{call} {pid}"));
            self.answers.lock().unwrap().insert(pid, Ok(to));
            Ok(())
        }
    }

    impl Cuda for FixedDriver {
        fn inventory(&self) -> CudaInventory {
            inventory(13000, &[(A, "H200", 1)])
        }
        fn maps_driver(&self, pid: u32) -> bool {
            self.answers.lock().unwrap().contains_key(&pid)
        }
        fn probe(&self, pids: &[u32]) -> Result<Vec<ProbedProcess>, CudaError> {
            self.probed.lock().unwrap().extend_from_slice(pids);
            let answers = self.answers.lock().unwrap();
            pids.iter()
                .map(|pid| match answers.get(pid) {
                    Some(Ok(state)) => Ok(ProbedProcess {
                        pid: *pid,
                        restore_tid: 1,
                        state: *state,
                    }),
                    Some(Err(err)) => Err(err.clone()),
                    None => panic!("pid {pid} does not map the driver and was probed"),
                })
                .collect()
        }
        fn lock(&self, pid: u32, _: std::time::Duration) -> Result<(), CudaError> {
            self.step("lock", pid, CudaProcessState::Locked)
        }
        fn checkpoint(&self, pid: u32) -> Result<(), CudaError> {
            self.step("checkpoint", pid, CudaProcessState::Checkpointed)
        }
        fn restore(&self, pid: u32, _: &[(String, String)]) -> Result<(), CudaError> {
            if self.fail_restore == Some(pid) {
                self.calls
                    .lock()
                    .unwrap()
                    .push(format!("restore {pid} failed"));
                return Err(CudaError::NotCuda { pid });
            }
            self.step("restore", pid, CudaProcessState::Locked)
        }
        fn unlock(&self, pid: u32) -> Result<(), CudaError> {
            self.step("unlock", pid, CudaProcessState::Running)
        }
    }

    fn take(
        answers: Vec<(u32, Result<CudaProcessState, CudaError>)>,
    ) -> (Arc<FixedDriver>, Result<Hold, GpuError>) {
        let driver = Arc::new(FixedDriver {
            answers: std::sync::Mutex::new(answers.into_iter().collect()),
            ..FixedDriver::default()
        });
        let slot = CudaSlot::with(driver.clone());
        // 1 and 2 never map the driver.
        let held = Hold::take(&slot, &[1, 10, 2, 11], None, &mut Timings::default());
        (driver, held)
    }

    fn no_context(pid: u32) -> CudaError {
        CudaError::Driver {
            call: Call::GetRestoreThreadId,
            pid: Some(pid),
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            message: "invalid argument".into(),
        }
    }

    #[test]
    fn only_processes_that_map_the_driver_are_probed() {
        let (driver, held) = take(vec![
            (10, Ok(CudaProcessState::Running)),
            (11, Ok(CudaProcessState::Running)),
        ]);
        let held = held.unwrap();
        assert_eq!(held.section().unwrap().pids, [10, 11]);
        drop(held);
        let probed = driver.probed.lock().unwrap();
        assert!(!probed.is_empty());
        assert!(
            probed.iter().all(|pid| [10, 11].contains(pid)),
            "{probed:?}"
        );
    }

    #[test]
    fn a_process_that_maps_the_driver_without_cuda_state_stops_the_checkpoint() {
        let (driver, held) = take(vec![
            (10, Ok(CudaProcessState::Running)),
            (11, Err(no_context(11))),
        ]);
        let err = held.unwrap_err();
        assert!(
            matches!(err, GpuError::NoCudaState { pid: 11, .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.starts_with(
                "pid 11 maps the CUDA driver, but the driver gives no CUDA state for it"
            ),
            "{text}"
        );
        assert!(text.contains("CUDA_ERROR_INVALID_VALUE"), "{text}");
        assert!(
            driver.calls.lock().unwrap().is_empty(),
            "nothing was locked"
        );
    }

    #[test]
    fn a_failed_process_is_named_as_failed_not_as_held_elsewhere() {
        let (driver, held) = take(vec![
            (10, Ok(CudaProcessState::Running)),
            (11, Ok(CudaProcessState::Failed)),
        ]);
        let err = held.unwrap_err();
        assert!(matches!(err, GpuError::Failed { pid: 11 }), "{err}");
        assert!(err.to_string().contains("FAILED state"), "{err}");
        assert!(!err.to_string().contains("another controller"), "{err}");
        assert!(driver.calls.lock().unwrap().is_empty());
        let (_, held) = take(vec![(10, Ok(CudaProcessState::Locked))]);
        let err = held.unwrap_err();
        assert_eq!(
            err.to_string(),
            "pid 10 is already locked: another controller holds its GPU state"
        );
    }

    fn section(gpu: &str, processes: Vec<CudaProcess>) -> CudaSection {
        CudaSection {
            driver_version: "12.8".into(),
            gpus: vec![GpuInfo {
                uuid: gpu.into(),
                model: "H200".into(),
                memory_bytes: 1,
            }],
            pids: vec![1],
            method: METHOD.into(),
            processes,
        }
    }

    /// A placeholder given every GPU of [`FixedDriver`]'s node.
    fn all_gpus() -> Assignment {
        let evidence = crate::gpu_assignment::Evidence {
            container: "placeholder",
            runtime: &crate::runtime::gpus::RuntimeGpus::default(),
            env: Some("all"),
            device_nodes: true,
        };
        crate::gpu_assignment::determine(&evidence, Some(&FixedDriver::default().inventory()))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn a_placeholder_given_fewer_gpus_than_the_checkpoint_used_is_refused() {
        let slot = CudaSlot::with(Arc::new(FixedDriver::default()));
        let err = plan_restore(&slot, &section(A, Vec::new()), None).unwrap_err();
        assert!(
            matches!(
                err,
                GpuRefusal::TooFewGpus {
                    needed: 1,
                    found: 0,
                    ..
                }
            ),
            "{err}"
        );
        let text = err.to_string();
        assert!(text.contains("given no GPU"), "{text}");
    }

    #[test]
    fn an_older_manifest_restores_onto_its_own_gpus_but_not_onto_others() {
        let slot = CudaSlot::with(Arc::new(FixedDriver::default()));
        let all = all_gpus();
        let me = Some(&all);
        // Same GPU: no pairs needed, nothing else to know.
        let plan = plan_restore(&slot, &section(A, Vec::new()), me).unwrap();
        assert!(plan.gpu_map.is_empty());
        // Another GPU: which pairs each process needs is unknown.
        let err = plan_restore(&slot, &section(B, Vec::new()), me).unwrap_err();
        assert!(matches!(err, GpuRefusal::NoProcessGpus { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(B) && text.contains(A), "{text}");
        assert!(text.contains("capture it again"), "{text}");
    }

    #[test]
    fn each_restored_process_gets_the_pairs_of_its_own_gpus() {
        let slot = CudaSlot::with(Arc::new(FixedDriver::default()));
        let me = std::process::id();
        let own = ns_pid(me).unwrap();
        let all = all_gpus();
        let held = vec![CudaProcess {
            pid: 1,
            ns_pid: own,
            gpus: vec![B.to_owned()],
        }];
        let plan = plan_restore(&slot, &section(B, held), Some(&all)).unwrap();
        assert_eq!(plan.gpu_map, [(B.to_owned(), A.to_owned())]);
        assert_eq!(plan.pairs_for(me), [(B.to_owned(), A.to_owned())]);
        let other = RestorePlan {
            held: vec![CudaProcess {
                pid: 1,
                ns_pid: own,
                gpus: vec!["GPU-00000000-0000-0000-0000-0000000000ff".to_owned()],
            }],
            ..plan
        };
        assert!(
            other.pairs_for(me).is_empty(),
            "no pair for a GPU it did not hold"
        );
    }

    #[test]
    fn a_process_holds_the_gpus_whose_device_nodes_it_has_open() {
        let tmp = tempfile::tempdir().unwrap();
        let node = tmp.path().join("nvidia1");
        nix::sys::stat::mknod(
            &node,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            nix::sys::stat::makedev(crate::mounts::NVIDIA_MAJOR, 1),
        )
        .unwrap();
        let ctl = tmp.path().join("nvidiactl");
        nix::sys::stat::mknod(
            &ctl,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            nix::sys::stat::makedev(crate::mounts::NVIDIA_MAJOR, 255),
        )
        .unwrap();
        let open = |path: &Path| {
            nix::fcntl::open(
                path,
                nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .unwrap()
        };
        let (_gpu, _ctl) = (open(&node), open(&ctl));
        let me = std::process::id();
        assert_eq!(held_gpu_minors(me).into_iter().collect::<Vec<_>>(), [1]);
        let inv = inventory(13000, &[(A, "H200", 1), (B, "H200", 1)]);
        let process = held_by(me, &inv, &inv.gpus);
        assert_eq!(process.gpus, [B]);
        assert_eq!(process.ns_pid, ns_pid(me).unwrap());
    }

    #[test]
    fn every_restore_ends_before_the_first_unlock_and_none_is_unlocked_after_a_failed_one() {
        let pids = [10, 11, 12];
        let driver = FixedDriver::default();
        let tids = BTreeMap::new();
        let mut timings = Timings::default();
        restore_then_unlock(&driver, &pids, &tids, |_| Vec::new(), &mut timings).unwrap();
        let calls = driver.calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 6, "{calls:?}");
        assert!(
            calls[..3].iter().all(|c| c.starts_with("restore")),
            "{calls:?}"
        );
        assert!(
            calls[3..].iter().all(|c| c.starts_with("unlock")),
            "{calls:?}"
        );
        let phases: Vec<&str> = timings.phases().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(phases, ["cuda-restore", "cuda-unlock"]);

        let driver = FixedDriver {
            fail_restore: Some(11),
            ..FixedDriver::default()
        };
        let err =
            restore_then_unlock(&driver, &pids, &tids, |_| Vec::new(), &mut timings).unwrap_err();
        assert!(
            matches!(
                err,
                GpuError::Calls {
                    step: "restore",
                    failed: 1,
                    total: 3,
                    ..
                }
            ),
            "{err}"
        );
        let calls = driver.calls.lock().unwrap().clone();
        assert!(!calls.iter().any(|c| c.starts_with("unlock")), "{calls:?}");
    }

    #[test]
    fn parallel_calls_keep_pid_order_and_each_result() {
        let pids = [5, 3, 9];
        let results = each(&pids, |pid| {
            if pid == 3 {
                Err(CudaError::NotCuda { pid })
            } else {
                Ok(pid * 2)
            }
        });
        assert_eq!(results.len(), 3);
        assert_eq!(results[0].0, 5);
        assert_eq!(*results[0].1.as_ref().unwrap(), 10);
        assert!(results[1].1.is_err());
        let err = failures("lock", results).unwrap_err();
        assert_eq!(
            err.to_string(),
            "lock failed for 1 of 3 CUDA process(es); first: pid 3 holds no CUDA state"
        );
    }
}
