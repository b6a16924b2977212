//! Runs the sample worker binary for real (loopback HTTP, temp signal and control directories)
//! and plays the agent's side of the protocol: ready file, restore-complete, `<hash>.done`.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use warmstart_shared::names;

const WORKER: &str = env!("CARGO_BIN_EXE_warmstart-sample-worker");
const HASH: &str = "96429b2725761a09";
/// Generous: a debug build under a loaded CI machine.
const DEADLINE: Duration = Duration::from_secs(60);

/// A running worker; killed (only this PID) and reaped if the test fails before it exits.
struct Worker {
    child: Option<Child>,
    lines: Receiver<String>,
    log: Vec<String>,
    addr: Option<SocketAddr>,
    dir: tempfile::TempDir,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Worker {
    /// Starts the worker with 4 MiB of weights, 100 ms of warm-up and a free loopback port.
    fn start(with_signal_file: bool) -> Self {
        Self::start_with(with_signal_file, &[], &|_| {})
    }

    /// [`Worker::start`] with more environment, after `prepare` saw the (new) control directory.
    fn start_with(with_signal_file: bool, env: &[(&str, &str)], prepare: &dyn Fn(&Path)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("control")).unwrap();
        prepare(&dir.path().join("control"));
        let mut command = Command::new(WORKER);
        command
            .args(["--weights-mib", "4", "--warmup-ms", "100"])
            .args(["--listen", "127.0.0.1", "--port", "0"])
            .env_clear()
            .env(
                names::ENV_READY_FILE,
                dir.path().join("signal").join(names::FILE_READY),
            )
            .env(names::ENV_CONTROL_DIR, dir.path().join("control"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if with_signal_file {
            command.env(names::ENV_SIGNAL_FILE, signal_path(dir.path()));
        }
        command.envs(env.iter().copied());
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child: Some(child),
            lines,
            log: Vec::new(),
            addr: None,
            dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn ready_file(&self) -> PathBuf {
        self.dir.path().join("signal").join(names::FILE_READY)
    }

    /// Waits for a log line containing `needle`, returning it.
    fn wait_for_line(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "no log line with {needle:?} in time; log:\n{}",
                        self.log.join("\n")
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!(
                        "worker stdout closed before {needle:?}; log:\n{}",
                        self.log.join("\n")
                    )
                }
            }
        }
    }

    /// Waits for the ready file, then learns the port from the log.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + DEADLINE;
        // The file's existence is the signal; its content is written right after it is
        // created, so wait for the content rather than race the writer.
        while std::fs::read_to_string(self.ready_file()).ok().as_deref() != Some("ready\n") {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "worker exited before ready: {status}; log:\n{}",
                    self.log.join("\n")
                );
            }
            assert!(Instant::now() < deadline, "no ready file in time");
            thread::sleep(Duration::from_millis(20));
        }
        let line = self.wait_for_line("listening on ");
        let addr = line.rsplit("listening on ").next().unwrap().trim();
        self.addr = Some(addr.parse().unwrap());
        self.wait_for_line("ready in");
    }

    /// Sends a raw request and returns (status, body).
    fn raw(&self, request: &[u8]) -> (u16, String) {
        let mut stream = TcpStream::connect(self.addr.unwrap()).unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        stream.write_all(request).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, body.to_owned())
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.raw(
            format!("GET {path} HTTP/1.1\r\nHost: worker\r\nConnection: close\r\n\r\n").as_bytes(),
        )
    }

    fn get_json(&self, path: &str) -> Value {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Waits for the worker to exit and returns its status (the guard then has nothing to kill).
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + DEADLINE;
        let child = self.child.as_mut().unwrap();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(Instant::now() < deadline, "worker did not exit in time");
            thread::sleep(Duration::from_millis(20));
        }
    }
}

fn signal_path(dir: &Path) -> PathBuf {
    dir.join("signal").join(names::done_file_name(HASH))
}

