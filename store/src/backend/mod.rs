//! Backends: bytes by key, and nothing else.
//!
//! A [`Backend`] is a handful of primitives over flat string keys (`chunks/sha256/<hex>`, ...;
//! see the crate doc for the layout). It knows nothing of digests, chunks or manifests.
//! Implementations: [`local`] (our own directory store: temp file, fsync, rename) and
//! [`s3`] (any S3-compatible server through `object_store`). Policy shared by all backends
//! (retries with backoff, request counters) lives once, in the [`retry::Retrying`] wrapper
//! that [`open`] puts around whichever backend the URL names.
//!
//! Keys are validated by [`validate_key`] before any backend sees them: relative, `/`-separated,
//! no empty segment, no segment starting with `.` (so no `.`/`..`), only `[A-Za-z0-9._~-]` characters, at most 512 bytes.

pub mod local;
mod local_pack;
pub(crate) mod pack;
pub mod retry;
pub mod s3;
pub mod s3_pack;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;

/// Errors from a backend primitive. `Transient` is the only kind [`retry::Retrying`] retries.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No object at the key.
    #[error("{store}: no object at {key}")]
    NotFound {
        /// The store (URL) asked.
        store: String,
        /// The key asked for.
        key: String,
    },
    /// A compare-and-swap found a different version than expected (or an object where
    /// absence was expected).
    #[error("{store}: {key} changed since it was read (compare-and-swap lost)")]
    Conflict {
        /// The store (URL) asked.
        store: String,
        /// The key written.
        key: String,
    },
    /// A key that fails [`validate_key`].
    #[error("invalid store key {0:?}")]
    InvalidKey(String),
    /// The bytes written did not hash to the expected sha256 (local backend's commit check).
    #[error("{store}: bytes for {key} hash to {actual}, expected {expected}")]
    DigestMismatch {
        /// The store (URL).
        store: String,
        /// The key being written.
        key: String,
        /// sha256 the caller promised.
        expected: String,
        /// sha256 of what was written.
        actual: String,
    },
    /// A store URL that cannot be opened.
    #[error("store URL {url:?}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A failure worth retrying: 5xx, timeout, connection reset, throttling.
    #[error("{store}: transient failure on {key}: {message}")]
    Transient {
        /// The store (URL).
        store: String,
        /// The key being accessed.
        key: String,
        /// The underlying error, rendered.
        message: String,
    },
    /// A transient failure that did not go away: every attempt of one operation failed, or
    /// the operation's time bound ([`retry::RetryPolicy::operation_timeout`]) ran out. Only
    /// [`retry::Retrying`] returns it.
    #[error(
        "{store}: {op} {key}: {}: {last}",
        retry::gave_up_text(.attempts, .elapsed, .bound)
    )]
    GaveUp {
        /// The store (URL).
        store: String,
        /// The primitive (`get`, `put_if_absent`, ...).
        op: &'static str,
        /// The key (or, for `list`, the prefix) being accessed.
        key: String,
        /// Attempts made, the last one included; 0 for a chunk read that waited for another
        /// read's fetch of the same chunk and made none of its own (`Store::get_chunk`), or
        /// for an object of a batched read left unread once the store answered neither the
        /// batch nor another object alone ([`retry::Retrying`]'s `get_many`).
        attempts: u32,
        /// Time from the first attempt's start to giving up.
        elapsed: std::time::Duration,
        /// `Some(bound)` when the time bound ran out, `None` when the attempts did.
        bound: Option<std::time::Duration>,
        /// What the last attempt met (the rendered failure, or that it had no answer yet).
        last: String,
    },
    /// The file system holding a local store is full (ENOSPC).
    #[error("{store}: {op} {key}: {space}")]
    NoSpace {
        /// The store (URL).
        store: String,
        /// The primitive (`put`, ...).
        op: &'static str,
        /// The key being written.
        key: String,
        /// The file written and the free space.
        space: crate::space::NoSpace,
    },
    /// Any other failure (permission denied, 4xx...).
    #[error("{store}: {op} {key}: {message}")]
    Other {
        /// The store (URL).
        store: String,
        /// The primitive (`get`, `put`, ...).
        op: &'static str,
        /// The key being accessed.
        key: String,
        /// The underlying error, rendered.
        message: String,
    },
}

