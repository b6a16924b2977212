//! The verbose `ContainerStatus` info of containerd and CRI-O, parsed into what resolution
//! needs.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Deserialize;

use super::{ResolveError, RuntimeMount};

use super::*;

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
    /// CDI device names from the CRI config (`CDI_devices`, containerd) and the OCI spec's
    /// `cdi.k8s.io/*` annotations.
    pub cdi_devices: Vec<String>,
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
    /// containerd: the CRI container config as the kubelet sent it.
    #[serde(default)]
    config: Option<serde_json::Value>,
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
    #[serde(default)]
    annotations: Option<HashMap<String, String>>,
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
        let mut cdi_devices: Vec<String> = raw
            .config
            .as_ref()
            .and_then(|c| c.get("CDI_devices"))
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|d| d.get("name").and_then(serde_json::Value::as_str))
            .map(str::to_owned)
            .collect();
        if let Some(annotations) = raw
            .runtime_spec
            .as_ref()
            .and_then(|s| s.annotations.as_ref())
        {
            cdi_devices.extend(super::cdi_annotation_devices(annotations));
        }
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
            cdi_devices,
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
