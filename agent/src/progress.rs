//! Progress of long operations (a dump, the hashing of a capture, a restore's verification):
//! bytes done against a total, sampled by a watcher thread every tick and handed to a sink (the
//! command line's terminal line, the cluster agent's gauges and Checkpoint status), and logged
//! every few seconds, so a checkpoint of a 70 GB worker is not silent for minutes.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use warmstart_shared::v1alpha1::human_size;

/// How often a progress line is logged.
pub const LOG_EVERY: Duration = Duration::from_secs(5);
/// How often the sink is told.
pub const TICK: Duration = Duration::from_millis(500);

/// The operation a phase belongs to (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    /// A checkpoint: dump, then hashing.
    Checkpoint,
    /// A restore: verification of the artifact (its page images beside CRIU).
    Restore,
    /// `inspect --verify`: verification of the artifact.
    Inspect,
}

impl Operation {
    /// `checkpoint` or `restore`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Checkpoint => "checkpoint",
            Self::Restore => "restore",
            Self::Inspect => "inspect",
        }
    }
}

/// Where a phase stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The operation.
    pub operation: Operation,
    /// What the phase does (`dumping`, `hashing`, `verifying`).
    pub verb: &'static str,
    /// Bytes done.
    pub done: u64,
    /// Bytes expected (an estimate for a dump: the tree's resident memory).
    pub total: u64,
    /// Since the phase started.
    pub elapsed: Duration,
}

impl Snapshot {
    /// Bytes per second so far.
    pub fn rate(&self) -> u64 {
        let secs = self.elapsed.as_secs_f64().max(1e-3);
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let rate = (self.done as f64 / secs) as u64;
        rate
    }

    /// `dumping 41.2 GiB/70.0 GiB at 1.9 GiB/s`.
    pub fn line(&self) -> String {
        format!(
            "{} {}/{} at {}/s",
            self.verb,
            human_size(self.done),
            human_size(self.total),
            human_size(self.rate())
        )
    }
}

/// Where snapshots go; called from the watcher thread.
pub type Sink = Arc<dyn Fn(&Snapshot) + Send + Sync>;

/// A byte counter for phases that count as they go (hashing, verification).
#[derive(Debug, Default)]
pub struct Meter {
    done: AtomicU64,
    total: AtomicU64,
}

impl Meter {
    /// Adds `bytes` done.
    pub fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Sets the bytes expected.
    pub fn set_total(&self, bytes: u64) {
        self.total.store(bytes, Ordering::Relaxed);
    }

    /// `(done, total)`.
    pub fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }
}

/// Starts the watches of one operation's phases. Cheap to clone.
#[derive(Clone)]
pub struct Reporter {
    sink: Option<Sink>,
    tick: Duration,
    log_every: Duration,
}

impl Default for Reporter {
    /// Logs every [`LOG_EVERY`], no sink.
    fn default() -> Self {
        Self {
            sink: None,
            tick: TICK,
            log_every: LOG_EVERY,
        }
    }
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("sink", &self.sink.is_some())
            .field("tick", &self.tick)
            .field("log_every", &self.log_every)
            .finish()
    }
}

impl Reporter {
    /// A reporter telling `sink` every [`TICK`] and logging every [`LOG_EVERY`].
    pub fn new(sink: Sink) -> Self {
        Self {
            sink: Some(sink),
            ..Self::default()
        }
    }

    /// The same with other intervals (tests).
    #[must_use]
    pub fn every(self, tick: Duration, log_every: Duration) -> Self {
        Self {
            tick,
            log_every,
            ..self
        }
    }

