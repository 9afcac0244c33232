//! One module per subcommand: parse flags, call the library, print.

pub mod common;
pub mod export;
pub mod import;
pub mod login;
pub mod plan;
pub mod pull;
pub mod push;
pub mod unpack;
