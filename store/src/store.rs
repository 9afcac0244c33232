//! [`Store`]: the typed store over one backend.
//!
//! A `Store` is cheap to clone (shared handles). It adds to the raw backend: digest checks on
//! every read, put-if-absent for immutable objects, a local index of chunks known to exist
//! (saves `put` round trips on repeated pushes), and an optional on-disk read cache of chunks.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;

use crate::backend::retry::{MetricsSnapshot, RetryPolicy, Retrying};
use crate::backend::s3::S3Options;
use crate::backend::{self, Backend, PutOutcome};
use crate::chunk::{self, EncodedChunk};
use crate::digest::{ChunkDigest, ManifestDigest};
use crate::inflight::{Claim, InFlight};
use crate::manifest::{MAX_MANIFEST_LEN, Manifest, ManifestError, ObjectRef, RawManifest};
use crate::readcache::ReadCache;
use crate::{StoreError, unix_now};

/// Presence checks ([`Store::exist`]) made one `head` each that are in flight at once.
pub const PRESENCE_CHECKS_IN_FLIGHT: usize = 32;

/// Fewest objects under one key prefix that [`Store::exist`] always looks for in a listing
/// rather than one `head` each, whatever earlier walks of that prefix found (a listing page
/// is a larger answer than a `head`).
pub const LIST_MIN_KEYS: usize = 256;

/// Objects a listing page must answer for, on average, for [`Store::exist`] to keep walking
/// the listing past its first two pages rather than `head` the rest. Also the fewest objects
/// under one prefix that [`Store::exist`] walks a listing for at all: fewer cannot meet it.
pub const LIST_MIN_PER_PAGE: usize = 8;

/// How long a [`Store`] handle heads, rather than lists, the groups below [`LIST_MIN_KEYS`]
/// of a key prefix whose listing walk gave up (10 minutes: a prefix dense with objects, a
/// store of loose chunks written before packs, stays so until a GC; and a walk that gives
/// up costs two listing pages, so a handle retrying every 10 minutes wastes next to
/// nothing).
pub const LIST_DENSE_RETRY: Duration = Duration::from_secs(600);

/// Options for [`Store::open_with`]. `Default` gives: environment S3 settings, default retry
/// policy, no read cache, in-memory known-chunk index, 8 parallel uploads.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// S3 overrides (endpoint, region, credentials).
    pub s3: S3Options,
    /// Retry policy of the backend wrapper.
    pub retry: RetryPolicy,
    /// On-disk read cache of chunks: directory and size bound in bytes.
    pub read_cache: Option<(PathBuf, u64)>,
    /// File persisting the known-chunk index across processes (one `<hex> <unix secs>` line per
    /// chunk); `None` keeps it in memory only.
    pub known_index: Option<PathBuf>,
    /// How long a "chunk exists" entry is trusted (default 1 h, the GC grace period: GC never
    /// deletes an object younger than that, and a push holds a lease on what it found).
    pub known_ttl: Duration,
    /// Chunk uploads/downloads in flight at once (default 8).
    pub parallelism: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            s3: S3Options::default(),
            retry: RetryPolicy::default(),
            read_cache: None,
            known_index: None,
            known_ttl: Duration::from_secs(3600),
            parallelism: 8,
        }
    }
}

/// Chunks known to exist in the store, with when that was last confirmed (unix seconds).
#[derive(Debug)]
pub(crate) struct KnownChunks {
    map: Mutex<HashMap<ChunkDigest, u64>>,
    file: Option<PathBuf>,
    ttl: Duration,
}

impl KnownChunks {
    fn load(file: Option<PathBuf>, ttl: Duration) -> Self {
        let mut map = HashMap::new();
        if let Some(f) = &file
            && let Ok(text) = std::fs::read_to_string(f)
        {
            for line in text.lines() {
                let mut it = line.split(' ');
                if let (Some(h), Some(t)) = (it.next(), it.next())
                    && let (Ok(d), Ok(t)) = (crate::digest::Sha256Hash::from_hex(h), t.parse())
                {
                    map.insert(ChunkDigest(d), t);
                }
            }
        }
        Self {
            map: Mutex::new(map),
            file,
            ttl,
        }
    }

    pub(crate) fn contains(&self, d: &ChunkDigest) -> bool {
        let now = unix_now();
        // The lock is never held across a panic point, so poisoning cannot happen; recover anyway.
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(d)
            .is_some_and(|t| now.saturating_sub(*t) < self.ttl.as_secs())
    }

    pub(crate) fn insert(&self, d: ChunkDigest) {
        let now = unix_now();
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(d, now);
        if let Some(f) = &self.file {
            use std::io::Write;
            // Best effort: the index only saves round trips.
            if let Ok(mut file) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(f)
            {
                let _ = writeln!(file, "{} {now}", d.hex());
            }
        }
    }

    pub(crate) fn forget(&self, d: &ChunkDigest) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).remove(d);
    }
}

/// The content-addressed store. See the crate doc for the key layout.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) backend: Arc<Retrying>,
    pub(crate) known: Arc<KnownChunks>,
    pub(crate) cache: Option<Arc<ReadCache>>,
    /// Chunk reads in flight, shared by the clones of this handle.
    pub(crate) inflight: InFlight,
    pub(crate) parallelism: usize,
    /// Key prefixes whose listing walk ([`Store::exist`]) gave up, and when: too many other
    /// objects under them for a listing page to answer for [`LIST_MIN_PER_PAGE`] of the
    /// objects asked about. Their groups below [`LIST_MIN_KEYS`] are headed for
    /// [`LIST_DENSE_RETRY`] after that.
    pub(crate) dense: Arc<Mutex<HashMap<String, std::time::Instant>>>,
}

