//! `kiln serve`: the custom-image HTTP API ([`kiln_service`]) over the local store, and
//! `kiln serve keys create|revoke` for its API keys. Thin: flags → [`ServiceConfig`] and a
//! [`Setup`] → [`kiln_service::serve`] until SIGTERM or Ctrl-C.
//!
//! Tenants' `RUN` steps run in the microVM executor ([`Executor::Vm`]), on the guest kernel
//! and initramfs found as `kiln build --isolation vm` finds them
//! ([`super::kernel::boot_assets`]); without them the server refuses to start.
//! `--trust-tenants` runs them in this host's namespace executor instead (development only).

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use kiln_builder::registry::RegistryOptions;
use kiln_pipeline::{Executor, Setup};
use kiln_service::{Db, Quota, ServiceConfig};
use kiln_vmm::snapshot::BootAssets;
use tokio_util::sync::CancellationToken;

/// Arguments of `kiln serve`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Key management (the server is not started).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Address to listen on (port 0: any free port; the address is printed on stderr);
    /// default: $KILN_LISTEN, else the config file's `serve.listen`, else 127.0.0.1:8080.
    #[arg(long)]
    pub listen: Option<String>,
    /// DEVELOPMENT ONLY: run tenants' RUN steps in this host's namespace executor, which is
    /// not a boundary against a hostile recipe. Without it each RUN step runs in a microVM of
    /// its own (--kernel, --initramfs).
    #[arg(long = "trust-tenants")]
    pub trust_tenants: bool,
    /// Address of the operator's listener, serving GET /metrics (every workspace's
    /// activity; port 0: any free port, printed on stderr). None by default; the tenants'
    /// port never serves /metrics.
    #[arg(
        long = "metrics-listen",
        env = "KILN_SERVE_METRICS_LISTEN",
        value_name = "ADDR"
    )]
    pub metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub common: Common,
    /// The local store directory (default: $KILN_STORE, else ~/.local/share/kiln/store).
    #[arg(long, env = "KILN_STORE")]
    pub store: Option<PathBuf>,
    /// Builds run at once, all workspaces together.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Largest context tarball, MiB.
    #[arg(long = "max-context-mib", default_value_t = 1024)]
    pub max_context_mib: u64,
    /// After SIGTERM, how long running builds may go on before they are cancelled (90s,
    /// 5m, ...).
    #[arg(long = "shutdown-grace", default_value = "60s", value_parser = super::parse_duration)]
    pub shutdown_grace: std::time::Duration,
    /// A client connection whose request head (request line and headers) has not arrived
    /// this long after the connection opened or its previous response is closed.
    #[arg(long = "header-timeout", env = "KILN_SERVE_HEADER_TIMEOUT", default_value = "10s", value_parser = super::parse_duration)]
    pub header_timeout: std::time::Duration,
    /// A request whose body sends nothing for this long fails, and its connection is
    /// closed.
    #[arg(long = "body-idle-timeout", env = "KILN_SERVE_BODY_IDLE_TIMEOUT", default_value = "60s", value_parser = super::parse_duration)]
    pub body_idle_timeout: std::time::Duration,
    /// Slowest average, bytes/s, a request body may arrive at once --body-rate-grace has
    /// passed: a body must have ended the grace plus one second per this many bytes received
    /// (0: no such bound); past it the request is answered 408 and its connection closed.
    #[arg(
        long = "min-body-rate",
        env = "KILN_SERVE_MIN_BODY_RATE",
        default_value_t = 64 << 10,
        value_name = "BYTES_PER_SEC"
    )]
    pub min_body_rate: u64,
    /// Time a request body has before --min-body-rate counts (5s, 1m, ...).
    #[arg(long = "body-rate-grace", env = "KILN_SERVE_BODY_RATE_GRACE", default_value = "10s", value_parser = super::parse_duration)]
    pub body_rate_grace: std::time::Duration,
    /// Most requests of one workspace in flight at once on the tenants' port, a log stream
    /// counted until it ends; past it a request is answered 429 with Retry-After.
    #[arg(
        long = "max-requests-per-workspace",
        env = "KILN_SERVE_MAX_REQUESTS_PER_WORKSPACE",
        default_value_t = 64
    )]
    pub max_requests_per_workspace: usize,
    /// Most client connections open at once on the tenants' port; past it a new connection
    /// is closed at once.
    #[arg(
        long = "max-connections",
        env = "KILN_SERVE_MAX_CONNECTIONS",
        default_value_t = 4096
    )]
    pub max_connections: usize,
    /// Most client connections open at once from one IP address on the tenants' port; past
    /// it a new connection from that address is closed at once.
    #[arg(
        long = "max-connections-per-ip",
        env = "KILN_SERVE_MAX_CONNECTIONS_PER_IP",
        default_value_t = 256
    )]
    pub max_connections_per_ip: usize,
    /// A response write that waits this long for the client to read closes the connection
    /// (5s, 1m, ...).
    #[arg(long = "send-timeout", env = "KILN_SERVE_SEND_TIMEOUT", default_value = "60s", value_parser = super::parse_duration)]
    pub send_timeout: std::time::Duration,
    /// How often this node writes its heartbeat to the database and sweeps for the builds
    /// of lost nodes (5s, 1m, ...).
    #[arg(long, env = "KILN_SERVE_HEARTBEAT", default_value = "10s", value_parser = super::parse_duration)]
    pub heartbeat: std::time::Duration,
    /// A node whose last heartbeat is older than this is lost and its running builds are
    /// taken over by the live nodes (at least twice --heartbeat).
    #[arg(long = "takeover-after", env = "KILN_SERVE_TAKEOVER_AFTER", default_value = "60s", value_parser = super::parse_duration)]
    pub takeover_after: std::time::Duration,
    /// Runs a build gets when the nodes running it are lost, the first included; after the
    /// last, it fails with a reason naming the lost node.
    #[arg(
        long = "max-attempts",
        env = "KILN_SERVE_MAX_ATTEMPTS",
        default_value_t = 3
    )]
    pub max_attempts: u32,
    /// A node's row in the database is deleted once its last heartbeat is this old and it
    /// runs no build (at least --takeover-after).
    #[arg(long = "node-retention", env = "KILN_SERVE_NODE_RETENTION", default_value = "7d", value_parser = super::parse_duration)]
    pub node_retention: std::time::Duration,
    /// The longest a liveness call to the database (heartbeat, takeover sweep), a running
    /// build's watch or log write, or getting a database connection may take; on PostgreSQL also how long a session may sit inside a
    /// transaction before the server ends it (a node cut off mid-transaction).
    #[arg(long = "database-timeout", env = "KILN_SERVE_DATABASE_TIMEOUT", default_value = "10s", value_parser = super::parse_duration)]
    pub database_timeout: std::time::Duration,
    /// How long an Idempotency-Key names its build.
    #[arg(long = "idempotency-window", default_value = "24h", value_parser = super::parse_duration)]
    pub idempotency_window: std::time::Duration,
    /// A registry (host[:port]) allowed over plain HTTP; loopback registries always are.
    #[arg(long = "insecure-registry")]
    pub insecure: Vec<String>,
    #[command(flatten)]
    pub egress: super::common::EgressArgs,
    #[command(flatten)]
    pub cache_disks: super::common::CacheDiskArgs,
    /// A store tag name every tenant may build FROM, with any of its tags (e.g. the image
    /// `kiln nightly` rebuilds); repeat for more. No tenant may create a tag of that name.
    #[arg(long = "base", value_name = "NAME")]
    pub bases: Vec<String>,
    /// Most rebuilds one move of a global base queues for the images that follow it
    /// (`follow_base`), all workspaces together; past it the rest wait for the base's next
    /// move, oldest follow first.
    #[arg(
        long = "follow-budget",
        env = "KILN_SERVE_FOLLOW_BUDGET",
        default_value_t = kiln_service::DEFAULT_FOLLOW_BUDGET
    )]
    pub follow_budget: u32,
    /// A registry (host[:port]) tenants may pull from although it is at a loopback, private
    /// or link-local address; repeat for more (a token server or blob host it sends pulls
    /// to is another destination to name). HOST alone allows every port. Other
    /// destinations of a tenant's pull must be at public addresses.
    #[arg(long = "allow-registry", value_name = "HOST[:PORT]")]
    pub allow_registries: Vec<String>,
    /// A file holding 64 hex digits (32 random bytes: `openssl rand -hex 32 > FILE`, mode
    /// 0600): the key that seals the registry credentials a tenant gives with a build
    /// (`registry_auth`) while the build waits. Every node of one database needs the same
    /// key. Without it, submissions with credentials are refused.
    #[arg(
        long = "credentials-key-file",
        env = "KILN_SERVE_CREDENTIALS_KEY_FILE",
        value_name = "FILE"
    )]
    pub credentials_key_file: Option<PathBuf>,
    /// Guest kernel (uncompressed vmlinux) of the step microVMs and of snapshot builds, with
    /// --initramfs; default `kiln kernel`'s. With --trust-tenants and neither given,
    /// snapshot builds are refused.
    #[arg(long, env = "KILN_KERNEL", value_name = "FILE")]
    pub kernel: Option<PathBuf>,
    /// Guest initramfs with kiln-guest-init, with --kernel; default `kiln kernel`'s.
    #[arg(long, env = "KILN_INITRAMFS", value_name = "FILE")]
    pub initramfs: Option<PathBuf>,
    /// Most tasks (processes and threads) each tenant RUN step may have at once: its pids
    /// cgroup's limit (in the microVM, set by the guest init; a fork refused there stops the
    /// step, "pids limit").
    #[arg(
        long = "step-pids-max",
        env = "KILN_SERVE_STEP_PIDS_MAX",
        default_value_t = kiln_builder::exec::DEFAULT_PIDS_MAX,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub step_pids_max: u64,
}

