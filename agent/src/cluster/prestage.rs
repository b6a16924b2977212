//! Pre-staging: Ready Checkpoints whose `spec.prestage` selects this node are fetched into the
//! node's cache before any restore asks (from the object store when there is one, else from
//! the artifact volume), so the first restore here reads local disk. Each node reports its own
//! entry of the Checkpoint's `status.prestage` (server-side apply under a field manager of its
//! own, so nodes never overwrite each other or the controller) and counts it in metrics.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tracing::{Instrument, info, info_span, warn};
use warmstart_shared::artifact::ArtifactLayout;
use warmstart_shared::{Checkpoint, CheckpointPhase, PrestageState, PrestageStatus};

use super::metrics::{CacheResult, Metrics};

/// How long after a failed pre-staging the same artifact is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(300);
/// How often every known Checkpoint is looked at again (a node's labels may have changed, a
/// failure may be due for a retry).
const RESYNC: Duration = Duration::from_secs(60);

/// The pre-stager of one node.
pub(super) struct Prestager {
    /// This node's name.
    pub(super) node: String,
    /// Root of the artifact volume.
    pub(super) artifact_root: PathBuf,
    /// The node's cache (without one there is nothing to warm: said on the Checkpoint).
    pub(super) cache: Option<Arc<crate::cache::Cache>>,
    /// The object store, when artifacts are fetched from one.
    pub(super) store: Option<warmstart_objstore::Store>,
    pub(super) client: Client,
    pub(super) metrics: Arc<Metrics>,
    /// Checkpoints (by uid) being fetched now.
    pub(super) fetching: Mutex<HashSet<String>>,
    /// When a Checkpoint's artifact (uid and digest) last failed to pre-stage.
    pub(super) failed: Mutex<HashMap<(String, String), Instant>>,
}

/// What a Checkpoint asks of this node.
#[derive(Debug, PartialEq, Eq)]
struct Wanted {
    uid: String,
    namespace: String,
    name: String,
    hash: String,
    digest: String,
    size_bytes: u64,
}

/// The Ready artifact `checkpoint` asks this node (with `labels`) to warm, unless this node's
/// entry already says it is warmed, or failed (then the caller decides on a retry).
fn wanted(
    checkpoint: &Checkpoint,
    node: &str,
    labels: &BTreeMap<String, String>,
) -> Option<(Wanted, Option<PrestageState>)> {
    let prestage = checkpoint.spec.prestage.as_ref()?;
    let status = checkpoint.status.as_ref()?;
    if status.phase != Some(CheckpointPhase::Ready) || !prestage.selects(labels) {
        return None;
    }
    let artifact = status.artifact.as_ref()?;
    let mine = status
        .prestage
        .iter()
        .find(|e| e.node == node && e.manifest_digest == artifact.manifest_digest)
        .map(|e| e.state);
    if mine == Some(PrestageState::Warmed) {
        return None;
    }
    Some((
        Wanted {
            uid: checkpoint.uid()?,
            namespace: checkpoint.namespace()?,
            name: checkpoint.name_any(),
            hash: status.identity_hash.clone()?,
            digest: artifact.manifest_digest.clone(),
            size_bytes: artifact.size_bytes,
        },
        mine,
    ))
}

/// The server-side apply body of this node's entry.
fn entry_patch(wanted: &Wanted, entry: &PrestageStatus) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "warmstart.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {"name": wanted.name, "namespace": wanted.namespace},
        "status": {"prestage": [entry]},
    })
}

/// Field manager of one node's entries: each node owns its own.
fn field_manager(node: &str) -> String {
    format!("warmstart-agent-{node}")
}

