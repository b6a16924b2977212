//! The workload side of the stand-in: one process's CUDA state, the gate that blocks its
//! CUDA calls while it is locked or checkpointed, and its restore thread, which serves the
//! controller's checkpoint-API requests from `req/<pid-ns inode>-<ns pid>/` in the state
//! directory. Like the real driver's restore thread, it must be runnable for a lock,
//! checkpoint, restore or unlock to be answered: asked while it is stopped, such a call
//! blocks until it runs (the real driver's does, which is why CRIU's CUDA plugin wakes the
//! restore thread of a frozen task around its restore). The state and the restore thread's
//! id are answered without it, from [`PUBLISHED`] in the process's memory, as the driver
//! answers them for a frozen task.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::codes::*;
use crate::config;
use crate::device::Device;

/// `CUprocessState` values.
pub const RUNNING: i32 = 0;
/// See [`RUNNING`].
pub const LOCKED: i32 = 1;
/// See [`RUNNING`].
pub const CHECKPOINTED: i32 = 2;
/// See [`RUNNING`].
pub const FAILED: i32 = 3;

/// Where device pointers start (looks like a real CUDA device address).
const DEVICE_BASE: u64 = 0x7f00_0000_0000;

/// The process's state and its restore thread's id (in its own PID namespace; 0 before its
/// first context), kept current by the process and read by a controller from
/// `/proc/<pid>/mem` at the same offset in the same library: what the driver answers for a
/// process whose threads are all stopped.
pub static PUBLISHED: [AtomicI32; 2] = [AtomicI32::new(RUNNING), AtomicI32::new(0)];

fn publish(inner: &Inner) {
    PUBLISHED[0].store(inner.state, Ordering::SeqCst);
    PUBLISHED[1].store(inner.restore_tid, Ordering::SeqCst);
}

#[derive(Debug, Default)]
struct Inner {
    state: i32,
    locking: bool,
    in_flight: u32,
    /// Kernels launched and still running on the GPU (`cuLaunchKernel`): GPU work in flight
    /// until then, which a lock waits for.
    busy_until: Option<Instant>,
    /// GPU UUIDs of the contexts the process created, by ordinal at creation.
    gpus: BTreeMap<i32, String>,
    /// Live allocations: device pointer → size.
    allocs: BTreeMap<u64, u64>,
    next_ptr: u64,
    /// Device memory while checkpointed: in this process's own (anonymous) memory.
    host_copy: Vec<(u64, Vec<u8>)>,
    /// A restore failed with out-of-memory: the process can no longer be restored.
    stuck: bool,
    device: Option<Device>,
    /// The device nodes of the GPUs held (none while checkpointed).
    nodes: Vec<std::fs::File>,
    restore_tid: i32,
}

struct Process {
    inner: Mutex<Inner>,
    changed: Condvar,
}

static PROCESS: OnceLock<Process> = OnceLock::new();

fn process() -> &'static Process {
    PROCESS.get_or_init(|| Process {
        inner: Mutex::new(Inner {
            next_ptr: DEVICE_BASE,
            ..Inner::default()
        }),
        changed: Condvar::new(),
    })
}

