//! Job shaping (README "How checkpoint and restore pods are shaped"): turns a `Checkpoint`'s `spec.job` into the
//! checkpoint `Job` the controller creates.
//!
//! Mirrors NVIDIA Dynamo's `buildCheckpointJob`, minus its clean-up init container: the signal
//! directory is an emptyDir, so each pod has its own, new and empty one and no stale
//! `<hash>.done` can be seen; and no hostPath is in the workload pod (Pod Security `baseline`).
//! The agent reaches the directory through the kubelet's pod directory on the node
//! ([`names::empty_dir_on_host`]).
//!
//! Invariants:
//! - Pure and deterministic: the `Checkpoint` is only read, and equal inputs give equal Jobs.
//! - The user's template is kept (labels, annotations, volumes, env, resources, command, image,
//!   other containers, init containers); only the target container and the pod-level fields
//!   the contract names are shaped.
//! - Nothing of the user's is silently replaced where data could be lost: a volume named like
//!   ours, or a target mount at one of our paths, is an error. Our env names, labels and probes
//!   replace the user's, as the contract requires; a seccomp profile the user set is kept (the
//!   pod gets ours only where none is set; the controller warns about the user's).
//! - The target gets the restore control mount and env too (mount parity with restore pods): the
//!   restored process keeps the environment it had at dump time, so it learns the control
//!   directory from the checkpoint pod, and CRIU needs the same mounts on both sides.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Container, EnvVar, EnvVarSource, ExecAction, PodSpec, Probe};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use thiserror::Error;

use crate::restore_pod::{self, MAX_LABEL_LENGTH};
use crate::v1alpha1::{Checkpoint, EntrypointMode};
use crate::wrap::{self, WrapError};
use crate::{mounts, names, placement};

/// Readiness probe period of the target, in seconds.
pub const READINESS_PERIOD_SECONDS: i32 = 5;
/// Readiness probe timeout of the target, in seconds.
pub const READINESS_TIMEOUT_SECONDS: i32 = 5;
/// Readiness probe failure threshold of the target: an hour at one probe every five seconds,
/// the default Job deadline. A readiness failure never restarts the container, so this only
/// keeps kubelet from flapping the Ready condition while the model loads.
pub const READINESS_FAILURE_THRESHOLD: i32 = 720;

/// The only pod restart policy the checkpoint pod may have: a restarted process is not the
/// one the agent was asked to checkpoint; the Job's backoff makes a new pod instead.
const RESTART_POLICY_NEVER: &str = "Never";

/// Why a checkpoint Job cannot be built from a `Checkpoint`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum JobBuildError {
    /// The `Checkpoint` lacks a metadata field the Job needs.
    #[error("checkpoint has no {field}, it is required to build the job")]
    MissingCheckpointField {
        /// `metadata.name`, `metadata.namespace` or `metadata.uid`.
        field: &'static str,
    },
    /// The Job name derived from the checkpoint name is not valid.
    #[error("job name {name:?} is invalid: {reason}")]
    InvalidJobName {
        /// The derived Job name.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// The identity hash cannot be a label value or a file name.
    #[error("checkpoint hash {hash:?} is invalid: {reason}")]
    InvalidHash {
        /// The hash as given.
        hash: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// The artifact location is empty.
    #[error("checkpoint location is empty, it is required")]
    EmptyLocation,
    /// A Job setting of the spec is out of range.
    #[error("spec.job.{field} is {value}, {rule}")]
    InvalidJobSetting {
        /// The field of `spec.job`.
        field: &'static str,
        /// Its value.
        value: i64,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The pod template has no spec.
    #[error("spec.job.podTemplateSpec has no spec")]
    MissingPodSpec,
    /// The pod template has no container.
    #[error("spec.job.podTemplateSpec has no containers, at least one is required")]
    NoContainers,
    /// Two containers of the pod template share a name.
    #[error("spec.job.podTemplateSpec has more than one container named {name:?}")]
    DuplicateContainerName {
        /// The repeated name.
        name: String,
    },
    /// A container or volume name of the template is not a DNS-1123 label (the API server
    /// refuses the Job; a container name also becomes a `subPath`).
    #[error(
        "spec.job.podTemplateSpec has a {kind} named {name:?}, which is not a valid DNS-1123 label: {reason}"
    )]
    InvalidName {
        /// `container`, `init container`, `ephemeral container` or `volume`.
        kind: &'static str,
        /// The offending name.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// `targetContainerName` is set but empty.
    #[error("spec.job.targetContainerName is empty, it must name a container or be omitted")]
    EmptyTargetContainerName,
    /// The requested target container does not exist.
    #[error(
        "spec.job.targetContainerName {name:?} not found in pod template (containers: {containers:?})"
    )]
    TargetContainerNotFound {
        /// The requested name.
        name: String,
        /// The template's containers.
        containers: Vec<String>,
    },
    /// No target was requested and none can be chosen.
    #[error(
        "spec.job.targetContainerName is unset and the pod template has several containers, none named {:?} (containers: {containers:?}); set it",
        names::DEFAULT_TARGET_CONTAINER
    )]
    AmbiguousTargetContainer {
        /// The template's containers.
        containers: Vec<String>,
    },
    /// A user volume (or a mount of one) is named like one warmstart adds.
    #[error("pod template already has a volume named {volume:?}, which is reserved by warmstart")]
    VolumeNameConflict {
        /// The reserved name.
        volume: String,
    },
    /// `spec.job.entrypoint: Wrap` cannot be applied to the target.
    #[error("spec.job.entrypoint is Wrap")]
    Wrap(#[source] WrapError),
    /// The target container mounts a user volume at a path warmstart mounts.
    #[error(
        "container {container:?} already mounts volume {volume:?} at {path:?}, which is reserved by warmstart"
    )]
    MountPathConflict {
        /// The target container.
        container: String,
        /// The user's volume mounted there.
        volume: String,
        /// The reserved path.
        path: String,
    },
}

