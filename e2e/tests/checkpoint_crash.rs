//! The agent dies in the middle of a checkpoint (docs/architecture.md "Checkpoint, step by step": a
//! published artifact is always complete; publish.rs: "a crash leaves only a staging
//! directory"): `warmstart-agent checkpoint` is SIGKILLed while CRIU is writing the memory pages
//! of a workload that holds a few hundred MiB, and then
//! - no artifact is published (the output directory does not exist; what is left is only a
//!   `.staging-*` directory without manifest or completion marker),
//! - the workload runs on, not frozen and not traced: its log keeps ticking, no task of the
//!   container is stopped (`T`/`t`) or has a tracer, and (with the sample worker) it still
//!   answers HTTP with its weights intact,
//! - a second checkpoint to the same output succeeds and `inspect --verify` passes.
//!
//! The CRIU process the agent started (`criu swrk`, found as the agent's child before the kill)
//! is orphaned by the kill; the test waits for it to exit on its own (only ever
//! signalling PIDs it attributed to the killed agent, checked against their start time) and
//! reports what it did.
//!
//! A second test kills the agent of a `checkpoint --stop` while it publishes, the workload held
//! stopped since the dump: the workload resumes within seconds, where it was held.
//!
//! The workload is a busybox shell printing ticks plus, when `target/static/warmstart-sample-worker`
//! exists (`make sample-worker`), the static sample worker holding [`WORKER_WEIGHTS_MIB`] MiB of
//! weights; otherwise the shell itself holds [`SHELL_MEMORY_BYTES`] bytes in a variable.
//! `WARMSTART_CRASH_WORKLOAD=worker|busybox` forces one.
//!
//! Needs root, runc, CRIU (`WARMSTART_CRIU`, default `/usr/local/bin/criu` when present) and the
//! agent binary built next to this test (`cargo build -p warmstart-agent`).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::fs;
use std::process::{Child, Command};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use warmstart_e2e::agent_cli;
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::fixture::{Container, ContainerSpec, ImageStore, Runtime};
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST, STAGING_PREFIX};

/// MiB of weights the sample worker loads.
const WORKER_WEIGHTS_MIB: u32 = 384;
/// Bytes the busybox fallback keeps in a shell variable.
const SHELL_MEMORY_BYTES: u64 = 300 << 20;
/// The sample worker's HTTP port inside the container.
const WORKER_PORT: u16 = 8000;
/// Bytes of page images CRIU has written when the agent is killed: well into the big task's
/// memory, far from its end.
const PAGES_BEFORE_KILL: u64 = 16 << 20;
/// How long one agent command may take.
const AGENT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the orphaned CRIU gets to finish on its own.
const ORPHAN_TIMEOUT: Duration = Duration::from_secs(120);

fn agent_command(rt: &Runtime) -> Command {
    agent_cli::command(rt).unwrap()
}

