//! Publishing a built image: OCI blobs + ext4 root file system → kiln image manifest → tags.
//!
//! [`publish`] takes what a build produced ([`BuiltImage`]: the OCI manifest, config and
//! layers, all already in the local blob cache) and, in DESIGN.md's publish order:
//!
//! 1. flattens the layers into one ext4 image with [`crate::ext4::build_unchecked`]
//!    (deterministic), in a scratch file beside the blob cache;
//! 2. stores it as a chunked artifact ([`Store::put_artifact`], FastCDC 16/64/256 KiB unless
//!    [`PublishOptions::chunking`] says otherwise), taking the chunks encoded while step 1
//!    wrote the image from their memo ([`crate::publish_ahead`]), while `e2fsck -fn` checks it
//!    ([`crate::ext4::Check`]); a failed check stops the publish there, before any manifest,
//!    image cache entry or tag;
//! 3. stores the OCI manifest, config and layers as blobs of the store, while step 1 runs
//!    (they do not depend on the image, and mke2fs keeps one core busy). The blob cache and a
//!    local store on the same directory share `blobs/sha256/<hex>`, so for that store this is
//!    a put-if-absent that finds every blob present; for any other store (S3, another
//!    directory) the blobs are uploaded (streamed, multipart on S3). Either way the image
//!    manifest only names blobs the store holds, and GC keeps them through it;
//! 4. writes the [`ImageManifest`]: the disk chunk table, the OCI manifest and config as
//!    blobs, the layers (bottom first) in `blobs`, [`ImageManifest::filesystem`] (block size,
//!    pinned feature list, UUID, mke2fs version), [`ImageManifest::sandbox`], the recipe
//!    digest and provenance. Nothing in it depends on the time or the host, so identical
//!    inputs give an identical manifest digest; build time and host go into the tag history;
//! 5. moves each tag to the manifest by compare-and-swap ([`Store::force_tag`]), recording the
//!    previous digest in the tag history.
//!
//! ## Reusing an image
//! Steps 1–4 are skipped when the store already holds the image manifest they would write:
//! [`flatten_key`] hashes everything the manifest is made from (the OCI manifest, config and
//! layer digests, recipe digest, provenance, sandbox, the ext4 options, the pinned features
//! and identity, the mke2fs configuration and version, [`ext4::FLATTEN_VERSION`], kiln's
//! version, the chunking), and an image cache entry (`images/<key>`,
//! [`Store::put_image_entry`]) written after each publish names its manifest. A later
//! publish with the same key leases that manifest and everything it names (every chunk and
//! blob: [`kiln_store::manifest::references`]) and checks under the sweep lock that all of
//! it is present ([`Lease::find_present`]); only then do the tags move to it. If anything is
//! missing (a GC swept it, an entry from another store's history), it flattens as usual and
//! the entry is rewritten. Reuse needs [`PublishOptions::lease`]: without a lease nothing
//! keeps the objects between the check and the tag, so it flattens.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use kiln_store::artifact::PutArtifactOptions;
use kiln_store::lease::Lease;
use kiln_store::progress::ProgressFn;
use kiln_store::{
    BlobDigest, BlobRef, Chunking, ImageManifest, Manifest, ManifestDigest, ReadySpec, SandboxSpec,
    StartSpec, Store, StoreError, TagRef,
};

use crate::cache::{BlobCache, CacheError};
use crate::ext4::{self, Ext4Error, Ext4Options, LayerBlob};
use crate::image;

/// What a build produced. All blobs are already in the blob cache.
#[derive(Debug, Clone)]
pub struct BuiltImage {
    /// Digest, size and media type of the OCI image manifest blob.
    pub oci_manifest: image::Descriptor,
    /// The OCI image config blob.
    pub config: image::Descriptor,
    /// The layer blobs, bottom first.
    pub layers: Vec<image::Descriptor>,
    /// How the image runs as a sandbox: start command, ready check, disk size.
    pub sandbox: kiln_recipes::plan::Sandbox,
    /// Digest (`sha256:<hex>`) of the recipe the image was built from.
    pub recipe_digest: kiln_store::digest::Sha256Hash,
    /// Base image digests, kiln version and the like. No times (they would make the manifest
    /// digest depend on when it was built).
    pub provenance: BTreeMap<String, String>,
    /// `SOURCE_DATE_EPOCH` of the build, seconds; `None`: kiln's fixed default epoch
    /// ([`crate::ext4::DEFAULT_EPOCH`]).
    pub source_date_epoch: Option<u64>,
}

