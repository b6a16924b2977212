//! The `warmstart-controller` command line as a user runs it: output, exit codes and messages.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_warmstart-controller"))
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn run(args: &[&str], stdin: &str) -> Output {
    let mut child = bin()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn warmstart-controller");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child
        .wait_with_output()
        .expect("wait for warmstart-controller")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_lists_the_commands() {
    let out = run(&["--help"], "");
    assert!(out.status.success());
    for cmd in ["crd", "identity-hash", "render-job", "render-restore-pod"] {
        assert!(
            stdout(&out).contains(cmd),
            "--help lacks {cmd}: {}",
            stdout(&out)
        );
    }
}

#[test]
fn bad_flags_exit_2_with_a_message() {
    let out = run(&["--no-such-flag"], "");
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--no-such-flag"), "{}", stderr(&out));
}

#[test]
fn identity_hash_prints_the_golden_hash_from_a_file_and_stdin() {
    let golden = data("identity-golden.yaml");
    let out = run(&["identity-hash", golden.to_str().unwrap()], "");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "f4ba65bccbb8e4fb\n");

    let json = r#"{"model":"meta-llama/Llama-2-7b-hf","backendFramework":"vllm"}"#;
    let out = run(&["identity-hash", "-"], json);
    assert_eq!(stdout(&out), "96429b2725761a09\n");
    let out = run(
        &["identity-hash"],
        "model: meta-llama/Llama-2-7b-hf\nbackendFramework: vllm\n",
    );
    assert_eq!(stdout(&out), "96429b2725761a09\n");
}

#[test]
fn identity_hash_accepts_a_whole_checkpoint() {
    let out = run(
        &["identity-hash", data("checkpoint.yaml").to_str().unwrap()],
        "",
    );
    assert_eq!(stdout(&out), "96429b2725761a09\n", "{}", stderr(&out));
}

