//! The agent's CUDA binding against the recording stand-in for `libcuda.so.1`, loaded through
//! the same code path as the real driver (`dlopen` of the configured library, every call in a
//! killable `warmstart-agent cuda-helper` process): a driver-API workload holding device memory
//! is locked, checkpointed, restored and unlocked with its memory intact; wrong-state calls,
//! each fault knob and the refusals come back as named errors with the process left as the
//! rules say; and CRIU refuses to dump a workload whose GPU state was not checkpointed first.
//! Needs CRIU for the last test (CI has it: `make setup`).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use warmstart_agent::cuda::ffi::RawDriver;
use warmstart_agent::cuda::{
    Call, CudaDriver, CudaError, CudaOptions, CudaProcessState, Isolation,
};
use warmstart_agent::gpu;
use warmstart_agent::seams::cuda::CudaSlot;
use warmstart_agent::timings::Timings;
use warmstart_e2e::binaries;
use warmstart_e2e::cuda::{GpuNode, SimGpu};

const GIB: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(60);

fn node() -> GpuNode {
    GpuNode::start(
        12080,
        &[SimGpu::numbered(0, 80 * GIB), SimGpu::numbered(1, 80 * GIB)],
    )
    .unwrap()
}

fn driver(node: &GpuNode, call_timeout: Duration) -> CudaDriver {
    CudaDriver::open(CudaOptions {
        library: node.library().to_owned(),
        isolation: Isolation::Helper {
            program: binaries::agent().unwrap(),
            args: vec!["cuda-helper".into()],
        },
        call_timeout,
        lock_timeout: Duration::from_secs(10),
        nvidia_driver_dir: node.nvidia_driver_dir(),
    })
    .unwrap()
}

/// A running `warmstart-cuda-workload`, killed on drop.
struct Workload {
    child: Child,
    report: PathBuf,
    _tmp: tempfile::TempDir,
    ready: String,
}

impl Workload {
    fn start(node: &GpuNode, mib: u32) -> Self {
        Self::start_with(node, &["--mib", &mib.to_string(), "--piece-mib", "24"])
    }

    fn start_with(node: &GpuNode, args: &[&str]) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let report = tmp.path().join("report");
        // Its own session, through setsid(1), which execs in place (the child is no group
        // leader) so the PID stays the workload's: CRIU refuses a tree whose session leader is
        // outside the dumped tree's PID namespace (`sid=0` where the runner's session began in
        // a parent namespace), even with `--shell-job`.
        let child = Command::new("setsid")
            .arg(node.workload())
            .arg("--library")
            .arg(node.library())
            .args(args)
            .arg("--report")
            .arg(&report)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut w = Self {
            child,
            report,
            _tmp: tmp,
            ready: String::new(),
        };
        w.ready = w.line(0);
        assert!(w.ready.starts_with("READY "), "{}", w.ready);
        w
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for line `n` (0-based) of the report.
    fn line(&mut self, n: usize) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let text = std::fs::read_to_string(&self.report).unwrap_or_default();
            if let Some(line) = text.lines().nth(n)
                && text.ends_with('\n')
            {
                return line.to_owned();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("workload exited with {status}: {text}");
            }
            assert!(Instant::now() < deadline, "no line {n} in {text:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Asks the workload to verify its device memory and make fresh CUDA calls.
    fn verify(&mut self) -> String {
        let n = std::fs::read_to_string(&self.report)
            .unwrap()
            .lines()
            .count();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.pid()).unwrap()),
            nix::sys::signal::Signal::SIGUSR1,
        )
        .unwrap();
        self.line(n)
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn assert_driver_error(err: &CudaError, call: Call, pid: u32, code: i32) {
    match err {
        CudaError::Driver {
            call: c,
            pid: Some(p),
            code: rc,
            ..
        } if *c == call && *p == pid && *rc == code => {}
        other => panic!("expected {call} for pid {pid} failing with {code}, got {other}"),
    }
    assert!(err.to_string().contains(&format!("pid {pid}")), "{err}");
}

