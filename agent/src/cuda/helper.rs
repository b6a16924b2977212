//! The driver calls themselves, and the `warmstart-agent cuda-helper` process that runs them.
//!
//! [`Local`] turns one [`Op`] into `RawDriver` calls and checks every result through one
//! [`Local::cu_try`]. The helper reads one [`HelperRequest`] as JSON on standard input, runs it
//! with a [`Local`], and writes `Result<Reply, CudaError>` as JSON on standard output. The
//! agent kills the helper when its deadline passes; nothing the helper does needs cleaning up
//! afterwards except what the driver itself did, which is why a timed-out PID is never called
//! again (see [`CudaError::Poisoned`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use super::ffi::{self, CuResult, GpuPair, RawDriver};
use super::{
    Call, CudaError, CudaInventory, CudaProcessState, GpuDevice, device_uuid_text, parse_uuid,
};

/// One operation, as sent to the helper.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Op {
    /// Driver version and GPUs.
    Inventory,
    /// Restore thread and state of each PID; the first PID the driver has none for is the
    /// answer (its error).
    Probe {
        /// The PIDs.
        pids: Vec<u32>,
    },
    /// Lock one process.
    Lock {
        /// The PID.
        pid: u32,
        /// The driver-side timeout (0: none).
        timeout_ms: u32,
    },
    /// Checkpoint one locked process.
    Checkpoint {
        /// The PID.
        pid: u32,
    },
    /// Restore one checkpointed process, remapping GPUs by UUID.
    Restore {
        /// The PID.
        pid: u32,
        /// (checkpoint GPU, target GPU) UUID pairs; empty: no remapping.
        gpu_map: Vec<(String, String)>,
    },
    /// Unlock one locked process.
    Unlock {
        /// The PID.
        pid: u32,
    },
}

impl Op {
    /// The driver call this operation is about, for errors.
    pub fn call(&self) -> Call {
        match self {
            Self::Inventory => Call::DeviceGetCount,
            Self::Probe { .. } => Call::GetState,
            Self::Lock { .. } => Call::Lock,
            Self::Checkpoint { .. } => Call::Checkpoint,
            Self::Restore { .. } => Call::Restore,
            Self::Unlock { .. } => Call::Unlock,
        }
    }

    /// The target PID, for single-process operations.
    pub fn pid(&self) -> Option<u32> {
        match self {
            Self::Inventory | Self::Probe { .. } => None,
            Self::Lock { pid, .. }
            | Self::Checkpoint { pid }
            | Self::Restore { pid, .. }
            | Self::Unlock { pid } => Some(*pid),
        }
    }
}

/// One probed process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Probed {
    /// The PID.
    pub pid: u32,
    /// Its CUDA restore thread.
    pub restore_tid: i32,
    /// Its state.
    pub state: CudaProcessState,
}

/// What the helper answers on success.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Reply {
    /// For [`Op::Inventory`].
    Inventory(CudaInventory),
    /// For [`Op::Probe`], in request order.
    Probe(Vec<Probed>),
    /// For the state-changing operations.
    Done,
}

/// What the helper reads on standard input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HelperRequest {
    /// The driver library to open.
    pub library: PathBuf,
    /// What to do.
    pub op: Op,
}

/// Runs operations against a driver opened in this process.
#[derive(Debug)]
pub struct Local {
    raw: RawDriver,
    /// `cuInit`'s result, called at most once: restore requires the caller to have run it, and
    /// the device queries need it.
    init: OnceLock<CuResult>,
}

