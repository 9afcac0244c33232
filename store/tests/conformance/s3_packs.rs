//! The S3 backend's packs (issue 33), against the real S3 server (moto): a push is one pack
//! and one index; a pack without index is invisible; a damaged index refuses only its
//! chunks; deletes and renames of packed chunks are seen at once; stores of loose chunks
//! still read; batched reads answer as single ones.

use super::*;

/// The keys under `packs/` of an S3 store, by kind (pack, index, dead marker).
async fn pack_objects(s: &Store) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for o in s.backend().list("packs/").await.unwrap() {
        if o.key.contains(".dead/") {
            out.2.push(o.key);
        } else if o.key.ends_with(".idx") {
            out.1.push(o.key);
        } else if o.key.ends_with(".pack") {
            out.0.push(o.key);
        }
    }
    out
}

/// A push to S3 sends its chunks as packs, not one object per chunk: 96 chunks of 64 KiB go
/// up as one pack and one index, none as a loose object; another handle (a second process)
/// reads them, sees them present, and a second push of the same bytes uploads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_hold_a_push_and_other_handles_read_it() {
    let f = Fixture::s3("packs-push").await;
    let data = noise(6 << 20, 81);
    let (m, table) = publish_image(&f.store, &data, Chunking::Fixed { size: 64 << 10 }).await;
    let (packs, idx, dead) = pack_objects(&f.store).await;
    assert_eq!(
        (packs.len(), idx.len(), dead.len()),
        (1, 1, 0),
        "{packs:?} {idx:?}"
    );
    let chunks = table.chunk_digests();
    assert_eq!(chunks.len(), 96);
    let other = f.reopen().await;
    let listed = other.backend().list("chunks/").await.unwrap();
    assert_eq!(listed.len(), 96);
    let Manifest::Image(im) = other.get_manifest(&m).await.unwrap() else {
        panic!("not an image")
    };
    let out = f.tmp("read");
    other.materialize(&im.disk, &out, None).await.unwrap();
    assert!(std::fs::read(&out).unwrap() == data);
    let objs: Vec<ObjectRef> = chunks.iter().map(|d| ObjectRef::Chunk(*d)).collect();
    assert!(other.exist(&objs).await.unwrap().iter().all(|p| *p));
    let (_, stats) = f
        .reopen()
        .await
        .put_artifact_reader(
            std::io::Cursor::new(data.clone()),
            &PutArtifactOptions {
                chunking: Some(Chunking::Fixed { size: 64 << 10 }),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(stats.chunks_transferred, 0);
    assert_eq!(pack_objects(&f.store).await.0.len(), 1);
    let v = other.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{:?}", v.findings);
}

/// A pack with no index (a push killed between its two PUTs) is invisible: its chunks read
/// as absent, no listing shows them, verify is clean, and a compaction leaves it while it is
/// young (its writer may still be uploading).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_a_pack_without_index_is_invisible() {
    let f = Fixture::s3("packs-orphan").await;
    let (m, _) = publish_image(
        &f.store,
        &noise(1 << 20, 82),
        Chunking::Fixed { size: 64 << 10 },
    )
    .await;
    f.store
        .set_tag(&"a:v1".parse().unwrap(), None, m)
        .await
        .unwrap();
    let local = Fixture::local().await;
    let (_, t) = publish_image(
        &local.store,
        &noise(256 << 10, 83),
        Chunking::Fixed { size: 64 << 10 },
    )
    .await;
    let d = t.chunk_digests()[0];
    let stored = local
        .store
        .backend()
        .get(&ObjectRef::Chunk(d).key())
        .await
        .unwrap();
    let b = f.store.backend();
    b.put("packs/crashed-1-0-1.pack", stored).await.unwrap();
    let other = f.reopen().await;
    assert!(!other.has(&ObjectRef::Chunk(d)).await.unwrap());
    assert!(
        other
            .backend()
            .get(&ObjectRef::Chunk(d).key())
            .await
            .unwrap_err()
            .is_not_found()
    );
    let listed = other.backend().list("chunks/").await.unwrap();
    assert!(listed.iter().all(|o| o.key != ObjectRef::Chunk(d).key()));
    let v = other.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{:?}", v.findings);
    let r = other.backend().compact(false, &[]).await.unwrap();
    assert_eq!(r.orphan_files, 0, "a young index-less pack is left alone");
    assert_eq!(pack_objects(&f.store).await.0.len(), 2);
}

