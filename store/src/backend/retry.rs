//! The one wrapper around any backend: retries transient failures with exponential backoff
//! and jitter, bounds each operation in time, and counts requests, retries and bytes.
//!
//! Only [`BackendError::Transient`] is retried. Writes are safe to retry: content-addressed
//! objects are immutable (a repeated `put_if_absent` that finds its own earlier write reports
//! `AlreadyExists`), and a compare-and-swap that lost its reply and then sees `Conflict` checks
//! whether the object now holds exactly the bytes it wrote, and if so reports success.
//!
//! Every retry is visible: it is logged as a `tracing` warning naming the store, the
//! operation, the key, the attempt and the wait, and handed as a [`RetryEvent`] to the
//! store's observer ([`Retrying::set_observer`]; the CLI prints it as a JSON event and shows it
//! in its progress bar). An operation that cannot succeed ends in [`BackendError::GaveUp`],
//! which says how many attempts were made and whether the attempts or the time bound ran out.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::{
    Backend, BackendError, CompactReport, LayoutReport, ListPage, ObjectInfo, PackedTogether,
    PutOutcome, StageBatch, Staged, StagedPut, Version,
};
use crate::digest::Sha256Hash;

/// Default [`RetryPolicy::max_attempts`]: 6.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 6;

/// Default [`RetryPolicy::operation_timeout`]: 300 s. Chosen above the worst case of the other
/// defaults for a server that stopped answering (6 attempts of the S3 backend's 30 s request
/// timeout, plus at most 3.1 s of backoff: about 183 s), so that by default the attempts end
/// such an operation, and so that one multipart upload of a large file (one operation) has
/// room: 1 GiB at 3.6 MB/s.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(300);

/// How often and how patiently to retry.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts in total, including the first (default [`DEFAULT_MAX_ATTEMPTS`]; 0 counts
    /// as 1).
    pub max_attempts: u32,
    /// Delay before the first retry (default 100 ms); doubled each retry, then 50-100% of it
    /// is waited (jitter).
    pub base_delay: Duration,
    /// Cap on one delay (default 5 s).
    pub max_delay: Duration,
    /// Bound on one operation (one primitive call: a get, a put, a list, a whole multipart
    /// upload of one file), every attempt and wait included (default
    /// [`DEFAULT_OPERATION_TIMEOUT`]). An attempt still running when it passes is abandoned,
    /// and no retry is begun whose wait would end past it.
    pub operation_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
        }
    }
}

/// One failed attempt about to be retried: what [`Retrying`] logs and tells its observer.
/// Serialized (camelCase) as the CLI's `retry` JSON event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RetryEvent {
    /// The store (URL).
    pub store: String,
    /// The primitive (`get`, `put_if_absent`, `list`, ...).
    pub op: &'static str,
    /// The key (for `list`, the prefix).
    pub key: String,
    /// The attempt that failed, from 1.
    pub attempt: u32,
    /// Attempts allowed in total ([`RetryPolicy::max_attempts`]).
    pub max_attempts: u32,
    /// Wait before the next attempt, milliseconds.
    pub wait_ms: u64,
    /// Time since the operation's first attempt began, milliseconds.
    pub elapsed_ms: u64,
    /// The operation's time bound ([`RetryPolicy::operation_timeout`]), milliseconds.
    pub bound_ms: u64,
    /// What the attempt met, rendered on one line.
    pub error: String,
}

impl std::fmt::Display for RetryEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} {}: attempt {} of {} failed after {:.1}s ({}); retrying in {:.1}s \
             (bound {})",
            self.store,
            self.op,
            self.key,
            self.attempt,
            self.max_attempts,
            self.elapsed_ms as f64 / 1000.0,
            self.error,
            self.wait_ms as f64 / 1000.0,
            bound_secs(Duration::from_millis(self.bound_ms)),
        )
    }
}

/// What a store's observer is called with, once per retry; called from async tasks, must not
/// block.
pub type RetryFn = Arc<dyn Fn(&RetryEvent) + Send + Sync>;

