//! Which GPUs the runtime gave a container, found the way the runtime gives them: first the
//! kubelet's PodResources API (the devices a device plugin or DRA driver allocated), then the
//! container's CDI device names (`nvidia.com/gpu=<uuid|index|all>`, from its annotations or
//! CRI config), then its `NVIDIA_VISIBLE_DEVICES`.
//!
//! `void` (the NVIDIA runtime's "devices come through CDI"), `none` and values naming GPUs the
//! node lacks never mean "no GPU": a container whose GPUs cannot be told is refused, naming the
//! value and every source tried. Only a container with no allocation, no CDI device and no
//! variable (and no NVIDIA device nodes) is a CPU-only container.

use thiserror::Error;
use warmstart_shared::artifact::{AssignedGpus, GpuSource};

use crate::cuda::{CudaInventory, GpuDevice};
use crate::podresources::AllocatedDevices;
use crate::runtime::gpus::{Allocation, RuntimeGpus};

/// The variable through which the NVIDIA container runtime and device plugin name a
/// container's GPUs.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// Everything a container's GPUs are decided from.
#[derive(Clone, Copy, Debug)]
pub struct Evidence<'a> {
    /// The container, for messages.
    pub container: &'a str,
    /// The runtime's allocation and CDI devices.
    pub runtime: &'a RuntimeGpus,
    /// Its `NVIDIA_VISIBLE_DEVICES` (of its init process), if set.
    pub env: Option<&'a str>,
    /// Whether it has the NVIDIA device nodes (`/dev/nvidiactl`).
    pub device_nodes: bool,
}

/// Why a container's GPUs cannot be told.
#[derive(Debug, Error)]
pub enum GpuAssignmentError {
    /// No source says which GPUs the container has, and something says it has some.
    #[error("cannot tell which GPUs container {container} was given: {reason}; tried {tried}")]
    Undetermined {
        /// The container.
        container: String,
        /// What says it has GPUs.
        reason: String,
        /// Each source tried and its answer.
        tried: String,
    },
    /// A source names a GPU this node does not have.
    #[error(
        "container {container} was given GPU {entry:?} ({source_kind}: {value}), which this node does not have (its GPUs: {known})"
    )]
    UnknownGpu {
        /// The container.
        container: String,
        /// The source.
        source_kind: GpuSource,
        /// What the source said.
        value: String,
        /// The entry not found.
        entry: String,
        /// The node's GPUs.
        known: String,
    },
    /// The environment of the container's init, one of the sources, cannot be used.
    #[error("cannot tell which GPUs container {container} was given")]
    Environment {
        /// The container.
        container: String,
        /// Why (its length, over the cap).
        #[source]
        source: crate::procfs::ProcError,
    },
}

/// A container's GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// As recorded in a manifest.
    pub recorded: AssignedGpus,
    /// The node's GPUs they are, in ordinal order, when the node's inventory was known.
    pub gpus: Option<Vec<GpuDevice>>,
}

/// Whether an extended resource or DRA driver hands out NVIDIA GPUs (or MIG slices of them).
pub fn is_gpu_resource(resource: &str) -> bool {
    resource == "nvidia.com/gpu"
        || resource.starts_with("nvidia.com/gpu.")
        || resource.starts_with("nvidia.com/mig-")
        || resource == "gpu.nvidia.com"
}

/// The device part of a CDI name for an NVIDIA GPU (`nvidia.com/gpu=GPU-…` → `GPU-…`; also the
/// device plugin's `k8s.device-plugin.nvidia.com/gpu=…` and the DRA driver's
/// `k8s.gpu.nvidia.com/device=…`), or `None` for another kind of device.
pub fn cdi_gpu(name: &str) -> Option<&str> {
    let (kind, device) = name.split_once('=')?;
    let (vendor, class) = kind.split_once('/')?;
    let nvidia = vendor == "nvidia.com" || vendor.ends_with(".nvidia.com");
    (nvidia && matches!(class, "gpu" | "device" | "mig") && !device.is_empty()).then_some(device)
}

