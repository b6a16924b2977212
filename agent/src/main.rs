//! `warmstart-agent`: parses flags, sets up logging, runs the command, maps errors to exit
//! codes (2: usage, 1: failure).

use std::process::ExitCode;

use clap::Parser;
use warmstart_agent::cli::Cli;
use warmstart_agent::report::{SYSLOG_IDENTIFIER, error_chain};
use warmstart_shell::telemetry::{Filter, Telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    Telemetry {
        program: SYSLOG_IDENTIFIER,
        format: cli.log_format(),
        journal: cli.global.log_journal,
        filter: Filter::Default(cli.default_log_filter()),
        targets: true,
    }
    .init();
    let mut stdout = std::io::stdout().lock();
    match cli.run(&mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("warmstart-agent: {}", error_chain(&err));
            ExitCode::from(err.exit_code())
        }
    }
}
