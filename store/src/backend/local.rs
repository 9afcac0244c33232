//! The local-directory backend: one file per key under a root directory, except the chunks
//! of an upload or a copy between stores, which share a pack file (see "Packs" below).
//!
//! Writes go to `<root>/.tmp/<unique>`, are fsynced (and, when the caller gives the expected
//! sha256, hashed and checked), then published: `put_if_absent` with `link(2)` (fails on an
//! existing name, so concurrent writers of one key are safe and the loser sees
//! `AlreadyExists`), `put` and `compare_and_swap` with `rename(2)` (atomic replace). The parent
//! directory is fsynced after publishing. A crash leaves at most a stray file in `.tmp`.
//!
//! ## Packs: an upload's chunks in one file, durable with one fsync
//! Keys of the form `chunks/sha256/<64 lowercase hex>` may be *packed*; every other key
//! (blobs, manifests, tags, fossils, a test's `chunks/sha256/aa`) is one file as above.
//! Before (issue 33), each 64 KiB chunk was a file of its own (`.tmp/<unique>`, then a
//! `link(2)` to its key at the commit, one `syncfs` per batch): `perf` of a 512 MiB
//! `kiln store import` put about 30% of CPU in the kernel creating those files (11% lock
//! contention on `.tmp`, 18% ext4 inode allocation), and a cold build of a small image made
//! 1,466 chunk files.
//!
//! **Layout.** Under `<root>/.packs/` (dot-named: no listing of objects walks it), for each
//! committed batch `<name>` = `<writer>-<n>-<nanos>` ([`tmp_owner`] names the writer):
//! - `<name>.pack`: the chunks' stored bytes (each exactly what a loose chunk file holds:
//!   one zstd frame), concatenated;
//! - `<name>.idx`: immutable, written at the commit: `KILNPIDX`, a version, the entry count,
//!   the entries sorted by digest (sha256 of the chunk, offset u64, stored length u64), then
//!   the sha256 of all that. A torn, altered or planted index (bad checksum, entries out of
//!   order, bytes past its pack's end) is refused: logged, named by
//!   [`Backend::layout_report`] and so by `kiln store verify` (`corruptStoreFile`), and its
//!   chunks are not served (they read as absent, so verify also reports the manifests'
//!   chunks missing, and the next upload of them writes them again). Refusing the one index
//!   rather than the whole store keeps every other image readable;
//! - `<name>.dead`: the digests of its deleted chunks, appended (32 bytes each, fsynced)
//!   under the packs lock. Made empty at the commit, so that its size is a deletion counter:
//!   it only grows.
//!
//! The format is the backend's, not the local file system's: the S3 backend uses it too
//! (packs as objects, read by ranged GETs: [`super::s3`], "Packs"); the encoder and decoder
//! are one module, [`super::pack`].
//!
//! **Staging.** [`Backend::stage_batch`] gives an upload its batch ([`PackBatch`]): a temp
//! pack `.tmp/<name>.pack`, made at its first chunk. An upload stages a group of chunks at a
//! time with one [`Backend::stage_many_if_absent`], one blocking call that writes them in the
//! order given, so that an upload's pack holds its chunks in input order. Each staged chunk
//! reserves its range with one atomic add and is written there with `pwrite(2)`, so stagers
//! of one batch at once (a copy's read batches) never wait on each other; nothing is
//! fsynced yet. A chunk already present (packed or loose) is not written ([`Staged::Done`]).
//!
//! **Commit** ([`Backend::commit_staged`]), in this order:
//! 1. fsync of the temp pack (one fsync for the whole batch, instead of a `syncfs`);
//! 2. fsync of `chunks/sha256/`, when it exists (see the power-loss argument);
//! 3. the exclusive `flock(2)` of `.locks/#packs` (released by the kernel if the process
//!    dies), then a rescan of `.packs`: every index committed by any process before;
//! 4. every staged chunk now present (packed, or a loose file another writer linked) is
//!    dropped from the batch: [`PutOutcome::AlreadyExists`], its bytes left in this pack as
//!    dead weight (counted in [`LayoutReport::dead_bytes`]); when none is left, the temp
//!    pack is removed and nothing is published;
//! 5. the index written to `.tmp/<name>.idx` and fsynced; `.packs/<name>.dead` made empty;
//! 6. `rename(2)` of the pack into `.packs/`, fsync of `.packs/`, then `rename(2)` of the
//!    index, fsync of `.packs/` again (the first fsync so that no file system, journal or
//!    not, can keep the index's name after a power loss and lose the pack's);
//! 7. the lock released. Only then does `put_artifact` return its table, and only then does
//!    its caller write the manifest (fsynced, linked, its directory fsynced), and the tag
//!    after the manifest (compare-and-swap: fsynced, renamed, directory fsynced).
//!
//! **The promise.**
//! - *After a `kill -9` at any point*, `kiln store verify` is clean and no tag names missing
//!   data. A packed chunk is visible only through an index, and an index appears (one
//!   rename) only after the pack it names is complete and under its final name. A kill
//!   before step 6 leaves a temp pack (and maybe a temp index) in `.tmp`; between the two
//!   renames, a pack and an empty dead file in `.packs` with no index: both invisible to every
//!   read, listing, verify and GC, both named by their writer, and removed by the next
//!   open of the store once that writer is gone (the same rule as the temp files). The
//!   manifest is written only after the commit returned, the tag only after the manifest,
//!   so any tag names a manifest and chunks that exist.
//! - *After a power loss*, a tag never names a manifest whose chunks were not synced, and
//!   no index names bytes that were not synced. The pack's data is on stable storage when
//!   step 1 returns, the index's when step 5 does, and both names when step 6's fsync of
//!   `.packs/` does, before the commit returns and so before the manifest is written. Chunks
//!   the upload found present rather than wrote: a packed one's index was renamed by a
//!   committer that held the lock until it had fsynced `.packs/`, and this commit takes the
//!   lock (step 3) after its look-ups, so that index is durable before this commit returns;
//!   a loose one was linked after its data's fsync (by `put_if_absent`, or by the per-file
//!   commit after its `syncfs`), and step 2 makes its directory entry durable even if its
//!   writer has not fsynced the directory yet. A power loss before the commit returns loses
//!   at most this batch, which no manifest names yet.
//!
//! The fsync of the pack replaces the `syncfs` of the store's file system: it costs what this
//! batch wrote, not what every other process left dirty. A batch that holds no packed chunk
//! (a backend handle's batch without a pack, or keys the packs do not take) is committed as
//! before: each object its own `.tmp` file, one `syncfs`, then a `link(2)` of each, and
//! their directories fsynced.
//!
//! **Reads.** The backend keeps a map digest → (pack, offset, length, index mtime), loaded
//! from every index (minus its dead entries) at the first look-up. A hit is checked against
//! its pack's dead file (one `lstat`: its size changed only if a chunk was deleted, by any
//! process) and of `.packs` (the no-symlink rule). A miss compares `.packs`'s inode, mtime and
//! ctime with the last scan (one `lstat`) and rescans when they changed, so a process sees
//! the packs others committed; since those timestamps come from a coarse clock, a change in
//! the same tick as the last one seen would not show, so for 100 ms after the last change
//! seen every miss rescans. `get`, `get_range` (clipped to the entry) and `head` (size: the
//! stored length; modified: the index's mtime, which GC's grace period uses) read the pack;
//! on a miss, the loose file as before, so **stores written before packs keep working
//! unchanged** (no migration). Open pack files are cached (at most 64). A pack deleted under
//! a reader: rescan and retry once, then the loose file, then `NotFound`.
//!
//! **Other writes.** A copy between stores (`kiln store pull`, a push to a local store:
//! [`crate::copy`]) stages its chunks into one batch as an upload does, so it makes one pack.
//! `put_if_absent` and `put_file_if_absent` of a packed chunk report `AlreadyExists`;
//! otherwise they write a loose file as before. `put`
//! of a chunk key writes a loose file and then deletes a packed entry (an overwrite). A chunk
//! both loose and packed (two racing writers) is harmless: reads take the pack, a listing
//! shows it once (with the later mtime), `delete` and `rename` remove both.
//!
//! **GC.** A listing whose prefix covers `chunks/sha256/` lists loose and live packed
//! chunks. `delete` of a packed chunk appends its digest to its pack's dead file (under the
//! lock, fsynced; on a view refreshed under the lock, and in every pack that holds it, see
//! "Duplicates"); when every entry of a pack is dead, the pack is *retired*: its index
//! removed, `.packs` fsynced, then its pack and dead file removed and `.packs` fsynced again
//! (a pack without an index is invisible, and reaped if a crash stops the removal; the
//! fsync between keeps a power loss from undoing the index's removal but not the pack's).
//! `rename` of a packed chunk (GC's condemn step) writes the bytes as a loose file at the
//! destination (tmp, fsync, rename, directory fsync), then deletes the packed entry: an
//! interruption leaves both keys, never neither, as [`Backend::rename`] promises. The
//! put-back (`fossil/…` → the chunk key) makes a loose chunk.
//!
//! **Compaction** ([`Backend::compact`], run by [`crate::Store::gc`] after its deletes,
//! under the GC lock). A pack's *dead bytes* are the bytes no serving entry names: deleted
//! chunks, chunks a batch wrote that another writer had published first, and copies of
//! chunks another pack serves. Without compaction a pack would live as long as one of its
//! chunks does: a nightly image's pack holds its new chunks, the next nights reuse most of
//! them, and when the old image is collected its pack keeps its dead bytes forever. A pack
//! whose dead bytes are at least half its bytes ([`local_pack::COMPACT_DEAD_SHARE`], which
//! says why half: the packs never take more than twice their live bytes, and a compaction
//! copies at most what it frees) is compacted:
//! 1. *Plan*, on a rescanned view: the entries the pack serves, in pack order.
//! 2. *Copy*, outside the lock (commits and deletes go on): each entry read from the old
//!    pack and written to a new temp pack `.tmp/<name>.pack` (`<name>` of the compacting
//!    process) through one buffer of at most 1 MiB, never the whole pack in memory; then
//!    fsynced.
//! 3. *Commit*, under the packs lock, exactly as an upload's batch (steps 3 to 6 above):
//!    rescan; the entries the old pack serves *now* are checked against those copied (one
//!    it serves now but did not at the plan, its other copy gone since, makes the
//!    compaction of this pack give up: the old pack stays, whole); those deleted meanwhile
//!    are left out of the new index; the index written to `.tmp/<name>.idx` with **the old
//!    index's mtime** (so no chunk's `modified`, which GC's grace period reads, changes) and
//!    fsynced; `.packs/<name>.dead` made empty; the pack renamed in, `.packs` fsynced, the
//!    index renamed in, `.packs` fsynced.
//! 4. *Retire* the old pack, still under the lock, as an all-dead pack is (index, fsync,
//!    pack and dead file, fsync). When no entry was left to copy, this is the only step.
//!
//! Before the compaction, under the lock, every pack or dead file in `.packs` without an
//! index is removed: under the lock no commit is between its two renames and no retirement
//! between its removals, so such a file is a crash's leftover (the open of a store reaps
//! them only once the writer named in them is gone, which for a retired pack is the
//! uploader, not the crashed compactor).
//!
//! *Why no live chunk is ever absent.* The new index is renamed in (step 3) before the old
//! one is removed (step 4), and between the two every key the old pack served is served
//! by both. Deletes take the lock, so none falls between step 3's check and step 4; one
//! before step 3 is seen by its rescan (the chunk is left out), one after reaches the new
//! pack (a delete refreshes its view under the lock). So at every instant the set of keys
//! is the one deletes and commits made, whatever compaction does: a reader, a writer that
//! found a chunk present ([`PutOutcome::AlreadyExists`], [`Staged::Done`]), GC's listing and
//! marks, and leases see the same keys, with the same bytes, sizes and `modified` times.
//! Compaction only changes where the bytes are. A reader of another process that still
//! holds the old location finds the old pack's dead file or index gone at its next
//! look-up, or the pack file gone at its read (`NotFound`: it rescans and retries once,
//! "Reads"); one with the old pack file still open reads the old bytes, which are the same.
//! A commit that rescans under the lock after step 3 finds the chunks present in the new
//! pack, as before in the old one.
//!
//! *Kill -9* at each point: during the copy, a temp pack in `.tmp` (reaped at the next open
//! once its writer is gone); between the pack's rename and the index's, an index-less pack
//! in `.packs` (invisible; reaped at open, or by the next compaction); between the new
//! index's rename and the old index's removal, every live chunk in two indexed packs:
//! harmless (see "Duplicates"; verify is clean and counts the old copies as dead bytes),
//! and the next compaction finds the old pack wholly dead and retires it without copying;
//! after the old index's removal, its pack and dead file without an index (invisible;
//! removed by the next compaction). *Power loss:* the new pack's data is durable before
//! its index is written, the index's before its rename, and both names (two fsyncs of
//! `.packs`) before anything of the old pack is removed; the old index's removal is
//! durable before its pack's. So after a power loss the store is in one of the states
//! above, each verify-clean with every live chunk readable.
//!
//! **Duplicates.** A chunk may be held by two packs (a compaction killed between its steps
//! 3 and 4). Reads take one: the *serving* pack, the smaller (then the lower name), a rule
//! of the packs alone, so every process agrees and a compacted pack (smaller than the pack
//! it came from) serves. The other copies count as dead bytes ([`LayoutReport::dead_bytes`],
//! so for compaction). When the serving pack's entry dies or the pack goes, the chunk is
//! served from the next pack that holds it, in every process's view; a delete marks every
//! copy dead.
//!
//! Memory: about 150 bytes per packed chunk for the map and the per-pack entry lists (150 MB
//! for a million chunks, 64 GB of 64 KiB chunks).
//!
//! Compare-and-swap holds an exclusive `flock(2)` on `<root>/.locks/<key with / as %>` (or
//! `#<sha256 hex of the key>` when that is longer than a file name may be) while
//! it reads the current version and renames; the OS drops the lock if the process dies, so a
//! crash never leaves a tag locked. A version is `<inode>-<ctime ns>-<size>` of the file: every
//! rename creates a new inode, so a rewrite with identical bytes still changes the version.
//!
//! Symlinks inside the root are never followed: before any operation, every existing directory
//! between the root and the key is checked with `lstat` (`.tmp` too before a write goes there,
//! `.locks` before a compare-and-swap takes its lock; a commit of staged chunks checks each
//! of their directories once), and objects are opened with `O_NOFOLLOW`, so a symlink planted
//! in the store (say `tags/n -> /etc`) gives a [`BackendError::Other`] instead of a read or
//! write outside the root. (The root itself may be a symlink: that is the owner's choice.)
//! `.packs` is checked with `lstat` at every look-up of a packed chunk and before every
//! commit, and pack, index and dead files are opened with `O_NOFOLLOW`: a symlink planted at
//! `.packs` fails every chunk read, write, listing and commit.
//! Staging a group of chunks into a pack costs, once, two `lstat`s for their directories and
//! one for `.tmp`, then for each chunk one `lstat` for `.packs` (the look-up), one for its
//! loose name, and one `pwrite`; it makes no file
//! (before packs: the same `lstat`s, and an `openat`, a `write` and a `close` of its own temp
//! file, then a `link` and an `unlink` at the commit).

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

