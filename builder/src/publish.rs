//! What a build produced, ready to publish into the store.
//!
//! [`BuiltImage`] is the hand-over between the build driver ([`crate::build`]) and
//! publishing (ext4 image, kiln image manifest, tags). Every blob it names (OCI manifest,
//! config, layers) is already in the store.

use std::collections::BTreeMap;

use crate::image;

/// What a build produced; all blobs already in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltImage {
    /// Digest, size and media type of the OCI manifest blob.
    pub oci_manifest: image::Descriptor,
    /// The OCI image config blob.
    pub config: image::Descriptor,
    /// The layers, bottom first.
    pub layers: Vec<image::Descriptor>,
    /// How the image starts as a sandbox (start, ready, disk_mib).
    pub sandbox: kiln_recipes::plan::Sandbox,
    /// `sha256:` of the build plan's stable JSON.
    pub recipe_digest: String,
    /// Base digests, kiln version; no times.
    pub provenance: BTreeMap<String, String>,
    /// `SOURCE_DATE_EPOCH` of the build (Unix seconds), if given.
    pub source_date_epoch: Option<u64>,
}
