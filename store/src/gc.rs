//! Garbage collection: a pure mark over references, and a sweep in two phases (condemn, then
//! delete), the same on every backend.
//!
//! [`mark`] takes roots and a "what does this refer to" function and returns the live set;
//! it never touches storage (unit-tested on an in-memory graph). [`Store::gc`] first takes
//! the store's GC lock ([`GC_LOCK_KEY`], one GC at a time per store, taken and renewed by
//! conditional writes; see [`GcError::Busy`]). It lists every chunk, blob and manifest; then
//! takes the store's sweep lock (exclusive, on a local store only; see
//! [`crate::lease::Lease`]) and, in this order, gathers the roots: every object of a live lease
//! ([`crate::lease::LeaseRecord::is_live`]), every tag's manifest, the layer of every
//! build-cache entry younger than [`GcOptions::cache_ttl`], every OCI image an OCI reference
//! ([`crate::ociref`]) names (its manifest or index, config and layers). It loads every
//! listed manifest (and any root names that the listing missed) to answer `refs_of`, and
//! marks. A reachable manifest that cannot be read stops GC before anything moves. Then:
//!
//! 1. *Condemn.* Every listed, unmarked chunk, blob and manifest last modified more than
//!    [`GcOptions::grace`] ago is moved to its fossil key, `fossil/<key>` ([`fossil_key`];
//!    [`Backend::rename`]: a rename locally, CopyObject and DeleteObject on S3), manifests
//!    first. Nothing is deleted yet.
//! 2. *Delete.* Once every move is done, the roots are gathered again (leases, then tags,
//!    cache entries, OCI references) and marked again, loading any manifest published
//!    meanwhile. Every fossil (this run's, and any a crashed run left) whose object is now
//!    marked is put back under its own key (unless an object is there already) and every
//!    other fossil is deleted, manifests first.
//!
//! Leases no longer live (expired, or their owner died) and expired cache entries (with their
//! inputs records and index copies, [`crate::lease`]) are deleted last, and the locks released. `dry_run` moves and deletes nothing and reports
//! what phase 1 would condemn.
//!
//! Last, still under the GC lock (the sweep lock released: writers need not wait),
//! [`Backend::compact`] reclaims the space the backend's layout holds for what was deleted:
//! the local backend copies the live chunks of each pack that is at least half dead into a
//! new pack and retires the old one ([`crate::backend::local`], "Compaction"). It never
//! changes which keys exist or their bytes and `modified` times, only where the bytes are,
//! so everything above holds through it: a build that found a chunk present finds it
//! still, and a mark sees the same keys. A dry run compacts nothing and reports what the
//! compaction would reclaim once its deletes are done.
//!
//! Why an in-flight build or push loses nothing, whatever the grace period (even zero), on
//! S3 as on a local directory. It rests on S3's strong read-after-write consistency (a
//! write, delete or copy that has returned is seen by every later read, head and listing,
//! Amazon S3 User Guide, "Amazon S3 data consistency model"), the one thing assumed of a
//! backend, and on the rule every writer follows ([`crate::lease::Lease`]): an object goes
//! into the writer's lease before it is written, or, when it is to be reused because it
//! exists, before it is looked up; the lease is released only after the writer's tag moved.
//! GC never deletes anything under a key a writer writes or looks up (only fossils), and
//! writers never look at fossils ([`Store::exist`]). Take an object X a build relies on and
//! a GC run that moves X in phase 1:
//! - If the build leased X before this run read the leases in phase 1, the run saw X leased
//!   (or, the lease released, the build's tag, read after the leases), so X is marked and
//!   never moved. So the build leased X after that read.
//! - If the build wrote X or found it present *after* the move, X was absent under its key
//!   then, so the build wrote it afresh (put-if-absent), and no GC phase deletes a real key.
//! - If it did so *before* the move, its lease came earlier still, so before phase 2 read the
//!   leases: phase 2 sees the lease, or, if it was released, the tag the build moved first
//!   (read after the leases), marks X and puts it back. Until then a reader of the build's
//!   manifest finds X at its fossil key ([`Store::read_range`] and the other read paths fall
//!   back to it in one place), and [`Store::set_tag`] accepts a manifest that is a fossil.
//! - The GC lock keeps a second GC from deleting a fossil this run has yet to judge. A run
//!   that crashed leaves fossils and a lock whose owner is dead or whose expiry passes
//!   ([`GC_LOCK_TTL`], renewed every [`GC_LOCK_RENEW`] while GC runs); the next run takes the
//!   lock and judges those fossils in its phase 2, after its own lease read, so the argument
//!   holds for them as for its own. Verify counts a fossil as presence of its object
//!   ([`crate::verify`]), so a store is verify-clean at every point of a run.
//!
//! On a local store GC also holds the sweep lock (a `flock(2)` in the store directory)
//! exclusively from its first lease read to its last delete, and look-ups for reuse take it
//! shared ([`crate::lease::Lease::find_present`]), so there a look-up never falls between a
//! lease read and a move at all; the fossil protocol does not need it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::backend::{Backend, BackendError, Version};
use crate::digest::ManifestDigest;
use crate::lease::{DEFAULT_CACHE_TTL, LeaseRecord};
use crate::manifest::{ObjectRef, references};
use crate::owner::LeaseOwner;
use crate::{Store, StoreError, hostname, unix_now};

pub use crate::ociref::MAX_OCI_MANIFEST_BYTES;

/// The prefix of fossil keys: `fossil/<key>` holds an object GC moved out of `<key>` in its
/// first phase and has not judged yet (see the module doc).
pub const FOSSIL_PREFIX: &str = "fossil/";

/// The fossil key of `key`: `fossil/<key>`.
pub fn fossil_key(key: &str) -> String {
    format!("{FOSSIL_PREFIX}{key}")
}

/// The key a fossil key was moved from (`None` for a key not under [`FOSSIL_PREFIX`]).
pub fn unfossil(key: &str) -> Option<&str> {
    key.strip_prefix(FOSSIL_PREFIX)
}

/// The GC lock: a JSON [`LeaseRecord`] (id `gc`, no objects) naming the GC that runs, its
/// owner and expiry. Written with put-if-absent, taken over from a dead or expired holder by
/// compare-and-swap on its version, renewed the same way.
pub const GC_LOCK_KEY: &str = "gc/lock";

/// How long the GC lock holds without renewal (10 minutes): how long a GC that died on
/// another host blocks the next one (on its own host a dead owner is seen at once).
pub const GC_LOCK_TTL: Duration = Duration::from_secs(600);

/// How often a running GC renews its lock (every minute, well inside [`GC_LOCK_TTL`]).
pub const GC_LOCK_RENEW: Duration = Duration::from_secs(60);

