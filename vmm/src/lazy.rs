//! Lazy clone start: a snapshot's memory file and disk image served to QEMU on demand, from
//! the chunk tables of its [`SnapshotManifest`](kiln_store::SnapshotManifest), by a small FUSE file system per snapshot and
//! host (the "chunk server").
//!
//! ## Why FUSE (and not NBD, nor userfaultfd)
//! QEMU maps a clone's memory file `share=off` ([`crate::launch::MemoryMode::Private`]): a
//! private mapping of a *file*. A FUSE file is such a file, so QEMU and the restore path stay
//! exactly as with a materialized snapshot, and every clone of one snapshot on one host maps
//! the same inode: clean pages are read once into the page cache and shared by all of them
//! (a clone's writes go to its private copies). The disk is the same kind of file, opened
//! read-only as the backing file of the per-clone qcow2 overlay. One mechanism serves both.
//! NBD would serve only the disk (memory still needs a file), and userfaultfd would need to
//! live inside QEMU's process. The price of FUSE is one mount per snapshot, which must not
//! outlive its server (below).
//!
//! ## The files
//! `<cache>/<snapshot hex>/mnt/` is the mount point; it holds `memory` and `disk.raw` (mode
//! 0444, read-only; their sizes are the chunk tables' sizes). A read of a range fetches every
//! chunk it covers through [`kiln_store::artifact::ArtifactReader`]: the chunks it read
//! recently first (kept in memory, [`kiln_store::artifact::READER_MEMORY`]: a guest touches
//! the pages of one chunk at different times), then the store's read cache
//! ([`kiln_store::readcache`], bounded by `cache_max_mib`, least-recently-used), else the
//! store (local or S3, with the store's bounded retries: `store_attempts`, and for
//! `kiln __lazy-serve` the read bound `lazy_read_timeout_secs`), decompressed, its sha256
//! checked, kept in the read cache, and answered. Zero chunks (holes of the table) are answered without any fetch. A chunk that
//! fails its digest, or a store that cannot be reached once the retries are spent, answers
//! the read with `EIO`, never with wrong bytes, and so does every read of that chunk for
//! [`FAILURE_MEMORY`] after, without asking the store again (QEMU retries a failed read at
//! once; each retry would wait the whole read bound again); the first such error is written to
//! `<dir>/failure` ([`FAILURE`]) so that the clone start that hit it names the chunk
//! ([`crate::clone::CloneError::ChunkServer`]). Every chunk served is appended once to
//! `<dir>/chunks.log` ([`CHUNK_LOG`], lines `memory|disk <index> <digest> <raw bytes>`).
//!
//! ## Where the server lives
//! `kiln start` returns once its clones answer and leaves QEMU running on its own, so the
//! server cannot be a thread of `kiln start`: it is a daemon per snapshot and host, spawned
//! by the first start that needs it ([`ensure_server`]: the program of
//! [`crate::clone::Serving::Lazy`], `kiln __lazy-serve`), and shared by every
//! later clone of that snapshot. Its process is a *watcher* that forks the *server*
//! ([`run_daemon`]). When the server dies (killed, crashed) the watcher detaches the mount
//! (`umount2(MNT_DETACH)`), kills every QEMU whose command line names the mount (a clone
//! whose memory is no longer served would fault forever or die of `SIGBUS`), writes the
//! reason into each such clone's directory (`stopped`, [`STOPPED`]; `kiln ps` and
//! `kiln exec` show it), and exits. Those clones are the ones whose QEMU names the mount
//! then, and the ones that did at its last look, every [`IDLE_INTERVAL`] while the server
//! ran: a QEMU that met an unserved page first is already gone. A server whose last clone
//! has left unmounts and exits on its own, and releases its lease: at once when the mount's
//! files were opened and are all closed again (counted by the FUSE `open` and `release`;
//! a QEMU holds its files until it exits), else once no QEMU has named the mount for a few
//! seconds ([`IDLE_CHECKS`] × [`IDLE_INTERVAL`]: a server nobody opened). A start holds a
//! shared `flock` on `<dir>/lazy.use` from before it looks for the server until its QEMU
//! runs, and the server exits only while it holds that lock exclusively and no QEMU names
//! the mount, so it never leaves under a start that is about to use it, nor under a clone.
//!
//! ## The prefetch list
//! A snapshot whose manifest carries a prefetch list ([`kiln_store::PrefetchList`], recorded
//! by `kiln snapshot`: [`crate::snapshot`]) has those chunks fetched by the server as soon as
//! it has read the snapshot manifest (before its lease and its mount; nothing is served
//! before both), in the fetch order ([`kiln_store::PrefetchList::fetch_order`]: the disk's
//! chunks first), in batches read with one [`Store::get_chunks`] each (on S3 a few ranged
//! GETs per pack, not a GET per chunk; `kiln snapshot` and a push to S3 write the listed
//! chunks again into a pack of their own in this very order, [`Store::pack_prefetch`], so a
//! batch is about one ranged GET of one small pack), [`PREFETCH_BATCHES`] batches at a time, in the
//! background while the clone starts: each through the store's read cache (verified, kept),
//! and then into the kernel's page cache of the file it is served in ([`push_pages`]), so
//! the clone's faults on those pages never reach the server. Only for a store with a read
//! cache (not a local directory, whose chunks are already on this host). When it is done
//! the server writes [`PREFETCH_DONE`]. A clone's read of a chunk the prefetch is fetching
//! waits for that fetch ([`Store::get_chunk`]).
//!
//! ## Whole chunks into the page cache
//! A read is answered with the pages asked for, and the rest of the chunks they fall in
//! (fetched whole anyway) then goes to the page cache too ([`chunk_span`], [`push_pages`]):
//! a guest touches the pages of one chunk at different times. Measured (issue 35,
//! `ci/bench-clone.sh --store s3`, five cold starts each, under load 1–2): a cold busybox
//! start (256 MiB guest) answered in 271 ms against 416 ms without it, the Debian fixture
//! (512 MiB) in 342 ms against 624 ms.
//!
//! ## The lease
//! While it serves, the server holds a store lease ([`kiln_store::lease`], id
//! `lazy-<16 hex of the snapshot>-<pid>-<ns>`) on the snapshot manifest and everything it
//! names: every memory and disk chunk, the vmstate, kernel and initramfs blobs, and the image
//! manifest. So `kiln store gc` keeps every chunk a clone may still read even after the
//! snapshot's tag is gone. It is taken in the background once the snapshot manifest is read,
//! while the server mounts and says "ready" and the clone's QEMU starts (its requests, a PUT
//! and a look under the sweep lock, are then off the start's path); every read waits for it,
//! and no page reaches the page cache before it is held. A lease that cannot be taken (the
//! store fails, or the snapshot was deleted meanwhile) is recorded as the server's failure
//! ([`FAILURE`]), every waiting read fails, and the server exits with status 1: its watcher
//! detaches the mount and stops the clones that had begun to start from it, whose start then
//! fails naming the lease. The lease expires
//! [`LEASE_TTL`] after its last renewal (every [`LEASE_RENEW`] while the server runs), and is
//! released when the idle server leaves; a server that dies leaves a lease whose owner is
//! dead, which GC on this host releases at once (and others at its expiry). The server's
//! reads are bounded by the store options it is opened with (`kiln __lazy-serve` uses
//! `lazy_read_timeout_secs`, below the clones' restore timeout), so a store that stops
//! answering fails the read, naming the chunk and the store, before the start times out.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::{IsTerminal, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    MountOption, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, Request,
};
use kiln_store::artifact::ArtifactReader;
use kiln_store::lease::Lease;
use kiln_store::manifest::{ObjectRef, references};
use kiln_store::owner::{ProcessId, start_ticks};
use kiln_store::{ChunkTable, Manifest, ManifestDigest, RawManifest, SnapshotManifest, Store};
use serde::{Deserialize, Serialize};