/// What `kiln serve` and its key commands share.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// The server's state directory: kiln.db (SQLite: keys, builds, logs) and uploaded
    /// contexts (default: $KILN_SERVE_STATE_DIR, else the config file's `serve.state_dir`,
    /// else $KILN_STATE_DIR/serve, else $XDG_STATE_HOME/kiln/serve, else
    /// ~/.local/state/kiln/serve).
    #[arg(long = "state-dir", global = true)]
    pub state_dir: Option<PathBuf>,
    /// A PostgreSQL URL (`postgres://USER@HOST:PORT/DB`) for the keys, builds and logs, so
    /// that several servers share one database (default: $KILN_SERVE_DATABASE, else the
    /// config file's `serve.database`, else SQLite in the state directory).
    #[arg(long, global = true, value_name = "URL")]
    pub database: Option<String>,
}

/// `kiln serve keys ...`.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// API keys.
    #[command(subcommand)]
    Keys(Keys),
}

/// `kiln serve keys create|revoke`.
#[derive(Debug, clap::Subcommand)]
pub enum Keys {
    /// Create a key for a workspace (created when new) and print it, once.
    Create {
        /// The workspace, `[a-z0-9]+([_-][a-z0-9]+)*`.
        #[arg(long)]
        workspace: String,
        /// Set the workspace's cap on builds running at once.
        #[arg(long = "max-concurrent")]
        max_concurrent: Option<u32>,
        /// Set the workspace's cap on builds queued or running (past it: 429).
        #[arg(long = "max-queued")]
        max_queued: Option<u32>,
        /// Set the workspace's longest build, seconds.
        #[arg(long = "max-timeout-secs")]
        max_timeout_secs: Option<u64>,
        /// Set the workspace's most memory per step, MiB.
        #[arg(long = "max-memory-mib")]
        max_memory_mib: Option<u64>,
        /// Set the workspace's most vCPUs.
        #[arg(long = "max-vcpus")]
        max_vcpus: Option<u32>,
        /// Set the workspace's storage quota, GiB (decimals allowed, e.g. 0.5): the images
        /// its tags hold, as the raw bytes of their distinct chunks. A build past it fails
        /// and moves no tag. 0 removes the cap; no cap by default.
        #[arg(long = "max-storage-gib", value_parser = parse_gib)]
        max_storage_gib: Option<u64>,
    },
    /// Revoke a key by its id (printed by `create`).
    Revoke {
        /// The key id.
        id: String,
    },
}

