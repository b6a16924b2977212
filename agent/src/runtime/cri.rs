//! CRI runtime resolver: finds a container through a CRI runtime (containerd or CRI-O) over its
//! unix socket (`runtime.v1.RuntimeService`) and turns its verbose status into a
//! [`ContainerInfo`].
//!
//! Both runtimes answer `ContainerStatus` with `verbose: true` with an `info` map whose `"info"`
//! entry is a JSON object carrying the container's host `pid` and the OCI `runtimeSpec` (mounts
//! with their host sources, `linux.maskedPaths`, `root.path`). containerd adds `sandboxID`,
//! `snapshotKey`, `snapshotter`, `runtimeType`, `config`; CRI-O adds `privileged` and writes an
//! absolute `root.path` (`/var/lib/containers/storage/overlay/<layer>/merged`), while containerd's
//! is relative to the task bundle (`<state>/io.containerd.runtime.v2.task/k8s.io/<id>/rootfs`).
//! The shapes are told apart by field presence ([`CriFlavor`]).
//!
//! The root filesystem is always reported as a host path that is visible in the agent's own mount
//! namespace, never as `/proc/<pid>/root` (CRIU cannot restore into that: see
//! `notes/restore-into-placeholder.md`). For a running container a candidate path is accepted only
//! when it is the same filesystem as the container's root (same device number); when no candidate
//! is, the agent's `/proc/self/mountinfo` is searched for the mount of the container's root
//! device, which also finds it under a containerd state directory this resolver was not told about.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    Container, ContainerFilter, ContainerState, ContainerStatusRequest, ContainerStatusResponse,
    ListContainersRequest, VersionRequest, VersionResponse,
};
use serde::Deserialize;
use tonic::transport::{Channel, Endpoint, Uri};

use super::mountinfo::{self, MountInfo};
use super::{ContainerInfo, ResolveError, RuntimeKind, RuntimeMount};

/// containerd's default CRI socket.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// CRI-O's default socket.
pub const CRIO_SOCKET: &str = "/var/run/crio/crio.sock";
/// containerd's default state directory (its `state` setting).
pub const CONTAINERD_STATE_DIR: &str = "/run/containerd";
/// The containerd namespace the CRI plugin keeps its containers in.
pub const CONTAINERD_CRI_NAMESPACE: &str = "k8s.io";
/// The key of the verbose-status `info` map that both containerd and CRI-O fill.
pub const INFO_KEY: &str = "info";

/// Settings of the CRI resolver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CriOptions {
    /// containerd's state directory (where task bundles live), as seen by the agent.
    pub containerd_state_dir: PathBuf,
    /// The containerd namespace of CRI containers.
    pub containerd_namespace: String,
    /// Deadline for connecting and for each CRI call.
    pub timeout: Duration,
}

impl Default for CriOptions {
    fn default() -> Self {
        Self {
            containerd_state_dir: PathBuf::from(CONTAINERD_STATE_DIR),
            containerd_namespace: CONTAINERD_CRI_NAMESPACE.to_owned(),
            timeout: Duration::from_secs(10),
        }
    }
}

/// Which CRI runtime produced a verbose status, told by the fields of its `info` JSON.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CriFlavor {
    /// containerd's CRI plugin (`snapshotKey`, `snapshotter`, `runtimeType` present).
    Containerd,
    /// CRI-O (`privileged` present, or an absolute `runtimeSpec.root.path`).
    CriO,
    /// Neither shape recognised.
    Unknown,
}

