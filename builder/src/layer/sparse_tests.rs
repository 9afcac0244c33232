//! Sparse files through the layer writer and applier: holes kept both ways, GNU tar's
//! sparse entries applied with their holes and bounded by apparent size, sparse maps bounded
//! like extension headers, PAX sparse formats refused. Moved out of `tests.rs` (the layer
//! tests' shared helpers stay there). They run as root, as those do.

use super::tests::*;
use super::*;
use std::fs;
use std::os::unix::fs::MetadataExt;
use tar::EntryType;

/// A file of `size` bytes holding `b"kiln"` at each offset of `at`, holes elsewhere.
fn sparse_file(path: &std::path::Path, size: u64, at: &[u64]) {
    use std::os::unix::fs::FileExt;
    fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
    let f = fs::File::create(path).expect("create");
    f.set_len(size).expect("set_len");
    for off in at {
        f.write_all_at(b"kiln", *off).expect("write_at");
    }
}

/// Asserts `path` has `size` bytes, `b"kiln"` at each offset of `at`, and at most
/// `max_alloc` bytes of allocated blocks (`st_blocks` × 512).
fn assert_sparse(path: &std::path::Path, size: u64, at: &[u64], max_alloc: u64, what: &str) {
    use std::os::unix::fs::FileExt;
    let md = fs::metadata(path).unwrap_or_else(|e| panic!("{what}: {}: {e}", path.display()));
    assert_eq!(md.len(), size, "{what}: apparent size");
    assert!(
        md.blocks() * 512 <= max_alloc,
        "{what}: {} allocates {} bytes (holes written as zeros?)",
        path.display(),
        md.blocks() * 512
    );
    let f = fs::File::open(path).expect("open");
    for off in at {
        let mut b = [0u8; 4];
        f.read_exact_at(&mut b, *off).expect("read_at");
        assert_eq!(&b, b"kiln", "{what}: data at {off}");
    }
}

