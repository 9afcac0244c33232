use super::*;

#[test]
fn mark_follows_edges_once_and_stops_on_error() {
    let graph: HashMap<u32, Vec<u32>> = [
        (1, vec![2, 3]),
        (2, vec![4]),
        (3, vec![4, 1]), // cycle back to 1
        (4, vec![]),
        (5, vec![6]), // unreachable
        (6, vec![]),
    ]
    .into_iter()
    .collect();
    let mut calls = 0;
    let live = mark([1u32], |n| {
        calls += 1;
        Ok::<_, ()>(graph[n].clone())
    })
    .unwrap();
    assert_eq!(live, HashSet::from([1, 2, 3, 4]));
    assert_eq!(calls, 4);
    let live = mark([6u32, 6], |n| Ok::<_, ()>(graph[n].clone())).unwrap();
    assert_eq!(live, HashSet::from([6]));
    assert!(
        mark(Vec::<u32>::new(), |_| Err::<Vec<u32>, _>("x"))
            .unwrap()
            .is_empty()
    );
    let err = mark([1u32], |n| {
        if *n == 4 {
            Err("bad 4")
        } else {
            Ok(graph[n].clone())
        }
    });
    assert_eq!(err, Err("bad 4"));
}

/// A corrupt tag or cache entry must stop GC, not silently drop the image it keeps alive.
#[tokio::test]
async fn an_unreadable_root_stops_gc_before_any_delete() {
    use crate::artifact::PutArtifactOptions;
    use crate::manifest::{ImageManifest, Manifest};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8 + 1).collect();
    let (table, _) = store
        .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
        .await
        .unwrap();
    let raw = store
        .put_manifest(&Manifest::Image(ImageManifest::new(table)))
        .await
        .unwrap();
    let t: crate::TagRef = "img:v1".parse().unwrap();
    store.set_tag(&t, None, raw.digest).await.unwrap();
    let layer = store
        .put_blob(bytes::Bytes::from_static(b"layer"))
        .await
        .unwrap();
    store.put_cache_entry("step1", layer.digest).await.unwrap();
    let opts = GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    };
    // Objects: manifest and blob files, and chunks (packed: listed through the backend).
    let count = || async {
        let mut n = 0;
        for p in ["manifests", "blobs"] {
            for e in walkdir(&dir.path().join(p)) {
                n += usize::from(e.is_file());
            }
        }
        n + store.backend.list("chunks/").await.unwrap().len()
    };
    let before = count().await;
    assert!(before >= 3);
    // Damage the tag (a torn write, a bad disk, a tenant's edit).
    std::fs::write(dir.path().join("tags/img/v1"), b"{ not json").unwrap();
    let err = store.gc(&opts).await.unwrap_err();
    assert!(err.to_string().contains("tags/img/v1"), "{err}");
    assert_eq!(count().await, before);
    // Damage a cache entry instead.
    store.set_tag(&t, None, raw.digest).await.ok();
    std::fs::remove_file(dir.path().join("tags/img/v1")).unwrap();
    store.set_tag(&t, None, raw.digest).await.unwrap();
    std::fs::write(dir.path().join("cache/step1"), b"\x00\x01").unwrap();
    let err = store.gc(&opts).await.unwrap_err();
    assert!(err.to_string().contains("cache/step1"), "{err}");
    assert_eq!(count().await, before);
}

/// A local backend that watches the order of writes: every content-addressed object
/// written must already be named by a lease object; and `on_lease_list` runs once, the
/// first time the leases are listed (GC's read of its roots, after its listing).
struct Watched {
    inner: crate::backend::local::LocalBackend,
    unleased_writes: std::sync::Mutex<Vec<String>>,
    on_lease_list: std::sync::Mutex<Option<LeaseListHook>>,
}

type LeaseListHook = Box<
    dyn FnOnce(
            Vec<crate::backend::ObjectInfo>,
        ) -> futures::future::BoxFuture<'static, Vec<crate::backend::ObjectInfo>>
        + Send,
