//! Prometheus metrics of the agent in cluster mode (`warmstart_agent_*`): operations by result,
//! phase durations, bytes of published artifacts, refusals by reason, operations in flight
//! and how far they are, restore pods' time to Ready and their fallbacks to a cold start by
//! reason, and the build.

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use warmstart_shell::admin::Exposes;
use warmstart_shell::metrics::Exposition;

use crate::progress::Operation;
use crate::timings::Timings;

/// How an operation that ran ended (the `result` label; a refusal is counted by
/// [`Metrics::refused`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It did what it was asked.
    Success,
    /// It failed, for this cause; nothing was published or restored.
    Failure(FailureCause),
}

impl Ended {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure(_) => "failure",
        }
    }
}

/// What made a checkpoint or restore fail: a bounded set of label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureCause {
    /// The container could not be found or inspected.
    Container,
    /// The artifact: unsafe path, missing, incomplete, changed, replaced.
    Artifact,
    /// The placeholder cannot take the restore (state, mounts, GPUs, claimed).
    Placeholder,
    /// CRIU (dump, restore, or the restore helper).
    Criu,
    /// The GPU state (CUDA checkpoint or restore).
    Gpu,
    /// The root filesystem's changes (captured or applied).
    Rootfs,
    /// Publishing the artifact.
    Publish,
    /// The node: a file operation, the log directory, a task that died.
    Node,
    /// The agent restarted during the operation.
    Interrupted,
}

impl FailureCause {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Container => "container",
            Self::Artifact => "artifact",
            Self::Placeholder => "placeholder",
            Self::Criu => "criu",
            Self::Gpu => "gpu",
            Self::Rootfs => "rootfs",
            Self::Publish => "publish",
            Self::Node => "node",
            Self::Interrupted => "interrupted",
        }
    }
}

/// Labels of a failure.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabel {
    /// `checkpoint` or `restore`.
    pub operation: String,
    /// [`FailureCause::as_str`].
    pub cause: &'static str,
}

/// Labels of a finished operation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabel {
    /// `checkpoint` or `restore`.
    pub operation: String,
    /// `success`, `failure` or `refused`.
    pub result: String,
}

/// Labels of a phase duration.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// `checkpoint` or `restore`.
    pub operation: String,
    /// The phase (`dump`, `publish`, `verify`, `criu-restore`, …, and `total`).
    pub phase: String,
}

/// Labels of a refusal.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabel {
    /// `checkpoint` or `restore`.
    pub operation: String,
    /// The rule broken ([`super::validate::Refusal::metric_label`]).
    pub reason: String,
}

/// Labels of the in-flight gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InFlightLabel {
    /// `checkpoint` or `restore`.
    pub operation: String,
}

/// Labels of the restore pods' time to Ready.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `restored` or `cold_start`.
    pub outcome: String,
}

/// Why a restore pod fell back to a cold start: a bounded set of label values.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum FallbackReason {
    /// The agent refused the restore (validation: binding, Checkpoint, pod state, …).
    Refused,
    /// The artifact could not be used (missing, incomplete, unreadable).
    Artifact,
    /// The restore ran and failed (CRIU, verification, GPU, placeholder).
    Failed,
    /// The agent restarted during the restore.
    Interrupted,
}

impl FallbackReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Refused => "refused",
            Self::Artifact => "artifact",
            Self::Failed => "failed",
            Self::Interrupted => "interrupted",
        }
    }
}

/// Labels of the fallback counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabel {
    /// [`FallbackReason::as_str`].
    pub reason: &'static str,
}

/// Labels of the build-info metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    /// The agent's version.
    pub version: String,
}

