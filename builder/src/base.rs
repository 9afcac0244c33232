//! Base images: turn a FROM (or a `kiln pull` / `kiln unpack` argument) into a manifest
//! digest in the local cache, and unpack an image into a directory.
//!
//! Resolution order, as Docker uses local images: an `oci:DIR[:TAG]` spec imports from a
//! layout; a reference pinned by digest whose manifest is cached is used as is; otherwise the
//! local store is looked at first: its own tags (`kiln tag` / `kiln build -t`: a spec as
//! written that is a store tag `NAME[:TAG]` whose kiln image manifest has an OCI manifest
//! gives that OCI image), then its OCI references (`registry/repo:tag`, from `kiln pull` and
//! `kiln import`), then the registry. An image found locally whose config or layers are not
//! all in the store counts as not found. [`PullPolicy::Always`] (`--pull`) always asks the
//! registry; [`PullPolicy::Never`] (`--offline`) never does and fails with
//! [`BaseError::NotCached`], naming what was looked for. The digest, never the tag, is what
//! callers should record.

use std::path::Path;

use crate::cache::BlobCache;
use crate::image::{AnyManifest, ImageError, Manifest};
use crate::layer::{LayerError, LayerStats, Limits, apply_layer};
use crate::layout::{self, LayoutError};
use crate::reference::{Reference, ReferenceError};
use crate::registry::{Registry, RegistryError};

/// Errors resolving or unpacking a base image.
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    /// The reference does not parse.
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    /// A registry problem (including `--offline` misses).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// An OCI layout problem.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A layer could not be applied.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// A manifest problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A cache problem.
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    /// `--offline` and the image is not (completely) in the store (local or S3).
    #[error(
        "{spec} is not in the store and --offline forbids asking a registry \
         (looked for {looked}; kiln pull or kiln import it, or build and tag it, first)"
    )]
    NotCached {
        /// The reference as written.
        spec: String,
        /// What was looked for, e.g. `store tag debian:bookworm, pulled image
        /// docker.io/library/debian:bookworm`, or the blob that is missing.
        looked: String,
    },
    /// A layer blob the manifest names is not cached.
    #[error("layer {0} is not in the local store (pull the image first)")]
    MissingBlob(String),
    /// The unpack target could not be prepared or a blob not opened.
    #[error("{path}: {source}")]
    Io {
        /// The path involved.
        path: std::path::PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// When to ask the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PullPolicy {
    /// Local references first, the registry when missing (Docker's default for FROM).
    #[default]
    Missing,
    /// Always ask the registry (`--pull`).
    Always,
    /// Never ask (`--offline`).
    Never,
}

/// Where an image came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Found in the local cache.
    Local,
    /// Imported from an OCI layout.
    Layout,
    /// Pulled from a registry: blobs downloaded and bytes.
    Registry {
        /// Blobs downloaded.
        fetched: usize,
        /// Bytes downloaded.
        bytes: u64,
    },
}

/// Resolves `spec` (`oci:DIR[:TAG]` or an image reference) to a cached manifest digest.
pub async fn resolve(
    spec: &str,
    policy: PullPolicy,
    registry: &Registry,
    cache: &dyn BlobCache,
) -> Result<(String, Source), BaseError> {
    if let Some((dir, tag)) = layout::parse_spec(spec) {
        let d = layout::import(&dir, tag.as_deref(), &registry.options().platform, cache)?;
        return Ok((d, Source::Layout));
    }
    let r: Reference = spec.parse()?;
    if policy != PullPolicy::Always {
        let found = match store_tag(spec, cache)? {
            Some(d) => Some(d),
            None => local(&r, cache)?,
        };
        if let Some(d) = &found {
            match first_missing(cache, d)? {
                None => return Ok((d.clone(), Source::Local)),
                Some(missing) if policy == PullPolicy::Never => {
                    return Err(BaseError::NotCached {
                        spec: spec.to_string(),
                        looked: format!("image {d}, whose blob {missing} is missing"),
                    });
                }
                Some(_) => {}
            }
        }
        if policy == PullPolicy::Never {
            return Err(BaseError::NotCached {
                spec: spec.to_string(),
                looked: looked_for(spec, &r),
            });
        }
    }
    let p = registry.pull(&r, cache).await?;
    Ok((
        p.digest,
        Source::Registry {
            fetched: p.fetched,
            bytes: p.fetched_bytes,
        },
    ))
}

