//! The kubelet's PodResources API (`v1.PodResourcesLister` on
//! `<kubelet-root>/pod-resources/kubelet.sock`): which devices the device plugins and DRA
//! drivers allocated to each container of a pod, as the kubelet recorded them.
//!
//! `Get` (one pod; beta and on by default since Kubernetes 1.34) is asked first; a kubelet
//! that refuses it (older, or the `KubeletPodResourcesGet` gate off) is asked `List`.

pub mod api;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use thiserror::Error;
use tonic::transport::{Endpoint, Uri};

use api::pod_resources_lister_client::PodResourcesListerClient;

/// The socket's path under the kubelet root.
pub const SOCKET_UNDER_KUBELET_ROOT: &str = "pod-resources/kubelet.sock";

/// How long a connection or a call may take.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// The PodResources socket of the kubelet whose root is `kubelet_root`.
pub fn socket_under(kubelet_root: &Path) -> PathBuf {
    kubelet_root.join(SOCKET_UNDER_KUBELET_ROOT)
}

/// A container of a pod, as the kubelet names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodContainer {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod.
    pub pod: String,
    /// The container's name in the pod spec.
    pub container: String,
}

impl std::fmt::Display for PodContainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} container {}",
            self.namespace, self.pod, self.container
        )
    }
}

/// Devices of one resource (extended resource or DRA driver) allocated to a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocatedDevices {
    /// The extended resource (`nvidia.com/gpu`), or the DRA driver (`gpu.nvidia.com`).
    pub resource: String,
    /// The device IDs the device plugin advertised (UUIDs or indices for NVIDIA's), or the DRA
    /// device names.
    pub ids: Vec<String>,
    /// The CDI devices the kubelet reports for them (DRA).
    pub cdi_devices: Vec<String>,
    /// Whether a DRA driver allocated them (else a device plugin).
    pub dynamic: bool,
}

/// Why the kubelet could not say what a container was allocated.
#[derive(Debug, Error)]
pub enum PodResourcesError {
    /// The socket does not answer.
    #[error("cannot connect to the kubelet's PodResources socket {socket}: {detail}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// Why.
        detail: String,
    },
    /// `List` failed (after `Get` did).
    #[error("the kubelet's PodResources List on {socket} failed: {detail}")]
    Call {
        /// The socket.
        socket: PathBuf,
        /// The gRPC status (and `Get`'s before it).
        detail: String,
    },
    /// The kubelet does not list the pod.
    #[error("the kubelet's PodResources API on {socket} does not list pod {namespace}/{pod}")]
    NoPod {
        /// The socket.
        socket: PathBuf,
        /// The pod's namespace.
        namespace: String,
        /// The pod.
        pod: String,
    },
    /// The kubelet lists the pod without the container.
    #[error(
        "the kubelet's PodResources API lists pod {namespace}/{pod} without a container {container} (it has: {found})"
    )]
    NoContainer {
        /// The pod's namespace.
        namespace: String,
        /// The pod.
        pod: String,
        /// The container asked about.
        container: String,
        /// The containers it lists.
        found: String,
    },
}

/// What the kubelet allocated to `target`.
///
/// # Errors
/// [`PodResourcesError`].
pub async fn container_devices(
    socket: &Path,
    target: &PodContainer,
) -> Result<Vec<AllocatedDevices>, PodResourcesError> {
    let mut client = connect(socket).await?;
    let get = client
        .get(api::GetPodResourcesRequest {
            pod_name: target.pod.clone(),
            pod_namespace: target.namespace.clone(),
        })
        .await;
    let pod = match get {
        Ok(answer) => answer.into_inner().pod_resources,
        Err(get_status) => {
            tracing::debug!(status = %get_status, "PodResources Get refused; asking List");
            let listed = client
                .list(api::ListPodResourcesRequest {})
                .await
                .map_err(|status| PodResourcesError::Call {
                    socket: socket.to_path_buf(),
                    detail: format!(
                        "{} (Get before it: {})",
                        status_text(&status),
                        status_text(&get_status)
                    ),
                })?;
            listed
                .into_inner()
                .pod_resources
                .into_iter()
                .find(|p| p.namespace == target.namespace && p.name == target.pod)
        }
    };
    let pod = pod.ok_or_else(|| PodResourcesError::NoPod {
        socket: socket.to_path_buf(),
        namespace: target.namespace.clone(),
        pod: target.pod.clone(),
    })?;
    devices_of(&pod, target)
}

