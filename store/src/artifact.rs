//! Artifacts: large files stored as chunks plus a [`ChunkTable`].
//!
//! - Upload ([`Store::put_artifact`]): the input is cut on a blocking thread (a file by
//!   [`crate::chunk::split_parallel`], content-defined cuts found a batch of 8 MiB per core at
//!   a time on up to 4 cores, at most `cores × 8 MiB + 2 × max chunk` of input held; any other
//!   reader by [`crate::chunk::split`], one chunk at a time; the same chunks either way); chunks are hashed and compressed (a chunk whose digest [`PutArtifactOptions::memo`] holds is only hashed:
//!   [`crate::memo`]) on the upload's own threads (one per core, at most
//!   [`crate::StoreOptions::parallelism`] chunks in flight) and stored with put-if-absent; the cutter runs at
//!   most [`READ_AHEAD`] bytes of cut chunks ahead of the encoders, so that it reads and cuts
//!   the next batch while the last is encoded (memory: that, plus about
//!   `2 × parallelism × max chunk`, plus [`GROUPS_IN_FLIGHT`] groups of compressed chunks,
//!   the older ones being looked up and written while the next is encoded). All-zero chunks
//!   become holes. Encoded chunks are stored a group at a time: with a lease, groups of
//!   [`LEASE_BATCH`]; without, the chunks encoded by the time the group is taken (at most
//!   [`LEASE_BATCH`]). Without a lease, chunks in the known-chunk index are skipped. With a
//!   lease, each group is added to the lease and only then looked up, under the store's
//!   sweep lock ([`Lease::find_present`]); those found are relied on, the rest written, so
//!   GC with any grace period keeps every chunk of the table (see [`crate::gc`]). A group's
//!   chunks are written with one [`Backend::stage_many_if_absent`] (locally one blocking
//!   call for the group, not one per chunk) into the upload's batch
//!   ([`Backend::stage_batch`], owned by the upload and given back to the commit), the
//!   groups one after another in input order (so a pack holds its chunks in input order),
//!   and committed once at the end ([`Backend::commit_staged`]; the bookkeeping, shared with a
//!   copy between stores, is `crate::staging`'s): locally all go into one pack file made
//!   durable by one fsync and visible by one index (the promise and its argument:
//!   [`crate::backend::local`]); on S3 into pack objects of 32 MiB, each visible by its index
//!   once sent ([`crate::backend::s3`], "Packs"). The table is returned in input order; publish a
//!   manifest naming it only after this returns (chunks, then manifest, then tag). Rerunning
//!   after a crash uploads only what is missing (locally: what was committed is kept).
//! - Random reads ([`ArtifactReader::read_at`]): offset → chunk by binary search, chunk
//!   fetched, decompressed and verified (through the read cache when configured).
//! - [`Store::materialize`]: writes the artifact to a sparse file (holes for zero entries) with
//!   positional writes, bounded parallelism, to `<dest>.partial` then renamed.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::backend::Backend;
use crate::chunk::{self, ChunkEntry, ChunkError, ChunkTable, Chunking};
use crate::lease::Lease;
use crate::manifest::ObjectRef;
use crate::memo::EncodeMemo;
use crate::progress::{ProgressEvent, ProgressFn, Reporter, TransferStats};
use crate::staging::Staging;

/// Chunks leased (and then stored) per group during an upload: 256, 16 MiB of 64 KiB chunks.
/// Each group costs a lease part (locally a file written and fsynced, renamed, its directory
/// fsynced; on S3 a PUT), the sweep lock and a look-up.
///
/// Measured (issue 33, `strace -f -T` of `kiln store import` of a 256 MiB tarball of `/usr`
/// into a new local store): with groups of 64, 48 lease parts and 108 fsyncs of 0.1 to 17 ms
/// each, in the pipeline between encoding and writing.
const LEASE_BATCH: usize = 256;
/// Groups of chunks in flight during an upload (of [`LEASE_BATCH`] chunks when leased), in
/// order: the older ones leased, looked up and written while the newest is encoded. Encoding stops while all
/// are busy: with 2 (one written, one encoded), every lease part's fsyncs stopped it, and an
/// import used about 1.4 of 2 cores (issue 33).
const GROUPS_IN_FLIGHT: usize = 3;
use crate::{Store, StoreError};

