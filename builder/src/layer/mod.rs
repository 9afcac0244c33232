//! Applying OCI layers (tar, optionally gzip or zstd compressed) onto a root directory.
//!
//! The tar stream is walked entry by entry (never `tar::Archive::unpack`, which turns devices
//! into files and trusts names). Each entry's parent directory is reached by a
//! component-by-component walk from a directory fd of the root, opening every directory with
//! `O_NOFOLLOW | O_DIRECTORY`; a symlink met on the way is resolved *inside* the root (an
//! absolute target restarts at the root, `..` may not climb above it), so no entry can reach
//! outside the root, whatever symlinks earlier entries or layers planted. Entry names and
//! hard-link targets are read relative to the root: a leading `/` is dropped (`umoci insert
//! ROOTFS /` writes the root as an entry named `/`; GNU tar, buildah and containerd read
//! absolute names this way), while names with `..` components are refused outright, as are
//! hard links whose target is not an existing non-directory inside the root.
//!
//! What is applied: regular files, directories, symlinks, hard links, character and block
//! devices and FIFOs (`mknodat`, needs root), uid/gid (PAX `uid`/`gid` override the header),
//! permission bits including setuid/setgid/sticky, PAX xattrs (`SCHILY.xattr.*`, including
//! `security.capability`; `system.*`, `security.selinux` and overlayfs's `trusted.overlay.*`
//! and `user.overlay.*` are dropped), and mtimes (set after
//! the content; directories' at the end of the layer, deepest first). Whiteouts follow
//! [`whiteout`].
//!
//! Bounds ([`Limits`]) on entry count, total uncompressed bytes and one file's size, and a
//! deadline and a cancel flag; exceeding a bound is a [`LayerError::Limit`], passing the
//! deadline a [`LayerError::Deadline`], a cancel a [`LayerError::Cancelled`], each naming
//! the layer digest and the entry being read.
//!
//! There is no bound on the decompression ratio. A ratio does not tell a bomb from an
//! ordinary file: 64 MiB of zeros (`dd if=/dev/zero`), a log or a sparse database compress
//! far better than 100:1, and refusing them refused layers kiln's own steps had written
//! (issue 44 §2). What a bomb costs is bytes written and time, and those are bounded
//! directly: by [`Limits::max_total_bytes`], [`Limits::max_entries`] and
//! [`Limits::max_file_bytes`] for the bytes, by [`Limits::deadline`] (the build's time limit)
//! for the time.
//!
//! ## Sparse files
//! GNU sparse entries (type `S`, the "old GNU" sparse format of the GNU tar manual, section
//! "Sparse Formats": up to 4 (offset, length) pairs in the header, more in 512-byte extension
//! headers after it, then only the data) are read by the `tar` crate, which makes the holes
//! up as zeros. The byte counter's framer reads each one's map from the raw stream (bounding
//! its extension headers like other extension data), and [`BoundedStream::extents`] hands it
//! to the entry's reader, so that apply and the ext4 flattener write the holes as holes
//! (apply: data written at its offsets, the file's length set after; zero 4 KiB blocks of
//! any file are not written either). Byte bounds: the total and extension-header
//! bounds count the stream's bytes, which for a sparse entry are its data and map only, so
//! the decompression-bomb bound holds for data and costs nothing for holes; a file's
//! apparent size (its real size) is bounded by [`Limits::max_file_bytes`], see there.
//! PAX sparse entries (`GNU.sparse.*` records, formats 0.0, 0.1 and 1.0) are not read as
//! sparse: the `tar` crate does not interpret them.

pub mod whiteout;
pub mod write;

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::rc::Rc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

use self::whiteout::WhiteoutKind;

/// How many symlinks one path walk may follow (Linux's own limit, `MAXSYMLINKS`, is 40).
const MAX_SYMLINK_HOPS: usize = 40;
/// How deep a resolved path may go, in components.
const MAX_DEPTH: usize = 1024;
/// Largest PAX (`x`, `g`) or GNU long name/link (`L`, `K`) header data, bytes.
pub const MAX_METADATA_BYTES: u64 = 1 << 20;

/// Bounds on one layer. Every field is checked while reading; see [`LayerError::Limit`].
#[derive(Debug, Clone)]
pub struct Limits {
    /// Total uncompressed bytes of the tar stream (headers included), bytes.
    pub max_total_bytes: u64,
    /// Number of tar entries.
    pub max_entries: u64,
    /// Size of one regular file, bytes: its apparent size, holes of a sparse entry included.
    /// Holes cost no stream bytes and no disk blocks, so this is what bounds them: whatever
    /// reads the file as bytes without knowing holes (a later step's program, a tool in the
    /// sandbox, `COPY --from` of the file) reads its apparent size, and an unbounded one (a
    /// 2 KiB layer can describe a file of 8 EiB) would make those reads endless. 16 GiB
    /// (the default) is what `truncate -s 16G` makes.
    pub max_file_bytes: u64,
    /// When reading the layer must stop ([`LayerError::Deadline`]): a build passes its own
    /// time limit here, so a layer that takes longer than the build may (a slow decompressor,
    /// a bomb just under the byte bounds) is stopped by it. Checked before each entry and on
    /// each read of the decompressed stream, so it is overrun by at most one read (one
    /// reader's buffer) and one file-system operation.
    /// `None`: no time bound (tools and tests outside a build).
    pub deadline: Option<std::time::Instant>,
    /// Set by the caller to stop reading ([`LayerError::Cancelled`]): a build passes its
    /// cancel flag (Ctrl-C, SIGTERM, a failed stage), checked where the deadline is.
    /// `None`: not cancellable.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl PartialEq for Limits {
    /// Equal bounds and deadline, and the same cancel flag (by identity).
    fn eq(&self, other: &Self) -> bool {
        self.max_total_bytes == other.max_total_bytes
            && self.max_entries == other.max_entries
            && self.max_file_bytes == other.max_file_bytes
            && self.deadline == other.deadline
            && match (&self.cancel, &other.cancel) {
                (None, None) => true,
                (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Eq for Limits {}

impl Default for Limits {
    /// 32 GiB total, 4 Mi entries, 16 GiB per file, no deadline. A Debian or Ubuntu base
    /// layer is about 80-120 MiB in a few thousand entries (measured on the test fixtures).
    fn default() -> Self {
        Limits {
            max_total_bytes: 32 << 30,
            max_entries: 4 << 20,
            max_file_bytes: 16 << 30,
            deadline: None,
            cancel: None,
        }
    }
}

impl Limits {
    /// Whether [`Limits::deadline`] has passed.
    pub fn expired(&self) -> bool {
        self.deadline
            .is_some_and(|d| std::time::Instant::now() >= d)
    }

    /// Whether [`Limits::cancel`] is set.
    pub fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Which of [`LimitKind::Deadline`] and [`LimitKind::Cancelled`] stops reading now.
    fn stop(&self) -> Option<LimitKind> {
        if self.cancelled() {
            Some(LimitKind::Cancelled)
        } else if self.expired() {
            Some(LimitKind::Deadline)
        } else {
            None
        }
    }
}

/// Which bound a layer broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// [`Limits::max_total_bytes`].
    TotalBytes,
    /// [`Limits::max_entries`].
    Entries,
    /// [`Limits::max_file_bytes`].
    FileBytes,
    /// [`Limits::deadline`] (reported as [`LayerError::Deadline`]).
    Deadline,
    /// [`Limits::cancel`] (reported as [`LayerError::Cancelled`]).
    Cancelled,
    /// [`MAX_METADATA_BYTES`]: one PAX or GNU long-name header's data (the tar reader keeps
    /// it in memory, so it is bounded before the reader sees it).
    MetadataBytes,
}

impl std::fmt::Display for LimitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LimitKind::TotalBytes => "total uncompressed bytes",
            LimitKind::Entries => "entry count",
            LimitKind::FileBytes => "file size",
            LimitKind::Deadline => "deadline",
            LimitKind::Cancelled => "cancel",
            LimitKind::MetadataBytes => "extension header size",
        })
    }
}

