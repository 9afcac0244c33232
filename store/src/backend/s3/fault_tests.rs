//! The S3 backend's calls on many objects against answers the test server (moto) never
//! gives, injected by a [`Tamper`] in the backend's HTTP client: a DeleteObjects answer
//! garbled on its way back (naming a key that was not asked, or not XML at all), and one
//! that says `NoSuchKey` for keys that are absent (what some S3-compatible servers answer,
//! where S3 says "Deleted"); a process killed at each request of a GC run in turn; and a
//! server that fails one write in k, before or after acting on it. GC's condemn and delete
//! phases (`Backend::rename_many`, `Backend::delete_many`) must come through each with every
//! object accounted for: a store verify calls clean, no fossil left, the garbage gone.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::artifact::PutArtifactOptions;
use crate::gc::GcOptions;
use crate::manifest::{ImageManifest, Manifest};
use crate::{Store, StoreOptions};

/// The test server's options, from the environment (as the conformance suite reads it).
pub(super) fn s3_options() -> S3Options {
    let endpoint = std::env::var("KILN_TEST_S3_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "KILN_TEST_S3_ENDPOINT is not set: run ci/setup.sh and source \
             /var/cache/kiln-ci/env (S3 tests never skip)"
        )
    });
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    S3Options {
        endpoint: Some(endpoint),
        allow_http: Some(true),
        region: Some(var("AWS_REGION", "us-east-1")),
        access_key_id: Some(var("AWS_ACCESS_KEY_ID", "kiln-test")),
        secret_access_key: Some(var("AWS_SECRET_ACCESS_KEY", "kiln-test")),
        ..S3Options::default()
    }
}

/// A new bucket of the test S3 server, for one store of these tests, created with a plain
/// `PUT /<bucket>` (S3 API reference, CreateBucket; moto takes it unsigned). These tests
/// delete many objects at once (DeleteObjects), and moto answers a listing of a bucket with a
/// 500 when a key it lists is deleted meanwhile: in the shared test bucket, another test's
/// listing, or this test's own checks, failed so (seen in CI: `gc_killed_at_every_request…`,
/// "HTTP 500 Internal Server Error" listing `blobs/`). A bucket per store keeps each store's
/// deletes out of every other listing, other tests' and the kill points run side by side, as
/// `vm_lazy` does (`kiln_tests::stores::fresh_bucket_url`).
pub(super) fn fresh_bucket() -> String {
    use std::io::{Read, Write};
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let endpoint = s3_options().endpoint.expect("endpoint");
    let host = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        % 1_000_000_000_000;
    // Bucket names: 3 to 63 lowercase letters, digits and hyphens.
    let bucket = format!("kiln-f-{}-{nanos}-{n}", std::process::id());
    let mut s = std::net::TcpStream::connect(&host)
        .unwrap_or_else(|e| panic!("S3 test server {host}: {e}: run ci/setup.sh"));
    write!(
        s,
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200"),
        "creating bucket {bucket} on {host}: {}",
        reply.lines().next().unwrap_or("")
    );
    bucket
}

/// A backend in a bucket of its own ([`fresh_bucket`]) whose HTTP client goes through
/// `tamper`; returns it, its bucket and its prefix.
fn tampered(test: &str, tamper: Arc<Tamper>) -> (S3Backend, String, String) {
    let bucket = fresh_bucket();
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let prefix = format!("s3-faults-{}-{run}/{test}", std::process::id());
    let b = S3Backend::open_tampered(&bucket, &prefix, &s3_options(), tamper).unwrap();
    (b, bucket, prefix)
}

/// Whether `req` is a DeleteObjects request (`POST /?delete`).
fn is_delete_objects(req: &HttpRequest) -> bool {
    req.method() == reqwest::Method::POST && req.uri().query().is_some_and(|q| q.contains("delete"))
}

/// The keys a DeleteObjects request asks for (its body's `<Key>` elements, bucket prefix
/// included).
fn asked(req: &HttpRequest) -> Vec<String> {
    let body = req
        .body()
        .as_bytes()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default();
    body.split("<Key>")
        .skip(1)
        .filter_map(|s| s.split("</Key>").next())
        .map(str::to_string)
        .collect()
}

/// A DeleteObjects answer (200) with an `<Error>` of `code` for each of `keys`.
fn errors_for(keys: &[String], code: &str) -> String {
    let mut body = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
         <DeleteResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">",
    );
    for k in keys {
        body.push_str(&format!(
            "<Error><Key>{k}</Key><Code>{code}</Code><Message>injected</Message></Error>"
        ));
    }
    body.push_str("</DeleteResult>");
    body
}