/// `--max-storage-gib`: a non-negative decimal number of GiB, as bytes (rounded down).
fn parse_gib(s: &str) -> Result<u64, String> {
    let gib: f64 = s
        .parse()
        .map_err(|_| format!("{s:?}: expected a number of GiB, such as 10 or 0.5"))?;
    if !gib.is_finite() || gib < 0.0 || gib > (1u64 << 33) as f64 {
        return Err(format!("{s:?}: expected a number of GiB from 0 to 2^33"));
    }
    Ok((gib * f64::from(1u32 << 30)) as u64)
}

/// The configuration with `kiln serve`'s flags (see [`crate::config`]).
fn config(c: &Common, listen: Option<&str>) -> anyhow::Result<crate::config::Config> {
    Ok(crate::config::Config::load(&crate::config::Flags {
        listen: listen.map(str::to_string),
        serve_state_dir: c.state_dir.as_ref().map(|p| p.display().to_string()),
        serve_database: c.database.clone(),
        ..Default::default()
    })?)
}

async fn open_db(c: &Common) -> anyhow::Result<Db> {
    open_serve_db(&config(c, None)?, true)
        .await?
        .ok_or_else(|| anyhow::anyhow!("kiln serve's database: none"))
}

/// `kiln serve`'s database as `cfg` names it: its `serve.database` (PostgreSQL), or
/// `kiln.db` in its state directory, made with the directory when `create`. `None`: no
/// such SQLite file and not `create` (no server keeps its state here).
pub(super) async fn open_serve_db(
    cfg: &crate::config::Config,
    create: bool,
) -> anyhow::Result<Option<Db>> {
    if let Some(url) = &cfg.serve_database.value {
        return Ok(Some(Db::connect(url).await?));
    }
    let dir = &cfg.serve_state_dir.value;
    let file = dir.join("kiln.db");
    if !create && !file.is_file() {
        return Ok(None);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(Some(Db::open(&file).await?))
}

/// Runs `kiln serve` or one of its key commands.
pub fn run(a: Args) -> anyhow::Result<()> {
    let rt = super::common::runtime()?;
    rt.block_on(async move {
        match a.command {
            Some(Command::Keys(k)) => keys(&a.common, k).await,
            None => serve(a).await,
        }
    })
}

async fn keys(c: &Common, k: Keys) -> anyhow::Result<()> {
    let db = open_db(c).await?;
    match k {
        Keys::Create {
            workspace,
            max_concurrent,
            max_queued,
            max_timeout_secs,
            max_memory_mib,
            max_vcpus,
            max_storage_gib,
        } => {
            kiln_service::tags::workspace_id(&workspace).map_err(anyhow::Error::msg)?;
            let given = max_concurrent.is_some()
                || max_queued.is_some()
                || max_timeout_secs.is_some()
                || max_memory_mib.is_some()
                || max_vcpus.is_some()
                || max_storage_gib.is_some();
            let base = db.quota(&workspace).await?.unwrap_or_default();
            let quota = Quota {
                max_concurrent: max_concurrent.unwrap_or(base.max_concurrent),
                max_queued: max_queued.unwrap_or(base.max_queued),
                max_timeout_secs: max_timeout_secs.unwrap_or(base.max_timeout_secs),
                max_memory_mib: max_memory_mib.unwrap_or(base.max_memory_mib),
                max_vcpus: max_vcpus.unwrap_or(base.max_vcpus),
                max_storage_bytes: match max_storage_gib {
                    None => base.max_storage_bytes,
                    Some(0) => None,
                    Some(b) => Some(b),
                },
            };
            db.upsert_workspace(&workspace, &quota, given).await?;
            let key = kiln_service::auth::generate()?;
            db.insert_key(
                &key.id,
                &workspace,
                &kiln_service::auth::hash_key(&key.secret),
            )
            .await?;
            eprintln!(
                "key {} for workspace {workspace} (shown once; revoke with `kiln serve keys revoke {}`)",
                key.id, key.id
            );
            println!("{}", key.secret);
        }
        Keys::Revoke { id } => {
            if !db.revoke_key(&id).await? {
                bail!("no live key {id}");
            }
            eprintln!("revoked key {id}");
        }
    }
    Ok(())
}

/// The guest kernel and initramfs of the microVM executor, found as `kiln build --isolation
/// vm` finds them ([`super::kernel::boot_assets`]), both checked to be files. Errors name the
/// flags, `kiln kernel` and `--trust-tenants`, then why.
async fn vm_boot_assets(a: &Args) -> anyhow::Result<BootAssets> {
    let (kernel, initramfs) = (a.kernel.clone(), a.initramfs.clone());
    // Blocking: the default may fetch the kernel package and build the initramfs.
    let found = tokio::task::spawn_blocking(move || {
        let b = super::kernel::boot_assets(kernel, initramfs)?;
        for (what, p) in [("guest kernel", &b.kernel), ("initramfs", &b.initramfs)] {
            if !p.is_file() {
                bail!("{what} {}: not a file", p.display());
            }
        }
        Ok(b)
    })
    .await?;
    found.context(
        "kiln serve runs tenants' RUN steps in microVMs and needs the guest kernel and \
         initramfs: give --kernel and --initramfs (or KILN_KERNEL and KILN_INITRAMFS), or run \
         `kiln kernel` to fetch and build them; --trust-tenants runs the steps in this host's \
         namespace executor instead (development only)",
    )
}

async fn serve(a: Args) -> anyhow::Result<()> {
    // What runs tenants' steps, and its boot assets, before anything is set up.
    let (executor, boot) = if a.trust_tenants {
        let boot = match (&a.kernel, &a.initramfs) {
            (Some(k), Some(i)) => Some(BootAssets {
                kernel: k.clone(),
                initramfs: i.clone(),
            }),
            (None, None) => None,
            _ => {
                bail!("give both --kernel and --initramfs (KILN_KERNEL/KILN_INITRAMFS), or neither")
            }
        };
        (Executor::Namespace, boot)
    } else {
        (Executor::Vm, Some(vm_boot_assets(&a).await?))
    };
    let store_flag = match &a.store {
        Some(p) => Some(
            p.to_str()
                .with_context(|| format!("--store {}: not UTF-8", p.display()))?,
        ),
        None => None,
    };
    let (store_cfg, root) = crate::config::store_and_local_dir(store_flag)?;
    let config = config(&a.common, a.listen.as_deref())?;
    let listen = config.serve_listen.value;
    let store =
        kiln_store::Store::open_with(&store_cfg.store.value, store_cfg.store_options()).await?;
    let mut setup = Setup::open(store, &root).await?;
    setup.registry = RegistryOptions {
        insecure: a.insecure.clone(),
        ..RegistryOptions::default()
    };
    config.apply_host(&mut setup);
    setup.addresses = a.egress.addresses()?;
    a.cache_disks.apply(&mut setup);
    setup.ca_certs = a.egress.ca_certs()?;
    let executor_line = match (&executor, &boot) {
        (Executor::Vm, Some(b)) => format!(
            "kiln serve: executor vm: each RUN step runs in a microVM of its own (kernel {}, \
             initramfs {})",
            b.kernel.display(),
            b.initramfs.display()
        ),
        _ => "kiln serve: executor namespace: RUN steps run in this host's namespace executor, \
              which is not a boundary against a hostile recipe (--trust-tenants: development \
              only)"
            .to_string(),
    };
    setup.boot = boot;
    setup.chunk_server = Some(super::start::lazy_server(Some(&store_cfg.store.value))?);
    let mut cfg = ServiceConfig::new(config.serve_state_dir.value.clone());
    cfg.database = config.serve_database.value.clone();
    cfg.workers = a.workers.max(1);
    cfg.max_context_bytes = a.max_context_mib << 20;
    cfg.shutdown_grace = a.shutdown_grace;
    cfg.idempotency_window = a.idempotency_window;
    cfg.heartbeat = a.heartbeat;
    cfg.takeover = a.takeover_after;
    cfg.max_attempts = a.max_attempts;
    cfg.node_retention = a.node_retention;
    cfg.database_timeout = a.database_timeout;
    cfg.global_bases = a.bases.iter().cloned().collect();
    cfg.follow_budget = a.follow_budget;
    cfg.allowed_registries = a.allow_registries.iter().cloned().collect();
    cfg.executor = executor;
    cfg.conn = kiln_service::listen::ConnLimits {
        header_timeout: a.header_timeout,
        body_idle_timeout: a.body_idle_timeout,
        min_body_rate: a.min_body_rate,
        body_rate_grace: a.body_rate_grace,
        max_connections: a.max_connections,
        max_connections_per_ip: a.max_connections_per_ip,
        send_timeout: a.send_timeout,
    };
    cfg.max_requests_per_workspace = a.max_requests_per_workspace;
    if let Some(f) = &a.credentials_key_file {
        let key = kiln_service::sealed::CredentialsKey::load(f)?;
        cfg.credentials_key = Some(std::sync::Arc::new(key));
    }
    cfg.step_pids_max = a.step_pids_max;
    cfg.check()?;
    // The operator's listener first: its line comes before the one that says the server is
    // up.
    let metrics = match &a.metrics_listen {
        Some(m) => {
            let l = tokio::net::TcpListener::bind(m)
                .await
                .with_context(|| format!("--metrics-listen {m}"))?;
            eprintln!("kiln serve: metrics on http://{}/metrics", l.local_addr()?);
            Some(l)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    let addr = listener.local_addr()?;
    eprintln!(
        "kiln serve: listening on http://{addr} (store {})",
        store_cfg.store.value
    );
    eprintln!("{executor_line}");
    let shutdown = CancellationToken::new();
    {
        let token = shutdown.clone();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("kiln serve: shutting down");
            token.cancel();
        });
    }
    kiln_service::serve(cfg, setup, listener, metrics, shutdown).await?;
    eprintln!("kiln serve: stopped");
    Ok(())
}
