//! The container's own readiness probe, run from inside the container: a Kubernetes `Probe`
//! (`httpGet`, `tcpSocket`, `exec`, `grpc`) with its timing fields, as kubelet runs it.
//!
//! Differences from kubelet, all because the probe runs inside the container:
//! - `host` unset means the loopback address (kubelet uses the pod IP; a server listening on
//!   all addresses answers on both). A host name other than `localhost` is refused: the binary
//!   is static and resolves no names.
//! - A named port cannot be looked up here: the Job builder writes the number.
//! - `httpGet` with `scheme: HTTPS` is refused (no TLS client in this binary).
//!
//! Results follow kubelet: HTTP 200–399 succeeds; a TCP connect succeeds; exec exit status 0
//! succeeds; gRPC succeeds when the health service answers `SERVING`. Every attempt is bounded
//! by `timeoutSeconds`. `successThreshold` consecutive successes make the container ready,
//! `failureThreshold` consecutive failures make it not ready.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Probe;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use nix::sys::signal::{Signal, kill};
use thiserror::Error;

use crate::grpc;
use crate::reaper::{Reaper, exit_code};
use crate::spawn::{SpawnSpec, spawn};

/// Kubelet's defaults for unset timing fields.
const DEFAULT_PERIOD_SECONDS: i32 = 10;
const DEFAULT_TIMEOUT_SECONDS: i32 = 1;
const DEFAULT_FAILURE_THRESHOLD: i32 = 3;
/// Most bytes of an HTTP response read to find its status line.
const MAX_STATUS_LINE: usize = 4096;

/// Why a probe definition cannot be run.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProbeSpecError {
    /// Not JSON of a Kubernetes `Probe`.
    #[error("readiness probe is not a Kubernetes Probe: {0}")]
    Json(String),
    /// None, or more than one, of the handlers is set.
    #[error(
        "readiness probe must set exactly one of httpGet, tcpSocket, exec and grpc, it sets {0}"
    )]
    Handlers(usize),
    /// A port is a name, or out of range.
    #[error(
        "{handler} port {port:?} is not a port number (named ports are resolved by the job builder)"
    )]
    Port {
        /// The handler.
        handler: &'static str,
        /// The port as given.
        port: String,
    },
    /// A host is a name this static binary cannot resolve.
    #[error("{handler} host {host:?} is not an IP address or localhost (no name resolution here)")]
    Host {
        /// The handler.
        handler: &'static str,
        /// The host as given.
        host: String,
    },
    /// `httpGet.scheme` is not `HTTP`.
    #[error("httpGet scheme {0:?} is not supported, only HTTP")]
    Scheme(String),
    /// `exec.command` is empty.
    #[error("exec probe has no command")]
    EmptyCommand,
    /// A timing field is out of range.
    #[error("{field} is {value}, must be at least {min}")]
    Timing {
        /// The field.
        field: &'static str,
        /// Its value.
        value: i32,
        /// Its minimum.
        min: i32,
    },
}

/// What one probe attempt does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `GET path` over HTTP/1.1.
    Http {
        /// Where to connect.
        addr: SocketAddr,
        /// The `Host` header (unless one of `headers` sets it).
        host: String,
        /// Request target.
        path: String,
        /// Extra request headers.
        headers: Vec<(String, String)>,
    },
    /// A TCP connect.
    Tcp {
        /// Where to connect.
        addr: SocketAddr,
    },
    /// A command, run without a shell.
    Exec {
        /// argv.
        command: Vec<String>,
    },
    /// `grpc.health.v1.Health/Check`.
    Grpc {
        /// Where to connect.
        addr: SocketAddr,
        /// The service to ask about (empty: the server as a whole).
        service: String,
    },
}

/// A validated probe: the action and kubelet's timing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSpec {
    /// What each attempt does.
    pub action: Action,
    /// Before the first attempt.
    pub initial_delay: Duration,
    /// Between attempts.
    pub period: Duration,
    /// Bound of one attempt.
    pub timeout: Duration,
    /// Consecutive successes that make the container ready.
    pub success_threshold: u32,
    /// Consecutive failures that make it not ready.
    pub failure_threshold: u32,
}

impl ProbeSpec {
    /// Parses the JSON of a Kubernetes `Probe` (what `WARMSTART_READY_PROBE` holds).
    ///
    /// # Errors
    /// Not a `Probe`, or one this runner cannot run (see [`ProbeSpecError`]).
    pub fn from_json(json: &str) -> Result<Self, ProbeSpecError> {
        let probe: Probe =
            serde_json::from_str(json).map_err(|e| ProbeSpecError::Json(e.to_string()))?;
        Self::from_probe(&probe)
    }