/// Options for [`Store::put_artifact`].
#[derive(Clone, Default)]
pub struct PutArtifactOptions {
    /// How to cut; `None` means [`Chunking::DISK_DEFAULT`].
    pub chunking: Option<Chunking>,
    /// A lease to record every chunk relied on (uploaded or found present).
    pub lease: Option<Arc<Lease>>,
    /// Progress callback.
    pub progress: Option<ProgressFn>,
    /// Chunks encoded ahead ([`crate::memo`]): a chunk whose digest it holds is not
    /// compressed again. The table is the same with or without it.
    pub memo: Option<Arc<EncodeMemo>>,
}

/// Bytes of raw chunks cut and not yet hashed and compressed that an upload holds at most
/// (32 MiB): two batches of [`chunk::split_parallel`] on a 2-core machine, one on 4 cores.
///
/// Measured (issue 33, 256 MiB tarball of `/usr`, 2 cores, `perf` and `time`): with the
/// cutter held to [`crate::StoreOptions::parallelism`] chunks ahead (512 KiB), it read and cut
/// each 16 MiB batch while the encoders waited for it, so an import used about 1.35 of the 2
/// cores.
const READ_AHEAD: usize = 32 << 20;

/// A piece of the input once encoded: its offset, and its chunk or (a hole) its length.
type Encoded = (u64, Result<chunk::EncodedChunk, u64>);

enum Piece {
    Hole {
        offset: u64,
        len: u64,
    },
    Data {
        offset: u64,
        data: Vec<u8>,
        /// This chunk's share of [`READ_AHEAD`], given back once it is encoded.
        _permit: Option<tokio::sync::OwnedSemaphorePermit>,
    },
}

impl Store {
    /// Chunks and stores a local file. Returns its table and transfer totals.
    pub async fn put_artifact(
        &self,
        path: &Path,
        opts: &PutArtifactOptions,
    ) -> Result<(ChunkTable, TransferStats), StoreError> {
        let f = File::open(path).map_err(|e| StoreError::io(path, e))?;
        // A file's reads do not stall: its content-defined cuts are found a batch at a time on
        // all cores (chunk::split_parallel; the same chunks as chunk::split).
        let chunking = opts.chunking.unwrap_or(Chunking::DISK_DEFAULT);
        let pieces =
            chunk::split_parallel(std::io::BufReader::with_capacity(1 << 20, f), chunking)?;
        self.put_pieces(pieces, chunking, opts).await
    }

