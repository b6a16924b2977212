//! The restore-pod contract (README "How checkpoint and restore pods are shaped"): how a pod that is to receive a
//! restored process is shaped, and the two validators that check a pod against that shape.
//!
//! Mirrors NVIDIA snapshot's `BuildRestorePod` / `ValidateRestorePod`. Each target container
//! gets its own directory of the emptyDir control volume (`subPath: <container name>`), mounted
//! at [`names::MOUNT_CONTROL`] and named by [`names::ENV_CONTROL_DIR`], and every other mount a
//! checkpoint pod's target has (the pod's own, empty signal directory and the pod-info files:
//! [`crate::mounts`], mount parity); its startup probe is
//! replaced by one that waits for [`names::FILE_RESTORE_COMPLETE`], which the agent writes once
//! the restore finished, so the container is neither live- nor readiness-probed before the
//! restored process runs (kubelet holds those probes back until the startup probe succeeds).
//!
//! Invariants:
//! - [`build_restore_pod`] is atomic (it shapes a clone; the input is never touched) and
//!   idempotent (`build(build(p)) == build(p)`), and its output always passes
//!   [`validate_restore_pod_exact`], which it checks before returning.
//! - [`validate_restore_pod_runtime`] (run by the agent) accepts every pod the exact validator
//!   accepts, plus equivalent probes (`cat` or `test -f`, bare or absolute, any timing).
//! - A restore pod gets no hostPath volume and no privilege, and node affinity to nodes whose
//!   agent is ready ([`crate::placement`]), AND-ed into the user's own.
//! - A user's mount is never dropped: a mount of one of our volumes that is not ours, or a
//!   mount of them in a container that is not a target (init containers included), is an error.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{
    Container, EnvVar, ExecAction, Pod, PodSpec, Probe, SeccompProfile, VolumeMount,
};
use thiserror::Error;

use crate::wrap::{self, WrapError};
use crate::{mounts, names, placement};

pub use crate::mounts::{control_volume, control_volume_mount};

/// Startup probe period of a restore target, in seconds.
pub const STARTUP_PERIOD_SECONDS: i32 = 1;
/// Startup probe timeout of a restore target, in seconds.
pub const STARTUP_TIMEOUT_SECONDS: i32 = 1;
/// Startup probe failure threshold of a restore target: 30 minutes at one probe a second. A
/// restore of a large model (tens of GiB of GPU memory from shared storage) can take minutes;
/// the gate must not kill the placeholder while the agent still restores into it.
pub const STARTUP_FAILURE_THRESHOLD: i32 = 1800;
/// How long a standby entrypoint waits for a restore before it cold-starts, by default: half
/// the startup gate, so that a cold start still has fifteen minutes to open it.
pub const DEFAULT_RESTORE_TIMEOUT_SECONDS: i32 =
    STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD / 2;

/// Seccomp profile type of a profile file on the node.
const SECCOMP_TYPE_LOCALHOST: &str = "Localhost";
/// Longest DNS-1123 label (and Kubernetes label value).
pub(crate) const MAX_LABEL_LENGTH: usize = 63;

/// Why a restore pod cannot be built, or does not follow the contract.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RestorePodError {
    /// The checkpoint was taken with `spec.job.entrypoint: Wrap` and a target cannot be
    /// wrapped the same way.
    #[error("the checkpoint was taken with entrypoint Wrap")]
    Wrap(#[source] WrapError),
    /// The target-containers annotation names no container.
    #[error(
        "annotation {} is empty, must name at least one container",
        names::ANNOTATION_TARGET_CONTAINERS
    )]
    EmptyTargetAnnotation,
    /// The target-containers annotation has an empty entry (`a,,b` or a trailing comma).
    #[error(
        "annotation {} {annotation:?} has an empty entry, entries must be container names",
        names::ANNOTATION_TARGET_CONTAINERS
    )]
    EmptyTargetEntry {
        /// The annotation as given.
        annotation: String,
    },
    /// A target container name is not a DNS-1123 label.
    #[error("target container name {name:?} is not a valid DNS-1123 label: {reason}")]
    InvalidTargetName {
        /// The offending name.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A container or volume name is not a DNS-1123 label (the API server refuses the pod).
    #[error("pod has a {kind} named {name:?}, which is not a valid DNS-1123 label: {reason}")]
    InvalidName {
        /// `container`, `init container`, `ephemeral container` or `volume`.
        kind: &'static str,
        /// The offending name.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// No target container was given.
    #[error("no target container given, at least one is required")]
    NoTargets,
    /// A target container is named twice.
    #[error("target container {name:?} is named more than once")]
    DuplicateTarget {
        /// The repeated name.
        name: String,
    },
    /// The pod has no spec.
    #[error("pod has no spec")]
    MissingPodSpec,
    /// Two containers of the pod share a name.
    #[error("pod has more than one container named {name:?}")]
    DuplicateContainerName {
        /// The repeated name.
        name: String,
    },
    /// A target is not one of the pod's containers.
    #[error("target container {name:?} not found in pod (containers: {containers:?})")]
    UnknownTarget {
        /// The requested target.
        name: String,
        /// The pod's containers.
        containers: Vec<String>,
    },
    /// The pod has no control volume.
    #[error("pod has no volume {volume:?}, the restore control volume is required")]
    NoControlVolume {
        /// The control volume's name.
        volume: String,
    },
    /// The control volume exists but is not (only) an emptyDir.
    #[error("volume {volume:?} must be an emptyDir and nothing else")]
    ControlVolumeNotEmptyDir {
        /// The control volume's name.
        volume: String,
    },
    /// A target container does not mount the control volume.
    #[error("container {container:?} does not mount volume {volume:?}")]
    ControlMountMissing {
        /// The target container.
        container: String,
        /// The control volume's name.
        volume: String,
    },
    /// A target container mounts the control volume at another path.
    #[error(
        "container {container:?} mounts volume {volume:?} at {path:?}, must be at {:?}",
        names::MOUNT_CONTROL
    )]
    ControlMountWrongPath {
        /// The target container.
        container: String,
        /// The control volume's name.
        volume: String,
        /// Where it is mounted.
        path: String,
    },
    /// A target container mounts the whole control volume instead of its own sub-directory.
    #[error(
        "container {container:?} mounts volume {volume:?} without subPath, must have subPath {container:?}"
    )]
    ControlMountSubPathMissing {
        /// The target container.
        container: String,
        /// The control volume's name.
        volume: String,
    },
    /// A target container mounts another container's sub-directory of the control volume.
    #[error(
        "container {container:?} mounts volume {volume:?} with subPath {sub_path:?}, must have subPath {container:?}"
    )]
    ControlMountSubPathWrong {
        /// The target container.
        container: String,
        /// The control volume's name.
        volume: String,
        /// The subPath found.
        sub_path: String,
    },
    /// A target container's control mount has extra settings, or appears twice (exact check).
    #[error(
        "container {container:?} mount of volume {volume:?} is not the builder's (exactly one mount at {:?}, subPath {container:?}, no other field)",
        names::MOUNT_CONTROL
    )]
    ControlMountNotExact {
        /// The target container.
        container: String,
        /// The control volume's name.
        volume: String,
    },
    /// Another volume is mounted where one of warmstart's volumes belongs.
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
    /// A volume named like one warmstart adds is not what warmstart would add.
    #[error(
        "pod already has a volume named {volume:?} that is not warmstart's, the name is reserved by warmstart"
    )]
    ReservedVolumeConflict {
        /// The reserved name.
        volume: String,
    },
    /// A target mounts one of warmstart's volumes otherwise than warmstart does: the builder
    /// would have to drop the user's mount.
    #[error(
        "container {container:?} mounts volume {volume:?} at {path:?}, which is not warmstart's mount of it (volume {volume:?} is reserved by warmstart)"
    )]
    ReservedMountConflict {
        /// The target container.
        container: String,
        /// The reserved volume.
        volume: String,
        /// Where the user mounts it.
        path: String,
    },
    /// A container that is not a target (an init container, a sidecar) mounts one of
    /// warmstart's volumes: with the control volume it could write a target's
    /// `restore-complete` and open the startup gate before any restore.
    #[error(
        "{kind} {container:?} mounts volume {volume:?} at {path:?}; only the restore targets may mount it"
    )]
    ReservedMountOutsideTargets {
        /// `container`, `init container` or `ephemeral container`.
        kind: &'static str,
        /// The container.
        container: String,
        /// The reserved volume.
        volume: String,
        /// Where it mounts it.
        path: String,
    },
    /// A target mounts the control volume a second time, where it could write another
    /// target's control directory (or its own outside the contract's mount).
    #[error(
        "container {container:?} mounts volume {volume:?} a second time at {path:?}; a target mounts it once, at {:?} with subPath {container:?}",
        names::MOUNT_CONTROL
    )]
    ControlMountRepeated {
        /// The target container.
        container: String,
        /// The control volume's name.
        volume: String,
        /// Where the extra mount is.
        path: String,
    },
    /// A target container lacks one of the mounts a checkpoint pod's target has (exact check).
    #[error(
        "container {container:?} does not mount volume {volume:?} at {path:?} as warmstart does (mount parity with checkpoint pods)"
    )]
    ParityMountMissing {
        /// The target container.
        container: String,
        /// The volume.
        volume: String,
        /// Where it belongs.
        path: String,
    },
    /// A volume warmstart adds is missing (exact check).
    #[error("pod has no volume {volume:?} as warmstart adds it")]
    ParityVolumeMissing {
        /// The volume.
        volume: String,
    },
    /// The pod may be scheduled where no agent is ready (exact check).
    #[error(
        "pod does not require nodes labelled {}={} in every required node selector term",
        names::LABEL_AGENT_READY,
        names::LABEL_AGENT_READY_VALUE
    )]
    AgentReadyAffinityMissing,
    /// A target container lacks a control-directory env var.
    #[error(
        "container {container:?} has no env {var}, must be {:?}",
        names::MOUNT_CONTROL
    )]
    ControlDirEnvMissing {
        /// The target container.
        container: String,
        /// The env var.
        var: String,
    },
    /// A target container's control-directory env var has another value.
    #[error(
        "container {container:?} env {var} is {found}, must be {:?}",
        names::MOUNT_CONTROL
    )]
    ControlDirEnvWrong {
        /// The target container.
        container: String,
        /// The env var.
        var: String,
        /// The value found (quoted), or `valueFrom`.
        found: String,
    },
    /// A target container defines a control-directory env var more than once (exact check).
    #[error("container {container:?} defines env {var} more than once")]
    ControlDirEnvNotExact {
        /// The target container.
        container: String,
        /// The env var.
        var: String,
    },
    /// A target container has no startup probe.
    #[error(
        "container {container:?} has no startup probe, must wait for {:?}",
        names::restore_complete_path()
    )]
    NoStartupProbe {
        /// The target container.
        container: String,
    },
    /// A target container's startup probe is not an exec probe.
    #[error(
        "container {container:?} startup probe is not an exec probe, must wait for {:?}",
        names::restore_complete_path()
    )]
    StartupProbeNotExec {
        /// The target container.
        container: String,
    },
    /// A target container's startup probe does not wait for the restore-complete file.
    #[error(
        "container {container:?} startup probe runs {command:?}, must wait for {:?} (cat or test -f)",
        names::restore_complete_path()
    )]
    StartupProbeWrongFile {
        /// The target container.
        container: String,
        /// The probe's command.
        command: Vec<String>,
    },
    /// A target container's startup probe waits for the right file but is not the builder's.
    #[error(
        "container {container:?} startup probe is not the builder's (exec cat {:?}, period {}s, timeout {}s, failure threshold {})",
        names::restore_complete_path(),
        STARTUP_PERIOD_SECONDS,
        STARTUP_TIMEOUT_SECONDS,
        STARTUP_FAILURE_THRESHOLD
    )]
    StartupProbeNotExact {
        /// The target container.
        container: String,
    },
    /// The pod sets no seccomp profile (exact check): the builder sets the warmstart profile
    /// where the user set none.
    #[error(
        "pod seccompProfile is unset, must be {} {:?} or the user's own",
        SECCOMP_TYPE_LOCALHOST,
        names::SECCOMP_PROFILE
    )]
    PodSeccompProfileMissing,
}