>;

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Watched {
    async fn leased(&self) -> HashSet<String> {
        let mut out = HashSet::new();
        for o in self.inner.list("leases/").await.unwrap() {
            let b = self.inner.get(&o.key).await.unwrap();
            let r: crate::lease::LeaseRecord = serde_json::from_slice(&b).unwrap();
            out.extend(r.objects);
        }
        out
    }

    async fn check(&self, key: &str) {
        if ObjectRef::from_key(key).is_some() && !self.leased().await.contains(key) {
            self.unleased_writes.lock().unwrap().push(key.to_string());
        }
    }
}

#[async_trait::async_trait]
impl Backend for Watched {
    fn url(&self) -> &str {
        self.inner.url()
    }
    async fn get(&self, key: &str) -> Result<bytes::Bytes, crate::BackendError> {
        self.inner.get(key).await
    }
    async fn get_range(
        &self,
        key: &str,
        r: std::ops::Range<u64>,
    ) -> Result<bytes::Bytes, crate::BackendError> {
        self.inner.get_range(key, r).await
    }
    async fn get_versioned(
        &self,
        key: &str,
    ) -> Result<(bytes::Bytes, crate::backend::Version), crate::BackendError> {
        self.inner.get_versioned(key).await
    }
    async fn head(
        &self,
        key: &str,
    ) -> Result<Option<crate::backend::ObjectInfo>, crate::BackendError> {
        self.inner.head(key).await
    }
    async fn put_if_absent(
        &self,
        key: &str,
        data: bytes::Bytes,
        expect: Option<crate::digest::Sha256Hash>,
    ) -> Result<crate::backend::PutOutcome, crate::BackendError> {
        self.check(key).await;
        self.inner.put_if_absent(key, data, expect).await
    }
    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &std::path::Path,
        expect: Option<crate::digest::Sha256Hash>,
    ) -> Result<crate::backend::PutOutcome, crate::BackendError> {
        self.check(key).await;
        self.inner.put_file_if_absent(key, path, expect).await
    }
    async fn put(
        &self,
        key: &str,
        data: bytes::Bytes,
    ) -> Result<crate::backend::Version, crate::BackendError> {
        self.check(key).await;
        self.inner.put(key, data).await
    }
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&crate::backend::Version>,
        data: bytes::Bytes,
    ) -> Result<crate::backend::Version, crate::BackendError> {
        self.inner.compare_and_swap(key, expected, data).await
    }
    async fn list(
        &self,
        prefix: &str,
    ) -> Result<Vec<crate::backend::ObjectInfo>, crate::BackendError> {
        let l = self.inner.list(prefix).await?;
        let hook = if prefix == "leases/" {
            self.on_lease_list.lock().unwrap().take()
        } else {
            None
        };
        Ok(match hook {
            Some(h) => h(l).await,
            None => l,
        })
    }
    async fn delete(&self, key: &str) -> Result<(), crate::BackendError> {
        self.inner.delete(key).await
    }
    async fn rename(&self, from: &str, to: &str) -> Result<(), crate::BackendError> {
        self.inner.rename(from, to).await
    }
    fn stage_batch(&self) -> crate::backend::StageBatch {
        self.inner.stage_batch()
    }
    async fn stage_if_absent(
        &self,
        batch: &crate::backend::StageBatch,
        key: &str,
        data: bytes::Bytes,
    ) -> Result<crate::backend::Staged, crate::BackendError> {
        self.check(key).await;
        self.inner.stage_if_absent(batch, key, data).await
    }
    async fn commit_staged(
        &self,
        batch: crate::backend::StageBatch,
        staged: Vec<crate::backend::StagedPut>,
    ) -> Result<Vec<crate::backend::PutOutcome>, crate::BackendError> {
        self.inner.commit_staged(batch, staged).await
    }
    async fn discard_staged(
        &self,
        batch: crate::backend::StageBatch,
        staged: Vec<crate::backend::StagedPut>,
    ) {
        self.inner.discard_staged(batch, staged).await
    }
    async fn flush_staged(
        &self,
        batch: &crate::backend::StageBatch,
    ) -> Result<(), crate::BackendError> {
        self.inner.flush_staged(batch).await
    }
    async fn packed_present(&self, keys: &[String]) -> Result<Vec<bool>, crate::BackendError> {
        self.inner.packed_present(keys).await
    }
    async fn pack_together(
        &self,
        keys: &[String],
    ) -> Result<crate::backend::PackedTogether, crate::BackendError> {
        self.inner.pack_together(keys).await
    }
    async fn loose_present(&self, key: &str) -> Result<bool, crate::BackendError> {
        self.inner.loose_present(key).await
    }
}

