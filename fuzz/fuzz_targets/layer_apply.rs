//! Any bytes as layer streams (plain, gzip or zstd tar; see `layers.rs` for how one input
//! holds several), applied with `kiln_builder::layer::apply_layer` into a scratch root: an
//! error is fine, a panic is not, and nothing may appear or change outside the root.
//!
//! The root sits three directories below a scratch directory that holds a sentinel file, so
//! a `..` or symlink escape lands somewhere this target looks; an absolute escape would land
//! in `/`, whose top-level names are compared with the ones seen at start.
#![no_main]

mod layers;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_builder::layer::apply_layer;
use libfuzzer_sys::fuzz_target;

const SENTINEL: &[u8] = b"outside the root\n";

struct Scratch {
    /// Kept for its Drop (the directory is removed at exit).
    _dir: tempfile::TempDir,
    outer: PathBuf,
    root: PathBuf,
    slash: BTreeSet<Vec<u8>>,
}

fn names(dir: &Path) -> BTreeSet<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").file_name().as_bytes().to_vec())
        .collect()
}

fn scratch() -> &'static Scratch {
    static S: OnceLock<Scratch> = OnceLock::new();
    S.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("kiln-fuzz-layer-")
            .tempdir()
            .expect("scratch directory");
        let outer = dir.path().to_path_buf();
        fs::write(outer.join("sentinel"), SENTINEL).expect("sentinel");
        let root = outer.join("a/b/root");
        fs::create_dir_all(&root).expect("root");
        Scratch {
            slash: names(Path::new("/")),
            _dir: dir,
            outer,
            root,
        }
    })
}

/// Asserts the scratch tree outside the root is as it was made.
fn check_outside(s: &Scratch) {
    let one = |n: &str| BTreeSet::from([n.as_bytes().to_vec()]);
    assert_eq!(
        names(&s.outer),
        BTreeSet::from([b"a".to_vec(), b"sentinel".to_vec()]),
        "an entry was written beside the scratch root's ancestors"
    );
    assert_eq!(names(&s.outer.join("a")), one("b"), "written into a/");
    assert_eq!(
        names(&s.outer.join("a/b")),
        one("root"),
        "written into a/b/"
    );
    let meta = fs::symlink_metadata(&s.root).expect("root");
    assert!(meta.is_dir(), "the root is no longer a directory");
    let sentinel = fs::symlink_metadata(s.outer.join("sentinel")).expect("sentinel");
    assert!(sentinel.is_file(), "the sentinel was replaced");
    assert_eq!(fs::read(s.outer.join("sentinel")).unwrap(), SENTINEL);
    assert_eq!(names(Path::new("/")), s.slash, "an entry appeared in /");
}

fn reset(root: &Path) {
    // Entries may have made directories unreadable or unwritable; root bypasses modes, and
    // as another user make them writable first.
    if fs::remove_dir_all(root).is_err() {
        let _ = std::process::Command::new("chmod")
            .args(["-R", "u+rwx"])
            .arg(root)
            .status();
        fs::remove_dir_all(root).expect("clearing the scratch root");
    }
    fs::create_dir(root).expect("scratch root");
}

fuzz_target!(|data: &[u8]| {
    let s = scratch();
    let limits = layers::limits();
    for (i, layer) in layers::split(data).into_iter().enumerate() {
        let digest = format!("sha256:fuzz-layer-{i}");
        let r = apply_layer(&s.root, layer, &digest, &limits);
        // The error must render (every variant names the layer and the entry).
        if let Err(e) = &r {
            let _ = e.to_string();
        }
        check_outside(s);
        if r.is_err() {
            break;
        }
    }
    reset(&s.root);
});