impl BackendError {
    /// True for [`BackendError::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, BackendError::NotFound { .. })
    }
}

/// An object's version for compare-and-swap: the S3 ETag, or the local backend's
/// `<inode>-<ctime>-<size>`. Opaque; only compare it or hand it back to
/// [`Backend::compare_and_swap`]. Different content always means a different version;
/// rewriting identical bytes may keep it (an S3 ETag is the MD5 of single-part content), which
/// is harmless for compare-and-swap since the state is then the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version(pub String);

/// What [`Backend::head`] and [`Backend::list`] report about an object.
#[derive(Debug, Clone)]
pub struct ObjectInfo {
    /// The object's key.
    pub key: String,
    /// Stored size in bytes.
    pub size: u64,
    /// Last modification time (creation time for immutable objects).
    pub modified: SystemTime,
    /// The version for compare-and-swap, when the backend reports one.
    pub version: Option<Version>,
}

/// Most keys one listing request returns: S3 ListObjectsV2's `max-keys` default and limit
/// (1000, Amazon S3 API Reference, ListObjectsV2).
pub const LIST_PAGE_MAX: usize = 1000;

/// What [`Backend::list_page`] returns.
#[derive(Debug, Clone)]
pub struct ListPage {
    /// The objects, in key order.
    pub objects: Vec<ObjectInfo>,
    /// More keys follow the last one.
    pub truncated: bool,
}

/// Requests a backend sent to its server since it was opened, by kind
/// ([`Backend::wire_requests`]): what the server saw, each attempt of a retried request
/// counted. The S3 backend counts every HTTP request its client sends; the local backend
/// has no server and counts nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireRequests {
    /// HEAD requests (an object's metadata, a presence check).
    pub heads: u64,
    /// GET requests of an object, whole or ranged.
    pub gets: u64,
    /// Listing requests (S3 ListObjectsV2: a GET with `list-type=2`).
    pub lists: u64,
    /// PUT requests (objects, parts, server-side copies).
    pub puts: u64,
    /// DELETE requests.
    pub deletes: u64,
    /// Any other method (POST: a multipart upload's start and end, a batch delete).
    pub other: u64,
}

impl WireRequests {
    /// Every request counted.
    pub fn total(&self) -> u64 {
        self.heads + self.gets + self.lists + self.puts + self.deletes + self.other
    }
}

/// Result of [`Backend::put_if_absent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// This call created the object.
    Created,
    /// An object already existed at the key; nothing was written.
    AlreadyExists,
}

/// What [`Backend::stage_if_absent`] did with one object.
#[derive(Debug)]
pub enum Staged {
    /// Written (or found) for good, as [`Backend::put_if_absent`] would have: durable now.
    Done(PutOutcome),
    /// Written under a private name, not yet visible or durable: it becomes the object (unless
    /// one exists by then) when [`Backend::commit_staged`] is given it.
    Pending(StagedPut),
}

/// An object written by [`Backend::stage_if_absent`] and not yet committed. Only the backend
/// that made it can commit or discard it.
#[derive(Debug)]
pub struct StagedPut {
    /// The object's key.
    pub key: String,
    /// Bytes written (the object's size).
    pub len: u64,
    /// Where the bytes wait (the local backend's temp file; empty for a chunk in the
    /// batch's pack).
    pub(crate) tmp: PathBuf,
    /// Where the bytes wait in the batch's pack (the local backend's packed chunks).
    pub(crate) packed: Option<u64>,
}

/// One upload's staged writes: what [`Backend::stage_if_absent`] writes into and what
/// [`Backend::commit_staged`] or [`Backend::discard_staged`] ends. A backend that stages
/// nothing gives an empty one; the local backend's holds the batch's pack file ([`local`],
/// "Packs"), the S3 backend's the packs being filled and sent ([`s3`], "Packs"). Two uploads at once in one process have two
/// batches. Dropped unused (its upload cancelled), it removes what it wrote (locally; on S3 a
/// pack already sent without its index stays, invisible, until a compaction removes it).
#[derive(Debug, Default)]
pub struct StageBatch {
    pub(crate) pack: Option<Arc<local::PackBatch>>,
    /// The S3 backend's packs being written ([`s3`], "Packs").
    pub(crate) s3: Option<Arc<s3_pack::S3Batch>>,
}

