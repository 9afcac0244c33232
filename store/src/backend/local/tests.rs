use super::*;
use crate::backend::pack::chunk_key;

type Hook = Box<dyn FnOnce() + Send>;

/// Run by a compaction of the store at the path, once, between its copy and its
/// commit (what another process does meanwhile).
static BEFORE_COMPACTION_COMMIT: std::sync::Mutex<Vec<(PathBuf, Hook)>> =
    std::sync::Mutex::new(Vec::new());

pub(super) fn before_compaction_commit(root: &Path) {
    let hook = {
        let mut hooks = BEFORE_COMPACTION_COMMIT.lock().unwrap();
        hooks
            .iter()
            .position(|(r, _)| r == root)
            .map(|i| hooks.remove(i).1)
    };
    if let Some(h) = hook {
        h();
    }
}

#[tokio::test]
async fn leftovers_and_hidden_files_are_not_objects() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    b.put("chunks/sha256/aa", Bytes::from_static(b"x"))
        .await
        .unwrap();
    // A crashed writer's temp file and a stray hidden file.
    fs::write(dir.path().join(".tmp/123-0-0"), b"partial").unwrap();
    fs::write(dir.path().join("chunks/.hidden"), b"h").unwrap();
    let keys: Vec<String> = b
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert_eq!(keys, vec!["chunks/sha256/aa".to_string()]);
    // A failed digest check leaves neither the object nor a temp file.
    let wrong = Sha256Hash::of(b"other");
    assert!(
        b.put_if_absent("blobs/sha256/bb", Bytes::from_static(b"data"), Some(wrong))
            .await
            .is_err()
    );
    assert!(b.head("blobs/sha256/bb").await.unwrap().is_none());
    assert_eq!(fs::read_dir(dir.path().join(".tmp")).unwrap().count(), 1);
}

/// The next open of a store removes the temp files of writers that are gone (a killed
/// import's staged chunks), and keeps those of a live writer, of another pid namespace,
/// and of another name form.
#[tokio::test]
async fn an_open_removes_the_temp_files_of_dead_writers_only() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let tmp = dir.path().join(".tmp");
    // A real writer that has exited: a child process, reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let ticks = crate::owner::start_ticks(pid).unwrap_or(1);
    child.wait().unwrap();
    let ns = crate::owner::pid_namespace().unwrap();
    let dead = format!("p{pid}s{ticks}n{ns}-0-1");
    let other_ns = format!("p{pid}s{ticks}n{}-0-1", ns + 1);
    let live = b.tmp_path().file_name().unwrap().to_owned();
    for name in [
        std::ffi::OsStr::new(&dead),
        std::ffi::OsStr::new(&other_ns),
        &live,
        std::ffi::OsStr::new("123-0-0"),
    ] {
        fs::write(tmp.join(name), b"staged").unwrap();
    }
    LocalBackend::open(dir.path()).await.unwrap();
    let mut left: Vec<String> = fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let mut want = vec![
        other_ns,
        live.to_string_lossy().into_owned(),
        "123-0-0".into(),
    ];
    want.sort();
    assert_eq!(left, want);
}

/// A staged object is invisible (no key, not listed) until its commit; the commit makes
/// A discarded batch's temp pack goes at the discard, even while a stage still running
/// holds the batch (a failed pull's other chunks on the blocking pool: CI saw the temp
/// pack still there when `failed_pull_leaves_nothing` looked), and a stage after the
/// discard fails instead of making the file again.
#[tokio::test]
async fn a_discard_removes_the_temp_pack_while_a_stage_holds_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let packs_in_tmp = || {
        fs::read_dir(dir.path().join(TMP_DIR))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".pack")
            })
            .count()
    };
    let batch = b.stage_batch();
    let key = chunk_key(&Sha256Hash::of(b"a"));
    let Staged::Pending(p) = b
        .stage_if_absent(&batch, &key, Bytes::from_static(b"a"))
        .await
        .unwrap()
    else {
        panic!("not staged");
    };
    assert_eq!(packs_in_tmp(), 1);
    // What a stage still in flight holds.
    let in_flight = batch.pack.clone().expect("a local batch has a pack");
    b.discard_staged(batch, vec![p]).await;
    assert_eq!(packs_in_tmp(), 0, "the temp pack went at the discard");
    assert!(in_flight.append(b"late").is_err());
    drop(in_flight);
    assert_eq!(packs_in_tmp(), 0, "a late stage made no file");
    assert!(b.head(&key).await.unwrap().is_none());
}