/// Issue 17, case 4: holes survive layer capture and layer apply. A 1 GiB file with 30
/// pieces of data (more than the 4 slots of a GNU sparse header, so extension headers follow
/// it) and a 256 MiB file that is one hole (`useradd`'s `/var/log/lastlog`) are written by
/// `write_layer` as sparse entries: the blob is small, GNU tar lists them with their sizes
/// and extracts them with their data and holes, and `apply_layer` writes them with holes
/// (`st_blocks`) and the data in place. The layer's byte counts see only the data.
#[test]
fn sparse_files_keep_their_holes_through_write_and_apply() {
    let src = Sandbox::new();
    let at: Vec<u64> = (0..30u64).map(|i| i * (32 << 20) + 4096 * i).collect();
    sparse_file(&src.root().join("var/sparse.img"), 1 << 30, &at);
    sparse_file(&src.root().join("var/log/lastlog"), 256 << 20, &[]);
    let mut blob = Vec::new();
    let w = write::write_layer(&src.root(), &mut blob, Some(2_000_000)).expect("write layer");
    assert!(
        w.size < 64 << 10,
        "the layer blob holds the holes: {} bytes",
        w.size
    );

    // GNU tar reads the entries back: sizes listed, data and holes extracted.
    let d = tempfile::tempdir().expect("tempdir");
    let path = d.path().join("layer.tar.zst");
    fs::write(&path, &blob).expect("write blob");
    let out = std::process::Command::new("tar")
        .arg("-tvf")
        .arg(&path)
        .output()
        .expect("GNU tar");
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tar -tvf: {list}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (size, name) in [
        (1u64 << 30, "var/sparse.img"),
        (256 << 20, "var/log/lastlog"),
    ] {
        assert!(
            list.lines()
                .any(|l| l.ends_with(name) && l.split_whitespace().any(|w| w == size.to_string())),
            "tar -tvf lists {name} with {size} bytes:\n{list}"
        );
    }
    let x = d.path().join("x");
    fs::create_dir(&x).expect("mkdir");
    let out = std::process::Command::new("tar")
        .arg("-xf")
        .arg(&path)
        .arg("-C")
        .arg(&x)
        .output()
        .expect("GNU tar");
    assert!(
        out.status.success(),
        "tar -xf: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_sparse(&x.join("var/sparse.img"), 1 << 30, &at, 1 << 20, "tar -x");
    assert_sparse(&x.join("var/log/lastlog"), 256 << 20, &[], 0, "tar -x");

    // kiln's own reader.
    let dst = Sandbox::new();
    let stats = apply_layer(
        &dst.root(),
        &blob[..],
        &w.digest.to_string(),
        &Limits::default(),
    )
    .expect("apply the sparse layer");
    assert!(
        stats.bytes < 1 << 20,
        "uncompressed bytes read: {}",
        stats.bytes
    );
    assert_sparse(
        &dst.root().join("var/sparse.img"),
        1 << 30,
        &at,
        1 << 20,
        "apply_layer",
    );
    assert_sparse(
        &dst.root().join("var/log/lastlog"),
        256 << 20,
        &[],
        0,
        "apply_layer",
    );
    dst.assert_untouched("sparse apply");
}

/// A layer made by GNU tar (`--sparse`, old GNU format: type `S` entries) applies with its
/// holes; a sparse entry whose apparent size passes [`Limits::max_file_bytes`] is refused
/// although its data is small (the bound on apparent size), while the bound on unpacked
/// bytes still stops a layer of real zeros
/// ([`well_compressed_files_apply_and_the_byte_bound_names_the_entry`]).
#[test]
fn gnu_tar_sparse_entries_apply_with_holes_and_are_bounded_by_apparent_size() {
    let d = tempfile::tempdir().expect("tempdir");
    let src = d.path().join("src");
    let at = [0u64, 5 << 20, (64 << 20) - 4];
    sparse_file(&src.join("big"), 64 << 20, &at);
    let out = std::process::Command::new("tar")
        .args(["--sparse", "-H", "gnu", "-cf", "-", "-C"])
        .arg(&src)
        .arg("big")
        .output()
        .expect("GNU tar");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tar = out.stdout;
    assert!(tar.len() < 1 << 20, "GNU tar wrote {} bytes", tar.len());
    let s = Sandbox::new();
    s.apply(&tar).expect("apply GNU tar's sparse layer");
    assert_sparse(
        &s.root().join("big"),
        64 << 20,
        &at,
        256 << 10,
        "GNU tar layer",
    );

    let small = Limits {
        max_file_bytes: 32 << 20,
        ..Limits::default()
    };
    let s = Sandbox::new();
    match s.apply_with(&tar, &small) {
        Err(LayerError::Limit {
            kind: LimitKind::FileBytes,
            max,
            ..
        }) => assert_eq!(max, 32 << 20),
        other => panic!("a 64 MiB sparse file under a 32 MiB bound: {other:?}"),
    }
    assert!(fs::metadata(s.root().join("big")).is_err());
}

/// A GNU sparse entry's extension headers (its map past 4 pieces) are extension data the
/// `tar` reader keeps in memory (a list of pieces): they are bounded like PAX headers and
/// long names, by [`MAX_METADATA_BYTES`], before the reader takes them.
#[test]
fn sparse_maps_are_bounded_like_extension_headers() {
    let n = (MAX_METADATA_BYTES / 512 + 2) as usize;
    let mut h = header(b"s", EntryType::GNUSparse, 0, b"", 0o644);
    {
        let g = h.as_gnu_mut().expect("gnu header");
        g.set_real_size(n as u64 * 512);
        g.set_is_extended(true);
    }
    h.set_cksum();
    let mut ext = Vec::new();
    for i in 0..n {
        let mut e = tar::GnuExtSparseHeader::new();
        e.sparse_mut()[0].set_offset(i as u64 * 512);
        e.sparse_mut()[0].set_length(0);
        e.set_is_extended(i + 1 < n);
        ext.extend_from_slice(e.as_bytes());
    }
    let s = Sandbox::new();
    match s.apply(&tar_of(vec![E::Raw(h, ext)])) {
        Err(LayerError::Limit {
            kind: LimitKind::MetadataBytes,
            ..
        }) => {}
        other => panic!("{n} sparse extension headers: {other:?}"),
    }
    s.assert_untouched("sparse map bound");
}

/// `tar --posix --sparse` writes PAX sparse files (format 1.0: a `GNU.sparse.*` record and a
/// name under `GNUSparseFile.N/`, the map inside the data). Read as a plain file it would land
/// under that name holding the map: it is refused, naming the record, and nothing lands.
#[test]
fn pax_sparse_files_are_refused_not_misread() {
    let d = tempfile::tempdir().expect("tempdir");
    let src = d.path().join("src");
    sparse_file(&src.join("big"), 8 << 20, &[0, 4 << 20]);
    let out = std::process::Command::new("tar")
        .args(["--posix", "--sparse", "-cf", "-", "-C"])
        .arg(&src)
        .arg("big")
        .output()
        .expect("GNU tar");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = Sandbox::new();
    let e = s.apply(&out.stdout).expect_err("a PAX sparse file");
    let text = e.to_string();
    assert!(text.contains("GNU.sparse."), "{text}");
    assert!(!s.root().join("GNUSparseFile.0").exists(), "nothing landed");
    assert!(
        fs::read_dir(s.root()).map(|r| r.count()).unwrap_or(0) == 0,
        "nothing landed"
    );
}
