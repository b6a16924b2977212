//! The admin endpoint of a server: `/healthz` (the process serves), `/readyz` (the program says
//! it is ready: what that means is the program's), `/metrics` (OpenMetrics text).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::{CONTENT_TYPE, Exposition};

/// What `/readyz` answers: set by the program when it is able to do its work, cleared when it
/// no longer is.
#[derive(Debug, Default)]
pub struct Health {
    /// Whether the program is ready.
    pub ready: AtomicBool,
}

/// Something that has metrics to expose.
pub trait Exposes: Send + Sync + 'static {
    /// The program's metrics registry.
    fn exposition(&self) -> &Exposition;
}

impl Exposes for Exposition {
    fn exposition(&self) -> &Exposition {
        self
    }
}

/// The admin endpoint could not be served.
#[derive(Debug, Error)]
#[error("cannot serve the admin endpoint on {addr}")]
pub struct AdminError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

struct AdminState<M> {
    health: Arc<Health>,
    metrics: Arc<M>,
}

impl<M> Clone for AdminState<M> {
    fn clone(&self) -> Self {
        Self {
            health: self.health.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// The admin router.
pub fn router<M: Exposes>(health: Arc<Health>, metrics: Arc<M>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz::<M>))
        .route("/metrics", get(metrics_text::<M>))
        .with_state(AdminState { health, metrics })
}

/// Binds `addr` and serves [`router`] on it from a spawned task until `stop` holds `true`.
/// Binding happens before this returns, so a taken port is a start-up error.
///
/// # Errors
/// [`AdminError`] when `addr` cannot be bound.
pub async fn serve<M: Exposes>(
    addr: SocketAddr,
    health: Arc<Health>,
    metrics: Arc<M>,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<std::io::Result<()>>, AdminError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AdminError { addr, source })?;
    Ok(serve_listener(listener, health, metrics, stop))
}

/// [`serve`] on a listener already bound.
pub fn serve_listener<M: Exposes>(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    metrics: Arc<M>,
    stop: watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    let router = router(health, metrics);
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(crate::shutdown::requested(stop))
            .await
    })
}

async fn readyz<M>(State(s): State<AdminState<M>>) -> impl IntoResponse {
    if s.health.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

async fn metrics_text<M: Exposes>(State(s): State<AdminState<M>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        s.metrics.exposition().encode(),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// One HTTP/1.1 request over loopback; the whole response as text.
    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }

    #[tokio::test]
    async fn health_readiness_and_metrics_are_served_until_shutdown() {
        let mut registry = Registry::with_prefix("warmstart_test");
        let gauge = Gauge::<i64>::default();
        registry.register("depth", "Queue depth", gauge.clone());
        gauge.set(7);
        let health = Arc::new(Health::default());
        let (stop_tx, stop_rx) = watch::channel(false);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = serve_listener(
            listener,
            health.clone(),
            Arc::new(Exposition::from(registry)),
            stop_rx,
        );

        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        let not_ready = get(addr, "/readyz").await;
        assert!(not_ready.starts_with("HTTP/1.1 503"), "{not_ready}");
        assert!(not_ready.ends_with("not ready"), "{not_ready}");
        health.ready.store(true, Ordering::Relaxed);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));

        let metrics = get(addr, "/metrics").await;
        assert!(
            metrics.contains(&format!("content-type: {CONTENT_TYPE}")),
            "{metrics}"
        );
        assert!(metrics.contains("warmstart_test_depth 7"), "{metrics}");

        stop_tx.send_replace(true);
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the endpoint outlived its shutdown")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_taken_address_is_a_start_up_error_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let (_tx, rx) = watch::channel(false);
        let err = serve(
            addr,
            Arc::new(Health::default()),
            Arc::new(Exposition::from(Registry::default())),
            rx,
        )
        .await
        .unwrap_err();
        assert_eq!(err.addr, addr);
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
