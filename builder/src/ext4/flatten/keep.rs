//! The kept inflated streams: pass 1 copies each compressed layer's plain tar aside, so
//! pass 2 reads it back instead of inflating the layer again (the module doc of [`super`]).

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Where the scan keeps the inflated stream of each compressed layer (gzip, zstd, xz,
/// bzip2) for pass 2, and how much, so that a publish inflates each layer once: pass 2 reads
/// the plain tar back instead of inflating the blob again. A plain-tar layer is read from
/// its blob in both passes. Each copy is an unlinked temporary file (`O_TMPFILE` through
/// `tempfile::tempfile_in`) in [`Keep::dir`]: nothing is left behind however the build
/// ends. A copy holds the bytes pass 1's tar reader read, so it is bounded by the same
/// [`crate::layer::Limits`] (`max_total_bytes` per layer; a layer past them fails the scan).
#[derive(Debug, Clone)]
pub struct Keep {
    /// Directory the copies are made in.
    pub dir: PathBuf,
    /// Most bytes kept over all layers. A layer is kept only while the total stays within
    /// it: the copy of the layer that would pass it is dropped as it grows past the limit
    /// and pass 2 inflates that layer from its blob; a later, smaller layer may still be
    /// kept.
    pub max_bytes: u64,
}

/// [`Keep::in_dir`] lets the copies take at most 1/`KEEP_FREE_DIVISOR` of the space free
/// on the scratch file system when the scan starts, leaving the rest for the image, which
/// holds about as many bytes of data as the layers' streams.
pub const KEEP_FREE_DIVISOR: u64 = 4;

impl Keep {
    /// Copies in `dir`, at most a quarter ([`KEEP_FREE_DIVISOR`]) of the bytes available
    /// to unprivileged writers on its file system now (`statvfs`: `f_bavail × f_frsize`,
    /// what `df` calls available). `statvfs` failing keeps nothing.
    pub fn in_dir(dir: &Path) -> Keep {
        let free = rustix::fs::statvfs(dir)
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
            .unwrap_or(0);
        Keep {
            dir: dir.to_path_buf(),
            max_bytes: free / KEEP_FREE_DIVISOR,
        }
    }
}

/// One layer's kept inflated stream ([`Keep`]): `len` bytes of plain tar.
pub(super) struct Kept {
    pub(super) file: File,
    pub(super) len: u64,
}

/// Copies what a layer's reader reads into a file ([`Keep`]) while the copy stays within
/// `max` bytes; past it, or on a failed write, the copy is dropped (the scan goes on).
pub(super) struct Tee<R> {
    pub(super) inner: R,
    pub(super) out: Option<BufWriter<File>>,
    pub(super) n: u64,
    pub(super) max: u64,
}

impl<R: Read> Read for Tee<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(w) = &mut self.out {
            if self.n + n as u64 > self.max || w.write_all(&buf[..n]).is_err() {
                // Not flushed: the unlinked file goes with what it holds.
                drop(self.out.take().map(BufWriter::into_parts));
            } else {
                self.n += n as u64;
            }
        }
        Ok(n)
    }
}

impl<R> Tee<R> {
    /// The copy, when it was kept whole and flushed.
    pub(super) fn finish(self) -> Option<Kept> {
        let file = self.out?.into_inner().ok()?;
        Some(Kept { file, len: self.n })
    }
}
