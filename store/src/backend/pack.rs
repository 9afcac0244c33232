//! The pack format both backends share (issue 33): a pack is the stored bytes of many chunks
//! (each one zstd frame, exactly what a loose chunk object holds), concatenated; its index
//! (`KILNPIDX`) names where each chunk is. The local backend keeps them under `.packs/`
//! ([`super::local`], "Packs"), the S3 backend as objects under `packs/` ([`super::s3_pack`]).
//! One format, one encoder and one decoder: a pack written by either backend can be read by
//! the other's code.

use std::sync::Arc;
use std::time::SystemTime;

use crate::digest::Sha256Hash;

const IDX_MAGIC: &[u8; 8] = b"KILNPIDX";
const IDX_VERSION: u32 = 1;
/// Magic, version, entry count.
const IDX_HEADER: usize = 8 + 4 + 8;
/// Digest, offset, stored length.
const IDX_ENTRY: usize = 32 + 8 + 8;

/// Where a packed chunk is (either backend's view of its packs).
#[derive(Debug, Clone)]
pub(crate) struct Loc {
    /// The pack's name.
    pub(crate) pack: Arc<str>,
    /// The chunk's offset in the pack, bytes.
    pub(crate) offset: u64,
    /// Its stored length, bytes.
    pub(crate) len: u64,
    /// The index's last-modified time (the chunk's `modified`, which GC's grace reads).
    pub(crate) modified: SystemTime,
}

impl Loc {
    /// Entry `e` of the index of pack `pack`, last modified at `modified`.
    pub(crate) fn of(pack: &Arc<str>, e: &IdxEntry, modified: SystemTime) -> Self {
        Self {
            pack: pack.clone(),
            offset: e.offset,
            len: e.len,
            modified,
        }
    }
}

/// The digest of a key the packs may hold: `chunks/sha256/<64 lowercase hex>`.
pub(crate) fn chunk_digest(key: &str) -> Option<Sha256Hash> {
    Sha256Hash::from_hex(key.strip_prefix("chunks/sha256/")?).ok()
}

/// The key of a packed chunk.
pub(crate) fn chunk_key(d: &Sha256Hash) -> String {
    format!("chunks/sha256/{}", d.hex())
}

/// Whether a listing of `prefix` covers packed chunks (`chunks/sha256/...` keys).
pub(crate) fn lists_chunks(prefix: &str) -> bool {
    const CHUNKS: &str = "chunks/sha256/";
    CHUNKS.starts_with(prefix) || prefix.starts_with(CHUNKS)
}

/// Adds to `out` (a listing of `prefix`'s loose objects) the live packed chunks `live`
/// gives as (digest, stored length, modified) under `prefix`: each key once, so a chunk
/// both loose and packed (two writers' copies) is listed with the later `modified`, and
/// GC's grace period counts from the newer copy. What both backends' `list` does.
pub(crate) fn add_packed(
    out: &mut Vec<super::ObjectInfo>,
    prefix: &str,
    live: impl IntoIterator<Item = (Sha256Hash, u64, std::time::SystemTime)>,
) {
    let mut at: std::collections::HashMap<String, usize> = out
        .iter()
        .enumerate()
        .map(|(i, o)| (o.key.clone(), i))
        .collect();
    for (d, len, modified) in live {
        let key = chunk_key(&d);
        if !key.starts_with(prefix) {
            continue;
        }
        match at.get(&key) {
            Some(&i) => {
                if out[i].modified < modified {
                    out[i].modified = modified;
                }
            }
            None => {
                at.insert(key.clone(), out.len());
                out.push(super::ObjectInfo {
                    key,
                    size: len,
                    modified,
                    version: None,
                });
            }
        }
    }
}

/// One chunk in a pack: its stored bytes are `len` bytes at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdxEntry {
    pub(crate) digest: Sha256Hash,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// An index file: `KILNPIDX`, version (u32 LE), entry count (u64 LE), the entries sorted by
/// digest (digest, offset u64 LE, stored length u64 LE), then the sha256 of all of that.
pub(crate) fn encode_index(entries: &mut [IdxEntry]) -> Vec<u8> {
    entries.sort_by_key(|e| e.digest);
    let mut out = Vec::with_capacity(IDX_HEADER + entries.len() * IDX_ENTRY + 32);
    out.extend_from_slice(IDX_MAGIC);
    out.extend_from_slice(&IDX_VERSION.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for e in entries.iter() {
        out.extend_from_slice(&e.digest.0);
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.len.to_le_bytes());
    }
    let sum = Sha256Hash::of(&out);
    out.extend_from_slice(&sum.0);
    out
}

/// Parses an index, refusing a torn, altered or foreign one (the reason says which).
pub(crate) fn decode_index(b: &[u8]) -> Result<Vec<IdxEntry>, String> {
    if b.len() < IDX_HEADER + 32 || &b[..8] != IDX_MAGIC {
        return Err(format!("not a pack index ({} bytes, no magic)", b.len()));
    }
    let (body, sum) = b.split_at(b.len() - 32);
    if Sha256Hash::of(body).0 != sum {
        return Err("checksum mismatch (torn or altered)".into());
    }
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
    let version = u32::from_le_bytes(b[8..12].try_into().unwrap_or([0; 4]));
    if version != IDX_VERSION {
        return Err(format!("version {version}, this kiln reads {IDX_VERSION}"));
    }
    let n = u64_at(12);
    if (body.len() - IDX_HEADER) as u64 != n.saturating_mul(IDX_ENTRY as u64) {
        return Err(format!("{n} entries do not fit its {} bytes", b.len()));
    }
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n as usize {
        let at = IDX_HEADER + i * IDX_ENTRY;
        let mut d = [0u8; 32];
        d.copy_from_slice(&b[at..at + 32]);
        let e = IdxEntry {
            digest: Sha256Hash(d),
            offset: u64_at(at + 32),
            len: u64_at(at + 40),
        };
        if out.last().is_some_and(|p: &IdxEntry| p.digest >= e.digest) {
            return Err("entries out of order".into());
        }
        if e.offset.checked_add(e.len).is_none() {
            return Err("entry past 2^64".into());
        }
        out.push(e);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_round_trips_and_a_changed_one_is_refused() {
        let mut e: Vec<IdxEntry> = (0..5u8)
            .rev()
            .map(|i| IdxEntry {
                digest: Sha256Hash::of(&[i]),
                offset: u64::from(i) * 10,
                len: 10,
            })
            .collect();
        let b = encode_index(&mut e);
        assert_eq!(decode_index(&b).unwrap(), e);
        let mut torn = b.clone();
        torn.truncate(b.len() - 7);
        assert!(decode_index(&torn).unwrap_err().contains("checksum"));
        let mut flipped = b.clone();
        flipped[30] ^= 1;
        assert!(decode_index(&flipped).unwrap_err().contains("checksum"));
        assert!(decode_index(b"garbage").is_err());
    }
}
