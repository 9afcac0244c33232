//! Blobs: immutable objects named by the sha256 of their stored bytes (OCI configs and layers,
//! vmstate). Stored at `blobs/sha256/<hex>` with put-if-absent; the digest is checked before
//! the object becomes visible, and again on every read.

use std::path::Path;

use bytes::Bytes;
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::backend::{Backend, PutOutcome};
use crate::digest::{BlobDigest, Hasher};
use crate::manifest::BlobRef;
use crate::{Store, StoreError};

/// Blob reads are fetched in ranges of this many bytes (8 MiB), bounding memory.
pub const BLOB_READ_RANGE: u64 = 8 << 20;

/// Ranges of one blob read in flight at once by [`Store::get_blob_to_file`] (4, so at most
/// 32 MiB held). One after the other, the 53 MB guest kernel of a clone cold from the local
/// S3 server took 7 serial GETs and most of the 1.8 s before its QEMU could start (issue 35,
/// Debian fixture, `kiln start` traced); S3 serves ranges of one object in parallel, as
/// boto3's downloads rely on (10 at a time by default).
pub const BLOB_RANGES_IN_FLIGHT: usize = 4;

/// Errors about blobs.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// Bytes read do not hash to the blob's name (corrupt or truncated object).
    #[error("blob {digest} in {store}: bytes hash to {actual} ({len} bytes)")]
    DigestMismatch {
        /// The blob asked for.
        digest: BlobDigest,
        /// The store read.
        store: String,
        /// What the bytes hash to.
        actual: BlobDigest,
        /// How many bytes were read.
        len: u64,
    },
}

impl Store {
    /// Stores bytes as a blob (put-if-absent). Returns its reference (digest, size).
    pub async fn put_blob(&self, data: Bytes) -> Result<BlobRef, StoreError> {
        let digest = BlobDigest::of(&data);
        let size = data.len() as u64;
        self.backend
            .put_if_absent(&digest.key(), data, Some(digest.0))
            .await?;
        Ok(BlobRef {
            digest,
            size,
            media_type: None,
        })
    }

    /// Stores a local file as a blob, streaming (multipart on S3 for large files). Hashes the
    /// file first; returns its reference and whether this call uploaded it.
    pub async fn put_blob_file(&self, path: &Path) -> Result<(BlobRef, bool), StoreError> {
        let mut f = tokio::fs::File::open(path)
            .await
            .map_err(|e| StoreError::io(path, e))?;
        let mut h = Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut size = 0u64;
        loop {
            let n = f
                .read(&mut buf)
                .await
                .map_err(|e| StoreError::io(path, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            size += n as u64;
        }
        let digest = BlobDigest(h.finish());
        let out = self
            .backend
            .put_file_if_absent(&digest.key(), path, Some(digest.0))
            .await?;
        Ok((
            BlobRef {
                digest,
                size,
                media_type: None,
            },
            out == PutOutcome::Created,
        ))
    }

    /// A whole blob in memory, verified. For large blobs use [`Store::get_blob_to_file`].
    pub async fn get_blob(&self, digest: &BlobDigest) -> Result<Bytes, StoreError> {
        let data = self.read(&digest.key()).await?;
        let actual = BlobDigest::of(&data);
        if actual != *digest {
            return Err(BlobError::DigestMismatch {
                digest: *digest,
                store: self.url().to_string(),
                actual,
                len: data.len() as u64,
            }
            .into());
        }
        Ok(data)
    }

    /// Writes a blob to `dest` in [`BLOB_READ_RANGE`] pieces, [`BLOB_RANGES_IN_FLIGHT`] read at
    /// once and written in order, hashing as it goes; on a digest
    /// mismatch the file is removed and the error names blob and store. Returns the size.
    pub async fn get_blob_to_file(
        &self,
        digest: &BlobDigest,
        dest: &Path,
    ) -> Result<u64, StoreError> {
        let key = digest.key();
        let size = match self.read_head(&key).await? {
            Some(i) => i.size,
            None => {
                return Err(crate::BackendError::NotFound {
                    store: self.url().to_string(),
                    key,
                }
                .into());
            }
        };
        let mut out = tokio::fs::File::create(dest)
            .await
            .map_err(|e| StoreError::io(dest, e))?;
        let mut h = Hasher::new();
        let mut pos = 0u64;
        let ranges = (0..size)
            .step_by(BLOB_READ_RANGE as usize)
            .map(|start| start..(start + BLOB_READ_RANGE).min(size));
        let key = &key;
        let mut parts = futures::stream::iter(ranges)
            .map(|r| self.read_range(key, r))
            .buffered(BLOB_RANGES_IN_FLIGHT);
        while let Some(part) = parts.next().await {
            let part = part?;
            if part.is_empty() {
                break;
            }
            h.update(&part);
            out.write_all(&part)
                .await
                .map_err(|e| StoreError::io(dest, e))?;
            pos += part.len() as u64;
        }
        out.flush().await.map_err(|e| StoreError::io(dest, e))?;
        let actual = BlobDigest(h.finish());
        if actual != *digest {
            drop(out);
            let _ = tokio::fs::remove_file(dest).await;
            return Err(BlobError::DigestMismatch {
                digest: *digest,
                store: self.url().to_string(),
                actual,
                len: pos,
            }
            .into());
        }
        Ok(pos)
    }
}
