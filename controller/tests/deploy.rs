//! The manifests in `deploy/`: the committed CRD is what the code generates, and the top-level
//! kustomization renders (with the real `kubectl kustomize`) into objects that parse as their
//! Kubernetes types and keep the promises the design makes (least privilege, node access).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Deserialize;
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn render(dir: &str) -> Vec<Value> {
    kustomize(&repo().join(dir))
}

/// `kubectl kustomize <dir>`, the objects it prints.
fn kustomize(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl")
        .args(["kustomize"])
        .arg(dir)
        .output()
        .expect("kubectl is installed by `make setup`");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("kustomize prints UTF-8");
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("kustomize prints valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!(
            "{} {} does not parse: {e}",
            v["kind"], v["metadata"]["name"]
        )
    })
}

#[test]
fn committed_crd_matches_the_generated_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_warmstart-controller"))
        .arg("crd")
        .output()
        .unwrap();
    assert!(out.status.success());
    let committed = std::fs::read_to_string(repo().join("deploy/crd/checkpoint.yaml")).unwrap();
    assert!(
        committed == String::from_utf8_lossy(&out.stdout),
        "deploy/crd/checkpoint.yaml is stale: run `make generate` and commit it"
    );
}

#[test]
fn every_rendered_object_parses_as_its_kubernetes_type() {
    let mut objects = render("deploy");
    objects.extend(render("deploy/storage"));
    assert!(
        objects.len() >= 10,
        "only {} objects rendered",
        objects.len()
    );
    for obj in &objects {
        match obj["kind"].as_str().unwrap_or_default() {
            "Namespace" => drop(typed::<Namespace>(obj)),
            "ServiceAccount" => drop(typed::<ServiceAccount>(obj)),
            "ClusterRole" => drop(typed::<ClusterRole>(obj)),
            "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(obj)),
            "Role" => drop(typed::<Role>(obj)),
            "RoleBinding" => drop(typed::<RoleBinding>(obj)),
            "Deployment" => drop(typed::<Deployment>(obj)),
            "DaemonSet" => drop(typed::<DaemonSet>(obj)),
            "Service" => drop(typed::<Service>(obj)),
            "PersistentVolumeClaim" => drop(typed::<PersistentVolumeClaim>(obj)),
            "ConfigMap" => drop(typed::<ConfigMap>(obj)),
            "Lease" => drop(typed::<k8s_openapi::api::coordination::v1::Lease>(obj)),
            "ResourceQuota" => drop(typed::<k8s_openapi::api::core::v1::ResourceQuota>(obj)),
            "PodDisruptionBudget" => drop(
                typed::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(obj),
            ),
            "CustomResourceDefinition" => drop(typed::<CustomResourceDefinition>(obj)),
            "MutatingWebhookConfiguration" => drop(typed::<
                k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration,
            >(obj)),
            "ValidatingWebhookConfiguration" => drop(typed::<
                k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration,
            >(obj)),
            other => panic!("unexpected kind {other} in deploy/"),
        }
    }
}

fn rules(objects: &[Value]) -> Vec<(String, PolicyRule)> {
    let mut all = Vec::new();
    for obj in objects {
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        match obj["kind"].as_str() {
            Some("ClusterRole") => {
                let role: ClusterRole = typed(obj);
                all.extend(
                    role.rules
                        .unwrap_or_default()
                        .into_iter()
                        .map(|r| (name.clone(), r)),
                );
            }
            Some("Role") => {
                let role: Role = typed(obj);
                all.extend(
                    role.rules
                        .unwrap_or_default()
                        .into_iter()
                        .map(|r| (name.clone(), r)),
                );
            }
            _ => {}
        }
    }
    all
}

#[test]
fn rbac_grants_no_wildcards() {
    let rules = rules(&render("deploy"));
    assert!(!rules.is_empty());
    for (role, rule) in rules {
        let fields = [
            rule.api_groups.unwrap_or_default(),
            rule.resources.unwrap_or_default(),
            rule.verbs,
        ];
        for value in fields.iter().flatten() {
            assert!(
                !value.contains('*'),
                "role {role} grants a wildcard: {value}"
            );
        }
    }
}

