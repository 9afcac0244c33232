//! The kiln store as the shared blob cache of base images.
//!
//! A [`crate::cache::LocalCache`] is the local kiln store itself (through
//! [`kiln_store::LocalBlobs`]), so every pulled manifest, config and layer is an ordinary
//! blob there. For a store elsewhere (S3, another directory), [`publish`] uploads an image's blobs (put-if-absent; the store hashes them
//! again) and [`materialize`] brings them back into a local cache, verified, so a host that
//! has never talked to the registry can unpack an image by digest.

use kiln_store::{BlobDigest, Store, StoreError};

use crate::cache::{BlobCache, CacheError};
use crate::image::{AnyManifest, ImageError};

/// Errors moving an image between the local cache and a kiln store.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The store failed (including a blob that is absent or corrupt there).
    #[error(transparent)]
    Store(Box<StoreError>),
    /// The local cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A manifest problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The image is not in the local cache.
    #[error("{0} is not in the local cache")]
    Missing(String),
    /// The store filed a blob under another digest than the one it was uploaded as.
    #[error("invalid digest {0:?}")]
    Digest(String),
}

impl From<StoreError> for RemoteError {
    fn from(e: StoreError) -> Self {
        RemoteError::Store(Box::new(e))
    }
}

fn image_blobs(manifest: &[u8], digest: &BlobDigest) -> Result<Vec<BlobDigest>, RemoteError> {
    match AnyManifest::parse(manifest, digest)? {
        AnyManifest::Image(m) => Ok(std::iter::once(&m.config)
            .chain(&m.layers)
            .map(|d| d.digest)
            .collect()),
        AnyManifest::Index(_) => Err(RemoteError::Missing(format!("{digest} (an index)"))),
    }
}

/// Uploads the image `digest` (manifest, config, layers) from `cache` to `store`. Returns how
/// many blobs the store did not have.
pub async fn publish(
    cache: &dyn BlobCache,
    digest: &BlobDigest,
    store: &Store,
) -> Result<usize, RemoteError> {
    let manifest = cache
        .read_blob(digest)?
        .ok_or_else(|| RemoteError::Missing(digest.to_string()))?;
    let mut uploaded = 0;
    // Blobs before the manifest that names them, as the store publishes.
    for d in image_blobs(&manifest, digest)?
        .iter()
        .chain(std::iter::once(digest))
    {
        let path = cache
            .blob_path(d)?
            .ok_or_else(|| RemoteError::Missing(d.to_string()))?;
        let (r, created) = store.put_blob_file(&path).await?;
        if r.digest != *d {
            return Err(RemoteError::Digest(d.to_string()));
        }
        uploaded += usize::from(created);
    }
    Ok(uploaded)
}

/// Downloads the image `digest` from `store` into `cache` (blobs already cached are skipped;
/// each is verified by the store's read and again by the cache's commit). Returns how many
/// blobs were fetched.
pub async fn materialize(
    store: &Store,
    digest: &BlobDigest,
    cache: &dyn BlobCache,
) -> Result<usize, RemoteError> {
    let manifest = match cache.read_blob(digest)? {
        Some(b) => b,
        None => store.get_blob(digest).await?.to_vec(),
    };
    let mut fetched = 0;
    for d in image_blobs(&manifest, digest)? {
        if cache.blob_path(&d)?.is_some() {
            continue;
        }
        let staged = cache.ingest_path(&d)?;
        store.get_blob_to_file(&d, &staged).await?;
        cache.commit(&staged, &d)?;
        fetched += 1;
    }
    cache.put_bytes(digest, &manifest)?;
    Ok(fetched)
}
