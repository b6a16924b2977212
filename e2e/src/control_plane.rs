//! A real Kubernetes control plane for the tests: upstream etcd, kube-apiserver and
//! kube-controller-manager (the binaries `make k8s-build` caches) as child processes on free
//! loopback ports, their data, certificates, kubeconfigs, logs and audit log in a temporary
//! directory. Test infrastructure only.
//!
//! The API server runs as a cluster's does: TLS with a certificate of the test CA
//! ([`ControlPlane::ca`], which also signs webhooks' serving certificates), x509 client
//! certificates and ServiceAccount tokens, `Node,RBAC` authorization, the default admission
//! plugins (Pod Security among them) and `NodeRestriction`, Services in 198.19.128.0/24. The
//! controller-manager runs the controllers the tests rely on: namespace deletion, garbage
//! collection, ServiceAccounts and the root CA ConfigMap, Jobs and their TTL, ClusterRole
//! aggregation. No scheduler and
//! no kubelet: the simulated node binds and runs pods (see [`crate::node`]).
//!
//! Every process is killed by PID and reaped when the [`ControlPlane`] is dropped, then the
//! directory goes; each is also started with `PR_SET_PDEATHSIG`, so one outlives neither the
//! thread that started it nor the test process. Start one per test (a few seconds): tests then
//! share nothing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::{Value, json};

use crate::testca::{CertError, TestCa};

/// The Service range of the control plane (RFC 2544 benchmarking addresses, never routed).
pub const SERVICE_CIDR: &str = "198.19.128.0/24";
/// How long the API server may take to become ready (a loaded CI machine is slow).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// The controllers of kube-controller-manager the tests use (and `job-controller`, see
/// [`ControlPlane::start_with`]).
const CONTROLLERS: &str = "namespace-controller,garbage-collector-controller,\
serviceaccount-controller,root-ca-certificate-publisher-controller,\
ttl-after-finished-controller,clusterrole-aggregation-controller";

/// Why the control plane cannot start or answer.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    /// The Kubernetes binaries are not built.
    #[error("the Kubernetes binaries are missing ({0}): run `make k8s-build`")]
    Binaries(String),
    /// A file of the control plane cannot be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A certificate cannot be made.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// A component cannot be started.
    #[error("cannot start {component}: {source}")]
    Spawn {
        /// The component.
        component: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A component ended or did not become ready in time.
    #[error("{component} {problem}; last lines of its log:\n{log}")]
    Component {
        /// The component.
        component: &'static str,
        /// What happened.
        problem: String,
        /// The end of its log.
        log: String,
    },
    /// A request to the API server failed.
    #[error("{what}: {source}")]
    Api {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: Box<kube::Error>,
    },
}

type Result<T, E = ControlPlaneError> = std::result::Result<T, E>;

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ControlPlaneError + '_ {
    move |source| ControlPlaneError::Io {
        path: path.to_owned(),
        source,
    }
}

fn api_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ControlPlaneError {
    let what = what.into();
    move |source| ControlPlaneError::Api {
        what,
        source: Box::new(source),
    }
}

