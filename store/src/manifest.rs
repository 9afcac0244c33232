//! Manifests: JSON documents naming everything an artifact is made of.
//!
//! A manifest is stored at `manifests/sha256/<hex>`, named by the sha256 of its raw bytes
//! ([`ManifestDigest`]). The raw bytes are kept ([`RawManifest`]) and never re-serialized, so a
//! digest always matches what was read. Every manifest is a JSON object with `schemaVersion`
//! (currently 1) and `mediaType`, which selects the type:
//!
//! - [`IMAGE_MEDIA_TYPE`] → [`ImageManifest`]: an ext4 image as a chunk table, its size, the
//!   OCI manifest and config it was built from (as blobs), recipe digest, provenance, and the
//!   snapshot taken from it once booted. No build time: identical inputs give identical bytes.
//! - [`SNAPSHOT_MEDIA_TYPE`] → [`SnapshotManifest`]: memory chunk table, vmstate blob, disk
//!   chunk table, compatibility key, the image manifest it came from, the kernel and
//!   initramfs it booted (as blobs), its vCPU count and memory size.
//!
//! Unknown fields are rejected (`deny_unknown_fields`): GC must never under-count references
//! because an older reader skipped a field it did not know. Manifests larger than
//! [`MAX_MANIFEST_LEN`] are refused before parsing. [`references`] lists what a manifest
//! refers to, for GC, verify and copy alike.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::chunk::{ChunkEntry, ChunkError, ChunkTable};
use crate::digest::{BlobDigest, ChunkDigest, ManifestDigest};

/// Media type of [`ImageManifest`].
pub const IMAGE_MEDIA_TYPE: &str = "application/vnd.kiln.image.manifest.v1+json";
/// Media type of [`SnapshotManifest`].
pub const SNAPSHOT_MEDIA_TYPE: &str = "application/vnd.kiln.snapshot.manifest.v1+json";
/// The only `schemaVersion` written and accepted.
pub const SCHEMA_VERSION: u32 = 1;
/// Largest manifest accepted, in bytes (64 MiB: a 1 TiB disk in 64 KiB chunks is ~16 M
/// entries; real tables are far smaller, and this bounds what a hostile store can make us parse).
pub const MAX_MANIFEST_LEN: usize = 64 << 20;

/// Errors about manifests.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not JSON, missing fields, unknown fields, wrong types.
    #[error("manifest {digest} does not parse: {reason}")]
    Parse {
        /// The manifest.
        digest: ManifestDigest,
        /// The parser's message.
        reason: String,
    },
    /// A `mediaType` this version does not know.
    #[error("manifest {digest} has unknown mediaType {media_type:?}")]
    UnknownMediaType {
        /// The manifest.
        digest: ManifestDigest,
        /// What it says.
        media_type: String,
    },
    /// A `schemaVersion` other than [`SCHEMA_VERSION`].
    #[error("manifest {digest} has schemaVersion {version}, expected 1")]
    SchemaVersion {
        /// The manifest.
        digest: ManifestDigest,
        /// What it says.
        version: u64,
    },
    /// Larger than [`MAX_MANIFEST_LEN`].
    #[error("manifest {digest} is {len} bytes, over the {MAX_MANIFEST_LEN}-byte limit")]
    TooLarge {
        /// The manifest.
        digest: ManifestDigest,
        /// Its length in bytes.
        len: usize,
    },
    /// The bytes read do not hash to the manifest's name.
    #[error("manifest {digest} in {store}: bytes hash to {actual}")]
    DigestMismatch {
        /// The manifest asked for.
        digest: ManifestDigest,
        /// The store read.
        store: String,
        /// What the bytes hash to.
        actual: ManifestDigest,
    },
    /// A chunk table inside the manifest is invalid.
    #[error("manifest {digest}: {field}: {source}")]
    Table {
        /// The manifest.
        digest: ManifestDigest,
        /// Which table (`disk`, `memory`).
        field: &'static str,
        /// What is wrong.
        source: ChunkError,
    },
    /// Serializing a new manifest failed (should not happen for these types).
    #[error("serializing manifest: {0}")]
    Serialize(String),
}

/// A blob reference: digest of stored bytes, size, and optionally its media type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BlobRef {
    /// sha256 of the stored bytes.
    pub digest: BlobDigest,
    /// Stored size in bytes.
    pub size: u64,
    /// Media type (e.g. `application/vnd.oci.image.config.v1+json`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
}

