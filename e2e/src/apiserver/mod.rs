//! A test double of the Kubernetes API server, for tests only: never run it as a real control
//! plane. No kube-apiserver can be installed where warmstart's tests run, and the controller and
//! agent must still be tested as whole programs talking to an API with real watch semantics.
//!
//! Use it in-process ([`ApiServer::start`], then [`ApiServer::client`] for a `kube::Client`, or
//! [`ApiServer::kubeconfig`] for programs and `kubectl`), or standalone with the
//! `warmstart-fake-apiserver` binary (`--listen 127.0.0.1:PORT --kubeconfig PATH`).
//!
//! # What it does
//! - Plain HTTP on loopback; legacy discovery (`/api`, `/apis`, per group version) and `/version`.
//! - Built-in resources: core/v1 Pods (with `status` and `binding`), Nodes, Events (also served
//!   as events.k8s.io/v1, one storage), Namespaces (with `finalize`), Secrets, ConfigMaps,
//!   Services, ServiceAccounts; batch/v1 Jobs; coordination.k8s.io/v1 Leases;
//!   admissionregistration.k8s.io/v1 Mutating/ValidatingWebhookConfigurations;
//!   apiextensions.k8s.io/v1 CustomResourceDefinitions. Every CRD created is served at once,
//!   with structural pruning, schema defaults, OpenAPI value validation, `x-kubernetes-validations`
//!   CEL rules (transition rules included) and the status subresource.
//! - create (name or generateName; uid, creationTimestamp, generation, resourceVersion), get, list
//!   (label selectors equality- and set-based; field selectors per kind; `limit`/`continue`),
//!   watch (from a resourceVersion; ADDED/MODIFIED/DELETED/BOOKMARK; objects entering or leaving a
//!   selector become ADDED/DELETED; 410 Gone as an `ERROR` event once history is compacted;
//!   `timeoutSeconds`; `sendInitialEvents`), update with optimistic concurrency (409), patch
//!   (JSON merge, JSON patch, strategic merge for the built-in kinds, server-side apply), status
//!   subresource (spec and status isolated; generation bumped by spec changes only), delete with
//!   finalizers and pod graceful deletion, garbage collection through ownerReferences
//!   (background, foreground, orphan; `batch/v1` Jobs orphan their pods by default, as upstream),
//!   namespace and CRD content cleanup.
//! - Admission: registered mutating and validating webhooks are called over HTTPS (the caBundle
//!   verified; rules, namespaceSelector, objectSelector and CEL matchConditions honoured; JSON
//!   patches applied; failurePolicy followed). A `clientConfig.service` is reached through
//!   [`ApiServer::route_service`]; [`testca::TestCa`] makes certificates for test webhooks.
//!   Pod Security admission enforces `baseline` on pods created in a namespace labelled
//!   `pod-security.kubernetes.io/enforce` ([`podsecurity`]), before the validating webhooks.
//! - kubectl: `get` (server-side `Table`s), `get -w`, `get -o yaml`, `create -f`, `apply -f`
//!   (client-side and `--server-side`), `label`, `annotate`, `patch`, `delete`, `describe`.
//!   kubectl's default client-side validation works: the OpenAPI documents it downloads are
//!   served ([`openapi`]).
//!
//! # For a node simulator (kubelet stand-in)
//! Deleting a pod that is bound to a node and not finished only sets its `deletionTimestamp` (grace
//! period from the request, else `spec.terminationGracePeriodSeconds`, else 30 s), exactly as
//! kube-apiserver does: the kubelet (the simulator) must stop the pod and then delete it again with
//! `gracePeriodSeconds=0` for it to go away. Unbound or finished pods go at once.
//!
//! # What it does not do
//! Refused with 501 `NotImplemented` (a real API server would answer, the double cannot answer
//! the same way): `dryRun`, protobuf request or response bodies (kubectl's generator commands
//! such as `kubectl create configmap` send protobuf; `kubectl create -f` does not), lists with
//! `resourceVersionMatch=Exact` at a past `resourceVersion`, webhooks with `reinvocationPolicy:
//! IfNeeded`, CRDs with conversion webhooks.
//!
//! Not modelled at all: authentication and authorization (every request is allowed), TLS on the
//! API port, OpenAPI schemas of built-in kinds and the `fieldValidation` parameter (kubectl's
//! client-side validation finds no schema and the double prunes unknown fields of custom
//! resources silently, as with `fieldValidation=Ignore`),
//! aggregated discovery (clients fall back to legacy discovery), API aggregation,
//! ValidatingAdmissionPolicies, webhook `matchPolicy: Equivalent` (rules match the served
//! group/version/resource exactly; it matters only for Events, served at two versions), the scheduler, kubelet, node lifecycle and workload controllers (tests bring their
//! own; only the garbage collector, namespace and CRD cleanup and the ServiceAccount controller's
//! `default` account are built in), ServiceAccount token volumes, pod `metadata.generation`, the
//! `exec`, `attach`, `portforward`, `eviction` and `scale` subresources (`pods/log` reads the
//! node's log files, [`ServerConfig::pod_logs`]; `follow` is not supported), and other
//! built-in kinds (apps/v1 and the rest answer 404). Built-in kinds are defaulted and validated
//! only on the fields listed in `strategy`. Server-side apply tracks ownership of leaves and list
//! items (not of the maps holding them) and merges built-in lists by their single
//! `patchMergeKey`. Watch history is one bounded list per resource (`history_limit`), with no
//! watch-cache quirks beyond one global revision.