/// The directory of the cached Kubernetes binaries: `$WARMSTART_K8S_BIN`, else what
/// `scripts/build-k8s.sh --cached-only` prints (it never builds).
///
/// # Errors
/// When they are not built.
pub fn k8s_bin_dir() -> Result<PathBuf> {
    let dir = if let Some(dir) = std::env::var_os("WARMSTART_K8S_BIN") {
        PathBuf::from(dir)
    } else {
        let script = crate::cluster::repo().join("scripts/build-k8s.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg("--cached-only")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| ControlPlaneError::Binaries(format!("bash {}: {e}", script.display())))?;
        if !out.status.success() {
            return Err(ControlPlaneError::Binaries(
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        PathBuf::from(stdout.lines().last().unwrap_or_default().trim())
    };
    for component in ["etcd", "kube-apiserver", "kube-controller-manager"] {
        if !dir.join(component).is_file() {
            return Err(ControlPlaneError::Binaries(format!(
                "no {} in {}",
                component,
                dir.display()
            )));
        }
    }
    Ok(dir)
}

/// A component running as a child process, its output in a log file.
#[derive(Debug)]
struct Component {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Component {
    fn spawn(name: &'static str, mut command: Command, log: PathBuf) -> Result<Self> {
        let file = std::fs::File::create(&log).map_err(io_error(&log))?;
        let err = file.try_clone().map_err(io_error(&log))?;
        warmstart_agent::sys::spawn::kill_with_parent(&mut command);
        let child = command
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .map_err(|source| ControlPlaneError::Spawn {
                component: name,
                source,
            })?;
        Ok(Self { name, child, log })
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// An error when it has exited.
    fn check_running(&mut self) -> Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(self.failed(format!("exited ({status})"))),
            Err(e) => Err(self.failed(format!("cannot be waited for: {e}"))),
        }
    }

    fn failed(&self, problem: String) -> ControlPlaneError {
        ControlPlaneError::Component {
            component: self.name,
            problem,
            log: self.log_tail(),
        }
    }

    fn stop(&mut self) {
        // By PID: the child is ours and not yet reaped, so the PID is still its.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running control plane; dropping it stops every component and removes its directory.
pub struct ControlPlane {
    url: String,
    ca: TestCa,
    admin_kubeconfig: PathBuf,
    client: kube::Client,
    components: Vec<Component>,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("url", &self.url)
            .field("components", &self.components)
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

/// A loopback port reserved for this test process (see [`crate::ports`]).
fn free_port() -> Result<u16> {
    crate::ports::reserve().map_err(|e| ControlPlaneError::Io {
        path: PathBuf::from("127.0.0.1"),
        source: std::io::Error::other(e),
    })
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(io_error(path))
}

/// A kubeconfig for `server` trusting `ca`, whose user is `user` (YAML of a `users[].user`).
fn kubeconfig_text(server: &str, ca: &Path, user: &Value) -> String {
    json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "warmstart-test", "cluster": {
            "server": server, "certificate-authority": ca}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "warmstart-test", "context": {
            "cluster": "warmstart-test", "user": "user", "namespace": "default"}}],
        "current-context": "warmstart-test",
    })
    .to_string()
}

/// A `kube::Client` from the kubeconfig at `path`.
///
/// # Errors
/// An unreadable kubeconfig or a client that cannot be built.
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client> {
    let config = config_from_kubeconfig(path).await?;
    kube::Client::try_from(config).map_err(api_error("build a client"))
}

/// The client configuration of the kubeconfig at `path`.
///
/// # Errors
/// An unreadable or unusable kubeconfig.
pub async fn config_from_kubeconfig(path: &Path) -> Result<kube::Config> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| ControlPlaneError::Io {
        path: path.to_owned(),
        source: std::io::Error::other(e.to_string()),
    })?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| ControlPlaneError::Io {
            path: path.to_owned(),
            source: std::io::Error::other(e.to_string()),
        })
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager and waits until the API server
    /// is ready and the `default` namespace has its ServiceAccount.
    ///
    /// # Errors
    /// Missing binaries, a component that fails or is not ready in time (with its log).
    pub async fn start() -> Result<Self> {
        Self::start_with(true).await
    }

    /// [`Self::start`]; without the Job controller when `job_controller` is false, for tests
    /// that play it themselves (they set a Job's status as it would).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub async fn start_with(job_controller: bool) -> Result<Self> {
        let bin = k8s_bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("warmstart-control-plane-")
            .tempdir()
            .map_err(io_error(Path::new("/tmp")))?;
        let path = |name: &str| dir.path().join(name);
        let ca = TestCa::new()?;
        write(&path("ca.crt"), &ca.cert_pem())?;
        let serving = ca.issue(&[
            "127.0.0.1",
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "198.19.128.1",
        ])?;
        write(&path("apiserver.crt"), &serving.cert_pem)?;
        write(&path("apiserver.key"), &serving.key_pem)?;
        let sa_key = rcgen::KeyPair::generate().map_err(CertError::from)?;
        write(&path("sa.key"), &sa_key.serialize_pem())?;
        write(&path("sa.pub"), &sa_key.public_key_pem())?;
        let audit_policy = "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived, ResponseStarted]\nrules:\n- level: Metadata\n";
        write(&path("audit-policy.yaml"), audit_policy)?;

        let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
        let url = format!("https://127.0.0.1:{api_port}");
        let mut components = Vec::new();
        let mut etcd = Command::new(bin.join("etcd"));
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        etcd.arg("--name=test")
            .arg(format!("--data-dir={}", path("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .args(["--unsafe-no-fsync", "--log-level=warn"]);
        components.push(Component::spawn("etcd", etcd, path("etcd.log"))?);

        let file = |name: &str| path(name).display().to_string();
        let mut apiserver = Command::new(bin.join("kube-apiserver"));
        apiserver
            .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
            .arg(format!("--secure-port={api_port}"))
            .arg(format!("--etcd-servers={etcd_url}"))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            .args(["--authorization-mode=Node,RBAC", "--allow-privileged=true"])
            .arg("--enable-admission-plugins=NodeRestriction")
            .arg(format!("--client-ca-file={}", file("ca.crt")))
            .arg(format!("--tls-cert-file={}", file("apiserver.crt")))
            .arg(format!("--tls-private-key-file={}", file("apiserver.key")))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", file("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                file("sa.key")
            ))
            .arg(format!("--audit-policy-file={}", file("audit-policy.yaml")))
            .arg(format!("--audit-log-path={}", file("audit.log")))
            .arg(format!("--cert-dir={}", file("apiserver-generated")))
            .arg("--profiling=false");
        components.push(Component::spawn(
            "kube-apiserver",
            apiserver,
            path("kube-apiserver.log"),
        )?);

        let admin = ca.issue_client("warmstart-test-admin", Some("system:masters"))?;
        write(&path("admin.crt"), &admin.cert_pem)?;
        write(&path("admin.key"), &admin.key_pem)?;
        let admin_kubeconfig = path("admin.kubeconfig");
        write(
            &admin_kubeconfig,
            &kubeconfig_text(
                &url,
                &path("ca.crt"),
                &json!({"client-certificate": file("admin.crt"), "client-key": file("admin.key")}),
            ),
        )?;
        let client = client_from_kubeconfig(&admin_kubeconfig).await?;
        let mut plane = Self {
            url: url.clone(),
            ca,
            admin_kubeconfig,
            client,
            components,
            dir,
        };
        plane.wait_ready().await?;

        let cm = plane
            .ca
            .issue_client("system:kube-controller-manager", None)?;
        write(&plane.file("controller-manager.crt"), &cm.cert_pem)?;
        write(&plane.file("controller-manager.key"), &cm.key_pem)?;
        let cm_kubeconfig = plane.file("controller-manager.kubeconfig");
        write(
            &cm_kubeconfig,
            &kubeconfig_text(
                &url,
                &plane.file("ca.crt"),
                &json!({
                    "client-certificate": plane.file("controller-manager.crt"),
                    "client-key": plane.file("controller-manager.key"),
                }),
            ),
        )?;
        let mut manager = Command::new(bin.join("kube-controller-manager"));
        manager
            .arg(format!("--kubeconfig={}", cm_kubeconfig.display()))
            .arg(format!(
                "--controllers={CONTROLLERS}{}",
                if job_controller {
                    ",job-controller"
                } else {
                    ""
                }
            ))
            .arg(format!("--root-ca-file={}", plane.file("ca.crt").display()))
            .arg(format!("--service-cluster-ip-range={SERVICE_CIDR}"))
            .args([
                "--use-service-account-credentials=true",
                "--secure-port=0",
                "--leader-elect=false",
                "--profiling=false",
                "--concurrent-gc-syncs=5",
            ]);
        let log = plane.file("kube-controller-manager.log");
        plane
            .components
            .push(Component::spawn("kube-controller-manager", manager, log)?);
        plane.namespace_ready("default").await?;
        Ok(plane)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn check_running(&mut self) -> Result<()> {
        self.components
            .iter_mut()
            .try_for_each(Component::check_running)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.check_running()?;
            let request = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| ControlPlaneError::Io {
                    path: PathBuf::from("/readyz"),
                    source: std::io::Error::other(e),
                })?;
            if let Ok(text) = self.client.request_text(request).await
                && text.trim() == "ok"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                let apiserver = self.components.iter().find(|c| c.name == "kube-apiserver");
                return Err(ControlPlaneError::Component {
                    component: "kube-apiserver",
                    problem: format!("not ready (/readyz) after {READY_TIMEOUT:?}"),
                    log: apiserver.map(Component::log_tail).unwrap_or_default(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until namespace `ns` has what pods need before they can be created there: its
    /// `default` ServiceAccount and the `kube-root-ca.crt` ConfigMap (both made by the
    /// controller-manager).
    async fn namespace_ready(&mut self, ns: &str) -> Result<()> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), ns);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            self.check_running()?;
            if matches!(accounts.get_opt("default").await, Ok(Some(_)))
                && matches!(maps.get_opt("kube-root-ca.crt").await, Ok(Some(_)))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                let manager = self
                    .components
                    .iter()
                    .find(|c| c.name == "kube-controller-manager");
                return Err(ControlPlaneError::Component {
                    component: "kube-controller-manager",
                    problem: format!(
                        "made no ServiceAccount `default` and ConfigMap `kube-root-ca.crt` in \
                         namespace {ns} in {READY_TIMEOUT:?}"
                    ),
                    log: manager.map(Component::log_tail).unwrap_or_default(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Creates namespace `ns` (an existing one is fine) with `labels` and waits until pods can
    /// be created in it.
    ///
    /// # Errors
    /// API errors, or the controller-manager not filling it in time.
    pub async fn create_namespace(&mut self, ns: &str) -> Result<()> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))
            .map_err(|e| ControlPlaneError::Io {
                path: PathBuf::from(ns),
                source: std::io::Error::other(e),
            })?;
        match api.create(&PostParams::default(), &namespace).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(api_error(format!("create namespace {ns}"))(e)),
        }
        self.namespace_ready(ns).await
    }

    /// The API server's URL (`https://127.0.0.1:PORT`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The CA the API server's certificate and the clients' certificates come from; it also
    /// signs webhooks' serving certificates (the `caBundle` is [`TestCa::ca_bundle`]).
    pub fn ca(&self) -> &TestCa {
        &self.ca
    }

    /// A client of the cluster admin (group `system:masters`).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The admin's kubeconfig (for `kubectl`).
    pub fn kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// Writes to `path` a kubeconfig that authenticates as ServiceAccount `namespace/name`
    /// with a token from the TokenRequest API (valid for a day), so a program using it has
    /// exactly the permissions RBAC grants that account.
    ///
    /// # Errors
    /// API errors (the ServiceAccount must exist), or the file cannot be written.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
        path: &Path,
    ) -> Result<()> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                expiration_seconds: Some(24 * 3600),
                ..TokenRequestSpec::default()
            },
            ..TokenRequest::default()
        };
        let token = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(api_error(format!(
                "request a token of ServiceAccount {namespace}/{name}"
            )))?
            .status
            .map(|s| s.token)
            .unwrap_or_default();
        write(
            path,
            &kubeconfig_text(&self.url, &self.file("ca.crt"), &json!({"token": token})),
        )
    }

    /// A client authenticating as ServiceAccount `namespace/name` (see
    /// [`Self::service_account_kubeconfig`]).
    ///
    /// # Errors
    /// As [`Self::service_account_kubeconfig`].
    pub async fn service_account_client(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<kube::Client> {
        let path = self.file(&format!("sa-{namespace}-{name}.kubeconfig"));
        self.service_account_kubeconfig(namespace, name, &path)
            .await?;
        client_from_kubeconfig(&path).await
    }

    /// The requests of `user` that RBAC refused so far, from the API server's audit log, as
    /// `verb group/resource[/subresource] namespace/name`, sorted and deduplicated.
    ///
    /// # Errors
    /// When the audit log cannot be read.
    pub fn forbidden_requests(&self, user: &str) -> Result<Vec<String>> {
        let mut refused: Vec<String> = self
            .audit_events()?
            .into_iter()
            .filter(|event| {
                event["user"]["username"] == user
                    && event["annotations"]["authorization.k8s.io/decision"] == "forbid"
            })
            .map(|event| {
                let object = &event["objectRef"];
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                let group = match text(&object["apiGroup"]) {
                    g if g.is_empty() => "core".to_owned(),
                    g => g,
                };
                let mut resource = text(&object["resource"]);
                if let Some(sub) = object["subresource"].as_str() {
                    resource = format!("{resource}/{sub}");
                }
                format!(
                    "{} {group}/{resource} {}/{}",
                    text(&event["verb"]),
                    text(&object["namespace"]),
                    text(&object["name"])
                )
            })
            .collect();
        refused.sort();
        refused.dedup();
        Ok(refused)
    }

    /// Every event of the API server's audit log so far (`audit.k8s.io/v1` `Event`s at level
    /// `Metadata`: who did what to which object, and the answer).
    ///
    /// # Errors
    /// When the audit log cannot be read.
    pub fn audit_events(&self) -> Result<Vec<Value>> {
        let path = self.file("audit.log");
        let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
        Ok(text
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .collect())
    }

    /// The user name of ServiceAccount `namespace/name`, as authorizers and the audit log see
    /// it.
    pub fn service_account_user(namespace: &str, name: &str) -> String {
        format!("system:serviceaccount:{namespace}:{name}")
    }

    /// The PIDs of its processes (etcd, kube-apiserver, kube-controller-manager).
    pub fn pids(&self) -> Vec<u32> {
        self.components.iter().map(|c| c.child.id()).collect()
    }

    /// Its directory (data, certificates, kubeconfigs, logs), removed when it is dropped.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The logs of the control plane's components (their last lines), for failure messages.
    pub fn logs(&self) -> String {
        self.components
            .iter()
            .map(|c| format!("--- {}:\n{}", c.name, c.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for component in self.components.iter_mut().rev() {
            component.stop();
        }
    }
}