/// An image: an ext4 filesystem image as a chunk table plus where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageManifest {
    /// Always [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Always [`IMAGE_MEDIA_TYPE`].
    pub media_type: String,
    /// The ext4 image (its `size` is the image size in bytes).
    pub disk: ChunkTable,
    /// The OCI image manifest it was built from, as a blob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_manifest: Option<BlobRef>,
    /// The OCI image config, as a blob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_config: Option<BlobRef>,
    /// Other blobs the image needs kept (e.g. OCI layers), in no particular order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blobs: Vec<BlobRef>,
    /// Digest (`sha256:<hex>`) of the recipe (Dockerfile or YAML plan) it was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe_digest: Option<String>,
    /// Free-form provenance (builder version, base image reference...). No times.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub provenance: BTreeMap<String, String>,
    /// The snapshot manifest taken from this image once booted, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<ManifestDigest>,
    /// How the ext4 image was made (block size, features, UUID), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<Filesystem>,
    /// How the image is started as a sandbox (start command, ready check), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxSpec>,
}

/// The ext4 file system of an image, as `mke2fs` was asked to make it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Filesystem {
    /// File system type; always `ext4` for now.
    pub kind: String,
    /// Block size, bytes (always 4096).
    pub block_size: u32,
    /// The `mke2fs -O` feature list, in the order given (e.g. `has_journal`, `extent`).
    pub features: Vec<String>,
    /// File system UUID (derived from the image digest, so identical inputs agree).
    pub uuid: String,
    /// Free-form facts about the tool that made it (e.g. `mke2fs` = `1.47.2`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tool: BTreeMap<String, String>,
}

/// How an image runs as a sandbox: what the guest init starts and how it knows it is ready.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxSpec {
    /// The start command, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
    /// The ready check, if any (none: ready as soon as the start command is started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<ReadySpec>,
}

/// The start command of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartSpec {
    /// argv, run directly (a shell form is already wrapped in its shell).
    pub argv: Vec<String>,
    /// User (`name`, `uid`, `name:group`, `uid:gid`), resolved in the image; `None`: root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Environment, `KEY=value`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Working directory (absolute); `None`: `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
}

/// The ready check of a sandbox: run every `interval_ms` until it exits 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReadySpec {
    /// argv of the check; exit status 0 means ready.
    pub argv: Vec<String>,
    /// Interval between checks, ms.
    pub interval_ms: u64,
    /// Timeout of one check, ms.
    pub timeout_ms: u64,
    /// Failures tolerated before the boot is declared failed.
    pub retries: u32,
}

impl ImageManifest {
    /// A manifest with the required fields and nothing else.
    pub fn new(disk: ChunkTable) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            media_type: IMAGE_MEDIA_TYPE.to_string(),
            disk,
            oci_manifest: None,
            oci_config: None,
            blobs: Vec::new(),
            recipe_digest: None,
            provenance: BTreeMap::new(),
            snapshot: None,
            filesystem: None,
            sandbox: None,
        }
    }
}

/// A snapshot of a booted VM: memory, device state, disk, and what it needs to wake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotManifest {
    /// Always [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Always [`SNAPSHOT_MEDIA_TYPE`].
    pub media_type: String,
    /// The guest memory file.
    pub memory: ChunkTable,
    /// The VMM's device/CPU state.
    pub vmstate: BlobRef,
    /// The disk at snapshot time.
    pub disk: ChunkTable,
    /// What a host must offer to restore it (CPU features, VMM version...), opaque here
    /// (kiln-vmm's `CompatKey` renders and parses it).
    pub compatibility_key: String,
    /// The image manifest the VM booted from.
    pub image: ManifestDigest,
    /// The guest kernel it booted (uncompressed vmlinux), as a blob.
    pub kernel: BlobRef,
    /// The initramfs it booted (cpio newc), as a blob.
    pub initramfs: BlobRef,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Guest RAM in bytes (the memory file's size).
    pub memory_bytes: u64,
    /// The chunks a clone read from its restore to its first answer, recorded at snapshot
    /// time by one lazily served restore (`kiln snapshot`), which a clone start fetches first
    /// and in the background. Absent in snapshots made before it existed or without a
    /// recording (then nothing is prefetched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<PrefetchList>,
}

