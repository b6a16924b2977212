//! The node loop's decisions, as pure functions of a pod, the journal and what its signal files
//! say: whether a checkpoint or restores start, which restores an agent that died left
//! unfinished, what a validation refusal calls for, and how a Ready restore pod is counted.
//! No I/O here: the loop ([`super::node`]) gathers the facts and acts on the answer.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use warmstart_shared::control::RestoreStatus;
use warmstart_shared::names;

use super::podvols::SourceSignals;
use super::validate::Refusal;

/// What a pod is to the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role<'a> {
    /// A checkpoint source (labelled so), of the identity hash it is labelled with.
    Source {
        /// `warmstart.dev/checkpoint-hash` (empty when absent: validation refuses it).
        hash: &'a str,
    },
    /// A pod that asks for a restore (`warmstart.dev/restore-from`).
    Restore,
    /// Neither: nothing to do.
    Other,
}

/// The pod's role, from its labels and annotations.
pub fn role(pod: &Pod) -> Role<'_> {
    let labels = pod.labels();
    if labels
        .get(names::LABEL_CHECKPOINT_SOURCE)
        .map(String::as_str)
        == Some(names::LABEL_CHECKPOINT_SOURCE_VALUE)
    {
        let hash = labels
            .get(names::LABEL_CHECKPOINT_HASH)
            .map_or("", String::as_str);
        return Role::Source { hash };
    }
    if pod
        .annotations()
        .contains_key(names::ANNOTATION_RESTORE_FROM)
    {
        return Role::Restore;
    }
    Role::Other
}

/// Whether a checkpoint of a source pod is due: its workload said it is ready (the `ready`
/// file, or the pod's Ready condition) or a dead agent's checkpoint is journalled
/// (`interrupted`), and no `<hash>.done` answered it yet.
pub fn checkpoint_due(pod: &Pod, interrupted: bool, signals: SourceSignals) -> bool {
    (interrupted || signals.ready || pod_is_ready(pod)) && !signals.done
}

/// A target container of a restore pod still to act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// The container.
    pub container: String,
    /// `None` when no restore of it started; [`RestoreStatus::InProgress`] when one started
    /// and no agent recorded its end.
    pub status: Option<RestoreStatus>,
}

/// The targets of a restore pod with no status, or with one left `in_progress`.
pub fn restore_pending(pod: &Pod) -> Vec<Pending> {
    let Some(targets) = pod.annotations().get(names::ANNOTATION_TARGET_CONTAINERS) else {
        return Vec::new();
    };
    targets
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .filter_map(|t| {
            let status = pod
                .annotations()
                .get(&names::restore_status_annotation(t))
                .map(|v| RestoreStatus::parse(v));
            match status {
                None => Some(None),
                Some(Some(RestoreStatus::InProgress)) => Some(Some(RestoreStatus::InProgress)),
                Some(_) => None,
            }
            .map(|status| Pending {
                container: t.to_owned(),
                status,
            })
        })
        .collect()
}

/// What a restore pod calls for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestorePlan {
    /// Every target's restore ended: count the pod's time to Ready (once).
    Ended,
    /// Not yet: the pod is not Running and nothing is left unfinished.
    Wait,
    /// Act on these targets: finish what a dead agent left, start the others.
    Start(Vec<Pending>),
}

/// The plan for a restore pod; `journalled(container)` tells whether the journal holds a
/// restore of that container (a dead agent's, since this agent runs none on the pod), and
/// `settled(container)` whether this agent wrote the outcome of its restore. The pod is the
/// watch's view, which may predate the agent's own writes: a settled target is never pending,
/// whatever status (none, or in progress) the view still shows.
pub fn restore_plan(
    pod: &Pod,
    journalled: impl Fn(&str) -> bool,
    settled: impl Fn(&str) -> bool,
) -> RestorePlan {
    let pending = restore_pending(pod);
    if pending.is_empty() {
        return RestorePlan::Ended;
    }
    let pending: Vec<Pending> = pending
        .into_iter()
        .filter(|p| !settled(&p.container))
        .collect();
    if pending.is_empty() {
        // Every outcome is written; the view shows them soon.
        return RestorePlan::Wait;
    }
    let interrupted = pending
        .iter()
        .any(|p| p.status.is_some() || journalled(&p.container));
    if interrupted || pod_phase(pod) == "Running" {
        RestorePlan::Start(pending)
    } else {
        RestorePlan::Wait
    }
}