impl Store {
    /// Opens the store at `url` (a path, `file://PATH` or `s3://bucket/prefix`) with default
    /// options. Local directories are created if missing; S3 makes no request yet.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_with(url, StoreOptions::default()).await
    }

    /// Opens the default store: `$KILN_STORE`, else `~/.local/share/kiln/store`.
    pub async fn open_default() -> Result<Self, StoreError> {
        Self::open(&backend::StoreUrl::default_url()?).await
    }

    /// Opens with explicit options.
    pub async fn open_with(url: &str, opts: StoreOptions) -> Result<Self, StoreError> {
        Self::open_url(&backend::StoreUrl::parse(url)?, opts).await
    }

    /// Opens the local store directory `dir` (created if missing) with default options; the
    /// path is used as it is (not as a URL string, so any path works).
    pub async fn open_dir(dir: &std::path::Path) -> Result<Self, StoreError> {
        Self::open_url(
            &backend::StoreUrl::Local(dir.to_path_buf()),
            StoreOptions::default(),
        )
        .await
    }

    /// Opens the parsed store URL `url` with explicit options.
    pub async fn open_url(url: &backend::StoreUrl, opts: StoreOptions) -> Result<Self, StoreError> {
        let backend = backend::open_url(url, &opts.s3, opts.retry).await?;
        let cache = match &opts.read_cache {
            Some((dir, max)) => Some(Arc::new(ReadCache::open(dir, *max).await?)),
            None => None,
        };
        Ok(Self {
            backend,
            known: Arc::new(KnownChunks::load(opts.known_index.clone(), opts.known_ttl)),
            cache,
            inflight: InFlight::default(),
            parallelism: opts.parallelism.max(1),
            dense: Arc::default(),
        })
    }

    /// Wraps an already-built backend (e.g. a fault injector in tests) with the standard
    /// retry/metrics wrapper.
    pub fn from_backend(inner: Arc<dyn Backend>, opts: StoreOptions) -> Self {
        Self {
            backend: Arc::new(Retrying::new(inner, opts.retry)),
            known: Arc::new(KnownChunks::load(opts.known_index, opts.known_ttl)),
            cache: None,
            inflight: InFlight::default(),
            parallelism: opts.parallelism.max(1),
            dense: Arc::default(),
        }
    }

    /// The store's URL (`file:///...` or `s3://bucket/prefix`), as used in error messages.
    pub fn url(&self) -> &str {
        self.backend.url()
    }

    /// The backend (with retries and metrics), for primitives this type does not wrap.
    pub fn backend(&self) -> &Arc<Retrying> {
        &self.backend
    }

    /// Request and byte counters since open.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.backend.metrics()
    }

    /// `op` on `key`, and where that finds nothing, on its fossil ([`crate::gc::fossil_key`])
    /// and then on `key` once more (GC may have put it back meanwhile). The one place
    /// readers of content-addressed objects fall back to fossils: an object GC condemned can
    /// still be named by a manifest published during that GC run, until its second phase puts
    /// it back (see [`crate::gc`]). Writers never look at fossils ([`Store::exist`]).
    async fn with_fossil<T, F, Fut>(&self, key: &str, op: F) -> Result<Option<T>, StoreError>
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, backend::BackendError>>,
    {
        if let Some(v) = op(key.to_string()).await? {
            return Ok(Some(v));
        }
        if let Some(v) = op(crate::gc::fossil_key(key)).await? {
            return Ok(Some(v));
        }
        Ok(op(key.to_string()).await?)
    }

    /// Bytes `range` of the object at `key` as a reader sees it (falling back to its fossil,
    /// see [`Store::with_fossil`]). Errors: `NotFound` naming `key` when neither exists.
    pub(crate) async fn read_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes, StoreError> {
        let found = self
            .with_fossil(key, |k| {
                let range = range.clone();
                async move { absent_as_none(self.backend.get_range(&k, range).await) }
            })
            .await?;
        found.ok_or_else(|| self.not_found(key))
    }

    /// The whole object at `key` as a reader sees it (see [`Store::read_range`]).
    pub(crate) async fn read(&self, key: &str) -> Result<Bytes, StoreError> {
        let found = self
            .with_fossil(key, |k| async move {
                absent_as_none(self.backend.get(&k).await)
            })
            .await?;
        found.ok_or_else(|| self.not_found(key))
    }

    /// Metadata of the object at `key` as a reader sees it (its fossil's when only that
    /// exists), `None` when neither exists.
    pub(crate) async fn read_head(
        &self,
        key: &str,
    ) -> Result<Option<backend::ObjectInfo>, StoreError> {
        self.with_fossil(key, |k| async move { self.backend.head(&k).await })
            .await
    }

    fn not_found(&self, key: &str) -> StoreError {
        backend::BackendError::NotFound {
            store: self.url().to_string(),
            key: key.to_string(),
        }
        .into()
    }

    /// Whether an object exists under its own key (one `head`; a fossil does not count: this
    /// is the writer's question).
    pub async fn has(&self, obj: &ObjectRef) -> Result<bool, StoreError> {
        Ok(self.backend.head(&obj.key()).await?.is_some())
    }

    /// Which of `objs` exist, in the order given (`true`: present). Answers for every object
    /// from the store itself, never from the known-chunk index. Packed chunks first
    /// ([`Backend::packed_present`]), then the rest:
    ///
    /// Where the backend lists in key order ([`Backend::ordered_listing`]: S3) and at least
    /// [`LIST_MIN_PER_PAGE`] objects share a key prefix (`chunks/sha256/`, ...), they are
    /// found by walking the listing from the first one: a page of up to
    /// [`backend::LIST_PAGE_MAX`] keys answers for every object up to its last key. So a push
    /// whose 2,797 objects are all present costs a few requests instead of 2,797 (issue 16),
    /// and each group of 64 chunks an import leases and looks up
    /// ([`crate::artifact`]) costs one listing instead of 64 heads in a store of packs, whose
    /// `chunks/sha256/` holds no or few loose objects (issue 33: a 256 MiB import into S3
    /// made about 4,000 heads, and ran at 17 MB/s against moto's ~400 requests a second).
    /// Once a walk answers for fewer than [`LIST_MIN_PER_PAGE`] objects a page (a prefix
    /// with many more objects than the set asked about: a store of loose chunks written
    /// before packs), the rest of that prefix is checked one `head` each, and for
    /// [`LIST_DENSE_RETRY`] this handle heads that prefix's groups below [`LIST_MIN_KEYS`]
    /// without walking: a dense prefix costs an import two wasted pages, not two per group.
    /// Everything else is one `head` per object ([`Backend::loose_present_many`]: locally
    /// all in one blocking call; on S3 [`PRESENCE_CHECKS_IN_FLIGHT`] at once).
    /// Errors: the first failed request.
    ///
    /// A walk's answer is as safe for the writer as a `head`'s (a `true` is never stale,
    /// [`crate::gc`]; a `false` may be): each page is a listing request made after the call
    /// began, so after the caller's lease ([`crate::lease::Lease::find_present`]), and a
    /// listing is as strongly consistent as a `head` (a write, delete or copy that has
    /// returned is seen by every later listing: Amazon S3 User Guide, "Amazon S3 data
    /// consistency model"), so a key GC moved to its fossil before the page was listed is
    /// not in it. Walk or `head` (and the memory of dense prefixes that chooses) changes
    /// what the answer costs, never what it can see.
    pub async fn exist(&self, objs: &[ObjectRef]) -> Result<Vec<bool>, StoreError> {
        let mut out = vec![false; objs.len()];
        let keys: Vec<String> = objs.iter().map(|o| o.key()).collect();
        // By prefix (the key up to its last `/`), then by key.
        // Chunks the backend holds in packs ([`Backend::packed_present`]: S3, one listing of
        // each pack's dead markers); the rest as loose objects below.
        let packed = self.backend.packed_present(&keys).await?;
        let mut order: Vec<usize> = (0..keys.len()).filter(|&i| !packed[i]).collect();
        for (i, p) in packed.iter().enumerate() {
            out[i] = *p;
        }
        let dir = |k: &str| k.rfind('/').map_or(0, |i| i + 1);
        order.sort_by(|&a, &b| {
            let (ka, kb) = (&keys[a], &keys[b]);
            ka[..dir(ka)].cmp(&kb[..dir(kb)]).then(ka.cmp(kb))
        });
        let mut by_head: Vec<usize> = Vec::new();
        let mut rest = &order[..];
        while let Some(&first) = rest.first() {
            let prefix = &keys[first][..dir(&keys[first])];
            let n = rest
                .iter()
                .take_while(|&&i| keys[i].starts_with(prefix) && dir(&keys[i]) == prefix.len())
                .count();
            let (group, tail) = rest.split_at(n);
            rest = tail;
            if !self.backend.ordered_listing()
                || group.len() < LIST_MIN_PER_PAGE
                || prefix.is_empty()
                || (group.len() < LIST_MIN_KEYS && self.recently_dense(prefix))
            {
                by_head.extend_from_slice(group);
                continue;
            }
            let done = self.walk_listing(prefix, group, &keys, &mut out).await?;
            if done < group.len() {
                self.lock_dense()
                    .insert(prefix.to_string(), std::time::Instant::now());
            }
            by_head.extend_from_slice(&group[done..]);
        }
        if by_head.is_empty() {
            return Ok(out);
        }
        let asked: Vec<String> = by_head.iter().map(|&i| keys[i].clone()).collect();
        let found = self.backend.loose_present_many(&asked).await;
        if found.len() != by_head.len() {
            // An error for all of them (a blocking call that panicked, ...).
            let e = found.into_iter().find_map(Result::err);
            return Err(e.map_or_else(
                || StoreError::io("exist", std::io::Error::other("a look-up lost")),
                StoreError::from,
            ));
        }
        for (i, p) in by_head.into_iter().zip(found) {
            out[i] = p?;
        }
        Ok(out)
    }

    fn lock_dense(&self) -> std::sync::MutexGuard<'_, HashMap<String, std::time::Instant>> {
        // Never held across a panic point; recover anyway.
        self.dense.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a listing walk under `prefix` gave up less than [`LIST_DENSE_RETRY`] ago.
    fn recently_dense(&self, prefix: &str) -> bool {
        self.lock_dense()
            .get(prefix)
            .is_some_and(|t| t.elapsed() < LIST_DENSE_RETRY)
    }

    /// [`Store::exist`]'s listing walk over `group` (indices into `keys`, sorted by key, all
    /// directly under `prefix`): sets `out` for the first objects it answers for and returns
    /// how many that is (the rest are left to `head`).
    async fn walk_listing(
        &self,
        prefix: &str,
        group: &[usize],
        keys: &[String],
        out: &mut [bool],
    ) -> Result<usize, StoreError> {
        let (mut done, mut pages) = (0usize, 0usize);
        while done < group.len() {
            if pages >= 2 && done < pages * LIST_MIN_PER_PAGE {
                break;
            }
            // Start just before the first unanswered key: its name less its last character
            // sorts before it, and at most 15 keys of the same length lie between the two.
            let next = &keys[group[done]];
            let start_after = &next[..next.len() - 1];
            let page = self
                .backend
                .list_page(prefix, start_after, backend::LIST_PAGE_MAX)
                .await?;
            pages += 1;
            let before = done;
            let last = page.objects.last().map(|o| o.key.as_str());
            while done < group.len() {
                let k = keys[group[done]].as_str();
                // Past the page's last key only when nothing follows it.
                if page.truncated && last.is_none_or(|l| k > l) {
                    break;
                }
                out[group[done]] = page
                    .objects
                    .binary_search_by(|o| o.key.as_str().cmp(k))
                    .is_ok();
                done += 1;
            }
            if done == before {
                break;
            }
        }
        Ok(done)
    }

    // ---- chunks ----

    /// Compresses and stores one raw chunk unless already present. Returns the encoded chunk
    /// and whether this call uploaded it (`false`: known or found present).
    pub async fn put_chunk(&self, raw: Bytes) -> Result<(EncodedChunk, bool), StoreError> {
        let enc = tokio::task::spawn_blocking(move || chunk::encode(&raw))
            .await
            .map_err(|e| StoreError::io("encode", std::io::Error::other(e)))??;
        let uploaded = self.put_encoded_chunk(&enc).await?;
        Ok((enc, uploaded))
    }

    /// Stores an encoded chunk unless known or present (put-if-absent). Returns `true` when
    /// this call wrote it. The caller vouches that `stored` is the zstd frame of bytes hashing
    /// to `digest` (use [`chunk::encode`]).
    pub async fn put_encoded_chunk(&self, enc: &EncodedChunk) -> Result<bool, StoreError> {
        if self.known.contains(&enc.digest) {
            return Ok(false);
        }
        self.put_encoded_chunk_unindexed(enc).await
    }

    /// Stores an encoded chunk with put-if-absent, whatever the known-chunk index says (for a
    /// chunk a lease found absent). Returns `true` when this call wrote it.
    pub(crate) async fn put_encoded_chunk_unindexed(
        &self,
        enc: &EncodedChunk,
    ) -> Result<bool, StoreError> {
        let out = self
            .backend
            .put_if_absent(&enc.digest.key(), enc.stored.clone(), None)
            .await?;
        self.known.insert(enc.digest);
        Ok(out == PutOutcome::Created)
    }

    /// A chunk's stored bytes (the zstd frame), unverified; for copying between stores.
    pub async fn get_chunk_stored(&self, digest: &ChunkDigest) -> Result<Bytes, StoreError> {
        // Read at most one byte past the bound, so a planted huge object is never loaded.
        let stored = self
            .read_range(&digest.key(), 0..chunk::MAX_STORED_CHUNK_LEN + 1)
            .await?;
        if stored.len() as u64 > chunk::MAX_STORED_CHUNK_LEN {
            self.known.forget(digest);
            return Err(chunk::ChunkError::Corrupt {
                digest: *digest,
                store: self.url().to_string(),
                reason: format!(
                    "stored object is over the {}-byte limit for a chunk",
                    chunk::MAX_STORED_CHUNK_LEN
                ),
            }
            .into());
        }
        Ok(stored)
    }

    /// A chunk's raw bytes, verified: decompressed with at most `max_raw_len` bytes and hashed.
    /// A mismatch is [`ChunkError::DigestMismatch`] naming chunk and store. Goes through the
    /// read cache when one is configured. A chunk another read of this handle is fetching
    /// is not fetched again: this read waits for that one's bytes ([`crate::inflight`]),
    /// within one operation bound in all ([`Store::theirs_or_fetch`]).
    pub async fn get_chunk(
        &self,
        digest: &ChunkDigest,
        max_raw_len: u64,
    ) -> Result<Bytes, StoreError> {
        if let Some(c) = &self.cache
            && let Some(b) = c.get(digest).await
        {
            return Ok(b);
        }
        match self.inflight.claim(*digest) {
            Claim::Mine(f) => self.fetch_chunk(digest, max_raw_len, Some(f)).await,
            Claim::Theirs(w) => self.theirs_or_fetch(w, digest, max_raw_len).await,
        }
    }

    /// A chunk's stored bytes fetched, decoded and verified ([`Store::get_chunk_stored`],
    /// then [`Store::decode_chunk`], which hands them to `fetching`'s waiters), whatever
    /// other reads of it are doing.
    async fn fetch_chunk(
        &self,
        digest: &ChunkDigest,
        max_raw_len: u64,
        fetching: Option<crate::inflight::Fetching>,
    ) -> Result<Bytes, StoreError> {
        let stored = self.get_chunk_stored(digest).await?;
        self.decode_chunk(*digest, stored, max_raw_len, fetching)
            .await
    }

    /// The bytes of a chunk another read of this handle is fetching (`theirs`), when that
    /// fetch brings them; when it fails first (or brings a chunk over `max_raw_len`), this
    /// read's own fetch. Both within one operation bound of the store
    /// ([`RetryPolicy::operation_timeout`]) counted from the call, so a read that meets
    /// another waits no longer than a fetch of its own may take: the chunk server's read
    /// bound (`lazy_read_timeout_secs`) then holds for the clone's reads of chunks its
    /// prefetch is fetching, which otherwise waited for the prefetch's whole bound and then
    /// their own (issue 35, a stalled store: 6 s for a 3 s bound). At the bound:
    /// [`BackendError::GaveUp`](crate::backend::BackendError::GaveUp) naming the chunk.
    async fn theirs_or_fetch(
        &self,
        theirs: crate::inflight::Waiter,
        digest: &ChunkDigest,
        max_raw_len: u64,
    ) -> Result<Bytes, StoreError> {
        let bound = self.backend.policy().operation_timeout;
        let started = std::time::Instant::now();
        if let Some(b) = theirs.bytes(bound).await
            && b.len() as u64 <= max_raw_len
        {
            return Ok(b);
        }
        let gave_up = |last: &str| {
            StoreError::Backend(backend::BackendError::GaveUp {
                store: self.url().to_string(),
                op: "get",
                key: digest.key(),
                attempts: 0,
                elapsed: started.elapsed(),
                bound: Some(bound),
                last: last.to_string(),
            })
        };
        let left = bound.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(gave_up(
                "another read of this chunk was fetching it and brought nothing",
            ));
        }
        tokio::time::timeout(left, self.fetch_chunk(digest, max_raw_len, None))
            .await
            .unwrap_or_else(|_| {
                Err(gave_up(
                    "another read of this chunk failed, and this read's own fetch had no answer yet",
                ))
            })
    }

    /// [`Store::get_chunk_stored`] of many chunks at once, in the order given: one
    /// [`Backend::get_many`] (on S3 a few ranged GETs per pack instead of a GET per chunk),
    /// then each chunk it found absent read alone the usual way (its fossil, say).
    pub async fn get_chunks_stored(
        &self,
        digests: &[ChunkDigest],
    ) -> Vec<Result<Bytes, StoreError>> {
        if digests.is_empty() {
            return Vec::new();
        }
        let keys: Vec<String> = digests.iter().map(|d| d.key()).collect();
        let got = self
            .backend
            .get_many(&keys, chunk::MAX_STORED_CHUNK_LEN + 1)
            .await;
        let mut out = Vec::with_capacity(digests.len());
        for (d, r) in digests.iter().zip(got) {
            out.push(match r {
                Ok(b) if b.len() as u64 <= chunk::MAX_STORED_CHUNK_LEN => Ok(b),
                Ok(_) => self.get_chunk_stored(d).await,
                Err(e) if e.is_not_found() => self.get_chunk_stored(d).await,
                Err(e) => Err(e.into()),
            });
        }
        out
    }

    /// [`Store::get_chunk`] of many chunks at once (digest, raw length bound), in the order
    /// given: the read cache first, then those no other read of this handle is fetching with
    /// [`Store::get_chunks_stored`], each decoded and verified (and cached) as
    /// [`Store::get_chunk`] does; last, the bytes of the chunks others were fetching (each
    /// read alone if that fetch failed).
    pub async fn get_chunks(
        &self,
        chunks: &[(ChunkDigest, u64)],
    ) -> Vec<Result<Bytes, StoreError>> {
        let mut out: Vec<Option<Result<Bytes, StoreError>>> = chunks.iter().map(|_| None).collect();
        if let Some(c) = &self.cache {
            for (i, (d, _)) in chunks.iter().enumerate() {
                if let Some(b) = c.get(d).await {
                    out[i] = Some(Ok(b));
                }
            }
        }
        let (mut mine, mut theirs) = (Vec::new(), Vec::new());
        for i in (0..chunks.len()).filter(|&i| out[i].is_none()) {
            match self.inflight.claim(chunks[i].0) {
                Claim::Mine(f) => mine.push((i, f)),
                Claim::Theirs(w) => theirs.push((i, w)),
            }
        }
        // Everything claimed here is fetched before any wait for another read's fetch.
        let digests: Vec<ChunkDigest> = mine.iter().map(|(i, _)| chunks[*i].0).collect();
        let stored = self.get_chunks_stored(&digests).await;
        // Decoded on every core, each handed to its waiters as soon as it is verified.
        let decoded: Vec<(usize, Result<Bytes, StoreError>)> =
            futures::stream::iter(mine.into_iter().zip(stored))
                .map(|((i, fetching), s)| async move {
                    let (d, max_raw_len) = chunks[i];
                    let raw = match s {
                        Ok(stored) => {
                            self.decode_chunk(d, stored, max_raw_len, Some(fetching))
                                .await
                        }
                        Err(e) => Err(e),
                    };
                    (i, raw)
                })
                .buffer_unordered(self.parallelism)
                .collect()
                .await;
        for (i, raw) in decoded {
            out[i] = Some(raw);
        }
        for (i, w) in theirs {
            let (d, max_raw_len) = chunks[i];
            out[i] = Some(self.theirs_or_fetch(w, &d, max_raw_len).await);
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(StoreError::io(
                        "get_chunks",
                        std::io::Error::other("no read made"),
                    ))
                })
            })
            .collect()
    }

    /// Writes the stored bytes of the chunks `digests` (each stored already), in the order
    /// given, into new packs of their own: [`Backend::pack_together`] (on S3, a second copy
    /// of each, which then serves when its pack is the smaller; locally nothing, a chunk is
    /// read from a file on this host, where order gains nothing). For a snapshot's prefetch
    /// list in the order a clone's chunk server fetches it
    /// ([`crate::PrefetchList::fetch_order`]): a cold start then reads it with a few
    /// ranged GETs of one small pack (the S3 backend's "Packing together").
    ///
    /// Not leased: a lease protects what a writer relies on finding present, and this
    /// relies on nothing. It reads each chunk (one condemned by a GC meanwhile reads as
    /// absent, and the call fails) and writes a copy no writer is told of: a writer still
    /// finds a chunk present only by a fresh check of the store, and a GC's condemn marks
    /// the chunk dead in every copy its listing shows; a copy published after that listing
    /// makes the chunk present again, never absent (the GC argument's "written afresh"
    /// case: garbage, if nothing references it, for a later GC). Errors: the backend's.
    pub async fn pack_together(
        &self,
        digests: &[ChunkDigest],
    ) -> Result<backend::PackedTogether, StoreError> {
        let keys: Vec<String> = digests.iter().map(|d| d.key()).collect();
        Ok(self.backend.pack_together(&keys).await?)
    }

    /// [`Store::pack_together`] of `snap`'s prefetch list in the order a clone's chunk
    /// server fetches it ([`crate::PrefetchList::fetch_order`]), where a snapshot's chunks
    /// come into a store: `kiln snapshot` (kiln-vmm) once the list is recorded, and a copy
    /// ([`crate::copy`]) that brings the snapshot manifest. Nothing for a snapshot without
    /// a list, or with one that names no chunk of it (the chunk server then fetches
    /// nothing either).
    ///
    /// Best effort, as both callers want it: the chunks are stored either way. What it
    /// packed is logged (`tracing` info: packs, chunks, bytes, ms) and returned; a failure is
    /// logged as a warning and returns `None`.
    pub async fn pack_prefetch(
        &self,
        snap: &crate::SnapshotManifest,
    ) -> Option<backend::PackedTogether> {
        let Some(Ok(entries)) = snap.prefetch.as_ref().map(|p| p.fetch_order(snap)) else {
            return Some(backend::PackedTogether::default());
        };
        let digests: Vec<ChunkDigest> = entries.into_iter().filter_map(|(_, e)| e.digest).collect();
        let t0 = std::time::Instant::now();
        match self.pack_together(&digests).await {
            Ok(p) => {
                if p.chunks > 0 {
                    tracing::info!(
                        store = %self.url(),
                        packs = ?p.packs,
                        chunks = p.chunks,
                        bytes = p.bytes,
                        ms = t0.elapsed().as_millis() as u64,
                        "the prefetch list's chunks packed together in fetch order"
                    );
                }
                Some(p)
            }
            Err(e) => {
                tracing::warn!(
                    store = %self.url(),
                    error = %e,
                    "packing the prefetch list's chunks together failed; they stay where they are"
                );
                None
            }
        }
    }

    /// A chunk's stored bytes decoded and verified (the known index forgets it when they are
    /// bad), handed to the waiters of `fetching` (the other reads of it), then put in the
    /// read cache: a write no reader need wait for (a file written and renamed under the
    /// cache's lock, on the blocking pool).
    async fn decode_chunk(
        &self,
        d: ChunkDigest,
        stored: Bytes,
        max_raw_len: u64,
        fetching: Option<crate::inflight::Fetching>,
    ) -> Result<Bytes, StoreError> {
        let url = self.url().to_string();
        let raw =
            tokio::task::spawn_blocking(move || chunk::decode(&d, &stored, max_raw_len, &url))
                .await
                .map_err(|e| StoreError::io("decode", std::io::Error::other(e)))?;
        let raw = match raw {
            Ok(r) => Bytes::from(r),
            Err(e) => {
                self.known.forget(&d);
                return Err(e.into());
            }
        };
        if let Some(f) = &fetching {
            f.done(&raw);
        }
        if let Some(c) = &self.cache {
            c.put(&d, raw.clone()).await;
        }
        // Claims of the chunk made meanwhile took the bytes from `fetching`; from here on a
        // read finds them in the cache.
        drop(fetching);
        Ok(raw)
    }

    // ---- manifests ----

    /// Serializes and stores a manifest (put-if-absent). Returns its raw form and digest.
    pub async fn put_manifest(&self, m: &Manifest) -> Result<RawManifest, StoreError> {
        let raw = RawManifest::encode(m)?;
        self.put_raw_manifest(&raw).await?;
        Ok(raw)
    }

    /// Stores manifest bytes as given after checking they parse (put-if-absent, digest checked
    /// by the backend before the object becomes visible).
    pub async fn put_raw_manifest(&self, raw: &RawManifest) -> Result<(), StoreError> {
        raw.parse()?;
        self.backend
            .put_if_absent(&raw.digest.key(), raw.bytes.clone(), Some(raw.digest.0))
            .await?;
        Ok(())
    }

    /// A manifest's bytes, checked against its digest and size limit (not parsed).
    pub async fn get_raw_manifest(
        &self,
        digest: &ManifestDigest,
    ) -> Result<RawManifest, StoreError> {
        let key = digest.key();
        if let Some(info) = self.read_head(&key).await?
            && info.size > MAX_MANIFEST_LEN as u64
        {
            return Err(ManifestError::TooLarge {
                digest: *digest,
                len: info.size as usize,
            }
            .into());
        }
        let bytes = self.read(&key).await?;
        let raw = RawManifest::new(bytes);
        if raw.digest != *digest {
            return Err(ManifestError::DigestMismatch {
                digest: *digest,
                store: self.url().to_string(),
                actual: raw.digest,
            }
            .into());
        }
        Ok(raw)
    }

    /// A manifest, checked and parsed.
    pub async fn get_manifest(&self, digest: &ManifestDigest) -> Result<Manifest, StoreError> {
        Ok(self.get_raw_manifest(digest).await?.parse()?)
    }
}

