//! Errors of the CRIU client.
//!
//! Every failure names the operation and, once CRIU has run, where its log is; a failed request
//! carries the log's key error lines, because CRIU's own RPC message is usually just the
//! harmless RLIMIT_NOFILE line (see [`super::log`]).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::wait::WaitStatus;

use super::opts::OptsError;
use super::version::CriuVersion;

/// The CRIU request an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CriuOp {
    /// `VERSION`: ask CRIU for its version.
    Version,
    /// `CHECK`: CRIU's self-test of kernel support.
    Check,
    /// `DUMP`: checkpoint a process tree.
    Dump,
    /// `RESTORE`: restore a process tree.
    Restore,
}

impl fmt::Display for CriuOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Version => "version",
            Self::Check => "check",
            Self::Dump => "dump",
            Self::Restore => "restore",
        })
    }
}

/// What can go wrong when driving `criu swrk`.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    /// The options were rejected before CRIU was started.
    #[error(transparent)]
    InvalidOpts(#[from] OptsError),

    /// The images directory could not be opened (checked before CRIU is started).
    #[error("cannot open criu images directory {}", path.display())]
    ImagesDir {
        /// The directory.
        path: PathBuf,
        /// Why it could not be opened.
        #[source]
        source: io::Error,
    },

    /// The work directory could not be opened (checked before CRIU is started).
    #[error("cannot open criu work directory {}", path.display())]
    WorkDir {
        /// The directory.
        path: PathBuf,
        /// Why it could not be opened.
        #[source]
        source: io::Error,
    },

    /// The agent's CRIU settings (an empty plugin directory and the configuration naming it)
    /// could not be prepared (checked before CRIU is started).
    #[error("cannot prepare the CRIU plugin directory {}", path.display())]
    PluginDir {
        /// The directory or file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },

    /// `criu swrk` could not be started (binary not found in `PATH`, not executable, ...).
    #[error("cannot start {} swrk for criu {op}", path.display())]
    Spawn {
        /// The request it was started for.
        op: CriuOp,
        /// The binary, as configured or as resolved through `PATH`.
        path: PathBuf,
        /// Why it could not be started.
        #[source]
        source: io::Error,
    },

    /// Setting up or using the RPC socket failed.
    #[error("criu {op}: rpc socket error: cannot {step}")]
    Socket {
        /// The request.
        op: CriuOp,
        /// What was being done (`send the request`, `receive a response`, ...).
        step: &'static str,
        /// The system error.
        #[source]
        source: io::Error,
    },

    /// A response could not be decoded as a `criu_resp` message.
    #[error("criu {op}: cannot decode the rpc response")]
    Decode {
        /// The request.
        op: CriuOp,
        /// The protobuf error.
        #[source]
        source: prost::DecodeError,
    },

    /// A response was well-formed but not what the protocol allows here.
    #[error("criu {op}: unexpected rpc response: {detail}")]
    Protocol {
        /// The request.
        op: CriuOp,
        /// What was wrong with it.
        detail: String,
    },

    /// `criu swrk` closed the socket without answering (it crashed or could not start).
    #[error(
        "criu {op}: criu swrk ended without a response ({}){}{}",
        describe_status(status),
        fmt_lines(output),
        fmt_log(log.as_deref())
    )]
    NoResponse {
        /// The request.
        op: CriuOp,
        /// How `criu swrk` ended.
        status: WaitStatus,
        /// The last lines CRIU wrote to its stdout/stderr.
        output: Vec<String>,
        /// The CRIU log, where there is one.
        log: Option<PathBuf>,
    },

    /// CRIU did not answer within the client's timeout; it was killed.
    #[error("criu {op}: no response within {timeout:?}, criu killed{}", fmt_log(log.as_deref()))]
    Timeout {
        /// The request.
        op: CriuOp,
        /// The timeout that passed.
        timeout: Duration,
        /// The CRIU log, where there is one.
        log: Option<PathBuf>,
    },

    /// The installed CRIU is older than required.
    #[error("criu {found} is too old: need {}.{} or newer", required.0, required.1)]
    TooOld {
        /// The version found.
        found: CriuVersion,
        /// The minimum (major, minor).
        required: (u32, u32),
    },

    /// CRIU answered that the request failed.
    #[error(
        "criu {op} failed{}: {}{}",
        cr_errno.map(|errno| format!(" (errno {errno})")).unwrap_or_default(),
        summary(message, key_lines),
        fmt_log(log.as_deref())
    )]
    Failed {
        /// The request.
        op: CriuOp,
        /// CRIU's `cr_errno` (an errno value such as `ESRCH`), when it set one.
        cr_errno: Option<i32>,
        /// CRIU's own error message (`cr_errmsg`: the first error it logged, often noise).
        message: String,
        /// The CRIU log: in the images (or work) directory for dump and restore; `None` for
        /// check, which logs to its stderr (captured into `key_lines`).
        log: Option<PathBuf>,
        /// The last error lines of the log (or of CRIU's stderr), noise removed, oldest first.
        key_lines: Vec<String>,
    },
}

