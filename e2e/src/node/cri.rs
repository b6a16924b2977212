//! The simulated node's pods through containerd over CRI, as kubelet runs them: a pod sandbox per
//! pod (`RunPodSandbox`, with a network namespace of its own from the test containerd's loopback
//! CNI plugin, or the host's for `hostNetwork`), containers created and started in it with
//! kubelet's security settings and log layout (`<logs>/<namespace>_<pod>_<uid>/<container>/<attempt>.log`),
//! exits read back with `ContainerStatus`, exec probes through `ExecSync`, removal with
//! `StopContainer`/`RemoveContainer`/`StopPodSandbox`/`RemovePodSandbox`. Images come from the
//! node's image directories, imported into containerd (`ctr images import`) on first use.
//!
//! Differences from kubelet: a container is signalled (`TERM` on graceful deletion, `KILL` after
//! a failed probe) by its host PID, checked against the start time seen at start, rather than
//! with `StopContainer`'s own grace period; no per-pod cgroup; no image pulls; no seccomp or
//! AppArmor profiles are passed (a `Localhost` profile would name a file kubelet's root holds).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_cri::v1::{
    Capability, ContainerConfig, ContainerMetadata, ContainerState, CreateContainerRequest,
    ExecSyncRequest, ImageSpec, Int64Value, KeyValue, LinuxContainerConfig,
    LinuxContainerSecurityContext, LinuxPodSandboxConfig, LinuxSandboxSecurityContext, Mount,
    NamespaceMode, NamespaceOption, PodSandboxConfig, PodSandboxMetadata, RemoveContainerRequest,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopContainerRequest,
    StopPodSandboxRequest,
};
use k8s_openapi::api::core::v1::{Container as K8sContainer, Pod};
use kube::ResourceExt;
use warmstart_agent::runtime::cri::{CriClient, CriOptions, parse_verbose_info};
use warmstart_agent::runtime::stat;

use crate::fixture::containerd::{
    KUBELET_MASKED_PATHS, KUBELET_READONLY_PATHS, cri_log_text, ctr_import, image_archive,
    normalize_reference, wait_for_image,
};
use crate::fixture::{ContainerExit, ContainerSpec, FixtureError, Image, Result, connect_in_netns};

use super::pod::PAUSE_ARGS;
use super::spec::pod_hostname;

/// How the node reaches its containerd.
#[derive(Debug, Clone)]
pub struct CriConfig {
    /// containerd's CRI socket.
    pub socket: PathBuf,
    /// Its state directory and namespace (as the agent must be told too).
    pub options: CriOptions,
    /// The `ctr` binary, for importing the node's images.
    pub ctr: PathBuf,
    /// The cgroup parent of every pod.
    pub cgroup_parent: String,
    /// containerd's `sandbox_image`: imported from the node's pause image on start.
    pub sandbox_image: String,
}

impl CriConfig {
    /// The settings for a test containerd.
    #[must_use]
    pub fn for_containerd(containerd: &crate::fixture::containerd::Containerd) -> Self {
        Self {
            socket: containerd.socket.clone(),
            options: containerd.options(),
            ctr: crate::fixture::containerd::which("ctr").unwrap_or_else(|| "ctr".into()),
            cgroup_parent: containerd.cgroup_parent.clone(),
            sandbox_image: crate::fixture::containerd::IMAGE.to_owned(),
        }
    }
}

/// A node's connection to containerd, and what it has imported.
pub(crate) struct CriNode {
    client: CriClient,
    config: CriConfig,
    logs_root: PathBuf,
    images_dir: PathBuf,
    imported: tokio::sync::Mutex<HashSet<String>>,
}

impl std::fmt::Debug for CriNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriNode")
            .field("socket", &self.config.socket)
            .field("logs_root", &self.logs_root)
            .finish_non_exhaustive()
    }
}

/// A running pod sandbox.
#[derive(Debug)]
pub(crate) struct CriSandbox {
    pub(crate) id: String,
    config: PodSandboxConfig,
}

/// Each CRI call's deadline: a loaded 2-core machine starting shims and CRIU at once is slow.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

