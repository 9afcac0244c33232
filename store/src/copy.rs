//! Copy between stores: push and pull of a tag and everything it references, or of an OCI
//! reference ([`copy_oci_ref`]) and the blobs it reaches.
//!
//! [`copy_tag`] reads the tag in the source, collects the closure of manifests it reaches,
//! and copies, in publish order: chunks (in parallel, bounded, skipping chunks the
//! destination's lease look-up finds present; each chunk is decompressed and verified before
//! it is written, so corruption is never passed on), then blobs (verified), then manifests
//! (referenced before referencing), then the tag. The chunks of one copy are staged into one
//! batch of the destination ([`Backend::stage_batch`], one [`Backend::stage_many_if_absent`]
//! per read batch) and
//! committed once ([`Backend::commit_staged`]) before any blob, manifest or tag is written:
//! a pull into a local store makes one pack file with one fsync (`crate::backend::local`,
//! "Packs"), not one file per chunk; a push to S3 makes pack objects
//! (`crate::backend::s3`, "Packs"), not one object per chunk. The bookkeeping is the upload's (`crate::staging`): a chunk enters the
//! destination's known-chunk index only after the commit, and a staged chunk another writer
//! committed first is taken out of the totals. A failed copy discards its batch (a cancelled
//! one's batch removes its temp pack as it drops). Every object goes through put-if-absent
//! (chunks: stage-if-absent), so a rerun after a crash moves only what is missing. A lease on
//! the destination covers every object relied on until the tag is set. A snapshot manifest
//! the destination did not have has its prefetch list's chunks written again into a pack of
//! their own once the chunks are committed ([`Store::pack_prefetch`]; on S3 only).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::backend::Backend;
use crate::digest::{BlobDigest, ChunkDigest, ManifestDigest};
use crate::manifest::{ObjectRef, RawManifest, references};
use crate::ociref::OciRef;
use crate::progress::{ProgressEvent, ProgressFn, Reporter, TransferStats};
use crate::staging::Staging;
use crate::tag::TagRef;
use crate::{Store, StoreError};

/// A chunk of a copy's read batch: digest, raw length, and its stored bytes as read
/// (`None`: present in the destination, not read).
type ToCopy = (ChunkDigest, u64, Option<Result<Bytes, StoreError>>);

/// Chunks of one read batch verified at once by a copy (then staged together).
const STAGES_PER_BATCH: usize = 4;

/// Blobs up to this size (bytes, 64 MiB) are copied in memory; larger ones through a temp file.
pub const IN_MEMORY_BLOB_LIMIT: u64 = 64 << 20;

/// Options for [`copy_tag`] and [`copy_manifest`].
#[derive(Clone)]
pub struct CopyOptions {
    /// Progress callback.
    pub progress: Option<ProgressFn>,
    /// Expiry of the destination lease held during the copy (default 1 h).
    pub lease_ttl: Duration,
}

impl Default for CopyOptions {
    fn default() -> Self {
        Self {
            progress: None,
            lease_ttl: Duration::from_secs(3600),
        }
    }
}

/// What a copy did.
#[derive(Debug, Clone)]
pub struct CopyReport {
    /// The top manifest copied.
    pub manifest: ManifestDigest,
    /// Totals (dedup ratio: [`TransferStats::dedup_ratio`]).
    pub stats: TransferStats,
}

/// Copies `tag` from `src` to `dst` (same name and tag), then sets it on `dst` whatever it
/// named there before. Errors: the tag missing in `src`, any read/verify/write failure.
pub async fn copy_tag(
    src: &Store,
    dst: &Store,
    tag: &TagRef,
    opts: &CopyOptions,
) -> Result<CopyReport, StoreError> {
    let digest = src.resolve_tag(tag).await?;
    let reporter = Reporter::new(opts.progress.clone());
    let lease = copy_closure(src, dst, digest, opts, &reporter).await?;
    dst.force_tag(tag, digest).await?;
    lease.release().await?;
    reporter.emit(ProgressEvent::Tag {
        tag: tag.to_string(),
        manifest: digest,
    });
    Ok(CopyReport {
        manifest: digest,
        stats: reporter.totals(),
    })
}

