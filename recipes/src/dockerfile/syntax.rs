//! Dockerfile syntax: parse-dockerfile plus kiln's heredoc handling for `RUN`.

/// A Dockerfile syntax error.
#[derive(Debug, thiserror::Error)]
pub enum SyntaxError {
    /// parse-dockerfile rejected the text.
    #[error("{0}")]
    Parse(String),
}
