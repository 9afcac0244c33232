//! What the two layer targets share: how one input becomes several layer streams, and the
//! bounds they are read under.

use kiln_builder::layer::Limits;

/// Separates layers in one input (bottom first), so that whiteouts meet lower layers.
pub const SEPARATOR: &[u8] = b"%KILN-NEXT-LAYER%";

/// At most this many layers per input.
pub const MAX_LAYERS: usize = 4;

/// The input cut at [`SEPARATOR`] into at most [`MAX_LAYERS`] streams (the rest stays in
/// the last one).
pub fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while out.len() + 1 < MAX_LAYERS {
        match rest.windows(SEPARATOR.len()).position(|w| w == SEPARATOR) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + SEPARATOR.len()..];
            }
            None => break,
        }
    }
    out.push(rest);
    out
}

/// Bounds small enough that one input stays fast (a gzip or zstd stream can still expand
/// a few KiB into many MiB; there is no ratio bound, so the total is what stops it).
pub fn limits() -> Limits {
    Limits {
        max_total_bytes: 16 << 20,
        max_entries: 20_000,
        max_file_bytes: 16 << 20,
        deadline: None,
        cancel: None,
    }
}