#[test]
fn users_get_checkpoints_through_the_aggregated_view_edit_and_admin_roles() {
    let objects = render("deploy");
    let role = |name: &str| -> ClusterRole {
        typed(
            objects
                .iter()
                .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("ClusterRole {name} is shipped")),
        )
    };
    let aggregated_into = |role: &ClusterRole| -> Vec<String> {
        let labels = role.metadata.labels.clone().unwrap_or_default();
        ["view", "edit", "admin"]
            .into_iter()
            .filter(|to| {
                labels
                    .get(&format!("rbac.authorization.k8s.io/aggregate-to-{to}"))
                    .is_some_and(|v| v == "true")
            })
            .map(str::to_owned)
            .collect()
    };
    let verbs = |role: &ClusterRole| -> Vec<String> {
        let mut verbs: Vec<String> = role
            .rules
            .iter()
            .flatten()
            .filter(|r| r.api_groups.as_deref() == Some(&["warmstart.dev".to_owned()][..]))
            .filter(|r| r.resources.iter().flatten().any(|res| res == "checkpoints"))
            .flat_map(|r| r.verbs.clone())
            .collect();
        verbs.sort();
        verbs
    };
    let view = role("warmstart-checkpoints-view");
    assert_eq!(aggregated_into(&view), ["view", "edit", "admin"]);
    assert_eq!(verbs(&view), ["get", "list", "watch"]);
    let edit = role("warmstart-checkpoints-edit");
    assert_eq!(aggregated_into(&edit), ["edit", "admin"]);
    assert_eq!(
        verbs(&edit),
        ["create", "delete", "deletecollection", "patch", "update"]
    );
    // Only the controller writes a Checkpoint's status.
    for role in [&view, &edit] {
        for rule in role.rules.iter().flatten() {
            if rule
                .resources
                .iter()
                .flatten()
                .any(|r| r == "checkpoints/status")
            {
                assert!(
                    rule.verbs
                        .iter()
                        .all(|v| ["get", "list", "watch"].contains(&v.as_str())),
                    "{:?} writes checkpoints/status",
                    role.metadata.name
                );
            }
        }
    }
}

/// Renders `deploy/` through an overlay that adds `namePrefix` and moves it to `namespace`, as a
/// user customising the installation would.
fn render_overlay(name_prefix: &str, namespace: &str) -> Vec<Value> {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // kustomize takes a base only by a relative path.
    let depth = dir.path().components().count() - 1;
    let base = format!(
        "{}{}",
        "../".repeat(depth),
        repo()
            .join("deploy")
            .canonicalize()
            .unwrap()
            .display()
            .to_string()
            .trim_start_matches('/')
    );
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamePrefix: {name_prefix}\nnamespace: {namespace}\nresources:\n  - {base}\n"
        ),
    )
    .unwrap();
    kustomize(dir.path())
}