impl StageBatch {
    /// A batch of a backend that stages nothing.
    pub fn immediate() -> Self {
        Self::default()
    }
}

/// A backend's own files that are damaged, and the bytes its layout holds that no key
/// names: what [`Backend::layout_report`] finds (the local backend's pack indexes).
#[derive(Debug, Default, Clone)]
pub struct LayoutReport {
    /// (file, why) for each damaged file: its objects are not served.
    pub problems: Vec<(String, String)>,
    /// Pack files.
    pub packs: u64,
    /// Bytes of pack files.
    pub pack_bytes: u64,
    /// Bytes of pack files no serving entry names (deleted chunks, chunks a batch wrote
    /// that another writer had published first, and copies of chunks another pack serves,
    /// left by a killed compaction), reclaimable by a compaction ([`Backend::compact`]; GC
    /// compacts a pack once half of it is dead, so up to that share stays).
    pub dead_bytes: u64,
}

/// What [`Backend::compact`] did or, in a dry run, would do.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CompactReport {
    /// Packs compacted: rewritten with their live chunks only, or removed (none live).
    pub packs: u64,
    /// Bytes of those packs before.
    pub bytes_before: u64,
    /// Live bytes copied into new packs.
    pub bytes_copied: u64,
    /// Bytes freed: those packs' bytes less the bytes copied, and the files that crashes
    /// left without an index, removed.
    pub bytes_reclaimed: u64,
    /// Pack and dead files without an index (a crash's leftovers) removed.
    pub orphan_files: u64,
}

/// Packs a delete retired whole since the last [`Backend::compact`]: compaction's work done
/// early (both backends retire a pack once every entry is dead, at the delete that made it
/// so; GC's condemn step makes most of them), which the next compaction reports as its own,
/// so a GC reports what its dry run said compaction would reclaim.
#[derive(Debug, Default)]
pub(crate) struct RetiredEarly(std::sync::Mutex<CompactReport>);

impl RetiredEarly {
    /// Notes one pack of `pack_len` bytes retired.
    pub(crate) fn note(&self, pack_len: u64) {
        let mut r = self.0.lock().unwrap_or_else(|p| p.into_inner());
        r.packs += 1;
        r.bytes_before += pack_len;
        r.bytes_reclaimed += pack_len;
    }

    /// Adds what was noted since the last call to `r`, and forgets it.
    pub(crate) fn report_into(&self, r: &mut CompactReport) {
        let early = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        r.packs += early.packs;
        r.bytes_before += early.bytes_before;
        r.bytes_reclaimed += early.bytes_reclaimed;
    }
}

/// What [`Backend::pack_together`] wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PackedTogether {
    /// The new packs' names (`packs/<name>.pack`), in the order their chunks were given.
    pub packs: Vec<String>,
    /// Chunks written into them (each distinct key once).
    pub chunks: u64,
    /// Their stored bytes, the packs' total size.
    pub bytes: u64,
}

/// A staged object takes its temp file with it when it drops: the one removal of a temp
/// name, whether it was committed (linked to its key first), discarded, or dropped unused
/// (its upload's future dropped, say a cancelled build, or a stage finishing on the blocking
/// pool after its caller gave up).
impl Drop for StagedPut {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The primitives every backend provides. All are async and cancel-safe in the sense that an
/// interrupted write leaves either no object or the whole object (never a partial one).
#[async_trait::async_trait]
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// The store's URL, used to name the store in errors (`file:///...`, `s3://bucket/prefix`).
    fn url(&self) -> &str;

    /// Whether every failure of this backend is final: a retry would meet it again (a file
    /// system's errors), never a transient one. The retry wrapper then passes its calls on
    /// many objects ([`Backend::stage_many_if_absent`], [`Backend::loose_present_many`])
    /// through once; for any other backend it makes them one object at a time, each retried
    /// with its own time bound. Default: `false`; the local backend: `true`. A wrapper that
    /// injects transient faults keeps the default.
    fn failures_are_final(&self) -> bool {
        false
    }

    /// Whole object. Errors: `NotFound`.
    async fn get(&self, key: &str) -> Result<Bytes, BackendError>;