/// Writes a file the way the agent does: a temporary file, then a rename.
fn write_atomically(path: &Path, content: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn done_json(success: bool) -> String {
    serde_json::json!({
        "hash": HASH,
        "location": format!("/var/lib/warmstart/checkpoints/default/{HASH}"),
        "success": success,
        "error": if success { Value::Null } else { "criu dump failed".into() },
        "timestamp": "2025-01-01T00:00:00Z",
    })
    .to_string()
}

#[test]
fn serves_then_follows_restore_complete_and_a_failed_done_file() {
    let mut worker = Worker::start(true);
    worker.wait_ready();

    assert_eq!(worker.get("/health"), (200, "ok".to_owned()));
    let first = worker.get_json("/state");
    let second = worker.get_json("/state");
    assert!(
        second["requests"].as_u64().unwrap() > first["requests"].as_u64().unwrap(),
        "{first} {second}"
    );
    let sha = first["weightsSha256"].as_str().unwrap();
    assert_eq!(sha.len(), 64);
    assert_eq!(second["weightsSha256"], sha);
    assert_eq!(first["weightsMib"], 4);
    assert_eq!(first["restored"], false);
    assert_eq!(first["pid"], worker.pid());
    assert_eq!(first["startedAt"], second["startedAt"]);
    assert!(first["startedAt"].as_u64().unwrap() > 1_600_000_000_000);
    assert!(first["hostname"].is_string());

    let verify = worker.get_json("/weights/verify");
    assert_eq!(verify["matches"], true);
    assert_eq!(verify["weightsSha256"], sha);
    assert_eq!(worker.get("/nope").0, 404);
    assert_eq!(worker.raw(b"NOT A REQUEST\r\n\r\n").0, 400);
    assert_eq!(worker.raw(b"\x00\x01\x02\r\n\r\n").0, 400);
    assert_eq!(
        worker.get("/health").0,
        200,
        "still serving after bad requests"
    );

    write_atomically(
        &worker
            .dir
            .path()
            .join("control")
            .join(names::FILE_RESTORE_COMPLETE),
        "",
    );
    worker.wait_for_line("restored, continuing");
    let restored = worker.get_json("/state");
    assert_eq!(restored["restored"], true);
    assert_eq!(restored["weightsSha256"], sha);

    // A restored copy ignores the done file (restore-complete is checked first) ...
    let signal = signal_path(worker.dir.path());
    write_atomically(&signal, &done_json(false));
    thread::sleep(Duration::from_millis(300));
    assert_eq!(worker.get("/health").0, 200);
    let mut worker = {
        drop(worker);
        Worker::start(true)
    };

    // ... while the original exits 1 on a failed checkpoint.
    worker.wait_ready();
    write_atomically(&signal_path(worker.dir.path()), &done_json(false));
    worker.wait_for_line("checkpoint failed");
    assert_eq!(
        worker.wait_exit().code(),
        Some(1),
        "{}",
        worker.log.join("\n")
    );
}

#[test]
fn exits_zero_on_a_successful_done_file() {
    let mut worker = Worker::start(true);
    worker.wait_ready();
    assert_eq!(worker.get("/health").0, 200);
    write_atomically(&signal_path(worker.dir.path()), &done_json(true));
    worker.wait_for_line("checkpoint done");
    assert_eq!(
        worker.wait_exit().code(),
        Some(0),
        "{}",
        worker.log.join("\n")
    );
}

#[test]
fn exits_one_on_an_unparsable_done_file() {
    let mut worker = Worker::start(true);
    worker.wait_ready();
    write_atomically(&signal_path(worker.dir.path()), "{not json");
    worker.wait_for_line("is unusable");
    assert_eq!(
        worker.wait_exit().code(),
        Some(1),
        "{}",
        worker.log.join("\n")
    );
}

#[test]
fn without_a_signal_file_it_serves_until_sigterm() {
    let mut worker = Worker::start(false);
    worker.wait_ready();
    assert_eq!(worker.get("/health").0, 200);
    let pid = Pid::from_raw(i32::try_from(worker.pid()).unwrap());
    kill(pid, Signal::SIGTERM).unwrap();
    worker.wait_for_line("SIGTERM received");
    assert_eq!(
        worker.wait_exit().code(),
        Some(0),
        "{}",
        worker.log.join("\n")
    );
}

fn control_json(worker: &Worker, file: &str) -> Value {
    let path = worker.dir.path().join("control").join(file);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn in_standby_it_loads_nothing_until_a_restore_fails_then_cold_starts() {
    let mut worker = Worker::start_with(false, &[(names::ENV_RESTORE_STANDBY, "1")], &|_| {});
    worker.wait_for_line("standby, waiting for a restore");
    assert!(!worker.ready_file().exists());
    write_atomically(
        &worker
            .dir
            .path()
            .join("control")
            .join(names::FILE_RESTORE_FAILED),
        r#"{"reason":"checksum mismatch","at":"2026-12-03T00:00:00Z"}"#,
    );
    worker.wait_for_line("cold start: restore failed: checksum mismatch");
    worker.wait_ready();
    // Its own gate file is not taken for a restore.
    assert_eq!(worker.get_json("/state")["restored"], false);
    let gate = control_json(&worker, names::FILE_RESTORE_COMPLETE);
    assert_eq!(gate["coldStart"], true);
    assert_eq!(gate["reason"], "restore failed: checksum mismatch");
    assert_eq!(
        control_json(&worker, names::FILE_RESTORE_CLAIM)["by"],
        "cold-start"
    );
    kill(
        Pid::from_raw(worker.pid().try_into().unwrap()),
        Signal::SIGTERM,
    )
    .unwrap();
    assert!(worker.wait_exit().success());
}

#[test]
fn in_standby_it_cold_starts_after_its_timeout_unless_a_restore_holds_the_claim() {
    let env = [
        (names::ENV_SNAPSHOT_RESTORE_STANDBY, "1"),
        (names::ENV_RESTORE_TIMEOUT, "1s"),
    ];
    let mut worker = Worker::start_with(false, &env, &|_| {});
    worker.wait_for_line("cold start: no restore within 1s");
    worker.wait_ready();
    assert_eq!(
        control_json(&worker, names::FILE_RESTORE_COMPLETE)["coldStart"],
        true
    );
    drop(worker);

    // The agent claimed the placeholder: the timeout does not start the worker.
    let mut claimed = Worker::start_with(false, &env, &|control| {
        std::fs::write(
            control.join(names::FILE_RESTORE_CLAIM),
            r#"{"by":"restore","pid":7,"at":"2026-12-03T00:00:00Z"}"#,
        )
        .unwrap();
    });
    claimed.wait_for_line("a restore is in flight, still waiting");
    assert!(!claimed.ready_file().exists());
    write_atomically(
        &claimed
            .dir
            .path()
            .join("control")
            .join(names::FILE_RESTORE_FAILED),
        r#"{"reason":"criu restore failed","at":"2026-12-03T00:00:00Z"}"#,
    );
    claimed.wait_ready();
    assert_eq!(
        control_json(&claimed, names::FILE_RESTORE_CLAIM)["by"],
        "restore"
    );
}
