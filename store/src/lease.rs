//! Leases and build-cache entries: the two kinds of GC root besides tags.
//!
//! A lease (`leases/<id>`, JSON [`LeaseRecord`]) is what an in-flight build or push relies on:
//! every object key it uploaded or found present, and an expiry (unix seconds). GC treats the
//! objects of unexpired leases as live, and deletes expired lease objects. A lease is written
//! before the objects it protects are looked up, and rewritten (unconditional put: one owner)
//! as objects are added.
//!
//! A build-cache entry (`cache/<key>`, JSON [`CacheEntry`]) maps a build step's cache key to
//! the layer blob it produced, with its creation time; it is a GC root for
//! [`DEFAULT_CACHE_TTL`] (configurable in [`crate::gc::GcOptions`]).

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, validate_key};
use crate::digest::BlobDigest;
use crate::manifest::ObjectRef;
use crate::owner::{LeaseOwner, Liveness};
use crate::{Store, StoreError, hostname, unix_now};

/// How long a build-cache entry keeps its layer alive (14 days).
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(14 * 24 * 3600);

/// Errors about leases and cache entries.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// An id or cache key that is not one `[A-Za-z0-9._-]` key segment (max 200 bytes).
    #[error("invalid lease id or cache key {0:?}")]
    InvalidId(String),
    /// A lease or cache object that does not parse.
    #[error("{key} in {store}: corrupt: {reason}")]
    Corrupt {
        /// The object key.
        key: String,
        /// The store.
        store: String,
        /// The parser's message.
        reason: String,
    },
}

/// Largest lease object read, bytes (256 MiB: a lease names each object once, about 80
/// bytes a chunk, so this covers some 3 million chunks). Bigger is corrupt or planted.
pub const MAX_LEASE_LEN: u64 = 256 << 20;

/// Largest build-cache entry read, bytes (an entry is a digest and a time, under 200 bytes).
pub const MAX_CACHE_ENTRY_LEN: u64 = 4096;

impl Store {
    /// Reads `key` whole if it is at most `max` bytes (never loading more than `max + 1`);
    /// `None` when absent.
    async fn get_small(&self, key: &str, max: u64) -> Result<Option<Bytes>, StoreError> {
        let b = match self.backend.get_range(key, 0..max + 1).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if b.len() as u64 > max {
            return Err(LeaseError::Corrupt {
                key: key.to_string(),
                store: self.url().to_string(),
                reason: format!("over the {max}-byte limit"),
            }
            .into());
        }
        Ok(Some(b))
    }
}

fn check_id(id: &str) -> Result<(), LeaseError> {
    if id.len() <= 200 && !id.contains('/') && !id.contains('~') && validate_key(id).is_ok() {
        Ok(())
    } else {
        Err(LeaseError::InvalidId(id.to_string()))
    }
}

/// What `leases/<id>` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRecord {
    /// The lease id.
    pub id: String,
    /// Expiry, unix seconds.
    pub expires: u64,
    /// Host holding it.
    pub host: String,
    /// Object keys relied on (`chunks/sha256/<hex>`, ...).
    pub objects: BTreeSet<String>,
    /// The process holding it; absent in leases written before owners were recorded (those
    /// live until they expire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<LeaseOwner>,
}

impl LeaseRecord {
    /// Whether GC must still honour it at `now` (unix seconds): not expired, and its owner
    /// not known to be dead ([`LeaseOwner::liveness`]: only a process on the owner's host,
    /// boot and pid namespace can know that, so a store shared by several hosts keeps another
    /// host's lease until it expires).
    pub fn is_live(&self, now: u64) -> bool {
        self.expires > now
            && self
                .owner
                .as_ref()
                .is_none_or(|o| o.liveness() != Liveness::Dead)
    }

    /// Objects as references (keys that are not content-addressed are skipped).
    pub fn refs(&self) -> Vec<ObjectRef> {
        self.objects
            .iter()
            .filter_map(|k| ObjectRef::from_key(k))
            .collect()
    }
}

/// A lease held by this process. Dropping it does not release it (it expires); call
/// [`Lease::release`] when done.
#[derive(Debug)]
pub struct Lease {
    store: Store,
    record: tokio::sync::Mutex<LeaseRecord>,
}

impl Lease {
    /// The lease id.
    pub async fn id(&self) -> String {
        self.record.lock().await.id.clone()
    }

