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
//!
//! Beside each build-cache entry, the builder may write what its key was made from:
//! `cache-inputs/<key>` (opaque JSON to the store, the builder's `StepInputs`, at most
//! [`MAX_CACHE_INPUTS_LEN`] bytes), and a copy of it under `cache-index/<id>`, where `<id>`
//! names an earlier build's step (the builder's digest of a recipe position or of the
//! instruction text, scoped like the key), so that a step that misses the cache finds what
//! its nearest earlier build used in one read. Neither is a GC root: GC deletes a
//! `cache-inputs/<key>` when it deletes `cache/<key>` (or finds no such entry), and a
//! `cache-index/<id>` written longer ago than the cache entries' time to live, as its entry
//! then is.
//!
//! An image cache entry (`images/<key>`, JSON [`ImageCacheEntry`]) maps what an ext4 image
//! is made from (the builder's flatten key: layers, file-system options, flattener version)
//! to the image manifest published for it, so a rebuild with the same key reuses that
//! manifest instead of flattening again. It is not a GC root: the tags and leases that keep
//! the manifest keep it useful, GC deletes the entries of the manifests it sweeps, and a
//! reader checks that the manifest and everything it names are present before relying on
//! it (an entry can outlive its manifest on a store swept by an older kiln).

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, validate_key};
use crate::digest::{BlobDigest, ManifestDigest};

use crate::manifest::{Manifest, ObjectRef, RawManifest};
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

/// Largest build-cache or image cache entry read, bytes (an entry is a digest and a time,
/// under 200 bytes).
pub const MAX_CACHE_ENTRY_LEN: u64 = 4096;

/// Largest `cache-inputs/<key>` or `cache-index/<id>` object written or read, bytes (4 MiB:
/// the builder bounds its file list at 10,000 names).
pub const MAX_CACHE_INPUTS_LEN: u64 = 4 << 20;

/// The prefix of the inputs records of build-cache entries (see the module doc).
pub const CACHE_INPUTS_PREFIX: &str = "cache-inputs/";

/// The prefix of the index of inputs records by earlier step (see the module doc).
pub const CACHE_INDEX_PREFIX: &str = "cache-index/";

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
///
/// The rule every writer follows (as containerd's leases, whose resources are added to the
/// lease before they are written): an object goes into the lease *before* it is written
/// ([`Lease::add`], [`Lease::add_blocking`], [`Lease::put_manifest`]), and an object that is
/// to be reused because it already exists is leased *before* it is looked up, with the look-up
/// made under the store's sweep lock ([`Lease::find_present`], [`Lease::hold_blocking`]).
/// Why that is enough against [`Store::gc`] with any grace period is said in [`crate::gc`].
///
/// Each [`Lease::add`] writes one more object, `leases/<id>~<n>` (`~` is never in an id),
/// holding only the objects not yet recorded, so adds never rewrite what earlier ones wrote
/// and need no ordering among themselves; [`Store::list_leases`] merges them into the record
/// `leases/<id>`; each part carries the record's expiry and owner as well, so a part whose
/// record is gone still ends as the lease would.
#[derive(Debug)]
pub struct Lease {
    store: Store,
    record: std::sync::Mutex<LeaseRecord>,
    /// Objects durably recorded (in the record or a written part).
    recorded: std::sync::Mutex<BTreeSet<String>>,
    next_part: std::sync::atomic::AtomicU64,
}

impl Lease {
    /// The lease id.
    pub async fn id(&self) -> String {
        self.lock_record().id.clone()
    }

    fn lock_record(&self) -> std::sync::MutexGuard<'_, LeaseRecord> {
        // Never held across a panic point; recover anyway.
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The part to write for `objs`: the record with only the objects not yet recorded, and
    /// its key; `None` when all are recorded.
    fn part(&self, objs: impl IntoIterator<Item = ObjectRef>) -> Option<(String, LeaseRecord)> {
        let recorded = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        let new: BTreeSet<String> = objs
            .into_iter()
            .map(|o| o.key())
            .filter(|k| !recorded.contains(k))
            .collect();
        drop(recorded);
        if new.is_empty() {
            return None;
        }
        let mut part = self.lock_record().clone();
        part.objects = new;
        let n = self
            .next_part
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some((format!("leases/{}~{n}", part.id), part))
    }

