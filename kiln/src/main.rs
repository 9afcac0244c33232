//! The `kiln` binary: CLI and HTTP service. Thin: parse, wire, print.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

/// kiln: image builder and snapshot store for microVM sandboxes.
#[derive(Debug, Parser)]
#[command(name = "kiln", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands, one module each under `cmd/`.
#[derive(Debug, Subcommand)]
enum Command {
    /// Lower a Dockerfile or YAML recipe into a build plan and print it.
    Plan(cmd::plan::PlanArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan(args) => cmd::plan::run(&args),
    }
}
