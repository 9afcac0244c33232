//! What a finished build returns: [`BuildReport`].

use std::time::Duration;

use kiln_builder::image::Descriptor;
use kiln_store::ManifestDigest;
use kiln_store::progress::TransferStats;
use serde::Serialize;

/// A successful build: digests, sizes, times and the chunks it stored.
#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    /// The OCI image manifest (what `--iidfile` gets, as buildx writes it).
    pub oci_manifest: Descriptor,
    /// The OCI image config.
    pub config: Descriptor,
    /// The layers, bottom first.
    pub layers: Vec<Descriptor>,
    /// sha256 of the recipe bytes, `sha256:<hex>`.
    pub recipe_digest: String,
    /// Steps that ran.
    pub steps_run: usize,
    /// Steps found in the build cache.
    pub steps_cached: usize,
    /// The published image (`None` with [`crate::Output::Oci`]).
    pub image: Option<PublishedImage>,
    /// The snapshot (when one was asked for).
    pub snapshot: Option<SnapshotSummary>,
    /// The tags (or, with [`crate::Output::Oci`], the local references) that now name the
    /// result: `name:tag`.
    pub tags: Vec<String>,
    /// Where the time went.
    pub times: Times,
}

impl BuildReport {
    /// What the tags name: the image manifest that names the snapshot, else the image
    /// manifest; `None` with [`crate::Output::Oci`].
    pub fn final_image(&self) -> Option<ManifestDigest> {
        match (&self.snapshot, &self.image) {
            (Some(s), _) => Some(s.image),
            (None, Some(i)) => Some(i.manifest),
            (None, None) => None,
        }
    }
}

/// The kiln image manifest and its ext4 image.
#[derive(Debug, Clone, Serialize)]
pub struct PublishedImage {
    /// The image manifest (before any snapshot).
    pub manifest: ManifestDigest,
    /// Size of the ext4 image, bytes.
    pub disk_bytes: u64,
    /// Its chunks.
    pub disk: ChunkCounts,
    /// `true`: the image manifest of an earlier identical publish, all of it present, was
    /// reused and nothing was flattened (`kiln_builder::publish`, "Reusing an image"); its
    /// chunks then all count as reused.
    pub reused: bool,
}

/// Chunks of one artifact: how many were new to the store and how many it had already.
/// Byte counts are raw (uncompressed) unless named `stored_`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ChunkCounts {
    /// Chunks the store did not have.
    pub new_chunks: u64,
    /// Their raw bytes.
    pub new_bytes: u64,
    /// Their stored (zstd) bytes.
    pub new_stored_bytes: u64,
    /// Chunks the store already had.
    pub reused_chunks: u64,
    /// Their raw bytes.
    pub reused_bytes: u64,
    /// All-zero bytes recorded as holes (nothing stored).
    pub hole_bytes: u64,
}

impl From<TransferStats> for ChunkCounts {
    fn from(s: TransferStats) -> Self {
        ChunkCounts {
            new_chunks: s.chunks_transferred,
            new_bytes: s.raw_bytes_transferred,
            new_stored_bytes: s.stored_bytes_transferred,
            reused_chunks: s.chunks - s.chunks_transferred,
            reused_bytes: s.raw_bytes - s.raw_bytes_transferred,
            hole_bytes: s.hole_bytes,
        }
    }
}

/// The boot-once snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotSummary {
    /// The snapshot manifest.
    pub snapshot: ManifestDigest,
    /// The image manifest that names it (what the tags name).
    pub image: ManifestDigest,
    /// `tcg` or `kvm`.
    pub accel: String,
    /// VMM start → ready check passed.
    pub boot_to_ready: Duration,
    /// Pause → snapshot saved.
    pub save: Duration,
    /// Guest RAM, bytes.
    pub memory_bytes: u64,
    /// Memory bytes that are not holes (raw).
    pub memory_nonzero_bytes: u64,
    /// Memory chunks' stored (compressed) bytes.
    pub memory_stored_bytes: u64,
    /// vmstate blob, bytes.
    pub vmstate_bytes: u64,
}

/// Wall-clock time of each phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Times {
    /// Lowering the recipe and resolving (fetching) its bases.
    pub resolve: Duration,
    /// Running the steps and writing the OCI image.
    pub build: Duration,
    /// ext4 image, chunks, blobs and image manifest.
    pub publish: Duration,
    /// Boot once and snapshot.
    pub snapshot: Duration,
    /// The whole run.
    pub total: Duration,
}
