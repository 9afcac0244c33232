//! Stores for tests: a fresh local directory, or a fresh prefix in the test bucket of the S3
//! server that `ci/setup.sh` starts (moto on 127.0.0.1:9000). The S3 settings come from the
//! environment `ci/setup.sh` writes (`source /var/cache/kiln-ci/env`); a missing variable is a
//! test failure naming `ci/setup.sh`, never a skip.

use std::sync::atomic::{AtomicU64, Ordering};

/// Which backend a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A local directory.
    Local,
    /// A prefix in the moto S3 test bucket.
    S3,
}

/// Reads a variable `ci/setup.sh` exports, panicking with a message naming it when absent.
pub fn env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run ci/setup.sh and `source /var/cache/kiln-ci/env` first")
    })
}

/// The S3 test server's `host:port` (from `KILN_TEST_S3_ENDPOINT`).
pub fn s3_host_port() -> String {
    let ep = env("KILN_TEST_S3_ENDPOINT");
    ep.trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string()
}

/// A fresh, empty store URL of `kind`. Local stores live under `dir`; S3 stores under a prefix
/// unique to this process and call.
pub fn fresh_url(kind: Kind, dir: &std::path::Path, label: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    match kind {
        Kind::Local => dir
            .join(format!("{label}-{n}"))
            .to_string_lossy()
            .into_owned(),
        Kind::S3 => {
            // Checked for its side effect: fail early when the environment is missing.
            let _ = env("AWS_ENDPOINT_URL");
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            format!(
                "s3://{}/t-{}-{nanos}-{label}-{n}",
                env("KILN_TEST_S3_BUCKET"),
                std::process::id()
            )
        }
    }
}

/// Deterministic pseudo-random bytes from `seed`, half of them compressible runs, so that
/// chunks are distinct and zstd has something to do.
pub fn test_bytes(seed: u64, len: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let v = rng.next_u64();
        if v.is_multiple_of(4) {
            let run = (v >> 8) as usize % 200;
            out.extend(std::iter::repeat_n((v >> 16) as u8, run));
        } else {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out.truncate(len);
    out
}

/// A fresh store URL `s3://<bucket>/<label>` in a bucket of its own, created now on the test
/// S3 server (a CreateBucket request, `PUT /<bucket>`; moto accepts it unsigned), for tests
/// that delete much while listing: moto (5.1) lists by walking every key of a bucket, and a
/// key another test deletes meanwhile makes that listing fail with a 500, so heavy deleters
/// keep to their own bucket. Panics (naming the server) when the bucket cannot be made.
pub fn fresh_bucket_url(label: &str) -> String {
    use std::io::{Read, Write};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000_000)
        .unwrap_or(0);
    // Bucket names: 3 to 63 lowercase letters, digits and hyphens (S3 bucket naming rules).
    let bucket = format!("kiln-t-{}-{nanos}-{n}", std::process::id());
    let host = s3_host_port();
    let mut s = std::net::TcpStream::connect(&host)
        .unwrap_or_else(|e| panic!("S3 test server {host}: {e}: run ci/setup.sh"));
    write!(
        s,
        "PUT /{bucket} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200"),
        "creating bucket {bucket} on {host}: {}",
        reply.lines().next().unwrap_or("")
    );
    format!("s3://{bucket}/{label}")
}