/// it an object, lets an object already at the key win, and leaves no temp file; a
/// discarded batch leaves nothing at all.
#[tokio::test]
async fn staged_objects_appear_only_at_their_commit() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let tmp_files = || fs::read_dir(dir.path().join(TMP_DIR)).unwrap().count();
    let batch = b.stage_batch();
    let stage = |key: &'static str, data: &'static [u8]| {
        let (b, batch) = (&b, &batch);
        async move {
            match b
                .stage_if_absent(batch, key, Bytes::from_static(data))
                .await
                .unwrap()
            {
                Staged::Pending(p) => p,
                Staged::Done(o) => panic!("{key}: not staged: {o:?}"),
            }
        }
    };
    let a = stage("chunks/sha256/aa", b"a").await;
    let c = stage("chunks/sha256/cc", b"c").await;
    assert!(b.head("chunks/sha256/aa").await.unwrap().is_none());
    assert!(b.list("chunks/").await.unwrap().is_empty());
    assert_eq!(tmp_files(), 2);
    // Another writer publishes `cc` meanwhile (durably, the ordinary way).
    b.put_if_absent("chunks/sha256/cc", Bytes::from_static(b"other"), None)
        .await
        .unwrap();
    let out = b.commit_staged(batch, vec![a, c]).await.unwrap();
    assert_eq!(out, [PutOutcome::Created, PutOutcome::AlreadyExists]);
    assert_eq!(&b.get("chunks/sha256/aa").await.unwrap()[..], b"a");
    assert_eq!(&b.get("chunks/sha256/cc").await.unwrap()[..], b"other");
    assert_eq!(tmp_files(), 0);
    // An object already there is found at staging time.
    let batch = b.stage_batch();
    assert!(matches!(
        b.stage_if_absent(&batch, "chunks/sha256/aa", Bytes::from_static(b"a"))
            .await
            .unwrap(),
        Staged::Done(PutOutcome::AlreadyExists)
    ));
    // Discarded: nothing stays.
    let d = match b
        .stage_if_absent(&batch, "chunks/sha256/dd", Bytes::from_static(b"d"))
        .await
        .unwrap()
    {
        Staged::Pending(p) => p,
        Staged::Done(o) => panic!("not staged: {o:?}"),
    };
    b.discard_staged(batch, vec![d]).await;
    assert_eq!(tmp_files(), 0);
    assert!(b.head("chunks/sha256/dd").await.unwrap().is_none());
    // An empty commit (the sync of what was found present) is fine.
    assert!(
        b.commit_staged(b.stage_batch(), Vec::new())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn symlinked_and_directory_keys_are_not_followed_as_objects() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    fs::create_dir_all(dir.path().join("tags/n")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", dir.path().join("tags/n/t")).unwrap();
    // list ignores symlinks; head of a directory is absent.
    assert!(b.list("tags/").await.unwrap().is_empty());
    assert!(b.head("tags/n").await.unwrap().is_none());
}

#[tokio::test]
async fn planted_directory_symlinks_never_lead_outside_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("victim");
    fs::write(&victim, b"keep").unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    // A tenant plants `tags/n -> outside` and `chunks -> outside`.
    fs::create_dir_all(dir.path().join("tags")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("tags/n")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("chunks")).unwrap();
    let data = Bytes::from_static(b"x");
    assert!(b.put("tags/n/t", data.clone()).await.is_err());
    assert!(
        b.compare_and_swap("tags/n/t", None, data.clone())
            .await
            .is_err()
    );
    assert!(
        b.put_if_absent("chunks/victim2", data.clone(), None)
            .await
            .is_err()
    );
    assert!(b.get("tags/n/victim").await.is_err());
    assert!(b.get_range("chunks/victim", 0..4).await.is_err());
    assert!(b.head("chunks/victim").await.is_err());
    // Listing through the symlink is refused (GC would otherwise sweep outside files).
    assert!(b.list("chunks/").await.is_err());
    assert!(b.list("tags/n/").await.is_err());
    assert!(b.delete("chunks/victim").await.is_err());
    assert!(
        b.stage_if_absent(&b.stage_batch(), "chunks/victim3", data.clone())
            .await
            .is_err()
    );
    assert_eq!(fs::read(&victim).unwrap(), b"keep");
    let mut names: Vec<_> = fs::read_dir(outside.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["victim"]);
    // A symlinked `.tmp` is refused too: temp files would be written outside.
    fs::remove_dir_all(dir.path().join(".tmp")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join(".tmp")).unwrap();
    assert!(b.put("blobs/sha256/aa", data.clone()).await.is_err());
    assert!(
        b.stage_if_absent(&b.stage_batch(), "blobs/sha256/bb", data.clone())
            .await
            .is_err()
    );
    assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
    // A symlinked `.locks`: no lock file is made outside.
    fs::remove_dir_all(dir.path().join(".locks")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join(".locks")).unwrap();
    assert!(b.compare_and_swap("tags/t", None, data).await.is_err());
    assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
}

/// Objects staged one file each (a batch without a pack) are committed only into
/// directories checked at the commit: one swapped for a symlink since they were staged
/// (their directory is checked once for all of them) fails the commit, and nothing is
/// linked outside.
#[tokio::test]
async fn a_directory_swapped_for_a_symlink_before_the_commit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let mut staged = Vec::new();
    let batch = StageBatch::immediate();
    for i in 0..3 {
        match b
            .stage_if_absent(
                &batch,
                &format!("chunks/sha256/{i:064x}"),
                Bytes::from(vec![i as u8; 10]),
            )
            .await
            .unwrap()
        {
            Staged::Pending(p) => staged.push(p),
            Staged::Done(o) => panic!("not staged: {o:?}"),
        }
    }
    fs::rename(dir.path().join("chunks/sha256"), dir.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("chunks/sha256")).unwrap();
    assert!(b.commit_staged(batch, staged).await.is_err());
    assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
    assert_eq!(fs::read_dir(dir.path().join(".tmp")).unwrap().count(), 0);
}

#[tokio::test]
async fn a_symlink_at_an_object_name_is_not_read_through() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    fs::create_dir_all(dir.path().join("tags/n")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", dir.path().join("tags/n/t")).unwrap();
    assert!(b.get("tags/n/t").await.is_err());
    assert!(b.get_versioned("tags/n/t").await.is_err());
    assert!(b.get_range("tags/n/t", 0..4).await.is_err());
    assert!(b.head("tags/n/t").await.unwrap().is_none());
}

