use super::*;
use crate::layer::apply_layer;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// The squash as kiln made it before [`merge_lowers`], from the blobs (`digests` bottom
/// first, from `cache`) into the empty directory `root`: each layer applied in order by
/// [`apply_layer`](crate::layer::apply_layer), after its parents were made its own ([`own_parents`]). The oracle
/// the merged trees are checked against.
fn squash_from_blobs(
    root: &Path,
    cache: &dyn BlobCache,
    digests: &[BlobDigest],
    limits: &Limits,
) -> Result<(), LowerError> {
    for d in digests {
        let blob = cache.blob_path(d)?.ok_or(LowerError::Missing(*d))?;
        let label = d.to_string();
        let f = fs::File::open(&blob).map_err(io_err("opening", &blob))?;
        own_parents(root, f, &label, limits)?;
        let f = fs::File::open(&blob).map_err(io_err("opening", &blob))?;
        apply_layer(root, f, &label, limits)?;
    }
    Ok(())
}

/// Before layer `blob` is applied to the tree `root` (the layers below it, applied): every
/// parent path of its entries whose component is not a directory in the tree (a symlink, a
/// file) is replaced by an empty directory (0755, root), as overlayfs shows this layer's
/// directory over a lower non-directory. Nothing is followed ([`crate::rootfs`]'s walk with
/// [`Walk::replace`]); a missing parent is left for the layer's apply to make. Entries are
/// read as [`mark_whiteouts`] reads them ([`for_each_entry_path`]).
fn own_parents(
    root: &Path,
    blob: impl Read,
    digest: &str,
    limits: &Limits,
) -> Result<(), LowerError> {
    let how = Walk::own_dirs(false, true);
    for_each_entry_path(
        root,
        blob,
        None,
        digest,
        limits,
        "making the parents of a layer in",
        |root_fd, comps| {
            let Some((_, parents)) = comps.split_last() else {
                return Ok(());
            };
            match walk_fd(root_fd.as_fd(), parents, &how, None) {
                Ok(_) | Err(WalkError::Missing) => Ok(()),
                Err(e) => Err(walk_io(e)),
            }
        },
    )
}

fn hdr() -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

fn tar_gz(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (name, data) in entries {
        let mut h = hdr();
        match data {
            Some(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(d.len() as u64);
                h.set_mode(0o644);
                b.append_data(&mut h, name, *d).unwrap();
            }
            None => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                h.set_mode(0o755);
                b.append_data(&mut h, name, io::empty()).unwrap();
            }
        }
    }
    b.into_inner().unwrap().finish().unwrap()
}

/// OCI whiteouts become overlay markers; what the same layer adds stays; an upper
/// directory written back as a layer gives the OCI form again.
#[test]
fn whiteouts_round_trip_through_overlay_form() {
    if !rustix::process::geteuid().is_root() {
        panic!("needs root (mknod, trusted.* xattrs); CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let blob = tar_gz(&[
        ("a/", None),
        ("a/.wh.gone", Some(b"")),
        ("b/", None),
        ("b/.wh..wh..opq", Some(b"")),
        ("b/kept", Some(b"k")),
        ("c/d/.wh.x", Some(b"")),
        (".wh.top", Some(b"")),
        ("f", Some(b"data")),
    ]);
    let digest = BlobDigest::of(&blob);
    cache.put_bytes(&digest, &blob).unwrap();
    let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
    let d = dirs.ensure(&cache, &digest, &Limits::default()).unwrap();
    let wh = |p: &str| {
        let m = fs::symlink_metadata(d.join(p)).unwrap();
        m.file_type().is_char_device() && m.rdev() == 0
    };
    assert!(wh("a/gone") && wh("c/d/x") && wh("top"));
    assert!(crate::layer::write::is_opaque(&d.join("b")).unwrap());
    assert!(!crate::layer::write::is_opaque(&d.join("a")).unwrap());
    assert_eq!(fs::read(d.join("b/kept")).unwrap(), b"k");
    // Second call: cached, same directory.
    assert_eq!(dirs.ensure(&cache, &digest, &Limits::default()).unwrap(), d);

    let mut out = Vec::new();
    crate::layer::write::write_upper_layer(&d, &mut out, None).unwrap();
    let mut names = Vec::new();
    let mut a = tar::Archive::new(decompressed(io::Cursor::new(out.clone())).unwrap());
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        names.push(String::from_utf8(e.path_bytes().into_owned()).unwrap());
        // Strict readers (the ext4 flattener) need every numeric field.
        let h = e.header();
        h.uid().unwrap();
        h.gid().unwrap();
        h.mtime().unwrap();
        h.mode().unwrap();
        for x in e.pax_extensions().unwrap().into_iter().flatten() {
            let x = x.unwrap();
            assert!(!x.key().unwrap().contains("overlay"), "{:?}", x.key());
        }
    }
    assert_eq!(
        names,
        [
            ".wh.top",
            "a/",
            "a/.wh.gone",
            "b/",
            "b/.wh..wh..opq",
            "b/kept",
            "c/",
            "c/d/",
            "c/d/.wh.x",
            "f"
        ]
    );
    // The diff_id is the sha256 of the uncompressed tar.
    let p = t.path().join("l.tar.zst");
    fs::write(&p, &out).unwrap();
    let mut raw = Vec::new();
    decompressed(io::Cursor::new(out.clone()))
        .unwrap()
        .read_to_end(&mut raw)
        .unwrap();
    assert_eq!(diff_id_of(&p).unwrap(), crate::cache::digest_of(&raw));
}

