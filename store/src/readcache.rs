//! A local read cache in front of a (usually remote) store: verified raw chunk bytes on disk
//! at `<dir>/<hex>`, bounded in total size with least-recently-used eviction, the bound kept
//! across every process that uses the directory at once (two `kiln start`s, each with its
//! chunk server, filling one `<cache>/chunks`).
//!
//! ## Why this shape
//! Recency must be seen by every process, and a hit must stay cheap: an index of entries and
//! their last use kept in a file would need the lock on every hit, so recency is the entry's
//! own modification time instead, and the only shared state is the total. An admission that
//! fits is then a lock, an 8-byte read and write of the index and a rename; the directory is
//! listed only when the cache is full (and once at open).
//!
//! ## Files
//! - `<dir>/<64 hex>`: an entry: the raw (decompressed, verified) bytes of the chunk whose
//!   sha256 is the name, so that a lazy reader serves a page fault with one `pread`. Its
//!   modification time is its last use (recency), shared by all processes.
//! - `<dir>/.index` ([`INDEX`]): 8 bytes, the sum of the entries' sizes in bytes (u64, little
//!   endian). The `flock` on this file is *the cache lock*. The bound covers the entries and
//!   these 8 bytes.
//! - `<dir>/.tmp-<hex>-<pid>-<n>`: an entry being written, `flock`ed by its writer while it
//!   is open.
//!
//! ## What is locked when
//! - **A hit takes no lock**: open, `fstat`, one `pread` of the whole entry, sha256 check, and
//!   at most once per [`TOUCH_AFTER`] per entry a `futimens` setting its time to now (so
//!   entries last used within that second of each other may go in either order). An entry
//!   that another process evicts while it is read stays whole: the unlink drops the name, the
//!   open file keeps the inode.
//! - **An admission** writes the bytes to a temp file outside the lock, then, under the cache
//!   lock: skips it if the entry already exists; when the index says the entries plus the new
//!   one would exceed the bound (or the index is unreadable), lists the directory, recomputes
//!   the total from the sizes found, and removes the least recently used entries (oldest
//!   modification time first) until the total plus the new entry is at most
//!   15/16 of the bound ([`LOW_WATER_DIV`]: so that a full cache lists its directory once
//!   per 1/16 of the bound admitted, not on every admission); writes the new total into the
//!   index, and only then renames the temp file to the entry's name. So outside the lock the
//!   entries always sum to at most the bound, and a reader never sees a partial entry.
//! - **Opening** takes the lock once to list the directory, rewrite the index from what is
//!   there, remove temp files whose writer is gone, and evict down to the bound (which may
//!   be smaller than the one another process used).
//!
//! The locked sections are short, synchronous and run on a blocking thread
//! (`spawn_blocking`), never across an `.await`. An in-process mutex orders the threads of
//! one process (`flock` does not, on one open file). A listing costs a `stat` per entry
//! (40 960 entries for 10 GiB of 256 KiB chunks: about 0.25 s in a
//! debug build here; a hit of a 4 KiB entry about 85 µs).
//!
//! Temp files are outside the bound: at most one chunk (≤ 16 MiB) per admission in flight.
//!
//! ## Crashes and strays
//! The index only ever over-counts: it is written before the rename, and an entry dropped
//! without the lock (below) is not subtracted, so an over-count just brings the next listing
//! (which corrects it) a little earlier; it never lets the entries exceed the bound. A process
//! killed mid-write leaves at most a temp file; its `flock` went with the process, so the next
//! listing (every open does one) finds it unlocked and removes it, while a live writer's
//! locked temp file is left alone. An entry whose bytes do not hash to its name (a torn
//! disk, a hand edit) is dropped when read and reported as a miss, never served. If the index
//! file is removed or replaced while a process holds it, that process notices (its open file
//! is no longer the one at the path) and takes the lock on the new one.
//!
//! ## Hostile neighbours
//! Another process on the host may plant names in the directory. Every file of the cache is
//! opened without following a symlink and without waiting on a FIFO, and must be a regular
//! file ([`open_regular`]): a planted entry or temp name that is not is never read, counted
//! or written through, and goes at the next listing (a directory stays, uncounted); a
//! `.index` that is not, or that has another hard link, fails the open with an error naming
//! it. The lock is waited for at
//! most [`LOCK_WAIT`]: a process holding it longer fails `open` (naming `.index`) and makes
//! admissions skip, rather than hanging `kiln start` or the chunk server.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use rustix::fs::{FlockOperation, flock};

