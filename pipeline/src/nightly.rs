//! The nightly rebuild of an image: [`nightly`] rebuilds a recipe with fresh inputs, boots
//! it once and snapshots it, smoke-tests a clone with the recipe's `smoke:` checks, and only
//! then promotes it; [`rollback`] points the tag back at the previous night.
//!
//! Steps of one night, in order (the first that fails ends the night and moves no tag):
//! 1. `build`: [`crate::run`] with [`PullPolicy::Always`] (the base is resolved again: a new
//!    digest when upstream moved) and `no_cache` (no step is served from an earlier night's
//!    build cache; the entries are still written). The snapshot is asked for; no tag moves.
//! 2. `smoke`: two clones of the new snapshot ([`kiln_vmm::clone::start_clones_of`]), started
//!    as `kiln start` starts them ([`NightlyRequest::clone_serving`]: lazily); each
//!    check runs in the first, in order, with [`kiln_vmm::exec::exec`] as the image's user
//!    (each at most [`NightlyRequest::check_timeout`]); then the two clones' machine-ids
//!    must differ ([`MACHINE_ID_CHECK`]); both clones are stopped afterwards whatever
//!    happened (a check that failed, timed out, or the request's cancel token).
//! 3. `promote`, two compare-and-swaps, each from what its tag named when the night
//!    started: first `NAME:nightly-YYYYMMDD` (the UTC day) claims the night for the new
//!    image, then the tag moves ([`NightlyRequest::expect`]). A night tag that moved in
//!    between (another run of the same night, e.g. `kiln nightly` fired on several nodes at
//!    once, got there first), or a tag that already names the new image, is
//!    [`NightlyOutcome::PromotedByAnotherRun`]: this night moves no tag. So of the runs of
//!    one night that started together, exactly one promotes, and the night tag and the tag
//!    name the same image. A tag that moved in between (another promotion, e.g. by hand) is
//!    [`NightlyOutcome::LostRace`]: the nightly tag stays (the night's image is kept), the
//!    tag does not move.
//! 4. `keep`: with [`NightlyRequest::keep`], `nightly-*` tags beyond the newest N are
//!    untagged (GC then collects their data).
//!
//! Between the build and the promotion the new image is named by no tag: the build's lease
//! holds it (and everything it names) against GC until the night ends.
//!
//! Whatever the outcome, the report is appended to the tag's reports in the store,
//! `tags/<name>/<tag>~reports` beside its `~history` ([`Store::tag_reports`] reads them).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kiln_builder::base::PullPolicy;
use kiln_recipes::yaml::SmokeCheck;
use kiln_store::{ImageManifest, Manifest, ManifestDigest, Store, StoreError, TagError, TagRef};
use kiln_vmm::clone::{CloneOptions, Serving};
use kiln_vmm::exec::ExecRequest;
use serde::Serialize;

use crate::packages::{self, PackageChanges};
use crate::{
    BuildReport, BuildRequest, ChunkCounts, EventSink, Output, PipelineError, Setup,
    SnapshotRequest,
};

/// Output of one check kept in the report, bytes (the last ones; the match sees at most
/// [`MAX_MATCHED_OUTPUT`]).
pub const MAX_REPORTED_OUTPUT: usize = 4096;
/// Output of one check matched against its pattern, bytes (the first ones).
pub const MAX_MATCHED_OUTPUT: usize = 1 << 20;

/// One night: what to build and which tag it promotes.
#[derive(Debug, Clone)]
pub struct NightlyRequest {
    /// The build: recipe, context, build args. Its pull policy, `no_cache` and output are
    /// replaced (see the module doc).
    pub build: BuildRequest,
    /// The tag promoted, e.g. `default:latest`; the night is also kept as
    /// `NAME:nightly-YYYYMMDD`.
    pub tag: TagRef,
    /// What the tag must hold for the promotion; `None`: what it holds when the night starts
    /// (absent is allowed: the first night creates it).
    pub expect: Option<Option<ManifestDigest>>,
    /// The night's UTC day, `YYYYMMDD`; `None`: today ([`utc_day`]).
    pub day: Option<String>,
    /// Keep only the newest N `nightly-*` tags of the name after a promotion.
    pub keep: Option<usize>,
    /// The boot-once VM.
    pub snapshot: SnapshotRequest,
    /// Where the smoke clone is recorded and its snapshot cached.
    pub clone_state_dir: PathBuf,
    /// Where the smoke clones' snapshot is cached (its chunk server's mount and chunks).
    pub clone_cache_dir: PathBuf,
    /// Where the smoke clones' memory and disk come from: the chunk server that `kiln start`
    /// uses ([`Serving::Lazy`], what `kiln nightly` passes), so that the night checks the
    /// path sandboxes start through.
    pub clone_serving: Serving,
    /// Time one smoke check may take; a check still running then fails the night.
    pub check_timeout: Duration,
}

