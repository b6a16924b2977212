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
//! namespace, never as `/proc/<pid>/root` (CRIU cannot restore into that path). For a running container a candidate path is accepted only
//! when it is the same filesystem as the container's root (same device number); when no candidate
//! is, the agent's `/proc/self/mountinfo` is searched for the mount of the container's root
//! device, which also finds it under a containerd state directory this resolver was not told about.

mod client;
mod info;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_cri::v1::{ContainerState, ContainerStatusResponse};

use super::mountinfo::{self, MountInfo};
use super::{ContainerInfo, ResolveError, RuntimeKind, RuntimeMount};

pub use client::CriClient;
pub use info::{CriFlavor, VerboseInfo, parse_verbose_info};

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
    /// The kubelet's PodResources socket, asked which devices a pod's container was allocated;
    /// `None` asks nothing (not a Kubernetes node).
    pub pod_resources: Option<PathBuf>,
}

impl Default for CriOptions {
    fn default() -> Self {
        Self {
            containerd_state_dir: PathBuf::from(CONTAINERD_STATE_DIR),
            containerd_namespace: CONTAINERD_CRI_NAMESPACE.to_owned(),
            timeout: Duration::from_secs(10),
            pod_resources: None,
        }
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
        gpus: crate::runtime::gpus::RuntimeGpus {
            pod: pod_container(&status.labels),
            allocation: crate::runtime::gpus::Allocation::default(),
            cdi_devices: {
                let mut names = verbose.cdi_devices.clone();
                names.extend(cdi_annotation_devices(&status.annotations));
                names.sort();
                names.dedup();
                names
            },
        },
    })
}

/// The pod container the kubelet's labels on a CRI container name.
pub fn pod_container(
    labels: &HashMap<String, String>,
) -> Option<crate::podresources::PodContainer> {
    let label = |key: &str| labels.get(key).filter(|v| !v.is_empty()).cloned();
    Some(crate::podresources::PodContainer {
        namespace: label("io.kubernetes.pod.namespace")?,
        pod: label("io.kubernetes.pod.name")?,
        container: label("io.kubernetes.container.name")?,
    })
}

/// The CDI device names in `cdi.k8s.io/*` annotations (comma-separated values).
pub fn cdi_annotation_devices(annotations: &HashMap<String, String>) -> Vec<String> {
    let mut names: Vec<String> = annotations
        .iter()
        .filter(|(key, _)| key.starts_with(crate::runtime::gpus::CDI_ANNOTATION_PREFIX))
        .flat_map(|(_, value)| value.split(','))
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect();
    names.sort();
    names
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
