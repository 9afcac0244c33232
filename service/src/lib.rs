//! kiln's custom-image HTTP API (`kiln serve`): tenants send a recipe and a build context,
//! the server queues the build, a worker runs it through [`kiln_pipeline::run`] (the function
//! `kiln build` calls), and the tenant reads its state, steps and logs and moves its tags.
//!
//! - [`db`]: the persisted state in an embedded SQLite database (or PostgreSQL, for several
//!   nodes sharing one store): workspaces and their quotas,
//!   API keys (sha256 hashes only), builds (the job queue), their steps and log lines,
//!   idempotency keys and uploaded blobs.
//! - [`auth`]: API keys (`kiln_<64 hex>`) and the `Authorization: Bearer` extractor; a
//!   missing or unknown key gets 401.
//! - [`api`]: the tenants' axum router under `/v1`, `/openapi.json` (utoipa), `/healthz`,
//!   `/readyz`. Every object belongs to one workspace; another workspace's object gets the
//!   same 404 as a missing one. The operator's `/metrics` (every workspace's activity) is a
//!   router of its own, on a listener of its own ([`serve`]).
//! - [`listen`]: the tenants' listener, bounded against slow and many clients.
//! - [`context`]: build contexts as content-addressed tarballs under the state directory
//!   (`PUT /v1/blobs/sha256:<hex>`, or the `context` part of a submission), and, with a
//!   remote store, blobs of the store leased for their builds' lives; unpacked for a build
//!   with hostile-input checks.
//! - [`worker`]: the pool that claims queued builds (one claim per build, per-workspace
//!   concurrency caps), runs them, stores what they tell and ends each in a terminal state.
//! - [`share`]: each workspace's share of the tenants' listener (requests in flight).
//! - [`sealed`]: a tenant's registry credentials for one build, sealed under the operator's
//!   key while the build waits in the database.
//! - [`follow`]: images that follow a global base (`follow_base`): rebuilt, checked and
//!   their tags moved by compare-and-swap when the base moves.
//! - [`tags`]: a workspace's tags live in the store as `<workspace>.<name>:<tag>`; workspace
//!   ids hold no `.`, so no tag name reaches another workspace's names.
//!
//! What the pipeline needs (store, caches, registry, boot assets) comes in as a
//! [`kiln_pipeline::Setup`]; everything about HTTP stays here.

pub mod api;
pub mod auth;
pub mod context;
pub mod db;
pub mod follow;
pub mod listen;
pub mod metrics;
pub mod sealed;
pub mod share;
pub mod spec;
pub mod tags;
pub mod worker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kiln_pipeline::{Executor, Setup};
use tokio_util::sync::CancellationToken;

pub use db::{Db, DbError, Quota};

