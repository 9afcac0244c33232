//! The build driver: a resolved [`BuildPlan`] becomes an OCI image (manifest, config and
//! gzip layers as blobs in the store), described by a [`BuiltImage`].
//!
//! For each stage, in dependency order (independent stages at once, up to
//! [`BuildOptions::jobs`]):
//!
//! 1. the base: nothing (`scratch`), the layers and config of an earlier stage, or an image
//!    in the store (layers, `rootfs.diff_ids`, history and config from its config blob);
//! 2. each step gets a cache key ([`key`]); with caching on and an entry `cache/<key>`
//!    whose layer blob is present, the step is a hit and nothing runs. Otherwise the
//!    parent's layers are unpacked once per digest as overlayfs lower directories
//!    ([`lower::LayerDirs`]), the step runs on an overlay with a fresh upper directory
//!    (`RUN`: [`crate::exec::LinuxExecutor`], its own namespaces; `WORKDIR`: [`merged`], a
//!    private mount namespace), the upper directory becomes one deterministic gzip layer
//!    ([`crate::layer::write::write_upper_layer`], overlay whiteouts turned into OCI ones),
//!    the layer goes into the store, the upper directory becomes that layer's lower
//!    directory, and the entry `cache/<key>` is written, with what its key was made from
//!    beside it ([`why`]: on a miss, the step's event says why, against the nearest earlier
//!    build of the step, in one read);
//! 3. the stage's image config is the plan's over the base's ([`config`]).
//!
//! After the target stage, a generated "sandbox preparation" layer (an empty
//! `/etc/machine-id`, `/etc/hostname` = `runtime-guest`, and an `/etc/hosts` that resolves
//! it; DESIGN.md "The sandbox environment") is added, with its history entry, cached like a step. Then the config and
//! the OCI manifest are written as blobs. A failed, timed-out or cancelled build writes no
//! manifest (layers of steps that succeeded stay in the cache) and leaves no mount and no
//! process: each step's mounts live in namespaces that die with it.

pub mod config;
mod error;
pub mod key;
pub mod lower;
pub mod merged;
pub mod why;

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use kiln_recipes::plan::{Action, BuildPlan, MountFrom, Stage, Step};
use kiln_store::{BlobDigest, Store};

use self::config::{History, OciConfig};
pub use self::error::BuildError;
use self::error::io_err;
use self::lower::LayerDirs;
use crate::cache::BlobCache;
use crate::copy::fetch::FetchOptions;
use crate::copy::{CopyOptions, Sources};
use crate::egress::ca;
use crate::exec::mounts::MountInputs;
use crate::exec::{
    ExecConfig, ExecError, LinuxExecutor, LogLine, OVERLAY_MAX_LOWERS, StepExecutor, StepSpec,
};
use crate::image::{Descriptor, OCI_MANIFEST};
use crate::layer::Limits;
use crate::publish::BuiltImage;
use crate::resolve::ResolvedBase;
use crate::secrets::Secrets;
use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{CopySource, CopyStep, Mount};

/// OCI image config media type (`media-types.md`).
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI gzip layer media type (`media-types.md`).
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The hostname written into `/etc/hostname` by the sandbox preparation layer.
pub const SANDBOX_HOSTNAME: &str = "runtime-guest";
/// The history `created_by` of the sandbox preparation layer.
pub const SANDBOX_LAYER_CREATED_BY: &str =
    "kiln: sandbox preparation (/etc/machine-id empty, /etc/hostname runtime-guest, /etc/hosts)";

/// `/etc/hosts` of the sandbox preparation layer (hosts(5)): the loopback names and
/// [`SANDBOX_HOSTNAME`] on 127.0.1.1, Debian's address for the machine's own name (Debian
/// reference manual, "The hostname resolution"). Like Docker, which writes a container's
/// `/etc/hosts` itself, it replaces the image's: without it `sudo` and other programs that
/// resolve the hostname print "unable to resolve host runtime-guest".
pub fn sandbox_hosts() -> String {
    format!(
        "127.0.0.1\tlocalhost\n127.0.1.1\t{SANDBOX_HOSTNAME}\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
    )
}

/// How to build.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Scratch and layer directories (`layers/<hex>`, step uppers); must be on a file
    /// system overlayfs accepts as upper (not overlayfs itself) and its path must not hold
    /// `:` or `,`.
    pub work_dir: PathBuf,
    /// The executor's configuration (memory is lowered to the plan's limit).
    pub exec: ExecConfig,
    /// `--no-cache`: look up no cache entry (entries are still written).
    pub no_cache: bool,
    /// `--no-cache-filter`: stages (by name or index) whose steps look up no entry.
    pub no_cache_filter: Vec<String>,
    /// Stages built at once (`--jobs`), at least 1.
    pub jobs: usize,
    /// Set by the caller to cancel (Ctrl-C, SIGTERM).
    pub cancel: Arc<AtomicBool>,
    /// Bounds when unpacking base layers.
    pub layer_limits: Limits,
    /// Add the sandbox preparation layer (default true).
    pub sandbox_layer: bool,
    /// The build context and its `.dockerignore` (`COPY`/`ADD` without `--from`, `RUN
    /// --mount=type=bind` without `from`); `None`: such steps fail.
    pub context: Option<(PathBuf, Dockerignore)>,
    /// The build's secrets (`--secret`), for `RUN --mount=type=secret`.
    pub secrets: Secrets,
    /// The build's SSH agents (`--ssh`), id → the agent's socket on the host, for `RUN
    /// --mount=type=ssh`, and `default` for `ADD` of a git repository over ssh
    /// ([`FetchOptions::ssh_agent`]). Not part of any cache key (the mount's id is, in the
    /// plan; a git source's commit is).
    pub ssh: std::collections::BTreeMap<String, PathBuf>,
    /// How `ADD` fetches URLs; its address policy is the egress proxy's too.
    pub fetch: FetchOptions,
    /// The network of every step, over the recipe's
    /// ([`crate::egress::effective_network`], written into the plan before anything is
    /// built, so it is part of the steps' cache keys); `None`: as the recipe says.
    pub network: Option<kiln_recipes::plan::Network>,
    /// [`BuiltImage::recipe_digest`]: the caller's digest of the recipe bytes; `None`: the
    /// digest of the plan's JSON with every file name reduced to its last component (so the
    /// directory a recipe sits in changes nothing).
    pub recipe_digest: Option<String>,
    /// How images named by `COPY --from=<image>` and `RUN --mount=from=<image>` are found
    /// (pull policy, build contexts, registry access; the stage's platform is used).
    pub resolve: crate::resolve::ResolveOptions,
    /// Where `RUN --mount=type=cache` directories persist, one per cache id; `None`:
    /// `work_dir/cache-mounts`. Builds given different directories share no cache mount
    /// (the caller's scope, e.g. one directory per workspace).
    pub cache_mount_dir: Option<PathBuf>,
    /// The store lease the build records what it relies on in (the caller's, taken before
    /// it resolved the bases); `None`: the build takes its own.
    pub lease: Option<Arc<kiln_store::lease::Lease>>,
    /// The name of the build's history (its first tag): a step that misses the cache is
    /// compared with the same recipe position in the last build of this name
    /// ([`why::index_id`]); `None`: with the last run of the same instruction text.
    pub history: Option<String>,
}

impl BuildOptions {
    /// Defaults with `work_dir`.
    pub fn new(work_dir: PathBuf) -> Self {
        BuildOptions {
            work_dir,
            exec: ExecConfig::default(),
            no_cache: false,
            no_cache_filter: Vec::new(),
            jobs: 2,
            cancel: Arc::default(),
            layer_limits: Limits::default(),
            sandbox_layer: true,
            context: None,
            secrets: Secrets::default(),
            ssh: Default::default(),
            fetch: FetchOptions::default(),
            network: None,
            recipe_digest: None,
            resolve: Default::default(),
            cache_mount_dir: None,
            lease: None,
            history: None,
        }
    }
}

/// Progress of a build, in order per stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildEvent {
    /// A step starts (or is found in the cache).
    Step {
        /// Build-wide step number (also in [`LogLine::step`]).
        index: usize,
        /// Stage index.
        stage: usize,
        /// `file:line`.
        location: String,
        /// The step, shortened.
        instruction: String,
        /// Found in the cache: nothing runs.
        cached: bool,
        /// Not found: why, against the nearest earlier build of the step ([`why`]); empty
        /// when found.
        why: Vec<why::MissReason>,
        /// The step runs a command in the build's [`StepExecutor`] (`RUN`, a recipe command);
        /// `false`: kiln applies it itself, on the host (`COPY`, `ADD`, `WORKDIR`, the
        /// generated sandbox layer).
        runs_command: bool,
    },
    /// A log line of a running step.
    Log(LogLine),
    /// A step made its layer.
    Layer {
        /// Build-wide step number.
        index: usize,
        /// Layer digest.
        digest: String,
        /// Compressed size, bytes.
        size: u64,
    },
}