    /// Watches a phase whose `(done, total)` `probe` measures, until the watch is dropped.
    pub fn watch(
        &self,
        operation: Operation,
        verb: &'static str,
        probe: impl Fn() -> (u64, u64) + Send + 'static,
    ) -> Watch {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        // The thread logs where its caller does: the caller's subscriber, within its span.
        let dispatch = tracing::dispatcher::get_default(Clone::clone);
        let span = tracing::Span::current();
        let reporter = self.clone();
        let thread = std::thread::Builder::new()
            .name(format!("{verb}-progress"))
            .spawn(move || {
                let _dispatch = tracing::dispatcher::set_default(&dispatch);
                let _entered = span.enter();
                let started = Instant::now();
                let mut next_log = started + reporter.log_every;
                let snapshot = || {
                    let (done, total) = probe();
                    Snapshot {
                        operation,
                        verb,
                        done,
                        total,
                        elapsed: started.elapsed(),
                    }
                };
                loop {
                    match stopped.recv_timeout(reporter.tick) {
                        Err(RecvTimeoutError::Timeout) => {}
                        // Dropped: the phase ended; the sink hears where it ended.
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                            if let Some(sink) = &reporter.sink {
                                sink(&snapshot());
                            }
                            return;
                        }
                    }
                    let now = snapshot();
                    if let Some(sink) = &reporter.sink {
                        sink(&now);
                    }
                    if Instant::now() >= next_log {
                        next_log += reporter.log_every;
                        tracing::info!(
                            operation = operation.as_str(),
                            done_bytes = now.done,
                            total_bytes = now.total,
                            bytes_per_second = now.rate(),
                            "{}",
                            now.line()
                        );
                    }
                }
            });
        match thread {
            Ok(thread) => Watch {
                stop: Some(stop),
                thread: Some(thread),
            },
            Err(err) => {
                tracing::debug!(error = %err, "no thread to report progress");
                Watch {
                    stop: None,
                    thread: None,
                }
            }
        }
    }

    /// Watches a phase counted by the returned [`Meter`] (its total set now or later).
    pub fn meter(&self, operation: Operation, verb: &'static str) -> (Arc<Meter>, Watch) {
        let meter = Arc::new(Meter::default());
        let probe = meter.clone();
        (meter, self.watch(operation, verb, move || probe.get()))
    }
}

/// A phase being watched; the watch stops when dropped.
#[derive(Debug)]
pub struct Watch {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The command line's progress line on a terminal: one line, rewritten in place (`\r`, then
/// erase to the end of the line), at most every `every`; cleared before the results print.
#[derive(Debug)]
pub struct TerminalLine {
    every: Duration,
    state: Mutex<LineState>,
}

#[derive(Debug, Default)]
struct LineState {
    last: Option<Instant>,
    shown: bool,
}

/// Rewrites the current terminal line.
const REWRITE: &str = "\r\x1b[2K";

impl TerminalLine {
    /// A line rewritten at most every `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new(LineState::default()),
        }
    }

    /// What to write for `snapshot` now (empty when too soon after the last).
    pub fn render(&self, snapshot: &Snapshot) -> String {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if state
            .last
            .is_some_and(|l| now.duration_since(l) < self.every)
        {
            return String::new();
        }
        state.last = Some(now);
        state.shown = true;
        format!(
            "{REWRITE}{}: {}",
            snapshot.operation.as_str(),
            snapshot.line()
        )
    }

    /// What to write to leave the terminal line empty for what follows.
    pub fn clear(&self) -> &'static str {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if std::mem::take(&mut state.shown) {
            REWRITE
        } else {
            ""
        }
    }
}

/// The command line's progress line on standard error, cleared when dropped.
#[derive(Debug)]
pub struct StderrLine(Option<Arc<TerminalLine>>);

impl StderrLine {
    /// A reporter drawing the line when `shown`, else one that only logs.
    pub fn reporter(shown: bool) -> (Reporter, Self) {
        if !shown {
            return (Reporter::default(), Self(None));
        }
        let line = Arc::new(TerminalLine::new(TICK));
        let drawn = line.clone();
        let sink: Sink = Arc::new(move |s: &Snapshot| {
            let text = drawn.render(s);
            if !text.is_empty() {
                let mut err = std::io::stderr().lock();
                let _ = err.write_all(text.as_bytes());
                let _ = err.flush();
            }
        });
        (Reporter::new(sink), Self(Some(line)))
    }
}

