//! Shaping a restore pod for a checkpoint: the decision the admission webhook makes, also used
//! by `render-restore-pod`. All or nothing: the input pod is never half-shaped.
//!
//! Besides the restore-pod builder's rules: a pod that already carries a checkpoint binding is
//! shaped only if that binding is valid and current (uid and digest of the live checkpoint), and
//! every target container must be the container the checkpoint captured.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use thiserror::Error;
use warmstart_shared::binding::{Binding, BindingError, BindingMismatch};
use warmstart_shared::job::{JobBuildError, resolve_target_container};
use warmstart_shared::names::{
    ANNOTATION_CHECKPOINT_BINDING, ANNOTATION_RESTORE_FROM, ANNOTATION_TARGET_CONTAINERS,
};
use warmstart_shared::restore_pod::{self, RestorePodError};
use warmstart_shared::{Checkpoint, CheckpointPhase, EntrypointMode};

/// Why a pod cannot be shaped to restore from a checkpoint.
#[derive(Debug, Error)]
pub enum RestoreShapeError {
    /// The pod does not carry the restore annotation.
    #[error("pod {pod} has no {ANNOTATION_RESTORE_FROM} annotation")]
    NotARestorePod {
        /// `<namespace>/<name>` of the pod.
        pod: String,
    },
    /// The pod names another checkpoint than the one given.
    #[error("pod {pod} restores from checkpoint {wanted:?}, but checkpoint {given:?} was given")]
    OtherCheckpoint {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// The annotation's value.
        wanted: String,
        /// The checkpoint's name.
        given: String,
    },
    /// Checkpoint and pod live in different namespaces.
    #[error(
        "checkpoint {checkpoint} is in namespace {checkpoint_namespace:?}, pod {pod} in {pod_namespace:?}: a pod restores only from its own namespace"
    )]
    OtherNamespace {
        /// The checkpoint's name.
        checkpoint: String,
        /// Its namespace.
        checkpoint_namespace: String,
        /// The pod's name.
        pod: String,
        /// Its namespace.
        pod_namespace: String,
    },
    /// The checkpoint is not Ready.
    #[error("checkpoint {checkpoint} is not Ready (phase {phase})")]
    NotReady {
        /// `<namespace>/<name>` of the checkpoint.
        checkpoint: String,
        /// Its phase, or `unknown`.
        phase: String,
    },
    /// The target-containers annotation is absent.
    #[error(
        "pod {pod} has no {ANNOTATION_TARGET_CONTAINERS} annotation naming the containers to restore"
    )]
    NoTargets {
        /// `<namespace>/<name>` of the pod.
        pod: String,
    },
    /// The checkpoint cannot be bound (incomplete status).
    #[error(transparent)]
    Binding(#[from] BindingError),
    /// The pod already carries a binding that does not parse.
    #[error("pod {pod} already carries an invalid {ANNOTATION_CHECKPOINT_BINDING} annotation")]
    InvalidExistingBinding {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// Why it does not parse.
        #[source]
        source: BindingError,
    },
    /// The pod already carries a binding to another checkpoint incarnation or artifact.
    #[error(
        "pod {pod} already carries a {ANNOTATION_CHECKPOINT_BINDING} that is not current for checkpoint {checkpoint}"
    )]
    StaleExistingBinding {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// `<namespace>/<name>` of the checkpoint.
        checkpoint: String,
        /// Which parts differ.
        #[source]
        source: BindingMismatch,
    },
    /// A target container is not the container the checkpoint captured.
    #[error(
        "pod {pod}: target container {target:?} was not captured by checkpoint {checkpoint} (it captured {captured:?})"
    )]
    NotCaptured {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// `<namespace>/<name>` of the checkpoint.
        checkpoint: String,
        /// The target.
        target: String,
        /// The container the checkpoint holds.
        captured: String,
    },
    /// The checkpoint neither records the captured container nor lets it be resolved.
    #[error("checkpoint {checkpoint} does not say which container it captured")]
    UnknownCapture {
        /// `<namespace>/<name>` of the checkpoint.
        checkpoint: String,
        /// Why its Job's target cannot be resolved.
        #[source]
        source: JobBuildError,
    },
    /// The restore-pod builder refused the pod.
    #[error("pod {pod} cannot be shaped for restore")]
    Build {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// The builder's reason.
        #[source]
        source: RestorePodError,
    },
}

