//! kiln-recipes: the front ends.
//!
//! A Dockerfile or a YAML recipe goes in; one [`plan::BuildPlan`] comes out. The crate is pure:
//! it reads only the bytes it is handed and never touches the network or the file system
//! beyond the files named by its caller.
pub mod dockerignore;