/// Puts garbage in `s` (an image manifest no tag names, its chunks packed, a loose blob),
/// waits out S3's one-second times, and runs GC with no grace: returns the run's result.
async fn gc_over_garbage(s: &Store) -> Result<crate::gc::GcReport, crate::StoreError> {
    let data = crate::test_support::random_bytes(1, 400_000);
    let (table, _) = s
        .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
        .await
        .unwrap();
    assert!(!table.chunk_digests().is_empty());
    s.put_manifest(&Manifest::Image(ImageManifest::new(table)))
        .await
        .unwrap();
    s.put_blob(Bytes::from_static(b"stray blob")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    s.gc(&GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    })
    .await
}

/// Asserts `s` holds nothing GC should have taken: no chunk, blob, manifest or fossil, and
/// verify finds nothing.
async fn assert_swept(s: &Store) {
    for prefix in ["chunks/", "blobs/", "manifests/", "fossil/"] {
        let left = s.backend().list(prefix).await.unwrap();
        assert!(left.is_empty(), "{prefix}: {left:?}");
    }
    let v = s.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
}

/// A DeleteObjects answer garbled on its way back (the deletes done by the server) must
/// fail its keys as a lost reply, for the retry wrapper to delete them one by one, not stop
/// GC: before, an answer naming a key that was not asked made object_store panic
/// (`find_position(..).unwrap()` in its DeleteObjects reader), taking the process down in
/// GC's condemn step, and an answer that is not XML failed every key for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_comes_through_garbled_delete_objects_answers() {
    for (name, garble) in [("not-asked", 0), ("not-xml", 1), ("cut-short", 2)] {
        let garbled = Arc::new(AtomicUsize::new(0));
        let g = garbled.clone();
        let prefix_of_bucket = Arc::new(std::sync::OnceLock::<String>::new());
        let p = prefix_of_bucket.clone();
        let tamper: Arc<Tamper> = Arc::new(move |req: &HttpRequest| {
            if !is_delete_objects(req) {
                return Tampered::Pass;
            }
            // Every other one, so that a key retried alone gets through.
            if g.fetch_add(1, Ordering::SeqCst) % 2 == 1 {
                return Tampered::Pass;
            }
            let body = match garble {
                0 => errors_for(
                    &[format!(
                        "{}/not-asked",
                        p.get().cloned().unwrap_or_default()
                    )],
                    "AccessDenied",
                ),
                1 => "<html><body>502 Bad Gateway</body></html>".to_string(),
                _ => "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult xmlns=\"http"
                    .to_string(),
            };
            Tampered::Garbled { status: 200, body }
        });
        let (b, _, prefix) = tampered(name, tamper);
        prefix_of_bucket.set(prefix).unwrap();
        let s = Store::from_backend(Arc::new(b), StoreOptions::default());
        let r = gc_over_garbage(&s).await;
        let r = r.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            garbled.load(Ordering::SeqCst) > 0,
            "{name}: no DeleteObjects request was made"
        );
        assert!(
            r.condemned > 0 && r.collected.len() == r.condemned,
            "{name}: {r:?}"
        );
        assert_swept(&s).await;
    }
}

/// `Backend::delete_many` says absent is not an error: a server that answers DeleteObjects
/// with `NoSuchKey` for a key that is not there (S3 itself says "Deleted") must not fail
/// the key (before: a final error, so a GC phase, or a compaction deleting markers, stopped
/// on a key that was already gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_many_takes_no_such_key_as_deleted() {
    let tamper: Arc<Tamper> = Arc::new(|req: &HttpRequest| {
        if !is_delete_objects(req) {
            return Tampered::Pass;
        }
        Tampered::Garbled {
            status: 200,
            body: errors_for(&asked(req), "NoSuchKey"),
        }
    });
    let (b, _, _) = tampered("no-such-key", tamper);
    let keys: Vec<String> = [
        "fossil/blobs/sha256/aa",
        "fossil/chunks/sha256/bb",
        "chunks/sha256/cc",
    ]
    .iter()
    .map(|k| k.to_string())
    .collect();
    for (k, r) in keys.iter().zip(b.delete_many(&keys).await) {
        assert!(r.is_ok(), "{k}: {r:?}");
    }
    // And through GC: its fossils' deletes and its moves' deletes of loose sources.
    let s = Store::from_backend(Arc::new(b), StoreOptions::default());
    let r = gc_over_garbage(&s).await.unwrap();
    assert!(r.condemned > 0 && r.collected.len() == r.condemned, "{r:?}");
    assert_swept(&s).await;
}

