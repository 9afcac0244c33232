//! The blob cache the base-image code pulls into: OCI manifests, configs and layers by digest,
//! plus named references (`registry/repo:tag` → manifest digest).
//!
//! [`BlobCache`] is the narrow interface the builder needs (read and ingest, containerd's
//! `Provider` + `Ingester` split). The blob cache is the store: [`LocalCache`] implements it
//! by delegating to kiln-store's [`LocalBlobs`] on the local store directory, so blobs are
//! the store's `blobs/sha256/<hex>` (written temp + fsync + digest check + put-if-absent by
//! the store's local backend), references are the store's OCI references
//! ([`kiln_store::ociref`]: GC roots, verified, copied, listed by `kiln tags`), and
//! [`BlobCache::store_tag`] reads the store's own tags.
//!
//! Blobs become visible only after their digest checks out: an ingest writes to
//! `.tmp/ingest/<hex>` (kept across runs, so an interrupted download resumes), is hashed in
//! full, then moved into place.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_store::digest::Sha256Hash;
use kiln_store::lease::Lease;
use kiln_store::{BlobDigest, LocalBlobs, Manifest, ObjectRef, OciRef, Store, TagRef};

/// Errors of the blob cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A digest where it entered the builder (a manifest, a reference, a cache record, user
    /// input) is not `sha256:<64 lower-case hex>`; refused there, once ([`parse_digest`]).
    #[error("invalid digest {digest:?} in {source_of} (expected sha256:<64 hex digits>)")]
    BadDigest {
        /// The digest as found.
        digest: String,
        /// Where it was found, e.g. `reference registry/repo@sha256:…`.
        source_of: String,
    },
    /// Content does not hash to the digest it was put under.
    #[error("digest mismatch: expected {expected}, got {actual}")]
    Mismatch {
        /// The digest asked for.
        expected: String,
        /// The digest of the bytes.
        actual: String,
    },
    /// A reference name cannot be a cache key.
    #[error("invalid reference name {0:?}")]
    BadName(String),
    /// The store failed (I/O, a corrupt reference or tag, an unreadable manifest).
    #[error(transparent)]
    Store(Box<kiln_store::StoreError>),
    /// A file-system operation failed.
    #[error("blob cache at {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// Underlying error.
        source: io::Error,
    },
}

impl From<kiln_store::StoreError> for CacheError {
    fn from(e: kiln_store::StoreError) -> Self {
        use kiln_store::{BackendError, StoreError};
        match e {
            StoreError::Backend(BackendError::DigestMismatch {
                expected, actual, ..
            }) => CacheError::Mismatch { expected, actual },
            e => CacheError::Store(Box::new(e)),
        }
    }
}

/// The sha256 of some bytes (`sha256:<hex>` printed), for a digest that names no store
/// object: a recipe's, a text input's of a step, a path's. A blob's is
/// [`BlobDigest::of`], which says which bytes it measures.
pub fn digest_of(bytes: &[u8]) -> Sha256Hash {
    Sha256Hash::of(bytes)
}

/// The sha256 of a file's content ([`Sha256Hash::of_file`]; a file that is a blob:
/// `BlobDigest(digest_of_file(p)?)`).
pub fn digest_of_file(path: &Path) -> io::Result<Sha256Hash> {
    Sha256Hash::of_file(path)
}

/// What the base-image code needs from a store. Blocking calls; small and local.
pub trait BlobCache: Send + Sync {
    /// The path of a verified blob, or `None` when it is not cached.
    fn blob_path(&self, digest: &BlobDigest) -> Result<Option<PathBuf>, CacheError>;
    /// Where a partial download of `digest` is kept (same file system as the blobs).
    fn ingest_path(&self, digest: &BlobDigest) -> Result<PathBuf, CacheError>;
    /// A scratch file path on the cache's file system (for blobs whose digest is known only
    /// once written); a new path at every call, whatever `label` (which names what it holds).
    fn scratch_path(&self, label: &str) -> PathBuf;
    /// Hashes the file at `staged` and, when it matches `digest`, moves it in.
    fn commit(&self, staged: &Path, digest: &BlobDigest) -> Result<PathBuf, CacheError>;
    /// Puts a small blob (a manifest, a config) after checking its digest.
    fn put_bytes(&self, digest: &BlobDigest, bytes: &[u8]) -> Result<(), CacheError>;
    /// The manifest digest a reference name points at (`registry/repo:tag`).
    fn get_ref(&self, name: &str) -> Result<Option<BlobDigest>, CacheError>;
    /// Points a reference name at a manifest digest.
    fn set_ref(&self, name: &str, digest: &BlobDigest) -> Result<(), CacheError>;