/// Shapes `pod` (created in `namespace`) to restore from `checkpoint`: checks the annotation,
/// namespace and phase, stamps the checkpoint binding, and applies the restore-pod builder;
/// for a checkpoint whose Job ran with `entrypoint: Wrap` (`status.entrypoint`), its targets
/// run under `warmstart-entrypoint` installed from `entrypoint_image`, in standby.
///
/// # Errors
/// [`RestoreShapeError`] naming the pod, the checkpoint and the rule; `pod` is untouched.
pub fn shape_restore_pod(
    pod: &Pod,
    namespace: &str,
    checkpoint: &Checkpoint,
    entrypoint_image: &str,
) -> Result<Pod, RestoreShapeError> {
    let pod_name = pod
        .metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.as_ref().map(|g| format!("{g}*")))
        .unwrap_or_default();
    let pod_key = format!("{namespace}/{pod_name}");
    let annotations = pod.annotations();
    let wanted = annotations.get(ANNOTATION_RESTORE_FROM).ok_or_else(|| {
        RestoreShapeError::NotARestorePod {
            pod: pod_key.clone(),
        }
    })?;
    let checkpoint_name = checkpoint.name_any();
    if *wanted != checkpoint_name {
        return Err(RestoreShapeError::OtherCheckpoint {
            pod: pod_key,
            wanted: wanted.clone(),
            given: checkpoint_name,
        });
    }
    let checkpoint_namespace = checkpoint.namespace().unwrap_or_default();
    if checkpoint_namespace != namespace {
        return Err(RestoreShapeError::OtherNamespace {
            checkpoint: checkpoint_name,
            checkpoint_namespace,
            pod: pod_name,
            pod_namespace: namespace.to_owned(),
        });
    }
    let phase = checkpoint.status.as_ref().and_then(|s| s.phase);
    if phase != Some(CheckpointPhase::Ready) {
        return Err(RestoreShapeError::NotReady {
            checkpoint: format!("{checkpoint_namespace}/{checkpoint_name}"),
            phase: phase.map_or_else(|| "unknown".to_owned(), |p| p.to_string()),
        });
    }
    let targets = annotations
        .get(ANNOTATION_TARGET_CONTAINERS)
        .ok_or_else(|| RestoreShapeError::NoTargets {
            pod: pod_key.clone(),
        })?;
    let build_err = |source| RestoreShapeError::Build {
        pod: pod_key.clone(),
        source,
    };
    let targets = restore_pod::parse_target_containers(targets).map_err(build_err)?;
    let wrapped =
        checkpoint.status.as_ref().and_then(|s| s.entrypoint) == Some(EntrypointMode::Wrap);
    let mut shaped =
        restore_pod::build_restore_pod_with(pod, &targets, wrapped.then_some(entrypoint_image))
            .map_err(build_err)?;
    let checkpoint_key = format!("{checkpoint_namespace}/{checkpoint_name}");
    let captured =
        captured_container(checkpoint).map_err(|source| RestoreShapeError::UnknownCapture {
            checkpoint: checkpoint_key.clone(),
            source,
        })?;
    if let Some(target) = targets.iter().find(|t| **t != captured) {
        return Err(RestoreShapeError::NotCaptured {
            pod: pod_key,
            checkpoint: checkpoint_key,
            target: target.clone(),
            captured,
        });
    }
    let binding = Binding::for_checkpoint(checkpoint)?;
    // A binding already on the pod (a copied manifest, a pod re-created from another's spec)
    // is never silently replaced: it must pin the checkpoint as it is now.
    if let Some(existing) = annotations.get(ANNOTATION_CHECKPOINT_BINDING) {
        let existing = existing.parse::<Binding>().map_err(|source| {
            RestoreShapeError::InvalidExistingBinding {
                pod: pod_key.clone(),
                source,
            }
        })?;
        existing
            .verify(&binding)
            .map_err(|source| RestoreShapeError::StaleExistingBinding {
                pod: pod_key.clone(),
                checkpoint: checkpoint_key.clone(),
                source,
            })?;
    }
    shaped.annotations_mut().insert(
        ANNOTATION_CHECKPOINT_BINDING.to_owned(),
        binding.to_string(),
    );
    Ok(shaped)
}

