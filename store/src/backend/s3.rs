//! The S3 backend, through the `object_store` crate (also speaks to any S3-compatible server:
//! moto in tests, MinIO, R2...).
//!
//! Configuration comes from the environment as `object_store`'s `AmazonS3Builder::from_env`
//! reads it (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_ALLOW_HTTP` for a plain-HTTP test server...), then [`S3Options`] overrides (CLI flags).
//!
//! Primitives map onto S3 conditional requests (S3 API reference, PutObject, "Conditional
//! requests"): put-if-absent is `PutMode::Create` (`If-None-Match: *`), compare-and-swap is
//! `PutMode::Update` (`If-Match: <etag>`), or `PutMode::Create` when absence is expected.
//! Files above [`MULTIPART_THRESHOLD`] go up as multipart uploads in [`MULTIPART_PART_SIZE`]
//! parts. `object_store`'s own retry loop is switched off: [`super::retry::Retrying`] is the one
//! retry layer, and errors are classified here (5xx, 408, 429 and connection/timeout failures
//! are `Transient`).
//!
//! ## Packs (issue 33): an upload's chunks in a few objects
//! Before, each 64 KiB chunk was an object of its own: pushing an image was thousands of
//! PUTs, and moto (the CI's S3) serves about 400 requests a second. Now the chunks an upload
//! (or a copy into this store) stages go up in *packs*, in the local backend's format
//! ([`super::pack`]: one encoder and decoder for both):
//! - `packs/<name>.pack`: the chunks' stored bytes (each one zstd frame, exactly what a loose
//!   chunk object holds), concatenated. `<name>` is `<host>-<pid>-<n>-<nanos>`, unique per
//!   writer.
//! - `packs/<name>.idx`: the `KILNPIDX` index (entries sorted by digest: digest, offset,
//!   stored length; then a sha256 of it all), immutable.
//! - `packs/<name>.dead/<hex>`: one empty object per deleted chunk of the pack (a key
//!   segment may not start with `.`, [`validate_key`], hence `.dead/` inside the segment).
//!
//! Keys in manifests stay `chunks/sha256/<hex>`: where a chunk lives is the store's business
//! (a manifest's digest must not depend on the store holding it). Loose chunk objects, from
//! stores written before packs, or GC's put-backs, are read as before: **no migration**.
//!
//! **Writing.** [`Backend::stage_batch`] gives an upload an `S3Batch`: staged chunks are
//! appended to an in-memory pack; at [`super::s3_pack::PACK_TARGET`] bytes (32 MiB, or
//! [`S3Options::pack_target`]; see there why) the stager that filled it sends it: one PUT of
//! the pack, and only once that returned, a put-if-absent of its index. The other stagers go
//! on filling the next pack meanwhile, so memory is bounded by the pack being filled plus at
//! most one pack in flight per stager. [`Backend::commit_staged`] (after
//! [`Backend::flush_staged`], which the retry wrapper retries: sending is idempotent, a
//! pack taken for sending is handed back to the batch if its send stops short, even by a
//! dropped future) closes the last pack and sends it the same way; before that it lists
//! `packs/` afresh and leaves out of the last pack every chunk another writer published
//! meanwhile (their outcome is `AlreadyExists`, as locally; one process's commits take turns
//! there, so two uploads in one process never publish a chunk twice). An index therefore
//! appears only after its whole pack: a reader that sees an index can read every entry. A
//! crash leaves at most a pack without an index: invisible to every read, listing, verify
//! and GC; a failed upload's discard deletes the packs it sent whose index PUT was never
//! begun, and leaves those whose index PUT failed (the index may be stored all the same, an
//! answer lost: the pack is then published, garbage for GC, and deleting it would leave an
//! index naming bytes gone, under chunks another writer may have found present), and
//! [`Backend::compact`] deletes any pack without an index older than
//! [`super::s3_pack::ORPHAN_AGE`] (24 h), which no writer still uploading can own: a writer never
//! puts an index more than [`super::s3_pack::INDEX_DEADLINE`] (12 h) after its pack (it fails its
//! upload instead). A chunk found live in a pack when staged is not written
//! ([`Staged::Done`]); a loose object is not asked for there (the writer's look-up just did,
//! [`crate::Store::exist`]), so a duplicate is possible, and harmless.
//!
//! **The view.** Each backend keeps a map digest → (pack, offset, stored length, index
//! last-modified), built from one LIST of `packs/` (which also gives every dead marker) plus
//! one GET of each index not loaded yet (indexes are immutable: each is loaded once; one that
//! fails its checks is refused, see below). One listing runs at a time, and callers waiting
//! for it share the next one, so a burst of look-ups costs at most two listings. How fresh
//! it must be depends on the question:
//! - *A hit is never trusted for a writer's question.* [`Backend::head`],
//!   [`Backend::put_if_absent`], [`Backend::stage_if_absent`] and
//!   [`Backend::packed_present`] (what [`crate::Store::exist`] asks first: one listing per
//!   pack for all of an upload's look-ups in it) check the pack afresh with a LIST of
//!   `packs/<name>.`: its dead markers, then its index, in key order. Live means: index
//!   still there and no marker for the chunk, as of a request made after the call began.
//! - *A miss* is looked up again: a read ([`Backend::get`], [`Backend::get_range`]) first
//!   tries the loose object, and only when that is absent lists `packs/` again (so a store
//!   written before packs costs no request more); [`Backend::head`] lists again on a loose
//!   miss; a write look-up lists again at most every second
//!   ([`super::s3_pack::WRITE_RELIST`]: a stale miss costs a duplicate, never safety).
//! - A read of a packed chunk is one ranged GET of its pack, with a HEAD of its dead marker
//!   at the same time (so a deleted chunk reads as absent, then its loose copy if any).
//!
//! **Deleting.** [`Backend::delete`] of a chunk deletes a loose object and writes a dead
//! marker in every pack that holds the chunk live (on a view listed after the call began);
//! a pack that would then serve no chunk at all is retired whole instead, as compaction
//! retires it (below): a few requests a pack, not one a chunk, when GC condemns a whole
//! snapshot.
//! [`Backend::rename`] of a packed chunk (GC's condemn step) PUTs its stored bytes at the
//! destination as a loose object, *then* writes the dead markers: an interruption leaves both
//! keys, never neither, as the trait promises. [`Backend::delete_many`] and
//! [`Backend::rename_many`] (GC's deletes of fossils and its condemn step) do the same for
//! many keys with one listing of `packs/` for all of them (made after the call began), the
//! packed sources read by spans as [`Backend::get_many`] reads, and the loose objects deleted
//! with DeleteObjects ([`DELETE_OBJECTS_MAX`] keys a request); a rename of many writes every
//! destination before any dead marker, and deletes a source only after its markers, so each
//! key keeps the order of a rename alone. GC's put-back writes a loose
//! `chunks/sha256/<hex>`. [`Backend::list`] over `chunks/` yields the loose objects and the
//! live packed entries (size: stored length; modified: the index's last-modified, which
//! GC's grace period reads), a chunk both loose and packed once, with the later time.
//!
//! **Why GC stays safe** ([`crate::gc`]'s argument, which rests on read-after-write
//! consistency and on writers leasing before looking up). Packs change only *how* "X is
//! present under its key" is decided: X is a live entry (index present, no marker) or a
//! loose object. Condemning X makes it absent under its key by writes that have returned
//! before phase 2 reads the leases: the copy to `fossil/X`, then the marker. Every positive
//! answer a writer gets comes from requests made after its look-up began, so after its
//! lease: a LIST of the pack's markers and index (strongly consistent), never the cached
//! view. So a writer that found X present did so either before the marker was written (then
//! its lease was written earlier still, phase 2 sees it and puts X back) or not at all (it
//! wrote X afresh). A retired pack is no exception: its index is deleted before its pack
//! and markers, and the fresh check lists the markers before the index, so a check that saw
//! no marker and the index saw the pack before any of its markers went. A stale *miss* only
//! makes a writer write X again (a new pack or loose object, which no GC phase deletes, as
//! it deletes only fossils). Verify counts the fossil as presence, as before.
//!
//! **Reading many** ([`Backend::get_many`], used by pulls, exports and a clone's
//! prefetch): the requested chunks the view has packed are grouped by pack; each pack's dead
//! markers are listed once (fresh, as every read), and its live entries, in pack order, are
//! read by ranged GETs of spans of nearby entries ([`GET_MANY_GAP`], [`GET_MANY_SPAN`]).
//! Everything else (loose objects, entries dead or moved) is read one by one as
//! [`Backend::get_range`] would.
//!
//! **Packing together** ([`Backend::pack_together`], issue 35): a snapshot's prefetch list,
//! the chunks a clone's start fetches first, is recorded after every chunk of the snapshot
//! is stored, so its chunks lie scattered over the snapshot's and its image's 32 MiB packs:
//! a cold Debian clone's prefetch was 13 ranged GETs of packs and 11 listings, about 300 ms,
//! and the test server's ranged GET costs in proportion to the object's size (2 MiB of a
//! 33.6 MB pack: 34 ms; of a 10.8 MB pack: 9.8 ms). `kiln snapshot` then writes the listed
//! chunks' stored bytes again, in the order the chunk server fetches them, into new packs
//! of their own (a second copy of each; `packs/<name>.pack` like any other, published the
//! same way), which a batch of the prefetch reads as one span of one small pack. Measured
//! (issue 35; dev build, the Debian fixture with 512 MiB pushed to the local S3 server: 394
//! chunks listed, a 7.1 MB pack; six cold starts each way, alternating, its index hidden
//! for the other way): the prefetch took 276 ms (median) against 381 ms, the clone
//! answered in 330 ms against 432 ms; warm starts answered in 139 ms.
//! - *Which copy serves*: of the packs holding a chunk live, the smaller, then the lower
//!   name ([`super::s3_pack::PackMeta::rank`]), a rule of the packs alone, so every process
//!   reads the same copy. The prefetch pack (the busybox fixture's list in `vm_lazy`: 305
//!   chunks, 4.9 MB stored) is smaller than the 32 MiB packs, so it serves what they hold
//!   (there, read back in fetch order: one listing and one ranged GET). A listed chunk that a
//!   still smaller pack holds (an upload's last pack: the few disk chunks a snapshot's boot
//!   changed, an image's last pack; another snapshot's smaller prefetch pack) is served from
//!   that one, and the batches holding such chunks read that pack too: a listing and a
//!   ranged GET more, of a small object, which by the cost above is a cheap one. In both
//!   fixtures the prefetch pack served every listed chunk (busybox: the push's packs were
//!   larger; Debian: 7.1 MB against the push's last pack of 10.7 MB). The rule is kept: it
//!   picks the cheaper object to read, and a rule preferring prefetch packs would have to
//!   tell them apart by their names and would still have to choose between two snapshots'
//!   prefetch packs sharing chunks (snapshots of one image share disk chunks), which the
//!   smaller wins as now.
//! - *GC*: a chunk is present while any copy is live. A delete or a condemn marks it dead
//!   in every pack that holds it live on a listing made after the call began
//!   ([`super::s3_pack::View::holders`]), so both copies die together. A copy published
//!   after that listing holds the chunk live again, which is the argument's "written
//!   afresh" case (presence, never absence): it is garbage if nothing references it, taken
//!   by a later GC once its grace has passed (its time is its index's). The copy relies on
//!   no look-up (it reads the bytes and writes them; a chunk already condemned reads as
//!   absent and fails the call), and no writer relies on it rather than on the chunk's
//!   presence under its key, checked afresh as always; so it needs no lease.
//! - *Compaction and verify*: a copy that does not serve is dead bytes
//!   ([`super::s3_pack::View::serving_bytes`]): counted by verify
//!   ([`LayoutReport::dead_bytes`]), and a pack left with nothing to serve (every entry dead
//!   or served by a prefetch pack) is retired by the next compaction. Until then the listed
//!   chunks' stored bytes are held twice (partly dead packs are not rewritten yet).
//!
//! **Damage.** An index that fails its checks (not an index, bad checksum, entries out of
//! order, an entry past its pack's size, its pack missing) is refused: logged, reported by
//! [`Backend::layout_report`] (so `kiln store verify`: `corruptStoreFile`), and only its own
//! chunks are not served. The report also counts packs, their bytes and their dead bytes.
//!
//! **Compaction** ([`Backend::compact`], after GC's deletes, under its lock) retires every
//! pack with no chunk left to serve: its index deleted first (the pack is invisible from
//! then on), then the pack, then its markers (DeleteObjects). It reports, as its own, the
//! packs the deletes since the last compaction retired early. Packs partly dead are not rewritten yet: their
//! dead bytes stay, counted by verify.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path as OsPath;
use object_store::{
    ClientOptions, GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion, WriteMultipart,
};
use tokio::io::AsyncReadExt;