impl Local {
    /// Opens the library.
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] naming the library and what is wrong with it.
    pub fn open(library: &Path) -> Result<Self, CudaError> {
        let raw = RawDriver::open(library).map_err(|e| CudaError::Unavailable {
            reason: crate::report::error_chain(&e),
        })?;
        Ok(Self {
            raw,
            init: OnceLock::new(),
        })
    }

    /// The single conversion of a `CUresult` into a `Result`, with the driver's own name and
    /// text for the code.
    ///
    /// # Errors
    /// [`CudaError::Driver`] for any code but `CUDA_SUCCESS`.
    pub fn cu_try(&self, call: Call, pid: Option<u32>, rc: CuResult) -> Result<(), CudaError> {
        if rc == ffi::CUDA_SUCCESS {
            return Ok(());
        }
        Err(CudaError::Driver {
            call,
            pid,
            code: rc,
            name: self
                .raw
                .error_name(rc)
                .unwrap_or_else(|| format!("CUresult {rc}")),
            message: self
                .raw
                .error_string(rc)
                .unwrap_or_else(|| "unknown error code".to_owned()),
        })
    }

    fn ensure_init(&self) -> Result<(), CudaError> {
        let rc = *self.init.get_or_init(|| self.raw.init());
        self.cu_try(Call::Init, None, rc)
    }

    fn driver_version(&self) -> Result<i32, CudaError> {
        self.raw
            .driver_version()
            .or_else(|rc| self.cu_try(Call::DriverGetVersion, None, rc).map(|()| 0))
    }

    fn require_checkpoint_api(&self, call: Call) -> Result<(), CudaError> {
        if self.raw.has_checkpoint_api() {
            return Ok(());
        }
        let version = self.driver_version().unwrap_or(0);
        Err(CudaError::Unavailable {
            reason: format!(
                "{} (driver {version}) has no {call}: the process-checkpoint API needs driver r570 or newer",
                self.raw.library_path().display()
            ),
        })
    }

    /// Runs one operation.
    ///
    /// # Errors
    /// The first failing driver call, or a refusal before any call (remapping on an old driver,
    /// a malformed UUID).
    pub fn run(&self, op: &Op) -> Result<Reply, CudaError> {
        match op {
            Op::Inventory => self.inventory().map(Reply::Inventory),
            Op::Probe { pids } => {
                self.require_checkpoint_api(Call::GetState)?;
                pids.iter()
                    .map(|&pid| self.probe(pid))
                    .collect::<Result<_, _>>()
                    .map(Reply::Probe)
            }
            Op::Lock { pid, timeout_ms } => {
                self.require_checkpoint_api(Call::Lock)?;
                let rc = self.raw.lock(raw_pid(*pid)?, *timeout_ms);
                self.cu_try(Call::Lock, Some(*pid), rc)
                    .map(|()| Reply::Done)
            }
            Op::Checkpoint { pid } => {
                self.require_checkpoint_api(Call::Checkpoint)?;
                let rc = self.raw.checkpoint(raw_pid(*pid)?);
                self.cu_try(Call::Checkpoint, Some(*pid), rc)
                    .map(|()| Reply::Done)
            }
            Op::Restore { pid, gpu_map } => {
                self.require_checkpoint_api(Call::Restore)?;
                let version = self.driver_version()?;
                if !gpu_map.is_empty() && version < ffi::REMAP_MIN_DRIVER {
                    return Err(CudaError::RemapUnsupported {
                        driver_version: version,
                    });
                }
                let pairs = gpu_pairs(gpu_map)?;
                self.ensure_init()?;
                let rc = self.raw.restore(raw_pid(*pid)?, version, &pairs);
                self.cu_try(Call::Restore, Some(*pid), rc)
                    .map(|()| Reply::Done)
            }
            Op::Unlock { pid } => {
                self.require_checkpoint_api(Call::Unlock)?;
                let rc = self.raw.unlock(raw_pid(*pid)?);
                self.cu_try(Call::Unlock, Some(*pid), rc)
                    .map(|()| Reply::Done)
            }
        }
    }

    fn inventory(&self) -> Result<CudaInventory, CudaError> {
        let driver_version = self.driver_version()?;
        self.ensure_init()?;
        let count = self
            .raw
            .device_count()
            .or_else(|rc| self.cu_try(Call::DeviceGetCount, None, rc).map(|()| 0))?;
        let mut gpus = Vec::new();
        for ordinal in 0..count {
            let device = self
                .raw
                .device(ordinal)
                .or_else(|rc| self.cu_try(Call::DeviceGet, None, rc).map(|()| 0))?;
            let uuid = self.raw.device_uuid(device).or_else(|rc| {
                self.cu_try(Call::DeviceGetUuid, None, rc)
                    .map(|()| ffi::CuUuid::default())
            })?;
            // A MIG instance's own UUID, which its container's runtime names it by.
            let own = match self.raw.device_uuid_v2(device) {
                Some(Ok(own)) => Some(own),
                Some(Err(rc)) => {
                    self.cu_try(Call::DeviceGetUuid, None, rc)?;
                    None
                }
                None => None,
            };
            let name = self.raw.device_name(device).or_else(|rc| {
                self.cu_try(Call::DeviceGetName, None, rc)
                    .map(|()| String::new())
            })?;
            let memory_bytes = self
                .raw
                .device_total_mem(device)
                .or_else(|rc| self.cu_try(Call::DeviceTotalMem, None, rc).map(|()| 0))?;
            gpus.push(GpuDevice {
                uuid: device_uuid_text(&uuid.bytes, own.as_ref().map(|u| &u.bytes)),
                name,
                memory_bytes,
                // Not the driver's to say: the agent reads it from the kernel module.
                minor: None,
            });
        }
        Ok(CudaInventory {
            driver_version,
            gpus,
        })
    }

    /// The restore thread and state of `pid`. No result code is read as "this process has no
    /// CUDA state": which codes the driver gives for that is not documented, and a guess
    /// would skip a real CUDA process (whose dump then fails on its device mappings). Callers
    /// probe only processes that map the driver, so any error is theirs to report.
    fn probe(&self, pid: u32) -> Result<Probed, CudaError> {
        let restore_tid = self.raw.restore_thread_id(raw_pid(pid)?).or_else(|rc| {
            self.cu_try(Call::GetRestoreThreadId, Some(pid), rc)
                .map(|()| 0)
        })?;
        let state = self
            .raw
            .process_state(raw_pid(pid)?)
            .or_else(|rc| self.cu_try(Call::GetState, Some(pid), rc).map(|()| -1))?;
        Ok(Probed {
            pid,
            restore_tid,
            state: CudaProcessState::from_raw(state),
        })
    }
}

