//! `warmstart-entrypoint`: parses the command line and environment, starts logging, runs the
//! mode, and exits with the supervised process's status.

use std::process::ExitCode;

use clap::Parser;
use warmstart_entrypoint::cli::{self, Args};
use warmstart_entrypoint::{install, supervise};
use warmstart_shell::error_chain;
use warmstart_shell::telemetry::{Filter, Telemetry};

/// Exit status for a bad command line or environment (as clap uses).
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let args = Args::parse();
    // stderr: the container log, shared with the server's own output.
    Telemetry {
        filter: Filter::Explicit(&args.log),
        targets: false,
        ..Telemetry::new("warmstart-entrypoint", "info")
    }
    .init();
    if let Some(dir) = &args.install {
        return match install::install(dir) {
            Ok(path) => {
                tracing::info!(path = %path.display(), "installed");
                ExitCode::SUCCESS
            }
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot install");
                ExitCode::FAILURE
            }
        };
    }
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let settings = match args.settings(&env, cli::default_control_dir_exists()) {
        Ok(settings) => settings,
        Err(e) => {
            tracing::error!("{}", error_chain(&e));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match supervise::run(&settings) {
        Ok(code) => ExitCode::from(u8::try_from(code & 0xff).unwrap_or(1)),
        Err(e) => {
            tracing::error!("{}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
