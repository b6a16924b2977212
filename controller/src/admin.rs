//! The admin HTTP endpoint: `/healthz` (the process serves), `/readyz` (the webhook listener is
//! up and the API answered once), `/metrics` (Prometheus text format).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;

/// What the admin endpoint reports.
#[derive(Debug, Default)]
pub struct Health {
    /// Set once the controller is ready to serve (webhook up, API reachable).
    pub ready: AtomicBool,
}

#[derive(Clone)]
struct AdminState {
    health: Arc<Health>,
    metrics: Arc<Metrics>,
}

/// The admin router.
pub fn router(health: Arc<Health>, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AdminState { health, metrics })
}

async fn readyz(State(s): State<AdminState>) -> impl IntoResponse {
    if s.health.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

async fn metrics_text(State(s): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}
