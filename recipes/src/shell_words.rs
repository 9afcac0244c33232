//! BuildKit's word expansion (`frontend/dockerfile/shell`): variables and quotes.

/// A substitution failure.
#[derive(Debug, thiserror::Error)]
pub enum ShellWordsError {
    /// `${` without `}`.
    #[error("missing '}}' in variable substitution")]
    MissingBrace,
}