use super::pack::{IdxEntry, add_packed, chunk_digest, decode_index, encode_index, lists_chunks};
use super::s3_pack::{
    INDEX_DEADLINE, Listing, Loc, ORPHAN_AGE, PACK_PREFIX, PACK_TARGET, PackMeta, PackObject,
    S3Batch, Sealed, View, WRITE_RELIST, dead_key, dead_prefix, idx_key, pack_key, pack_prefix,
    parse_key,
};
use super::{
    Backend, BackendError, CompactReport, LIST_PAGE_MAX, LayoutReport, ListPage, ObjectInfo,
    PackedTogether, PutOutcome, StageBatch, Staged, StagedPut, Version, WireRequests, validate_key,
};
use crate::digest::{Hasher, Sha256Hash};

mod errors;
mod packed;

#[cfg(test)]
mod fault_tests;
#[cfg(test)]
mod together_tests;

use errors::{classify, missing_key, range_not_satisfiable};

use packed::packed_info;
pub use packed::{GET_MANY_GAP, GET_MANY_SPAN};

/// Keys one DeleteObjects request deletes at most (1,000: S3 API reference, DeleteObjects).
pub const DELETE_OBJECTS_MAX: usize = 1000;

/// Files larger than this (bytes, 16 MiB) are uploaded with multipart upload.
pub const MULTIPART_THRESHOLD: u64 = 16 << 20;
/// Multipart part size in bytes (8 MiB; S3's minimum part size is 5 MiB).
pub const MULTIPART_PART_SIZE: usize = 8 << 20;
/// Parts of one multipart upload in flight at once.
pub const MULTIPART_CONCURRENCY: usize = 4;

