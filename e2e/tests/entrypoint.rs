//! An unmodified server under `warmstart-entrypoint`, in real runc containers: Python's
//! `http.server` (the host's Python 3, which nobody here wrote) serving the container's
//! `/dev/shm`, with an `httpGet` readiness probe. Checkpointed with `warmstart-agent checkpoint
//! --stop`, restored with `warmstart-agent restore` into a placeholder whose entrypoint waits in
//! standby, or cold-started by that entrypoint when no restore comes.
//!
//! The image is busybox plus the host's `python3` binary and its shared libraries; the Python
//! standard library is bind-mounted read-only from the host, and the entrypoint binary is
//! bind-mounted read-only at `/warmstart/bin`, as the install init container's emptyDir is in a
//! pod. The server's "state" is a file in its `/dev/shm` (memory: CRIU dumps the tmpfs with the
//! process; a cold start has an empty one). Needs root, runc, CRIU and python3 (CI has them).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use warmstart_e2e::agent_cli;
use warmstart_e2e::fixture::{
    BindMount, Container, ContainerExit, ContainerSpec, Image, ImageStore, Runtime,
    become_child_subreaper,
};
use warmstart_e2e::worker::PodVolumes;
use warmstart_shared::names;

const PORT: u16 = 8000;
const HASH: &str = "0123456789abcdef";
const WAIT: Duration = Duration::from_secs(60);
/// The host's Python (Debian's python3 package).
const HOST_PYTHON: &str = "/usr/bin/python3";
/// Exit status of a process killed by SIGTERM, as the entrypoint reports it.
const KILLED_BY_SIGTERM: i32 = 128 + 15;

/// Python's real binary, standard library directory and shared libraries.
struct Python {
    binary: PathBuf,
    stdlib: PathBuf,
    libraries: Vec<PathBuf>,
}

fn host_python() -> Python {
    let binary = std::fs::canonicalize(HOST_PYTHON)
        .unwrap_or_else(|e| panic!("{HOST_PYTHON} is needed for these tests: {e}"));
    let name = binary.file_name().unwrap().to_str().unwrap().to_owned();
    let stdlib = Path::new("/usr/lib").join(&name);
    assert!(
        stdlib.join("http/server.py").is_file(),
        "{} has no http.server",
        stdlib.display()
    );
    let ldd = Command::new("ldd").arg(&binary).output().unwrap();
    assert!(ldd.status.success(), "ldd {}", binary.display());
    let libraries = String::from_utf8_lossy(&ldd.stdout)
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect();
    Python {
        binary,
        stdlib,
        libraries,
    }
}

/// busybox + python (binary and libraries at their host paths).
fn python_image(store: &ImageStore, python: &Python) -> Image {
    store
        .get_or_build("busybox-python", |image| {
            image.add_file(&python.binary, python.binary.to_str().unwrap(), 0o755)?;
            for lib in &python.libraries {
                image.add_file(lib, lib.to_str().unwrap(), 0o755)?;
            }
            Ok(())
        })
        .unwrap()
}

/// What every test here needs: the host's Python, the image holding it, the runtime. The test
/// becomes a child subreaper first, so the containers' orphans are reaped by it.
struct Setup {
    /// Owns the image's directory: keep it for as long as the image is used.
    _store: ImageStore,
    python: Python,
    image: Image,
    rt: Runtime,
}

impl Setup {
    fn new() -> Self {
        become_child_subreaper().unwrap();
        let store = ImageStore::temporary().unwrap();
        let python = host_python();
        let image = python_image(&store, &python);
        Self {
            _store: store,
            python,
            image,
            rt: Runtime::default(),
        }
    }
}

