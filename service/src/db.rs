//! The persisted state: one SQLite database (WAL mode) under the state directory, or, for
//! several nodes sharing one store, one PostgreSQL database; the same SQL runs on both
//! through sqlx's `Any` driver (`$N` parameters, `ON CONFLICT`, `RETURNING`), and
//! [`Backend`] picks the few differences: how a write transaction locks, `FOR UPDATE SKIP
//! LOCKED` in the claim, `BLOB` or `BYTEA`.
//!
//! | table | rows |
//! | --- | --- |
//! | `workspaces` | id, quota |
//! | `api_keys` | key id, workspace, sha256 of the key (hex), created, revoked |
//! | `builds` | the job queue: id, workspace, state, the submitted spec (JSON), recipe bytes, context digest, times, claim (node id and attempt number), results, failure |
//! | `nodes` | one row per `kiln serve` process: id, name (host and state directory), listen address, pid, start, last heartbeat, clean stop |
//! | `build_steps` | per build and step number: location, instruction, cached, start/end, layer, executor (`vm`, `namespace`, or none), why it missed the cache (JSON) |
//! | `build_logs` | per build: seq (1, 2, ...), time, step, text |
//! | `idempotency` | workspace, key, sha256 of the request, build id, time |
//! | `blobs` | workspace, digest: which workspace uploaded which context |
//! | `build_credentials` | build id, the tenant's registry credentials sealed ([`crate::sealed`]), while the build is queued or running |
//! | `context_leases` | build id, context digest, last renewal: the store lease that holds a build's context in a remote store ([`crate::context::lease_id`]), while the build is queued or running, or a follow reruns it |
//! | `follows` | per workspace and store tag that follows a global base ([`crate::follow`]): the build it reruns, the image the tag named after it, the base tag and the OCI manifest it was built from, the config summaries a rebuild is checked against, the last head a rebuild was queued for and that rebuild, its report (JSON) |
//!
//! Times are Unix milliseconds (`BIGINT`). A build's state moves `queued → running → succeeded | failed
//! | cancelled` or `queued → cancelled`, each move a conditional `UPDATE`, so one claim per
//! build and one end per build.
//!
//! Liveness: each node writes its heartbeat with the database's clock (so the nodes' clocks
//! need not agree), and every node sweeps ([`Db::take_over`]): a running build whose node's
//! heartbeat is older than the takeover time, or whose node stopped, goes back to `queued`
//! (attempt `n + 1` at its next claim), or ends failed naming that node once it has had its
//! attempts. A claim is the pair (node id, attempt): the ends, log writes and cancel checks
//! of a build are conditional on it, so a node whose claim was taken away changes nothing.
//! The same sweep deletes the rows of nodes not heard of for the node retention that hold no
//! claim ([`Db::prune_nodes`]).

use std::path::Path;

use serde::{Deserialize, Serialize};
use sqlx::Row as _;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Executor as _};

mod follows;
mod nodes;

pub use follows::{BaseMove, DueGroup, FollowRow, Planned, Room};

/// The start of the failure reason of a build whose node stopped or stopped heartbeating
/// (kill -9, crash, cut off) during its last attempt; the rest names the node.
pub const SERVER_STOPPED: &str = "server stopped during the build";
/// The failure reason of a build cancelled by a server shutdown after its grace period.
pub const SERVER_SHUTDOWN: &str = "server shutdown";