/// A snapshot's prefetch list ([`SnapshotManifest::prefetch`]): indices into its chunk
/// tables (`memory.entries`, `disk.entries`), each naming a chunk that is not a hole, in the
/// order the recording clone first read them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchList {
    /// Indices into the memory table.
    pub memory: Vec<u32>,
    /// Indices into the disk table.
    pub disk: Vec<u32>,
}

impl PrefetchList {
    /// The listed chunks of `snap`, memory first, each as whether it is a disk chunk and its
    /// table entry. Errors name the first index that is out of its table or a hole (a
    /// hostile manifest).
    pub fn entries<'a>(
        &self,
        snap: &'a SnapshotManifest,
    ) -> Result<Vec<(bool, &'a ChunkEntry)>, String> {
        let mut out = Vec::with_capacity(self.memory.len() + self.disk.len());
        for (name, table, list) in [
            ("memory", &snap.memory, &self.memory),
            ("disk", &snap.disk, &self.disk),
        ] {
            for &i in list {
                match table.entries.get(i as usize) {
                    Some(e) if e.digest.is_some() => out.push((name == "disk", e)),
                    Some(_) => return Err(format!("prefetch list: {name} chunk {i} is a hole")),
                    None => {
                        return Err(format!(
                            "prefetch list: {name} chunk {i} is past the table's {} entries",
                            table.entries.len()
                        ));
                    }
                }
            }
        }
        Ok(out)
    }

    /// [`PrefetchList::entries`] in the order a clone's chunk server fetches them: the
    /// disk's chunks first, then memory's, each in list order (a stable partition). The one
    /// definition of that order, for the chunk server (`kiln_vmm::lazy`) and for the pack
    /// the listed chunks are written into in that order ([`crate::Store::pack_together`]).
    /// Why the disk first: a cold Debian start's first read waited 155 ms for the last
    /// batch with the disk's chunks last; five cold starts each from the local S3 server,
    /// Debian 423 -> 298 ms with them first (issue 35). Errors: as
    /// [`PrefetchList::entries`].
    pub fn fetch_order<'a>(
        &self,
        snap: &'a SnapshotManifest,
    ) -> Result<Vec<(bool, &'a ChunkEntry)>, String> {
        let mut entries = self.entries(snap)?;
        entries.sort_by_key(|(disk, _)| !disk);
        Ok(entries)
    }

    /// [`PrefetchList::entries`] as (digest, raw length).
    pub fn chunks(&self, snap: &SnapshotManifest) -> Result<Vec<(ChunkDigest, u64)>, String> {
        Ok(self
            .entries(snap)?
            .into_iter()
            .filter_map(|(_, e)| Some((e.digest?, e.raw_len)))
            .collect())
    }
}

/// A parsed manifest of any known type.
// Manifests are few and short-lived; boxing the image variant would change every caller's
// `Manifest::Image(m)` for no measurable gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Manifest {
    /// [`IMAGE_MEDIA_TYPE`].
    Image(ImageManifest),
    /// [`SNAPSHOT_MEDIA_TYPE`].
    Snapshot(SnapshotManifest),
}

/// A manifest's exact bytes and their digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawManifest {
    /// sha256 of `bytes`.
    pub digest: ManifestDigest,
    /// The JSON bytes as stored.
    pub bytes: Bytes,
}

impl RawManifest {
    /// Wraps bytes, computing their digest.
    pub fn new(bytes: Bytes) -> Self {
        Self {
            digest: ManifestDigest::of(&bytes),
            bytes,
        }
    }

    /// Serializes a manifest once (compact JSON, field order as declared).
    pub fn encode(m: &Manifest) -> Result<Self, ManifestError> {
        let v = match m {
            Manifest::Image(i) => serde_json::to_vec(i),
            Manifest::Snapshot(s) => serde_json::to_vec(s),
        }
        .map_err(|e| ManifestError::Serialize(e.to_string()))?;
        Ok(Self::new(Bytes::from(v)))
    }