    /// Validates a Kubernetes `Probe`, applying kubelet's defaults.
    ///
    /// # Errors
    /// See [`ProbeSpecError`].
    pub fn from_probe(probe: &Probe) -> Result<Self, ProbeSpecError> {
        let set = usize::from(probe.http_get.is_some())
            + usize::from(probe.tcp_socket.is_some())
            + usize::from(probe.exec.is_some())
            + usize::from(probe.grpc.is_some());
        if set != 1 {
            return Err(ProbeSpecError::Handlers(set));
        }
        let action = if let Some(http) = &probe.http_get {
            if let Some(scheme) = http.scheme.as_deref().filter(|s| *s != "HTTP") {
                return Err(ProbeSpecError::Scheme(scheme.to_owned()));
            }
            let port = port_number("httpGet", &http.port)?;
            let ip = host_ip("httpGet", http.host.as_deref())?;
            let path = match http.path.as_deref() {
                None | Some("") => "/".to_owned(),
                Some(p) if p.starts_with('/') => p.to_owned(),
                Some(p) => format!("/{p}"),
            };
            Action::Http {
                addr: SocketAddr::new(ip, port),
                host: SocketAddr::new(ip, port).to_string(),
                path,
                headers: http
                    .http_headers
                    .iter()
                    .flatten()
                    .map(|h| (h.name.clone(), h.value.clone()))
                    .collect(),
            }
        } else if let Some(tcp) = &probe.tcp_socket {
            let port = port_number("tcpSocket", &tcp.port)?;
            let ip = host_ip("tcpSocket", tcp.host.as_deref())?;
            Action::Tcp {
                addr: SocketAddr::new(ip, port),
            }
        } else if let Some(exec) = &probe.exec {
            let command = exec.command.clone().unwrap_or_default();
            if command.is_empty() {
                return Err(ProbeSpecError::EmptyCommand);
            }
            Action::Exec { command }
        } else if let Some(g) = &probe.grpc {
            let port = u16::try_from(g.port).map_err(|_| ProbeSpecError::Port {
                handler: "grpc",
                port: g.port.to_string(),
            })?;
            Action::Grpc {
                addr: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port),
                service: g.service.clone().unwrap_or_default(),
            }
        } else {
            return Err(ProbeSpecError::Handlers(0));
        };
        Ok(Self {
            action,
            initial_delay: seconds("initialDelaySeconds", probe.initial_delay_seconds, 0, 0)?,
            period: seconds(
                "periodSeconds",
                probe.period_seconds,
                DEFAULT_PERIOD_SECONDS,
                1,
            )?,
            timeout: seconds(
                "timeoutSeconds",
                probe.timeout_seconds,
                DEFAULT_TIMEOUT_SECONDS,
                1,
            )?,
            success_threshold: threshold("successThreshold", probe.success_threshold, 1)?,
            failure_threshold: threshold(
                "failureThreshold",
                probe.failure_threshold,
                DEFAULT_FAILURE_THRESHOLD,
            )?,
        })
    }
}

fn port_number(handler: &'static str, port: &IntOrString) -> Result<u16, ProbeSpecError> {
    let parsed = match port {
        IntOrString::Int(n) => u16::try_from(*n).ok(),
        IntOrString::String(s) => s.parse::<u16>().ok(),
    };
    parsed
        .filter(|p| *p != 0)
        .ok_or_else(|| ProbeSpecError::Port {
            handler,
            port: match port {
                IntOrString::Int(n) => n.to_string(),
                IntOrString::String(s) => s.clone(),
            },
        })
}

fn host_ip(handler: &'static str, host: Option<&str>) -> Result<IpAddr, ProbeSpecError> {
    match host {
        None | Some("" | "localhost") => Ok(Ipv4Addr::LOCALHOST.into()),
        Some(h) => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| ProbeSpecError::Host {
                handler,
                host: h.to_owned(),
            }),
    }
}

fn seconds(
    field: &'static str,
    value: Option<i32>,
    default: i32,
    min: i32,
) -> Result<Duration, ProbeSpecError> {
    let value = value.unwrap_or(default);
    let secs = u64::try_from(value)
        .ok()
        .filter(|_| value >= min)
        .ok_or(ProbeSpecError::Timing { field, value, min })?;
    Ok(Duration::from_secs(secs))
}

