//! `warmstart-controller`: parses the command line, runs the chosen command, maps errors to exit
//! codes (2: bad input or usage, 1: failure).

use std::process::ExitCode;

use clap::Parser;
use warmstart_controller::cli::{Cli, LogFormat};
use warmstart_controller::errors::error_chain;
use warmstart_shell::telemetry::{self, Telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    Telemetry {
        format: match cli.log_format {
            LogFormat::Json => telemetry::LogFormat::Json,
            LogFormat::Text => telemetry::LogFormat::Text,
        },
        ..Telemetry::new("warmstart-controller", "info")
    }
    .init();
    let mut stdout = std::io::stdout().lock();
    match cli.run(&mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("warmstart-controller: {}", error_chain(&err));
            ExitCode::from(err.exit_code())
        }
    }
}