    /// Bytes `range` (half-open, in bytes) of the object. A range past the end is clipped by
    /// the backend; callers check lengths.
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError>;

    /// The first `limit` bytes of each of `keys` (as [`Backend::get_range`] with `0..limit`),
    /// in the order given, each its own result (`NotFound` for one absent). For the bulk
    /// reads of many chunks (a pull, an export, a clone's prefetch): the S3 backend reads the
    /// chunks of one pack with a few ranged GETs of nearby entries ([`s3`], "Reading many").
    /// Default: one `get_range` each, [`GET_MANY_IN_FLIGHT`] at once.
    async fn get_many(&self, keys: &[String], limit: u64) -> Vec<Result<Bytes, BackendError>> {
        use futures::StreamExt;
        futures::stream::iter(keys.iter().cloned())
            .map(|k| async move { self.get_range(&k, 0..limit).await })
            .buffered(GET_MANY_IN_FLIGHT)
            .collect()
            .await
    }

    /// Whole object and its version, for a later [`Backend::compare_and_swap`]. Only for the
    /// small mutable objects (tags, tag histories): an object over [`MAX_MUTABLE_LEN`] is
    /// [`BackendError::Other`], refused before its body is read.
    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError>;

    /// Metadata, or `None` when absent.
    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError>;

