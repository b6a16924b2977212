//! The Helm chart (`deploy/helm/warmstart`) as Helm renders it: it lints clean, renders for its
//! default values exactly the objects `deploy/` renders (plus the artifact PVC of
//! `deploy/storage`), carries the CRD `make generate` writes, and each of its settings reaches
//! every place that depends on it. Its optional monitoring objects are checked with the real
//! `promtool` and against the metrics the programs register. Rendered with the Helm that
//! `make helm-build` builds; nothing is contacted.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;
use warmstart_e2e::manifests::{self, CHART, find, helm_run, helm_template, kustomize, repo};

/// Labels Helm's conventions add to the objects' metadata (not to selectors or pod templates).
const HELM_LABELS: [&str; 4] = [
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
];

/// An object keyed for comparison, with what only Helm adds taken out.
fn normalized(mut object: Value) -> (String, Value) {
    let meta = object["metadata"].as_object_mut().unwrap();
    if let Some(labels) = meta.get_mut("labels").and_then(Value::as_object_mut) {
        for l in HELM_LABELS {
            labels.remove(l);
        }
    }
    if let Some(annotations) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
        // The artifact PVC outlives `helm uninstall`; deploy/storage outlives `delete -k deploy`.
        annotations.remove("helm.sh/resource-policy");
        if annotations.is_empty() {
            meta.remove("annotations");
        }
    }
    let key = format!(
        "{} {}/{}",
        object["kind"].as_str().unwrap(),
        object["metadata"]["namespace"].as_str().unwrap_or(""),
        object["metadata"]["name"].as_str().unwrap()
    );
    (key, object)
}

/// The objects Helm applies as release resources (hooks, such as the uninstall Job, are the
/// chart's own: kustomize users run their step by hand).
fn by_key(objects: Vec<Value>) -> BTreeMap<String, Value> {
    objects
        .into_iter()
        .filter(|o| o["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .map(normalized)
        .collect()
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

fn agent(objects: &[Value]) -> &Value {
    &find(objects, "DaemonSet", "warmstart-agent").expect("the agent DaemonSet")["spec"]["template"]
        ["spec"]
}

fn controller(objects: &[Value]) -> &Value {
    &find(objects, "Deployment", "warmstart-controller").expect("the controller Deployment")["spec"]
        ["template"]["spec"]
}

/// (mountPath, hostPath) of each hostPath volume mounted into the agent container.
fn agent_host_mounts(objects: &[Value]) -> BTreeMap<String, String> {
    let spec = agent(objects);
    let volumes: BTreeMap<&str, &str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| Some((v["name"].as_str()?, v["hostPath"]["path"].as_str()?)))
        .collect();
    spec["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| {
            let host = volumes.get(m["name"].as_str()?)?;
            Some((m["mountPath"].as_str()?.to_owned(), (*host).to_owned()))
        })
        .collect()
}

#[test]
fn the_chart_lints_clean() {
    let out = helm_run(&["lint", "--strict", CHART]).unwrap();
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn for_its_default_values_the_chart_renders_what_deploy_renders() {
    let chart = by_key(helm_template(&[]).unwrap());
    let mut deploy = by_key(kustomize("deploy").unwrap());
    // What deploy/storage holds besides the CRD and the namespace: the artifact claim.
    let storage = kustomize("deploy/storage").unwrap();
    let pvc = storage
        .into_iter()
        .find(|o| o["kind"] == "PersistentVolumeClaim")
        .unwrap();
    deploy.extend([normalized(pvc)]);

    let chart_keys: BTreeSet<&String> = chart.keys().collect();
    let deploy_keys: BTreeSet<&String> = deploy.keys().collect();
    assert_eq!(
        chart_keys, deploy_keys,
        "the chart and deploy/ render different objects"
    );
    for (key, object) in &deploy {
        assert_eq!(
            &chart[key],
            object,
            "{key} differs:\nchart:\n{}\ndeploy/:\n{}",
            serde_norway::to_string(&chart[key]).unwrap(),
            serde_norway::to_string(object).unwrap()
        );
    }
}

#[test]
fn the_charts_crd_is_the_one_make_generate_writes() {
    let generated = std::fs::read_to_string(repo().join("deploy/crd/checkpoint.yaml")).unwrap();
    let chart = std::fs::read_to_string(repo().join(CHART).join("crds/checkpoint.yaml")).unwrap();
    assert!(
        generated == chart,
        "{CHART}/crds/checkpoint.yaml differs from deploy/crd/checkpoint.yaml: run `make generate`"
    );
}

#[test]
fn the_chart_installs_this_release() {
    let chart: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo().join(CHART).join("Chart.yaml")).unwrap(),
    )
    .unwrap();
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(chart["version"], version, "Chart.yaml version");
    assert_eq!(chart["appVersion"], version, "Chart.yaml appVersion");
    let objects = helm_template(&[]).unwrap();
    assert_eq!(
        agent(&objects)["containers"][0]["image"],
        format!("ghcr.io/warmstart/agent:{version}")
    );
    assert_eq!(
        env(
            &controller(&objects)["containers"][0],
            "WARMSTART_ENTRYPOINT_IMAGE"
        ),
        Some(warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE),
        "the controller's own default Wrap image is the chart's"
    );
}