/// The names the controller is configured with agree with the objects they name, the webhooks'
/// Service, the certificate it would issue and the RBAC that grants them by name.
fn assert_names_agree(objects: &[Value], namespace: &str) {
    let one = |kind: &str| -> &Value {
        let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found[0]
    };
    let deployment = one("Deployment");
    assert_eq!(deployment["metadata"]["namespace"], namespace);
    let env = |name: &str| -> String {
        deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("the controller's environment sets {name}"))["value"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let service = one("Service");
    let service_name = env("WARMSTART_WEBHOOK_SERVICE");
    assert_eq!(service["metadata"]["name"], service_name.as_str());
    assert_eq!(service["metadata"]["namespace"], namespace);
    // The certificate the controller issues covers the name the API server calls.
    let settings = warmstart_controller::certs::CertSettings {
        service_name: service_name.clone(),
        service_namespace: namespace.to_owned(),
        ..Default::default()
    };
    let dns_names = settings.dns_names();
    let cluster_role = objects
        .iter()
        .find(|o| {
            o["kind"] == "ClusterRole"
                && o["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("warmstart-controller"))
        })
        .unwrap();
    let granted = |role: &Value, resource: &str| -> Vec<String> {
        role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["resources"] == serde_json::json!([resource]))
            .flat_map(|r| r["resourceNames"].as_array().cloned().unwrap_or_default())
            .map(|n| n.as_str().unwrap().to_owned())
            .collect()
    };
    for (kind, variable, resource) in [
        (
            "MutatingWebhookConfiguration",
            "WARMSTART_WEBHOOK_MUTATING_CONFIGURATION",
            "mutatingwebhookconfigurations",
        ),
        (
            "ValidatingWebhookConfiguration",
            "WARMSTART_WEBHOOK_VALIDATING_CONFIGURATION",
            "validatingwebhookconfigurations",
        ),
    ] {
        let config = one(kind);
        let name = env(variable);
        assert_eq!(config["metadata"]["name"], name.as_str(), "{kind}");
        assert_eq!(
            granted(cluster_role, resource),
            std::slice::from_ref(&name),
            "{kind}"
        );
        for webhook in config["webhooks"].as_array().unwrap() {
            let svc = &webhook["clientConfig"]["service"];
            assert_eq!(svc["name"], service_name.as_str(), "{kind}");
            assert_eq!(svc["namespace"], namespace, "{kind}");
            let host = format!("{}.{}.svc", service_name, namespace);
            assert!(dns_names.contains(&host), "{host} not in {dns_names:?}");
        }
    }
    let lease = one("Lease");
    let lease_name = env("WARMSTART_LEASE_NAME");
    assert_eq!(lease["metadata"]["name"], lease_name.as_str());
    assert_eq!(lease["metadata"]["namespace"], namespace);
    let role = objects
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["namespace"] == namespace)
        .unwrap();
    assert_eq!(granted(role, "leases"), [lease_name]);
    assert_eq!(
        granted(role, "secrets"),
        [env("WARMSTART_WEBHOOK_SECRET")],
        "the certificate Secret is granted by the name the controller uses"
    );
}

#[test]
fn names_agree_as_deployed_and_under_a_name_prefix_in_another_namespace() {
    assert_names_agree(&render("deploy"), "warmstart-system");
    let objects = render_overlay("team-", "inference-infra");
    assert_names_agree(&objects, "inference-infra");
    let config = objects
        .iter()
        .find(|o| o["kind"] == "MutatingWebhookConfiguration")
        .unwrap();
    assert_eq!(config["metadata"]["name"], "team-warmstart-restore");
}

#[test]
fn the_agent_runs_privileged_with_the_node_paths_it_needs() {
    let objects = render("deploy");
    let ds: DaemonSet = typed(
        objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet")
            .expect("agent DaemonSet"),
    );
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_pid, Some(true));
    let agent = &pod.containers[0];
    let sc = agent.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(true));
    let host_paths: Vec<String> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.clone()))
        .collect();
    for needed in [
        "/proc",
        "/sys/fs/cgroup",
        "/run/containerd",
        "/var/lib/kubelet",
    ] {
        assert!(
            host_paths.iter().any(|p| p == needed),
            "agent lacks hostPath {needed}: {host_paths:?}"
        );
    }
    // Pods' emptyDir signal and control directories are reached through the kubelet root,
    // with the kubelet's later mounts propagated in; no signal hostPath is left over.
    assert!(
        !host_paths.iter().any(|p| p.contains("signals")),
        "{host_paths:?}"
    );
    let kubelet_root = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| {
            v.host_path
                .as_ref()
                .is_some_and(|h| h.path == "/var/lib/kubelet")
        })
        .expect("kubelet root volume");
    let mount = agent
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == kubelet_root.name)
        .expect("kubelet root mounted into the agent");
    assert_eq!(mount.mount_path, "/var/lib/kubelet");
    assert_eq!(mount.mount_propagation.as_deref(), Some("HostToContainer"));
    assert!(
        pod.init_containers
            .unwrap_or_default()
            .iter()
            .any(|c| c.name.contains("seccomp"))
    );
}

