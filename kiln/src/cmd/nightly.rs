//! `kiln nightly RECIPE --tag NAME:TAG [--keep N]`: the nightly rebuild of an image
//! ([`kiln_pipeline::nightly`]): rebuild with fresh inputs (the base pulled again, no step
//! served from the build cache), boot once and snapshot, run the recipe's `smoke:` checks in
//! a clone, then promote: `NAME:nightly-YYYYMMDD` (UTC) and the tag, moved by
//! compare-and-swap from what it named when the night started. Prints the report (text, or
//! one `nightly` JSON event with `--json`). Exit codes: 0 promoted; 1 a step or check failed
//! (no tag moved); 4 a compare-and-swap lost: another run of the same night (another node's)
//! promoted first, or the tag already named the night's image (no tag moved), or the tag
//! moved under the night (only the nightly tag was set). Ctrl-C and SIGTERM cancel the
//! night (nothing promoted, the smoke clone stopped).
//!
//! `kiln nightly --rollback --tag NAME:TAG` points the tag back at the previous night
//! ([`kiln_pipeline::nightly::rollback`]).

use std::path::PathBuf;

use anyhow::{Context as _, anyhow};
use kiln_builder::registry::RegistryOptions;
use kiln_pipeline::nightly::{NightlyOutcome, NightlyReport};
use kiln_pipeline::{BuildRequest, ContextSource, NightlyRequest, Recipe, Setup, SnapshotRequest};
use kiln_store::{ManifestDigest, TagRef};
use kiln_vmm::clone::{Serving, default_cache_dir, default_state_dir};
use serde_json::json;

use super::build::Progress;
use super::{CmdResult, Failure, Out, exit};

/// Arguments of `kiln nightly`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The YAML recipe (or Dockerfile: no smoke checks) to rebuild; its folder is the build
    /// context.
    #[arg(required_unless_present = "rollback")]
    recipe: Option<PathBuf>,
    /// The tag promoted, `NAME:TAG` (e.g. `default:latest`).
    #[arg(long)]
    tag: TagRef,
    /// After a promotion, keep only the newest N `NAME:nightly-*` tags (GC collects the rest).
    #[arg(long, value_name = "N")]
    keep: Option<usize>,
    /// Point the tag back at the previous night's image instead of building.
    #[arg(long, conflicts_with_all = ["recipe", "keep"])]
    rollback: bool,
    /// Promote only if the tag names this digest (`absent`: if unset); default: what it
    /// names when the night starts.
    #[arg(long, value_name = "DIGEST|absent")]
    expect: Option<String>,
    /// The night's day, `YYYYMMDD` (default: today, UTC).
    #[arg(long, value_name = "YYYYMMDD")]
    day: Option<String>,
    /// Build argument `NAME=value` (repeatable).
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    build_args: Vec<String>,
    /// Do not mount this host's package download cache on the build's `RUN` steps (as
    /// `kiln build --no-package-cache`).
    #[arg(long = "no-package-cache")]
    no_package_cache: bool,
    /// Also write the report (JSON) to this file.
    #[arg(long = "report-file", value_name = "FILE")]
    report_file: Option<PathBuf>,
    /// The store, a directory or `s3://BUCKET/PREFIX` (as `kiln build --store`).
    #[arg(long, value_name = "DIR")]
    store: Option<String>,
    /// A registry (host[:port]) allowed over plain HTTP; loopback registries always are.
    #[arg(long = "insecure-registry")]
    insecure: Vec<String>,
    #[command(flatten)]
    egress: super::common::EgressArgs,
    /// Guest kernel (uncompressed vmlinux); default `kiln kernel`'s.
    #[arg(long, env = "KILN_KERNEL", value_name = "FILE")]
    kernel: Option<PathBuf>,
    /// Guest initramfs with kiln-guest-init; default `kiln kernel`'s.
    #[arg(long, env = "KILN_INITRAMFS", value_name = "FILE")]
    initramfs: Option<PathBuf>,
    /// Guest RAM of the boot-once VM and the smoke clone, MiB.
    #[arg(long = "memory-mib", default_value_t = 512)]
    memory_mib: u64,
    /// Seconds to wait for the ready check of the boot-once VM.
    #[arg(long = "ready-timeout", default_value_t = 600)]
    ready_timeout: u64,
    /// Seconds one smoke check may take.
    #[arg(long = "check-timeout", default_value_t = 120)]
    check_timeout: u64,
    /// Progress output on stderr (as `kiln build`).
    #[arg(long, value_enum, default_value = "plain")]
    progress: Progress,
}

