//! The whole loop on a real Kubernetes: the local two-node cluster of `make cluster-up`
//! (upstream kube-apiserver, etcd, controller-manager, scheduler, and per node a kubelet over its
//! own containerd; pods go to either node unless a test holds them to one),
//! warmstart installed from `deploy/` as a user installs it, from images assembled here
//! (`warmstart_e2e::real_kube`). One cluster for this whole test binary, a namespace per test.
//!
//! The tests start in the order below. Those that leave warmstart as it is (each in its
//! namespace) run side by side, up to [`BESIDE`] at once; each of the others ([`Share::Alone`]:
//! they delete warmstart's own pods, reinstall it, change the node's device plugin, or read the
//! API server's audit log of everything before them) runs alone, after everything listed before
//! it ended and before anything after it starts.
//!
//! Runs as root (`cargo test -p warmstart-e2e --test real_cluster`); skipped otherwise, unless
//! `WARMSTART_REQUIRE_ROOT` is set, which makes that a failure. Needs the agent and controller
//! built (`cargo build -p warmstart-agent -p warmstart-controller`), `make static` and
//! `make setup`. A cluster already up (`make cluster-up`) is reused and left up; one this binary
//! starts is torn down (`make cluster-down`) at its end, pass or fail, unless
//! `WARMSTART_KEEP_CLUSTER=1`. The images are assembled and loaded on every run, so the cluster
//! runs the binaries just built; a warmstart already installed is rolled to them.

#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};
use warmstart_e2e::binaries::WORKER_IN_IMAGE;
use warmstart_e2e::cuda::SimGpu;
use warmstart_e2e::device_plugin::Form;
use warmstart_e2e::real_kube::poll;
use warmstart_e2e::real_kube::{
    self, AGENT_STATE, ARTIFACTS, AUDIT_LOG, DEVICE_PLUGIN_LOGS, DevicePluginForm, LocalKube, PORT,
    SYSTEM_NAMESPACE, TestNamespace, WAIT, checkpoint, checkpoint_ready, client, create_checkpoint,
    event_notes, http_get, kubectl, pod, pod_ready, restore_status, warmstart_logs,
    worker_container, worker_state,
};
use warmstart_shared::artifact::{GpuSource, Verification, read_published};
use warmstart_shared::names;
use warmstart_shared::v1alpha1::{Checkpoint, CheckpointPhase};

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
    false
}

type Scenario = fn(Client, String) -> std::pin::Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// How a scenario shares the cluster with the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Share {
    /// It leaves warmstart as it is and keeps to its namespace: it runs beside the others of
    /// its kind.
    Beside,
    /// It disrupts warmstart or reads what all others did: it runs alone.
    Alone,
}

/// Scenarios that run side by side at most: most of their time is spent waiting on pods.
const BESIDE: usize = 3;

macro_rules! scenario {
    ($share:ident, $f:ident) => {
        (
            stringify!($f),
            Share::$share,
            (|c, ns| Box::pin($f(c, ns))) as Scenario,
        )
    };
}

/// The tests, in the order they start. The first runs alone: it counts the restores of every
/// node's agent.
fn scenarios() -> Vec<(&'static str, Share, Scenario)> {
    vec![
        scenario!(Alone, a_checkpoint_restores_into_eight_pods_created_at_once),
        scenario!(
            Beside,
            a_long_checkpoint_shows_its_progress_on_the_checkpoint
        ),
        scenario!(
            Beside,
            an_unchanged_server_under_wrap_is_restored_and_a_stale_binding_cold_starts
        ),
        scenario!(
            Beside,
            a_tampered_artifact_and_an_uncaptured_container_are_refused
        ),
        scenario!(
            Beside,
            a_checkpoint_job_refused_by_pod_security_is_reported_on_the_checkpoint
        ),
        scenario!(
            Beside,
            a_ready_file_in_a_pod_that_is_no_checkpoint_source_is_ignored
        ),
        scenario!(
            Beside,
            a_deleted_namespace_keeps_its_artifacts_for_a_checkpoint_to_adopt
        ),
        scenario!(
            Beside,
            a_checkpoint_made_on_one_node_restores_on_the_other_through_the_artifact_volume
        ),
        scenario!(
            Alone,
            the_gpus_the_kubelet_allocated_are_recorded_and_void_alone_is_refused
        ),
        scenario!(Alone, the_agent_pod_deleted_mid_checkpoint_loses_nothing),
        scenario!(
            Alone,
            the_agent_pod_deleted_mid_restore_restores_at_most_once
        ),
        scenario!(
            Alone,
            the_controller_leader_deleted_while_creating_the_next_leader_finishes
        ),
        scenario!(
            Alone,
            an_agent_that_cannot_reach_its_runtime_unlabels_its_node_and_says_why
        ),
        scenario!(
            Alone,
            a_checkpoint_made_on_one_node_restores_on_the_other_through_the_object_store
        ),
        scenario!(Alone, an_uninstall_and_reinstall_keep_every_checkpoint),
        scenario!(
            Alone,
            the_helm_chart_installs_upgrades_and_uninstalls_keeping_every_checkpoint
        ),
        scenario!(Alone, every_request_of_warmstart_was_allowed_by_its_rbac),
    ]
}

/// Which scenarios ended, so each starts only when those it must follow did (see the module
/// doc): one that runs alone waits for every scenario before it, one that runs beside others
/// for the lone ones before it. A scenario that does not run (filtered out) counts as ended.
struct Turns {
    ended: std::sync::Mutex<Vec<bool>>,
    changed: std::sync::Condvar,
    shares: Vec<Share>,
}

impl Turns {
    fn new(shares: Vec<Share>, runs: impl Fn(usize) -> bool) -> Self {
        let ended = (0..shares.len()).map(|i| !runs(i)).collect();
        Self {
            ended: std::sync::Mutex::new(ended),
            changed: std::sync::Condvar::new(),
            shares,
        }
    }

    /// Waits for scenario `i`'s turn; its end is recorded when the returned guard drops.
    fn wait(&self, i: usize) -> TurnEnded<'_> {
        let alone = self.shares[i] == Share::Alone;
        let mut ended = self.ended.lock().unwrap();
        while ended[..i]
            .iter()
            .zip(&self.shares)
            .any(|(done, share)| !done && (alone || *share == Share::Alone))
        {
            ended = self.changed.wait(ended).unwrap();
        }
        TurnEnded { turns: self, i }
    }
}

/// Records a scenario's end, however it ended.
struct TurnEnded<'a> {
    turns: &'a Turns,
    i: usize,
}

impl Drop for TurnEnded<'_> {
    fn drop(&mut self) {
        let mut ended = self
            .turns
            .ended
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        ended[self.i] = true;
        self.turns.changed.notify_all();
    }
}

fn main() {
    let mut args = Arguments::from_args();
    // Lone scenarios wait their turn (see the module doc); the others run side by side.
    args.test_threads.get_or_insert(BESIDE);
    let started = SystemTime::now();
    let _ = STARTED.set(started);
    let list = scenarios();
    let shares = list.iter().map(|(_, share, _)| *share).collect();
    let names: Vec<&str> = list.iter().map(|(name, _, _)| *name).collect();
    let runs = |i: usize| {
        let probe = Trial::test(names[i], || Ok(()));
        !args.is_filtered_out(&probe) && !args.is_ignored(&probe)
    };
    let turns = std::sync::Arc::new(Turns::new(shares, runs));
    let trials: Vec<Trial> = list
        .into_iter()
        .enumerate()
        .map(|(i, (name, _, scenario))| {
            let turns = turns.clone();
            Trial::test(name, move || {
                let _turn = turns.wait(i);
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                runtime
                    .block_on(async {
                        let client = client().await?;
                        let prefix: String = name.split('_').take(3).collect::<Vec<_>>().join("-");
                        let ns = TestNamespace::create(&client, &prefix).await?;
                        let result = scenario(client, ns.name.clone()).await;
                        drop(ns);
                        result
                    })
                    .map_err(|e| Failed::from(format!("{e:#}")))
            })
        })
        .collect();
    let runs = !args.list
        && trials
            .iter()
            .any(|t| !args.is_filtered_out(t) && !args.is_ignored(t));
    if !runs {
        libtest_mimic::run(&args, trials).exit();
    }
    if !is_root() {
        eprintln!("skipped: the local cluster needs root");
        return;
    }
    let cluster = LocalKube::up().unwrap();
    real_kube::ensure_device_plugin(Path::new(env!(
        "CARGO_BIN_EXE_warmstart-test-device-plugin"
    )))
    .unwrap();
    real_kube::build_and_load_images(&target_dir()).unwrap();
    real_kube::install().unwrap();
    let conclusion = libtest_mimic::run(&args, trials);
    drop(cluster);
    conclusion.exit();
}

/// When this test binary started (the audit test reads requests from then on).
static STARTED: std::sync::OnceLock<SystemTime> = std::sync::OnceLock::new();

