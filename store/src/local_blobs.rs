//! [`LocalBlobs`]: blocking access to a local store directory, for code that works with files
//! (the builder downloads layers into the store and unpacks them from it).
//!
//! It is the same store as [`Store`](crate::Store) opened on that directory: the same keys,
//! and every write goes through the local backend ([`crate::backend::local`]): a temp file
//! under `.tmp/`, fsynced, its sha256 checked, then published with put-if-absent (blobs) or an
//! atomic rename (OCI references). A blob becomes visible only once its digest checks out.
//!
//! Besides what [`Store`](crate::Store) offers, it hands out paths: of a verified blob (to
//! read or stream), of a resumable download (`.tmp/ingest/<hex>`, kept across runs), and of
//! scratch files on the store's file system (to be moved in with [`LocalBlobs::commit`]).

use std::path::{Path, PathBuf};

use crate::backend::local::LocalBackend;
use crate::digest::{BlobDigest, ManifestDigest};
use crate::manifest::{MAX_MANIFEST_LEN, Manifest, ManifestError, RawManifest};
use crate::ociref::{MAX_OCI_REF_LEN, OciRef, OciRefError, parse_ref_object};
use crate::tag::{MAX_TAG_RECORD_LEN, TagError, TagRecord, TagRef};
use crate::{StoreError, backend::PutOutcome};

/// Directory (under the store root) of resumable downloads, one file per blob hex digest.
pub const INGEST_DIR: &str = ".tmp/ingest";

/// A local store directory, used from blocking code. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LocalBlobs {
    backend: std::sync::Arc<LocalBackend>,
    root: PathBuf,
}

impl LocalBlobs {
    /// Opens (creating if needed) the store directory `root`.
    pub fn open(root: &Path) -> Result<Self, StoreError> {
        let backend = LocalBackend::open_blocking(root)?;
        for sub in [INGEST_DIR, "blobs/sha256"] {
            let p = root.join(sub);
            std::fs::create_dir_all(&p).map_err(|e| StoreError::io(&p, e))?;
        }
        Ok(Self {
            backend: std::sync::Arc::new(backend),
            root: root.to_path_buf(),
        })
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The store's URL (`file://...`), as used in error messages.
    pub fn url(&self) -> String {
        format!("file://{}", self.root.display())
    }

    /// The path of blob `digest` when the store has it (never through a symlink).
    pub fn blob_path(&self, digest: &BlobDigest) -> Result<Option<PathBuf>, StoreError> {
        Ok(self.backend.object_path_blocking(&digest.key())?)
    }

    /// Where a partial download of `digest` is kept (`.tmp/ingest/<hex>`; same file system
    /// as the blobs, so [`LocalBlobs::commit`] moves it in without copying).
    pub fn ingest_path(&self, digest: &BlobDigest) -> PathBuf {
        self.root.join(INGEST_DIR).join(digest.hex())
    }

    /// A scratch file path under `.tmp/` for a blob whose digest is known only once written:
    /// `scratch-<pid>-<n>-<label>`, `label` reduced to `[A-Za-z0-9-]`, `n` a per-process
    /// sequence number, so every call gets its own path even when concurrent builds of one
    /// process (the HTTP API's workers) pass the same label.
    pub fn scratch_path(&self, label: &str) -> PathBuf {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let safe: String = label
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.root
            .join(".tmp")
            .join(format!("scratch-{}-{n}-{safe}", std::process::id()))
    }

    /// Moves the file `staged` (on the store's file system) in as blob `digest` after
    /// fsyncing and hashing it. Returns the blob's path. An existing blob wins; `staged` is
    /// removed either way. Errors: [`BackendError::DigestMismatch`](crate::BackendError) (the
    /// staged file is removed, nothing becomes visible), I/O.
    pub fn commit(&self, staged: &Path, digest: &BlobDigest) -> Result<PathBuf, StoreError> {
        let key = digest.key();
        self.backend.adopt_file_blocking(&key, staged, digest.0)?;
        Ok(self.root.join(key))
    }

    /// Stores `bytes` as blob `digest` (put-if-absent, digest checked first).
    /// Returns whether this call created it.
    pub fn put_bytes(&self, digest: &BlobDigest, bytes: &[u8]) -> Result<bool, StoreError> {
        // Checked here too: an existing blob would otherwise hide a caller's wrong bytes.
        let actual = BlobDigest::of(bytes);
        if actual != *digest {
            return Err(crate::BackendError::DigestMismatch {
                store: self.url(),
                key: digest.key(),
                expected: digest.to_string(),
                actual: actual.to_string(),
            }
            .into());
        }
        let out = self
            .backend
            .put_if_absent_blocking(&digest.key(), bytes, Some(digest.0))?;
        Ok(out == PutOutcome::Created)
    }

    /// Reads a whole blob when it is at most `max` bytes (manifests, configs), verified;
    /// `None` when absent. Errors: over `max`, a digest mismatch, I/O.
    pub fn read_blob(&self, digest: &BlobDigest, max: u64) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(b) = self.backend.get_bounded_blocking(&digest.key(), max)? else {
            return Ok(None);
        };
        let actual = BlobDigest::of(&b);
        if actual != *digest {
            return Err(crate::BlobError::DigestMismatch {
                digest: *digest,
                store: self.url(),
                actual,
                len: b.len() as u64,
            }
            .into());
        }
        Ok(Some(b.to_vec()))
    }