/// Errors of the database.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// SQLite failed.
    #[error("database: {0}")]
    Sql(#[from] sqlx::Error),
    /// The system's random source failed (a node id).
    #[error("random source: {0}")]
    Random(String),
    /// A bounded database call ([`Db::connect_bounded`]) did not end in its time: the
    /// database is unreachable or stuck (a TCP connection to a lost peer hangs rather than
    /// fails). Its connection is closed, not reused.
    #[error("database: {what} took longer than {after:?}")]
    Timeout {
        /// The call.
        what: &'static str,
        /// Its bound.
        after: std::time::Duration,
    },
    /// A stored JSON column does not parse (a damaged database).
    #[error("database: corrupt {what}: {source}")]
    Corrupt {
        /// The column.
        what: &'static str,
        /// Why.
        source: serde_json::Error,
    },
}

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS workspaces (
        id TEXT PRIMARY KEY,
        created_ms BIGINT NOT NULL,
        max_concurrent BIGINT NOT NULL,
        max_queued BIGINT NOT NULL,
        max_timeout_secs BIGINT NOT NULL,
        max_memory_mib BIGINT NOT NULL,
        max_vcpus BIGINT NOT NULL,
        max_storage_bytes BIGINT)",
    "CREATE TABLE IF NOT EXISTS api_keys (
        id TEXT PRIMARY KEY,
        workspace TEXT NOT NULL REFERENCES workspaces(id),
        hash TEXT NOT NULL UNIQUE,
        created_ms BIGINT NOT NULL,
        revoked_ms BIGINT)",
    "CREATE TABLE IF NOT EXISTS builds (
        id TEXT PRIMARY KEY,
        workspace TEXT NOT NULL REFERENCES workspaces(id),
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        recipe {blob} NOT NULL,
        context TEXT,
        created_ms BIGINT NOT NULL,
        started_ms BIGINT,
        finished_ms BIGINT,
        claimed_by TEXT,
        attempt BIGINT NOT NULL DEFAULT 0,
        cancel_requested BIGINT NOT NULL DEFAULT 0,
        image TEXT,
        result TEXT,
        failure TEXT)",
    "CREATE INDEX IF NOT EXISTS builds_queue ON builds (state, created_ms)",
    "CREATE INDEX IF NOT EXISTS builds_ws ON builds (workspace, state)",
    "CREATE TABLE IF NOT EXISTS build_steps (
        build_id TEXT NOT NULL,
        step BIGINT NOT NULL,
        stage BIGINT NOT NULL,
        location TEXT NOT NULL,
        instruction TEXT NOT NULL,
        cached BIGINT NOT NULL,
        started_ms BIGINT NOT NULL,
        finished_ms BIGINT,
        layer TEXT,
        executor TEXT,
        why TEXT,
        PRIMARY KEY (build_id, step))",
    "CREATE TABLE IF NOT EXISTS build_logs (
        build_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        time_ms BIGINT NOT NULL,
        step BIGINT,
        text TEXT NOT NULL,
        PRIMARY KEY (build_id, seq))",
    "CREATE TABLE IF NOT EXISTS idempotency (
        workspace TEXT NOT NULL,
        key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        build_id TEXT NOT NULL,
        created_ms BIGINT NOT NULL,
        PRIMARY KEY (workspace, key))",
    "CREATE TABLE IF NOT EXISTS blobs (
        workspace TEXT NOT NULL,
        digest TEXT NOT NULL,
        size BIGINT NOT NULL,
        created_ms BIGINT NOT NULL,
        PRIMARY KEY (workspace, digest))",
    "CREATE TABLE IF NOT EXISTS build_credentials (
        build_id TEXT PRIMARY KEY,
        sealed {blob} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS context_leases (
        build_id TEXT PRIMARY KEY,
        digest TEXT NOT NULL,
        renewed_ms BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS follows (
        workspace TEXT NOT NULL REFERENCES workspaces(id),
        tag TEXT NOT NULL,
        build_id TEXT NOT NULL,
        image TEXT NOT NULL,
        base_tag TEXT NOT NULL,
        base_oci TEXT NOT NULL,
        configs TEXT,
        created_ms BIGINT NOT NULL,
        tried_head TEXT,
        rebuild_build TEXT,
        last TEXT,
        PRIMARY KEY (workspace, tag))",
    "CREATE INDEX IF NOT EXISTS follows_base ON follows (base_tag)",
    "CREATE TABLE IF NOT EXISTS nodes (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        listen TEXT NOT NULL,
        pid BIGINT NOT NULL,
        started_ms BIGINT NOT NULL,
        heartbeat_ms BIGINT NOT NULL,
        stopped_ms BIGINT)",
];

/// Columns added after their table was first made, `(table, column, declaration)`: [`SCHEMA`]
/// has them, and a database made before gets them when opened ([`add_column`]).
const ADDED_COLUMNS: &[(&str, &str, &str)] = &[
    ("builds", "attempt", "BIGINT NOT NULL DEFAULT 0"),
    ("build_steps", "executor", "TEXT"),
    ("build_steps", "why", "TEXT"),
    ("workspaces", "max_storage_bytes", "BIGINT"),
];

/// Adds `column` (`decl`: its type and default) to `table` when a database made before the
/// column lacks it, inside the schema's transaction `tx`. `table`, `column` and `decl` are
/// kiln's constants ([`ADDED_COLUMNS`]), never input.
async fn add_column(
    tx: &mut sqlx::AnyConnection,
    backend: Backend,
    table: &str,
    column: &str,
    decl: &str,
) -> Result<(), DbError> {
    let sql = match backend {
        Backend::Postgres => {
            format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {decl}")
        }
        Backend::Sqlite => {
            let n: i64 = sqlx::query(&format!(
                "SELECT COUNT(*) AS n FROM pragma_table_info('{table}') WHERE name = '{column}'"
            ))
            .fetch_one(&mut *tx)
            .await?
            .try_get("n")?;
            if n == 1 {
                return Ok(());
            }
            format!("ALTER TABLE {table} ADD COLUMN {column} {decl}")
        }
    };
    sqlx::query(&sql).execute(&mut *tx).await?;
    Ok(())
}

/// A workspace's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    /// Builds running at once; more wait in the queue.
    pub max_concurrent: u32,
    /// Builds queued or running at once; past it a submission gets 429.
    pub max_queued: u32,
    /// Longest build, seconds (the platform default: 15 min).
    pub max_timeout_secs: u64,
    /// Most memory a build's step may use, MiB (the platform default: 1 GiB).
    pub max_memory_mib: u64,
    /// Most vCPUs of a build's microVMs.
    pub max_vcpus: u32,
    /// Most bytes the images of the workspace's tags may hold, counted as the raw bytes of
    /// their distinct chunks ([`kiln_pipeline::StorageQuota`]); `None`: no cap. A build
    /// past it fails and moves no tag.
    #[serde(default)]
    pub max_storage_bytes: Option<u64>,
}

impl Default for Quota {
    /// 2 running, 20 queued or running, 15 min, 1 GiB, 2 vCPUs, no storage cap.
    fn default() -> Self {
        Quota {
            max_concurrent: 2,
            max_queued: 20,
            max_timeout_secs: 900,
            max_memory_mib: 1024,
            max_vcpus: 2,
            max_storage_bytes: None,
        }
    }
}