impl CriNode {
    /// Connects to containerd (waiting up to 30 s for its CRI plugin), keeping logs under
    /// `state_dir/logs` and image archives under `state_dir/cri-images`, and imports
    /// `pause_image` as containerd's sandbox image.
    pub(crate) async fn connect(
        config: CriConfig,
        state_dir: &Path,
        pause_image: &Image,
    ) -> Result<Self> {
        let options = CriOptions {
            timeout: CALL_TIMEOUT,
            ..config.options.clone()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            let attempt = async {
                let client = CriClient::connect(&config.socket, options.clone()).await?;
                client.version().await?;
                Ok::<_, warmstart_agent::runtime::ResolveError>(client)
            };
            match attempt.await {
                Ok(client) => break client,
                Err(e) if Instant::now() > deadline => {
                    return Err(FixtureError::Invalid(format!(
                        "containerd at {}: CRI does not answer: {e}",
                        config.socket.display()
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        let logs_root = super::NodeConfig::pod_logs_dir(state_dir);
        let images_dir = state_dir.join("cri-images");
        for dir in [&logs_root, &images_dir] {
            fs::create_dir_all(dir).map_err(|source| FixtureError::Io {
                context: format!("create {}", dir.display()),
                source,
            })?;
        }
        let node = Self {
            client,
            config,
            logs_root,
            images_dir,
            imported: tokio::sync::Mutex::new(HashSet::new()),
        };
        node.ensure_image(&node.config.sandbox_image, pause_image, &PAUSE_ARGS)
            .await
            .map_err(|e| FixtureError::Invalid(format!("containerd's sandbox image: {e}")))?;
        Ok(node)
    }

    /// Imports `image` into containerd as `reference` (with `entrypoint`), once.
    pub(crate) async fn ensure_image(
        &self,
        reference: &str,
        image: &Image,
        entrypoint: &[&str],
    ) -> std::result::Result<(), String> {
        let name = normalize_reference(reference);
        let mut imported = self.imported.lock().await;
        if imported.contains(&name) {
            return Ok(());
        }
        let work = self.images_dir.join(name.replace(['/', ':', '@'], "_"));
        let rootfs = image.root().to_owned();
        let entrypoint: Vec<String> = entrypoint.iter().map(|s| (*s).to_owned()).collect();
        let ctr = self.config.ctr.clone();
        let socket = self.config.socket.clone();
        let namespace = self.config.options.containerd_namespace.clone();
        let reference_owned = reference.to_owned();
        tokio::task::spawn_blocking(move || {
            let entrypoint: Vec<&str> = entrypoint.iter().map(String::as_str).collect();
            let archive = image_archive(&rootfs, &reference_owned, &entrypoint, &work);
            let imported =
                archive.and_then(|archive| ctr_import(&ctr, &socket, &namespace, &archive));
            let _ = fs::remove_dir_all(&work);
            imported
        })
        .await
        .map_err(|e| format!("import {reference}: {e}"))??;
        wait_for_image(&self.client, &name).await?;
        imported.insert(name);
        Ok(())
    }

    /// Starts the pod's sandbox: its network namespace (the host's for `hostNetwork`), its log
    /// directory.
    pub(crate) async fn run_sandbox(
        &self,
        pod: &Pod,
        host_network: bool,
    ) -> std::result::Result<CriSandbox, String> {
        let namespace = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let uid = pod.uid().unwrap_or_default();
        let log_directory = self.logs_root.join(format!("{namespace}_{name}_{uid}"));
        fs::create_dir_all(&log_directory)
            .map_err(|e| format!("create {}: {e}", log_directory.display()))?;
        let labels = HashMap::from([
            ("io.kubernetes.pod.name".to_owned(), name.clone()),
            ("io.kubernetes.pod.namespace".to_owned(), namespace.clone()),
            ("io.kubernetes.pod.uid".to_owned(), uid.clone()),
        ]);
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name,
                uid,
                namespace,
                attempt: 0,
            }),
            // A host-network pod shares the host's UTS namespace: no hostname (as kubelet does).
            hostname: if host_network {
                String::new()
            } else {
                pod_hostname(pod)
            },
            log_directory: log_directory.to_string_lossy().into_owned(),
            labels,
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: self.config.cgroup_parent.clone(),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces(host_network)),
                    ..LinuxSandboxSecurityContext::default()
                }),
                ..LinuxPodSandboxConfig::default()
            }),
            ..PodSandboxConfig::default()
        };
        let id = self
            .client
            .runtime_service()
            .run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await
            .map_err(|s| format!("RunPodSandbox: {}", s.message()))?
            .into_inner()
            .pod_sandbox_id;
        Ok(CriSandbox { id, config })
    }

    /// Creates and starts `container` of `pod` in `sandbox`: the process, environment and
    /// mounts of `spec` (what the node computed), image `reference`, the security settings of
    /// the pod spec, its log at `<container>/<attempt>.log` of the pod's log directory.
    pub(crate) async fn start_container(
        &self,
        sandbox: &CriSandbox,
        pod: &Pod,
        container: &K8sContainer,
        spec: &ContainerSpec,
        attempt: u32,
    ) -> std::result::Result<CriContainer, String> {
        let log_path = format!("{}/{attempt}.log", container.name);
        let config = container_config(pod, container, spec, attempt, &log_path);
        let mut service = self.client.runtime_service();
        let id = service
            .create_container(CreateContainerRequest {
                pod_sandbox_id: sandbox.id.clone(),
                config: Some(config),
                sandbox_config: Some(sandbox.config.clone()),
            })
            .await
            .map_err(|s| format!("CreateContainer: {}", s.message()))?
            .into_inner()
            .container_id;
        if let Err(s) = service
            .start_container(StartContainerRequest {
                container_id: id.clone(),
            })
            .await
        {
            let _ = self.remove_container(&id).await;
            return Err(format!("StartContainer: {}", s.message()));
        }
        let status = self
            .client
            .container_status(&id)
            .await
            .map_err(|e| e.to_string())?;
        let info = parse_verbose_info(&id, &status.info).map_err(|e| e.to_string())?;
        let pid =
            u32::try_from(info.pid).map_err(|_| format!("container {id}: PID {}", info.pid))?;
        // Pinned now, so a reused PID can never redirect a connection.
        let netns = File::open(format!("/proc/{pid}/ns/net")).ok();
        Ok(CriContainer {
            started: stat::start_time(info.pid),
            id,
            pid,
            socket: self.config.socket.clone(),
            options: self.client.options().clone(),
            log_path: PathBuf::from(&sandbox.config.log_directory).join(log_path),
            netns,
            exit: Mutex::new(None),
        })
    }

    /// Stops (at once) and removes container `id`; one already gone (its sandbox removed) is
    /// no error. Retried for a few seconds, as kubelet's garbage collection retries: containerd
    /// may still hold a container that just exited as running (`StopContainer` returns once the
    /// task is gone, before the exit event updated its status, and `RemoveContainer` then
    /// refuses).
    pub(crate) async fn remove_container(&self, id: &str) -> std::result::Result<(), String> {
        retry_removal(|| async {
            let mut service = self.client.runtime_service();
            gone_is_done(
                service
                    .stop_container(StopContainerRequest {
                        container_id: id.to_owned(),
                        timeout: 0,
                    })
                    .await
                    .map(drop),
            )
            .map_err(|s| format!("StopContainer {id}: {}", s.message()))?;
            gone_is_done(
                service
                    .remove_container(RemoveContainerRequest {
                        container_id: id.to_owned(),
                    })
                    .await
                    .map(drop),
            )
            .map_err(|s| format!("RemoveContainer {id}: {}", s.message()))
        })
        .await
    }

    /// Stops and removes pod sandbox `sandbox` (and whatever containers it still has), retried
    /// as [`CriNode::remove_container`] is.
    pub(crate) async fn remove_sandbox(
        &self,
        sandbox: &CriSandbox,
    ) -> std::result::Result<(), String> {
        let id = &sandbox.id;
        retry_removal(|| async {
            let mut service = self.client.runtime_service();
            gone_is_done(
                service
                    .stop_pod_sandbox(StopPodSandboxRequest {
                        pod_sandbox_id: id.clone(),
                    })
                    .await
                    .map(drop),
            )
            .map_err(|s| format!("StopPodSandbox {id}: {}", s.message()))?;
            gone_is_done(
                service
                    .remove_pod_sandbox(RemovePodSandboxRequest {
                        pod_sandbox_id: id.clone(),
                    })
                    .await
                    .map(drop),
            )
            .map_err(|s| format!("RemovePodSandbox {id}: {}", s.message()))
        })
        .await
    }
}