/// Errors from garbage collection.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// A reachable manifest could not be read or parsed, so marking stopped (nothing deleted).
    #[error("cannot mark from {object}: {reason}")]
    Unreadable {
        /// The object.
        object: String,
        /// Why.
        reason: String,
    },
    /// Another GC holds the store's GC lock ([`GC_LOCK_KEY`]) and is alive as far as this
    /// host can tell (on another host, until its expiry).
    #[error(
        "{store}: another GC is running ({GC_LOCK_KEY} held by {host}, pid {pid}, until unix \
         time {expires}); run GC again once it is done"
    )]
    Busy {
        /// The store.
        store: String,
        /// The holder's host.
        host: String,
        /// The holder's pid (0 when it recorded none).
        pid: u32,
        /// The lock's expiry, unix seconds.
        expires: u64,
    },
    /// This GC's lock was taken over (it could not renew it in time), so it stopped before
    /// moving or deleting anything more; the fossils it left are judged by the next run.
    #[error("{store}: this GC lost the GC lock ({GC_LOCK_KEY}) and stopped; run GC again")]
    LockLost {
        /// The store.
        store: String,
    },
}

/// Marks everything reachable from `roots` through `refs_of`. Each object is expanded once,
/// so cycles and shared subgraphs are fine. Returns the live set (roots included).
pub fn mark<T, E>(
    roots: impl IntoIterator<Item = T>,
    mut refs_of: impl FnMut(&T) -> Result<Vec<T>, E>,
) -> Result<HashSet<T>, E>
where
    T: Clone + Eq + std::hash::Hash,
{
    let mut live = HashSet::new();
    let mut stack: Vec<T> = Vec::new();
    for r in roots {
        if live.insert(r.clone()) {
            stack.push(r);
        }
    }
    while let Some(o) = stack.pop() {
        for r in refs_of(&o)? {
            if live.insert(r.clone()) {
                stack.push(r);
            }
        }
    }
    Ok(live)
}

/// GC settings.
#[derive(Debug, Clone, Copy)]
pub struct GcOptions {
    /// Unmarked objects younger than this are kept (default 1 h).
    pub grace: Duration,
    /// Build-cache entries younger than this are roots (default 14 days).
    pub cache_ttl: Duration,
    /// Report only, move and delete nothing.
    pub dry_run: bool,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(3600),
            cache_ttl: DEFAULT_CACHE_TTL,
            dry_run: false,
        }
    }
}

/// One object GC deletes (or would).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Collected {
    /// The key (the object's own, not its fossil key).
    pub key: String,
    /// Stored size in bytes.
    pub size: u64,
}

/// What a GC run found and did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GcReport {
    /// Live objects marked (first phase).
    pub marked: usize,
    /// Unmarked objects kept because younger than the grace period.
    pub young_kept: usize,
    /// Objects deleted for good: fossils found unmarked in the second phase (this run's and
    /// those an earlier run left). In a dry run: the objects the first phase would condemn.
    pub collected: Vec<Collected>,
    /// Objects moved to their fossil keys in the first phase.
    pub condemned: usize,
    /// Keys of fossils found marked in the second phase and put back (a build relied on
    /// them meanwhile, or an earlier run left them).
    pub resurrected: Vec<String>,
    /// Leases no longer live (expired, or held by a dead process of this host), expired
    /// cache entries and the image cache entries (`images/<key>`) of swept manifests,
    /// removed (or that would be).
    pub expired: Vec<String>,
    /// Whether this was a dry run.
    pub dry_run: bool,
    /// The backend's compaction after the deletes ([`Backend::compact`]: the local
    /// backend's partly dead packs rewritten). In a dry run: what it would reclaim once
    /// the objects of [`GcReport::collected`] are deleted.
    pub compacted: crate::backend::CompactReport,
}

/// A root or reachable object that cannot be read: marking stops (see [`GcError::Unreadable`]).
fn unreadable(object: &str, reason: impl ToString) -> StoreError {
    GcError::Unreadable {
        object: object.to_string(),
        reason: reason.to_string(),
    }
    .into()
}

/// What each loaded manifest refers to, or why it could not be read.
pub(crate) type RefsOf = HashMap<ManifestDigest, Result<Vec<ObjectRef>, String>>;

/// The live set of a store and the content-addressed objects it holds.
pub(crate) struct Marked {
    pub(crate) live: HashSet<ObjectRef>,
    pub(crate) objects: Vec<crate::backend::ObjectInfo>,
    /// Lease records no longer live and expired cache entries.
    pub(crate) expired: Vec<String>,
    /// The parts (`leases/<id>~<n>`) of the expired lease records.
    pub(crate) expired_parts: Vec<String>,
    /// The sweep lock, when asked for.
    pub(crate) lock: Option<crate::lease::SweepLock>,
    /// The manifests loaded, for a second mark.
    pub(crate) refs: RefsOf,
}

/// The roots of one mark, and what is no longer live.
struct Roots {
    roots: Vec<ObjectRef>,
    expired: Vec<String>,
    expired_parts: Vec<String>,
}

impl Store {
    /// Lists the objects, then gathers roots, loads manifests and marks. Shared by GC and
    /// verify. With `lock`, the sweep lock is taken (exclusively) after the listing and
    /// before the leases are read, and returned held in [`Marked::lock`].
    ///
    /// The order is what makes GC safe with any grace period (see the module doc): objects
    /// first, then leases, then tags, cache entries and OCI references.
    ///
    /// `strict`: a reachable manifest that cannot be read stops marking (GC); otherwise it
    /// is treated as referring to nothing (verify, which reports it separately).
    pub(crate) async fn mark_live(
        &self,
        opts: &GcOptions,
        strict: bool,
        lock: bool,
    ) -> Result<Marked, StoreError> {
        let mut objects = Vec::new();
        for p in ["manifests/", "blobs/", "chunks/"] {
            objects.extend(self.backend.list(p).await?);
        }
        let lock = if lock {
            Some(self.sweep_lock(true).await?)
        } else {
            None
        };
        let Roots {
            roots,
            expired,
            expired_parts,
        } = self.gather_roots(opts, strict).await?;
        // Load every manifest listed; remember failures (they matter only if reachable).
        let mut refs: RefsOf = HashMap::new();
        for o in &objects {
            if let Some(ObjectRef::Manifest(d)) = ObjectRef::from_key(&o.key) {
                refs.insert(d, self.manifest_refs(&d).await);
            }
        }
        let live = self.mark_from(&roots, &mut refs, strict).await?;
        Ok(Marked {
            live,
            objects,
            expired,
            expired_parts,
            lock,
            refs,
        })
    }