/// The agent's metrics.
#[derive(Debug)]
pub struct Metrics {
    exposition: Exposition,
    operations: Family<OperationLabel, Counter>,
    durations: Family<PhaseLabel, Histogram>,
    artifact_bytes: Histogram,
    refusals: Family<RefusalLabel, Counter>,
    in_flight: Family<InFlightLabel, Gauge>,
    pod_ready: Family<OutcomeLabel, Histogram>,
    fallbacks: Family<FallbackLabel, Counter>,
    failures: Family<FailureLabel, Counter>,
    bytes_done: Family<InFlightLabel, Gauge>,
    bytes_total: Family<InFlightLabel, Gauge>,
    cache_bytes: Gauge,
    cache_reads: Family<CacheReadLabel, Counter>,
    prestages: Family<CacheReadLabel, Counter>,
}

/// How a read of the node's cache (a restore's, or a pre-staging) went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheResult {
    /// The artifact was on the node's disk.
    Hit,
    /// It was fetched there first.
    Fetched,
    /// It could not be had.
    Failed,
}

impl CacheResult {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "hit",
            Self::Fetched => "fetched",
            Self::Failed => "failed",
        }
    }
}

/// How a restore got its artifact from the node's cache.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheReadLabel {
    /// `hit` (on the node's disk), `fetched` (copied there first) or `failed`.
    pub result: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("warmstart_agent");
        let operations = Family::<OperationLabel, Counter>::default();
        registry.register(
            "operations",
            "Checkpoints and restores by result (success, failure, refused)",
            operations.clone(),
        );
        // 5 ms to 87 minutes, by doublings: a checkpoint of a large model takes many minutes.
        let durations = Family::<PhaseLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 21))
        });
        registry.register(
            "operation_duration_seconds",
            "Duration of each phase of checkpoints and restores, and their total",
            durations.clone(),
        );
        // 1 MiB to 1 TiB, by factors of four.
        let artifact_bytes = Histogram::new(exponential_buckets(1_048_576.0, 4.0, 11));
        registry.register(
            "artifact_bytes",
            "Size of each artifact this agent published",
            artifact_bytes.clone(),
        );
        let refusals = Family::<RefusalLabel, Counter>::default();
        registry.register(
            "refusals",
            "Operations refused by validation, by rule",
            refusals.clone(),
        );
        // What users buy warmstart for: a restore pod's time from creation to Ready, restored
        // or fallen back to a cold start. 0.25 s to 68 minutes, by doublings.
        let pod_ready = Family::<OutcomeLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.25, 2.0, 15))
        });
        registry.register(
            "restore_pod_ready_seconds",
            "Time from a restore pod's creation to Ready, by outcome (restored, cold_start)",
            pod_ready.clone(),
        );
        let failures = Family::<FailureLabel, Counter>::default();
        registry.register(
            "failures",
            "Checkpoints and restores that failed, by cause",
            failures.clone(),
        );
        let fallbacks = Family::<FallbackLabel, Counter>::default();
        registry.register(
            "restore_fallbacks",
            "Restores that restored nothing, so their pod falls back to a cold start, by reason",
            fallbacks.clone(),
        );
        for reason in [
            FallbackReason::Refused,
            FallbackReason::Artifact,
            FallbackReason::Failed,
            FallbackReason::Interrupted,
        ] {
            let _ = fallbacks.get_or_create(&FallbackLabel {
                reason: reason.as_str(),
            });
        }
        let bytes_done = Family::<InFlightLabel, Gauge>::default();
        registry.register(
            "operation_bytes_done",
            "Bytes done by the current phase of the checkpoints and restores running now",
            bytes_done.clone(),
        );
        let bytes_total = Family::<InFlightLabel, Gauge>::default();
        registry.register(
            "operation_bytes_total",
            "Bytes expected by the current phase of the checkpoints and restores running now",
            bytes_total.clone(),
        );
        let in_flight = Family::<InFlightLabel, Gauge>::default();
        registry.register(
            "operations_in_flight",
            "Checkpoints and restores running now",
            in_flight.clone(),
        );
        for operation in [Operation::Checkpoint, Operation::Restore] {
            let label = InFlightLabel {
                operation: operation.as_str().to_owned(),
            };
            let _ = in_flight.get_or_create(&label);
            let _ = bytes_done.get_or_create(&label);
            let _ = bytes_total.get_or_create(&label);
        }
        let (cache_bytes, cache_reads, prestages) = register_cache(&mut registry);
        let build = Family::<BuildLabel, Gauge>::default();
        build
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION").to_owned(),
            })
            .set(1);
        registry.register("build_info", "The agent's build (value 1)", build);
        Self {
            exposition: Exposition::from(registry),
            operations,
            durations,
            artifact_bytes,
            refusals,
            in_flight,
            pod_ready,
            fallbacks,
            failures,
            bytes_done,
            bytes_total,
            cache_bytes,
            cache_reads,
            prestages,
        }
    }
}

