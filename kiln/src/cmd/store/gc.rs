//! `kiln store gc [--dry-run] [--grace DURATION] [--store URL]`: delete content-addressed
//! objects that no tag, live lease or build-cache entry reaches and that are older than the
//! grace period, and leases that are no longer live (expired, or held by a process of this
//! host that died) and expired cache entries. `--dry-run` lists them only.
//!
//! Then it compacts the store's partly dead packs (a local store: each pack at least half
//! dead is rewritten with its live chunks only, [`kiln_store::backend::local`]), and
//! reports the packs compacted and the bytes reclaimed (`compacted` event; `packsCompacted`
//! and `packBytesReclaimed` in the `gc` event). `--dry-run` compacts nothing and reports
//! what the compaction would reclaim once its deletes are done.
//!
//! For a local store it also cleans its build work directory (`<store>/.build`, the default
//! of `kiln build`): what dead builds left (step processes still in their cgroups, scratch
//! and unfinished directories, [`kiln_builder::build::clean_up_dead_builds`]), and, when no
//! build is running there, the unpacked layers of `layers/` and the microVM executor's disk
//! images of them under `run/`, a cache re-made from the store's blobs on use
//! ([`kiln_builder::workdir::collect_layers`]). A dry run removes none of it and
//! reports the layers it would.
//!
//! Whatever the store, it then empties this host's shared directory of unpacked layers (the
//! `layer_dir` setting, default `<cache>/layers`) the same way, when no build on the host
//! holds it, first removing what dead builds left unfinished there
//! ([`kiln_builder::workdir::collect_shared_layers`]): a layer there is unpacked again, from
//! the blob, by the next build that needs it.

use std::path::Path;
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
    if let kiln_store::StoreUrl::Local(root) = kiln_store::StoreUrl::parse(store.url())? {
        clean_work_dir(out, &root.join(".build"), a.dry_run, verb)?;
    }
    let config = crate::config::Config::load(&crate::config::Flags::store(a.store.as_deref()))?;
    clean_shared_layers(out, &config.layer_dir.value, a.dry_run, verb)?;
    for c in &r.collected {
        out.event(
            "collected",
            json!({"key": c.key, "size": c.size, "dryRun": a.dry_run}),
            || format!("{verb} {} ({} bytes)", c.key, c.size),
        );
    }
    for k in &r.resurrected {
        out.event("resurrected", json!({"key": k}), || {
            format!("kept {k}: a build relied on it while GC ran")
        });
    }
    for k in &r.expired {
        out.event("expired", json!({"key": k, "dryRun": a.dry_run}), || {
            format!("{verb} expired {k}")
        });
    }
    let c = &r.compacted;
    if c.packs > 0 || c.orphan_files > 0 {
        let verb = if a.dry_run {
            "would compact"
        } else {
            "compacted"
        };
        out.event(
            "compacted",
            json!({
                "packs": c.packs, "bytesBefore": c.bytes_before, "bytesCopied": c.bytes_copied,
                "bytesReclaimed": c.bytes_reclaimed, "orphanFiles": c.orphan_files,
                "dryRun": a.dry_run,
            }),
            || {
                let orphans = if c.orphan_files > 0 {
                    format!(", and removed {} pack files a crash left", c.orphan_files)
                } else {
                    String::new()
                };
                format!(
                    "{verb} {} packs: {} bytes reclaimed, their {} live bytes (of {}) copied{orphans}",
                    c.packs, c.bytes_reclaimed, c.bytes_copied, c.bytes_before
                )
            },
        );
    }
    let bytes: u64 = r.collected.iter().map(|c| c.size).sum();
    out.event(
        "gc",
        json!({
            "store": store.url(), "dryRun": a.dry_run, "marked": r.marked,
            "youngKept": r.young_kept, "collected": r.collected.len(), "collectedBytes": bytes,
            "condemned": r.condemned, "resurrected": r.resurrected.len(),
            "expired": r.expired.len(), "packsCompacted": r.compacted.packs,
            "packBytesReclaimed": r.compacted.bytes_reclaimed,
        }),
        || {
            format!(
                "{}: {} live, {} young kept, {verb} {} objects ({bytes} bytes) and {} expired leases/cache entries; {} {} packs ({} bytes)",
                store.url(),
                r.marked,
                r.young_kept,
                r.collected.len(),
                r.expired.len(),
                if a.dry_run { "would compact" } else { "compacted" },
                r.compacted.packs,
                r.compacted.bytes_reclaimed,
            )
        },
    );
    Ok(())
}

/// The work-directory part of `kiln store gc` for a local store (see the module docs).
fn clean_work_dir(out: &Out, work: &Path, dry_run: bool, verb: &str) -> CmdResult {
    if !dry_run {
        let cgroup_parent = kiln_builder::exec::ExecConfig::default().cgroup_parent;
        let dead = kiln_builder::build::clean_up_dead_builds(work, &cgroup_parent);
        for p in dead.cgroups.iter().chain(&dead.dirs) {
            out.event("deadBuild", json!({"path": p}), || {
                format!("removed {} of a dead build", p.display())
            });
        }
    }
    let layers = work.join("layers");
    let c = kiln_builder::workdir::collect_layers(work, dry_run)
        .map_err(|e| anyhow::anyhow!("collecting unpacked layers in {}: {e}", layers.display()))?;
    layers_event(out, &layers, &c, dry_run, verb, true);
    Ok(())
}

/// The `layers` event of one collection `c` of unpacked layers in `dir`; the text names the
/// microVM disk images of layers when `images` (a work directory's, not the host's shared
/// directory, which has none).
fn layers_event(
    out: &Out,
    dir: &Path,
    c: &kiln_builder::workdir::LayersCollected,
    dry_run: bool,
    verb: &str,
    images: bool,
) {
    out.event(
        "layers",
        json!({"path": dir, "busy": c.busy, "dirs": c.dirs, "images": c.images,
               "bytes": c.bytes, "dryRun": dry_run}),
        || {
            if c.busy {
                format!("{}: kept, a build is using it", dir.display())
            } else if images {
                format!(
                    "{}: {verb} {} unpacked layers and {} microVM disk images of layers ({} bytes)",
                    dir.display(),
                    c.dirs,
                    c.images,
                    c.bytes
                )
            } else {
                format!(
                    "{}: {verb} {} unpacked layers ({} bytes)",
                    dir.display(),
                    c.dirs,
                    c.bytes
                )
            }
        },
    );
}

/// The host's shared layer directory's part of `kiln store gc` (see the module docs).
fn clean_shared_layers(out: &Out, dir: &Path, dry_run: bool, verb: &str) -> CmdResult {
    let c = kiln_builder::workdir::collect_shared_layers(dir, dry_run)
        .map_err(|e| anyhow::anyhow!("collecting shared layers in {}: {e}", dir.display()))?;
    layers_event(out, dir, &c, dry_run, verb, false);
    Ok(())
}
