//! Chunks encoded ahead of their upload ([`EncodeMemo`]).
//!
//! A caller that knows most of a file's bytes before the file is finished (a publish while
//! mke2fs still writes the image) can hash and compress chunks of it early, on a core that
//! would otherwise wait, and hand the results to the upload of the finished file
//! ([`crate::artifact::PutArtifactOptions::memo`]). The upload still cuts and hashes every
//! chunk of the finished file; for a chunk whose digest the memo holds it takes the stored
//! bytes from there instead of compressing the chunk again.
//!
//! Why the result is the same: a memo entry is the zstd frame ([`crate::chunk::encode`]) of
//! raw bytes whose sha256 is the entry's digest, and the frame is a function of the raw bytes
//! alone (one compression level and parameters, [`crate::chunk::ZSTD_LEVEL`]). So a chunk
//! taken from the memo has the digest, length and stored bytes it would have had encoded in
//! the upload, and the chunk table (offsets, lengths, digests, stored lengths) is the same
//! byte for byte. What was encoded early and is not in the finished file (bytes that changed
//! after they were read) is never looked up, and costs only the work.
//!
//! The stored bytes go to a file the caller gives (an unlinked temporary file: page cache,
//! not memory), at most [`EncodeMemo::max_bytes`] of them; the index (digest → place) is in
//! memory, 40 bytes or so per chunk.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::sync::Mutex;

use bytes::Bytes;

use crate::ChunkDigest;
use crate::chunk::{self, ChunkError, EncodedChunk};

/// Digest → (offset in the memo's file, stored length), and the file's end: bytes.
type Index = (HashMap<ChunkDigest, (u64, u32)>, u64);

/// Stored bytes of chunks encoded ahead, by digest. Shared between threads.
#[derive(Debug)]
pub struct EncodeMemo {
    file: File,
    max_bytes: u64,
    /// Digest → (offset in `file`, stored length), and the file's end.
    index: Mutex<Index>,
    /// Chunks [`EncodeMemo::encode`] took from it.
    taken: std::sync::atomic::AtomicU64,
}

impl EncodeMemo {
    /// A memo keeping stored bytes in `file` (written from offset 0; an unlinked temporary
    /// file is meant), at most `max_bytes` of them.
    pub fn new(file: File, max_bytes: u64) -> EncodeMemo {
        EncodeMemo {
            file,
            max_bytes,
            index: Mutex::new((HashMap::new(), 0)),
            taken: Default::default(),
        }
    }

    /// The most stored bytes it keeps.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Whether it holds `digest`.
    pub fn contains(&self, digest: &ChunkDigest) -> bool {
        self.lock().0.contains_key(digest)
    }

    /// Chunks [`EncodeMemo::encode`] took from it so far.
    pub fn taken(&self) -> u64 {
        self.taken.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.lock().0.len()
    }

    /// True when it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `enc` (an [`chunk::encode`] result). Returns `Ok(false)` when it was not kept:
    /// held already, or the memo is full. Errors: writing the file failed (the entry is
    /// not kept).
    pub fn insert(&self, enc: &EncodedChunk) -> std::io::Result<bool> {
        let len = enc.stored.len() as u64;
        let at = {
            let mut g = self.lock();
            let (index, end) = &mut *g;
            if index.contains_key(&enc.digest) || *end + len > self.max_bytes {
                return Ok(false);
            }
            let at = *end;
            *end += len;
            at
        };
        // Written outside the lock; the entry is visible only once the bytes are there.
        self.file.write_all_at(&enc.stored, at)?;
        self.lock().0.insert(enc.digest, (at, len as u32));
        Ok(true)
    }

    /// The stored bytes of `digest`, when held and readable.
    fn get(&self, digest: &ChunkDigest) -> Option<Bytes> {
        let (at, len) = *self.lock().0.get(digest)?;
        let mut buf = vec![0u8; len as usize];
        self.file.read_exact_at(&mut buf, at).ok()?;
        Some(Bytes::from(buf))
    }