/// Errors of the service outside one request (start-up, the database, the listener).
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The database failed.
    #[error(transparent)]
    Db(#[from] DbError),
    /// A setting is out of range.
    #[error("kiln serve: {0}")]
    Config(String),
    /// A file or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Most rebuilds one move of a global base queues by default ([`ServiceConfig::follow_budget`]):
/// with the default two workers and 15-minute builds, about 12 hours of rebuilds at worst.
pub const DEFAULT_FOLLOW_BUDGET: u32 = 100;

/// The server's settings (the `kiln serve` flags).
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// The state directory: `kiln.db` (SQLite) and `blobs/` (build contexts).
    pub state_dir: PathBuf,
    /// A PostgreSQL URL (`postgres://...`) for the database instead of `kiln.db`.
    pub database: Option<String>,
    /// Builds run at once by this server, all workspaces together.
    pub workers: usize,
    /// Largest context tarball accepted, bytes (default 1 GiB).
    pub max_context_bytes: u64,
    /// Largest unpacked context, bytes: the sum of the tarball's file sizes (default 4 GiB).
    pub max_unpacked_bytes: u64,
    /// How long an `Idempotency-Key` names its build (default 24 h, as Stripe's API keeps
    /// keys).
    pub idempotency_window: Duration,
    /// After SIGTERM, how long running builds may go on before they are cancelled
    /// (default 60 s).
    pub shutdown_grace: Duration,
    /// How often this node writes its heartbeat and sweeps for lost nodes' builds
    /// (default 10 s).
    pub heartbeat: Duration,
    /// A node whose last heartbeat is older than this is lost: its running builds are taken
    /// over (default 60 s, the bound issue 19 asks for; at least twice `heartbeat`). A build
    /// is re-queued at most `takeover + heartbeat` after its node's last heartbeat.
    pub takeover: Duration,
    /// Attempts a build gets when its nodes are lost, the first run included (default 3);
    /// after the last one it fails with a reason naming the node.
    pub max_attempts: u32,
    /// A node's row in the database is deleted once its last heartbeat is this old and no
    /// running build is claimed by it (default 7 days; at least `takeover`): one row is
    /// added per server start.
    pub node_retention: Duration,
    /// How long the store lease of a queued or running build's context lasts unrenewed
    /// (default 1 h; at least three heartbeats): the sweep renews it after a third of it,
    /// so one failed renewal still leaves time for the next. A remote store only (see
    /// [`context`]).
    pub context_lease: Duration,
    /// The longest a database call of the node's liveness (its heartbeat, the sweep for
    /// lost nodes' builds), a running build's watch and event writes, or getting a database
    /// connection may take (default 10 s,
    /// [`db::DEFAULT_TIMEOUT`]); on PostgreSQL also how long a session may sit inside a
    /// transaction before the server ends it, releasing its locks ([`Db::connect_bounded`]).
    /// A node cut off from the database sees its calls hang, not fail: this bounds them.
    pub database_timeout: Duration,
    /// Store tag names every tenant may build `FROM` (any tag of each; `kiln serve --base`).
    /// No workspace may create a tag of such a name, so a name has one meaning.
    pub global_bases: std::collections::BTreeSet<String>,
    /// Most rebuilds one move of a global base queues for the images that follow it
    /// (`kiln serve --follow-budget`; default [`DEFAULT_FOLLOW_BUDGET`]; [`follow`]).
    pub follow_budget: u32,
    /// Registries (`host[:port]`) tenants may pull from at a loopback, private or
    /// link-local address (`kiln serve --allow-registry`); every other registry must be at a
    /// public address ([`kiln_pipeline::Tenant::registries`]).
    pub allowed_registries: std::collections::BTreeSet<String>,
    /// What runs tenants' `RUN` steps (default [`Executor::Vm`]: a microVM per step, which
    /// needs [`Setup::boot`]). [`Executor::Namespace`] is this host's namespace executor,
    /// not a boundary against a hostile recipe: `kiln serve --trust-tenants`, development
    /// only. Under the VM executor a submission asking for the host network is refused.
    pub executor: Executor,
    /// The key that seals tenants' registry credentials while their builds wait
    /// (`--credentials-key-file`; [`sealed`]). `None`: a submission with credentials is
    /// refused (400).
    pub credentials_key: Option<Arc<sealed::CredentialsKey>>,
    /// The bounds of the tenants' listener: header and body timeouts, most connections.
    pub conn: listen::ConnLimits,
    /// Most requests of one workspace in flight at once, log streams counted for their
    /// whole life (`kiln serve --max-requests-per-workspace`; default 64; [`share`]). 64 is
    /// well above what one tenant's normal use holds (a follow stream for each of its 20
    /// queued and 2 running builds, plus uploads and polls) and a sixty-fourth of the
    /// default `--max-connections`.
    pub max_requests_per_workspace: usize,
    /// Most tasks (processes and threads) in each tenant step (`kiln serve --step-pids-max`;
    /// default [`kiln_pipeline::DEFAULT_PIDS_MAX`], 4096).
    pub step_pids_max: u64,
}

impl ServiceConfig {
    /// Defaults for the state directory `state_dir`: SQLite, 2 workers, 1 GiB contexts, 4 GiB
    /// unpacked, 24 h idempotency window, 60 s shutdown grace, 10 s heartbeat, 60 s takeover,
    /// 3 attempts, 7 days node retention, 1 h context leases, 10 s database timeout, the
    /// microVM executor, no credentials key, [`listen::ConnLimits::default`], 64 requests in
    /// flight per workspace, 4096 tasks a step.
    pub fn new(state_dir: PathBuf) -> Self {
        ServiceConfig {
            state_dir,
            database: None,
            workers: 2,
            max_context_bytes: 1 << 30,
            max_unpacked_bytes: 4 << 30,
            idempotency_window: Duration::from_secs(24 * 3600),
            shutdown_grace: Duration::from_secs(60),
            heartbeat: Duration::from_secs(10),
            takeover: Duration::from_secs(60),
            max_attempts: 3,
            node_retention: Duration::from_secs(7 * 24 * 3600),
            context_lease: Duration::from_secs(3600),
            database_timeout: db::DEFAULT_TIMEOUT,
            global_bases: Default::default(),
            follow_budget: DEFAULT_FOLLOW_BUDGET,
            allowed_registries: Default::default(),
            executor: Executor::Vm,
            credentials_key: None,
            conn: listen::ConnLimits::default(),
            max_requests_per_workspace: 64,
            step_pids_max: kiln_pipeline::DEFAULT_PIDS_MAX,
        }
    }