    /// Parses and validates (schema version, media type, chunk tables).
    pub fn parse(&self) -> Result<Manifest, ManifestError> {
        let digest = self.digest;
        if self.bytes.len() > MAX_MANIFEST_LEN {
            return Err(ManifestError::TooLarge {
                digest,
                len: self.bytes.len(),
            });
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Head {
            schema_version: u64,
            media_type: String,
        }
        let perr = |e: serde_json::Error| ManifestError::Parse {
            digest,
            reason: e.to_string(),
        };
        let head: Head = serde_json::from_slice(&self.bytes).map_err(perr)?;
        if head.schema_version != u64::from(SCHEMA_VERSION) {
            return Err(ManifestError::SchemaVersion {
                digest,
                version: head.schema_version,
            });
        }
        let table = |field, t: &ChunkTable| {
            t.validate().map_err(|source| ManifestError::Table {
                digest,
                field,
                source,
            })
        };
        match head.media_type.as_str() {
            IMAGE_MEDIA_TYPE => {
                let m: ImageManifest = serde_json::from_slice(&self.bytes).map_err(perr)?;
                table("disk", &m.disk)?;
                Ok(Manifest::Image(m))
            }
            SNAPSHOT_MEDIA_TYPE => {
                let m: SnapshotManifest = serde_json::from_slice(&self.bytes).map_err(perr)?;
                table("memory", &m.memory)?;
                table("disk", &m.disk)?;
                Ok(Manifest::Snapshot(m))
            }
            _ => Err(ManifestError::UnknownMediaType {
                digest,
                media_type: head.media_type,
            }),
        }
    }
}

/// Any object in the store that can be referenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ObjectRef {
    /// `manifests/sha256/<hex>`.
    Manifest(ManifestDigest),
    /// `blobs/sha256/<hex>`.
    Blob(BlobDigest),
    /// `chunks/sha256/<hex>`.
    Chunk(ChunkDigest),
}

impl ObjectRef {
    /// The object's store key.
    pub fn key(&self) -> String {
        match self {
            ObjectRef::Manifest(d) => d.key(),
            ObjectRef::Blob(d) => d.key(),
            ObjectRef::Chunk(d) => d.key(),
        }
    }

    /// Parses a content-addressed key back into a reference.
    pub fn from_key(key: &str) -> Option<Self> {
        ManifestDigest::from_key(key)
            .map(ObjectRef::Manifest)
            .or_else(|| BlobDigest::from_key(key).map(ObjectRef::Blob))
            .or_else(|| ChunkDigest::from_key(key).map(ObjectRef::Chunk))
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key())
    }
}