    /// Marks a written part's objects as recorded. Only after the write: a concurrent add
    /// of the same object writes it again rather than returning before it is durable.
    fn recorded(&self, part: LeaseRecord) {
        self.recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(part.objects);
    }

    /// Adds objects: when this returns, a lease object naming them is written, so GC keeps
    /// them. Call it before writing them (see the type's doc).
    pub async fn add(&self, objs: impl IntoIterator<Item = ObjectRef>) -> Result<(), StoreError> {
        let Some((key, part)) = self.part(objs) else {
            return Ok(());
        };
        self.store.backend.put(&key, encode_record(&part)).await?;
        self.recorded(part);
        Ok(())
    }

    /// Whether the lease is on a local store directory (where [`Lease::add_blocking`] works).
    pub fn is_local(&self) -> bool {
        self.store.local_root().is_some()
    }

    /// [`Lease::add`] from blocking code, for a local store (the builder's blob cache is that
    /// store's directory). Errors: the store is not a local directory, or the write failed.
    pub fn add_blocking(
        &self,
        objs: impl IntoIterator<Item = ObjectRef>,
    ) -> Result<(), StoreError> {
        let Some((key, part)) = self.part(objs) else {
            return Ok(());
        };
        let root = self.store.local_root().ok_or_else(|| {
            StoreError::io(
                self.store.url(),
                std::io::Error::other("a lease is added from blocking code only on a local store"),
            )
        })?;
        let backend = crate::backend::local::LocalBackend::open_blocking(&root)?;
        backend.put_blocking(&key, &encode_record(&part))?;
        self.recorded(part);
        Ok(())
    }

    /// Leases `objs`, then, under the store's sweep lock (shared), tells which of them exist:
    /// those can be relied on without writing them (they stay until the lease is released).
    /// Leasing first closes the race "GC finds X unreferenced; the caller sees X and skips
    /// writing it; GC deletes X": GC only moves X to its fossil key before it reads the
    /// leases again, so a look that found X had leased it in time for that second read, and
    /// GC puts X back (see [`crate::gc`]). On a local store the lock closes it as well (a
    /// sweep that began before the lock was taken has finished; one that begins after reads
    /// the leases afterwards and sees X).
    pub async fn find_present(
        &self,
        objs: &[ObjectRef],
    ) -> Result<std::collections::HashSet<ObjectRef>, StoreError> {
        self.add(objs.iter().copied()).await?;
        let _lock = self.store.sweep_lock(false).await?;
        let found = self.store.exist(objs).await?;
        Ok(objs
            .iter()
            .zip(found)
            .filter(|(_, p)| *p)
            .map(|(o, _)| *o)
            .collect())
    }

    /// [`Lease::find_present`] for blocking code on a local store, with the caller's own
    /// look-up: leases `objs` ([`Lease::add_blocking`]), then runs `look` under the sweep
    /// lock (shared) and returns what it returns. For a store that is not a local directory
    /// (whose GC never touches this machine's files) `look` runs without either.
    ///
    /// It blocks the calling thread while a GC of the store sweeps; a process that runs GC
    /// itself must not call it from every worker of the runtime that GC needs.
    pub fn hold_blocking<T>(
        &self,
        objs: impl IntoIterator<Item = ObjectRef>,
        look: impl FnOnce() -> T,
    ) -> Result<T, StoreError> {
        let Some(root) = self.store.local_root() else {
            return Ok(look());
        };
        self.add_blocking(objs)?;
        let _lock = SweepLock::take(&root, false)?;
        Ok(look())
    }

    /// Stores manifest `m` after leasing it (the object is named by its digest, known before
    /// the write). Returns the stored form.
    pub async fn put_manifest(&self, m: &Manifest) -> Result<RawManifest, StoreError> {
        let raw = RawManifest::encode(m)?;
        self.add([ObjectRef::Manifest(raw.digest)]).await?;
        self.store.put_raw_manifest(&raw).await?;
        Ok(raw)
    }

    /// Moves the expiry to `ttl` from now (rewrites the record; the parts follow it).
    pub async fn renew(&self, ttl: Duration) -> Result<(), StoreError> {
        let r = {
            let mut r = self.lock_record();
            r.expires = unix_now() + ttl.as_secs();
            r.clone()
        };
        self.store.write_lease(&r).await
    }

