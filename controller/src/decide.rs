//! The Checkpoint state machine as a pure function: what the controller observed (the
//! Checkpoint, its Job, other Checkpoints with the same hash, the artifact) in, the next status
//! and the one action to take out. The reconciler does the I/O; everything a user can see in
//! `status` is decided here, so it is tested without a cluster.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use warmstart_shared::v1alpha1::{
    ArtifactStatus, CONDITION_ARTIFACT_VERIFIED, CONDITION_JOB_COMPLETED, CONDITION_JOB_CREATED,
    CONDITION_READY,
};
use warmstart_shared::{Checkpoint, CheckpointPhase, CheckpointStatus};

/// What became of the checkpoint Job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    /// There is no Job of that name.
    Absent,
    /// A Job of that name exists but belongs to something else.
    NotOwned,
    /// A Job of that name left by an earlier Checkpoint of the same name (its controller is a
    /// Checkpoint of this name with another uid): deleted with its owner, but the garbage
    /// collector removes dependents only some time after their owner is gone, so a Checkpoint
    /// deleted and created again under its name finds it. It is deleted, then ours is created.
    Stale,
    /// Running (or not yet started).
    Running,
    /// `Complete` condition true.
    Succeeded,
    /// `Failed` condition true.
    Failed {
        /// The condition's reason (`DeadlineExceeded`, `BackoffLimitExceeded`, …).
        reason: String,
        /// The condition's message.
        message: String,
    },
}

impl JobState {
    /// Reads the state from a Job owned (or not) by the checkpoint `owner_name` with
    /// `owner_uid`. Terminal conditions decide, never the `failed` counter (a retried pod is
    /// not a failed Job).
    pub fn of(job: Option<&Job>, owner_name: &str, owner_uid: &str) -> Self {
        let Some(job) = job else {
            return Self::Absent;
        };
        let controller = job
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true));
        match controller {
            Some(o) if o.uid == owner_uid => {}
            Some(o)
                if o.kind == "Checkpoint"
                    && o.api_version.starts_with("warmstart.dev/")
                    && o.name == owner_name =>
            {
                return Self::Stale;
            }
            _ => return Self::NotOwned,
        }
        let conditions = job
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .map(Vec::as_slice)
            .unwrap_or_default();
        let is_true = |kind: &str| {
            conditions
                .iter()
                .find(|c| c.type_ == kind && c.status == "True")
        };
        if let Some(failed) = is_true("Failed") {
            return Self::Failed {
                reason: failed.reason.clone().unwrap_or_default(),
                message: failed.message.clone().unwrap_or_default(),
            };
        }
        if is_true("Complete").is_some() {
            return Self::Succeeded;
        }
        Self::Running
    }
}

/// The artifact as the controller found it after the Job succeeded.
#[derive(Clone, Debug, PartialEq)]
pub enum ArtifactCheck {
    /// Not looked at (the Job has not succeeded).
    NotChecked,
    /// Verified: what status reports.
    Verified {
        /// `status.artifact` (boxed: the other variants are small).
        status: Box<ArtifactStatus>,
        /// Seconds per capture phase.
        timings: std::collections::BTreeMap<String, f64>,
        /// When it was captured (RFC 3339).
        created_at: String,
    },
    /// Missing or invalid: why, in words.
    Invalid(String),
}

/// Why a Checkpoint's identity gives it no artifact location.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unaddressable {
    /// The identity breaks a rule (names the field).
    #[error(transparent)]
    Identity(#[from] warmstart_shared::identity::IdentityError),
    /// The hash and namespace do not make a safe path below the artifact root.
    #[error("identity hash {hash} or namespace {namespace} makes an unsafe artifact path")]
    UnsafePath {
        /// The identity hash.
        hash: String,
        /// The Checkpoint's namespace.
        namespace: String,
    },
}

/// Everything the decision depends on besides the Checkpoint itself.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The identity hash, or why it gives no artifact location.
    pub hash: Result<String, Unaddressable>,
    /// The artifact location for that hash.
    pub location: String,
    /// Another Checkpoint in the namespace that owns the same hash.
    pub duplicate_owner: Option<String>,
    /// The Job.
    pub job: JobState,
    /// The artifact.
    pub artifact: ArtifactCheck,
    /// Why the running Job cannot create its pod (its latest `FailedCreate` Event, while it has
    /// no pod), e.g. a pod refused by admission.
    pub pod_creation_failure: Option<String>,
    /// Why the running Job's pod cannot be scheduled (the scheduler's latest `FailedScheduling`
    /// Event of a pod not yet scheduled), e.g. no node whose agent is ready.
    pub pod_unschedulable: Option<String>,
    /// Where artifacts are verified (`status.storageType`): `pvc` or `s3`.
    pub storage_type: &'static str,
}

/// An Event to emit for a transition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human-readable note.
    pub note: String,
    /// Whether it is a Warning (else Normal).
    pub warning: bool,
}

