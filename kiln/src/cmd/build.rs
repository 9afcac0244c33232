//! `kiln build [CONTEXT] -f FILE -t NAME:TAG...`: builds a Dockerfile or a YAML recipe into
//! the local store (flags named as `docker buildx build` names them): the OCI image, then
//! its checked ext4 image, the kiln image manifest and the tags. The flags become one
//! [`BuildRequest`] for [`kiln_pipeline::run`], the function the HTTP API and the nightly
//! job call too. Prints the image manifest digest as the last line on stdout (with
//! `--oci-only`, the OCI manifest digest); `--iidfile` gets the OCI manifest digest, as
//! buildx writes it. Progress and step logs (the pipeline's [`Event`]s) go to stderr: plain
//! lines, a terminal display, or one JSON object per step event with `--progress rawjson`.
//! With the global `--json`, stdout has only JSON lines: those step events, then a `built`
//! event (image manifest, OCI manifest, snapshot, tags, steps run and cached, `imageReused`:
//! whether an identical earlier image was reused without flattening, and `disk`: the ext4
//! image's new and reused chunks, [`kiln_pipeline::ChunkCounts`]) instead of the digest line.
//!
//! `--snapshot` (kiln's own flag) then boots the image once in a microVM, runs its start
//! command until its ready check passes and stores the snapshot
//! ([`kiln_vmm::snapshot::snapshot_manifest`]); the tags then name the image manifest that
//! names the snapshot, so `kiln start NAME:TAG` works at once. A failed boot or ready check
//! fails the build and moves no tag (the image stays in the store, untagged, for GC).
//!
//! Ctrl-C and SIGTERM cancel the build: the running step is killed, nothing is tagged, no
//! mount or process is left.

use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, bail};
use kiln_builder::base::PullPolicy;
use kiln_builder::registry::RegistryOptions;
use kiln_pipeline::event::why_text;
use kiln_pipeline::{
    BuildRequest, ContextSource, Event, EventSink, Executor, NetworkPolicy, Output, Recipe, Setup,
    SnapshotRequest, TagMove,
};
use serde_json::json;

/// `--progress` values (buildx's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Progress {
    /// `tty` on a terminal, else `plain`.
    Auto,
    /// One spinner per running step with its last log line; finished steps stay as lines.
    Tty,
    /// One line per step and per log line.
    Plain,
    /// One JSON object per event and line.
    Rawjson,
}

/// `--isolation` values: what runs the `RUN` steps ([`Executor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Isolation {
    /// Host namespaces (the default; for trusted recipes).
    Namespace,
    /// A microVM per step.
    Vm,
}

