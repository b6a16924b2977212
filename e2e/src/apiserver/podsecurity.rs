//! Pod Security admission (k8s.io/pod-security-admission), the `baseline` level: a pod created
//! in a namespace labelled `pod-security.kubernetes.io/enforce: baseline` (or `restricted`,
//! checked here at baseline only) is refused with the checks it fails, worded as upstream
//! words them (`violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true), …`).
//! Unlabelled and `privileged` namespaces are not checked; neither are pod templates of
//! workloads (upstream only warns about those).
//!
//! The checks are the baseline policy of the Pod Security Standards as of Kubernetes 1.30:
//! HostProcess, host namespaces, privileged containers, added capabilities beyond the default
//! set, hostPath volumes, host ports, AppArmor, SELinux, `/proc` mount type, seccomp
//! `Unconfined`, unsafe sysctls.

use serde_json::Value;

use super::error::ApiError;
use super::meta;

/// The namespace label that selects the enforced level.
pub const ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";

/// Capabilities a baseline container may add (the container runtimes' default set).
const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// Sysctls a baseline pod may set.
const SAFE_SYSCTLS: [&str; 10] = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
];

/// SELinux types a baseline pod may ask for.
const SELINUX_TYPES: [&str; 5] = [
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
];

/// Every container of a pod spec with the name of its list.
fn containers(spec: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers", "ephemeralContainers"]
        .into_iter()
        .flat_map(move |list| spec[list].as_array().into_iter().flatten())
}

fn name_of(c: &Value) -> &str {
    c["name"].as_str().unwrap_or_default()
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The baseline checks `pod` (a served Pod object) fails, each as upstream reports it; empty
/// when it passes.
pub fn baseline_violations(pod: &Value) -> Vec<String> {
    let spec = &pod["spec"];
    let mut out = Vec::new();

    let host_process: Vec<String> = containers(spec)
        .filter(|c| c["securityContext"]["windowsOptions"]["hostProcess"] == true)
        .map(|c| name_of(c).to_owned())
        .collect();
    if spec["securityContext"]["windowsOptions"]["hostProcess"] == true || !host_process.is_empty()
    {
        out.push("hostProcess (pod or containers must not set hostProcess=true)".to_owned());
    }

    let host_ns: Vec<String> = ["hostNetwork", "hostPID", "hostIPC"]
        .into_iter()
        .filter(|k| spec[*k] == true)
        .map(|k| format!("{k}=true"))
        .collect();
    if !host_ns.is_empty() {
        out.push(format!("host namespaces ({})", host_ns.join(", ")));
    }

    let privileged: Vec<String> = containers(spec)
        .filter(|c| c["securityContext"]["privileged"] == true)
        .map(|c| name_of(c).to_owned())
        .collect();
    if !privileged.is_empty() {
        out.push(format!(
            "privileged (container{} {} must not set securityContext.privileged=true)",
            if privileged.len() > 1 { "s" } else { "" },
            quoted(&privileged)
        ));
    }

    let mut added = Vec::new();
    for c in containers(spec) {
        for cap in c["securityContext"]["capabilities"]["add"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !BASELINE_CAPABILITIES.contains(&cap) && !added.iter().any(|a| a == cap) {
                added.push(cap.to_owned());
            }
        }
    }
    if !added.is_empty() {
        out.push(format!(
            "non-default capabilities (must not include {})",
            quoted(&added)
        ));
    }

    let host_paths: Vec<String> = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v.get("hostPath").is_some_and(|h| !h.is_null()))
        .map(|v| v["name"].as_str().unwrap_or_default().to_owned())
        .collect();
    if !host_paths.is_empty() {
        out.push(format!(
            "hostPath volume{} ({})",
            if host_paths.len() > 1 { "s" } else { "" },
            quoted(&host_paths)
        ));
    }

    let mut ports = Vec::new();
    for c in containers(spec) {
        for port in c["ports"].as_array().into_iter().flatten() {
            if let Some(p) = port["hostPort"].as_u64().filter(|p| *p != 0) {
                ports.push(p.to_string());
            }
        }
    }
    if !ports.is_empty() {
        out.push(format!("hostPort (hostPorts {})", ports.join(", ")));
    }

    let annotations = pod["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let unconfined_apparmor = annotations.iter().any(|(k, v)| {
        k.starts_with("container.apparmor.security.beta.kubernetes.io/")
            && v.as_str()
                .is_some_and(|v| v != "runtime/default" && !v.starts_with("localhost/"))
    }) || std::iter::once(&spec["securityContext"])
        .chain(containers(spec).map(|c| &c["securityContext"]))
        .any(|sc| sc["appArmorProfile"]["type"] == "Unconfined");
    if unconfined_apparmor {
        out.push("appArmorProfile (must not be Unconfined)".to_owned());
    }

    let bad_selinux = std::iter::once(&spec["securityContext"])
        .chain(containers(spec).map(|c| &c["securityContext"]))
        .map(|sc| &sc["seLinuxOptions"])
        .any(|o| {
            !SELINUX_TYPES.contains(&o["type"].as_str().unwrap_or_default())
                || !o["user"].as_str().unwrap_or_default().is_empty()
                || !o["role"].as_str().unwrap_or_default().is_empty()
        });
    if bad_selinux {
        out.push("seLinuxOptions (type, user and role must be allowed values)".to_owned());
    }

    let proc_mount: Vec<String> = containers(spec)
        .filter(|c| {
            c["securityContext"]["procMount"]
                .as_str()
                .is_some_and(|m| m != "Default")
        })
        .map(|c| name_of(c).to_owned())
        .collect();
    if !proc_mount.is_empty() {
        out.push(format!(
            "procMount (containers {} must not set securityContext.procMount)",
            quoted(&proc_mount)
        ));
    }

    let unconfined_seccomp = std::iter::once(&spec["securityContext"])
        .chain(containers(spec).map(|c| &c["securityContext"]))
        .any(|sc| sc["seccompProfile"]["type"] == "Unconfined");
    if unconfined_seccomp {
        out.push("seccompProfile (must not set seccompProfile.type to \"Unconfined\")".to_owned());
    }

    let sysctls: Vec<String> = spec["securityContext"]["sysctls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["name"].as_str())
        .filter(|n| !SAFE_SYSCTLS.contains(n))
        .map(str::to_owned)
        .collect();
    if !sysctls.is_empty() {
        out.push(format!("forbidden sysctls ({})", sysctls.join(", ")));
    }
    out
}