/// A layer whose inflated stream a flatten scan keeps (the prescan of a build's base) is
/// unpacked from that shared copy, not from its blob ([`layer_stream`]): the same
/// directory as unpacked from the blob, whiteouts marked (a second read of the copy),
/// with the blob gone meanwhile; and the image the scan continues to is the image made
/// from the blob. Once the scan is gone, unpacks read the blob again.
#[test]
fn a_layer_being_scanned_is_unpacked_from_the_scans_copy() {
    use crate::ext4::{self, Keep, LayerBlob, Prescan};
    if !rustix::process::geteuid().is_root() {
        panic!("needs root (mknod, trusted.* xattrs); CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    // Past the copy's 1 MiB write-behind, so it is appended in pieces.
    let big: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    let blob = tar_gz(&[
        ("a/", None),
        ("a/.wh.gone", Some(b"")),
        ("b/", None),
        ("b/.wh..wh..opq", Some(b"")),
        ("b/kept", Some(b"k")),
        ("big", Some(&big)),
        ("f", Some(b"data")),
    ]);
    let digest = BlobDigest::of(&blob);
    cache.put_bytes(&digest, &blob).unwrap();
    let path = cache.blob_path(&digest).unwrap().unwrap();
    let layer = LayerBlob {
        digest: digest.to_string(),
        path: path.clone(),
    };
    let unpack = |name: &str| {
        let dir = t.path().join(name);
        fs::create_dir(&dir).unwrap();
        unpack_overlay_form(&dir, &path, &layer.digest, &Limits::default()).map(|()| dir)
    };
    // A whiteout's own times are those of its making (`mknodat`), so two unpacks differ
    // there and nowhere else.
    let tree = |dir: &Path| -> Vec<String> {
        describe(dir)
            .into_iter()
            .map(|l| match l.contains("\"dev 0\"") {
                true => format!("{} whiteout", l.split(' ').next().unwrap_or_default()),
                false => l,
            })
            .collect()
    };
    let opts = ext4::Ext4Options {
        disk_mib: None,
        max_mib: ext4::DEFAULT_MAX_MIB,
        source_date_epoch: Some(1_700_000_000),
        limits: Limits::default(),
    };

    // The reference: from the blob, no copy alive.
    assert!(crate::layer::shared::follow(&layer.digest, &path).is_none());
    let want = unpack("want").unwrap();
    let want_img = t.path().join("want.ext4");
    ext4::build(std::slice::from_ref(&layer), &want_img, &opts).unwrap();
    assert!(crate::layer::shared::follow(&layer.digest, &path).is_none());

    let keep = Keep {
        dir: t.path().to_path_buf(),
        max_bytes: u64::MAX,
    };
    let p = Prescan::start(
        vec![layer.clone()],
        &Limits::default(),
        Some(1_700_000_000),
        keep,
    );
    // Its copy is there from the start: an unpack that comes before the scan's thread
    // reads anything follows it too.
    assert!(crate::layer::shared::follow(&layer.digest, &path).is_some());
    let scan = p.take().expect("the prescan read the layer");
    // The blob gone: what is unpacked comes from the scan's copy.
    let aside = t.path().join("aside");
    fs::rename(&path, &aside).unwrap();
    let got = unpack("got").unwrap();
    assert!(tree(&got) == tree(&want), "the same tree as from the blob");
    assert!(crate::layer::write::is_opaque(&got.join("b")).unwrap());
    let got_img = t.path().join("got.ext4");
    ext4::build_from(Some(scan), std::slice::from_ref(&layer), &got_img, &opts).unwrap();
    assert!(fs::read(&got_img).unwrap() == fs::read(&want_img).unwrap());

    // The scan and its copy are gone: the blob is read again (here: missing).
    assert!(crate::layer::shared::follow(&layer.digest, &path).is_none());
    assert!(unpack("after").is_err());
    fs::rename(&aside, &path).unwrap();
    assert!(tree(&unpack("again").unwrap()) == tree(&want));
}

/// Issue 34: a layer unpacked from its blob by a build of one work directory goes into
/// the host's shared directory, and a build of another work directory (another store, its
/// own blob cache) finds it there and unpacks nothing (the same inode); a step's adopted
/// directory stays in its own work directory; a blob whose bytes are not its digest is
/// never unpacked there.
#[test]
fn the_hosts_shared_layers_are_unpacked_once() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let shared = t.path().join("host/layers");
    let blob = tar_gz(&[("etc/", None), ("etc/os-release", Some(b"debian"))]);
    let digest = BlobDigest::of(&blob);
    let limits = Limits::default();
    let store = |name: &str| {
        let cache = crate::cache::LocalCache::open(&t.path().join(name)).unwrap();
        cache.put_bytes(&digest, &blob).unwrap();
        let dirs =
            LayerDirs::open_shared(&t.path().join(name).join(".build/layers"), Some(&shared))
                .unwrap();
        (cache, dirs)
    };
    let (cache_a, a) = store("a");
    assert_eq!(a.shared(), Some(shared.as_path()));
    let d = a.ensure(&cache_a, &digest, &limits).unwrap();
    assert_eq!(d, shared.join(digest.hex()));
    assert!(!t.path().join("a/.build/layers").join(digest.hex()).exists());
    let mode = fs::metadata(&shared).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the shared directory is private");
    let ino = |p: &Path| fs::symlink_metadata(p).unwrap().ino();
    let (dir_ino, file_ino) = (ino(&d), ino(&d.join("etc/os-release")));

    // Another store: found, not unpacked again (its blob even gone).
    let (cache_b, b) = store("b");
    let blob_b = cache_b.blob_path(&digest).unwrap().unwrap();
    fs::remove_file(&blob_b).unwrap();
    assert_eq!(b.path(&digest), d);
    assert_eq!(b.ensure(&cache_b, &digest, &limits).unwrap(), d);
    assert_eq!(
        (ino(&d), ino(&d.join("etc/os-release"))),
        (dir_ino, file_ino)
    );
    // Its squashed trees are its own, linking the shared files.
    let sq = b.squashed(&cache_b, &[digest], &limits).unwrap();
    assert!(
        sq.starts_with(t.path().join("b/.build/layers")),
        "{}",
        sq.display()
    );
    assert_eq!(ino(&sq.join("etc/os-release")), file_ino);

    // A step's upper directory is adopted into its own work directory.
    let upper = b.temp("upper");
    fs::create_dir_all(upper.join("made")).unwrap();
    let step = BlobDigest::of(b"a step's layer");
    let adopted = b.adopt(&upper, &step).unwrap();
    assert_eq!(adopted, t.path().join("b/.build/layers").join(step.hex()));
    assert!(!shared.join(step.hex()).exists());

    // A blob whose bytes are not its digest: refused, nothing left in the shared
    // directory (and nothing in the work directory).
    let other = tar_gz(&[("x", Some(b"x"))]);
    let odigest = BlobDigest::of(&other);
    cache_b.put_bytes(&odigest, &other).unwrap();
    let opath = cache_b.blob_path(&odigest).unwrap().unwrap();
    let mut perms = fs::metadata(&opath).unwrap().permissions();
    perms.set_mode(0o644);
    fs::set_permissions(&opath, perms).unwrap();
    fs::write(&opath, tar_gz(&[("y", Some(b"swapped"))])).unwrap();
    let e = b.ensure(&cache_b, &odigest, &limits).unwrap_err();
    assert!(matches!(e, LowerError::Mismatch { .. }), "{e}");
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let mut want = vec![
        ".lock".to_string(),
        digest.hex(),
        format!("{}{UNPACKING}", digest.hex()),
        format!("{}{UNPACKING}", odigest.hex()),
    ];
    want.sort();
    assert_eq!(names(&shared), want);

    // Without a shared directory, layers are the work directory's, as before.
    let (cache_c, _) = store("c");
    let c = LayerDirs::open(&t.path().join("c/.build/own")).unwrap();
    assert_eq!(c.shared(), None);
    let own = c.ensure(&cache_c, &digest, &limits).unwrap();
    assert_eq!(own, t.path().join("c/.build/own").join(digest.hex()));
}

/// Issue 34: `kiln store gc`'s collection of the host's shared layers removes nothing
/// while a build (of any work directory) holds them, and everything once none does;
/// an unfinished directory of a dead build there is removed by the next build that opens
/// the directory, and by the collection; a live build's is kept.
#[test]
fn the_hosts_shared_layers_are_collected_only_when_no_build_holds_them() {
    let t = tempfile::tempdir().unwrap();
    let shared = t.path().join("shared");
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let blob = tar_gz(&[("f", Some(b"data"))]);
    let digest = BlobDigest::of(&blob);
    cache.put_bytes(&digest, &blob).unwrap();
    let limits = Limits::default();
    let dead = {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start_ticks = kiln_store::owner::start_ticks(pid).unwrap_or(1);
        child.wait().unwrap();
        kiln_store::owner::ProcessId { pid, start_ticks }
    };
    let crashed = shared.join(format!("{}.tmp-{}-0", digest.hex(), dead.token()));
    fs::create_dir_all(crashed.join("etc")).unwrap();
    let a = LayerDirs::open_shared(&t.path().join("a"), Some(&shared)).unwrap();
    assert!(!crashed.exists(), "a dead build's unpack is reaped on open");
    let d = a.ensure(&cache, &digest, &limits).unwrap();
    let live = temp_in(&shared, "live");
    fs::create_dir(&live).unwrap();

    // A build of another work directory holds the shared directory too.
    let b = LayerDirs::open_shared(&t.path().join("b"), Some(&shared)).unwrap();
    drop(a);
    fs::create_dir_all(&crashed).unwrap();
    let busy = crate::workdir::collect_shared_layers(&shared, false).unwrap();
    assert!(busy.busy && busy.dirs == 0, "{busy:?}");
    assert!(d.is_dir() && live.is_dir());
    assert!(
        !crashed.exists(),
        "dead builds' leftovers go even while builds run"
    );
    drop(b);
    let dry = crate::workdir::collect_shared_layers(&shared, true).unwrap();
    assert_eq!((dry.busy, dry.dirs, dry.images), (false, 1, 0));
    assert!(d.is_dir());
    assert!(
        shared
            .join(format!("{}{UNPACKING}", digest.hex()))
            .is_file()
    );
    let done = crate::workdir::collect_shared_layers(&shared, false).unwrap();
    assert_eq!(done, dry);
    assert!(!d.exists());
    assert!(!shared.join(format!("{}{UNPACKING}", digest.hex())).exists());
    assert!(
        live.is_dir(),
        "a live build's unfinished directory is its own"
    );
    // Unpacked again on use.
    let c = LayerDirs::open_shared(&t.path().join("c"), Some(&shared)).unwrap();
    assert_eq!(c.ensure(&cache, &digest, &limits).unwrap(), d);
    assert_eq!(fs::read(d.join("f")).unwrap(), b"data");
    assert_eq!(
        crate::workdir::collect_shared_layers(&t.path().join("none"), false).unwrap(),
        crate::workdir::LayersCollected::default()
    );
}

/// Issue 34: a build that needs a layer another build of the host is unpacking into the
/// shared directory waits for it, unpacks nothing itself and finds the other's directory;
/// a wait stops at the build's deadline.
#[test]
fn a_layer_being_unpacked_by_another_build_is_waited_for() {
    let t = tempfile::tempdir().unwrap();
    let shared = t.path().join("shared");
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let blob = tar_gz(&[("f", Some(b"data"))]);
    let digest = BlobDigest::of(&blob);
    cache.put_bytes(&digest, &blob).unwrap();
    let a = LayerDirs::open_shared(&t.path().join("a"), Some(&shared)).unwrap();
    let b = LayerDirs::open_shared(&t.path().join("b"), Some(&shared)).unwrap();
    // Build a is unpacking (holds the lock, its directory not there yet).
    let held = lock_unpacking(&shared, &digest, &Limits::default()).unwrap();
    let late = Limits {
        deadline: Some(std::time::Instant::now() + std::time::Duration::from_millis(200)),
        ..Limits::default()
    };
    let e = b.ensure(&cache, &digest, &late).unwrap_err();
    assert!(
        matches!(e, LowerError::Layer(LayerError::Deadline { .. })),
        "{e}"
    );
    let waiting = {
        let (b, cache) = (b.clone(), cache.clone());
        std::thread::spawn(move || b.ensure(&cache, &digest, &Limits::default()))
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(!waiting.is_finished(), "b waits for a's unpack");
    let temps = |dir: &Path| {
        fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                n.to_string_lossy().contains(".tmp-")
            })
            .count()
    };
    assert_eq!(temps(&shared), 0, "b unpacks nothing meanwhile");
    // a's unpack completes (as LayerDirs::ensure does it), then releases the lock.
    let tmp = temp_in(&shared, &digest.hex());
    fs::create_dir(&tmp).unwrap();
    fs::write(tmp.join("made-by-a"), b"").unwrap();
    fs::rename(&tmp, shared.join(digest.hex())).unwrap();
    drop(held);
    let got = waiting.join().unwrap().unwrap();
    assert_eq!(got, shared.join(digest.hex()));
    assert!(got.join("made-by-a").is_file(), "b found a's directory");
    assert_eq!(a.ensure(&cache, &digest, &Limits::default()).unwrap(), got);
}