    /// The OCI manifest digest of the kiln image a store tag (`name:tag`, kiln's grammar)
    /// names: the tag's image manifest's `oci_manifest`. `None` when there is no such tag,
    /// the tag names no image or one without an OCI manifest, or this cache has no tags.
    fn store_tag(&self, tag: &str) -> Result<Option<BlobDigest>, CacheError> {
        let _ = tag;
        Ok(None)
    }

    /// Reads a whole blob (for manifests and configs), `None` when absent.
    fn read_blob(&self, digest: &BlobDigest) -> Result<Option<Vec<u8>>, CacheError> {
        match self.blob_path(digest)? {
            None => Ok(None),
            Some(p) => fs::read(&p)
                .map(Some)
                .map_err(|source| CacheError::Io { path: p, source }),
        }
    }
}

/// [`BlobCache`] on the local store directory, through kiln-store's [`LocalBlobs`].
#[derive(Debug, Clone)]
pub struct LocalCache {
    blobs: LocalBlobs,
}

/// Parses a digest where it enters the builder: `source_of` names where it was found (a
/// manifest, a reference, a cache record, user input), for the error. The one place a
/// digest string becomes a [`BlobDigest`]; everything past it takes the typed value.
pub fn parse_digest(digest: &str, source_of: &str) -> Result<BlobDigest, CacheError> {
    digest.parse().map_err(|_| CacheError::BadDigest {
        digest: digest.to_string(),
        source_of: source_of.to_string(),
    })
}

pub(crate) fn oci_ref(name: &str) -> Result<OciRef, CacheError> {
    name.parse()
        .map_err(|_| CacheError::BadName(name.to_string()))
}

impl LocalCache {
    /// Opens (creating) the store directory `root`.
    pub fn open(root: &Path) -> Result<LocalCache, CacheError> {
        Ok(LocalCache {
            blobs: LocalBlobs::open(root)?,
        })
    }

    /// The default location: `$KILN_STORE`, else `$HOME/.local/share/kiln/store` (the
    /// store's own default).
    pub fn default_root() -> PathBuf {
        if let Some(s) = std::env::var_os("KILN_STORE").filter(|s| !s.is_empty()) {
            return PathBuf::from(s);
        }
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
        Path::new(&home).join(".local/share/kiln/store")
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        self.blobs.root()
    }

    /// The store underneath.
    pub fn blobs(&self) -> &LocalBlobs {
        &self.blobs
    }
}

impl BlobCache for LocalCache {
    fn blob_path(&self, digest: &BlobDigest) -> Result<Option<PathBuf>, CacheError> {
        Ok(self.blobs.blob_path(digest)?)
    }

    fn ingest_path(&self, digest: &BlobDigest) -> Result<PathBuf, CacheError> {
        Ok(self.blobs.ingest_path(digest))
    }

    fn scratch_path(&self, label: &str) -> PathBuf {
        self.blobs.scratch_path(label)
    }

    fn commit(&self, staged: &Path, digest: &BlobDigest) -> Result<PathBuf, CacheError> {
        Ok(self.blobs.commit(staged, digest)?)
    }

    fn put_bytes(&self, digest: &BlobDigest, bytes: &[u8]) -> Result<(), CacheError> {
        self.blobs.put_bytes(digest, bytes)?;
        Ok(())
    }