fn status_of(ck: &Checkpoint) -> Value {
    serde_json::to_value(ck.status.as_ref().unwrap()).unwrap()
}

/// The artifact directory of a Ready Checkpoint on the node.
fn artifact_dir(ck: &Checkpoint) -> PathBuf {
    Path::new(ARTIFACTS).join(ck.status.as_ref().unwrap().location.as_ref().unwrap())
}

/// The names in the namespace's artifact directory, but the restores' private views.
fn artifacts_of(namespace: &str) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(Path::new(ARTIFACTS).join(namespace))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n != ".views")
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

async fn make_ready_checkpoint(
    client: &Client,
    ns: &str,
    name: &str,
    container: &Value,
    job: &Value,
) -> Result<(Checkpoint, Duration)> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), ns);
    let started = Instant::now();
    create_checkpoint(&checkpoints, &checkpoint(name, container, job)?).await?;
    let ready = checkpoint_ready(&checkpoints, name).await?;
    Ok((ready, started.elapsed()))
}

/// A checkpoint of a worker with 768 MiB of weights says how far it is on its Checkpoint while
/// it runs (`status.progress`, the Progress column of `kubectl get`), and the field is gone once
/// the Checkpoint is Ready.
async fn a_long_checkpoint_shows_its_progress_on_the_checkpoint(
    client: Client,
    ns: String,
) -> Result<()> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(768, 0);
    create_checkpoint(&checkpoints, &checkpoint("big", &worker, &json!({}))?).await?;
    let mut seen: Vec<Value> = Vec::new();
    let mut listed = None;
    let deadline = Instant::now() + WAIT;
    let ready = loop {
        let ck = checkpoints.get("big").await?;
        // No status until the controller first sees it.
        let status = serde_json::to_value(&ck.status)?;
        if !status["progress"].is_null() {
            if listed.is_none() {
                listed = Some(kubectl(&["-n", &ns, "get", "checkpoint", "big"])?);
            }
            if seen.last() != Some(&status["progress"]) {
                seen.push(status["progress"].clone());
            }
        }
        match status["phase"].as_str() {
            Some("Ready") => break status,
            Some("Failed") => bail!("the checkpoint failed: {status}\n{}", warmstart_logs()),
            _ => {}
        }
        ensure!(
            Instant::now() < deadline,
            "Checkpoint big not Ready: {status}\n{}",
            warmstart_logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for progress in &seen {
        println!("progress on the Checkpoint: {progress}");
    }
    ensure!(
        !seen.is_empty(),
        "no progress while Creating; ready: {ready}"
    );
    for progress in &seen {
        let message = progress["message"].as_str().unwrap_or_default();
        ensure!(
            (message.starts_with("dumping ") || message.starts_with("hashing "))
                && message.contains(" at ")
                && progress["bytesTotal"].as_u64().unwrap_or(0) > 0
                && progress["updatedAt"].is_string(),
            "{progress}"
        );
    }
    // The dump's total is the worker's resident memory, its weights included.
    ensure!(
        seen.iter()
            .filter(|p| p["message"]
                .as_str()
                .unwrap_or_default()
                .starts_with("dumping "))
            .all(|p| p["bytesTotal"].as_u64().unwrap_or(0) > 768 << 20),
        "{seen:?}"
    );
    let listed = listed.unwrap_or_default();
    println!("{listed}");
    ensure!(
        listed
            .lines()
            .next()
            .unwrap_or_default()
            .contains("PROGRESS")
            && (listed.contains("dumping ") || listed.contains("hashing ")),
        "{listed}"
    );
    ensure!(
        ready["progress"].is_null(),
        "progress left on a Ready Checkpoint: {ready}"
    );
    Ok(())
}

/// The number of `reason` Events about pod `name`.
async fn events_with_reason(client: &Client, ns: &str, name: &str, reason: &str) -> Result<usize> {
    let prefix = format!("{reason}: ");
    Ok(event_notes(client, ns, "Pod", name)
        .await?
        .iter()
        .filter(|n| n.starts_with(&prefix))
        .count())
}

/// The processes in pod `name`'s container `main` (`ps` inside it), running `program`.
fn processes_running(ns: &str, name: &str, program: &str) -> Result<usize> {
    let ps = kubectl(&[
        "-n", ns, "exec", name, "-c", "main", "--", "ps", "-o", "args",
    ])?;
    Ok(ps
        .lines()
        .filter(|l| l.split_whitespace().next() == Some(program))
        .count())
}

/// A Checkpoint of the sample worker becomes Ready with its artifact's facts; eight pods
/// annotated to restore from it, created at once, all become Ready, each serving the
/// checkpointed process and each restored once. Their times from creation to Ready are printed
/// next to a cold start of the same pod.
async fn a_checkpoint_restores_into_eight_pods_created_at_once(
    client: Client,
    ns: String,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(64, 2000);
    let (ready, checkpoint_took) =
        make_ready_checkpoint(&client, &ns, "worker", &worker, &json!({})).await?;
    let status = status_of(&ready);
    let artifact = &status["artifact"];
    ensure!(artifact["container"] == "main", "{status}");
    ensure!(
        artifact["sizeBytes"].as_u64().unwrap() > 64 << 20,
        "{status}"
    );
    ensure!(
        artifact["manifestDigest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"),
        "{status}"
    );
    ensure!(
        artifact["criuVersion"].as_str().unwrap().starts_with('4'),
        "{status}"
    );
    ensure!(
        status["location"].as_str().unwrap()
            == format!("{ns}/{}", status["identityHash"].as_str().unwrap()),
        "{status}"
    );
    ensure!(status["timings"]["dump"].is_number(), "{status}");
    ensure!(
        status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True"),
        "{status}"
    );
    read_published(&artifact_dir(&ready), Verification::Checksums)?;
    // What a user sees: the agent's Events on the Checkpoint itself, its readiness and size in
    // `kubectl get`.
    let notes = event_notes(&client, &ns, "Checkpoint", "worker").await?;
    for reason in ["Checkpointing: ", "Checkpointed: "] {
        ensure!(
            notes.iter().any(|n| n.starts_with(reason)),
            "{reason}missing: {notes:?}"
        );
    }
    let listed = kubectl(&["-n", &ns, "get", "checkpoint", "worker"])?;
    let header: Vec<&str> = listed
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let row: Vec<&str> = listed
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let column = |name: &str| {
        let i = header.iter().position(|h| *h == name)?;
        // Size is two words ("68.4 MiB").
        Some(if name == "SIZE" {
            row[i..=i + 1].join(" ")
        } else {
            row[i].to_owned()
        })
    };
    ensure!(column("READY").as_deref() == Some("True"), "{listed}");
    ensure!(
        column("SIZE").as_deref() == artifact["size"].as_str()
            && artifact["size"]
                .as_str()
                .is_some_and(|s| s.ends_with(" MiB")),
        "{listed}\n{status}"
    );

    let replicas: Vec<String> = (0..8).map(|i| format!("restored-{i}")).collect();
    let created = Instant::now();
    let creates = replicas.iter().map(|name| {
        let pods = pods.clone();
        let p = pod(name, Some("worker"), &worker);
        async move { anyhow::Ok(pods.create(&PostParams::default(), &p?).await?) }
    });
    for created in futures::future::join_all(creates).await {
        created?;
    }
    let mut ready_after = Vec::new();
    let mut sources = BTreeSet::new();
    for name in &replicas {
        let p = pod_ready(&pods, name, false).await?;
        ready_after.push(created.elapsed().as_secs_f64());
        ensure!(
            restore_status(&p) == Some("completed"),
            "{name}: {:?}",
            p.annotations()
        );
        let state = worker_state(&p)?;
        ensure!(state["restored"] == true, "{name}: {state}");
        let source = state["hostname"].as_str().unwrap_or_default().to_owned();
        ensure!(
            source.starts_with("checkpoint-worker-"),
            "{name}: the process of the checkpoint Job's pod serves, not a fresh one: {state}"
        );
        ensure!(state["requests"].as_u64() >= Some(1), "{name}: {state}");
        sources.insert(state["weightsSha256"].to_string());
        let restored = events_with_reason(&client, &ns, name, "Restored").await?;
        ensure!(restored == 1, "{name} restored {restored} times");
    }
    ensure!(
        sources.len() == 1,
        "every replica serves the same weights: {sources:?}"
    );

    // What users buy warmstart for, in the agents' metrics: each restore pod's time to Ready
    // (counted by the agent of the node it ran on).
    let count = "warmstart_agent_restore_pod_ready_seconds_count{outcome=\"restored\"}";
    poll(
        "the agents to count 8 restored pods Ready",
        WAIT,
        Duration::from_millis(200),
        warmstart_logs,
        || async {
            let mut counted = 0;
            for node in real_kube::NODES {
                counted += agent_metric(&agent_on(&client, node).await?, count)?;
            }
            Ok((counted >= 8).then_some(()))
        },
    )
    .await?;

    // The same pod without the annotation: a cold start, for comparison.
    let cold_started = Instant::now();
    pods.create(&PostParams::default(), &pod("cold", None, &worker)?)
        .await?;
    let cold = pod_ready(&pods, "cold", false).await?;
    let cold_took = cold_started.elapsed();
    let cold_state = worker_state(&cold)?;
    ensure!(cold_state["restored"] == false, "{cold_state}");
    ensure!(sources.contains(&cold_state["weightsSha256"].to_string()));

    eprintln!(
        "real cluster: Checkpoint created -> Ready {:.2}s; 8 restore pods created at once -> \
         Ready after {:?} s; one cold start {:.2}s",
        checkpoint_took.as_secs_f64(),
        ready_after
            .iter()
            .map(|s| (s * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        cold_took.as_secs_f64()
    );
    Ok(())
}

/// The Ready agent pod on `node`.
async fn agent_on(client: &Client, node: &str) -> Result<Pod> {
    real_kube::agent_pods(client)
        .await?
        .into_iter()
        .find(|p| {
            real_kube::is_ready(p)
                && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
        })
        .with_context(|| format!("no Ready agent pod on {node}"))
}

/// The value of the agent's metric `series` (name and labels, as exposed), 0 when absent.
fn agent_metric(agent: &Pod, series: &str) -> Result<u64> {
    let (_, metrics) = real_kube::http_get_port(agent, 9090, "/metrics")?;
    Ok(metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(0))
}

/// Waits until the agent refused the restore into `name` (restore status `failed`) and the pod
/// cold-started: Ready, its restore status still `failed`. The notes of its Events.
async fn refused_and_cold_started(client: &Client, ns: &str, name: &str) -> Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let p = pod_ready(&pods, name, true).await?;
    let status = restore_status(&p);
    ensure!(
        status == Some("failed"),
        "{name} became Ready without a refusal: restore status {status:?}"
    );
    let restored = events_with_reason(client, ns, name, "Restored").await?;
    ensure!(restored == 0, "{name} was restored {restored} times");
    event_notes(client, ns, "Pod", name).await
}

/// busybox `httpd`, a server that knows nothing of warmstart, checkpointed under
/// `spec.job.entrypoint: Wrap`, is restored into a new pod. Then a pod bound to that Checkpoint
/// is held back from scheduling while the Checkpoint is deleted and made again under the same
/// name (another uid): the agent refuses the stale binding, nothing is restored, the pod's
/// Events say why, and the entrypoint cold-starts the server.
async fn an_unchanged_server_under_wrap_is_restored_and_a_stale_binding_cold_starts(
    client: Client,
    ns: String,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let server = json!({
        "name": "main", "image": real_kube::WORKER_IMAGE, "imagePullPolicy": "Never",
        "command": ["httpd", "-f", "-p", PORT.to_string(), "-h", "/etc"],
        "readinessProbe": {"httpGet": {"path": "/hostname", "port": PORT}, "periodSeconds": 1}
    });
    let wrap = json!({"entrypoint": "Wrap"});
    let (first, took) = make_ready_checkpoint(&client, &ns, "httpd", &server, &wrap).await?;
    ensure!(
        status_of(&first)["entrypoint"] == "Wrap",
        "{}",
        status_of(&first)
    );
    eprintln!(
        "httpd under Wrap: Checkpoint created -> Ready {:.2}s",
        took.as_secs_f64()
    );

    pods.create(
        &PostParams::default(),
        &pod("httpd-restored", Some("httpd"), &server)?,
    )
    .await?;
    let restored = pod_ready(&pods, "httpd-restored", false).await?;
    ensure!(restore_status(&restored) == Some("completed"));
    // The restored httpd serves, through the restore pod's own mounts (kubelet's /etc/hostname
    // of this pod), below the entrypoint that waited in standby and the restored copy of the
    // entrypoint: two entrypoints, one httpd. A cold start would have one of each.
    let (code, body) = http_get(&restored, "/hostname")?;
    ensure!(
        code == 200 && body.trim() == "httpd-restored",
        "{code} {body}"
    );
    ensure!(processes_running(&ns, "httpd-restored", &names::entrypoint_path())? == 2);
    ensure!(processes_running(&ns, "httpd-restored", "httpd")? == 1);
    ensure!(events_with_reason(&client, &ns, "httpd-restored", "Restored").await? == 1);

    let mut held = serde_json::to_value(pod("held", Some("httpd"), &server)?)?;
    held["spec"]["schedulingGates"] = json!([{"name": "example.com/hold"}]);
    let held = pods
        .create(&PostParams::default(), &serde_json::from_value(held)?)
        .await?;
    let binding = held.annotations()[names::ANNOTATION_CHECKPOINT_BINDING].clone();
    let first_uid = first.uid().unwrap();
    ensure!(binding.contains(&first_uid), "{binding}");
    checkpoints
        .delete("httpd", &DeleteParams::default())
        .await?;
    poll(
        "the Checkpoint to be gone",
        WAIT,
        Duration::from_millis(100),
        warmstart_logs,
        || async { Ok(checkpoints.get_opt("httpd").await?.is_none().then_some(())) },
    )
    .await?;
    let (second, _) = make_ready_checkpoint(&client, &ns, "httpd", &server, &wrap).await?;
    ensure!(second.uid() != Some(first_uid));
    pods.patch(
        "held",
        &PatchParams::default(),
        &Patch::Json::<()>(serde_json::from_value(json!([
            {"op": "remove", "path": "/spec/schedulingGates"}
        ]))?),
    )
    .await?;
    let notes = refused_and_cold_started(&client, &ns, "held").await?;
    ensure!(
        notes.iter().any(|m| m.contains("binding")),
        "the pod's Events say the binding is stale: {notes:?}\n{}",
        warmstart_logs()
    );
    let held = pods.get("held").await?;
    let (code, body) = http_get(&held, "/hostname")?;
    ensure!(code == 200 && body.trim() == "held", "{code} {body}");
    ensure!(
        processes_running(&ns, "held", &names::entrypoint_path())? == 1,
        "a cold start: the entrypoint runs httpd itself"
    );
    Ok(())
}

/// A page image changed on the storage after the Checkpoint became Ready: the restore is
/// refused (the Events name the page image), nothing is restored and the worker cold-starts.
/// A pod asking to restore a container the Checkpoint did not capture is refused when it is
/// created, with the reason.
async fn a_tampered_artifact_and_an_uncaptured_container_are_refused(
    client: Client,
    ns: String,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(16, 300);
    let (ck, _) = make_ready_checkpoint(&client, &ns, "tamper", &worker, &json!({})).await?;

    let mut sidecar = worker.clone();
    sidecar["name"] = json!("sidecar");
    let err = pods
        .create(
            &PostParams::default(),
            &pod("foreign", Some("tamper"), &sidecar)?,
        )
        .await
        .err()
        .context("a pod restoring an uncaptured container was admitted")?;
    ensure!(
        err.to_string()
            .contains("target container \"sidecar\" was not captured by checkpoint"),
        "{err}"
    );
    ensure!(pods.get_opt("foreign").await?.is_none());

    let images = artifact_dir(&ck).join("criu");
    let page = std::fs::read_dir(&images)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pages-"))
        })
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .context("no page image")?;
    let mut bytes = std::fs::read(&page)?;
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&page, bytes)?;

    pods.create(
        &PostParams::default(),
        &pod("tampered", Some("tamper"), &worker)?,
    )
    .await?;
    let notes = refused_and_cold_started(&client, &ns, "tampered").await?;
    ensure!(
        notes
            .iter()
            .any(|m| m.contains("pages-") && m.contains("chunk")),
        "the pod's Events name the changed page image: {notes:?}\n{}",
        warmstart_logs()
    );
    let state = worker_state(&pods.get("tampered").await?)?;
    ensure!(state["restored"] == false, "{state}");
    ensure!(
        processes_running(&ns, "tampered", WORKER_IN_IMAGE)? == 1,
        "one worker, cold-started"
    );
    Ok(())
}