fn threshold(field: &'static str, value: Option<i32>, default: i32) -> Result<u32, ProbeSpecError> {
    let value = value.unwrap_or(default);
    u32::try_from(value)
        .ok()
        .filter(|v| *v >= 1)
        .ok_or(ProbeSpecError::Timing {
            field,
            value,
            min: 1,
        })
}

/// The result of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The probe passed.
    Success,
    /// The probe failed, and why.
    Failure(String),
}

/// Runs one attempt of `action`, bounded by `timeout`. Exec probes start their command through
/// `reaper`, so a PID 1 reaping every child does not lose its status.
pub fn run_once(action: &Action, timeout: Duration, reaper: &Reaper) -> Outcome {
    let result = match action {
        Action::Http {
            addr,
            host,
            path,
            headers,
        } => http_get(*addr, host, path, headers, timeout),
        Action::Tcp { addr } => TcpStream::connect_timeout(addr, timeout)
            .map(drop)
            .map_err(|e| format!("connect to {addr}: {e}")),
        Action::Exec { command } => exec(command, timeout, reaper),
        Action::Grpc { addr, service } => grpc::health_check(*addr, service, timeout),
    };
    match result {
        Ok(()) => Outcome::Success,
        Err(reason) => Outcome::Failure(reason),
    }
}

fn http_get(
    addr: SocketAddr,
    host: &str,
    path: &str,
    headers: &[(String, String)],
    timeout: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let mut request = format!("GET {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {host}\r\n"));
    }
    if !headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("user-agent"))
    {
        request.push_str("User-Agent: warmstart-entrypoint\r\n");
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("Accept: */*\r\nConnection: close\r\n\r\n");
    stream
        .set_write_timeout(Some(left()))
        .and_then(|()| stream.write_all(request.as_bytes()))
        .map_err(|e| format!("send GET {path} to {addr}: {e}"))?;
    let mut head = Vec::new();
    let mut buf = [0_u8; 512];
    let line_end = loop {
        if let Some(end) = head.iter().position(|b| *b == b'\n') {
            break end;
        }
        if head.len() > MAX_STATUS_LINE {
            return Err(format!("GET {path} on {addr}: no status line"));
        }
        stream
            .set_read_timeout(Some(left()))
            .map_err(|e| format!("GET {path} on {addr}: {e}"))?;
        match stream.read(&mut buf) {
            Ok(0) => {
                return Err(format!(
                    "GET {path} on {addr}: connection closed without a response"
                ));
            }
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("GET {path} on {addr}: {e}")),
        }
    };
    let line = String::from_utf8_lossy(&head[..line_end]);
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| line.starts_with("HTTP/"))
        .ok_or_else(|| {
            format!(
                "GET {path} on {addr}: malformed status line {:?}",
                line.trim_end()
            )
        })?;
    if (200..400).contains(&status) {
        Ok(())
    } else {
        Err(format!("GET {path} on {addr}: HTTP {status}"))
    }
}

fn exec(command: &[String], timeout: Duration, reaper: &Reaper) -> Result<(), String> {
    let program = command.first().ok_or("exec probe has no command")?;
    let spec = SpawnSpec {
        argv: command.iter().map(OsString::from).collect(),
        unset: Vec::new(),
        null_stdio: true,
    };
    let pid = reaper
        .spawn(|| spawn(&spec).map_err(std::io::Error::from))
        .map_err(|e| format!("run {program}: {e}"))?;
    match reaper.wait_timeout(pid, timeout) {
        Some(status) => match exit_code(status) {
            0 => Ok(()),
            code => Err(format!("{program} exited with status {code}")),
        },
        None => {
            // Kubelet gives a timed-out exec probe no second chance either.
            let _ = kill(pid, Signal::SIGKILL);
            let _ = reaper.wait_timeout(pid, Duration::from_secs(5));
            Err(format!("{program} timed out after {}s", timeout.as_secs()))
        }
    }
}

/// A change of the probe's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// `successThreshold` consecutive successes.
    Ready,
    /// `failureThreshold` consecutive failures; the last reason.
    NotReady {
        /// Consecutive failures so far.
        failures: u32,
        /// Why the last attempt failed.
        reason: String,
    },
}

/// Kubelet's threshold logic: the verdict changes only after enough consecutive results.
#[derive(Debug, Clone)]
pub struct Thresholds {
    success_threshold: u32,
    failure_threshold: u32,
    successes: u32,
    failures: u32,
    /// `None` before the first verdict (the container starts not ready, silently).
    ready: Option<bool>,
}

