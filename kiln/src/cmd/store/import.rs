//! `kiln store import FILE NAME:TAG`: store a file (an ext4 image) as an image manifest and
//! tag it: chunks, then manifest, then tag, under a lease so that GC keeps what the import
//! relies on until the tag is set. Rerun after a crash, it uploads only missing chunks.

use std::path::PathBuf;
use std::time::Duration;

use kiln_store::TagRef;
use kiln_store::artifact::PutArtifactOptions;
use kiln_store::manifest::{ImageManifest, Manifest};
use serde_json::json;

use crate::cmd::progress::Progress;
use crate::cmd::{CmdResult, Out, open_store};

/// Arguments of `kiln store import`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The file to store.
    file: PathBuf,
    /// The tag to set, `NAME:TAG` (name `[a-z0-9._-]`, no registry host or `/`).
    target: TagRef,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// How long the import's lease lasts if this process dies without releasing it.
const LEASE_TTL: Duration = Duration::from_secs(6 * 3600);

/// Runs `kiln store import`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_store(out, a.store.as_deref()).await?;
    let size = std::fs::metadata(&a.file)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.file.display()))?
        .len();
    let lease = std::sync::Arc::new(
        store
            .create_lease(&crate::cmd::lease_id("import"), LEASE_TTL, [])
            .await?,
    );
    let progress = Progress::new(out, size, "import");
    progress.watch_retries(out, &store);
    let opts = PutArtifactOptions {
        chunking: None,
        lease: Some(lease.clone()),
        progress: Some(progress.callback(out)),
        memo: None,
    };
    let stored = async {
        let (table, _) = store.put_artifact(&a.file, &opts).await?;
        // Leased before it is written (kiln_store::gc).
        let raw = lease
            .put_manifest(&Manifest::Image(ImageManifest::new(table)))
            .await?;
        let previous = store.force_tag(&a.target, raw.digest).await?;
        Ok::<_, kiln_store::StoreError>((raw, previous))
    }
    .await;
    progress.finish();
    let (raw, previous) = stored?;
    lease.release().await?;
    let s = progress.stats();
    out.event(
        "imported",
        json!({
            "tag": a.target.to_string(), "manifest": raw.digest, "previous": previous,
            "size": size, "chunks": s.chunks, "chunksPresent": s.chunks - s.chunks_transferred,
            "bytes": s.raw_bytes, "bytesPresent": s.raw_bytes - s.raw_bytes_transferred,
            "storedUploaded": s.stored_bytes_transferred, "holeBytes": s.hole_bytes,
        }),
        || {
            format!(
                "{} -> {} ({} chunks, {} already present, dedup {:.1}%, {} bytes uploaded)",
                a.target,
                raw.digest,
                s.chunks,
                s.chunks - s.chunks_transferred,
                s.dedup_ratio() * 100.0,
                s.stored_bytes_transferred
            )
        },
    );
    Ok(())
}
