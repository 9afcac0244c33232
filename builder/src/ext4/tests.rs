//! Flattening and ext4 building on synthetic layers, with the real e2fsprogs.

use std::io::Write;
use std::path::Path;

use super::*;
use crate::cache::digest_of;

pub(super) enum E<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8]),
    FileMeta(&'a str, &'a [u8], u32, u32, u32, u64),
    FileX(&'a str, &'a [u8], &'a [(&'a str, &'a [u8])]),
    Sym(&'a str, &'a str),
    /// A symlink whose header gives a mode other than 0777.
    SymMode(&'a str, &'a str, u32),
    /// A symlink with xattrs.
    SymX(&'a str, &'a str, &'a [(&'a str, &'a [u8])]),
    Hard(&'a str, &'a str),
    Char(&'a str, u32, u32),
    Fifo(&'a str),
}

pub(super) fn tar_of(entries: &[E<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        match e {
            E::Dir(p, mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                h.set_size(0);
                b.append_data(&mut h, p, std::io::empty()).unwrap();
            }
            E::File(p, d) => {
                h.set_size(d.len() as u64);
                b.append_data(&mut h, p, *d).unwrap();
            }
            E::FileMeta(p, d, mode, uid, gid, mtime) => {
                h.set_size(d.len() as u64);
                h.set_mode(*mode);
                h.set_uid(*uid as u64);
                h.set_gid(*gid as u64);
                h.set_mtime(*mtime);
                b.append_data(&mut h, p, *d).unwrap();
            }
            E::FileX(p, d, xs) => {
                let recs: Vec<(String, &[u8])> = xs
                    .iter()
                    .map(|(k, v)| (format!("SCHILY.xattr.{k}"), *v))
                    .collect();
                b.append_pax_extensions(recs.iter().map(|(k, v)| (k.as_str(), *v)))
                    .unwrap();
                h.set_size(d.len() as u64);
                b.append_data(&mut h, p, *d).unwrap();
            }
            E::Sym(p, t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::SymMode(p, t, mode) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(*mode);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::SymX(p, t, xs) => {
                let recs: Vec<(String, &[u8])> = xs
                    .iter()
                    .map(|(k, v)| (format!("SCHILY.xattr.{k}"), *v))
                    .collect();
                b.append_pax_extensions(recs.iter().map(|(k, v)| (k.as_str(), *v)))
                    .unwrap();
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Hard(p, t) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Char(p, ma, mi) => {
                h.set_entry_type(tar::EntryType::Char);
                h.set_device_major(*ma).unwrap();
                h.set_device_minor(*mi).unwrap();
                h.set_size(0);
                b.append_data(&mut h, p, std::io::empty()).unwrap();
            }
            E::Fifo(p) => {
                h.set_entry_type(tar::EntryType::Fifo);
                h.set_size(0);
                b.append_data(&mut h, p, std::io::empty()).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

#[derive(Clone, Copy)]
pub(super) enum Z {
    Plain,
    Gzip,
    Zstd,
}

pub(super) fn blob(dir: &Path, entries: &[E<'_>], z: Z) -> LayerBlob {
    let raw = tar_of(entries);
    let bytes = match z {
        Z::Plain => raw,
        Z::Gzip => {
            let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            g.write_all(&raw).unwrap();
            g.finish().unwrap()
        }
        Z::Zstd => zstd::encode_all(&raw[..], 3).unwrap(),
    };
    let digest = digest_of(&bytes).to_string();
    let path = dir.join(&digest[7..]);
    std::fs::write(&path, &bytes).unwrap();
    LayerBlob { digest, path }
}

pub(super) fn opts() -> Ext4Options {
    Ext4Options {
        disk_mib: None,
        max_mib: DEFAULT_MAX_MIB,
        source_date_epoch: None,
        limits: Limits::default(),
    }
}

pub(super) const LONG: &str = "a-name-longer-than-one-hundred-bytes-so-that-the-writer-needs-a-pax-path-record-\
                    for-it-and-then-some-more.txt";

pub(super) fn three_layers(dir: &Path) -> Vec<LayerBlob> {
    let long_target = "t/".repeat(60);
    let l0 = blob(
        dir,
        &[
            E::Dir("etc/", 0o755),
            E::File("etc/a", b"A0"),
            E::FileMeta("etc/b", b"B", 0o600, 5, 6, 1_500_000_000),
            E::Dir("etc/opq/", 0o750),
            E::File("etc/opq/old", b"old"),
            E::File("data/h1", b"shared"),
            E::Dir("gone/", 0o755),
            E::File("gone/x", b"x"),
            E::Dir("rep/", 0o755),
            E::File("rep/child", b"c"),
            E::Dir("usr/", 0o755),
            E::Dir("usr/lib/", 0o755),
            E::Sym("lib", "usr/lib"),
            E::Char("dev/null", 1, 3),
            E::Fifo("fifo"),
            E::FileX(
                "cap",
                b"#!/bin/true\n",
                &[
                    ("user.kiln", b"v"),
                    (
                        "security.capability",
                        &[1, 0, 0, 2, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    ),
                    ("trusted.kiln", b"\x00binary\xff"),
                ],
            ),
            E::FileMeta(LONG, b"long", 0o4755, 1000, 1000, 1_600_000_001),
            E::Sym("longlink", &long_target),
        ],
        Z::Gzip,
    );
    let l1 = blob(
        dir,
        &[
            E::File("etc/a", b"A1"),
            E::File(".wh.gone", b""),
            E::File("etc/opq/new", b"new"),
            E::File("etc/opq/.wh..wh..opq", b""),
            E::File("rep", b"now a file"),
            E::Hard("data/h2", "data/h1"),
            E::File("lib/in-lib", b"through the symlink"),
            E::File("etc/.wh.b", b""),
        ],
        Z::Zstd,
    );
    let l2 = blob(
        dir,
        &[
            E::File("data/h1", b"replaced"),
            E::File("newdir/deep/f", b"implicit parents"),
            E::Hard("newdir/h3", "data/h2"),
        ],
        Z::Plain,
    );
    vec![l0, l1, l2]
}

#[test]
fn flatten_applies_whiteouts_links_and_symlinked_parents() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let mut out = Vec::new();
    let stats = flatten(&layers, &mut out, &Limits::default(), None).unwrap();
    let tree = kiln_tests::ext4::tar_tree(&out);
    let keys: Vec<&str> = tree.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        vec![
            LONG,
            "cap",
            "data",
            "data/h1",
            "data/h2",
            "dev",
            "dev/null",
            "etc",
            "etc/a",
            "etc/opq",
            "etc/opq/new",
            "fifo",
            "lib",
            "longlink",
            "newdir",
            "newdir/deep",
            "newdir/deep/f",
            "newdir/h3",
            "rep",
            "usr",
            "usr/lib",
            "usr/lib/in-lib",
        ]
    );
    let hash = |b: &[u8]| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b));
    assert_eq!(tree["etc/a"].hash, hash(b"A1"));
    assert_eq!(tree["data/h1"].hash, hash(b"replaced"));
    // data/h2 was a link to the old data/h1: it keeps the old content, and so does h3.
    assert_eq!(tree["data/h2"].hash, hash(b"shared"));
    assert_eq!(tree["newdir/h3"].hash, hash(b"shared"));
    assert_eq!(tree["rep"].kind, 'f');
    assert_eq!(tree["etc/opq"].mode, 0o750);
    assert_eq!(tree["data"].mode, 0o755, "implicit parent");
    assert_eq!(tree["dev/null"].kind, 'c');
    assert_eq!(tree[LONG].mode, 0o4755);
    assert_eq!((tree[LONG].uid, tree[LONG].gid), (1000, 1000));
    assert_eq!(tree["longlink"].link.len(), 120);
    assert_eq!(tree["cap"].xattrs.len(), 3);
    assert_eq!(stats.files, 9, "{stats:?}");
    assert_eq!(stats.extra_links, 1, "{stats:?}");

    // Layer order: the surviving entries of layer 0 come before those of layer 1.
    let mut order = Vec::new();
    for e in tar::Archive::new(&out[..]).entries().unwrap() {
        let e = e.unwrap();
        order.push(String::from_utf8_lossy(&e.path_bytes()).into_owned());
    }
    let at = |n: &str| order.iter().position(|p| p == n).unwrap();
    assert!(at("cap") < at("etc/opq/new"), "{order:?}");
    // etc/a replaced in layer 1 is written in place: at layer 0's position.
    assert!(at("etc/a") < at("cap"), "{order:?}");
    assert_eq!(stats.in_place, 1, "{stats:?}");
    // The carrier of the shared inode is written at layer 0's position under its new name;
    // data/h1's replacement (layer 2) is not in place, the old inode lives on as data/h2.
    assert!(at("data/h2") < at("cap"), "{order:?}");
    assert!(at("etc/opq/new") < at("data/h1"), "{order:?}");
}

#[test]
fn ext4_reads_back_as_the_flattened_tar() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let mut out = Vec::new();
    flatten(&layers, &mut out, &Limits::default(), None).unwrap();
    let img = d.path().join("root.ext4");
    let built = build(&layers, &img, &opts()).unwrap();
    assert_eq!(built.filesystem.block_size, 4096);
    assert_eq!(
        std::fs::metadata(&img).unwrap().len(),
        built.size_bytes,
        "the file has the recorded size"
    );
    let diffs = kiln_tests::ext4::compare(
        &kiln_tests::ext4::tar_tree(&out),
        &kiln_tests::ext4::image_tree(&img),
    );
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
    let dump = std::process::Command::new("dumpe2fs")
        .arg("-h")
        .arg(&img)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&dump.stdout);
    let feats: Vec<&str> = text
        .lines()
        .find_map(|l| l.strip_prefix("Filesystem features:"))
        .unwrap()
        .split_whitespace()
        .collect();
    let mut want: Vec<&str> = FEATURES.to_vec();
    let mut got = feats.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want, "exactly the pinned features");
    assert!(text.contains(&fs_uuid(ROOTFS_SEED)), "{text}");
    assert!(text.contains("Block size:               4096"), "{text}");
}

#[test]
fn identical_input_gives_identical_bytes() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let sha = |p: &Path| crate::cache::digest_of_file(p).unwrap();
    let a = d.path().join("a.ext4");
    let b = d.path().join("b.ext4");
    let c = d.path().join("c.ext4");
    build(&layers, &a, &opts()).unwrap();
    build(&layers, &b, &opts()).unwrap();
    build(&layers[..1], &c, &opts()).unwrap();
    assert_eq!(sha(&a), sha(&b));
    assert_ne!(sha(&a), sha(&c), "another tree, another image");
    // ... with the same identity: it does not follow the tree.
    for img in [&a, &c] {
        let s = debugfs_says(img, "stats");
        assert!(s.contains(&fs_uuid(ROOTFS_SEED)), "{s}");
        assert!(s.contains(&hash_seed(ROOTFS_SEED)), "{s}");
    }
    let mut sde = opts();
    sde.source_date_epoch = Some(1_550_000_000);
    let e = d.path().join("e.ext4");
    build(&layers, &e, &sde).unwrap();
    let tree = kiln_tests::ext4::image_tree(&e);
    assert!(tree.values().all(|o| o.mtime <= 1_550_000_000));
    assert_eq!(tree["etc/a"].mtime, 1_550_000_000);
}

/// Issue 17, fault 3: with the image on a full host file system (a 64 MiB tmpfs), mke2fs
/// fails with "No space left on device". That is reported as what it is, with the path and
/// the free space, not retried larger and not called "image too large". Needs root (mount).
#[test]
fn a_full_host_file_system_is_no_space_not_image_too_large() {
    assert!(
        rustix::process::geteuid().is_root(),
        "mounting a tmpfs needs root (CI runs the tests as root)"
    );
    let d = tempfile::tempdir().unwrap();
    let big = vec![7u8; 100 << 20];
    let layers = vec![blob(d.path(), &[E::File("big", &big)], Z::Plain)];
    let small = d.path().join("small");
    std::fs::create_dir(&small).unwrap();
    rustix::mount::mount(
        "tmpfs",
        &small,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        Some(c"size=64m"),
    )
    .unwrap();
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = rustix::mount::unmount(self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }
    let _unmount = Unmount(&small);
    let dest = small.join("x.ext4");
    let err = build(&layers, &dest, &opts()).unwrap_err();
    let msg = err.to_string();
    let Ext4Error::NoSpace(e) = &err else {
        panic!("expected NoSpace, got: {msg}");
    };
    assert_eq!(e.path, dest);
    assert_eq!(e.total_bytes, Some(64 << 20));
    // The partial image is gone, so (nearly) all of the tmpfs is free again.
    assert!(e.free_bytes.unwrap() > 60 << 20, "{msg}");
    assert!(e.needs_bytes.unwrap() > 100 << 20, "{msg}");
    assert!(
        msg.starts_with(&format!(
            "no space left on device: writing the ext4 image {}: the file system holding it \
             has ",
            dest.display()
        )) && msg.contains(" free of 64.0 MiB (about "),
        "{msg}"
    );
    assert!(!dest.exists());
}

#[test]
fn fixed_size_too_small_is_refused_with_numbers() {
    let d = tempfile::tempdir().unwrap();
    let big = vec![7u8; 3 << 20];
    let layers = vec![blob(d.path(), &[E::File("big", &big)], Z::Gzip)];
    let mut o = opts();
    o.disk_mib = Some(8);
    let err = build(&layers, &d.path().join("x.ext4"), &o).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("image too large: needs ") && msg.ends_with(" MiB, limit 8 MiB"),
        "{msg}"
    );
    assert!(!d.path().join("x.ext4").exists());
    // Given enough room it fits, at exactly the size asked for.
    o.disk_mib = Some(64);
    let img = build(&layers, &d.path().join("y.ext4"), &o).unwrap();
    assert_eq!(img.size_bytes, 64 << 20);
}

#[test]
fn hostile_layers_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<E<'_>>, &str)> = vec![
        (
            vec![E::Sym("esc", "../../.."), E::File("esc/x", b"x")],
            "outside the root",
        ),
        (vec![E::Hard("h", "missing")], "does not exist"),
        (
            vec![E::Dir("d/", 0o755), E::Hard("h", "d")],
            "is a directory",
        ),
        (
            vec![E::File("f", b"x"), E::File("f/y", b"y")],
            "not a directory",
        ),
        (vec![E::File("d/.wh..", b"")], "malformed whiteout"),
    ];
    for (entries, want) in cases {
        let layers = vec![blob(d.path(), &entries, Z::Plain)];
        let err = flatten(&layers, std::io::sink(), &Limits::default(), None).unwrap_err();
        assert!(err.to_string().contains(want), "{err} (wanted {want:?})");
    }
    // A hard link whose target escapes through `..`, and a name with `..`, written raw.
    let mut raw = tar_of(&[E::File("ok", b"x")]);
    raw.truncate(raw.len() - 1024);
    let mut h = tar::Header::new_gnu();
    h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../escape");
    h.set_size(0);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    raw.extend_from_slice(h.as_bytes());
    raw.extend_from_slice(&[0u8; 1024]);
    let digest = digest_of(&raw).to_string();
    let path = d.path().join("raw");
    std::fs::write(&path, &raw).unwrap();
    let err = flatten(
        &[LayerBlob { digest, path }],
        std::io::sink(),
        &Limits::default(),
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("'..'"), "{err}");
    // Bounds apply: a file over max_file_bytes.
    let layers = vec![blob(d.path(), &[E::File("f", &[1u8; 4096])], Z::Gzip)];
    let limits = Limits {
        max_file_bytes: 100,
        ..Limits::default()
    };
    let err = flatten(&layers, std::io::sink(), &limits, None).unwrap_err();
    assert!(err.to_string().contains("file size exceeds"), "{err}");
}