impl Prestager {
    /// Watches every Checkpoint until `shutdown`, pre-staging what selects this node.
    pub(super) async fn run(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        let api: Api<Checkpoint> = Api::all(self.client.clone());
        let (store, writer) = kube::runtime::reflector::store();
        let mut changes = std::pin::pin!(
            watcher(api, watcher::Config::default())
                .default_backoff()
                .reflect(writer)
                .applied_objects()
        );
        let mut resync = tokio::time::interval(RESYNC);
        let stop = warmstart_shell::shutdown::requested(shutdown);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                change = changes.next() => match change {
                    Some(Ok(checkpoint)) => self.consider(&[Arc::new(checkpoint)]).await,
                    Some(Err(e)) => warn!(error = %e, "checkpoint watch failed (retrying)"),
                    None => return,
                },
                _ = resync.tick() => self.consider(&store.state()).await,
                () = &mut stop => return,
            }
        }
    }

    /// Starts the pre-staging each of `checkpoints` asks of this node.
    async fn consider(self: &Arc<Self>, checkpoints: &[Arc<Checkpoint>]) {
        let asking: Vec<&Arc<Checkpoint>> = checkpoints
            .iter()
            .filter(|c| c.spec.prestage.is_some())
            .collect();
        if asking.is_empty() {
            return;
        }
        let labels = match self.node_labels().await {
            Ok(labels) => labels,
            Err(e) => {
                warn!(error = %e, "cannot read this node's labels for pre-staging");
                return;
            }
        };
        for checkpoint in asking {
            let Some((wanted, state)) = wanted(checkpoint, &self.node, &labels) else {
                continue;
            };
            // Without a cache nothing changes while this agent runs: its entry says so once.
            // Otherwise a failure is tried again only when due: every node's entry is an event
            // for every node, and answering each with a write grows with the square of the nodes.
            if state == Some(PrestageState::Failed)
                && (self.cache.is_none() || !self.retry_due(&wanted))
            {
                continue;
            }
            let fresh = self
                .fetching
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(wanted.uid.clone());
            if fresh {
                let this = self.clone();
                tokio::spawn(async move {
                    this.prestage(&wanted).await;
                    this.fetching
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&wanted.uid);
                });
            }
        }
    }

    async fn node_labels(&self) -> Result<BTreeMap<String, String>, kube::Error> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        Ok(nodes.get(&self.node).await?.labels().clone())
    }

    /// Whether a failed pre-staging is due for another try (always after a restart).
    fn retry_due(&self, wanted: &Wanted) -> bool {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(wanted.uid.clone(), wanted.digest.clone()))
            .is_none_or(|at| at.elapsed() >= RETRY_AFTER)
    }

    /// Fetches the artifact into the cache and reports how it went.
    async fn prestage(&self, wanted: &Wanted) {
        let span = info_span!("prestage", checkpoint.namespace = %wanted.namespace, checkpoint.name = %wanted.name, checkpoint.hash = %wanted.hash);
        async {
            let Some(cache) = &self.cache else {
                self.metrics.prestaged(CacheResult::Failed, None);
                self.report(
                    wanted,
                    PrestageState::Failed,
                    None,
                    "this node's agent runs without a node cache (--cache-dir): nothing to warm"
                        .to_owned(),
                )
                .await;
                return;
            };
            self.report(
                wanted,
                PrestageState::Fetching,
                None,
                "fetching into the node's cache".to_owned(),
            )
            .await;
            let layout =
                match ArtifactLayout::new(&self.artifact_root, &wanted.namespace, &wanted.hash) {
                    Ok(layout) => layout,
                    Err(e) => {
                        self.failed(wanted, cache, format!("unsafe artifact location: {e}"))
                            .await;
                        return;
                    }
                };
            let source = crate::store_source::for_artifact(self.store.as_ref(), &layout);
            let started = Instant::now();
            match cache
                .get(
                    &wanted.namespace,
                    &wanted.hash,
                    &wanted.digest,
                    source.as_ref(),
                )
                .await
            {
                Ok(held) => {
                    let (result, how) = if held.fetched() {
                        (
                            CacheResult::Fetched,
                            format!("fetched in {:.1} s", started.elapsed().as_secs_f64()),
                        )
                    } else {
                        (CacheResult::Hit, "already in the node's cache".to_owned())
                    };
                    drop(held);
                    info!(result = result.as_str(), "artifact pre-staged");
                    // Counted before it is reported: what the Checkpoint says is in the metrics.
                    self.metrics.prestaged(result, measured(cache).await);
                    self.report(wanted, PrestageState::Warmed, Some(wanted.size_bytes), how)
                        .await;
                }
                Err(e) => {
                    let why = format!(
                        "cannot fetch the artifact into the node's cache: {}",
                        crate::report::error_chain(&e)
                    );
                    self.failed(wanted, cache, why).await;
                }
            }
        }
        .instrument(span)
        .await;
    }

    async fn failed(&self, wanted: &Wanted, cache: &Arc<crate::cache::Cache>, why: String) {
        warn!(reason = %why, "pre-staging failed");
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((wanted.uid.clone(), wanted.digest.clone()), Instant::now());
        self.metrics
            .prestaged(CacheResult::Failed, measured(cache).await);
        self.report(wanted, PrestageState::Failed, None, why).await;
    }

    /// Applies this node's entry (a failure to write it is logged: the next change retries).
    async fn report(
        &self,
        wanted: &Wanted,
        state: PrestageState,
        size_bytes: Option<u64>,
        message: String,
    ) {
        let entry = PrestageStatus {
            node: self.node.clone(),
            state,
            manifest_digest: wanted.digest.clone(),
            size_bytes,
            message: Some(message.chars().take(1000).collect()),
            updated_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            )),
        };
        let api: Api<Checkpoint> = Api::namespaced(self.client.clone(), &wanted.namespace);
        let params = PatchParams::apply(&field_manager(&self.node)).force();
        if let Err(e) = api
            .patch_status(
                &wanted.name,
                &params,
                &Patch::Apply(entry_patch(wanted, &entry)),
            )
            .await
        {
            warn!(error = %e, state = state.as_str(), "cannot report pre-staging on the checkpoint");
        }
    }
}

