//! A stand-in inference worker for the end-to-end tests (docs/architecture.md "The two flows"):
//! it starts slowly like a model server, then plays the workload's side
//! of the checkpoint protocol while serving a tiny HTTP API.
//!
//! Start-up: allocates `--weights-mib` MiB of "weights", fills them deterministically (seeded
//! splitmix64, the same bytes on every run), computes their SHA-256, then warms up for
//! `--warmup-ms`. It binds its listener, writes the ready file (`$WARMSTART_READY_FILE`) and
//! serves HTTP on `--listen`:`--port`:
//!
//! - `GET /health` → `200 ok`
//! - `GET /state` → `{"weightsSha256", "weightsMib", "requests", "startedAt", "restored", "pid",
//!   "hostname"}`; `requests` counts every request, this one included
//! - `GET /weights/verify` → `{"weightsSha256", "matches"}`, the checksum recomputed over the
//!   weights in memory (proves that memory survived a restore)
//! - any other path → 404, another method → 405, a malformed request → 400
//!
//! Standby (`WARMSTART_RESTORE_STANDBY=1`, alias `SNAPSHOT_RESTORE_STANDBY`: a restore pod's
//! target): it loads nothing and waits. When `restore-complete` appears it is the init of the
//! restored worker: it forwards SIGTERM and SIGINT to it and exits with its status. When
//! `restore-failed` appears, or after `WARMSTART_RESTORE_TIMEOUT` (default 300 s) if it wins
//! the restore claim, it opens the startup gate (`restore-complete` saying `coldStart`) and
//! starts as below, a cold start. Losing the claim (a restore is in flight), it keeps waiting.
//!
//! Protocol loop (every 50 ms, on the main thread): once `$WARMSTART_CONTROL_DIR/restore-complete`
//! exists it is a restored copy (unless it cold-started): it says so (once) and keeps serving,
//! never looking at the done file again. Otherwise, once `$WARMSTART_SIGNAL_FILE` (`<hash>.done`) exists, the checkpoint
//! finished: exit 0 if it says `"success": true`, 1 otherwise (also when it stays unparsable for
//! two polls in a row). Without a signal file it serves until SIGTERM or SIGINT (exit 0).
//!
//! It must run as a static binary in an image without libc, so it resolves no names (no NSS):
//! addresses are parsed, never looked up. Every log line goes to stdout, timestamped and flushed.

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use warmstart_entrypoint::cli::parse_duration;
use warmstart_entrypoint::control::{Claim, ControlDir};
use warmstart_shared::names;
use warmstart_shared::restore_pod::DEFAULT_RESTORE_TIMEOUT_SECONDS;

/// One mebibyte.
const MIB: usize = 1 << 20;
/// Seed of the weights generator ("WARMSTAR"): every run produces the same weights.
const WEIGHTS_SEED: u64 = 0x5741_524d_5354_4152;
/// How often the protocol loop (and the warm-up) looks at the files and signals.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Signals are looked at every this many MiB while the weights load.
const LOAD_SIGNAL_CHECK_MIB: usize = 64;
/// Largest request head (request line and headers) accepted.
const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Read and write timeout of one HTTP connection.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long after `restore-complete` the restored worker has to show up as a child.
const ADOPT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default control directory, used when `$WARMSTART_CONTROL_DIR` is unset and it exists.
const DEFAULT_CONTROL_DIR: &str = names::MOUNT_CONTROL;

/// Env fallback of `--weights-mib`.
const ENV_WEIGHTS_MIB: &str = "WORKER_WEIGHTS_MIB";
/// Env fallback of `--warmup-ms`.
const ENV_WARMUP_MS: &str = "WORKER_WARMUP_MS";
/// Env fallback of `--port`.
const ENV_PORT: &str = "WORKER_PORT";
/// Env fallback of `--listen`.
const ENV_LISTEN: &str = "WORKER_LISTEN";

const USAGE: &str = "\
usage: warmstart-sample-worker [--weights-mib N] [--warmup-ms MS] [--port P] [--listen ADDR]

  --weights-mib N   MiB of deterministic weights to load (env WORKER_WEIGHTS_MIB, default 64)
  --warmup-ms MS    warm-up time after loading (env WORKER_WARMUP_MS, default 2000)
  --port P          HTTP port, 0 for any free one (env WORKER_PORT, default 8000)
  --listen ADDR     IP address to listen on, no host names (env WORKER_LISTEN, default 0.0.0.0)

Protocol env: WARMSTART_READY_FILE, WARMSTART_SIGNAL_FILE, WARMSTART_CONTROL_DIR,
WARMSTART_RESTORE_STANDBY, WARMSTART_RESTORE_TIMEOUT
(Dynamo/snapshot aliases accepted when the primary name is unset).
";

/// The worker's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Config {
    weights_mib: usize,
    warmup: Duration,
    listen: SocketAddr,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Command {
    Run(Config),
    Help,
}

