//! A program's metrics registry and its exposition in the OpenMetrics text format.

use prometheus_client::registry::Registry;

/// The `Content-Type` of [`Exposition::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A program's registry, complete once built: its metrics are handles updated elsewhere, and
/// the registry is only read (encoded) from then on, so it needs no lock.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
}

impl From<Registry> for Exposition {
    fn from(registry: Registry) -> Self {
        Self { registry }
    }
}

impl Exposition {
    /// Every metric registered, with its current value, as OpenMetrics text (ending in
    /// `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    #[test]
    fn registered_metrics_are_encoded_with_their_current_values() {
        let mut registry = Registry::with_prefix("warmstart");
        let counter = Counter::<u64>::default();
        registry.register("things", "Things seen", counter.clone());
        let exposition = Exposition::from(registry);
        counter.inc_by(3);
        let text = exposition.encode();
        assert!(
            text.contains("# HELP warmstart_things Things seen."),
            "{text}"
        );
        assert!(text.contains("warmstart_things_total 3"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
