//! The local-directory backend: one file per key under a root directory.
//!
//! Writes go to `<root>/.tmp/<unique>`, are fsynced (and, when the caller gives the expected
//! sha256, hashed and checked), then published: `put_if_absent` with `link(2)` (fails on an
//! existing name, so concurrent writers of one key are safe and the loser sees
//! `AlreadyExists`), `put` and `compare_and_swap` with `rename(2)` (atomic replace). The parent
//! directory is fsynced after publishing. A crash leaves at most a stray file in `.tmp`.
//!
//! ## Chunks: durability with one sync
//! An artifact's chunks ([`crate::Store::put_artifact`]) are written with
//! [`Backend::stage_if_absent`]: each to its own `.tmp/<unique>` file, not fsynced, its key's
//! directory made, and not yet linked to its key. At the end [`Backend::commit_staged`] does,
//! in this order: one `syncfs(2)` of the store's file system; a `link(2)` of each staged file
//! to its key (an existing object wins, as in `put_if_absent`) and the removal of its temp
//! name; one fsync of each directory that got a new name (one for all chunks:
//! `chunks/sha256/`). Only after that does `put_artifact` return its table, and only then does
//! its caller write the manifest (fsynced, then linked, then its directory fsynced), and only
//! after that the tag (compare-and-swap: fsynced, renamed, directory fsynced). For one
//! `kiln store import` of a 512 MiB tarball of `/usr` (5,957 chunks; `strace -f -c -e
//! trace=fsync,fdatasync,syncfs,openat`, 2026-12-05, issue 33) this is 1 `syncfs` and 207
//! fsyncs (nearly all of the lease's record, rewritten once per 64 chunks) in place of 12,122
//! fsyncs (one per chunk file and one per chunk link), and 6,543 `openat` in place of 12,251.
//!
//! The promise:
//! - **after a `kill -9` at any point**, `kiln store verify` is clean and no tag names missing
//!   data. A killed process loses nothing it wrote (the page cache belongs to the kernel):
//!   a staged chunk is either a whole temp file or no file, and is visible under its key
//!   only once whole (link of a complete file). The manifest is written only after every
//!   chunk it names is linked, and the tag only after the manifest, so any tag names a
//!   manifest and chunks that exist. What a kill leaves is temp files in `.tmp` (at most the
//!   staged chunks of the imports in flight, bytes: their stored size), which no listing,
//!   verify or GC ever counts as objects; each names its writer (pid, start time, pid
//!   namespace), and the next open of the store removes those of writers that are gone.
//! - **after a power loss**, a tag never names a manifest whose chunks were not synced, and
//!   no chunk key names bytes that were not synced. The data of a staged file is on stable
//!   storage when `syncfs` returns (Linux 5.8 and later also report a failed writeback
//!   there); its key is made only after that, so a chunk key never points at an unsynced or
//!   torn file (a rerun after the power loss that finds the key present may rely on it). The
//!   new keys are durable once their directory is fsynced, before `commit_staged` returns.
//!   Chunks the import found present rather than wrote were linked, by whichever writer,
//!   before the import looked, so before its `syncfs`, which writes that directory entry
//!   too; their data was synced before their link (by the same rule, or by the fsync before
//!   link of [`Backend::put_if_absent`]). The manifest is written after all this, and the tag
//!   after the manifest's fsync, so a tag that survives a power loss names a manifest whose
//!   every chunk was synced first. A power loss before the commit loses staged temp files
//!   and nothing that any manifest names.
//!
//! `syncfs` writes back the whole file system, other processes' dirty data included: its
//! cost grows with what they wrote and did not sync, where one fsync per chunk grew with the
//! number of chunks.
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
//! Staging a chunk costs two `lstat`s for its directories, one for its key and one for `.tmp`,
//! and makes no directory that exists (before: six `lstat`s and a `mkdir` per chunk, and four
//! more `lstat`s at the commit; `strace -c` of `kiln store import` of 64 MiB, 800 chunks:
//! 12,020 `statx` and 832 `mkdir`).

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use super::{
    Backend, BackendError, MAX_MUTABLE_LEN, ObjectInfo, PutOutcome, Staged, StagedPut, Version,
    too_large, validate_key,
};
use crate::digest::{Hasher, Sha256Hash};

const TMP_DIR: &str = ".tmp";
const LOCK_DIR: &str = ".locks";

