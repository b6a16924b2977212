//! How a warmstart program logs: standard error as text or JSON, and the node's journal with
//! searchable fields when there is one.

use std::io::IsTerminal;

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

/// Whether entries also go to the node's journal (besides standard error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogJournal {
    /// When the journal answers on its socket and standard error is not the journal already.
    #[default]
    Auto,
    /// Always (a warning on standard error when the journal does not answer).
    On,
    /// Never.
    Off,
}

/// Where the journal listens (the DaemonSet mounts the node's `/run/systemd/journal`).
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

impl LogJournal {
    /// Whether to try the journal: `on`, or `auto` while standard error is not connected to
    /// the journal already (`JOURNAL_STREAM`, a systemd service: entries would be written
    /// twice).
    pub fn wanted(self, journal_stream: Option<&std::ffi::OsStr>) -> bool {
        match self {
            Self::On => true,
            Self::Off => false,
            Self::Auto => journal_stream.is_none_or(std::ffi::OsStr::is_empty),
        }
    }
}

/// The journal layer: entries tagged `identifier` (`journalctl -t <identifier>`), with the fields of the event and
/// of its spans under their own upper-case names (`POD`, `NAMESPACE`, `CHECKPOINT_HASH`,
/// `CONTAINER_ID`), as `journalctl` filters on them.
///
/// # Errors
/// The journal's socket does not answer.
pub fn journal_layer(identifier: &str) -> std::io::Result<tracing_journald::Layer> {
    Ok(tracing_journald::layer()?
        .with_syslog_identifier(identifier.to_owned())
        .with_field_prefix(None))
}

/// How a program logs.
#[derive(Clone, Copy, Debug)]
pub struct Telemetry<'a> {
    /// The program's name: its journal entries' identifier (`journalctl -t <program>`).
    pub program: &'a str,
    /// Standard error's format.
    pub format: LogFormat,
    /// Whether entries also go to the node's journal.
    pub journal: LogJournal,
    /// Which events are logged.
    pub filter: Filter<'a>,
    /// Whether a line names the module that logged it.
    pub targets: bool,
}

/// Which events a program logs (`tracing_subscriber`'s directives, e.g. `info,kube=warn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter<'a> {
    /// `RUST_LOG` when set and valid, else these directives.
    Default(&'a str),
    /// These directives, whatever `RUST_LOG` says (`info` when they do not parse).
    Explicit(&'a str),
}

impl Filter<'_> {
    fn env_filter(self) -> tracing_subscriber::EnvFilter {
        use tracing_subscriber::EnvFilter;
        match self {
            Self::Default(directives) => {
                EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(directives))
            }
            Self::Explicit(directives) => {
                EnvFilter::try_new(directives).unwrap_or_else(|_| EnvFilter::new("info"))
            }
        }
    }
}

impl<'a> Telemetry<'a> {
    /// Text to standard error, no journal, `RUST_LOG` or `default_filter`, with targets.
    pub fn new(program: &'a str, default_filter: &'a str) -> Self {
        Self {
            program,
            format: LogFormat::Text,
            journal: LogJournal::Off,
            filter: Filter::Default(default_filter),
            targets: true,
        }
    }

    /// The subscriber: events to standard error (text or JSON; none with `journald`, which is
    /// the journal alone, colours only at a terminal) and to `journal` when given.
    pub fn subscriber(
        &self,
        journal: Option<tracing_journald::Layer>,
    ) -> impl tracing::Subscriber + Send + Sync + use<> {
        use tracing_subscriber::Layer;
        use tracing_subscriber::layer::SubscriberExt;
        // Colours only for a person at a terminal: container logs (`kubectl logs`) and files
        // get plain text.
        let stderr = tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(self.targets)
            .with_writer(std::io::stderr);
        let stderr = match self.format {
            LogFormat::Json => Some(stderr.json().boxed()),
            LogFormat::Text => Some(stderr.boxed()),
            LogFormat::Journald => None,
        };
        tracing_subscriber::registry()
            .with(self.filter.env_filter())
            .with(stderr)
            .with(journal)
    }

