//! An image as OCI consumers that read no zstd layer need it: its `tar+zstd` layers gzipped.
//!
//! A build writes its layers as zstd ([`crate::layer::write`], issue 34): they are read
//! again by the same build's publish, where zstd costs a fraction of gzip. Not every OCI
//! consumer reads them: umoci 0.4.7 (Debian bookworm) refuses the media type ("blob is not
//! correct mediatype"), as do Docker before 23.0 and containerd before 1.5. So where an image
//! leaves kiln for such a consumer, an OCI layout (`kiln export --format oci`) and a registry
//! (`kiln push`), [`with_gzip_layers`] gives the manifest with each `tar+zstd` layer replaced
//! by the same tar gzipped ([`crate::layer::pgzip`] at level [`GZIP_LEVEL`], whose bytes
//! depend on the tar alone), so an export or a push of one image gives one digest on every
//! host. Only the layers' descriptors change: the config, and so its `rootfs.diff_ids` (the
//! digests of the uncompressed tars) and the image's identity by config, stay.
//!
//! This changes the manifest's digest: an exported or pushed image whose layers kiln wrote
//! has a digest of its own, not the digest of the OCI manifest the build reported (which
//! names the zstd layers that kiln's store and later builds use). `kiln export` and
//! `kiln push` print the digest they wrote.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;

use kiln_store::BlobDigest;

use crate::build::{OCI_LAYER_GZIP, OCI_LAYER_ZSTD};
use crate::cache::{BlobCache, CacheError};
use crate::layer::Limits;
use crate::layer::write::HashWriter;

/// How an image's layers leave kiln (`kiln export --format oci`, `kiln push`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerCompression {
    /// zstd layers gzipped ([`with_gzip_layers`]): what every OCI consumer reads. The default.
    #[default]
    Gzip,
    /// The layers as the image has them (a build's zstd ones too), under its own manifest
    /// digest: for consumers that read zstd (Docker 23+, containerd 1.5+, podman, skopeo).
    AsBuilt,
}

/// The gzip level of a transcoded layer (flate2's default, 6). Part of the output's format:
/// changing it changes the digest of every exported or pushed image with a zstd layer.
pub const GZIP_LEVEL: u32 = 6;