impl Thresholds {
    /// The state before the first attempt.
    pub fn new(success_threshold: u32, failure_threshold: u32) -> Self {
        Self {
            success_threshold,
            failure_threshold,
            successes: 0,
            failures: 0,
            ready: None,
        }
    }

    /// Records one result; the transition it causes, if any.
    pub fn record(&mut self, outcome: &Outcome) -> Option<Transition> {
        match outcome {
            Outcome::Success => {
                self.failures = 0;
                self.successes = self.successes.saturating_add(1);
                (self.successes >= self.success_threshold && self.ready != Some(true)).then(|| {
                    self.ready = Some(true);
                    Transition::Ready
                })
            }
            Outcome::Failure(reason) => {
                self.successes = 0;
                self.failures = self.failures.saturating_add(1);
                (self.failures >= self.failure_threshold && self.ready != Some(false)).then(|| {
                    self.ready = Some(false);
                    Transition::NotReady {
                        failures: self.failures,
                        reason: reason.clone(),
                    }
                })
            }
        }
    }
}

/// What the runner thread reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeEvent {
    /// A verdict changed.
    Transition(Transition),
    /// One attempt failed (below the threshold too), for the log.
    Failed(String),
}

/// A probe running on its own thread until it reports [`Transition::Ready`] or is stopped.
#[derive(Debug)]
pub struct Runner {
    stop: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Runner {
    /// Starts probing: waits `initialDelaySeconds`, then one attempt every `periodSeconds`;
    /// reports to `events`; ends after the first [`Transition::Ready`].
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn start(
        spec: ProbeSpec,
        reaper: Arc<Reaper>,
        events: Sender<ProbeEvent>,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = std::sync::mpsc::channel();
        let thread = thread::Builder::new()
            .name("ready-probe".to_owned())
            .spawn(move || probe_until_ready(&spec, &reaper, &events, &stopped))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread (after its current attempt) and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let _ = self.stop.send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn probe_until_ready(
    spec: &ProbeSpec,
    reaper: &Reaper,
    events: &Sender<ProbeEvent>,
    stopped: &Receiver<()>,
) {
    let mut thresholds = Thresholds::new(spec.success_threshold, spec.failure_threshold);
    let mut wait = spec.initial_delay;
    loop {
        match stopped.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let started = Instant::now();
        let outcome = run_once(&spec.action, spec.timeout, reaper);
        if let Outcome::Failure(reason) = &outcome
            && events.send(ProbeEvent::Failed(reason.clone())).is_err()
        {
            return;
        }
        if let Some(transition) = thresholds.record(&outcome) {
            let ready = transition == Transition::Ready;
            if events.send(ProbeEvent::Transition(transition)).is_err() || ready {
                return;
            }
        }
        wait = spec.period.saturating_sub(started.elapsed());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::TcpListener;
    use std::sync::PoisonError;

    use serde_json::json;

    use super::*;
    use crate::reaper::CHILDREN_LOCK;

    fn spec(probe: serde_json::Value) -> Result<ProbeSpec, ProbeSpecError> {
        ProbeSpec::from_json(&probe.to_string())
    }

    #[test]
    fn kubelet_defaults_apply_and_timing_fields_are_honoured() {
        let s = spec(json!({"tcpSocket": {"port": 6379}})).unwrap();
        assert_eq!(
            s.action,
            Action::Tcp {
                addr: "127.0.0.1:6379".parse().unwrap()
            }
        );
        assert_eq!(
            (s.initial_delay, s.period, s.timeout),
            (
                Duration::ZERO,
                Duration::from_secs(10),
                Duration::from_secs(1)
            )
        );
        assert_eq!((s.success_threshold, s.failure_threshold), (1, 3));
        let s = spec(
            json!({"httpGet": {"port": "8080", "path": "health", "host": "::1",
            "httpHeaders": [{"name": "X-A", "value": "b"}]},
            "initialDelaySeconds": 4, "periodSeconds": 2, "timeoutSeconds": 3,
            "successThreshold": 2, "failureThreshold": 5}),
        )
        .unwrap();
        assert_eq!(
            s.action,
            Action::Http {
                addr: "[::1]:8080".parse().unwrap(),
                host: "[::1]:8080".to_owned(),
                path: "/health".to_owned(),
                headers: vec![("X-A".to_owned(), "b".to_owned())],
            }
        );
        assert_eq!(
            (s.initial_delay, s.period, s.timeout),
            (
                Duration::from_secs(4),
                Duration::from_secs(2),
                Duration::from_secs(3)
            )
        );
        assert_eq!((s.success_threshold, s.failure_threshold), (2, 5));
        let s = spec(json!({"grpc": {"port": 50051}})).unwrap();
        assert_eq!(
            s.action,
            Action::Grpc {
                addr: "127.0.0.1:50051".parse().unwrap(),
                service: String::new()
            }
        );
    }

    #[test]
    fn probes_this_runner_cannot_run_are_refused_with_the_reason() {
        let cases = [
            (json!({}), ProbeSpecError::Handlers(0)),
            (
                json!({"tcpSocket": {"port": 1}, "exec": {"command": ["true"]}}),
                ProbeSpecError::Handlers(2),
            ),
            (
                json!({"httpGet": {"port": "http"}}),
                ProbeSpecError::Port {
                    handler: "httpGet",
                    port: "http".to_owned(),
                },
            ),
            (
                json!({"tcpSocket": {"port": 80, "host": "redis.default.svc"}}),
                ProbeSpecError::Host {
                    handler: "tcpSocket",
                    host: "redis.default.svc".to_owned(),
                },
            ),
            (
                json!({"httpGet": {"port": 443, "scheme": "HTTPS"}}),
                ProbeSpecError::Scheme("HTTPS".to_owned()),
            ),
            (
                json!({"exec": {"command": []}}),
                ProbeSpecError::EmptyCommand,
            ),
            (
                json!({"exec": {"command": ["true"]}, "periodSeconds": 0}),
                ProbeSpecError::Timing {
                    field: "periodSeconds",
                    value: 0,
                    min: 1,
                },
            ),
            (
                json!({"exec": {"command": ["true"]}, "failureThreshold": -1}),
                ProbeSpecError::Timing {
                    field: "failureThreshold",
                    value: -1,
                    min: 1,
                },
            ),
        ];
        for (probe, expected) in cases {
            assert_eq!(spec(probe.clone()), Err(expected), "{probe}");
        }
        assert!(matches!(
            ProbeSpec::from_json("not json"),
            Err(ProbeSpecError::Json(_))
        ));
    }

    /// A one-shot HTTP server answering every connection with `status`.
    fn http_server(status: u16) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut buf = [0_u8; 1024];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = stream.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                }
                let request = String::from_utf8_lossy(&seen);
                assert!(request.starts_with("GET /ready HTTP/1.1\r\n"), "{request}");
                assert!(request.contains("\r\nX-Probe: yes\r\n"), "{request}");
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        addr
    }

    fn bound_not_listening() -> (std::os::fd::OwnedFd, SocketAddr) {
        use nix::sys::socket::{
            AddressFamily, SockFlag, SockType, SockaddrIn, bind, getsockname, socket,
        };
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::new(127, 0, 0, 1, 0),
        )
        .unwrap();
        let local: SockaddrIn = getsockname(std::os::fd::AsRawFd::as_raw_fd(&fd)).unwrap();
        (fd, SocketAddr::V4(local.into()))
    }

    fn http(addr: SocketAddr) -> Action {
        Action::Http {
            addr,
            host: addr.to_string(),
            path: "/ready".to_owned(),
            headers: vec![("X-Probe".to_owned(), "yes".to_owned())],
        }
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn http_get_passes_on_2xx_and_3xx_and_fails_otherwise() {
        let reaper = Reaper::new();
        for (status, ok) in [(200, true), (302, true), (404, false), (503, false)] {
            let outcome = run_once(&http(http_server(status)), SECOND, &reaper);
            assert_eq!(outcome == Outcome::Success, ok, "{status}: {outcome:?}");
            if let Outcome::Failure(reason) = outcome {
                assert!(reason.contains(&format!("HTTP {status}")), "{reason}");
            }
        }
    }

    #[test]
    fn http_get_times_out_on_a_server_that_never_answers() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // Accepted by the kernel (backlog), never read nor answered.
        let outcome = run_once(&http(addr), SECOND, &Reaper::new());
        let Outcome::Failure(reason) = outcome else {
            panic!("a silent server passed");
        };
        assert!(
            reason.contains("timed out") || reason.contains("Resource temporarily unavailable"),
            "{reason}"
        );
        drop(listener);
    }

    #[test]
    fn tcp_socket_passes_only_while_something_listens() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reaper = Reaper::new();
        assert_eq!(
            run_once(&Action::Tcp { addr }, SECOND, &reaper),
            Outcome::Success
        );
        // A bound socket that does not listen keeps the port ours and refuses connections.
        let closed = bound_not_listening();
        let addr = closed.1;
        let Outcome::Failure(reason) = run_once(&Action::Tcp { addr }, SECOND, &reaper) else {
            panic!("a closed port passed");
        };
        assert!(reason.contains("refused"), "{reason}");
    }

