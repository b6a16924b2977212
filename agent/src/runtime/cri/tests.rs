//! Tests of parsing and resolution against recorded runtime answers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_cri::v1::{ContainerState, ContainerStatusResponse};

use super::{ResolveError, RuntimeKind};

use super::info::*;
use super::*;
use k8s_cri::v1::{ContainerStatus, ImageSpec};

/// A real containerd 1.6.20 answer (captured by `tests/cri_containerd.rs`), paths rewritten
/// to a production node's (`/var/lib/containerd`, `/run/containerd`, kubelet's pod dir).
const CONTAINERD_INFO: &str = include_str!("../testdata/containerd-1.6-status-info.json");
/// CRI-O's shape (`sandboxID`, `pid`, `runtimeSpec`, `privileged`) for a vLLM worker pod.
const CRIO_INFO: &str = include_str!("../testdata/crio-1.30-status-info.json");
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

#[test]
fn cdi_devices_come_from_the_cri_config_and_the_specs_annotations() {
    let text = r#"{"pid": 7, "snapshotKey": "k",
        "config": {"CDI_devices": [{"name": "nvidia.com/gpu=GPU-a"}]},
        "runtimeSpec": {"root": {"path": "rootfs"}, "annotations": {
            "cdi.k8s.io/nvidia-device-plugin_x": "nvidia.com/gpu=1,nvidia.com/gpu=2",
            "io.kubernetes.cri.container-type": "container"}}}"#;
    let info = parse_verbose_info("x", &info_map(text)).unwrap();
    assert_eq!(
        info.cdi_devices,
        [
            "nvidia.com/gpu=GPU-a",
            "nvidia.com/gpu=1",
            "nvidia.com/gpu=2"
        ]
    );
}

#[test]
fn the_kubelets_labels_name_the_pod_container() {
    let labels: HashMap<String, String> = [
        ("io.kubernetes.pod.namespace", "ml"),
        ("io.kubernetes.pod.name", "llama-0"),
        ("io.kubernetes.container.name", "worker"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let pod = pod_container(&labels).unwrap();
    assert_eq!(pod.to_string(), "ml/llama-0 container worker");
    let mut partial = labels.clone();
    partial.remove("io.kubernetes.container.name");
    assert_eq!(pod_container(&partial), None);
}
