//! A minimal Job controller: [`JobController`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::batch::v1::{Job, JobCondition, JobStatus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::error::{Context, NodeError, is_not_found};
use super::events::{EventType, Recorder};

/// How the Job controller runs. [`JobControllerConfig::default`] gives the defaults.
#[derive(Debug, Clone)]
pub struct JobControllerConfig {
    /// How often every Job is looked at even without a change (for deadlines and TTLs). Default
    /// 200 ms.
    pub resync: Duration,
}

impl Default for JobControllerConfig {
    fn default() -> Self {
        Self {
            resync: Duration::from_millis(200),
        }
    }
}

/// A minimal Job controller (`batch/v1`), enough for checkpoint Jobs:
///
/// - creates pods from `spec.template` (named `<job>-<suffix>`, labelled `job-name`,
///   `controller-uid` and their `batch.kubernetes.io/` forms, owned by the Job), up to
///   `parallelism` (default 1) at a time and `completions` (default: one success) in all;
/// - counts pods that reach `Succeeded` and `Failed` (each pod once) in `status.succeeded` and
///   `status.failed`, and keeps `active`, `ready` and `startTime`;
/// - completes the Job (`SuccessCriteriaMet` and `Complete` conditions, `completionTime`) when
///   enough pods succeeded;
/// - fails it (`FailureTarget` and `Failed`, reason `BackoffLimitExceeded` or
///   `DeadlineExceeded`) when more pods failed than `backoffLimit` (default 6) or it ran longer
///   than `activeDeadlineSeconds`, deleting its active pods;
/// - deletes a finished Job `ttlSecondsAfterFinished` after it finished, with background
///   propagation (the API server's garbage collector then deletes its pods).
///
/// Not supported: indexed completion, `podFailurePolicy`, `successPolicy`, `suspend`,
/// `managedBy`, pod-creation back-off (a failed pod is replaced at once), custom selectors.
#[derive(Debug)]
pub struct JobController {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl JobController {
    /// Starts the controller with the default configuration. Must be called inside a tokio
    /// runtime.
    #[must_use]
    pub fn start(client: Client) -> Self {
        Self::start_with(client, JobControllerConfig::default())
    }

    /// Starts the controller with `config`.
    #[must_use]
    pub fn start_with(client: Client, config: JobControllerConfig) -> Self {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(client, config, stopped));
        Self {
            stop,
            task: Some(task),
        }
    }

    /// Stops the controller (Jobs and pods are left as they are).
    ///
    /// # Errors
    /// The controller's task panicked.
    pub async fn shutdown(mut self) -> Result<(), NodeError> {
        let _ = self.stop.send(true);
        match self.task.take() {
            Some(task) => task.await.ctx(|| "the Job controller's task".to_owned()),
            None => Ok(()),
        }
    }
}