    #[test]
    fn exec_passes_on_status_zero_fails_otherwise_and_is_killed_at_its_timeout() {
        let _serial = CHILDREN_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let reaper = Reaper::new();
        let sh = |script: &str| Action::Exec {
            command: vec!["/bin/sh".to_owned(), "-c".to_owned(), script.to_owned()],
        };
        assert_eq!(run_once(&sh("exit 0"), SECOND, &reaper), Outcome::Success);
        assert_eq!(
            run_once(&sh("exit 3"), SECOND, &reaper),
            Outcome::Failure("/bin/sh exited with status 3".to_owned())
        );
        assert_eq!(
            run_once(&sh("exec sleep 30"), SECOND, &reaper),
            Outcome::Failure("/bin/sh timed out after 1s".to_owned())
        );
        let missing = Action::Exec {
            command: vec!["/does/not/exist".to_owned()],
        };
        let Outcome::Failure(reason) = run_once(&missing, SECOND, &reaper) else {
            panic!("a missing program passed");
        };
        assert!(reason.starts_with("run /does/not/exist:"), "{reason}");
    }

    #[test]
    fn success_threshold_needs_consecutive_successes() {
        let fail = Outcome::Failure("no".to_owned());
        let mut t = Thresholds::new(3, 3);
        assert_eq!(t.record(&Outcome::Success), None);
        assert_eq!(t.record(&Outcome::Success), None);
        assert_eq!(t.record(&fail), None, "one failure resets the count");
        assert_eq!(t.record(&Outcome::Success), None);
        assert_eq!(t.record(&Outcome::Success), None);
        assert_eq!(t.record(&Outcome::Success), Some(Transition::Ready));
        assert_eq!(t.record(&Outcome::Success), None, "reported once");
    }

