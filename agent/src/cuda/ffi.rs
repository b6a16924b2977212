//! The raw CUDA driver binding: `libcuda.so.1` opened at run time with `libloading`, the
//! symbols warmstart calls resolved once, the `#[repr(C)]` argument structs of the
//! process-checkpoint API, and safe methods around each call. This file (with `sys/`) is the
//! agent's only `unsafe` code.
//!
//! Mirrors `cuda.h` (CUDA 12.8 … 13.4): every checkpoint argument struct is 64 bytes, its
//! reserved bytes must be zero, and `CUcheckpointRestoreArgs` gained `gpuPairs` (offset 0) and
//! `gpuPairsCount` (offset 8) in CUDA 13.0 (driver r580); older drivers see the same 64 bytes
//! as `reserved[8]` and reject any non-zero byte, so the pair fields are filled only when
//! `cuDriverGetVersion` reports 13000 or more.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::path::{Path, PathBuf};

use libloading::Library;

/// `CUresult`: 0 is success, anything else an error code.
pub type CuResult = c_int;
/// `CUdevice`: an ordinal.
pub type CuDevice = c_int;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
/// The first driver version whose restore accepts GPU UUID pairs (CUDA 13.0, r580).
pub const REMAP_MIN_DRIVER: i32 = 13000;