#[test]
fn the_agent_reads_the_nodes_gpus_and_driver_through_the_stand_in() {
    let node = node();
    let inv = driver(&node, WAIT).inventory();
    assert_eq!(inv.driver_version, 12080);
    assert_eq!(inv.gpus.len(), 2);
    assert_eq!(inv.gpus[1].uuid, SimGpu::numbered(1, 0).uuid);
    assert_eq!(inv.gpus[0].name, "NVIDIA Stand-in 80GB");
    assert_eq!(inv.gpus[0].memory_bytes, 80 * GIB);
}

#[test]
fn a_node_without_a_driver_library_is_unavailable_not_a_crash() {
    let err = CudaDriver::open(CudaOptions {
        library: PathBuf::from("/nonexistent/libcuda.so.1"),
        isolation: Isolation::Helper {
            program: binaries::agent().unwrap(),
            args: vec!["cuda-helper".into()],
        },
        call_timeout: WAIT,
        lock_timeout: Duration::from_secs(10),
        nvidia_driver_dir: PathBuf::from("/nonexistent"),
    })
    .unwrap_err();
    assert!(matches!(err, CudaError::Unavailable { .. }), "{err}");
    assert!(
        err.to_string().contains("/nonexistent/libcuda.so.1"),
        "{err}"
    );
}

#[test]
fn checkpoint_and_restore_keep_device_memory_and_run_in_the_drivers_order() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 64);
    let pid = w.pid();
    assert!(w.verify().starts_with("OK "));
    assert_eq!(node.resident_bytes(), 64 << 20);

    let found = cuda.discover(pid).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].pid, pid);
    assert_eq!(found[0].state, CudaProcessState::Running);

    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    assert_eq!(cuda.process_state(pid).unwrap(), CudaProcessState::Locked);
    cuda.checkpoint(pid).unwrap();
    assert_eq!(
        cuda.process_state(pid).unwrap(),
        CudaProcessState::Checkpointed
    );
    // Device memory left the GPU: it is in the process now.
    assert_eq!(node.resident_bytes(), 0);

    cuda.restore(pid, &[]).unwrap();
    cuda.unlock(pid).unwrap();
    assert_eq!(cuda.process_state(pid).unwrap(), CudaProcessState::Running);
    assert_eq!(node.resident_bytes(), 64 << 20);
    let ok = w.verify();
    assert!(ok.starts_with("OK "), "{ok}");
    // The same device addresses as before.
    let first = |line: &str| {
        line.split_whitespace()
            .find(|f| f.starts_with("first="))
            .map(str::to_owned)
    };
    assert_eq!(first(&ok), first(&w.ready));

    let target = i32::try_from(pid).unwrap();
    let calls: Vec<String> = node
        .calls()
        .unwrap()
        .into_iter()
        .filter(|c| {
            c.target == Some(target)
                && c.call.starts_with("cuCheckpointProcess")
                && !c.call.ends_with("GetState")
                && !c.call.ends_with("ThreadId")
        })
        .map(|c| format!("{}={}", c.call, c.rc))
        .collect();
    assert_eq!(
        calls,
        [
            "cuCheckpointProcessLock=0",
            "cuCheckpointProcessCheckpoint=0",
            "cuCheckpointProcessRestore=0",
            "cuCheckpointProcessUnlock=0"
        ]
    );
    // The restoring process had called cuInit (the driver requires it).
    let restore = node
        .calls()
        .unwrap()
        .into_iter()
        .find(|c| c.call == "cuCheckpointProcessRestore")
        .unwrap();
    assert_eq!(restore.args["initialised"], json!(true));
    assert_eq!(restore.args["gpuPairs"], json!([]));
}

#[test]
fn calls_in_the_wrong_state_are_refused_with_the_drivers_error() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    let pid = w.pid();
    assert_driver_error(&cuda.unlock(pid).unwrap_err(), Call::Unlock, pid, 401);
    assert_driver_error(
        &cuda.checkpoint(pid).unwrap_err(),
        Call::Checkpoint,
        pid,
        401,
    );
    assert_driver_error(
        &cuda.restore(pid, &[]).unwrap_err(),
        Call::Restore,
        pid,
        401,
    );
    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    assert_driver_error(
        &cuda.lock(pid, Duration::from_secs(1)).unwrap_err(),
        Call::Lock,
        pid,
        401,
    );
    cuda.unlock(pid).unwrap();
    assert!(w.verify().starts_with("OK "));
}