/// Errors of [`with_gzip_layers`].
#[derive(Debug, thiserror::Error)]
pub enum CompatError {
    /// The cache could not be read.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A layer the manifest names is not in the cache.
    #[error("layer {0} is not in the local store")]
    Missing(BlobDigest),
    /// Reading a layer or writing its gzip copy.
    #[error("gzipping layer {digest} (into {}): {source}", dir.display())]
    Io {
        /// The zstd layer.
        digest: BlobDigest,
        /// Where the copy was being written.
        dir: PathBuf,
        /// The failure.
        source: io::Error,
    },
    /// A layer's stream is not a tar within the [`Limits`] given (a decompression bomb, say).
    #[error(transparent)]
    Layer(#[from] crate::layer::LayerError),
    /// The manifest is not a JSON object with a `layers` array of descriptors.
    #[error("manifest {0}: not an image manifest with a layers array")]
    Manifest(BlobDigest),
}

/// One layer gzipped by [`with_gzip_layers`].
#[derive(Debug)]
pub struct GzipLayer {
    /// The `tar+zstd` layer it replaces.
    pub from: BlobDigest,
    /// The gzip blob's digest.
    pub digest: BlobDigest,
    /// The gzip blob's size, bytes.
    pub size: u64,
    /// The gzip blob: an unlinked temporary file, at its start.
    pub file: File,
}

/// An image manifest whose zstd layers were gzipped.
#[derive(Debug)]
pub struct GzipImage {
    /// The new manifest's bytes (compact JSON).
    pub manifest: Vec<u8>,
    /// Their digest.
    pub digest: BlobDigest,
    /// The gzipped layers, in manifest order (a layer listed twice is gzipped once).
    pub layers: Vec<GzipLayer>,
}

/// An image manifest as it leaves kiln ([`outgoing`]).
#[derive(Debug)]
pub struct Outgoing {
    /// The manifest's bytes.
    pub bytes: Vec<u8>,
    /// Their digest.
    pub digest: BlobDigest,
    /// Parsed.
    pub manifest: crate::image::Manifest,
    /// The gzipped layers to write instead of their zstd ones (none with
    /// [`LayerCompression::AsBuilt`] or without zstd layers).
    pub gzipped: Vec<GzipLayer>,
}

/// The image manifest `manifest` (raw bytes of the OCI image manifest `digest`, parsed as
/// `parsed`, its layers in `cache`) as an export or a push writes it under `layers`: with
/// [`LayerCompression::Gzip`], [`with_gzip_layers`] (the gzip blobs in `tmp`, each layer
/// bounded by [`Limits::default`]); else as it is. The one place both decide it.
pub fn outgoing(
    cache: &dyn BlobCache,
    manifest: Vec<u8>,
    digest: &BlobDigest,
    parsed: crate::image::Manifest,
    layers: LayerCompression,
    tmp: &Path,
) -> Result<Outgoing, CompatError> {
    let gzip = match layers {
        LayerCompression::Gzip => {
            with_gzip_layers(cache, &manifest, digest, tmp, &Limits::default())?
        }
        LayerCompression::AsBuilt => None,
    };
    Ok(match gzip {
        None => Outgoing {
            bytes: manifest,
            digest: *digest,
            manifest: parsed,
            gzipped: Vec::new(),
        },
        Some(g) => {
            let manifest = match crate::image::AnyManifest::parse(&g.manifest, &g.digest) {
                Ok(crate::image::AnyManifest::Image(m)) => m,
                _ => return Err(CompatError::Manifest(*digest)),
            };
            Outgoing {
                bytes: g.manifest,
                digest: g.digest,
                manifest,
                gzipped: g.layers,
            }
        }
    })
}

/// `manifest` (the raw bytes of the OCI image manifest `digest`, its layers in `cache`) with
/// every layer of media type `tar+zstd` gzipped, the gzip blobs in unlinked temporary files
/// in `tmp`, each layer's tar stream bounded by `limits` as a layer apply's is (a bomb fails
/// with [`CompatError::Layer`]). `None` when no layer is zstd: the manifest is used as it
/// is. Costs a zstd decompression and a gzip compression of each such layer (on every core).
pub fn with_gzip_layers(
    cache: &dyn BlobCache,
    manifest: &[u8],
    digest: &BlobDigest,
    tmp: &Path,
    limits: &Limits,
) -> Result<Option<GzipImage>, CompatError> {
    let bad = || CompatError::Manifest(*digest);
    let mut v: Value = serde_json::from_slice(manifest).map_err(|_| bad())?;
    let layers = v
        .get_mut("layers")
        .and_then(Value::as_array_mut)
        .ok_or_else(bad)?;
    let mut done: Vec<GzipLayer> = Vec::new();
    for l in layers.iter_mut() {
        if l.get("mediaType").and_then(Value::as_str) != Some(OCI_LAYER_ZSTD) {
            continue;
        }
        let from: BlobDigest = l
            .get("digest")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)?;
        let (to, size) = match done.iter().find(|g| g.from == from) {
            Some(g) => (g.digest, g.size),
            None => {
                let g = gzip_layer(cache, &from, tmp, limits)?;
                let r = (g.digest, g.size);
                done.push(g);
                r
            }
        };
        let o = l.as_object_mut().ok_or_else(bad)?;
        o.insert("mediaType".into(), OCI_LAYER_GZIP.into());
        o.insert("digest".into(), to.to_string().into());
        o.insert("size".into(), size.into());
    }
    if done.is_empty() {
        return Ok(None);
    }
    // A JSON value always serializes.
    let manifest = serde_json::to_vec(&v).expect("JSON values serialize");
    Ok(Some(GzipImage {
        digest: BlobDigest::of(&manifest),
        manifest,
        layers: done,
    }))
}