    /// Adds objects and rewrites the lease object.
    pub async fn add(&self, objs: impl IntoIterator<Item = ObjectRef>) -> Result<(), StoreError> {
        let mut r = self.record.lock().await;
        let before = r.objects.len();
        r.objects.extend(objs.into_iter().map(|o| o.key()));
        if r.objects.len() != before {
            self.store.write_lease(&r).await?;
        }
        Ok(())
    }

    /// Moves the expiry to `ttl` from now.
    pub async fn renew(&self, ttl: Duration) -> Result<(), StoreError> {
        let mut r = self.record.lock().await;
        r.expires = unix_now() + ttl.as_secs();
        self.store.write_lease(&r).await
    }

    /// Deletes the lease object (the handle stays usable: a later `add` recreates it).
    pub async fn release(&self) -> Result<(), StoreError> {
        let id = self.record.lock().await.id.clone();
        Ok(self.store.backend.delete(&format!("leases/{id}")).await?)
    }
}

/// What `cache/<key>` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheEntry {
    /// The layer blob the step produced.
    pub layer: BlobDigest,
    /// When written, unix seconds.
    pub time: u64,
}

impl Store {
    async fn write_lease(&self, r: &LeaseRecord) -> Result<(), StoreError> {
        // Serializing these plain types cannot fail.
        let bytes = Bytes::from(serde_json::to_vec(r).unwrap_or_default());
        self.backend.put(&format!("leases/{}", r.id), bytes).await?;
        Ok(())
    }

    /// Creates (or replaces) lease `id` expiring `ttl` from now, holding `objs`.
    pub async fn create_lease(
        &self,
        id: &str,
        ttl: Duration,
        objs: impl IntoIterator<Item = ObjectRef>,
    ) -> Result<Lease, StoreError> {
        check_id(id)?;
        let record = LeaseRecord {
            id: id.to_string(),
            expires: unix_now() + ttl.as_secs(),
            host: hostname(),
            objects: objs.into_iter().map(|o| o.key()).collect(),
            owner: Some(LeaseOwner::current()),
        };
        self.write_lease(&record).await?;
        Ok(Lease {
            store: self.clone(),
            record: tokio::sync::Mutex::new(record),
        })
    }

    /// Every lease (expired ones included); corrupt lease objects are errors, since GC must
    /// not guess what they protect.
    pub async fn list_leases(&self) -> Result<Vec<LeaseRecord>, StoreError> {
        let mut out = Vec::new();
        for o in self.backend.list("leases/").await? {
            let Some(bytes) = self.get_small(&o.key, MAX_LEASE_LEN).await? else {
                continue;
            };
            let r: LeaseRecord =
                serde_json::from_slice(&bytes).map_err(|e| LeaseError::Corrupt {
                    key: o.key.clone(),
                    store: self.url().to_string(),
                    reason: e.to_string(),
                })?;
            out.push(r);
        }
        Ok(out)
    }

    /// Deletes every lease that is no longer live ([`LeaseRecord::is_live`]: expired, or
    /// held by a process of this host that has died, such as a killed build) and returns
    /// their keys (`leases/<id>`). What they held is left for GC. A corrupt lease object is
    /// an error, as in [`Store::list_leases`].
    pub async fn release_dead_leases(&self) -> Result<Vec<String>, StoreError> {
        let now = unix_now();
        let mut released = Vec::new();
        for l in self.list_leases().await? {
            if !l.is_live(now) {
                let key = format!("leases/{}", l.id);
                self.backend.delete(&key).await?;
                released.push(key);
            }
        }
        Ok(released)
    }

    /// Writes build-cache entry `cache/<key>` → `layer`, stamped now. `key` is one key
    /// segment (`[A-Za-z0-9._-]`, e.g. the hex of the step's cache digest).
    pub async fn put_cache_entry(&self, key: &str, layer: BlobDigest) -> Result<(), StoreError> {
        check_id(key)?;
        let e = CacheEntry {
            layer,
            time: unix_now(),
        };
        // Serializing these plain types cannot fail.
        let bytes = Bytes::from(serde_json::to_vec(&e).unwrap_or_default());
        self.backend.put(&format!("cache/{key}"), bytes).await?;
        Ok(())
    }

    /// Reads build-cache entry `key`, `None` when absent.
    pub async fn get_cache_entry(&self, key: &str) -> Result<Option<CacheEntry>, StoreError> {
        check_id(key)?;
        let k = format!("cache/{key}");
        let Some(b) = self.get_small(&k, MAX_CACHE_ENTRY_LEN).await? else {
            return Ok(None);
        };
        Ok(Some(serde_json::from_slice(&b).map_err(|e| {
            LeaseError::Corrupt {
                key: k,
                store: self.url().to_string(),
                reason: e.to_string(),
            }
        })?))
    }

