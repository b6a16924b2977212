//! What a container runtime says about a container's devices (besides its environment): the
//! pod container it is, the kubelet's allocation, its CDI device names. Filled in by the
//! resolvers; [`crate::gpu_assignment`] decides the container's GPUs from it.

use crate::podresources::{AllocatedDevices, PodContainer};

/// The annotations (on a container's CRI config and OCI spec) that carry CDI device names,
/// comma-separated in their values.
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// What the runtime says about a container's devices, besides its environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeGpus {
    /// The pod container it is, from the runtime's labels (`io.kubernetes.*`).
    pub pod: Option<PodContainer>,
    /// What the kubelet allocated to it.
    pub allocation: Allocation,
    /// Fully qualified CDI device names from its annotations and CRI config.
    pub cdi_devices: Vec<String>,
}

/// The kubelet's answer about a container's allocated devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// Not asked, and why.
    NotAsked(String),
    /// The devices allocated (maybe none).
    Devices(Vec<AllocatedDevices>),
    /// Asking failed.
    Failed(String),
}

impl Default for Allocation {
    fn default() -> Self {
        Self::NotAsked("the container is not known to be a Kubernetes pod's".to_owned())
    }
}
