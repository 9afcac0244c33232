//! Writing a directory tree as a deterministic, gzip-compressed layer tar.
//!
//! Entries are sorted by name (bytes), directories before their contents; names are relative
//! with no `./` prefix and directories end in `/`. Owners, permission bits (with
//! setuid/setgid/sticky), devices, FIFOs, symlinks, hard links (the first path of an inode in
//! walk order carries the data, later ones are `Link` entries) and xattrs (PAX
//! `SCHILY.xattr.*`, except `security.selinux`) are kept; user and group names are left empty;
//! mtimes are clamped to `SOURCE_DATE_EPOCH` when given. Sockets are skipped (tar cannot hold
//! them). gzip uses a pinned level with a zero header mtime and no file name, so the same tree
//! gives the same bytes.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use sha2::{Digest as _, Sha256};

/// The gzip level layers are written with (flate2's default, 6).
pub const GZIP_LEVEL: u32 = 6;

/// What [`write_layer`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `sha256:` of the compressed bytes (the layer's descriptor digest).
    pub digest: String,
    /// `sha256:` of the uncompressed tar (the config's `rootfs.diff_ids` entry).
    pub diff_id: String,
    /// Compressed size, bytes.
    pub size: u64,
}

struct HashWriter<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the tree under `root` (the root's own metadata excluded) as a gzip layer into
/// `out`. `source_date_epoch` clamps mtimes (seconds since 1970).
pub fn write_layer(
    root: &Path,
    out: impl Write,
    source_date_epoch: Option<u64>,
) -> io::Result<Written> {
    write_tree(root, out, source_date_epoch, false)
}

/// Writes an overlayfs upper directory as a gzip layer into `out`, like [`write_layer`] but
/// with overlayfs' change markers turned into the OCI image spec's (`layer.md`,
/// "Whiteouts"; Linux `Documentation/filesystems/overlayfs.rst`, "whiteouts and opaque
/// directories"): a character device 0/0 named `x` becomes an empty regular file `.wh.x`,
/// a directory with the xattr `trusted.overlay.opaque=y` gets a `.wh..wh..opq` entry first
/// inside it, and no `trusted.overlay.*` xattr reaches the layer.
pub fn write_upper_layer(
    root: &Path,
    out: impl Write,
    source_date_epoch: Option<u64>,
) -> io::Result<Written> {
    write_tree(root, out, source_date_epoch, true)
}

/// The overlayfs xattr namespace (`trusted.overlay.`), never written into a layer.
const OVERLAY_XATTR_PREFIX: &str = "trusted.overlay.";
/// The overlayfs opaque directory marker.
pub const OVERLAY_OPAQUE_XATTR: &str = "trusted.overlay.opaque";

fn write_tree(
    root: &Path,
    out: impl Write,
    source_date_epoch: Option<u64>,
    overlay: bool,
) -> io::Result<Written> {
    let outer = HashWriter {
        inner: out,
        hash: Sha256::new(),
        len: 0,
    };
    let gz = flate2::GzBuilder::new()
        .mtime(0)
        .write(outer, flate2::Compression::new(GZIP_LEVEL));
    let inner = HashWriter {
        inner: gz,
        hash: Sha256::new(),
        len: 0,
    };
    let mut b = tar::Builder::new(inner);
    b.mode(tar::HeaderMode::Complete);
    b.follow_symlinks(false);
    let mut links: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    walk(
        root,
        Vec::new(),
        &mut b,
        &mut links,
        source_date_epoch,
        overlay,
    )?;
    let inner = b.into_inner()?;
    let diff_id = format!("sha256:{}", hex::encode(inner.hash.finalize()));
    let mut outer = inner.inner.finish()?;
    outer.flush()?;
    Ok(Written {
        digest: format!("sha256:{}", hex::encode(outer.hash.finalize())),
        diff_id,
        size: outer.len,
    })
}

fn walk<W: Write>(
    dir: &Path,
    prefix: Vec<u8>,
    b: &mut tar::Builder<W>,
    links: &mut HashMap<(u64, u64), Vec<u8>>,
    epoch: Option<u64>,
    overlay: bool,
) -> io::Result<()> {
    // (name in the layer, name on disk), sorted by the former.
    let mut names: Vec<(Vec<u8>, std::ffi::OsString)> = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let mut out_name = name.as_bytes().to_vec();
        if overlay {
            let md = std::fs::symlink_metadata(e.path())?;
            if md.file_type().is_char_device() && md.rdev() == 0 {
                out_name = [super::whiteout::PREFIX.as_bytes(), name.as_bytes()].concat();
            }
        }
        names.push((out_name, name));
    }
    names.sort_by(|a, b| a.0.cmp(&b.0));
    if overlay && !prefix.is_empty() && is_opaque(dir)? {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(0);
        h.set_mtime(epoch.unwrap_or(0));
        let mut rel = prefix.clone();
        rel.extend_from_slice(super::whiteout::OPAQUE.as_bytes());
        b.append_data(
            &mut h,
            Path::new(std::ffi::OsStr::from_bytes(&rel)),
            io::empty(),
        )?;
    }
    for (out_name, name) in names {
        let path = dir.join(&name);
        let md = std::fs::symlink_metadata(&path)?;
        let ft = md.file_type();
        if ft.is_socket() {
            continue;
        }
        let mut rel = prefix.clone();
        rel.extend_from_slice(&out_name);
        if overlay && ft.is_char_device() && md.rdev() == 0 {
            // An overlayfs whiteout: an empty regular `.wh.<name>`.
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(0);
            let mtime = md.mtime().max(0) as u64;
            h.set_mtime(epoch.map_or(mtime, |e| mtime.min(e)));
            b.append_data(
                &mut h,
                Path::new(std::ffi::OsStr::from_bytes(&rel)),
                io::empty(),
            )?;
            continue;
        }
        let mut xattrs: Vec<(String, Vec<u8>)> = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let n = rustix::fs::llistxattr(&path, &mut buf[..]).map_err(io::Error::from)?;
        for k in buf[..n].split(|c| *c == 0).filter(|s| !s.is_empty()) {
            let k = String::from_utf8_lossy(k).into_owned();
            if k == "security.selinux" || (overlay && k.starts_with(OVERLAY_XATTR_PREFIX)) {
                continue;
            }
            let mut v = vec![0u8; 64 << 10];
            let m =
                rustix::fs::lgetxattr(&path, k.as_str(), &mut v[..]).map_err(io::Error::from)?;
            v.truncate(m);
            xattrs.push((format!("SCHILY.xattr.{k}"), v));
        }
        xattrs.sort();
        if !xattrs.is_empty() {
            b.append_pax_extensions(xattrs.iter().map(|(k, v)| (k.as_str(), v.as_slice())))?;
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(md.mode() & 0o7777);
        h.set_uid(md.uid() as u64);
        h.set_gid(md.gid() as u64);
        let mtime = md.mtime().max(0) as u64;
        h.set_mtime(epoch.map_or(mtime, |e| mtime.min(e)));
        h.set_size(0);
        let rel_path = Path::new(std::ffi::OsStr::from_bytes(&rel)).to_path_buf();
        if ft.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            let mut dname = rel.clone();
            dname.push(b'/');
            b.append_data(
                &mut h,
                Path::new(std::ffi::OsStr::from_bytes(&dname)),
                io::empty(),
            )?;
            let mut p = rel.clone();
            p.push(b'/');
            walk(&path, p, b, links, epoch, overlay)?;
        } else if ft.is_symlink() {
            h.set_entry_type(tar::EntryType::Symlink);
            let target = std::fs::read_link(&path)?;
            b.append_link(&mut h, &rel_path, &target)?;
        } else if ft.is_file() {
            if md.nlink() > 1 {
                if let Some(first) = links.get(&(md.dev(), md.ino())) {
                    h.set_entry_type(tar::EntryType::Link);
                    b.append_link(
                        &mut h,
                        &rel_path,
                        Path::new(std::ffi::OsStr::from_bytes(first)),
                    )?;
                    continue;
                }
                links.insert((md.dev(), md.ino()), rel.clone());
            }
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(md.len());
            let f = std::fs::File::open(&path)?;
            b.append_data(&mut h, &rel_path, f)?;
        } else if ft.is_char_device() || ft.is_block_device() || ft.is_fifo() {
            h.set_entry_type(if ft.is_char_device() {
                tar::EntryType::Char
            } else if ft.is_block_device() {
                tar::EntryType::Block
            } else {
                tar::EntryType::Fifo
            });
            if !ft.is_fifo() {
                h.set_device_major(rustix::fs::major(md.rdev()))?;
                h.set_device_minor(rustix::fs::minor(md.rdev()))?;
            }
            b.append_data(&mut h, &rel_path, io::empty())?;
        }
    }
    Ok(())
}

/// Whether `dir` carries overlayfs' opaque marker (`trusted.overlay.opaque` = `y`).
pub fn is_opaque(dir: &Path) -> io::Result<bool> {
    let mut v = [0u8; 8];
    match rustix::fs::lgetxattr(dir, OVERLAY_OPAQUE_XATTR, &mut v[..]) {
        Ok(n) => Ok(&v[..n] == b"y"),
        Err(rustix::io::Errno::NODATA) | Err(rustix::io::Errno::NOTSUP) => Ok(false),
        Err(e) => Err(e.into()),
    }
}