/// How many pods the kubelet's PodResources API lists on `socket`: whether it answers.
///
/// # Errors
/// [`PodResourcesError`]: no connection, or the call refused.
pub async fn pods_listed(socket: &Path) -> Result<usize, PodResourcesError> {
    let mut client = connect(socket).await?;
    let listed = client
        .list(api::ListPodResourcesRequest {})
        .await
        .map_err(|status| PodResourcesError::Call {
            socket: socket.to_path_buf(),
            detail: status_text(&status),
        })?;
    Ok(listed.into_inner().pod_resources.len())
}

/// The devices `pod` (as the kubelet answered) lists for `target`'s container.
///
/// # Errors
/// [`PodResourcesError::NoContainer`].
pub fn devices_of(
    pod: &api::PodResources,
    target: &PodContainer,
) -> Result<Vec<AllocatedDevices>, PodResourcesError> {
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == target.container)
        .ok_or_else(|| PodResourcesError::NoContainer {
            namespace: target.namespace.clone(),
            pod: target.pod.clone(),
            container: target.container.clone(),
            found: pod
                .containers
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    let plugins = container.devices.iter().map(|d| AllocatedDevices {
        resource: d.resource_name.clone(),
        ids: d.device_ids.clone(),
        cdi_devices: Vec::new(),
        dynamic: false,
    });
    let dra = container
        .dynamic_resources
        .iter()
        .flat_map(|claim| &claim.claim_resources)
        .map(|r| AllocatedDevices {
            resource: r.driver_name.clone(),
            ids: vec![r.device_name.clone()],
            cdi_devices: r.cdi_devices.iter().map(|c| c.name.clone()).collect(),
            dynamic: true,
        });
    Ok(plugins.chain(dra).collect())
}

fn status_text(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

async fn connect(
    socket: &Path,
) -> Result<PodResourcesListerClient<tonic::transport::Channel>, PodResourcesError> {
    let path = socket.to_path_buf();
    let endpoint = Endpoint::from_static("http://pod-resources.invalid")
        .connect_timeout(TIMEOUT)
        .timeout(TIMEOUT);
    let connect = endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(&path).await?;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    }));
    let error = |detail: String| PodResourcesError::Connect {
        socket: socket.to_path_buf(),
        detail,
    };
    match tokio::time::timeout(TIMEOUT, connect).await {
        Ok(Ok(channel)) => Ok(PodResourcesListerClient::new(channel)),
        Ok(Err(err)) => Err(error(crate::report::error_chain(&err))),
        Err(_) => Err(error(format!("no answer within {TIMEOUT:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> PodContainer {
        PodContainer {
            namespace: "ml".into(),
            pod: "llama-0".into(),
            container: "worker".into(),
        }
    }

    #[test]
    fn a_containers_plugin_and_dra_devices_are_read_and_another_container_is_named() {
        let pod = api::PodResources {
            name: "llama-0".into(),
            namespace: "ml".into(),
            containers: vec![
                api::ContainerResources {
                    name: "sidecar".into(),
                    ..Default::default()
                },
                api::ContainerResources {
                    name: "worker".into(),
                    devices: vec![api::ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: vec!["GPU-a".into(), "GPU-b".into()],
                        topology: None,
                    }],
                    dynamic_resources: vec![api::DynamicResource {
                        claim_name: "gpu".into(),
                        claim_namespace: "ml".into(),
                        claim_resources: vec![api::ClaimResource {
                            cdi_devices: vec![api::CdiDevice {
                                name: "k8s.gpu.nvidia.com/device=gpu-0".into(),
                            }],
                            driver_name: "gpu.nvidia.com".into(),
                            pool_name: "node-1".into(),
                            device_name: "gpu-0".into(),
                            share_id: None,
                        }],
                    }],
                    ..Default::default()
                },
            ],
        };
        let devices = devices_of(&pod, &target()).unwrap();
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].resource, "nvidia.com/gpu");
        assert_eq!(devices[0].ids, ["GPU-a", "GPU-b"]);
        assert!(devices[1].dynamic);
        assert_eq!(devices[1].cdi_devices, ["k8s.gpu.nvidia.com/device=gpu-0"]);
        let other = PodContainer {
            container: "nope".into(),
            ..target()
        };
        let err = devices_of(&pod, &other).unwrap_err().to_string();
        assert!(
            err.contains("without a container nope") && err.contains("sidecar, worker"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_missing_socket_is_named() {
        let err = container_devices(Path::new("/nonexistent/kubelet.sock"), &target())
            .await
            .unwrap_err();
        assert!(matches!(err, PodResourcesError::Connect { .. }), "{err}");
        assert!(
            err.to_string().contains("/nonexistent/kubelet.sock"),
            "{err}"
        );
    }
}