/// A checkpoint Job whose pod the namespace's Pod Security (`baseline`) refuses, a privileged
/// worker, is reported on the Checkpoint: its Ready condition says `JobFailedCreate` with the
/// admission's words, instead of the Checkpoint waiting for the Job's deadline.
async fn a_checkpoint_job_refused_by_pod_security_is_reported_on_the_checkpoint(
    client: Client,
    ns: String,
) -> Result<()> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let mut worker = worker_container(16, 300);
    worker["securityContext"] = json!({"privileged": true});
    create_checkpoint(
        &checkpoints,
        &checkpoint("privileged", &worker, &json!({}))?,
    )
    .await?;
    let condition = poll(
        "the Checkpoint to report that its Job cannot create its pod",
        WAIT,
        Duration::from_millis(200),
        warmstart_logs,
        || async {
            let ck = checkpoints.get("privileged").await?;
            Ok(ck.status.and_then(|s| {
                s.conditions
                    .into_iter()
                    .find(|c| c.type_ == "Ready" && c.reason == "JobFailedCreate")
            }))
        },
    )
    .await?;
    ensure!(condition.status == "False");
    ensure!(
        condition
            .message
            .contains("violates PodSecurity \"baseline:latest\"")
            && condition.message.contains("privileged"),
        "{}",
        condition.message
    );
    Ok(())
}

