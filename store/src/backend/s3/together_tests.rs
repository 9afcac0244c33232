//! [`Backend::pack_together`] on the test S3 server (a bucket of its own): chunks an upload
//! spread over two packs, some of them packed together in a given order, are one new pack
//! holding exactly those in that order, which serves them (it is the smaller) and is read
//! with one ranged GET; every chunk still reads right; verify is clean and counts the old
//! copies as dead bytes; a larger copy serves nothing and the next compaction retires it;
//! and once nothing references the chunks, GC takes every copy and the packs go.

use std::collections::HashMap;

use super::fault_tests::{fresh_bucket, s3_options};
use super::*;
use crate::artifact::PutArtifactOptions;
use crate::chunk::Chunking;
use crate::gc::GcOptions;
use crate::manifest::{ImageManifest, Manifest};
use crate::test_support::random_bytes;
use crate::{ChunkDigest, Store, StoreOptions, TagRef};

/// A backend on `bucket`/`prefix` whose packs close at `target` bytes.
fn open(bucket: &str, prefix: &str, target: u64) -> S3Backend {
    let opts = S3Options {
        pack_target: Some(target),
        ..s3_options()
    };
    S3Backend::open(bucket, prefix, &opts).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_packed_together_are_one_new_pack_in_order_and_gc_takes_every_copy() {
    let bucket = fresh_bucket();
    let prefix = format!("together-{}", std::process::id());
    // Packs close at 300 KiB: ten incompressible 64 KiB chunks (65.5 KiB stored) go up in
    // two packs of five.
    let target = 300 << 10;
    let s3 = Arc::new(open(&bucket, &prefix, target));
    let store = Store::from_backend(s3.clone(), StoreOptions::default());
    let data = random_bytes(1, 10 << 16);
    let (table, _) = store
        .put_artifact_reader(
            std::io::Cursor::new(data.clone()),
            &PutArtifactOptions {
                chunking: Some(Chunking::MEMORY_DEFAULT),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(table.entries.len(), 10);
    let manifest = store
        .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
        .await
        .unwrap();
    let tag = TagRef::new("together", "v1").unwrap();
    store.set_tag(&tag, None, manifest.digest).await.unwrap();

    // Where the upload put each chunk: two packs of five.
    let mut by_pack: HashMap<Arc<str>, Vec<ChunkDigest>> = HashMap::new();
    for e in &table.entries {
        let d = e.digest.unwrap();
        let pack = s3.view().map[&d.0].pack.clone();
        by_pack.entry(pack).or_default().push(d);
    }
    let packs: Vec<Vec<ChunkDigest>> = by_pack.into_values().collect();
    assert_eq!(
        packs.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![5, 5],
        "{packs:?}"
    );
    let (a, b) = (&packs[0], &packs[1]);
    // Two of each, interleaved; one given twice (written once, where it first comes).
    let chosen = vec![b[3], a[0], b[1], a[4]];
    let mut asked = chosen.clone();
    asked.push(a[0]);
    let stored: Vec<Bytes> =
        futures::future::try_join_all(chosen.iter().map(|d| store.get_chunk_stored(d)))
            .await
            .unwrap();
    let together = store.pack_together(&asked).await.unwrap();
    assert_eq!(together.packs.len(), 1, "{together:?}");
    assert_eq!(together.chunks, 4);
    let want_bytes: Vec<u8> = stored.iter().flat_map(|b| b.iter().copied()).collect();
    assert_eq!(together.bytes, want_bytes.len() as u64);
    let name = together.packs[0].clone();

    // The new pack holds exactly those, in that order.
    let idx = s3.get_raw(&idx_key(&name)).await.unwrap();
    let mut entries = decode_index(&idx).unwrap();
    entries.sort_by_key(|e| e.offset);
    assert_eq!(
        entries.iter().map(|e| e.digest).collect::<Vec<_>>(),
        chosen.iter().map(|d| d.0).collect::<Vec<_>>()
    );
    let pack = s3.get_raw(&pack_key(&name)).await.unwrap();
    assert_eq!(&pack[..], &want_bytes[..]);

    // Another process serves the four from it (the smaller pack), and reads them with one
    // listing of its dead markers and one ranged GET.
    let other = open(&bucket, &prefix, target);
    other.refresh(Instant::now()).await.unwrap();
    for e in &table.entries {
        let d = e.digest.unwrap();
        let serving = other.view().map[&d.0].pack.to_string();
        assert_eq!(serving == name, chosen.contains(&d), "{d}");
    }
    let other = Store::from_backend(Arc::new(other), StoreOptions::default());
    let before = other.backend().wire_requests();
    let asked_raw: Vec<(ChunkDigest, u64)> = chosen.iter().map(|d| (*d, 1 << 16)).collect();
    for r in other.get_chunks(&asked_raw).await {
        r.unwrap();
    }
    let after = other.backend().wire_requests();
    assert_eq!(
        (after.gets - before.gets, after.lists - before.lists),
        (1, 1)
    );
    // Every chunk reads right.
    let all: Vec<(ChunkDigest, u64)> = table
        .entries
        .iter()
        .map(|e| (e.digest.unwrap(), e.raw_len))
        .collect();
    for (e, r) in table.entries.iter().zip(other.get_chunks(&all).await) {
        let at = e.offset as usize..(e.offset + e.raw_len) as usize;
        assert_eq!(&r.unwrap()[..], &data[at]);
    }

    // Verify is clean; the old copies of the four are dead bytes.
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
    assert_eq!(v.pack_dead_bytes, together.bytes);

    // A copy in a pack larger than the ones holding them (written by a process whose packs
    // close at 1 MiB) serves nothing: dead bytes, and retired by the next compaction (GC
    // with the tag in place takes nothing else).
    let keys: Vec<ChunkDigest> = all.iter().map(|(d, _)| *d).collect();
    let big = Store::from_backend(
        Arc::new(open(&bucket, &prefix, 1 << 20)),
        StoreOptions::default(),
    )
    .pack_together(&keys)
    .await
    .unwrap();
    assert_eq!((big.packs.len(), big.chunks), (1, 10));
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
    assert_eq!(v.pack_dead_bytes, together.bytes + big.bytes);
    let no_grace = GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    };
    let r = store.gc(&no_grace).await.unwrap();
    assert!(r.collected.is_empty(), "{r:?}");
    assert_eq!(r.compacted.packs, 1, "{r:?}");
    let left: Vec<String> = s3
        .list_raw("packs/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert!(!left.iter().any(|k| k.contains(&big.packs[0])), "{left:?}");
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
    assert_eq!(v.pack_dead_bytes, together.bytes);

    // Untagged, everything goes: each chunk dead in every pack holding it, every pack
    // retired, no fossil left, verify clean.
    store.untag(&tag, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = store.gc(&no_grace).await.unwrap();
    assert_eq!(r.compacted.packs, 3, "{r:?}");
    for prefix in ["chunks/", "manifests/", "fossil/", "packs/"] {
        let left = store.backend().list(prefix).await.unwrap();
        assert!(left.is_empty(), "{prefix}: {left:?}");
    }
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
    assert_eq!(v.pack_dead_bytes, 0);
}

/// A key that is not a chunk's is refused, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packing_together_refuses_a_key_that_is_not_a_chunks() {
    let bucket = fresh_bucket();
    let s3 = open(&bucket, "together-refused", PACK_TARGET);
    let e = s3
        .pack_together(&["blobs/sha256/00".to_string()])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not a chunk's key"), "{e}");
    assert!(s3.list_raw("packs/").await.unwrap().is_empty());
}

/// A push of a snapshot to S3 ([`crate::copy::copy_tag`]) writes its prefetch list's chunks
/// again into a pack of their own, in the chunk server's fetch order (the disk's first), which
/// serves them; pushing it again, the manifest already there, writes no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_packs_a_snapshots_prefetch_list_in_fetch_order_once() {
    use crate::manifest::{PrefetchList, SCHEMA_VERSION, SNAPSHOT_MEDIA_TYPE, SnapshotManifest};
    let dir = tempfile::tempdir().unwrap();
    let local = Store::open_dir(dir.path()).await.unwrap();
    let memory_opts = PutArtifactOptions {
        chunking: Some(Chunking::MEMORY_DEFAULT),
        ..Default::default()
    };
    let data = random_bytes(1, 12 << 16);
    let (memory, _) = local
        .put_artifact_reader(std::io::Cursor::new(data[..8 << 16].to_vec()), &memory_opts)
        .await
        .unwrap();
    let (disk, _) = local
        .put_artifact_reader(std::io::Cursor::new(data[8 << 16..].to_vec()), &memory_opts)
        .await
        .unwrap();
    let image = local
        .put_manifest(&Manifest::Image(ImageManifest::new(disk.clone())))
        .await
        .unwrap();
    let blob = |b: &'static [u8]| local.put_blob(Bytes::from_static(b));
    let snap = SnapshotManifest {
        schema_version: SCHEMA_VERSION,
        media_type: SNAPSHOT_MEDIA_TYPE.to_string(),
        memory: memory.clone(),
        vmstate: blob(b"vmstate").await.unwrap(),
        disk: disk.clone(),
        compatibility_key: "qemu=10.0.2".into(),
        image: image.digest,
        kernel: blob(b"vmlinux").await.unwrap(),
        initramfs: blob(b"initrd").await.unwrap(),
        vcpus: 1,
        memory_bytes: 8 << 16,
        prefetch: Some(PrefetchList {
            memory: vec![5, 1],
            disk: vec![2, 0, 3],
        }),
    };
    let raw = local.put_manifest(&Manifest::Snapshot(snap)).await.unwrap();
    let tag = TagRef::new("snap", "v1").unwrap();
    local.set_tag(&tag, None, raw.digest).await.unwrap();

    let bucket = fresh_bucket();
    let prefix = "together-push";
    let s3 = Arc::new(open(&bucket, prefix, PACK_TARGET));
    let remote = Store::from_backend(s3.clone(), StoreOptions::default());
    let opts = crate::copy::CopyOptions::default();
    crate::copy::copy_tag(&local, &remote, &tag, &opts)
        .await
        .unwrap();
    let d = |t: &crate::ChunkTable, i: usize| t.entries[i].digest.unwrap().0;
    let want = vec![
        d(&disk, 2),
        d(&disk, 0),
        d(&disk, 3),
        d(&memory, 5),
        d(&memory, 1),
    ];
    let packs = || async {
        let other = open(&bucket, prefix, PACK_TARGET);
        other.refresh(Instant::now()).await.unwrap();
        let v = other.view();
        let mut packs: Vec<(String, Vec<Sha256Hash>, usize)> = v
            .packs
            .values()
            .map(|p| {
                let mut e = p.entries.clone();
                e.sort_by_key(|e| e.offset);
                let serving = e.iter().filter(|e| v.map[&e.digest].pack == p.name).count();
                (
                    p.name.to_string(),
                    e.iter().map(|e| e.digest).collect(),
                    serving,
                )
            })
            .collect();
        packs.sort_by_key(|(_, e, _)| e.len());
        packs
    };
    // The push's own pack (all twelve) and the prefetch pack, which serves its five.
    let first = packs().await;
    assert_eq!(
        first
            .iter()
            .map(|(_, e, s)| (e.len(), *s))
            .collect::<Vec<_>>(),
        vec![(5, 5), (12, 7)]
    );
    assert_eq!(first[0].1, want);
    crate::copy::copy_tag(&local, &remote, &tag, &opts)
        .await
        .unwrap();
    let again = packs().await;
    assert_eq!(
        again.iter().map(|(n, _, _)| n).collect::<Vec<_>>(),
        first.iter().map(|(n, _, _)| n).collect::<Vec<_>>()
    );
    let v = remote.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{v:?}");
}
