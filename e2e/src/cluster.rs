//! Building blocks of a test cluster for the end-to-end tests: warmstart installed into a
//! [`ControlPlane`] from `deploy/` (the CRD, the ServiceAccounts and RBAC, the admission webhook
//! configurations pointed at a loopback URL), and the real `warmstart-controller run` and
//! `warmstart-agent run` programs started against it as child processes (killed when
//! dropped), each with its ServiceAccount's token, so each has exactly the permissions
//! `deploy/rbac` grants it. Test infrastructure only.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::core::{DynamicObject, GroupVersionKind};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::binaries;
use crate::control_plane::ControlPlane;
use crate::fixture::{FixtureError, Result};

/// The repository's root (for `deploy/`).
pub fn repo() -> PathBuf {
    crate::manifests::repo()
}

/// A loopback address reserved for this test process (see [`crate::ports`]).
///
/// # Errors
/// When no port can be reserved.
pub fn free_addr() -> Result<SocketAddr> {
    crate::ports::reserve_addr().map_err(|e| FixtureError::Invalid(format!("a free port: {e}")))
}

/// The YAML documents of a file, as JSON values.
///
/// # Errors
/// Unreadable or unparsable files.
pub fn yaml_docs(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| FixtureError::Invalid(format!("{}: {e}", path.display())))?;
    crate::manifests::parse_stream(&text)
        .map_err(|e| FixtureError::Invalid(format!("{}: {e}", path.display())))
}

fn api_error(what: &str) -> impl FnOnce(kube::Error) -> FixtureError + '_ {
    move |e| FixtureError::Invalid(format!("{what}: {e}"))
}

fn plane_error(e: crate::control_plane::ControlPlaneError) -> FixtureError {
    FixtureError::Invalid(e.to_string())
}

/// The field manager the tests install `deploy/` with.
pub const FIELD_MANAGER: &str = "warmstart-e2e";

/// Server-side applies `doc` (any kind the API server serves, `apiVersion` and `kind` set).
///
/// # Errors
/// API errors, or a document without `apiVersion`, `kind` or `metadata.name`.
pub async fn apply(client: &kube::Client, doc: &Value) -> Result<DynamicObject> {
    let (group, version) = match doc["apiVersion"].as_str() {
        Some(v) => v.rsplit_once('/').unwrap_or(("", v)),
        None => return Err(FixtureError::Invalid(format!("no apiVersion: {doc}"))),
    };
    let kind = doc["kind"]
        .as_str()
        .ok_or_else(|| FixtureError::Invalid(format!("no kind: {doc}")))?;
    let name = doc["metadata"]["name"]
        .as_str()
        .ok_or_else(|| FixtureError::Invalid(format!("no metadata.name: {doc}")))?;
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let (resource, caps) = kube::discovery::pinned_kind(client, &gvk)
        .await
        .map_err(api_error(kind))?;
    let api: Api<DynamicObject> = match (caps.scope, doc["metadata"]["namespace"].as_str()) {
        (kube::discovery::Scope::Namespaced, Some(ns)) => {
            Api::namespaced_with(client.clone(), ns, &resource)
        }
        (kube::discovery::Scope::Namespaced, None) => {
            Api::default_namespaced_with(client.clone(), &resource)
        }
        (kube::discovery::Scope::Cluster, _) => Api::all_with(client.clone(), &resource),
    };
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(doc),
    )
    .await
    .map_err(|e| FixtureError::Invalid(format!("apply {kind} {name}: {e}")))
}