/// The node's GPUs come from the tests' device plugin, a test double of NVIDIA's, so the real
/// kubelet allocates them and reports them over its PodResources API. A checkpoint of a worker
/// given one `nvidia.com/gpu` records the GPU the kubelet allocated, found through that API,
/// whichever way the plugin named it to the container: its UUID in `NVIDIA_VISIBLE_DEVICES`, or
/// `void` with CDI devices or CDI annotations (the GPU Operator's CDI mode). The agent here has
/// no CUDA driver: finding a container's GPUs does not need one. A restore pod given a GPU is
/// restored. A restore pod, and a worker to checkpoint, that say `NVIDIA_VISIBLE_DEVICES=void`
/// without being given a GPU are refused, and the reason is on the pod, and on the Checkpoint
/// and its Job's pod.
async fn the_gpus_the_kubelet_allocated_are_recorded_and_void_alone_is_refused(
    client: Client,
    ns: String,
) -> Result<()> {
    let standin: Vec<String> = (0..8).map(|n| SimGpu::numbered(n, 0).uuid).collect();
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    for form in [Form::Uuids, Form::Cdi, Form::CdiAnnotations] {
        let _form = DevicePluginForm::set(form)?;
        let mut worker = worker_container(16, 300);
        worker["resources"] = json!({"limits": {"nvidia.com/gpu": 1}});
        let name = format!("gpu-{}", form.name());
        // A model of its own: another identity, so another artifact.
        let mut ck = serde_json::to_value(checkpoint(&name, &worker, &json!({}))?)?;
        ck["spec"]["identity"]["model"] = json!(format!("sample-worker-{}", form.name()));
        create_checkpoint(&checkpoints, &serde_json::from_value(ck)?).await?;
        let ck = checkpoint_ready(&checkpoints, &name).await?;
        let manifest = read_published(&artifact_dir(&ck), Verification::Checksums)?;
        let gpus = manifest
            .assigned_gpus
            .with_context(|| format!("{name}: the manifest records no GPU"))?;
        ensure!(
            gpus.source == GpuSource::PodResources && gpus.resource == "nvidia.com/gpu",
            "{name}: {gpus:?}"
        );
        let [gpu] = gpus.devices.as_slice() else {
            bail!("{name}: one GPU was allocated, the manifest records {gpus:?}");
        };
        ensure!(standin.contains(gpu), "{name}: {gpu} is no stand-in GPU");
        // The plugin handed that GPU to the container in this form.
        let allocated = format!("allocate [{gpu:?}] as {}", form.name());
        // By the plugin of the node the Job's pod ran on.
        let logs = DEVICE_PLUGIN_LOGS
            .iter()
            .map(|log| std::fs::read_to_string(log).unwrap_or_default())
            .collect::<String>();
        ensure!(
            logs.contains(&allocated),
            "{name}: no device plugin's log has {allocated:?}"
        );
        let notes = event_notes(&client, &ns, "Checkpoint", &name).await?;
        let said = format!("GPUs: {gpu} from the kubelet's PodResources API (nvidia.com/gpu)");
        ensure!(
            notes
                .iter()
                .any(|n| n.starts_with("Checkpointed: ") && n.contains(&said)),
            "{name}: no Checkpointed Event says {said:?}: {notes:?}"
        );
    }

    // A restore pod given a GPU by the kubelet is restored; one that says `void` and is given
    // none is refused (and cold-started), saying why.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut worker = worker_container(16, 300);
    worker["resources"] = json!({"limits": {"nvidia.com/gpu": 1}});
    real_kube::create_admitted(&pods, &pod("restored", Some("gpu-uuids"), &worker)?).await?;
    let restored = pod_ready(&pods, "restored", false).await?;
    ensure!(restore_status(&restored) == Some("completed"));
    let mut void = worker_container(16, 300);
    void["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]);
    real_kube::create_admitted(&pods, &pod("void-placeholder", Some("gpu-uuids"), &void)?).await?;
    let notes = refused_and_cold_started(&client, &ns, "void-placeholder").await?;
    ensure!(
        notes
            .iter()
            .any(|n| n.contains("the placeholder's GPUs cannot be told")
                && n.contains("NVIDIA_VISIBLE_DEVICES=\"void\"")),
        "the refusal names the placeholder's GPUs: {notes:?}"
    );

    let published = artifacts_of(&ns);
    create_checkpoint(&checkpoints, &checkpoint("gpu-void", &void, &json!({}))?).await?;
    let refused = |n: &String| {
        n.starts_with("CheckpointFailed: ")
            && n.contains("cannot tell which GPUs container")
            && n.contains("NVIDIA_VISIBLE_DEVICES=\"void\"")
            && n.contains("the kubelet's PodResources API (no GPU allocated to")
    };
    let notes = poll(
        "the Checkpoint to say why its container's GPUs cannot be told",
        WAIT,
        Duration::from_millis(200),
        warmstart_logs,
        || async {
            let notes = event_notes(&client, &ns, "Checkpoint", "gpu-void").await?;
            Ok(notes.iter().any(refused).then_some(notes))
        },
    )
    .await?;
    let mut on_pod = false;
    for p in pods.list(&kube::api::ListParams::default()).await? {
        if p.name_any().starts_with("gpu-void") || p.labels().values().any(|v| v == "gpu-void") {
            on_pod |= event_notes(&client, &ns, "Pod", &p.name_any())
                .await?
                .iter()
                .any(refused);
        }
    }
    ensure!(on_pod, "no pod of gpu-void says why: {notes:?}");
    ensure!(
        artifacts_of(&ns) == published,
        "nothing is published or left for the refused container: {:?} before, {:?} after",
        published,
        artifacts_of(&ns)
    );
    Ok(())
}

/// A pod that is no checkpoint source (no Checkpoint's Job owns it) writing `ready` into a
/// volume named like the signal volume, labelled with a real Checkpoint's hash, is ignored:
/// nothing is checkpointed, nothing written into its volume, no artifact appears beside the
/// real one.
async fn a_ready_file_in_a_pod_that_is_no_checkpoint_source_is_ignored(
    client: Client,
    ns: String,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let (ck, _) = make_ready_checkpoint(
        &client,
        &ns,
        "genuine",
        &worker_container(16, 300),
        &json!({}),
    )
    .await?;
    let hash = ck.status.unwrap().identity_hash.unwrap();
    // On node 1: its kubelet root is this machine's.
    let spoof: Pod = serde_json::from_value(real_kube::pinned(
        json!({
            "metadata": {"name": "spoof", "labels": {names::LABEL_CHECKPOINT_HASH: hash}},
            "spec": {"containers": [{"name": "main", "image": real_kube::WORKER_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", format!("touch {}; sleep 100000", names::ready_file_path())],
                "volumeMounts": [{"name": names::VOLUME_SIGNAL, "mountPath": names::MOUNT_SIGNAL}]}],
                "volumes": [{"name": names::VOLUME_SIGNAL, "emptyDir": {}}],
                "terminationGracePeriodSeconds": 1}
        }),
        real_kube::NODE,
    ))?;
    let spoof = pods.create(&PostParams::default(), &spoof).await?;
    let dir = Path::new("/var/lib/kubelet/pods")
        .join(spoof.uid().unwrap())
        .join("volumes/kubernetes.io~empty-dir")
        .join(names::VOLUME_SIGNAL);
    poll(
        "the spoofed ready file",
        WAIT,
        Duration::from_millis(50),
        warmstart_logs,
        || async { Ok(dir.join(names::FILE_READY).exists().then_some(())) },
    )
    .await?;
    let before = artifacts_of(&ns);
    // Several of the agent's resyncs later: nothing checkpointed, nothing written.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut entries: Vec<String> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    entries.sort();
    ensure!(
        entries == [names::FILE_READY],
        "{entries:?}\n{}",
        warmstart_logs()
    );
    ensure!(artifacts_of(&ns) == before);
    ensure!(before == [hash], "{before:?}");
    Ok(())
}

/// Waits until an agent journals an operation of `kind` (`checkpoint`, or the container name
/// of a restore) on its node, whichever: it is then in flight.
async fn operation_in_flight(kind: &str) -> Result<()> {
    let dirs: Vec<PathBuf> = real_kube::NODES
        .iter()
        .map(|node| real_kube::on_node(node, AGENT_STATE).join("journal"))
        .collect();
    let suffix = format!(".{kind}.json");
    poll(
        &format!("a journalled {kind} operation"),
        WAIT,
        Duration::from_millis(5),
        warmstart_logs,
        || async {
            let found = dirs.iter().any(|dir| {
                std::fs::read_dir(dir).ok().is_some_and(|entries| {
                    entries
                        .flatten()
                        .any(|e| e.file_name().to_string_lossy().ends_with(&suffix))
                })
            });
            Ok(found.then_some(()))
        },
    )
    .await
}

/// Deletes the agent's pod as an operator would (`kubectl delete pod`), without waiting; the
/// DaemonSet makes another.
fn delete_agent_pod() -> Result<()> {
    kubectl(&[
        "-n",
        SYSTEM_NAMESPACE,
        "delete",
        "pod",
        "-l",
        real_kube::AGENT_SELECTOR,
        "--wait=false",
    ])?;
    Ok(())
}

/// The agent's pod deleted while it dumps a Checkpoint's pod: the DaemonSet brings it back and
/// the Checkpoint still ends Ready, with one complete artifact and nothing half-written beside
/// it; the checkpointed workload is not left frozen (its Job's pod ends).
async fn the_agent_pod_deleted_mid_checkpoint_loses_nothing(
    client: Client,
    ns: String,
) -> Result<()> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(256, 300);
    create_checkpoint(
        &checkpoints,
        &checkpoint("interrupted", &worker, &json!({}))?,
    )
    .await?;
    operation_in_flight("checkpoint").await?;
    delete_agent_pod()?;
    let ready = checkpoint_ready(&checkpoints, "interrupted").await?;
    real_kube::rolled_out()?;
    read_published(&artifact_dir(&ready), Verification::Checksums)?;
    let hash = ready
        .status
        .as_ref()
        .unwrap()
        .identity_hash
        .clone()
        .unwrap();
    let beside = artifacts_of(&ns);
    ensure!(
        beside == [hash],
        "one artifact and nothing else: {beside:?}"
    );
    // Nothing left frozen: the Job's pods all end (the Job completes or is cleaned up).
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    poll(
        "the checkpoint Job's pods to end",
        WAIT,
        Duration::from_millis(200),
        warmstart_logs,
        || async {
            let running: Vec<String> = pods
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.phase.as_deref())
                        .is_some_and(|ph| ph == "Running" || ph == "Pending")
                })
                .map(|p| p.name_any())
                .collect();
            Ok(running.is_empty().then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// The agent's pod deleted while it restores into a replica: the replica ends Ready with
/// exactly one worker, restored (the next agent recognised the finished restore) or
/// cold-started (it reported the interrupted one as failed); never two.
async fn the_agent_pod_deleted_mid_restore_restores_at_most_once(
    client: Client,
    ns: String,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(256, 300);
    make_ready_checkpoint(&client, &ns, "kill-restore", &worker, &json!({})).await?;
    pods.create(
        &PostParams::default(),
        &pod("replica", Some("kill-restore"), &worker)?,
    )
    .await?;
    operation_in_flight("main").await?;
    delete_agent_pod()?;
    let replica = pod_ready(&pods, "replica", true).await?;
    real_kube::rolled_out()?;
    let outcome = poll(
        "a final restore status",
        WAIT,
        Duration::from_millis(100),
        warmstart_logs,
        || async {
            let p = pods.get("replica").await?;
            Ok(restore_status(&p)
                .filter(|s| matches!(*s, "completed" | "failed"))
                .map(str::to_owned))
        },
    )
    .await?;
    eprintln!("restore interrupted by the agent pod's deletion ended {outcome}");
    let state = worker_state(&replica)?;
    ensure!(
        state["restored"] == (outcome == "completed"),
        "{outcome}: {state}"
    );
    // Restored: the standby worker supervising its one restored copy; failed: the standby
    // worker cold-started itself. Never a second restored copy, not even after later resyncs.
    let expected = if outcome == "completed" { 2 } else { 1 };
    let workers = processes_running(&ns, "replica", WORKER_IN_IMAGE)?;
    ensure!(workers == expected, "{outcome}: {workers} workers");
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(processes_running(&ns, "replica", WORKER_IN_IMAGE)? == expected);
    Ok(())
}

/// The controller replica holding the leader Lease deleted while a Checkpoint is `Creating`:
/// the next leader (the other replica) finishes it.
async fn the_controller_leader_deleted_while_creating_the_next_leader_finishes(
    client: Client,
    ns: String,
) -> Result<()> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    // A long warm-up keeps the Checkpoint Creating while the leader goes.
    let worker = worker_container(16, 8000);
    create_checkpoint(&checkpoints, &checkpoint("handover", &worker, &json!({}))?).await?;
    poll(
        "the Checkpoint to be Creating",
        WAIT,
        Duration::from_millis(50),
        warmstart_logs,
        || async {
            let ck = checkpoints.get("handover").await?;
            let phase = ck.status.and_then(|s| s.phase);
            if phase == Some(CheckpointPhase::Ready) {
                bail!("Ready before the leader could be deleted: lengthen the warm-up");
            }
            Ok((phase == Some(CheckpointPhase::Creating)).then_some(()))
        },
    )
    .await?;
    let holder = |lease: Lease| lease.spec.and_then(|s| s.holder_identity);
    let leader = holder(leases.get("warmstart-controller").await?)
        .context("the controller's Lease has no holder")?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    pods.delete(&leader, &DeleteParams::default())
        .await
        .with_context(|| format!("delete the leader's pod {leader}"))?;
    let ready = checkpoint_ready(&checkpoints, "handover").await?;
    let next = holder(leases.get("warmstart-controller").await?).unwrap_or_default();
    ensure!(next != leader, "the deleted {leader} still leads");
    ensure!(
        ready.status.as_ref().unwrap().phase == Some(CheckpointPhase::Ready),
        "{:?}",
        ready.status
    );
    real_kube::rolled_out()?;
    Ok(())
}

