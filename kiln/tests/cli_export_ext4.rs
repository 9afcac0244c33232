//! `kiln export NAME:TAG --format ext4 -o FILE` on an image published from the busybox
//! fixture (`ci/fixtures.sh`) into a local store, with the real e2fsprogs.

use std::path::Path;
use std::process::Command;

use kiln_builder::cache::{BlobCache, LocalCache};
use kiln_builder::image::{Descriptor, Platform};
use kiln_builder::publish::{self, BuiltImage, PublishOptions};
use kiln_builder::{base, layout};
use kiln_tests::require_env;

fn publish_busybox(store: &Path) -> (String, u64) {
    let cache = LocalCache::open(store).expect("open store");
    let dir = require_env("KILN_TEST_BUSYBOX_OCI");
    let digest = layout::import(
        Path::new(&dir),
        Some("latest"),
        &Platform::linux_amd64(),
        &cache,
    )
    .expect("import");
    let m = base::manifest(&cache, &digest).expect("manifest");
    let size = cache.read_blob(&digest).expect("ok").expect("blob").len() as u64;
    let image = BuiltImage {
        oci_manifest: Descriptor {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest,
            size,
            platform: None,
            annotations: None,
        },
        config: m.config.clone(),
        layers: m.layers.clone(),
        sandbox: kiln_recipes::plan::Sandbox {
            disk_mib: Some(40),
            ..Default::default()
        },
        recipe_digest: kiln_builder::cache::digest_of(b"FROM busybox\n"),
        provenance: Default::default(),
        source_date_epoch: Some(1_700_000_000),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let s = kiln_store::Store::open(store.to_str().expect("utf-8 path"))
            .await
            .expect("store");
        let t: kiln_store::TagRef = "bb:v1".parse().expect("tag");
        let d = publish::publish(&s, &cache, &image, &[t], &PublishOptions::default())
            .await
            .expect("publish")
            .manifest;
        (d.to_string(), 40 << 20)
    })
}

#[test]
fn export_ext4_writes_the_checked_image() {
    let t = tempfile::tempdir().expect("tempdir");
    let store = t.path().join("store");
    let (digest, size) = publish_busybox(&store);
    let out = t.path().join("rootfs.ext4");
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["export", "bb:v1", "--format", "ext4", "-o"])
        .arg(&out)
        .env("KILN_STORE", &store)
        .output()
        .expect("run kiln");
    assert!(
        o.status.success(),
        "kiln export: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), digest);
    assert_eq!(
        std::fs::metadata(&out).expect("file").len(),
        size,
        "disk_mib 40"
    );
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&out)
        .output()
        .expect("e2fsck");
    assert!(fsck.status.success(), "e2fsck -fn of the exported image");
    let ls = Command::new("debugfs")
        .args(["-R", "stat /bin/busybox"])
        .arg(&out)
        .output()
        .expect("debugfs");
    assert!(
        String::from_utf8_lossy(&ls.stdout).contains("Type: regular"),
        "busybox in the exported image"
    );
    // By digest too; an unknown tag fails.
    let by_digest = t.path().join("by-digest.ext4");
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["export", &digest, "--format", "ext4", "-o"])
        .arg(&by_digest)
        .env("KILN_STORE", &store)
        .output()
        .expect("run kiln");
    assert!(o.status.success());
    assert_eq!(
        std::fs::read(&out).expect("read"),
        std::fs::read(&by_digest).expect("read")
    );
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["export", "bb:nope", "--format", "ext4", "-o"])
        .arg(t.path().join("x.ext4"))
        .env("KILN_STORE", &store)
        .output()
        .expect("run kiln");
    assert!(!o.status.success(), "an unknown tag is an error");
}
