//! `kiln untag NAME:TAG`: remove a tag (the manifest and its data stay until GC finds them
//! unreferenced). With `--expect DIGEST`, only if the tag still names that digest (exit 4 if not).

use kiln_store::{ManifestDigest, TagRef};
use serde_json::json;

use super::{CmdResult, Out, open_existing_store};

/// Arguments of `kiln untag`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The tag to remove.
    target: TagRef,
    /// Only remove it if it names this digest.
    #[arg(long, value_name = "DIGEST")]
    expect: Option<ManifestDigest>,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln untag`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    let was = store.untag(&a.target, a.expect).await?;
    out.event(
        "untagged",
        json!({"tag": a.target.to_string(), "manifest": was}),
        || format!("untagged {} (was {was})", a.target),
    );
    Ok(())
}
