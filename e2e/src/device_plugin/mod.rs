//! A test double of NVIDIA's Kubernetes device plugin: advertises the CUDA stand-in's GPUs
//! (UUIDs of [`crate::cuda::SimGpu::numbered`]) to the kubelet as `nvidia.com/gpu`, so the real
//! kubelet allocates them to pods and reports them over its PodResources API, and answers
//! `Allocate` as NVIDIA's plugin does in the form asked for ([`Form`]): the UUIDs in
//! `NVIDIA_VISIBLE_DEVICES`, or `void` with the devices as CDI devices or CDI annotations (the
//! GPU Operator's CDI mode). No device node or mount is handed out: the node has no GPU.
//!
//! The form is read from a file at every `Allocate`, so a test can switch it between pods.
//! The kubelet removes every plugin socket when it restarts: the plugin then serves and
//! registers again.

pub mod api;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use thiserror::Error;
use tonic::transport::{Endpoint, Uri};

use api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use api::registration_client::RegistrationClient;

/// The resource NVIDIA's plugin advertises.
pub const RESOURCE: &str = "nvidia.com/gpu";

/// The device plugin API version the kubelet speaks.
pub const API_VERSION: &str = "v1beta1";

/// The variable NVIDIA's plugin sets.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// How `Allocate` names the devices to the container runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `NVIDIA_VISIBLE_DEVICES=<uuid>,…` (the plugin's `envvar` strategy).
    Uuids,
    /// `NVIDIA_VISIBLE_DEVICES=void` and CDI devices `nvidia.com/gpu=<uuid>` in the CRI config
    /// (`cdi-cri`).
    Cdi,
    /// `NVIDIA_VISIBLE_DEVICES=void` and a `cdi.k8s.io/…` annotation naming them
    /// (`cdi-annotations`).
    CdiAnnotations,
}

impl Form {
    /// `uuids`, `cdi` or `cdi-annotations` (what the form file holds).
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "" | "uuids" => Some(Self::Uuids),
            "cdi" => Some(Self::Cdi),
            "cdi-annotations" => Some(Self::CdiAnnotations),
            _ => None,
        }
    }

    /// The name [`Form::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Uuids => "uuids",
            Self::Cdi => "cdi",
            Self::CdiAnnotations => "cdi-annotations",
        }
    }
}

/// The answer for one container given `ids`.
pub fn container_response(form: Form, ids: &[String]) -> api::ContainerAllocateResponse {
    let names: Vec<String> = ids.iter().map(|id| format!("{RESOURCE}={id}")).collect();
    let mut response = api::ContainerAllocateResponse::default();
    match form {
        Form::Uuids => {
            response
                .envs
                .insert(VISIBLE_DEVICES_ENV.to_owned(), ids.join(","));
        }
        Form::Cdi => {
            response
                .envs
                .insert(VISIBLE_DEVICES_ENV.to_owned(), "void".to_owned());
            response.cdi_devices = names
                .into_iter()
                .map(|name| api::CdiDevice { name })
                .collect();
        }
        Form::CdiAnnotations => {
            response
                .envs
                .insert(VISIBLE_DEVICES_ENV.to_owned(), "void".to_owned());
            response.annotations.insert(
                "cdi.k8s.io/warmstart-test-device-plugin_gpu".to_owned(),
                names.join(","),
            );
        }
    }
    response
}

/// Why the plugin stopped.
#[derive(Debug, Error)]
pub enum PluginError {
    /// An I/O step failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The kubelet refused or did not answer the registration.
    #[error("cannot register with the kubelet at {}: {detail}", socket.display())]
    Register {
        /// The kubelet's registration socket.
        socket: PathBuf,
        /// Why.
        detail: String,
    },
    /// The gRPC server failed.
    #[error("the device plugin server stopped: {0}")]
    Serve(String),
}

/// The plugin's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `<kubelet-root>/device-plugins`, where the kubelet's socket is and the plugin's goes.
    pub plugin_dir: PathBuf,
    /// The plugin socket's file name.
    pub socket_name: String,
    /// The devices advertised.
    pub devices: Vec<String>,
    /// The file whose content chooses the [`Form`] (missing: [`Form::Uuids`]).
    pub form_file: PathBuf,
}

impl Settings {
    /// The stand-in's first `count` GPUs, under `kubelet_root`.
    pub fn standin(kubelet_root: &Path, count: u8, form_file: PathBuf) -> Self {
        Self {
            plugin_dir: kubelet_root.join("device-plugins"),
            socket_name: "warmstart-test-gpu.sock".to_owned(),
            devices: (0..count)
                .map(|n| crate::cuda::SimGpu::numbered(n, 0).uuid)
                .collect(),
            form_file,
        }
    }

    fn socket(&self) -> PathBuf {
        self.plugin_dir.join(&self.socket_name)
    }
}

#[derive(Debug)]
struct Plugin {
    settings: Settings,
}

impl Plugin {
    fn form(&self) -> Result<Form, tonic::Status> {
        let text = match std::fs::read_to_string(&self.settings.form_file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(tonic::Status::internal(e.to_string())),
        };
        Form::parse(&text).ok_or_else(|| {
            tonic::Status::invalid_argument(format!(
                "{} holds {text:?}, not uuids, cdi or cdi-annotations",
                self.settings.form_file.display()
            ))
        })
    }
}