use crate::StoreError;
use crate::digest::{ChunkDigest, Sha256Hash};

/// Name of the index file inside the cache directory; its `flock` is the cache lock.
pub const INDEX: &str = ".index";
/// Size of the index file, bytes; counted in the bound.
const INDEX_LEN: u64 = 8;
/// Prefix of the temp files entries are written to before their rename.
const TEMP_PREFIX: &str = ".tmp-";
/// A hit sets the entry's modification time to now when it is older than this.
pub const TOUCH_AFTER: Duration = Duration::from_secs(1);
/// An eviction frees down to `bound - bound / LOW_WATER_DIV` (the new entry included).
pub const LOW_WATER_DIV: u64 = 16;
/// Longest wait for the cache lock; a process that holds it longer (hung, or hostile) makes
/// opening fail and admissions skip, instead of blocking them forever. The locked sections
/// last well under a second (a listing of 40 960 entries: 0.25 s).
pub const LOCK_WAIT: Duration = Duration::from_secs(10);
/// Pause between two tries of the cache lock.
const LOCK_POLL: Duration = Duration::from_millis(20);

/// The cache. Shared by every clone of a [`crate::Store`].
#[derive(Debug)]
pub struct ReadCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    /// Bound on the sum of the entries' sizes, bytes: the cache's bound less the index.
    max_bytes: u64,
    /// The index file, open. The mutex orders this process's threads; `flock` on the file
    /// orders processes.
    index: Mutex<File>,
    /// Numbers this process's temp files.
    seq: AtomicU64,
}

/// The cache lock, held: the in-process mutex and the `flock` on the index. Dropping it
/// unlocks.
struct Locked<'a> {
    file: MutexGuard<'a, File>,
}

impl Locked<'_> {
    /// The total the index holds, bytes; `None` when it is missing or short.
    fn total(&self) -> Option<u64> {
        let mut b = [0u8; 8];
        self.file.read_exact_at(&mut b, 0).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn set_total(&self, total: u64) -> io::Result<()> {
        self.file.write_all_at(&total.to_le_bytes(), 0)
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let _ = flock(&*self.file, FlockOperation::Unlock);
    }
}

/// Opens the file named `path` inside the cache directory, the one way every file of the
/// cache is opened: `create` makes it when missing (never through a symlink); a symlink is
/// not followed and a FIFO's open does not wait for a peer (`O_NOFOLLOW | O_NONBLOCK`), and
/// anything but a regular file (symlink, FIFO, socket, device, directory) is refused; opened
/// for writing (`write`), a file with another hard link (whose other name kiln does not own)
/// is refused too. Errors: the open's own (`NotFound` when missing), or `InvalidData`
/// "`<path>` is not a regular file ..." / "`<path>` has N hard links ...".
fn open_regular(path: &Path, write: bool, create: bool) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK;
    let opened = OpenOptions::new()
        .read(true)
        .write(write)
        .create(create)
        .truncate(false)
        .custom_flags(flags.bits() as i32)
        .open(path);
    let not_regular = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is not a regular file (a symlink, FIFO, socket, device or directory \
                 planted in the read cache); remove it",
                path.display()
            ),
        )
    };
    let f = match opened {
        Ok(f) => f,
        // ELOOP: the name is a symlink; EISDIR: a directory opened for writing; ENXIO: a
        // socket.
        Err(e)
            if matches!(
                rustix::io::Errno::from_io_error(&e),
                Some(rustix::io::Errno::LOOP | rustix::io::Errno::ISDIR | rustix::io::Errno::NXIO)
            ) =>
        {
            return Err(not_regular());
        }
        Err(e) => return Err(e),
    };
    let md = f.metadata()?;
    if !md.is_file() {
        return Err(not_regular());
    }
    if write && md.nlink() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} has {} hard links: the read cache writes only a file of its own; remove it",
                path.display(),
                md.nlink()
            ),
        ));
    }
    Ok(f)
}

/// Opens (creating) the index of `dir` for reading and writing: see [`open_regular`].
fn open_index(dir: &Path) -> io::Result<File> {
    open_regular(&dir.join(INDEX), true, true)
}