/// Why a layer could not be applied. Every variant names the layer digest and the entry.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The tar stream (or its compression) is corrupt or truncated.
    #[error("layer {digest}: unreadable tar stream at {entry}: {source}")]
    Tar {
        /// Layer digest.
        digest: String,
        /// Entry being read (or the one before it).
        entry: String,
        /// Underlying error.
        source: io::Error,
    },
    /// An entry name has a `..` component.
    #[error("layer {digest}: entry {entry} has a '..' component")]
    DotDot {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
    },
    /// A symlink on the entry's path leads above the root.
    #[error("layer {digest}: entry {entry}: a symlink on its path leads outside the root")]
    SymlinkEscape {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
    },
    /// Too many symlinks (a loop) on the entry's path.
    #[error("layer {digest}: entry {entry}: more than {MAX_SYMLINK_HOPS} symlinks on its path")]
    SymlinkLoop {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
    },
    /// The entry's resolved path is deeper than the walker allows.
    #[error("layer {digest}: entry {entry}: path deeper than {MAX_DEPTH} components")]
    TooDeep {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
    },
    /// A component of the entry's parent path is neither a directory nor a symlink.
    #[error("layer {digest}: entry {entry}: a parent component is not a directory")]
    NotADirectory {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
    },
    /// A hard link's target is absolute, has `..`, or resolves outside the root.
    #[error("layer {digest}: hard link {entry} -> {target}: target outside the root")]
    HardLinkEscape {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// Link target as written in the tar.
        target: String,
    },
    /// A hard link's target does not exist (yet).
    #[error("layer {digest}: hard link {entry} -> {target}: target does not exist")]
    HardLinkMissing {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// Link target.
        target: String,
    },
    /// A hard link's target is a directory.
    #[error("layer {digest}: hard link {entry} -> {target}: target is a directory")]
    HardLinkToDirectory {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// Link target.
        target: String,
    },
    /// A whiteout name is malformed (`.wh.`, `.wh..`, `.wh...`).
    #[error("layer {digest}: entry {entry}: {source}")]
    Whiteout {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// What is wrong.
        source: whiteout::WhiteoutError,
    },
    /// A tar entry type kiln does not apply (e.g. `V` volume labels, `M` multi-volume).
    #[error("layer {digest}: entry {entry}: unsupported tar entry type {kind:?}")]
    UnsupportedType {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// The type byte.
        kind: char,
    },
    /// A bound in [`Limits`] was exceeded.
    #[error("layer {digest}: entry {entry}: {kind} exceeds the limit of {max}")]
    Limit {
        /// Layer digest.
        digest: String,
        /// Entry being read.
        entry: String,
        /// Which bound.
        kind: LimitKind,
        /// The bound's value.
        max: u64,
    },
    /// [`Limits::deadline`] passed while the layer was read (the build's time limit).
    #[error("layer {digest}: entry {entry}: stopped at the time limit")]
    Deadline {
        /// Layer digest.
        digest: String,
        /// Entry being read.
        entry: String,
    },
    /// [`Limits::cancel`] was set while the layer was read.
    #[error("layer {digest}: entry {entry}: cancelled")]
    Cancelled {
        /// Layer digest.
        digest: String,
        /// Entry being read.
        entry: String,
    },
    /// A file-system operation failed.
    #[error("layer {digest}: entry {entry}: {op}: {source}")]
    Io {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// What was being done (`mkdirat`, `mknodat`, ...).
        op: &'static str,
        /// Underlying error.
        source: io::Error,
    },
}

/// What one layer application did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Tar entries read (whiteouts included).
    pub entries: u64,
    /// Uncompressed bytes read.
    pub bytes: u64,
}

/// The compression of a layer stream (or of an archive `ADD` unpacks), told by its first
/// bytes, as Docker's archive package tells it (`DetectCompression`: gzip, bzip2, xz, zstd).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain tar.
    None,
    /// gzip (RFC 1952; magic `1f 8b`).
    Gzip,
    /// zstd (RFC 8878; magic `28 b5 2f fd`).
    Zstd,
    /// xz (the .xz file format 1.2.1, section 2.1.1.1; magic `fd 37 7a 58 5a 00`).
    Xz,
    /// bzip2 (magic `BZh` and a block size digit `1`-`9`).
    Bzip2,
}

impl Compression {
    /// Detects the compression from the stream's first bytes (6 are enough).
    pub fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
            Compression::Xz
        } else if head.len() >= 4 && head.starts_with(b"BZh") && matches!(head[3], b'1'..=b'9') {
            Compression::Bzip2
        } else {
            Compression::None
        }
    }

    /// The decompressed stream of `raw` (concatenated gzip, xz and bzip2 members are read
    /// through, as `gzip -d`, `xz -d` and `bzip2 -d` do). The one place that maps a
    /// [`Compression`] to a decoder: layer apply, the entry reader and `ADD`'s archive test
    /// all use it.
    pub fn decoder<'a>(self, raw: impl BufRead + 'a) -> io::Result<Box<dyn Read + 'a>> {
        Ok(match self {
            Compression::None => Box::new(raw),
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(raw)),
            Compression::Zstd => Box::new(zstd::stream::read::Decoder::with_buffer(raw)?),
            Compression::Xz => Box::new(liblzma::bufread::XzDecoder::new_multi_decoder(raw)),
            Compression::Bzip2 => Box::new(bzip2::bufread::MultiBzDecoder::new(raw)),
        })
    }
}

/// Counters shared between the reader stack and the apply loop.
#[derive(Default)]
struct Counters {
    uncompressed: Cell<u64>,
    hit: Cell<Option<LimitKind>>,
    /// The map of the last GNU sparse entry the framer read whole, for
    /// [`BoundedStream::extents`].
    sparse: std::cell::RefCell<Option<SparseMap>>,
}

