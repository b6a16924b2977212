//! `warmstart-cuda-workload`: a GPU workload that uses only the CUDA driver API of
//! `libcuda.so.1` (no runtime library, no toolkit), for `scripts/gpu-check.sh` on a real GPU
//! and for the tests against the stand-in driver.
//!
//! It allocates `--mib` MiB of device memory in pieces of at most `--piece-mib`, fills it with
//! a pattern computed from each byte's position, keeps its context, and prints one `READY`
//! line with its device pointers and the time of a plain `cuMemcpyDtoH` of everything (the
//! reference for a checkpoint's device→host throughput). On each SIGUSR1 it reads all device
//! memory back, compares it with the recomputed pattern, then proves the driver still works
//! (allocates, copies, frees a fresh buffer), and prints `OK …` or `MISMATCH …`. SIGUSR1 is
//! blocked before `cuInit`, so the driver's own threads never take it. Lines also go to
//! `--report FILE` when given (a container's stdout may not be reachable).
//!
//! On each SIGUSR2 it launches a kernel that spins on the GPU for `--spin-ms` ms (default
//! 5000; PTX loaded with `cuModuleLoadData`, started with `cuLaunchKernel`), prints
//! `SPIN launched ms=…`, waits for it (`cuCtxSynchronize`) and prints `SPIN done ms=…`: GPU
//! work in flight for as long as asked, for a lock to wait on or time out on.
//!
//! With `--ticks FILE` a thread of its own looks at its PID namespace every millisecond and,
//! each time it finds a new one (after a CRIU restore into another container), appends
//! `<namespace> <wall-clock ns>` to FILE: when its first application thread ran after a
//! restore, to compare with when its GPU state came back.
//!
//! `--device 0,1` holds a context on each GPU listed (memory goes to the first).
//! With `--no-context` it only loads the library (it maps `libcuda.so.1` but never calls
//! `cuInit`), prints `READY … no-context` and waits: a process that maps the driver without
//! holding CUDA state.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::io::Write;
use std::time::Instant;

use libloading::Library;
use nix::sys::signal::{SigSet, Signal};

type Fn0 = unsafe extern "C" fn(c_uint) -> c_int;
type FnDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type FnRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type FnSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type FnFree = unsafe extern "C" fn(u64) -> c_int;
type FnHtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
type FnDtoH = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
type FnErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
type FnModuleLoad = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
type FnGetFunction = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int;
type FnLaunch = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;
type FnSync = unsafe extern "C" fn() -> c_int;

/// A kernel of one thread that spins until the GPU's global timer has advanced by its
/// parameter (nanoseconds). PTX ISA 7.0 for sm_50: the driver JIT-compiles it for any GPU
/// the checkpoint API supports.
const SPIN_PTX: &str = "\
.version 7.0
.target sm_50
.address_size 64
.visible .entry spin(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
WAIT:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p, %rd4, %rd3;
    @%p bra WAIT;
    ret;
}
\0";

struct Cuda {
    init: Fn0,
    device_get: FnDeviceGet,
    retain: FnRetain,
    set_current: FnSetCurrent,
    alloc: FnAlloc,
    free: FnFree,
    htod: FnHtoD,
    dtoh: FnDtoH,
    error_name: FnErrorName,
    module_load: FnModuleLoad,
    get_function: FnGetFunction,
    launch: FnLaunch,
    synchronize: FnSync,
    _lib: Library,
}

impl Cuda {
    fn load(path: &str) -> Result<Self, String> {
        // SAFETY: loading the driver runs its constructors, which need nothing from us.
        let lib = unsafe { Library::new(path) }.map_err(|e| format!("cannot load {path}: {e}"))?;
        fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
            // SAFETY: each call below names `T` as the symbol's prototype in cuda.h; the
            // pointer is used only while the library (kept in `Cuda`) is loaded.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| format!("no {name}: {e}"))
        }
        Ok(Self {
            init: sym(&lib, "cuInit")?,
            device_get: sym(&lib, "cuDeviceGet")?,
            retain: sym(&lib, "cuDevicePrimaryCtxRetain")?,
            set_current: sym(&lib, "cuCtxSetCurrent")?,
            alloc: sym(&lib, "cuMemAlloc_v2")?,
            free: sym(&lib, "cuMemFree_v2")?,
            htod: sym(&lib, "cuMemcpyHtoD_v2")?,
            dtoh: sym(&lib, "cuMemcpyDtoH_v2")?,
            error_name: sym(&lib, "cuGetErrorName")?,
            module_load: sym(&lib, "cuModuleLoadData")?,
            get_function: sym(&lib, "cuModuleGetFunction")?,
            launch: sym(&lib, "cuLaunchKernel")?,
            synchronize: sym(&lib, "cuCtxSynchronize")?,
            _lib: lib,
        })
    }

    fn check(&self, what: &str, rc: c_int) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: the out pointer is a live local; the driver stores a static string.
        let known = unsafe { (self.error_name)(rc, &mut name) } == 0 && !name.is_null();
        let text = if known {
            // SAFETY: non-null, static and NUL-terminated per the driver API.
            unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            String::from("unknown")
        };
        Err(format!("{what} failed: {text} ({rc})"))
    }
}

