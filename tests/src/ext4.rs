//! Reading an ext4 image back against the tar it was made from: every entry of the tar must be
//! in the image with the same type, mode, uid/gid, mtime, size, content, link target and
//! xattrs, and the image must hold nothing else (but `lost+found`). Files are read with the
//! `ext4-view` crate; xattrs with `debugfs` (`ea_list`, `ea_get -f`), since ext4-view does
//! not expose them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;
use std::process::Command;

use sha2::{Digest as _, Sha256};

/// One object of the tree, as the tar says or the image holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Obj {
    /// `d`, `f`, `l`, `c`, `b`, `p`.
    pub kind: char,
    /// Permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// mtime, seconds.
    pub mtime: u64,
    /// Size of a regular file, bytes (0 otherwise).
    pub size: u64,
    /// sha256 hex of a regular file's content.
    pub hash: String,
    /// Symlink target.
    pub link: Vec<u8>,
    /// Xattrs (name → value).
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// Parses a (flattened) tar into path → object; hard links take their target's object.
pub fn tar_tree(tar_bytes: &[u8]) -> BTreeMap<String, Obj> {
    let mut out: BTreeMap<String, Obj> = BTreeMap::new();
    let mut ar = tar::Archive::new(tar_bytes);
    for e in ar.entries().expect("tar entries") {
        let mut e = e.expect("tar entry");
        let path = String::from_utf8_lossy(&e.path_bytes())
            .trim_end_matches('/')
            .to_string();
        let h = e.header().clone();
        let mut xattrs = BTreeMap::new();
        if let Some(exts) = e.pax_extensions().expect("pax") {
            for x in exts {
                let x = x.expect("pax record");
                if let Some(n) = x.key().expect("utf8 key").strip_prefix("SCHILY.xattr.") {
                    xattrs.insert(n.to_string(), x.value_bytes().to_vec());
                }
            }
        }
        use tar::EntryType as T;
        let ty = h.entry_type();
        if ty == T::Link {
            let target = String::from_utf8_lossy(&e.link_name_bytes().expect("link target"))
                .trim_end_matches('/')
                .to_string();
            let obj = out
                .get(&target)
                .unwrap_or_else(|| panic!("hard link {path} -> {target}: target not earlier"))
                .clone();
            out.insert(path, obj);
            continue;
        }
        let kind = match ty {
            T::Directory => 'd',
            // The tar crate reads an old GNU sparse entry's data with its holes as zeros.
            T::Regular | T::GNUSparse => 'f',
            T::Symlink => 'l',
            T::Char => 'c',
            T::Block => 'b',
            T::Fifo => 'p',
            other => panic!("{path}: unexpected entry type {other:?}"),
        };
        let mut data = Vec::new();
        e.read_to_end(&mut data).expect("tar data");
        let obj = Obj {
            kind,
            mode: h.mode().expect("mode") & 0o7777,
            uid: h.uid().expect("uid") as u32,
            gid: h.gid().expect("gid") as u32,
            mtime: h.mtime().expect("mtime"),
            size: if kind == 'f' { data.len() as u64 } else { 0 },
            hash: if kind == 'f' {
                hex::encode(Sha256::digest(&data))
            } else {
                String::new()
            },
            link: if kind == 'l' {
                e.link_name_bytes().expect("symlink target").into_owned()
            } else {
                Vec::new()
            },
            xattrs,
        };
        assert!(
            out.insert(path.clone(), obj).is_none(),
            "{path} twice in the flattened tar"
        );
    }
    out
}