/// Options of [`publish`].
#[derive(Clone, Default)]
pub struct PublishOptions {
    /// Disk size in MiB (`--disk-mib`); overrides the recipe's `disk_mib`. `None` and no
    /// recipe value: the smallest size holding the tree plus [`crate::ext4`]'s headroom.
    pub disk_mib: Option<u64>,
    /// Largest image accepted when the size is computed, MiB; `None`:
    /// [`crate::ext4::DEFAULT_MAX_MIB`].
    pub max_mib: Option<u64>,
    /// Chunking of the ext4 artifact; `None`: [`Chunking::DISK_DEFAULT`].
    pub chunking: Option<Chunking>,
    /// Bounds applied while reading the layers.
    pub limits: crate::layer::Limits,
    /// Where the scratch ext4 file goes; `None`: the blob cache's scratch area.
    pub scratch_dir: Option<PathBuf>,
    /// Told of each ext4 chunk stored or found present, and of each hole
    /// ([`Store::put_artifact`]'s events); [`kiln_store::progress::TransferStats`] adds them
    /// up into new and reused chunks.
    pub progress: Option<ProgressFn>,
    /// A lease (the build's) that records every ext4 chunk, blob and the image manifest
    /// before each is stored or looked up, so GC keeps them until a tag names them
    /// ([`kiln_store::gc`]).
    pub lease: Option<Arc<Lease>>,
    /// A tenant build's workspace: its image cache entry (`images/<key>`) is the
    /// workspace's own ([`crate::build::key::workspace_key`] over [`flatten_key`]), so a
    /// publish reuses only what that workspace published. `None`: the operator's builds.
    pub workspace: Option<String>,
    /// A scan of the image's bottom layers started earlier (the build's base, while its
    /// steps ran), continued by the flatten when it was made with the same settings
    /// ([`ext4::build_from`]); dropped unused when the image is reused.
    pub prescan: Option<ext4::Prescan>,
}

/// Why publishing failed. Nothing is tagged when any step fails.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Making or checking the ext4 image failed.
    #[error(transparent)]
    Ext4(#[from] Ext4Error),
    /// The blob cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The store failed (chunks, blobs, manifest or a tag).
    #[error(transparent)]
    Store(Box<StoreError>),
    /// A blob the image names is not in the blob cache.
    #[error("blob {0} of the built image is not in the blob cache")]
    MissingBlob(BlobDigest),
    /// The store hashed a blob differently from its descriptor.
    #[error("blob {digest}: {reason}")]
    BadBlob {
        /// The digest named.
        digest: BlobDigest,
        /// What is wrong.
        reason: String,
    },
    /// Writing the scratch file failed.
    #[error("scratch file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

impl From<StoreError> for PublishError {
    fn from(e: StoreError) -> Self {
        PublishError::Store(Box::new(e))
    }
}

/// The store's [`SandboxSpec`] for a plan's sandbox; `None` when it has neither a start
/// command nor a ready check.
pub fn sandbox_spec(s: &kiln_recipes::plan::Sandbox) -> Option<SandboxSpec> {
    if s.start.is_none() && s.ready.is_none() {
        return None;
    }
    Some(SandboxSpec {
        start: s.start.as_ref().map(|c| StartSpec {
            argv: c.argv.clone(),
            user: c.user.clone(),
            env: c.env.clone(),
            workdir: c.workdir.clone(),
        }),
        ready: s.ready.as_ref().map(|r| ReadySpec {
            argv: r.argv.clone(),
            interval_ms: r.interval_ms,
            timeout_ms: r.timeout_ms,
            retries: r.retries,
        }),
    })
}

/// Stores one cached blob in `store` and checks the store's digest against the descriptor.
async fn put_blob(
    store: &Store,
    cache: &dyn BlobCache,
    d: &image::Descriptor,
) -> Result<BlobRef, PublishError> {
    let want = d.digest;
    let path = cache
        .blob_path(&d.digest)?
        .ok_or(PublishError::MissingBlob(d.digest))?;
    let (mut r, _) = store.put_blob_file(&path).await?;
    if r.digest != want || r.size != d.size {
        return Err(PublishError::BadBlob {
            digest: d.digest,
            reason: format!(
                "the cached file hashes to {} ({} bytes), the descriptor says {} bytes",
                r.digest, r.size, d.size
            ),
        });
    }
    r.media_type = Some(d.media_type.clone());
    Ok(r)
}

/// What [`publish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Publication {
    /// The image manifest the tags name.
    pub manifest: ManifestDigest,
    /// `true`: an earlier publish's manifest with the same [`flatten_key`] was reused, all of
    /// it present; nothing was flattened or chunked.
    pub reused: bool,
}

