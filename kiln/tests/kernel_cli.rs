//! `kiln kernel`: fetches the guest kernel by name and builds the initramfs, printing the paths
//! as shell exports (or a `kernel` JSON event); refuses an init that is not static before
//! fetching anything. Needs `KILN_TEST_CACHE` and apt lists that know
//! `linux-image-cloud-amd64` (both from `ci/setup.sh`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_tests::require_env;
use kiln_vmm::initramfs;
use serde_json::Value;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env_remove("KILN_GUEST_INIT")
        .output()
        .expect("run kiln")
}

fn static_init() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"))
        .join("guest-init");
    initramfs::build_guest_init(workspace, &target).expect("build kiln-guest-init")
}

#[test]
fn kernel_refuses_a_dynamic_init_before_fetching_anything() {
    let cache = tempfile::tempdir().unwrap();
    let c = cache.path().to_str().unwrap();
    let o = kiln(&["kernel", "--cache", c, "--init", "/bin/sh"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a static executable"), "{err}");
    assert!(!cache.path().join("kernel").exists());
}

#[test]
fn kernel_prints_the_vmlinux_and_initramfs_it_made() {
    let cache = require_env("KILN_TEST_CACHE");
    let init = static_init();
    let init = init.to_str().unwrap();
    let o = kiln(&["--json", "kernel", "--cache", &cache, "--init", init]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ev: Value = serde_json::from_slice(&o.stdout).expect("one JSON event");
    assert_eq!(ev["event"], "kernel");
    assert!(ev["package"].as_str().unwrap().starts_with("linux-image-"));
    assert_eq!(
        ev["modules"],
        serde_json::json!([
            "virtio_ring",
            "virtio",
            "virtio_mmio",
            "virtio_blk",
            "virtio_console",
            "overlay"
        ])
    );
    for key in ["vmlinux", "initramfs"] {
        assert!(Path::new(ev[key].as_str().unwrap()).is_file(), "{ev}");
    }
    // Text mode: lines for `eval "$(kiln kernel)"`, the same files.
    let o = kiln(&["kernel", "--cache", &cache, "--init", init]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        text,
        format!(
            "export KILN_KERNEL={}\nexport KILN_INITRAMFS={}\n",
            ev["vmlinux"].as_str().unwrap(),
            ev["initramfs"].as_str().unwrap()
        )
    );
}

/// Issue 16: after a plain `cargo build`, no static `kiln-guest-init` is beside kiln (cargo's
/// is dynamic, or absent); `kiln kernel` (and so a first `kiln build --snapshot`) builds the
/// init from the source checkout instead of failing with "No such file or directory".
#[test]
fn kernel_without_an_init_builds_one_from_the_checkout() {
    let cache = require_env("KILN_TEST_CACHE");
    let o = kiln(&["kernel", "--cache", &cache]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("kiln-guest-init is not beside kiln; building it from"),
        "{err}"
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.starts_with("export KILN_KERNEL=") && text.contains("\nexport KILN_INITRAMFS="),
        "{text}"
    );
}