/// Builds the checkpoint Job `checkpoint-<name>` of `checkpoint`, whose identity hash is `hash`
/// and whose artifact goes to `location`. With `spec.job.entrypoint: Wrap` the target runs
/// under `warmstart-entrypoint`, copied in from `entrypoint_image` (see [`crate::wrap`]), with
/// its original readiness probe in [`names::ENV_READY_PROBE`].
///
/// # Errors
/// A `Checkpoint` without name, namespace or uid; a name too long for a Job; a hash that is not
/// a valid label value; an empty location; negative Job settings; a template without spec or
/// containers, or whose target container cannot be resolved (see
/// [`resolve_target_container`]); a user volume or target mount that collides with ours; with
/// `Wrap`, a target without `command` or readiness probe.
///
/// # Guarantees
/// `checkpoint` is only read; calling twice on the same input gives equal Jobs. The Job is owned
/// (controller reference) by the `Checkpoint`, and the pod carries the labels the agent checks
/// before acting.
pub fn build_checkpoint_job(
    checkpoint: &Checkpoint,
    hash: &str,
    location: &str,
    entrypoint_image: &str,
) -> Result<Job, JobBuildError> {
    let meta = &checkpoint.metadata;
    let name = required(meta.name.as_deref(), "metadata.name")?;
    let namespace = required(meta.namespace.as_deref(), "metadata.namespace")?;
    let uid = required(meta.uid.as_deref(), "metadata.uid")?;

    let job_name = names::job_name(name);
    check_inputs(checkpoint, &job_name, hash, location)?;
    let spec = &checkpoint.spec.job;

    let labels = checkpoint_labels(name, hash);
    let mut template = spec.pod_template_spec.clone();
    let pod = template
        .spec
        .as_mut()
        .ok_or(JobBuildError::MissingPodSpec)?;
    let target = resolve_target_container(pod, spec.target_container_name.as_deref())?;
    check_conflicts(pod, &target)?;
    // Read before shaping replaces it with the ready-file probe.
    let wrapped_probe = match spec.entrypoint {
        EntrypointMode::Native => None,
        EntrypointMode::Wrap => pod
            .containers
            .iter()
            .find(|c| c.name == target)
            .map(wrap::ready_probe_json)
            .transpose()
            .map_err(JobBuildError::Wrap)?,
    };

    let template_meta = template.metadata.get_or_insert_with(ObjectMeta::default);
    template_meta
        .labels
        .get_or_insert_with(BTreeMap::new)
        .extend(labels.clone());
    template_meta
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(
            names::ANNOTATION_CHECKPOINT_TARGET.to_owned(),
            target.clone(),
        );
    pod.restart_policy = Some(RESTART_POLICY_NEVER.to_owned());
    pod.volumes
        .get_or_insert_with(Vec::new)
        .extend(mounts::volumes());
    placement::require_agent_ready(pod);
    restore_pod::set_pod_seccomp(pod);
    let container = pod
        .containers
        .iter_mut()
        .find(|c| c.name == target)
        .ok_or(JobBuildError::NoContainers)?;
    shape_target(container, hash, location);
    if let Some(probe) = wrapped_probe {
        let grace = pod.termination_grace_period_seconds;
        wrap::wrap_target(pod, &target, entrypoint_image).map_err(JobBuildError::Wrap)?;
        let container = pod
            .containers
            .iter_mut()
            .find(|c| c.name == target)
            .ok_or(JobBuildError::NoContainers)?;
        let mut env = vec![plain_env(names::ENV_READY_PROBE, probe)];
        if let Some(grace) = grace {
            env.push(plain_env(names::ENV_STOP_GRACE_PERIOD, grace.to_string()));
        }
        restore_pod::set_env(container, env);
    }

    Ok(Job {
        metadata: ObjectMeta {
            name: Some(job_name),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            owner_references: Some(vec![OwnerReference {
                api_version: format!("{}/{}", names::API_GROUP, names::API_VERSION),
                kind: names::CHECKPOINT_KIND.to_owned(),
                name: name.to_owned(),
                uid: uid.to_owned(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            template,
            active_deadline_seconds: Some(spec.active_deadline_seconds),
            backoff_limit: Some(spec.backoff_limit),
            ttl_seconds_after_finished: Some(spec.ttl_seconds_after_finished),
            ..JobSpec::default()
        }),
        status: None,
    })
}

/// The names and settings a Job is built from, before anything is built.
fn check_inputs(
    checkpoint: &Checkpoint,
    job_name: &str,
    hash: &str,
    location: &str,
) -> Result<(), JobBuildError> {
    // Job pods carry `job-name=<job name>`, so the name must also be a label value.
    if let Some(reason) = label_value_violation(job_name) {
        return Err(JobBuildError::InvalidJobName {
            name: job_name.to_owned(),
            reason,
        });
    }
    // The hash is a label value and part of the `<hash>.done` file name.
    if let Some(reason) = label_value_violation(hash) {
        return Err(JobBuildError::InvalidHash {
            hash: hash.to_owned(),
            reason,
        });
    }
    if location.is_empty() {
        return Err(JobBuildError::EmptyLocation);
    }
    let spec = &checkpoint.spec.job;
    check_setting("activeDeadlineSeconds", spec.active_deadline_seconds, 1)?;
    check_setting("backoffLimit", spec.backoff_limit.into(), 0)?;
    check_setting(
        "ttlSecondsAfterFinished",
        spec.ttl_seconds_after_finished.into(),
        0,
    )
}

/// Chooses the container to checkpoint: `requested` if given; else the container named
/// [`names::DEFAULT_TARGET_CONTAINER`] if there is one; else the only container.
///
/// # Errors
/// No containers, a container or volume name that is not a DNS-1123 label, duplicate container
/// names, an empty or unknown `requested` name (the error lists the containers), or several
/// containers none of which is named `main`.
pub fn resolve_target_container(
    pod: &PodSpec,
    requested: Option<&str>,
) -> Result<String, JobBuildError> {
    let containers: Vec<String> = pod.containers.iter().map(|c| c.name.clone()).collect();
    if containers.is_empty() {
        return Err(JobBuildError::NoContainers);
    }
    if let Some((kind, name, reason)) = restore_pod::invalid_name(pod) {
        return Err(JobBuildError::InvalidName { kind, name, reason });
    }
    if let Some(name) = restore_pod::first_duplicate(containers.iter().map(String::as_str)) {
        return Err(JobBuildError::DuplicateContainerName {
            name: name.to_owned(),
        });
    }
    match requested {
        Some("") => Err(JobBuildError::EmptyTargetContainerName),
        Some(name) if containers.iter().any(|c| c == name) => Ok(name.to_owned()),
        Some(name) => Err(JobBuildError::TargetContainerNotFound {
            name: name.to_owned(),
            containers,
        }),
        None if containers
            .iter()
            .any(|c| c == names::DEFAULT_TARGET_CONTAINER) =>
        {
            Ok(names::DEFAULT_TARGET_CONTAINER.to_owned())
        }
        None => match containers.as_slice() {
            [only] => Ok(only.clone()),
            _ => Err(JobBuildError::AmbiguousTargetContainer { containers }),
        },
    }
}

/// The labels of a checkpoint Job and its pods, which the agent checks before acting.
pub fn checkpoint_labels(name: &str, hash: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (names::LABEL_CHECKPOINT_NAME.to_owned(), name.to_owned()),
        (names::LABEL_CHECKPOINT_HASH.to_owned(), hash.to_owned()),
        (
            names::LABEL_CHECKPOINT_SOURCE.to_owned(),
            names::LABEL_CHECKPOINT_SOURCE_VALUE.to_owned(),
        ),
    ])
}

/// The readiness probe of the target: `cat /checkpoint-signal/ready`. The contract writes it as
/// `cat $WARMSTART_READY_FILE`, but exec probes run without a shell and kubelet does not expand
/// variables in them, so the path is spelt out.
pub fn ready_probe() -> Probe {
    Probe {
        exec: Some(ExecAction {
            command: Some(vec!["cat".to_owned(), names::ready_file_path()]),
        }),
        period_seconds: Some(READINESS_PERIOD_SECONDS),
        timeout_seconds: Some(READINESS_TIMEOUT_SECONDS),
        success_threshold: Some(1),
        failure_threshold: Some(READINESS_FAILURE_THRESHOLD),
        ..Probe::default()
    }
}

fn plain_env(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value),
        value_from: None,
    }
}