/// The map of one GNU sparse entry as the framer read it from the raw stream (GNU tar
/// manual, "Sparse Formats", "Old GNU Format").
#[derive(Debug, Clone, PartialEq, Eq)]
struct SparseMap {
    /// Stream position of the entry's own header (`tar::Entry::raw_header_position`).
    header_pos: u64,
    /// The file's apparent size (the header's `realsize`), bytes.
    real_size: u64,
    /// (offset, length) of each piece of data, in stream order.
    segments: Vec<(u64, u64)>,
}

/// Follows the tar framing of the uncompressed stream (512-byte headers, data padded to
/// 512), to bound extension headers before `tar` buffers them and to read the maps of GNU
/// sparse entries (their extension headers included, bounded alike). Honours a PAX `size`
/// record for the next entry, as the `tar` reader does.
#[derive(Default)]
struct Framer {
    header: Vec<u8>,
    skip: u64,
    /// Bytes fed so far (the stream position).
    pos: u64,
    /// Data of the PAX header being read, and how much of it remains.
    pax: Option<(Vec<u8>, u64)>,
    pending_size: Option<u64>,
    /// A GNU sparse entry whose extension headers are being read: its map so far, its data
    /// size (read after the extension headers) and the extension bytes read.
    sparse: Option<(SparseMap, u64, u64)>,
    /// The last sparse map read whole, for the counters.
    done: Option<SparseMap>,
}

enum FrameFault {
    Metadata,
    Malformed,
}

/// Adds the non-empty pieces of a sparse header's slots to `m` (the `tar` crate's reading:
/// a slot whose offset or length field starts with a NUL is unused).
fn add_slots(m: &mut SparseMap, slots: &[tar::GnuSparseHeader]) -> Result<(), FrameFault> {
    for s in slots {
        if s.is_empty() {
            continue;
        }
        let off = s.offset().map_err(|_| FrameFault::Malformed)?;
        let len = s.length().map_err(|_| FrameFault::Malformed)?;
        m.segments.push((off, len));
    }
    Ok(())
}

fn parse_octal_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        // base-256, big-endian in the remaining bytes
        let mut v: u64 = 0;
        for b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(*b as u64)?;
        }
        return Some(v);
    }
    let t: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|c| *c == b' ' || *c == 0)
        .take_while(|c| *c != b' ' && *c != 0)
        .collect();
    if t.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(std::str::from_utf8(&t).ok()?, 8).ok()
}

/// The `size` a PAX header gives the next entry, read exactly as the `tar` crate (0.4.46,
/// `pax::pax_extensions_value`) reads it, so the framer and the reader agree on where every
/// header is: records split on newlines, each line's length field must be the line's length
/// plus one, the *first* `size` record wins and its value must parse whole as a `u64`; a
/// malformed record before it, or an unparsable value, means no size at all. (Reading records
/// by their length, or taking the last `size`, or trimming blanks, would make the framer
/// skip what the reader reads as headers: a sparse entry or a huge long name would hide
/// there.)
fn pax_size(data: &[u8]) -> Option<u64> {
    for line in data.split(|b| *b == b'\n') {
        if line.is_empty() {
            return None;
        }
        let sp = line.iter().position(|c| *c == b' ')?;
        let len: usize = std::str::from_utf8(&line[..sp]).ok()?.parse().ok()?;
        if line.len() + 1 != len {
            return None;
        }
        let kv = &line[sp + 1..];
        let eq = kv.iter().position(|c| *c == b'=')?;
        if &kv[..eq] != b"size" {
            continue;
        }
        return std::str::from_utf8(&kv[eq + 1..]).ok()?.parse().ok();
    }
    None
}

/// Whether the `tar` crate treats a header's extension type (`x`, `g`, `L`, `K`) as one: only
/// with the POSIX `ustar\000` or the GNU `ustar  \0` magic; otherwise it is an ordinary
/// entry (which the applier then refuses as an unsupported type).
fn recognized(h: &[u8]) -> bool {
    let (magic, version) = (&h[257..263], &h[263..265]);
    (magic == b"ustar\0" && version == b"00") || (magic == b"ustar " && version == b" \0")
}

impl Framer {
    fn feed(&mut self, data: &[u8]) -> Result<(), FrameFault> {
        self.pos += data.len() as u64;
        self.feed_inner(data)
    }

    fn feed_inner(&mut self, mut data: &[u8]) -> Result<(), FrameFault> {
        // Stream position just past `data`'s last byte (`feed` counted it).
        let end = self.pos;
        while !data.is_empty() {
            if self.skip > 0 {
                let n = (self.skip.min(data.len() as u64)) as usize;
                if let Some((buf, left)) = &mut self.pax {
                    let take = (*left).min(n as u64) as usize;
                    buf.extend_from_slice(&data[..take]);
                    *left -= take as u64;
                    if *left == 0 {
                        self.pending_size = pax_size(buf);
                        self.pax = None;
                    }
                }
                self.skip -= n as u64;
                data = &data[n..];
                continue;
            }
            let n = (512 - self.header.len()).min(data.len());
            self.header.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.header.len() < 512 {
                break;
            }
            let h = std::mem::take(&mut self.header);
            let header_pos = end - data.len() as u64 - 512;
            if let Some((mut map, size, ext)) = self.sparse.take() {
                // An extension header of a GNU sparse entry: 21 more slots.
                let ext = ext + 512;
                if ext > MAX_METADATA_BYTES {
                    return Err(FrameFault::Metadata);
                }
                let mut e = tar::GnuExtSparseHeader::new();
                e.as_mut_bytes().copy_from_slice(&h);
                add_slots(&mut map, e.sparse())?;
                if e.is_extended() {
                    self.sparse = Some((map, size, ext));
                } else {
                    self.done = Some(map);
                    self.skip = size.checked_add(511).ok_or(FrameFault::Malformed)? & !511;
                }
                continue;
            }
            if h.iter().all(|b| *b == 0) {
                continue;
            }
            let kind = h[156];
            let header_size = parse_octal_size(&h[124..136]).ok_or(FrameFault::Malformed)?;
            // As the tar reader: a PAX size applies to the next header that is not an
            // extension type (recognised or not), and only recognised `x`, `L`, `K`
            // headers are read as extension data (into memory: bounded here).
            let ext_type = matches!(kind, b'x' | b'g' | b'L' | b'K');
            let ext = ext_type && recognized(&h);
            let size = if ext_type {
                if ext && header_size > MAX_METADATA_BYTES {
                    return Err(FrameFault::Metadata);
                }
                header_size
            } else {
                self.pending_size.take().unwrap_or(header_size)
            };
            if !ext || kind == b'g' {
                // An entry of its own: the PAX header before it was used up.
                self.pending_size = None;
            }
            if kind == b'S' {
                // As the `tar` reader: a sparse entry needs a GNU header; its extension
                // headers follow it, then `size` bytes of data.
                let hdr = tar::Header::from_byte_slice(&h);
                let g = hdr.as_gnu().ok_or(FrameFault::Malformed)?;
                let mut map = SparseMap {
                    header_pos,
                    real_size: g.real_size().map_err(|_| FrameFault::Malformed)?,
                    segments: Vec::new(),
                };
                add_slots(&mut map, &g.sparse)?;
                if g.is_extended() {
                    self.sparse = Some((map, size, 0));
                } else {
                    self.done = Some(map);
                    self.skip = size.checked_add(511).ok_or(FrameFault::Malformed)? & !511;
                }
                continue;
            }
            if kind == b'x' && ext {
                self.pending_size = None;
                if size > 0 {
                    self.pax = Some((Vec::new(), size));
                }
            }
            self.skip = size.checked_add(511).ok_or(FrameFault::Malformed)? & !511;
        }
        Ok(())
    }
}

