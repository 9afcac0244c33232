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

mod apply;
mod framer;
mod meta;
pub mod pgzip;
pub(crate) mod shared;
pub mod whiteout;
pub mod write;

pub use apply::*;
pub(crate) use framer::*;
pub use meta::*;

use std::cell::{Cell, RefCell};
use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::rc::Rc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

use self::whiteout::{Created, WhiteoutKind};

use crate::rootfs::root::walk_fd;
use crate::rootfs::walk::{Walk, WalkError};
use crate::rootfs::{MAX_DEPTH, MAX_SYMLINK_HOPS};

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
    pub(crate) fn stop(&self) -> Option<LimitKind> {
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
    /// An entry name holds a NUL byte ([`split_name`]).
    #[error("layer {digest}: entry {entry:?}: the name holds a NUL byte")]
    NulInName {
        /// Layer digest.
        digest: String,
        /// Entry name (lossy UTF-8).
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
    /// An owner the process's user namespace does not map (a build without root maps ids
    /// 0–65535: [`crate::exec::rootless`]); chown(2) answers `EINVAL`.
    #[error(
        "layer {digest}: entry {entry}: owner {uid}:{gid} is outside this build's user \
         namespace (a build without root maps ids 0-65535: the user and 65,535 subordinate \
         ids, as a root build's steps have 0-65535); build this image as root"
    )]
    UnmappedOwner {
        /// Layer digest.
        digest: String,
        /// Entry name.
        entry: String,
        /// The entry's uid.
        uid: u32,
        /// The entry's gid.
        gid: u32,
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
    /// Whiteout entries (`.wh.<name>` and `.wh..wh..opq`; not the `.wh..wh.` metadata ones)
    /// among them. With none, the layer's overlay form needs no marker pass
    /// (`build::lower::unpack_overlay_form`).
    pub whiteouts: u64,
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

    /// The OCI layer media type of a layer compressed so (`media-types.md`): `None` for xz
    /// and bzip2, which have none.
    pub fn oci_layer_media_type(self) -> Option<&'static str> {
        match self {
            Compression::None => Some(crate::build::OCI_LAYER_TAR),
            Compression::Gzip => Some(crate::build::OCI_LAYER_GZIP),
            Compression::Zstd => Some(crate::build::OCI_LAYER_ZSTD),
            Compression::Xz | Compression::Bzip2 => None,
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

#[cfg(test)]
mod sparse_tests;
#[cfg(test)]
mod tests;