/// The PIDs that checkpoint-API calls were made on.
fn targets(node: &GpuNode) -> Vec<i32> {
    node.calls()
        .unwrap()
        .into_iter()
        .filter(|c| c.call.starts_with("cuCheckpointProcess"))
        .filter_map(|c| c.target)
        .collect()
}

#[test]
fn only_processes_that_map_the_driver_are_asked_about_cuda() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut plain = Command::new("sleep").arg("1000").spawn().unwrap();
    let plain_pid = plain.id();
    let found = cuda.discover(plain_pid);
    let _ = plain.kill();
    let _ = plain.wait();
    assert_eq!(found.unwrap(), []);
    let asked = targets(&node);
    assert!(
        !asked.contains(&i32::try_from(plain_pid).unwrap()),
        "a process without the driver was probed: {asked:?}"
    );
}

#[test]
fn a_process_that_maps_the_driver_without_cuda_state_is_an_error_not_skipped() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let idle = Workload::start_with(&node, &["--no-context"]);
    assert!(idle.ready.ends_with("no-context"), "{}", idle.ready);
    let err = cuda.discover(idle.pid()).unwrap_err();
    match &err {
        CudaError::Driver {
            call: Call::GetRestoreThreadId,
            pid: Some(p),
            ..
        } if *p == idle.pid() => {}
        other => panic!(
            "expected the driver's answer for pid {}, got {other}",
            idle.pid()
        ),
    }
}

/// Asks the workload to verify (its device reads then run as GPU work) and waits until the
/// first of them is surely in flight.
fn start_gpu_work(w: &Workload) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(w.pid()).unwrap()),
        nix::sys::signal::Signal::SIGUSR1,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn a_lock_waits_for_the_gpu_work_in_flight() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    let lines = w.line(0);
    node.set_faults(&json!({"callDelayMs": 1500})).unwrap();
    start_gpu_work(&w);
    let started = Instant::now();
    cuda.lock(w.pid(), Duration::from_secs(20)).unwrap();
    let waited = started.elapsed();
    // The call in flight had about 1.2 s left.
    assert!(
        waited >= Duration::from_millis(800),
        "the lock took {waited:?}"
    );
    assert_eq!(
        cuda.process_state(w.pid()).unwrap(),
        CudaProcessState::Locked
    );
    node.set_faults(&json!({})).unwrap();
    cuda.unlock(w.pid()).unwrap();
    assert!(w.line(1).starts_with("OK "), "{lines}");
}

#[test]
fn a_lock_that_times_out_on_gpu_work_leaves_the_process_running() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    node.set_faults(&json!({"callDelayMs": 4000})).unwrap();
    start_gpu_work(&w);
    let started = Instant::now();
    let err = cuda.lock(w.pid(), Duration::from_millis(500)).unwrap_err();
    let took = started.elapsed();
    // Which code the driver answers a lock timeout with is not documented: only that the
    // lock failed, for this process, after its timeout and before the work ended.
    assert!(
        matches!(err, CudaError::Driver { call: Call::Lock, pid: Some(p), .. } if p == w.pid()),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(3500),
        "the lock gave up after {took:?}"
    );
    assert_eq!(
        cuda.process_state(w.pid()).unwrap(),
        CudaProcessState::Running
    );
    node.set_faults(&json!({})).unwrap();
    assert!(w.line(1).starts_with("OK "));
}

