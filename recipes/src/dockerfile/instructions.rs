//! Typed Dockerfile instructions.

/// A malformed instruction.
#[derive(Debug, thiserror::Error)]
pub enum InstructionError {
    /// A flag the instruction does not take.
    #[error("unknown flag --{flag} for {instruction}")]
    UnknownFlag {
        /// The instruction.
        instruction: &'static str,
        /// The flag name.
        flag: String,
    },
}
