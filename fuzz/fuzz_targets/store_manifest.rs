//! Any bytes as a store manifest (`kiln_store::RawManifest::parse`: image and snapshot
//! manifests, their chunk tables validated): a manifest or an error, never a panic. What
//! parses must list its references, answer chunk-table lookups inside its bounds, and
//! encode to bytes that parse to the same manifest.
#![no_main]

use bytes::Bytes;
use kiln_store::ChunkTable;
use kiln_store::manifest::{Manifest, RawManifest, references};
use libfuzzer_sys::fuzz_target;

fn probe(t: &ChunkTable) {
    let _ = t.chunk_digests();
    let _ = t.stored_bytes();
    for offset in [0, 1, t.size / 2, t.size.saturating_sub(1), t.size, u64::MAX] {
        match t.find(offset) {
            Some(i) => {
                let e = &t.entries[i];
                assert!(
                    e.offset <= offset && offset < e.end(),
                    "{offset} not in {e:?}"
                );
            }
            None => assert!(offset >= t.size, "{offset} < {} has no entry", t.size),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let raw = RawManifest::new(Bytes::copy_from_slice(data));
    match raw.parse() {
        Ok(m) => {
            let _ = references(&m);
            match &m {
                Manifest::Image(i) => probe(&i.disk),
                Manifest::Snapshot(s) => {
                    probe(&s.memory);
                    probe(&s.disk);
                }
            }
            let encoded = RawManifest::encode(&m).expect("a parsed manifest encodes");
            let again = encoded.parse().expect("an encoded manifest parses");
            assert_eq!(again, m, "a manifest does not survive encoding");
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
