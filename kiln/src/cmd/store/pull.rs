//! `kiln store pull NAME:TAG --from URL`: copy an image (or snapshot) and everything it
//! references from another store into the local store, moving only missing objects, then set
//! the tag locally.

use crate::cmd::{CmdResult, Out};

/// Arguments of `kiln store pull`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The tag to pull (NAME:TAG), or an OCI reference (a name with a `/`, as `kiln tags`
    /// lists it, e.g. 127.0.0.1:5000/debian:bookworm).
    tag: String,
    /// The source store (path, `file://PATH` or `s3://bucket/prefix`).
    #[arg(long, value_name = "URL")]
    from: String,
    /// The destination store; default `$KILN_STORE`, else `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln store pull`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    super::copy::copy(out, &a.tag, Some(&a.from), a.store.as_deref(), "pulled").await
}