    /// Chunks and stores everything `input` yields (read on a blocking thread). Chunks are cut
    /// one at a time as `input` yields them ([`chunk::split`]), so what a reader gave before
    /// it stalls is stored.
    pub async fn put_artifact_reader<R: Read + Send + 'static>(
        &self,
        input: R,
        opts: &PutArtifactOptions,
    ) -> Result<(ChunkTable, TransferStats), StoreError> {
        let chunking = opts.chunking.unwrap_or(Chunking::DISK_DEFAULT);
        let pieces = chunk::split(input, chunking)?;
        self.put_pieces(pieces, chunking, opts).await
    }

    /// Stores the chunks `pieces` yields, cut by `chunking` (read on a blocking thread).
    async fn put_pieces(
        &self,
        pieces: Box<dyn Iterator<Item = Result<chunk::RawChunk, ChunkError>> + Send>,
        chunking: Chunking,
        opts: &PutArtifactOptions,
    ) -> Result<(ChunkTable, TransferStats), StoreError> {
        // The cutter runs up to READ_AHEAD bytes of cut chunks ahead of the encoders (a byte
        // budget: each data chunk holds its length in permits until it is encoded), so that it
        // reads and cuts the next batch while the last one is hashed and compressed. The
        // channel's count bound is set above what the budget lets through at the smallest
        // usual chunk, so the bytes bind first.
        let budget = Arc::new(tokio::sync::Semaphore::new(READ_AHEAD));
        let min_len = match chunking {
            Chunking::Fixed { size } => size as usize,
            Chunking::Cdc { min, .. } => min as usize,
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Piece, ChunkError>>(
            READ_AHEAD / min_len.max(1) + self.parallelism,
        );
        let producer = tokio::task::spawn_blocking(move || {
            for c in pieces {
                let p = c.map(|c| {
                    if chunk::is_all_zero(&c.data) {
                        Piece::Hole {
                            offset: c.offset,
                            len: c.data.len() as u64,
                        }
                    } else {
                        // Closed never (the semaphore lives as long as this thread holds it);
                        // a chunk above the whole budget waits for all of it.
                        let n = c.data.len().clamp(1, READ_AHEAD) as u32;
                        let permit =
                            futures::executor::block_on(budget.clone().acquire_many_owned(n)).ok();
                        Piece::Data {
                            offset: c.offset,
                            data: c.data,
                            _permit: permit,
                        }
                    }
                });
                let stop = p.is_err();
                if tx.blocking_send(p).is_err() || stop {
                    return;
                }
            }
        });
        let reporter = Reporter::new(opts.progress.clone());
        // Stage 1: hash and compress on the upload's encoder threads, in input order.
        let encoders = &Encoders::start(self.parallelism.min(encoder_threads()), opts.memo.clone());
        let encoded = tokio_stream_from(rx)
            .map(|p| async move {
                match p? {
                    Piece::Hole { offset, len } => Ok::<Encoded, StoreError>((offset, Err(len))),
                    Piece::Data {
                        offset,
                        data,
                        _permit,
                    } => {
                        // The permit goes with the raw bytes, once encoded.
                        let enc = encoders.encode(data).await?;
                        drop(_permit);
                        Ok((offset, Ok(enc)))
                    }
                }
            })
            .buffered(self.parallelism);
        // Chunks written but not yet durable nor visible (the local backend's), committed
        // with one sync at the end (see `Store::commit_chunks`).
        let staging = &Mutex::new(Staging::default());
        // This upload's batch (locally: its pack file), given back at the commit.
        let batch_owned = self.backend.stage_batch();
        let batch = &batch_owned;
        // The group whose chunks are written next: groups write one after another in input
        // order, so a batch holds its chunks in input order (locally, the pack file).
        let (turn, _) = tokio::sync::watch::channel(0usize);
        let turn = &turn;
        let reporter = &reporter;
        // Stage 2, per group of chunks: which ones are relied on without a write (with a
        // lease, those found under it; without, those in the known-chunk index), then, in
        // turn, the others written with one `stage_chunks`, then the group's table entries.
        let store_group = |i: usize, group: Vec<Result<Encoded, StoreError>>| async move {
            let group: Vec<Encoded> = group.into_iter().collect::<Result<_, _>>()?;
            let chunks = || group.iter().filter_map(|(_, e)| e.as_ref().ok());
            let found: HashSet<crate::ChunkDigest> = match &opts.lease {
                // Leased, then looked up under the sweep lock (Lease::find_present). The
                // known-chunk index is not trusted here: GC may have deleted a chunk since.
                Some(lease) => {
                    let objs: Vec<ObjectRef> =
                        chunks().map(|e| ObjectRef::Chunk(e.digest)).collect();
                    let present = lease.find_present(&objs).await?;
                    chunks()
                        .map(|e| e.digest)
                        .filter(|d| present.contains(&ObjectRef::Chunk(*d)))
                        .collect()
                }
                None => chunks()
                    .map(|e| e.digest)
                    .filter(|d| self.known.contains(d))
                    .collect(),
            };
            let missing: Vec<&chunk::EncodedChunk> =
                chunks().filter(|e| !found.contains(&e.digest)).collect();
            // Never closed while this upload runs (the sender is borrowed here).
            let _ = turn.subscribe().wait_for(|&n| n == i).await;
            let wrote = self.stage_chunks(&missing, batch, staging).await;
            turn.send_replace(i + 1);
            let mut wrote = wrote?.into_iter();
            let mut leased = 0;
            let entries: Vec<ChunkEntry> = group
                .into_iter()
                .map(|(offset, e)| match e {
                    Err(len) => {
                        reporter.emit(ProgressEvent::Hole { raw_len: len });
                        ChunkEntry {
                            offset,
                            raw_len: len,
                            digest: None,
                            stored_len: 0,
                        }
                    }
                    Ok(enc) => {
                        let uploaded = if found.contains(&enc.digest) {
                            leased += usize::from(opts.lease.is_some());
                            false
                        } else {
                            wrote.next().unwrap_or(false)
                        };
                        let stored_len = enc.stored.len() as u64;
                        reporter.emit(ProgressEvent::Chunk {
                            digest: enc.digest,
                            raw_len: enc.raw_len,
                            stored_len,
                            transferred: uploaded,
                        });
                        ChunkEntry {
                            offset,
                            raw_len: enc.raw_len,
                            digest: Some(enc.digest),
                            stored_len,
                        }
                    }
                })
                .collect();
            if leased > 0 {
                staging.lock().unwrap_or_else(|p| p.into_inner()).leased += leased;
            }
            Ok::<_, StoreError>(entries)
        };
        let mut table = ChunkTable {
            size: 0,
            chunking,
            entries: Vec::new(),
        };
        let stored = async {
            // With a lease, groups of LEASE_BATCH (each costs a lease part and a look-up);
            // without, the chunks encoded by the time the last group was taken (at most
            // LEASE_BATCH), so that writes follow the encoders closely. GROUPS_IN_FLIGHT at
            // once, in order: while one is looked up and written, the next one's chunks are
            // hashed and compressed.
            let groups = if opts.lease.is_some() {
                encoded.chunks(LEASE_BATCH).left_stream()
            } else {
                encoded.ready_chunks(LEASE_BATCH).right_stream()
            };
            let mut groups = std::pin::pin!(
                groups
                    .enumerate()
                    .map(|(i, g)| store_group(i, g))
                    .buffered(GROUPS_IN_FLIGHT)
            );
            while let Some(entries) = groups.try_next().await? {
                for e in entries {
                    table.size = e.end();
                    table.push(e);
                }
            }
            Ok::<_, StoreError>(())
        }
        .await;
        let stored = match stored {
            Ok(()) => producer.await.map_err(StoreError::from),
            Err(e) => Err(e),
        };
        let staging = std::mem::take(&mut *staging.lock().unwrap_or_else(|p| p.into_inner()));
        let batch = batch_owned;
        if let Err(e) = stored {
            self.discard_chunks(staging, batch).await;
            return Err(e);
        }
        self.commit_chunks(staging, batch, reporter).await?;
        table.validate()?;
        Ok((table, reporter.totals()))
    }

    /// Writes the artifact `table` describes to `dest` as a sparse file: the file is sized
    /// first, holes are never written, chunks are fetched, verified and written in parallel
    /// (bounded). Written to `<dest>.partial`, fsynced, then renamed. Returns bytes written
    /// (excluding holes).
    pub async fn materialize(
        &self,
        table: &ChunkTable,
        dest: &Path,
        progress: Option<ProgressFn>,
    ) -> Result<u64, StoreError> {
        table.validate()?;
        let partial = dest.with_extension(match dest.extension() {
            Some(e) => format!("{}.partial", e.to_string_lossy()),
            None => "partial".into(),
        });
        let file = File::create(&partial).map_err(|e| StoreError::io(&partial, e))?;
        if let Err(e) = file.set_len(table.size) {
            // E.g. a hostile table claiming exabytes: EFBIG. Leave nothing behind.
            let _ = std::fs::remove_file(&partial);
            return Err(StoreError::io(&partial, e));
        }
        let file = Arc::new(file);
        let reporter = Reporter::new(progress);
        // In batches of READ_BATCH chunks, each read with one `get_chunks` (on S3, a few
        // ranged GETs of the packs holding them), BATCHES_IN_FLIGHT batches at once.
        let batches: Vec<Vec<ChunkEntry>> = table
            .entries
            .chunks(READ_BATCH)
            .map(<[ChunkEntry]>::to_vec)
            .collect();
        let res = futures::stream::iter(batches)
            .map(|batch| {
                let file = file.clone();
                let reporter = reporter.clone();
                let partial = partial.clone();
                async move {
                    let wanted: Vec<(crate::ChunkDigest, u64)> = batch
                        .iter()
                        .filter_map(|e| e.digest.map(|d| (d, e.raw_len)))
                        .collect();
                    let mut got = self.get_chunks(&wanted).await.into_iter();
                    let mut n = 0u64;
                    for e in batch {
                        let Some(d) = e.digest else {
                            reporter.emit(ProgressEvent::Hole { raw_len: e.raw_len });
                            continue;
                        };
                        let raw = got.next().ok_or_else(|| {
                            StoreError::io("materialize", std::io::Error::other("read lost"))
                        })??;
                        check_len(self, &e, &raw)?;
                        n += raw.len() as u64;
                        let file = file.clone();
                        tokio::task::spawn_blocking(move || file.write_all_at(&raw, e.offset))
                            .await?
                            .map_err(|err| StoreError::io(&partial, err))?;
                        reporter.emit(ProgressEvent::Chunk {
                            digest: d,
                            raw_len: e.raw_len,
                            stored_len: e.stored_len,
                            transferred: true,
                        });
                    }
                    Ok::<_, StoreError>(n)
                }
            })
            .buffer_unordered(batches_in_flight(self.parallelism))
            .try_fold(0u64, |a, n| async move { Ok(a + n) })
            .await;
        let written = match res {
            Ok(w) => w,
            Err(e) => {
                let _ = std::fs::remove_file(&partial);
                return Err(e);
            }
        };
        file.sync_all().map_err(|e| StoreError::io(&partial, e))?;
        std::fs::rename(&partial, dest).map_err(|e| StoreError::io(dest, e))?;
        Ok(written)
    }
}

