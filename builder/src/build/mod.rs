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
#[cfg(test)]
mod driver_tests;
mod error;
mod inputs;
pub mod key;
pub mod lower;
pub mod merged;
mod sandbox;
mod step;
mod step_cache;
pub mod why;

use self::inputs::*;
use self::sandbox::*;
use self::step::*;
use self::step_cache::*;

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use kiln_recipes::plan::{Action, BuildPlan, MountFrom, Stage, Step};
use kiln_store::digest::Sha256Hash;
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

/// What [`clean_up_dead_builds`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadBuilds {
    /// Step cgroups of dead builds, their processes killed ([`crate::exec::cgroup::reap_dead`]).
    pub cgroups: Vec<PathBuf>,
    /// Their directories in the work directory ([`crate::workdir::reap_dead_builds`]).
    pub dirs: Vec<PathBuf>,
}

/// Cleans up after builds that died in `work_dir` whose step cgroups are under
/// `cgroup_parent` ([`crate::exec::ExecConfig::cgroup_parent`]): kills what is left in
/// their cgroups and removes those, then their directories. Their leases are the store's
/// ([`kiln_store::Store::release_dead_leases`], and GC). Run by every build before it
/// starts, and by `kiln store gc`.
pub fn clean_up_dead_builds(work_dir: &Path, cgroup_parent: &str) -> DeadBuilds {
    DeadBuilds {
        cgroups: crate::exec::cgroup::reap_dead(cgroup_parent),
        dirs: crate::workdir::reap_dead_builds(work_dir),
    }
}

/// OCI image config media type (`media-types.md`).
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI gzip layer media type (`media-types.md`).
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// OCI zstd layer media type (`media-types.md`, image spec v1.1): what a build writes its
/// layers as ([`crate::layer::write`]).
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// OCI uncompressed layer media type (`media-types.md`).
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
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
    pub recipe_digest: Option<Sha256Hash>,
    /// How images named by `COPY --from=<image>` and `RUN --mount=from=<image>` are found
    /// (pull policy, build contexts, registry access; the stage's platform is used).
    pub resolve: crate::resolve::ResolveOptions,
    /// Where `RUN --mount=type=cache` directories persist, one per cache id; `None`:
    /// `work_dir/cache-mounts`. Builds given different directories share no cache mount
    /// (the caller's scope, e.g. one directory per workspace).
    pub cache_mount_dir: Option<PathBuf>,
    /// The host's package download cache, one directory per entry of
    /// [`crate::exec::mounts::packages::PACKAGE_CACHES`] under it, mounted on those paths in
    /// every `RUN` step ([`crate::exec::mounts::packages::package_mounts`]); only for trusted
    /// builds (the CLI, the nightly), never a tenant's. `None`: no cache mounted. Either way
    /// those paths leave every `RUN` step's layer, so the layers do not depend on it.
    pub package_cache: Option<PathBuf>,
    /// The store lease the build records what it relies on in (the caller's, taken before
    /// it resolved the bases); `None`: the build takes its own.
    pub lease: Option<Arc<kiln_store::lease::Lease>>,
    /// The name of the build's history (its first tag): a step that misses the cache is
    /// compared with the same recipe position in the last build of this name
    /// ([`why::index_id`]); `None`: with the last run of the same instruction text.
    pub history: Option<String>,
    /// The host's shared layer directory: layers unpacked from blobs go there, digest
    /// checked, and are found there by every build of the host whatever its work directory
    /// ([`lower::LayerDirs::open_shared`], used only on `work_dir`'s file system; its path,
    /// like `work_dir`'s, must not hold `:` or `,`, as it becomes an overlay lower); `None`:
    /// into `work_dir/layers`, as a step's own layers always go.
    pub shared_layers: Option<PathBuf>,
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
            package_cache: None,
            lease: None,
            history: None,
            shared_layers: None,
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
        digest: BlobDigest,
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
    /// The sha256 of the layer's uncompressed tar (OCI `rootfs.diff_ids`): no store object
    /// (the blob is the compressed bytes), so a plain hash, not a [`BlobDigest`].
    diff_id: Sha256Hash,
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
    let epoch = source_date_epoch(plan)?;
    let timeout = Duration::from_secs(plan.limits.timeout_secs);
    // What builds killed before they could clean up left: their step processes (any still
    // in a step cgroup), their scratch directories and their leases (crate::workdir).
    let (work, cgroups) = (opts.work_dir.clone(), opts.exec.cgroup_parent.clone());
    let dead = tokio::task::spawn_blocking(move || clean_up_dead_builds(&work, &cgroups))
        .await
        .map_err(|e| BuildError::Task(e.to_string()))?;
    // A store whose leases cannot be read fails GC, which names the object; the build
    // itself does not depend on them.
    let released = store.release_dead_leases().await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "not releasing dead builds' leases");
        Vec::new()
    });
    if dead != DeadBuilds::default() || !released.is_empty() {
        tracing::info!(
            cgroups = dead.cgroups.len(),
            dirs = dead.dirs.len(),
            leases = released.len(),
            "cleaned up after dead builds"
        );
    }
    let dirs =
        LayerDirs::open_shared(&opts.work_dir.join("layers"), opts.shared_layers.as_deref())?;
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

/// The build's `SOURCE_DATE_EPOCH` (a given build arg), seconds; `None` when not given.
/// Errors: [`BuildError::Plan`] when it does not parse.
pub fn source_date_epoch(plan: &BuildPlan) -> Result<Option<u64>, BuildError> {
    match plan.build_args.given.get("SOURCE_DATE_EPOCH") {
        Some(v) => Ok(Some(
            config::parse_source_date_epoch(v).map_err(BuildError::Plan)?,
        )),
        None => Ok(None),
    }
}

/// Adds `digests` (blobs) to the build's lease.
async fn hold(ctx: &Ctx, digests: impl IntoIterator<Item = BlobDigest>) -> Result<(), BuildError> {
    let objs: Vec<_> = digests
        .into_iter()
        .map(kiln_store::ObjectRef::Blob)
        .collect();
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
/// ([`crate::user::parse_id`]: decimal, never 4294967295), as BuildKit takes them with
/// `--link`.
fn is_numeric_chown(o: &str) -> bool {
    let parts: Vec<&str> = o.split(':').collect();
    parts.len() <= 2
        && parts
            .iter()
            .all(|p| *p == "root" || crate::user::parse_id(p).is_some())
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
                digest: *digest,
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
            // The config's diff_ids enter here: each is parsed once, naming the config.
            let layers = m
                .layers
                .iter()
                .zip(&config.rootfs.diff_ids)
                .map(|(d, diff)| {
                    let diff_id = Sha256Hash::parse_prefixed(diff).map_err(|_| {
                        bad(format!(
                            "config {}: diff_id {diff:?} is not sha256:<64 hex>",
                            m.config.digest
                        ))
                    })?;
                    Ok(LayerRef {
                        desc: Descriptor {
                            media_type: config::oci_layer_media_type(&d.media_type),
                            digest: d.digest,
                            size: d.size,
                            platform: None,
                            annotations: None,
                        },
                        diff_id,
                    })
                })
                .collect::<Result<_, BuildError>>()?;
            Ok(StageOut {
                layers,
                config,
                key: root("image", &digest.to_string()),
            })
        }
    }
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
        assert!(topmost_unique::<String>(&[]).is_empty());
    }
}
