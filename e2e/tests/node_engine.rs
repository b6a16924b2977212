//! The node engine on real containers: the sample worker runs in a runc container (busybox
//! image, overlay root), is checkpointed with `warmstart-agent checkpoint --stop`, and is
//! restored into fresh placeholder containers started from the same image with a standby
//! command and the same mounts. Needs root, runc and CRIU (CI has them: `make setup`).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use warmstart_e2e::agent_cli;
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::fixture::{
    BindMount, Container, ContainerExit, ContainerSpec, ImageStore, Runtime, become_child_subreaper,
};
use warmstart_e2e::worker::PodVolumes;

const PORT: u16 = 8000;
const HASH: &str = "0123456789abcdef";
const WAIT: Duration = Duration::from_secs(30);

fn worker_spec(image: &warmstart_e2e::fixture::Image, name: &str, v: &PodVolumes) -> ContainerSpec {
    ContainerSpec::new(
        name,
        image,
        [
            WORKER_IN_IMAGE,
            "--weights-mib",
            "64",
            "--warmup-ms",
            "200",
            "--port",
            "8000",
        ],
    )
    .with_env("WARMSTART_READY_FILE", "/checkpoint-signal/ready")
    .with_env(
        "WARMSTART_SIGNAL_FILE",
        format!("/checkpoint-signal/{HASH}.done"),
    )
    .with_env("WARMSTART_CONTROL_DIR", "/warmstart-control")
    .with_mount(BindMount::new(&v.signal, "/checkpoint-signal"))
    .with_mount(BindMount::new(&v.control, "/warmstart-control"))
    .with_mount(BindMount::new(&v.data, "/data"))
}

/// A placeholder for `spec`: same image and mount destinations, its own volumes.
fn placeholder_spec(spec: &ContainerSpec, name: &str, v: &PodVolumes) -> ContainerSpec {
    let mut ph = spec.placeholder(name);
    ph.mounts = vec![
        BindMount::new(&v.signal, "/checkpoint-signal"),
        BindMount::new(&v.control, "/warmstart-control"),
        BindMount::new(&v.data, "/data"),
    ];
    ph
}

fn agent(rt: &Runtime, args: &[&str], paths: &[&Path]) -> Output {
    let mut command = agent_cli::command(rt).unwrap();
    command.args(args).args(paths);
    agent_cli::run(command, agent_cli::DEFAULT_TIMEOUT).unwrap()
}

fn state(c: &Container) -> Value {
    let (status, body) = c.http_get(PORT, "/state").unwrap();
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The restored worker's host PID: a child of the placeholder's init running the worker.
fn restored_pid(ph: &Container) -> u32 {
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let ppid: u32 = after.split(' ').nth(1).unwrap().parse().unwrap();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid == ph.pid() && String::from_utf8_lossy(&cmdline).contains("warmstart-sample-worker")
        {
            return pid;
        }
    }
    panic!("no restored worker under placeholder {}", ph.pid());
}

fn ns(pid: u32, name: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{name}")).unwrap()
}

/// Starts the source worker, changes its filesystem, and checkpoints it (stopping it).
fn checkpoint_worker(
    rt: &Runtime,
    image: &warmstart_e2e::fixture::Image,
    artifact: &Path,
) -> (ContainerSpec, Value, String) {
    let v = PodVolumes::new().unwrap();
    let spec = worker_spec(image, "worker", &v);
    let src = Container::start_in(rt, &spec).unwrap();
    src.wait_for_log("worker: ready", WAIT).unwrap();
    src.exec_ok([
        "sh",
        "-c",
        "echo created > /tmp/created && echo extra:x:1:1::/:/bin/sh >> /etc/passwd \
         && rm /etc/group && mkdir -p /var/cache/w && echo in-shm > /dev/shm/shared",
    ])
    .unwrap();
    state(&src);
    let before = state(&src);
    let out = agent(
        rt,
        &[
            "checkpoint",
            "--stop",
            "--hash",
            HASH,
            "--runc",
            src.id(),
            "--output",
        ],
        &[artifact],
    );
    assert!(out.status.success(), "checkpoint failed");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(report.contains("dump"), "phase table printed: {report}");
    (spec, before, src.read_log())
}

