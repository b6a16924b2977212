//! The files the entrypoint reads and writes: `ready` and `<hash>.done` in the signal
//! directory, and the restore target's control directory (`restore-complete`,
//! `restore-failed`, `restore-claim`). Formats are the contract's (`warmstart_shared::control`).

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;
use warmstart_shared::control::{ClaimedBy, GateFile, RestoreClaim};
use warmstart_shared::names;
use warmstart_shared::signal::RestoreFailed;

/// A file operation of the protocol failed.
#[derive(Debug, Error)]
#[error("cannot {action} {}", path.display())]
pub struct ControlError {
    /// What was being done.
    pub action: &'static str,
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

fn ctx(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> ControlError {
    let path = path.to_path_buf();
    move |source| ControlError {
        action,
        path,
        source,
    }
}

/// Writes the ready file (`ready\n`), creating its directory.
///
/// # Errors
/// The directory or file cannot be written.
pub fn write_ready(path: &Path) -> Result<(), ControlError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(ctx("create", parent))?;
    }
    fs::write(path, "ready\n").map_err(ctx("write", path))
}

/// What `<hash>.done` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Done {
    /// The checkpoint was published.
    Success,
    /// The checkpoint failed, and why.
    Failure(String),
}

#[derive(Deserialize)]
struct DoneFile {
    success: bool,
    #[serde(default)]
    error: Option<String>,
}

/// Reads the done file: `Ok(None)` while it does not exist, `Err` with the reason when it
/// cannot be read or parsed (the caller reads twice before giving up, in case of a writer
/// that did not write atomically).
pub fn read_done(path: &Path) -> Result<Option<Done>, String> {
    let content = match fs::read_to_string(path) {
        Ok(content) => content,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let done: DoneFile = serde_json::from_str(&content)
        .map_err(|e| format!("{} is not a done file: {e}", path.display()))?;
    Ok(Some(if done.success {
        Done::Success
    } else {
        Done::Failure(done.error.unwrap_or_else(|| "no error given".to_owned()))
    }))
}

/// The outcome of trying to claim the placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The claim file is ours.
    Won,
    /// Somebody else's claim (its content when it could be read: a claimant may still be
    /// writing it).
    Lost(Option<RestoreClaim>),
}

/// A restore target's control directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlDir {
    dir: PathBuf,
}

impl ControlDir {
    /// The control directory at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The content of `restore-complete`, once it exists.
    pub fn restore_complete(&self) -> Option<GateFile> {
        match fs::read_to_string(self.file(names::FILE_RESTORE_COMPLETE)) {
            Ok(content) => Some(GateFile::parse(&content)),
            // Exists but unreadable: it still means the gate is open.
            Err(e) if e.kind() != io::ErrorKind::NotFound => Some(GateFile::parse("")),
            Err(_) => None,
        }
    }