/// Gzips the zstd layer `from` into an unlinked temporary file in `tmp`, its stream bounded
/// by `limits`.
fn gzip_layer(
    cache: &dyn BlobCache,
    from: &BlobDigest,
    tmp: &Path,
    limits: &Limits,
) -> Result<GzipLayer, CompatError> {
    let path = cache.blob_path(from)?.ok_or(CompatError::Missing(*from))?;
    let io = |source| CompatError::Io {
        digest: *from,
        dir: tmp.to_path_buf(),
        source,
    };
    let file = tempfile::tempfile_in(tmp).map_err(io)?;
    let out = HashWriter::new(io::BufWriter::new(file));
    let mut gz = crate::layer::pgzip::ParGzWriter::new(out, flate2::Compression::new(GZIP_LEVEL))
        .map_err(io)?;
    let (mut tar, bounded) =
        crate::layer::bounded_stream(File::open(&path).map_err(io)?, &from.to_string(), limits)?;
    if let Err(e) = io::copy(&mut tar, &mut gz) {
        return Err(match e.kind() {
            io::ErrorKind::Other => bounded.error(e, "(the layer's tar stream)").into(),
            _ => io(e),
        });
    }
    let mut out = gz.finish().map_err(io)?;
    out.flush().map_err(io)?;
    let (w, digest, size) = out.finish();
    let mut file = w.into_inner().map_err(|e| io(e.into_error()))?;
    io::Seek::rewind(&mut file).map_err(io)?;
    Ok(GzipLayer {
        from: *from,
        digest: BlobDigest(digest),
        size,
        file,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use serde_json::json;

    use super::*;
    use crate::cache::LocalCache;
    use crate::layer::write::write_layer;

    /// A layer of a small tree as kiln writes it (zstd), put in `cache`.
    fn zstd_layer(cache: &LocalCache, files: &[(&str, &str)]) -> crate::layer::write::Written {
        let t = tempfile::tempdir().unwrap();
        for (name, body) in files {
            std::fs::write(t.path().join(name), body).unwrap();
        }
        let mut blob = Vec::new();
        let w = write_layer(t.path(), &mut blob, Some(1_700_000_000)).unwrap();
        cache.put_bytes(&w.digest, &blob).unwrap();
        w
    }

    fn manifest(layers: &[(&str, &BlobDigest, u64)]) -> Vec<u8> {
        let layers: Vec<_> = layers
            .iter()
            .map(|(t, d, n)| json!({"mediaType": t, "digest": d.to_string(), "size": n}))
            .collect();
        let config = BlobDigest::of(b"{}");
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": crate::image::OCI_MANIFEST,
            "config": {"mediaType": crate::build::OCI_CONFIG, "digest": config.to_string(), "size": 2},
            "layers": layers,
            "annotations": {"org.example": "kept"},
        }))
        .unwrap()
    }

    /// Only the zstd layers are replaced, by gzip blobs of the same tar, the same bytes on
    /// every call; the rest of the manifest stays.
    #[test]
    fn zstd_layers_become_gzip_of_the_same_tar_and_nothing_else_changes() {
        let d = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&d.path().join("cache")).unwrap();
        let a = zstd_layer(&cache, &[("a", "one")]);
        let b = zstd_layer(&cache, &[("b", "two")]);
        let other = BlobDigest::of(b"a gzip layer pulled from a registry");
        let m = manifest(&[
            (OCI_LAYER_ZSTD, &a.digest, a.size),
            (OCI_LAYER_GZIP, &other, 9),
            (OCI_LAYER_ZSTD, &b.digest, b.size),
            (OCI_LAYER_ZSTD, &a.digest, a.size),
        ]);
        let md = BlobDigest::of(&m);
        let g = with_gzip_layers(&cache, &m, &md, d.path(), &Limits::default())
            .unwrap()
            .unwrap();
        assert_eq!(g.digest, BlobDigest::of(&g.manifest));
        assert_eq!(g.layers.len(), 2, "a layer listed twice is gzipped once");
        let v: Value = serde_json::from_slice(&g.manifest).unwrap();
        let layers = v["layers"].as_array().unwrap();
        assert_eq!(layers[1]["digest"], other.to_string());
        assert_eq!(layers[1]["mediaType"], OCI_LAYER_GZIP);
        assert_eq!(layers[0]["digest"], layers[3]["digest"]);
        assert_eq!(v["annotations"]["org.example"], "kept");
        for (i, w) in [(0, &a), (2, &b)] {
            assert_eq!(layers[i]["mediaType"], OCI_LAYER_GZIP);
            let gl = g
                .layers
                .iter()
                .find(|l| layers[i]["digest"] == l.digest.to_string())
                .unwrap();
            assert_eq!(gl.from, w.digest);
            assert_eq!(layers[i]["size"], gl.size);
            let mut gz = Vec::new();
            (&gl.file).read_to_end(&mut gz).unwrap();
            assert_eq!(gz.len() as u64, gl.size);
            assert_eq!(BlobDigest::of(&gz), gl.digest);
            assert_eq!(&gz[..2], &[0x1f, 0x8b], "gzip");
            let mut tar = Vec::new();
            flate2::read::GzDecoder::new(&gz[..])
                .read_to_end(&mut tar)
                .unwrap();
            assert_eq!(crate::cache::digest_of(&tar), w.diff_id, "the same tar");
        }
        let again = with_gzip_layers(&cache, &m, &md, d.path(), &Limits::default())
            .unwrap()
            .unwrap();
        assert_eq!(again.digest, g.digest, "one digest for one image");
    }

    #[test]
    fn a_manifest_without_zstd_layers_is_used_as_it_is() {
        let d = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&d.path().join("cache")).unwrap();
        let l = BlobDigest::of(b"x");
        let m = manifest(&[(OCI_LAYER_GZIP, &l, 1)]);
        let md = BlobDigest::of(&m);
        assert!(
            with_gzip_layers(&cache, &m, &md, d.path(), &Limits::default())
                .unwrap()
                .is_none()
        );
        // A zstd layer missing from the cache is named.
        let m = manifest(&[(OCI_LAYER_ZSTD, &l, 1)]);
        match with_gzip_layers(
            &cache,
            &m,
            &BlobDigest::of(&m),
            d.path(),
            &Limits::default(),
        ) {
            Err(CompatError::Missing(x)) => assert_eq!(x, l),
            other => panic!("{other:?}"),
        }
    }

    /// A zstd layer whose stream passes the bounds (a bomb: 64 MiB of zeros in a few KiB)
    /// stops at them with a layer error naming it, and writes nothing past them.
    #[test]
    fn a_zstd_bomb_stops_at_the_bounds() {
        let d = tempfile::tempdir().unwrap();
        let cache = LocalCache::open(&d.path().join("cache")).unwrap();
        let mut tar = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(64 << 20);
        h.set_mode(0o644);
        h.set_cksum();
        tar.append_data(&mut h, "zeros", std::io::repeat(0).take(64 << 20))
            .unwrap();
        let tar = tar.into_inner().unwrap();
        let bomb = zstd::encode_all(&tar[..], 19).unwrap();
        assert!(bomb.len() < 64 << 10, "{} bytes", bomb.len());
        let l = BlobDigest::of(&bomb);
        cache.put_bytes(&l, &bomb).unwrap();
        let m = manifest(&[(OCI_LAYER_ZSTD, &l, bomb.len() as u64)]);
        let limits = Limits {
            max_total_bytes: 1 << 20,
            ..Limits::default()
        };
        match with_gzip_layers(&cache, &m, &BlobDigest::of(&m), d.path(), &limits) {
            Err(CompatError::Layer(e)) => {
                assert!(e.to_string().contains(&l.to_string()), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert!(
            with_gzip_layers(
                &cache,
                &m,
                &BlobDigest::of(&m),
                d.path(),
                &Limits::default()
            )
            .is_ok()
        );
    }
}