    /// The roots, in the order the module doc gives: live leases, then tags, cache entries
    /// and OCI references.
    async fn gather_roots(&self, opts: &GcOptions, strict: bool) -> Result<Roots, StoreError> {
        let now = unix_now();
        let mut roots = Vec::new();
        let mut expired = Vec::new();
        let mut expired_parts = Vec::new();
        for (key, l, parts) in self.list_lease_objects().await? {
            if l.is_live(now) {
                roots.extend(l.refs());
            } else {
                expired.push(key);
                expired_parts.extend(parts);
            }
        }
        // A root that cannot be read (a corrupt tag or cache entry) stops GC: skipping it would
        // sweep everything only it keeps alive. (`list_tags` and `list_cache_entries` skip
        // such entries, so they are read here one by one.) Verify reports them instead.
        for o in self.backend.list("tags/").await? {
            if crate::tag::is_side_key(&o.key) {
                continue;
            }
            let Some(t) = crate::TagRef::from_key(&o.key) else {
                continue;
            };
            match self.get_tag(&t).await {
                Ok(Some(r)) => roots.push(ObjectRef::Manifest(r.manifest)),
                Ok(None) => {}
                Err(e) if strict => return Err(unreadable(&o.key, e)),
                Err(_) => {}
            }
        }
        // Inputs records and index copies are listed before the entries: a record is written
        // after its entry, so one listed here whose entry is not listed below has none.
        let inputs = self.backend.list(crate::lease::CACHE_INPUTS_PREFIX).await?;
        let index = self.backend.list(crate::lease::CACHE_INDEX_PREFIX).await?;
        let mut entries = HashSet::new();
        for o in self.backend.list("cache/").await? {
            let k = o.key.trim_start_matches("cache/").to_string();
            entries.insert(k.clone());
            let e = match self.get_cache_entry(&k).await {
                Ok(Some(e)) => e,
                Ok(None) => continue,
                Err(e) if strict => return Err(unreadable(&o.key, e)),
                Err(_) => continue,
            };
            if now.saturating_sub(e.time) < opts.cache_ttl.as_secs() {
                roots.push(ObjectRef::Blob(e.layer));
            } else {
                expired.push(format!("cache/{k}"));
                entries.remove(&k);
            }
        }
        // An entry's inputs record goes with it (or when it has none), an index copy once it
        // is as old as an expired entry.
        for o in inputs {
            let k = &o.key[crate::lease::CACHE_INPUTS_PREFIX.len()..];
            if !entries.contains(k) {
                expired.push(o.key);
            }
        }
        let ttl_ago = SystemTime::now()
            .checked_sub(opts.cache_ttl)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        for o in index {
            if o.modified <= ttl_ago {
                expired.push(o.key);
            }
        }
        roots.extend(self.oci_ref_roots(strict).await?);
        Ok(Roots {
            roots,
            expired,
            expired_parts,
        })
    }

    /// Marks from `roots` over the manifests in `refs`, loading (into `refs`) any reachable
    /// manifest not there yet: a root read after the listing may name a manifest written
    /// after it (a build that published meanwhile).
    ///
    /// A manifest named but absent (neither at its key nor its fossil key) refers to nothing
    /// in this mark and is not remembered in `refs`: a lease names its manifest before the
    /// manifest is written (after the objects it names, each leased already), so a later
    /// mark loads it again.
    async fn mark_from(
        &self,
        roots: &[ObjectRef],
        refs: &mut RefsOf,
        strict: bool,
    ) -> Result<HashSet<ObjectRef>, StoreError> {
        let mut absent: HashSet<ManifestDigest> = HashSet::new();
        loop {
            let mut unknown = Vec::new();
            let live = mark(roots.iter().copied(), |o| match o {
                ObjectRef::Manifest(d) => match refs.get(d) {
                    Some(Ok(r)) => Ok(r.clone()),
                    Some(Err(_)) if !strict => Ok(Vec::new()),
                    Some(Err(reason)) => Err(GcError::Unreadable {
                        object: d.key(),
                        reason: reason.clone(),
                    }),
                    None if absent.contains(d) => Ok(Vec::new()),
                    None => {
                        unknown.push(*d);
                        Ok(Vec::new())
                    }
                },
                _ => Ok(Vec::new()),
            })?;
            if unknown.is_empty() {
                return Ok(live);
            }
            for d in unknown {
                match self.get_manifest(&d).await {
                    Ok(m) => {
                        refs.insert(d, Ok(references(&m)));
                    }
                    // Named but absent: nothing further to keep now (verify reports it if
                    // it stays so).
                    Err(StoreError::Backend(e)) if e.is_not_found() => {
                        absent.insert(d);
                    }
                    Err(e) => {
                        refs.insert(d, Err(e.to_string()));
                    }
                }
            }
        }
    }

