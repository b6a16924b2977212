//! Validation before acting (cluster mode): pure decisions over what the API and the artifact
//! say — whether a pod's `ready` may be answered with a checkpoint, and whether a restore pod
//! may receive a restored process. No I/O here: the caller fetches the Job, the Checkpoint (a
//! direct read, never a cache) and the manifest, and acts only on an `Ok`.
//!
//! Every refusal is a [`Refusal`] whose message names the rule and the objects involved, and
//! whose [`Refusal::metric_label`] labels the refusals counter.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;
use thiserror::Error;
use warmstart_shared::artifact::{Manifest, PathError};
use warmstart_shared::binding::{Binding, BindingError, BindingMismatch};
use warmstart_shared::job::{JobBuildError, resolve_target_container};
use warmstart_shared::names;
use warmstart_shared::restore_pod::{
    RestorePodError, parse_target_containers, validate_restore_pod_runtime,
};
use warmstart_shared::{Checkpoint, CheckpointPhase};

/// Why the agent will not act on a pod.
#[derive(Debug, Error)]
pub enum Refusal {
    /// The pod is bound to another node.
    #[error("pod is bound to node {found:?}, this agent serves {node:?}")]
    OtherNode {
        /// This agent's node.
        node: String,
        /// The pod's `spec.nodeName`.
        found: String,
    },
    /// The pod is not in phase Running.
    #[error("pod is in phase {0}, not Running")]
    NotRunning(String),
    /// The pod is being deleted.
    #[error("pod is terminating")]
    Terminating,
    /// A label a checkpoint source must carry is absent or wrong.
    #[error("pod is not a checkpoint source: label {label} is {found:?}")]
    NotASource {
        /// The label.
        label: &'static str,
        /// Its value (empty when absent).
        found: String,
    },
    /// The pod is not owned by a Job.
    #[error("pod is not owned by a Job (no controller owner reference of kind Job)")]
    NoOwnerJob,
    /// The owning Job is gone.
    #[error("owner Job {0} does not exist")]
    JobMissing(String),
    /// The pod's owner reference names another Job incarnation.
    #[error("owner Job {job} has uid {found}, the pod names {expected}")]
    JobUid {
        /// The Job.
        job: String,
        /// The uid the pod's owner reference names.
        expected: String,
        /// The live Job's uid.
        found: String,
    },
    /// The Job is not owned by a Checkpoint.
    #[error("Job {0} is not owned by a Checkpoint")]
    NoOwnerCheckpoint(String),
    /// The Checkpoint the Job names is gone.
    #[error("Checkpoint {0} does not exist")]
    CheckpointMissing(String),
    /// The Job's owner reference names another Checkpoint incarnation.
    #[error("Checkpoint {checkpoint} has uid {found}, Job {job} names {expected}")]
    CheckpointUid {
        /// The Checkpoint.
        checkpoint: String,
        /// The Job.
        job: String,
        /// The uid the Job names.
        expected: String,
        /// The live Checkpoint's uid.
        found: String,
    },
    /// The Checkpoint is not capturing.
    #[error("Checkpoint {checkpoint} is in phase {phase}, not Creating")]
    NotCreating {
        /// The Checkpoint.
        checkpoint: String,
        /// Its phase.
        phase: String,
    },
    /// The Checkpoint's status disagrees with the pod or the Job.
    #[error("Checkpoint {checkpoint} status.{field} is {found:?}, the pod says {expected:?}")]
    CheckpointMismatch {
        /// The Checkpoint.
        checkpoint: String,
        /// The status field.
        field: &'static str,
        /// What the pod (label) or Job (name) says.
        expected: String,
        /// What the status says.
        found: String,
    },
    /// The target container cannot be chosen.
    #[error("cannot choose the container to checkpoint")]
    Target(#[source] JobBuildError),
    /// The Checkpoint's artifact has no usable path on this node.
    #[error("Checkpoint {checkpoint} has no usable artifact path")]
    ArtifactPath {
        /// The Checkpoint.
        checkpoint: String,
        /// Which element of the path and why.
        #[source]
        source: PathError,
    },
    /// A container to act on is not running.
    #[error("container {0:?} is not running")]
    ContainerNotRunning(String),
    /// A container's runtime id is absent or of an unknown runtime.
    #[error(
        "container {container:?} has runtime id {id:?}: expected containerd://, cri-o:// or runc://"
    )]
    ContainerId {
        /// The container.
        container: String,
        /// The id found.
        id: String,
    },
    /// A restore pod lacks an annotation the webhook stamps.
    #[error("pod has no {0} annotation (it was not admitted by the warmstart webhook)")]
    MissingAnnotation(&'static str),
    /// The binding does not parse.
    #[error("invalid {annotation}", annotation = names::ANNOTATION_CHECKPOINT_BINDING)]
    Binding(#[source] BindingError),
    /// The binding pins another Checkpoint incarnation or artifact.
    #[error("stale {annotation} for Checkpoint {checkpoint}", annotation = names::ANNOTATION_CHECKPOINT_BINDING)]
    StaleBinding {
        /// The Checkpoint.
        checkpoint: String,
        /// What differs.
        #[source]
        source: BindingMismatch,
    },
    /// The Checkpoint to restore from is not Ready.
    #[error("Checkpoint {checkpoint} is in phase {phase}, not Ready")]
    NotReady {
        /// The Checkpoint.
        checkpoint: String,
        /// Its phase.
        phase: String,
    },
    /// The restore pod does not follow the restore-pod contract.
    #[error("pod does not follow the restore-pod contract")]
    Contract(#[source] RestorePodError),
    /// The on-disk manifest is not the one the Checkpoint was verified with.
    #[error(
        "artifact manifest on disk is {on_disk}, Checkpoint {checkpoint} was verified with {in_status} (the artifact was replaced)"
    )]
    ManifestReplaced {
        /// The Checkpoint.
        checkpoint: String,
        /// Digest of the manifest on disk.
        on_disk: String,
        /// Digest in `status.artifact.manifestDigest`.
        in_status: String,
    },
    /// A target container was not captured by the checkpoint.
    #[error(
        "target container {target:?} was not captured by the checkpoint (it captured {captured:?})"
    )]
    NotCaptured {
        /// The target.
        target: String,
        /// The container the checkpoint captured.
        captured: String,
    },
    /// A container other than the target can write the target's control directory.
    #[error(
        "container {writer:?} mounts the control volume {volume} at {path} and could write the control directory of {target:?}"
    )]
    ControlWriter {
        /// The other container.
        writer: String,
        /// The volume.
        volume: &'static str,
        /// Where it mounts it.
        path: String,
        /// The target whose directory it reaches.
        target: String,
    },
}