pub(crate) use super::local_pack::PackBatch;
use super::local_pack::{self, IdxEntry, PACK_DIR, PACK_LOCK, Packs, chunk_digest};
use super::{
    Backend, BackendError, CompactReport, LayoutReport, MAX_MUTABLE_LEN, ObjectInfo, PutOutcome,
    StageBatch, Staged, StagedPut, Version, too_large, validate_key,
};
use crate::digest::{Hasher, Sha256Hash};

const TMP_DIR: &str = ".tmp";
const LOCK_DIR: &str = ".locks";

/// A store in a local directory.
#[derive(Debug)]
pub struct LocalBackend {
    root: PathBuf,
    url: String,
    packs: Arc<Packs>,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The writer part of a temp file's name: `<ProcessId token>n<pid namespace inode>` (e.g.
/// `p4242s98765n4026531836`), so that [`reap_dead_writers`] can tell a dead writer's file
/// from a live one's, pid reuse and other pid namespaces included ([`crate::owner`]).
fn tmp_owner() -> &'static str {
    static OWNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    OWNER.get_or_init(|| {
        format!(
            "{}n{}",
            crate::owner::ProcessId::current().token(),
            crate::owner::pid_namespace().unwrap_or(0)
        )
    })
}

/// A new unique temp or pack name: `<writer>-<n>-<nanos>` ([`tmp_owner`]).
fn fresh_name() -> String {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}-{}-{}", tmp_owner(), n, nanos)
}

