//! [`CudaDriver`]: the agent's one handle on the CUDA driver. It exposes the operations the
//! engine needs (inventory, state, lock, checkpoint, restore with GPU remapping, unlock) and
//! discovery of a tree's CUDA processes, and runs each call either in this process (for the
//! helper itself and for tools) or in a killable `cuda-helper` process under a deadline.
//!
//! # Guarantees
//! - A call that outlives its deadline is abandoned: its helper is SIGKILLed, the error is
//!   [`CudaError::Timeout`], and the PID is *poisoned*: no further call is made on it, because
//!   killing the caller does not tell what the driver did to the target.
//! - While a call waits, the target is watched: if it exits, or its CUDA restore thread is
//!   stopped (the call could then only hang), the call is abandoned at once.

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use super::helper::{HelperRequest, Local, Op, Probed, Reply};
use super::{Call, CudaError, CudaInventory, CudaProcessState};
use crate::sys::spawn::kill_with_parent;

/// How often a waiting call looks at its target.
const WATCH_INTERVAL: Duration = Duration::from_millis(10);
/// Time a lock's helper gets on top of the driver-side lock timeout (start-up, library load).
const LOCK_GRACE: Duration = Duration::from_secs(10);

/// Where driver calls run.
#[derive(Clone, Debug)]
pub enum Isolation {
    /// In this process: a hanging call hangs the caller. For the helper and for tests.
    InProcess,
    /// In a fresh helper process per call, killed at its deadline.
    Helper {
        /// The program (the agent binary).
        program: PathBuf,
        /// Its arguments (`["cuda-helper"]`).
        args: Vec<OsString>,
    },
}

impl Isolation {
    /// This executable's `cuda-helper` subcommand.
    ///
    /// # Errors
    /// When the path of the running executable cannot be read.
    pub fn current_exe() -> std::io::Result<Self> {
        Ok(Self::Helper {
            program: std::env::current_exe()?,
            args: vec!["cuda-helper".into()],
        })
    }
}

/// How to reach the driver.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// `libcuda.so.1`, or a path to it.
    pub library: PathBuf,
    /// Where calls run.
    pub isolation: Isolation,
    /// The deadline of one call (checkpoint and restore move all device memory: allow for
    /// tens of GiB at a few GiB/s).
    pub call_timeout: Duration,
    /// How long a lock waits for the process's in-flight CUDA work before giving up (the
    /// process then stays running and the checkpoint fails).
    pub lock_timeout: Duration,
    /// Where the kernel module lists the GPUs' device node minors
    /// ([`super::DEFAULT_NVIDIA_DRIVER_DIR`]).
    pub nvidia_driver_dir: PathBuf,
}

/// A process of a tree and its CUDA state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbedProcess {
    /// Host PID.
    pub pid: u32,
    /// The driver's restore thread in it.
    pub restore_tid: i32,
    /// Its state.
    pub state: CudaProcessState,
}

/// The CUDA driver, opened once and shared (`Send + Sync`).
#[derive(Debug)]
pub struct CudaDriver {
    library: PathBuf,
    runner: Runner,
    call_timeout: Duration,
    lock_timeout: Duration,
    inventory: CudaInventory,
    /// PIDs a call timed out on: never called again.
    poisoned: Mutex<BTreeSet<u32>>,
    /// Restore threads seen by probes, watched while calls on their process wait.
    restore_tids: Mutex<HashMap<u32, i32>>,
}

#[derive(Debug)]
enum Runner {
    Local(Arc<Local>),
    Helper {
        program: PathBuf,
        args: Vec<OsString>,
    },
}

