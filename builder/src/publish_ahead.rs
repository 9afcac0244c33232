//! Encoding the ext4 image's chunks while mke2fs still writes it ([`Ahead`]), so that the
//! publish's upload finds most of them compressed already ([`kiln_store::memo`]).
//!
//! Why: a publish made the image (mke2fs, about one core busy) and only then cut, hashed and
//! compressed it (both cores busy), one after the other. Compressing is most of the upload's
//! work: of the 276 MB of non-zero chunks of the peer's `apt` image (325 MiB), one core
//! hashed them in 0.17 s and hashed and compressed them in 1.18 s (2026-12-07, a timing
//! example over the image). While mke2fs writes file data, the other core reads what it has
//! written and encodes it, at a lower priority than mke2fs (nice 10, this thread only), into
//! an [`EncodeMemo`]. On a quiet machine it has the idle core; on a busy one it yields: at
//! nice 0, with another compile running (load 4), it encoded more (2,100–2,700 chunks against
//! 240–1,200) but slowed mke2fs, and the publish took 4.3–5.4 s against 3.6–3.8 s (the
//! `publish_phase` example, three pairs, 2026-12-07).
//!
//! What it reads: mke2fs writes the files' data in increasing block order into one region
//! that grows (the largest extent of data in the file, found with `SEEK_DATA`/`SEEK_HOLE`,
//! which report written, not-yet-written-back data too). This follows that region and reads
//! up to [`MARGIN`] bytes short of its end, cutting it with the store's own cutter
//! ([`chunk::split`]). Anything it reads may still change (a directory block mke2fs adds
//! entries to, the bitmaps and inode tables it writes at the end, what `e2fsck -fpD`
//! rewrites): that costs only work, never a wrong chunk, because the upload cuts and hashes
//! the finished image itself and takes from the memo only a chunk of the same sha256 (the
//! memo's module doc says why that is the same stored chunk). On a file system without
//! `SEEK_DATA`/`SEEK_HOLE` (which then reports the whole file as data) it reads ahead of
//! mke2fs, and its work is wasted, never wrong.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kiln_store::chunk::{self, Chunking};
use kiln_store::memo::EncodeMemo;

/// Bytes short of the growing region's end that are not read yet (1 MiB): the blocks mke2fs
/// has just written may be rewritten (libext2fs caches a few blocks before writing them;
/// the region's last file may still grow), and a cut near the end depends on bytes after it.
pub const MARGIN: u64 = 1 << 20;
/// The growing region is followed once it holds this many bytes (4 MiB): before that, the
/// largest extent may be the superblock's and group descriptors' region.
const START: u64 = 4 << 20;
/// How often the file is looked at while the reader waits for more data.
const POLL: Duration = Duration::from_millis(5);
/// Most stored bytes the memo keeps (512 MiB, in an unlinked temporary file: page cache).
pub const MEMO_MAX: u64 = 512 << 20;

/// The encoding-ahead thread of one publish.
pub(crate) struct Ahead {
    stop: Arc<AtomicBool>,
    memo: Arc<EncodeMemo>,
}

impl Ahead {
    /// Starts reading `image` (the path mke2fs will create) as it is written, cutting by
    /// `chunking`, with the memo's file in `dir`. `None` when the memo's file or the thread
    /// cannot be made (the publish then encodes everything itself, as before).
    pub(crate) fn start(image: &Path, chunking: Chunking, dir: &Path) -> Option<Ahead> {
        let file = tempfile::tempfile_in(dir).ok()?;
        let memo = Arc::new(EncodeMemo::new(file, MEMO_MAX));
        let stop = Arc::new(AtomicBool::new(false));
        let (m, s, path) = (memo.clone(), stop.clone(), image.to_path_buf());
        // Not joined: it stops within one chunk of being told (Drop), holding only the
        // memo and the flag.
        std::thread::Builder::new()
            .name("kiln-ahead".into())
            .spawn(move || run(&path, chunking, &m, &s))
            .ok()?;
        Some(Ahead { stop, memo })
    }

