//! The command line: `warmstart-entrypoint [options] -- <command> [args…]`, every option with
//! its protocol environment variable (the Dynamo and snapshot aliases are read too), parsed
//! into [`Settings`].

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use thiserror::Error;
use warmstart_shared::names;
use warmstart_shared::restore_pod::DEFAULT_RESTORE_TIMEOUT_SECONDS;

use crate::probe::{ProbeSpec, ProbeSpecError};
use crate::supervise::{Mode, Settings};

/// Runs a server under the warmstart protocol: readiness by its own probe in a checkpoint pod,
/// standby and cold-start fallback in a restore pod.
#[derive(Debug, Parser)]
#[command(name = "warmstart-entrypoint", version, about)]
pub struct Args {
    /// Copy this binary to DIR/warmstart-entrypoint and exit (the install init container).
    #[arg(long, value_name = "DIR")]
    pub install: Option<PathBuf>,
    /// Where to write `ready` (checkpoint source mode).
    #[arg(long, env = names::ENV_READY_FILE)]
    pub ready_file: Option<PathBuf>,
    /// The `<hash>.done` file to wait for.
    #[arg(long, env = names::ENV_SIGNAL_FILE)]
    pub signal_file: Option<PathBuf>,
    /// The restore control directory (default: /warmstart-control when it exists).
    #[arg(long, env = names::ENV_CONTROL_DIR)]
    pub control_dir: Option<PathBuf>,
    /// The container's readiness probe, JSON of a Kubernetes Probe.
    #[arg(long, env = names::ENV_READY_PROBE)]
    pub ready_probe: Option<String>,
    /// Wait to be restored instead of starting the command (`1`/`true` or `0`/`false`).
    #[arg(long, env = names::ENV_RESTORE_STANDBY)]
    pub standby: Option<String>,
    /// How long standby waits before a cold start: seconds, or a number with s, m or h.
    #[arg(long, env = names::ENV_RESTORE_TIMEOUT)]
    pub restore_timeout: Option<String>,
    /// SIGTERM-to-SIGKILL grace when stopping the command after a checkpoint.
    #[arg(long, env = names::ENV_STOP_GRACE_PERIOD, default_value = "30")]
    pub stop_grace_period: String,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "WARMSTART_LOG", default_value = "info")]
    pub log: String,
    /// The command to run, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// A setting that cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SettingsError {
    /// A boolean that is not one.
    #[error("{name} is {value:?}, must be 1, true, 0 or false")]
    Flag {
        /// The variable or option.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// A duration that is not one.
    #[error("{name} is {value:?}, must be seconds or a number with s, m or h")]
    Duration {
        /// The variable or option.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// A checkpoint source without a probe.
    #[error(
        "{} is set but {} is not: the entrypoint needs the container's readiness probe to know when the server is ready",
        names::ENV_READY_FILE,
        names::ENV_READY_PROBE
    )]
    NoProbe,
    /// The probe cannot be run.
    #[error("invalid {}", names::ENV_READY_PROBE)]
    Probe(#[source] ProbeSpecError),
    /// No command.
    #[error("no command given: usage is warmstart-entrypoint -- <command> [args…]")]
    NoCommand,
}

impl Args {
    /// The settings, with the aliases of unset variables looked up through `env` and the
    /// default control directory taken when `default_control_exists`.
    ///
    /// # Errors
    /// See [`SettingsError`].
    pub fn settings(
        self,
        env: &dyn Fn(&str) -> Option<String>,
        default_control_exists: bool,
    ) -> Result<Settings, SettingsError> {
        if self.command.is_empty() {
            return Err(SettingsError::NoCommand);
        }
        let alias = |value: Option<String>, name: &str| value.or_else(|| env(name));
        let path =
            |value: Option<PathBuf>, name: &str| value.or_else(|| env(name).map(PathBuf::from));
        let ready_file = path(self.ready_file, names::ENV_DYN_READY_FILE);
        let done_file = path(self.signal_file, names::ENV_DYN_SIGNAL_FILE);
        let control_dir = path(self.control_dir, names::ENV_SNAPSHOT_CONTROL_DIR)
            .or_else(|| default_control_exists.then(|| PathBuf::from(names::MOUNT_CONTROL)));
        let standby = match alias(self.standby, names::ENV_SNAPSHOT_RESTORE_STANDBY) {
            None => false,
            Some(value) => parse_flag(names::ENV_RESTORE_STANDBY, &value)?,
        };
        let timeout = match self.restore_timeout {
            None => Duration::from_secs(DEFAULT_RESTORE_TIMEOUT_SECONDS.unsigned_abs().into()),
            Some(value) => parse_duration(names::ENV_RESTORE_TIMEOUT, &value)?,
        };
        let stop_grace = parse_duration(names::ENV_STOP_GRACE_PERIOD, &self.stop_grace_period)?;
        let mode = if standby {
            Mode::Standby { timeout }
        } else if let Some(ready_file) = ready_file {
            let probe = self.ready_probe.ok_or(SettingsError::NoProbe)?;
            Mode::Source {
                ready_file,
                done_file,
                probe: ProbeSpec::from_json(&probe).map_err(SettingsError::Probe)?,
            }
        } else {
            Mode::Plain
        };
        Ok(Settings {
            command: self.command,
            mode,
            control_dir,
            stop_grace,
        })
    }
}