#[test]
fn a_restored_worker_keeps_its_state_files_and_namespaces() {
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    let rt = Runtime::default();
    let out = tempfile::tempdir().unwrap();
    let artifact = out.path().join("artifact");
    let (spec, before, _) = checkpoint_worker(&rt, &image, &artifact);

    let v = PodVolumes::new().unwrap();
    let ph = Container::start_in(&rt, &placeholder_spec(&spec, "placeholder", &v)).unwrap();
    let out = agent(
        &rt,
        &["restore", "--into-runc", ph.id(), "--artifact"],
        &[&artifact],
    );
    assert!(out.status.success(), "restore failed");
    assert!(String::from_utf8_lossy(&out.stdout).contains("criu-restore"));
    assert!(
        v.control.join("restore-complete").exists(),
        "restore-complete written"
    );

    // The restored process answers inside the placeholder's network namespace.
    ph.wait_for_log("worker: restored", WAIT).unwrap();
    let after = state(&ph);
    assert_eq!(after["weightsSha256"], before["weightsSha256"]);
    assert_eq!(
        after["startedAt"], before["startedAt"],
        "same process state, not a restart"
    );
    assert!(
        after["requests"].as_u64() > before["requests"].as_u64(),
        "counter continues"
    );
    assert_eq!(after["restored"], true);
    let (status, verify) = ph.http_get(PORT, "/weights/verify").unwrap();
    assert_eq!(status, 200);
    assert!(verify.contains("\"matches\":true"), "{verify}");

    // Its output goes to the placeholder's log.
    assert!(ph.read_log().contains("worker: restored"));

    // Namespaces and cgroups of the placeholder; PID namespace nested in the placeholder's.
    let pid = restored_pid(&ph);
    for name in ["net", "ipc", "uts"] {
        assert_eq!(ns(pid, name), ns(ph.pid(), name), "{name} namespace");
    }
    let cgroup = |p: u32| std::fs::read_to_string(format!("/proc/{p}/cgroup")).unwrap();
    assert_eq!(cgroup(pid), cgroup(ph.pid()));
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    assert_eq!(
        nspid.split_whitespace().count(),
        4,
        "host, placeholder, own: {nspid}"
    );

    // Files created, modified and deleted before the checkpoint are as they were.
    let root = |p: &str| ph.host_path(p).unwrap();
    assert_eq!(
        std::fs::read_to_string(root("/tmp/created")).unwrap(),
        "created\n"
    );
    assert!(
        std::fs::read_to_string(root("/etc/passwd"))
            .unwrap()
            .contains("extra:x:1:1")
    );
    assert!(!root("/etc/group").exists(), "deleted file stays deleted");
    assert!(root("/var/cache/w").is_dir());
    // /dev/shm is the restored process's own tmpfs, with its content.
    let shm = std::fs::read_to_string(format!("/proc/{pid}/root/dev/shm/shared")).unwrap();
    assert_eq!(shm, "in-shm\n");
}

#[test]
fn one_artifact_restores_twice_side_by_side() {
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    let rt = Runtime::default();
    let out = tempfile::tempdir().unwrap();
    let artifact = out.path().join("artifact");
    let (spec, before, _) = checkpoint_worker(&rt, &image, &artifact);

    let (va, vb) = (PodVolumes::new().unwrap(), PodVolumes::new().unwrap());
    let a = Container::start_in(&rt, &placeholder_spec(&spec, "ph-a", &va)).unwrap();
    let b = Container::start_in(&rt, &placeholder_spec(&spec, "ph-b", &vb)).unwrap();
    for ph in [&a, &b] {
        let out = agent(
            &rt,
            &["restore", "--into-runc", ph.id(), "--artifact"],
            &[&artifact],
        );
        assert!(out.status.success(), "restore into {} failed", ph.id());
    }
    let base = before["requests"].as_u64().unwrap();
    for _ in 0..3 {
        state(&a);
    }
    let sa = state(&a);
    let sb = state(&b);
    assert_eq!(sa["weightsSha256"], before["weightsSha256"]);
    assert_eq!(sb["weightsSha256"], before["weightsSha256"]);
    // Each copy counts its own requests from the checkpointed value.
    assert_eq!(sa["requests"].as_u64().unwrap(), base + 4);
    assert_eq!(sb["requests"].as_u64().unwrap(), base + 1);
    assert_ne!(ns(restored_pid(&a), "net"), ns(restored_pid(&b), "net"));
}