/// The mount point's name inside the snapshot's cache directory.
pub const MOUNT_DIR: &str = "mnt";
/// The memory file's name in the mount.
pub const MEMORY_FILE: &str = "memory";
/// The disk image's name in the mount.
pub const DISK_FILE: &str = "disk.raw";
/// The first read error of the server (text naming the chunk and the store).
pub const FAILURE: &str = "failure";
/// Every chunk served, once (`memory|disk <index> <digest> <raw bytes>` per line).
pub const CHUNK_LOG: &str = "chunks.log";
/// Why a clone was stopped by the watcher (in the clone's directory).
pub const STOPPED: &str = "stopped";
/// The server's and the watcher's process ids (JSON [`ServerRecord`]).
pub const SERVER_RECORD: &str = "server.json";
/// The server's standard error (appended).
pub const SERVER_LOG: &str = "lazy.log";
/// Written by the server when its prefetch is done: `<fetched> <failed> <bytes> <ms>`.
pub const PREFETCH_DONE: &str = "prefetch.done";
/// Batches of [`kiln_store::artifact::READ_BATCH`] chunks the prefetch has in flight (8:
/// 32 MiB of 64 KiB chunks, the whole list of a Debian clone's 416 chunks at once). The
/// clone's first faults wait for the batches holding their chunks ([`Store::get_chunk`]
/// takes a chunk another read is fetching from that read), so the prefetch's speed is the
/// clone's. Measured cold from the local S3 server (issue 35, Debian fixture, 512 MiB,
/// three starts each): two batches at a time, the prefetch took 1.2 s and the clone
/// answered in 1.25 s; eight, 0.6 s and 0.68 s.
pub const PREFETCH_BATCHES: usize = 8;
/// The lock starts hold shared while they use the server.
const USE_LOCK: &str = "lazy.use";
/// How often the server looks for clones using it.
pub const IDLE_INTERVAL: Duration = Duration::from_secs(1);
/// How many checks in a row without a clone make the server exit.
pub const IDLE_CHECKS: u32 = 3;
/// How often a server whose files were opened and are all closed again asks for the use
/// lock, while a start holds it shared (50 ms: an `flock` attempt each, no process scan).
pub const CLOSED_POLL: Duration = Duration::from_millis(50);

/// How long a chunk whose read failed is answered at once with that failure (`EIO`) instead
/// of being asked of the store again ([`ArtifactReader::remembering_failures`]): 5 s. QEMU
/// reads a page or block again right after an `EIO`: measured (issue 35, `vm_lazy`'s stalled
/// store, 3 s read bound, under load), a restore read the disk's first block twice and one
/// memory page three times, each read issued within 15 ms of the last one's failure,
/// and each waited the whole bound: 15 s before the start could fail, 6 s with this. A store
/// that comes back is asked again at most this long after the failure.
pub const FAILURE_MEMORY: Duration = Duration::from_secs(5);

/// How long the server's lease lasts after its last renewal (10 min: a server that hangs or
/// whose host vanishes stops protecting the snapshot after that).
pub const LEASE_TTL: Duration = Duration::from_secs(600);
/// How often the server renews its lease (a tenth of [`LEASE_TTL`], so several renewals can
/// fail before it lapses).
pub const LEASE_RENEW: Duration = Duration::from_secs(60);

/// What [`SERVER_RECORD`] holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerRecord {
    /// The serving process.
    pub server: ProcessId,
    /// The watcher that forked it.
    pub watcher: ProcessId,
}

/// The paths a clone is started with, and the use lock that keeps the server from exiting
/// while the start is under way (drop it once QEMU runs).
#[derive(Debug)]
pub struct Served {
    /// `<mnt>/memory`.
    pub memory: PathBuf,
    /// `<mnt>/disk.raw`.
    pub disk: PathBuf,
    /// The snapshot's cache directory (holds [`FAILURE`]).
    pub dir: PathBuf,
    _use: std::fs::File,
}

/// Errors of the chunk server's start.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    /// A local file operation.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The server did not say it was ready.
    #[error("the chunk server for {dir} did not start: {reason}")]
    Start {
        /// The snapshot's cache directory.
        dir: PathBuf,
        /// Why (its log's last lines).
        reason: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LazyError + '_ {
    move |source| LazyError::Io {
        path: path.to_path_buf(),
        source,
    }
}

// ---------------------------------------------------------------- the file system

const ROOT: u64 = 1;
const MEMORY_INO: u64 = 2;
const DISK_INO: u64 = 3;
/// Attributes never change (the artifacts are immutable): cache them a day.
const TTL: Duration = Duration::from_secs(86_400);
/// The mount's readahead, bytes: one page (FUSE `max_readahead`, answered at `FUSE_INIT`;
/// the kernel offers 128 KiB). A fault on the memory file reads this much around the faulting
/// page (`do_sync_mmap_readahead`'s read-around, centred on the page), and every memory chunk
/// (64 KiB, [`kiln_store::Chunking::MEMORY_DEFAULT`]) the window touches is fetched whole,
/// so the window is kept to the page. Measured by `kiln/tests/vm_lazy.rs` (busybox, 256 MiB
/// guest, cold from the local S3 server, huge-page advice refused, one run each): memory
/// served before the clone answered and ran a command was 16.8% of guest RAM with 128 KiB
/// (327 memory read requests), 17.0% with 64 KiB (529), 14.8% with 4 KiB (2,435 requests of
/// one page; 9.5 MiB of distinct pages, 3.7% of RAM). The disk's reads are QEMU's `pread`s
/// of the guest's requests, read as asked with no readahead past them (2.2 MB of disk chunks
/// served in each of those runs).
pub const READAHEAD: u32 = 4 << 10;

struct Served1 {
    name: &'static str,
    table: Arc<ChunkTable>,
    reader: Arc<ArtifactReader>,
}