/// `CUuuid`: 16 raw bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CuUuid {
    /// The bytes, most significant first as in `GPU-xxxxxxxx-…`.
    pub bytes: [u8; 16],
}

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Debug, Default)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` and `CUcheckpointUnlockArgs`: reserved only.
#[repr(C)]
#[derive(Debug, Default)]
struct ReservedArgs {
    reserved: [u64; 8],
}

/// `CUcheckpointGpuPair`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuPair {
    /// The GPU at checkpoint time.
    pub old_uuid: CuUuid,
    /// The GPU to restore onto.
    pub new_uuid: CuUuid,
}

/// `CUcheckpointRestoreArgs` as of CUDA 13.x: the pair pointer and count, then bytes that are
/// reserved (or, on 13.4, optional fields whose zero value means "not used").
#[repr(C)]
#[derive(Debug)]
struct RestoreArgs {
    gpu_pairs: *mut GpuPair,
    gpu_pairs_count: c_uint,
    rest: [u8; 52],
}

const _: () = assert!(std::mem::size_of::<CuUuid>() == 16);
const _: () = assert!(std::mem::size_of::<LockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<ReservedArgs>() == 64);
const _: () = assert!(std::mem::size_of::<GpuPair>() == 32);
const _: () = assert!(std::mem::size_of::<RestoreArgs>() == 64);
const _: () = assert!(std::mem::offset_of!(RestoreArgs, gpu_pairs_count) == 8);

impl RestoreArgs {
    /// All 64 bytes zero: what every driver before 13000 requires.
    fn zeroed() -> Self {
        Self {
            gpu_pairs: std::ptr::null_mut(),
            gpu_pairs_count: 0,
            rest: [0; 52],
        }
    }
}

/// Why the library could not be used at all.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// `dlopen` failed (no driver on this node, or a wrong path).
    #[error("cannot load the CUDA driver library {library}")]
    Open {
        /// The library path or name.
        library: PathBuf,
        /// The loader's error.
        #[source]
        source: libloading::Error,
    },
    /// A symbol every supported driver exports is missing: not a CUDA driver library.
    #[error("{library} has no symbol {symbol} (not a CUDA driver library?)")]
    Symbol {
        /// The library path or name.
        library: PathBuf,
        /// The missing symbol.
        symbol: &'static str,
        /// The loader's error.
        #[source]
        source: libloading::Error,
    },
}

type FnInit = unsafe extern "C" fn(c_uint) -> CuResult;
type FnOutInt = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnErrorText = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
type FnDeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
type FnDeviceUuid = unsafe extern "C" fn(*mut CuUuid, CuDevice) -> CuResult;
type FnDeviceName = unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult;
type FnDeviceMem = unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult;
type FnPidOutInt = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;
type FnLock = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResult;
type FnReserved = unsafe extern "C" fn(c_int, *mut ReservedArgs) -> CuResult;
type FnRestore = unsafe extern "C" fn(c_int, *mut RestoreArgs) -> CuResult;

/// The six process-checkpoint entry points (driver r570 and newer).
#[derive(Debug, Clone, Copy)]
struct CheckpointApi {
    get_restore_thread_id: FnPidOutInt,
    get_state: FnPidOutInt,
    lock: FnLock,
    checkpoint: FnReserved,
    restore: FnRestore,
    unlock: FnReserved,
}

/// An opened driver library and its resolved entry points.
///
/// The function pointers stay valid because `_library` is never unloaded before them (it is
/// dropped last, and nothing hands the pointers out). The CUDA driver API is thread-safe
/// (CUDA Driver API, "Thread Safety"), so the type is `Send + Sync` like its fields.
#[derive(Debug)]
pub struct RawDriver {
    library_path: PathBuf,
    init: FnInit,
    driver_get_version: FnOutInt,
    get_error_name: FnErrorText,
    get_error_string: FnErrorText,
    device_get_count: FnOutInt,
    device_get: FnDeviceGet,
    device_get_uuid: FnDeviceUuid,
    /// `cuDeviceGetUuid_v2` (CUDA 11.4+): a MIG instance's own UUID.
    device_get_uuid_v2: Option<FnDeviceUuid>,
    device_get_name: FnDeviceName,
    device_total_mem: FnDeviceMem,
    checkpoint: Option<CheckpointApi>,
    _library: Library,
}

/// Resolves one symbol and copies the function pointer out.
///
/// # Safety
/// `T` must be the C signature of `name` in `cuda.h`.
unsafe fn symbol<T: Copy>(
    library: &Library,
    path: &Path,
    name: &'static str,
) -> Result<T, LoadError> {
    let cname = format!("{name}\0");
    // SAFETY: the caller guarantees `T` matches the symbol's C type; the pointer is copied
    // out but only used while `library` lives (it is stored next to it in `RawDriver`).
    unsafe { library.get::<T>(cname.as_bytes()) }
        .map(|s| *s)
        .map_err(|source| LoadError::Symbol {
            library: path.to_owned(),
            symbol: name,
            source,
        })
}

impl RawDriver {
    /// Opens `library` (a path, or a bare name the dynamic loader searches for) and resolves
    /// the symbols. The checkpoint API is optional here (drivers before r570 lack it); using
    /// it on such a driver is reported by [`RawDriver::has_checkpoint_api`].
    ///
    /// # Errors
    /// [`LoadError`] when the library cannot be opened or lacks a basic driver symbol.
    pub fn open(library: &Path) -> Result<Self, LoadError> {
        // SAFETY: loading the CUDA driver runs its ELF constructors, which have no
        // preconditions on the caller; `RTLD_NOW` (libloading's default) resolves everything
        // up front, so a broken library fails here rather than in a later call.
        let lib =
            unsafe { Library::new(library.as_os_str()) }.map_err(|source| LoadError::Open {
                library: library.to_owned(),
                source,
            })?;
        // SAFETY (each `symbol` call below): the type aliases mirror the prototypes of
        // cuda.h: `CUresult f(unsigned)`, `CUresult f(int*)`, `CUresult f(CUresult, const
        // char**)`, `CUresult f(CUdevice*, int)`, `CUresult f(CUuuid*, CUdevice)`, `CUresult
        // f(char*, int, CUdevice)`, `CUresult f(size_t*, CUdevice)` and the checkpoint API's
        // `CUresult f(int pid, T* args)` with `T` the 64-byte argument structs above.
        let checkpoint = (|| -> Result<CheckpointApi, LoadError> {
            // SAFETY: see the block comment above.
            unsafe {
                Ok(CheckpointApi {
                    get_restore_thread_id: symbol(
                        &lib,
                        library,
                        "cuCheckpointProcessGetRestoreThreadId",
                    )?,
                    get_state: symbol(&lib, library, "cuCheckpointProcessGetState")?,
                    lock: symbol(&lib, library, "cuCheckpointProcessLock")?,
                    checkpoint: symbol(&lib, library, "cuCheckpointProcessCheckpoint")?,
                    restore: symbol(&lib, library, "cuCheckpointProcessRestore")?,
                    unlock: symbol(&lib, library, "cuCheckpointProcessUnlock")?,
                })
            }
        })()
        .ok();
        // SAFETY: see the block comment above.
        unsafe {
            Ok(Self {
                library_path: library.to_owned(),
                init: symbol(&lib, library, "cuInit")?,
                driver_get_version: symbol(&lib, library, "cuDriverGetVersion")?,
                get_error_name: symbol(&lib, library, "cuGetErrorName")?,
                get_error_string: symbol(&lib, library, "cuGetErrorString")?,
                device_get_count: symbol(&lib, library, "cuDeviceGetCount")?,
                device_get: symbol(&lib, library, "cuDeviceGet")?,
                device_get_uuid: symbol(&lib, library, "cuDeviceGetUuid")?,
                device_get_uuid_v2: symbol(&lib, library, "cuDeviceGetUuid_v2").ok(),
                device_get_name: symbol(&lib, library, "cuDeviceGetName")?,
                device_total_mem: symbol(&lib, library, "cuDeviceTotalMem_v2")?,
                checkpoint,
                _library: lib,
            })
        }
    }

    /// The path or name the library was opened from.
    pub fn library_path(&self) -> &Path {
        &self.library_path
    }

    /// Whether the six `cuCheckpointProcess*` functions were found (driver r570 or newer).
    pub fn has_checkpoint_api(&self) -> bool {
        self.checkpoint.is_some()
    }

    fn api(&self) -> Result<&CheckpointApi, CuResult> {
        // CUDA_ERROR_NOT_SUPPORTED: what a caller of a missing entry point would be told.
        self.checkpoint.as_ref().ok_or(801)
    }

    /// `cuInit(0)`.
    #[doc(alias = "cuInit")]
    pub fn init(&self) -> CuResult {
        // SAFETY: `cuInit` takes a flags word that must be 0 and no pointers.
        unsafe { (self.init)(0) }
    }

    /// `cuDriverGetVersion`: e.g. 12080 for 12.8.
    #[doc(alias = "cuDriverGetVersion")]
    pub fn driver_version(&self) -> Result<i32, CuResult> {
        let mut version: c_int = 0;
        // SAFETY: the out pointer is a live, aligned local.
        out(unsafe { (self.driver_get_version)(&mut version) }, version)
    }

    /// `cuGetErrorName`, `None` for a code the driver does not know.
    #[doc(alias = "cuGetErrorName")]
    pub fn error_name(&self, code: CuResult) -> Option<String> {
        self.error_text(self.get_error_name, code)
    }

    /// `cuGetErrorString`, `None` for a code the driver does not know.
    #[doc(alias = "cuGetErrorString")]
    pub fn error_string(&self, code: CuResult) -> Option<String> {
        self.error_text(self.get_error_string, code)
    }

    fn error_text(&self, f: FnErrorText, code: CuResult) -> Option<String> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: the out pointer is a live local; the driver stores a pointer to a static,
        // NUL-terminated string (or leaves it null and returns an error).
        let rc = unsafe { f(code, &mut text) };
        if rc != CUDA_SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated and static per the driver API documentation.
        Some(
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// `cuDeviceGetCount` (needs `cuInit`).
    #[doc(alias = "cuDeviceGetCount")]
    pub fn device_count(&self) -> Result<i32, CuResult> {
        let mut count: c_int = 0;
        // SAFETY: the out pointer is a live, aligned local.
        out(unsafe { (self.device_get_count)(&mut count) }, count)
    }

    /// `cuDeviceGet` for an ordinal.
    #[doc(alias = "cuDeviceGet")]
    pub fn device(&self, ordinal: i32) -> Result<CuDevice, CuResult> {
        let mut device: CuDevice = 0;
        // SAFETY: the out pointer is a live, aligned local.
        out(unsafe { (self.device_get)(&mut device, ordinal) }, device)
    }

    /// `cuDeviceGetUuid`.
    #[doc(alias = "cuDeviceGetUuid")]
    pub fn device_uuid(&self, device: CuDevice) -> Result<CuUuid, CuResult> {
        let mut uuid = CuUuid::default();
        // SAFETY: `uuid` is a live 16-byte `#[repr(C)]` CUuuid.
        out(unsafe { (self.device_get_uuid)(&mut uuid, device) }, uuid)
    }

    /// `cuDeviceGetUuid_v2`, `None` on a driver without it: for a MIG instance its MIG UUID,
    /// where `cuDeviceGetUuid` answers its parent GPU's.
    #[doc(alias = "cuDeviceGetUuid_v2")]
    pub fn device_uuid_v2(&self, device: CuDevice) -> Option<Result<CuUuid, CuResult>> {
        let f = self.device_get_uuid_v2?;
        let mut uuid = CuUuid::default();
        // SAFETY: `uuid` is a live 16-byte `#[repr(C)]` CUuuid; same prototype as v1.
        Some(out(unsafe { f(&mut uuid, device) }, uuid))
    }

    /// `cuDeviceGetName`.
    #[doc(alias = "cuDeviceGetName")]
    pub fn device_name(&self, device: CuDevice) -> Result<String, CuResult> {
        let mut buf = [0 as c_char; 256];
        let len = c_int::try_from(buf.len()).unwrap_or(c_int::MAX);
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        let rc = unsafe { (self.device_get_name)(buf.as_mut_ptr(), len, device) };
        if rc != CUDA_SUCCESS {
            return Err(rc);
        }
        // Never trust the terminator: read up to the first NUL inside the buffer.
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c.to_ne_bytes()[0])
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `cuDeviceTotalMem_v2`, in bytes.
    #[doc(alias = "cuDeviceTotalMem_v2")]
    pub fn device_total_mem(&self, device: CuDevice) -> Result<u64, CuResult> {
        let mut bytes: usize = 0;
        // SAFETY: the out pointer is a live, aligned local.
        let rc = unsafe { (self.device_total_mem)(&mut bytes, device) };
        out(rc, u64::try_from(bytes).unwrap_or(u64::MAX))
    }

    /// `cuCheckpointProcessGetRestoreThreadId`.
    #[doc(alias = "cuCheckpointProcessGetRestoreThreadId")]
    pub fn restore_thread_id(&self, pid: i32) -> Result<i32, CuResult> {
        let api = self.api()?;
        let mut tid: c_int = 0;
        // SAFETY: the out pointer is a live, aligned local; `pid` is a plain integer.
        out(unsafe { (api.get_restore_thread_id)(pid, &mut tid) }, tid)
    }

    /// `cuCheckpointProcessGetState`, the raw `CUprocessState` value.
    #[doc(alias = "cuCheckpointProcessGetState")]
    pub fn process_state(&self, pid: i32) -> Result<i32, CuResult> {
        let api = self.api()?;
        // Read as a plain int: newer drivers add values a Rust enum would not know.
        let mut state: c_int = -1;
        // SAFETY: the out pointer is a live, aligned local (CUprocessState is an int enum).
        out(unsafe { (api.get_state)(pid, &mut state) }, state)
    }

    /// `cuCheckpointProcessLock`; `timeout_ms` 0 waits without limit.
    #[doc(alias = "cuCheckpointProcessLock")]
    pub fn lock(&self, pid: i32, timeout_ms: u32) -> CuResult {
        let api = match self.api() {
            Ok(api) => api,
            Err(rc) => return rc,
        };
        let mut args = LockArgs {
            timeout_ms,
            ..LockArgs::default()
        };
        // SAFETY: `args` is a live 64-byte struct with its reserved fields zeroed.
        unsafe { (api.lock)(pid, &mut args) }
    }

    /// `cuCheckpointProcessCheckpoint`.
    #[doc(alias = "cuCheckpointProcessCheckpoint")]
    pub fn checkpoint(&self, pid: i32) -> CuResult {
        let api = match self.api() {
            Ok(api) => api,
            Err(rc) => return rc,
        };
        let mut args = ReservedArgs::default();
        // SAFETY: `args` is a live, all-zero 64-byte struct.
        unsafe { (api.checkpoint)(pid, &mut args) }
    }

    /// `cuCheckpointProcessRestore`. `pairs` must be empty unless `driver_version` is at least
    /// [`REMAP_MIN_DRIVER`] (the caller checks; an older driver's struct is all reserved).
    #[doc(alias = "cuCheckpointProcessRestore")]
    pub fn restore(&self, pid: i32, driver_version: i32, pairs: &[GpuPair]) -> CuResult {
        let api = match self.api() {
            Ok(api) => api,
            Err(rc) => return rc,
        };
        let mut pairs = pairs.to_vec();
        let mut args = RestoreArgs::zeroed();
        if driver_version >= REMAP_MIN_DRIVER && !pairs.is_empty() {
            let Ok(count) = c_uint::try_from(pairs.len()) else {
                return CUDA_ERROR_INVALID_VALUE;
            };
            args.gpu_pairs = pairs.as_mut_ptr();
            args.gpu_pairs_count = count;
        } else if !pairs.is_empty() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: `args` is a live 64-byte struct whose bytes past the pair fields are zero;
        // `gpu_pairs` is null or points at `count` live pairs that outlive the call.
        unsafe { (api.restore)(pid, &mut args) }
    }

    /// `cuCheckpointProcessUnlock`.
    #[doc(alias = "cuCheckpointProcessUnlock")]
    pub fn unlock(&self, pid: i32) -> CuResult {
        let api = match self.api() {
            Ok(api) => api,
            Err(rc) => return rc,
        };
        let mut args = ReservedArgs::default();
        // SAFETY: `args` is a live, all-zero 64-byte struct.
        unsafe { (api.unlock)(pid, &mut args) }
    }
}

