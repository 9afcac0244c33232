//! The layer writer's tests: a written layer applies back to the same tree, whiteout-named
//! files are refused, times settle to the layer's, and the two-thread zstd frame is the
//! one-thread frame of the same tar.

use super::*;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// A tree written by `write::write_layer` and applied again is the same tree (owners, modes,
/// devices, FIFOs, hard links, symlinks, xattrs, contents), and writing is deterministic.
#[test]
fn write_then_apply_round_trip() {
    let sb = Sandbox::new();
    let mut chr = header(b"dev/tty", EntryType::Char, 0, b"", 0o620);
    chr.set_device_major(5).expect("gnu header");
    chr.set_device_minor(0).expect("gnu header");
    chr.set_gid(5);
    chr.set_cksum();
    let mut suid = header(b"usr/bin/passwd", EntryType::Regular, 3, b"", 0o4755);
    suid.set_uid(0);
    suid.set_cksum();
    let long = format!("usr/share/{}/file", "long-directory-name".repeat(8));
    let t = tar_of(vec![
        E::Dir(b"dev/"),
        E::Raw(chr, vec![]),
        E::Raw(header(b"run/fifo", EntryType::Fifo, 0, b"", 0o600), vec![]),
        E::Raw(suid, b"pwd".to_vec()),
        E::Link(b"usr/bin/chfn", b"usr/bin/passwd"),
        E::Sym(b"bin", b"usr/bin"),
        E::Pax(vec![
            ("SCHILY.xattr.user.k", b"v"),
            ("path", long.as_bytes()),
        ]),
        E::File(b"placeholder", b"long"),
    ]);
    sb.apply(&t).expect("apply source tree");
    let mut first = Vec::new();
    let w1 = write::write_layer(&sb.root(), &mut first, Some(2_000_000)).expect("write");
    let mut second = Vec::new();
    let w2 = write::write_layer(&sb.root(), &mut second, Some(2_000_000)).expect("write again");
    assert_eq!(w1, w2, "deterministic");
    assert_eq!(first, second);
    assert_eq!(w1.size, first.len() as u64);
    assert_eq!(kiln_store::BlobDigest::of(&first), w1.digest);
    let copy = Sandbox::new();
    apply_layer(
        &copy.root(),
        &first[..],
        &w1.digest.to_string(),
        &Limits::default(),
    )
    .expect("apply written layer");
    assert_eq!(
        kiln_tests::tree_listing(&sb.root()),
        kiln_tests::tree_listing(&copy.root())
    );
    let md = fs::metadata(copy.root().join("usr/bin/chfn")).expect("stat");
    assert_eq!(md.nlink(), 2, "hard link kept");
    assert!(copy.root().join(&long).is_file(), "long names kept");
}

/// A file named `.wh.*` is refused by the layer writer, upper or plain tree, wherever it is:
/// stored as it is, the name would delete what it names from the image (a `COPY f /.wh.bin`
/// removed `/bin` from the published image while the build's steps still saw it; found by
/// the attack pass).
#[test]
fn whiteout_named_files_are_refused_by_the_layer_writer() {
    for name in [".wh.bin", "etc/.wh..wh..opq", "a/b/.wh.x"] {
        let t = tempfile::tempdir().expect("tempdir");
        let path = t.path().join(name);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, b"x").expect("write");
        for upper in [false, true] {
            let mut out = Vec::new();
            let r = if upper {
                write::write_upper_layer(t.path(), &mut out, None)
            } else {
                write::write_layer(t.path(), &mut out, None)
            };
            let e = r.expect_err(name).to_string();
            assert!(
                e.contains(&format!("/{name}")) && e.contains("marks a deletion"),
                "{e}"
            );
        }
    }
}

/// An upper directory's times become its layer's (whole seconds, at most the epoch, access
/// time equal), below it at any depth, and a symlink's target outside is never touched.
#[test]
fn settled_times_are_the_layers() {
    let t = tempfile::tempdir().unwrap();
    let outside = t.path().join("outside");
    fs::write(&outside, b"o").unwrap();
    let upper = t.path().join("upper");
    fs::create_dir_all(upper.join("d/e")).unwrap();
    fs::write(upper.join("d/e/f"), b"f").unwrap();
    fs::write(upper.join("old"), b"old").unwrap();
    std::os::unix::fs::symlink(&outside, upper.join("d/link")).unwrap();
    let set = |p: &Path, secs: i64, nsec: i64| {
        let ts = rustix::fs::Timespec {
            tv_sec: secs,
            tv_nsec: nsec,
        };
        rustix::fs::utimensat(
            rustix::fs::CWD,
            p,
            &Timestamps {
                last_access: ts,
                last_modification: ts,
            },
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .unwrap();
    };
    set(&upper.join("old"), 1_000, 500);
    set(&outside, 2_000_000_000, 7);
    let epoch = 1_700_000_000;
    write::settle_times(&upper, Some(epoch as u64)).unwrap();
    for p in ["d", "d/e", "d/e/f", "d/link"] {
        let md = fs::symlink_metadata(upper.join(p)).unwrap();
        assert_eq!(
            (md.mtime(), md.mtime_nsec(), md.atime()),
            (epoch, 0, epoch),
            "{p}"
        );
    }
    let md = fs::symlink_metadata(upper.join("old")).unwrap();
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_000, 0));
    let md = fs::metadata(&outside).unwrap();
    assert_eq!((md.mtime(), md.mtime_nsec()), (2_000_000_000, 7));
    // Without an epoch, whole seconds only.
    set(&upper.join("d/e/f"), 1_800_000_000, 999);
    write::settle_times(&upper, None).unwrap();
    let md = fs::symlink_metadata(upper.join("d/e/f")).unwrap();
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_800_000_000, 0));
}

/// Issue 34: a layer written with the tar on one thread and zstd on another
/// ([`write::write_layer`]) is byte for byte the one-thread zstd frame of its tar, whatever
/// the pieces it was handed over in: the same blob digest as before the split, and its diff
/// id is the tar's sha256. Several MiB, so that many pieces and zstd blocks pass.
#[test]
fn a_layer_is_the_one_thread_zstd_frame_of_its_tar() {
    let t = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    let mut text = Vec::new();
    while text.len() < 5 << 20 {
        let x = rng.next_u64();
        text.extend_from_slice(format!("line {} of {}\n", x >> 40, x % 97).as_bytes());
    }
    fs::create_dir_all(t.path().join("usr/lib")).unwrap();
    fs::write(t.path().join("usr/lib/big"), &text).unwrap();
    for i in 0..300 {
        fs::write(
            t.path().join(format!("usr/f{i}")),
            format!("{i}\n").repeat(i),
        )
        .unwrap();
    }
    let mut blob = Vec::new();
    let w = write::write_layer(t.path(), &mut blob, Some(1_700_000_000)).unwrap();
    assert_eq!(kiln_store::BlobDigest::of(&blob), w.digest);
    assert_eq!(w.size, blob.len() as u64);
    let tar = zstd::stream::decode_all(&blob[..]).unwrap();
    assert!(tar.len() > 5 << 20);
    assert_eq!(kiln_store::digest::Sha256Hash::of(&tar), w.diff_id);
    let mut z = zstd::stream::write::Encoder::new(Vec::new(), write::ZSTD_LEVEL).unwrap();
    z.include_checksum(true).unwrap();
    z.write_all(&tar).unwrap();
    assert!(
        z.finish().unwrap() == blob,
        "not the one-thread frame of its tar"
    );
}