/// A store on a fresh prefix whose process is "killed" at a request: from request `limit`
/// on (counted in `sent`, from 0), nothing is sent and every request is refused (403
/// AccessDenied, a final failure, so nothing is retried): what was sent before is done,
/// nothing after. Returns the store, its backend, its URL, `sent` and `limit`.
struct Killable {
    store: Store,
    backend: Arc<S3Backend>,
    url: String,
    sent: Arc<AtomicUsize>,
    limit: Arc<AtomicUsize>,
    /// Whether a DeleteObjects request naming a fossil was sent (GC's second phase began).
    fossils_deleted: Arc<std::sync::atomic::AtomicBool>,
}

fn killable(test: &str) -> Killable {
    let sent = Arc::new(AtomicUsize::new(0));
    let limit = Arc::new(AtomicUsize::new(usize::MAX));
    let fossils_deleted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s2, l2, f2) = (sent.clone(), limit.clone(), fossils_deleted.clone());
    let tamper: Arc<Tamper> = Arc::new(move |req: &HttpRequest| {
        if s2.fetch_add(1, Ordering::SeqCst) < l2.load(Ordering::SeqCst) {
            if is_delete_objects(req) && asked(req).iter().any(|k| k.contains("/fossil/")) {
                f2.store(true, Ordering::SeqCst);
            }
            return Tampered::Pass;
        }
        Tampered::Refused {
            status: 403,
            body: "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AccessDenied</Code>\
                   <Message>killed</Message></Error>"
                .to_string(),
        }
    });
    let (b, bucket, prefix) = tampered(test, tamper);
    let backend = Arc::new(b);
    Killable {
        store: Store::from_backend(backend.clone(), StoreOptions::default()),
        backend,
        url: format!("s3://{bucket}/{prefix}"),
        sent,
        limit,
        fossils_deleted,
    }
}

/// Puts in `s` an image a tag keeps, and garbage: an image no tag names (its chunks
/// packed, one of them also a loose object, as two writers leave it) and a loose blob.
async fn live_and_garbage(k: &Killable) {
    let s = &k.store;
    // Image `seed` is `bytes` from offset `seed` on: the two images are the same bytes one
    // byte apart.
    let bytes = crate::test_support::random_bytes(1, 300_002);
    let bytes = &bytes;
    let put = |seed: usize| async move {
        let data = bytes[seed..seed + 300_000].to_vec();
        let (table, _) = s
            .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
            .await
            .unwrap();
        let raw = s
            .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
            .await
            .unwrap();
        (raw.digest, table)
    };
    let (kept, _) = put(1).await;
    s.set_tag(&"keep:v1".parse().unwrap(), None, kept)
        .await
        .unwrap();
    let (_, dropped) = put(2).await;
    let both = dropped.chunk_digests()[0].key();
    let stored = k.backend.get(&both).await.unwrap();
    k.backend.put_raw(&both, stored).await.unwrap();
    s.put_blob(Bytes::from_static(b"stray blob")).await.unwrap();
}

