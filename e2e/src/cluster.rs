//! Building blocks of a simulated cluster for the end-to-end tests: the API server double with
//! the CRD and the admission webhook configurations applied from `deploy/`, and the real
//! `warmstart-controller run` and `warmstart-agent run` programs started against it as child
//! processes (killed when dropped). Test infrastructure only.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::PostParams;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::apiserver::ApiServer;
use crate::binaries;
use crate::fixture::{FixtureError, Result};
use crate::rbac::service_account_user;

/// The repository's root (for `deploy/`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A free loopback address.
///
/// # Errors
/// When no port can be bound.
pub fn free_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| FixtureError::Invalid(format!("bind a free port: {e}")))?;
    listener
        .local_addr()
        .map_err(|e| FixtureError::Invalid(format!("local address: {e}")))
}

/// The YAML documents of a file, as JSON values.
///
/// # Errors
/// Unreadable or unparsable files.
pub fn yaml_docs(path: &Path) -> Result<Vec<Value>> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path)
        .map_err(|e| FixtureError::Invalid(format!("{}: {e}", path.display())))?;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let value = Value::deserialize(doc)
            .map_err(|e| FixtureError::Invalid(format!("{}: {e}", path.display())))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

fn api_error(what: &str) -> impl FnOnce(kube::Error) -> FixtureError + '_ {
    move |e| FixtureError::Invalid(format!("{what}: {e}"))
}

/// Applies the Checkpoint CRD exactly as deployed and creates `namespaces`.
///
/// # Errors
/// API errors.
pub async fn install_crd(client: &kube::Client, namespaces: &[&str]) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let doc = yaml_docs(&repo().join("deploy/crd/checkpoint.yaml"))?
        .into_iter()
        .next()
        .ok_or_else(|| FixtureError::Invalid("deploy/crd/checkpoint.yaml is empty".into()))?;
    let crd =
        serde_json::from_value(doc).map_err(|e| FixtureError::Invalid(format!("the CRD: {e}")))?;
    crds.create(&PostParams::default(), &crd)
        .await
        .map_err(api_error("create the CRD"))?;
    let api: Api<Namespace> = Api::all(client.clone());
    for ns in namespaces {
        let namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))
            .map_err(|e| FixtureError::Invalid(format!("namespace {ns}: {e}")))?;
        // An existing namespace is fine.
        let _ = api.create(&PostParams::default(), &namespace).await;
    }
    Ok(())
}

/// The namespace `deploy/` installs warmstart into.
pub const DEPLOY_NAMESPACE: &str = "warmstart-system";

/// `deploy/` rendered as `kubectl apply -k deploy` would apply it.
///
/// # Errors
/// When kubectl is missing or kustomize fails.
pub fn render_deploy() -> Result<Vec<Value>> {
    let out = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(repo().join("deploy"))
        .output()
        .map_err(|e| FixtureError::Invalid(format!("kubectl kustomize deploy: {e}")))?;
    if !out.status.success() {
        return Err(FixtureError::Invalid(format!(
            "kubectl kustomize deploy: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| {
            serde::Deserialize::deserialize(doc)
                .map_err(|e| FixtureError::Invalid(format!("kustomize output: {e}")))
        })
        .filter(|v| !matches!(v, Ok(Value::Null)))
        .collect()
}

/// Checks that every request `user` made to `api` is allowed by the RBAC that `deploy/` grants
/// its ServiceAccount `warmstart-system/<service_account>`; the refused ones, each with its
/// attributes.
///
/// # Errors
/// When `deploy/` cannot be rendered.
pub fn requests_outside_rbac(api: &ApiServer, service_account: &str) -> Result<Vec<String>> {
    let objects = render_deploy()?;
    let authorizer =
        crate::rbac::Authorizer::for_service_account(&objects, DEPLOY_NAMESPACE, service_account);
    let user = service_account_user(DEPLOY_NAMESPACE, service_account);
    let mut refused: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.user == user && authorizer.allowing(r).is_none())
        .map(|r| r.to_string())
        .collect();
    refused.sort();
    refused.dedup();
    Ok(refused)
}

/// Labels namespace `ns` to enforce the Pod Security `level` (`baseline`, `restricted`): the
/// API double then refuses pods created there that fail it, as a cluster's Pod Security
/// admission does.
///
/// # Errors
/// API errors.
pub async fn enforce_pod_security(client: &kube::Client, ns: &str, level: &str) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let patch = json!({"metadata": {"labels": {
        crate::apiserver::podsecurity::ENFORCE_LABEL: level,
    }}});
    api.patch(
        ns,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .map_err(api_error("label the namespace for Pod Security"))?;
    Ok(())
}

/// Applies the mutating and validating webhook configurations of `deploy/webhook/` and routes
/// their Service to `addr`, where the controller's webhook will listen.
///
/// # Errors
/// API errors.
pub async fn install_webhooks(api: &ApiServer, addr: SocketAddr) -> Result<()> {
    let client = api.client();
    for file in [
        "deploy/webhook/mutating.yaml",
        "deploy/webhook/validating.yaml",
    ] {
        for doc in yaml_docs(&repo().join(file))? {
            let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
            let resource: Api<kube::core::DynamicObject> = Api::all_with(
                client.clone(),
                &kube::discovery::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
                    "admissionregistration.k8s.io",
                    "v1",
                    &kind,
                )),
            );
            let object = serde_json::from_value(doc)
                .map_err(|e| FixtureError::Invalid(format!("{file}: {e}")))?;
            resource
                .create(&PostParams::default(), &object)
                .await
                .map_err(api_error(file))?;
        }
    }
    api.route_service("warmstart-system", "warmstart-controller", 443, addr);
    Ok(())
}

