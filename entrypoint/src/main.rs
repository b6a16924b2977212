//! `warmstart-entrypoint`: parses the command line and environment, starts logging, runs the
//! mode, and exits with the supervised process's status.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;
use warmstart_entrypoint::cli::{self, Args};
use warmstart_entrypoint::{install, supervise};

/// Exit status for a bad command line or environment (as clap uses).
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("info"));
    // stderr: the container log, shared with the server's own output.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(false)
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

/// `error: cause: cause`, as `warmstart_shared::errors::error_chain` prints it (a cause the line
/// already ends with, or an empty one, is not repeated). A copy: the entrypoint is copied into
/// workload images and depends on no warmstart crate, to stay a small static binary.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !cause_text.is_empty() && !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
