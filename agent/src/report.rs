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

/// `s` cut to at most `max` bytes on a character boundary, with `…` when cut (for API fields
/// with a size limit).
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
    /// Structured entries in the systemd journal (fields searchable with `journalctl`).
    Journald,
}

impl LogFormat {
    /// The format to use: `explicit` when given, else journald when standard error is connected
    /// to the journal (`JOURNAL_STREAM` is set, as systemd does for its services: the node's
    /// journal is where people debug the agent), else text.
    pub fn resolve(explicit: Option<Self>, journal_stream: Option<&std::ffi::OsStr>) -> Self {
        explicit.unwrap_or(if journal_stream.is_some_and(|s| !s.is_empty()) {
            Self::Journald
        } else {
            Self::Text
        })
    }
}

/// Sets up `tracing` for this process: filter from `RUST_LOG` (default `default_filter`), to
/// standard error (text or JSON) or the journal. Call once, first thing in `main`. Without a
/// journal to write to, journald falls back to text, saying so.
pub fn init_telemetry(format: LogFormat, default_filter: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter))
    };
    let builder = || {
        tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
    };
    match format {
        LogFormat::Json => builder().json().init(),
        LogFormat::Text => builder().init(),
        LogFormat::Journald => match tracing_journald::layer() {
            Ok(layer) => tracing_subscriber::registry()
                .with(filter())
                .with(layer.with_syslog_identifier("warmstart-agent".to_owned()))
                .init(),
            Err(e) => {
                builder().init();
                tracing::warn!(error = %e, "no journal to log to: logging text to standard error");
            }
        },
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
    fn journald_is_chosen_under_the_journal_unless_a_format_is_given() {
        let stream = Some(std::ffi::OsStr::new("8:12345"));
        assert_eq!(LogFormat::resolve(None, None), LogFormat::Text);
        assert_eq!(LogFormat::resolve(None, stream), LogFormat::Journald);
        assert_eq!(
            LogFormat::resolve(None, Some(std::ffi::OsStr::new(""))),
            LogFormat::Text
        );
        assert_eq!(
            LogFormat::resolve(Some(LogFormat::Json), stream),
            LogFormat::Json
        );
    }

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
