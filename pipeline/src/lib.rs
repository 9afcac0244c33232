//! kiln's build pipeline: one [`BuildRequest`] in, one [`BuildReport`] out, [`Event`]s on
//! the way. The CLI (`kiln build`), the HTTP API (`kiln serve`) and the nightly rebuild all
//! call [`run`], so the same inputs give the same digests whoever asks.
//!
//! - A [`BuildRequest`] is plain data: the [`Recipe`] (bytes and name), a [`ContextSource`],
//!   build args, target, platform, the [`NetworkPolicy`], [`Limits`], the [`Executor`], the
//!   [`CacheMountScope`], and the [`Output`]: a published image with its [`TagMove`]s and an
//!   optional [`SnapshotRequest`], or only the OCI image. Its `cancel` token stops the build.
//! - A [`Setup`] is where it runs: the [`Store`], its local blob cache, a scratch directory,
//!   registry access and the guest kernel for snapshots. One per process (or per command).
//! - [`run`] lowers the recipe and resolves its bases (`kiln_builder::resolve`), runs the
//!   steps into an OCI image (`kiln_builder::build`), publishes the ext4 image and the kiln
//!   image manifest (`kiln_builder::publish`), boots it once and stores the snapshot
//!   (`kiln_vmm::snapshot`), and only then moves the tags, by compare-and-swap where the
//!   request says so. A lease holds everything it relies on until the tags name it.
//! - An [`EventSink`] receives each [`Event`]: step started, cache hit, log line, step done,
//!   publish progress, published, snapshot stored, tagged. A closure or a channel will do.
//! - A [`BuildReport`] gives the digests, sizes, phase times and the new and reused chunk
//!   counts ([`ChunkCounts`]), and the image bases it used ([`BaseUse`],
//!   [`BuildReport::image_base`]); a [`PipelineError`] says which phase failed, and on any
//!   error no tag has moved.
//! - A rebuild of an image that follows its base sets [`BuildRequest::rebuild_check`]
//!   ([`rebuild`]): its config must keep the original's wherever the base's did not change,
//!   checked before any tag moves.

pub mod event;
pub mod nightly;
pub mod packages;
pub mod qemu_cgroups;
pub mod rebuild;
pub mod report;
pub mod request;
pub mod vm_cache;
pub mod vmexec;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Expiry of a build's lease while its bases are resolved (1 h; renewed to the build's time
/// limit plus an hour once the plan is known).
const RESOLVE_LEASE_TTL: Duration = Duration::from_secs(3600);

use kiln_builder::build::{BuildError, BuildOptions, BuildOutput};
use kiln_builder::cache::{BlobCache as _, CacheError, LocalCache};
use kiln_builder::egress::address::AddressPolicy;
use kiln_builder::front::Fronted;
use kiln_builder::publish::{PublishError, PublishOptions};
use kiln_builder::registry::RegistryOptions;
use kiln_builder::resolve::{ResolveError, ResolveOptions};
use kiln_store::manifest::ObjectRef;
use kiln_store::progress::{ProgressEvent, TransferStats};
use kiln_store::{BlobDigest, ManifestDigest, Store, StoreError, TagError, TagRef};
use kiln_vmm::SnapshotError;
use kiln_vmm::snapshot::BootAssets;

pub use event::{Event, EventSink};
/// The builder's per-step defaults that [`Limits::pids_max`] and [`Limits::write_bytes`]
/// lower.
pub use kiln_builder::egress::ca::{CaCerts, MAX_CERTS as MAX_CA_CERTS};
pub use kiln_builder::exec::{DEFAULT_PIDS_MAX, DEFAULT_WRITE_LIMIT_BYTES};
pub use kiln_builder::reference::Reference;
pub use kiln_builder::registry::Credentials;
pub use nightly::{NightlyOutcome, NightlyReport, NightlyRequest, nightly};
pub use rebuild::{ConfigSummary, RebuildCheck, check_rebuild, oci_config_summary};
pub use report::{
    BaseUse, BuildReport, ChunkCounts, PublishedImage, SnapshotSummary, StageFrom, Times,
};
pub use request::{
    BuildRequest, CacheMountScope, ContextSource, Executor, Limits, NetworkPolicy, Output, Recipe,
    Scope, SnapshotRequest, StorageQuota, TagExpect, TagMove, Tenant, WorkspaceId,
};
pub use tokio_util::sync::CancellationToken;

/// Why a build failed. Whatever the phase, no tag has moved.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The request is inconsistent (e.g. a snapshot without boot assets).
    #[error("invalid build request: {0}")]
    Request(String),
    /// The build context directory does not exist or is not a directory.
    #[error("build context {} is not a directory", .0.display())]
    ContextNotDir(PathBuf),
    /// Reading a file of the request (an ignore file) failed.
    #[error("reading {}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The local store's blob cache could not be opened.
    #[error("opening the store at {}: {source}", .path.display())]
    OpenCache {
        /// The store directory.
        path: PathBuf,
        /// Why.
        source: CacheError,
    },
    /// An ignore file does not parse; the message names file and line.
    #[error(transparent)]
    Dockerignore(#[from] kiln_recipes::dockerignore::DockerignoreError),
    /// Lowering the recipe or resolving a base image failed.
    #[error(transparent)]
    Resolve(Box<ResolveError>),
    /// A step failed, or the build hit a limit; the message names the step's file and line.
    #[error(transparent)]
    Build(Box<BuildError>),
    /// Writing the ext4 image, its chunks or the image manifest failed.
    #[error(transparent)]
    Publish(Box<PublishError>),
    /// The boot-once VM did not reach its ready check, or its snapshot was not stored.
    #[error("the boot-once snapshot failed; nothing tagged")]
    Snapshot(#[source] Box<SnapshotError>),
    /// The store failed (the build's lease).
    #[error(transparent)]
    Store(Box<StoreError>),
    /// A tag did not move: the store failed, or (compare-and-swap) the tag held something
    /// else than expected ([`kiln_store::TagError::Stale`]). Earlier tags of the request
    /// may have moved only when the store failed between two moves.
    #[error("tagging {tag}")]
    Tag {
        /// `name:tag`.
        tag: String,
        /// Why.
        #[source]
        source: Box<StoreError>,
    },
    /// A local OCI reference ([`Output::Oci`]) could not be set.
    #[error("tagging {tag}")]
    Ref {
        /// The reference.
        tag: String,
        /// Why.
        #[source]
        source: CacheError,
    },
    /// The images of the workspace's tags, with this build's image, would hold more than its
    /// storage quota ([`StorageQuota`]); no tag moved.
    #[error(
        "storage quota exceeded: with this image, the workspace's tagged images (and the \
         build contexts kept for images that follow their base) would hold {}, over its \
         quota of {}; nothing was tagged (delete tags to make room)",
        mib(*.used),
        mib(*.limit)
    )]
    StorageQuota {
        /// Raw chunk bytes the tags would hold, with the kept bytes, bytes.
        used: u64,
        /// The quota, bytes.
        limit: u64,
    },
    /// The recipe asks for something the build is not entitled to (`RUN
    /// --security=insecure` without `security.insecure`); the message names the file and
    /// line.
    #[error("{0}")]
    Entitlement(String),
    /// The request's cancellation token fired.
    #[error("build cancelled")]
    Cancelled,
    /// An image's OCI manifest or config could not be read from the local blob cache
    /// ([`oci_config_summary`]): missing, not a platform manifest, or not an image config.
    #[error("reading the image config of OCI manifest {manifest}: {reason}")]
    ImageConfig {
        /// The OCI image manifest.
        manifest: kiln_store::BlobDigest,
        /// What is wrong.
        reason: String,
    },
    /// A rebuild's config differs from the original image's in a field its base did not
    /// change ([`BuildRequest::rebuild_check`], [`check_rebuild`]); no tag moved.
    #[error(
        "rebuilt image's config differs from the original's where its base did not change: \
         {field}: expected {expected}, found {found}"
    )]
    RebuildCheck {
        /// `user`, `env KEY`, `workdir`, `entrypoint` or `cmd`.
        field: String,
        /// The original image's value: JSON (`"/bin"`, `["sh"]`) or `unset`.
        expected: String,
        /// The rebuilt image's value, rendered the same way.
        found: String,
    },
}

