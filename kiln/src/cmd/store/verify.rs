//! `kiln store verify [--deep] [--store URL]`: every tag names a manifest that parses, and
//! every chunk and blob it reaches exists (`--deep`: and hashes right). Lists orphans and
//! whether GC would collect them. Exit 3 when anything is wrong (orphans are not problems).

use std::time::Duration;

use kiln_store::gc::GcOptions;
use serde_json::json;

use crate::cmd::{CmdResult, Failure, Out, exit, open_existing_store, parse_duration};

/// Arguments of `kiln store verify`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Also read every chunk and blob and check its digest.
    #[arg(long)]
    deep: bool,
    /// Grace period used to say whether GC would collect an orphan now.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration)]
    grace: Duration,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln store verify`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    let gc = GcOptions {
        grace: a.grace,
        ..GcOptions::default()
    };
    let r = store.verify(a.deep, &gc).await?;
    for f in &r.findings {
        out.event("finding", json!(f), || format!("problem: {}", json!(f)));
    }
    for o in &r.orphans {
        out.event("orphan", json!(o), || {
            let when = if o.collectable {
                "GC would delete it"
            } else {
                "younger than the grace period"
            };
            format!("orphan: {} ({} bytes, {when})", o.key, o.size)
        });
    }
    out.event(
        "verified",
        json!({
            "store": store.url(), "deep": a.deep, "ok": r.is_ok(),
            "problems": r.findings.len(), "orphans": r.orphans.len(),
            "manifests": r.manifests, "chunks": r.chunks, "blobs": r.blobs,
            "packDeadBytes": r.pack_dead_bytes,
        }),
        || {
            format!(
                "{}: {} manifests, {} chunks, {} blobs checked{}; {} problems, {} orphans{}",
                store.url(),
                r.manifests,
                r.chunks,
                r.blobs,
                if a.deep { " (deep)" } else { "" },
                r.findings.len(),
                r.orphans.len(),
                if r.pack_dead_bytes > 0 {
                    format!("; {} bytes of packs unused (dead)", r.pack_dead_bytes)
                } else {
                    String::new()
                }
            )
        },
    );
    if r.is_ok() {
        Ok(())
    } else {
        Err(Failure {
            code: exit::DAMAGED,
            error: anyhow::anyhow!("{}: {} problems found", store.url(), r.findings.len()),
        })
    }
}