/// How a night ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum NightlyOutcome {
    /// Every check passed and the tag moved.
    Promoted,
    /// A step failed (or a check did not pass); no tag moved.
    Failed {
        /// `build`, `smoke` or `promote`.
        step: String,
        /// Why, with the failing check's location and output.
        message: String,
    },
    /// The tag no longer held the digest read when the night started: it did not move.
    /// `NAME:nightly-YYYYMMDD` names the night's image.
    LostRace {
        /// The digest expected.
        expected: Option<ManifestDigest>,
        /// What the tag held.
        actual: Option<ManifestDigest>,
    },
    /// Another run of this night promoted first: `NAME:nightly-YYYYMMDD` moved from what it
    /// named when this night started (another node's `kiln nightly` of the same day), or
    /// the tag already named this night's image. This night moved no tag; its image, named
    /// by no tag, is left to GC.
    PromotedByAnotherRun {
        /// What `NAME:nightly-YYYYMMDD` names now: the other run's image (`None`: it was
        /// removed in between).
        night: Option<ManifestDigest>,
        /// The image manifest the other run built and booted (its snapshot's image), when
        /// its image has a snapshot; equal to [`NightlyReport::built`] when both runs built
        /// the same inputs.
        night_built: Option<ManifestDigest>,
        /// Whether the tag names that image, read once the other run's second move (the
        /// tag, after the night's tag) came, or after waiting for it for at most 10 s.
        tag_names_night: bool,
    },
}

/// One smoke check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    /// `file:line` of the check.
    pub location: String,
    /// Its argv.
    pub argv: Vec<String>,
    /// Exit code expected.
    pub expected_exit: i32,
    /// Exit code it ended with (128+N for signal N; 125–127 when it could not run).
    pub exit: i32,
    /// The substring expected, if any.
    pub output_pattern: Option<String>,
    /// Whether it passed.
    pub passed: bool,
    /// stdout and stderr as they arrived, lossy UTF-8, the last [`MAX_REPORTED_OUTPUT`]
    /// bytes.
    pub output: String,
}

/// What a night did: the digests, the chunks it stored, the checks and the outcome.
#[derive(Debug, Clone, Serialize)]
pub struct NightlyReport {
    /// The tag promoted.
    pub tag: String,
    /// `NAME:nightly-YYYYMMDD`.
    pub nightly_tag: String,
    /// What the tag named when the night started (the digest the promotion expects).
    pub previous: Option<ManifestDigest>,
    /// The new image manifest that names the snapshot (what the tags name). Each boot makes
    /// another snapshot, so each run of a night has its own.
    pub image: Option<ManifestDigest>,
    /// The image manifest the build published, before the boot (the one the snapshot booted):
    /// identical inputs give the identical digest on every node and every run.
    pub built: Option<ManifestDigest>,
    /// The snapshot manifest.
    pub snapshot: Option<ManifestDigest>,
    /// The ext4 image's chunks: new to the store vs already there.
    pub disk: Option<ChunkCounts>,
    /// The Debian packages of the new image against the previous one (their dpkg status
    /// files); `None` on the first night, for images without dpkg, or when a status file
    /// could not be read (see [`NightlyReport::packages_error`]).
    pub packages: Option<PackageChanges>,
    /// Why the packages could not be compared, when they could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packages_error: Option<String>,
    /// The snapshot's memory: raw bytes, non-zero bytes and stored (compressed) bytes.
    pub snapshot_memory: Option<SnapshotBytes>,
    /// Steps run and cached.
    pub steps_run: usize,
    /// Steps served from the build cache (0 unless a step has no network input).
    pub steps_cached: usize,
    /// The checks run (up to and including the first failure).
    pub checks: Vec<CheckResult>,
    /// `nightly-*` tags untagged by `keep`.
    pub untagged: Vec<String>,
    /// Phase times, milliseconds.
    pub times_ms: NightlyTimes,
    /// How it ended.
    #[serde(flatten)]
    pub outcome: NightlyOutcome,
}

