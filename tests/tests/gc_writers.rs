//! GC with many writers on an S3 store (issue 19), against moto's S3: the race "GC lists
//! old unreferenced chunk X and reads the leases; a build leases X, finds it present and
//! skips uploading it; GC deletes X; the build publishes a manifest naming X" driven step by
//! step; a GC process killed at every write, then a GC that finishes; and two nodes pushing
//! images that share old unreferenced chunks while GC with no grace period runs in a loop.
//! The last two run on a local directory too (the same protocol; there GC's sweep lock
//! closes the race as well, so the first, which holds GC mid-sweep, runs on S3 only).
//!
//! Needs the servers of `ci/setup.sh` (`source /var/cache/kiln-ci/env`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_like::BoxFuture;
use kiln_store::artifact::PutArtifactOptions;
use kiln_store::backend::s3::{S3Backend, S3Options};
use kiln_store::backend::{
    Backend, BackendError, CompactReport, LayoutReport, ListPage, ObjectInfo, PutOutcome,
    StageBatch, Staged, StagedPut, StoreUrl, Version,
};
use kiln_store::gc::GcOptions;
use kiln_store::manifest::{ImageManifest, Manifest, ObjectRef};
use kiln_store::verify::Finding;
use kiln_store::{ChunkTable, Store, StoreOptions, TagRef};
use kiln_tests::stores::{Kind, fresh_bucket_url, fresh_url, test_bytes};

mod futures_like {
    /// A boxed future (the tests crate does not depend on `futures`).
    pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;
}

/// The raw S3 backend of `url`.
fn s3_backend(url: &str) -> Arc<dyn Backend> {
    let StoreUrl::S3 { bucket, prefix } = StoreUrl::parse(url).unwrap() else {
        panic!("not an S3 URL: {url}")
    };
    Arc::new(S3Backend::open(&bucket, &prefix, &S3Options::from_env()).unwrap())
}

fn no_grace() -> GcOptions {
    GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    }
}

/// Fault injector: runs `hook` once, just before the first delete or rename whose source is
/// `key` (GC's sweep of that object, which comes after GC's lease read), and holds that
/// request until the hook is done. A real S3 server cannot be paused at one request.
struct BeforeSweepOf {
    inner: Arc<dyn Backend>,
    key: String,
    hook: Mutex<Option<BoxFuture<()>>>,
}

impl std::fmt::Debug for BeforeSweepOf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BeforeSweepOf")
            .field("key", &self.key)
            .finish()
    }
}

impl BeforeSweepOf {
    async fn maybe_run(&self, key: &str) {
        if key != self.key {
            return;
        }
        let hook = self.hook.lock().unwrap().take();
        if let Some(h) = hook {
            h.await;
        }
    }
}

#[async_trait::async_trait]
impl Backend for BeforeSweepOf {
    fn url(&self) -> &str {
        self.inner.url()
    }
    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        self.inner.get(key).await
    }
    async fn get_range(&self, key: &str, r: std::ops::Range<u64>) -> Result<Bytes, BackendError> {
        self.inner.get_range(key, r).await
    }
    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError> {
        self.inner.get_versioned(key).await
    }
    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        self.inner.head(key).await
    }
    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect: Option<kiln_store::digest::Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        self.inner.put_if_absent(key, data, expect).await
    }
    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &std::path::Path,
        expect: Option<kiln_store::digest::Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        self.inner.put_file_if_absent(key, path, expect).await
    }
    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        self.inner.put(key, data).await
    }
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError> {
        self.inner.compare_and_swap(key, expected, data).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        self.inner.list(prefix).await
    }
    fn ordered_listing(&self) -> bool {
        self.inner.ordered_listing()
    }
    async fn list_page(
        &self,
        prefix: &str,
        start_after: &str,
        max: usize,
    ) -> Result<ListPage, BackendError> {
        self.inner.list_page(prefix, start_after, max).await
    }
    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        self.maybe_run(key).await;
        self.inner.delete(key).await
    }
    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        self.maybe_run(from).await;
        self.inner.rename(from, to).await
    }
    // The S3 backend's packs (issue 33): writes go through them as without the injector.
    fn stage_batch(&self) -> StageBatch {
        self.inner.stage_batch()
    }
    async fn stage_if_absent(
        &self,
        batch: &StageBatch,
        key: &str,
        data: Bytes,
    ) -> Result<Staged, BackendError> {
        self.inner.stage_if_absent(batch, key, data).await
    }
    async fn flush_staged(&self, batch: &StageBatch) -> Result<(), BackendError> {
        self.inner.flush_staged(batch).await
    }
    async fn commit_staged(
        &self,
        batch: StageBatch,
        staged: Vec<StagedPut>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        self.inner.commit_staged(batch, staged).await
    }
    async fn discard_staged(&self, batch: StageBatch, staged: Vec<StagedPut>) {
        self.inner.discard_staged(batch, staged).await
    }
    async fn packed_present(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.inner.packed_present(keys).await
    }
    async fn pack_together(
        &self,
        keys: &[String],
    ) -> Result<kiln_store::backend::PackedTogether, BackendError> {
        self.inner.pack_together(keys).await
    }
    async fn loose_present(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.loose_present(key).await
    }
    async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
        self.inner.layout_report().await
    }
    async fn compact(
        &self,
        dry_run: bool,
        also_dead: &[String],
    ) -> Result<CompactReport, BackendError> {
        self.inner.compact(dry_run, also_dead).await
    }
}