/// `NotFound` as `None`.
fn absent_as_none<T>(
    r: Result<T, backend::BackendError>,
) -> Result<Option<T>, backend::BackendError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

impl From<tokio::task::JoinError> for StoreError {
    fn from(e: tokio::task::JoinError) -> Self {
        StoreError::io("task", std::io::Error::other(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::random_bytes;

    /// A huge object planted under a chunk key is refused without being read into memory.
    #[tokio::test]
    async fn an_oversized_chunk_object_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let enc = chunk::encode(b"some chunk").unwrap();
        store.put_encoded_chunk(&enc).await.unwrap();
        assert_eq!(
            &store.get_chunk(&enc.digest, 10).await.unwrap()[..],
            b"some chunk"
        );
        // Replace it with a 1 TiB sparse file (a read of it all would exhaust memory).
        let p = dir.path().join(enc.digest.key());
        std::fs::remove_file(&p).unwrap();
        std::fs::File::create(&p).unwrap().set_len(1 << 40).unwrap();
        for r in [
            store.get_chunk(&enc.digest, 10).await,
            store.get_chunk_stored(&enc.digest).await,
        ] {
            let err = r.unwrap_err();
            assert!(
                matches!(err, StoreError::Chunk(chunk::ChunkError::Corrupt { .. })),
                "{err}"
            );
            assert!(err.to_string().contains("limit"), "{err}");
        }
    }

    /// A read that meets another's fetch of the same chunk waits for it within one operation
    /// bound of the store in all: when that fetch brings nothing by then, the read gives up,
    /// naming the chunk, instead of waiting a second bound for a fetch of its own; when that
    /// fetch fails first, the read fetches the chunk itself.
    #[tokio::test]
    async fn a_read_that_waits_for_another_fetch_stays_within_one_bound() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().to_str().unwrap().to_string();
        let bound = Duration::from_millis(300);
        let opts = StoreOptions {
            retry: RetryPolicy {
                operation_timeout: bound,
                ..RetryPolicy::default()
            },
            ..StoreOptions::default()
        };
        let store = Store::open_with(&url, opts).await.unwrap();
        let enc = chunk::encode(b"a chunk in the store").unwrap();
        store.put_encoded_chunk(&enc).await.unwrap();
        // Another read's fetch that never ends (held, never done): the chunk is in the
        // store, so a read that fell back to a fetch of its own would get it.
        let Claim::Mine(stalled) = store.inflight.claim(enc.digest) else {
            panic!("the first claim fetches")
        };
        for r in [
            store.get_chunk(&enc.digest, 1 << 20).await,
            store
                .get_chunks(&[(enc.digest, 1 << 20)])
                .await
                .pop()
                .unwrap(),
        ] {
            let err = r.unwrap_err();
            assert!(
                matches!(
                    &err,
                    StoreError::Backend(backend::BackendError::GaveUp { bound: Some(b), .. })
                        if *b == bound
                ),
                "{err}"
            );
            let msg = err.to_string();
            assert!(
                msg.contains(&url) && msg.contains(&enc.digest.hex()) && msg.contains("gave up in"),
                "{msg}"
            );
        }
        // That fetch fails (ends without bytes): the read fetches the chunk itself.
        drop(stalled);
        let Claim::Mine(failing) = store.inflight.claim(enc.digest) else {
            panic!("the claim was released")
        };
        let (read, ()) = tokio::join!(store.get_chunk(&enc.digest, 1 << 20), async {
            // The read above claims first (polled first) and waits for this fetch.
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(failing);
        });
        assert_eq!(&read.unwrap()[..], b"a chunk in the store");
    }

    /// Verify on packed chunks: `--deep` finds a chunk whose bytes in its pack were
    /// damaged; a pack cut short of what its index names and a damaged index are each
    /// reported as a corrupt store file, and the chunks they held as missing.
    #[tokio::test]
    async fn verify_reports_damaged_packs_and_indexes() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        use crate::verify::Finding;
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().to_str().unwrap().to_string();
        let store = Store::open(&url).await.unwrap();
        let (table, _) = store
            .put_artifact_reader(
                std::io::Cursor::new(random_bytes(5, 1 << 20)),
                &PutArtifactOptions::default(),
            )
            .await
            .unwrap();
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
            .await
            .unwrap();
        store
            .set_tag(&"img:v1".parse().unwrap(), None, raw.digest)
            .await
            .unwrap();
        let gc = crate::gc::GcOptions::default();
        assert!(store.verify(true, &gc).await.unwrap().findings.is_empty());
        let packs = dir.path().join(".packs");
        let file = |ext: &str| {
            std::fs::read_dir(&packs)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| p.extension().is_some_and(|x| x == ext))
                .unwrap()
        };
        // One byte of the pack flipped (the start of the first chunk written: a zstd magic).
        let pack = file("pack");
        let mut bytes = std::fs::read(&pack).unwrap();
        bytes[0] ^= 0xff;
        std::fs::write(&pack, &bytes).unwrap();
        let r = Store::open(&url)
            .await
            .unwrap()
            .verify(true, &gc)
            .await
            .unwrap();
        assert!(
            r.findings
                .iter()
                .any(|f| matches!(f, Finding::CorruptChunk { .. })),
            "{:?}",
            r.findings
        );
        // The pack cut short.
        std::fs::write(&pack, &bytes[..bytes.len() / 2]).unwrap();
        let r = Store::open(&url)
            .await
            .unwrap()
            .verify(false, &gc)
            .await
            .unwrap();
        let name = pack.file_name().unwrap().to_str().unwrap();
        assert!(
            r.findings.iter().any(|f| matches!(f,
                Finding::CorruptStoreFile { reason, .. } if reason.contains(name))),
            "{:?}",
            r.findings
        );
        assert!(
            r.findings
                .iter()
                .any(|f| matches!(f, Finding::MissingChunk { .. })),
            "{:?}",
            r.findings
        );
        // The index damaged.
        std::fs::write(&pack, &bytes).unwrap();
        let idx = file("idx");
        let mut ib = std::fs::read(&idx).unwrap();
        ib[20] ^= 1;
        std::fs::write(&idx, &ib).unwrap();
        let r = Store::open(&url)
            .await
            .unwrap()
            .verify(false, &gc)
            .await
            .unwrap();
        let name = idx.display().to_string();
        assert!(
            r.findings.iter().any(|f| matches!(f,
                Finding::CorruptStoreFile { file, reason } if *file == name && reason.contains("checksum"))),
            "{:?}",
            r.findings
        );
    }

    /// `verify --deep` reports such an object as a corrupt chunk (and does not load it).
    #[tokio::test]
    async fn verify_reports_an_oversized_chunk_object() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::ImageManifest;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8 + 1).collect();
        let (table, _) = store
            .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
            .await
            .unwrap();
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
            .await
            .unwrap();
        store
            .set_tag(&"img:v1".parse().unwrap(), None, raw.digest)
            .await
            .unwrap();
        let victim = table.entries[0].digest.unwrap();
        let p = dir.path().join(victim.key());
        // The chunk is packed: deleted there, it is the file at its key that is read.
        store.backend.delete(&victim.key()).await.unwrap();
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::File::create(&p).unwrap().set_len(1 << 40).unwrap();
        let r = store
            .verify(true, &crate::gc::GcOptions::default())
            .await
            .unwrap();
        assert!(
            r.findings.iter().any(|f| matches!(f,
                crate::verify::Finding::CorruptChunk { chunk, reason }
                    if *chunk == victim && reason.contains("limit"))),
            "{:?}",
            r.findings
        );
    }

    /// A reader that gives `data`, then blocks until `wait`'s sender is dropped, then ends.
    struct Stalling {
        data: std::io::Cursor<Vec<u8>>,
        wait: std::sync::mpsc::Receiver<()>,
    }

    impl std::io::Read for Stalling {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.data.read(buf)?;
            if n == 0 {
                let _ = self.wait.recv();
            }
            Ok(n)
        }
    }

    /// The files (not directories) in the local store's `.tmp`.
    fn temp_files(root: &std::path::Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(root.join(".tmp"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect()
    }

    /// An upload dropped before its commit (a build cancelled while its image or memory
    /// file is stored: the pipeline drops the snapshot future on cancel) leaves no staged
    /// chunk behind in `.tmp`: nothing (GC, verify, a later import) ever removes one, and
    /// a memory file's are gigabytes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_put_artifact_leaves_no_staged_chunks_in_tmp() {
        use crate::artifact::PutArtifactOptions;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let (hold, wait) = std::sync::mpsc::channel::<()>();
        let reader = Stalling {
            data: std::io::Cursor::new(random_bytes(7, 4 << 20)),
            wait,
        };
        let opts = PutArtifactOptions::default();
        let root = dir.path().to_path_buf();
        // Staged: 16 chunks' worth of bytes in `.tmp` (the upload's pack file).
        let staged_bytes = |root: &std::path::Path| -> u64 {
            temp_files(root)
                .iter()
                .filter_map(|p| std::fs::metadata(p).ok())
                .map(|m| m.len())
                .sum()
        };
        let staged = async {
            while staged_bytes(&root) < 16 << 16 {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            // Let everything before the stall be staged.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        };
        tokio::select! {
            r = store.put_artifact_reader(reader, &opts) => panic!("the upload ended: {:?}", r.map(|_| ())),
            _ = staged => {}
        }
        // The upload is dropped; its reader may end now.
        drop(hold);
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let left = temp_files(dir.path());
        assert!(
            left.is_empty(),
            "{} staged temp files left in .tmp: {:?}",
            left.len(),
            &left[..left.len().min(3)]
        );
    }

    /// A block an artifact holds three times is written once: no chunk is reported
    /// transferred twice, and each repeat says it was not transferred. Before, every repeat
    /// was staged again and its link failed at the commit (its count was then taken back).
    #[tokio::test]
    async fn a_chunk_repeated_in_one_artifact_is_written_once() {
        use crate::artifact::PutArtifactOptions;
        use crate::progress::ProgressEvent;
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let x = random_bytes(3, 2 << 20);
        let a = [x.clone(), x.clone(), x].concat();
        let seen: Arc<Mutex<Vec<(crate::ChunkDigest, bool)>>> = Arc::default();
        let keep = seen.clone();
        let opts = PutArtifactOptions {
            progress: Some(Arc::new(move |e: &ProgressEvent| {
                if let ProgressEvent::Chunk {
                    digest,
                    transferred,
                    ..
                } = e
                {
                    keep.lock().unwrap().push((*digest, *transferred));
                }
            })),
            ..Default::default()
        };
        let (table, stats) = s
            .put_artifact_reader(std::io::Cursor::new(a), &opts)
            .await
            .unwrap();
        let seen = seen.lock().unwrap();
        let mut written = std::collections::BTreeMap::<_, u32>::new();
        for (d, t) in seen.iter() {
            *written.entry(*d).or_default() += u32::from(*t);
        }
        assert!(written.values().all(|n| *n == 1), "{written:?}");
        let repeats = seen.len() - written.len();
        assert!(
            repeats > 0,
            "the block's chunks repeat: {} chunks",
            seen.len()
        );
        assert_eq!(stats.chunks_transferred, written.len() as u64);
        assert_eq!(table.entries.len(), seen.len());
    }

    /// Two handles on one local store (two processes' imports) put overlapping files at once,
    /// one of them holding one block three times: each import's table reads back, `verify
    /// --deep` finds nothing, nothing is left in `.tmp`, and every distinct chunk is counted
    /// as transferred once per import that wrote it (never twice for a chunk a file repeats).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_overlapping_imports_verify_clean_and_count_each_chunk_once() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::ImageManifest;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().to_str().unwrap();
        let (s1, s2) = (Store::open(p).await.unwrap(), Store::open(p).await.unwrap());
        let (x, y) = (random_bytes(1, 2 << 20), random_bytes(2, 2 << 20));
        let a = [x.clone(), y.clone()].concat();
        let b = [y.clone(), x.clone(), y.clone()].concat();
        let opts = PutArtifactOptions::default();
        let (ra, rb) = tokio::join!(
            s1.put_artifact_reader(std::io::Cursor::new(a.clone()), &opts),
            s2.put_artifact_reader(std::io::Cursor::new(b.clone()), &opts),
        );
        let ((ta, sa), (tb, sb)) = (ra.unwrap(), rb.unwrap());
        for (store, table, data, stats, tag) in
            [(&s1, &ta, &a, &sa, "a:v1"), (&s2, &tb, &b, &sb, "b:v1")]
        {
            let distinct: std::collections::BTreeSet<_> =
                table.entries.iter().filter_map(|e| e.digest).collect();
            assert!(
                stats.chunks_transferred <= distinct.len() as u64,
                "{tag}: {} chunks counted as transferred, {} distinct",
                stats.chunks_transferred,
                distinct.len()
            );
            let out = dir.path().join(format!("{tag}.out"));
            store.materialize(table, &out, None).await.unwrap();
            assert!(std::fs::read(&out).unwrap() == *data, "{tag}: reads back");
            std::fs::remove_file(&out).unwrap();
            let raw = store
                .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
                .await
                .unwrap();
            store
                .set_tag(&tag.parse().unwrap(), None, raw.digest)
                .await
                .unwrap();
        }
        // Chunks in the store (loose or packed).
        let on_disk = s1.backend.list("chunks/").await.unwrap().len() as u64;
        assert!(
            sa.chunks_transferred + sb.chunks_transferred >= on_disk,
            "{on_disk} chunks, {} + {} counted as written",
            sa.chunks_transferred,
            sb.chunks_transferred
        );
        let r = s1
            .verify(true, &crate::gc::GcOptions::default())
            .await
            .unwrap();
        assert!(r.findings.is_empty(), "{:?}", r.findings);
        assert!(temp_files(dir.path()).is_empty());
    }

    /// A reader that gives `data`, then fails.
    struct Failing(std::io::Cursor<Vec<u8>>);

    impl std::io::Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.0.read(buf)? {
                0 => Err(std::io::Error::other("the source broke")),
                n => Ok(n),
            }
        }
    }

    /// An import whose input fails half-way returns the error and leaves nothing: no staged
    /// chunk in `.tmp`, no chunk under its key, and a verify and a GC that find nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_import_leaves_no_garbage() {
        use crate::artifact::PutArtifactOptions;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let r = store
            .put_artifact_reader(
                Failing(std::io::Cursor::new(random_bytes(9, 3 << 20))),
                &PutArtifactOptions::default(),
            )
            .await;
        assert!(r.is_err());
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(
            temp_files(dir.path()).is_empty(),
            "{:?}",
            temp_files(dir.path())
        );
        let chunks = store.backend.list("chunks/").await.unwrap().len();
        assert_eq!(chunks, 0, "chunks of a failed import were published");
        let packs = std::fs::read_dir(dir.path().join(".packs"))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(packs, 0, "a failed import committed a pack");
        let v = store
            .verify(true, &crate::gc::GcOptions::default())
            .await
            .unwrap();
        assert!(v.findings.is_empty(), "{:?}", v.findings);
    }
}