#[test]
fn what_the_scan_keeps_is_bounded() {
    let d = tempfile::tempdir().unwrap();
    let long = "n".repeat(200);
    let names: Vec<String> = (0..20).map(|i| format!("{long}{i}")).collect();
    let entries: Vec<E<'_>> = names.iter().map(|n| E::File(n, b"x")).collect();
    let layers = vec![blob(d.path(), &entries, Z::Gzip)];
    let err = match Flat::scan_bounded(&layers, &Limits::default(), None, 0, 2048, None) {
        Err(e) => e,
        Ok(_) => panic!("4 KiB of names kept under a 2 KiB bound"),
    };
    assert!(
        matches!(err, Ext4Error::ScanTooLarge { limit: 2048, .. }),
        "{err}"
    );
    assert!(Flat::scan_bounded(&layers, &Limits::default(), None, 0, 8192, None).is_ok());
}

#[test]
fn tools_check_passes_here() {
    let t = check_tools().expect("ci/setup.sh installs e2fsprogs 1.47.2 and libarchive13");
    assert!(parse_version(&t.version).unwrap() >= MIN_E2FSPROGS);
    assert_eq!(parse_version("1.47.0"), Some((1, 47, 0)));
    assert!(parse_version("1.47.0").unwrap() < MIN_E2FSPROGS);
}

