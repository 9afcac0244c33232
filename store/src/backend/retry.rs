//! The one wrapper around any backend: retries transient failures with exponential backoff
//! and jitter, and counts requests, retries and bytes.
//!
//! Only [`BackendError::Transient`] is retried. Writes are safe to retry: content-addressed
//! objects are immutable (a repeated `put_if_absent` that finds its own earlier write reports
//! `AlreadyExists`), and a compare-and-swap that lost its reply and then sees `Conflict` checks
//! whether the object now holds exactly the bytes it wrote, and if so reports success.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use super::{Backend, BackendError, ObjectInfo, PutOutcome, Version};
use crate::digest::Sha256Hash;

/// How often and how patiently to retry.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in total, including the first (default 6).
    pub max_attempts: u32,
    /// Delay before the first retry (default 100 ms); doubled each retry.
    pub base_delay: Duration,
    /// Cap on one delay (default 5 s).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 6,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
        }
    }
}

/// Counters since the store was opened.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Primitive calls made (each attempt counts).
    pub requests: AtomicU64,
    /// Attempts that were retries.
    pub retries: AtomicU64,
    /// Calls that finally failed (any error other than `NotFound`).
    pub failures: AtomicU64,
    /// Bytes read by `get*` calls.
    pub bytes_read: AtomicU64,
    /// Bytes written by `put*` and `compare_and_swap` calls (file uploads count the file size).
    pub bytes_written: AtomicU64,
}

/// A plain copy of [`Metrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// See [`Metrics::requests`].
    pub requests: u64,
    /// See [`Metrics::retries`].
    pub retries: u64,
    /// See [`Metrics::failures`].
    pub failures: u64,
    /// See [`Metrics::bytes_read`].
    pub bytes_read: u64,
    /// See [`Metrics::bytes_written`].
    pub bytes_written: u64,
}

/// Retries and metrics around any [`Backend`].
#[derive(Debug)]
pub struct Retrying {
    inner: Arc<dyn Backend>,
    policy: RetryPolicy,
    metrics: Metrics,
}

impl Retrying {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>, policy: RetryPolicy) -> Self {
        Self {
            inner,
            policy,
            metrics: Metrics::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// Current counter values.
    pub fn metrics(&self) -> MetricsSnapshot {
        let m = &self.metrics;
        MetricsSnapshot {
            requests: m.requests.load(Ordering::Relaxed),
            retries: m.retries.load(Ordering::Relaxed),
            failures: m.failures.load(Ordering::Relaxed),
            bytes_read: m.bytes_read.load(Ordering::Relaxed),
            bytes_written: m.bytes_written.load(Ordering::Relaxed),
        }
    }

    fn delay(&self, attempt: u32) -> Duration {
        let exp = self
            .policy
            .base_delay
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.policy.max_delay);
        // Jitter: 50..100% of the delay, from the clock's low bits (no RNG dependency needed).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        exp / 2 + exp.mul_f64(f64::from(nanos % 1000) / 2000.0)
    }

    /// Runs `f` until it succeeds, fails permanently, or attempts run out. Returns the result
    /// and whether any attempt before the last failed transiently.
    async fn run<T, F, Fut>(&self, op: &str, key: &str, mut f: F) -> (Result<T, BackendError>, bool)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, BackendError>>,
    {
        let mut attempt = 0;
        let mut retried = false;
        loop {
            self.metrics.requests.fetch_add(1, Ordering::Relaxed);
            match f().await {
                Err(e @ BackendError::Transient { .. })
                    if attempt + 1 < self.policy.max_attempts =>
                {
                    tracing::debug!(op, key, attempt, error = %e, "transient store error, retrying");
                    tokio::time::sleep(self.delay(attempt)).await;
                    attempt += 1;
                    retried = true;
                    self.metrics.retries.fetch_add(1, Ordering::Relaxed);
                }
                r => {
                    if let Err(e) = &r
                        && !e.is_not_found()
                    {
                        self.metrics.failures.fetch_add(1, Ordering::Relaxed);
                    }
                    return (r, retried);
                }
            }
        }
    }

    fn read(&self, r: &Result<Bytes, BackendError>) {
        if let Ok(b) = r {
            self.metrics
                .bytes_read
                .fetch_add(b.len() as u64, Ordering::Relaxed);
        }
    }

    fn wrote(&self, n: u64) {
        self.metrics.bytes_written.fetch_add(n, Ordering::Relaxed);
    }
}

