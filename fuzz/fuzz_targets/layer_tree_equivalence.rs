//! Differential: the same 1 to 3 layers applied in order by `kiln_builder::layer::apply_layer`
//! into a fresh directory and flattened by `kiln_builder::ext4::flatten` must give the same
//! tree (the invariant of `builder/src/layer/whiteout.rs`): every path with its kind, mode,
//! owner, size, content hash, symlink target, xattrs and non-directory mtime
//! (`kiln_tests::ext4::{tar_tree, dir_tree, compare}`), and the same hard-link groups
//! (`tar_link_groups`, `dir_link_groups`). Both refusing is fine; one refusing is a
//! divergence, and so is any difference in the trees.
//!
//! The input is a small op list, not tar bytes, so that names collide and whiteouts, links
//! and replacements meet what lower layers and earlier entries made (see [`decode`]).
#![no_main]

use std::fs;

use kiln_builder::ext4::{LayerBlob, flatten};
use kiln_builder::layer::{Limits, apply_layer};
use kiln_tests::ext4::{compare, dir_link_groups, dir_tree, tar_link_groups, tar_tree};
use libfuzzer_sys::fuzz_target;

/// At most this many layers, and entries per layer (a run stays well under a millisecond of
/// tar and a few dozen system calls per entry).
const MAX_LAYERS: usize = 3;
const MAX_OPS: usize = 24;

/// One component of the tiny alphabet (so that names collide).
const NAMES: [&[u8]; 3] = [b"a", b"b", b"c"];

/// A path from one byte: up to three components from [`NAMES`], two bits each (0 ends the
/// path; an empty path is the root), and in the top two bits a spelling: plain, `./`
/// prefix, trailing `/`, or a `.` in the middle (`a/./b`). No `..`: both sides refuse an
/// entry name holding one with the same code (`split_name`), and a quarter of all names
/// would make most inputs refused by both.
fn path(b: u8) -> Vec<u8> {
    let mut comps: Vec<&[u8]> = Vec::new();
    for i in 0..3 {
        match (b >> (2 * i)) & 3 {
            0 => break,
            c => comps.push(NAMES[usize::from(c) - 1]),
        }
    }
    let mut p = comps.join(&b'/');
    match b >> 6 {
        1 => p.splice(0..0, b"./".iter().copied()).for_each(drop),
        2 if !p.is_empty() => p.push(b'/'),
        3 if comps.len() > 1 => {
            let at = comps[0].len();
            p.splice(at..at, b"/.".iter().copied()).for_each(drop);
        }
        _ => {}
    }
    p
}

/// `path(b)` with at least one component (entries need a name).
fn name(b: u8) -> Vec<u8> {
    if b & 3 == 0 { path(b | 1) } else { path(b) }
}

/// A symlink target from one byte: [`path`] of the low six bits, relative, absolute, with a
/// `../` prefix, or `.`-relative (`./x`).
fn target(b: u8) -> Vec<u8> {
    let mut p = path(b & 0x3f);
    let prefix: &[u8] = match b >> 6 {
        0 => b"",
        1 => b"/",
        2 => b"../",
        _ => b"./",
    };
    p.splice(0..0, prefix.iter().copied()).for_each(drop);
    if p.is_empty() {
        p.push(b'.');
    }
    p
}

/// The parent and last component of `p` (`b"a/b"` → (`b"a/"`, `b"b"`)).
fn split_last(p: &[u8]) -> (&[u8], &[u8]) {
    let t = p.strip_suffix(b"/").unwrap_or(p);
    match t.iter().rposition(|c| *c == b'/') {
        Some(i) => (&t[..=i], &t[i + 1..]),
        None => (&b""[..], t),
    }
}

/// One tar entry to write.
#[derive(Debug)]
struct Ent {
    name: Vec<u8>,
    kind: tar::EntryType,
    mode: u32,
    uid: u64,
    mtime: u64,
    data: Vec<u8>,
    link: Vec<u8>,
}