/// Decides `evidence`'s GPUs: `Ok(None)` for a container given none.
///
/// # Errors
/// [`GpuAssignmentError`] when they cannot be told, or name a GPU this node lacks.
pub fn determine(
    evidence: &Evidence<'_>,
    inventory: Option<&CudaInventory>,
) -> Result<Option<Assignment>, GpuAssignmentError> {
    let mut tried = Vec::new();
    let pod = evidence
        .runtime
        .pod
        .as_ref()
        .map_or_else(|| "the container".to_owned(), ToString::to_string);
    match kubelet_gpus(&evidence.runtime.allocation, &pod) {
        Ok((resource, ids)) => {
            return resolve(evidence, GpuSource::PodResources, resource, ids, inventory).map(Some);
        }
        Err(asked) => tried.push(asked),
    }
    let cdi: Vec<String> = evidence
        .runtime
        .cdi_devices
        .iter()
        .filter_map(|c| cdi_gpu(c))
        .map(str::to_owned)
        .collect();
    if !cdi.is_empty() {
        return resolve(evidence, GpuSource::Cdi, String::new(), cdi, inventory).map(Some);
    }
    tried.push(if evidence.runtime.cdi_devices.is_empty() {
        "CDI devices (none)".to_owned()
    } else {
        format!(
            "CDI devices (none an NVIDIA GPU: {})",
            evidence.runtime.cdi_devices.join(",")
        )
    });
    let undetermined = |reason: String, mut tried: Vec<String>, value: String| {
        tried.push(value);
        GpuAssignmentError::Undetermined {
            container: evidence.container.to_owned(),
            reason,
            tried: tried.join(", "),
        }
    };
    let Some(value) = evidence.env.map(str::trim) else {
        if evidence.device_nodes {
            return resolve(
                evidence,
                GpuSource::DeviceNodes,
                String::new(),
                vec!["all".to_owned()],
                inventory,
            )
            .map(Some);
        }
        return Ok(None);
    };
    let env = format!("{VISIBLE_DEVICES_ENV}={value:?}");
    match value {
        "void" => Err(undetermined(
            format!(
                "{env} says its GPUs come through CDI, but neither the kubelet nor its CDI devices name any"
            ),
            tried,
            env,
        )),
        "none" => Err(undetermined(
            format!(
                "{env} gives it the NVIDIA driver without saying which GPUs, and neither the kubelet nor its CDI devices name any"
            ),
            tried,
            env,
        )),
        "" if evidence.device_nodes => Err(undetermined(
            format!("{env} is empty, but the container has the NVIDIA device nodes"),
            tried,
            env,
        )),
        "" => Ok(None),
        _ => {
            let entries = value
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_owned)
                .collect();
            resolve(evidence, GpuSource::Env, String::new(), entries, inventory).map(Some)
        }
    }
}

/// The GPUs the kubelet's PodResources answer names: the resource(s) and device ids of a
/// device plugin's allocation (a shared GPU's replicas, `<id>::<n>`, read as the GPU), else a
/// DRA allocation's CDI GPUs; or, as the error, what asking found (for the refusal's list).
fn kubelet_gpus(allocation: &Allocation, pod: &str) -> Result<(String, Vec<String>), String> {
    match allocation {
        Allocation::Devices(devices) => {
            let plugin: Vec<&AllocatedDevices> = devices
                .iter()
                .filter(|d| !d.dynamic && is_gpu_resource(&d.resource) && !d.ids.is_empty())
                .collect();
            if !plugin.is_empty() {
                let resource = plugin
                    .iter()
                    .map(|d| d.resource.as_str())
                    .collect::<Vec<_>>()
                    .join(",");
                // A shared GPU's replicas are `<id>::<n>` (the NVIDIA plugin's time-slicing).
                let ids: Vec<String> = plugin
                    .iter()
                    .flat_map(|d| &d.ids)
                    .map(|id| {
                        id.split_once("::")
                            .map_or(id.as_str(), |(id, _)| id)
                            .to_owned()
                    })
                    .collect();
                return Ok((resource, ids));
            }
            let dra: Vec<&AllocatedDevices> = devices
                .iter()
                .filter(|d| d.dynamic && d.cdi_devices.iter().any(|c| cdi_gpu(c).is_some()))
                .collect();
            if !dra.is_empty() {
                let resource = dra
                    .iter()
                    .map(|d| d.resource.as_str())
                    .collect::<Vec<_>>()
                    .join(",");
                let ids = dra
                    .iter()
                    .flat_map(|d| &d.cdi_devices)
                    .filter_map(|c| cdi_gpu(c))
                    .map(str::to_owned)
                    .collect();
                return Ok((resource, ids));
            }
            Err(format!(
                "the kubelet's PodResources API (no GPU allocated to {pod})"
            ))
        }
        Allocation::NotAsked(why) => {
            Err(format!("the kubelet's PodResources API (not asked: {why})"))
        }
        Allocation::Failed(why) => Err(format!("the kubelet's PodResources API (failed: {why})")),
    }
}

