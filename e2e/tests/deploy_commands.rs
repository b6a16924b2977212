//! Every container in `deploy/` that runs a warmstart program starts it with a command line its
//! argument parser accepts: the manifests are rendered with the real `kubectl kustomize`, each
//! container's program and arguments are taken from its `command`/`args` or, where it leaves
//! them out, from its image's `ENTRYPOINT`/`CMD` (`deploy/images/*.Containerfile`), and the
//! program built here is started with exactly those arguments and the container's environment
//! (downward-API values stand in as plain strings). A usage error (exit status 2, clap's
//! "Usage:") fails the test; a program that parsed its flags and then stopped for lack of a
//! cluster (no kubeconfig, no node directories) passes: that is as far as a command line goes.
//!
//! Nothing is contacted: the programs get `KUBECONFIG` pointing at a missing file and no
//! in-cluster environment, and are killed (by PID) if they run past a bound.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use warmstart_e2e::cluster::render_deploy;
use warmstart_e2e::{agent_cli, binaries};

/// How long a program may take to give up without a cluster.
const BOUND: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// An image's `ENTRYPOINT` and `CMD` (exec form) from its Containerfile.
fn image_command(containerfile: &str) -> (Vec<String>, Vec<String>) {
    let text = std::fs::read_to_string(repo().join("deploy/images").join(containerfile)).unwrap();
    let exec_form = |directive: &str| -> Vec<String> {
        let line = text
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(directive))
            .unwrap_or_else(|| panic!("{containerfile} has no {directive}"));
        serde_json::from_str(line.trim())
            .unwrap_or_else(|e| panic!("{containerfile}: {directive} is not exec form: {e}"))
    };
    (exec_form("ENTRYPOINT "), exec_form("CMD "))
}

/// A warmstart program as an image runs it.
struct Program {
    /// The image repository (`ghcr.io/warmstart/agent`).
    image: &'static str,
    /// Its `ENTRYPOINT` and `CMD`.
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    /// The binary built here.
    binary: PathBuf,
}

fn programs() -> Vec<Program> {
    let (entrypoint, cmd) = image_command("agent.Containerfile");
    let agent = Program {
        image: "ghcr.io/warmstart/agent",
        entrypoint,
        cmd,
        binary: binaries::agent().unwrap(),
    };
    let (entrypoint, cmd) = image_command("controller.Containerfile");
    let controller = Program {
        image: "ghcr.io/warmstart/controller",
        entrypoint,
        cmd,
        binary: binaries::controller().unwrap(),
    };
    vec![agent, controller]
}

/// A container's environment as plain strings: downward-API fields become stand-in values.
fn environment(container: &Value) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap().to_owned();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_owned()
        } else if let Some(path) = var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            match path {
                "spec.nodeName" => "node-a".to_owned(),
                "metadata.name" => "pod-a".to_owned(),
                "metadata.namespace" => "warmstart-system".to_owned(),
                other => format!("stand-in-for-{other}"),
            }
        } else {
            panic!("{name}: only value and fieldRef are expected in deploy/");
        };
        env.push((name, value));
    }
    env
}

/// Runs `binary` with `args` and `env` as the container would; the reason it refused its
/// command line, if it did.
fn usage_error(binary: &Path, args: &[String], env: &[(String, String)]) -> Option<String> {
    let mut command = Command::new(binary);
    command
        .args(args)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env(
            "KUBECONFIG",
            "/nonexistent/warmstart-deploy-test/kubeconfig",
        )
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(std::env::temp_dir());
    let out = agent_cli::run(command, BOUND).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code() == Some(2) || stderr.contains("Usage:")).then_some(stderr)
}