/// A seccomp profile the user set that is not the warmstart profile: the builders keep it
/// (the user chose it), and the controller warns that io_uring may then not be blocked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeccompOverride {
    /// `None` for the pod's profile, else the container that sets its own.
    pub container: Option<String>,
    /// The profile, as `Type` or `Localhost "<file>"`.
    pub profile: String,
}

impl std::fmt::Display for SeccompOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.container {
            None => write!(f, "the pod's seccompProfile is {}", self.profile)?,
            Some(c) => write!(f, "container {c:?} sets seccompProfile {}", self.profile)?,
        }
        write!(
            f,
            ", kept instead of warmstart's {} {:?}: io_uring may not be blocked, and CRIU cannot checkpoint a process that uses it",
            SECCOMP_TYPE_LOCALHOST,
            names::SECCOMP_PROFILE
        )
    }
}

/// The seccomp profiles the user set on the pod or on one of `containers` that differ from the
/// warmstart profile, pod first.
pub fn seccomp_overrides(spec: &PodSpec, containers: &[String]) -> Vec<SeccompOverride> {
    let ours = seccomp_profile();
    let pod = spec
        .security_context
        .as_ref()
        .and_then(|sc| sc.seccomp_profile.as_ref())
        .filter(|p| **p != ours)
        .map(|p| SeccompOverride {
            container: None,
            profile: describe_seccomp(Some(p)),
        });
    let own = spec
        .containers
        .iter()
        .filter(|c| containers.contains(&c.name))
        .filter_map(|c| {
            c.security_context
                .as_ref()
                .and_then(|sc| sc.seccomp_profile.as_ref())
                .filter(|p| **p != ours)
                .map(|p| SeccompOverride {
                    container: Some(c.name.clone()),
                    profile: describe_seccomp(Some(p)),
                })
        });
    pod.into_iter().chain(own).collect()
}

/// Parses the `warmstart.dev/target-containers` annotation: comma-separated container names.
///
/// # Errors
/// An empty annotation, an empty entry, a repeated name, or a name that is not a DNS-1123 label.
pub fn parse_target_containers(annotation: &str) -> Result<Vec<String>, RestorePodError> {
    if annotation.trim().is_empty() {
        return Err(RestorePodError::EmptyTargetAnnotation);
    }
    let mut targets: Vec<String> = Vec::new();
    for entry in annotation.split(',') {
        let name = entry.trim();
        if name.is_empty() {
            return Err(RestorePodError::EmptyTargetEntry {
                annotation: annotation.to_owned(),
            });
        }
        if let Some(reason) = dns1123_label_violation(name) {
            return Err(RestorePodError::InvalidTargetName {
                name: name.to_owned(),
                reason,
            });
        }
        if targets.iter().any(|t| t == name) {
            return Err(RestorePodError::DuplicateTarget {
                name: name.to_owned(),
            });
        }
        targets.push(name.to_owned());
    }
    Ok(targets)
}

/// Shapes `pod` into a restore pod for `targets` and returns the result.
///
/// Adds warmstart's volumes (once) and, to each target, every mount a checkpoint pod's target
/// has ([`mounts::target_mounts`]: signal, control with `subPath: <container name>`, pod-info),
/// sets [`names::ENV_CONTROL_DIR`] and [`names::ENV_SNAPSHOT_CONTROL_DIR`] (replacing any user
/// value), replaces each target's startup probe with [`restore_startup_probe`], sets
/// [`standby_env`] (the server waits to be restored instead of starting), sets the pod's
/// seccomp profile to [`names::SECCOMP_PROFILE`] where the user set none (a user's profile is
/// kept, see [`seccomp_overrides`]), and requires a node whose agent is ready. See
/// [`build_restore_pod_with`] for checkpoints taken with `spec.job.entrypoint: Wrap`.
///
/// # Errors
/// No, repeated or unknown targets; a pod without spec or with duplicate container names; a
/// volume named like the control volume that is not an emptyDir; another volume mounted at
/// [`names::MOUNT_CONTROL`] in a target.
///
/// # Guarantees
/// The input is never modified (on error nothing is half-shaped). The output passes
/// [`validate_restore_pod_exact`]. Idempotent: shaping the output again returns it unchanged.
/// Liveness and readiness probes, other containers, and all other fields are kept.
pub fn build_restore_pod(pod: &Pod, targets: &[String]) -> Result<Pod, RestorePodError> {
    build_restore_pod_with(pod, targets, None)
}

/// [`build_restore_pod`], and with `entrypoint_image` (checkpoints taken with
/// `spec.job.entrypoint: Wrap`) each target also runs under `warmstart-entrypoint` copied in
/// from that image, as in the checkpoint Job, so that it waits in standby and can fall back to
/// a cold start (see [`crate::wrap`]).
///
/// # Errors
/// As [`build_restore_pod`]; with `entrypoint_image`, a target without `command`, or a volume,
/// init container or mount named or placed like the entrypoint's.
pub fn build_restore_pod_with(
    pod: &Pod,
    targets: &[String],
    entrypoint_image: Option<&str>,
) -> Result<Pod, RestorePodError> {
    let mut out = pod.clone();
    let spec = out.spec.as_mut().ok_or(RestorePodError::MissingPodSpec)?;
    check_targets(spec, targets)?;

    check_reserved_mounts_outside_targets(spec, targets)?;
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    for ours in mounts::volumes() {
        match volumes.iter().find(|v| v.name == ours.name) {
            Some(existing) if mounts::acceptable_reserved_volume(existing) => {}
            Some(_) if ours.name == names::VOLUME_CONTROL => {
                return Err(RestorePodError::ControlVolumeNotEmptyDir {
                    volume: names::VOLUME_CONTROL.to_owned(),
                });
            }
            Some(_) => {
                return Err(RestorePodError::ReservedVolumeConflict { volume: ours.name });
            }
            None => volumes.push(ours),
        }
    }

    for target in targets {
        let container = find_container_mut(spec, target)?;
        add_target_mounts(container)?;
        let mut env = control_env();
        env.extend(standby_env());
        set_env(container, env);
        container.startup_probe = Some(restore_startup_probe());
        if let Some(image) = entrypoint_image {
            wrap::wrap_target(spec, target, image).map_err(RestorePodError::Wrap)?;
        }
    }
    set_pod_seccomp(spec);
    placement::require_agent_ready(spec);

    // The builder validates its own output exactly (README "How checkpoint and restore pods are shaped").
    validate_restore_pod_exact(&out, targets)?;
    Ok(out)
}

/// Checks that `pod` is exactly what [`build_restore_pod`] makes for `targets`: the control
/// volume an emptyDir, in each target exactly one control mount equal to
/// [`control_volume_mount`], exactly one of each [`control_env`] entry, the startup probe equal
/// to [`restore_startup_probe`], the signal and pod-info mounts and volumes, a pod seccomp
/// profile (warmstart's or the user's), node affinity to ready agents, and no container but a
/// target mounting the control volume.
///
/// # Errors
/// The first difference found, naming the container and volume.
pub fn validate_restore_pod_exact(pod: &Pod, targets: &[String]) -> Result<(), RestorePodError> {
    validate(pod, targets, Mode::Exact)
}

/// Checks that `pod` follows the restore-pod contract well enough for the agent to restore into
/// it: the control volume is an emptyDir; each target mounts it at [`names::MOUNT_CONTROL`] with
/// `subPath: <container name>`; [`names::ENV_CONTROL_DIR`] (and [`names::ENV_SNAPSHOT_CONTROL_DIR`],
/// where set) name that directory; and the startup probe is an exec probe that waits for the
/// restore-complete file (`cat` or `test -f`, bare or as `/bin/…`, `/usr/bin/…`; any timing).
///
/// # Errors
/// A distinct variant per broken rule, naming the container and volume.
///
/// # Caveats
/// Seccomp is not checked here: CRIU restores the dumped process's own seccomp filters, so the
/// placeholder's profile does not change what the restored process may do.
pub fn validate_restore_pod_runtime(pod: &Pod, targets: &[String]) -> Result<(), RestorePodError> {
    validate(pod, targets, Mode::Runtime)
}