/// Copies manifest `digest` and everything it references (no tag).
pub async fn copy_manifest(
    src: &Store,
    dst: &Store,
    digest: ManifestDigest,
    opts: &CopyOptions,
) -> Result<CopyReport, StoreError> {
    let reporter = Reporter::new(opts.progress.clone());
    let lease = copy_closure(src, dst, digest, opts, &reporter).await?;
    lease.release().await?;
    Ok(CopyReport {
        manifest: digest,
        stats: reporter.totals(),
    })
}

async fn copy_closure(
    src: &Store,
    dst: &Store,
    top: ManifestDigest,
    opts: &CopyOptions,
    reporter: &Reporter,
) -> Result<crate::lease::Lease, StoreError> {
    // Closure of manifests, breadth first from the top.
    let mut order: Vec<RawManifest> = Vec::new();
    let mut chunks: Vec<(ChunkDigest, u64)> = Vec::new();
    let mut blobs: Vec<BlobDigest> = Vec::new();
    let mut seen: HashSet<ObjectRef> = HashSet::new();
    let mut queue = VecDeque::from([top]);
    seen.insert(ObjectRef::Manifest(top));
    while let Some(d) = queue.pop_front() {
        let raw = src.get_raw_manifest(&d).await?;
        let m = raw.parse()?;
        let lens = crate::verify::max_raw_lens(&m);
        for r in references(&m) {
            if !seen.insert(r) {
                continue;
            }
            match r {
                ObjectRef::Manifest(c) => queue.push_back(c),
                ObjectRef::Blob(b) => blobs.push(b),
                ObjectRef::Chunk(c) => chunks.push((c, lens.get(&c).copied().unwrap_or(0))),
            }
        }
        order.push(raw);
    }
    let lease_id = format!(
        "copy-{}-{}-{}",
        &top.hex()[..16],
        crate::hostname().replace(|c: char| !c.is_ascii_alphanumeric(), "-"),
        std::process::id()
    );
    let lease = dst
        .create_lease(&lease_id, opts.lease_ttl, seen.iter().copied())
        .await?;
    // Everything is leased before it is looked up (under the sweep lock) or written, so GC
    // with any grace period spares it (crate::gc).
    let wanted: Vec<ObjectRef> = seen.iter().copied().collect();
    let present = &lease.find_present(&wanted).await?;

    // Chunks, staged into one batch of `dst` (locally: one pack file) and committed once,
    // before any blob, manifest or tag naming them is written.
    let batch_owned = dst.backend.stage_batch();
    let batch = &batch_owned;
    let staging = &Mutex::new(Staging::default());
    // Read in batches ([`crate::artifact::READ_BATCH`] chunks, one `get_chunks_stored`: on S3
    // a few ranged GETs of the packs holding them), each batch's chunks then verified a few
    // at a time and staged together (locally: one blocking call for the batch).
    let groups: Vec<Vec<(ChunkDigest, u64)>> = chunks
        .chunks(crate::artifact::READ_BATCH)
        .map(<[(ChunkDigest, u64)]>::to_vec)
        .collect();
    let copied = futures::stream::iter(groups)
        .map(|group| async move {
            let missing: Vec<ChunkDigest> = group
                .iter()
                .map(|(c, _)| *c)
                .filter(|c| !present.contains(&ObjectRef::Chunk(*c)))
                .collect();
            let mut read = src.get_chunks_stored(&missing).await.into_iter();
            let items: Vec<ToCopy> = group
                .into_iter()
                .map(|(c, len)| {
                    let r = if present.contains(&ObjectRef::Chunk(c)) {
                        None
                    } else {
                        Some(read.next().unwrap_or_else(|| {
                            Err(StoreError::io("copy", std::io::Error::other("read lost")))
                        }))
                    };
                    (c, len, r)
                })
                .collect();
            // Each chunk read is verified before it is written: corruption is never passed
            // on. Then the batch's chunks are staged with one `stage_chunks`.
            let checked: Vec<(ChunkDigest, u64, Option<crate::chunk::EncodedChunk>)> =
                futures::stream::iter(items)
                    .map(|(c, len, read)| async move {
                        let Some(stored) = read else {
                            return Ok::<_, StoreError>((c, len, None));
                        };
                        let stored = stored?;
                        let url = src.url().to_string();
                        let s2 = stored.clone();
                        tokio::task::spawn_blocking(move || {
                            crate::chunk::decode(&c, &s2, len, &url)
                        })
                        .await??;
                        let enc = crate::chunk::EncodedChunk {
                            digest: c,
                            raw_len: len,
                            stored,
                        };
                        Ok((c, len, Some(enc)))
                    })
                    .buffered(STAGES_PER_BATCH)
                    .try_collect()
                    .await?;
            let encs: Vec<&crate::chunk::EncodedChunk> =
                checked.iter().filter_map(|(_, _, e)| e.as_ref()).collect();
            let mut wrote = dst.stage_chunks(&encs, batch, staging).await?.into_iter();
            for (c, len, enc) in checked {
                let (stored_len, transferred) = match enc {
                    Some(enc) => (enc.stored.len() as u64, wrote.next().unwrap_or(false)),
                    None => {
                        // Indexed as known after the commit (which makes it durable here
                        // too).
                        staging
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .found
                            .push(c);
                        (0, false)
                    }
                };
                reporter.emit(ProgressEvent::Chunk {
                    digest: c,
                    raw_len: len,
                    stored_len,
                    transferred,
                });
            }
            Ok::<_, StoreError>(())
        })
        .buffer_unordered(crate::artifact::batches_in_flight(
            src.parallelism.max(dst.parallelism),
        ))
        .try_collect::<()>()
        .await;
    let staging = std::mem::take(&mut *staging.lock().unwrap_or_else(|p| p.into_inner()));
    if let Err(e) = copied {
        dst.discard_chunks(staging, batch_owned).await;
        return Err(e);
    }
    dst.commit_chunks(staging, batch_owned, reporter).await?;

    // A snapshot that comes into `dst` with this copy: its prefetch list's chunks into a
    // pack of their own, in the order a clone's chunk server fetches them
    // ([`Store::pack_prefetch`]; on S3, where a push's packs hold them among others,
    // interleaved by the batches in flight). A failure is a warning: the chunks are here.
    for raw in &order {
        if present.contains(&ObjectRef::Manifest(raw.digest)) {
            continue;
        }
        if let Ok(crate::Manifest::Snapshot(s)) = raw.parse() {
            let span = tracing::info_span!("pack_prefetch", snapshot = %raw.digest);
            tracing::Instrument::instrument(dst.pack_prefetch(&s), span).await;
        }
    }

    // Blobs.
    for b in blobs {
        copy_blob(src, dst, b, reporter, present).await?;
    }

    // Manifests, referenced before referencing.
    for raw in order.iter().rev() {
        let transferred = !present.contains(&ObjectRef::Manifest(raw.digest));
        if transferred {
            dst.put_raw_manifest(raw).await?;
        }
        reporter.emit(ProgressEvent::Manifest {
            digest: raw.digest,
            transferred,
        });
    }
    // The caller releases the lease once the tag is set (or the copy is abandoned).
    Ok(lease)
}