async fn watched(dir: &std::path::Path) -> (std::sync::Arc<Watched>, Store) {
    let w = std::sync::Arc::new(Watched {
        inner: crate::backend::local::LocalBackend::open(dir)
            .await
            .unwrap(),
        unleased_writes: Default::default(),
        on_lease_list: Default::default(),
    });
    let store = Store::from_backend(w.clone(), crate::StoreOptions::default());
    (w, store)
}

/// 1 MiB of pseudo-random bytes from `seed`: several distinct chunks.
fn data(seed: u32) -> Vec<u8> {
    crate::test_support::random_bytes(seed.into(), 1 << 20)
}

/// Every chunk and the manifest an upload under a lease writes is in the lease before it
/// is written, so a GC at any moment sees it leased.
#[tokio::test]
async fn every_object_is_leased_before_it_is_written() {
    use crate::artifact::PutArtifactOptions;
    use crate::manifest::{ImageManifest, Manifest};
    let dir = tempfile::tempdir().unwrap();
    let (w, store) = watched(dir.path()).await;
    let lease = std::sync::Arc::new(
        store
            .create_lease("upload", Duration::from_secs(600), [])
            .await
            .unwrap(),
    );
    let opts = PutArtifactOptions {
        lease: Some(lease.clone()),
        ..Default::default()
    };
    let (table, _) = store
        .put_artifact_reader(std::io::Cursor::new(data(7)), &opts)
        .await
        .unwrap();
    assert!(table.entries.iter().filter(|e| e.digest.is_some()).count() > 2);
    let raw = lease
        .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
        .await
        .unwrap();
    let blob = bytes::Bytes::from_static(b"a blob");
    let b = crate::digest::BlobDigest(crate::digest::Sha256Hash::of(&blob));
    lease.add([ObjectRef::Blob(b)]).await.unwrap();
    store.put_blob(blob).await.unwrap();
    assert!(
        w.unleased_writes.lock().unwrap().is_empty(),
        "{:?}",
        w.unleased_writes
    );
    // Written without a lease, the watcher sees it.
    store
        .put_blob(bytes::Bytes::from_static(b"unleased"))
        .await
        .unwrap();
    assert_eq!(w.unleased_writes.lock().unwrap().len(), 1);
    let gc = GcOptions {
        grace: Duration::ZERO,
        ..Default::default()
    };
    store.gc(&gc).await.unwrap();
    assert!(store.has(&ObjectRef::Manifest(raw.digest)).await.unwrap());
    for e in &table.entries {
        if let Some(d) = e.digest {
            assert!(store.has(&ObjectRef::Chunk(d)).await.unwrap());
        }
    }
}