#[test]
fn uuids_are_well_formed_and_seeded() {
    let u = fs_uuid("sha256:abc");
    assert_eq!(u.len(), 36);
    assert_eq!(&u[14..15], "4");
    assert_ne!(u, fs_uuid("sha256:abd"));
    assert_ne!(u, hash_seed("sha256:abc"));
}

/// One raw entry: name, kind, data, link target (bytes as given, uncleaned).
pub(super) type RawEntry<'a> = (&'a [u8], tar::EntryType, &'a [u8], &'a [u8]);

/// A tar of raw GNU headers.
pub(super) fn raw_tar(entries: &[RawEntry<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, data, link) in entries {
        let mut h = tar::Header::new_gnu();
        let gnu = h.as_gnu_mut().unwrap();
        gnu.name[..name.len()].copy_from_slice(name);
        gnu.linkname[..link.len()].copy_from_slice(link);
        h.set_entry_type(*kind);
        h.set_size(data.len() as u64);
        h.set_mode(if kind.is_dir() { 0o755 } else { 0o644 });
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

/// Issue 17, case 3, for the flattener: the tree `umoci insert ROOTFS /` makes (the root as
/// an entry named `/`, absolute names, an absolute hard-link target) flattens to the same
/// names `apply_layer` gives them, inside the root.
#[test]
fn absolute_names_and_a_root_named_slash_flatten_inside_the_root() {
    use tar::EntryType as T;
    let d = tempfile::tempdir().unwrap();
    let raw = raw_tar(&[
        (b"/", T::Directory, b"", b""),
        (b"/tmp/", T::Directory, b"", b""),
        (b"/tmp/x", T::Regular, b"x", b""),
        (b"//etc//conf", T::Regular, b"c", b""),
        (b"/etc/conf-link", T::Link, b"", b"/etc/conf"),
    ]);
    let path = d.path().join("abs");
    std::fs::write(&path, &raw).unwrap();
    let layers = [LayerBlob {
        digest: digest_of(&raw).to_string(),
        path,
    }];
    let mut out = Vec::new();
    let stats = flatten(&layers, &mut out, &Limits::default(), None).unwrap();
    let tree = kiln_tests::ext4::tar_tree(&out);
    let keys: Vec<&str> = tree.keys().map(String::as_str).collect();
    assert_eq!(keys, ["etc", "etc/conf", "etc/conf-link", "tmp", "tmp/x"]);
    assert_eq!(stats.extra_links, 1, "{stats:?}");
    build(&layers, &d.path().join("abs.ext4"), &opts()).expect("e2fsck-clean image");
}

/// Issue 17, case 2: owner ids past 32 bits, in PAX records, wrapped to other owners in the
/// flattened tree (`uid=4294967296` became root) while `apply_layer` refused them. Both now
/// read entries with one metadata reader, which refuses them.
#[test]
fn owner_ids_past_32_bits_are_refused_not_wrapped() {
    let d = tempfile::tempdir().unwrap();
    for (key, value) in [
        ("uid", "4294967296"),
        ("uid", "4294967297"),
        ("gid", "4294967296"),
        ("uid", "4294967295"),
    ] {
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([(key, value.as_bytes())]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        b.append_data(&mut h, "owned", &b"x"[..]).unwrap();
        let raw = b.into_inner().unwrap();
        let path = d.path().join(format!("{key}-{value}"));
        std::fs::write(&path, &raw).unwrap();
        let layer = LayerBlob {
            digest: digest_of(&raw).to_string(),
            path: path.clone(),
        };
        let err = flatten(
            std::slice::from_ref(&layer),
            std::io::sink(),
            &Limits::default(),
            None,
        )
        .expect_err("an id that is not a Linux id");
        assert!(
            err.to_string()
                .contains(&format!("{key} {value} is not a valid id")),
            "{key}={value}: {err}"
        );
        // The applier says the same about the same layer.
        let root = d.path().join(format!("root-{key}-{value}"));
        std::fs::create_dir(&root).unwrap();
        let applied = crate::layer::apply_layer(
            &root,
            std::fs::File::open(&path).unwrap(),
            &layer.digest,
            &Limits::default(),
        );
        let err = applied.expect_err("the applier refuses it too").to_string();
        assert!(
            err.contains(&format!("{key} {value} is not a valid id")),
            "{err}"
        );
    }
}

/// A GNU long-name record (`L` name, `K` link target) holding `value` as given, then NUL.
pub(super) fn gnu_long(kind: tar::EntryType, value: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.as_gnu_mut().unwrap().name[..13].copy_from_slice(b"././@LongLink");
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(value.len() as u64 + 1);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(value);
    out.push(0);
    out.resize(out.len().next_multiple_of(512), 0);
    out
}

/// A raw GNU header named `name` (cut to 100 bytes) of `kind` with `data`.
pub(super) fn gnu_entry(name: &[u8], kind: tar::EntryType, data: &[u8]) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    let n = name.len().min(100);
    h.as_gnu_mut().unwrap().name[..n].copy_from_slice(&name[..n]);
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_600_000_000);
    h.set_size(data.len() as u64);
    h.set_cksum();
    let mut out = h.as_bytes().to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(512), 0);
    out
}