/// A damaged or planted index is reported by verify (`corruptStoreFile`) and takes only its
/// own chunks out of service: garbage under an index name, and image b's real index with one
/// byte flipped. Image a stays readable; b's chunks read as absent and verify says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_a_damaged_index_refuses_only_its_chunks() {
    let f = Fixture::s3("packs-damaged").await;
    let chunking = Chunking::Fixed { size: 64 << 10 };
    let a_data = noise(512 << 10, 84);
    let (a, _) = publish_image(&f.store, &a_data, chunking).await;
    let (_, a_idx, _) = pack_objects(&f.store).await;
    let (b, b_table) = publish_image(&f.store, &noise(512 << 10, 85), chunking).await;
    f.store
        .set_tag(&"a:v1".parse().unwrap(), None, a)
        .await
        .unwrap();
    f.store
        .set_tag(&"b:v1".parse().unwrap(), None, b)
        .await
        .unwrap();
    let (_, idx, _) = pack_objects(&f.store).await;
    let b_idx = idx.iter().find(|k| !a_idx.contains(k)).unwrap().clone();
    let be = f.store.backend();
    let mut bytes = be.get(&b_idx).await.unwrap().to_vec();
    bytes[30] ^= 1;
    be.put(&b_idx, Bytes::from(bytes)).await.unwrap();
    be.put(
        "packs/planted-1-0-1.idx",
        Bytes::from_static(b"not an index at all"),
    )
    .await
    .unwrap();
    be.put("packs/planted-1-0-1.pack", Bytes::from_static(b"x"))
        .await
        .unwrap();

    let other = f.reopen().await;
    let v = other.verify(true, &GcOptions::default()).await.unwrap();
    let corrupt: Vec<String> = v
        .findings
        .iter()
        .filter_map(|x| match x {
            Finding::CorruptStoreFile { file, .. } => Some(file.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(corrupt.len(), 2, "{:?}", v.findings);
    assert!(corrupt.iter().any(|c| c.ends_with(&b_idx)), "{corrupt:?}");
    assert!(
        corrupt.iter().any(|c| c.ends_with("planted-1-0-1.idx")),
        "{corrupt:?}"
    );
    let missing = v
        .findings
        .iter()
        .filter(|x| matches!(x, Finding::MissingChunk { .. }))
        .count();
    assert_eq!(missing, b_table.chunk_digests().len(), "{:?}", v.findings);
    let Manifest::Image(im) = other.get_manifest(&a).await.unwrap() else {
        panic!("not an image")
    };
    let out = f.tmp("a");
    other.materialize(&im.disk, &out, None).await.unwrap();
    assert!(std::fs::read(&out).unwrap() == a_data);
    for d in b_table.chunk_digests() {
        assert!(!other.has(&ObjectRef::Chunk(d)).await.unwrap());
    }
}

/// Delete and rename (GC's condemn step) of a packed chunk on S3: afterwards the key is
/// absent for every handle, including one whose view still had it live (the check is
/// fresh); the renamed bytes are at the destination, and a put-back makes the chunk a loose
/// object again, present everywhere. Once every chunk of a pack is deleted, a compaction
/// retires the pack (index, pack, markers).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_delete_and_rename_of_a_packed_chunk() {
    let f = Fixture::s3("packs-delete").await;
    let (_, table) = publish_image(
        &f.store,
        &noise(256 << 10, 86),
        Chunking::Fixed { size: 64 << 10 },
    )
    .await;
    let ds = table.chunk_digests();
    assert_eq!(ds.len(), 4);
    let keys: Vec<String> = ds.iter().map(|d| ObjectRef::Chunk(*d).key()).collect();
    let watcher = f.reopen().await;
    for k in &keys {
        assert!(watcher.backend().head(k).await.unwrap().is_some());
    }
    let stored = f.store.backend().get(&keys[1]).await.unwrap();
    let gcer = f.reopen().await;
    gcer.backend().delete(&keys[0]).await.unwrap();
    gcer.backend()
        .rename(&keys[1], &format!("fossil/{}", keys[1]))
        .await
        .unwrap();
    for s in [&watcher, &gcer, &f.reopen().await] {
        let b = s.backend();
        assert!(b.head(&keys[0]).await.unwrap().is_none());
        assert!(b.get(&keys[0]).await.unwrap_err().is_not_found());
        assert!(b.head(&keys[1]).await.unwrap().is_none());
        let objs = [ObjectRef::Chunk(ds[0]), ObjectRef::Chunk(ds[2])];
        assert_eq!(s.exist(&objs).await.unwrap(), vec![false, true]);
        assert!(b.head(&keys[2]).await.unwrap().is_some());
    }
    assert_eq!(
        f.store
            .backend()
            .get(&format!("fossil/{}", keys[1]))
            .await
            .unwrap(),
        stored
    );
    // GC's put-back: a loose object, read by all.
    assert_eq!(
        gcer.backend()
            .put_if_absent(&keys[1], stored.clone(), None)
            .await
            .unwrap(),
        PutOutcome::Created
    );
    // The put-back (above, by the first handle to try): a loose object, read by all.
    assert_eq!(watcher.backend().get(&keys[1]).await.unwrap(), stored);
    let listed: HashSet<String> = f
        .reopen()
        .await
        .backend()
        .list("chunks/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert_eq!(
        listed,
        [&keys[1], &keys[2], &keys[3]]
            .into_iter()
            .cloned()
            .collect()
    );
    let (_, _, dead) = pack_objects(&f.store).await;
    assert_eq!(dead.len(), 2);
    // Every chunk dead: the pack is retired whole.
    for k in &keys[2..] {
        gcer.backend().delete(k).await.unwrap();
    }
    let r = gcer.backend().compact(false, &[]).await.unwrap();
    assert_eq!(r.packs, 1, "{r:?}");
    assert_eq!(pack_objects(&f.store).await, (vec![], vec![], vec![]));
    assert_eq!(watcher.backend().get(&keys[1]).await.unwrap(), stored);
    assert!(watcher.backend().head(&keys[2]).await.unwrap().is_none());
}

/// GC's batched calls on packed chunks: `rename_many` of two packed chunks and one loose
/// one (and a pair whose destination key is invalid) moves the three, each fossil holding the
/// chunk's stored bytes, and every handle then finds none of them under its key; only the
/// two packed ones have dead markers. `delete_many` of the other two packed chunks leaves the
/// pack with nothing to serve: it retires the pack whole (no marker written; the next
/// compaction reports it) and of the fossils deletes them with one DeleteObjects request,
/// no DELETE.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_rename_many_and_delete_many_of_packed_chunks() {
    let f = Fixture::s3("packs-many").await;
    let (_, table) = publish_image(
        &f.store,
        &noise(256 << 10, 87),
        Chunking::Fixed { size: 64 << 10 },
    )
    .await;
    let ds = table.chunk_digests();
    assert_eq!(ds.len(), 4);
    let keys: Vec<String> = ds.iter().map(|d| ObjectRef::Chunk(*d).key()).collect();
    let watcher = f.reopen().await;
    for k in &keys {
        assert!(watcher.backend().head(k).await.unwrap().is_some());
    }
    let stored: Vec<Bytes> =
        futures::future::join_all(keys[..2].iter().map(|k| f.store.backend().get(k)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    let loose = "chunks/sha256/00aa".to_string();
    f.store
        .backend()
        .put(&loose, Bytes::from_static(b"loose"))
        .await
        .unwrap();
    let gcer = f.reopen().await;
    let mut pairs: Vec<(String, String)> = [&keys[0], &keys[1], &loose]
        .iter()
        .map(|k| (k.to_string(), format!("fossil/{k}")))
        .collect();
    pairs.push((keys[2].clone(), "fossil/.bad".into()));
    let r = gcer.backend().rename_many(&pairs).await;
    assert!(r[..3].iter().all(Result::is_ok), "{r:?}");
    assert!(r[3].is_err(), "an invalid destination is refused: {r:?}");
    for s in [&watcher, &gcer, &f.reopen().await] {
        let b = s.backend();
        for k in [&keys[0], &keys[1], &loose] {
            assert!(b.head(k).await.unwrap().is_none(), "{k} moved");
        }
        assert!(
            b.head(&keys[2]).await.unwrap().is_some(),
            "a refused pair stays"
        );
        let objs = [ObjectRef::Chunk(ds[0]), ObjectRef::Chunk(ds[2])];
        assert_eq!(s.exist(&objs).await.unwrap(), vec![false, true]);
    }
    for (k, want) in keys[..2].iter().zip(&stored) {
        assert_eq!(
            &f.store.backend().get(&format!("fossil/{k}")).await.unwrap(),
            want
        );
    }
    assert_eq!(
        &f.store
            .backend()
            .get(&format!("fossil/{loose}"))
            .await
            .unwrap()[..],
        b"loose"
    );
    let (_, _, dead) = pack_objects(&f.store).await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    let before = gcer.backend().wire_requests();
    let r = gcer.backend().delete_many(&keys[2..]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let after = gcer.backend().wire_requests();
    assert_eq!(
        after.puts - before.puts,
        0,
        "a pack left serving nothing takes no marker: it is retired whole"
    );
    assert_eq!(pack_objects(&f.store).await, (vec![], vec![], vec![]));
    for s in [&watcher, &gcer, &f.reopen().await] {
        for k in &keys {
            assert!(s.backend().head(k).await.unwrap().is_none());
        }
        let objs = [ObjectRef::Chunk(ds[2]), ObjectRef::Chunk(ds[3])];
        assert_eq!(s.exist(&objs).await.unwrap(), vec![false, false]);
    }
    // The next compaction reports the pack the delete retired, as its own; then nothing.
    let c = gcer.backend().compact(false, &[]).await.unwrap();
    assert_eq!(c.packs, 1, "{c:?}");
    assert!(c.bytes_reclaimed > 0, "{c:?}");
    let c = gcer.backend().compact(false, &[]).await.unwrap();
    assert_eq!(c, Default::default());
    let fossils: Vec<String> = gcer
        .backend()
        .list("fossil/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert_eq!(fossils.len(), 3, "{fossils:?}");
    let before = gcer.backend().wire_requests();
    let r = gcer.backend().delete_many(&fossils).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let after = gcer.backend().wire_requests();
    assert_eq!(
        (after.deletes - before.deletes, after.other - before.other),
        (0, 1),
        "one DeleteObjects request"
    );
    assert!(gcer.backend().list("fossil/").await.unwrap().is_empty());
}

/// A store written before packs (each chunk its own object) reads, lists, verifies and is
/// found present as before; a push of the same image to it uploads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_a_store_of_loose_chunks_still_reads() {
    let f = Fixture::s3("packs-loose").await;
    let local = Fixture::local().await;
    let data = noise(1 << 20, 87);
    let (m, table) = publish_image(&local.store, &data, Chunking::Fixed { size: 64 << 10 }).await;
    let b = f.store.backend();
    for d in table.chunk_digests() {
        let k = ObjectRef::Chunk(d).key();
        let stored = local.store.backend().get(&k).await.unwrap();
        assert_eq!(
            b.put_if_absent(&k, stored, None).await.unwrap(),
            PutOutcome::Created
        );
    }
    let mk = ObjectRef::Manifest(m).key();
    b.put_if_absent(&mk, local.store.backend().get(&mk).await.unwrap(), None)
        .await
        .unwrap();
    f.store
        .set_tag(&"old:v1".parse().unwrap(), None, m)
        .await
        .unwrap();
    let s = f.reopen().await;
    let Manifest::Image(im) = s.get_manifest(&m).await.unwrap() else {
        panic!("not an image")
    };
    let out = f.tmp("old");
    s.materialize(&im.disk, &out, None).await.unwrap();
    assert!(std::fs::read(&out).unwrap() == data);
    assert_eq!(s.backend().list("chunks/").await.unwrap().len(), 16);
    let v = s.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{:?}", v.findings);
    // A build's upload (leased, looked up first) finds every loose chunk present.
    let lease = Arc::new(
        s.create_lease("old-store", Duration::from_secs(600), [])
            .await
            .unwrap(),
    );
    let (_, stats) = s
        .put_artifact_reader(
            std::io::Cursor::new(data),
            &PutArtifactOptions {
                chunking: Some(Chunking::Fixed { size: 64 << 10 }),
                lease: Some(lease.clone()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    lease.release().await.unwrap();
    assert_eq!(stats.chunks_transferred, 0);
    assert_eq!(pack_objects(&s).await.0.len(), 0);
}

/// `get_many` on S3 reads packed chunks by spans of their pack, and answers for every key as
/// `get_range(0..limit)` would: packed, deleted (absent), loose, absent, over the limit
/// (clipped), in the order given, from a handle whose view is cold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_get_many_answers_as_one_read_each() {
    let f = Fixture::s3("packs-get-many").await;
    let (_, table) = publish_image(
        &f.store,
        &noise(2 << 20, 88),
        Chunking::Fixed { size: 64 << 10 },
    )
    .await;
    let keys: Vec<String> = table
        .chunk_digests()
        .iter()
        .map(|d| ObjectRef::Chunk(*d).key())
        .collect();
    let b = f.store.backend();
    b.delete(&keys[5]).await.unwrap();
    let loose = "chunks/sha256/00000000000000000000000000000000000000000000000000000000000000aa";
    b.put_if_absent(loose, Bytes::from_static(b"loose bytes"), None)
        .await
        .unwrap();
    let mut asked = keys.clone();
    asked.push(loose.into());
    asked.push(
        "chunks/sha256/00000000000000000000000000000000000000000000000000000000000000bb".into(),
    );
    asked.reverse();
    let cold = f.reopen().await;
    let cb = cold.backend();
    let many = cb.get_many(&asked, 1 << 20).await;
    assert_eq!(many.len(), asked.len());
    for (k, r) in asked.iter().zip(&many) {
        match cb.get_range(k, 0..1 << 20).await {
            Ok(want) => assert_eq!(r.as_ref().unwrap(), &want, "{k}"),
            Err(e) => {
                assert!(e.is_not_found(), "{e}");
                assert!(r.as_ref().unwrap_err().is_not_found(), "{k}");
            }
        }
    }
    assert!(many[0].as_ref().unwrap_err().is_not_found());
    assert_eq!(many[1].as_ref().unwrap().as_ref(), b"loose bytes");
    let clipped = cb.get_many(&asked[2..3], 10).await;
    assert_eq!(clipped[0].as_ref().unwrap().len(), 10);
}

/// Reads of one packed chunk at once through one handle (a clone's page fault beside its
/// prefetch) cost the requests of one read: the later ones wait for the first one's bytes.
/// (S3 only: a local read completes before the next one looks, so there is nothing to share.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_concurrent_reads_of_a_chunk_fetch_it_once() {
    let f = Fixture::s3("packs-inflight").await;
    let (_, table) = publish_image(&f.store, &noise(1 << 20, 11), Chunking::DISK_DEFAULT).await;
    let chunks: Vec<_> = table
        .entries
        .iter()
        .filter_map(|e| e.digest.map(|d| (d, e.raw_len)))
        .collect();
    assert!(chunks.len() >= 3, "{} chunks", chunks.len());
    let s = f.reopen().await;
    // The first read of a handle may load what it knows of the store (S3: the packs).
    s.get_chunk(&chunks[0].0, chunks[0].1).await.unwrap();
    let before = s.metrics().requests;
    let one = s.get_chunk(&chunks[1].0, chunks[1].1).await.unwrap();
    let solo = s.metrics().requests - before;
    assert_eq!(one.len() as u64, chunks[1].1);
    let (d, n) = chunks[2];
    let pair = [(d, n), (d, n)];
    let before = s.metrics().requests;
    // Polled in this order in one task: the first read has sent its request before the
    // others look.
    let (a, b, many) = tokio::join!(s.get_chunk(&d, n), s.get_chunk(&d, n), s.get_chunks(&pair));
    let together = s.metrics().requests - before;
    let a = a.unwrap();
    assert_eq!(a.len() as u64, n);
    assert_eq!(b.unwrap(), a);
    for r in many {
        assert_eq!(r.unwrap(), a);
    }
    assert!(
        together <= solo,
        "four reads of one chunk at once made {together} requests, one read alone {solo}"
    );
}

/// A leased import into S3 (what `kiln store import` does) looks its chunks up a group at a
/// time with a listing of `chunks/sha256/`, not one HEAD per chunk (issue 33: a 256 MiB
/// import made about 4,000 HEADs and ran at 17 MB/s against moto): 512 chunks in groups of
/// 64 cost a few requests per group, counted on the wire ([`Store::metrics`]'s `wire`,
/// every HTTP request the client sent). A second import of the same chunks behind 16 that
/// are loose objects finds every one present (the 16 by the listing, the rest in the pack)
/// and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_leased_import_looks_chunks_up_by_listing() {
    let f = Fixture::s3("leased-import").await;
    let chunking = Chunking::Fixed { size: 16 << 10 };
    let data = noise(8 << 20, 89);
    let lease = Arc::new(
        f.store
            .create_lease("import-1", Duration::from_secs(600), [])
            .await
            .unwrap(),
    );
    let opts = PutArtifactOptions {
        chunking: Some(chunking),
        lease: Some(lease.clone()),
        ..Default::default()
    };
    let before = f.store.metrics().wire;
    let (table, stats) = f
        .store
        .put_artifact_reader(std::io::Cursor::new(data.clone()), &opts)
        .await
        .unwrap();
    let wire = f.store.metrics().wire;
    let chunks = table.chunk_digests().len() as u64;
    assert_eq!(chunks, 512);
    assert_eq!(stats.chunks_transferred, 512);
    let (heads, total) = (wire.heads - before.heads, wire.total() - before.total());
    // Per group of chunks (the upload's lease batch): its lease part (a PUT), a listing of chunks/sha256/, and at most
    // a listing of packs/ a second; then the pack and its index.
    assert!(
        heads <= 8 && total <= chunks / 8,
        "{heads} HEADs, {total} requests for {chunks} chunks: {:?}",
        wire
    );

    // 16 chunks written as loose objects, then imported with the rest: found, not written.
    let extra = noise(16 * (16 << 10), 90);
    for c in extra.chunks(16 << 10) {
        f.store.put_chunk(Bytes::copy_from_slice(c)).await.unwrap();
    }
    let again = f.reopen().await;
    let before = again.metrics().wire;
    let lease2 = Arc::new(
        again
            .create_lease("import-2", Duration::from_secs(600), [])
            .await
            .unwrap(),
    );
    let (table2, stats2) = again
        .put_artifact_reader(
            std::io::Cursor::new([extra, data].concat()),
            &PutArtifactOptions {
                chunking: Some(chunking),
                lease: Some(lease2.clone()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let wire = again.metrics().wire;
    assert_eq!(table2.chunk_digests().len(), 528);
    assert_eq!(stats2.chunks_transferred, 0, "every chunk was present");
    let (heads, total) = (wire.heads - before.heads, wire.total() - before.total());
    assert!(
        heads <= 8 && total <= 528 / 8,
        "{heads} HEADs, {total} requests for 528 present chunks: {:?}",
        wire
    );
    lease.release().await.unwrap();
    lease2.release().await.unwrap();
}

/// A batched read on a handle that has not listed the packs yet (a clone's chunk server
/// starting its prefetch) lists them first and reads the packed chunks by a few ranged
/// GETs, not one by one (issue 35: eight prefetch batches at once made 879 requests of a
/// Debian clone's cold start, each chunk a loose GET, a ranged GET and a marker HEAD).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_packs_a_fresh_handle_reads_a_batch_by_ranges() {
    let f = Fixture::s3("packs-fresh-batch").await;
    let (_, table) = publish_image(
        &f.store,
        &noise(4 << 20, 91),
        Chunking::Fixed { size: 64 << 10 },
    )
    .await;
    let chunks = table.chunk_digests();
    assert_eq!(chunks.len(), 64);
    let s = f.reopen().await;
    let before = s.metrics().wire;
    let read = s.get_chunks_stored(&chunks).await;
    let w = s.metrics().wire;
    assert!(read.iter().all(Result::is_ok));
    let (gets, heads, lists) = (
        w.gets - before.gets,
        w.heads - before.heads,
        w.lists - before.lists,
    );
    // One listing of `packs/` (its markers with it, made after the read began) and the GET
    // of its index, and the chunks in a ranged GET or two: no listing of the pack again.
    assert!(
        gets <= 3 && heads == 0 && lists == 1,
        "64 packed chunks on a fresh handle: {gets} GETs, {heads} HEADs, {lists} listings"
    );
    // A chunk deleted before a fresh handle's read began reads as absent: that listing
    // holds its marker.
    let gone = ObjectRef::Chunk(chunks[5]).key();
    assert!(f.store.backend().delete_many(&[gone]).await[0].is_ok());
    let read = f.reopen().await.get_chunks_stored(&chunks).await;
    for (i, r) in read.iter().enumerate() {
        assert_eq!(
            r.is_ok(),
            i != 5,
            "chunk {i}: {:?}",
            r.as_ref().map(|b| b.len())
        );
    }
}
