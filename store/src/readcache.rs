//! A local read cache in front of a (usually remote) store: verified raw chunk bytes on disk
//! at `<dir>/<hex>`, bounded in total size with least-recently-used eviction.
//!
//! Entries are written to a temp name and renamed, so a reader never sees a partial entry.
//! Recency is kept in memory (seeded from file modification times at open). Entries are raw
//! (decompressed, already verified) bytes so that a lazy reader can serve a page fault with a
//! single `pread`; a cached entry whose size or hash no longer matches is dropped on read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use bytes::Bytes;

use crate::StoreError;
use crate::digest::ChunkDigest;

/// The cache. Shared by every clone of a [`crate::Store`].
#[derive(Debug)]
pub struct ReadCache {
    dir: PathBuf,
    max_bytes: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// digest → (size in bytes, last use tick)
    entries: HashMap<ChunkDigest, (u64, u64)>,
    total: u64,
    tick: u64,
}

impl ReadCache {
    /// Opens (creating) the cache directory; `max_bytes` bounds the sum of entry sizes.
    pub async fn open(dir: &Path, max_bytes: u64) -> Result<Self, StoreError> {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| StoreError::io(dir, e))?;
        let mut found = Vec::new();
        let mut rd = tokio::fs::read_dir(dir)
            .await
            .map_err(|e| StoreError::io(dir, e))?;
        while let Some(ent) = rd.next_entry().await.map_err(|e| StoreError::io(dir, e))? {
            let name = ent.file_name().to_string_lossy().into_owned();
            let Ok(h) = crate::digest::Sha256Hash::from_hex(&name) else {
                // Temp files of a crashed writer.
                let _ = tokio::fs::remove_file(ent.path()).await;
                continue;
            };
            if let Ok(m) = ent.metadata().await {
                let t = m.modified().unwrap_or(std::time::UNIX_EPOCH);
                found.push((ChunkDigest(h), m.len(), t));
            }
        }
        found.sort_by_key(|f| f.2);
        let mut st = State::default();
        for (d, len, _) in found {
            st.tick += 1;
            st.entries.insert(d, (len, st.tick));
            st.total += len;
        }
        let c = Self {
            dir: dir.to_path_buf(),
            max_bytes,
            state: Mutex::new(st),
        };
        c.evict().await;
        Ok(c)
    }

    /// Bytes held now.
    pub fn size(&self) -> u64 {
        self.lock().total
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Never held across a panic point; recover from poisoning anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, d: &ChunkDigest) -> PathBuf {
        self.dir.join(d.hex())
    }

    /// Raw bytes of a cached chunk, re-verified; `None` on a miss or a bad entry.
    pub async fn get(&self, d: &ChunkDigest) -> Option<Bytes> {
        {
            let mut st = self.lock();
            st.tick += 1;
            let tick = st.tick;
            st.entries.get_mut(d)?.1 = tick;
        }
        match tokio::fs::read(self.path(d)).await {
            Ok(b) if ChunkDigest::of(&b) == *d => Some(Bytes::from(b)),
            _ => {
                self.remove(d).await;
                None
            }
        }
    }

    /// Adds verified raw bytes, then evicts least-recently-used entries over the bound.
    /// Failures are ignored (a cache is an optimisation).
    pub async fn put(&self, d: &ChunkDigest, raw: &[u8]) {
        if raw.len() as u64 > self.max_bytes || self.lock().entries.contains_key(d) {
            return;
        }
        let tmp = self
            .dir
            .join(format!(".tmp-{}-{}", d.hex(), std::process::id()));
        if tokio::fs::write(&tmp, raw).await.is_err()
            || tokio::fs::rename(&tmp, self.path(d)).await.is_err()
        {
            let _ = tokio::fs::remove_file(&tmp).await;
            return;
        }
        {
            let mut st = self.lock();
            st.tick += 1;
            let tick = st.tick;
            if st.entries.insert(*d, (raw.len() as u64, tick)).is_none() {
                st.total += raw.len() as u64;
            }
        }
        self.evict().await;
    }

    async fn remove(&self, d: &ChunkDigest) {
        {
            let mut st = self.lock();
            if let Some((len, _)) = st.entries.remove(d) {
                st.total -= len;
            }
        }
        let _ = tokio::fs::remove_file(self.path(d)).await;
    }

    async fn evict(&self) {
        loop {
            let victim = {
                let st = self.lock();
                if st.total <= self.max_bytes {
                    return;
                }
                st.entries
                    .iter()
                    .min_by_key(|(_, (_, t))| *t)
                    .map(|(d, _)| *d)
            };
            match victim {
                Some(d) => self.remove(&d).await,
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lru_bound_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let c = ReadCache::open(dir.path(), 250).await.unwrap();
        let chunks: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i; 100]).collect();
        let ds: Vec<ChunkDigest> = chunks.iter().map(|c| ChunkDigest::of(c)).collect();
        c.put(&ds[0], &chunks[0]).await;
        c.put(&ds[1], &chunks[1]).await;
        assert!(c.get(&ds[0]).await.is_some()); // 0 is now more recent than 1
        c.put(&ds[2], &chunks[2]).await; // over 250: evicts 1
        assert!(c.size() <= 250);
        assert!(c.get(&ds[1]).await.is_none());
        assert_eq!(c.get(&ds[0]).await.unwrap(), chunks[0]);
        // A corrupted entry is dropped, not served.
        std::fs::write(dir.path().join(ds[2].hex()), b"garbage").unwrap();
        assert!(c.get(&ds[2]).await.is_none());
        assert!(c.get(&ds[2]).await.is_none());
        // Reopen keeps what is there.
        drop(c);
        let c = ReadCache::open(dir.path(), 250).await.unwrap();
        assert_eq!(c.len(), 1);
    }
}