/// Reads the directory tree under `root` (not `root` itself) into path → object, as
/// [`tar_tree`] reads a flattened tar: lstat for kind, mode, owner and mtime, the content's
/// sha256, symlink targets, and every xattr (llistxattr/lgetxattr). Hard links are not told
/// apart: each path gets its inode's object, as `tar_tree` gives a link its target's.
pub fn dir_tree(root: &Path) -> BTreeMap<String, Obj> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for ent in std::fs::read_dir(&dir).expect("read_dir") {
            let p = ent.expect("dir entry").path();
            let md = std::fs::symlink_metadata(&p).expect("lstat");
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                stack.push(p.clone());
                'd'
            } else if ft.is_file() {
                'f'
            } else if ft.is_symlink() {
                'l'
            } else if ft.is_char_device() {
                'c'
            } else if ft.is_block_device() {
                'b'
            } else if ft.is_fifo() {
                'p'
            } else {
                panic!("{}: unexpected file type", p.display())
            };
            let mut names = vec![0u8; 1 << 16];
            let n = rustix::fs::llistxattr(&p, &mut names[..]).expect("llistxattr");
            let mut xattrs = BTreeMap::new();
            for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
                let mut value = vec![0u8; 1 << 16];
                let len = rustix::fs::lgetxattr(&p, name, &mut value[..]).expect("lgetxattr");
                value.truncate(len);
                xattrs.insert(String::from_utf8_lossy(name).into_owned(), value);
            }
            let data = if kind == 'f' {
                std::fs::read(&p).expect("read")
            } else {
                Vec::new()
            };
            let rel = p.strip_prefix(root).expect("under the root");
            out.insert(
                String::from_utf8_lossy(rel.as_os_str().as_bytes()).into_owned(),
                Obj {
                    kind,
                    mode: md.mode() & 0o7777,
                    uid: md.uid(),
                    gid: md.gid(),
                    mtime: md.mtime() as u64,
                    size: if kind == 'f' { md.len() } else { 0 },
                    hash: if kind == 'f' {
                        hex::encode(Sha256::digest(&data))
                    } else {
                        String::new()
                    },
                    link: if kind == 'l' {
                        std::fs::read_link(&p)
                            .expect("readlink")
                            .as_os_str()
                            .as_bytes()
                            .to_vec()
                    } else {
                        Vec::new()
                    },
                    xattrs,
                },
            );
        }
    }
    out
}

/// The hard-link groups of a (flattened) tar: every set of two or more paths that name one
/// inode (a link entry joins its target's group). [`tar_tree`] gives a link its target's
/// object, so a tree compare alone cannot tell two linked names from two equal files.
pub fn tar_link_groups(tar_bytes: &[u8]) -> BTreeSet<BTreeSet<String>> {
    let mut group_of: BTreeMap<String, usize> = BTreeMap::new();
    let mut groups: Vec<BTreeSet<String>> = Vec::new();
    let mut ar = tar::Archive::new(tar_bytes);
    for e in ar.entries().expect("tar entries") {
        let e = e.expect("tar entry");
        let name = |b: &[u8]| String::from_utf8_lossy(b).trim_end_matches('/').to_string();
        let path = name(&e.path_bytes());
        // A later entry under the same name starts a new inode (tar_tree refuses that).
        if let Some(g) = group_of.remove(&path) {
            groups[g].remove(&path);
        }
        let g = if e.header().entry_type() == tar::EntryType::Link {
            let target = name(&e.link_name_bytes().expect("link target"));
            *group_of
                .get(&target)
                .expect("hard link target earlier in the tar")
        } else {
            groups.push(BTreeSet::new());
            groups.len() - 1
        };
        groups[g].insert(path.clone());
        group_of.insert(path, g);
    }
    groups.into_iter().filter(|g| g.len() > 1).collect()
}

/// The hard-link groups of the tree under `root`, as [`tar_link_groups`] gives them for a
/// tar: the non-directories sharing an inode, by path relative to `root`.
pub fn dir_link_groups(root: &Path) -> BTreeSet<BTreeSet<String>> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let mut by_ino: BTreeMap<(u64, u64), BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for ent in std::fs::read_dir(&dir).expect("read_dir") {
            let p = ent.expect("dir entry").path();
            let md = std::fs::symlink_metadata(&p).expect("lstat");
            if md.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p.strip_prefix(root).expect("under the root");
            by_ino
                .entry((md.dev(), md.ino()))
                .or_default()
                .insert(String::from_utf8_lossy(rel.as_os_str().as_bytes()).into_owned());
        }
    }
    by_ino.into_values().filter(|g| g.len() > 1).collect()
}