/// The node's `WarmstartAgentReady` condition: status, reason and message.
async fn agent_condition(client: &Client, node: &str) -> Result<Option<(String, String, String)>> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let node = nodes.get(node).await?;
    Ok(node
        .status
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "WarmstartAgentReady")
        .map(|c| {
            (
                c.status,
                c.reason.unwrap_or_default(),
                c.message.unwrap_or_default(),
            )
        }))
}

async fn node_labelled(client: &Client, node: &str) -> Result<bool> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    Ok(nodes
        .get(node)
        .await?
        .labels()
        .contains_key(names::LABEL_AGENT_READY))
}

/// The agents pointed at a CRI socket that does not exist (as after a runtime moved its socket):
/// their preflight fails, so each takes the `agent-ready` label off its node, says why in the
/// Node's `WarmstartAgentReady` condition and an Event, and its pod is not Ready. A Checkpoint
/// made meanwhile is not sent anywhere: its Job's pod waits unscheduled and the Checkpoint says
/// so with the scheduler's words. Pointed back, the agents label their nodes again and the
/// Checkpoint becomes Ready.
async fn an_agent_that_cannot_reach_its_runtime_unlabels_its_node_and_says_why(
    client: Client,
    ns: String,
) -> Result<()> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let socket = "/var/lib/warmstart-cluster/containerd/containerd.sock";
    let set_socket = |path: &str| {
        kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "set",
            "env",
            "daemonset/warmstart-agent",
            &format!("WARMSTART_CRI_SOCKET={path}"),
        ])
    };
    for node in real_kube::NODES {
        ensure!(
            node_labelled(&client, node).await?,
            "node {node} is not labelled to begin with"
        );
    }
    set_socket("/var/lib/warmstart-cluster/containerd/moved.sock")?;
    let refused = async {
        // A DaemonSet rolls one node at a time and stops at the first agent that does not become
        // Ready: both nodes' agents are restarted onto the setting at once, as an operator would.
        delete_agent_pod()?;
        let message = poll(
            "the node to lose its label and say why",
            WAIT,
            Duration::from_millis(200),
            warmstart_logs,
            || async {
                let mut said = None;
                for node in real_kube::NODES {
                    let condition = agent_condition(&client, node).await?;
                    let labelled = node_labelled(&client, node).await?;
                    // (The agent the rollout replaces says AgentStopped on its way out.)
                    match condition {
                        Some((status, reason, message))
                            if status == "False" && reason == "PreflightFailed" && !labelled =>
                        {
                            said = Some(message);
                        }
                        _ => return Ok(None),
                    }
                }
                Ok(said)
            },
        )
        .await?;
        ensure!(
            message.contains("cri socket") && message.contains("moved.sock"),
            "{message}"
        );
        let events = event_notes(&client, "default", "Node", real_kube::NODE).await?;
        ensure!(
            events
                .iter()
                .any(|e| e.starts_with("WarmstartAgentNotReady: ") && e.contains("moved.sock")),
            "{events:?}"
        );
        let agents = real_kube::agent_pods(&client).await?;
        ensure!(
            agents.iter().all(|p| !real_kube::is_ready(p)),
            "an agent that cannot serve reports Ready"
        );
        let worker = worker_container(16, 300);
        create_checkpoint(&checkpoints, &checkpoint("waits", &worker, &json!({}))?).await?;
        let condition = poll(
            "the Checkpoint to say that its Job's pod cannot be scheduled",
            WAIT,
            Duration::from_millis(200),
            warmstart_logs,
            || async {
                let ck = checkpoints.get("waits").await?;
                Ok(ck.status.and_then(|s| {
                    s.conditions
                        .into_iter()
                        .find(|c| c.type_ == "Ready" && c.reason == "JobPodUnschedulable")
                }))
            },
        )
        .await?;
        ensure!(
            condition.message.contains("node affinity"),
            "the scheduler's words: {}",
            condition.message
        );
        anyhow::Ok(())
    }
    .await;
    // Pointed back whatever happened, so that the tests after this one find a ready node.
    set_socket(socket)?;
    real_kube::rolled_out()?;
    refused?;
    for node in real_kube::NODES {
        poll(
            &format!("node {node} to be labelled again"),
            WAIT,
            Duration::from_millis(200),
            warmstart_logs,
            || async {
                let ready = agent_condition(&client, node)
                    .await?
                    .is_some_and(|(status, _, _)| status == "True");
                Ok((ready && node_labelled(&client, node).await?).then_some(()))
            },
        )
        .await?;
        // Ready again, with every item answering: the kubelet's PodResources API too, through
        // the mounted kubelet root (no requirement, so it would be named as not working if it
        // failed): node 2's agent reaches node 2's kubelet.
        let (_, _, message) = agent_condition(&client, node).await?.unwrap_or_default();
        ensure!(
            message.contains("pod resources") && !message.contains("not working"),
            "node {node}'s condition does not show the kubelet's PodResources API answering: {message}"
        );
    }
    checkpoint_ready(&checkpoints, "waits").await?;
    Ok(())
}