mod admission;
mod apply;
mod commit;
mod crd;
mod discovery;
pub mod error;
mod fieldmanager;
mod http;
mod meta;
mod openapi;
mod patch;
pub mod podsecurity;
mod resources;
mod selectors;
mod store;
mod strategy;
mod table;
pub use crate::testca;
mod watch;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch as signal;
use tokio::task::JoinHandle;

pub use error::ApiError;

/// Settings of a double.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// Changes kept per resource for watches from a `resourceVersion`; older ones get 410.
    pub history_limit: usize,
    /// Interval between watch bookmarks (kube-apiserver: about a minute).
    pub bookmark_interval: Duration,
    /// Watch length when the client gives no `timeoutSeconds` (kube-apiserver: 30–60 min).
    pub default_watch_timeout: Duration,
    /// Where the node keeps pod logs as kubelet does (`/var/log/pods`:
    /// `<dir>/<namespace>_<pod>_<uid>/<container>/<restart>.log`, CRI format): `pods/log` reads
    /// them there, as kubelet would serve them. None: `pods/log` answers that no log exists.
    pub pod_logs: Option<std::path::PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            history_limit: 10_000,
            bookmark_interval: Duration::from_secs(5),
            default_watch_timeout: Duration::from_secs(1800),
            pod_logs: None,
        }
    }
}

/// Why the double could not start or write its kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Binding the listen address failed.
    #[error("binding {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing the kubeconfig failed.
    #[error("writing kubeconfig {path}")]
    Kubeconfig {
        /// Where.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("serving HTTP")]
    Serve(#[source] std::io::Error),
}

/// State shared by every request.
#[derive(Debug)]
pub(crate) struct Shared {
    store: store::Store,
    config: ServerConfig,
    shutdown: signal::Receiver<bool>,
    addr: SocketAddr,
    /// Routes to webhook Services: (namespace, name, port) -> address.
    services: std::sync::Mutex<std::collections::HashMap<(String, String, u16), SocketAddr>>,
    /// Injected failures, consumed in order by matching requests.
    faults: std::sync::Mutex<Vec<Fault>>,
    /// Every resource request, as an authorizer sees it.
    audit: std::sync::Mutex<Vec<Request>>,
}

/// A resource request as an authorizer sees it (the attributes RBAC decides on). The user is
/// the bearer token the client sent (see [`ApiServer::kubeconfig_as`]), empty without one:
/// the double authenticates nobody, it only records who said they were whom.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The bearer token: the user the client claims to be.
    pub user: String,
    /// RBAC verb: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`.
    pub verb: &'static str,
    /// API group (`""` for core).
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Subresource or empty.
    pub subresource: String,
    /// Namespace or empty.
    pub namespace: String,
    /// Object name or empty (a list or watch selecting `metadata.name=<name>` carries it too).
    pub name: String,
}

impl std::fmt::Display for Request {
    /// `verb group/resource[/subresource] namespace/name`, `core` for the core group.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{} {group}/{}", self.verb, self.resource)?;
        if !self.subresource.is_empty() {
            write!(f, "/{}", self.subresource)?;
        }
        write!(f, " {}/{}", self.namespace, self.name)
    }
}

/// A failure to inject: the next `count` requests with `method` whose path ends with
/// `path_suffix` get a `409 Conflict` (what a lost optimistic-concurrency race returns), so tests
/// can prove that clients retry. Test instrumentation; a real API server has no such switch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// HTTP method (`PATCH`, `PUT`, `POST`, …).
    pub method: String,
    /// The end of the request path (`/checkpoints/llama/status`).
    pub path_suffix: String,
    /// How many requests to fail.
    pub count: u32,
}

/// A running API server double. Dropping it stops serving.
#[derive(Debug)]
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: signal::Sender<bool>,
    task: Option<JoinHandle<Result<(), std::io::Error>>>,
}