/// The store tag a spec as written names (`NAME:TAG`, or `NAME` for `NAME:latest`; `NAME` may
/// be `myorg/app`), if it is one in kiln's tag grammar. A digest-pinned spec never is.
pub fn as_store_tag(spec: &str) -> Option<kiln_store::TagRef> {
    if spec.contains('@') {
        return None;
    }
    spec.parse().ok()
}

/// The OCI manifest digest of the kiln image the store tag `spec` names, when it is a store
/// tag, exists, and its image has an OCI manifest in the store.
pub fn store_tag(spec: &str, cache: &dyn BlobCache) -> Result<Option<String>, BaseError> {
    let Some(t) = as_store_tag(spec) else {
        return Ok(None);
    };
    match cache.store_tag(&t.to_string())? {
        Some(d) if cache.blob_path(&d)?.is_some() => Ok(Some(d)),
        _ => Ok(None),
    }
}

fn looked_for(spec: &str, r: &Reference) -> String {
    let pulled = match r.digest() {
        Some(d) => format!("image {d}"),
        None => format!(
            "pulled image {}:{}",
            r.name(),
            r.tag().unwrap_or(crate::reference::DEFAULT_TAG)
        ),
    };
    match as_store_tag(spec) {
        Some(t) => format!("store tag {t}, {pulled}"),
        None => pulled,
    }
}

/// The first blob (config, then layers) of image manifest `digest` that the cache lacks;
/// `None` when the image is complete.
fn first_missing(cache: &dyn BlobCache, digest: &str) -> Result<Option<String>, BaseError> {
    let m = manifest(cache, digest)?;
    for d in std::iter::once(&m.config).chain(&m.layers) {
        if cache.blob_path(&d.digest)?.is_none() {
            return Ok(Some(d.digest.clone()));
        }
    }
    Ok(None)
}

/// The cached platform manifest for a reference, if any: by its digest, or by its name.
/// A digest that names a cached index is not followed here (pull resolves platforms).
pub fn local(r: &Reference, cache: &dyn BlobCache) -> Result<Option<String>, BaseError> {
    if let Some(d) = r.digest() {
        if let Some(b) = cache.read_blob(d)?
            && matches!(AnyManifest::parse(&b, d)?, AnyManifest::Image(_))
        {
            return Ok(Some(d.to_string()));
        }
        return Ok(None);
    }
    let tag = r.tag().unwrap_or(crate::reference::DEFAULT_TAG);
    match cache.get_ref(&format!("{}:{tag}", r.name()))? {
        Some(d) if cache.blob_path(&d)?.is_some() => Ok(Some(d)),
        _ => Ok(None),
    }
}

/// Finds an image in the cache by `sha256:<hex>`, store tag, or reference (pulled or
/// imported).
pub fn lookup(spec: &str, cache: &dyn BlobCache) -> Result<Option<String>, BaseError> {
    if spec.starts_with("sha256:") {
        crate::cache::sha256_hex(spec)?;
        return Ok(cache.blob_path(spec)?.map(|_| spec.to_string()));
    }
    if let Some(d) = store_tag(spec, cache)? {
        return Ok(Some(d));
    }
    local(&spec.parse()?, cache)
}

/// The parsed manifest `digest` from the cache.
pub fn manifest(cache: &dyn BlobCache, digest: &str) -> Result<Manifest, BaseError> {
    let b = cache
        .read_blob(digest)?
        .ok_or_else(|| BaseError::MissingBlob(digest.to_string()))?;
    match AnyManifest::parse(&b, digest)? {
        AnyManifest::Image(m) => Ok(m),
        AnyManifest::Index(_) => Err(BaseError::MissingBlob(format!("{digest} (an index)"))),
    }
}

/// Unpacks the image `digest` into `dir` (created if missing), layer by layer. Returns the
/// summed [`LayerStats`].
pub fn unpack(
    cache: &dyn BlobCache,
    digest: &str,
    dir: &Path,
    limits: &Limits,
) -> Result<LayerStats, BaseError> {
    let m = manifest(cache, digest)?;
    std::fs::create_dir_all(dir).map_err(|source| BaseError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut total = LayerStats::default();
    for l in &m.layers {
        let p = cache
            .blob_path(&l.digest)?
            .ok_or_else(|| BaseError::MissingBlob(l.digest.clone()))?;
        let f = std::fs::File::open(&p).map_err(|source| BaseError::Io { path: p, source })?;
        let s = apply_layer(dir, f, &l.digest, limits)?;
        total.entries += s.entries;
        total.bytes += s.bytes;
    }
    Ok(total)
}
