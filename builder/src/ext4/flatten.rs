//! Flattening an image's layers into one tar stream, whiteouts applied.
//!
//! Two passes over the layer blobs (bottom first):
//!
//! 1. [`Flat::scan`] reads every layer's entry headers (no file data is kept) into a model of
//!    the final tree: path → directory or inode, inodes shared by hard links. Per layer, its
//!    entries are taken in stream order, whiteouts too, sparing what the layer made before
//!    them ([`crate::layer::whiteout`]), as [`crate::layer::apply_layer`] takes them.
//!    Entry parents are resolved inside the tree the way
//!    [`crate::layer::apply_layer`] resolves them (symlinks followed inside the root, `..`
//!    never above it, missing parents created), so the flattened tree is the tree
//!    `apply_layer` would unpack. An entry replacing something removes it first (a directory
//!    with everything below it). Each surviving object is given the stream position (layer,
//!    entry index) it is written at.
//!    With [`Flat::scan_keeping`] (what [`super::build`] uses) the scan also keeps each
//!    compressed layer's inflated stream in an unlinked temporary file, within a byte bound
//!    taken from the free space ([`Keep`]), so that a layer is inflated once per image.
//!    [`Scan`] is this pass a layer at a time: a build scans its base while its steps run
//!    ([`super::Prescan`]) and the publish continues with the steps' layers. The copy is
//!    shared while it grows ([`crate::layer::shared`]): the unpack of the base into its layer
//!    directory for the steps reads it instead of inflating the blob a second time.
//! 2. [`Flat::write`] reads the layers again (a kept layer from its plain copy, others from
//!    their blobs, inflating them again) and writes one tar (GNU headers, for their
//!    atime and ctime fields, GNU long-name records for long names, PAX records for
//!    xattrs): every
//!    surviving entry at its own position, so files stay in layer order (the order that gave
//!    98-99% chunk reuse between builds, see `kiln_store::chunk`). Directories are written at
//!    the first entry of their current incarnation with their last metadata; a directory
//!    needed earlier (an implicit parent) is written just before its first child. A regular
//!    file that replaces a lower layer's regular file (an edited `/etc/passwd`, dpkg's
//!    status) is written *in place*: at the position of that path's first version, its data
//!    taken from a spool the scan filled (at most [`spool::SPOOL_FILE_MAX`] per file and
//!    [`spool::SPOOL_TOTAL_MAX`] in all, in an unlinked temporary file; beyond that, or when the old
//!    inode lives on through a hard link, it is written at its own position). mke2fs lays
//!    file data out in stream order, so without this one changed file early in the base
//!    layer shifts every later file by its blocks. Measured (2026-11-30, `measure_chunking`
//!    of `kiln-store`, 512 MiB images) on the Debian fixture against the same plus a layer
//!    adding ten files and changing `/etc/motd`: FastCDC 64 KiB reused 88.9% of chunks
//!    (82.8% of bytes) and fixed 64 KiB 0.5% before, 99.4% (98.8%) and 99.5% in place;
//!    adding the files only gives 99.5% (98.9%). A file
//!    whose original name is gone but which lives on through a hard link made in a later
//!    layer is written, data and all, at its original position under the first surviving
//!    name; its other names follow as hard links. Directories no entry ever named come last.
//!
//! Output entries carry mode (permission bits incl. setuid/setgid/sticky; 0777 for a symlink,
//! the only mode one has on Linux), uid/gid, mtime
//! (clamped to `SOURCE_DATE_EPOCH` when one is set; atime and ctime equal to it), size, link target, device numbers and
//! the xattrs `apply_layer` keeps (`SCHILY.xattr.*`); names and link targets over 100 bytes
//! go into GNU long-name records (`L`, `K`; a PAX record cannot hold a newline for the
//! `tar` crate). A sparse file of a layer (a GNU sparse entry, read
//! by the entry reader's [`crate::layer::Extents`]) is written as one again, its map and
//! then only its data, so its holes never pass through the pipe (mke2fs, through libarchive,
//! makes them holes in the image); its blocks in the size estimate are those of its data. Hard links repeat the inode's metadata. Nothing
//! else from the input headers (user names, atime, ctime) passes through. The root directory is not written (mke2fs makes it: 0755,
//! 0:0).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;

use crate::layer::shared::{Inflation, Reserved};
use crate::layer::whiteout::{Created, WhiteoutKind};
use crate::layer::write::set_sparse;
use crate::layer::{
    Compression, DataReader, LayerError, LimitKind, Limits, Split, bounded_stream,
    bounded_stream_as, read_meta, split_name,
};

use super::{Ext4Error, LayerBlob};
use crate::rootfs::walk::{Lookup, Tree, Walk, WalkError, walk};

mod keep;
mod spool;
mod write;

use write::{WriteFail, Writer};

pub use keep::{KEEP_FREE_DIVISOR, Keep};
use keep::{Kept, Tee};
use spool::{Spool, SpoolReader};

/// Names, link targets and xattrs the scan keeps in memory over all layers, bytes (1 GiB;
/// the Debian base needs about 1 MiB). A hostile image could otherwise fill memory with
/// long names or xattrs within the per-layer [`Limits`].
pub const MAX_SCAN_BYTES: u64 = 1 << 30;

/// A stream position: (layer index, entry index in that layer's tar stream).
type Pos = (u32, u32);

/// Metadata of one output entry: the layer entry reader's ([`crate::layer::read_meta`]).
pub use crate::layer::Meta;