/// Chunks read with one [`Store::get_chunks`] by the bulk readers (an export, a pull, a
/// clone's prefetch): 64, 4 MiB of 64 KiB chunks, about 2 MiB stored, so on S3 a batch is
/// usually one or two ranged GETs of a pack.
pub const READ_BATCH: usize = 64;

/// Batches read at once for `parallelism` chunk reads: a quarter as many, at least two
/// (one batch is many chunks; the S3 backend reads its spans in parallel too).
pub fn batches_in_flight(parallelism: usize) -> usize {
    (parallelism / 4).max(2)
}

fn check_len(store: &Store, e: &ChunkEntry, raw: &[u8]) -> Result<(), StoreError> {
    if raw.len() as u64 != e.raw_len {
        return Err(ChunkError::Corrupt {
            // Only called for entries with a digest.
            digest: e
                .digest
                .unwrap_or(crate::ChunkDigest(crate::digest::Sha256Hash([0; 32]))),
            store: store.url().to_string(),
            reason: format!("{} raw bytes, the table says {}", raw.len(), e.raw_len),
        }
        .into());
    }
    Ok(())
}

/// Threads that hash and compress an upload's chunks ([`Encoders`]): the machine's cores.
fn encoder_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A chunk to encode and where its result goes.
type EncodeJob = (
    Vec<u8>,
    tokio::sync::oneshot::Sender<Result<chunk::EncodedChunk, ChunkError>>,
);

