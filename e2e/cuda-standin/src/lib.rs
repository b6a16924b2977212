//! A recording stand-in for the CUDA driver (`libcuda.so.1`), for tests only: no GPU is
//! available where warmstart's tests run, so the agent's GPU path is tested against this
//! library, loaded through the same code path (`dlopen` of the path given to the agent) and
//! preloaded into test workloads through `LD_LIBRARY_PATH`.
//!
//! What it simulates, and why it is faithful where it matters:
//! - **The node**: driver version and GPUs come from `config.json` in the state directory
//!   ([`config`]); without it the library behaves as a node without a GPU.
//! - **Device memory lives outside the process**: in the test harness's device server, over
//!   a connected unix socket, so CRIU refuses to dump a workload that was not
//!   CUDA-checkpointed, as with a real GPU's `/dev/nvidia*` mappings ([`device`]).
//! - **States and rules**: RUNNING → LOCKED → CHECKPOINTED → LOCKED → RUNNING, and FAILED
//!   after an uncorrectable error (for good); a call in the wrong state answers
//!   `CUDA_ERROR_ILLEGAL_STATE`; lock blocks new calls at once and waits for the GPU work in
//!   flight, honouring its timeout (the process then stays RUNNING); a non-zero reserved byte
//!   answers `CUDA_ERROR_INVALID_VALUE`; restore needs the caller's `cuInit`; GPU pairs only
//!   from driver 13000, and then exactly the process's GPUs (each once, none it did not use,
//!   no two onto one); application calls block while locked or checkpointed.
//! - **Device nodes**: a context, and a restore, open the GPU's `nvidia<minor>` and
//!   `nvidiactl` in the process's own mount namespace (`deviceDir` of the config, `/dev`
//!   by default), so a restored container needs the new GPU's node.
//! - **The restore thread**: each CUDA process runs one; it serves lock, checkpoint, restore
//!   and unlock, so such a call on a process whose restore thread is stopped blocks until it
//!   runs (the agent's watch then gives up), as CRIU's CUDA plugin expects of the driver; the
//!   state and the restore thread's id (as the caller sees it) are answered with every
//!   thread stopped ([`process`]).
//! - **GPU work in flight**: `cuModuleLoadData`, `cuModuleGetFunction` and `cuLaunchKernel`
//!   of a spin kernel keep the GPU busy for the nanoseconds its first parameter says, without
//!   running any code; a lock waits for that work and, past its timeout, answers
//!   `CUDA_ERROR_TIMEOUT` with the process left running. `cuCtxSynchronize` waits for it.
//! - **MIG**: a configured GPU with a `parent` is a MIG instance: `cuDeviceGetUuid_v2`
//!   answers its own (`MIG-`) UUID, `cuDeviceGetUuid` its parent GPU's.
//! - **Fault knobs** in `faults.json` (GPU work per application call, hang, checkpoint error,
//!   FAILED at checkpoint or restore, sticky restore out-of-memory, a transfer delay) and a **recording** of every call (`calls.jsonl`: pid,
//!   arguments, start and end time, result).
//!
//! The exported functions must use raw pointers (it is a C library), which is why this test
//! double allows `unsafe`; every block says what it relies on.
#![allow(unsafe_code)]

mod codes;
mod config;
mod control;
mod device;
mod process;

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::Ordering;

use codes::*;
use control::{INITIALISED, reserved_ok};
use process::{Request, api_call};

/// Size of each piece of a host↔device copy sent to the device server.
const COPY_PIECE: usize = 16 << 20;
/// Allocation granularity (like the real driver's 2 MiB pages).
const GRANULE: u64 = 2 << 20;

fn recorded(
    call: &str,
    target: Option<i32>,
    args: serde_json::Value,
    f: impl FnOnce() -> i32,
) -> i32 {
    let start_ns = config::now_ns();
    let rc = f();
    config::record(&config::Record {
        pid: std::process::id(),
        call,
        target,
        args,
        start_ns,
        end_ns: config::now_ns(),
        rc,
    });
    rc
}