#[tokio::test]
async fn a_huge_mutable_object_is_refused_before_reading() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    fs::create_dir_all(dir.path().join("tags/n")).unwrap();
    // 1 TiB, sparse: allocating or reading it whole would abort or exhaust memory.
    File::create(dir.path().join("tags/n/t"))
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let err = b.get_versioned("tags/n/t").await.unwrap_err();
    assert!(err.to_string().contains("limit"), "{err}");
    // And at the store level: a tag read is a named error, verify reports it.
    let store = crate::Store::open(dir.path().to_str().unwrap())
        .await
        .unwrap();
    assert!(store.get_tag(&"n:t".parse().unwrap()).await.is_err());
    let r = store
        .verify(false, &crate::gc::GcOptions::default())
        .await
        .unwrap();
    assert!(
        r.findings.iter().any(|f| matches!(f,
            crate::verify::Finding::TagCorrupt { key, reason }
                if key == "tags/n/t" && reason.contains("limit"))),
        "{:?}",
        r.findings
    );
}

fn chunk(i: u8) -> (String, Bytes) {
    let data = Bytes::from(vec![i; 100 + usize::from(i)]);
    (chunk_key(&Sha256Hash::of(&data)), data)
}

async fn stage_all(
    b: &LocalBackend,
    batch: &StageBatch,
    items: &[(String, Bytes)],
) -> Vec<StagedPut> {
    let mut out = Vec::new();
    for (k, d) in items {
        match b.stage_if_absent(batch, k, d.clone()).await.unwrap() {
            Staged::Pending(p) => out.push(p),
            Staged::Done(o) => panic!("{k}: not staged: {o:?}"),
        }
    }
    out
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Chunks staged into a batch go into one pack file: invisible (no key, not listed)
/// until the commit, then read whole and by range, headed and listed; the commit makes
/// one pack, one index and one dead file, and no chunk file; a chunk published by another
/// writer meanwhile wins (its bytes stay in the pack as dead weight).
#[tokio::test]
async fn packed_chunks_appear_only_at_their_commit() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=4).map(chunk).collect();
    let batch = b.stage_batch();
    let staged = stage_all(&b, &batch, &items).await;
    assert_eq!(files(&dir.path().join(TMP_DIR)).len(), 1, "one temp pack");
    for (k, _) in &items {
        assert!(b.head(k).await.unwrap().is_none());
        assert!(b.get(k).await.unwrap_err().is_not_found());
    }
    assert!(b.list("chunks/").await.unwrap().is_empty());
    // Another writer publishes chunk 4 meanwhile, as a loose file.
    b.put_if_absent(&items[3].0, items[3].1.clone(), None)
        .await
        .unwrap();
    let out = b.commit_staged(batch, staged).await.unwrap();
    assert_eq!(
        out,
        [
            PutOutcome::Created,
            PutOutcome::Created,
            PutOutcome::Created,
            PutOutcome::AlreadyExists
        ]
    );
    assert!(files(&dir.path().join(TMP_DIR)).is_empty());
    let packs = files(&dir.path().join(PACK_DIR));
    assert_eq!(packs.len(), 3, "{packs:?}");
    assert!(
        packs.iter().all(|n| n.starts_with(tmp_owner())),
        "{packs:?}"
    );
    for (k, d) in &items {
        assert_eq!(b.get(k).await.unwrap(), *d);
        let h = b.head(k).await.unwrap().unwrap();
        assert_eq!(h.size, d.len() as u64);
        assert_eq!(b.get_range(k, 10..20).await.unwrap(), d.slice(10..20));
        // Clipped to the chunk, never into the next one.
        assert_eq!(b.get_range(k, 50..100_000).await.unwrap(), d.slice(50..));
    }
    let mut listed: Vec<(String, u64)> = b
        .list("chunks/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| (o.key, o.size))
        .collect();
    listed.sort();
    let mut want: Vec<(String, u64)> = items
        .iter()
        .map(|(k, d)| (k.clone(), d.len() as u64))
        .collect();
    want.sort();
    assert_eq!(listed, want);
    assert_eq!(b.list("").await.unwrap().len(), 4);
    assert!(b.list("blobs/").await.unwrap().is_empty());
    let r = b.layout_report().await.unwrap();
    assert_eq!((r.packs, r.problems.len()), (1, 0));
    assert_eq!(r.dead_bytes, items[3].1.len() as u64);
    // Staged again: found present, put_if_absent too.
    let batch = b.stage_batch();
    assert!(matches!(
        b.stage_if_absent(&batch, &items[0].0, items[0].1.clone())
            .await
            .unwrap(),
        Staged::Done(PutOutcome::AlreadyExists)
    ));
    assert_eq!(
        b.put_if_absent(&items[1].0, items[1].1.clone(), None)
            .await
            .unwrap(),
        PutOutcome::AlreadyExists
    );
    assert!(!dir.path().join(&items[1].0).exists());
}

