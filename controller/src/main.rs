//! `warmstart-controller`: parses the command line, runs the chosen command, maps errors to exit
//! codes (2: bad input or usage, 1: failure).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use warmstart_controller::cli::{Cli, LogFormat};
use warmstart_controller::errors::error_chain;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: container logs (`kubectl logs`) and files
        // get plain text.
        .with_ansi(std::io::stderr().is_terminal());
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    let mut stdout = std::io::stdout().lock();
    match cli.run(&mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("warmstart-controller: {}", error_chain(&err));
            ExitCode::from(err.exit_code())
        }
    }
}