/// A time bound in seconds for messages: `4s` when whole, else to a tenth (`0.3s`).
fn bound_secs(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// The middle of [`BackendError::GaveUp`]'s message: `gave up after 3 attempts in 4.0s (the
/// 4s bound on one store operation ran out)`, or `(all 6 attempts failed)`.
pub(crate) fn gave_up_text(attempts: &u32, elapsed: &Duration, bound: &Option<Duration>) -> String {
    let reason = match bound {
        Some(b) => format!(
            "the {} bound on one store operation ran out",
            bound_secs(*b)
        ),
        None if *attempts == 1 => "its only attempt failed".to_string(),
        None => format!("all {attempts} attempts failed"),
    };
    if *attempts == 0 {
        // A read that waited for another's fetch of the same object (Store::get_chunk).
        return format!("gave up in {:.1}s ({reason})", elapsed.as_secs_f64());
    }
    format!(
        "gave up after {attempts} attempt{} in {:.1}s ({reason})",
        if *attempts == 1 { "" } else { "s" },
        elapsed.as_secs_f64()
    )
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
    /// Requests the wrapped backend sent to its server ([`Backend::wire_requests`]): a
    /// primitive call above may be none (a chunk staged in memory) or many (a listing of
    /// `packs/` and the indexes it loads).
    pub wire: super::WireRequests,
}

/// The observer slot (a newtype only to give it a `Debug`).
#[derive(Default)]
struct Observer(RwLock<Option<RetryFn>>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.read().map(|o| o.is_some()).unwrap_or(false);
        f.write_str(if set {
            "Observer(set)"
        } else {
            "Observer(none)"
        })
    }
}

/// Retries, time bounds and metrics around any [`Backend`].
#[derive(Debug)]
pub struct Retrying {
    inner: Arc<dyn Backend>,
    policy: RetryPolicy,
    metrics: Metrics,
    observer: Observer,
}

impl Retrying {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>, policy: RetryPolicy) -> Self {
        Self {
            inner,
            policy,
            metrics: Metrics::default(),
            observer: Observer::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// The policy in force.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Sets the function told of every retry of every operation on this backend (replacing
    /// the one set before; `None` removes it). The `tracing` warning is logged either way.
    pub fn set_observer(&self, f: Option<RetryFn>) {
        *self.observer.0.write().unwrap_or_else(|p| p.into_inner()) = f;
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
            wire: self.inner.wire_requests(),
        }
    }

    /// The wait after failed attempt `attempt` (from 1).
    fn delay(&self, attempt: u32) -> Duration {
        let exp = self
            .policy
            .base_delay
            .saturating_mul(1u32 << (attempt - 1).min(16))
            .min(self.policy.max_delay);
        // Jitter: 50..100% of the delay, from the clock's low bits (no RNG dependency needed).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        exp / 2 + exp.mul_f64(f64::from(nanos % 1000) / 2000.0)
    }

    fn gave_up(
        &self,
        op: &'static str,
        key: &str,
        attempts: u32,
        start: Instant,
        bound: Option<Duration>,
        last: String,
    ) -> BackendError {
        self.metrics.failures.fetch_add(1, Ordering::Relaxed);
        BackendError::GaveUp {
            store: self.inner.url().to_string(),
            op,
            key: key.to_string(),
            attempts,
            elapsed: start.elapsed(),
            bound,
            last,
        }
    }