#[derive(Debug, Clone)]
enum Kind {
    /// A regular file of `size` bytes (apparent); `map`: the pieces of data of a sparse one
    /// ((offset, length), [`crate::layer::Extents`]), written as a GNU sparse entry.
    File {
        size: u64,
        map: Option<Vec<(u64, u64)>>,
    },
    Symlink(Vec<u8>),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

#[derive(Debug)]
struct Inode {
    kind: Kind,
    meta: Meta,
    src: Pos,
    /// For a file that replaced a file of a lower layer: the position of the first version
    /// of that path (where this one is written when its data is spooled).
    slot: Option<Pos>,
    /// Where its data is in the spool: (offset, length).
    spool: Option<(u64, u64)>,
}

#[derive(Debug)]
enum Node {
    Dir {
        meta: Option<Meta>,
        first: Option<Pos>,
    },
    Leaf {
        ino: usize,
        pos: Pos,
    },
}

#[derive(Debug, Clone)]
enum Action {
    Skip,
    Dir(Vec<u8>),
    Inode {
        ino: usize,
        name: Vec<u8>,
    },
    Link {
        ino: usize,
        name: Vec<u8>,
        target: Vec<u8>,
    },
    /// A replacing file written at its first version's position, data from the spool.
    Spooled {
        ino: usize,
        name: Vec<u8>,
    },
}

/// Counts of the flattened tree (what the ext4 image must hold).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlatStats {
    /// Tar entries read over all layers (whiteouts included).
    pub entries_read: u64,
    /// Uncompressed layer bytes read in the scan.
    pub layer_bytes: u64,
    /// Directories in the result (the root not counted).
    pub dirs: u64,
    /// Regular files (distinct inodes).
    pub files: u64,
    /// Symlinks (distinct inodes).
    pub symlinks: u64,
    /// Devices and FIFOs (distinct inodes).
    pub specials: u64,
    /// Names beyond the first of multiply linked inodes.
    pub extra_links: u64,
    /// Files that replace a lower layer's file, written at its position.
    pub in_place: u64,
    /// Compressed layers whose inflated stream the scan kept for pass 2 ([`Keep`]).
    pub layers_kept: u64,
    /// Bytes of those kept streams (plain tar, the [`Keep::max_bytes`] count).
    pub kept_bytes: u64,
    /// Bytes of regular file data.
    pub data_bytes: u64,
    /// 4 KiB blocks the tree needs: file data, long symlinks, directory blocks, xattr blocks
    /// (an estimate; see [`super::size_estimate`]).
    pub blocks: u64,
}

/// Pass 1's result: the final tree and where each of its objects is written.
pub struct Flat {
    layers: Vec<LayerBlob>,
    limits: Limits,
    clamp: Option<u64>,
    default_mtime: u64,
    paths: BTreeMap<Vec<u8>, Node>,
    inodes: Vec<Inode>,
    actions: Vec<Vec<Action>>,
    spool: Spool,
    /// Per layer: its inflated stream kept by the scan ([`Keep`]), which pass 2 reads instead
    /// of the blob.
    copies: Vec<Option<Kept>>,
    /// Directories whose link count passes [`LINK_MAX`], see [`Flat::link_max_dirs`].
    link_max_dirs: Vec<Vec<u8>>,
    /// Counts of the flattened tree.
    pub stats: FlatStats,
}

/// The largest link count ext4 keeps for a directory (`EXT4_LINK_MAX` of the Linux kernel,
/// `EXT2_LINK_MAX` of e2fsprogs: 65,000). With `dir_nlink`, a directory whose count would
/// pass it (2 + its subdirectories) has the count 1 instead: the kernel's `ext4_inc_count`
/// sets it so, and `e2fsck` pass 4 expects it.
pub const LINK_MAX: u64 = 65_000;

/// The mode of every symlink ([`Flat::add`]).
const SYMLINK_MODE: u32 = 0o777;

/// One entry as read in the scan.
struct Scanned {
    comps: Vec<Vec<u8>>,
    name: String,
    kind: tar::EntryType,
    meta: Meta,
    size: u64,
    link: Option<Vec<u8>>,
    dev: (u32, u32),
    spooled: Option<(u64, u64)>,
    /// A sparse file's pieces of data.
    map: Option<Vec<(u64, u64)>>,
}

fn join(comps: &[Vec<u8>]) -> Vec<u8> {
    comps.join(&b'/')
}

fn child(parent: &[u8], base: &[u8]) -> Vec<u8> {
    if parent.is_empty() {
        base.to_vec()
    } else {
        let mut p = Vec::with_capacity(parent.len() + 1 + base.len());
        p.extend_from_slice(parent);
        p.push(b'/');
        p.extend_from_slice(base);
        p
    }
}

/// The components of a tree path (`a/b/c`; none for the root, `""`), as [`Created`] keys
/// them.
fn comps_of(path: &[u8]) -> Vec<Vec<u8>> {
    if path.is_empty() {
        return Vec::new();
    }
    path.split(|b| *b == b'/').map(<[u8]>::to_vec).collect()
}

/// The key range of everything below `dir` (keys `dir/...`): `dir/` up to `dir0`.
fn below(dir: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut lo = dir.to_vec();
    lo.push(b'/');
    let mut hi = dir.to_vec();
    hi.push(b'/' + 1);
    (lo, hi)
}

fn open_layer(l: &LayerBlob) -> Result<File, Ext4Error> {
    File::open(&l.path).map_err(|source| Ext4Error::Io {
        path: l.path.clone(),
        source,
    })
}

