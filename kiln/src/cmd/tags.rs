//! `kiln tags [NAME]`: list tags (all, or those of one image name) with their manifests.

use serde_json::json;

use super::{CmdResult, Out, open_existing_store};

/// Arguments of `kiln tags`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only tags of this image name.
    name: Option<String>,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln tags`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(a.store.as_deref()).await?;
    for (tag, manifest) in store.list_tags(a.name.as_deref()).await? {
        out.event(
            "tag",
            json!({"tag": tag.to_string(), "manifest": manifest}),
            || format!("{tag}\t{manifest}"),
        );
    }
    Ok(())
}