/// A namespace deleted with a `Ready` Checkpoint in it (`deletionPolicy: Delete`, the default):
/// the Checkpoint goes, its artifact stays, since nobody deleted it on purpose. The namespace
/// made again and the same Checkpoint with it: it adopts the verified artifact (no Job runs)
/// and a pod restores from it.
async fn a_deleted_namespace_keeps_its_artifacts_for_a_checkpoint_to_adopt(
    client: Client,
    ns: String,
) -> Result<()> {
    let name = format!("{ns}-again");
    let worker = worker_container(16, 300);
    let first = TestNamespace::named(&client, &name).await?;
    let (before, _) = make_ready_checkpoint(&client, &name, "adopt", &worker, &json!({})).await?;
    let artifact = artifact_dir(&before);
    drop(first);
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    ensure!(
        namespaces.get_opt(&name).await?.is_none(),
        "namespace {name} is still there"
    );
    read_published(&artifact, Verification::Checksums)
        .with_context(|| format!("the namespace's deletion took {}", artifact.display()))?;

    let _again = TestNamespace::named(&client, &name).await?;
    let (adopted, took) =
        make_ready_checkpoint(&client, &name, "adopt", &worker, &json!({})).await?;
    let status = adopted.status.as_ref().unwrap();
    ensure!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("adopted")),
        "{status:?}"
    );
    ensure!(
        status.artifact == before.status.as_ref().unwrap().artifact,
        "{status:?}"
    );
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(client.clone(), &name);
    ensure!(
        jobs.list(&Default::default()).await?.items.is_empty(),
        "a checkpoint Job ran for an adopted artifact"
    );
    eprintln!("adopted in {:.2}s", took.as_secs_f64());
    let pods: Api<Pod> = Api::namespaced(client.clone(), &name);
    pods.create(
        &PostParams::default(),
        &pod("from-adopted", Some("adopt"), &worker)?,
    )
    .await?;
    let restored = pod_ready(&pods, "from-adopted", false).await?;
    ensure!(worker_state(&restored)?["restored"] == true);
    Ok(())
}

/// What an uninstall (`what`) must leave: the node without the agent's label (the agent took it
/// off on its way out, so nothing attracts checkpoint Jobs), and the Checkpoint `before` still
/// there, the same object, `Ready`, its artifact intact.
async fn left_as_it_was(client: &Client, before: &Checkpoint, what: &str) -> Result<()> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for name in real_kube::NODES {
        let node = nodes.get(name).await?;
        ensure!(
            !node.labels().contains_key(names::LABEL_AGENT_READY),
            "node {name} keeps {} after {what}: {:?}",
            names::LABEL_AGENT_READY,
            node.labels()
        );
    }
    let checkpoints: Api<Checkpoint> =
        Api::namespaced(client.clone(), &before.namespace().unwrap_or_default());
    let after = checkpoints
        .get_opt(&before.name_any())
        .await?
        .with_context(|| format!("{what} deleted the Checkpoint"))?;
    ensure!(after.uid() == before.uid(), "the Checkpoint was made again");
    ensure!(after.status.as_ref().unwrap().phase == Some(CheckpointPhase::Ready));
    let artifact = artifact_dir(before);
    read_published(&artifact, Verification::Checksums)
        .with_context(|| format!("{what} touched the artifact {}", artifact.display()))?;
    Ok(())
}

/// Uninstalled as the README says (the workloads, then `kubectl delete -k` of the install), then
/// installed again: the agent unlabelled its node on its way out, the Checkpoint made before is
/// still there and `Ready`, its artifact intact, and a pod restores from it.
async fn an_uninstall_and_reinstall_keep_every_checkpoint(
    client: Client,
    ns: String,
) -> Result<()> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(16, 300);
    let (before, _) = make_ready_checkpoint(&client, &ns, "kept", &worker, &json!({})).await?;

    let uninstalled = async {
        real_kube::uninstall()?;
        left_as_it_was(&client, &before, "the uninstall").await
    }
    .await;
    // Installed again whatever happened, so that the tests after this one find warmstart.
    let installed = real_kube::install();
    uninstalled?;
    installed?;
    let ready = checkpoint_ready(&checkpoints, "kept").await?;
    ensure!(
        ready.status == before.status,
        "{:?}\n{:?}",
        ready.status,
        before.status
    );
    // The webhook answers once a controller replica is Ready again; until then pod creation
    // is refused (it fails closed).
    real_kube::create_admitted(&pods, &pod("after-reinstall", Some("kept"), &worker)?).await?;
    let restored = pod_ready(&pods, "after-reinstall", false).await?;
    ensure!(restore_status(&restored) == Some("completed"));
    ensure!(worker_state(&restored)?["restored"] == true);
    Ok(())
}