#[test]
fn images_pull_settings_and_the_wrap_image_come_from_values() {
    let objects = helm_template(&[
        "image.agent.repository=registry.example/gpu/warmstart-agent",
        "image.agent.digest=sha256:0000000000000000000000000000000000000000000000000000000000000001",
        "image.controller.tag=9.9.9",
        "image.wrap.repository=registry.example/gpu/warmstart-entrypoint",
        "image.wrap.tag=1.2.3",
        "image.pullPolicy=Always",
        "image.pullSecrets[0]=regcred",
    ])
    .unwrap();
    let agent = agent(&objects);
    let digest = "registry.example/gpu/warmstart-agent@sha256:0000000000000000000000000000000000000000000000000000000000000001";
    assert_eq!(agent["containers"][0]["image"], digest);
    assert_eq!(agent["initContainers"][0]["image"], digest);
    assert_eq!(agent["containers"][0]["imagePullPolicy"], "Always");
    assert_eq!(agent["imagePullSecrets"][0]["name"], "regcred");
    let controller = controller(&objects);
    assert_eq!(
        controller["containers"][0]["image"],
        "ghcr.io/warmstart/controller:9.9.9"
    );
    assert_eq!(controller["imagePullSecrets"][0]["name"], "regcred");
    assert_eq!(
        env(&controller["containers"][0], "WARMSTART_ENTRYPOINT_IMAGE"),
        Some("registry.example/gpu/warmstart-entrypoint:1.2.3")
    );
    // Without image.wrap, Wrap pods copy the entrypoint from the agent image, whatever it is.
    let objects = helm_template(&["image.agent.tag=2.0.0"]).unwrap();
    assert_eq!(
        env(
            &controller_container(&objects),
            "WARMSTART_ENTRYPOINT_IMAGE"
        ),
        Some("ghcr.io/warmstart/agent:2.0.0")
    );
}

fn controller_container(objects: &[Value]) -> Value {
    controller(objects)["containers"][0].clone()
}

