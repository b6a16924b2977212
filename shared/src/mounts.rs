//! The volumes and mounts warmstart adds to a target container, identical in checkpoint Job
//! pods and restore pods (mount parity, docs/architecture.md "The two flows"): the signal emptyDir at [`names::MOUNT_SIGNAL`], the Downward API pod-info volume at
//! [`names::MOUNT_POD_INFO`] (read-only) and the control emptyDir at [`names::MOUNT_CONTROL`]
//! (`subPath: <container>`).
//!
//! Why parity: CRIU restores a process with the mounts it had at dump time, so a restored
//! process finds every directory it had in the checkpoint pod, and the engine refuses a
//! placeholder that lacks one. Each pod gets its own, new and empty signal and control
//! directories (emptyDir), so nothing of the source pod's signals is seen in the restored one.
//!
//! Invariants: the same container name gives the same mounts in both builders; no hostPath.

use k8s_openapi::api::core::v1::{
    DownwardAPIVolumeFile, DownwardAPIVolumeSource, EmptyDirVolumeSource, ObjectFieldSelector,
    Volume, VolumeMount,
};

use crate::names;

/// API version of Downward API field selectors (what the API server defaults them to).
const FIELD_API_VERSION: &str = "v1";
/// Downward API field of the pod's labels.
pub(crate) const FIELD_LABELS: &str = "metadata.labels";
/// Downward API field of the pod's annotations.
pub(crate) const FIELD_ANNOTATIONS: &str = "metadata.annotations";
/// Downward API field of the pod's name.
pub(crate) const FIELD_NAME: &str = "metadata.name";
/// Downward API field of the pod's namespace.
pub(crate) const FIELD_NAMESPACE: &str = "metadata.namespace";
/// Downward API field of the pod's UID.
pub(crate) const FIELD_UID: &str = "metadata.uid";

/// The names of the volumes warmstart adds; a user volume of one of these names is refused.
pub const RESERVED_VOLUMES: [&str; 3] = [
    names::VOLUME_SIGNAL,
    names::VOLUME_CONTROL,
    names::VOLUME_POD_INFO,
];

/// The paths warmstart mounts in a target; a user mount at one of them is refused.
pub const RESERVED_PATHS: [&str; 3] = [
    names::MOUNT_SIGNAL,
    names::MOUNT_CONTROL,
    names::MOUNT_POD_INFO,
];

