//! What `kiln store push` and `kiln store pull` share: copy one tag between two stores with a
//! progress display, then report totals.

use kiln_store::TagRef;
use kiln_store::copy::{CopyOptions, copy_tag};
use kiln_store::manifest::Manifest;
use serde_json::json;

use crate::cmd::progress::Progress;
use crate::cmd::{CmdResult, Out, open_existing_store, open_store};

/// Copies `tag` from store `src` to store `dst` (default store when `None`); `verb` names the
/// direction in messages and the final event (`pushed`, `pulled`).
pub async fn copy(
    out: &Out,
    tag: &TagRef,
    src: Option<&str>,
    dst: Option<&str>,
    verb: &str,
) -> CmdResult {
    let src = open_existing_store(src).await?;
    let dst = open_store(dst).await?;
    // The bar's total: the raw size of the image (or snapshot disk + memory) behind the tag.
    let digest = src.resolve_tag(tag).await?;
    let total = match src.get_manifest(&digest).await? {
        Manifest::Image(m) => m.disk.size,
        Manifest::Snapshot(m) => m.disk.size.saturating_add(m.memory.size),
    };
    let progress = Progress::new(out, total, verb);
    let opts = CopyOptions {
        progress: Some(progress.callback(out)),
        ..CopyOptions::default()
    };
    let report = copy_tag(&src, &dst, tag, &opts).await?;
    progress.finish();
    let s = report.stats;
    out.event(
        verb,
        json!({
            "tag": tag.to_string(), "manifest": report.manifest,
            "from": src.url(), "to": dst.url(),
            "stats": s, "dedupRatio": s.dedup_ratio(),
        }),
        || {
            format!(
                "{verb} {tag} ({}) {} -> {}: {} chunks, {} moved, dedup {:.1}%, {} bytes moved",
                report.manifest,
                src.url(),
                dst.url(),
                s.chunks,
                s.chunks_transferred,
                s.dedup_ratio() * 100.0,
                s.stored_bytes_transferred
            )
        },
    );
    Ok(())
}