#[test]
fn each_runtime_is_set_once_and_reaches_the_agents_settings_and_mounts() {
    // (values, CRI socket, containerd state dir, containerd root)
    let cases: [(&str, &str, &str, &str); 4] = [
        (
            "containerd",
            "/run/containerd/containerd.sock",
            "/run/containerd",
            "/var/lib/containerd",
        ),
        (
            "crio",
            "/var/run/crio/crio.sock",
            "/run/containerd",
            "/var/lib/containerd",
        ),
        (
            "k3s",
            "/run/k3s/containerd/containerd.sock",
            "/run/k3s/containerd",
            "/var/lib/rancher/k3s/agent/containerd",
        ),
        (
            "rke2",
            "/run/k3s/containerd/containerd.sock",
            "/run/k3s/containerd",
            "/var/lib/rancher/rke2/agent/containerd",
        ),
    ];
    for (name, socket, state, root) in cases {
        let objects = helm_template(&[&format!("runtime.name={name}")]).unwrap();
        let container = &agent(&objects)["containers"][0];
        // The agent's defaults are containerd's: the variables appear only where they differ.
        assert_eq!(
            env(container, "WARMSTART_CRI_SOCKET").unwrap_or("/run/containerd/containerd.sock"),
            socket,
            "{name}: CRI socket"
        );
        assert_eq!(
            env(container, "WARMSTART_CONTAINERD_STATE_DIR").unwrap_or("/run/containerd"),
            state,
            "{name}: containerd state dir"
        );
        let mounts = agent_host_mounts(&objects);
        // Mounted at the host's own paths, so the paths the runtime reports resolve unchanged.
        assert_eq!(
            mounts.get(state).map(String::as_str),
            Some(state),
            "{name}: {mounts:?}"
        );
        assert_eq!(
            mounts.get(root).map(String::as_str),
            Some(root),
            "{name}: {mounts:?}"
        );
        let socket_dir = std::path::Path::new(socket)
            .parent()
            .unwrap()
            .to_str()
            .unwrap();
        assert!(
            mounts.keys().any(|m| socket_dir.starts_with(m.as_str())),
            "{name}: the socket's directory {socket_dir} is not mounted: {mounts:?}"
        );
    }
    // A socket elsewhere gets its own mount.
    let objects = helm_template(&["runtime.socket=/run/custom/cri.sock"]).unwrap();
    assert_eq!(
        env(&agent(&objects)["containers"][0], "WARMSTART_CRI_SOCKET"),
        Some("/run/custom/cri.sock")
    );
    assert_eq!(
        agent_host_mounts(&objects)
            .get("/run/custom")
            .map(String::as_str),
        Some("/run/custom")
    );
    let refused = helm_template(&["runtime.name=docker"])
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains(
            "at '/runtime/name': value must be one of 'containerd', 'crio', 'k3s', 'rke2'"
        ),
        "{refused}"
    );
}

#[test]
fn a_moved_kubelet_root_is_one_setting() {
    let objects = helm_template(&["kubeletRoot=/data/kubelet"]).unwrap();
    let text = serde_json::to_string(agent(&objects)).unwrap();
    assert!(
        !text.contains("/var/lib/kubelet"),
        "the default kubelet root is still named: {text}"
    );
    let mounts = agent_host_mounts(&objects);
    assert_eq!(
        mounts.get("/data/kubelet").map(String::as_str),
        Some("/data/kubelet")
    );
    assert_eq!(
        mounts.get("/host/seccomp").map(String::as_str),
        None,
        "the seccomp directory is the init container's"
    );
    let init_volume = agent(&objects)["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kubelet-seccomp")
        .unwrap();
    assert_eq!(init_volume["hostPath"]["path"], "/data/kubelet/seccomp");
    assert_eq!(
        env(&agent(&objects)["containers"][0], "WARMSTART_KUBELET_ROOT"),
        Some("/data/kubelet")
    );
}