#[test]
fn only_dead_processes_temps_are_stale() {
    let stale_temp = |name: &str| crate::workdir::owned_by_dead_process(name, ".tmp-");
    assert!(!stale_temp("0123abcd"));
    assert!(!stale_temp(&format!("upper.tmp-{}-3", std::process::id())));
    assert!(!stale_temp("upper.tmp-1-0"), "pid 1 is alive");
    assert!(stale_temp("upper.tmp-2147483646-0"));
    assert!(stale_temp("upper.tmp-x"));
    let me = kiln_store::owner::ProcessId::current();
    assert!(!stale_temp(&format!("upper.tmp-{}-3", me.token())));
    let reused = kiln_store::owner::ProcessId {
        start_ticks: me.start_ticks + 1,
        ..me
    };
    assert!(stale_temp(&format!("upper.tmp-{}-3", reused.token())));
}

#[test]
fn squash_plans_fit_the_mount_and_grow_in_steps() {
    assert_eq!(squash_plan(0, 0), Some(0));
    assert_eq!(squash_plan(16, 16), Some(0));
    assert_eq!(squash_plan(1, 0), None);
    // 17 lowers where 16 fit: the lowest 8 squash, 9 + 1 lowers.
    assert_eq!(squash_plan(17, 16), Some(8));
    // The same squash serves the next steps, until 15 + 1 are mounted.
    for n in 17..=23 {
        assert_eq!(squash_plan(n, 16), Some(8), "{n}");
    }
    assert_eq!(squash_plan(24, 16), Some(16));
    assert_eq!(squash_plan(30, 16), Some(16));
    assert_eq!(squash_plan(32, 16), Some(24));
    // overlayfs' 500: the lowest 250 squash at 501, 500 at 750.
    assert_eq!(squash_plan(501, 500), Some(250));
    assert_eq!(squash_plan(749, 500), Some(250));
    assert_eq!(squash_plan(750, 500), Some(500));
    // A mount of one lower takes the whole squash.
    assert_eq!(squash_plan(5, 1), Some(5));
    for lowers in 0..=1200 {
        for fit in [1, 2, 3, 7, 16, 22, 500] {
            let s = squash_plan(lowers, fit).unwrap();
            let mounted = lowers - s + usize::from(s > 0);
            assert!(s <= lowers && mounted <= fit, "{lowers} on {fit}: {s}");
        }
    }
    // A RUN step's package layer takes one lower: the same multiples, so a RUN over 505
    // layers reuses the 250 a COPY beside it squashed.
    assert_eq!(squash_plan_reserving(505, 500, 1), Some(250));
    assert_eq!(squash_plan_reserving(506, 500, 0), Some(250));
    assert_eq!(squash_plan_reserving(15, 16, 1), Some(0));
    assert_eq!(squash_plan_reserving(16, 16, 1), Some(8));
    assert_eq!(squash_plan_reserving(1, 1, 1), None);
    for lowers in 0..=1200 {
        for fit in [2, 3, 7, 16, 22, 500] {
            let s = squash_plan_reserving(lowers, fit, 1).unwrap();
            let mounted = lowers - s + usize::from(s > 0);
            assert!(
                s <= lowers && mounted < fit,
                "{lowers} on {fit} less 1: {s}"
            );
        }
    }
}