/// Arguments of `kiln build`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The build context directory (default: `.`; for a YAML recipe given with `-f`, the
    /// recipe's folder).
    pub context: Option<PathBuf>,
    /// The Dockerfile or YAML recipe (`*.yaml`, `*.yml`); default `CONTEXT/Dockerfile`.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Name and tag for the image, `name:tag` (repeatable). Each moves by compare-and-swap
    /// against what it named when the build started: a build that another writer overtook
    /// moves none of them and exits 4, naming the tag, the expected and the found digest.
    #[arg(short = 't', long = "tag")]
    pub tags: Vec<String>,
    /// Build argument `NAME=value`; `NAME` alone takes the value from the environment.
    /// `SOURCE_DATE_EPOCH` (Unix seconds) sets the build's timestamps; as with `docker buildx
    /// build`, a `SOURCE_DATE_EPOCH` set (not empty) in the environment is taken as
    /// `--build-arg SOURCE_DATE_EPOCH` unless this flag gives one.
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    pub build_args: Vec<String>,
    /// Stage to build (name or index); default the last.
    #[arg(long)]
    pub target: Option<String>,
    /// Do not use the build cache.
    #[arg(long = "no-cache")]
    pub no_cache: bool,
    /// Do not use the build cache for these stages (name or index, repeatable).
    #[arg(long = "no-cache-filter", value_delimiter = ',')]
    pub no_cache_filter: Vec<String>,
    /// Do not mount this host's package download cache (`<cache>/packages`) on the `RUN`
    /// steps' apt, pip and npm download directories; they stay out of the layers either way.
    #[arg(long = "no-package-cache")]
    pub no_package_cache: bool,
    /// Target platform, `os/arch[/variant]` (default linux/amd64).
    #[arg(long)]
    pub platform: Option<String>,
    /// Progress output on stderr.
    #[arg(long, value_enum, default_value = "auto")]
    pub progress: Progress,
    /// Never contact a registry: bases must be in the local store.
    #[arg(long, conflicts_with = "pull")]
    pub offline: bool,
    /// Always ask the registry for newer base images.
    #[arg(long)]
    pub pull: bool,
    /// The store: a directory, `file://PATH` or `s3://BUCKET/PREFIX` (default: $KILN_STORE,
    /// else the config file's `store`, else ~/.local/share/kiln/store). With S3, layers are
    /// kept as files in this host's cache (`<cache>/stores/…`) and the chunks read back in
    /// `<cache>/chunks` (at most `cache_max_mib`).
    #[arg(long, value_name = "DIR")]
    pub store: Option<String>,
    /// Sandbox disk size in MiB (overrides `LABEL kiln.disk-mib` / `disk_mib:`).
    #[arg(long = "disk-mib", value_name = "MIB")]
    pub disk_mib: Option<u64>,
    /// Stages built at once.
    #[arg(long, default_value_t = 2)]
    pub jobs: usize,
    /// Write the image (OCI manifest) digest to this file.
    #[arg(long)]
    pub iidfile: Option<PathBuf>,
    /// Write build metadata (JSON, buildx's keys) to this file.
    #[arg(long = "metadata-file")]
    pub metadata_file: Option<PathBuf>,
    /// Extra privileges (repeatable): `network.host` allows `RUN --network=host`,
    /// `security.insecure` allows `RUN --security=insecure` (every capability, no seccomp
    /// filter).
    #[arg(long = "allow", value_name = "ENTITLEMENT")]
    pub allow: Vec<String>,
    /// The network of every `RUN` step, over the recipe's (`docker build --network`):
    /// `default` keeps what each step asks for, `none` gives no step any network, `host`
    /// runs every step that asks for the default network in the host's network namespace
    /// (needs `--allow network.host`; `none` steps keep none).
    #[arg(long, value_name = "MODE", value_parser = ["default", "none", "host"])]
    pub network: Option<String>,
    /// An allow-list for every step with the default network (repeatable): a domain,
    /// `*.domain`, an address or a CIDR range; the steps reach only these, through the
    /// egress proxy (README, "Network of build steps").
    #[arg(long = "network-allow", value_name = "ENTRY")]
    pub network_allow: Vec<String>,
    /// A deny entry of the allow-list (repeatable; wins over every allow entry).
    #[arg(
        long = "network-deny",
        value_name = "ENTRY",
        requires = "network_allow"
    )]
    pub network_deny: Vec<String>,
    /// A secret for `RUN --mount=type=secret`: `id=ID,src=PATH` or `id=ID,env=VAR`.
    #[arg(long)]
    pub secret: Vec<String>,
    /// An SSH agent for `RUN --mount=type=ssh` (repeatable, buildx's spelling): `default`
    /// ($SSH_AUTH_SOCK), `ID` ($SSH_AUTH_SOCK as ID) or `ID=SOCKET`.
    #[arg(long, value_name = "default|ID[=SOCKET]")]
    pub ssh: Vec<String>,
    /// A named context: `NAME=oci-layout://DIR[:TAG]` (a FROM of NAME uses it).
    #[arg(long = "build-context")]
    pub build_context: Vec<String>,
    /// A registry (host[:port]) allowed over plain HTTP; loopback registries always are.
    #[arg(long = "insecure-registry")]
    pub insecure: Vec<String>,
    #[command(flatten)]
    pub egress: super::common::EgressArgs,
    #[command(flatten)]
    pub cache_disks: super::common::CacheDiskArgs,
    /// Stop at the OCI image: no ext4 image, no kiln image manifest; `-t` names become
    /// local OCI references (what `kiln pull` makes) instead of store tags.
    #[arg(long = "oci-only")]
    pub oci_only: bool,
    /// Scratch and layer directories (default: STORE/.build).
    #[arg(long = "work-dir", env = "KILN_BUILD_DIR")]
    pub work_dir: Option<PathBuf>,
    /// After publishing, boot the image once, run its start command until ready and store
    /// the snapshot; `-t` tags then name the image with its snapshot (for `kiln start`).
    #[arg(long, conflicts_with = "oci_only")]
    pub snapshot: bool,
    /// What runs the `RUN` steps: `namespace` (host namespaces, for trusted recipes) or
    /// `vm` (each step in a microVM of its own, on the guest kernel and initramfs below).
    #[arg(long, value_enum, default_value_t = Isolation::Namespace)]
    pub isolation: Isolation,
    /// With `--snapshot` or `--isolation vm`: guest kernel (uncompressed vmlinux); default
    /// `kiln kernel`'s.
    #[arg(long, env = "KILN_KERNEL", value_name = "FILE")]
    pub kernel: Option<PathBuf>,
    /// With `--snapshot` or `--isolation vm`: guest initramfs with kiln-guest-init; default
    /// `kiln kernel`'s.
    #[arg(long, env = "KILN_INITRAMFS", value_name = "FILE")]
    pub initramfs: Option<PathBuf>,
    /// With `--snapshot`: guest RAM, MiB.
    #[arg(long = "memory-mib", default_value_t = 512)]
    pub memory_mib: u64,
    /// With `--snapshot`: vCPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// With `--snapshot`: seconds to wait for the ready check (after the guest's hello).
    #[arg(long = "ready-timeout", default_value_t = 600)]
    pub ready_timeout: u64,
}