/// The `layer_flatten` fuzz crash of 2026-12-04: a long name holding a newline (and bytes
/// that are not UTF-8) was written back as a PAX `path` record, which the `tar` crate
/// splits at newlines, so `apply_layer` refused the flattened stream. Long names and link
/// targets now go into GNU long-name records, and reach the image byte for byte.
#[test]
fn long_names_with_a_newline_and_no_utf8_pass_through_to_the_image() {
    use std::os::unix::ffi::OsStrExt;
    use tar::EntryType as T;
    let d = tempfile::tempdir().unwrap();
    let mut name = b"d/".to_vec();
    name.extend_from_slice(&[b'n'; 100]);
    name.extend_from_slice(b"\nline\xff");
    let mut target = b"t\n".repeat(60);
    target.push(0xfe);
    let mut raw = gnu_entry(b"d/", T::Directory, b"");
    raw.extend(gnu_long(T::GNULongName, &name));
    raw.extend(gnu_entry(&name, T::Regular, b"odd"));
    raw.extend(gnu_long(T::GNULongLink, &target));
    raw.extend(gnu_entry(b"d/s\n", T::Symlink, b""));
    raw.extend([0u8; 1024]);
    let path = d.path().join("odd");
    std::fs::write(&path, &raw).unwrap();
    let layers = [LayerBlob {
        digest: digest_of(&raw).to_string(),
        path,
    }];
    let mut out = Vec::new();
    flatten(&layers, &mut out, &Limits::default(), None).unwrap();
    let root = d.path().join("root");
    std::fs::create_dir(&root).unwrap();
    crate::layer::apply_layer(&root, &out[..], "sha256:flattened", &Limits::default())
        .expect("the flattened stream is a layer");
    let file = root.join(std::ffi::OsStr::from_bytes(&name));
    assert_eq!(std::fs::read(&file).unwrap(), b"odd");
    let link = std::fs::read_link(root.join("d/s\n")).unwrap();
    assert_eq!(link.as_os_str().as_bytes(), &target[..]);

    let img = d.path().join("odd.ext4");
    build(&layers, &img, &opts()).expect("e2fsck-clean image");
    let listing = std::process::Command::new("debugfs")
        .args(["-R", "ls -p /d"])
        .arg(&img)
        .output()
        .unwrap()
        .stdout;
    let base = &name[2..];
    assert!(
        listing.windows(base.len()).any(|w| w == base),
        "{}",
        String::from_utf8_lossy(&listing)
    );
}