/// Takes the cache lock of `dir` through `index` (an open index file of `dir`, reopened when
/// the file at the path is no longer the one open), waiting at most [`LOCK_WAIT`] for
/// another process to release it. Errors: the index cannot be opened ([`open_index`]), or
/// `TimedOut` "`<dir>/.index` locked by another process for over 10 s".
fn lock<'a>(dir: &Path, index: &'a Mutex<File>) -> io::Result<Locked<'a>> {
    // Never held across a panic point; recover from poisoning anyway.
    let mut file = index.lock().unwrap_or_else(|p| p.into_inner());
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        loop {
            match flock(&*file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(LOCK_POLL);
                }
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "{} locked by another process for over {} s (the read cache's \
                             lock); is a kiln process hung?",
                            dir.join(INDEX).display(),
                            LOCK_WAIT.as_secs()
                        ),
                    ));
                }
                Err(e) => return Err(e.into()),
            }
        }
        let same = match (file.metadata(), std::fs::metadata(dir.join(INDEX))) {
            (Ok(held), Ok(m)) => m.ino() == held.ino() && m.dev() == held.dev(),
            _ => false,
        };
        if same {
            return Ok(Locked { file });
        }
        // Removed or replaced: lock the one at the path.
        let _ = flock(&*file, FlockOperation::Unlock);
        *file = open_index(dir)?;
    }
}

/// An entry found in the directory.
struct Found {
    path: PathBuf,
    /// Size, bytes.
    len: u64,
    /// Last use: modification time.
    used: SystemTime,
}

/// The entries of `dir`. With `reap` (under the cache lock), also removes temp files whose
/// writer is gone (nobody holds their `flock`).
fn list(dir: &Path, reap: bool) -> io::Result<Vec<Found>> {
    let mut found = Vec::new();
    for ent in std::fs::read_dir(dir)? {
        let ent = ent?;
        let name = ent.file_name();
        let name = name.to_string_lossy();
        let entry = Sha256Hash::from_hex(&name).is_ok();
        if !entry && !name.starts_with(TEMP_PREFIX) {
            continue;
        }
        // Not followed: a symlink is a stray here, whatever it points to. Gone since the
        // listing (evicted, dropped, renamed): not there.
        let Ok(m) = ent.metadata() else { continue };
        if !m.is_file() {
            // Planted (kiln writes only regular files): neither counted nor opened. Under the
            // lock the name goes, unless it is a directory (left, and never counted).
            if reap && !m.is_dir() {
                let _ = std::fs::remove_file(ent.path());
            }
            continue;
        }
        if entry {
            found.push(Found {
                path: ent.path(),
                len: m.len(),
                used: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            });
        } else if reap
            && let Ok(f) = open_regular(&ent.path(), false, false)
            && flock(&f, FlockOperation::NonBlockingLockExclusive).is_ok()
        {
            let _ = std::fs::remove_file(ent.path());
        }
    }
    Ok(found)
}

/// What a read of one entry found.
enum Read {
    Hit(Vec<u8>),
    Miss,
    /// There, but its bytes do not hash to its name.
    Bad,
}

/// Reads the entry at `path` for `d`: one open, `fstat` and `pread`, and the recency touch.
fn read_entry(path: &Path, d: &ChunkDigest) -> Read {
    let f = match open_regular(path, false, false) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::InvalidData => return Read::Bad,
        Err(_) => return Read::Miss,
    };
    let Ok(m) = f.metadata() else {
        return Read::Miss;
    };
    if m.len() > crate::chunk::MAX_CHUNK_LEN {
        return Read::Bad;
    }
    let mut b = vec![0u8; m.len() as usize];
    if f.read_exact_at(&mut b, 0).is_err() || ChunkDigest::of(&b) != *d {
        return Read::Bad;
    }
    let now = SystemTime::now();
    if m.modified()
        .is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age >= TOUCH_AFTER))
    {
        // Recency is an optimisation: a failed touch only makes the entry look older.
        let _ = f.set_modified(now);
    }
    Read::Hit(b)
}

