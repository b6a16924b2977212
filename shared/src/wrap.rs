//! `spec.job.entrypoint: Wrap`: how the Job and restore-pod builders put `warmstart-entrypoint`
//! in front of a target container's command (README "Unchanged servers: `warmstart-entrypoint`", "Standby, fallback and unchanged
//! servers").
//!
//! The pod gets an emptyDir [`names::VOLUME_ENTRYPOINT`], an init container
//! [`names::INIT_CONTAINER_ENTRYPOINT`] (the entrypoint image, a controller setting) that
//! copies the binary into it, and the target mounts it read-only at
//! [`names::MOUNT_ENTRYPOINT`] and runs `/warmstart/bin/warmstart-entrypoint -- <command>`.
//! Checkpoint and restore pods are shaped alike, so their mounts match for CRIU.
//!
//! Invariants: idempotent (shaping a shaped pod changes nothing); a container without an
//! explicit `command` is refused (the image's entrypoint cannot be known here); nothing of the
//! user's is replaced silently (a volume, mount or init container named or placed like ours is
//! an error unless it is exactly ours).

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, PodSpec, Probe, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use thiserror::Error;

use crate::names;

/// The image the install init container runs by default: the agent image, which ships the
/// binary at [`names::ENTRYPOINT_IN_IMAGE`] (the controller's `--entrypoint-image`), of this
/// release: a controller never hands Wrap pods an entrypoint of another version.
pub const DEFAULT_ENTRYPOINT_IMAGE: &str =
    concat!("ghcr.io/warmstart/agent:", env!("CARGO_PKG_VERSION"));

/// Why a target cannot be wrapped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WrapError {
    /// The container has no `command`: its image's entrypoint is unknown to the builder.
    #[error(
        "container {container:?} has no command: spec.job.entrypoint Wrap needs the container's command spelt out (the image's entrypoint cannot be known), e.g. command: [\"vllm\", \"serve\"]"
    )]
    NoCommand {
        /// The container.
        container: String,
    },
    /// The checkpoint source has no readiness probe to decide when the server is ready.
    #[error(
        "container {container:?} has no readinessProbe: spec.job.entrypoint Wrap runs it to know when the server is ready to be checkpointed"
    )]
    NoReadinessProbe {
        /// The container.
        container: String,
    },
    /// The readiness probe names a port the container does not declare.
    #[error(
        "container {container:?} readinessProbe uses port {port:?}, which is not one of its named ports"
    )]
    UnknownNamedPort {
        /// The container.
        container: String,
        /// The port name.
        port: String,
    },
    /// A user volume, init container or mount is named or placed like ours.
    #[error("pod already has {what} {name:?}, which is reserved by warmstart for the entrypoint")]
    Conflict {
        /// `volume`, `init container` or `mount`.
        what: &'static str,
        /// Its name (or path).
        name: String,
    },
    /// The probe cannot be serialised (cannot happen for a parsed probe).
    #[error("cannot serialise the readiness probe: {0}")]
    Probe(String),
}