/// A build row.
#[derive(Debug, Clone)]
pub struct BuildRow {
    /// Build id.
    pub id: String,
    /// Workspace.
    pub workspace: String,
    /// `queued`, `running`, `succeeded`, `failed`, `cancelled`.
    pub state: String,
    /// The accepted spec, JSON ([`crate::spec::StoredSpec`]).
    pub spec: String,
    /// The recipe's bytes.
    pub recipe: Vec<u8>,
    /// The context blob digest.
    pub context: Option<String>,
    /// Times, Unix ms.
    pub created_ms: i64,
    /// Claimed (this attempt's start).
    pub started_ms: Option<i64>,
    /// Reached a terminal state.
    pub finished_ms: Option<i64>,
    /// The image manifest the tags name (succeeded builds).
    pub image: Option<String>,
    /// Results (JSON, [`crate::spec::BuildResult`]).
    pub result: Option<String>,
    /// Failure (JSON, [`crate::spec::Failure`]).
    pub failure: Option<String>,
    /// The node id of the last claim (none: never claimed, or re-queued).
    pub claimed_by: Option<String>,
    /// Claims so far: 0 while first queued, 1 in the first run, `n` in the `n`-th.
    pub attempt: i64,
}

impl BuildRow {
    /// The claim this row was read under, when it is claimed.
    pub fn claim(&self) -> Option<Claim> {
        self.claimed_by.as_ref().map(|node| Claim {
            node: node.clone(),
            attempt: self.attempt,
        })
    }
}

/// Who runs a build: the node that claimed it and which attempt this is. A build's writes
/// are conditional on the claim it was started under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The claiming node's id ([`NodeInfo::id`]).
    pub node: String,
    /// The attempt, 1 for the first run.
    pub attempt: i64,
}

/// A `kiln serve` process as the `nodes` table knows it.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    /// Random per process: `n` and 16 hex digits.
    pub id: String,
    /// Stable across restarts: `<hostname>:<state directory>`. A node that starts stops
    /// the rows of the same name (its previous processes: one server per state directory),
    /// so their builds are taken over at once.
    pub name: String,
    /// The address its API listens on.
    pub listen: String,
    /// Its process id.
    pub pid: u32,
}

impl NodeInfo {
    /// A new node id: `n` and 16 random hex digits.
    pub fn new_id() -> Result<String, DbError> {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).map_err(|e| DbError::Random(e.to_string()))?;
        Ok(format!("n{}", hex::encode(b)))
    }
}

/// A context lease the sweep acts on ([`Db::context_leases_due`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextLease {
    /// The build.
    pub build: String,
    /// Its context, `sha256:<hex>`.
    pub digest: String,
    /// When it was last renewed, Unix ms (database clock): the version a renewal or a drop
    /// is conditional on.
    pub renewed_ms: i64,
    /// Whether the build is queued or running or a follow reruns it (renew), or not (ended,
    /// or never inserted: delete).
    pub live: bool,
}

/// What [`Db::take_over`] did to one build of a lost node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenOver {
    /// The build.
    pub build: String,
    /// The lost node's id.
    pub node: String,
    /// The attempt that was lost.
    pub attempt: i64,
    /// Queued again (false: ended failed, its attempts used up).
    pub requeued: bool,
    /// Where the node ran (`HOST:STATE_DIR, listening on ADDR`), for the server's log only:
    /// the build's reason and log name the node by its id alone. Empty when unknown.
    pub node_detail: String,
}

/// A step row.
#[derive(Debug, Clone)]
pub struct StepRow {
    /// Build-wide step number.
    pub step: i64,
    /// Stage index.
    pub stage: i64,
    /// `file:line`.
    pub location: String,
    /// The instruction, shortened.
    pub instruction: String,
    /// Found in the build cache.
    pub cached: bool,
    /// Start, Unix ms.
    pub started_ms: i64,
    /// End, Unix ms.
    pub finished_ms: Option<i64>,
    /// Its layer.
    pub layer: Option<String>,
    /// What ran its command ([`kiln_pipeline::Executor::name`]: `vm`, `namespace`); none
    /// for a cache hit or a step that runs no command.
    pub executor: Option<String>,
    /// Why it missed the build cache ([`kiln_pipeline::event::MissReason`]); empty for a
    /// hit. Stored as JSON, NULL when empty.
    pub why: Vec<kiln_pipeline::event::MissReason>,
}

/// One log line.
#[derive(Debug, Clone, Serialize)]
pub struct LogLine {
    /// 1, 2, ... per build.
    pub seq: i64,
    /// Unix ms.
    pub time_ms: i64,
    /// The step that wrote it (none: a build-wide message).
    pub step: Option<i64>,
    /// The text.
    pub text: String,
}

/// What a submission needs inserted.
#[derive(Debug, Clone)]
pub struct NewBuild {
    /// Build id.
    pub id: String,
    /// Workspace.
    pub workspace: String,
    /// Spec JSON.
    pub spec: String,
    /// Recipe bytes.
    pub recipe: Vec<u8>,
    /// Context blob.
    pub context: Option<String>,
    /// `Idempotency-Key` and the request's hash.
    pub idempotency: Option<(String, String)>,
    /// The tenant's registry credentials, sealed for this build ([`crate::sealed`]).
    pub credentials: Option<Vec<u8>>,
}

/// What [`Db::insert_build`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inserted {
    /// Queued.
    Queued,
    /// The idempotency key names this earlier build of the same request.
    Existing(String),
    /// The idempotency key was used with another request.
    KeyReused,
    /// The workspace has `max_queued` builds queued or running.
    OverQuota,
}

/// A new build id: `b` and 32 random hex digits.
pub fn new_build_id() -> Result<String, DbError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| DbError::Random(e.to_string()))?;
    Ok(format!("b{}", hex::encode(b)))
}

/// Unix time, milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Which database a [`Db`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// An embedded SQLite file (one node).
    Sqlite,
    /// A PostgreSQL server (several nodes sharing one store).
    Postgres,
}

/// The database handle; cheap to clone.
#[derive(Debug, Clone)]
pub struct Db {
    pool: AnyPool,
    backend: Backend,
    timeout: std::time::Duration,
}