/// Whether the default control directory exists in this container.
pub fn default_control_dir_exists() -> bool {
    Path::new(names::MOUNT_CONTROL).is_dir()
}

fn parse_flag(name: &'static str, value: &str) -> Result<bool, SettingsError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Ok(true),
        "" | "0" | "false" | "no" => Ok(false),
        _ => Err(SettingsError::Flag {
            name,
            value: value.to_owned(),
        }),
    }
}

/// Parses a duration setting `name`: seconds, or a number with `s`, `m` or `h`.
///
/// # Errors
/// Anything else, naming `name`.
pub fn parse_duration(name: &'static str, value: &str) -> Result<Duration, SettingsError> {
    let trimmed = value.trim();
    let (number, unit) = match trimmed.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => trimmed.split_at(i),
        None => (trimmed, "s"),
    };
    let factor = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => 0,
    };
    number
        .parse::<u64>()
        .ok()
        .filter(|_| factor > 0)
        .and_then(|n| n.checked_mul(factor))
        .map(Duration::from_secs)
        .ok_or_else(|| SettingsError::Duration {
            name,
            value: value.to_owned(),
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("warmstart-entrypoint").chain(list.iter().copied()))
            .unwrap()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    const PROBE: &str = r#"{"tcpSocket":{"port":6379}}"#;

    #[test]
    fn the_mode_follows_the_protocol_variables() {
        let s = args(&["--", "redis-server", "--port", "6379"])
            .settings(&no_env, false)
            .unwrap();
        assert!(matches!(s.mode, Mode::Plain));
        assert_eq!(s.command, ["redis-server", "--port", "6379"]);
        assert_eq!(s.control_dir, None);

        let s = args(&[
            "--ready-file",
            "/s/ready",
            "--ready-probe",
            PROBE,
            "--",
            "x",
        ])
        .settings(&no_env, true)
        .unwrap();
        let Mode::Source {
            ready_file,
            done_file,
            ..
        } = s.mode
        else {
            panic!("not a source");
        };
        assert_eq!(ready_file, PathBuf::from("/s/ready"));
        assert_eq!(done_file, None);
        assert_eq!(s.control_dir, Some(PathBuf::from("/warmstart-control")));

        // Standby wins over a ready file; the snapshot alias counts; the timeout has units.
        let env =
            |name: &str| (name == names::ENV_SNAPSHOT_RESTORE_STANDBY).then(|| "1".to_owned());
        let s = args(&[
            "--ready-file",
            "/s/ready",
            "--restore-timeout",
            "2m",
            "--",
            "x",
        ])
        .settings(&env, true)
        .unwrap();
        let Mode::Standby { timeout } = s.mode else {
            panic!("not standby");
        };
        assert_eq!(timeout, Duration::from_secs(120));
        let s = args(&["--standby", "true", "--", "x"])
            .settings(&no_env, true)
            .unwrap();
        // The default: half the restore pod's startup gate.
        let default =
            u64::try_from(warmstart_shared::restore_pod::DEFAULT_RESTORE_TIMEOUT_SECONDS).unwrap();
        assert!(matches!(s.mode, Mode::Standby { timeout } if timeout.as_secs() == default));
        assert_eq!(default, 900);
    }

    #[test]
    fn dynamo_aliases_name_the_files() {
        let env = |name: &str| match name {
            n if n == names::ENV_DYN_READY_FILE => Some("/dyn/ready".to_owned()),
            n if n == names::ENV_DYN_SIGNAL_FILE => Some("/dyn/h.done".to_owned()),
            n if n == names::ENV_SNAPSHOT_CONTROL_DIR => Some("/ctl".to_owned()),
            _ => None,
        };
        let s = args(&["--ready-probe", PROBE, "--", "x"])
            .settings(&env, false)
            .unwrap();
        let Mode::Source {
            ready_file,
            done_file,
            ..
        } = s.mode
        else {
            panic!("not a source");
        };
        assert_eq!(ready_file, PathBuf::from("/dyn/ready"));
        assert_eq!(done_file, Some(PathBuf::from("/dyn/h.done")));
        assert_eq!(s.control_dir, Some(PathBuf::from("/ctl")));
    }

    #[test]
    fn bad_settings_are_refused_with_their_name() {
        let err = |list: &[&str]| args(list).settings(&no_env, false).unwrap_err();
        assert_eq!(
            err(&["--ready-file", "/r", "--", "x"]),
            SettingsError::NoProbe
        );
        assert!(matches!(
            err(&["--ready-file", "/r", "--ready-probe", "{}", "--", "x"]),
            SettingsError::Probe(ProbeSpecError::Handlers(0))
        ));
        assert_eq!(
            err(&["--standby", "maybe", "--", "x"]).to_string(),
            "WARMSTART_RESTORE_STANDBY is \"maybe\", must be 1, true, 0 or false"
        );
        assert!(matches!(
            err(&["--restore-timeout", "5 minutes", "--", "x"]),
            SettingsError::Duration { .. }
        ));
        assert!(matches!(
            err(&["--stop-grace-period=-1", "--", "x"]),
            SettingsError::Duration { .. }
        ));
        assert_eq!(err(&[]), SettingsError::NoCommand);
        assert_eq!(parse_duration("t", "0").unwrap(), Duration::ZERO);
        assert_eq!(
            parse_duration("t", "1h").unwrap(),
            Duration::from_secs(3600)
        );
    }
}