/// The decision: the status to write, whether to create the Job, the Event to emit.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The next status (equal to the current one when nothing changes).
    pub status: CheckpointStatus,
    /// Create the checkpoint Job.
    pub create_job: bool,
    /// The Event of the transition, if the phase changed.
    pub transition: Option<Transition>,
}

/// The decision being made: the next status, whether to create the Job, the transition's
/// Event.
struct Step {
    next: CheckpointStatus,
    create_job: bool,
    transition: Option<Transition>,
}

impl Step {
    /// Moves to phase `to`, with `note` as the message and the Event (a warning for `Failed`).
    fn go(&mut self, to: CheckpointPhase, reason: &'static str, note: String) {
        self.next.phase = Some(to);
        self.next.message = Some(note.clone());
        self.transition = Some(Transition {
            reason,
            note,
            warning: to == CheckpointPhase::Failed,
        });
    }
}

/// Decides the next step. `now` stamps condition transitions.
pub fn decide(checkpoint: &Checkpoint, observed: &Observed, now: &Time) -> Decision {
    let current = checkpoint.status.clone().unwrap_or_default();
    let mut step = Step {
        next: CheckpointStatus {
            observed_generation: checkpoint.metadata.generation,
            ..current.clone()
        },
        create_job: false,
        transition: None,
    };
    match current.phase {
        Some(CheckpointPhase::Ready) => {
            // Made Ready before `status.artifact.size` existed: `kubectl get` shows it too.
            if let Some(artifact) = step.next.artifact.as_mut().filter(|a| a.size.is_none()) {
                artifact.size = Some(warmstart_shared::v1alpha1::human_size(artifact.size_bytes));
            }
        }
        Some(CheckpointPhase::Failed) => {}
        None => match &observed.hash {
            Ok(hash) => {
                step.next.identity_hash = Some(hash.clone());
                step.next.location = Some(observed.location.clone());
                step.next.storage_type = Some(observed.storage_type.to_owned());
                step.go(
                    CheckpointPhase::Pending,
                    "Pending",
                    format!("identity hash {hash}"),
                );
            }
            Err(why) => step.go(CheckpointPhase::Failed, "InvalidSpec", why.to_string()),
        },
        Some(CheckpointPhase::Pending) => pending(&mut step, checkpoint, &current, observed, now),
        Some(CheckpointPhase::Creating) => creating(&mut step, checkpoint, observed, now),
    }
    // The node agent's progress means something only while its capture runs.
    if step.next.phase != Some(CheckpointPhase::Creating) {
        step.next.progress = None;
    }
    ready_condition(&mut step, now);
    Decision {
        status: step.next,
        create_job: step.create_job,
        transition: step.transition,
    }
}

/// From `Pending`: adopt a verified artifact of this identity, or create the Job (or wait for
/// a stale one to go), or fail on a conflict.
fn pending(
    step: &mut Step,
    checkpoint: &Checkpoint,
    current: &CheckpointStatus,
    observed: &Observed,
    now: &Time,
) {
    if let Some(owner) = &observed.duplicate_owner {
        step.go(
            CheckpointPhase::Failed,
            "DuplicateIdentity",
            format!(
                "identity hash {} is already owned by checkpoint {owner}",
                current.identity_hash.clone().unwrap_or_default()
            ),
        );
        return;
    }
    if let (
        JobState::Absent,
        ArtifactCheck::Verified {
            status,
            timings,
            created_at,
        },
    ) = (&observed.job, &observed.artifact)
    {
        // A verified artifact of this identity is already published (its Checkpoint went with
        // its namespace or with the CRD, or was deleted with `deletionPolicy: Retain`):
        // adopted, not captured again.
        record_verified(&mut step.next, status, timings, created_at, now);
        step.go(
            CheckpointPhase::Ready,
            "ArtifactAdopted",
            format!(
                "adopted the verified artifact at {} ({} bytes, captured {created_at}); no checkpoint job ran",
                observed.location, status.size_bytes
            ),
        );
        return;
    }
    match &observed.job {
        // Deleted by the reconcile that saw it; looked at again shortly.
        JobState::Stale => {
            step.next.message = Some(format!(
                "job {} of an earlier checkpoint of this name is being deleted; \
                 the new job is created once it is gone",
                job_name(checkpoint)
            ));
        }
        JobState::NotOwned => step.go(
            CheckpointPhase::Failed,
            "JobConflict",
            format!(
                "job {} exists and is not owned by this checkpoint",
                job_name(checkpoint)
            ),
        ),
        // Absent: create it. Present and ours: created by an earlier reconcile whose status
        // write was lost.
        state => {
            step.create_job = *state == JobState::Absent;
            step.next.job_name = Some(job_name(checkpoint));
            // What restore pods are shaped after, whatever spec.job says later.
            step.next.entrypoint = Some(checkpoint.spec.job.entrypoint);
            set_condition(
                &mut step.next,
                CONDITION_JOB_CREATED,
                true,
                "Created",
                "checkpoint job created",
                now,
            );
            let note = if step.create_job {
                format!("created job {}", job_name(checkpoint))
            } else {
                format!("job {} exists", job_name(checkpoint))
            };
            step.go(CheckpointPhase::Creating, "JobCreated", note);
        }
    }
}