/// The control-directory env of a target: [`names::ENV_CONTROL_DIR`] and its alias
/// [`names::ENV_SNAPSHOT_CONTROL_DIR`], both [`names::MOUNT_CONTROL`].
pub fn control_env() -> Vec<EnvVar> {
    [names::ENV_CONTROL_DIR, names::ENV_SNAPSHOT_CONTROL_DIR]
        .into_iter()
        .map(|name| EnvVar {
            name: name.to_owned(),
            value: Some(names::MOUNT_CONTROL.to_owned()),
            value_from: None,
        })
        .collect()
}

/// The standby env of a restore target: [`names::ENV_RESTORE_STANDBY`] and its alias
/// [`names::ENV_SNAPSHOT_RESTORE_STANDBY`], both `1`. A server that honours the convention (or
/// `warmstart-entrypoint`) waits to be restored instead of loading its model again.
pub fn standby_env() -> Vec<EnvVar> {
    [
        names::ENV_RESTORE_STANDBY,
        names::ENV_SNAPSHOT_RESTORE_STANDBY,
    ]
    .into_iter()
    .map(|name| EnvVar {
        name: name.to_owned(),
        value: Some("1".to_owned()),
        value_from: None,
    })
    .collect()
}

/// The startup probe of a restore target: `cat /warmstart-control/restore-complete` once a
/// second for 30 minutes. Exec probes are not run by a shell and kubelet does not expand
/// `$(VAR)` in them, so the path is spelt out.
pub fn restore_startup_probe() -> Probe {
    Probe {
        exec: Some(ExecAction {
            command: Some(vec!["cat".to_owned(), names::restore_complete_path()]),
        }),
        period_seconds: Some(STARTUP_PERIOD_SECONDS),
        timeout_seconds: Some(STARTUP_TIMEOUT_SECONDS),
        success_threshold: Some(1),
        failure_threshold: Some(STARTUP_FAILURE_THRESHOLD),
        ..Probe::default()
    }
}

/// The warmstart seccomp profile: Localhost [`names::SECCOMP_PROFILE`] (blocks io_uring, which
/// CRIU cannot checkpoint).
pub fn seccomp_profile() -> SeccompProfile {
    SeccompProfile {
        type_: SECCOMP_TYPE_LOCALHOST.to_owned(),
        localhost_profile: Some(names::SECCOMP_PROFILE.to_owned()),
    }
}

/// Sets the pod-level seccomp profile where the user set none, keeping every other pod
/// security setting. A profile the user set (on the pod or a container) is kept: it is their
/// decision, reported by [`seccomp_overrides`] so the controller can warn about it.
pub(crate) fn set_pod_seccomp(spec: &mut PodSpec) {
    let sc = spec.security_context.get_or_insert_with(Default::default);
    if sc.seccomp_profile.is_none() {
        sc.seccomp_profile = Some(seccomp_profile());
    }
}

/// Replaces any env entries named like `ours` and puts `ours` first, in order, so that the
/// user's own entries can refer to them with `$(NAME)`. Idempotent.
pub(crate) fn set_env(container: &mut Container, ours: Vec<EnvVar>) {
    let env = container.env.get_or_insert_with(Vec::new);
    env.retain(|e| !ours.iter().any(|o| o.name == e.name));
    let mut shaped = ours;
    shaped.append(env);
    *env = shaped;
}

/// Whether two mount paths name the same directory (`/x`, `/x/`, `//x`, `/y/../x`).
pub(crate) fn same_path(a: &str, b: &str) -> bool {
    mounts::clean_mount_path(a) == mounts::clean_mount_path(b)
}

/// The first container or volume of the pod whose name the API server would refuse (not a
/// DNS-1123 label), as (kind, name, rule). Container names become paths (`subPath`, the control
/// directory on the node), so one named `../x` must never get that far.
pub(crate) fn invalid_name(spec: &PodSpec) -> Option<(&'static str, String, &'static str)> {
    let containers = all_containers(spec).map(|(kind, name, _)| (kind, name));
    let volumes = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| ("volume", v.name.as_str()));
    containers.chain(volumes).find_map(|(kind, name)| {
        dns1123_label_violation(name).map(|reason| (kind, name.to_owned(), reason))
    })
}

/// Why `s` is not a DNS-1123 label, or `None` when it is one.
pub(crate) fn dns1123_label_violation(s: &str) -> Option<&'static str> {
    if s.is_empty() {
        return Some("must not be empty");
    }
    if s.len() > MAX_LABEL_LENGTH {
        return Some("must be at most 63 characters");
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Some("must consist of lowercase letters, digits and '-'");
    }
    if s.starts_with('-') || s.ends_with('-') {
        return Some("must start and end with a letter or digit");
    }
    None
}

/// The first name that appears twice, if any.
pub(crate) fn first_duplicate<'a>(items: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = BTreeSet::new();
    items.into_iter().find(|item| !seen.insert(*item))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Exact,
    Runtime,
}

fn validate(pod: &Pod, targets: &[String], mode: Mode) -> Result<(), RestorePodError> {
    let spec = pod.spec.as_ref().ok_or(RestorePodError::MissingPodSpec)?;
    check_targets(spec, targets)?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == names::VOLUME_CONTROL)
        .ok_or_else(|| RestorePodError::NoControlVolume {
            volume: names::VOLUME_CONTROL.to_owned(),
        })?;
    if !mounts::is_only_empty_dir(volume) {
        return Err(RestorePodError::ControlVolumeNotEmptyDir {
            volume: names::VOLUME_CONTROL.to_owned(),
        });
    }
    if mode == Mode::Exact {
        for ours in [mounts::signal_volume(), mounts::pod_info_volume()] {
            if !spec
                .volumes
                .iter()
                .flatten()
                .any(|v| v.name == ours.name && mounts::acceptable_reserved_volume(v))
            {
                return Err(RestorePodError::ParityVolumeMissing { volume: ours.name });
            }
        }
    }
    for target in targets {
        let container = spec
            .containers
            .iter()
            .find(|c| &c.name == target)
            .ok_or_else(|| unknown_target(spec, target))?;
        check_mount(container, mode)?;
        if mode == Mode::Exact {
            check_parity_mounts(container)?;
        }
        // Our volumes' mounts are judged above; any other at or inside our paths shadows them.
        for mount in container.volume_mounts.iter().flatten() {
            if !mounts::RESERVED_VOLUMES.contains(&mount.name.as_str()) {
                check_user_mount(&container.name, mount)?;
            }
        }
        check_env(container, mode)?;
        check_startup_probe(container, mode)?;
    }
    check_control_writers(spec, targets)?;
    if mode == Mode::Exact {
        if !placement::requires_agent_ready(spec) {
            return Err(RestorePodError::AgentReadyAffinityMissing);
        }
        if spec
            .security_context
            .as_ref()
            .and_then(|sc| sc.seccomp_profile.as_ref())
            .is_none()
        {
            return Err(RestorePodError::PodSeccompProfileMissing);
        }
    }
    Ok(())
}

fn check_targets(spec: &PodSpec, targets: &[String]) -> Result<(), RestorePodError> {
    if targets.is_empty() {
        return Err(RestorePodError::NoTargets);
    }
    if let Some((kind, name, reason)) = invalid_name(spec) {
        return Err(RestorePodError::InvalidName { kind, name, reason });
    }
    if let Some(name) = first_duplicate(spec.containers.iter().map(|c| c.name.as_str())) {
        return Err(RestorePodError::DuplicateContainerName {
            name: name.to_owned(),
        });
    }
    if let Some(name) = first_duplicate(targets.iter().map(String::as_str)) {
        return Err(RestorePodError::DuplicateTarget {
            name: name.to_owned(),
        });
    }
    for target in targets {
        if !spec.containers.iter().any(|c| &c.name == target) {
            return Err(unknown_target(spec, target));
        }
    }
    Ok(())
}

fn unknown_target(spec: &PodSpec, target: &str) -> RestorePodError {
    RestorePodError::UnknownTarget {
        name: target.to_owned(),
        containers: spec.containers.iter().map(|c| c.name.clone()).collect(),
    }
}

fn find_container_mut<'a>(
    spec: &'a mut PodSpec,
    target: &str,
) -> Result<&'a mut Container, RestorePodError> {
    let containers: Vec<String> = spec.containers.iter().map(|c| c.name.clone()).collect();
    spec.containers
        .iter_mut()
        .find(|c| c.name == target)
        .ok_or_else(|| RestorePodError::UnknownTarget {
            name: target.to_owned(),
            containers,
        })
}

/// Adds to a target every mount of [`mounts::target_mounts`] it lacks, after the user's own.
/// A user mount at one of our paths, or of one of our volumes otherwise than ours, is an error:
/// replacing it would drop the user's mount.
fn add_target_mounts(container: &mut Container) -> Result<(), RestorePodError> {
    let ours = mounts::target_mounts(&container.name);
    let existing = container.volume_mounts.get_or_insert_with(Vec::new);
    for mount in existing.iter_mut() {
        // Ours with its path spelt otherwise (`/warmstart-control/`) is ours: spelt our way.
        if let Some(our) = ours.iter().find(|o| mounts::same_mount(mount, o)) {
            mount.clone_from(our);
            continue;
        }
        check_user_mount(&container.name, mount)?;
    }
    for mount in ours {
        if !existing.contains(&mount) {
            existing.push(mount);
        }
    }
    Ok(())
}

/// A target's mount that is not one of ours: of none of our volumes, and not at or inside one
/// of our paths, however spelt (`//checkpoint-signal`, `/warmstart-control/restore-complete`).
fn check_user_mount(container: &str, mount: &VolumeMount) -> Result<(), RestorePodError> {
    if mounts::RESERVED_VOLUMES.contains(&mount.name.as_str()) {
        return Err(RestorePodError::ReservedMountConflict {
            container: container.to_owned(),
            volume: mount.name.clone(),
            path: mount.mount_path.clone(),
        });
    }
    if mounts::reserved_path_reached(&mount.mount_path).is_some() {
        return Err(RestorePodError::MountPathConflict {
            container: container.to_owned(),
            volume: mount.name.clone(),
            path: mount.mount_path.clone(),
        });
    }
    Ok(())
}

