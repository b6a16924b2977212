//! Signal files (contract): what the agent writes into a checkpoint source pod's signal
//! directory when a checkpoint finished (`<hash>.done`), and into a restore target's control
//! directory when a restore did not happen (`restore-failed`). Workloads (the sample worker,
//! `warmstart-entrypoint`, native servers) read them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Content of `<hash>.done`: the outcome of the checkpoint of this pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DoneSignal {
    /// The identity hash.
    pub hash: String,
    /// Where the artifact was published (`<namespace>/<hash>` under the artifact root).
    pub location: String,
    /// Whether the artifact was published: the workload exits 0 when true, non-zero otherwise.
    pub success: bool,
    /// Why not, when `success` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Seconds per phase of the capture.
    #[serde(default)]
    pub timings: BTreeMap<String, f64>,
    /// RFC 3339 time the agent wrote this.
    pub timestamp: String,
}

/// Content of `restore-failed`: nothing was restored into this container, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreFailed {
    /// Why the restore was refused or failed.
    pub reason: String,
    /// RFC 3339 time the agent wrote this.
    pub at: String,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn done_signal_wire_format() {
        let done = DoneSignal {
            hash: "96429b2725761a09".into(),
            location: "default/96429b2725761a09".into(),
            success: false,
            error: Some("criu dump failed".into()),
            timings: [("dump".to_owned(), 1.5)].into(),
            timestamp: "2026-12-03T08:00:00Z".into(),
        };
        let json = serde_json::to_value(&done).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"hash": "96429b2725761a09", "location": "default/96429b2725761a09",
                "success": false, "error": "criu dump failed", "timings": {"dump": 1.5},
                "timestamp": "2026-12-03T08:00:00Z"})
        );
        let ok = DoneSignal {
            success: true,
            error: None,
            ..done
        };
        assert!(!serde_json::to_string(&ok).unwrap().contains("error"));
        assert_eq!(
            serde_json::from_value::<DoneSignal>(serde_json::to_value(&ok).unwrap()).unwrap(),
            ok
        );
    }

    #[test]
    fn restore_failed_wire_format() {
        let failed = RestoreFailed {
            reason: "stale binding".into(),
            at: "2026-12-03T08:00:00Z".into(),
        };
        assert_eq!(
            serde_json::to_value(&failed).unwrap(),
            serde_json::json!({"reason": "stale binding", "at": "2026-12-03T08:00:00Z"})
        );
    }
}
