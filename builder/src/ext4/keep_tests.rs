//! The flatten's kept inflated layers ([`Keep`]) and the prescan of a build's base
//! ([`Prescan`]): pass 2 reads what pass 1 kept, within its bounds, and a prescan continued
//! gives the image a whole flatten gives.

use std::path::Path;

use super::tests::*;
use super::*;

/// The length of a layer blob's decompressed stream.
fn inflated_len(blob: &LayerBlob) -> u64 {
    let f = std::fs::File::open(&blob.path).unwrap();
    let mut r = crate::build::lower::decompressed(f).unwrap();
    std::io::copy(&mut r, &mut std::io::sink()).unwrap()
}

#[test]
fn pass_two_reads_the_kept_inflated_layers_not_the_blobs() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let mut want = Vec::new();
    flatten(&layers, &mut want, &Limits::default(), None).unwrap();
    let keep_dir = tempfile::tempdir().unwrap();
    let keep = Keep {
        dir: keep_dir.path().to_path_buf(),
        max_bytes: u64::MAX,
    };
    let flat = Flat::scan_keeping(&layers, &Limits::default(), None, DEFAULT_EPOCH, &keep).unwrap();
    // The gzip and the zstd layer are kept, the plain one is read from its blob.
    assert_eq!(flat.stats.layers_kept, 2, "{:?}", flat.stats);
    assert!(flat.stats.kept_bytes >= 1024, "{:?}", flat.stats);
    assert_eq!(
        std::fs::read_dir(keep_dir.path()).unwrap().count(),
        0,
        "the copies are unlinked"
    );
    // Pass 2 no longer needs the compressed blobs; twice, as a retry at a larger size does.
    std::fs::remove_file(&layers[0].path).unwrap();
    std::fs::remove_file(&layers[1].path).unwrap();
    for _ in 0..2 {
        let mut out = Vec::new();
        flat.write(&mut out).unwrap();
        assert!(out == want, "the same tar as from the blobs");
    }
}

#[test]
fn layers_past_the_keep_limit_are_inflated_again_to_the_same_bytes() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let mut want = Vec::new();
    flatten(&layers, &mut want, &Limits::default(), None).unwrap();
    let keep_dir = tempfile::tempdir().unwrap();
    // Room for the gzip layer's stream (the tar reader reads at most all of it) and not
    // for the zstd layer's too.
    let keep = Keep {
        dir: keep_dir.path().to_path_buf(),
        max_bytes: inflated_len(&layers[0]),
    };
    let flat = Flat::scan_keeping(&layers, &Limits::default(), None, DEFAULT_EPOCH, &keep).unwrap();
    assert_eq!(flat.stats.layers_kept, 1, "{:?}", flat.stats);
    assert!(flat.stats.kept_bytes <= keep.max_bytes, "{:?}", flat.stats);
    std::fs::remove_file(&layers[0].path).unwrap();
    let mut out = Vec::new();
    flat.write(&mut out).unwrap();
    assert!(out == want, "the same tar with one layer inflated again");
    // The zstd layer is read from its blob.
    std::fs::remove_file(&layers[1].path).unwrap();
    assert!(matches!(
        flat.write(std::io::sink()),
        Err(Ext4Error::Io { .. })
    ));

    // Nothing kept: the same image bytes as with every layer kept.
    let layers = three_layers(d.path());
    let a = d.path().join("kept.ext4");
    let b = d.path().join("none.ext4");
    let ka = build_inner(None, &layers, &a, &opts(), None).unwrap();
    let kb = build_inner(None, &layers, &b, &opts(), Some(0)).unwrap();
    assert_eq!((ka.stats.layers_kept, kb.stats.layers_kept), (2, 0));
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
}

#[test]
fn a_kept_layer_is_bounded_like_the_layer() {
    let d = tempfile::tempdir().unwrap();
    let layers = vec![blob(d.path(), &[E::File("f", &[0u8; 1 << 20])], Z::Gzip)];
    let limits = Limits {
        max_total_bytes: 64 << 10,
        ..Limits::default()
    };
    let keep_dir = tempfile::tempdir().unwrap();
    let keep = Keep {
        dir: keep_dir.path().to_path_buf(),
        max_bytes: u64::MAX,
    };
    let err = match Flat::scan_keeping(&layers, &limits, None, DEFAULT_EPOCH, &keep) {
        Err(e) => e,
        Ok(_) => panic!("1 MiB inflated under a 64 KiB bound"),
    };
    assert!(
        matches!(
            err,
            Ext4Error::Layer(LayerError::Limit {
                kind: crate::layer::LimitKind::TotalBytes,
                ..
            })
        ),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(keep_dir.path()).unwrap().count(), 0);
}