impl CudaDriver {
    /// Opens the driver and reads its inventory (which also proves the library works).
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when there is no usable driver; any error of the inventory.
    pub fn open(options: CudaOptions) -> Result<Self, CudaError> {
        let minors = super::device_minors(&options.nvidia_driver_dir);
        let runner = match options.isolation {
            Isolation::InProcess => Runner::Local(Arc::new(Local::open(&options.library)?)),
            Isolation::Helper { program, args } => Runner::Helper { program, args },
        };
        let mut driver = Self {
            library: options.library,
            runner,
            call_timeout: options.call_timeout,
            lock_timeout: options.lock_timeout,
            inventory: CudaInventory {
                driver_version: 0,
                gpus: Vec::new(),
            },
            poisoned: Mutex::new(BTreeSet::new()),
            restore_tids: Mutex::new(HashMap::new()),
        };
        driver.inventory = match driver.run(&Op::Inventory, driver.call_timeout)? {
            Reply::Inventory(inventory) => inventory,
            other => return Err(driver.unexpected(&Op::Inventory, &other)),
        };
        for gpu in &mut driver.inventory.gpus {
            gpu.minor = minors.get(&gpu.uuid.to_lowercase()).copied();
        }
        tracing::info!(
            library = %driver.library.display(),
            driver.version = driver.inventory.driver_version,
            gpus = driver.inventory.gpus.len(),
            "cuda driver opened"
        );
        Ok(driver)
    }

    /// How long a lock waits for in-flight work.
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// The library this driver was opened from.
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// Driver version and GPUs, as read when the driver was opened.
    #[doc(alias = "cuDriverGetVersion")]
    #[doc(alias = "cuDeviceGetUuid")]
    pub fn inventory(&self) -> CudaInventory {
        self.inventory.clone()
    }

    /// The CUDA state of one process.
    ///
    /// # Errors
    /// The driver's error (also when the process holds no CUDA state); a timeout.
    #[doc(alias = "cuCheckpointProcessGetState")]
    pub fn process_state(&self, pid: u32) -> Result<CudaProcessState, CudaError> {
        self.probe(&[pid])?
            .into_iter()
            .next()
            .map(|p| p.state)
            .ok_or(CudaError::NotCuda { pid })
    }

    /// The restore thread and state of each of `pids`, in `pids` order. Every one must hold
    /// CUDA state: pass only processes that map the driver ([`super::maps_cuda_driver`]).
    ///
    /// # Errors
    /// The driver's error for the first process it has no state for; a timeout.
    pub fn probe(&self, pids: &[u32]) -> Result<Vec<ProbedProcess>, CudaError> {
        if pids.is_empty() {
            return Ok(Vec::new());
        }
        for pid in pids {
            self.check_poisoned(*pid)?;
        }
        let op = Op::Probe {
            pids: pids.to_vec(),
        };
        let probed = match self.run(&op, self.call_timeout)? {
            Reply::Probe(probed) => probed,
            other => return Err(self.unexpected(&op, &other)),
        };
        let found: Vec<ProbedProcess> = probed
            .into_iter()
            .map(
                |Probed {
                     pid,
                     restore_tid,
                     state,
                 }| ProbedProcess {
                    pid,
                    restore_tid,
                    state,
                },
            )
            .collect();
        let mut tids = self
            .restore_tids
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for p in &found {
            tids.insert(p.pid, p.restore_tid);
        }
        Ok(found)
    }

    /// The CUDA processes of the tree rooted at `root` (host PID): those that map the driver,
    /// each probed.
    ///
    /// # Errors
    /// As [`CudaDriver::probe`]: a process that maps the driver but holds no CUDA state is
    /// an error, not skipped.
    pub fn discover(&self, root: u32) -> Result<Vec<ProbedProcess>, CudaError> {
        let Ok(root) = i32::try_from(root) else {
            return Ok(Vec::new());
        };
        let pids: Vec<u32> = crate::runtime::stat::descendants(root)
            .into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .filter(|p| super::maps_cuda_driver(*p))
            .collect();
        self.probe(&pids)
    }