fn gpu(ordinal: c_int) -> Result<config::Gpu, i32> {
    if !INITIALISED.load(Ordering::SeqCst) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    let config = config::config().ok_or(CUDA_ERROR_NO_DEVICE)?;
    usize::try_from(ordinal)
        .ok()
        .and_then(|i| config.gpus.get(i).cloned())
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

fn rc_of<T>(result: Result<T, i32>) -> i32 {
    result.err().unwrap_or(CUDA_SUCCESS)
}

/// Writes `value` through `out` when it is not null.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> i32 {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null, and valid for writes per the caller.
    unsafe { out.write(value) };
    CUDA_SUCCESS
}

/// `cuInit`.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> c_int {
    recorded(
        "cuInit",
        None,
        serde_json::json!({ "flags": flags }),
        || {
            if flags != 0 {
                return CUDA_ERROR_INVALID_VALUE;
            }
            if config::config().is_none() {
                return CUDA_ERROR_NO_DEVICE;
            }
            INITIALISED.store(true, Ordering::SeqCst);
            CUDA_SUCCESS
        },
    )
}

/// `cuDriverGetVersion`.
///
/// # Safety
/// `version` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> c_int {
    match config::config() {
        // SAFETY: forwarded from the caller.
        Some(c) => unsafe { put(version, c.driver_version) },
        None => CUDA_ERROR_NO_DEVICE,
    }
}

/// `cuGetErrorName`.
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: c_int, out: *mut *const c_char) -> c_int {
    match codes::text(code) {
        // SAFETY: forwarded from the caller; the string is static and NUL-terminated.
        Some((name, _)) => unsafe { put(out, name.as_ptr().cast()) },
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

/// `cuGetErrorString`.
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: c_int, out: *mut *const c_char) -> c_int {
    match codes::text(code) {
        // SAFETY: forwarded from the caller; the string is static and NUL-terminated.
        Some((_, text)) => unsafe { put(out, text.as_ptr().cast()) },
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

/// `cuDeviceGetCount`.
///
/// # Safety
/// `count` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> c_int {
    if !INITIALISED.load(Ordering::SeqCst) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    let n = config::config().map_or(0, |c| c.gpus.len());
    // SAFETY: forwarded from the caller.
    unsafe { put(count, c_int::try_from(n).unwrap_or(c_int::MAX)) }
}

/// `cuDeviceGet`.
///
/// # Safety
/// `device` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> c_int {
    match gpu(ordinal) {
        // SAFETY: forwarded from the caller.
        Ok(_) => unsafe { put(device, ordinal) },
        Err(rc) => rc,
    }
}

/// `cuDeviceGetUuid`: of a MIG instance, its parent GPU's UUID.
///
/// # Safety
/// `uuid` is null or valid for a write of 16 bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], device: c_int) -> c_int {
    match gpu(device) {
        // SAFETY: forwarded from the caller.
        Ok(g) => unsafe { put(uuid, uuid_bytes(g.parent.as_deref().unwrap_or(&g.uuid))) },
        Err(rc) => rc,
    }
}

/// `cuDeviceGetUuid_v2`: of a MIG instance, its own (MIG) UUID.
///
/// # Safety
/// `uuid` is null or valid for a write of 16 bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], device: c_int) -> c_int {
    match gpu(device) {
        // SAFETY: forwarded from the caller.
        Ok(g) => unsafe { put(uuid, uuid_bytes(&g.uuid)) },
        Err(rc) => rc,
    }
}

/// The 16 bytes of `GPU-…` or `MIG-…`.
fn uuid_bytes(text: &str) -> [u8; 16] {
    let digits: String = text
        .trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let mut bytes = [0u8; 16];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = digits
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    bytes
}

/// `cuDeviceGetName`.
///
/// # Safety
/// `name` is null or valid for `len` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> c_int {
    let gpu = match gpu(device) {
        Ok(g) => g,
        Err(rc) => return rc,
    };
    let Ok(len) = usize::try_from(len) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if name.is_null() || len == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let bytes = gpu.name.as_bytes();
    let n = bytes.len().min(len - 1);
    // SAFETY: `name` is valid for `len` bytes and `n + 1 <= len`; the regions are distinct.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), n);
        name.add(n).write(0);
    }
    CUDA_SUCCESS
}

