//! A crash injector for store backends: [`CrashAfterWrites`] wraps a real backend and kills
//! the whole process (`abort`, no destructors, no flushing: as abrupt as a `kill -9`) right
//! after its N-th write completes. Reads pass through untouched. What the process wrote stays
//! in the page cache, so this is not a power cut: a write never synced survives it (the
//! local backend's staged chunks, [`kiln_store::backend::Backend::stage_if_absent`], are
//! synced only at their commit, and a power cut before that is not simulated here).
//!
//! Used by the `kiln-test-pusher` binary, whose crash point comes from
//! `KILN_TEST_CRASH_AFTER_WRITES`, so a test can stop a push at every write in turn. It stands
//! in for a crash the real backend cannot produce on demand.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kiln_store::backend::{
    Backend, BackendError, LayoutReport, ObjectInfo, PutOutcome, StageBatch, Staged, StagedPut,
    Version,
};
use kiln_store::digest::Sha256Hash;

/// The environment variable naming the write after which the process dies (1-based).
pub const CRASH_AFTER_WRITES: &str = "KILN_TEST_CRASH_AFTER_WRITES";

/// What happens at the chosen write.
#[derive(Debug)]
enum AtLimit {
    /// Abort the process.
    Abort,
    /// Tell the test (`reached`), then wait until it says go on (`resume`).
    Pause {
        reached: tokio::sync::Notify,
        resume: tokio::sync::Notify,
    },
}

/// A backend that aborts the process after `limit` writes (put, put-if-absent, a staged write,
/// the commit of staged writes, compare-and-swap, delete, rename), counted whether or not the write created anything; or, built with
/// [`CrashAfterWrites::pause_after`], holds the writer there until the test lets it go.
#[derive(Debug)]
pub struct CrashAfterWrites {
    inner: Arc<dyn Backend>,
    limit: u64,
    writes: AtomicU64,
    action: AtLimit,
}

impl CrashAfterWrites {
    /// Wraps `inner`; the process dies right after write number `limit` (1-based) returns.
    pub fn new(inner: Arc<dyn Backend>, limit: u64) -> Self {
        Self {
            inner,
            limit,
            writes: AtomicU64::new(0),
            action: AtLimit::Abort,
        }
    }

    /// Wraps `inner`; the task making write number `limit` (1-based) stops right after it until
    /// [`CrashAfterWrites::resume`]; [`CrashAfterWrites::reached`] waits for that moment.
    pub fn pause_after(inner: Arc<dyn Backend>, limit: u64) -> Self {
        Self {
            inner,
            limit,
            writes: AtomicU64::new(0),
            action: AtLimit::Pause {
                reached: tokio::sync::Notify::new(),
                resume: tokio::sync::Notify::new(),
            },
        }
    }

    /// Waits until the writer reached the pause point (returns at once for an abort injector).
    pub async fn reached(&self) {
        if let AtLimit::Pause { reached, .. } = &self.action {
            reached.notified().await;
        }
    }

    /// Lets a paused writer go on.
    pub fn resume(&self) {
        if let AtLimit::Pause { resume, .. } = &self.action {
            resume.notify_one();
        }
    }

    /// Writes made so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    async fn wrote(&self, key: &str) {
        let n = self.writes.fetch_add(1, Ordering::SeqCst) + 1;
        match &self.action {
            AtLimit::Abort if n >= self.limit => {
                eprintln!("kiln-test-pusher: crashing after write {n} ({key})");
                std::process::abort();
            }
            AtLimit::Pause { reached, resume } if n == self.limit => {
                reached.notify_one();
                resume.notified().await;
            }
            _ => {}
        }
    }
}

#[async_trait::async_trait]
impl Backend for CrashAfterWrites {
    fn url(&self) -> &str {
        self.inner.url()
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        self.inner.get(key).await
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError> {
        self.inner.get_range(key, range).await
    }

    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError> {
        self.inner.get_versioned(key).await
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        self.inner.head(key).await
    }

    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let r = self.inner.put_if_absent(key, data, expect_sha256).await;
        self.wrote(key).await;
        r
    }

    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let r = self
            .inner
            .put_file_if_absent(key, path, expect_sha256)
            .await;
        self.wrote(key).await;
        r
    }

    fn stage_batch(&self) -> StageBatch {
        self.inner.stage_batch()
    }

    async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
        self.inner.layout_report().await
    }

    async fn stage_if_absent(
        &self,
        batch: &StageBatch,
        key: &str,
        data: Bytes,
    ) -> Result<Staged, BackendError> {
        let r = self.inner.stage_if_absent(batch, key, data).await;
        self.wrote(key).await;
        r
    }

    async fn commit_staged(
        &self,
        batch: StageBatch,
        staged: Vec<StagedPut>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        let r = self.inner.commit_staged(batch, staged).await;
        self.wrote("(commit of staged objects)").await;
        r
    }

    async fn discard_staged(&self, batch: StageBatch, staged: Vec<StagedPut>) {
        self.inner.discard_staged(batch, staged).await
    }

    /// A write when it sends anything (the S3 backend's last pack and index), counted like
    /// the commit.
    async fn flush_staged(&self, batch: &StageBatch) -> Result<(), BackendError> {
        let r = self.inner.flush_staged(batch).await;
        self.wrote("(flush of staged objects)").await;
        r
    }

    async fn packed_present(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.inner.packed_present(keys).await
    }
    async fn pack_together(
        &self,
        keys: &[String],
    ) -> Result<kiln_store::backend::PackedTogether, BackendError> {
        self.inner.pack_together(keys).await
    }
    async fn loose_present(&self, key: &str) -> Result<bool, BackendError> {
        self.inner.loose_present(key).await
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        let r = self.inner.put(key, data).await;
        self.wrote(key).await;
        r
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError> {
        let r = self.inner.compare_and_swap(key, expected, data).await;
        self.wrote(key).await;
        r
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        self.inner.list(prefix).await
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        let r = self.inner.delete(key).await;
        self.wrote(key).await;
        r
    }

    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let r = self.inner.rename(from, to).await;
        self.wrote(from).await;
        r
    }
}