    /// Creates the object unless one exists (S3 `If-None-Match: *`; locally a `link(2)` that
    /// fails on an existing name). With `expect_sha256`, the bytes are hashed and the write
    /// fails with `DigestMismatch` before becoming visible if they differ.
    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<crate::digest::Sha256Hash>,
    ) -> Result<PutOutcome, BackendError>;

    /// Like [`Backend::put_if_absent`] but streams from a local file (S3: multipart upload
    /// above [`s3::MULTIPART_THRESHOLD`] bytes; a duplicate upload of content-addressed data is
    /// harmless, so the check is a `head` first).
    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<crate::digest::Sha256Hash>,
    ) -> Result<PutOutcome, BackendError>;

    /// Unconditional atomic overwrite (histories, leases, cache entries). Returns the new version.
    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError>;

    /// Writes `data` only if the object's current version is `expected` (`None`: only if
    /// absent). Errors: `Conflict` when the condition fails. Returns the new version.
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError>;

    /// Every object whose key starts with `prefix` (a plain string prefix ending in `/`),
    /// recursively, in no particular order.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError>;

    /// Requests sent to the backend's server since it was opened ([`WireRequests`]).
    /// Default: none (a backend without a server).
    fn wire_requests(&self) -> WireRequests {
        WireRequests::default()
    }

    /// Whether [`Backend::list_page`] works here: one request lists many keys in key order
    /// (S3's ListObjectsV2). `false` by default, and for the local backend, where a `stat`
    /// per key is cheaper than reading a directory.
    fn ordered_listing(&self) -> bool {
        false
    }

    /// One listing request: up to `max` objects (at most [`LIST_PAGE_MAX`]) whose keys start
    /// with `prefix` (ending in `/`) and sort after `start_after` (byte order), in key order;
    /// [`ListPage::truncated`] when more follow. Errors: [`BackendError::Other`] on a backend
    /// without [`Backend::ordered_listing`].
    async fn list_page(
        &self,
        prefix: &str,
        start_after: &str,
        max: usize,
    ) -> Result<ListPage, BackendError> {
        let _ = (start_after, max);
        Err(BackendError::Other {
            store: self.url().to_string(),
            op: "list_page",
            key: prefix.to_string(),
            message: "this backend has no ordered listing".into(),
        })
    }

    /// Put-if-absent of an immutable object whose durability may wait, into `batch` (from
    /// this backend's [`Backend::stage_batch`]): a backend that can make many writes durable
    /// at once (the local one: a chunk is appended to the batch's pack file, made durable by
    /// one fsync at the commit; [`local`], "Packs") writes the bytes where no reader sees them
    /// and returns [`Staged::Pending`]; the object exists only once [`Backend::commit_staged`]
    /// returns. Others write it for good at once (the default: [`Backend::put_if_absent`], no
    /// digest check). Safe to call from many tasks at once on one batch.
    async fn stage_if_absent(
        &self,
        batch: &StageBatch,
        key: &str,
        data: Bytes,
    ) -> Result<Staged, BackendError> {
        let _ = batch;
        Ok(Staged::Done(self.put_if_absent(key, data, None).await?))
    }

    /// [`Backend::stage_if_absent`] of each of `items` (key, bytes) into `batch`, each its
    /// own result, in the order given; a backend that appends to a pack appends them in that
    /// order. For an upload's or a copy's group of chunks: the local backend stages a whole
    /// group in one blocking call (one hand-off to a thread of the blocking pool and back,
    /// instead of one per chunk). Default: one [`Backend::stage_if_absent`] each,
    /// [`STAGE_MANY_IN_FLIGHT`] at once.
    async fn stage_many_if_absent(
        &self,
        batch: &StageBatch,
        items: Vec<(String, Bytes)>,
    ) -> Vec<Result<Staged, BackendError>> {
        stage_each(self, batch, items).await
    }

    /// Which of `keys` are chunks this backend holds in packs, live, as of a look-up made
    /// after the call began (`true`: present; a `false` says nothing, the key may still be
    /// a loose object). Backs [`crate::Store::exist`], the writer's question, so a `true`
    /// must never be stale (see [`crate::gc`]); a `false` may be (it costs a duplicate
    /// write). Default: all `false`, no request (no packs).
    async fn packed_present(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        Ok(vec![false; keys.len()])
    }

    /// Whether an object is at `key` outside the packs (a loose object): the rest of the
    /// writer's question once [`Backend::packed_present`] said no ([`crate::Store::exist`]).
    /// Default: [`Backend::head`].
    async fn loose_present(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.head(key).await?.is_some())
    }

    /// [`Backend::loose_present`] of each of `keys`, in the order given: [`crate::Store::exist`]'s
    /// objects that neither [`Backend::packed_present`] nor a listing answered for. The
    /// local backend looks all of them up in one blocking call. Default: one
    /// [`Backend::loose_present`] each, [`crate::store::PRESENCE_CHECKS_IN_FLIGHT`] at once.
    /// Errors: the first failed look-up (its error alone, or one per key).
    async fn loose_present_many(&self, keys: &[String]) -> Vec<Result<bool, BackendError>> {
        present_each(self, keys).await
    }

    /// Sends what `batch` still holds unsent (the S3 backend's last pack and its index),
    /// so that [`Backend::commit_staged`] has nothing left that can fail transiently.
    /// Idempotent: the retry wrapper may call it again after a failure. Default: nothing.
    async fn flush_staged(&self, batch: &StageBatch) -> Result<(), BackendError> {
        let _ = batch;
        Ok(())
    }

    /// A new batch for [`Backend::stage_if_absent`] (one per upload). Default: an empty one
    /// (this backend stages nothing).
    fn stage_batch(&self) -> StageBatch {
        StageBatch::immediate()
    }

    /// The backend's own files that are damaged, and its layout's dead bytes
    /// ([`LayoutReport`]); read by verify. Default: nothing (one object per key).
    async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
        Ok(LayoutReport::default())
    }

    /// Makes `staged` (from this backend's [`Backend::stage_if_absent`] into `batch`) durable and visible,
    /// each as a put-if-absent (outcomes in the order given), and makes durable every object
    /// this process saw in the store before the call. Called once per batch, even an empty
    /// one, before anything that names the objects is written. Default: nothing to do
    /// (every write was already durable); a staged object it does not know is an error.
    async fn commit_staged(
        &self,
        batch: StageBatch,
        staged: Vec<StagedPut>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        let _ = batch;
        match staged.first() {
            None => Ok(Vec::new()),
            Some(s) => Err(BackendError::Other {
                store: self.url().to_string(),
                op: "commit_staged",
                key: s.key.clone(),
                message: "this backend stages nothing".into(),
            }),
        }
    }

    /// Reclaims the space the layout still holds for deleted objects (the local backend's
    /// partly dead packs: [`local`], "Compaction") without changing which keys exist or
    /// their bytes. With `dry_run`, changes nothing and reports what it would reclaim if
    /// the objects `also_dead` (keys) were deleted too. Called by [`crate::Store::gc`] after
    /// its deletes. Default: nothing to reclaim (one object per key).
    async fn compact(
        &self,
        dry_run: bool,
        also_dead: &[String],
    ) -> Result<CompactReport, BackendError> {
        let _ = (dry_run, also_dead);
        Ok(CompactReport::default())
    }

    /// Writes the stored bytes of the chunks `keys` (`chunks/sha256/<hex>`, each present),
    /// in the order given (a key given twice, once, where it first comes), into new packs of
    /// their own, closed at the pack target as an upload's are, even where another pack or a
    /// loose object holds them already; each is published as every pack is (the pack's PUT,
    /// then its index's), so a reader sees the new copies only whole. For the chunks a
    /// clone's start fetches first, in the order it fetches them
    /// ([`crate::manifest::PrefetchList::fetch_order`], [`crate::Store::pack_together`]):
    /// the S3 backend's reads of many chunks cost a ranged GET per span of nearby entries of
    /// one pack ([`s3`], "Reading many"), and the test S3 server's ranged GET costs in
    /// proportion to the *object's* size (2 MiB of a 33.6 MB pack: 34 ms; of a 10.8 MB
    /// pack: 9.8 ms); a cold Debian clone's prefetch from the chunks where the uploads left
    /// them was 13 ranged GETs of 32 MiB packs and 11 listings, about 300 ms (issue 35).
    /// Which copy then serves, and why GC, compaction and verify stay right with two:
    /// [`s3`], "Packing together". Errors: a key that is not a chunk's, a chunk that cannot
    /// be read, a write that fails (a pack published before it stays, a whole copy like the
    /// others; one sent without its index is invisible, left to a compaction). Default:
    /// nothing written (the local backend reads a chunk from a file on this host, where
    /// order gains nothing).
    async fn pack_together(&self, keys: &[String]) -> Result<PackedTogether, BackendError> {
        let _ = keys;
        Ok(PackedTogether::default())
    }

    /// Forgets `batch` and `staged` after a failed upload, removing what they wrote that no
    /// reader or writer can have seen (on S3, a pack whose index PUT failed stays: its index
    /// may be stored all the same, an answer lost, [`s3`], "Packs"). Default: nothing.
    async fn discard_staged(&self, batch: StageBatch, staged: Vec<StagedPut>) {
        let _ = (batch, staged);
    }

    /// Removes the object; absent is not an error.
    async fn delete(&self, key: &str) -> Result<(), BackendError>;

    /// Moves the object at `from` to `to`, replacing any object there (GC's fossil step,
    /// [`crate::gc`]). Locally one `rename(2)`, atomic. On S3 a CopyObject (server side, no
    /// bytes through the client; objects up to 5 GiB, S3 API reference, CopyObject) then a
    /// DeleteObject: an interruption between the two leaves both keys holding the object,
    /// never neither. Errors: `NotFound` when `from` is absent.
    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError>;

    /// [`Backend::delete`] of each of `keys`, each its own result, in the order given (GC's
    /// deletes of fossils, a compaction's of dead markers). The S3 backend deletes up to
    /// 1,000 keys with one DeleteObjects request (S3 API reference, DeleteObjects) and marks
    /// the chunks among them dead in their packs after one listing of `packs/`. Default: one
    /// [`Backend::delete`] each, [`MANY_IN_FLIGHT`] at once.
    async fn delete_many(&self, keys: &[String]) -> Vec<Result<(), BackendError>> {
        use futures::StreamExt;
        futures::stream::iter(keys.iter().cloned())
            .map(|k| async move { self.delete(&k).await })
            .buffered(MANY_IN_FLIGHT)
            .collect()
            .await
    }

    /// [`Backend::rename`] of each of `pairs` (from, to), each its own result, in the order
    /// given; each keeps the promise of [`Backend::rename`] (an interruption leaves both keys
    /// holding the object, never neither). GC's condemn step. The S3 backend reads the packed
    /// chunks among them by spans of their packs ([`Backend::get_many`]'s way), writes every
    /// destination, then the dead markers (after one listing of `packs/`), then deletes the
    /// loose sources with DeleteObjects. Default: one [`Backend::rename`] each,
    /// [`MANY_IN_FLIGHT`] at once.
    async fn rename_many(&self, pairs: &[(String, String)]) -> Vec<Result<(), BackendError>> {
        rename_each(self, pairs).await
    }
}

