//! Requests to the S3 endpoint: signed by `rusty-s3` (query-string SigV4), sent with hyper over
//! rustls, bounded in time and in the size of what is read back, retried with exponential
//! backoff where a retry can help (no answer, 5xx, throttling), and answers turned into
//! [`StoreError`]s naming the operation, endpoint and bucket.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rusty_s3::{Bucket, Credentials, UrlStyle};
use url::Url;

use crate::config::StoreConfig;
use crate::error::{ServerAnswer, StoreError};

/// How long a presigned request stays valid: longer than any one request may take.
pub(crate) const SIGNATURE_LIFETIME: Duration = Duration::from_secs(3600);
/// Largest error or listing body read.
pub(crate) const MAX_SMALL_BODY: usize = 8 << 20;

/// A signed request to send: the URL carries the signature, `headers` are sent as they are
/// (those that must be signed were signed).
#[derive(Debug)]
pub(crate) struct Signed {
    pub method: Method,
    pub url: Url,
    pub headers: Vec<(&'static str, String)>,
    pub body: Bytes,
}

/// A successful answer.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// One attempt's failure.
#[derive(Debug)]
enum Attempt {
    /// The server answered with an error status.
    Refused(ServerAnswer),
    /// No (complete) answer.
    Transport(String),
    /// The TLS handshake failed (an unknown CA, a name the certificate does not cover): trying
    /// again cannot help.
    Tls(String),
}

/// The S3 client of one store.
#[derive(Clone)]
pub(crate) struct S3 {
    http: HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>,
    pub bucket: Arc<Bucket>,
    pub credentials: Arc<Credentials>,
    pub config: Arc<StoreConfig>,
    store: Arc<str>,
}

impl std::fmt::Debug for S3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3").field("store", &self.store).finish()
    }
}

impl S3 {
    /// A client for `config`, its credentials read from their files.
    pub fn new(config: StoreConfig) -> Result<Self, StoreError> {
        config.validate()?;
        let creds = config.credentials()?;
        let style = if config.path_style {
            UrlStyle::Path
        } else {
            UrlStyle::VirtualHost
        };
        let bucket = Bucket::new(
            config.endpoint.clone(),
            style,
            config.bucket.clone(),
            config.region.clone(),
        )
        .map_err(|e| StoreError::Client(format!("{}: {e}", config.describe())))?;
        let tls = tls_config(&config)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        http.set_nodelay(true);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            http: client,
            bucket: Arc::new(bucket),
            credentials: Arc::new(Credentials::new(
                creds.access_key_id.expose(),
                creds.secret_access_key.expose(),
            )),
            store: config.describe().into(),
            config: Arc::new(config),
        })
    }

    /// `http://host:port bucket name`, for messages.
    pub fn store(&self) -> String {
        self.store.to_string()
    }

    /// Sends the request `sign` makes (signed again for every attempt), retrying transport
    /// failures, 5xx and throttling with exponential backoff. `Ok(None)` for a 404 whose code is
    /// `NoSuchKey` or `NoSuchUpload` (or a 404 without a body), the absent object.
    pub async fn send(
        &self,
        op: &str,
        limit: usize,
        sign: impl Fn() -> Signed,
    ) -> Result<Option<Answer>, StoreError> {
        let mut attempts = 0;
        let mut backoff = self.config.retry_backoff;
        loop {
            attempts += 1;
            let failure = match self.attempt(sign(), limit).await {
                Ok(answer) => return Ok(Some(answer)),
                Err(Attempt::Refused(answer)) if answer.status == 404 => {
                    if answer.code == "NoSuchBucket" {
                        return Err(StoreError::NoSuchBucket {
                            store: self.store(),
                            bucket: self.config.bucket.clone(),
                            answer,
                        });
                    }
                    if matches!(answer.code.as_str(), "NoSuchKey" | "NoSuchUpload" | "") {
                        return Ok(None);
                    }
                    Attempt::Refused(answer)
                }
                Err(failure) => failure,
            };
            let retry = match &failure {
                Attempt::Transport(_) => true,
                Attempt::Tls(_) => false,
                Attempt::Refused(a) => {
                    a.status >= 500
                        || a.status == 429
                        || matches!(
                            a.code.as_str(),
                            "RequestTimeout" | "SlowDown" | "InternalError"
                        )
                }
            };
            if !retry || attempts > self.config.retries {
                return Err(self.failed(op, attempts, failure));
            }
            tracing::debug!(op, attempts, ?failure, "retrying an object store request");
            tokio::time::sleep(backoff).await;
            backoff = backoff.saturating_mul(2).min(Duration::from_secs(30));
        }
    }

    /// As [`S3::send`], an absent object being an error too.
    pub async fn send_present(
        &self,
        op: &str,
        limit: usize,
        sign: impl Fn() -> Signed,
    ) -> Result<Answer, StoreError> {
        self.send(op, limit, sign)
            .await?
            .ok_or_else(|| StoreError::Server {
                store: self.store(),
                op: op.to_owned(),
                attempts: 1,
                answer: ServerAnswer {
                    status: 404,
                    code: "NoSuchKey".into(),
                    message: "the object or upload does not exist".into(),
                },
            })
    }

    fn failed(&self, op: &str, attempts: u32, failure: Attempt) -> StoreError {
        match failure {
            Attempt::Refused(answer)
                if answer.status == 403
                    || matches!(
                        answer.code.as_str(),
                        "AccessDenied" | "SignatureDoesNotMatch" | "InvalidAccessKeyId"
                    ) =>
            {
                StoreError::AccessDenied {
                    store: self.store(),
                    op: op.to_owned(),
                    answer,
                }
            }
            Attempt::Refused(answer) => StoreError::Server {
                store: self.store(),
                op: op.to_owned(),
                attempts,
                answer,
            },
            Attempt::Transport(detail) => StoreError::Transport {
                store: self.store(),
                op: op.to_owned(),
                attempts,
                detail,
            },
            Attempt::Tls(detail) => StoreError::Tls {
                store: self.store(),
                op: op.to_owned(),
                detail,
            },
        }
    }

    async fn attempt(&self, signed: Signed, limit: usize) -> Result<Answer, Attempt> {
        let timeout = self.config.request_timeout;
        let uri: http::Uri = signed
            .url
            .as_str()
            .parse()
            .map_err(|e| Attempt::Transport(format!("unusable URL: {e}")))?;
        let mut request = Request::builder().method(signed.method).uri(uri);
        for (name, value) in &signed.headers {
            request = request.header(*name, value);
        }
        let request = request
            .body(Full::new(signed.body))
            .map_err(|e| Attempt::Transport(format!("cannot build the request: {e}")))?;
        let exchange = async {
            let response = self.http.request(request).await.map_err(|e| {
                if is_tls_error(&e) {
                    Attempt::Tls(describe_chain(&e))
                } else {
                    Attempt::Transport(describe_chain(&e))
                }
            })?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, limit)
                .collect()
                .await
                .map_err(|e| Attempt::Transport(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok::<_, Attempt>((parts, body))
        };
        let (parts, body) = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| Attempt::Transport(format!("no complete answer within {timeout:?}")))??;
        if parts.status.is_success() {
            return Ok(Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            });
        }
        Err(Attempt::Refused(parse_error_body(parts.status, &body)))
    }
}

