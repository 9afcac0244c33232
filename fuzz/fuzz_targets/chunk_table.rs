//! Any bytes as a chunk table (the JSON form manifests embed, `kiln_store::ChunkTable`),
//! validated: an error or a table whose lookups stay inside it, never a panic.
#![no_main]

use kiln_store::ChunkTable;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(t) = serde_json::from_slice::<ChunkTable>(data) else {
        return;
    };
    let _ = t.chunking.validate();
    let _ = t.chunking.max_len();
    if let Err(e) = t.validate() {
        let _ = e.to_string();
        return;
    }
    let mut covered = 0u64;
    for (i, e) in t.entries.iter().enumerate() {
        assert_eq!(e.offset, covered);
        assert_eq!(t.find(e.offset), Some(i));
        assert_eq!(t.find(e.end() - 1), Some(i));
        covered = e.end();
    }
    assert_eq!(covered, t.size);
    assert_eq!(t.find(t.size), None);
    let _ = t.chunk_digests();
    let _ = t.stored_bytes();
    let back: ChunkTable =
        serde_json::from_slice(&serde_json::to_vec(&t).expect("encodes")).expect("parses");
    assert_eq!(back, t);
});