/// The key of the image cache entry for `image` made with `ext4_opts` and `chunking` by
/// mke2fs `mke2fs_version`: lowercase hex sha256 (64 characters) of a JSON object of every
/// input of the image manifest (see the module doc). Equal keys mean equal manifests, as
/// long as [`ext4::FLATTEN_VERSION`] is bumped with any change to what the flattener makes
/// of the same layers. Errors: none (serializing plain values cannot fail).
pub fn flatten_key(
    image: &BuiltImage,
    ext4_opts: &Ext4Options,
    chunking: Chunking,
    mke2fs_version: &str,
) -> String {
    let l = &ext4_opts.limits;
    let v = serde_json::json!({
        "flattener": ext4::FLATTEN_VERSION,
        "kiln": env!("CARGO_PKG_VERSION"),
        "ociManifest": image.oci_manifest.digest,
        "config": image.config.digest,
        "layers": image.layers.iter().map(|d| &d.digest).collect::<Vec<_>>(),
        "recipeDigest": image.recipe_digest.to_string(),
        "provenance": image.provenance,
        "sandbox": sandbox_spec(&image.sandbox),
        "diskMib": ext4_opts.disk_mib,
        "maxMib": ext4_opts.max_mib,
        "sourceDateEpoch": ext4_opts.source_date_epoch,
        // The last two were the ratio bound (100 past 64 MiB), dropped in issue 44: written
        // as they were, so that keys of images made before stay the same (an image that
        // flattened under that bound flattens to the same manifest without it). The
        // deadline is no input of the manifest.
        "limits": [l.max_total_bytes, l.max_entries, l.max_file_bytes, 100, 64u64 << 20],
        "features": ext4::FEATURES,
        "identity": ext4::ROOTFS_SEED,
        "mke2fsConf": ext4::MKE2FS_CONF,
        "mke2fs": mke2fs_version,
        "chunking": chunking,
    });
    hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        v.to_string().as_bytes(),
    ))
}

/// The image manifest of image cache entry `key` when it and every object it names are in
/// `store`, all leased by `lease` first; `None` otherwise (no entry, a corrupt one, or
/// something missing: logged).
async fn reusable(
    store: &Store,
    lease: &Lease,
    key: &str,
) -> Result<Option<(ManifestDigest, Manifest)>, PublishError> {
    let entry = match store.get_image_entry(key).await {
        Ok(Some(e)) => e,
        Ok(None) => return Ok(None),
        Err(e) => {
            tracing::warn!(key, error = %e, "ignoring the image cache entry");
            return Ok(None);
        }
    };
    let d = entry.manifest;
    let top = [kiln_store::ObjectRef::Manifest(d)];
    if lease.find_present(&top).await?.is_empty() {
        tracing::info!(key, manifest = %d, "image cache entry names a manifest not in the store");
        return Ok(None);
    }
    let m = match store.get_manifest(&d).await? {
        m @ Manifest::Image(_) => m,
        _ => return Ok(None),
    };
    let refs = kiln_store::manifest::references(&m);
    let present = lease.find_present(&refs).await?;
    if present.len() != refs.len() {
        tracing::info!(
            key,
            manifest = %d,
            missing = refs.len() - present.len(),
            "image cache entry's manifest misses objects; flattening again"
        );
        return Ok(None);
    }
    Ok(Some((d, m)))
}

