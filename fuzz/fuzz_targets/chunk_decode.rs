//! Any bytes as a stored chunk (`kiln_store::chunk::decode`: one zstd frame, bounded raw
//! length, digest checked): the raw bytes or an error, never a panic and never more than
//! the bound. The first byte picks the bound (1 B to 8 MiB). Decoding under a wrong name
//! must say what the bytes hash to; under that name the same frame must decode, and the
//! raw bytes must encode and decode back.
#![no_main]

use kiln_store::ChunkDigest;
use kiln_store::chunk::{ChunkError, decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&bound, stored)) = data.split_first() else {
        return;
    };
    let max = 1u64 << (bound % 24);
    // The name of the one byte 0xff: only a frame of exactly that byte decodes under it.
    let wrong = ChunkDigest::of(&[0xff]);
    let actual = match decode(&wrong, stored, max, "fuzz") {
        Ok(raw) => {
            assert_eq!(raw, [0xff], "bytes that hash to another name were accepted");
            return;
        }
        Err(ChunkError::DigestMismatch { actual, .. }) => actual,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let raw = decode(&actual, stored, max, "fuzz").expect("the frame decodes under its name");
    assert!(
        raw.len() as u64 <= max,
        "{} bytes past the bound {max}",
        raw.len()
    );
    assert_eq!(ChunkDigest::of(&raw), actual);
    let enc = encode(&raw).expect("encodes");
    assert_eq!(enc.digest, actual);
    let back = decode(&actual, &enc.stored, raw.len() as u64, "fuzz").expect("round trip");
    assert_eq!(back, raw);
});