/// The mount's open files, counted by the FUSE `open` and `release` (a `release` comes once
/// the last reference to an open file is gone: its last descriptor closed and its last
/// mapping unmapped, so a QEMU holds its files until it exits), and a wake-up of the idle
/// thread ([`idle_exit`]) when the count comes back to 0.
#[derive(Debug, Default)]
struct OpenFiles {
    /// Open files now; whether the mount was opened since the idle thread last found a
    /// clone without open files ("armed": only then does a count of 0 mean a clone left).
    state: Mutex<(usize, bool)>,
    changed: std::sync::Condvar,
}

impl OpenFiles {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn opened(&self) {
        let mut s = self.lock();
        s.0 += 1;
        s.1 = true;
    }

    fn released(&self) {
        let mut s = self.lock();
        s.0 = s.0.saturating_sub(1);
        if s.0 == 0 {
            self.changed.notify_all();
        }
    }

    /// Whether files were opened and every one is closed again.
    fn all_closed(&self) -> bool {
        let s = self.lock();
        s.1 && s.0 == 0
    }

    /// Forgets that files were opened (until the next open).
    fn disarm(&self) {
        self.lock().1 = false;
    }

    /// Waits `d`, or less if the last open file is closed meanwhile.
    fn wait(&self, d: Duration) {
        let s = self.lock();
        let _ = self.changed.wait_timeout(s, d);
    }
}

/// The FUSE file system of one snapshot: two read-only files.
struct LazyFs {
    open: Arc<OpenFiles>,
    files: [Served1; 2],
    rt: tokio::runtime::Handle,
    dir: PathBuf,
    seen: Arc<Mutex<HashSet<(u64, usize)>>>,
    log: Arc<Mutex<Option<std::fs::File>>>,
    /// Where the rest of each chunk a read fetched goes ([`push_pages`]).
    pages: std::sync::mpsc::Sender<Push>,
    /// Every read waits for the lease first.
    gate: LeaseGate,
}

/// Whether the server holds its lease ([`hold_snapshot`], taken in the background while the
/// mount is made). A lease that cannot be taken ends the process ([`lease_failed`]), so the
/// only other end is a lease task that is gone without one.
#[derive(Clone)]
struct LeaseGate(tokio::sync::watch::Receiver<bool>);

impl LeaseGate {
    /// Waits until the lease is held; an error when the lease task ended without it.
    async fn held(&self) -> Result<(), String> {
        let mut rx = self.0.clone();
        match rx.wait_for(|held| *held).await {
            Ok(_) => Ok(()),
            Err(_) => Err("the chunk server's lease was never taken".into()),
        }
    }
}

/// A lease that could not be taken: no read may be served, so the server records why
/// ([`FAILURE`]: the start of a clone that was reading names it) and exits with status 1;
/// the kernel then fails every read still waiting on the mount. Its watcher detaches the
/// mount and stops every clone that had begun to start from it ([`run_daemon`]), as when a
/// server dies.
fn lease_failed(dir: &Path, msg: &str) -> ! {
    tracing::error!("{msg}");
    eprintln!("kiln chunk server: {msg}");
    record_failure(dir, msg);
    std::process::exit(1);
}

/// Milliseconds since `t0`, for the server's debug log.
fn since(t0: std::time::Instant) -> u64 {
    t0.elapsed().as_millis() as u64
}

