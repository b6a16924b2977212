//! `warmstart-agent`: parses flags, sets up logging, runs the command, maps errors to exit
//! codes (2: usage, 1: failure).

use std::process::ExitCode;

use clap::Parser;
use warmstart_agent::cli::Cli;
use warmstart_agent::report::{error_chain, init_telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_telemetry(
        cli.log_format(),
        cli.global.log_journal,
        cli.default_log_filter(),
    );
    let mut stdout = std::io::stdout().lock();
    match cli.run(&mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("warmstart-agent: {}", error_chain(&err));
            ExitCode::from(err.exit_code())
        }
    }
}
