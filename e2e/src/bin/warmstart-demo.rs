//! `make demo`: the local demonstration of warmstart on this machine. Starts the sample worker
//! in a runc container with about 1 GiB of weights and a few seconds of warm-up, checkpoints it
//! with `warmstart-agent`, restores it into a new placeholder container, and prints cold-start,
//! checkpoint and restore times and whether the restored state matched.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::fixture::{BindMount, Container, ContainerSpec, ImageStore, Runtime};
use warmstart_e2e::worker::{PORT, get_state, run_agent, wait_serving};

const WEIGHTS_MIB: &str = "1024";
const WARMUP_MS: &str = "3000";
const TIMEOUT: Duration = Duration::from_secs(120);

fn main() -> Result<()> {
    let tmp = tempfile::tempdir().context("temporary directory")?;
    let store = ImageStore::temporary().context("image store")?;
    let image = binaries::worker_image(&store).context("worker image")?;
    let agent = binaries::agent().context("warmstart-agent binary")?;
    let rt = Runtime::default();
    let dirs = ["source-control", "placeholder-control", "data"].map(|d| tmp.path().join(d));
    for dir in &dirs {
        std::fs::create_dir(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    println!(
        "warmstart demo: sample worker with {WEIGHTS_MIB} MiB of weights and {WARMUP_MS} ms of warm-up"
    );

    let spec = ContainerSpec::new(
        "demo-worker",
        &image,
        [
            WORKER_IN_IMAGE,
            "--weights-mib",
            WEIGHTS_MIB,
            "--warmup-ms",
            WARMUP_MS,
            "--port",
            "8000",
        ],
    )
    .with_env("WARMSTART_CONTROL_DIR", "/warmstart-control")
    .with_mount(BindMount::new(&dirs[0], "/warmstart-control"))
    .with_mount(BindMount::new(&dirs[2], "/data"));

    let cold = Instant::now();
    let source = Container::start_in(&rt, &spec).context("start the worker")?;
    wait_serving(&source, TIMEOUT)?;
    let cold = cold.elapsed();
    println!("cold start: serving after {:.2} s", cold.as_secs_f64());
    get_state(&source)?;
    let before = get_state(&source)?;

    let artifact = tmp.path().join("artifact");
    let started = Instant::now();
    let out = run_agent(
        &agent,
        &rt,
        &["checkpoint", "--stop", "--runc", source.id(), "--output"],
        &artifact,
    )?;
    let checkpoint = started.elapsed();
    print!("{out}");

    let mut ph_spec = spec.placeholder("demo-placeholder");
    ph_spec.mounts = vec![
        BindMount::new(&dirs[1], "/warmstart-control"),
        BindMount::new(&dirs[2], "/data"),
    ];
    let placeholder = Container::start_in(&rt, &ph_spec).context("start the placeholder")?;
    let started = Instant::now();
    let out = run_agent(
        &agent,
        &rt,
        &["restore", "--into-runc", placeholder.id(), "--artifact"],
        &artifact,
    )?;
    wait_serving(&placeholder, TIMEOUT)?;
    let restore = started.elapsed();
    print!("{out}");
    let after = get_state(&placeholder)?;
    let (_, verify) = placeholder
        .http_get(PORT, "/weights/verify")
        .context("verify weights")?;

    let same_weights = after["weightsSha256"] == before["weightsSha256"];
    let same_start = after["startedAt"] == before["startedAt"];
    let counter_continues = after["requests"].as_u64() > before["requests"].as_u64();
    let memory_intact = verify.contains("\"matches\":true");
    let matched = same_weights && same_start && counter_continues && memory_intact;

    let secs = |d: Duration| format!("{:>8.2}", d.as_secs_f64());
    println!();
    println!("{:<40} {:>8}", "", "seconds");
    println!(
        "{:<40} {}",
        "cold start (container start → serving)",
        secs(cold)
    );
    println!("{:<40} {}", "checkpoint (dump + publish)", secs(checkpoint));
    println!(
        "{:<40} {}",
        "restore (verify + restore → serving)",
        secs(restore)
    );
    println!(
        "{:<40} {:>7.1}x",
        "speed-up of restore over cold start",
        cold.as_secs_f64() / restore.as_secs_f64()
    );
    println!(
        "{:<40} {}",
        "restored state matched",
        if matched { "yes" } else { "NO" }
    );
    println!(
        "  weights sha256 {} ({}), start time {}, requests {} → {}, in-memory weights re-verified: {}",
        short(&after["weightsSha256"]),
        if same_weights { "same" } else { "differs" },
        if same_start { "same" } else { "differs" },
        before["requests"],
        after["requests"],
        if memory_intact { "match" } else { "MISMATCH" },
    );
    ensure!(
        matched,
        "the restored state did not match the checkpointed one"
    );
    Ok(())
}

fn short(v: &Value) -> String {
    v.as_str()
        .map(|s| s.chars().take(16).collect())
        .unwrap_or_default()
}