/// `cuDeviceTotalMem_v2`.
///
/// # Safety
/// `bytes` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> c_int {
    match gpu(device) {
        // SAFETY: forwarded from the caller.
        Ok(g) => unsafe { put(bytes, usize::try_from(g.memory_bytes).unwrap_or(usize::MAX)) },
        Err(rc) => rc,
    }
}

fn create_context(device: c_int) -> Result<usize, i32> {
    let gpu = gpu(device)?;
    match process::attach(device, gpu.uuid) {
        CUDA_SUCCESS => Ok(usize::try_from(device).unwrap_or(0) + 1),
        rc => Err(rc),
    }
}

/// `cuDevicePrimaryCtxRetain`: makes this process a CUDA process.
///
/// # Safety
/// `ctx` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, device: c_int) -> c_int {
    recorded(
        "cuDevicePrimaryCtxRetain",
        None,
        serde_json::json!({ "device": device }),
        || {
            match create_context(device) {
                // SAFETY: forwarded from the caller; the handle is an opaque token.
                Ok(handle) => unsafe { put(ctx, handle as *mut c_void) },
                Err(rc) => rc,
            }
        },
    )
}

/// `cuCtxCreate_v2`: as the primary context.
///
/// # Safety
/// `ctx` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    ctx: *mut *mut c_void,
    _flags: c_uint,
    device: c_int,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe { cuDevicePrimaryCtxRetain(ctx, device) }
}

/// `cuCtxSetCurrent`: one context per process here, nothing to switch.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(_ctx: *mut c_void) -> c_int {
    if INITIALISED.load(Ordering::SeqCst) {
        CUDA_SUCCESS
    } else {
        CUDA_ERROR_NOT_INITIALIZED
    }
}

/// `cuMemAlloc_v2`.
///
/// # Safety
/// `dptr` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> c_int {
    let size = size as u64;
    let result = api_call(|device, ctx| {
        let capacity = ctx
            .gpus
            .values()
            .filter_map(|u| config::config()?.gpus.into_iter().find(|g| &g.uuid == u))
            .map(|g| g.memory_bytes)
            .max()
            .unwrap_or(0);
        let used: u64 = ctx.allocs.values().sum();
        if size == 0 || used + size > capacity {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let ptr = ctx.next_ptr;
        device
            .alloc(ptr, size)
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        ctx.allocs.insert(ptr, size);
        ctx.next_ptr += size.div_ceil(GRANULE) * GRANULE;
        Ok(ptr)
    });
    match result {
        // SAFETY: forwarded from the caller.
        Ok(ptr) => unsafe { put(dptr, ptr) },
        Err(rc) => rc,
    }
}

/// `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> c_int {
    rc_of(api_call(|device, ctx| {
        ctx.allocs.remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        device.free(ptr).map_err(|_| CUDA_ERROR_UNKNOWN)
    }))
}

/// `cuMemcpyHtoD_v2`.
///
/// # Safety
/// `src` is valid for `n` bytes of reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> c_int {
    if src.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller guarantees `src` is valid for `n` bytes.
    let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) };
    rc_of(api_call(|device, ctx| {
        ctx.find(dst, n as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for (i, piece) in data.chunks(COPY_PIECE).enumerate() {
            let at = dst + (i * COPY_PIECE) as u64;
            device.write(at, piece).map_err(|_| CUDA_ERROR_UNKNOWN)?;
        }
        Ok(())
    }))
}

/// `cuMemcpyDtoH_v2`.
///
/// # Safety
/// `dst` is valid for `n` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> c_int {
    if dst.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller guarantees `dst` is valid for `n` bytes and not aliased meanwhile.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
    rc_of(api_call(|device, ctx| {
        ctx.find(src, n as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for (i, piece) in out.chunks_mut(COPY_PIECE).enumerate() {
            let at = src + (i * COPY_PIECE) as u64;
            device.read(at, piece).map_err(|_| CUDA_ERROR_UNKNOWN)?;
        }
        Ok(())
    }))
}