/// The agent pods that are not on their way out.
async fn live_agent_pods(client: &Client) -> Result<Vec<Pod>> {
    Ok(real_kube::agent_pods(client)
        .await?
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

/// warmstart installed with its Helm chart instead of kustomize (`helm install -f
/// e2e/cluster/helm-values.yaml`, the overlay's changes as values), upgraded and uninstalled: a
/// Checkpoint made under the kustomize install restores under the chart's; an upgrade that
/// changes the agent's settings rolls the agent onto them and restores still work; `helm
/// uninstall` removes warmstart, its node label included, and keeps the CRD, the Checkpoint, its
/// artifact and the claim.
async fn the_helm_chart_installs_upgrades_and_uninstalls_keeping_every_checkpoint(
    client: Client,
    ns: String,
) -> Result<()> {
    use real_kube::{HELM_RELEASE, HELM_VALUES, helm};
    const CHART: &str = warmstart_e2e::manifests::CHART;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(16, 300);
    let (before, _) = make_ready_checkpoint(&client, &ns, "charted", &worker, &json!({})).await?;
    let timeout = format!("{}s", WAIT.as_secs());
    let uninstall = || {
        helm(&[
            "uninstall",
            HELM_RELEASE,
            "--namespace",
            SYSTEM_NAMESPACE,
            "--wait",
            "--timeout",
            &timeout,
        ])
    };
    let install = [
        "--namespace",
        SYSTEM_NAMESPACE,
        "-f",
        HELM_VALUES,
        "--wait",
        "--timeout",
        &timeout,
    ];

    let charted = async {
        real_kube::uninstall()?;
        let started = Instant::now();
        helm(&[&["install", HELM_RELEASE, CHART][..], &install].concat())?;
        real_kube::rolled_out()?;
        eprintln!("helm install: {:.1}s", started.elapsed().as_secs_f64());
        real_kube::create_admitted(&pods, &pod("under-helm", Some("charted"), &worker)?).await?;
        let restored = pod_ready(&pods, "under-helm", false).await?;
        ensure!(restore_status(&restored) == Some("completed"));
        ensure!(worker_state(&restored)?["restored"] == true);

        // An upgrade that changes the agent's settings rolls its pods onto them.
        helm(
            &[
                &["upgrade", HELM_RELEASE, CHART][..],
                &install,
                &[
                    "--set",
                    "agent.extraEnv[0].name=WARMSTART_MAX_RESTORES",
                    "--set-string",
                    "agent.extraEnv[0].value=2",
                ],
            ]
            .concat(),
        )?;
        real_kube::rolled_out()?;
        let agents = poll(
            "the agent rolled onto the upgrade",
            WAIT,
            Duration::from_millis(500),
            warmstart_logs,
            || async {
                let agents = live_agent_pods(&client).await?;
                let upgraded = agents.iter().all(|p| {
                    p.spec.as_ref().unwrap().containers[0]
                        .env
                        .iter()
                        .flatten()
                        .any(|e| {
                            e.name == "WARMSTART_MAX_RESTORES" && e.value.as_deref() == Some("2")
                        })
                });
                Ok(
                    (upgraded && !agents.is_empty() && agents.iter().all(real_kube::is_ready))
                        .then_some(agents),
                )
            },
        )
        .await?;
        ensure!(
            agents.len() == real_kube::NODES.len(),
            "{} agent pods on {} nodes",
            agents.len(),
            real_kube::NODES.len()
        );
        real_kube::create_admitted(&pods, &pod("after-upgrade", Some("charted"), &worker)?).await?;
        let restored = pod_ready(&pods, "after-upgrade", false).await?;
        ensure!(restore_status(&restored) == Some("completed"));

        // Alone: the chart's pre-delete hook stops the agent and the controller first, so the
        // agent unlabels its node on its way out while its RBAC exists.
        uninstall()?;
        let left = kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "get",
            "daemonsets,deployments,pods",
            "-l",
            "app.kubernetes.io/part-of=warmstart",
            "-o",
            "name",
        ])?;
        ensure!(left.trim().is_empty(), "left after helm uninstall: {left}");
        // What the chart never deletes: the CRD (crds/), the claim (existing) and with them
        // every Checkpoint and artifact.
        kubectl(&["get", "crd", "checkpoints.warmstart.dev"])
            .context("helm uninstall deleted the CRD")?;
        kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "get",
            "pvc",
            "warmstart-checkpoints",
        ])
        .context("helm uninstall deleted the artifact claim")?;
        left_as_it_was(&client, &before, "helm uninstall").await
    }
    .await;
    // Back to the kustomize install whatever happened, for the tests after this one.
    if real_kube::helm_installed() {
        let _ = uninstall();
    }
    let installed = real_kube::install();
    charted?;
    installed?;
    Ok(())
}

/// Least privilege, from the API server's audit log: every request the controller's and the
/// agent's ServiceAccounts made since this test binary started was allowed (no `forbid`
/// decision, no 403), and each made some.
async fn every_request_of_warmstart_was_allowed_by_its_rbac(
    _client: Client,
    _ns: String,
) -> Result<()> {
    let since = *STARTED.get().unwrap();
    let mut made: std::collections::BTreeMap<&str, BTreeSet<String>> = Default::default();
    let mut refused = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(Path::new(AUDIT_LOG).parent().unwrap())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("audit"))
        })
        .collect();
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file)?;
        for line in text.lines() {
            let Ok(event) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let Some(user) = event["user"]["username"].as_str() else {
                continue;
            };
            let sa = match user {
                "system:serviceaccount:warmstart-system:warmstart-controller" => "controller",
                "system:serviceaccount:warmstart-system:warmstart-agent" => "agent",
                _ => continue,
            };
            let at = event["requestReceivedTimestamp"]
                .as_str()
                .unwrap_or_default();
            let Ok(at) = at.parse::<jiff::Timestamp>() else {
                continue;
            };
            if SystemTime::from(at) < since {
                continue;
            }
            let object = &event["objectRef"];
            let what = format!(
                "{} {}/{}/{}",
                event["verb"].as_str().unwrap_or_default(),
                object["apiGroup"].as_str().unwrap_or_default(),
                object["resource"].as_str().unwrap_or_default(),
                object["subresource"].as_str().unwrap_or_default()
            );
            let decision = event["annotations"]["authorization.k8s.io/decision"]
                .as_str()
                .unwrap_or_default();
            // A namespace being deleted refuses new objects at admission (NamespaceLifecycle),
            // whoever asks: that is no question of privilege.
            let terminating = event["responseStatus"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("because it is being terminated"));
            if decision == "forbid" || (event["responseStatus"]["code"] == 403 && !terminating) {
                refused.push(format!(
                    "{sa}: {what} {} ({})",
                    object["name"].as_str().unwrap_or_default(),
                    event["annotations"]["authorization.k8s.io/reason"]
                ));
            }
            made.entry(sa).or_default().insert(what);
        }
    }
    for sa in ["controller", "agent"] {
        let requests = made.get(sa).map(BTreeSet::len).unwrap_or(0);
        ensure!(requests > 0, "no request of the {sa} in {AUDIT_LOG}");
        eprintln!("{sa} made: {:#?}", made[sa]);
    }
    ensure!(
        refused.is_empty(),
        "requests that deploy/rbac does not allow:\n{}",
        refused.join("\n")
    );
    Ok(())
}

/// A Checkpoint of a worker held to `node` (its Job's pod template's node selector): Ready,
/// and the node its Job's pod ran on, as the scheduler placed it.
async fn checkpoint_on_node(
    client: &Client,
    ns: &str,
    name: &str,
    container: &Value,
    node: &str,
) -> Result<(Checkpoint, String)> {
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), ns);
    let template = real_kube::pinned(json!({"spec": {"containers": [container]}}), node);
    let mut ck = serde_json::to_value(checkpoint(name, container, &json!({}))?)?;
    ck["spec"]["job"]["podTemplateSpec"] = template;
    create_checkpoint(&checkpoints, &serde_json::from_value(ck)?).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = format!("job-name={}", names::job_name(name));
    let ran_on = poll(
        &format!("the pod of Checkpoint {name}'s Job to be scheduled"),
        WAIT,
        Duration::from_millis(50),
        warmstart_logs,
        || async {
            Ok(pods
                .list(&kube::api::ListParams::default().labels(&selector))
                .await?
                .items
                .into_iter()
                .find_map(|p| p.spec.and_then(|s| s.node_name)))
        },
    )
    .await?;
    Ok((checkpoint_ready(&checkpoints, name).await?, ran_on))
}

/// The cgroup lines (every hierarchy) of the processes of `pod` on this machine.
fn pod_cgroups(pod: &Pod) -> Vec<String> {
    let uid = pod.uid().unwrap_or_default();
    let underscored = uid.replace('-', "_");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cgroup) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        found.extend(
            cgroup
                .lines()
                .filter(|l| {
                    l.contains(&format!("pod{uid}")) || l.contains(&format!("pod{underscored}"))
                })
                .map(str::to_owned),
        );
    }
    found
}

/// Pod `name` restoring Checkpoint `checkpoint`, held to node 2, Ready and restored: the
/// process the checkpoint Job's pod ran, in node 2's pod (its cgroups are node 2's kubelet's).
async fn restored_on_node2(
    pods: &Api<Pod>,
    name: &str,
    checkpoint: &str,
    worker: &Value,
) -> Result<Pod> {
    let restore = real_kube::pinned(
        serde_json::to_value(pod(name, Some(checkpoint), worker)?)?,
        real_kube::NODE2,
    );
    real_kube::create_admitted(pods, &serde_json::from_value(restore)?).await?;
    let restored = pod_ready(pods, name, false).await?;
    let on = restored
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    ensure!(on == real_kube::NODE2, "{name} ran on {on}");
    ensure!(
        restore_status(&restored) == Some("completed"),
        "{:?}",
        restored.annotations()
    );
    let state = worker_state(&restored)?;
    ensure!(state["restored"] == true, "{state}");
    ensure!(
        state["hostname"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&format!("checkpoint-{checkpoint}-")),
        "the process of the checkpoint Job's pod serves, not a fresh one: {state}"
    );
    ensure!(state["requests"].as_u64() >= Some(1), "{state}");
    let cgroups = pod_cgroups(&restored);
    ensure!(
        !cgroups.is_empty()
            && cgroups
                .iter()
                .all(|c| c.contains("/warmstart-cluster/node-2/")),
        "{name}'s processes are not (all) in node 2's pod cgroups: {cgroups:?}"
    );
    Ok(restored)
}

