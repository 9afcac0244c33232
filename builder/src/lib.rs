//! kiln-builder: base image resolution and fetch, layer apply, step execution, build cache,
//! flattening and ext4 writing. It consumes only `kiln_recipes::plan::BuildPlan`.

pub mod exec;