/// Reads every header of one layer (data skipped). `kept` counts the bytes of names, link
/// targets and xattrs held so far, against [`MAX_SCAN_BYTES`].
/// `replaces(comps)`: whether a file at that name replaces a lower layer's file (its data is
/// then spooled, within the spool's bounds). `keep`: where a compressed layer's inflated
/// stream is copied and how many bytes it may take ([`Keep`]); the copy is returned when it
/// was kept whole. `reserved`: the copy published ahead for this layer ([`Scan::reserve`]),
/// written when the layer is kept, else abandoned.
#[allow(clippy::too_many_arguments)]
fn scan_layer(
    l: &LayerBlob,
    limits: &Limits,
    kept: &mut u64,
    max_kept: u64,
    replaces: &dyn Fn(&[Vec<u8>]) -> bool,
    spool: &mut Spool,
    keep: Option<(&Path, u64)>,
    reserved: Option<Reserved>,
) -> Result<(Vec<Scanned>, u64, Option<Kept>), Ext4Error> {
    let (stream, bounded) = bounded_stream(open_layer(l)?, &l.digest, limits)?;
    let out = match keep {
        Some((dir, max)) if max > 0 && bounded.compression() != Compression::None => {
            match reserved {
                Some(r) => r.take(),
                // Published under the digest: an unpack of this layer meanwhile follows it.
                None => match tempfile::tempfile_in(dir) {
                    Ok(f) => Some(Inflation::publish(&l.digest, f)),
                    Err(e) => {
                        tracing::debug!(dir = %dir.display(), error = %e, "not keeping the inflated layer");
                        None
                    }
                },
            }
        }
        // Not kept: a copy reserved for it is abandoned (dropped).
        _ => None,
    };
    let max = keep.map_or(0, |k| k.1);
    let mut archive = tar::Archive::new(Tee::new(stream, out, max));
    let mut out = Vec::new();
    let mut last = String::from("(start)");
    let entries = archive.entries().map_err(|e| bounded.error(e, "(start)"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bounded.error(e, &last))?;
        let raw = entry.path_bytes().into_owned();
        last = String::from_utf8_lossy(&raw).into_owned();
        if out.len() as u64 >= limits.max_entries {
            return Err(LayerError::Limit {
                digest: l.digest.clone(),
                entry: last,
                kind: LimitKind::Entries,
                max: limits.max_entries,
            }
            .into());
        }
        let comps = match split_name(&raw) {
            Split::Ok(c) => c,
            Split::DotDot => {
                return Err(LayerError::DotDot {
                    digest: l.digest.clone(),
                    entry: last,
                }
                .into());
            }
            Split::Nul => {
                return Err(LayerError::NulInName {
                    digest: l.digest.clone(),
                    entry: last,
                }
                .into());
            }
        };
        let kind = entry.header().entry_type();
        let meta = read_meta(&mut entry).map_err(|e| bounded.error(e, &last))?;
        let size = entry.size();
        let is_file = matches!(
            kind,
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse
        );
        let map = if is_file {
            let ext = bounded
                .extents(&entry)
                .map_err(|e| bounded.error(e, &last))?;
            ext.sparse.then_some(ext.segments)
        } else {
            None
        };
        if is_file && size > limits.max_file_bytes {
            return Err(LayerError::Limit {
                digest: l.digest.clone(),
                entry: last,
                kind: LimitKind::FileBytes,
                max: limits.max_file_bytes,
            }
            .into());
        }
        let link = entry.link_name_bytes().map(|c| c.into_owned());
        *kept += (raw.len() + link.as_ref().map_or(0, Vec::len)) as u64
            + 16 * map.as_ref().map_or(0, Vec::len) as u64
            + meta
                .xattrs
                .iter()
                .map(|(k, v)| (k.len() + v.len()) as u64)
                .sum::<u64>();
        if *kept > max_kept {
            return Err(Ext4Error::ScanTooLarge {
                digest: l.digest.clone(),
                entry: last,
                limit: max_kept,
            });
        }
        let h = entry.header();
        let dev = (
            h.device_major().ok().flatten().unwrap_or(0),
            h.device_minor().ok().flatten().unwrap_or(0),
        );
        // A sparse file is not spooled: it is written at its own position.
        let spooled = if is_file && map.is_none() && replaces(&comps) {
            spool
                .put(&mut entry, size)
                .map_err(|e| bounded.error(e, &last))?
        } else {
            None
        };
        out.push(Scanned {
            comps,
            name: last.clone(),
            kind,
            meta,
            size,
            link,
            dev,
            spooled,
            map,
        });
    }
    let copy = archive.into_inner().finish();
    Ok((out, bounded.bytes(), copy))
}

/// Pass 1 taken a layer at a time: [`Scan::new`], [`Scan::layer`] for each layer bottom
/// first, then [`Scan::finish`] for the [`Flat`] that pass 2 writes. [`Flat::scan`] is this
/// over all layers at once; a build starts one on its base layers while its steps run and
/// continues it with the steps' layers when it publishes ([`super::Prescan`],
/// [`Scan::resume`]).
pub struct Scan {
    flat: Flat,
    /// Bytes of names, link targets and xattrs held so far, against `max_kept`.
    kept: u64,
    max_kept: u64,
    keep: Option<Keep>,
    /// Copies published ahead for layers not read yet ([`Scan::reserve`]), by digest.
    reserved: Vec<(String, Reserved)>,
}

impl Scan {
    /// An empty scan: nothing read yet. `clamp`, `default_mtime` as in [`Flat::scan`];
    /// `keep`: where and how much of the compressed layers' inflated streams to keep for
    /// pass 2 ([`Keep`]; `None`: pass 2 inflates them again).
    pub fn new(
        limits: &Limits,
        clamp: Option<u64>,
        default_mtime: u64,
        keep: Option<Keep>,
    ) -> Scan {
        Self::bounded(limits, clamp, default_mtime, keep, MAX_SCAN_BYTES)
    }

    /// [`Scan::new`] with another bound than [`MAX_SCAN_BYTES`].
    pub(crate) fn bounded(
        limits: &Limits,
        clamp: Option<u64>,
        default_mtime: u64,
        keep: Option<Keep>,
        max_kept: u64,
    ) -> Scan {
        Scan {
            flat: Flat {
                layers: Vec::new(),
                limits: limits.clone(),
                clamp,
                default_mtime,
                paths: BTreeMap::new(),
                inodes: Vec::new(),
                actions: Vec::new(),
                spool: Spool { file: None, len: 0 },
                copies: Vec::new(),
                link_max_dirs: Vec::new(),
                stats: FlatStats::default(),
            },
            kept: 0,
            max_kept,
            keep,
            reserved: Vec::new(),
        }
    }

