//! A pod's volumes as host directories, and a container's volume mounts as bind mounts.
//!
//! | volume                  | host directory                                                  |
//! |-------------------------|-----------------------------------------------------------------|
//! | `emptyDir`              | `<pod dir>/volumes/kubernetes.io~empty-dir/<volume>` (the kubelet's layout) (mode 0777; also for `medium: Memory`: no tmpfs, no size limit) |
//! | `hostPath`              | `<host root>/<path>`: never the real host path                   |
//! | `persistentVolumeClaim` | `<pvc root>/<namespace>/<claim name>` (created when missing)     |
//! | `configMap`, `secret`, `downwardAPI`, `projected` | `<pod dir>/volumes/<kind>/<volume>`, files written by the node, mounted read-only |
//!
//! `projected` supports the `configMap`, `secret`, `downwardAPI` and `serviceAccountToken`
//! (a fixed placeholder token) sources. Other volume types are refused.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, DownwardAPIVolumeFile, KeyToPath, Pod, Volume};

use crate::fixture::BindMount;

use super::env::{PodFacts, Sources, expand_with, field_ref};

/// The token written for a `serviceAccountToken` projection: not a real credential.
pub(crate) const PLACEHOLDER_TOKEN: &str = "warmstart-node-simulator-placeholder-token";

/// Where the node keeps a pod's volumes, and where `hostPath` and PVC volumes live.
#[derive(Debug, Clone)]
pub(crate) struct VolumeRoots {
    /// The pod's directory (`<state dir>/pods/<uid>`).
    pub(crate) pod_dir: PathBuf,
    /// The directory standing in for the host's `/` for `hostPath` volumes.
    pub(crate) host_root: PathBuf,
    /// The directory holding one directory per claim, by namespace.
    pub(crate) pvc_root: PathBuf,
}

/// A volume ready to be mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VolumeDir {
    /// The host path.
    pub(crate) path: PathBuf,
    /// Whether every mount of it is read-only (files the node writes; a read-only claim).
    pub(crate) read_only: bool,
}

/// The host directories of a pod's volumes, by volume name.
pub(crate) type PodVolumes = BTreeMap<String, VolumeDir>;

/// Creates the host side of every volume of `pod` and writes the files of ConfigMap, Secret,
/// Downward API and projected volumes.
///
/// # Errors
/// An unsupported volume type, a missing non-optional ConfigMap, Secret or key, an unusable
/// `hostPath`, or a file-system error (the kubelet's `FailedMount`).
pub(crate) fn prepare(
    pod: &Pod,
    roots: &VolumeRoots,
    facts: &PodFacts,
    sources: &Sources,
) -> Result<PodVolumes, String> {
    let mut volumes = PodVolumes::new();
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let dir = prepare_one(pod, volume, namespace, roots, facts, sources)
            .map_err(|e| format!("volume {:?}: {e}", volume.name))?;
        volumes.insert(volume.name.clone(), dir);
    }
    Ok(volumes)
}

