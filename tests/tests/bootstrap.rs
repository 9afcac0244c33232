//! Bootstrap bases: debootstrap of Debian bookworm minbase from the mirror apt already uses
//! (needs root, debootstrap and the Debian mirror, as `ci/setup.sh` sets up).

use std::process::Command;

use kiln_builder::base;
use kiln_builder::bootstrap::{BootstrapSpec, bootstrap};
use kiln_builder::cache::LocalCache;
use kiln_builder::layer::Limits;

/// The bookworm mirror from apt's own configuration (as ci/setup.sh finds it).
fn apt_mirror() -> String {
    let out = Command::new("apt-get")
        .args(["indextargets", "--format", "$(REPO_URI) $(RELEASE)"])
        .output()
        .expect("apt-get");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_suffix(" bookworm").map(str::to_string))
        .expect("apt lists a bookworm mirror (run ci/setup.sh, which runs apt-get update)")
}

#[test]
fn debootstrap_minbase_is_cached_by_inputs() {
    let spec = BootstrapSpec {
        distro: "debian".into(),
        suite: "bookworm".into(),
        mirror: apt_mirror(),
        variant: Some("minbase".into()),
        include: vec![],
    };
    let t = tempfile::tempdir().expect("tempdir");
    let cache = LocalCache::open(&t.path().join("store")).expect("store");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let first = rt
        .block_on(bootstrap(&spec, &cache, t.path()))
        .expect("bootstrap");
    assert!(!first.cached);
    let again = rt
        .block_on(bootstrap(&spec, &cache, t.path()))
        .expect("bootstrap again");
    assert!(
        again.cached,
        "same inputs: found in the cache, debootstrap not run"
    );
    assert_eq!(again.digest, first.digest);
    let root = t.path().join("rootfs");
    base::unpack(&cache, &first.digest, &root, &Limits::default()).expect("unpack");
    assert!(root.join("usr/bin/dpkg").is_file());
    assert!(root.join("dev/null").exists());
    assert_eq!(
        std::fs::read(root.join("etc/hostname")).expect("hostname"),
        b"",
        "host name not leaked"
    );
    // An ordinary OCI image: umoci reads it from an exported layout.
    let layout = t.path().join("layout");
    kiln_builder::layout::export(
        &cache,
        &first.digest,
        &layout,
        "bookworm",
        Default::default(),
    )
    .expect("export");
    let out = Command::new("umoci")
        .args([
            "unpack",
            "--image",
            &format!("{}:bookworm", layout.display()),
        ])
        .arg(t.path().join("bundle"))
        .output()
        .expect("umoci");
    assert!(
        out.status.success(),
        "umoci: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        kiln_tests::tree_listing(&root),
        kiln_tests::tree_listing(&t.path().join("bundle/rootfs"))
    );
}