struct CountOut<R> {
    inner: R,
    c: Rc<Counters>,
    limits: Limits,
    framer: Framer,
}

impl<R: Read> Read for CountOut<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        match self.framer.feed(&buf[..n]) {
            Ok(()) => {}
            Err(FrameFault::Metadata) => {
                self.c.hit.set(Some(LimitKind::MetadataBytes));
                return Err(io::Error::other("extension header too large"));
            }
            Err(FrameFault::Malformed) => {
                return Err(io::Error::other("malformed tar header size or sparse map"));
            }
        }
        if let Some(map) = self.framer.done.take() {
            *self.c.sparse.borrow_mut() = Some(map);
        }
        let total = self.c.uncompressed.get() + n as u64;
        self.c.uncompressed.set(total);
        let kind = if total > self.limits.max_total_bytes {
            Some(LimitKind::TotalBytes)
        } else {
            self.limits.stop()
        };
        if let Some(k) = kind {
            self.c.hit.set(Some(k));
            return Err(io::Error::other(format!("{k} limit exceeded")));
        }
        Ok(n)
    }
}

/// Applies one layer stream to `root`. `digest` is used in errors only (the caller verifies
/// content). `root` must be a directory; the caller should run as root for devices and owners.
///
/// Errors: see [`LayerError`]; on error the tree may hold part of the layer (never anything
/// outside `root`).
pub fn apply_layer(
    root: &Path,
    layer: impl Read,
    digest: &str,
    limits: &Limits,
) -> Result<LayerStats, LayerError> {
    let root_fd = rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| LayerError::Io {
        digest: digest.to_string(),
        entry: "/".into(),
        op: "open root",
        source: e.into(),
    })?;
    let (stream, bounded) = bounded_stream(layer, digest, limits)?;
    let mut applier = Applier {
        root: root_fd,
        digest: digest.to_string(),
        entry: String::from("(start)"),
        created: Created::default(),
        dirs: Vec::new(),
        limits: limits.clone(),
    };
    let mut archive = tar::Archive::new(stream);
    let mut entries_read = 0u64;
    let entries = archive.entries().map_err(|e| bounded.error(e, "(start)"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bounded.error(e, &applier.entry))?;
        entries_read += 1;
        applier.entry = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if entries_read > limits.max_entries {
            return Err(applier.limit(LimitKind::Entries, limits.max_entries));
        }
        match limits.stop() {
            Some(LimitKind::Cancelled) => {
                return Err(LayerError::Cancelled {
                    digest: digest.to_string(),
                    entry: applier.entry.clone(),
                });
            }
            Some(_) => {
                return Err(LayerError::Deadline {
                    digest: digest.to_string(),
                    entry: applier.entry.clone(),
                });
            }
            None => {}
        }
        match applier.apply_entry(&mut entry, &bounded) {
            Ok(()) => {}
            Err(ApplyFail::Layer(e)) => return Err(e),
            Err(ApplyFail::Read(e)) => return Err(bounded.error(e, &applier.entry)),
        }
    }
    applier.finish_dirs()?;
    Ok(LayerStats {
        entries: entries_read,
        bytes: bounded.bytes(),
    })
}

/// An entry failed either on our side or while reading its data from the stream.
enum ApplyFail {
    Layer(LayerError),
    Read(io::Error),
}

impl From<LayerError> for ApplyFail {
    fn from(e: LayerError) -> Self {
        ApplyFail::Layer(e)
    }
}

struct Applier {
    root: OwnedFd,
    digest: String,
    entry: String,
    /// Paths this layer created, with their ancestors.
    created: Created,
    /// Directories whose mtime is set at the end: (components, mtime seconds).
    dirs: Vec<(Vec<Vec<u8>>, u64)>,
    limits: Limits,
}

/// The paths a layer created, with their ancestors, as a tree of components: recording or
/// looking up a path costs one map operation per component. (A set of joined prefixes costs
/// depth² × name length per entry: one entry 1024 components deep with 255-byte names is
/// 134 MB of copying and hashing, and a small layer can hold thousands of them.)
#[derive(Default)]
struct Created {
    /// (parent node, name) → node; node 0 is the root.
    nodes: HashMap<(usize, Vec<u8>), usize>,
}

impl Created {
    fn insert(&mut self, comps: &[Vec<u8>]) {
        let mut cur = 0;
        for c in comps {
            let next = self.nodes.len() + 1;
            cur = *self.nodes.entry((cur, c.clone())).or_insert(next);
        }
    }

    fn contains(&self, comps: &[Vec<u8>]) -> bool {
        let mut cur = 0;
        for c in comps {
            match self.nodes.get(&(cur, c.clone())) {
                Some(n) => cur = *n,
                None => return false,
            }
        }
        true
    }

    /// Bytes of names held (for the bound's test).
    #[cfg(test)]
    fn name_bytes(&self) -> usize {
        self.nodes.keys().map(|(_, n)| n.len()).sum()
    }
}

/// An entry name split into its components by [`split_name`] (also used by the ext4
/// flattener, which must place entries exactly as [`apply_layer`] does).
pub(crate) enum Split {
    Ok(Vec<Vec<u8>>),
    DotDot,
}

/// Splits an entry name (or a hard link's target) into its components, relative to the
/// root: empty and `.` components, leading `/`s included, are dropped, so `/`, `./` and `//`
/// name the root and `/etc/x` is `etc/x`; a `..` component is refused.
pub(crate) fn split_name(name: &[u8]) -> Split {
    let mut out = Vec::new();
    for c in name.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Split::DotDot,
            c => out.push(c.to_vec()),
        }
    }
    Split::Ok(out)
}

fn os(c: &[u8]) -> &OsStr {
    OsStr::from_bytes(c)
}