/// `bytes` as MiB with one decimal (`5.2 MiB`), for messages.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

impl PipelineError {
    /// The recipe's own error (it does not parse or lower; its message names the file and
    /// line), when that is why the build failed: the caller's fault, not the build's.
    pub fn recipe_error(&self) -> Option<&kiln_recipes::RecipeError> {
        match self {
            PipelineError::Resolve(e) => match &**e {
                ResolveError::Recipe(r) => Some(r),
                _ => None,
            },
            PipelineError::Build(e) => match &**e {
                BuildError::Recipe(r) => Some(r),
                _ => None,
            },
            _ => None,
        }
    }
}

impl From<StoreError> for PipelineError {
    fn from(e: StoreError) -> Self {
        PipelineError::Store(Box::new(e))
    }
}

impl From<BuildError> for PipelineError {
    fn from(e: BuildError) -> Self {
        match e {
            BuildError::Cancelled => PipelineError::Cancelled,
            e => PipelineError::Build(Box::new(e)),
        }
    }
}

impl From<ResolveError> for PipelineError {
    fn from(e: ResolveError) -> Self {
        PipelineError::Resolve(Box::new(e))
    }
}

impl From<PublishError> for PipelineError {
    fn from(e: PublishError) -> Self {
        PipelineError::Publish(Box::new(e))
    }
}

/// Where builds run: the store and the parts of this host they use. Cheap to clone.
#[derive(Clone)]
pub struct Setup {
    /// The store images, snapshots, tags, leases and build-cache entries go to: the local
    /// store directory of [`Setup::cache`], or a remote (S3) store that cache fronts
    /// ([`Setup::open`]).
    pub store: Store,
    /// The local blob cache: base image layers, step layers, OCI manifests and configs (the
    /// store's own directory, or a cache of a remote store's blobs on this host).
    pub cache: Arc<LocalCache>,
    /// The store and [`Setup::cache`]'s directory as a store, when the store is not that
    /// directory (an S3 store): images are fetched from it by name and written through to it.
    pub front: Option<Fronted>,
    /// Scratch and layer directories (`layers/`, step uppers, `cache-mounts/`, bootstrap
    /// trees); see [`BuildOptions::work_dir`] for what the file system must allow.
    pub work_dir: PathBuf,
    /// The host's shared layer directory, where layers unpacked from blobs are kept for
    /// every build of the host, whatever its store ([`BuildOptions::shared_layers`]; `kiln`'s
    /// `layer_dir`); `None`: in each work directory.
    pub layer_dir: Option<PathBuf>,
    /// The host's package download cache (`kiln`'s `<cache>/packages`), mounted on the
    /// package download directories of the `RUN` steps of builds that ask for it
    /// ([`BuildRequest::package_cache`]) and are not a tenant's
    /// ([`kiln_builder::exec::mounts::packages`]); `None`: no build gets one.
    pub package_cache: Option<PathBuf>,
    /// Registry access for base images (plain-HTTP registries, credentials).
    pub registry: RegistryOptions,
    /// Mirror for `from: {bootstrap: ...}` recipes that name none.
    pub bootstrap_mirror: Option<String>,
    /// Guest kernel and initramfs, needed by [`Output::Image`] with a snapshot.
    pub boot: Option<BootAssets>,
    /// The chunk server that records a new snapshot's prefetch list by restoring it once
    /// ([`kiln_vmm::snapshot::SnapshotOptions::record_prefetch`]; `kiln` passes itself as
    /// `kiln __lazy-serve` with this store), as `kiln snapshot` does; `None`: snapshots get no
    /// list, and their clones fetch every chunk on demand.
    pub chunk_server: Option<Vec<std::ffi::OsString>>,
    /// Stages built at once, at least 1.
    pub jobs: usize,
    /// What `RUN` steps (through the egress proxy) and `ADD <url>` may reach: public
    /// addresses only, unless a test turns on
    /// [`AddressPolicy::allow_private_addresses`] or names hosts in
    /// [`AddressPolicy::hosts`] (`--egress-allow-private-for-tests`,
    /// `--egress-host-for-tests`).
    pub addresses: AddressPolicy,
    /// Extra CA certificates every build of this host trusts (`--ca-cert`), before a
    /// request's own ([`BuildRequest::ca_certs`]); see [`kiln_builder::egress::ca`].
    pub ca_certs: Option<CaCerts>,
    /// Size of each microVM cache disk made on this host, bytes
    /// ([`kiln_builder::exec::ExecConfig::cache_disk_bytes`]; `--cache-disk-mib`).
    pub cache_disk_bytes: u64,
    /// Bound on one cache base's microVM cache disks together, bytes
    /// ([`kiln_builder::exec::ExecConfig::cache_disks_total_bytes`]; `--cache-disks-total-mib`).
    pub cache_disks_total_bytes: u64,
}

impl Setup {
    /// The local store directory `root` (created when missing) with its blob cache, scratch
    /// under `root/.build`, default registry access, no bootstrap mirror, no boot assets and
    /// 2 stages at once.
    pub async fn open_local(root: &Path) -> Result<Setup, PipelineError> {
        let store = Store::open_dir(root).await?;
        Setup::open(store, root).await
    }