impl Refusal {
    /// A short, stable label for metrics and Event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::OtherNode { .. } => "other-node",
            Self::NotRunning(_) | Self::Terminating => "pod-state",
            Self::NotASource { .. } => "not-a-source",
            Self::NoOwnerJob | Self::JobMissing(_) | Self::JobUid { .. } => "job-mismatch",
            Self::NoOwnerCheckpoint(_)
            | Self::CheckpointMissing(_)
            | Self::CheckpointUid { .. }
            | Self::NotCreating { .. }
            | Self::CheckpointMismatch { .. } => "checkpoint-mismatch",
            Self::Target(_) | Self::ArtifactPath { .. } | Self::NotCaptured { .. } => "target",
            Self::ContainerNotRunning(_) | Self::ContainerId { .. } => "container-state",
            Self::MissingAnnotation(_) | Self::Binding(_) | Self::StaleBinding { .. } => "binding",
            Self::NotReady { .. } => "not-ready",
            Self::Contract(_) | Self::ControlWriter { .. } => "contract",
            Self::ManifestReplaced { .. } => "artifact",
        }
    }
}

/// What a checkpoint source pod claims through its labels and owner reference: the caller
/// fetches the Job and the Checkpoint it names, then calls [`checkpoint_target`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceClaims {
    /// The owning Job's name.
    pub job: String,
    /// The owning Job's uid, from the pod's owner reference.
    pub job_uid: String,
    /// `warmstart.dev/checkpoint-name`.
    pub checkpoint: String,
    /// `warmstart.dev/checkpoint-hash`.
    pub hash: String,
    /// `warmstart.dev/checkpoint-target`: the target container, resolved when the Job was
    /// built (absent on pods of Jobs built before it was recorded).
    pub target: Option<String>,
}

/// The container a validated checkpoint captures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointTarget {
    /// The container's name.
    pub container: String,
    /// Its runtime id, as the pod status gives it (`containerd://…`).
    pub container_id: String,
    /// The identity hash.
    pub hash: String,
    /// The Checkpoint's name.
    pub checkpoint: String,
    /// `status.location` of the Checkpoint (`<namespace>/<hash>`).
    pub location: String,
}