/// Memory of the snapshot, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SnapshotBytes {
    /// Guest RAM.
    pub memory: u64,
    /// Not holes.
    pub nonzero: u64,
    /// Stored (zstd).
    pub stored: u64,
}

/// Times of a night's phases, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct NightlyTimes {
    /// Resolve the bases.
    pub resolve: u64,
    /// Run the steps.
    pub build: u64,
    /// ext4 image and image manifest.
    pub publish: u64,
    /// Boot once and snapshot.
    pub snapshot: u64,
    /// Start the clone, run the checks, stop it.
    pub smoke: u64,
    /// The whole night.
    pub total: u64,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// The UTC day of `t` as `YYYYMMDD` (the proleptic Gregorian calendar; days from the civil
/// algorithm in Howard Hinnant's "chrono-Compatible Low-Level Date Algorithms").
pub fn utc_day(t: SystemTime) -> String {
    // humantime writes `YYYY-MM-DDTHH:MM:SSZ` for years up to 9999 (its Display fails past
    // them; such a clock is clamped to 9999-12-31).
    let t = t.min(UNIX_EPOCH + Duration::from_secs(kiln_builder::build::config::MAX_UNIX_SECONDS));
    let text = humantime::format_rfc3339_seconds(t).to_string();
    text[..10].replace('-', "")
}

/// Whether `tag` is a nightly tag, `nightly-YYYYMMDD`; returns the day.
pub fn nightly_day(tag: &str) -> Option<&str> {
    let d = tag.strip_prefix("nightly-")?;
    (d.len() == 8 && d.bytes().all(|b| b.is_ascii_digit())).then_some(d)
}

/// Runs one night (see the module doc). Every failure is in the report's outcome, with the
/// step that failed; the error is only for a night that could not start (the tag could not
/// be read, or the recipe's `smoke:` does not parse). The report is kept beside the tag's
/// history ([`Store::append_tag_report`], JSON as [`NightlyReport`] serializes); a report
/// that cannot be kept is a warning, not a failed night.
pub async fn nightly(
    setup: &Setup,
    req: NightlyRequest,
    events: Arc<dyn EventSink>,
) -> Result<NightlyReport, PipelineError> {
    let tag = req.tag.clone();
    let report = night(setup, req, events).await?;
    match serde_json::to_value(&report) {
        Ok(v) => {
            if let Err(e) = setup.store.append_tag_report(&tag, &v).await {
                tracing::warn!(tag = %tag, error = %e, "keeping the nightly report");
            }
        }
        Err(e) => tracing::warn!(error = %e, "serializing the nightly report"),
    }
    Ok(report)
}

async fn night(
    setup: &Setup,
    req: NightlyRequest,
    events: Arc<dyn EventSink>,
) -> Result<NightlyReport, PipelineError> {
    let t0 = Instant::now();
    let checks = kiln_recipes::smoke_checks(&req.build.recipe.name, &req.build.recipe.bytes)
        .map_err(|e| PipelineError::Request(e.to_string()))?;
    let store = &setup.store;
    let previous = match req.expect {
        Some(e) => e,
        None => store
            .get_tag(&req.tag)
            .await
            .map_err(tag_err(&req.tag))?
            .map(|r| r.manifest),
    };
    let day = req
        .day
        .clone()
        .unwrap_or_else(|| utc_day(SystemTime::now()));
    let nightly_tag = TagRef::new(&req.tag.name, &format!("nightly-{day}"))
        .map_err(|e| PipelineError::Request(format!("day {day:?}: {e}")))?;
    // What the promotion's first compare-and-swap expects of the night's tag.
    let night_previous = store
        .get_tag(&nightly_tag)
        .await
        .map_err(tag_err(&nightly_tag))?
        .map(|r| r.manifest);
    let report = NightlyReport {
        tag: req.tag.to_string(),
        nightly_tag: nightly_tag.to_string(),
        previous,
        image: None,
        built: None,
        snapshot: None,
        disk: None,
        packages: None,
        packages_error: None,
        snapshot_memory: None,
        steps_run: 0,
        steps_cached: 0,
        checks: Vec::new(),
        untagged: Vec::new(),
        times_ms: NightlyTimes::default(),
        outcome: NightlyOutcome::Promoted,
    };

    // 1. Build with fresh inputs, boot once, snapshot; no tag.
    let mut build = req.build.clone();
    build.pull = PullPolicy::Always;
    build.no_cache = true;
    build.output = Output::Image {
        tags: Vec::new(),
        snapshot: Some(req.snapshot.clone()),
    };
    let (built, lease): (BuildReport, _) = match crate::run_leased(setup, build, events).await {
        Ok(b) => b,
        Err(e) => return fail(t0, report, "build", error_chain(&e)),
    };
    // The build's lease holds the untagged image until the night is over.
    let r = after_build(
        store,
        &setup.work_dir,
        &req,
        &checks,
        built,
        (nightly_tag, night_previous),
        report,
        t0,
    )
    .await;
    let _ = lease.release().await;
    r
}

