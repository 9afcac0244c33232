//! What a finished build returns: [`BuildReport`].

use std::time::Duration;

use kiln_builder::image::Descriptor;
use kiln_builder::resolve::ResolvedBase;
use kiln_store::progress::TransferStats;
use kiln_store::{BlobDigest, ManifestDigest};
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
    /// The image bases of the build: one per stage whose `FROM` is an image (not `scratch`,
    /// not an earlier stage), in stage order.
    pub bases: Vec<BaseUse>,
    /// What each stage of the plan starts from, by stage index (the plan's stages, in
    /// dependency order): what [`BuildReport::image_base`] follows.
    pub froms: Vec<StageFrom>,
    /// The index of the stage built (the plan's target, the image provenance's `target`).
    pub target_stage: usize,
}

/// A stage's image base as resolved for this build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BaseUse {
    /// The stage's index in the plan.
    pub stage: usize,
    /// The `FROM` as written in the recipe (`default:latest`, `busybox@sha256:…`).
    pub reference: String,
    /// The platform OCI image manifest it resolved to (in the local blob cache, leased by
    /// the build): what [`crate::oci_config_summary`] reads.
    pub digest: BlobDigest,
}

/// What a stage starts from ([`kiln_builder::resolve::ResolvedBase`] without the details).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StageFrom {
    /// `FROM scratch`: an empty root.
    Scratch,
    /// An earlier stage, by index.
    Stage(usize),
    /// An image: the stage's entry of [`BuildReport::bases`].
    Image,
}

impl StageFrom {
    /// What `b` starts from.
    pub fn of(b: &ResolvedBase) -> StageFrom {
        match b {
            ResolvedBase::Scratch => StageFrom::Scratch,
            ResolvedBase::Stage(i) => StageFrom::Stage(*i),
            ResolvedBase::Image { .. } => StageFrom::Image,
        }
    }
}

/// The [`BaseUse`]s of a build's resolved bases (one per stage, by index).
pub(crate) fn base_uses(bases: &[ResolvedBase]) -> Vec<BaseUse> {
    bases
        .iter()
        .enumerate()
        .filter_map(|(stage, b)| match b {
            ResolvedBase::Image {
                reference, digest, ..
            } => Some(BaseUse {
                stage,
                reference: reference.clone(),
                digest: *digest,
            }),
            _ => None,
        })
        .collect()
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

    /// The image the built image inherits its config from: the image base at the root of
    /// the target stage's `FROM` chain (a stage `FROM` an earlier stage inherits that
    /// stage's base); `None` when the chain ends in `scratch`.
    pub fn image_base(&self) -> Option<&BaseUse> {
        image_base(&self.froms, &self.bases, self.target_stage)
    }
}

/// [`BuildReport::image_base`] of these parts: follows `froms` from `target` through
/// [`StageFrom::Stage`] links to the stage whose base is an image, and returns its entry of
/// `bases`.
pub(crate) fn image_base<'a>(
    froms: &[StageFrom],
    bases: &'a [BaseUse],
    target: usize,
) -> Option<&'a BaseUse> {
    let mut stage = target;
    // Stages only name earlier ones; the bound stops a malformed report's loop.
    for _ in 0..=froms.len() {
        match froms.get(stage)? {
            StageFrom::Scratch => return None,
            StageFrom::Stage(i) => stage = *i,
            StageFrom::Image => return bases.iter().find(|b| b.stage == stage),
        }
    }
    None
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The image base is the root of the target stage's `FROM` chain: followed through
    /// earlier stages, not the last image base of the build; `scratch` at the root is none.
    #[test]
    fn the_image_base_is_the_root_of_the_targets_chain() {
        let digest = |b: &[u8]| BlobDigest::of(b);
        let resolved = [
            ResolvedBase::Image {
                reference: "default:latest".into(),
                digest: digest(b"a"),
                onbuild: Vec::new(),
            },
            ResolvedBase::Image {
                reference: "busybox".into(),
                digest: digest(b"b"),
                onbuild: Vec::new(),
            },
            ResolvedBase::Stage(0),
            ResolvedBase::Stage(2),
            ResolvedBase::Scratch,
            ResolvedBase::Stage(4),
        ];
        let froms: Vec<StageFrom> = resolved.iter().map(StageFrom::of).collect();
        let bases = base_uses(&resolved);
        assert_eq!(
            bases.iter().map(|b| b.stage).collect::<Vec<_>>(),
            [0, 1],
            "one per image base"
        );
        let root = |t| image_base(&froms, &bases, t).map(|b| b.reference.as_str());
        assert_eq!(root(3), Some("default:latest"));
        assert_eq!(root(2), Some("default:latest"));
        assert_eq!(root(1), Some("busybox"));
        assert_eq!(root(5), None);
        assert_eq!(root(9), None, "no such stage");
        // A malformed loop ends.
        let looped = [StageFrom::Stage(1), StageFrom::Stage(0)];
        assert_eq!(image_base(&looped, &bases, 0), None);
    }
}