type DeviceStream = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<api::ListAndWatchResponse, tonic::Status>> + Send>,
>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: tonic::Request<api::Empty>,
    ) -> Result<tonic::Response<api::DevicePluginOptions>, tonic::Status> {
        Ok(tonic::Response::new(api::DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: tonic::Request<api::Empty>,
    ) -> Result<tonic::Response<Self::ListAndWatchStream>, tonic::Status> {
        let devices = self
            .settings
            .devices
            .iter()
            .map(|id| api::Device {
                id: id.clone(),
                health: "Healthy".to_owned(),
                topology: None,
            })
            .collect();
        // One list, then the stream stays open: the devices never change.
        let once = futures::stream::once(async { Ok(api::ListAndWatchResponse { devices }) });
        Ok(tonic::Response::new(Box::pin(futures::StreamExt::chain(
            once,
            futures::stream::pending(),
        ))))
    }

    async fn get_preferred_allocation(
        &self,
        _: tonic::Request<api::PreferredAllocationRequest>,
    ) -> Result<tonic::Response<api::PreferredAllocationResponse>, tonic::Status> {
        Ok(tonic::Response::new(
            api::PreferredAllocationResponse::default(),
        ))
    }

    async fn allocate(
        &self,
        request: tonic::Request<api::AllocateRequest>,
    ) -> Result<tonic::Response<api::AllocateResponse>, tonic::Status> {
        let form = self.form()?;
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|c| {
                eprintln!("allocate {:?} as {}", c.devices_ids, form.name());
                container_response(form, &c.devices_ids)
            })
            .collect();
        Ok(tonic::Response::new(api::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: tonic::Request<api::PreStartContainerRequest>,
    ) -> Result<tonic::Response<api::PreStartContainerResponse>, tonic::Status> {
        Ok(tonic::Response::new(api::PreStartContainerResponse {}))
    }
}

/// Serves the plugin and registers it; serves and registers again whenever its socket is gone
/// (the kubelet restarted). Runs until the process ends.
///
/// # Errors
/// [`PluginError`] when the socket cannot be served or the kubelet refuses the registration.
pub async fn run(settings: Settings) -> Result<(), PluginError> {
    loop {
        let socket = settings.socket();
        match std::fs::remove_file(&socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(PluginError::Io {
                    what: "cannot remove the stale socket",
                    path: socket,
                    source,
                });
            }
        }
        let listener =
            tokio::net::UnixListener::bind(&socket).map_err(|source| PluginError::Io {
                what: "cannot listen on",
                path: socket.clone(),
                source,
            })?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(Plugin {
                settings: settings.clone(),
            }))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            );
        let serving = tokio::spawn(server);
        register(&settings).await?;
        eprintln!(
            "registered {} ({} devices) at {}",
            RESOURCE,
            settings.devices.len(),
            socket.display()
        );
        // The kubelet removes the plugin sockets when it starts again.
        while socket.exists() && !serving.is_finished() {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let _ = stop.send(());
        match serving.await {
            Ok(Ok(())) => eprintln!("socket {} gone: serving again", socket.display()),
            Ok(Err(e)) => return Err(PluginError::Serve(e.to_string())),
            Err(e) => return Err(PluginError::Serve(e.to_string())),
        }
    }
}

async fn register(settings: &Settings) -> Result<(), PluginError> {
    let kubelet = settings.plugin_dir.join("kubelet.sock");
    let error = |detail: String| PluginError::Register {
        socket: kubelet.clone(),
        detail,
    };
    let path = kubelet.clone();
    let channel = Endpoint::from_static("http://kubelet.invalid")
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|e| error(format!("{e:?}")))?;
    RegistrationClient::new(channel)
        .register(api::RegisterRequest {
            version: API_VERSION.to_owned(),
            endpoint: settings.socket_name.clone(),
            resource_name: RESOURCE.to_owned(),
            options: Some(api::DevicePluginOptions::default()),
        })
        .await
        .map_err(|status| error(format!("{:?}: {}", status.code(), status.message())))?;
    Ok(())
}

/// The form file's path of the local cluster's plugin.
pub fn cluster_form_file(cluster_dir: &Path) -> PathBuf {
    cluster_dir.join("device-plugin").join("form")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_names_the_devices_as_nvidias_plugin_does() {
        let ids = vec!["GPU-a".to_owned(), "GPU-b".to_owned()];
        let uuids = container_response(Form::Uuids, &ids);
        assert_eq!(uuids.envs[VISIBLE_DEVICES_ENV], "GPU-a,GPU-b");
        assert!(uuids.cdi_devices.is_empty() && uuids.annotations.is_empty());
        let cdi = container_response(Form::Cdi, &ids);
        assert_eq!(cdi.envs[VISIBLE_DEVICES_ENV], "void");
        assert_eq!(cdi.cdi_devices[1].name, "nvidia.com/gpu=GPU-b");
        let annotated = container_response(Form::CdiAnnotations, &ids);
        assert_eq!(annotated.envs[VISIBLE_DEVICES_ENV], "void");
        assert_eq!(
            annotated.annotations.values().next().unwrap(),
            "nvidia.com/gpu=GPU-a,nvidia.com/gpu=GPU-b"
        );
        for form in [Form::Uuids, Form::Cdi, Form::CdiAnnotations] {
            assert_eq!(Form::parse(form.name()), Some(form));
        }
        assert_eq!(Form::parse("bogus"), None);
    }
}
