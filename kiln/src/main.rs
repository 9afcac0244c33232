//! The `kiln` binary: CLI and HTTP service. Thin: parse, wire, print.

fn main() {
    println!("kiln {}", env!("CARGO_PKG_VERSION"));
}