#[async_trait::async_trait]
impl Backend for Retrying {
    fn url(&self) -> &str {
        self.inner.url()
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        let r = self.run("get", key, || self.inner.get(key)).await.0;
        self.read(&r);
        r
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError> {
        let r = self
            .run("get_range", key, || {
                self.inner.get_range(key, range.clone())
            })
            .await
            .0;
        self.read(&r);
        r
    }

    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError> {
        let r = self
            .run("get", key, || self.inner.get_versioned(key))
            .await
            .0;
        if let Ok((b, _)) = &r {
            self.metrics
                .bytes_read
                .fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        r
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        self.run("head", key, || self.inner.head(key)).await.0
    }

    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let n = data.len() as u64;
        let r = self
            .run("put_if_absent", key, || {
                self.inner.put_if_absent(key, data.clone(), expect_sha256)
            })
            .await
            .0;
        if matches!(r, Ok(PutOutcome::Created)) {
            self.wrote(n);
        }
        r
    }

    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let r = self
            .run("put_file_if_absent", key, || {
                self.inner.put_file_if_absent(key, path, expect_sha256)
            })
            .await
            .0;
        if matches!(r, Ok(PutOutcome::Created))
            && let Ok(m) = tokio::fs::metadata(path).await
        {
            self.wrote(m.len());
        }
        r
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        let n = data.len() as u64;
        let r = self
            .run("put", key, || self.inner.put(key, data.clone()))
            .await
            .0;
        if r.is_ok() {
            self.wrote(n);
        }
        r
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError> {
        let n = data.len() as u64;
        let (r, retried) = self
            .run("compare_and_swap", key, || {
                self.inner.compare_and_swap(key, expected, data.clone())
            })
            .await;
        match r {
            Ok(v) => {
                self.wrote(n);
                Ok(v)
            }
            Err(e @ BackendError::Conflict { .. }) if retried => {
                // An earlier attempt may have succeeded with its reply lost.
                match self.inner.get_versioned(key).await {
                    Ok((now, v)) if now == data => Ok(v),
                    _ => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        self.run("list", prefix, || self.inner.list(prefix)).await.0
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        self.run("delete", key, || self.inner.delete(key)).await.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::local::LocalBackend;
    use std::sync::atomic::AtomicU32;

    /// Fault injector: fails the first `fail_before` calls of each write with `Transient`;
    /// with `lose_reply`, the first write is performed and then reported as failed (a reply
    /// lost on the wire), which a real server cannot be made to do on demand.
    #[derive(Debug)]
    struct Flaky {
        inner: LocalBackend,
        fail_before: u32,
        lose_reply: bool,
        calls: AtomicU32,
    }

    impl Flaky {
        fn fault(&self, key: &str) -> Option<BackendError> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            (n < self.fail_before).then(|| BackendError::Transient {
                store: "flaky".into(),
                key: key.into(),
                message: "injected".into(),
            })
        }
    }

    #[async_trait::async_trait]
    impl Backend for Flaky {
        fn url(&self) -> &str {
            "flaky://"
        }
        async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
            if let Some(e) = self.fault(key) {
                return Err(e);
            }
            self.inner.get(key).await
        }
        async fn get_range(&self, key: &str, r: Range<u64>) -> Result<Bytes, BackendError> {
            self.inner.get_range(key, r).await
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
            expect: Option<Sha256Hash>,
        ) -> Result<PutOutcome, BackendError> {
            self.inner.put_if_absent(key, data, expect).await
        }
        async fn put_file_if_absent(
            &self,
            key: &str,
            path: &Path,
            expect: Option<Sha256Hash>,
        ) -> Result<PutOutcome, BackendError> {
            self.inner.put_file_if_absent(key, path, expect).await
        }
        async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
            self.inner.put(key, data).await
        }
        async fn compare_and_swap(
            &self,
            key: &str,
            expected: Option<&Version>,
            data: Bytes,
        ) -> Result<Version, BackendError> {
            if self.lose_reply && self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                self.inner.compare_and_swap(key, expected, data).await?;
                return Err(BackendError::Transient {
                    store: "flaky".into(),
                    key: key.into(),
                    message: "reply lost".into(),
                });
            }
            self.inner.compare_and_swap(key, expected, data).await
        }
        async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
            self.inner.list(prefix).await
        }
        async fn delete(&self, key: &str) -> Result<(), BackendError> {
            self.inner.delete(key).await
        }
    }

    fn fast() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 4,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(5),
        }
    }

    async fn flaky(fail_before: u32, lose_reply: bool) -> (tempfile::TempDir, Retrying) {
        let dir = tempfile::tempdir().unwrap();
        let inner = LocalBackend::open(dir.path()).await.unwrap();
        inner.put("k", Bytes::from_static(b"v")).await.unwrap();
        let f = Flaky {
            inner,
            fail_before,
            lose_reply,
            calls: AtomicU32::new(0),
        };
        (dir, Retrying::new(Arc::new(f), fast()))
    }

    #[tokio::test]
    async fn retries_transient_then_gives_up() {
        let (_d, r) = flaky(3, false).await;
        assert_eq!(r.get("k").await.unwrap(), &b"v"[..]);
        let m = r.metrics();
        assert_eq!((m.requests, m.retries, m.failures), (4, 3, 0));
        let (_d, r) = flaky(10, false).await;
        assert!(matches!(
            r.get("k").await,
            Err(BackendError::Transient { .. })
        ));
        assert_eq!(r.metrics().requests, 4);
        assert_eq!(r.metrics().failures, 1);
        // Permanent errors are not retried.
        let (_d, r) = flaky(0, false).await;
        assert!(r.get("../x").await.is_err());
        assert_eq!(r.metrics().requests, 1);
    }

    #[tokio::test]
    async fn cas_with_lost_reply_is_recognised() {
        let (_d, r) = flaky(0, true).await;
        let (_, v) = r.get_versioned("k").await.unwrap();
        // The first attempt lands but reports failure; the retry then sees Conflict, finds its
        // own bytes and reports success.
        r.compare_and_swap("k", Some(&v), Bytes::from_static(b"new"))
            .await
            .unwrap();
        assert_eq!(r.get("k").await.unwrap(), &b"new"[..]);
        // A genuine loser still gets Conflict.
        let (_d, r) = flaky(0, true).await;
        let (_, v) = r.get_versioned("k").await.unwrap();
        r.inner()
            .put("k", Bytes::from_static(b"other"))
            .await
            .unwrap();
        assert!(matches!(
            r.compare_and_swap("k", Some(&v), Bytes::from_static(b"mine"))
                .await,
            Err(BackendError::Conflict { .. })
        ));
    }
}