/// Calls [`Backend::delete_many`] and [`Backend::rename_many`] have in flight at once by
/// default (64: what GC had in flight before they existed, [`crate::gc::GC_BATCH`]).
pub const MANY_IN_FLIGHT: usize = 64;

/// [`Backend::rename_many`]'s default: one [`Backend::rename`] of `b` each,
/// [`MANY_IN_FLIGHT`] at once, results in the order given.
pub(crate) async fn rename_each<B: Backend + ?Sized>(
    b: &B,
    pairs: &[(String, String)],
) -> Vec<Result<(), BackendError>> {
    use futures::StreamExt;
    futures::stream::iter(pairs.iter().cloned())
        .map(|(f, t)| async move { b.rename(&f, &t).await })
        .buffered(MANY_IN_FLIGHT)
        .collect()
        .await
}

/// Reads [`Backend::get_many`] has in flight at once, by default.
pub const GET_MANY_IN_FLIGHT: usize = 8;

/// Stages [`Backend::stage_many_if_absent`] has in flight at once, by default (as many as
/// an upload had before it staged by groups: [`crate::StoreOptions::parallelism`]'s default).
pub const STAGE_MANY_IN_FLIGHT: usize = 8;

/// [`Backend::stage_many_if_absent`]'s default: one [`Backend::stage_if_absent`] of `b`
/// each, [`STAGE_MANY_IN_FLIGHT`] at once, results in the order given.
pub(crate) async fn stage_each<B: Backend + ?Sized>(
    b: &B,
    batch: &StageBatch,
    items: Vec<(String, Bytes)>,
) -> Vec<Result<Staged, BackendError>> {
    use futures::StreamExt;
    futures::stream::iter(items)
        .map(|(k, d)| async move { b.stage_if_absent(batch, &k, d).await })
        .buffered(STAGE_MANY_IN_FLIGHT)
        .collect()
        .await
}