/// A store in a local directory.
#[derive(Debug)]
pub struct LocalBackend {
    root: PathBuf,
    url: String,
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
        let Some((owner, rest)) = name.to_str().and_then(crate::owner::ProcessId::parse_token)
        else {
            continue;
        };
        let Some(writer_ns) = rest
            .strip_prefix('n')
            .and_then(|r| r.split('-').next())
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if writer_ns == ns && !owner.is_alive() && fs::remove_file(e.path()).is_ok() {
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
            for d in [TMP_DIR, LOCK_DIR] {
                fs::create_dir_all(r.join(d)).map_err(|e| other(&u, "open", "", e))?;
            }
            // A symlinked `.tmp` is refused at the first write; never reaped through.
            let reaped = match no_symlink(&u, "", &r.join(TMP_DIR)) {
                Ok(_) => reap_dead_writers(&r.join(TMP_DIR)),
                Err(_) => 0,
            };
            if reaped > 0 {
                tracing::info!(store = %u, files = reaped, "removed temp files of writers that are gone");
            }
            Ok::<_, BackendError>(())
        })
        .await
        .map_err(|e| join_err(&url, e))??;
        Ok(Self { root, url })
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
        validate_key(key)?;
        let mut p = self.root.clone();
        let mut segs = key.split('/').peekable();
        let mut dir_exists = true;
        while let Some(seg) = segs.next() {
            if segs.peek().is_none() {
                break;
            }
            p.push(seg);
            if !no_symlink(&self.url, key, &p)? {
                dir_exists = false;
                break;
            }
        }
        Ok((self.root.join(key), dir_exists))
    }

    fn tmp_path(&self) -> PathBuf {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        self.root
            .join(TMP_DIR)
            .join(format!("{}-{}-{}", tmp_owner(), n, nanos))
    }

    fn ctx(&self) -> Ctx {
        Ctx {
            url: self.url.clone(),
            root: self.root.clone(),
            tmp: self.tmp_path(),
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
        for d in [TMP_DIR, LOCK_DIR] {
            fs::create_dir_all(root.join(d)).map_err(|e| other(&url, "open", "", e))?;
        }
        Ok(Self {
            root: root.to_path_buf(),
            url,
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
        if fs::symlink_metadata(dest).is_ok_and(|m| m.is_file()) {
            return Ok(PutOutcome::AlreadyExists);
        }
        let tmp = self.write_tmp(key, expect, |f, h| {
            h.update(data);
            f.write_all(data)
        })?;
        self.publish_link(key, &tmp)
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

    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
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
        self.blocking(move |c| match fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => Ok(Some(info_of(key, &m))),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(other(&c.url, "head", &key, e)),
        })
        .await
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
            if fs::symlink_metadata(&dest).is_ok_and(|m| m.is_file()) {
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

    async fn stage_if_absent(&self, key: &str, data: Bytes) -> Result<Staged, BackendError> {
        let (dest, dir_exists) = self.checked_path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            if dir_exists && fs::symlink_metadata(&dest).is_ok_and(|m| m.is_file()) {
                return Ok(Staged::Done(PutOutcome::AlreadyExists));
            }
            // The object's directory is made now, so that the commit's syncfs covers its
            // entry in its parent.
            if !dir_exists {
                let parent = dest.parent().unwrap_or(&c.root);
                fs::create_dir_all(parent).map_err(|e| other(&c.url, "put", &key, e))?;
            }
            let tmp = c.write_tmp_with(&key, None, false, |f, _| f.write_all(&data))?;
            Ok(Staged::Pending(StagedPut {
                key,
                len: data.len() as u64,
                tmp,
            }))
        })
        .await
    }

    async fn commit_staged(&self, staged: Vec<StagedPut>) -> Result<Vec<PutOutcome>, BackendError> {
        // Every key was checked when staged; check again (a symlink planted since), each
        // directory once (an artifact's chunks share one).
        let mut dests = Vec::with_capacity(staged.len());
        let mut checked = std::collections::HashSet::new();
        for s in &staged {
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
                    self.discard_staged(staged).await;
                    return Err(e);
                }
            }
        }
        self.blocking(move |c| c.commit(staged, dests)).await
    }

    async fn discard_staged(&self, staged: Vec<StagedPut>) {
        if staged.is_empty() {
            return;
        }
        let _ = self
            .blocking(move |_| {
                // Each StagedPut removes its temp file as it drops.
                drop(staged);
                Ok(())
            })
            .await;
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| {
            let tmp = c.write_tmp(&key, None, |f, _| f.write_all(&data))?;
            c.publish_rename(&key, &tmp)
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
            Ok(out)
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        let path = self.path(key)?;
        let key = key.to_string();
        self.blocking(move |c| match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(other(&c.url, "delete", &key, e)),
        })
        .await
    }

    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let src = self.path(from)?;
        let dest = self.path(to)?;
        let from = from.to_string();
        self.blocking(move |c| {
            if !no_symlink(&c.url, &from, &src)? {
                return Err(BackendError::NotFound {
                    store: c.url.clone(),
                    key: from,
                });
            }
            let parent = dest.parent().unwrap_or(&c.root).to_path_buf();
            fs::create_dir_all(&parent).map_err(|e| other(&c.url, "rename", &from, e))?;
            fs::rename(&src, &dest).map_err(|e| not_found_or(&c.url, "rename", &from, e))?;
            fsync_dir(&parent).map_err(|e| other(&c.url, "rename", &from, e))?;
            if let Some(p) = src.parent() {
                fsync_dir(p).map_err(|e| other(&c.url, "rename", &from, e))?;
            }
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn leftovers_and_hidden_files_are_not_objects() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        b.put("chunks/sha256/aa", Bytes::from_static(b"x"))
            .await
            .unwrap();
        // A crashed writer's temp file and a stray hidden file.
        fs::write(dir.path().join(".tmp/123-0-0"), b"partial").unwrap();
        fs::write(dir.path().join("chunks/.hidden"), b"h").unwrap();
        let keys: Vec<String> = b
            .list("")
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .collect();
        assert_eq!(keys, vec!["chunks/sha256/aa".to_string()]);
        // A failed digest check leaves neither the object nor a temp file.
        let wrong = Sha256Hash::of(b"other");
        assert!(
            b.put_if_absent("blobs/sha256/bb", Bytes::from_static(b"data"), Some(wrong))
                .await
                .is_err()
        );
        assert!(b.head("blobs/sha256/bb").await.unwrap().is_none());
        assert_eq!(fs::read_dir(dir.path().join(".tmp")).unwrap().count(), 1);
    }

    /// The next open of a store removes the temp files of writers that are gone (a killed
    /// import's staged chunks), and keeps those of a live writer, of another pid namespace,
    /// and of another name form.
    #[tokio::test]
    async fn an_open_removes_the_temp_files_of_dead_writers_only() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        let tmp = dir.path().join(".tmp");
        // A real writer that has exited: a child process, reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let ticks = crate::owner::start_ticks(pid).unwrap_or(1);
        child.wait().unwrap();
        let ns = crate::owner::pid_namespace().unwrap();
        let dead = format!("p{pid}s{ticks}n{ns}-0-1");
        let other_ns = format!("p{pid}s{ticks}n{}-0-1", ns + 1);
        let live = b.tmp_path().file_name().unwrap().to_owned();
        for name in [
            std::ffi::OsStr::new(&dead),
            std::ffi::OsStr::new(&other_ns),
            &live,
            std::ffi::OsStr::new("123-0-0"),
        ] {
            fs::write(tmp.join(name), b"staged").unwrap();
        }
        LocalBackend::open(dir.path()).await.unwrap();
        let mut left: Vec<String> = fs::read_dir(&tmp)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = vec![
            other_ns,
            live.to_string_lossy().into_owned(),
            "123-0-0".into(),
        ];
        want.sort();
        assert_eq!(left, want);
    }

    /// A staged object is invisible (no key, not listed) until its commit; the commit makes
    /// it an object, lets an object already at the key win, and leaves no temp file; a
    /// discarded batch leaves nothing at all.
    #[tokio::test]
    async fn staged_objects_appear_only_at_their_commit() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        let tmp_files = || fs::read_dir(dir.path().join(TMP_DIR)).unwrap().count();
        let stage = |key: &'static str, data: &'static [u8]| {
            let b = &b;
            async move {
                match b
                    .stage_if_absent(key, Bytes::from_static(data))
                    .await
                    .unwrap()
                {
                    Staged::Pending(p) => p,
                    Staged::Done(o) => panic!("{key}: not staged: {o:?}"),
                }
            }
        };
        let a = stage("chunks/sha256/aa", b"a").await;
        let c = stage("chunks/sha256/cc", b"c").await;
        assert!(b.head("chunks/sha256/aa").await.unwrap().is_none());
        assert!(b.list("chunks/").await.unwrap().is_empty());
        assert_eq!(tmp_files(), 2);
        // Another writer publishes `cc` meanwhile (durably, the ordinary way).
        b.put_if_absent("chunks/sha256/cc", Bytes::from_static(b"other"), None)
            .await
            .unwrap();
        let out = b.commit_staged(vec![a, c]).await.unwrap();
        assert_eq!(out, [PutOutcome::Created, PutOutcome::AlreadyExists]);
        assert_eq!(&b.get("chunks/sha256/aa").await.unwrap()[..], b"a");
        assert_eq!(&b.get("chunks/sha256/cc").await.unwrap()[..], b"other");
        assert_eq!(tmp_files(), 0);
        // An object already there is found at staging time.
        assert!(matches!(
            b.stage_if_absent("chunks/sha256/aa", Bytes::from_static(b"a"))
                .await
                .unwrap(),
            Staged::Done(PutOutcome::AlreadyExists)
        ));
        // Discarded: nothing stays.
        let d = stage("chunks/sha256/dd", b"d").await;
        b.discard_staged(vec![d]).await;
        assert_eq!(tmp_files(), 0);
        assert!(b.head("chunks/sha256/dd").await.unwrap().is_none());
        // An empty commit (the sync of what was found present) is fine.
        assert!(b.commit_staged(Vec::new()).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn symlinked_and_directory_keys_are_not_followed_as_objects() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        fs::create_dir_all(dir.path().join("tags/n")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("tags/n/t")).unwrap();
        // list ignores symlinks; head of a directory is absent.
        assert!(b.list("tags/").await.unwrap().is_empty());
        assert!(b.head("tags/n").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn planted_directory_symlinks_never_lead_outside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        // A tenant plants `tags/n -> outside` and `chunks -> outside`.
        fs::create_dir_all(dir.path().join("tags")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("tags/n")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("chunks")).unwrap();
        let data = Bytes::from_static(b"x");
        assert!(b.put("tags/n/t", data.clone()).await.is_err());
        assert!(
            b.compare_and_swap("tags/n/t", None, data.clone())
                .await
                .is_err()
        );
        assert!(
            b.put_if_absent("chunks/victim2", data.clone(), None)
                .await
                .is_err()
        );
        assert!(b.get("tags/n/victim").await.is_err());
        assert!(b.get_range("chunks/victim", 0..4).await.is_err());
        assert!(b.head("chunks/victim").await.is_err());
        // Listing through the symlink is refused (GC would otherwise sweep outside files).
        assert!(b.list("chunks/").await.is_err());
        assert!(b.list("tags/n/").await.is_err());
        assert!(b.delete("chunks/victim").await.is_err());
        assert!(
            b.stage_if_absent("chunks/victim3", data.clone())
                .await
                .is_err()
        );
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        let mut names: Vec<_> = fs::read_dir(outside.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["victim"]);
        // A symlinked `.tmp` is refused too: temp files would be written outside.
        fs::remove_dir_all(dir.path().join(".tmp")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join(".tmp")).unwrap();
        assert!(b.put("blobs/sha256/aa", data.clone()).await.is_err());
        assert!(
            b.stage_if_absent("blobs/sha256/bb", data.clone())
                .await
                .is_err()
        );
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
        // A symlinked `.locks`: no lock file is made outside.
        fs::remove_dir_all(dir.path().join(".locks")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join(".locks")).unwrap();
        assert!(b.compare_and_swap("tags/t", None, data).await.is_err());
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
    }

    /// Staged chunks are committed only into directories checked at the commit: one
    /// swapped for a symlink since they were staged (their directory is checked once for
    /// all of them) fails the commit, and nothing is linked outside.
    #[tokio::test]
    async fn a_directory_swapped_for_a_symlink_before_the_commit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        let mut staged = Vec::new();
        for i in 0..3 {
            match b
                .stage_if_absent(
                    &format!("chunks/sha256/{i:064x}"),
                    Bytes::from(vec![i as u8; 10]),
                )
                .await
                .unwrap()
            {
                Staged::Pending(p) => staged.push(p),
                Staged::Done(o) => panic!("not staged: {o:?}"),
            }
        }
        fs::rename(dir.path().join("chunks/sha256"), dir.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("chunks/sha256")).unwrap();
        assert!(b.commit_staged(staged).await.is_err());
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 0);
        assert_eq!(fs::read_dir(dir.path().join(".tmp")).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn a_symlink_at_an_object_name_is_not_read_through() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        fs::create_dir_all(dir.path().join("tags/n")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("tags/n/t")).unwrap();
        assert!(b.get("tags/n/t").await.is_err());
        assert!(b.get_versioned("tags/n/t").await.is_err());
        assert!(b.get_range("tags/n/t", 0..4).await.is_err());
        assert!(b.head("tags/n/t").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_huge_mutable_object_is_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::open(dir.path()).await.unwrap();
        fs::create_dir_all(dir.path().join("tags/n")).unwrap();
        // 1 TiB, sparse: allocating or reading it whole would abort or exhaust memory.
        File::create(dir.path().join("tags/n/t"))
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        let err = b.get_versioned("tags/n/t").await.unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        // And at the store level: a tag read is a named error, verify reports it.
        let store = crate::Store::open(dir.path().to_str().unwrap())
            .await
            .unwrap();
        assert!(store.get_tag(&"n:t".parse().unwrap()).await.is_err());
        let r = store
            .verify(false, &crate::gc::GcOptions::default())
            .await
            .unwrap();
        assert!(
            r.findings.iter().any(|f| matches!(f,
                crate::verify::Finding::TagCorrupt { key, reason }
                    if key == "tags/n/t" && reason.contains("limit"))),
            "{:?}",
            r.findings
        );
    }
}