/// `cuModuleLoadData`: any PTX image with an `.entry` loads (the stand-in runs no code).
///
/// # Safety
/// `module` is null or valid for a write; `image` is null or a NUL-terminated PTX text.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> c_int {
    if image.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: a PTX image is NUL-terminated text per the caller.
    let text = unsafe { std::ffi::CStr::from_ptr(image.cast()) }.to_string_lossy();
    if !text.contains(".entry") {
        return CUDA_ERROR_INVALID_IMAGE;
    }
    match process::api_call(|_, _| Ok(())) {
        // SAFETY: forwarded from the caller; the handle is an opaque token.
        Ok(()) => unsafe { put(module, std::ptr::dangling_mut::<c_void>()) },
        Err(rc) => rc,
    }
}

/// `cuModuleGetFunction`: every name is a kernel that spins (see [`cuLaunchKernel`]).
///
/// # Safety
/// `function` is null or valid for a write; `name` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> c_int {
    if module.is_null() || name.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: forwarded from the caller; the handle is an opaque token.
    unsafe { put(function, std::ptr::dangling_mut::<c_void>()) }
}

/// `cuLaunchKernel` of a spin kernel: its first parameter, a `u64` of nanoseconds, is how
/// long the GPU stays busy. The launch returns at once; the work is in flight until then
/// (a lock waits for it; `cuCtxSynchronize` returns after it).
///
/// # Safety
/// `params` is null or points at a pointer to a readable `u64`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    function: *mut c_void,
    _grid_x: c_uint,
    _grid_y: c_uint,
    _grid_z: c_uint,
    _block_x: c_uint,
    _block_y: c_uint,
    _block_z: c_uint,
    _shared_bytes: c_uint,
    _stream: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> c_int {
    if function.is_null() || params.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: per the caller, `params[0]` points at the kernel's `u64` parameter.
    let ns = unsafe { (*params).cast::<u64>().read_unaligned() };
    rc_of(process::launch(std::time::Duration::from_nanos(ns)))
}

/// `cuCtxSynchronize`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> c_int {
    rc_of(process::synchronize())
}

fn request(op: &str) -> Request {
    Request {
        op: op.to_owned(),
        timeout_ms: 0,
        pairs: Vec::new(),
    }
}

/// Reads a checkpoint-API argument struct.
///
/// # Safety
/// `args` is null or valid for 64 bytes of reads.
unsafe fn args_bytes(args: *const c_void) -> Option<[u8; 64]> {
    if args.is_null() {
        return None;
    }
    // SAFETY: non-null and valid for 64 bytes per the caller; read unaligned to be safe.
    Some(unsafe { args.cast::<[u8; 64]>().read_unaligned() })
}

/// `cuCheckpointProcessGetRestoreThreadId`.
///
/// # Safety
/// `tid` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(
    pid: c_int,
    tid: *mut c_int,
) -> c_int {
    recorded(
        "cuCheckpointProcessGetRestoreThreadId",
        Some(pid),
        serde_json::Value::Null,
        || {
            match control::target(pid) {
                // SAFETY: forwarded from the caller.
                Some((_, restore_tid)) => unsafe { put(tid, restore_tid) },
                None => CUDA_ERROR_INVALID_VALUE,
            }
        },
    )
}

/// `cuCheckpointProcessGetState`.
///
/// # Safety
/// `state` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_int) -> c_int {
    recorded(
        "cuCheckpointProcessGetState",
        Some(pid),
        serde_json::Value::Null,
        || {
            match control::target(pid) {
                // SAFETY: forwarded from the caller.
                Some((value, _)) => unsafe { put(state, value) },
                None => CUDA_ERROR_INVALID_VALUE,
            }
        },
    )
}

