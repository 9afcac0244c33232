//! `/metrics` in the Prometheus text exposition format (version 0.0.4): builds by state
//! (from the database), queue depth, a build-duration histogram, bytes uploaded and requests
//! refused with 429 (this process's counts since it started).

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the build-duration histogram's buckets, seconds.
pub const DURATION_BUCKETS: [f64; 10] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0,
];

/// In-process counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Bytes of context received (blob uploads and submission parts).
    pub uploaded_bytes: AtomicU64,
    /// Submissions refused with 429.
    pub throttled: AtomicU64,
    /// Requests refused with 429 because their workspace had its share of requests in
    /// flight (`--max-requests-per-workspace`, [`crate::share`]).
    pub over_share: AtomicU64,
    hist: Mutex<Histogram>,
}

#[derive(Debug, Default)]
struct Histogram {
    /// Per state: bucket counts, sum of seconds, count.
    by_state: std::collections::BTreeMap<String, ([u64; DURATION_BUCKETS.len()], f64, u64)>,
}

impl Metrics {
    /// Records a build that ended in `state` after `d` (claim to end).
    pub fn finished(&self, state: &str, d: Duration) {
        let s = d.as_secs_f64();
        let mut h = self.hist.lock().unwrap_or_else(|p| p.into_inner());
        let e = h.by_state.entry(state.to_string()).or_default();
        for (i, b) in DURATION_BUCKETS.iter().enumerate() {
            if s <= *b {
                e.0[i] += 1;
            }
        }
        e.1 += s;
        e.2 += 1;
    }

    /// Adds uploaded bytes.
    pub fn uploaded(&self, n: u64) {
        self.uploaded_bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// The exposition text, with `by_state` (state → builds) from the database.
    pub fn render(&self, by_state: &[(String, i64)]) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# HELP kiln_builds Builds by state.");
        let _ = writeln!(o, "# TYPE kiln_builds gauge");
        for st in ["queued", "running", "succeeded", "failed", "cancelled"] {
            let n = by_state
                .iter()
                .find(|(s, _)| s == st)
                .map_or(0, |(_, n)| *n);
            let _ = writeln!(o, "kiln_builds{{state=\"{st}\"}} {n}");
        }
        let depth = by_state
            .iter()
            .find(|(s, _)| s == "queued")
            .map_or(0, |(_, n)| *n);
        let _ = writeln!(o, "# HELP kiln_queue_depth Builds waiting for a worker.");
        let _ = writeln!(o, "# TYPE kiln_queue_depth gauge");
        let _ = writeln!(o, "kiln_queue_depth {depth}");
        let _ = writeln!(
            o,
            "# HELP kiln_build_duration_seconds Time from claim to end of a build."
        );
        let _ = writeln!(o, "# TYPE kiln_build_duration_seconds histogram");
        let h = self.hist.lock().unwrap_or_else(|p| p.into_inner());
        for (st, (buckets, sum, count)) in &h.by_state {
            for (i, b) in DURATION_BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    o,
                    "kiln_build_duration_seconds_bucket{{state=\"{st}\",le=\"{b}\"}} {}",
                    buckets[i]
                );
            }
            let _ = writeln!(
                o,
                "kiln_build_duration_seconds_bucket{{state=\"{st}\",le=\"+Inf\"}} {count}"
            );
            let _ = writeln!(o, "kiln_build_duration_seconds_sum{{state=\"{st}\"}} {sum}");
            let _ = writeln!(
                o,
                "kiln_build_duration_seconds_count{{state=\"{st}\"}} {count}"
            );
        }
        let _ = writeln!(
            o,
            "# HELP kiln_uploaded_bytes_total Build context bytes received."
        );
        let _ = writeln!(o, "# TYPE kiln_uploaded_bytes_total counter");
        let _ = writeln!(
            o,
            "kiln_uploaded_bytes_total {}",
            self.uploaded_bytes.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            o,
            "# HELP kiln_submissions_throttled_total Submissions refused with 429."
        );
        let _ = writeln!(o, "# TYPE kiln_submissions_throttled_total counter");
        let _ = writeln!(
            o,
            "kiln_submissions_throttled_total {}",
            self.throttled.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            o,
            "# HELP kiln_requests_over_share_total Requests refused with 429: their workspace \
             had its share of requests in flight."
        );
        let _ = writeln!(o, "# TYPE kiln_requests_over_share_total counter");
        let _ = writeln!(
            o,
            "kiln_requests_over_share_total {}",
            self.over_share.load(Ordering::Relaxed)
        );
        o
    }
}