    /// RUNNING → LOCKED; new CUDA calls of the process block. The driver gives up after
    /// `timeout` (the process then stays RUNNING); the helper gets a little longer.
    ///
    /// # Errors
    /// The driver's error (a wrong state, the lock timeout); a timeout of the helper.
    #[doc(alias = "cuCheckpointProcessLock")]
    pub fn lock(&self, pid: u32, timeout: Duration) -> Result<(), CudaError> {
        let timeout_ms = u32::try_from(timeout.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        self.done(&Op::Lock { pid, timeout_ms }, timeout + LOCK_GRACE)
    }

    /// LOCKED → CHECKPOINTED: device memory moves to host memory, GPU handles are released.
    ///
    /// # Errors
    /// The driver's error; a timeout.
    #[doc(alias = "cuCheckpointProcessCheckpoint")]
    pub fn checkpoint(&self, pid: u32) -> Result<(), CudaError> {
        self.done(&Op::Checkpoint { pid }, self.call_timeout)
    }

    /// CHECKPOINTED → LOCKED, device memory back at its addresses; `gpu_map` pairs (source
    /// GPU UUID, target GPU UUID), empty for no remapping (which needs driver 13000+).
    ///
    /// # Errors
    /// [`CudaError::RemapUnsupported`]; the driver's error; a timeout.
    #[doc(alias = "cuCheckpointProcessRestore")]
    pub fn restore(&self, pid: u32, gpu_map: &[(String, String)]) -> Result<(), CudaError> {
        if !gpu_map.is_empty() && self.inventory.driver_version < super::ffi::REMAP_MIN_DRIVER {
            return Err(CudaError::RemapUnsupported {
                driver_version: self.inventory.driver_version,
            });
        }
        self.done(
            &Op::Restore {
                pid,
                gpu_map: gpu_map.to_vec(),
            },
            self.call_timeout,
        )
    }

    /// LOCKED → RUNNING.
    ///
    /// # Errors
    /// The driver's error; a timeout.
    #[doc(alias = "cuCheckpointProcessUnlock")]
    pub fn unlock(&self, pid: u32) -> Result<(), CudaError> {
        self.done(&Op::Unlock { pid }, self.call_timeout)
    }

    /// Whether a call on `pid` timed out earlier (its state is unknown).
    pub fn is_poisoned(&self, pid: u32) -> bool {
        self.poisoned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&pid)
    }

    fn check_poisoned(&self, pid: u32) -> Result<(), CudaError> {
        if self.is_poisoned(pid) {
            Err(CudaError::Poisoned { pid })
        } else {
            Ok(())
        }
    }

    fn done(&self, op: &Op, deadline: Duration) -> Result<(), CudaError> {
        if let Some(pid) = op.pid() {
            self.check_poisoned(pid)?;
        }
        let started = Instant::now();
        let result = self.run(op, deadline);
        tracing::debug!(
            call = %op.call(),
            pid = op.pid(),
            elapsed_ms = started.elapsed().as_millis(),
            ok = result.is_ok(),
            "cuda call"
        );
        match result? {
            Reply::Done => Ok(()),
            other => Err(self.unexpected(op, &other)),
        }
    }

    fn unexpected(&self, op: &Op, reply: &Reply) -> CudaError {
        CudaError::HelperFailed {
            call: op.call(),
            pid: op.pid(),
            status: format!("an answer of the wrong kind ({reply:?})"),
        }
    }

    fn run(&self, op: &Op, deadline: Duration) -> Result<Reply, CudaError> {
        match &self.runner {
            Runner::Local(local) => local.run(op),
            Runner::Helper { program, args } => {
                let result = self.run_helper(program, args, op, deadline);
                if let (Err(CudaError::Timeout { .. }), Some(pid)) = (&result, op.pid()) {
                    tracing::error!(pid, call = %op.call(), "cuda call timed out; no further calls on this process");
                    self.poisoned
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(pid);
                }
                result
            }
        }
    }

