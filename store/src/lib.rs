//! kiln-store: the content-addressed store for images and snapshots (see DESIGN.md, "Store
//! keys"). The same key layout lives in a local directory (the default, `$KILN_STORE` or
//! `~/.local/share/kiln/store`) or under an S3 prefix (`s3://bucket/prefix`).
//!
//! ```text
//! <root>/
//!   chunks/sha256/<hex>       one chunk: a zstd frame; <hex> = sha256 of the RAW bytes
//!   blobs/sha256/<hex>        OCI config/layer, vmstate...; <hex> = sha256 of STORED bytes
//!   manifests/sha256/<hex>    JSON manifest; <hex> = sha256 of its bytes as stored
//!   tags/<name>/<tag>         mutable: JSON {manifest, time, host}; moved by compare-and-swap
//!                             (a `/` in the name is written `~2f`: `tags/myorg~2fapp/v1`)
//!   tags/<name>/<tag>~history JSON lines: every move (time, host, previous, new)
//!   tags/<name>/<tag>~reports JSON lines: reports kept beside the tag (the nightly job's)
//!   refs/oci/<registry>/<repo..>/<tag>  mutable: `sha256:<hex>` of an OCI manifest/index blob
//!   leases/<id>               JSON: expiry, owner + keys an in-flight build/push relies on
//!   leases/<id>~<n>           JSON: the same lease, keys added later ([`lease::Lease`])
//!   cache/<key>               JSON: build-cache entry → layer blob digest, with its time
//!   cache-inputs/<key>        JSON, at most 4 MiB: what that entry's key was made from (the
//!                             builder's record; not a GC root, goes with its entry)
//!   cache-index/<id>          the same record by the step it was made for (a recipe position
//!                             or instruction, per workspace); goes after the entries' TTL
//!   images/<key>              JSON: image cache entry → image manifest digest, with its
//!                             time ([`lease::ImageCacheEntry`]; not a GC root)
//!   fossil/<key>              an object GC moved out of <key> and has not judged yet
//!                             (readers fall back to it; [`gc`])
//!   gc/lock                   JSON: the GC that runs (one per store), owner + expiry
//!   (local only) .tmp/ .locks/  temp files before rename, flock files for tag CAS and the
//!                             sweep lock `.locks/%sweep` ([`gc`])
//! ```
//! Everything but tags, histories, OCI references, leases, cache and image cache entries
//! (and the records beside cache entries) is immutable and written with put-if-absent. Publish order is chunks, then manifest,
//! then tag, so no tag ever names missing data.
//!
//! ## Layers (bottom up)
//! - [`backend`]: bytes by key. [`backend::Backend`] (get, get_range, head, put_if_absent,
//!   put, compare_and_swap, list, delete); [`backend::local`], [`backend::s3`]; one
//!   [`backend::retry::Retrying`] wrapper adds retries and metrics; [`backend::open`] by URL.
//! - [`digest`]: [`ChunkDigest`] (raw bytes), [`BlobDigest`] (stored bytes),
//!   [`ManifestDigest`].
//! - [`chunk`]: chunking (fixed or FastCDC), zstd at a pinned level, [`chunk::ChunkTable`].
//! - [`Store`] ([`store`] module): the typed store over a backend: blobs ([`blob`]), chunks,
//!   manifests ([`manifest`]), artifacts ([`artifact`]: chunked upload, reader, materialize),
//!   with an optional on-disk read cache ([`readcache`]).
//! - [`tag`]: tags and their history; [`ociref`]: OCI references (pulled images);
//!   [`lease`]: leases and build-cache entries; [`owner`]: who holds a lease (or a work
//!   directory), told apart from a later process that reuses its pid.
//! - [`local_blobs`]: blocking access to a local store's blobs, OCI references and tags, for
//!   the builder (download into the store, unpack from it).
//! - [`gc`] (mark is pure; sweep separate), [`verify`], [`copy`] (push/pull between stores,
//!   with [`progress`] events).
//! - [`usage`]: the raw chunk bytes a set of images holds (a workspace's storage quota).
//! - [`space`]: a full host file system (ENOSPC) reported with its path and free space.
//!
//! ## Example: publish an ext4 image and read it back
//! ```no_run
//! # async fn demo() -> Result<(), kiln_store::StoreError> {
//! use kiln_store::{artifact::PutArtifactOptions, ImageManifest, Manifest, Store, TagRef};
//! let store = Store::open("s3://bucket/prefix").await?; // or a path, or Store::open_default()
//! let opts = PutArtifactOptions::default(); // FastCDC 16/64/256 KiB
//! let (table, stats) = store.put_artifact("rootfs.ext4".as_ref(), &opts).await?; // 1. chunks
//! let mut m = ImageManifest::new(table);
//! m.oci_config = Some(store.put_blob(b"{}".to_vec().into()).await?);
//! let raw = store.put_manifest(&Manifest::Image(m)).await?; // 2. manifest
//! let tag: TagRef = "base:latest".parse()?;
//! let previous = store.get_tag(&tag).await?.map(|r| r.manifest);
//! store.set_tag(&tag, previous, raw.digest).await?; // 3. tag (compare-and-swap)
//! if let Manifest::Image(m) = store.get_manifest(&store.resolve_tag(&tag).await?).await? {
//!     store.materialize(&m.disk, "out.ext4".as_ref(), None).await?; // sparse, verified
//! }
//! println!("uploaded {} of {} chunks", stats.chunks_transferred, stats.chunks);
//! # Ok(()) }
//! ```