    fn get_ref(&self, name: &str) -> Result<Option<BlobDigest>, CacheError> {
        Ok(self.blobs.get_oci_ref(&oci_ref(name)?)?)
    }

    fn set_ref(&self, name: &str, digest: &BlobDigest) -> Result<(), CacheError> {
        Ok(self.blobs.set_oci_ref(&oci_ref(name)?, digest)?)
    }

    fn store_tag(&self, tag: &str) -> Result<Option<BlobDigest>, CacheError> {
        let Ok(t) = tag.parse::<TagRef>() else {
            return Ok(None);
        };
        let Some(m) = self.blobs.get_tag(&t)? else {
            return Ok(None);
        };
        match self.blobs.get_manifest(&m)? {
            Manifest::Image(i) => Ok(i.oci_manifest.map(|b| b.digest)),
            Manifest::Snapshot(_) => Ok(None),
        }
    }
}

/// The path of blob `digest` (`sha256:<hex>`) in `cache`, fetched from `store` first when
/// only the store has it: a store that is not `cache`'s own directory (an S3 store, whose
/// local files are a cache) may hold layers that other hosts built, which a build-cache hit
/// names. The download goes to a fresh scratch file, hashed in full by
/// [`BlobCache::commit`] before it becomes visible. `None` when neither has it. Errors: the
/// store's (a digest mismatch names blob and store), the cache's.
pub async fn fetch_blob(
    cache: &dyn BlobCache,
    store: &Store,
    digest: &BlobDigest,
) -> Result<Option<PathBuf>, CacheError> {
    if let Some(p) = cache.blob_path(digest)? {
        return Ok(Some(p));
    }
    let d = *digest;
    if !store.has(&ObjectRef::Blob(d)).await? {
        return Ok(None);
    }
    let staged = cache.scratch_path(&format!("fetch-{}", d.hex()));
    if let Some(dir) = staged.parent() {
        fs::create_dir_all(dir).map_err(|source| CacheError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    if let Err(e) = store.get_blob_to_file(&d, &staged).await {
        let _ = fs::remove_file(&staged);
        return Err(e.into());
    }
    Ok(Some(cache.commit(&staged, digest)?))
}

/// Makes blob `digest` of `cache` an object of `store` too, so that what names it there (a
/// build-cache entry `cache/<key>`, written after this returns) never names a missing blob,
/// and another host's build can fetch it ([`fetch_blob`]). Leases it in `lease` first; one
/// `head`, and an upload only when the store lacks it (for the store whose directory `cache`
/// is, the head finds it). Errors: [`CacheError::Store`], the blob missing from `cache`
/// ([`CacheError::Io`] naming its would-be path).
pub async fn share_blob(
    cache: &dyn BlobCache,
    store: &Store,
    digest: &BlobDigest,
    lease: Option<&Lease>,
) -> Result<(), CacheError> {
    let d = *digest;
    let obj = ObjectRef::Blob(d);
    if let Some(l) = lease {
        l.add([obj]).await?;
    }
    if store.has(&obj).await? {
        return Ok(());
    }
    let Some(path) = cache.blob_path(digest)? else {
        return Err(CacheError::Io {
            path: cache.scratch_path(&d.hex()),
            source: io::Error::new(
                io::ErrorKind::NotFound,
                format!("blob {digest} is not in the blob cache"),
            ),
        });
    };
    store.put_blob_file(&path).await?;
    Ok(())
}

/// A [`BlobCache`] whose every blob is put under a store lease: a blob before it is written
/// ([`BlobCache::commit`], [`BlobCache::put_bytes`]), and a blob found before it is looked up
/// ([`BlobCache::blob_path`], which the look-ups of base layers, cache-hit layers and
/// configs go through), with the look-up under the store's sweep lock
/// ([`kiln_store::lease::Lease::hold_blocking`]). So GC, with any grace period, keeps every
/// blob a build relies on until the lease is released (after its tag is published). The
/// lease must be on the store whose directory `inner` is. A look-up may wait while a GC of
/// that store sweeps.
pub struct LeasedCache {
    inner: Arc<dyn BlobCache>,
    lease: Arc<kiln_store::lease::Lease>,
}

impl LeasedCache {
    /// `inner` with every blob it writes or finds added to `lease`.
    pub fn new(inner: Arc<dyn BlobCache>, lease: Arc<kiln_store::lease::Lease>) -> Self {
        LeasedCache { inner, lease }
    }

    fn obj(digest: &BlobDigest) -> kiln_store::ObjectRef {
        kiln_store::ObjectRef::Blob(*digest)
    }

    /// Leases `digest` before it is written. A lease on a store that is not a local
    /// directory protects nothing here (that store's GC never touches this cache's files).
    fn before_write(&self, digest: &BlobDigest) -> Result<(), CacheError> {
        if self.lease.is_local() {
            self.lease.add_blocking([Self::obj(digest)])?;
        }
        Ok(())
    }
}

impl BlobCache for LeasedCache {
    fn blob_path(&self, digest: &BlobDigest) -> Result<Option<PathBuf>, CacheError> {
        let obj = Self::obj(digest);
        self.lease
            .hold_blocking([obj], || self.inner.blob_path(digest))?
    }

    fn ingest_path(&self, digest: &BlobDigest) -> Result<PathBuf, CacheError> {
        self.inner.ingest_path(digest)
    }

    fn scratch_path(&self, label: &str) -> PathBuf {
        self.inner.scratch_path(label)
    }

    fn commit(&self, staged: &Path, digest: &BlobDigest) -> Result<PathBuf, CacheError> {
        self.before_write(digest)?;
        self.inner.commit(staged, digest)
    }

    fn put_bytes(&self, digest: &BlobDigest, bytes: &[u8]) -> Result<(), CacheError> {
        self.before_write(digest)?;
        self.inner.put_bytes(digest, bytes)
    }

    fn get_ref(&self, name: &str) -> Result<Option<BlobDigest>, CacheError> {
        self.inner.get_ref(name)
    }

    fn set_ref(&self, name: &str, digest: &BlobDigest) -> Result<(), CacheError> {
        self.inner.set_ref(name, digest)
    }

    fn store_tag(&self, tag: &str) -> Result<Option<BlobDigest>, CacheError> {
        self.inner.store_tag(tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_commit_refs() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(d.path()).expect("open");
        let dg = BlobDigest::of(b"hello");
        assert!(c.blob_path(&dg).expect("ok").is_none());
        c.put_bytes(&dg, b"hello").expect("put");
        assert_eq!(
            c.read_blob(&dg).expect("ok").as_deref(),
            Some(&b"hello"[..])
        );
        assert!(matches!(
            c.put_bytes(&dg, b"other"),
            Err(CacheError::Mismatch { .. })
        ));
        let dg2 = BlobDigest::of(b"world");
        let staged = c.ingest_path(&dg2).expect("path");
        fs::write(&staged, b"worlx").expect("write");
        assert!(matches!(
            c.commit(&staged, &dg2),
            Err(CacheError::Mismatch { .. })
        ));
        assert!(
            c.blob_path(&dg2).expect("ok").is_none(),
            "bad content never becomes visible"
        );
        fs::write(&staged, b"world").expect("write");
        c.commit(&staged, &dg2).expect("commit");
        c.set_ref("127.0.0.1:5000/x/y:t", &dg).expect("set");
        assert_eq!(c.get_ref("127.0.0.1:5000/x/y:t").expect("get"), Some(dg));
        assert_eq!(c.get_ref("127.0.0.1:5000/x/y:u").expect("get"), None);
        assert!(matches!(
            c.set_ref("a/../../b:t", &dg),
            Err(CacheError::BadName(_))
        ));
        // A malformed digest never reaches the cache: it is refused where it is parsed,
        // naming where it came from.
        let e = parse_digest("sha256:../../etc", "the test's input").unwrap_err();
        assert!(matches!(e, CacheError::BadDigest { .. }), "{e:?}");
        assert!(e.to_string().contains("the test's input"), "{e}");
    }
}