impl Inner {
    fn lock(&self) -> io::Result<Locked<'_>> {
        lock(&self.dir, &self.index)
    }

    /// Under the lock: lists the directory (reaping dead temp files), removes the least
    /// recently used entries while they and `incoming` more bytes exceed `target`, and
    /// returns the entries' total left, bytes (also written to the index).
    fn evict(&self, l: &Locked<'_>, incoming: u64, target: u64) -> io::Result<u64> {
        let mut found = list(&self.dir, true)?;
        let mut total: u64 = found.iter().map(|f| f.len).sum();
        // Oldest first; the name breaks ties so every process picks the same victim.
        found.sort_by(|a, b| a.used.cmp(&b.used).then_with(|| a.path.cmp(&b.path)));
        for f in found {
            if total.saturating_add(incoming) <= target {
                break;
            }
            match std::fs::remove_file(&f.path) {
                Ok(()) => total -= f.len,
                // Dropped without the lock (a bad entry) since the listing: gone all the same.
                Err(e) if e.kind() == io::ErrorKind::NotFound => total -= f.len,
                Err(_) => {}
            }
        }
        l.set_total(total)?;
        Ok(total)
    }

    /// Admits `raw` as the entry of `d`: written to a temp file, then renamed under the lock
    /// after making room.
    fn put(&self, d: &ChunkDigest, raw: &[u8]) -> io::Result<()> {
        let path = self.dir.join(d.hex());
        if path.exists() {
            return Ok(());
        }
        let tmp = self.dir.join(format!(
            "{TEMP_PREFIX}{}-{}-{}",
            d.hex(),
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        // Held until `f` closes (after the rename): a listing leaves a locked temp file be. A
        // lister that got here first removes the file; then this put gives up.
        if flock(&f, FlockOperation::NonBlockingLockExclusive).is_err() {
            return Ok(());
        }
        let r = f
            .write_all(raw)
            .and_then(|()| self.admit(&tmp, &path, raw.len() as u64));
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    /// Under the lock: makes room for `len` bytes, counts them in the index, renames `tmp`
    /// to `path`.
    fn admit(&self, tmp: &Path, path: &Path, len: u64) -> io::Result<()> {
        let l = self.lock()?;
        if path.exists() {
            // Another writer got there first (same bytes: the name is their hash).
            return std::fs::remove_file(tmp);
        }
        let mut total = match l.total() {
            Some(t) if t.saturating_add(len) <= self.max_bytes => t,
            _ => self.evict(&l, len, self.max_bytes - self.max_bytes / LOW_WATER_DIV)?,
        };
        if total.saturating_add(len) > self.max_bytes {
            // Nothing left to evict and still no room (only when `len` itself is too big).
            return Err(io::Error::other("entry over the cache bound"));
        }
        total += len;
        // Count first: a crash between the two over-counts, which is safe.
        l.set_total(total)?;
        if let Err(e) = std::fs::rename(tmp, path) {
            l.set_total(total - len)?;
            return Err(e);
        }
        Ok(())
    }
}

impl ReadCache {
    /// Opens (creating) the cache directory; `max_bytes` bounds the sum of the sizes of the
    /// entries and the index (8 bytes).
    /// Under the cache lock, rewrites the index from the directory, removes temp files of
    /// writers that are gone and names that are not regular files, and evicts down to
    /// `max_bytes`. Errors: the directory or index cannot be created, listed or locked
    /// ([`StoreError::Io`] naming the directory, its message the index file): the index is
    /// not a regular file, or another process held the lock over [`LOCK_WAIT`].
    pub async fn open(dir: &Path, max_bytes: u64) -> Result<Self, StoreError> {
        let dir = dir.to_path_buf();
        let d = dir.clone();
        let inner = tokio::task::spawn_blocking(move || -> io::Result<Inner> {
            std::fs::create_dir_all(&d)?;
            let inner = Inner {
                index: Mutex::new(open_index(&d)?),
                dir: d,
                max_bytes: max_bytes.saturating_sub(INDEX_LEN),
                seq: AtomicU64::new(0),
            };
            {
                let l = inner.lock()?;
                inner.evict(&l, 0, inner.max_bytes)?;
            }
            Ok(inner)
        })
        .await
        .map_err(|e| StoreError::io(&dir, io::Error::other(e)))?
        .map_err(|e| StoreError::io(&dir, e))?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Runs `f` under the cache lock of the directory `dir` (created if missing), as
    /// admissions and evictions do: the entries `f` sees sum to at most the bound of the
    /// processes using it. Waits at most [`LOCK_WAIT`] for the lock. Errors: the index cannot
    /// be opened or locked (as [`ReadCache::open`]).
    pub fn locked<R>(dir: &Path, f: impl FnOnce() -> R) -> io::Result<R> {
        let index = Mutex::new(open_index(dir)?);
        let _l = lock(dir, &index)?;
        Ok(f())
    }

    /// Bytes the entries hold now (a listing of the directory; blocking).
    pub fn size(&self) -> u64 {
        list(&self.inner.dir, false).map_or(0, |f| f.iter().map(|f| f.len).sum())
    }

    /// Number of entries now (a listing of the directory; blocking).
    pub fn len(&self) -> usize {
        list(&self.inner.dir, false).map_or(0, |f| f.len())
    }

    /// True when there is no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Raw bytes of a cached chunk, re-verified; `None` on a miss or a bad entry (which is
    /// removed): bytes that do not hash to the name, or a name that is not a regular file.
    pub async fn get(&self, d: &ChunkDigest) -> Option<Bytes> {
        let path = self.inner.dir.join(d.hex());
        let d = *d;
        let p = path.clone();
        match tokio::task::spawn_blocking(move || read_entry(&p, &d)).await {
            Ok(Read::Hit(b)) => Some(Bytes::from(b)),
            Ok(Read::Bad) => {
                // Without the lock: the index over-counts until the next listing.
                let _ = tokio::fs::remove_file(&path).await;
                None
            }
            Ok(Read::Miss) | Err(_) => None,
        }
    }

    /// Adds verified raw bytes, evicting least-recently-used entries to stay within the
    /// bound. Failures are ignored (a cache is an optimisation).
    pub async fn put(&self, d: &ChunkDigest, raw: Bytes) {
        if raw.len() as u64 > self.inner.max_bytes {
            return;
        }
        let inner = self.inner.clone();
        let d = *d;
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || inner.put(&d, &raw)).await {
            tracing::debug!(chunk = %d, error = %e, "read cache: not kept");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sets the modification time of entry `d` in `dir` to `secs` seconds ago.
    fn age(dir: &Path, d: &ChunkDigest, secs: u64) {
        let f = File::options().write(true).open(dir.join(d.hex())).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(secs))
            .unwrap();
    }

    #[tokio::test]
    async fn lru_bound_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let c = ReadCache::open(dir.path(), 250).await.unwrap();
        let chunks: Vec<Bytes> = (0..4u8).map(|i| Bytes::from(vec![i; 100])).collect();
        let ds: Vec<ChunkDigest> = chunks.iter().map(|c| ChunkDigest::of(c)).collect();
        c.put(&ds[0], chunks[0].clone()).await;
        c.put(&ds[1], chunks[1].clone()).await;
        // Written a while ago, 0 before 1; then 0 is used: 0 is now more recent than 1.
        age(dir.path(), &ds[0], 20);
        age(dir.path(), &ds[1], 10);
        assert!(c.get(&ds[0]).await.is_some());
        c.put(&ds[2], chunks[2].clone()).await; // over 250: evicts 1
        assert_eq!(c.size(), 200);
        assert!(c.get(&ds[1]).await.is_none());
        assert_eq!(c.get(&ds[0]).await.unwrap(), chunks[0]);
        // A corrupted entry is dropped, not served.
        std::fs::write(dir.path().join(ds[2].hex()), b"garbage").unwrap();
        assert!(c.get(&ds[2]).await.is_none());
        assert!(c.get(&ds[2]).await.is_none());
        // Reopen keeps what is there.
        drop(c);
        let c = ReadCache::open(dir.path(), 250).await.unwrap();
        assert_eq!(c.len(), 1);
        // Reopen with a smaller bound evicts down to it.
        drop(c);
        let c = ReadCache::open(dir.path(), 50).await.unwrap();
        assert!(c.is_empty());
    }

    #[tokio::test]
    async fn open_reaps_dead_temp_files_and_rewrites_the_index() {
        let dir = tempfile::tempdir().unwrap();
        // What a writer killed mid-write leaves (its lock went with it), and a live writer's
        // temp file, locked.
        let dead = dir.path().join(format!("{TEMP_PREFIX}dead"));
        std::fs::write(&dead, b"partial").unwrap();
        let live = dir.path().join(format!("{TEMP_PREFIX}live"));
        let held = File::create(&live).unwrap();
        flock(&held, FlockOperation::NonBlockingLockExclusive).unwrap();
        // An entry put there by hand and an index that over-counts (a crash after counting).
        let raw = vec![7u8; 300];
        let d = ChunkDigest::of(&raw);
        std::fs::write(dir.path().join(d.hex()), &raw).unwrap();
        std::fs::write(dir.path().join(INDEX), 5000u64.to_le_bytes()).unwrap();

        let c = ReadCache::open(dir.path(), 1000).await.unwrap();
        assert!(!dead.exists());
        assert!(live.exists());
        let l = c.inner.lock().unwrap();
        assert_eq!(l.total(), Some(300));
        drop(l);
        assert_eq!(c.get(&d).await.unwrap(), raw);
    }

    fn mkfifo(p: &Path) {
        let st = std::process::Command::new("mkfifo")
            .arg(p)
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// Opens the write side of the FIFO at `p` without blocking (releasing a reader stuck in
    /// its open), when there is a reader.
    fn release_fifo(p: &Path) {
        use std::os::unix::fs::OpenOptionsExt;
        let _ = OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(p);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_fifo_named_like_an_entry_or_a_temp_file_blocks_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let c = ReadCache::open(dir.path(), 1000).await.unwrap();
        let raw = Bytes::from(vec![3u8; 100]);
        let d = ChunkDigest::of(&raw);
        let fifo = dir.path().join(d.hex());
        mkfifo(&fifo);
        let got = tokio::time::timeout(Duration::from_secs(5), c.get(&d)).await;
        if got.is_err() {
            release_fifo(&fifo);
            panic!("get of a FIFO named like an entry hung");
        }
        assert!(got.unwrap().is_none());
        // The stray is gone, and the real entry can be admitted and served.
        c.put(&d, raw.clone()).await;
        assert_eq!(c.get(&d).await.unwrap(), raw);
        drop(c);

        let tmp = dir.path().join(format!("{TEMP_PREFIX}planted"));
        mkfifo(&tmp);
        let opened =
            tokio::time::timeout(Duration::from_secs(5), ReadCache::open(dir.path(), 1000)).await;
        if opened.is_err() {
            release_fifo(&tmp);
            panic!("open hung on a FIFO named like a temp file");
        }
        opened.unwrap().unwrap();
        assert!(!tmp.exists());
    }

    #[tokio::test]
    async fn an_index_that_is_not_a_regular_file_is_refused_and_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"do not overwrite me").unwrap();
        let cache = dir.path().join("cache");
        std::fs::create_dir(&cache).unwrap();
        std::os::unix::fs::symlink(&victim, cache.join(INDEX)).unwrap();
        let e = ReadCache::open(&cache, 1000).await.unwrap_err().to_string();
        assert_eq!(std::fs::read(&victim).unwrap(), b"do not overwrite me");
        assert!(e.contains(INDEX) && e.contains("not a regular file"), "{e}");

        std::fs::remove_file(cache.join(INDEX)).unwrap();
        mkfifo(&cache.join(INDEX));
        let e = ReadCache::open(&cache, 1000).await.unwrap_err().to_string();
        assert!(e.contains(INDEX) && e.contains("not a regular file"), "{e}");

        // A hard link to another file is a regular file, but not the cache's own.
        std::fs::remove_file(cache.join(INDEX)).unwrap();
        std::fs::hard_link(&victim, cache.join(INDEX)).unwrap();
        let e = ReadCache::open(&cache, 1000).await.unwrap_err().to_string();
        assert_eq!(std::fs::read(&victim).unwrap(), b"do not overwrite me");
        assert!(e.contains(INDEX) && e.contains("hard link"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_lock_held_forever_fails_open_in_bounded_time() {
        let dir = tempfile::tempdir().unwrap();
        let held = File::create(dir.path().join(INDEX)).unwrap();
        flock(&held, FlockOperation::LockExclusive).unwrap();
        let opened =
            tokio::time::timeout(Duration::from_secs(30), ReadCache::open(dir.path(), 1000)).await;
        drop(held);
        let e = opened
            .expect("open waited over 30 s for a lock another process never releases")
            .unwrap_err()
            .to_string();
        assert!(e.contains(INDEX) && e.contains("locked"), "{e}");
    }

    #[tokio::test]
    async fn a_removed_index_is_recreated_and_locked() {
        let dir = tempfile::tempdir().unwrap();
        let c = ReadCache::open(dir.path(), 1000).await.unwrap();
        std::fs::remove_file(dir.path().join(INDEX)).unwrap();
        let raw = Bytes::from(vec![1u8; 100]);
        let d = ChunkDigest::of(&raw);
        c.put(&d, raw.clone()).await;
        assert_eq!(c.get(&d).await.unwrap(), raw);
        // The index at the path is the one counted in.
        let b = std::fs::read(dir.path().join(INDEX)).unwrap();
        assert!(u64::from_le_bytes(b[..8].try_into().unwrap()) >= 100);
    }
}
