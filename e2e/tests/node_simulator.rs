//! The node simulator against a real kube-apiserver and kube-controller-manager (the tests'
//! control plane), with real runc containers: a pod with an emptyDir, a hostPath `subPathExpr` mount, Downward API env and an
//! exec readiness probe turns Ready and is deleted cleanly; the real Job controller's Jobs
//! fail after `backoffLimit`, complete and expire, and pass their deadline, from the pod
//! statuses the node reports; restarts, liveness kills, init containers, ConfigMap and Secret inputs,
//! node selectors; a restarted container's status always carries the exit that caused the
//! restart; and the fixture's exit status of a container under a subreaper, reported only once
//! the container's log is complete.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::future::Future;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Pod, Secret};
use kube::api::{DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tempfile::TempDir;
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_e2e::fixture::{
    ContainerExit, ContainerSpec, ImageStore, Runtime, become_child_subreaper,
};
use warmstart_e2e::node::{NodeConfig, NodeImages, POD_IP, SimNode};

const WAIT: Duration = Duration::from_secs(60);

/// A control plane, a simulated node (busybox images), and the directories they use.
struct Cluster {
    node: SimNode,
    state: TempDir,
    images: ImageStore,
    plane: ControlPlane,
}

impl Cluster {
    async fn start(node_name: &str) -> Self {
        let plane = ControlPlane::start().await.unwrap();
        let images = ImageStore::temporary().unwrap();
        images.busybox().unwrap();
        let state = tempfile::Builder::new()
            .prefix("warmstart-node-")
            .tempdir()
            .unwrap();
        let mut config = NodeConfig::new(node_name, NodeImages::from_store(&images), state.path());
        config.restart_backoff = Duration::from_millis(500);
        let node = SimNode::start(plane.client(), config).await.unwrap();
        Self {
            node,
            state,
            images,
            plane,
        }
    }

    fn client(&self) -> Client {
        self.plane.client()
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client(), "default")
    }

    async fn stop(self) {
        let Self {
            node,
            state,
            images,
            plane,
        } = self;
        node.shutdown().await.unwrap();
        let leftovers: Vec<_> = std::fs::read_dir(state.path().join("pods"))
            .unwrap()
            .collect();
        assert!(leftovers.is_empty(), "pod directories left: {leftovers:?}");
        let containers = state.path().join("runtime").join("containers");
        let leftovers: Vec<_> = std::fs::read_dir(&containers)
            .map(|d| d.collect())
            .unwrap_or_default();
        assert!(leftovers.is_empty(), "containers left: {leftovers:?}");
        drop(plane);
        drop(images);
    }
}

/// Polls `check` every 100 ms until it gives a value, at most `timeout`.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until pod `name` satisfies `ok`; returns it.
async fn wait_pod(api: &Api<Pod>, name: &str, what: &str, ok: impl Fn(&Pod) -> bool) -> Pod {
    wait_for(&format!("pod {name}: {what}"), WAIT, || async {
        api.get_opt(name).await.unwrap().filter(|p| ok(p))
    })
    .await
}

fn condition(pod: &Pod, kind: &str) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"))
}

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

fn container_status<'a>(
    pod: &'a Pod,
    name: &str,
) -> Option<&'a k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == name)
}