#[test]
fn storage_node_selection_and_the_agents_runtime_class_come_from_values() {
    // An existing claim: none is created, every pod mounts that one.
    let objects = helm_template(&["storage.existingClaim=shared-artifacts"]).unwrap();
    assert!(
        !objects.iter().any(|o| o["kind"] == "PersistentVolumeClaim"),
        "a claim was created beside the existing one"
    );
    for spec in [agent(&objects), controller(&objects)] {
        let claim = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "checkpoints")
            .unwrap();
        assert_eq!(
            claim["persistentVolumeClaim"]["claimName"],
            "shared-artifacts"
        );
    }
    // A new claim, of a class and size; kept on uninstall.
    let objects = helm_template(&["storage.storageClassName=cephfs", "storage.size=2Ti"]).unwrap();
    let pvc = find(&objects, "PersistentVolumeClaim", "warmstart-checkpoints").unwrap();
    assert_eq!(pvc["spec"]["storageClassName"], "cephfs");
    assert_eq!(pvc["spec"]["resources"]["requests"]["storage"], "2Ti");
    assert_eq!(
        pvc["metadata"]["annotations"]["helm.sh/resource-policy"],
        "keep"
    );
    let objects = helm_template(&[
        "agent.runtimeClassName=nvidia",
        "agent.nodeSelector.pool=gpu-a100",
        "agent.tolerations=null",
        "agent.requireCuda=false",
    ])
    .unwrap();
    let spec = agent(&objects);
    assert_eq!(spec["runtimeClassName"], "nvidia");
    assert_eq!(spec["nodeSelector"]["pool"], "gpu-a100");
    assert!(spec["tolerations"].is_null(), "{}", spec["tolerations"]);
    assert_eq!(
        env(&spec["containers"][0], "WARMSTART_REQUIRE_CUDA"),
        Some("false")
    );
    // By default the agent runs under the node's default runtime.
    assert!(agent(&helm_template(&[]).unwrap())["runtimeClassName"].is_null());
}