/// A program of ours running as a child process, killed and reaped when dropped; its output
/// goes to a log file.
#[derive(Debug)]
pub struct Program {
    child: Option<Child>,
    /// The program's own PID when it runs under [`binaries::shim`] (`child` is the shim).
    shimmed: Option<Pid>,
    log: PathBuf,
}

impl Program {
    fn spawn(mut command: Command, log: PathBuf) -> Result<Self> {
        let file = std::fs::File::create(&log)
            .map_err(|e| FixtureError::Invalid(format!("{}: {e}", log.display())))?;
        let err = file
            .try_clone()
            .map_err(|e| FixtureError::Invalid(format!("{}: {e}", log.display())))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .map_err(|e| FixtureError::Invalid(format!("spawn {command:?}: {e}")))?;
        Ok(Self {
            child: Some(child),
            shimmed: None,
            log,
        })
    }

    /// [`Program::spawn`] under [`binaries::shim`], which reaps the orphans the program leaves
    /// when it is killed, as a node's runtime shim does for a pod (see the shim's docs).
    ///
    /// # Errors
    /// Spawn or I/O errors; the shim not starting the program within 10 s.
    pub fn spawn_shimmed(command: &Command, log: PathBuf) -> Result<Self> {
        let mut shimmed = Command::new(binaries::shim()?);
        shimmed.arg(command.get_program()).args(command.get_args());
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => shimmed.env(key, value),
                None => shimmed.env_remove(key),
            };
        }
        if let Some(dir) = command.get_current_dir() {
            shimmed.current_dir(dir);
        }
        let mut program = Self::spawn(shimmed, log)?;
        let shim = program.child.as_ref().map_or(0, Child::id);
        let children = format!("/proc/{shim}/task/{shim}/children");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let first = std::fs::read_to_string(&children)
                .ok()
                .and_then(|c| c.split_whitespace().next().and_then(|p| p.parse().ok()));
            if let Some(pid) = first {
                program.shimmed = Some(Pid::from_raw(pid));
                return Ok(program);
            }
            if std::time::Instant::now() > deadline {
                return Err(FixtureError::Invalid(format!(
                    "the shim (pid {shim}) started no program in 10 s: {}",
                    program.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The program's PID.
    pub fn pid(&self) -> Option<Pid> {
        self.shimmed.or_else(|| {
            self.child
                .as_ref()
                .and_then(|c| i32::try_from(c.id()).ok())
                .map(Pid::from_raw)
        })
    }

    /// SIGKILLs it (under the shim: the program, then the shim ends once it reaped the
    /// program's orphans).
    pub fn kill(&mut self) {
        let _ = self.signal_and_wait(Signal::SIGKILL);
    }

    /// Sends `signal` to the program and waits for it (and its shim) to end.
    ///
    /// # Errors
    /// When it has already been waited for.
    pub fn signal_and_wait(&mut self, signal: Signal) -> Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| FixtureError::Invalid("the program already ended".to_owned()))?;
        match self.shimmed {
            // The shim has not reaped the program while it is its child: the PID is still its.
            Some(pid)
                if warmstart_agent::runtime::stat::parent(pid.as_raw())
                    .and_then(|p| u32::try_from(p).ok())
                    == Some(child.id()) =>
            {
                let _ = nix::sys::signal::kill(pid, signal);
            }
            Some(_) => {}
            None => {
                if let Ok(pid) = i32::try_from(child.id()) {
                    let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
                }
            }
        }
        child
            .wait()
            .map_err(|e| FixtureError::Invalid(format!("wait for the program: {e}")))
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `warmstart-controller run` against `api`, its webhook on `webhook`, artifacts under
/// `artifact_root`, its files (kubeconfig, certificates, log) in `dir`.
///
/// # Errors
/// Spawn or I/O errors.
pub fn start_controller(
    api: &ApiServer,
    dir: &Path,
    artifact_root: &Path,
    webhook: SocketAddr,
) -> Result<Program> {
    // One kubeconfig per program: they may share `dir`, and each is its own user.
    let kubeconfig = dir.join("controller.kubeconfig");
    api.kubeconfig_as(
        &kubeconfig,
        &service_account_user(DEPLOY_NAMESPACE, "warmstart-controller"),
    )
    .map_err(|e| FixtureError::Invalid(format!("kubeconfig: {e}")))?;
    let mut command = Command::new(binaries::controller()?);
    command
        .arg("run")
        .arg("--artifact-root")
        .arg(artifact_root)
        .args(["--admin-listen", &free_addr()?.to_string()])
        .args(["--webhook-listen", &webhook.to_string()])
        .arg("--webhook-cert-dir")
        .arg(dir.join("controller-tls"))
        .args(["--identity", "controller-0", "--lease-seconds", "3"])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info,warmstart_controller=debug");
    Program::spawn(command, dir.join("controller.log"))
}

/// Where an agent runs: its node, the node's kubelet root and runc root, the artifact root.
#[derive(Clone, Debug)]
pub struct AgentSetup {
    /// The node's name.
    pub node: String,
    /// The kubelet root of the node.
    pub kubelet_root: PathBuf,
    /// runc's state root of the node.
    pub runc_root: PathBuf,
    /// The artifact root (the PVC).
    pub artifact_root: PathBuf,
    /// The agent's journal.
    pub state_dir: PathBuf,
    /// The node's containerd, when its pods run there: CRI socket and state directory.
    pub containerd: Option<(PathBuf, PathBuf)>,
}

/// `warmstart-agent run` against `api` for `setup`; kubeconfig and log in `dir`.
///
/// # Errors
/// Spawn or I/O errors.
pub fn start_agent(api: &ApiServer, dir: &Path, setup: &AgentSetup) -> Result<Program> {
    let kubeconfig = dir.join("agent.kubeconfig");
    api.kubeconfig_as(
        &kubeconfig,
        &service_account_user(DEPLOY_NAMESPACE, "warmstart-agent"),
    )
    .map_err(|e| FixtureError::Invalid(format!("kubeconfig: {e}")))?;
    let mut command = Command::new(binaries::agent()?);
    command
        .arg("run")
        .arg("--kubelet-root")
        .arg(&setup.kubelet_root)
        .arg("--artifact-root")
        .arg(&setup.artifact_root)
        .arg("--runc-root")
        .arg(&setup.runc_root)
        .arg("--state-dir")
        .arg(&setup.state_dir)
        .arg("--admin-listen")
        .arg(free_addr()?.to_string())
        .args(["--resync-seconds", "1", "--max-restores", "4"])
        // The simulated node has no CUDA driver of its own (GPU tests give the agent the
        // stand-in when they need one).
        .arg("--require-cuda=false");
    if let Some((socket, state)) = &setup.containerd {
        command
            .arg("--cri-socket")
            .arg(socket)
            .arg("--containerd-state-dir")
            .arg(state);
    } else {
        // Pods run as runc containers of the node's own: no CRI socket to answer.
        command.arg("--require-cri=false");
    }
    command
        .env("KUBECONFIG", &kubeconfig)
        .env("NODE_NAME", &setup.node)
        .env("RUST_LOG", "info");
    Program::spawn_shimmed(&command, dir.join("agent.log"))
}

/// Polls `check` every 100 ms until it gives a value; panics after `timeout` naming `what`
/// and `context()` (logs worth reading then). [`crate::real_kube::poll`] for callers that
/// handle the timeout.
pub async fn wait_for<T, F, Fut>(
    what: &str,
    timeout: Duration,
    context: impl Fn() -> String,
    mut check: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    crate::real_kube::poll(what, timeout, Duration::from_millis(100), context, || {
        let checked = check();
        async move { Ok(checked.await) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
}
