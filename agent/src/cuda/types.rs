//! The node's GPUs and a process's checkpoint state, as the rest of the agent sees them.

use serde::{Deserialize, Serialize};

/// The driver version and the GPUs the driver reports, in ordinal order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CudaInventory {
    /// `cuDriverGetVersion`, e.g. 12080 for CUDA 12.8.
    pub driver_version: i32,
    /// The GPUs, ordinal 0 first.
    pub gpus: Vec<GpuDevice>,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuDevice {
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total device memory in bytes.
    pub memory_bytes: u64,
    /// Minor number of its device node `/dev/nvidia<minor>`, as the kernel module lists it;
    /// `None` when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
}

impl CudaInventory {
    /// `12.8` for 12080.
    pub fn driver_version_text(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// `CUprocessState`, read as an integer (newer drivers add values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum CudaProcessState {
    /// `CU_PROCESS_STATE_RUNNING`.
    Running,
    /// `CU_PROCESS_STATE_LOCKED`: new CUDA calls block.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED`: device memory is in host memory, no GPU handles held.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED`: an uncorrectable error; only killing the process helps.
    Failed,
    /// A value this agent does not know (e.g. a transient state of a newer driver).
    Other(i32),
}

impl CudaProcessState {
    /// From the raw `CUprocessState`.
    pub fn from_raw(raw: i32) -> Self {
        match raw {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            other => Self::Other(other),
        }
    }
}

impl std::fmt::Display for CudaProcessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Running => f.write_str("running"),
            Self::Locked => f.write_str("locked"),
            Self::Checkpointed => f.write_str("checkpointed"),
            Self::Failed => f.write_str("failed"),
            Self::Other(raw) => write!(f, "state {raw}"),
        }
    }
}

/// `GPU-` followed by the 16 bytes as 8-4-4-4-12 lowercase hex, as `nvidia-smi -L` prints.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    format_prefixed("GPU-", bytes)
}

/// A device's UUID as `nvidia-smi -L` and `NVIDIA_VISIBLE_DEVICES` write it, from
/// `cuDeviceGetUuid` (`v1`) and `cuDeviceGetUuid_v2` (`v2`, when the driver has it): a MIG
/// instance is the device whose `_v2` UUID (its own) differs from its `v1` UUID (its parent
/// GPU's), and is written `MIG-…`; any other device `GPU-…`.
pub fn device_uuid_text(v1: &[u8; 16], v2: Option<&[u8; 16]>) -> String {
    match v2 {
        Some(own) if own != v1 => format_prefixed("MIG-", own),
        _ => format_uuid(v1),
    }
}

fn format_prefixed(prefix: &str, bytes: &[u8; 16]) -> String {
    let h = hex::encode(bytes);
    format!(
        "{prefix}{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The inverse of [`format_uuid`] and [`device_uuid_text`]; the `GPU-` or `MIG-` prefix and
/// the dashes are optional. The old MIG form `MIG-GPU-<uuid>/<gi>/<ci>` is not a UUID.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let body = text
        .strip_prefix("GPU-")
        .or_else(|| text.strip_prefix("MIG-"))
        .unwrap_or(text);
    let digits: String = body.chars().filter(|c| *c != '-').collect();
    let mut bytes = [0u8; 16];
    hex::decode_to_slice(&digits, &mut bytes).ok()?;
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_round_trip_in_nvidia_smi_form() {
        let bytes: [u8; 16] = std::array::from_fn(|i| u8::try_from(i * 17).unwrap());
        let text = format_uuid(&bytes);
        assert_eq!(text, "GPU-00112233-4455-6677-8899-aabbccddeeff");
        assert_eq!(parse_uuid(&text), Some(bytes));
        assert_eq!(parse_uuid("00112233445566778899aabbccddeeff"), Some(bytes));
        assert_eq!(parse_uuid("GPU-0011"), None);
        assert_eq!(parse_uuid("GPU-zz112233-4455-6677-8899-aabbccddeeff"), None);
    }

    #[test]
    fn a_mig_instance_is_named_by_its_own_uuid_as_nvidia_smi_writes_it() {
        let gpu: [u8; 16] = [0xaa; 16];
        let mig: [u8; 16] = std::array::from_fn(|i| u8::try_from(i).unwrap());
        // A MIG instance: v1 answers the parent GPU, v2 the instance.
        let text = device_uuid_text(&gpu, Some(&mig));
        assert_eq!(text, "MIG-00010203-0405-0607-0809-0a0b0c0d0e0f");
        assert_eq!(parse_uuid(&text), Some(mig));
        // A whole GPU answers the same to both; a driver without v2 only has v1.
        let whole = "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa";
        assert_eq!(device_uuid_text(&gpu, Some(&gpu)), whole);
        assert_eq!(device_uuid_text(&gpu, None), whole);
        // The pre-R470 form names a GPU and two instance ids, not a UUID.
        assert_eq!(
            parse_uuid("MIG-GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa/1/0"),
            None
        );
    }

    #[test]
    fn unknown_process_states_are_kept_not_guessed() {
        assert_eq!(
            CudaProcessState::from_raw(2),
            CudaProcessState::Checkpointed
        );
        assert_eq!(CudaProcessState::from_raw(5), CudaProcessState::Other(5));
        assert_eq!(CudaProcessState::Other(5).to_string(), "state 5");
    }

    #[test]
    fn driver_versions_read_as_cuda_releases() {
        let inv = CudaInventory {
            driver_version: 12080,
            gpus: vec![],
        };
        assert_eq!(inv.driver_version_text(), "12.8");
    }
}