fn prepare_one(
    pod: &Pod,
    volume: &Volume,
    namespace: &str,
    roots: &VolumeRoots,
    facts: &PodFacts,
    sources: &Sources,
) -> Result<VolumeDir, String> {
    let own = |kind: &str| roots.pod_dir.join("volumes").join(kind).join(&volume.name);
    if volume.empty_dir.is_some() {
        let path = own(warmstart_shared::names::KUBELET_EMPTY_DIR_PLUGIN);
        make_dir(&path, 0o777)?;
        return Ok(VolumeDir {
            path,
            read_only: false,
        });
    }
    if let Some(host) = &volume.host_path {
        let path = host_path(&roots.host_root, &host.path)?;
        prepare_host_path(&path, host.type_.as_deref().unwrap_or_default())?;
        return Ok(VolumeDir {
            path,
            read_only: false,
        });
    }
    if let Some(claim) = &volume.persistent_volume_claim {
        let name = single_component(&claim.claim_name, "claim name")?;
        let path = roots.pvc_root.join(namespace).join(name);
        make_dir(&path, 0o777)?;
        return Ok(VolumeDir {
            path,
            read_only: claim.read_only == Some(true),
        });
    }
    let mut files = Vec::new();
    let kind = if let Some(cm) = &volume.config_map {
        let mode = cm.default_mode.unwrap_or(0o644);
        match sources.config_map(&cm.name) {
            Ok(data) => key_files(&data, cm.items.as_deref(), mode, &mut files)?,
            Err(_) if cm.optional == Some(true) => {}
            Err(e) => return Err(e),
        }
        "configmap"
    } else if let Some(secret) = &volume.secret {
        let mode = secret.default_mode.unwrap_or(0o644);
        let name = secret.secret_name.clone().unwrap_or_default();
        match sources.secret(&name) {
            Ok(data) => key_files(&data, secret.items.as_deref(), mode, &mut files)?,
            Err(_) if secret.optional == Some(true) => {}
            Err(e) => return Err(e),
        }
        "secret"
    } else if let Some(downward) = &volume.downward_api {
        let mode = downward.default_mode.unwrap_or(0o644);
        downward_files(pod, facts, downward.items.as_deref(), mode, &mut files)?;
        "downward-api"
    } else if let Some(projected) = &volume.projected {
        let mode = projected.default_mode.unwrap_or(0o644);
        for source in projected.sources.iter().flatten() {
            if let Some(cm) = &source.config_map {
                match sources.config_map(&cm.name) {
                    Ok(data) => key_files(&data, cm.items.as_deref(), mode, &mut files)?,
                    Err(_) if cm.optional == Some(true) => {}
                    Err(e) => return Err(e),
                }
            } else if let Some(secret) = &source.secret {
                match sources.secret(&secret.name) {
                    Ok(data) => key_files(&data, secret.items.as_deref(), mode, &mut files)?,
                    Err(_) if secret.optional == Some(true) => {}
                    Err(e) => return Err(e),
                }
            } else if let Some(downward) = &source.downward_api {
                downward_files(pod, facts, downward.items.as_deref(), mode, &mut files)?;
            } else if let Some(token) = &source.service_account_token {
                files.push(File {
                    path: token.path.clone(),
                    contents: PLACEHOLDER_TOKEN.as_bytes().to_vec(),
                    mode: 0o600,
                });
            } else {
                return Err("unsupported projected source".to_owned());
            }
        }
        "projected"
    } else {
        return Err(
            "unsupported volume type (the node simulator supports emptyDir, hostPath, \
                    persistentVolumeClaim, configMap, secret, downwardAPI and projected)"
                .to_owned(),
        );
    };
    let path = own(kind);
    make_dir(&path, 0o755)?;
    write_files(&path, &files)?;
    Ok(VolumeDir {
        path,
        read_only: true,
    })
}

/// Rewrites the files of the pod's Downward API volumes (and projections) whose content changed,
/// as the kubelet does when labels or annotations change.
///
/// # Errors
/// A file-system error or an unsupported field.
pub(crate) fn refresh_downward_api(
    pod: &Pod,
    volumes: &PodVolumes,
    facts: &PodFacts,
) -> Result<(), String> {
    for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let Some(dir) = volumes.get(&volume.name) else {
            continue;
        };
        let mut files = Vec::new();
        if let Some(downward) = &volume.downward_api {
            let mode = downward.default_mode.unwrap_or(0o644);
            downward_files(pod, facts, downward.items.as_deref(), mode, &mut files)?;
        } else if let Some(projected) = &volume.projected {
            let mode = projected.default_mode.unwrap_or(0o644);
            for source in projected.sources.iter().flatten() {
                if let Some(downward) = &source.downward_api {
                    downward_files(pod, facts, downward.items.as_deref(), mode, &mut files)?;
                }
            }
        }
        files.retain(|file| {
            fs::read(dir.path.join(&file.path)).map_or(true, |old| old != file.contents)
        });
        write_files(&dir.path, &files)?;
    }
    Ok(())
}

/// A file of a ConfigMap, Secret, Downward API or projected volume.
#[derive(Debug, Clone, PartialEq, Eq)]
struct File {
    /// Relative path inside the volume.
    path: String,
    contents: Vec<u8>,
    mode: u32,
}