/// `path` as a mount lands: absolute, without empty, `.` or `..` components (`..` at the root
/// stays there, as in the container's root filesystem) and without a trailing slash. The kubelet
/// and the runtime clean a `mountPath` this way before they mount, so judging the spelling as
/// given would be fooled by `//x`, `/./x` or `/y/../x`.
pub fn clean_mount_path(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Whether a mount at `path` lands at `reserved` or inside it (where it would shadow part of
/// warmstart's directory, such as `restore-complete`).
pub fn at_or_below(path: &str, reserved: &str) -> bool {
    let path = clean_mount_path(path);
    let reserved = clean_mount_path(reserved);
    path == reserved
        || path
            .strip_prefix(reserved.as_str())
            .is_some_and(|rest| rest.starts_with('/'))
}

/// The reserved path ([`RESERVED_PATHS`]) a mount at `path` lands at or inside, if any.
pub fn reserved_path_reached(path: &str) -> Option<&'static str> {
    RESERVED_PATHS.into_iter().find(|p| at_or_below(path, p))
}

/// Whether `mount` is `ours` with its path spelt differently (`/warmstart-control/`).
pub(crate) fn same_mount(mount: &VolumeMount, ours: &VolumeMount) -> bool {
    VolumeMount {
        mount_path: clean_mount_path(&mount.mount_path),
        ..mount.clone()
    } == VolumeMount {
        mount_path: clean_mount_path(&ours.mount_path),
        ..ours.clone()
    }
}

/// The signal volume: the pod's own emptyDir. The agent reaches it on the node through the
/// kubelet's pod directory ([`names::empty_dir_on_host`]).
pub fn signal_volume() -> Volume {
    Volume {
        name: names::VOLUME_SIGNAL.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// The signal mount of a target: the whole signal volume at [`names::MOUNT_SIGNAL`].
pub fn signal_volume_mount() -> VolumeMount {
    VolumeMount {
        name: names::VOLUME_SIGNAL.to_owned(),
        mount_path: names::MOUNT_SIGNAL.to_owned(),
        ..VolumeMount::default()
    }
}

/// The control volume: an empty emptyDir (one sub-directory per target container).
pub fn control_volume() -> Volume {
    Volume {
        name: names::VOLUME_CONTROL.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// The control mount of `container`: its own sub-directory of the control volume at
/// [`names::MOUNT_CONTROL`].
pub fn control_volume_mount(container: &str) -> VolumeMount {
    VolumeMount {
        name: names::VOLUME_CONTROL.to_owned(),
        mount_path: names::MOUNT_CONTROL.to_owned(),
        sub_path: Some(container.to_owned()),
        ..VolumeMount::default()
    }
}

/// The pod-info volume: the pod's labels, annotations, name, namespace and UID as files
/// (Downward API).
pub fn pod_info_volume() -> Volume {
    let items = [
        (names::PODINFO_FILE_LABELS, FIELD_LABELS),
        (names::PODINFO_FILE_ANNOTATIONS, FIELD_ANNOTATIONS),
        (names::PODINFO_FILE_NAME, FIELD_NAME),
        (names::PODINFO_FILE_NAMESPACE, FIELD_NAMESPACE),
        (names::PODINFO_FILE_UID, FIELD_UID),
    ]
    .into_iter()
    .map(|(path, field)| DownwardAPIVolumeFile {
        path: path.to_owned(),
        field_ref: Some(field_selector(field)),
        ..DownwardAPIVolumeFile::default()
    })
    .collect();
    Volume {
        name: names::VOLUME_POD_INFO.to_owned(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(items),
            ..DownwardAPIVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The pod-info mount of a target: read-only at [`names::MOUNT_POD_INFO`].
pub fn pod_info_volume_mount() -> VolumeMount {
    VolumeMount {
        name: names::VOLUME_POD_INFO.to_owned(),
        mount_path: names::MOUNT_POD_INFO.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

/// Every volume warmstart adds to a pod, in the order the builders add them.
pub fn volumes() -> Vec<Volume> {
    vec![signal_volume(), control_volume(), pod_info_volume()]
}

/// Every mount warmstart adds to target `container`, in the order the builders add them.
pub fn target_mounts(container: &str) -> Vec<VolumeMount> {
    vec![
        signal_volume_mount(),
        control_volume_mount(container),
        pod_info_volume_mount(),
    ]
}

/// A Downward API selector of `field`.
pub(crate) fn field_selector(field: &str) -> ObjectFieldSelector {
    ObjectFieldSelector {
        api_version: Some(FIELD_API_VERSION.to_owned()),
        field_path: field.to_owned(),
    }
}

/// Whether `volume` is an emptyDir and nothing else (any medium or size limit).
pub(crate) fn is_only_empty_dir(volume: &Volume) -> bool {
    volume.empty_dir.is_some()
        && *volume
            == Volume {
                name: volume.name.clone(),
                empty_dir: volume.empty_dir.clone(),
                ..Volume::default()
            }
}

/// Whether a user's volume of a reserved name can stand for ours: the emptyDir volumes
/// (signal, control) may be any emptyDir (a medium or size limit the user chose is kept); the
/// pod-info volume must be exactly ours.
pub(crate) fn acceptable_reserved_volume(volume: &Volume) -> bool {
    match volume.name.as_str() {
        names::VOLUME_SIGNAL | names::VOLUME_CONTROL => is_only_empty_dir(volume),
        names::VOLUME_POD_INFO => *volume == pod_info_volume(),
        _ => false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use k8s_openapi::api::core::v1::{
        Container, Pod, PodSpec, PodTemplateSpec, Probe, TCPSocketAction,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    use super::*;
    use crate::job::build_checkpoint_job;
    use crate::restore_pod::build_restore_pod_with;
    use crate::v1alpha1::{
        Checkpoint, CheckpointIdentity, CheckpointJobSpec, CheckpointSpec,
        DEFAULT_ACTIVE_DEADLINE_SECONDS, DEFAULT_BACKOFF_LIMIT, DEFAULT_TTL_SECONDS_AFTER_FINISHED,
        DeletionPolicy, EntrypointMode,
    };

    /// One template, as a user writes it once for both the Checkpoint and the restore pods.
    fn template() -> PodTemplateSpec {
        let container = |name: &str| Container {
            name: name.to_owned(),
            image: Some("worker:1".to_owned()),
            command: Some(vec!["serve".to_owned()]),
            readiness_probe: Some(Probe {
                tcp_socket: Some(TCPSocketAction {
                    port: IntOrString::Int(8000),
                    ..TCPSocketAction::default()
                }),
                ..Probe::default()
            }),
            volume_mounts: Some(vec![VolumeMount {
                name: "models".to_owned(),
                mount_path: "/models".to_owned(),
                read_only: Some(true),
                ..VolumeMount::default()
            }]),
            ..Container::default()
        };
        PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(BTreeMap::from([("app".to_owned(), "llm".to_owned())])),
                ..ObjectMeta::default()
            }),
            spec: Some(PodSpec {
                containers: vec![container("main"), container("sidecar")],
                volumes: Some(vec![Volume {
                    name: "models".to_owned(),
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Volume::default()
                }]),
                ..PodSpec::default()
            }),
        }
    }

    /// (destination, read-only, volume, subPath) of every mount of `container`.
    fn mount_set(spec: &PodSpec, container: &str) -> BTreeSet<(String, bool, String, String)> {
        spec.containers
            .iter()
            .find(|c| c.name == container)
            .unwrap()
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| {
                (
                    m.mount_path.clone(),
                    m.read_only.unwrap_or(false),
                    m.name.clone(),
                    m.sub_path.clone().unwrap_or_default(),
                )
            })
            .collect()
    }

    fn volume_named<'a>(spec: &'a PodSpec, name: &str) -> &'a Volume {
        spec.volumes
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .unwrap()
    }

    // A checkpoint taken in a Job is restorable into a pod
    // the webhook shaped, so the target sees the same mounts in both.
    #[test]
    fn checkpoint_and_restore_pods_of_one_template_give_the_target_identical_mounts() {
        for mode in [EntrypointMode::Native, EntrypointMode::Wrap] {
            same_mounts_in_both_pods(mode);
        }
    }

    fn same_mounts_in_both_pods(mode: EntrypointMode) {
        let mut checkpoint = Checkpoint::new(
            "llama",
            CheckpointSpec {
                identity: CheckpointIdentity {
                    model: "m".to_owned(),
                    backend_framework: "vllm".to_owned(),
                    tensor_parallel_size: 1,
                    pipeline_parallel_size: 1,
                    ..CheckpointIdentity::default()
                },
                job: CheckpointJobSpec {
                    pod_template_spec: template(),
                    target_container_name: None,
                    active_deadline_seconds: DEFAULT_ACTIVE_DEADLINE_SECONDS,
                    backoff_limit: DEFAULT_BACKOFF_LIMIT,
                    ttl_seconds_after_finished: DEFAULT_TTL_SECONDS_AFTER_FINISHED,
                    entrypoint: mode,
                },
                deletion_policy: DeletionPolicy::Delete,
                prestage: None,
            },
        );
        checkpoint.metadata.namespace = Some("default".to_owned());
        checkpoint.metadata.uid = Some("uid-1".to_owned());
        let image = "agent:1";
        let job = build_checkpoint_job(
            &checkpoint,
            "96429b2725761a09",
            "default/96429b2725761a09",
            image,
        )
        .unwrap();
        let job_pod = job.spec.unwrap().template.spec.unwrap();

        let user = template();
        let restore = build_restore_pod_with(
            &Pod {
                metadata: user.metadata.unwrap(),
                spec: user.spec,
                status: None,
            },
            &["main".to_owned()],
            (mode == EntrypointMode::Wrap).then_some(image),
        )
        .unwrap();
        let restore_pod = restore.spec.unwrap();

        let in_job = mount_set(&job_pod, "main");
        let in_restore = mount_set(&restore_pod, "main");
        assert_eq!(in_job, in_restore, "{mode:?}");
        let wrapped = in_job
            .iter()
            .any(|(dest, ..)| dest == names::MOUNT_ENTRYPOINT);
        assert_eq!(wrapped, mode == EntrypointMode::Wrap);
        for path in RESERVED_PATHS {
            assert!(
                in_job.iter().any(|(dest, ..)| dest == path),
                "{path} missing: {in_job:?}"
            );
        }
        // Each reserved mount is backed by the same kind of volume on both sides: a new,
        // empty emptyDir per pod for signal and control, the same Downward API files for
        // pod-info.
        for name in RESERVED_VOLUMES {
            assert_eq!(
                volume_named(&job_pod, name),
                volume_named(&restore_pod, name),
                "{name}"
            );
        }
        assert!(
            volume_named(&restore_pod, names::VOLUME_SIGNAL)
                .empty_dir
                .is_some()
        );
        assert!(
            job_pod
                .volumes
                .iter()
                .chain(restore_pod.volumes.iter())
                .flatten()
                .all(|v| v.host_path.is_none()),
            "no hostPath in workload pods"
        );
    }

    #[test]
    fn only_the_emptydir_volumes_accept_a_users_own_settings() {
        let mut sized = signal_volume();
        sized.empty_dir = Some(EmptyDirVolumeSource {
            medium: Some("Memory".to_owned()),
            size_limit: None,
        });
        assert!(acceptable_reserved_volume(&sized));
        let mut other_info = pod_info_volume();
        other_info.downward_api.as_mut().unwrap().default_mode = Some(0o777);
        assert!(!acceptable_reserved_volume(&other_info));
        assert!(acceptable_reserved_volume(&pod_info_volume()));
        let mut host = control_volume();
        host.empty_dir = None;
        host.host_path = Some(Default::default());
        assert!(!acceptable_reserved_volume(&host));
    }

    #[test]
    fn mount_paths_are_judged_as_they_land() {
        for spelling in [
            "/checkpoint-signal",
            "/checkpoint-signal/",
            "//checkpoint-signal",
            "/./checkpoint-signal",
            "/x/../checkpoint-signal",
            "/../checkpoint-signal",
            "checkpoint-signal",
            "/checkpoint-signal/.",
            "/checkpoint-signal/sub",
            "/checkpoint-signal//sub/",
            "/warmstart-control/restore-complete",
            "/etc/./podinfo/uid",
        ] {
            assert!(reserved_path_reached(spelling).is_some(), "{spelling}");
        }
        for elsewhere in [
            "/checkpoint-signals",
            "/checkpoint-signal/..",
            "/warmstart-controller",
            "/etc",
            "/",
            "/models",
        ] {
            assert_eq!(reserved_path_reached(elsewhere), None, "{elsewhere}");
        }
        assert_eq!(clean_mount_path("//a/./b/../c/"), "/a/c");
    }
}