#[test]
fn a_checkpoint_without_stop_leaves_the_worker_serving_and_inspect_describes_it() {
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    let rt = Runtime::default();
    let v = PodVolumes::new().unwrap();
    let src = Container::start_in(&rt, &worker_spec(&image, "running", &v)).unwrap();
    src.wait_for_log("worker: ready", WAIT).unwrap();
    let before = state(&src);
    let out = tempfile::tempdir().unwrap();
    let artifact = out.path().join("artifact");
    let run = agent(
        &rt,
        &["checkpoint", "--hash", HASH, "--runc", src.id(), "--output"],
        &[&artifact],
    );
    assert!(run.status.success());
    // Not frozen, not killed: it answers and keeps counting.
    let after = state(&src);
    assert_eq!(
        after["requests"].as_u64().unwrap(),
        before["requests"].as_u64().unwrap() + 1
    );
    assert_eq!(src.state().unwrap(), "running");

    let run = agent(&rt, &["inspect", "--verify"], &[&artifact]);
    assert!(run.status.success());
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(text.contains(&format!("identity hash  {HASH}")), "{text}");
    assert!(text.contains("criu           4.2"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("mount") && l.contains("External  /data (")),
        "{text}"
    );
    assert!(text.contains("every file matches"), "{text}");

    // A second checkpoint to the same output is refused: artifacts are never replaced.
    let run = agent(
        &rt,
        &["checkpoint", "--runc", src.id(), "--output"],
        &[&artifact],
    );
    assert_eq!(run.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&run.stderr).contains("an artifact already exists"));
}

/// A native workload's own standby: the placeholder runs the sample worker itself with
/// `WARMSTART_RESTORE_STANDBY=1` (as a restore pod does), which loads nothing, becomes the
/// init of the restored worker, forwards SIGTERM to it and exits with its status.
#[test]
fn a_native_worker_in_standby_supervises_its_restored_copy() {
    become_child_subreaper().unwrap();
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    let rt = Runtime::default();
    let out = tempfile::tempdir().unwrap();
    let artifact = out.path().join("artifact");
    let (spec, before, _) = checkpoint_worker(&rt, &image, &artifact);

    let v = PodVolumes::new().unwrap();
    let mut standby = placeholder_spec(&spec, "standby", &v)
        .with_env(warmstart_shared::names::ENV_RESTORE_STANDBY, "1")
        .with_env(warmstart_shared::names::ENV_RESTORE_TIMEOUT, "1h");
    standby.args = spec.args.clone();
    let ph = Container::start_in(&rt, &standby).unwrap();
    ph.wait_for_log("standby, waiting for a restore", WAIT)
        .unwrap();
    let run = agent(
        &rt,
        &["restore", "--into-runc", ph.id(), "--artifact"],
        &[&artifact],
    );
    assert!(run.status.success(), "restore failed");
    ph.wait_for_log("supervising the restored worker", WAIT)
        .unwrap();
    // The restored worker notices `restore-complete` on its own next poll.
    ph.wait_for_log("restored, continuing", WAIT).unwrap();
    let after = state(&ph);
    assert_eq!(
        after["startedAt"], before["startedAt"],
        "the restored worker"
    );
    assert_eq!(after["restored"], true);
    assert!(!ph.read_log().contains("cold start"));

    ph.signal("TERM").unwrap();
    assert_eq!(ph.wait_exit(WAIT).unwrap(), ContainerExit::Code(0));
    assert!(ph.read_log().contains("restored worker exited with 0"));
}