fn required<'a>(value: Option<&'a str>, field: &'static str) -> Result<&'a str, JobBuildError> {
    value
        .filter(|v| !v.is_empty())
        .ok_or(JobBuildError::MissingCheckpointField { field })
}

fn check_setting(field: &'static str, value: i64, min: i64) -> Result<(), JobBuildError> {
    if value < min {
        return Err(JobBuildError::InvalidJobSetting {
            field,
            value,
            rule: if min == 0 {
                "must not be negative"
            } else {
                "must be at least 1"
            },
        });
    }
    Ok(())
}

/// Why `value` cannot be a (non-empty) Kubernetes label value, or `None` when it can.
fn label_value_violation(value: &str) -> Option<&'static str> {
    if value.is_empty() {
        return Some("must not be empty");
    }
    if value.len() > MAX_LABEL_LENGTH {
        return Some("must be at most 63 characters (a label value)");
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Some("must consist of letters, digits, '-', '_' and '.' (a label value)");
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !alnum(value.chars().next()) || !alnum(value.chars().last()) {
        return Some("must start and end with a letter or digit (a label value)");
    }
    None
}

/// Rejects a template that already uses one of our volume names, or mounts something at one of
/// our paths in the target: adding ours would shadow the user's data or hand it our volume.
fn check_conflicts(pod: &PodSpec, target: &str) -> Result<(), JobBuildError> {
    let conflict = |name: &str| {
        mounts::RESERVED_VOLUMES
            .contains(&name)
            .then(|| JobBuildError::VolumeNameConflict {
                volume: name.to_owned(),
            })
    };
    if let Some(err) = pod.volumes.iter().flatten().find_map(|v| conflict(&v.name)) {
        return Err(err);
    }
    // A mount of a volume that does not exist yet would bind to ours once we add it.
    let all_mounts = pod
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .chain(
            pod.init_containers
                .iter()
                .flatten()
                .flat_map(|c| c.volume_mounts.iter().flatten()),
        )
        .chain(
            pod.ephemeral_containers
                .iter()
                .flatten()
                .flat_map(|c| c.volume_mounts.iter().flatten()),
        );
    for mount in all_mounts {
        if let Some(err) = conflict(&mount.name) {
            return Err(err);
        }
    }
    let target_mounts = pod
        .containers
        .iter()
        .filter(|c| c.name == target)
        .flat_map(|c| c.volume_mounts.iter().flatten());
    for mount in target_mounts {
        if mounts::reserved_path_reached(&mount.mount_path).is_some() {
            return Err(JobBuildError::MountPathConflict {
                container: target.to_owned(),
                volume: mount.name.clone(),
                path: mount.mount_path.clone(),
            });
        }
    }
    Ok(())
}

