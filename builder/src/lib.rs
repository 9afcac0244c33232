//! kiln-builder: base image resolution and fetch, layer apply, step execution, build cache,
//! flattening and ext4 writing. It consumes only `kiln_recipes::plan::BuildPlan`.
//!
//! Base images (issue 4):
//! - [`reference`]: image references as Docker parses them;
//! - [`image`]: OCI/Docker manifests, indexes, platforms;
//! - [`cache`]: the blob cache pulled into, which is the local store ([`cache::BlobCache`],
//!   [`cache::LocalCache`] over [`kiln_store::LocalBlobs`]);
//! - [`registry`]: pull and push through `oci-client`, with resume and credentials;
//! - [`layout`]: OCI image layout directories (import and export);
//! - [`layer`]: applying layers safely onto a root directory;
//! - [`bootstrap`]: base images built with debootstrap, cached by their inputs;
//! - [`remote`]: the kiln store (local or S3) as the shared blob cache;
//! - [`resolve`]: the resolve phase of a build plan (every base to a digest, ONBUILD);
//! - [`base`]: resolving a FROM (local refs first, then the registry) and unpacking.
//!
//! Build inputs (issue 5):
//! - [`copy`]: COPY/ADD into a step's root, and the sources' cache-key digest;
//! - [`secrets`]: `--secret id=..,src=..|env=..` build secrets for `RUN --mount=type=secret`.
//!
//! Build execution (issue 5):
//! - [`exec`]: one RUN step in an isolated root (namespaces, overlayfs, cgroup limits);
//! - [`build`]: the build driver, a plan into an OCI image in the store.
//!
//! Root file systems (issue 6):
//! - [`ext4`]: layers flattened into a deterministic, checked ext4 image (`mke2fs -d -`);
//! - [`publish`]: a built image into the store: ext4 chunks, OCI blobs, manifest, tags.

pub mod base;
pub mod bootstrap;
pub mod build;
pub mod cache;
pub mod copy;
pub mod egress;
pub mod exec;
pub mod ext4;
pub mod front;
pub mod image;
pub mod layer;
pub mod layout;
pub mod oci_compat;
pub mod publish;
mod publish_ahead;
pub mod reference;
pub mod registry;
pub mod remote;
pub mod resolve;
pub mod rootfs;
pub mod secrets;
pub mod ssh_agent;
pub mod user;
pub mod workdir;