/// `cuCheckpointProcessLock`.
///
/// # Safety
/// `args` is null or valid for 64 bytes of reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: c_int, args: *const c_void) -> c_int {
    // SAFETY: forwarded from the caller.
    let bytes = unsafe { args_bytes(args) };
    let timeout_ms = bytes.map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    recorded(
        "cuCheckpointProcessLock",
        Some(pid),
        serde_json::json!({ "timeoutMs": timeout_ms }),
        || {
            let Some(bytes) = bytes.filter(|b| reserved_ok(b, 0..4)) else {
                return CUDA_ERROR_INVALID_VALUE;
            };
            let mut r = request("lock");
            r.timeout_ms = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            control::call(pid, &r).rc
        },
    )
}

/// `cuCheckpointProcessCheckpoint`.
///
/// # Safety
/// `args` is null or valid for 64 bytes of reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(pid: c_int, args: *const c_void) -> c_int {
    // SAFETY: forwarded from the caller.
    let bytes = unsafe { args_bytes(args) };
    recorded(
        "cuCheckpointProcessCheckpoint",
        Some(pid),
        serde_json::Value::Null,
        || {
            if !bytes.is_some_and(|b| reserved_ok(&b, 0..0)) {
                return CUDA_ERROR_INVALID_VALUE;
            }
            control::call(pid, &request("checkpoint")).rc
        },
    )
}

/// The configured GPU (or MIG instance) whose UUID has these bytes, else `GPU-…` of them.
fn uuid_text(bytes: &[u8]) -> String {
    if let Some(gpu) = config::config()
        .into_iter()
        .flat_map(|c| c.gpus)
        .find(|g| uuid_bytes(&g.uuid) == bytes)
    {
        return gpu.uuid;
    }
    let h: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// `cuCheckpointProcessRestore`: the args layout depends on the driver version the node
/// claims (all reserved before 13000; `gpuPairs` and `gpuPairsCount` from 13000).
///
/// # Safety
/// `args` is null or valid for 64 bytes of reads; from driver 13000 its `gpuPairs` is null
/// or valid for `gpuPairsCount` pairs of 32 bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessRestore(pid: c_int, args: *const c_void) -> c_int {
    // SAFETY: forwarded from the caller.
    let bytes = unsafe { args_bytes(args) };
    let version = control::driver_version();
    let pairs: Option<Vec<(String, String)>> = bytes.and_then(|b| {
        if version < 13000 {
            return reserved_ok(&b, 0..0).then(Vec::new);
        }
        if !reserved_ok(&b, 0..12) {
            return None;
        }
        let ptr = u64::from_ne_bytes(b[0..8].try_into().ok()?) as *const [u8; 32];
        let count = u32::from_ne_bytes(b[8..12].try_into().ok()?) as usize;
        if count == 0 {
            return Some(Vec::new());
        }
        if ptr.is_null() {
            return None;
        }
        Some(
            (0..count)
                .map(|i| {
                    // SAFETY: the caller guarantees `count` readable pairs at `ptr`.
                    let pair = unsafe { ptr.add(i).read_unaligned() };
                    (uuid_text(&pair[..16]), uuid_text(&pair[16..]))
                })
                .collect(),
        )
    });
    recorded(
        "cuCheckpointProcessRestore",
        Some(pid),
        serde_json::json!({ "gpuPairs": pairs, "initialised": INITIALISED.load(Ordering::SeqCst) }),
        || {
            let Some(pairs) = pairs else {
                return CUDA_ERROR_INVALID_VALUE;
            };
            if !INITIALISED.load(Ordering::SeqCst) {
                return CUDA_ERROR_NOT_INITIALIZED;
            }
            let mut r = request("restore");
            r.pairs = pairs;
            control::call(pid, &r).rc
        },
    )
}

/// `cuCheckpointProcessUnlock`.
///
/// # Safety
/// `args` is null or valid for 64 bytes of reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(pid: c_int, args: *const c_void) -> c_int {
    // SAFETY: forwarded from the caller.
    let bytes = unsafe { args_bytes(args) };
    recorded(
        "cuCheckpointProcessUnlock",
        Some(pid),
        serde_json::Value::Null,
        || {
            if !bytes.is_some_and(|b| reserved_ok(&b, 0..0)) {
                return CUDA_ERROR_INVALID_VALUE;
            }
            control::call(pid, &request("unlock")).rc
        },
    )
}