    /// Publishes now, before any is read, the copies this scan will keep of `layers`
    /// ([`crate::layer::shared::Reserved`]): an unpack of one of them that starts before the
    /// scan reaches it follows the copy instead of inflating the blob too. Nothing when the
    /// scan keeps nothing or a temporary file cannot be made.
    pub(crate) fn reserve(&mut self, layers: &[LayerBlob]) {
        let Some(keep) = &self.keep else { return };
        if keep.max_bytes == 0 {
            return;
        }
        for l in layers {
            match tempfile::tempfile_in(&keep.dir) {
                Ok(f) => self
                    .reserved
                    .push((l.digest.clone(), Reserved::new(&l.digest, f))),
                Err(e) => {
                    tracing::debug!(dir = %keep.dir.display(), error = %e, "no copy reserved");
                    return;
                }
            }
        }
    }

    /// The layers read so far, bottom first.
    pub fn layers(&self) -> &[LayerBlob] {
        &self.flat.layers
    }

    /// This scan, to be continued by a flatten of `layers` with `limits`, `clamp` and
    /// `default_mtime`, when it was made with the same settings (the same bounds and
    /// deadline of [`Limits`]; its cancel flag may differ, and from here on `limits`' is
    /// used) and what it has read is the bottom of `layers`. `None` otherwise: it is dropped
    /// and the flatten scans from the start.
    pub fn resume(
        mut self,
        layers: &[LayerBlob],
        limits: &Limits,
        clamp: Option<u64>,
        default_mtime: u64,
    ) -> Option<Scan> {
        let f = &self.flat;
        let same = f.limits.max_total_bytes == limits.max_total_bytes
            && f.limits.max_entries == limits.max_entries
            && f.limits.max_file_bytes == limits.max_file_bytes
            && f.limits.deadline == limits.deadline
            && f.clamp == clamp
            && f.default_mtime == default_mtime
            && layers.starts_with(&f.layers);
        if !same {
            return None;
        }
        self.flat.limits = limits.clone();
        Some(self)
    }

    /// Reads the next layer up (`l`) into the tree. Errors: as [`Flat::scan`]; the scan is
    /// gone with them.
    pub fn layer(mut self, l: &LayerBlob) -> Result<Scan, Ext4Error> {
        let li = self.flat.layers.len();
        let reserved = self
            .reserved
            .iter()
            .position(|(d, _)| *d == l.digest)
            .map(|i| self.reserved.remove(i).1);
        let f = &mut self.flat;
        let room = self.keep.as_ref().map(|k| {
            (
                k.dir.as_path(),
                k.max_bytes.saturating_sub(f.stats.kept_bytes),
            )
        });
        let (entries, bytes, copy) = {
            let Flat {
                paths,
                inodes,
                spool,
                limits,
                ..
            } = &mut *f;
            // A plain lookup of the name (no symlink resolution): layers written from an
            // overlay's upper directory name real paths.
            let replaces = |comps: &[Vec<u8>]| {
                li > 0
                    && matches!(paths.get(&join(comps)),
                        Some(Node::Leaf { ino, .. })
                            if matches!(inodes[*ino].kind, Kind::File { .. }))
            };
            scan_layer(
                l,
                limits,
                &mut self.kept,
                self.max_kept,
                &replaces,
                spool,
                room,
                reserved,
            )?
        };
        if let Some(c) = &copy {
            f.stats.layers_kept += 1;
            f.stats.kept_bytes += c.len;
        }
        f.layers.push(l.clone());
        f.copies.push(copy);
        f.stats.entries_read += entries.len() as u64;
        f.stats.layer_bytes += bytes;
        f.actions.push(vec![Action::Skip; entries.len()]);
        let mut cx = Cx {
            digest: &l.digest,
            entry: String::new(),
        };
        // In stream order, whiteouts too, as the applier goes ([`crate::layer::whiteout`]).
        let mut made = Created::default();
        for (ei, e) in entries.into_iter().enumerate() {
            let pos = (li as u32, ei as u32);
            cx.entry.clone_from(&e.name);
            f.add(e, pos, &cx, &mut made)?;
        }
        Ok(self)
    }

    /// The final tree of the layers read, ready for [`Flat::write`].
    pub fn finish(mut self) -> Flat {
        self.flat.plan();
        self.flat
    }
}

/// The flattened tree in memory as a [`Tree`] for the walk: a directory is its path (`""`
/// for the root), a symlink's leaf its target (other leaves empty).
struct Model<'a>(&'a mut Flat);

impl Tree for Model<'_> {
    type Dir = Vec<u8>;
    type Leaf = Vec<u8>;
    type Error = std::convert::Infallible;

    fn lookup(&mut self, dir: &Vec<u8>, name: &[u8]) -> Result<Lookup<Vec<u8>>, Self::Error> {
        Ok(match self.0.paths.get(&child(dir, name)) {
            None => Lookup::Missing,
            Some(Node::Dir { .. }) => Lookup::Dir(Vec::new()),
            Some(Node::Leaf { ino, .. }) => match &self.0.inodes[*ino].kind {
                Kind::Symlink(target) => Lookup::Symlink(target.clone()),
                _ => Lookup::Other(Vec::new()),
            },
        })
    }

    fn read_link(
        &mut self,
        _: &Vec<u8>,
        _: &[u8],
        target: &Vec<u8>,
    ) -> Result<Vec<u8>, Self::Error> {
        Ok(target.clone())
    }

    fn enter(&mut self, dir: &Vec<u8>, name: &[u8], _: Vec<u8>) -> Result<Vec<u8>, Self::Error> {
        Ok(child(dir, name))
    }

    fn make_dir(&mut self, dir: &Vec<u8>, name: &[u8]) -> Result<Vec<u8>, Self::Error> {
        let path = child(dir, name);
        self.0.paths.insert(
            path.clone(),
            Node::Dir {
                meta: None,
                first: None,
            },
        );
        Ok(path)
    }

    fn replace_with_dir(&mut self, dir: &Vec<u8>, name: &[u8]) -> Result<Vec<u8>, Self::Error> {
        self.0.paths.remove(&child(dir, name));
        self.make_dir(dir, name)
    }
}