/// Overrides on top of the environment. `None` keeps what the environment says.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    /// Endpoint URL, e.g. `http://127.0.0.1:9000`.
    pub endpoint: Option<String>,
    /// Region, e.g. `us-east-1`.
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Allow plain HTTP endpoints.
    pub allow_http: Option<bool>,
    /// Per-request timeout (default 30 s, `object_store`'s default).
    pub request_timeout: Option<Duration>,
    /// Connect timeout (default 5 s).
    pub connect_timeout: Option<Duration>,
    /// Bytes at which an upload's pack is closed and sent (default
    /// [`super::s3_pack::PACK_TARGET`], 32 MiB). Smaller keeps more of an upload that fails
    /// part way on a flaky link (what was sent is kept per pack); larger makes fewer requests.
    pub pack_target: Option<u64>,
}

impl S3Options {
    /// No overrides: everything from the environment (read when the store is opened).
    pub fn from_env() -> Self {
        Self::default()
    }
}

/// An S3 bucket and key prefix.
#[derive(Debug)]
pub struct S3Backend {
    store: Arc<dyn ObjectStore>,
    /// The same client, for page-by-page listing (`Backend::list_page`).
    lister: Arc<AmazonS3>,
    bucket: String,
    prefix: String,
    url: String,
    /// The view of the committed packs ([`super::s3_pack`]).
    packs: PackState,
    /// [`S3Options::pack_target`].
    pack_target: u64,
    /// Every HTTP request the client sent ([`Backend::wire_requests`]).
    wire: Arc<WireCounts>,
}

/// The HTTP requests an [`S3Backend`]'s client sent, by kind ([`WireRequests`]).
#[derive(Debug, Default)]
struct WireCounts {
    heads: std::sync::atomic::AtomicU64,
    gets: std::sync::atomic::AtomicU64,
    lists: std::sync::atomic::AtomicU64,
    puts: std::sync::atomic::AtomicU64,
    deletes: std::sync::atomic::AtomicU64,
    other: std::sync::atomic::AtomicU64,
}

impl WireCounts {
    /// Counts one request of `method` whose URL query is `query` (a ListObjectsV2 is a GET
    /// with `list-type=2` in it).
    fn count(&self, method: &reqwest::Method, query: Option<&str>) {
        use reqwest::Method;
        let c = match *method {
            Method::HEAD => &self.heads,
            Method::GET if query.is_some_and(|q| q.contains("list-type=2")) => &self.lists,
            Method::GET => &self.gets,
            Method::PUT => &self.puts,
            Method::DELETE => &self.deletes,
            _ => &self.other,
        };
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn snapshot(&self) -> WireRequests {
        let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        WireRequests {
            heads: n(&self.heads),
            gets: n(&self.gets),
            lists: n(&self.lists),
            puts: n(&self.puts),
            deletes: n(&self.deletes),
            other: n(&self.other),
        }
    }
}

/// `object_store`'s own reqwest client, each request counted in a [`WireCounts`] as it is
/// sent (and, in a test, passed by its [`Tamper`]).
#[derive(Debug)]
struct CountingConnector(Arc<WireCounts>, Option<TamperHook>);

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(Counting {
            inner: ReqwestConnector::default().connect(options)?,
            counts: self.0.clone(),
            tamper: self.1.clone(),
        }))
    }
}

/// A fault injector's hand in an [`S3Backend`]'s HTTP exchanges, for tests only
/// ([`S3Backend::open_tampered`]; none in a store opened by [`S3Backend::open`]): it sees
/// each request before it is sent and says what the client gets back. It stands in for a
/// server, or a network, that answers wrongly, which the test S3 server cannot be made to
/// do on demand.
pub(crate) type Tamper = dyn Fn(&HttpRequest) -> Tampered + Send + Sync;

/// [`Tamper`], shared, with a `Debug` for the client that holds it.
#[derive(Clone)]
struct TamperHook(Arc<Tamper>);

