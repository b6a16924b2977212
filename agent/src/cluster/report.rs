//! Everything the cluster agent tells about its work, through one reporter: Events (on pods,
//! on Checkpoints beside their source pods, on the Node), the restore pods' status annotations
//! (values from [`warmstart_shared::control::RestoreStatus`]) and `restore-failed` answers,
//! the Checkpoints' progress, and the refusal, fallback and progress metrics.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::watch;
use tracing::warn;
use warmstart_shared::Checkpoint;
use warmstart_shared::control::RestoreStatus;
use warmstart_shared::names;

use super::metrics::{FallbackReason, Metrics};
use super::podvols;
use super::readiness::Verdict;
use super::validate::Refusal;
use crate::progress::{Operation, Reporter, Snapshot};

/// The agent's reporter.
pub struct Report {
    client: Client,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    /// Where the pods' control directories are (`restore-failed` goes there).
    kubelet_root: PathBuf,
    /// Last refusal reported per pod, so a refusal becomes one Event, not one per resync.
    refused: Mutex<HashMap<String, String>>,
    /// The containers, per pod uid, whose restore outcome (completed or failed) this agent
    /// wrote on the pod. The loop decides from its watch of pods, which can lag behind the
    /// agent's own writes: a restore it ended must not look unstarted there (restored twice)
    /// or left in progress by a dead agent (answered with a refusal after it completed).
    settled: Mutex<HashMap<String, HashSet<String>>>,
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Report")
            .field("kubelet_root", &self.kubelet_root)
            .finish_non_exhaustive()
    }
}

impl Report {
    /// A reporter through `client` and `recorder`, counting into `metrics`.
    pub fn new(
        client: Client,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        kubelet_root: PathBuf,
    ) -> Self {
        Self {
            client,
            recorder,
            metrics,
            kubelet_root,
            refused: Mutex::default(),
            settled: Mutex::default(),
        }
    }

    /// Forgets what was reported about pod `uid` (it is gone).
    pub fn forget(&self, uid: &str) {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
        self.forget_settled(uid);
    }

    /// Whether this agent wrote the outcome of the restore of `container` in pod `uid`.
    pub fn settled(&self, uid: &str, container: &str) -> bool {
        self.settled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .is_some_and(|containers| containers.contains(container))
    }

    /// Forgets the outcomes written on pod `uid`: its watched state shows them (or it is gone).
    pub fn forget_settled(&self, uid: &str) {
        self.settled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
    }

    /// A progress reporter for one `operation`: its share of the progress gauges, and (a
    /// checkpoint's, for its Checkpoint) a snapshot on `status` at most every
    /// [`PROGRESS_EVERY`], the first at once.
    pub fn progress(
        &self,
        operation: Operation,
        status: Option<watch::Sender<Option<Snapshot>>>,
    ) -> Reporter {
        let share = self.metrics.progress(operation);
        let sent = Mutex::new(None::<std::time::Instant>);
        Reporter::new(Arc::new(move |s: &Snapshot| {
            share.update(s.done, s.total);
            let Some(status) = &status else {
                return;
            };
            let mut sent = sent.lock().unwrap_or_else(PoisonError::into_inner);
            if sent.is_none_or(|at| at.elapsed() >= PROGRESS_EVERY) {
                *sent = Some(std::time::Instant::now());
                status.send_replace(Some(s.clone()));
            }
        }))
    }

    /// Reports a refusal once per pod and reason: an Event, a log line, a metric.
    pub async fn refused(&self, pod: &Pod, operation: Operation, refusal: &Refusal) {
        let uid = pod.uid().unwrap_or_default();
        let message = refusal_message(refusal);
        {
            let mut refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
            if refused.get(&uid) == Some(&message) {
                return;
            }
            refused.insert(uid, message.clone());
        }
        warn!(reason = refusal.metric_label(), message = %message, "{} refused", operation.as_str());
        self.metrics.refused(operation, refusal.metric_label());
        let reason = if operation == Operation::Checkpoint {
            "CheckpointRefused"
        } else {
            "RestoreRefused"
        };
        self.event(pod, EventType::Warning, reason, &message).await;
    }

    /// An Event on the checkpoint source `pod` and the same on its Checkpoint (`mirror`),
    /// naming the pod.
    pub async fn checkpoint_event(
        &self,
        pod: &Pod,
        mirror: Option<&ObjectReference>,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        self.event(pod, type_, reason, note).await;
        let Some(checkpoint) = mirror else {
            return;
        };
        self.publish(
            checkpoint,
            type_,
            reason,
            reason,
            note,
            Some(pod.object_ref(&())),
        )
        .await;
    }

    /// An Event on `pod`.
    pub async fn event(&self, pod: &Pod, type_: EventType, reason: &str, note: &str) {
        self.publish(&pod.object_ref(&()), type_, reason, reason, note, None)
            .await;
    }