/// Runs `kiln nightly`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let (store, root) = super::open_store_and_local_dir(out, a.store.as_deref()).await?;
    if a.rollback {
        let (night, d) = kiln_pipeline::nightly::rollback(&store, &a.tag).await?;
        out.event(
            "rolled_back",
            json!({"tag": a.tag.to_string(), "night": night.to_string(), "manifest": d}),
            || format!("{} -> {d} ({night})", a.tag),
        );
        return Ok(());
    }
    let file = a
        .recipe
        .clone()
        .ok_or_else(|| anyhow!("a recipe is needed"))?;
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let mut build = BuildRequest::new(
        Recipe {
            name: file.display().to_string(),
            bytes,
        },
        ContextSource::dir(&dir, Some(&file)).map_err(anyhow::Error::from)?,
    );
    build.package_cache = !a.no_package_cache;
    for b in &a.build_args {
        let (k, v) = b
            .split_once('=')
            .ok_or_else(|| anyhow!("--build-arg {b:?}: expected NAME=value"))?;
        build.build_args.insert(k.to_string(), v.to_string());
    }
    let expect = match a.expect.as_deref() {
        None => None,
        Some("absent") => Some(None),
        Some(d) => Some(Some(
            d.parse::<ManifestDigest>()
                .map_err(|e| anyhow!("--expect {d:?}: {e}"))?,
        )),
    };
    let boot = super::kernel::boot_assets(a.kernel.clone(), a.initramfs.clone())?;
    let config = crate::config::Config::load(&crate::config::Flags::default())?;
    let mut setup = Setup::open(store, &root)
        .await
        .map_err(anyhow::Error::from)?;
    setup.registry = RegistryOptions {
        insecure: a.insecure.clone(),
        ..RegistryOptions::default()
    };
    config.apply_host(&mut setup);
    setup.boot = Some(boot);
    setup.chunk_server = Some(super::start::lazy_server(a.store.as_deref())?);
    setup.addresses = a.egress.addresses()?;
    setup.ca_certs = a.egress.ca_certs()?;
    let req = NightlyRequest {
        build,
        tag: a.tag.clone(),
        expect,
        day: a.day.clone(),
        keep: a.keep,
        snapshot: SnapshotRequest {
            memory_bytes: a.memory_mib << 20,
            ready_timeout: std::time::Duration::from_secs(a.ready_timeout),
        },
        clone_state_dir: default_state_dir(),
        clone_cache_dir: default_cache_dir(),
        clone_serving: Serving::Lazy {
            server: super::start::lazy_server(a.store.as_deref())?,
        },
        check_timeout: std::time::Duration::from_secs(a.check_timeout),
    };
    // Ctrl-C and SIGTERM cancel the night: the build or the checks stop, the smoke clone is
    // stopped, no tag moves.
    let token = req.build.cancel.clone();
    let _signals = tokio::spawn(async move {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return;
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("kiln: cancelling the night");
        token.cancel();
    });
    let events = super::build::printer(a.progress, false);
    let report = kiln_pipeline::nightly(&setup, req, events)
        .await
        .map_err(anyhow::Error::from)?;
    let mut value = serde_json::to_value(&report).map_err(anyhow::Error::from)?;
    // A move: what follows the tag on this host's `kiln serve`, which rebuilds it.
    let follows = match report.outcome {
        NightlyOutcome::Promoted => followers(&a.tag).await,
        _ => None,
    };
    if let (Some((images, workspaces)), Some(o)) = (follows, value.as_object_mut()) {
        o.insert(
            "follows".into(),
            json!({"images": images, "workspaces": workspaces}),
        );
    }
    if let Some(p) = &a.report_file {
        let text = serde_json::to_string_pretty(&value).map_err(anyhow::Error::from)?;
        std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
    }
    out.event("nightly", value, || {
        let mut t = text(&report);
        if let Some((images, workspaces)) = follows {
            t.push_str(&format!(
                "  follows: {images} images in {workspaces} workspaces follow {}; kiln serve \
                 rebuilds them (GET /v1/follows)\n",
                a.tag
            ));
        }
        t
    });
    match &report.outcome {
        NightlyOutcome::Promoted => Ok(()),
        NightlyOutcome::Failed { step, message } => Err(Failure {
            code: exit::FAILURE,
            error: anyhow!("nightly {step} failed; no tag moved: {message}"),
        }),
        NightlyOutcome::LostRace { expected, actual } => Err(Failure {
            code: exit::STALE,
            error: anyhow!(
                "{} moved during the night (expected {}, found {}); not promoted, the night \
                 is kept as {}",
                report.tag,
                show(expected),
                show(actual),
                report.nightly_tag
            ),
        }),
        NightlyOutcome::PromotedByAnotherRun { .. } => Err(Failure {
            code: exit::STALE,
            error: anyhow!("{}; this night moved no tag", another_run(&report)),
        }),
    }
}