/// Applies the Checkpoint CRD exactly as deployed, waits until it is served, and creates
/// `namespaces` (ready for pods).
///
/// # Errors
/// API errors, or a CRD the API server does not establish.
pub async fn install_crd(plane: &mut ControlPlane, namespaces: &[&str]) -> Result<()> {
    let client = plane.client();
    let doc = yaml_docs(&repo().join("deploy/crd/checkpoint.yaml"))?
        .into_iter()
        .next()
        .ok_or_else(|| FixtureError::Invalid("deploy/crd/checkpoint.yaml is empty".into()))?;
    let applied = apply(&client, &doc).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = applied.metadata.name.unwrap_or_default();
    crate::real_kube::poll(
        &format!("CRD {name} to be established"),
        Duration::from_secs(60),
        Duration::from_millis(50),
        String::new,
        || async {
            let crd = crds.get(&name).await?;
            let established = crd.status.and_then(|s| s.conditions).is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
            Ok(established.then_some(()))
        },
    )
    .await
    .map_err(|e| FixtureError::Invalid(format!("{e:#}")))?;
    for ns in namespaces {
        plane.create_namespace(ns).await.map_err(plane_error)?;
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
    crate::manifests::kustomize("deploy").map_err(|e| FixtureError::Invalid(e.to_string()))
}

/// Applies what `deploy/` grants the programs: namespace `warmstart-system`, the controller's
/// and the agent's ServiceAccounts, their (Cluster)Roles and bindings, the users' aggregated
/// ClusterRoles and the controller's leader Lease, exactly as rendered.
///
/// # Errors
/// When `deploy/` cannot be rendered or the API server refuses an object.
pub async fn install_rbac(plane: &mut ControlPlane) -> Result<()> {
    plane
        .create_namespace(DEPLOY_NAMESPACE)
        .await
        .map_err(plane_error)?;
    let client = plane.client();
    for doc in render_deploy()? {
        let kind = doc["kind"].as_str().unwrap_or_default();
        if matches!(
            kind,
            "ServiceAccount"
                | "ClusterRole"
                | "ClusterRoleBinding"
                | "Role"
                | "RoleBinding"
                | "Lease"
        ) {
            apply(&client, &doc).await?;
        }
    }
    Ok(())
}

/// The requests `deploy/`'s ServiceAccount `warmstart-system/<service_account>` made that RBAC
/// refused (from the API server's audit log), each with its attributes.
///
/// # Errors
/// When the audit log cannot be read.
pub fn requests_outside_rbac(plane: &ControlPlane, service_account: &str) -> Result<Vec<String>> {
    plane
        .forbidden_requests(&ControlPlane::service_account_user(
            DEPLOY_NAMESPACE,
            service_account,
        ))
        .map_err(plane_error)
}

/// The namespace label Pod Security admission enforces a level from.
pub const POD_SECURITY_ENFORCE: &str = "pod-security.kubernetes.io/enforce";

/// Labels namespace `ns` to enforce the Pod Security `level` (`baseline`, `restricted`): the
/// API server's Pod Security admission then refuses pods created there that fail it.
///
/// # Errors
/// API errors.
pub async fn enforce_pod_security(client: &kube::Client, ns: &str, level: &str) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let patch = json!({"metadata": {"labels": {POD_SECURITY_ENFORCE: level}}});
    api.patch(ns, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(api_error("label the namespace for Pod Security"))?;
    Ok(())
}

/// The webhook configurations of `deploy/webhook/` as the tests install them: each
/// `clientConfig.service` replaced by the URL of the controller's webhook listening on `addr`
/// (loopback: a test cluster has no Service network), and `caBundle` the control plane's CA,
/// which signs the serving certificate [`webhook_cert_dir`] writes.
///
/// # Errors
/// Unreadable manifests.
pub fn webhook_configurations(plane: &ControlPlane, addr: SocketAddr) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for file in [
        "deploy/webhook/mutating.yaml",
        "deploy/webhook/validating.yaml",
    ] {
        for mut doc in yaml_docs(&repo().join(file))? {
            for hook in doc["webhooks"].as_array_mut().into_iter().flatten() {
                let path = hook["clientConfig"]["service"]["path"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                hook["clientConfig"] = json!({
                    "url": format!("https://{addr}{path}"),
                    "caBundle": plane.ca().ca_bundle(),
                });
            }
            docs.push(doc);
        }
    }
    Ok(docs)
}

/// Applies [`webhook_configurations`] for a webhook listening on `addr`.
///
/// # Errors
/// API errors.
pub async fn install_webhooks(plane: &ControlPlane, addr: SocketAddr) -> Result<()> {
    let client = plane.client();
    for doc in webhook_configurations(plane, addr)? {
        apply(&client, &doc).await?;
    }
    Ok(())
}

/// Writes into `dir` (`tls.crt`, `tls.key`, as cert-manager's Secret volume lays them out) a
/// serving certificate of the control plane's CA for the webhook on loopback and for its
/// Service names; `dir` is what `--webhook-cert-dir` names.
///
/// # Errors
/// Signing or I/O errors.
pub fn webhook_cert_dir(plane: &ControlPlane, dir: &Path) -> Result<()> {
    let cert = plane
        .ca()
        .issue(&[
            "127.0.0.1",
            "localhost",
            "warmstart-controller.warmstart-system.svc",
        ])
        .map_err(|e| FixtureError::Invalid(format!("webhook certificate: {e}")))?;
    std::fs::create_dir_all(dir)
        .map_err(|e| FixtureError::Invalid(format!("{}: {e}", dir.display())))?;
    for (name, text) in [("tls.crt", &cert.cert_pem), ("tls.key", &cert.key_pem)] {
        std::fs::write(dir.join(name), text)
            .map_err(|e| FixtureError::Invalid(format!("{}/{name}: {e}", dir.display())))?;
    }
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

/// `warmstart-controller run` against `plane` as ServiceAccount
/// `warmstart-system/warmstart-controller`, its webhook on `webhook` with a certificate of the
/// control plane's CA ([`webhook_cert_dir`]; self-signed mode off: the tests' webhook
/// configurations carry that CA), artifacts under `artifact_root`, its files (kubeconfig,
/// certificates, log) in `dir`.
///
/// # Errors
/// Spawn, API or I/O errors.
pub async fn start_controller(
    plane: &ControlPlane,
    dir: &Path,
    artifact_root: &Path,
    webhook: SocketAddr,
) -> Result<Program> {
    // One kubeconfig per program: they may share `dir`, and each is its own user.
    let kubeconfig = dir.join("controller.kubeconfig");
    plane
        .service_account_kubeconfig(DEPLOY_NAMESPACE, "warmstart-controller", &kubeconfig)
        .await
        .map_err(plane_error)?;
    let certs = dir.join("controller-tls");
    webhook_cert_dir(plane, &certs)?;
    let mut command = Command::new(binaries::controller()?);
    command
        .arg("run")
        .arg("--artifact-root")
        .arg(artifact_root)
        .args(["--admin-listen", &free_addr()?.to_string()])
        .args(["--webhook-listen", &webhook.to_string()])
        .arg("--webhook-cert-dir")
        .arg(certs)
        .arg("--webhook-self-signed=false")
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

/// The kubeconfig of ServiceAccount `warmstart-system/warmstart-agent` in `dir`, for
/// [`start_agent`].
///
/// # Errors
/// API or I/O errors.
pub async fn agent_kubeconfig(plane: &ControlPlane, dir: &Path) -> Result<PathBuf> {
    let kubeconfig = dir.join("agent.kubeconfig");
    plane
        .service_account_kubeconfig(DEPLOY_NAMESPACE, "warmstart-agent", &kubeconfig)
        .await
        .map_err(plane_error)?;
    Ok(kubeconfig)
}

/// `warmstart-agent run` for `setup` with `kubeconfig` (see [`agent_kubeconfig`]); log in
/// `dir`.
///
/// # Errors
/// Spawn or I/O errors.
pub fn start_agent(kubeconfig: &Path, dir: &Path, setup: &AgentSetup) -> Result<Program> {
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
        .env("KUBECONFIG", kubeconfig)
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