/// Whether rustls refused the connection somewhere in `error`'s causes. hyper-rustls hands a
/// handshake failure over as an `io::Error` wrapping tokio-rustls's `io::Error` wrapping the
/// `rustls::Error`, and an `io::Error`'s `source` skips what it wraps: both paths are walked.
fn is_tls_error(error: &(dyn std::error::Error + 'static)) -> bool {
    if error.is::<rustls::Error>() {
        return true;
    }
    let wrapped = error
        .downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::get_ref)
        .is_some_and(|inner| is_tls_error(inner));
    wrapped || error.source().is_some_and(is_tls_error)
}

/// The error and its causes, `: `-separated (hyper's own message alone says little).
fn describe_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// An S3 error body's code and message (`<Error><Code>…</Code><Message>…</Message></Error>`).
pub(crate) fn parse_error_body(status: StatusCode, body: &[u8]) -> ServerAnswer {
    let text = String::from_utf8_lossy(body);
    let element = |name: &str| {
        let open = format!("<{name}>");
        let close = format!("</{name}>");
        text.find(&open)
            .and_then(|start| {
                let rest = &text[start + open.len()..];
                rest.find(&close).map(|end| unescape(&rest[..end]))
            })
            .unwrap_or_default()
    };
    ServerAnswer {
        status: status.as_u16(),
        code: element("Code"),
        message: element("Message"),
    }
}

/// XML's predefined entities.
pub(crate) fn unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// The TLS settings: the CA bundle's certificates, or the system's roots.
fn tls_config(config: &StoreConfig) -> Result<rustls::ClientConfig, StoreError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Client(format!("TLS: {e}")))?;
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &config.ca_file {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(Iterator::collect)
            .map_err(|e| {
                StoreError::Client(format!(
                    "--s3-ca-file {}: not a PEM certificate bundle: {e}",
                    path.display()
                ))
            })?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(StoreError::Client(format!(
                "--s3-ca-file {}: no usable CA certificate in it",
                path.display()
            )));
        }
    } else if config.endpoint.scheme() == "https" {
        let found = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(found.certs);
        if roots.is_empty() {
            return Err(StoreError::Client(
                "no system CA certificates found for the https endpoint: set --s3-ca-file".into(),
            ));
        }
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_handshake_failure_is_found_however_deep_it_is_wrapped() {
        let tls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::General("bad certificate".into()),
        );
        assert!(is_tls_error(&std::io::Error::other(tls)));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!is_tls_error(&std::io::Error::other(refused)));
    }

    #[test]
    fn an_error_body_gives_code_and_message() {
        let body = br#"<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>BadDigest</Code><Message>The Content-MD5 you specified did not match &amp; so on</Message><Resource>/b/k</Resource></Error>"#;
        let answer = parse_error_body(StatusCode::BAD_REQUEST, body);
        assert_eq!(answer.code, "BadDigest");
        assert_eq!(
            answer.message,
            "The Content-MD5 you specified did not match & so on"
        );
        assert_eq!(
            answer.to_string(),
            "HTTP 400 BadDigest: The Content-MD5 you specified did not match & so on"
        );
        let empty = parse_error_body(StatusCode::NOT_FOUND, b"");
        assert_eq!(empty.to_string(), "HTTP 404");
    }
}
