//! The Checkpoint reconciler: gathers what [`crate::decide`] needs (the Job, other Checkpoints
//! with the same hash, the artifact on storage), applies the decision (status, Job, Event), and
//! honours `spec.deletionPolicy` through a finalizer. Idempotent: reconciling twice changes
//! nothing the second time. Waits on watches (the Job is owned and watched), never polls;
//! requeues with backoff only on errors.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::finalizer::{Error as FinalizerError, Event as Finalizer, finalizer};
use kube::{Client, Resource, ResourceExt};
use thiserror::Error;
use tracing::{Instrument, info, info_span, warn};
use warmstart_shared::artifact::ArtifactLayout;
use warmstart_shared::names::{FINALIZER, job_name};
use warmstart_shared::{Checkpoint, CheckpointPhase, DeletionPolicy, identity, job, restore_pod};

use crate::artifact::{self, ArtifactError};
use crate::decide::{self, ArtifactCheck, JobState, Observed};
use crate::metrics::Metrics;

/// Field manager of every write.
pub const FIELD_MANAGER: &str = "warmstart-controller";
/// Reason of the warning Event about a user's seccomp profile kept in the checkpoint Job.
pub const REASON_SECCOMP_PROFILE_KEPT: &str = "SeccompProfileKept";
/// Requeue after a transient error (grows with consecutive failures, capped).
const ERROR_REQUEUE: Duration = Duration::from_secs(1);
const MAX_ERROR_REQUEUE: Duration = Duration::from_secs(300);

/// Shared state of the reconciler.
#[allow(missing_debug_implementations)] // kube's Client and Recorder are not Debug.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Artifact root (the mounted PVC).
    pub artifact_root: std::path::PathBuf,
    /// The object store artifacts are uploaded to: verified and deleted there (and the
    /// volume's copy deleted too) when set.
    pub store: Option<warmstart_objstore::Store>,
    /// Image of the init container that installs `warmstart-entrypoint` (`Wrap` checkpoints).
    pub entrypoint_image: String,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Event recorder.
    pub recorder: Recorder,
    /// Consecutive failures per object, for the error backoff.
    pub failures: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

