//! Issue 17, fault 3: with the store on a 64 MiB tmpfs, a build that fills it is told so, with
//! the path and the free space, once, wherever it fills (layer, ext4 image, chunks): not
//! "image too large" after retries at bigger sizes, and not with the cause printed twice.
//! Needs root (mount, build).

use std::path::Path;
use std::process::Command;

struct Unmount<'a>(&'a Path);

impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

/// `len` incompressible bytes (xorshift), so that layers and chunks are as big as the file.
fn noise(len: usize, seed: u32) -> Vec<u8> {
    let mut x = 0x9e37_79b9 ^ seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

#[test]
fn a_full_store_file_system_is_reported_as_no_space() {
    assert!(
        rustix::process::geteuid().is_root(),
        "mounting a tmpfs and building need root (CI runs the tests as root)"
    );
    let bb = kiln_tests::require_env("KILN_TEST_BUSYBOX_REF");
    // 18 MB: layers and image fit, the image's chunks do not. 27 MB: the layer fits,
    // mke2fs's image does not. 40 MB: the layer itself does not.
    for (mb, what) in [
        (18, "writing"),
        (27, "writing the ext4 image"),
        (40, "writing the layer"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir(&store).unwrap();
        rustix::mount::mount(
            "tmpfs",
            &store,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            Some(c"size=64m"),
        )
        .unwrap();
        let _unmount = Unmount(&store);
        let ctx = dir.path().join("ctx");
        std::fs::create_dir(&ctx).unwrap();
        std::fs::write(ctx.join("big"), noise(mb * 1_000_000, mb as u32)).unwrap();
        std::fs::write(
            ctx.join("Dockerfile"),
            format!("FROM {bb}\nCOPY big /big\n"),
        )
        .unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("build")
            .arg(&ctx)
            .args(["-t", "full:1", "--store"])
            .arg(&store)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{mb} MB: {stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("kiln: ")
                && last.contains(&format!(
                    "no space left on device: {what} {}/",
                    store.display()
                ))
                && last.contains(" free of 64.0 MiB"),
            "{mb} MB: {last}"
        );
        assert!(!stderr.contains("image too large"), "{mb} MB: {stderr}");
        assert!(
            stderr.matches("No space left on device").count() <= 1,
            "{mb} MB: {stderr}"
        );
    }
}