/// Smoke, promote, keep: everything after the build.
#[allow(clippy::too_many_arguments)]
async fn after_build(
    store: &Store,
    scratch: &Path,
    req: &NightlyRequest,
    checks: &[SmokeCheck],
    built: BuildReport,
    (nightly_tag, night_previous): (TagRef, Option<ManifestDigest>),
    mut report: NightlyReport,
    t0: Instant,
) -> Result<NightlyReport, PipelineError> {
    let previous = report.previous;
    report.image = built.final_image();
    report.built = built.image.as_ref().map(|i| i.manifest);
    report.snapshot = built.snapshot.as_ref().map(|s| s.snapshot);
    report.disk = built.image.as_ref().map(|i| i.disk);
    report.snapshot_memory = built.snapshot.as_ref().map(|s| SnapshotBytes {
        memory: s.memory_bytes,
        nonzero: s.memory_nonzero_bytes,
        stored: s.memory_stored_bytes,
    });
    report.steps_run = built.steps_run;
    report.steps_cached = built.steps_cached;
    report.times_ms.resolve = ms(built.times.resolve);
    report.times_ms.build = ms(built.times.build);
    report.times_ms.publish = ms(built.times.publish);
    report.times_ms.snapshot = ms(built.times.snapshot);
    let Some(image) = report.image else {
        return fail(t0, report, "build", "the build made no image".into());
    };
    if let Some(prev) = previous {
        match compare_packages(store, &prev, &image, scratch).await {
            Ok(p) => report.packages = p,
            Err(e) => {
                tracing::warn!(error = %e, "comparing the images' packages");
                report.packages_error = Some(e);
            }
        }
    }

    // 2. Smoke checks in one clone.
    let t = Instant::now();
    let smoke = smoke(store, image, req, checks, &mut report.checks).await;
    report.times_ms.smoke = ms(t.elapsed());
    if let Err(message) = smoke {
        return fail(t0, report, "smoke", message);
    }

    // 3. Promote: claim the night, then move the tag.
    let tags = Promotion {
        tag: &req.tag,
        previous,
        night: &nightly_tag,
        night_previous,
    };
    match promote(store, &tags, image).await {
        Ok(NightlyOutcome::Promoted) => {}
        Ok(lost) => {
            report.outcome = lost;
            report.times_ms.total = ms(t0.elapsed());
            return Ok(report);
        }
        Err(e) => return fail(t0, report, "promote", error_chain(&e)),
    }

    // 4. Keep the newest N nights.
    if let Some(n) = req.keep {
        match prune(store, &req.tag.name, n).await {
            Ok(u) => report.untagged = u,
            Err(e) => return fail(t0, report, "keep", error_chain(&e)),
        }
    }
    report.times_ms.total = ms(t0.elapsed());
    Ok(report)
}

/// The two tags a night moves and what each named when it started.
struct Promotion<'a> {
    /// The tag promoted.
    tag: &'a TagRef,
    /// What it named.
    previous: Option<ManifestDigest>,
    /// `NAME:nightly-YYYYMMDD`.
    night: &'a TagRef,
    /// What it named.
    night_previous: Option<ManifestDigest>,
}