/// The files of a ConfigMap's or Secret's `data`: every key, or the listed `items`.
fn key_files(
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    mode: i32,
    files: &mut Vec<File>,
) -> Result<(), String> {
    match items {
        None => {
            for (key, contents) in data {
                files.push(File {
                    path: key.clone(),
                    contents: contents.clone(),
                    mode: file_mode(mode),
                });
            }
        }
        Some(items) => {
            for item in items {
                let contents = data
                    .get(&item.key)
                    .ok_or_else(|| format!("key {:?} not found", item.key))?;
                files.push(File {
                    path: item.path.clone(),
                    contents: contents.clone(),
                    mode: file_mode(item.mode.unwrap_or(mode)),
                });
            }
        }
    }
    Ok(())
}

/// The files of a Downward API volume.
fn downward_files(
    pod: &Pod,
    facts: &PodFacts,
    items: Option<&[DownwardAPIVolumeFile]>,
    mode: i32,
    files: &mut Vec<File>,
) -> Result<(), String> {
    for item in items.into_iter().flatten() {
        let contents = match (&item.field_ref, &item.resource_field_ref) {
            (Some(field), _) => field_ref(pod, facts, &field.field_path)?,
            (None, Some(_)) => {
                return Err(format!(
                    "{}: resourceFieldRef is not supported by the node simulator",
                    item.path
                ));
            }
            (None, None) => String::new(),
        };
        files.push(File {
            path: item.path.clone(),
            contents: contents.into_bytes(),
            mode: file_mode(item.mode.unwrap_or(mode)),
        });
    }
    Ok(())
}

/// The permission bits of a Kubernetes `mode` (only the low 9 bits count).
fn file_mode(mode: i32) -> u32 {
    u32::try_from(mode).unwrap_or(0o644) & 0o777
}

/// Writes `files` under `dir`: each to a temporary name, then renamed into place.
fn write_files(dir: &Path, files: &[File]) -> Result<(), String> {
    for file in files {
        let relative = relative_path(&file.path, "file path")?;
        let path = dir.join(relative);
        if let Some(parent) = path.parent() {
            make_dir(parent, 0o755)?;
        }
        let temp = path.with_file_name(format!(
            ".tmp-{}",
            path.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        ));
        fs::write(&temp, &file.contents).map_err(|e| format!("write {}: {e}", temp.display()))?;
        fs::set_permissions(&temp, fs::Permissions::from_mode(file.mode))
            .map_err(|e| format!("chmod {}: {e}", temp.display()))?;
        fs::rename(&temp, &path)
            .map_err(|e| format!("rename {} to {}: {e}", temp.display(), path.display()))?;
    }
    Ok(())
}

/// Where the node keeps `hostPath` `path`: under `host_root`, never on the real host (tests must
/// not write into the machine's `/var/lib`).
///
/// # Errors
/// `path` is not absolute or contains `..`.
pub(crate) fn host_path(host_root: &Path, path: &str) -> Result<PathBuf, String> {
    if !path.starts_with('/') {
        return Err(format!("hostPath {path:?} is not absolute"));
    }
    let relative = relative_path(path.trim_start_matches('/'), "hostPath")?;
    Ok(host_root.join(relative))
}

/// Checks a `hostPath` volume's `type`, creating what `DirectoryOrCreate`, `FileOrCreate` (and,
/// as container runtimes do for a bind source, an unset type) create.
fn prepare_host_path(path: &Path, kind: &str) -> Result<(), String> {
    let meta = match fs::metadata(path) {
        Ok(meta) => Some(meta),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("inspect {}: {e}", path.display())),
    };
    let wrong = |what: &str| Err(format!("hostPath {} is not {what}", path.display()));
    match (kind, meta) {
        ("" | "DirectoryOrCreate", None) => make_dir(path, 0o755),
        ("FileOrCreate", None) => {
            if let Some(parent) = path.parent() {
                make_dir(parent, 0o755)?;
            }
            fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map(drop)
                .map_err(|e| format!("create {}: {e}", path.display()))
        }
        ("DirectoryOrCreate" | "Directory", Some(meta)) if !meta.is_dir() => wrong("a directory"),
        ("FileOrCreate" | "File", Some(meta)) if !meta.is_file() => wrong("a file"),
        ("Socket", Some(meta)) if !meta.file_type().is_socket() => wrong("a socket"),
        ("CharDevice", Some(meta)) if !meta.file_type().is_char_device() => {
            wrong("a character device")
        }
        ("BlockDevice", Some(meta)) if !meta.file_type().is_block_device() => {
            wrong("a block device")
        }
        (
            "" | "DirectoryOrCreate" | "Directory" | "FileOrCreate" | "File" | "Socket"
            | "CharDevice" | "BlockDevice",
            Some(_),
        ) => Ok(()),
        ("Directory" | "File" | "Socket" | "CharDevice" | "BlockDevice", None) => Err(format!(
            "hostPath {} does not exist (type {kind})",
            path.display()
        )),
        (other, _) => Err(format!("unknown hostPath type {other:?}")),
    }
}