    /// Deletes the lease: its record, then its parts. The handle stays usable: a later `add`
    /// records its objects again.
    pub async fn release(&self) -> Result<(), StoreError> {
        let r = self.lock_record().clone();
        self.store
            .backend
            .delete(&format!("leases/{}", r.id))
            .await?;
        let n = self.next_part.load(std::sync::atomic::Ordering::Relaxed);
        for i in 0..n {
            self.store
                .backend
                .delete(&format!("leases/{}~{i}", r.id))
                .await?;
        }
        self.recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.lock_record().objects.clear();
        Ok(())
    }
}

/// The store's sweep lock: a `flock(2)` on `<root>/.locks/%sweep` of a local store (the
/// name is the flattened form of the key `/sweep`, which no object can have, so it never
/// meets a compare-and-swap lock). [`Store::gc`] holds it exclusively from reading the leases
/// to its last delete; [`Lease::find_present`] and [`Lease::hold_blocking`] hold it shared
/// while they look. The OS drops it when the holder dies. A store that is not a local
/// directory has none, and needs none: GC's fossil step closes the same race on every store
/// (see [`crate::gc`]).
#[derive(Debug)]
pub(crate) struct SweepLock(#[allow(dead_code)] Option<std::fs::File>);

impl SweepLock {
    /// Blocks until the lock on the local store at `root` is held (`exclusive` or shared).
    pub(crate) fn take(root: &std::path::Path, exclusive: bool) -> Result<SweepLock, StoreError> {
        let dir = root.join(".locks");
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::io(&dir, e))?;
        let path = dir.join("%sweep");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| StoreError::io(&path, e))?;
        if exclusive { f.lock() } else { f.lock_shared() }.map_err(|e| StoreError::io(&path, e))?;
        Ok(SweepLock(Some(f)))
    }
}

fn encode_record(r: &LeaseRecord) -> Bytes {
    // Serializing these plain types cannot fail.
    Bytes::from(serde_json::to_vec(r).unwrap_or_default())
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

/// What `images/<key>` holds (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageCacheEntry {
    /// The image manifest published for the key.
    pub manifest: ManifestDigest,
    /// When written, unix seconds.
    pub time: u64,
}

impl Store {
    async fn write_lease(&self, r: &LeaseRecord) -> Result<(), StoreError> {
        self.backend
            .put(&format!("leases/{}", r.id), encode_record(r))
            .await?;
        Ok(())
    }

    /// The root directory when this store is a local directory (`file://<root>`).
    pub fn local_root(&self) -> Option<std::path::PathBuf> {
        self.url()
            .strip_prefix("file://")
            .map(std::path::PathBuf::from)
    }

    /// Takes the sweep lock ([`SweepLock`]); a no-op guard for a store that is not local.
    pub(crate) async fn sweep_lock(&self, exclusive: bool) -> Result<SweepLock, StoreError> {
        let Some(root) = self.local_root() else {
            return Ok(SweepLock(None));
        };
        tokio::task::spawn_blocking(move || SweepLock::take(&root, exclusive))
            .await
            .map_err(|e| StoreError::io("sweep lock", std::io::Error::other(e)))?
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
            recorded: std::sync::Mutex::new(record.objects.clone()),
            record: std::sync::Mutex::new(record),
            next_part: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Writes lease `id` held by no process ([`LeaseRecord::owner`] absent): `objs`,
    /// expiring `ttl` from now, replacing what `leases/<id>` held. For what a queued job of a
    /// cluster relies on (a build's uploaded context, which any node may run): whichever
    /// process comes next renews it by writing it again, and deletes it
    /// ([`Store::delete_shared_lease`]) when the job is over. GC cannot ask an owner whether
    /// it still needs it, so only its expiry ends it. Such a lease has no parts.
    pub async fn put_shared_lease(
        &self,
        id: &str,
        ttl: Duration,
        objs: impl IntoIterator<Item = ObjectRef>,
    ) -> Result<(), StoreError> {
        check_id(id)?;
        self.write_lease(&LeaseRecord {
            id: id.to_string(),
            expires: unix_now() + ttl.as_secs(),
            host: hostname(),
            objects: objs.into_iter().map(|o| o.key()).collect(),
            owner: None,
        })
        .await
    }

    /// Deletes lease `id` written by [`Store::put_shared_lease`] (nothing when absent).
    pub async fn delete_shared_lease(&self, id: &str) -> Result<(), StoreError> {
        check_id(id)?;
        self.backend.delete(&format!("leases/{id}")).await?;
        Ok(())
    }

    /// Every lease (expired ones included), each record merged with its parts
    /// (`leases/<id>~<n>`, see [`Lease`]); parts whose record is gone (a released lease)
    /// are dropped. Corrupt lease objects are errors, since GC must not guess what they
    /// protect.
    pub async fn list_leases(&self) -> Result<Vec<LeaseRecord>, StoreError> {
        Ok(self
            .list_lease_objects()
            .await?
            .into_iter()
            .map(|(_, r, _)| r)
            .collect())
    }

    /// Every lease: the record's key, the record with the objects of its parts merged in,
    /// and the parts' keys. A part whose record is gone (a release in progress, or one a
    /// crash interrupted) stands as a lease of its own under its own key, which its owner and
    /// expiry end as any other.
    pub(crate) async fn list_lease_objects(
        &self,
    ) -> Result<Vec<(String, LeaseRecord, Vec<String>)>, StoreError> {
        let mut records: std::collections::BTreeMap<String, (String, LeaseRecord, Vec<String>)> =
            Default::default();
        let mut parts: Vec<(String, LeaseRecord)> = Vec::new();
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
            if o.key.contains('~') {
                parts.push((o.key, r));
            } else {
                records.insert(r.id.clone(), (o.key, r, Vec::new()));
            }
        }
        let mut orphans = Vec::new();
        for (key, p) in parts {
            match records.get_mut(&p.id) {
                Some((_, r, keys)) => {
                    r.objects.extend(p.objects);
                    keys.push(key);
                }
                None => orphans.push((key, p, Vec::new())),
            }
        }
        Ok(records.into_values().chain(orphans).collect())
    }