/// Uploads `data` as chunks with no manifest or tag (an untagged image's leftovers).
async fn orphan_chunks(store: &Store, data: &[u8]) -> ChunkTable {
    let (table, _) = store
        .put_artifact_reader(std::io::Cursor::new(data.to_vec()), &Default::default())
        .await
        .unwrap();
    table
}

/// A build of `data` under a lease on `store` (as `kiln build` publishes): chunks leased and
/// looked up before reuse, written when absent. Returns the lease and the table.
async fn leased_upload(
    store: &Store,
    id: &str,
    data: &[u8],
) -> (Arc<kiln_store::lease::Lease>, ChunkTable) {
    let lease = Arc::new(
        store
            .create_lease(id, Duration::from_secs(600), [])
            .await
            .unwrap(),
    );
    let opts = PutArtifactOptions {
        lease: Some(lease.clone()),
        ..Default::default()
    };
    let (table, _) = store
        .put_artifact_reader(std::io::Cursor::new(data.to_vec()), &opts)
        .await
        .unwrap();
    (lease, table)
}

/// The rest of the build: manifest (leased), tag, release.
async fn publish(
    store: &Store,
    lease: Arc<kiln_store::lease::Lease>,
    table: ChunkTable,
    tag: &str,
) {
    let raw = lease
        .put_manifest(&Manifest::Image(ImageManifest::new(table)))
        .await
        .unwrap();
    store
        .force_tag(&tag.parse().unwrap(), raw.digest)
        .await
        .unwrap();
    lease.release().await.unwrap();
}

/// Verify, deep: the findings (empty when clean) and the number of missing chunks.
async fn deep_verify(store: &Store) -> (Vec<Finding>, usize) {
    let r = store.verify(true, &GcOptions::default()).await.unwrap();
    let missing = r
        .findings
        .iter()
        .filter(|f| matches!(f, Finding::MissingChunk { .. }))
        .count();
    (r.findings, missing)
}

