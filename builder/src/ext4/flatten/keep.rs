//! The kept inflated streams: pass 1 copies each compressed layer's plain tar aside, so
//! pass 2 reads it back instead of inflating the layer again (the module doc of [`super`]).

use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::layer::shared::Inflation;

/// Where the scan keeps the inflated stream of each compressed layer (gzip, zstd, xz,
/// bzip2) for pass 2, and how much, so that a publish inflates each layer once: pass 2 reads
/// the plain tar back instead of inflating the blob again. A plain-tar layer is read from
/// its blob in both passes. Each copy is an unlinked temporary file (`O_TMPFILE` through
/// `tempfile::tempfile_in`) in [`Keep::dir`]: nothing is left behind however the build
/// ends. A copy holds the bytes pass 1's tar reader read, so it is bounded by the same
/// [`crate::layer::Limits`] (`max_total_bytes` per layer; a layer past them fails the scan).
/// While it lives, a copy is also the layer's shared inflated stream
/// ([`crate::layer::shared`]), which an unpack of the same layer reads as it grows.
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

/// One layer's kept inflated stream ([`Keep`]): `len` bytes of plain tar, in the file of
/// the layer's shared copy ([`crate::layer::shared`]), which the unpack of the same layer
/// follows instead of inflating the blob again.
pub(super) struct Kept {
    pub(super) inf: Arc<Inflation>,
    pub(super) len: u64,
}

/// Bytes gathered before they are appended to the copy (and shown to its followers).
const TEE_BUF: usize = 1 << 20;

/// Copies what a layer's reader reads into its shared copy ([`Keep`], [`Inflation`]) while
/// the copy stays within `max` bytes; past it, or on a failed write, the copy is abandoned
/// (the scan goes on, followers read the rest from the blob). Dropped unfinished (the scan
/// failed), the copy is abandoned too.
pub(super) struct Tee<R> {
    pub(super) inner: R,
    pub(super) out: Option<Arc<Inflation>>,
    /// Read but not appended yet.
    pub(super) buf: Vec<u8>,
    /// Bytes copied (appended or in `buf`).
    pub(super) n: u64,
    pub(super) max: u64,
    /// The inner reader reached its end.
    pub(super) eof: bool,
}

impl<R> Tee<R> {
    /// A tee of `inner` into `out` (nothing when `None`), at most `max` bytes.
    pub(super) fn new(inner: R, out: Option<Arc<Inflation>>, max: u64) -> Tee<R> {
        Tee {
            inner,
            out,
            buf: Vec::new(),
            n: 0,
            max,
            eof: false,
        }
    }

    fn flush(&mut self) {
        if let Some(inf) = &self.out
            && inf.append(&self.buf).is_err()
        {
            self.drop_copy();
        }
        self.buf.clear();
    }

    fn drop_copy(&mut self) {
        if let Some(inf) = self.out.take() {
            inf.abandon();
        }
        self.buf = Vec::new();
    }
}

impl<R: Read> Read for Tee<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.eof = true;
        }
        if self.out.is_some() {
            if self.n + n as u64 > self.max {
                self.drop_copy();
            } else {
                self.buf.extend_from_slice(&buf[..n]);
                self.n += n as u64;
                if self.buf.len() >= TEE_BUF {
                    self.flush();
                }
            }
        }
        Ok(n)
    }
}

impl<R> Tee<R> {
    /// The copy, when it was kept whole and written: finished (whole when the inner reader
    /// reached its end), its followers told.
    pub(super) fn finish(mut self) -> Option<Kept> {
        self.flush();
        let inf = self.out.take()?;
        inf.complete(self.eof);
        Some(Kept { inf, len: self.n })
    }
}

impl<R> Drop for Tee<R> {
    fn drop(&mut self) {
        self.drop_copy();
    }
}