impl Drop for JobController {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The pods of a Job counted so far, by UID.
#[derive(Debug, Clone, Default)]
struct Counted {
    /// Counts already in the status when the controller first saw the Job.
    base_succeeded: i32,
    base_failed: i32,
    succeeded: BTreeSet<String>,
    failed: BTreeSet<String>,
    /// Names of pods created but not yet seen in the watch.
    expected: BTreeSet<String>,
    /// After a refused pod creation: no new attempt before this time, and the wait doubles
    /// (the Job controller's backoff, so a refusal is not reported five times a second).
    create_backoff: Option<(std::time::Instant, Duration)>,
}

/// What one look at a Job decided.
#[derive(Debug, Clone, Default, PartialEq)]
struct Plan {
    /// How many pods to create.
    create: usize,
    /// Pods to delete (active pods of a finished Job).
    delete: Vec<String>,
    /// The new status, when it changed.
    status: Option<JobStatus>,
    /// Events to record: type, reason, message.
    events: Vec<(EventType, &'static str, String)>,
    /// Whether the Job's TTL ran out.
    delete_job: bool,
}

fn is_true(job: &Job, kind: &str) -> Option<Timestamp> {
    job.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind && c.status == "True")
        .map(|c| {
            c.last_transition_time
                .as_ref()
                .map_or_else(Timestamp::now, |t| t.0)
        })
}

fn condition(kind: &str, reason: &str, message: &str, now: Timestamp) -> JobCondition {
    JobCondition {
        type_: kind.to_owned(),
        status: "True".to_owned(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        last_probe_time: Some(Time(now)),
        last_transition_time: Some(Time(now)),
    }
}

fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Decides what to do about `job`, given its pods and what was counted before (updated here).
fn plan(job: &Job, pods: &[&Pod], counted: &mut Counted, now: Timestamp) -> Plan {
    let mut plan = Plan::default();
    let spec = job.spec.clone().unwrap_or_default();
    let old = job.status.clone().unwrap_or_default();
    let finished_at = is_true(job, "Complete").or_else(|| is_true(job, "Failed"));
    if let Some(finished_at) = finished_at {
        if let Some(ttl) = spec.ttl_seconds_after_finished {
            let ttl = jiff::SignedDuration::from_secs(i64::from(ttl.max(0)));
            if now >= finished_at + ttl {
                plan.delete_job = true;
            }
        }
        return plan;
    }
    for pod in pods {
        let Some(uid) = pod.uid() else { continue };
        match pod_phase(pod) {
            "Succeeded" => {
                counted.succeeded.insert(uid);
            }
            "Failed" => {
                counted.failed.insert(uid);
            }
            _ => {}
        }
        counted.expected.remove(&pod.name_any());
    }
    let active: Vec<&&Pod> = pods
        .iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && !matches!(pod_phase(p), "Succeeded" | "Failed")
        })
        .collect();
    let active_count = active.len() + counted.expected.len();
    let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    let succeeded = counted.base_succeeded + count(counted.succeeded.len());
    let failed = counted.base_failed + count(counted.failed.len());
    let ready = count(active.iter().filter(|p| pod_ready(p)).count());
    let start_time = old.start_time.clone().unwrap_or(Time(now));
    let parallelism = spec.parallelism.unwrap_or(1).max(0);
    let backoff_limit = spec.backoff_limit.unwrap_or(6);
    let mut conditions = old.conditions.clone().unwrap_or_default();
    let mut completion_time = old.completion_time.clone();

    let deadline_passed = spec.active_deadline_seconds.is_some_and(|seconds| {
        now >= start_time.0 + jiff::SignedDuration::from_secs(seconds.max(0))
    });
    let complete = match spec.completions {
        Some(n) => succeeded >= n,
        None => succeeded >= 1 && active_count == 0,
    };
    let failure = if failed > backoff_limit {
        Some((
            "BackoffLimitExceeded",
            "Job has reached the specified backoff limit",
        ))
    } else if deadline_passed {
        Some((
            "DeadlineExceeded",
            "Job was active longer than specified deadline",
        ))
    } else {
        None
    };
    let mut active_after = count(active_count);
    if let Some((reason, message)) = failure {
        conditions.push(condition("FailureTarget", reason, message, now));
        conditions.push(condition("Failed", reason, message, now));
        plan.delete = active.iter().map(|p| p.name_any()).collect();
        plan.events
            .push((EventType::Warning, reason, message.to_owned()));
        active_after = 0;
    } else if complete {
        conditions.push(condition(
            "SuccessCriteriaMet",
            "CompletionsReached",
            "Reached expected number of succeeded pods",
            now,
        ));
        conditions.push(condition(
            "Complete",
            "CompletionsReached",
            "Reached expected number of succeeded pods",
            now,
        ));
        completion_time = Some(Time(now));
        plan.delete = active.iter().map(|p| p.name_any()).collect();
        plan.events
            .push((EventType::Normal, "Completed", "Job completed".to_owned()));
        active_after = 0;
    } else {
        let remaining = spec
            .completions
            .map_or(parallelism, |n| (n - succeeded).min(parallelism));
        let want = remaining.max(0) - count(active_count);
        plan.create = usize::try_from(want.max(0)).unwrap_or(0);
        active_after += want.max(0);
    }
    let status = JobStatus {
        start_time: Some(start_time),
        active: Some(active_after),
        succeeded: Some(succeeded),
        failed: Some(failed),
        ready: Some(ready),
        conditions: (!conditions.is_empty()).then_some(conditions),
        completion_time,
        ..old.clone()
    };
    if status != old {
        plan.status = Some(status);
    }
    plan
}