/// The metric families a program registers (`# TYPE <name> <type>` lines of its exposition).
fn families(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// warmstart metric names in a PromQL text, as written.
fn warmstart_metrics(promql: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = promql;
    while let Some(at) = rest.find("warmstart_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// The agent's exposition with every metric family recorded once (a family with no series
/// is not listed).
fn agent_metrics() -> String {
    use warmstart_agent::cluster::metrics::{Ended, FailureCause, FallbackReason, Metrics};
    use warmstart_agent::progress::Operation;
    let metrics = Metrics::default();
    let _running = metrics.start(Operation::Restore);
    let mut timings = warmstart_agent::timings::Timings::default();
    timings.record("dump", std::time::Duration::from_secs(1));
    metrics.finished(Operation::Checkpoint, Ended::Success, Some(&timings));
    metrics.finished(Operation::Restore, Ended::Failure(FailureCause::Criu), None);
    metrics.refused(Operation::Restore, "stale-binding");
    metrics.pod_ready("restored", std::time::Duration::from_secs(3));
    metrics.published(1 << 30);
    metrics.fell_back(FallbackReason::Refused);
    metrics.progress(Operation::Restore).update(1, 2);
    metrics.encode()
}

/// The controller's, likewise.
fn controller_metrics() -> String {
    let metrics = warmstart_controller::metrics::Metrics::default();
    metrics.reconciled("ok", std::time::Duration::from_millis(3));
    metrics.set_phases(&[]);
    metrics.webhook_decision("mutate-pods", "mutated");
    metrics.encode()
}

fn monitoring() -> Vec<Value> {
    helm_template(&[
        "metrics.podMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
        "metrics.dashboard.enabled=true",
    ])
    .unwrap()
}

#[test]
fn the_monitoring_objects_are_optional_and_scrape_both_programs() {
    let plain = helm_template(&[]).unwrap();
    for kind in ["PodMonitor", "PrometheusRule"] {
        assert!(
            !plain.iter().any(|o| o["kind"] == kind),
            "{kind} by default"
        );
    }
    assert!(find(&plain, "ConfigMap", "warmstart-dashboard").is_none());
    let objects = monitoring();
    for (name, port) in [
        ("warmstart-agent", "admin"),
        ("warmstart-controller", "metrics"),
    ] {
        let monitor = find(&objects, "PodMonitor", name).unwrap();
        assert_eq!(
            monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
            name
        );
        assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["port"], port);
        // The port exists on the pods it selects.
        let workload = objects
            .iter()
            .find(|o| o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == name)
            .unwrap();
        let ports = &workload["spec"]["template"]["spec"]["containers"][0]["ports"];
        assert!(
            ports.as_array().unwrap().iter().any(|p| p["name"] == port),
            "{name} has no port {port}: {ports}"
        );
    }
}

#[test]
fn alerts_and_dashboard_query_metrics_the_programs_export() {
    let objects = monitoring();
    let rule = find(&objects, "PrometheusRule", "warmstart").unwrap();
    let dashboard = find(&objects, "ConfigMap", "warmstart-dashboard").unwrap();
    let dashboard: Value =
        serde_json::from_str(dashboard["data"]["warmstart.json"].as_str().unwrap()).unwrap();
    let mut queries: Vec<String> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["expr"].as_str().unwrap().to_owned())
        .collect();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    let mut exported = families(&agent_metrics());
    exported.extend(families(&controller_metrics()));
    let mut used = BTreeSet::new();
    for q in &queries {
        for name in warmstart_metrics(q) {
            // A series of a family: itself (a gauge), or a counter's or histogram's suffix.
            let family = std::iter::once(name.as_str())
                .chain(
                    ["_total", "_bucket", "_count", "_sum"]
                        .iter()
                        .filter_map(|s| name.strip_suffix(s)),
                )
                .find(|f| exported.contains(*f))
                .unwrap_or_else(|| {
                    panic!("{name} (in `{q}`) is not a metric warmstart exports: {exported:?}")
                });
            used.insert(family.to_owned());
        }
    }
    // The ones users pay for are on the dashboard.
    for needed in [
        "warmstart_agent_restore_pod_ready_seconds",
        "warmstart_agent_operation_duration_seconds",
        "warmstart_agent_operations",
        "warmstart_agent_restore_fallbacks",
        "warmstart_agent_failures",
    ] {
        assert!(used.contains(needed), "{needed} is not used: {used:?}");
    }
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    let objects = monitoring();
    let rule = find(&objects, "PrometheusRule", "warmstart").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("warmstart-rules.yaml");
    std::fs::write(&rules, serde_norway::to_string(&rule["spec"]).unwrap()).unwrap();
    std::fs::copy(
        repo().join("e2e/monitoring/alerts.test.yaml"),
        dir.path().join("alerts.test.yaml"),
    )
    .unwrap();
    for args in [
        vec!["check", "rules", "warmstart-rules.yaml"],
        vec!["test", "rules", "alerts.test.yaml"],
    ] {
        let out = Command::new("promtool")
            .args(&args)
            .current_dir(dir.path())
            .output()
            .expect("promtool (make setup installs it)");
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A value misspelt or of the wrong type is refused by the chart's schema, naming it, instead
/// of being ignored (a `requirecuda: false` that does nothing would leave GPU nodes unready).
#[test]
fn values_the_chart_does_not_know_are_refused_by_name() {
    for (value, message) in [
        (
            "agent.requirecuda=false",
            "at '/agent': additional properties 'requirecuda' not allowed",
        ),
        ("kubeletRoot=var/lib/kubelet", "at '/kubeletRoot'"),
        ("controller.replicas=0", "at '/controller/replicas'"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
        ("image.agent.digest=latest", "at '/image/agent/digest'"),
    ] {
        let refused = helm_template(&[value]).unwrap_err().to_string();
        assert!(refused.contains(message), "{value}: {refused}");
    }
}

#[test]
fn the_chart_refuses_an_empty_image_repository() {
    let refused = manifests::helm_template(&["image.agent.repository="])
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("image.*.repository must not be empty"),
        "{refused}"
    );
}

/// The object store's and the node cache's values for the chart (`helm --set`).
const OBJECT_STORE: [&str; 9] = [
    "objectStore.endpoint=http://198.18.0.1:8333",
    "objectStore.bucket=warmstart",
    "objectStore.prefix=artifacts",
    "objectStore.region=us-east-1",
    "objectStore.pathStyle=true",
    "objectStore.credentials.existingSecret=warmstart-object-store-credentials",
    "agent.cache.enabled=true",
    "agent.cache.hostPath=/var/lib/warmstart-cluster/cache",
    "agent.cache.maxGiB=4",
];

/// A container's environment as the kubelet gives it: `envFrom` ConfigMaps (of `objects`) first,
/// then `env` (which wins); `valueFrom` entries as `<valueFrom>`.
fn effective_env(objects: &[Value], container: &Value) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for from in container["envFrom"].as_array().into_iter().flatten() {
        let name = from["configMapRef"]["name"].as_str().unwrap();
        let map = find(objects, "ConfigMap", name)
            .unwrap_or_else(|| panic!("envFrom names ConfigMap {name}, which is not rendered"));
        for (k, v) in map["data"].as_object().unwrap() {
            env.insert(k.clone(), v.as_str().unwrap().to_owned());
        }
    }
    for e in container["env"].as_array().into_iter().flatten() {
        let value = e["value"]
            .as_str()
            .map_or_else(|| "<valueFrom>".to_owned(), str::to_owned);
        env.insert(e["name"].as_str().unwrap().to_owned(), value);
    }
    env
}

/// The object store's and the cache's part of a container's environment.
fn store_env(objects: &[Value], container: &Value) -> BTreeMap<String, String> {
    effective_env(objects, container)
        .into_iter()
        .filter(|(k, _)| k.starts_with("WARMSTART_S3_") || k.starts_with("WARMSTART_CACHE_"))
        .collect()
}

/// Where each file an environment variable `*_FILE` names comes from in `pod`: (variable,
/// `<kind>/<object>/<key>`), resolved through the container's mounts and the pod's volumes.
fn file_sources(pod: &Value, env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let container = &pod["containers"][0];
    let mut found = BTreeMap::new();
    for (name, path) in env.iter().filter(|(k, _)| k.ends_with("_FILE")) {
        let mount = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| {
                path.strip_prefix(m["mountPath"].as_str().unwrap())
                    .is_some_and(|rest| rest.starts_with('/'))
            })
            .unwrap_or_else(|| panic!("{name}={path} is in no mounted volume"));
        let file = &path[mount["mountPath"].as_str().unwrap().len() + 1..];
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        let (kind, object, items) = if volume["secret"].is_object() {
            (
                "Secret",
                &volume["secret"]["secretName"],
                &volume["secret"]["items"],
            )
        } else {
            (
                "ConfigMap",
                &volume["configMap"]["name"],
                &volume["configMap"]["items"],
            )
        };
        let key = items
            .as_array()
            .and_then(|items| items.iter().find(|i| i["path"] == file))
            .map_or(file, |i| i["key"].as_str().unwrap());
        found.insert(
            name.clone(),
            format!("{kind}/{}/{key}", object.as_str().unwrap()),
        );
    }
    found
}

/// With the object store set, the controller and the agent get the same settings: endpoint,
/// bucket, prefix, region and path style in their environment, the credentials as files of the
/// named Secret (keys as configured), the CA bundle from a ConfigMap or a Secret; the agent also
/// gets the node cache (its hostPath and size limit). Without it, none of that is rendered.
#[test]
fn the_object_store_and_the_node_cache_reach_the_controller_and_the_agent() {
    let plain = helm_template(&[]).unwrap();
    for spec in [agent(&plain), controller(&plain)] {
        assert!(store_env(&plain, &spec["containers"][0]).is_empty());
    }
    assert!(!agent_host_mounts(&plain).contains_key("/var/lib/warmstart/cache"));

    let mut values = OBJECT_STORE.to_vec();
    values.extend([
        "objectStore.credentials.accessKeyIdKey=id",
        "objectStore.credentials.secretAccessKeyKey=key",
        "objectStore.ca.configMap=s3-ca",
        "objectStore.ca.key=bundle.pem",
    ]);
    let objects = helm_template(&values).unwrap();
    for (what, spec) in [
        ("agent", agent(&objects)),
        ("controller", controller(&objects)),
    ] {
        let env = store_env(&objects, &spec["containers"][0]);
        for (name, value) in [
            ("WARMSTART_S3_ENDPOINT", "http://198.18.0.1:8333"),
            ("WARMSTART_S3_BUCKET", "warmstart"),
            ("WARMSTART_S3_PREFIX", "artifacts"),
            ("WARMSTART_S3_REGION", "us-east-1"),
            ("WARMSTART_S3_PATH_STYLE", "true"),
            ("WARMSTART_S3_COMPRESSION_LEVEL", "0"),
        ] {
            assert_eq!(
                env.get(name).map(String::as_str),
                Some(value),
                "{what}: {env:?}"
            );
        }
        let sources = file_sources(spec, &env);
        assert_eq!(
            sources,
            BTreeMap::from([
                (
                    "WARMSTART_S3_ACCESS_KEY_ID_FILE".to_owned(),
                    "Secret/warmstart-object-store-credentials/id".to_owned()
                ),
                (
                    "WARMSTART_S3_SECRET_ACCESS_KEY_FILE".to_owned(),
                    "Secret/warmstart-object-store-credentials/key".to_owned()
                ),
                (
                    "WARMSTART_S3_CA_FILE".to_owned(),
                    "ConfigMap/s3-ca/bundle.pem".to_owned()
                ),
            ]),
            "{what}"
        );
    }
    let env = store_env(&objects, &agent(&objects)["containers"][0]);
    assert_eq!(env["WARMSTART_CACHE_MAX_GIB"], "4");
    assert_eq!(
        agent_host_mounts(&objects)
            .get(&env["WARMSTART_CACHE_DIR"])
            .map(String::as_str),
        Some("/var/lib/warmstart-cluster/cache"),
        "the cache directory is the hostPath: {:?}",
        agent_host_mounts(&objects)
    );
    assert!(
        !store_env(&objects, &controller(&objects)["containers"][0])
            .contains_key("WARMSTART_CACHE_DIR"),
        "the controller has no node cache"
    );

    // The CA bundle from a Secret instead.
    let mut values = OBJECT_STORE.to_vec();
    values.push("objectStore.ca.secret=s3-ca-secret");
    let objects = helm_template(&values).unwrap();
    let spec = controller(&objects);
    let sources = file_sources(spec, &store_env(&objects, &spec["containers"][0]));
    assert_eq!(
        sources["WARMSTART_S3_CA_FILE"],
        "Secret/s3-ca-secret/ca.crt"
    );
    // The cache alone, without the object store.
    let objects = helm_template(&["agent.cache.enabled=true"]).unwrap();
    let env = store_env(&objects, &agent(&objects)["containers"][0]);
    assert_eq!(
        env.keys().collect::<Vec<_>>(),
        ["WARMSTART_CACHE_DIR", "WARMSTART_CACHE_MAX_GIB"]
    );
    assert_eq!(
        agent_host_mounts(&objects)
            .get("/var/lib/warmstart/cache")
            .map(String::as_str),
        Some("/var/lib/warmstart/cache")
    );
}

/// Settings that cannot work are refused when the chart renders, saying what is missing,
/// rather than installing agents that fail at start.
#[test]
fn object_store_settings_that_cannot_work_fail_render_with_the_reason() {
    let without = |drop: &str| -> Vec<&str> {
        OBJECT_STORE
            .iter()
            .copied()
            .filter(|v| !v.starts_with(drop))
            .collect()
    };
    let with = |extra: &'static str| -> Vec<&str> {
        let mut values = OBJECT_STORE.to_vec();
        values.push(extra);
        values
    };
    for (values, message) in [
        (
            without("agent.cache.enabled"),
            "objectStore.endpoint needs agent.cache.enabled=true",
        ),
        (
            without("objectStore.bucket"),
            "objectStore.bucket: required with objectStore.endpoint",
        ),
        (
            without("objectStore.credentials.existingSecret"),
            "objectStore.credentials.existingSecret: required with objectStore.endpoint",
        ),
        (
            without("objectStore.endpoint"),
            "objectStore.endpoint: required when any other objectStore setting",
        ),
        (
            with("objectStore.endpoint=198.18.0.1:8333"),
            "objectStore.endpoint \"198.18.0.1:8333\": an http:// or https:// URL is needed",
        ),
        (
            [
                with("objectStore.ca.secret=a"),
                vec!["objectStore.ca.configMap=b"],
            ]
            .concat(),
            "objectStore.ca: set configMap or secret, not both",
        ),
        (with("agent.cache.maxGiB=0"), "at '/agent/cache/maxGiB'"),
    ] {
        let refused = helm_template(&values).unwrap_err().to_string();
        assert!(refused.contains(message), "{values:?}: {refused}");
    }
}