fn attr(ino: u64, size: u64) -> FileAttr {
    let dir = ino == ROOT;
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o555 } else { 0o444 },
        nlink: if dir { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl LazyFs {
    fn file(&self, ino: u64) -> Option<&Served1> {
        match ino {
            MEMORY_INO => Some(&self.files[0]),
            DISK_INO => Some(&self.files[1]),
            _ => None,
        }
    }
}

impl Filesystem for LazyFs {
    fn init(&mut self, _req: &Request, config: &mut fuser::KernelConfig) -> std::io::Result<()> {
        if let Err(nearest) = config.set_max_readahead(READAHEAD) {
            config
                .set_max_readahead(nearest)
                .map_err(|_| std::io::Error::other("FUSE max_readahead refused"))?;
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let ino = match name.to_str() {
            Some(MEMORY_FILE) if parent.0 == ROOT => MEMORY_INO,
            Some(DISK_FILE) if parent.0 == ROOT => DISK_INO,
            _ => return reply.error(Errno::ENOENT),
        };
        let size = self.file(ino).map_or(0, |f| f.table.size);
        reply.entry(&TTL, &attr(ino, size), Generation(0));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match (ino.0, self.file(ino.0)) {
            (ROOT, _) => reply.attr(&TTL, &attr(ROOT, 0)),
            (_, Some(f)) => reply.attr(&TTL, &attr(ino.0, f.table.size)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.file(ino.0).is_none() {
            return reply.error(Errno::ENOENT);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        self.open.opened();
        // Keep the page cache across opens: every clone of the snapshot shares it.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: fuser::ReplyEmpty,
    ) {
        self.open.released();
        reply.ok();
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(f) = self.file(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let (name, table, reader) = (f.name, f.table.clone(), f.reader.clone());
        // One line per FUSE read request: its size says what the kernel asked for around a
        // fault (a page, its readahead window, or a huge page's worth).
        tracing::debug!(file = name, offset, size, "read");
        let (seen, log, dir) = (self.seen.clone(), self.log.clone(), self.dir.clone());
        let (pages, gate) = (self.pages.clone(), self.gate.clone());
        let asked = std::time::Instant::now();
        self.rt.spawn(async move {
            if gate.held().await.is_err() {
                return reply.error(Errno::EIO);
            }
            let len = (size as u64).min(table.size.saturating_sub(offset)) as usize;
            // The whole chunks the request falls in: the rest of them goes to the page cache
            // once the request is answered.
            let (from, to) = chunk_span(&table, offset, len as u64);
            let mut buf = vec![0u8; (to - from) as usize];
            match reader.read_at(from, &mut buf).await {
                Ok(n) => {
                    // How long the reader (a faulting vCPU, a QEMU block request) waited.
                    tracing::debug!(
                        file = name,
                        offset,
                        us = asked.elapsed().as_micros() as u64,
                        "answered"
                    );
                    let a = (offset - from) as usize;
                    let b = (a + len).min(n).max(a);
                    note_chunks(name, ino.0, &table, offset, (b - a) as u64, &seen, &log);
                    reply.data(&buf[a..b]);
                    buf.truncate(n);
                    let buf = bytes::Bytes::from(buf);
                    if a > 0 {
                        let _ = pages.send((ino.0, from, buf.slice(..a)));
                    }
                    if b < n {
                        let _ = pages.send((ino.0, from + b as u64, buf.slice(b..)));
                    }
                }
                Err(e) => {
                    let msg = format!(
                        "reading {name} bytes {offset}..{}: {e}",
                        offset + len as u64
                    );
                    tracing::error!("{msg}");
                    eprintln!("kiln chunk server: {msg}");
                    record_failure(&dir, &msg);
                    reply.error(Errno::EIO);
                }
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino.0 != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (MEMORY_INO, FileType::RegularFile, MEMORY_FILE),
            (DISK_INO, FileType::RegularFile, DISK_FILE),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The largest span [`chunk_span`] widens a read to (256 KiB: four memory chunks).
const MAX_SPAN: u64 = 256 << 10;

/// The byte range of the chunks of `table` that `offset..offset+len` falls in, when it is at
/// most [`MAX_SPAN`] bytes; else `offset..offset+len`.
fn chunk_span(table: &ChunkTable, offset: u64, len: u64) -> (u64, u64) {
    let end = offset + len;
    let (Some(first), Some(last)) = (
        table.find(offset),
        table.find(end.saturating_sub(1).max(offset)),
    ) else {
        return (offset, end);
    };
    let from = table.entries[first].offset;
    let last = &table.entries[last];
    let to = (last.offset + last.raw_len).max(end);
    if to - from > MAX_SPAN {
        return (offset, end);
    }
    (from, to)
}

/// A piece of a served file for the kernel's page cache: inode, offset, bytes.
type Push = (u64, u64, bytes::Bytes);

/// Puts each piece `rx` brings into the kernel's page cache of the mount's files, in order
/// (`FUSE_NOTIFY_STORE`, fuse(4); pages it covers whole become up to date). A fault on a
/// page there is then answered by the kernel with no request to this server: a clone's
/// guest touches the pages of one 64 KiB memory chunk at different times, and each page
/// not cached was a FUSE request of its own (about 1,300 of them for about 390 chunks in a
/// cold busybox start, issue 35). On a thread of its own: a store waits for the lock of any
/// page a read in flight holds, and the runtime answers that read. The kernel takes stores
/// only for inodes it knows, so both files are looked up first (`mnt` is the mount; the
/// session answers once it runs). A store the kernel refuses is only logged: the page is
/// then read as before. Ends when every sender is gone.
fn push_pages(notifier: fuser::Notifier, mnt: PathBuf, rx: std::sync::mpsc::Receiver<Push>) {
    for f in [MEMORY_FILE, DISK_FILE] {
        let _ = std::fs::metadata(mnt.join(f));
    }
    for (ino, offset, data) in rx {
        if let Err(e) = notifier.store(INodeNo(ino), offset, &data) {
            tracing::debug!(ino, offset, len = data.len(), error = %e, "page cache store refused");
        }
    }
}

/// Appends the chunks of `offset..offset+len` not logged before to [`CHUNK_LOG`].
fn note_chunks(
    name: &str,
    ino: u64,
    table: &ChunkTable,
    offset: u64,
    len: u64,
    seen: &Mutex<HashSet<(u64, usize)>>,
    log: &Mutex<Option<std::fs::File>>,
) {
    let Some(mut i) = table.find(offset) else {
        return;
    };
    let mut lines = String::new();
    {
        let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(e) = table.entries.get(i) {
            if e.offset >= offset + len {
                break;
            }
            if let Some(d) = e.digest
                && seen.insert((ino, i))
            {
                lines.push_str(&format!("{name} {i} {d} {}\n", e.raw_len));
            }
            i += 1;
        }
    }
    if !lines.is_empty()
        && let Some(f) = log.lock().unwrap_or_else(|p| p.into_inner()).as_mut()
    {
        let _ = f.write_all(lines.as_bytes());
    }
}

/// Writes `msg` to `<dir>/failure` unless a failure is already recorded. The file appears
/// whole (written under a name of its own, then linked, which fails when one is there): two
/// reads failing at once each answer `EIO`, and the start that sees its clone die may read
/// the file before the first writer has written it (seen by `kiln/tests/vm_lazy.rs`: "the
/// chunk server refused a read: " with no reason).
fn record_failure(dir: &Path, msg: &str) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{FAILURE}.{}-{n}", std::process::id()));
    if std::fs::write(&tmp, msg.as_bytes()).is_ok() {
        let _ = std::fs::hard_link(&tmp, dir.join(FAILURE));
    }
    let _ = std::fs::remove_file(&tmp);
}

/// The server's recorded read failure, if any (names the chunk and the store).
pub fn failure(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(FAILURE)).ok()
}

// ---------------------------------------------------------------- the daemon

/// The body of `kiln __lazy-serve DIGEST DIR`: serves the snapshot `snapshot` at
/// `<dir>/mnt` (see the module doc). Must be called before any thread is started (it forks):
/// the calling process becomes the watcher, its child the server. `open_store` opens the
/// store in the server, on the runtime it is given. Returns the process's exit code: the
/// watcher's is 0 when the server exited on its own (idle), 1 otherwise; "ready" is printed
/// on stdout once the files are served, and nothing else.
pub fn run_daemon<F>(snapshot: ManifestDigest, dir: PathBuf, open_store: F) -> i32
where
    F: FnOnce(&tokio::runtime::Runtime) -> Result<Store, String>,
{
    let _ = std::fs::remove_file(dir.join(FAILURE));
    let _ = std::fs::remove_file(dir.join(PREFETCH_DONE));
    // SAFETY: fork(2) in a process that has started no thread yet (the caller's contract);
    // the child goes on to run ordinary Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        eprintln!(
            "kiln chunk server: fork: {}",
            std::io::Error::last_os_error()
        );
        return 1;
    }
    if pid == 0 {
        let code = match serve(&snapshot, &dir, open_store) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln chunk server for {snapshot}: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    watch(pid as u32, &snapshot, &dir)
}

/// Exit status text of a `waitpid` status.
fn describe(status: i32) -> String {
    if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("exited with code {}", libc::WEXITSTATUS(status))
    }
}

/// Waits for the child `child` to exit and returns its `waitpid` status, calling `tick`
/// every [`IDLE_INTERVAL`] until then (through a pidfd; on a kernel without `pidfd_open`,
/// Linux before 5.3, one blocking `waitpid` and no tick).
fn wait_child(child: u32, mut tick: impl FnMut()) -> i32 {
    // SAFETY: pidfd_open(2) of our own child; the fd is closed below.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, child as libc::pid_t, 0) } as i32;
    if pidfd >= 0 {
        loop {
            tick();
            let mut p = libc::pollfd {
                fd: pidfd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll(2) of one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, IDLE_INTERVAL.as_millis() as i32) };
            if r > 0
                || (r < 0
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
            {
                break;
            }
        }
        // SAFETY: closing the pidfd opened above.
        unsafe { libc::close(pidfd) };
    }
    let mut status = 0;
    loop {
        // SAFETY: waitpid(2) on our own child with a valid out pointer.
        let r = unsafe { libc::waitpid(child as libc::pid_t, &mut status, 0) };
        if r == child as libc::pid_t {
            return status;
        }
        if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return status;
        }
    }
}

fn watch(child: u32, snapshot: &ManifestDigest, dir: &Path) -> i32 {
    let rec = ServerRecord {
        server: ProcessId {
            pid: child,
            start_ticks: start_ticks(child).unwrap_or(0),
        },
        watcher: ProcessId::current(),
    };
    let path = dir.join(SERVER_RECORD);
    let tmp = dir.join(format!("{SERVER_RECORD}.tmp"));
    if let Ok(bytes) = serde_json::to_vec(&rec) {
        let _ = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &path));
    }
    let mnt = dir.join(MOUNT_DIR);
    // The clones this server serves, by their directories, looked up every
    // [`IDLE_INTERVAL`] while it runs: when it dies, a clone whose QEMU died with it (a
    // page it could no longer read) before this process woke is told why all the same.
    // Under load that came first: `vm_lazy`'s killed server once left its clone without a
    // `stopped` (a CI run at 3624448).
    let mut serving: HashSet<PathBuf> = HashSet::new();
    let status = wait_child(child, || {
        serving = crate::clone::qemus_in(&mnt)
            .into_iter()
            .filter_map(clone_dir_of)
            .collect();
    });
    let clean = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    if !clean {
        let reason = format!(
            "the chunk server of snapshot {snapshot} (pid {child}) {}, so the clone's memory \
             and disk could no longer be read",
            describe(status)
        );
        eprintln!("kiln chunk server watcher: {reason}");
        detach(&mnt);
        let qemus = crate::clone::qemus_in(&mnt);
        serving.extend(qemus.iter().filter_map(|pid| clone_dir_of(*pid)));
        // A clone removed meanwhile (`kiln rm`) has no directory left to tell.
        for cdir in serving.iter().filter(|d| d.is_dir()) {
            let _ = std::fs::write(cdir.join(STOPPED), &reason);
        }
        for pid in qemus {
            // SAFETY: kill(2) of a QEMU whose command line names this server's mount.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
    // Only our own record: a new server may already have replaced it.
    if let Ok(b) = std::fs::read(&path)
        && let Ok(r) = serde_json::from_slice::<ServerRecord>(&b)
        && r.server.pid == child
    {
        let _ = std::fs::remove_file(&path);
    }
    if clean { 0 } else { 1 }
}

/// A clone's directory from its QEMU's command line: `-qmp unix:<dir>/qmp.sock,...`, or for
/// a QEMU that runs as its own user the ` qmp=<dir>/qmp.sock` of its `-name`
/// ([`crate::jail`]).
fn clone_dir_of(pid: u32) -> Option<PathBuf> {
    let c = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    c.split(|b| *b == 0)
        .find_map(|a| qmp_dir_in(std::str::from_utf8(a).ok()?))
}

/// The directory of the QMP socket one QEMU argument names (see [`clone_dir_of`]).
fn qmp_dir_in(arg: &str) -> Option<PathBuf> {
    let s = match arg.strip_prefix("unix:") {
        Some(s) => s,
        None => &arg[arg.find(" qmp=")? + " qmp=".len()..],
    };
    let end = s.find("/qmp.sock")?;
    // `-name` doubles commas (QEMU's option syntax).
    Some(PathBuf::from(s[..end].replace(",,", ",")))
}

/// `umount2(path, MNT_DETACH)`, errors ignored (not mounted).
pub(crate) fn detach(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: umount2(2) with a NUL-terminated path that lives across the call.
    unsafe {
        libc::umount2(c.as_ptr(), libc::MNT_DETACH);
    }
}

/// Whether `path` is a mount point (listed in `/proc/self/mountinfo`, proc(5): field 5 is the
/// mount point, with spaces and backslashes escaped as octal).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.display().to_string();
    info.lines().any(|l| {
        l.split(' ').nth(4).is_some_and(|m| {
            m.replace("\\040", " ")
                .replace("\\011", "\t")
                .replace("\\134", "\\")
                == want
        })
    })
}

fn serve<F>(snapshot: &ManifestDigest, dir: &Path, open_store: F) -> Result<(), String>
where
    F: FnOnce(&tokio::runtime::Runtime) -> Result<Store, String>,
{
    let t0 = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let handed = handed_manifest(snapshot);
    let store = open_store(&rt)?;
    let manifest = match handed {
        Some(m) => m,
        None => rt
            .block_on(store.get_manifest(snapshot))
            .map_err(|e| e.to_string())?,
    };
    let snap = match manifest {
        Manifest::Snapshot(s) => s,
        Manifest::Image(_) => return Err(format!("{snapshot} is not a snapshot manifest")),
    };
    crate::clone::check_snapshot(&snap).map_err(|r| format!("snapshot {snapshot}: {r}"))?;
    tracing::debug!(ms = since(t0), "snapshot manifest read");
    let (pages, pages_rx) = std::sync::mpsc::channel::<Push>();
    if let Some(p) = &snap.prefetch
        && store.local_root().is_none()
    {
        // Begun before the lease is held, the mount made and "ready" said: the clone's
        // first faults wait for the prefetch's first batches, and the lease's requests
        // (a PUT, then a look under the sweep lock) are 3 round trips the prefetch need not
        // wait for. Nothing is served before the lease is held: the prefetch only fills the
        // read cache (every chunk verified by its digest, so one GC deletes meanwhile fails
        // and is skipped) and queues pages for the page cache, stored once the lease is held.
        // Measured (issue 35, the Debian fixture with 512 MiB, cold from the local S3 server,
        // 8 starts each way alternating, host loaded by a build): answered median 314 ms
        // against 384 ms with the prefetch begun after "ready".
        // Checked with the rest of the manifest (check_snapshot). In the fetch order, the
        // disk's chunks first (PrefetchList::fetch_order says why), which is also the order
        // `kiln snapshot` wrote them into a pack of their own (crate::snapshot, step 5): a
        // batch is then one span of that pack. Busybox (one disk chunk listed): 235 -> 274
        // ms with the disk first, five cold starts each from the local S3 server.
        let chunks: Vec<Listed> = p
            .fetch_order(&snap)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(disk, e)| {
                Some(Listed {
                    digest: e.digest?,
                    raw_len: e.raw_len,
                    ino: if disk { DISK_INO } else { MEMORY_INO },
                    offset: e.offset,
                })
            })
            .collect();
        rt.spawn(prefetch(
            store.clone(),
            chunks,
            pages.clone(),
            dir.to_path_buf(),
        ));
    }
    // Taken while the mount is made and the clone's QEMU starts: its requests (a PUT, then a
    // look under the sweep lock) are round trips no clone need wait for before its first
    // read, and nothing is served before it is held (LeaseGate).
    let held: Arc<std::sync::OnceLock<Lease>> = Arc::default();
    let gate = {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let (store, snapshot, snap) = (store.clone(), *snapshot, snap.clone());
        let (held, dir) = (held.clone(), dir.to_path_buf());
        rt.spawn(async move {
            let lease = match hold_snapshot(&store, &snapshot, &snap).await {
                Ok(l) => l,
                Err(e) => {
                    let msg = format!("leasing snapshot {snapshot} in {}: {e}", store.url());
                    lease_failed(&dir, &msg);
                }
            };
            tracing::debug!(ms = since(t0), "lease held");
            let lease = held.get_or_init(|| lease);
            let _ = tx.send(true);
            loop {
                tokio::time::sleep(LEASE_RENEW).await;
                if let Err(e) = lease.renew(LEASE_TTL).await {
                    tracing::warn!(error = %e, "renewing the chunk server's lease");
                    eprintln!("kiln chunk server: renewing its lease: {e}");
                }
            }
        });
        LeaseGate(rx)
    };
    let file = |name: &'static str, t: &ChunkTable| -> Result<Served1, String> {
        let table = Arc::new(t.clone());
        let reader = ArtifactReader::new(store.clone(), table.clone())
            .map_err(|e| format!("{name} of {snapshot}: {e}"))?
            .remembering_failures(FAILURE_MEMORY);
        Ok(Served1 {
            name,
            table,
            reader: Arc::new(reader),
        })
    };
    let log_path = dir.join(CHUNK_LOG);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    let open = Arc::new(OpenFiles::default());
    let fs = LazyFs {
        open: open.clone(),
        files: [file(MEMORY_FILE, &snap.memory)?, file("disk", &snap.disk)?],
        rt: rt.handle().clone(),
        dir: dir.to_path_buf(),
        seen: Arc::default(),
        log: Arc::new(Mutex::new(Some(log))),
        pages: pages.clone(),
        gate: gate.clone(),
    };
    let mnt = dir.join(MOUNT_DIR);
    std::fs::create_dir_all(&mnt).map_err(|e| format!("{}: {e}", mnt.display()))?;
    let mut config = fuser::Config::default();
    // QEMU runs as a user of its own (crate::jail), not as the mounter: `allow_other` lets
    // other users in, and `default_permissions` has the kernel check the files' modes
    // (0444: read only, for everyone who is handed them). The mounter is root, so no
    // `user_allow_other` in /etc/fuse.conf is needed (fuse(8)). Nobody reaches the files by
    // path but root: the snapshot's cache directory is 0700 (ensure_server); QEMU gets them
    // as descriptors.
    config.acl = fuser::SessionACL::All;
    config.mount_options = vec![
        MountOption::FSName(format!("kiln-{}", &snapshot.hex()[..12])),
        MountOption::Subtype("kiln".into()),
        MountOption::RO,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
        MountOption::DefaultPermissions,
    ];
    let mut session = fuser::Session::new(fs, &mnt, &config)
        .map_err(|e| format!("mount {}: {e}", mnt.display()))?;
    let unmounter = session.unmount_callable();
    {
        let (notifier, mnt, rt) = (session.notifier(), mnt.clone(), rt.handle().clone());
        let gate = gate.clone();
        std::thread::spawn(move || {
            // Nothing reaches the page cache before the lease is held.
            if rt.block_on(gate.held()).is_ok() {
                push_pages(notifier, mnt, pages_rx)
            }
        });
    }
    tracing::debug!(ms = since(t0), "mounted");
    {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"ready\n");
        let _ = out.flush();
    }
    // Nothing more goes to stdout: whoever read "ready" may be gone.
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2(2) of two descriptors this process owns.
        unsafe {
            libc::dup2(null.as_raw_fd(), 1);
        }
    }
    let use_lock = dir.join(USE_LOCK);
    std::thread::spawn(move || idle_exit(&use_lock, &mnt, &open, unmounter));
    let served = session
        .run()
        .map_err(|e| format!("serving {}: {e}", dir.display()));
    // No clone is left: the snapshot need not be kept any more. A lease still being taken
    // (a server nobody used, left at once) is waited for, so as to release it: bounded by
    // the store's operation timeout, and a lease that fails ends the process (lease_failed).
    let _ = rt.block_on(gate.held());
    if let Some(lease) = held.get()
        && let Err(e) = rt.block_on(lease.release())
    {
        eprintln!("kiln chunk server: releasing its lease: {e}");
    }
    served?;
    // Keep the use lock (held by the idle thread) until the process exits.
    std::process::exit(0);
}

/// The snapshot manifest the starter handed over on standard input ([`ensure_server`]):
/// [`manifest_from`] of it, or `None` when it is a terminal.
fn handed_manifest(digest: &ManifestDigest) -> Option<Manifest> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return None;
    }
    manifest_from(stdin.lock(), digest)
}