/// GC on S3 killed at each of its requests in turn (its batched moves' fossil writes, dead
/// markers and DeleteObjects, its fossil deletes, its compaction): the store it leaves is
/// one verify calls clean, and the next GC (the dead one's lock taken over) sweeps every
/// piece of garbage and every fossil, the kept image whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_killed_at_every_request_leaves_a_clean_store_the_next_gc_sweeps() {
    let opts = GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    };
    // A whole run's requests, counted.
    let whole = killable("whole");
    live_and_garbage(&whole).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    whole.sent.store(0, Ordering::SeqCst);
    whole.store.gc(&opts).await.unwrap();
    let total = whole.sent.load(Ordering::SeqCst);
    assert!(total > 10, "{total} requests");
    // One store per kill point, all made before the one wait for S3's clock.
    let mut runs = Vec::new();
    for n in 0..total {
        let k = killable(&format!("killed-at-{n}"));
        live_and_garbage(&k).await;
        let mut objects = Vec::new();
        for prefix in ["chunks/", "blobs/", "manifests/"] {
            objects.extend(
                k.backend
                    .list(prefix)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|o| o.key),
            );
        }
        runs.push((n, k, objects));
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Four kill points at a time (each its own store): the server's time per request is
    // most of it.
    futures::stream::iter(runs)
        .for_each_concurrent(4, |(n, k, objects)| {
            let opts = &opts;
            async move {
                k.sent.store(0, Ordering::SeqCst);
                k.limit.store(n, Ordering::SeqCst);
                let killed = k.store.gc(opts).await;
                let after = Store::open_with(
                    &k.url,
                    StoreOptions {
                        s3: s3_options(),
                        ..StoreOptions::default()
                    },
                )
                .await
                .unwrap();
                let v = after.verify(true, &GcOptions::default()).await.unwrap();
                assert!(
                    v.is_ok(),
                    "killed at request {n} of {total} ({killed:?}): {v:?}"
                );
                // Until the second phase deletes fossils, a move leaves every object under its key
                // or its fossil key, or both, never neither (garbage included: the order of the
                // writes is what a writer relying on the object needs).
                if !k.fossils_deleted.load(Ordering::SeqCst) {
                    for key in &objects {
                        let here = after.backend().head(key).await.unwrap().is_some();
                        let fossil = after
                            .backend()
                            .head(&crate::gc::fossil_key(key))
                            .await
                            .unwrap()
                            .is_some();
                        assert!(
                            here || fossil,
                            "killed at request {n} of {total}: {key} is gone, its fossil too"
                        );
                    }
                }
                // The dead run's lock names this (live) process: taken over as a dead owner's is.
                after
                    .backend()
                    .delete(crate::gc::GC_LOCK_KEY)
                    .await
                    .unwrap();
                after.gc(opts).await.unwrap();
                let v = after.verify(true, &GcOptions::default()).await.unwrap();
                assert!(v.is_ok(), "killed at request {n}, then GC again: {v:?}");
                let left: Vec<String> = after
                    .backend()
                    .list("fossil/")
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|o| o.key)
                    .collect();
                assert!(
                    left.is_empty(),
                    "killed at request {n}, then GC again: {left:?}"
                );
                let blobs = after.backend().list("blobs/").await.unwrap();
                assert!(blobs.is_empty(), "killed at request {n}: {blobs:?}");
                let manifests = after.backend().list("manifests/").await.unwrap();
                assert_eq!(manifests.len(), 1, "killed at request {n}: {manifests:?}");
            }
        })
        .await;
}

/// GC on S3 through a server that fails one write in k (spread over the run), in turn
/// before acting on it (503 SlowDown) and after (a 500 where its answer was: the reply
/// lost), at every stage of
/// the batched moves and deletes: the retry wrapper's one pass and per-key retries finish
/// the run, which leaves a store verify calls clean with every piece of garbage and every
/// fossil gone and the kept image whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_finishes_through_lost_replies_and_refusals_of_one_write_in_k() {
    let mut runs = Vec::new();
    for every in [3usize, 5, 8] {
        let count = Arc::new(AtomicUsize::new(0));
        let on = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, o) = (count.clone(), on.clone());
        let tamper: Arc<Tamper> = Arc::new(move |req: &HttpRequest| {
            if !o.load(Ordering::SeqCst) || req.method() == reqwest::Method::GET {
                return Tampered::Pass;
            }
            // Writes only (PUT, POST, DELETE): the fossils, markers and DeleteObjects.
            // Spread, not periodic, so that a call made of several writes gets through
            // on some attempt.
            let n = c.fetch_add(1, Ordering::SeqCst) + 1;
            if (n.wrapping_mul(2_654_435_761) >> 7) % every != 0 {
                return Tampered::Pass;
            }
            let body = |code: &str| {
                format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
                     <Message>injected</Message></Error>"
                )
            };
            if (n.wrapping_mul(2_654_435_761) >> 11) % 2 == 0 {
                Tampered::Refused {
                    status: 503,
                    body: body("SlowDown"),
                }
            } else {
                Tampered::Garbled {
                    status: 500,
                    body: body("InternalError"),
                }
            }
        });
        let (b, _, prefix) = tampered(&format!("every-{every}"), tamper);
        let backend = Arc::new(b);
        let k = Killable {
            store: Store::from_backend(backend.clone(), StoreOptions::default()),
            backend,
            url: prefix,
            sent: count,
            limit: Arc::new(AtomicUsize::new(0)),
            fossils_deleted: Arc::default(),
        };
        live_and_garbage(&k).await;
        runs.push((every, k, on));
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for (every, k, on) in runs {
        on.store(true, Ordering::SeqCst);
        let r = k
            .store
            .gc(&GcOptions {
                grace: Duration::ZERO,
                ..GcOptions::default()
            })
            .await
            .unwrap_or_else(|e| panic!("one write in {every} failing: {e}"));
        on.store(false, Ordering::SeqCst);
        assert!(
            k.sent.load(Ordering::SeqCst) >= every,
            "one write in {every}: no fault"
        );
        assert!(r.condemned > 0, "one write in {every}: {r:?}");
        let s = &k.store;
        let v = s.verify(true, &GcOptions::default()).await.unwrap();
        assert!(v.is_ok(), "one write in {every}: {v:?}");
        for prefix in ["fossil/", "blobs/"] {
            let left = s.backend().list(prefix).await.unwrap();
            assert!(left.is_empty(), "one write in {every}: {prefix}: {left:?}");
        }
        let manifests = s.backend().list("manifests/").await.unwrap();
        assert_eq!(manifests.len(), 1, "one write in {every}: {manifests:?}");
    }
}

