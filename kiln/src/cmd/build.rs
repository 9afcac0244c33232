//! `kiln build [CONTEXT] -f FILE -t NAME:TAG...`: builds a Dockerfile or a YAML recipe into
//! the local store (flags named as `docker buildx build` names them): the OCI image, then
//! its checked ext4 image, the kiln image manifest and the tags
//! ([`kiln_builder::publish::publish`]). Prints the image manifest digest as the last line
//! on stdout (with `--oci-only`, the OCI manifest digest); `--iidfile` gets the OCI
//! manifest digest, as buildx writes it. Progress and step logs go to stderr:
//! plain lines, or one JSON object per line with `--progress rawjson`. With the global
//! `--json`, stdout has only JSON lines: those events, then a `built` event (image manifest,
//! OCI manifest, snapshot, tags, steps run and cached) instead of the digest line.
//!
//! `--snapshot` (kiln's own flag) then boots the image once in a microVM, runs its start
//! command until its ready check passes and stores the snapshot
//! ([`kiln_vmm::snapshot::snapshot_manifest`]); the tags then name the image manifest that
//! names the snapshot, so `kiln start NAME:TAG` works at once. A failed boot or ready check
//! fails the build and moves no tag (the image stays in the store, untagged, for GC).
//!
//! Ctrl-C and SIGTERM cancel the build: the running step is killed, nothing is tagged, no
//! mount or process is left.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::{Context as _, bail};
use kiln_builder::base::PullPolicy;
use kiln_builder::build::{BuildEvent, BuildOptions, build};
use kiln_builder::cache::{BlobCache as _, LocalCache};
use kiln_builder::registry::RegistryOptions;
use kiln_builder::resolve::{ResolveOptions, parse_build_context};
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

/// Arguments of `kiln build`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The build context directory (default: `.`; for a YAML recipe given with `-f`, the
    /// recipe's folder).
    pub context: Option<PathBuf>,
    /// The Dockerfile or YAML recipe (`*.yaml`, `*.yml`); default `CONTEXT/Dockerfile`.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Name and tag for the image, `name:tag` (repeatable).
    #[arg(short = 't', long = "tag")]
    pub tags: Vec<String>,
    /// Build argument `NAME=value`; `NAME` alone takes the value from the environment.
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
    /// The local store directory or `file://PATH` (default: $KILN_STORE, else the config
    /// file's `store`, else ~/.local/share/kiln/store). An S3 store is refused: a build
    /// writes into a local store; `kiln store push` copies it to S3.
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
    /// Extra privileges: `network.host` allows `RUN --network=host`.
    #[arg(long = "allow")]
    pub allow: Vec<String>,
    /// A secret for `RUN --mount=type=secret`: `id=ID,src=PATH` or `id=ID,env=VAR`.
    #[arg(long)]
    pub secret: Vec<String>,
    /// SSH agent forwarding: refused (not supported).
    #[arg(long)]
    pub ssh: Vec<String>,
    /// A named context: `NAME=oci-layout://DIR[:TAG]` (a FROM of NAME uses it).
    #[arg(long = "build-context")]
    pub build_context: Vec<String>,
    /// A registry (host[:port]) allowed over plain HTTP; loopback registries always are.
    #[arg(long = "insecure-registry")]
    pub insecure: Vec<String>,
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
    /// With `--snapshot`: guest kernel (uncompressed vmlinux); default `kiln kernel`'s.
    #[arg(long, env = "KILN_KERNEL", value_name = "FILE")]
    pub kernel: Option<PathBuf>,
    /// With `--snapshot`: guest initramfs with kiln-guest-init; default `kiln kernel`'s.
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