    /// Checks the liveness settings: a heartbeat of at least 1 s, a takeover time of at
    /// least two heartbeats (so one late heartbeat does not lose a live node), a node
    /// retention of at least the takeover time, a context lease of at least three
    /// heartbeats, at least one attempt, a database timeout of at least 100 ms.
    pub fn check(&self) -> Result<(), ServiceError> {
        let bad = |m: String| Err(ServiceError::Config(m));
        if self.heartbeat < Duration::from_secs(1) {
            return bad(format!(
                "heartbeat {:?}: expected at least 1 s",
                self.heartbeat
            ));
        }
        if self.takeover < 2 * self.heartbeat {
            return bad(format!(
                "takeover time {:?}: expected at least two heartbeats ({:?})",
                self.takeover,
                2 * self.heartbeat
            ));
        }
        if self.node_retention < self.takeover {
            return bad(format!(
                "node retention {:?}: expected at least the takeover time ({:?})",
                self.node_retention, self.takeover
            ));
        }
        if self.context_lease < 3 * self.heartbeat {
            return bad(format!(
                "context lease {:?}: expected at least three heartbeats ({:?})",
                self.context_lease,
                3 * self.heartbeat
            ));
        }
        if self.max_requests_per_workspace == 0 {
            return bad("max requests per workspace 0: expected at least 1".into());
        }
        if self.max_attempts == 0 {
            return bad("max attempts 0: expected at least 1".into());
        }
        if let Some(b) = self
            .global_bases
            .iter()
            .find(|b| b.contains('.') || b.parse::<kiln_store::TagRef>().is_err())
        {
            return bad(format!(
                "global base {b:?}: expected a store tag name without '.' (names with a '.' \
                 are workspaces' tags)"
            ));
        }
        if self.database_timeout < Duration::from_millis(100) {
            return bad(format!(
                "database timeout {:?}: expected at least 100 ms",
                self.database_timeout
            ));
        }
        Ok(())
    }

    /// The SQLite database file.
    pub fn db_path(&self) -> PathBuf {
        self.state_dir.join("kiln.db")
    }
}

/// What the handlers and workers share.
#[derive(Clone)]
pub struct AppState {
    /// The settings.
    pub config: Arc<ServiceConfig>,
    /// The database.
    pub db: Db,
    /// The pipeline's setup (store, caches, registry, boot assets).
    pub setup: Setup,
    /// The uploaded contexts.
    pub blobs: context::BlobDir,
    /// Wakes idle workers when a build is queued.
    pub queued: Arc<tokio::sync::Notify>,
    /// In-process metrics.
    pub metrics: Arc<metrics::Metrics>,
    /// Cancellation tokens of the builds running in this process, by build id.
    pub running: Arc<std::sync::Mutex<std::collections::HashMap<String, CancellationToken>>>,
    /// Fired when the server stops accepting (SIGTERM): `/readyz` fails, workers claim no
    /// more builds.
    pub stopping: CancellationToken,
    /// This node, as registered in the database.
    pub node: Arc<db::NodeInfo>,
    /// Set while this node could not write a heartbeat for the takeover time: its builds are
    /// cancelled and it claims none ([`worker::liveness`]).
    pub fenced: Arc<std::sync::atomic::AtomicBool>,
    /// How many times this node fenced itself: an attempt that saw it change was cancelled
    /// by a fence, and gives its claim back.
    pub fences: Arc<std::sync::atomic::AtomicU64>,
    /// Each workspace's requests in flight ([`share`]).
    pub shares: Arc<share::Shares>,
}

impl AppState {
    /// Whether contexts go through the store ([`context`]): it is not a local directory, so
    /// other nodes may share it.
    pub fn contexts_in_store(&self) -> bool {
        self.setup.store.local_root().is_none()
    }
}