impl CriuError {
    /// CRIU's `cr_errno` for a failed request, if it reported one.
    pub fn cr_errno(&self) -> Option<i32> {
        match self {
            Self::Failed { cr_errno, .. } => *cr_errno,
            _ => None,
        }
    }

    /// The CRIU log this error refers to, if any.
    pub fn log(&self) -> Option<&Path> {
        match self {
            Self::Failed { log, .. } | Self::NoResponse { log, .. } | Self::Timeout { log, .. } => {
                log.as_deref()
            }
            _ => None,
        }
    }
}

impl CriuError {
    /// Points the error at `path`, where its log was copied to (see
    /// [`crate::logdir::keep_failed_log`]).
    pub fn set_log(&mut self, path: PathBuf) {
        match self {
            Self::Failed { log, .. } | Self::NoResponse { log, .. } | Self::Timeout { log, .. } => {
                *log = Some(path);
            }
            _ => {}
        }
    }
}

fn fmt_log(log: Option<&Path>) -> String {
    log.map(|path| format!(" (log: {})", path.display()))
        .unwrap_or_default()
}

fn fmt_lines(lines: &[String]) -> String {
    if lines.is_empty() {
        String::new()
    } else {
        format!(": {}", lines.join(" | "))
    }
}

fn summary(message: &str, key_lines: &[String]) -> String {
    if !key_lines.is_empty() {
        key_lines.join(" | ")
    } else if !message.is_empty() {
        message.to_owned()
    } else {
        "no error lines found".to_owned()
    }
}

fn describe_status(status: &WaitStatus) -> String {
    match status {
        WaitStatus::Exited(_, code) => format!("exit code {code}"),
        WaitStatus::Signaled(_, signal, _) => format!("killed by {signal}"),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use nix::unistd::Pid;

    use super::*;

    #[test]
    fn failed_display_names_the_log_and_the_key_lines_not_the_noise() {
        let err = CriuError::Failed {
            op: CriuOp::Dump,
            cr_errno: Some(libc::ESRCH),
            message: "Can't setup RLIMIT_NOFILE for self".to_owned(),
            log: Some(PathBuf::from("/images/dump.log")),
            key_lines: vec!["Error (criu/seize.c:1): Can't seize 7".to_owned()],
        };
        assert_eq!(
            err.to_string(),
            "criu dump failed (errno 3): Error (criu/seize.c:1): Can't seize 7 \
             (log: /images/dump.log)"
        );
        assert_eq!(err.cr_errno(), Some(libc::ESRCH));
        assert_eq!(err.log(), Some(Path::new("/images/dump.log")));
    }

    #[test]
    fn failed_display_falls_back_to_criu_message() {
        let err = CriuError::Failed {
            op: CriuOp::Check,
            cr_errno: None,
            message: "something".to_owned(),
            log: None,
            key_lines: vec![],
        };
        assert_eq!(err.to_string(), "criu check failed: something");
    }

    #[test]
    fn no_response_display_shows_status_and_output() {
        let err = CriuError::NoResponse {
            op: CriuOp::Version,
            status: WaitStatus::Exited(Pid::from_raw(10), 127),
            output: vec!["ld.so: cannot open".to_owned()],
            log: None,
        };
        assert_eq!(
            err.to_string(),
            "criu version: criu swrk ended without a response (exit code 127): ld.so: cannot open"
        );
    }
}