/// An upload's own encoder threads: each hashes and compresses one chunk at a time
/// ([`chunk::encode`]) with its zstd context kept warm, for as long as the upload runs.
///
/// Measured (issue 33, `perf record` of `kiln store import` of a 256 MiB tarball of `/usr`
/// into a new local store, 2 cores): with one `spawn_blocking` per chunk, 76 threads of the
/// blocking pool each encoded a share of the 3,122 chunks, each with a zstd context of its
/// own (made and faulted in on first use, then cold in cache when its thread next ran), and
/// ZSTD_compressBlock_doubleFast was 45% of all samples. With these threads, in 75
/// alternating rounds taken when the machine was idle at their start: wall median 0.95 s
/// against 1.14 s, user+sys 1.71 s against 1.93 s, page faults about 21,000 against
/// 58,000 to 69,000. The threads stop when the upload drops this (a job being encoded
/// finishes first; nothing waits for it).
struct Encoders {
    jobs: std::sync::mpsc::Sender<EncodeJob>,
}

impl Encoders {
    /// Starts `n` threads (at least one), taking what `memo` holds from it.
    fn start(n: usize, memo: Option<Arc<EncodeMemo>>) -> Self {
        let (jobs, rx) = std::sync::mpsc::channel::<EncodeJob>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let memo = memo.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kiln-encode-{i}"))
                .spawn(move || {
                    loop {
                        // The lock is held only while waiting for the next job.
                        let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok((data, done)) = job else { return };
                        // The upload may have stopped waiting; nothing to do then.
                        let _ = done.send(match &memo {
                            Some(m) => m.encode(&data),
                            None => chunk::encode(&data),
                        });
                    }
                });
            // Without any thread, each job is encoded by the caller (see `encode`).
            if spawned.is_err() {
                break;
            }
        }
        Self { jobs }
    }

    /// Hashes and compresses `data` on one of the threads.
    async fn encode(&self, data: Vec<u8>) -> Result<chunk::EncodedChunk, StoreError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if let Err(std::sync::mpsc::SendError((data, _))) = self.jobs.send((data, tx)) {
            // No thread could be started: encode on the blocking pool.
            return Ok(tokio::task::spawn_blocking(move || chunk::encode(&data)).await??);
        }
        match rx.await {
            Ok(r) => Ok(r?),
            // The thread panicked in encode.
            Err(_) => Err(StoreError::io(
                "encode",
                std::io::Error::other("an encoder thread stopped"),
            )),
        }
    }
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// How many bytes of recently read chunks an [`ArtifactReader`] keeps in memory (32 MiB:
/// 512 memory chunks of 64 KiB).
///
/// A clone's chunk server reads its memory file a page at a time (4 KiB, `vmm`'s
/// `lazy::READAHEAD`) and a guest touches the pages of one 64 KiB chunk at different times.
/// Measured (issue 35, busybox, 256 MiB guest, cold from the local S3 server): 1,302 FUSE
/// reads for about 390 chunks, 1.2 s of them after the prefetch had put every chunk into the
/// read cache, each a read and sha256 of the whole chunk again from the read cache because
/// only the last chunk was kept here.
pub const READER_MEMORY: u64 = 32 << 20;

