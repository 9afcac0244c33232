//! Builds the guest kernel and initramfs the VM tests boot, for `ci/setup.sh`: fetches the
//! kernel of `base-images/kernel.yaml` into `$KILN_TEST_CACHE` (by name; cached by resolved
//! version), builds `kiln-guest-init` static from this checkout into
//! `$CARGO_TARGET_DIR/guest-init` (or takes `KILN_GUEST_INIT`), and writes the initramfs into
//! `$KILN_TEST_CACHE/initramfs/`, with the digest of the init's sources beside it
//! (`kiln_tests::vm::init_stamp`), which the tests check before they boot it.
//!
//! Usage: `kiln-test-guest-assets` (no arguments). Prints shell lines for the env file:
//! `export KILN_TEST_KERNEL=<vmlinux>` and `export KILN_TEST_INITRAMFS=<cpio>`, then a comment
//! line with the resolved package, version and digests.
//! Exit: 0 done, 1 failed (message on stderr).

use std::path::{Path, PathBuf};

use kiln_vmm::initramfs;
use kiln_vmm::kernel::KernelRecipe;

fn main() {
    let cache = PathBuf::from(kiln_tests::require_env("KILN_TEST_CACHE"));
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"))
        .join("guest-init");
    let run = || -> Result<(), Box<kiln_vmm::VmmError>> {
        let init =
            initramfs::build_guest_init(&workspace, &target).map_err(|e| Box::new(e.into()))?;
        let a = initramfs::guest_artifacts(&cache, &KernelRecipe::shipped(), &init)
            .map_err(|e| Box::new(e.into()))?;
        // What the tests check before booting it (kiln_tests::vm::guest_assets).
        let stamp = kiln_tests::vm::init_stamp(&a.initramfs.path);
        let sources = kiln_tests::vm::guest_init_sources_digest(&workspace);
        if let Err(e) = std::fs::write(&stamp, sources) {
            eprintln!("kiln-test-guest-assets: writing {}: {e}", stamp.display());
            std::process::exit(1);
        }
        println!("export KILN_TEST_KERNEL={}", a.kernel.vmlinux().display());
        println!("export KILN_TEST_INITRAMFS={}", a.initramfs.path.display());
        println!(
            "# guest kernel {} {} ({}): deb {} vmlinux {}; initramfs {} (modules {})",
            a.kernel.package,
            a.kernel.version,
            a.kernel.release,
            a.kernel.deb_sha256,
            a.kernel.vmlinux_sha256,
            a.initramfs.sha256,
            a.initramfs.modules.join(",")
        );
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("kiln-test-guest-assets: {e}");
        std::process::exit(1);
    }
}
