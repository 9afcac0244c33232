//! The package servers of the tenant recipe benchmark (issue 32), run by `ci/bench-tenant.sh`;
//! not a test.
//!
//! Builds and serves [`kiln_tests::pkgs::PackageServers`] (an apt repository of three
//! packages, a PEP 503 index and an npm registry, each on a port of 127.0.0.1) under the
//! directory given as its one argument, prints one line of build arguments for
//! `ci/tenant-recipe/Dockerfile`, `APT_PORT=<port> PYPI_PORT=<port> NPM_PORT=<port>`, and
//! serves until its stdin ends (the script holds it open), then prints each server's request
//! count on stderr and exits.
//!
//! Exit: 0 when stdin ended; a panic (101) when a source could not be built.

use std::io::Read as _;
use std::path::PathBuf;

use kiln_tests::pkgs::PackageServers;

fn main() {
    let root = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .expect("usage: bench_tenant_servers DIR"),
    );
    let s = PackageServers::start(&root);
    println!(
        "APT_PORT={} PYPI_PORT={} NPM_PORT={}",
        s.apt.port, s.pypi.port, s.npm.port
    );
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    for (name, server) in PackageServers::HOSTS.iter().zip([&s.apt, &s.pypi, &s.npm]) {
        eprintln!(
            "bench_tenant_servers: {name}: {} requests",
            server.seen.lock().expect("lock").len()
        );
    }
}
