//! What a set of images holds in the store: the raw bytes of the distinct chunks reachable
//! from their manifests. A workspace's storage quota is counted this way (the service's
//! `--max-storage-gib`): a chunk two of its images share is counted once, and holes count
//! nothing.

use std::collections::HashSet;

use crate::digest::{ChunkDigest, ManifestDigest};
use crate::manifest::Manifest;
use crate::{Store, StoreError};

impl Store {
    /// The raw (uncompressed) bytes of the distinct chunks reachable from `roots`, in
    /// bytes: each manifest's chunk tables (an image's disk; a snapshot's memory file and
    /// disk), following an image to its snapshot and a snapshot to its image, each manifest
    /// read once. Blobs (OCI manifests and configs, vmstate, kernel) are not counted.
    /// Errors: a manifest that cannot be read or parsed.
    pub async fn chunk_bytes(
        &self,
        roots: impl IntoIterator<Item = ManifestDigest>,
    ) -> Result<u64, StoreError> {
        let mut seen: HashSet<ManifestDigest> = HashSet::new();
        let mut stack: Vec<ManifestDigest> =
            roots.into_iter().filter(|d| seen.insert(*d)).collect();
        let mut chunks: HashSet<ChunkDigest> = HashSet::new();
        let mut bytes = 0u64;
        while let Some(d) = stack.pop() {
            let m = self.get_manifest(&d).await?;
            let (next, tables) = match &m {
                Manifest::Image(i) => (i.snapshot, vec![&i.disk]),
                Manifest::Snapshot(s) => (Some(s.image), vec![&s.memory, &s.disk]),
            };
            if let Some(n) = next
                && seen.insert(n)
            {
                stack.push(n);
            }
            for e in tables.into_iter().flat_map(|t| &t.entries) {
                if let Some(c) = e.digest
                    && chunks.insert(c)
                {
                    bytes += e.raw_len;
                }
            }
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use crate::artifact::PutArtifactOptions;
    use crate::{ImageManifest, Manifest, Store};

    /// Two images sharing their chunks count them once; a missing manifest is an error.
    #[tokio::test]
    async fn shared_chunks_count_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path().to_str().expect("utf-8"))
            .await
            .expect("open store");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (table, _) = store
            .put_artifact_reader(
                std::io::Cursor::new(data.clone()),
                &PutArtifactOptions::default(),
            )
            .await
            .expect("artifact");
        let one = ImageManifest::new(table.clone());
        let mut two = ImageManifest::new(table);
        two.oci_config = Some(store.put_blob(b"{}".to_vec().into()).await.expect("blob"));
        let a = store
            .put_manifest(&Manifest::Image(one))
            .await
            .expect("manifest")
            .digest;
        let b = store
            .put_manifest(&Manifest::Image(two))
            .await
            .expect("manifest")
            .digest;
        assert_ne!(a, b);
        let distinct: u64 = {
            let m = store.get_manifest(&a).await.expect("read");
            let Manifest::Image(i) = m else {
                panic!("image")
            };
            let mut seen = std::collections::HashSet::new();
            i.disk
                .entries
                .iter()
                .filter(|e| e.digest.is_some_and(|d| seen.insert(d)))
                .map(|e| e.raw_len)
                .sum()
        };
        assert!(distinct > 0 && distinct <= data.len() as u64);
        assert_eq!(store.chunk_bytes([a]).await.expect("usage"), distinct);
        assert_eq!(store.chunk_bytes([a, b, a]).await.expect("usage"), distinct);
        assert_eq!(store.chunk_bytes([]).await.expect("usage"), 0);
        let missing = crate::ManifestDigest::of(b"nothing");
        assert!(store.chunk_bytes([a, missing]).await.is_err());
    }
}
