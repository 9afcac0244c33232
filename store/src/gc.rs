//! gc (in progress).

/// Errors from garbage collection.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// A reachable manifest could not be read or parsed, so marking stopped.
    #[error("cannot mark from {object}: {reason}")]
    Unreadable {
        /// The object.
        object: String,
        /// Why.
        reason: String,
    },
}