    /// Runs `f` until it succeeds, fails permanently, or the attempts or the time bound run
    /// out ([`BackendError::GaveUp`]). Returns the result and whether any attempt before the
    /// last failed transiently.
    async fn run<T, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        mut f: F,
    ) -> (Result<T, BackendError>, bool)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, BackendError>>,
    {
        let start = Instant::now();
        let bound = self.policy.operation_timeout;
        // A bound too large to add to the clock is no bound.
        let deadline = start.checked_add(bound);
        let max = self.policy.max_attempts.max(1);
        let mut attempt = 0;
        let mut last: Option<String> = None;
        loop {
            attempt += 1;
            self.metrics.requests.fetch_add(1, Ordering::Relaxed);
            let r = match deadline {
                Some(d) => match tokio::time::timeout_at(d.into(), f()).await {
                    Ok(r) => r,
                    Err(_) => {
                        let mut why = format!("attempt {attempt} had no answer yet");
                        if let Some(l) = last {
                            why.push_str(&format!("; attempt {} failed: {l}", attempt - 1));
                        }
                        let e = self.gave_up(op, key, attempt, start, Some(bound), why);
                        return (Err(e), attempt > 1);
                    }
                },
                None => f().await,
            };
            match r {
                Err(BackendError::Transient { message, .. }) => {
                    if attempt >= max {
                        let e = self.gave_up(op, key, attempt, start, None, message);
                        return (Err(e), attempt > 1);
                    }
                    let wait = self.delay(attempt);
                    if deadline.is_some_and(|d| Instant::now() + wait >= d) {
                        let why = format!("attempt {attempt} failed: {message}");
                        let e = self.gave_up(op, key, attempt, start, Some(bound), why);
                        return (Err(e), attempt > 1);
                    }
                    let ev = RetryEvent {
                        store: self.inner.url().to_string(),
                        op,
                        key: key.to_string(),
                        attempt,
                        max_attempts: max,
                        wait_ms: wait.as_millis().try_into().unwrap_or(u64::MAX),
                        elapsed_ms: start.elapsed().as_millis().try_into().unwrap_or(u64::MAX),
                        bound_ms: bound.as_millis().try_into().unwrap_or(u64::MAX),
                        error: message.clone(),
                    };
                    tracing::warn!("{ev}");
                    let observer = self
                        .observer
                        .0
                        .read()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone();
                    if let Some(o) = observer {
                        o(&ev);
                    }
                    tokio::time::sleep(wait).await;
                    self.metrics.retries.fetch_add(1, Ordering::Relaxed);
                    last = Some(message);
                }
                r => {
                    if let Err(e) = &r
                        && !e.is_not_found()
                    {
                        self.metrics.failures.fetch_add(1, Ordering::Relaxed);
                    }
                    return (r, attempt > 1);
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

    /// `pass`, a call of the backend's own on many objects (`keys`), bounded as one operation
    /// ([`RetryPolicy::operation_timeout`]): with no answer by then, every key's result is a
    /// transient failure (`what` says which call), for the caller to retry one by one.
    async fn bulk_pass<F>(
        &self,
        keys: &[String],
        what: &str,
        pass: F,
    ) -> Vec<Result<(), BackendError>>
    where
        F: std::future::Future<Output = Vec<Result<(), BackendError>>>,
    {
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let bound = self.policy.operation_timeout;
        match tokio::time::timeout(bound, pass).await {
            Ok(out) if out.len() == keys.len() => out,
            Ok(_) | Err(_) => keys
                .iter()
                .map(|k| {
                    Err(BackendError::Transient {
                        store: self.inner.url().to_string(),
                        key: k.clone(),
                        message: format!("{what} had no answer within {bound:?}"),
                    })
                })
                .collect(),
        }
    }

    /// Whether a call on many objects goes to the backend's own implementation once, not
    /// retried: for a backend whose failures are all final ([`Backend::failures_are_final`]:
    /// the local one, whose batched calls are one blocking call each, issue 33). Any other
    /// backend's are made one object at a time here, each retried with its own time bound.
    fn passes_batches(&self) -> bool {
        self.inner.failures_are_final()
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

    /// One pass through the backend's own bulk read, bounded as one operation
    /// ([`RetryPolicy::operation_timeout`]: a pass with no answer by then counts as a
    /// transient failure of every object); then each object it failed to read for a reason
    /// worth retrying is read again alone ([`Backend::get_range`], retried as usual).
    ///
    /// Except when the store is not answering: a pass with no answer at all, then an object
    /// read alone that gave up too, fails every other object it left unread at once
    /// ([`BackendError::GaveUp`] with no attempt of its own, naming that object), rather
    /// than after a bound each. A clone's prefetch batch of 64 chunks from a stalled store
    /// took 65 bounds (3 s each in `vm_lazy`) to fail, where it now takes two.
    async fn get_many(&self, keys: &[String], limit: u64) -> Vec<Result<Bytes, BackendError>> {
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let bound = self.policy.operation_timeout;
        let (mut out, unanswered) =
            match tokio::time::timeout(bound, self.inner.get_many(keys, limit)).await {
                Ok(out) => (out, false),
                Err(_) => (
                    keys.iter()
                        .map(|k| {
                            Err(BackendError::Transient {
                                store: self.inner.url().to_string(),
                                key: k.clone(),
                                message: format!("a batched read had no answer within {bound:?}"),
                            })
                        })
                        .collect(),
                    true,
                ),
            };
        // (the object read alone that gave up, when it was, and how).
        let mut dead: Option<(
            String,
            std::time::Duration,
            Option<std::time::Duration>,
            String,
        )> = None;
        for (k, r) in keys.iter().zip(out.iter_mut()) {
            if !matches!(r, Err(BackendError::Transient { .. })) {
                self.read(r);
                continue;
            }
            if let Some((first, elapsed, bound, last)) = &dead {
                *r = Err(BackendError::GaveUp {
                    store: self.inner.url().to_string(),
                    op: "get_range",
                    key: k.clone(),
                    attempts: 0,
                    elapsed: *elapsed,
                    bound: *bound,
                    last: format!(
                        "not read alone: the store answered neither the batched read nor a \
                         read of {first} alone ({last})"
                    ),
                });
                continue;
            }
            *r = self.get_range(k, 0..limit).await;
            if let Err(BackendError::GaveUp {
                elapsed,
                bound,
                last,
                ..
            }) = r
                && unanswered
            {
                dead = Some((k.clone(), *elapsed, *bound, last.clone()));
            }
        }
        out
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

    fn wire_requests(&self) -> super::WireRequests {
        self.inner.wire_requests()
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

    fn stage_batch(&self) -> StageBatch {
        self.inner.stage_batch()
    }

    /// Retried as a whole: it only reads (on S3, a listing of `packs/` and the indexes, which
    /// the CI's S3 server, moto, answers with a 500 when a key it lists is deleted meanwhile).
    async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
        self.run("layout_report", "packs/", || self.inner.layout_report())
            .await
            .0
    }

    /// Retried as a whole: each step of a compaction is safe to run again (a pack copied
    /// again is dead weight until the next one; deleting an object already gone succeeds).
    async fn compact(
        &self,
        dry_run: bool,
        also_dead: &[String],
    ) -> Result<CompactReport, BackendError> {
        self.run("compact", "packs/", || {
            self.inner.compact(dry_run, also_dead)
        })
        .await
        .0
    }

    /// Retried as a whole: an attempt that failed published nothing but, at worst, a whole
    /// pack whose index's answer was lost, a duplicate copy like any other (the S3 backend's
    /// "Packing together"), and a pack sent without its index is invisible.
    async fn pack_together(&self, keys: &[String]) -> Result<PackedTogether, BackendError> {
        let r = self
            .run("pack_together", "packs/", || self.inner.pack_together(keys))
            .await
            .0;
        if let Ok(p) = &r {
            self.wrote(p.bytes);
        }
        r
    }

    async fn stage_if_absent(
        &self,
        batch: &StageBatch,
        key: &str,
        data: Bytes,
    ) -> Result<Staged, BackendError> {
        let n = data.len() as u64;
        let r = self
            .run("stage_if_absent", key, || {
                self.inner.stage_if_absent(batch, key, data.clone())
            })
            .await
            .0;
        if matches!(
            r,
            Ok(Staged::Pending(_) | Staged::Done(PutOutcome::Created))
        ) {
            self.wrote(n);
        }
        r
    }

    /// A backend whose failures are final, such as the local one
    /// ([`Retrying::passes_batches`]): the backend's own staging of all of them, one call.
    /// Any other: [`Backend::stage_if_absent`] of each, retried as usual (on S3 each stage
    /// may send a pack; each has its own time bound, as before).
    async fn stage_many_if_absent(
        &self,
        batch: &StageBatch,
        items: Vec<(String, Bytes)>,
    ) -> Vec<Result<Staged, BackendError>> {
        if !self.passes_batches() {
            return super::stage_each(self, batch, items).await;
        }
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let lens: Vec<u64> = items.iter().map(|(_, d)| d.len() as u64).collect();
        let out = self.inner.stage_many_if_absent(batch, items).await;
        for (n, r) in lens.into_iter().zip(&out) {
            match r {
                Ok(Staged::Pending(_) | Staged::Done(PutOutcome::Created)) => self.wrote(n),
                Ok(_) => {}
                Err(_) => {
                    self.metrics.failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        out
    }

    async fn packed_present(&self, keys: &[String]) -> Result<Vec<bool>, BackendError> {
        self.run("packed_present", "packs/", || {
            self.inner.packed_present(keys)
        })
        .await
        .0
    }

    /// A backend whose failures are final, such as the local one
    /// ([`Retrying::passes_batches`]): the backend's own look-up of all of them, one call.
    /// Any other: [`Backend::loose_present`] of each, retried as usual.
    async fn loose_present_many(&self, keys: &[String]) -> Vec<Result<bool, BackendError>> {
        if !self.passes_batches() {
            return super::present_each(self, keys).await;
        }
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let out = self.inner.loose_present_many(keys).await;
        if out.iter().any(Result::is_err) {
            self.metrics.failures.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    async fn loose_present(&self, key: &str) -> Result<bool, BackendError> {
        self.run("head", key, || self.inner.loose_present(key))
            .await
            .0
    }

    async fn flush_staged(&self, batch: &StageBatch) -> Result<(), BackendError> {
        self.run("flush_staged", "packs/", || self.inner.flush_staged(batch))
            .await
            .0
    }

    /// Not retried itself: it consumes the batch. What can fail transiently in it (the S3
    /// backend's last pack and index PUTs) is sent first by [`Backend::flush_staged`], which
    /// is retried; the local backend's failures are never transient.
    async fn commit_staged(
        &self,
        batch: StageBatch,
        staged: Vec<StagedPut>,
    ) -> Result<Vec<PutOutcome>, BackendError> {
        if batch.s3.is_some() {
            self.flush_staged(&batch).await?;
        }
        self.metrics.requests.fetch_add(1, Ordering::Relaxed);
        let r = self.inner.commit_staged(batch, staged).await;
        if r.is_err() {
            self.metrics.failures.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    async fn discard_staged(&self, batch: StageBatch, staged: Vec<StagedPut>) {
        self.inner.discard_staged(batch, staged).await
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

    fn ordered_listing(&self) -> bool {
        self.inner.ordered_listing()
    }

    async fn list_page(
        &self,
        prefix: &str,
        start_after: &str,
        max: usize,
    ) -> Result<ListPage, BackendError> {
        self.run("list_page", prefix, || {
            self.inner.list_page(prefix, start_after, max)
        })
        .await
        .0
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        self.run("delete", key, || self.inner.delete(key)).await.0
    }

    /// One pass through the backend's own bulk delete, bounded as one operation (no answer
    /// by then counts as a transient failure of every key); then each key it failed to
    /// delete for a reason worth retrying is deleted alone ([`Backend::delete`], retried as
    /// usual). Deleting again is harmless: absent is not an error.
    async fn delete_many(&self, keys: &[String]) -> Vec<Result<(), BackendError>> {
        let mut out = self
            .bulk_pass(keys, "a batched delete", self.inner.delete_many(keys))
            .await;
        for (k, r) in keys.iter().zip(out.iter_mut()) {
            if matches!(r, Err(BackendError::Transient { .. })) {
                *r = self.delete(k).await;
            }
        }
        out
    }

    /// As [`Retrying::delete_many`]: one bounded pass through the backend's own, then each
    /// pair that failed transiently renamed alone ([`Backend::rename`], retried as usual,
    /// which also recognises a move whose reply was lost).
    async fn rename_many(&self, pairs: &[(String, String)]) -> Vec<Result<(), BackendError>> {
        let keys: Vec<String> = pairs.iter().map(|(f, _)| f.clone()).collect();
        let mut out = self
            .bulk_pass(&keys, "a batched rename", self.inner.rename_many(pairs))
            .await;
        for ((f, t), r) in pairs.iter().zip(out.iter_mut()) {
            if matches!(r, Err(BackendError::Transient { .. })) {
                *r = match self.rename(f, t).await {
                    // The pass may have moved it before it failed.
                    Err(e) if e.is_not_found() => match self.inner.head(t).await {
                        Ok(Some(_)) => Ok(()),
                        _ => Err(e),
                    },
                    r => r,
                };
            }
        }
        out
    }

    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let (r, retried) = self
            .run("rename", from, || self.inner.rename(from, to))
            .await;
        match r {
            // An earlier attempt may have moved it with its reply lost.
            Err(e @ BackendError::NotFound { .. }) if retried => match self.inner.head(to).await {
                Ok(Some(_)) => Ok(()),
                _ => Err(e),
            },
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::local::LocalBackend;
    use std::sync::atomic::AtomicU32;

    /// Fault injector: fails the first `fail_before` calls of each write with `Transient`;
    /// with `lose_reply`, the first write is performed and then reported as failed (a reply
    /// lost on the wire), which a real server cannot be made to do on demand; with `hang`,
    /// `get` never answers (a server that stopped, seen from one request).
    #[derive(Debug)]
    struct Flaky {
        inner: LocalBackend,
        fail_before: u32,
        lose_reply: bool,
        hang: bool,
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
            if self.hang {
                std::future::pending::<()>().await;
            }
            if let Some(e) = self.fault(key) {
                return Err(e);
            }
            self.inner.get(key).await
        }
        async fn get_range(&self, key: &str, r: Range<u64>) -> Result<Bytes, BackendError> {
            if self.hang {
                std::future::pending::<()>().await;
            }
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
        async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
            self.inner.rename(from, to).await
        }
        async fn layout_report(&self) -> Result<LayoutReport, BackendError> {
            if let Some(e) = self.fault("packs/") {
                return Err(e);
            }
            self.inner.layout_report().await
        }
        async fn compact(
            &self,
            dry_run: bool,
            also_dead: &[String],
        ) -> Result<CompactReport, BackendError> {
            if let Some(e) = self.fault("packs/") {
                return Err(e);
            }
            self.inner.compact(dry_run, also_dead).await
        }
    }

    /// A transient failure of verify's layout report or of GC's compaction is retried like
    /// any other read or write: the S3 backend lists `packs/` in both, and moto (the CI's S3)
    /// answers a listing with a 500 when a key it lists is deleted meanwhile (seen in CI:
    /// `kiln store verify --deep` failed on `vm_nightly`'s store).
    #[tokio::test]
    async fn layout_report_and_compact_are_retried() {
        let (_d, r) = flaky(2, false).await;
        r.layout_report().await.unwrap();
        assert_eq!(r.metrics().retries, 2);
        let (_d, r) = flaky(2, false).await;
        r.compact(false, &[]).await.unwrap();
        assert_eq!(r.metrics().retries, 2);
    }

    fn fast() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 4,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(5),
            operation_timeout: Duration::from_secs(60),
        }
    }

    /// A store that never answers (every call hangs), behind [`Retrying`] with an operation
    /// bound of `bound`.
    async fn hung(bound: Duration) -> (tempfile::TempDir, Retrying) {
        let dir = tempfile::tempdir().unwrap();
        let hung = Flaky {
            inner: LocalBackend::open(dir.path()).await.unwrap(),
            fail_before: 0,
            lose_reply: false,
            hang: true,
            calls: AtomicU32::new(0),
        };
        let r = Retrying::new(
            Arc::new(hung),
            RetryPolicy {
                operation_timeout: bound,
                ..fast()
            },
        );
        (dir, r)
    }

    async fn flaky(fail_before: u32, lose_reply: bool) -> (tempfile::TempDir, Retrying) {
        let dir = tempfile::tempdir().unwrap();
        let inner = LocalBackend::open(dir.path()).await.unwrap();
        inner.put("k", Bytes::from_static(b"v")).await.unwrap();
        let f = Flaky {
            inner,
            fail_before,
            lose_reply,
            hang: false,
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
            Err(BackendError::GaveUp {
                attempts: 4,
                bound: None,
                ..
            })
        ));
        assert_eq!(r.metrics().requests, 4);
        assert_eq!(r.metrics().failures, 1);
        // Permanent errors are not retried.
        let (_d, r) = flaky(0, false).await;
        assert!(r.get("../x").await.is_err());
        assert_eq!(r.metrics().requests, 1);
    }

    /// Issue 17, fault 4: retries were logged at debug level only, so a push against a hung
    /// server printed nothing for minutes. Each retry is an event naming the store, the
    /// operation, the key, the attempt and the wait; the final error says it gave up and why.
    #[tokio::test]
    async fn every_retry_is_told_and_giving_up_names_op_key_and_attempts() {
        let (_d, r) = flaky(10, false).await;
        let seen: Arc<std::sync::Mutex<Vec<RetryEvent>>> = Arc::default();
        let s = seen.clone();
        r.set_observer(Some(Arc::new(move |e: &RetryEvent| {
            s.lock().unwrap().push(e.clone());
        })));
        let e = r.get("k").await.unwrap_err();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen.iter().map(|e| e.attempt).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        for ev in &seen {
            assert_eq!(
                (ev.store.as_str(), ev.op, ev.key.as_str(), ev.max_attempts),
                ("flaky://", "get", "k", 4)
            );
            assert!(ev.wait_ms <= 5 && ev.error == "injected", "{ev:?}");
            let line = ev.to_string();
            assert!(
                line.starts_with("flaky://: get k: attempt ")
                    && line.contains("of 4 failed")
                    && line.contains("retrying in"),
                "{line}"
            );
        }
        let msg = e.to_string();
        assert!(
            msg.starts_with("flaky://: get k: gave up after 4 attempts in ")
                && msg.contains("(all 4 attempts failed): injected"),
            "{msg}"
        );
    }

    /// Issue 17, fault 4: the whole operation has a bound. An attempt that never answers is
    /// abandoned when the bound runs out, and a retry whose wait would pass it is not begun.
    #[tokio::test]
    async fn an_operation_gives_up_at_its_time_bound() {
        let bound = Duration::from_millis(300);
        let (_dir, r) = hung(bound).await;
        let t = Instant::now();
        let e = r.get("k").await.unwrap_err();
        assert!(t.elapsed() < bound * 4, "{:?}", t.elapsed());
        assert!(
            matches!(e, BackendError::GaveUp { attempts: 1, bound: Some(b), .. } if b == bound),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("get k: gave up after 1 attempt in ")
                && msg.contains("the 0.3s bound on one store operation ran out")
                && msg.contains("attempt 1 had no answer yet"),
            "{msg}"
        );

        // Waits of 10 s against a 300 ms bound: giving up at once beats waiting past it.
        let (_d, r) = flaky(10, false).await;
        let r = Retrying::new(
            r.inner().clone(),
            RetryPolicy {
                max_attempts: 6,
                base_delay: Duration::from_secs(10),
                max_delay: Duration::from_secs(10),
                operation_timeout: bound,
            },
        );
        let t = Instant::now();
        let e = r.get("k").await.unwrap_err();
        assert!(t.elapsed() < bound, "{:?}", t.elapsed());
        let msg = e.to_string();
        assert!(
            msg.contains("gave up after 1 attempt")
                && msg.contains("bound")
                && msg.contains("attempt 1 failed: injected"),
            "{msg}"
        );
    }

    /// A batched read of a store that answers nothing gives up after the batch's bound and
    /// one object's alone, not after a bound an object: every object fails, each named, the
    /// first read alone with its attempt, the others said to be left unread and why.
    #[tokio::test]
    async fn a_batched_read_of_a_store_that_answers_nothing_gives_up_at_once() {
        let bound = Duration::from_millis(200);
        let (_dir, r) = hung(bound).await;
        let keys: Vec<String> = (0..20).map(|i| format!("chunks/sha256/{i:02x}")).collect();
        let t = Instant::now();
        let out = r.get_many(&keys, 1 << 20).await;
        assert!(t.elapsed() < bound * 4, "{:?}", t.elapsed());
        for (i, (k, r)) in keys.iter().zip(&out).enumerate() {
            let e = r.as_ref().unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(k.as_str()), "{msg}");
            if i == 0 {
                assert!(
                    matches!(e, BackendError::GaveUp { attempts: 1, .. }),
                    "{e:?}"
                );
            } else {
                assert!(
                    matches!(e, BackendError::GaveUp { attempts: 0, .. })
                        && msg.contains(&format!("a read of {} alone", keys[0])),
                    "{msg}"
                );
            }
        }
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
