//! A pod's container as a runc container: the fixture's [`ContainerSpec`] built from the
//! Kubernetes container (command, args, environment, working directory, mounts, user,
//! capabilities, read-only root) and the pod's network.

use k8s_openapi::api::core::v1::{Container as K8sContainer, Pod};
use serde_json::{Map, Value, json};

use crate::fixture::{BindMount, ContainerSpec, Image, Network, merge_patch};

use super::env::expand_with;

/// Every Linux capability, for `privileged: true`.
const ALL_CAPABILITIES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// The pod's hostname: `spec.hostname`, else its name.
pub(crate) fn pod_hostname(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.hostname.clone())
        .or_else(|| pod.metadata.name.clone())
        .unwrap_or_else(|| "pod".to_owned())
}

/// The runc container for `container` of `pod`: `command` then `args` (each with `$(VAR)`
/// expanded from `env`; with no `command`, `args` alone, as images carry no entrypoint), `env`
/// after `PATH` and `HOSTNAME`, `workingDir` (default `/`), `mounts`, `network`, and from the
/// security contexts `runAsUser`/`runAsGroup`, capabilities `add`/`drop`, `privileged` (every
/// capability, nothing masked) and `readOnlyRootFilesystem`.
///
/// # Errors
/// Nothing to run (the kubelet's `CreateContainerConfigError`).
pub(crate) fn container_spec(
    pod: &Pod,
    container: &K8sContainer,
    image: &Image,
    env: &[(String, String)],
    mounts: Vec<BindMount>,
    network: Network,
) -> Result<ContainerSpec, String> {
    let args: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .map(|arg| expand_with(arg, env))
        .collect();
    if args.is_empty() {
        return Err(format!(
            "container {:?} has neither command nor args (simulated images have no entrypoint)",
            container.name
        ));
    }
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let hostname = pod_hostname(pod);
    let mut spec = ContainerSpec::new(&format!("{pod_name}-{}", container.name), image, args)
        .with_hostname(hostname.clone())
        .with_env("HOSTNAME", hostname)
        .with_network(network);
    for (key, value) in env {
        spec = spec.with_env(key.clone(), value.clone());
    }
    if let Some(dir) = container.working_dir.as_deref().filter(|d| !d.is_empty()) {
        spec = spec.with_cwd(dir);
    }
    spec.mounts = mounts;

    let pod_security = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let security = container.security_context.as_ref();
    let mut patch = Map::new();
    let uid = security
        .and_then(|s| s.run_as_user)
        .or_else(|| pod_security.and_then(|s| s.run_as_user));
    let gid = security
        .and_then(|s| s.run_as_group)
        .or_else(|| pod_security.and_then(|s| s.run_as_group));
    if uid.is_some() || gid.is_some() {
        patch.insert(
            "process".to_owned(),
            json!({"user": {"uid": uid.unwrap_or(0), "gid": gid.unwrap_or(0)}}),
        );
    }
    if security.and_then(|s| s.privileged) == Some(true) {
        spec.capabilities = ALL_CAPABILITIES.iter().map(|c| (*c).to_owned()).collect();
        patch.insert(
            "linux".to_owned(),
            json!({"maskedPaths": [], "readonlyPaths": []}),
        );
    }
    if let Some(caps) = security.and_then(|s| s.capabilities.as_ref()) {
        let name = |c: &String| {
            let upper = c.to_ascii_uppercase();
            if upper.starts_with("CAP_") {
                upper
            } else {
                format!("CAP_{upper}")
            }
        };
        let drop: Vec<String> = caps.drop.iter().flatten().map(name).collect();
        if drop.iter().any(|c| c == "CAP_ALL") {
            spec.capabilities.clear();
        } else {
            spec.capabilities.retain(|c| !drop.contains(c));
        }
        for cap in caps.add.iter().flatten().map(name) {
            if cap == "CAP_ALL" {
                spec.capabilities = ALL_CAPABILITIES.iter().map(|c| (*c).to_owned()).collect();
            } else if !spec.capabilities.contains(&cap) {
                spec.capabilities.push(cap);
            }
        }
    }
    if security.and_then(|s| s.read_only_root_filesystem) == Some(true) {
        patch.insert("root".to_owned(), json!({"readonly": true}));
    }
    if !patch.is_empty() {
        let mut merged = spec.oci_patch.take().unwrap_or(Value::Null);
        merge_patch(&mut merged, &Value::Object(patch));
        spec.oci_patch = Some(merged);
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn builds_process_env_and_security() {
        let dir = tempfile::tempdir().unwrap();
        let image = Image::open(dir.path()).unwrap();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-1"},
            "spec": {"containers": [], "securityContext": {"runAsUser": 1000}},
        }))
        .unwrap();
        let container: K8sContainer = serde_json::from_value(json!({
            "name": "main",
            "command": ["sh", "-c"],
            "args": ["echo $(GREETING) $$(GREETING)"],
            "workingDir": "/work",
            "securityContext": {"capabilities": {"drop": ["NET_RAW"], "add": ["SYS_PTRACE"]},
                                "readOnlyRootFilesystem": true},
        }))
        .unwrap();
        let env = vec![("GREETING".to_owned(), "hi".to_owned())];
        let spec =
            container_spec(&pod, &container, &image, &env, Vec::new(), Network::Host).unwrap();
        assert_eq!(spec.args, ["sh", "-c", "echo hi $(GREETING)"]);
        assert!(spec.id.starts_with("web-1-main-"), "{}", spec.id);
        assert_eq!(spec.hostname, "web-1");
        assert_eq!(spec.cwd, "/work");
        assert!(spec.env.contains(&("GREETING".to_owned(), "hi".to_owned())));
        assert!(
            spec.env
                .contains(&("HOSTNAME".to_owned(), "web-1".to_owned()))
        );
        assert!(!spec.capabilities.contains(&"CAP_NET_RAW".to_owned()));
        assert!(spec.capabilities.contains(&"CAP_SYS_PTRACE".to_owned()));
        let config = spec.oci_config(Path::new("/rootfs"));
        assert_eq!(config["process"]["user"], json!({"uid": 1000, "gid": 0}));
        assert_eq!(config["root"]["readonly"], json!(true));

        let empty: K8sContainer = serde_json::from_value(json!({"name": "x"})).unwrap();
        assert!(container_spec(&pod, &empty, &image, &[], Vec::new(), Network::Host).is_err());
    }
}