/// The manifest in `r` (read to its end, at most [`kiln_store::manifest::MAX_MANIFEST_LEN`]
/// bytes) when those bytes are the manifest `digest` names (their sha256) and parse; else
/// `None`, and the server reads it from the store: nothing handed over (a server started by
/// hand), or other bytes (a starter's bug, logged as a warning).
fn manifest_from(r: impl std::io::Read, digest: &ManifestDigest) -> Option<Manifest> {
    use std::io::Read;
    let mut bytes = Vec::new();
    let limit = kiln_store::manifest::MAX_MANIFEST_LEN as u64;
    r.take(limit + 1).read_to_end(&mut bytes).ok()?;
    if bytes.is_empty() {
        return None;
    }
    let raw = RawManifest::new(bytes.into());
    match (raw.digest == *digest, raw.parse()) {
        (true, Ok(m)) => Some(m),
        (same, parsed) => {
            tracing::warn!(
                digest_matches = same,
                parses = parsed.is_ok(),
                "the snapshot manifest handed over is not {digest}; reading it from the store"
            );
            None
        }
    }
}

/// A chunk of the prefetch list: its digest and raw length, and where it is served (inode,
/// byte offset).
#[derive(Debug, Clone, Copy)]
struct Listed {
    digest: kiln_store::ChunkDigest,
    raw_len: u64,
    ino: u64,
    offset: u64,
}