/// Step 3 of the module doc for `image`: [`NightlyOutcome::Promoted`] when both tags moved,
/// [`NightlyOutcome::PromotedByAnotherRun`] when the tag named `image` already or the night's
/// tag moved since the night started (neither moved), [`NightlyOutcome::LostRace`] when the
/// tag moved since (the night's tag names `image`). Errors: a tag could not be read or moved
/// ([`PipelineError::Tag`] naming it).
async fn promote(
    store: &Store,
    p: &Promotion<'_>,
    image: ManifestDigest,
) -> Result<NightlyOutcome, PipelineError> {
    if p.previous == Some(image) {
        return Ok(promoted_by_another_run(store, p.tag, Some(image)).await);
    }
    match store.set_tag(p.night, p.night_previous, image).await {
        Ok(()) => {}
        Err(StoreError::Tag(TagError::Stale { actual, .. })) => {
            return Ok(promoted_by_another_run(store, p.tag, actual).await);
        }
        Err(e) => return Err(tag_err(p.night)(e)),
    }
    match store.set_tag(p.tag, p.previous, image).await {
        Ok(()) => Ok(NightlyOutcome::Promoted),
        // Another writer put this very image there meanwhile: it was not this night's move.
        Err(StoreError::Tag(TagError::Stale { actual, .. })) if actual == Some(image) => {
            Ok(promoted_by_another_run(store, p.tag, actual).await)
        }
        Err(StoreError::Tag(TagError::Stale {
            expected, actual, ..
        })) => Ok(NightlyOutcome::LostRace { expected, actual }),
        Err(e) => Err(tag_err(p.tag)(e)),
    }
}

/// How long a run that another one beat waits for the winner's second move (the tag after
/// the night's tag) before it reports whether the tag names the night's image.
const TAG_SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// [`NightlyOutcome::PromotedByAnotherRun`], `night` being what the night's tag names now:
/// reads which image that one booted and whether `tag` names it (a read that fails leaves
/// the field unknown, with a warning: the outcome is decided already).
async fn promoted_by_another_run(
    store: &Store,
    tag: &TagRef,
    night: Option<ManifestDigest>,
) -> NightlyOutcome {
    let mut night_built = None;
    if let Some(d) = night {
        match store.get_manifest(&d).await {
            Ok(Manifest::Image(ImageManifest {
                snapshot: Some(s), ..
            })) => match store.get_manifest(&s).await {
                Ok(Manifest::Snapshot(m)) => night_built = Some(m.image),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(manifest = %s, error = %e, "reading the other run's snapshot")
                }
            },
            Ok(_) => {}
            Err(e) => tracing::warn!(manifest = %d, error = %e, "reading the other run's image"),
        }
    }
    // The other run moves the night's tag, then the tag: read as it settles, for at most
    // TAG_SETTLE (a run that lost between the two moves would otherwise report a tag the
    // winner is about to move).
    let deadline = std::time::Instant::now() + TAG_SETTLE;
    let tag_names_night = loop {
        let names = match store.get_tag(tag).await {
            Ok(rec) => night.is_some() && rec.map(|x| x.manifest) == night,
            Err(e) => {
                tracing::warn!(tag = %tag, error = %e, "reading the tag");
                break false;
            }
        };
        if names || night.is_none() || std::time::Instant::now() >= deadline {
            break names;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    NightlyOutcome::PromotedByAnotherRun {
        night,
        night_built,
        tag_names_night,
    }
}

/// The packages of `new` against `old`; `None` when either has no dpkg status.
async fn compare_packages(
    store: &Store,
    old: &ManifestDigest,
    new: &ManifestDigest,
    scratch: &Path,
) -> Result<Option<PackageChanges>, String> {
    let Some(old) = packages::image_packages(store, old, scratch).await? else {
        return Ok(None);
    };
    let Some(new) = packages::image_packages(store, new, scratch).await? else {
        return Ok(None);
    };
    Ok(Some(packages::diff(&old, &new)))
}

/// `e` from moving or reading the tag `t`.
fn tag_err(t: &TagRef) -> impl FnOnce(StoreError) -> PipelineError {
    let tag = t.to_string();
    move |e| PipelineError::Tag {
        tag,
        source: Box::new(e),
    }
}

/// `r` ended by a failure of `step`.
fn fail(
    t0: Instant,
    mut r: NightlyReport,
    step: &str,
    message: String,
) -> Result<NightlyReport, PipelineError> {
    r.outcome = NightlyOutcome::Failed {
        step: step.to_string(),
        message,
    };
    r.times_ms.total = ms(t0.elapsed());
    Ok(r)
}

/// `e` and its sources, `: `-joined.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = c.source();
    }
    s
}