/// Everything a manifest refers to directly: other manifests first, then blobs, then chunks
/// (distinct: a snapshot's prefetch list in its order, then the rest in table order). Holes
/// refer to nothing.
pub fn references(m: &Manifest) -> Vec<ObjectRef> {
    let mut out = Vec::new();
    let mut tables: Vec<&ChunkTable> = Vec::new();
    match m {
        Manifest::Image(i) => {
            out.extend(i.snapshot.map(ObjectRef::Manifest));
            for b in i.oci_manifest.iter().chain(&i.oci_config).chain(&i.blobs) {
                out.push(ObjectRef::Blob(b.digest));
            }
            tables.push(&i.disk);
        }
        Manifest::Snapshot(s) => {
            out.push(ObjectRef::Manifest(s.image));
            out.push(ObjectRef::Blob(s.vmstate.digest));
            out.push(ObjectRef::Blob(s.kernel.digest));
            out.push(ObjectRef::Blob(s.initramfs.digest));
            tables.push(&s.memory);
            tables.push(&s.disk);
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|r| seen.insert(*r));
    // A snapshot's prefetch list first, in its order: a copy writes chunks in this order, so
    // on S3 the chunks a clone prefetches lie together in a pack and a few ranged GETs fetch
    // them all (issue 35). A list that names a bad index changes only the order, not the set.
    if let Manifest::Snapshot(s) = m
        && let Some(Ok(listed)) = s.prefetch.as_ref().map(|p| p.chunks(s))
    {
        for (d, _) in listed {
            if seen.insert(ObjectRef::Chunk(d)) {
                out.push(ObjectRef::Chunk(d));
            }
        }
    }
    for t in tables {
        for d in t.chunk_digests() {
            if seen.insert(ObjectRef::Chunk(d)) {
                out.push(ObjectRef::Chunk(d));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{ChunkEntry, Chunking};

    fn table() -> ChunkTable {
        ChunkTable {
            size: 8,
            chunking: Chunking::DISK_DEFAULT,
            entries: vec![
                ChunkEntry {
                    offset: 0,
                    raw_len: 4,
                    digest: Some(ChunkDigest::of(b"a")),
                    stored_len: 3,
                },
                ChunkEntry {
                    offset: 4,
                    raw_len: 4,
                    digest: None,
                    stored_len: 0,
                },
            ],
        }
    }

    #[test]
    fn round_trip_keeps_bytes_and_refs() {
        let mut m = ImageManifest::new(table());
        m.oci_config = Some(BlobRef {
            digest: BlobDigest::of(b"cfg"),
            size: 3,
            media_type: None,
        });
        let raw = RawManifest::encode(&Manifest::Image(m.clone())).unwrap();
        assert_eq!(raw.parse().unwrap(), Manifest::Image(m.clone()));
        let refs = references(&Manifest::Image(m));
        assert_eq!(
            refs,
            vec![
                ObjectRef::Blob(BlobDigest::of(b"cfg")),
                ObjectRef::Chunk(ChunkDigest::of(b"a"))
            ]
        );
        // Same bytes with different whitespace are a different manifest, kept as is.
        let spaced = RawManifest::new(Bytes::from(
            String::from_utf8(raw.bytes.to_vec())
                .unwrap()
                .replace(',', ", "),
        ));
        assert_ne!(spaced.digest, raw.digest);
        assert!(spaced.parse().is_ok());
    }

    #[test]
    fn snapshot_references_name_kernel_initramfs_vmstate_and_image() {
        let blob = |b: &[u8]| BlobRef {
            digest: BlobDigest::of(b),
            size: b.len() as u64,
            media_type: None,
        };
        let image = ManifestDigest::of(b"image");
        let s = SnapshotManifest {
            schema_version: SCHEMA_VERSION,
            media_type: SNAPSHOT_MEDIA_TYPE.to_string(),
            memory: table(),
            vmstate: blob(b"vmstate"),
            disk: table(),
            compatibility_key: "qemu=10.0.2".into(),
            image,
            kernel: blob(b"vmlinux"),
            initramfs: blob(b"initrd"),
            vcpus: 1,
            memory_bytes: 8,
            prefetch: None,
        };
        let raw = RawManifest::encode(&Manifest::Snapshot(s.clone())).unwrap();
        assert_eq!(raw.parse().unwrap(), Manifest::Snapshot(s.clone()));
        // No list, no field: a snapshot without one encodes as before the field existed.
        assert!(!String::from_utf8_lossy(&raw.bytes).contains("prefetch"));
        let listed = SnapshotManifest {
            prefetch: Some(PrefetchList {
                memory: vec![0],
                disk: vec![0],
            }),
            ..s.clone()
        };
        let raw = RawManifest::encode(&Manifest::Snapshot(listed.clone())).unwrap();
        assert_eq!(raw.parse().unwrap(), Manifest::Snapshot(listed.clone()));
        let chunks = listed.prefetch.as_ref().unwrap().chunks(&listed).unwrap();
        assert_eq!(
            chunks,
            vec![
                (listed.memory.entries[0].digest.unwrap(), 4),
                (listed.disk.entries[0].digest.unwrap(), 4)
            ]
        );
        // A hostile list: an index past the table, or of a hole, is refused, named.
        for (i, want) in [
            (7, "memory chunk 7 is past"),
            (1, "memory chunk 1 is a hole"),
        ] {
            let bad = PrefetchList {
                memory: vec![i],
                disk: vec![],
            };
            let e = bad.chunks(&listed).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        assert_eq!(
            references(&Manifest::Snapshot(s)),
            vec![
                ObjectRef::Manifest(image),
                ObjectRef::Blob(BlobDigest::of(b"vmstate")),
                ObjectRef::Blob(BlobDigest::of(b"vmlinux")),
                ObjectRef::Blob(BlobDigest::of(b"initrd")),
                ObjectRef::Chunk(ChunkDigest::of(b"a")),
            ]
        );
    }

    /// A snapshot manifest whose memory and disk tables hold a 4-byte chunk a name, named
    /// after its content (`ChunkDigest::of(name)`), with prefetch list `prefetch`.
    fn snapshot_of(memory: &[&[u8]], disk: &[&[u8]], prefetch: PrefetchList) -> SnapshotManifest {
        let table = |names: &[&[u8]]| ChunkTable {
            size: 4 * names.len() as u64,
            chunking: Chunking::DISK_DEFAULT,
            entries: names
                .iter()
                .enumerate()
                .map(|(i, n)| ChunkEntry {
                    offset: i as u64 * 4,
                    raw_len: 4,
                    digest: Some(ChunkDigest::of(n)),
                    stored_len: 3,
                })
                .collect(),
        };
        let blob = |b: &[u8]| BlobRef {
            digest: BlobDigest::of(b),
            size: b.len() as u64,
            media_type: None,
        };
        SnapshotManifest {
            schema_version: SCHEMA_VERSION,
            media_type: SNAPSHOT_MEDIA_TYPE.to_string(),
            memory: table(memory),
            vmstate: blob(b"vmstate"),
            disk: table(disk),
            compatibility_key: "qemu=10.0.2".into(),
            image: ManifestDigest::of(b"image"),
            kernel: blob(b"vmlinux"),
            initramfs: blob(b"initrd"),
            vcpus: 1,
            memory_bytes: 4 * memory.len() as u64,
            prefetch: Some(prefetch),
        }
    }

    #[test]
    fn a_snapshots_prefetched_chunks_come_first_in_list_order() {
        let s = snapshot_of(
            &[b"m0", b"m1", b"m2"],
            &[b"d0", b"m0"],
            PrefetchList {
                memory: vec![2, 0],
                disk: vec![1, 0],
            },
        );
        let chunks = |m: &SnapshotManifest| -> Vec<ObjectRef> {
            references(&Manifest::Snapshot(m.clone()))
                .into_iter()
                .filter(|r| matches!(r, ObjectRef::Chunk(_)))
                .collect()
        };
        let c = |n: &[u8]| ObjectRef::Chunk(ChunkDigest::of(n));
        // Listed first in list order (m0 once, though both tables and the list name it
        // twice), then the rest in table order.
        assert_eq!(chunks(&s), vec![c(b"m2"), c(b"m0"), c(b"d0"), c(b"m1")]);
        // A hostile list changes nothing but the order: the same set, in table order.
        let hostile = SnapshotManifest {
            prefetch: Some(PrefetchList {
                memory: vec![2, 9],
                disk: vec![],
            }),
            ..s.clone()
        };
        assert_eq!(
            chunks(&hostile),
            vec![c(b"m0"), c(b"m1"), c(b"m2"), c(b"d0")]
        );
    }

    #[test]
    fn the_fetch_order_is_the_disks_chunks_then_memorys_each_in_list_order() {
        let s = snapshot_of(
            &[b"m0", b"m1", b"m2"],
            &[b"d0", b"d1", b"d2"],
            PrefetchList {
                memory: vec![2, 0],
                disk: vec![1, 2, 0],
            },
        );
        let order: Vec<(bool, ChunkDigest)> = s
            .prefetch
            .as_ref()
            .unwrap()
            .fetch_order(&s)
            .unwrap()
            .into_iter()
            .map(|(disk, e)| (disk, e.digest.unwrap()))
            .collect();
        let c = ChunkDigest::of;
        assert_eq!(
            order,
            vec![
                (true, c(b"d1")),
                (true, c(b"d2")),
                (true, c(b"d0")),
                (false, c(b"m2")),
                (false, c(b"m0")),
            ]
        );
    }

    #[test]
    fn bad_manifests_are_named_errors() {
        let p = |s: &str| RawManifest::new(Bytes::from(s.to_string())).parse();
        assert!(matches!(p("{"), Err(ManifestError::Parse { .. })));
        assert!(matches!(p("[]"), Err(ManifestError::Parse { .. })));
        assert!(matches!(
            p(r#"{"schemaVersion":2,"mediaType":"x"}"#),
            Err(ManifestError::SchemaVersion { .. })
        ));
        assert!(matches!(
            p(r#"{"schemaVersion":1,"mediaType":"x"}"#),
            Err(ManifestError::UnknownMediaType { .. })
        ));
        let mut good = serde_json::to_value(ImageManifest::new(table())).unwrap();
        good["extra"] = 1.into();
        assert!(matches!(
            p(&good.to_string()),
            Err(ManifestError::Parse { .. })
        ));
        let mut gap = ImageManifest::new(table());
        gap.disk.entries[1].offset = 5;
        let raw = RawManifest::encode(&Manifest::Image(gap)).unwrap();
        assert!(matches!(raw.parse(), Err(ManifestError::Table { .. })));
    }
}