impl Flat {
    /// Pass 1: reads the headers of every layer (bottom first) and computes the final tree.
    /// `clamp`: `SOURCE_DATE_EPOCH`, mtimes above it are lowered to it; `default_mtime`: the
    /// mtime of directories no entry describes.
    ///
    /// Errors: [`Ext4Error::Layer`] for an unreadable or hostile layer (names with `..` or a
    /// leading `/`, symlinked parents leading out of the root, hard links to missing or
    /// outside targets or to directories, malformed whiteouts, unsupported entry types,
    /// exceeded [`Limits`]), [`Ext4Error::Io`] when a blob cannot be opened.
    pub fn scan(
        layers: &[LayerBlob],
        limits: &Limits,
        clamp: Option<u64>,
        default_mtime: u64,
    ) -> Result<Flat, Ext4Error> {
        Self::scan_bounded(layers, limits, clamp, default_mtime, MAX_SCAN_BYTES, None)
    }

    /// [`Flat::scan`] that keeps each compressed layer's inflated stream as `keep` says, for
    /// [`Flat::write`] to read instead of inflating the blob again.
    pub fn scan_keeping(
        layers: &[LayerBlob],
        limits: &Limits,
        clamp: Option<u64>,
        default_mtime: u64,
        keep: &Keep,
    ) -> Result<Flat, Ext4Error> {
        Self::scan_bounded(
            layers,
            limits,
            clamp,
            default_mtime,
            MAX_SCAN_BYTES,
            Some(keep),
        )
    }

    /// [`Flat::scan`] with another bound than [`MAX_SCAN_BYTES`] on what it keeps in memory
    /// and, when `keep` is given, copies of the inflated layers ([`Keep`]).
    pub(crate) fn scan_bounded(
        layers: &[LayerBlob],
        limits: &Limits,
        clamp: Option<u64>,
        default_mtime: u64,
        max_kept: u64,
        keep: Option<&Keep>,
    ) -> Result<Flat, Ext4Error> {
        let mut s = Scan::bounded(limits, clamp, default_mtime, keep.cloned(), max_kept);
        for l in layers {
            s = s.layer(l)?;
        }
        Ok(s.finish())
    }

    /// Resolves `comps` (a directory path) inside the tree, with the walk `apply_layer`
    /// uses ([`crate::rootfs`]: symlinks followed inside the root, a `..` above it
    /// refused); creates missing directories when `create`, else returns `None` for a
    /// missing one.
    fn resolve(
        &mut self,
        comps: &[Vec<u8>],
        create: bool,
        cx: &Cx<'_>,
    ) -> Result<Option<Vec<u8>>, Ext4Error> {
        let how = Walk::layer_parents(create);
        match walk(&mut Model(self), Vec::new(), comps, &how) {
            Ok(mut reached) => Ok(reached.dirs.pop().map(|(path, _)| path)),
            Err(WalkError::Missing) => Ok(None),
            Err(WalkError::Tree(never)) => match never {},
            Err(WalkError::Escape) => {
                Err(cx.err(|digest, entry| LayerError::SymlinkEscape { digest, entry }))
            }
            Err(WalkError::Loop) => {
                Err(cx.err(|digest, entry| LayerError::SymlinkLoop { digest, entry }))
            }
            Err(WalkError::TooDeep) => {
                Err(cx.err(|digest, entry| LayerError::TooDeep { digest, entry }))
            }
            Err(WalkError::NotADirectory) => {
                Err(cx.err(|digest, entry| LayerError::NotADirectory { digest, entry }))
            }
        }
    }

    /// Removes `path` and, for a directory, everything below it.
    fn remove(&mut self, path: &[u8]) {
        if let Some(Node::Dir { .. }) = self.paths.remove(path) {
            self.remove_below(path);
        }
    }

    /// Removes everything below `dir` (all of the tree for the root, `""`).
    fn remove_below(&mut self, dir: &[u8]) {
        self.remove_below_unless(dir, |_| false);
    }

