//! How the agent reports: its one error-chain formatter and its one telemetry set-up (used by
//! the `warmstart-agent` binary for every command, the restore helper included).

use std::io::IsTerminal;

/// An error and its sources on one line, `outer: cause: root cause`. A cause whose text the
/// line already ends with (an error that prints its source itself, as transport errors do)
/// is not repeated.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !text.is_empty() && !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Sets up `tracing` for this process: filter from `RUST_LOG` (default `warn`), to standard
/// error, in `format`. Call once, first thing in `main`.
pub fn init_telemetry(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot connect")]
    struct Outer(#[source] Transport);

    #[derive(Debug, thiserror::Error)]
    #[error("transport error: {0}")]
    struct Transport(#[source] std::io::Error);

    #[test]
    fn a_cause_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let text = io.to_string();
        let err = Outer(Transport(io));
        assert_eq!(
            error_chain(&err),
            format!("cannot connect: transport error: {text}")
        );
    }
}