/// Issue 39: a build-cache entry's inputs record (`cache-inputs/<key>`) and its index
/// copy (`cache-index/<id>`) are collected by GC when the entry is; a record whose entry
/// is gone is collected too; while the entry lives, both stay.
#[tokio::test]
async fn a_cache_entrys_inputs_record_goes_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let layer = store
        .put_blob(bytes::Bytes::from_static(b"layer"))
        .await
        .unwrap();
    store.put_cache_entry("step1", layer.digest).await.unwrap();
    let record = bytes::Bytes::from_static(b"{\"inputs\":1}");
    store
        .put_cache_inputs("step1", Some("pos1"), record.clone())
        .await
        .unwrap();
    store
        .put_cache_inputs("orphan", None, record.clone())
        .await
        .unwrap();
    let kept = store
        .gc(&GcOptions {
            grace: Duration::ZERO,
            ..GcOptions::default()
        })
        .await
        .unwrap();
    assert_eq!(kept.expired, ["cache-inputs/orphan"]);
    assert_eq!(
        store.get_cache_inputs("step1").await.unwrap(),
        Some(record.clone())
    );
    assert_eq!(store.get_cache_index("pos1").await.unwrap(), Some(record));
    assert_eq!(store.get_cache_inputs("orphan").await.unwrap(), None);
    let gone = store
        .gc(&GcOptions {
            grace: Duration::ZERO,
            cache_ttl: Duration::ZERO,
            dry_run: false,
        })
        .await
        .unwrap();
    let mut expired = gone.expired.clone();
    expired.sort();
    assert_eq!(
        expired,
        ["cache-index/pos1", "cache-inputs/step1", "cache/step1"]
    );
    assert!(store.get_cache_entry("step1").await.unwrap().is_none());
    assert_eq!(store.get_cache_inputs("step1").await.unwrap(), None);
    assert_eq!(store.get_cache_index("pos1").await.unwrap(), None);
}

/// Issue 16: an image cache entry (`images/<key>`) is not a GC root: the image it names
/// is swept once no tag keeps it, and the entry goes with it; an entry whose image a tag
/// keeps stays.
#[tokio::test]
async fn image_cache_entries_go_with_the_images_gc_sweeps() {
    use crate::artifact::PutArtifactOptions;
    use crate::manifest::{ImageManifest, Manifest};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let mut digests = Vec::new();
    for n in [1u32, 2] {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8 + n as u8).collect();
        let (table, _) = store
            .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
            .await
            .unwrap();
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table)))
            .await
            .unwrap();
        store
            .put_image_entry(&format!("key{n}"), raw.digest)
            .await
            .unwrap();
        digests.push(raw.digest);
    }
    let t: crate::TagRef = "img:kept".parse().unwrap();
    store.set_tag(&t, None, digests[1]).await.unwrap();
    let opts = GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    };
    let report = store.gc(&opts).await.unwrap();
    assert!(
        report.expired.contains(&"images/key1".to_string()),
        "{report:?}"
    );
    assert!(!store.has(&ObjectRef::Manifest(digests[0])).await.unwrap());
    assert_eq!(store.get_image_entry("key1").await.unwrap(), None);
    let kept = store.get_image_entry("key2").await.unwrap().expect("kept");
    assert_eq!(kept.manifest, digests[1]);
}

/// GC lists the objects, then reads the leases: a lease taken between the two (a build
/// that leases chunk X after GC listed it) is seen, and X is kept.
#[tokio::test]
async fn gc_sees_a_lease_taken_after_it_listed_the_objects() {
    let dir = tempfile::tempdir().unwrap();
    let (w, store) = watched(dir.path()).await;
    let (x, _) = store.put_chunk(bytes::Bytes::from(data(3))).await.unwrap();
    let x = ObjectRef::Chunk(x.digest);
    let leaser = store.clone();
    *w.on_lease_list.lock().unwrap() = Some(Box::new(move |_listed| {
        Box::pin(async move {
            // GC has listed chunks (X among them, unreferenced); now a build leases X.
            let l = leaser
                .create_lease("late", Duration::from_secs(600), [])
                .await
                .unwrap();
            l.add([x]).await.unwrap();
            leaser.backend.inner().list("leases/").await.unwrap()
        })
    }));
    let gc = GcOptions {
        grace: Duration::ZERO,
        ..Default::default()
    };
    let r = store.gc(&gc).await.unwrap();
    assert!(store.has(&x).await.unwrap(), "{r:?}");
    assert!(r.collected.is_empty(), "{r:?}");
}