/// How long a removal is retried before its last error is reported.
const REMOVAL_RETRY: Duration = Duration::from_secs(10);

/// Runs `attempt` until it succeeds or [`REMOVAL_RETRY`] has passed; the last error then.
async fn retry_removal<F, Fut>(mut attempt: F) -> std::result::Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<(), String>>,
{
    let deadline = Instant::now() + REMOVAL_RETRY;
    loop {
        match attempt().await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(e) => {
                tracing::debug!("removal retried: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A removal that finds its object gone has nothing left to do.
fn gone_is_done(
    result: std::result::Result<(), tonic::Status>,
) -> std::result::Result<(), tonic::Status> {
    match result {
        Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
        other => other,
    }
}

/// A pod's own network namespace (or the host's), a PID namespace per container, IPC shared in
/// the pod: kubelet's defaults.
fn namespaces(host_network: bool) -> NamespaceOption {
    NamespaceOption {
        network: if host_network {
            NamespaceMode::Node
        } else {
            NamespaceMode::Pod
        } as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..NamespaceOption::default()
    }
}

/// The CRI configuration kubelet would send for `container`.
fn container_config(
    pod: &Pod,
    container: &K8sContainer,
    spec: &ContainerSpec,
    attempt: u32,
    log_path: &str,
) -> ContainerConfig {
    let pod_spec = pod.spec.as_ref();
    let host_network = pod_spec.and_then(|s| s.host_network) == Some(true);
    let pod_security = pod_spec.and_then(|s| s.security_context.as_ref());
    let security = container.security_context.as_ref();
    let privileged = security.and_then(|s| s.privileged) == Some(true);
    let cap_name = |c: &String| {
        let upper = c.to_ascii_uppercase();
        upper
            .strip_prefix("CAP_")
            .map_or(upper.clone(), str::to_owned)
    };
    let capabilities = security
        .and_then(|s| s.capabilities.as_ref())
        .map(|c| Capability {
            add_capabilities: c.add.iter().flatten().map(cap_name).collect(),
            drop_capabilities: c.drop.iter().flatten().map(cap_name).collect(),
            ..Capability::default()
        });
    let user = security
        .and_then(|s| s.run_as_user)
        .or_else(|| pod_security.and_then(|s| s.run_as_user));
    let group = security
        .and_then(|s| s.run_as_group)
        .or_else(|| pod_security.and_then(|s| s.run_as_group));
    let (masked_paths, readonly_paths) = if privileged {
        (Vec::new(), Vec::new())
    } else {
        (
            KUBELET_MASKED_PATHS.map(str::to_owned).to_vec(),
            KUBELET_READONLY_PATHS.map(str::to_owned).to_vec(),
        )
    };
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: container.name.clone(),
            attempt,
        }),
        image: Some(ImageSpec {
            image: normalize_reference(container.image.as_deref().unwrap_or_default()),
            ..ImageSpec::default()
        }),
        command: spec.args.clone(),
        working_dir: spec.cwd.clone(),
        envs: spec
            .env
            .iter()
            .map(|(key, value)| KeyValue {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        mounts: spec
            .mounts
            .iter()
            .map(|m| Mount {
                container_path: m.destination.clone(),
                host_path: m.source.to_string_lossy().into_owned(),
                readonly: m.readonly,
                ..Mount::default()
            })
            .collect(),
        labels: HashMap::from([
            (
                "io.kubernetes.container.name".to_owned(),
                container.name.clone(),
            ),
            ("io.kubernetes.pod.name".to_owned(), pod.name_any()),
            (
                "io.kubernetes.pod.namespace".to_owned(),
                pod.namespace().unwrap_or_default(),
            ),
            (
                "io.kubernetes.pod.uid".to_owned(),
                pod.uid().unwrap_or_default(),
            ),
        ]),
        log_path: log_path.to_owned(),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                capabilities,
                privileged,
                namespace_options: Some(namespaces(host_network)),
                run_as_user: user.map(|value| Int64Value { value }),
                run_as_group: group.map(|value| Int64Value { value }),
                readonly_rootfs: security.and_then(|s| s.read_only_root_filesystem) == Some(true),
                masked_paths,
                readonly_paths,
                ..LinuxContainerSecurityContext::default()
            }),
            ..LinuxContainerConfig::default()
        }),
        ..ContainerConfig::default()
    }
}