    /// [`chunk::encode`] of `raw`, taking the stored bytes from the memo when it holds
    /// `raw`'s digest (see the module doc for why that is the same result).
    pub fn encode(&self, raw: &[u8]) -> Result<EncodedChunk, ChunkError> {
        let digest = ChunkDigest::of(raw);
        match self.get(&digest) {
            Some(stored) => {
                self.taken
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(EncodedChunk {
                    digest,
                    raw_len: raw.len() as u64,
                    stored,
                })
            }
            None => chunk::encode_hashed(raw, digest),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk taken from the memo is the chunk `chunk::encode` makes; a full memo keeps
    /// nothing more; a chunk not held is encoded.
    #[test]
    fn memo_encodings_are_encode_s() {
        let raw: Vec<u8> = (0..200_000u32)
            .map(|i| (i % 251) as u8 ^ (i / 977) as u8)
            .collect();
        let other = vec![7u8; 70_000];
        let want = chunk::encode(&raw).unwrap();
        let memo = EncodeMemo::new(tempfile::tempfile().unwrap(), want.stored.len() as u64);
        assert!(memo.insert(&want).unwrap());
        assert!(!memo.insert(&want).unwrap(), "held already");
        let o = chunk::encode(&other).unwrap();
        assert!(!memo.insert(&o).unwrap(), "full");
        assert_eq!(memo.len(), 1);
        let got = memo.encode(&raw).unwrap();
        assert_eq!(
            (got.digest, got.raw_len, &got.stored),
            (want.digest, want.raw_len, &want.stored)
        );
        let got = memo.encode(&other).unwrap();
        assert_eq!((got.digest, &got.stored), (o.digest, &o.stored));
        assert!(!memo.contains(&o.digest));
    }

    /// An upload with a memo holding some of its chunks (and one chunk it does not have)
    /// writes the same table and the same stored chunks as one without, and takes the held
    /// chunks from the memo.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_with_a_memo_makes_the_same_table() {
        use crate::artifact::PutArtifactOptions;
        // Compressible noise (16 byte values), so stored lengths differ from raw ones.
        let mut data = crate::test_support::random_bytes(7, 3 << 20);
        data.iter_mut().for_each(|b| *b %= 16);
        data.extend(std::iter::repeat_n(0u8, 1 << 20));
        data.extend_from_within(..(1 << 20));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("input");
        std::fs::write(&path, &data).unwrap();
        let plain = crate::Store::open_dir(&dir.path().join("plain"))
            .await
            .unwrap();
        let (want, _) = plain
            .put_artifact(&path, &PutArtifactOptions::default())
            .await
            .unwrap();
        let memo = std::sync::Arc::new(EncodeMemo::new(tempfile::tempfile().unwrap(), 1 << 30));
        let mut held = 0;
        for e in want
            .entries
            .iter()
            .filter(|e| e.digest.is_some())
            .step_by(2)
        {
            let raw = &data[e.offset as usize..(e.offset + e.raw_len) as usize];
            // A repeated chunk is held once.
            held += u64::from(memo.insert(&chunk::encode(raw).unwrap()).unwrap());
        }
        memo.insert(&chunk::encode(b"not in the input").unwrap())
            .unwrap();
        let with = crate::Store::open_dir(&dir.path().join("with"))
            .await
            .unwrap();
        let opts = PutArtifactOptions {
            memo: Some(memo.clone()),
            ..Default::default()
        };
        let (got, _) = with.put_artifact(&path, &opts).await.unwrap();
        assert_eq!(
            serde_json::to_string(&got).unwrap(),
            serde_json::to_string(&want).unwrap()
        );
        assert!(memo.taken() >= held, "{} < {held}", memo.taken());
        for e in want.entries.iter().filter_map(|e| e.digest) {
            assert_eq!(
                with.get_chunk_stored(&e).await.unwrap(),
                plain.get_chunk_stored(&e).await.unwrap()
            );
        }
    }
}