#[test]
fn an_uncorrectable_checkpoint_error_leaves_the_process_failed_and_the_agent_says_so() {
    let node = node();
    let cuda = Arc::new(driver(&node, WAIT));
    let w = Workload::start(&node, 8);
    let pid = w.pid();
    node.set_faults(&json!({"fail": "checkpoint"})).unwrap();
    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    assert!(matches!(
        cuda.checkpoint(pid).unwrap_err(),
        CudaError::Driver {
            call: Call::Checkpoint,
            ..
        }
    ));
    node.set_faults(&json!({})).unwrap();
    assert_eq!(cuda.process_state(pid).unwrap(), CudaProcessState::Failed);
    // Nothing moves it out of FAILED.
    assert_driver_error(&cuda.unlock(pid).unwrap_err(), Call::Unlock, pid, 401);
    assert_driver_error(
        &cuda.restore(pid, &[]).unwrap_err(),
        Call::Restore,
        pid,
        401,
    );
    assert_driver_error(
        &cuda.lock(pid, Duration::from_secs(1)).unwrap_err(),
        Call::Lock,
        pid,
        401,
    );
    let slot = CudaSlot::with(cuda.clone());
    let err = gpu::Hold::take(&slot, &[pid], None, &mut Timings::default()).unwrap_err();
    assert!(
        matches!(err, gpu::GpuError::Failed { pid: p } if p == pid),
        "{err}"
    );
    assert!(err.to_string().contains("FAILED state"), "{err}");
}

#[test]
fn restore_pairs_must_be_exactly_the_processes_gpus() {
    let node = GpuNode::start(
        13000,
        &[SimGpu::numbered(0, 80 * GIB), SimGpu::numbered(1, 80 * GIB)],
    )
    .unwrap();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    let pid = w.pid();
    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    cuda.checkpoint(pid).unwrap();
    let (g0, g1) = (SimGpu::numbered(0, 0).uuid, SimGpu::numbered(1, 0).uuid);
    // A pair for a GPU the process never used (it runs on GPU 0 only).
    let extra = [(g0.clone(), g1.clone()), (g1.clone(), g0.clone())];
    let err = cuda.restore(pid, &extra).unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::Driver {
                call: Call::Restore,
                ..
            }
        ),
        "{err}"
    );
    // Two GPUs onto one.
    let err = cuda
        .restore(pid, &[(g0.clone(), g1.clone()), (g0.clone(), g1.clone())])
        .unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::Driver {
                call: Call::Restore,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        cuda.process_state(pid).unwrap(),
        CudaProcessState::Checkpointed
    );
    cuda.restore(pid, &[(g0, g1)]).unwrap();
    cuda.unlock(pid).unwrap();
    assert!(w.verify().starts_with("OK "));
}

#[test]
fn a_restore_needs_the_target_gpus_device_node_in_the_process_s_view() {
    let node = GpuNode::start(
        13000,
        &[SimGpu::numbered(0, 80 * GIB), SimGpu::numbered(1, 80 * GIB)],
    )
    .unwrap();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    let pid = w.pid();
    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    cuda.checkpoint(pid).unwrap();
    node.remove_device_node("nvidia1").unwrap();
    let map = [(SimGpu::numbered(0, 0).uuid, SimGpu::numbered(1, 0).uuid)];
    let err = cuda.restore(pid, &map).unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::Driver {
                call: Call::Restore,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        cuda.process_state(pid).unwrap(),
        CudaProcessState::Checkpointed
    );
    // Once the node is there (as the restore puts the placeholder's nodes in place), it works.
    node.add_device_node("nvidia1", 1).unwrap();
    cuda.restore(pid, &map).unwrap();
    cuda.unlock(pid).unwrap();
    assert!(w.verify().starts_with("OK "));
    // And a context cannot be made on a GPU whose node is missing.
    node.remove_device_node("nvidia0").unwrap();
    let failed = Command::new(node.workload())
        .arg("--library")
        .arg(node.library())
        .args(["--mib", "2"])
        .output()
        .unwrap();
    assert!(!failed.status.success());
    assert!(
        String::from_utf8_lossy(&failed.stderr).contains("cuDevicePrimaryCtxRetain"),
        "{}",
        String::from_utf8_lossy(&failed.stderr)
    );
}

#[test]
fn a_hanging_checkpoint_is_killed_at_its_deadline_and_the_process_is_not_called_again() {
    let node = node();
    let cuda = driver(&node, Duration::from_secs(2));
    let w = Workload::start(&node, 8);
    node.set_faults(&json!({"hang": "checkpoint"})).unwrap();
    cuda.lock(w.pid(), Duration::from_secs(10)).unwrap();
    let err = cuda.checkpoint(w.pid()).unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::Timeout {
                call: Call::Checkpoint,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        cuda.unlock(w.pid()).unwrap_err(),
        CudaError::Poisoned { pid: w.pid() }
    );
}