    /// What manifest `d` refers to, or why it cannot be read.
    async fn manifest_refs(&self, d: &ManifestDigest) -> Result<Vec<ObjectRef>, String> {
        match self.get_manifest(d).await {
            Ok(m) => Ok(references(&m)),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Roots from OCI references ([`crate::ociref`], written by the builder's `kiln pull`
    /// and `kiln import`): the OCI manifest or index blob each names, and every blob that
    /// reaches ([`Store::oci_closure`]: config, layers, stored index children).
    ///
    /// Errors (when `strict`): [`GcError::Unreadable`] for a reference that cannot be read or
    /// does not hold a digest, as for tags.
    async fn oci_ref_roots(&self, strict: bool) -> Result<Vec<ObjectRef>, StoreError> {
        let mut roots = Vec::new();
        for (r, d) in self.list_oci_refs().await? {
            let d = match d {
                Ok(d) => d,
                Err(reason) if strict => return Err(unreadable(&r.key(), reason)),
                Err(_) => continue,
            };
            let c = self.oci_closure(d, strict).await?;
            roots.extend(c.blobs.into_iter().map(ObjectRef::Blob));
        }
        Ok(roots)
    }

    /// Runs GC (see the module doc). Errors: [`GcError::Busy`] when another GC runs,
    /// [`GcError::Unreadable`] before anything moves, [`GcError::LockLost`], backend errors
    /// (a run stopped by one leaves fossils that the next run judges).
    pub async fn gc(&self, opts: &GcOptions) -> Result<GcReport, StoreError> {
        if opts.dry_run {
            return self.gc_with(opts, None).await;
        }
        let lock = GcLock::take(self).await?;
        let r = self.gc_with(opts, Some(&lock)).await;
        let released = lock.release().await;
        let report = r?;
        released?;
        Ok(report)
    }

    /// [`Store::gc`] under `lock` (`None`: a dry run).
    async fn gc_with(
        &self,
        opts: &GcOptions,
        lock: Option<&GcLock>,
    ) -> Result<GcReport, StoreError> {
        let Marked {
            live,
            objects,
            expired,
            expired_parts,
            lock: sweep,
            mut refs,
        } = self.mark_live(opts, true, true).await?;
        let cutoff = SystemTime::now()
            .checked_sub(opts.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let mut report = GcReport {
            marked: live.len(),
            dry_run: opts.dry_run,
            expired,
            ..GcReport::default()
        };
        let mut doomed: Vec<(ObjectRef, u64)> = Vec::new();
        for o in &objects {
            let Some(r) = ObjectRef::from_key(&o.key) else {
                continue;
            };
            if live.contains(&r) {
                continue;
            }
            if o.modified > cutoff {
                report.young_kept += 1;
            } else {
                doomed.push((r, o.size));
            }
        }
        // Manifests first, then blobs, then chunks: no manifest left under its key ever
        // names a condemned object.
        doomed.sort_by_key(|(r, _)| kind_order(r));
        let swept: HashSet<ManifestDigest> = match lock {
            None => {
                report.collected = doomed
                    .iter()
                    .map(|(r, size)| Collected {
                        key: r.key(),
                        size: *size,
                    })
                    .collect();
                manifests_of(&report.collected)
            }
            Some(lock) => {
                // Phase 1: condemn.
                for (r, _) in &doomed {
                    lock.check()?;
                    let key = r.key();
                    match self.backend.rename(&key, &fossil_key(&key)).await {
                        Ok(()) => report.condemned += 1,
                        // Gone meanwhile (another store handle's delete of a stray object).
                        Err(e) if e.is_not_found() => {}
                        Err(e) => return Err(e.into()),
                    }
                    if let ObjectRef::Chunk(d) = r {
                        self.known.forget(d);
                    }
                }
                // Phase 2: mark again, then judge every fossil.
                lock.check()?;
                let again = self.gather_roots(opts, true).await?;
                let live = self.mark_from(&again.roots, &mut refs, true).await?;
                self.judge_fossils(&live, lock, &mut report).await?;
                manifests_of(&report.collected)
            }
        };
        // Image cache entries of the manifests swept now (listed after the sweep: an entry
        // written meanwhile names a manifest some lease or tag keeps, so not one of these).
        if !swept.is_empty() {
            for o in self.backend.list("images/").await? {
                let k = o.key.trim_start_matches("images/");
                if let Ok(Some(e)) = self.get_image_entry(k).await
                    && swept.contains(&e.manifest)
                {
                    report.expired.push(o.key.clone());
                }
            }
        }
        if let Some(lock) = lock {
            lock.check()?;
            for k in &report.expired {
                self.backend.delete(k).await?;
            }
            for k in &expired_parts {
                self.backend.delete(k).await?;
            }
        }
        // Writers need not wait for the compaction: it never changes which keys exist.
        drop(sweep);
        // Compaction, after every delete and still under the GC lock.
        report.compacted = match lock {
            None => {
                let doomed: Vec<String> = report.collected.iter().map(|c| c.key.clone()).collect();
                self.backend.compact(true, &doomed).await?
            }
            Some(lock) => {
                lock.check()?;
                self.backend.compact(false, &[]).await?
            }
        };
        Ok(report)
    }

    /// Phase 2's verdict on every fossil: put back those whose object is in `live` (chunks
    /// first, then blobs, then manifests), delete the rest (manifests first).
    async fn judge_fossils(
        &self,
        live: &HashSet<ObjectRef>,
        lock: &GcLock,
        report: &mut GcReport,
    ) -> Result<(), StoreError> {
        let mut keep = Vec::new();
        let mut doomed = Vec::new();
        for f in self.backend.list(FOSSIL_PREFIX).await? {
            // Anything else under the prefix is no fossil of ours: left alone.
            let Some(r) = unfossil(&f.key).and_then(ObjectRef::from_key) else {
                continue;
            };
            if live.contains(&r) {
                keep.push((r, f));
            } else {
                doomed.push((r, f));
            }
        }
        keep.sort_by_key(|(r, _)| std::cmp::Reverse(kind_order(r)));
        for (r, f) in keep {
            lock.check()?;
            let key = r.key();
            if self.backend.head(&key).await?.is_none() {
                self.backend.rename(&f.key, &key).await?;
            } else {
                self.backend.delete(&f.key).await?;
            }
            report.resurrected.push(key);
        }
        doomed.sort_by_key(|(r, _)| kind_order(r));
        for (r, f) in doomed {
            lock.check()?;
            self.backend.delete(&f.key).await?;
            if let ObjectRef::Chunk(d) = r {
                self.known.forget(&d);
            }
            report.collected.push(Collected {
                key: r.key(),
                size: f.size,
            });
        }
        Ok(())
    }
}

/// Sweep order: manifests, blobs, chunks.
fn kind_order(r: &ObjectRef) -> u8 {
    match r {
        ObjectRef::Manifest(_) => 0,
        ObjectRef::Blob(_) => 1,
        ObjectRef::Chunk(_) => 2,
    }
}

/// The manifests among `collected`.
fn manifests_of(collected: &[Collected]) -> HashSet<ManifestDigest> {
    collected
        .iter()
        .filter_map(|c| match ObjectRef::from_key(&c.key) {
            Some(ObjectRef::Manifest(d)) => Some(d),
            _ => None,
        })
        .collect()
}

/// The GC lock held by this run ([`GC_LOCK_KEY`]), renewed in the background every
/// [`GC_LOCK_RENEW`]. A renewal that finds the lock taken over, or that has not succeeded
/// by the lock's expiry, marks it lost: [`GcLock::check`] then fails before the next move or
/// delete.
struct GcLock {
    store: Store,
    state: Arc<Mutex<LockState>>,
    stop: Arc<tokio::sync::Notify>,
    /// `None` once released.
    renewer: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for GcLock {
    fn drop(&mut self) {
        // A GC cancelled before `release` (its future dropped): stop renewing, so the lock
        // expires.
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
    }
}

#[derive(Debug)]
struct LockState {
    version: Version,
    expires: u64,
    lost: bool,
}

/// A fresh lock record for this process, expiring [`GC_LOCK_TTL`] from now.
fn lock_record() -> LeaseRecord {
    LeaseRecord {
        id: "gc".into(),
        expires: unix_now() + GC_LOCK_TTL.as_secs(),
        host: hostname(),
        objects: Default::default(),
        owner: Some(LeaseOwner::current()),
    }
}

fn encode_lock(r: &LeaseRecord) -> bytes::Bytes {
    // Serializing these plain types cannot fail.
    bytes::Bytes::from(serde_json::to_vec(r).unwrap_or_default())
}

impl GcLock {
    /// Takes the lock: creates it if absent; takes it over (compare-and-swap on the version
    /// read) if its holder is not live ([`LeaseRecord::is_live`]) or it does not parse.
    /// Errors: [`GcError::Busy`] when a live holder has it, backend errors.
    async fn take(store: &Store) -> Result<GcLock, StoreError> {
        let backend = &store.backend;
        let mut attempts = 0;
        let (version, expires) = loop {
            attempts += 1;
            let mine = lock_record();
            match backend
                .compare_and_swap(GC_LOCK_KEY, None, encode_lock(&mine))
                .await
            {
                Ok(v) => break (v, mine.expires),
                Err(BackendError::Conflict { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            let (bytes, held) = match backend.get_versioned(GC_LOCK_KEY).await {
                Ok(x) => x,
                // Released between the two requests: try again.
                Err(e) if e.is_not_found() && attempts < 3 => continue,
                Err(e) => return Err(e.into()),
            };
            let holder = serde_json::from_slice::<LeaseRecord>(&bytes).ok();
            if let Some(h) = &holder
                && h.is_live(unix_now())
            {
                return Err(busy(store, h));
            }
            match backend
                .compare_and_swap(GC_LOCK_KEY, Some(&held), encode_lock(&mine))
                .await
            {
                Ok(v) => break (v, mine.expires),
                Err(BackendError::Conflict { .. }) if attempts < 3 => continue,
                Err(BackendError::Conflict { .. }) => {
                    return Err(match holder {
                        Some(h) => busy(store, &h),
                        None => GcError::Busy {
                            store: store.url().to_string(),
                            host: "unknown".into(),
                            pid: 0,
                            expires: 0,
                        }
                        .into(),
                    });
                }
                Err(e) => return Err(e.into()),
            }
        };
        let state = Arc::new(Mutex::new(LockState {
            version,
            expires,
            lost: false,
        }));
        let stop = Arc::new(tokio::sync::Notify::new());
        let renewer = tokio::spawn(renew(store.clone(), state.clone(), stop.clone()));
        Ok(GcLock {
            store: store.clone(),
            state,
            stop,
            renewer: Some(renewer),
        })
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, LockState> {
        // Never held across a panic point; recover anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Errors: [`GcError::LockLost`] once the lock is lost or past its expiry unrenewed.
    fn check(&self) -> Result<(), StoreError> {
        let s = self.lock_state();
        if s.lost || s.expires <= unix_now() {
            return Err(GcError::LockLost {
                store: self.store.url().to_string(),
            }
            .into());
        }
        Ok(())
    }

    /// Stops renewing and deletes the lock if it is still this run's.
    async fn release(mut self) -> Result<(), StoreError> {
        // Let a renewal in flight finish first, so none lands after the delete.
        self.stop.notify_one();
        if let Some(r) = self.renewer.take() {
            let _ = r.await;
        }
        let lost = self.lock_state().lost;
        if !lost {
            self.store.backend.delete(GC_LOCK_KEY).await?;
        }
        Ok(())
    }
}

/// [`GcLock`]'s renewal loop.
async fn renew(store: Store, state: Arc<Mutex<LockState>>, stop: Arc<tokio::sync::Notify>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(GC_LOCK_RENEW) => {}
            _ = stop.notified() => return,
        }
        let version = state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .version
            .clone();
        let mine = lock_record();
        let r = store
            .backend
            .compare_and_swap(GC_LOCK_KEY, Some(&version), encode_lock(&mine))
            .await;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        match r {
            Ok(v) => {
                s.version = v;
                s.expires = mine.expires;
            }
            Err(BackendError::Conflict { .. }) => {
                s.lost = true;
                return;
            }
            // Tried again at the next tick; `check` fails once the expiry passes.
            Err(e) => tracing::warn!(error = %e, "cannot renew the GC lock"),
        }
    }
}

fn busy(store: &Store, holder: &LeaseRecord) -> StoreError {
    GcError::Busy {
        store: store.url().to_string(),
        host: holder.host.clone(),
        pid: holder.owner.as_ref().map_or(0, |o| o.process.pid),
        expires: holder.expires,
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_follows_edges_once_and_stops_on_error() {
        let graph: HashMap<u32, Vec<u32>> = [
            (1, vec![2, 3]),
            (2, vec![4]),
            (3, vec![4, 1]), // cycle back to 1
            (4, vec![]),
            (5, vec![6]), // unreachable
            (6, vec![]),
        ]
        .into_iter()
        .collect();
        let mut calls = 0;
        let live = mark([1u32], |n| {
            calls += 1;
            Ok::<_, ()>(graph[n].clone())
        })
        .unwrap();
        assert_eq!(live, HashSet::from([1, 2, 3, 4]));
        assert_eq!(calls, 4);
        let live = mark([6u32, 6], |n| Ok::<_, ()>(graph[n].clone())).unwrap();
        assert_eq!(live, HashSet::from([6]));
        assert!(
            mark(Vec::<u32>::new(), |_| Err::<Vec<u32>, _>("x"))
                .unwrap()
                .is_empty()
        );
        let err = mark([1u32], |n| {
            if *n == 4 {
                Err("bad 4")
            } else {
                Ok(graph[n].clone())
            }
        });
        assert_eq!(err, Err("bad 4"));
    }

    /// A corrupt tag or cache entry must stop GC, not silently drop the image it keeps alive.
    #[tokio::test]
    async fn an_unreadable_root_stops_gc_before_any_delete() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8 + 1).collect();
        let (table, _) = store
            .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
            .await
            .unwrap();
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table)))
            .await
            .unwrap();
        let t: crate::TagRef = "img:v1".parse().unwrap();
        store.set_tag(&t, None, raw.digest).await.unwrap();
        let layer = store
            .put_blob(bytes::Bytes::from_static(b"layer"))
            .await
            .unwrap();
        store.put_cache_entry("step1", layer.digest).await.unwrap();
        let opts = GcOptions {
            grace: Duration::ZERO,
            ..GcOptions::default()
        };
        // Objects: manifest and blob files, and chunks (packed: listed through the backend).
        let count = || async {
            let mut n = 0;
            for p in ["manifests", "blobs"] {
                for e in walkdir(&dir.path().join(p)) {
                    n += usize::from(e.is_file());
                }
            }
            n + store.backend.list("chunks/").await.unwrap().len()
        };
        let before = count().await;
        assert!(before >= 3);
        // Damage the tag (a torn write, a bad disk, a tenant's edit).
        std::fs::write(dir.path().join("tags/img/v1"), b"{ not json").unwrap();
        let err = store.gc(&opts).await.unwrap_err();
        assert!(err.to_string().contains("tags/img/v1"), "{err}");
        assert_eq!(count().await, before);
        // Damage a cache entry instead.
        store.set_tag(&t, None, raw.digest).await.ok();
        std::fs::remove_file(dir.path().join("tags/img/v1")).unwrap();
        store.set_tag(&t, None, raw.digest).await.unwrap();
        std::fs::write(dir.path().join("cache/step1"), b"\x00\x01").unwrap();
        let err = store.gc(&opts).await.unwrap_err();
        assert!(err.to_string().contains("cache/step1"), "{err}");
        assert_eq!(count().await, before);
    }

    /// A local backend that watches the order of writes: every content-addressed object
    /// written must already be named by a lease object; and `on_lease_list` runs once, the
    /// first time the leases are listed (GC's read of its roots, after its listing).
    struct Watched {
        inner: crate::backend::local::LocalBackend,
        unleased_writes: std::sync::Mutex<Vec<String>>,
        on_lease_list: std::sync::Mutex<Option<LeaseListHook>>,
    }

    type LeaseListHook = Box<
        dyn FnOnce(
                Vec<crate::backend::ObjectInfo>,
            )
                -> futures::future::BoxFuture<'static, Vec<crate::backend::ObjectInfo>>
            + Send,
    >;

    impl std::fmt::Debug for Watched {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Watched")
                .field("inner", &self.inner)
                .finish()
        }
    }

    impl Watched {
        async fn leased(&self) -> HashSet<String> {
            let mut out = HashSet::new();
            for o in self.inner.list("leases/").await.unwrap() {
                let b = self.inner.get(&o.key).await.unwrap();
                let r: crate::lease::LeaseRecord = serde_json::from_slice(&b).unwrap();
                out.extend(r.objects);
            }
            out
        }

        async fn check(&self, key: &str) {
            if ObjectRef::from_key(key).is_some() && !self.leased().await.contains(key) {
                self.unleased_writes.lock().unwrap().push(key.to_string());
            }
        }
    }

    #[async_trait::async_trait]
    impl Backend for Watched {
        fn url(&self) -> &str {
            self.inner.url()
        }
        async fn get(&self, key: &str) -> Result<bytes::Bytes, crate::BackendError> {
            self.inner.get(key).await
        }
        async fn get_range(
            &self,
            key: &str,
            r: std::ops::Range<u64>,
        ) -> Result<bytes::Bytes, crate::BackendError> {
            self.inner.get_range(key, r).await
        }
        async fn get_versioned(
            &self,
            key: &str,
        ) -> Result<(bytes::Bytes, crate::backend::Version), crate::BackendError> {
            self.inner.get_versioned(key).await
        }
        async fn head(
            &self,
            key: &str,
        ) -> Result<Option<crate::backend::ObjectInfo>, crate::BackendError> {
            self.inner.head(key).await
        }
        async fn put_if_absent(
            &self,
            key: &str,
            data: bytes::Bytes,
            expect: Option<crate::digest::Sha256Hash>,
        ) -> Result<crate::backend::PutOutcome, crate::BackendError> {
            self.check(key).await;
            self.inner.put_if_absent(key, data, expect).await
        }
        async fn put_file_if_absent(
            &self,
            key: &str,
            path: &std::path::Path,
            expect: Option<crate::digest::Sha256Hash>,
        ) -> Result<crate::backend::PutOutcome, crate::BackendError> {
            self.check(key).await;
            self.inner.put_file_if_absent(key, path, expect).await
        }
        async fn put(
            &self,
            key: &str,
            data: bytes::Bytes,
        ) -> Result<crate::backend::Version, crate::BackendError> {
            self.check(key).await;
            self.inner.put(key, data).await
        }
        async fn compare_and_swap(
            &self,
            key: &str,
            expected: Option<&crate::backend::Version>,
            data: bytes::Bytes,
        ) -> Result<crate::backend::Version, crate::BackendError> {
            self.inner.compare_and_swap(key, expected, data).await
        }
        async fn list(
            &self,
            prefix: &str,
        ) -> Result<Vec<crate::backend::ObjectInfo>, crate::BackendError> {
            let l = self.inner.list(prefix).await?;
            let hook = if prefix == "leases/" {
                self.on_lease_list.lock().unwrap().take()
            } else {
                None
            };
            Ok(match hook {
                Some(h) => h(l).await,
                None => l,
            })
        }
        async fn delete(&self, key: &str) -> Result<(), crate::BackendError> {
            self.inner.delete(key).await
        }
        async fn rename(&self, from: &str, to: &str) -> Result<(), crate::BackendError> {
            self.inner.rename(from, to).await
        }
        fn stage_batch(&self) -> crate::backend::StageBatch {
            self.inner.stage_batch()
        }
        async fn stage_if_absent(
            &self,
            batch: &crate::backend::StageBatch,
            key: &str,
            data: bytes::Bytes,
        ) -> Result<crate::backend::Staged, crate::BackendError> {
            self.check(key).await;
            self.inner.stage_if_absent(batch, key, data).await
        }
        async fn commit_staged(
            &self,
            batch: crate::backend::StageBatch,
            staged: Vec<crate::backend::StagedPut>,
        ) -> Result<Vec<crate::backend::PutOutcome>, crate::BackendError> {
            self.inner.commit_staged(batch, staged).await
        }
        async fn discard_staged(
            &self,
            batch: crate::backend::StageBatch,
            staged: Vec<crate::backend::StagedPut>,
        ) {
            self.inner.discard_staged(batch, staged).await
        }
    }

    async fn watched(dir: &std::path::Path) -> (std::sync::Arc<Watched>, Store) {
        let w = std::sync::Arc::new(Watched {
            inner: crate::backend::local::LocalBackend::open(dir)
                .await
                .unwrap(),
            unleased_writes: Default::default(),
            on_lease_list: Default::default(),
        });
        let store = Store::from_backend(w.clone(), crate::StoreOptions::default());
        (w, store)
    }

    /// 1 MiB of pseudo-random bytes (xorshift from `seed`): several distinct chunks.
    fn data(seed: u32) -> Vec<u8> {
        let mut x = 0x9e37_79b9u32 ^ seed;
        (0..1u32 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    /// Every chunk and the manifest an upload under a lease writes is in the lease before it
    /// is written, so a GC at any moment sees it leased.
    #[tokio::test]
    async fn every_object_is_leased_before_it_is_written() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().unwrap();
        let (w, store) = watched(dir.path()).await;
        let lease = std::sync::Arc::new(
            store
                .create_lease("upload", Duration::from_secs(600), [])
                .await
                .unwrap(),
        );
        let opts = PutArtifactOptions {
            lease: Some(lease.clone()),
            ..Default::default()
        };
        let (table, _) = store
            .put_artifact_reader(std::io::Cursor::new(data(7)), &opts)
            .await
            .unwrap();
        assert!(table.entries.iter().filter(|e| e.digest.is_some()).count() > 2);
        let raw = lease
            .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
            .await
            .unwrap();
        let blob = bytes::Bytes::from_static(b"a blob");
        let b = crate::digest::BlobDigest(crate::digest::Sha256Hash::of(&blob));
        lease.add([ObjectRef::Blob(b)]).await.unwrap();
        store.put_blob(blob).await.unwrap();
        assert!(
            w.unleased_writes.lock().unwrap().is_empty(),
            "{:?}",
            w.unleased_writes
        );
        // Written without a lease, the watcher sees it.
        store
            .put_blob(bytes::Bytes::from_static(b"unleased"))
            .await
            .unwrap();
        assert_eq!(w.unleased_writes.lock().unwrap().len(), 1);
        let gc = GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        };
        store.gc(&gc).await.unwrap();
        assert!(store.has(&ObjectRef::Manifest(raw.digest)).await.unwrap());
        for e in &table.entries {
            if let Some(d) = e.digest {
                assert!(store.has(&ObjectRef::Chunk(d)).await.unwrap());
            }
        }
    }

    /// Issue 39: a build-cache entry's inputs record (`cache-inputs/<key>`) and its index
    /// copy (`cache-index/<id>`) are collected by GC when the entry is; a record whose entry
    /// is gone is collected too; while the entry lives, both stay.
    #[tokio::test]
    async fn a_cache_entrys_inputs_record_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let layer = store
            .put_blob(bytes::Bytes::from_static(b"layer"))
            .await
            .unwrap();
        store.put_cache_entry("step1", layer.digest).await.unwrap();
        let record = bytes::Bytes::from_static(b"{\"inputs\":1}");
        store
            .put_cache_inputs("step1", Some("pos1"), record.clone())
            .await
            .unwrap();
        store
            .put_cache_inputs("orphan", None, record.clone())
            .await
            .unwrap();
        let kept = store
            .gc(&GcOptions {
                grace: Duration::ZERO,
                ..GcOptions::default()
            })
            .await
            .unwrap();
        assert_eq!(kept.expired, ["cache-inputs/orphan"]);
        assert_eq!(
            store.get_cache_inputs("step1").await.unwrap(),
            Some(record.clone())
        );
        assert_eq!(store.get_cache_index("pos1").await.unwrap(), Some(record));
        assert_eq!(store.get_cache_inputs("orphan").await.unwrap(), None);
        let gone = store
            .gc(&GcOptions {
                grace: Duration::ZERO,
                cache_ttl: Duration::ZERO,
                dry_run: false,
            })
            .await
            .unwrap();
        let mut expired = gone.expired.clone();
        expired.sort();
        assert_eq!(
            expired,
            ["cache-index/pos1", "cache-inputs/step1", "cache/step1"]
        );
        assert!(store.get_cache_entry("step1").await.unwrap().is_none());
        assert_eq!(store.get_cache_inputs("step1").await.unwrap(), None);
        assert_eq!(store.get_cache_index("pos1").await.unwrap(), None);
    }

    /// Issue 16: an image cache entry (`images/<key>`) is not a GC root: the image it names
    /// is swept once no tag keeps it, and the entry goes with it; an entry whose image a tag
    /// keeps stays.
    #[tokio::test]
    async fn image_cache_entries_go_with_the_images_gc_sweeps() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let mut digests = Vec::new();
        for n in [1u32, 2] {
            let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8 + n as u8).collect();
            let (table, _) = store
                .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
                .await
                .unwrap();
            let raw = store
                .put_manifest(&Manifest::Image(ImageManifest::new(table)))
                .await
                .unwrap();
            store
                .put_image_entry(&format!("key{n}"), raw.digest)
                .await
                .unwrap();
            digests.push(raw.digest);
        }
        let t: crate::TagRef = "img:kept".parse().unwrap();
        store.set_tag(&t, None, digests[1]).await.unwrap();
        let opts = GcOptions {
            grace: Duration::ZERO,
            ..GcOptions::default()
        };
        let report = store.gc(&opts).await.unwrap();
        assert!(
            report.expired.contains(&"images/key1".to_string()),
            "{report:?}"
        );
        assert!(!store.has(&ObjectRef::Manifest(digests[0])).await.unwrap());
        assert_eq!(store.get_image_entry("key1").await.unwrap(), None);
        let kept = store.get_image_entry("key2").await.unwrap().expect("kept");
        assert_eq!(kept.manifest, digests[1]);
    }

