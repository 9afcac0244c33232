//! `kiln rmi REF...`: remove images from the store's tag list. A `NAME:TAG` (or `NAME`, for
//! `NAME:latest`) is untagged; a manifest digest untags every tag that names it. The data
//! stays until `kiln store gc` finds it unreferenced (and past its grace period).

use serde_json::json;

use super::images::ImageRef;
use super::{CmdResult, Failure, Out, exit, open_existing_store};

/// Arguments of `kiln rmi`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The images: `NAME:TAG`, `NAME` (`NAME:latest`) or `sha256:<hex>` (every tag naming it).
    #[arg(required = true)]
    references: Vec<ImageRef>,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, then
    /// the config file, then `~/.local/share/kiln/store` (see `kiln config show`).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln rmi`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    for r in &a.references {
        let tags = match r {
            ImageRef::Tag(t) => vec![t.clone()],
            ImageRef::Digest(d) => {
                let tags: Vec<_> = store
                    .list_tags(None)
                    .await?
                    .into_iter()
                    .filter(|(_, m)| m == d)
                    .map(|(t, _)| t)
                    .collect();
                if tags.is_empty() {
                    return Err(Failure {
                        code: exit::NOT_FOUND,
                        error: anyhow::anyhow!("no tag of {} names {d}", store.url()),
                    });
                }
                tags
            }
        };
        for t in tags {
            // Expect the digest we resolved, so a tag moved meanwhile is left alone (exit 4).
            let expect = match r {
                ImageRef::Digest(d) => Some(*d),
                ImageRef::Tag(_) => None,
            };
            let was = store.untag(&t, expect).await?;
            out.event(
                "untagged",
                json!({"tag": t.to_string(), "manifest": was}),
                || format!("untagged {t} ({was}); its data stays until `kiln store gc`"),
            );
        }
    }
    Ok(())
}