#[test]
fn json_output_carries_the_results_and_their_timings() {
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    let rt = Runtime::default();
    let out = tempfile::tempdir().unwrap();
    let artifact = out.path().join("artifact");
    let v = PodVolumes::new().unwrap();
    let spec = worker_spec(&image, "json-worker", &v);
    let src = Container::start_in(&rt, &spec).unwrap();
    src.wait_for_log("worker: ready", WAIT).unwrap();
    let parse = |o: &Output| -> Value {
        assert!(o.status.success());
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let ck = parse(&agent(
        &rt,
        &[
            "checkpoint",
            "--json",
            "--stop",
            "--hash",
            HASH,
            "--runc",
            src.id(),
            "--output",
        ],
        &[&artifact],
    ));
    assert_eq!(ck["identityHash"], HASH);
    assert_eq!(ck["stopped"], true);
    assert_eq!(ck["artifact"], artifact.display().to_string());
    assert!(ck["timings"]["dump"].as_f64().unwrap() > 0.0, "{ck}");
    assert!(ck["bytes"].as_u64().unwrap() > 64 << 20, "{ck}");

    let inspect = parse(&agent(
        &rt,
        &["inspect", "--json", "--verify"],
        &[&artifact],
    ));
    assert_eq!(inspect["verified"], true);
    assert_eq!(inspect["manifest"]["formatVersion"], 2);
    assert_eq!(inspect["manifest"]["digest"], ck["manifestDigest"]);
    // On a terminal a progress line is drawn on standard error, then cleared for the results;
    // none with --json.
    let on_terminal = |args: &str| -> String {
        let command = format!(
            "{} --runc-root {} --criu {} {args} {}",
            binaries::agent().unwrap().display(),
            rt.runc_root().display(),
            binaries::criu().display(),
            artifact.display()
        );
        let out = std::process::Command::new("script")
            .args(["-qec", &command, "/dev/null"])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        text
    };
    let shown = on_terminal("inspect --verify");
    let line = shown
        .split("\r\x1b[2K")
        .find(|l| l.starts_with("inspect: verifying "))
        .unwrap_or_else(|| panic!("no progress line: {shown:?}"));
    assert!(line.contains(" MiB at "), "{shown:?}");
    assert!(
        shown.matches("\r\x1b[2K").count() >= 2,
        "drawn, then cleared: {shown:?}"
    );
    assert!(
        shown.contains("every file matches its SHA-256"),
        "{shown:?}"
    );
    let quiet = on_terminal("inspect --json --verify");
    assert!(!quiet.contains("verifying"), "{quiet:?}");
    assert!(!quiet.contains('\x1b'), "{quiet:?}");

    let vp = PodVolumes::new().unwrap();
    let ph = Container::start_in(&rt, &placeholder_spec(&spec, "json-ph", &vp)).unwrap();
    let restored = parse(&agent(
        &rt,
        &["restore", "--json", "--into-runc", ph.id(), "--artifact"],
        &[&artifact],
    ));
    assert_eq!(restored["restoreComplete"], true);
    assert!(restored["timings"]["criu-restore"].as_f64().unwrap() > 0.0);
    assert!(
        restored["timings"].get("verify-pages").is_some(),
        "{restored}"
    );
    // The page images were verified beside CRIU: marked, and not part of the wall-clock total.
    assert_eq!(
        restored["besidePhases"],
        serde_json::json!(["verify-pages"]),
        "{restored}"
    );
    let sum: f64 = restored["timings"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(Value::as_f64)
        .sum();
    let total = restored["totalSeconds"].as_f64().unwrap();
    let pages = restored["timings"]["verify-pages"].as_f64().unwrap();
    assert!((sum - pages - total).abs() < 1e-6, "{restored}");
    ph.wait_for_log("worker: restored", WAIT).unwrap();
}

/// A directory bind-mounted onto itself as a shared mount (what every directory is on a node
/// whose `/` is shared, as systemd makes it), unmounted when dropped.
struct SharedDir(tempfile::TempDir);

impl SharedDir {
    fn new() -> Self {
        use nix::mount::{MsFlags, mount};
        let dir = tempfile::Builder::new()
            .prefix("warmstart-shared-")
            .tempdir()
            .unwrap();
        mount(
            Some(dir.path()),
            dir.path(),
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap();
        let shared = Self(dir);
        mount(
            None::<&str>,
            shared.0.path(),
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
        .unwrap();
        shared
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Containers whose root filesystems are mounted below a shared mount, as on a node whose `/`
/// is shared (systemd's default; containerd's state directory lies below it): the container's
/// root is a slave of the host's mount, CRIU records that master at dump and restores it by
/// copying it from the placeholder's root, which must not be private in the restore helper's
/// mount namespace.
#[test]
fn a_worker_whose_root_is_below_a_shared_mount_restores() {
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    // Declared before the runtime's containers: unmounted after they are removed.
    let shared = SharedDir::new();
    let rt = Runtime::new(shared.0.path());
    let out = tempfile::tempdir().unwrap();
    let artifact = out.path().join("artifact");
    let (spec, before, _) = checkpoint_worker(&rt, &image, &artifact);

    let v = PodVolumes::new().unwrap();
    let ph = Container::start_in(&rt, &placeholder_spec(&spec, "shared-ph", &v)).unwrap();
    let run = agent(
        &rt,
        &["restore", "--into-runc", ph.id(), "--artifact"],
        &[&artifact],
    );
    assert!(
        run.status.success(),
        "restore failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    ph.wait_for_log("worker: restored", WAIT).unwrap();
    let after = state(&ph);
    assert_eq!(after["startedAt"], before["startedAt"]);
    assert_eq!(after["restored"], true);
}

/// The largest page image of `artifact` (the worker's weights live there), relative to it.
fn largest_page_image(artifact: &Path) -> String {
    let mut images: Vec<(u64, String)> = std::fs::read_dir(artifact.join("criu"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("pages-") && name.ends_with(".img")
        })
        .map(|e| {
            (
                e.metadata().unwrap().len(),
                format!("criu/{}", e.file_name().to_string_lossy()),
            )
        })
        .collect();
    images.sort();
    images.pop().expect("the artifact holds page images").1
}

/// Whoever can write artifact storage renames a tampered page image over the real one while a
/// restore runs, after the artifact was verified and before CRIU reads it (the debug build's
/// fault point `restore-before-criu` holds the restore there until the swap is done). CRIU
/// restores the bytes that were verified: the restore succeeds and the worker's weights in
/// memory are the checkpointed ones, never the tampered bytes.
#[test]
fn a_page_image_swapped_during_a_restore_is_not_restored() {
    let store = ImageStore::temporary().unwrap();
    let image = binaries::worker_image(&store).unwrap();
    let rt = Runtime::default();
    let dir = tempfile::tempdir().unwrap();
    let artifact = dir.path().join("artifact");
    let (spec, before, _) = checkpoint_worker(&rt, &image, &artifact);
    let pages = largest_page_image(&artifact);
    let v = PodVolumes::new().unwrap();
    let ph = Container::start_in(&rt, &placeholder_spec(&spec, "swap-ph", &v)).unwrap();

    let log_dir = dir.path().join("restore-log");
    let mut command = agent_cli::command(&rt).unwrap();
    command
        .args(["restore", "--into-runc", ph.id(), "--log-dir"])
        .arg(&log_dir)
        .arg("--artifact")
        .arg(&artifact)
        .env("WARMSTART_FAULT_PAUSE", "restore-before-criu");
    let restore = std::thread::spawn(move || agent_cli::run(command, agent_cli::DEFAULT_TIMEOUT));
    let paused = log_dir.join("fault-restore-before-criu");
    let started = std::time::Instant::now();
    while !paused.exists() {
        assert!(
            !restore.is_finished(),
            "the restore ended before CRIU was started"
        );
        assert!(
            started.elapsed() < WAIT * 4,
            "the restore never reached CRIU"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The swap: a copy with one byte of the weights changed, renamed over the page image.
    let path = artifact.join(&pages);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    let swap = artifact.join("criu/.swap");
    std::fs::write(&swap, &bytes).unwrap();
    std::fs::rename(&swap, &path).unwrap();
    std::fs::write(log_dir.join("resume-restore-before-criu"), b"").unwrap();

    let out = restore.join().unwrap().unwrap();
    assert!(
        out.status.success(),
        "the verified bytes restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ph.wait_for_log("worker: restored", WAIT).unwrap();
    let after = state(&ph);
    assert_eq!(after["weightsSha256"], before["weightsSha256"]);
    assert_eq!(after["startedAt"], before["startedAt"]);
    let (status, verify) = ph.http_get(PORT, "/weights/verify").unwrap();
    assert_eq!(status, 200);
    assert!(
        verify.contains("\"matches\":true"),
        "the restored memory is the verified one, not the swapped file: {verify}"
    );
    // The swap did happen: the artifact on disk no longer verifies, naming the file.
    let run = agent(&rt, &["inspect", "--verify"], &[&artifact]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains(&pages) && stderr.contains("differs from the manifest"),
        "{stderr}"
    );
    // The restore's private view of the artifact is gone with it.
    let views = dir.path().join(".views");
    assert!(
        std::fs::read_dir(&views).map_or(true, |mut d| d.next().is_none()),
        "views left in {}",
        views.display()
    );
}