/// Parses the flags (`--flag value` or `--flag=value`); a flag wins over its env fallback.
fn parse_args<I>(args: I, env: &dyn Fn(&str) -> Option<String>) -> Result<Command, String>
where
    I: IntoIterator<Item = String>,
{
    let mut weights_mib = env(ENV_WEIGHTS_MIB).map(|v| (ENV_WEIGHTS_MIB, v));
    let mut warmup_ms = env(ENV_WARMUP_MS).map(|v| (ENV_WARMUP_MS, v));
    let mut port = env(ENV_PORT).map(|v| (ENV_PORT, v));
    let mut listen = env(ENV_LISTEN).map(|v| (ENV_LISTEN, v));

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_owned(), Some(value.into())),
            _ => (arg, None),
        };
        let (name, slot) = match flag.as_str() {
            "--weights-mib" => ("--weights-mib", &mut weights_mib),
            "--warmup-ms" => ("--warmup-ms", &mut warmup_ms),
            "--port" => ("--port", &mut port),
            "--listen" => ("--listen", &mut listen),
            other => return Err(format!("unknown argument {other:?}")),
        };
        let value = match inline {
            Some(value) => value,
            None => args.next().ok_or_else(|| format!("{name} needs a value"))?,
        };
        *slot = Some((name, value));
    }

    let weights_mib = parse_value::<usize>(weights_mib)?.unwrap_or(64);
    if weights_mib.checked_mul(MIB).is_none() {
        return Err(format!("--weights-mib {weights_mib} is too large"));
    }
    let warmup_ms = parse_value::<u64>(warmup_ms)?.unwrap_or(2000);
    let port = parse_value::<u16>(port)?.unwrap_or(8000);
    let ip = parse_value::<IpAddr>(listen)?.unwrap_or(IpAddr::from([0, 0, 0, 0]));
    Ok(Command::Run(Config {
        weights_mib,
        warmup: Duration::from_millis(warmup_ms),
        listen: SocketAddr::new(ip, port),
    }))
}

/// Parses one setting, naming where it came from when it is invalid.
fn parse_value<T>(value: Option<(&str, String)>) -> Result<Option<T>, String>
where
    T: std::str::FromStr,
    T::Err: fmt::Display,
{
    value
        .map(|(origin, raw)| {
            raw.trim()
                .parse::<T>()
                .map_err(|e| format!("invalid {origin} {raw:?}: {e}"))
        })
        .transpose()
}

/// The first of `names` that is set in the environment (primary name first, then aliases).
fn env_path(names: &[&str]) -> Option<PathBuf> {
    names
        .iter()
        .find_map(|name| std::env::var_os(name).filter(|v| !v.is_empty()))
        .map(PathBuf::from)
}

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