/// Whether `req` is the PUT of a pack's index (`packs/<name>.idx`).
fn is_index_put(req: &HttpRequest) -> bool {
    req.method() == reqwest::Method::PUT && req.uri().path().ends_with(".idx")
}

/// An S3 error body of `code`.
fn error_body(code: &str) -> String {
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>injected</Message></Error>"
    )
}

/// An upload whose first pack index PUT reaches the server (which stores the index) and
/// whose answer is lost (a 500 in its place), and whose every later index PUT is not sent:
/// refused with a 503 (retried) while `hold` is set, then with a 403 (final), so that the
/// upload fails in its staging and discards its batch. Its packs close at 300 KiB (five
/// 64 KiB chunks zstd cannot shrink), so the first one is sent while chunks are staged.
struct LostIndexAnswer {
    /// The uploading store (its backend behind the tamper, retried every 20 ms).
    store: Store,
    /// A store on the same bucket and prefix, untampered: another writer, or a later reader.
    other: Store,
    /// Index PUTs the upload sent or tried (from 2 on, the first one's answer was received).
    index_puts: Arc<AtomicUsize>,
    /// While set, the index PUTs after the first are refused as transient (the upload retries).
    hold: Arc<std::sync::atomic::AtomicBool>,
}

/// Two handles on one fresh prefix named after `test`, packs closing at 300 KiB (five
/// incompressible 64 KiB chunks): the first through `tamper`, the second untampered.
fn small_packs(test: &str, tamper: Arc<Tamper>) -> (S3Backend, S3Backend) {
    let bucket = fresh_bucket();
    let prefix = format!("s3-faults-{}/{test}", std::process::id());
    let opts = S3Options {
        pack_target: Some(300 << 10),
        ..s3_options()
    };
    (
        S3Backend::open_tampered(&bucket, &prefix, &opts, tamper).unwrap(),
        S3Backend::open(&bucket, &prefix, &opts).unwrap(),
    )
}

fn lost_index_answer(test: &str, hold: bool) -> LostIndexAnswer {
    let index_puts = Arc::new(AtomicUsize::new(0));
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(hold));
    let (n, h) = (index_puts.clone(), hold.clone());
    let tamper: Arc<Tamper> = Arc::new(move |req: &HttpRequest| {
        if !is_index_put(req) {
            return Tampered::Pass;
        }
        if n.fetch_add(1, Ordering::SeqCst) == 0 {
            return Tampered::Garbled {
                status: 500,
                body: error_body("InternalError"),
            };
        }
        if h.load(Ordering::SeqCst) {
            Tampered::Refused {
                status: 503,
                body: error_body("SlowDown"),
            }
        } else {
            Tampered::Refused {
                status: 403,
                body: error_body("AccessDenied"),
            }
        }
    });
    let (b, other) = small_packs(test, tamper);
    let retry = crate::backend::retry::RetryPolicy {
        max_attempts: 10_000,
        base_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(20),
        operation_timeout: Duration::from_secs(60),
    };
    let store = Store::from_backend(
        Arc::new(b),
        StoreOptions {
            retry,
            ..StoreOptions::default()
        },
    );
    LostIndexAnswer {
        store,
        other: Store::from_backend(Arc::new(other), StoreOptions::default()),
        index_puts,
        hold,
    }
}

/// Twelve 64 KiB chunks zstd cannot shrink, and the upload options that cut them so.
fn twelve_chunks() -> (Vec<u8>, PutArtifactOptions) {
    let data = crate::test_support::random_bytes(1, 12 << 16);
    let opts = PutArtifactOptions {
        chunking: Some(crate::chunk::Chunking::MEMORY_DEFAULT),
        ..PutArtifactOptions::default()
    };
    (data, opts)
}