fn shape_target(container: &mut Container, hash: &str, location: &str) {
    let ours = mounts::target_mounts(&container.name);
    container
        .volume_mounts
        .get_or_insert_with(Vec::new)
        .extend(ours);

    let value = |name: &str, value: String| EnvVar {
        name: name.to_owned(),
        value: Some(value),
        value_from: None,
    };
    let signal_file = names::signal_file_path(hash);
    let ready_file = names::ready_file_path();
    // The pod UID comes first: a `$(…)` reference in the user's env needs it defined before.
    let mut env = vec![EnvVar {
        name: names::ENV_POD_UID.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(mounts::field_selector(mounts::FIELD_UID)),
            ..EnvVarSource::default()
        }),
    }];
    for (primary, alias, v) in [
        (
            names::ENV_SIGNAL_FILE,
            names::ENV_DYN_SIGNAL_FILE,
            &signal_file,
        ),
        (
            names::ENV_READY_FILE,
            names::ENV_DYN_READY_FILE,
            &ready_file,
        ),
        (
            names::ENV_CHECKPOINT_HASH,
            names::ENV_DYN_CHECKPOINT_HASH,
            &hash.to_owned(),
        ),
        (
            names::ENV_CHECKPOINT_LOCATION,
            names::ENV_DYN_CHECKPOINT_LOCATION,
            &location.to_owned(),
        ),
        (
            names::ENV_STORAGE_TYPE,
            names::ENV_DYN_STORAGE_TYPE,
            &names::STORAGE_TYPE_PVC.to_owned(),
        ),
    ] {
        env.push(value(primary, v.clone()));
        env.push(value(alias, v.clone()));
    }
    env.extend(restore_pod::control_env());
    restore_pod::set_env(container, env);

    container.readiness_probe = Some(ready_probe());
    container.liveness_probe = None;
    container.startup_probe = None;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::{
        Affinity, EmptyDirVolumeSource, HTTPGetAction, NodeAffinity, NodeSelector,
        NodeSelectorRequirement, NodeSelectorTerm, PodSecurityContext, PodTemplateSpec,
        ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    use super::*;
    use crate::v1alpha1::{
        CheckpointIdentity, CheckpointJobSpec, CheckpointSpec, DEFAULT_ACTIVE_DEADLINE_SECONDS,
        DEFAULT_BACKOFF_LIMIT, DEFAULT_TTL_SECONDS_AFTER_FINISHED, DeletionPolicy,
    };

    const HASH: &str = "96429b2725761a09";
    const LOCATION: &str = "default/96429b2725761a09";
    const ENTRYPOINT_IMAGE: &str = "ghcr.io/warmstart/agent:test";

    fn container(name: &str) -> Container {
        Container {
            name: name.to_owned(),
            image: Some(format!("{name}:1")),
            command: Some(vec![
                "python".to_owned(),
                "-m".to_owned(),
                "serve".to_owned(),
            ]),
            env: Some(vec![EnvVar {
                name: "MODEL".to_owned(),
                value: Some("llama".to_owned()),
                value_from: None,
            }]),
            resources: Some(ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    "nvidia.com/gpu".to_owned(),
                    Quantity("1".to_owned()),
                )])),
                ..ResourceRequirements::default()
            }),
            volume_mounts: Some(vec![VolumeMount {
                name: "models".to_owned(),
                mount_path: "/models".to_owned(),
                ..VolumeMount::default()
            }]),
            liveness_probe: Some(http_probe("/healthz")),
            readiness_probe: Some(http_probe("/ready")),
            startup_probe: Some(http_probe("/startup")),
            ..Container::default()
        }
    }

    fn http_probe(path: &str) -> Probe {
        Probe {
            http_get: Some(HTTPGetAction {
                path: Some(path.to_owned()),
                port: IntOrString::Int(8000),
                ..HTTPGetAction::default()
            }),
            ..Probe::default()
        }
    }

    fn checkpoint_with(containers: &[&str], target: Option<&str>) -> Checkpoint {
        let mut ckpt = Checkpoint::new(
            "llama",
            CheckpointSpec {
                identity: CheckpointIdentity {
                    model: "meta-llama/Llama-2-7b-hf".to_owned(),
                    backend_framework: "vllm".to_owned(),
                    tensor_parallel_size: 1,
                    pipeline_parallel_size: 1,
                    ..CheckpointIdentity::default()
                },
                job: CheckpointJobSpec {
                    pod_template_spec: PodTemplateSpec {
                        metadata: Some(ObjectMeta {
                            labels: Some(BTreeMap::from([("app".to_owned(), "llm".to_owned())])),
                            annotations: Some(BTreeMap::from([(
                                "team".to_owned(),
                                "infra".to_owned(),
                            )])),
                            ..ObjectMeta::default()
                        }),
                        spec: Some(PodSpec {
                            containers: containers.iter().map(|c| container(c)).collect(),
                            init_containers: Some(vec![container("fetch")]),
                            volumes: Some(vec![Volume {
                                name: "models".to_owned(),
                                empty_dir: Some(EmptyDirVolumeSource::default()),
                                ..Volume::default()
                            }]),
                            restart_policy: Some("OnFailure".to_owned()),
                            ..PodSpec::default()
                        }),
                    },
                    target_container_name: target.map(str::to_owned),
                    active_deadline_seconds: DEFAULT_ACTIVE_DEADLINE_SECONDS,
                    backoff_limit: DEFAULT_BACKOFF_LIMIT,
                    ttl_seconds_after_finished: DEFAULT_TTL_SECONDS_AFTER_FINISHED,
                    entrypoint: EntrypointMode::Native,
                },
                deletion_policy: DeletionPolicy::Delete,
                prestage: None,
            },
        );
        ckpt.metadata.namespace = Some("default".to_owned());
        ckpt.metadata.uid = Some("0f5c-uid".to_owned());
        ckpt
    }

    fn checkpoint() -> Checkpoint {
        checkpoint_with(&["main", "sidecar"], None)
    }

    fn build(ckpt: &Checkpoint) -> Result<Job, JobBuildError> {
        build_checkpoint_job(ckpt, HASH, LOCATION, ENTRYPOINT_IMAGE)
    }

    fn pod_spec(job: &Job) -> &PodSpec {
        job.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
    }

    fn template_mut(ckpt: &mut Checkpoint) -> &mut PodSpec {
        ckpt.spec.job.pod_template_spec.spec.as_mut().unwrap()
    }

    fn target<'a>(job: &'a Job, name: &str) -> &'a Container {
        pod_spec(job)
            .containers
            .iter()
            .find(|c| c.name == name)
            .unwrap()
    }

    fn env_values<'a>(c: &'a Container, name: &str) -> Vec<&'a EnvVar> {
        c.env.iter().flatten().filter(|e| e.name == name).collect()
    }

    fn env_value<'a>(c: &'a Container, name: &str) -> &'a str {
        let found = env_values(c, name);
        assert_eq!(found.len(), 1, "{name}");
        found[0].value.as_deref().unwrap()
    }

    fn volume<'a>(job: &'a Job, name: &str) -> &'a Volume {
        pod_spec(job)
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .unwrap()
    }

    fn mount<'a>(c: &'a Container, name: &str) -> &'a VolumeMount {
        c.volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == name)
            .unwrap()
    }

    #[test]
    fn job_is_named_after_the_checkpoint_in_its_namespace() {
        let job = build(&checkpoint()).unwrap();
        assert_eq!(job.metadata.name.as_deref(), Some("checkpoint-llama"));
        assert_eq!(job.metadata.namespace.as_deref(), Some("default"));
    }

    #[test]
    fn checkpoint_without_name_namespace_or_uid_is_rejected() {
        for (field, clear) in [
            (
                "metadata.name",
                (|c: &mut Checkpoint| c.metadata.name = None) as fn(&mut Checkpoint),
            ),
            ("metadata.namespace", |c| c.metadata.namespace = None),
            ("metadata.uid", |c| c.metadata.uid = None),
            ("metadata.uid", |c| c.metadata.uid = Some(String::new())),
        ] {
            let mut ckpt = checkpoint();
            clear(&mut ckpt);
            assert_eq!(
                build(&ckpt),
                Err(JobBuildError::MissingCheckpointField { field })
            );
        }
    }

    #[test]
    fn job_name_longer_than_a_label_value_is_rejected() {
        let mut ckpt = checkpoint();
        ckpt.metadata.name = Some("x".repeat(53));
        assert!(matches!(
            build(&ckpt),
            Err(JobBuildError::InvalidJobName { name, .. }) if name.len() == 64
        ));
        ckpt.metadata.name = Some("x".repeat(52));
        assert!(build(&ckpt).is_ok());
    }

    #[test]
    fn hash_that_cannot_be_a_label_value_is_rejected() {
        for bad in ["", "../etc", "a/b", "-abc", &"a".repeat(64)] {
            let result = build_checkpoint_job(&checkpoint(), bad, LOCATION, ENTRYPOINT_IMAGE);
            assert!(
                matches!(&result, Err(JobBuildError::InvalidHash { hash, .. }) if hash == bad),
                "{bad}: {result:?}"
            );
        }
    }

    #[test]
    fn empty_location_is_rejected() {
        assert_eq!(
            build_checkpoint_job(&checkpoint(), HASH, "", ENTRYPOINT_IMAGE),
            Err(JobBuildError::EmptyLocation)
        );
    }

    #[test]
    fn job_is_owned_by_the_checkpoint() {
        let job = build(&checkpoint()).unwrap();
        assert_eq!(
            job.metadata.owner_references,
            Some(vec![OwnerReference {
                api_version: "warmstart.dev/v1alpha1".to_owned(),
                kind: "Checkpoint".to_owned(),
                name: "llama".to_owned(),
                uid: "0f5c-uid".to_owned(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }])
        );
    }

    #[test]
    fn job_and_pod_carry_the_checkpoint_labels_keeping_user_metadata() {
        let job = build(&checkpoint()).unwrap();
        let ours = BTreeMap::from([
            (
                "warmstart.dev/checkpoint-name".to_owned(),
                "llama".to_owned(),
            ),
            ("warmstart.dev/checkpoint-hash".to_owned(), HASH.to_owned()),
            (
                "warmstart.dev/checkpoint-source".to_owned(),
                "true".to_owned(),
            ),
        ]);
        assert_eq!(job.metadata.labels.as_ref(), Some(&ours));
        let meta = job
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap();
        let mut expected = ours.clone();
        expected.insert("app".to_owned(), "llm".to_owned());
        assert_eq!(meta.labels.as_ref(), Some(&expected));
        assert_eq!(
            meta.annotations
                .as_ref()
                .unwrap()
                .get("team")
                .map(String::as_str),
            Some("infra")
        );
    }

    #[test]
    fn the_pod_records_the_target_resolved_when_the_job_was_built() {
        let recorded = |job: &Job| {
            job.spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .as_ref()
                .unwrap()
                .annotations
                .as_ref()
                .unwrap()
                .get(names::ANNOTATION_CHECKPOINT_TARGET)
                .cloned()
        };
        assert_eq!(
            recorded(&build(&checkpoint()).unwrap()).as_deref(),
            Some("main")
        );
        let sidecar = checkpoint_with(&["main", "sidecar"], Some("sidecar"));
        assert_eq!(
            recorded(&build(&sidecar).unwrap()).as_deref(),
            Some("sidecar")
        );
    }

    #[test]
    fn our_labels_replace_user_values_of_the_same_key() {
        let mut ckpt = checkpoint();
        ckpt.spec
            .job
            .pod_template_spec
            .metadata
            .as_mut()
            .unwrap()
            .labels
            .as_mut()
            .unwrap()
            .insert(names::LABEL_CHECKPOINT_HASH.to_owned(), "forged".to_owned());
        let job = build(&ckpt).unwrap();
        let meta = job
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap();
        assert_eq!(
            meta.labels
                .as_ref()
                .unwrap()
                .get(names::LABEL_CHECKPOINT_HASH),
            Some(&HASH.to_owned())
        );
    }

    #[test]
    fn pod_template_without_metadata_gets_the_labels() {
        let mut ckpt = checkpoint();
        ckpt.spec.job.pod_template_spec.metadata = None;
        let job = build(&ckpt).unwrap();
        let meta = job
            .spec
            .as_ref()
            .unwrap()
            .template
            .metadata
            .as_ref()
            .unwrap();
        assert_eq!(meta.labels, Some(checkpoint_labels("llama", HASH)));
    }

    #[test]
    fn explicit_target_container_is_used() {
        let job = build(&checkpoint_with(&["main", "worker"], Some("worker"))).unwrap();
        assert_eq!(target(&job, "worker").readiness_probe, Some(ready_probe()));
        assert_eq!(
            target(&job, "main").readiness_probe,
            Some(http_probe("/ready"))
        );
    }

    #[test]
    fn target_defaults_to_main() {
        let spec = checkpoint_with(&["sidecar", "main"], None)
            .spec
            .job
            .pod_template_spec
            .spec
            .unwrap();
        assert_eq!(resolve_target_container(&spec, None).unwrap(), "main");
    }

    #[test]
    fn target_defaults_to_the_only_container() {
        let job = build(&checkpoint_with(&["worker"], None)).unwrap();
        assert_eq!(target(&job, "worker").readiness_probe, Some(ready_probe()));
    }

    #[test]
    fn several_containers_none_named_main_is_an_error_listing_them() {
        let err = build(&checkpoint_with(&["worker", "sidecar"], None)).unwrap_err();
        assert_eq!(
            err,
            JobBuildError::AmbiguousTargetContainer {
                containers: vec!["worker".to_owned(), "sidecar".to_owned()]
            }
        );
        assert!(err.to_string().contains("\"worker\", \"sidecar\""), "{err}");
    }

    #[test]
    fn unknown_named_target_is_an_error_listing_the_containers() {
        let err = build(&checkpoint_with(&["main", "sidecar"], Some("worker"))).unwrap_err();
        assert_eq!(
            err,
            JobBuildError::TargetContainerNotFound {
                name: "worker".to_owned(),
                containers: vec!["main".to_owned(), "sidecar".to_owned()]
            }
        );
        assert_eq!(
            err.to_string(),
            "spec.job.targetContainerName \"worker\" not found in pod template (containers: [\"main\", \"sidecar\"])"
        );
    }

    #[test]
    fn empty_target_name_no_containers_and_duplicates_are_errors() {
        assert_eq!(
            build(&checkpoint_with(&["main"], Some(""))),
            Err(JobBuildError::EmptyTargetContainerName)
        );
        assert_eq!(
            build(&checkpoint_with(&[], None)),
            Err(JobBuildError::NoContainers)
        );
        assert_eq!(
            build(&checkpoint_with(&["main", "main"], None)),
            Err(JobBuildError::DuplicateContainerName {
                name: "main".to_owned()
            })
        );
        let mut ckpt = checkpoint();
        ckpt.spec.job.pod_template_spec.spec = None;
        assert_eq!(build(&ckpt), Err(JobBuildError::MissingPodSpec));
    }

    #[test]
    fn user_pod_content_is_preserved() {
        let ckpt = checkpoint();
        let job = build(&ckpt).unwrap();
        let user = ckpt.spec.job.pod_template_spec.spec.as_ref().unwrap();
        let pod = pod_spec(&job);
        assert_eq!(pod.init_containers, user.init_containers);
        assert_eq!(target(&job, "sidecar"), &container("sidecar"));
        assert!(pod.volumes.as_ref().unwrap().contains(&Volume {
            name: "models".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        }));
        let main = target(&job, "main");
        let original = container("main");
        assert_eq!(main.image, original.image);
        assert_eq!(main.command, original.command);
        assert_eq!(main.resources, original.resources);
        assert_eq!(env_value(main, "MODEL"), "llama");
        assert_eq!(mount(main, "models"), &original.volume_mounts.unwrap()[0]);
    }

    #[test]
    fn signal_volume_is_the_pods_own_empty_dir() {
        let job = build(&checkpoint()).unwrap();
        assert_eq!(
            volume(&job, "warmstart-signal"),
            &Volume {
                name: "warmstart-signal".to_owned(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            }
        );
        assert_eq!(
            mount(target(&job, "main"), "warmstart-signal"),
            &VolumeMount {
                name: "warmstart-signal".to_owned(),
                mount_path: "/checkpoint-signal".to_owned(),
                ..VolumeMount::default()
            }
        );
        assert!(
            pod_spec(&job)
                .volumes
                .iter()
                .flatten()
                .all(|v| v.host_path.is_none()),
            "no hostPath in a checkpoint pod (Pod Security baseline)"
        );
        assert!(
            target(&job, "sidecar")
                .volume_mounts
                .iter()
                .flatten()
                .all(|m| m.name != "warmstart-signal"),
            "only the target sees the signal directory"
        );
    }

    #[test]
    fn the_pod_requires_a_node_whose_agent_is_ready() {
        let job = build(&checkpoint()).unwrap();
        let required = pod_spec(&job)
            .affinity
            .as_ref()
            .unwrap()
            .node_affinity
            .as_ref()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap();
        assert_eq!(
            required.node_selector_terms,
            vec![NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: "warmstart.dev/agent-ready".to_owned(),
                    operator: "In".to_owned(),
                    values: Some(vec!["true".to_owned()]),
                }]),
                match_fields: None,
            }]
        );
    }

    #[test]
    fn the_users_node_affinity_is_kept_and_anded_with_the_agent_requirement() {
        let gpu = NodeSelectorRequirement {
            key: "nvidia.com/gpu.product".to_owned(),
            operator: "In".to_owned(),
            values: Some(vec!["H100".to_owned()]),
        };
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt).affinity = Some(Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![gpu.clone()]),
                        match_fields: None,
                    }],
                }),
                preferred_during_scheduling_ignored_during_execution: None,
            }),
            ..Affinity::default()
        });
        let job = build(&ckpt).unwrap();
        let terms = &pod_spec(&job)
            .affinity
            .as_ref()
            .unwrap()
            .node_affinity
            .as_ref()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()
            .node_selector_terms;
        assert_eq!(terms.len(), 1);
        assert_eq!(
            terms[0].match_expressions,
            Some(vec![gpu, crate::placement::agent_ready_requirement()])
        );
    }

    #[test]
    fn control_volume_is_mounted_like_in_restore_pods() {
        let job = build(&checkpoint()).unwrap();
        assert_eq!(
            volume(&job, "warmstart-control"),
            &restore_pod::control_volume()
        );
        assert_eq!(
            mount(target(&job, "main"), "warmstart-control"),
            &VolumeMount {
                name: "warmstart-control".to_owned(),
                mount_path: "/warmstart-control".to_owned(),
                sub_path: Some("main".to_owned()),
                ..VolumeMount::default()
            }
        );
        let main = target(&job, "main");
        assert_eq!(
            env_value(main, "WARMSTART_CONTROL_DIR"),
            "/warmstart-control"
        );
        assert_eq!(
            env_value(main, "SNAPSHOT_CONTROL_DIR"),
            "/warmstart-control"
        );
    }

    #[test]
    fn pod_info_volume_exposes_the_pod_metadata() {
        let job = build(&checkpoint()).unwrap();
        let items = volume(&job, "warmstart-podinfo")
            .downward_api
            .as_ref()
            .unwrap()
            .items
            .as_ref()
            .unwrap();
        let pairs: Vec<(&str, &str)> = items
            .iter()
            .map(|i| {
                (
                    i.path.as_str(),
                    i.field_ref.as_ref().unwrap().field_path.as_str(),
                )
            })
            .collect();
        assert_eq!(
            pairs,
            vec![
                ("labels", "metadata.labels"),
                ("annotations", "metadata.annotations"),
                ("name", "metadata.name"),
                ("namespace", "metadata.namespace"),
                ("uid", "metadata.uid"),
            ]
        );
        let m = mount(target(&job, "main"), "warmstart-podinfo");
        assert_eq!(m.mount_path, "/etc/podinfo");
        assert_eq!(m.read_only, Some(true));
    }

    #[test]
    fn target_env_carries_the_signal_contract_and_dynamo_aliases() {
        let job = build(&checkpoint()).unwrap();
        let main = target(&job, "main");
        for (primary, alias, want) in [
            (
                "WARMSTART_SIGNAL_FILE",
                "DYN_CHECKPOINT_SIGNAL_FILE",
                "/checkpoint-signal/96429b2725761a09.done",
            ),
            (
                "WARMSTART_READY_FILE",
                "DYN_CHECKPOINT_READY_FILE",
                "/checkpoint-signal/ready",
            ),
            ("WARMSTART_CHECKPOINT_HASH", "DYN_CHECKPOINT_HASH", HASH),
            (
                "WARMSTART_CHECKPOINT_LOCATION",
                "DYN_CHECKPOINT_LOCATION",
                LOCATION,
            ),
            (
                "WARMSTART_STORAGE_TYPE",
                "DYN_CHECKPOINT_STORAGE_TYPE",
                "pvc",
            ),
        ] {
            assert_eq!(env_value(main, primary), want, "{primary}");
            assert_eq!(env_value(main, alias), want, "{alias}");
        }
    }

    #[test]
    fn pod_uid_env_comes_first_from_the_downward_api() {
        let job = build(&checkpoint()).unwrap();
        let first = &target(&job, "main").env.as_ref().unwrap()[0];
        assert_eq!(first.name, "WARMSTART_POD_UID");
        assert_eq!(first.value, None);
        assert_eq!(
            first
                .value_from
                .as_ref()
                .unwrap()
                .field_ref
                .as_ref()
                .unwrap()
                .field_path,
            "metadata.uid"
        );
    }

    #[test]
    fn user_env_of_our_names_is_replaced_without_duplicates() {
        let mut ckpt = checkpoint();
        let main = &mut template_mut(&mut ckpt).containers[0];
        for name in [
            "WARMSTART_CHECKPOINT_HASH",
            "DYN_CHECKPOINT_LOCATION",
            "WARMSTART_POD_UID",
        ] {
            main.env.get_or_insert_with(Vec::new).push(EnvVar {
                name: name.to_owned(),
                value: Some("user".to_owned()),
                value_from: None,
            });
        }
        let job = build(&ckpt).unwrap();
        let main = target(&job, "main");
        assert_eq!(env_value(main, "WARMSTART_CHECKPOINT_HASH"), HASH);
        assert_eq!(env_value(main, "DYN_CHECKPOINT_LOCATION"), LOCATION);
        assert_eq!(env_values(main, "WARMSTART_POD_UID").len(), 1);
        assert_eq!(main.env.as_ref().unwrap()[0].name, "WARMSTART_POD_UID");
    }

    #[test]
    fn target_is_readiness_probed_on_the_ready_file_without_liveness_or_startup() {
        let job = build(&checkpoint()).unwrap();
        let main = target(&job, "main");
        let probe = main.readiness_probe.as_ref().unwrap();
        assert_eq!(
            probe.exec.as_ref().unwrap().command,
            Some(vec![
                "cat".to_owned(),
                "/checkpoint-signal/ready".to_owned()
            ])
        );
        assert_eq!(probe.period_seconds, Some(5));
        assert!(probe.failure_threshold.unwrap() >= 360);
        assert_eq!(probe.http_get, None);
        assert_eq!(main.liveness_probe, None);
        assert_eq!(main.startup_probe, None);
        assert_eq!(
            target(&job, "sidecar").liveness_probe,
            Some(http_probe("/healthz")),
            "other containers keep their probes"
        );
    }

    #[test]
    fn pod_never_restarts_and_runs_under_the_warmstart_seccomp_profile() {
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt).security_context = Some(PodSecurityContext {
            run_as_user: Some(1000),
            fs_group: Some(2000),
            ..PodSecurityContext::default()
        });
        let job = build(&ckpt).unwrap();
        let pod = pod_spec(&job);
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        let sc = pod.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_user, Some(1000));
        assert_eq!(sc.fs_group, Some(2000));
        assert_eq!(
            sc.seccomp_profile,
            Some(SeccompProfile {
                type_: "Localhost".to_owned(),
                localhost_profile: Some("profiles/warmstart-block-iouring.json".to_owned()),
            })
        );
    }

    // A profile the user set is kept (the controller
    // warns about it).
    #[test]
    fn a_users_seccomp_profiles_are_kept() {
        let mut ckpt = checkpoint();
        let runtime_default = SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        };
        template_mut(&mut ckpt).security_context = Some(PodSecurityContext {
            seccomp_profile: Some(runtime_default.clone()),
            ..PodSecurityContext::default()
        });
        template_mut(&mut ckpt).containers[0].security_context = Some(SecurityContext {
            run_as_non_root: Some(true),
            seccomp_profile: Some(SeccompProfile {
                type_: "Unconfined".to_owned(),
                localhost_profile: None,
            }),
            ..SecurityContext::default()
        });
        let job = build(&ckpt).unwrap();
        let pod = pod_spec(&job);
        assert_eq!(
            pod.security_context.as_ref().unwrap().seccomp_profile,
            Some(runtime_default)
        );
        let sc = target(&job, "main").security_context.as_ref().unwrap();
        assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "Unconfined");
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(
            restore_pod::seccomp_overrides(pod, &["main".to_owned()]).len(),
            2
        );
    }

    #[test]
    fn job_settings_come_from_the_spec() {
        let mut ckpt = checkpoint();
        ckpt.spec.job.active_deadline_seconds = 7200;
        ckpt.spec.job.backoff_limit = 0;
        ckpt.spec.job.ttl_seconds_after_finished = 60;
        let job = build(&ckpt).unwrap();
        let spec = job.spec.as_ref().unwrap();
        assert_eq!(spec.active_deadline_seconds, Some(7200));
        assert_eq!(spec.backoff_limit, Some(0));
        assert_eq!(spec.ttl_seconds_after_finished, Some(60));

        let defaults = build(&checkpoint()).unwrap().spec.unwrap();
        assert_eq!(defaults.active_deadline_seconds, Some(3600));
        assert_eq!(defaults.backoff_limit, Some(3));
        assert_eq!(defaults.ttl_seconds_after_finished, Some(300));
    }

    #[test]
    fn out_of_range_job_settings_are_rejected() {
        let mut ckpt = checkpoint();
        ckpt.spec.job.active_deadline_seconds = 0;
        assert_eq!(
            build(&ckpt),
            Err(JobBuildError::InvalidJobSetting {
                field: "activeDeadlineSeconds",
                value: 0,
                rule: "must be at least 1"
            })
        );
        let mut ckpt = checkpoint();
        ckpt.spec.job.backoff_limit = -1;
        assert!(matches!(
            build(&ckpt),
            Err(JobBuildError::InvalidJobSetting {
                field: "backoffLimit",
                value: -1,
                ..
            })
        ));
        let mut ckpt = checkpoint();
        ckpt.spec.job.ttl_seconds_after_finished = -5;
        let err = build(&ckpt).unwrap_err();
        assert_eq!(
            err.to_string(),
            "spec.job.ttlSecondsAfterFinished is -5, must not be negative"
        );
    }

    #[test]
    fn user_volume_named_like_ours_is_a_conflict() {
        for reserved in ["warmstart-signal", "warmstart-control", "warmstart-podinfo"] {
            let mut ckpt = checkpoint();
            template_mut(&mut ckpt)
                .volumes
                .as_mut()
                .unwrap()
                .push(Volume {
                    name: reserved.to_owned(),
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Volume::default()
                });
            assert_eq!(
                build(&ckpt),
                Err(JobBuildError::VolumeNameConflict {
                    volume: reserved.to_owned()
                })
            );
        }
    }

    #[test]
    fn a_mount_of_our_volume_name_in_any_container_is_a_conflict() {
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt).containers[1]
            .volume_mounts
            .get_or_insert_with(Vec::new)
            .push(VolumeMount {
                name: "warmstart-signal".to_owned(),
                mount_path: "/spy".to_owned(),
                ..VolumeMount::default()
            });
        assert_eq!(
            build(&ckpt),
            Err(JobBuildError::VolumeNameConflict {
                volume: "warmstart-signal".to_owned()
            })
        );
    }

    #[test]
    fn user_mount_at_one_of_our_paths_is_a_conflict() {
        for path in [
            "/checkpoint-signal",
            "/warmstart-control/",
            "/etc/podinfo",
            // Other spellings of the same places, and places inside them.
            "//checkpoint-signal",
            "/./checkpoint-signal",
            "/models/../checkpoint-signal",
            "checkpoint-signal",
            "/warmstart-control/sub",
            "/warmstart-control/restore-complete",
            "/checkpoint-signal/0123456789abcdef.done",
            "/etc//podinfo/labels",
        ] {
            let mut ckpt = checkpoint();
            template_mut(&mut ckpt).containers[0]
                .volume_mounts
                .as_mut()
                .unwrap()
                .push(VolumeMount {
                    name: "models".to_owned(),
                    mount_path: path.to_owned(),
                    ..VolumeMount::default()
                });
            assert_eq!(
                build(&ckpt),
                Err(JobBuildError::MountPathConflict {
                    container: "main".to_owned(),
                    volume: "models".to_owned(),
                    path: path.to_owned(),
                })
            );
        }
    }

    #[test]
    fn user_mounts_beside_our_paths_are_kept() {
        for path in [
            "/checkpoint-signals",
            "/etc",
            "/warmstart-control/..",
            "/models",
        ] {
            let mut ckpt = checkpoint();
            template_mut(&mut ckpt).containers[0]
                .volume_mounts
                .as_mut()
                .unwrap()
                .push(VolumeMount {
                    name: "models".to_owned(),
                    mount_path: path.to_owned(),
                    ..VolumeMount::default()
                });
            let job = build(&ckpt).unwrap();
            assert!(
                target(&job, "main")
                    .volume_mounts
                    .iter()
                    .flatten()
                    .any(|m| m.mount_path == path),
                "{path}"
            );
        }
    }

    // A container name becomes the control mount's `subPath`: `../x` would reach outside the
    // control volume. The API server refuses such names; so does the builder.
    #[test]
    fn names_the_api_server_refuses_are_refused() {
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt).containers[1].name = "../x".to_owned();
        assert_eq!(
            build(&ckpt),
            Err(JobBuildError::InvalidName {
                kind: "container",
                name: "../x".to_owned(),
                reason: "must consist of lowercase letters, digits and '-'",
            })
        );
        let mut ckpt = checkpoint_with(&["../x"], None);
        ckpt.spec.job.target_container_name = Some("../x".to_owned());
        assert!(matches!(
            build(&ckpt),
            Err(JobBuildError::InvalidName { name, .. }) if name == "../x"
        ));
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt).init_containers = Some(vec![Container {
            name: "Init".to_owned(),
            ..Container::default()
        }]);
        assert!(matches!(
            build(&ckpt),
            Err(JobBuildError::InvalidName {
                kind: "init container",
                ..
            })
        ));
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt)
            .volumes
            .get_or_insert_with(Vec::new)
            .push(k8s_openapi::api::core::v1::Volume {
                name: "a/b".to_owned(),
                ..Default::default()
            });
        let err = build(&ckpt).unwrap_err();
        assert_eq!(
            err.to_string(),
            "spec.job.podTemplateSpec has a volume named \"a/b\", which is not a valid DNS-1123 label: must consist of lowercase letters, digits and '-'"
        );
    }

    #[test]
    fn other_containers_may_use_our_paths() {
        let mut ckpt = checkpoint();
        template_mut(&mut ckpt).containers[1]
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(VolumeMount {
                name: "models".to_owned(),
                mount_path: "/etc/podinfo".to_owned(),
                ..VolumeMount::default()
            });
        assert!(build(&ckpt).is_ok());
    }

    #[test]
    fn building_twice_gives_equal_jobs_and_never_mutates_the_checkpoint() {
        let ckpt = checkpoint();
        let before = ckpt.clone();
        let first = build(&ckpt).unwrap();
        let second = build(&ckpt).unwrap();
        assert_eq!(first, second);
        assert_eq!(ckpt.metadata, before.metadata);
        assert_eq!(ckpt.spec, before.spec);
        assert_eq!(ckpt.status, before.status);
    }

    #[test]
    fn job_round_trips_through_json() {
        let job = build(&checkpoint()).unwrap();
        let json = serde_json::to_value(&job).unwrap();
        assert_eq!(
            json["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]["type"],
            "Localhost"
        );
        let back: Job = serde_json::from_value(json).unwrap();
        assert_eq!(back, job);
    }

    fn wrapped() -> Checkpoint {
        let mut ckpt = checkpoint();
        ckpt.spec.job.entrypoint = EntrypointMode::Wrap;
        template_mut(&mut ckpt).termination_grace_period_seconds = Some(45);
        ckpt
    }

    #[test]
    fn wrap_runs_the_target_under_the_entrypoint_with_its_own_readiness_probe() {
        let job = build(&wrapped()).unwrap();
        let main = target(&job, "main");
        assert_eq!(
            main.command.as_deref().unwrap(),
            [
                "/warmstart/bin/warmstart-entrypoint",
                "--",
                "python",
                "-m",
                "serve"
            ]
        );
        // The original probe goes to the entrypoint; kubelet waits for the ready file.
        let probe: Probe = serde_json::from_str(env_value(main, names::ENV_READY_PROBE)).unwrap();
        assert_eq!(probe, http_probe("/ready"));
        assert_eq!(main.readiness_probe, Some(ready_probe()));
        assert_eq!(env_value(main, names::ENV_STOP_GRACE_PERIOD), "45");
        assert_eq!(
            mount(main, names::VOLUME_ENTRYPOINT),
            &wrap::entrypoint_mount()
        );
        assert_eq!(
            volume(&job, names::VOLUME_ENTRYPOINT),
            &wrap::entrypoint_volume()
        );
        let inits = pod_spec(&job).init_containers.as_deref().unwrap();
        assert_eq!(inits[0], wrap::install_init_container(ENTRYPOINT_IMAGE));
        assert_eq!(inits[1].name, "fetch");
        // The sidecar is not wrapped; Native changes nothing of the command.
        assert_eq!(
            target(&job, "sidecar").command,
            container("sidecar").command
        );
        let native = build(&checkpoint()).unwrap();
        assert_eq!(target(&native, "main").command, container("main").command);
        assert!(env_values(target(&native, "main"), names::ENV_READY_PROBE).is_empty());
        assert_eq!(pod_spec(&native).init_containers.as_ref().unwrap().len(), 1);
    }

    #[test]
    fn wrap_needs_a_command_and_a_readiness_probe() {
        let mut ckpt = wrapped();
        template_mut(&mut ckpt).containers[0].command = None;
        let err = build(&ckpt).unwrap_err();
        assert_eq!(
            err,
            JobBuildError::Wrap(WrapError::NoCommand {
                container: "main".to_owned()
            })
        );
        let mut ckpt = wrapped();
        template_mut(&mut ckpt).containers[0].readiness_probe = None;
        assert_eq!(
            build(&ckpt).unwrap_err(),
            JobBuildError::Wrap(WrapError::NoReadinessProbe {
                container: "main".to_owned()
            })
        );
    }
}