/// Copies one blob unless `present` (what the copy's lease found in `dst`) has it (verified
/// on read; large blobs through a temp file).
async fn copy_blob(
    src: &Store,
    dst: &Store,
    b: BlobDigest,
    reporter: &Reporter,
    present: &HashSet<ObjectRef>,
) -> Result<(), StoreError> {
    let found = if present.contains(&ObjectRef::Blob(b)) {
        dst.backend.head(&b.key()).await?
    } else {
        None
    };
    let (size, transferred) = match found {
        Some(i) => (i.size, false),
        None => {
            let size = src.read_head(&b.key()).await?.map(|i| i.size).unwrap_or(0);
            if size <= IN_MEMORY_BLOB_LIMIT {
                let data = src.get_blob(&b).await?;
                dst.put_blob(data).await?;
            } else {
                let dir = tempfile_dir();
                let tmp = dir.join(format!("kiln-copy-{}-{}", b.hex(), std::process::id()));
                let r = async {
                    src.get_blob_to_file(&b, &tmp).await?;
                    dst.put_blob_file(&tmp).await
                }
                .await;
                let _ = tokio::fs::remove_file(&tmp).await;
                r?;
            }
            (size, true)
        }
    };
    reporter.emit(ProgressEvent::Blob {
        digest: b,
        size,
        transferred,
    });
    Ok(())
}