impl fmt::Debug for TamperHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TamperHook")
    }
}

/// What a [`Tamper`] does to one request.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Tampered {
    /// Sent, and answered as the server answers.
    Pass,
    /// Sent (the server acts on it), and answered with this status and body instead of the
    /// server's answer: a reply garbled on its way back.
    Garbled {
        /// The HTTP status the client sees.
        status: u16,
        /// The body the client sees.
        body: String,
    },
    /// Not sent (the server never sees it), answered with this status and body: with every
    /// request from some point on, a process killed there (what it sent before is done).
    Refused {
        /// The HTTP status the client sees.
        status: u16,
        /// The body the client sees.
        body: String,
    },
}

/// An HTTP client that counts each request ([`CountingConnector`]).
#[derive(Debug)]
struct Counting {
    inner: HttpClient,
    counts: Arc<WireCounts>,
    tamper: Option<TamperHook>,
}

#[async_trait::async_trait]
impl HttpService for Counting {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        self.counts.count(req.method(), req.uri().query());
        let Some(t) = &self.tamper else {
            return self.inner.execute(req).await;
        };
        let (status, body) = match (t.0)(&req) {
            Tampered::Pass => return self.inner.execute(req).await,
            Tampered::Garbled { status, body } => {
                self.inner.execute(req).await?;
                (status, body)
            }
            Tampered::Refused { status, body } => (status, body),
        };
        let mut r = HttpResponse::new(body.into());
        *r.status_mut() = reqwest::StatusCode::from_u16(status)
            .unwrap_or(reqwest::StatusCode::INTERNAL_SERVER_ERROR);
        Ok(r)
    }
}

/// The process's view of the packs, and the one listing of `packs/` at a time.
#[derive(Debug, Default)]
struct PackState {
    view: std::sync::RwLock<View>,
    relist: tokio::sync::Mutex<()>,
    /// Packs a delete retired whole since the last [`Backend::compact`].
    retired_early: super::RetiredEarly,
}

impl S3Backend {
    /// Builds the client (no request is made). `prefix` has no leading or trailing `/`.
    pub fn open(bucket: &str, prefix: &str, opts: &S3Options) -> Result<Self, BackendError> {
        Self::open_via(bucket, prefix, opts, None)
    }

    /// [`S3Backend::open`] with a fault injector in its HTTP client ([`Tamper`]; tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn open_tampered(
        bucket: &str,
        prefix: &str,
        opts: &S3Options,
        tamper: Arc<Tamper>,
    ) -> Result<Self, BackendError> {
        Self::open_via(bucket, prefix, opts, Some(TamperHook(tamper)))
    }

    fn open_via(
        bucket: &str,
        prefix: &str,
        opts: &S3Options,
        tamper: Option<TamperHook>,
    ) -> Result<Self, BackendError> {
        let url = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        // reqwest is built without a TLS crypto provider of its own (the workspace's
        // "rustls-no-provider"): make ring the process's provider before a client exists, as the
        // registry client does. Err means one is installed already, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
        if let Some(e) = &opts.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(r) = &opts.region {
            b = b.with_region(r);
        }
        if let Some(k) = &opts.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(k) = &opts.secret_access_key {
            b = b.with_secret_access_key(k);
        }
        if let Some(a) = opts.allow_http {
            b = b.with_allow_http(a);
        }
        let mut client = ClientOptions::new()
            .with_timeout(opts.request_timeout.unwrap_or(Duration::from_secs(30)))
            .with_connect_timeout(opts.connect_timeout.unwrap_or(Duration::from_secs(5)));
        if let Some(a) = opts.allow_http {
            client = client.with_allow_http(a);
        } else if std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v == "true" || v == "1") {
            client = client.with_allow_http(true);
        }
        let retry = RetryConfig {
            max_retries: 0,
            ..RetryConfig::default()
        };
        let wire = Arc::new(WireCounts::default());
        let store = b
            .with_http_connector(CountingConnector(wire.clone(), tamper))
            .with_client_options(client)
            .with_retry(retry)
            .build()
            .map_err(|e| BackendError::Url {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        let store = Arc::new(store);
        Ok(Self {
            store: store.clone(),
            lister: store,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            url,
            packs: PackState::default(),
            pack_target: opts.pack_target.unwrap_or(PACK_TARGET).max(1),
            wire,
        })
    }

    fn path(&self, key: &str) -> Result<OsPath, BackendError> {
        validate_key(key)?;
        let full = if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{}", self.prefix, key)
        };
        OsPath::parse(full).map_err(|_| BackendError::InvalidKey(key.to_string()))
    }

    fn key_of(&self, loc: &OsPath) -> Option<String> {
        let s = loc.as_ref();
        if self.prefix.is_empty() {
            Some(s.to_string())
        } else {
            s.strip_prefix(&self.prefix)?
                .strip_prefix('/')
                .map(str::to_string)
        }
    }

    fn err(&self, op: &'static str, key: &str, e: object_store::Error) -> BackendError {
        classify(&self.url, &self.bucket, op, key, e)
    }

    fn info(&self, meta: ObjectMeta) -> Option<ObjectInfo> {
        let key = self.key_of(&meta.location)?;
        Some(ObjectInfo {
            key,
            size: meta.size,
            modified: to_system_time(
                meta.last_modified.timestamp(),
                meta.last_modified.timestamp_subsec_nanos(),
            ),
            version: meta.e_tag.map(Version),
        })
    }
}

/// `f` (a delete by object_store), or, when it panics, why: object_store makes every delete
/// a DeleteObjects request (S3 API reference, DeleteObjects) and panics on an answer that
/// names a key the request did not ask for (0.14's reader looks each named key up among those
/// asked and unwraps). Such an answer is garbled, so nothing is known of what the server did:
/// the caller fails its keys as transient (a lost reply; deleting again is harmless), where
/// the panic would have taken the process down (GC in its condemn step, say).
async fn unpanicked<T>(f: impl std::future::Future<Output = T>) -> Result<T, String> {
    use futures::FutureExt;
    std::panic::AssertUnwindSafe(f)
        .catch_unwind()
        .await
        .map_err(|p| {
            let what = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            format!("the DeleteObjects answer could not be read (object_store: {what})")
        })
}