/// Two batches of one process at once (two uploads), and a second backend on the same
/// root (another process): each sees the other's committed pack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_at_once_and_other_processes_see_committed_packs() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let other = LocalBackend::open(dir.path()).await.unwrap();
    let xs: Vec<_> = (1..=3).map(chunk).collect();
    let ys: Vec<_> = (4..=6).map(chunk).collect();
    // The other process has looked (and cached an empty view) before.
    assert!(other.head(&xs[0].0).await.unwrap().is_none());
    let (bx, by) = (b.stage_batch(), b.stage_batch());
    let (sx, sy) = tokio::join!(stage_all(&b, &bx, &xs), stage_all(&b, &by, &ys));
    let (ox, oy) = tokio::join!(b.commit_staged(bx, sx), b.commit_staged(by, sy));
    assert!(
        ox.unwrap()
            .iter()
            .chain(&oy.unwrap())
            .all(|o| *o == PutOutcome::Created)
    );
    assert_eq!(files(&dir.path().join(PACK_DIR)).len(), 6);
    for (k, d) in xs.iter().chain(&ys) {
        assert_eq!(other.get(k).await.unwrap(), *d, "{k}");
    }
    assert_eq!(other.list("chunks/sha256/").await.unwrap().len(), 6);
    // A delete by the other process is seen here at once.
    other.delete(&xs[0].0).await.unwrap();
    assert!(b.head(&xs[0].0).await.unwrap().is_none());
    assert!(b.get(&xs[0].0).await.unwrap_err().is_not_found());
    assert_eq!(b.list("chunks/").await.unwrap().len(), 5);
}

/// Another process's view is refreshed by `.packs`'s timestamps: one that scanned well
/// after the last change (not in the racy window) sees a pack committed later at its
/// next miss, and a delete at its next hit.
#[tokio::test]
async fn a_settled_view_sees_a_later_commit_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let other = LocalBackend::open(dir.path()).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let xs: Vec<_> = (7..=8).map(chunk).collect();
    assert!(other.head(&xs[0].0).await.unwrap().is_none());
    assert!(
        !other.packs.read().racy,
        "scanned long after the last change"
    );
    let batch = b.stage_batch();
    let staged = stage_all(&b, &batch, &xs).await;
    b.commit_staged(batch, staged).await.unwrap();
    assert_eq!(other.get(&xs[0].0).await.unwrap(), xs[0].1);
    b.delete(&xs[1].0).await.unwrap();
    assert!(other.head(&xs[1].0).await.unwrap().is_none());
}

/// GC on packed chunks: a move to the fossil key leaves the bytes there and the key
/// absent, a put back makes a loose chunk; a pack whose every entry is deleted goes
/// with its index and dead file.
#[tokio::test]
async fn packed_chunks_are_renamed_and_deleted_and_an_all_dead_pack_goes() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=3).map(chunk).collect();
    let batch = b.stage_batch();
    let staged = stage_all(&b, &batch, &items).await;
    b.commit_staged(batch, staged).await.unwrap();
    let (k, d) = &items[0];
    let fossil = format!("fossil/{k}");
    b.rename(k, &fossil).await.unwrap();
    assert!(b.head(k).await.unwrap().is_none());
    assert_eq!(b.get(&fossil).await.unwrap(), *d);
    assert!(b.rename(k, &fossil).await.unwrap_err().is_not_found());
    b.rename(&fossil, k).await.unwrap();
    assert_eq!(b.get(k).await.unwrap(), *d);
    assert!(dir.path().join(k).is_file(), "put back as a loose chunk");
    // Reopened (a fresh view): the dead entry stays dead, the loose copy is the object.
    let fresh = LocalBackend::open(dir.path()).await.unwrap();
    assert_eq!(fresh.get(k).await.unwrap(), *d);
    assert_eq!(fresh.list("chunks/").await.unwrap().len(), 3);
    for (k, _) in &items {
        b.delete(k).await.unwrap();
    }
    assert!(b.list("chunks/").await.unwrap().is_empty());
    assert!(files(&dir.path().join(PACK_DIR)).is_empty());
    assert!(fresh.list("chunks/").await.unwrap().is_empty());
    assert!(fresh.get(&items[1].0).await.unwrap_err().is_not_found());
    // Deleting again is not an error.
    b.delete(&items[1].0).await.unwrap();
}

/// A torn or planted index is refused, named in the layout report, and its chunks are
/// not served (they read as absent, so an upload writes them again).
#[tokio::test]
async fn a_torn_or_planted_index_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=2).map(chunk).collect();
    let batch = b.stage_batch();
    let staged = stage_all(&b, &batch, &items).await;
    b.commit_staged(batch, staged).await.unwrap();
    let idx = files(&dir.path().join(PACK_DIR))
        .into_iter()
        .find(|n| n.ends_with(".idx"))
        .unwrap();
    let p = dir.path().join(PACK_DIR).join(&idx);
    let bytes = fs::read(&p).unwrap();
    fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
    let fresh = LocalBackend::open(dir.path()).await.unwrap();
    assert!(fresh.head(&items[0].0).await.unwrap().is_none());
    let r = fresh.layout_report().await.unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert!(
        r.problems[0].0.ends_with(&idx) && r.problems[0].1.contains("checksum"),
        "{:?}",
        r.problems
    );
    // A planted index naming bytes past its pack's end.
    let mut e = vec![IdxEntry {
        digest: Sha256Hash::of(b"planted"),
        offset: 0,
        len: 1 << 30,
    }];
    fs::write(&p, local_pack::encode_index(&mut e)).unwrap();
    let fresh = LocalBackend::open(dir.path()).await.unwrap();
    let r = fresh.layout_report().await.unwrap();
    assert!(r.problems[0].1.contains("bytes up to"), "{:?}", r.problems);
    assert!(
        fresh
            .get(&chunk_key(&Sha256Hash::of(b"planted")))
            .await
            .unwrap_err()
            .is_not_found()
    );
}

