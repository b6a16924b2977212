//! The whole loop on a real Kubernetes: the local single-node cluster of `make cluster-up`
//! (upstream kube-apiserver, etcd, controller-manager, scheduler and kubelet over containerd),
//! warmstart installed from `deploy/` as a user installs it (`kubectl apply -k deploy/storage`,
//! then `kubectl apply -k` of the overlay `e2e/cluster/overlay`, which changes only image names,
//! pull policy and this node's containerd paths) from images assembled here
//! (`scripts/cluster-images.sh`). In a namespace of its own, a Checkpoint of the sample worker
//! becomes Ready with its artifact's facts, and a pod annotated to restore from it becomes Ready
//! serving the checkpointed process; the time from its creation to Ready is printed next to a
//! cold start of the same pod.
//!
//! Runs as root (`cargo test -p warmstart-e2e --test real_cluster`); skipped otherwise, unless
//! `WARMSTART_REQUIRE_ROOT` is set, which makes that a failure. Needs the agent and controller
//! built (`cargo build -p warmstart-agent -p warmstart-controller`), `make static` and
//! `make setup`. The cluster: one already up (`make cluster-up`) is reused and left up; one
//! this test starts is torn down (`make cluster-down`) at its end, pass or fail, unless
//! `WARMSTART_KEEP_CLUSTER=1`. The images are assembled and loaded on every run, so the cluster
//! runs the binaries just built; a warmstart already installed is rolled to them.

#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, ResourceExt};
use serde_json::{Value, json};
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::local_cluster::{is_ready, poll};
use warmstart_shared::names;
use warmstart_shared::v1alpha1::{Checkpoint, CheckpointPhase};