/// The pod-level checks of a checkpoint source: bound to `node`, Running, not terminating,
/// labelled as a source with name and hash, owned by a Job.
///
/// # Errors
/// The first rule the pod breaks.
pub fn source_claims(node: &str, pod: &Pod) -> Result<SourceClaims, Refusal> {
    check_pod_state(node, pod)?;
    let label = |name: &'static str| pod.labels().get(name).cloned().unwrap_or_default();
    let source = label(names::LABEL_CHECKPOINT_SOURCE);
    if source != names::LABEL_CHECKPOINT_SOURCE_VALUE {
        return Err(Refusal::NotASource {
            label: names::LABEL_CHECKPOINT_SOURCE,
            found: source,
        });
    }
    let mut claims = SourceClaims {
        job: String::new(),
        job_uid: String::new(),
        checkpoint: label(names::LABEL_CHECKPOINT_NAME),
        hash: label(names::LABEL_CHECKPOINT_HASH),
        target: pod
            .annotations()
            .get(names::ANNOTATION_CHECKPOINT_TARGET)
            .cloned(),
    };
    for (label, value) in [
        (names::LABEL_CHECKPOINT_NAME, &claims.checkpoint),
        (names::LABEL_CHECKPOINT_HASH, &claims.hash),
    ] {
        if value.is_empty() {
            return Err(Refusal::NotASource {
                label,
                found: String::new(),
            });
        }
    }
    let owner = pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "Job" && o.api_version == "batch/v1")
        .ok_or(Refusal::NoOwnerJob)?;
    claims.job.clone_from(&owner.name);
    claims.job_uid.clone_from(&owner.uid);
    Ok(claims)
}

/// Checks the owner chain pod → Job → Checkpoint and the Checkpoint's state, then chooses the
/// target container. `job` and `checkpoint` are the live objects the claims name (`None` when
/// they do not exist).
///
/// # Errors
/// The first rule broken.
pub fn checkpoint_target(
    pod: &Pod,
    claims: &SourceClaims,
    job: Option<&Job>,
    checkpoint: Option<&Checkpoint>,
) -> Result<CheckpointTarget, Refusal> {
    let job = job.ok_or_else(|| Refusal::JobMissing(claims.job.clone()))?;
    let job_uid = job.uid().unwrap_or_default();
    if job_uid != claims.job_uid {
        return Err(Refusal::JobUid {
            job: claims.job.clone(),
            expected: claims.job_uid.clone(),
            found: job_uid,
        });
    }
    let owner = job
        .owner_references()
        .iter()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == names::CHECKPOINT_KIND
                && o.api_version == format!("{}/{}", names::API_GROUP, names::API_VERSION)
        })
        .ok_or_else(|| Refusal::NoOwnerCheckpoint(claims.job.clone()))?;
    if owner.name != claims.checkpoint {
        return Err(Refusal::CheckpointMismatch {
            checkpoint: owner.name.clone(),
            field: "metadata.name",
            expected: claims.checkpoint.clone(),
            found: owner.name.clone(),
        });
    }
    let checkpoint =
        checkpoint.ok_or_else(|| Refusal::CheckpointMissing(claims.checkpoint.clone()))?;
    let uid = checkpoint.uid().unwrap_or_default();
    if uid != owner.uid {
        return Err(Refusal::CheckpointUid {
            checkpoint: claims.checkpoint.clone(),
            job: claims.job.clone(),
            expected: owner.uid.clone(),
            found: uid,
        });
    }
    let status = checkpoint.status.clone().unwrap_or_default();
    if status.phase != Some(CheckpointPhase::Creating) {
        return Err(Refusal::NotCreating {
            checkpoint: claims.checkpoint.clone(),
            phase: phase_name(status.phase),
        });
    }
    for (field, expected, found) in [
        (
            "identityHash",
            &claims.hash,
            status.identity_hash.clone().unwrap_or_default(),
        ),
        (
            "jobName",
            &claims.job,
            status.job_name.clone().unwrap_or_default(),
        ),
    ] {
        if *expected != found {
            return Err(Refusal::CheckpointMismatch {
                checkpoint: claims.checkpoint.clone(),
                field,
                expected: expected.clone(),
                found,
            });
        }
    }
    let location = status.location.clone().unwrap_or_default();
    if location.is_empty() {
        return Err(Refusal::CheckpointMismatch {
            checkpoint: claims.checkpoint.clone(),
            field: "location",
            expected: format!("<namespace>/{}", claims.hash),
            found: location,
        });
    }
    let spec = pod
        .spec
        .as_ref()
        .ok_or(Refusal::Target(JobBuildError::MissingPodSpec))?;
    // The target recorded on the pod when its Job was built, never the Checkpoint's live spec,
    // which can be edited while the Job runs; the spec only for pods that record none.
    let requested = claims.target.as_deref().or(checkpoint
        .spec
        .job
        .target_container_name
        .as_deref());
    let container = resolve_target_container(spec, requested).map_err(Refusal::Target)?;
    let container_id = running_container_id(pod, &container)?;
    Ok(CheckpointTarget {
        container,
        container_id,
        hash: claims.hash.clone(),
        checkpoint: claims.checkpoint.clone(),
        location,
    })
}

