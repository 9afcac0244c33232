//! kiln-builder: base image resolution and fetch, layer apply, step execution, build cache,
//! flattening and ext4 writing. It consumes only `kiln_recipes::plan::BuildPlan`.
//!
//! Base images (issue 4): [`reference`] parses image references as Docker does, [`layer`]
//! applies OCI layers safely onto a root directory.

pub mod layer;
pub mod reference;
