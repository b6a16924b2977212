//! The HTTPS server of the admission webhooks: `POST /mutate/pods` and
//! `POST /validate/checkpoints` (the paths in `deploy/webhook/`), HTTP/1.1 over rustls with a
//! certificate reloaded from files (see [`crate::tls`]).
//!
//! Invariants:
//! - A body that is not an `AdmissionReview` with a request gets a 400, never a panic and never
//!   an "allowed".
//! - Every external wait is bounded: TLS handshake, request headers, the Checkpoint read (see
//!   [`super::admission::DEFAULT_LOOKUP_TIMEOUT`]) and the drain at shutdown.
//! - Shutdown stops accepting at once, lets requests in flight finish (up to
//!   [`SHUTDOWN_GRACE`]), then returns.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use clap::Args;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use kube::core::DynamicObject;
use kube::core::admission::AdmissionReview;
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, ServerConfig};
use tracing::{debug, info, warn};

use super::admission::{Admission, WEBHOOK_MUTATE_PODS, WEBHOOK_VALIDATE_CHECKPOINTS};
use crate::certs::{CertArgs, CertSettings};
use crate::tls::{self, DEFAULT_CERT_DIR, ReloadingCertResolver, TlsError, TlsSource};

/// Path of the mutating webhook (`deploy/webhook/mutating.yaml`).
pub const PATH_MUTATE_PODS: &str = "/mutate/pods";
/// Path of the validating webhook (`deploy/webhook/validating.yaml`).
pub const PATH_VALIDATE_CHECKPOINTS: &str = "/validate/checkpoints";
/// Default listen address (the Service maps 443 to this port).
pub const DEFAULT_ADDR: &str = "0.0.0.0:8443";
/// Largest accepted request body: a review holds the object and the old object, each at most
/// the API server's 3 MiB request limit.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Limit on a TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Limit on reading a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for requests in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Pause after a failed `accept` (e.g. out of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Flags of the admission webhook (every one also readable from the environment).
#[derive(Debug, Clone, Args)]
pub struct WebhookArgs {
    /// Address the HTTPS webhook listens on.
    #[arg(id = "webhook_listen", long = "webhook-listen", env = "WARMSTART_WEBHOOK_LISTEN", default_value = DEFAULT_ADDR)]
    pub listen: SocketAddr,
    /// Directory of `tls.crt` and `tls.key`, reloaded when they change.
    #[arg(id = "webhook_cert_dir", long = "webhook-cert-dir", env = "WARMSTART_WEBHOOK_CERT_DIR", default_value = DEFAULT_CERT_DIR)]
    pub cert_dir: PathBuf,
    /// Self-signed certificate management.
    #[command(flatten)]
    pub certs: CertArgs,
}

impl WebhookArgs {
    /// Where the server reads its certificate.
    pub fn tls_source(&self) -> TlsSource {
        TlsSource::in_dir(&self.cert_dir)
    }

    /// The settings of self-signed mode, writing into the certificate directory.
    pub fn cert_settings(&self) -> CertSettings {
        self.certs.settings(self.cert_dir.clone())
    }
}

/// Why the webhook server cannot run.
#[derive(Debug, Error)]
pub enum WebhookError {
    /// The listen address cannot be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The first certificate cannot be loaded.
    #[error("cannot load the serving certificate")]
    Certificate(#[source] TlsError),
    /// rustls refuses the configuration.
    #[error("cannot configure TLS")]
    Tls(#[source] rustls::Error),
}

/// The routes, without TLS: `POST /mutate/pods` and `POST /validate/checkpoints`.
pub fn router(admission: Admission) -> Router {
    Router::new()
        .route(PATH_MUTATE_PODS, post(mutate_pods))
        .route(PATH_VALIDATE_CHECKPOINTS, post(validate_checkpoints))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(admission)
}

async fn mutate_pods(State(admission): State<Admission>, body: Bytes) -> Response {
    match parse(&admission, WEBHOOK_MUTATE_PODS, &body) {
        Ok(review) => reply(&admission.mutate_pods(review).await),
        Err(problem) => (StatusCode::BAD_REQUEST, problem).into_response(),
    }
}

async fn validate_checkpoints(State(admission): State<Admission>, body: Bytes) -> Response {
    match parse(&admission, WEBHOOK_VALIDATE_CHECKPOINTS, &body) {
        Ok(review) => reply(&admission.validate_checkpoints(review)),
        Err(problem) => (StatusCode::BAD_REQUEST, problem).into_response(),
    }
}

/// The review in `body`, or why it is none (counted and logged; answered with a 400).
fn parse(
    admission: &Admission,
    webhook: &'static str,
    body: &[u8],
) -> Result<AdmissionReview<DynamicObject>, String> {
    // Read strictly first: a key given twice would otherwise silently count once.
    let problem = match crate::input::parse_json_strict(body)
        .and_then(serde_json::from_value::<AdmissionReview<DynamicObject>>)
    {
        Ok(review) if review.request.is_some() => return Ok(review),
        Ok(_) => "AdmissionReview has no request".to_owned(),
        Err(err) => format!("malformed AdmissionReview: {err}"),
    };
    admission.record_unreadable(webhook, &problem);
    Err(problem)
}

fn reply(review: &AdmissionReview<DynamicObject>) -> Response {
    match serde_json::to_vec(review) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        // Without a response the API server applies failurePolicy: Fail, i.e. denies.
        Err(err) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the AdmissionReview response: {err}"),
        )
            .into_response(),
    }
}