/// The useful part of a verbose container status `info` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerboseInfo {
    /// Which runtime shape it had.
    pub flavor: CriFlavor,
    /// Host PID of the container's init (0 when it does not run).
    pub pid: i32,
    /// The pod sandbox id, when given.
    pub sandbox_id: Option<String>,
    /// containerd's snapshot key, when given.
    pub snapshot_key: Option<String>,
    /// containerd's snapshotter, when given.
    pub snapshotter: Option<String>,
    /// The OCI spec's `root.path` as written (absolute for CRI-O, bundle-relative for containerd).
    pub root_path: Option<String>,
    /// The OCI spec's mounts.
    pub mounts: Vec<RuntimeMount>,
    /// The OCI spec's `linux.maskedPaths`.
    pub masked_paths: Vec<String>,
    /// Whether the OCI spec was present at all.
    pub has_spec: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawInfo {
    #[serde(default)]
    pid: Option<i64>,
    #[serde(default, rename = "sandboxID")]
    sandbox_id: Option<String>,
    #[serde(default)]
    snapshot_key: Option<String>,
    #[serde(default)]
    snapshotter: Option<String>,
    #[serde(default)]
    runtime_type: Option<String>,
    #[serde(default)]
    privileged: Option<bool>,
    #[serde(default)]
    runtime_spec: Option<RawSpec>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawSpec {
    #[serde(default)]
    root: Option<RawRoot>,
    #[serde(default)]
    mounts: Option<Vec<RawMount>>,
    #[serde(default)]
    linux: Option<RawLinux>,
}

#[derive(Deserialize)]
struct RawRoot {
    #[serde(default)]
    path: String,
}

#[derive(Deserialize)]
struct RawMount {
    #[serde(default)]
    destination: String,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    options: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawLinux {
    #[serde(default)]
    masked_paths: Option<Vec<String>>,
}

/// Parses the verbose `info` map of a `ContainerStatus` answer (either runtime's shape).
///
/// Takes the [`INFO_KEY`] entry, or else the first entry that is a JSON object with a `pid` or a
/// `runtimeSpec`. `id` is only used in errors.
pub fn parse_verbose_info(
    id: &str,
    info: &HashMap<String, String>,
) -> Result<VerboseInfo, ResolveError> {
    let raw: RawInfo = if let Some(text) = info.get(INFO_KEY) {
        serde_json::from_str(text).map_err(|source| ResolveError::Parse {
            what: "CRI verbose status info",
            id: id.to_owned(),
            source,
        })?
    } else {
        let mut keys: Vec<&String> = info.keys().collect();
        keys.sort();
        let found = keys.into_iter().find_map(|key| {
            let value: serde_json::Value = serde_json::from_str(&info[key]).ok()?;
            let object = value.as_object()?;
            if !object.contains_key("pid") && !object.contains_key("runtimeSpec") {
                return None;
            }
            serde_json::from_value::<RawInfo>(value).ok()
        });
        found.ok_or_else(|| ResolveError::Runtime {
            tool: "CRI ContainerStatus (verbose)".to_owned(),
            id: id.to_owned(),
            detail: format!(
                "the answer has no {INFO_KEY:?} entry with the container's pid and OCI spec \
                 (keys: {:?}); is the runtime started with verbose status support?",
                info.keys().collect::<Vec<_>>()
            ),
        })?
    };
    VerboseInfo::from_raw(id, raw)
}

impl VerboseInfo {
    fn from_raw(id: &str, raw: RawInfo) -> Result<Self, ResolveError> {
        let pid = match raw.pid {
            None => 0,
            Some(pid) => i32::try_from(pid).map_err(|_| ResolveError::Runtime {
                tool: "CRI ContainerStatus (verbose)".to_owned(),
                id: id.to_owned(),
                detail: format!("pid {pid} out of range"),
            })?,
        };
        let root_path = raw
            .runtime_spec
            .as_ref()
            .and_then(|s| s.root.as_ref())
            .map(|r| r.path.clone())
            .filter(|p| !p.is_empty());
        let flavor = if raw.snapshot_key.is_some()
            || raw.snapshotter.is_some()
            || raw.runtime_type.is_some()
        {
            CriFlavor::Containerd
        } else if raw.privileged.is_some()
            || root_path.as_deref().is_some_and(|p| p.starts_with('/'))
        {
            CriFlavor::CriO
        } else {
            CriFlavor::Unknown
        };
        let has_spec = raw.runtime_spec.is_some();
        let (mounts, masked_paths) = match raw.runtime_spec {
            None => (Vec::new(), Vec::new()),
            Some(spec) => (
                spec.mounts
                    .unwrap_or_default()
                    .into_iter()
                    .map(|m| RuntimeMount {
                        destination: m.destination,
                        source: m.source.unwrap_or_default(),
                        kind: m.kind.unwrap_or_default(),
                        options: m.options.unwrap_or_default(),
                    })
                    .collect(),
                spec.linux.and_then(|l| l.masked_paths).unwrap_or_default(),
            ),
        };
        Ok(Self {
            flavor,
            pid,
            sandbox_id: raw.sandbox_id.filter(|s| !s.is_empty()),
            snapshot_key: raw.snapshot_key.filter(|s| !s.is_empty()),
            snapshotter: raw.snapshotter.filter(|s| !s.is_empty()),
            root_path,
            mounts,
            masked_paths,
            has_spec,
        })
    }

    /// Host paths where the container's root filesystem should be, best first: an absolute
    /// `root.path` (CRI-O), then containerd's task bundle `root.path` (default `rootfs`) under
    /// `options.containerd_state_dir`.
    pub fn rootfs_candidates(&self, id: &str, options: &CriOptions) -> Vec<PathBuf> {
        let mut out = Vec::new();
        if let Some(root) = self.root_path.as_deref()
            && root.starts_with('/')
        {
            out.push(PathBuf::from(root));
        }
        if self.flavor != CriFlavor::CriO {
            let relative = self
                .root_path
                .as_deref()
                .filter(|p| !p.starts_with('/'))
                .unwrap_or("rootfs");
            out.push(
                options
                    .containerd_state_dir
                    .join("io.containerd.runtime.v2.task")
                    .join(&options.containerd_namespace)
                    .join(id)
                    .join(relative),
            );
        }
        out
    }
}

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
        container_info_from_status(&id, &response, &self.options)
    }
}