/// Parses `--build-arg` values as `docker build` does.
fn build_args(args: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for a in args {
        match a.split_once('=') {
            Some((k, v)) => {
                out.insert(k.to_string(), v.to_string());
            }
            None => {
                if let Ok(v) = std::env::var(a) {
                    out.insert(a.clone(), v);
                }
            }
        }
    }
    out
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

/// The progress printer; with the global `--json` (`json`), every event is a JSON line on
/// stdout instead (the `--progress rawjson` objects), whatever `--progress` says.
fn printer(progress: Progress, json: bool) -> Arc<dyn Fn(BuildEvent) + Send + Sync> {
    let mode = match progress {
        Progress::Auto if std::io::stderr().is_terminal() => Progress::Tty,
        Progress::Auto => Progress::Plain,
        p => p,
    };
    if mode == Progress::Tty && !json {
        return tty_printer();
    }
    Arc::new(move |ev: BuildEvent| {
        if json || mode == Progress::Rawjson {
            let v = match &ev {
                BuildEvent::Step {
                    index,
                    stage,
                    location,
                    instruction,
                    cached,
                } => json!({"event": "step", "step": index, "stage": stage,
                    "location": location, "instruction": instruction, "cached": cached}),
                BuildEvent::Log(l) => json!({"event": "log", "step": l.step, "text": l.text}),
                BuildEvent::Layer {
                    index,
                    digest,
                    size,
                } => json!({"event": "layer", "step": index, "digest": digest, "size": size}),
            };
            if json {
                println!("{v}");
            } else {
                eprintln!("{v}");
            }
            return;
        }
        match ev {
            BuildEvent::Step {
                index,
                stage,
                location,
                instruction,
                cached,
            } => {
                let c = if cached { " CACHED" } else { "" };
                eprintln!("#{index} [stage {stage}] {location} {instruction}{c}");
            }
            BuildEvent::Log(l) => eprintln!("#{} {}", l.step, l.text),
            BuildEvent::Layer {
                index,
                digest,
                size,
            } => eprintln!("#{index} layer {digest} ({size} bytes)"),
        }
    })
}

/// Runs `kiln build`; `cli` carries the global `--json` choice.
pub fn run(a: Args, cli: &super::Out) -> anyhow::Result<()> {
    for f in &a.ssh {
        kiln_builder::secrets::refuse_ssh(f)?;
    }
    let specs = a
        .secret
        .iter()
        .map(|f| kiln_builder::secrets::parse_secret_flag(f))
        .collect::<Result<Vec<_>, _>>()?;
    let secrets = kiln_builder::secrets::Secrets::load(&specs)?;
    for e in &a.allow {
        if e != "network.host" {
            bail!("--allow {e:?}: the only entitlement is network.host");
        }
    }
    let (context, file) = locate(&a);
    if !context.is_dir() {
        bail!("build context {} is not a directory", context.display());
    }
    let bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let name = file.display().to_string();
    let oci_tags: Vec<kiln_builder::reference::Reference> = if a.oci_only {
        a.tags
            .iter()
            .map(|t| {
                t.parse()
                    .with_context(|| format!("-t {t}: not a valid name:tag"))
            })
            .collect::<anyhow::Result<_>>()?
    } else {
        Vec::new()
    };
    let store_tags: Vec<kiln_store::TagRef> = if a.oci_only {
        Vec::new()
    } else {
        a.tags
            .iter()
            .map(|t| {
                t.parse()
                    .with_context(|| format!("-t {t}: not a valid store tag (name:tag)"))
            })
            .collect::<anyhow::Result<_>>()?
    };

    // The guest kernel and initramfs first: a missing guest init fails before the build.
    let boot = if a.snapshot {
        Some(super::kernel::boot_assets(
            a.kernel.clone(),
            a.initramfs.clone(),
        )?)
    } else {
        None
    };
    let config = crate::config::Config::load(&crate::config::Flags::default())?;
    let root = crate::config::local_store_dir(a.store.as_deref(), "kiln build")?;
    let cache = Arc::new(
        LocalCache::open(&root)
            .with_context(|| format!("opening the store at {}", root.display()))?,
    );
    let work = a.work_dir.clone().unwrap_or_else(|| root.join(".build"));
    let options = kiln_recipes::Options {
        target: a.target.clone(),
        build_args: build_args(&a.build_args),
        platform: a.platform.clone(),
        disk_mib: a.disk_mib,
        ..Default::default()
    };
    let mut resolve = ResolveOptions {
        policy: if a.offline {
            PullPolicy::Never
        } else if a.pull {
            PullPolicy::Always
        } else {
            PullPolicy::Missing
        },
        work_dir: work.join("bootstrap"),
        // `from: {bootstrap: ...}` without a mirror: the configured one, else this host's apt
        // archive (see `kiln config show`).
        default_mirror: config.bootstrap_mirror.value.clone(),
        registry: RegistryOptions {
            insecure: a.insecure.clone(),
            ..RegistryOptions::default()
        },
        ..Default::default()
    };
    for bc in &a.build_context {
        let (n, v) = parse_build_context(bc)?;
        resolve.build_contexts.insert(n, v);
    }
    let mut opts = BuildOptions::new(work.clone());
    opts.no_cache = a.no_cache;
    opts.no_cache_filter = a.no_cache_filter.clone();
    opts.jobs = a.jobs.max(1);
    opts.exec.allow_network_host = a.allow.iter().any(|e| e == "network.host");
    opts.exec.run_dir = work.join("run");
    opts.context = Some((context.clone(), dockerignore(&context, &file)?));
    opts.secrets = secrets;
    opts.recipe_digest = Some(kiln_builder::cache::digest_of(&bytes));
    opts.resolve = resolve.clone();
    let cancel = opts.cancel.clone();
    let events = printer(a.progress, cli.json);

    let rt = super::common::runtime()?;
    let (out, published) = rt.block_on(async {
        // Ctrl-C and SIGTERM cancel the build.
        let flag = cancel.clone();
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
            flag.store(true, Ordering::Relaxed);
        });
        let store = kiln_store::Store::open(&root.to_string_lossy()).await?;
        let (plan, bases) = kiln_builder::resolve::resolve_recipe(
            &name,
            &bytes,
            &options,
            &resolve,
            cache.as_ref(),
        )
        .await?;
        for w in &plan.warnings {
            match &w.location {
                Some(l) => eprintln!("warning: {}:{}: {}", l.file, l.start_line, w.message),
                None => eprintln!("warning: {}", w.message),
            }
        }
        let out = build(&plan, &bases, cache.clone(), &store, &opts, events).await?;
        if cancel.load(Ordering::Relaxed) {
            bail!("build cancelled");
        }
        // The ext4 image, the kiln image manifest and the store tags (nothing is tagged
        // when any of it fails).
        let published = if a.oci_only {
            None
        } else {
            eprintln!("publishing: ext4 image, image manifest, tags");
            // With --snapshot the tags move only once the snapshot is stored.
            let tags: &[kiln_store::TagRef] = if boot.is_some() { &[] } else { &store_tags };
            let p = kiln_builder::publish::publish(
                &store,
                cache.as_ref(),
                &out.image,
                tags,
                &kiln_builder::publish::PublishOptions {
                    disk_mib: a.disk_mib,
                    ..Default::default()
                },
            )
            .await;
            let p = match (p, &boot) {
                (Ok(d), Some(assets)) => {
                    snapshot_and_tag(&store, &out.lease, d, assets, &a, &store_tags).await
                }
                (p, _) => p.map(|d| (d, None)).map_err(anyhow::Error::from),
            };
            let _ = out.lease.release().await;
            Some(p?)
        };
        if a.oci_only {
            // The local references made below keep the image; the lease is not needed.
            let _ = out.lease.release().await;
        }
        anyhow::Ok((out, published))
    })?;
    let (published, snapshot) = match published {
        Some((d, s)) => (Some(d), s),
        None => (None, None),
    };
    if cancel.load(Ordering::Relaxed) {
        bail!("build cancelled");
    }
    let digest = out.image.oci_manifest.digest.clone();
    let mut names: Vec<String> = store_tags.iter().map(|t| t.to_string()).collect();
    for t in &oci_tags {
        let full = format!("{}:{}", t.name(), t.tag().unwrap_or("latest"));
        cache
            .set_ref(&full, &digest)
            .with_context(|| format!("tagging {full}"))?;
        names.push(full);
    }
    if let Some(p) = &a.iidfile {
        write_file(p, digest.as_bytes())?;
    }
    if let Some(p) = &a.metadata_file {
        let meta = json!({
            "containerimage.digest": digest,
            "containerimage.config.digest": out.image.config.digest,
            "containerimage.descriptor": out.image.oci_manifest,
            "image.name": names.join(","),
            "kiln.image.manifest": published.as_ref().map(|d| d.to_string()),
            "kiln.snapshot": snapshot.as_ref().map(|d| d.to_string()),
            "kiln.recipe.digest": out.image.recipe_digest,
            "kiln.steps.run": out.stats.steps_run,
            "kiln.steps.cached": out.stats.steps_cached,
        });
        write_file(p, serde_json::to_string_pretty(&meta)?.as_bytes())?;
    }
    let last = published
        .as_ref()
        .map(|d| d.to_string())
        .unwrap_or_else(|| digest.clone());
    let oci_note = if published.is_some() {
        format!(" (OCI manifest {digest})")
    } else {
        String::new()
    };
    eprintln!(
        "built {last}{oci_note}: {} steps run, {} cached{}",
        out.stats.steps_run,
        out.stats.steps_cached,
        if names.is_empty() {
            String::new()
        } else {
            format!(", tagged {}", names.join(", "))
        }
    );
    cli.event(
        "built",
        json!({
            "manifest": published.as_ref().map(|d| d.to_string()),
            "ociManifest": digest, "snapshot": snapshot.as_ref().map(|d| d.to_string()),
            "tags": names, "stepsRun": out.stats.steps_run, "stepsCached": out.stats.steps_cached,
        }),
        || last.clone(),
    );
    Ok(())
}

