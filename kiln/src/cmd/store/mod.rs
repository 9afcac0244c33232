//! `kiln store ...`: copies between stores and store maintenance, one file per subcommand.

mod copy;
pub mod export;
pub mod gc;
pub mod import;
pub mod pull;
pub mod push;
pub mod verify;

use super::{CmdResult, Out};

/// `kiln store` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Copy NAME:TAG and everything it references to another store, moving only what is missing.
    Push(push::Args),
    /// Copy NAME:TAG and everything it references from another store into this one.
    Pull(pull::Args),
    /// Check that every tagged manifest parses and every object it names exists.
    Verify(verify::Args),
    /// Delete objects no tag, live lease or build-cache entry reaches.
    Gc(gc::Args),
    /// Store a file (an ext4 image) as an image manifest and tag it.
    Import(import::Args),
    /// Write the image a tag names out to a file (sparse: holes for zero chunks).
    Export(export::Args),
}

/// Runs a `kiln store` subcommand.
pub async fn run(out: &Out, c: Command) -> CmdResult {
    match c {
        Command::Push(a) => push::run(out, a).await,
        Command::Pull(a) => pull::run(out, a).await,
        Command::Verify(a) => verify::run(out, a).await,
        Command::Gc(a) => gc::run(out, a).await,
        Command::Import(a) => import::run(out, a).await,
        Command::Export(a) => export::run(out, a).await,
    }
}