    /// Builds into `store` with the files they need on this host under `local`: the blob
    /// cache (base and step layers, OCI manifests and configs, laid out as a local store
    /// directory) and scratch under `local/.build`; the rest as [`Setup::open_local`]. For a
    /// local store `local` is its own directory; for any other (S3) it is a directory of
    /// this host's cache: layers the build needs are fetched from the store into it
    /// ([`kiln_builder::cache::fetch_blob`]), and step layers go from it to the store before
    /// their build-cache entry ([`kiln_builder::cache::share_blob`]), so the store holds
    /// everything and `local` only saves downloads; a FROM is fetched from the store first
    /// ([`Setup::front`]). Errors: [`PipelineError::OpenCache`].
    pub async fn open(store: Store, local: &Path) -> Result<Setup, PipelineError> {
        let CachedStore {
            store,
            cache,
            front,
        } = CachedStore::open(store, local).await?;
        Ok(Setup {
            front,
            store,
            cache: Arc::new(cache),
            work_dir: local.join(".build"),
            layer_dir: None,
            package_cache: None,
            registry: RegistryOptions::default(),
            bootstrap_mirror: None,
            boot: None,
            chunk_server: None,
            jobs: 2,
            addresses: AddressPolicy::default(),
            ca_certs: None,
            cache_disk_bytes: kiln_builder::exec::DEFAULT_CACHE_DISK_BYTES,
            cache_disks_total_bytes: kiln_builder::exec::DEFAULT_CACHE_DISKS_TOTAL_BYTES,
        })
    }
}

/// A store with this host's blob files in front of it, as builds and the image commands
/// (`kiln pull`, `export`, `unpack`...) use it: the one way to open a store with its local
/// blob cache.
pub struct CachedStore {
    /// The store.
    pub store: Store,
    /// The blob files (laid out as a local store directory): the store's own directory, or
    /// a cache of a remote store's blobs on this host.
    pub cache: LocalCache,
    /// The store and the cache's directory as a store, when they differ (an S3 store):
    /// images are fetched from the store into the cache by name and written through to it.
    pub front: Option<Fronted>,
}