/// The race "GC lists unreferenced chunk X; a build sees X exists and skips writing it;
/// GC deletes X": a build that leases X after GC read the leases looks for X under the
/// sweep lock, so it waits for the sweep, never finding X present-then-deleted. (Its
/// lease, written before GC's second phase read the leases, makes that phase put X
/// back, so the look-up then finds X.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reuse_look_up_during_a_sweep_never_finds_what_the_sweep_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let (w, store) = watched(dir.path()).await;
    let (x, _) = store.put_chunk(bytes::Bytes::from(data(5))).await.unwrap();
    let x = ObjectRef::Chunk(x.digest);
    let reuser = store.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    *w.on_lease_list.lock().unwrap() = Some(Box::new(move |listed| {
        Box::pin(async move {
            // GC holds the leases it read (X not among them); a build now leases X and
            // looks for it.
            let lease = reuser
                .create_lease("reuser", Duration::from_secs(600), [])
                .await
                .unwrap();
            let look = tokio::spawn(async move {
                let found = lease.find_present(&[x]).await.unwrap();
                (lease, found)
            });
            // Wait until its lease part is written: it is looking (or waiting to).
            while !reuser
                .backend
                .inner()
                .list("leases/")
                .await
                .unwrap()
                .iter()
                .any(|o| o.key.starts_with("leases/reuser~"))
            {
                tokio::task::yield_now().await;
            }
            let _ = tx.send(look);
            listed
        })
    }));
    let gc = GcOptions {
        grace: Duration::ZERO,
        ..Default::default()
    };
    let r = store.gc(&gc).await.unwrap();
    let (lease, found) = rx.await.unwrap().await.unwrap();
    assert_eq!(
        found.contains(&x),
        store.has(&x).await.unwrap(),
        "the look-up said {found:?}; GC: {r:?}"
    );
    assert_eq!(r.condemned, 1, "{r:?}");
    assert_eq!(r.resurrected, [x.key()], "{r:?}");
    assert!(found.contains(&x), "the sweep did not finish first: {r:?}");
    lease.release().await.unwrap();
}

/// One GC per store: a live holder's lock refuses a second GC (naming the holder), a
/// dead holder's (same host, process gone) or an expired one is taken over, and a run
/// removes its lock when done.
#[tokio::test]
async fn the_gc_lock_refuses_a_second_gc_and_is_taken_over_from_a_dead_one() {
    use crate::owner::ProcessId;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let put_lock = |r: LeaseRecord| {
        let store = store.clone();
        async move {
            store
                .backend
                .put(GC_LOCK_KEY, encode_lock(&r))
                .await
                .unwrap();
        }
    };
    put_lock(lock_record()).await;
    let err = store.gc(&GcOptions::default()).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Gc(GcError::Busy { pid, .. }) if *pid == std::process::id()),
        "{err:?}"
    );
    assert!(err.to_string().contains("another GC is running"), "{err}");
    // A dry run takes no lock.
    store
        .gc(&GcOptions {
            dry_run: true,
            ..Default::default()
        })
        .await
        .unwrap();

    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let start_ticks = crate::owner::start_ticks(pid).unwrap_or(1);
    child.wait().unwrap();
    let mut dead = lock_record();
    dead.owner = Some(LeaseOwner {
        process: ProcessId { pid, start_ticks },
        ..LeaseOwner::current()
    });
    put_lock(dead).await;
    store.gc(&GcOptions::default()).await.unwrap();
    assert!(store.backend.head(GC_LOCK_KEY).await.unwrap().is_none());

    let mut expired = lock_record();
    expired.host = "elsewhere".into();
    expired.owner = None;
    expired.expires = unix_now() - 1;
    put_lock(expired).await;
    store.gc(&GcOptions::default()).await.unwrap();
    assert!(store.backend.head(GC_LOCK_KEY).await.unwrap().is_none());
}

