//! The Dockerfile front end, in BuildKit's layers: [`syntax`] (bytes to instructions with
//! spans and heredocs), [`instructions`] (typed, validated commands grouped in stages),
//! [`lower`] (ARG scoping, substitution, stage resolution and pruning, image config) into a
//! [`crate::plan::BuildPlan`].

mod env_map;
pub mod instructions;
pub mod lower;
pub mod syntax;
