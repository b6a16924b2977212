//! Progress lines for long operations (bytes done, rate), throttled, on standard error.

use std::io::Write;
use std::time::{Duration, Instant};

/// Reports bytes processed by one phase.
#[derive(Debug)]
pub struct Progress {
    phase: &'static str,
    done: u64,
    started: Instant,
    last: Instant,
    enabled: bool,
}

const EVERY: Duration = Duration::from_millis(500);
const MIB: f64 = 1024.0 * 1024.0;

impl Progress {
    /// A reporter for `phase`; `enabled: false` keeps it silent (JSON logs, tests).
    pub fn new(phase: &'static str, enabled: bool) -> Self {
        let now = Instant::now();
        Self {
            phase,
            done: 0,
            started: now,
            last: now,
            enabled,
        }
    }

    /// Adds `bytes`; prints a line at most every half second.
    pub fn add(&mut self, bytes: u64) {
        self.done += bytes;
        if self.enabled && self.last.elapsed() >= EVERY {
            self.last = Instant::now();
            self.print();
        }
    }

    /// Bytes so far.
    pub fn done(&self) -> u64 {
        self.done
    }

    /// `<phase>: <MiB> MiB (<rate> MiB/s)`.
    pub fn line(&self) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-6);
        #[allow(clippy::cast_precision_loss)]
        let mib = self.done as f64 / MIB;
        format!("{}: {mib:.1} MiB ({:.1} MiB/s)", self.phase, mib / secs)
    }

    /// Prints the final line (also done on drop, so a reporter moved into a callback still
    /// ends with one).
    pub fn finish(mut self) {
        self.finish_now();
    }

    fn finish_now(&mut self) {
        if std::mem::take(&mut self.enabled) {
            self.print();
        }
    }

    fn print(&self) {
        let _ = writeln!(std::io::stderr(), "{}", self.line());
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_bytes_and_formats_a_rate() {
        let mut p = Progress::new("hash", false);
        p.add(3 * 1024 * 1024);
        p.add(1024 * 1024);
        assert_eq!(p.done(), 4 * 1024 * 1024);
        assert!(p.line().starts_with("hash: 4.0 MiB ("), "{}", p.line());
        assert!(p.line().ends_with("MiB/s)"));
    }
}
