//! The operation journal of cluster mode: one file per operation that started and whose outcome
//! is not yet recorded, `<state dir>/journal/<pod uid>.<checkpoint | container>.json`, written
//! durably before the operation starts. An entry found with no operation running belongs to an
//! agent that died mid-way: the node loop reports what it left and never runs it again.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tracing::warn;

/// What an entry records (spelt `checkpoint` and `restore` in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalOperation {
    /// A checkpoint of a source pod's target.
    Checkpoint,
    /// A restore into one container of a restore pod.
    Restore,
}

/// One entry: an operation that started and whose outcome is not yet recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JournalEntry {
    /// The operation.
    pub operation: JournalOperation,
    /// The pod's name.
    pub pod: String,
    /// Its namespace.
    pub namespace: String,
    /// The container operated on.
    pub container: String,
    /// When it started, RFC 3339.
    pub started_at: String,
}

/// The journal directory.
#[derive(Clone, Debug)]
pub struct Journal {
    dir: PathBuf,
}

/// The file name's part after the pod uid for a checkpoint (a restore's is its container).
const CHECKPOINT: &str = "checkpoint";

impl Journal {
    /// The journal in `dir` (created by the caller).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, uid: &str, what: &str) -> PathBuf {
        self.dir.join(format!("{uid}.{what}.json"))
    }

    fn key(operation: JournalOperation, container: &str) -> &str {
        match operation {
            JournalOperation::Checkpoint => CHECKPOINT,
            JournalOperation::Restore => container,
        }
    }

    /// Whether a checkpoint of pod `uid` is journalled.
    pub fn has_checkpoint(&self, uid: &str) -> bool {
        self.path(uid, CHECKPOINT).exists()
    }

    /// Whether a restore into `container` of pod `uid` is journalled.
    pub fn has_restore(&self, uid: &str, container: &str) -> bool {
        self.path(uid, container).exists()
    }

    /// The checkpoint entry of pod `uid`, if one is there and reads.
    pub fn checkpoint_entry(&self, uid: &str) -> Option<JournalEntry> {
        let bytes = std::fs::read(self.path(uid, CHECKPOINT)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Journals `entry` of pod `uid` durably; the guard removes it once the outcome is
    /// recorded.
    ///
    /// # Errors
    /// The entry could not be written: the operation must not start.
    pub fn record(&self, uid: &str, entry: &JournalEntry) -> std::io::Result<Recorded> {
        let path = self.path(uid, Self::key(entry.operation, &entry.container));
        let bytes = serde_json::to_vec(entry).map_err(std::io::Error::other)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        crate::podfiles::write_file(&self.dir, &name, &bytes)?;
        Ok(Recorded { path })
    }

    /// Removes the checkpoint entry of pod `uid` (a dead agent's, now reported).
    pub fn remove_checkpoint(&self, uid: &str) {
        remove(&self.path(uid, CHECKPOINT));
    }

    /// Removes the restore entry of `container` in pod `uid` (a dead agent's, now reported).
    pub fn remove_restore(&self, uid: &str, container: &str) {
        remove(&self.path(uid, container));
    }

    /// Removes the entries of pods that are neither `live` nor `busy`: nothing is left to
    /// report them on.
    pub fn sweep(&self, live: impl Fn(&str) -> bool, busy: impl Fn(&str) -> bool) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let uid = name.split('.').next().unwrap_or_default();
            if !uid.is_empty() && !live(uid) && !busy(uid) {
                remove(&entry.path());
            }
        }
    }
}

/// A journalled operation: its entry is removed when this is dropped (its outcome recorded, or
/// the operation abandoned before it changed anything).
#[derive(Debug)]
#[must_use = "the entry is removed when this is dropped"]
pub struct Recorded {
    path: PathBuf,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        remove(&self.path);
    }
}

/// Removes a journal entry; a failure is logged (the entry would be taken for a dead agent's
/// operation by the next look at the pod).
fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %e, "cannot remove a journal entry");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(operation: JournalOperation, container: &str) -> JournalEntry {
        JournalEntry {
            operation,
            pod: "replica".into(),
            namespace: "default".into(),
            container: container.into(),
            started_at: "2026-12-05T10:00:00Z".into(),
        }
    }

    #[test]
    fn entries_keep_their_spelling() {
        let json = serde_json::to_value(entry(JournalOperation::Restore, "main")).unwrap();
        assert_eq!(json["operation"], "restore");
        assert_eq!(json["startedAt"], "2026-12-05T10:00:00Z");
        let written = r#"{"operation":"checkpoint","pod":"p","namespace":"n","container":"main","startedAt":"t"}"#;
        let read: JournalEntry = serde_json::from_str(written).unwrap();
        assert_eq!(read.operation, JournalOperation::Checkpoint);
    }

    #[test]
    fn an_entry_lasts_as_long_as_its_operation() {
        let tmp = tempfile::tempdir().unwrap();
        let journal = Journal::new(tmp.path());
        let checkpoint = entry(JournalOperation::Checkpoint, "main");
        let recorded = journal.record("uid-1", &checkpoint).unwrap();
        assert!(journal.has_checkpoint("uid-1"));
        assert!(!journal.has_restore("uid-1", "main"));
        assert_eq!(journal.checkpoint_entry("uid-1"), Some(checkpoint));
        assert!(tmp.path().join("uid-1.checkpoint.json").is_file());
        drop(recorded);
        assert!(!journal.has_checkpoint("uid-1"));
        let restore = journal
            .record("uid-2", &entry(JournalOperation::Restore, "main"))
            .unwrap();
        assert!(journal.has_restore("uid-2", "main"));
        // Left by a dead agent (the guard forgotten, as a killed process forgets it).
        std::mem::forget(restore);
        journal.sweep(|uid| uid == "uid-2", |_| false);
        assert!(
            journal.has_restore("uid-2", "main"),
            "a live pod's entry stays"
        );
        journal.sweep(|_| false, |uid| uid == "uid-2");
        assert!(
            journal.has_restore("uid-2", "main"),
            "a busy pod's entry stays"
        );
        journal.sweep(|_| false, |_| false);
        assert!(!journal.has_restore("uid-2", "main"));
    }
}
