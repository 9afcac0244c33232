//! kiln-tests: helpers shared by the integration tests in `tests/tests/`, which run against
//! the real servers that `ci/setup.sh` starts on 127.0.0.1.

pub mod crash;
pub mod ext4;
pub mod fault_proxy;
pub mod hostile;
pub mod http;
pub mod lazy;
pub mod netns;
pub mod pkgs;
pub mod serve;
pub mod ssh;
pub mod stores;
pub mod tls;
pub mod vm;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use sha2::{Digest as _, Sha256};

/// The value of an environment variable `ci/setup.sh` exports; panics (failing the test,
/// never skipping it) with a message naming the setup script when it is missing.
pub fn require_env(name: &str) -> String {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v,
        _ => panic!(
            "{name} is not set: run `. ci/setup.sh` (or `source /var/cache/kiln-ci/env`) first; \
             it starts the test servers and builds the fixtures"
        ),
    }
}

/// Asserts that a finished command exited 0; otherwise fails the test with `what` (the
/// command, in the caller's words), the exit status and both outputs. Returns its stdout as
/// text, trimmed.
pub fn assert_success(o: &std::process::Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what} failed: {}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

/// Runs `cmd` to completion and [`assert_success`]es it, naming it by its program and
/// arguments. Returns its output.
pub fn run_ok(cmd: &mut std::process::Command) -> std::process::Output {
    let what = format!("{cmd:?}");
    let o = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} could not start: {e}"));
    assert_success(&o, &what);
    o
}

/// Asserts that two files hold the same bytes, reading both in 4 MiB blocks (cheaper than
/// hashing each: multi-GiB disk images are compared this way); fails the test naming the
/// first differing byte offset, or both lengths.
pub fn assert_same_bytes(a: &Path, b: &Path) {
    use std::io::Read as _;
    let open = |p: &Path| std::fs::File::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let (mut fa, mut fb) = (open(a), open(b));
    let (la, lb) = (
        fa.metadata().expect("metadata").len(),
        fb.metadata().expect("metadata").len(),
    );
    assert_eq!(
        la,
        lb,
        "{} has {la} bytes, {} has {lb}",
        a.display(),
        b.display()
    );
    let (mut ba, mut bb) = (vec![0u8; 4 << 20], vec![0u8; 4 << 20]);
    let mut at = 0u64;
    while at < la {
        let n = (la - at).min(ba.len() as u64) as usize;
        fa.read_exact(&mut ba[..n]).expect("read");
        fb.read_exact(&mut bb[..n]).expect("read");
        // Slice equality is one memcmp; the byte-by-byte search runs only on a difference
        // (the iterator version took about 90 s of CPU in CI's unoptimised test build for
        // the main job's two 3 GiB images).
        if ba[..n] != bb[..n] {
            let i = ba[..n]
                .iter()
                .zip(&bb[..n])
                .position(|(x, y)| x != y)
                .unwrap_or(0);
            panic!(
                "{} and {} differ at byte {}",
                a.display(),
                b.display(),
                at + i as u64
            );
        }
        at += n as u64;
    }
}

/// One line per path under `root` (the root itself excluded), sorted: path, file type,
/// permission bits, uid, gid, xattrs (name=hex value, sorted), and then the symlink target,
/// the sha256 of a regular file's content, or a device's major:minor. Used to compare trees
/// unpacked by different tools.
pub fn tree_listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let md = std::fs::symlink_metadata(&p).expect("lstat");
        let rel = p
            .strip_prefix(root)
            .expect("under root")
            .display()
            .to_string();
        let ft = md.file_type();
        use std::os::unix::fs::FileTypeExt;
        let (kind, extra) = if ft.is_symlink() {
            (
                "l",
                std::fs::read_link(&p)
                    .expect("readlink")
                    .display()
                    .to_string(),
            )
        } else if ft.is_dir() {
            ("d", String::new())
        } else if ft.is_file() {
            let data = std::fs::read(&p).expect("read");
            ("f", hex::encode(Sha256::digest(&data)))
        } else if ft.is_char_device() || ft.is_block_device() {
            let r = md.rdev();
            (
                if ft.is_char_device() { "c" } else { "b" },
                format!("{}:{}", rustix::fs::major(r), rustix::fs::minor(r)),
            )
        } else if ft.is_fifo() {
            ("p", String::new())
        } else {
            ("s", String::new())
        };
        let mut xattrs = Vec::new();
        let mut names = vec![0u8; 64 << 10];
        let n = rustix::fs::llistxattr(&p, &mut names[..]).expect("llistxattr");
        for name in names[..n].split(|b| *b == 0).filter(|s| !s.is_empty()) {
            let name = std::str::from_utf8(name).expect("xattr name").to_string();
            let mut val = vec![0u8; 64 << 10];
            let m = rustix::fs::lgetxattr(&p, name.as_str(), &mut val[..]).expect("lgetxattr");
            xattrs.push(format!("{name}={}", hex::encode(&val[..m])));
        }
        xattrs.sort();
        out.push(format!(
            "{rel} {kind} {:o} {}:{} [{}] {extra}",
            md.mode() & 0o7777,
            md.uid(),
            md.gid(),
            xattrs.join(",")
        ));
        if ft.is_dir() {
            walk(root, &p, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bytes_names_the_first_differing_offset() {
        let t = tempfile::tempdir().expect("tempdir");
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        let mut data = vec![7u8; (4 << 20) + 3];
        std::fs::write(&a, &data).expect("write");
        std::fs::write(&b, &data).expect("write");
        assert_same_bytes(&a, &b);
        data[(4 << 20) + 1] = 8;
        std::fs::write(&b, &data).expect("write");
        let e = std::panic::catch_unwind(|| assert_same_bytes(&a, &b)).unwrap_err();
        let msg = e.downcast_ref::<String>().expect("a message");
        assert!(
            msg.ends_with(&format!("differ at byte {}", (4 << 20) + 1)),
            "{msg}"
        );
        std::fs::write(&b, &data[..10]).expect("write");
        let e = std::panic::catch_unwind(|| assert_same_bytes(&a, &b)).unwrap_err();
        let msg = e.downcast_ref::<String>().expect("a message");
        assert!(msg.contains("has 10"), "{msg}");
    }
}
