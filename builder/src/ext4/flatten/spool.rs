//! The spool of the in-place writes: the data of files that replace a lower layer's file,
//! kept by pass 1 so pass 2 writes them at the position of the file they replace (the
//! module doc of [`super`]).

use std::fs::File;
use std::io::{self, Read};

/// Largest file whose data is spooled to be written in place, bytes.
pub const SPOOL_FILE_MAX: u64 = 16 << 20;
/// Largest total of spooled data, bytes.
pub const SPOOL_TOTAL_MAX: u64 = 256 << 20;

/// The data of files that replace a lower layer's file, kept (in an unlinked temporary file)
/// so they can be written at the position of the file they replace: a changed file then
/// does not shift every later file of the image by its blocks.
pub(super) struct Spool {
    pub(super) file: Option<File>,
    pub(super) len: u64,
}

impl Spool {
    pub(super) fn put(
        &mut self,
        data: &mut impl Read,
        size: u64,
    ) -> io::Result<Option<(u64, u64)>> {
        if size > SPOOL_FILE_MAX || self.len + size > SPOOL_TOTAL_MAX {
            return Ok(None);
        }
        let f = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(tempfile::tempfile()?),
        };
        let off = self.len;
        let n = io::copy(&mut data.take(size), f)?;
        if n != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file data shorter than its header says",
            ));
        }
        self.len += size;
        Ok(Some((off, size)))
    }

    pub(super) fn reader(&self, (off, len): (u64, u64)) -> SpoolReader<'_> {
        SpoolReader {
            file: self.file.as_ref(),
            off,
            left: len,
        }
    }
}

pub(super) struct SpoolReader<'a> {
    pub(super) file: Option<&'a File>,
    pub(super) off: u64,
    pub(super) left: u64,
}

impl Read for SpoolReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let Some(f) = self.file else { return Ok(0) };
        let want = (buf.len() as u64).min(self.left) as usize;
        if want == 0 {
            return Ok(0);
        }
        let n = f.read_at(&mut buf[..want], self.off)?;
        self.off += n as u64;
        self.left -= n as u64;
        Ok(n)
    }
}
