//! The local two-node Kubernetes of `make cluster-up` (upstream kube-apiserver, etcd,
//! controller-manager, scheduler, and per node a kubelet over its own containerd), as the
//! real-cluster tests and `make cluster-demo` use it: bring it up or reuse it, assemble and load
//! warmstart's images, install warmstart from `deploy/` as a user does (through the overlay
//! `e2e/cluster/overlay`, which changes only image names, pull policy and this node's paths),
//! namespaces of a test's own, the sample worker's pods and their state over the pod network
//! (198.18.0.0/24, the cluster's own bridge). Needs root.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, ResourceExt};
use serde_json::{Value, json};
use warmstart_shared::names;
use warmstart_shared::v1alpha1::{Checkpoint, CheckpointPhase};

use crate::binaries::{self, WORKER_IN_IMAGE};

/// Where `make cluster-up` writes the admin kubeconfig (scripts/cluster-lib.sh).
pub const KUBECONFIG: &str = "/var/lib/warmstart-cluster/admin.kubeconfig";
/// The first node `make cluster-up` registers: this machine's own paths are its paths.
pub const NODE: &str = "warmstart-node";
/// The second node (scripts/cluster-lib.sh): its kubelet and containerd see its own
/// directories, under [`NODE2_DIR`] here, at the paths node 1 uses.
pub const NODE2: &str = "warmstart-node-2";
/// Both nodes.
pub const NODES: [&str; 2] = [NODE, NODE2];
/// Node 2's directories as this machine sees them.
pub const NODE2_DIR: &str = "/var/lib/warmstart-cluster/node-2";
/// The node cache's hostPath of the object store install (each node's own directory).
pub const NODE_CACHE: &str = "/var/lib/warmstart-cluster/cache";
/// The namespace warmstart runs in (`deploy/`).
pub const SYSTEM_NAMESPACE: &str = "warmstart-system";
/// The label selector of warmstart's agent pods (`deploy/agent`).
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/name=warmstart-agent";
/// The artifact PVC's hostPath PersistentVolume (`e2e/cluster/storage.yaml`).
pub const ARTIFACTS: &str = "/var/lib/warmstart-cluster/artifacts";
/// The agent's state directory on the node (`e2e/cluster/overlay/agent.yaml`).
pub const AGENT_STATE: &str = "/var/lib/warmstart-cluster/agent-state";

/// Where a node-local path of `node` (one node 2 sees in its own directory, such as
/// [`AGENT_STATE`], [`NODE_CACHE`] or the kubelet root) is on this machine.
///
/// # Panics
/// For a node the cluster does not have, or a path that is no node-local one.
#[must_use]
pub fn on_node(node: &str, path: &str) -> PathBuf {
    match node {
        NODE => PathBuf::from(path),
        NODE2 => {
            let name = match path {
                AGENT_STATE => "agent-state",
                NODE_CACHE => "cache",
                KUBELET_ROOT => "kubelet",
                _ => panic!("{path} is not one of node 2's own directories"),
            };
            Path::new(NODE2_DIR).join(name)
        }
        _ => panic!("the local cluster has no node {node}"),
    }
}

/// The kubelet root both nodes name.
pub const KUBELET_ROOT: &str = "/var/lib/kubelet";
/// The API server's audit log: every request, its user and its response code.
pub const AUDIT_LOG: &str = "/var/lib/warmstart-cluster/logs/audit.log";
/// The sample worker's image, as scripts/cluster-images.sh tags it.
pub const WORKER_IMAGE: &str = "docker.io/warmstart/sample-worker:dev";
/// The sample worker's port.
pub const PORT: u16 = 8000;
/// How long one step may take (a cold cluster start builds nothing: the components are cached).
pub const WAIT: Duration = Duration::from_secs(180);

/// Polls `check` every `every` until it returns a value, for at most `timeout`.
///
/// # Errors
/// What `check` returned as an error, or a timeout naming `what` with `context()`.
pub async fn poll<T, F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    context: impl Fn() -> String,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out waiting for {what}\n{}", context());
        }
        tokio::time::sleep(every).await;
    }
}