/// The node's GPUs `ids` (UUIDs, ordinals or `all`) name, in ordinal order.
fn resolve(
    evidence: &Evidence<'_>,
    source: GpuSource,
    resource: String,
    ids: Vec<String>,
    inventory: Option<&CudaInventory>,
) -> Result<Assignment, GpuAssignmentError> {
    let recorded = |uuids: Vec<String>| AssignedGpus {
        source,
        resource: resource.clone(),
        devices: ids.clone(),
        uuids,
    };
    let Some(inventory) = inventory else {
        return Ok(Assignment {
            recorded: recorded(Vec::new()),
            gpus: None,
        });
    };
    let mut chosen = Vec::new();
    for id in &ids {
        if id == "all" {
            chosen.extend(0..inventory.gpus.len());
            continue;
        }
        let index = id.parse::<usize>().ok();
        match inventory
            .gpus
            .iter()
            .position(|g| g.uuid.eq_ignore_ascii_case(id))
            .or_else(|| index.filter(|i| *i < inventory.gpus.len()))
        {
            Some(i) => chosen.push(i),
            None => {
                return Err(GpuAssignmentError::UnknownGpu {
                    container: evidence.container.to_owned(),
                    source_kind: source,
                    value: ids.join(","),
                    entry: id.clone(),
                    known: inventory
                        .gpus
                        .iter()
                        .map(|g| g.uuid.as_str())
                        .collect::<Vec<_>>()
                        .join(","),
                });
            }
        }
    }
    chosen.sort_unstable();
    chosen.dedup();
    let gpus: Vec<GpuDevice> = chosen
        .into_iter()
        .map(|i| inventory.gpus[i].clone())
        .collect();
    Ok(Assignment {
        recorded: recorded(gpus.iter().map(|g| g.uuid.clone()).collect()),
        gpus: Some(gpus),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podresources::PodContainer;

    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    fn inventory() -> CudaInventory {
        CudaInventory {
            driver_version: 13000,
            gpus: [A, B]
                .iter()
                .enumerate()
                .map(|(minor, uuid)| GpuDevice {
                    uuid: (*uuid).to_owned(),
                    name: "H200".to_owned(),
                    memory_bytes: 1,
                    minor: u32::try_from(minor).ok(),
                })
                .collect(),
        }
    }

    fn pod() -> Option<PodContainer> {
        Some(PodContainer {
            namespace: "ml".into(),
            pod: "llama-0".into(),
            container: "worker".into(),
        })
    }

    fn allocated(resource: &str, ids: &[&str]) -> Allocation {
        Allocation::Devices(vec![AllocatedDevices {
            resource: resource.into(),
            ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            ..AllocatedDevices::default()
        }])
    }

    fn decide(
        runtime: &RuntimeGpus,
        env: Option<&str>,
        nodes: bool,
        inv: Option<&CudaInventory>,
    ) -> Result<Option<Assignment>, GpuAssignmentError> {
        determine(
            &Evidence {
                container: "cri://abc",
                runtime,
                env,
                device_nodes: nodes,
            },
            inv,
        )
    }

    fn uuids(result: Result<Option<Assignment>, GpuAssignmentError>) -> (GpuSource, Vec<String>) {
        let a = result.unwrap().unwrap();
        (a.recorded.source, a.recorded.uuids)
    }

    #[test]
    fn the_kubelets_allocation_wins_over_the_variable_as_uuids_or_indices() {
        let inv = inventory();
        let by_uuid = RuntimeGpus {
            pod: pod(),
            allocation: allocated("nvidia.com/gpu", &[B]),
            cdi_devices: Vec::new(),
        };
        // The CDI-mode container: the variable is `void`, the kubelet knows.
        assert_eq!(
            uuids(decide(&by_uuid, Some("void"), true, Some(&inv))),
            (GpuSource::PodResources, vec![B.to_owned()])
        );
        // A variable naming another GPU does not override the allocation.
        assert_eq!(
            uuids(decide(&by_uuid, Some(A), true, Some(&inv))),
            (GpuSource::PodResources, vec![B.to_owned()])
        );
        let by_index = RuntimeGpus {
            allocation: allocated("nvidia.com/gpu", &["1", "0"]),
            ..by_uuid.clone()
        };
        assert_eq!(
            uuids(decide(&by_index, None, true, Some(&inv))),
            (GpuSource::PodResources, vec![A.to_owned(), B.to_owned()])
        );
        // Time-sliced replicas name their GPU before `::`.
        let shared = RuntimeGpus {
            allocation: allocated("nvidia.com/gpu.shared", &[&format!("{A}::3")]),
            ..by_uuid.clone()
        };
        assert_eq!(
            uuids(decide(&shared, None, true, Some(&inv))).1,
            [A.to_owned()]
        );
        // Without the driver (no inventory) the IDs are recorded as the kubelet gave them.
        let a = decide(&by_uuid, Some("void"), true, None).unwrap().unwrap();
        assert_eq!(a.recorded.devices, [B]);
        assert_eq!(a.recorded.resource, "nvidia.com/gpu");
        assert_eq!(a.recorded.count(), Some(1));
        assert!(a.gpus.is_none());
    }

    #[test]
    fn a_mig_slice_is_matched_by_the_mig_uuid_the_driver_and_the_runtime_both_write() {
        // The inventory's UUID of a MIG instance as the driver's `_v2` UUID is written.
        let own: [u8; 16] = std::array::from_fn(|i| u8::try_from(i + 1).unwrap());
        let parent = crate::cuda::parse_uuid(A).unwrap();
        let mig = crate::cuda::device_uuid_text(&parent, Some(&own));
        let mut inv = inventory();
        inv.gpus.push(GpuDevice {
            uuid: mig.clone(),
            name: "H200 MIG 1g.18gb".to_owned(),
            memory_bytes: 1,
            minor: None,
        });
        // The device plugin's mixed strategy allocates it by its MIG UUID, upper or lower case.
        let runtime = RuntimeGpus {
            pod: pod(),
            allocation: allocated("nvidia.com/mig-1g.18gb", &[&mig.to_uppercase()]),
            cdi_devices: Vec::new(),
        };
        assert_eq!(
            uuids(decide(&runtime, Some("void"), true, Some(&inv))),
            (GpuSource::PodResources, vec![mig.clone()])
        );
        // NVIDIA_VISIBLE_DEVICES names it the same way.
        let none = RuntimeGpus::default();
        assert_eq!(uuids(decide(&none, Some(&mig), true, Some(&inv))).1, [mig]);
        // The pre-R470 form is refused by name, never matched to the whole GPU.
        let old = format!("MIG-{A}/1/0");
        let err = decide(&none, Some(&old), true, Some(&inv)).unwrap_err();
        assert!(err.to_string().contains(&old), "{err}");
    }

    #[test]
    fn an_allocated_gpu_the_node_lacks_is_refused_by_name() {
        let runtime = RuntimeGpus {
            pod: pod(),
            allocation: allocated("nvidia.com/gpu", &["GPU-elsewhere"]),
            cdi_devices: Vec::new(),
        };
        let err = decide(&runtime, None, true, Some(&inventory())).unwrap_err();
        assert!(
            matches!(err, GpuAssignmentError::UnknownGpu { .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("GPU-elsewhere") && text.contains("PodResources"),
            "{text}"
        );
    }

    #[test]
    fn cdi_names_are_read_when_the_kubelet_allocated_no_gpu() {
        let inv = inventory();
        for (names, expected) in [
            (vec![format!("nvidia.com/gpu={B}")], vec![B]),
            (vec!["nvidia.com/gpu=0".to_owned()], vec![A]),
            (vec!["nvidia.com/gpu=all".to_owned()], vec![A, B]),
            (
                vec![
                    "vendor.example/nic=eth1".to_owned(),
                    format!("k8s.device-plugin.nvidia.com/gpu={A}"),
                ],
                vec![A],
            ),
        ] {
            let runtime = RuntimeGpus {
                pod: pod(),
                allocation: Allocation::Devices(Vec::new()),
                cdi_devices: names.clone(),
            };
            assert_eq!(
                uuids(decide(&runtime, Some("void"), true, Some(&inv))),
                (
                    GpuSource::Cdi,
                    expected.iter().map(|s| (*s).to_owned()).collect()
                ),
                "{names:?}"
            );
        }
        let unknown = RuntimeGpus {
            cdi_devices: vec!["nvidia.com/gpu=7".to_owned()],
            ..RuntimeGpus::default()
        };
        let err = decide(&unknown, Some("void"), true, Some(&inv)).unwrap_err();
        assert!(err.to_string().contains("\"7\""), "{err}");
    }

    #[test]
    fn each_form_of_the_variable_is_read_without_an_allocation() {
        let inv = inventory();
        let none = RuntimeGpus::default();
        assert_eq!(
            uuids(decide(&none, Some("all"), true, Some(&inv))),
            (GpuSource::Env, vec![A.to_owned(), B.to_owned()])
        );
        assert_eq!(
            uuids(decide(&none, Some(&B.to_lowercase()), true, Some(&inv))).1,
            [B]
        );
        assert_eq!(
            uuids(decide(&none, Some(&format!("1,{A}")), true, Some(&inv))).1,
            [A, B]
        );
        // Unset, with the device nodes: every GPU of the node, as the runtime shows them.
        assert_eq!(
            uuids(decide(&none, None, true, Some(&inv))),
            (GpuSource::DeviceNodes, vec![A.to_owned(), B.to_owned()])
        );
        let err = decide(&none, Some("GPU-nope"), true, Some(&inv)).unwrap_err();
        assert!(err.to_string().contains("GPU-nope"), "{err}");
        assert!(matches!(
            decide(&none, Some("2"), true, Some(&inv)),
            Err(GpuAssignmentError::UnknownGpu { .. })
        ));
    }

    #[test]
    fn void_none_and_empty_with_device_nodes_are_refused_never_read_as_no_gpu() {
        let inv = inventory();
        let runtime = RuntimeGpus {
            pod: pod(),
            allocation: Allocation::Devices(Vec::new()),
            cdi_devices: Vec::new(),
        };
        for (value, nodes) in [("void", true), ("void", false), ("none", true), ("", true)] {
            for inv in [Some(&inv), None] {
                let err = decide(&runtime, Some(value), nodes, inv).unwrap_err();
                let text = err.to_string();
                assert!(
                    matches!(err, GpuAssignmentError::Undetermined { .. }),
                    "{value:?}: {text}"
                );
                assert!(text.contains("cri://abc"), "{text}");
                assert!(
                    text.contains(&format!("NVIDIA_VISIBLE_DEVICES={value:?}")),
                    "{text}"
                );
                assert!(
                    text.contains(
                        "PodResources API (no GPU allocated to ml/llama-0 container worker)"
                    ) && text.contains("CDI devices (none)"),
                    "{text}"
                );
            }
        }
        // A PodResources failure is named among the sources tried.
        let failed = RuntimeGpus {
            allocation: Allocation::Failed("connection refused".into()),
            ..runtime.clone()
        };
        let text = decide(&failed, Some("void"), true, None)
            .unwrap_err()
            .to_string();
        assert!(text.contains("failed: connection refused"), "{text}");
    }

    #[test]
    fn a_container_that_asks_for_no_gpu_is_cpu_only() {
        let runtime = RuntimeGpus {
            pod: pod(),
            allocation: allocated("example.com/nic", &["eth1"]),
            cdi_devices: Vec::new(),
        };
        assert_eq!(decide(&runtime, None, false, None).unwrap(), None);
        assert_eq!(decide(&runtime, Some(""), false, None).unwrap(), None);
        assert_eq!(
            decide(&RuntimeGpus::default(), None, false, Some(&inventory())).unwrap(),
            None
        );
    }

    #[test]
    fn dra_claims_name_their_gpus_through_cdi() {
        let runtime = RuntimeGpus {
            pod: pod(),
            allocation: Allocation::Devices(vec![AllocatedDevices {
                resource: "gpu.nvidia.com".into(),
                ids: vec!["gpu-1".into()],
                cdi_devices: vec![format!("k8s.gpu.nvidia.com/device={B}")],
                dynamic: true,
            }]),
            cdi_devices: Vec::new(),
        };
        let a = decide(&runtime, Some("void"), true, Some(&inventory()))
            .unwrap()
            .unwrap();
        assert_eq!(a.recorded.source, GpuSource::PodResources);
        assert_eq!(a.recorded.resource, "gpu.nvidia.com");
        assert_eq!(a.recorded.uuids, [B]);
    }
}
