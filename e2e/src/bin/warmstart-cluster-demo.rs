//! `make cluster-demo`: the whole loop on this machine (as root, after `make setup`). Starts the
//! local cluster (API server double, simulated node, Job controller, `warmstart-controller
//! run`, `warmstart-agent run`), checkpoints the sample worker through a Checkpoint, prints the
//! Checkpoint as `kubectl get` shows it, then creates a restore pod and, after it, a cold start
//! of the same pod, and prints both timelines side by side: created → container running →
//! restore started → restore complete → Ready. The node runs pods through a containerd of its
//! own over CRI (`WARMSTART_NODE_RUNTIME=containerd`, the default, as kubelet does) or as runc
//! containers of its own (`runc`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::PostParams;
use serde_json::{Value, json};
use warmstart_e2e::local_cluster::{self, LocalCluster, NAMESPACE, NodeRuntime, WAIT, is_ready};
use warmstart_shared::names;

const WEIGHTS_MIB: u32 = 512;
const WARMUP_MS: u32 = 3000;
const CHECKPOINT: &str = "sample-worker";

/// When each step of a pod's start was first seen, from its creation.
#[derive(Debug, Default)]
struct Timeline {
    running: Option<Duration>,
    restore_started: Option<Duration>,
    restore_complete: Option<Duration>,
    ready: Option<Duration>,
}

impl Timeline {
    fn observe(&mut self, pod: &Pod, at: Duration) {
        let running = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            });
        if running {
            self.running.get_or_insert(at);
        }
        match pod
            .annotations()
            .get(&names::restore_status_annotation("main"))
            .map(String::as_str)
        {
            Some("in_progress") => {
                self.restore_started.get_or_insert(at);
            }
            Some("completed") => {
                self.restore_started.get_or_insert(at);
                self.restore_complete.get_or_insert(at);
            }
            _ => {}
        }
        if is_ready(pod) {
            self.ready.get_or_insert(at);
        }
    }
}

/// Creates `pod` and follows it until Ready; its timeline.
async fn follow(cluster: &LocalCluster, pod: Pod) -> Result<Timeline> {
    let name = pod.name_any();
    let pods = cluster.pods();
    let created = Instant::now();
    pods.create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("create pod {name}"))?;
    let mut timeline = Timeline::default();
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(p) = pods.get(&name).await {
            timeline.observe(&p, created.elapsed());
        }
        if timeline.ready.is_some() {
            return Ok(timeline);
        }
        ensure!(
            Instant::now() < deadline,
            "pod {name} did not become Ready within {WAIT:?}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn cell(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()))
}

fn state_of(cluster: &LocalCluster, pod: &str) -> Result<Value> {
    cluster
        .worker_state(pod)
        .with_context(|| format!("pod {pod} does not answer GET /state"))
}

async fn run(cluster: &LocalCluster, runtime: NodeRuntime) -> Result<()> {
    let worker = local_cluster::worker_container(WEIGHTS_MIB, WARMUP_MS);
    println!(
        "Checkpoint {CHECKPOINT}: sample worker with {WEIGHTS_MIB} MiB of weights and {WARMUP_MS} ms of warm-up"
    );
    let (_, took) = cluster.checkpoint(CHECKPOINT, &worker, &json!({})).await?;
    println!(
        "created → Ready in {:.2} s (checkpoint Job ran, agent captured it)\n",
        took.as_secs_f64()
    );
    print!(
        "{}",
        cluster
            .kubectl(&["get", "checkpoint", CHECKPOINT, "-n", NAMESPACE])
            .await?
    );
    println!();

    let restored = follow(
        cluster,
        LocalCluster::pod("replica-restored", Some(CHECKPOINT), &worker)?,
    )
    .await?;
    let cold = follow(cluster, LocalCluster::pod("replica-cold", None, &worker)?).await?;

    println!("{:<20}{:>18}{:>18}", "", "restore pod", "cold start");
    println!(
        "{:<20}{:>18}{:>18}",
        "created",
        cell(Some(Duration::ZERO)),
        cell(Some(Duration::ZERO))
    );
    for (step, r, c) in [
        ("container running", restored.running, cold.running),
        (
            "restore started",
            restored.restore_started,
            cold.restore_started,
        ),
        (
            "restore complete",
            restored.restore_complete,
            cold.restore_complete,
        ),
        ("Ready", restored.ready, cold.ready),
    ] {
        println!("{step:<20}{:>18}{:>18}", cell(r), cell(c));
    }
    let a = state_of(cluster, "replica-restored")?;
    let b = state_of(cluster, "replica-cold")?;
    println!(
        "\nreplica-restored: restored={} weights checksum {}; replica-cold: restored={} weights checksum {}",
        a["restored"], a["weightsSha256"], b["restored"], b["weightsSha256"]
    );
    ensure!(
        a["restored"] == json!(true),
        "the restore pod was not restored: {a}"
    );
    ensure!(
        b["restored"] == json!(false),
        "the cold start claims to be restored: {b}"
    );
    if runtime == NodeRuntime::Containerd {
        println!("\n$ kubectl logs replica-restored --tail 3");
        print!(
            "{}",
            cluster
                .kubectl(&["logs", "replica-restored", "-n", NAMESPACE, "--tail", "3"])
                .await?
        );
    }
    if let (Some(r), Some(c)) = (restored.ready, cold.ready) {
        println!(
            "Ready {:.1}× sooner restored than cold",
            c.as_secs_f64() / r.as_secs_f64().max(0.001)
        );
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<()> {
    let runtime = match std::env::var("WARMSTART_NODE_RUNTIME").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("" | "containerd") => NodeRuntime::Containerd,
        Ok("runc") => NodeRuntime::Runc,
        Ok(other) => bail!("WARMSTART_NODE_RUNTIME={other:?}: expected containerd or runc"),
        Err(e) => bail!("WARMSTART_NODE_RUNTIME: {e}"),
    };
    println!(
        "starting the local cluster (API server double, node over {runtime:?}, controller, agent)…"
    );
    let mut cluster = LocalCluster::start_with(runtime).await?;
    let result = run(&cluster, runtime).await;
    let stopped = cluster.shutdown().await;
    result?;
    stopped
}