/// The bind mounts of `container`'s volume mounts: `subPath`, or `subPathExpr` expanded with the
/// container's environment, selects (and creates, as the kubelet does) a directory inside the
/// volume. Sorted so that a mount comes after the mounts of its parents.
///
/// # Errors
/// A mount of an unknown volume, both `subPath` and `subPathExpr`, an absolute sub-path or one
/// with `..`, or a directory that cannot be created.
pub(crate) fn container_mounts(
    container: &Container,
    volumes: &PodVolumes,
    env: &[(String, String)],
) -> Result<Vec<BindMount>, String> {
    let mut mounts = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let volume = volumes.get(&mount.name).ok_or_else(|| {
            format!(
                "volume mount {:?}: no volume named {:?}",
                mount.mount_path, mount.name
            )
        })?;
        let sub_path = match (&mount.sub_path, &mount.sub_path_expr) {
            (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => {
                return Err(format!(
                    "volume mount {:?}: subPath and subPathExpr are mutually exclusive",
                    mount.mount_path
                ));
            }
            (_, Some(expr)) if !expr.is_empty() => expand_with(expr, env),
            (Some(path), _) => path.clone(),
            _ => String::new(),
        };
        let source = if sub_path.is_empty() {
            volume.path.clone()
        } else {
            let relative = relative_path(&sub_path, "subPath")
                .map_err(|e| format!("volume mount {:?}: {e}", mount.mount_path))?;
            let path = volume.path.join(relative);
            if !path.exists() {
                make_dir(&path, 0o777)?;
            }
            path
        };
        mounts.push(BindMount {
            source,
            destination: mount.mount_path.clone(),
            readonly: volume.read_only || mount.read_only == Some(true),
        });
    }
    mounts.sort_by_key(|m| Path::new(&m.destination).components().count());
    Ok(mounts)
}

/// `path` as a relative path without `..` (a sub-path, a file of a volume).
fn relative_path<'a>(path: &'a str, what: &str) -> Result<&'a Path, String> {
    let relative = Path::new(path);
    let ok = !path.is_empty()
        && relative
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if ok {
        Ok(relative)
    } else {
        Err(format!("{what} {path:?} must be relative and without `..`"))
    }
}

/// `name` when it is a single path component.
fn single_component<'a>(name: &'a str, what: &str) -> Result<&'a str, String> {
    if !name.is_empty() && name != "." && name != ".." && !name.contains('/') {
        Ok(name)
    } else {
        Err(format!("invalid {what} {name:?}"))
    }
}

