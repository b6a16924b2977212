//! `warmstart-controller`: parses the command line, runs the chosen command, maps errors to exit
//! codes (2: bad input or usage, 1: failure).

use std::process::ExitCode;

use clap::Parser;
use warmstart_controller::cli::{Cli, CliError};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut stdout = std::io::stdout().lock();
    match cli.run(&mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("warmstart-controller: {}", error_chain(&err));
            ExitCode::from(err.exit_code())
        }
    }
}

fn error_chain(err: &CliError) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