/// A Checkpoint whose source pod runs on node 1 is restored into a pod held to node 2, through
/// the shared artifact volume: node 2's agent restores the process node 1's agent dumped, into
/// node 2's pod, serving the checkpointed state.
async fn a_checkpoint_made_on_one_node_restores_on_the_other_through_the_artifact_volume(
    client: Client,
    ns: String,
) -> Result<()> {
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(32, 300);
    let (ck, ran_on) =
        checkpoint_on_node(&client, &ns, "crossing", &worker, real_kube::NODE).await?;
    ensure!(
        ran_on == real_kube::NODE,
        "the checkpoint Job's pod ran on {ran_on}"
    );
    read_published(&artifact_dir(&ck), Verification::Checksums)?;
    let restored = restored_on_node2(&pods, "on-node-2", "crossing", &worker).await?;
    ensure!(events_with_reason(&client, &ns, "on-node-2", "Restored").await? == 1);
    let state = worker_state(&restored)?;
    ensure!(state["weightsMib"] == 32, "{state}");
    eprintln!(
        "checkpoint on {ran_on}, restore on {}: {:.1}s",
        real_kube::NODE2,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The credentials Secret of the object store install.
const S3_SECRET: &str = "warmstart-object-store-credentials";

/// warmstart installed with the object store (Helm: `objectStore`, the credentials in a Secret,
/// `agent.cache`) against a real SeaweedFS this test starts on the cluster's bridge address
/// (pods reach only 198.18.0.0/15): a Checkpoint whose source pod runs on node 1 is uploaded by
/// node 1's agent (complete in the bucket when Ready); with the artifact volume's copy deleted,
/// a pod held to node 2 restores it, fetched into node 2's own cache (its agent counts the
/// fetch), serving the checkpointed state; a second pod there restores from that cache (a hit,
/// no second fetch). Afterwards warmstart is installed again as before
/// (kustomize, no object store), whatever happened.
async fn a_checkpoint_made_on_one_node_restores_on_the_other_through_the_object_store(
    client: Client,
    ns: String,
) -> Result<()> {
    use real_kube::{HELM_RELEASE, HELM_VALUES, NODE_CACHE, NODE2, helm, on_node};
    const CHART: &str = warmstart_e2e::manifests::CHART;
    let started = Instant::now();
    let bridge = std::net::IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 0, 1));
    let server = warmstart_e2e::s3_server::S3Server::start_on("warmstart", bridge)?;
    let store = warmstart_objstore::Store::new(server.store_config())?;
    let timeout = format!("{}s", WAIT.as_secs());
    let endpoint = format!("objectStore.endpoint={}", server.endpoint());
    let bucket = format!("objectStore.bucket={}", server.bucket());
    let prefix = format!("objectStore.prefix={}", server.store_config().prefix);
    let secret = format!("objectStore.credentials.existingSecret={S3_SECRET}");
    let cache = format!("agent.cache.hostPath={NODE_CACHE}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let worker = worker_container(32, 300);

    let crossed = async {
        real_kube::uninstall()?;
        kubectl(&[
            "-n",
            SYSTEM_NAMESPACE,
            "create",
            "secret",
            "generic",
            S3_SECRET,
            &format!(
                "--from-file=accessKeyId={}",
                server.access_key_file().display()
            ),
            &format!(
                "--from-file=secretAccessKey={}",
                server.secret_key_file().display()
            ),
        ])?;
        helm(&[
            "install",
            HELM_RELEASE,
            CHART,
            "--namespace",
            SYSTEM_NAMESPACE,
            "-f",
            HELM_VALUES,
            "--set",
            &endpoint,
            "--set",
            &bucket,
            "--set",
            &prefix,
            "--set",
            &secret,
            "--set",
            "agent.cache.enabled=true",
            "--set",
            &cache,
            "--set",
            "agent.cache.maxGiB=4",
            "--wait",
            "--timeout",
            &timeout,
        ])?;
        real_kube::rolled_out()?;
        eprintln!(
            "installed with the object store: {:.1}s",
            started.elapsed().as_secs_f64()
        );

        let (ck, ran_on) =
            checkpoint_on_node(&client, &ns, "stored", &worker, real_kube::NODE).await?;
        ensure!(
            ran_on == real_kube::NODE,
            "the checkpoint Job's pod ran on {ran_on}"
        );
        let manifest = read_published(&artifact_dir(&ck), Verification::Checksums)?;
        // In the bucket, complete, once Ready.
        let stored = store.verify(&ns, &manifest.identity_hash).await?;
        ensure!(
            stored.digest == manifest.digest,
            "{} != {}",
            stored.digest,
            manifest.digest
        );
        // The volume's copy gone: node 2 can get it only from the bucket.
        std::fs::remove_dir_all(artifact_dir(&ck))?;
        let fetched = "warmstart_agent_cache_reads_total{result=\"fetched\"}";
        let before = agent_metric(&agent_on(&client, NODE2).await?, fetched)?;
        restored_on_node2(&pods, "from-bucket", "stored", &worker).await?;
        let cached = on_node(NODE2, NODE_CACHE)
            .join(&ns)
            .join(&manifest.identity_hash);
        let in_cache = read_published(&cached, Verification::Checksums)
            .with_context(|| format!("node 2's cache {}", cached.display()))?;
        ensure!(in_cache.digest == manifest.digest);
        let after = agent_metric(&agent_on(&client, NODE2).await?, fetched)?;
        ensure!(
            after == before + 1,
            "node 2's agent counted {before} fetches, then {after}"
        );
        // The next restore there reads node 2's disk: a cache hit, nothing fetched again.
        let hit = "warmstart_agent_cache_reads_total{result=\"hit\"}";
        let hits = agent_metric(&agent_on(&client, NODE2).await?, hit)?;
        restored_on_node2(&pods, "from-node-cache", "stored", &worker).await?;
        let agent = agent_on(&client, NODE2).await?;
        let (hits_after, fetched_after) = (agent_metric(&agent, hit)?, agent_metric(&agent, fetched)?);
        ensure!(
            hits_after == hits + 1 && fetched_after == after,
            "the second restore on node 2: hits {hits} -> {hits_after}, fetches {after} -> {fetched_after}"
        );
        // The controller verified the bucket's copy.
        let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), &ns);
        let ready = checkpoints.get("stored").await?;
        let storage = ready.status.as_ref().and_then(|s| s.storage_type.clone());
        ensure!(storage.as_deref() == Some("s3"), "storageType {storage:?}");
        // Pre-staging onto node 1 (which made the checkpoint but never restored it): its agent
        // fetches the artifact from the bucket into node 1's cache with no restore asking, and
        // says so in its own entry; node 2, not selected, writes none.
        checkpoints
            .patch(
                "stored",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"prestage": {"nodeSelector":
                    {"kubernetes.io/hostname": real_kube::NODE}}}})),
            )
            .await?;
        let entries = poll(
            "node 1's pre-staging",
            WAIT,
            Duration::from_millis(500),
            warmstart_logs,
            || async {
                let ck = checkpoints.get("stored").await?;
                let entries = ck.status.map(|s| s.prestage).unwrap_or_default();
                Ok(entries
                    .iter()
                    .any(|e| e.state == warmstart_shared::PrestageState::Warmed)
                    .then_some(entries))
            },
        )
        .await?;
        ensure!(
            entries.len() == 1
                && entries[0].node == real_kube::NODE
                && entries[0].manifest_digest == manifest.digest,
            "{entries:?}"
        );
        let warmed = on_node(real_kube::NODE, NODE_CACHE)
            .join(&ns)
            .join(&manifest.identity_hash);
        let in_cache = read_published(&warmed, Verification::Checksums)
            .with_context(|| format!("node 1's cache {}", warmed.display()))?;
        ensure!(in_cache.digest == manifest.digest);
        let prestaged = agent_metric(
            &agent_on(&client, real_kube::NODE).await?,
            "warmstart_agent_prestages_total{result=\"fetched\"}",
        )?;
        ensure!(prestaged == 1, "node 1's agent counted {prestaged} pre-stagings");
        let logs = warmstart_logs();
        ensure!(!logs.contains(server.secret()), "the secret is logged");
        anyhow::Ok(())
    }
    .await;
    // Back to the install the other tests expect, whatever happened.
    if real_kube::helm_installed() {
        let _ = helm(&[
            "uninstall",
            HELM_RELEASE,
            "--namespace",
            SYSTEM_NAMESPACE,
            "--wait",
            "--timeout",
            &timeout,
        ]);
    }
    let _ = kubectl(&[
        "-n",
        SYSTEM_NAMESPACE,
        "delete",
        "secret",
        S3_SECRET,
        "--ignore-not-found",
    ]);
    let installed = real_kube::install();
    for node in real_kube::NODES {
        let _ = std::fs::remove_dir_all(on_node(node, NODE_CACHE).join(&ns));
    }
    if crossed.is_err() {
        eprintln!("SeaweedFS log:\n{}", server.log_tail());
    }
    drop(server);
    crossed?;
    installed?;
    eprintln!(
        "object store install, checkpoint on node 1, restore on node 2, reinstall: {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
