//! Progress events for pushes, pulls and artifact uploads, and running totals.
//!
//! Producers call a [`ProgressFn`] with each [`ProgressEvent`]; the CLI renders a bar from
//! [`TransferStats`] or prints each event as one JSON line (`serde` shape: `{"event":
//! "chunk", ...}`). Byte counts are raw (uncompressed) unless named `stored_*`.

use std::sync::Arc;

use serde::Serialize;

use crate::digest::{BlobDigest, ChunkDigest, ManifestDigest};

/// One step of a transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum ProgressEvent {
    /// A chunk handled. `transferred: false` means it was already there (dedup).
    #[serde(rename_all = "camelCase")]
    Chunk {
        /// The chunk.
        digest: ChunkDigest,
        /// Raw length in bytes.
        raw_len: u64,
        /// Stored (compressed) length in bytes.
        stored_len: u64,
        /// Whether bytes moved.
        transferred: bool,
    },
    /// An all-zero region recorded as a hole (nothing stored).
    #[serde(rename_all = "camelCase")]
    Hole {
        /// Raw length in bytes.
        raw_len: u64,
    },
    /// A blob handled.
    #[serde(rename_all = "camelCase")]
    Blob {
        /// The blob.
        digest: BlobDigest,
        /// Size in bytes.
        size: u64,
        /// Whether bytes moved.
        transferred: bool,
    },
    /// A manifest handled.
    #[serde(rename_all = "camelCase")]
    Manifest {
        /// The manifest.
        digest: ManifestDigest,
        /// Whether bytes moved.
        transferred: bool,
    },
    /// The tag was set (last event of a push or pull).
    #[serde(rename_all = "camelCase")]
    Tag {
        /// `name:tag`.
        tag: String,
        /// The manifest it now names.
        manifest: ManifestDigest,
    },
}

/// Callback receiving progress events; called from async tasks, must not block.
pub type ProgressFn = Arc<dyn Fn(&ProgressEvent) + Send + Sync>;

/// Running totals of a transfer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TransferStats {
    /// Chunks seen (not counting holes).
    pub chunks: u64,
    /// Chunks whose bytes moved.
    pub chunks_transferred: u64,
    /// Raw bytes of all chunks seen (not counting holes).
    pub raw_bytes: u64,
    /// Raw bytes of chunks that moved.
    pub raw_bytes_transferred: u64,
    /// Stored bytes that moved (chunks and blobs).
    pub stored_bytes_transferred: u64,
    /// Bytes in holes.
    pub hole_bytes: u64,
    /// Blobs seen.
    pub blobs: u64,
    /// Blobs that moved.
    pub blobs_transferred: u64,
    /// Manifests seen.
    pub manifests: u64,
    /// Manifests that moved.
    pub manifests_transferred: u64,
}

impl TransferStats {
    /// Adds one event.
    pub fn record(&mut self, e: &ProgressEvent) {
        match e {
            ProgressEvent::Chunk {
                raw_len,
                stored_len,
                transferred,
                ..
            } => {
                self.chunks += 1;
                self.raw_bytes += raw_len;
                if *transferred {
                    self.chunks_transferred += 1;
                    self.raw_bytes_transferred += raw_len;
                    self.stored_bytes_transferred += stored_len;
                }
            }
            ProgressEvent::Hole { raw_len } => self.hole_bytes += raw_len,
            ProgressEvent::Blob {
                size, transferred, ..
            } => {
                self.blobs += 1;
                if *transferred {
                    self.blobs_transferred += 1;
                    self.stored_bytes_transferred += size;
                }
            }
            ProgressEvent::Manifest { transferred, .. } => {
                self.manifests += 1;
                self.manifests_transferred += u64::from(*transferred);
            }
            ProgressEvent::Tag { .. } => {}
        }
    }

    /// Share of chunk raw bytes that did not need to move (0.0..=1.0; 0 when nothing seen).
    pub fn dedup_ratio(&self) -> f64 {
        if self.raw_bytes == 0 {
            0.0
        } else {
            1.0 - self.raw_bytes_transferred as f64 / self.raw_bytes as f64
        }
    }
}

/// Records into totals and forwards to an optional callback.
#[derive(Clone, Default)]
pub(crate) struct Reporter {
    pub(crate) stats: Arc<std::sync::Mutex<TransferStats>>,
    pub(crate) cb: Option<ProgressFn>,
}

impl Reporter {
    pub(crate) fn new(cb: Option<ProgressFn>) -> Self {
        Self {
            stats: Arc::default(),
            cb,
        }
    }

    pub(crate) fn emit(&self, e: ProgressEvent) {
        // Never held across a panic point; recover from poisoning anyway.
        self.stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(&e);
        if let Some(cb) = &self.cb {
            cb(&e);
        }
    }

    /// Takes one chunk back out of the transferred totals (a staged write another writer
    /// published first; see [`crate::artifact`]). Sends no event.
    pub(crate) fn uncount_transfer(&self, raw_len: u64, stored_len: u64) {
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        s.chunks_transferred = s.chunks_transferred.saturating_sub(1);
        s.raw_bytes_transferred = s.raw_bytes_transferred.saturating_sub(raw_len);
        s.stored_bytes_transferred = s.stored_bytes_transferred.saturating_sub(stored_len);
    }

    pub(crate) fn totals(&self) -> TransferStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }
}
