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
    /// Fetch an image from a registry into the local store.
    Pull(cmd::pull::Args),
    /// Upload an image from the local store to a registry.
    Push(cmd::push::Args),
    /// Store registry credentials where Docker keeps them.
    Login(cmd::login::Args),
    /// Copy an image from an OCI layout (oci:DIR[:TAG]) into the local store.
    Import(cmd::import::Args),
    /// Write an image from the local store as an OCI layout.
    Export(cmd::export::Args),
    /// Write an image's root filesystem into a directory.
    Unpack(cmd::unpack::Args),
}

/// Prints an error chain and turns it into a failing exit code.
fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    match cli.command {
        Command::Plan(args) => cmd::plan::run(&args),
        Command::Pull(a) => report(cmd::pull::run(a)),
        Command::Push(a) => report(cmd::push::run(a)),
        Command::Login(a) => report(cmd::login::run(a)),
        Command::Import(a) => report(cmd::import::run(a)),
        Command::Export(a) => report(cmd::export::run(a)),
        Command::Unpack(a) => report(cmd::unpack::run(a)),
    }
}
