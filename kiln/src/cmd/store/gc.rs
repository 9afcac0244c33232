//! `kiln store gc [--dry-run] [--grace DURATION] [--store URL]`: delete content-addressed
//! objects that no tag, live lease or build-cache entry reaches and that are older than the
//! grace period, and expired leases and cache entries. `--dry-run` lists them only.

use std::time::Duration;

use kiln_store::gc::GcOptions;
use kiln_store::lease::DEFAULT_CACHE_TTL;
use serde_json::json;

use crate::cmd::{CmdResult, Out, open_existing_store, parse_duration};

/// Arguments of `kiln store gc`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// List what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Keep unreachable objects younger than this (e.g. `1h`, `30m`, `0s`).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration)]
    grace: Duration,
    /// Build-cache entries younger than this are roots; default 14 days.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    cache_ttl: Option<Duration>,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln store gc`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    let opts = GcOptions {
        grace: a.grace,
        cache_ttl: a.cache_ttl.unwrap_or(DEFAULT_CACHE_TTL),
        dry_run: a.dry_run,
    };
    let r = store.gc(&opts).await?;
    let verb = if a.dry_run { "would delete" } else { "deleted" };
    for c in &r.collected {
        out.event(
            "collected",
            json!({"key": c.key, "size": c.size, "dryRun": a.dry_run}),
            || format!("{verb} {} ({} bytes)", c.key, c.size),
        );
    }
    for k in &r.expired {
        out.event("expired", json!({"key": k, "dryRun": a.dry_run}), || {
            format!("{verb} expired {k}")
        });
    }
    let bytes: u64 = r.collected.iter().map(|c| c.size).sum();
    out.event(
        "gc",
        json!({
            "store": store.url(), "dryRun": a.dry_run, "marked": r.marked,
            "youngKept": r.young_kept, "collected": r.collected.len(), "collectedBytes": bytes,
            "expired": r.expired.len(),
        }),
        || {
            format!(
                "{}: {} live, {} young kept, {verb} {} objects ({bytes} bytes) and {} expired leases/cache entries",
                store.url(),
                r.marked,
                r.young_kept,
                r.collected.len(),
                r.expired.len()
            )
        },
    );
    Ok(())
}
