//! The local backend's pack files: the index format, the batch being written, and the
//! in-memory map of what every committed pack holds. The layout, the commit order and the
//! durability argument are in [`super::local`] ("Packs").

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use crate::digest::Sha256Hash;

pub(crate) use super::pack::{IdxEntry, Loc, chunk_digest, decode_index, encode_index};

/// The directory of committed packs, under the store's root. Dot-named: no listing of
/// objects ever walks it.
pub(crate) const PACK_DIR: &str = ".packs";
/// The lock file (under `.locks`) held while packs are committed or entries marked dead.
/// `#` is not in the key alphabet and a key's hashed lock name has 64 hex digits after it.
pub(crate) const PACK_LOCK: &str = "#packs";
/// Open pack files kept for reads.
const OPEN_PACKS_MAX: usize = 64;
/// How long after a change of `.packs` its timestamps alone cannot show a second change:
/// file system timestamps come from a coarse clock (one tick: 1 to 10 ms), so a change in the
/// same tick as the last one seen leaves them equal. While the last change seen is younger
/// than this, a miss rescans the directory.
const RACY: Duration = Duration::from_millis(100);

/// A pack is compacted once this share of its bytes is dead (one half). Then every pack
/// left after a GC is at least half live, so the packs never take more than twice the
/// bytes of the chunks they serve, however long the store lives; and a compaction copies
/// at most as many bytes as it frees (live ≤ dead), so its cost is bounded by the space it
/// reclaims: each byte deleted is copied at most once on average before it is freed. A
/// lower share would copy more than it frees (at 10% dead, nine bytes copied per byte
/// freed); a higher one would let the dead weight grow past the live bytes.
pub(crate) const COMPACT_DEAD_SHARE: Share = Share { num: 1, den: 2 };

/// A fraction `num / den`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Share {
    num: u64,
    den: u64,
}

impl Share {
    /// `num / den` of `n`, rounded up.
    fn threshold(self, n: u64) -> u64 {
        (u128::from(n) * u128::from(self.num)).div_ceil(u128::from(self.den)) as u64
    }
}

/// One pack to compact: its serving entries, in pack order, copied into a new pack.
#[derive(Debug, Clone)]
pub(crate) struct CompactPlan {
    pub(crate) name: Arc<str>,
    pub(crate) pack_len: u64,
    pub(crate) live: Vec<IdxEntry>,
    pub(crate) live_bytes: u64,
    /// The index's mtime: the new index gets it too, so that no chunk's `modified` (GC's
    /// grace period) changes.
    pub(crate) modified: SystemTime,
}

/// The digests of a dead file's whole records (a torn last one is not a deletion yet).
fn decode_dead(b: &[u8]) -> HashSet<Sha256Hash> {
    b.chunks_exact(32)
        .map(|c| {
            let mut d = [0u8; 32];
            d.copy_from_slice(c);
            Sha256Hash(d)
        })
        .collect()
}

/// One upload's pack while it is written: `.tmp/<writer>-<n>-<nanos>.pack`, made at the
/// first chunk; parallel stagers reserve their ranges with one atomic add and write them
/// with `pwrite`, so encoding stays parallel. Every [`WRITEBACK_WINDOW`] bytes reserved, the
/// kernel is asked to start writing the range back (see there). Dropped uncommitted, it
/// removes the file.
#[derive(Debug)]
pub(crate) struct PackBatch {
    /// `<writer>-<n>-<nanos>`: the pack's, index's and dead file's name without extension.
    pub(crate) name: String,
    /// `.tmp/<name>.pack`.
    pub(crate) tmp: PathBuf,
    file: Mutex<Option<Arc<File>>>,
    next: AtomicU64,
    /// Bytes from the pack's start whose writeback was started ([`start_writeback`]).
    started: AtomicU64,
    /// Set by [`PackBatch::discard`]: no append makes the file again.
    discarded: std::sync::atomic::AtomicBool,
}