/// [`Backend::loose_present_many`]'s default: one [`Backend::loose_present`] of `b` each,
/// [`crate::store::PRESENCE_CHECKS_IN_FLIGHT`] at once, answers in the order given.
pub(crate) async fn present_each<B: Backend + ?Sized>(
    b: &B,
    keys: &[String],
) -> Vec<Result<bool, BackendError>> {
    use futures::StreamExt;
    futures::stream::iter(keys.iter().cloned())
        .map(|k| async move { b.loose_present(&k).await })
        .buffered(crate::store::PRESENCE_CHECKS_IN_FLIGHT)
        .collect()
        .await
}

/// Largest object [`Backend::get_versioned`] reads, bytes (64 MiB, the manifest limit): far
/// above any tag record or history, far below what would exhaust memory.
pub const MAX_MUTABLE_LEN: u64 = 64 << 20;

/// The error for a mutable object over [`MAX_MUTABLE_LEN`].
pub(crate) fn too_large(store: &str, key: &str, len: u64) -> BackendError {
    BackendError::Other {
        store: store.to_string(),
        op: "get",
        key: key.to_string(),
        message: format!("{len} bytes, over the {MAX_MUTABLE_LEN}-byte limit for a mutable object"),
    }
}

/// Checks a key: relative, `/`-separated segments of `[A-Za-z0-9._~-]`, no empty segment and
/// none starting with `.`, at most 512 bytes. Keys come partly from users (tag names), so this guards the
/// local backend against path traversal.
pub fn validate_key(key: &str) -> Result<(), BackendError> {
    let ok = !key.is_empty()
        && key.len() <= 512
        && key.split('/').all(|seg| {
            !seg.is_empty()
                && !seg.starts_with('.')
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'~'))
        });
    if ok {
        Ok(())
    } else {
        Err(BackendError::InvalidKey(key.to_string()))
    }
}

/// Where a store lives, parsed from a path, `file://PATH` or `s3://bucket/prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local directory.
    Local(PathBuf),
    /// An S3 bucket and key prefix (no leading or trailing `/`; may be empty).
    S3 {
        /// Bucket name.
        bucket: String,
        /// Key prefix inside the bucket.
        prefix: String,
    },
}

