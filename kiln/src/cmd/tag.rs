//! `kiln tag SRC NAME:TAG`: point a tag at a manifest, named by digest (`sha256:<hex>`) or by
//! another tag. The move is a compare-and-swap; with `--expect` it fails (exit 4) unless the
//! tag held that digest (`--expect absent`: unless it was unset).

use kiln_store::{ManifestDigest, TagRef};
use serde_json::json;

use super::{CmdResult, Out, open_store};

/// Arguments of `kiln tag`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The manifest: `sha256:<hex>` (64 hex digits) or an existing `NAME:TAG` of this store
    /// (see `kiln tags`; images from `kiln pull`/`kiln import` are not tags).
    src: String,
    /// The tag to set, `NAME:TAG` (name `[a-z0-9._-]`, no registry host or `/`).
    target: TagRef,
    /// Only move the tag if it currently names this digest (`absent`: if it is unset).
    #[arg(long, value_name = "DIGEST|absent")]
    expect: Option<String>,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln tag`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_store(out, a.store.as_deref()).await?;
    let manifest = match a.src.parse::<ManifestDigest>() {
        Ok(d) => d,
        Err(_) => store.resolve_tag(&a.src.parse::<TagRef>()?).await?,
    };
    let previous = match a.expect.as_deref() {
        None => store.force_tag(&a.target, manifest).await?,
        Some(e) => {
            let expected = match e {
                "absent" => None,
                d => Some(d.parse::<ManifestDigest>()?),
            };
            store.set_tag(&a.target, expected, manifest).await?;
            expected
        }
    };
    out.event(
        "tagged",
        json!({"tag": a.target.to_string(), "manifest": manifest, "previous": previous}),
        || format!("{} -> {manifest}", a.target),
    );
    Ok(())
}
