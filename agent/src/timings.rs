//! Per-phase durations of one operation, reported in logs, manifests and the CLI's table. Most
//! phases run one after another; a phase that ran beside them (page verification beside CRIU's
//! restore) is recorded as such, shown marked and left out of the total, so the total is the
//! operation's wall-clock time, not the sum of everything measured.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Ordered phase timings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    phases: Vec<(String, Duration)>,
    /// Phases that ran beside the others.
    beside: BTreeSet<String>,
}

impl Timings {
    /// Runs `f` as phase `name` and records how long it took, even when it fails.
    pub fn measure<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let elapsed = start.elapsed();
        tracing::debug!(
            phase = name,
            seconds = elapsed.as_secs_f64(),
            "phase finished"
        );
        self.phases.push((name.to_owned(), elapsed));
        out
    }

    /// Records a phase measured elsewhere.
    pub fn record(&mut self, name: &str, elapsed: Duration) {
        self.phases.push((name.to_owned(), elapsed));
    }

    /// Records a phase that ran beside the others (not part of the total).
    pub fn record_beside(&mut self, name: &str, elapsed: Duration) {
        self.beside.insert(name.to_owned());
        self.record(name, elapsed);
    }

    /// The phases in order, those that ran beside the others included.
    pub fn phases(&self) -> &[(String, Duration)] {
        &self.phases
    }

    /// Whether phase `name` ran beside the others.
    pub fn is_beside(&self, name: &str) -> bool {
        self.beside.contains(name)
    }

    /// The phases that ran beside the others, in order (`besidePhases` of the command line's
    /// JSON: their seconds are in `timings` but not in `totalSeconds`).
    pub fn beside_phases(&self) -> Vec<&str> {
        self.phases
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| self.is_beside(n))
            .collect()
    }

    /// The wall-clock time: the sum of the phases that ran one after another.
    pub fn total(&self) -> Duration {
        self.phases
            .iter()
            .filter(|(n, _)| !self.is_beside(n))
            .map(|(_, d)| *d)
            .sum()
    }

    /// Seconds per phase, as stored in manifests and status.
    pub fn as_seconds(&self) -> BTreeMap<String, f64> {
        self.phases
            .iter()
            .map(|(n, d)| (n.clone(), d.as_secs_f64()))
            .collect()
    }

    /// A plain-text table: one line per phase (those that ran beside the others marked) and
    /// the wall-clock total.
    pub fn table(&self) -> String {
        let label = |name: &str| {
            if self.is_beside(name) {
                format!("{name} (beside)")
            } else {
                name.to_owned()
            }
        };
        let width = self
            .phases
            .iter()
            .map(|(n, _)| label(n).len())
            .max()
            .unwrap_or(0)
            .max("total".len());
        let mut out = format!("{:<width$}  {:>10}\n", "phase", "seconds");
        for (name, d) in &self.phases {
            out.push_str(&format!(
                "{:<width$}  {:>10.3}\n",
                label(name),
                d.as_secs_f64()
            ));
        }
        out.push_str(&format!(
            "{:<width$}  {:>10.3}\n",
            "total",
            self.total().as_secs_f64()
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_recorded_in_order_with_a_total() {
        let mut t = Timings::default();
        let v = t.measure("dump", || 7);
        assert_eq!(v, 7);
        t.record("publish", Duration::from_millis(1500));
        assert_eq!(t.phases().len(), 2);
        assert_eq!(t.phases()[0].0, "dump");
        assert!(t.total() >= Duration::from_millis(1500));
        let table = t.table();
        assert!(table.contains("publish       1.500"), "{table}");
        assert!(table.lines().last().unwrap().starts_with("total"));
        assert_eq!(t.as_seconds()["publish"], 1.5);
    }

    #[test]
    fn a_phase_beside_the_others_is_marked_and_left_out_of_the_total() {
        let mut t = Timings::default();
        t.record("criu-restore", Duration::from_millis(1000));
        t.record_beside("verify-pages", Duration::from_millis(800));
        t.record("verify-wait", Duration::from_millis(100));
        assert_eq!(t.total(), Duration::from_millis(1100));
        let table = t.table();
        assert!(table.contains("verify-pages (beside)"), "{table}");
        assert!(table.contains("verify-wait    "), "{table}");
        assert!(table.lines().last().unwrap().contains("1.100"), "{table}");
        assert_eq!(t.as_seconds()["verify-pages"], 0.8);
        assert_eq!(t.beside_phases(), ["verify-pages"]);
    }
}
