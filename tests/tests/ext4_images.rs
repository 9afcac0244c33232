//! ext4 root images of the real fixtures (`ci/fixtures.sh`: Debian bookworm minbase and
//! busybox, as OCI layouts), with the real e2fsprogs: read-back against the flattened tar,
//! byte-identical rebuilds into fresh stores, publishing to a local store and to S3 (moto).

use std::collections::BTreeMap;
use std::path::Path;

use kiln_builder::cache::{BlobCache, LocalCache};
use kiln_builder::ext4::{self, Ext4Options, LayerBlob};
use kiln_builder::image::{Descriptor, Platform};
use kiln_builder::layer::Limits;
use kiln_builder::publish::{self, BuiltImage, PublishOptions};
use kiln_builder::{base, layout};
use kiln_store::{BlobDigest, Manifest, Store, TagRef};
use kiln_tests::require_env;
use kiln_tests::stores::{Kind, fresh_url};

/// Imports a fixture layout into a fresh blob cache; returns the image's manifest digest.
fn import(env: &str, tag: &str, root: &Path) -> (LocalCache, BlobDigest) {
    let dir = require_env(env);
    let cache = LocalCache::open(root).expect("open cache");
    let digest = layout::import(Path::new(&dir), Some(tag), &Platform::linux_amd64(), &cache)
        .expect("import fixture layout");
    (cache, digest)
}

fn layers(cache: &LocalCache, digest: &BlobDigest) -> Vec<LayerBlob> {
    let m = base::manifest(cache, digest).expect("manifest");
    m.layers
        .iter()
        .map(|l| LayerBlob {
            digest: l.digest.to_string(),
            path: cache.blob_path(&l.digest).expect("ok").expect("cached"),
        })
        .collect()
}

fn built(cache: &LocalCache, digest: &BlobDigest) -> BuiltImage {
    let m = base::manifest(cache, digest).expect("manifest");
    let bytes = cache.read_blob(digest).expect("ok").expect("manifest blob");
    let mut provenance = BTreeMap::new();
    provenance.insert("base".to_string(), digest.to_string());
    BuiltImage {
        oci_manifest: Descriptor {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest: *digest,
            size: bytes.len() as u64,
            platform: None,
            annotations: None,
        },
        config: m.config.clone(),
        layers: m.layers.clone(),
        sandbox: kiln_recipes::plan::Sandbox::default(),
        recipe_digest: kiln_builder::cache::digest_of(b"FROM fixture\n"),
        provenance,
        source_date_epoch: None,
    }
}