/// The container a checkpoint captured: `status.artifact.container` (recorded from the
/// artifact's manifest when it was verified), else its Job's target container resolved as the
/// Job builder does (`spec.job.targetContainerName`, `main`, or the only container).
///
/// # Errors
/// The Job's target cannot be resolved from the spec.
pub fn captured_container(checkpoint: &Checkpoint) -> Result<String, JobBuildError> {
    if let Some(container) = checkpoint
        .status
        .as_ref()
        .and_then(|s| s.artifact.as_ref())
        .and_then(|a| a.container.clone())
        .filter(|c| !c.is_empty())
    {
        return Ok(container);
    }
    let job = &checkpoint.spec.job;
    let spec = job
        .pod_template_spec
        .spec
        .as_ref()
        .ok_or(JobBuildError::MissingPodSpec)?;
    resolve_target_container(spec, job.target_container_name.as_deref())
}

/// The seccomp profiles a restore pod's user set on the pod or its targets that are kept
/// instead of warmstart's, as warnings for the admission response.
pub fn seccomp_warnings(pod: &Pod) -> Vec<String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    let targets = pod
        .annotations()
        .get(ANNOTATION_TARGET_CONTAINERS)
        .and_then(|t| restore_pod::parse_target_containers(t).ok())
        .unwrap_or_default();
    restore_pod::seccomp_overrides(spec, &targets)
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use warmstart_shared::names;

    use super::*;
    use crate::webhook::fixtures::{ready_checkpoint, restore_pod_json};

    fn main_command(pod: &Pod) -> Vec<String> {
        pod.spec.as_ref().unwrap().containers[0]
            .command
            .clone()
            .unwrap()
    }

    #[test]
    fn restore_pods_of_a_wrapped_checkpoint_run_the_entrypoint_in_standby() {
        let pod: Pod =
            serde_json::from_value(restore_pod_json("default", "llama", "main")).unwrap();
        let mut checkpoint = ready_checkpoint("default", "llama");
        let native = shape_restore_pod(&pod, "default", &checkpoint, "img:1").unwrap();
        assert_eq!(main_command(&native), ["sleep", "infinity"]);
        assert!(native.spec.as_ref().unwrap().init_containers.is_none());

        checkpoint.status.as_mut().unwrap().entrypoint = Some(EntrypointMode::Wrap);
        let wrapped = shape_restore_pod(&pod, "default", &checkpoint, "img:1").unwrap();
        assert_eq!(
            main_command(&wrapped),
            [&names::entrypoint_path(), "--", "sleep", "infinity"]
        );
        let spec = wrapped.spec.as_ref().unwrap();
        let init = &spec.init_containers.as_ref().unwrap()[0];
        assert_eq!(init.image.as_deref(), Some("img:1"));
        let standby = spec.containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == names::ENV_RESTORE_STANDBY)
            .unwrap();
        assert_eq!(standby.value.as_deref(), Some("1"));
        assert!(
            wrapped
                .metadata
                .annotations
                .as_ref()
                .unwrap()
                .contains_key(ANNOTATION_CHECKPOINT_BINDING)
        );
    }
}