/// Serves the webhooks on `addr` until `shutdown` completes.
///
/// # Errors
/// See [`serve_listener`]; also [`WebhookError::Bind`].
pub async fn serve(
    addr: SocketAddr,
    tls: TlsSource,
    admission: Admission,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WebhookError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| WebhookError::Bind { addr, source })?;
    serve_listener(listener, tls, admission, shutdown).await
}

/// Serves the webhooks on a bound `listener` (port 0 in tests) until `shutdown` completes,
/// with the certificate in `tls`, reloaded when its files change.
///
/// # Errors
/// [`WebhookError::Certificate`] when the first certificate cannot be loaded,
/// [`WebhookError::Tls`] when rustls refuses the configuration. Once serving, per-connection
/// failures are logged, never returned.
///
/// # Guarantees
/// On `shutdown`, the listener is closed before this returns; requests in flight get up to
/// [`SHUTDOWN_GRACE`] to finish.
pub async fn serve_listener(
    listener: TcpListener,
    tls: TlsSource,
    admission: Admission,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WebhookError> {
    let resolver = Arc::new(
        ReloadingCertResolver::load(tls)
            .await
            .map_err(WebhookError::Certificate)?,
    );
    let mut config = ServerConfig::builder_with_provider(Arc::new(tls::provider()))
        .with_safe_default_protocol_versions()
        .map_err(WebhookError::Tls)?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let app = router(admission);

    let (stop_reload, stop_rx) = tokio::sync::watch::channel(false);
    let reload = tokio::spawn(resolver.watch(stop_rx));
    let graceful = GracefulShutdown::new();
    if let Ok(addr) = listener.local_addr() {
        info!(addr = %addr, "admission webhook listening");
    }
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(connection(
                        stream,
                        peer,
                        acceptor.clone(),
                        app.clone(),
                        graceful.watcher(),
                    ));
                }
                Err(err) => {
                    warn!(error = %err, "accepting a webhook connection failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
    }
    drop(listener);
    info!("admission webhook stopping");
    let _ = stop_reload.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(grace = ?SHUTDOWN_GRACE, "webhook connections still open at shutdown, dropping them");
    }
    if let Err(err) = reload.await {
        warn!(error = %err, "certificate reload task failed");
    }
    Ok(())
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    app: Router,
    watcher: Watcher,
) {
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(err)) => {
            debug!(peer = %peer, error = %err, "webhook TLS handshake failed");
            return;
        }
        Err(_) => {
            debug!(peer = %peer, "webhook TLS handshake timed out");
            return;
        }
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let conn = builder.serve_connection(TokioIo::new(tls), TowerToHyperService::new(app));
    if let Err(err) = watcher.watch(conn).await {
        debug!(peer = %peer, error = %err, "webhook connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use axum::body::Body;
    use serde_json::json;
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    use super::*;
    use crate::certs::{self, CertBundle};
    use crate::metrics::Metrics;
    use crate::webhook::fixtures::{
        CHECKPOINT, FakeSource, POD, checkpoint_json, ready_checkpoint, restore_pod_json,
        review_json,
    };

    const HOST: &str = "localhost";

    fn bundle() -> CertBundle {
        certs::generate(
            &[HOST.to_owned()],
            SystemTime::now(),
            certs::DEFAULT_VALIDITY,
        )
        .unwrap()
    }

    fn leaf_der(bundle: &CertBundle) -> Vec<u8> {
        CertificateDer::from_pem_slice(bundle.cert_pem.as_bytes())
            .unwrap()
            .to_vec()
    }

    /// One HTTPS request to the server, trusting only `ca_pem`. Returns the status, the body
    /// and the certificate the server presented.
    async fn post(
        addr: SocketAddr,
        ca_pem: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(StatusCode, Vec<u8>, Vec<u8>), String> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let config = ClientConfig::builder_with_provider(Arc::new(tls::provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let tls = TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from(HOST).unwrap(), stream)
            .await
            .map_err(|e| e.to_string())?;
        let served = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = hyper::Request::post(path)
            .header(header::HOST, HOST)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .unwrap();
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let bytes = axum::body::to_bytes(Body::new(response.into_body()), MAX_BODY_BYTES)
            .await
            .map_err(|e| e.to_string())?;
        Ok((status, bytes.to_vec(), served))
    }

    #[tokio::test]
    async fn serves_reviews_over_tls_and_picks_up_a_new_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let first = bundle();
        certs::write_files(&first, dir.path()).await.unwrap();
        let metrics = Arc::new(Metrics::default());
        let admission = Admission::new(
            Arc::new(FakeSource::with([ready_checkpoint("default", "llama")])),
            metrics.clone(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_listener(
            listener,
            TlsSource::in_dir(dir.path()).with_reload_interval(Duration::from_millis(50)),
            admission,
            async move {
                let _ = stopped.await;
            },
        ));

        // A restore pod comes back allowed with a JSON patch.
        let body = serde_json::to_vec(&review_json(
            POD,
            "CREATE",
            "default",
            "llama-restored",
            Some(restore_pod_json("default", "llama", "main")),
            None,
        ))
        .unwrap();
        let (status, reply, served) = post(addr, &first.ca_pem, PATH_MUTATE_PODS, body)
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(served, leaf_der(&first));
        let reply: serde_json::Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(reply["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(reply["kind"], "AdmissionReview");
        assert_eq!(
            reply["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(reply["response"]["allowed"], true);
        assert_eq!(reply["response"]["patchType"], "JSONPatch");

        // The validating route answers too.
        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["identity"]["model"] = json!("");
        let body = serde_json::to_vec(&review_json(
            CHECKPOINT,
            "CREATE",
            "default",
            "llama",
            Some(ck),
            None,
        ))
        .unwrap();
        let (status, reply, _) = post(addr, &first.ca_pem, PATH_VALIDATE_CHECKPOINTS, body)
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        let reply: serde_json::Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(reply["response"]["allowed"], false);

        // A key given twice is refused, not read as its last value: here a request with a
        // restore pod after a harmless one.
        let review = serde_json::to_string(&review_json(
            POD,
            "CREATE",
            "default",
            "llama-restored",
            Some(restore_pod_json("default", "llama", "main")),
            None,
        ))
        .unwrap();
        let twice = review.replacen('{', r#"{"request":{"uid":"first"},"#, 1);
        let (status, reply, _) = post(addr, &first.ca_pem, PATH_MUTATE_PODS, twice.into_bytes())
            .await
            .unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let reply = String::from_utf8_lossy(&reply);
        assert!(reply.contains("duplicate key \"request\""), "{reply}");

        // Not a review: 400, counted as an error, never allowed.
        let (status, reply, _) = post(
            addr,
            &first.ca_pem,
            PATH_MUTATE_PODS,
            b"{\"kind\":".to_vec(),
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&reply).contains("malformed AdmissionReview"));
        let (status, _, _) = post(
            addr,
            &first.ca_pem,
            PATH_VALIDATE_CHECKPOINTS,
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
        )
        .await
        .unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let text = metrics.encode();
        assert!(
            text.contains(
                "warmstart_webhook_decisions_total{webhook=\"mutate-pods\",outcome=\"error\"} 2"
            ),
            "{text}"
        );

        // Rotate to a certificate of a new CA: after a reload, new connections get it.
        let second = bundle();
        certs::write_files(&second, dir.path()).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let body = serde_json::to_vec(&review_json(
                POD,
                "CREATE",
                "default",
                "plain",
                Some(crate::webhook::fixtures::pod_json("default", &[])),
                None,
            ))
            .unwrap();
            match post(addr, &second.ca_pem, PATH_MUTATE_PODS, body).await {
                Ok((status, _, served)) => {
                    assert_eq!(status, StatusCode::OK);
                    assert_eq!(served, leaf_der(&second));
                    break;
                }
                Err(err) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "new certificate never served: {err}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        // The old CA no longer verifies the server.
        assert!(
            post(addr, &first.ca_pem, PATH_MUTATE_PODS, b"{}".to_vec())
                .await
                .is_err()
        );

        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(15), server)
            .await
            .expect("server stops after shutdown")
            .unwrap()
            .unwrap();
        assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
    }

    #[test]
    fn the_flags_default_to_the_deployment_layout() {
        use clap::{CommandFactory as _, Parser};
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            webhook: WebhookArgs,
        }
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["test"]).unwrap();
        assert_eq!(cli.webhook.listen, DEFAULT_ADDR.parse().unwrap());
        assert!(cli.webhook.certs.self_signed);
        let settings = cli.webhook.cert_settings();
        assert_eq!(settings.dir, std::path::Path::new(DEFAULT_CERT_DIR));
        assert_eq!(
            cli.webhook.tls_source().cert_path,
            std::path::Path::new(DEFAULT_CERT_DIR).join("tls.crt")
        );
        let cli = Cli::try_parse_from([
            "test",
            "--webhook-self-signed",
            "false",
            "--webhook-cert-dir",
            "/etc/webhook-certs",
        ])
        .unwrap();
        assert!(!cli.webhook.certs.self_signed);
        assert_eq!(
            cli.webhook.cert_dir,
            std::path::Path::new("/etc/webhook-certs")
        );
    }

    #[tokio::test]
    async fn a_missing_certificate_fails_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admission = Admission::new(
            Arc::new(FakeSource::default()),
            Arc::new(Metrics::default()),
        );
        let err = serve_listener(listener, TlsSource::in_dir(dir.path()), admission, async {})
            .await
            .unwrap_err();
        assert!(
            matches!(err, WebhookError::Certificate(TlsError::Read { .. })),
            "{err:?}"
        );
    }
}