/// What [`copy_oci_ref`] did.
#[derive(Debug, Clone)]
pub struct OciCopyReport {
    /// The OCI manifest or index blob the reference names.
    pub digest: BlobDigest,
    /// Totals (blobs only).
    pub stats: TransferStats,
}

/// Copies the OCI reference `r` from `src` to `dst`: every blob it reaches (its manifest or
/// index, the stored manifests of an index, configs and layers), verified, under a lease on
/// `dst`, then sets the reference there. Errors: the reference missing in `src`
/// ([`crate::BackendError::NotFound`] on its key), a blob it needs absent in `src`, any
/// read/verify/write failure.
pub async fn copy_oci_ref(
    src: &Store,
    dst: &Store,
    r: &OciRef,
    opts: &CopyOptions,
) -> Result<OciCopyReport, StoreError> {
    let digest = src
        .get_oci_ref(r)
        .await?
        .ok_or_else(|| crate::BackendError::NotFound {
            store: src.url().to_string(),
            key: r.key(),
        })?;
    let (lease, report) = copy_oci_blobs(src, dst, digest, opts).await?;
    dst.set_oci_ref(r, digest).await?;
    lease.release().await?;
    Ok(report)
}

/// Copies the OCI manifest or index blob `digest` from `src` to `dst` with every blob it
/// reaches, as [`copy_oci_ref`] does, without a reference: for a caller that names it
/// otherwise (a kiln image manifest's `oci_manifest`, a reference set afterwards). What is
/// copied is unprotected by a lease once this returns. Errors: as [`copy_oci_ref`]'s, a
/// missing blob named by its key in `src`.
pub async fn copy_oci_manifest(
    src: &Store,
    dst: &Store,
    digest: BlobDigest,
    opts: &CopyOptions,
) -> Result<OciCopyReport, StoreError> {
    let (lease, report) = copy_oci_blobs(src, dst, digest, opts).await?;
    lease.release().await?;
    Ok(report)
}

/// The blobs `digest` reaches, copied from `src` to `dst` under a lease on `dst`, which is
/// returned still held.
async fn copy_oci_blobs(
    src: &Store,
    dst: &Store,
    digest: BlobDigest,
    opts: &CopyOptions,
) -> Result<(crate::lease::Lease, OciCopyReport), StoreError> {
    let closure = src.oci_closure(digest, true).await?;
    if let Some((b, _)) = closure
        .missing
        .first()
        .copied()
        .or_else(|| (!closure.top_present).then_some((digest, digest)))
    {
        return Err(crate::BackendError::NotFound {
            store: src.url().to_string(),
            key: b.key(),
        }
        .into());
    }
    let reporter = Reporter::new(opts.progress.clone());
    let lease_id = format!(
        "copy-oci-{}-{}-{}",
        &digest.hex()[..16],
        crate::hostname().replace(|c: char| !c.is_ascii_alphanumeric(), "-"),
        std::process::id()
    );
    let lease = dst
        .create_lease(
            &lease_id,
            opts.lease_ttl,
            closure.blobs.iter().map(|b| ObjectRef::Blob(*b)),
        )
        .await?;
    let wanted: Vec<ObjectRef> = closure.blobs.iter().map(|b| ObjectRef::Blob(*b)).collect();
    let present = lease.find_present(&wanted).await?;
    // Configs and layers before the manifests naming them: the closure lists a manifest
    // before what it names, so copy in reverse.
    for b in closure.blobs.iter().rev() {
        copy_blob(src, dst, *b, &reporter, &present).await?;
    }
    Ok((
        lease,
        OciCopyReport {
            digest,
            stats: reporter.totals(),
        },
    ))
}

fn tempfile_dir() -> std::path::PathBuf {
    std::env::var_os("TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/var/tmp".into())
}