#[test]
fn a_prescan_of_the_bottom_layers_is_continued_to_the_same_image() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let whole = d.path().join("whole.ext4");
    build(&layers, &whole, &opts()).unwrap();
    let keep_dir = tempfile::tempdir().unwrap();
    let keep = Keep {
        dir: keep_dir.path().to_path_buf(),
        max_bytes: u64::MAX,
    };
    let p = Prescan::start(layers[..2].to_vec(), &Limits::default(), None, keep.clone());
    let started = p.clone().take().expect("the prescan read both layers");
    assert!(p.take().is_none(), "taken once");
    assert_eq!(started.layers(), &layers[..2]);
    // The prescanned layers are not read again: their blobs can go.
    std::fs::remove_file(&layers[0].path).unwrap();
    std::fs::remove_file(&layers[1].path).unwrap();
    let cont = d.path().join("continued.ext4");
    let built = build_from(Some(started), &layers, &cont, &opts()).unwrap();
    assert_eq!(built.stats.layers_kept, 2, "{:?}", built.stats);
    assert!(std::fs::read(&whole).unwrap() == std::fs::read(&cont).unwrap());

    // Made with another SOURCE_DATE_EPOCH (or other layers): not continued; the flatten
    // scans from the start and makes the image the options say.
    let layers = three_layers(d.path());
    let sde = Ext4Options {
        source_date_epoch: Some(1_550_000_000),
        ..opts()
    };
    let want = d.path().join("sde.ext4");
    build(&layers, &want, &sde).unwrap();
    for (p, o) in [
        (
            Prescan::start(layers[..2].to_vec(), &Limits::default(), None, keep.clone()),
            &sde,
        ),
        (
            Prescan::start(
                layers[1..].to_vec(),
                &Limits::default(),
                Some(1_550_000_000),
                keep.clone(),
            ),
            &sde,
        ),
    ] {
        let got = d.path().join("other.ext4");
        build_from(p.take(), &layers, &got, o).unwrap();
        assert!(std::fs::read(&want).unwrap() == std::fs::read(&got).unwrap());
    }
    assert_eq!(std::fs::read_dir(keep_dir.path()).unwrap().count(), 0);
}

/// Files this process holds open under `dir` (unlinked ones too: `/proc/self/fd` names them
/// `DIR/#N (deleted)`).
fn open_under(dir: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.starts_with(dir))
        .count()
}

#[test]
fn a_failed_or_dropped_prescan_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let keep_dir = tempfile::tempdir().unwrap();
    let keep = Keep {
        dir: keep_dir.path().to_path_buf(),
        max_bytes: u64::MAX,
    };
    // A layer past the bounds: the prescan ends with nothing, and the build says why.
    let big = vec![blob(d.path(), &[E::File("f", &[0u8; 1 << 20])], Z::Gzip)];
    let limits = Limits {
        max_total_bytes: 64 << 10,
        ..Limits::default()
    };
    let p = Prescan::start(big.clone(), &limits, None, keep.clone());
    assert!(p.take().is_none());
    let o = Ext4Options { limits, ..opts() };
    let err = build_from(None, &big, &d.path().join("x.ext4"), &o).unwrap_err();
    assert!(err.to_string().contains("limit"), "{err}");
    // Dropped untaken, running or done: the thread is stopped and waited for, and its
    // copies are gone.
    let layers = three_layers(d.path());
    let held = Prescan::start(layers.clone(), &Limits::default(), None, keep.clone())
        .take()
        .unwrap();
    assert_eq!(
        open_under(keep_dir.path()),
        2,
        "the two compressed layers' copies"
    );
    drop(held);
    assert_eq!(open_under(keep_dir.path()), 0);
    drop(Prescan::start(
        layers.clone(),
        &Limits::default(),
        None,
        keep.clone(),
    ));
    let p = Prescan::start(layers, &Limits::default(), None, keep);
    std::thread::sleep(std::time::Duration::from_millis(50));
    drop(p);
    assert_eq!(open_under(keep_dir.path()), 0);
    assert_eq!(std::fs::read_dir(keep_dir.path()).unwrap().count(), 0);
}