    /// Why the agent gave up, once `restore-failed` exists (its raw content when it is not the
    /// contract's JSON: the file is written atomically, so that is all it will say).
    pub fn restore_failed(&self) -> Option<String> {
        let path = self.file(names::FILE_RESTORE_FAILED);
        match fs::read_to_string(&path) {
            Ok(content) => Some(
                serde_json::from_str::<RestoreFailed>(&content)
                    .map(|f| f.reason)
                    .unwrap_or_else(|_| content.trim().to_owned()),
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => Some(format!("{} exists but cannot be read: {e}", path.display())),
        }
    }

    /// The current claim, if any.
    pub fn claim(&self) -> Option<RestoreClaim> {
        let content = fs::read_to_string(self.file(names::FILE_RESTORE_CLAIM)).ok()?;
        serde_json::from_str(&content).ok()
    }

    /// Claims the placeholder for a cold start: creates `restore-claim` with `O_CREAT|O_EXCL`,
    /// writes and fsyncs the claim. Exactly one claimant wins.
    ///
    /// # Errors
    /// The file cannot be created for another reason than that it exists, or written.
    ///
    /// # Guarantees
    /// `Won` only if this call created the file.
    pub fn claim_cold_start(&self, pid: u32, reason: &str) -> Result<Claim, ControlError> {
        let path = self.file(names::FILE_RESTORE_CLAIM);
        let mut file = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Ok(Claim::Lost(self.claim()));
            }
            Err(e) => return Err(ctx("create", &path)(e)),
        };
        let claim = RestoreClaim {
            by: ClaimedBy::ColdStart,
            pid,
            at: now(),
            reason: Some(reason.to_owned()),
        };
        let json = serde_json::to_vec(&claim).map_err(|e| ctx("write", &path)(e.into()))?;
        file.write_all(&json)
            .and_then(|()| file.sync_all())
            .map_err(ctx("write", &path))?;
        sync_dir(&self.dir);
        Ok(Claim::Won)
    }

    /// Opens the startup gate after a cold start: `restore-complete` with
    /// `{"coldStart": true, "reason": …}`, written to a temporary file and renamed.
    ///
    /// # Errors
    /// The file cannot be written or renamed.
    pub fn open_gate_cold(&self, reason: &str) -> Result<(), ControlError> {
        let gate = GateFile {
            cold_start: true,
            reason: Some(reason.to_owned()),
        };
        let path = self.file(names::FILE_RESTORE_COMPLETE);
        let tmp = self.file(&format!(".{}.tmp", names::FILE_RESTORE_COMPLETE));
        let json = serde_json::to_vec(&gate).map_err(|e| ctx("write", &tmp)(e.into()))?;
        let mut file = fs::File::create(&tmp).map_err(ctx("create", &tmp))?;
        file.write_all(&json)
            .and_then(|()| file.sync_all())
            .map_err(ctx("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(ctx("rename into place", &path))?;
        sync_dir(&self.dir);
        Ok(())
    }
}

/// Best effort: makes a created or renamed entry durable.
fn sync_dir(dir: &Path) {
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Now, RFC 3339 UTC.
pub fn now() -> String {
    jiff::Timestamp::now().to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_claim_wins_and_the_loser_sees_the_winner() {
        let dir = tempfile::tempdir().unwrap();
        let control = ControlDir::new(dir.path());
        assert_eq!(control.claim_cold_start(1, "timeout").unwrap(), Claim::Won);
        let Claim::Lost(Some(winner)) = control.claim_cold_start(2, "again").unwrap() else {
            panic!("a second claim won");
        };
        assert_eq!((winner.by, winner.pid), (ClaimedBy::ColdStart, 1));
        assert_eq!(winner.reason.as_deref(), Some("timeout"));
        // A claim by the agent wins the same way.
        let other = tempfile::tempdir().unwrap();
        fs::write(
            other.path().join(names::FILE_RESTORE_CLAIM),
            r#"{"by":"restore","pid":9,"at":"t"}"#,
        )
        .unwrap();
        let control = ControlDir::new(other.path());
        let Claim::Lost(Some(agent)) = control.claim_cold_start(1, "timeout").unwrap() else {
            panic!("claimed over the agent");
        };
        assert_eq!(agent.by, ClaimedBy::Restore);
    }

    #[test]
    fn gate_and_failure_files_read_as_the_contract_says() {
        let dir = tempfile::tempdir().unwrap();
        let control = ControlDir::new(dir.path());
        assert_eq!(control.restore_complete(), None);
        assert_eq!(control.restore_failed(), None);
        control
            .open_gate_cold("restore failed: bad checksum")
            .unwrap();
        let gate = control.restore_complete().unwrap();
        assert!(gate.cold_start);
        assert_eq!(gate.reason.as_deref(), Some("restore failed: bad checksum"));
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
        fs::write(
            dir.path().join(names::FILE_RESTORE_FAILED),
            r#"{"reason":"checksum mismatch","at":"t"}"#,
        )
        .unwrap();
        assert_eq!(
            control.restore_failed().as_deref(),
            Some("checksum mismatch")
        );
        fs::write(dir.path().join(names::FILE_RESTORE_FAILED), "plain words\n").unwrap();
        assert_eq!(control.restore_failed().as_deref(), Some("plain words"));
    }

    #[test]
    fn done_files_are_parsed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.done");
        assert_eq!(read_done(&path), Ok(None));
        fs::write(&path, r#"{"hash":"h","success":true}"#).unwrap();
        assert_eq!(read_done(&path), Ok(Some(Done::Success)));
        fs::write(&path, r#"{"success":false,"error":"criu dump failed"}"#).unwrap();
        assert_eq!(
            read_done(&path),
            Ok(Some(Done::Failure("criu dump failed".to_owned())))
        );
        fs::write(&path, "{").unwrap();
        assert!(read_done(&path).unwrap_err().contains("is not a done file"));
    }
}
