//! Support shared by the crate's unit tests.

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// `len` deterministic pseudo-random bytes from `seed` (the same on every run, so failures
/// reproduce): zstd cannot shrink them, no two 64 KiB windows of them are alike, and
/// distinct seeds give distinct bytes.
pub(crate) fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut out);
    out
}