#[test]
fn the_controller_runs_as_non_root_with_probes_and_the_artifact_volume() {
    let objects = render("deploy");
    let deploy: Deployment = typed(
        objects
            .iter()
            .find(|o| o["kind"] == "Deployment")
            .expect("controller Deployment"),
    );
    let pod = deploy.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().unwrap();
    let pod_sc = pod.security_context.clone().unwrap_or_default();
    assert!(sc.run_as_non_root == Some(true) || pod_sc.run_as_non_root == Some(true));
    assert!(c.liveness_probe.is_some() && c.readiness_probe.is_some());
    assert!(c.resources.is_some());
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/var/lib/warmstart/checkpoints")
    );
    let storage = render("deploy/storage");
    let pvc: PersistentVolumeClaim = typed(
        storage
            .iter()
            .find(|o| o["kind"] == "PersistentVolumeClaim")
            .expect("artifact PVC"),
    );
    assert_eq!(
        pvc.spec.unwrap().access_modes.unwrap_or_default(),
        vec!["ReadWriteMany".to_owned()]
    );
}

/// `kubectl delete -k deploy` deletes what `deploy/` renders: neither the namespace (deleting it
/// would delete the PVC with it), nor the artifact PVC, nor the Checkpoint CRD (deleting it
/// deletes every Checkpoint, whose finalizer then deletes its artifact) may be among them. They
/// come from `deploy/storage`, and every workload of `deploy/` claims that PVC in that namespace.
#[test]
fn an_uninstall_keeps_the_checkpoint_artifacts() {
    let app = render("deploy");
    for kind in [
        "Namespace",
        "PersistentVolumeClaim",
        "CustomResourceDefinition",
    ] {
        let found: Vec<&Value> = app.iter().filter(|o| o["kind"] == kind).collect();
        assert!(
            found.is_empty(),
            "deploy/ renders a {kind} that kubectl delete -k deploy would delete: {found:?}"
        );
    }
    let storage = render("deploy/storage");
    let kinds: Vec<&str> = storage
        .iter()
        .map(|o| o["kind"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        kinds,
        [
            "Namespace",
            "CustomResourceDefinition",
            "PersistentVolumeClaim"
        ],
        "{storage:?}"
    );
    let namespace = storage[0]["metadata"]["name"].as_str().unwrap();
    let pvc = &storage[2]["metadata"];
    assert_eq!(pvc["namespace"], namespace);
    let mut claims = 0;
    for obj in &app {
        for volume in obj["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(claim) = volume["persistentVolumeClaim"]["claimName"].as_str() {
                claims += 1;
                assert_eq!(
                    claim, pvc["name"],
                    "{} claims another PVC",
                    obj["metadata"]["name"]
                );
                assert_eq!(
                    obj["metadata"]["namespace"], namespace,
                    "{} is not in the PVC's namespace",
                    obj["metadata"]["name"]
                );
            }
        }
    }
    assert!(
        claims >= 2,
        "the controller and the agent both mount the artifact PVC"
    );
}

/// The rules of the profile as (names, action, errnoRet, has args).
fn seccomp_rules(profile: &Value) -> Vec<(Vec<String>, String, Option<u64>, bool)> {
    profile["syscalls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|rule| {
            (
                rule["names"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_str().unwrap().to_owned())
                    .collect(),
                rule["action"].as_str().unwrap().to_owned(),
                rule["errnoRet"].as_u64(),
                rule.get("args").is_some(),
            )
        })
        .collect()
}