/// Where events go.
pub type EventSink = Arc<dyn Fn(BuildEvent) + Send + Sync>;

/// Counts of a finished build.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuildStats {
    /// Steps that ran.
    pub steps_run: usize,
    /// Steps found in the cache.
    pub steps_cached: usize,
}

/// A finished build.
#[derive(Debug, Clone)]
pub struct BuildOutput {
    /// The image.
    pub image: BuiltImage,
    /// Its config.
    pub config: OciConfig,
    /// Counts.
    pub stats: BuildStats,
    /// The store lease (`leases/<id>`) holding every blob of the image (and the layers
    /// made on the way) against GC until the caller has published: release it then
    /// ([`kiln_store::lease::Lease::release`]); otherwise it expires with the build's
    /// timeout plus an hour.
    pub lease: Arc<kiln_store::lease::Lease>,
}

/// A layer of a stage: its descriptor and diff id.
#[derive(Debug, Clone)]
struct LayerRef {
    desc: Descriptor,
    diff_id: String,
}

/// A finished stage.
#[derive(Debug, Clone)]
struct StageOut {
    layers: Vec<LayerRef>,
    config: OciConfig,
    key: String,
}

struct Ctx {
    plan: BuildPlan,
    bases: Vec<ResolvedBase>,
    cache: Arc<dyn BlobCache>,
    store: Store,
    dirs: LayerDirs,
    opts: BuildOptions,
    executor: Arc<dyn StepExecutor>,
    events: EventSink,
    cancel: Arc<AtomicBool>,
    deadline: Instant,
    timeout: Duration,
    epoch: Option<u64>,
    step_counter: AtomicUsize,
    /// What this build relies on in the store.
    lease: Arc<kiln_store::lease::Lease>,
    /// Log bytes the build has emitted (its whole log is bounded, DESIGN.md "Build limits").
    log_bytes: AtomicUsize,
    run: AtomicUsize,
    cached: AtomicUsize,
}

impl Ctx {
    /// The bounds every layer this build reads is applied with: the caller's
    /// [`BuildOptions::layer_limits`] with the build's deadline, so that reading a layer
    /// (a base's, a cached step's, a `COPY --from` stage tree) stops at the build's time
    /// limit and on its cancel like a step does.
    fn layer_limits(&self) -> Limits {
        Limits {
            deadline: Some(self.deadline),
            cancel: Some(self.cancel.clone()),
            ..self.opts.layer_limits.clone()
        }
    }

    /// Root key `k` as this build's scope has it: the operator's as it is, a tenant's made
    /// its workspace's own ([`key::workspace_key`]).
    fn scoped_key(&self, k: String) -> String {
        match &self.opts.resolve.scope {
            crate::base::Scope::Operator => k,
            crate::base::Scope::Tenant(t) => key::workspace_key(&t.workspace, &k),
        }
    }
}

/// Builds `plan` whose bases `bases` were resolved by [`crate::resolve::resolve_plan`],
/// with blobs in `cache` and cache entries in `store` (the same store). Events go to
/// `events`. Returns the image; nothing is tagged.
pub async fn build(
    plan: &BuildPlan,
    bases: &[ResolvedBase],
    cache: Arc<dyn BlobCache>,
    store: &Store,
    opts: &BuildOptions,
    events: EventSink,
) -> Result<BuildOutput, BuildError> {
    build_with(
        plan,
        bases,
        cache,
        store,
        opts,
        events,
        Arc::new(LinuxExecutor::new(exec_config(plan, opts))),
    )
    .await
}

/// The settings a step executor of `plan` gets: `opts.exec` with its memory limit lowered to
/// the plan's (`limits.memory_mib`, MiB) and the address policy of `ADD`'s fetch, so that one
/// policy covers everything the build reaches (ADD and the egress proxy). Every executor
/// (namespace or microVM) is made from this.
pub fn exec_config(plan: &BuildPlan, opts: &BuildOptions) -> ExecConfig {
    let mut exec = opts.exec.clone();
    exec.memory_bytes = exec.memory_bytes.min(plan.limits.memory_mib << 20);
    exec.addresses = opts.fetch.addresses.clone();
    exec
}