    #[test]
    fn failure_threshold_turns_a_ready_container_not_ready_once() {
        let fail = |r: &str| Outcome::Failure(r.to_owned());
        let mut t = Thresholds::new(1, 2);
        assert_eq!(t.record(&Outcome::Success), Some(Transition::Ready));
        assert_eq!(t.record(&fail("a")), None);
        assert_eq!(
            t.record(&fail("b")),
            Some(Transition::NotReady {
                failures: 2,
                reason: "b".to_owned()
            })
        );
        assert_eq!(t.record(&fail("c")), None, "reported once");
        assert_eq!(t.record(&Outcome::Success), Some(Transition::Ready));
        // Before any verdict, failures below the threshold say nothing.
        let mut fresh = Thresholds::new(1, 3);
        assert_eq!(fresh.record(&fail("x")), None);
        assert_eq!(fresh.record(&fail("x")), None);
        assert!(matches!(
            fresh.record(&fail("x")),
            Some(Transition::NotReady { failures: 3, .. })
        ));
    }

    #[test]
    fn the_runner_reports_failures_then_ready_and_stops() {
        let _serial = CHILDREN_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("loaded");
        let spec = ProbeSpec {
            action: Action::Exec {
                command: vec![
                    "/bin/sh".to_owned(),
                    "-c".to_owned(),
                    format!("test -f {}", flag.display()),
                ],
            },
            initial_delay: Duration::ZERO,
            period: SECOND,
            timeout: SECOND,
            success_threshold: 1,
            failure_threshold: 1,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let runner = Runner::start(spec, Arc::new(Reaper::new()), tx).unwrap();
        let first = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(matches!(first, ProbeEvent::Failed(_)), "{first:?}");
        let second = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            matches!(second, ProbeEvent::Transition(Transition::NotReady { .. })),
            "{second:?}"
        );
        // The server comes up: an attempt makes the container ready and the runner ends.
        std::fs::write(&flag, "").unwrap();
        let events: Vec<ProbeEvent> = rx.iter().collect();
        assert_eq!(
            events.last(),
            Some(&ProbeEvent::Transition(Transition::Ready)),
            "{events:?}"
        );
        runner.stop();
    }
}