/// Whether `pod` has condition `Ready=True`.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    crate::manifests::repo()
}

/// Runs `program` with `args` in the repository root; its stdout, or an error with its output.
///
/// # Errors
/// The program cannot start or fails.
pub fn run(program: &str, args: &[&str], envs: &[(&str, &Path)]) -> Result<String> {
    let mut command = Command::new(program);
    command.args(args).current_dir(repo_root());
    for (k, v) in envs {
        command.env(k, v);
    }
    let out = command
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}):\n{}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl` with the admin kubeconfig; its stdout.
///
/// # Errors
/// kubectl fails (its output in the error).
pub fn kubectl(args: &[&str]) -> Result<String> {
    let mut all = vec!["--kubeconfig", KUBECONFIG, "--request-timeout=30s"];
    all.extend_from_slice(args);
    run("kubectl", &all, &[])
}

/// `helm` (the one `make helm-build` built) against the local cluster, in the repository root;
/// its stdout.
///
/// # Errors
/// Helm is not built or fails (its output in the error).
pub fn helm(args: &[&str]) -> Result<String> {
    let helm = crate::manifests::helm()?;
    let helm = helm.to_str().context("the helm path is not UTF-8")?;
    run(helm, args, &[("KUBECONFIG", Path::new(KUBECONFIG))])
}

/// The values that install the chart on the local cluster (as `e2e/cluster/overlay` does
/// `deploy/`).
pub const HELM_VALUES: &str = "e2e/cluster/helm-values.yaml";

/// The Helm release name the tests install.
pub const HELM_RELEASE: &str = "warmstart";

/// Whether the tests' Helm release is installed.
#[must_use]
pub fn helm_installed() -> bool {
    helm(&["status", HELM_RELEASE, "-n", SYSTEM_NAMESPACE]).is_ok()
}

/// Whether the cluster answers and both its nodes are Ready.
pub fn cluster_ready() -> bool {
    NODES.iter().all(|node| {
        Command::new("kubectl")
            .args(["--kubeconfig", KUBECONFIG, "--request-timeout=5s"])
            .args(["get", "node", node, "-o"])
            .arg("jsonpath={.status.conditions[?(@.type==\"Ready\")].status}")
            .output()
            .is_ok_and(|o| o.status.success() && o.stdout == b"True")
    })
}

/// The local cluster: reused when up, else started and (on drop) torn down, unless
/// `WARMSTART_KEEP_CLUSTER` is set.
#[derive(Debug)]
pub struct LocalKube {
    started_here: bool,
}

impl LocalKube {
    /// Reuses the cluster that is up, or starts one (`scripts/cluster-up.sh`).
    ///
    /// # Errors
    /// cluster-up fails (what it printed in the error); what it left is removed.
    pub fn up() -> Result<Self> {
        if cluster_ready() {
            eprintln!("reusing the local cluster that is up (left up afterwards)");
            return Ok(Self {
                started_here: false,
            });
        }
        // From here on, whatever cluster-up leaves behind is removed on drop.
        let cluster = Self { started_here: true };
        let started = Instant::now();
        run("bash", &["scripts/cluster-up.sh"], &[])?;
        eprintln!("cluster-up: {:.1}s", started.elapsed().as_secs_f64());
        Ok(cluster)
    }
}

impl Drop for LocalKube {
    fn drop(&mut self) {
        if !self.started_here || std::env::var_os("WARMSTART_KEEP_CLUSTER").is_some() {
            return;
        }
        if let Err(e) = run("bash", &["scripts/cluster-down.sh"], &[]) {
            eprintln!("{e:#}");
        }
    }
}

/// The tests' device plugin's form file (`scripts/cluster-device-plugin.sh`).
pub const DEVICE_PLUGIN_FORM: &str = "/var/lib/warmstart-cluster/device-plugin/form";
/// The tests' device plugins' logs (node 1's, node 2's).
pub const DEVICE_PLUGIN_LOGS: [&str; 2] = [
    "/var/lib/warmstart-cluster/logs/device-plugin.log",
    "/var/lib/warmstart-cluster/logs/device-plugin-2.log",
];

/// Makes the node's GPUs come from the tests' device plugin (`binary`, a test double of
/// NVIDIA's): started unless it runs (`scripts/cluster-device-plugin.sh`), and left running
/// with the cluster, as a GPU node's plugin is (cluster-down stops it).
///
/// # Errors
/// The script fails (its output in the error).
pub fn ensure_device_plugin(binary: &Path) -> Result<()> {
    let binary = binary
        .to_str()
        .context("the device plugin's path is not UTF-8")?;
    run("bash", &["scripts/cluster-device-plugin.sh", binary], &[])?;
    Ok(())
}

/// The device plugin's `Allocate` form while it lives (`uuids`, `cdi`, `cdi-annotations`);
/// `uuids` again when dropped.
#[derive(Debug)]
pub struct DevicePluginForm(());

impl DevicePluginForm {
    /// Sets the form for the pods created from now on.
    ///
    /// # Errors
    /// The form file cannot be written.
    pub fn set(form: crate::device_plugin::Form) -> Result<Self> {
        write_form(form)?;
        Ok(Self(()))
    }
}

fn write_form(form: crate::device_plugin::Form) -> Result<()> {
    let path = Path::new(DEVICE_PLUGIN_FORM);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, form.name()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming onto {}", path.display()))?;
    Ok(())
}

impl Drop for DevicePluginForm {
    fn drop(&mut self) {
        if let Err(e) = write_form(crate::device_plugin::Form::Uuids) {
            eprintln!("cannot set the device plugin's form back: {e:#}");
        }
    }
}

/// Assembles warmstart's images from the binaries built in `target_dir` and loads them into
/// the cluster (`scripts/cluster-images.sh --load`).
///
/// # Errors
/// A binary is missing (saying how to build it) or the script fails.
pub fn build_and_load_images(target_dir: &Path) -> Result<()> {
    // Clear errors before the script's: what is missing and how to build it.
    binaries::agent()?;
    binaries::controller()?;
    binaries::static_worker()?;
    binaries::static_entrypoint()?;
    let started = Instant::now();
    run(
        "bash",
        &["scripts/cluster-images.sh", "--load"],
        &[("CARGO_TARGET_DIR", target_dir)],
    )?;
    eprintln!(
        "images assembled and loaded: {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn installed() -> bool {
    Command::new("kubectl")
        .args(["--kubeconfig", KUBECONFIG, "-n", SYSTEM_NAMESPACE, "get"])
        .args([
            "deployment/warmstart-controller",
            "daemonset/warmstart-agent",
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Installs warmstart as a user does (storage, then the overlay of `deploy/`) and waits until
/// the controller and the agent are Ready; one already installed is restarted onto the images
/// just loaded (same names, new contents).
///
/// # Errors
/// kubectl fails or the rollout does not finish in time.
pub fn install() -> Result<()> {
    let restart = installed();
    kubectl(&["apply", "-f", "e2e/cluster/storage.yaml"])?;
    kubectl(&["apply", "-k", "deploy/storage"])?;
    kubectl(&["apply", "-k", "e2e/cluster/overlay"])?;
    if restart {
        kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "rollout",
            "restart",
            "deployment/warmstart-controller",
            "daemonset/warmstart-agent",
        ])?;
    }
    rolled_out()
}

/// Waits until the controller's Deployment and the agent's DaemonSet are rolled out and Ready.
///
/// # Errors
/// Not in time.
pub fn rolled_out() -> Result<()> {
    let timeout = format!("--timeout={}s", WAIT.as_secs());
    for what in [
        "deployment/warmstart-controller",
        "daemonset/warmstart-agent",
    ] {
        kubectl(&["-n", SYSTEM_NAMESPACE, "rollout", "status", what, &timeout])
            .with_context(warmstart_logs)?;
    }
    Ok(())
}

/// The first step of an uninstall, kustomize's or Helm's, as the README says: warmstart's
/// DaemonSets and Deployments deleted, waiting until their pods have ended (the agent unlabels
/// its node and the controller releases its Lease on the way out, which needs their RBAC).
///
/// # Errors
/// kubectl fails or the pods do not end in time.
pub fn stop_workloads() -> Result<()> {
    let timeout = format!("--timeout={}s", WAIT.as_secs());
    kubectl(&[
        "-n",
        SYSTEM_NAMESPACE,
        "delete",
        "daemonsets,deployments",
        "-l",
        "app.kubernetes.io/part-of=warmstart",
        "--cascade=foreground",
        "--wait=true",
        &timeout,
    ])?;
    Ok(())
}

/// Uninstalls warmstart as the README says: its workloads first, waiting until their pods have
/// ended (the agent unlabels its node and the controller releases its Lease on the way out,
/// which needs their RBAC), then `kubectl delete -k` of what [`install`] applied, not its
/// storage.
///
/// # Errors
/// kubectl fails.
pub fn uninstall() -> Result<()> {
    let timeout = format!("--timeout={}s", WAIT.as_secs());
    stop_workloads()?;
    kubectl(&[
        "delete",
        "-k",
        "e2e/cluster/overlay",
        "--ignore-not-found",
        "--wait=true",
        &timeout,
    ])?;
    Ok(())
}

/// An admin client of the cluster.
///
/// # Errors
/// The kubeconfig is missing or unusable.
pub async fn client() -> Result<Client> {
    let kubeconfig = Kubeconfig::read_from(KUBECONFIG)
        .with_context(|| format!("read {KUBECONFIG} (is the cluster up? make cluster-up)"))?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// A namespace of a test's own, enforcing Pod Security `baseline` (checkpoint Jobs' pods and
/// restore pods must pass it); its pods and then itself deleted (and waited for) on drop.
#[derive(Debug)]
pub struct TestNamespace {
    /// Its name.
    pub name: String,
}

impl TestNamespace {
    /// Creates `ws-<prefix>-<random>`.
    ///
    /// # Errors
    /// The API refuses it.
    pub async fn create(client: &Client, prefix: &str) -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos();
        Self::named(client, &format!("ws-{prefix}-{nanos:x}")).await
    }

    /// Creates namespace `name`.
    ///
    /// # Errors
    /// The API refuses it.
    pub async fn named(client: &Client, name: &str) -> Result<Self> {
        let name = name.to_owned();
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {
                "pod-security.kubernetes.io/enforce": "baseline"}}
        }))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("create namespace {name}"))?;
        Ok(Self { name })
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // Pods first, so the namespace goes fast; the controller removes its finalizers from
        // the namespace's Checkpoints.
        for args in [
            &["delete", "pods", "--all", "-n", &self.name, "--wait=true"][..],
            &[
                "delete",
                "namespace",
                &self.name,
                "--wait=true",
                "--timeout=120s",
            ][..],
        ] {
            if let Err(e) = kubectl(args) {
                eprintln!("cannot delete namespace {}: {e:#}", self.name);
            }
        }
    }
}

/// The sample worker as the container `main` of a pod, pulled from nowhere: `weights_mib` of
/// weights, `warmup_ms` of warm-up, Ready when it serves `/health`.
pub fn worker_container(weights_mib: u32, warmup_ms: u32) -> Value {
    json!({
        "name": "main", "image": WORKER_IMAGE, "imagePullPolicy": "Never",
        "command": [WORKER_IN_IMAGE, "--weights-mib", weights_mib.to_string(),
                    "--warmup-ms", warmup_ms.to_string(), "--port", PORT.to_string()],
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1}
    })
}

/// What warmstart's controller and agent said lately, for a failure's message.
pub fn warmstart_logs() -> String {
    let logs = |what: &str| {
        Command::new("kubectl")
            .args(["--kubeconfig", KUBECONFIG, "-n", SYSTEM_NAMESPACE, "logs"])
            .args([what, "--all-containers", "--tail=40", "--prefix"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    };
    format!(
        "controller:\n{}\nagent:\n{}",
        logs("deployment/warmstart-controller"),
        logs("daemonset/warmstart-agent")
    )
}

/// `GET path` on the pod's port [`PORT`] over the pod network: status code and body.
///
/// # Errors
/// The connection or the read fails.
pub fn http_get(pod: &Pod, path: &str) -> Result<(u16, String)> {
    http_get_port(pod, PORT, path)
}

/// `GET path` on the pod's `port` over the pod network: status code and body.
///
/// # Errors
/// The connection or the read fails.
pub fn http_get_port(pod: &Pod, port: u16, path: &str) -> Result<(u16, String)> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .ok_or_else(|| anyhow!("pod {} has no IP", pod.name_any()))?;
    let addr = format!("{ip}:{port}").parse()?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((code, body))
}

/// The sample worker's `/state` in `pod`.
///
/// # Errors
/// It does not answer 200 with JSON.
pub fn worker_state(pod: &Pod) -> Result<Value> {
    let (code, body) = http_get(pod, "/state")?;
    if code != 200 {
        bail!("GET /state of {}: {code} {body}", pod.name_any());
    }
    Ok(serde_json::from_str(&body)?)
}

/// `pod` (a Pod or a pod template's JSON) held to `node` (a node selector on its hostname).
#[must_use]
pub fn pinned(mut pod: Value, node: &str) -> Value {
    pod["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    pod
}

/// The node pod `name` was scheduled to, once it is.
///
/// # Errors
/// The API refuses, or it is not scheduled in time.
pub async fn node_of(pods: &Api<Pod>, name: &str) -> Result<String> {
    poll(
        &format!("pod {name} to be scheduled"),
        WAIT,
        Duration::from_millis(100),
        warmstart_logs,
        || async {
            Ok(pods
                .get(name)
                .await?
                .spec
                .and_then(|s| s.node_name)
                .filter(|n| !n.is_empty()))
        },
    )
    .await
}

/// Pod `name` with `container` as its only container, annotated to restore `container`'s name
/// from Checkpoint `checkpoint` when given.
///
/// # Errors
/// Never for a container of [`worker_container`]'s shape.
pub fn pod(name: &str, checkpoint: Option<&str>, container: &Value) -> Result<Pod> {
    let annotations = checkpoint.map_or_else(
        || json!({}),
        |ck| {
            json!({
                names::ANNOTATION_RESTORE_FROM: ck,
                names::ANNOTATION_TARGET_CONTAINERS: container["name"],
            })
        },
    );
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5}
    }))?)
}

/// A Checkpoint `name` of a Job running `container`, with `job` merged into `spec.job`.
///
/// # Errors
/// Never for JSON objects.
pub fn checkpoint(name: &str, container: &Value, job: &Value) -> Result<Checkpoint> {
    let mut spec_job = json!({"podTemplateSpec": {"spec": {"containers": [container]}}});
    if let (Some(into), Some(from)) = (spec_job.as_object_mut(), job.as_object()) {
        into.extend(from.clone());
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
        "metadata": {"name": name},
        "spec": {"identity": {"model": "sample-worker", "backendFramework": "vllm"},
                 "job": spec_job}
    }))?)
}

/// Creates `ck`, waiting while the validating webhook does not answer yet (the controller's
/// Endpoints not ready: after an install or while a replica restarts); any other refusal is
/// final.
///
/// # Errors
/// The API refuses it.
pub async fn create_checkpoint(api: &Api<Checkpoint>, ck: &Checkpoint) -> Result<()> {
    create_admitted(api, ck).await
}

/// Creates `object`, waiting while warmstart's webhooks do not answer yet (they fail closed
/// until a controller replica is Ready: after an install or while a replica restarts); any
/// other refusal is final.
///
/// # Errors
/// The API refuses it.
pub async fn create_admitted<K>(api: &Api<K>, object: &K) -> Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    let what = format!(
        "{} {}",
        K::kind(&Default::default()),
        object.meta().name.clone().unwrap_or_default()
    );
    poll(
        &format!("{what} to be admitted"),
        WAIT,
        Duration::from_millis(200),
        warmstart_logs,
        || async {
            match api.create(&PostParams::default(), object).await {
                Ok(_) => Ok(Some(())),
                Err(kube::Error::Api(e)) if e.code == 500 && e.message.contains("webhook") => {
                    Ok(None)
                }
                Err(e) => Err(anyhow!("create {what}: {e}")),
            }
        },
    )
    .await
}

/// The pods of warmstart's agent.
///
/// # Errors
/// The API refuses the list.
pub async fn agent_pods(client: &Client) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    Ok(pods
        .list(&ListParams::default().labels(AGENT_SELECTOR))
        .await?
        .items)
}

/// Waits until Checkpoint `name` is `Ready`; fails at once when it is `Failed`.
///
/// # Errors
/// Failed, or not Ready in time.
pub async fn checkpoint_ready(api: &Api<Checkpoint>, name: &str) -> Result<Checkpoint> {
    poll(
        &format!("Checkpoint {name} to become Ready"),
        WAIT,
        Duration::from_millis(100),
        warmstart_logs,
        || async {
            let Ok(ck) = api.get(name).await else {
                return Ok(None);
            };
            let Some(status) = ck.status.as_ref() else {
                return Ok(None);
            };
            if status.phase == Some(CheckpointPhase::Failed) {
                bail!("Checkpoint {name} failed: {status:?}\n{}", warmstart_logs());
            }
            Ok((status.phase == Some(CheckpointPhase::Ready)).then_some(ck))
        },
    )
    .await
}

/// Waits until pod `name` is Ready; fails at once when its restore is reported failed, with
/// `kubectl describe` of the pod, unless `refusal_expected`.
///
/// # Errors
/// Restore failed (when not expected), or not Ready in time.
pub async fn pod_ready(pods: &Api<Pod>, name: &str, refusal_expected: bool) -> Result<Pod> {
    let status_key = names::restore_status_annotation("main");
    poll(
        &format!("pod {name} to become Ready"),
        WAIT,
        Duration::from_millis(50),
        warmstart_logs,
        || async {
            let Ok(p) = pods.get(name).await else {
                return Ok(None);
            };
            if !refusal_expected
                && p.annotations().get(&status_key).map(String::as_str) == Some("failed")
            {
                let ns = p.namespace().unwrap_or_default();
                bail!(
                    "restore of {name} failed: {:?}\n{}",
                    p.annotations(),
                    kubectl(&["-n", &ns, "describe", "pod", name]).unwrap_or_default()
                );
            }
            Ok(is_ready(&p).then_some(p))
        },
    )
    .await
}

/// The restore status the agent wrote on `pod` for its container `main`.
pub fn restore_status(pod: &Pod) -> Option<&str> {
    pod.annotations()
        .get(&names::restore_status_annotation("main"))
        .map(String::as_str)
}

/// The reasons and notes of the Events about `kind` object `name` in `namespace`, as
/// `<reason>: <note>`, of both Event APIs.
///
/// # Errors
/// The API refuses the lists.
pub async fn event_notes(
    client: &Client,
    namespace: &str,
    kind: &str,
    name: &str,
) -> Result<Vec<String>> {
    let core: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), namespace);
    let new: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), namespace);
    let selector = format!("involvedObject.name={name},involvedObject.kind={kind}");
    let mut notes: Vec<String> = core
        .list(&ListParams::default().fields(&selector))
        .await?
        .items
        .into_iter()
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .collect();
    notes.extend(
        new.list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| {
                e.regarding.as_ref().is_some_and(|r| {
                    r.name.as_deref() == Some(name) && r.kind.as_deref() == Some(kind)
                })
            })
            .map(|e| {
                format!(
                    "{}: {}",
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default()
                )
            }),
    );
    notes.sort();
    notes.dedup();
    Ok(notes)
}

/// The command lines of the processes on this node that run in `pod`'s cgroup (found through
/// `/proc/<pid>/cgroup`, which names the pod's uid under either cgroup driver).
pub fn pod_processes(pod: &Pod) -> Vec<String> {
    let Some(uid) = pod.uid() else {
        return Vec::new();
    };
    let underscored = uid.replace('-', "_");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let pid = entry.file_name();
        if !pid.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cgroup) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if !(cgroup.contains(&format!("pod{uid}")) || cgroup.contains(&format!("pod{underscored}")))
        {
            continue;
        }
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let line = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            found.push(line.trim().to_owned());
        }
    }
    found
}