/// The node cache's metrics, registered in `registry`: its size, restores' reads, pre-staging.
fn register_cache(
    registry: &mut Registry,
) -> (
    Gauge,
    Family<CacheReadLabel, Counter>,
    Family<CacheReadLabel, Counter>,
) {
    let cache_bytes = Gauge::default();
    registry.register(
        "cache_bytes",
        "Bytes of the artifacts in this node's cache",
        cache_bytes.clone(),
    );
    let cache_reads = Family::<CacheReadLabel, Counter>::default();
    registry.register(
        "cache_reads",
        "Restores' reads of the node's artifact cache, by result (hit, fetched, failed)",
        cache_reads.clone(),
    );
    let prestages = Family::<CacheReadLabel, Counter>::default();
    registry.register(
        "prestages",
        "Artifacts pre-staged into the node's cache for Checkpoints selecting this node, by result (fetched, hit: already there, failed)",
        prestages.clone(),
    );
    (cache_bytes, cache_reads, prestages)
}

/// One running operation's share of the progress gauges (which sum every operation running
/// now); taken back when dropped.
#[derive(Debug)]
pub struct ProgressShare {
    done: Gauge,
    total: Gauge,
    counted: Mutex<(i64, i64)>,
}

impl ProgressShare {
    /// This operation's current phase is `done` of `total` bytes.
    pub fn update(&self, done: u64, total: u64) {
        let (done, total) = (
            i64::try_from(done).unwrap_or(i64::MAX),
            i64::try_from(total).unwrap_or(i64::MAX),
        );
        let mut counted = self
            .counted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.done.inc_by(done - counted.0);
        self.total.inc_by(total - counted.1);
        *counted = (done, total);
    }
}

impl Drop for ProgressShare {
    fn drop(&mut self) {
        self.update(0, 0);
    }
}

/// Decrements the in-flight gauge when dropped.
#[derive(Debug)]
pub struct InFlight {
    gauge: Gauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

impl Metrics {
    /// Counts one operation as running until the guard is dropped.
    pub fn start(&self, operation: Operation) -> InFlight {
        let gauge = self
            .in_flight
            .get_or_create(&InFlightLabel {
                operation: operation.as_str().to_owned(),
            })
            .clone();
        gauge.inc();
        InFlight { gauge }
    }

    /// Records a finished operation, its phases and its total (wall-clock: phases that ran
    /// beside the others are not added), when its timings are known.
    pub fn finished(&self, operation: Operation, result: Ended, timings: Option<&Timings>) {
        let operation = operation.as_str();
        self.operations
            .get_or_create(&OperationLabel {
                operation: operation.to_owned(),
                result: result.as_str().to_owned(),
            })
            .inc();
        if let Ended::Failure(cause) = result {
            self.failures
                .get_or_create(&FailureLabel {
                    operation: operation.to_owned(),
                    cause: cause.as_str(),
                })
                .inc();
        }
        let Some(timings) = timings.filter(|t| !t.phases().is_empty()) else {
            return;
        };
        for (phase, d) in timings.phases() {
            self.observe(operation, phase, *d);
        }
        self.observe(operation, "total", timings.total());
    }