    /// Removes everything below `dir` (all of the tree for the root, `""`) but the paths
    /// `keep` spares. `keep` must spare a path's ancestors with it ([`Created`] does), so
    /// that nothing is kept below a removed directory.
    fn remove_below_unless(&mut self, dir: &[u8], keep: impl Fn(&[u8]) -> bool) {
        if dir.is_empty() {
            self.paths.retain(|k, _| keep(k));
            return;
        }
        let (lo, hi) = below(dir);
        let gone: Vec<Vec<u8>> = self
            .paths
            .range(lo..hi)
            .filter(|(k, _)| !keep(k))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.paths.remove(&k);
        }
    }

    /// What a whiteout does to `path`: removes it and everything below it that this layer
    /// has not made (`made`), and keeps what it made, at any depth, as the applier does
    /// ([`crate::layer::whiteout`]).
    fn remove_lower(&mut self, path: &[u8], made: &Created) {
        if made.contains(&comps_of(path)) {
            self.remove_below_unless(path, |k| made.contains(&comps_of(k)));
        } else {
            self.remove(path);
        }
    }

    fn clamp_meta(&self, mut m: Meta) -> Meta {
        if let Some(c) = self.clamp {
            m.mtime = m.mtime.min(c);
        }
        m
    }

    fn new_inode(&mut self, kind: Kind, meta: Meta, src: Pos) -> usize {
        let meta = self.clamp_meta(meta);
        self.inodes.push(Inode {
            kind,
            meta,
            src,
            slot: None,
            spool: None,
        });
        self.inodes.len() - 1
    }

    /// Takes one entry of a layer into the tree, in stream order. `made`: the paths the
    /// layer has made before it, which its whiteouts spare; the entry's path is added.
    fn add(
        &mut self,
        e: Scanned,
        pos: Pos,
        cx: &Cx<'_>,
        made: &mut Created,
    ) -> Result<(), Ext4Error> {
        use tar::EntryType as T;
        if e.kind.is_pax_global_extensions() {
            return Ok(());
        }
        let Some((base, parent)) = e.comps.split_last() else {
            return Ok(()); // the root itself
        };
        match cx.whiteout(base)? {
            WhiteoutKind::None => {}
            WhiteoutKind::Meta => return Ok(()),
            WhiteoutKind::Remove(name) => {
                if let Some(dir) = self.resolve(parent, false, cx)? {
                    self.remove_lower(&child(&dir, name), made);
                }
                return Ok(());
            }
            WhiteoutKind::Opaque => {
                if let Some(dir) = self.resolve(parent, true, cx)? {
                    self.remove_below_unless(&dir, |k| made.contains(&comps_of(k)));
                    made.insert(&comps_of(&dir));
                }
                return Ok(());
            }
        }
        let Some(dir) = self.resolve(parent, true, cx)? else {
            return Ok(()); // unreachable: create is true
        };
        let full = child(&dir, base);
        made.insert(&comps_of(&full));
        let kind = match e.kind {
            T::Directory => {
                let meta = self.clamp_meta(e.meta);
                match self.paths.get_mut(&full) {
                    Some(Node::Dir { meta: m, first }) => {
                        *m = Some(meta);
                        first.get_or_insert(pos);
                    }
                    _ => {
                        self.remove(&full);
                        self.paths.insert(
                            full,
                            Node::Dir {
                                meta: Some(meta),
                                first: Some(pos),
                            },
                        );
                    }
                }
                return Ok(());
            }
            T::Link => {
                let target = e.link.unwrap_or_default();
                let (ino, tpath) = self.link_target(&target, cx)?;
                if matches!(self.paths.get(&full), Some(Node::Leaf { ino: i, .. }) if *i == ino) {
                    return Ok(());
                }
                // What the link replaces goes first, as the applier removes it before
                // linking: a target below it (`d` linked to `d/f`) is gone with it.
                self.remove(&full);
                if !self.paths.contains_key(&tpath) {
                    return Err(cx.err(|digest, entry| LayerError::HardLinkMissing {
                        digest,
                        entry,
                        target: String::from_utf8_lossy(&target).into_owned(),
                    }));
                }
                self.paths.insert(full, Node::Leaf { ino, pos });
                return Ok(());
            }
            T::Regular | T::Continuous | T::GNUSparse => Kind::File {
                size: e.size,
                map: e.map,
            },
            T::Symlink => Kind::Symlink(e.link.unwrap_or_default()),
            T::Char => Kind::Char(e.dev.0, e.dev.1),
            T::Block => Kind::Block(e.dev.0, e.dev.1),
            T::Fifo => Kind::Fifo,
            other => {
                return Err(cx.err(|digest, entry| LayerError::UnsupportedType {
                    digest,
                    entry,
                    kind: other.as_byte() as char,
                }));
            }
        };
        let is_file = matches!(kind, Kind::File { .. });
        let mut meta = e.meta;
        if matches!(kind, Kind::Symlink(_)) {
            // A symlink on Linux has the mode 0777 whatever the header says: the applier's
            // `symlinkat` gives it that and nothing can change it (no `lchmod`).
            meta.mode = SYMLINK_MODE;
        }
        let ino = self.new_inode(kind, meta, pos);
        if is_file
            && let Some(Node::Leaf { ino: old, .. }) = self.paths.get(&full)
            && let Kind::File { .. } = self.inodes[*old].kind
        {
            let slot = self.inodes[*old].slot.unwrap_or(self.inodes[*old].src);
            self.inodes[ino].slot = Some(slot);
            self.inodes[ino].spool = e.spooled;
        }
        self.remove(&full);
        self.paths.insert(full, Node::Leaf { ino, pos });
        Ok(())
    }

    /// The inode a hard link's target names and the target's path, symlinks resolved
    /// (resolved like the layer applier does).
    fn link_target(&mut self, target: &[u8], cx: &Cx<'_>) -> Result<(usize, Vec<u8>), Ext4Error> {
        let tname = String::from_utf8_lossy(target).into_owned();
        let escape = |cx: &Cx<'_>| {
            cx.err(|digest, entry| LayerError::HardLinkEscape {
                digest,
                entry,
                target: tname.clone(),
            })
        };
        let missing = |cx: &Cx<'_>| {
            cx.err(|digest, entry| LayerError::HardLinkMissing {
                digest,
                entry,
                target: tname.clone(),
            })
        };
        let to_dir = |cx: &Cx<'_>| {
            cx.err(|digest, entry| LayerError::HardLinkToDirectory {
                digest,
                entry,
                target: tname.clone(),
            })
        };
        let comps = match split_name(target) {
            Split::Ok(c) => c,
            _ => return Err(escape(cx)),
        };
        let Some((tbase, tparent)) = comps.split_last() else {
            return Err(to_dir(cx));
        };
        let dir = match self.resolve(tparent, false, cx) {
            Ok(Some(d)) => d,
            Ok(None) => return Err(missing(cx)),
            Err(Ext4Error::Layer(LayerError::SymlinkEscape { .. })) => return Err(escape(cx)),
            Err(e) => return Err(e),
        };
        let path = child(&dir, tbase);
        match self.paths.get(&path) {
            None => Err(missing(cx)),
            Some(Node::Dir { .. }) => Err(to_dir(cx)),
            Some(Node::Leaf { ino, .. }) => Ok((*ino, path)),
        }
    }

    /// Decides what is written at each stream position and computes the counts.
    fn plan(&mut self) {
        let mut names: HashMap<usize, Vec<(Pos, Vec<u8>)>> = HashMap::new();
        let mut dir_bytes: HashMap<Vec<u8>, u64> = HashMap::new();
        let mut subdirs: HashMap<Vec<u8>, u64> = HashMap::new();
        let mut stats = std::mem::take(&mut self.stats);
        for (path, node) in &self.paths {
            let (parent, base) = match path.iter().rposition(|b| *b == b'/') {
                Some(i) => (path[..i].to_vec(), &path[i + 1..]),
                None => (Vec::new(), &path[..]),
            };
            // ext4 directory entry: 8 bytes + name, padded to 4 (ext4 disk layout, "Linear
            // (Classic) Directories").
            *dir_bytes.entry(parent.clone()).or_default() +=
                8 + (base.len() as u64).div_ceil(4) * 4;
            match node {
                Node::Dir { first, meta } => {
                    stats.dirs += 1;
                    *subdirs.entry(parent.clone()).or_default() += 1;
                    stats.blocks += xattr_blocks(meta.as_ref());
                    if let Some(p) = first {
                        self.actions[p.0 as usize][p.1 as usize] = Action::Dir(path.clone());
                    }
                }
                Node::Leaf { ino, pos } => {
                    names.entry(*ino).or_default().push((*pos, path.clone()));
                }
            }
        }
        // Every directory has at least one block, an empty one too (for `.` and `..`).
        for (path, node) in &self.paths {
            if matches!(node, Node::Dir { .. }) {
                dir_bytes.entry(path.clone()).or_default();
            }
        }
        for bytes in dir_bytes.values() {
            // `.` and `..` take 24 bytes; each 4 KiB block keeps 12 bytes for its checksum
            // tail (metadata_csum); an htree directory adds its root block.
            let b = (24 + bytes).div_ceil(4096 - 12);
            stats.blocks += if b > 1 { b + 1 } else { b };
        }
        // The root (counted above when it has entries) and lost+found.
        stats.blocks += 1 + 4;
        // A directory's link count is 2 + its subdirectories (the root's include
        // lost+found, which mke2fs makes).
        *subdirs.entry(Vec::new()).or_default() += 1;
        let mut over: Vec<Vec<u8>> = subdirs
            .into_iter()
            .filter(|(_, n)| 2 + n > LINK_MAX)
            .map(|(p, _)| p)
            .collect();
        over.sort();
        self.link_max_dirs = over;
        let mut inos: Vec<usize> = names.keys().copied().collect();
        inos.sort_unstable();
        for ino in inos {
            let Some(mut list) = names.remove(&ino) else {
                continue;
            };
            list.sort();
            let inode = &self.inodes[ino];
            let carrier = list.iter().position(|(p, _)| *p == inode.src).unwrap_or(0);
            let (cpos, cname) = list.remove(carrier);
            let (s0, s1) = (inode.src.0 as usize, inode.src.1 as usize);
            let in_place = match (inode.slot, inode.spool) {
                (Some(slot), Some(_))
                    if list.is_empty()
                        && cpos == inode.src
                        && matches!(
                            self.actions[slot.0 as usize][slot.1 as usize],
                            Action::Skip
                        ) =>
                {
                    Some(slot)
                }
                _ => None,
            };
            if let Some(slot) = in_place {
                stats.in_place += 1;
                self.actions[slot.0 as usize][slot.1 as usize] = Action::Spooled {
                    ino,
                    name: cname.clone(),
                };
            } else {
                self.actions[s0][s1] = Action::Inode {
                    ino,
                    name: cname.clone(),
                };
            }
            for (p, name) in list {
                stats.extra_links += 1;
                self.actions[p.0 as usize][p.1 as usize] = Action::Link {
                    ino,
                    name,
                    target: cname.clone(),
                };
            }
            stats.blocks += xattr_blocks(Some(&inode.meta));
            match &inode.kind {
                Kind::File { size, map: None } => {
                    stats.files += 1;
                    stats.data_bytes += size;
                    // Data blocks, plus an extent index block past 4 extents of up to
                    // 128 MiB each.
                    stats.blocks += size.div_ceil(4096) + u64::from(*size > 512 << 20);
                }
                Kind::File { map: Some(map), .. } => {
                    // A sparse file: the blocks its pieces of data touch (holes take none),
                    // each piece at least one extent (up to 128 MiB), and extent tree
                    // blocks of 340 extents past the 4 that fit in the inode.
                    stats.files += 1;
                    let mut extents = 0u64;
                    for (off, len) in map {
                        stats.data_bytes += len;
                        if *len > 0 {
                            let b = (off + len).div_ceil(4096) - off / 4096;
                            stats.blocks += b;
                            extents += b.div_ceil(32768);
                        }
                    }
                    if extents > 4 {
                        stats.blocks += extents.div_ceil(340) + 1;
                    }
                }
                Kind::Symlink(t) => {
                    stats.symlinks += 1;
                    // Targets under 60 bytes live in the inode ("fast symlinks").
                    stats.blocks += u64::from(t.len() >= 60);
                }
                _ => stats.specials += 1,
            }
        }
        self.stats = stats;
    }

    /// Pass 2: reads the layers again and writes the flattened tar to `out` (ending with
    /// the two zero blocks). Errors: as [`Flat::scan`], plus [`Ext4Error::Io`] for a failed
    /// write and [`Ext4Error::LayerChanged`] when a blob no longer reads as in the scan.
    pub fn write(&self, out: impl Write) -> Result<(), Ext4Error> {
        let mut w = Writer {
            b: tar::Builder::new(out),
            emitted: HashSet::new(),
            flat: self,
        };
        for (li, l) in self.layers.iter().enumerate() {
            // A kept copy is plain tar: not sniffed (its first name could look compressed).
            let (stream, bounded) = match &self.copies[li] {
                Some(c) => bounded_stream_as(
                    SpoolReader {
                        file: Some(c.inf.file()),
                        off: 0,
                        left: c.len,
                    },
                    Some(Compression::None),
                    &l.digest,
                    &self.limits,
                )?,
                None => bounded_stream(open_layer(l)?, &l.digest, &self.limits)?,
            };
            let mut archive = tar::Archive::new(stream);
            let actions = &self.actions[li];
            let mut n = 0usize;
            let mut last = String::from("(start)");
            let entries = archive.entries().map_err(|e| bounded.error(e, "(start)"))?;
            for entry in entries {
                let mut entry = entry.map_err(|e| bounded.error(e, &last))?;
                last = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
                let Some(action) = actions.get(n) else {
                    return Err(Ext4Error::LayerChanged(l.digest.clone()));
                };
                n += 1;
                match action {
                    Action::Skip => {}
                    Action::Dir(p) => w.dir(p)?,
                    Action::Link { ino, name, target } => {
                        w.link(name, target, &self.inodes[*ino].meta)?
                    }
                    Action::Spooled { ino, name } => {
                        let inode = &self.inodes[*ino];
                        let Some(at) = inode.spool else {
                            return Err(Ext4Error::LayerChanged(l.digest.clone()));
                        };
                        w.inode(name, inode, self.spool.reader(at))
                            .map_err(|e| match e {
                                WriteFail::Read(e) => Ext4Error::Io {
                                    path: "(spool)".into(),
                                    source: e,
                                },
                                WriteFail::Out(e) => e,
                            })?;
                    }
                    Action::Inode { ino, name } => {
                        let inode = &self.inodes[*ino];
                        let mut extents = None;
                        if let Kind::File { size, map } = &inode.kind {
                            let ext = bounded
                                .extents(&entry)
                                .map_err(|e| bounded.error(e, &last))?;
                            if entry.size() != *size
                                || map.as_ref().is_some_and(|m| *m != ext.segments)
                            {
                                return Err(Ext4Error::LayerChanged(l.digest.clone()));
                            }
                            extents = Some(ext);
                        }
                        // A sparse file's data without the holes the reader makes up.
                        let res = match &extents {
                            Some(ext) if ext.sparse => {
                                w.inode(name, inode, DataReader::new(&mut entry, ext))
                            }
                            _ => w.inode(name, inode, &mut entry),
                        };
                        res.map_err(|e| match e {
                            WriteFail::Read(e) => bounded.error(e, &last).into(),
                            WriteFail::Out(e) => e,
                        })?;
                    }
                }
            }
            if n != actions.len() {
                return Err(Ext4Error::LayerChanged(l.digest.clone()));
            }
        }
        for (path, node) in &self.paths {
            if matches!(node, Node::Dir { .. }) && !w.emitted.contains(path) {
                w.dir(path)?;
            }
        }
        w.b.finish().map_err(Ext4Error::output)?;
        Ok(())
    }
}

