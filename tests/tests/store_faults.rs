//! Fault and crash tests of the store (issue 3), against the local backend and moto's S3:
//! connections reset or stalled mid-upload (a TCP fault injector in front of moto), a pusher
//! process killed at many points then rerun, concurrent pushers, GC during a push, and a stale
//! compare-and-swap on a tag.
//!
//! Needs the servers of `ci/setup.sh` (`source /var/cache/kiln-ci/env`).

use kiln_store::backend::Backend;
use kiln_store::chunk::{ChunkTable, Chunking};
use kiln_store::manifest::{ImageManifest, Manifest};
use kiln_store::{Store, StoreError, TagError, TagRef};
use kiln_tests::stores::{Kind, fresh_url};

/// A small manifest with no chunks (one hole), distinct per `n`.
fn empty_manifest(n: u64) -> Manifest {
    let mut table = ChunkTable {
        size: 0,
        chunking: Chunking::DISK_DEFAULT,
        entries: Vec::new(),
    };
    table.size = n + 1;
    table.push(kiln_store::chunk::ChunkEntry {
        offset: 0,
        raw_len: n + 1,
        digest: None,
        stored_len: 0,
    });
    Manifest::Image(ImageManifest::new(table))
}

async fn stale_compare_and_swap_loses(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_url(kind, dir.path(), "stale");
    // Two independent handles on one store: two hosts.
    let a = Store::open(&url).await.unwrap();
    let b = Store::open(&url).await.unwrap();
    let m1 = a.put_manifest(&empty_manifest(1)).await.unwrap().digest;
    let m2 = a.put_manifest(&empty_manifest(2)).await.unwrap().digest;
    let m3 = a.put_manifest(&empty_manifest(3)).await.unwrap().digest;
    let t: TagRef = "img:latest".parse().unwrap();

    a.set_tag(&t, None, m1).await.unwrap();
    // Both read m1; a moves it to m2 first; b's move from m1 must lose.
    assert_eq!(b.resolve_tag(&t).await.unwrap(), m1);
    a.set_tag(&t, Some(m1), m2).await.unwrap();
    let err = b.set_tag(&t, Some(m1), m3).await.unwrap_err();
    match &err {
        StoreError::Tag(TagError::Stale {
            expected, actual, ..
        }) => {
            assert_eq!(*expected, Some(m1));
            assert_eq!(*actual, Some(m2));
        }
        other => panic!("expected a stale-tag error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("img:latest") && msg.contains("stale") && msg.contains(&m1.to_string()),
        "unclear message: {msg}"
    );
    // The winner's value stands, and the history has both moves and nothing of the loser.
    assert_eq!(a.resolve_tag(&t).await.unwrap(), m2);
    let hist = a.tag_history(&t).await.unwrap();
    let moves: Vec<_> = hist.iter().map(|h| (h.previous, h.new)).collect();
    assert_eq!(moves, vec![(None, Some(m1)), (Some(m1), Some(m2))]);
    // "Expected absent" loses too once the tag exists.
    assert!(matches!(
        b.set_tag(&t, None, m3).await,
        Err(StoreError::Tag(TagError::Stale { .. }))
    ));
}

#[tokio::test]
async fn stale_compare_and_swap_loses_local() {
    stale_compare_and_swap_loses(Kind::Local).await;
}

#[tokio::test]
async fn stale_compare_and_swap_loses_s3() {
    stale_compare_and_swap_loses(Kind::S3).await;
}

// ---- a pusher process killed at many points ------------------------------------------------

const PUSHER: &str = env!("CARGO_BIN_EXE_kiln-test-pusher");

/// An artifact of data, a zero run (a hole) and more data: 28 chunks at the disk default
/// (35 backend writes; the 6 MiB one before made 37 and 44), over three times the
/// pusher's 8 uploads in flight. Each of the
/// 24 crash points uploads and reads back the whole artifact from moto: its size is most
/// of this test's time.
fn write_artifact(path: &std::path::Path, seed: u64) -> Vec<u8> {
    let mut bytes = kiln_tests::stores::test_bytes(seed, 2 << 20);
    bytes.extend(std::iter::repeat_n(0u8, 1 << 19));
    bytes.extend(kiln_tests::stores::test_bytes(seed + 1, 3 << 19));
    std::fs::write(path, &bytes).unwrap();
    bytes
}

/// What one pusher run printed: (manifest, chunks uploaded, chunks seen, writes).
fn parse_pusher(stdout: &[u8]) -> (String, u64, u64, u64) {
    let s = String::from_utf8_lossy(stdout);
    let mut it = s.split_whitespace();
    let manifest = it.next().unwrap_or_default().to_string();
    let mut num = |k: &str| -> u64 {
        it.next()
            .and_then(|f| f.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("unexpected pusher output {s:?}"))
    };
    (manifest, num("uploaded="), num("chunks="), num("writes="))
}

fn run_pusher(
    file: &std::path::Path,
    tag: &str,
    url: &str,
    crash: Option<u64>,
) -> std::process::Output {
    let mut c = std::process::Command::new(PUSHER);
    c.args(["import", &file.to_string_lossy(), tag, url]);
    match crash {
        Some(n) => c.env(kiln_tests::crash::CRASH_AFTER_WRITES, n.to_string()),
        None => c.env(kiln_tests::crash::CRASH_AFTER_WRITES, u64::MAX.to_string()),
    };
    c.output().unwrap()
}

/// The invariant a crash must never break: every tag names a manifest that exists and parses,
/// and every chunk it names exists. Returns the number of tags checked.
async fn assert_no_dangling_tag(store: &Store) -> usize {
    let tags = store.list_tags(None).await.unwrap();
    for (t, digest) in &tags {
        let m = store
            .get_manifest(digest)
            .await
            .unwrap_or_else(|e| panic!("tag {t} names an unreadable manifest: {e}"));
        let table = match m {
            Manifest::Image(m) => m.disk,
            Manifest::Snapshot(m) => m.disk,
        };
        for d in table.chunk_digests() {
            assert!(
                store
                    .has(&kiln_store::manifest::ObjectRef::Chunk(d))
                    .await
                    .unwrap(),
                "tag {t} names manifest {digest}, whose chunk {d} is missing"
            );
        }
    }
    tags.len()
}

async fn chunk_count(store: &Store) -> u64 {
    store.backend().list("chunks/").await.unwrap().len() as u64
}

async fn killed_at_many_points(kind: Kind) {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("artifact.img");
    let bytes = write_artifact(&file, 7);

    // A full run on a scratch store counts the writes a cold import makes.
    let scratch = fresh_url(kind, dir.path(), "count");
    let out = run_pusher(&file, "img:v1", &scratch, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (want_manifest, _, chunks, writes) = parse_pusher(&out.stdout);
    assert!(
        chunks >= 20 && writes > chunks,
        "chunks={chunks} writes={writes}"
    );

    // Crash after write n, for 24 n spread over the whole run (first and last included).
    let mut points: Vec<u64> = (0..24).map(|i| 1 + i * (writes - 1) / 23).collect();
    points.dedup();
    assert!(points.len() >= 20, "{points:?}");
    for n in points {
        let url = fresh_url(kind, dir.path(), &format!("crash{n}"));
        let out = run_pusher(&file, "img:v1", &url, Some(n));
        assert_eq!(
            out.status.signal(),
            Some(6),
            "pusher should have aborted after write {n}: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let store = Store::open(&url).await.unwrap();
        if kind == Kind::Local {
            // The open took back the killed pusher's temp files (its staged chunks).
            let tmp = std::path::Path::new(&url).join(".tmp");
            let left: Vec<_> = std::fs::read_dir(&tmp)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert!(left.is_empty(), "crash at {n}: temp files left: {left:?}");
        }
        let tagged = assert_no_dangling_tag(&store).await;
        let present = chunk_count(&store).await;

        // Rerun: completes, uploads only what is missing, and the result is whole.
        let out = run_pusher(&file, "img:v1", &url, None);
        assert!(
            out.status.success(),
            "rerun after crash at {n}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (manifest, uploaded, seen, _) = parse_pusher(&out.stdout);
        assert_eq!(manifest, want_manifest, "crash at {n}");
        assert_eq!(seen, chunks);
        // Only the rest is uploaded. A request in flight when the pusher died may still land
        // on the server after the listing, so up to the parallelism (8) may be found present.
        assert!(
            uploaded <= chunks - present && uploaded + 8 >= chunks - present,
            "crash at {n}: {present} of {chunks} chunks were there, the rerun uploaded {uploaded}"
        );
        assert_eq!(
            assert_no_dangling_tag(&store).await,
            1,
            "crash at {n} (tags before rerun: {tagged})"
        );
        let dest = dir.path().join(format!("out{n}.img"));
        let digest = store.resolve_tag(&"img:v1".parse().unwrap()).await.unwrap();
        let Manifest::Image(m) = store.get_manifest(&digest).await.unwrap() else {
            panic!("not an image manifest")
        };
        store.materialize(&m.disk, &dest, None).await.unwrap();
        assert!(
            std::fs::read(&dest).unwrap() == bytes,
            "crash at {n}: content differs"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pusher_killed_at_many_points_local() {
    killed_at_many_points(Kind::Local).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pusher_killed_at_many_points_s3() {
    killed_at_many_points(Kind::S3).await;
}

// ---- connections reset or stalled mid-upload (S3 through the fault injector) -----------------

fn s3_through(
    proxy: &kiln_tests::fault_proxy::FaultProxy,
    attempts: u32,
) -> kiln_store::StoreOptions {
    use kiln_store::backend::retry::RetryPolicy;
    use kiln_store::backend::s3::S3Options;
    use std::time::Duration;
    kiln_store::StoreOptions {
        s3: S3Options {
            endpoint: Some(proxy.url()),
            allow_http: Some(true),
            request_timeout: Some(Duration::from_secs(3)),
            connect_timeout: Some(Duration::from_secs(3)),
            // Packs of 256 KiB (four chunks), so an upload that gives up part way has sent
            // some of its packs whole (issue 33: what was sent is kept per pack).
            pack_target: Some(256 << 10),
            ..Default::default()
        },
        retry: RetryPolicy {
            max_attempts: attempts,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(500),
            ..RetryPolicy::default()
        },
        parallelism: 4,
        ..Default::default()
    }
}

async fn import_with(
    store: &Store,
    file: &std::path::Path,
    tag: &str,
) -> Result<
    (
        kiln_store::ManifestDigest,
        kiln_store::progress::TransferStats,
    ),
    StoreError,
> {
    let (table, stats) = store
        .put_artifact(file, &kiln_store::artifact::PutArtifactOptions::default())
        .await?;
    let raw = store
        .put_manifest(&Manifest::Image(ImageManifest::new(table)))
        .await?;
    store.force_tag(&tag.parse()?, raw.digest).await?;
    Ok((raw.digest, stats))
}

async fn assert_whole(url: &str, tag: &str, bytes: &[u8], dir: &std::path::Path) {
    let store = Store::open(url).await.unwrap();
    assert_eq!(assert_no_dangling_tag(&store).await, 1);
    let digest = store.resolve_tag(&tag.parse().unwrap()).await.unwrap();
    let Manifest::Image(m) = store.get_manifest(&digest).await.unwrap() else {
        panic!("not an image manifest")
    };
    let dest = dir.join("whole.img");
    store.materialize(&m.disk, &dest, None).await.unwrap();
    assert!(std::fs::read(&dest).unwrap() == bytes, "content differs");
}

#[tokio::test(flavor = "multi_thread")]
async fn s3_upload_survives_resets_and_stalls() {
    use kiln_tests::fault_proxy::{Fault, FaultProxy};
    let proxy = FaultProxy::start(&kiln_tests::stores::s3_host_port())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_url(Kind::S3, dir.path(), "resets");
    let file = dir.path().join("a.img");
    let bytes = write_artifact(&file, 11);
    let store = Store::open_with(&url, s3_through(&proxy, 8)).await.unwrap();
    // Resets and a stall (longer than the 3 s request timeout) in the first ~700 kB of upload.
    proxy.arm([
        (100_000, Fault::Reset),
        (300_000, Fault::Reset),
        (450_000, Fault::Stall(std::time::Duration::from_secs(6))),
        (700_000, Fault::Reset),
    ]);
    let (_, stats) = import_with(&store, &file, "img:v1").await.unwrap();
    assert_eq!(proxy.fired(), 4, "uploaded {} bytes", proxy.uploaded());
    assert!(store.metrics().retries >= 4, "{:?}", store.metrics());
    assert_eq!(stats.chunks_transferred, stats.chunks);
    assert_whole(&url, "img:v1", &bytes, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn s3_upload_that_gives_up_resumes_on_rerun() {
    use kiln_tests::fault_proxy::{Fault, FaultProxy};
    let proxy = FaultProxy::start(&kiln_tests::stores::s3_host_port())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_url(Kind::S3, dir.path(), "resume");
    let file = dir.path().join("a.img");
    let bytes = write_artifact(&file, 13);
    // Two attempts per request, and a reset every 20 kB after the first 400 kB: the push
    // makes progress, then gives up.
    let store = Store::open_with(&url, s3_through(&proxy, 2)).await.unwrap();
    proxy.arm((0..200).map(|i| (400_000 + i * 20_000, Fault::Reset)));
    let err = import_with(&store, &file, "img:v1").await.unwrap_err();
    assert!(proxy.fired() >= 2, "{err}");
    let direct = Store::open(&url).await.unwrap();
    assert!(
        direct.list_tags(None).await.unwrap().is_empty(),
        "a failed push set a tag"
    );
    let present = chunk_count(&direct).await;
    assert!(
        present > 0,
        "the failed push stored nothing before giving up: {err}"
    );

    // Rerun through a healthy network: uploads only the missing chunks.
    proxy.arm([]);
    let store = Store::open_with(&url, s3_through(&proxy, 8)).await.unwrap();
    let (_, stats) = import_with(&store, &file, "img:v1").await.unwrap();
    assert_eq!(stats.chunks_transferred, stats.chunks - present);
    assert_whole(&url, "img:v1", &bytes, dir.path()).await;
}

/// A read across chunks asks the store for all of them at once (issue 35: a lazy clone's disk
/// reads span two or three chunks, and each used to wait for the one before it): with every
/// read of chunk bytes stalled by the fault injector (a loose chunk's GET or a pack's ranged
/// GET; listings and pack indexes pass), one `read_at` over three chunks has all three reads
/// in flight. One after another, the second could not be asked for before the first gave up
/// at its 60 s request bound.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_across_chunks_asks_for_them_at_once_s3() {
    use kiln_tests::fault_proxy::FaultProxy;
    use std::time::{Duration, Instant};
    let proxy = FaultProxy::start(&kiln_tests::stores::s3_host_port())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_url(Kind::S3, dir.path(), "read-at");
    let file = dir.path().join("a.img");
    write_artifact(&file, 31);
    let (table, _) = Store::open(&url)
        .await
        .unwrap()
        .put_artifact(&file, &kiln_store::artifact::PutArtifactOptions::default())
        .await
        .unwrap();
    let first = &table.entries[0];
    let third = &table.entries[2];
    assert!(
        table.entries[..3].iter().all(|e| e.digest.is_some()),
        "three stored chunks first: {:?}",
        &table.entries[..3]
    );
    let mut opts = s3_through(&proxy, 1);
    opts.s3.request_timeout = Some(Duration::from_secs(60));
    let store = Store::open_with(&url, opts).await.unwrap();
    let reader =
        kiln_store::artifact::ArtifactReader::new(store, std::sync::Arc::new(table.clone()))
            .unwrap();
    proxy.stall_requests_containing(b"/chunks/sha256/", Duration::from_secs(120));
    proxy.stall_requests_containing(b".pack HTTP/", Duration::from_secs(120));
    let (from, len) = (
        first.offset,
        (third.offset + third.raw_len - first.offset) as usize,
    );
    let read = tokio::spawn(async move {
        let mut buf = vec![0u8; len];
        reader.read_at(from, &mut buf).await.map(|_| ())
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while proxy.fired() < 3 && Instant::now() < deadline && !read.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fired = proxy.fired();
    read.abort();
    assert_eq!(
        fired, 3,
        "chunk reads in flight at once for a read of three chunks"
    );
}

// ---- concurrent pushers -------------------------------------------------------------------------

async fn concurrent_pushers(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let url = fresh_url(kind, dir.path(), "concurrent");
    // Two artifacts sharing their first 3 MiB.
    let a = dir.path().join("a.img");
    let b = dir.path().join("b.img");
    let a_bytes = write_artifact(&a, 21);
    let mut b_bytes = a_bytes[..3 << 20].to_vec();
    b_bytes.extend(kiln_tests::stores::test_bytes(99, 3 << 20));
    std::fs::write(&b, &b_bytes).unwrap();

    // Four processes at once: two per artifact, all also racing for one shared tag.
    let spawn = |file: &std::path::Path, tag: &str| {
        std::process::Command::new(PUSHER)
            .args(["import", &file.to_string_lossy(), tag, &url])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let kids = vec![
        spawn(&a, "img:a"),
        spawn(&b, "img:b"),
        spawn(&a, "img:latest"),
        spawn(&b, "img:latest"),
    ];
    let mut manifests = Vec::new();
    for k in kids {
        let out = k.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        manifests.push(parse_pusher(&out.stdout).0);
    }
    assert_eq!(manifests[0], manifests[2]);
    assert_eq!(manifests[1], manifests[3]);
    let store = Store::open(&url).await.unwrap();
    assert_eq!(assert_no_dangling_tag(&store).await, 3);
    let latest = store
        .resolve_tag(&"img:latest".parse().unwrap())
        .await
        .unwrap()
        .to_string();
    assert!(latest == manifests[0] || latest == manifests[1]);
    // The history records both moves of the shared tag.
    let hist = store
        .tag_history(&"img:latest".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(hist.len(), 2, "{hist:?}");
    for (tag, want) in [("img:a", &a_bytes), ("img:b", &b_bytes)] {
        let d = store.resolve_tag(&tag.parse().unwrap()).await.unwrap();
        let Manifest::Image(m) = store.get_manifest(&d).await.unwrap() else {
            panic!("not an image")
        };
        let dest = dir.path().join(format!("{tag}.out").replace(':', "-"));
        store.materialize(&m.disk, &dest, None).await.unwrap();
        assert!(std::fs::read(&dest).unwrap() == *want, "{tag} differs");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_pushers_of_overlapping_content_local() {
    concurrent_pushers(Kind::Local).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_pushers_of_overlapping_content_s3() {
    concurrent_pushers(Kind::S3).await;
}

// ---- GC during a push ---------------------------------------------------------------------------

/// Opens `url` with its raw backend behind a pause injector holding the writer after `k` writes.
async fn paused_store(
    url: &str,
    k: u64,
) -> (Store, std::sync::Arc<kiln_tests::crash::CrashAfterWrites>) {
    use kiln_store::backend::StoreUrl;
    use kiln_store::backend::local::LocalBackend;
    use kiln_store::backend::s3::{S3Backend, S3Options};
    let inner: std::sync::Arc<dyn Backend> = match StoreUrl::parse(url).unwrap() {
        StoreUrl::Local(p) => std::sync::Arc::new(LocalBackend::open(&p).await.unwrap()),
        StoreUrl::S3 { bucket, prefix } => {
            std::sync::Arc::new(S3Backend::open(&bucket, &prefix, &S3Options::from_env()).unwrap())
        }
    };
    let gate = std::sync::Arc::new(kiln_tests::crash::CrashAfterWrites::pause_after(inner, k));
    let store = Store::from_backend(gate.clone(), kiln_store::StoreOptions::default());
    (store, gate)
}

/// GC with no grace period runs while a push (`kiln store push`'s copy) is held mid-way; the
/// push's lease must keep everything it relies on, and GC must still delete a real orphan.
async fn gc_during_push(kind: Kind) {
    use kiln_store::gc::GcOptions;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.img");
    let bytes = write_artifact(&file, 31);
    let src = Store::open(&fresh_url(Kind::Local, dir.path(), "src"))
        .await
        .unwrap();
    import_with(&src, &file, "img:v1").await.unwrap();

    let url = fresh_url(kind, dir.path(), "dst");
    let direct = Store::open(&url).await.unwrap();
    // An orphan chunk, and half of the artifact's chunks already present (found, not uploaded:
    // the lease must cover those too).
    let (orphan, _) = direct
        .put_chunk(bytes::Bytes::from_static(b"orphan chunk"))
        .await
        .unwrap();
    let digest = src.resolve_tag(&"img:v1".parse().unwrap()).await.unwrap();
    let Manifest::Image(m) = src.get_manifest(&digest).await.unwrap() else {
        panic!("not an image")
    };
    let all = m.disk.chunk_digests();
    for d in all.iter().step_by(2) {
        let stored = src.get_chunk_stored(d).await.unwrap();
        direct
            .backend()
            .put_if_absent(&d.key(), stored, None)
            .await
            .unwrap();
    }

    // Hold the push after its 5th write (the lease is the first).
    let (dst, gate) = paused_store(&url, 5).await;
    let push = tokio::spawn(async move {
        kiln_store::copy::copy_tag(&src, &dst, &"img:v1".parse().unwrap(), &Default::default())
            .await
    });
    gate.reached().await;
    let report = direct
        .gc(&GcOptions {
            grace: std::time::Duration::ZERO,
            ..GcOptions::default()
        })
        .await
        .unwrap();
    let deleted: Vec<&str> = report.collected.iter().map(|c| c.key.as_str()).collect();
    assert!(
        deleted.contains(&orphan.digest.key().as_str()),
        "orphan kept: {deleted:?}"
    );
    assert_eq!(
        deleted.len(),
        1,
        "GC deleted what the push relies on: {deleted:?}"
    );
    gate.resume();
    push.await.unwrap().unwrap();

    let r = direct.verify(true, &GcOptions::default()).await.unwrap();
    assert!(r.is_ok(), "{:?}", r.findings);
    assert_eq!(r.chunks, all.len());
    assert_whole(&url, "img:v1", &bytes, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_during_push_keeps_leased_objects_local() {
    gc_during_push(Kind::Local).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_during_push_keeps_leased_objects_s3() {
    gc_during_push(Kind::S3).await;
}

/// The writes an import of `file` under a lease makes to a fresh store of `kind` until
/// `put_artifact` returns (its chunks visible: on the local backend they are staged, then
/// committed by its last write).
async fn writes_of_an_import(kind: Kind, file: &std::path::Path, scratch: &std::path::Path) -> u64 {
    let url = fresh_url(kind, scratch, "count");
    let (store, gate) = paused_store(&url, u64::MAX).await;
    let lease = std::sync::Arc::new(
        store
            .create_lease("count", std::time::Duration::from_secs(600), [])
            .await
            .unwrap(),
    );
    let opts = kiln_store::artifact::PutArtifactOptions {
        lease: Some(lease),
        ..Default::default()
    };
    store.put_artifact(file, &opts).await.unwrap();
    gate.writes()
}

/// The same during an import (chunking a file straight into the store under a lease). The
/// import is held mid-way through its chunks on S3 (each written visible), and right after
/// its chunks became visible on the local backend (staged, then one commit): before then
/// nothing of it is there for GC to find.
async fn gc_during_import(kind: Kind) {
    use kiln_store::gc::GcOptions;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.img");
    let bytes = write_artifact(&file, 41);
    let url = fresh_url(kind, dir.path(), "imp");
    let direct = Store::open(&url).await.unwrap();
    let pause_at = match kind {
        Kind::S3 => 10,
        Kind::Local => writes_of_an_import(kind, &file, dir.path()).await,
    };
    let (store, gate) = paused_store(&url, pause_at).await;
    let f2 = file.clone();
    let import = tokio::spawn(async move {
        let lease = std::sync::Arc::new(
            store
                .create_lease("gc-during-import", std::time::Duration::from_secs(600), [])
                .await?,
        );
        let opts = kiln_store::artifact::PutArtifactOptions {
            lease: Some(lease.clone()),
            ..Default::default()
        };
        let (table, _) = store.put_artifact(&f2, &opts).await?;
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table)))
            .await?;
        lease
            .add([kiln_store::manifest::ObjectRef::Manifest(raw.digest)])
            .await?;
        store.force_tag(&"img:v1".parse()?, raw.digest).await?;
        lease.release().await?;
        Ok::<_, StoreError>(())
    });
    gate.reached().await;
    let report = direct
        .gc(&GcOptions {
            grace: std::time::Duration::ZERO,
            ..GcOptions::default()
        })
        .await
        .unwrap();
    assert!(
        report.collected.is_empty(),
        "GC deleted what the import relies on: {:?}",
        report.collected
    );
    if kind == Kind::Local {
        // Held after the commit: the chunks are there, and were kept.
        let local = kiln_store::backend::local::LocalBackend::open(std::path::Path::new(&url))
            .await
            .unwrap();
        let chunks = local.list("chunks/").await.unwrap().len();
        assert!(chunks > 10, "{chunks} chunks visible at the pause");
    }
    gate.resume();
    import.await.unwrap().unwrap();
    let r = direct.verify(true, &GcOptions::default()).await.unwrap();
    assert!(r.is_ok(), "{:?}", r.findings);
    assert_whole(&url, "img:v1", &bytes, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_during_import_keeps_leased_objects_local() {
    gc_during_import(Kind::Local).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn gc_during_import_keeps_leased_objects_s3() {
    gc_during_import(Kind::S3).await;
}