/// Runs a command to completion within [`AGENT_TIMEOUT`]: whether it succeeded, and its output.
fn run_to_end(command: Command, what: &str) -> (bool, String) {
    let out = agent_cli::run(command, AGENT_TIMEOUT).unwrap_or_else(|e| panic!("{what}: {e}"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ProcStat {
    pid: i32,
    comm: String,
    state: char,
    ppid: i32,
    start_time: u64,
    exit_code: Option<i32>,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    let fields: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // fields[0] is field 3 (state); field N is fields[N - 3].
    Some(ProcStat {
        pid,
        comm,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
        exit_code: fields.get(49).and_then(|c| c.parse().ok()),
    })
}

fn all_pids() -> Vec<i32> {
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Every live descendant of `root`.
fn descendants(root: i32) -> Vec<ProcStat> {
    let stats: Vec<ProcStat> = all_pids().into_iter().filter_map(proc_stat).collect();
    let mut found: Vec<ProcStat> = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for stat in stats.iter().filter(|s| s.ppid == parent) {
            parents.push(stat.pid);
            found.push(stat.clone());
        }
    }
    found
}

/// The same process (PID and start time) if it still exists and is not a zombie.
fn still_running(p: &ProcStat) -> Option<ProcStat> {
    proc_stat(p.pid).filter(|now| now.start_time == p.start_time && now.state != 'Z')
}

/// A `Name:\tvalue` field of `/proc/<pid>/status`.
fn status_field(pid: u32, field: &str) -> Option<String> {
    field_of(
        &fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
        field,
    )
}

fn field_of(status: &str, field: &str) -> Option<String> {
    status.lines().find_map(|l| {
        l.strip_prefix(field)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    })
}

/// Task `pid` of a container whose init is `init` is neither stopped nor traced, read from one
/// status read. A task other than the init may have ended since it was listed (a `sleep` of the
/// shell whose time ran out while it was held): an ended task is neither.
fn assert_running_untraced(pid: u32, init: u32) {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        assert_ne!(pid, init, "the workload's init ended");
        return;
    };
    let state = field_of(&status, "State").unwrap_or_default();
    assert!(
        !state.starts_with('T') && !state.starts_with('t'),
        "task {pid} is stopped: {state}"
    );
    assert_eq!(
        field_of(&status, "TracerPid").as_deref(),
        Some("0"),
        "task {pid} is traced"
    );
}

/// Host PIDs of the container's processes (`runc ps`).
fn container_pids(rt: &Runtime, id: &str) -> Vec<u32> {
    let out = rt
        .runc_command()
        .args(["ps", "--format", "json", id])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "runc ps: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Option<Vec<u32>>>(&out.stdout)
        .unwrap()
        .unwrap_or_default()
}

fn last_tick(c: &Container) -> u64 {
    c.read_log()
        .lines()
        .filter_map(|l| l.strip_prefix("tick "))
        .filter_map(|n| n.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// Kills, on drop, the processes the test attributed to the killed agent that are still there
/// (same PID and start time): the test never leaves an orphaned CRIU behind, even when it fails.
struct Orphans(Vec<ProcStat>);

impl Drop for Orphans {
    fn drop(&mut self) {
        for p in &self.0 {
            if still_running(p).is_some() {
                eprintln!("checkpoint_crash: killing leftover {} ({})", p.pid, p.comm);
                let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL);
            }
        }
    }
}

/// The agent process of the interrupted checkpoint, killed and reaped if the test fails early.
struct AgentChild(Option<Child>);

impl Drop for AgentChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    /// The static sample worker (weights in memory) beside a ticking shell.
    Worker,
    /// A busybox shell holding its memory in a variable, ticking.
    Busybox,
}

fn choose_workload() -> Workload {
    match std::env::var("WARMSTART_CRASH_WORKLOAD").as_deref() {
        Ok("worker") => Workload::Worker,
        Ok("busybox") => Workload::Busybox,
        Ok(other) => panic!("WARMSTART_CRASH_WORKLOAD={other:?}: use worker or busybox"),
        Err(_) if binaries::static_worker().is_ok() => Workload::Worker,
        Err(_) => Workload::Busybox,
    }
}

#[test]
#[allow(clippy::too_many_lines)]
fn agent_killed_during_the_dump_publishes_nothing_and_leaves_the_workload_running() {
    let started = Instant::now();
    let workload = choose_workload();
    let rt = Runtime::default();
    let store = ImageStore::temporary().unwrap();
    let (image, script) = match workload {
        Workload::Worker => {
            let image = binaries::worker_image(&store).unwrap();
            let script = format!(
                "{WORKER_IN_IMAGE} --weights-mib {WORKER_WEIGHTS_MIB} --warmup-ms 0 \
                 --listen 127.0.0.1 --port {WORKER_PORT} & \
                 i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done"
            );
            (image, script)
        }
        Workload::Busybox => {
            let script = format!(
                "x=$(head -c {SHELL_MEMORY_BYTES} /dev/zero | tr '\\0' a); echo holding ${{#x}} bytes; \
                 i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done"
            );
            (store.busybox().unwrap(), script)
        }
    };
    let spec = ContainerSpec::new("crash-src", &image, ["sh", "-c", script.as_str()]);
    let source = Container::start_in(&rt, &spec).unwrap();
    let ready = match workload {
        Workload::Worker => format!("weights loaded {WORKER_WEIGHTS_MIB} MiB"),
        Workload::Busybox => format!("holding {SHELL_MEMORY_BYTES} bytes"),
    };
    source
        .wait_for_log(&ready, Duration::from_secs(60))
        .unwrap();
    if workload == Workload::Worker {
        source
            .wait_for_log("ready in", Duration::from_secs(60))
            .unwrap();
    }
    source
        .wait_for_log("tick 2", Duration::from_secs(20))
        .unwrap();
    eprintln!(
        "checkpoint_crash: {workload:?} workload ready after {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let out_parent = tempfile::tempdir().unwrap();
    let output = out_parent.path().join("art");
    let agent_log = out_parent.path().join("interrupted-agent.log");
    let mut interrupted = agent_command(&rt);
    // `--stop` on purpose: a checkpoint killed mid-dump must not take the workload with it.
    interrupted
        .args(["checkpoint", "--stop", "--runc", source.id(), "--output"])
        .arg(&output)
        .stdout(fs::File::create(&agent_log).unwrap())
        .stderr(
            fs::OpenOptions::new()
                .append(true)
                .open(&agent_log)
                .unwrap(),
        );
    let dump_started = Instant::now();
    let mut agent_child = AgentChild(Some(interrupted.spawn().unwrap()));
    let agent_pid = i32::try_from(agent_child.0.as_ref().unwrap().id()).unwrap();

    // Wait until CRIU holds the workload (its tracer) and has written some MiB of page images
    // into the staging directory; remember every descendant of the agent at that moment.
    let (staging, orphans, pages_at_kill) = loop {
        if let Some(status) = agent_child.0.as_mut().unwrap().try_wait().unwrap() {
            panic!(
                "the checkpoint ended ({status}) after {:.2}s, before it could be interrupted: {}",
                dump_started.elapsed().as_secs_f64(),
                fs::read_to_string(&agent_log).unwrap_or_default()
            );
        }
        assert!(
            dump_started.elapsed() < Duration::from_secs(60),
            "no dump in progress after 60s"
        );
        let staging = fs::read_dir(out_parent.path())
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("{STAGING_PREFIX}art-"))
            });
        let traced = status_field(source.pid(), "TracerPid").is_some_and(|t| t != "0");
        if let Some(staging) = staging
            && traced
        {
            let pages: u64 = fs::read_dir(staging.join("criu"))
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
                        .filter_map(|e| e.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0);
            if pages >= PAGES_BEFORE_KILL {
                let family = descendants(agent_pid);
                if !family.is_empty() {
                    break (staging, family, pages);
                }
            }
        }
        thread::sleep(Duration::from_millis(2));
    };
    let mut orphans = Orphans(orphans);
    let tracer = status_field(source.pid(), "TracerPid").unwrap();
    kill(Pid::from_raw(agent_pid), Signal::SIGKILL).unwrap();
    let killed_at = Instant::now();
    let agent_status = agent_child.0.take().unwrap().wait().unwrap();
    eprintln!(
        "checkpoint_crash: killed the agent {agent_pid} ({agent_status}) {:.2}s into the checkpoint, \
         with {pages_at_kill} bytes of pages written, workload traced by {tracer}; its descendants: {:?}",
        killed_at.duration_since(dump_started).as_secs_f64(),
        orphans
            .0
            .iter()
            .map(|p| format!("{} {} (state {})", p.pid, p.comm, p.state))
            .collect::<Vec<_>>()
    );
    assert!(
        orphans.0.iter().any(|p| tracer == p.pid.to_string()),
        "the workload's tracer {tracer} is a process the agent started"
    );

    // What the orphaned CRIU does: wait for every attributed process to exit on its own.
    loop {
        let alive: Vec<ProcStat> = orphans.0.iter().filter_map(still_running).collect();
        if alive.is_empty() {
            break;
        }
        assert!(
            killed_at.elapsed() < ORPHAN_TIMEOUT,
            "the agent's orphans still run {ORPHAN_TIMEOUT:?} after it was killed: {alive:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let after: Vec<String> = orphans
        .0
        .iter()
        .map(
            |p| match proc_stat(p.pid).filter(|s| s.start_time == p.start_time) {
                Some(z) => format!(
                    "{} {}: zombie of parent {}, exit code {:?}",
                    p.pid, p.comm, z.ppid, z.exit_code
                ),
                None => format!("{} {}: gone (reaped)", p.pid, p.comm),
            },
        )
        .collect();
    let dump_log = fs::read_to_string(staging.join("criu").join("dump.log")).unwrap_or_default();
    let log_tail: Vec<&str> = dump_log.lines().rev().take(4).collect();
    eprintln!(
        "checkpoint_crash: the orphans exited {:.2}s after the kill: {after:?}; dump.log ends: {log_tail:?}",
        killed_at.elapsed().as_secs_f64()
    );
    orphans.0.clear();

    // Nothing published: no output directory; the staging directory (if CRIU or nobody removed
    // it) holds neither manifest nor completion marker.
    assert!(
        fs::symlink_metadata(&output).is_err(),
        "no artifact is published at {}",
        output.display()
    );
    let leftovers: Vec<String> = fs::read_dir(out_parent.path())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "interrupted-agent.log")
        .collect();
    eprintln!("checkpoint_crash: left beside the output: {leftovers:?}");
    assert!(
        leftovers.iter().all(|n| n.starts_with(STAGING_PREFIX)),
        "only staging directories are left: {leftovers:?}"
    );
    assert!(!staging.join(FILE_MANIFEST).exists());
    assert!(!staging.join(FILE_COMPLETE).exists());

    // The workload runs on: no task stopped or traced, the log keeps ticking, the worker serves.
    // The shell's `sleep` child may just have ended (its time ran out while it was held, and
    // it exits the moment it is released): wait for the shell's next one, within seconds.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut pids = container_pids(&rt, source.id());
    while pids.len() < 2 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
        pids = container_pids(&rt, source.id());
    }
    assert!(pids.contains(&source.pid()), "{pids:?}");
    assert!(
        pids.len() >= 2,
        "the shell and its children still run: {pids:?}"
    );
    for pid in &pids {
        assert_running_untraced(*pid, source.pid());
    }
    let tick = last_tick(&source);
    source
        .wait_for_log(&format!("tick {}", tick + 3), Duration::from_secs(3))
        .unwrap();
    if workload == Workload::Worker {
        let (code, body) = source.http_get(WORKER_PORT, "/health").unwrap();
        assert_eq!((code, body.trim()), (200, "ok"));
        let (code, body) = source.http_get(WORKER_PORT, "/weights/verify").unwrap();
        assert_eq!(code, 200, "{body}");
        let verify: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(verify["matches"], true, "the weights are intact: {body}");
    }

    // A second checkpoint to the same output succeeds and verifies.
    let rerun_started = Instant::now();
    let mut rerun = agent_command(&rt);
    rerun
        .args(["checkpoint", "--runc", source.id(), "--output"])
        .arg(&output);
    let (ok, text) = run_to_end(rerun, "the second checkpoint");
    assert!(ok, "the second checkpoint succeeds: {text}");
    let leftovers: Vec<_> = fs::read_dir(out_parent.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".staging-"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "the abandoned staging directory is swept: {leftovers:?}"
    );
    eprintln!(
        "checkpoint_crash: second checkpoint took {:.2}s",
        rerun_started.elapsed().as_secs_f64()
    );
    let mut inspect = agent_command(&rt);
    inspect.arg("inspect").arg(&output).arg("--verify");
    let (ok, text) = run_to_end(inspect, "inspect --verify");
    assert!(ok, "inspect --verify passes: {text}");
    assert!(text.contains("every file matches its SHA-256"), "{text}");
    let tick = last_tick(&source);
    source
        .wait_for_log(&format!("tick {}", tick + 2), Duration::from_secs(3))
        .unwrap();
    eprintln!(
        "checkpoint_crash: done in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// Bytes the held workload keeps in a shell variable.
const HELD_MEMORY_BYTES: u64 = 64 << 20;

/// `checkpoint --stop` holds the workload from the dump until the artifact is sealed (issue:
/// "frozen at the snapshot point"); the agent is SIGKILLed while it publishes (paused there by
/// the debug build's fault point `post-dump`), the workload stopped: CRIU exits, the workload
/// resumes within seconds (untraced, ticking on from where it was held), and nothing is
/// published.
#[test]
#[allow(clippy::too_many_lines)]
fn agent_killed_while_it_holds_a_stopped_workload_resumes_the_workload() {
    let rt = Runtime::default();
    let store = ImageStore::temporary().unwrap();
    let script = format!(
        "x=$(head -c {HELD_MEMORY_BYTES} /dev/zero | tr '\\0' a); echo holding ${{#x}} bytes; \
         i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.1; done"
    );
    let spec = ContainerSpec::new(
        "held-src",
        &store.busybox().unwrap(),
        ["sh", "-c", script.as_str()],
    );
    let source = Container::start_in(&rt, &spec).unwrap();
    source
        .wait_for_log("tick 2", Duration::from_secs(60))
        .unwrap();

    let out_parent = tempfile::tempdir().unwrap();
    let output = out_parent.path().join("art");
    let agent_log = out_parent.path().join("held-agent.log");
    let mut command = agent_command(&rt);
    command
        .args(["checkpoint", "--stop", "--runc", source.id(), "--output"])
        .arg(&output)
        .env("RUST_LOG", "info")
        // Debug build fault point: the agent stops inside CRIU's post-dump hand-over.
        .env("WARMSTART_FAULT_PAUSE", "post-dump")
        .stdout(fs::File::create(&agent_log).unwrap())
        .stderr(
            fs::OpenOptions::new()
                .append(true)
                .open(&agent_log)
                .unwrap(),
        );
    let started = Instant::now();
    let mut agent_child = AgentChild(Some(command.spawn().unwrap()));
    let agent_pid = i32::try_from(agent_child.0.as_ref().unwrap().id()).unwrap();

    // Wait for the hand-over: CRIU has run its post-dump notification and still traces the
    // workload while the agent publishes.
    let (held_at_tick, family) = loop {
        if let Some(status) = agent_child.0.as_mut().unwrap().try_wait().unwrap() {
            panic!(
                "the checkpoint ended ({status}) before it could be interrupted: {}",
                fs::read_to_string(&agent_log).unwrap_or_default()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no hand-over after 120s"
        );
        let staging = fs::read_dir(out_parent.path())
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(STAGING_PREFIX)
            });
        let handed_over = staging.is_some_and(|s| s.join("fault-post-dump").exists());
        let traced = status_field(source.pid(), "TracerPid").is_some_and(|t| t != "0");
        if handed_over && traced {
            break (last_tick(&source), descendants(agent_pid));
        }
        thread::sleep(Duration::from_millis(2));
    };
    let orphans = Orphans(family);
    // Held: no tick while the agent publishes.
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        last_tick(&source),
        held_at_tick,
        "the workload does not run while it is held"
    );
    kill(Pid::from_raw(agent_pid), Signal::SIGKILL).unwrap();
    let killed_at = Instant::now();
    agent_child.0.take().unwrap().wait().unwrap();

    // CRIU reads the agent's death as a refused hand-over: it resumes the tree and exits.
    loop {
        let alive: Vec<ProcStat> = orphans.0.iter().filter_map(still_running).collect();
        if alive.is_empty() {
            break;
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(5),
            "the agent's CRIU still runs 5s after it: {alive:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
    // The workload resumes within seconds, where it was held.
    source
        .wait_for_log(
            &format!("tick {}", held_at_tick + 2),
            Duration::from_secs(5),
        )
        .unwrap();
    let log = source.read_log();
    let ticks: Vec<u64> = log
        .lines()
        .filter_map(|l| l.strip_prefix("tick "))
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    assert_eq!(
        ticks,
        (1..=*ticks.last().unwrap()).collect::<Vec<_>>(),
        "it resumed where it was held: no tick lost or repeated"
    );
    eprintln!(
        "checkpoint_crash: held at tick {held_at_tick}, agent killed, workload ticking again {:.2}s later",
        killed_at.elapsed().as_secs_f64()
    );
    for pid in container_pids(&rt, source.id()) {
        assert_running_untraced(pid, source.pid());
    }
    assert!(
        fs::symlink_metadata(&output).is_err(),
        "nothing is published at {}",
        output.display()
    );
}

/// `checkpoint --stop` is SIGKILLed after CRIU killed the workload and before the sealed capture
/// was renamed into place (the debug build's fault point `pre-place`): the workload is gone, so
/// the capture must not be. The next checkpoint to that output verifies the sealed staging
/// directory and publishes it (and says so instead of capturing again), `inspect --verify`
/// passes, and the artifact restores into a placeholder, ticking on from where it was killed.
#[test]
#[allow(clippy::too_many_lines)]
fn agent_killed_after_the_workload_was_killed_and_before_the_rename_loses_nothing() {
    let rt = Runtime::default();
    let store = ImageStore::temporary().unwrap();
    let script = "i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.1; done";
    let spec = ContainerSpec::new(
        "placed-src",
        &store.busybox().unwrap(),
        ["sh", "-c", script],
    );
    let source = Container::start_in(&rt, &spec).unwrap();
    source
        .wait_for_log("tick 2", Duration::from_secs(60))
        .unwrap();

    let out_parent = tempfile::tempdir().unwrap();
    let output = out_parent.path().join("art");
    let agent_log = out_parent.path().join("placed-agent.log");
    let mut command = agent_command(&rt);
    command
        .args(["checkpoint", "--stop", "--runc", source.id(), "--output"])
        .arg(&output)
        .env("RUST_LOG", "info")
        // Debug build fault point: after CRIU killed the tree, before the rename.
        .env("WARMSTART_FAULT_PAUSE", "pre-place")
        .stdout(fs::File::create(&agent_log).unwrap())
        .stderr(
            fs::OpenOptions::new()
                .append(true)
                .open(&agent_log)
                .unwrap(),
        );
    let started = Instant::now();
    let mut agent_child = AgentChild(Some(command.spawn().unwrap()));
    let agent_pid = i32::try_from(agent_child.0.as_ref().unwrap().id()).unwrap();
    let marker = out_parent.path().join("fault-pre-place");
    while !marker.exists() {
        if let Some(status) = agent_child.0.as_mut().unwrap().try_wait().unwrap() {
            panic!(
                "the checkpoint ended ({status}) before it reached the rename: {}",
                fs::read_to_string(&agent_log).unwrap_or_default()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the checkpoint did not reach the rename in 120s"
        );
        thread::sleep(Duration::from_millis(5));
    }
    let killed_at_tick = last_tick(&source);
    kill(Pid::from_raw(agent_pid), Signal::SIGKILL).unwrap();
    agent_child.0.take().unwrap().wait().unwrap();

    // The workload is gone (CRIU killed it at the hand-over) and nothing is published yet:
    // only the sealed staging directory holds the capture.
    let deadline = Instant::now() + Duration::from_secs(10);
    while source.state().unwrap() == "running" {
        assert!(Instant::now() < deadline, "the workload still runs");
        thread::sleep(Duration::from_millis(20));
    }
    assert!(fs::symlink_metadata(&output).is_err());
    let staged: Vec<_> = fs::read_dir(out_parent.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(STAGING_PREFIX)
        })
        .collect();
    assert_eq!(staged.len(), 1, "{staged:?}");
    assert!(
        staged[0].join(FILE_MANIFEST).is_file(),
        "the capture is sealed"
    );

    // The next checkpoint to the same output finishes the publication instead of deleting it.
    let mut rerun = agent_command(&rt);
    rerun
        .args(["checkpoint", "--stop", "--runc", source.id(), "--output"])
        .arg(&output);
    let (ok, text) = run_to_end(rerun, "the next checkpoint");
    assert!(!ok, "nothing new is captured: {text}");
    assert!(
        text.contains("it is verified and published there now"),
        "{text}"
    );
    assert!(output.join(FILE_COMPLETE).is_file(), "{text}");
    assert!(
        !staged[0].exists(),
        "the staging directory became the artifact"
    );
    let mut inspect = agent_command(&rt);
    inspect.arg("inspect").arg(&output).arg("--verify");
    let (ok, text) = run_to_end(inspect, "inspect --verify");
    assert!(ok, "inspect --verify passes: {text}");
    assert!(text.contains("every file matches its SHA-256"), "{text}");

    // And it restores: the workload ticks on from where it was killed.
    source.destroy().unwrap();
    let placeholder = Container::start_in(&rt, &spec.placeholder("placed-dst")).unwrap();
    let mut restore = agent_command(&rt);
    restore
        .args(["restore", "--artifact"])
        .arg(&output)
        .args(["--into-runc", placeholder.id(), "--log-dir"])
        .arg(out_parent.path().join("restore-log"));
    let (ok, text) = run_to_end(restore, "the restore");
    assert!(ok, "the published capture restores: {text}");
    placeholder
        .wait_for_log(
            &format!("tick {}", killed_at_tick + 3),
            Duration::from_secs(10),
        )
        .unwrap();
}
