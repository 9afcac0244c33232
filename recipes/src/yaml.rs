//! The kiln YAML recipe.

use crate::plan::BuildPlan;
use crate::{Options, RecipeError};

/// A recipe that does not fit the schema.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Not written yet.
    #[error("the YAML front end is not implemented yet")]
    Unimplemented,
}

/// Lowers the YAML recipe `text` named `file`.
pub(crate) fn lower(file: &str, _text: &str, _options: &Options) -> Result<BuildPlan, RecipeError> {
    Err(RecipeError::unlocated(
        file,
        YamlError::Unimplemented.into(),
    ))
}