/// The pattern byte at `offset` of buffer `index`: cheap, position-dependent, never all-zero.
fn pattern(index: usize, offset: usize, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        let x = ((offset + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64 + 1);
        *b = (x >> 29).to_le_bytes()[0];
    }
}

struct Args {
    library: String,
    mib: usize,
    piece_mib: usize,
    /// Ordinals of the GPUs to hold a context on; memory goes to the first.
    devices: Vec<c_int>,
    report: Option<String>,
    no_context: bool,
    spin_ms: u64,
    ticks: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        library: "libcuda.so.1".into(),
        mib: 64,
        piece_mib: 1024,
        devices: vec![0],
        report: None,
        no_context: false,
        spin_ms: 5000,
        ticks: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--library" => a.library = value()?,
            "--mib" => a.mib = value()?.parse().map_err(|e| format!("--mib: {e}"))?,
            "--piece-mib" => {
                a.piece_mib = value()?.parse().map_err(|e| format!("--piece-mib: {e}"))?
            }
            "--device" => {
                a.devices = value()?
                    .split(',')
                    .map(|d| d.trim().parse().map_err(|e| format!("--device: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--report" => a.report = Some(value()?),
            "--no-context" => a.no_context = true,
            "--spin-ms" => a.spin_ms = value()?.parse().map_err(|e| format!("--spin-ms: {e}"))?,
            "--ticks" => a.ticks = Some(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.mib == 0 || a.piece_mib == 0 {
        return Err("--mib and --piece-mib must be positive".into());
    }
    Ok(a)
}

struct Out(Option<std::fs::File>);

impl Out {
    fn line(&mut self, text: &str) {
        println!("{text}");
        let _ = std::io::stdout().flush();
        if let Some(f) = &mut self.0 {
            let _ = writeln!(f, "{text}");
            let _ = f.flush();
        }
    }
}

const STAGE: usize = 64 << 20;

fn main() {
    if let Err(e) = run() {
        eprintln!("warmstart-cuda-workload: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let a = args()?;
    let mut out = Out(match &a.report {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| format!("{p}: {e}"))?,
        ),
        None => None,
    });
    let mut usr1 = SigSet::empty();
    usr1.add(Signal::SIGUSR1);
    usr1.add(Signal::SIGUSR2);
    usr1.thread_block()
        .map_err(|e| format!("sigprocmask: {e}"))?;
    if let Some(path) = a.ticks.clone() {
        std::thread::Builder::new()
            .name("ticks".into())
            .spawn(move || ticks(&path))
            .map_err(|e| format!("cannot start the ticks thread: {e}"))?;
    }

    let cu = Cuda::load(&a.library)?;
    if a.no_context {
        out.line(&format!("READY pid={} no-context", std::process::id()));
        loop {
            usr1.wait().map_err(|e| format!("sigwait: {e}"))?;
        }
    }
    // SAFETY: arguments follow cuda.h; out pointers are live locals. (The same holds for
    // every driver call below, whose host buffers are valid for the byte counts passed.)
    unsafe {
        cu.check("cuInit", (cu.init)(0))?;
        let mut first: *mut c_void = std::ptr::null_mut();
        for &ordinal in &a.devices {
            let mut dev: c_int = 0;
            cu.check("cuDeviceGet", (cu.device_get)(&mut dev, ordinal))?;
            let mut ctx: *mut c_void = std::ptr::null_mut();
            cu.check("cuDevicePrimaryCtxRetain", (cu.retain)(&mut ctx, dev))?;
            if first.is_null() {
                first = ctx;
            }
        }
        cu.check("cuCtxSetCurrent", (cu.set_current)(first))?;
    }
    let total = a.mib << 20;
    let piece = a.piece_mib << 20;
    let mut buffers: Vec<(u64, usize)> = Vec::new();
    let mut host = vec![0u8; STAGE.min(total)];
    let fill_start = Instant::now();
    let mut left = total;
    while left > 0 {
        let size = left.min(piece);
        let mut ptr = 0u64;
        // SAFETY: see above.
        cu.check("cuMemAlloc_v2", unsafe { (cu.alloc)(&mut ptr, size) })?;
        let index = buffers.len();
        let mut offset = 0;
        while offset < size {
            let n = STAGE.min(size - offset);
            pattern(index, offset, &mut host[..n]);
            // SAFETY: see above.
            cu.check("cuMemcpyHtoD_v2", unsafe {
                (cu.htod)(ptr + offset as u64, host.as_ptr().cast(), n)
            })?;
            offset += n;
        }
        buffers.push((ptr, size));
        left -= size;
    }
    let fill = fill_start.elapsed();
    let dtoh_start = Instant::now();
    for &(ptr, size) in &buffers {
        let mut offset = 0;
        while offset < size {
            let n = STAGE.min(size - offset);
            // SAFETY: see above.
            cu.check("cuMemcpyDtoH_v2", unsafe {
                (cu.dtoh)(host.as_mut_ptr().cast(), ptr + offset as u64, n)
            })?;
            offset += n;
        }
    }
    let dtoh = dtoh_start.elapsed();
    let gbps = total as f64 / dtoh.as_secs_f64().max(1e-9) / 1e9;
    out.line(&format!(
        "READY pid={} bytes={total} buffers={} first=0x{:x} fill_ms={} dtoh_ms={} dtoh_gbps={gbps:.2}",
        std::process::id(),
        buffers.len(),
        buffers.first().map_or(0, |b| b.0),
        fill.as_millis(),
        dtoh.as_millis(),
    ));
    loop {
        if usr1.wait().map_err(|e| format!("sigwait: {e}"))? == Signal::SIGUSR2 {
            match spin(&cu, a.spin_ms, &mut out) {
                Ok(took) => out.line(&format!("SPIN done ms={}", took.as_millis())),
                Err(e) => out.line(&format!("SPIN failed {e}")),
            }
            continue;
        }
        let started = Instant::now();
        let mut expect = vec![0u8; host.len()];
        let mut bad = None;
        'check: for (index, &(ptr, size)) in buffers.iter().enumerate() {
            let mut offset = 0;
            while offset < size {
                let n = STAGE.min(size - offset);
                // SAFETY: see above.
                cu.check("cuMemcpyDtoH_v2", unsafe {
                    (cu.dtoh)(host.as_mut_ptr().cast(), ptr + offset as u64, n)
                })?;
                pattern(index, offset, &mut expect[..n]);
                if let Some(i) = (0..n).find(|&i| host[i] != expect[i]) {
                    bad = Some((index, offset + i));
                    break 'check;
                }
                offset += n;
            }
        }
        // A fresh allocation and round trip: the driver works after whatever happened.
        let mut probe = 0u64;
        let word = [0x5au8; 4096];
        let mut back = [0u8; 4096];
        // SAFETY: see above.
        let fresh = unsafe {
            cu.check("cuMemAlloc_v2", (cu.alloc)(&mut probe, word.len()))
                .and_then(|()| {
                    cu.check(
                        "cuMemcpyHtoD_v2",
                        (cu.htod)(probe, word.as_ptr().cast(), word.len()),
                    )
                })
                .and_then(|()| {
                    cu.check(
                        "cuMemcpyDtoH_v2",
                        (cu.dtoh)(back.as_mut_ptr().cast(), probe, back.len()),
                    )
                })
                .and_then(|()| cu.check("cuMemFree_v2", (cu.free)(probe)))
        };
        match (bad, fresh) {
            (None, Ok(())) if back == word => out.line(&format!(
                "OK bytes={total} first=0x{:x} verify_ms={}",
                buffers.first().map_or(0, |b| b.0),
                started.elapsed().as_millis()
            )),
            (Some((index, at)), _) => out.line(&format!("MISMATCH buffer={index} offset={at}")),
            (None, Err(e)) => out.line(&format!("MISMATCH fresh-call {e}")),
            (None, Ok(())) => out.line("MISMATCH fresh-call round trip"),
        }
    }
}

/// Launches the spin kernel for `ms` and waits for it; returns how long that took.
fn spin(cu: &Cuda, ms: u64, out: &mut Out) -> Result<std::time::Duration, String> {
    let mut module: *mut c_void = std::ptr::null_mut();
    let mut function: *mut c_void = std::ptr::null_mut();
    let mut ns: u64 = ms.saturating_mul(1_000_000);
    let mut params = [std::ptr::from_mut(&mut ns).cast::<c_void>()];
    // SAFETY: the image is NUL-terminated PTX; the out pointers are live locals; the kernel
    // takes one u64 parameter, pointed at by `params[0]` until the launch returns (the
    // driver copies parameters at launch).
    unsafe {
        cu.check(
            "cuModuleLoadData",
            (cu.module_load)(&mut module, SPIN_PTX.as_ptr().cast()),
        )?;
        cu.check(
            "cuModuleGetFunction",
            (cu.get_function)(&mut function, module, c"spin".as_ptr()),
        )?;
        let started = Instant::now();
        cu.check(
            "cuLaunchKernel",
            (cu.launch)(
                function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        )?;
        out.line(&format!("SPIN launched ms={ms}"));
        cu.check("cuCtxSynchronize", (cu.synchronize)())?;
        Ok(started.elapsed())
    }
}

/// Appends `<PID namespace> <wall-clock ns>` to `path` each time the namespace changes.
fn ticks(path: &str) {
    let mut seen = String::new();
    loop {
        let ns = std::fs::read_link("/proc/self/ns/pid")
            .map(|l| l.display().to_string())
            .unwrap_or_default();
        if ns != seen {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = writeln!(f, "{ns} {now}");
            }
            seen = ns;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