/// Reads every path of the image (but `lost+found`) with ext4-view and debugfs.
pub fn image_tree(img: &Path) -> BTreeMap<String, Obj> {
    let fs = ext4_view::Ext4::load_from_path(img).expect("ext4-view loads the image");
    let mut out = BTreeMap::new();
    let mut stack = vec![String::new()];
    while let Some(dir) = stack.pop() {
        let abs = format!("/{dir}");
        for ent in fs.read_dir(abs.as_str()).expect("read_dir") {
            let ent = ent.expect("dir entry");
            let name = ent.file_name().as_str().expect("utf-8 name").to_string();
            if name == "." || name == ".." || (dir.is_empty() && name == "lost+found") {
                continue;
            }
            let rel = if dir.is_empty() {
                name
            } else {
                format!("{dir}/{name}")
            };
            let p = format!("/{rel}");
            let md = fs.symlink_metadata(p.as_str()).expect("metadata");
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                'd'
            } else if ft.is_regular_file() {
                'f'
            } else if ft.is_symlink() {
                'l'
            } else if ft.is_char_dev() {
                'c'
            } else if ft.is_block_dev() {
                'b'
            } else if ft.is_fifo() {
                'p'
            } else {
                '?'
            };
            let (size, hash) = if kind == 'f' {
                let data = fs.read(p.as_str()).expect("read file");
                (data.len() as u64, hex::encode(Sha256::digest(&data)))
            } else {
                (0, String::new())
            };
            let link = if kind == 'l' {
                fs.read_link(p.as_str())
                    .expect("read_link")
                    .as_ref()
                    .to_vec()
            } else {
                Vec::new()
            };
            if kind == 'd' {
                stack.push(rel.clone());
            }
            out.insert(
                rel,
                Obj {
                    kind,
                    mode: md.mode() as u32,
                    uid: md.uid(),
                    gid: md.gid(),
                    mtime: md.modified().seconds().max(0) as u64,
                    size,
                    hash,
                    link,
                    xattrs: BTreeMap::new(),
                },
            );
        }
    }
    let names: Vec<String> = out.keys().cloned().collect();
    for (path, xs) in debugfs_xattrs(img, &names) {
        if let Some(o) = out.get_mut(&path) {
            o.xattrs = xs;
        }
    }
    out
}

/// Quotes a path for a debugfs command line.
fn dq(p: &str) -> String {
    format!("\"/{}\"", p.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The xattrs of each path, through one `debugfs` run of `ea_list` and one of `ea_get -f`.
pub fn debugfs_xattrs(img: &Path, paths: &[String]) -> BTreeMap<String, BTreeMap<String, Vec<u8>>> {
    let dir = tempfile::tempdir().expect("tempdir");
    let cmds = dir.path().join("list");
    let mut script = String::new();
    for p in paths {
        script.push_str(&format!("ea_list {}\n", dq(p)));
    }
    std::fs::write(&cmds, script).expect("write debugfs commands");
    let out = Command::new("debugfs")
        .arg("-f")
        .arg(&cmds)
        .arg(img)
        .output()
        .expect("debugfs (e2fsprogs, ci/setup.sh)");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names: Vec<(String, String)> = Vec::new();
    // With -f, debugfs echoes each command as `debugfs: ea_list "/path"`.
    let by_quoted: BTreeMap<String, &String> = paths.iter().map(|p| (dq(p), p)).collect();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        if let Some(q) = line.strip_prefix("debugfs: ea_list ") {
            cur = by_quoted.get(q.trim_end()).map(|p| (*p).clone());
        } else if let (Some(p), Some(rest)) = (&cur, line.strip_prefix("  "))
            && let Some((name, _)) = rest.split_once(" (")
        {
            names.push((p.clone(), name.to_string()));
        }
    }
    let mut result: BTreeMap<String, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
    if names.is_empty() {
        return result;
    }
    let mut script = String::new();
    for (i, (p, n)) in names.iter().enumerate() {
        let f = dir.path().join(format!("v{i}"));
        script.push_str(&format!("ea_get -f {} {} {n}\n", f.display(), dq(p)));
    }
    std::fs::write(&cmds, script).expect("write debugfs commands");
    let st = Command::new("debugfs")
        .arg("-f")
        .arg(&cmds)
        .arg(img)
        .output()
        .expect("debugfs");
    assert!(st.status.success(), "debugfs ea_get");
    for (i, (p, n)) in names.into_iter().enumerate() {
        let v = std::fs::read(dir.path().join(format!("v{i}")))
            .unwrap_or_else(|e| panic!("ea_get {p} {n}: {e}"));
        result.entry(p).or_default().insert(n, v);
    }
    result
}

/// Compares the tar's tree with the image's; returns the differences (empty when equal).
pub fn compare(tar: &BTreeMap<String, Obj>, img: &BTreeMap<String, Obj>) -> Vec<String> {
    let mut diffs = Vec::new();
    for (p, t) in tar {
        match img.get(p) {
            None => diffs.push(format!("{p}: in the tar, not in the image")),
            Some(i) if i != t => diffs.push(format!("{p}: tar {t:?}\n   image {i:?}")),
            Some(_) => {}
        }
    }
    for p in img.keys() {
        if !tar.contains_key(p) {
            diffs.push(format!("{p}: in the image, not in the tar"));
        }
    }
    diffs
}