/// Default [`Db::connect_bounded`] time: 10 s, far above a healthy database's milliseconds
/// and well below the default takeover time (60 s), so a node's liveness calls give up on an
/// unreachable database several times before other nodes take its builds over.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn build_row(r: &AnyRow) -> Result<BuildRow, sqlx::Error> {
    Ok(BuildRow {
        id: r.try_get("id")?,
        workspace: r.try_get("workspace")?,
        state: r.try_get("state")?,
        spec: r.try_get("spec")?,
        recipe: r.try_get("recipe")?,
        context: r.try_get("context")?,
        created_ms: r.try_get("created_ms")?,
        started_ms: r.try_get("started_ms")?,
        finished_ms: r.try_get("finished_ms")?,
        image: r.try_get("image")?,
        result: r.try_get("result")?,
        failure: r.try_get("failure")?,
        claimed_by: r.try_get("claimed_by")?,
        attempt: r.try_get("attempt")?,
    })
}

/// The quota of a row of `workspaces`.
fn quota_row(r: &AnyRow) -> Result<Quota, sqlx::Error> {
    Ok(Quota {
        max_concurrent: r.try_get::<i64, _>("max_concurrent")? as u32,
        max_queued: r.try_get::<i64, _>("max_queued")? as u32,
        max_timeout_secs: r.try_get::<i64, _>("max_timeout_secs")? as u64,
        max_memory_mib: r.try_get::<i64, _>("max_memory_mib")? as u64,
        max_vcpus: r.try_get::<i64, _>("max_vcpus")? as u32,
        max_storage_bytes: r
            .try_get::<Option<i64>, _>("max_storage_bytes")?
            .map(|b| b.max(0) as u64),
    })
}