/// Issue 19's race, step by step: GC has read the leases (X unleased, untagged, older than
/// the zero grace period) and is about to sweep X; a build now leases X, finds it present
/// and skips uploading it; then (before GC's second look, or after GC is done) it publishes
/// a manifest naming X and moves its tag. Every chunk of the published image must be there.
async fn reuse_during_sweep(publish_before_gc_ends: bool) {
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_bucket_url("race");
    let node = Store::open(&url).await.unwrap();
    let data = test_bytes(19, 1 << 20);
    let old = orphan_chunks(&node, &data).await;
    let x = old.entries[0].digest.unwrap();

    let writer = Store::open(&url).await.unwrap();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let w = writer.clone();
    let hook: BoxFuture<()> = Box::pin(async move {
        // GC read the leases and is about to sweep X: the build leases and finds it.
        let (lease, table) = leased_upload(&w, "racing-build", &data).await;
        if publish_before_gc_ends {
            publish(&w, lease, table, "img:v1").await;
            let _ = done_tx.send(None);
        } else {
            let _ = done_tx.send(Some((lease, table)));
        }
    });
    let gc_store = Store::from_backend(
        Arc::new(BeforeSweepOf {
            inner: s3_backend(&url),
            key: x.key(),
            hook: Mutex::new(Some(hook)),
        }),
        StoreOptions::default(),
    );
    let report = gc_store.gc(&no_grace()).await.unwrap();
    let held = done_rx
        .await
        .unwrap_or_else(|_| panic!("GC never swept X (so the race was not run): {report:?}"));
    if let Some((lease, table)) = held {
        publish(&writer, lease, table, "img:v1").await;
    }
    let store = Store::open(&url).await.unwrap();
    for d in old.chunk_digests() {
        assert!(
            store.has(&ObjectRef::Chunk(d)).await.unwrap(),
            "chunk {d} of the published image is gone; GC: {report:?}"
        );
    }
    let (findings, missing) = deep_verify(&store).await;
    assert!(
        findings.is_empty(),
        "{missing} missing chunks: {findings:?}"
    );
    let Manifest::Image(m) = store
        .get_manifest(&store.resolve_tag(&"img:v1".parse().unwrap()).await.unwrap())
        .await
        .unwrap()
    else {
        panic!("not an image")
    };
    let out = dir.path().join("out.img");
    store.materialize(&m.disk, &out, None).await.unwrap();
    assert!(std::fs::read(&out).unwrap() == test_bytes(19, 1 << 20));
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_keeps_a_chunk_a_build_reuses_mid_sweep_s3() {
    reuse_during_sweep(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_keeps_a_chunk_a_build_reuses_and_tags_mid_sweep_s3() {
    reuse_during_sweep(true).await;
}

// ---- a GC process killed at every write ---------------------------------------------------------

const PUSHER: &str = env!("CARGO_BIN_EXE_kiln-test-pusher");

/// One `kiln-test-pusher gc` run, killed after write `crash` (or not at all).
fn run_gc(url: &str, crash: Option<u64>) -> std::process::Output {
    let mut c = std::process::Command::new(PUSHER);
    c.args(["gc", url]);
    c.env(
        kiln_tests::crash::CRASH_AFTER_WRITES,
        crash.unwrap_or(u64::MAX).to_string(),
    );
    c.output().unwrap()
}

/// A GC process killed after each of its writes (the lock, every move to a fossil key, every
/// fossil judged, the lock's release), on a store with a tagged image, an untagged one and a
/// leftover of a move cut between its copy and its delete (a chunk of the tagged image both
/// at its key and at its fossil key). After each kill verify --deep is clean; then a build
/// may tag the untagged image (it relied on it before the kill: the race above); then a GC
/// runs to the end: no fossil is left, the tagged images are whole, the rest is gone.
/// The store every kill point starts from: a tagged image, an untagged one, and a fossil
/// copy of one chunk of the tagged image (a move cut between its copy and its delete).
/// Returns the store handle and the untagged image's manifest.
async fn crash_fixture(url: &str) -> (Store, kiln_store::ManifestDigest) {
    let s = Store::open(url).await.unwrap();
    let chunking = kiln_store::Chunking::Fixed { size: 64 << 10 };
    let put = |seed| {
        let s = s.clone();
        async move {
            let (table, _) = s
                .put_artifact_reader(
                    std::io::Cursor::new(test_bytes(seed, 192 << 10)),
                    &PutArtifactOptions {
                        chunking: Some(chunking),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            s.put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
                .await
                .unwrap()
                .digest
        }
    };
    let kept = put(1).await;
    s.force_tag(&"img:kept".parse().unwrap(), kept)
        .await
        .unwrap();
    let untagged = put(2).await;
    let Manifest::Image(km) = s.get_manifest(&kept).await.unwrap() else {
        panic!("not an image")
    };
    let half = km.disk.chunk_digests()[0].key();
    let b = s.backend();
    b.put(
        &kiln_store::gc::fossil_key(&half),
        b.get(&half).await.unwrap(),
    )
    .await
    .unwrap();
    (s, untagged)
}

/// Kill point `k` on a fresh store at `url`: returns whether a build tagged the untagged
/// image after the kill.
async fn killed_at(url: String, k: u64) -> bool {
    let (s, untagged) = crash_fixture(&url).await;
    let u = url.clone();
    let out = tokio::task::spawn_blocking(move || run_gc(&u, Some(k)))
        .await
        .unwrap();
    assert!(
        !out.status.success(),
        "the GC was to die after write {k}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let (findings, _) = deep_verify(&s).await;
    assert!(
        findings.is_empty(),
        "after a kill at write {k}: {findings:?}"
    );
    // Every other time, while all of it is still there to read (before the GC's second
    // phase deleted any of it: that phase never deletes what a build it saw relies on), a
    // build that had found the untagged image present tags it.
    let tag_it = k.is_multiple_of(2) && readable(&s, untagged).await;
    if tag_it {
        s.force_tag(&"img:late".parse().unwrap(), untagged)
            .await
            .unwrap();
        let (findings, _) = deep_verify(&s).await;
        assert!(
            findings.is_empty(),
            "kill at write {k}, then a tag: {findings:?}"
        );
    }
    let again = Store::open(&url).await.unwrap();
    again
        .gc(&no_grace())
        .await
        .unwrap_or_else(|e| panic!("the GC after a kill at write {k}: {e}"));
    let b = s.backend();
    assert!(
        b.list("fossil/").await.unwrap().is_empty(),
        "kill at write {k}"
    );
    assert!(b.head(kiln_store::gc::GC_LOCK_KEY).await.unwrap().is_none());
    let r = s.verify(true, &GcOptions::default()).await.unwrap();
    assert!(r.is_ok(), "kill at write {k}: {:?}", r.findings);
    assert_eq!(r.manifests, if tag_it { 2 } else { 1 }, "kill at write {k}");
    assert_eq!(
        s.has(&ObjectRef::Manifest(untagged)).await.unwrap(),
        tag_it,
        "kill at write {k}"
    );
    assert!(r.orphans.is_empty(), "kill at write {k}: {:?}", r.orphans);
    tag_it
}

/// A fresh store of `kind`; on S3 in a bucket of its own ([`fresh_bucket_url`]: these tests
/// delete much).
fn own_url(kind: Kind, dir: &std::path::Path, label: &str) -> String {
    match kind {
        Kind::Local => fresh_url(kind, dir, label),
        Kind::S3 => fresh_bucket_url(label),
    }
}

/// Kill points run at once (each on its own store): a few, since one S3 test server serves
/// every test.
const KILL_POINTS_AT_ONCE: usize = 4;

async fn gc_killed_at_every_write(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    // Writes of an uncrashed run on this store.
    let url = own_url(kind, dir.path(), "crash-count");
    crash_fixture(&url).await;
    let out = tokio::task::spawn_blocking(move || run_gc(&url, None))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let total: u64 = text
        .split_whitespace()
        .find_map(|f| f.strip_prefix("writes="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unexpected gc output {text:?}"));
    // lock + 4 moves (3 chunks, 1 manifest) + 1 fossil put back + 4 deletes + release.
    assert!(total >= 11, "{text}");
    // Each kill point on its own store, [`KILL_POINTS_AT_ONCE`] at a time.
    let mut runs = tokio::task::JoinSet::new();
    let mut tagged_after_kill = 0;
    for k in 1..=total {
        if runs.len() >= KILL_POINTS_AT_ONCE {
            tagged_after_kill += u32::from(runs.join_next().await.unwrap().unwrap());
        }
        runs.spawn(killed_at(
            own_url(kind, dir.path(), &format!("crash{k}")),
            k,
        ));
    }
    while let Some(r) = runs.join_next().await {
        tagged_after_kill += u32::from(r.unwrap());
    }
    assert!(tagged_after_kill >= 2, "{tagged_after_kill}");
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_killed_at_every_write_leaves_a_clean_store_the_next_gc_finishes_local() {
    gc_killed_at_every_write(Kind::Local).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_killed_at_every_write_leaves_a_clean_store_the_next_gc_finishes_s3() {
    gc_killed_at_every_write(Kind::S3).await;
}

/// Whether manifest `d` and every chunk it names can be read (at their keys or fossils).
async fn readable(s: &Store, d: kiln_store::ManifestDigest) -> bool {
    let Ok(Manifest::Image(m)) = s.get_manifest(&d).await else {
        return false;
    };
    for c in m.disk.chunk_digests() {
        if s.get_chunk_stored(&c).await.is_err() {
            return false;
        }
    }
    true
}

// ---- two nodes pushing while GC runs ------------------------------------------------------------

/// Most time the concurrent test runs (its rounds usually end it first).
const CONCURRENT_FOR: Duration = Duration::from_secs(45);
/// Images each node pushes at most.
const ROUNDS: u32 = 60;
/// Bases (the old chunks images share): 4 of 512 KiB.
const BASES: u64 = 4;

/// The image of `node`'s `round`: base `round % BASES` (shared by both nodes, so its chunks
/// are often old and untagged when reused) and 64 KiB of its own.
fn image_bytes(node: u64, round: u32) -> Vec<u8> {
    let mut b = test_bytes(1000 + u64::from(round) % BASES, 512 << 10);
    b.extend(test_bytes(node * 100_000 + u64::from(round), 64 << 10));
    b
}

/// Issue 19's test: two nodes (two store handles, each with its own known-chunk index)
/// push images sharing old unreferenced chunks, each moving its own tag to the new image
/// every round (so the last image's chunks become unreferenced), while GC with no grace
/// period runs in a loop; for at most [`CONCURRENT_FOR`] or [`ROUNDS`] images a node. At the
/// end every tag's image is whole: verify --deep clean, 0 missing chunks.
async fn concurrent_gc_and_pushes(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let url = own_url(kind, dir.path(), "two-nodes");
    let seed = Store::open(&url).await.unwrap();
    for b in 0..BASES {
        orphan_chunks(&seed, &test_bytes(1000 + b, 512 << 10)).await;
    }
    let start = Instant::now();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut nodes = Vec::new();
    for node in 0..2u64 {
        let store = Store::open(&url).await.unwrap();
        nodes.push(tokio::spawn(async move {
            let tag: TagRef = format!("node{node}:latest").parse().unwrap();
            let mut pushed = 0u32;
            for round in 0..ROUNDS {
                if start.elapsed() > CONCURRENT_FOR {
                    break;
                }
                let (lease, table) = leased_upload(
                    &store,
                    &format!("node{node}-r{round}"),
                    &image_bytes(node, round),
                )
                .await;
                let raw = lease
                    .put_manifest(&Manifest::Image(ImageManifest::new(table)))
                    .await
                    .unwrap();
                store.force_tag(&tag, raw.digest).await.unwrap();
                // A tag per round as well, kept: each must stay whole.
                let kept: TagRef = format!("node{node}:r{round}").parse().unwrap();
                store.force_tag(&kept, raw.digest).await.unwrap();
                lease.release().await.unwrap();
                // The kept tag goes again two rounds later (its chunks then unreferenced,
                // unless shared), so old untagged chunks keep coming back.
                if round >= 2 {
                    let old: TagRef = format!("node{node}:r{}", round - 2).parse().unwrap();
                    store.untag(&old, None).await.unwrap();
                }
                pushed += 1;
            }
            pushed
        }));
    }
    let gc_stop = stop.clone();
    let gc = tokio::spawn(async move {
        let store = Store::open(&url).await.unwrap();
        let mut runs = 0u32;
        let (mut condemned, mut resurrected) = (0usize, 0usize);
        while !gc_stop.load(std::sync::atomic::Ordering::SeqCst) {
            let r = store.gc(&no_grace()).await.unwrap();
            condemned += r.condemned;
            resurrected += r.resurrected.len();
            runs += 1;
        }
        (store, runs, condemned, resurrected)
    });
    let mut pushed = Vec::new();
    for n in nodes {
        pushed.push(n.await.unwrap());
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (store, runs, condemned, resurrected) = gc.await.unwrap();
    eprintln!(
        "pushed {pushed:?} images, {runs} GC runs ({condemned} objects condemned, \
         {resurrected} put back) in {:?}",
        start.elapsed()
    );
    assert!(
        runs >= 2 && pushed.iter().all(|p| *p >= 2),
        "{runs} {pushed:?}"
    );
    let (findings, missing) = deep_verify(&store).await;
    assert!(
        findings.is_empty(),
        "{missing} missing chunks after {runs} GC runs: {findings:?}"
    );
    // Per node: its latest tag and its last two round tags.
    let tags = store.list_tags(None).await.unwrap();
    let want: usize = pushed.iter().map(|p| 1 + 2.min(*p as usize)).sum();
    assert_eq!(tags.len(), want, "{tags:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_gc_and_pushes_from_two_nodes_lose_no_chunk_local() {
    concurrent_gc_and_pushes(Kind::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_gc_and_pushes_from_two_nodes_lose_no_chunk_s3() {
    concurrent_gc_and_pushes(Kind::S3).await;
}