    /// GC lists the objects, then reads the leases: a lease taken between the two (a build
    /// that leases chunk X after GC listed it) is seen, and X is kept.
    #[tokio::test]
    async fn gc_sees_a_lease_taken_after_it_listed_the_objects() {
        let dir = tempfile::tempdir().unwrap();
        let (w, store) = watched(dir.path()).await;
        let (x, _) = store.put_chunk(bytes::Bytes::from(data(3))).await.unwrap();
        let x = ObjectRef::Chunk(x.digest);
        let leaser = store.clone();
        *w.on_lease_list.lock().unwrap() = Some(Box::new(move |_listed| {
            Box::pin(async move {
                // GC has listed chunks (X among them, unreferenced); now a build leases X.
                let l = leaser
                    .create_lease("late", Duration::from_secs(600), [])
                    .await
                    .unwrap();
                l.add([x]).await.unwrap();
                leaser.backend.inner().list("leases/").await.unwrap()
            })
        }));
        let gc = GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        };
        let r = store.gc(&gc).await.unwrap();
        assert!(store.has(&x).await.unwrap(), "{r:?}");
        assert!(r.collected.is_empty(), "{r:?}");
    }

    /// The race "GC lists unreferenced chunk X; a build sees X exists and skips writing it;
    /// GC deletes X": a build that leases X after GC read the leases looks for X under the
    /// sweep lock, so it waits for the sweep, never finding X present-then-deleted. (Its
    /// lease, written before GC's second phase read the leases, makes that phase put X
    /// back, so the look-up then finds X.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reuse_look_up_during_a_sweep_never_finds_what_the_sweep_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let (w, store) = watched(dir.path()).await;
        let (x, _) = store.put_chunk(bytes::Bytes::from(data(5))).await.unwrap();
        let x = ObjectRef::Chunk(x.digest);
        let reuser = store.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        *w.on_lease_list.lock().unwrap() = Some(Box::new(move |listed| {
            Box::pin(async move {
                // GC holds the leases it read (X not among them); a build now leases X and
                // looks for it.
                let lease = reuser
                    .create_lease("reuser", Duration::from_secs(600), [])
                    .await
                    .unwrap();
                let look = tokio::spawn(async move {
                    let found = lease.find_present(&[x]).await.unwrap();
                    (lease, found)
                });
                // Wait until its lease part is written: it is looking (or waiting to).
                while !reuser
                    .backend
                    .inner()
                    .list("leases/")
                    .await
                    .unwrap()
                    .iter()
                    .any(|o| o.key.starts_with("leases/reuser~"))
                {
                    tokio::task::yield_now().await;
                }
                let _ = tx.send(look);
                listed
            })
        }));
        let gc = GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        };
        let r = store.gc(&gc).await.unwrap();
        let (lease, found) = rx.await.unwrap().await.unwrap();
        assert_eq!(
            found.contains(&x),
            store.has(&x).await.unwrap(),
            "the look-up said {found:?}; GC: {r:?}"
        );
        assert_eq!(r.condemned, 1, "{r:?}");
        assert_eq!(r.resurrected, [x.key()], "{r:?}");
        assert!(found.contains(&x), "the sweep did not finish first: {r:?}");
        lease.release().await.unwrap();
    }

    /// One GC per store: a live holder's lock refuses a second GC (naming the holder), a
    /// dead holder's (same host, process gone) or an expired one is taken over, and a run
    /// removes its lock when done.
    #[tokio::test]
    async fn the_gc_lock_refuses_a_second_gc_and_is_taken_over_from_a_dead_one() {
        use crate::owner::ProcessId;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let put_lock = |r: LeaseRecord| {
            let store = store.clone();
            async move {
                store
                    .backend
                    .put(GC_LOCK_KEY, encode_lock(&r))
                    .await
                    .unwrap();
            }
        };
        put_lock(lock_record()).await;
        let err = store.gc(&GcOptions::default()).await.unwrap_err();
        assert!(
            matches!(&err, StoreError::Gc(GcError::Busy { pid, .. }) if *pid == std::process::id()),
            "{err:?}"
        );
        assert!(err.to_string().contains("another GC is running"), "{err}");
        // A dry run takes no lock.
        store
            .gc(&GcOptions {
                dry_run: true,
                ..Default::default()
            })
            .await
            .unwrap();

        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start_ticks = crate::owner::start_ticks(pid).unwrap_or(1);
        child.wait().unwrap();
        let mut dead = lock_record();
        dead.owner = Some(LeaseOwner {
            process: ProcessId { pid, start_ticks },
            ..LeaseOwner::current()
        });
        put_lock(dead).await;
        store.gc(&GcOptions::default()).await.unwrap();
        assert!(store.backend.head(GC_LOCK_KEY).await.unwrap().is_none());

        let mut expired = lock_record();
        expired.host = "elsewhere".into();
        expired.owner = None;
        expired.expires = unix_now() - 1;
        put_lock(expired).await;
        store.gc(&GcOptions::default()).await.unwrap();
        assert!(store.backend.head(GC_LOCK_KEY).await.unwrap().is_none());
    }

    /// A tagged image whose manifest and one chunk sit at their fossil keys (a GC stopped
    /// between its phases, after a build relied on them): writers see them absent, readers
    /// and verify find them, and the next GC puts them back.
    #[tokio::test]
    async fn fossils_are_read_through_and_the_next_gc_puts_back_what_is_marked() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let bytes = data(11);
        let (table, _) = store
            .put_artifact_reader(
                std::io::Cursor::new(bytes.clone()),
                &PutArtifactOptions::default(),
            )
            .await
            .unwrap();
        let raw = store
            .put_manifest(&Manifest::Image(ImageManifest::new(table.clone())))
            .await
            .unwrap();
        let m = ObjectRef::Manifest(raw.digest);
        let c = ObjectRef::Chunk(table.entries[0].digest.unwrap());
        for o in [m, c] {
            store
                .backend
                .rename(&o.key(), &fossil_key(&o.key()))
                .await
                .unwrap();
        }
        // A manifest that is a fossil can be tagged (a build's publish during a GC).
        let t: crate::TagRef = "img:v1".parse().unwrap();
        store.set_tag(&t, None, raw.digest).await.unwrap();
        assert!(!store.has(&c).await.unwrap() && !store.has(&m).await.unwrap());
        let found = store.exist(&[c, m]).await.unwrap();
        assert_eq!(found, [false, false], "writers never see fossils");
        let out = dir.path().join("out");
        let Manifest::Image(im) = store.get_manifest(&raw.digest).await.unwrap() else {
            panic!("not an image")
        };
        store.materialize(&im.disk, &out, None).await.unwrap();
        assert!(std::fs::read(&out).unwrap() == bytes);
        let v = store.verify(true, &GcOptions::default()).await.unwrap();
        assert!(v.is_ok(), "{:?}", v.findings);
        assert_eq!(v.fossils, 2);
        assert!(v.orphans.is_empty(), "{:?}", v.orphans);

        let r = store
            .gc(&GcOptions {
                grace: Duration::ZERO,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut back = r.resurrected.clone();
        back.sort();
        let mut want = vec![m.key(), c.key()];
        want.sort();
        assert_eq!(back, want, "{r:?}");
        assert!(r.collected.is_empty(), "{r:?}");
        assert!(store.has(&c).await.unwrap() && store.has(&m).await.unwrap());
        assert!(store.backend.list(FOSSIL_PREFIX).await.unwrap().is_empty());
        let v = store.verify(true, &GcOptions::default()).await.unwrap();
        assert!(v.is_ok() && v.fossils == 0, "{v:?}");
    }

    fn walkdir(p: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                let path = e.path();
                if path.is_dir() {
                    out.extend(walkdir(&path));
                } else {
                    out.push(path);
                }
            }
        }
        out
    }

    /// What a killed import leaves in a local store's `.tmp` (its staged chunks: up to the
    /// whole artifact's stored size, e.g. 133 MB of 1,663 files for a 200 MB image killed
    /// 1.5 s in) is reclaimed when the store is next opened, as `kiln store gc` opens it:
    /// the files of a writer that is gone go, those of a live writer (an import in flight)
    /// stay, whatever their age.
    #[tokio::test]
    async fn gc_reclaims_staged_files_a_killed_import_left_in_tmp() {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().to_str().unwrap().to_string();
        Store::open(&url).await.unwrap();
        let tmp = dir.path().join(".tmp");
        // A writer that is gone: a child process, reaped; named as the backend names its
        // temp files (pid, start time, pid namespace).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let ticks = crate::owner::start_ticks(pid).unwrap_or(1);
        child.wait().unwrap();
        let ns = crate::owner::pid_namespace().unwrap();
        let dead = tmp.join(format!("p{pid}s{ticks}n{ns}-0-1796434403609641437"));
        let me = crate::owner::ProcessId::current().token();
        let live = tmp.join(format!("{me}n{ns}-1-1796434403609641438"));
        for p in [&dead, &live] {
            std::fs::write(p, vec![7u8; 64 << 10]).unwrap();
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(std::time::SystemTime::now() - Duration::from_secs(7200))
                .unwrap();
        }
        let store = Store::open(&url).await.unwrap();
        store.gc(&GcOptions::default()).await.unwrap();
        assert!(
            live.exists(),
            "a live writer's temp file (an import in flight) is kept"
        );
        assert!(
            !dead.exists(),
            "a killed import's temp file is left for good"
        );
    }

    /// GC of one of two images that share chunks (the second is a quarter of the first
    /// plus new bytes, so its upload reused that quarter and its pack holds only its new
    /// chunks): the first image's pack is three quarters dead, so it is compacted, and the
    /// packs' bytes on disk come down to the stored bytes of the live chunks. The store is
    /// verify-clean, the live image reads back whole; a dry run had said what would go.
    #[tokio::test]
    async fn gc_compacts_the_pack_of_a_collected_image() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let first: Vec<u8> = (0..8).flat_map(|i| data(100 + i)).collect();
        let second: Vec<u8> = first[..2 << 20]
            .iter()
            .copied()
            .chain(data(200))
            .chain(data(201))
            .collect();
        let mut digests = Vec::new();
        for (bytes, tag) in [(&first, "img:a"), (&second, "img:b")] {
            let (table, _) = store
                .put_artifact_reader(
                    std::io::Cursor::new(bytes.clone()),
                    &PutArtifactOptions::default(),
                )
                .await
                .unwrap();
            let raw = store
                .put_manifest(&Manifest::Image(ImageManifest::new(table)))
                .await
                .unwrap();
            store
                .set_tag(&tag.parse().unwrap(), None, raw.digest)
                .await
                .unwrap();
            digests.push(raw.digest);
        }
        let pack_bytes = || -> u64 {
            walkdir(&dir.path().join(".packs"))
                .iter()
                .filter(|p| p.extension().is_some_and(|e| e == "pack"))
                .map(|p| std::fs::metadata(p).unwrap().len())
                .sum()
        };
        let stored = || async {
            store
                .backend
                .list("chunks/")
                .await
                .unwrap()
                .iter()
                .map(|o| o.size)
                .sum::<u64>()
        };
        let before = pack_bytes();
        assert_eq!(before, stored().await, "every chunk packed, no dead bytes");
        store.untag(&"img:a".parse().unwrap(), None).await.unwrap();
        let opts = GcOptions {
            grace: Duration::ZERO,
            ..GcOptions::default()
        };
        let dry = store
            .gc(&GcOptions {
                dry_run: true,
                ..opts
            })
            .await
            .unwrap();
        assert_eq!(dry.compacted.packs, 1, "{:?}", dry.compacted);
        assert_eq!(pack_bytes(), before, "a dry run changes nothing");
        let r = store.gc(&opts).await.unwrap();
        assert!(!r.collected.is_empty());
        assert_eq!(r.compacted.packs, 1, "{:?}", r.compacted);
        let after = pack_bytes();
        let live = stored().await;
        assert_eq!(after, live, "{:?}", r.compacted);
        assert_eq!(r.compacted.bytes_reclaimed, dry.compacted.bytes_reclaimed);
        assert_eq!(before - after, r.compacted.bytes_reclaimed);
        assert!(after < before / 2, "before {before}, after {after}");
        eprintln!(
            "pack bytes before GC {before}, after {after} (live chunks' stored bytes {live}); {:?}",
            r.compacted
        );
        let v = store.verify(true, &GcOptions::default()).await.unwrap();
        assert!(v.is_ok(), "{:?}", v.findings);
        assert_eq!(v.pack_dead_bytes, 0);
        assert!(v.orphans.is_empty(), "{:?}", v.orphans);
        let Manifest::Image(im) = store.get_manifest(&digests[1]).await.unwrap() else {
            panic!("not an image")
        };
        let out = dir.path().join("out");
        store.materialize(&im.disk, &out, None).await.unwrap();
        assert!(std::fs::read(&out).unwrap() == second);
        // Nothing left to compact.
        let again = store.gc(&opts).await.unwrap();
        assert_eq!(again.compacted, crate::backend::CompactReport::default());
    }
}
