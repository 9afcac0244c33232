//! What `kiln store push` and `kiln store pull` share: copy one tag between two stores with a
//! progress display, then report totals. A name that is no tag of the source store but an OCI
//! reference (a pulled or imported image, `registry/repository:tag`) is copied with its blobs.

use kiln_store::copy::{CopyOptions, copy_oci_ref, copy_tag};
use kiln_store::manifest::Manifest;
use kiln_store::{OciRef, TagRef};
use serde_json::json;

use crate::cmd::progress::Progress;
use crate::cmd::{CmdResult, Out, open_existing_store, open_store};

/// Copies `tag` from store `src` to store `dst` (default store when `None`); `verb` names the
/// direction in messages and the final event (`pushed`, `pulled`).
pub async fn copy(
    out: &Out,
    name: &str,
    src: Option<&str>,
    dst: Option<&str>,
    verb: &str,
) -> CmdResult {
    let src = open_existing_store(out, src).await?;
    let dst = open_store(out, dst).await?;
    // `myorg/app:v1` may be a store tag or an OCI reference: the store's own tags first, as a
    // FROM looks; when it is neither, the error is about the tag.
    let tag = name.parse::<TagRef>();
    let oci = match (&tag, name.contains('/')) {
        (_, false) => None,
        (Ok(t), true) if src.get_tag(t).await?.is_some() => None,
        (Ok(_), true) => match name.parse::<OciRef>() {
            Ok(r) if src.get_oci_ref(&r).await?.is_some() => Some(r),
            _ => None,
        },
        (Err(_), true) => Some(
            name.parse::<OciRef>()
                .map_err(kiln_store::StoreError::from)?,
        ),
    };
    if let Some(r) = oci {
        let report = copy_oci_ref(&src, &dst, &r, &CopyOptions::default()).await?;
        let s = report.stats;
        out.event(
            verb,
            json!({
                "reference": r.to_string(), "digest": report.digest.to_string(),
                "from": src.url(), "to": dst.url(), "stats": s,
            }),
            || {
                format!(
                    "{verb} {r} ({}) {} -> {}: {} blobs, {} moved",
                    report.digest,
                    src.url(),
                    dst.url(),
                    s.blobs,
                    s.blobs_transferred
                )
            },
        );
        return Ok(());
    }
    let tag: &TagRef = &tag.map_err(kiln_store::StoreError::from)?;
    // The bar's total: the raw size of the image (or snapshot disk + memory) behind the tag.
    let digest = src.resolve_tag(tag).await?;
    let total = match src.get_manifest(&digest).await? {
        Manifest::Image(m) => m.disk.size,
        Manifest::Snapshot(m) => m.disk.size.saturating_add(m.memory.size),
    };
    let progress = Progress::new(out, total, verb);
    progress.watch_retries(out, &src);
    progress.watch_retries(out, &dst);
    let opts = CopyOptions {
        progress: Some(progress.callback(out)),
        ..CopyOptions::default()
    };
    let report = copy_tag(&src, &dst, tag, &opts).await;
    progress.finish();
    let report = report?;
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
