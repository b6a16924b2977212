//! Startup, liveness and readiness probes: when each is due, what it runs (`runc exec` for
//! `exec`, a connection into the pod's network namespace for `tcpSocket` and `httpGet`), and the
//! kubelet's thresholds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container as K8sContainer, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::fixture::FixtureError;

use super::container::NodeContainer;

/// Extra time granted to `runc exec` itself on top of a probe's `timeoutSeconds`: starting the
/// exec takes a while on a loaded machine, and a probe must not fail for that.
const EXEC_SLACK: Duration = Duration::from_secs(5);

/// Which probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProbeKind {
    /// `startupProbe`.
    Startup,
    /// `livenessProbe`.
    Liveness,
    /// `readinessProbe`.
    Readiness,
}

impl ProbeKind {
    /// The name used in events (`Startup probe failed: …`).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Startup => "Startup",
            Self::Liveness => "Liveness",
            Self::Readiness => "Readiness",
        }
    }
}

/// What a probe does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// Run a command in the container; exit status 0 is success.
    Exec(Vec<String>),
    /// Open a TCP connection to `127.0.0.1:port` in the pod's network namespace.
    Tcp(u16),
    /// `GET path` on `127.0.0.1:port`; a status from 200 to 399 is success.
    Http {
        /// The port.
        port: u16,
        /// The path, with its query.
        path: String,
    },
    /// Something the simulator cannot run (gRPC, HTTPS, another host): always fails, saying so.
    Unsupported(String),
}

/// One probe of one running container: its schedule and consecutive results.
#[derive(Debug, Clone)]
pub(crate) struct ProbeState {
    /// Which probe.
    pub(crate) kind: ProbeKind,
    /// What it runs.
    pub(crate) action: Action,
    period: Duration,
    timeout: Duration,
    success_threshold: u32,
    failure_threshold: u32,
    next_at: Instant,
    successes: u32,
    failures: u32,
}

/// What a probe result changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Enough consecutive successes.
    Passed,
    /// Enough consecutive failures.
    Failed,
    /// Neither threshold reached yet.
    Undecided,
}