    /// The blob an OCI reference names, `None` when there is no such reference.
    pub fn get_oci_ref(&self, r: &OciRef) -> Result<Option<BlobDigest>, StoreError> {
        match self.backend.get_bounded_blocking(&r.key(), MAX_OCI_REF_LEN) {
            Ok(None) => Ok(None),
            Ok(Some(b)) => parse_ref_object(&b).map(Some).map_err(|reason| {
                OciRefError::Corrupt {
                    reference: r.clone(),
                    store: self.url(),
                    reason,
                }
                .into()
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Points an OCI reference at blob `digest` (atomic replace; the blob should be stored
    /// first).
    pub fn set_oci_ref(&self, r: &OciRef, digest: &BlobDigest) -> Result<(), StoreError> {
        self.backend
            .put_blocking(&r.key(), format!("{digest}\n").as_bytes())?;
        Ok(())
    }

    /// The manifest a store tag names, `None` when there is no such tag.
    pub fn get_tag(&self, t: &TagRef) -> Result<Option<ManifestDigest>, StoreError> {
        let corrupt = |reason: String| TagError::Corrupt {
            tag: t.clone(),
            store: self.url(),
            reason,
        };
        match self
            .backend
            .get_bounded_blocking(&t.key(), MAX_TAG_RECORD_LEN as u64)
        {
            Ok(None) => Ok(None),
            Ok(Some(b)) => {
                let rec: TagRecord =
                    serde_json::from_slice(&b).map_err(|e| corrupt(e.to_string()))?;
                Ok(Some(rec.manifest))
            }
            Err(e) => Err(corrupt(e.to_string()).into()),
        }
    }

    /// A kiln manifest, checked against its digest and parsed.
    pub fn get_manifest(&self, digest: &ManifestDigest) -> Result<Manifest, StoreError> {
        let b = self
            .backend
            .get_bounded_blocking(&digest.key(), MAX_MANIFEST_LEN as u64)?
            .ok_or_else(|| crate::BackendError::NotFound {
                store: self.url(),
                key: digest.key(),
            })?;
        let raw = RawManifest::new(b);
        if raw.digest != *digest {
            return Err(ManifestError::DigestMismatch {
                digest: *digest,
                store: self.url(),
                actual: raw.digest,
            }
            .into());
        }
        Ok(raw.parse()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BackendError;

    #[test]
    fn blobs_refs_and_tags_are_the_stores() {
        let d = tempfile::tempdir().unwrap();
        let l = LocalBlobs::open(d.path()).unwrap();
        let dg = BlobDigest::of(b"hello");
        assert!(l.blob_path(&dg).unwrap().is_none());
        assert!(l.put_bytes(&dg, b"hello").unwrap());
        assert!(!l.put_bytes(&dg, b"hello").unwrap());
        assert_eq!(
            l.read_blob(&dg, 100).unwrap().as_deref(),
            Some(&b"hello"[..])
        );
        assert!(l.read_blob(&dg, 2).is_err(), "over the bound");
        let err = l.put_bytes(&dg, b"other").unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Backend(BackendError::DigestMismatch { .. })
            ),
            "{err}"
        );
        // A staged download with the wrong bytes never becomes visible and is removed.
        let dg2 = BlobDigest::of(b"world");
        let staged = l.ingest_path(&dg2);
        std::fs::write(&staged, b"worlx").unwrap();
        assert!(l.commit(&staged, &dg2).is_err());
        assert!(!staged.exists());
        assert!(l.blob_path(&dg2).unwrap().is_none());
        std::fs::write(&staged, b"world").unwrap();
        let p = l.commit(&staged, &dg2).unwrap();
        assert_eq!(std::fs::read(p).unwrap(), b"world");
        assert!(!staged.exists());
        // References and tags as the async store sees them.
        let r: OciRef = "127.0.0.1:5000/x/y:t".parse().unwrap();
        l.set_oci_ref(&r, &dg).unwrap();
        assert_eq!(l.get_oci_ref(&r).unwrap(), Some(dg));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let s = crate::Store::open(d.path().to_str().unwrap())
                .await
                .unwrap();
            assert_eq!(s.get_oci_ref(&r).await.unwrap(), Some(dg));
            assert!(s.has(&crate::ObjectRef::Blob(dg2)).await.unwrap());
            let (table, _) = s
                .put_artifact_reader(
                    std::io::Cursor::new(vec![7u8; 5000]),
                    &crate::artifact::PutArtifactOptions::default(),
                )
                .await
                .unwrap();
            let raw = s
                .put_manifest(&Manifest::Image(crate::ImageManifest::new(table)))
                .await
                .unwrap();
            let t: TagRef = "img:v1".parse().unwrap();
            s.set_tag(&t, None, raw.digest).await.unwrap();
            assert_eq!(l.get_tag(&t).unwrap(), Some(raw.digest));
            assert!(matches!(
                l.get_manifest(&raw.digest).unwrap(),
                Manifest::Image(_)
            ));
        });
        assert_eq!(l.get_tag(&"img:v2".parse().unwrap()).unwrap(), None);
    }

    #[test]
    fn a_planted_symlink_is_not_a_blob() {
        let d = tempfile::tempdir().unwrap();
        let l = LocalBlobs::open(d.path()).unwrap();
        let dg = BlobDigest::of(b"x");
        std::os::unix::fs::symlink("/etc/hostname", d.path().join(dg.key())).unwrap();
        assert!(l.blob_path(&dg).unwrap().is_none());
        assert!(l.read_blob(&dg, 1 << 20).is_err());
    }
}
