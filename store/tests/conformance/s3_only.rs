//! S3 behaviour the local backend has no counterpart for, against the real S3 server
//! (moto): a missing bucket is named; a presence check under a prefix too dense for a
//! listing walk falls back to HEADs.

use super::*;

/// A store URL naming an S3 bucket that does not exist (newcomer review, 2026-11-30): every
/// operation must say the bucket is missing, not "no object at <key>" (which read as if the
/// store were there and merely empty). S3 only: a local store has no bucket.
#[tokio::test]
async fn s3_missing_bucket_is_named() {
    let opts = Fixture::s3("missing-bucket").await.opts;
    let store = Store::open_with("s3://kiln-no-such-bucket/x", opts)
        .await
        .expect("opening does not touch the bucket");
    let put = store
        .put_blob(Bytes::from_static(b"x"))
        .await
        .expect_err("no bucket to write to");
    assert!(
        put.to_string().contains("bucket does not exist"),
        "put: {put}"
    );
    let tag = store
        .get_tag(&"app:v1".parse().expect("tag"))
        .await
        .expect_err("a missing bucket is not an empty store");
    assert!(
        tag.to_string().contains("bucket does not exist"),
        "get_tag: {tag}"
    );
}

/// A presence check under a prefix too dense for a listing walk answers right, and the
/// handle then heads that prefix's small groups instead of paying two listing pages each
/// time ([`kiln_store::store::LIST_DENSE_RETRY`]); a fresh handle walks again. The prefix:
/// 2,500 loose blobs, so a page of 1,000 keys spans about 40% of the key space; the group:
/// 16 absent blobs one sixteenth of the key space apart, so two pages answer for at most
/// 14 of them, fewer than 8 a page, and the walk gives up. S3 only: the local backend never
/// lists for presence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_a_dense_prefix_is_headed_after_one_walk() {
    use futures::StreamExt;
    let f = Fixture::s3("dense-prefix").await;
    let present: Vec<ObjectRef> = futures::stream::iter(0..2500u32)
        .map(|i| {
            let s = f.store.clone();
            async move {
                let b = s.put_blob(Bytes::from(format!("blob {i}"))).await.unwrap();
                ObjectRef::Blob(b.digest)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let spread = |n: u8| -> Vec<ObjectRef> {
        (0..16u8)
            .map(|i| {
                let mut h = [n; 32];
                h[0] = (i << 4) | 1;
                ObjectRef::Blob(kiln_store::BlobDigest(kiln_store::digest::Sha256Hash(h)))
            })
            .collect()
    };
    // (listing requests, HEADs, retries) of one look-up, whose answers are checked. A
    // request the retry layer sent again is on the wire twice: moto answers a LIST with a
    // 500 when another test deletes a key of the shared bucket meanwhile (`Retrying`), so
    // each count may exceed its expected value by the retries.
    let ask = |s: Store, objs: Vec<ObjectRef>, want: bool| async move {
        let (before, retries) = (s.metrics().wire, s.metrics().retries);
        let found = s.exist(&objs).await.unwrap();
        assert_eq!(found, vec![want; objs.len()]);
        let w = s.metrics().wire;
        (
            w.lists - before.lists,
            w.heads - before.heads,
            s.metrics().retries - retries,
        )
    };
    let s = f.reopen().await;
    let (lists, heads, r) = ask(s.clone(), spread(1), false).await;
    assert!(
        (2..=2 + r).contains(&lists),
        "the first walk lists two pages and gives up: {lists} listings, {r} retries"
    );
    assert!(
        (2..=10 + r).contains(&heads),
        "{heads} HEADs after the walk"
    );
    for (objs, want, what) in [
        (spread(2), false, "the same handle heads the next group"),
        (present[..16].to_vec(), true, "and a group that is there"),
    ] {
        let (lists, heads, r) = ask(s.clone(), objs, want).await;
        assert_eq!(lists, 0, "{what}");
        assert!((16..=16 + r).contains(&heads), "{what}: {heads} HEADs");
    }
    let (lists, _, r) = ask(f.reopen().await, spread(3), false).await;
    assert!(
        (2..=2 + r).contains(&lists),
        "a fresh handle walks again: {lists} listings, {r} retries"
    );
}