/// The blob files of `layers` (bottom first) in the blob cache, as the flattener reads
/// them: what a publish flattens, and what the pipeline's prescan of a base image scans.
/// Errors: [`PublishError::MissingBlob`] for a layer the cache lacks.
pub fn layer_blobs(
    cache: &dyn BlobCache,
    layers: &[image::Descriptor],
) -> Result<Vec<LayerBlob>, PublishError> {
    layers
        .iter()
        .map(|l| {
            let path = cache
                .blob_path(&l.digest)?
                .ok_or(PublishError::MissingBlob(l.digest))?;
            Ok(LayerBlob {
                digest: l.digest.to_string(),
                path,
            })
        })
        .collect()
}

/// Publishes `image` into `store` and points `tags` at it, reusing the image manifest of an
/// identical earlier publish when all of it is present (module doc, "Reusing an image").
///
/// The ext4 size is [`PublishOptions::disk_mib`], else the recipe's
/// [`kiln_recipes::plan::Sandbox::disk_mib`], else computed (see [`crate::ext4`]). The
/// file-system identity is [`ext4::ROOTFS_SEED`]'s, the same for every image, so a rebuild
/// shares its metadata blocks with the image before it. Errors: see
/// [`PublishError`]; on any error no tag moves (chunks and blobs already stored stay, for GC).
pub async fn publish(
    store: &Store,
    cache: &dyn BlobCache,
    image: &BuiltImage,
    tags: &[TagRef],
    opts: &PublishOptions,
) -> Result<Publication, PublishError> {
    let layers = layer_blobs(cache, &image.layers)?;
    let ext4_opts = Ext4Options {
        disk_mib: opts.disk_mib.or(image.sandbox.disk_mib),
        max_mib: opts.max_mib.unwrap_or(ext4::DEFAULT_MAX_MIB),
        source_date_epoch: image.source_date_epoch,
        limits: opts.limits.clone(),
    };
    let chunking = opts.chunking.unwrap_or(Chunking::DISK_DEFAULT);
    let mut key = flatten_key(image, &ext4_opts, chunking, &ext4::check_tools()?.version);
    if let Some(ws) = &opts.workspace {
        key = crate::build::key::workspace_key(ws, &key);
    }
    if let Some(lease) = &opts.lease
        && let Some((d, m)) = reusable(store, lease, &key).await?
    {
        if let (Some(progress), Manifest::Image(m)) = (&opts.progress, &m) {
            // Told as a publish that found every chunk present would tell it.
            for e in &m.disk.entries {
                progress(&match e.digest {
                    Some(digest) => kiln_store::progress::ProgressEvent::Chunk {
                        digest,
                        raw_len: e.raw_len,
                        stored_len: e.stored_len,
                        transferred: false,
                    },
                    None => kiln_store::progress::ProgressEvent::Hole { raw_len: e.raw_len },
                });
            }
        }
        move_tags(store, tags, d).await?;
        return Ok(Publication {
            manifest: d,
            reused: true,
        });
    }
    let scratch = match &opts.scratch_dir {
        Some(d) => d.join(format!(
            "kiln-ext4-{}-{}",
            std::process::id(),
            image.oci_manifest.digest.hex()
        )),
        None => cache.scratch_path(&format!("ext4-{}", image.oci_manifest.digest.hex())),
    };
    if let Some(dir) = scratch.parent() {
        std::fs::create_dir_all(dir).map_err(|source| PublishError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let result = publish_with(store, cache, image, opts, &layers, &ext4_opts, &scratch).await;
    // Removing the scratch image frees its page cache (the 175 MiB image of the peer's small
    // case: 77 ms of unlink, strace -T, 2026-12-06) off the critical path: beside the image
    // entry and the tags, awaited before returning either way.
    let removal = tokio::task::spawn_blocking(move || std::fs::remove_file(&scratch));
    let published = async {
        let manifest = result?;
        store.put_image_entry(&key, manifest).await?;
        move_tags(store, tags, manifest).await?;
        Ok(Publication {
            manifest,
            reused: false,
        })
    }
    .await;
    let _ = removal.await;
    published
}

/// Moves each of `tags` to `d` unless it names it already.
async fn move_tags(store: &Store, tags: &[TagRef], d: ManifestDigest) -> Result<(), PublishError> {
    for t in tags {
        if store.get_tag(t).await?.map(|r| r.manifest) == Some(d) {
            continue;
        }
        store.force_tag(t, d).await?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn publish_with(
    store: &Store,
    cache: &dyn BlobCache,
    image: &BuiltImage,
    opts: &PublishOptions,
    layers: &[LayerBlob],
    ext4_opts: &Ext4Options,
    scratch: &std::path::Path,
) -> Result<ManifestDigest, PublishError> {
    let joined = |e: tokio::task::JoinError| PublishError::Io {
        path: scratch.to_path_buf(),
        source: std::io::Error::other(e),
    };
    // Chunks of the image encoded while mke2fs writes it (crate::publish_ahead), taken by
    // the upload below instead of compressing them again; the chunk table is the same.
    let chunking = opts.chunking.unwrap_or(Chunking::DISK_DEFAULT);
    let ahead = scratch
        .parent()
        .and_then(|dir| crate::publish_ahead::Ahead::start(scratch, chunking, dir));
    let build = {
        let layers = layers.to_vec();
        let o = ext4_opts.clone();
        let dest = scratch.to_path_buf();
        let prescan = opts.prescan.clone();
        tokio::task::spawn_blocking(move || {
            let started = prescan.and_then(|p| p.take());
            ext4::build_unchecked(started, &layers, &dest, &o)
        })
    };
    // 1. blobs (leased before they are put: for another store than the cache's they are
    // written there), while the image is made: they do not depend on it, and mke2fs leaves
    // a core mostly idle.
    let blobs = async {
        if let Some(lease) = &opts.lease {
            let mut objs = Vec::new();
            for d in [&image.oci_manifest, &image.config]
                .into_iter()
                .chain(&image.layers)
            {
                objs.push(kiln_store::ObjectRef::Blob(d.digest));
            }
            lease.add(objs).await?;
        }
        let oci_manifest = put_blob(store, cache, &image.oci_manifest).await?;
        let oci_config = put_blob(store, cache, &image.config).await?;
        let mut blobs = Vec::with_capacity(image.layers.len());
        for l in &image.layers {
            blobs.push(put_blob(store, cache, l).await?);
        }
        Ok::<_, PublishError>((oci_manifest, oci_config, blobs))
    };
    let (built, blobs) = tokio::join!(build, blobs);
    let memo = ahead.map(crate::publish_ahead::Ahead::finish);
    let (built, check) = built.map_err(joined)??;
    // 2. chunks, while `e2fsck -fn` checks the image (both only read it). Nothing made of the
    // image (manifest, image entry, tag) is written before the check passed; the chunks a
    // failed check leaves are leased like those of any failed publish, and GC takes them.
    let check = tokio::task::spawn_blocking(move || check.wait());
    let chunked = store
        .put_artifact(
            scratch,
            &PutArtifactOptions {
                chunking: opts.chunking,
                lease: opts.lease.clone(),
                progress: opts.progress.clone(),
                memo: memo.clone(),
            },
        )
        .await;
    if let Some(m) = &memo {
        tracing::debug!(
            encoded_ahead = m.len(),
            taken = m.taken(),
            "chunks encoded while the image was made"
        );
    }
    check.await.map_err(joined)??;
    let (table, _stats) = chunked?;
    let (oci_manifest, oci_config, blobs) = blobs?;
    // 3. manifest
    let mut m = ImageManifest::new(table);
    m.oci_manifest = Some(oci_manifest);
    m.oci_config = Some(oci_config);
    m.blobs = blobs;
    m.recipe_digest = Some(image.recipe_digest.to_string());
    m.provenance = image.provenance.clone();
    m.filesystem = Some(built.filesystem);
    m.sandbox = sandbox_spec(&image.sandbox);
    let m = Manifest::Image(m);
    let raw = match &opts.lease {
        // Leased before it is written, so GC keeps it until a tag names it.
        Some(lease) => lease.put_manifest(&m).await?,
        None => store.put_manifest(&m).await?,
    };
    Ok(raw.digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{LocalCache, digest_of, parse_digest};

    /// A one-layer image whose blobs are in a fresh blob cache under `dir`.
    fn one_layer_image(dir: &std::path::Path) -> (LocalCache, BuiltImage) {
        let cache = LocalCache::open(&dir.join("cache")).unwrap();
        let put = |media_type: &str, bytes: &[u8]| {
            let digest = parse_digest(&digest_of(bytes).to_string(), "test").unwrap();
            cache.put_bytes(&digest, bytes).unwrap();
            image::Descriptor {
                media_type: media_type.into(),
                digest,
                size: bytes.len() as u64,
                platform: None,
                annotations: None,
            }
        };
        let mut b = tar::Builder::new(Vec::new());
        for (i, name) in ["etc/hostname", "bin/app", "srv/data"].iter().enumerate() {
            let data = name.repeat(100 * (i + 1));
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(1_600_000_000);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, name, data.as_bytes()).unwrap();
        }
        let layer = put(
            "application/vnd.oci.image.layer.v1.tar",
            &b.into_inner().unwrap(),
        );
        let config = put("application/vnd.oci.image.config.v1+json", b"{}");
        let oci_manifest = put("application/vnd.oci.image.manifest.v1+json", b"{\"m\":1}");
        let image = BuiltImage {
            oci_manifest,
            config,
            layers: vec![layer],
            sandbox: kiln_recipes::plan::Sandbox::default(),
            recipe_digest: digest_of(b"FROM scratch\n"),
            provenance: BTreeMap::new(),
            source_date_epoch: Some(1_700_000_000),
        };
        (cache, image)
    }

    /// The files under `dir` (recursively), as paths relative to it.
    fn files_under(dir: &std::path::Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                if e.file_type().unwrap().is_dir() {
                    todo.push(e.path());
                } else {
                    let p = e.path();
                    out.push(p.strip_prefix(dir).unwrap().display().to_string());
                }
            }
        }
        out
    }

    /// An image that fails `e2fsck -fn` (really corrupted after the indexing pass, checked by
    /// the real e2fsck while its chunks are stored) publishes no manifest, no image cache
    /// entry and no tag, and its scratch file is gone; the same image uncorrupted (the
    /// control) publishes all three.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_image_failing_its_check_publishes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let (cache, image) = one_layer_image(d.path());
        let tag: TagRef = "app:latest".parse().unwrap();
        let publish_into = |name: &'static str| {
            let root = d.path().join(name);
            let scratch = d.path().join(format!("{name}-scratch"));
            let cache = &cache;
            let image = &image;
            let tag = tag.clone();
            async move {
                let store = Store::open_dir(&root).await.unwrap();
                let lease = Arc::new(
                    store
                        .create_lease("build-test", std::time::Duration::from_secs(3600), [])
                        .await
                        .unwrap(),
                );
                let opts = PublishOptions {
                    scratch_dir: Some(scratch.clone()),
                    lease: Some(lease),
                    ..Default::default()
                };
                let r = publish(&store, cache, image, std::slice::from_ref(&tag), &opts).await;
                (store, root, scratch, r)
            }
        };
        ext4::CORRUPT_UNDER
            .lock()
            .unwrap()
            .push(d.path().join("bad-scratch"));
        let (store, root, scratch, r) = publish_into("bad").await;
        let err = r.expect_err("a corrupted image must not publish");
        assert!(
            matches!(err, PublishError::Ext4(Ext4Error::Fsck { .. })),
            "{err}"
        );
        assert_eq!(store.get_tag(&tag).await.unwrap().map(|t| t.manifest), None);
        for kind in ["manifests", "images", "tags"] {
            assert_eq!(
                files_under(&root.join(kind)),
                Vec::<String>::new(),
                "{kind}"
            );
        }
        assert_eq!(files_under(&scratch), Vec::<String>::new(), "scratch");
        // The check ran while the chunks were stored: they are in the store, leased.
        assert!(!files_under(&root.join(".packs")).is_empty());

        let (store, root, _, r) = publish_into("good").await;
        let p = r.expect("the same image uncorrupted publishes");
        assert_eq!(
            store.get_tag(&tag).await.unwrap().map(|t| t.manifest),
            Some(p.manifest)
        );
        assert_eq!(files_under(&root.join("manifests")).len(), 1);
        assert_eq!(files_under(&root.join("images")).len(), 1);
    }
}
