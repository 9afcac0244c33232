//! The flattener against the layer applier (issue 17, case 2's differential test): the
//! tree an image gets equals the tree `apply_layer` unpacks, on every corpus and on the
//! whiteout, symlink and hard-link cases found by review and fuzzing.

use std::path::Path;

use super::tests::*;
use super::*;
use crate::cache::digest_of;

/// The flattener and the layer applier disagree on nothing (issue 17, case 2's differential
/// test): for every layer corpus of these tests (the three-layer stack with whiteouts, an
/// opaque directory, a file replacing a directory, hard links across layers, a symlinked
/// parent, devices, xattrs and long names; the umoci-style layer with a root named `/` and
/// absolute names; a sparse file), the flattened tar read back is the tree `apply_layer`
/// makes when it applies the same layers in order. Every field of
/// [`kiln_tests::ext4::Obj`] is compared (kind, mode, owner, mtime, content, link, xattrs),
/// except one, measured here and left: a directory's mtime. The flattener gives a directory
/// the mtime of its last entry (the epoch for an implicit parent); the applier, like
/// containerd's, sets the mtimes of the directories a layer names after applying it, but a
/// directory that a later layer writes into without naming it, or that it creates as an
/// implicit parent, keeps the time of the apply. Applied trees are lower directories of
/// steps only; images come from the flattener.
#[test]
fn flattened_tree_equals_the_applied_tree_for_every_corpus() {
    use tar::EntryType as T;
    let d = tempfile::tempdir().unwrap();
    let mut corpora: Vec<(&str, Vec<LayerBlob>)> = vec![("three layers", three_layers(d.path()))];
    let raw = raw_tar(&[
        (b"/", T::Directory, b"", b""),
        (b"/tmp/", T::Directory, b"", b""),
        (b"/tmp/x", T::Regular, b"x", b""),
        (b"//etc//conf", T::Regular, b"c", b""),
        (b"/etc/conf-link", T::Link, b"", b"/etc/conf"),
    ]);
    let abs = d.path().join("abs");
    std::fs::write(&abs, &raw).unwrap();
    corpora.push((
        "absolute names",
        vec![LayerBlob {
            digest: digest_of(&raw).to_string(),
            path: abs,
        }],
    ));
    let src = d.path().join("sparse-src");
    std::fs::create_dir(&src).unwrap();
    {
        let f = std::fs::File::create(src.join("holes")).unwrap();
        f.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_at(&f, b"middle", 4 << 20).unwrap();
    }
    let mut sparse = Vec::new();
    crate::layer::write::write_layer(&src, &mut sparse, Some(1_700_000_000)).unwrap();
    let sp = d.path().join("sparse");
    std::fs::write(&sp, &sparse).unwrap();
    corpora.push((
        "sparse file",
        vec![LayerBlob {
            digest: digest_of(&sparse).to_string(),
            path: sp,
        }],
    ));

    for (name, layers) in &corpora {
        let mut out = Vec::new();
        flatten(layers, &mut out, &Limits::default(), None)
            .unwrap_or_else(|e| panic!("{name}: flatten: {e}"));
        let flat = kiln_tests::ext4::tar_tree(&out);
        let root = d.path().join(format!("applied-{}", name.replace(' ', "-")));
        std::fs::create_dir(&root).unwrap();
        for l in layers {
            crate::layer::apply_layer(
                &root,
                std::fs::File::open(&l.path).unwrap(),
                &l.digest,
                &Limits::default(),
            )
            .unwrap_or_else(|e| panic!("{name}: apply {}: {e}", l.digest));
        }
        let mut applied = kiln_tests::ext4::dir_tree(&root);
        let mut flat = flat;
        for o in flat.values_mut().chain(applied.values_mut()) {
            if o.kind == 'd' {
                o.mtime = 0;
            }
        }
        let diffs = kiln_tests::ext4::compare(&flat, &applied);
        let extra: Vec<&String> = applied.keys().filter(|p| !flat.contains_key(*p)).collect();
        assert!(
            diffs.is_empty() && extra.is_empty(),
            "{name}: flattened vs applied:\n{}\napplied only: {extra:?}",
            diffs.join("\n")
        );
    }
}

