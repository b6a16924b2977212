//! `warmstart-agent`: the node agent's entry point. Parses flags, runs the command, maps errors
//! to exit codes (2: usage, 1: failure).

use std::process::ExitCode;

use clap::Parser;

/// warmstart node agent: checkpoints and restores containers with CRIU and the CUDA driver.
#[derive(Debug, Parser)]
#[command(name = "warmstart-agent", version, about, long_about = None)]
struct Cli {}

fn main() -> ExitCode {
    let _cli = Cli::parse();
    ExitCode::SUCCESS
}