/// Resolves a CRI container with default [`CriOptions`], blocking the calling thread.
///
/// Builds its own current-thread tokio runtime: do not call it from inside an async runtime
/// (use [`CriClient`] there).
pub fn resolve_blocking(socket: &Path, id: &str) -> Result<ContainerInfo, ResolveError> {
    resolve_blocking_with(socket, id, &CriOptions::default())
}

/// [`resolve_blocking`] with explicit options (such as a private containerd state directory).
pub fn resolve_blocking_with(
    socket: &Path,
    id: &str,
    options: &CriOptions,
) -> Result<ContainerInfo, ResolveError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| ResolveError::Runtime {
            tool: "tokio runtime".to_owned(),
            id: id.to_owned(),
            detail: format!("cannot build a runtime for the CRI client: {source}"),
        })?;
    runtime
        .block_on(async {
            let client = CriClient::connect(socket, options.clone()).await?;
            client.resolve(id).await
        })
        .map_err(|err| match err {
            // Connecting knows no container: name the one asked for.
            ResolveError::Runtime {
                tool,
                id: unnamed,
                detail,
            } if unnamed.is_empty() => ResolveError::Runtime {
                tool,
                id: id.to_owned(),
                detail,
            },
            other => other,
        })
}

/// Builds a [`ContainerInfo`] from a verbose `ContainerStatus` answer for the container `id`,
/// reading `/proc/<pid>` and the agent's mount table to find the root filesystem and upper dir.
pub fn container_info_from_status(
    id: &str,
    response: &ContainerStatusResponse,
    options: &CriOptions,
) -> Result<ContainerInfo, ResolveError> {
    let status = response
        .status
        .as_ref()
        .ok_or_else(|| ResolveError::Runtime {
            tool: "CRI ContainerStatus".to_owned(),
            id: id.to_owned(),
            detail: "the answer has no status".to_owned(),
        })?;
    let verbose = parse_verbose_info(id, &response.info)?;
    let proc_dir = PathBuf::from(format!("/proc/{}", verbose.pid));
    let running = status.state == ContainerState::ContainerRunning as i32
        && verbose.pid > 0
        && proc_dir.exists();

    let mut mounts = verbose.mounts.clone();
    if !verbose.has_spec {
        // No OCI spec: fall back to the CRI-level mounts (host paths of volumes).
        mounts = status
            .mounts
            .iter()
            .map(|m| RuntimeMount {
                destination: m.container_path.clone(),
                source: m.host_path.clone(),
                kind: "bind".to_owned(),
                options: vec![
                    "rbind".to_owned(),
                    if m.readonly { "ro" } else { "rw" }.to_owned(),
                ],
            })
            .collect();
    }

    let candidates = verbose.rootfs_candidates(id, options);
    let (rootfs, upper_dir) = if running {
        let own = mountinfo::read(verbose.pid)?;
        let root = own.iter().rev().find(|m| m.mount_point == "/");
        let rootfs = find_running_rootfs(id, verbose.pid, root, &candidates)?;
        (rootfs, mountinfo::overlay_upper_dir(&own))
    } else {
        let rootfs = candidates
            .iter()
            .find(|c| c.is_dir())
            .or_else(|| candidates.first())
            .cloned()
            .ok_or_else(|| ResolveError::NoRootfs {
                id: id.to_owned(),
                detail: "the container does not run and its status names no root path".to_owned(),
            })?;
        (rootfs, None)
    };

    let image = status
        .image
        .as_ref()
        .map(|i| i.image.clone())
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| status.image_ref.clone());

    Ok(ContainerInfo {
        id: id.to_owned(),
        runtime: RuntimeKind::Cri,
        pid: verbose.pid,
        running,
        rootfs,
        upper_dir,
        mounts,
        masked_paths: verbose.masked_paths,
        image,
    })
}