/// A pack left without an index by a writer that is gone (killed between the pack's
/// rename and the index's) is removed at the next open; a live writer's stays.
#[tokio::test]
async fn an_index_less_pack_of_a_dead_writer_is_reaped_at_open() {
    let dir = tempfile::tempdir().unwrap();
    LocalBackend::open(dir.path()).await.unwrap();
    let packs = dir.path().join(PACK_DIR);
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let ticks = crate::owner::start_ticks(pid).unwrap_or(1);
    child.wait().unwrap();
    let ns = crate::owner::pid_namespace().unwrap();
    let dead = format!("p{pid}s{ticks}n{ns}-0-1");
    let live = format!("{}-0-1", tmp_owner());
    for n in [&dead, &live] {
        fs::write(packs.join(format!("{n}.pack")), b"bytes").unwrap();
        fs::write(packs.join(format!("{n}.dead")), b"").unwrap();
    }
    LocalBackend::open(dir.path()).await.unwrap();
    assert_eq!(
        files(&packs),
        [format!("{live}.dead"), format!("{live}.pack")]
    );
}

/// A symlink planted at `.packs` is never followed: chunk reads, writes, listings and
/// commits through it fail, and nothing is written outside.
#[tokio::test]
async fn a_symlink_at_packs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    fs::create_dir_all(dir.path()).unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join(PACK_DIR)).unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let (k, d) = chunk(1);
    assert!(b.get(&k).await.is_err());
    assert!(b.head(&k).await.is_err());
    assert!(b.list("chunks/").await.is_err());
    assert!(b.put_if_absent(&k, d.clone(), None).await.is_err());
    let batch = b.stage_batch();
    let staged = b.stage_if_absent(&batch, &k, d).await;
    if let Ok(Staged::Pending(p)) = staged {
        assert!(b.commit_staged(batch, vec![p]).await.is_err());
    }
    assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
}

/// Sum of the sizes of the `.pack` files under `.packs`.
fn pack_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir.join(PACK_DIR))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".pack"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

async fn commit_all(b: &LocalBackend, items: &[(String, Bytes)]) {
    let batch = b.stage_batch();
    let staged = stage_all(b, &batch, items).await;
    let out = b.commit_staged(batch, staged).await.unwrap();
    assert!(out.iter().all(|o| *o == PutOutcome::Created), "{out:?}");
}

/// A pack at least half dead is compacted: its live chunks stay readable with the same
/// bytes, size and `modified`, its dead bytes leave the disk; one less dead is left as
/// it is; a dry run reports the same figures and changes nothing.
#[tokio::test]
async fn compaction_keeps_live_chunks_and_frees_dead_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=6).map(chunk).collect();
    commit_all(&b, &items).await;
    let total: u64 = items.iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!(pack_bytes(dir.path()), total);
    // Two of six dead (211 of 621 bytes, under half): left alone.
    for (k, _) in &items[4..] {
        b.delete(k).await.unwrap();
    }
    assert_eq!(
        b.compact(false, &[]).await.unwrap(),
        CompactReport::default()
    );
    assert_eq!(pack_bytes(dir.path()), total);
    // A dry run counting a third as deleted (its GC would delete it) would compact.
    let dry = b.compact(true, &[items[3].0.clone()]).await.unwrap();
    let live: u64 = items[..3].iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!(
        dry,
        CompactReport {
            packs: 1,
            bytes_before: total,
            bytes_copied: live,
            bytes_reclaimed: total - live,
            orphan_files: 0,
        }
    );
    assert_eq!(pack_bytes(dir.path()), total, "a dry run changes nothing");
    let heads_before: Vec<_> = {
        let mut v = Vec::new();
        for (k, _) in &items[..3] {
            v.push(b.head(k).await.unwrap().unwrap());
        }
        v
    };
    b.delete(&items[3].0).await.unwrap();
    let before_files = files(&dir.path().join(PACK_DIR));
    let r = b.compact(false, &[]).await.unwrap();
    assert_eq!(r, dry);
    assert_eq!(pack_bytes(dir.path()), live);
    let after_files = files(&dir.path().join(PACK_DIR));
    assert_eq!(after_files.len(), 3, "{after_files:?}");
    assert!(before_files.iter().all(|f| !after_files.contains(f)));
    for ((k, d), h) in items[..3].iter().zip(&heads_before) {
        assert_eq!(b.get(k).await.unwrap(), *d);
        assert_eq!(b.get_range(k, 10..20).await.unwrap(), d.slice(10..20));
        let now = b.head(k).await.unwrap().unwrap();
        assert_eq!((now.size, now.modified), (h.size, h.modified), "{k}");
    }
    for (k, _) in &items[3..] {
        assert!(b.head(k).await.unwrap().is_none());
    }
    // Another process's fresh view: the same keys, no dead bytes, no problem.
    let fresh = LocalBackend::open(dir.path()).await.unwrap();
    assert_eq!(fresh.list("chunks/").await.unwrap().len(), 3);
    let rep = fresh.layout_report().await.unwrap();
    assert_eq!((rep.packs, rep.dead_bytes, rep.problems.len()), (1, 0, 0));
    for (k, d) in &items[..3] {
        assert_eq!(fresh.get(k).await.unwrap(), *d);
        let h = fresh.head(k).await.unwrap().unwrap();
        assert_eq!(h.modified, heads_before[0].modified);
    }
    // Nothing left to do; deleting the rest retires the new pack as any other.
    assert_eq!(
        b.compact(false, &[]).await.unwrap(),
        CompactReport::default()
    );
    for (k, _) in &items[..3] {
        b.delete(k).await.unwrap();
    }
    assert!(files(&dir.path().join(PACK_DIR)).is_empty());
    assert!(files(&dir.path().join(TMP_DIR)).is_empty());
}