impl Drop for StderrLine {
    fn drop(&mut self) {
        if let Some(line) = &self.0 {
            let _ = std::io::stderr().write_all(line.clear().as_bytes());
        }
    }
}

/// Whether the command line shows a progress line: on a terminal, and never with `--json`
/// (whose output is for programs).
pub fn shows_line(json: bool, stderr_is_terminal: bool) -> bool {
    !json && stderr_is_terminal
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(done: u64, total: u64, secs: u64) -> Snapshot {
        Snapshot {
            operation: Operation::Checkpoint,
            verb: "dumping",
            done,
            total,
            elapsed: Duration::from_secs(secs),
        }
    }

    #[test]
    fn a_line_says_how_far_of_how_much_at_what_rate() {
        assert_eq!(
            snapshot(41 << 30, 70 << 30, 20).line(),
            "dumping 41.0 GiB/70.0 GiB at 2.0 GiB/s"
        );
        assert_eq!(snapshot(0, 0, 0).line(), "dumping 0 B/0 B at 0 B/s");
    }

    #[test]
    fn a_watch_tells_its_sink_while_the_phase_runs_and_where_it_ended() {
        let seen: Arc<Mutex<Vec<Snapshot>>> = Arc::default();
        let into = seen.clone();
        let reporter = Reporter::new(Arc::new(move |s: &Snapshot| {
            into.lock().unwrap().push(s.clone());
        }))
        .every(Duration::from_millis(20), Duration::from_millis(50));
        let (meter, watch) = reporter.meter(Operation::Restore, "verifying");
        meter.set_total(300);
        meter.add(100);
        std::thread::sleep(Duration::from_millis(120));
        meter.add(200);
        let stopping = Instant::now();
        drop(watch);
        assert!(
            stopping.elapsed() < Duration::from_millis(500),
            "stops at once"
        );
        let seen = seen.lock().unwrap();
        assert!(seen.len() >= 3, "told while running: {seen:?}");
        assert!(seen.iter().any(|s| s.done == 100 && s.total == 300));
        let last = seen.last().unwrap();
        assert_eq!((last.done, last.total, last.verb), (300, 300, "verifying"));
        assert_eq!(last.operation, Operation::Restore);
    }

    /// Log output captured from the subscriber this test sets.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_watch_logs_how_far_of_how_much_at_what_rate_every_few_seconds() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("checkpoint", pod = "llama-0");
            let _entered = span.enter();
            let reporter =
                Reporter::default().every(Duration::from_millis(10), Duration::from_millis(40));
            let (meter, watch) = reporter.meter(Operation::Checkpoint, "hashing");
            meter.set_total(3 << 20);
            meter.add(1 << 20);
            std::thread::sleep(Duration::from_millis(150));
            drop(watch);
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("hashing 1.0 MiB/3.0 MiB at "))
            .collect();
        assert!(lines.len() >= 2, "a line every 40 ms:\n{text}");
        assert!(
            lines.iter().all(|l| l.contains("INFO")
                && l.contains("checkpoint{pod=\"llama-0\"}")
                && l.contains("done_bytes=1048576 total_bytes=3145728")),
            "{text}"
        );
    }

    #[test]
    fn the_terminal_line_is_rewritten_in_place_throttled_and_cleared() {
        let line = TerminalLine::new(Duration::from_secs(3600));
        assert_eq!(line.clear(), "", "nothing shown, nothing to clear");
        let first = line.render(&snapshot(1 << 30, 2 << 30, 1));
        assert_eq!(
            first,
            "\r\x1b[2Kcheckpoint: dumping 1.0 GiB/2.0 GiB at 1.0 GiB/s"
        );
        assert_eq!(line.render(&snapshot(2 << 30, 2 << 30, 2)), "", "throttled");
        assert_eq!(line.clear(), "\r\x1b[2K");
        assert_eq!(line.clear(), "");
    }

    #[test]
    fn a_line_shows_on_a_terminal_without_json_only() {
        assert!(shows_line(false, true));
        assert!(!shows_line(true, true));
        assert!(!shows_line(false, false));
    }
}
