//! `kiln store export NAME:TAG FILE`: write the image a tag names to a file, streaming, as a
//! sparse file (holes for zero chunks); every chunk is verified against its digest.

use std::path::PathBuf;

use kiln_store::TagRef;
use kiln_store::manifest::Manifest;
use serde_json::json;

use crate::cmd::progress::Progress;
use crate::cmd::{CmdResult, Out, open_existing_store};

/// Arguments of `kiln store export`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image's tag.
    source: TagRef,
    /// Where to write it (replaced atomically).
    file: PathBuf,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln store export`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    let digest = store.resolve_tag(&a.source).await?;
    let table = match store.get_manifest(&digest).await? {
        Manifest::Image(m) => m.disk,
        Manifest::Snapshot(m) => m.disk,
    };
    let progress = Progress::new(out, table.size, "export");
    progress.watch_retries(out, &store);
    let written = store
        .materialize(&table, &a.file, Some(progress.callback(out)))
        .await;
    progress.finish();
    let written = written?;
    out.event(
        "exported",
        json!({"tag": a.source.to_string(), "manifest": digest, "file": a.file, "size": table.size, "written": written}),
        || format!("{} -> {} ({} bytes, {written} written)", a.source, a.file.display(), table.size),
    );
    Ok(())
}