async fn event_reasons(client: Client) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client, "default");
    events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|e| e.reason)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_with_volumes_downward_env_and_readiness_runs_and_is_deleted_cleanly() {
    let cluster = Cluster::start("sim-node-demo").await;
    let pods = cluster.pods();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo", "labels": {"app": "demo"}},
        "spec": {
            "terminationGracePeriodSeconds": 10,
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {"name": "signals", "hostPath": {"path": "/var/lib/warmstart/signals",
                                                  "type": "DirectoryOrCreate"}},
            ],
            "containers": [{
                "name": "main",
                "image": "busybox:latest",
                "command": ["sh", "-c"],
                "args": ["trap 'echo got TERM; exit 0' TERM; echo started $(POD_NAME); \
                          sleep 1; echo $POD_UID > /signal/whoami; touch /scratch/ready; \
                          while true; do sleep 0.1; done"],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                ],
                "volumeMounts": [
                    {"name": "scratch", "mountPath": "/scratch"},
                    {"name": "signals", "mountPath": "/signal", "subPathExpr": "$(POD_UID)"},
                ],
                "readinessProbe": {"exec": {"command": ["cat", "/scratch/ready"]},
                                   "periodSeconds": 1},
            }],
        },
    }))
    .unwrap();
    let started = Instant::now();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    let uid = created.metadata.uid.clone().unwrap();

    let running = wait_pod(&pods, "demo", "running, not yet ready", |p| {
        phase(p) == "Running"
    })
    .await;
    let to_running = started.elapsed();
    assert!(
        !condition(&running, "Ready"),
        "ready before the probe could pass"
    );
    let ready = wait_pod(&pods, "demo", "Ready", |p| condition(p, "Ready")).await;
    let to_ready = started.elapsed();

    let spec = ready.spec.as_ref().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some("sim-node-demo"));
    let status = ready.status.as_ref().unwrap();
    assert_eq!(status.pod_ip.as_deref(), Some(POD_IP));
    assert!(condition(&ready, "ContainersReady"));
    assert!(condition(&ready, "Initialized"));
    assert!(condition(&ready, "PodScheduled"));
    let main = container_status(&ready, "main").unwrap();
    assert!(main.ready);
    assert_eq!(main.restart_count, 0);
    assert!(main.state.as_ref().unwrap().running.is_some());
    let container_id = main.container_id.clone().unwrap();
    let runc_id = container_id.strip_prefix("runc://").unwrap().to_owned();

    // The container: its id, environment, mounts.
    let runtime: Runtime = cluster.node.runtime().clone();
    {
        let container = cluster.node.container("default", "demo", "main").unwrap();
        assert_eq!(container.id(), runc_id);
        assert_eq!(runtime.runc_state(&runc_id).unwrap()["status"], "running");
        let env = container.exec_ok(["env"]).unwrap();
        for line in [
            "POD_NAME=demo".to_owned(),
            format!("POD_UID={uid}"),
            "NODE=sim-node-demo".to_owned(),
            format!("POD_IP={POD_IP}"),
            "APP=demo".to_owned(),
        ] {
            assert!(
                env.lines().any(|l| l == line),
                "{line} missing from:\n{env}"
            );
        }
        assert!(container.read_log().contains("started demo"));
        // The hostPath volume lives under the node's host root, one directory per pod UID.
        let signal_dir = cluster
            .node
            .host_path("/var/lib/warmstart/signals")
            .unwrap()
            .join(&uid);
        assert!(signal_dir.starts_with(cluster.state.path()));
        let whoami = std::fs::read_to_string(signal_dir.join("whoami")).unwrap();
        assert_eq!(whoami.trim(), uid);
        // The emptyDir is shared with nobody else but mounted writable.
        container.exec_ok(["touch", "/scratch/other"]).unwrap();
    }

    // Graceful deletion: the API server sets deletionTimestamp, the node stops the container
    // (SIGTERM: the shell exits 0), removes it and then deletes the object with grace period 0.
    // The deletion is taken from a watch, not a poll, so what follows is checked right as the
    // object goes: whatever the node removed only after deleting the object would still be
    // there.
    let from = pods.get("demo").await.unwrap().resource_version().unwrap();
    let mut watch = pods
        .watch(&WatchParams::default().fields("metadata.name=demo"), &from)
        .await
        .unwrap()
        .boxed();
    let deleting = Instant::now();
    pods.delete("demo", &DeleteParams::default()).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while let Some(event) = watch.try_next().await.unwrap() {
            if let WatchEvent::Deleted(_) = event {
                return;
            }
        }
        panic!("the watch ended before pod demo was deleted");
    })
    .await
    .expect("pod demo deleted in time");
    let to_deleted = deleting.elapsed();
    assert!(cluster.node.container("default", "demo", "main").is_none());
    assert!(!runtime.runc_has(&runc_id), "runc still has {runc_id}");
    assert!(!runtime.containers_dir().join(&runc_id).exists());
    assert!(
        to_deleted < Duration::from_secs(8),
        "SIGTERM should have ended the container well within the grace period: {to_deleted:?}"
    );

    let reasons = event_reasons(cluster.client()).await;
    for reason in ["Scheduled", "Pulled", "Created", "Started", "Killing"] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "no {reason} event in {reasons:?}"
        );
    }
    eprintln!(
        "timings: running after {to_running:?}, ready after {to_ready:?}, deleted {to_deleted:?} after the delete request"
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn job_with_a_failing_pod_fails_after_its_backoff_limit() {
    let cluster = Cluster::start("sim-node-jobs").await;
    let jobs: Api<Job> = Api::namespaced(cluster.client(), "default");
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "failing"},
        "spec": {
            "backoffLimit": 1,
            "template": {
                "metadata": {"labels": {"app": "failing"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "busybox",
                                    "command": ["sh", "-c", "echo failing; exit 3"]}],
                },
            },
        },
    }))
    .unwrap();
    let started = Instant::now();
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let failed = wait_for("job failing to fail", WAIT, || async {
        let job = jobs.get("failing").await.unwrap();
        let status = job.status.clone()?;
        status
            .conditions
            .as_ref()?
            .iter()
            .any(|c| c.type_ == "Failed" && c.status == "True")
            .then_some(job)
    })
    .await;
    let to_failed = started.elapsed();
    let status = failed.status.unwrap();
    assert_eq!(status.failed, Some(2), "backoffLimit 1 allows one retry");
    // The Job controller leaves zero counts out.
    assert_eq!(status.succeeded.unwrap_or(0), 0);
    assert_eq!(status.active.unwrap_or(0), 0);
    let condition = status
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Failed")
        .unwrap();
    assert_eq!(condition.reason.as_deref(), Some("BackoffLimitExceeded"));

    let pods = cluster
        .pods()
        .list(&ListParams::default().labels("job-name=failing"))
        .await
        .unwrap()
        .items;
    assert_eq!(pods.len(), 2);
    for pod in &pods {
        assert_eq!(phase(pod), "Failed");
        let main = container_status(pod, "main").unwrap();
        let terminated = main.state.as_ref().unwrap().terminated.as_ref().unwrap();
        assert_eq!(terminated.exit_code, 3);
        assert_eq!(terminated.reason.as_deref(), Some("Error"));
        assert!(main.container_id.as_deref().unwrap().starts_with("runc://"));
        assert_eq!(main.restart_count, 0, "restartPolicy Never");
    }
    eprintln!("timings: job failed after {to_failed:?}");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn job_completes_and_expires_after_its_ttl() {
    let cluster = Cluster::start("sim-node-ttl").await;
    let jobs: Api<Job> = Api::namespaced(cluster.client(), "default");
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "works"},
        "spec": {
            "ttlSecondsAfterFinished": 2,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "busybox",
                                "command": ["sh", "-c", "echo done"]}],
            }},
        },
    }))
    .unwrap();
    let started = Instant::now();
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let complete = wait_for("job works to complete", WAIT, || async {
        let job = jobs.get_opt("works").await.unwrap()?;
        let done = job
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .any(|c| c.type_ == "Complete" && c.status == "True");
        done.then_some(job)
    })
    .await;
    let to_complete = started.elapsed();
    let status = complete.status.unwrap();
    assert_eq!(status.succeeded, Some(1));
    assert!(status.completion_time.is_some());
    wait_for("job works to expire", WAIT, || async {
        jobs.get_opt("works").await.unwrap().is_none().then_some(())
    })
    .await;
    // The garbage collector deletes the finished pod; the node removes it.
    wait_for("the job's pod to go", WAIT, || async {
        let pods = cluster
            .pods()
            .list(&ListParams::default().labels("job-name=works"))
            .await
            .unwrap();
        pods.items.is_empty().then_some(())
    })
    .await;
    eprintln!("timings: job complete after {to_complete:?}");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn job_past_its_deadline_fails_and_its_pod_is_stopped() {
    let cluster = Cluster::start("sim-node-deadline").await;
    let jobs: Api<Job> = Api::namespaced(cluster.client(), "default");
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "slow"},
        "spec": {
            "activeDeadlineSeconds": 2,
            "template": {"spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "1000"]}],
            }},
        },
    }))
    .unwrap();
    let started = Instant::now();
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let failed = wait_for("job slow to fail", WAIT, || async {
        let job = jobs.get("slow").await.unwrap();
        let reason = job
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .find(|c| c.type_ == "Failed" && c.status == "True")?
            .reason
            .clone();
        Some(reason)
    })
    .await;
    let to_failed = started.elapsed();
    assert_eq!(failed.as_deref(), Some("DeadlineExceeded"));
    // `startTime` has whole seconds, as in Kubernetes: the deadline may end up to 1 s early.
    assert!(to_failed >= Duration::from_secs(1), "{to_failed:?}");
    // Its running pod is deleted; `sleep` ignores SIGTERM as PID 1, so it is killed after the
    // grace period, and the node removes the object.
    wait_for("the job's pod to go", WAIT, || async {
        let pods = cluster
            .pods()
            .list(&ListParams::default().labels("job-name=slow"))
            .await
            .unwrap();
        pods.items.is_empty().then_some(())
    })
    .await;
    eprintln!(
        "timings: job failed on its deadline after {to_failed:?}, pod gone after {:?}",
        started.elapsed()
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarts_liveness_init_containers_inputs_and_selectors() {
    let cluster = Cluster::start("sim-node-life").await;
    let client = cluster.client();
    let pods = cluster.pods();
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    config_maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "settings"}, "data": {"greeting": "hello"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "creds"}, "stringData": {"password": "hunter2"},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let busybox = |name: &str, script: &str| json!({"name": name, "image": "busybox", "command": ["sh", "-c", script]});
    let manifests = [
        // Crashes: restarted with back-off.
        json!({"metadata": {"name": "crasher"}, "spec": {
            "containers": [busybox("main", "echo crash; exit 1")]}}),
        // Never live: killed and restarted.
        json!({"metadata": {"name": "unlively"}, "spec": {"containers": [{
            "name": "main", "image": "busybox", "command": ["sleep", "1000"],
            "livenessProbe": {"exec": {"command": ["cat", "/missing"]},
                              "periodSeconds": 1, "failureThreshold": 1}}]}}),
        // An init container prepares a file; inputs from a ConfigMap volume and a Secret key.
        json!({"metadata": {"name": "inputs"}, "spec": {
            "restartPolicy": "OnFailure",
            "volumes": [{"name": "work", "emptyDir": {}},
                        {"name": "cfg", "configMap": {"name": "settings"}}],
            "initContainers": [{"name": "prepare", "image": "busybox",
                                "command": ["sh", "-c", "echo prepared > /work/flag"],
                                "volumeMounts": [{"name": "work", "mountPath": "/work"}]}],
            "containers": [{"name": "main", "image": "busybox",
                            "command": ["sh", "-c",
                                        "test \"$(cat /work/flag)\" = prepared && \
                                         test \"$(cat /cfg/greeting)\" = hello && \
                                         test \"$PASSWORD\" = hunter2 && \
                                         ! touch /cfg/x 2>/dev/null && echo all good"],
                            "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {
                                "name": "creds", "key": "password"}}}],
                            "volumeMounts": [{"name": "work", "mountPath": "/work"},
                                             {"name": "cfg", "mountPath": "/cfg"}]}]}}),
        // A startup probe gates readiness; the working directory is created.
        json!({"metadata": {"name": "slow-start"}, "spec": {"containers": [{
            "name": "main", "image": "busybox", "workingDir": "/var/app",
            "command": ["sh", "-c", "pwd; sleep 1; touch /started; exec sleep 1000"],
            "startupProbe": {"exec": {"command": ["cat", "/started"]},
                             "periodSeconds": 1, "failureThreshold": 30}}]}}),
        // Inputs that do not exist: the containers wait, saying why.
        json!({"metadata": {"name": "no-config"}, "spec": {
            "volumes": [{"name": "cfg", "configMap": {"name": "absent"}}],
            "containers": [busybox("main", "true")]}}),
        json!({"metadata": {"name": "no-image"}, "spec": {"containers": [{
            "name": "main", "image": "registry.example/nothing:1", "command": ["true"]}]}}),
        // No node matches: stays unbound.
        json!({"metadata": {"name": "elsewhere"}, "spec": {
            "nodeSelector": {"pool": "gpu"},
            "containers": [busybox("main", "true")]}}),
    ];
    for manifest in manifests {
        let pod: Pod = serde_json::from_value(manifest).unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }

    let inputs = wait_pod(&pods, "inputs", "Succeeded", |p| phase(p) == "Succeeded").await;
    let init = &inputs
        .status
        .as_ref()
        .unwrap()
        .init_container_statuses
        .as_ref()
        .unwrap()[0];
    assert_eq!(
        init.state
            .as_ref()
            .unwrap()
            .terminated
            .as_ref()
            .unwrap()
            .reason
            .as_deref(),
        Some("Completed")
    );
    let main = container_status(&inputs, "main").unwrap();
    assert_eq!(
        main.state
            .as_ref()
            .unwrap()
            .terminated
            .as_ref()
            .unwrap()
            .exit_code,
        0
    );
    assert_eq!(main.restart_count, 0);
    assert_eq!(
        cluster
            .node
            .container_log("default", "inputs", "main")
            .unwrap(),
        "all good\n"
    );

    // Between two back-offs the crasher runs for a moment, and a running container without a
    // readiness probe is ready (as with the kubelet): it is unready while it waits to restart.
    let crasher = wait_pod(&pods, "crasher", "restarted twice, in back-off", |p| {
        container_status(p, "main").is_some_and(|s| {
            s.restart_count >= 2 && s.state.as_ref().is_some_and(|s| s.waiting.is_some())
        })
    })
    .await;
    assert_eq!(phase(&crasher), "Running");
    let main = container_status(&crasher, "main").unwrap();
    let waiting = main.state.as_ref().unwrap().waiting.as_ref().unwrap();
    assert_eq!(
        waiting.reason.as_deref(),
        Some("CrashLoopBackOff"),
        "{main:?}"
    );
    let last = main.last_state.as_ref().and_then(|s| s.terminated.as_ref());
    assert_eq!(last.unwrap().exit_code, 1, "{main:?}");
    assert!(!main.ready);
    assert!(!condition(&crasher, "Ready"));

    let unlively = wait_pod(&pods, "unlively", "restarted by its liveness probe", |p| {
        container_status(p, "main").is_some_and(|s| s.restart_count >= 1)
    })
    .await;
    let main = container_status(&unlively, "main").unwrap();
    let last = main
        .last_state
        .as_ref()
        .unwrap()
        .terminated
        .as_ref()
        .unwrap();
    assert_eq!(last.exit_code, 137, "SIGKILL");
    assert_eq!(last.signal, Some(9));

    let slow = wait_pod(&pods, "slow-start", "Ready", |p| condition(p, "Ready")).await;
    let main = container_status(&slow, "main").unwrap();
    assert_eq!(main.started, Some(true));
    assert!(main.ready);
    let log = cluster
        .node
        .container_log("default", "slow-start", "main")
        .unwrap();
    assert_eq!(log, "/var/app\n");

    let waiting = |pod: &Pod| {
        container_status(pod, "main")
            .and_then(|s| s.state.as_ref()?.waiting.clone())
            .map(|w| (w.reason.unwrap_or_default(), w.message.unwrap_or_default()))
    };
    let no_config = wait_pod(&pods, "no-config", "waiting for its ConfigMap", |p| {
        waiting(p).is_some_and(|(_, message)| message.contains("configmap \"absent\" not found"))
    })
    .await;
    assert_eq!(phase(&no_config), "Pending");
    let no_image = wait_pod(&pods, "no-image", "waiting for its image", |p| {
        waiting(p).is_some_and(|(reason, _)| reason == "ErrImagePull")
    })
    .await;
    assert_eq!(phase(&no_image), "Pending");

    let elsewhere = pods.get("elsewhere").await.unwrap();
    assert!(elsewhere.spec.unwrap().node_name.is_none());

    let reasons = event_reasons(client).await;
    for reason in ["BackOff", "Unhealthy", "Killing", "FailedMount", "Failed"] {
        assert!(
            reasons.iter().any(|r| r == reason),
            "no {reason} event in {reasons:?}"
        );
    }
    // Pods are left running: shutting the node down removes their containers.
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_status_of_a_restarted_container_carries_the_exit_that_caused_the_restart() {
    let cluster = Cluster::start("sim-node-restarts").await;
    let pods = cluster.pods();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "crasher"},
        "spec": {"containers": [{"name": "main", "image": "busybox",
                                 "command": ["sh", "-c", "echo crash; exit 1"]}]},
    }))
    .unwrap();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    // Every version of the pod, as the kubelet's status writes made them: a status read at any
    // moment must never show a restart without its cause.
    let mut watch = pods
        .watch(
            &WatchParams::default().fields("metadata.name=crasher"),
            &created.resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    let mut running_after_a_restart = 0;
    tokio::time::timeout(WAIT, async {
        while let Some(event) = watch.try_next().await.unwrap() {
            let (WatchEvent::Added(pod) | WatchEvent::Modified(pod)) = event else {
                continue;
            };
            let Some(main) = container_status(&pod, "main") else {
                continue;
            };
            if main.restart_count == 0 {
                continue;
            }
            let last = main.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            assert_eq!(
                last.map(|t| t.exit_code),
                Some(1),
                "restart {} without the exit that caused it: {main:?}",
                main.restart_count
            );
            if main.state.as_ref().is_some_and(|s| s.running.is_some()) {
                running_after_a_restart += 1;
            }
            if main.restart_count >= 3 {
                return;
            }
        }
        panic!("the watch ended before pod crasher restarted 3 times");
    })
    .await
    .expect("pod crasher restarted 3 times in time");
    // Each restart is written with the new instance running, before its exit is noticed.
    assert!(
        running_after_a_restart >= 1,
        "never saw a restarted instance run"
    );
    cluster.stop().await;
}