impl ProbeState {
    /// The state of `probe` for `container`, started at `started`: first due after
    /// `initialDelaySeconds`, then every `periodSeconds` (defaults as the API's: period 10 s,
    /// timeout 1 s, thresholds 1 and 3).
    pub(crate) fn new(
        kind: ProbeKind,
        probe: &Probe,
        container: &K8sContainer,
        started: Instant,
    ) -> Self {
        let seconds = |value: Option<i32>, default: u64| {
            Duration::from_secs(value.map_or(default, |v| u64::try_from(v.max(0)).unwrap_or(0)))
        };
        let count = |value: Option<i32>, default: u32| {
            value.map_or(default, |v| u32::try_from(v.max(1)).unwrap_or(1))
        };
        Self {
            kind,
            action: action(probe, container),
            period: seconds(probe.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: seconds(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
            success_threshold: count(probe.success_threshold, 1),
            failure_threshold: count(probe.failure_threshold, 3),
            next_at: started + seconds(probe.initial_delay_seconds, 0),
            successes: 0,
            failures: 0,
        }
    }

    /// Whether the probe should run at `now`.
    pub(crate) fn due(&self, now: Instant) -> bool {
        now >= self.next_at
    }

    /// Schedules the next run one period after `now`.
    pub(crate) fn schedule(&mut self, now: Instant) {
        self.next_at = now + self.period;
    }

    /// How long one run may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Records one result and says whether a threshold was reached.
    pub(crate) fn record(&mut self, success: bool) -> Verdict {
        if success {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if self.successes >= self.success_threshold {
                return Verdict::Passed;
            }
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            if self.failures >= self.failure_threshold {
                return Verdict::Failed;
            }
        }
        Verdict::Undecided
    }

    /// Starts counting afresh (after a restart decision or a kill).
    pub(crate) fn reset(&mut self) {
        self.successes = 0;
        self.failures = 0;
    }
}

/// What `probe` does, with named ports resolved from `container`'s ports.
fn action(probe: &Probe, container: &K8sContainer) -> Action {
    let port = |value: &IntOrString| -> Result<u16, String> {
        match value {
            IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("invalid port {n}")),
            IntOrString::String(name) => container
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .and_then(|p| u16::try_from(p.container_port).ok())
                .ok_or_else(|| format!("no container port named {name:?}")),
        }
    };
    if let Some(exec) = &probe.exec {
        let command = exec.command.clone().unwrap_or_default();
        if command.is_empty() {
            return Action::Unsupported("exec probe without a command".to_owned());
        }
        return Action::Exec(command);
    }
    if let Some(tcp) = &probe.tcp_socket {
        if tcp
            .host
            .as_deref()
            .is_some_and(|h| !h.is_empty() && h != "127.0.0.1" && h != "localhost")
        {
            return Action::Unsupported(format!("tcpSocket host {:?}", tcp.host));
        }
        return port(&tcp.port).map_or_else(Action::Unsupported, Action::Tcp);
    }
    if let Some(http) = &probe.http_get {
        if http
            .scheme
            .as_deref()
            .is_some_and(|s| !s.eq_ignore_ascii_case("HTTP"))
        {
            return Action::Unsupported(format!("httpGet scheme {:?}", http.scheme));
        }
        if http
            .host
            .as_deref()
            .is_some_and(|h| !h.is_empty() && h != "127.0.0.1" && h != "localhost")
        {
            return Action::Unsupported(format!("httpGet host {:?}", http.host));
        }
        let path = match http.path.as_deref() {
            Some(p) if p.starts_with('/') => p.to_owned(),
            Some(p) => format!("/{p}"),
            None => "/".to_owned(),
        };
        return match port(&http.port) {
            Ok(port) => Action::Http { port, path },
            Err(e) => Action::Unsupported(e),
        };
    }
    if probe.grpc.is_some() {
        return Action::Unsupported(
            "gRPC probes are not supported by the node simulator".to_owned(),
        );
    }
    Action::Unsupported("probe without a handler".to_owned())
}

/// Runs `action` against `container` (blocking: call it from `spawn_blocking`). `Ok(())` is
/// success; `Err` says why it failed, in the kubelet's manner (the command's output, the HTTP
/// status, the connection error).
pub(crate) fn run(
    container: &Arc<NodeContainer>,
    action: &Action,
    timeout: Duration,
) -> Result<(), String> {
    match action {
        Action::Exec(command) => match container.exec_timeout(command, timeout + EXEC_SLACK) {
            Ok(output) if output.status.success() => Ok(()),
            Ok(output) => {
                let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
                text.push_str(&String::from_utf8_lossy(&output.stderr));
                Err(format!(
                    "command {command:?} exited with {}: {}",
                    output.status.code().unwrap_or(-1),
                    text.trim()
                ))
            }
            Err(FixtureError::Timeout { .. }) => {
                Err(format!("command {command:?} timed out after {timeout:?}"))
            }
            Err(e) => Err(e.to_string()),
        },
        Action::Tcp(port) => container
            .net_connect(*port)
            .map(drop)
            .map_err(|e| format!("dial tcp 127.0.0.1:{port}: {e}")),
        Action::Http { port, path } => match container.http_get(*port, path) {
            Ok((status, _)) if (200..400).contains(&status) => Ok(()),
            Ok((status, _)) => Err(format!("HTTP probe failed with statuscode: {status}")),
            Err(e) => Err(format!("Get \"http://127.0.0.1:{port}{path}\": {e}")),
        },
        Action::Unsupported(why) => Err(why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn thresholds_and_schedule() {
        let probe: Probe = serde_json::from_value(json!({
            "exec": {"command": ["cat", "/ready"]},
            "initialDelaySeconds": 2, "periodSeconds": 1, "failureThreshold": 2,
        }))
        .unwrap();
        let container: K8sContainer = serde_json::from_value(json!({"name": "c"})).unwrap();
        let start = Instant::now();
        let mut state = ProbeState::new(ProbeKind::Readiness, &probe, &container, start);
        assert_eq!(
            state.action,
            Action::Exec(vec!["cat".into(), "/ready".into()])
        );
        assert!(!state.due(start + Duration::from_secs(1)));
        assert!(state.due(start + Duration::from_secs(2)));
        state.schedule(start + Duration::from_secs(2));
        assert!(!state.due(start + Duration::from_millis(2500)));
        assert_eq!(state.record(false), Verdict::Undecided);
        assert_eq!(state.record(false), Verdict::Failed);
        assert_eq!(state.record(true), Verdict::Passed);
    }

    #[test]
    fn named_ports_and_unsupported_handlers() {
        let container: K8sContainer = serde_json::from_value(json!({
            "name": "c", "ports": [{"name": "http", "containerPort": 8080}],
        }))
        .unwrap();
        let probe = |p: serde_json::Value| action(&serde_json::from_value(p).unwrap(), &container);
        assert_eq!(
            probe(json!({"httpGet": {"port": "http", "path": "healthz"}})),
            Action::Http {
                port: 8080,
                path: "/healthz".to_owned()
            }
        );
        assert_eq!(
            probe(json!({"tcpSocket": {"port": 9000}})),
            Action::Tcp(9000)
        );
        assert!(matches!(
            probe(json!({"tcpSocket": {"port": "nope"}})),
            Action::Unsupported(_)
        ));
        assert!(matches!(
            probe(json!({"grpc": {"port": 1}})),
            Action::Unsupported(_)
        ));
        assert!(matches!(
            probe(json!({"httpGet": {"port": 1, "scheme": "HTTPS"}})),
            Action::Unsupported(_)
        ));
    }
}