/// A NUL byte in a name or a link target (possible only in a GNU long-name record) is
/// refused by the entry reader, for layer apply and the flattener alike: a C reader of the
/// flattened stream (libarchive under `mke2fs -d`) would cut the name there.
#[test]
fn a_nul_in_a_name_or_link_target_is_refused() {
    use tar::EntryType as T;
    let d = tempfile::tempdir().unwrap();
    let mut nul_name = vec![b'x'; 100];
    nul_name.extend_from_slice(b"\0y");
    let mut in_name = gnu_long(T::GNULongName, &nul_name);
    in_name.extend(gnu_entry(&nul_name, T::Regular, b"x"));
    let mut in_link = gnu_long(T::GNULongLink, b"tar\0get");
    in_link.extend(gnu_entry(b"s", T::Symlink, b""));
    for (what, mut raw, want) in [
        ("name", in_name, "the name holds a NUL byte"),
        ("link", in_link, "link target holds a NUL byte"),
    ] {
        raw.extend([0u8; 1024]);
        let path = d.path().join(what);
        std::fs::write(&path, &raw).unwrap();
        let layer = LayerBlob {
            digest: digest_of(&raw).to_string(),
            path,
        };
        let err = flatten(
            std::slice::from_ref(&layer),
            std::io::sink(),
            &Limits::default(),
            None,
        )
        .expect_err("the flattener refuses it");
        assert!(err.to_string().contains(want), "{what}: {err}");
        let root = d.path().join(format!("root-{what}"));
        std::fs::create_dir(&root).unwrap();
        let err = crate::layer::apply_layer(&root, &raw[..], &layer.digest, &Limits::default())
            .expect_err("the applier refuses it too");
        assert!(err.to_string().contains(want), "{what}: {err}");
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0, "{what}");
    }
}