/// The targets whose restore a dead agent left unfinished (reported, never redone), and the
/// others (to restore).
pub fn split_interrupted(
    pending: Vec<Pending>,
    journalled: impl Fn(&str) -> bool,
) -> (Vec<String>, Vec<String>) {
    let (interrupted, fresh): (Vec<Pending>, Vec<Pending>) = pending
        .into_iter()
        .partition(|p| p.status.is_some() || journalled(&p.container));
    let names = |list: Vec<Pending>| list.into_iter().map(|p| p.container).collect();
    (names(interrupted), names(fresh))
}

/// What a validation refusal calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRefusal {
    /// A state that passes (the pod not yet Running, a container starting): look again later.
    Wait,
    /// The pod can no longer be acted on, but a dead agent's operation on it is journalled:
    /// report what it left.
    FinishInterrupted,
    /// Report the refusal.
    Refuse,
}

/// What `refusal` calls for, `interrupted` when a dead agent's operation on the pod is
/// journalled.
pub fn on_refusal(refusal: &Refusal, interrupted: bool) -> OnRefusal {
    if interrupted {
        OnRefusal::FinishInterrupted
    } else if is_transient(refusal) {
        OnRefusal::Wait
    } else {
        OnRefusal::Refuse
    }
}

/// Refusals of a state that passes by itself.
fn is_transient(refusal: &Refusal) -> bool {
    matches!(
        refusal,
        Refusal::NotRunning(_)
            | Refusal::Terminating
            | Refusal::OtherNode { .. }
            | Refusal::ContainerNotRunning(_)
    )
}

/// For a Ready restore pod: `restored` when every target was restored, else `cold_start`, and
/// the time from its creation to its Ready condition (the API's one-second resolution).
pub fn ready_after(pod: &Pod) -> Option<(&'static str, Duration)> {
    let ready = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")?;
    let became = ready.last_transition_time.as_ref()?.0;
    let created = pod.metadata.creation_timestamp.as_ref()?.0;
    let millis = u64::try_from(became.as_millisecond() - created.as_millisecond()).ok()?;
    let failed = pod.annotations().iter().any(|(k, v)| {
        k.starts_with(names::ANNOTATION_RESTORE_STATUS_PREFIX)
            && RestoreStatus::parse(v) == Some(RestoreStatus::Failed)
    });
    Some((
        if failed { "cold_start" } else { "restored" },
        Duration::from_millis(millis),
    ))
}

fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