impl ApiServer {
    /// Start a double on a free loopback port.
    ///
    /// # Errors
    /// When no port can be bound.
    pub async fn start() -> Result<Self, ServeError> {
        Self::start_with(ServerConfig::default()).await
    }

    /// Start a double with settings.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn start_with(config: ServerConfig) -> Result<Self, ServeError> {
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ServeError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
        let (stop, shutdown) = signal::channel(false);
        let shared = Arc::new(Shared {
            store: store::Store::new(config.history_limit),
            config,
            shutdown: shutdown.clone(),
            addr,
            services: std::sync::Mutex::default(),
            faults: std::sync::Mutex::default(),
            audit: std::sync::Mutex::default(),
        });
        let app_shared = shared.clone();
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let shared = app_shared.clone();
            async move { http::handle(shared, req).await }
        });
        let mut stopped = shutdown;
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    // Either a stop or a dropped sender ends serving.
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        });
        tracing::info!(url = %format!("http://{addr}"), "api server double listening");
        Ok(Self {
            shared,
            addr,
            stop,
            task: Some(task),
        })
    }

    /// The base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The listen address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A `kube::Client` talking to the double (default namespace `default`).
    pub fn client(&self) -> kube::Client {
        use tower::ServiceExt as _;
        let uri: axum::http::Uri = self
            .url()
            .parse()
            .expect("a formatted socket address is a valid URI");
        let config = kube::Config::new(uri);
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let http =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build::<_, kube::client::Body>(connector);
        let service = tower::ServiceBuilder::new()
            .layer(kube::client::ConfigExt::base_uri_layer(&config))
            .service(http)
            .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { Box::new(e) });
        kube::Client::new(service, config.default_namespace)
    }

    /// A kubeconfig (YAML) pointing at the double, context `warmstart-double`, namespace `default`.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: warmstart-double\n  cluster:\n    server: {}\ncontexts:\n- name: warmstart-double\n  context:\n    cluster: warmstart-double\n    user: warmstart-double\n    namespace: default\ncurrent-context: warmstart-double\nusers:\n- name: warmstart-double\n  user: {{}}\n",
            self.url()
        )
    }

    /// Write a kubeconfig to `path` whose user sends `user` as its bearer token, so the
    /// requests of the program that uses it are recorded as `user`'s ([`Self::requests`]).
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn kubeconfig_as(&self, path: &Path, user: &str) -> Result<(), ServeError> {
        let text = self
            .kubeconfig_yaml()
            .replace("  user: {}\n", &format!("  user:\n    token: {user:?}\n"));
        std::fs::write(path, text).map_err(|source| ServeError::Kubeconfig {
            path: path.to_owned(),
            source,
        })
    }

    /// Every resource request served so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared
            .audit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Write the kubeconfig to `path`.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn kubeconfig(&self, path: &Path) -> Result<(), ServeError> {
        std::fs::write(path, self.kubeconfig_yaml()).map_err(|source| ServeError::Kubeconfig {
            path: path.to_owned(),
            source,
        })
    }

    /// Forget the change history: every watch from an earlier `resourceVersion` now gets 410
    /// Gone (as after an etcd compaction).
    pub fn compact(&self) {
        self.shared.store.lock().compact();
    }

    /// Route calls to the Service `namespace/name` on `port` (a webhook's `clientConfig.service`)
    /// to `addr`. The webhook's certificate must be valid for `<name>.<namespace>.svc`.
    pub fn route_service(&self, namespace: &str, name: &str, port: u16, addr: SocketAddr) {
        self.shared
            .services
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((namespace.to_owned(), name.to_owned(), port), addr);
    }

    /// Make the next matching requests fail with 409 Conflict (see [`Fault`]).
    pub fn inject_conflicts(&self, fault: Fault) {
        self.shared
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(fault);
    }

    /// How many injected failures are still pending.
    pub fn pending_faults(&self) -> u32 {
        self.shared
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|f| f.count)
            .sum()
    }

    /// The current global `resourceVersion`.
    pub fn resource_version(&self) -> u64 {
        self.shared.store.lock().rv()
    }

    /// Stop serving: open watches end, then the listener closes.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            // The server's own result does not matter once it is asked to stop.
            let _ = task.await;
        }
    }

    /// Serve until the server fails (for the standalone binary).
    ///
    /// # Errors
    /// When the HTTP server fails.
    pub async fn wait(mut self) -> Result<(), ServeError> {
        match self.task.take() {
            Some(task) => match task.await {
                Ok(r) => r.map_err(ServeError::Serve),
                Err(e) => Err(ServeError::Serve(std::io::Error::other(e))),
            },
            None => Ok(()),
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