#[test]
fn identity_hash_rejects_bad_input_with_exit_2() {
    let cases = [
        ("", "standard input is empty"),
        (
            "model: [unclosed\n",
            "standard input is not a valid YAML or JSON document",
        ),
        ("backendFramework: vllm\n", "missing field `model`"),
        (
            "model: m\nbackendFramework: b\ntensorParalelSize: 2\n",
            "unknown field `tensorParalelSize`",
        ),
        (
            "model: m\nbackendFramework: b\nmaxModelLen: -1\n",
            "spec.identity.maxModelLen is -1",
        ),
        (
            "model: \"\"\nbackendFramework: b\n",
            "spec.identity.model is required",
        ),
        ("a: 1\n---\nb: 2\n", "several YAML documents"),
    ];
    for (input, message) in cases {
        let out = run(&["identity-hash", "-"], input);
        assert_eq!(out.status.code(), Some(2), "{input:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty());
        assert!(
            stderr(&out).contains(message),
            "{input:?}: {}",
            stderr(&out)
        );
    }
    let out = run(&["identity-hash", "/nonexistent/id.yaml"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("cannot read /nonexistent/id.yaml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn crd_prints_the_checkpoint_crd() {
    let out = run(&["crd"], "");
    assert!(out.status.success());
    let crd: serde_json::Value = serde_norway::from_str(&stdout(&out)).unwrap();
    assert_eq!(crd["kind"], "CustomResourceDefinition");
    assert_eq!(crd["metadata"]["name"], "checkpoints.warmstart.dev");
}

#[test]
fn render_job_prints_a_shaped_job() {
    let out = run(
        &[
            "render-job",
            "-f",
            data("checkpoint.yaml").to_str().unwrap(),
        ],
        "",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let job: k8s_openapi::api::batch::v1::Job = serde_norway::from_str(&stdout(&out)).unwrap();
    assert_eq!(job.metadata.name.as_deref(), Some("checkpoint-llama"));
    assert_eq!(job.metadata.namespace.as_deref(), Some("inference"));
    let text = stdout(&out);
    assert!(text.contains("apiVersion: batch/v1"));
    // The location is relative to the artifact root: every program mounts the volume where it
    // likes, the agent and the controller resolve it under their own root.
    let env = job.spec.unwrap().template.spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap();
    let location = env
        .iter()
        .find(|e| e.name == "WARMSTART_CHECKPOINT_LOCATION")
        .and_then(|e| e.value.clone());
    assert_eq!(location.as_deref(), Some("inference/96429b2725761a09"));
    assert!(!text.contains("/var/lib/warmstart"), "{text}");
}

#[test]
fn render_job_without_uid_says_how_to_fix_it() {
    let text = std::fs::read_to_string(data("checkpoint.yaml")).unwrap();
    let no_uid = text.replace("  uid: 6f1d2c3b-0000-4000-8000-000000000001\n", "");
    let out = run(&["render-job", "-f", "-"], &no_uid);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("checkpoint inference/llama has no metadata.uid"),
        "{}",
        stderr(&out)
    );
    let out = run(&["render-job", "-f", "-", "--uid", "abc"], &no_uid);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("uid: abc"));
}

#[test]
fn render_job_with_a_missing_target_container_names_it() {
    let text = std::fs::read_to_string(data("checkpoint.yaml")).unwrap();
    let bad = text.replace("  job:\n", "  job:\n    targetContainerName: worker\n");
    let out = run(&["render-job", "-f", "-"], &bad);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("worker"), "{}", stderr(&out));
}

#[test]
fn render_restore_pod_stamps_the_binding_and_shapes_the_pod() {
    let out = run(
        &[
            "render-restore-pod",
            "--checkpoint",
            data("checkpoint.yaml").to_str().unwrap(),
            "-f",
            data("restore-pod.yaml").to_str().unwrap(),
        ],
        "",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let pod: k8s_openapi::api::core::v1::Pod = serde_norway::from_str(&stdout(&out)).unwrap();
    let binding = &pod.metadata.annotations.as_ref().unwrap()["warmstart.dev/checkpoint-binding"];
    assert!(
        binding.starts_with("v1/6f1d2c3b-0000-4000-8000-000000000001/1/"),
        "{binding}"
    );
    let main = &pod.spec.as_ref().unwrap().containers[0];
    let probe = main.startup_probe.as_ref().unwrap();
    assert!(
        probe.exec.is_some(),
        "startup probe replaced by the restore gate"
    );
    assert!(
        main.liveness_probe.as_ref().unwrap().http_get.is_some(),
        "liveness kept"
    );
}

#[test]
fn render_restore_pod_refuses_a_checkpoint_that_is_not_ready() {
    let text = std::fs::read_to_string(data("checkpoint.yaml")).unwrap();
    let pending = text.replace("phase: Ready", "phase: Creating");
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck.yaml");
    std::fs::write(&ck, pending).unwrap();
    let pod = std::fs::read_to_string(data("restore-pod.yaml")).unwrap();
    let out = run(
        &[
            "render-restore-pod",
            "--checkpoint",
            ck.to_str().unwrap(),
            "-f",
            "-",
        ],
        &pod,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("checkpoint inference/llama is not Ready (phase Creating)"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn render_restore_pod_refuses_another_namespace_and_unknown_targets() {
    let ck = data("checkpoint.yaml");
    let pod = std::fs::read_to_string(data("restore-pod.yaml")).unwrap();
    let other_ns = pod.replace("namespace: inference", "namespace: other");
    let out = run(
        &[
            "render-restore-pod",
            "--checkpoint",
            ck.to_str().unwrap(),
            "-f",
            "-",
        ],
        &other_ns,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("restores only from its own namespace"),
        "{}",
        stderr(&out)
    );

    let unknown = pod.replace("target-containers: main", "target-containers: main,sidecar");
    let out = run(
        &[
            "render-restore-pod",
            "--checkpoint",
            ck.to_str().unwrap(),
            "-f",
            "-",
        ],
        &unknown,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("sidecar"), "{}", stderr(&out));
}

#[test]
fn completion_prints_a_script_for_the_shell() {
    let o = run(&["completion", "bash"], "");
    assert!(o.status.success(), "{}", stderr(&o));
    let script = stdout(&o);
    for command in ["render-job", "render-restore-pod", "identity-hash", "run"] {
        assert!(script.contains(command), "{command} missing");
    }
    let o = run(&["completion", "cmd.exe"], "");
    assert_eq!(o.status.code(), Some(2));
}

/// `run`'s log lines on a pipe (a container's log, `kubectl logs`) are plain text: no terminal
/// colour escapes. Made to log by an API server that refuses connections (a loopback port
/// nobody listens on).
#[test]
fn run_logs_without_colour_escapes_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: c, cluster: {{server: \"http://127.0.0.1:{port}\"}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\n\
             contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\ncurrent-context: c\n"
        ),
    )
    .unwrap();
    let artifacts = dir.path().join("artifacts");
    std::fs::create_dir(&artifacts).unwrap();
    let mut child = bin()
        .args(["run", "--identity", "test", "--admin-listen", "127.0.0.1:0"])
        .args(["--webhook-listen", "127.0.0.1:0", "--artifact-root"])
        .arg(&artifacts)
        .arg("--webhook-cert-dir")
        .arg(dir.path().join("tls"))
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let log = stderr(&out);
    assert!(log.contains("ERROR"), "a log line was written: {log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour escapes in the log: {log:?}"
    );
}