/// The credentials never pass through the chart: it takes only the Secret's name (a key given
/// as a value is refused by the schema, and not echoed), renders no Secret of its own for them,
/// and the pods reference the Secret's keys as mounted files, never as values.
#[test]
fn the_object_store_credentials_are_only_referenced() {
    let secret = "s3cr3t-never-rendered";
    for value in [
        format!("objectStore.credentials.secretAccessKey={secret}"),
        format!("objectStore.secretAccessKey={secret}"),
    ] {
        let refused = helm_template(&[&value]).unwrap_err().to_string();
        assert!(
            refused.contains("additional properties"),
            "{value}: {refused}"
        );
        // What Helm said (after the command line the error repeats).
        let said = refused.split_once(" failed: ").map_or("", |(_, said)| said);
        assert!(
            !said.is_empty() && !said.contains(secret),
            "Helm shows the secret: {said}"
        );
    }
    let objects = helm_template(&OBJECT_STORE).unwrap();
    let secrets: Vec<&str> = objects
        .iter()
        .filter(|o| o["kind"] == "Secret")
        .map(|o| o["metadata"]["name"].as_str().unwrap())
        .collect();
    assert!(secrets.is_empty(), "the chart renders Secrets: {secrets:?}");
    for spec in [agent(&objects), controller(&objects)] {
        for e in spec["containers"][0]["env"].as_array().unwrap() {
            let name = e["name"].as_str().unwrap();
            assert!(
                !name.contains("ACCESS_KEY") || name.ends_with("_FILE"),
                "a credential in the environment: {e}"
            );
            assert!(
                e["valueFrom"]["secretKeyRef"].is_null(),
                "a Secret's value in the environment: {e}"
            );
        }
    }
}