/// Why a reconcile failed (it is retried).
#[derive(Debug, Error)]
pub enum ReconcileError {
    /// An API call failed.
    #[error("API request failed: {0}")]
    Api(#[source] kube::Error),
    /// The finalizer machinery failed.
    #[error("finalizer failed")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<ReconcileError>>),
    /// Artifact removal failed.
    #[error("artifact removal failed")]
    Artifact(#[source] ArtifactError),
    /// The object store could not be used (unreachable, refusing the credentials, no such
    /// bucket): the artifact is neither judged nor deleted until it can.
    #[error("the object store cannot be used")]
    Store(#[source] warmstart_objstore::StoreError),
    /// A blocking task panicked or was cancelled.
    #[error("background task failed: {0}")]
    Task(String),
    /// The object has no namespace.
    #[error("checkpoint has no namespace")]
    NoNamespace,
    /// The Job could not be built (spec changed after validation).
    #[error("cannot build the checkpoint job")]
    Job(#[source] job::JobBuildError),
}

impl ReconcileError {
    /// A short, stable label for the failures metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Api(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Self::Api(_) => "api",
            Self::Finalizer(e) => match e.as_ref() {
                FinalizerError::ApplyFailed(inner) | FinalizerError::CleanupFailed(inner) => {
                    inner.metric_label()
                }
                FinalizerError::AddFinalizer(kube::Error::Api(s))
                | FinalizerError::RemoveFinalizer(kube::Error::Api(s))
                    if s.code == 409 =>
                {
                    "conflict"
                }
                _ => "finalizer",
            },
            Self::Artifact(_) => "artifact",
            Self::Store(_) => "store",
            Self::Task(_) => "task",
            Self::NoNamespace => "no_namespace",
            Self::Job(_) => "job_build",
        }
    }
}

/// Reconciles one Checkpoint (entry point for `Controller::run`).
///
/// # Errors
/// [`ReconcileError`]; the caller requeues with backoff.
pub async fn reconcile(
    checkpoint: Arc<Checkpoint>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let ns = checkpoint.namespace().ok_or(ReconcileError::NoNamespace)?;
    let name = checkpoint.name_any();
    let hash = checkpoint
        .status
        .as_ref()
        .and_then(|s| s.identity_hash.clone())
        .unwrap_or_default();
    let span = info_span!("reconcile", checkpoint.name = %name, checkpoint.namespace = %ns, checkpoint.hash = %hash);
    let started = Instant::now();
    let api: Api<Checkpoint> = Api::namespaced(ctx.client.clone(), &ns);
    let result = finalizer(&api, FINALIZER, checkpoint, |event| async {
        match event {
            Finalizer::Apply(ck) => apply(&ck, &ctx).await,
            Finalizer::Cleanup(ck) => cleanup(&ck, &ctx).await,
        }
    })
    .instrument(span)
    .await
    .map_err(|e| ReconcileError::Finalizer(Box::new(e)));
    let key = format!("{ns}/{name}");
    match &result {
        Ok(_) => {
            ctx.metrics.reconciled("ok", started.elapsed());
            if let Ok(mut f) = ctx.failures.lock() {
                f.remove(&key);
            }
        }
        Err(e) => ctx.metrics.reconciled(e.metric_label(), started.elapsed()),
    }
    result
}

/// Requeue policy on error: exponential backoff per object, logged once here.
pub fn error_policy(
    checkpoint: Arc<Checkpoint>,
    error: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    let key = format!(
        "{}/{}",
        checkpoint.namespace().unwrap_or_default(),
        checkpoint.name_any()
    );
    let attempts = ctx
        .failures
        .lock()
        .map(|mut f| {
            let n = f.entry(key.clone()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        })
        .unwrap_or(1);
    let delay = ERROR_REQUEUE
        .saturating_mul(2u32.saturating_pow(attempts.saturating_sub(1).min(6)))
        .min(MAX_ERROR_REQUEUE);
    warn!(checkpoint = %key, error = %crate::errors::error_chain(error), attempts, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

async fn apply(checkpoint: &Checkpoint, ctx: &Context) -> Result<Action, ReconcileError> {
    let ns = checkpoint.namespace().ok_or(ReconcileError::NoNamespace)?;
    let name = checkpoint.name_any();
    let uid = checkpoint.uid().unwrap_or_default();
    let phase = checkpoint.status.as_ref().and_then(|s| s.phase);
    let (hash, location) = identity_and_location(checkpoint, &ctx.artifact_root, &ns);
    let terminal = matches!(
        phase,
        Some(CheckpointPhase::Ready | CheckpointPhase::Failed)
    );
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ns);
    let job = if terminal || phase.is_none() {
        None
    } else {
        jobs.get_opt(&job_name(&name))
            .await
            .map_err(ReconcileError::Api)?
    };
    let job_state = JobState::of(job.as_ref(), &name, &uid);
    let duplicate_owner = match (&hash, phase) {
        (Ok(h), Some(CheckpointPhase::Pending)) => duplicate_owner(checkpoint, h, ctx).await?,
        _ => None,
    };
    // A Pending Checkpoint with no Job yet looks for an artifact of its identity to adopt.
    let adoptable = phase == Some(CheckpointPhase::Pending)
        && job_state == JobState::Absent
        && duplicate_owner.is_none()
        && hash.is_ok();
    // A Job gone while Creating may have finished and been removed by its TTL: its artifact
    // says so.
    let artifact = if (matches!(job_state, JobState::Succeeded | JobState::Absent)
        && phase == Some(CheckpointPhase::Creating))
        || adoptable
    {
        check_artifact(
            checkpoint,
            ctx,
            &ns,
            hash.clone().unwrap_or_default(),
            adoptable,
        )
        .await?
    } else {
        ArtifactCheck::NotChecked
    };
    let running = job
        .as_ref()
        .filter(|_| job_state == JobState::Running && phase == Some(CheckpointPhase::Creating));
    let stuck = match running {
        Some(job) => stuck_job(job, ctx).await,
        None => Stuck::default(),
    };
    let recheck_soon = stuck.recheck_soon;
    let observed_stale = job_state == JobState::Stale;
    let observed = Observed {
        hash,
        location,
        duplicate_owner,
        job: job_state,
        artifact,
        pod_creation_failure: stuck.pod_creation_failure,
        pod_unschedulable: stuck.pod_unschedulable,
        storage_type: storage_type(ctx),
    };
    let decision = decide::decide(
        checkpoint,
        &observed,
        &Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let stale_job = job
        .as_ref()
        .filter(|_| observed_stale && phase == Some(CheckpointPhase::Pending));
    if let Some(stale) = stale_job {
        delete_stale_job(&jobs, stale).await?;
    }
    if decision.create_job {
        create_job(checkpoint, &decision, &jobs, ctx).await?;
    }
    if checkpoint.status.as_ref() != Some(&decision.status) {
        let api: Api<Checkpoint> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = decide::status_patch(checkpoint.status.as_ref(), &decision.status);
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(ReconcileError::Api)?;
    }
    if let Some(t) = &decision.transition {
        info!(phase = ?decision.status.phase, reason = t.reason, note = %t.note, "checkpoint phase changed");
        record_transition(checkpoint, t, ctx).await;
    }
    // Transitions that need another look right away (Pending → create the Job) requeue now;
    // otherwise the watches on the Checkpoint and its Job wake us.
    if decision.transition.is_some() && decision.status.phase == Some(CheckpointPhase::Pending) {
        return Ok(Action::requeue(Duration::from_millis(100)));
    }
    if recheck_soon {
        return Ok(Action::requeue(PODLESS_JOB_RECHECK));
    }
    // A stale Job's deletion wakes no watch of ours (it names another owner).
    if stale_job.is_some() {
        return Ok(Action::requeue(STALE_JOB_RECHECK));
    }
    Ok(Action::await_change())
}

/// The identity hash (from status once recorded, else computed from the spec; an error text for
/// a spec that has none) and the artifact's location relative to the root (empty when the hash
/// or namespace would make an unsafe path, which is then the error).
fn identity_and_location(
    checkpoint: &Checkpoint,
    artifact_root: &std::path::Path,
    ns: &str,
) -> (Result<String, decide::Unaddressable>, String) {
    let hash = match checkpoint
        .status
        .as_ref()
        .and_then(|s| s.identity_hash.clone())
    {
        Some(h) => Ok(h),
        None => identity::identity_hash(&checkpoint.spec.identity).map_err(Into::into),
    };
    let location = hash
        .as_ref()
        .ok()
        .and_then(|h| ArtifactLayout::new(artifact_root, ns, h).ok())
        .map(|l| l.relative())
        .unwrap_or_default();
    let hash = match (&hash, location.is_empty()) {
        (Ok(h), true) => Err(decide::Unaddressable::UnsafePath {
            hash: h.clone(),
            namespace: ns.to_owned(),
        }),
        _ => hash,
    };
    (hash, location)
}

/// `status.storageType`: where this controller verifies artifacts.
fn storage_type(ctx: &Context) -> &'static str {
    use warmstart_shared::names::{STORAGE_TYPE_PVC, STORAGE_TYPE_S3};
    if ctx.store.is_some() {
        STORAGE_TYPE_S3
    } else {
        STORAGE_TYPE_PVC
    }
}

/// Reason of the warning Event when the object store cannot be used.
pub const REASON_STORE_UNAVAILABLE: &str = "ArtifactStoreUnavailable";

/// Verifies the artifact of `hash` where restores read it: in the object store when there is
/// one, else on the artifact volume (off the executor). When only looking for one to `adopt`,
/// a missing or unusable artifact is `NotChecked` (the Job captures one), not `Invalid`.
///
/// # Errors
/// [`ReconcileError::Store`] when the store cannot be asked (a warning Event on the Checkpoint
/// says why): an artifact is never judged unusable because its store is unreachable.
async fn check_artifact(
    checkpoint: &Checkpoint,
    ctx: &Context,
    ns: &str,
    hash: String,
    adopt: bool,
) -> Result<ArtifactCheck, ReconcileError> {
    let verified = match &ctx.store {
        Some(store) => match store.verify(ns, &hash).await {
            Ok(manifest) => Ok(manifest),
            Err(e) if !e.is_artifact_fault() => {
                store_unavailable(checkpoint, ctx, "verify the artifact in", &e).await;
                return Err(ReconcileError::Store(e));
            }
            Err(e) => Err(crate::errors::error_chain(&e)),
        },
        None => {
            let (root, ns) = (ctx.artifact_root.clone(), ns.to_owned());
            tokio::task::spawn_blocking(move || artifact::verify(&root, &ns, &hash))
                .await
                .map_err(|e| ReconcileError::Task(e.to_string()))?
                .map(|v| v.manifest)
                .map_err(|e| crate::errors::error_chain(&e))
        }
    };
    Ok(match verified {
        Ok(manifest) => ArtifactCheck::Verified {
            status: Box::new(artifact::status_of(&manifest)),
            timings: artifact::status_timings(&manifest),
            created_at: manifest.created_at.clone(),
        },
        Err(_) if adopt => ArtifactCheck::NotChecked,
        Err(why) => ArtifactCheck::Invalid(why),
    })
}

/// Says on the Checkpoint (a warning Event) that the object store could not be used to `what`.
async fn store_unavailable(
    checkpoint: &Checkpoint,
    ctx: &Context,
    what: &str,
    error: &warmstart_objstore::StoreError,
) {
    let note = format!(
        "cannot {what} the object store (retrying): {}",
        crate::errors::error_chain(error)
    );
    warn!(%note, "object store unavailable");
    let event = Event {
        type_: EventType::Warning,
        reason: REASON_STORE_UNAVAILABLE.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: if what.starts_with("delete") {
            "DeleteArtifact"
        } else {
            "VerifyArtifact"
        }
        .to_owned(),
        secondary: None,
    };
    publish(checkpoint, &event, ctx).await;
}

/// Why a running checkpoint Job makes no progress, as far as its Events say.
#[derive(Debug, Default)]
struct Stuck {
    pod_creation_failure: Option<String>,
    pod_unschedulable: Option<String>,
    /// Look again soon: what is wrong is said only in Events, which wake no watch of ours.
    recheck_soon: bool,
}

/// Looks for what holds up a running Job: no pod yet (the Job controller reports a pod it
/// cannot create only in an Event), or a pod waiting unscheduled (say, no node's agent is
/// ready: the scheduler says why only in an Event on the pod).
async fn stuck_job(job: &Job, ctx: &Context) -> Stuck {
    let waiting = job
        .status
        .as_ref()
        .is_some_and(|s| s.active.unwrap_or(0) > 0 && s.ready.unwrap_or(0) == 0);
    let podless = pod_count(job) == 0;
    Stuck {
        pod_creation_failure: if podless {
            pod_creation_failure(job, ctx).await
        } else {
            None
        },
        pod_unschedulable: if waiting {
            pod_unschedulable(job, ctx).await
        } else {
            None
        },
        recheck_soon: podless || waiting,
    }
}

/// Creates the checkpoint Job the decision asks for (one already there, from an earlier
/// attempt whose status write was lost, is fine).
async fn create_job(
    checkpoint: &Checkpoint,
    decision: &decide::Decision,
    jobs: &Api<Job>,
    ctx: &Context,
) -> Result<(), ReconcileError> {
    let hash = decision.status.identity_hash.clone().unwrap_or_default();
    let location = decision.status.location.clone().unwrap_or_default();
    let job = job::build_checkpoint_job(checkpoint, &hash, &location, &ctx.entrypoint_image)
        .map_err(ReconcileError::Job)?;
    match jobs.create(&PostParams::default(), &job).await {
        Ok(_) => {
            info!(job = %job_name(&checkpoint.name_any()), "checkpoint job created");
            warn_about_seccomp(checkpoint, &job, ctx).await;
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(ReconcileError::Api(e)),
    }
}

/// The transition's Event on the Checkpoint (a failure to record it is logged, not fatal).
async fn record_transition(checkpoint: &Checkpoint, t: &decide::Transition, ctx: &Context) {
    let event = Event {
        type_: if t.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: t.reason.to_owned(),
        note: Some(t.note.chars().take(1000).collect()),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    publish(checkpoint, &event, ctx).await;
}

/// Records `event` on the Checkpoint (a failure to record it is logged, not fatal).
async fn publish(checkpoint: &Checkpoint, event: &Event, ctx: &Context) {
    if let Err(e) = ctx
        .recorder
        .publish(event, &checkpoint.object_ref(&()))
        .await
    {
        warn!(error = %e, "cannot record event");
    }
}

/// How often a Checkpoint waiting for a stale Job of its name to go is looked at.
const STALE_JOB_RECHECK: Duration = Duration::from_secs(1);

/// Deletes `job`, left by an earlier Checkpoint of the same name, with its pods (in the
/// background), exactly that object (uid precondition): a Job of the same name created since
/// is not touched. Already gone is fine.
async fn delete_stale_job(jobs: &Api<Job>, job: &Job) -> Result<(), ReconcileError> {
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: job.uid(),
            resource_version: None,
        }),
        ..kube::api::DeleteParams::background()
    };
    match jobs.delete(&job.name_any(), &params).await {
        Ok(_) => {
            info!(job = %job.name_any(), "deleted the job of an earlier checkpoint of this name");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(ReconcileError::Api(e)),
    }
}

/// How often a checkpoint Job without any pod is looked at (for `FailedCreate` Events).
const PODLESS_JOB_RECHECK: Duration = Duration::from_secs(5);

/// Pods the Job has or had (active, ready, succeeded, failed).
fn pod_count(job: &Job) -> i32 {
    let status = job.status.clone().unwrap_or_default();
    status.active.unwrap_or(0)
        + status.succeeded.unwrap_or(0)
        + status.failed.unwrap_or(0)
        + status.ready.unwrap_or(0)
}

/// Why `job` (which has no pod at all) cannot create its pod: the message of its latest
/// `FailedCreate` Event (the Job controller's, core/v1). Best effort: an unreadable list says
/// nothing.
async fn pod_creation_failure(job: &Job, ctx: &Context) -> Option<String> {
    let ns = job.namespace()?;
    let uid = job.uid()?;
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(ctx.client.clone(), &ns);
    let selector = format!(
        "involvedObject.kind=Job,involvedObject.name={},reason=FailedCreate",
        job.name_any()
    );
    let list = match events.list(&ListParams::default().fields(&selector)).await {
        Ok(list) => list,
        Err(e) => {
            warn!(error = %e, job = %job.name_any(), "cannot list the job's events");
            return None;
        }
    };
    list.items
        .into_iter()
        .filter(|e| e.involved_object.uid.as_deref() == Some(uid.as_str()))
        .max_by_key(last_seen)
        .and_then(|e| e.message)
}

/// When an Event was last seen: its series' last observation, its last timestamp, its time,
/// or its creation, whichever API wrote it.
fn last_seen(e: &k8s_openapi::api::core::v1::Event) -> Option<k8s_openapi::jiff::Timestamp> {
    e.series
        .as_ref()
        .and_then(|s| s.last_observed_time.as_ref().map(|t| t.0))
        .or_else(|| e.last_timestamp.as_ref().map(|t| t.0))
        .or_else(|| e.event_time.as_ref().map(|t| t.0))
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// Why `job`'s pod cannot be scheduled: the message of the scheduler's latest `FailedScheduling`
/// Event about one of its pods (named `<job>-<5 characters>`) that has no `Scheduled` Event
/// since. Best effort: an unreadable list says nothing.
async fn pod_unschedulable(job: &Job, ctx: &Context) -> Option<String> {
    let ns = job.namespace()?;
    let prefix = format!("{}-", job.name_any());
    let of_job = |e: &k8s_openapi::api::core::v1::Event| {
        e.involved_object.name.as_deref().is_some_and(|n| {
            n.strip_prefix(&prefix).is_some_and(|rest| {
                rest.len() == 5 && rest.bytes().all(|b| b.is_ascii_alphanumeric())
            })
        })
    };
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(ctx.client.clone(), &ns);
    let mut found = Vec::new();
    for reason in ["FailedScheduling", "Scheduled"] {
        let selector = format!("involvedObject.kind=Pod,reason={reason}");
        match events.list(&ListParams::default().fields(&selector)).await {
            Ok(list) => found.extend(list.items.into_iter().filter(of_job)),
            Err(e) => {
                warn!(error = %e, job = %job.name_any(), "cannot list the job's pods' events");
                return None;
            }
        }
    }
    let latest = found.iter().max_by_key(|e| last_seen(e))?;
    (latest.reason.as_deref() == Some("FailedScheduling"))
        .then(|| latest.message.clone())
        .flatten()
}

/// A seccomp profile the user set on the checkpoint pod or its target is kept instead of
/// warmstart's (their decision), but io_uring may then be usable and the dump fail: say so with
/// a warning Event on the Checkpoint, once, when the Job is created.
async fn warn_about_seccomp(checkpoint: &Checkpoint, job: &Job, ctx: &Context) {
    let Some(pod) = job.spec.as_ref().and_then(|s| s.template.spec.as_ref()) else {
        return;
    };
    let Ok(target) =
        job::resolve_target_container(pod, checkpoint.spec.job.target_container_name.as_deref())
    else {
        return;
    };
    for kept in restore_pod::seccomp_overrides(pod, &[target]) {
        warn!(warning = %kept, "user seccomp profile kept in the checkpoint job");
        let event = Event {
            type_: EventType::Warning,
            reason: REASON_SECCOMP_PROFILE_KEPT.to_owned(),
            note: Some(kept.to_string()),
            action: "CreateJob".to_owned(),
            secondary: None,
        };
        publish(checkpoint, &event, ctx).await;
    }
}

/// Other live Checkpoints of the namespace holding `hash` (not Failed, not being deleted),
/// oldest first.
async fn holders(
    checkpoint: &Checkpoint,
    hash: &str,
    ctx: &Context,
) -> Result<Vec<Checkpoint>, ReconcileError> {
    let ns = checkpoint.namespace().unwrap_or_default();
    let api: Api<Checkpoint> = Api::namespaced(ctx.client.clone(), &ns);
    let all = api
        .list(&ListParams::default())
        .await
        .map_err(ReconcileError::Api)?;
    let mut holders: Vec<Checkpoint> = all
        .items
        .into_iter()
        .filter(|o| o.uid() != checkpoint.uid() && o.metadata.deletion_timestamp.is_none())
        .filter(|o| {
            o.status.as_ref().is_some_and(|s| {
                s.identity_hash.as_deref() == Some(hash) && s.phase != Some(CheckpointPhase::Failed)
            })
        })
        .collect();
    holders.sort_by_key(|o| (o.creation_timestamp(), o.name_any()));
    Ok(holders)
}

/// The Checkpoint that owns `hash` before this one: the oldest live holder created earlier.
async fn duplicate_owner(
    checkpoint: &Checkpoint,
    hash: &str,
    ctx: &Context,
) -> Result<Option<String>, ReconcileError> {
    let me = (checkpoint.creation_timestamp(), checkpoint.name_any());
    Ok(holders(checkpoint, hash, ctx)
        .await?
        .into_iter()
        .find(|o| (o.creation_timestamp(), o.name_any()) < me)
        .map(|o| format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())))
}

async fn cleanup(checkpoint: &Checkpoint, ctx: &Context) -> Result<Action, ReconcileError> {
    let ns = checkpoint.namespace().ok_or(ReconcileError::NoNamespace)?;
    let hash = checkpoint
        .status
        .as_ref()
        .and_then(|s| s.identity_hash.clone());
    // The artifact is addressed by hash: never remove one that another live Checkpoint (for
    // example the owner of a rejected duplicate) still holds.
    let shared = match &hash {
        Some(h) => holders(checkpoint, h, ctx)
            .await?
            .first()
            .map(ResourceExt::name_any),
        None => None,
    };
    // A Checkpoint that goes because its namespace or the CRD goes was not deleted on purpose:
    // its artifact stays, for a Checkpoint of the same identity to adopt later.
    let going = going_away(&ns, ctx).await?;
    match (checkpoint.spec.deletion_policy, hash) {
        (DeletionPolicy::Delete, Some(hash)) if shared.is_none() && going.is_none() => {
            // The bucket's copy first: restores read it; the volume's is then only a leftover.
            if let Some(store) = &ctx.store {
                match store.delete(&ns, &hash).await {
                    Ok(objects) => {
                        info!(objects, checkpoint.hash = %hash, store = %store.config().describe(), "artifact deleted from the object store with its checkpoint");
                    }
                    Err(e) => {
                        store_unavailable(checkpoint, ctx, "delete the artifact from", &e).await;
                        return Err(ReconcileError::Store(e));
                    }
                }
            }
            let root = ctx.artifact_root.clone();
            let (ns2, h2) = (ns.clone(), hash.clone());
            let removed = tokio::task::spawn_blocking(move || artifact::remove(&root, &ns2, &h2))
                .await
                .map_err(|e| ReconcileError::Task(e.to_string()))?
                .map_err(ReconcileError::Artifact)?;
            info!(removed, checkpoint.hash = %hash, "artifact deleted with its checkpoint");
        }
        (policy, _) => info!(?policy, held_by = ?shared, going = ?going, "artifact kept"),
    }
    Ok(Action::await_change())
}

/// What is being deleted around a Checkpoint in `namespace` that is itself being deleted: its
/// namespace or the Checkpoint CRD (`None`: neither, the Checkpoint was deleted on purpose).
///
/// # Errors
/// The API cannot tell (the finalizer stays and the deletion is retried: an artifact is never
/// deleted on a guess).
async fn going_away(namespace: &str, ctx: &Context) -> Result<Option<String>, ReconcileError> {
    use k8s_openapi::api::core::v1::Namespace;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    let ns = namespaces
        .get_opt(namespace)
        .await
        .map_err(ReconcileError::Api)?;
    if ns.is_none_or(|n| n.metadata.deletion_timestamp.is_some()) {
        return Ok(Some(format!("namespace {namespace}")));
    }
    let crds: Api<CustomResourceDefinition> = Api::all(ctx.client.clone());
    let crd_name = format!(
        "{}.{}",
        <Checkpoint as kube::Resource>::plural(&()),
        <Checkpoint as kube::Resource>::group(&())
    );
    let crd = crds.get_opt(&crd_name).await.map_err(ReconcileError::Api)?;
    if crd.is_none_or(|c| c.metadata.deletion_timestamp.is_some()) {
        return Ok(Some(format!("customresourcedefinition {crd_name}")));
    }
    Ok(None)
}