#[test]
fn read_file_reads_back_a_file_says_none_for_a_missing_one_and_refuses_unquotable_paths() {
    let d = tempfile::tempdir().unwrap();
    let status = b"Package: a\nStatus: install ok installed\nVersion: 1\n";
    let layers = vec![blob(
        d.path(),
        &[
            E::Dir("var", 0o755),
            E::Dir("var/lib", 0o755),
            E::Dir("var/lib/dpkg", 0o755),
            E::File("var/lib/dpkg/status", status),
        ],
        Z::Plain,
    )];
    let img = d.path().join("root.ext4");
    build(&layers, &img, &opts()).unwrap();
    let got = read_file(&img, "/var/lib/dpkg/status", 1 << 20).unwrap();
    assert_eq!(got.as_deref(), Some(&status[..]));
    assert_eq!(
        read_file(&img, "/var/lib/dpkg/nothing", 1 << 20).unwrap(),
        None
    );
    let small = read_file(&img, "/var/lib/dpkg/status", 4).unwrap_err();
    assert!(small.to_string().contains("larger than 4 bytes"), "{small}");
    for bad in ["var/lib/dpkg/status", "/a b", "/a\"b", "/a\nb"] {
        let e = read_file(&img, bad, 1 << 20).unwrap_err();
        assert!(
            e.to_string().contains("not an absolute path"),
            "{bad:?}: {e}"
        );
    }
}

/// A plain layer of `names` (directories when they end in `/`, else empty files).
pub(super) fn names_blob(dir: &Path, names: impl Iterator<Item = String>) -> LayerBlob {
    let mut b = tar::Builder::new(Vec::new());
    for n in names {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        h.set_size(0);
        if n.ends_with('/') {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
        } else {
            h.set_mode(0o644);
        }
        b.append_data(&mut h, &n, std::io::empty()).unwrap();
    }
    let bytes = b.into_inner().unwrap();
    let digest = digest_of(&bytes).to_string();
    let path = dir.join(&digest[7..]);
    std::fs::write(&path, &bytes).unwrap();
    LayerBlob { digest, path }
}