#[test]
fn fixture_reports_an_exit_once_the_log_holds_all_the_container_wrote() {
    become_child_subreaper().unwrap();
    let images = ImageStore::temporary().unwrap();
    let image = images.busybox().unwrap();
    let base = tempfile::tempdir().unwrap();
    let runtime = Runtime::new(base.path());
    // Without a PID namespace of its own, a child outlives the init process and writes to the
    // container's stdout after the init exited: output still on its way to the log when the exit
    // can first be seen.
    let mut spec = ContainerSpec::new(
        "late-output",
        &image,
        [
            "sh",
            "-c",
            "sh -c 'sleep 2; echo late output' & echo writer $!",
        ],
    );
    spec.oci_patch = Some(json!({"linux": {"namespaces": [
        {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
    ]}}));
    let container = runtime.start(&spec).unwrap();
    let exit = container.wait_exit(WAIT);
    let log = container.read_log();
    // The writer was orphaned to this process (the subreaper): reap it.
    if let Some(writer) = log
        .lines()
        .find_map(|l| l.strip_prefix("writer "))
        .and_then(|pid| pid.trim().parse().ok())
    {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(writer), None);
    }
    assert_eq!(exit.unwrap(), ContainerExit::Code(0));
    assert!(
        log.contains("late output\n"),
        "the exit was reported before the log was complete: {log:?}"
    );
    container.destroy().unwrap();
}

#[test]
fn fixture_reports_exit_status_under_a_subreaper() {
    become_child_subreaper().unwrap();
    let images = ImageStore::temporary().unwrap();
    let image = images.busybox().unwrap();
    let base = tempfile::tempdir().unwrap();
    let runtime = Runtime::new(base.path());
    let exits = runtime
        .start(&ContainerSpec::new(
            "exit-7",
            &image,
            ["sh", "-c", "exit 7"],
        ))
        .unwrap();
    assert_eq!(exits.wait_exit(WAIT).unwrap(), ContainerExit::Code(7));
    assert_eq!(exits.try_wait().unwrap(), Some(ContainerExit::Code(7)));
    let sleeper = runtime
        .start(&ContainerSpec::new("sleeper", &image, ["sleep", "1000"]))
        .unwrap();
    assert_eq!(sleeper.try_wait().unwrap(), None);
    sleeper.signal("KILL").unwrap();
    let exit = sleeper.wait_exit(WAIT).unwrap();
    assert_eq!(exit, ContainerExit::Signal(9));
    assert_eq!(exit.code(), 137);
    assert!(!exit.success());
    let pid = sleeper.pid();
    sleeper.destroy().unwrap();
    exits.destroy().unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "zombie left"
    );
}