/// A tagged image whose manifest and one chunk sit at their fossil keys (a GC stopped
/// between its phases, after a build relied on them): writers see them absent, readers
/// and verify find them, and the next GC puts them back.
#[tokio::test]
async fn fossils_are_read_through_and_the_next_gc_puts_back_what_is_marked() {
    use crate::artifact::PutArtifactOptions;
    use crate::manifest::{ImageManifest, Manifest};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let bytes = data(11);
    let (table, _) = store
        .put_artifact_reader(
            std::io::Cursor::new(bytes.clone()),
            &PutArtifactOptions::default(),
        )
        .await
        .unwrap();
    let raw = store
        .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
        .await
        .unwrap();
    let m = ObjectRef::Manifest(raw.digest);
    let c = ObjectRef::Chunk(table.entries[0].digest.unwrap());
    for o in [m, c] {
        store
            .backend
            .rename(&o.key(), &fossil_key(&o.key()))
            .await
            .unwrap();
    }
    // A manifest that is a fossil can be tagged (a build's publish during a GC).
    let t: crate::TagRef = "img:v1".parse().unwrap();
    store.set_tag(&t, None, raw.digest).await.unwrap();
    assert!(!store.has(&c).await.unwrap() && !store.has(&m).await.unwrap());
    let found = store.exist(&[c, m]).await.unwrap();
    assert_eq!(found, [false, false], "writers never see fossils");
    let out = dir.path().join("out");
    let Manifest::Image(im) = store.get_manifest(&raw.digest).await.unwrap() else {
        panic!("not an image")
    };
    store.materialize(&im.disk, &out, None).await.unwrap();
    assert!(std::fs::read(&out).unwrap() == bytes);
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{:?}", v.findings);
    assert_eq!(v.fossils, 2);
    assert!(v.orphans.is_empty(), "{:?}", v.orphans);

    let r = store
        .gc(&GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut back = r.resurrected.clone();
    back.sort();
    let mut want = vec![m.key(), c.key()];
    want.sort();
    assert_eq!(back, want, "{r:?}");
    assert!(r.collected.is_empty(), "{r:?}");
    assert!(store.has(&c).await.unwrap() && store.has(&m).await.unwrap());
    assert!(store.backend.list(FOSSIL_PREFIX).await.unwrap().is_empty());
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok() && v.fossils == 0, "{v:?}");
}

fn walkdir(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walkdir(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
}

/// What a killed import leaves in a local store's `.tmp` (its staged chunks: up to the
/// whole artifact's stored size, e.g. 133 MB of 1,663 files for a 200 MB image killed
/// 1.5 s in) is reclaimed when the store is next opened, as `kiln store gc` opens it:
/// the files of a writer that is gone go, those of a live writer (an import in flight)
/// stay, whatever their age.
#[tokio::test]
async fn gc_reclaims_staged_files_a_killed_import_left_in_tmp() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().to_str().unwrap().to_string();
    Store::open(&url).await.unwrap();
    let tmp = dir.path().join(".tmp");
    // A writer that is gone: a child process, reaped; named as the backend names its
    // temp files (pid, start time, pid namespace).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let ticks = crate::owner::start_ticks(pid).unwrap_or(1);
    child.wait().unwrap();
    let ns = crate::owner::pid_namespace().unwrap();
    let dead = tmp.join(format!("p{pid}s{ticks}n{ns}-0-1796434403609641437"));
    let me = crate::owner::ProcessId::current().token();
    let live = tmp.join(format!("{me}n{ns}-1-1796434403609641438"));
    for p in [&dead, &live] {
        std::fs::write(p, vec![7u8; 64 << 10]).unwrap();
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - Duration::from_secs(7200))
            .unwrap();
    }
    let store = Store::open(&url).await.unwrap();
    store.gc(&GcOptions::default()).await.unwrap();
    assert!(
        live.exists(),
        "a live writer's temp file (an import in flight) is kept"
    );
    assert!(
        !dead.exists(),
        "a killed import's temp file is left for good"
    );
}

