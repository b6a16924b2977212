//! `make cluster-demo`: the whole loop on a real Kubernetes on this machine (as root): brings
//! up the local cluster of `make cluster-up` (or reuses the one that is up),
//! assembles warmstart's images from the binaries built here and installs it from `deploy/` as a
//! user does, checkpoints the sample worker through a Checkpoint, prints the Checkpoint as
//! `kubectl get` shows it, then creates a restore pod and, after it, a cold start of the same
//! pod, and prints both timelines side by side: created → container running → restore started →
//! restore complete → Ready. Everything runs in a namespace of its own, deleted at the end; a
//! cluster it started is torn down at the end unless `WARMSTART_KEEP_CLUSTER=1`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use warmstart_e2e::real_kube::is_ready;
use warmstart_e2e::real_kube::{
    self, LocalKube, TestNamespace, WAIT, checkpoint, checkpoint_ready, create_checkpoint, kubectl,
    pod, warmstart_logs, worker_container, worker_state,
};
use warmstart_shared::names;
use warmstart_shared::v1alpha1::Checkpoint;

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

/// Creates `pod` and follows it until Ready; its timeline and the Ready pod.
async fn follow(pods: &Api<Pod>, pod: Pod) -> Result<(Timeline, Pod)> {
    let name = pod.name_any();
    let created = Instant::now();
    pods.create(&PostParams::default(), &pod)
        .await
        .with_context(|| format!("create pod {name}"))?;
    let mut timeline = Timeline::default();
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(p) = pods.get(&name).await {
            timeline.observe(&p, created.elapsed());
            if timeline.ready.is_some() {
                return Ok((timeline, p));
            }
        }
        ensure!(
            Instant::now() < deadline,
            "pod {name} did not become Ready within {WAIT:?}\n{}",
            warmstart_logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn cell(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()))
}

async fn run(client: &Client, ns: &str) -> Result<()> {
    let worker = worker_container(WEIGHTS_MIB, WARMUP_MS);
    let checkpoints: Api<Checkpoint> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    println!(
        "Checkpoint {CHECKPOINT}: sample worker with {WEIGHTS_MIB} MiB of weights and {WARMUP_MS} ms of warm-up"
    );
    let started = Instant::now();
    create_checkpoint(&checkpoints, &checkpoint(CHECKPOINT, &worker, &json!({}))?).await?;
    checkpoint_ready(&checkpoints, CHECKPOINT).await?;
    let took = started.elapsed();
    println!(
        "created → Ready in {:.2} s (checkpoint Job ran, agent captured it)\n",
        took.as_secs_f64()
    );
    println!("$ kubectl get checkpoint {CHECKPOINT}");
    print!("{}", kubectl(&["get", "checkpoint", CHECKPOINT, "-n", ns])?);
    println!();

    let (restored, restored_pod) =
        follow(&pods, pod("replica-restored", Some(CHECKPOINT), &worker)?).await?;
    let (cold, cold_pod) = follow(&pods, pod("replica-cold", None, &worker)?).await?;

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
    let a = worker_state(&restored_pod).context("replica-restored does not answer GET /state")?;
    let b = worker_state(&cold_pod).context("replica-cold does not answer GET /state")?;
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
    println!("\n$ kubectl logs replica-restored --tail 3");
    print!(
        "{}",
        kubectl(&["logs", "replica-restored", "-n", ns, "--tail", "3"])?
    );
    if let (Some(r), Some(c)) = (restored.ready, cold.ready) {
        println!(
            "Ready {:.1}× sooner restored than cold",
            c.as_secs_f64() / r.as_secs_f64().max(0.001)
        );
    }
    Ok(())
}

/// The cargo target directory this program was built in (`<target>/debug/<bin>`).
fn target_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_owned)
        .context("cannot find the target directory of this program")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<()> {
    ensure!(
        nix::unistd::Uid::effective().is_root(),
        "the local cluster needs root: run make cluster-demo as root"
    );
    println!("bringing up the local Kubernetes (make cluster-up)…");
    let _cluster = LocalKube::up()?;
    println!("assembling warmstart's images and installing it from deploy/…");
    real_kube::build_and_load_images(&target_dir()?)?;
    real_kube::install()?;
    let client = real_kube::client().await?;
    let ns = TestNamespace::create(&client, "demo").await?;
    println!("namespace {}\n", ns.name);
    run(&client, &ns.name).await
}