/// `debugfs -R REQUEST IMG`: standard output and error.
pub(super) fn debugfs_says(img: &Path, request: &str) -> String {
    let out = std::process::Command::new("debugfs")
        .arg("-R")
        .arg(request)
        .arg(img)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

pub(super) fn assert_fsck_clean(img: &Path) {
    let out = std::process::Command::new("e2fsck")
        .arg("-fn")
        .arg(img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "e2fsck -fn {}: {}{}",
        img.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Short distinct names (base 36, four characters, distinct below 36^4).
pub(super) fn short_name(i: usize) -> String {
    const D: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    [i / 46_656 % 36, i / 1296 % 36, i / 36 % 36, i % 36]
        .iter()
        .map(|d| D[*d] as char)
        .collect()
}

/// Issue 17, item 5: a directory of 4,000 entries came out linear ("Not a hash-indexed
/// directory") although `dir_index` is on. It is indexed, the image is still byte-identical
/// for identical inputs (also when built at another wall-clock second: the indexing pass
/// writes superblock times) and `e2fsck -fn` is clean.
#[test]
fn large_directories_are_hash_indexed_and_reproducible() {
    let d = tempfile::tempdir().unwrap();
    let names =
        std::iter::once("big/".to_string()).chain((0..4000).map(|i| format!("big/entry-{i:05}")));
    let layers = vec![names_blob(d.path(), names)];
    let a = d.path().join("a.ext4");
    let b = d.path().join("b.ext4");
    build(&layers, &a, &opts()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    build(&layers, &b, &opts()).unwrap();
    let sha = |p: &Path| crate::cache::digest_of_file(p).unwrap();
    assert_eq!(sha(&a), sha(&b), "identical inputs, identical image");
    let htree = debugfs_says(&a, "htree /big");
    assert!(
        !htree.contains("Not a hash-indexed directory") && htree.contains("Root node dump"),
        "{htree}"
    );
    let stat = debugfs_says(&a, "stat /big/entry-03999");
    assert!(stat.contains("Type: regular"), "{stat}");
    assert_fsck_clean(&a);
}

/// Issue 17, item 5: 65,010 empty directories were estimated at no blocks at all (only
/// directories with entries were counted), so mke2fs ran out of blocks at 44, 66 and 99 MiB.
/// Every directory has a block: they fit on the first try, at the estimated size. Spread
/// over 255 parents so that no directory is large: mke2fs inserts into a (then linear)
/// directory by scanning it, and 65,010 entries in one directory took it over 10 minutes
/// here, so the one-directory `dir_nlink` case is covered by the next test's threshold and
/// the debugfs edit it drives.
#[test]
fn many_empty_directories_fit_on_the_first_try() {
    let d = tempfile::tempdir().unwrap();
    let names = (0..255).flat_map(|p| {
        let n = if p < 250 { 255 } else { 252 };
        std::iter::once(format!("p{p:03}/")).chain((0..n).map(move |i| format!("p{p:03}/{i:03}/")))
    });
    let layers = vec![names_blob(d.path(), names)];
    let img = d.path().join("root.ext4");
    let built = build(&layers, &img, &opts()).unwrap();
    assert_eq!(built.stats.dirs, 255 + 250 * 255 + 5 * 252);
    assert_eq!(
        built.size_bytes,
        built.estimate.min_mib << 20,
        "built at the estimated size, not retried larger"
    );
    assert_fsck_clean(&img);
}

/// Which directories pass ext4's 65,000 links: 2 + subdirectories, so 64,998
/// subdirectories stay counted and 64,999 do not; the root counts lost+found too.
#[test]
fn link_max_dirs_are_those_past_65000_links() {
    let d = tempfile::tempdir().unwrap();
    let names = ["a/", "b/"].into_iter().flat_map(|top| {
        let n = if top == "a/" { 64_998 } else { 64_999 };
        std::iter::once(top.to_string())
            .chain((0..n).map(move |i| format!("{top}{}/", short_name(i))))
    });
    let layers = vec![names_blob(d.path(), names)];
    let flat = Flat::scan(&layers, &Limits::default(), None, DEFAULT_EPOCH).unwrap();
    assert_eq!(flat.link_max_dirs(), &[b"b".to_vec()]);
    let roots = (0..64_998).map(|i| format!("{}/", short_name(i)));
    let layers = vec![names_blob(d.path(), roots)];
    let flat = Flat::scan(&layers, &Limits::default(), None, DEFAULT_EPOCH).unwrap();
    assert_eq!(
        flat.link_max_dirs(),
        &[Vec::<u8>::new()],
        "64,998 + lost+found"
    );
}

/// Issue 17, item 5: after the retries kiln said "image too large: needs 148 MiB, limit
/// 65536 MiB", a need below the limit. Running out inside the image says what ran out and
/// at which sizes.
#[test]
fn running_out_inside_the_image_says_what_ran_out_and_where() {
    let stderr = "__populate_fs: Could not allocate block in ext2 filesystem while \
                  writing file \"x\"";
    let msg = ran_out(stderr, &[44, 66, 99], 44, DEFAULT_MAX_MIB, 65_023).to_string();
    assert!(
        msg.starts_with(
            "mke2fs ran out of blocks inside the image at 99 MiB (82302 inodes; sizes tried: \
             44, 66, 99 MiB; estimated 44 MiB, limit 65536 MiB): __populate_fs: Could not"
        ),
        "{msg}"
    );
    let msg = ran_out(
        "Could not allocate inode in ext2 filesystem",
        &[2048],
        40,
        2048,
        9,
    )
    .to_string();
    assert!(
        msg.starts_with("mke2fs ran out of inodes inside the image at 2048 MiB"),
        "{msg}"
    );
    assert!(!msg.contains("too large"), "{msg}");
}

/// Issue 17, case 4: a 16 GiB sparse file (as `truncate -s 16G` makes) with a little data in
/// it, captured by `write_layer`, is in the ext4 image with its apparent size and nearly no
/// blocks (`debugfs stat`: Blockcount), its data at its offset; the image is sized by the
/// data, not by the holes; `e2fsck -fn` is clean.
#[test]
fn sparse_files_stay_sparse_in_the_image() {
    use std::os::unix::fs::FileExt;
    let d = tempfile::tempdir().unwrap();
    let tree = d.path().join("tree");
    std::fs::create_dir_all(tree.join("var")).unwrap();
    let f = std::fs::File::create(tree.join("var/sparse.img")).unwrap();
    f.set_len(16 << 30).unwrap();
    f.write_all_at(b"kiln", 8 << 30).unwrap();
    drop(f);
    let mut bytes = Vec::new();
    let w = crate::layer::write::write_layer(&tree, &mut bytes, None).unwrap();
    assert!(w.size < 1 << 20, "layer blob of {} bytes", w.size);
    let path = d.path().join("layer");
    std::fs::write(&path, &bytes).unwrap();
    let layers = vec![LayerBlob {
        digest: w.digest.to_string(),
        path,
    }];
    let img = d.path().join("img.ext4");
    build(&layers, &img, &opts()).unwrap();
    assert_fsck_clean(&img);
    let image_bytes = std::fs::metadata(&img).unwrap().len();
    assert!(
        image_bytes < 1 << 30,
        "a {image_bytes}-byte image for 4 bytes of data"
    );
    let stat = debugfs_says(&img, "stat /var/sparse.img");
    assert!(stat.contains("Size: 17179869184"), "{stat}");
    let blocks: u64 = stat
        .split("Blockcount: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no Blockcount in {stat}"));
    assert!(
        blocks <= 64,
        "Blockcount {blocks} (512-byte units):\n{stat}"
    );
    let extents = debugfs_says(&img, "dump_extents /var/sparse.img");
    assert!(
        extents.contains("2097152"),
        "the data block is at 8 GiB (block 2097152):\n{extents}"
    );
}

/// The share of `b`'s non-zero raw chunk bytes, cut by the store's disk chunking
/// ([`kiln_store::Chunking::DISK_DEFAULT`], FastCDC 16/64/256 KiB), that `a` does not have.
pub(super) fn new_chunk_share(a: &Path, b: &Path) -> f64 {
    let chunks = |p: &Path| {
        let f = std::fs::File::open(p).unwrap();
        kiln_store::chunk::split(f, kiln_store::Chunking::DISK_DEFAULT)
            .unwrap()
            .map(|c| c.unwrap())
            .filter(|c| !kiln_store::chunk::is_all_zero(&c.data))
            .map(|c| (kiln_store::ChunkDigest::of(&c.data), c.data.len() as u64))
            .collect::<Vec<_>>()
    };
    let have: std::collections::HashSet<_> = chunks(a).into_iter().map(|(d, _)| d).collect();
    let (mut total, mut new) = (0u64, 0u64);
    for (d, n) in chunks(b) {
        total += n;
        if !have.contains(&d) {
            new += n;
        }
    }
    assert!(total > 0);
    new as f64 / total as f64
}

/// Issue 16: the file system's identity (UUID, checksum seed, directory hash seed) must not
/// follow the tree. Two images whose trees differ by one small file, each built as its
/// caller would (any seed a caller could choose was per image: the image's digest), share at
/// least 97% of their chunk bytes. With a per-image UUID, `metadata_csum` put it into every
/// inode table, bitmap, directory and extent checksum, and most metadata chunks were new.
#[test]
fn one_added_file_keeps_97_percent_of_chunk_bytes_shared() {
    let d = tempfile::tempdir().unwrap();
    // 4,000 files of about 2 KiB in 40 directories (8 MiB): metadata (inode tables,
    // directory blocks) is a large share of the image, as in a distribution's tree.
    let bodies: Vec<(String, Vec<u8>)> = (0..4000)
        .map(|i| {
            let body: String = (0..100)
                .map(|l| format!("file {i:04} line {l:05}\n"))
                .collect();
            (format!("d{:02}/f{i:04}.txt", i % 40), body.into_bytes())
        })
        .collect();
    let base: Vec<E<'_>> = (0..40)
        .map(|i| E::Dir(Box::leak(format!("d{i:02}/").into_boxed_str()), 0o755))
        .chain(bodies.iter().map(|(p, b)| E::File(p, b)))
        .collect();
    let la = vec![blob(d.path(), &base, Z::Plain)];
    let mut more = base;
    more.push(E::File("d07/added.txt", b"one more small file\n"));
    let lb = vec![blob(d.path(), &more, Z::Plain)];
    let (a, b) = (d.path().join("a.ext4"), d.path().join("b.ext4"));
    build(&la, &a, &opts()).unwrap();
    build(&lb, &b, &opts()).unwrap();
    assert_fsck_clean(&a);
    assert_fsck_clean(&b);
    let share = new_chunk_share(&a, &b);
    eprintln!("new chunk bytes: {:.2}%", share * 100.0);
    assert!(
        share <= 0.03,
        "{:.2}% of the chunk bytes are new",
        share * 100.0
    );
}

/// Issue 16: images carry `metadata_csum_seed`, so the checksums do not depend on the UUID
/// field: a copy given its own UUID (`tune2fs -U`, for a host that mounts two images by UUID
/// at once) differs from the original in its superblock block only, and checks clean.
#[test]
fn a_new_uuid_rewrites_the_superblock_only() {
    let d = tempfile::tempdir().unwrap();
    let layers = three_layers(d.path());
    let a = d.path().join("a.ext4");
    build(&layers, &a, &opts()).unwrap();
    let b = d.path().join("b.ext4");
    std::fs::copy(&a, &b).unwrap();
    let out = std::process::Command::new("tune2fs")
        .args(["-U", "6d1f0c9a-0b3e-4c55-9a51-2f4b8e7d1c20"])
        .arg(&b)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_fsck_clean(&b);
    let (x, y) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let differ: Vec<usize> = x
        .chunks(BLOCK_SIZE as usize)
        .zip(y.chunks(BLOCK_SIZE as usize))
        .enumerate()
        .filter(|(_, (p, q))| p != q)
        .map(|(i, _)| i)
        .collect();
    // One block group (the image is under 128 MiB): the only superblock is in block 0.
    assert_eq!(differ, vec![0], "blocks that differ");
}