/// The first candidate that is the container's root filesystem (same device as
/// `/proc/<pid>/root`), or else the agent's mount of the container's root filesystem.
fn find_running_rootfs(
    id: &str,
    pid: i32,
    root: Option<&MountInfo>,
    candidates: &[PathBuf],
) -> Result<PathBuf, ResolveError> {
    let proc_root = PathBuf::from(format!("/proc/{pid}/root"));
    let root_dev = std::fs::metadata(&proc_root)
        .map_err(|source| ResolveError::Read {
            path: proc_root.clone(),
            source,
        })?
        .dev();
    let mut rejected = Vec::new();
    for candidate in candidates {
        match std::fs::metadata(candidate) {
            Ok(meta) if meta.is_dir() && meta.dev() == root_dev => return Ok(candidate.clone()),
            Ok(meta) => rejected.push(format!(
                "{} is on device {}:{}, the container's root on {}:{}",
                candidate.display(),
                dev_major(meta.dev()),
                dev_minor(meta.dev()),
                dev_major(root_dev),
                dev_minor(root_dev)
            )),
            Err(err) => rejected.push(format!("{}: {err}", candidate.display())),
        }
    }
    if let Some(root) = root {
        let self_mountinfo = Path::new("/proc/self/mountinfo");
        let text =
            std::fs::read_to_string(self_mountinfo).map_err(|source| ResolveError::Read {
                path: self_mountinfo.to_path_buf(),
                source,
            })?;
        let own = mountinfo::parse(&text, self_mountinfo)?;
        if let Some(found) = host_mount_of(root, root_dev, &own, candidates) {
            return Ok(found);
        }
        rejected.push(format!(
            "no {} mount of device {}:{} (root {}) in the agent's mount namespace",
            root.fstype,
            dev_major(root_dev),
            dev_minor(root_dev),
            root.root
        ));
    }
    Err(ResolveError::NoRootfs {
        id: id.to_owned(),
        detail: format!(
            "{}; the agent must see the runtime's rootfs mounts (hostPath with \
             mountPropagation: HostToContainer)",
            rejected.join("; ")
        ),
    })
}

/// Where `root` (the root mount of another mount namespace, on device `root_dev`) is mounted in
/// `own` (the agent's mounts), as a path. Among several, one whose last component matches a
/// candidate's (`rootfs`, `merged`) wins, then the shortest.
fn host_mount_of(
    root: &MountInfo,
    root_dev: u64,
    own: &[MountInfo],
    candidates: &[PathBuf],
) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = own
        .iter()
        .filter(|m| m.fstype == root.fstype)
        .filter_map(|m| {
            let path = if m.root == root.root {
                PathBuf::from(&m.mount_point)
            } else if m.root == "/" {
                PathBuf::from(&m.mount_point).join(root.root.trim_start_matches('/'))
            } else {
                let rest = root.root.strip_prefix(&m.root)?;
                if !rest.starts_with('/') {
                    return None;
                }
                PathBuf::from(&m.mount_point).join(rest.trim_start_matches('/'))
            };
            let meta = std::fs::metadata(&path).ok()?;
            (meta.is_dir() && meta.dev() == root_dev).then_some(path)
        })
        .collect();
    found.sort_by_key(|p| {
        let near = candidates
            .iter()
            .any(|c| c.file_name().is_some() && c.file_name() == p.file_name());
        (!near, p.as_os_str().len())
    });
    found.dedup();
    found.into_iter().next()
}

fn dev_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff)
}

fn dev_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0xff)
}