/// A failed upload whose first pack's index reached the server, its answer lost: the
/// index is in the store, so the pack is published, and the discard must not delete it
/// (before, it did: verify then found an index whose pack is missing, `corruptStoreFile`).
/// The store stays clean, and GC takes the pack's chunks as the garbage they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_upload_leaves_a_pack_whose_index_answer_was_lost() {
    let t = lost_index_answer("discard-lost-index", false);
    let (data, opts) = twelve_chunks();
    let r = t
        .store
        .put_artifact_reader(std::io::Cursor::new(data), &opts)
        .await;
    assert!(r.is_err(), "the upload went through: {r:?}");
    assert!(t.index_puts.load(Ordering::SeqCst) >= 2);
    let v = t.other.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
    let packs = t.other.backend().layout_report().await.unwrap().packs;
    assert_eq!(packs, 1, "the pack whose index was stored");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    t.other
        .gc(&GcOptions {
            grace: Duration::ZERO,
            ..GcOptions::default()
        })
        .await
        .unwrap();
    let left = t.other.backend().list("chunks/").await.unwrap();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(t.other.backend().layout_report().await.unwrap().packs, 0);
    let v = t.other.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
}

/// The same lost answer, with another writer uploading the same bytes while the first
/// upload retries: it finds the published pack's chunks present, writes none of them and
/// tags an image naming them. The first upload then fails and discards its batch: the
/// pack must stay (before, the discard deleted it, and the other writer's image lost the
/// chunks it had found present).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_upload_keeps_a_pack_another_writer_found_its_chunks_in() {
    let t = lost_index_answer("discard-relied-on", true);
    let (data, opts) = twelve_chunks();
    let failing = t
        .store
        .put_artifact_reader(std::io::Cursor::new(data.clone()), &opts);
    let other = async {
        // A second index PUT is a retry, sent once the first one's answer came back: the
        // index is stored by then.
        while t.index_puts.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (table, _) = t
            .other
            .put_artifact_reader(std::io::Cursor::new(data.clone()), &opts)
            .await
            .unwrap();
        let m = t
            .other
            .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
            .await
            .unwrap();
        t.other
            .set_tag(&"relied:v1".parse().unwrap(), None, m.digest)
            .await
            .unwrap();
        t.hold.store(false, Ordering::SeqCst);
        table
    };
    let (r, table) = tokio::join!(failing, other);
    assert!(r.is_err(), "the upload went through: {r:?}");
    let wanted: Vec<(crate::ChunkDigest, u64)> = table
        .entries
        .iter()
        .map(|e| (e.digest.unwrap(), e.raw_len))
        .collect();
    assert_eq!(wanted.len(), 12);
    for (e, got) in table.entries.iter().zip(t.other.get_chunks(&wanted).await) {
        let at = e.offset as usize..(e.offset + e.raw_len) as usize;
        let got = got.unwrap_or_else(|err| panic!("chunk at {}: {err}", e.offset));
        assert!(got[..] == data[at], "chunk at {}", e.offset);
    }
    let v = t.other.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
}

/// A pack published (its index PUT answered), then the HEAD of its index that adds it to
/// the view fails for good: the upload fails and discards its batch, and the pack, whose
/// index is in the store, must stay (before, the failed send handed it back to the batch as
/// a pack without its index, and the discard deleted it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_upload_keeps_a_pack_published_before_a_later_request_failed() {
    let heads = Arc::new(AtomicUsize::new(0));
    let h = heads.clone();
    let tamper: Arc<Tamper> = Arc::new(move |req: &HttpRequest| {
        if req.method() != reqwest::Method::HEAD || !req.uri().path().ends_with(".idx") {
            return Tampered::Pass;
        }
        h.fetch_add(1, Ordering::SeqCst);
        Tampered::Refused {
            status: 403,
            body: error_body("AccessDenied"),
        }
    });
    let (b, other) = small_packs("discard-published", tamper);
    let s = Store::from_backend(Arc::new(b), StoreOptions::default());
    let (data, put_opts) = twelve_chunks();
    let r = s
        .put_artifact_reader(std::io::Cursor::new(data), &put_opts)
        .await;
    assert!(r.is_err(), "the upload went through: {r:?}");
    assert!(heads.load(Ordering::SeqCst) > 0);
    let other = Store::from_backend(Arc::new(other), StoreOptions::default());
    let v = other.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
    assert!(other.backend().layout_report().await.unwrap().packs >= 1);
}
