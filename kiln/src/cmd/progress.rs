//! Progress of a transfer (push, pull, import, export), from the store's
//! [`ProgressEvent`]s: with `--json`, each event as one JSON line on stdout; on a terminal, an
//! indicatif bar on stderr showing bytes (raw) done of the total, chunks, and the dedup ratio
//! (share of chunk bytes already present at the destination); otherwise nothing.
//!
//! Retries of store operations ([`RetryEvent`]) are shown too: the store logs each as a
//! warning (written through [`LogWriter`], which clears the bar first and redraws it after);
//! with `--json` each is a `retry` event line; and the bar's message says what it is waiting
//! for until the next chunk moves.

use std::io::Write as _;
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln_store::backend::retry::{RetryEvent, RetryFn};
use kiln_store::progress::{ProgressEvent, ProgressFn, TransferStats};

use super::Out;

/// The bar on screen, if any, so that log lines can be written around it.
static ACTIVE_BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

fn active_bar() -> std::sync::MutexGuard<'static, Option<ProgressBar>> {
    // Nothing panics while holding it; recover the value if anything ever did.
    ACTIVE_BAR.lock().unwrap_or_else(|p| p.into_inner())
}

/// The observer of a store's retries for a command: with `--json`, each retry as one
/// `{"event": "retry", "store", "op", "key", "attempt", "maxAttempts", "waitMs", "elapsedMs",
/// "boundMs", "error"}` line on stdout; with `bar`, the bar's message says it is waiting.
/// `None` when there is nothing to do beyond the store's own warning.
pub fn retry_observer(out: &Out, bar: Option<ProgressBar>) -> Option<RetryFn> {
    if !out.json && bar.is_none() {
        return None;
    }
    let out = *out;
    Some(Arc::new(move |e: &RetryEvent| {
        if out.json {
            out.event(
                "retry",
                serde_json::to_value(e).unwrap_or_default(),
                String::new,
            );
        }
        if let Some(b) = &bar {
            b.set_message(format!(
                "waiting: {} {} failed (attempt {} of {}), retrying in {:.1}s",
                e.op,
                e.key,
                e.attempt,
                e.max_attempts,
                e.wait_ms as f64 / 1000.0
            ));
        }
    }))
}

/// Where the CLI's log lines go: stderr, one whole line at a time, with the progress bar (if
/// one is on screen) suspended around it, so that a warning never lands inside the bar.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

/// One log line being formatted; written out when dropped.
#[derive(Debug, Default)]
pub struct LogLine(Vec<u8>);

impl std::io::Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let line = std::mem::take(&mut self.0);
        let write = || {
            // Nowhere to report a failing stderr.
            let _ = std::io::stderr().lock().write_all(&line);
        };
        let bar = active_bar().clone();
        match bar {
            Some(b) => b.suspend(write),
            None => write(),
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> Self::Writer {
        LogLine::default()
    }
}

/// A transfer's progress display and running totals.
#[derive(Clone)]
pub struct Progress {
    bar: Option<ProgressBar>,
    stats: Arc<Mutex<TransferStats>>,
}

impl Progress {
    /// A display for a transfer of `total_bytes` raw bytes (0 when unknown), labelled `what`.
    pub fn new(out: &Out, total_bytes: u64, what: &str) -> Self {
        let target = ProgressDrawTarget::stderr();
        let bar = (!out.json && !target.is_hidden()).then(|| {
            let b = ProgressBar::with_draw_target((total_bytes > 0).then_some(total_bytes), target);
            // The template is a constant that parses; fall back to the default style anyway.
            let style = ProgressStyle::with_template(
                "{prefix} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            b.set_style(style);
            b.set_prefix(what.to_string());
            *active_bar() = Some(b.clone());
            b
        });
        Self {
            bar,
            stats: Arc::default(),
        }
    }

    /// The callback to hand to the store.
    pub fn callback(&self, out: &Out) -> ProgressFn {
        let me = self.clone();
        let json = out.json;
        Arc::new(move |e: &ProgressEvent| {
            if json && let Ok(line) = serde_json::to_string(e) {
                println!("{line}");
            }
            let s = {
                let mut s = me.stats.lock().unwrap_or_else(|p| p.into_inner());
                s.record(e);
                *s
            };
            if let Some(b) = &me.bar {
                b.set_position(s.raw_bytes + s.hole_bytes);
                b.set_message(format!(
                    "{} chunks, {} moved, dedup {:.1}%",
                    s.chunks,
                    s.chunks_transferred,
                    s.dedup_ratio() * 100.0
                ));
            }
        })
    }

    /// Shows the retries of `store`'s operations: on the bar, and with `--json` as events
    /// ([`retry_observer`]).
    pub fn watch_retries(&self, out: &Out, store: &kiln_store::Store) {
        store
            .backend()
            .set_observer(retry_observer(out, self.bar.clone()));
    }

    /// Totals so far.
    pub fn stats(&self) -> TransferStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the bar (call it on failure too, before the error is printed).
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
            *active_bar() = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 17, fault 4: a push waiting on retries showed a bar that only stopped moving; its
    /// message now says what it waits for.
    #[test]
    fn the_bar_says_it_is_waiting_for_a_retry() {
        let bar = ProgressBar::hidden();
        let observe = retry_observer(&Out::new(false), Some(bar.clone())).unwrap();
        observe(&RetryEvent {
            store: "s3://b/p".into(),
            op: "put_if_absent",
            key: "chunks/sha256/ab".into(),
            attempt: 2,
            max_attempts: 6,
            wait_ms: 400,
            elapsed_ms: 2100,
            bound_ms: 300_000,
            error: "timed out".into(),
        });
        assert_eq!(
            bar.message(),
            "waiting: put_if_absent chunks/sha256/ab failed (attempt 2 of 6), retrying in 0.4s"
        );
        // Without a bar and without --json there is nothing beyond the store's warning.
        assert!(retry_observer(&Out::new(false), None).is_none());
    }
}