/// Where the machine-id check reads each clone's identity (systemd's machine-id(5)).
const MACHINE_ID_FILE: &str = "/etc/machine-id";

/// `location` of the built-in check that two clones of one snapshot got different
/// machine-ids (the sandbox spec: a machine's identity is new at its first start).
pub const MACHINE_ID_CHECK: &str = "nightly: machine-id differs between two clones";

/// Starts two clones of `image`, runs `checks` in the first until one fails (recording each
/// in `out`), then checks that the two clones' [`MACHINE_ID_FILE`]s differ (recorded as
/// [`MACHINE_ID_CHECK`]), and stops both clones whatever happened. Errors: the message
/// naming the failure.
async fn smoke(
    store: &Store,
    image: ManifestDigest,
    req: &NightlyRequest,
    checks: &[SmokeCheck],
    out: &mut Vec<CheckResult>,
) -> Result<(), String> {
    let mut opts = CloneOptions::new(
        req.clone_state_dir.clone(),
        req.clone_cache_dir.clone(),
        req.clone_serving.clone(),
    );
    opts.count = 2;
    crate::qemu_cgroups::install();
    let clones = kiln_vmm::clone::start_clones_of(store, image, &req.tag.to_string(), &opts)
        .await
        .map_err(|e| format!("starting two clones: {}", error_chain(&e)))?;
    let ids: Vec<String> = clones.iter().map(|c| c.id.clone()).collect();
    let r = tokio::select! {
        r = async {
            let [first, second] = ids.as_slice() else {
                return Err(format!("starting two clones: {} started", ids.len()));
            };
            run_checks(&req.clone_state_dir, first, checks, req.check_timeout, out).await?;
            machine_ids_differ(&req.clone_state_dir, [first, second], req.check_timeout, out).await
        } => r,
        _ = req.build.cancel.cancelled() => Err("cancelled".to_string()),
    };
    for id in &ids {
        if let Err(e) = kiln_vmm::clone::stop(&req.clone_state_dir, id).await {
            tracing::warn!(id = %id, error = %e, "stopping a smoke clone");
        }
    }
    r
}

/// Runs `argv` in clone `id` with exec's defaults, at most `timeout`; returns its exit code
/// and its output (stdout and stderr as they arrived, the first [`MAX_MATCHED_OUTPUT`]
/// bytes). Errors: the message naming `what`, for a timeout or an exec failure.
async fn run_in(
    state_dir: &Path,
    id: &str,
    argv: &[String],
    timeout: Duration,
    what: &str,
) -> Result<(i32, String), String> {
    let mut output = Vec::new();
    let status = tokio::time::timeout(
        timeout,
        kiln_vmm::exec::exec(
            state_dir,
            id,
            &ExecRequest {
                argv: argv.to_vec(),
                ..ExecRequest::default()
            },
            |_, data| {
                let room = MAX_MATCHED_OUTPUT.saturating_sub(output.len());
                output.extend_from_slice(&data[..data.len().min(room)]);
            },
        ),
    )
    .await
    .map_err(|_| {
        format!(
            "{what} ({}) still running after {} s",
            argv.join(" "),
            timeout.as_secs()
        )
    })?
    .map_err(|e| format!("{what}: exec: {}", error_chain(&e)))?;
    Ok((
        status.exit_code(),
        String::from_utf8_lossy(&output).into_owned(),
    ))
}

/// The last [`MAX_REPORTED_OUTPUT`] bytes of `text`, cut at a character boundary.
fn tail(text: &str) -> String {
    let mut start = text.len().saturating_sub(MAX_REPORTED_OUTPUT);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}