    /// Sets this up as the process's subscriber: the journal too when [`Self::journal`] wants
    /// it and it answers. Call once, first thing in `main`. `journald` without a journal falls
    /// back to text, saying so.
    pub fn init(self) {
        use tracing_subscriber::util::SubscriberInitExt;
        let wanted = self.format == LogFormat::Journald
            || self
                .journal
                .wanted(std::env::var_os("JOURNAL_STREAM").as_deref());
        let (layer, error) = match wanted.then(|| journal_layer(self.program)) {
            Some(Ok(layer)) => (Some(layer), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        let stderr_format = match (self.format, &layer) {
            (LogFormat::Journald, None) => LogFormat::Text,
            (format, _) => format,
        };
        Self {
            format: stderr_format,
            ..self
        }
        .subscriber(layer)
        .init();
        let Some(e) = error else {
            return;
        };
        if self.format == LogFormat::Journald || self.journal == LogJournal::On {
            tracing::warn!(error = %e, socket = JOURNAL_SOCKET, "no journal to log to: logging to standard error only");
        } else {
            tracing::debug!(error = %e, socket = JOURNAL_SOCKET, "no journal answers: logging to standard error only");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_journal_is_tried_unless_off_or_standard_error_is_the_journal() {
        let stream = Some(std::ffi::OsStr::new("8:12345"));
        assert!(LogJournal::Auto.wanted(None));
        assert!(!LogJournal::Auto.wanted(stream));
        assert!(LogJournal::On.wanted(stream));
        assert!(!LogJournal::Off.wanted(None));
    }

    const JOURNAL_CHILD: &str = "WARMSTART_TEST_JOURNAL_CHILD";

    /// Run by the test below in a mount namespace whose `/run` holds its socket; does nothing
    /// otherwise.
    #[test]
    fn journal_child_logs_an_operation() {
        if std::env::var_os(JOURNAL_CHILD).is_none() {
            return;
        }
        let journal = journal_layer("warmstart-agent").expect("the test's journal answers");
        let subscriber = Telemetry::new("warmstart-agent", "info").subscriber(Some(journal));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "checkpoint",
                pod = "llama-0",
                namespace = "models",
                checkpoint.hash = "0123456789abcdef",
                container.id = "containerd://abc"
            );
            let _entered = span.enter();
            tracing::info!(done_bytes = 42u64, "dumping 1.0 GiB/2.0 GiB at 1.0 GiB/s");
        });
    }

    /// Journal export fields of one native-protocol datagram (`KEY=value` lines, or `KEY`, a
    /// little-endian length and the value).
    fn journal_fields(mut data: &[u8]) -> std::collections::BTreeMap<String, String> {
        let mut fields = std::collections::BTreeMap::new();
        while let Some(end) = data.iter().position(|&b| b == b'\n') {
            let line = &data[..end];
            if let Some(eq) = line.iter().position(|&b| b == b'=') {
                fields.insert(
                    String::from_utf8_lossy(&line[..eq]).into_owned(),
                    String::from_utf8_lossy(&line[eq + 1..]).into_owned(),
                );
                data = &data[end + 1..];
            } else {
                let rest = &data[end + 1..];
                let len =
                    usize::try_from(u64::from_le_bytes(rest[..8].try_into().unwrap())).unwrap();
                fields.insert(
                    String::from_utf8_lossy(line).into_owned(),
                    String::from_utf8_lossy(&rest[8..8 + len]).into_owned(),
                );
                data = &rest[8 + len + 1..];
            }
        }
        fields
    }

    #[test]
    fn entries_reach_the_journal_with_the_operations_fields_and_standard_error_too() {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var_os("WARMSTART_REQUIRE_ROOT").is_none(),
                "WARMSTART_REQUIRE_ROOT is set but this test does not run as root"
            );
            return;
        }
        // A journal of the test's own, at the path the agent writes to, in a mount namespace
        // of the child alone.
        let run = tempfile::tempdir().unwrap();
        let dir = run.path().join("systemd/journal");
        std::fs::create_dir_all(&dir).unwrap();
        let socket = std::os::unix::net::UnixDatagram::bind(dir.join("socket")).unwrap();
        socket
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let output = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount --bind "$0" /run && exec "$1" --exact telemetry::tests::journal_child_logs_an_operation --nocapture --test-threads=1"#)
            .arg(run.path())
            .arg(std::env::current_exe().unwrap())
            .env(JOURNAL_CHILD, "1")
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        let mut entries = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = socket.recv(&mut buf) {
            if n == 0 {
                continue; // the layer's hello
            }
            let fields = journal_fields(&buf[..n]);
            let done = fields
                .get("MESSAGE")
                .is_some_and(|m| m.starts_with("dumping"));
            entries.push(fields);
            if done {
                break;
            }
        }
        let entry = entries
            .iter()
            .find(|f| f.get("MESSAGE").is_some_and(|m| m.starts_with("dumping")))
            .unwrap_or_else(|| panic!("no entry reached the journal: {entries:?}"));
        for (key, value) in [
            ("MESSAGE", "dumping 1.0 GiB/2.0 GiB at 1.0 GiB/s"),
            ("SYSLOG_IDENTIFIER", "warmstart-agent"),
            ("POD", "llama-0"),
            ("NAMESPACE", "models"),
            ("CHECKPOINT_HASH", "0123456789abcdef"),
            ("CONTAINER_ID", "containerd://abc"),
            ("DONE_BYTES", "42"),
            ("PRIORITY", "5"),
        ] {
            assert_eq!(
                entry.get(key).map(String::as_str),
                Some(value),
                "{key} in {entry:?}"
            );
        }
        // And the same line on standard error, for `kubectl logs`.
        assert!(
            stderr.contains("dumping 1.0 GiB/2.0 GiB at 1.0 GiB/s")
                && stderr.contains("pod=\"llama-0\""),
            "{stderr}"
        );
    }
}
