//! Garbage collection: a pure mark over references, and a separate sweep.
//!
//! [`mark`] takes roots and a "what does this refer to" function and returns the live set;
//! it never touches storage (unit-tested on an in-memory graph). [`Store::gc`] lists every
//! chunk, blob and manifest first; then takes the store's sweep lock (exclusive; see
//! [`crate::lease::Lease`]) and, in this order, gathers the roots: every object of a live
//! lease ([`crate::lease::LeaseRecord::is_live`]), every tag's manifest, the layer of every
//! build-cache entry younger than [`GcOptions::cache_ttl`], every OCI image an OCI reference
//! ([`crate::ociref`]) names (its manifest or index, config and layers). It loads every
//! listed manifest (and any root names that the listing missed) to answer `refs_of`, marks,
//! then sweeps: only listed, unmarked chunks, blobs and manifests last modified more than
//! [`GcOptions::grace`] ago are deleted (manifests first, so no surviving manifest ever
//! names a deleted chunk), and the lock is released after the last delete. A reachable
//! manifest that cannot be read stops GC before any delete. Leases no longer live
//! (expired, or their owner died) and expired cache entries are deleted too. `dry_run`
//! deletes nothing and returns the same report.
//!
//! Why an in-flight build or push loses nothing, whatever the grace period (even zero):
//! - *An object it writes.* It leases the object before writing it ([`crate::lease::Lease`]).
//!   GC deletes only objects it listed, so a deleted object was written, hence leased, before
//!   the listing, hence before GC read the leases. If the lease was still there, GC saw the
//!   object in it. If it was released, the holder had first moved its tag (publish order:
//!   objects, manifest, tag, then release), and GC reads the tags after the leases, so it
//!   marked the object from the tag. Either way it is live.
//! - *An object it reuses because it exists* (a base layer, a cache hit, a chunk deduplicated
//!   and so not written). The race is "GC lists X unreferenced; the build sees X and skips
//!   writing it; GC deletes X; the build publishes a manifest naming X". The build leases X
//!   first and then looks under the sweep lock (shared,
//!   [`crate::lease::Lease::find_present`]); GC reads the leases and deletes while holding
//!   that lock exclusively. So the look comes either wholly before GC's lease read (which
//!   then sees X leased and spares it) or wholly after GC's last delete (and then finds X
//!   gone, if GC took it, and writes it again).
//! - The sweep lock is a `flock(2)` in a local store's directory. An S3 store has no lock
//!   shared by every host, so there the second case is closed only by the grace period; the
//!   first holds on any store.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::backend::Backend;
use crate::digest::ManifestDigest;
use crate::lease::DEFAULT_CACHE_TTL;
use crate::manifest::{ObjectRef, references};
use crate::{Store, StoreError, unix_now};

pub use crate::ociref::MAX_OCI_MANIFEST_BYTES;

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
    /// Report only, delete nothing.
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
    /// The key.
    pub key: String,
    /// Stored size in bytes.
    pub size: u64,
}

/// What a GC run found and did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GcReport {
    /// Live objects marked.
    pub marked: usize,
    /// Unmarked objects kept because younger than the grace period.
    pub young_kept: usize,
    /// Unmarked objects older than the grace period: deleted, or listed in a dry run.
    pub collected: Vec<Collected>,
    /// Leases no longer live (expired, or held by a dead process of this host), expired
    /// cache entries and the image cache entries (`images/<key>`) of swept manifests,
    /// removed (or that would be).
    pub expired: Vec<String>,
    /// Whether this was a dry run.
    pub dry_run: bool,
}

