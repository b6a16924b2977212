//! What can go wrong with a CUDA driver call, kept matchable: the driver's `CUresult` stays a
//! number next to its name and text.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A driver entry point, named as in `cuda.h` when displayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Call {
    /// `cuInit`.
    Init,
    /// `cuDriverGetVersion`.
    DriverGetVersion,
    /// `cuDeviceGetCount`.
    DeviceGetCount,
    /// `cuDeviceGet`.
    DeviceGet,
    /// `cuDeviceGetUuid`.
    DeviceGetUuid,
    /// `cuDeviceGetName`.
    DeviceGetName,
    /// `cuDeviceTotalMem_v2`.
    DeviceTotalMem,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    GetRestoreThreadId,
    /// `cuCheckpointProcessGetState`.
    GetState,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
}

impl Call {
    /// The C name.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::Init => "cuInit",
            Self::DriverGetVersion => "cuDriverGetVersion",
            Self::DeviceGetCount => "cuDeviceGetCount",
            Self::DeviceGet => "cuDeviceGet",
            Self::DeviceGetUuid => "cuDeviceGetUuid",
            Self::DeviceGetName => "cuDeviceGetName",
            Self::DeviceTotalMem => "cuDeviceTotalMem_v2",
            Self::GetRestoreThreadId => "cuCheckpointProcessGetRestoreThreadId",
            Self::GetState => "cuCheckpointProcessGetState",
            Self::Lock => "cuCheckpointProcessLock",
            Self::Checkpoint => "cuCheckpointProcessCheckpoint",
            Self::Restore => "cuCheckpointProcessRestore",
            Self::Unlock => "cuCheckpointProcessUnlock",
        }
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.symbol())
    }
}

fn for_pid(pid: Option<u32>) -> String {
    pid.map(|p| format!(" for pid {p}")).unwrap_or_default()
}

/// Why a CUDA operation failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CudaError {
    /// No usable CUDA driver on this node (library missing, not a driver, no checkpoint API).
    #[error("no usable CUDA driver: {reason}")]
    Unavailable {
        /// What is missing, naming the library.
        reason: String,
    },
    /// The driver returned an error code.
    #[error("{call}{} failed: {name} ({code}): {message}", for_pid(*.pid))]
    Driver {
        /// The entry point.
        call: Call,
        /// The target process, for the checkpoint API.
        pid: Option<u32>,
        /// The `CUresult`.
        code: i32,
        /// `cuGetErrorName`, e.g. `CUDA_ERROR_ILLEGAL_STATE`.
        name: String,
        /// `cuGetErrorString`.
        message: String,
    },
    /// The call did not return within its deadline; the process running it was killed.
    #[error("{call}{} did not return within {after:?}; its helper was killed", for_pid(*.pid))]
    Timeout {
        /// The entry point.
        call: Call,
        /// The target process.
        pid: Option<u32>,
        /// The deadline.
        after: Duration,
    },
    /// An earlier call on this process timed out, so its CUDA state is unknown and no further
    /// call is made (killing a helper does not roll anything back).
    #[error(
        "no CUDA call is made for pid {pid}: an earlier call on it timed out, its GPU state is unknown"
    )]
    Poisoned {
        /// The target process.
        pid: u32,
    },
    /// The target process exited while a call on it was in flight.
    #[error("pid {pid} exited during {call}")]
    ProcessGone {
        /// The entry point.
        call: Call,
        /// The target process.
        pid: u32,
    },
    /// The target's CUDA restore thread is stopped (ptrace, SIGSTOP, freezer): the call can
    /// only hang, so it was abandoned.
    #[error("{call} for pid {pid} abandoned: its CUDA restore thread {tid} is stopped")]
    RestoreThreadStopped {
        /// The entry point.
        call: Call,
        /// The target process.
        pid: u32,
        /// The restore thread.
        tid: i32,
    },
    /// A call succeeded but left the process in an unexpected state.
    #[error("after {call}, pid {pid} is {found} instead of {expected}")]
    UnexpectedState {
        /// The entry point.
        call: Call,
        /// The target process.
        pid: u32,
        /// The state the call should have produced.
        expected: crate::cuda::CudaProcessState,
        /// The state found.
        found: crate::cuda::CudaProcessState,
    },
    /// The target holds no CUDA state.
    #[error("pid {pid} holds no CUDA state")]
    NotCuda {
        /// The process.
        pid: u32,
    },
    /// GPU remapping was asked of a driver that cannot do it.
    #[error(
        "restoring onto different GPUs needs CUDA driver 13.0 (r580) or newer; this node has {driver_version}"
    )]
    RemapUnsupported {
        /// `cuDriverGetVersion`.
        driver_version: i32,
    },
    /// A GPU UUID in a remapping is not `GPU-` and 32 hex digits.
    #[error("invalid GPU UUID {uuid:?}")]
    InvalidUuid {
        /// The text.
        uuid: String,
    },
    /// The helper process could not be started.
    #[error("cannot start the CUDA helper {program}: {message}")]
    HelperSpawn {
        /// The program.
        program: PathBuf,
        /// The OS error.
        message: String,
    },
    /// The helper exited without a readable answer.
    #[error("the CUDA helper for {call}{} exited with {status} without an answer", for_pid(*.pid))]
    HelperFailed {
        /// The entry point.
        call: Call,
        /// The target process.
        pid: Option<u32>,
        /// Its exit status.
        status: String,
    },
}

impl CudaError {
    /// The driver's `CUresult`, when the driver answered with one.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// A short label for metrics and the table output.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Unavailable { .. } => "unavailable",
            Self::Driver { .. } => "driver",
            Self::Timeout { .. } => "timeout",
            Self::Poisoned { .. } => "poisoned",
            Self::ProcessGone { .. } => "process_gone",
            Self::RestoreThreadStopped { .. } => "restore_thread_stopped",
            Self::UnexpectedState { .. } => "unexpected_state",
            Self::NotCuda { .. } => "not_cuda",
            Self::RemapUnsupported { .. } => "remap_unsupported",
            Self::InvalidUuid { .. } => "invalid_uuid",
            Self::HelperSpawn { .. } | Self::HelperFailed { .. } => "helper",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_name_the_call_the_pid_and_the_code() {
        let err = CudaError::Driver {
            call: Call::Unlock,
            pid: Some(42),
            code: 401,
            name: "CUDA_ERROR_ILLEGAL_STATE".into(),
            message: "operation not permitted in this state".into(),
        };
        assert_eq!(
            err.to_string(),
            "cuCheckpointProcessUnlock for pid 42 failed: CUDA_ERROR_ILLEGAL_STATE (401): \
             operation not permitted in this state"
        );
        assert_eq!(err.code(), Some(401));
        let json = serde_json::to_string(&err).unwrap();
        assert_eq!(serde_json::from_str::<CudaError>(&json).unwrap(), err);
    }
}
