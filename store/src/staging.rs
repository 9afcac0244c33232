//! Chunk staging shared by every writer of chunks: an upload ([`crate::artifact`],
//! `put_artifact_reader`) and a copy between stores ([`crate::copy`]).
//!
//! A writer takes one batch of the store ([`Backend::stage_batch`]; locally, one pack file),
//! writes its chunks into it a group at a time with [`Store::stage_chunks`] (one
//! [`Backend::stage_many_if_absent`] per group, groups in parallel; the bookkeeping is a
//! [`Staging`] behind a mutex), and then either commits once with [`Store::commit_chunks`]
//! (before anything naming the chunks is written: chunks, then blobs and manifests, then the
//! tag) or, on a failure, forgets it all with [`Store::discard_chunks`] (a batch dropped
//! without either, e.g. a cancelled future, removes its temp pack as it drops). On S3 the
//! batch's packs are sent as they fill, and the commit sends the last one.

use std::sync::Mutex;

use crate::backend::{Backend, PutOutcome, StageBatch, Staged, StagedPut};
use crate::chunk;
use crate::progress::Reporter;
use crate::{Store, StoreError};

/// A batch's chunks (an upload's or a copy's) between their writes and the commit
/// ([`Store::commit_chunks`]). Memory: two digests per distinct chunk, plus a key and temp path (about 200 bytes) per
/// staged one.
#[derive(Default)]
pub(crate) struct Staging {
    /// Staged (digest, raw length in bytes, the backend's handle), in no particular order.
    pub(crate) pending: Vec<(crate::ChunkDigest, u64, StagedPut)>,
    /// Found present by writing them, or by a copy's lease look-up (not written again;
    /// indexed after the commit).
    pub(crate) found: Vec<crate::ChunkDigest>,
    /// How many an upload's lease found present (not written; not indexed, as before
    /// staging).
    pub(crate) leased: usize,
    /// Written for good at once (a backend that stages nothing).
    pub(crate) written: Vec<crate::ChunkDigest>,
    /// Every chunk this batch has written or is writing: a chunk the artifact holds again
    /// (a repeated block) is not written a second time. Before, each repeat was staged to a
    /// temp file of its own whose link then failed at the commit: 250 extra 64 KiB writes
    /// for a 512 MiB import (`KILN_BENCH_SIZE=512 ci/bench-store.sh`).
    pub(crate) claimed: std::collections::HashSet<crate::ChunkDigest>,
}

impl Store {
    /// Writes encoded chunks with one [`Backend::stage_many_if_absent`] into the writer's
    /// `batch` ([`Backend::stage_batch`]), in the order given (locally: appended to the
    /// batch's pack in that order): a staged one is queued in `staging` for
    /// [`Store::commit_chunks`], one found present is noted there. Returns, for each chunk,
    /// whether this call wrote its bytes (not for one this batch holds already, from an
    /// earlier call or earlier in `encs`). Errors: the first failed write (every result is
    /// noted in `staging` first, so that the discard removes what was written).
    pub(crate) async fn stage_chunks(
        &self,
        encs: &[&chunk::EncodedChunk],
        batch: &StageBatch,
        staging: &Mutex<Staging>,
    ) -> Result<Vec<bool>, StoreError> {
        // Claimed under the lock, before the write: of two copies in flight at once, one
        // writes. Should that write fail, the whole upload (or copy) fails with it.
        let mine: Vec<bool> = {
            let mut s = staging.lock().unwrap_or_else(|p| p.into_inner());
            encs.iter().map(|e| s.claimed.insert(e.digest)).collect()
        };
        let items: Vec<(String, bytes::Bytes)> = encs
            .iter()
            .zip(&mine)
            .filter(|(_, m)| **m)
            .map(|(e, _)| (e.digest.key(), e.stored.clone()))
            .collect();
        let mut results = if items.is_empty() {
            Vec::new()
        } else {
            self.backend.stage_many_if_absent(batch, items).await
        }
        .into_iter();
        let mut s = staging.lock().unwrap_or_else(|p| p.into_inner());
        let mut first_err = None;
        let wrote = encs
            .iter()
            .zip(mine)
            .map(|(enc, mine)| {
                if !mine {
                    return false;
                }
                match results.next() {
                    Some(Ok(Staged::Done(PutOutcome::Created))) => {
                        s.written.push(enc.digest);
                        true
                    }
                    Some(Ok(Staged::Done(PutOutcome::AlreadyExists))) => {
                        s.found.push(enc.digest);
                        false
                    }
                    Some(Ok(Staged::Pending(p))) => {
                        s.pending.push((enc.digest, enc.raw_len, p));
                        true
                    }
                    Some(Err(e)) => {
                        first_err.get_or_insert(StoreError::from(e));
                        false
                    }
                    None => {
                        first_err.get_or_insert_with(|| {
                            StoreError::io("stage", std::io::Error::other("a stage lost"))
                        });
                        false
                    }
                }
            })
            .collect();
        match first_err {
            Some(e) => Err(e),
            None => Ok(wrote),
        }
    }

    /// Commits what an upload or a copy staged into `batch` ([`Backend::commit_staged`]; locally the
    /// fsync of the batch's pack and its index's publication, which also make durable the
    /// chunks found present in the store). Skipped only when
    /// nothing was staged and nothing was found by asking the store (every chunk came from the
    /// known-chunk index, whose entries are durable). Then every chunk of the batch enters the
    /// known-chunk index (only now: the index must never name a chunk a power cut could still
    /// take away), and a staged chunk another writer published first is taken out of the
    /// totals (its progress event, sent when it was written, said `transferred`).
    pub(crate) async fn commit_chunks(
        &self,
        staging: Staging,
        batch: StageBatch,
        reporter: &Reporter,
    ) -> Result<(), StoreError> {
        let Staging {
            pending,
            found,
            leased,
            written,
            claimed: _,
        } = staging;
        if pending.is_empty() && found.is_empty() && leased == 0 {
            for d in written {
                self.known.insert(d);
            }
            return Ok(());
        }
        let (meta, staged): (Vec<_>, Vec<_>) = pending
            .into_iter()
            .map(|(d, raw_len, p)| ((d, raw_len, p.len), p))
            .unzip();
        let outcomes = self.backend.commit_staged(batch, staged).await?;
        let mut raced = 0u64;
        for ((d, raw_len, stored_len), o) in meta.iter().zip(&outcomes) {
            if *o == PutOutcome::AlreadyExists {
                raced += 1;
                reporter.uncount_transfer(*raw_len, *stored_len);
            }
            self.known.insert(*d);
        }
        if raced > 0 {
            tracing::debug!(
                store = %self.url(),
                chunks = raced,
                "staged chunks another writer had published meanwhile (its copy kept)"
            );
        }
        for d in found.into_iter().chain(written) {
            self.known.insert(d);
        }
        Ok(())
    }

    /// Forgets `batch` and what `staging` holds staged in it (removes what they wrote),
    /// after a failed upload or copy ([`Backend::discard_staged`]).
    pub(crate) async fn discard_chunks(&self, staging: Staging, batch: StageBatch) {
        self.backend
            .discard_staged(
                batch,
                staging.pending.into_iter().map(|(.., p)| p).collect(),
            )
            .await;
    }
}