/// A squashed tree is the layers applied in order: a whiteout and an opaque directory
/// of a later layer remove what earlier ones made and leave no marker; it is made once
/// per list of digests, and another order is another tree.
#[test]
fn squashed_tree_applies_the_layers_in_order_once() {
    if !rustix::process::geteuid().is_root() {
        panic!("needs root (owners); CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let put = |entries: &[(&str, Option<&[u8]>)]| {
        let blob = tar_gz(entries);
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        digest
    };
    let l1 = put(&[
        ("a", Some(b"a1")),
        ("gone", Some(b"x")),
        ("o/", None),
        ("o/x", Some(b"x")),
    ]);
    let l2 = put(&[
        (".wh.gone", Some(b"")),
        ("o/", None),
        ("o/.wh..wh..opq", Some(b"")),
        ("o/y", Some(b"y")),
        ("a", Some(b"a2")),
    ]);
    let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(t.path().join("layers"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "layers/ is private");
    }
    let both = [l1, l2];
    let d = dirs.squashed(&cache, &both, &Limits::default()).unwrap();
    assert_eq!(fs::read(d.join("a")).unwrap(), b"a2");
    assert!(fs::symlink_metadata(d.join("gone")).is_err());
    assert!(fs::symlink_metadata(d.join("o/x")).is_err());
    assert_eq!(fs::read(d.join("o/y")).unwrap(), b"y");
    assert!(!crate::layer::write::is_opaque(&d.join("o")).unwrap());
    assert_eq!(dirs.squashed(&cache, &both, &Limits::default()).unwrap(), d);
    // No layers (a stage FROM scratch with no step): an empty tree.
    let none = dirs.squashed(&cache, &[], &Limits::default()).unwrap();
    assert_eq!(fs::read_dir(&none).unwrap().count(), 0);
    let other = dirs
        .squashed(&cache, &[l2, l1], &Limits::default())
        .unwrap();
    assert_ne!(other, d);
    assert_eq!(fs::read(other.join("a")).unwrap(), b"a1");
    // A missing blob is named, and leaves nothing behind.
    let missing = format!("sha256:{}", "0".repeat(64));
    let e = dirs
        .squashed(&cache, &[l1, missing.parse().unwrap()], &Limits::default())
        .unwrap_err();
    assert!(e.to_string().contains(&missing), "{e}");
    // The lock, the boot stamp, three trees and the two layers' directories they are made
    // of.
    assert_eq!(fs::read_dir(t.path().join("layers")).unwrap().count(), 7);
}

/// A lower layer's symlink (or file) where a later layer has a directory is replaced by
/// that directory in the squashed tree, as overlayfs stacks them: the later layer's
/// entries and whiteouts below it are never applied through the symlink (found by the
/// attack pass: `/tmp/attack/repro_squash_symlink.sh`, `repro_stage_tree.sh`).
#[test]
fn squashed_tree_never_writes_through_a_lower_symlink() {
    if !rustix::process::geteuid().is_root() {
        panic!("needs root (owners); CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let put = |blob: Vec<u8>| {
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        digest
    };
    let mut b = tar::Builder::new(Vec::new());
    for (name, target) in [("t/in", "/etc"), ("t/out", "../../../x")] {
        let mut h = hdr();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, name, target).unwrap();
    }
    let lower = put(tar_gz(&[
        ("etc/", None),
        ("etc/passwd", Some(b"root")),
        ("t/", None),
        ("t/file", Some(b"f")),
    ]));
    let links = put(b.into_inner().unwrap());
    let upper = put(tar_gz(&[
        ("t/in/.wh.passwd", Some(b"")),
        ("t/in/new", Some(b"n")),
        ("t/out/f", Some(b"o")),
        ("t/file/under", Some(b"u")),
    ]));
    let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
    let d = dirs
        .squashed(&cache, &[lower, links, upper], &Limits::default())
        .unwrap();
    assert_eq!(fs::read(d.join("etc/passwd")).unwrap(), b"root");
    assert!(!d.join("etc/new").exists());
    for (dir, file, data) in [
        ("t/in", "new", "n"),
        ("t/out", "f", "o"),
        ("t/file", "under", "u"),
    ] {
        assert!(fs::symlink_metadata(d.join(dir)).unwrap().is_dir(), "{dir}");
        assert_eq!(fs::read_to_string(d.join(dir).join(file)).unwrap(), data);
    }
    assert!(!t.path().join("x").exists());
}

/// An entry of a test layer ([`layer_of`]).
enum E<'a> {
    /// A directory: name, mode, uid, gid.
    Dir(&'a str, u32, u32, u32),
    /// A regular file: name, content, mode, uid.
    File(&'a str, &'a [u8], u32, u32),
    /// A symlink and its target.
    Sym(&'a str, &'a str),
    /// A hard link and its target.
    Hard(&'a str, &'a str),
    /// A FIFO.
    Fifo(&'a str),
    /// A character device: name, major, minor.
    Dev(&'a str, u32, u32),
    /// The xattr (name, value) of the next entry.
    Xattr(&'a str, &'a [u8]),
}

/// A gzip layer of `entries`, the n-th with mtime `mtime + n`.
fn layer_of(mtime: u64, entries: &[E<'_>]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (n, e) in entries.iter().enumerate() {
        let mut h = hdr();
        h.set_mtime(mtime + n as u64);
        h.set_size(0);
        match *e {
            E::Dir(name, mode, uid, gid) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(mode);
                h.set_uid(uid.into());
                h.set_gid(gid.into());
                b.append_data(&mut h, name, io::empty()).unwrap();
            }
            E::File(name, data, mode, uid) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(mode);
                h.set_uid(uid.into());
                h.set_size(data.len() as u64);
                b.append_data(&mut h, name, data).unwrap();
            }
            E::Sym(name, target) | E::Hard(name, target) => {
                h.set_entry_type(match e {
                    E::Sym(..) => tar::EntryType::Symlink,
                    _ => tar::EntryType::Link,
                });
                h.set_mode(0o777);
                b.append_link(&mut h, name, target).unwrap();
            }
            E::Fifo(name) | E::Dev(name, ..) => {
                h.set_entry_type(match e {
                    E::Fifo(_) => tar::EntryType::Fifo,
                    _ => tar::EntryType::Char,
                });
                if let E::Dev(_, major, minor) = *e {
                    h.set_device_major(major).unwrap();
                    h.set_device_minor(minor).unwrap();
                }
                h.set_mode(0o640);
                b.append_data(&mut h, name, io::empty()).unwrap();
            }
            E::Xattr(key, value) => b
                .append_pax_extensions([(format!("SCHILY.xattr.{key}").as_str(), value)])
                .unwrap(),
        }
    }
    b.into_inner().unwrap().finish().unwrap()
}

/// Every entry below `root`, sorted by path, as one line each: path, type, mode, owner,
/// mtime, kept xattrs, content (a file's bytes, a symlink's target, a device's numbers)
/// and the first path of its inode in the tree (hard links), as `COPY --from` and a mount
/// over the tree would see them.
fn describe(root: &Path) -> Vec<String> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, fs::Metadata, String)>) {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for name in names {
            let path = dir.join(&name);
            let rel = format!("{rel}/{}", name.to_string_lossy());
            let md = match fs::symlink_metadata(&path) {
                Ok(md) => md,
                // Overlayfs lists a whiteout in a directory it merges with no lower one
                // (`/t/in` here), and finds nothing by its name.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    eprintln!("{rel}: listed, not found");
                    continue;
                }
                Err(e) => panic!("{rel}: {e}"),
            };
            let ft = md.file_type();
            let content = if ft.is_file() {
                String::from_utf8_lossy(&fs::read(&path).unwrap()).into_owned()
            } else if ft.is_symlink() {
                fs::read_link(&path).unwrap().display().to_string()
            } else if ft.is_char_device() || ft.is_block_device() {
                format!("dev {}", md.rdev())
            } else {
                String::new()
            };
            let mut xattrs = Vec::new();
            let mut buf = vec![0u8; 4096];
            let n = rustix::fs::llistxattr(&path, &mut buf[..]).unwrap();
            for k in buf[..n].split(|b| *b == 0).filter(|k| !k.is_empty()) {
                if crate::layer::keep_xattr(k) {
                    let mut v = vec![0u8; 4096];
                    let m =
                        rustix::fs::lgetxattr(&path, std::ffi::OsStr::from_bytes(k), &mut v[..])
                            .unwrap();
                    xattrs.push(format!(
                        "{}={}",
                        String::from_utf8_lossy(k),
                        String::from_utf8_lossy(&v[..m])
                    ));
                }
            }
            xattrs.sort();
            let line = format!(
                "{rel} {:?} {:o} {}:{} {}.{} [{}] {content:?}",
                ft,
                md.mode() & 0o7777,
                md.uid(),
                md.gid(),
                md.mtime(),
                md.mtime_nsec(),
                xattrs.join(",")
            );
            let is_dir = ft.is_dir();
            out.push((rel.clone(), md, line));
            if is_dir {
                walk(&path, &rel, out);
            }
        }
    }
    let mut entries = Vec::new();
    walk(root, "", &mut entries);
    let mut first: std::collections::HashMap<(u64, u64), String> = Default::default();
    entries
        .into_iter()
        .map(|(rel, md, line)| {
            if md.is_dir() {
                return line;
            }
            let group = first.entry((md.dev(), md.ino())).or_insert(rel);
            format!("{line} inode of {group}")
        })
        .collect()
}

