//! `kiln store ...`: copies between stores and store maintenance, one file per subcommand.

pub mod export;
pub mod import;

use super::{CmdResult, Out};

/// `kiln store` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Store a file (an ext4 image) as an image manifest and tag it.
    Import(import::Args),
    /// Write the image a tag names out to a file (sparse: holes for zero chunks).
    Export(export::Args),
}

/// Runs a `kiln store` subcommand.
pub async fn run(out: &Out, c: Command) -> CmdResult {
    match c {
        Command::Import(a) => import::run(out, a).await,
        Command::Export(a) => export::run(out, a).await,
    }
}