async fn run_checks(
    state_dir: &Path,
    id: &str,
    checks: &[SmokeCheck],
    timeout: Duration,
    out: &mut Vec<CheckResult>,
) -> Result<(), String> {
    for c in checks {
        let (exit, text) = run_in(
            state_dir,
            id,
            &c.argv,
            timeout,
            &format!("smoke check {}", c.location),
        )
        .await?;
        let matched = c.output.as_ref().is_none_or(|p| text.contains(p.as_str()));
        let passed = exit == c.exit && matched;
        let tail = tail(&text);
        out.push(CheckResult {
            location: c.location.clone(),
            argv: c.argv.clone(),
            expected_exit: c.exit,
            exit,
            output_pattern: c.output.clone(),
            passed,
            output: tail.clone(),
        });
        if !passed {
            let why = if exit != c.exit {
                format!("exited {exit}, expected {}", c.exit)
            } else {
                format!(
                    "output does not contain {:?}",
                    c.output.as_deref().unwrap_or("")
                )
            };
            return Err(format!(
                "smoke check {} ({}) failed: {why}; output:\n{tail}",
                c.location,
                c.argv.join(" ")
            ));
        }
    }
    Ok(())
}

/// Reads [`MACHINE_ID_FILE`] in both clones and records [`MACHINE_ID_CHECK`]: it passes when
/// both reads exit 0 with a non-empty id and the ids differ. Errors: the message naming the
/// failure and both outputs.
async fn machine_ids_differ(
    state_dir: &Path,
    ids: [&String; 2],
    timeout: Duration,
    out: &mut Vec<CheckResult>,
) -> Result<(), String> {
    let argv = vec!["cat".to_string(), MACHINE_ID_FILE.to_string()];
    let mut read = Vec::new();
    for id in ids {
        read.push(run_in(state_dir, id, &argv, timeout, MACHINE_ID_CHECK).await?);
    }
    let [(exit_a, a), (exit_b, b)] = [read[0].clone(), read[1].clone()];
    let exit = if exit_a != 0 { exit_a } else { exit_b };
    let output = format!("{}: {}\n{}: {}", ids[0], a.trim(), ids[1], b.trim());
    let passed = exit == 0 && !a.trim().is_empty() && a.trim() != b.trim();
    out.push(CheckResult {
        location: MACHINE_ID_CHECK.to_string(),
        argv: argv.clone(),
        expected_exit: 0,
        exit,
        output_pattern: None,
        passed,
        output: tail(&output),
    });
    if passed {
        Ok(())
    } else if exit != 0 {
        Err(format!(
            "{MACHINE_ID_CHECK}: `cat {MACHINE_ID_FILE}` exited {exit}; output:\n{output}"
        ))
    } else {
        Err(format!(
            "{MACHINE_ID_CHECK}: the clones' ids are empty or equal:\n{output}"
        ))
    }
}

/// The `nightly-*` tags of `name`, newest day first.
async fn nights(store: &Store, name: &str) -> Result<Vec<(TagRef, ManifestDigest)>, StoreError> {
    let mut v: Vec<_> = store
        .list_tags(Some(name))
        .await?
        .into_iter()
        .filter(|(t, _)| nightly_day(&t.tag).is_some())
        .collect();
    v.sort_by(|a, b| b.0.tag.cmp(&a.0.tag));
    Ok(v)
}

/// Untags `name`'s `nightly-*` tags beyond the newest `keep` (each only if it still names
/// what it named when listed). Returns the tags removed.
pub async fn prune(store: &Store, name: &str, keep: usize) -> Result<Vec<String>, StoreError> {
    let mut gone = Vec::new();
    for (t, d) in nights(store, name).await?.into_iter().skip(keep) {
        store.untag(&t, Some(d)).await?;
        gone.push(t.to_string());
    }
    Ok(gone)
}