fn raw_pid(pid: u32) -> Result<i32, CudaError> {
    i32::try_from(pid).map_err(|_| CudaError::NotCuda { pid })
}

fn gpu_pairs(map: &[(String, String)]) -> Result<Vec<GpuPair>, CudaError> {
    let parse = |uuid: &String| {
        parse_uuid(uuid)
            .map(|bytes| ffi::CuUuid { bytes })
            .ok_or_else(|| CudaError::InvalidUuid { uuid: uuid.clone() })
    };
    map.iter()
        .map(|(old, new)| {
            Ok(GpuPair {
                old_uuid: parse(old)?,
                new_uuid: parse(new)?,
            })
        })
        .collect()
}

/// The body of `warmstart-agent cuda-helper`: one request in, one answer out. Returns the exit
/// code (0 when an answer was written, even a failed one; 2 when the request was unreadable).
pub fn run_helper(input: &mut dyn Read, output: &mut dyn Write) -> i32 {
    let mut text = String::new();
    let request: HelperRequest = match input
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())
        .and_then(|_| serde_json::from_str(&text).map_err(|e| e.to_string()))
    {
        Ok(request) => request,
        Err(e) => {
            tracing::error!(error = %e, "unreadable cuda-helper request");
            return 2;
        }
    };
    tracing::debug!(op = ?request.op, library = %request.library.display(), "cuda helper call");
    let answer: Result<Reply, CudaError> =
        Local::open(&request.library).and_then(|local| local.run(&request.op));
    match serde_json::to_writer(&mut *output, &answer).map(|()| output.flush()) {
        Ok(Ok(())) => 0,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unloadable_library_is_answered_as_unavailable() {
        let request = HelperRequest {
            library: PathBuf::from("/nonexistent/libcuda.so.1"),
            op: Op::Inventory,
        };
        let mut out = Vec::new();
        let code = run_helper(
            &mut serde_json::to_vec(&request).unwrap().as_slice(),
            &mut out,
        );
        assert_eq!(code, 0);
        let answer: Result<Reply, CudaError> = serde_json::from_slice(&out).unwrap();
        match answer {
            Err(CudaError::Unavailable { reason }) => {
                assert!(reason.contains("/nonexistent/libcuda.so.1"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_garbled_request_is_refused_with_exit_code_2() {
        let mut out = Vec::new();
        assert_eq!(run_helper(&mut &b"{not json"[..], &mut out), 2);
        assert!(out.is_empty());
    }

    #[test]
    fn malformed_uuids_in_a_gpu_map_are_named() {
        let err = gpu_pairs(&[(
            "GPU-00112233-4455-6677-8899-aabbccddeeff".into(),
            "GPU-nope".into(),
        )])
        .unwrap_err();
        assert_eq!(
            err,
            CudaError::InvalidUuid {
                uuid: "GPU-nope".into()
            }
        );
    }
}
