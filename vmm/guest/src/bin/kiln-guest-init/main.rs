//! kiln-guest-init: the static PID 1 of a kiln microVM (work in progress).

fn main() {
    eprintln!("kiln-guest-init {}", env!("CARGO_PKG_VERSION"));
}