    /// Deletes every lease that is no longer live ([`LeaseRecord::is_live`]: expired, or
    /// held by a process of this host that has died, such as a killed build) and returns
    /// their keys (`leases/<id>`). What they held is left for GC. A corrupt lease object is
    /// an error, as in [`Store::list_leases`].
    pub async fn release_dead_leases(&self) -> Result<Vec<String>, StoreError> {
        let now = unix_now();
        let mut released = Vec::new();
        for (key, l, parts) in self.list_lease_objects().await? {
            if !l.is_live(now) {
                self.delete_lease(&key, &parts).await?;
                released.push(key);
            }
        }
        Ok(released)
    }

    /// Deletes lease record `key`, then its `parts`.
    pub(crate) async fn delete_lease(&self, key: &str, parts: &[String]) -> Result<(), StoreError> {
        self.backend.delete(key).await?;
        for p in parts {
            self.backend.delete(p).await?;
        }
        Ok(())
    }

    /// Writes build-cache entry `cache/<key>` → `layer`, stamped now. `key` is one key
    /// segment (`[A-Za-z0-9._-]`, e.g. the hex of the step's cache digest).
    pub async fn put_cache_entry(&self, key: &str, layer: BlobDigest) -> Result<(), StoreError> {
        let e = CacheEntry {
            layer,
            time: unix_now(),
        };
        self.put_entry("cache", key, &e).await
    }

    /// Reads build-cache entry `key`, `None` when absent.
    pub async fn get_cache_entry(&self, key: &str) -> Result<Option<CacheEntry>, StoreError> {
        self.get_entry("cache", key).await
    }

    /// Writes the inputs record of build-cache entry `key` (`cache-inputs/<key>`) and, when
    /// `index` is given, the same bytes as `cache-index/<index>`; call it after
    /// [`Store::put_cache_entry`], so a record never outlives its entry by more than one GC.
    /// Errors: [`LeaseError::InvalidId`] for a key or index that is not one key segment,
    /// [`LeaseError::Corrupt`] for a record over [`MAX_CACHE_INPUTS_LEN`], backend errors.
    pub async fn put_cache_inputs(
        &self,
        key: &str,
        index: Option<&str>,
        record: impl Into<Bytes>,
    ) -> Result<(), StoreError> {
        let record: Bytes = record.into();
        check_id(key)?;
        if let Some(i) = index {
            check_id(i)?;
        }
        let k = format!("{CACHE_INPUTS_PREFIX}{key}");
        if record.len() as u64 > MAX_CACHE_INPUTS_LEN {
            return Err(LeaseError::Corrupt {
                key: k,
                store: self.url().to_string(),
                reason: format!("{} bytes, over {MAX_CACHE_INPUTS_LEN}", record.len()),
            }
            .into());
        }
        self.backend.put(&k, record.clone()).await?;
        if let Some(i) = index {
            self.backend
                .put(&format!("{CACHE_INDEX_PREFIX}{i}"), record)
                .await?;
        }
        Ok(())
    }

