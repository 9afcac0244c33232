//! Garbage collection: a pure mark over references, and a separate sweep.
//!
//! [`mark`] takes roots and a "what does this refer to" function and returns the live set;
//! it never touches storage (unit-tested on an in-memory graph). [`Store::gc`] gathers the
//! roots — every tag's manifest, every object of a live lease ([`crate::lease::LeaseRecord::is_live`]), the layer of every
//! build-cache entry younger than [`GcOptions::cache_ttl`], every OCI image an OCI reference
//! reference ([`crate::ociref`]) names (its manifest or index, config and layers) — loads every manifest in the store
//! to answer `refs_of`, marks, then sweeps: only unmarked chunks, blobs and manifests last
//! modified more than [`GcOptions::grace`] ago are deleted (manifests first, so no surviving
//! manifest ever names a deleted chunk), after re-reading the leases to spare anything a
//! push leased meanwhile. A reachable manifest that cannot be read stops GC before any
//! delete. Leases no longer live (expired, or their owner died) and expired cache entries are
//! deleted too. `dry_run` deletes nothing and
//! returns the same report.

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
    /// Leases no longer live (expired, or held by a dead process of this host) and expired
    /// cache entries, removed (or that would be).
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
    pub(crate) expired: Vec<String>,
}

impl Store {
    /// Gathers roots, loads manifests and marks. Shared by GC and verify.
    ///
    /// `strict`: a reachable manifest that cannot be read stops marking (GC); otherwise it
    /// is treated as referring to nothing (verify, which reports it separately).
    pub(crate) async fn mark_live(
        &self,
        opts: &GcOptions,
        strict: bool,
    ) -> Result<Marked, StoreError> {
        let now = unix_now();
        let mut roots = Vec::new();
        let mut expired = Vec::new();
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
        for l in self.list_leases().await? {
            if l.is_live(now) {
                roots.extend(l.refs());
            } else {
                expired.push(format!("leases/{}", l.id));
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
        let mut objects = Vec::new();
        for p in ["manifests/", "blobs/", "chunks/"] {
            objects.extend(self.backend.list(p).await?);
        }
        // Load every manifest present; remember failures (they matter only if reachable).
        let mut refs: HashMap<ManifestDigest, Result<Vec<ObjectRef>, String>> = HashMap::new();
        for o in &objects {
            if let Some(ObjectRef::Manifest(d)) = ObjectRef::from_key(&o.key) {
                let r = match self.get_manifest(&d).await {
                    Ok(m) => Ok(references(&m)),
                    Err(e) => Err(e.to_string()),
                };
                refs.insert(d, r);
            }
        }
        let live = mark(roots, |o| match o {
            ObjectRef::Manifest(d) => match refs.get(d) {
                Some(Ok(r)) => Ok(r.clone()),
                Some(Err(_)) if !strict => Ok(Vec::new()),
                Some(Err(reason)) => Err(GcError::Unreadable {
                    object: d.key(),
                    reason: reason.clone(),
                }),
                // Named but absent: nothing further to keep (verify reports it).
                None => Ok(Vec::new()),
            },
            _ => Ok(Vec::new()),
        })?;
        Ok(Marked {
            live,
            objects,
            expired,
        })
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
        } = self.mark_live(opts, true).await?;
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
        // Spare anything a lease taken during marking relies on.
        let now = unix_now();
        let leased: HashSet<ObjectRef> = self
            .list_leases()
            .await?
            .into_iter()
            .filter(|l| l.is_live(now))
            .flat_map(|l| l.refs())
            .collect();
        doomed.retain(|(r, _)| !leased.contains(r));
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
        if !opts.dry_run {
            for k in &report.expired {
                self.backend.delete(k).await?;
            }
        }
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
