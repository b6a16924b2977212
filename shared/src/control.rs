//! The restore protocol's words: the files of a restore target's control directory
//! (`$WARMSTART_CONTROL_DIR`) beyond the bare `restore-complete` and the agent's
//! `restore-failed` ([`crate::signal::RestoreFailed`]) — the restore claim that makes exactly
//! one of restore and cold-start fallback win, and the content of `restore-complete` when the
//! standby entrypoint opened the startup gate itself — and the values of a restore pod's
//! per-container status annotation ([`RestoreStatus`]).
//!
//! Wire formats shared by the agent and `warmstart-entrypoint` (camelCase JSON). Readers accept
//! unknown fields, so either side may add one without breaking the other.

use serde::{Deserialize, Serialize};

/// Who created the restore claim.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimedBy {
    /// The agent, before it changed anything in the placeholder.
    Restore,
    /// The standby entrypoint, before it started the command itself.
    ColdStart,
}

impl ClaimedBy {
    /// The value as spelt in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restore => "restore",
            Self::ColdStart => "cold-start",
        }
    }
}

impl std::fmt::Display for ClaimedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Content of [`crate::names::FILE_RESTORE_CLAIM`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RestoreClaim {
    /// Who won.
    pub by: ClaimedBy,
    /// Process id of the claimant, in its own PID namespace.
    pub pid: u32,
    /// When, RFC 3339.
    pub at: String,
    /// Why the entrypoint fell back to a cold start (only for [`ClaimedBy::ColdStart`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Content of [`crate::names::FILE_RESTORE_COMPLETE`] when it is JSON. The agent may also write
/// plain text; [`GateFile::parse`] reads both.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GateFile {
    /// `true` when the standby entrypoint cold-started the command instead of a restore.
    pub cold_start: bool,
    /// Why it cold-started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl GateFile {
    /// Reads `restore-complete`: JSON as above, anything else means a restore (the agent's
    /// plain marker).
    pub fn parse(content: &str) -> Self {
        serde_json::from_str(content).unwrap_or(Self {
            cold_start: false,
            reason: None,
        })
    }
}

impl RestoreClaim {
    /// A claim by `by`, process `pid`, at `at`, without a reason.
    pub fn new(by: ClaimedBy, pid: u32, at: impl Into<String>) -> Self {
        Self {
            by,
            pid,
            at: at.into(),
            reason: None,
        }
    }
}

/// The value of a restore pod's `warmstart.dev/restore-status.<container>` annotation
/// ([`crate::names::restore_status_annotation`]), which the agent sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RestoreStatus {
    /// The agent started restoring the container (an agent that finds it with nothing running
    /// finishes what a dead agent left).
    InProgress,
    /// The restore completed: the container runs the restored process.
    Completed,
    /// Nothing was restored; the container cold-starts.
    Failed,
}

impl RestoreStatus {
    /// Every value.
    pub const ALL: [Self; 3] = [Self::InProgress, Self::Completed, Self::Failed];

    /// The value as spelt in the annotation.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    /// The status an annotation value names (`None` for any other text).
    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == value)
    }

    /// Whether the restore ended (completed or failed).
    pub fn is_final(self) -> bool {
        self != Self::InProgress
    }
}

impl std::fmt::Display for RestoreStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn claim_spells_the_contract() {
        let claim = RestoreClaim {
            by: ClaimedBy::ColdStart,
            pid: 1,
            at: "2026-01-01T00:00:00Z".to_owned(),
            reason: Some("no restore within 300s".to_owned()),
        };
        assert_eq!(
            serde_json::to_value(&claim).unwrap(),
            json!({"by": "cold-start", "pid": 1, "at": "2026-01-01T00:00:00Z",
                   "reason": "no restore within 300s"})
        );
        let by_agent: RestoreClaim =
            serde_json::from_str(r#"{"by":"restore","pid":7,"at":"x","extra":1}"#).unwrap();
        assert_eq!(by_agent.by, ClaimedBy::Restore);
        assert_eq!(by_agent.reason, None);
        assert!(
            serde_json::from_str::<RestoreClaim>(r#"{"by":"someone","pid":1,"at":""}"#).is_err()
        );
    }

    #[test]
    fn gate_file_reads_json_and_plain_markers() {
        let cold = GateFile {
            cold_start: true,
            reason: Some("restore failed: tampered".to_owned()),
        };
        let text = serde_json::to_string(&cold).unwrap();
        assert_eq!(
            text,
            r#"{"coldStart":true,"reason":"restore failed: tampered"}"#
        );
        assert_eq!(GateFile::parse(&text), cold);
        assert!(!GateFile::parse("restored\n").cold_start);
        assert!(!GateFile::parse(r#"{"coldStart":false}"#).cold_start);
    }

    #[test]
    fn restore_status_values_spell_the_contract() {
        let spelt: Vec<&str> = RestoreStatus::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(spelt, ["in_progress", "completed", "failed"]);
        for status in RestoreStatus::ALL {
            assert_eq!(RestoreStatus::parse(status.as_str()), Some(status));
        }
        assert_eq!(RestoreStatus::parse("Completed"), None);
        assert!(!RestoreStatus::InProgress.is_final());
        assert!(RestoreStatus::Failed.is_final());
    }
}
