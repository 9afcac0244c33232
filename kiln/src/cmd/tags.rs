//! `kiln tags [NAME]`: list tags (all, or those of one image name) with their manifests, then
//! the OCI references of pulled and imported images (`registry/repository:tag`, the OCI
//! manifest or index blob, and `oci`).

use kiln_store::TagRef;
use kiln_store::tag::DEFAULT_TAG;
use serde_json::json;

use super::{CmdResult, Out, open_existing_store};

/// Arguments of `kiln tags`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only tags of this image name (or OCI references of this `registry/repository`).
    name: Option<String>,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln tags`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    // A name that is no store name but has a `/` can only be an OCI reference's repository
    // (`127.0.0.1:5000/busybox`); `myorg/app` may be either.
    let tags = match a.name.as_deref() {
        Some(n) if n.contains('/') && TagRef::new(n, DEFAULT_TAG).is_err() => Vec::new(),
        n => store.list_tags(n).await?,
    };
    for (tag, manifest) in tags {
        out.event(
            "tag",
            json!({"tag": tag.to_string(), "manifest": manifest}),
            || format!("{tag}\t{manifest}"),
        );
    }
    for (r, digest) in store.list_oci_refs().await? {
        if a.name.as_deref().is_some_and(|n| n != r.repository) {
            continue;
        }
        let digest = digest.map_err(|reason| {
            kiln_store::StoreError::from(kiln_store::OciRefError::Corrupt {
                reference: r.clone(),
                store: store.url().to_string(),
                reason,
            })
        })?;
        out.event(
            "ociRef",
            json!({"reference": r.to_string(), "digest": digest.to_string()}),
            || format!("{r}\t{digest}\toci"),
        );
    }
    Ok(())
}