/// Fetches `chunks` into the store's read cache in batches of
/// [`kiln_store::artifact::READ_BATCH`] in list order, each with one
/// [`Store::get_chunks`] (on S3 a few ranged GETs of the packs holding them, instead of a
/// GET per chunk), [`PREFETCH_BATCHES`] batches at a time, puts each batch's chunks into
/// the page cache of the files they are served in ([`push_pages`], through `pages`), then
/// writes [`PREFETCH_DONE`] in `dir`. A chunk that fails is skipped (its first error goes to
/// the server's log): the clone's own read of it will fail and be named.
async fn prefetch(
    store: Store,
    chunks: Vec<Listed>,
    pages: std::sync::mpsc::Sender<Push>,
    dir: PathBuf,
) {
    let t0 = std::time::Instant::now();
    let slots = Arc::new(tokio::sync::Semaphore::new(PREFETCH_BATCHES));
    let mut set = tokio::task::JoinSet::new();
    for (batch, group) in chunks.chunks(kiln_store::artifact::READ_BATCH).enumerate() {
        let (store, slots, group) = (store.clone(), slots.clone(), group.to_vec());
        let pages = pages.clone();
        set.spawn(async move {
            let _slot = slots.acquire_owned().await;
            let asked: Vec<(kiln_store::ChunkDigest, u64)> =
                group.iter().map(|c| (c.digest, c.raw_len)).collect();
            let got = store
                .get_chunks(&asked)
                .await
                .into_iter()
                .zip(&group)
                .map(|(r, c)| {
                    let raw = r.map_err(|e| e.to_string())?;
                    // A length other than the table's is the reader's to refuse, by name.
                    if raw.len() as u64 == c.raw_len {
                        let _ = pages.send((c.ino, c.offset, raw.clone()));
                    }
                    Ok(raw.len() as u64)
                })
                .collect::<Vec<Result<u64, String>>>();
            let ms = t0.elapsed().as_millis() as u64;
            tracing::debug!(batch, chunks = group.len(), ms, "prefetch batch fetched");
            got
        });
    }
    drop(pages);
    let (mut fetched, mut failed, mut bytes) = (0u64, 0u64, 0u64);
    while let Some(r) = set.join_next().await {
        let Ok(results) = r else {
            failed += 1;
            continue;
        };
        for r in results {
            match r {
                Ok(n) => {
                    fetched += 1;
                    bytes += n;
                }
                Err(e) => {
                    if failed == 0 {
                        eprintln!("kiln chunk server: prefetch: {e}");
                    }
                    failed += 1;
                }
            }
        }
    }
    let ms = t0.elapsed().as_millis();
    tracing::info!(fetched, failed, bytes, ms, "prefetch done");
    let _ = std::fs::write(
        dir.join(PREFETCH_DONE),
        format!("{fetched} {failed} {bytes} {ms}\n"),
    );
}