/// Another process that read the packs before a compaction reads through it: a stale
/// location (the old pack gone) is looked up again, a pack file it still has open
/// gives the same bytes; its deletes after the compaction reach the new pack.
#[tokio::test]
async fn another_process_reads_through_a_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let other = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=8).map(chunk).collect();
    commit_all(&b, &items).await;
    // The other process knows every location; it has the pack open too.
    for (k, d) in &items {
        assert_eq!(other.get(k).await.unwrap(), *d);
    }
    // A second process that knows the locations but never opened the pack.
    let cold = LocalBackend::open(dir.path()).await.unwrap();
    for (k, _) in &items {
        assert!(cold.head(k).await.unwrap().is_some());
    }
    // A third that looked before the deletes (its view of the dead file is empty).
    let stale = LocalBackend::open(dir.path()).await.unwrap();
    for (k, _) in &items {
        assert!(stale.head(k).await.unwrap().is_some());
    }
    let old = files(&dir.path().join(PACK_DIR));
    for (k, _) in &items[..5] {
        b.delete(k).await.unwrap();
    }
    let r = b.compact(false, &[]).await.unwrap();
    assert_eq!(r.packs, 1);
    for (k, d) in &items[5..] {
        assert_eq!(other.get(k).await.unwrap(), *d, "{k}");
        assert_eq!(cold.get(k).await.unwrap(), *d, "{k}");
        assert_eq!(cold.get_range(k, 3..9).await.unwrap(), d.slice(3..9));
    }
    // The stale process's look-up passes (an empty dead file where it expects one, as
    // between the old index's removal and its dead file's), its read of the old pack
    // finds it gone (ENOENT): it rescans and reads the new pack.
    let old_dead = dir
        .path()
        .join(PACK_DIR)
        .join(old.iter().find(|n| n.ends_with(".dead")).unwrap());
    fs::write(&old_dead, b"").unwrap();
    let loc = stale
        .packs
        .lookup(&chunk_digest(&items[6].0).unwrap())
        .unwrap();
    assert!(loc.is_some_and(|l| old.contains(&format!("{}.pack", l.pack))));
    assert_eq!(stale.get(&items[6].0).await.unwrap(), items[6].1);
    fs::remove_file(&old_dead).unwrap();
    for (k, _) in &items[..5] {
        assert!(cold.head(k).await.unwrap().is_none());
        assert!(other.get(k).await.unwrap_err().is_not_found());
    }
    assert_eq!(cold.list("chunks/").await.unwrap().len(), 3);
    // A delete by the stale process lands in the new pack.
    cold.delete(&items[5].0).await.unwrap();
    assert!(b.head(&items[5].0).await.unwrap().is_none());
    assert!(
        LocalBackend::open(dir.path())
            .await
            .unwrap()
            .head(&items[5].0)
            .await
            .unwrap()
            .is_none()
    );
}

