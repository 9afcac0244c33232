//! The `kiln` binary: CLI and HTTP service. Thin: parse, wire, print.
//!
//! Exit codes (every subcommand): see [`cmd::exit`].

mod cmd;

use clap::{Parser, Subcommand};

/// kiln: image builder and snapshot store for microVM sandboxes.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about)]
struct Cli {
    /// Print one JSON object per line on stdout (events, results, errors) instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Point NAME:TAG at a manifest (by digest or by another tag).
    Tag(cmd::tag::Args),
    /// List tags, optionally of one NAME.
    Tags(cmd::tags::Args),
    /// Remove a tag.
    Untag(cmd::untag::Args),
    /// Store maintenance and copies between stores.
    #[command(subcommand)]
    Store(cmd::store::Command),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let out = cmd::Out::new(cli.json);
    cmd::run(&out, async |out| match cli.command {
        Command::Tag(a) => cmd::tag::run(out, a).await,
        Command::Tags(a) => cmd::tags::run(out, a).await,
        Command::Untag(a) => cmd::untag::run(out, a).await,
        Command::Store(c) => cmd::store::run(out, c).await,
    })
}