/// Metadata of one layer entry as [`read_meta`] reads it: the header's fields with PAX
/// overrides applied. The ext4 flattener carries the same type (`ext4::Meta`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits (`& 0o7777`: setuid, setgid and sticky included).
    pub mode: u32,
    /// Owner, a valid Linux uid ([`owner_id`]).
    pub uid: u32,
    /// Group, a valid Linux gid.
    pub gid: u32,
    /// Modification time, seconds since the epoch (PAX `mtime`, fraction dropped).
    pub mtime: u64,
    /// Extended attributes kept ([`keep_xattr`]), in stream order, each name once (a
    /// repeated name keeps its last value, as setting them in order would).
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Reads one entry's metadata: the one reader of owners, modes, times and xattrs that layer
/// apply and the ext4 flattener share, so that they cannot diverge. PAX `uid`/`gid` override
/// the header's, `mtime` too, `SCHILY.xattr.*` records give the xattrs (POSIX.1-2008 pax
/// format; the xattr key form is GNU tar's and star's).
///
/// Errors (`InvalidData`): an owner id that is not a Linux id ([`owner_id`]), a PAX
/// `uid`/`gid` that is not a number, a PAX sparse file (`GNU.sparse.*` records); the
/// header's own read errors.
pub(crate) fn read_meta(entry: &mut tar::Entry<'_, impl Read>) -> io::Result<Meta> {
    let h = entry.header();
    let mut m = Meta {
        mode: h.mode()? & 0o7777,
        uid: owner_id("uid", h.uid()?)?,
        gid: owner_id("gid", h.gid()?)?,
        mtime: h.mtime()?,
        xattrs: Vec::new(),
    };
    if let Some(exts) = entry.pax_extensions()? {
        for ext in exts {
            let ext = ext?;
            let key = ext.key_bytes();
            let val = ext.value_bytes();
            let num = || {
                std::str::from_utf8(val)
                    .ok()
                    .and_then(|s| s.split('.').next())
                    .and_then(|s| s.parse::<u64>().ok())
            };
            match key {
                b"uid" | b"gid" => {
                    let what = if key == b"uid" { "uid" } else { "gid" };
                    let v = num().ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("PAX {what} is not a number"),
                        )
                    })?;
                    let id = owner_id(what, v)?;
                    if key == b"uid" {
                        m.uid = id;
                    } else {
                        m.gid = id;
                    }
                }
                b"mtime" => m.mtime = num().unwrap_or(m.mtime),
                // PAX sparse files (GNU tar manual, "Sparse Formats": 0.0, 0.1 and 1.0, as
                // `tar --posix --sparse` writes) are regular files whose name and data hide a
                // map; read as plain files they would land as `GNUSparseFile.N/...` holding
                // the map. The tar crate does not read them, so they are refused.
                k if k.starts_with(b"GNU.sparse.") => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "a PAX sparse file (record {}): not supported; expected a plain file or an old GNU sparse ('S') entry",
                            String::from_utf8_lossy(k)
                        ),
                    ));
                }
                k if k.starts_with(b"SCHILY.xattr.") => {
                    let name = &k[b"SCHILY.xattr.".len()..];
                    if keep_xattr(name) {
                        m.xattrs.retain(|(n, _)| n != name);
                        m.xattrs.push((name.to_vec(), val.to_vec()));
                    }
                }
                _ => {}
            }
        }
    }
    Ok(m)
}

/// A tar owner id as a Linux uid/gid. Ids that do not fit 32 bits would wrap (4294967296 is
/// root), and 4294967295 is `(uid_t)-1`, which `chown` reads as "leave unchanged": both are
/// refused as invalid data rather than truncated.
fn owner_id(what: &str, v: u64) -> io::Result<u32> {
    u32::try_from(v)
        .ok()
        .filter(|&id| id != u32::MAX)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{what} {v} is not a valid id (0 to 4294967294)"),
            )
        })
}

/// Whether an xattr from a layer is applied: `system.*` (ACLs are kernel-encoded) and
/// `security.selinux` (host policy) are not, as umoci and containerd skip them; nor are
/// overlayfs's own `trusted.overlay.*` and `user.overlay.*` (opaque, redirect, metacopy,
/// origin...: Linux `Documentation/filesystems/overlayfs.rst`), which would change what an
/// overlay mounted over the unpacked tree shows (a planted `redirect` or `metacopy` points it
/// at other files). Whiteouts reach the tree only through the OCI `.wh.` entries.
pub(crate) fn keep_xattr(name: &[u8]) -> bool {
    !(name.starts_with(b"system.")
        || name == b"security.selinux"
        || name.starts_with(b"trusted.overlay.")
        || name.starts_with(b"user.overlay."))
}

impl Applier {
    fn limit(&self, kind: LimitKind, max: u64) -> LayerError {
        LayerError::Limit {
            digest: self.digest.clone(),
            entry: self.entry.clone(),
            kind,
            max,
        }
    }

    fn io(&self, op: &'static str, e: impl Into<io::Error>) -> LayerError {
        LayerError::Io {
            digest: self.digest.clone(),
            entry: self.entry.clone(),
            op,
            source: e.into(),
        }
    }

    fn err_entry(&self) -> (String, String) {
        (self.digest.clone(), self.entry.clone())
    }

