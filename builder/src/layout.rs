//! OCI image layout directories (OCI image spec `image-layout.md`): `oci-layout`,
//! `index.json`, `blobs/<alg>/<hex>`. Tags are the `org.opencontainers.image.ref.name`
//! annotation of `index.json` entries, as skopeo's and umoci's `oci:DIR:TAG` use them.
//!
//! [`import`] copies an image from a layout into the blob cache (every blob hashed on the
//! way in); [`export`] writes an image from the cache into a layout, adding or replacing the
//! entry for its tag and keeping the others.
//!
//! A layout directory is untrusted input. Reading, `index.json` and every blob are opened with
//! `O_NOFOLLOW | O_NONBLOCK` and must be regular files (a blob that is a symlink, a FIFO or a
//! device such as `/dev/zero` is refused, not read forever); `index.json` and manifests are
//! read up to [`MAX_MANIFEST_BYTES`]. Writing, each file goes to a fresh `<name>.tmp`
//! (`O_EXCL`, after removing whatever was planted there) and is renamed over its name, and
//! `blobs` and `blobs/sha256` must be real directories, so a symlink planted in an existing
//! layout is replaced, never written through.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use kiln_store::BlobDigest;

use crate::cache::{BlobCache, CacheError};
use crate::image::{AnyManifest, Descriptor, ImageError, OCI_MANIFEST, Platform};
pub use crate::oci_compat::LayerCompression;

/// The annotation that names a tag in `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Largest `index.json` or manifest read from a layout, bytes. The same 4 MiB bound that
/// containerd and the distribution registry put on manifests.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

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
        digest: BlobDigest,
    },
    /// A manifest problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A cache problem.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A zstd layer could not be gzipped for the layout.
    #[error(transparent)]
    Compat(#[from] crate::oci_compat::CompatError),
}

/// An image in an OCI layout directory, as skopeo and umoci name it: `oci:DIR[:TAG]`
/// (`kiln import`, a `FROM` of an operator's build) or a named build context
/// `NAME=oci-layout://DIR[:TAG]` (`kiln build --build-context`, as buildx takes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutRef {
    /// The layout directory.
    pub dir: PathBuf,
    /// The tag (`org.opencontainers.image.ref.name`), if one is named.
    pub tag: Option<String>,
}

impl LayoutRef {
    /// Reads `oci:DIR[:TAG]`. `None` if `s` does not start `oci:`.
    pub fn parse(s: &str) -> Option<LayoutRef> {
        Self::from_dir_and_tag(s.strip_prefix("oci:")?)
    }

    /// Reads `DIR[:TAG]`: a tag never contains `/`, so a `:` after the last `/` separates
    /// it. `None` for an empty directory.
    pub fn from_dir_and_tag(rest: &str) -> Option<LayoutRef> {
        let slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (dir, tag) = match rest[slash..].rfind(':') {
            Some(i) => (&rest[..slash + i], Some(rest[slash + i + 1..].to_string())),
            None => (rest, None),
        };
        (!dir.is_empty()).then(|| LayoutRef {
            dir: PathBuf::from(dir),
            tag,
        })
    }

    /// The image: imports it into `cache` ([`import`]) and gives its manifest digest.
    pub fn import(
        &self,
        platform: &Platform,
        cache: &dyn BlobCache,
    ) -> Result<BlobDigest, LayoutError> {
        import(&self.dir, self.tag.as_deref(), platform, cache)
    }
}

/// `oci:DIR[:TAG]`.
impl std::fmt::Display for LayoutRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oci:{}", self.dir.display())?;
        match &self.tag {
            Some(t) => write!(f, ":{t}"),
            None => Ok(()),
        }
    }
}

fn blob_path(dir: &Path, digest: &BlobDigest) -> PathBuf {
    dir.join("blobs/sha256").join(digest.hex())
}

/// Opens `p` for reading if it is a regular file, never following a symlink at its name and
/// never blocking on a FIFO.
fn open_regular(dir: &Path, p: &Path) -> Result<fs::File, LayoutError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| LayoutError::Io {
        path: p.to_path_buf(),
        source,
    };
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(p)
        .map_err(io)?;
    if !f.metadata().map_err(io)?.is_file() {
        return Err(LayoutError::Format {
            dir: dir.to_path_buf(),
            reason: format!("{} is not a regular file", p.display()),
        });
    }
    Ok(f)
}

/// Reads a regular file of at most [`MAX_MANIFEST_BYTES`].
fn read_small(dir: &Path, p: &Path) -> Result<Vec<u8>, LayoutError> {
    use std::io::Read;
    let mut b = Vec::new();
    open_regular(dir, p)?
        .take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut b)
        .map_err(|source| LayoutError::Io {
            path: p.to_path_buf(),
            source,
        })?;
    if b.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(LayoutError::Format {
            dir: dir.to_path_buf(),
            reason: format!(
                "{} is over the {MAX_MANIFEST_BYTES}-byte manifest limit",
                p.display()
            ),
        });
    }
    Ok(b)
}

