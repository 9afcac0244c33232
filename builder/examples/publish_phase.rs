//! Times a cold publish ([`kiln_builder::publish::publish`]) of given layers into a new local
//! store, as a cold `kiln build` publishes its image: the base's layers scanned first (the
//! build's prescan, which runs while the steps do and is not timed), then the publish with a
//! lease. For measuring the publish phase alone (issue 34) without running steps.
//!
//! Usage: `publish_phase STORE_DIR BASE_LAYERS LAYER...`: STORE_DIR is made anew (it must not
//! exist); the first BASE_LAYERS of the layers (bottom first; plain, gzip or zstd tar files)
//! are the base. Prints `prescan_s=` and `publish_s=` (wall seconds) and the manifest digest.
//! `SOURCE_DATE_EPOCH` sets the build's epoch, as for `kiln build`; `PRESCAN_WAIT_S` the
//! untimed wait for the base's scan (default 4 s).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kiln_builder::cache::{BlobCache, LocalCache, digest_of, digest_of_file, parse_digest};
use kiln_builder::ext4::{Keep, Prescan};
use kiln_builder::image::Descriptor;
use kiln_builder::publish::{BuiltImage, PublishOptions, layer_blobs, publish};
use kiln_store::Store;

fn fail(what: impl std::fmt::Display) -> ! {
    eprintln!("publish_phase: {what}");
    std::process::exit(1)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        fail("usage: publish_phase STORE_DIR BASE_LAYERS LAYER...");
    }
    let root = PathBuf::from(&args[0]);
    let base_n: usize = args[1].parse().unwrap_or_else(|e| fail(e));
    if root.exists() {
        fail(format!("{} exists", root.display()));
    }
    let store = Store::open_dir(&root).await.unwrap_or_else(|e| fail(e));
    let cache = LocalCache::open(&root).unwrap_or_else(|e| fail(e));
    let descriptor = |media_type: &str, digest: kiln_store::BlobDigest, size: u64| Descriptor {
        media_type: media_type.into(),
        digest,
        size,
        platform: None,
        annotations: None,
    };
    let mut layers = Vec::new();
    for p in &args[2..] {
        let d = digest_of_file(p.as_ref()).unwrap_or_else(|e| fail(e));
        let digest = parse_digest(&d.to_string(), "argument").unwrap_or_else(|e| fail(e));
        let staged = cache.ingest_path(&digest).unwrap_or_else(|e| fail(e));
        std::fs::copy(p, &staged).unwrap_or_else(|e| fail(e));
        cache.commit(&staged, &digest).unwrap_or_else(|e| fail(e));
        let size = std::fs::metadata(p).unwrap_or_else(|e| fail(e)).len();
        layers.push(descriptor(
            "application/vnd.oci.image.layer.v1.tar",
            digest,
            size,
        ));
    }
    let put = |media_type: &str, bytes: &[u8]| {
        let digest = parse_digest(&digest_of(bytes).to_string(), "test").unwrap();
        cache.put_bytes(&digest, bytes).unwrap_or_else(|e| fail(e));
        descriptor(media_type, digest, bytes.len() as u64)
    };
    let config = put("application/vnd.oci.image.config.v1+json", b"{}");
    let oci_manifest = put("application/vnd.oci.image.manifest.v1+json", b"{\"m\":1}");
    let sde = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse().ok());
    let image = BuiltImage {
        oci_manifest,
        config,
        layers: layers.clone(),
        sandbox: kiln_recipes::plan::Sandbox::default(),
        recipe_digest: digest_of(b"FROM scratch\n"),
        provenance: BTreeMap::new(),
        source_date_epoch: sde,
    };
    let opts = PublishOptions::default();
    let t = Instant::now();
    let base = layer_blobs(&cache, &layers[..base_n]).unwrap_or_else(|e| fail(e));
    let prescan = Prescan::start(base, &opts.limits, sde, Keep::in_dir(&std::env::temp_dir()));
    // A build's steps take longer than the scan of its base (about 0.7 s for the Debian
    // base here): wait past it, untimed (waiting on the scan itself would take it).
    std::thread::sleep(std::time::Duration::from_secs_f64(
        std::env::var("PRESCAN_WAIT_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(4.0),
    ));
    let prescan_s = t.elapsed().as_secs_f64();
    let lease = Arc::new(
        store
            .create_lease("publish-phase", std::time::Duration::from_secs(3600), [])
            .await
            .unwrap_or_else(|e| fail(e)),
    );
    let opts = PublishOptions {
        lease: Some(lease),
        prescan: Some(prescan),
        ..opts
    };
    let t = Instant::now();
    let p = publish(&store, &cache, &image, &[], &opts)
        .await
        .unwrap_or_else(|e| fail(e));
    println!(
        "prescan_s={prescan_s:.3} publish_s={:.3} manifest={}",
        t.elapsed().as_secs_f64(),
        p.manifest
    );
}