/// What a restore pod asks for, from its annotations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreIntent {
    /// The Checkpoint's name (`restore-from`).
    pub checkpoint: String,
    /// The parsed binding.
    pub binding: Binding,
    /// The target containers.
    pub targets: Vec<String>,
}

/// A validated restore: the containers it goes into and the artifact it must restore.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidRestore {
    /// The placeholders, running.
    pub targets: Vec<RestoreTarget>,
    /// The digest of the manifest checked against the binding (the Checkpoint's
    /// `status.artifact.manifestDigest`, which the binding pins): the restore must restore an
    /// artifact with exactly this manifest.
    pub manifest_digest: String,
}

/// One container a validated restore goes into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreTarget {
    /// The placeholder container's name.
    pub container: String,
    /// Its runtime id.
    pub container_id: String,
}

/// The pod-level checks of a restore pod: `None` when the pod asks for no restore; else bound to
/// `node`, Running, not terminating, the binding and targets parse, the pod follows the
/// restore-pod contract (runtime validator) and no other container can write a target's
/// control directory.
///
/// # Errors
/// The first rule broken.
pub fn restore_intent(node: &str, pod: &Pod) -> Result<Option<RestoreIntent>, Refusal> {
    let annotations = pod.annotations();
    let Some(checkpoint) = annotations.get(names::ANNOTATION_RESTORE_FROM) else {
        return Ok(None);
    };
    check_pod_state(node, pod)?;
    let binding = annotations
        .get(names::ANNOTATION_CHECKPOINT_BINDING)
        .ok_or(Refusal::MissingAnnotation(
            names::ANNOTATION_CHECKPOINT_BINDING,
        ))?
        .parse::<Binding>()
        .map_err(Refusal::Binding)?;
    let targets =
        parse_target_containers(annotations.get(names::ANNOTATION_TARGET_CONTAINERS).ok_or(
            Refusal::MissingAnnotation(names::ANNOTATION_TARGET_CONTAINERS),
        )?)
        .map_err(Refusal::Contract)?;
    // Writers first: the shared validator refuses them too, but this refusal names the target
    // whose control directory is reachable.
    check_control_writers(pod, &targets)?;
    validate_restore_pod_runtime(pod, &targets).map_err(Refusal::Contract)?;
    Ok(Some(RestoreIntent {
        checkpoint: checkpoint.clone(),
        binding,
        targets,
    }))
}