/// The layers an input describes, bottom first. The first byte is the layer count (1 to
/// [`MAX_LAYERS`]); then ops of two bytes, the op byte and an operand byte. The op's low 3
/// bits are its kind: 0 directory, 1 file, 2 symlink, 3 hard link, 4 whiteout, 5 opaque
/// whiteout, 6 FIFO (a character device 1:3 with bit 6), 7 next layer. Bits 3-4 pick a
/// mode, bit 5 the owner (0 or 1000), bits 6-7 the file content (a link's or symlink's
/// target is the next byte). Every entry has its own mtime (its layer and index), so that
/// metadata taken from the wrong entry shows.
fn decode(data: &[u8]) -> Vec<Vec<Ent>> {
    let Some((&first, mut rest)) = data.split_first() else {
        return vec![Vec::new()];
    };
    let nlayers = 1 + usize::from(first) % MAX_LAYERS;
    let mut layers: Vec<Vec<Ent>> = vec![Vec::new()];
    while let [op, arg, tail @ ..] = rest {
        rest = tail;
        let (op, arg) = (*op, *arg);
        let mode = [0o755, 0o644, 0o4750, 0o1777][usize::from((op >> 3) & 3)];
        let uid = if op & 0x20 != 0 { 1000 } else { 0 };
        let mut e = Ent {
            name: name(arg),
            kind: tar::EntryType::Regular,
            mode,
            uid,
            mtime: 1_600_000_000
                + 100 * layers.len() as u64
                + layers.last().map_or(0, Vec::len) as u64,
            data: Vec::new(),
            link: Vec::new(),
        };
        match op & 7 {
            0 => e.kind = tar::EntryType::Directory,
            1 => e.data = vec![b'0' + (op >> 6); usize::from(op >> 6)],
            2 | 3 => {
                let Some((&t, tail)) = rest.split_first() else {
                    break;
                };
                rest = tail;
                if op & 7 == 2 {
                    e.kind = tar::EntryType::Symlink;
                    e.link = target(t);
                } else {
                    e.kind = tar::EntryType::Link;
                    e.link = name(t);
                }
            }
            4 => {
                let (parent, base) = split_last(&e.name);
                let mut n = parent.to_vec();
                n.extend_from_slice(b".wh.");
                n.extend_from_slice(base);
                e.name = n;
                e.mode = 0o644;
            }
            5 => {
                // The directory may be the root (an empty path).
                let mut n = path(arg);
                if !n.is_empty() && !n.ends_with(b"/") {
                    n.push(b'/');
                }
                n.extend_from_slice(b".wh..wh..opq");
                e.name = n;
                e.mode = 0o644;
            }
            6 if op & 0x40 != 0 => e.kind = tar::EntryType::Char,
            6 => e.kind = tar::EntryType::Fifo,
            _ => {
                if layers.len() < nlayers {
                    layers.push(Vec::new());
                }
                continue;
            }
        }
        let cur = layers.last_mut().expect("one layer at least");
        if cur.len() < MAX_OPS {
            cur.push(e);
        }
    }
    layers
}

fn tar_of(entries: &[Ent]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        // Names and targets are written as they are (the tar crate's setters refuse `..`).
        let g = h.as_gnu_mut().expect("gnu header");
        g.name[..e.name.len()].copy_from_slice(&e.name);
        g.linkname[..e.link.len()].copy_from_slice(&e.link);
        h.set_entry_type(e.kind);
        h.set_mode(e.mode);
        h.set_uid(e.uid);
        h.set_gid(e.uid);
        h.set_mtime(e.mtime);
        if e.kind == tar::EntryType::Char {
            h.set_device_major(1).expect("gnu header");
            h.set_device_minor(3).expect("gnu header");
        }
        h.set_size(e.data.len() as u64);
        h.set_cksum();
        b.append(&h, &e.data[..]).expect("tar in memory");
    }
    b.into_inner().expect("tar in memory")
}

fuzz_target!(|data: &[u8]| {
    let layers = decode(data);
    let dir = tempfile::Builder::new()
        .prefix("kiln-fuzz-equiv-")
        .tempdir()
        .expect("scratch directory");
    let mut blobs = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let path = dir.path().join(format!("layer-{i}"));
        fs::write(&path, tar_of(l)).expect("layer file");
        blobs.push(LayerBlob {
            digest: format!("sha256:fuzz-layer-{i}"),
            path,
        });
    }
    let limits = Limits::default();
    let mut out = Vec::new();
    let flat = flatten(&blobs, &mut out, &limits, None).map(|_| ());
    let root = dir.path().join("root");
    fs::create_dir(&root).expect("root");
    let mut applied = Ok(());
    for b in &blobs {
        let f = fs::File::open(&b.path).expect("layer file");
        applied = apply_layer(&root, f, &b.digest, &limits).map(|_| ());
        if applied.is_err() {
            break;
        }
    }
    match (&flat, &applied) {
        (Ok(()), Ok(())) => {}
        (Err(_), Err(_)) => return,
        (Ok(()), Err(e)) => panic!("apply refused what flatten took: {e}\nlayers: {layers:#?}"),
        (Err(e), Ok(())) => panic!("flatten refused what apply took: {e}\nlayers: {layers:#?}"),
    }
    let mut ft = tar_tree(&out);
    let mut at = dir_tree(&root);
    for o in ft.values_mut().chain(at.values_mut()) {
        if o.kind == 'd' {
            o.mtime = 0;
        }
    }
    let diffs = compare(&ft, &at);
    assert!(
        diffs.is_empty(),
        "trees differ (flattened first, applied second):\n{}\nlayers: {layers:#?}",
        diffs.join("\n")
    );
    let (fl, al) = (tar_link_groups(&out), dir_link_groups(&root));
    assert_eq!(
        fl, al,
        "hard-link groups differ (flattened, applied)\nlayers: {layers:#?}"
    );
});
