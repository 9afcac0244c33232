//! The `kiln` binary: CLI and HTTP service. Thin: parse, wire, print.

mod cmd;

use clap::{Parser, Subcommand};

/// kiln: image builder and snapshot store for microVM sandboxes.
#[derive(Debug, Parser)]
#[command(name = "kiln", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Pull(a) => cmd::pull::run(a),
        Command::Push(a) => cmd::push::run(a),
        Command::Login(a) => cmd::login::run(a),
        Command::Import(a) => cmd::import::run(a),
        Command::Export(a) => cmd::export::run(a),
        Command::Unpack(a) => cmd::unpack::run(a),
    }
}