impl PackBatch {
    pub(crate) fn new(name: String, tmp: PathBuf) -> Self {
        Self {
            name,
            tmp,
            file: Mutex::new(None),
            next: AtomicU64::new(0),
            started: AtomicU64::new(0),
            discarded: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Removes the temp pack now, and makes every later [`PackBatch::append`] fail: a failed
    /// upload's discard must not wait for the last holder of the batch (a stage still
    /// running on the blocking pool after its upload gave up), and such a stage must not
    /// make the file again. A stage that got the file before writes into an unlinked inode,
    /// freed when it closes.
    pub(crate) fn discard(&self) {
        let mut g = self.file.lock().unwrap_or_else(|p| p.into_inner());
        self.discarded.store(true, Ordering::SeqCst);
        if g.take().is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }

    /// Writes `data` at a range of its own; returns its offset.
    pub(crate) fn append(&self, data: &[u8]) -> std::io::Result<u64> {
        let f = {
            let mut g = self.file.lock().unwrap_or_else(|p| p.into_inner());
            if self.discarded.load(Ordering::SeqCst) {
                return Err(std::io::Error::other("the upload's batch was discarded"));
            }
            match &*g {
                Some(f) => f.clone(),
                None => {
                    let f = Arc::new(
                        OpenOptions::new()
                            .read(true)
                            .write(true)
                            .create_new(true)
                            .open(&self.tmp)?,
                    );
                    *g = Some(f.clone());
                    f
                }
            }
        };
        let off = self.next.fetch_add(data.len() as u64, Ordering::Relaxed);
        f.write_all_at(data, off)?;
        let end = off + data.len() as u64;
        let from = self.started.load(Ordering::Relaxed);
        // One stager starts each window; ranges reserved in it and not yet written are left
        // to the commit's fsync.
        if end >= from + WRITEBACK_WINDOW
            && self
                .started
                .compare_exchange(from, end, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            start_writeback(&f, from, end - from);
        }
        Ok(off)
    }

    /// The pack file, once a chunk was written.
    pub(crate) fn file(&self) -> Option<Arc<File>> {
        self.file.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Bytes reserved so far.
    pub(crate) fn len(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }
}

/// Bytes of a pack being written after which the kernel is asked to start writing them back
/// (8 MiB), so that the commit's one fsync waits for the last window rather than the whole
/// pack.
///
/// Measured (issue 33, `strace -f -T` of `kiln store import` of a 256 MiB tarball of `/usr`
/// into a new local store, 2 cores): without it, the pack's fsync took 0.12 s of a 1.4 s
/// import, with both cores idle.
const WRITEBACK_WINDOW: u64 = 8 << 20;

/// Asks the kernel to start writing `len` bytes of `f` from `from` back to the disk, without
/// waiting (`sync_file_range(2)` with `SYNC_FILE_RANGE_WRITE` only). A hint: durability is
/// still the commit's fsync, which also reports any write-back error (this call neither
/// waits for nor consumes one: the kernel keeps it for the file until an fsync reads it).
/// Errors are ignored. Elsewhere than Linux it does nothing.
fn start_writeback(f: &File, from: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(from), Ok(len)) = (i64::try_from(from), i64::try_from(len)) else {
            return;
        };
        // SAFETY: sync_file_range takes a file descriptor and integers, and touches no memory
        // of ours; the descriptor stays open while `f` is borrowed.
        let _ =
            unsafe { libc::sync_file_range(f.as_raw_fd(), from, len, libc::SYNC_FILE_RANGE_WRITE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, from, len);
}

impl Drop for PackBatch {
    fn drop(&mut self) {
        // After a commit the file is under `.packs`: nothing to remove.
        if self.file.get_mut().map(|f| f.is_some()).unwrap_or(true) {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

fn stamp_of(m: &fs::Metadata) -> Stamp {
    Stamp {
        ino: m.ino(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    }
}

#[derive(Debug)]
struct PackInfo {
    name: Arc<str>,
    entries: Vec<IdxEntry>,
    dead: HashSet<Sha256Hash>,
    /// Size of the dead file when last read (it only grows, so a new size is a new delete).
    dead_len: u64,
    modified: SystemTime,
    pack_len: u64,
}

impl PackInfo {
    fn live(&self) -> impl Iterator<Item = &IdxEntry> {
        self.entries
            .iter()
            .filter(|e| !self.dead.contains(&e.digest))
    }

    /// Whether `d` is a live entry of this pack (the entries are sorted by digest).
    fn holds_live(&self, d: &Sha256Hash) -> bool {
        !self.dead.contains(d) && self.entries.binary_search_by_key(d, |e| e.digest).is_ok()
    }

    fn entry(&self, d: &Sha256Hash) -> Option<&IdxEntry> {
        self.entries
            .binary_search_by_key(d, |e| e.digest)
            .ok()
            .map(|i| &self.entries[i])
    }

    /// Which of two packs holding one chunk serves it: the smaller, then the lower name.
    /// Fixed by the packs alone (not by the order a process read them), so every process
    /// agrees; a compacted pack is smaller than the pack it was copied from, so when a
    /// compaction was killed before it retired the old pack, the new one serves and the
    /// old one's entries all count as dead ([`Packs::plan_compaction`]).
    fn rank(&self) -> (u64, &str) {
        (self.pack_len, &self.name)
    }

    fn loc(&self, e: &IdxEntry) -> Loc {
        Loc::of(&self.name, e, self.modified)
    }
}

#[derive(Debug, Default)]
pub(super) struct PackMap {
    stamp: Option<Stamp>,
    pub(super) racy: bool,
    packs: HashMap<Arc<str>, PackInfo>,
    /// Where each live chunk is served from: one pack, by [`PackInfo::rank`].
    map: HashMap<Sha256Hash, Loc>,
    /// The other packs holding a live entry of a chunk (a duplicate: a compaction killed
    /// before it retired the pack it copied). Rare; consulted when the serving pack's entry
    /// dies or the pack goes, so the chunk stays served from the next one.
    alts: HashMap<Sha256Hash, Vec<Arc<str>>>,
    /// Index files refused (file name → why): their chunks are not served.
    problems: BTreeMap<String, String>,
}

impl PackMap {
    fn insert(&mut self, info: PackInfo) {
        for e in info.live() {
            let d = e.digest;
            let current = self.map.get(&d).map(|l| l.pack.clone());
            match current {
                Some(cur) if *cur != *info.name => {
                    let keep = self
                        .packs
                        .get(&cur)
                        .is_some_and(|c| c.rank() <= info.rank());
                    if keep {
                        self.alts.entry(d).or_default().push(info.name.clone());
                    } else {
                        self.alts.entry(d).or_default().push(cur);
                        self.map.insert(d, info.loc(e));
                    }
                }
                _ => {
                    self.map.insert(d, info.loc(e));
                }
            }
        }
        self.packs.insert(info.name.clone(), info);
    }

    /// `d` is no longer live in pack `name`: served from another pack that holds it, if any.
    fn unlink(&mut self, name: &str, d: &Sha256Hash) {
        if self.map.get(d).is_none_or(|l| *l.pack != *name) {
            if let Some(a) = self.alts.get_mut(d) {
                a.retain(|n| **n != *name);
                if a.is_empty() {
                    self.alts.remove(d);
                }
            }
            return;
        }
        self.map.remove(d);
        let Some(mut cands) = self.alts.remove(d) else {
            return;
        };
        cands.retain(|n| **n != *name && self.packs.get(n).is_some_and(|p| p.holds_live(d)));
        cands.sort_by(|a, b| self.packs[a].rank().cmp(&self.packs[b].rank()));
        if cands.is_empty() {
            return;
        }
        let best = cands.remove(0);
        let info = &self.packs[&best];
        if let Some(e) = info.entry(d) {
            let loc = info.loc(e);
            self.map.insert(*d, loc);
        }
        if !cands.is_empty() {
            self.alts.insert(*d, cands);
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some(info) = self.packs.remove(name) {
            for e in &info.entries {
                self.unlink(name, &e.digest);
            }
        }
    }

    fn set_dead(&mut self, name: &str, dead: HashSet<Sha256Hash>, dead_len: u64) {
        let Some(info) = self.packs.get_mut(name) else {
            return;
        };
        let newly: Vec<Sha256Hash> = dead.difference(&info.dead).copied().collect();
        info.dead = dead;
        info.dead_len = dead_len;
        for d in &newly {
            self.unlink(name, d);
        }
    }

    /// The entries of pack `name` that serve their chunk (see [`PackInfo::rank`]).
    fn serving<'a>(&'a self, info: &'a PackInfo) -> impl Iterator<Item = &'a IdxEntry> {
        info.live()
            .filter(move |e| self.map.get(&e.digest).is_some_and(|l| l.pack == info.name))
    }
}

/// What every committed pack of a store holds, as this process last read it, and its open
/// pack files.
#[derive(Debug)]
pub(crate) struct Packs {
    dir: PathBuf,
    state: RwLock<PackMap>,
    open: Mutex<HashMap<Arc<str>, Arc<File>>>,
    /// Packs a delete retired whole since the last compaction.
    pub(crate) retired_early: super::RetiredEarly,
}

/// The error for a `.packs` that is a symlink.
fn symlinked(dir: &Path) -> std::io::Error {
    std::io::Error::other(format!(
        "{} is a symlink; a store never follows one",
        dir.display()
    ))
}

impl Packs {
    pub(crate) fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            state: RwLock::default(),
            open: Mutex::default(),
            retired_early: super::RetiredEarly::default(),
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn path(&self, name: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{name}.{ext}"))
    }

    pub(super) fn read(&self) -> std::sync::RwLockReadGuard<'_, PackMap> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, PackMap> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// `lstat` of `.packs`: a symlink is an error, an absent one `None`.
    fn dir_meta(&self) -> std::io::Result<Option<fs::Metadata>> {
        match fs::symlink_metadata(&self.dir) {
            Ok(m) if m.file_type().is_symlink() => Err(symlinked(&self.dir)),
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Where the live chunk `d` is packed, as of now: a hit is checked against its pack's
    /// dead file (one `lstat`: another process may have deleted it), a miss against
    /// `.packs`'s timestamps (one `lstat`: another process may have committed a pack).
    pub(crate) fn lookup(&self, d: &Sha256Hash) -> std::io::Result<Option<Loc>> {
        for _ in 0..3 {
            let hit = self.read().map.get(d).cloned();
            match hit {
                Some(loc) => {
                    if self.dir_meta()?.is_none() {
                        self.rescan()?;
                        continue;
                    }
                    if self.dead_is_current(&loc.pack)? {
                        return Ok(Some(loc));
                    }
                }
                None => {
                    if !self.rescan_if_changed()? {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(self.read().map.get(d).cloned())
    }

    /// Whether `d` is a live packed chunk in this process's view, as last scanned (the
    /// commit's check, under the lock, right after a rescan).
    pub(crate) fn contains(&self, d: &Sha256Hash) -> bool {
        self.read().map.contains_key(d)
    }

    /// Whether this process's view of pack `name`'s deletions is current; when it is not,
    /// reloads them (or forgets the pack, gone) and returns false.
    fn dead_is_current(&self, name: &Arc<str>) -> std::io::Result<bool> {
        let known = match self.read().packs.get(name) {
            Some(i) => i.dead_len,
            None => return Ok(false),
        };
        match fs::symlink_metadata(self.path(name, "dead")) {
            Ok(m) if m.len() == known => Ok(true),
            Ok(_) => {
                self.reload_dead(name)?;
                Ok(false)
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if fs::symlink_metadata(self.path(name, "idx")).is_ok() {
                    Ok(known == 0)
                } else {
                    self.write().remove(name);
                    self.forget_file(name);
                    Ok(false)
                }
            }
            Err(e) => Err(e),
        }
    }

    fn reload_dead(&self, name: &str) -> std::io::Result<()> {
        let (dead, len) = read_dead(&self.path(name, "dead"))?;
        self.write().set_dead(name, dead, len);
        Ok(())
    }

    /// Rescans when `.packs` changed since the last scan (or may have: [`RACY`]). Returns
    /// whether it rescanned.
    pub(crate) fn rescan_if_changed(&self) -> std::io::Result<bool> {
        let Some(m) = self.dir_meta()? else {
            return Ok(false);
        };
        {
            let s = self.read();
            if !s.racy && s.stamp.as_ref() == Some(&stamp_of(&m)) {
                return Ok(false);
            }
        }
        self.rescan()?;
        Ok(true)
    }

    /// Reads `.packs` again: loads the indexes not seen yet, forgets the packs gone, and
    /// rereads the dead files that grew.
    pub(crate) fn rescan(&self) -> std::io::Result<()> {
        let mut s = self.write();
        let Some(m) = self.dir_meta()? else {
            *s = PackMap::default();
            return Ok(());
        };
        let seen_at = SystemTime::now();
        let stamp = stamp_of(&m);
        let mut names = HashSet::new();
        for e in fs::read_dir(&self.dir)? {
            let e = e?;
            if let Some(stem) = e.file_name().to_str().and_then(|n| n.strip_suffix(".idx")) {
                names.insert(stem.to_string());
            }
        }
        let gone: Vec<Arc<str>> = s
            .packs
            .keys()
            .filter(|n| !names.contains(&***n))
            .cloned()
            .collect();
        for n in gone {
            s.remove(&n);
            self.forget_file(&n);
        }
        // A refused index removed since is no longer reported.
        s.problems
            .retain(|f, _| f.strip_suffix(".idx").is_some_and(|n| names.contains(n)));
        for n in names {
            let file = format!("{n}.idx");
            if s.problems.contains_key(&file) {
                continue;
            }
            if let Some(info) = s.packs.get(n.as_str()) {
                let len = match fs::symlink_metadata(self.path(&n, "dead")) {
                    Ok(m) => m.len(),
                    Err(e) if e.kind() == ErrorKind::NotFound => 0,
                    Err(e) => return Err(e),
                };
                if len != info.dead_len {
                    let (dead, len) = read_dead(&self.path(&n, "dead"))?;
                    s.set_dead(&n, dead, len);
                }
                continue;
            }
            match self.load(&n) {
                Ok(Some(info)) => s.insert(info),
                Ok(None) => {}
                Err(reason) => {
                    tracing::warn!(file = %self.dir.join(&file).display(), %reason, "pack index refused: its chunks are not served");
                    s.problems.insert(file, reason);
                }
            }
        }
        let changed = std::time::UNIX_EPOCH
            + Duration::new(m.mtime().max(0) as u64, m.mtime_nsec().max(0) as u32).max(
                Duration::new(m.ctime().max(0) as u64, m.ctime_nsec().max(0) as u32),
            );
        s.racy = seen_at < changed + RACY;
        s.stamp = Some(stamp);
        Ok(())
    }

    /// Loads pack `name` (its index checked, its pack long enough, its dead file read).
    /// `Ok(None)`: removed meanwhile.
    fn load(&self, name: &str) -> Result<Option<PackInfo>, String> {
        let idx = self.path(name, "idx");
        let (bytes, modified) = match open_nofollow(&idx) {
            Ok(mut f) => {
                let mut b = Vec::new();
                let m = f
                    .metadata()
                    .and_then(|m| f.read_to_end(&mut b).map(|_| m))
                    .map_err(|e| e.to_string())?;
                if !m.is_file() {
                    return Err("not a regular file".into());
                }
                (b, m.modified().unwrap_or(std::time::UNIX_EPOCH))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let entries = decode_index(&bytes)?;
        let pack_len = match fs::symlink_metadata(self.path(name, "pack")) {
            Ok(m) if m.is_file() => m.len(),
            Ok(_) => return Err(format!("{name}.pack is not a regular file")),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                // Removed after the index by a delete of its last chunk, or lost.
                if fs::symlink_metadata(&idx).is_err() {
                    return Ok(None);
                }
                return Err(format!("its pack {name}.pack is missing"));
            }
            Err(e) => return Err(e.to_string()),
        };
        let end = entries.iter().map(|e| e.offset + e.len).max().unwrap_or(0);
        if end > pack_len {
            return Err(format!(
                "its pack {name}.pack is {pack_len} bytes, the index names bytes up to {end}"
            ));
        }
        let (dead, dead_len) = read_dead(&self.path(name, "dead")).map_err(|e| e.to_string())?;
        Ok(Some(PackInfo {
            name: Arc::from(name),
            entries,
            dead,
            dead_len,
            modified,
            pack_len,
        }))
    }

    /// Adds a pack this process just committed.
    pub(crate) fn add(
        &self,
        name: &str,
        entries: Vec<IdxEntry>,
        pack_len: u64,
        modified: SystemTime,
    ) {
        self.write().insert(PackInfo {
            name: Arc::from(name),
            entries,
            dead: HashSet::new(),
            dead_len: 0,
            modified,
            pack_len,
        });
    }

    /// Notes `d` deleted from pack `name` (its dead file now `dead_len` bytes). Returns the
    /// pack's length in bytes when every entry of it is dead (`None`: some entry lives).
    pub(crate) fn mark_dead(&self, name: &str, d: Sha256Hash, dead_len: u64) -> Option<u64> {
        let mut s = self.write();
        let Some(info) = s.packs.get_mut(name) else {
            s.unlink(name, &d);
            return None;
        };
        info.dead.insert(d);
        info.dead_len = dead_len;
        let all_dead = info.live().next().is_none().then_some(info.pack_len);
        s.unlink(name, &d);
        all_dead
    }

    /// Forgets pack `name` (deleted).
    pub(crate) fn drop_pack(&self, name: &str) {
        self.write().remove(name);
        self.forget_file(name);
    }

    fn forget_file(&self, name: &str) {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
    }

    /// Bytes `range` (clipped to the entry) of the chunk at `loc`. `NotFound` when the pack
    /// is gone.
    pub(crate) fn read_at(
        &self,
        loc: &Loc,
        range: std::ops::Range<u64>,
    ) -> std::io::Result<Vec<u8>> {
        let end = range.end.min(loc.len);
        let start = range.start.min(end);
        let f = {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            match open.get(&loc.pack) {
                Some(f) => f.clone(),
                None => {
                    self.dir_meta()?;
                    let f = Arc::new(open_nofollow(&self.path(&loc.pack, "pack"))?);
                    if open.len() >= OPEN_PACKS_MAX
                        && let Some(k) = open.keys().next().cloned()
                    {
                        open.remove(&k);
                    }
                    open.insert(loc.pack.clone(), f.clone());
                    f
                }
            }
        };
        let mut buf = vec![0u8; (end - start) as usize];
        f.read_exact_at(&mut buf, loc.offset + start)?;
        Ok(buf)
    }

    /// Every live packed chunk: (digest, stored length, modified).
    pub(crate) fn live(&self) -> Vec<(Sha256Hash, u64, SystemTime)> {
        self.read()
            .map
            .iter()
            .map(|(d, l)| (*d, l.len, l.modified))
            .collect()
    }

    /// Refused index files, pack count and bytes, and bytes no live entry names.
    pub(crate) fn report(&self) -> super::LayoutReport {
        let s = self.read();
        let mut r = super::LayoutReport {
            problems: s
                .problems
                .iter()
                .map(|(f, why)| (self.dir.join(f).display().to_string(), why.clone()))
                .collect(),
            ..Default::default()
        };
        for info in s.packs.values() {
            r.packs += 1;
            r.pack_bytes += info.pack_len;
            let live: u64 = s.serving(info).map(|e| e.len).sum();
            r.dead_bytes += info.pack_len.saturating_sub(live);
        }
        r
    }

    /// The packs a compaction takes now: those whose dead bytes (bytes no serving entry
    /// names: deleted chunks, chunks another writer had published first, copies another
    /// pack serves) are at least [`COMPACT_DEAD_SHARE`] of the pack, counting the chunks of
    /// `also_dead` as deleted too (a dry run's estimate of what its deletes would free).
    /// Largest reclaim first.
    pub(crate) fn plan_compaction(&self, also_dead: &HashSet<Sha256Hash>) -> Vec<CompactPlan> {
        let s = self.read();
        let mut out = Vec::new();
        for info in s.packs.values() {
            let mut live: Vec<IdxEntry> = s
                .serving(info)
                .filter(|e| !also_dead.contains(&e.digest))
                .copied()
                .collect();
            let live_bytes: u64 = live.iter().map(|e| e.len).sum();
            let dead = info.pack_len.saturating_sub(live_bytes);
            if dead == 0 || dead < COMPACT_DEAD_SHARE.threshold(info.pack_len) {
                continue;
            }
            // Read in the order of the pack: one sequential pass.
            live.sort_by_key(|e| e.offset);
            out.push(CompactPlan {
                name: info.name.clone(),
                pack_len: info.pack_len,
                live,
                live_bytes,
                modified: info.modified,
            });
        }
        out.sort_by_key(|p| std::cmp::Reverse(p.pack_len - p.live_bytes));
        out
    }

    /// The entries of pack `name` that serve their chunk now (`None`: no such pack).
    pub(crate) fn serving_entries(&self, name: &str) -> Option<Vec<IdxEntry>> {
        let s = self.read();
        let info = s.packs.get(name)?;
        Some(s.serving(info).copied().collect())
    }
}

fn read_dead(p: &Path) -> std::io::Result<(HashSet<Sha256Hash>, u64)> {
    match open_nofollow(p) {
        Ok(mut f) => {
            let mut b = Vec::new();
            f.read_to_end(&mut b)?;
            Ok((decode_dead(&b), b.len() as u64))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => Ok((HashSet::new(), 0)),
        Err(e) => Err(e),
    }
}

pub(crate) fn open_nofollow(p: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(p)
}