    fn run_helper(
        &self,
        program: &Path,
        args: &[OsString],
        op: &Op,
        deadline: Duration,
    ) -> Result<Reply, CudaError> {
        let call = op.call();
        let pid = op.pid();
        let request = serde_json::to_vec(&HelperRequest {
            library: self.library.clone(),
            op: op.clone(),
        })
        .map_err(|e| CudaError::HelperFailed {
            call,
            pid,
            status: format!("unencodable request: {e}"),
        })?;
        let mut child = kill_with_parent(
            Command::new(program)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .map_err(|e| CudaError::HelperSpawn {
            program: program.to_owned(),
            message: e.to_string(),
        })?;
        let started = Instant::now();
        // The request is small (far below a pipe's capacity): writing it cannot block.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(&request);
        }
        let (tx, rx) = mpsc::channel();
        if let Some(mut stdout) = child.stdout.take() {
            let reader = std::thread::Builder::new()
                .name("cuda-helper-out".into())
                .spawn(move || {
                    let mut out = Vec::new();
                    let _ = stdout.read_to_end(&mut out);
                    let _ = tx.send(out);
                });
            if let Err(e) = reader {
                kill_and_reap(child);
                return Err(CudaError::HelperSpawn {
                    program: program.to_owned(),
                    message: format!("cannot start its reader thread: {e}"),
                });
            }
        }
        let watched = pid.map(|p| (p, self.restore_tid(p)));
        let output = loop {
            match rx.recv_timeout(WATCH_INTERVAL) {
                Ok(out) => break out,
                Err(mpsc::RecvTimeoutError::Disconnected) => break Vec::new(),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if started.elapsed() >= deadline {
                kill_and_reap(child);
                return Err(CudaError::Timeout {
                    call,
                    pid,
                    after: deadline,
                });
            }
            if let Some((target, tid)) = watched
                && let Some(err) = watch(call, target, tid)
            {
                kill_and_reap(child);
                return Err(err);
            }
        };
        let status = child
            .wait()
            .map_or_else(|e| format!("unknown status ({e})"), |s| s.to_string());
        serde_json::from_slice::<Result<Reply, CudaError>>(&output)
            .map_err(|_| CudaError::HelperFailed { call, pid, status })?
    }

    fn restore_tid(&self, pid: u32) -> Option<i32> {
        self.restore_tids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&pid)
            .copied()
    }
}

/// Looks at the target of a waiting call: gone, or restore thread stopped.
fn watch(call: Call, pid: u32, tid: Option<i32>) -> Option<CudaError> {
    let Ok(ipid) = i32::try_from(pid) else {
        return None;
    };
    let state = crate::runtime::stat::fields(ipid)
        .and_then(|f| f.first().cloned())
        .unwrap_or_default();
    // A zombie or a vanished process will never answer.
    if state.is_empty() || state == "Z" || state == "X" {
        return Some(CudaError::ProcessGone { call, pid });
    }
    let tid = tid?;
    let host = super::host_tid(pid, tid)?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{host}/stat")).ok()?;
    let thread_state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    // `T`: stopped by a signal; `t`: stopped by a tracer (CRIU's seize).
    matches!(thread_state, Some("T" | "t")).then_some(CudaError::RestoreThreadStopped {
        call,
        pid,
        tid,
    })
}