/// Checks the live Checkpoint and the artifact's manifest against the intent, and finds the
/// running placeholder containers.
///
/// # Errors
/// The first rule broken.
pub fn restore_targets(
    pod: &Pod,
    intent: &RestoreIntent,
    checkpoint: Option<&Checkpoint>,
    manifest: &Manifest,
) -> Result<ValidRestore, Refusal> {
    let checkpoint =
        checkpoint.ok_or_else(|| Refusal::CheckpointMissing(intent.checkpoint.clone()))?;
    let phase = checkpoint.status.as_ref().and_then(|s| s.phase);
    if phase != Some(CheckpointPhase::Ready) {
        return Err(Refusal::NotReady {
            checkpoint: intent.checkpoint.clone(),
            phase: phase_name(phase),
        });
    }
    let live = Binding::for_checkpoint(checkpoint).map_err(Refusal::Binding)?;
    intent
        .binding
        .verify(&live)
        .map_err(|source| Refusal::StaleBinding {
            checkpoint: intent.checkpoint.clone(),
            source,
        })?;
    let in_status = checkpoint
        .status
        .as_ref()
        .and_then(|s| s.artifact.as_ref())
        .map(|a| a.manifest_digest.clone())
        .unwrap_or_default();
    if manifest.digest != in_status {
        return Err(Refusal::ManifestReplaced {
            checkpoint: intent.checkpoint.clone(),
            on_disk: manifest.digest.clone(),
            in_status,
        });
    }
    let targets = intent
        .targets
        .iter()
        .map(|target| {
            if *target != manifest.source.container {
                return Err(Refusal::NotCaptured {
                    target: target.clone(),
                    captured: manifest.source.container.clone(),
                });
            }
            Ok(RestoreTarget {
                container: target.clone(),
                container_id: running_container_id(pod, target)?,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(ValidRestore {
        targets,
        manifest_digest: in_status,
    })
}

/// The runtime id of a running container of `pod`.
///
/// # Errors
/// [`Refusal::ContainerNotRunning`] or [`Refusal::ContainerId`].
pub fn running_container_id(pod: &Pod, container: &str) -> Result<String, Refusal> {
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|list| list.iter().find(|c| c.name == container))
        .ok_or_else(|| Refusal::ContainerNotRunning(container.to_owned()))?;
    if status
        .state
        .as_ref()
        .and_then(|s| s.running.as_ref())
        .is_none()
    {
        return Err(Refusal::ContainerNotRunning(container.to_owned()));
    }
    let id = status.container_id.clone().unwrap_or_default();
    let known = ["containerd://", "cri-o://", "runc://"];
    if !known
        .iter()
        .any(|p| id.len() > p.len() && id.starts_with(p))
    {
        return Err(Refusal::ContainerId {
            container: container.to_owned(),
            id,
        });
    }
    Ok(id)
}

fn check_pod_state(node: &str, pod: &Pod) -> Result<(), Refusal> {
    let bound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    if bound != node {
        return Err(Refusal::OtherNode {
            node: node.to_owned(),
            found: bound,
        });
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(Refusal::Terminating);
    }
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    if phase != "Running" {
        return Err(Refusal::NotRunning(if phase.is_empty() {
            "(none)".into()
        } else {
            phase
        }));
    }
    Ok(())
}

/// No container but a target itself may mount the control volume, and a target only its own
/// sub-directory: anyone else could write `restore-complete` and open the startup gate before
/// a restore, or `restore-failed` and force a cold start.
fn check_control_writers(pod: &Pod, targets: &[String]) -> Result<(), Refusal> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(());
    };
    let all = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter());
    let first_target = targets.first().cloned().unwrap_or_default();
    for container in all {
        for mount in mounts_of(container) {
            if mount.name != names::VOLUME_CONTROL {
                continue;
            }
            let own = targets.contains(&container.name)
                && mount.sub_path.as_deref() == Some(container.name.as_str());
            if !own {
                let reached = mount
                    .sub_path
                    .clone()
                    .filter(|s| targets.contains(s))
                    .unwrap_or_else(|| first_target.clone());
                return Err(Refusal::ControlWriter {
                    writer: container.name.clone(),
                    volume: names::VOLUME_CONTROL,
                    path: mount.mount_path.clone(),
                    target: reached,
                });
            }
        }
    }
    Ok(())
}

fn mounts_of(
    container: &Container,
) -> impl Iterator<Item = &k8s_openapi::api::core::v1::VolumeMount> {
    container.volume_mounts.iter().flatten()
}