/// Runs the server on `listener` (the tenants' API, [`api::router`]) and, when given, the
/// operator's endpoints on `metrics` ([`api::operator_router`]: `/metrics`, which the
/// tenants' port does not serve) until `shutdown` fires, then stops accepting, lets running
/// builds go on for [`ServiceConfig::shutdown_grace`] and cancels those still running
/// (failed, "server shutdown"; no tag moved). The operator listener answers until the last
/// build ended.
///
/// Errors: [`ServiceError::Config`] for settings out of range, or the microVM executor
/// ([`ServiceConfig::executor`]) without the guest kernel and initramfs ([`Setup::boot`]),
/// checked before anything is created; then the state directory's and the database's.
///
/// The node registers in the database and heartbeats; builds of lost nodes, those a
/// previous process of this state directory left running included, are re-queued or, after
/// [`ServiceConfig::max_attempts`], end failed with a reason naming the node, so every
/// accepted build reaches a terminal state.
pub async fn serve(
    config: ServiceConfig,
    setup: Setup,
    listener: tokio::net::TcpListener,
    metrics: Option<tokio::net::TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    config.check()?;
    if config.executor == Executor::Vm && setup.boot.is_none() {
        return Err(ServiceError::Config(
            "the microVM executor needs the guest kernel and initramfs (boot assets)".into(),
        ));
    }
    match config.executor {
        Executor::Vm => tracing::info!(
            executor = %config.executor,
            "tenants' RUN steps run in the microVM executor, a VM per step"
        ),
        _ => tracing::warn!(
            executor = %config.executor,
            "tenants' RUN steps run in this host's namespace executor, which is not a \
             boundary against a hostile recipe (--trust-tenants: development only)"
        ),
    }
    std::fs::create_dir_all(&config.state_dir).map_err(|source| ServiceError::Io {
        what: format!("creating {}", config.state_dir.display()),
        source,
    })?;
    // Build directories a killed server left behind (unpacked contexts).
    let work = config.state_dir.join("work");
    if work.exists() {
        std::fs::remove_dir_all(&work).map_err(|source| ServiceError::Io {
            what: format!("removing {}", work.display()),
            source,
        })?;
    }
    let db = match &config.database {
        Some(url) => Db::connect_bounded(url, config.database_timeout).await?,
        None => Db::open(&config.db_path()).await?,
    };
    let node = db::NodeInfo {
        id: db::NodeInfo::new_id()?,
        name: format!(
            "{}:{}",
            worker::hostname(),
            std::fs::canonicalize(&config.state_dir)
                .unwrap_or_else(|_| config.state_dir.clone())
                .display()
        ),
        listen: listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default(),
        pid: std::process::id(),
    };
    let registered = std::time::Instant::now();
    db.register_node(&node).await?;
    tracing::info!(node = %node.id, name = %node.name, "node registered");
    // What a previous process of this state directory left running is taken over before
    // the API answers, like every lost node's builds.
    let taken = db
        .take_over(config.takeover.as_millis() as i64, config.max_attempts)
        .await?;
    if !taken.is_empty() {
        tracing::warn!(
            builds = taken.len(),
            "builds of stopped servers re-queued or, past their attempts, failed"
        );
    }
    let blobs = context::BlobDir::open(&config.state_dir.join("blobs")).map_err(|source| {
        ServiceError::Io {
            what: "opening the blob directory".into(),
            source,
        }
    })?;
    let shares = Arc::new(share::Shares::new(config.max_requests_per_workspace));
    let state = AppState {
        config: Arc::new(config),
        db,
        setup,
        blobs,
        queued: Arc::new(tokio::sync::Notify::new()),
        metrics: Arc::new(metrics::Metrics::default()),
        running: Arc::default(),
        stopping: CancellationToken::new(),
        node: Arc::new(node),
        fenced: Arc::default(),
        fences: Arc::default(),
        shares,
    };
    // It heartbeats until the last build has ended, through the shutdown grace.
    let live = CancellationToken::new();
    let liveness = tokio::spawn(worker::liveness(state.clone(), registered, live.clone()));
    let follows = tokio::spawn(follow::watch_bases(state.clone(), live.clone()));
    let workers = worker::spawn_pool(state.clone());
    let app = api::router(state.clone());
    let stopping = state.stopping.clone();
    let http = tokio::spawn(listen::serve(
        listener,
        app,
        state.config.conn,
        stopping.clone(),
    ));
    let operator = metrics.map(|l| {
        let (app, done) = (api::operator_router(state.clone()), live.clone());
        tokio::spawn(async move {
            axum::serve(l, app)
                .with_graceful_shutdown(async move { done.cancelled().await })
                .await
        })
    });
    shutdown.cancelled().await;
    tracing::info!("shutting down: no new builds accepted");
    stopping.cancel();
    state.queued.notify_waiters();
    worker::shutdown(&state, workers).await;
    live.cancel();
    let _ = liveness.await;
    let _ = follows.await;
    if let Err(e) = state.db.stop_node(&state.node.id).await {
        tracing::error!(error = %e, "marking this node stopped");
    }
    // Open log streams end when their builds do; the listener closes after them.
    let _ = http.await;
    if let Some(o) = operator {
        let _ = o.await;
    }
    Ok(())
}