// Errors carry the digests, keys and store URL they are about (reads must name the chunk and
// the store); that makes them large, a cost paid only on the error path.
#![allow(clippy::result_large_err)]

pub mod artifact;
pub mod backend;
pub mod blob;
pub mod chunk;
pub mod copy;
pub mod digest;
pub mod gc;
mod inflight;
pub mod lease;
pub mod local_blobs;
pub mod manifest;
pub mod memo;
pub mod ociref;
pub mod owner;
pub mod progress;
pub mod readcache;
pub mod space;
mod staging;
pub mod store;
pub mod tag;
#[cfg(test)]
mod test_support;
pub mod usage;
pub mod verify;

pub use backend::{Backend, BackendError, StoreUrl};
pub use blob::BlobError;
pub use chunk::{ChunkEntry, ChunkError, ChunkTable, Chunking};
pub use digest::{BlobDigest, ChunkDigest, DigestError, ManifestDigest};
pub use gc::GcError;
pub use lease::LeaseError;
pub use local_blobs::LocalBlobs;
pub use manifest::{
    BlobRef, Filesystem, ImageManifest, Manifest, ManifestError, ObjectRef, PrefetchList,
    RawManifest, ReadySpec, SandboxSpec, SnapshotManifest, StartSpec,
};
pub use ociref::{OciRef, OciRefError};
pub use store::{Store, StoreOptions};
pub use tag::{TagError, TagRef};

/// Any error from this crate.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A backend primitive failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A digest string did not parse.
    #[error(transparent)]
    Digest(#[from] DigestError),
    /// A chunk or chunk table problem.
    #[error(transparent)]
    Chunk(#[from] ChunkError),
    /// A blob problem.
    #[error(transparent)]
    Blob(#[from] BlobError),
    /// A manifest problem.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// A tag problem (including a lost compare-and-swap).
    #[error(transparent)]
    Tag(#[from] TagError),
    /// An OCI reference problem.
    #[error(transparent)]
    OciRef(#[from] OciRefError),
    /// A lease or build-cache entry problem.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// A garbage-collection problem.
    #[error(transparent)]
    Gc(#[from] GcError),
    /// A local file operation (materialize, read cache, input files).
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
}

impl StoreError {
    pub(crate) fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        StoreError::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// Seconds since the Unix epoch, now.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// This host's name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else `unknown`).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}