/// The state a compaction killed between its new index's rename and the old index's
/// removal leaves: the live chunks in two indexed packs. Every process reads them,
/// a delete removes both copies, the store is verify-clean (the copies count as dead
/// bytes), and the next compaction retires the old pack without copying anything. A
/// kill after the old index went (its pack and dead file left) is cleaned up too.
#[tokio::test]
async fn a_compaction_killed_before_retiring_leaves_harmless_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=6).map(chunk).collect();
    commit_all(&b, &items).await;
    for (k, _) in &items[..3] {
        b.delete(k).await.unwrap();
    }
    let old_len = pack_bytes(dir.path());
    // The new pack of a compaction: the live chunks, indexed, with an empty dead file.
    let packs = dir.path().join(PACK_DIR);
    let name = format!("{}-999-1", tmp_owner());
    let mut bytes = Vec::new();
    let mut entries = Vec::new();
    for (k, d) in &items[3..] {
        entries.push(IdxEntry {
            digest: chunk_digest(k).unwrap(),
            offset: bytes.len() as u64,
            len: d.len() as u64,
        });
        bytes.extend_from_slice(d);
    }
    let live = bytes.len() as u64;
    fs::write(packs.join(format!("{name}.pack")), &bytes).unwrap();
    fs::write(packs.join(format!("{name}.dead")), b"").unwrap();
    fs::write(
        packs.join(format!("{name}.idx")),
        local_pack::encode_index(&mut entries),
    )
    .unwrap();
    // A stale process (knows the old pack only) and fresh ones.
    let fresh = LocalBackend::open(dir.path()).await.unwrap();
    for (k, d) in &items[3..] {
        assert_eq!(b.get(k).await.unwrap(), *d);
        assert_eq!(fresh.get(k).await.unwrap(), *d);
    }
    assert_eq!(fresh.list("chunks/").await.unwrap().len(), 3);
    let rep = fresh.layout_report().await.unwrap();
    assert_eq!((rep.packs, rep.problems.len()), (2, 0));
    assert_eq!(
        rep.dead_bytes, old_len,
        "the old pack's copies count as dead"
    );
    let store = crate::Store::open(dir.path().to_str().unwrap())
        .await
        .unwrap();
    let v = store
        .verify(false, &crate::gc::GcOptions::default())
        .await
        .unwrap();
    assert!(v.findings.is_empty(), "{:?}", v.findings);
    // A delete removes both copies (seen by every process).
    b.delete(&items[3].0).await.unwrap();
    for p in [&b, &fresh, &LocalBackend::open(dir.path()).await.unwrap()] {
        assert!(p.head(&items[3].0).await.unwrap().is_none());
    }
    // And what a kill after an old index's removal leaves: a pack and dead file
    // without an index, of a writer that still runs (so not reaped at open).
    let orphan = format!("{}-998-1", tmp_owner());
    fs::write(packs.join(format!("{orphan}.pack")), b"0123456789").unwrap();
    fs::write(packs.join(format!("{orphan}.dead")), b"").unwrap();
    let r = fresh.compact(false, &[]).await.unwrap();
    assert_eq!(
        (r.packs, r.bytes_copied, r.orphan_files),
        (1, 0, 2),
        "{r:?}"
    );
    assert_eq!(r.bytes_reclaimed, old_len + 10);
    assert_eq!(pack_bytes(dir.path()), live);
    assert_eq!(
        files(&packs),
        [
            format!("{name}.dead"),
            format!("{name}.idx"),
            format!("{name}.pack")
        ]
    );
    for p in [&b, &fresh, &LocalBackend::open(dir.path()).await.unwrap()] {
        for (k, d) in &items[4..] {
            assert_eq!(p.get(k).await.unwrap(), *d);
        }
        assert_eq!(p.list("chunks/").await.unwrap().len(), 2);
    }
    let v = store
        .verify(false, &crate::gc::GcOptions::default())
        .await
        .unwrap();
    assert!(v.findings.is_empty(), "{:?}", v.findings);
    assert_eq!(v.pack_dead_bytes, items[3].1.len() as u64);
}

/// Compactions racing readers of another process: over rounds of commits, deletes and
/// compactions (a round's pack compacted at once, older packs again as their chunks
/// die), a reader that reads every live chunk in a loop never misses one nor reads a
/// wrong byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_never_miss_a_live_chunk_during_compactions() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let reader = Arc::new(LocalBackend::open(dir.path()).await.unwrap());
    let live: Arc<tokio::sync::RwLock<Vec<(String, Bytes)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = {
        let (reader, live, stop) = (reader.clone(), live.clone(), stop.clone());
        tokio::spawn(async move {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let keys = live.read().await;
                for (k, d) in keys.iter() {
                    assert_eq!(reader.get(k).await.unwrap(), *d, "{k}");
                    reads += 1;
                }
                drop(keys);
                tokio::task::yield_now().await;
            }
            reads
        })
    };
    let mut compacted = 0;
    for round in 0..20u8 {
        let items: Vec<_> = (0..10).map(|i| chunk(round * 10 + i + 1)).collect();
        commit_all(&b, &items).await;
        let mut l = live.write().await;
        l.extend(items[..4].iter().cloned());
        // One older live chunk dies too (its pack, compacted before, dies again).
        let older = (round > 0).then(|| l.remove(0));
        drop(l);
        for (k, _) in items[4..].iter().chain(&older) {
            b.delete(k).await.unwrap();
        }
        compacted += b.compact(false, &[]).await.unwrap().packs;
    }
    stop.store(true, Ordering::Relaxed);
    let reads = task.await.unwrap();
    assert!(compacted >= 20, "{compacted}");
    assert!(reads > 0);
    let keys = live.read().await;
    let fresh = LocalBackend::open(dir.path()).await.unwrap();
    assert_eq!(fresh.list("chunks/").await.unwrap().len(), keys.len());
    for (k, d) in keys.iter() {
        assert_eq!(fresh.get(k).await.unwrap(), *d);
    }
    let rep = fresh.layout_report().await.unwrap();
    assert!(
        rep.dead_bytes * 2 <= rep.pack_bytes,
        "{} dead of {}",
        rep.dead_bytes,
        rep.pack_bytes
    );
    eprintln!(
        "{reads} reads, {compacted} compactions; {} packs, {} bytes, {} dead",
        rep.packs, rep.pack_bytes, rep.dead_bytes
    );
}