/// From `Creating`: follow the Job (stuck, deleted, conflicting, failed, succeeded) and, once
/// it succeeded, the artifact it published.
fn creating(step: &mut Step, checkpoint: &Checkpoint, observed: &Observed, now: &Time) {
    // A Job gone while its artifact is verified finished and was removed by its
    // `ttlSecondsAfterFinished` before this controller saw it complete (the controller was
    // down or behind): the artifact is the proof, nothing is captured again.
    let job = match (&observed.job, &observed.artifact) {
        (JobState::Absent, ArtifactCheck::Verified { .. }) => &JobState::Succeeded,
        (job, _) => job,
    };
    match job {
        JobState::Running => {
            // Reported as it happens, not when the Job's deadline passes; the phase stays
            // Creating (quota freed, a policy changed or a node's agent ready again, the Job's
            // pod goes on).
            let stuck = observed
                .pod_creation_failure
                .as_ref()
                .map(|f| ("JobFailedCreate", "cannot create its pod", f))
                .or_else(|| {
                    observed
                        .pod_unschedulable
                        .as_ref()
                        .map(|f| ("JobPodUnschedulable", "has a pod no node can take", f))
                });
            if let Some((reason, what, failure)) = stuck {
                let note = format!("job {} {what}: {failure}", job_name(checkpoint));
                if step.next.message.as_deref() != Some(note.as_str()) {
                    step.next.message = Some(note.clone());
                    step.transition = Some(Transition {
                        reason,
                        note,
                        warning: true,
                    });
                }
            }
        }
        JobState::Absent => {
            set_condition(
                &mut step.next,
                CONDITION_JOB_CREATED,
                false,
                "JobDeleted",
                "checkpoint job was deleted",
                now,
            );
            step.go(
                CheckpointPhase::Pending,
                "JobDeleted",
                format!(
                    "job {} was deleted before it finished; it will be created again",
                    job_name(checkpoint)
                ),
            );
        }
        JobState::NotOwned | JobState::Stale => step.go(
            CheckpointPhase::Failed,
            "JobConflict",
            format!(
                "job {} is not owned by this checkpoint",
                job_name(checkpoint)
            ),
        ),
        JobState::Failed { reason, message } => {
            set_condition(
                &mut step.next,
                CONDITION_JOB_COMPLETED,
                false,
                reason_or(reason, "Failed"),
                message,
                now,
            );
            step.go(
                CheckpointPhase::Failed,
                "JobFailed",
                format!(
                    "job {} failed: {}: {message}",
                    job_name(checkpoint),
                    reason_or(reason, "Failed")
                ),
            );
        }
        JobState::Succeeded => succeeded(step, checkpoint, observed, now),
    }
}

/// The Job succeeded: `Ready` on a verified artifact, `Failed` on an unusable one.
fn succeeded(step: &mut Step, checkpoint: &Checkpoint, observed: &Observed, now: &Time) {
    set_condition(
        &mut step.next,
        CONDITION_JOB_COMPLETED,
        true,
        "Completed",
        "checkpoint job completed",
        now,
    );
    match &observed.artifact {
        ArtifactCheck::Verified {
            status,
            timings,
            created_at,
        } => {
            record_verified(&mut step.next, status, timings, created_at, now);
            step.go(
                CheckpointPhase::Ready,
                "Ready",
                format!(
                    "artifact verified at {} ({} bytes)",
                    observed.location, status.size_bytes
                ),
            );
        }
        ArtifactCheck::Invalid(why) => {
            set_condition(
                &mut step.next,
                CONDITION_ARTIFACT_VERIFIED,
                false,
                "Invalid",
                why,
                now,
            );
            step.go(
                CheckpointPhase::Failed,
                "ArtifactInvalid",
                format!(
                    "job {} succeeded but the artifact is not usable: {why}",
                    job_name(checkpoint)
                ),
            );
        }
        ArtifactCheck::NotChecked => {}
    }
}

/// `Ready` mirrors the phase, for `kubectl wait --for=condition=Ready` and health checks. Set
/// on every transition, and once on objects written before the condition existed.
fn ready_condition(step: &mut Step, now: &Time) {
    let missing = !step
        .next
        .conditions
        .iter()
        .any(|c| c.type_ == CONDITION_READY);
    let Some(phase) = step
        .next
        .phase
        .filter(|_| step.transition.is_some() || missing)
    else {
        return;
    };
    let warned = step.transition.as_ref().filter(|t| t.warning);
    let (value, reason) = match phase {
        CheckpointPhase::Ready => (true, "ArtifactVerified"),
        CheckpointPhase::Pending => (false, "Pending"),
        CheckpointPhase::Creating => (false, warned.map_or("Creating", |t| t.reason)),
        CheckpointPhase::Failed => (
            false,
            step.transition.as_ref().map_or("Failed", |t| t.reason),
        ),
    };
    let message = step.next.message.clone().unwrap_or_default();
    set_condition(
        &mut step.next,
        CONDITION_READY,
        value,
        reason,
        &message,
        now,
    );
}

