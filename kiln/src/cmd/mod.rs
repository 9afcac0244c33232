//! One module per subcommand: parse arguments, call the library, print.

pub mod common;
pub mod export;
pub mod import;
pub mod login;
pub mod pull;
pub mod push;
pub mod unpack;
