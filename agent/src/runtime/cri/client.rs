//! The CRI client: `runtime.v1.RuntimeService` over a unix socket, callable from async code.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    Container, ContainerFilter, ContainerStatusRequest, ContainerStatusResponse,
    ListContainersRequest, VersionRequest, VersionResponse,
};
use tonic::transport::{Channel, Endpoint, Uri};

use super::{ContainerInfo, ResolveError};

use super::*;

/// A client of a CRI runtime's `RuntimeService` over a unix socket.
#[derive(Clone, Debug)]
pub struct CriClient {
    client: RuntimeServiceClient<Channel>,
    channel: Channel,
    socket: PathBuf,
    options: CriOptions,
}

impl CriClient {
    /// Connects to the CRI socket at `socket` (within `options.timeout`).
    pub async fn connect(socket: &Path, options: CriOptions) -> Result<Self, ResolveError> {
        let path = socket.to_path_buf();
        let endpoint = Endpoint::from_static("http://cri.invalid")
            .connect_timeout(options.timeout)
            .timeout(options.timeout);
        let connect = endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }));
        let channel = match tokio::time::timeout(options.timeout, connect).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(err)) => {
                return Err(ResolveError::Runtime {
                    tool: format!("CRI socket {}", socket.display()),
                    id: String::new(),
                    detail: format!("cannot connect: {}", crate::report::error_chain(&err)),
                });
            }
            Err(_) => {
                return Err(ResolveError::Runtime {
                    tool: format!("CRI socket {}", socket.display()),
                    id: String::new(),
                    detail: format!("cannot connect within {:?}", options.timeout),
                });
            }
        };
        Ok(Self {
            client: RuntimeServiceClient::new(channel.clone()),
            channel,
            socket: socket.to_path_buf(),
            options,
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The resolver settings.
    pub fn options(&self) -> &CriOptions {
        &self.options
    }

    /// The underlying gRPC channel (for other CRI services, such as `ImageService`).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// A raw `RuntimeService` client on the same channel (for calls this type does not wrap).
    pub fn runtime_service(&self) -> RuntimeServiceClient<Channel> {
        self.client.clone()
    }

    fn call_error(&self, method: &str, id: &str, status: &tonic::Status) -> ResolveError {
        if status.code() == tonic::Code::NotFound {
            return ResolveError::NotFound {
                id: id.to_owned(),
                detail: format!(
                    "CRI {method} on {}: {}",
                    self.socket.display(),
                    status.message()
                ),
            };
        }
        ResolveError::Runtime {
            tool: format!("CRI {method} on {}", self.socket.display()),
            id: id.to_owned(),
            detail: format!("{:?}: {}", status.code(), status.message()),
        }
    }

    /// The runtime's name and versions (`Version`).
    pub async fn version(&self) -> Result<VersionResponse, ResolveError> {
        let request = VersionRequest {
            version: "v1".to_owned(),
        };
        self.client
            .clone()
            .version(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.call_error("Version", "", &s))
    }

    /// Lists containers (`ListContainers`), all of them when `filter` is `None`.
    pub async fn list_containers(
        &self,
        filter: Option<ContainerFilter>,
    ) -> Result<Vec<Container>, ResolveError> {
        let id = filter.as_ref().map(|f| f.id.clone()).unwrap_or_default();
        self.client
            .clone()
            .list_containers(ListContainersRequest { filter })
            .await
            .map(|r| r.into_inner().containers)
            .map_err(|s| self.call_error("ListContainers", &id, &s))
    }

    /// The verbose status of the container with the full id `id` (`ContainerStatus`).
    pub async fn container_status(
        &self,
        id: &str,
    ) -> Result<ContainerStatusResponse, ResolveError> {
        self.client
            .clone()
            .container_status(ContainerStatusRequest {
                container_id: id.to_owned(),
                verbose: true,
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.call_error("ContainerStatus", id, &s))
    }

    /// The full id of the container `reference` names: its full id or a unique prefix of it
    /// (like `crictl`), optionally written `cri://<id>`.
    pub async fn find_container(&self, reference: &str) -> Result<String, ResolveError> {
        let wanted = validate_reference(reference)?;
        let filter = ContainerFilter {
            id: wanted.to_owned(),
            ..ContainerFilter::default()
        };
        let mut ids: Vec<String> = self
            .list_containers(Some(filter))
            .await?
            .into_iter()
            .map(|c| c.id)
            .filter(|id| id.starts_with(wanted))
            .collect();
        if ids.is_empty() {
            // Runtimes that match the filter id exactly only: match the prefix here.
            ids = self
                .list_containers(None)
                .await?
                .into_iter()
                .map(|c| c.id)
                .filter(|id| id.starts_with(wanted))
                .collect();
        }
        ids.sort();
        ids.dedup();
        if ids.iter().any(|id| id == wanted) {
            return Ok(wanted.to_owned());
        }
        match ids.len() {
            0 => Err(ResolveError::NotFound {
                id: reference.to_owned(),
                detail: format!(
                    "no container of the CRI runtime at {} has an id starting with {wanted:?}",
                    self.socket.display()
                ),
            }),
            1 => Ok(ids.remove(0)),
            _ => Err(ResolveError::Ambiguous {
                id: reference.to_owned(),
                matches: ids,
            }),
        }
    }

    /// Resolves `reference` (full id or unique prefix) into what the engine needs.
    pub async fn resolve(&self, reference: &str) -> Result<ContainerInfo, ResolveError> {
        let id = self.find_container(reference).await?;
        let response = self.container_status(&id).await?;
        let mut info = container_info_from_status(&id, &response, &self.options)?;
        info.gpus.allocation = self.allocation(info.gpus.pod.as_ref()).await;
        Ok(info)
    }

    /// What the kubelet allocated to `pod`'s container, asked on the same async runtime as
    /// the CRI calls.
    async fn allocation(
        &self,
        pod: Option<&crate::podresources::PodContainer>,
    ) -> crate::runtime::gpus::Allocation {
        use crate::runtime::gpus::Allocation;
        let Some(socket) = &self.options.pod_resources else {
            return Allocation::NotAsked("no kubelet PodResources socket is configured".to_owned());
        };
        let Some(pod) = pod else {
            return Allocation::NotAsked("the container has no Kubernetes pod labels".to_owned());
        };
        match crate::podresources::container_devices(socket, pod).await {
            Ok(devices) => Allocation::Devices(devices),
            Err(err) => {
                // Not fatal here: the container may name its GPUs otherwise, or use none.
                tracing::warn!(pod = %pod, error = %err, "cannot ask the kubelet which devices the container was allocated");
                Allocation::Failed(err.to_string())
            }
        }
    }
}