/// The merged tree of a stage is the tree its layers' blobs applied in order give (the
/// squash kiln made before, [`squash_from_blobs`]) and the tree an overlay mount of its
/// layer directories shows: whiteouts of files and directories, opaque directories, a
/// whiteout and the directory made again in one layer, a file replaced by a directory
/// and a directory by a file, hard links (one of them replaced later), a symlink of a
/// lower layer under a later layer's entries, owners, modes, setgid, xattrs, mtimes,
/// devices and FIFOs. Its files are the layer directories' inodes, not copies.
#[test]
fn squashed_tree_is_the_blob_squash_and_the_overlay_view() {
    if !rustix::process::geteuid().is_root() {
        panic!("needs root (owners, devices, overlay mounts); CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let put = |blob: Vec<u8>| {
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        digest
    };
    let l1 = put(layer_of(
        1_000,
        &[
            E::Dir("etc/", 0o755, 0, 0),
            E::File("etc/passwd", b"root", 0o644, 0),
            E::Dir("d/", 0o755, 0, 0),
            E::File("d/a", b"a", 0o644, 0),
            E::File("d/b", b"b", 0o600, 3),
            E::Dir("o/", 0o755, 0, 0),
            E::File("o/x", b"x", 0o644, 0),
            E::Dir("o/sub/", 0o755, 0, 0),
            E::File("o/sub/y", b"y", 0o644, 0),
            E::File("f", b"f1", 0o644, 0),
            E::Dir("dd/", 0o755, 0, 0),
            E::File("dd/z", b"z", 0o644, 0),
            E::File("h1", b"hard", 0o4755, 1000),
            E::Hard("h2", "h1"),
            E::Hard("h3", "h1"),
            E::Sym("lnk", "d"),
            E::Dir("t/", 0o755, 0, 0),
            E::File("t/file", b"f", 0o644, 0),
            E::File("gone", b"x", 0o644, 0),
            E::Dir("rm/", 0o755, 0, 0),
            E::File("rm/q", b"q", 0o644, 0),
            E::Dir("w/", 0o755, 0, 0),
            E::File("w/old", b"old", 0o644, 0),
            E::Fifo("fifo"),
            E::Dev("null", 1, 3),
            E::Xattr("user.k", b"v1"),
            E::File("xf", b"xf", 0o644, 0),
            E::Xattr("user.d", b"1"),
            E::Dir("xd/", 0o755, 0, 0),
            E::Dir("s/", 0o2775, 1000, 50),
            E::File("s/g", b"g", 0o664, 1000),
        ],
    ));
    let l2 = put(layer_of(
        2_000,
        &[
            E::File(".wh.gone", b"", 0o644, 0),
            E::File(".wh.rm", b"", 0o644, 0),
            E::Dir("d/", 0o750, 5, 6),
            E::File("d/.wh.a", b"", 0o644, 0),
            E::File("d/c", b"c", 0o644, 0),
            E::Dir("o/", 0o755, 0, 0),
            E::File("o/.wh..wh..opq", b"", 0o644, 0),
            E::File("o/new", b"n", 0o644, 0),
            E::Dir("f/", 0o711, 0, 0),
            E::File("f/inner", b"i", 0o644, 0),
            E::File("dd", b"now a file", 0o644, 0),
            E::Dir("t/", 0o755, 0, 0),
            E::Sym("t/in", "/etc"),
            E::Sym("t/out", "../../../x"),
            E::File("k1", b"k", 0o644, 0),
            E::Hard("k2", "k1"),
            E::Xattr("user.k", b"v2"),
            E::File("xf", b"xf2", 0o644, 0),
        ],
    ));
    let l3 = put(layer_of(
        3_000,
        &[
            E::Dir("t/", 0o755, 0, 0),
            E::Dir("t/in/", 0o755, 0, 0),
            E::File("t/in/.wh.passwd", b"", 0o644, 0),
            E::File("t/in/new", b"n", 0o644, 0),
            E::Dir("t/out/", 0o755, 0, 0),
            E::File("t/out/f", b"o", 0o644, 0),
            E::Dir("t/file/", 0o755, 0, 0),
            E::File("t/file/under", b"u", 0o644, 0),
            E::Dir("lnk/", 0o755, 0, 0),
            E::File("lnk/new", b"n", 0o644, 0),
            E::File(".wh.w", b"", 0o644, 0),
            E::Dir("w/", 0o755, 0, 0),
            E::File("w/new", b"new", 0o644, 0),
            E::Xattr("user.m", b"3"),
            E::Dir("d/", 0o700, 7, 8),
            E::File("h2", b"h2 again", 0o644, 0),
        ],
    ));
    let digests = [l1, l2, l3];
    let limits = Limits::default();
    let expected = t.path().join("from-blobs");
    fs::create_dir(&expected).unwrap();
    squash_from_blobs(&expected, &cache, &digests, &limits).unwrap();
    let want = describe(&expected);
    assert!(want.iter().any(|l| l.starts_with("/w/new ")), "{want:#?}");
    assert!(!want.iter().any(|l| l.starts_with("/w/old ")), "{want:#?}");

    let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
    let merged = dirs.squashed(&cache, &digests, &limits).unwrap();
    assert_eq!(describe(&merged), want);

    // The files are the layer directories' own.
    let ino = |p: &Path| fs::symlink_metadata(p).unwrap().ino();
    assert_eq!(ino(&merged.join("h1")), ino(&dirs.path(&l1).join("h1")));
    assert_eq!(ino(&merged.join("d/c")), ino(&dirs.path(&l2).join("d/c")));

    // What the steps saw: the layer directories stacked as overlay lowers.
    let lowers: Vec<PathBuf> = digests.iter().rev().map(|d| dirs.path(d)).collect();
    let scratch = t.path().join("mount");
    for d in ["upper", "work", "mnt"] {
        fs::create_dir_all(scratch.join(d)).unwrap();
    }
    let seen = crate::build::merged::with_merged(
        lowers,
        scratch.join("upper"),
        scratch.join("work"),
        scratch.join("mnt"),
        |root| Ok(describe(root)),
    )
    .unwrap();
    assert_eq!(seen, want);
}

/// The passes of their own over a layer (parents before a squash, whiteouts after an
/// unpack) read it through the bounded entry reader: a layer past the entry bound is
/// refused by the pass itself, before anything is applied, naming the bound.
#[test]
fn own_passes_over_a_layer_are_bounded() {
    let t = tempfile::tempdir().unwrap();
    let blob = tar_gz(&[
        ("a/", None),
        ("a/x", Some(b"x")),
        ("a/y", Some(b"y")),
        ("a/.wh.z", Some(b"")),
    ]);
    let limits = Limits {
        max_entries: 2,
        ..Limits::default()
    };
    let root = t.path().join("root");
    fs::create_dir(&root).unwrap();
    let err = own_parents(&root, &blob[..], "sha256:many", &limits).unwrap_err();
    assert!(
        matches!(
            err,
            LowerError::Layer(LayerError::Limit {
                kind: LimitKind::Entries,
                ..
            })
        ),
        "{err}"
    );
    assert_eq!(fs::read_dir(&root).unwrap().count(), 0);
    let err = mark_whiteouts(&root, &blob[..], None, "sha256:many", &limits).unwrap_err();
    assert!(err.to_string().contains("entry count exceeds"), "{err}");
}

/// A whiteout below a symlink the layer planted is dropped, never followed.
#[test]
fn whiteout_below_symlink_is_not_followed() {
    if !rustix::process::geteuid().is_root() {
        panic!("needs root; CI runs as root");
    }
    let t = tempfile::tempdir().unwrap();
    let victim = t.path().join("victim");
    fs::create_dir(&victim).unwrap();
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    let mut h = hdr();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    h.set_mode(0o777);
    b.append_link(&mut h, "s", &victim).unwrap();
    let mut h = hdr();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(0);
    h.set_mode(0o644);
    b.append_data(&mut h, "s/.wh.x", io::empty()).unwrap();
    let blob = b.into_inner().unwrap().finish().unwrap();
    let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
    let digest = BlobDigest::of(&blob);
    cache.put_bytes(&digest, &blob).unwrap();
    let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
    dirs.ensure(&cache, &digest, &Limits::default()).unwrap();
    assert_eq!(fs::read_dir(&victim).unwrap().count(), 0);
}