    /// Walks `comps` from the root, following symlinks inside the root, and returns the fd
    /// of the directory reached. Missing directories are created (0755, root) when `create`;
    /// otherwise `Ok(None)` is returned for a missing component.
    fn walk(&self, comps: &[Vec<u8>], create: bool) -> Result<Option<OwnedFd>, LayerError> {
        let mut stack: Vec<OwnedFd> =
            vec![self.root.try_clone().map_err(|e| self.io("dup root", e))?];
        let mut queue: std::collections::VecDeque<Vec<u8>> = comps.iter().cloned().collect();
        let mut hops = 0;
        while let Some(c) = queue.pop_front() {
            if c.is_empty() || c == b"." {
                continue;
            }
            if c == b".." {
                if stack.len() == 1 {
                    let (digest, entry) = self.err_entry();
                    return Err(LayerError::SymlinkEscape { digest, entry });
                }
                stack.pop();
                continue;
            }
            if stack.len() > MAX_DEPTH {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::TooDeep { digest, entry });
            }
            // The last element always exists: the root is never popped (checked above).
            let cur = stack
                .last()
                .map(|f| f.as_fd())
                .expect("stack holds the root");
            let st = match rustix::fs::statat(cur, os(&c), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => Some(st),
                Err(Errno::NOENT) => None,
                Err(e) => return Err(self.io("stat parent", e)),
            };
            let st = match st {
                Some(st) => st,
                None if create => {
                    rustix::fs::mkdirat(cur, os(&c), Mode::from_raw_mode(0o755))
                        .map_err(|e| self.io("mkdirat parent", e))?;
                    rustix::fs::statat(cur, os(&c), AtFlags::SYMLINK_NOFOLLOW)
                        .map_err(|e| self.io("stat parent", e))?
                }
                None => return Ok(None),
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => {
                    let fd = rustix::fs::openat(
                        cur,
                        os(&c),
                        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(|e| self.io("open parent", e))?;
                    stack.push(fd);
                }
                FileType::Symlink => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        let (digest, entry) = self.err_entry();
                        return Err(LayerError::SymlinkLoop { digest, entry });
                    }
                    let target = rustix::fs::readlinkat(cur, os(&c), Vec::new())
                        .map_err(|e| self.io("readlinkat", e))?;
                    let target = target.as_bytes();
                    if target.first() == Some(&b'/') {
                        stack.truncate(1);
                    }
                    for t in target.split(|b| *b == b'/').rev() {
                        if !t.is_empty() {
                            queue.push_front(t.to_vec());
                        }
                    }
                }
                _ => {
                    let (digest, entry) = self.err_entry();
                    return Err(LayerError::NotADirectory { digest, entry });
                }
            }
        }
        Ok(stack.pop())
    }

    fn mark_created(&mut self, comps: &[Vec<u8>]) {
        self.created.insert(comps);
    }

    fn meta(&self, entry: &mut tar::Entry<'_, impl Read>) -> Result<Meta, ApplyFail> {
        read_meta(entry).map_err(ApplyFail::Read)
    }

    /// Removes `name` in `dir`, recursively for directories, never following symlinks.
    fn remove_all(&self, dir: BorrowedFd<'_>, name: &[u8], depth: usize) -> Result<(), LayerError> {
        let st = match rustix::fs::statat(dir, os(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(self.io("stat for removal", e)),
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            if depth > MAX_DEPTH {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::TooDeep { digest, entry });
            }
            let fd = rustix::fs::openat(
                dir,
                os(name),
                OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| self.io("open for removal", e))?;
            for child in self.list(fd.as_fd())? {
                self.remove_all(fd.as_fd(), &child, depth + 1)?;
            }
            rustix::fs::unlinkat(dir, os(name), AtFlags::REMOVEDIR)
                .map_err(|e| self.io("rmdir", e))?;
        } else {
            rustix::fs::unlinkat(dir, os(name), AtFlags::empty())
                .map_err(|e| self.io("unlink", e))?;
        }
        Ok(())
    }

    fn list(&self, dir: BorrowedFd<'_>) -> Result<Vec<Vec<u8>>, LayerError> {
        let mut out = Vec::new();
        let d = rustix::fs::Dir::read_from(dir).map_err(|e| self.io("readdir", e))?;
        for ent in d {
            let ent = ent.map_err(|e| self.io("readdir", e))?;
            let n = ent.file_name().to_bytes();
            if n != b"." && n != b".." {
                out.push(n.to_vec());
            }
        }
        Ok(out)
    }

    fn apply_entry(
        &mut self,
        entry: &mut tar::Entry<'_, impl Read>,
        bounded: &BoundedStream,
    ) -> Result<(), ApplyFail> {
        let raw = entry.path_bytes().into_owned();
        let comps = match split_name(&raw) {
            Split::Ok(c) => c,
            Split::DotDot => {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::DotDot { digest, entry }.into());
            }
        };
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            return Ok(());
        }
        let Some((base, parent)) = comps.split_last() else {
            // The root itself ("./"): its metadata is the caller's.
            return Ok(());
        };
        let wh = WhiteoutKind::parse(base).map_err(|source| {
            let (digest, entry) = self.err_entry();
            LayerError::Whiteout {
                digest,
                entry,
                source,
            }
        })?;
        match wh {
            WhiteoutKind::None => {}
            WhiteoutKind::Meta => return Ok(()),
            WhiteoutKind::Remove(name) => {
                let Some(dir) = self.walk(parent, false)? else {
                    return Ok(());
                };
                let mut full = parent.to_vec();
                full.push(name.to_vec());
                if !self.created.contains(&full) {
                    self.remove_all(dir.as_fd(), name, 0)?;
                }
                return Ok(());
            }
            WhiteoutKind::Opaque => {
                let Some(dir) = self.walk(parent, true)? else {
                    return Ok(());
                };
                for child in self.list(dir.as_fd())? {
                    let mut full = parent.to_vec();
                    full.push(child.clone());
                    if !self.created.contains(&full) {
                        self.remove_all(dir.as_fd(), &child, 0)?;
                    }
                }
                self.mark_created(parent);
                return Ok(());
            }
        }
        let meta = self.meta(entry)?;
        let dir = self
            .walk(parent, true)?
            .ok_or_else(|| self.io("walk", io::Error::from(io::ErrorKind::NotFound)))?;
        let dir = dir.as_fd();
        let existing = match rustix::fs::statat(dir, os(base), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Some(FileType::from_raw_mode(st.st_mode)),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(self.io("stat", e).into()),
        };
        use tar::EntryType as T;
        match kind {
            T::Directory => {
                if existing.is_some_and(|t| t != FileType::Directory) {
                    self.remove_all(dir, base, 0)?;
                }
                if existing != Some(FileType::Directory) {
                    rustix::fs::mkdirat(dir, os(base), Mode::from_raw_mode(0o700))
                        .map_err(|e| self.io("mkdirat", e))?;
                }
                let fd = rustix::fs::openat(
                    dir,
                    os(base),
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| self.io("open dir", e))?;
                self.set_fd_meta(fd.as_fd(), &meta)?;
                self.dirs.push((comps.clone(), meta.mtime));
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                let extents = bounded.extents(entry).map_err(ApplyFail::Read)?;
                if extents.size > self.limits.max_file_bytes {
                    return Err(self
                        .limit(LimitKind::FileBytes, self.limits.max_file_bytes)
                        .into());
                }
                if existing.is_some() {
                    self.remove_all(dir, base, 0)?;
                }
                let fd = rustix::fs::openat(
                    dir,
                    os(base),
                    OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::WRONLY
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| self.io("create file", e))?;
                let file = std::fs::File::from(fd);
                let mut data = DataReader::new(entry, &extents);
                let mut buf = vec![0u8; 128 << 10];
                while let Some((off, n)) = data.next_piece(&mut buf).map_err(ApplyFail::Read)? {
                    write_skipping_zero_blocks(&file, off, &buf[..n])
                        .map_err(|e| self.io("write", e))?;
                }
                file.set_len(extents.size)
                    .map_err(|e| self.io("set length", e))?;
                self.set_fd_meta(file.as_fd(), &meta)?;
                self.set_mtime(dir, base, meta.mtime)?;
            }
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.io("symlink", io::Error::other("no link target")))?
                    .into_owned();
                if existing.is_some() {
                    self.remove_all(dir, base, 0)?;
                }
                rustix::fs::symlinkat(os(&target), dir, os(base))
                    .map_err(|e| self.io("symlinkat", e))?;
                self.chown_at(dir, base, &meta)?;
                self.set_path_xattrs(dir, base, &meta)?;
                self.set_mtime(dir, base, meta.mtime)?;
            }
            T::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.io("link", io::Error::other("no link target")))?
                    .into_owned();
                self.hard_link(dir, base, &target, existing.is_some())?;
            }
            T::Char | T::Block | T::Fifo => {
                let h = entry.header();
                let major = h.device_major().ok().flatten().unwrap_or(0);
                let minor = h.device_minor().ok().flatten().unwrap_or(0);
                let ft = match kind {
                    T::Char => FileType::CharacterDevice,
                    T::Block => FileType::BlockDevice,
                    _ => FileType::Fifo,
                };
                if existing.is_some() {
                    self.remove_all(dir, base, 0)?;
                }
                rustix::fs::mknodat(
                    dir,
                    os(base),
                    ft,
                    Mode::from_raw_mode(0o600),
                    rustix::fs::makedev(major, minor),
                )
                .map_err(|e| self.io("mknodat", e))?;
                self.chown_at(dir, base, &meta)?;
                rustix::fs::chmodat(
                    dir,
                    os(base),
                    Mode::from_raw_mode(meta.mode),
                    AtFlags::empty(),
                )
                .map_err(|e| self.io("chmodat", e))?;
                self.set_path_xattrs(dir, base, &meta)?;
                self.set_mtime(dir, base, meta.mtime)?;
            }
            other => {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::UnsupportedType {
                    digest,
                    entry,
                    kind: other.as_byte() as char,
                }
                .into());
            }
        }
        self.mark_created(&comps);
        Ok(())
    }

    fn hard_link(
        &self,
        dir: BorrowedFd<'_>,
        base: &[u8],
        target: &[u8],
        existing: bool,
    ) -> Result<(), LayerError> {
        let tname = String::from_utf8_lossy(target).into_owned();
        let escape = || LayerError::HardLinkEscape {
            digest: self.digest.clone(),
            entry: self.entry.clone(),
            target: tname.clone(),
        };
        let tcomps = match split_name(target) {
            Split::Ok(c) => c,
            _ => return Err(escape()),
        };
        let Some((tbase, tparent)) = tcomps.split_last() else {
            return Err(LayerError::HardLinkToDirectory {
                digest: self.digest.clone(),
                entry: self.entry.clone(),
                target: tname,
            });
        };
        let tdir = match self.walk(tparent, false) {
            Ok(Some(d)) => d,
            Ok(None) => {
                return Err(LayerError::HardLinkMissing {
                    digest: self.digest.clone(),
                    entry: self.entry.clone(),
                    target: tname,
                });
            }
            Err(LayerError::SymlinkEscape { .. }) => return Err(escape()),
            Err(e) => return Err(e),
        };
        let st = match rustix::fs::statat(&tdir, os(tbase), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => {
                return Err(LayerError::HardLinkMissing {
                    digest: self.digest.clone(),
                    entry: self.entry.clone(),
                    target: tname,
                });
            }
            Err(e) => return Err(self.io("stat link target", e)),
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            return Err(LayerError::HardLinkToDirectory {
                digest: self.digest.clone(),
                entry: self.entry.clone(),
                target: tname,
            });
        }
        if existing {
            if let Ok(cur) = rustix::fs::statat(dir, os(base), AtFlags::SYMLINK_NOFOLLOW)
                && cur.st_ino == st.st_ino
                && cur.st_dev == st.st_dev
            {
                return Ok(());
            }
            self.remove_all(dir, base, 0)?;
        }
        rustix::fs::linkat(&tdir, os(tbase), dir, os(base), AtFlags::empty())
            .map_err(|e| self.io("linkat", e))
    }

    fn chown_at(&self, dir: BorrowedFd<'_>, base: &[u8], m: &Meta) -> Result<(), LayerError> {
        rustix::fs::chownat(
            dir,
            os(base),
            Some(Uid::from_raw(m.uid)),
            Some(Gid::from_raw(m.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io("chown", e))
    }

    /// Owner, then mode (chown clears setuid/setgid), then xattrs, on an open file or dir.
    fn set_fd_meta(&self, fd: BorrowedFd<'_>, m: &Meta) -> Result<(), LayerError> {
        rustix::fs::fchown(fd, Some(Uid::from_raw(m.uid)), Some(Gid::from_raw(m.gid)))
            .map_err(|e| self.io("fchown", e))?;
        rustix::fs::fchmod(fd, Mode::from_raw_mode(m.mode)).map_err(|e| self.io("fchmod", e))?;
        for (k, v) in &m.xattrs {
            rustix::fs::fsetxattr(fd, os(k), v, XattrFlags::empty())
                .map_err(|e| self.io("fsetxattr", e))?;
        }
        Ok(())
    }

    /// Xattrs on a symlink or device, through `/proc/self/fd/<dir>/<name>` with `lsetxattr`
    /// (there is no `setxattrat` before Linux 6.13).
    fn set_path_xattrs(
        &self,
        dir: BorrowedFd<'_>,
        base: &[u8],
        m: &Meta,
    ) -> Result<(), LayerError> {
        if m.xattrs.is_empty() {
            return Ok(());
        }
        use std::os::fd::AsRawFd;
        let mut p = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
        p.extend_from_slice(base);
        for (k, v) in &m.xattrs {
            rustix::fs::lsetxattr(os(&p), os(k), v, XattrFlags::empty())
                .map_err(|e| self.io("lsetxattr", e))?;
        }
        Ok(())
    }

    fn set_mtime(&self, dir: BorrowedFd<'_>, base: &[u8], mtime: u64) -> Result<(), LayerError> {
        let t = Timespec {
            tv_sec: mtime.min(i64::MAX as u64) as i64,
            tv_nsec: 0,
        };
        rustix::fs::utimensat(
            dir,
            os(base),
            &Timestamps {
                last_access: t,
                last_modification: t,
            },
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io("utimensat", e))
    }

    /// Sets the directories' mtimes, deepest first, once all their content is in place.
    fn finish_dirs(&mut self) -> Result<(), LayerError> {
        let mut dirs = std::mem::take(&mut self.dirs);
        dirs.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        for (comps, mtime) in dirs {
            self.entry = String::from_utf8_lossy(&comps.join(&b'/')).into_owned();
            let Some((base, parent)) = comps.split_last() else {
                continue;
            };
            // A directory removed by a later whiteout of the same layer is simply skipped.
            let Ok(Some(dir)) = self.walk(parent, false) else {
                continue;
            };
            match rustix::fs::statat(&dir, os(base), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                    self.set_mtime(dir.as_fd(), base, mtime)?
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// A layer's decompressed tar stream with the bounds of [`Limits`] enforced, for readers of
/// layers other than [`apply_layer`] (the ext4 flattener): the same compression sniffing,
/// byte, extension-header and time bounds and GNU-sparse refusal.
pub(crate) struct BoundedStream {
    counters: Rc<Counters>,
    limits: Limits,
    digest: String,
}

/// Opens `layer` (gzip, zstd or plain) as a bounded tar stream. Errors: [`LayerError::Tar`]
/// when the compression header is unreadable.
pub(crate) fn bounded_stream<'a>(
    layer: impl Read + 'a,
    digest: &str,
    limits: &Limits,
) -> Result<(Box<dyn Read + 'a>, BoundedStream), LayerError> {
    let counters = Rc::new(Counters::default());
    let mut raw = BufReader::with_capacity(256 << 10, layer);
    let tar_err = |e: io::Error| LayerError::Tar {
        digest: digest.to_string(),
        entry: "(start)".into(),
        source: e,
    };
    let head = raw.fill_buf().map_err(tar_err)?;
    let decoded: Box<dyn Read + 'a> = Compression::sniff(head).decoder(raw).map_err(tar_err)?;
    let counted = CountOut {
        inner: decoded,
        c: counters.clone(),
        limits: limits.clone(),
        framer: Framer::default(),
    };
    Ok((
        Box::new(counted),
        BoundedStream {
            counters,
            limits: limits.clone(),
            digest: digest.to_string(),
        },
    ))
}

impl BoundedStream {
    /// Turns a read error of the stream into the [`LayerError`] it stands for (a bound hit,
    /// or a plain tar error at `entry`).
    pub(crate) fn error(&self, e: io::Error, entry: &str) -> LayerError {
        let digest = self.digest.clone();
        match self.counters.hit.get() {
            Some(LimitKind::Deadline) => LayerError::Deadline {
                digest,
                entry: entry.to_string(),
            },
            Some(LimitKind::Cancelled) => LayerError::Cancelled {
                digest,
                entry: entry.to_string(),
            },
            Some(kind) => LayerError::Limit {
                digest,
                entry: entry.to_string(),
                kind,
                max: match kind {
                    LimitKind::TotalBytes => self.limits.max_total_bytes,
                    LimitKind::Deadline | LimitKind::Cancelled => 0,
                    LimitKind::Entries => self.limits.max_entries,
                    LimitKind::FileBytes => self.limits.max_file_bytes,
                    LimitKind::MetadataBytes => MAX_METADATA_BYTES,
                },
            },
            None => LayerError::Tar {
                digest,
                entry: entry.to_string(),
                source: e,
            },
        }
    }

    /// Uncompressed bytes read so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.counters.uncompressed.get()
    }

    /// Where the data of a regular-file entry (`0`, `7` or GNU sparse `S`) of this stream
    /// goes in the file. For a sparse entry, the map the framer read with its header; for
    /// others, all of its size is one piece of data.
    ///
    /// Errors (`InvalidData`): a sparse entry whose map the framer did not read with this
    /// entry's header, or whose map disagrees with the `tar` reader's size.
    pub(crate) fn extents(&self, entry: &tar::Entry<'_, impl Read>) -> io::Result<Extents> {
        if !entry.header().entry_type().is_gnu_sparse() {
            return Ok(Extents {
                size: entry.size(),
                segments: vec![(0, entry.size())],
                sparse: false,
            });
        }
        match self.counters.sparse.borrow_mut().take() {
            Some(m)
                if m.header_pos == entry.raw_header_position() && m.real_size == entry.size() =>
            {
                Ok(Extents {
                    size: m.real_size,
                    segments: m.segments,
                    sparse: true,
                })
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "GNU sparse entry whose map was not read with its header",
            )),
        }
    }
}

/// Where a regular file's bytes go, as [`BoundedStream::extents`] reads it: its apparent
/// size and its pieces of data; everything else is a hole (zeros, no blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Extents {
    /// Apparent size, bytes.
    pub(crate) size: u64,
    /// (offset, length) in bytes of each piece of data, in file order, none overlapping
    /// (the `tar` reader refuses a map that is out of order or overlaps).
    pub(crate) segments: Vec<(u64, u64)>,
    /// Whether the entry was a sparse one (`S`).
    pub(crate) sparse: bool,
}

/// Reads an entry's data piece by piece as its [`Extents`] lay it out: the `tar` reader
/// makes a sparse entry's holes up as zeros between the pieces, and those are read past
/// (they never come from the stream, so they cost no stream bytes), never handed out.
pub(crate) struct DataReader<'e, R> {
    inner: R,
    /// Where the made-up zeros of holes are read to (64 KiB: it stays in the CPU's cache,
    /// so a 16 GiB hole costs well under a second).
    scratch: Vec<u8>,
    segments: &'e [(u64, u64)],
    /// Apparent offset of the next byte `inner` gives.
    at: u64,
    /// Index of the piece being read, and its bytes left.
    idx: usize,
    left: u64,
}