/// Chunks [`ArtifactReader::read_at`] fetches at once (8: 512 KiB of 64 KiB chunks, twice
/// the widest read a lazy clone's chunk server makes).
pub const READ_AT_PARALLEL: usize = 8;

/// Random access to an artifact by byte offset.
#[derive(Debug)]
pub struct ArtifactReader {
    store: Store,
    table: Arc<ChunkTable>,
    /// Recently read chunks (verified raw bytes), at most [`READER_MEMORY`] bytes.
    recent: Mutex<Recent>,
    /// How long a chunk's failed read is remembered ([`ArtifactReader::remembering_failures`]);
    /// zero: not at all.
    remember_failures: std::time::Duration,
    /// Chunk index → when its read failed, and the error's text.
    failed: Mutex<std::collections::HashMap<usize, (std::time::Instant, String)>>,
}

/// Chunk index → (raw bytes, last use), bounded in bytes; the least recently used goes first.
#[derive(Debug, Default)]
struct Recent {
    chunks: std::collections::HashMap<usize, (Bytes, u64)>,
    bytes: u64,
    tick: u64,
}

impl Recent {
    fn get(&mut self, i: usize) -> Option<Bytes> {
        self.tick += 1;
        let tick = self.tick;
        self.chunks.get_mut(&i).map(|(b, t)| {
            *t = tick;
            b.clone()
        })
    }

    fn put(&mut self, i: usize, b: Bytes, max: u64) {
        let len = b.len() as u64;
        if len > max || self.chunks.contains_key(&i) {
            return;
        }
        while self.bytes + len > max {
            let Some((&old, _)) = self.chunks.iter().min_by_key(|(_, (_, t))| *t) else {
                break;
            };
            if let Some((b, _)) = self.chunks.remove(&old) {
                self.bytes -= b.len() as u64;
            }
        }
        self.tick += 1;
        self.bytes += len;
        self.chunks.insert(i, (b, self.tick));
    }
}

impl ArtifactReader {
    /// A reader over `table` (validated here) in `store`.
    pub fn new(store: Store, table: Arc<ChunkTable>) -> Result<Self, StoreError> {
        table.validate()?;
        Ok(Self {
            store,
            table,
            recent: Mutex::default(),
            remember_failures: std::time::Duration::ZERO,
            failed: Mutex::default(),
        })
    }