/// Boots the published image manifest `image` once and stores its snapshot
/// ([`kiln_vmm::snapshot::snapshot_manifest`]), the image held by the build's lease
/// meanwhile; then points `tags` at the image manifest that names the snapshot. Returns that
/// manifest and the snapshot manifest. On error no tag has moved.
async fn snapshot_and_tag(
    store: &kiln_store::Store,
    lease: &kiln_store::lease::Lease,
    image: kiln_store::ManifestDigest,
    assets: &kiln_vmm::snapshot::BootAssets,
    a: &Args,
    tags: &[kiln_store::TagRef],
) -> anyhow::Result<(
    kiln_store::ManifestDigest,
    Option<kiln_store::ManifestDigest>,
)> {
    use kiln_store::manifest::ObjectRef;
    lease.add([ObjectRef::Manifest(image)]).await?;
    eprintln!("snapshot: booting {image} once, waiting for its ready check");
    let opts = kiln_vmm::snapshot::SnapshotOptions {
        vcpus: a.vcpus,
        memory_bytes: a.memory_mib << 20,
        ready_timeout: std::time::Duration::from_secs(a.ready_timeout),
        ..Default::default()
    };
    let r = kiln_vmm::snapshot::snapshot_manifest(store, image, assets, &opts)
        .await
        .context("kiln build --snapshot: nothing tagged")?;
    lease.add([ObjectRef::Manifest(r.image)]).await?;
    eprintln!(
        "snapshot {} ({}: ready in {} ms, saved in {} ms; memory {} MiB stored as {} KiB)",
        r.snapshot,
        r.accel.name(),
        r.boot_to_ready.as_millis(),
        r.save.as_millis(),
        r.memory_bytes >> 20,
        r.memory_stored_bytes >> 10
    );
    for t in tags {
        if store.get_tag(t).await?.map(|x| x.manifest) == Some(r.image) {
            continue;
        }
        store
            .force_tag(t, r.image)
            .await
            .with_context(|| format!("tagging {t}"))?;
    }
    Ok((r.image, Some(r.snapshot)))
}