/// How many images (and in how many workspaces) follow `tag` in this host's `kiln serve`
/// database (issue 40: they are rebuilt when it moves): its `--database`, or the SQLite file
/// of its state directory when one exists (the configuration `kiln serve` reads). `None`:
/// no server database here, or it could not be read (logged).
async fn followers(tag: &TagRef) -> Option<(u64, u64)> {
    let cfg = crate::config::Config::load(&Default::default()).ok()?;
    let counts = async {
        match super::serve::open_serve_db(&cfg, false).await? {
            Some(db) => Ok(Some(db.follow_counts(&tag.to_string()).await?)),
            None => Ok(None),
        }
    };
    counts
        .await
        .inspect_err(|e: &anyhow::Error| {
            tracing::warn!(error = %e, "reading what follows the tag in kiln serve's database")
        })
        .ok()
        .flatten()
}

/// What a [`NightlyOutcome::PromotedByAnotherRun`] report says happened.
fn another_run(r: &NightlyReport) -> String {
    let NightlyOutcome::PromotedByAnotherRun {
        night,
        night_built,
        tag_names_night,
    } = &r.outcome
    else {
        return String::new();
    };
    if r.previous.is_some() && *night == r.previous && r.previous == r.image {
        return format!(
            "{} already names this night's image {}, promoted by another run",
            r.tag,
            show(night)
        );
    }
    let build = match night_built {
        Some(b) if *night_built == r.built => format!("the same build {b}"),
        Some(b) => format!("another build {b}"),
        None => "its build unknown".to_string(),
    };
    let tag = if *tag_names_night {
        format!("{} names it", r.tag)
    } else {
        format!("{} does not name it", r.tag)
    };
    format!(
        "another run of this night promoted first: {} names {} ({build}), {tag}",
        r.nightly_tag,
        show(night)
    )
}

fn show(d: &Option<ManifestDigest>) -> String {
    d.map_or_else(|| "absent".to_string(), |d| d.to_string())
}

/// The report as text.
fn text(r: &NightlyReport) -> String {
    let mut s = String::new();
    let outcome = match &r.outcome {
        NightlyOutcome::Promoted => format!("promoted {} and {}", r.tag, r.nightly_tag),
        NightlyOutcome::Failed { step, .. } => format!("FAILED at {step}; no tag moved"),
        NightlyOutcome::LostRace { .. } => {
            format!("lost the race for {}; kept as {}", r.tag, r.nightly_tag)
        }
        NightlyOutcome::PromotedByAnotherRun { .. } => {
            format!("{}; no tag moved", another_run(r))
        }
    };
    s.push_str(&format!("nightly {}: {outcome}\n", r.tag));
    s.push_str(&format!("  previous: {}\n", show(&r.previous)));
    s.push_str(&format!("  image:    {}\n", show(&r.image)));
    s.push_str(&format!("  built:    {}\n", show(&r.built)));
    s.push_str(&format!("  snapshot: {}\n", show(&r.snapshot)));
    if let Some(d) = &r.disk {
        s.push_str(&format!(
            "  ext4 chunks: {} new ({} bytes raw, {} stored), {} reused ({} bytes raw), {} \
             bytes of holes\n",
            d.new_chunks,
            d.new_bytes,
            d.new_stored_bytes,
            d.reused_chunks,
            d.reused_bytes,
            d.hole_bytes
        ));
    }
    match (&r.packages, &r.packages_error) {
        (Some(p), _) if p.is_empty() => s.push_str("  packages: none changed\n"),
        (Some(p), _) => {
            s.push_str(&format!(
                "  packages: {} changed, {} added, {} removed\n",
                p.changed.len(),
                p.added.len(),
                p.removed.len()
            ));
            for c in &p.changed {
                s.push_str(&format!("    {} {} -> {}\n", c.name, c.from, c.to));
            }
            for a in &p.added {
                s.push_str(&format!("    + {} {}\n", a.name, a.version));
            }
            for r in &p.removed {
                s.push_str(&format!("    - {} {}\n", r.name, r.version));
            }
        }
        (None, Some(e)) => s.push_str(&format!("  packages: not compared: {e}\n")),
        (None, None) => {}
    }
    if let Some(m) = &r.snapshot_memory {
        s.push_str(&format!(
            "  snapshot memory: {} bytes, {} non-zero, {} stored\n",
            m.memory, m.nonzero, m.stored
        ));
    }
    s.push_str(&format!(
        "  steps: {} run, {} cached\n",
        r.steps_run, r.steps_cached
    ));
    for c in &r.checks {
        s.push_str(&format!(
            "  check {} {}: {} (exit {})\n",
            c.location,
            c.argv.join(" "),
            if c.passed { "ok" } else { "FAILED" },
            c.exit
        ));
    }
    for u in &r.untagged {
        s.push_str(&format!("  untagged {u}\n"));
    }
    let t = &r.times_ms;
    s.push_str(&format!(
        "  times (ms): resolve {}, build {}, publish {}, snapshot {}, smoke {}, total {}",
        t.resolve, t.build, t.publish, t.snapshot, t.smoke, t.total
    ));
    s
}
