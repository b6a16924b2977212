//! Shaping a restore pod for a checkpoint: the decision the admission webhook makes, also used
//! by `render-restore-pod`. All or nothing: the input pod is never half-shaped.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use thiserror::Error;
use warmstart_shared::binding::{Binding, BindingError};
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
    let binding = Binding::for_checkpoint(checkpoint)?;
    let wrapped =
        checkpoint.status.as_ref().and_then(|s| s.entrypoint) == Some(EntrypointMode::Wrap);
    let mut shaped =
        restore_pod::build_restore_pod_with(pod, &targets, wrapped.then_some(entrypoint_image))
            .map_err(build_err)?;
    shaped.annotations_mut().insert(
        ANNOTATION_CHECKPOINT_BINDING.to_owned(),
        binding.to_string(),
    );
    Ok(shaped)
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