fn read_back(env: &str, tag: &str) {
    let work = tempfile::tempdir().expect("tempdir");
    let (cache, digest) = import(env, tag, &work.path().join("cache"));
    let layers = layers(&cache, &digest);
    let tar_path = work.path().join("flat.tar");
    let f = std::fs::File::create(&tar_path).expect("create");
    let stats = ext4::flatten(
        &layers,
        std::io::BufWriter::new(f),
        &Limits::default(),
        None,
    )
    .expect("flatten");
    assert!(stats.files > 0, "{stats:?}");
    let img = work.path().join("root.ext4");
    let opts = Ext4Options {
        disk_mib: None,
        max_mib: ext4::DEFAULT_MAX_MIB,
        source_date_epoch: None,
        limits: Limits::default(),
    };
    let out = ext4::build(&layers, &img, &opts).expect("build ext4 (e2fsck -fn passed)");
    assert_eq!(
        std::fs::metadata(&img).expect("image").len(),
        out.size_bytes
    );
    let tar_bytes = std::fs::read(&tar_path).expect("read tar");
    let want = kiln_tests::ext4::tar_tree(&tar_bytes);
    let got = kiln_tests::ext4::image_tree(&img);
    assert!(
        want.len() as u64 > stats.dirs,
        "sanity: {} paths",
        want.len()
    );
    let diffs = kiln_tests::ext4::compare(&want, &got);
    assert!(
        diffs.is_empty(),
        "{} differences, first ones:\n{}",
        diffs.len(),
        diffs
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Every path of the flattened Debian tar is in the image, identical (type, mode, owner,
/// mtime, size, content, link target, xattrs), and nothing else is.
#[test]
fn debian_image_reads_back_as_its_flattened_tar() {
    read_back("KILN_TEST_DEBIAN_OCI", "bookworm");
}

/// The same for busybox (hard links: its applets are one binary under many names).
#[test]
fn busybox_image_reads_back_as_its_flattened_tar() {
    read_back("KILN_TEST_BUSYBOX_OCI", "latest");
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Publishes `env`'s fixture from a fresh cache into a fresh store of `kind`; returns the
/// manifest digest and the sha256 of the materialized ext4.
fn publish_fresh(kind: Kind, env: &str, tag: &str, work: &Path, label: &str) -> (String, String) {
    let (cache, digest) = import(env, tag, &work.join(format!("{label}-cache")));
    let image = built(&cache, &digest);
    let rt = rt();
    rt.block_on(async {
        let store = Store::open(&fresh_url(kind, work, label))
            .await
            .expect("open store");
        let t: TagRef = "fixture:v1".parse().expect("tag");
        let m = publish::publish(
            &store,
            &cache,
            &image,
            std::slice::from_ref(&t),
            &PublishOptions::default(),
        )
        .await
        .expect("publish")
        .manifest;
        assert_eq!(store.resolve_tag(&t).await.expect("tag set"), m);
        let Manifest::Image(im) = store.get_manifest(&m).await.expect("manifest") else {
            panic!("not an image manifest");
        };
        let fs = im.filesystem.as_ref().expect("filesystem recorded");
        assert_eq!(fs.block_size, 4096);
        assert_eq!(fs.features, ext4::FEATURES);
        assert_eq!(fs.uuid, ext4::fs_uuid(ext4::ROOTFS_SEED));
        assert_eq!(im.blobs.len(), image.layers.len());
        // Every blob the manifest names is in this store (uploaded for S3).
        for b in im
            .oci_manifest
            .iter()
            .chain(&im.oci_config)
            .chain(&im.blobs)
        {
            assert!(
                store
                    .has(&kiln_store::ObjectRef::Blob(b.digest))
                    .await
                    .expect("head"),
                "{} in the store",
                b.digest
            );
        }
        let out = work.join(format!("{label}.ext4"));
        store
            .materialize(&im.disk, &out, None)
            .await
            .expect("materialize");
        let check = std::process::Command::new("e2fsck")
            .arg("-fn")
            .arg(&out)
            .output()
            .expect("e2fsck");
        assert!(check.status.success(), "e2fsck -fn on the stored image");
        let sha = kiln_builder::cache::digest_of_file(&out).expect("hash");
        (m.to_string(), sha.to_string())
    })
}

/// Two builds of the same input into fresh stores give the same ext4 bytes and the same
/// image manifest digest, locally and on S3.
#[test]
fn same_input_same_ext4_and_manifest_in_fresh_stores() {
    let work = tempfile::tempdir().expect("tempdir");
    let a = publish_fresh(
        Kind::Local,
        "KILN_TEST_DEBIAN_OCI",
        "bookworm",
        work.path(),
        "a",
    );
    let b = publish_fresh(
        Kind::Local,
        "KILN_TEST_DEBIAN_OCI",
        "bookworm",
        work.path(),
        "b",
    );
    assert_eq!(a, b, "manifest digest and ext4 sha256");
    let s3 = publish_fresh(
        Kind::S3,
        "KILN_TEST_BUSYBOX_OCI",
        "latest",
        work.path(),
        "s",
    );
    let local = publish_fresh(
        Kind::Local,
        "KILN_TEST_BUSYBOX_OCI",
        "latest",
        work.path(),
        "l",
    );
    assert_eq!(s3, local, "S3 and local stores hold the same image");
}
