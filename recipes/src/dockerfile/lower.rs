//! Lowering typed instructions into a [`BuildPlan`].

use crate::Options;
use crate::error::Fault;
use crate::plan::BuildPlan;

/// A Dockerfile that parses but cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    /// Not written yet.
    #[error("the Dockerfile front end is not implemented yet")]
    Unimplemented,
}

/// Lowers Dockerfile `text` named `file`.
pub(crate) fn lower(_file: &str, _text: &str, _options: &Options) -> Result<BuildPlan, Fault> {
    Err(Fault::new(0, LowerError::Unimplemented))
}
