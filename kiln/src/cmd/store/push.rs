//! `kiln store push NAME:TAG --to URL`: copy an image (or snapshot) and everything it
//! references from the local store to another store, moving only missing objects, then set
//! the tag there.

use crate::cmd::{CmdResult, Out};

/// Arguments of `kiln store push`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The tag to push (NAME:TAG), or an OCI reference (a name with a `/`, as `kiln tags`
    /// lists it, e.g. 127.0.0.1:5000/debian:bookworm).
    tag: String,
    /// The destination store (path, `file://PATH` or `s3://bucket/prefix`).
    #[arg(long, value_name = "URL")]
    to: String,
    /// The source store; default `$KILN_STORE`, else `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln store push`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    super::copy::copy(out, &a.tag, a.store.as_deref(), Some(&a.to), "pushed").await
}