/// GC of one of two images that share chunks (the second is a quarter of the first
/// plus new bytes, so its upload reused that quarter and its pack holds only its new
/// chunks): the first image's pack is three quarters dead, so it is compacted, and the
/// packs' bytes on disk come down to the stored bytes of the live chunks. The store is
/// verify-clean, the live image reads back whole; a dry run had said what would go.
#[tokio::test]
async fn gc_compacts_the_pack_of_a_collected_image() {
    use crate::artifact::PutArtifactOptions;
    use crate::manifest::{ImageManifest, Manifest};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
    let first: Vec<u8> = (0..8).flat_map(|i| data(100 + i)).collect();
    let second: Vec<u8> = first[..2 << 20]
        .iter()
        .copied()
        .chain(data(200))
        .chain(data(201))
        .collect();
    let mut digests = Vec::new();
    for (bytes, tag) in [(&first, "img:a"), (&second, "img:b")] {
        let (table, _) = store
            .put_artifact_reader(
                std::io::Cursor::new(bytes.clone()),
                &PutArtifactOptions::default(),
            )
            .await
            .unwrap();
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table)))
            .await
            .unwrap();
        store
            .set_tag(&tag.parse().unwrap(), None, raw.digest)
            .await
            .unwrap();
        digests.push(raw.digest);
    }
    let pack_bytes = || -> u64 {
        walkdir(&dir.path().join(".packs"))
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "pack"))
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum()
    };
    let stored = || async {
        store
            .backend
            .list("chunks/")
            .await
            .unwrap()
            .iter()
            .map(|o| o.size)
            .sum::<u64>()
    };
    let before = pack_bytes();
    assert_eq!(before, stored().await, "every chunk packed, no dead bytes");
    store.untag(&"img:a".parse().unwrap(), None).await.unwrap();
    let opts = GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    };
    let dry = store
        .gc(&GcOptions {
            dry_run: true,
            ..opts
        })
        .await
        .unwrap();
    assert_eq!(dry.compacted.packs, 1, "{:?}", dry.compacted);
    assert_eq!(pack_bytes(), before, "a dry run changes nothing");
    let r = store.gc(&opts).await.unwrap();
    assert!(!r.collected.is_empty());
    assert_eq!(r.compacted.packs, 1, "{:?}", r.compacted);
    let after = pack_bytes();
    let live = stored().await;
    assert_eq!(after, live, "{:?}", r.compacted);
    assert_eq!(r.compacted.bytes_reclaimed, dry.compacted.bytes_reclaimed);
    assert_eq!(before - after, r.compacted.bytes_reclaimed);
    assert!(after < before / 2, "before {before}, after {after}");
    eprintln!(
        "pack bytes before GC {before}, after {after} (live chunks' stored bytes {live}); {:?}",
        r.compacted
    );
    let v = store.verify(true, &GcOptions::default()).await.unwrap();
    assert!(v.is_ok(), "{:?}", v.findings);
    assert_eq!(v.pack_dead_bytes, 0);
    assert!(v.orphans.is_empty(), "{:?}", v.orphans);
    let Manifest::Image(im) = store.get_manifest(&digests[1]).await.unwrap() else {
        panic!("not an image")
    };
    let out = dir.path().join("out");
    store.materialize(&im.disk, &out, None).await.unwrap();
    assert!(std::fs::read(&out).unwrap() == second);
    // Nothing left to compact.
    let again = store.gc(&opts).await.unwrap();
    assert_eq!(again.compacted, crate::backend::CompactReport::default());
}