/// Every container of the pod with its kind, init and ephemeral containers included.
fn all_containers(spec: &PodSpec) -> impl Iterator<Item = (&'static str, &str, &[VolumeMount])> {
    let regular = spec
        .containers
        .iter()
        .map(|c| ("container", c.name.as_str(), c.volume_mounts.as_deref()));
    let init = spec.init_containers.iter().flatten().map(|c| {
        (
            "init container",
            c.name.as_str(),
            c.volume_mounts.as_deref(),
        )
    });
    let ephemeral = spec.ephemeral_containers.iter().flatten().map(|c| {
        (
            "ephemeral container",
            c.name.as_str(),
            c.volume_mounts.as_deref(),
        )
    });
    regular
        .chain(init)
        .chain(ephemeral)
        .map(|(kind, name, m)| (kind, name, m.unwrap_or_default()))
}

/// No container but a target (a regular container named in `targets`) mounts one of our
/// volumes.
fn check_reserved_mounts_outside_targets(
    spec: &PodSpec,
    targets: &[String],
) -> Result<(), RestorePodError> {
    for (kind, name, container_mounts) in all_containers(spec) {
        if kind == "container" && targets.iter().any(|t| t == name) {
            continue;
        }
        if let Some(m) = container_mounts
            .iter()
            .find(|m| mounts::RESERVED_VOLUMES.contains(&m.name.as_str()))
        {
            return Err(RestorePodError::ReservedMountOutsideTargets {
                kind,
                container: name.to_owned(),
                volume: m.name.clone(),
                path: m.mount_path.clone(),
            });
        }
    }
    Ok(())
}

/// Only targets mount the control volume, each once (its own sub-directory): anyone else could
/// write a target's `restore-complete` and open its startup gate before any restore, or
/// `restore-failed` and force a cold start.
fn check_control_writers(spec: &PodSpec, targets: &[String]) -> Result<(), RestorePodError> {
    for (kind, name, container_mounts) in all_containers(spec) {
        let is_target = kind == "container" && targets.iter().any(|t| t == name);
        let control: Vec<&VolumeMount> = container_mounts
            .iter()
            .filter(|m| m.name == names::VOLUME_CONTROL)
            .collect();
        if !is_target {
            if let Some(m) = control.first() {
                return Err(RestorePodError::ReservedMountOutsideTargets {
                    kind,
                    container: name.to_owned(),
                    volume: m.name.clone(),
                    path: m.mount_path.clone(),
                });
            }
            continue;
        }
        // The target's own mount is checked by `check_mount`. A mount of another (or no)
        // subPath reaches other targets' directories.
        if let Some(m) = control.iter().find(|m| m.sub_path.as_deref() != Some(name)) {
            return Err(RestorePodError::ControlMountRepeated {
                container: name.to_owned(),
                volume: names::VOLUME_CONTROL.to_owned(),
                path: m.mount_path.clone(),
            });
        }
    }
    Ok(())
}

fn check_mount(container: &Container, mode: Mode) -> Result<(), RestorePodError> {
    let name = &container.name;
    let ours: Vec<&VolumeMount> = container
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.name == names::VOLUME_CONTROL)
        .collect();
    let Some(first) = ours.first() else {
        return Err(RestorePodError::ControlMountMissing {
            container: name.clone(),
            volume: names::VOLUME_CONTROL.to_owned(),
        });
    };
    let mount = match mode {
        Mode::Exact => first,
        Mode::Runtime => ours
            .iter()
            .find(|m| same_path(&m.mount_path, names::MOUNT_CONTROL))
            .unwrap_or(first),
    };
    let path_ok = match mode {
        Mode::Exact => mount.mount_path == names::MOUNT_CONTROL,
        Mode::Runtime => same_path(&mount.mount_path, names::MOUNT_CONTROL),
    };
    if !path_ok {
        return Err(RestorePodError::ControlMountWrongPath {
            container: name.clone(),
            volume: names::VOLUME_CONTROL.to_owned(),
            path: mount.mount_path.clone(),
        });
    }
    match mount.sub_path.as_deref() {
        None | Some("") => {
            return Err(RestorePodError::ControlMountSubPathMissing {
                container: name.clone(),
                volume: names::VOLUME_CONTROL.to_owned(),
            });
        }
        Some(sub_path) if sub_path != name => {
            return Err(RestorePodError::ControlMountSubPathWrong {
                container: name.clone(),
                volume: names::VOLUME_CONTROL.to_owned(),
                sub_path: sub_path.to_owned(),
            });
        }
        Some(_) => {}
    }
    if mode == Mode::Exact && (ours.len() != 1 || **mount != control_volume_mount(name)) {
        return Err(RestorePodError::ControlMountNotExact {
            container: name.clone(),
            volume: names::VOLUME_CONTROL.to_owned(),
        });
    }
    Ok(())
}

/// The signal and pod-info mounts a checkpoint pod's target has, each exactly once.
fn check_parity_mounts(container: &Container) -> Result<(), RestorePodError> {
    for ours in [
        mounts::signal_volume_mount(),
        mounts::pod_info_volume_mount(),
    ] {
        let found = container
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| m.name == ours.name)
            .collect::<Vec<_>>();
        if found != [&ours] {
            return Err(RestorePodError::ParityMountMissing {
                container: container.name.clone(),
                volume: ours.name.clone(),
                path: ours.mount_path.clone(),
            });
        }
    }
    Ok(())
}

fn check_env(container: &Container, mode: Mode) -> Result<(), RestorePodError> {
    for (var, required) in [
        (names::ENV_CONTROL_DIR, true),
        (names::ENV_SNAPSHOT_CONTROL_DIR, mode == Mode::Exact),
    ] {
        let entries: Vec<&EnvVar> = container
            .env
            .iter()
            .flatten()
            .filter(|e| e.name == var)
            .collect();
        // Where a name repeats, the last entry is the one the container sees.
        let Some(last) = entries.last() else {
            if required {
                return Err(RestorePodError::ControlDirEnvMissing {
                    container: container.name.clone(),
                    var: var.to_owned(),
                });
            }
            continue;
        };
        let value_ok = match (mode, last.value.as_deref(), &last.value_from) {
            (_, _, Some(_)) | (_, None, None) => false,
            (Mode::Exact, Some(value), None) => value == names::MOUNT_CONTROL,
            (Mode::Runtime, Some(value), None) => same_path(value, names::MOUNT_CONTROL),
        };
        if !value_ok {
            let found = match (&last.value, &last.value_from) {
                (_, Some(_)) => "valueFrom".to_owned(),
                (Some(value), None) => format!("{value:?}"),
                (None, None) => "unset".to_owned(),
            };
            return Err(RestorePodError::ControlDirEnvWrong {
                container: container.name.clone(),
                var: var.to_owned(),
                found,
            });
        }
        if mode == Mode::Exact && entries.len() != 1 {
            return Err(RestorePodError::ControlDirEnvNotExact {
                container: container.name.clone(),
                var: var.to_owned(),
            });
        }
    }
    Ok(())
}

fn check_startup_probe(container: &Container, mode: Mode) -> Result<(), RestorePodError> {
    let name = &container.name;
    let probe =
        container
            .startup_probe
            .as_ref()
            .ok_or_else(|| RestorePodError::NoStartupProbe {
                container: name.clone(),
            })?;
    let Some(exec) = &probe.exec else {
        return Err(RestorePodError::StartupProbeNotExec {
            container: name.clone(),
        });
    };
    let command = exec.command.clone().unwrap_or_default();
    if !waits_for_restore_complete(&command) {
        return Err(RestorePodError::StartupProbeWrongFile {
            container: name.clone(),
            command,
        });
    }
    if mode == Mode::Exact && *probe != restore_startup_probe() {
        return Err(RestorePodError::StartupProbeNotExact {
            container: name.clone(),
        });
    }
    Ok(())
}

/// Whether an exec probe command succeeds exactly when the restore-complete file exists:
/// `cat <file>` or `test -f <file>`, each bare or from `/bin` or `/usr/bin`.
fn waits_for_restore_complete(command: &[String]) -> bool {
    let file = names::restore_complete_path();
    let is = |arg: &String, tool: &str| {
        arg == tool || *arg == format!("/bin/{tool}") || *arg == format!("/usr/bin/{tool}")
    };
    match command {
        [tool, path] => is(tool, "cat") && *path == file,
        [tool, flag, path] => is(tool, "test") && flag == "-f" && *path == file,
        _ => false,
    }
}