/// Creates `path` and its missing parents; `path` itself gets `mode` (not subject to the umask).
fn make_dir(path: &Path, mode: u32) -> Result<(), String> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(path)
        .and_then(|()| fs::set_permissions(path, fs::Permissions::from_mode(mode)))
        .map_err(|e| format!("create directory {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn facts() -> PodFacts {
        PodFacts {
            node_name: "n".to_owned(),
            pod_ip: "127.0.0.1".to_owned(),
            host_ip: "127.0.0.1".to_owned(),
        }
    }

    #[test]
    fn prepares_every_supported_volume_and_mounts_sub_paths() {
        let root = tempfile::tempdir().unwrap();
        let roots = VolumeRoots {
            pod_dir: root.path().join("pod"),
            host_root: root.path().join("host"),
            pvc_root: root.path().join("pvc"),
        };
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"a": "b"}},
            "spec": {
                "containers": [{"name": "c", "volumeMounts": [
                    {"name": "scratch", "mountPath": "/scratch"},
                    {"name": "signals", "mountPath": "/sig", "subPathExpr": "$(UID)"},
                    {"name": "info", "mountPath": "/etc/podinfo"},
                    {"name": "cfg", "mountPath": "/etc/cfg/one", "subPath": "one"},
                    {"name": "data", "mountPath": "/data", "readOnly": true},
                ]}],
                "volumes": [
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "signals", "hostPath": {"path": "/var/lib/x/signals", "type": "DirectoryOrCreate"}},
                    {"name": "info", "downwardAPI": {"items": [
                        {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
                        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    ]}},
                    {"name": "cfg", "configMap": {"name": "cm", "items": [{"key": "k", "path": "one"}]}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "claim"}},
                    {"name": "opt", "secret": {"secretName": "gone", "optional": true}},
                ],
            },
        }))
        .unwrap();
        let mut sources = Sources::default();
        sources.config_maps.insert(
            "cm".to_owned(),
            Some(
                serde_json::from_value(json!({"metadata": {"name": "cm"}, "data": {"k": "v"}}))
                    .unwrap(),
            ),
        );
        let volumes = prepare(&pod, &roots, &facts(), &sources).unwrap();
        let signals = root.path().join("host/var/lib/x/signals");
        assert_eq!(volumes["signals"].path, signals);
        assert!(signals.is_dir());
        let info = &volumes["info"];
        assert!(info.read_only);
        assert_eq!(fs::read_to_string(info.path.join("name")).unwrap(), "p");
        assert_eq!(
            fs::read_to_string(info.path.join("labels")).unwrap(),
            "a=\"b\"\n"
        );
        assert_eq!(
            fs::read_to_string(volumes["cfg"].path.join("one")).unwrap(),
            "v"
        );
        assert_eq!(volumes["data"].path, root.path().join("pvc/ns/claim"));

        let container = &pod.spec.as_ref().unwrap().containers[0];
        let env = vec![("UID".to_owned(), "u1".to_owned())];
        let mounts = container_mounts(container, &volumes, &env).unwrap();
        let by_dest: BTreeMap<_, _> = mounts.iter().map(|m| (m.destination.as_str(), m)).collect();
        assert_eq!(by_dest["/sig"].source, signals.join("u1"));
        assert!(signals.join("u1").is_dir());
        assert!(!by_dest["/sig"].readonly);
        assert!(by_dest["/data"].readonly);
        assert_eq!(
            by_dest["/etc/cfg/one"].source,
            volumes["cfg"].path.join("one")
        );
        assert_eq!(mounts.last().unwrap().destination, "/etc/cfg/one");

        let mut relabelled = pod.clone();
        relabelled.metadata.labels = Some(BTreeMap::from([("a".to_owned(), "c".to_owned())]));
        refresh_downward_api(&relabelled, &volumes, &facts()).unwrap();
        assert_eq!(
            fs::read_to_string(info.path.join("labels")).unwrap(),
            "a=\"c\"\n"
        );
    }

    #[test]
    fn refuses_escapes_missing_sources_and_unknown_types() {
        let root = tempfile::tempdir().unwrap();
        let roots = VolumeRoots {
            pod_dir: root.path().join("pod"),
            host_root: root.path().join("host"),
            pvc_root: root.path().join("pvc"),
        };
        assert!(host_path(&roots.host_root, "/a/../../etc").is_err());
        assert!(host_path(&roots.host_root, "relative").is_err());
        let pod = |volume: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [], "volumes": [volume]},
            }))
            .unwrap()
        };
        let sources = Sources::default();
        for (volume, needle) in [
            (
                json!({"name": "v", "configMap": {"name": "cm"}}),
                "configmap \"cm\" not found",
            ),
            (
                json!({"name": "v", "hostPath": {"path": "/nope", "type": "Directory"}}),
                "does not exist",
            ),
            (
                json!({"name": "v", "nfs": {"server": "s", "path": "/"}}),
                "unsupported volume type",
            ),
        ] {
            let error = prepare(&pod(volume), &roots, &facts(), &sources).unwrap_err();
            assert!(error.contains(needle), "{error}");
        }
        let container: Container = serde_json::from_value(json!({
            "name": "c", "volumeMounts": [{"name": "v", "mountPath": "/x", "subPath": "../up"}],
        }))
        .unwrap();
        let volumes = PodVolumes::from([(
            "v".to_owned(),
            VolumeDir {
                path: root.path().to_owned(),
                read_only: false,
            },
        )]);
        assert!(container_mounts(&container, &volumes, &[]).is_err());
    }
}