#[test]
fn a_checkpoint_error_leaves_the_process_locked_and_unlock_returns_it_to_running() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    node.set_faults(&json!({"checkpointError": 999})).unwrap();
    cuda.lock(w.pid(), Duration::from_secs(10)).unwrap();
    let err = cuda.checkpoint(w.pid()).unwrap_err();
    assert_driver_error(&err, Call::Checkpoint, w.pid(), 999);
    assert!(err.to_string().contains("CUDA_ERROR_UNKNOWN"), "{err}");
    assert_eq!(
        cuda.process_state(w.pid()).unwrap(),
        CudaProcessState::Locked
    );
    cuda.unlock(w.pid()).unwrap();
    assert!(w.verify().starts_with("OK "));
}

#[test]
fn a_restore_out_of_memory_sticks_as_on_the_real_driver() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let w = Workload::start(&node, 8);
    let pid = w.pid();
    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    cuda.checkpoint(pid).unwrap();
    node.set_faults(&json!({"restoreOom": true})).unwrap();
    assert_driver_error(&cuda.restore(pid, &[]).unwrap_err(), Call::Restore, pid, 2);
    node.set_faults(&json!({})).unwrap();
    assert_driver_error(
        &cuda.restore(pid, &[]).unwrap_err(),
        Call::Restore,
        pid,
        304,
    );
    assert_driver_error(&cuda.unlock(pid).unwrap_err(), Call::Unlock, pid, 401);
}

#[test]
fn restoring_onto_other_gpus_needs_a_map_and_driver_13000() {
    let node = node();
    let w_cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    let pid = w.pid();
    w_cuda.lock(pid, Duration::from_secs(10)).unwrap();
    w_cuda.checkpoint(pid).unwrap();

    // "Another node": a different GPU, an old driver.
    let other = SimGpu::numbered(9, 80 * GIB);
    node.set_node(12080, std::slice::from_ref(&other)).unwrap();
    let old = driver(&node, WAIT);
    // Without a map, onto a GPU the process never used: refused (the code is not documented).
    let err = old.restore(pid, &[]).unwrap_err();
    assert!(
        matches!(err, CudaError::Driver { call: Call::Restore, pid: Some(p), .. } if p == pid),
        "{err}"
    );
    assert_eq!(
        old.process_state(pid).unwrap(),
        CudaProcessState::Checkpointed
    );
    let map = [(SimGpu::numbered(0, 0).uuid, other.uuid.clone())];
    assert_eq!(
        old.restore(pid, &map).unwrap_err(),
        CudaError::RemapUnsupported {
            driver_version: 12080
        }
    );

    // Driver 13.0: the pairs are passed and honoured.
    node.set_node(13000, std::slice::from_ref(&other)).unwrap();
    let new = driver(&node, WAIT);
    new.restore(pid, &map).unwrap();
    new.unlock(pid).unwrap();
    assert!(w.verify().starts_with("OK "));
    let restore = node
        .calls()
        .unwrap()
        .into_iter()
        .rfind(|c| c.call == "cuCheckpointProcessRestore" && c.rc == 0)
        .unwrap();
    assert_eq!(restore.args["gpuPairs"], json!([[map[0].0, map[0].1]]));
}

#[test]
fn restore_requires_cuinit_in_the_calling_process() {
    let node = node();
    let w = Workload::start(&node, 8);
    let pid = i32::try_from(w.pid()).unwrap();
    // The raw binding in this very process, which has not called cuInit.
    let raw = RawDriver::open(node.library()).unwrap();
    assert_eq!(raw.lock(pid, 10_000), 0);
    assert_eq!(raw.checkpoint(pid), 0);
    assert_eq!(raw.restore(pid, 12080, &[]), 3);
    assert_eq!(
        raw.error_name(3).as_deref(),
        Some("CUDA_ERROR_NOT_INITIALIZED")
    );
    assert_eq!(raw.init(), 0);
    assert_eq!(raw.restore(pid, 12080, &[]), 0);
    assert_eq!(raw.unlock(pid), 0);
    assert_eq!(raw.process_state(pid), Ok(0));
}

