//! The blob cache the base-image code pulls into: OCI manifests, configs and layers by digest,
//! plus named references (`registry/repo:tag` → manifest digest).
//!
//! [`BlobCache`] is the narrow interface the builder needs (read and ingest, containerd's
//! `Provider` + `Ingester` split); [`LocalCache`] implements it on a local directory with the
//! store's key layout (`blobs/sha256/<hex>`, DESIGN.md "Store keys"), so a kiln-store
//! directory and this cache share blobs. References live under `refs/oci/<name>/<tag>` (one
//! line: the manifest digest); they are not kiln-store tags, which name kiln image manifests.
//!
//! Blobs become visible only after their digest checks out: an ingest writes to
//! `.tmp/ingest/<hex>` (kept across runs, so an interrupted download resumes), is hashed in
//! full, then renamed into place.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// Errors of the blob cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A digest is not `sha256:<64 lower-case hex>`.
    #[error("invalid digest {0:?} (expected sha256:<64 hex digits>)")]
    BadDigest(String),
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
    /// A file-system operation failed.
    #[error("blob cache at {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// Underlying error.
        source: io::Error,
    },
}

/// The hex part of a `sha256:<hex>` digest, validated.
pub fn sha256_hex(digest: &str) -> Result<&str, CacheError> {
    match digest.strip_prefix("sha256:") {
        Some(h)
            if h.len() == 64
                && h.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) =>
        {
            Ok(h)
        }
        _ => Err(CacheError::BadDigest(digest.to_string())),
    }
}

/// `sha256:<hex>` of some bytes.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// `sha256:<hex>` of a file's content, read in 1 MiB pieces.
pub fn digest_of_file(path: &Path) -> io::Result<String> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("sha256:{}", hex::encode(h.finalize())))
}

/// What the base-image code needs from a store. Blocking calls; small and local.
pub trait BlobCache: Send + Sync {
    /// The path of a verified blob, or `None` when it is not cached.
    fn blob_path(&self, digest: &str) -> Result<Option<PathBuf>, CacheError>;
    /// Where a partial download of `digest` is kept (same file system as the blobs).
    fn ingest_path(&self, digest: &str) -> Result<PathBuf, CacheError>;
    /// A scratch file path on the cache's file system (for blobs whose digest is known only
    /// once written); `label` is made unique by the caller.
    fn scratch_path(&self, label: &str) -> PathBuf;
    /// Hashes the file at `staged` and, when it matches `digest`, moves it in.
    fn commit(&self, staged: &Path, digest: &str) -> Result<PathBuf, CacheError>;
    /// Puts a small blob (a manifest, a config) after checking its digest.
    fn put_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), CacheError>;
    /// The manifest digest a reference name points at (`registry/repo:tag`).
    fn get_ref(&self, name: &str) -> Result<Option<String>, CacheError>;
    /// Points a reference name at a manifest digest.
    fn set_ref(&self, name: &str, digest: &str) -> Result<(), CacheError>;

    /// Reads a whole blob (for manifests and configs), `None` when absent.
    fn read_blob(&self, digest: &str) -> Result<Option<Vec<u8>>, CacheError> {
        match self.blob_path(digest)? {
            None => Ok(None),
            Some(p) => fs::read(&p)
                .map(Some)
                .map_err(|source| CacheError::Io { path: p, source }),
        }
    }
}