fn pod_is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn restore_pod(status: &str, ready_at: Option<&str>) -> Pod {
        let conditions = ready_at.map_or_else(
            || serde_json::json!([{"type": "Ready", "status": "False"}]),
            |at| serde_json::json!([{"type": "Ready", "status": "True", "lastTransitionTime": at}]),
        );
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "replica", "creationTimestamp": "2026-12-05T10:00:00Z",
                "annotations": {
                    names::ANNOTATION_RESTORE_FROM: "ck",
                    names::restore_status_annotation("main"): status}},
            "status": {"conditions": conditions}
        }))
        .unwrap()
    }

    /// A restore pod of targets `main` and `side` in `phase`, with these statuses.
    fn two_targets(phase: &str, statuses: &[(&str, &str)]) -> Pod {
        let mut annotations = serde_json::json!({
            names::ANNOTATION_RESTORE_FROM: "ck",
            names::ANNOTATION_TARGET_CONTAINERS: "main, side",
        });
        for (container, status) in statuses {
            annotations[names::restore_status_annotation(container)] = (*status).into();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "replica", "annotations": annotations},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    fn source(ready: bool) -> Pod {
        let status = if ready { "True" } else { "False" };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "checkpoint-llama-x", "labels": {
                names::LABEL_CHECKPOINT_SOURCE: names::LABEL_CHECKPOINT_SOURCE_VALUE,
                names::LABEL_CHECKPOINT_HASH: "96429b2725761a09"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": status}]}
        }))
        .unwrap()
    }

    #[test]
    fn pods_are_sources_restores_or_nothing() {
        assert_eq!(
            role(&source(false)),
            Role::Source {
                hash: "96429b2725761a09"
            }
        );
        assert_eq!(role(&two_targets("Running", &[])), Role::Restore);
        let mut spoof = source(false);
        spoof
            .labels_mut()
            .insert(names::LABEL_CHECKPOINT_SOURCE.into(), "yes".into());
        assert_eq!(role(&spoof), Role::Other);
    }

    #[test]
    fn a_checkpoint_is_due_when_ready_or_interrupted_until_answered() {
        let signals = |ready, done| SourceSignals { ready, done };
        assert!(!checkpoint_due(
            &source(false),
            false,
            signals(false, false)
        ));
        assert!(checkpoint_due(&source(false), false, signals(true, false)));
        assert!(checkpoint_due(&source(true), false, signals(false, false)));
        assert!(checkpoint_due(&source(false), true, signals(false, false)));
        for interrupted in [false, true] {
            assert!(!checkpoint_due(
                &source(true),
                interrupted,
                signals(true, true)
            ));
        }
    }

    #[test]
    fn restores_start_on_running_pods_or_to_finish_a_dead_agents_work() {
        let nothing = |_: &str| false;
        assert_eq!(
            restore_plan(&two_targets("Pending", &[]), nothing, nothing),
            RestorePlan::Wait
        );
        let both = vec![
            Pending {
                container: "main".into(),
                status: None,
            },
            Pending {
                container: "side".into(),
                status: None,
            },
        ];
        assert_eq!(
            restore_plan(&two_targets("Running", &[]), nothing, nothing),
            RestorePlan::Start(both.clone())
        );
        // A journal entry, or a status left in progress, is finished even before Running.
        assert_eq!(
            restore_plan(&two_targets("Pending", &[]), |c| c == "side", nothing),
            RestorePlan::Start(both)
        );
        let left = two_targets("Pending", &[("main", "completed"), ("side", "in_progress")]);
        assert_eq!(
            restore_plan(&left, nothing, nothing),
            RestorePlan::Start(vec![Pending {
                container: "side".into(),
                status: Some(RestoreStatus::InProgress),
            }])
        );
        let ended = two_targets("Running", &[("main", "completed"), ("side", "failed")]);
        assert_eq!(restore_plan(&ended, nothing, nothing), RestorePlan::Ended);
    }

    #[test]
    fn a_restore_this_agent_ended_is_never_pending_in_a_view_older_than_its_outcome() {
        let nothing = |_: &str| false;
        // The watch still shows the restore of `main` in progress (or not yet started) after
        // this agent wrote its outcome: not a dead agent's work, and not to restore again.
        for stale in [
            two_targets("Running", &[("main", "in_progress"), ("side", "completed")]),
            two_targets("Running", &[("side", "failed")]),
        ] {
            assert_eq!(
                restore_plan(&stale, nothing, |c| c == "main"),
                RestorePlan::Wait
            );
            assert!(matches!(
                restore_plan(&stale, nothing, nothing),
                RestorePlan::Start(_)
            ));
        }
        // The other target still starts.
        assert_eq!(
            restore_plan(&two_targets("Running", &[]), nothing, |c| c == "main"),
            RestorePlan::Start(vec![Pending {
                container: "side".into(),
                status: None,
            }])
        );
    }

    #[test]
    fn unfinished_restores_are_reported_the_others_started() {
        let pod = two_targets("Running", &[("side", "in_progress")]);
        assert_eq!(
            split_interrupted(restore_pending(&pod), |_| false),
            (vec!["side".to_owned()], vec!["main".to_owned()])
        );
        let pod = two_targets("Running", &[]);
        assert_eq!(
            split_interrupted(restore_pending(&pod), |c| c == "main"),
            (vec!["main".to_owned()], vec!["side".to_owned()])
        );
    }

    #[test]
    fn passing_states_wait_and_interrupted_work_is_finished() {
        let passing = Refusal::NotRunning("Pending".into());
        let lasting = Refusal::NoOwnerJob;
        assert_eq!(on_refusal(&passing, false), OnRefusal::Wait);
        assert_eq!(on_refusal(&lasting, false), OnRefusal::Refuse);
        for refusal in [&passing, &lasting] {
            assert_eq!(on_refusal(refusal, true), OnRefusal::FinishInterrupted);
        }
    }

    #[test]
    fn a_ready_restore_pod_counts_from_its_creation_by_outcome() {
        let restored = restore_pod("completed", Some("2026-12-05T10:00:03Z"));
        assert_eq!(
            ready_after(&restored),
            Some(("restored", Duration::from_secs(3)))
        );
        let cold = restore_pod("failed", Some("2026-12-05T10:01:00Z"));
        assert_eq!(
            ready_after(&cold),
            Some(("cold_start", Duration::from_secs(60)))
        );
        assert_eq!(ready_after(&restore_pod("completed", None)), None);
    }
}