impl StoreUrl {
    /// Parses `s3://bucket[/prefix]`, `file://PATH` or a plain path.
    pub fn parse(url: &str) -> Result<Self, BackendError> {
        let bad = |reason: &str| BackendError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("no bucket name"));
            }
            let prefix = prefix.trim_matches('/').to_string();
            if !prefix.is_empty() {
                validate_key(&prefix).map_err(|_| bad("invalid prefix"))?;
            }
            return Ok(StoreUrl::S3 {
                bucket: bucket.to_string(),
                prefix,
            });
        }
        let path = url.strip_prefix("file://").unwrap_or(url);
        if path.is_empty() {
            return Err(bad("empty path"));
        }
        if url.contains("://") && !url.starts_with("file://") {
            return Err(bad(
                "unknown scheme (use a path, file://PATH or s3://bucket/prefix)",
            ));
        }
        Ok(StoreUrl::Local(PathBuf::from(path)))
    }

    /// The default store: `$KILN_STORE`, else `$HOME/.local/share/kiln/store`.
    pub fn default_url() -> Result<String, BackendError> {
        if let Some(s) = std::env::var_os("KILN_STORE").filter(|s| !s.is_empty()) {
            return Ok(s.to_string_lossy().into_owned());
        }
        let home = std::env::var_os("HOME").ok_or_else(|| BackendError::Url {
            url: String::new(),
            reason: "neither KILN_STORE nor HOME is set".into(),
        })?;
        Ok(Path::new(&home)
            .join(".local/share/kiln/store")
            .to_string_lossy()
            .into_owned())
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Local(p) => write!(f, "file://{}", p.display()),
            StoreUrl::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            StoreUrl::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// Opens the backend a URL names, wrapped once in [`retry::Retrying`] (default policy).
/// S3 settings come from the environment (see [`s3::S3Options::from_env`]).
pub async fn open(url: &str) -> Result<Arc<retry::Retrying>, BackendError> {
    open_with(
        url,
        &s3::S3Options::from_env(),
        retry::RetryPolicy::default(),
    )
    .await
}

/// Like [`open`] with explicit S3 options and retry policy.
pub async fn open_with(
    url: &str,
    s3_options: &s3::S3Options,
    policy: retry::RetryPolicy,
) -> Result<Arc<retry::Retrying>, BackendError> {
    open_url(&StoreUrl::parse(url)?, s3_options, policy).await
}

/// [`open_with`] for a parsed URL (a local directory as a path, never through a string).
pub async fn open_url(
    parsed: &StoreUrl,
    s3_options: &s3::S3Options,
    policy: retry::RetryPolicy,
) -> Result<Arc<retry::Retrying>, BackendError> {
    let inner: Arc<dyn Backend> = match parsed {
        StoreUrl::Local(path) => Arc::new(local::LocalBackend::open(path).await?),
        StoreUrl::S3 { bucket, prefix } => {
            Arc::new(s3::S3Backend::open(bucket, prefix, s3_options)?)
        }
    };
    Ok(Arc::new(retry::Retrying::new(inner, policy)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for ok in ["chunks/sha256/ab", "tags/my-img/v1.0_x", "a"] {
            validate_key(ok).unwrap();
        }
        for bad in [
            "",
            "/abs",
            "a//b",
            "a/../b",
            "..",
            "a/./b",
            "a/.hidden",
            "a/b/",
            "a b",
            "a/\u{e9}",
            "a\\b",
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            StoreUrl::parse("s3://b/p/q/").unwrap(),
            StoreUrl::S3 {
                bucket: "b".into(),
                prefix: "p/q".into()
            }
        );
        assert_eq!(
            StoreUrl::parse("s3://b").unwrap(),
            StoreUrl::S3 {
                bucket: "b".into(),
                prefix: "".into()
            }
        );
        assert_eq!(
            StoreUrl::parse("file:///x/y").unwrap(),
            StoreUrl::Local("/x/y".into())
        );
        assert_eq!(
            StoreUrl::parse("rel/dir").unwrap(),
            StoreUrl::Local("rel/dir".into())
        );
        assert!(StoreUrl::parse("s3://").is_err());
        assert!(StoreUrl::parse("s3://b/../x").is_err());
        assert!(StoreUrl::parse("gs://b").is_err());
        assert!(StoreUrl::parse("").is_err());
    }
}