/// The cache's size, measured off the executor.
async fn measured(cache: &Arc<crate::cache::Cache>) -> Option<u64> {
    let cache = cache.clone();
    tokio::task::spawn_blocking(move || cache.bytes())
        .await
        .ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn checkpoint(entries: serde_json::Value) -> Checkpoint {
        serde_json::from_value(json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": "llama", "namespace": "team", "uid": "u1"},
            "spec": {"identity": {"model": "m", "backendFramework": "vllm"},
                     "job": {"podTemplateSpec": {}},
                     "prestage": {"nodeSelector": {"pool": "h100"}}},
            "status": {"phase": "Ready", "identityHash": "0123456789abcdef",
                       "artifact": {"sizeBytes": 4096, "manifestDigest": "sha256:aa",
                                    "criuVersion": "4.2", "kernelVersion": "6.1"},
                       "prestage": entries}
        }))
        .unwrap()
    }

    fn labels(pool: &str) -> BTreeMap<String, String> {
        [("pool".to_owned(), pool.to_owned())].into()
    }

    #[test]
    fn a_ready_checkpoint_selecting_the_node_is_wanted_until_its_digest_is_warmed_there() {
        let (w, state) = wanted(&checkpoint(json!([])), "n1", &labels("h100")).unwrap();
        assert_eq!(
            (w.hash.as_str(), w.digest.as_str()),
            ("0123456789abcdef", "sha256:aa")
        );
        assert_eq!((w.namespace.as_str(), w.size_bytes), ("team", 4096));
        assert_eq!(state, None);
        assert!(wanted(&checkpoint(json!([])), "n1", &labels("a100")).is_none());
        let warmed = json!([{"node": "n1", "state": "Warmed", "manifestDigest": "sha256:aa"}]);
        assert!(wanted(&checkpoint(warmed.clone()), "n1", &labels("h100")).is_none());
        // Another node's entry, or this node's for an earlier capture, is not this one.
        assert!(wanted(&checkpoint(warmed), "n2", &labels("h100")).is_some());
        let stale = json!([{"node": "n1", "state": "Warmed", "manifestDigest": "sha256:old"}]);
        assert!(wanted(&checkpoint(stale), "n1", &labels("h100")).is_some());
        let failed = json!([{"node": "n1", "state": "Failed", "manifestDigest": "sha256:aa"}]);
        assert_eq!(
            wanted(&checkpoint(failed), "n1", &labels("h100"))
                .unwrap()
                .1,
            Some(PrestageState::Failed)
        );
        let mut creating = checkpoint(json!([]));
        creating.status.as_mut().unwrap().phase = Some(CheckpointPhase::Creating);
        assert!(wanted(&creating, "n1", &labels("h100")).is_none());
    }

    #[test]
    fn the_entry_is_applied_alone_under_the_nodes_own_manager() {
        let (w, _) = wanted(&checkpoint(json!([])), "n1", &labels("h100")).unwrap();
        let entry = PrestageStatus {
            node: "n1".into(),
            state: PrestageState::Warmed,
            manifest_digest: "sha256:aa".into(),
            ..Default::default()
        };
        let patch = entry_patch(&w, &entry);
        assert_eq!(
            patch["metadata"],
            json!({"name": "llama", "namespace": "team"})
        );
        assert_eq!(patch["status"]["prestage"][0]["node"], "n1");
        assert_eq!(patch["status"]["prestage"][0]["state"], "Warmed");
        assert_eq!(patch["status"].as_object().unwrap().len(), 1);
        assert_eq!(field_manager("n1"), "warmstart-agent-n1");
    }
}