fn lock_inner() -> MutexGuard<'static, Inner> {
    process()
        .inner
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Makes the calling process a CUDA process: connects the "GPU" and starts the restore
/// thread (once). Called on context creation.
pub fn attach(ordinal: i32, uuid: String) -> i32 {
    // The driver opens the GPU's device node in the process's own mount namespace.
    let Some(nodes) = config::config().and_then(|c| c.open_device_nodes([&uuid])) else {
        return CUDA_ERROR_NO_DEVICE;
    };
    let mut inner = lock_inner();
    inner.nodes.extend(nodes);
    inner.gpus.insert(ordinal, uuid);
    if inner.device.is_none() && inner.state == RUNNING {
        match Device::connect() {
            Ok(device) => inner.device = Some(device),
            Err(_) => return CUDA_ERROR_NO_DEVICE,
        }
    }
    if inner.restore_tid == 0 {
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("cuda-restore".into())
            .spawn(move || {
                // SAFETY: gettid takes no arguments and cannot fail.
                let tid = unsafe { libc::gettid() };
                let _ = tx.send(tid);
                serve_forever();
            });
        if spawned.is_err() {
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
        inner.restore_tid = rx.recv().unwrap_or(0);
        publish(&inner);
    }
    CUDA_SUCCESS
}

/// Runs `f` as an application CUDA call: waits while the process is locked or checkpointed,
/// and counts as in flight so a lock waits for it.
pub fn api_call<T>(f: impl FnOnce(&mut Device, &mut CallCtx) -> Result<T, i32>) -> Result<T, i32> {
    let p = process();
    {
        let mut inner = p.inner.lock().unwrap_or_else(PoisonError::into_inner);
        while inner.state != RUNNING || inner.locking {
            if inner.state == FAILED {
                return Err(CUDA_ERROR_UNKNOWN);
            }
            inner = p
                .changed
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner);
        }
        inner.in_flight += 1;
    }
    // The GPU work this call stands for; a lock waits for it to finish.
    let delay = config::faults().call_delay_ms;
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    // The device connection is taken out for the call so the lock is not held during I/O.
    let (mut device, mut ctx) = {
        let mut inner = p.inner.lock().unwrap_or_else(PoisonError::into_inner);
        (
            inner.device.take(),
            CallCtx {
                allocs: std::mem::take(&mut inner.allocs),
                next_ptr: inner.next_ptr,
                gpus: inner.gpus.clone(),
            },
        )
    };
    let result = match device.as_mut() {
        Some(d) => f(d, &mut ctx),
        None => Err(CUDA_ERROR_INVALID_CONTEXT),
    };
    let mut inner = p.inner.lock().unwrap_or_else(PoisonError::into_inner);
    inner.device = device;
    inner.allocs = ctx.allocs;
    inner.next_ptr = ctx.next_ptr;
    inner.in_flight -= 1;
    p.changed.notify_all();
    result
}

/// Launches a kernel that keeps the GPU busy for `busy`: returns at once (launches are
/// asynchronous), the work stays in flight until then.
pub fn launch(busy: Duration) -> Result<(), i32> {
    api_call(|_, _| Ok(()))?;
    let mut inner = lock_inner();
    let end = Instant::now() + busy;
    inner.busy_until = Some(inner.busy_until.map_or(end, |t| t.max(end)));
    Ok(())
}

/// Waits until every kernel launched has ended (`cuCtxSynchronize`), as an application call.
pub fn synchronize() -> Result<(), i32> {
    api_call(|_, _| {
        let until = lock_inner().busy_until;
        if let Some(left) = until.map(|t| t.saturating_duration_since(Instant::now())) {
            std::thread::sleep(left);
        }
        Ok(())
    })
}

/// What an application call may change.
#[derive(Debug)]
pub struct CallCtx {
    /// Live allocations.
    pub allocs: BTreeMap<u64, u64>,
    /// The next free device address.
    pub next_ptr: u64,
    /// The process's GPUs.
    pub gpus: BTreeMap<i32, String>,
}

impl CallCtx {
    /// The allocation holding `[ptr, ptr+len)`.
    pub fn find(&self, ptr: u64, len: u64) -> Option<u64> {
        let (&base, &size) = self.allocs.range(..=ptr).next_back()?;
        (ptr + len <= base + size).then_some(base)
    }
}

/// A request from the controller.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    /// `threadId`, `state`, `lock`, `checkpoint`, `restore`, `unlock`.
    pub op: String,
    /// For `lock`.
    pub timeout_ms: u32,
    /// For `restore`: (old UUID, new UUID).
    pub pairs: Vec<(String, String)>,
}

/// The answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct Response {
    /// The `CUresult`.
    pub rc: i32,
    /// The thread id or state, for queries.
    pub value: i32,
}

/// The request directory name of this process (or of `pid` seen from the host).
pub fn key(ns_link: &Path, ns_pid: u32) -> Option<String> {
    let link = std::fs::read_link(ns_link).ok()?;
    let link = link.to_str()?;
    let inode: String = link.chars().filter(char::is_ascii_digit).collect();
    Some(format!("{inode}-{ns_pid}"))
}