/// The emptyDir the binary is copied into.
pub fn entrypoint_volume() -> Volume {
    Volume {
        name: names::VOLUME_ENTRYPOINT.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// The init container that copies the binary: `warmstart-entrypoint --install /warmstart/bin`
/// from `image` (the binary copies itself: the image needs no shell).
pub fn install_init_container(image: &str) -> Container {
    Container {
        name: names::INIT_CONTAINER_ENTRYPOINT.to_owned(),
        image: Some(image.to_owned()),
        command: Some(vec![
            names::ENTRYPOINT_IN_IMAGE.to_owned(),
            "--install".to_owned(),
            names::MOUNT_ENTRYPOINT.to_owned(),
        ]),
        volume_mounts: Some(vec![VolumeMount {
            name: names::VOLUME_ENTRYPOINT.to_owned(),
            mount_path: names::MOUNT_ENTRYPOINT.to_owned(),
            ..VolumeMount::default()
        }]),
        ..Container::default()
    }
}

/// The target's read-only mount of the binary.
pub fn entrypoint_mount() -> VolumeMount {
    VolumeMount {
        name: names::VOLUME_ENTRYPOINT.to_owned(),
        mount_path: names::MOUNT_ENTRYPOINT.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

/// Whether `command` already runs under the entrypoint.
pub fn is_wrapped(command: &[String]) -> bool {
    command.first().map(String::as_str) == Some(names::entrypoint_path().as_str())
        && command.get(1).map(String::as_str) == Some("--")
}

/// Shapes `pod` so that `target` runs under the entrypoint copied from `image`: volume, init
/// container, read-only mount, command prefix. Environment is the caller's business.
///
/// # Errors
/// The target has no command, or something of the user's is named or placed like ours.
pub fn wrap_target(pod: &mut PodSpec, target: &str, image: &str) -> Result<(), WrapError> {
    let volumes = pod.volumes.get_or_insert_with(Vec::new);
    match volumes.iter().find(|v| v.name == names::VOLUME_ENTRYPOINT) {
        Some(v) if *v != entrypoint_volume() => return Err(conflict("volume", &v.name)),
        Some(_) => {}
        None => volumes.push(entrypoint_volume()),
    }
    let init = install_init_container(image);
    let inits = pod.init_containers.get_or_insert_with(Vec::new);
    match inits.iter().find(|c| c.name == init.name) {
        Some(c) if *c != init => return Err(conflict("init container", &c.name)),
        Some(_) => {}
        // First, so the binary is there however long the user's init containers take.
        None => inits.insert(0, init),
    }
    let container = pod
        .containers
        .iter_mut()
        .find(|c| c.name == target)
        .ok_or_else(|| WrapError::NoCommand {
            container: target.to_owned(),
        })?;
    let command = match container.command.as_deref() {
        Some(command) if !command.is_empty() => command,
        _ => {
            return Err(WrapError::NoCommand {
                container: target.to_owned(),
            });
        }
    };
    if !is_wrapped(command) {
        let mut wrapped = vec![names::entrypoint_path(), "--".to_owned()];
        wrapped.extend(command.iter().cloned());
        container.command = Some(wrapped);
    }
    let mounts = container.volume_mounts.get_or_insert_with(Vec::new);
    let ours = entrypoint_mount();
    match mounts.iter().find(|m| {
        m.name == names::VOLUME_ENTRYPOINT
            || crate::mounts::at_or_below(&m.mount_path, names::MOUNT_ENTRYPOINT)
    }) {
        Some(m) if *m != ours => return Err(conflict("mount", &m.mount_path)),
        Some(_) => {}
        None => mounts.push(ours),
    }
    Ok(())
}

fn conflict(what: &'static str, name: &str) -> WrapError {
    WrapError::Conflict {
        what,
        name: name.to_owned(),
    }
}

/// The container's readiness probe as JSON for `WARMSTART_READY_PROBE`, with named ports
/// replaced by their numbers (the entrypoint cannot look them up).
///
/// # Errors
/// No readiness probe, or a named port the container does not declare.
pub fn ready_probe_json(container: &Container) -> Result<String, WrapError> {
    let mut probe: Probe =
        container
            .readiness_probe
            .clone()
            .ok_or_else(|| WrapError::NoReadinessProbe {
                container: container.name.clone(),
            })?;
    let resolve = |port: &mut IntOrString| -> Result<(), WrapError> {
        if let IntOrString::String(name) = port
            && name.parse::<u16>().is_err()
        {
            let number = container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .map(|p| p.container_port)
                .ok_or_else(|| WrapError::UnknownNamedPort {
                    container: container.name.clone(),
                    port: name.clone(),
                })?;
            *port = IntOrString::Int(number);
        }
        Ok(())
    };
    if let Some(http) = probe.http_get.as_mut() {
        resolve(&mut http.port)?;
    }
    if let Some(tcp) = probe.tcp_socket.as_mut() {
        resolve(&mut tcp.port)?;
    }
    serde_json::to_string(&probe).map_err(|e| WrapError::Probe(e.to_string()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerPort, HTTPGetAction};

    use super::*;

    fn pod() -> PodSpec {
        PodSpec {
            containers: vec![Container {
                name: "main".to_owned(),
                command: Some(vec!["redis-server".to_owned(), "--port".to_owned()]),
                args: Some(vec!["6379".to_owned()]),
                ports: Some(vec![ContainerPort {
                    name: Some("http".to_owned()),
                    container_port: 8000,
                    ..ContainerPort::default()
                }]),
                readiness_probe: Some(Probe {
                    http_get: Some(HTTPGetAction {
                        port: IntOrString::String("http".to_owned()),
                        path: Some("/health".to_owned()),
                        ..HTTPGetAction::default()
                    }),
                    period_seconds: Some(2),
                    ..Probe::default()
                }),
                ..Container::default()
            }],
            init_containers: Some(vec![Container {
                name: "fetch".to_owned(),
                ..Container::default()
            }]),
            ..PodSpec::default()
        }
    }

    #[test]
    fn wrapping_prefixes_the_command_and_mounts_the_installed_binary_read_only() {
        let mut spec = pod();
        wrap_target(&mut spec, "main", "agent:1").unwrap();
        let main = &spec.containers[0];
        assert_eq!(
            main.command.as_deref().unwrap(),
            [
                "/warmstart/bin/warmstart-entrypoint",
                "--",
                "redis-server",
                "--port"
            ]
        );
        assert_eq!(main.args.as_deref().unwrap(), ["6379"], "args kept");
        assert_eq!(main.volume_mounts.as_deref().unwrap(), [entrypoint_mount()]);
        let inits = spec.init_containers.as_deref().unwrap();
        assert_eq!(inits[0], install_init_container("agent:1"));
        assert_eq!(
            inits[0].command.as_deref().unwrap(),
            [
                "/usr/local/bin/warmstart-entrypoint",
                "--install",
                "/warmstart/bin"
            ]
        );
        assert_eq!(inits[1].name, "fetch");
        assert_eq!(spec.volumes.as_deref().unwrap(), [entrypoint_volume()]);
        // Idempotent.
        let once = spec.clone();
        wrap_target(&mut spec, "main", "agent:1").unwrap();
        assert_eq!(spec, once);
    }

    #[test]
    fn a_container_without_command_or_with_our_names_is_refused() {
        let mut spec = pod();
        spec.containers[0].command = None;
        let err = wrap_target(&mut spec, "main", "agent:1").unwrap_err();
        assert_eq!(
            err,
            WrapError::NoCommand {
                container: "main".to_owned()
            }
        );
        assert!(err.to_string().contains("has no command"), "{err}");
        let mut spec = pod();
        spec.volumes = Some(vec![Volume {
            name: names::VOLUME_ENTRYPOINT.to_owned(),
            ..Volume::default()
        }]);
        assert!(matches!(
            wrap_target(&mut spec, "main", "agent:1"),
            Err(WrapError::Conflict { what: "volume", .. })
        ));
        let mut spec = pod();
        spec.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "tools".to_owned(),
            mount_path: "/warmstart/bin/".to_owned(),
            ..VolumeMount::default()
        }]);
        assert!(matches!(
            wrap_target(&mut spec, "main", "agent:1"),
            Err(WrapError::Conflict { what: "mount", .. })
        ));
        let mut spec = pod();
        wrap_target(&mut spec, "main", "agent:1").unwrap();
        assert!(matches!(
            wrap_target(&mut spec, "main", "other:2"),
            Err(WrapError::Conflict {
                what: "init container",
                ..
            })
        ));
    }

    #[test]
    fn the_ready_probe_keeps_its_timing_and_gets_port_numbers() {
        let json: serde_json::Value =
            serde_json::from_str(&ready_probe_json(&pod().containers[0]).unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"httpGet": {"port": 8000, "path": "/health"}, "periodSeconds": 2})
        );
        let mut unknown = pod().containers[0].clone();
        unknown.ports = None;
        assert_eq!(
            ready_probe_json(&unknown),
            Err(WrapError::UnknownNamedPort {
                container: "main".to_owned(),
                port: "http".to_owned()
            })
        );
        unknown.readiness_probe = None;
        assert!(matches!(
            ready_probe_json(&unknown),
            Err(WrapError::NoReadinessProbe { .. })
        ));
    }
}