fn to_system_time(secs: i64, nanos: u32) -> SystemTime {
    if secs < 0 {
        return UNIX_EPOCH;
    }
    UNIX_EPOCH + Duration::new(secs as u64, nanos)
}

/// The primitives on plain objects, packs not consulted (what the trait methods were before
/// packs, and what they still are for every key the packs do not take).
impl S3Backend {
    async fn get_raw(&self, key: &str) -> Result<Bytes, BackendError> {
        let p = self.path(key)?;
        let r = self
            .store
            .get(&p)
            .await
            .map_err(|e| self.err("get", key, e))?;
        r.bytes().await.map_err(|e| self.err("get", key, e))
    }

    async fn get_range_raw(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError> {
        let p = self.path(key)?;
        if range.start >= range.end {
            return Ok(Bytes::new());
        }
        let opts = GetOptions {
            range: Some(range.into()),
            ..GetOptions::default()
        };
        match self.store.get_opts(&p, opts).await {
            Ok(r) => r.bytes().await.map_err(|e| self.err("get", key, e)),
            // A range wholly past the end reads as empty, as on the local backend.
            Err(e) if range_not_satisfiable(&e) => Ok(Bytes::new()),
            Err(e) => Err(self.err("get", key, e)),
        }
    }

    async fn head_raw(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        let p = self.path(key)?;
        match self.store.head(&p).await {
            Ok(m) => Ok(self.info(m)),
            Err(e) if missing_key(&e) => Ok(None),
            Err(e) => Err(self.err("head", key, e)),
        }
    }

    async fn put_if_absent_raw(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let p = self.path(key)?;
        if let Some(expected) = expect_sha256 {
            let actual = Sha256Hash::of(&data);
            if actual != expected {
                return Err(BackendError::DigestMismatch {
                    store: self.url.clone(),
                    key: key.to_string(),
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        let opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self.store.put_opts(&p, PutPayload::from(data), opts).await {
            Ok(_) => Ok(PutOutcome::Created),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(PutOutcome::AlreadyExists),
            Err(e) => Err(self.err("put", key, e)),
        }
    }

    async fn put_file_if_absent_raw(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let io = |e: std::io::Error| BackendError::Other {
            store: self.url.clone(),
            op: "put",
            key: key.to_string(),
            message: format!("reading {}: {e}", path.display()),
        };
        let size = tokio::fs::metadata(path).await.map_err(io)?.len();
        if size <= MULTIPART_THRESHOLD {
            let data = tokio::fs::read(path).await.map_err(io)?;
            return self
                .put_if_absent_raw(key, Bytes::from(data), expect_sha256)
                .await;
        }
        if self.head_raw(key).await?.is_some() {
            return Ok(PutOutcome::AlreadyExists);
        }
        // Hash first so that a mismatch never uploads anything.
        if let Some(expected) = expect_sha256 {
            let mut f = tokio::fs::File::open(path).await.map_err(io)?;
            let mut h = Hasher::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).await.map_err(io)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
            let actual = h.finish();
            if actual != expected {
                return Err(BackendError::DigestMismatch {
                    store: self.url.clone(),
                    key: key.to_string(),
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        let p = self.path(key)?;
        let upload = self
            .store
            .put_multipart(&p)
            .await
            .map_err(|e| self.err("put", key, e))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, MULTIPART_PART_SIZE);
        let mut f = tokio::fs::File::open(path).await.map_err(io)?;
        let mut buf = vec![0u8; MULTIPART_PART_SIZE];
        loop {
            let n = match read_full(&mut f, &mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(io(e));
                }
            };
            if n == 0 {
                break;
            }
            if let Err(e) = w.wait_for_capacity(MULTIPART_CONCURRENCY).await {
                let _ = w.abort().await;
                return Err(self.err("put", key, e));
            }
            w.write(&buf[..n]);
        }
        w.finish().await.map_err(|e| self.err("put", key, e))?;
        Ok(PutOutcome::Created)
    }

    async fn put_raw(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        let p = self.path(key)?;
        let r = self
            .store
            .put(&p, PutPayload::from(data))
            .await
            .map_err(|e| self.err("put", key, e))?;
        Ok(Version(r.e_tag.unwrap_or_default()))
    }

    async fn list_raw(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let list_path = if dir.is_empty() {
            if self.prefix.is_empty() {
                None
            } else {
                Some(
                    OsPath::parse(&self.prefix)
                        .map_err(|_| BackendError::InvalidKey(prefix.into()))?,
                )
            }
        } else {
            Some(self.path(dir)?)
        };
        let metas: Vec<ObjectMeta> = self
            .store
            .list(list_path.as_ref())
            .try_collect()
            .await
            .map_err(|e| self.err("list", prefix, e))?;
        Ok(metas
            .into_iter()
            .filter_map(|m| self.info(m))
            .filter(|o| o.key.starts_with(prefix))
            .collect())
    }

    async fn delete_raw(&self, key: &str) -> Result<(), BackendError> {
        let p = self.path(key)?;
        let done =
            unpanicked(self.store.delete(&p))
                .await
                .map_err(|message| BackendError::Transient {
                    store: self.url.clone(),
                    key: key.to_string(),
                    message,
                })?;
        match done {
            Ok(()) => Ok(()),
            Err(e) if missing_key(&e) => Ok(()),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }

    /// DeleteObjects of `keys` (up to [`DELETE_OBJECTS_MAX`] per request), each key's
    /// result in the order given; absent is not an error (S3 answers "Deleted"). A request
    /// that fails fails each of its keys as it was classified (a transient failure is
    /// retried key by key by the retry wrapper); a key the answer names as not deleted fails
    /// as S3's code for it says.
    async fn delete_raw_many(&self, keys: &[String]) -> Vec<Result<(), BackendError>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(DELETE_OBJECTS_MAX) {
            let paths: Vec<Result<OsPath, BackendError>> =
                part.iter().map(|k| self.path(k)).collect();
            let valid: Vec<OsPath> = paths
                .iter()
                .filter_map(|p| p.as_ref().ok().cloned())
                .collect();
            let answers = unpanicked(
                self.store
                    .delete_stream(futures::stream::iter(valid.clone().into_iter().map(Ok)).boxed())
                    .collect::<Vec<object_store::Result<OsPath>>>(),
            )
            .await;
            // One answer per key, in order; anything else is the whole request failing.
            let (whole, mut answers) = match answers {
                Err(why) => (
                    Some(BackendError::Transient {
                        store: self.url.clone(),
                        key: part[0].clone(),
                        message: why,
                    }),
                    Vec::new().into_iter(),
                ),
                Ok(answers) if answers.len() == valid.len() => (None, answers.into_iter()),
                Ok(answers) => {
                    let e = match answers.into_iter().find_map(Result::err) {
                        Some(e) => self.err("delete", &part[0], e),
                        None => BackendError::Transient {
                            store: self.url.clone(),
                            key: part[0].clone(),
                            message: "DeleteObjects answered for fewer keys than asked".into(),
                        },
                    };
                    (Some(e), Vec::new().into_iter())
                }
            };
            for (k, p) in part.iter().zip(paths) {
                out.push(match (p, &whole) {
                    (Err(e), _) => Err(e),
                    (Ok(_), Some(e)) => Err(self.again(e, "delete", k)),
                    (Ok(_), None) => match answers.next() {
                        Some(Ok(_)) => Ok(()),
                        Some(Err(e)) if missing_key(&e) => Ok(()),
                        Some(Err(e)) => Err(self.err("delete", k, e)),
                        None => Err(self.again(
                            &BackendError::Transient {
                                store: self.url.clone(),
                                key: k.clone(),
                                message: "no answer".into(),
                            },
                            "delete",
                            k,
                        )),
                    },
                });
            }
        }
        out
    }

    /// `e`, a failure of a call on many keys, as the failure of `key` (op `op`): the same
    /// kind (transient stays transient, so the retry wrapper retries that key alone), its
    /// text.
    pub(super) fn again(&self, e: &BackendError, op: &'static str, key: &str) -> BackendError {
        match e {
            BackendError::Transient { message, .. } => BackendError::Transient {
                store: self.url.clone(),
                key: key.to_string(),
                message: message.clone(),
            },
            BackendError::NotFound { .. } => BackendError::NotFound {
                store: self.url.clone(),
                key: key.to_string(),
            },
            other => BackendError::Other {
                store: self.url.clone(),
                op,
                key: key.to_string(),
                message: other.to_string(),
            },
        }
    }

    /// CopyObject of `from` to `to` (server side).
    async fn copy_raw(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let (src, dest) = (self.path(from)?, self.path(to)?);
        self.store
            .copy(&src, &dest)
            .await
            .map_err(|e| self.err("rename", from, e))
    }

    async fn rename_raw(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let (src, dest) = (self.path(from)?, self.path(to)?);
        // CopyObject, then DeleteObject (object_store's `rename` would do the same, but this
        // keeps each step's error naming its key).
        self.store
            .copy(&src, &dest)
            .await
            .map_err(|e| self.err("rename", from, e))?;
        self.delete_raw(from).await
    }
}

#[async_trait::async_trait]
impl Backend for S3Backend {
    fn url(&self) -> &str {
        &self.url
    }

    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError> {
        let p = self.path(key)?;
        let r = self
            .store
            .get(&p)
            .await
            .map_err(|e| self.err("get", key, e))?;
        if r.meta.size > super::MAX_MUTABLE_LEN {
            return Err(super::too_large(&self.url, key, r.meta.size));
        }
        let etag = r.meta.e_tag.clone();
        let bytes = r.bytes().await.map_err(|e| self.err("get", key, e))?;
        let etag = etag.ok_or_else(|| BackendError::Other {
            store: self.url.clone(),
            op: "get",
            key: key.to_string(),
            message: "server returned no ETag".into(),
        })?;
        Ok((bytes, Version(etag)))
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError> {
        let p = self.path(key)?;
        let mode = match expected {
            None => PutMode::Create,
            Some(v) => PutMode::Update(UpdateVersion {
                e_tag: Some(v.0.clone()),
                version: None,
            }),
        };
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        let r = self
            .store
            .put_opts(&p, PutPayload::from(data), opts)
            .await
            .map_err(|e| self.err("cas", key, e))?;
        Ok(Version(r.e_tag.unwrap_or_default()))
    }

    fn ordered_listing(&self) -> bool {
        true
    }

    fn wire_requests(&self) -> WireRequests {
        self.wire.snapshot()
    }

    async fn list_page(
        &self,
        prefix: &str,
        start_after: &str,
        max: usize,
    ) -> Result<ListPage, BackendError> {
        let full = |k: &str| {
            if self.prefix.is_empty() {
                k.to_string()
            } else {
                format!("{}/{k}", self.prefix)
            }
        };
        validate_key(prefix.trim_end_matches('/'))?;
        let opts = PaginatedListOptions {
            offset: (!start_after.is_empty()).then(|| full(start_after)),
            max_keys: Some(max.clamp(1, LIST_PAGE_MAX)),
            ..PaginatedListOptions::default()
        };
        let r = self
            .lister
            .list_paginated(Some(&full(prefix)), opts)
            .await
            .map_err(|e| self.err("list_page", prefix, e))?;
        let mut objects: Vec<ObjectInfo> = r
            .result
            .objects
            .into_iter()
            .filter_map(|m| self.info(m))
            .filter(|o| o.key.starts_with(prefix))
            .collect();
        // S3 lists in key order; sorting costs nothing then and keeps the promise anyway.
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(ListPage {
            objects,
            truncated: r.page_token.is_some(),
        })
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        self.get_range_or_all(key, None).await
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError> {
        if range.start >= range.end {
            validate_key(key)?;
            return Ok(Bytes::new());
        }
        self.get_range_or_all(key, Some(range)).await
    }

    async fn get_many(&self, keys: &[String], limit: u64) -> Vec<Result<Bytes, BackendError>> {
        let mut out: Vec<Option<Result<Bytes, BackendError>>> = keys.iter().map(|_| None).collect();
        // Chunks the view does not place: it is listed again first (once for all the calls
        // waiting, [`S3Backend::refresh`]), or every one of them would be read alone (a
        // loose GET, then a packed read and its dead marker). A clone's prefetch starts
        // with an empty view: measured cold from the local S3 server (issue 35, Debian
        // fixture, eight batches at once), the whole start made 879 requests before this
        // and 52 after. A failed listing leaves the view as it was: the reads below still
        // answer.
        let started = Instant::now();
        let unplaced = {
            let v = self.view();
            keys.iter()
                .any(|k| chunk_digest(k).is_some_and(|d| !v.map.contains_key(&d)))
        };
        if unplaced {
            let _ = self.refresh(started).await;
        }
        for (i, b) in self.get_many_packed(keys, limit, started).await {
            out[i] = Some(Ok(b));
        }
        // The rest one by one: loose objects, entries found dead or in a pack gone, entries
        // over `limit`, and any whose span failed (so the error is the object's own).
        let rest: Vec<usize> = (0..keys.len()).filter(|&i| out[i].is_none()).collect();
        let got: Vec<(usize, Result<Bytes, BackendError>)> = futures::stream::iter(rest)
            .map(|i| async move { (i, self.get_range(&keys[i], 0..limit).await) })
            .buffered(super::GET_MANY_IN_FLIGHT)
            .collect()
            .await;
        for (i, r) in got {
            out[i] = Some(r);
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(BackendError::Other {
                        store: self.url.clone(),
                        op: "get",
                        key: String::new(),
                        message: "no read made".into(),
                    })
                })
            })
            .collect()
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        let Some(d) = chunk_digest(key) else {
            return self.head_raw(key).await;
        };
        if let Some(loc) = self.packed_live(&d, None).await? {
            return Ok(Some(packed_info(key, &loc)));
        }
        if let Some(i) = self.head_raw(key).await? {
            return Ok(Some(i));
        }
        // Neither: maybe in a pack published since the view was listed (a listing begun
        // now; heads that wait for it share the next one).
        Ok(self
            .packed_live(&d, Some(Instant::now()))
            .await?
            .map(|loc| packed_info(key, &loc)))
    }

    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        if let Some(d) = chunk_digest(key)
            && self.packed_live(&d, None).await?.is_some()
        {
            return Ok(PutOutcome::AlreadyExists);
        }
        self.put_if_absent_raw(key, data, expect_sha256).await
    }

    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        if let Some(d) = chunk_digest(key)
            && self.packed_live(&d, None).await?.is_some()
        {
            return Ok(PutOutcome::AlreadyExists);
        }
        self.put_file_if_absent_raw(key, path, expect_sha256).await
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        let v = self.put_raw(key, data).await?;
        // An overwrite of a packed chunk: the new bytes are the object (written first, so
        // the key is never absent), the packed entries die.
        if let Some(d) = chunk_digest(key) {
            self.delete_packed(&d).await?;
        }
        Ok(v)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        let mut out = self.list_raw(prefix).await?;
        if !lists_chunks(prefix) {
            return Ok(out);
        }
        self.refresh(Instant::now()).await?;
        let live: Vec<(Sha256Hash, u64, SystemTime)> = self
            .view()
            .map
            .iter()
            .map(|(d, l)| (*d, l.len, l.modified))
            .collect();
        add_packed(&mut out, prefix, live);
        Ok(out)
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        self.delete_raw(key).await?;
        if let Some(d) = chunk_digest(key) {
            self.delete_packed(&d).await?;
        }
        Ok(())
    }

    async fn delete_many(&self, keys: &[String]) -> Vec<Result<(), BackendError>> {
        let mut out = self.delete_raw_many(keys).await;
        // The chunks among them: marked dead in their packs after the loose deletes, as
        // `delete` does, with one listing of `packs/` for all of them.
        let chunks: Vec<(usize, Sha256Hash)> = keys
            .iter()
            .enumerate()
            .filter(|(i, _)| out[*i].is_ok())
            .filter_map(|(i, k)| Some((i, chunk_digest(k)?)))
            .collect();
        if !chunks.is_empty() {
            let ds: Vec<Sha256Hash> = chunks.iter().map(|(_, d)| *d).collect();
            if let Err(e) = self.delete_packed_many(&ds).await {
                for (i, _) in chunks {
                    out[i] = Err(self.again(&e, "delete", &keys[i]));
                }
            }
        }
        out
    }

    async fn rename_many(&self, pairs: &[(String, String)]) -> Vec<Result<(), BackendError>> {
        self.rename_many_impl(pairs).await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        validate_key(to)?;
        let d = chunk_digest(from);
        if let Some(d) = &d
            && self.view().map.contains_key(d)
            && let Some(bytes) = self.get_packed(d, 0..u64::MAX, None).await?
        {
            return self.rename_packed(from, to, d, bytes).await;
        }
        match (self.rename_raw(from, to).await, d) {
            // Not a loose object: maybe in a pack written since the view was listed.
            (Err(e), Some(d)) if e.is_not_found() => {
                match self
                    .get_packed(&d, 0..u64::MAX, Some(Instant::now()))
                    .await?
                {
                    Some(bytes) => self.rename_packed(from, to, &d, bytes).await,
                    None => Err(e),
                }
            }
            (r, _) => r,
        }
    }

    async fn pack_together(&self, keys: &[String]) -> Result<PackedTogether, BackendError> {
        self.pack_together_impl(keys).await
    }

    fn stage_batch(&self) -> StageBatch {
        StageBatch {
            pack: None,
            s3: Some(Arc::new(S3Batch::new(self.pack_target))),
        }
    }

    async fn stage_if_absent(
        &self,
        batch: &StageBatch,
        key: &str,
        data: Bytes,
    ) -> Result<Staged, BackendError> {
        let (Some(b), Some(d)) = (&batch.s3, chunk_digest(key)) else {
            return Ok(Staged::Done(self.put_if_absent(key, data, None).await?));
        };
        validate_key(key)?;
        // Found live in a pack (checked afresh: a stale hit is never relied on), it is not
        // written. On a miss the view is listed again if older than [`WRITE_RELIST`], no
        // more: a stale miss costs a duplicate (bytes, not safety), and the loose object is
        // not asked for (the writer's look-up, `Store::exist` after its lease, just did).
        let since = Instant::now()
            .checked_sub(WRITE_RELIST)
            .unwrap_or_else(Instant::now);
        if !b.holds(&d) && self.packed_live(&d, Some(since)).await?.is_some() {
            return Ok(Staged::Done(PutOutcome::AlreadyExists));
        }
        let (offset, _closed) = b.append(d, &data);
        self.send_unsent(b).await?;
        Ok(Staged::Pending(StagedPut {
            key: key.to_string(),
            len: data.len() as u64,
            tmp: PathBuf::new(),
            packed: Some(offset.unwrap_or(0)),
        }))
    }

    /// One HEAD of the loose object: no listing of `packs/` (the caller asked
    /// [`Backend::packed_present`] first, whose misses may be a second stale: a duplicate
    /// write, never an unsafe answer).
    async fn loose_present(&self, key: &str) -> Result<bool, BackendError> {
        Ok(self.head_raw(key).await?.is_some())
    }

    async fn flush_staged(&self, batch: &StageBatch) -> Result<(), BackendError> {
        match &batch.s3 {
            Some(b) => self.flush_batch(b).await,
            None => Ok(()),
        }
    }

    async fn commit_staged(
        &self,
        batch: StageBatch,
        staged: Vec<StagedPut>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        if let Some(b) = &batch.s3 {
            self.flush_batch(b).await?;
            return Ok(staged
                .iter()
                .map(|s| match chunk_digest(&s.key) {
                    Some(d) if b.raced(&d) => PutOutcome::AlreadyExists,
                    _ => PutOutcome::Created,
                })
                .collect());
        }
        match staged.first() {
            None => Ok(Vec::new()),
            Some(s) => Err(BackendError::Other {
                store: self.url.clone(),
                op: "commit_staged",
                key: s.key.clone(),
                message: "not a batch of this backend".into(),
            }),
        }
    }

    async fn discard_staged(&self, batch: StageBatch, staged: Vec<StagedPut>) {
        drop(staged);
        if let Some(b) = &batch.s3 {
            let d = b.discard();
            // Packs sent whose index PUT was never begun: invisible for good, removed now
            // (or, if this fails, by a compaction once they are old).
            for name in &d.delete {
                let _ = self.delete_raw(&pack_key(name)).await;
            }
            // Packs whose index PUT failed may be published all the same (the server stored
            // the index, its answer was lost): deleting one would leave an index naming
            // bytes that are gone, under chunks another writer may have found present
            // meanwhile. Confirming with a HEAD would not do: a request still on its way can
            // store the index after the HEAD. Left: garbage for GC if published, else a pack
            // without an index that a compaction removes after `ORPHAN_AGE`.
            if !d.left.is_empty() {
                tracing::debug!(
                    store = %self.url,
                    packs = ?d.left,
                    "discarded upload: packs whose index PUT may have been stored are left for GC or compaction"
                );
            }
        }
    }

    async fn packed_present(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        let mut out = vec![false; keys.len()];
        let digests: Vec<Option<Sha256Hash>> = keys.iter().map(|k| chunk_digest(k)).collect();
        if digests.iter().all(Option::is_none) {
            return Ok(out);
        }
        let since = Instant::now()
            .checked_sub(WRITE_RELIST)
            .unwrap_or_else(Instant::now);
        self.refresh(since).await?;
        // One listing per pack, made now (after the caller's lease): a hit is never stale.
        let at: Vec<usize> = (0..keys.len()).filter(|&i| digests[i].is_some()).collect();
        let ds: Vec<Sha256Hash> = digests.iter().flatten().copied().collect();
        for (i, live) in at.into_iter().zip(self.live_now(&ds).await?) {
            out[i] = live;
        }
        Ok(out)
    }

    async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
        self.refresh(Instant::now()).await?;
        let v = self.view();
        let mut r = LayoutReport {
            problems: v
                .problems
                .iter()
                .map(|(k, why)| (format!("{}/{k}", self.url), why.clone()))
                .collect(),
            ..Default::default()
        };
        let none = HashSet::new();
        for p in v.packs.values() {
            r.packs += 1;
            r.pack_bytes += p.pack_len;
            r.dead_bytes += p.pack_len.saturating_sub(v.serving_bytes(p, &none));
        }
        Ok(r)
    }

    async fn compact(
        &self,
        dry_run: bool,
        also_dead: &[String],
    ) -> Result<CompactReport, BackendError> {
        self.refresh(Instant::now()).await?;
        let also: HashSet<Sha256Hash> = also_dead.iter().filter_map(|k| chunk_digest(k)).collect();
        let (retire, orphans, stray) = {
            let v = self.view();
            let retire: Vec<(String, u64)> = v
                .packs
                .values()
                .filter(|p| v.serving_bytes(p, &also) == 0)
                .map(|p| (p.name.to_string(), p.pack_len))
                .collect();
            let now = SystemTime::now();
            let orphans: Vec<(String, u64)> = v
                .orphans
                .iter()
                .filter(|(_, (_, m))| now.duration_since(*m).is_ok_and(|a| a > ORPHAN_AGE))
                .map(|(n, (len, _))| (n.clone(), *len))
                .collect();
            (retire, orphans, v.stray_dead.clone())
        };
        let mut r = CompactReport::default();
        for (_, len) in &retire {
            r.packs += 1;
            r.bytes_before += len;
            r.bytes_reclaimed += len;
        }
        for (_, len) in &orphans {
            r.orphan_files += 1;
            r.bytes_reclaimed += len;
        }
        if dry_run {
            return Ok(r);
        }
        for (name, _) in &retire {
            self.retire_pack(name).await?;
        }
        self.packs.retired_early.report_into(&mut r);
        for (name, _) in &orphans {
            self.delete_raw(&pack_key(name)).await?;
            self.delete_markers(name).await?;
        }
        for name in &stray {
            self.delete_markers(name).await?;
        }
        Ok(r)
    }
}

async fn read_full(f: &mut tokio::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let r = f.read(&mut buf[n..]).await?;
        if r == 0 {
            break;
        }
        n += r;
    }
    Ok(n)
}