fn criu_dump(pid: u32, dir: &Path) -> (bool, String) {
    std::fs::create_dir_all(dir).unwrap();
    let status = Command::new(binaries::criu())
        .args([
            "dump",
            "--leave-running",
            "--shell-job",
            "-v4",
            "-o",
            "dump.log",
            "-t",
        ])
        .arg(pid.to_string())
        .arg("-D")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    (
        status.success(),
        std::fs::read_to_string(dir.join("dump.log")).unwrap_or_default(),
    )
}

#[test]
fn criu_refuses_a_workload_whose_gpu_state_was_not_checkpointed() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start(&node, 8);
    let images = tempfile::tempdir().unwrap();
    let (ok, log) = criu_dump(w.pid(), &images.path().join("before"));
    assert!(!ok, "CRIU dumped a workload holding device memory");
    assert!(log.contains("nix"), "{log}");
    assert!(w.verify().starts_with("OK "));

    cuda.lock(w.pid(), Duration::from_secs(10)).unwrap();
    cuda.checkpoint(w.pid()).unwrap();
    let (ok, log) = criu_dump(w.pid(), &images.path().join("after"));
    let tail: String = log.lines().rev().take(30).collect::<Vec<_>>().join("\n");
    assert!(ok, "CRIU failed on a CUDA-checkpointed workload:\n{tail}");
    cuda.restore(w.pid(), &[]).unwrap();
    cuda.unlock(w.pid()).unwrap();
    assert!(w.verify().starts_with("OK "));
}

/// The state letter of `pid`'s main thread (`T`: stopped).
fn process_state_letter(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap()
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        signal,
    )
    .unwrap();
}

/// A workload of `node`, checkpointed, then stopped (SIGSTOP) as a tree CRIU restored with
/// `--leave-stopped` is.
fn checkpointed_and_stopped(node: &GpuNode, cuda: &CudaDriver) -> Workload {
    let w = Workload::start(node, 8);
    let pid = w.pid();
    cuda.lock(pid, Duration::from_secs(10)).unwrap();
    cuda.checkpoint(pid).unwrap();
    signal(pid, nix::sys::signal::Signal::SIGSTOP);
    let deadline = Instant::now() + WAIT;
    while process_state_letter(pid) != 'T' {
        assert!(Instant::now() < deadline, "the workload does not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
    w
}

#[test]
fn a_restore_asked_while_the_restore_thread_is_stopped_is_abandoned() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let w = checkpointed_and_stopped(&node, &cuda);
    let pid = w.pid();
    // The state and the restore thread are answered with every thread stopped, and the
    // thread is one of the process's, as this caller sees it.
    let probed = cuda.probe(&[pid]).unwrap();
    assert_eq!(probed[0].state, CudaProcessState::Checkpointed);
    let tid = probed[0].restore_tid;
    assert!(
        Path::new(&format!("/proc/{pid}/task/{tid}")).exists(),
        "restore thread {tid} is not a thread of {pid}"
    );
    // A restore needs the restore thread to run: asked while it is stopped, the call could
    // only hang, and is abandoned, the process left as it was.
    let started = Instant::now();
    let err = cuda.restore(pid, &[]).unwrap_err();
    assert_eq!(
        err,
        CudaError::RestoreThreadStopped {
            call: Call::Restore,
            pid,
            tid
        }
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        cuda.process_state(pid).unwrap(),
        CudaProcessState::Checkpointed
    );
}

#[test]
fn a_stopped_process_is_restored_by_its_restore_thread_alone_and_stays_stopped() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = checkpointed_and_stopped(&node, &cuda);
    let pid = w.pid();
    let tid = cuda.probe(&[pid]).unwrap()[0].restore_tid;
    // Woken alone, the restore thread restores and unlocks; the process stays stopped.
    let tids = [(pid, tid)].into_iter().collect();
    let mut timings = Timings::default();
    gpu::restore_then_unlock(&cuda, &[pid], &tids, |_| Vec::new(), &mut timings).unwrap();
    assert_eq!(cuda.process_state(pid).unwrap(), CudaProcessState::Running);
    assert_eq!(process_state_letter(pid), 'T', "the process was resumed");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("TracerPid:\t0"), "still traced: {status}");
    signal(pid, nix::sys::signal::Signal::SIGCONT);
    assert!(w.verify().starts_with("OK "));
}