/// A file removed when this drops, unless [`RemoveOnDrop::keep`] was called.
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn keep(&mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = fs::remove_file(p);
        }
    }
}

/// Removes `p`; absent is fine.
fn remove_if_present(p: &Path) -> std::io::Result<()> {
    match fs::remove_file(p) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Largest piece a compaction reads and writes at once: its memory, whatever the chunks'
/// size.
const COMPACT_BUF: u64 = 1 << 20;

/// Removes the temp files in `tmp` (the store's `.tmp`) of writers that are gone: named by
/// [`tmp_owner`] for a process of this pid namespace (not 0: unknown) that no longer runs.
/// A killed import leaves its staged chunks there (up to their stored size); this is what
/// takes them back, at the next open of the store. Files of live writers, of other pid
/// namespaces, and names of another form are left alone. Returns the files removed.
fn reap_dead_writers(tmp: &Path) -> usize {
    let Some(ns) = crate::owner::pid_namespace() else {
        return 0;
    };
    let Ok(entries) = fs::read_dir(tmp) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        if name.to_str().is_some_and(|n| writer_is_gone(n, ns)) && fs::remove_file(e.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Whether `name` (a temp file's or a pack's) names, by [`tmp_owner`], a writer of pid
/// namespace `ns` that no longer runs.
fn writer_is_gone(name: &str, ns: u64) -> bool {
    let Some((owner, rest)) = crate::owner::ProcessId::parse_token(name) else {
        return false;
    };
    let Some(writer_ns) = rest
        .strip_prefix('n')
        .and_then(|r| r.split('-').next())
        .and_then(|n| n.parse::<u64>().ok())
    else {
        return false;
    };
    writer_ns == ns && !owner.is_alive()
}

/// Removes from `.packs` the files of packs that have no index (a commit killed between
/// its pack's rename and its index's, or a delete of a pack's last chunk killed after its
/// index went) when their writer is gone. Returns the files removed.
fn reap_dead_packs(packs: &Path) -> usize {
    let Some(ns) = crate::owner::pid_namespace() else {
        return 0;
    };
    let Ok(entries) = fs::read_dir(packs) else {
        return 0;
    };
    let names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    let indexed: std::collections::HashSet<&str> = names
        .iter()
        .filter_map(|n| n.strip_suffix(".idx"))
        .collect();
    let mut removed = 0;
    for n in &names {
        let Some(stem) = n.strip_suffix(".pack").or_else(|| n.strip_suffix(".dead")) else {
            continue;
        };
        if !indexed.contains(stem)
            && writer_is_gone(stem, ns)
            && fs::remove_file(packs.join(n)).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

fn version_of(meta: &fs::Metadata) -> Version {
    Version(format!(
        "{}-{}.{}-{}",
        meta.ino(),
        meta.ctime(),
        meta.ctime_nsec(),
        meta.size()
    ))
}

fn info_of(key: String, meta: &fs::Metadata) -> ObjectInfo {
    ObjectInfo {
        key,
        size: meta.len(),
        modified: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
        version: Some(version_of(meta)),
    }
}

impl LocalBackend {
    /// Opens (creating if needed) a store rooted at `root`.
    pub async fn open(root: &Path) -> Result<Self, BackendError> {
        let root = root.to_path_buf();
        let url = format!("file://{}", root.display());
        let r = root.clone();
        let u = url.clone();
        tokio::task::spawn_blocking(move || {
            for d in [TMP_DIR, LOCK_DIR, PACK_DIR] {
                fs::create_dir_all(r.join(d)).map_err(|e| other(&u, "open", "", e))?;
            }
            // A symlinked `.tmp` is refused at the first write; never reaped through.
            let mut reaped = match no_symlink(&u, "", &r.join(TMP_DIR)) {
                Ok(_) => reap_dead_writers(&r.join(TMP_DIR)),
                Err(_) => 0,
            };
            // A symlinked `.packs` is refused by every chunk operation; never reaped through.
            if no_symlink(&u, "", &r.join(PACK_DIR)).is_ok() {
                reaped += reap_dead_packs(&r.join(PACK_DIR));
            }
            if reaped > 0 {
                tracing::info!(store = %u, files = reaped, "removed temp files of writers that are gone");
            }
            Ok::<_, BackendError>(())
        })
        .await
        .map_err(|e| join_err(&url, e))??;
        let packs = Arc::new(Packs::new(root.join(PACK_DIR)));
        Ok(Self { root, url, packs })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> Result<PathBuf, BackendError> {
        Ok(self.checked_path(key)?.0)
    }

    /// The path of `key` once every ancestor directory of it that exists is checked to be a
    /// real directory (no symlink), and whether its own directory exists (then a write
    /// need not make it). Costs one `lstat` per existing ancestor.
    fn checked_path(&self, key: &str) -> Result<(PathBuf, bool), BackendError> {
        checked_path(&self.root, &self.url, key)
    }

    fn tmp_path(&self) -> PathBuf {
        self.root.join(TMP_DIR).join(fresh_name())
    }

    fn ctx(&self) -> Ctx {
        Ctx {
            url: self.url.clone(),
            root: self.root.clone(),
            tmp: self.tmp_path(),
            packs: self.packs.clone(),
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(Ctx) -> Result<T, BackendError> + Send + 'static,
    ) -> Result<T, BackendError> {
        let ctx = self.ctx();
        tokio::task::spawn_blocking(move || f(ctx))
            .await
            .map_err(|e| join_err(&self.url, e))?
    }

    /// Opens (creating if needed) a store rooted at `root`, from blocking code.
    pub fn open_blocking(root: &Path) -> Result<Self, BackendError> {
        let url = format!("file://{}", root.display());
        for d in [TMP_DIR, LOCK_DIR, PACK_DIR] {
            fs::create_dir_all(root.join(d)).map_err(|e| other(&url, "open", "", e))?;
        }
        Ok(Self {
            root: root.to_path_buf(),
            url,
            packs: Arc::new(Packs::new(root.join(PACK_DIR))),
        })
    }

    /// The path of the object `key` when it exists as a regular file (no symlink on the way).
    pub(crate) fn object_path_blocking(&self, key: &str) -> Result<Option<PathBuf>, BackendError> {
        let p = self.path(key)?;
        match fs::symlink_metadata(&p) {
            Ok(m) if m.is_file() => Ok(Some(p)),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(other(&self.url, "head", key, e)),
        }
    }

    /// [`Backend::put_if_absent`], from blocking code.
    pub(crate) fn put_if_absent_blocking(
        &self,
        key: &str,
        data: &[u8],
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let dest = self.path(key)?;
        self.ctx().put_if_absent(key, &dest, data, expect_sha256)
    }

    /// [`Backend::put`] (atomic replace), from blocking code.
    pub(crate) fn put_blocking(&self, key: &str, data: &[u8]) -> Result<Version, BackendError> {
        self.path(key)?;
        let c = self.ctx();
        let tmp = c.write_tmp(key, None, |f, _| f.write_all(data))?;
        c.publish_rename(key, &tmp)
    }

    /// Moves the file `staged` (on the store's file system, e.g. under `.tmp/`) in as the
    /// object `key` after fsyncing it and checking that it hashes to `expect_sha256`;
    /// put-if-absent (an existing object wins). On a mismatch the staged file is removed
    /// and the error is [`BackendError::DigestMismatch`].
    pub(crate) fn adopt_file_blocking(
        &self,
        key: &str,
        staged: &Path,
        expect_sha256: Sha256Hash,
    ) -> Result<PutOutcome, BackendError> {
        self.path(key)?;
        let c = self.ctx();
        let res = (|| {
            let mut f = OpenOptions::new().read(true).write(true).open(staged)?;
            f.sync_all()?;
            let mut h = Hasher::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    return Ok::<_, std::io::Error>(h.finish());
                }
                h.update(&buf[..n]);
            }
        })();
        let actual = match res {
            Ok(a) => a,
            Err(e) => return Err(not_found_or(&c.url, "put", key, e)),
        };
        if actual != expect_sha256 {
            let _ = fs::remove_file(staged);
            return Err(BackendError::DigestMismatch {
                store: c.url.clone(),
                key: key.to_string(),
                expected: expect_sha256.to_string(),
                actual: actual.to_string(),
            });
        }
        c.publish_link(key, staged)
    }

    /// Reads the object `key` whole when it is at most `max` bytes (`None`: absent);
    /// a larger object is an error naming the limit, read no further.
    pub(crate) fn get_bounded_blocking(
        &self,
        key: &str,
        max: u64,
    ) -> Result<Option<Bytes>, BackendError> {
        let path = self.path(key)?;
        let f = match open_nofollow(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(other(&self.url, "get", key, e)),
        };
        let mut buf = Vec::new();
        f.take(max + 1)
            .read_to_end(&mut buf)
            .map_err(|e| other(&self.url, "get", key, e))?;
        if buf.len() as u64 > max {
            return Err(BackendError::Other {
                store: self.url.clone(),
                op: "get",
                key: key.to_string(),
                message: format!("over the {max}-byte limit for this object"),
            });
        }
        Ok(Some(Bytes::from(buf)))
    }
}

struct Ctx {
    url: String,
    root: PathBuf,
    tmp: PathBuf,
    packs: Arc<Packs>,
}

fn other(url: &str, op: &'static str, key: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Other {
        store: url.to_string(),
        op,
        key: key.to_string(),
        message: e.to_string(),
    }
}

fn join_err(url: &str, e: tokio::task::JoinError) -> BackendError {
    other(url, "task", "", e)
}

fn not_found_or(url: &str, op: &'static str, key: &str, e: std::io::Error) -> BackendError {
    if e.kind() == ErrorKind::NotFound {
        BackendError::NotFound {
            store: url.to_string(),
            key: key.to_string(),
        }
    } else {
        other(url, op, key, e)
    }
}

/// [`LocalBackend::checked_path`] of the store at `root` (URL `url`).
fn checked_path(root: &Path, url: &str, key: &str) -> Result<(PathBuf, bool), BackendError> {
    validate_key(key)?;
    let mut p = root.to_path_buf();
    let mut segs = key.split('/').peekable();
    let mut dir_exists = true;
    while let Some(seg) = segs.next() {
        if segs.peek().is_none() {
            break;
        }
        p.push(seg);
        if !no_symlink(url, key, &p)? {
            dir_exists = false;
            break;
        }
    }
    Ok((root.join(key), dir_exists))
}

/// `Ok(true)` if `p` exists and is not a symlink, `Ok(false)` if it does not exist, an error
/// naming the key if it is a symlink.
fn no_symlink(url: &str, key: &str, p: &Path) -> Result<bool, BackendError> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => Err(other(
            url,
            "resolve",
            key,
            format!("{} is a symlink; a store never follows one", p.display()),
        )),
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(other(url, "resolve", key, e)),
    }
}

/// Opens an object for reading without following a symlink at its name.
fn open_nofollow(p: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(p)
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Ctx {
    /// Put-if-absent of `data` at `key` (whose path is `dest`), digest checked when given.
    fn put_if_absent(
        &self,
        key: &str,
        dest: &Path,
        data: &[u8],
        expect: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        if self.packed(key)?.is_some() || fs::symlink_metadata(dest).is_ok_and(|m| m.is_file()) {
            return Ok(PutOutcome::AlreadyExists);
        }
        let tmp = self.write_tmp(key, expect, |f, h| {
            h.update(data);
            f.write_all(data)
        })?;
        self.publish_link(key, &tmp)
    }

    /// [`Backend::head`] of `key` (at `path`, checked) on a blocking thread.
    fn head(&self, key: String, path: &Path) -> Result<Option<ObjectInfo>, BackendError> {
        if let Some(loc) = self.packed(&key)? {
            return Ok(Some(ObjectInfo {
                key,
                size: loc.len,
                modified: loc.modified,
                version: None,
            }));
        }
        match fs::symlink_metadata(path) {
            Ok(m) if m.is_file() => Ok(Some(info_of(key, &m))),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(other(&self.url, "head", &key, e)),
        }
    }

    /// [`Backend::stage_many_if_absent`] on a blocking thread: each of `items` staged in
    /// turn, each its own result. Each directory of the keys and `.tmp` are checked (no
    /// symlink) once per call.
    fn stage_many(
        &self,
        pack: Option<&PackBatch>,
        items: Vec<(String, Bytes)>,
    ) -> Vec<Result<Staged, BackendError>> {
        // Directory of a key → whether it exists (checked once).
        let mut dirs: std::collections::HashMap<String, bool> = Default::default();
        let mut tmp_checked = false;
        items
            .into_iter()
            .map(|(key, data)| {
                validate_key(&key)?;
                let dir = key.rsplit_once('/').map_or("", |(d, _)| d).to_string();
                let dir_exists = match dirs.get(&dir) {
                    Some(e) => *e,
                    None => {
                        let e = checked_path(&self.root, &self.url, &key)?.1;
                        dirs.insert(dir.clone(), e);
                        e
                    }
                };
                if !tmp_checked {
                    no_symlink(&self.url, &key, &self.root.join(TMP_DIR))?;
                    tmp_checked = true;
                }
                let staged = self.stage(pack, key, data, dir_exists);
                if !dir_exists {
                    // Maybe made by this stage: looked at again by the next.
                    dirs.remove(&dir);
                }
                staged
            })
            .collect()
    }

    /// Stages one object (see [`Ctx::stage_many`], which checked its directories and `.tmp`;
    /// `dir_exists`: whether its directory existed then).
    fn stage(
        &self,
        pack: Option<&PackBatch>,
        key: String,
        data: Bytes,
        dir_exists: bool,
    ) -> Result<Staged, BackendError> {
        let dest = self.root.join(&key);
        if let (Some(pack), Some(_)) = (pack, chunk_digest(&key)) {
            // Packed: appended to the batch's pack at a range of its own.
            if self.packed(&key)?.is_some()
                || fs::symlink_metadata(&dest).is_ok_and(|m| m.is_file())
            {
                return Ok(Staged::Done(PutOutcome::AlreadyExists));
            }
            let offset = pack.append(&data).map_err(|e| {
                if crate::space::is_no_space(&e) {
                    BackendError::NoSpace {
                        store: self.url.clone(),
                        op: "put",
                        key: key.clone(),
                        space: crate::space::NoSpace::at("writing", &pack.tmp, None),
                    }
                } else {
                    other(&self.url, "put", &key, e)
                }
            })?;
            return Ok(Staged::Pending(StagedPut {
                key,
                len: data.len() as u64,
                tmp: PathBuf::new(),
                packed: Some(offset),
            }));
        }
        if dir_exists && fs::symlink_metadata(&dest).is_ok_and(|m| m.is_file()) {
            return Ok(Staged::Done(PutOutcome::AlreadyExists));
        }
        // The object's directory is made now, so that the commit's syncfs covers its
        // entry in its parent.
        if !dir_exists {
            let parent = dest.parent().unwrap_or(&self.root);
            fs::create_dir_all(parent).map_err(|e| other(&self.url, "put", &key, e))?;
        }
        // A temp file of its own.
        let c = Ctx {
            url: self.url.clone(),
            root: self.root.clone(),
            tmp: self.root.join(TMP_DIR).join(fresh_name()),
            packs: self.packs.clone(),
        };
        let tmp = c.write_tmp_with(&key, None, false, |f, _| f.write_all(&data))?;
        Ok(Staged::Pending(StagedPut {
            key,
            len: data.len() as u64,
            tmp,
            packed: None,
        }))
    }

    /// The error for a failed write of `key`'s temp file: [`BackendError::NoSpace`] (with
    /// the free space measured once the partial file is gone) when the file system is full.
    fn write_err(&self, key: &str, e: std::io::Error) -> BackendError {
        if crate::space::is_no_space(&e) {
            return BackendError::NoSpace {
                store: self.url.clone(),
                op: "put",
                key: key.to_string(),
                space: crate::space::NoSpace::at("writing", &self.tmp, None),
            };
        }
        other(&self.url, "put", key, e)
    }

    /// Writes a temp file from `fill`, fsyncs it, checks the digest. Returns the temp path.
    fn write_tmp(
        &self,
        key: &str,
        expect: Option<Sha256Hash>,
        fill: impl FnOnce(&mut File, &mut Hasher) -> std::io::Result<()>,
    ) -> Result<PathBuf, BackendError> {
        self.write_tmp_with(key, expect, true, fill)
    }

    /// [`Ctx::write_tmp`], with the fsync only when `sync` (staged writes are made durable
    /// all at once by [`LocalBackend::commit_staged`]).
    fn write_tmp_with(
        &self,
        key: &str,
        expect: Option<Sha256Hash>,
        sync: bool,
        fill: impl FnOnce(&mut File, &mut Hasher) -> std::io::Result<()>,
    ) -> Result<PathBuf, BackendError> {
        no_symlink(&self.url, key, &self.root.join(TMP_DIR))?;
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&self.tmp)
            .map_err(|e| self.write_err(key, e))?;
        let mut hasher = Hasher::new();
        let res = fill(&mut f, &mut hasher).and_then(|_| if sync { f.sync_all() } else { Ok(()) });
        if let Err(e) = res {
            let _ = fs::remove_file(&self.tmp);
            return Err(self.write_err(key, e));
        }
        if let Some(expected) = expect {
            let actual = hasher.finish();
            if actual != expected {
                let _ = fs::remove_file(&self.tmp);
                return Err(BackendError::DigestMismatch {
                    store: self.url.clone(),
                    key: key.to_string(),
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        Ok(self.tmp.clone())
    }

    /// [`Backend::commit_staged`]: one `syncfs(2)` of the store's file system (every staged
    /// file's data and inode, the directories made for them, and whatever else any process
    /// wrote there before, such as objects this batch found present); then each staged file
    /// is linked to its key (an existing object wins) and its temp name removed; then each
    /// directory that got a new name is fsynced, once. On an error the temp files not yet
    /// linked are removed.
    fn commit(
        &self,
        staged: Vec<StagedPut>,
        dests: Vec<PathBuf>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        // Each temp name goes when its StagedPut drops, on every path out of here.
        let synced = File::open(&self.root)
            .and_then(|root| rustix::fs::syncfs(&root).map_err(std::io::Error::from));
        if let Err(e) = synced {
            return Err(other(&self.url, "syncfs", "", e));
        }
        let mut outcomes = Vec::with_capacity(staged.len());
        let mut dirs = std::collections::BTreeSet::new();
        for (s, dest) in staged.iter().zip(&dests) {
            match fs::hard_link(&s.tmp, dest) {
                Ok(()) => {
                    dirs.insert(dest.parent().unwrap_or(&self.root));
                    outcomes.push(PutOutcome::Created);
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    outcomes.push(PutOutcome::AlreadyExists)
                }
                Err(e) => return Err(other(&self.url, "put", &s.key, e)),
            }
        }
        for d in dirs {
            fsync_dir(d).map_err(|e| other(&self.url, "put", &d.display().to_string(), e))?;
        }
        tracing::debug!(
            store = %self.url,
            objects = staged.len(),
            created = outcomes.iter().filter(|o| **o == PutOutcome::Created).count(),
            "committed staged objects with one syncfs"
        );
        Ok(outcomes)
    }

    fn publish_link(&self, key: &str, tmp: &Path) -> Result<PutOutcome, BackendError> {
        let dest = self.root.join(key);
        let parent = dest.parent().unwrap_or(&self.root).to_path_buf();
        let res = fs::create_dir_all(&parent).and_then(|_| fs::hard_link(tmp, &dest));
        let _ = fs::remove_file(tmp);
        match res {
            Ok(()) => {
                fsync_dir(&parent).map_err(|e| other(&self.url, "put", key, e))?;
                Ok(PutOutcome::Created)
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(PutOutcome::AlreadyExists),
            Err(e) => Err(other(&self.url, "put", key, e)),
        }
    }

    fn publish_rename(&self, key: &str, tmp: &Path) -> Result<Version, BackendError> {
        let dest = self.root.join(key);
        let parent = dest.parent().unwrap_or(&self.root).to_path_buf();
        let res = fs::create_dir_all(&parent).and_then(|_| fs::rename(tmp, &dest));
        if let Err(e) = res {
            let _ = fs::remove_file(tmp);
            return Err(other(&self.url, "put", key, e));
        }
        fsync_dir(&parent).map_err(|e| other(&self.url, "put", key, e))?;
        let meta = fs::metadata(&dest).map_err(|e| other(&self.url, "put", key, e))?;
        Ok(version_of(&meta))
    }
}

/// Longest file name (bytes) on Linux file systems (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// The file under `.locks` that serializes compare-and-swap on `key`: the key with `/` as
/// `%`, or, when that is longer than [`NAME_MAX`], `#` and the sha256 of the key (neither `%`
/// nor `#` is in the key alphabet, so the two forms never meet).
fn lock_name(key: &str) -> String {
    let flat = key.replace('/', "%");
    if flat.len() <= NAME_MAX {
        flat
    } else {
        format!("#{}", crate::digest::Sha256Hash::of(key.as_bytes()).hex())
    }
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<ObjectInfo>) -> std::io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            // Deleted while we walked.
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if meta.is_dir() {
            walk(root, &path, out)?;
        } else if meta.is_file() {
            let Ok(rel) = path.strip_prefix(root) else {
                continue;
            };
            let key = rel.to_string_lossy().into_owned();
            if validate_key(&key).is_ok() {
                out.push(info_of(key, &meta));
            }
        }
    }
    Ok(())
}

#[async_trait::async_trait]
impl Backend for LocalBackend {
    fn url(&self) -> &str {
        &self.url
    }

    fn failures_are_final(&self) -> bool {
        true
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            if let Some(b) = c.read_packed(&key, 0..u64::MAX)? {
                return Ok(b);
            }
            let mut f = open_nofollow(&path).map_err(|e| not_found_or(&c.url, "get", &key, e))?;
            let mut buf = Vec::new();
            f.read_to_end(&mut buf)
                .map_err(|e| other(&c.url, "get", &key, e))?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            use std::os::unix::fs::FileExt;
            if let Some(b) = c.read_packed(&key, range.clone())? {
                return Ok(b);
            }
            let f = open_nofollow(&path).map_err(|e| not_found_or(&c.url, "get", &key, e))?;
            let len = f
                .metadata()
                .map_err(|e| other(&c.url, "get", &key, e))?
                .len();
            let end = range.end.min(len);
            let start = range.start.min(end);
            let mut buf = vec![0u8; (end - start) as usize];
            f.read_exact_at(&mut buf, start)
                .map_err(|e| other(&c.url, "get", &key, e))?;
            Ok(Bytes::from(buf))
        })
        .await
    }

    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            let f = open_nofollow(&path).map_err(|e| not_found_or(&c.url, "get", &key, e))?;
            let meta = f.metadata().map_err(|e| other(&c.url, "get", &key, e))?;
            if meta.len() > MAX_MUTABLE_LEN {
                return Err(too_large(&c.url, &key, meta.len()));
            }
            let mut buf = Vec::with_capacity(meta.len() as usize);
            f.take(MAX_MUTABLE_LEN + 1)
                .read_to_end(&mut buf)
                .map_err(|e| other(&c.url, "get", &key, e))?;
            if buf.len() as u64 > MAX_MUTABLE_LEN {
                return Err(too_large(&c.url, &key, buf.len() as u64));
            }
            Ok((Bytes::from(buf), version_of(&meta)))
        })
        .await
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| c.head(key, &path)).await
    }

    /// All of `keys` in one blocking call, each as [`Backend::head`] (packed or loose).
    ///
    /// Measured (issue 33, `kiln store import` of a 256 MiB tarball of `/usr` into a new
    /// local store, about 3,100 chunks, 2 cores, `perf stat`): with one blocking call per
    /// key (32 at once, so as many threads of the blocking pool), about 14,300 context
    /// switches and 1.85 s of CPU; with one per look-up of a group, about 6,400 and 1.72 s.
    async fn loose_present_many(&self, keys: &[String]) -> Vec<Result<bool, BackendError>> {
        let keys = keys.to_vec();
        let ctx = self.ctx();
        let looked = tokio::task::spawn_blocking(move || {
            keys.iter()
                .map(|k| {
                    let (path, _) = checked_path(&ctx.root, &ctx.url, k)?;
                    Ok(ctx.head(k.clone(), &path)?.is_some())
                })
                .collect::<Vec<_>>()
        });
        match looked.await {
            Ok(out) => out,
            Err(e) => vec![Err(join_err(&self.url, e))],
        }
    }

    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let dest = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| c.put_if_absent(&key, &dest, &data, expect_sha256))
            .await
    }

    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let dest = self.path(key)?;
        let key = key.to_string();
        let src = path.to_path_buf();
        self.blocking(move |c| {
            if c.packed(&key)?.is_some() || fs::symlink_metadata(&dest).is_ok_and(|m| m.is_file()) {
                return Ok(PutOutcome::AlreadyExists);
            }
            let tmp = c.write_tmp(&key, expect_sha256, |f, h| {
                let mut input = File::open(&src)?;
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let n = input.read(&mut buf)?;
                    if n == 0 {
                        return Ok(());
                    }
                    h.update(&buf[..n]);
                    f.write_all(&buf[..n])?;
                }
            })?;
            c.publish_link(&key, &tmp)
        })
        .await
    }

    fn stage_batch(&self) -> StageBatch {
        let tmp = self.tmp_path();
        let name = tmp
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        StageBatch {
            pack: Some(Arc::new(PackBatch::new(
                name.clone(),
                tmp.with_file_name(format!("{name}.pack")),
            ))),
            s3: None,
        }
    }

    async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
        self.blocking(|c| {
            c.packs
                .rescan()
                .map_err(|e| other(&c.url, "list", PACK_DIR, e))?;
            Ok(c.packs.report())
        })
        .await
    }

    async fn compact(
        &self,
        dry_run: bool,
        also_dead: &[String],
    ) -> Result<CompactReport, BackendError> {
        let also_dead = also_dead.to_vec();
        self.blocking(move |c| c.compact(dry_run, &also_dead)).await
    }

    async fn stage_if_absent(
        &self,
        batch: &StageBatch,
        key: &str,
        data: Bytes,
    ) -> Result<Staged, BackendError> {
        let mut out = self
            .stage_many_if_absent(batch, vec![(key.to_string(), data)])
            .await;
        out.pop()
            .unwrap_or_else(|| Err(other(&self.url, "put", key, "no stage made")))
    }

    /// All of `items` in one blocking call, in the order given (packed chunks: appended to
    /// the batch's pack in that order).
    ///
    /// Measured (issue 33, `kiln store import` of a 256 MiB tarball of `/usr` into a new
    /// local store, about 3,100 chunks, 2 cores, `perf stat`): with one blocking call per
    /// chunk, about 21,600 context switches and 2.07 s of CPU; with one per group, about
    /// 14,300 and 1.85 s.
    async fn stage_many_if_absent(
        &self,
        batch: &StageBatch,
        items: Vec<(String, Bytes)>,
    ) -> Vec<Result<Staged, BackendError>> {
        let keys: Vec<String> = items.iter().map(|(k, _)| k.clone()).collect();
        let pack = batch.pack.clone();
        let ctx = self.ctx();
        match tokio::task::spawn_blocking(move || ctx.stage_many(pack.as_deref(), items)).await {
            Ok(out) => out,
            Err(e) => {
                let e = e.to_string();
                keys.iter()
                    .map(|k| Err(other(&self.url, "task", k, &e)))
                    .collect()
            }
        }
    }

    async fn commit_staged(
        &self,
        batch: StageBatch,
        staged: Vec<StagedPut>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        // Packed chunks, and objects staged one file each (a batch without a pack, or a key
        // the packs do not take); outcomes go back in the order given.
        let (packed, loose): (Vec<_>, Vec<_>) = staged
            .into_iter()
            .enumerate()
            .partition(|(_, s)| s.packed.is_some());
        let (loose_at, loose): (Vec<usize>, Vec<StagedPut>) = loose.into_iter().unzip();
        let (packed_at, packed): (Vec<usize>, Vec<StagedPut>) = packed.into_iter().unzip();
        let mut outcomes = vec![PutOutcome::AlreadyExists; loose_at.len() + packed_at.len()];
        if !loose.is_empty() || batch.pack.is_none() {
            // Every key was checked when staged; check again (a symlink planted since), each
            // directory once (an artifact's chunks share one).
            let mut dests = Vec::with_capacity(loose.len());
            let mut checked = std::collections::HashSet::new();
            for s in &loose {
                let dir = s.key.rsplit_once('/').map_or("", |(d, _)| d);
                let res = if checked.contains(dir) {
                    Ok(self.root.join(&s.key))
                } else {
                    self.path(&s.key)
                };
                match res {
                    Ok(d) => {
                        checked.insert(dir.to_string());
                        dests.push(d);
                    }
                    Err(e) => {
                        self.discard_staged(batch, loose).await;
                        return Err(e);
                    }
                }
            }
            let out = self.blocking(move |c| c.commit(loose, dests)).await?;
            for (i, o) in loose_at.into_iter().zip(out) {
                outcomes[i] = o;
            }
        }
        if let Some(pack) = batch.pack {
            let out = self
                .blocking(move |c| {
                    let out = c.commit_pack(&pack, &packed);
                    // The batch's temp pack (if not committed) goes as its last handle drops.
                    drop(pack);
                    out
                })
                .await?;
            for (i, o) in packed_at.into_iter().zip(out) {
                outcomes[i] = o;
            }
        }
        Ok(outcomes)
    }

    async fn discard_staged(&self, batch: StageBatch, staged: Vec<StagedPut>) {
        if staged.is_empty() && batch.pack.is_none() {
            return;
        }
        let _ = self
            .blocking(move |_| {
                // Each StagedPut removes its temp file as it drops. The batch's pack goes
                // now, even while a stage still running holds the batch.
                drop(staged);
                if let Some(p) = &batch.pack {
                    p.discard();
                }
                drop(batch);
                Ok(())
            })
            .await;
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            let tmp = c.write_tmp(&key, None, |f, _| f.write_all(&data))?;
            let v = c.publish_rename(&key, &tmp)?;
            // An overwrite of a packed chunk: the new bytes are the object (written first,
            // so the key is never absent), the packed entry is deleted.
            c.delete_packed(&key)?;
            Ok(v)
        })
        .await
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError> {
        let dest = self.path(key)?;
        let key = key.to_string();
        let expected = expected.cloned();
        self.blocking(move |c| {
            no_symlink(&c.url, &key, &c.root.join(LOCK_DIR))?;
            let lock_path = c.root.join(LOCK_DIR).join(lock_name(&key));
            let lock = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock_path)
                .map_err(|e| other(&c.url, "lock", &key, e))?;
            lock.lock().map_err(|e| other(&c.url, "lock", &key, e))?;
            let current = match fs::symlink_metadata(&dest) {
                Ok(m) => Some(version_of(&m)),
                Err(e) if e.kind() == ErrorKind::NotFound => None,
                Err(e) => return Err(other(&c.url, "cas", &key, e)),
            };
            if current != expected {
                return Err(BackendError::Conflict {
                    store: c.url.clone(),
                    key,
                });
            }
            let tmp = c.write_tmp(&key, None, |f, _| f.write_all(&data))?;
            let v = c.publish_rename(&key, &tmp);
            drop(lock);
            v
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        // Walk the deepest directory the prefix names, then filter by the full prefix.
        let dir_part = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        if !dir_part.is_empty() {
            // Checks every directory down to and including `dir_part` (a symlinked `chunks`
            // would otherwise list, and let GC delete, files outside the root).
            self.path(&format!("{dir_part}/x"))?;
        }
        let prefix = prefix.to_string();
        let dir_part = dir_part.to_string();
        self.blocking(move |c| {
            let mut out = Vec::new();
            walk(&c.root, &c.root.join(&dir_part), &mut out)
                .map_err(|e| other(&c.url, "list", &prefix, e))?;
            out.retain(|o| o.key.starts_with(&prefix));
            // Packed chunks, when the prefix covers some.
            if super::pack::lists_chunks(&prefix) {
                c.packs
                    .rescan()
                    .map_err(|e| other(&c.url, "list", &prefix, e))?;
                super::pack::add_packed(&mut out, &prefix, c.packs.live());
            }
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(other(&c.url, "delete", &key, e)),
            }
            c.delete_packed(&key)?;
            Ok(())
        })
        .await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let src = self.path(from)?;
        let dest = self.path(to)?;
        let from = from.to_string();
        let to = to.to_string();
        self.blocking(move |c| {
            if !no_symlink(&c.url, &from, &src)? {
                // Packed: the bytes written at `to` (durably), then the entry deleted, so an
                // interruption leaves both keys, never neither.
                let Some(data) = c.read_packed(&from, 0..u64::MAX)? else {
                    return Err(BackendError::NotFound {
                        store: c.url.clone(),
                        key: from,
                    });
                };
                let tmp = c.write_tmp(&to, None, |f, _| f.write_all(&data))?;
                c.publish_rename(&to, &tmp)?;
                c.delete_packed(&from)?;
                return Ok(());
            }
            let parent = dest.parent().unwrap_or(&c.root).to_path_buf();
            fs::create_dir_all(&parent).map_err(|e| other(&c.url, "rename", &from, e))?;
            fs::rename(&src, &dest).map_err(|e| not_found_or(&c.url, "rename", &from, e))?;
            fsync_dir(&parent).map_err(|e| other(&c.url, "rename", &from, e))?;
            if let Some(p) = src.parent() {
                fsync_dir(p).map_err(|e| other(&c.url, "rename", &from, e))?;
            }
            // A packed copy too (two writers' copies): gone with the loose one.
            c.delete_packed(&from)?;
            Ok(())
        })
        .await
    }
}

mod packed;

#[cfg(test)]
mod tests;