/// Points `tag` back at the previous night: the newest `nightly-*` tag of its name that
/// names something else than `tag` and is older than the night `tag` names now (any night
/// when `tag` names none). Compare-and-swap from what `tag` names now. Returns the night's
/// tag and its digest. Errors: [`TagError::NotFound`] when there is no such night.
pub async fn rollback(store: &Store, tag: &TagRef) -> Result<(TagRef, ManifestDigest), StoreError> {
    let now = store.get_tag(tag).await?.map(|r| r.manifest);
    let all = nights(store, &tag.name).await?;
    let current_night = all.iter().position(|(_, d)| Some(*d) == now);
    let from = current_night.map_or(0, |i| i + 1);
    let Some((night, d)) = all.into_iter().skip(from).find(|(_, d)| Some(*d) != now) else {
        return Err(TagError::NotFound {
            tag: TagRef::new(&tag.name, "nightly-YYYYMMDD").unwrap_or_else(|_| tag.clone()),
            store: store.url().to_string(),
        }
        .into());
    };
    store.set_tag(tag, now, d).await?;
    Ok((night, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An image manifest in `store` whose disk is `bytes` (each call's bytes differ: as each
    /// run's snapshot does).
    async fn image(store: &Store, dir: &Path, bytes: &[u8]) -> ManifestDigest {
        let f = dir.join("disk");
        std::fs::write(&f, bytes).unwrap();
        let (table, _) = store
            .put_artifact(&f, &kiln_store::artifact::PutArtifactOptions::default())
            .await
            .unwrap();
        store
            .put_manifest(&Manifest::Image(ImageManifest::new(table)))
            .await
            .unwrap()
            .digest
    }

    /// The promotion's compare-and-swaps on a local store: of runs that read the tags at the
    /// same start, the first promotes and the others move nothing; a later run promotes
    /// again; a tag already naming the image is no promotion; a tag moved by someone else
    /// is a lost race that keeps the night's tag.
    #[tokio::test]
    async fn one_run_of_a_night_promotes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s").to_str().unwrap())
            .await
            .unwrap();
        let tag: TagRef = "bb:latest".parse().unwrap();
        let night: TagRef = "bb:nightly-20261204".parse().unwrap();
        let at = |t: &TagRef| {
            let (s, t) = (store.clone(), t.clone());
            async move { s.get_tag(&t).await.unwrap().map(|r| r.manifest) }
        };
        let [a, b, c] = [
            image(&store, dir.path(), b"a").await,
            image(&store, dir.path(), b"b").await,
            image(&store, dir.path(), b"c").await,
        ];
        let start = Promotion {
            tag: &tag,
            previous: None,
            night: &night,
            night_previous: None,
        };
        assert_eq!(
            promote(&store, &start, a).await.unwrap(),
            NightlyOutcome::Promoted
        );
        // Another run that started with `a`'s: nothing moves, it names the winner.
        assert_eq!(
            promote(&store, &start, b).await.unwrap(),
            NightlyOutcome::PromotedByAnotherRun {
                night: Some(a),
                night_built: None,
                tag_names_night: true
            }
        );
        assert_eq!((at(&tag).await, at(&night).await), (Some(a), Some(a)));
        // A run that started after the promotion is a new promotion.
        let after = Promotion {
            previous: Some(a),
            night_previous: Some(a),
            ..start
        };
        assert_eq!(
            promote(&store, &after, c).await.unwrap(),
            NightlyOutcome::Promoted
        );
        assert_eq!((at(&tag).await, at(&night).await), (Some(c), Some(c)));
        // The tag already names the night's image: not this night's promotion.
        let again = Promotion {
            previous: Some(c),
            night_previous: Some(c),
            ..start
        };
        assert!(matches!(
            promote(&store, &again, c).await.unwrap(),
            NightlyOutcome::PromotedByAnotherRun { night: Some(n), .. } if n == c
        ));
        // The tag moved by hand during the night: the night's tag still moves.
        store.set_tag(&tag, Some(c), a).await.unwrap();
        assert_eq!(
            promote(&store, &again, b).await.unwrap(),
            NightlyOutcome::LostRace {
                expected: Some(c),
                actual: Some(a)
            }
        );
        assert_eq!((at(&tag).await, at(&night).await), (Some(a), Some(b)));
    }

    #[test]
    fn utc_days() {
        let at = |s: u64| utc_day(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "19700101");
        assert_eq!(at(86399), "19700101");
        assert_eq!(at(951_782_400), "20000229");
        assert_eq!(at(1_798_761_599), "20261231");
        assert_eq!(at(1_798_761_600), "20270101");
        assert_eq!(nightly_day("nightly-20261201"), Some("20261201"));
        for bad in [
            "nightly-2026120",
            "nightly-2026120x",
            "latest",
            "nightly-202612011",
        ] {
            assert_eq!(nightly_day(bad), None, "{bad}");
        }
    }
}
