//! OCI image manifests, indexes and platforms: the parts the builder reads.
//!
//! Shapes from the OCI image spec (`manifest.md`, `image-index.md`, `descriptor.md`,
//! `config.md`); Docker's v2 schema 2 manifest and manifest list have the same fields under
//! other media types and are accepted too. Digests are always of the raw bytes as stored:
//! nothing here re-serializes a manifest.

use kiln_store::BlobDigest;
use serde::{Deserialize, Serialize};

/// OCI image manifest media type.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index media type.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Docker v2 schema 2 manifest media type.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list media type.
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// The media types asked for when fetching a manifest.
pub const MANIFEST_TYPES: [&str; 4] = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST];

/// Largest image config accepted, bytes (64 MiB; real configs are a few KiB, long histories
/// a few hundred). Configs are read whole into memory, so a descriptor claiming more is
/// refused before anything is fetched or copied.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// Errors reading manifests.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The bytes are not a manifest or index.
    #[error("manifest {digest}: not a valid OCI/Docker manifest: {source}")]
    Parse {
        /// Digest of the bytes.
        digest: String,
        /// JSON error.
        source: serde_json::Error,
    },
    /// An index has no entry for the platform asked for.
    #[error("index {digest} has no manifest for {platform} (it has: {available})")]
    NoPlatform {
        /// Index digest.
        digest: String,
        /// Platform asked for.
        platform: Platform,
        /// Platforms present, comma separated.
        available: String,
    },
    /// An index points at another index deeper than allowed.
    #[error("index {0}: nested indexes deeper than 4 levels")]
    TooDeep(String),
    /// A platform string does not parse.
    #[error("invalid platform {0:?} (expected os/arch[/variant], e.g. linux/amd64)")]
    BadPlatform(String),
    /// The config descriptor claims more than [`MAX_CONFIG_BYTES`].
    #[error("manifest {digest}: config is {size} bytes, over the {MAX_CONFIG_BYTES}-byte limit")]
    ConfigTooLarge {
        /// Manifest digest.
        digest: String,
        /// The size claimed, bytes.
        size: u64,
    },
    /// A descriptor digest is malformed.
    #[error("manifest {digest}: descriptor digest {bad:?} is not sha256:<64 hex>")]
    BadDescriptor {
        /// Manifest digest.
        digest: String,
        /// The bad digest.
        bad: String,
    },
}

/// A content descriptor (`descriptor.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Media type of the referenced content.
    pub media_type: String,
    /// `sha256:<hex>` of the referenced bytes (a manifest, config or layer: a blob of the
    /// store). Serialized as that string; refused at parse when malformed.
    pub digest: BlobDigest,
    /// Size of the referenced bytes, bytes.
    pub size: u64,
    /// Platform (index entries only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

/// An image manifest (`manifest.md`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Media type field, when present.
    #[serde(default)]
    pub media_type: Option<String>,
    /// The image config.
    pub config: Descriptor,
    /// Layers, bottom first.
    pub layers: Vec<Descriptor>,
}

/// An image index or Docker manifest list (`image-index.md`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    /// Media type field, when present.
    #[serde(default)]
    pub media_type: Option<String>,
    /// The manifests it lists.
    pub manifests: Vec<Descriptor>,
}

/// A manifest or an index, told apart by `mediaType` or by shape.
#[derive(Debug, Clone)]
pub enum AnyManifest {
    /// An image manifest.
    Image(Manifest),
    /// An index / manifest list.
    Index(Index),
}

impl AnyManifest {
    /// Parses raw manifest bytes. `digest` is used in errors.
    pub fn parse(bytes: &[u8], digest: &BlobDigest) -> Result<AnyManifest, ImageError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Probe {
            #[serde(default)]
            media_type: Option<String>,
            #[serde(default)]
            manifests: Option<serde_json::Value>,
        }
        let perr = |source| ImageError::Parse {
            digest: digest.to_string(),
            source,
        };
        let probe: Probe = serde_json::from_slice(bytes).map_err(perr)?;
        let is_index = match probe.media_type.as_deref() {
            Some(OCI_INDEX) | Some(DOCKER_LIST) => true,
            Some(_) => false,
            None => probe.manifests.is_some(),
        };
        // Every descriptor digest is checked here, where it enters, and named in the error;
        // the typed parse below then cannot fail on one.
        #[derive(Deserialize)]
        struct RawDescriptor {
            digest: String,
        }
        #[derive(Deserialize)]
        struct RawIndex {
            manifests: Vec<RawDescriptor>,
        }
        #[derive(Deserialize)]
        struct RawImage {
            config: RawDescriptor,
            layers: Vec<RawDescriptor>,
        }
        let listed = if is_index {
            serde_json::from_slice::<RawIndex>(bytes)
                .map_err(perr)?
                .manifests
        } else {
            let raw: RawImage = serde_json::from_slice(bytes).map_err(perr)?;
            std::iter::once(raw.config).chain(raw.layers).collect()
        };
        for d in listed {
            if d.digest.parse::<BlobDigest>().is_err() {
                return Err(ImageError::BadDescriptor {
                    digest: digest.to_string(),
                    bad: d.digest,
                });
            }
        }
        let m = if is_index {
            AnyManifest::Index(serde_json::from_slice(bytes).map_err(perr)?)
        } else {
            AnyManifest::Image(serde_json::from_slice(bytes).map_err(perr)?)
        };
        if let AnyManifest::Image(im) = &m
            && im.config.size > MAX_CONFIG_BYTES
        {
            return Err(ImageError::ConfigTooLarge {
                digest: digest.to_string(),
                size: im.config.size,
            });
        }
        Ok(m)
    }
}