#[test]
fn a_lock_times_out_on_a_kernel_in_flight_and_the_process_runs_on() {
    let node = node();
    let cuda = driver(&node, WAIT);
    let mut w = Workload::start_with(
        &node,
        &["--mib", "8", "--piece-mib", "8", "--spin-ms", "3000"],
    );
    signal(w.pid(), nix::sys::signal::Signal::SIGUSR2);
    assert_eq!(w.line(1), "SPIN launched ms=3000");
    let started = Instant::now();
    let err = cuda.lock(w.pid(), Duration::from_millis(500)).unwrap_err();
    let took = started.elapsed();
    // The documented outcome: the lock fails after its timeout and leaves the process
    // RUNNING; which code it fails with is not documented, so it is not asserted.
    assert!(
        matches!(err, CudaError::Driver { call: Call::Lock, pid: Some(p), .. } if p == w.pid()),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(2500),
        "the lock gave up after {took:?}"
    );
    assert_eq!(
        cuda.process_state(w.pid()).unwrap(),
        CudaProcessState::Running
    );
    let done = w.line(2);
    assert!(done.starts_with("SPIN done ms="), "{done}");
    // Once the kernel ended, a lock is granted at once.
    cuda.lock(w.pid(), Duration::from_millis(500)).unwrap();
    cuda.unlock(w.pid()).unwrap();
    assert!(w.verify().starts_with("OK "));
}

#[test]
fn a_mig_instance_is_listed_by_its_mig_uuid_and_found_by_the_runtimes_id() {
    let whole = SimGpu::numbered(0, 80 * GIB);
    let parent = SimGpu::numbered(1, 80 * GIB);
    let mig = SimGpu::mig(1, &parent, 10 * GIB);
    let node = GpuNode::start(13000, &[whole.clone(), mig.clone()]).unwrap();
    let cuda = driver(&node, WAIT);
    let inventory = cuda.inventory();
    let uuids: Vec<&str> = inventory.gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(uuids, [whole.uuid.as_str(), mig.uuid.as_str()]);
    assert!(mig.uuid.starts_with("MIG-"), "{}", mig.uuid);
    // A container given the instance by its MIG UUID (as NVIDIA_VISIBLE_DEVICES and the
    // device plugin write it) is matched to it, in any case of letters.
    let runtime = warmstart_agent::runtime::gpus::RuntimeGpus::default();
    let upper = mig.uuid.to_uppercase();
    let evidence = warmstart_agent::gpu_assignment::Evidence {
        container: "c",
        runtime: &runtime,
        env: Some(&upper),
        device_nodes: true,
    };
    let assigned = warmstart_agent::gpu_assignment::determine(&evidence, Some(&inventory))
        .unwrap()
        .unwrap();
    let gpus = assigned.gpus.unwrap();
    assert_eq!(gpus.len(), 1);
    assert_eq!(gpus[0].uuid, mig.uuid);
    // Its parent GPU's UUID is not the instance.
    let by_parent = warmstart_agent::gpu_assignment::Evidence {
        env: Some(&parent.uuid),
        ..evidence
    };
    let err = warmstart_agent::gpu_assignment::determine(&by_parent, Some(&inventory)).unwrap_err();
    assert!(err.to_string().contains(&parent.uuid), "{err}");
}

#[test]
fn cuda_state_as_a_user_who_cannot_read_the_process_says_so_and_fails() {
    let node = node();
    let w = Workload::start(&node, 8);
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(binaries::agent().unwrap())
        .args(["cuda", "state", "--pid"])
        .arg(w.pid().to_string())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains(&format!("cannot read /proc/{}/maps", w.pid()))
            && stderr.contains("ermission denied"),
        "{stderr}"
    );
}