fn write_file(p: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(p, bytes).with_context(|| format!("writing {}", p.display()))
}

/// The build context's ignore file, as BuildKit picks it: `<recipe>.dockerignore` beside the
/// recipe when it exists, else `CONTEXT/.dockerignore`, else none.
fn dockerignore(
    context: &Path,
    recipe: &Path,
) -> anyhow::Result<kiln_recipes::dockerignore::Dockerignore> {
    let mut specific = recipe.as_os_str().to_owned();
    specific.push(".dockerignore");
    for p in [PathBuf::from(specific), context.join(".dockerignore")] {
        match std::fs::read(&p) {
            Ok(b) => {
                return Ok(kiln_recipes::dockerignore::Dockerignore::parse(
                    &p.display().to_string(),
                    &b,
                )?);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }
    Ok(Default::default())
}

/// The terminal display: an indicatif spinner per running step (its `file:line`, the
/// instruction and its last log line), turned into a plain line when the step ends.
fn tty_printer() -> Arc<dyn Fn(BuildEvent) + Send + Sync> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    use std::collections::HashMap;
    use std::sync::Mutex;
    let multi = MultiProgress::new();
    // The template is a constant that parses; fall back to the default style anyway.
    let style = ProgressStyle::with_template("{spinner} {prefix} {elapsed} {wide_msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let bars: Mutex<HashMap<usize, ProgressBar>> = Mutex::default();
    Arc::new(move |ev: BuildEvent| {
        // A poisoned lock only means another event panicked; drawing is best effort.
        let Ok(mut bars) = bars.lock() else { return };
        match ev {
            BuildEvent::Step {
                index,
                stage,
                location,
                instruction,
                cached,
            } => {
                let line = format!("#{index} [stage {stage}] {location} {instruction}");
                if cached {
                    let _ = multi.println(format!("{line} CACHED"));
                    return;
                }
                let _ = multi.println(line.clone());
                let b = multi.add(ProgressBar::new_spinner());
                b.set_style(style.clone());
                b.set_prefix(format!("#{index}"));
                b.enable_steady_tick(std::time::Duration::from_millis(120));
                bars.insert(index, b);
            }
            BuildEvent::Log(l) => match bars.get(&l.step) {
                Some(b) => b.set_message(l.text),
                None => {
                    let _ = multi.println(format!("#{} {}", l.step, l.text));
                }
            },
            BuildEvent::Layer {
                index,
                digest,
                size,
            } => {
                if let Some(b) = bars.remove(&index) {
                    b.finish_and_clear();
                }
                let _ = multi.println(format!("#{index} done: layer {digest} ({size} bytes)"));
            }
        }
    })
}