/// Everything a clone of `snap` may read from the store: the snapshot manifest and all it
/// names ([`references`]: the image manifest, the vmstate, kernel and initramfs blobs, every
/// memory and disk chunk).
pub fn snapshot_objects(digest: &ManifestDigest, snap: &SnapshotManifest) -> Vec<ObjectRef> {
    let mut objs = vec![ObjectRef::Manifest(*digest)];
    objs.extend(references(&Manifest::Snapshot(snap.clone())));
    objs
}

/// Leases [`snapshot_objects`] for this process ([`LEASE_TTL`]), then checks, under the
/// store's sweep lock, that the snapshot manifest is still there (a GC between the manifest's
/// read and the lease may have taken it; then the lease is released and this is an error).
/// Errors are the store's, as text.
async fn hold_snapshot(
    store: &Store,
    digest: &ManifestDigest,
    snap: &SnapshotManifest,
) -> Result<Lease, String> {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let id = format!(
        "lazy-{}-{}-{nanos}",
        &digest.hex()[..16],
        std::process::id()
    );
    let lease = store
        .create_lease(&id, LEASE_TTL, snapshot_objects(digest, snap))
        .await
        .map_err(|e| e.to_string())?;
    let m = ObjectRef::Manifest(*digest);
    let present = lease.find_present(&[m]).await.map_err(|e| e.to_string())?;
    if present.contains(&m) {
        return Ok(lease);
    }
    lease.release().await.map_err(|e| e.to_string())?;
    Err(format!("snapshot {digest} was deleted from the store"))
}

/// Unmounts once no start holds the use lock and no QEMU names the mount, and either the
/// mount's files were opened and are all closed again (the last clone left: asked for at
/// once, then every [`CLOSED_POLL`] while a start holds the lock) or no QEMU has named the
/// mount for [`IDLE_CHECKS`] checks in a row, [`IDLE_INTERVAL`] apart (a server nobody
/// opened, or whose files stay open without a QEMU naming the mount). Keeps that lock
/// (exclusive) until the process exits.
fn idle_exit(
    use_lock: &Path,
    mnt: &Path,
    open: &OpenFiles,
    mut unmounter: fuser::SessionUnmounter,
) {
    let mut idle = 0;
    loop {
        open.wait(if open.all_closed() {
            CLOSED_POLL
        } else {
            IDLE_INTERVAL
        });
        let closed = open.all_closed();
        if !closed {
            if !crate::clone::qemus_in(mnt).is_empty() {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_CHECKS {
                continue;
            }
        }
        let Ok(f) = open_lock(use_lock) else {
            continue;
        };
        // SAFETY: flock(2) on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            continue;
        }
        if !crate::clone::qemus_in(mnt).is_empty() {
            // A QEMU names the mount with none of its files open (one starting, or one on
            // its way out): back to the checks a second apart until files are opened again.
            open.disarm();
            idle = 0;
            continue;
        }
        let _ = unmounter.unmount();
        // The lock goes with the process.
        std::mem::forget(f);
        return;
    }
}

fn open_lock(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
}

/// Takes `flock(op)` on `path` on a blocking thread; the lock lasts as long as the file.
async fn flock(path: &Path, op: i32) -> Result<std::fs::File, LazyError> {
    let p = path.to_path_buf();
    let f = open_lock(&p).map_err(io_err(&p))?;
    tokio::task::spawn_blocking(move || {
        // SAFETY: flock(2) on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), op) } != 0 {
            return Err(io_err(&p)(std::io::Error::last_os_error()));
        }
        Ok(f)
    })
    .await
    .map_err(|e| LazyError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?
}

/// The live server of `dir`, if any: its record names a running server and its mount is
/// there.
pub fn server_of(dir: &Path) -> Option<ServerRecord> {
    let b = std::fs::read(dir.join(SERVER_RECORD)).ok()?;
    let r: ServerRecord = serde_json::from_slice(&b).ok()?;
    (r.server.is_alive() && is_mounted(&dir.join(MOUNT_DIR))).then_some(r)
}