/// splitmix64: small, fast and fully deterministic.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Fills `buf` with the generator's output, 8 little-endian bytes per step (a trailing partial
/// word takes the first bytes of one more step). Filling in pieces of multiples of 8 bytes gives
/// the same bytes as filling at once.
fn fill_weights(buf: &mut [u8], rng: &mut SplitMix64) {
    let mut words = buf.chunks_exact_mut(8);
    for word in &mut words {
        word.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let rest = words.into_remainder();
    if !rest.is_empty() {
        let bytes = rng.next_u64().to_le_bytes();
        rest.copy_from_slice(&bytes[..rest.len()]);
    }
}

/// Lowercase hex SHA-256 of the weights.
fn weights_checksum(weights: &[u8]) -> String {
    hex::encode(Sha256::digest(weights))
}

/// Allocates and fills `mib` MiB of weights, hashing them on the way. `interrupted` is asked
/// every [`LOAD_SIGNAL_CHECK_MIB`] MiB; `Ok(None)` when it said yes.
fn load_weights(
    mib: usize,
    seed: u64,
    interrupted: &mut dyn FnMut() -> bool,
) -> anyhow::Result<Option<(Vec<u8>, String)>> {
    let len = mib
        .checked_mul(MIB)
        .context("weights size overflows usize")?;
    let mut weights = Vec::new();
    weights
        .try_reserve_exact(len)
        .with_context(|| format!("cannot allocate {mib} MiB of weights"))?;
    let mut rng = SplitMix64(seed);
    let mut hasher = Sha256::new();
    for i in 0..mib {
        if i % LOAD_SIGNAL_CHECK_MIB == 0 && interrupted() {
            return Ok(None);
        }
        let start = weights.len();
        weights.resize(start + MIB, 0);
        let chunk = &mut weights[start..];
        fill_weights(chunk, &mut rng);
        hasher.update(&*chunk);
    }
    Ok(Some((weights, hex::encode(hasher.finalize()))))
}

// ---------------------------------------------------------------------------------------------
// Logging
// ---------------------------------------------------------------------------------------------

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// RFC 3339 UTC timestamp with milliseconds, e.g. `2023-11-14T22:13:20.000Z`.
fn format_timestamp(unix_ms: u64) -> String {
    let (secs, ms) = (unix_ms / 1000, unix_ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Days to civil date (Howard Hinnant's algorithm), for dates from 1970 on.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{ms:03}Z")
}

/// Writes one timestamped line to stdout and flushes it; a closed stdout is ignored.
fn log(message: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{} worker: {message}", format_timestamp(unix_ms()));
    let _ = out.flush();
}

macro_rules! log {
    ($($arg:tt)*) => {
        log(format_args!($($arg)*))
    };
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

/// A parsed request head (only what the worker needs).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Request {
    method: String,
    /// The path of the target, without the query string.
    path: String,
}

/// Why a request head is rejected (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum BadRequest {
    #[error("request head is not UTF-8")]
    NotUtf8,
    #[error("empty request")]
    Empty,
    #[error("malformed request line {0:?}")]
    RequestLine(String),
    #[error("unsupported protocol version {0:?}")]
    Version(String),
    #[error("malformed header line {0:?}")]
    Header(String),
    #[error("request head is incomplete or larger than {MAX_HEAD_BYTES} bytes")]
    Incomplete,
}

/// Parses a request head: the request line and the header lines, up to the blank line.
fn parse_request(head: &[u8]) -> Result<Request, BadRequest> {
    let text = std::str::from_utf8(head).map_err(|_| BadRequest::NotUtf8)?;
    let mut lines = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .peekable();
    let request_line = lines
        .next()
        .filter(|l| !l.is_empty())
        .ok_or(BadRequest::Empty)?;
    let parts: Vec<&str> = request_line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return Err(BadRequest::RequestLine(request_line.to_owned()));
    };
    let method_ok =
        !method.is_empty() && method.len() <= 16 && method.bytes().all(|b| b.is_ascii_uppercase());
    let target_ok = target.starts_with('/') && target.bytes().all(|b| b.is_ascii_graphic());
    if !method_ok || !target_ok {
        return Err(BadRequest::RequestLine(request_line.to_owned()));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(BadRequest::Version(version.to_owned()));
    }
    let mut terminated = false;
    while let Some(line) = lines.next() {
        if line.is_empty() {
            // The blank line ends the head only when a line break follows it.
            terminated = lines.peek().is_some();
            break;
        }
        let name = line.split_once(':').map(|(name, _)| name);
        if !name.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_graphic())) {
            return Err(BadRequest::Header(line.to_owned()));
        }
    }
    if !terminated {
        return Err(BadRequest::Incomplete);
    }
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    Ok(Request {
        method: method.to_owned(),
        path: path.to_owned(),
    })
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Health,
    State,
    VerifyWeights,
    NotFound,
    MethodNotAllowed,
}

fn route(request: &Request) -> Route {
    let known = match request.path.as_str() {
        "/health" => Route::Health,
        "/state" => Route::State,
        "/weights/verify" => Route::VerifyWeights,
        _ => return Route::NotFound,
    };
    if request.method == "GET" {
        known
    } else {
        Route::MethodNotAllowed
    }
}

/// An HTTP response, always sent with `Connection: close`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.to_owned(),
        }
    }

    fn json<T: Serialize>(value: &T) -> Self {
        match serde_json::to_string(value) {
            Ok(body) => Self {
                status: 200,
                content_type: "application/json",
                body,
            },
            Err(e) => Self::text(500, &format!("cannot serialise the response: {e}\n")),
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Internal Server Error",
        };
        let allow = if self.status == 405 {
            "Allow: GET\r\n"
        } else {
            ""
        };
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        out.extend_from_slice(self.body.as_bytes());
        out
    }
}

/// `GET /state`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct StateBody {
    weights_sha256: String,
    weights_mib: usize,
    requests: u64,
    started_at: u64,
    restored: bool,
    pid: i32,
    hostname: String,
}

/// `GET /weights/verify`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct VerifyBody {
    weights_sha256: String,
    matches: bool,
}

/// Everything the HTTP handlers and the protocol loop share.
#[derive(Debug)]
struct Worker {
    weights: Vec<u8>,
    weights_sha256: String,
    weights_mib: usize,
    started_at_ms: u64,
    requests: AtomicU64,
    restored: AtomicBool,
}

impl Worker {
    /// Answers one request head (counted, whatever it is).
    fn respond(&self, head: Result<Request, BadRequest>) -> Response {
        let requests = self.requests.fetch_add(1, Ordering::SeqCst) + 1;
        let request = match head {
            Ok(request) => request,
            Err(e) => return Response::text(400, &format!("bad request: {e}\n")),
        };
        match route(&request) {
            Route::Health => Response::text(200, "ok"),
            Route::State => Response::json(&StateBody {
                weights_sha256: self.weights_sha256.clone(),
                weights_mib: self.weights_mib,
                requests,
                started_at: self.started_at_ms,
                restored: self.restored.load(Ordering::SeqCst),
                // Asked on every request: after a restore these are the new pod's.
                pid: nix::unistd::getpid().as_raw(),
                hostname: nix::unistd::gethostname()
                    .map(OsString::into_string)
                    .map(|h| h.unwrap_or_else(|h| h.to_string_lossy().into_owned()))
                    .unwrap_or_default(),
            }),
            Route::VerifyWeights => {
                let actual = weights_checksum(&self.weights);
                let matches = actual == self.weights_sha256;
                Response::json(&VerifyBody {
                    weights_sha256: actual,
                    matches,
                })
            }
            Route::NotFound => Response::text(404, "not found\n"),
            Route::MethodNotAllowed => Response::text(405, "method not allowed\n"),
        }
    }
}

