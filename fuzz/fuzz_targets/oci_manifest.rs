//! Any bytes as a registry manifest or index (`kiln_builder::image::AnyManifest::parse`, what
//! base-image fetch and OCI layout import read): a manifest or an error, never a panic. A
//! parsed index is asked for linux/amd64 (and the first entry's own platform), and a parsed
//! manifest's descriptors must be what the parser promises (sha256 digests, a bounded config).
#![no_main]

use kiln_builder::image::{AnyManifest, MAX_CONFIG_BYTES, Platform};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let digest = &kiln_store::digest::BlobDigest::of(data);
    match AnyManifest::parse(data, digest) {
        Ok(AnyManifest::Index(index)) => {
            for d in &index.manifests {
                assert!(d.digest.to_string().starts_with("sha256:"), "{d:?}");
            }
            match index.select(&Platform::linux_amd64(), digest) {
                Ok(d) => assert!(d.platform.is_some()),
                Err(e) => {
                    let _ = e.to_string();
                }
            }
            if let Some(p) = index.manifests.iter().find_map(|d| d.platform.as_ref()) {
                let _ = Platform::parse(&p.to_string());
                assert!(index.select(p, digest).is_ok(), "{p} is listed");
            }
        }
        Ok(AnyManifest::Image(m)) => {
            assert!(m.config.size <= MAX_CONFIG_BYTES);
            for d in std::iter::once(&m.config).chain(&m.layers) {
                assert!(d.digest.to_string().starts_with("sha256:"), "{d:?}");
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