/// Inserts `b` queued at `now` (Unix ms) in `tx`: its row and, when it has them, its sealed
/// credentials. The caller checks the queue's bounds.
async fn insert_build_row(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    b: &NewBuild,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO builds (id, workspace, state, spec, recipe, context, created_ms)
         VALUES ($1, $2, 'queued', $3, $4, $5, $6)",
    )
    .bind(&b.id)
    .bind(&b.workspace)
    .bind(&b.spec)
    .bind(&b.recipe)
    .bind(&b.context)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    if let Some(sealed) = &b.credentials {
        sqlx::query("INSERT INTO build_credentials VALUES ($1, $2)")
            .bind(&b.id)
            .bind(sealed)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

impl Db {
    /// Opens (creating when missing) the SQLite database file `path` and its tables.
    pub async fn open(path: &Path) -> Result<Db, DbError> {
        let url = format!("sqlite://{}?mode=rwc", path.display());
        Self::connect(&url).await
    }

    /// [`Db::connect_bounded`] with [`DEFAULT_TIMEOUT`].
    pub async fn connect(url: &str) -> Result<Db, DbError> {
        Self::connect_bounded(url, DEFAULT_TIMEOUT).await
    }

    /// Connects to `url` (`sqlite://PATH?mode=rwc` or `postgres://...`) and makes the tables.
    /// SQLite runs in WAL mode with a 30 s busy timeout and foreign keys on.
    ///
    /// `timeout` bounds getting a connection from the pool (opening one included), each of
    /// the node's liveness calls ([`Db::heartbeat`], [`Db::take_over`]), and a running
    /// build's calls that can be given up safely ([`Db::watch`], [`Db::write_batch`],
    /// [`Db::last_seq`], [`Db::give_back`]); on PostgreSQL
    /// it is also the session's `idle_in_transaction_session_timeout`: the server ends a
    /// session that sits inside a transaction that long, as one whose node was cut off
    /// mid-transaction does, so the advisory lock every claim, sweep and submission takes
    /// ([`Db::write_tx`]) is not held past it.
    pub async fn connect_bounded(url: &str, timeout: std::time::Duration) -> Result<Db, DbError> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            Backend::Sqlite
        };
        let idle_in_tx = format!(
            "SET idle_in_transaction_session_timeout = {}",
            timeout.as_millis().max(1)
        );
        let pool = AnyPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(timeout)
            .after_connect(move |conn, _| {
                let idle_in_tx = idle_in_tx.clone();
                Box::pin(async move {
                    match backend {
                        Backend::Sqlite => {
                            conn.execute("PRAGMA journal_mode = WAL").await?;
                            conn.execute("PRAGMA busy_timeout = 30000").await?;
                            conn.execute("PRAGMA foreign_keys = ON").await?;
                        }
                        Backend::Postgres => {
                            conn.execute(idle_in_tx.as_str()).await?;
                        }
                    }
                    Ok(())
                })
            })
            .connect(url)
            .await?;
        let blob = match backend {
            Backend::Sqlite => "BLOB",
            Backend::Postgres => "BYTEA",
        };
        let db = Db {
            pool,
            backend,
            timeout,
        };
        // One schema writer at a time: PostgreSQL's `CREATE TABLE IF NOT EXISTS` races with
        // itself across connections (a unique violation in pg_type).
        let mut tx = db.write_tx().await?;
        for s in SCHEMA {
            sqlx::query(&s.replace("{blob}", blob))
                .execute(&mut *tx)
                .await?;
        }
        // Databases made before claims had attempts, and before steps named their executor.
        for (table, column, decl) in ADDED_COLUMNS {
            add_column(&mut tx, backend, table, column, decl).await?;
        }
        tx.commit().await?;
        Ok(db)
    }

    /// The database's clock as Unix milliseconds, in SQL: heartbeats and their ages are
    /// read on one clock, whatever the nodes' clocks say.
    fn now_sql(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS BIGINT)",
            Backend::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        }
    }

    /// Runs `f` on a connection of its own, getting it included, for at most the
    /// [`Db::connect_bounded`] time; past it the call fails with [`DbError::Timeout`] and
    /// the connection is closed rather than given back to the pool, whose check of a returned
    /// connection would hang on a lost peer too.
    async fn bounded<T>(
        &self,
        what: &'static str,
        f: impl AsyncFnOnce(&mut sqlx::AnyConnection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let timeout = DbError::Timeout {
            what,
            after: self.timeout,
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let Ok(conn) = tokio::time::timeout_at(deadline, self.pool.acquire()).await else {
            return Err(timeout);
        };
        let mut conn = conn?;
        match tokio::time::timeout_at(deadline, f(&mut conn)).await {
            Ok(r) => r,
            Err(_) => {
                conn.close_on_drop();
                Err(timeout)
            }
        }
    }

    /// A transaction that holds the database's one write lock from its start. SQLite:
    /// `BEGIN IMMEDIATE` (a deferred transaction that reads and then writes gets
    /// `SQLITE_BUSY` at once, without waiting, when another connection writes in between,
    /// which concurrent submissions hit). PostgreSQL: a transaction-scoped advisory lock, so
    /// a quota count and its insert, or a claim's cap check and its update, are atomic across
    /// nodes.
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>, DbError> {
        match self.backend {
            Backend::Sqlite => Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?),
            Backend::Postgres => {
                let mut tx = self.pool.begin().await?;
                Self::advisory_lock(&mut tx).await?;
                Ok(tx)
            }
        }
    }

    /// [`Db::write_tx`] on the connection `conn`.
    async fn write_tx_on<'c>(
        &self,
        conn: &'c mut sqlx::AnyConnection,
    ) -> Result<sqlx::Transaction<'c, sqlx::Any>, DbError> {
        use sqlx::Connection as _;
        match self.backend {
            Backend::Sqlite => Ok(conn.begin_with("BEGIN IMMEDIATE").await?),
            Backend::Postgres => {
                let mut tx = conn.begin().await?;
                Self::advisory_lock(&mut tx).await?;
                Ok(tx)
            }
        }
    }

    /// The transaction-scoped advisory lock of [`Db::write_tx`].
    async fn advisory_lock(tx: &mut sqlx::Transaction<'_, sqlx::Any>) -> Result<(), DbError> {
        sqlx::query("SELECT pg_advisory_xact_lock(7147041)")
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Creates workspace `ws` with `quota`, or sets the quota of an existing one when
    /// `replace`.
    pub async fn upsert_workspace(
        &self,
        ws: &str,
        quota: &Quota,
        replace: bool,
    ) -> Result<(), DbError> {
        // Columns named: a database made before `max_storage_bytes` has it last.
        let sql = if replace {
            "INSERT INTO workspaces (id, created_ms, max_concurrent, max_queued, max_timeout_secs,
             max_memory_mib, max_vcpus, max_storage_bytes) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT(id) DO UPDATE SET
             max_concurrent = excluded.max_concurrent, max_queued = excluded.max_queued,
             max_timeout_secs = excluded.max_timeout_secs,
             max_memory_mib = excluded.max_memory_mib, max_vcpus = excluded.max_vcpus,
             max_storage_bytes = excluded.max_storage_bytes"
        } else {
            "INSERT INTO workspaces (id, created_ms, max_concurrent, max_queued, max_timeout_secs,
             max_memory_mib, max_vcpus, max_storage_bytes) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT(id) DO NOTHING"
        };
        sqlx::query(sql)
            .bind(ws)
            .bind(now_ms())
            .bind(i64::from(quota.max_concurrent))
            .bind(i64::from(quota.max_queued))
            .bind(quota.max_timeout_secs as i64)
            .bind(quota.max_memory_mib as i64)
            .bind(i64::from(quota.max_vcpus))
            .bind(
                quota
                    .max_storage_bytes
                    .map(|b| b.min(i64::MAX as u64) as i64),
            )
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The quota of workspace `ws`.
    pub async fn quota(&self, ws: &str) -> Result<Option<Quota>, DbError> {
        let r = sqlx::query("SELECT * FROM workspaces WHERE id = $1")
            .bind(ws)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(quota_row).transpose()?)
    }

    /// Stores a key's hash for workspace `ws` under the key id `id`.
    pub async fn insert_key(&self, id: &str, ws: &str, hash: &str) -> Result<(), DbError> {
        sqlx::query("INSERT INTO api_keys VALUES ($1, $2, $3, $4, NULL)")
            .bind(id)
            .bind(ws)
            .bind(hash)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Revokes key `id`; false when there is no such live key.
    pub async fn revoke_key(&self, id: &str) -> Result<bool, DbError> {
        let r =
            sqlx::query("UPDATE api_keys SET revoked_ms = $1 WHERE id = $2 AND revoked_ms IS NULL")
                .bind(now_ms())
                .bind(id)
                .execute(&self.pool)
                .await?;
        Ok(r.rows_affected() == 1)
    }

    /// The workspace of the live key whose hash is `hash`.
    pub async fn key_workspace(&self, hash: &str) -> Result<Option<String>, DbError> {
        let r =
            sqlx::query("SELECT workspace FROM api_keys WHERE hash = $1 AND revoked_ms IS NULL")
                .bind(hash)
                .fetch_optional(&self.pool)
                .await?;
        Ok(match r {
            Some(r) => Some(r.try_get("workspace")?),
            None => None,
        })
    }

    /// Queues `b` unless its idempotency key names an earlier build (within `window_ms`) or
    /// the workspace's queue is full, in one transaction.
    pub async fn insert_build(
        &self,
        b: &NewBuild,
        max_queued: u32,
        window_ms: i64,
    ) -> Result<Inserted, DbError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        if let Some((key, hash)) = &b.idempotency {
            let r = sqlx::query(
                "SELECT request_hash, build_id, created_ms FROM idempotency
                 WHERE workspace = $1 AND key = $2",
            )
            .bind(&b.workspace)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(r) = r {
                let created: i64 = r.try_get("created_ms")?;
                if now - created < window_ms {
                    let h: String = r.try_get("request_hash")?;
                    return Ok(if &h == hash {
                        Inserted::Existing(r.try_get("build_id")?)
                    } else {
                        Inserted::KeyReused
                    });
                }
            }
        }
        let active: i64 = sqlx::query(
            "SELECT COUNT(*) AS n FROM builds WHERE workspace = $1 AND state IN ('queued', 'running')",
        )
        .bind(&b.workspace)
        .fetch_one(&mut *tx)
        .await?
        .try_get("n")?;
        if active >= i64::from(max_queued) {
            return Ok(Inserted::OverQuota);
        }
        insert_build_row(&mut tx, b, now).await?;
        if let Some((key, hash)) = &b.idempotency {
            sqlx::query(
                "INSERT INTO idempotency VALUES ($1, $2, $3, $4, $5) ON CONFLICT(workspace, key)
                 DO UPDATE SET request_hash = excluded.request_hash,
                 build_id = excluded.build_id, created_ms = excluded.created_ms",
            )
            .bind(&b.workspace)
            .bind(key)
            .bind(hash)
            .bind(&b.id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Inserted::Queued)
    }

    /// The sealed registry credentials of build `id`, while it has some.
    pub async fn credentials(&self, id: &str) -> Result<Option<Vec<u8>>, DbError> {
        let r = sqlx::query("SELECT sealed FROM build_credentials WHERE build_id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match r {
            Some(r) => Some(r.try_get("sealed")?),
            None => None,
        })
    }

    /// Deletes the sealed credentials of every build that ended (succeeded, failed or
    /// cancelled, whichever way: its worker's end, a cancel while queued, a takeover that
    /// gave up); the number deleted. [`Db::finish`] deletes a build's own at once; the
    /// liveness sweep calls this for the rest.
    pub async fn drop_ended_credentials(&self) -> Result<u64, DbError> {
        let r = sqlx::query(
            "DELETE FROM build_credentials WHERE build_id IN
             (SELECT id FROM builds WHERE state IN ('succeeded', 'failed', 'cancelled'))",
        )
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected())
    }

    /// Build `id` of workspace `ws`.
    pub async fn build(&self, ws: &str, id: &str) -> Result<Option<BuildRow>, DbError> {
        let r = sqlx::query("SELECT * FROM builds WHERE id = $1 AND workspace = $2")
            .bind(id)
            .bind(ws)
            .fetch_optional(&self.pool)
            .await?;
        Ok(r.as_ref().map(build_row).transpose()?)
    }

    /// The state of build `id` (any workspace: for workers and log streams).
    pub async fn state(&self, id: &str) -> Result<Option<String>, DbError> {
        let r = sqlx::query("SELECT state FROM builds WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match r {
            Some(r) => Some(r.try_get("state")?),
            None => None,
        })
    }

    /// Claims a queued build for node `node`: `queued → running`, the next attempt. Of the
    /// workspaces that run fewer than their `max_concurrent` builds, one that runs the
    /// fewest goes first, so a workspace with running builds yields to one with none and a
    /// burst from one workspace does not take every worker; within that, the oldest build.
    /// The `state = 'queued'` condition makes the claim happen once per build and attempt.
    ///
    /// Not bounded by the database timeout, nor is [`Db::finish`]: given up after the
    /// database ran the statement but before the answer came, either would leave a build
    /// running under a live node's claim with no worker (a claim the node does not know it
    /// holds, an end it did not record), which no sweep takes over.
    pub async fn claim(&self, node: &str) -> Result<Option<BuildRow>, DbError> {
        // PostgreSQL: rows another node's claim holds are skipped, not waited for.
        let lock = match self.backend {
            Backend::Sqlite => "",
            Backend::Postgres => "FOR UPDATE OF b SKIP LOCKED",
        };
        let sql = format!(
            "UPDATE builds SET state = 'running', started_ms = $1, claimed_by = $2,
             attempt = attempt + 1
             WHERE state = 'queued' AND id = (
               SELECT b.id FROM builds b JOIN workspaces w ON w.id = b.workspace
               WHERE b.state = 'queued' AND (SELECT COUNT(*) FROM builds r
                 WHERE r.workspace = b.workspace AND r.state = 'running') < w.max_concurrent
               ORDER BY (SELECT COUNT(*) FROM builds r
                 WHERE r.workspace = b.workspace AND r.state = 'running'), b.created_ms, b.id
               LIMIT 1 {lock})
             RETURNING *"
        );
        let mut tx = self.write_tx().await?;
        let r = sqlx::query(&sql)
            .bind(now_ms())
            .bind(node)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(r.as_ref().map(build_row).transpose()?)
    }

    /// Ends build `id` (`running` → `state`), with its result or failure JSON. False when it
    /// was not running under `claim` (taken over, or already ended).
    pub async fn finish(
        &self,
        id: &str,
        claim: &Claim,
        state: &str,
        image: Option<&str>,
        result: Option<&str>,
        failure: Option<&str>,
    ) -> Result<bool, DbError> {
        let r = sqlx::query(
            "UPDATE builds SET state = $1, finished_ms = $2, image = $3, result = $4, failure = $5
             WHERE id = $6 AND state = 'running' AND claimed_by = $7 AND attempt = $8",
        )
        .bind(state)
        .bind(now_ms())
        .bind(image)
        .bind(result)
        .bind(failure)
        .bind(id)
        .bind(&claim.node)
        .bind(claim.attempt)
        .execute(&self.pool)
        .await?;
        if r.rows_affected() == 1 {
            sqlx::query("DELETE FROM build_credentials WHERE build_id = $1")
                .bind(id)
                .execute(&self.pool)
                .await?;
        }
        Ok(r.rows_affected() == 1)
    }

    /// Asks build `id` of `ws` to stop: a queued build is cancelled at once; a running one is
    /// flagged (its worker cancels it). Returns the state it was in, `None` when there is no
    /// such build.
    pub async fn request_cancel(&self, ws: &str, id: &str) -> Result<Option<String>, DbError> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query("SELECT state FROM builds WHERE id = $1 AND workspace = $2")
            .bind(id)
            .bind(ws)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(r) = r else { return Ok(None) };
        let state: String = r.try_get("state")?;
        match state.as_str() {
            "queued" => {
                sqlx::query(
                    "UPDATE builds SET state = 'cancelled', finished_ms = $1, cancel_requested = 1,
                     failure = $2 WHERE id = $3 AND state = 'queued'",
                )
                .bind(now_ms())
                .bind(r#"{"reason":"cancelled before it started"}"#)
                .bind(id)
                .execute(&mut *tx)
                .await?;
            }
            "running" => {
                sqlx::query("UPDATE builds SET cancel_requested = 1 WHERE id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
            }
            _ => {}
        }
        tx.commit().await?;
        Ok(Some(state))
    }

    /// What the watcher of a running build needs: whether its cancellation was asked for,
    /// and whether it still runs under `claim` (false: taken over or ended).
    ///
    /// Bounded ([`Db::bounded`]).
    pub async fn watch(&self, id: &str, claim: &Claim) -> Result<Watch, DbError> {
        self.bounded("watching a build", async |conn| {
            let r = sqlx::query(
                "SELECT cancel_requested, state, claimed_by, attempt FROM builds WHERE id = $1",
            )
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
            let Some(r) = r else {
                return Ok(Watch {
                    cancel: false,
                    held: false,
                });
            };
            let state: String = r.try_get("state")?;
            let node: Option<String> = r.try_get("claimed_by")?;
            let attempt: i64 = r.try_get("attempt")?;
            Ok(Watch {
                cancel: r.try_get::<i64, _>("cancel_requested")? != 0,
                held: state == "running"
                    && node.as_deref() == Some(claim.node.as_str())
                    && attempt == claim.attempt,
            })
        })
        .await
    }

    /// The last log sequence number of build `id` (0: none), where a new attempt's lines go
    /// on.
    ///
    /// Bounded ([`Db::bounded`]).
    pub async fn last_seq(&self, id: &str) -> Result<i64, DbError> {
        self.bounded("reading a build's last log line", async |conn| {
            let r = sqlx::query(
                "SELECT COALESCE(MAX(seq), 0) AS n FROM build_logs WHERE build_id = $1",
            )
            .bind(id)
            .fetch_one(&mut *conn)
            .await?;
            Ok(r.try_get("n")?)
        })
        .await
    }

    /// Steps of build `id`, in step order.
    pub async fn steps(&self, id: &str) -> Result<Vec<StepRow>, DbError> {
        let rows = sqlx::query("SELECT * FROM build_steps WHERE build_id = $1 ORDER BY step")
            .bind(id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(StepRow {
                    step: r.try_get("step")?,
                    stage: r.try_get("stage")?,
                    location: r.try_get("location")?,
                    instruction: r.try_get("instruction")?,
                    cached: r.try_get::<i64, _>("cached")? != 0,
                    started_ms: r.try_get("started_ms")?,
                    finished_ms: r.try_get("finished_ms")?,
                    layer: r.try_get("layer")?,
                    executor: r.try_get("executor")?,
                    why: r
                        .try_get::<Option<String>, _>("why")?
                        .and_then(|w| serde_json::from_str(&w).ok())
                        .unwrap_or_default(),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(DbError::from)
    }

    /// Log lines of build `id` after `after`, at most `limit`, in order.
    pub async fn logs(&self, id: &str, after: i64, limit: i64) -> Result<Vec<LogLine>, DbError> {
        let rows = sqlx::query(
            "SELECT seq, time_ms, step, text FROM build_logs WHERE build_id = $1 AND seq > $2
             ORDER BY seq LIMIT $3",
        )
        .bind(id)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(LogLine {
                    seq: r.try_get("seq")?,
                    time_ms: r.try_get("time_ms")?,
                    step: r.try_get("step")?,
                    text: r.try_get("text")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(DbError::from)
    }

    /// The last `n` log lines of `step` of build `id`, oldest first.
    pub async fn last_lines(&self, id: &str, step: i64, n: i64) -> Result<Vec<String>, DbError> {
        let rows = sqlx::query(
            "SELECT text FROM build_logs WHERE build_id = $1 AND step = $2 ORDER BY seq DESC LIMIT $3",
        )
        .bind(id)
        .bind(step)
        .bind(n)
        .fetch_all(&self.pool)
        .await?;
        let mut out = rows
            .iter()
            .map(|r| r.try_get("text"))
            .collect::<Result<Vec<String>, _>>()?;
        out.reverse();
        Ok(out)
    }

    /// Writes one batch of a running build's records in one transaction, if the build still
    /// runs under `claim`; false (nothing written) when it was taken over or ended.
    ///
    /// Bounded ([`Db::bounded`]).
    pub async fn write_batch(
        &self,
        id: &str,
        claim: &Claim,
        batch: &[Record],
    ) -> Result<bool, DbError> {
        self.bounded("storing build events", async |conn| {
            let mut tx = self.write_tx_on(conn).await?;
            let held = sqlx::query(
                "SELECT 1 FROM builds WHERE id = $1 AND state = 'running' AND claimed_by = $2
                 AND attempt = $3",
            )
            .bind(id)
            .bind(&claim.node)
            .bind(claim.attempt)
            .fetch_optional(&mut *tx)
            .await?;
            if held.is_none() {
                return Ok(false);
            }
            for rec in batch {
                match rec {
                    Record::Log(l) => {
                        sqlx::query("INSERT INTO build_logs VALUES ($1, $2, $3, $4, $5)")
                            .bind(id)
                            .bind(l.seq)
                            .bind(l.time_ms)
                            .bind(l.step)
                            .bind(&l.text)
                            .execute(&mut *tx)
                            .await?;
                    }
                    Record::Step(s) => {
                        sqlx::query(
                            "INSERT INTO build_steps (build_id, step, stage, location,
                             instruction, cached, started_ms, finished_ms, layer, executor, why)
                             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
                             ON CONFLICT (build_id, step) DO UPDATE SET stage = excluded.stage,
                             location = excluded.location, instruction = excluded.instruction,
                             cached = excluded.cached, started_ms = excluded.started_ms,
                             finished_ms = excluded.finished_ms, layer = excluded.layer,
                             executor = excluded.executor, why = excluded.why",
                        )
                        .bind(id)
                        .bind(s.step)
                        .bind(s.stage)
                        .bind(&s.location)
                        .bind(&s.instruction)
                        .bind(i64::from(s.cached))
                        .bind(s.started_ms)
                        .bind(s.finished_ms)
                        .bind(&s.layer)
                        .bind(&s.executor)
                        .bind(
                            (!s.why.is_empty())
                                .then(|| serde_json::to_string(&s.why).unwrap_or_default()),
                        )
                        .execute(&mut *tx)
                        .await?;
                    }
                    Record::StepDone {
                        step,
                        finished_ms,
                        layer,
                    } => {
                        sqlx::query(
                            "UPDATE build_steps SET finished_ms = $1, layer = $2
                             WHERE build_id = $3 AND step = $4",
                        )
                        .bind(finished_ms)
                        .bind(layer)
                        .bind(id)
                        .bind(step)
                        .execute(&mut *tx)
                        .await?;
                    }
                }
            }
            tx.commit().await?;
            Ok(true)
        })
        .await
    }

    /// Records that `ws` uploaded blob `digest` of `size` bytes.
    pub async fn add_blob(&self, ws: &str, digest: &str, size: u64) -> Result<(), DbError> {
        sqlx::query(
            "INSERT INTO blobs VALUES ($1, $2, $3, $4) ON CONFLICT (workspace, digest) DO NOTHING",
        )
        .bind(ws)
        .bind(digest)
        .bind(size as i64)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The size of blob `digest` when `ws` uploaded it.
    pub async fn blob(&self, ws: &str, digest: &str) -> Result<Option<u64>, DbError> {
        let r = sqlx::query("SELECT size FROM blobs WHERE workspace = $1 AND digest = $2")
            .bind(ws)
            .bind(digest)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match r {
            Some(r) => Some(r.try_get::<i64, _>("size")? as u64),
            None => None,
        })
    }

    /// The `result` column (JSON, [`crate::spec::BuildResult`]) of every build of workspace
    /// `ws` that succeeded, oldest first.
    pub async fn results(&self, ws: &str) -> Result<Vec<String>, DbError> {
        let rows = sqlx::query(
            "SELECT result FROM builds WHERE workspace = $1 AND state = 'succeeded'
             AND result IS NOT NULL ORDER BY created_ms",
        )
        .bind(ws)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| Ok(r.try_get::<String, _>("result")?))
            .collect()
    }

    /// Whether a build of `ws` produced manifest `digest` (a tenant may point its tags only
    /// at its own images).
    pub async fn owns_manifest(&self, ws: &str, digest: &str) -> Result<bool, DbError> {
        let r = sqlx::query(
            "SELECT 1 FROM builds WHERE workspace = $1 AND state = 'succeeded' AND image = $2
             LIMIT 1",
        )
        .bind(ws)
        .bind(digest)
        .fetch_optional(&self.pool)
        .await?;
        Ok(r.is_some())
    }

    /// Builds per state (all workspaces), for `/metrics`.
    pub async fn count_by_state(&self) -> Result<Vec<(String, i64)>, DbError> {
        let rows = sqlx::query("SELECT state, COUNT(*) AS n FROM builds GROUP BY state")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("state")?, r.try_get("n")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(DbError::from)
    }

    /// Whether the database answers (for `/readyz`).
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}

/// What [`Db::watch`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watch {
    /// Cancellation was asked for.
    pub cancel: bool,
    /// The build still runs under the watcher's claim.
    pub held: bool,
}

/// One thing a running build writes.
#[derive(Debug, Clone)]
pub enum Record {
    /// A log line.
    Log(LogLine),
    /// A step started or was a cache hit.
    Step(StepRow),
    /// A step made its layer.
    StepDone {
        /// Step number.
        step: i64,
        /// End, Unix ms.
        finished_ms: i64,
        /// The layer digest.
        layer: String,
    },
}

#[cfg(test)]
mod tests;