/// Context directory and recipe file from the arguments.
fn locate(a: &Args) -> (PathBuf, PathBuf) {
    match (&a.context, &a.file) {
        (Some(c), Some(f)) => (c.clone(), f.clone()),
        (Some(c), None) => (c.clone(), c.join("Dockerfile")),
        (None, Some(f)) => {
            let yaml = kiln_recipes::RecipeFormat::for_path(&f.to_string_lossy())
                == kiln_recipes::RecipeFormat::Yaml;
            let dir = match f.parent() {
                Some(p) if yaml && !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            (dir, f.clone())
        }
        (None, None) => (PathBuf::from("."), PathBuf::from("Dockerfile")),
    }
}

/// The build's display for `--progress`: pipeline events as buildx-like lines on stderr;
/// with the global `--json` (`json`), every step event is a JSON line on stdout instead (the
/// `--progress rawjson` objects), whatever `--progress` says.
pub(crate) fn printer(progress: Progress, json: bool) -> Arc<dyn EventSink> {
    let mode = match progress {
        Progress::Auto if std::io::stderr().is_terminal() => Progress::Tty,
        Progress::Auto => Progress::Plain,
        p => p,
    };
    if mode == Progress::Tty && !json {
        return tty_printer();
    }
    Arc::new(move |ev: Event| {
        if let Some(line) = phase_line(&ev) {
            eprintln!("{line}");
            return;
        }
        if json || mode == Progress::Rawjson {
            let v = match &ev {
                Event::StepStarted {
                    step,
                    stage,
                    location,
                    instruction,
                    executor,
                    why,
                } => json!({"event": "step", "step": step, "stage": stage,
                    "location": location, "instruction": instruction,
                    "cached": false, "executor": executor, "why": why,
                    "whyText": why_text(why)}),
                Event::CacheHit {
                    step,
                    stage,
                    location,
                    instruction,
                } => json!({"event": "step", "step": step, "stage": stage,
                    "location": location, "instruction": instruction,
                    "cached": true}),
                Event::Log { step, text } => json!({"event": "log", "step": step, "text": text}),
                Event::StepDone { step, layer, size } => {
                    json!({"event": "layer", "step": step, "digest": layer, "size": size})
                }
                _ => return,
            };
            if json {
                println!("{v}");
            } else {
                eprintln!("{v}");
            }
            return;
        }
        match ev {
            Event::StepStarted {
                step,
                stage,
                location,
                instruction,
                why,
                ..
            } => {
                eprintln!("#{step} [stage {stage}] {location} {instruction}");
                if let Some(w) = why_text(&why) {
                    eprintln!("step {step} ran: {w}");
                }
            }
            Event::CacheHit {
                step,
                stage,
                location,
                instruction,
            } => eprintln!("#{step} [stage {stage}] {location} {instruction} CACHED"),
            Event::Log { step, text } => eprintln!("#{step} {text}"),
            Event::StepDone { step, layer, size } => {
                eprintln!("#{step} layer {layer} ({size} bytes)")
            }
            _ => {}
        }
    })
}

/// The line printed, in every progress mode, for an event that is not about one step:
/// warnings, the start and the end of publishing, the start of the boot, the stored
/// snapshot.
fn phase_line(ev: &Event) -> Option<String> {
    Some(match ev {
        Event::Warning {
            location: Some(l),
            message,
        } => format!("warning: {l}: {message}"),
        Event::Warning {
            location: None,
            message,
        } => format!("warning: {message}"),
        Event::Publishing => "publishing: ext4 image, image manifest, tags".to_string(),
        Event::Published {
            image,
            disk,
            reused,
            ..
        } => published_line(*image, *disk, *reused),
        Event::Booting { image } => {
            format!("snapshot: booting {image} once, waiting for its ready check")
        }
        Event::SnapshotStored {
            snapshot,
            accel,
            boot_to_ready_ms,
            save_ms,
            memory_bytes,
            memory_stored_bytes,
            ..
        } => format!(
            "snapshot {snapshot} ({accel}: ready in {boot_to_ready_ms} ms, saved in {save_ms} ms; \
             memory {} MiB stored as {} KiB)",
            memory_bytes >> 20,
            memory_stored_bytes >> 10
        ),
        _ => return None,
    })
}

/// The line saying what publishing stored, or that it reused an identical image.
fn published_line(
    image: kiln_store::ManifestDigest,
    disk: kiln_pipeline::ChunkCounts,
    reused: bool,
) -> String {
    if reused {
        format!(
            "published {image}: reused (an identical image, all {} chunks present; not flattened)",
            disk.reused_chunks
        )
    } else {
        format!(
            "published {image}: {} new chunks ({} KiB stored), {} reused",
            disk.new_chunks,
            disk.new_stored_bytes >> 10,
            disk.reused_chunks
        )
    }
}

/// The build's [`NetworkPolicy`] from `--network`, `--network-allow`/`--network-deny` and
/// `--allow network.host`. Errors: modes that contradict each other, `--network host`
/// without the entitlement (as BuildKit: `--allow network.host`), a bad list entry.
fn network_policy(a: &Args) -> anyhow::Result<NetworkPolicy> {
    let host = a.allow.iter().any(|e| e == "network.host");
    let listed = !a.network_allow.is_empty();
    match a.network.as_deref() {
        Some("host") if listed => bail!("--network host and --network-allow contradict each other"),
        Some("host") if !host => {
            bail!("--network host needs the network.host entitlement (--allow network.host)")
        }
        Some("host") => return Ok(NetworkPolicy::Host),
        Some("none") if listed => bail!("--network none and --network-allow contradict each other"),
        Some("none") if host => {
            bail!("--network none and --allow network.host contradict each other")
        }
        Some("none") => return Ok(NetworkPolicy::None),
        _ => {}
    }
    if listed {
        if host {
            bail!("--network-allow and --allow network.host contradict each other");
        }
        return NetworkPolicy::allow_list(&a.network_allow, &a.network_deny)
            .map_err(|m| anyhow::anyhow!("--network-{m}"));
    }
    Ok(if host {
        NetworkPolicy::AllowHost
    } else {
        NetworkPolicy::Sandboxed
    })
}

/// `kiln build` as a user other than root: refuses what needs host root, with the
/// capability it needs, then runs the build again as root of a user namespace mapped to
/// the user's subordinate ids ([`kiln_builder::exec::rootless`]) and returns its exit code.
pub fn run_without_root(a: &Args) -> anyhow::Result<u8> {
    let needs = |what: &str, why: &str| {
        anyhow::anyhow!(
            "{what} needs host root ({why}); a build without root runs in a user namespace. \
             Run it as root, or leave {what} out"
        )
    };
    if a.isolation == Isolation::Vm {
        return Err(needs(
            "--isolation vm",
            "each QEMU runs jailed with a uid and a cgroup of its own: CAP_SETUID and \
             CAP_SYS_ADMIN on the host",
        ));
    }
    if a.snapshot {
        return Err(needs(
            "--snapshot",
            "the boot-once QEMU runs jailed with a uid and a cgroup of its own: CAP_SETUID \
             and CAP_SYS_ADMIN on the host",
        ));
    }
    for e in &a.allow {
        match e.as_str() {
            "network.host" => {
                return Err(needs(
                    "--allow network.host",
                    "a step in the host's network namespace has no CAP_NET_ADMIN or \
                     CAP_NET_RAW there",
                ));
            }
            "security.insecure" => {
                return Err(needs(
                    "--allow security.insecure",
                    "the host's devices and every capability on the host",
                ));
            }
            _ => {}
        }
    }
    Ok(kiln_builder::exec::rootless::reexec()?)
}

/// Runs `kiln build`: flags → [`BuildRequest`] → [`kiln_pipeline::run`] → the digest on
/// stdout (or the `built` event with `--json`), `--iidfile`, `--metadata-file` and a summary line on stderr.
pub fn run(a: Args, cli: &super::Out) -> anyhow::Result<()> {
    let ssh = super::flags::parse_ssh_flags(&a.ssh, std::env::var_os("SSH_AUTH_SOCK").as_deref())?;
    let specs = a
        .secret
        .iter()
        .map(|f| super::flags::parse_secret_flag(f))
        .collect::<Result<Vec<_>, _>>()?;
    let secrets = kiln_builder::secrets::Secrets::load(&specs)?;
    for e in &a.allow {
        if e != "network.host" && e != "security.insecure" {
            bail!("--allow {e:?}: the entitlements are network.host and security.insecure");
        }
    }
    let (context, file) = locate(&a);
    let context = ContextSource::dir(&context, Some(&file))?;
    let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let output = if a.oci_only {
        let refs = a
            .tags
            .iter()
            .map(|t| {
                t.parse()
                    .with_context(|| format!("-t {t}: not a valid name:tag"))
            })
            .collect::<anyhow::Result<_>>()?;
        Output::Oci { refs }
    } else {
        let tags = a
            .tags
            .iter()
            .map(|t| {
                t.parse()
                    .map(TagMove::at_start)
                    .with_context(|| format!("-t {t}: not a valid store tag (name:tag)"))
            })
            .collect::<anyhow::Result<_>>()?;
        let snapshot = a.snapshot.then(|| SnapshotRequest {
            memory_bytes: a.memory_mib << 20,
            ready_timeout: std::time::Duration::from_secs(a.ready_timeout),
        });
        Output::Image { tags, snapshot }
    };

    // The guest kernel and initramfs first: a missing guest init fails before the build.
    let boot = if a.snapshot || a.isolation == Isolation::Vm {
        Some(super::kernel::boot_assets(
            a.kernel.clone(),
            a.initramfs.clone(),
        )?)
    } else {
        None
    };
    let config = crate::config::Config::load(&crate::config::Flags::default())?;
    let mut req = BuildRequest::new(
        Recipe {
            name: file.display().to_string(),
            bytes,
        },
        context,
    );
    req.build_args = super::flags::parse_build_args(&a.build_args, |n| std::env::var(n).ok());
    req.target = a.target.clone();
    req.platform = a.platform.clone();
    req.disk_mib = a.disk_mib;
    req.pull = if a.offline {
        PullPolicy::Never
    } else if a.pull {
        PullPolicy::Always
    } else {
        PullPolicy::Missing
    };
    for bc in &a.build_context {
        let (n, v) = super::flags::parse_build_context(bc)?;
        req.build_contexts.insert(n, v);
    }
    req.no_cache = a.no_cache;
    req.no_cache_filter = a.no_cache_filter.clone();
    req.package_cache = !a.no_package_cache;
    req.secrets = secrets;
    req.network = network_policy(&a)?;
    req.limits.vcpus = Some(a.vcpus);
    req.executor = match a.isolation {
        Isolation::Namespace => Executor::Namespace,
        Isolation::Vm => Executor::Vm,
    };
    req.output = output;
    req.ca_certs = a.egress.ca_certs()?;
    req.allow_insecure = a.allow.iter().any(|e| e == "security.insecure");
    req.ssh = Some(ssh);
    let cancel = req.cancel.clone();
    let events = printer(a.progress, cli.json);

    let rt = super::common::runtime()?;
    let report = rt.block_on(async {
        // Ctrl-C and SIGTERM cancel the build.
        let token = cancel.clone();
        tokio::spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(_) => return,
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("kiln: cancelling the build");
            token.cancel();
        });
        let (store, local) = super::open_store_and_local_dir(cli, a.store.as_deref())
            .await
            .map_err(|f| f.error)?;
        let mut setup = Setup::open(store, &local).await?;
        if let Some(w) = &a.work_dir {
            setup.work_dir = w.clone();
        }
        setup.registry = RegistryOptions {
            insecure: a.insecure.clone(),
            ..RegistryOptions::default()
        };
        config.apply_host(&mut setup);
        setup.boot = boot;
        setup.chunk_server = Some(super::start::lazy_server(a.store.as_deref())?);
        setup.jobs = a.jobs.max(1);
        setup.addresses = a.egress.addresses()?;
        a.cache_disks.apply(&mut setup);
        anyhow::Ok(kiln_pipeline::run(&setup, req, events).await?)
    })?;
    let digest = &report.oci_manifest.digest.to_string();
    let published = report.image.as_ref().map(|i| i.manifest);
    let last = report
        .final_image()
        .map(|d| d.to_string())
        .unwrap_or_else(|| digest.clone());
    if let Some(p) = &a.iidfile {
        write_file(p, digest.as_bytes())?;
    }
    if let Some(p) = &a.metadata_file {
        let meta = json!({
            "containerimage.digest": digest,
            "containerimage.config.digest": report.config.digest,
            "containerimage.descriptor": report.oci_manifest,
            "image.name": report.tags.join(","),
            "kiln.image.manifest": report.final_image().map(|d| d.to_string()),
            "kiln.snapshot": report.snapshot.as_ref().map(|s| s.snapshot.to_string()),
            "kiln.recipe.digest": report.recipe_digest,
            "kiln.steps.run": report.steps_run,
            "kiln.steps.cached": report.steps_cached,
        });
        write_file(p, serde_json::to_string_pretty(&meta)?.as_bytes())?;
    }
    let oci_note = if published.is_some() {
        format!(" (OCI manifest {digest})")
    } else {
        String::new()
    };
    eprintln!(
        "built {last}{oci_note}: {} steps run, {} cached{}",
        report.steps_run,
        report.steps_cached,
        if report.tags.is_empty() {
            String::new()
        } else {
            format!(", tagged {}", report.tags.join(", "))
        }
    );
    cli.event(
        "built",
        json!({
            "manifest": published.as_ref().map(|d| d.to_string()),
            "ociManifest": digest,
            "snapshot": report.snapshot.as_ref().map(|s| s.snapshot.to_string()),
            "tags": report.tags, "stepsRun": report.steps_run, "stepsCached": report.steps_cached,
            "imageReused": report.image.as_ref().map(|i| i.reused),
            "disk": report.image.as_ref().map(|i| i.disk),
        }),
        || last.clone(),
    );
    Ok(())
}