fn describe_seccomp(profile: Option<&SeccompProfile>) -> String {
    match profile {
        None => "unset".to_owned(),
        Some(SeccompProfile {
            type_,
            localhost_profile: Some(file),
        }) => format!("{type_} {file:?}"),
        Some(SeccompProfile {
            type_,
            localhost_profile: None,
        }) => type_.clone(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::{
        Capabilities, EmptyDirVolumeSource, HTTPGetAction, PodSecurityContext, SecurityContext,
        Volume,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use proptest::prelude::*;

    use super::*;

    fn container(name: &str) -> Container {
        Container {
            name: name.to_owned(),
            image: Some("worker:1".to_owned()),
            env: Some(vec![EnvVar {
                name: "MODEL".to_owned(),
                value: Some("llama".to_owned()),
                value_from: None,
            }]),
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
            period_seconds: Some(10),
            ..Probe::default()
        }
    }

    fn pod(containers: &[&str]) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: containers.iter().map(|c| container(c)).collect(),
                volumes: Some(vec![Volume {
                    name: "models".to_owned(),
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Volume::default()
                }]),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn targets(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    fn built(containers: &[&str], target_names: &[&str]) -> Pod {
        build_restore_pod(&pod(containers), &targets(target_names)).unwrap()
    }

    fn spec_mut(pod: &mut Pod) -> &mut PodSpec {
        pod.spec.as_mut().unwrap()
    }

    fn container_mut<'a>(pod: &'a mut Pod, name: &str) -> &'a mut Container {
        spec_mut(pod)
            .containers
            .iter_mut()
            .find(|c| c.name == name)
            .unwrap()
    }

    fn container_ref<'a>(pod: &'a Pod, name: &str) -> &'a Container {
        pod.spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .find(|c| c.name == name)
            .unwrap()
    }

    fn runtime(pod: &Pod) -> Result<(), RestorePodError> {
        validate_restore_pod_runtime(pod, &targets(&["main"]))
    }

    fn set_probe_command(pod: &mut Pod, command: &[&str]) {
        container_mut(pod, "main").startup_probe = Some(Probe {
            exec: Some(ExecAction {
                command: Some(command.iter().map(|s| (*s).to_owned()).collect()),
            }),
            period_seconds: Some(3),
            failure_threshold: Some(100),
            ..Probe::default()
        });
    }

    // ---- parse_target_containers ----

    #[test]
    fn parse_splits_on_commas_and_trims_spaces() {
        assert_eq!(
            parse_target_containers(" main , worker-2,sidecar ").unwrap(),
            targets(&["main", "worker-2", "sidecar"])
        );
        assert_eq!(parse_target_containers("main").unwrap(), targets(&["main"]));
    }

    #[test]
    fn parse_rejects_an_empty_annotation() {
        assert_eq!(
            parse_target_containers(""),
            Err(RestorePodError::EmptyTargetAnnotation)
        );
        assert_eq!(
            parse_target_containers("   "),
            Err(RestorePodError::EmptyTargetAnnotation)
        );
    }

    #[test]
    fn parse_rejects_empty_entries() {
        for annotation in ["main,,worker", "main,", ",main", "main, ,worker"] {
            assert_eq!(
                parse_target_containers(annotation),
                Err(RestorePodError::EmptyTargetEntry {
                    annotation: annotation.to_owned()
                }),
                "{annotation}"
            );
        }
    }

    #[test]
    fn parse_rejects_duplicates() {
        assert_eq!(
            parse_target_containers("main, worker ,main"),
            Err(RestorePodError::DuplicateTarget {
                name: "main".to_owned()
            })
        );
    }

    #[test]
    fn parse_rejects_names_that_are_not_dns1123_labels() {
        let long = "a".repeat(64);
        for bad in [
            "Main",
            "-main",
            "main-",
            "ma_in",
            "ma.in",
            "mäin",
            long.as_str(),
        ] {
            let err = parse_target_containers(&format!("ok,{bad}")).unwrap_err();
            assert!(
                matches!(&err, RestorePodError::InvalidTargetName { name, .. } if name == bad),
                "{bad}: {err}"
            );
        }
        assert!(parse_target_containers(&"a".repeat(63)).is_ok());
    }

    // ---- build_restore_pod ----

    #[test]
    fn build_adds_the_control_volume_once() {
        let out = built(&["main", "worker"], &["main", "worker"]);
        let volumes = out.spec.as_ref().unwrap().volumes.as_ref().unwrap();
        let control: Vec<_> = volumes
            .iter()
            .filter(|v| v.name == names::VOLUME_CONTROL)
            .collect();
        assert_eq!(control, vec![&control_volume()]);
        assert!(
            volumes.iter().any(|v| v.name == "models"),
            "user volume kept"
        );
    }

    #[test]
    fn build_mounts_each_targets_own_sub_directory() {
        let out = built(&["main", "worker", "sidecar"], &["main", "worker"]);
        for target in ["main", "worker"] {
            let mounts = container_ref(&out, target).volume_mounts.as_ref().unwrap();
            assert!(mounts.contains(&VolumeMount {
                name: "warmstart-control".to_owned(),
                mount_path: "/warmstart-control".to_owned(),
                sub_path: Some(target.to_owned()),
                ..VolumeMount::default()
            }));
            assert!(mounts.iter().any(|m| m.name == "models"), "user mount kept");
        }
        assert_eq!(container_ref(&out, "sidecar"), &container("sidecar"));
    }

    #[test]
    fn build_sets_control_dir_env_and_alias_replacing_user_values() {
        let mut input = pod(&["main"]);
        container_mut(&mut input, "main")
            .env
            .as_mut()
            .unwrap()
            .push(EnvVar {
                name: names::ENV_CONTROL_DIR.to_owned(),
                value: Some("/elsewhere".to_owned()),
                value_from: None,
            });
        let out = build_restore_pod(&input, &targets(&["main"])).unwrap();
        let env = container_ref(&out, "main").env.as_ref().unwrap();
        let get = |name: &str| -> Vec<Option<&str>> {
            env.iter()
                .filter(|e| e.name == name)
                .map(|e| e.value.as_deref())
                .collect()
        };
        assert_eq!(
            get("WARMSTART_CONTROL_DIR"),
            vec![Some("/warmstart-control")]
        );
        assert_eq!(
            get("SNAPSHOT_CONTROL_DIR"),
            vec![Some("/warmstart-control")]
        );
        assert_eq!(get("MODEL"), vec![Some("llama")]);
    }

    #[test]
    fn build_replaces_the_startup_probe_and_keeps_liveness_and_readiness() {
        let out = built(&["main"], &["main"]);
        let main = container_ref(&out, "main");
        let probe = main.startup_probe.as_ref().unwrap();
        assert_eq!(
            probe.exec.as_ref().unwrap().command.as_ref().unwrap(),
            &vec![
                "cat".to_owned(),
                "/warmstart-control/restore-complete".to_owned()
            ]
        );
        assert_eq!(probe.period_seconds, Some(1));
        assert_eq!(probe.failure_threshold, Some(1800));
        assert_eq!(probe.http_get, None);
        assert_eq!(main.liveness_probe, Some(http_probe("/healthz")));
        assert_eq!(main.readiness_probe, Some(http_probe("/ready")));
    }

    #[test]
    fn build_adds_a_startup_probe_where_there_was_none() {
        let mut input = pod(&["main"]);
        container_mut(&mut input, "main").startup_probe = None;
        let out = build_restore_pod(&input, &targets(&["main"])).unwrap();
        assert_eq!(
            container_ref(&out, "main").startup_probe,
            Some(restore_startup_probe())
        );
    }

    #[test]
    fn build_sets_the_pod_seccomp_profile_where_none_is_set_keeping_other_settings() {
        let mut input = pod(&["main"]);
        spec_mut(&mut input).security_context = Some(PodSecurityContext {
            run_as_user: Some(1000),
            ..PodSecurityContext::default()
        });
        let out = build_restore_pod(&input, &targets(&["main"])).unwrap();
        let sc = out
            .spec
            .as_ref()
            .unwrap()
            .security_context
            .as_ref()
            .unwrap();
        assert_eq!(sc.run_as_user, Some(1000));
        assert_eq!(
            sc.seccomp_profile,
            Some(SeccompProfile {
                type_: "Localhost".to_owned(),
                localhost_profile: Some("profiles/warmstart-block-iouring.json".to_owned()),
            })
        );
        assert_eq!(
            seccomp_overrides(out.spec.as_ref().unwrap(), &targets(&["main"])),
            []
        );
    }

    // A profile the user set is kept, and reported.
    #[test]
    fn build_keeps_a_users_seccomp_profiles_and_reports_them() {
        let mut input = pod(&["main", "worker"]);
        spec_mut(&mut input).security_context = Some(PodSecurityContext {
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                localhost_profile: None,
            }),
            ..PodSecurityContext::default()
        });
        container_mut(&mut input, "main").security_context = Some(SecurityContext {
            read_only_root_filesystem: Some(true),
            seccomp_profile: Some(SeccompProfile {
                type_: "Unconfined".to_owned(),
                localhost_profile: None,
            }),
            ..SecurityContext::default()
        });
        let t = targets(&["main", "worker"]);
        let out = build_restore_pod(&input, &t).unwrap();
        let spec = out.spec.as_ref().unwrap();
        assert_eq!(
            spec.security_context,
            input.spec.as_ref().unwrap().security_context
        );
        assert_eq!(
            container_ref(&out, "main").security_context,
            container_ref(&input, "main").security_context
        );
        assert_eq!(container_ref(&out, "worker").security_context, None);
        assert_eq!(validate_restore_pod_exact(&out, &t), Ok(()));
        let overrides = seccomp_overrides(spec, &t);
        assert_eq!(
            overrides,
            [
                SeccompOverride {
                    container: None,
                    profile: "RuntimeDefault".to_owned()
                },
                SeccompOverride {
                    container: Some("main".to_owned()),
                    profile: "Unconfined".to_owned()
                },
            ]
        );
        assert!(
            overrides[1]
                .to_string()
                .starts_with("container \"main\" sets seccompProfile Unconfined, kept instead of warmstart's Localhost"),
            "{}",
            overrides[1]
        );
    }

    #[test]
    fn the_startup_gate_allows_at_least_30_minutes() {
        let probe = restore_startup_probe();
        let seconds = probe.period_seconds.unwrap() * probe.failure_threshold.unwrap();
        assert!(seconds >= 1800, "{seconds}");
    }

    #[test]
    fn build_adds_no_host_path_and_no_privilege() {
        let input = pod(&["main", "worker"]);
        let out = build_restore_pod(&input, &targets(&["main", "worker"])).unwrap();
        let spec = out.spec.as_ref().unwrap();
        assert!(spec.volumes.iter().flatten().all(|v| v.host_path.is_none()));
        for c in &spec.containers {
            assert_eq!(c.security_context, None, "{}", c.name);
        }
        assert_eq!(spec.host_pid, None);
        assert_eq!(spec.host_network, None);
        assert_eq!(spec.host_ipc, None);
    }

    #[test]
    fn build_rejects_no_targets() {
        assert_eq!(
            build_restore_pod(&pod(&["main"]), &[]),
            Err(RestorePodError::NoTargets)
        );
    }

    #[test]
    fn build_rejects_duplicate_targets() {
        assert_eq!(
            build_restore_pod(&pod(&["main"]), &targets(&["main", "main"])),
            Err(RestorePodError::DuplicateTarget {
                name: "main".to_owned()
            })
        );
    }

    #[test]
    fn build_rejects_unknown_targets_listing_the_containers() {
        let err = build_restore_pod(&pod(&["main", "sidecar"]), &targets(&["main", "worker"]))
            .unwrap_err();
        assert_eq!(
            err,
            RestorePodError::UnknownTarget {
                name: "worker".to_owned(),
                containers: targets(&["main", "sidecar"]),
            }
        );
        let message = err.to_string();
        assert!(message.contains("\"worker\"") && message.contains("\"sidecar\""));
    }

    #[test]
    fn build_rejects_a_pod_without_spec() {
        assert_eq!(
            build_restore_pod(&Pod::default(), &targets(&["main"])),
            Err(RestorePodError::MissingPodSpec)
        );
    }

    #[test]
    fn build_rejects_duplicate_container_names() {
        assert_eq!(
            build_restore_pod(&pod(&["main", "main"]), &targets(&["main"])),
            Err(RestorePodError::DuplicateContainerName {
                name: "main".to_owned()
            })
        );
    }

    #[test]
    fn build_rejects_a_control_volume_that_is_not_an_empty_dir() {
        let mut input = pod(&["main"]);
        spec_mut(&mut input).volumes.as_mut().unwrap().push(Volume {
            name: names::VOLUME_CONTROL.to_owned(),
            host_path: Some(Default::default()),
            ..Volume::default()
        });
        assert_eq!(
            build_restore_pod(&input, &targets(&["main"])),
            Err(RestorePodError::ControlVolumeNotEmptyDir {
                volume: "warmstart-control".to_owned()
            })
        );
    }

    #[test]
    fn build_keeps_an_existing_empty_dir_control_volume() {
        let mut input = pod(&["main"]);
        let sized = Volume {
            name: names::VOLUME_CONTROL.to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".to_owned()),
                size_limit: Some(Quantity("1Mi".to_owned())),
            }),
            ..Volume::default()
        };
        spec_mut(&mut input)
            .volumes
            .as_mut()
            .unwrap()
            .push(sized.clone());
        let out = build_restore_pod(&input, &targets(&["main"])).unwrap();
        let control: Vec<_> = out
            .spec
            .as_ref()
            .unwrap()
            .volumes
            .iter()
            .flatten()
            .filter(|v| v.name == names::VOLUME_CONTROL)
            .collect();
        assert_eq!(control, vec![&sized]);
    }

    #[test]
    fn build_rejects_another_volume_mounted_at_the_control_path() {
        let mut input = pod(&["main"]);
        container_mut(&mut input, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(VolumeMount {
                name: "models".to_owned(),
                mount_path: "/warmstart-control/".to_owned(),
                ..VolumeMount::default()
            });
        assert_eq!(
            build_restore_pod(&input, &targets(&["main"])),
            Err(RestorePodError::MountPathConflict {
                container: "main".to_owned(),
                volume: "models".to_owned(),
                path: "/warmstart-control/".to_owned(),
            })
        );
    }

    #[test]
    fn build_rejects_user_mounts_at_any_spelling_of_our_paths_or_inside_them() {
        for path in [
            "//warmstart-control",
            "/./warmstart-control",
            "/models/../warmstart-control",
            "warmstart-control",
            "/warmstart-control/sub",
            "/warmstart-control/restore-complete",
            "/checkpoint-signal",
            "//checkpoint-signal/",
            "/etc/podinfo/",
            "/etc/podinfo/./uid",
        ] {
            let mut input = pod(&["main"]);
            container_mut(&mut input, "main")
                .volume_mounts
                .as_mut()
                .unwrap()
                .push(VolumeMount {
                    name: "models".to_owned(),
                    mount_path: path.to_owned(),
                    ..VolumeMount::default()
                });
            assert_eq!(
                build_restore_pod(&input, &targets(&["main"])),
                Err(RestorePodError::MountPathConflict {
                    container: "main".to_owned(),
                    volume: "models".to_owned(),
                    path: path.to_owned(),
                }),
                "{path}"
            );
        }
    }

    // The pod already carries our mounts, spelt with a trailing slash or a doubled one: they are
    // ours, not a conflict, and come out spelt our way.
    #[test]
    fn build_accepts_our_own_mounts_spelt_otherwise() {
        let mut input = pod(&["main"]);
        let spelt: Vec<VolumeMount> = mounts::target_mounts("main")
            .into_iter()
            .map(|m| VolumeMount {
                mount_path: format!("/{}/", m.mount_path),
                ..m
            })
            .collect();
        container_mut(&mut input, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .extend(spelt);
        let out = build_restore_pod(&input, &targets(&["main"])).unwrap();
        assert_eq!(out, built(&["main"], &["main"]));
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Ok(())
        );
    }

    #[test]
    fn validators_reject_user_mounts_inside_our_paths() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(VolumeMount {
                name: "models".to_owned(),
                mount_path: "/warmstart-control//restore-complete".to_owned(),
                sub_path: Some("ok".to_owned()),
                ..VolumeMount::default()
            });
        let expected = Err(RestorePodError::MountPathConflict {
            container: "main".to_owned(),
            volume: "models".to_owned(),
            path: "/warmstart-control//restore-complete".to_owned(),
        });
        assert_eq!(
            validate_restore_pod_runtime(&out, &targets(&["main"])),
            expected
        );
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            expected
        );
    }

    // A container name becomes the control mount's `subPath`.
    #[test]
    fn names_the_api_server_refuses_are_refused() {
        let mut input = pod(&["main", "side"]);
        container_mut(&mut input, "side").name = "../x".to_owned();
        let expected = RestorePodError::InvalidName {
            kind: "container",
            name: "../x".to_owned(),
            reason: "must consist of lowercase letters, digits and '-'",
        };
        assert_eq!(
            build_restore_pod(&input, &targets(&["main"])),
            Err(expected.clone())
        );
        assert_eq!(
            validate_restore_pod_runtime(&input, &targets(&["main"])),
            Err(expected)
        );
        let mut input = pod(&["main"]);
        spec_mut(&mut input).volumes.as_mut().unwrap()[0].name = "Models".to_owned();
        assert!(matches!(
            build_restore_pod(&input, &targets(&["main"])),
            Err(RestorePodError::InvalidName { kind: "volume", .. })
        ));
    }

    #[test]
    fn build_leaves_the_input_untouched_on_error() {
        // The first target is shaped before the second turns out to conflict.
        let mut input = pod(&["main", "worker"]);
        container_mut(&mut input, "worker")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(VolumeMount {
                name: "models".to_owned(),
                mount_path: names::MOUNT_CONTROL.to_owned(),
                ..VolumeMount::default()
            });
        let before = input.clone();
        let result = build_restore_pod(&input, &targets(&["main", "worker"]));
        assert!(matches!(
            result,
            Err(RestorePodError::MountPathConflict { .. })
        ));
        assert_eq!(input, before);
    }

    #[test]
    fn build_leaves_the_input_untouched_on_success() {
        let input = pod(&["main"]);
        let before = input.clone();
        let _ = build_restore_pod(&input, &targets(&["main"])).unwrap();
        assert_eq!(input, before);
    }

    #[test]
    fn build_is_idempotent() {
        let once = built(&["main", "worker", "sidecar"], &["worker", "main"]);
        let twice = build_restore_pod(&once, &targets(&["worker", "main"])).unwrap();
        assert_eq!(twice, once);
    }

    #[test]
    fn build_output_passes_both_validators() {
        let out = built(&["main", "worker"], &["main", "worker"]);
        let t = targets(&["main", "worker"]);
        assert_eq!(validate_restore_pod_exact(&out, &t), Ok(()));
        assert_eq!(validate_restore_pod_runtime(&out, &t), Ok(()));
    }

    // The builder never drops a user's mount.
    #[test]
    fn build_rejects_a_second_mount_of_the_control_volume_instead_of_dropping_it() {
        let mut input = pod(&["main"]);
        container_mut(&mut input, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(VolumeMount {
                name: names::VOLUME_CONTROL.to_owned(),
                mount_path: "/old".to_owned(),
                ..VolumeMount::default()
            });
        let err = build_restore_pod(&input, &targets(&["main"])).unwrap_err();
        assert_eq!(
            err,
            RestorePodError::ReservedMountConflict {
                container: "main".to_owned(),
                volume: "warmstart-control".to_owned(),
                path: "/old".to_owned(),
            }
        );
        assert!(err.to_string().contains("\"/old\""), "{err}");
    }

    #[test]
    fn build_keeps_a_targets_exact_mounts_in_place() {
        let once = built(&["main"], &["main"]);
        let mut input = pod(&["main"]);
        container_mut(&mut input, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .insert(0, control_volume_mount("main"));
        let out = build_restore_pod(&input, &targets(&["main"])).unwrap();
        let mounts = container_ref(&out, "main").volume_mounts.as_ref().unwrap();
        assert_eq!(mounts[0], control_volume_mount("main"));
        assert_eq!(mounts.len(), 4, "{mounts:?}");
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Ok(())
        );
        assert_eq!(
            container_ref(&once, "main")
                .volume_mounts
                .as_ref()
                .unwrap()
                .len(),
            4
        );
    }

    #[test]
    fn build_gives_targets_every_mount_of_a_checkpoint_pods_target() {
        let out = built(&["main", "sidecar"], &["main"]);
        let spec = out.spec.as_ref().unwrap();
        let mounts = container_ref(&out, "main").volume_mounts.as_ref().unwrap();
        for ours in mounts::target_mounts("main") {
            assert_eq!(mounts.iter().filter(|m| **m == ours).count(), 1, "{ours:?}");
        }
        for volume in mounts::volumes() {
            assert!(
                spec.volumes.iter().flatten().any(|v| *v == volume),
                "{volume:?}"
            );
        }
        assert_eq!(container_ref(&out, "sidecar"), &container("sidecar"));
    }

    #[test]
    fn build_rejects_a_reserved_volume_that_is_not_ours() {
        let mut input = pod(&["main"]);
        spec_mut(&mut input).volumes.as_mut().unwrap().push(Volume {
            name: names::VOLUME_POD_INFO.to_owned(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        });
        assert_eq!(
            build_restore_pod(&input, &targets(&["main"])),
            Err(RestorePodError::ReservedVolumeConflict {
                volume: "warmstart-podinfo".to_owned()
            })
        );
    }

    // A sidecar or init container mounting the control
    // volume could open a target's startup gate before any restore.
    #[test]
    fn build_and_runtime_reject_the_control_volume_outside_the_targets() {
        let sidecar_mount = VolumeMount {
            name: names::VOLUME_CONTROL.to_owned(),
            mount_path: "/ctl".to_owned(),
            ..VolumeMount::default()
        };
        let mut input = pod(&["main", "sidecar"]);
        container_mut(&mut input, "sidecar")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(sidecar_mount.clone());
        let err = build_restore_pod(&input, &targets(&["main"])).unwrap_err();
        assert_eq!(
            err,
            RestorePodError::ReservedMountOutsideTargets {
                kind: "container",
                container: "sidecar".to_owned(),
                volume: "warmstart-control".to_owned(),
                path: "/ctl".to_owned(),
            }
        );

        let mut init = pod(&["main"]);
        spec_mut(&mut init).init_containers = Some(vec![Container {
            name: "prep".to_owned(),
            volume_mounts: Some(vec![sidecar_mount.clone()]),
            ..Container::default()
        }]);
        assert!(matches!(
            build_restore_pod(&init, &targets(&["main"])),
            Err(RestorePodError::ReservedMountOutsideTargets {
                kind: "init container",
                ..
            })
        ));

        // The same on a pod the builder never saw: the agent's validator refuses it.
        let mut out = built(&["main", "sidecar"], &["main"]);
        container_mut(&mut out, "sidecar")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(sidecar_mount.clone());
        assert!(matches!(
            runtime(&out),
            Err(RestorePodError::ReservedMountOutsideTargets {
                kind: "container",
                ..
            })
        ));
        let mut out = built(&["main"], &["main"]);
        spec_mut(&mut out).init_containers = Some(vec![Container {
            name: "prep".to_owned(),
            volume_mounts: Some(vec![sidecar_mount]),
            ..Container::default()
        }]);
        let err = runtime(&out).unwrap_err();
        assert_eq!(
            err.to_string(),
            "init container \"prep\" mounts volume \"warmstart-control\" at \"/ctl\"; only the restore targets may mount it"
        );
    }

    #[test]
    fn runtime_rejects_a_target_mounting_the_whole_control_volume_a_second_time() {
        let mut out = built(&["main", "worker"], &["main", "worker"]);
        container_mut(&mut out, "worker")
            .volume_mounts
            .as_mut()
            .unwrap()
            .push(VolumeMount {
                name: names::VOLUME_CONTROL.to_owned(),
                mount_path: "/all".to_owned(),
                ..VolumeMount::default()
            });
        assert_eq!(
            validate_restore_pod_runtime(&out, &targets(&["main", "worker"])),
            Err(RestorePodError::ControlMountRepeated {
                container: "worker".to_owned(),
                volume: "warmstart-control".to_owned(),
                path: "/all".to_owned(),
            })
        );
    }

    #[test]
    fn build_requires_a_node_whose_agent_is_ready() {
        let out = built(&["main"], &["main"]);
        assert!(placement::requires_agent_ready(out.spec.as_ref().unwrap()));
        let mut no_affinity = out.clone();
        spec_mut(&mut no_affinity).affinity = None;
        assert_eq!(
            validate_restore_pod_exact(&no_affinity, &targets(&["main"])),
            Err(RestorePodError::AgentReadyAffinityMissing)
        );
        assert_eq!(runtime(&no_affinity), Ok(()));
    }

    #[test]
    fn exact_requires_the_parity_mounts() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .retain(|m| m.name != names::VOLUME_SIGNAL);
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::ParityMountMissing {
                container: "main".to_owned(),
                volume: "warmstart-signal".to_owned(),
                path: "/checkpoint-signal".to_owned(),
            })
        );
    }

    // ---- validate_restore_pod_exact ----

    #[test]
    fn exact_rejects_an_equivalent_but_different_probe() {
        let mut out = built(&["main"], &["main"]);
        set_probe_command(
            &mut out,
            &["test", "-f", "/warmstart-control/restore-complete"],
        );
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::StartupProbeNotExact {
                container: "main".to_owned()
            })
        );
    }

    #[test]
    fn exact_rejects_other_probe_timings() {
        let mut out = built(&["main"], &["main"]);
        if let Some(p) = container_mut(&mut out, "main").startup_probe.as_mut() {
            p.failure_threshold = Some(30);
        }
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::StartupProbeNotExact {
                container: "main".to_owned()
            })
        );
    }

    #[test]
    fn exact_rejects_extra_mount_fields() {
        let mut out = built(&["main"], &["main"]);
        for m in container_mut(&mut out, "main")
            .volume_mounts
            .iter_mut()
            .flatten()
        {
            if m.name == names::VOLUME_CONTROL {
                m.read_only = Some(true);
            }
        }
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::ControlMountNotExact {
                container: "main".to_owned(),
                volume: "warmstart-control".to_owned(),
            })
        );
        assert_eq!(runtime(&out), Ok(()), "a read-only mount still works");
    }

    #[test]
    fn exact_rejects_a_duplicated_env_entry() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main")
            .env
            .as_mut()
            .unwrap()
            .push(EnvVar {
                name: names::ENV_CONTROL_DIR.to_owned(),
                value: Some(names::MOUNT_CONTROL.to_owned()),
                value_from: None,
            });
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::ControlDirEnvNotExact {
                container: "main".to_owned(),
                var: "WARMSTART_CONTROL_DIR".to_owned(),
            })
        );
    }

    #[test]
    fn exact_requires_the_alias_env() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main")
            .env
            .as_mut()
            .unwrap()
            .retain(|e| e.name != names::ENV_SNAPSHOT_CONTROL_DIR);
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::ControlDirEnvMissing {
                container: "main".to_owned(),
                var: "SNAPSHOT_CONTROL_DIR".to_owned(),
            })
        );
        assert_eq!(runtime(&out), Ok(()), "the alias is optional at run time");
    }

    #[test]
    fn exact_rejects_a_missing_pod_seccomp_profile() {
        let mut out = built(&["main"], &["main"]);
        spec_mut(&mut out).security_context = None;
        assert_eq!(
            validate_restore_pod_exact(&out, &targets(&["main"])),
            Err(RestorePodError::PodSeccompProfileMissing)
        );
        assert_eq!(runtime(&out), Ok(()));
    }

    #[test]
    fn exact_rejects_unknown_targets() {
        let out = built(&["main"], &["main"]);
        assert!(matches!(
            validate_restore_pod_exact(&out, &targets(&["worker"])),
            Err(RestorePodError::UnknownTarget { name, .. }) if name == "worker"
        ));
    }

    // ---- validate_restore_pod_runtime: accepted ----

    #[test]
    fn runtime_accepts_equivalent_probes_with_any_timing() {
        let file = "/warmstart-control/restore-complete";
        for command in [
            vec!["cat", file],
            vec!["/bin/cat", file],
            vec!["/usr/bin/cat", file],
            vec!["test", "-f", file],
            vec!["/bin/test", "-f", file],
            vec!["/usr/bin/test", "-f", file],
        ] {
            let mut out = built(&["main"], &["main"]);
            set_probe_command(&mut out, &command);
            assert_eq!(runtime(&out), Ok(()), "{command:?}");
        }
    }

    #[test]
    fn runtime_accepts_an_extra_privilege_free_sidecar() {
        let out = built(&["main", "sidecar"], &["main"]);
        assert_eq!(runtime(&out), Ok(()));
    }

    // ---- validate_restore_pod_runtime: one rejection each ----

    #[test]
    fn runtime_rejects_a_pod_without_control_volume() {
        let mut out = built(&["main"], &["main"]);
        spec_mut(&mut out)
            .volumes
            .as_mut()
            .unwrap()
            .retain(|v| v.name != names::VOLUME_CONTROL);
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::NoControlVolume {
                volume: "warmstart-control".to_owned()
            })
        );
    }

    #[test]
    fn runtime_rejects_a_control_volume_that_is_not_an_empty_dir() {
        let mut out = built(&["main"], &["main"]);
        for v in spec_mut(&mut out).volumes.iter_mut().flatten() {
            if v.name == names::VOLUME_CONTROL {
                v.empty_dir = None;
                v.host_path = Some(Default::default());
            }
        }
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::ControlVolumeNotEmptyDir {
                volume: "warmstart-control".to_owned()
            })
        );
    }

    #[test]
    fn runtime_rejects_a_target_without_control_mount() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main")
            .volume_mounts
            .as_mut()
            .unwrap()
            .retain(|m| m.name != names::VOLUME_CONTROL);
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::ControlMountMissing {
                container: "main".to_owned(),
                volume: "warmstart-control".to_owned(),
            })
        );
    }

    #[test]
    fn runtime_rejects_a_control_mount_at_the_wrong_path() {
        let mut out = built(&["main"], &["main"]);
        for m in container_mut(&mut out, "main")
            .volume_mounts
            .iter_mut()
            .flatten()
        {
            if m.name == names::VOLUME_CONTROL {
                m.mount_path = "/control".to_owned();
            }
        }
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::ControlMountWrongPath {
                container: "main".to_owned(),
                volume: "warmstart-control".to_owned(),
                path: "/control".to_owned(),
            })
        );
    }

    #[test]
    fn runtime_rejects_a_control_mount_without_sub_path() {
        let mut out = built(&["main"], &["main"]);
        for m in container_mut(&mut out, "main")
            .volume_mounts
            .iter_mut()
            .flatten()
        {
            if m.name == names::VOLUME_CONTROL {
                m.sub_path = None;
            }
        }
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::ControlMountSubPathMissing {
                container: "main".to_owned(),
                volume: "warmstart-control".to_owned(),
            })
        );
    }

    #[test]
    fn runtime_rejects_a_control_mount_with_another_containers_sub_path() {
        let mut out = built(&["main"], &["main"]);
        for m in container_mut(&mut out, "main")
            .volume_mounts
            .iter_mut()
            .flatten()
        {
            if m.name == names::VOLUME_CONTROL {
                m.sub_path = Some("worker".to_owned());
            }
        }
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::ControlMountSubPathWrong {
                container: "main".to_owned(),
                volume: "warmstart-control".to_owned(),
                sub_path: "worker".to_owned(),
            })
        );
    }

    #[test]
    fn runtime_rejects_a_missing_control_dir_env() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main")
            .env
            .as_mut()
            .unwrap()
            .retain(|e| e.name != names::ENV_CONTROL_DIR);
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::ControlDirEnvMissing {
                container: "main".to_owned(),
                var: "WARMSTART_CONTROL_DIR".to_owned(),
            })
        );
    }

    #[test]
    fn runtime_rejects_a_wrong_control_dir_env() {
        let mut out = built(&["main"], &["main"]);
        for e in container_mut(&mut out, "main").env.iter_mut().flatten() {
            if e.name == names::ENV_CONTROL_DIR {
                e.value = Some("/tmp".to_owned());
            }
        }
        let err = runtime(&out).unwrap_err();
        assert_eq!(
            err,
            RestorePodError::ControlDirEnvWrong {
                container: "main".to_owned(),
                var: "WARMSTART_CONTROL_DIR".to_owned(),
                found: "\"/tmp\"".to_owned(),
            }
        );
        assert_eq!(
            err.to_string(),
            "container \"main\" env WARMSTART_CONTROL_DIR is \"/tmp\", must be \"/warmstart-control\""
        );
    }

    #[test]
    fn runtime_rejects_a_target_without_startup_probe() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main").startup_probe = None;
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::NoStartupProbe {
                container: "main".to_owned()
            })
        );
    }

    #[test]
    fn runtime_rejects_a_startup_probe_that_is_not_exec() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main").startup_probe = Some(http_probe("/startup"));
        assert_eq!(
            runtime(&out),
            Err(RestorePodError::StartupProbeNotExec {
                container: "main".to_owned()
            })
        );
    }

    #[test]
    fn runtime_rejects_a_startup_probe_waiting_for_another_file() {
        for command in [
            vec!["cat", "/warmstart-control/other"],
            vec!["test", "-e", "/warmstart-control/restore-complete"],
            vec!["sh", "-c", "cat /warmstart-control/restore-complete"],
            vec!["cat", "$(WARMSTART_CONTROL_DIR)/restore-complete"],
            vec!["/opt/cat", "/warmstart-control/restore-complete"],
            vec![],
        ] {
            let mut out = built(&["main"], &["main"]);
            set_probe_command(&mut out, &command);
            assert_eq!(
                runtime(&out),
                Err(RestorePodError::StartupProbeWrongFile {
                    container: "main".to_owned(),
                    command: command.iter().map(|s| (*s).to_owned()).collect(),
                }),
                "{command:?}"
            );
        }
    }

    #[test]
    fn runtime_rejects_an_unknown_target() {
        let out = built(&["main"], &["main"]);
        assert!(matches!(
            validate_restore_pod_runtime(&out, &targets(&["main", "worker"])),
            Err(RestorePodError::UnknownTarget { name, .. }) if name == "worker"
        ));
    }

    #[test]
    fn messages_are_lowercase_and_name_the_container() {
        let mut out = built(&["main"], &["main"]);
        container_mut(&mut out, "main").startup_probe = None;
        let message = runtime(&out).unwrap_err().to_string();
        assert!(message.starts_with("container \"main\""), "{message}");
        assert!(!message.ends_with('.'));
    }

    // ---- properties ----

    const NAMES: [&str; 4] = ["main", "worker", "sidecar", "a-1"];

    fn arb_container(name: &'static str) -> impl Strategy<Value = Container> {
        (
            any::<bool>(),
            prop::option::of("[a-z/]{0,12}"),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(move |(startup, stale_env, own_seccomp, privileged)| {
                let mut c = container(name);
                if !startup {
                    c.startup_probe = None;
                }
                if let Some(value) = stale_env {
                    c.env.get_or_insert_with(Vec::new).push(EnvVar {
                        name: names::ENV_CONTROL_DIR.to_owned(),
                        value: Some(value),
                        value_from: None,
                    });
                }
                if own_seccomp || privileged {
                    c.security_context = Some(SecurityContext {
                        seccomp_profile: own_seccomp.then(|| SeccompProfile {
                            type_: "RuntimeDefault".to_owned(),
                            localhost_profile: None,
                        }),
                        privileged: privileged.then_some(true),
                        capabilities: privileged.then(|| Capabilities {
                            add: Some(vec!["SYS_ADMIN".to_owned()]),
                            drop: None,
                        }),
                        ..SecurityContext::default()
                    });
                }
                c
            })
    }

    fn arb_pod_and_targets() -> impl Strategy<Value = (Pod, Vec<String>)> {
        (
            prop::sample::subsequence(NAMES.to_vec(), 1..=NAMES.len()),
            any::<bool>(),
        )
            .prop_flat_map(|(names_, control_volume_present)| {
                let containers: Vec<_> = names_.iter().map(|n| arb_container(n)).collect();
                let n = names_.len();
                (
                    containers,
                    prop::sample::subsequence(names_.clone(), 1..=n).prop_shuffle(),
                    Just(control_volume_present),
                )
            })
            .prop_map(|(containers, targets_, control_volume_present)| {
                let mut p = pod(&[]);
                let spec = spec_mut(&mut p);
                spec.containers = containers;
                if control_volume_present {
                    spec.volumes
                        .get_or_insert_with(Vec::new)
                        .push(control_volume());
                }
                (p, targets_.into_iter().map(str::to_owned).collect())
            })
    }

    proptest! {
        #[test]
        fn prop_build_is_idempotent_and_valid((input, t) in arb_pod_and_targets()) {
            let before = input.clone();
            let once = build_restore_pod(&input, &t).unwrap();
            prop_assert_eq!(&input, &before);
            let twice = build_restore_pod(&once, &t).unwrap();
            prop_assert_eq!(&twice, &once);
            prop_assert_eq!(validate_restore_pod_exact(&once, &t), Ok(()));
            prop_assert_eq!(validate_restore_pod_runtime(&once, &t), Ok(()));
        }

        #[test]
        fn prop_build_touches_only_targets_and_adds_no_privilege((input, t) in arb_pod_and_targets()) {
            let out = build_restore_pod(&input, &t).unwrap();
            let (in_spec, out_spec) = (input.spec.as_ref().unwrap(), out.spec.as_ref().unwrap());
            prop_assert_eq!(out_spec.volumes.iter().flatten().filter(|v| v.host_path.is_some()).count(), 0);
            for (before, after) in in_spec.containers.iter().zip(&out_spec.containers) {
                if t.contains(&before.name) {
                    prop_assert_eq!(&after.liveness_probe, &before.liveness_probe);
                    prop_assert_eq!(&after.readiness_probe, &before.readiness_probe);
                    let privileged = |c: &Container| c.security_context.as_ref().map(|s| (s.privileged, s.capabilities.clone()));
                    prop_assert_eq!(privileged(after), privileged(before));
                } else {
                    prop_assert_eq!(after, before);
                }
            }
        }
    }

    fn env_of<'a>(pod: &'a Pod, container: &str, name: &str) -> Option<&'a str> {
        pod.spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .find(|c| c.name == container)
            .unwrap()
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.as_deref())
    }

    #[test]
    fn targets_wait_in_standby_and_other_containers_do_not() {
        let out = built(&["main", "sidecar"], &["main"]);
        assert_eq!(env_of(&out, "main", names::ENV_RESTORE_STANDBY), Some("1"));
        assert_eq!(
            env_of(&out, "main", names::ENV_SNAPSHOT_RESTORE_STANDBY),
            Some("1")
        );
        assert_eq!(env_of(&out, "sidecar", names::ENV_RESTORE_STANDBY), None);
        assert_eq!(env_of(&out, "main", "MODEL"), Some("llama"));
    }

    #[test]
    fn a_wrapped_checkpoint_wraps_its_restore_targets_like_the_job_did() {
        let mut input = pod(&["main", "sidecar"]);
        for c in &mut spec_mut(&mut input).containers {
            c.command = Some(vec!["redis-server".to_owned()]);
        }
        let out = build_restore_pod_with(&input, &targets(&["main"]), Some("agent:1")).unwrap();
        let spec = out.spec.as_ref().unwrap();
        let main = &spec.containers[0];
        assert_eq!(
            main.command.as_deref().unwrap(),
            ["/warmstart/bin/warmstart-entrypoint", "--", "redis-server"]
        );
        assert!(
            main.volume_mounts
                .iter()
                .flatten()
                .any(|m| *m == wrap::entrypoint_mount())
        );
        assert_eq!(
            spec.containers[1].command.as_deref().unwrap(),
            ["redis-server"]
        );
        assert_eq!(
            spec.init_containers.as_deref().unwrap(),
            [wrap::install_init_container("agent:1")]
        );
        // Still a valid restore pod, and shaping it again changes nothing.
        validate_restore_pod_exact(&out, &targets(&["main"])).unwrap();
        validate_restore_pod_runtime(&out, &targets(&["main"])).unwrap();
        let again = build_restore_pod_with(&out, &targets(&["main"]), Some("agent:1")).unwrap();
        assert_eq!(again, out);
        // The image's entrypoint cannot be wrapped: the pod is refused, not half-shaped.
        let err = build_restore_pod_with(&pod(&["main"]), &targets(&["main"]), Some("agent:1"))
            .unwrap_err();
        assert_eq!(
            err,
            RestorePodError::Wrap(WrapError::NoCommand {
                container: "main".to_owned()
            })
        );
    }
}