/// [`BlobCache`] on a local directory.
#[derive(Debug, Clone)]
pub struct LocalCache {
    root: PathBuf,
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl LocalCache {
    /// Opens (creating) a cache at `root`.
    pub fn open(root: &Path) -> Result<LocalCache, CacheError> {
        for sub in ["blobs/sha256", ".tmp/ingest", "refs/oci"] {
            let p = root.join(sub);
            fs::create_dir_all(&p).map_err(io_at(&p))?;
        }
        Ok(LocalCache {
            root: root.to_path_buf(),
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

    /// The cache's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `refs/oci/<registry>/<repo...>/<tag>`, each segment encoded into the store's key
    /// alphabet (`[A-Za-z0-9._-]`, other bytes as `~XX`, a leading `.` too), so the store's
    /// own listing and key checks accept these files.
    fn ref_path(&self, name: &str) -> Result<PathBuf, CacheError> {
        // name is `registry/repo:tag`; tags and repo components are checked by the
        // reference grammar, but this becomes a file path, so check again.
        let (repo, tag) = name
            .rsplit_once(':')
            .filter(|(r, t)| !r.is_empty() && !t.is_empty() && !t.contains('/'))
            .ok_or_else(|| CacheError::BadName(name.to_string()))?;
        let ok = |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains('\0');
        if !repo.split('/').all(ok) || !ok(tag) {
            return Err(CacheError::BadName(name.to_string()));
        }
        let mut p = self.root.join("refs/oci");
        for seg in repo.split('/').chain(std::iter::once(tag)) {
            p.push(encode_segment(seg));
        }
        Ok(p)
    }
}

fn encode_segment(seg: &str) -> String {
    let mut out = String::new();
    for (i, b) in seg.bytes().enumerate() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && i > 0) {
            out.push(b as char);
        } else {
            out.push_str(&format!("~{b:02x}"));
        }
    }
    out
}

impl BlobCache for LocalCache {
    fn blob_path(&self, digest: &str) -> Result<Option<PathBuf>, CacheError> {
        let p = self.root.join("blobs/sha256").join(sha256_hex(digest)?);
        Ok(p.is_file().then_some(p))
    }

    fn ingest_path(&self, digest: &str) -> Result<PathBuf, CacheError> {
        Ok(self.root.join(".tmp/ingest").join(sha256_hex(digest)?))
    }

    fn scratch_path(&self, label: &str) -> PathBuf {
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
            .join(format!("scratch-{}-{safe}", std::process::id()))
    }

    fn commit(&self, staged: &Path, digest: &str) -> Result<PathBuf, CacheError> {
        let hex = sha256_hex(digest)?;
        let actual = digest_of_file(staged).map_err(io_at(staged))?;
        if actual != digest {
            let _ = fs::remove_file(staged);
            return Err(CacheError::Mismatch {
                expected: digest.to_string(),
                actual,
            });
        }
        let dst = self.root.join("blobs/sha256").join(hex);
        fs::rename(staged, &dst).map_err(io_at(&dst))?;
        Ok(dst)
    }

    fn put_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), CacheError> {
        let hex = sha256_hex(digest)?;
        let actual = digest_of(bytes);
        if actual != digest {
            return Err(CacheError::Mismatch {
                expected: digest.to_string(),
                actual,
            });
        }
        let dst = self.root.join("blobs/sha256").join(hex);
        if dst.is_file() {
            return Ok(());
        }
        let tmp = self
            .root
            .join(".tmp")
            .join(format!("put-{hex}-{}", std::process::id()));
        let mut f = fs::File::create(&tmp).map_err(io_at(&tmp))?;
        f.write_all(bytes).map_err(io_at(&tmp))?;
        f.sync_all().map_err(io_at(&tmp))?;
        fs::rename(&tmp, &dst).map_err(io_at(&dst))
    }

    fn get_ref(&self, name: &str) -> Result<Option<String>, CacheError> {
        let p = self.ref_path(name)?;
        match fs::read_to_string(&p) {
            Ok(s) => {
                let d = s.trim().to_string();
                sha256_hex(&d)?;
                Ok(Some(d))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CacheError::Io { path: p, source }),
        }
    }

    fn set_ref(&self, name: &str, digest: &str) -> Result<(), CacheError> {
        sha256_hex(digest)?;
        let p = self.ref_path(name)?;
        let dir = p
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| self.root.clone());
        fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        let tmp = dir.join(format!(".{}.tmp", std::process::id()));
        fs::write(&tmp, format!("{digest}\n")).map_err(io_at(&tmp))?;
        fs::rename(&tmp, &p).map_err(io_at(&p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_commit_refs() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(d.path()).expect("open");
        let dg = digest_of(b"hello");
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
        let dg2 = digest_of(b"world");
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
        assert_eq!(
            c.get_ref("127.0.0.1:5000/x/y:t").expect("get"),
            Some(dg.clone())
        );
        assert_eq!(c.get_ref("127.0.0.1:5000/x/y:u").expect("get"), None);
        assert!(matches!(
            c.set_ref("a/../../b:t", &dg),
            Err(CacheError::BadName(_))
        ));
        assert!(matches!(
            c.blob_path("sha256:../../etc"),
            Err(CacheError::BadDigest(_))
        ));
    }
}