fn write_file(p: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(p, bytes).with_context(|| format!("writing {}", p.display()))
}

/// The terminal display: an indicatif spinner per running step (its `file:line`, the
/// instruction and its last log line), turned into a plain line when the step ends; while
/// publishing, one spinner with the ext4 chunks stored so far.
fn tty_printer() -> Arc<dyn EventSink> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    use kiln_store::progress::TransferStats;
    use std::collections::HashMap;
    use std::sync::Mutex;
    /// The spinners shown.
    #[derive(Default)]
    struct Bars {
        steps: HashMap<usize, ProgressBar>,
        publish: Option<(ProgressBar, TransferStats)>,
    }
    let multi = MultiProgress::new();
    // The template is a constant that parses; fall back to the default style anyway.
    let style = ProgressStyle::with_template("{spinner} {prefix} {elapsed} {wide_msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let bars: Mutex<Bars> = Mutex::default();
    let spinner = move |multi: &MultiProgress, prefix: String| {
        let b = multi.add(ProgressBar::new_spinner());
        b.set_style(style.clone());
        b.set_prefix(prefix);
        b.enable_steady_tick(std::time::Duration::from_millis(120));
        b
    };
    Arc::new(move |ev: Event| {
        // A poisoned lock only means another event panicked; drawing is best effort.
        let Ok(mut bars) = bars.lock() else { return };
        if let Some(line) = phase_line(&ev) {
            let _ = multi.println(line);
        }
        match ev {
            Event::StepStarted {
                step,
                stage,
                location,
                instruction,
                why,
                ..
            } => {
                let _ = multi.println(format!("#{step} [stage {stage}] {location} {instruction}"));
                if let Some(w) = why_text(&why) {
                    let _ = multi.println(format!("step {step} ran: {w}"));
                }
                bars.steps.insert(step, spinner(&multi, format!("#{step}")));
            }
            Event::CacheHit {
                step,
                stage,
                location,
                instruction,
            } => {
                let _ = multi.println(format!(
                    "#{step} [stage {stage}] {location} {instruction} CACHED"
                ));
            }
            Event::Log { step, text } => match bars.steps.get(&step) {
                Some(b) => b.set_message(text),
                None => {
                    let _ = multi.println(format!("#{step} {text}"));
                }
            },
            Event::StepDone { step, layer, size } => {
                if let Some(b) = bars.steps.remove(&step) {
                    b.finish_and_clear();
                }
                let _ = multi.println(format!("#{step} done: layer {layer} ({size} bytes)"));
            }
            Event::Publishing => {
                bars.publish = Some((
                    spinner(&multi, "ext4".to_string()),
                    TransferStats::default(),
                ));
            }
            Event::Progress { progress } => {
                if let Some((b, stats)) = &mut bars.publish {
                    stats.record(&progress);
                    b.set_message(format!(
                        "{} chunks ({} new), {} MiB",
                        stats.chunks,
                        stats.chunks_transferred,
                        (stats.raw_bytes + stats.hole_bytes) >> 20
                    ));
                }
            }
            // Its line is `phase_line`'s, printed above.
            Event::Published { .. } => {
                if let Some((b, _)) = bars.publish.take() {
                    b.finish_and_clear();
                }
            }
            _ => {}
        }
    })
}