/// The merge patch writing `next` over `current`. `status.progress` is the node agent's to
/// write: it is left out (so a patch computed from an older read never puts back an older
/// progress), and only removed (`null`) once `next` drops it. `status.prestage` belongs to
/// the nodes' agents alone (each applies its own entry): never written here.
pub fn status_patch(
    current: Option<&CheckpointStatus>,
    next: &CheckpointStatus,
) -> serde_json::Value {
    let mut status = serde_json::to_value(next).unwrap_or_default();
    if let Some(fields) = status.as_object_mut() {
        fields.remove("progress");
        fields.remove("prestage");
        if next.progress.is_none() && current.is_some_and(|c| c.progress.is_some()) {
            fields.insert("progress".to_owned(), serde_json::Value::Null);
        }
    }
    serde_json::json!({ "status": status })
}

fn reason_or<'a>(reason: &'a str, default: &'a str) -> &'a str {
    if reason.is_empty() { default } else { reason }
}

fn job_name(checkpoint: &Checkpoint) -> String {
    warmstart_shared::names::job_name(&checkpoint.name_any())
}

/// A verified artifact's facts into `status` (its `ArtifactVerified` condition, `artifact`,
/// `timings`, `createdAt`), whether a Job captured it or it was adopted.
fn record_verified(
    status: &mut CheckpointStatus,
    artifact: &ArtifactStatus,
    timings: &std::collections::BTreeMap<String, f64>,
    created_at: &str,
    now: &Time,
) {
    set_condition(
        status,
        CONDITION_ARTIFACT_VERIFIED,
        true,
        "Verified",
        "artifact verified on storage",
        now,
    );
    status.artifact = Some(artifact.clone());
    status.timings = timings.clone();
    status.created_at = parse_time(created_at);
}

fn parse_time(rfc3339: &str) -> Option<Time> {
    rfc3339
        .parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .map(Time)
}