/// What other processes do between a compaction's copy and its commit: a chunk deleted
/// then is not indexed again (its copied bytes are dead weight in the new pack); a
/// chunk the pack did not serve at the plan but serves now (the copy that served it
/// went) makes the compaction leave the pack whole.
#[tokio::test]
async fn a_compaction_commits_on_the_view_under_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (1..=6).map(chunk).collect();
    commit_all(&b, &items).await;
    for (k, _) in &items[3..] {
        b.delete(k).await.unwrap();
    }
    let root = dir.path().to_path_buf();
    let victim = items[1].0.clone();
    BEFORE_COMPACTION_COMMIT.lock().unwrap().push((
        root.clone(),
        Box::new(move || {
            let other = LocalBackend::open_blocking(&root).unwrap();
            assert!(other.ctx().delete_packed(&victim).unwrap());
        }),
    ));
    let r = b.compact(false, &[]).await.unwrap();
    let copied: u64 = items[..3].iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!((r.packs, r.bytes_copied), (1, copied));
    for p in [&b, &LocalBackend::open(dir.path()).await.unwrap()] {
        assert!(p.head(&items[1].0).await.unwrap().is_none());
        for i in [0, 2] {
            assert_eq!(p.get(&items[i].0).await.unwrap(), items[i].1);
        }
        let rep = p.layout_report().await.unwrap();
        assert_eq!(
            (rep.packs, rep.dead_bytes),
            (1, items[1].1.len() as u64),
            "{rep:?}"
        );
    }

    // A pack P of chunks 7 to 12, 7 and 8 deleted; a smaller pack N (a compaction's
    // leftover) serves 9 and 10, so P is two thirds dead. P's plan copies 11 and 12
    // only; N goes before the commit, so P serves 9 and 10 again: P stays whole.
    let dir = tempfile::tempdir().unwrap();
    let b = LocalBackend::open(dir.path()).await.unwrap();
    let items: Vec<_> = (7..=12).map(chunk).collect();
    commit_all(&b, &items).await;
    for (k, _) in &items[..2] {
        b.delete(k).await.unwrap();
    }
    let packs = dir.path().join(PACK_DIR);
    let before = files(&packs);
    let n = format!("{}-997-1", tmp_owner());
    let mut bytes = Vec::new();
    let mut entries = Vec::new();
    for (k, d) in &items[2..4] {
        entries.push(IdxEntry {
            digest: chunk_digest(k).unwrap(),
            offset: bytes.len() as u64,
            len: d.len() as u64,
        });
        bytes.extend_from_slice(d);
    }
    fs::write(packs.join(format!("{n}.pack")), &bytes).unwrap();
    fs::write(packs.join(format!("{n}.dead")), b"").unwrap();
    fs::write(
        packs.join(format!("{n}.idx")),
        local_pack::encode_index(&mut entries),
    )
    .unwrap();
    let root = dir.path().to_path_buf();
    let n2 = n.clone();
    BEFORE_COMPACTION_COMMIT.lock().unwrap().push((
        root.clone(),
        Box::new(move || {
            for ext in ["idx", "pack", "dead"] {
                fs::remove_file(root.join(PACK_DIR).join(format!("{n2}.{ext}"))).unwrap();
            }
        }),
    ));
    let r = b.compact(false, &[]).await.unwrap();
    assert_eq!(r.packs, 0, "{r:?}");
    assert_eq!(files(&packs), before);
    assert!(files(&dir.path().join(TMP_DIR)).is_empty());
    for p in [&b, &LocalBackend::open(dir.path()).await.unwrap()] {
        for (k, d) in &items[2..] {
            assert_eq!(p.get(k).await.unwrap(), *d);
        }
    }
    // P is a third dead now: the next compaction leaves it too.
    assert_eq!(b.compact(false, &[]).await.unwrap().packs, 0);
}

/// An upload's pack holds its chunks in input order (issue 33), with a lease (groups of
/// `LEASE_BATCH`, several in flight) and without: each group is staged with one call, the
/// groups one after another, so a lazy reader of consecutive chunks reads consecutive bytes.
/// Before, each chunk was staged alone, eight at once, in whatever order they ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploads_pack_holds_its_chunks_in_input_order() {
    use crate::artifact::PutArtifactOptions;
    let input = tempfile::tempdir().unwrap();
    let file = input.path().join("in");
    // Deterministic pseudo-random bytes: about 380 chunks of 64 KiB on average, more than
    // one lease group.
    let data = crate::test_support::random_bytes(1, 24 << 20);
    fs::write(&file, &data).unwrap();
    for leased in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::Store::open_dir(dir.path()).await.unwrap();
        let lease = match leased {
            true => Some(Arc::new(
                store
                    .create_lease("order", std::time::Duration::from_secs(3600), [])
                    .await
                    .unwrap(),
            )),
            false => None,
        };
        let opts = PutArtifactOptions {
            lease,
            ..Default::default()
        };
        let (table, _) = store.put_artifact(&file, &opts).await.unwrap();
        assert!(table.entries.len() > 300, "{}", table.entries.len());
        let idx: Vec<String> = files(&dir.path().join(PACK_DIR))
            .into_iter()
            .filter(|n| n.ends_with(".idx"))
            .collect();
        assert_eq!(idx.len(), 1, "{idx:?}");
        let entries =
            local_pack::decode_index(&fs::read(dir.path().join(PACK_DIR).join(&idx[0])).unwrap())
                .unwrap();
        let at: std::collections::HashMap<Sha256Hash, u64> =
            entries.iter().map(|e| (e.digest, e.offset)).collect();
        let mut seen = std::collections::HashSet::new();
        let offsets: Vec<u64> = table
            .entries
            .iter()
            .filter_map(|e| e.digest)
            .filter(|d| seen.insert(*d))
            .map(|d| at[&d.0])
            .collect();
        assert_eq!(offsets.len(), entries.len());
        let out_of_order = offsets.windows(2).filter(|w| w[0] >= w[1]).count();
        assert_eq!(out_of_order, 0, "leased: {leased}; offsets {offsets:?}");
    }
}