fn own_dir() -> Option<PathBuf> {
    let key = key(Path::new("/proc/self/ns/pid"), std::process::id())?;
    let dir = config::dir()?.join("req").join(key);
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
}

/// The restore thread: polls its request directory (whose name changes when CRIU restores
/// the process into a new PID namespace) and answers each request.
fn serve_forever() {
    loop {
        if let Some(dir) = own_dir()
            && let Ok(entries) = std::fs::read_dir(&dir)
        {
            let mut requests: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "req"))
                .collect();
            requests.sort();
            for path in requests {
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                let _ = std::fs::remove_file(&path);
                let Ok(request) = serde_json::from_str::<Request>(&text) else {
                    continue;
                };
                let faults = config::faults();
                if faults.hang.as_deref() == Some(request.op.as_str()) {
                    // A driver call that never returns.
                    loop {
                        std::thread::park();
                    }
                }
                let response = handle(&request, &faults);
                publish(&lock_inner());
                let tmp = path.with_extension("tmp");
                if let Ok(json) = serde_json::to_vec(&response)
                    && std::fs::write(&tmp, json).is_ok()
                {
                    let _ = std::fs::rename(&tmp, path.with_extension("resp"));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn handle(request: &Request, faults: &config::Faults) -> Response {
    let p = process();
    let mut inner = p.inner.lock().unwrap_or_else(PoisonError::into_inner);
    let done = |rc: i32| Response { rc, value: 0 };
    match request.op.as_str() {
        "threadId" => Response {
            rc: CUDA_SUCCESS,
            value: inner.restore_tid,
        },
        "state" => Response {
            rc: CUDA_SUCCESS,
            value: inner.state,
        },
        "lock" => {
            if inner.state != RUNNING || inner.locking {
                return done(CUDA_ERROR_ILLEGAL_STATE);
            }
            let timeout = Duration::from_millis(u64::from(request.timeout_ms));
            // New calls wait from now on; the lock waits for the work in flight.
            inner.locking = true;
            let deadline = Instant::now() + timeout;
            while inner.in_flight > 0 || inner.busy_until.is_some_and(|t| t > Instant::now()) {
                let left = deadline.saturating_duration_since(Instant::now());
                if request.timeout_ms != 0 && left.is_zero() {
                    // Given up: the process goes on running, as documented. The code is
                    // cuda.h's for a lapsed wait timeout; which code the driver answers is
                    // not documented.
                    inner.locking = false;
                    p.changed.notify_all();
                    return done(CUDA_ERROR_TIMEOUT);
                }
                // Kernels end without a notification: looked at every 10 ms.
                let wait = if request.timeout_ms == 0 {
                    Duration::from_millis(10)
                } else {
                    left.min(Duration::from_millis(10))
                };
                inner = p
                    .changed
                    .wait_timeout(inner, wait)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            inner.locking = false;
            inner.state = LOCKED;
            done(CUDA_SUCCESS)
        }
        "checkpoint" => {
            if inner.state != LOCKED {
                return done(CUDA_ERROR_ILLEGAL_STATE);
            }
            if let Some(rc) = faults.checkpoint_error {
                return done(rc);
            }
            if faults.fail.as_deref() == Some("checkpoint") {
                return fail(&mut inner);
            }
            std::thread::sleep(Duration::from_millis(faults.transfer_delay_ms));
            let Some(mut device) = inner.device.take() else {
                return done(CUDA_ERROR_ILLEGAL_STATE);
            };
            let mut copy = Vec::new();
            for (&ptr, &size) in &inner.allocs {
                let mut bytes = vec![0u8; usize::try_from(size).unwrap_or(0)];
                if device.read(ptr, &mut bytes).is_err() {
                    inner.device = Some(device);
                    return done(CUDA_ERROR_UNKNOWN);
                }
                copy.push((ptr, bytes));
            }
            // Closing the connection frees the device memory, as releasing GPU handles does.
            drop(device);
            inner.nodes.clear();
            inner.host_copy = copy;
            inner.state = CHECKPOINTED;
            done(CUDA_SUCCESS)
        }
        "restore" => restore(&mut inner, &request.pairs, faults),
        "unlock" => {
            if inner.state != LOCKED || inner.stuck {
                return done(CUDA_ERROR_ILLEGAL_STATE);
            }
            inner.state = RUNNING;
            p.changed.notify_all();
            done(CUDA_SUCCESS)
        }
        _ => done(CUDA_ERROR_INVALID_VALUE),
    }
}

/// An uncorrectable error: the process is FAILED for good, its device memory lost.
fn fail(inner: &mut Inner) -> Response {
    inner.state = FAILED;
    inner.device = None;
    inner.nodes.clear();
    inner.host_copy = Vec::new();
    process().changed.notify_all();
    Response {
        rc: CUDA_ERROR_UNKNOWN,
        value: 0,
    }
}

fn restore(inner: &mut Inner, pairs: &[(String, String)], faults: &config::Faults) -> Response {
    let done = |rc: i32| Response { rc, value: 0 };
    if inner.stuck {
        return done(CUDA_ERROR_OPERATING_SYSTEM);
    }
    if inner.state != CHECKPOINTED {
        return done(CUDA_ERROR_ILLEGAL_STATE);
    }
    if faults.restore_oom {
        inner.stuck = true;
        return done(CUDA_ERROR_OUT_OF_MEMORY);
    }
    if faults.fail.as_deref() == Some("restore") {
        return fail(inner);
    }
    let Some(config) = config::config() else {
        return done(CUDA_ERROR_NO_DEVICE);
    };
    // The pairs, when given, are exactly the process's GPUs: each checkpointed GPU once, no
    // GPU it did not use, no two onto one target.
    if !pairs.is_empty() {
        let olds: std::collections::BTreeSet<&String> = pairs.iter().map(|(old, _)| old).collect();
        let news: std::collections::BTreeSet<&String> = pairs.iter().map(|(_, new)| new).collect();
        let used: std::collections::BTreeSet<&String> = inner.gpus.values().collect();
        if olds.len() != pairs.len() || news.len() != pairs.len() || olds != used {
            return done(CUDA_ERROR_INVALID_VALUE);
        }
    }
    // Each checkpointed GPU must map to a present GPU: through the pairs when given, else by
    // the same UUID.
    let mut gpus = inner.gpus.clone();
    for uuid in gpus.values_mut() {
        let target = if pairs.is_empty() {
            uuid.clone()
        } else {
            match pairs.iter().find(|(old, _)| old == uuid) {
                Some((_, new)) => new.clone(),
                None => return done(CUDA_ERROR_INVALID_VALUE),
            }
        };
        if !config.gpus.iter().any(|g| g.uuid == target) {
            return done(CUDA_ERROR_INVALID_DEVICE);
        }
        *uuid = target;
    }
    let used: u64 = inner.host_copy.iter().map(|(_, b)| b.len() as u64).sum();
    let capacity = gpus
        .values()
        .filter_map(|u| config.gpus.iter().find(|g| &g.uuid == u))
        .map(|g| g.memory_bytes)
        .max()
        .unwrap_or(0);
    if used > capacity {
        return done(CUDA_ERROR_OUT_OF_MEMORY);
    }
    // The restore thread reopens the target GPUs' device nodes in the process's own mount
    // namespace: a restored container needs the new node's, not the checkpoint's.
    let Some(nodes) = config.open_device_nodes(gpus.values()) else {
        return done(CUDA_ERROR_NO_DEVICE);
    };
    std::thread::sleep(Duration::from_millis(faults.transfer_delay_ms));
    let Ok(mut device) = Device::connect() else {
        return done(CUDA_ERROR_NO_DEVICE);
    };
    for (ptr, bytes) in &inner.host_copy {
        if device.alloc(*ptr, bytes.len() as u64).is_err() || device.write(*ptr, bytes).is_err() {
            return done(CUDA_ERROR_UNKNOWN);
        }
    }
    inner.host_copy = Vec::new();
    inner.device = Some(device);
    inner.nodes = nodes;
    inner.gpus = gpus;
    inner.state = LOCKED;
    done(CUDA_SUCCESS)
}