/// Flattens and applies `layers` (from `dir`), and returns what differs between the two
/// trees (directory mtimes left out, as in
/// [`flattened_tree_equals_the_applied_tree_for_every_corpus`]) and their hard-link groups
/// (which names share an inode), or why one refused.
fn flattened_vs_applied(dir: &Path, name: &str, layers: &[Vec<E<'_>>]) -> Vec<String> {
    let blobs: Vec<LayerBlob> = layers.iter().map(|l| blob(dir, l, Z::Plain)).collect();
    let mut out = Vec::new();
    let flat = flatten(&blobs, &mut out, &Limits::default(), None).map(|_| ());
    let root = dir.join(format!("applied-{name}"));
    std::fs::create_dir(&root).unwrap();
    let mut applied = Ok(());
    for l in &blobs {
        applied = crate::layer::apply_layer(
            &root,
            std::fs::File::open(&l.path).unwrap(),
            &l.digest,
            &Limits::default(),
        )
        .map(|_| ());
        if applied.is_err() {
            break;
        }
    }
    match (flat, applied) {
        (Ok(()), Ok(())) => {}
        (Err(a), Err(b)) => {
            let _ = (a, b);
            return Vec::new();
        }
        (a, b) => return vec![format!("{name}: flatten {a:?}, apply {b:?}")],
    }
    let mut flat = kiln_tests::ext4::tar_tree(&out);
    let mut applied = kiln_tests::ext4::dir_tree(&root);
    for o in flat.values_mut().chain(applied.values_mut()) {
        if o.kind == 'd' {
            o.mtime = 0;
        }
    }
    let mut diffs: Vec<String> = kiln_tests::ext4::compare(&flat, &applied)
        .into_iter()
        .map(|d| format!("{name}: {d}"))
        .collect();
    for p in applied.keys().filter(|p| !flat.contains_key(*p)) {
        diffs.push(format!("{name}: only applied: {p}"));
    }
    let (fl, al) = (
        kiln_tests::ext4::tar_link_groups(&out),
        kiln_tests::ext4::dir_link_groups(&root),
    );
    if fl != al {
        diffs.push(format!(
            "{name}: hard-link groups: flattened {fl:?}, applied {al:?}"
        ));
    }
    diffs
}

/// The invariant of [`flattened_tree_equals_the_applied_tree_for_every_corpus`], for layers
/// whose opaque whiteout names a directory the layer wrote into through another path (a
/// symlink, or the real one when the whiteout goes through the symlink). The flattener
/// takes a layer's whiteouts first and keeps all of the layer's own entries; the applier
/// took them in order and spared only what the layer made under the very path (symlinks not
/// resolved) the whiteout names.
#[test]
fn flattened_tree_equals_the_applied_tree_with_whiteouts_through_symlinks() {
    let d = tempfile::tempdir().unwrap();
    let base = || {
        vec![
            E::Dir("usr/", 0o755),
            E::Dir("usr/lib/", 0o755),
            E::File("usr/lib/old", b"old"),
            E::Sym("lib", "usr/lib"),
        ]
    };
    let mut diffs = Vec::new();
    // A file written through the symlink, then the real directory made opaque.
    diffs.extend(flattened_vs_applied(
        d.path(),
        "opaque-by-real-path",
        &[
            base(),
            vec![
                E::File("lib/new", b"new"),
                E::File("usr/lib/.wh..wh..opq", b""),
            ],
        ],
    ));
    // A file written by its real path, then its directory made opaque through the symlink.
    diffs.extend(flattened_vs_applied(
        d.path(),
        "opaque-through-symlink",
        &[
            base(),
            vec![
                E::File("usr/lib/new", b"new"),
                E::File("lib/.wh..wh..opq", b""),
            ],
        ],
    ));
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}

/// The same invariant for a whiteout whose parent is a symlink the same layer makes (`x ->
/// usr/lib`, then `x/.wh.old`). Both take a layer's entries in stream order, so the
/// whiteout goes through the new symlink and removes the lower layer's `usr/lib/old`, as
/// containerd's in-order apply does. (The flattener used to take a layer's whiteouts first,
/// where `x` was missing, and kept it.)
#[test]
fn flattened_tree_equals_the_applied_tree_with_a_whiteout_through_a_symlink_the_layer_makes() {
    let d = tempfile::tempdir().unwrap();
    let diffs = flattened_vs_applied(
        d.path(),
        "whiteout-through-new-symlink",
        &[
            vec![
                E::Dir("usr/", 0o755),
                E::Dir("usr/lib/", 0o755),
                E::File("usr/lib/old", b"old"),
                E::Sym("lib", "usr/lib"),
            ],
            vec![E::Sym("x", "usr/lib"), E::File("x/.wh.old", b"")],
        ],
    );
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}

/// The same invariant for a layer that hard-links a lower layer's file and then whites the
/// file out (`c` linked to `a`, then `.wh.a`): `c` is linked while `a` exists, and keeps
/// its data once `a` is gone. (The flattener used to take the whiteout first and refuse
/// the link, `HardLinkMissing`, in a layer `apply_layer` applied.)
#[test]
fn flattened_tree_equals_the_applied_tree_with_a_link_to_a_file_the_layer_whites_out() {
    let d = tempfile::tempdir().unwrap();
    let diffs = flattened_vs_applied(
        d.path(),
        "link-then-whiteout-target",
        &[
            vec![E::File("a", b"A")],
            vec![E::Hard("c", "a"), E::File(".wh.a", b"")],
        ],
    );
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}

/// A whiteout that comes after the layer's own entries below the path it names hides every
/// lower entry there, at any depth, and keeps what the layer made (OCI `layer.md`: an
/// opaque whiteout hides "all siblings" from lower layers, and whiteouts never hide the
/// same layer's entries, whatever their order). Lower `d/sub/old` under a layer of
/// `d/sub/new` then `d/.wh..wh..opq` (or `d/.wh.sub`) leaves `d/sub` holding `new` alone, in
/// the applied tree and the image alike.
#[test]
fn a_whiteout_after_the_layers_own_entries_hides_the_lower_ones_below_them() {
    let d = tempfile::tempdir().unwrap();
    let lower = || {
        vec![
            E::Dir("d/", 0o755),
            E::Dir("d/sub/", 0o755),
            E::File("d/sub/old", b"old"),
            E::File("d/gone", b"gone"),
        ]
    };
    for (name, wh) in [
        ("opaque-after", "d/.wh..wh..opq"),
        ("remove-after", "d/.wh.sub"),
    ] {
        let layers = [
            lower(),
            vec![E::File("d/sub/new", b"new"), E::File(wh, b"")],
        ];
        let diffs = flattened_vs_applied(d.path(), name, &layers);
        assert!(diffs.is_empty(), "{}", diffs.join("\n"));
        let root = d.path().join(format!("applied-{name}"));
        assert!(root.join("d/sub/new").exists(), "{name}");
        assert!(
            !root.join("d/sub/old").exists(),
            "{name}: lower d/sub/old kept"
        );
        let gone_kept = root.join("d/gone").exists();
        assert_eq!(gone_kept, name == "remove-after", "{name}: d/gone");
    }
}

/// A hard link that replaces the directory holding its own target (`d/f`, then `d` linked
/// to `d/f`): replacing `d` removes `d/f` first, so there is nothing left to link, as in
/// containerd's in-order apply (remove the old path, then link). Both refuse
/// (`HardLinkMissing`). The applier refused (`linkat`: no such file) while the flattener
/// took the target's inode before removing `d` and made `d` a file holding `f`'s data.
#[test]
fn a_hard_link_over_the_directory_holding_its_target_is_refused_by_both() {
    let d = tempfile::tempdir().unwrap();
    for (name, layers) in [
        (
            "link-over-own-dir-same-layer",
            vec![vec![
                E::Dir("d/", 0o755),
                E::File("d/f", b"f"),
                E::Hard("d", "d/f"),
            ]],
        ),
        (
            "link-over-own-dir-lower",
            vec![
                vec![E::Dir("d/", 0o755), E::File("d/f", b"f")],
                vec![E::Hard("d", "d/f")],
            ],
        ),
    ] {
        let diffs = flattened_vs_applied(d.path(), name, &layers);
        assert!(diffs.is_empty(), "{}", diffs.join("\n"));
        let blobs: Vec<LayerBlob> = layers.iter().map(|l| blob(d.path(), l, Z::Plain)).collect();
        let r = flatten(&blobs, &mut Vec::new(), &Limits::default(), None);
        assert!(
            matches!(r, Err(Ext4Error::Layer(LayerError::HardLinkMissing { .. }))),
            "{name}: {r:?}"
        );
    }
}

/// A symlink whose header gives a mode other than 0777 (`a -> c` with 0755, and a hard
/// link to it). A Linux symlink is always 0777: the applier's `symlinkat` makes it so and
/// nothing changes it. The flattener wrote the header's mode, which mke2fs puts in the
/// image's inode, so the image's symlink was `lrwxr-xr-x` where the applied one is
/// `lrwxrwxrwx`.
#[test]
fn a_symlinks_mode_is_0777_whatever_its_header_says() {
    let d = tempfile::tempdir().unwrap();
    let layers = [
        vec![E::SymMode("a", "c", 0o755), E::SymMode("b", "a", 0o600)],
        vec![E::Hard("h", "a")],
    ];
    let diffs = flattened_vs_applied(d.path(), "symlink-mode", &layers);
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}

/// A `user.*` xattr on a symlink (`s -> t` with `user.note`). Linux keeps `user.*` xattrs on
/// regular files and directories only (xattr(7)) and refuses them elsewhere (`EPERM`), so
/// the applier refused the layer (`lsetxattr`), while the flattener wrote the xattr into
/// the image; containerd applies such a layer and drops the xattr. The one metadata reader
/// now drops `user.*` xattrs of symlinks, devices and FIFOs, for both; others stay.
#[test]
fn a_user_xattr_on_a_symlink_is_dropped_by_both() {
    let d = tempfile::tempdir().unwrap();
    let layers = [vec![
        E::SymX("s", "t", &[("user.note", b"v")]),
        E::FileX("f", b"f", &[("user.note", b"v")]),
    ]];
    let diffs = flattened_vs_applied(d.path(), "symlink-user-xattr", &layers);
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
    let root = d.path().join("applied-symlink-user-xattr");
    let tree = kiln_tests::ext4::dir_tree(&root);
    assert!(tree["s"].xattrs.is_empty(), "{:?}", tree["s"]);
    assert_eq!(
        tree["f"].xattrs.get("user.note").map(Vec::as_slice),
        Some(&b"v"[..])
    );
}