/// A pod name for `job`: `<job>-<5 characters>` (as `generateName` would make).
fn pod_name(job: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut seed = Timestamp::now()
        .as_nanosecond()
        .unsigned_abs()
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(u128::from(n).wrapping_mul(1_442_695_040_888_963_407));
    let mut suffix = String::new();
    for _ in 0..5 {
        let index = usize::try_from(seed % ALPHABET.len() as u128).unwrap_or(0);
        suffix.push(char::from(ALPHABET[index]));
        seed /= ALPHABET.len() as u128;
    }
    let prefix: String = job.chars().take(57).collect();
    format!("{prefix}-{suffix}")
}

/// The pod `job`'s template describes, named `name`.
fn pod_for(job: &Job, name: &str) -> Pod {
    let template = job
        .spec
        .as_ref()
        .map(|s| s.template.clone())
        .unwrap_or_default();
    let meta = template.metadata.unwrap_or_default();
    let uid = job.uid().unwrap_or_default();
    let job_name = job.name_any();
    let mut labels = meta.labels.unwrap_or_default();
    labels.insert("batch.kubernetes.io/controller-uid".to_owned(), uid.clone());
    labels.insert("batch.kubernetes.io/job-name".to_owned(), job_name.clone());
    labels.insert("controller-uid".to_owned(), uid.clone());
    labels.insert("job-name".to_owned(), job_name.clone());
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: job.namespace(),
            labels: Some(labels),
            annotations: meta.annotations,
            owner_references: Some(vec![OwnerReference {
                api_version: "batch/v1".to_owned(),
                kind: "Job".to_owned(),
                name: job_name,
                uid,
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: template.spec,
        status: None,
    }
}

/// The UID of the Job controlling `pod`.
fn controller_uid(pod: &Pod) -> Option<&str> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true) && r.kind == "Job")
        .map(|r| r.uid.as_str())
}

/// A store fed by a watcher, with relists replacing its content.
struct Store<K> {
    items: BTreeMap<String, K>,
    relist: Option<BTreeMap<String, K>>,
}

impl<K: kube::Resource> Store<K> {
    fn new() -> Self {
        Self {
            items: BTreeMap::new(),
            relist: None,
        }
    }

    /// Applies a watch event; returns the objects that changed (the deleted ones too, with
    /// `true`).
    fn apply(&mut self, event: Event<K>) -> Vec<(K, bool)>
    where
        K: Clone,
    {
        let key = |k: &K| k.meta().uid.clone().unwrap_or_default();
        match event {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                Vec::new()
            }
            Event::InitApply(object) => {
                if let Some(relist) = self.relist.as_mut() {
                    relist.insert(key(&object), object.clone());
                }
                vec![(object, false)]
            }
            Event::InitDone => {
                let Some(fresh) = self.relist.take() else {
                    return Vec::new();
                };
                let gone: Vec<(K, bool)> = self
                    .items
                    .iter()
                    .filter(|(uid, _)| !fresh.contains_key(*uid))
                    .map(|(_, k)| (k.clone(), true))
                    .collect();
                self.items = fresh;
                gone
            }
            Event::Apply(object) => {
                self.items.insert(key(&object), object.clone());
                vec![(object, false)]
            }
            Event::Delete(object) => {
                self.items.remove(&key(&object));
                vec![(object, true)]
            }
        }
    }
}

/// The controller's loop.
async fn run(client: Client, config: JobControllerConfig, mut stopped: watch::Receiver<bool>) {
    let job_api: Api<Job> = Api::all(client.clone());
    let pod_api: Api<Pod> = Api::all(client.clone());
    let mut job_events =
        pin!(watcher::watcher(job_api, watcher::Config::default()).default_backoff());
    let mut pod_events =
        pin!(watcher::watcher(pod_api, watcher::Config::default()).default_backoff());
    let recorder = Recorder::new(client.clone(), "job-controller", None);
    let mut jobs: Store<Job> = Store::new();
    let mut pods: Store<Pod> = Store::new();
    let mut counted: HashMap<String, Counted> = HashMap::new();
    let mut resync = tokio::time::interval(config.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            event = job_events.next() => match event {
                Some(Ok(event)) => {
                    for (job, deleted) in jobs.apply(event) {
                        if deleted && let Some(uid) = job.uid() {
                            counted.remove(&uid);
                        }
                    }
                }
                Some(Err(e)) => tracing::warn!("job watch: {e}"),
                None => return,
            },
            event = pod_events.next() => match event {
                Some(Ok(event)) => { pods.apply(event); }
                Some(Err(e)) => tracing::warn!("job controller pod watch: {e}"),
                None => return,
            },
            _ = resync.tick() => {
                let all: Vec<Job> = jobs.items.values().cloned().collect();
                for job in all {
                    if let Err(e) = reconcile(&client, &recorder, &job, &pods, &mut counted).await {
                        tracing::warn!("{e}");
                    }
                }
            }
        }
    }
}