/// A started containerd container. Its methods block (each CRI call runs on a thread of its own
/// with its own connection), so they can be called from async code and from blocking threads.
#[derive(Debug)]
pub struct CriContainer {
    id: String,
    pid: u32,
    /// The init process's start time, to tell it from a process that reused its PID.
    started: Option<u64>,
    socket: PathBuf,
    options: CriOptions,
    log_path: PathBuf,
    netns: Option<File>,
    exit: Mutex<Option<ContainerExit>>,
}

impl CriContainer {
    /// containerd's container id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The host PID of the container's init process.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The container's CRI log file.
    #[must_use]
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn alive(&self) -> bool {
        let pid = i32::try_from(self.pid).unwrap_or(i32::MAX);
        self.started.is_some() && stat::start_time(pid) == self.started
    }

    /// Runs `call` against a fresh connection on a thread of its own.
    fn call<T, F, Fut>(&self, what: &str, call: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(CriClient) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = std::result::Result<T, String>>,
    {
        let socket = self.socket.clone();
        let options = self.options.clone();
        let label = format!("container {}: {what}", self.id);
        let thread_label = label.clone();
        let handle = std::thread::Builder::new()
            .name("cri-call".to_owned())
            .spawn(move || -> std::result::Result<T, String> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("{thread_label}: a runtime: {e}"))?;
                rt.block_on(async move {
                    let client = CriClient::connect(&socket, options)
                        .await
                        .map_err(|e| e.to_string())?;
                    call(client).await
                })
            })
            .map_err(|source| FixtureError::Io {
                context: label.clone(),
                source,
            })?;
        handle
            .join()
            .map_err(|_| FixtureError::Invalid(format!("{label}: the CRI thread panicked")))?
            .map_err(|e| FixtureError::Invalid(format!("{label}: {e}")))
    }

    /// How the init process ended, once containerd says it has (`ContainerStatus`); `None`
    /// while it runs.
    ///
    /// # Errors
    /// The status call fails.
    pub fn try_wait(&self) -> Result<Option<ContainerExit>> {
        let mut exit = self.exit.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(done) = *exit {
            return Ok(Some(done));
        }
        if self.alive() {
            return Ok(None);
        }
        let id = self.id.clone();
        let status = self.call("ContainerStatus", move |client| async move {
            client
                .container_status(&id)
                .await
                .map_err(|e| e.to_string())
        })?;
        let Some(status) = status.status else {
            return Ok(None);
        };
        if status.state != ContainerState::ContainerExited as i32 {
            // The process is gone but containerd has not recorded it yet.
            return Ok(None);
        }
        let code = status.exit_code;
        let done = if (129..=192).contains(&code) && status.reason != "Completed" {
            ContainerExit::Signal(code - 128)
        } else {
            ContainerExit::Code(code)
        };
        *exit = Some(done);
        Ok(Some(done))
    }

    /// Sends `TERM` or `KILL` to the init process (checked to be the container's still).
    ///
    /// # Errors
    /// Another signal name, or the process is gone.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let signal = match signal.trim_start_matches("SIG") {
            "TERM" | "15" => nix::sys::signal::Signal::SIGTERM,
            "KILL" | "9" => nix::sys::signal::Signal::SIGKILL,
            other => {
                return Err(FixtureError::Invalid(format!(
                    "container {}: signal {other} is not supported over CRI",
                    self.id
                )));
            }
        };
        if !self.alive() {
            return Err(FixtureError::Invalid(format!(
                "container {}: its init process {} is gone",
                self.id, self.pid
            )));
        }
        let pid = i32::try_from(self.pid).unwrap_or(i32::MAX);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).map_err(|source| {
            FixtureError::Sys {
                context: format!("container {}: send {signal} to {pid}", self.id),
                source,
            }
        })
    }

    /// Runs `args` in the container (`ExecSync`), for at most `timeout`.
    ///
    /// # Errors
    /// The call fails or times out.
    pub fn exec(&self, args: Vec<String>, timeout: Duration) -> Result<Output> {
        let id = self.id.clone();
        let seconds = i64::try_from(timeout.as_secs().max(1)).unwrap_or(i64::MAX);
        let response = self.call("ExecSync", move |client| async move {
            client
                .runtime_service()
                .exec_sync(ExecSyncRequest {
                    container_id: id,
                    cmd: args,
                    timeout: seconds,
                })
                .await
                .map(tonic::Response::into_inner)
                .map_err(|s| format!("ExecSync: {}", s.message()))
        })?;
        Ok(Output {
            status: ExitStatus::from_raw((response.exit_code & 0xff) << 8),
            stdout: response.stdout,
            stderr: response.stderr,
        })
    }

    /// The content of the container's CRI log (`<time> <stream> <P|F> <text>` lines), as
    /// `kubectl logs` shows it.
    #[must_use]
    pub fn read_log(&self) -> String {
        fs::read(&self.log_path)
            .map(|bytes| cri_log_text(&String::from_utf8_lossy(&bytes)))
            .unwrap_or_default()
    }

    /// Connects to `127.0.0.1:port` in the container's network namespace.
    ///
    /// # Errors
    /// The namespace was not pinned at start, or the connection fails.
    pub fn net_connect(&self, port: u16) -> Result<std::net::TcpStream> {
        let netns = self.netns.as_ref().ok_or_else(|| {
            FixtureError::Invalid(format!(
                "container {}: its network namespace was not pinned at start",
                self.id
            ))
        })?;
        connect_in_netns(netns, port, &format!("container {}", self.id))
    }
}