    /// Every build-cache entry as (key, entry); corrupt ones are skipped with a warning.
    pub async fn list_cache_entries(&self) -> Result<Vec<(String, CacheEntry)>, StoreError> {
        let mut out = Vec::new();
        for o in self.backend.list("cache/").await? {
            let key = o.key.trim_start_matches("cache/").to_string();
            match self.get_cache_entry(&key).await {
                Ok(Some(e)) => out.push((key, e)),
                Ok(None) => {}
                Err(e) => tracing::warn!(key, error = %e, "skipping cache entry"),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::ProcessId;

    /// A lease whose owner died on this host (a killed build) is released by GC and by
    /// [`Store::release_dead_leases`] long before it expires, and stops holding its objects;
    /// the same lease recorded by another host is left to its expiry.
    #[tokio::test]
    async fn a_dead_owners_lease_is_released_before_it_expires() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start_ticks = crate::owner::start_ticks(pid).unwrap_or(1);
        child.wait().unwrap();
        let dead = LeaseOwner {
            process: ProcessId { pid, start_ticks },
            ..LeaseOwner::current()
        };
        let blob = store.put_blob(Bytes::from_static(b"held")).await.unwrap();
        let other_blob = store
            .put_blob(Bytes::from_static(b"held elsewhere"))
            .await
            .unwrap();
        let lease = |id: &str, owner: LeaseOwner, b: BlobDigest| LeaseRecord {
            id: id.to_string(),
            expires: unix_now() + 3600,
            host: owner.host.clone(),
            objects: [ObjectRef::Blob(b).key()].into(),
            owner: Some(owner),
        };
        let mine = lease("killed-build", dead.clone(), blob.digest);
        let theirs = lease(
            "other-host",
            LeaseOwner {
                host: format!("{}-elsewhere", dead.host),
                ..dead.clone()
            },
            other_blob.digest,
        );
        store.write_lease(&mine).await.unwrap();
        store.write_lease(&theirs).await.unwrap();
        let live = store
            .create_lease("alive", Duration::from_secs(3600), [])
            .await
            .unwrap();
        assert!(!mine.is_live(unix_now()));
        assert!(theirs.is_live(unix_now()));

        let gc = crate::gc::GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        };
        let report = store.gc(&gc).await.unwrap();
        assert_eq!(report.expired, vec!["leases/killed-build".to_string()]);
        assert!(!store.has(&ObjectRef::Blob(blob.digest)).await.unwrap());
        assert!(
            store
                .has(&ObjectRef::Blob(other_blob.digest))
                .await
                .unwrap()
        );
        let mut ids: Vec<String> = store
            .list_leases()
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.id)
            .collect();
        ids.sort();
        assert_eq!(ids, ["alive", "other-host"]);

        store.write_lease(&mine).await.unwrap();
        assert_eq!(
            store.release_dead_leases().await.unwrap(),
            ["leases/killed-build"]
        );
        assert_eq!(store.list_leases().await.unwrap().len(), 2);
        live.release().await.unwrap();
    }

    /// Huge planted lease or cache objects are named errors, never loaded whole; GC stops.
    #[tokio::test]
    async fn oversized_lease_and_cache_objects_are_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let layer = store.put_blob(Bytes::from_static(b"layer")).await.unwrap();
        store.put_cache_entry("k", layer.digest).await.unwrap();
        assert!(store.get_cache_entry("k").await.unwrap().is_some());
        assert!(store.get_cache_entry("absent").await.unwrap().is_none());
        let plant = |key: &str| {
            // 1 TiB, sparse.
            std::fs::File::create(dir.path().join(key))
                .unwrap()
                .set_len(1 << 40)
                .unwrap();
        };
        plant("cache/k");
        let err = store.get_cache_entry("k").await.unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        let gc = crate::gc::GcOptions::default();
        assert!(store.gc(&gc).await.is_err());
        std::fs::remove_file(dir.path().join("cache/k")).unwrap();
        std::fs::create_dir_all(dir.path().join("leases")).unwrap();
        plant("leases/l");
        let err = store.list_leases().await.unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        assert!(store.gc(&gc).await.is_err());
        assert!(store.has(&ObjectRef::Blob(layer.digest)).await.unwrap());
    }
}