/// Looks at one Job and acts on the plan.
async fn reconcile(
    client: &Client,
    recorder: &Recorder,
    job: &Job,
    pods: &Store<Pod>,
    counted: &mut HashMap<String, Counted>,
) -> Result<(), NodeError> {
    if job.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let Some(uid) = job.uid() else {
        return Ok(());
    };
    let namespace = job.namespace().unwrap_or_else(|| "default".to_owned());
    let name = job.name_any();
    let owned: Vec<&Pod> = pods
        .items
        .values()
        .filter(|p| controller_uid(p) == Some(uid.as_str()))
        .collect();
    let counts = counted.entry(uid.clone()).or_insert_with(|| {
        let status = job.status.clone().unwrap_or_default();
        Counted {
            base_succeeded: status.succeeded.unwrap_or(0),
            base_failed: status.failed.unwrap_or(0),
            ..Counted::default()
        }
    });
    let plan = plan(job, &owned, counts, Timestamp::now());
    let job_api: Api<Job> = Api::namespaced(client.clone(), &namespace);
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    if plan.delete_job {
        let params = DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            ..DeleteParams::default()
        };
        match job_api.delete(&name, &params).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e).ctx(|| format!("delete finished job {namespace}/{name}")),
        }
        return Ok(());
    }
    let backing_off = counts
        .create_backoff
        .is_some_and(|(until, _)| std::time::Instant::now() < until);
    let mut created = 0;
    for _ in 0..if backing_off { 0 } else { plan.create } {
        let pod_name = pod_name(&name);
        let pod = pod_for(job, &pod_name);
        match pod_api.create(&PostParams::default(), &pod).await {
            Ok(_) => {
                counts.create_backoff = None;
                created += 1;
            }
            // Refused (admission, validation, quota): the Job controller says so in a
            // FailedCreate Event on the Job and tries again after a backoff.
            Err(kube::Error::Api(status)) if (400..500).contains(&status.code) => {
                let wait = counts
                    .create_backoff
                    .map_or(Duration::from_secs(1), |(_, wait)| {
                        (wait * 2).min(Duration::from_secs(30))
                    });
                counts.create_backoff = Some((std::time::Instant::now() + wait, wait));
                recorder.emit(
                    job,
                    None,
                    EventType::Warning,
                    "FailedCreate",
                    format!("Error creating: {}", status.message),
                );
                break;
            }
            Err(e) => {
                return Err(e).ctx(|| format!("create pod {pod_name} of job {namespace}/{name}"));
            }
        }
        counts.expected.insert(pod_name.clone());
        recorder.emit(
            job,
            None,
            EventType::Normal,
            "SuccessfulCreate",
            format!("Created pod: {pod_name}"),
        );
    }
    for pod_name in &plan.delete {
        match pod_api.delete(pod_name, &DeleteParams::default()).await {
            Ok(_) => recorder.emit(
                job,
                None,
                EventType::Normal,
                "SuccessfulDelete",
                format!("Deleted pod: {pod_name}"),
            ),
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                return Err(e).ctx(|| format!("delete pod {pod_name} of job {namespace}/{name}"));
            }
        }
    }
    // The plan counts the pods it creates as active; one not created (refused, or backing off)
    // is not, as upstream counts only pods that exist.
    let mut status = plan.status;
    let shortfall = plan.create - created;
    if shortfall > 0 {
        let mut adjusted = status.unwrap_or_else(|| job.status.clone().unwrap_or_default());
        adjusted.active =
            Some(adjusted.active.unwrap_or(0) - i32::try_from(shortfall).unwrap_or(i32::MAX));
        status = (Some(&adjusted) != job.status.as_ref()).then_some(adjusted);
    }
    if let Some(status) = status {
        let patch = json!({"status": status});
        job_api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .ctx(|| format!("update the status of job {namespace}/{name}"))?;
    }
    for (kind, reason, message) in plan.events {
        recorder.emit(job, None, kind, reason, message);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(spec: serde_json::Value) -> Job {
        serde_json::from_value(json!({
            "metadata": {"name": "j", "namespace": "ns", "uid": "job-uid"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn pod(name: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "uid": format!("uid-{name}"),
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "j",
                                              "uid": "job-uid", "controller": true}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn template() -> serde_json::Value {
        json!({"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [{"name": "c"}]}})
    }

    #[test]
    fn creates_then_completes() {
        let now = Timestamp::now();
        let j = job(json!({"template": template()}));
        let mut counted = Counted::default();
        let first = plan(&j, &[], &mut counted, now);
        assert_eq!(first.create, 1);
        assert_eq!(first.status.as_ref().unwrap().active, Some(1));

        let running = pod("j-a", "Running");
        let second = plan(&j, &[&running], &mut counted, now);
        assert_eq!(second.create, 0);

        let done = pod("j-a", "Succeeded");
        let third = plan(&j, &[&done], &mut counted, now);
        let status = third.status.unwrap();
        assert_eq!(status.succeeded, Some(1));
        let kinds: Vec<_> = status
            .conditions
            .unwrap()
            .iter()
            .map(|c| c.type_.clone())
            .collect();
        assert_eq!(kinds, ["SuccessCriteriaMet", "Complete"]);
        assert!(status.completion_time.is_some());

        let pod = pod_for(&j, "j-abcde");
        let labels = pod.metadata.labels.unwrap();
        assert_eq!(labels["job-name"], "j");
        assert_eq!(labels["app"], "x");
        assert_eq!(controller_uid(&pod_for(&j, "x")), Some("job-uid"));
    }

    #[test]
    fn fails_after_the_backoff_limit_and_expires() {
        let now = Timestamp::now();
        let j =
            job(json!({"template": template(), "backoffLimit": 1, "ttlSecondsAfterFinished": 0}));
        let mut counted = Counted::default();
        let one = pod("j-1", "Failed");
        let first = plan(&j, &[&one], &mut counted, now);
        assert_eq!(first.create, 1, "one failure is within the limit");
        let two = pod("j-2", "Failed");
        let second = plan(&j, &[&one, &two], &mut counted, now);
        assert_eq!(second.create, 0);
        let status = second.status.unwrap();
        assert_eq!(status.failed, Some(2));
        let failed = status.conditions.as_ref().unwrap().last().unwrap().clone();
        assert_eq!(failed.type_, "Failed");
        assert_eq!(failed.reason.as_deref(), Some("BackoffLimitExceeded"));

        let mut finished = j.clone();
        finished.status = Some(status);
        let later = plan(
            &finished,
            &[],
            &mut counted,
            now + jiff::SignedDuration::from_secs(1),
        );
        assert!(later.delete_job);
    }

    #[test]
    fn deadline_fails_and_deletes_active_pods() {
        let start = Timestamp::now();
        let mut j = job(json!({"template": template(), "activeDeadlineSeconds": 5}));
        j.status = Some(JobStatus {
            start_time: Some(Time(start)),
            ..JobStatus::default()
        });
        let mut counted = Counted::default();
        let running = pod("j-1", "Running");
        let early = plan(
            &j,
            &[&running],
            &mut counted,
            start + jiff::SignedDuration::from_secs(1),
        );
        assert!(early.delete.is_empty());
        let late = plan(
            &j,
            &[&running],
            &mut counted,
            start + jiff::SignedDuration::from_secs(6),
        );
        assert_eq!(late.delete, ["j-1"]);
        let status = late.status.unwrap();
        assert_eq!(
            status.conditions.unwrap().last().unwrap().reason.as_deref(),
            Some("DeadlineExceeded")
        );
    }

    #[test]
    fn pod_names_look_generated() {
        let a = pod_name("checkpoint-x");
        let b = pod_name("checkpoint-x");
        assert_ne!(a, b);
        assert!(
            a.starts_with("checkpoint-x-") && a.len() == "checkpoint-x-".len() + 5,
            "{a}"
        );
    }
}