/// [`build`] with a given step executor.
pub async fn build_with(
    plan: &BuildPlan,
    bases: &[ResolvedBase],
    cache: Arc<dyn BlobCache>,
    store: &Store,
    opts: &BuildOptions,
    events: EventSink,
    executor: Arc<dyn StepExecutor>,
) -> Result<BuildOutput, BuildError> {
    // A build-wide network is written into the plan, so that it is part of each step's
    // canonical form and cache key: a step run without network is not reused by a build
    // whose steps have some.
    let rewritten;
    let plan = match &opts.network {
        None => plan,
        Some(over) => {
            rewritten = crate::egress::with_network(plan, over);
            &rewritten
        }
    };
    check_supported(plan)?;
    if bases.len() != plan.stages.len() || plan.stages.is_empty() {
        return Err(BuildError::Plan(format!(
            "{} stages but {} resolved bases",
            plan.stages.len(),
            bases.len()
        )));
    }
    let epoch = match plan.build_args.given.get("SOURCE_DATE_EPOCH") {
        Some(v) => Some(config::parse_source_date_epoch(v).map_err(BuildError::Plan)?),
        None => None,
    };
    let timeout = Duration::from_secs(plan.limits.timeout_secs);
    // What builds killed before they could clean up left: their step processes (any still
    // in a step cgroup), their scratch directories and their leases (crate::workdir).
    let (work, cgroups) = (opts.work_dir.clone(), opts.exec.cgroup_parent.clone());
    let dead =
        tokio::task::spawn_blocking(move || crate::workdir::clean_up_dead_builds(&work, &cgroups))
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
    // A store whose leases cannot be read fails GC, which names the object; the build
    // itself does not depend on them.
    let released = store.release_dead_leases().await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "not releasing dead builds' leases");
        Vec::new()
    });
    if dead != crate::workdir::DeadBuilds::default() || !released.is_empty() {
        tracing::info!(
            cgroups = dead.cgroups.len(),
            dirs = dead.dirs.len(),
            leases = released.len(),
            "cleaned up after dead builds"
        );
    }
    let dirs = LayerDirs::open(&opts.work_dir.join("layers"))?;
    let cancel = Arc::new(AtomicBool::new(false));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let lease = match &opts.lease {
        Some(l) => l.clone(),
        None => Arc::new(
            store
                .create_lease(
                    &format!("build-{}-{nanos}", std::process::id()),
                    timeout + Duration::from_secs(3600),
                    [],
                )
                .await?,
        ),
    };
    // Every blob the build writes into, or finds in, the blob cache (the store's directory)
    // is leased first (crate::cache::LeasedCache).
    let cache: Arc<dyn BlobCache> = Arc::new(crate::cache::LeasedCache::new(cache, lease.clone()));
    let ctx = Arc::new(Ctx {
        plan: plan.clone(),
        bases: bases.to_vec(),
        cache,
        store: store.clone(),
        dirs,
        opts: opts.clone(),
        executor,
        events,
        cancel: cancel.clone(),
        deadline: Instant::now() + timeout,
        timeout,
        epoch,
        step_counter: AtomicUsize::new(0),
        lease: lease.clone(),
        log_bytes: AtomicUsize::new(0),
        run: AtomicUsize::new(0),
        cached: AtomicUsize::new(0),
    });
    // The caller's flag is copied into the build's own, which a failing stage also sets
    // to stop its siblings.
    let watch = {
        let (outer, inner) = (opts.cancel.clone(), cancel.clone());
        tokio::spawn(async move {
            loop {
                if outer.load(Ordering::Relaxed) {
                    inner.store(true, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let r = async {
        let outs = run_stages(ctx.clone()).await?;
        let target = plan.target.min(plan.stages.len() - 1);
        let mut out = outs[target]
            .clone()
            .ok_or_else(|| BuildError::Plan("target stage was not built".into()))?;
        if opts.sandbox_layer {
            sandbox_layer(&ctx, &mut out).await?;
        }
        finish(&ctx, out, target).await
    }
    .await;
    watch.abort();
    if r.is_err() {
        // Nothing to protect: layers that were made stay reachable through cache entries.
        let _ = lease.release().await;
    }
    r
}

/// Adds `digests` (blobs) to the build's lease.
async fn hold(ctx: &Ctx, digests: impl IntoIterator<Item = &str>) -> Result<(), BuildError> {
    let mut objs = Vec::new();
    for d in digests {
        objs.push(kiln_store::ObjectRef::Blob(blob_digest(d)?));
    }
    ctx.lease.add(objs).await?;
    Ok(())
}

/// Stage indexes a stage needs first.
fn stage_deps(stage: &Stage, base: &ResolvedBase) -> Vec<usize> {
    let mut d = Vec::new();
    if let ResolvedBase::Stage(s) = base {
        d.push(*s);
    }
    for step in &stage.steps {
        let from = match &step.action {
            Action::Copy(c) | Action::Add(c) => c.from.as_ref(),
            Action::Run(r) => {
                for m in &r.mounts {
                    if let kiln_recipes::plan::Mount::Bind {
                        from: Some(MountFrom::Stage { stage }),
                        ..
                    }
                    | kiln_recipes::plan::Mount::Cache {
                        from: Some(MountFrom::Stage { stage }),
                        ..
                    } = m
                    {
                        d.push(*stage);
                    }
                }
                None
            }
            Action::Mkdir(_) => None,
        };
        if let Some(MountFrom::Stage { stage }) = from {
            d.push(*stage);
        }
    }
    d.sort_unstable();
    d.dedup();
    d
}

async fn run_stages(ctx: Arc<Ctx>) -> Result<Vec<Option<StageOut>>, BuildError> {
    let n = ctx.plan.stages.len();
    let deps: Vec<Vec<usize>> = (0..n)
        .map(|i| stage_deps(&ctx.plan.stages[i], &ctx.bases[i]))
        .collect();
    for (i, d) in deps.iter().enumerate() {
        if d.iter().any(|&s| s >= i) {
            return Err(BuildError::Plan(format!(
                "stage {i} depends on a later stage"
            )));
        }
    }
    let mut outs: Vec<Option<StageOut>> = vec![None; n];
    let mut started: HashSet<usize> = HashSet::new();
    let mut running = FuturesUnordered::new();
    let jobs = ctx.opts.jobs.max(1);
    let mut first_err: Option<BuildError> = None;
    loop {
        if first_err.is_none() {
            for (i, deps_i) in deps.iter().enumerate() {
                if running.len() >= jobs {
                    break;
                }
                if started.contains(&i) || deps_i.iter().any(|&d| outs[d].is_none()) {
                    continue;
                }
                started.insert(i);
                let inputs: BTreeMap<usize, StageOut> = deps_i
                    .iter()
                    .filter_map(|&d| outs[d].clone().map(|o| (d, o)))
                    .collect();
                let c = ctx.clone();
                running.push(async move { (i, run_stage(c, i, inputs).await) });
            }
        }
        let Some((i, r)) = running.next().await else {
            break;
        };
        match r {
            Ok(o) => outs[i] = Some(o),
            Err(e) => {
                ctx.cancel.store(true, Ordering::Relaxed);
                // The first real error wins over the cancellations it caused.
                if first_err.is_none() || matches!(first_err, Some(BuildError::Cancelled)) {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(outs),
    }
}

fn location(step: &Step) -> String {
    format!("{}:{}", step.location.file, step.location.start_line)
}

/// Refuses, with the step's `file:line`, what a plan may say but this builder does not do:
/// `COPY --link`/`ADD --link` with `--chown` by name (BuildKit refuses it too: a linked layer
/// is made without the layers that hold the user database). `ADD` of a git repository over
/// ssh depends on the build's agent ([`BuildOptions::ssh`]), so it is checked where that is
/// known: the pipeline's entitlement check, and the fetch itself. [`build_with`] calls it
/// first; `kiln plan` and the API's submission check call it too, so the plan printed or
/// accepted is one that builds. Errors: [`BuildError::Unsupported`].
pub fn check_supported(plan: &BuildPlan) -> Result<(), BuildError> {
    for step in plan.stages.iter().flat_map(|s| &s.steps) {
        let (verb, c) = match &step.action {
            Action::Copy(c) => ("COPY", c),
            Action::Add(c) => ("ADD", c),
            _ => continue,
        };
        let unsupported = |what: String| BuildError::Unsupported {
            location: location(step),
            what,
        };
        if let Some(chown) = c
            .chown
            .as_deref()
            .filter(|o| c.link && !is_numeric_chown(o))
        {
            return Err(unsupported(format!(
                "{verb} --link --chown={chown}: a linked layer is made without the layers \
                 below it, so it has no /etc/passwd or /etc/group to look names up in; give \
                 numeric ids (--chown=UID[:GID]) or drop --link (as BuildKit)"
            )));
        }
    }
    Ok(())
}

/// Whether `--chown` value `o` (`user[:group]`) names ids without a user database: one or
/// two parts, each `root` (0) or an id as the step's user resolution reads it
/// ([`crate::exec::user::parse_id`]: decimal, never 4294967295), as BuildKit takes them with
/// `--link`.
fn is_numeric_chown(o: &str) -> bool {
    let parts: Vec<&str> = o.split(':').collect();
    parts.len() <= 2
        && parts
            .iter()
            .all(|p| *p == "root" || crate::exec::user::parse_id(p).is_some())
}

/// `o` ([`is_numeric_chown`]) with `root` written as 0.
fn numeric_chown(o: &str) -> String {
    o.split(':')
        .map(|p| if p == "root" { "0" } else { p })
        .collect::<Vec<_>>()
        .join(":")
}

/// The history `created_by` of a step, Docker-like.
pub fn describe(step: &Step) -> String {
    match &step.action {
        Action::Run(r) => format!("RUN {}", r.argv.join(" ")),
        Action::Copy(c) | Action::Add(c) => {
            let verb = if matches!(step.action, Action::Copy(_)) {
                "COPY"
            } else {
                "ADD"
            };
            let srcs: Vec<String> = c
                .sources
                .iter()
                .map(|s| match s {
                    kiln_recipes::plan::CopySource::Path { path } => path.clone(),
                    kiln_recipes::plan::CopySource::Url { url }
                    | kiln_recipes::plan::CopySource::Git { url } => url.clone(),
                    kiln_recipes::plan::CopySource::Inline(f) => format!("<<{}", f.name),
                })
                .collect();
            let from = match &c.from {
                Some(MountFrom::Stage { stage }) => format!("--from={stage} "),
                Some(MountFrom::Image { reference }) => format!("--from={reference} "),
                None => String::new(),
            };
            format!("{verb} {from}{} {}", srcs.join(" "), c.dest)
        }
        Action::Mkdir(m) => format!("WORKDIR {}", m.path),
    }
}

fn short(s: &str) -> String {
    let s = s.replace('\n', " ");
    if s.chars().count() > 120 {
        let mut t: String = s.chars().take(117).collect();
        t.push_str("...");
        t
    } else {
        s
    }
}

fn stage_uses_cache(ctx: &Ctx, i: usize) -> bool {
    if ctx.opts.no_cache {
        return false;
    }
    let st = &ctx.plan.stages[i];
    !ctx.opts.no_cache_filter.iter().any(|f| {
        st.name.as_deref() == Some(f.to_ascii_lowercase().as_str())
            || f.parse::<usize>().is_ok_and(|n| n == st.index)
    })
}

fn platform_parts(p: &str) -> (String, String, Option<String>) {
    let mut it = p.split('/');
    let os = it.next().unwrap_or("linux").to_string();
    let arch = it.next().unwrap_or("amd64").to_string();
    (os, arch, it.next().map(str::to_string))
}

/// The starting point of stage `i`.
fn stage_base(
    ctx: &Ctx,
    i: usize,
    inputs: &BTreeMap<usize, StageOut>,
) -> Result<StageOut, BuildError> {
    let stage = &ctx.plan.stages[i];
    let (os, architecture, variant) = platform_parts(&stage.platform);
    let root =
        |kind: &str, value: &str| ctx.scoped_key(key::root_key(kind, value, &stage.platform));
    match &ctx.bases[i] {
        ResolvedBase::Scratch => Ok(StageOut {
            layers: Vec::new(),
            config: OciConfig {
                architecture,
                os,
                variant,
                ..OciConfig::default()
            },
            key: root("scratch", ""),
        }),
        ResolvedBase::Stage(s) => inputs
            .get(s)
            .cloned()
            .ok_or_else(|| BuildError::Plan(format!("stage {i}: base stage {s} not built"))),
        ResolvedBase::Image { digest, .. } => {
            let bad = |reason: String| BuildError::Base {
                stage: i,
                digest: digest.clone(),
                reason,
            };
            let m = crate::base::manifest(ctx.cache.as_ref(), digest)
                .map_err(|e| bad(e.to_string()))?;
            let bytes = ctx
                .cache
                .read_blob(&m.config.digest)?
                .ok_or_else(|| bad(format!("config {} is not in the store", m.config.digest)))?;
            let mut config: OciConfig = serde_json::from_slice(&bytes)
                .map_err(|e| bad(format!("config {}: {e}", m.config.digest)))?;
            if config.rootfs.diff_ids.len() != m.layers.len() {
                return Err(bad(format!(
                    "{} layers but {} diff_ids",
                    m.layers.len(),
                    config.rootfs.diff_ids.len()
                )));
            }
            config.created = None;
            config.config.on_build = None;
            let layers = m
                .layers
                .iter()
                .zip(&config.rootfs.diff_ids)
                .map(|(d, diff)| LayerRef {
                    desc: Descriptor {
                        media_type: config::oci_layer_media_type(&d.media_type),
                        digest: d.digest.clone(),
                        size: d.size,
                        platform: None,
                        annotations: None,
                    },
                    diff_id: diff.clone(),
                })
                .collect();
            Ok(StageOut {
                layers,
                config,
                key: root("image", digest),
            })
        }
    }
}

/// Lower directories for `layers` (bottom first) when a mount takes at most `fit` of them:
/// topmost first, unpacking what is missing. A layer digest that occurs more than once
/// (`RUN true` twice, a `WORKDIR` that changes nothing) is one directory, which overlayfs
/// refuses to take twice ("conflicting lowerdir path", ELOOP), so only its topmost
/// occurrence is kept ([`topmost_unique`]). Past `fit`, the lowest ones are one squashed
/// tree made from their blobs instead ([`lower::squash_plan`], [`LayerDirs::squashed`]):
/// overlayfs' 500 lowers on the host, the microVM's disks
/// ([`crate::exec::StepExecutor::max_lowers`]). With `fit` 0 every layer is given as it
/// is, for the executor to refuse.
async fn step_lowers(
    ctx: &Arc<Ctx>,
    layers: &[LayerRef],
    fit: usize,
) -> Result<Vec<PathBuf>, BuildError> {
    let c = ctx.clone();
    let digests: Vec<String> = layers.iter().map(|l| l.desc.digest.clone()).collect();
    tokio::task::spawn_blocking(move || {
        let unique = topmost_unique(&digests);
        let squash = lower::squash_plan(unique.len(), fit).unwrap_or(0);
        let keep = unique.len() - squash;
        let mut dirs = Vec::with_capacity(keep + 1);
        for d in &unique[..keep] {
            dirs.push(c.dirs.ensure(c.cache.as_ref(), d, &c.layer_limits())?);
        }
        if squash > 0 {
            let t0 = Instant::now();
            let bottom_first: Vec<String> = unique[keep..].iter().rev().map(|d| (*d).clone()).collect();
            dirs.push(
                c.dirs
                    .squashed(c.cache.as_ref(), &bottom_first, &c.layer_limits())?,
            );
            tracing::debug!(layers = squash, fit, took = ?t0.elapsed(), "squashed the lowest layers");
        }
        Ok::<_, BuildError>(dirs)
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?
}

/// `digests` (bottom first) as overlay lowers: topmost first, each digest once, at its
/// topmost position. Dropping the lower copies changes nothing: the upper copy holds the
/// same entries, so it already shadows every path the lower copy has, and its whiteouts and
/// opaque directories hide everything below it, the lower copy's range included.
fn topmost_unique(digests: &[String]) -> Vec<&String> {
    let mut seen = std::collections::HashSet::new();
    digests.iter().rev().filter(|d| seen.insert(*d)).collect()
}

/// Writes build-cache entry `key` → `layer` in the store, after the layer blob itself
/// ([`crate::cache::share_blob`]): an entry never names a blob the store lacks, so any host
/// sharing the store gets the hit.
async fn share_entry(ctx: &Ctx, key: &str, layer: &str) -> Result<(), BuildError> {
    crate::cache::share_blob(ctx.cache.as_ref(), &ctx.store, layer, Some(&ctx.lease)).await?;
    ctx.store.put_cache_entry(key, blob_digest(layer)?).await?;
    Ok(())
}

/// What step `step` of stage `stage` (key `key`, parent `parent`) was made from.
#[allow(clippy::too_many_arguments)]
fn step_inputs(
    ctx: &Ctx,
    stage: usize,
    parent: &str,
    key: &str,
    step: &Step,
    env: &[String],
    user: Option<&str>,
    prepared: &Prepared,
) -> why::StepInputs {
    let base = match &ctx.bases[stage] {
        ResolvedBase::Scratch => "scratch".to_string(),
        ResolvedBase::Stage(s) => format!("stage {s}"),
        ResolvedBase::Image { digest, .. } => digest.clone(),
    };
    let (args, env) = why::split_env(env, &ctx.plan.build_args.given);
    let mut action = step.action.clone();
    let (mut mounts, mut network) = (Vec::new(), String::new());
    if let Action::Run(r) = &mut action {
        // Plan types always serialize.
        mounts = r
            .mounts
            .drain(..)
            .map(|m| why::text_digest(&serde_json::to_string(&m).unwrap_or_default()))
            .collect();
        network = why::text_digest(&serde_json::to_string(&r.network).unwrap_or_default());
        r.network = Default::default();
    }
    let action = serde_json::to_string(&(&action, &step.context.shell)).unwrap_or_default();
    why::StepInputs {
        v: why::INPUTS_VERSION,
        key: key.to_string(),
        base,
        parent: parent.to_string(),
        instruction: why::text_digest(&describe(step)),
        action: crate::cache::digest_of(action.as_bytes()),
        args,
        env,
        user: user.map(why::text_digest),
        workdir: why::text_digest(&step.context.workdir),
        network,
        mounts,
        sources: prepared.digest.clone(),
        files: prepared.files.clone(),
    }
}

/// The `cache-index/<id>` of a step, within the build's scope ([`why::index_id`]).
fn index_of(ctx: &Ctx, stage: usize, position: usize, instruction: &str) -> String {
    let workspace = match &ctx.opts.resolve.scope {
        crate::base::Scope::Operator => None,
        crate::base::Scope::Tenant(t) => Some(t.workspace.as_str()),
    };
    why::index_id(
        workspace,
        ctx.opts.history.as_deref(),
        stage,
        position,
        instruction,
    )
}

/// Why a step missed: `--no-cache` or its filter (`use_cache` false), else against the
/// record at `cache-index/<id>` (one read). A record that cannot be read counts as none.
async fn why_missed(
    ctx: &Ctx,
    use_cache: bool,
    id: &str,
    now: &why::StepInputs,
) -> Vec<why::MissReason> {
    if ctx.opts.no_cache {
        return vec![why::MissReason::NoCache];
    }
    if !use_cache {
        return vec![why::MissReason::NoCacheFilter];
    }
    let before = match ctx.store.get_cache_index(id).await {
        Ok(b) => b.and_then(|b| serde_json::from_slice::<why::StepInputs>(&b).ok()),
        Err(e) => {
            tracing::warn!(error = %e, "not reading the earlier build's step inputs");
            None
        }
    };
    let before = before.filter(|b| b.v == why::INPUTS_VERSION);
    why::reasons(before.as_ref(), now)
}

/// Writes the inputs record of entry `key` and its index copy `id`. A failure is logged:
/// the record only explains, the build does not depend on it.
async fn record_inputs(ctx: &Ctx, key: &str, id: &str, inputs: &why::StepInputs) {
    // Plain structs of strings and maps always serialize.
    let bytes = serde_json::to_vec(inputs).unwrap_or_default();
    if let Err(e) = ctx.store.put_cache_inputs(key, Some(id), bytes).await {
        tracing::warn!(key, error = %e, "not recording the step's cache inputs");
    }
}

/// Looks `key` up; a hit whose layer blob is present gives the layer.
async fn lookup(ctx: &Ctx, key: &str) -> Result<Option<LayerRef>, BuildError> {
    let Some(entry) = ctx.store.get_cache_entry(key).await? else {
        return Ok(None);
    };
    let digest = format!("sha256:{}", entry.layer.hex());
    // An entry another host wrote names a layer only the store has (an S3 store).
    let Some(path) = crate::cache::fetch_blob(ctx.cache.as_ref(), &ctx.store, &digest).await?
    else {
        return Ok(None);
    };
    let size = fs::metadata(&path).map_err(io_err("reading", &path))?.len();
    let diff_path = ctx.opts.work_dir.join("diffids").join(entry.layer.hex());
    let diff_id = match fs::read_to_string(&diff_path) {
        Ok(s) if crate::cache::sha256_hex(s.trim()).is_ok() => s.trim().to_string(),
        _ => {
            let p = path.clone();
            let d = tokio::task::spawn_blocking(move || lower::diff_id_of(&p))
                .await
                .map_err(|e| BuildError::Task(e.to_string()))?
                .map_err(io_err("reading", &path))?;
            remember_diff_id(&ctx.opts.work_dir, &digest, &d);
            d
        }
    };
    Ok(Some(LayerRef {
        desc: Descriptor {
            media_type: OCI_LAYER_GZIP.into(),
            digest,
            size,
            platform: None,
            annotations: None,
        },
        diff_id,
    }))
}

fn remember_diff_id(work: &Path, digest: &str, diff_id: &str) {
    let Ok(hex) = crate::cache::sha256_hex(digest) else {
        return;
    };
    let dir = work.join("diffids");
    let _ = fs::create_dir_all(&dir);
    let tmp = dir.join(format!(".{hex}.{}", std::process::id()));
    if fs::write(&tmp, diff_id).is_ok() {
        let _ = fs::rename(&tmp, dir.join(hex));
    }
}

/// A step's fresh upper and work directories, removed on drop unless taken.
struct Scratch {
    upper: Option<PathBuf>,
    work: PathBuf,
    mnt: PathBuf,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(u) = &self.upper {
            let _ = fs::remove_dir_all(u);
        }
        let _ = fs::remove_dir_all(&self.work);
        let _ = fs::remove_dir_all(self.work.with_extension("empty"));
        let _ = fs::remove_dir(&self.mnt);
    }
}

fn scratch(ctx: &Ctx) -> Result<Scratch, BuildError> {
    let s = Scratch {
        upper: Some(ctx.dirs.temp("upper")),
        work: ctx.dirs.temp("work"),
        mnt: ctx.dirs.temp("mnt"),
    };
    for d in [s.upper.as_deref().unwrap_or(&s.work), &s.work, &s.mnt] {
        fs::create_dir(d).map_err(io_err("creating", d))?;
    }
    Ok(s)
}

/// Writes the upper directory as a layer into the store and adopts it as that layer's
/// lower directory.
async fn commit_upper(ctx: &Arc<Ctx>, mut s: Scratch) -> Result<LayerRef, BuildError> {
    let upper = s
        .upper
        .take()
        .ok_or_else(|| BuildError::Task("upper directory taken twice".into()))?;
    let c = ctx.clone();
    let r = tokio::task::spawn_blocking(move || -> Result<LayerRef, BuildError> {
        let staged = c
            .cache
            .scratch_path(&format!("layer-{}", c.step_counter.load(Ordering::Relaxed)));
        let staged = staged.with_file_name(format!(
            "{}-{}",
            staged
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            upper
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        if let Some(p) = staged.parent() {
            fs::create_dir_all(p).map_err(io_err("creating", p))?;
        }
        let f = fs::File::create(&staged).map_err(io_err("creating", &staged))?;
        let w = crate::layer::write::write_upper_layer(&upper, std::io::BufWriter::new(f), c.epoch);
        let w = match w {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&staged);
                // Out of space is about the file being written (its free space measured
                // without the partial layer, beside the step's files), not the directory read.
                let e = if kiln_store::space::is_no_space(&e) {
                    kiln_store::space::NoSpace::at("writing the layer", &staged, None).into()
                } else {
                    io_err("writing a layer from", &upper)(e)
                };
                let _ = fs::remove_dir_all(&upper);
                return Err(e);
            }
        };
        c.cache.commit(&staged, &w.digest)?;
        remember_diff_id(&c.opts.work_dir, &w.digest, &w.diff_id);
        c.dirs.adopt(&upper, &w.digest)?;
        Ok(LayerRef {
            desc: Descriptor {
                media_type: OCI_LAYER_GZIP.into(),
                digest: w.digest,
                size: w.size,
                platform: None,
                annotations: None,
            },
            diff_id: w.diff_id,
        })
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?;
    drop(s);
    r
}

fn check_cancel(ctx: &Ctx, loc: &str) -> Result<(), BuildError> {
    if ctx.opts.cancel.load(Ordering::Relaxed) || ctx.cancel.load(Ordering::Relaxed) {
        return Err(BuildError::Cancelled);
    }
    if Instant::now() >= ctx.deadline {
        return Err(BuildError::Timeout {
            location: loc.to_string(),
            after: ctx.timeout,
            stopped: None,
        });
    }
    Ok(())
}

async fn run_stage(
    ctx: Arc<Ctx>,
    i: usize,
    inputs: BTreeMap<usize, StageOut>,
) -> Result<StageOut, BuildError> {
    let mut st = stage_base(&ctx, i, &inputs)?;
    hold(&ctx, st.layers.iter().map(|l| l.desc.digest.as_str())).await?;
    config::default_path(st.config.config.env.get_or_insert_with(Vec::new));
    let base_run = st.config.config.clone();
    let use_cache = stage_uses_cache(&ctx, i);
    let stage = ctx.plan.stages[i].clone();
    for (position, step) in stage.steps.iter().enumerate() {
        let loc = location(step);
        check_cancel(&ctx, &loc)?;
        let index = ctx.step_counter.fetch_add(1, Ordering::Relaxed);
        let env = config::merge_env(base_run.env.as_deref().unwrap_or(&[]), &step.context.env);
        let user = step.context.user.clone().or_else(|| base_run.user.clone());
        let canonical = step.canonical_json();
        let prepared = prepare_inputs(&ctx, step, &inputs, &stage.platform, &loc).await?;
        let sources = prepared.digest.clone();
        // `COPY --link`: the layer's key has no parent, and no environment or user (a copy
        // reads neither), so a change below it leaves it a hit; the stage's key still
        // chains through it (below).
        let link = matches!(&step.action, Action::Copy(c) | Action::Add(c) if c.link);
        let parent = if link {
            ctx.scoped_key(key::root_key("link", "", &stage.platform))
        } else {
            st.key.clone()
        };
        let key = key::StepKey {
            parent: &parent,
            step: &canonical,
            env: if link { &[] } else { &env },
            user: if link { None } else { user.as_deref() },
            workdir: &step.context.workdir,
            sources: sources.as_deref(),
        }
        .key();
        let instruction = short(&describe(step));
        let hit = if use_cache {
            lookup(&ctx, &key).await?
        } else {
            None
        };
        // A miss only: what the key was made from, and why the nearest earlier build's
        // entry is not this one (one read).
        let missed = match hit {
            Some(_) => None,
            None => {
                let inputs = step_inputs(
                    &ctx,
                    i,
                    &parent,
                    &key,
                    step,
                    &env,
                    user.as_deref(),
                    &prepared,
                );
                let id = index_of(&ctx, i, position, &inputs.instruction);
                let why = why_missed(&ctx, use_cache, &id, &inputs).await;
                Some((inputs, id, why))
            }
        };
        (ctx.events)(BuildEvent::Step {
            index,
            stage: i,
            location: loc.clone(),
            instruction: instruction.clone(),
            cached: hit.is_some(),
            why: missed.as_ref().map(|m| m.2.clone()).unwrap_or_default(),
            runs_command: matches!(step.action, Action::Run(_)),
        });
        let layer = match hit {
            Some(l) => {
                ctx.cached.fetch_add(1, Ordering::Relaxed);
                l
            }
            None => {
                let l =
                    run_step(&ctx, step, index, &st, &env, user.clone(), &loc, prepared).await?;
                ctx.run.fetch_add(1, Ordering::Relaxed);
                share_entry(&ctx, &key, &l.desc.digest).await?;
                if let Some((inputs, id, _)) = &missed {
                    record_inputs(&ctx, &key, id, inputs).await;
                }
                (ctx.events)(BuildEvent::Layer {
                    index,
                    digest: l.desc.digest.clone(),
                    size: l.desc.size,
                });
                l
            }
        };
        hold(&ctx, [layer.desc.digest.as_str()]).await?;
        st.config.rootfs.diff_ids.push(layer.diff_id.clone());
        st.config.history.push(History {
            created: ctx.epoch.map(config::rfc3339),
            created_by: Some(describe(step)),
            comment: None,
            empty_layer: false,
        });
        st.layers.push(layer);
        st.key = if link {
            key::chained(&st.key, &key)
        } else {
            key
        };
    }
    st.config.config = config::merge_run_config(&base_run, &stage.config);
    st.config.created = ctx.epoch.map(config::rfc3339);
    Ok(st)
}

/// The image's own CA bundle as a step over `lowers` (topmost first) sees it: the first of
/// [`ca::SYSTEM_BUNDLES`] that is a regular file in the merged view, read inside it
/// (symlinks resolved within the root), or `None` when there is none, none that resolves (a
/// symlink loop), or it is larger than [`ca::MAX_SYSTEM_BUNDLE_BYTES`] (the step's bundle then
/// holds the extra certificates alone, and says nothing more: the step fails its TLS checks
/// as the image alone would).
async fn image_ca_bundle(
    ctx: &Arc<Ctx>,
    lowers: Vec<PathBuf>,
) -> Result<Option<Vec<u8>>, ExecError> {
    if lowers.is_empty() {
        return Ok(None);
    }
    let s = scratch(ctx).map_err(|e| ExecError::Setup(e.to_string()))?;
    let (upper, work, mnt) = (
        s.upper.clone().unwrap_or_default(),
        s.work.clone(),
        s.mnt.clone(),
    );
    let r = tokio::task::spawn_blocking(move || {
        merged::with_merged(lowers, upper, work, mnt, |root| {
            use crate::copy::root::{Root, read_bounded};
            let root = Root::open(root).map_err(|e| e.to_string())?;
            for p in ca::SYSTEM_BUNDLES {
                match read_bounded(&root, p, ca::MAX_SYSTEM_BUNDLE_BYTES + 1) {
                    Ok(None) => continue,
                    Ok(Some(b)) if b.len() as u64 > ca::MAX_SYSTEM_BUNDLE_BYTES => {
                        return Ok(None);
                    }
                    Ok(Some(b)) => return Ok(Some(b)),
                    // A symlink loop, a path through a file: the image has no usable bundle
                    // there, and its own tools fail on it as they would without kiln.
                    Err(_) => continue,
                }
            }
            Ok(None)
        })
    })
    .await
    .map_err(|e| ExecError::Setup(format!("reading the image's CA bundle: {e}")))?;
    drop(s);
    r.map_err(|e| ExecError::Setup(format!("reading the image's CA bundle: {e}")))
}

fn blob_digest(d: &str) -> Result<BlobDigest, BuildError> {
    let hex = crate::cache::sha256_hex(d)?;
    BlobDigest::from_key(&format!("blobs/sha256/{hex}"))
        .ok_or_else(|| BuildError::Task(format!("digest {d} does not convert")))
}

#[allow(clippy::too_many_arguments)]
async fn run_step(
    ctx: &Arc<Ctx>,
    step: &Step,
    index: usize,
    st: &StageOut,
    env: &[String],
    user: Option<String>,
    loc: &str,
    prepared: Prepared,
) -> Result<LayerRef, BuildError> {
    let s = scratch(ctx)?;
    let upper = s.upper.clone().unwrap_or_default();
    match &step.action {
        Action::Run(_) => {
            let remaining = ctx.deadline.saturating_duration_since(Instant::now());
            let mounts = prepared.mounts.clone().unwrap_or_default();
            let mut spec = StepSpec::from_plan_with_mounts(
                index,
                step,
                Vec::new(),
                upper,
                s.work.clone(),
                remaining,
                &mounts,
            )
            .map_err(|e| BuildError::Step {
                location: loc.to_string(),
                instruction: short(&describe(step)),
                error: e,
            })?;
            spec.lower_dirs = step_lowers(ctx, &st.layers, ctx.executor.max_lowers(&spec)).await?;
            // The plan's env merged over the base's, then what the spec adds after it (the
            // proxy build args, secret env).
            let added: Vec<String> = spec
                .env
                .split_off(step.context.env.len().min(spec.env.len()));
            spec.env = env.to_vec();
            spec.env.extend(added);
            spec.user = user;
            if let Some(ca) = &ctx.opts.fetch.ca_certs {
                let step_err = |error| BuildError::Step {
                    location: loc.to_string(),
                    instruction: short(&describe(step)),
                    error,
                };
                if spec
                    .files
                    .iter()
                    .any(|f| f.path.as_deref() == Some(ca::BUNDLE_PATH))
                {
                    return Err(step_err(ExecError::Setup(format!(
                        "a heredoc named {} would replace the extra CA certificates' bundle",
                        ca::BUNDLE_PATH
                    ))));
                }
                let system = image_ca_bundle(ctx, spec.lower_dirs.clone())
                    .await
                    .map_err(step_err)?;
                spec.files.push(ca.bundle_file(system.as_deref()));
                spec.env.extend(ca::bundle_env());
            }
            spec.layer_limits = ctx.layer_limits();
            let used = ctx.log_bytes.load(Ordering::Relaxed);
            spec.log_budget = Some(ctx.opts.exec.log_limits.total_max.saturating_sub(used));
            let c = ctx.clone();
            let r = tokio::task::spawn_blocking(move || {
                let events = c.events.clone();
                c.executor
                    .run(&spec, &c.cancel, &mut |l| events(BuildEvent::Log(l)))
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
            match r {
                Ok(report) => {
                    ctx.log_bytes.fetch_add(report.log_bytes, Ordering::Relaxed);
                }
                Err(ExecError::Cancelled) => return Err(BuildError::Cancelled),
                Err(ExecError::Timeout { stopped, .. }) if Instant::now() >= ctx.deadline => {
                    return Err(BuildError::Timeout {
                        location: loc.to_string(),
                        after: ctx.timeout,
                        stopped: Some(format!("{}: {stopped}", short(&describe(step)))),
                    });
                }
                Err(e) => {
                    return Err(BuildError::Step {
                        location: loc.to_string(),
                        instruction: short(&describe(step)),
                        error: e,
                    });
                }
            }
        }
        Action::Mkdir(m) => {
            let lowers = step_lowers(ctx, &st.layers, OVERLAY_MAX_LOWERS).await?;
            let (path, mode) = (m.path.clone(), m.mode);
            let user = user.clone();
            let r = tokio::task::spawn_blocking({
                let (upper, work, mnt) = (upper.clone(), s.work.clone(), s.mnt.clone());
                move || {
                    merged::with_merged(lowers, upper, work, mnt, move |root| {
                        let (uid, gid) = match &user {
                            None => (0, 0),
                            Some(u) => {
                                let passwd =
                                    fs::read_to_string(root.join("etc/passwd")).unwrap_or_default();
                                let group =
                                    fs::read_to_string(root.join("etc/group")).unwrap_or_default();
                                let eu = crate::exec::user::resolve_user(Some(u), &passwd, &group)
                                    .map_err(|e| e.to_string())?;
                                (eu.uid, eu.gid)
                            }
                        };
                        merged::mkdir_in_root(root, &path, mode, uid, gid)
                            .map(|_| ())
                            .map_err(|e| format!("creating {path}: {e}"))
                    })
                }
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
            r.map_err(|source| BuildError::Merged {
                location: loc.to_string(),
                source,
            })?;
        }
        Action::Copy(c) | Action::Add(c) if c.link => {
            // `--link`: onto an empty root, the step's upper directory itself, so the layer
            // holds the copied files and their parent directories and nothing of the layers
            // below (BuildKit's independent layer). `--chown` is numeric or root
            // ([`check_supported`]), so no user database is read.
            let sources = prepared.sources.clone().ok_or_else(|| BuildError::Copy {
                location: loc.to_string(),
                message: "sources were not prepared".into(),
            })?;
            let mut c = c.clone();
            c.chown = c.chown.as_deref().map(numeric_chown);
            let opts = CopyOptions {
                tar_limits: ctx.layer_limits(),
                ..CopyOptions::default()
            };
            let root = upper.clone();
            tokio::task::spawn_blocking(move || crate::copy::copy_into(&c, &sources, &root, &opts))
                .await
                .map_err(|e| BuildError::Task(e.to_string()))?
                .map_err(copy_err(loc))?;
        }
        Action::Copy(c) | Action::Add(c) => {
            let lowers = step_lowers(ctx, &st.layers, OVERLAY_MAX_LOWERS).await?;
            let sources = prepared.sources.clone().ok_or_else(|| BuildError::Copy {
                location: loc.to_string(),
                message: "sources were not prepared".into(),
            })?;
            let c = c.clone();
            let limits = ctx.layer_limits();
            let r = tokio::task::spawn_blocking({
                let (upper, work, mnt) = (upper.clone(), s.work.clone(), s.mnt.clone());
                move || {
                    merged::with_merged(lowers, upper, work, mnt, move |root| {
                        let opts = CopyOptions {
                            tar_limits: limits,
                            ..CopyOptions::default()
                        };
                        crate::copy::copy_into(&c, &sources, root, &opts)
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    })
                }
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
            r.map_err(|source| BuildError::Merged {
                location: loc.to_string(),
                source,
            })?;
        }
    }
    drop(prepared);
    commit_upper(ctx, s).await
}

/// Adds the sandbox preparation layer to the target stage.
async fn sandbox_layer(ctx: &Arc<Ctx>, out: &mut StageOut) -> Result<(), BuildError> {
    let key = key::generated_key(&out.key, "sandbox-preparation-v2");
    let index = ctx.step_counter.fetch_add(1, Ordering::Relaxed);
    let hit = if ctx.opts.no_cache {
        None
    } else {
        lookup(ctx, &key).await?
    };
    let missed = match hit {
        Some(_) => None,
        None => {
            let inputs = why::StepInputs {
                v: why::INPUTS_VERSION,
                key: key.clone(),
                base: "sandbox".into(),
                parent: out.key.clone(),
                instruction: why::text_digest(SANDBOX_LAYER_CREATED_BY),
                ..why::StepInputs::default()
            };
            let id = index_of(ctx, usize::MAX, 0, &inputs.instruction);
            let why = why_missed(ctx, true, &id, &inputs).await;
            Some((inputs, id, why))
        }
    };
    (ctx.events)(BuildEvent::Step {
        index,
        stage: ctx.plan.target,
        location: "(generated)".into(),
        instruction: SANDBOX_LAYER_CREATED_BY.into(),
        cached: hit.is_some(),
        why: missed.as_ref().map(|m| m.2.clone()).unwrap_or_default(),
        runs_command: false,
    });
    let layer = match hit {
        Some(l) => l,
        None => {
            let s = scratch(ctx)?;
            let upper = s.upper.clone().unwrap_or_default();
            let t = ctx.epoch.unwrap_or(0);
            make_sandbox_tree(&upper, t).map_err(io_err("writing", &upper))?;
            let l = commit_upper(ctx, s).await?;
            share_entry(ctx, &key, &l.desc.digest).await?;
            if let Some((inputs, id, _)) = &missed {
                record_inputs(ctx, &key, id, inputs).await;
            }
            (ctx.events)(BuildEvent::Layer {
                index,
                digest: l.desc.digest.clone(),
                size: l.desc.size,
            });
            l
        }
    };
    hold(ctx, [layer.desc.digest.as_str()]).await?;
    out.config.rootfs.diff_ids.push(layer.diff_id.clone());
    out.config.history.push(History {
        created: ctx.epoch.map(config::rfc3339),
        created_by: Some(SANDBOX_LAYER_CREATED_BY.into()),
        comment: Some("generated by kiln".into()),
        empty_layer: false,
    });
    out.layers.push(layer);
    out.key = key;
    Ok(())
}

/// `etc/` (0755), `etc/machine-id` (empty, 0444) and `etc/hostname` (0644), root-owned,
/// every mtime `t`.
fn make_sandbox_tree(root: &Path, t: u64) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let etc = root.join("etc");
    fs::create_dir(&etc)?;
    fs::write(etc.join("machine-id"), b"")?;
    fs::write(etc.join("hostname"), format!("{SANDBOX_HOSTNAME}\n"))?;
    fs::write(etc.join("hosts"), sandbox_hosts())?;
    for (p, mode) in [
        (etc.join("machine-id"), 0o444),
        (etc.join("hostname"), 0o644),
        (etc.join("hosts"), 0o644),
        (etc.clone(), 0o755),
    ] {
        fs::set_permissions(&p, fs::Permissions::from_mode(mode))?;
        std::os::unix::fs::lchown(&p, Some(0), Some(0))?;
        let ts = rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec {
                tv_sec: t as i64,
                tv_nsec: 0,
            },
            last_modification: rustix::fs::Timespec {
                tv_sec: t as i64,
                tv_nsec: 0,
            },
        };
        rustix::fs::utimensat(
            rustix::fs::CWD,
            &p,
            &ts,
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )?;
    }
    Ok(())
}

/// Writes the config and manifest blobs of the target stage.
async fn finish(ctx: &Ctx, out: StageOut, target: usize) -> Result<BuildOutput, BuildError> {
    let config_bytes = out.config.to_bytes();
    let config_digest = crate::cache::digest_of(&config_bytes);
    ctx.cache.put_bytes(&config_digest, &config_bytes)?;
    let config_desc = Descriptor {
        media_type: OCI_CONFIG.into(),
        digest: config_digest,
        size: config_bytes.len() as u64,
        platform: None,
        annotations: None,
    };
    let layers: Vec<Descriptor> = out.layers.iter().map(|l| l.desc.clone()).collect();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": config_desc,
        "layers": layers,
    });
    // A JSON value always serializes.
    let manifest_bytes = serde_json::to_vec(&manifest).expect("JSON values serialize");
    let manifest_digest = crate::cache::digest_of(&manifest_bytes);
    hold(ctx, [config_desc.digest.as_str(), manifest_digest.as_str()]).await?;
    ctx.cache.put_bytes(&manifest_digest, &manifest_bytes)?;
    let mut provenance = BTreeMap::new();
    provenance.insert(
        "kiln.version".to_string(),
        env!("CARGO_PKG_VERSION").to_string(),
    );
    for (i, b) in ctx.bases.iter().enumerate() {
        if let ResolvedBase::Image {
            reference, digest, ..
        } = b
        {
            provenance.insert(format!("base.{i}.reference"), reference.clone());
            provenance.insert(format!("base.{i}.digest"), digest.clone());
        }
    }
    provenance.insert("target".into(), target.to_string());
    let recipe_digest = match &ctx.opts.recipe_digest {
        Some(d) => d.clone(),
        None => crate::cache::digest_of(plan_json_without_paths(&ctx.plan).as_bytes()),
    };
    Ok(BuildOutput {
        image: BuiltImage {
            oci_manifest: Descriptor {
                media_type: OCI_MANIFEST.into(),
                digest: manifest_digest,
                size: manifest_bytes.len() as u64,
                platform: None,
                annotations: None,
            },
            config: config_desc,
            layers,
            sandbox: ctx.plan.sandbox.clone(),
            recipe_digest,
            provenance,
            source_date_epoch: ctx.epoch,
        },
        config: out.config,
        stats: BuildStats {
            steps_run: ctx.run.load(Ordering::Relaxed),
            steps_cached: ctx.cached.load(Ordering::Relaxed),
        },
        lease: ctx.lease.clone(),
    })
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// What a step needs besides its parent: copy sources, mount inputs, and the digest of
/// what it reads for its cache key.
#[derive(Default)]
struct Prepared {
    /// `COPY`/`ADD`: the sources (with `ADD`'s downloads).
    sources: Option<Sources>,
    /// `RUN --mount`: what the mounts resolve against.
    mounts: Option<MountInputs>,
    /// Digest of the sources or bound inputs, for the cache key.
    digest: Option<String>,
    /// The build-context entries read (for [`why::StepInputs::files`]).
    files: crate::copy::ContextFiles,
    /// Scratch removed after the step.
    _temps: Vec<TempDir>,
}

/// The merged tree of a finished stage as a plain directory: its layers squashed into one
/// ([`LayerDirs::squashed`], each layer once at its topmost place as for lowers), made once
/// per list of layers and collected with the layer directories.
async fn stage_tree(ctx: &Arc<Ctx>, st: &StageOut) -> Result<PathBuf, BuildError> {
    let c = ctx.clone();
    let digests: Vec<String> = st.layers.iter().map(|l| l.desc.digest.clone()).collect();
    tokio::task::spawn_blocking(move || {
        let bottom_first: Vec<String> = topmost_unique(&digests)
            .into_iter()
            .rev()
            .cloned()
            .collect();
        Ok(c.dirs
            .squashed(c.cache.as_ref(), &bottom_first, &c.layer_limits())?)
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?
}

fn copy_err(loc: &str) -> impl FnOnce(crate::copy::CopyError) -> BuildError + '_ {
    move |e| BuildError::Copy {
        location: loc.to_string(),
        message: e.to_string(),
    }
}

/// Sources of a copy from `from`, resolved against the stages built so far.
async fn source_root(
    ctx: &Arc<Ctx>,
    from: Option<&MountFrom>,
    inputs: &BTreeMap<usize, StageOut>,
    platform: &str,
    loc: &str,
) -> Result<Sources, BuildError> {
    match from {
        None => {
            let (dir, ignore) = ctx.opts.context.clone().ok_or_else(|| BuildError::Copy {
                location: loc.to_string(),
                message: "this build has no build context".into(),
            })?;
            Ok(Sources::context(dir, ignore))
        }
        Some(MountFrom::Stage { stage }) => {
            let so = inputs.get(stage).ok_or_else(|| {
                BuildError::Plan(format!(
                    "{loc}: stage {stage} is not built before this step"
                ))
            })?;
            Ok(Sources::tree(stage_tree(ctx, so).await?))
        }
        Some(MountFrom::Image { reference }) => Ok(Sources::tree(
            image_tree(ctx, reference, platform, loc).await?,
        )),
    }
}

/// The root of image `reference` (resolved as a FROM is, for `platform`) as a plain
/// directory `work/trees/image-<hex>`, unpacked once per manifest digest.
async fn image_tree(
    ctx: &Arc<Ctx>,
    reference: &str,
    platform: &str,
    loc: &str,
) -> Result<PathBuf, BuildError> {
    let platform = crate::image::Platform::parse(platform).map_err(|e| BuildError::Copy {
        location: loc.to_string(),
        message: e.to_string(),
    })?;
    let digest = crate::resolve::resolve_reference(
        &ctx.opts.resolve,
        reference,
        platform,
        ctx.cache.as_ref(),
    )
    .await
    .map_err(|e| BuildError::Copy {
        location: loc.to_string(),
        message: format!("--from={reference}: {e}"),
    })?;
    let dir = ctx
        .opts
        .work_dir
        .join("trees")
        .join(format!("image-{}", crate::cache::sha256_hex(&digest)?));
    if dir.is_dir() {
        return Ok(dir);
    }
    let c = ctx.clone();
    let loc = loc.to_string();
    tokio::task::spawn_blocking(move || {
        let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::create_dir_all(&parent).map_err(io_err("creating", &parent))?;
        // Private, as layers/ is (LayerDirs::open): an image's device nodes are in its tree.
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&parent, fs::Permissions::from_mode(0o700))
                .map_err(io_err("making private", &parent))?;
        }
        let tmp = parent.join(c.dirs.temp("image").file_name().unwrap_or_default());
        let guard = TempDir(tmp.clone());
        crate::base::unpack(c.cache.as_ref(), &digest, &tmp, &c.layer_limits()).map_err(|e| {
            BuildError::Copy {
                location: loc.clone(),
                message: e.to_string(),
            }
        })?;
        if let Err(e) = fs::rename(&tmp, &dir)
            && !dir.is_dir()
        {
            return Err(io_err("moving an image tree to", &dir)(e));
        }
        drop(guard);
        Ok(dir)
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?
}

/// Digest of the sources of `c` in `src`, with the context entries read (blocking work on
/// a worker thread).
async fn digest_sources(
    c: &CopyStep,
    src: &Sources,
    loc: &str,
) -> Result<(String, crate::copy::ContextFiles), BuildError> {
    let (c2, s2) = (c.clone(), src.clone());
    tokio::task::spawn_blocking(move || crate::copy::sources_digest_with_files(&c2, &s2))
        .await
        .map_err(|e| BuildError::Task(e.to_string()))?
        .map_err(copy_err(loc))
}

async fn prepare_inputs(
    ctx: &Arc<Ctx>,
    step: &Step,
    inputs: &BTreeMap<usize, StageOut>,
    platform: &str,
    loc: &str,
) -> Result<Prepared, BuildError> {
    let mut p = Prepared::default();
    match &step.action {
        Action::Copy(c) | Action::Add(c) => {
            let mut src = source_root(ctx, c.from.as_ref(), inputs, platform, loc).await?;
            if c.sources
                .iter()
                .any(|s| matches!(s, CopySource::Url { .. } | CopySource::Git { .. }))
            {
                let dir = ctx.dirs.temp("download");
                fs::create_dir(&dir).map_err(io_err("creating", &dir))?;
                p._temps.push(TempDir(dir.clone()));
                // A build-wide allow-list holds for ADD's downloads too.
                let mut fetch = ctx.opts.fetch.clone();
                if let Some(kiln_recipes::plan::Network::Allow(rules)) = &ctx.opts.network {
                    fetch.rules = Some(rules.clone());
                }
                // A git source over ssh authenticates with the `default` agent (BuildKit's).
                fetch.ssh_agent = ctx.opts.ssh.get("default").cloned();
                let d = crate::copy::fetch::fetch_urls(c, &dir, &fetch)
                    .await
                    .map_err(|e| BuildError::Copy {
                        location: loc.to_string(),
                        message: e.to_string(),
                    })?;
                src = src.with_downloads(d);
            }
            let (digest, files) = digest_sources(c, &src, loc).await?;
            p.digest = Some(digest);
            p.files = files;
            p.sources = Some(src);
        }
        Action::Run(r) if !r.mounts.is_empty() => {
            let mut mi = MountInputs {
                context: ctx.opts.context.clone(),
                cache_dir: Some(
                    ctx.opts
                        .cache_mount_dir
                        .clone()
                        .unwrap_or_else(|| ctx.opts.work_dir.join("cache-mounts")),
                ),
                secrets: ctx.opts.secrets.clone(),
                ssh: ctx.opts.ssh.clone(),
                ..MountInputs::default()
            };
            let scratch = ctx.dirs.temp("mount-scratch");
            fs::create_dir(&scratch).map_err(io_err("creating", &scratch))?;
            p._temps.push(TempDir(scratch.clone()));
            mi.scratch_dir = Some(scratch);
            // What bind mounts read enters the key: a stage by its key, the context by the
            // digest of the bound path's content.
            let mut parts: Vec<String> = Vec::new();
            for m in &r.mounts {
                let (from, source) = match m {
                    Mount::Bind { from, source, .. } => (from.as_ref(), Some(source.clone())),
                    Mount::Cache { from, source, .. } => (from.as_ref(), source.clone()),
                    _ => continue,
                };
                match from {
                    Some(MountFrom::Stage { stage }) => {
                        let so = inputs.get(stage).ok_or_else(|| {
                            BuildError::Plan(format!("{loc}: stage {stage} is not built yet"))
                        })?;
                        mi.stage_roots.insert(*stage, stage_tree(ctx, so).await?);
                        parts.push(format!("stage:{}", so.key));
                    }
                    Some(MountFrom::Image { reference }) => {
                        let tree = image_tree(ctx, reference, platform, loc).await?;
                        parts.push(format!(
                            "image:{}",
                            tree.file_name()
                                .map(|n| n.to_string_lossy().into_owned())
                                .unwrap_or_default()
                        ));
                        mi.image_roots.insert(reference.clone(), tree);
                    }
                    None if matches!(m, Mount::Bind { .. }) => {
                        let src = source_root(ctx, None, inputs, platform, loc).await?;
                        let path = source.unwrap_or_else(|| ".".into());
                        let sel = CopyStep {
                            sources: vec![CopySource::Path { path }],
                            dest: "/".into(),
                            from: None,
                            chown: None,
                            chmod: None,
                            link: false,
                            parents: false,
                            exclude: Vec::new(),
                            checksum: None,
                            unpack: false,
                            keep_git_dir: false,
                        };
                        let (digest, files) = digest_sources(&sel, &src, loc).await?;
                        parts.push(format!("context:{digest}"));
                        p.files.merge(files);
                    }
                    None => {}
                }
            }
            if !parts.is_empty() {
                p.digest = Some(crate::cache::digest_of(parts.join("\n").as_bytes()));
            }
            p.mounts = Some(mi);
        }
        _ => {}
    }
    Ok(p)
}

/// The plan's JSON with file names cut to their last component.
fn plan_json_without_paths(plan: &BuildPlan) -> String {
    fn base(f: &mut String) {
        if let Some((_, b)) = f.rsplit_once('/') {
            *f = b.to_string();
        }
    }
    let mut p = plan.clone();
    base(&mut p.file);
    for st in &mut p.stages {
        base(&mut st.location.file);
        for step in &mut st.steps {
            base(&mut step.location.file);
        }
    }
    for w in &mut p.warnings {
        if let Some(l) = &mut w.location {
            base(&mut l.file);
        }
    }
    kiln_recipes::plan_to_json(&p)
}

#[cfg(test)]
mod tests {
    use super::{is_numeric_chown, numeric_chown, topmost_unique};

    #[test]
    fn linked_chown_takes_numbers_and_root_only() {
        for ok in ["0", "1234", "1234:0", "root", "root:root", "1000:root"] {
            assert!(is_numeric_chown(ok), "{ok}");
        }
        for name in [
            "1:2:3",
            "4294967295",
            "4294967296",
            "0:4294967295",
            "nobody",
            "1000:staff",
            "",
            ":",
            "1000:",
            "-1",
            "1e3",
            "root:x",
        ] {
            assert!(!is_numeric_chown(name), "{name}");
        }
        assert_eq!(numeric_chown("root:root"), "0:0");
        assert_eq!(numeric_chown("1234:root"), "1234:0");
        assert_eq!(numeric_chown("7"), "7");
    }

    #[test]
    fn lowers_keep_each_layer_once_at_its_topmost_place() {
        let d = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        // Bottom first in, topmost first out.
        assert_eq!(
            topmost_unique(&d(&["base", "a", "empty", "b", "empty", "a"])),
            ["a", "empty", "b", "base"]
        );
        assert_eq!(topmost_unique(&d(&["x", "x", "x"])), ["x"]);
        assert!(topmost_unique(&[]).is_empty());
    }
}
