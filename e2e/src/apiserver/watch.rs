//! Watch streams: newline-delimited JSON `WatchEvent`s (`{"type":…,"object":…}`) over a chunked
//! response, as kube-apiserver writes them, with `ADDED`/`MODIFIED`/`DELETED`, `BOOKMARK`s when
//! asked for, `ERROR` with a 410 `Status` when the history is gone, `timeoutSeconds`, and the
//! initial-events list of `sendInitialEvents`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, watch};

use super::resources::{self, ResourceType};
use super::selectors::{FieldSelector, LabelSelector};
use super::store::{Change, ChangeKind};
use super::table::Tabler;

/// What a watch selects.
#[derive(Clone, Debug)]
pub struct Filter {
    /// The served type.
    pub rt: ResourceType,
    /// Only this namespace (`None`: all).
    pub namespace: Option<String>,
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
}

impl Filter {
    /// Whether the stored object belongs to the watch; returns the served form when it does.
    pub fn select(&self, stored: &Value) -> Option<Value> {
        if let Some(ns) = &self.namespace
            && super::meta::namespace(stored) != ns
        {
            return None;
        }
        let served = resources::to_served(&self.rt, stored);
        (self.labels.matches(&super::meta::labels(&served))
            && self.fields.matches(&self.rt, &served))
        .then_some(served)
    }
}

/// Everything a watch task needs.
#[derive(Debug)]
pub struct WatchTask {
    /// Selection.
    pub filter: Filter,
    /// Objects to send as `ADDED` first (served form).
    pub initial: Vec<Value>,
    /// Send the `k8s.io/initial-events-end` bookmark after `initial`.
    pub initial_end_bookmark: bool,
    /// Changes from history to replay.
    pub backlog: Vec<Arc<Change>>,
    /// Live feed.
    pub live: broadcast::Receiver<Arc<Change>>,
    /// The `resourceVersion` the watch starts at.
    pub start_rv: u64,
    /// Send bookmarks.
    pub bookmarks: bool,
    /// Bookmark interval.
    pub bookmark_every: Duration,
    /// Close after this long.
    pub timeout: Duration,
    /// Server shutdown signal.
    pub shutdown: watch::Receiver<bool>,
    /// Render objects as `meta.k8s.io/v1` Tables (kubectl `get -w`).
    pub table: Option<Tabler>,
    /// Render objects as `PartialObjectMetadata` (kube-rs metadata watches).
    pub metadata_only: bool,
}

fn event_line(kind: &str, object: Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

impl WatchTask {
    fn render(&self, obj: Value, first: &mut bool) -> Value {
        match &self.table {
            Some(t) => {
                let table = t.table(&[obj], !*first);
                *first = false;
                table
            }
            None if self.metadata_only => {
                json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]})
            }
            None => obj,
        }
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Value {
        let mut meta = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        json!({"kind": self.filter.rt.kind, "apiVersion": self.filter.rt.api_version(), "metadata": meta})
    }

    /// Translate a change into the event this watch sends, if any.
    fn translate(&self, change: &Change) -> Option<(&'static str, Value)> {
        if change.key != self.filter.rt.storage {
            return None;
        }
        let new = self.filter.select(&change.object);
        match change.kind {
            ChangeKind::Added => new.map(|o| ("ADDED", o)),
            ChangeKind::Deleted => new.map(|o| ("DELETED", o)),
            ChangeKind::Modified => {
                let was = change
                    .old
                    .as_ref()
                    .and_then(|o| self.filter.select(o))
                    .is_some();
                match (was, new) {
                    (true, Some(o)) => Some(("MODIFIED", o)),
                    (false, Some(o)) => Some(("ADDED", o)),
                    (true, None) => {
                        let served = resources::to_served(&self.filter.rt, &change.object);
                        Some(("DELETED", served))
                    }
                    (false, None) => None,
                }
            }
        }
    }

    /// Run the watch, writing lines to `tx` until timeout, shutdown, or the client goes away.
    pub async fn run(mut self, tx: mpsc::Sender<Result<Bytes, std::io::Error>>) {
        let deadline = tokio::time::sleep(self.timeout);
        tokio::pin!(deadline);
        let mut first = true;
        let mut last_rv = self.start_rv;
        for obj in std::mem::take(&mut self.initial) {
            let o = self.render(obj, &mut first);
            if tx.send(Ok(event_line("ADDED", o))).await.is_err() {
                return;
            }
        }
        if self.initial_end_bookmark {
            let b = self.bookmark(last_rv, true);
            if tx.send(Ok(event_line("BOOKMARK", b))).await.is_err() {
                return;
            }
        }
        for change in std::mem::take(&mut self.backlog) {
            last_rv = last_rv.max(change.rv);
            if let Some((kind, obj)) = self.translate(&change) {
                let o = self.render(obj, &mut first);
                if tx.send(Ok(event_line(kind, o))).await.is_err() {
                    return;
                }
            }
        }
        let mut ticker = tokio::time::interval(self.bookmark_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                () = &mut deadline => return,
                () = tx.closed() => return,
                changed = self.shutdown.changed() => {
                    if changed.is_err() || *self.shutdown.borrow() {
                        return;
                    }
                }
                _ = ticker.tick(), if self.bookmarks => {
                    let b = self.bookmark(last_rv, false);
                    if tx.send(Ok(event_line("BOOKMARK", b))).await.is_err() {
                        return;
                    }
                }
                received = self.live.recv() => match received {
                    Ok(change) => {
                        if change.rv <= last_rv {
                            continue;
                        }
                        last_rv = change.rv;
                        if let Some((kind, obj)) = self.translate(&change) {
                            let o = self.render(obj, &mut first);
                            if tx.send(Ok(event_line(kind, o))).await.is_err() {
                                return;
                            }
                        }
                    }
                    // A watcher this far behind is closed; the client resumes from the last
                    // resourceVersion it saw, which the history still holds (or gets 410).
                    Err(broadcast::error::RecvError::Lagged(_) | broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }
}

/// The `ERROR` event a watch from a compacted `resourceVersion` gets (HTTP 200, then this).
pub fn error_line(status: &Value) -> Bytes {
    event_line("ERROR", status.clone())
}