impl<'e, R: Read> DataReader<'e, R> {
    /// `inner`: the entry's data as the `tar` reader gives it (apparent bytes).
    pub(crate) fn new(inner: R, extents: &'e Extents) -> Self {
        DataReader {
            inner,
            scratch: Vec::new(),
            segments: &extents.segments,
            at: 0,
            idx: 0,
            left: extents.segments.first().map_or(0, |s| s.1),
        }
    }

    /// The next piece of data into `buf`: `Some((file offset, length))`, `None` at the end.
    /// Errors: the entry's read errors; `UnexpectedEof` when it ends before its map does.
    pub(crate) fn next_piece(&mut self, buf: &mut [u8]) -> io::Result<Option<(u64, usize)>> {
        loop {
            let Some(&(off, _)) = self.segments.get(self.idx) else {
                return Ok(None);
            };
            if self.left == 0 {
                self.idx += 1;
                self.left = self.segments.get(self.idx).map_or(0, |s| s.1);
                continue;
            }
            // The hole before the piece (zeros made up by the reader).
            if self.at < off && self.scratch.is_empty() {
                self.scratch = vec![0u8; 64 << 10];
            }
            while self.at < off {
                let want = (off - self.at).min(self.scratch.len() as u64) as usize;
                let n = self.inner.read(&mut self.scratch[..want])?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                self.at += n as u64;
            }
            let want = self.left.min(buf.len() as u64) as usize;
            let n = self.inner.read(&mut buf[..want])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let at = self.at;
            self.at += n as u64;
            self.left -= n as u64;
            return Ok(Some((at, n)));
        }
    }
}