    /// This reader, remembering each chunk whose read fails for `d`: a read of that chunk
    /// within `d` of the failure fails at once ([`ChunkError::FailedRecently`], with the
    /// failure's text) instead of asking the store again. For a reader whose caller retries a
    /// failed read at once: a lazy clone's chunk server, whose QEMU reads a page or block again
    /// right after an `EIO` (issue 35: with a store that stopped answering and a 3 s read
    /// bound, a clone's start read the disk's first block twice and one memory page three
    /// times, each retry waiting the whole bound again: 15 s before the start could fail).
    pub fn remembering_failures(mut self, d: std::time::Duration) -> Self {
        self.remember_failures = d;
        self
    }

    /// Artifact size in bytes.
    pub fn size(&self) -> u64 {
        self.table.size
    }

    async fn chunk(&self, i: usize) -> Result<Bytes, StoreError> {
        if let Some(b) = self.recent.lock().unwrap_or_else(|p| p.into_inner()).get(i) {
            return Ok(b);
        }
        let e = &self.table.entries[i];
        let raw = match e.digest {
            // Holes may be large; they are served without this buffer (see read_at).
            None => return Ok(Bytes::new()),
            Some(d) => {
                if let Some(err) = self.failed_recently(i, &d) {
                    return Err(err);
                }
                let got = match self.store.get_chunk(&d, e.raw_len).await {
                    Ok(raw) => check_len(&self.store, e, &raw).map(|()| raw),
                    Err(err) => Err(err),
                };
                match got {
                    Ok(raw) => raw,
                    Err(err) => {
                        if !self.remember_failures.is_zero() {
                            self.failed
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .insert(i, (std::time::Instant::now(), err.to_string()));
                        }
                        return Err(err);
                    }
                }
            }
        };
        self.recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .put(i, raw.clone(), READER_MEMORY);
        Ok(raw)
    }

    /// The remembered failure of chunk `i` (digest `d`), if its read failed less than
    /// [`ArtifactReader::remembering_failures`] ago (an older one is forgotten here).
    fn failed_recently(&self, i: usize, d: &crate::ChunkDigest) -> Option<StoreError> {
        if self.remember_failures.is_zero() {
            return None;
        }
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        let (at, reason) = failed.get(&i)?;
        let ago = at.elapsed();
        if ago >= self.remember_failures {
            failed.remove(&i);
            return None;
        }
        Some(
            ChunkError::FailedRecently {
                digest: *d,
                ago,
                reason: reason.clone(),
            }
            .into(),
        )
    }

    /// Fills `buf` from byte `offset`, crossing chunks as needed. Returns the bytes read (less
    /// than `buf.len()` only at the end of the artifact). Every chunk is verified.
    ///
    /// The chunks the range falls in are fetched [`READ_AT_PARALLEL`] at a time, in order
    /// (holes are zeros, fetched never): a read of k chunks no cache holds waits about one
    /// store round trip, not k one after another. On a failure the first failing chunk's
    /// error, in offset order. A lazy clone's disk reads are such reads: the guest's
    /// readahead asks for up to 128 KiB, two or three content-defined chunks (issue 35: in a
    /// cold Debian clone from the local S3 server, those reads took 54-58 ms against 26-32 ms
    /// for a read of one chunk).
    pub async fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize, StoreError> {
        // (entry, where in buf, where in the chunk, bytes), in offset order.
        let mut parts: Vec<(usize, usize, usize, usize)> = Vec::new();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let Some(i) = self.table.find(pos) else {
                break;
            };
            let e = &self.table.entries[i];
            let within = (pos - e.offset) as usize;
            let avail = (e.raw_len as usize - within).min(buf.len() - done);
            if e.is_hole() {
                buf[done..done + avail].fill(0);
            } else {
                parts.push((i, done, within, avail));
            }
            done += avail;
        }
        let entries: Vec<usize> = parts.iter().map(|p| p.0).collect();
        let mut fetched = futures::stream::iter(entries)
            .map(|i| self.chunk(i))
            .buffered(READ_AT_PARALLEL);
        for &(_, at, within, avail) in &parts {
            let raw = fetched.next().await.expect("one fetch for each part")?;
            buf[at..at + avail].copy_from_slice(&raw[within..within + avail]);
        }
        Ok(done)
    }
}