/// Where `make cluster-up` writes the admin kubeconfig (scripts/cluster-lib.sh).
const KUBECONFIG: &str = "/var/lib/warmstart-cluster/admin.kubeconfig";
/// The node `make cluster-up` registers.
const NODE: &str = "warmstart-node";
/// The sample worker's image, as scripts/cluster-images.sh tags it.
const WORKER_IMAGE: &str = "docker.io/warmstart/sample-worker:dev";
const PORT: u16 = 8000;
/// How long one step may take (a cold cluster start builds nothing: the components are cached).
const WAIT: Duration = Duration::from_secs(180);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The cargo target directory of this test executable (`<target>/debug/deps/<test>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors()
        .find(|d| {
            d.file_name()
                .is_some_and(|n| n == "debug" || n == "release")
        })
        .and_then(Path::parent)
        .unwrap()
        .to_owned()
}

fn is_root() -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    assert!(
        std::env::var_os("WARMSTART_REQUIRE_ROOT").is_none(),
        "WARMSTART_REQUIRE_ROOT is set but this test does not run as root"
    );
    eprintln!("skipped: the local cluster needs root");
    false
}

/// Runs `program` with `args` in the repository root; its stdout, or a panic with its output.
fn run(program: &str, args: &[&str], envs: &[(&str, &Path)]) -> String {
    let mut command = Command::new(program);
    command.args(args).current_dir(repo_root());
    for (k, v) in envs {
        command.env(k, v);
    }
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed ({}):\n{}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn kubectl(args: &[&str]) -> String {
    let mut all = vec!["--kubeconfig", KUBECONFIG, "--request-timeout=30s"];
    all.extend_from_slice(args);
    run("kubectl", &all, &[])
}

/// Whether the cluster answers and its node is Ready.
fn cluster_ready() -> bool {
    Command::new("kubectl")
        .args([
            "--kubeconfig",
            KUBECONFIG,
            "--request-timeout=5s",
            "get",
            "node",
            NODE,
        ])
        .args([
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ])
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout == b"True")
}

/// The local cluster for this test: reused when up, else started and (on drop) torn down.
struct LocalKube {
    started_here: bool,
}

impl LocalKube {
    fn up() -> Self {
        if cluster_ready() {
            eprintln!("reusing the local cluster that is up (left up afterwards)");
            return Self {
                started_here: false,
            };
        }
        // From here on, whatever cluster-up leaves behind is removed on drop.
        let cluster = Self { started_here: true };
        let started = Instant::now();
        run("bash", &["scripts/cluster-up.sh"], &[]);
        eprintln!("cluster-up: {:.1}s", started.elapsed().as_secs_f64());
        cluster
    }
}

impl Drop for LocalKube {
    fn drop(&mut self) {
        if !self.started_here || std::env::var_os("WARMSTART_KEEP_CLUSTER").is_some() {
            return;
        }
        let out = Command::new("bash")
            .arg("scripts/cluster-down.sh")
            .current_dir(repo_root())
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "cluster-down failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("cannot run cluster-down: {e}"),
        }
    }
}

/// Assembles the images from the binaries built here and loads them into the cluster.
fn build_and_load_images() {
    // Clear errors before the script's: what is missing and how to build it.
    binaries::agent().unwrap();
    binaries::controller().unwrap();
    binaries::static_worker().unwrap();
    binaries::static_entrypoint().unwrap();
    let target = target_dir();
    let started = Instant::now();
    run(
        "bash",
        &["scripts/cluster-images.sh", "--load"],
        &[("CARGO_TARGET_DIR", &target)],
    );
    eprintln!(
        "images assembled and loaded: {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// Installs warmstart as a user does, and waits until the controller and the agent are Ready.
fn install() {
    let installed = Command::new("kubectl")
        .args(["--kubeconfig", KUBECONFIG, "-n", "warmstart-system"])
        .args([
            "get",
            "deployment/warmstart-controller",
            "daemonset/warmstart-agent",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    kubectl(&["apply", "-f", "e2e/cluster/storage.yaml"]);
    kubectl(&["apply", "-k", "deploy/storage"]);
    kubectl(&["apply", "-k", "e2e/cluster/overlay"]);
    if installed {
        // Same image names, new contents: run the images just loaded.
        kubectl(&[
            "-n",
            "warmstart-system",
            "rollout",
            "restart",
            "deployment/warmstart-controller",
            "daemonset/warmstart-agent",
        ]);
    }
    let timeout = format!("--timeout={}s", WAIT.as_secs());
    for what in [
        "deployment/warmstart-controller",
        "daemonset/warmstart-agent",
    ] {
        kubectl(&[
            "-n",
            "warmstart-system",
            "rollout",
            "status",
            what,
            &timeout,
        ]);
    }
}

async fn client() -> Client {
    let kubeconfig = Kubeconfig::read_from(KUBECONFIG).unwrap();
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// A namespace of this test's own, deleted (and waited for) on drop.
struct TestNamespace {
    name: String,
}

impl TestNamespace {
    async fn create(client: &Client) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!("ws-real-{}-{nanos:x}", std::process::id());
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {
                // Checkpoint Jobs' pods and restore pods must pass Pod Security `baseline`.
                "pod-security.kubernetes.io/enforce": "baseline"}}
        }))
        .unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        Self { name }
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // The controller removes its finalizers from the namespace's Checkpoints.
        let out = Command::new("kubectl")
            .args([
                "--kubeconfig",
                KUBECONFIG,
                "delete",
                "namespace",
                &self.name,
            ])
            .args(["--wait=true", "--timeout=120s"])
            .output();
        if !out.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("cannot delete namespace {}: {out:?}", self.name);
        }
    }
}

/// The sample worker as the container of a pod, pulled from nowhere.
fn worker_container() -> Value {
    json!({
        "name": "main", "image": WORKER_IMAGE, "imagePullPolicy": "Never",
        "command": [WORKER_IN_IMAGE, "--weights-mib", "64", "--warmup-ms", "2000",
                    "--port", PORT.to_string()],
        "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 1}
    })
}

/// What warmstart's controller and agent said lately, for a failure's message.
fn warmstart_logs() -> String {
    let logs = |what: &str| {
        Command::new("kubectl")
            .args(["--kubeconfig", KUBECONFIG, "-n", "warmstart-system", "logs"])
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

/// `GET path` of the pod's sample worker over the pod network (198.18.0.0/24, the cluster's own
/// bridge): status code and body.
fn http_get(ip: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(
        &format!("{ip}:{PORT}").parse().unwrap(),
        Duration::from_secs(3),
    )?;
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

fn worker_state(pod: &Pod) -> Value {
    let ip = pod.status.as_ref().unwrap().pod_ip.clone().unwrap();
    let (code, body) = http_get(&ip, "/state").unwrap();
    assert_eq!(code, 200, "GET /state of {}: {body}", pod.name_any());
    serde_json::from_str(&body).unwrap()
}

/// Creates pod `name` (annotated to restore from `checkpoint` when given) and waits until it is
/// Ready; the pod and the time from its creation to Ready.
async fn pod_until_ready(pods: &Api<Pod>, name: &str, checkpoint: Option<&str>) -> (Pod, Duration) {
    let annotations = checkpoint.map_or_else(
        || json!({}),
        |ck| {
            json!({
                names::ANNOTATION_RESTORE_FROM: ck,
                names::ANNOTATION_TARGET_CONTAINERS: "main",
            })
        },
    );
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"containers": [worker_container()]}
    }))
    .unwrap();
    let created = Instant::now();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let status_key = names::restore_status_annotation("main");
    let ready = poll(
        &format!("pod {name} to become Ready"),
        WAIT,
        Duration::from_millis(50),
        warmstart_logs,
        || async {
            let Ok(p) = pods.get(name).await else {
                return Ok(None);
            };
            if p.annotations().get(&status_key).map(String::as_str) == Some("failed") {
                anyhow::bail!(
                    "restore of {name} failed: {:?}\n{}",
                    p.annotations(),
                    kubectl(&["-n", &p.namespace().unwrap(), "describe", "pod", name])
                );
            }
            Ok(is_ready(&p).then_some(p))
        },
    )
    .await
    .unwrap();
    (ready, created.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_the_sample_worker_restores_into_a_new_pod_on_a_real_cluster() {
    if !is_root() {
        return;
    }
    let _cluster = LocalKube::up();
    build_and_load_images();
    install();
    let client = client().await;
    let ns = TestNamespace::create(&client).await;
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);

    // The Checkpoint: Job → ready → agent → .done → Ready with the artifact's facts.
    let ck: Checkpoint = serde_json::from_value(json!({
        "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
        "metadata": {"name": "worker"},
        "spec": {"identity": {"model": "sample-worker", "backendFramework": "vllm"},
                 "job": {"podTemplateSpec": {"spec": {"containers": [worker_container()]}}}}
    }))
    .unwrap();
    let started = Instant::now();
    // The validating webhook answers once the controller's Endpoints are ready: a refusal
    // for another reason is final.
    poll(
        "the Checkpoint to be admitted",
        WAIT,
        Duration::from_millis(200),
        warmstart_logs,
        || async {
            match checkpoints.create(&PostParams::default(), &ck).await {
                Ok(_) => Ok(Some(())),
                Err(kube::Error::Api(e)) if e.code == 500 && e.message.contains("webhook") => {
                    Ok(None)
                }
                Err(e) => Err(anyhow::anyhow!("create Checkpoint worker: {e}")),
            }
        },
    )
    .await
    .unwrap();
    let ready = poll(
        "Checkpoint worker to become Ready",
        WAIT,
        Duration::from_millis(100),
        warmstart_logs,
        || async {
            let Ok(ck) = checkpoints.get("worker").await else {
                return Ok(None);
            };
            let Some(status) = ck.status.as_ref() else {
                return Ok(None);
            };
            if status.phase == Some(CheckpointPhase::Failed) {
                anyhow::bail!("Checkpoint worker failed: {status:?}\n{}", warmstart_logs());
            }
            Ok((status.phase == Some(CheckpointPhase::Ready)).then_some(ck))
        },
    )
    .await
    .unwrap();
    let checkpoint_took = started.elapsed();
    let status = serde_json::to_value(ready.status.as_ref().unwrap()).unwrap();
    let artifact = &status["artifact"];
    assert_eq!(artifact["container"], "main", "{status}");
    assert!(
        artifact["sizeBytes"].as_u64().unwrap() > 64 << 20,
        "{status}"
    );
    assert!(
        artifact["manifestDigest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"),
        "{status}"
    );
    assert!(
        artifact["criuVersion"].as_str().unwrap().starts_with('4'),
        "{status}"
    );
    assert_eq!(
        status["location"].as_str().unwrap(),
        format!("{}/{}", ns.name, status["identityHash"].as_str().unwrap()),
        "{status}"
    );

    // A restore pod: Ready, serving the checkpointed process, restored once.
    let (restored, restore_took) = pod_until_ready(&pods, "restored", Some("worker")).await;
    assert_eq!(
        restored
            .annotations()
            .get(&names::restore_status_annotation("main"))
            .map(String::as_str),
        Some("completed")
    );
    let state = worker_state(&restored);
    assert_eq!(state["restored"], true, "{state}");
    let source = state["hostname"].as_str().unwrap();
    assert!(
        source.starts_with("checkpoint-worker-"),
        "the process of the checkpoint Job's pod serves, not a fresh one: {state}"
    );
    let events = kubectl(&[
        "-n",
        &ns.name,
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=restored,reason=Restored",
        "-o",
        "name",
    ]);
    assert_eq!(events.lines().count(), 1, "restored once: {events}");

    // The same pod without the annotation: a cold start, for comparison.
    let (cold, cold_took) = pod_until_ready(&pods, "cold", None).await;
    let cold_state = worker_state(&cold);
    assert_eq!(cold_state["restored"], false, "{cold_state}");
    assert_eq!(cold_state["weightsSha256"], state["weightsSha256"]);

    eprintln!(
        "real cluster: Checkpoint created -> Ready {:.2}s; pod created -> Ready: restored {:.2}s, cold start {:.2}s",
        checkpoint_took.as_secs_f64(),
        restore_took.as_secs_f64(),
        cold_took.as_secs_f64()
    );
    // Pods go with the namespace (TestNamespace); delete them first so the namespace goes fast.
    let _ = pods
        .delete_collection(&DeleteParams::default(), &Default::default())
        .await;
}