/// Admits a pod created in a namespace with `namespace_labels`, or refuses it (403) naming
/// every baseline check it fails.
///
/// # Errors
/// [`ApiError`] `Forbidden` when the namespace enforces `baseline` (or `restricted`) and the pod
/// fails a check.
pub fn admit_pod(
    namespace_labels: &serde_json::Map<String, Value>,
    pod: &Value,
) -> Result<(), ApiError> {
    let level = namespace_labels
        .get(ENFORCE_LABEL)
        .and_then(Value::as_str)
        .unwrap_or("privileged");
    if level != "baseline" && level != "restricted" {
        return Ok(());
    }
    let violations = baseline_violations(pod);
    if violations.is_empty() {
        return Ok(());
    }
    Err(ApiError::forbidden(format!(
        "pods {:?} is forbidden: violates PodSecurity \"{level}:latest\": {}",
        meta::name(pod),
        violations.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn labels(level: &str) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert(ENFORCE_LABEL.to_owned(), json!(level));
        m
    }

    #[test]
    fn a_plain_pod_passes() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {
            "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "x.json"}},
            "volumes": [{"name": "signal", "emptyDir": {}}],
            "containers": [{"name": "main", "image": "i", "ports": [{"containerPort": 8000}],
                "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}}}]}});
        assert_eq!(baseline_violations(&pod), Vec::<String>::new());
        admit_pod(&labels("baseline"), &pod).unwrap();
    }

    #[test]
    fn every_check_names_what_it_refuses() {
        let pod = json!({"metadata": {"name": "p", "annotations": {
                "container.apparmor.security.beta.kubernetes.io/main": "unconfined"}},
            "spec": {
                "hostNetwork": true, "hostPID": true,
                "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}],
                    "seLinuxOptions": {"type": "spc_t"}},
                "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
                "initContainers": [{"name": "init", "securityContext": {"privileged": true}}],
                "containers": [{"name": "main", "ports": [{"containerPort": 80, "hostPort": 80}],
                    "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]},
                        "procMount": "Unmasked", "seccompProfile": {"type": "Unconfined"}}}]}});
        let v = baseline_violations(&pod).join("; ");
        for expected in [
            "host namespaces (hostNetwork=true, hostPID=true)",
            "privileged (container \"init\" must not set securityContext.privileged=true)",
            "non-default capabilities (must not include \"SYS_ADMIN\")",
            "hostPath volume (\"host\")",
            "hostPort (hostPorts 80)",
            "appArmorProfile",
            "seLinuxOptions",
            "procMount (containers \"main\"",
            "seccompProfile",
            "forbidden sysctls (kernel.msgmax)",
        ] {
            assert!(v.contains(expected), "{expected} missing from {v}");
        }
        let err = admit_pod(&labels("baseline"), &pod).unwrap_err();
        assert_eq!(err.code, 403);
        assert!(
            err.message
                .starts_with("pods \"p\" is forbidden: violates PodSecurity \"baseline:latest\": "),
            "{}",
            err.message
        );
    }

    #[test]
    fn only_enforcing_namespaces_refuse() {
        let pod =
            json!({"metadata": {"name": "p"}, "spec": {"hostNetwork": true, "containers": []}});
        admit_pod(&serde_json::Map::new(), &pod).unwrap();
        admit_pod(&labels("privileged"), &pod).unwrap();
        assert!(admit_pod(&labels("restricted"), &pod).is_err());
    }
}