fn out<T>(rc: CuResult, value: T) -> Result<T, CuResult> {
    if rc == CUDA_SUCCESS {
        Ok(value)
    } else {
        Err(rc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_args_are_all_zero_for_drivers_before_remapping() {
        let args = RestoreArgs::zeroed();
        // SAFETY: RestoreArgs is 64 bytes of plain data; viewing it as bytes reads each once.
        let bytes: [u8; 64] = unsafe { std::mem::transmute(args) };
        assert_eq!(bytes, [0u8; 64]);
        let lock = LockArgs {
            timeout_ms: 7,
            ..LockArgs::default()
        };
        // SAFETY: as above, LockArgs is 64 bytes of plain data.
        let bytes: [u8; 64] = unsafe { std::mem::transmute(lock) };
        assert_eq!(bytes[..4], 7u32.to_ne_bytes());
        assert!(
            bytes[4..].iter().all(|&b| b == 0),
            "reserved bytes not zero"
        );
    }

    #[test]
    fn a_library_that_is_not_there_is_a_load_error_naming_it() {
        let err = RawDriver::open(Path::new("/nonexistent/libcuda.so.1")).unwrap_err();
        assert!(matches!(err, LoadError::Open { .. }));
        assert!(err.to_string().contains("/nonexistent/libcuda.so.1"));
    }

    #[test]
    fn a_library_without_driver_symbols_is_refused_naming_the_symbol() {
        // libc is loaded in every process and exports none of the driver's symbols.
        let err = RawDriver::open(Path::new("libc.so.6")).unwrap_err();
        match err {
            LoadError::Symbol { symbol, .. } => assert_eq!(symbol, "cuInit"),
            other => panic!("unexpected {other}"),
        }
    }
}