    fn observe(&self, operation: &str, phase: &str, d: Duration) {
        self.durations
            .get_or_create(&PhaseLabel {
                operation: operation.to_owned(),
                phase: phase.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    /// Records a refusal.
    pub fn refused(&self, operation: Operation, reason: &str) {
        let operation = operation.as_str();
        self.refusals
            .get_or_create(&RefusalLabel {
                operation: operation.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
        self.operations
            .get_or_create(&OperationLabel {
                operation: operation.to_owned(),
                result: "refused".to_owned(),
            })
            .inc();
    }

    /// A running operation's share of the progress gauges.
    pub fn progress(&self, operation: Operation) -> ProgressShare {
        let label = InFlightLabel {
            operation: operation.as_str().to_owned(),
        };
        ProgressShare {
            done: self.bytes_done.get_or_create(&label).clone(),
            total: self.bytes_total.get_or_create(&label).clone(),
            counted: Mutex::new((0, 0)),
        }
    }

    /// Counts a restore that restored nothing: its pod falls back to a cold start.
    pub fn fell_back(&self, reason: FallbackReason) {
        self.fallbacks
            .get_or_create(&FallbackLabel {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// Records a restore pod's time from creation to Ready, by `outcome`.
    pub fn pod_ready(&self, outcome: &str, after: Duration) {
        self.pod_ready
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .observe(after.as_secs_f64());
    }

    /// Records the size of a published artifact.
    #[allow(clippy::cast_precision_loss)] // a histogram of sizes needs no byte precision
    pub fn published(&self, bytes: u64) {
        self.artifact_bytes.observe(bytes as f64);
    }

    /// A restore's read of the node's cache (`hit`, `fetched`, `failed`), and the cache's size
    /// after it when it was measured.
    pub fn cache_read(&self, result: CacheResult, cache_bytes: Option<u64>) {
        self.cache_reads
            .get_or_create(&CacheReadLabel {
                result: result.as_str(),
            })
            .inc();
        if let Some(bytes) = cache_bytes {
            self.cache_bytes
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// A pre-staging of an artifact into the node's cache (`fetched`, `hit`, `failed`), and the
    /// cache's size after it when it was measured.
    pub fn prestaged(&self, result: CacheResult, cache_bytes: Option<u64>) {
        self.prestages
            .get_or_create(&CacheReadLabel {
                result: result.as_str(),
            })
            .inc();
        if let Some(bytes) = cache_bytes {
            self.cache_bytes
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
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
        {
            let _guard = m.start(Operation::Restore);
            assert!(
                m.encode()
                    .contains("warmstart_agent_operations_in_flight{operation=\"restore\"} 1")
            );
        }
        let mut timings = Timings::default();
        timings.record("dump", Duration::from_millis(300));
        timings.record("publish", Duration::from_millis(100));
        timings.record_beside("verify", Duration::from_millis(250));
        m.finished(Operation::Checkpoint, Ended::Success, Some(&timings));
        m.refused(Operation::Restore, "binding");
        m.published(4096);
        m.pod_ready("restored", Duration::from_millis(2700));
        let text = m.encode();
        for needle in [
            "warmstart_agent_operations_total{operation=\"checkpoint\",result=\"success\"} 1",
            "warmstart_agent_operations_total{operation=\"restore\",result=\"refused\"} 1",
            "warmstart_agent_operation_duration_seconds_count{operation=\"checkpoint\",phase=\"dump\"} 1",
            "warmstart_agent_operation_duration_seconds_sum{operation=\"checkpoint\",phase=\"total\"} 0.4",
            "warmstart_agent_artifact_bytes_sum 4096.0",
            "warmstart_agent_artifact_bytes_count 1",
            "warmstart_agent_refusals_total{operation=\"restore\",reason=\"binding\"} 1",
            "warmstart_agent_restore_pod_ready_seconds_sum{outcome=\"restored\"} 2.7",
            "warmstart_agent_operations_in_flight{operation=\"restore\"} 0",
            "warmstart_agent_operations_in_flight{operation=\"checkpoint\"} 0",
            "warmstart_agent_build_info{version=",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }

    #[test]
    fn the_progress_gauges_sum_the_running_operations_and_fall_back_when_they_end() {
        let m = Metrics::default();
        let gauges = |m: &Metrics| {
            let text = m.encode();
            let value = |name: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}{{operation=\"checkpoint\"}} ")))
                    .map(str::to_owned)
            };
            (
                value("warmstart_agent_operation_bytes_done"),
                value("warmstart_agent_operation_bytes_total"),
            )
        };
        assert_eq!(gauges(&m), (Some("0".into()), Some("0".into())));
        let first = m.progress(Operation::Checkpoint);
        let second = m.progress(Operation::Checkpoint);
        first.update(100, 1000);
        second.update(50, 500);
        first.update(400, 1000);
        assert_eq!(gauges(&m), (Some("450".into()), Some("1500".into())));
        drop(first);
        assert_eq!(gauges(&m), (Some("50".into()), Some("500".into())));
        drop(second);
        assert_eq!(gauges(&m), (Some("0".into()), Some("0".into())));
    }

    #[test]
    fn failures_are_counted_by_cause() {
        let m = Metrics::default();
        m.finished(
            Operation::Restore,
            Ended::Failure(FailureCause::Artifact),
            None,
        );
        m.finished(Operation::Restore, Ended::Failure(FailureCause::Criu), None);
        m.finished(Operation::Restore, Ended::Success, None);
        let text = m.encode();
        for needle in [
            "warmstart_agent_operations_total{operation=\"restore\",result=\"failure\"} 2",
            "warmstart_agent_failures_total{operation=\"restore\",cause=\"artifact\"} 1",
            "warmstart_agent_failures_total{operation=\"restore\",cause=\"criu\"} 1",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert!(!text.contains("cause=\"gpu\""), "{text}");
    }

    #[test]
    fn fallbacks_are_counted_by_reason_each_shown_from_the_start() {
        let m = Metrics::default();
        m.fell_back(FallbackReason::Failed);
        m.fell_back(FallbackReason::Failed);
        m.fell_back(FallbackReason::Refused);
        let text = m.encode();
        for needle in [
            "warmstart_agent_restore_fallbacks_total{reason=\"failed\"} 2",
            "warmstart_agent_restore_fallbacks_total{reason=\"refused\"} 1",
            "warmstart_agent_restore_fallbacks_total{reason=\"artifact\"} 0",
            "warmstart_agent_restore_fallbacks_total{reason=\"interrupted\"} 0",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }

    #[test]
    fn a_checkpoint_of_forty_minutes_lands_in_a_finite_bucket() {
        let m = Metrics::default();
        let mut timings = Timings::default();
        timings.record("dump", Duration::from_secs(40 * 60));
        m.finished(Operation::Checkpoint, Ended::Success, Some(&timings));
        let text = m.encode();
        let prefix = "le=\"";
        let finite: Vec<(f64, u64)> = text
            .lines()
            .filter(|l| {
                l.starts_with("warmstart_agent_operation_duration_seconds_bucket")
                    && l.contains("phase=\"dump\"")
            })
            .filter_map(|l| {
                let le = l
                    .split(prefix)
                    .nth(1)?
                    .split('"')
                    .next()?
                    .parse::<f64>()
                    .ok()?;
                let count = l.rsplit(' ').next()?.parse::<u64>().ok()?;
                le.is_finite().then_some((le, count))
            })
            .collect();
        let (largest, count) = finite
            .iter()
            .copied()
            .fold((0.0, 0), |a, b| if b.0 > a.0 { b } else { a });
        assert!(
            largest >= 3600.0,
            "largest finite bucket {largest}:\n{text}"
        );
        assert_eq!(count, 1, "40 minutes counted below {largest} s:\n{text}");
    }
}