/// SIGKILLs a helper and reaps it off the caller's thread (a process blocked in the kernel may
/// take a while to die, and the caller must not wait for that).
fn kill_and_reap(mut child: std::process::Child) {
    let _ = child.kill();
    let reaper = std::thread::Builder::new()
        .name("cuda-helper-reap".into())
        .spawn(move || {
            let _ = child.wait();
        });
    if reaper.is_err() {
        tracing::warn!("cannot start a thread to reap a killed cuda helper");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> Isolation {
        Isolation::Helper {
            program: PathBuf::from("sh"),
            args: vec!["-c".into(), script.into()],
        }
    }

    fn driver_with(isolation: Isolation, call_timeout: Duration) -> CudaDriver {
        CudaDriver {
            library: PathBuf::from("libcuda.so.1"),
            runner: match isolation {
                Isolation::Helper { program, args } => Runner::Helper { program, args },
                Isolation::InProcess => unreachable!("tests use a helper"),
            },
            call_timeout,
            lock_timeout: Duration::from_secs(30),
            inventory: CudaInventory {
                driver_version: 12080,
                gpus: Vec::new(),
            },
            poisoned: Mutex::new(BTreeSet::new()),
            restore_tids: Mutex::new(HashMap::new()),
        }
    }

    #[test]
    fn a_hanging_call_is_killed_at_its_deadline_and_its_pid_is_never_called_again() {
        // A helper that never answers stands for a driver call that hangs.
        let driver = driver_with(shell("exec sleep 1000"), Duration::from_millis(300));
        let me = std::process::id();
        let err = driver.checkpoint(me).unwrap_err();
        assert!(
            matches!(err, CudaError::Timeout { call: Call::Checkpoint, pid: Some(p), .. } if p == me),
            "{err}"
        );
        assert!(driver.is_poisoned(me));
        assert_eq!(
            driver.unlock(me).unwrap_err(),
            CudaError::Poisoned { pid: me }
        );
    }

    #[test]
    fn a_call_on_a_process_that_exits_is_abandoned() {
        let mut target = Command::new("sleep").arg("1000").spawn().unwrap();
        let pid = target.id();
        let driver = driver_with(shell("exec sleep 1000"), Duration::from_secs(600));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            target.kill().unwrap();
            target.wait().unwrap();
        });
        let err = driver.unlock(pid).unwrap_err();
        killer.join().unwrap();
        assert_eq!(
            err,
            CudaError::ProcessGone {
                call: Call::Unlock,
                pid
            }
        );
    }

    #[test]
    fn a_call_waiting_on_a_stopped_restore_thread_is_abandoned() {
        let mut target = Command::new("sleep").arg("1000").spawn().unwrap();
        let pid = target.id();
        let tid = i32::try_from(pid).unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(tid),
            nix::sys::signal::Signal::SIGSTOP,
        )
        .unwrap();
        let driver = driver_with(shell("exec sleep 1000"), Duration::from_secs(600));
        driver.restore_tids.lock().unwrap().insert(pid, tid);
        let err = driver.checkpoint(pid).unwrap_err();
        target.kill().unwrap();
        target.wait().unwrap();
        assert_eq!(
            err,
            CudaError::RestoreThreadStopped {
                call: Call::Checkpoint,
                pid,
                tid
            }
        );
        assert!(!driver.is_poisoned(pid));
    }

    #[test]
    fn a_helper_that_dies_without_answering_is_reported_with_its_status() {
        let driver = driver_with(shell("cat >/dev/null; exit 3"), Duration::from_secs(60));
        let err = driver.unlock(std::process::id()).unwrap_err();
        match err {
            CudaError::HelperFailed { call, status, .. } => {
                assert_eq!(call, Call::Unlock);
                assert!(status.contains('3'), "{status}");
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn the_helpers_answer_is_passed_through_typed() {
        let answer = serde_json::to_string(&Err::<Reply, _>(CudaError::Driver {
            call: Call::Lock,
            pid: Some(7),
            code: 401,
            name: "CUDA_ERROR_ILLEGAL_STATE".into(),
            message: "illegal state".into(),
        }))
        .unwrap();
        let driver = driver_with(
            shell(&format!("cat >/dev/null; printf '%s' '{answer}'")),
            Duration::from_secs(60),
        );
        let err = driver
            .lock(std::process::id(), Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(err.code(), Some(401));
    }

    #[test]
    fn remapping_is_refused_before_any_call_on_an_old_driver() {
        // The helper would fail the test by answering garbage if it were started.
        let driver = driver_with(shell("echo garbage"), Duration::from_secs(60));
        let err = driver
            .restore(1, &[("GPU-a".into(), "GPU-b".into())])
            .unwrap_err();
        assert_eq!(
            err,
            CudaError::RemapUnsupported {
                driver_version: 12080
            }
        );
    }
}
