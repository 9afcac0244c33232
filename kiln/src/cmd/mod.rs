//! One module per subcommand: parse flags, call the library, print.

pub mod plan;