/// A root or reachable object that cannot be read: marking stops (see [`GcError::Unreadable`]).
fn unreadable(object: &str, reason: impl ToString) -> StoreError {
    GcError::Unreadable {
        object: object.to_string(),
        reason: reason.to_string(),
    }
    .into()
}

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
        for o in self.backend.list("cache/").await? {
            let k = o.key.trim_start_matches("cache/").to_string();
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
            }
        }
        roots.extend(self.oci_ref_roots(strict).await?);
        // Load every manifest listed; remember failures (they matter only if reachable).
        let mut refs: HashMap<ManifestDigest, Result<Vec<ObjectRef>, String>> = HashMap::new();
        for o in &objects {
            if let Some(ObjectRef::Manifest(d)) = ObjectRef::from_key(&o.key) {
                refs.insert(d, self.manifest_refs(&d).await);
            }
        }
        // A root read after the listing may name a manifest written after it (a build that
        // published meanwhile): load those too, until nothing reachable is unknown.
        let live = loop {
            let mut unknown = Vec::new();
            let live = mark(roots.iter().copied(), |o| match o {
                ObjectRef::Manifest(d) => match refs.get(d) {
                    Some(Ok(r)) => Ok(r.clone()),
                    Some(Err(_)) if !strict => Ok(Vec::new()),
                    Some(Err(reason)) => Err(GcError::Unreadable {
                        object: d.key(),
                        reason: reason.clone(),
                    }),
                    None => {
                        unknown.push(*d);
                        Ok(Vec::new())
                    }
                },
                _ => Ok(Vec::new()),
            })?;
            if unknown.is_empty() {
                break live;
            }
            for d in unknown {
                let r = match self.manifest_refs(&d).await {
                    // Named but absent: nothing further to keep (verify reports it).
                    Err(_) if !self.has(&ObjectRef::Manifest(d)).await? => Ok(Vec::new()),
                    r => r,
                };
                refs.insert(d, r);
            }
        };
        Ok(Marked {
            live,
            objects,
            expired,
            expired_parts,
            lock,
        })
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

    /// Runs GC (see the module doc). Errors: [`GcError::Unreadable`] before any delete.
    pub async fn gc(&self, opts: &GcOptions) -> Result<GcReport, StoreError> {
        let Marked {
            live,
            objects,
            expired,
            expired_parts,
            lock,
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
        // Manifests first, then blobs, then chunks.
        doomed.sort_by_key(|(r, _)| match r {
            ObjectRef::Manifest(_) => 0,
            ObjectRef::Blob(_) => 1,
            ObjectRef::Chunk(_) => 2,
        });
        for (r, size) in doomed {
            if !opts.dry_run {
                self.backend.delete(&r.key()).await?;
                if let ObjectRef::Chunk(d) = r {
                    self.known.forget(&d);
                }
            }
            report.collected.push(Collected { key: r.key(), size });
        }
        // Image cache entries of the manifests swept now (listed after the sweep: an entry
        // written meanwhile names a manifest some lease or tag keeps, so not one of these).
        let swept: HashSet<ManifestDigest> = report
            .collected
            .iter()
            .filter_map(|c| match ObjectRef::from_key(&c.key) {
                Some(ObjectRef::Manifest(d)) => Some(d),
                _ => None,
            })
            .collect();
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
        if !opts.dry_run {
            for k in &report.expired {
                self.backend.delete(k).await?;
            }
            for k in &expired_parts {
                self.backend.delete(k).await?;
            }
        }
        drop(lock);
        Ok(report)
    }
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
        let count = || {
            let mut n = 0;
            for p in ["manifests", "chunks", "blobs"] {
                for e in walkdir(&dir.path().join(p)) {
                    n += usize::from(e.is_file());
                }
            }
            n
        };
        let before = count();
        assert!(before >= 3);
        // Damage the tag (a torn write, a bad disk, a tenant's edit).
        std::fs::write(dir.path().join("tags/img/v1"), b"{ not json").unwrap();
        let err = store.gc(&opts).await.unwrap_err();
        assert!(err.to_string().contains("tags/img/v1"), "{err}");
        assert_eq!(count(), before);
        // Damage a cache entry instead.
        store.set_tag(&t, None, raw.digest).await.ok();
        std::fs::remove_file(dir.path().join("tags/img/v1")).unwrap();
        store.set_tag(&t, None, raw.digest).await.unwrap();
        std::fs::write(dir.path().join("cache/step1"), b"\x00\x01").unwrap();
        let err = store.gc(&opts).await.unwrap_err();
        assert!(err.to_string().contains("cache/step1"), "{err}");
        assert_eq!(count(), before);
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
    /// sweep lock, so it waits for the sweep and finds X gone (and writes it), never
    /// present-then-deleted.
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
        assert!(
            !found.contains(&x),
            "the sweep ran first and deleted X: {r:?}"
        );
        lease.release().await.unwrap();
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
}