    /// Tells the thread to stop (it does after the chunk it is encoding, without being
    /// waited for) and returns the memo.
    pub(crate) fn finish(self) -> Arc<EncodeMemo> {
        self.memo.clone()
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The thread: waits for the file, then encodes what [`Growing`] yields until stopped.
fn run(path: &Path, chunking: Chunking, memo: &EncodeMemo, stop: &Arc<AtomicBool>) {
    // SAFETY: setpriority on this thread's own id (Linux: per-thread nice); no memory.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
    let file = loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match File::open(path) {
            Ok(f) => break f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::thread::sleep(POLL),
            Err(_) => return,
        }
    };
    let reader = Growing {
        file,
        pos: None,
        limit: 0,
        beyond: None,
        stop: stop.clone(),
        path: path.to_path_buf(),
    };
    let Ok(chunks) = chunk::split(reader, chunking) else {
        return;
    };
    for c in chunks {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let Ok(c) = c else { return };
        if chunk::is_all_zero(&c.data) {
            continue;
        }
        let digest = kiln_store::ChunkDigest::of(&c.data);
        if memo.contains(&digest) {
            continue;
        }
        let Ok(enc) = chunk::encode_hashed(&c.data, digest) else {
            return;
        };
        // Not kept (it was not held, so the memo is full) or its file failed: stop.
        if !matches!(memo.insert(&enc), Ok(true)) {
            return;
        }
    }
}

/// The image as mke2fs writes it: reads follow the largest extent of data, up to [`MARGIN`]
/// short of its end, waiting while there is nothing more to read. When the extent stops
/// growing and an extent past it grows (mke2fs's data went past a region it skips, such as
/// the journal), the rest of the extent and the hole after it (zeros) are read up to the
/// extent that grew, and that one is followed. End of input when stopped, or when a hole
/// is found where the region was (the file was made anew).
struct Growing {
    file: File,
    /// Where the next read starts; `None` until the region is found.
    pos: Option<u64>,
    /// Reads up to here need no look at the file.
    limit: u64,
    /// While waiting at the region's end: the extents past it when last looked at.
    beyond: Option<Vec<(u64, u64)>>,
    stop: Arc<AtomicBool>,
    path: PathBuf,
}

impl Growing {
    /// `lseek(fd, at, whence)`; `None` on an error (`ENXIO`: no data, or no hole, past `at`).
    fn seek(&self, at: u64, whence: libc::c_int) -> Option<u64> {
        // SAFETY: lseek on a descriptor this owns; no memory.
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), at as libc::off_t, whence) };
        u64::try_from(r).ok()
    }

    /// The extents of data from `from` on (at most 256), as `(start, end)` byte offsets.
    fn extents(&self, from: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut p = from;
        while out.len() < 256 {
            let Some(d) = self.seek(p, libc::SEEK_DATA) else {
                break;
            };
            let Some(h) = self.seek(d, libc::SEEK_HOLE).filter(|&h| h > d) else {
                break;
            };
            out.push((d, h));
            p = h;
        }
        out
    }

    /// Where the next extent to follow starts: `None` while the region at `pos` (ending at
    /// `end`) is the one growing, else the start of the first extent past it that grew or
    /// appeared since the last look.
    fn moved_on(&mut self, end: u64) -> Option<u64> {
        let now = self.extents(end);
        let grew = self.beyond.as_ref().and_then(|before| {
            now.iter()
                .find(|(s, e)| !before.iter().any(|(bs, be)| bs == s && be >= e))
                .map(|(s, _)| *s)
        });
        self.beyond = Some(now);
        grew
    }
}

impl Read for Growing {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(0);
            }
            match self.pos {
                Some(pos) if pos < self.limit => {
                    let n = (self.limit - pos).min(buf.len() as u64) as usize;
                    let k = self.file.read_at(&mut buf[..n], pos)?;
                    if k == 0 {
                        return Ok(0);
                    }
                    self.pos = Some(pos + k as u64);
                    return Ok(k);
                }
                None => {
                    if let Some((s, e)) = self.extents(0).into_iter().max_by_key(|(s, e)| e - s)
                        && e - s >= START
                    {
                        (self.pos, self.limit) = (Some(s), s);
                        continue;
                    }
                }
                Some(pos) => {
                    if self.seek(pos, libc::SEEK_DATA) != Some(pos) {
                        return Ok(0);
                    }
                    let end = self.seek(pos, libc::SEEK_HOLE).unwrap_or(pos);
                    if end.saturating_sub(MARGIN) > pos {
                        self.limit = end - MARGIN;
                        self.beyond = None;
                        continue;
                    }
                    if let Some(next) = self.moved_on(end) {
                        self.limit = next;
                        self.beyond = None;
                        continue;
                    }
                }
            }
            if !self.path.exists() {
                return Ok(0);
            }
            std::thread::sleep(POLL);
        }
    }
}
