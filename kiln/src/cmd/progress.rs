//! Progress of a transfer (push, pull, import, export), from the store's
//! [`ProgressEvent`]s: with `--json`, each event as one JSON line on stdout; on a terminal, an
//! indicatif bar on stderr showing bytes (raw) done of the total, chunks, and the dedup ratio
//! (share of chunk bytes already present at the destination); otherwise nothing.

use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln_store::progress::{ProgressEvent, ProgressFn, TransferStats};

use super::Out;

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

    /// Totals so far.
    pub fn stats(&self) -> TransferStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