fn validate_reference(reference: &str) -> Result<&str, ResolveError> {
    let id = reference.strip_prefix("cri://").unwrap_or(reference).trim();
    if !id.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(ResolveError::InvalidId(reference.to_owned()));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_cri::v1::{ContainerStatus, ImageSpec};

    /// A real containerd 1.6.20 answer (captured by `tests/cri_containerd.rs`), paths rewritten
    /// to a production node's (`/var/lib/containerd`, `/run/containerd`, kubelet's pod dir).
    const CONTAINERD_INFO: &str = include_str!("testdata/containerd-1.6-status-info.json");
    /// CRI-O's shape (`sandboxID`, `pid`, `runtimeSpec`, `privileged`) for a vLLM worker pod.
    const CRIO_INFO: &str = include_str!("testdata/crio-1.30-status-info.json");
    const CONTAINER_ID: &str = "f6edb4757761f1cdcc5f9555deae62baaf35b185ce8f8d280915b58defe77cd6";

    fn info_map(json: &str) -> HashMap<String, String> {
        HashMap::from([(INFO_KEY.to_owned(), json.to_owned())])
    }

    fn with_pid(json: &str, pid: i64) -> String {
        let mut value: serde_json::Value = serde_json::from_str(json).unwrap();
        value["pid"] = serde_json::Value::from(pid);
        value.to_string()
    }

    fn response(info: HashMap<String, String>, state: ContainerState) -> ContainerStatusResponse {
        ContainerStatusResponse {
            status: Some(ContainerStatus {
                id: CONTAINER_ID.to_owned(),
                state: state as i32,
                image: Some(ImageSpec {
                    image: "docker.io/library/busybox:1.36".to_owned(),
                    ..ImageSpec::default()
                }),
                image_ref: "docker.io/library/busybox@sha256:0123".to_owned(),
                ..ContainerStatus::default()
            }),
            info,
        }
    }

    #[test]
    fn parses_containerd_shape() {
        let info = parse_verbose_info(CONTAINER_ID, &info_map(CONTAINERD_INFO)).unwrap();
        assert_eq!(info.flavor, CriFlavor::Containerd);
        assert_eq!(info.pid, 3373);
        assert_eq!(
            info.sandbox_id.as_deref(),
            Some("6116db96faf898d54b1f8fb73fffed7bce7e3013e1b2368b41732c077d9eac68")
        );
        assert_eq!(info.snapshotter.as_deref(), Some("overlayfs"));
        assert!(info.snapshot_key.is_some());
        assert_eq!(info.root_path.as_deref(), Some("rootfs"));
        assert!(info.has_spec);
        assert_eq!(info.mounts.len(), 11);
        let data = info
            .mounts
            .iter()
            .find(|m| m.destination == "/data")
            .unwrap();
        assert!(data.is_bind());
        assert_eq!(
            data.source,
            "/var/lib/kubelet/pods/6f1c2a59-1b7e-4d0c-9d0e-3f5e2b7a9c10/volumes/kubernetes.io~empty-dir/data"
        );
        let shm = info
            .mounts
            .iter()
            .find(|m| m.destination == "/dev/shm")
            .unwrap();
        assert!(
            shm.is_bind(),
            "CRI's /dev/shm is a bind of the sandbox's shm"
        );
        let proc_mount = info
            .mounts
            .iter()
            .find(|m| m.destination == "/proc")
            .unwrap();
        assert_eq!(proc_mount.kind, "proc");
        assert!(!proc_mount.is_bind());
        assert_eq!(info.masked_paths.len(), 10);
        assert_eq!(info.masked_paths[2], "/proc/kcore");

        let candidates = info.rootfs_candidates(CONTAINER_ID, &CriOptions::default());
        assert_eq!(
            candidates,
            vec![PathBuf::from(format!(
                "/run/containerd/io.containerd.runtime.v2.task/k8s.io/{CONTAINER_ID}/rootfs"
            ))]
        );
        let private = CriOptions {
            containerd_state_dir: PathBuf::from("/host/run/containerd"),
            ..CriOptions::default()
        };
        assert_eq!(
            info.rootfs_candidates(CONTAINER_ID, &private)[0],
            PathBuf::from(format!(
                "/host/run/containerd/io.containerd.runtime.v2.task/k8s.io/{CONTAINER_ID}/rootfs"
            ))
        );
    }

    #[test]
    fn parses_crio_shape() {
        let info = parse_verbose_info("c0ffee", &info_map(CRIO_INFO)).unwrap();
        assert_eq!(info.flavor, CriFlavor::CriO);
        assert_eq!(info.pid, 48213);
        assert_eq!(info.snapshot_key, None);
        let merged = "/var/lib/containers/storage/overlay/\
                      5e1a3f9b7c2d4e6f8a0b1c3d5e7f9a2b4c6d8e0f1a3b5c7d9e2f4a6b8c0d1e3f/merged";
        assert_eq!(info.root_path.as_deref(), Some(merged));
        // CRI-O's root is absolute: the only candidate, whatever containerd's state dir.
        assert_eq!(
            info.rootfs_candidates("c0ffee", &CriOptions::default()),
            vec![PathBuf::from(merged)]
        );
        let models = info
            .mounts
            .iter()
            .find(|m| m.destination == "/models")
            .unwrap();
        assert!(models.is_bind());
        assert!(models.options.iter().any(|o| o == "ro"));
        assert!(
            models
                .source
                .ends_with("/volumes/kubernetes.io~csi/pvc-0a1b2c3d/mount")
        );
        assert_eq!(
            info.mounts.iter().filter(|m| m.is_bind()).count(),
            9,
            "{:?}",
            info.mounts
        );
        assert!(info.masked_paths.iter().any(|p| p == "/proc/interrupts"));
    }

    #[test]
    fn flavor_by_field_presence() {
        let bare = r#"{"pid": 7, "runtimeSpec": {"root": {"path": "rootfs"}}}"#;
        let info = parse_verbose_info("x", &info_map(bare)).unwrap();
        assert_eq!(info.flavor, CriFlavor::Unknown);
        // Unknown with a relative root: treated like containerd's bundle layout.
        assert_eq!(info.rootfs_candidates("x", &CriOptions::default()).len(), 1);
        let absolute = r#"{"pid": 7, "runtimeSpec": {"root": {"path": "/x/merged"}}}"#;
        let info = parse_verbose_info("x", &info_map(absolute)).unwrap();
        assert_eq!(info.flavor, CriFlavor::CriO);
        let no_spec = r#"{"pid": 7, "snapshotKey": "k"}"#;
        let info = parse_verbose_info("x", &info_map(no_spec)).unwrap();
        assert_eq!(info.flavor, CriFlavor::Containerd);
        assert!(!info.has_spec);
        assert!(info.mounts.is_empty());
    }

    #[test]
    fn info_under_another_key_or_missing_or_malformed() {
        let other = HashMap::from([
            ("version".to_owned(), "\"1.2.3\"".to_owned()),
            ("details".to_owned(), CRIO_INFO.to_owned()),
        ]);
        assert_eq!(parse_verbose_info("x", &other).unwrap().pid, 48213);

        let none = HashMap::from([("version".to_owned(), "1".to_owned())]);
        let err = parse_verbose_info("x", &none).unwrap_err();
        assert!(matches!(err, ResolveError::Runtime { .. }), "{err}");
        assert!(err.to_string().contains("verbose"), "{err}");

        let err = parse_verbose_info("x", &info_map("{not json")).unwrap_err();
        assert!(matches!(err, ResolveError::Parse { .. }), "{err}");

        let err = parse_verbose_info("x", &info_map(r#"{"pid": 99999999999}"#)).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    }

    #[test]
    fn stopped_container_keeps_its_candidate_rootfs() {
        let info = container_info_from_status(
            CONTAINER_ID,
            &response(
                info_map(&with_pid(CONTAINERD_INFO, 0)),
                ContainerState::ContainerExited,
            ),
            &CriOptions::default(),
        )
        .unwrap();
        assert!(!info.running);
        assert_eq!(info.pid, 0);
        assert_eq!(info.runtime, RuntimeKind::Cri);
        assert_eq!(info.uri(), format!("cri://{CONTAINER_ID}"));
        assert!(
            info.rootfs
                .ends_with(format!("k8s.io/{CONTAINER_ID}/rootfs"))
        );
        assert_eq!(info.upper_dir, None);
        assert_eq!(info.image, "docker.io/library/busybox:1.36");
        assert_eq!(info.masked_paths.len(), 10);
        assert!(info.mount_at("/data/").is_some());
    }

    #[test]
    fn image_falls_back_to_image_ref() {
        let mut resp = response(
            info_map(&with_pid(CRIO_INFO, 0)),
            ContainerState::ContainerCreated,
        );
        if let Some(status) = resp.status.as_mut() {
            status.image = None;
        }
        let info = container_info_from_status("c0ffee", &resp, &CriOptions::default()).unwrap();
        assert_eq!(info.image, "docker.io/library/busybox@sha256:0123");
        assert!(info.rootfs.ends_with("merged"));
    }

    #[test]
    fn no_spec_falls_back_to_cri_mounts() {
        let mut resp = response(
            info_map(r#"{"pid": 0, "snapshotKey": "k"}"#),
            ContainerState::ContainerExited,
        );
        if let Some(status) = resp.status.as_mut() {
            status.mounts = vec![k8s_cri::v1::Mount {
                container_path: "/models".to_owned(),
                host_path: "/mnt/models".to_owned(),
                readonly: true,
                ..k8s_cri::v1::Mount::default()
            }];
        }
        let info = container_info_from_status("abc", &resp, &CriOptions::default()).unwrap();
        let models = info.mount_at("/models").unwrap();
        assert_eq!(models.source, "/mnt/models");
        assert!(models.is_bind());
        assert_eq!(models.options, ["rbind", "ro"]);
    }

    #[test]
    fn running_container_rootfs_found_through_the_mount_table() {
        // This test process stands in for the container: no candidate path exists, so the
        // resolver must find the mount of its root device in its own mount table: `/`.
        let pid = i64::from(std::process::id());
        let info = container_info_from_status(
            CONTAINER_ID,
            &response(
                info_map(&with_pid(CONTAINERD_INFO, pid)),
                ContainerState::ContainerRunning,
            ),
            &CriOptions {
                containerd_state_dir: PathBuf::from("/nonexistent-warmstart-state"),
                ..CriOptions::default()
            },
        )
        .unwrap();
        assert!(info.running);
        assert_eq!(info.rootfs, PathBuf::from("/"));
    }

    #[test]
    fn candidate_on_another_device_is_rejected() {
        // A candidate that exists but is not the container's root (here /proc, another device
        // than this process's root) must not be taken: restore would write into the wrong place.
        let pid = i32::try_from(std::process::id()).unwrap();
        let found = find_running_rootfs("x", pid, None, &[PathBuf::from("/proc")]);
        let err = found.unwrap_err();
        assert!(matches!(err, ResolveError::NoRootfs { .. }), "{err}");
        assert!(err.to_string().contains("/proc is on device"), "{err}");
        assert!(err.to_string().contains("HostToContainer"), "{err}");
        assert_eq!(
            find_running_rootfs(
                "x",
                pid,
                None,
                &[PathBuf::from("/proc"), PathBuf::from("/")]
            )
            .unwrap(),
            PathBuf::from("/")
        );
    }

    #[test]
    fn references() {
        assert_eq!(validate_reference("cri://abc123").unwrap(), "abc123");
        assert_eq!(validate_reference("abc123").unwrap(), "abc123");
        for bad in ["", "cri://", "../etc", "..", ".hidden", "a b", "a/b"] {
            assert!(
                matches!(validate_reference(bad), Err(ResolveError::InvalidId(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn device_numbers_split_like_the_kernel() {
        // makedev(259, 3) and makedev(0, 1234) as glibc encodes them.
        let dev = (259u64 << 8) | 3;
        assert_eq!((dev_major(dev), dev_minor(dev)), (259, 3));
        let dev = ((1234u64 & 0xff) | ((1234u64 & !0xff) << 12)) & 0xffff_ffff;
        assert_eq!((dev_major(dev), dev_minor(dev)), (0, 1234));
    }

    #[test]
    fn connect_to_a_missing_socket_fails_with_the_path() {
        let err = resolve_blocking_with(
            Path::new("/nonexistent-warmstart/cri.sock"),
            "abc",
            &CriOptions {
                timeout: Duration::from_secs(2),
                ..CriOptions::default()
            },
        )
        .unwrap_err();
        assert!(matches!(err, ResolveError::Runtime { .. }), "{err}");
        assert!(
            err.to_string().contains("/nonexistent-warmstart/cri.sock"),
            "{err}"
        );
    }
}