/// The kustomize way (deploy/components/object-store, used by e2e/cluster/object-store) gives
/// the controller and the agent the same object store and cache settings, credentials and cache
/// directory as the chart with the same values.
#[test]
fn the_kustomize_component_sets_what_the_chart_sets() {
    let kustomized = kustomize("e2e/cluster/object-store").unwrap();
    let charted = helm_template(&OBJECT_STORE).unwrap();
    for (what, of) in [
        ("agent", agent as fn(&[Value]) -> &Value),
        ("controller", controller),
    ] {
        let k_env = store_env(&kustomized, &of(&kustomized)["containers"][0]);
        let h_env = store_env(&charted, &of(&charted)["containers"][0]);
        assert_eq!(k_env, h_env, "{what}'s settings differ (kustomize, Helm)");
        assert!(
            k_env.contains_key("WARMSTART_S3_ENDPOINT"),
            "{what}: {k_env:?}"
        );
        assert_eq!(
            file_sources(of(&kustomized), &k_env),
            file_sources(of(&charted), &h_env),
            "{what}'s credential files differ (kustomize, Helm)"
        );
    }
    assert_eq!(
        agent_host_mounts(&kustomized).get("/var/lib/warmstart/cache"),
        agent_host_mounts(&charted).get("/var/lib/warmstart/cache")
    );
}