/// Sets a condition; its transition time changes only when its status does.
fn set_condition(
    status: &mut CheckpointStatus,
    kind: &str,
    value: bool,
    reason: &str,
    message: &str,
    now: &Time,
) {
    let value = if value { "True" } else { "False" };
    let generation = status.observed_generation;
    match status.conditions.iter_mut().find(|c| c.type_ == kind) {
        Some(c) => {
            if c.status != value {
                c.last_transition_time = now.clone();
            }
            c.status = value.to_owned();
            c.reason = reason.to_owned();
            c.message = message.to_owned();
            c.observed_generation = generation;
        }
        None => status.conditions.push(Condition {
            type_: kind.to_owned(),
            status: value.to_owned(),
            reason: reason.to_owned(),
            message: message.to_owned(),
            last_transition_time: now.clone(),
            observed_generation: generation,
        }),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    use warmstart_shared::EntrypointMode;
    use warmstart_shared::identity::IdentityError;

    use super::*;

    const HASH: &str = "96429b2725761a09";
    const LOCATION: &str = "default/96429b2725761a09";

    fn now() -> Time {
        Time("2026-12-02T18:00:00Z".parse().unwrap())
    }

    fn checkpoint(phase: Option<CheckpointPhase>) -> Checkpoint {
        let mut ck: Checkpoint = serde_json::from_value(serde_json::json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": "llama", "namespace": "default", "uid": "u1", "generation": 1},
            "spec": {"identity": {"model": "m", "backendFramework": "vllm"},
                     "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main"}]}}}}
        }))
        .unwrap();
        if let Some(phase) = phase {
            ck.status = Some(CheckpointStatus {
                phase: Some(phase),
                identity_hash: Some(HASH.into()),
                location: Some(LOCATION.into()),
                ..Default::default()
            });
        }
        ck
    }

    fn observed(job: JobState) -> Observed {
        Observed {
            hash: Ok(HASH.into()),
            location: LOCATION.into(),
            duplicate_owner: None,
            job,
            artifact: ArtifactCheck::NotChecked,
            pod_creation_failure: None,
            pod_unschedulable: None,
            storage_type: warmstart_shared::names::STORAGE_TYPE_PVC,
        }
    }

    #[test]
    fn a_job_that_cannot_create_its_pod_is_reported_once_and_stays_creating() {
        let creating = checkpoint(Some(CheckpointPhase::Creating));
        let o = Observed {
            pod_creation_failure: Some(
                "pods \"checkpoint-llama-x\" is forbidden: violates PodSecurity \"restricted\""
                    .into(),
            ),
            ..observed(JobState::Running)
        };
        let d = decide(&creating, &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Creating));
        let message = d.status.message.clone().unwrap();
        assert!(message.contains("cannot create its pod"), "{message}");
        assert!(message.contains("PodSecurity"), "{message}");
        let t = d.transition.unwrap();
        assert_eq!(t.reason, "JobFailedCreate");
        assert!(t.warning);
        let ready = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .unwrap();
        assert_eq!(ready.reason, "JobFailedCreate");
        assert_eq!(ready.status, "False");
        // The same failure again: nothing new to say, no second Event.
        let mut again = creating.clone();
        again.status = Some(d.status.clone());
        let d = decide(&again, &o, &now());
        assert!(d.transition.is_none());
        assert_eq!(Some(&d.status), again.status.as_ref());
    }

    #[test]
    fn a_job_whose_pod_no_node_can_take_is_reported_with_the_schedulers_words() {
        let creating = checkpoint(Some(CheckpointPhase::Creating));
        let o = Observed {
            pod_unschedulable: Some(
                "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
                    .into(),
            ),
            ..observed(JobState::Running)
        };
        let d = decide(&creating, &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Creating));
        let message = d.status.message.clone().unwrap();
        assert!(message.contains("no node can take"), "{message}");
        assert!(message.contains("node affinity"), "{message}");
        let t = d.transition.unwrap();
        assert_eq!(t.reason, "JobPodUnschedulable");
        assert!(t.warning);
        let ready = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .unwrap();
        assert_eq!(ready.reason, "JobPodUnschedulable");
        assert_eq!(ready.status, "False");
    }

    #[test]
    fn a_pending_checkpoint_adopts_a_verified_artifact_of_its_identity_without_a_job() {
        let pending = checkpoint(Some(CheckpointPhase::Pending));
        let o = Observed {
            artifact: ArtifactCheck::Verified {
                status: Box::new(ArtifactStatus {
                    size_bytes: 4096,
                    ..Default::default()
                }),
                timings: Default::default(),
                created_at: "2026-12-05T10:00:00Z".into(),
            },
            ..observed(JobState::Absent)
        };
        let d = decide(&pending, &o, &now());
        assert!(!d.create_job);
        assert_eq!(d.status.phase, Some(CheckpointPhase::Ready));
        assert_eq!(d.status.artifact.as_ref().unwrap().size_bytes, 4096);
        assert_eq!(d.transition.unwrap().reason, "ArtifactAdopted");
        // Without one, the Job is created as before.
        let d = decide(&pending, &observed(JobState::Absent), &now());
        assert!(d.create_job);
        assert_eq!(d.status.phase, Some(CheckpointPhase::Creating));
    }

    #[test]
    fn a_checkpoint_made_ready_before_sizes_for_people_gets_one() {
        let mut ready = checkpoint(Some(CheckpointPhase::Ready));
        let mut status = ready.status.clone().unwrap_or_default();
        status.artifact = Some(ArtifactStatus {
            size_bytes: 537_520_526,
            ..Default::default()
        });
        ready.status = Some(status);
        let d = decide(&ready, &observed(JobState::Absent), &now());
        assert_eq!(
            d.status.artifact.unwrap().size.as_deref(),
            Some("512.6 MiB")
        );
        assert!(d.transition.is_none());
        assert!(!d.create_job);
    }

    fn job(conditions: &[(&str, &str)], owner: &str) -> Job {
        Job {
            metadata: kube::api::ObjectMeta {
                name: Some("checkpoint-llama".into()),
                owner_references: Some(vec![OwnerReference {
                    uid: owner.into(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            status: Some(JobStatus {
                failed: Some(2),
                conditions: Some(
                    conditions
                        .iter()
                        .map(|(t, r)| JobCondition {
                            type_: (*t).into(),
                            status: "True".into(),
                            reason: Some((*r).into()),
                            message: Some(format!("{r} happened")),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_new_checkpoint_gets_its_hash_once_and_turns_pending() {
        let d = decide(&checkpoint(None), &observed(JobState::Absent), &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Pending));
        assert_eq!(d.status.identity_hash.as_deref(), Some(HASH));
        assert_eq!(d.status.location.as_deref(), Some(LOCATION));
        assert_eq!(d.status.storage_type.as_deref(), Some("pvc"));
        assert_eq!(d.status.observed_generation, Some(1));
        assert!(!d.create_job);
        assert_eq!(d.transition.unwrap().reason, "Pending");
    }

    #[test]
    fn an_invalid_identity_fails_naming_the_field() {
        let mut o = observed(JobState::Absent);
        o.hash = Err(IdentityError::Empty { field: "model" }.into());
        let d = decide(&checkpoint(None), &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Failed));
        assert!(d.status.message.unwrap().contains("spec.identity.model"));
        assert!(d.transition.unwrap().warning);
    }

    #[test]
    fn pending_creates_the_job_and_turns_creating() {
        let d = decide(
            &checkpoint(Some(CheckpointPhase::Pending)),
            &observed(JobState::Absent),
            &now(),
        );
        assert!(d.create_job);
        assert_eq!(d.status.phase, Some(CheckpointPhase::Creating));
        assert_eq!(d.status.job_name.as_deref(), Some("checkpoint-llama"));
        let c = &d.status.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str()),
            ("JobCreated", "True")
        );
        assert_eq!(d.status.entrypoint, Some(EntrypointMode::Native));
    }

    #[test]
    fn the_entrypoint_mode_the_job_ran_with_is_recorded_and_kept() {
        let mut ck = checkpoint(Some(CheckpointPhase::Pending));
        ck.spec.job.entrypoint = EntrypointMode::Wrap;
        let d = decide(&ck, &observed(JobState::Absent), &now());
        assert_eq!(d.status.entrypoint, Some(EntrypointMode::Wrap));
        // An edit of spec.job after the Job was created does not rewrite history.
        ck.status = Some(d.status);
        ck.spec.job.entrypoint = EntrypointMode::Native;
        let d = decide(&ck, &observed(JobState::Running), &now());
        assert_eq!(d.status.entrypoint, Some(EntrypointMode::Wrap));
    }

    #[test]
    fn a_duplicate_hash_fails_naming_the_owner() {
        let mut o = observed(JobState::Absent);
        o.duplicate_owner = Some("default/first".into());
        let d = decide(&checkpoint(Some(CheckpointPhase::Pending)), &o, &now());
        assert!(!d.create_job);
        assert_eq!(d.status.phase, Some(CheckpointPhase::Failed));
        assert_eq!(
            d.status.message.unwrap(),
            "identity hash 96429b2725761a09 is already owned by checkpoint default/first"
        );
    }

    #[test]
    fn a_job_owned_by_someone_else_is_never_adopted() {
        let state = JobState::of(Some(&job(&[], "other-uid")), "someone-else", "u1");
        assert_eq!(state, JobState::NotOwned);
        let d = decide(
            &checkpoint(Some(CheckpointPhase::Pending)),
            &observed(state),
            &now(),
        );
        assert!(!d.create_job);
        assert_eq!(d.status.phase, Some(CheckpointPhase::Failed));
    }

    #[test]
    fn a_job_left_by_an_earlier_checkpoint_of_the_same_name_is_replaced_not_a_conflict() {
        let mut stale = job(&[("Complete", "Completed")], "old-uid");
        if let Some(owners) = stale.metadata.owner_references.as_mut() {
            owners[0].api_version = "warmstart.dev/v1alpha1".into();
            owners[0].kind = "Checkpoint".into();
            owners[0].name = "llama".into();
        }
        assert_eq!(JobState::of(Some(&stale), "llama", "u1"), JobState::Stale);
        // Another Checkpoint's Job is still a conflict.
        assert_eq!(
            JobState::of(Some(&stale), "other", "u1"),
            JobState::NotOwned
        );
        let d = decide(
            &checkpoint(Some(CheckpointPhase::Pending)),
            &observed(JobState::Stale),
            &now(),
        );
        assert!(!d.create_job, "created once the stale one is gone");
        assert_eq!(d.status.phase, Some(CheckpointPhase::Pending));
        assert!(d.transition.is_none());
        assert!(
            d.status
                .message
                .unwrap()
                .contains("of an earlier checkpoint of this name is being deleted")
        );
    }

    #[test]
    fn the_terminal_failed_condition_fails_with_the_jobs_reason_not_the_failed_counter() {
        // failed: 2 but no terminal condition: still running (pods are retried).
        assert_eq!(
            JobState::of(Some(&job(&[], "u1")), "c", "u1"),
            JobState::Running
        );
        for reason in ["DeadlineExceeded", "BackoffLimitExceeded"] {
            let state = JobState::of(Some(&job(&[("Failed", reason)], "u1")), "c", "u1");
            let d = decide(
                &checkpoint(Some(CheckpointPhase::Creating)),
                &observed(state),
                &now(),
            );
            assert_eq!(d.status.phase, Some(CheckpointPhase::Failed));
            let message = d.status.message.unwrap();
            assert!(message.contains(reason), "{message}");
            assert!(message.contains("checkpoint-llama"), "{message}");
        }
    }

    #[test]
    fn a_job_deleted_while_creating_goes_back_to_pending() {
        let d = decide(
            &checkpoint(Some(CheckpointPhase::Creating)),
            &observed(JobState::Absent),
            &now(),
        );
        assert_eq!(d.status.phase, Some(CheckpointPhase::Pending));
        assert!(!d.create_job, "the next reconcile creates it");
    }

    #[test]
    fn a_running_job_changes_nothing() {
        let mut ck = checkpoint(Some(CheckpointPhase::Creating));
        // As the reconciler left it when it turned Creating.
        let status = ck.status.as_mut().unwrap();
        status.observed_generation = Some(1);
        set_condition(status, CONDITION_READY, false, "Creating", "", &now());
        let d = decide(&ck, &observed(JobState::Running), &now());
        let mut expected = ck.status.clone().unwrap();
        expected.observed_generation = Some(1);
        assert_eq!(d.status, expected);
        assert_eq!(d.transition, None);
    }

    #[test]
    fn a_job_gone_with_a_verified_artifact_turns_ready_and_without_one_is_created_again() {
        let mut o = observed(JobState::Absent);
        o.artifact = ArtifactCheck::Verified {
            status: Box::new(ArtifactStatus {
                size_bytes: 42,
                ..Default::default()
            }),
            timings: std::collections::BTreeMap::new(),
            created_at: "2026-12-02T17:59:00Z".into(),
        };
        let creating = checkpoint(Some(CheckpointPhase::Creating));
        let d = decide(&creating, &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Ready));
        assert!(!d.create_job);
        o.artifact = ArtifactCheck::Invalid("no manifest".into());
        let d = decide(&creating, &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Pending));
        assert_eq!(d.transition.map(|t| t.reason), Some("JobDeleted"));
    }

    #[test]
    fn a_completed_job_with_a_verified_artifact_turns_ready() {
        let state = JobState::of(Some(&job(&[("Complete", "Completed")], "u1")), "c", "u1");
        let mut o = observed(state);
        o.artifact = ArtifactCheck::Verified {
            status: Box::new(ArtifactStatus {
                size_bytes: 42,
                manifest_digest: "sha256:x".into(),
                ..Default::default()
            }),
            timings: [("dump".to_owned(), 1.5)].into(),
            created_at: "2026-12-02T17:59:00Z".into(),
        };
        let d = decide(&checkpoint(Some(CheckpointPhase::Creating)), &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Ready));
        assert_eq!(d.status.artifact.as_ref().unwrap().size_bytes, 42);
        assert_eq!(d.status.timings["dump"], 1.5);
        assert!(d.status.created_at.is_some());
        let types: Vec<_> = d
            .status
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str()))
            .collect();
        assert!(types.contains(&("JobCompleted", "True")));
        assert!(types.contains(&("ArtifactVerified", "True")));
    }

    fn with_progress(phase: CheckpointPhase) -> Checkpoint {
        let mut ck = checkpoint(Some(phase));
        if let Some(status) = ck.status.as_mut() {
            status.progress = Some(warmstart_shared::v1alpha1::CheckpointProgress {
                bytes_done: 41,
                bytes_total: 70,
                message: "dumping 41 B/70 B at 20 B/s".into(),
                updated_at: None,
            });
        }
        ck
    }

    #[test]
    fn the_agents_progress_is_kept_while_creating_and_removed_once_ready_or_failed() {
        let creating = with_progress(CheckpointPhase::Creating);
        let d = decide(&creating, &observed(JobState::Running), &now());
        assert_eq!(
            d.status.progress,
            creating.status.as_ref().unwrap().progress
        );
        let mut again = creating.clone();
        again.status = Some(d.status.clone());
        let d = decide(&again, &observed(JobState::Running), &now());
        assert_eq!(Some(&d.status), again.status.as_ref(), "nothing to write");

        let state = JobState::of(Some(&job(&[("Complete", "Completed")], "u1")), "c", "u1");
        let mut o = observed(state);
        o.artifact = ArtifactCheck::Verified {
            status: Box::new(ArtifactStatus::default()),
            timings: std::collections::BTreeMap::new(),
            created_at: "2026-12-02T17:59:00Z".into(),
        };
        let ready = decide(&creating, &o, &now());
        assert_eq!(ready.status.phase, Some(CheckpointPhase::Ready));
        assert_eq!(ready.status.progress, None);
        let patch = status_patch(creating.status.as_ref(), &ready.status);
        assert_eq!(patch["status"]["progress"], serde_json::Value::Null);
        assert!(
            patch["status"]
                .as_object()
                .unwrap()
                .contains_key("progress")
        );

        let failed = decide(
            &creating,
            &observed(JobState::Failed {
                reason: "DeadlineExceeded".into(),
                message: String::new(),
            }),
            &now(),
        );
        assert_eq!(failed.status.phase, Some(CheckpointPhase::Failed));
        assert_eq!(failed.status.progress, None);
    }

    #[test]
    fn the_controllers_status_patch_never_writes_the_agents_progress() {
        // Decided from a read older than the agent's latest write: the patch leaves it alone.
        let creating = with_progress(CheckpointPhase::Creating);
        let mut next = creating.status.clone().unwrap();
        next.message = Some("changed".into());
        let patch = status_patch(creating.status.as_ref(), &next);
        assert_eq!(patch["status"]["message"], "changed");
        assert!(
            !patch["status"]
                .as_object()
                .unwrap()
                .contains_key("progress")
        );
        // Nothing to remove when there was none.
        let plain = checkpoint(Some(CheckpointPhase::Ready));
        let patch = status_patch(plain.status.as_ref(), plain.status.as_ref().unwrap());
        assert!(
            !patch["status"]
                .as_object()
                .unwrap()
                .contains_key("progress")
        );
    }

    #[test]
    fn the_controllers_status_patch_never_writes_the_nodes_prestage_entries() {
        // A merge patch replaces a list whole: one computed from a read older than a node's
        // entry would drop it.
        let mut ready = checkpoint(Some(CheckpointPhase::Ready));
        ready.status.as_mut().unwrap().prestage = vec![warmstart_shared::PrestageStatus {
            node: "gpu-1".into(),
            state: warmstart_shared::PrestageState::Warmed,
            manifest_digest: "sha256:00".into(),
            ..Default::default()
        }];
        let mut next = ready.status.clone().unwrap();
        next.message = Some("changed".into());
        let patch = status_patch(ready.status.as_ref(), &next);
        assert_eq!(patch["status"]["message"], "changed");
        assert!(
            !patch["status"]
                .as_object()
                .unwrap()
                .contains_key("prestage"),
            "{patch}"
        );
    }

    #[test]
    fn the_storage_type_is_where_artifacts_are_verified() {
        let o = Observed {
            storage_type: warmstart_shared::names::STORAGE_TYPE_S3,
            ..observed(JobState::Absent)
        };
        let d = decide(&checkpoint(None), &o, &now());
        assert_eq!(d.status.storage_type.as_deref(), Some("s3"));
    }

    fn ready_condition(d: &Decision) -> (String, String) {
        let c = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .expect("Ready condition");
        (c.status.clone(), c.reason.clone())
    }

    // `kubectl wait --for=condition=Ready` works.
    #[test]
    fn the_ready_condition_follows_the_phase() {
        let d = decide(&checkpoint(None), &observed(JobState::Absent), &now());
        assert_eq!(ready_condition(&d), ("False".into(), "Pending".into()));

        let d = decide(
            &checkpoint(Some(CheckpointPhase::Pending)),
            &observed(JobState::Absent),
            &now(),
        );
        assert_eq!(ready_condition(&d), ("False".into(), "Creating".into()));

        let state = JobState::of(Some(&job(&[("Complete", "Completed")], "u1")), "c", "u1");
        let mut o = observed(state);
        o.artifact = ArtifactCheck::Verified {
            status: Box::default(),
            timings: Default::default(),
            created_at: "2026-12-02T17:59:00Z".into(),
        };
        let mut ck = checkpoint(Some(CheckpointPhase::Creating));
        ck.status.as_mut().unwrap().conditions = d.status.conditions.clone();
        let ready = decide(&ck, &o, &now());
        assert_eq!(
            ready_condition(&ready),
            ("True".into(), "ArtifactVerified".into())
        );
        assert_eq!(
            ready
                .status
                .conditions
                .iter()
                .filter(|c| c.type_ == "Ready")
                .count(),
            1,
            "one condition per type"
        );

        let mut o = observed(JobState::Absent);
        o.hash = Err(IdentityError::Empty { field: "model" }.into());
        let failed = decide(&checkpoint(None), &o, &now());
        assert_eq!(
            ready_condition(&failed),
            ("False".into(), "InvalidSpec".into())
        );
    }

    #[test]
    fn a_ready_checkpoint_written_before_the_condition_existed_gets_it_once() {
        let mut ck = checkpoint(Some(CheckpointPhase::Ready));
        ck.status.as_mut().unwrap().conditions.clear();
        let d = decide(&ck, &observed(JobState::Absent), &now());
        assert!(d.transition.is_none());
        assert_eq!(ready_condition(&d).0, "True");
        ck.status = Some(d.status.clone());
        assert_eq!(
            decide(&ck, &observed(JobState::Absent), &now()).status,
            d.status
        );
    }

    #[test]
    fn a_completed_job_without_a_valid_artifact_fails_saying_what_was_missing() {
        let mut o = observed(JobState::Succeeded);
        o.artifact = ArtifactCheck::Invalid("no artifact at /x".into());
        let d = decide(&checkpoint(Some(CheckpointPhase::Creating)), &o, &now());
        assert_eq!(d.status.phase, Some(CheckpointPhase::Failed));
        assert!(d.status.message.unwrap().contains("no artifact at /x"));
        let verified = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "ArtifactVerified")
            .unwrap();
        assert_eq!(verified.status, "False");
    }

    #[test]
    fn deciding_twice_changes_nothing_the_second_time() {
        let mut ck = checkpoint(Some(CheckpointPhase::Pending));
        let first = decide(&ck, &observed(JobState::Absent), &now());
        ck.status = Some(first.status.clone());
        let later = Time("2026-12-02T18:05:00Z".parse().unwrap());
        let second = decide(&ck, &observed(JobState::Running), &later);
        assert_eq!(second.status, first.status);
        assert!(!second.create_job);
        assert_eq!(second.transition, None);
        for terminal in [CheckpointPhase::Ready, CheckpointPhase::Failed] {
            let ck = checkpoint(Some(terminal));
            let d = decide(&ck, &observed(JobState::Absent), &now());
            assert!(!d.create_job && d.transition.is_none());
        }
    }
}