// The profile is the container runtime's default filter
// plus io_uring failing with ENOSYS, never an allow-all profile.
#[test]
fn the_seccomp_profile_is_the_runtime_default_with_io_uring_failing_enosys() {
    let text = std::fs::read_to_string(repo().join("deploy/seccomp/warmstart-block-iouring.json"))
        .unwrap();
    let profile: Value = serde_json::from_str(&text).unwrap();
    // Deny by default with EPERM, as the runtimes' default profile does.
    assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO");
    assert_eq!(profile["defaultErrnoRet"], 1);
    // Only fields of the OCI runtime spec's seccomp object: containerd reads a Localhost
    // profile straight into it and would silently ignore Docker's `includes`, `excludes` and
    // `archMap`, applying capability-gated rules to every container.
    let object = profile.as_object().unwrap();
    for key in object.keys() {
        assert!(
            [
                "defaultAction",
                "defaultErrnoRet",
                "architectures",
                "syscalls"
            ]
            .contains(&key.as_str()),
            "unexpected top-level field {key}"
        );
    }
    for rule in profile["syscalls"].as_array().unwrap() {
        for key in rule.as_object().unwrap().keys() {
            assert!(
                ["names", "action", "errnoRet", "args"].contains(&key.as_str()),
                "unexpected rule field {key}: {rule}"
            );
        }
    }
    let arches: Vec<&str> = profile["architectures"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for arch in ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"] {
        assert!(arches.contains(&arch), "{arch} missing");
    }

    let rules = seccomp_rules(&profile);
    let allowed: Vec<&str> = rules
        .iter()
        .filter(|(_, action, _, args)| action == "SCMP_ACT_ALLOW" && !args)
        .flat_map(|(names, ..)| names.iter().map(String::as_str))
        .collect();
    // The default allow list: what every inference server and its runtime needs.
    for name in [
        "read",
        "write",
        "openat",
        "close",
        "mmap",
        "mprotect",
        "munmap",
        "brk",
        "futex",
        "execve",
        "exit_group",
        "rt_sigaction",
        "epoll_wait",
        "epoll_pwait",
        "accept4",
        "sendmsg",
        "recvmsg",
        "ioctl",
        "getrandom",
        "rseq",
        "set_robust_list",
        "wait4",
        "clock_nanosleep",
        "sched_getaffinity",
        "memfd_create",
        "madvise",
        "prctl",
    ] {
        assert!(allowed.contains(&name), "{name} is not allowed");
    }
    // What the default profile denies to a container without extra capabilities.
    for name in [
        "mount",
        "umount2",
        "unshare",
        "setns",
        "bpf",
        "perf_event_open",
        "kexec_load",
        "init_module",
        "reboot",
        "open_by_handle_at",
        "keyctl",
        "add_key",
        "userfaultfd",
    ] {
        assert!(
            rules
                .iter()
                .all(|(names, ..)| !names.iter().any(|n| n == name)),
            "{name} must fall to the default action"
        );
    }
    // clone only without namespace flags (a masked-equal rule), clone3 ENOSYS so libc falls
    // back to clone.
    assert!(
        rules
            .iter()
            .any(|(names, action, _, args)| names == &["clone"]
                && action == "SCMP_ACT_ALLOW"
                && *args)
    );
    assert!(!allowed.contains(&"clone"));
    // io_uring: ENOSYS (38), so runtimes fall back to epoll, and in no other rule (libseccomp
    // refuses two actions for one syscall).
    for name in [
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "clone3",
    ] {
        let holding: Vec<_> = rules
            .iter()
            .filter(|(names, ..)| names.iter().any(|n| n == name))
            .collect();
        assert_eq!(holding.len(), 1, "{name}: {holding:?}");
        assert_eq!(holding[0].1, "SCMP_ACT_ERRNO", "{name}");
        assert_eq!(holding[0].2, Some(38), "{name}");
    }
    // Arg-less rules name each syscall once.
    let mut seen = std::collections::BTreeSet::new();
    for (names, _, _, args) in &rules {
        if !args {
            for n in names {
                assert!(seen.insert(n.clone()), "{n} appears twice");
            }
        }
    }
}

#[test]
fn the_examples_shape_through_the_command_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_warmstart-controller"))
        .args([
            "render-job",
            "--uid",
            "00000000-0000-4000-8000-000000000001",
            "-f",
        ])
        .arg(repo().join("deploy/examples/checkpoint.yaml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let job: k8s_openapi::api::batch::v1::Job =
        serde_norway::from_slice(&out.stdout).expect("render-job prints a Job");
    assert_eq!(
        job.metadata.name.as_deref(),
        Some("checkpoint-llama-7b-vllm")
    );

    let pod: k8s_openapi::api::core::v1::Pod = serde_norway::from_str(
        &std::fs::read_to_string(repo().join("deploy/examples/restore-pod.yaml")).unwrap(),
    )
    .unwrap();
    let annotations = pod.metadata.annotations.unwrap_or_default();
    assert_eq!(annotations["warmstart.dev/restore-from"], "llama-7b-vllm");
    assert_eq!(annotations["warmstart.dev/target-containers"], "main");
}