fn phase_name(phase: Option<CheckpointPhase>) -> String {
    phase.map_or_else(|| "(none)".to_owned(), |p| format!("{p:?}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use warmstart_shared::artifact::{CriuInfo, MANIFEST_FORMAT_VERSION, SourceInfo};
    use warmstart_shared::restore_pod::build_restore_pod;
    use warmstart_shared::v1alpha1::{ArtifactStatus, CheckpointStatus};

    use super::*;

    const NODE: &str = "gpu-1";
    const HASH: &str = "96429b2725761a09";

    fn running(pod: &mut Pod, containers: &[(&str, &str)]) {
        let status = pod.status.get_or_insert_with(Default::default);
        status.phase = Some("Running".into());
        status.container_statuses = Some(
            containers
                .iter()
                .map(|(name, id)| ContainerStatus {
                    name: (*name).into(),
                    container_id: Some((*id).into()),
                    state: Some(ContainerState {
                        running: Some(ContainerStateRunning::default()),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        );
    }

    fn checkpoint(phase: CheckpointPhase) -> Checkpoint {
        let mut ck: Checkpoint = serde_json::from_value(serde_json::json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": "llama", "namespace": "default", "uid": "ck-uid", "generation": 1},
            "spec": {"identity": {"model": "m", "backendFramework": "vllm"},
                     "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main"}]}}}}
        }))
        .unwrap();
        ck.status = Some(CheckpointStatus {
            phase: Some(phase),
            identity_hash: Some(HASH.into()),
            job_name: Some("checkpoint-llama".into()),
            location: Some(format!("default/{HASH}")),
            artifact: Some(ArtifactStatus {
                manifest_digest: format!("sha256:{}", "a".repeat(64)),
                ..Default::default()
            }),
            ..Default::default()
        });
        ck
    }

    fn job() -> Job {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "checkpoint-llama", "namespace": "default", "uid": "job-uid",
              "ownerReferences": [{"apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
                "name": "llama", "uid": "ck-uid", "controller": true}]}
        }))
        .unwrap()
    }

    fn source_pod() -> Pod {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "checkpoint-llama-x", "namespace": "default", "uid": "pod-uid",
              "labels": {"warmstart.dev/checkpoint-source": "true",
                         "warmstart.dev/checkpoint-name": "llama",
                         "warmstart.dev/checkpoint-hash": HASH}},
            "spec": {"nodeName": NODE, "containers": [{"name": "main"}, {"name": "side"}]}
        }))
        .unwrap();
        pod.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "batch/v1".into(),
            kind: "Job".into(),
            name: "checkpoint-llama".into(),
            uid: "job-uid".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        running(
            &mut pod,
            &[("main", "containerd://abc"), ("side", "containerd://def")],
        );
        pod
    }

    fn validate_source(
        pod: &Pod,
        job: Option<&Job>,
        ck: Option<&Checkpoint>,
    ) -> Result<CheckpointTarget, Refusal> {
        let claims = source_claims(NODE, pod)?;
        checkpoint_target(pod, &claims, job, ck)
    }

    #[test]
    fn a_valid_source_pod_yields_its_target_container() {
        let t = validate_source(
            &source_pod(),
            Some(&job()),
            Some(&checkpoint(CheckpointPhase::Creating)),
        )
        .unwrap();
        assert_eq!(t.container, "main");
        assert_eq!(t.container_id, "containerd://abc");
        assert_eq!(t.hash, HASH);
        assert_eq!(t.location, format!("default/{HASH}"));
    }

    #[test]
    fn the_target_recorded_on_the_pod_wins_over_the_live_spec() {
        let mut edited = checkpoint(CheckpointPhase::Creating);
        edited.spec.job.target_container_name = Some("side".into());
        let mut pod = source_pod();
        pod.annotations_mut()
            .insert(names::ANNOTATION_CHECKPOINT_TARGET.into(), "main".into());
        let t = validate_source(&pod, Some(&job()), Some(&edited)).unwrap();
        assert_eq!(
            (t.container.as_str(), t.container_id.as_str()),
            ("main", "containerd://abc")
        );
        // A pod of a Job built before the target was recorded: the spec says.
        let t = validate_source(&source_pod(), Some(&job()), Some(&edited)).unwrap();
        assert_eq!(t.container, "side");
        pod.annotations_mut()
            .insert(names::ANNOTATION_CHECKPOINT_TARGET.into(), "gone".into());
        let err = validate_source(&pod, Some(&job()), Some(&edited)).unwrap_err();
        assert!(
            matches!(
                err,
                Refusal::Target(JobBuildError::TargetContainerNotFound { ref name, .. }) if name == "gone"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_pod_that_is_not_a_source_is_refused() {
        let mut pod = source_pod();
        pod.labels_mut().remove(names::LABEL_CHECKPOINT_SOURCE);
        let err = source_claims(NODE, &pod).unwrap_err();
        assert!(matches!(err, Refusal::NotASource { .. }), "{err}");
        let mut pod = source_pod();
        pod.labels_mut().remove(names::LABEL_CHECKPOINT_HASH);
        assert!(
            matches!(source_claims(NODE, &pod), Err(Refusal::NotASource { label, .. }) if label == names::LABEL_CHECKPOINT_HASH)
        );
    }

    #[test]
    fn pod_state_is_checked() {
        let pod = source_pod();
        assert!(matches!(
            source_claims("gpu-2", &pod),
            Err(Refusal::OtherNode { .. })
        ));
        let mut pending = source_pod();
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(matches!(
            source_claims(NODE, &pending),
            Err(Refusal::NotRunning(ref phase)) if phase == "Pending"
        ));
        let mut deleting = source_pod();
        deleting.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        assert!(matches!(
            source_claims(NODE, &deleting),
            Err(Refusal::Terminating)
        ));
    }

    #[test]
    fn owner_chain_must_match() {
        let mut orphan = source_pod();
        orphan.metadata.owner_references = None;
        assert!(matches!(
            source_claims(NODE, &orphan),
            Err(Refusal::NoOwnerJob)
        ));
        let ck = checkpoint(CheckpointPhase::Creating);
        let pod = source_pod();
        assert!(matches!(
            validate_source(&pod, None, Some(&ck)),
            Err(Refusal::JobMissing(_))
        ));
        let mut other_job = job();
        other_job.metadata.uid = Some("other".into());
        assert!(matches!(
            validate_source(&pod, Some(&other_job), Some(&ck)),
            Err(Refusal::JobUid { .. })
        ));
        let mut unowned = job();
        unowned.metadata.owner_references = None;
        assert!(matches!(
            validate_source(&pod, Some(&unowned), Some(&ck)),
            Err(Refusal::NoOwnerCheckpoint(_))
        ));
        assert!(matches!(
            validate_source(&pod, Some(&job()), None),
            Err(Refusal::CheckpointMissing(_))
        ));
        let mut recreated = ck.clone();
        recreated.metadata.uid = Some("new-uid".into());
        assert!(matches!(
            validate_source(&pod, Some(&job()), Some(&recreated)),
            Err(Refusal::CheckpointUid { .. })
        ));
    }

    #[test]
    fn checkpoint_must_be_creating_with_the_pods_hash_and_job() {
        let pod = source_pod();
        let err = validate_source(
            &pod,
            Some(&job()),
            Some(&checkpoint(CheckpointPhase::Ready)),
        )
        .unwrap_err();
        assert!(matches!(err, Refusal::NotCreating { .. }), "{err}");
        let mut other_hash = checkpoint(CheckpointPhase::Creating);
        other_hash.status.as_mut().unwrap().identity_hash = Some("0000000000000000".into());
        let err = validate_source(&pod, Some(&job()), Some(&other_hash)).unwrap_err();
        assert!(
            matches!(
                err,
                Refusal::CheckpointMismatch {
                    field: "identityHash",
                    ..
                }
            ),
            "{err}"
        );
        let mut other_job = checkpoint(CheckpointPhase::Creating);
        other_job.status.as_mut().unwrap().job_name = Some("checkpoint-other".into());
        let err = validate_source(&pod, Some(&job()), Some(&other_job)).unwrap_err();
        assert!(
            matches!(
                err,
                Refusal::CheckpointMismatch {
                    field: "jobName",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn the_target_must_run_with_a_known_runtime_id() {
        let ck = checkpoint(CheckpointPhase::Creating);
        let mut pod = source_pod();
        running(&mut pod, &[("main", "docker://abc")]);
        assert!(matches!(
            validate_source(&pod, Some(&job()), Some(&ck)),
            Err(Refusal::ContainerId { .. })
        ));
        let mut pod = source_pod();
        running(&mut pod, &[("side", "containerd://def")]);
        assert!(matches!(
            validate_source(&pod, Some(&job()), Some(&ck)),
            Err(Refusal::ContainerNotRunning(_))
        ));
        let mut pod = source_pod();
        running(&mut pod, &[("main", "runc://abc")]);
        assert_eq!(
            validate_source(&pod, Some(&job()), Some(&ck))
                .unwrap()
                .container_id,
            "runc://abc"
        );
    }

    fn manifest(container: &str, digest: &str) -> Manifest {
        Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: HASH.into(),
            created_at: String::new(),
            source: SourceInfo {
                container: container.into(),
                ..Default::default()
            },
            criu: CriuInfo::default(),
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: Default::default(),
            chunk_bytes: warmstart_shared::filehash::CHUNK_BYTES,
            files: vec![],
            digest: digest.into(),
        }
    }

    fn restore_pod(targets: &str) -> Pod {
        let ck = checkpoint(CheckpointPhase::Ready);
        let binding = Binding::for_checkpoint(&ck).unwrap().to_string();
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "replica", "namespace": "default", "uid": "r-uid",
              "annotations": {"warmstart.dev/restore-from": "llama",
                              "warmstart.dev/target-containers": targets,
                              "warmstart.dev/checkpoint-binding": binding}},
            "spec": {"nodeName": NODE, "containers": [{"name": "main"}, {"name": "side"}]}
        }))
        .unwrap();
        let list = parse_target_containers(targets).unwrap();
        let mut pod = build_restore_pod(&pod, &list).unwrap();
        running(
            &mut pod,
            &[("main", "containerd://p1"), ("side", "containerd://p2")],
        );
        pod
    }

    fn digest() -> String {
        format!("sha256:{}", "a".repeat(64))
    }

    #[test]
    fn pods_without_restore_from_are_not_restore_pods() {
        assert!(matches!(restore_intent(NODE, &source_pod()), Ok(None)));
    }

    #[test]
    fn a_valid_restore_pod_yields_its_placeholders() {
        let pod = restore_pod("main");
        let intent = restore_intent(NODE, &pod).unwrap().unwrap();
        let targets = restore_targets(
            &pod,
            &intent,
            Some(&checkpoint(CheckpointPhase::Ready)),
            &manifest("main", &digest()),
        )
        .unwrap();
        assert_eq!(
            targets,
            ValidRestore {
                targets: vec![RestoreTarget {
                    container: "main".into(),
                    container_id: "containerd://p1".into()
                }],
                manifest_digest: digest(),
            }
        );
    }

    #[test]
    fn restore_refusals_name_their_reason() {
        let pod = restore_pod("main");
        let intent = restore_intent(NODE, &pod).unwrap().unwrap();
        let ready = checkpoint(CheckpointPhase::Ready);
        let m = manifest("main", &digest());
        assert!(matches!(
            restore_targets(&pod, &intent, None, &m),
            Err(Refusal::CheckpointMissing(_))
        ));
        assert!(matches!(
            restore_targets(
                &pod,
                &intent,
                Some(&checkpoint(CheckpointPhase::Failed)),
                &m
            ),
            Err(Refusal::NotReady { .. })
        ));
        let mut recreated = ready.clone();
        recreated.metadata.uid = Some("new".into());
        let err = restore_targets(&pod, &intent, Some(&recreated), &m).unwrap_err();
        assert!(matches!(err, Refusal::StaleBinding { .. }), "{err}");
        let other = manifest("main", &format!("sha256:{}", "b".repeat(64)));
        assert!(matches!(
            restore_targets(&pod, &intent, Some(&ready), &other),
            Err(Refusal::ManifestReplaced { .. })
        ));
        let sidecar = restore_pod("side");
        let intent = restore_intent(NODE, &sidecar).unwrap().unwrap();
        let err = restore_targets(&sidecar, &intent, Some(&ready), &m).unwrap_err();
        assert!(
            matches!(
                err,
                Refusal::NotCaptured { ref target, ref captured }
                    if target == "side" && captured == "main"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_garbage_or_missing_binding_is_refused() {
        let mut pod = restore_pod("main");
        pod.annotations_mut().insert(
            names::ANNOTATION_CHECKPOINT_BINDING.into(),
            "garbage".into(),
        );
        assert!(matches!(
            restore_intent(NODE, &pod),
            Err(Refusal::Binding(_))
        ));
        pod.annotations_mut()
            .remove(names::ANNOTATION_CHECKPOINT_BINDING);
        assert!(matches!(
            restore_intent(NODE, &pod),
            Err(Refusal::MissingAnnotation(_))
        ));
    }

    #[test]
    fn another_container_mounting_the_control_volume_is_refused() {
        let mut pod = restore_pod("main");
        let side = &mut pod.spec.as_mut().unwrap().containers[1];
        side.volume_mounts = Some(vec![k8s_openapi::api::core::v1::VolumeMount {
            name: names::VOLUME_CONTROL.into(),
            mount_path: "/ctl".into(),
            ..Default::default()
        }]);
        let err = restore_intent(NODE, &pod).unwrap_err();
        assert!(
            matches!(err, Refusal::ControlWriter { ref writer, .. } if writer == "side"),
            "{err}"
        );
        let mut pod = restore_pod("main");
        pod.spec.as_mut().unwrap().init_containers = Some(vec![Container {
            name: "init".into(),
            volume_mounts: Some(vec![k8s_openapi::api::core::v1::VolumeMount {
                name: names::VOLUME_CONTROL.into(),
                mount_path: "/ctl".into(),
                sub_path: Some("main".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }]);
        let err = restore_intent(NODE, &pod).unwrap_err();
        assert!(
            matches!(err, Refusal::ControlWriter { ref writer, ref target, .. } if writer == "init" && target == "main"),
            "{err}"
        );
    }

    #[test]
    fn a_pod_off_contract_is_refused() {
        let mut pod = restore_pod("main");
        pod.spec.as_mut().unwrap().containers[0].startup_probe = None;
        assert!(matches!(
            restore_intent(NODE, &pod),
            Err(Refusal::Contract(_))
        ));
    }
}