/// Writes `path` through a fresh `<path>.tmp` and a rename, so a symlink planted at either
/// name is replaced, not written through.
fn write_replacing(
    path: &Path,
    fill: impl FnOnce(&mut fs::File) -> std::io::Result<()>,
) -> Result<(), LayoutError> {
    let tmp = path.with_extension("tmp");
    let io = |p: &Path| {
        let path = p.to_path_buf();
        move |source| LayoutError::Io { path, source }
    };
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&tmp)(e)),
        _ => {}
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(io(&tmp))?;
    if let Err(e) = fill(&mut f).and_then(|_| f.sync_all()) {
        let _ = fs::remove_file(&tmp);
        return Err(io(&tmp)(e));
    }
    fs::rename(&tmp, path).map_err(io(path))
}

fn read_index(dir: &Path) -> Result<Vec<Descriptor>, LayoutError> {
    let p = dir.join("index.json");
    let b = read_small(dir, &p)?;
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
) -> Result<BlobDigest, LayoutError> {
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
        let tags: Vec<&str> = entries
            .iter()
            .filter_map(|d| d.annotations.as_ref()?.get(REF_NAME).map(String::as_str))
            .collect();
        let tags = if tags.is_empty() {
            "none".to_string()
        } else {
            tags.join(", ")
        };
        return Err(LayoutError::NoImage {
            dir: dir.to_path_buf(),
            reason: match tag {
                Some(t) => format!("no image tagged {t:?} (its tags: {tags})"),
                None => format!(
                    "{} images and no tag given: name one as oci:DIR:TAG (its tags: {tags})",
                    entries.len()
                ),
            },
        });
    };
    let mut digest = desc.digest;
    for _ in 0..4 {
        let bytes = read_blob_verified(dir, &digest)?;
        match AnyManifest::parse(&bytes, &digest)? {
            AnyManifest::Index(i) => {
                cache.put_bytes(&digest, &bytes)?;
                digest = i.select(platform, &digest)?.digest;
            }
            AnyManifest::Image(m) => {
                for d in std::iter::once(&m.config).chain(&m.layers) {
                    copy_in(dir, d, cache)?;
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

fn read_blob_verified(dir: &Path, digest: &BlobDigest) -> Result<Vec<u8>, LayoutError> {
    let p = blob_path(dir, digest);
    let b = read_small(dir, &p)?;
    if BlobDigest::of(&b) != *digest {
        return Err(LayoutError::Corrupt {
            dir: dir.to_path_buf(),
            digest: *digest,
        });
    }
    Ok(b)
}

/// Copies the blob `d` names into the cache. Its file must be exactly `d.size` bytes (the
/// size bounds what is copied; the digest is checked by the cache).
fn copy_in(dir: &Path, d: &Descriptor, cache: &dyn BlobCache) -> Result<(), LayoutError> {
    let digest = &d.digest;
    if cache.blob_path(digest)?.is_some() {
        return Ok(());
    }
    let src = blob_path(dir, digest);
    let mut input = open_regular(dir, &src)?;
    let len = input
        .metadata()
        .map_err(|source| LayoutError::Io {
            path: src.clone(),
            source,
        })?
        .len();
    if len != d.size {
        return Err(LayoutError::Format {
            dir: dir.to_path_buf(),
            reason: format!(
                "blob {digest} is {len} bytes, its descriptor says {}",
                d.size
            ),
        });
    }
    let staged = cache.ingest_path(digest)?;
    fs::File::create(&staged)
        .and_then(|mut out| std::io::copy(&mut input, &mut out))
        .map_err(|source| LayoutError::Io { path: src, source })?;
    match cache.commit(&staged, digest) {
        Ok(_) => Ok(()),
        Err(CacheError::Mismatch { .. }) => Err(LayoutError::Corrupt {
            dir: dir.to_path_buf(),
            digest: *digest,
        }),
        Err(e) => Err(e.into()),
    }
}

/// Writes the image with manifest `digest` from `cache` into the layout at `dir` (created if
/// needed) under `tag`; with [`LayerCompression::Gzip`], its zstd layers gzipped for
/// consumers that read no zstd ([`crate::oci_compat`]). Returns the digest of the manifest
/// written: `digest` itself when no layer changed.
pub fn export(
    cache: &dyn BlobCache,
    digest: &BlobDigest,
    dir: &Path,
    tag: &str,
    layers: LayerCompression,
) -> Result<BlobDigest, LayoutError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LayoutError::Io { path, source }
    };
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).map_err(io(&blobs))?;
    for d in [dir.join("blobs"), blobs.clone()] {
        if !fs::symlink_metadata(&d).map_err(io(&d))?.is_dir() {
            return Err(LayoutError::Format {
                dir: dir.to_path_buf(),
                reason: format!("{} is not a directory", d.display()),
            });
        }
    }
    write_replacing(&dir.join("oci-layout"), |f| {
        f.write_all(br#"{"imageLayoutVersion":"1.0.0"}"#)
    })?;
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
    let crate::oci_compat::Outgoing {
        bytes,
        digest,
        manifest: m,
        mut gzipped,
    } = crate::oci_compat::outgoing(cache, bytes, digest, m, layers, &blobs)?;
    let digest = &digest;
    for d in std::iter::once(&m.config).chain(&m.layers) {
        let dst = blob_path(dir, &d.digest);
        if fs::symlink_metadata(&dst).is_ok_and(|m| m.is_file()) {
            continue;
        }
        if let Some(g) = gzipped.iter_mut().find(|g| g.digest == d.digest) {
            write_replacing(&dst, |out| std::io::copy(&mut g.file, out).map(|_| ()))?;
            continue;
        }
        let src = cache
            .blob_path(&d.digest)?
            .ok_or_else(|| LayoutError::NoImage {
                dir: dir.to_path_buf(),
                reason: format!("blob {} is not in the local store", d.digest),
            })?;
        let mut input = fs::File::open(&src).map_err(io(&src))?;
        write_replacing(&dst, |out| std::io::copy(&mut input, out).map(|_| ()))?;
    }
    write_replacing(&blob_path(dir, digest), |f| f.write_all(&bytes))?;
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
        "digest": digest.to_string(),
        "size": bytes.len(),
        "annotations": { REF_NAME: tag },
    }));
    let index =
        json!({ "schemaVersion": 2, "mediaType": crate::image::OCI_INDEX, "manifests": entries });
    // A JSON value always serializes.
    let body = serde_json::to_vec(&index).expect("JSON values serialize");
    write_replacing(&dir.join("index.json"), |f| f.write_all(&body))?;
    Ok(*digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::LocalCache;

    #[test]
    fn specs() {
        let r = |d: &str, t: Option<&str>| {
            Some(LayoutRef {
                dir: PathBuf::from(d),
                tag: t.map(str::to_string),
            })
        };
        assert_eq!(LayoutRef::parse("oci:/a/b:t"), r("/a/b", Some("t")));
        assert_eq!(LayoutRef::parse("oci:/a/b"), r("/a/b", None));
        assert_eq!(LayoutRef::parse("oci:rel:x"), r("rel", Some("x")));
        assert_eq!(LayoutRef::parse("docker://x"), None);
        assert_eq!(LayoutRef::parse("oci:"), None);
        assert_eq!(
            LayoutRef::parse("oci:/a/b:t").map(|l| l.to_string()),
            Some("oci:/a/b:t".into())
        );
    }

    /// A one-layer layout in `dir`; returns (manifest digest, layer digest).
    fn layout(dir: &Path) -> (BlobDigest, BlobDigest) {
        layout_with(dir, |_| {})
    }

    fn layout_with(dir: &Path, tweak: impl FnOnce(&mut Value)) -> (BlobDigest, BlobDigest) {
        let put = |b: &[u8]| {
            let d = BlobDigest::of(b);
            fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
            fs::write(blob_path(dir, &d), b).unwrap();
            d
        };
        let config =
            br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
        let cd = put(config);
        let ld = put(b"layer bytes");
        let mut m = json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd.to_string(), "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld.to_string(), "size": 11}],
        });
        tweak(&mut m);
        let mb = serde_json::to_vec(&m).unwrap();
        let md = put(&mb);
        fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        let index = json!({"schemaVersion": 2, "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": md.to_string(), "size": mb.len(), "annotations": {REF_NAME: "t"}}
        ]});
        fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
        (md, ld)
    }

    fn fifo(p: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from(0o600),
            0,
        )
        .unwrap();
    }

    fn import_t(dir: &Path, cache: &LocalCache) -> Result<BlobDigest, LayoutError> {
        import(dir, Some("t"), &Platform::linux_amd64(), cache)
    }

    #[test]
    fn hostile_layout_files_are_refused_not_read_forever() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&tmp.path().join("cache")).unwrap();
        let dir = tmp.path().join("l");
        let (md, ld) = layout(&dir);
        // Sanity: the clean layout imports.
        assert_eq!(import_t(&dir, &cache).unwrap(), md);
        let cache = LocalCache::open(&tmp.path().join("cache2")).unwrap();
        // A layer blob that is a symlink to /dev/zero (fs::copy would fill the disk).
        let lp = blob_path(&dir, &ld);
        fs::remove_file(&lp).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &lp).unwrap();
        assert!(import_t(&dir, &cache).is_err());
        // ... or a FIFO (a read would block forever).
        fs::remove_file(&lp).unwrap();
        fifo(&lp);
        assert!(matches!(
            import_t(&dir, &cache),
            Err(LayoutError::Format { .. })
        ));
        // The manifest blob a FIFO, and index.json a symlink to /dev/zero.
        let mp = blob_path(&dir, &md);
        fs::remove_file(&mp).unwrap();
        fifo(&mp);
        assert!(matches!(
            import_t(&dir, &cache),
            Err(LayoutError::Format { .. })
        ));
        fs::remove_file(dir.join("index.json")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("index.json")).unwrap();
        assert!(import_t(&dir, &cache).is_err());
    }

    #[test]
    fn oversized_index_or_manifest_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&tmp.path().join("cache")).unwrap();
        let dir = tmp.path().join("l");
        layout(&dir);
        let mut big = b"{\"schemaVersion\":2,\"manifests\":[]".to_vec();
        big.resize(MAX_MANIFEST_BYTES as usize + 10, b' ');
        big.push(b'}');
        fs::write(dir.join("index.json"), &big).unwrap();
        let err = import_t(&dir, &cache).unwrap_err();
        assert!(err.to_string().contains("manifest limit"), "{err}");
    }

    #[test]
    fn export_replaces_planted_symlinks_instead_of_writing_through_them() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&tmp.path().join("cache")).unwrap();
        let src = tmp.path().join("src");
        let (md, ld) = layout(&src);
        import_t(&src, &cache).unwrap();
        let victim = tmp.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        let out = tmp.path().join("out");
        fs::create_dir_all(out.join("blobs/sha256")).unwrap();
        for p in [
            blob_path(&out, &md),
            blob_path(&out, &ld),
            blob_path(&out, &ld).with_extension("tmp"),
            out.join("index.json.tmp"),
            out.join("oci-layout"),
        ] {
            std::os::unix::fs::symlink(&victim, p).unwrap();
        }
        export(&cache, &md, &out, "t", LayerCompression::Gzip).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        let c2 = LocalCache::open(&tmp.path().join("cache2")).unwrap();
        assert_eq!(import_t(&out, &c2).unwrap(), md);
        // A symlinked blobs directory is refused.
        let out2 = tmp.path().join("out2");
        fs::create_dir_all(&out2).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        fs::create_dir_all(elsewhere.join("sha256")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, out2.join("blobs")).unwrap();
        assert!(export(&cache, &md, &out2, "t", LayerCompression::Gzip).is_err());
        assert_eq!(fs::read_dir(elsewhere.join("sha256")).unwrap().count(), 0);
    }

    #[test]
    fn a_malformed_digest_is_refused_where_it_enters_naming_its_file() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&tmp.path().join("cache")).unwrap();
        // In index.json: refused reading the index, which the error names.
        let dir = tmp.path().join("bad-index");
        let (md, _) = layout(&dir);
        let index = fs::read_to_string(dir.join("index.json")).unwrap();
        let bad = "sha256:../../../../etc/passwd";
        fs::write(dir.join("index.json"), index.replace(&md.to_string(), bad)).unwrap();
        let err = import_t(&dir, &cache).unwrap_err();
        assert!(matches!(err, LayoutError::Format { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("index.json") && text.contains(bad), "{text}");
        // In a manifest: refused parsing it, naming the manifest and the bad digest.
        let dir = tmp.path().join("bad-layer");
        layout_with(&dir, |m| m["layers"][0]["digest"] = json!("sha256:ABC"));
        let err = import_t(&dir, &cache).unwrap_err();
        assert!(
            matches!(
                &err,
                LayoutError::Image(ImageError::BadDescriptor { bad, .. }) if bad == "sha256:ABC"
            ),
            "{err:?}"
        );
        assert!(err.to_string().starts_with("manifest sha256:"), "{err}");
    }

    #[test]
    fn descriptor_sizes_bound_what_is_copied() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&tmp.path().join("cache")).unwrap();
        // A config claiming 1 TiB is refused before anything is copied.
        let dir = tmp.path().join("big-config");
        layout_with(&dir, |m| m["config"]["size"] = json!(1u64 << 40));
        assert!(matches!(
            import_t(&dir, &cache),
            Err(LayoutError::Image(ImageError::ConfigTooLarge { .. }))
        ));
        // A layer file larger than its descriptor says is refused.
        let dir = tmp.path().join("lying-size");
        layout_with(&dir, |m| m["layers"][0]["size"] = json!(3));
        let err = import_t(&dir, &cache).unwrap_err();
        assert!(err.to_string().contains("descriptor says 3"), "{err}");
    }
}