/// Makes sure the chunk server of the snapshot manifest `manifest` (its bytes as stored,
/// read and checked by the caller) runs for `dir` (`<cache>/<snapshot hex>`), starting
/// `program` (its arguments then `DIGEST DIR` appended) when none does, with the manifest's
/// bytes on its standard input ([`run_daemon`] takes them when their digest is `DIGEST`:
/// one read of the store less before it mounts), and waits up to `timeout` for it to say
/// "ready". Returns the files to start clones from, holding the use lock (see the module
/// doc).
///
/// Errors: [`LazyError::Start`] with the server's log when it exits or stays silent.
pub async fn ensure_server(
    program: &[OsString],
    manifest: &RawManifest,
    dir: &Path,
    timeout: Duration,
) -> Result<Served, LazyError> {
    let snapshot = &manifest.digest;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    {
        // Its mount is open to other users (allow_other): only root walks to it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(dir))?;
    }
    let use_lock = flock(&dir.join(USE_LOCK), libc::LOCK_SH).await?;
    let _spawn = flock(&dir.join("lazy.lock"), libc::LOCK_EX).await?;
    let mnt = dir.join(MOUNT_DIR);
    let served = Served {
        memory: mnt.join(MEMORY_FILE),
        disk: mnt.join(DISK_FILE),
        dir: dir.to_path_buf(),
        _use: use_lock,
    };
    if server_of(dir).is_some() {
        return Ok(served);
    }
    // A server that died: its watcher detaches the mount and removes the record; wait for
    // it (bounded), then clear what may be left.
    for _ in 0..200 {
        match std::fs::read(dir.join(SERVER_RECORD))
            .ok()
            .and_then(|b| serde_json::from_slice::<ServerRecord>(&b).ok())
        {
            Some(r) if r.watcher.is_alive() => tokio::time::sleep(Duration::from_millis(25)).await,
            _ => break,
        }
    }
    detach(&mnt);
    let _ = std::fs::remove_file(dir.join(SERVER_RECORD));
    std::fs::create_dir_all(&mnt).map_err(io_err(&mnt))?;
    let (Some(prog), args) = (program.first(), program.get(1..).unwrap_or_default()) else {
        return Err(LazyError::Start {
            dir: dir.to_path_buf(),
            reason: "no chunk server program given".into(),
        });
    };
    let log_path = dir.join(SERVER_LOG);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io_err(&log_path))?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let mut child = tokio::process::Command::new(prog)
        .args(args)
        .arg(snapshot.to_string())
        .arg(dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        // Its own process group: a Ctrl-C of the `kiln start` that spawned it does not
        // reach the clones' server.
        .process_group(0)
        .kill_on_drop(false)
        .spawn()
        .map_err(io_err(Path::new(prog)))?;
    let stdout = child.stdout.take();
    if let Some(mut stdin) = child.stdin.take() {
        // Written beside the wait for "ready" (a manifest is larger than a pipe's buffer);
        // a server that stops reading has failed, which the wait tells.
        let bytes = manifest.bytes.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let _ = stdin.write_all(&bytes).await;
        });
    }
    let wait_ready = async {
        use tokio::io::AsyncBufReadExt;
        let Some(out) = stdout else {
            return false;
        };
        let mut lines = tokio::io::BufReader::new(out).lines();
        matches!(lines.next_line().await, Ok(Some(l)) if l == "ready")
    };
    let ready = tokio::time::timeout(timeout, wait_ready)
        .await
        .unwrap_or(false);
    // Reaped in the background (the watcher runs on until its server ends).
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    if !ready {
        let text = std::fs::read(&log_path).unwrap_or_default();
        let tail = String::from_utf8_lossy(text.get(log_start as usize..).unwrap_or_default())
            .trim()
            .to_string();
        return Err(LazyError::Start {
            dir: dir.to_path_buf(),
            reason: if tail.is_empty() {
                format!("no \"ready\" within {timeout:?}")
            } else {
                tail
            },
        });
    }
    Ok(served)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_store::{ChunkDigest, ChunkEntry, Chunking};

    /// The chunk log is what tells which chunks a clone needed: each chunk a read covers is
    /// logged once, holes (zero chunks, never fetched) never.
    #[test]
    fn chunk_log_names_each_served_chunk_once_and_skips_holes() {
        let d = ChunkDigest::of(b"a");
        let e = |offset, digest| ChunkEntry {
            offset,
            raw_len: 100,
            digest,
            stored_len: 10,
        };
        let table = ChunkTable {
            size: 300,
            chunking: Chunking::MEMORY_DEFAULT,
            entries: vec![e(0, Some(d)), e(100, None), e(200, Some(d))],
        };
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(CHUNK_LOG);
        let log = Mutex::new(Some(std::fs::File::create(&path).unwrap()));
        let seen = Mutex::default();
        note_chunks("memory", MEMORY_INO, &table, 50, 200, &seen, &log);
        note_chunks("memory", MEMORY_INO, &table, 0, 300, &seen, &log);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, format!("memory 0 {d} 100\nmemory 2 {d} 100\n"));
    }

    /// A read is widened to the whole chunks it falls in (their rest goes to the page
    /// cache), unless they are longer than MAX_SPAN together; at the end nothing is widened.
    #[test]
    fn a_read_widens_to_its_chunks_up_to_the_span_bound() {
        let chunk = 64 << 10;
        let e = |offset, raw_len| ChunkEntry {
            offset,
            raw_len,
            digest: Some(ChunkDigest::of(b"a")),
            stored_len: 10,
        };
        let table = ChunkTable {
            size: 3 * chunk + MAX_SPAN + 4096,
            chunking: Chunking::MEMORY_DEFAULT,
            entries: vec![
                e(0, chunk),
                e(chunk, chunk),
                e(2 * chunk, chunk),
                e(3 * chunk, MAX_SPAN + 4096),
            ],
        };
        // One page in the second chunk: that chunk.
        assert_eq!(chunk_span(&table, chunk + 4096, 4096), (chunk, 2 * chunk));
        // A read across the first two chunks: both.
        assert_eq!(chunk_span(&table, chunk - 4096, 8192), (0, 2 * chunk));
        // A chunk over the bound: the read as asked.
        let off = 3 * chunk + 8192;
        assert_eq!(chunk_span(&table, off, 4096), (off, off + 4096));
        // At the end of the file: nothing to widen.
        assert_eq!(chunk_span(&table, table.size, 0), (table.size, table.size));
    }

    /// A manifest handed over is taken only when its bytes are the digest's and parse.
    #[test]
    fn a_handed_manifest_is_taken_only_with_its_digest() {
        let snap = crate::clone::test_snapshot(256 << 20, 256 << 20, 1);
        let raw = RawManifest::encode(&Manifest::Snapshot(snap.clone())).unwrap();
        let taken = manifest_from(&raw.bytes[..], &raw.digest);
        assert!(matches!(taken, Some(Manifest::Snapshot(s)) if s == snap));
        // Nothing handed over, or bytes of another digest: read from the store.
        assert!(manifest_from(&b""[..], &raw.digest).is_none());
        let other = ManifestDigest::of(b"other");
        assert!(manifest_from(&raw.bytes[..], &other).is_none());
        // The right digest of bytes that are no manifest.
        let junk = b"not json";
        assert!(manifest_from(&junk[..], &ManifestDigest::of(junk)).is_none());
    }

    /// The first failure is kept, whole, and nothing else is left in the directory.
    #[test]
    fn first_failure_is_kept_whole() {
        let tmp = tempfile::tempdir().unwrap();
        record_failure(tmp.path(), "reading memory: chunk a");
        record_failure(tmp.path(), "reading disk: chunk b");
        assert_eq!(
            failure(tmp.path()).as_deref(),
            Some("reading memory: chunk a")
        );
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [FAILURE]);
    }

    #[test]
    fn clone_dir_from_either_form_of_the_qmp_argument() {
        assert_eq!(
            qmp_dir_in("unix:/s/clones/ab/qmp.sock,server=on,wait=off"),
            Some("/s/clones/ab".into())
        );
        assert_eq!(
            qmp_dir_in("guest=kiln qmp=/s/c,,d/ab/qmp.sock channel=/s/c,,d/ab/guest.sock"),
            Some("/s/c,d/ab".into())
        );
        assert_eq!(qmp_dir_in("guest=kiln disk=/s/disk.qcow2"), None);
        assert_eq!(qmp_dir_in("-nodefaults"), None);
    }

    #[test]
    fn only_mount_points_are_mounted() {
        assert!(is_mounted(Path::new("/proc")));
        let tmp = tempfile::tempdir().unwrap();
        assert!(!is_mounted(tmp.path()));
    }
}
