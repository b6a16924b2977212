//! Prometheus metrics of the controller (`warmstart_*`): reconciles and their errors by result,
//! reconcile duration, Checkpoints by phase, the bytes their artifacts take in the store, and
//! admission webhook decisions by outcome.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use warmstart_shared::CheckpointPhase;
use warmstart_shell::admin::Exposes;
use warmstart_shell::metrics::Exposition;

/// Label of a reconcile outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or the error's metric label.
    pub result: String,
}

/// Label of a Checkpoint phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// The phase.
    pub phase: String,
}

/// Label of an artifact store.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabel {
    /// `pvc` or `s3`.
    pub store: String,
}

/// Labels of a webhook decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabel {
    /// `mutate-pods` or `validate-checkpoints`.
    pub webhook: String,
    /// `allowed`, `mutated`, `denied` or `error`.
    pub outcome: String,
}

/// The controller's metrics.
#[derive(Debug)]
pub struct Metrics {
    exposition: Exposition,
    reconciles: Family<ResultLabel, Counter>,
    reconcile_duration: Histogram,
    checkpoints: Family<PhaseLabel, Gauge>,
    artifact_bytes: Family<StoreLabel, Gauge>,
    webhook: Family<WebhookLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("warmstart");
        let reconciles = Family::<ResultLabel, Counter>::default();
        registry.register(
            "reconciles",
            "Checkpoint reconciles by result (ok or error kind)",
            reconciles.clone(),
        );
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one Checkpoint reconcile",
            reconcile_duration.clone(),
        );
        let checkpoints = Family::<PhaseLabel, Gauge>::default();
        registry.register("checkpoints", "Checkpoints by phase", checkpoints.clone());
        let artifact_bytes = Family::<StoreLabel, Gauge>::default();
        registry.register(
            "artifact_bytes",
            "Bytes of the artifacts of Ready Checkpoints (each identity once) by store",
            artifact_bytes.clone(),
        );
        let webhook = Family::<WebhookLabel, Counter>::default();
        registry.register(
            "webhook_decisions",
            "Admission webhook decisions by webhook and outcome",
            webhook.clone(),
        );
        Self {
            exposition: Exposition::from(registry),
            reconciles,
            reconcile_duration,
            checkpoints,
            artifact_bytes,
            webhook,
        }
    }
}

impl Metrics {
    /// Records one reconcile.
    pub fn reconciled(&self, result: &str, duration: Duration) {
        self.reconciles
            .get_or_create(&ResultLabel {
                result: result.to_owned(),
            })
            .inc();
        self.reconcile_duration.observe(duration.as_secs_f64());
    }

    /// Sets the number of Checkpoints per phase (every phase, zero included).
    pub fn set_phases(&self, counts: &[(CheckpointPhase, usize)]) {
        for phase in CheckpointPhase::ALL {
            let n = counts
                .iter()
                .find(|(p, _)| *p == phase)
                .map_or(0, |(_, n)| *n);
            self.checkpoints
                .get_or_create(&PhaseLabel {
                    phase: phase.to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Sets the bytes the Ready Checkpoints' artifacts take in `store`.
    pub fn set_artifact_bytes(&self, store: &str, bytes: u64) {
        self.artifact_bytes
            .get_or_create(&StoreLabel {
                store: store.to_owned(),
            })
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Records one webhook decision.
    pub fn webhook_decision(&self, webhook: &str, outcome: &str) {
        self.webhook
            .get_or_create(&WebhookLabel {
                webhook: webhook.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        self.exposition.encode()
    }
}

impl Exposes for Metrics {
    fn exposition(&self) -> &Exposition {
        &self.exposition
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exposed_once_used() {
        let m = Metrics::default();
        m.reconciled("ok", Duration::from_millis(3));
        m.reconciled("job_failed", Duration::from_millis(1));
        m.set_phases(&[(CheckpointPhase::Ready, 2)]);
        m.webhook_decision("mutate-pods", "denied");
        m.set_artifact_bytes("s3", 4096);
        let text = m.encode();
        for needle in [
            "warmstart_reconciles_total{result=\"ok\"} 1",
            "warmstart_reconciles_total{result=\"job_failed\"} 1",
            "warmstart_reconcile_duration_seconds_count 2",
            "warmstart_checkpoints{phase=\"Ready\"} 2",
            "warmstart_checkpoints{phase=\"Failed\"} 0",
            "warmstart_artifact_bytes{store=\"s3\"} 4096",
            "warmstart_webhook_decisions_total{webhook=\"mutate-pods\",outcome=\"denied\"} 1",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }
}