/// A platform (`image-index.md`, "platform"): os, architecture, optional variant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    /// e.g. `linux`.
    pub os: String,
    /// e.g. `amd64`, `arm64`.
    pub architecture: String,
    /// e.g. `v8` for arm64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

impl Platform {
    /// linux/amd64, the platform kiln's sandboxes run.
    pub fn linux_amd64() -> Platform {
        Platform {
            os: "linux".into(),
            architecture: "amd64".into(),
            variant: None,
        }
    }

    /// Parses `os/arch[/variant]`.
    pub fn parse(s: &str) -> Result<Platform, ImageError> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok =
            |p: &&str| !p.is_empty() && p.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_');
        match parts.as_slice() {
            [os, arch] if ok(os) && ok(arch) => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: None,
            }),
            [os, arch, v] if ok(os) && ok(arch) && ok(v) => Ok(Platform {
                os: os.to_string(),
                architecture: arch.to_string(),
                variant: Some(v.to_string()),
            }),
            _ => Err(ImageError::BadPlatform(s.to_string())),
        }
    }

    /// Whether an index entry's platform satisfies this one: os and architecture equal, and
    /// the variant equal when this one names a variant.
    pub fn matches(&self, other: &Platform) -> bool {
        self.os == other.os
            && self.architecture == other.architecture
            && (self.variant.is_none() || self.variant == other.variant)
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

impl Index {
    /// The first manifest for `platform`.
    pub fn select(
        &self,
        platform: &Platform,
        digest: &BlobDigest,
    ) -> Result<&Descriptor, ImageError> {
        self.manifests
            .iter()
            .find(|d| d.platform.as_ref().is_some_and(|p| platform.matches(p)))
            .ok_or_else(|| ImageError::NoPlatform {
                digest: digest.to_string(),
                platform: platform.clone(),
                available: self
                    .manifests
                    .iter()
                    .filter_map(|d| d.platform.as_ref().map(|p| p.to_string()))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn parse_and_select() {
        let idx = format!(
            r#"{{"schemaVersion":2,"manifests":[
              {{"mediaType":"{OCI_MANIFEST}","digest":"{D1}","size":1,"platform":{{"os":"linux","architecture":"arm64","variant":"v8"}}}},
              {{"mediaType":"{OCI_MANIFEST}","digest":"{D2}","size":2,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#
        );
        let AnyManifest::Index(i) =
            AnyManifest::parse(idx.as_bytes(), &BlobDigest::of(b"x")).expect("parse")
        else {
            panic!("not an index")
        };
        assert_eq!(
            i.select(&Platform::linux_amd64(), &BlobDigest::of(b"x"))
                .expect("amd64")
                .digest
                .to_string(),
            D2
        );
        assert_eq!(
            i.select(
                &Platform::parse("linux/arm64").expect("p"),
                &BlobDigest::of(b"x")
            )
            .expect("arm")
            .digest
            .to_string(),
            D1
        );
        assert_eq!(
            i.select(
                &Platform::parse("linux/arm64/v8").expect("p"),
                &BlobDigest::of(b"x")
            )
            .expect("arm")
            .digest
            .to_string(),
            D1
        );
        let e = i
            .select(
                &Platform::parse("linux/s390x").expect("p"),
                &BlobDigest::of(b"x"),
            )
            .unwrap_err();
        assert!(e.to_string().contains("linux/arm64/v8, linux/amd64"), "{e}");
        assert!(Platform::parse("linux").is_err());
        assert!(Platform::parse("linux/../x").is_err());
        let m = format!(
            r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST}","config":{{"mediaType":"c","digest":"{D1}","size":3}},"layers":[{{"mediaType":"l","digest":"{D2}","size":4}}]}}"#
        );
        assert!(matches!(
            AnyManifest::parse(m.as_bytes(), &BlobDigest::of(b"y")),
            Ok(AnyManifest::Image(_))
        ));
        let bad = m.replace(D2, "sha256:../../x");
        assert!(matches!(
            AnyManifest::parse(bad.as_bytes(), &BlobDigest::of(b"y")),
            Err(ImageError::BadDescriptor { .. })
        ));
    }
}