/// The server's command line, unchanged, after the entrypoint.
fn wrapped_server(python: &Python) -> Vec<String> {
    [
        names::entrypoint_path().as_str(),
        "--",
        python.binary.to_str().unwrap(),
        "-m",
        "http.server",
        "--bind",
        "0.0.0.0",
        &PORT.to_string(),
        "--directory",
        "/dev/shm",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// The same mounts, at the same paths, for source and placeholder (CRIU needs them to match).
fn server_spec(name: &str, image: &Image, python: &Python, v: &PodVolumes) -> ContainerSpec {
    ContainerSpec::new(name, image, wrapped_server(python))
        .with_env(names::ENV_CONTROL_DIR, names::MOUNT_CONTROL)
        .with_mount(BindMount::new(&v.signal, names::MOUNT_SIGNAL))
        .with_mount(BindMount::new(&v.control, names::MOUNT_CONTROL))
        .with_mount(BindMount::readonly(&v.bin, names::MOUNT_ENTRYPOINT))
        .with_mount(BindMount::readonly(
            &python.stdlib,
            python.stdlib.to_str().unwrap(),
        ))
}

/// A checkpoint source as the Job builder shapes it with `entrypoint: Wrap`.
fn source_spec(image: &Image, python: &Python, v: &PodVolumes) -> ContainerSpec {
    server_spec("http-source", image, python, v)
        .with_env(names::ENV_READY_FILE, names::ready_file_path())
        .with_env(names::ENV_SIGNAL_FILE, names::signal_file_path(HASH))
        .with_env(
            names::ENV_READY_PROBE,
            format!(r#"{{"httpGet":{{"port":{PORT},"path":"/"}},"periodSeconds":1}}"#),
        )
}

/// A restore pod's target as the restore-pod builder shapes it for a `Wrap` checkpoint.
fn placeholder_spec(
    image: &Image,
    python: &Python,
    v: &PodVolumes,
    timeout_seconds: u32,
) -> ContainerSpec {
    server_spec("http-placeholder", image, python, v)
        .with_env(names::ENV_RESTORE_STANDBY, "1")
        .with_env(names::ENV_RESTORE_TIMEOUT, timeout_seconds.to_string())
}

/// Writes `restore-claim` as the agent does when it starts a restore (the test stands in for an
/// agent whose restore is slow).
fn claim_as_agent(v: &PodVolumes) {
    std::fs::write(
        v.control.join(names::FILE_RESTORE_CLAIM),
        r#"{"by":"restore","pid":4242,"at":"2026-12-03T00:00:00Z"}"#,
    )
    .unwrap();
}

/// Writes `restore-failed` as the agent does when its restore failed, reason "criu restore
/// failed".
fn fail_restore_as_agent(v: &PodVolumes) {
    write_atomically(
        &v.control.join(names::FILE_RESTORE_FAILED),
        r#"{"reason":"criu restore failed","at":"2026-12-03T00:00:00Z"}"#,
    );
}

fn agent(rt: &Runtime, args: &[&str], paths: &[&Path]) -> Output {
    let mut command = agent_cli::command(rt).unwrap();
    command.args(args).args(paths);
    agent_cli::run(command, agent_cli::DEFAULT_TIMEOUT).unwrap()
}

fn json_file(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text:?}", path.display()))
}

/// Waits until the server answers.
fn wait_serving(c: &Container) {
    c.wait_for_port(PORT, WAIT).unwrap();
}

/// SIGTERM to the container's PID 1 must stop the server and end the container with the
/// server's status (killed by SIGTERM).
fn terminate_and_expect_server_status(c: &Container) {
    c.signal("TERM").unwrap();
    let exit = c.wait_exit(WAIT).unwrap();
    assert_eq!(
        exit,
        ContainerExit::Code(KILLED_BY_SIGTERM),
        "log: {}",
        c.read_log()
    );
}

/// Starts the source, gives the server some state, checkpoints it; the artifact's path.
fn checkpoint_server(rt: &Runtime, image: &Image, python: &Python, out: &Path) -> PathBuf {
    let v = PodVolumes::with_entrypoint().unwrap();
    let src = Container::start_in(rt, &source_spec(image, python, &v)).unwrap();
    src.wait_for_log("ready, waiting for the checkpoint", WAIT)
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(v.signal.join(names::FILE_READY)).unwrap(),
        "ready\n"
    );
    src.exec_ok(["sh", "-c", "echo held-in-memory > /dev/shm/state.txt"])
        .unwrap();
    let (status, body) = src.http_get(PORT, "/state.txt").unwrap();
    assert_eq!((status, body.as_str()), (200, "held-in-memory\n"));
    let artifact = out.join("artifact");
    let run = agent(
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
        &[&artifact],
    );
    assert!(run.status.success(), "checkpoint failed");
    artifact
}

#[test]
fn an_unmodified_server_is_checkpointed_and_restored_into_a_standby_placeholder() {
    let s = Setup::new();
    let out = tempfile::tempdir().unwrap();
    let artifact = checkpoint_server(&s.rt, &s.image, &s.python, out.path());

    // A placeholder that would only cold-start after an hour: whatever serves is the restore.
    let v = PodVolumes::with_entrypoint().unwrap();
    let ph = Container::start_in(&s.rt, &placeholder_spec(&s.image, &s.python, &v, 3600)).unwrap();
    ph.wait_for_log("standby, waiting for a restore", WAIT)
        .unwrap();
    assert!(
        ph.net_connect(PORT).is_err(),
        "nothing serves while in standby"
    );
    let run = agent(
        &s.rt,
        &["restore", "--into-runc", ph.id(), "--artifact"],
        &[&artifact],
    );
    assert!(run.status.success(), "restore failed");

    // The restored server serves the state it had, from the placeholder's network namespace.
    wait_serving(&ph);
    let (status, body) = ph.http_get(PORT, "/state.txt").unwrap();
    assert_eq!((status, body.as_str()), (200, "held-in-memory\n"));
    ph.wait_for_log("supervising the restored process", WAIT)
        .unwrap();
    // The restored entrypoint (its output continues in the placeholder's log) stopped waiting
    // for the checkpoint's done file and now only supervises.
    ph.wait_for_log("restored, supervising the restored command", WAIT)
        .unwrap();
    let log = ph.read_log();
    assert!(!log.contains("cold start"), "{log}");
    assert!(!v.control.join(names::FILE_RESTORE_FAILED).exists());
    let claim = v.control.join(names::FILE_RESTORE_CLAIM);
    assert!(
        !claim.exists() || json_file(&claim)["by"] == "restore",
        "the entrypoint never claimed the placeholder"
    );

    terminate_and_expect_server_status(&ph);
    let log = ph.wait_for_log("forwarding signal", WAIT).unwrap();
    eprintln!("placeholder log:\n{log}");
}

#[test]
fn a_standby_placeholder_cold_starts_after_its_timeout() {
    let s = Setup::new();
    let v = PodVolumes::with_entrypoint().unwrap();
    let ph = Container::start_in(&s.rt, &placeholder_spec(&s.image, &s.python, &v, 1)).unwrap();

    wait_serving(&ph);
    // Fresh state: nothing in /dev/shm, but the server serves.
    assert_eq!(ph.http_get(PORT, "/state.txt").unwrap().0, 404);
    assert_eq!(ph.http_get(PORT, "/").unwrap().0, 200);
    let gate = json_file(&v.control.join(names::FILE_RESTORE_COMPLETE));
    assert_eq!(gate["coldStart"], true);
    assert_eq!(gate["reason"], "no restore within 1s");
    let claim = json_file(&v.control.join(names::FILE_RESTORE_CLAIM));
    assert_eq!(claim["by"], "cold-start");
    assert_eq!(claim["reason"], "no restore within 1s");
    // The server was started without the standby variables (it must not wait itself).
    let environ = ph
        .exec_ok([
            "sh",
            "-c",
            "cat /proc/$(pidof python3.11 || pidof python3)/environ",
        ])
        .unwrap();
    assert!(!environ.contains(names::ENV_RESTORE_STANDBY), "{environ}");

    terminate_and_expect_server_status(&ph);
}

/// The agent's refusal of a tampered artifact, then the cold start it leads to: the agent
/// claims the placeholder, writes `restore-failed` with its reason, and the entrypoint
/// cold-starts with that reason in the gate file.
#[test]
fn a_refused_restore_falls_back_to_a_cold_start_with_the_reason_in_the_gate_file() {
    let s = Setup::new();
    let out = tempfile::tempdir().unwrap();
    let artifact = checkpoint_server(&s.rt, &s.image, &s.python, out.path());
    tamper_one_image_file(&artifact);

    let v = PodVolumes::with_entrypoint().unwrap();
    let ph = Container::start_in(&s.rt, &placeholder_spec(&s.image, &s.python, &v, 3600)).unwrap();
    ph.wait_for_log("standby, waiting for a restore", WAIT)
        .unwrap();
    let run = agent(
        &s.rt,
        &["restore", "--into-runc", ph.id(), "--artifact"],
        &[&artifact],
    );
    assert!(!run.status.success(), "a tampered artifact was restored");
    let error = String::from_utf8_lossy(&run.stderr).trim().to_owned();
    assert!(error.contains("sha256"), "{error}");
    let failed = json_file(&v.control.join(names::FILE_RESTORE_FAILED));
    let reason = failed["reason"].as_str().unwrap().to_owned();
    assert!(reason.contains("sha256"), "{failed}");

    wait_serving(&ph);
    assert_eq!(
        ph.http_get(PORT, "/state.txt").unwrap().0,
        404,
        "fresh state, not the checkpoint's"
    );
    let gate = json_file(&v.control.join(names::FILE_RESTORE_COMPLETE));
    assert_eq!(gate["coldStart"], true);
    assert_eq!(gate["reason"], format!("restore failed: {reason}"));
    terminate_and_expect_server_status(&ph);
}

/// A late restore and the standby's own fallback race for the placeholder's claim: exactly one
/// wins, at any timing. Either the restore ran (the checkpoint's state serves, no cold start)
/// or the agent refused it naming the cold start (fresh state serves, nothing restored).
#[test]
fn a_late_restore_and_the_fallback_have_one_winner() {
    let s = Setup::new();
    let out = tempfile::tempdir().unwrap();
    let artifact = checkpoint_server(&s.rt, &s.image, &s.python, out.path());
    let mut outcomes = Vec::new();
    // The standby times out after 2 s; the restore starts before, around and after that.
    for delay_ms in [1_700_u64, 2_000, 2_300, 3_000] {
        let v = PodVolumes::with_entrypoint().unwrap();
        let ph = Container::start_in(&s.rt, &placeholder_spec(&s.image, &s.python, &v, 2)).unwrap();
        ph.wait_for_log("standby, waiting for a restore", WAIT)
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let run = agent(
            &s.rt,
            &["restore", "--into-runc", ph.id(), "--artifact"],
            &[&artifact],
        );
        wait_serving(&ph);
        let claim = json_file(&v.control.join(names::FILE_RESTORE_CLAIM));
        let (status, body) = ph.http_get(PORT, "/state.txt").unwrap();
        let servers = ph
            .exec_ok(["sh", "-c", "pidof python3.11 || pidof python3"])
            .unwrap();
        let servers = servers.split_whitespace().count();
        if run.status.success() {
            assert_eq!(claim["by"], "restore", "{claim}");
            assert_eq!((status, body.as_str()), (200, "held-in-memory\n"));
            assert!(!ph.read_log().contains("cold start"), "{}", ph.read_log());
        } else {
            let error = String::from_utf8_lossy(&run.stderr);
            assert!(error.contains("cold start"), "{error}");
            assert_eq!(claim["by"], "cold-start", "{claim}");
            assert_eq!(status, 404, "fresh state, not the checkpoint's");
            assert_eq!(
                json_file(&v.control.join(names::FILE_RESTORE_COMPLETE))["coldStart"],
                true
            );
        }
        assert_eq!(servers, 1, "exactly one server runs");
        outcomes.push(run.status.success());
        terminate_and_expect_server_status(&ph);
    }
    eprintln!("restore won at delays 1.7/2.0/2.3/3.0 s: {outcomes:?}");
    assert!(!outcomes[3], "a restore 1 s after the fallback must lose");
}

/// The entrypoint's half of the claim: once the agent holds the claim, the timeout does not
/// start the server (a restore is in flight); `restore-failed` then does. The claim and
/// `restore-failed` are written by the test in the place of an agent whose restore is slow and
/// then fails, to hold the placeholder in that state as long as the test needs.
#[test]
fn a_claimed_placeholder_waits_past_its_timeout_until_the_restore_fails() {
    let s = Setup::new();
    let v = PodVolumes::with_entrypoint().unwrap();
    claim_as_agent(&v);
    let ph = Container::start_in(&s.rt, &placeholder_spec(&s.image, &s.python, &v, 1)).unwrap();
    ph.wait_for_log("a restore is in flight", WAIT).unwrap();
    assert!(ph.net_connect(PORT).is_err(), "no cold start under a claim");
    assert!(!v.control.join(names::FILE_RESTORE_COMPLETE).exists());

    fail_restore_as_agent(&v);
    wait_serving(&ph);
    let gate = json_file(&v.control.join(names::FILE_RESTORE_COMPLETE));
    assert_eq!(gate["reason"], "restore failed: criu restore failed");
    assert_eq!(
        json_file(&v.control.join(names::FILE_RESTORE_CLAIM))["by"],
        "restore",
        "the agent's claim stays"
    );
    terminate_and_expect_server_status(&ph);
}

/// A signal in standby while a restore holds the claim is for the restored process (the agent
/// resumes it just before it writes `restore-complete`): the entrypoint waits for the restore's
/// outcome instead of exiting at once and taking the restored process down unsignalled. Here the
/// restore fails, so there is nothing to stop and nothing is cold-started.
#[test]
fn a_signal_during_a_restore_waits_for_its_outcome() {
    let s = Setup::new();
    let v = PodVolumes::with_entrypoint().unwrap();
    let ph = Container::start_in(&s.rt, &placeholder_spec(&s.image, &s.python, &v, 60)).unwrap();
    ph.wait_for_log("standby, waiting for a restore", WAIT)
        .unwrap();
    claim_as_agent(&v);
    ph.signal("TERM").unwrap();
    ph.wait_for_log("signalled while a restore holds the placeholder", WAIT)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(ph.state().unwrap(), "running", "{}", ph.read_log());

    fail_restore_as_agent(&v);
    assert_eq!(ph.wait_exit(WAIT).unwrap(), ContainerExit::Code(0));
    // The log pump may still be copying the last line when the exit is seen.
    let log = ph.wait_for_log("nothing to stop", WAIT).unwrap();
    assert!(!log.contains("cold start"), "{log}");
}

/// The same signal when the agent died holding the claim (neither `restore-complete` nor
/// `restore-failed` ever comes): the entrypoint waits no longer than its stop grace period, then
/// exits 0 with nothing restored and nothing cold-started.
#[test]
fn a_signal_during_a_restore_whose_agent_died_waits_only_the_grace_period() {
    let s = Setup::new();
    let v = PodVolumes::with_entrypoint().unwrap();
    claim_as_agent(&v);
    let spec =
        placeholder_spec(&s.image, &s.python, &v, 3600).with_env(names::ENV_STOP_GRACE_PERIOD, "2");
    let ph = Container::start_in(&s.rt, &spec).unwrap();
    ph.wait_for_log("standby, waiting for a restore", WAIT)
        .unwrap();
    let signalled = std::time::Instant::now();
    ph.signal("TERM").unwrap();
    assert_eq!(ph.wait_exit(WAIT).unwrap(), ContainerExit::Code(0));
    assert!(
        signalled.elapsed() >= Duration::from_secs(2),
        "it waited for the restore first: {}",
        ph.read_log()
    );
    // The log pump may still be copying the last line when the exit is seen.
    let log = ph.wait_for_log("nothing to stop", WAIT).unwrap();
    assert!(
        log.contains("signalled while a restore holds the placeholder"),
        "{log}"
    );
    assert!(!log.contains("cold start"), "{log}");
    assert!(!v.control.join(names::FILE_RESTORE_COMPLETE).exists());
}

#[test]
fn the_source_entrypoint_stops_the_server_and_exits_0_when_the_checkpoint_is_done() {
    let s = Setup::new();
    let v = PodVolumes::with_entrypoint().unwrap();
    let src = Container::start_in(&s.rt, &source_spec(&s.image, &s.python, &v)).unwrap();
    src.wait_for_log("ready, waiting for the checkpoint", WAIT)
        .unwrap();
    write_atomically(
        &v.signal.join(names::done_file_name(HASH)),
        r#"{"hash":"0123456789abcdef","location":"x","success":true,"timestamp":"t"}"#,
    );
    assert_eq!(src.wait_exit(WAIT).unwrap(), ContainerExit::Code(0));
    // The log pump may still be copying the last lines when the exit is seen.
    src.wait_for_log("command stopped", WAIT).unwrap();

    // A failed checkpoint: non-zero.
    let v = PodVolumes::with_entrypoint().unwrap();
    let src = Container::start_in(&s.rt, &source_spec(&s.image, &s.python, &v)).unwrap();
    src.wait_for_log("ready, waiting for the checkpoint", WAIT)
        .unwrap();
    write_atomically(
        &v.signal.join(names::done_file_name(HASH)),
        r#"{"hash":"0123456789abcdef","location":"x","success":false,"error":"dump failed","timestamp":"t"}"#,
    );
    assert_eq!(src.wait_exit(WAIT).unwrap(), ContainerExit::Code(1));
}

/// Flips a byte in the largest file of the artifact (a CRIU memory image), which its manifest
/// checksums.
fn tamper_one_image_file(artifact: &Path) {
    let mut largest: Option<(u64, PathBuf)> = None;
    let mut stack = vec![artifact.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() && largest.as_ref().is_none_or(|(size, _)| meta.len() > *size)
            {
                largest = Some((meta.len(), entry.path()));
            }
        }
    }
    let (_, path) = largest.unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
}

fn write_atomically(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
