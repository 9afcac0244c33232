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
//!    [`Backend::rename_many`], up to [`GC_BATCH`] objects of one kind per call: a rename
//!    each locally; on S3 the destinations written, then the packed sources marked dead (a
//!    pack left serving nothing retired whole instead, as compaction would), then the loose
//!    sources deleted), manifests first. Nothing is deleted yet.
//! 2. *Delete.* Once every move is done, the roots are gathered again (leases, then tags,
//!    cache entries, OCI references) and marked again, loading any manifest published
//!    meanwhile. Every fossil (this run's, and any a crashed run left) whose object is now
//!    marked is put back under its own key (unless an object is there already) and every
//!    other fossil is deleted, manifests first ([`Backend::delete_many`]: on S3 one
//!    DeleteObjects request per [`GC_BATCH`] fossils).
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
//! Packs change what "present under its key" means, not the argument. In both backends a
//! chunk may live in a pack (local: [`crate::backend::local`], "Packs"; S3:
//! [`crate::backend::s3`], "Packs"), present while its pack's index names it and no
//! deletion does; the condemn step copies it to its fossil key as a loose object and *then*
//! records the deletion (a dead file's entry locally, a dead marker object on S3), so an
//! interruption leaves both, never neither. Batching keeps that order per object: on S3 a
//! call of [`Backend::rename_many`] writes every fossil of the call before any of its dead
//! markers, and deletes loose sources only after their markers, so each object still goes
//! through the same three writes in the same order, each returned before the next begins. What the argument needs of a look-up, that a
//! writer finding X present saw the store as of after its lease, holds because a hit is
//! always checked against the store itself when it is asked: locally an `lstat` of the
//! pack's dead file (the sweep lock serialises it besides), on S3 a LIST of the pack's dead
//! markers and index, never the process's cached map. A stale miss only makes the writer
//! write X again (a new pack entry or loose object), which is the second case above.
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

/// Moves to fossil keys (phase 1) and deletes of fossils (phase 2) a GC run hands the backend
/// in one call ([`Backend::rename_many`], [`Backend::delete_many`]), within one kind of object
/// (manifests, blobs, chunks: the kinds still go one after the other): 1,000, what one S3
/// DeleteObjects request takes. Each object's move or delete is independent of the others'
/// (see the module doc), so only their order by kind matters. The local backend (and any
/// backend without calls of its own on many objects) makes them [`crate::backend::MANY_IN_FLIGHT`]
/// (64) at a time. On S3 a call reads the packed chunks by spans of their packs, writes
/// their fossils, lists `packs/` once, writes their dead markers and deletes any loose copies
/// with one DeleteObjects: about two requests per packed chunk, where one move at a time was
/// about six (a ranged GET and a HEAD, a PUT of the fossil, a listing of `packs/`, a PUT of
/// the dead marker, a DELETE of any loose copy), and a fossil's delete is a thousandth of a
/// request. Measured (issue 35, `kiln/tests/vm_lazy.rs`'s last `kiln store gc`: about 870
/// objects of one snapshot on the test S3 server, moto, 2 cores): one move at a time the run
/// took 40 and 43 s; 64 single moves in flight, 19 to 21 s; in calls of 1,000 (then about
/// 1,160 chunks, 400 of them loose), 5.4 and 5.6 s, two runs at load 2.5 to 4, with 32 or 64
/// writes in flight in the S3 backend alike: what is left is the server's time per request.
pub const GC_BATCH: usize = 1000;

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
                // Phase 1: condemn, one kind after the other (the order above), GC_BATCH
                // moves of one kind per call of the backend.
                for kind in [0, 1, 2] {
                    let of_kind: Vec<ObjectRef> = doomed
                        .iter()
                        .filter(|(r, _)| kind_order(r) == kind)
                        .map(|(r, _)| *r)
                        .collect();
                    for batch in of_kind.chunks(GC_BATCH) {
                        report.condemned += self.condemn(lock, batch).await?;
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

    /// Phase 1's move of each of `refs` to its fossil key, under `lock`, with one
    /// [`Backend::rename_many`]. Returns how many were moved (not: gone meanwhile, another
    /// store handle's delete of a stray object). Errors: the first failed move (after every
    /// other move of the call is done).
    async fn condemn(&self, lock: &GcLock, refs: &[ObjectRef]) -> Result<usize, StoreError> {
        lock.check()?;
        let pairs: Vec<(String, String)> = refs
            .iter()
            .map(|r| {
                let key = r.key();
                let fossil = fossil_key(&key);
                (key, fossil)
            })
            .collect();
        let mut moved = 0;
        let mut failed = None;
        for (r, res) in refs.iter().zip(self.backend.rename_many(&pairs).await) {
            match res {
                Ok(()) => moved += 1,
                Err(e) if e.is_not_found() => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            if let ObjectRef::Chunk(d) = r {
                self.known.forget(d);
            }
        }
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(moved),
        }
    }

    /// Phase 2's delete of the fossils `doomed` (object, fossil), under `lock`, with one
    /// [`Backend::delete_many`]. Errors: the first failed delete (after the others).
    async fn delete_fossils(
        &self,
        lock: &GcLock,
        doomed: &[(ObjectRef, crate::backend::ObjectInfo)],
    ) -> Result<Vec<Collected>, StoreError> {
        lock.check()?;
        let keys: Vec<String> = doomed.iter().map(|(_, f)| f.key.clone()).collect();
        let mut collected = Vec::with_capacity(doomed.len());
        let mut failed = None;
        for ((r, f), res) in doomed.iter().zip(self.backend.delete_many(&keys).await) {
            if let ObjectRef::Chunk(d) = r {
                self.known.forget(d);
            }
            match res {
                Ok(()) => collected.push(Collected {
                    key: r.key(),
                    size: f.size,
                }),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(collected),
        }
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
        // One kind after the other (manifests first), GC_BATCH deletes of one kind per call
        // of the backend.
        for kind in [0, 1, 2] {
            let of_kind: Vec<(ObjectRef, crate::backend::ObjectInfo)> = doomed
                .iter()
                .filter(|(r, _)| kind_order(r) == kind)
                .cloned()
                .collect();
            for batch in of_kind.chunks(GC_BATCH) {
                let collected = self.delete_fossils(lock, batch).await?;
                report.collected.extend(collected);
            }
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
mod tests;