/// How a container starts a warmstart program.
struct Launch {
    /// `<kind> <name> <list>/<container>`.
    place: String,
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// The warmstart containers of every workload in the rendered deploy.
fn warmstart_containers(objects: &[Value]) -> Vec<Launch> {
    let programs = programs();
    let mut found = Vec::new();
    for object in objects {
        let template = &object["spec"]["template"]["spec"];
        if template.is_null() {
            continue;
        }
        for list in ["initContainers", "containers"] {
            for container in template[list].as_array().into_iter().flatten() {
                let image = container["image"].as_str().unwrap();
                let repository = image.rsplit_once(':').map_or(image, |(r, _)| r);
                let Some(program) = programs.iter().find(|p| p.image == repository) else {
                    continue;
                };
                let strings = |v: &Value| -> Option<Vec<String>> {
                    v.as_array()
                        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
                };
                let command = strings(&container["command"]);
                let args = strings(&container["args"]);
                // Kubernetes: `command` replaces ENTRYPOINT (and drops CMD), `args` replaces CMD.
                let argv: Vec<String> = match (command, args) {
                    (Some(command), args) => command
                        .into_iter()
                        .chain(args.unwrap_or_default())
                        .collect(),
                    (None, Some(args)) => program.entrypoint.iter().cloned().chain(args).collect(),
                    (None, None) => program
                        .entrypoint
                        .iter()
                        .chain(&program.cmd)
                        .cloned()
                        .collect(),
                };
                // A shell step in a warmstart image (the seccomp installer) is not ours to parse.
                if argv.first() != program.entrypoint.first() {
                    continue;
                }
                let place = format!(
                    "{} {} {list}/{}",
                    object["kind"].as_str().unwrap(),
                    object["metadata"]["name"].as_str().unwrap(),
                    container["name"].as_str().unwrap()
                );
                found.push(Launch {
                    place,
                    binary: program.binary.clone(),
                    args: argv[1..].to_vec(),
                    env: environment(container),
                });
            }
        }
    }
    found
}

#[test]
fn every_warmstart_container_in_deploy_starts_with_arguments_its_program_accepts() {
    let objects = render_deploy().unwrap();
    let containers = warmstart_containers(&objects);
    let places: BTreeSet<&str> = containers.iter().map(|l| l.place.as_str()).collect();
    for expected in [
        "DaemonSet warmstart-agent containers/agent",
        "Deployment warmstart-controller containers/controller",
    ] {
        assert!(
            places.contains(expected),
            "{expected} not found in {places:?}"
        );
    }
    for l in &containers {
        if let Some(stderr) = usage_error(&l.binary, &l.args, &l.env) {
            panic!(
                "{}: {} {:?} is refused:\n{stderr}",
                l.place,
                l.binary.display(),
                l.args
            );
        }
    }
}

/// The same for the Helm chart, with its defaults and with the settings that change the
/// agent's and the controller's environment.
#[test]
fn every_warmstart_container_the_chart_renders_starts_with_arguments_its_program_accepts() {
    let cases: [&[&str]; 4] = [
        &[],
        &["runtime.name=crio", "agent.requireCuda=false"],
        &["runtime.name=k3s", "kubeletRoot=/data/kubelet"],
        &[
            "runtime.socket=/run/custom/cri.sock",
            "image.wrap.repository=registry.example/entrypoint",
        ],
    ];
    for values in cases {
        let objects = warmstart_e2e::manifests::helm_template(values).unwrap();
        let containers = warmstart_containers(&objects);
        let places: BTreeSet<&str> = containers.iter().map(|l| l.place.as_str()).collect();
        assert_eq!(
            places,
            BTreeSet::from([
                "DaemonSet warmstart-agent containers/agent",
                "Deployment warmstart-controller containers/controller",
                "Job warmstart-uninstall containers/stop-workloads",
            ]),
            "{values:?}"
        );
        for l in &containers {
            if let Some(stderr) = usage_error(&l.binary, &l.args, &l.env) {
                panic!(
                    "chart with {values:?}: {}: {} {:?} is refused:\n{stderr}",
                    l.place,
                    l.binary.display(),
                    l.args
                );
            }
        }
    }
}

/// The check above catches a command line the program does not accept.
#[test]
fn a_command_line_the_program_does_not_accept_is_caught() {
    let objects = render_deploy().unwrap();
    let Launch {
        place,
        binary,
        mut args,
        env,
    } = warmstart_containers(&objects)
        .into_iter()
        .find(|l| l.place.starts_with("DaemonSet"))
        .unwrap();
    args.push("--no-such-flag".to_owned());
    assert!(
        usage_error(&binary, &args, &env).is_some(),
        "{place} with --no-such-flag was accepted"
    );
    // A required setting the environment no longer provides is caught too.
    let without_node: Vec<(String, String)> =
        env.into_iter().filter(|(k, _)| k != "NODE_NAME").collect();
    args.pop();
    assert!(
        usage_error(&binary, &args, &without_node).is_some(),
        "{place} without NODE_NAME was accepted"
    );
}