/// Reads a request head, up to and including the blank line. `Ok(None)` when the peer sent
/// nothing at all; `Err` (answered with 400) when it sent a partial or oversized head.
fn read_head(stream: &mut TcpStream) -> Result<Option<Vec<u8>>, BadRequest> {
    let mut head = Vec::new();
    let mut buf = [0_u8; 2048];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) if head.is_empty() => return Ok(None),
            Ok(0) | Err(_) => return Err(BadRequest::Incomplete),
            Ok(n) => n,
        };
        let searched_from = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        let tail = &head[searched_from..];
        let end = find(tail, b"\r\n\r\n")
            .map(|i| i + 4)
            .or_else(|| find(tail, b"\n\n").map(|i| i + 2));
        if let Some(end) = end {
            head.truncate(searched_from + end);
            return Ok(Some(head));
        }
        if head.len() > MAX_HEAD_BYTES {
            return Err(BadRequest::Incomplete);
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn handle_connection(mut stream: TcpStream, worker: &Worker) {
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let head = match read_head(&mut stream) {
        Ok(None) => return,
        Ok(Some(head)) => parse_request(&head),
        Err(e) => Err(e),
    };
    let response = worker.respond(head);
    let _ = stream.write_all(&response.to_bytes());
    let _ = stream.flush();
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Accepts connections forever, one thread per connection.
fn serve(listener: TcpListener, worker: Arc<Worker>) {
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                let worker = Arc::clone(&worker);
                let spawned = thread::Builder::new()
                    .name("http-conn".into())
                    .spawn(move || handle_connection(stream, &worker));
                if let Err(e) = spawned {
                    log!("cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                log!("accept failed: {e}");
                thread::sleep(POLL_INTERVAL);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Protocol
// ---------------------------------------------------------------------------------------------

/// Content of the `<hash>.done` signal file the agent writes when a checkpoint finished.
#[derive(Debug, Clone, PartialEq, Deserialize)]
struct DoneSignal {
    #[serde(default)]
    hash: Option<String>,
    #[serde(default)]
    location: Option<String>,
    success: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    timestamp: Option<serde_json::Value>,
}

fn parse_done(content: &str) -> Result<DoneSignal, String> {
    serde_json::from_str(content).map_err(|e| format!("invalid done file: {e}"))
}

/// The control directory: `$WARMSTART_CONTROL_DIR` (or its alias), else the default mount
/// path when it exists. Looked up on every poll: it may appear only in the restore pod.
fn control_dir(configured: Option<&Path>) -> Option<PathBuf> {
    match configured {
        Some(dir) => Some(dir.to_path_buf()),
        None => {
            let default = Path::new(DEFAULT_CONTROL_DIR);
            default.is_dir().then(|| default.to_path_buf())
        }
    }
}

/// Blocks SIGTERM and SIGINT (in every thread started afterwards too) and reads them from a
/// signalfd, so the main loop handles them without a signal handler. Also right for PID 1.
#[derive(Debug)]
struct Signals(SignalFd);

impl Signals {
    fn install() -> anyhow::Result<Self> {
        let mut set = SigSet::empty();
        set.add(Signal::SIGTERM);
        set.add(Signal::SIGINT);
        pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None)
            .context("cannot block SIGTERM/SIGINT")?;
        let fd = SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
            .context("cannot create a signalfd")?;
        Ok(Self(fd))
    }

    /// A pending SIGTERM or SIGINT, if any.
    fn pending(&self) -> Option<String> {
        self.pending_signal().map(|s| s.to_string())
    }

    /// The same, as a signal.
    fn pending_signal(&self) -> Option<Signal> {
        match self.0.read_signal() {
            Ok(Some(info)) => Signal::try_from(i32::try_from(info.ssi_signo).ok()?).ok(),
            Ok(None) | Err(_) => None,
        }
    }
}

/// Sleeps for `duration` in poll steps; the signal, when one arrived meanwhile.
fn sleep_unless_signalled(duration: Duration, signals: &Signals) -> Option<String> {
    let deadline = Instant::now() + duration;
    loop {
        if let Some(signal) = signals.pending() {
            return Some(signal);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        thread::sleep(left.min(POLL_INTERVAL));
    }
}

fn write_ready_file(path: &Path) -> anyhow::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    fs::write(path, "ready\n").with_context(|| format!("cannot write {}", path.display()))
}

fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let started_at_ms = unix_ms();
    let started = Instant::now();
    let signals = Signals::install()?;
    let ready_file = env_path(&[names::ENV_READY_FILE, names::ENV_DYN_READY_FILE]);
    let signal_file = env_path(&[names::ENV_SIGNAL_FILE, names::ENV_DYN_SIGNAL_FILE]);
    let configured_control = env_path(&[names::ENV_CONTROL_DIR, names::ENV_SNAPSHOT_CONTROL_DIR]);
    let mut cold_started = false;
    if let Some(timeout) = standby_settings()? {
        let control = control_dir(configured_control.as_deref())
            .context("standby needs the control directory (WARMSTART_CONTROL_DIR)")?;
        match standby(&ControlDir::new(control), timeout, &signals)? {
            Standby::Signalled(signal) => {
                log!("{signal} in standby, exiting");
                return Ok(ExitCode::SUCCESS);
            }
            Standby::Restored(code) => return Ok(ExitCode::from(code)),
            Standby::ColdStart(reason) => {
                log!("cold start: {reason}");
                cold_started = true;
            }
        }
    }
    log!(
        "starting pid={} weights={} MiB warmup={} ms listen={}",
        std::process::id(),
        config.weights_mib,
        config.warmup.as_millis(),
        config.listen
    );

    let load_started = Instant::now();
    let mut interrupted = None;
    let loaded = load_weights(config.weights_mib, WEIGHTS_SEED, &mut || {
        interrupted = signals.pending();
        interrupted.is_some()
    })?;
    let Some((weights, weights_sha256)) = loaded else {
        log!(
            "{} while loading weights, exiting",
            interrupted.unwrap_or_default()
        );
        return Ok(ExitCode::SUCCESS);
    };
    log!(
        "weights loaded {} MiB sha256={weights_sha256} in {:.2}s",
        config.weights_mib,
        load_started.elapsed().as_secs_f64()
    );

    if let Some(signal) = sleep_unless_signalled(config.warmup, &signals) {
        log!("{signal} during warm-up, exiting");
        return Ok(ExitCode::SUCCESS);
    }
    log!("warm-up done in {:.2}s", config.warmup.as_secs_f64());

    let listener = TcpListener::bind(config.listen)
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let local = listener.local_addr().context("listener has no address")?;
    let worker = Arc::new(Worker {
        weights,
        weights_sha256,
        weights_mib: config.weights_mib,
        started_at_ms,
        requests: AtomicU64::new(0),
        restored: AtomicBool::new(false),
    });
    {
        let worker = Arc::clone(&worker);
        thread::Builder::new()
            .name("http".into())
            .spawn(move || serve(listener, worker))
            .context("cannot start the HTTP thread")?;
    }
    log!("listening on {local}");
    if let Some(path) = &ready_file {
        write_ready_file(path)?;
        log!("wrote ready file {}", path.display());
    }
    log!("ready in {:.2}s", started.elapsed().as_secs_f64());

    let mut unparsable_before = false;
    loop {
        if let Some(signal) = signals.pending() {
            log!("{signal} received, exiting");
            return Ok(ExitCode::SUCCESS);
        }
        if worker.restored.load(Ordering::SeqCst) {
            thread::sleep(POLL_INTERVAL);
            continue;
        }
        // restore-complete first: a restored copy may still see the source pod's done file.
        // After a cold start it is the gate this worker opened itself, not a restore.
        if let Some(dir) = control_dir(configured_control.as_deref()).filter(|_| !cold_started) {
            let marker = dir.join(names::FILE_RESTORE_COMPLETE);
            if marker.exists() {
                worker.restored.store(true, Ordering::SeqCst);
                log!(
                    "restored, continuing ({} found, pid={})",
                    marker.display(),
                    std::process::id()
                );
                continue;
            }
        }
        if let Some(path) = &signal_file {
            let outcome = match fs::read_to_string(path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => Some(Err(format!("cannot read {}: {e}", path.display()))),
                Ok(content) => Some(parse_done(&content)),
            };
            match outcome {
                None => unparsable_before = false,
                Some(Ok(done)) => {
                    let hash = done.hash.as_deref().unwrap_or("?");
                    let location = done.location.as_deref().unwrap_or("?");
                    if done.success {
                        log!("checkpoint done hash={hash} location={location}, exiting 0");
                        return Ok(ExitCode::SUCCESS);
                    }
                    let error = done.error.as_deref().unwrap_or("no error given");
                    log!("checkpoint failed hash={hash}: {error}, exiting 1");
                    return Ok(ExitCode::FAILURE);
                }
                // Read twice before giving up, in case a writer did not write atomically.
                Some(Err(e)) if unparsable_before => {
                    log!("{} is unusable: {e}, exiting 1", path.display());
                    return Ok(ExitCode::FAILURE);
                }
                Some(Err(_)) => unparsable_before = true,
            }
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// The standby timeout when standby is asked for (`WARMSTART_RESTORE_STANDBY` or its alias).
fn standby_settings() -> anyhow::Result<Option<Duration>> {
    let flag = [
        names::ENV_RESTORE_STANDBY,
        names::ENV_SNAPSHOT_RESTORE_STANDBY,
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()));
    match flag.as_deref().map(str::trim) {
        None | Some("0" | "false") => Ok(None),
        Some("1" | "true") => {
            let timeout = match std::env::var(names::ENV_RESTORE_TIMEOUT) {
                Ok(value) if !value.is_empty() => {
                    parse_duration(names::ENV_RESTORE_TIMEOUT, &value)?
                }
                _ => Duration::from_secs(DEFAULT_RESTORE_TIMEOUT_SECONDS.unsigned_abs().into()),
            };
            Ok(Some(timeout))
        }
        Some(other) => anyhow::bail!(
            "{} is {other:?}, must be 1, true, 0 or false",
            names::ENV_RESTORE_STANDBY
        ),
    }
}

/// How standby ended.
#[derive(Debug)]
enum Standby {
    /// SIGTERM or SIGINT before anything happened.
    Signalled(Signal),
    /// The restored worker ended with this status.
    Restored(u8),
    /// Start as usual: no restore will come, and why.
    ColdStart(String),
}

/// Waits to be restored (README "The standby convention").
fn standby(control: &ControlDir, timeout: Duration, signals: &Signals) -> anyhow::Result<Standby> {
    log!(
        "standby, waiting for a restore in {} (timeout {}s)",
        control.path().display(),
        timeout.as_secs()
    );
    let started = Instant::now();
    let mut claim_lost = false;
    loop {
        if let Some(signal) = signals.pending_signal() {
            return Ok(Standby::Signalled(signal));
        }
        if control.restore_complete().is_some() {
            return supervise_restored(signals).map(Standby::Restored);
        }
        if let Some(reason) = control.restore_failed() {
            let reason = format!("restore failed: {reason}");
            // Nothing was restored: cold-start whoever holds the claim.
            control.claim_cold_start(std::process::id(), &reason)?;
            control.open_gate_cold(&reason)?;
            return Ok(Standby::ColdStart(reason));
        }
        if !claim_lost && started.elapsed() >= timeout {
            let reason = format!("no restore within {}s", timeout.as_secs());
            match control.claim_cold_start(std::process::id(), &reason)? {
                Claim::Won => {
                    control.open_gate_cold(&reason)?;
                    return Ok(Standby::ColdStart(reason));
                }
                Claim::Lost(_) => {
                    claim_lost = true;
                    log!("standby timed out but a restore is in flight, still waiting");
                }
            }
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// The init of a restored tree: its root is re-parented to this process (the placeholder's
/// PID 1). Forwards SIGTERM and SIGINT to it; its exit status (128 + signal when killed).
fn supervise_restored(signals: &Signals) -> anyhow::Result<u8> {
    let me = nix::unistd::getpid();
    let since = Instant::now();
    let root = loop {
        if let Some(root) = children_of(me.as_raw()).first() {
            break nix::unistd::Pid::from_raw(*root);
        }
        anyhow::ensure!(
            since.elapsed() < ADOPT_TIMEOUT,
            "restore complete but no restored process became a child of pid {me}"
        );
        thread::sleep(POLL_INTERVAL);
    };
    log!("restore complete, supervising the restored worker pid={root}");
    loop {
        if let Some(signal) = signals.pending_signal() {
            log!("{signal} received, forwarding to pid={root}");
            let _ = nix::sys::signal::kill(root, signal);
        }
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == root => {
                    log!("restored worker exited with {code}");
                    return Ok(u8::try_from(code & 0xff).unwrap_or(1));
                }
                Ok(WaitStatus::Signaled(pid, signal, _)) if pid == root => {
                    log!("restored worker killed by {signal}");
                    return Ok(128_u8.saturating_add(u8::try_from(signal as i32).unwrap_or(0)));
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => {}
            }
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Pids whose parent is `parent`, lowest first.
fn children_of(parent: i32) -> Vec<i32> {
    let mut children: Vec<i32> = fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = &stat[stat.rfind(')')? + 1..];
                    after.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect();
    children.sort_unstable();
    children
}

fn main() -> ExitCode {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let config = match parse_args(std::env::args().skip(1), &env) {
        Ok(Command::Run(config)) => config,
        Ok(Command::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("warmstart-sample-worker: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&config) {
        Ok(code) => code,
        Err(e) => {
            log!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn run_config(list: &[&str], env: &dyn Fn(&str) -> Option<String>) -> Config {
        match parse_args(args(list), env).unwrap() {
            Command::Run(config) => config,
            Command::Help => panic!("unexpected help"),
        }
    }

    #[test]
    fn defaults() {
        let config = run_config(&[], &no_env);
        assert_eq!(config.weights_mib, 64);
        assert_eq!(config.warmup, Duration::from_millis(2000));
        assert_eq!(config.listen, "0.0.0.0:8000".parse().unwrap());
    }

    #[test]
    fn flags_win_over_env_and_both_forms_parse() {
        let env = |name: &str| match name {
            ENV_WEIGHTS_MIB => Some("8".to_owned()),
            ENV_WARMUP_MS => Some("5".to_owned()),
            ENV_PORT => Some("9000".to_owned()),
            _ => None,
        };
        let config = run_config(&["--weights-mib=16", "--listen", "::1"], &env);
        assert_eq!(config.weights_mib, 16);
        assert_eq!(config.warmup, Duration::from_millis(5));
        assert_eq!(config.listen, "[::1]:9000".parse().unwrap());
    }

    #[test]
    fn bad_flags_are_errors() {
        for bad in [
            &["--port", "70000"][..],
            &["--port"],
            &["--listen", "localhost"],
            &["--weights-mib", "-1"],
            &["--frobnicate"],
            &["positional"],
        ] {
            assert!(parse_args(args(bad), &no_env).is_err(), "{bad:?}");
        }
        let env = |name: &str| (name == ENV_WARMUP_MS).then(|| "soon".to_owned());
        let err = parse_args(args(&[]), &env).unwrap_err();
        assert!(err.contains(ENV_WARMUP_MS), "{err}");
        assert_eq!(parse_args(args(&["-h"]), &no_env), Ok(Command::Help));
    }

    #[test]
    fn fill_is_deterministic_and_pinned() {
        let mut a = vec![0_u8; MIB];
        let mut b = vec![0_u8; MIB];
        fill_weights(&mut a, &mut SplitMix64(WEIGHTS_SEED));
        fill_weights(&mut b, &mut SplitMix64(WEIGHTS_SEED));
        assert_eq!(a, b);
        // Golden value: changing the generator or the seed changes every stored checkpoint's
        // expected checksum.
        assert_eq!(
            weights_checksum(&a),
            "2b91d7f3d41342caca84b4600f20a5e49b33593cef9b6c0b16ed3de1225996c1"
        );
        let mut other = vec![0_u8; MIB];
        fill_weights(&mut other, &mut SplitMix64(WEIGHTS_SEED + 1));
        assert_ne!(weights_checksum(&a), weights_checksum(&other));
        // The reference splitmix64 sequence for seed 0.
        assert_eq!(SplitMix64(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn chunked_load_matches_a_single_fill() {
        let (weights, sha) = load_weights(3, WEIGHTS_SEED, &mut || false)
            .unwrap()
            .unwrap();
        let mut whole = vec![0_u8; 3 * MIB];
        fill_weights(&mut whole, &mut SplitMix64(WEIGHTS_SEED));
        assert_eq!(weights, whole);
        assert_eq!(sha, weights_checksum(&whole));
        assert!(load_weights(1, 1, &mut || true).unwrap().is_none());
        let (empty, sha) = load_weights(0, 1, &mut || false).unwrap().unwrap();
        assert!(empty.is_empty());
        assert_eq!(sha, weights_checksum(&[]));
    }

    #[test]
    fn partial_words_are_filled() {
        let mut odd = [0_u8; 11];
        fill_weights(&mut odd, &mut SplitMix64(7));
        let mut rng = SplitMix64(7);
        let first = rng.next_u64().to_le_bytes();
        let second = rng.next_u64().to_le_bytes();
        assert_eq!(&odd[..8], &first);
        assert_eq!(&odd[8..], &second[..3]);
    }

    #[test]
    fn timestamps() {
        assert_eq!(format_timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format_timestamp(951_782_400_123),
            "2000-02-29T00:00:00.123Z"
        );
        assert_eq!(
            format_timestamp(1_700_000_000_000),
            "2023-11-14T22:13:20.000Z"
        );
        assert_eq!(
            format_timestamp(4_107_542_399_999),
            "2100-02-28T23:59:59.999Z"
        );
    }

    #[test]
    fn parses_good_requests() {
        let req =
            parse_request(b"GET /state?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n").unwrap();
        assert_eq!(
            req,
            Request {
                method: "GET".into(),
                path: "/state".into()
            }
        );
        assert_eq!(route(&req), Route::State);
        let req = parse_request(b"GET /health HTTP/1.0\n\n").unwrap();
        assert_eq!(route(&req), Route::Health);
        let req = parse_request(b"GET /weights/verify HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(route(&req), Route::VerifyWeights);
    }

    #[test]
    fn routes_unknown_paths_and_methods() {
        let req = parse_request(b"GET /nope HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(route(&req), Route::NotFound);
        let req = parse_request(b"POST /nope HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(route(&req), Route::NotFound);
        let req = parse_request(b"POST /state HTTP/1.1\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert_eq!(route(&req), Route::MethodNotAllowed);
        let req = parse_request(b"GET /health/ HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(route(&req), Route::NotFound);
    }

    #[test]
    fn rejects_malformed_requests() {
        let cases: &[(&[u8], BadRequest)] = &[
            (b"", BadRequest::Empty),
            (b"\r\n\r\n", BadRequest::Empty),
            (b"\xff\xfe\r\n\r\n", BadRequest::NotUtf8),
            (b"GET /\r\n\r\n", BadRequest::RequestLine("GET /".into())),
            (
                b"GET  / HTTP/1.1\r\n\r\n",
                BadRequest::RequestLine("GET  / HTTP/1.1".into()),
            ),
            (
                b"get / HTTP/1.1\r\n\r\n",
                BadRequest::RequestLine("get / HTTP/1.1".into()),
            ),
            (
                b"GET state HTTP/1.1\r\n\r\n",
                BadRequest::RequestLine("GET state HTTP/1.1".into()),
            ),
            (
                b"GET / HTTP/2.0\r\n\r\n",
                BadRequest::Version("HTTP/2.0".into()),
            ),
            (
                b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
                BadRequest::Header("no colon".into()),
            ),
            (
                b"GET / HTTP/1.1\r\n: empty\r\n\r\n",
                BadRequest::Header(": empty".into()),
            ),
            (b"GET / HTTP/1.1\r\nHost: a\r\n", BadRequest::Incomplete),
        ];
        for (input, expected) in cases {
            assert_eq!(
                parse_request(input).as_ref(),
                Err(expected),
                "{:?}",
                String::from_utf8_lossy(input)
            );
        }
    }

    fn worker() -> Worker {
        let (weights, weights_sha256) = load_weights(1, WEIGHTS_SEED, &mut || false)
            .unwrap()
            .unwrap();
        Worker {
            weights,
            weights_sha256,
            weights_mib: 1,
            started_at_ms: 42,
            requests: AtomicU64::new(0),
            restored: AtomicBool::new(false),
        }
    }

    #[test]
    fn responses_count_every_request() {
        let worker = worker();
        assert_eq!(worker.respond(Err(BadRequest::Empty)).status, 400);
        let get = |path: &str| Request {
            method: "GET".into(),
            path: path.into(),
        };
        assert_eq!(worker.respond(Ok(get("/nope"))).status, 404);
        let health = worker.respond(Ok(get("/health")));
        assert_eq!((health.status, health.body.as_str()), (200, "ok"));
        let state = worker.respond(Ok(get("/state")));
        assert_eq!(state.status, 200);
        let state: serde_json::Value = serde_json::from_str(&state.body).unwrap();
        assert_eq!(state["requests"], 4);
        assert_eq!(state["weightsMib"], 1);
        assert_eq!(state["startedAt"], 42);
        assert_eq!(state["restored"], false);
        assert_eq!(state["weightsSha256"], worker.weights_sha256.as_str());
        assert_eq!(state["pid"], nix::unistd::getpid().as_raw());
        assert!(state["hostname"].is_string());
        let verify = worker.respond(Ok(get("/weights/verify")));
        let verify: serde_json::Value = serde_json::from_str(&verify.body).unwrap();
        assert_eq!(verify["matches"], true);
        assert_eq!(verify["weightsSha256"], worker.weights_sha256.as_str());
        let bytes = Response::text(405, "x").to_bytes();
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{text}"
        );
        assert!(
            text.contains("Allow: GET\r\n") && text.ends_with("\r\n\r\nx"),
            "{text}"
        );
    }

    #[test]
    fn parses_done_files() {
        let ok = parse_done(
            r#"{"hash":"96429b2725761a09","location":"/ckpt/ns/96429b2725761a09","success":true,"error":null,"timestamp":"2025-01-01T00:00:00Z"}"#,
        )
        .unwrap();
        assert!(ok.success);
        assert_eq!(ok.hash.as_deref(), Some("96429b2725761a09"));
        assert_eq!(ok.location.as_deref(), Some("/ckpt/ns/96429b2725761a09"));
        assert_eq!(ok.error, None);
        let failed =
            parse_done(r#"{"hash":"h","success":false,"error":"criu dump failed","timestamp":1}"#)
                .unwrap();
        assert!(!failed.success);
        assert_eq!(failed.error.as_deref(), Some("criu dump failed"));
        for garbage in ["", "not json", "{}", r#"{"success":"yes"}"#, "[true]"] {
            assert!(parse_done(garbage).is_err(), "{garbage:?}");
        }
    }

    #[test]
    fn control_dir_prefers_the_configured_one() {
        let dir = Path::new("/somewhere/control");
        assert_eq!(control_dir(Some(dir)), Some(dir.to_path_buf()));
        assert_eq!(
            control_dir(None).is_some(),
            Path::new(DEFAULT_CONTROL_DIR).is_dir()
        );
    }
}