impl CachedStore {
    /// `store` with its blob cache at `local`: the store's own directory for a local store,
    /// else a directory of this host's cache (created when missing).
    ///
    /// Errors: [`PipelineError::OpenCache`]; the store errors of opening `local` as a store.
    pub async fn open(store: Store, local: &Path) -> Result<CachedStore, PipelineError> {
        let cache = LocalCache::open(local).map_err(|source| PipelineError::OpenCache {
            path: local.to_path_buf(),
            source,
        })?;
        let front = if store.local_root().as_deref() == Some(local) {
            None
        } else {
            Some(Fronted {
                remote: store.clone(),
                local: Store::open_dir(local).await?,
            })
        };
        Ok(CachedStore {
            store,
            cache,
            front,
        })
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the build `req` in `setup`, telling `events` what happens. Returns the report once
/// the tags have moved.
///
/// Order: lower and resolve → steps → (with [`Output::Image`]) ext4 image, chunks, blobs,
/// image manifest → boot once and snapshot (when asked) → tags. Every tag expectation is
/// checked before the first tag moves, so a stale compare-and-swap moves none.
///
/// Cancellation ([`BuildRequest::cancel`]) is seen between steps and kills a running step;
/// a boot in progress is stopped; resolving and writing the ext4 image run to their end
/// first. A cancelled build returns [`PipelineError::Cancelled`] and moves no tag. What was
/// stored on the way (layers, chunks, manifests) stays untagged, for GC.
pub async fn run(
    setup: &Setup,
    req: BuildRequest,
    events: Arc<dyn EventSink>,
) -> Result<BuildReport, PipelineError> {
    let (report, lease) = run_leased(setup, req, events).await?;
    let _ = lease.release().await;
    Ok(report)
}

/// [`run`], returning the build's lease still held (it holds the image, its snapshot and
/// every blob and chunk they name against GC) for a caller that tags later: the nightly job
/// smoke-tests the image before any tag names it. The caller releases it (else it expires
/// with the build's time limit plus an hour). On an error the lease is released.
pub(crate) async fn run_leased(
    setup: &Setup,
    req: BuildRequest,
    events: Arc<dyn EventSink>,
) -> Result<(BuildReport, Arc<kiln_store::lease::Lease>), PipelineError> {
    let t0 = Instant::now();
    let mut times = Times::default();
    let cancel = req.cancel.clone();
    if let Output::Image {
        snapshot: Some(_), ..
    } = &req.output
        && setup.boot.is_none()
    {
        return Err(PipelineError::Request(
            "a snapshot needs the guest kernel and initramfs (boot assets)".into(),
        ));
    }
    if req.executor == Executor::Vm && setup.boot.is_none() {
        return Err(PipelineError::Request(
            "--isolation vm needs the guest kernel and initramfs (boot assets)".into(),
        ));
    }
    let ca_certs = match (&setup.ca_certs, &req.ca_certs) {
        (Some(a), Some(b)) => Some(
            a.join(b)
                .map_err(|e| PipelineError::Request(e.to_string()))?,
        ),
        (a, b) => a.clone().or_else(|| b.clone()),
    };
    // What each `AtStart` tag names now: the build moves it only if it still does.
    let req = pin_tags(&setup.store, req).await?;

    // 1. Lower and resolve.
    let options = kiln_recipes::Options {
        target: req.target.clone(),
        build_args: req.build_args.clone(),
        platform: req.platform.clone(),
        disk_mib: req.disk_mib,
        ..Default::default()
    };
    let resolve = ResolveOptions {
        policy: req.pull,
        build_contexts: req.build_contexts.clone(),
        default_mirror: setup.bootstrap_mirror.clone(),
        work_dir: setup.work_dir.join("bootstrap"),
        registry: setup.registry.clone(),
        front: setup.front.clone(),
        scope: req.scope.clone(),
    };
    // The build's lease, taken before anything is fetched or looked up: every blob the
    // resolution writes or finds, and then the build's layers, chunks and manifest, are put
    // under it first (kiln_builder::cache::LeasedCache, kiln_store::gc).
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let lease = Arc::new(
        setup
            .store
            .create_lease(
                &format!("build-{}-{nanos}", std::process::id()),
                RESOLVE_LEASE_TTL,
                [],
            )
            .await?,
    );
    let leased_cache = kiln_builder::cache::LeasedCache::new(setup.cache.clone(), lease.clone());
    let resolved = kiln_builder::resolve::resolve_recipe(
        &req.recipe.name,
        &req.recipe.bytes,
        &options,
        &resolve,
        &leased_cache,
    )
    .await;
    let (mut plan, bases) = match resolved {
        Ok(r) => r,
        Err(e) => {
            let _ = lease.release().await;
            return Err(e.into());
        }
    };
    if let Err(e) = check_entitlements(&plan, &req) {
        let _ = lease.release().await;
        return Err(e);
    }
    for w in &plan.warnings {
        events.event(Event::Warning {
            location: w
                .location
                .as_ref()
                .map(|l| format!("{}:{}", l.file, l.start_line)),
            message: w.message.clone(),
        });
    }
    if let Some(t) = req.limits.timeout {
        let secs = t.as_secs() + u64::from(t.subsec_nanos() > 0);
        plan.limits.timeout_secs = plan.limits.timeout_secs.min(secs);
    }
    times.resolve = t0.elapsed();
    if cancel.is_cancelled() {
        let _ = lease.release().await;
        return Err(PipelineError::Cancelled);
    }
    // As long as the build may take, plus an hour to publish.
    if let Err(e) = lease
        .renew(Duration::from_secs(plan.limits.timeout_secs + 3600))
        .await
    {
        let _ = lease.release().await;
        return Err(e.into());
    }

    let froms: Vec<StageFrom> = bases.iter().map(StageFrom::of).collect();
    let base_uses = report::base_uses(&bases);
    let image_base = report::image_base(&froms, &base_uses, plan.target).map(|b| b.digest);
    // The flatten's first pass over the image's base runs while the steps do; publishing
    // continues it with the steps' layers. Dropped (stopped) when the build fails.
    let prescan = match (&req.output, image_base) {
        (Output::Image { .. }, Some(d)) => prescan_base(setup, &plan, &d),
        _ => None,
    };

    // 2. Steps.
    let t = Instant::now();
    let mut opts = build_options(setup, &req, resolve);
    opts.fetch.ca_certs = ca_certs;
    opts.lease = Some(lease.clone());
    let _bridge = {
        let (token, flag) = (cancel.clone(), opts.cancel.clone());
        AbortOnDrop(tokio::spawn(async move {
            token.cancelled().await;
            flag.store(true, Ordering::Relaxed);
        }))
    };
    let (sink, kind) = (events.clone(), req.executor);
    let sink: kiln_builder::build::EventSink =
        Arc::new(move |e| sink.event(event::from_build(e, kind)));
    // `run` refused a VM build without boot assets before anything was leased.
    let executor: Arc<dyn kiln_builder::exec::StepExecutor> = match (req.executor, &setup.boot) {
        (Executor::Vm, Some(boot)) => {
            let exec = kiln_builder::build::exec_config(&plan, &opts);
            let vcpus = req.limits.vcpus.unwrap_or(1);
            match vmexec::VmExecutor::new(boot.clone(), exec, vcpus).await {
                Ok(ex) => Arc::new(ex),
                Err(e) => {
                    let _ = lease.release().await;
                    return Err(PipelineError::Request(e.to_string()));
                }
            }
        }
        _ => Arc::new(kiln_builder::exec::LinuxExecutor::new(
            kiln_builder::build::exec_config(&plan, &opts),
        )),
    };
    let built = kiln_builder::build::build_with(
        &plan,
        &bases,
        setup.cache.clone(),
        &setup.store,
        &opts,
        sink,
        executor,
    )
    .await;
    let out = match built {
        Ok(o) => o,
        Err(e) => {
            let _ = lease.release().await;
            return Err(e.into());
        }
    };
    times.build = t.elapsed();
    let r = finish(setup, &req, &out, image_base, prescan, &events, &mut times).await;
    let (image, snapshot, tags) = match r {
        Ok(r) => r,
        Err(e) => {
            let _ = out.lease.release().await;
            return Err(e);
        }
    };
    times.total = t0.elapsed();
    let report = BuildReport {
        oci_manifest: out.image.oci_manifest.clone(),
        config: out.image.config.clone(),
        layers: out.image.layers.clone(),
        recipe_digest: out.image.recipe_digest.to_string(),
        steps_run: out.stats.steps_run,
        steps_cached: out.stats.steps_cached,
        image,
        snapshot,
        tags,
        times,
        bases: base_uses,
        froms,
        target_stage: plan.target,
    };
    Ok((report, out.lease.clone()))
}

/// Lowers `req`'s recipe with its target, build args, platform and disk size, as `kiln plan`
/// does, without resolving any base image: a caller that queues builds (the HTTP API) can
/// refuse a recipe error at submission. The error's text is `kiln plan`'s
/// (`file:line:column: message` and a snippet). [`run`] lowers again, with the bases'
/// configs, so a recipe that passes here can still fail there (e.g. a refused `ONBUILD`).
/// What lowers but kiln does not build ([`kiln_builder::build::check_supported`]: `--link
/// --chown` by name) is refused here too, as `kiln plan` refuses it, and what needs an
/// entitlement the request does not have ([`check_entitlements`]: through the API, `ADD` of
/// a git repository over ssh among others).
///
/// Returns the lowered plan (its bases unresolved), e.g. for
/// [`kiln_recipes::plan::BuildPlan::image_base`].
pub fn check_recipe(req: &BuildRequest) -> Result<kiln_recipes::plan::BuildPlan, PipelineError> {
    let options = kiln_recipes::Options {
        target: req.target.clone(),
        build_args: req.build_args.clone(),
        platform: req.platform.clone(),
        disk_mib: req.disk_mib,
        ..Default::default()
    };
    let plan = kiln_recipes::load(&req.recipe.name, &req.recipe.bytes, &options)
        .map_err(|e| PipelineError::Resolve(Box::new(ResolveError::Recipe(Box::new(e)))))?;
    kiln_builder::build::check_supported(&plan).map_err(|e| PipelineError::Build(Box::new(e)))?;
    check_entitlements(&plan, req)?;
    Ok(plan)
}

/// Refuses a step of `plan` that needs an entitlement `req` does not have: `RUN
/// --security=insecure` without [`BuildRequest::allow_insecure`]; `RUN --mount=type=ssh`
/// in a build without agents ([`BuildRequest::ssh`] `None`: the API, the nightly), under
/// the microVM executor, or `required` with its id not given; `ADD` of a git repository
/// over ssh without the `default` agent (`check_git_over_ssh`). The message names the
/// step's file and line and what would allow it. Checked before anything runs (the executors
/// check again).
pub fn check_entitlements(
    plan: &kiln_recipes::plan::BuildPlan,
    req: &BuildRequest,
) -> Result<(), PipelineError> {
    use kiln_recipes::plan::{Action, Mount, Security};
    for step in plan.stages.iter().flat_map(|s| &s.steps) {
        let at = format!("{}:{}", step.location.file, step.location.start_line);
        if let Action::Add(c) | Action::Copy(c) = &step.action {
            check_git_over_ssh(&at, c, req)?;
        }
        let Action::Run(run) = &step.action else {
            continue;
        };
        if run.security == Security::Insecure && !req.allow_insecure {
            return Err(PipelineError::Entitlement(format!(
                "{at}: RUN --security=insecure needs the security.insecure entitlement: \
                 `kiln build --allow security.insecure` (it runs the step with every \
                 capability and no seccomp filter; never allowed for builds through the API)"
            )));
        }
        for m in &run.mounts {
            let Mount::Ssh { id, required, .. } = m else {
                continue;
            };
            let agents = match &req.ssh {
                None => {
                    return Err(PipelineError::Entitlement(format!(
                        "{at}: RUN --mount=type=ssh is not available here: the build host has \
                         no SSH agent of yours (pass keys and tokens as build secrets, RUN \
                         --mount=type=secret, instead); only kiln build --ssh forwards one"
                    )));
                }
                Some(a) => a,
            };
            if req.executor == Executor::Vm {
                return Err(PipelineError::Entitlement(format!(
                    "{at}: RUN --mount=type=ssh is not supported under --isolation vm: the SSH \
                     agent is not forwarded over the guest channel"
                )));
            }
            if *required && !agents.contains_key(id) {
                return Err(PipelineError::Entitlement(format!(
                    "{at}: RUN --mount=type=ssh: SSH agent {id:?} is required but was not \
                     given (kiln build --ssh {id}[=SOCKET])"
                )));
            }
        }
    }
    Ok(())
}

/// `ADD` of a git repository over ssh (`git@host:path`, `ssh://…`) needs the `default` SSH
/// agent, as BuildKit's git source mounts it (`client/llb/source.go`): refused with the
/// step's `file:line` in a build without agents ([`BuildRequest::ssh`] `None`: the API, the
/// nightly) and in a CLI build without `--ssh default`. The fetch runs on the host under
/// either executor, so `--isolation vm` does not matter here.
fn check_git_over_ssh(
    at: &str,
    c: &kiln_recipes::plan::CopyStep,
    req: &BuildRequest,
) -> Result<(), PipelineError> {
    let ssh_url = c.sources.iter().find_map(|s| match s {
        kiln_recipes::plan::CopySource::Git { url }
            if kiln_recipes::git::GitRef::parse(url)
                .ok()
                .flatten()
                .is_some_and(|g| g.scheme == kiln_recipes::git::GitScheme::Ssh) =>
        {
            Some(url)
        }
        _ => None,
    });
    let Some(url) = ssh_url else {
        return Ok(());
    };
    match &req.ssh {
        None => Err(PipelineError::Entitlement(format!(
            "{at}: ADD {url}: git over ssh is not available here: the build host has no SSH \
             agent of yours; use an https:// URL of the repository (only kiln build --ssh \
             default forwards an agent)"
        ))),
        Some(agents) if !agents.contains_key("default") => {
            Err(PipelineError::Entitlement(format!(
                "{at}: ADD {url}: git over ssh needs an SSH agent: pass `kiln build --ssh \
                 default` (the agent of $SSH_AUTH_SOCK, or --ssh default=SOCKET), as with \
                 docker buildx build"
            )))
        }
        Some(_) => Ok(()),
    }
}

/// Starts the flatten's first pass over the layers of base image `digest`
/// ([`kiln_builder::ext4::Prescan`]) with the bounds and `SOURCE_DATE_EPOCH` the publish
/// uses, keeping inflated layers in the temporary directory. `None` when a blob is not in
/// the cache or the epoch does not parse (the build reports that).
fn prescan_base(
    setup: &Setup,
    plan: &kiln_recipes::plan::BuildPlan,
    digest: &BlobDigest,
) -> Option<kiln_builder::ext4::Prescan> {
    let m = kiln_builder::base::manifest(setup.cache.as_ref(), digest).ok()?;
    let layers = kiln_builder::publish::layer_blobs(setup.cache.as_ref(), &m.layers).ok()?;
    let sde = kiln_builder::build::source_date_epoch(plan).ok()?;
    Some(kiln_builder::ext4::Prescan::start(
        layers,
        &PublishOptions::default().limits,
        sde,
        kiln_builder::ext4::Keep::in_dir(&std::env::temp_dir()),
    ))
}

/// The builder's options for `req`.
fn build_options(setup: &Setup, req: &BuildRequest, resolve: ResolveOptions) -> BuildOptions {
    let work = &setup.work_dir;
    let mut opts = BuildOptions::new(work.clone());
    opts.no_cache = req.no_cache;
    opts.no_cache_filter = req.no_cache_filter.clone();
    opts.jobs = setup.jobs.max(1);
    opts.exec.allow_network_host =
        matches!(req.network, NetworkPolicy::AllowHost | NetworkPolicy::Host);
    opts.exec.allow_insecure = req.allow_insecure;
    opts.network = req.network.step_network();
    opts.exec.run_dir = work.join("run");
    opts.exec.cache_disk_bytes = setup.cache_disk_bytes;
    opts.exec.cache_disks_total_bytes = setup.cache_disks_total_bytes;
    opts.fetch.addresses = setup.addresses.clone();
    if let Some(m) = req.limits.memory_bytes {
        opts.exec.memory_bytes = opts.exec.memory_bytes.min(m);
    }
    if let Some(w) = req.limits.write_bytes {
        opts.exec.write_limit_bytes = opts.exec.write_limit_bytes.min(w);
    }
    if let Some(p) = req.limits.pids_max {
        opts.exec.pids_max = opts.exec.pids_max.min(p.max(1));
    }
    opts.context = match &req.context {
        ContextSource::None => None,
        ContextSource::Dir { path, dockerignore } => Some((path.clone(), dockerignore.clone())),
    };
    opts.secrets = req.secrets.clone();
    opts.ssh = req.ssh.clone().unwrap_or_default();
    opts.recipe_digest = Some(kiln_builder::cache::digest_of(&req.recipe.bytes));
    opts.history = match &req.output {
        Output::Image { tags, .. } => tags.first().map(|t| t.tag.to_string()),
        Output::Oci { refs } => refs.first().map(|r| r.to_string()),
    };
    opts.resolve = resolve;
    opts.shared_layers = setup.layer_dir.clone();
    opts.cache_mount_dir = match &req.cache_mounts {
        CacheMountScope::Shared => None,
        CacheMountScope::Workspace(w) => {
            Some(work.join("cache-mounts-by-workspace").join(w.as_str()))
        }
    };
    // A host-wide cache is never a tenant's, whatever the request says (issue 34). Nor, for
    // now, a microVM build's: its three cache disks would be more than the builder
    // snapshot's two, and every RUN step of the build would boot cold instead of restoring
    // it; until the three share one disk, those builds download as before (the layers are
    // the same either way).
    opts.package_cache = match (&req.scope, &req.cache_mounts, req.executor) {
        (Scope::Operator, CacheMountScope::Shared, Executor::Namespace) if req.package_cache => {
            setup.package_cache.clone()
        }
        _ => None,
    };
    opts
}

type Finished = (Option<PublishedImage>, Option<SnapshotSummary>, Vec<String>);

/// Everything after the steps: publish, snapshot, the rebuild check, tags (or the rebuild
/// check and the local OCI references). `image_base`: the OCI manifest of the image at the
/// root of the target stage's `FROM` chain, if any; `prescan`: the flatten's first pass over
/// its layers, started while the steps ran ([`prescan_base`]).
async fn finish(
    setup: &Setup,
    req: &BuildRequest,
    out: &BuildOutput,
    image_base: Option<BlobDigest>,
    prescan: Option<kiln_builder::ext4::Prescan>,
    events: &Arc<dyn EventSink>,
    times: &mut Times,
) -> Result<Finished, PipelineError> {
    let cancel = &req.cancel;
    if cancel.is_cancelled() {
        return Err(PipelineError::Cancelled);
    }
    let (tags, snapshot) = match &req.output {
        Output::Oci { refs } => {
            rebuild_check(setup, req, out, image_base).await?;
            let digest = &out.image.oci_manifest.digest;
            let mut names = Vec::new();
            for r in refs {
                let full = format!("{}:{}", r.name(), r.tag().unwrap_or("latest"));
                setup
                    .cache
                    .set_ref(&full, digest)
                    .map_err(|source| PipelineError::Ref {
                        tag: full.clone(),
                        source,
                    })?;
                // Other hosts find it in the store (an S3 store the cache fronts).
                if let Some(f) = &setup.front {
                    f.publish(digest, Some(&full))
                        .await
                        .map_err(|source| PipelineError::Ref {
                            tag: full.clone(),
                            source,
                        })?;
                }
                events.event(Event::Tagged {
                    tag: full.clone(),
                    manifest: digest.to_string(),
                });
                names.push(full);
            }
            return Ok((None, None, names));
        }
        Output::Image { tags, snapshot } => (tags, snapshot),
    };

    // 3. ext4 image, chunks, blobs, image manifest.
    let t = Instant::now();
    events.event(Event::Publishing);
    let stats: Arc<Mutex<TransferStats>> = Arc::default();
    let progress = {
        let (stats, events) = (stats.clone(), events.clone());
        Arc::new(move |e: &ProgressEvent| {
            stats.lock().unwrap_or_else(|p| p.into_inner()).record(e);
            events.event(Event::Progress {
                progress: e.clone(),
            });
        })
    };
    let publication = kiln_builder::publish::publish(
        &setup.store,
        setup.cache.as_ref(),
        &out.image,
        &[],
        &PublishOptions {
            disk_mib: req.disk_mib,
            progress: Some(progress),
            lease: Some(out.lease.clone()),
            workspace: match &req.scope {
                Scope::Operator => None,
                Scope::Tenant(t) => Some(t.workspace.clone()),
            },
            prescan,
            ..Default::default()
        },
    )
    .await?;
    // publish leased the manifest before writing it (or before reusing it).
    let manifest = publication.manifest;
    let totals = *stats.lock().unwrap_or_else(|p| p.into_inner());
    let published = PublishedImage {
        manifest,
        disk_bytes: totals.raw_bytes + totals.hole_bytes,
        disk: totals.into(),
        reused: publication.reused,
    };
    events.event(Event::Published {
        image: manifest,
        oci_manifest: out.image.oci_manifest.digest.to_string(),
        disk: published.disk,
        reused: publication.reused,
    });
    times.publish = t.elapsed();
    if cancel.is_cancelled() {
        return Err(PipelineError::Cancelled);
    }

    // 4. Boot once and snapshot.
    let mut target = manifest;
    let summary = match (snapshot, &setup.boot) {
        (Some(s), Some(assets)) => {
            let t = Instant::now();
            events.event(Event::Booting { image: manifest });
            let opts = kiln_vmm::snapshot::SnapshotOptions {
                vcpus: req.limits.vcpus.unwrap_or(1),
                memory_bytes: s.memory_bytes,
                ready_timeout: s.ready_timeout,
                record_prefetch: setup.chunk_server.clone(),
                ..Default::default()
            };
            qemu_cgroups::install();
            // Dropping the boot kills the VMM and removes its scratch directory.
            let r = tokio::select! {
                r = kiln_vmm::snapshot::snapshot_manifest(&setup.store, manifest, assets, &opts) => r,
                _ = cancel.cancelled() => return Err(PipelineError::Cancelled),
            }
            .map_err(|e| PipelineError::Snapshot(Box::new(e)))?;
            out.lease.add([ObjectRef::Manifest(r.image)]).await?;
            events.event(Event::SnapshotStored {
                snapshot: r.snapshot,
                image: r.image,
                accel: r.accel.name().to_string(),
                boot_to_ready_ms: r.boot_to_ready.as_millis() as u64,
                settle_ms: r.settle.as_millis() as u64,
                save_ms: r.save.as_millis() as u64,
                memory_bytes: r.memory_bytes,
                memory_stored_bytes: r.memory_stored_bytes,
            });
            times.snapshot = t.elapsed();
            target = r.image;
            Some(SnapshotSummary {
                snapshot: r.snapshot,
                image: r.image,
                accel: r.accel.name().to_string(),
                boot_to_ready: r.boot_to_ready,
                save: r.save,
                memory_bytes: r.memory_bytes,
                memory_nonzero_bytes: r.memory_nonzero_bytes,
                memory_stored_bytes: r.memory_stored_bytes,
                vmstate_bytes: r.vmstate_bytes,
            })
        }
        // `run` refused a snapshot without boot assets.
        _ => None,
    };
    if cancel.is_cancelled() {
        return Err(PipelineError::Cancelled);
    }

    // The rebuild check (issue 40), on the published (and booted) image, before any tag.
    rebuild_check(setup, req, out, image_base).await?;

    // 5. Tags, within the storage quota.
    // An untagged image holds nothing of the quota; pointing a tag at it later is checked.
    if let Some(q) = req.storage_quota.as_ref().filter(|_| !tags.is_empty()) {
        let moving: Vec<TagRef> = tags.iter().map(|m| m.tag.clone()).collect();
        check_storage_quota(&setup.store, q, &moving, target).await?;
    }
    let names = move_tags(&setup.store, tags, target, events).await?;
    Ok((Some(published), summary, names))
}

/// [`BuildRequest::rebuild_check`], when set: the built image's config against the check,
/// with `image_base`'s config as the new base, both read from the cache (where the build
/// wrote or leased them) by [`oci_config_summary`], as a caller reads the original's.
/// Errors: [`PipelineError::RebuildCheck`], [`PipelineError::ImageConfig`].
async fn rebuild_check(
    setup: &Setup,
    req: &BuildRequest,
    out: &BuildOutput,
    image_base: Option<BlobDigest>,
) -> Result<(), PipelineError> {
    let Some(check) = &req.rebuild_check else {
        return Ok(());
    };
    let new_image =
        oci_config_summary(setup.cache.as_ref(), &out.image.oci_manifest.digest).await?;
    let new_base = match image_base {
        Some(d) => Some(oci_config_summary(setup.cache.as_ref(), &d).await?),
        None => None,
    };
    check_rebuild(check, new_base.as_ref(), &new_image)
}

/// Errors with [`PipelineError::StorageQuota`] when the tags under `q`'s prefix would hold
/// more than its bytes once the tags `moving` name `new`: the images of those tags that
/// `moving` leaves alone, and `new`, plus [`StorageQuota::kept_bytes`]. What a build checks
/// before its tags move, and the service before a tenant points a tag at an image. Errors:
/// [`PipelineError::Store`] when a tag or manifest cannot be read.
pub async fn check_storage_quota(
    store: &Store,
    q: &StorageQuota,
    moving: &[TagRef],
    new: ManifestDigest,
) -> Result<(), PipelineError> {
    let store_err = |e: StoreError| PipelineError::Store(Box::new(e));
    let held = store
        .list_tags_named_from(&q.tag_prefix)
        .await
        .map_err(store_err)?;
    let kept = held
        .into_iter()
        .filter(|(t, _)| !moving.contains(t))
        .map(|(_, d)| d);
    let used = store
        .chunk_bytes(kept.chain([new]))
        .await
        .map_err(store_err)?
        .saturating_add(q.kept_bytes);
    tracing::debug!(prefix = %q.tag_prefix, used, limit = q.max_bytes, "storage quota");
    if used > q.max_bytes {
        return Err(PipelineError::StorageQuota {
            used,
            limit: q.max_bytes,
        });
    }
    Ok(())
}

/// `req` with each [`TagExpect::AtStart`] of its tags replaced by what the tag names in
/// `store` now ([`TagExpect::Pinned`]: its manifest, or `None` for a tag that does not exist).
/// Errors: [`PipelineError::Tag`] when a tag cannot be read.
async fn pin_tags(store: &Store, mut req: BuildRequest) -> Result<BuildRequest, PipelineError> {
    if let Output::Image { tags, .. } = &mut req.output {
        for m in tags.iter_mut().filter(|m| m.expect == TagExpect::AtStart) {
            let now = store
                .get_tag(&m.tag)
                .await
                .map_err(|e| PipelineError::Tag {
                    tag: m.tag.to_string(),
                    source: Box::new(e),
                })?;
            m.expect = TagExpect::Pinned(now.map(|r| r.manifest));
        }
    }
    Ok(req)
}

/// Points every tag of `moves` at `new`. Every compare-and-swap expectation is checked
/// first: when one does not hold, no tag moves. A tag already naming `new` is left alone; a
/// [`TagExpect::Pinned`] one then holds whatever it was expected to hold (another run of the
/// same build published the same image first), an expectation the caller wrote does not.
async fn move_tags(
    store: &Store,
    moves: &[TagMove],
    new: ManifestDigest,
    events: &Arc<dyn EventSink>,
) -> Result<Vec<String>, PipelineError> {
    let tag_err = |m: &TagMove| {
        let tag = m.tag.to_string();
        move |e: StoreError| PipelineError::Tag {
            tag,
            source: Box::new(e),
        }
    };
    let expected = |m: &TagMove| match m.expect {
        TagExpect::Any => None,
        TagExpect::Absent => Some(None),
        TagExpect::Digest(d) => Some(Some(d)),
        TagExpect::Pinned(d) => Some(d),
        // `run` pinned these (pin_tags); one left unpinned must still be what it was.
        TagExpect::AtStart => Some(None),
    };
    let mut current = Vec::with_capacity(moves.len());
    for m in moves {
        let now = store
            .get_tag(&m.tag)
            .await
            .map_err(tag_err(m))?
            .map(|r| r.manifest);
        let pinned = matches!(m.expect, TagExpect::Pinned(_));
        if let Some(want) = expected(m)
            && now != want
            && !(pinned && now == Some(new))
        {
            return Err(tag_err(m)(StoreError::Tag(TagError::Stale {
                tag: m.tag.clone(),
                store: store.url().to_string(),
                expected: want,
                actual: now,
            })));
        }
        current.push(now);
    }
    let mut names = Vec::with_capacity(moves.len());
    for (m, now) in moves.iter().zip(current) {
        if now != Some(new) {
            match expected(m) {
                None => store.force_tag(&m.tag, new).await.map(|_| ()),
                Some(want) => match store.set_tag(&m.tag, want, new).await {
                    // Moved to this very image by another run since the check above.
                    Err(StoreError::Tag(TagError::Stale { actual, .. }))
                        if matches!(m.expect, TagExpect::Pinned(_)) && actual == Some(new) =>
                    {
                        Ok(())
                    }
                    r => r,
                },
            }
            .map_err(tag_err(m))?;
        }
        events.event(Event::Tagged {
            tag: m.tag.to_string(),
            manifest: new.to_string(),
        });
        names.push(m.tag.to_string());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 41: what each kind of build may run. `check_recipe` (the API's check at
    /// submission) refuses both; `kiln build` takes insecure with the flag, under either
    /// executor, and ssh mounts only under the namespace executor, a required one only when
    /// its agent was given.
    #[test]
    fn entitlements_by_kind_of_build() {
        let req = |text: &str| {
            BuildRequest::new(
                Recipe {
                    name: "Dockerfile".into(),
                    bytes: text.as_bytes().to_vec(),
                },
                ContextSource::None,
            )
        };
        let insecure = "FROM scratch\nRUN --security=insecure true\n";
        let ssh = "FROM scratch\nRUN true\nRUN --mount=type=ssh,required=true true\n";
        let err = |r: &BuildRequest| check_recipe(r).unwrap_err().to_string();
        assert!(err(&req(insecure)).starts_with("Dockerfile:2: RUN --security=insecure needs"));
        assert!(
            err(&req(ssh)).starts_with("Dockerfile:3: RUN --mount=type=ssh is not available here")
        );
        let mut cli = req(insecure);
        cli.allow_insecure = true;
        check_recipe(&cli).unwrap();
        cli.executor = Executor::Vm;
        check_recipe(&cli).unwrap();
        let mut cli = req(ssh);
        cli.ssh = Some(std::collections::BTreeMap::new());
        assert!(err(&cli).contains("SSH agent \"default\" is required but was not given"));
        cli.ssh = Some(std::collections::BTreeMap::from([(
            "default".into(),
            PathBuf::from("/a.sock"),
        )]));
        check_recipe(&cli).unwrap();
        cli.executor = Executor::Vm;
        assert!(err(&cli).contains("not supported under --isolation vm"));
    }

    /// The host's cache disk sizes (`--cache-disk-mib`, `--cache-disks-total-mib`) reach
    /// the executor of every build of the setup; unset, the executor's defaults.
    #[tokio::test]
    async fn the_hosts_cache_disk_sizes_reach_the_executor() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut setup = Setup::open_local(dir.path()).await.expect("setup");
        let req = BuildRequest::new(
            crate::request::Recipe {
                name: "Dockerfile".into(),
                bytes: b"FROM scratch\n".to_vec(),
            },
            ContextSource::None,
        );
        let o = build_options(&setup, &req, ResolveOptions::default());
        assert_eq!(
            (o.exec.cache_disk_bytes, o.exec.cache_disks_total_bytes),
            (
                kiln_builder::exec::DEFAULT_CACHE_DISK_BYTES,
                kiln_builder::exec::DEFAULT_CACHE_DISKS_TOTAL_BYTES
            )
        );
        setup.cache_disk_bytes = 64 << 20;
        setup.cache_disks_total_bytes = 256 << 20;
        let o = build_options(&setup, &req, ResolveOptions::default());
        assert_eq!(
            (o.exec.cache_disk_bytes, o.exec.cache_disks_total_bytes),
            (64 << 20, 256 << 20)
        );
    }

    /// A tag pinned absent at the start finds the tag already naming the build's image
    /// (another node's run of the same build published first): the tag holds, no lost race.
    /// An expectation the caller wrote (`Absent`) stays strict.
    #[tokio::test]
    async fn a_tag_already_naming_the_new_image_is_no_lost_race() {
        use kiln_store::artifact::PutArtifactOptions;
        use kiln_store::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path().to_str().expect("utf-8"))
            .await
            .expect("open store");
        let mut digests = Vec::new();
        for byte in [1u8, 2] {
            let (table, _) = store
                .put_artifact_reader(
                    std::io::Cursor::new(vec![byte; 5000]),
                    &PutArtifactOptions::default(),
                )
                .await
                .expect("artifact");
            let raw = store
                .put_manifest(&Manifest::Image(ImageManifest::new(table)))
                .await
                .expect("manifest");
            digests.push(raw.digest);
        }
        let (same, other) = (digests[0], digests[1]);
        let tag: TagRef = "race:same".parse().expect("tag");
        store
            .set_tag(&tag, None, same)
            .await
            .expect("the other node's publish");
        let events: Arc<dyn EventSink> = Arc::new(|_: Event| {});
        let pinned = TagMove {
            tag: tag.clone(),
            expect: TagExpect::Pinned(None),
        };
        let names = move_tags(&store, std::slice::from_ref(&pinned), same, &events)
            .await
            .expect("the same image is no lost race");
        assert_eq!(names, vec![tag.to_string()]);
        assert_eq!(store.resolve_tag(&tag).await.expect("tag"), same);
        // A different image under the same expectation still loses.
        let e = move_tags(&store, &[pinned], other, &events)
            .await
            .expect_err("a different image loses the race");
        assert!(e.to_string().contains("race:same"), "{e}");
        // The caller's own "absent" is not met by a tag that exists, whatever it names.
        let absent = TagMove {
            tag: tag.clone(),
            expect: TagExpect::Absent,
        };
        let e = move_tags(&store, &[absent], same, &events)
            .await
            .expect_err("an explicit absent is strict");
        assert!(e.to_string().contains("race:same"), "{e}");
        assert_eq!(store.resolve_tag(&tag).await.expect("tag"), same);
    }

    /// Issue 41: through the API (which checks a recipe at submission; no agents), `ADD` of
    /// a git repository over ssh is refused with the reason; over https it passes. A CLI
    /// build needs `--ssh default` for it (another agent id is not enough), under either
    /// executor.
    #[test]
    fn check_recipe_refuses_git_over_ssh_without_the_default_agent() {
        let req = |text: &str| {
            BuildRequest::new(
                crate::request::Recipe {
                    name: "Dockerfile".into(),
                    bytes: text.as_bytes().to_vec(),
                },
                ContextSource::None,
            )
        };
        let scp = "FROM scratch\nADD git@git.test:x/y.git /src\n";
        let e = check_recipe(&req(scp)).expect_err("ssh is refused");
        assert!(
            e.to_string().contains(
                "Dockerfile:2: ADD git@git.test:x/y.git: git over ssh is not available here"
            ),
            "{e}"
        );
        let e = check_recipe(&req(
            "FROM scratch\nADD https://git.test/a.git ssh://git.test/b.git /src/\n",
        ))
        .expect_err("ssh as a later source too");
        assert!(
            e.to_string()
                .contains("ADD ssh://git.test/b.git: git over ssh is not available"),
            "{e}"
        );
        check_recipe(&req("FROM scratch\nADD https://git.test/x/y.git#v1 /src\n"))
            .expect("https is fetched");
        let mut cli = req(scp);
        cli.ssh = Some(std::collections::BTreeMap::from([(
            "gh".to_string(),
            std::path::PathBuf::from("/run/agent.sock"),
        )]));
        let e = check_recipe(&cli).expect_err("not the default agent");
        assert!(
            e.to_string().contains(
                "Dockerfile:2: ADD git@git.test:x/y.git: git over ssh needs an SSH agent: \
                 pass `kiln build --ssh default`"
            ),
            "{e}"
        );
        cli.ssh
            .as_mut()
            .unwrap()
            .insert("default".into(), "/run/agent.sock".into());
        check_recipe(&cli).expect("with --ssh default");
        cli.executor = Executor::Vm;
        check_recipe(&cli).expect("fetched on the host under the microVM executor too");
    }

    #[test]
    fn recipe_errors_are_told_apart() {
        let bad = kiln_recipes::load("Dockerfile", b"FROM scratch\nFRM x\n", &Default::default())
            .expect_err("FRM is no instruction");
        let text = bad.to_string();
        let e = PipelineError::from(ResolveError::Recipe(Box::new(bad)));
        assert_eq!(e.recipe_error().map(|r| r.to_string()), Some(text.clone()));
        assert!(text.contains("Dockerfile:2"), "{text}");
        assert!(PipelineError::Cancelled.recipe_error().is_none());
        assert!(
            PipelineError::from(BuildError::Cancelled)
                .recipe_error()
                .is_none()
        );
    }
}
