//! Per-phase durations of one operation, reported in logs, manifests and the CLI's table.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Ordered phase timings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    phases: Vec<(String, Duration)>,
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

    /// The phases in order.
    pub fn phases(&self) -> &[(String, Duration)] {
        &self.phases
    }

    /// The sum of all phases.
    pub fn total(&self) -> Duration {
        self.phases.iter().map(|(_, d)| *d).sum()
    }

    /// Seconds per phase, as stored in manifests and status.
    pub fn as_seconds(&self) -> BTreeMap<String, f64> {
        self.phases
            .iter()
            .map(|(n, d)| (n.clone(), d.as_secs_f64()))
            .collect()
    }

    /// A plain-text table: one line per phase and a total.
    pub fn table(&self) -> String {
        let width = self
            .phases
            .iter()
            .map(|(n, _)| n.len())
            .max()
            .unwrap_or(0)
            .max("total".len());
        let mut out = format!("{:<width$}  {:>10}\n", "phase", "seconds");
        for (name, d) in &self.phases {
            out.push_str(&format!("{name:<width$}  {:>10.3}\n", d.as_secs_f64()));
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
}
