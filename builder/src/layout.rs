//! OCI image layout directories (OCI image spec `image-layout.md`): `oci-layout`,
//! `index.json`, `blobs/<alg>/<hex>`. Tags are the `org.opencontainers.image.ref.name`
//! annotation of `index.json` entries, as skopeo's and umoci's `oci:DIR:TAG` use them.
//!
//! [`import`] copies an image from a layout into the blob cache (every blob hashed on the
//! way in); [`export`] writes an image from the cache into a layout, adding or replacing the
//! entry for its tag and keeping the others.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::cache::{BlobCache, CacheError, digest_of, sha256_hex};
use crate::image::{AnyManifest, Descriptor, ImageError, OCI_MANIFEST, Platform};

/// The annotation that names a tag in `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Errors reading or writing a layout.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A file of the layout could not be read or written.
    #[error("OCI layout {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// `oci-layout` or `index.json` is missing or malformed.
    #[error("OCI layout {dir}: {reason}")]
    Format {
        /// The layout directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No entry for the tag (or several entries and no tag).
    #[error("OCI layout {dir}: {reason}")]
    NoImage {
        /// The layout directory.
        dir: PathBuf,
        /// What was looked for.
        reason: String,
    },
    /// A blob's content does not match its digest.
    #[error("OCI layout {dir}: blob {digest} does not match its digest")]
    Corrupt {
        /// The layout directory.
        dir: PathBuf,
        /// The blob digest.
        digest: String,
    },
    /// A manifest problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A cache problem.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Splits `oci:DIR[:TAG]` into the directory and tag. `None` if `s` does not start `oci:`.
pub fn parse_spec(s: &str) -> Option<(PathBuf, Option<String>)> {
    let rest = s.strip_prefix("oci:")?;
    // A tag never contains '/', so a ':' after the last '/' separates it.
    let slash = rest.rfind('/').map_or(0, |i| i + 1);
    match rest[slash..].rfind(':') {
        Some(i) => Some((
            PathBuf::from(&rest[..slash + i]),
            Some(rest[slash + i + 1..].to_string()),
        )),
        None => Some((PathBuf::from(rest), None)),
    }
}

fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf, LayoutError> {
    Ok(dir.join("blobs/sha256").join(sha256_hex(digest)?))
}

fn read_index(dir: &Path) -> Result<Vec<Descriptor>, LayoutError> {
    let p = dir.join("index.json");
    let b = fs::read(&p).map_err(|source| LayoutError::Io {
        path: p.clone(),
        source,
    })?;
    let v: Value = serde_json::from_slice(&b).map_err(|e| LayoutError::Format {
        dir: dir.to_path_buf(),
        reason: format!("index.json: {e}"),
    })?;
    let list = v.get("manifests").cloned().unwrap_or(Value::Array(vec![]));
    serde_json::from_value(list).map_err(|e| LayoutError::Format {
        dir: dir.to_path_buf(),
        reason: format!("index.json manifests: {e}"),
    })
}

/// Imports the image tagged `tag` (or the only image, when `tag` is `None`) from the layout at
/// `dir` into `cache`, choosing `platform` from an index. Returns the platform manifest
/// digest.
pub fn import(
    dir: &Path,
    tag: Option<&str>,
    platform: &Platform,
    cache: &dyn BlobCache,
) -> Result<String, LayoutError> {
    if !dir.join("oci-layout").is_file() {
        return Err(LayoutError::Format {
            dir: dir.to_path_buf(),
            reason: "no oci-layout file (not an OCI image layout)".into(),
        });
    }
    let entries = read_index(dir)?;
    let chosen = match tag {
        Some(t) => entries.iter().find(|d| {
            d.annotations
                .as_ref()
                .and_then(|a| a.get(REF_NAME))
                .map(String::as_str)
                == Some(t)
        }),
        None if entries.len() == 1 => entries.first(),
        None => None,
    };
    let Some(desc) = chosen else {
        return Err(LayoutError::NoImage {
            dir: dir.to_path_buf(),
            reason: match tag {
                Some(t) => format!("no image tagged {t:?}"),
                None => format!("{} images and no tag given", entries.len()),
            },
        });
    };
    let mut digest = desc.digest.clone();
    for _ in 0..4 {
        let bytes = read_blob_verified(dir, &digest)?;
        match AnyManifest::parse(&bytes, &digest)? {
            AnyManifest::Index(i) => {
                cache.put_bytes(&digest, &bytes)?;
                digest = i.select(platform, &digest)?.digest.clone();
            }
            AnyManifest::Image(m) => {
                for d in std::iter::once(&m.config).chain(&m.layers) {
                    copy_in(dir, &d.digest, cache)?;
                }
                cache.put_bytes(&digest, &bytes)?;
                return Ok(digest);
            }
        }
    }
    Err(LayoutError::Format {
        dir: dir.to_path_buf(),
        reason: "indexes nested more than 4 levels".into(),
    })
}

fn read_blob_verified(dir: &Path, digest: &str) -> Result<Vec<u8>, LayoutError> {
    let p = blob_path(dir, digest)?;
    let b = fs::read(&p).map_err(|source| LayoutError::Io { path: p, source })?;
    if digest_of(&b) != digest {
        return Err(LayoutError::Corrupt {
            dir: dir.to_path_buf(),
            digest: digest.to_string(),
        });
    }
    Ok(b)
}

fn copy_in(dir: &Path, digest: &str, cache: &dyn BlobCache) -> Result<(), LayoutError> {
    if cache.blob_path(digest)?.is_some() {
        return Ok(());
    }
    let src = blob_path(dir, digest)?;
    let staged = cache.ingest_path(digest)?;
    fs::copy(&src, &staged).map_err(|source| LayoutError::Io { path: src, source })?;
    match cache.commit(&staged, digest) {
        Ok(_) => Ok(()),
        Err(CacheError::Mismatch { .. }) => Err(LayoutError::Corrupt {
            dir: dir.to_path_buf(),
            digest: digest.to_string(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// Writes the image with manifest `digest` from `cache` into the layout at `dir` (created if
/// needed) under `tag`.
pub fn export(
    cache: &dyn BlobCache,
    digest: &str,
    dir: &Path,
    tag: &str,
) -> Result<(), LayoutError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LayoutError::Io { path, source }
    };
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).map_err(io(&blobs))?;
    let lp = dir.join("oci-layout");
    fs::write(&lp, br#"{"imageLayoutVersion":"1.0.0"}"#).map_err(io(&lp))?;
    let bytes = cache
        .read_blob(digest)?
        .ok_or_else(|| LayoutError::NoImage {
            dir: dir.to_path_buf(),
            reason: format!("manifest {digest} is not in the local store"),
        })?;
    let AnyManifest::Image(m) = AnyManifest::parse(&bytes, digest)? else {
        return Err(LayoutError::NoImage {
            dir: dir.to_path_buf(),
            reason: format!("{digest} is an index, not an image manifest"),
        });
    };
    for d in std::iter::once(&m.config).chain(&m.layers) {
        let dst = blob_path(dir, &d.digest)?;
        if dst.is_file() {
            continue;
        }
        let src = cache
            .blob_path(&d.digest)?
            .ok_or_else(|| LayoutError::NoImage {
                dir: dir.to_path_buf(),
                reason: format!("blob {} is not in the local store", d.digest),
            })?;
        let tmp = dst.with_extension("tmp");
        fs::copy(&src, &tmp).map_err(io(&src))?;
        fs::rename(&tmp, &dst).map_err(io(&dst))?;
    }
    let mp = blob_path(dir, digest)?;
    fs::write(&mp, &bytes).map_err(io(&mp))?;
    let mut entries: Vec<Value> = if dir.join("index.json").is_file() {
        read_index(dir)?
            .into_iter()
            .filter(|d| {
                d.annotations
                    .as_ref()
                    .and_then(|a| a.get(REF_NAME))
                    .map(String::as_str)
                    != Some(tag)
            })
            .map(|d| serde_json::to_value(d).expect("descriptors serialize"))
            .collect()
    } else {
        Vec::new()
    };
    entries.push(json!({
        "mediaType": m.media_type.as_deref().unwrap_or(OCI_MANIFEST),
        "digest": digest,
        "size": bytes.len(),
        "annotations": { REF_NAME: tag },
    }));
    let index =
        json!({ "schemaVersion": 2, "mediaType": crate::image::OCI_INDEX, "manifests": entries });
    let ip = dir.join("index.json");
    let tmp = dir.join("index.json.tmp");
    // A JSON value always serializes.
    fs::write(
        &tmp,
        serde_json::to_vec(&index).expect("JSON values serialize"),
    )
    .map_err(io(&tmp))?;
    fs::rename(&tmp, &ip).map_err(io(&ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        assert_eq!(
            parse_spec("oci:/a/b:t"),
            Some((PathBuf::from("/a/b"), Some("t".into())))
        );
        assert_eq!(parse_spec("oci:/a/b"), Some((PathBuf::from("/a/b"), None)));
        assert_eq!(
            parse_spec("oci:rel:x"),
            Some((PathBuf::from("rel"), Some("x".into())))
        );
        assert_eq!(parse_spec("docker://x"), None);
    }
}