    /// Records an Event about `regarding` (its note cut to the API's limit); a failure is
    /// logged, never fatal.
    async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
        secondary: Option<ObjectReference>,
    ) {
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(crate::report::truncate(note, 1000)),
            action: action.to_owned(),
            secondary,
        };
        if let Err(e) = self.recorder.publish(&event, regarding).await {
            warn!(error = %e, reason, kind = ?regarding.kind, name = ?regarding.name, "cannot record event");
        }
    }

    /// An Event on the Node: the agent became ready, or why it is not.
    pub async fn node_event(&self, node: &str, verdict: &Verdict) {
        let (type_, reason) = if verdict.ready {
            (EventType::Normal, "WarmstartAgentReady")
        } else {
            (EventType::Warning, "WarmstartAgentNotReady")
        };
        // As kubelet refers to its Node (uid = name), so `kubectl describe node` lists it.
        let reference = ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(node.to_owned()),
            uid: Some(node.to_owned()),
            ..Default::default()
        };
        self.publish(
            &reference,
            type_,
            reason,
            "Preflight",
            &verdict.message,
            None,
        )
        .await;
    }

    /// Records a restore refused by validation, for each of `containers`: counted as refused,
    /// then answered as [`Report::restore_failed`].
    pub async fn restore_refused(&self, pod: &Pod, containers: &[String], refusal: &Refusal) {
        self.metrics
            .refused(Operation::Restore, refusal.metric_label());
        self.restore_unusable(
            pod,
            containers,
            refusal.metric_label(),
            FallbackReason::Refused,
            &refusal_message(refusal),
        )
        .await;
    }

    /// Records restores of `containers` that cannot run, why in `message` (`label` in the log).
    pub async fn restore_unusable(
        &self,
        pod: &Pod,
        containers: &[String],
        label: &str,
        fallback: FallbackReason,
        message: &str,
    ) {
        warn!(reason = label, message, "restore refused");
        for container in containers {
            self.restore_failed(pod, container, fallback, message).await;
        }
    }

    /// Records a restore that restored nothing: `restore-failed` for the standby entrypoint,
    /// the status annotation, an Event, the fallback counted by `reason`.
    pub async fn restore_failed(
        &self,
        pod: &Pod,
        container: &str,
        reason: FallbackReason,
        message: &str,
    ) {
        self.metrics.fell_back(reason);
        let uid = pod.uid().unwrap_or_default();
        // The one answer to a restore that restored nothing (claim, then restore-failed); the
        // first answer stands, whatever else the workload planted there is replaced.
        let written = podvols::control_dir(&self.kubelet_root, &uid, container)
            .and_then(|dir| crate::placeholder::answer_refusal(&dir, message));
        let unwritten = match written {
            Ok(_) => String::new(),
            Err(e) => {
                warn!(container, error = %e, "cannot write restore-failed");
                format!(
                    " (restore-failed could not be written: {e}; a standby entrypoint cold starts only after its restore timeout)"
                )
            }
        };
        let _ = self
            .set_restore_status(pod, container, RestoreStatus::Failed)
            .await;
        self.event(
            pod,
            EventType::Warning,
            "RestoreFailed",
            &format!("container {container}: {message}{unwritten}"),
        )
        .await;
    }

    /// Sets the restore status annotation of `container`; an outcome (anything but in progress)
    /// written is remembered as [`Report::settled`].
    ///
    /// # Errors
    /// The API's.
    pub async fn set_restore_status(
        &self,
        pod: &Pod,
        container: &str,
        status: RestoreStatus,
    ) -> Result<(), kube::Error> {
        let pods: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let patch = serde_json::json!({"metadata": {"annotations": {names::restore_status_annotation(container): status.as_str()}}});
        pods.patch(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
        // Only a written outcome is remembered: one the API did not take is looked at again
        // (and reported again) on the next pass.
        if status != RestoreStatus::InProgress {
            self.settled
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(pod.uid().unwrap_or_default())
                .or_default()
                .insert(container.to_owned());
        }
        Ok(())
    }
}

/// How often a Checkpoint's progress is written at most.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Writes each snapshot of a capture into `status.progress` of Checkpoint `name` until the
/// sender is dropped (the snapshots come at most every [`PROGRESS_EVERY`]). Only that field is
/// patched: the rest of the status is the controller's.
pub async fn report_progress(
    api: Api<Checkpoint>,
    name: String,
    mut updated: watch::Receiver<Option<Snapshot>>,
) {
    while updated.changed().await.is_ok() {
        let Some(snapshot) = updated.borrow_and_update().clone() else {
            continue;
        };
        let patch = progress_patch(&snapshot, &crate::clock::now_rfc3339());
        if let Err(e) = api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            warn!(error = %e, checkpoint = %name, "cannot write the Checkpoint's progress");
        }
    }
}

/// The merge patch of a Checkpoint's `status.progress`.
fn progress_patch(snapshot: &Snapshot, now: &str) -> serde_json::Value {
    serde_json::json!({"status": {"progress": {
        "bytesDone": snapshot.done,
        "bytesTotal": snapshot.total,
        "message": snapshot.line(),
        "updatedAt": now,
    }}})
}

fn refusal_message(refusal: &Refusal) -> String {
    crate::report::error_chain(refusal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoints_progress_is_a_merge_patch_of_its_status_field_alone() {
        let snapshot = Snapshot {
            operation: crate::progress::Operation::Checkpoint,
            verb: "dumping",
            done: 41 << 30,
            total: 70 << 30,
            elapsed: Duration::from_secs(20),
        };
        let patch = progress_patch(&snapshot, "2026-12-05T10:00:00Z");
        assert_eq!(
            patch,
            serde_json::json!({"status": {"progress": {
                "bytesDone": 41u64 << 30, "bytesTotal": 70u64 << 30,
                "message": "dumping 41.0 GiB/70.0 GiB at 2.0 GiB/s",
                "updatedAt": "2026-12-05T10:00:00Z"}}})
        );
        // What the controller and `kubectl get` read.
        let status: warmstart_shared::v1alpha1::CheckpointStatus =
            serde_json::from_value(patch["status"].clone()).unwrap();
        assert_eq!(
            status.progress.unwrap().message,
            "dumping 41.0 GiB/70.0 GiB at 2.0 GiB/s"
        );
    }
}