impl<R: Read> Read for DataReader<'_, R> {
    /// The data bytes only, in order (what a sparse entry stores after its map).
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(self.next_piece(buf)?.map_or(0, |(_, n)| n))
    }
}

/// Block size of the zero test in [`write_skipping_zero_blocks`], bytes (ext4's, and the
/// page size).
const ZERO_BLOCK: u64 = 4096;

/// Writes `data` at `off` into a new file, leaving out every 4 KiB block (aligned to the
/// file's start) that is all zero: the file is new, so those read back as zeros, and they
/// stay holes (a layer written without sparse entries, or a sparse file's data with zero
/// runs, costs no blocks for them).
fn write_skipping_zero_blocks(file: &std::fs::File, off: u64, data: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    // Runs of blocks that are not all zero are written with one call each.
    let mut run: Option<usize> = None;
    let mut pos = 0usize;
    while pos < data.len() {
        let at = off + pos as u64;
        let n = ((ZERO_BLOCK - at % ZERO_BLOCK) as usize).min(data.len() - pos);
        let zero = kiln_store::chunk::is_all_zero(&data[pos..pos + n]);
        match (zero, run) {
            (false, None) => run = Some(pos),
            (true, Some(start)) => {
                file.write_all_at(&data[start..pos], off + start as u64)?;
                run = None;
            }
            _ => {}
        }
        pos += n;
    }
    if let Some(start) = run {
        file.write_all_at(&data[start..], off + start as u64)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