    /// Reads the inputs record of build-cache entry `key`, `None` when absent.
    pub async fn get_cache_inputs(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        check_id(key)?;
        self.get_small(&format!("{CACHE_INPUTS_PREFIX}{key}"), MAX_CACHE_INPUTS_LEN)
            .await
    }

    /// Reads `cache-index/<index>` (a copy of an inputs record), `None` when absent.
    pub async fn get_cache_index(&self, index: &str) -> Result<Option<Bytes>, StoreError> {
        check_id(index)?;
        self.get_small(
            &format!("{CACHE_INDEX_PREFIX}{index}"),
            MAX_CACHE_INPUTS_LEN,
        )
        .await
    }

    /// Writes `<prefix>/<key>` as the JSON of `e` (an unconditional put). Errors:
    /// [`LeaseError::InvalidId`] for a `key` that is not one key segment, backend errors.
    async fn put_entry<T: Serialize>(
        &self,
        prefix: &str,
        key: &str,
        e: &T,
    ) -> Result<(), StoreError> {
        check_id(key)?;
        // Serializing these plain types cannot fail.
        let bytes = Bytes::from(serde_json::to_vec(e).unwrap_or_default());
        self.backend.put(&format!("{prefix}/{key}"), bytes).await?;
        Ok(())
    }

    /// Reads `<prefix>/<key>` (at most [`MAX_CACHE_ENTRY_LEN`] bytes), `None` when absent.
    /// Errors: [`LeaseError::Corrupt`] naming the key for JSON that does not parse as `T`.
    async fn get_entry<T: serde::de::DeserializeOwned>(
        &self,
        prefix: &str,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        check_id(key)?;
        let k = format!("{prefix}/{key}");
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

    /// Writes image cache entry `images/<key>` → `manifest`, stamped now (unconditional
    /// put: a newer publish of the same key replaces it). `key` is one key segment, as for
    /// [`Store::put_cache_entry`]. Errors: [`LeaseError::InvalidId`], backend errors.
    pub async fn put_image_entry(
        &self,
        key: &str,
        manifest: ManifestDigest,
    ) -> Result<(), StoreError> {
        let e = ImageCacheEntry {
            manifest,
            time: unix_now(),
        };
        self.put_entry("images", key, &e).await
    }

    /// Reads image cache entry `key`, `None` when absent. It says nothing of whether the
    /// manifest is still there. Errors: [`LeaseError::Corrupt`] naming `images/<key>` for
    /// one that does not parse.
    pub async fn get_image_entry(&self, key: &str) -> Result<Option<ImageCacheEntry>, StoreError> {
        self.get_entry("images", key).await
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

    /// A shared lease keeps its objects through GC and `release_dead_leases` (no owner to
    /// judge) until it is deleted; rewriting it renews it.
    #[tokio::test]
    async fn a_shared_lease_lives_until_deleted_or_expired() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let blob = store
            .put_blob(Bytes::from_static(b"context"))
            .await
            .unwrap();
        let obj = ObjectRef::Blob(blob.digest);
        store
            .put_shared_lease("ctx-b1", Duration::from_secs(3600), [obj])
            .await
            .unwrap();
        store
            .put_shared_lease("ctx-b1", Duration::from_secs(7200), [obj])
            .await
            .unwrap();
        let leases = store.list_leases().await.unwrap();
        assert_eq!(leases.len(), 1, "{leases:?}");
        assert_eq!(leases[0].owner, None);
        assert!(
            leases[0].expires >= unix_now() + 7100,
            "renewed: {leases:?}"
        );
        let gc = crate::gc::GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        };
        assert!(store.release_dead_leases().await.unwrap().is_empty());
        store.gc(&gc).await.unwrap();
        assert!(store.has(&obj).await.unwrap(), "kept by the shared lease");
        store.delete_shared_lease("ctx-b1").await.unwrap();
        store.delete_shared_lease("ctx-b1").await.unwrap();
        store.gc(&gc).await.unwrap();
        assert!(!store.has(&obj).await.unwrap(), "collected once deleted");
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