impl Flat {
    /// The directories (paths as in [`Flat::xattrs`], `""` for the root) whose link count
    /// passes [`LINK_MAX`] (more than 64,998 subdirectories), sorted. mke2fs 1.47.2 (its
    /// `ext2fs_mkdir`) counts every subdirectory into the parent's link count regardless of
    /// `dir_nlink`, so [`super::build`] sets these to 1 after it.
    pub fn link_max_dirs(&self) -> &[Vec<u8>] {
        &self.link_max_dirs
    }

    /// Every xattr of the final tree: (path, name, value), paths as written in the tar
    /// (a shared inode under its first name), sorted by path.
    pub fn xattrs(&self) -> Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        for (path, node) in &self.paths {
            if let Node::Dir { meta: Some(m), .. } = node {
                for (k, v) in &m.xattrs {
                    out.push((path.clone(), k.clone(), v.clone()));
                }
            }
        }
        for acts in &self.actions {
            for a in acts {
                if let Action::Inode { ino, name } = a {
                    for (k, v) in &self.inodes[*ino].meta.xattrs {
                        out.push((name.clone(), k.clone(), v.clone()));
                    }
                }
            }
        }
        out.sort();
        out
    }
}

/// A 4 KiB block for xattrs that do not fit in the inode's extra space (256-byte inodes
/// leave about 96 bytes: `i_extra_isize` 32, then a 4-byte header, each entry 16 bytes +
/// name and value padded to 4, ext4 disk layout "Extended Attributes").
fn xattr_blocks(m: Option<&Meta>) -> u64 {
    let Some(m) = m else { return 0 };
    let need: u64 = m
        .xattrs
        .iter()
        .map(|(k, v)| 16 + (k.len() as u64).div_ceil(4) * 4 + (v.len() as u64).div_ceil(4) * 4)
        .sum();
    u64::from(need > 92)
}

/// Error context: the layer and entry being looked at.
struct Cx<'a> {
    digest: &'a str,
    entry: String,
}

impl Cx<'_> {
    fn err(&self, f: impl FnOnce(String, String) -> LayerError) -> Ext4Error {
        Ext4Error::Layer(f(self.digest.to_string(), self.entry.clone()))
    }

    fn whiteout<'b>(&self, base: &'b [u8]) -> Result<WhiteoutKind<'b>, Ext4Error> {
        WhiteoutKind::parse(base).map_err(|source| {
            self.err(|digest, entry| LayerError::Whiteout {
                digest,
                entry,
                source,
            })
        })
    }
}
