//! The worker pool: each worker claims the oldest queued build its workspace's concurrency
//! cap allows ([`Db::claim`](crate::Db::claim): one claim per build), unpacks its context
//! (fetched from a remote store when another node received it),
//! runs it through [`kiln_pipeline::run`] with the server's executor
//! ([`crate::ServiceConfig::executor`]: a microVM per step unless `--trust-tenants`), writes its steps and
//! log lines as they come, and ends it in a terminal state, after its last log line is
//! stored (so a log stream that sees the end has every line).
//!
//! Cancellation: `POST /v1/builds/{id}/cancel` fires the build's token here and flags it in
//! the database; a watcher also polls the flag (every 250 ms), so a cancel reaches the build
//! whichever node took it. A cancelled build publishes nothing and moves no tag (the
//! pipeline's guarantee).
//!
//! Liveness ([`liveness`]): the node heartbeats and sweeps for lost nodes' builds
//! ([`Db::take_over`](crate::Db::take_over)) every [`crate::ServiceConfig::heartbeat`]. The
//! same watcher cancels a build whose claim was taken away (its node was thought dead), and
//! a node that could not heartbeat for the takeover time cancels all its builds and claims
//! none until a heartbeat succeeds: their claims are being taken over. Such a build's end is
//! not recorded; its log writes are refused (both conditional on the claim), and its tags,
//! which move by compare-and-swap, are not moved over another attempt's.

use std::error::Error as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kiln_pipeline::{ContextSource, Event, PipelineError, Scope, Tenant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::AppState;
use crate::db::{self, BuildRow, Claim, LogLine, Record, StepRow, now_ms};
use crate::spec::{BuildResult, Failure, StoredSpec};

/// Set when the shutdown grace period is over: builds cancelled then end failed with
/// [`db::SERVER_SHUTDOWN`].
static SHUTDOWN_CANCEL: AtomicBool = AtomicBool::new(false);

/// Starts [`crate::ServiceConfig::workers`] workers, which claim for this node.
pub fn spawn_pool(state: AppState) -> Vec<JoinHandle<()>> {
    (0..state.config.workers.max(1))
        .map(|_| {
            let state = state.clone();
            tokio::spawn(async move { worker(state).await })
        })
        .collect()
}

/// The node's heartbeat and sweep, every [`crate::ServiceConfig::heartbeat`] until `done`
/// fires (after the last build of a shutdown ended): writes the heartbeat, re-queues or
/// fails the builds of lost nodes, deletes the rows of long-gone nodes
/// ([`crate::Db::prune_nodes`]) and renews or drops context leases, each database call of the
/// node's liveness bounded by [`crate::ServiceConfig::database_timeout`]. `registered` is
/// when the registration (the first heartbeat) was sent.
///
/// A timer of its own ([`fence_when_lost`]) fences this node (cancels its builds, stops
/// claiming) once the last heartbeat written was sent the takeover time ago, whatever the
/// database calls do meanwhile: from a node cut off from the database they hang rather than
/// fail. Other nodes take its builds over only once that heartbeat, stamped by the database
/// after it was sent, is older than the takeover time, so this node stops first.
pub async fn liveness(state: AppState, registered: Instant, done: CancellationToken) {
    let cfg = &state.config;
    let takeover_ms = cfg.takeover.as_millis() as i64;
    let last_ok = Arc::new(std::sync::Mutex::new(registered));
    let fence = tokio::spawn(fence_when_lost(
        state.clone(),
        last_ok.clone(),
        done.clone(),
    ));
    loop {
        let sent = Instant::now();
        match state.db.heartbeat(&state.node.id).await {
            Ok(true) => {
                *lock(&last_ok) = sent;
                // A heartbeat that took the takeover time to be written lifts no fence: it
                // may be stamped that late, and the next one comes within an interval.
                if sent.elapsed() < cfg.takeover && state.fenced.swap(false, Ordering::SeqCst) {
                    tracing::warn!(node = %state.node.id, "heartbeat written again: claiming builds again");
                }
            }
            Ok(false) => tracing::error!(
                node = %state.node.id,
                "this node's row is stopped or gone: a newer server of the same state \
                 directory runs, or the row was pruned after the node retention"
            ),
            Err(e) => tracing::error!(node = %state.node.id, error = %e, "writing the heartbeat"),
        }
        match state.db.take_over(takeover_ms, cfg.max_attempts).await {
            Ok(taken) => {
                for t in taken {
                    tracing::warn!(
                        build = %t.build,
                        lost_node = %t.node,
                        lost_node_ran = %t.node_detail,
                        attempt = t.attempt,
                        requeued = t.requeued,
                        "took over a build of a lost node"
                    );
                }
                state.queued.notify_waiters();
            }
            Err(e) => tracing::error!(error = %e, "sweeping for lost nodes' builds"),
        }
        if state.contexts_in_store() {
            context_leases(&state).await;
        }
        if let Err(e) = state.db.drop_ended_credentials().await {
            tracing::error!(error = %e, "deleting the registry credentials of ended builds");
        }
        match state
            .db
            .prune_nodes(cfg.node_retention.as_millis() as i64)
            .await
        {
            Ok(gone) if !gone.is_empty() => {
                tracing::info!(nodes = ?gone, "removed the rows of long-gone nodes")
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "removing the rows of long-gone nodes"),
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.heartbeat) => {}
            _ = done.cancelled() => break,
        }
    }
    let _ = fence.await;
}

/// Fences this node when `last_ok` (when the last heartbeat written was sent) is the
/// takeover time ago, and again after every heartbeat interval the fence is lifted
/// ([`liveness`] lifts it when a heartbeat is written); returns when `done` fires.
async fn fence_when_lost(
    state: AppState,
    last_ok: Arc<std::sync::Mutex<Instant>>,
    done: CancellationToken,
) {
    let cfg = &state.config;
    loop {
        let at = *lock(&last_ok) + cfg.takeover;
        let now = Instant::now();
        let wake = if now < at {
            at
        } else {
            if !state.fenced.swap(true, Ordering::SeqCst) {
                state.fences.fetch_add(1, Ordering::SeqCst);
                tracing::error!(
                    node = %state.node.id,
                    "no heartbeat written for the takeover time: other nodes take this node's \
                     builds over, so they are cancelled here and no build is claimed"
                );
                let tokens: Vec<_> = lock(&state.running).values().cloned().collect();
                for t in tokens {
                    t.cancel();
                }
            }
            now + cfg.heartbeat
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = done.cancelled() => return,
        }
    }
}

/// The sweep's part for contexts in a remote store ([`crate::context`]): renews the shared
/// leases of queued or running builds' contexts a third of [`crate::ServiceConfig::context_lease`]
/// after their last renewal, and deletes those of builds that ended. Each row is acted on by
/// the one node whose conditional update wins. A renewal that races with the build's end can
/// write the lease again after another node deleted it: it then ends at its expiry.
async fn context_leases(state: &AppState) {
    let ttl = state.config.context_lease;
    let store = &state.setup.store;
    let due = match state
        .db
        .context_leases_due((ttl / 3).as_millis() as i64)
        .await
    {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(error = %e, "reading the context leases");
            return;
        }
    };
    for l in due {
        let id = crate::context::lease_id(&l.build);
        let r = if l.live {
            match state.db.renew_context_lease(&l).await {
                Ok(true) => match crate::context::store_object(&l.digest) {
                    Ok(obj) => store
                        .put_shared_lease(&id, ttl, [obj])
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Ok(false) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        } else {
            match state.db.drop_context_lease(&l).await {
                Ok(true) => store
                    .delete_shared_lease(&id)
                    .await
                    .map_err(|e| e.to_string()),
                Ok(false) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        };
        if let Err(e) = r {
            tracing::warn!(build = %l.build, lease = %id, renew = l.live, error = %e, "context lease");
        }
    }
}

/// After the server stopped accepting: waits up to the grace period for the workers to
/// finish their builds, then cancels what still runs and waits for those to end.
pub async fn shutdown(state: &AppState, workers: Vec<JoinHandle<()>>) {
    let all = futures_util::future::join_all(workers);
    tokio::pin!(all);
    if tokio::time::timeout(state.config.shutdown_grace, &mut all)
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace period over: cancelling running builds");
        SHUTDOWN_CANCEL.store(true, Ordering::SeqCst);
        let tokens: Vec<_> = lock(&state.running).values().cloned().collect();
        for t in tokens {
            t.cancel();
        }
        all.await;
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// This host's name (`/proc/sys/kernel/hostname`), for [`crate::db::NodeInfo::name`].
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string()
}

async fn worker(state: AppState) {
    loop {
        if state.stopping.is_cancelled() {
            return;
        }
        if state.fenced.load(Ordering::SeqCst) {
            tokio::select! {
                _ = tokio::time::sleep(state.config.heartbeat) => {}
                _ = state.stopping.cancelled() => return,
            }
            continue;
        }
        match state.db.claim(&state.node.id).await {
            Ok(Some(row)) => {
                run_one(&state, row).await;
                // A slot of the workspace is free: another worker may claim now.
                state.queued.notify_one();
            }
            Ok(None) => {
                tokio::select! {
                    _ = state.queued.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = state.stopping.cancelled() => return,
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "claiming a build");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The directories and files of this server that a failure's reason (or its last lines)
/// must not show a tenant, each with the name shown instead: the work directory, the local
/// directory it is in (the local store, or the cache beside a remote one), the state
/// directory, the guest kernel and initramfs; each as configured and canonical.
fn server_paths(state: &AppState) -> Vec<(std::path::PathBuf, &'static str)> {
    let work = state.setup.work_dir.clone();
    let mut v = vec![(work.clone(), "<work>")];
    if let Some(local) = work.parent() {
        v.push((local.to_path_buf(), "<local>"));
    }
    if let Some(root) = state.setup.store.local_root() {
        v.push((root, "<store>"));
    }
    v.push((state.config.state_dir.clone(), "<state>"));
    if let Some(b) = &state.setup.boot {
        v.push((b.kernel.clone(), "<kernel>"));
        v.push((b.initramfs.clone(), "<initramfs>"));
    }
    // Each also as the kernel names it (symbolic links resolved), as errors may.
    let canonical: Vec<_> = v
        .iter()
        .filter_map(|(p, n)| std::fs::canonicalize(p).ok().map(|c| (c, *n)))
        .filter(|(c, _)| !v.iter().any(|(p, _)| p == c))
        .collect();
    v.extend(canonical);
    v
}

/// `reason` with each of `paths` (longest first, so a directory inside another is named
/// as itself) replaced by its name: a build's failure reason is the tenant's to read, and an
/// executor's or the host's error can name a file of the server.
fn without_server_paths(reason: &str, paths: &[(std::path::PathBuf, &str)]) -> String {
    let mut by_len: Vec<(String, &str)> = paths
        .iter()
        .map(|(p, n)| (p.display().to_string(), *n))
        .filter(|(p, _)| p.len() > 1)
        .collect();
    by_len.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    let mut s = reason.to_string();
    for (p, n) in by_len {
        s = s.replace(&p, n);
    }
    s
}

/// Whether `e` is a tag that held something else than the build expected
/// ([`kiln_store::TagError::Stale`]): no tag moved.
fn is_stale_tag(e: &PipelineError) -> bool {
    matches!(e, PipelineError::Tag { source, .. }
        if matches!(**source, kiln_store::StoreError::Tag(kiln_store::TagError::Stale { .. })))
}

/// The error and its causes, each once.
fn chain(e: &PipelineError) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

async fn run_one(state: &AppState, row: BuildRow) {
    let id = row.id.clone();
    let Some(claim) = row.claim() else {
        tracing::error!(build = %id, "claimed build without a claim");
        return;
    };
    let t0 = Instant::now();
    let token = CancellationToken::new();
    let fences = state.fences.load(Ordering::SeqCst);
    lock(&state.running).insert(id.clone(), token.clone());
    let lost = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (db, id, token) = (state.db.clone(), id.clone(), token.clone());
        let (claim, lost) = (claim.clone(), lost.clone());
        tokio::spawn(async move {
            loop {
                match db.watch(&id, &claim).await {
                    Ok(w) if !w.held => {
                        tracing::warn!(build = %id, attempt = claim.attempt, "claim taken away: cancelling this attempt");
                        lost.store(true, Ordering::SeqCst);
                        token.cancel();
                        return;
                    }
                    Ok(w) if w.cancel => {
                        token.cancel();
                        return;
                    }
                    _ => {}
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let work = state.config.state_dir.join("work");
    let dir = std::fs::create_dir_all(&work)
        .and_then(|_| tempfile::Builder::new().prefix(&id).tempdir_in(&work));
    let outcome = match dir {
        Ok(dir) => execute(state, &row, &claim, dir.path(), token).await,
        Err(e) => Outcome::Failed(Failure {
            reason: format!(
                "creating the build's directory under {}: {e}",
                work.display()
            ),
            ..Default::default()
        }),
    };
    watcher.abort();
    lock(&state.running).remove(&id);
    if lost.load(Ordering::SeqCst) {
        tracing::warn!(build = %id, attempt = claim.attempt, "attempt ended without its claim: its end is not recorded");
        return;
    }
    if state.fences.load(Ordering::SeqCst) != fences {
        // Cancelled by the fence: the claim goes back unless another node took it already,
        // so a node that could heartbeat again before the others swept leaves no build
        // running without a worker.
        // The tenant reads the node's id; where it runs goes to the log below.
        let why = format!(
            "node {} could not write its heartbeat for the takeover time and cancelled the \
             attempt",
            state.node.id
        );
        tracing::warn!(
            build = %id, node = %state.node.id, node_name = %state.node.name,
            listen = %state.node.listen, "{why}"
        );
        match state
            .db
            .give_back(&id, &claim, state.config.max_attempts, &why)
            .await
        {
            Ok(Some(_)) => {
                tracing::warn!(build = %id, attempt = claim.attempt, "attempt cancelled by the fence: claim given back");
                state.queued.notify_waiters();
            }
            Ok(None) => {
                tracing::warn!(build = %id, attempt = claim.attempt, "attempt ended without its claim: its end is not recorded")
            }
            Err(e) => {
                tracing::error!(build = %id, attempt = claim.attempt, error = %e, "giving back the claim of an attempt cancelled by the fence: other nodes take it over")
            }
        }
        return;
    }
    // The failure as the tenant reads it: without the server's paths.
    let told = match &outcome {
        Outcome::Succeeded(..) => None,
        Outcome::Cancelled => Some(Failure {
            reason: "cancelled".into(),
            ..Default::default()
        }),
        Outcome::Failed(f) => {
            let mut f = f.clone();
            let paths = server_paths(state);
            let told = without_server_paths(&f.reason, &paths);
            if told != f.reason {
                tracing::info!(build = %id, reason = %f.reason, "failure reason, with the server's paths the tenant is not shown");
                f.reason = told;
            }
            for l in &mut f.last_lines {
                *l = without_server_paths(l, &paths);
            }
            Some(f)
        }
    };
    let (st, image, result) = match &outcome {
        Outcome::Succeeded(r, _) => ("succeeded", r.image.clone(), serde_json::to_string(r).ok()),
        Outcome::Cancelled => ("cancelled", None, None),
        Outcome::Failed(_) => ("failed", None, None),
    };
    let failure = told.as_ref().and_then(|f| serde_json::to_string(f).ok());
    match state
        .db
        .finish(
            &id,
            &claim,
            st,
            image.as_deref(),
            result.as_deref(),
            failure.as_deref(),
        )
        .await
    {
        Ok(true) => {
            state.metrics.finished(st, t0.elapsed());
            // What the end means for the tags that follow a base (its rows are written
            // only by the attempt whose end was recorded).
            if let Ok(spec) = serde_json::from_str::<StoredSpec>(&row.spec) {
                let end = match (&outcome, &told) {
                    (Outcome::Succeeded(r, check), _) => Some(crate::follow::End::Succeeded {
                        result: r,
                        check: check.as_deref(),
                    }),
                    (o, Some(f)) => Some(crate::follow::End::Failed {
                        failure: f,
                        cancelled: matches!(o, Outcome::Cancelled),
                    }),
                    _ => None,
                };
                if let Some(end) = end {
                    crate::follow::after_build(state, &row, &spec, end).await;
                }
            }
        }
        Ok(false) => tracing::warn!(build = %id, "build was no longer running when it ended"),
        Err(e) => tracing::error!(build = %id, error = %e, "recording the end of a build"),
    }
}

enum Outcome {
    /// With, for a build that follows its base, what a rebuild of it is checked against
    /// (read from this node's cache, where the build left the configs).
    Succeeded(BuildResult, Option<Box<kiln_pipeline::RebuildCheck>>),
    Cancelled,
    Failed(Failure),
}

async fn execute(
    state: &AppState,
    row: &BuildRow,
    claim: &Claim,
    dir: &std::path::Path,
    token: CancellationToken,
) -> Outcome {
    let failed = |reason: String| {
        Outcome::Failed(Failure {
            reason,
            ..Default::default()
        })
    };
    let spec: StoredSpec = match serde_json::from_str(&row.spec) {
        Ok(s) => s,
        Err(e) => return failed(format!("stored build spec: {e}")),
    };
    let ctx_dir = dir.join("context");
    let context = match &row.context {
        None => ContextSource::None,
        Some(d) => {
            let path = match state.blobs.path(d) {
                Ok(p) => p,
                Err(e) => return failed(e.to_string()),
            };
            let here = if state.contexts_in_store() {
                match state.blobs.fetch(&state.setup.store, d).await {
                    Ok(h) => h,
                    Err(e) => return failed(e.to_string()),
                }
            } else {
                path.is_file()
            };
            if !here {
                // The tenant reads the node's id; where it runs and the store go to the log.
                tracing::error!(
                    build = %row.id, context = %d, node = %state.node.id,
                    node_name = %state.node.name, store = %state.setup.store.url(),
                    "the build's context is not here"
                );
                return failed(if state.contexts_in_store() {
                    format!(
                        "context blob {d} is neither on node {} nor in the store",
                        state.node.id,
                    )
                } else {
                    // With a local store, contexts stay on the node they were uploaded to.
                    format!(
                        "context blob {d} is not on node {}: it was uploaded to another \
                         node, and with a local store build contexts are not shared between \
                         nodes",
                        state.node.id
                    )
                });
            }
            let (dest, limit) = (ctx_dir.clone(), state.config.max_unpacked_bytes);
            let recipe = spec
                .recipe_in_context
                .then(|| crate::context::check_member_path(&spec.recipe).ok())
                .flatten();
            let r = tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(&dest).map_err(|e| e.to_string())?;
                crate::context::unpack(&path, &dest, limit, recipe.as_deref())
                    .map_err(|e| e.to_string())
            })
            .await;
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return failed(e),
                Err(e) => return failed(format!("unpacking the context: {e}")),
            }
            let recipe_path = spec.recipe_in_context.then(|| ctx_dir.join(&spec.recipe));
            match ContextSource::dir(&ctx_dir, recipe_path.as_deref()) {
                Ok(c) => c,
                Err(e) => return failed(chain(&e)),
            }
        }
    };
    // Checked when the build was accepted (the same mapping).
    let mut req = match spec.request(
        row.recipe.clone(),
        context,
        &row.workspace,
        state.config.step_pids_max,
    ) {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    req.rebuild_check = match crate::follow::rebuild_check(&spec) {
        Ok(c) => c,
        Err(e) => return failed(e),
    };
    let own_images = match own_images(state, &row.workspace).await {
        Ok(m) => m,
        Err(e) => return failed(format!("reading the workspace's images: {e}")),
    };
    let registry_auth = match registry_auth(state, &row.id).await {
        Ok(a) => a,
        Err(e) => return failed(e),
    };
    req.scope = Scope::Tenant(Tenant {
        workspace: row.workspace.clone(),
        global_bases: state.config.global_bases.clone(),
        registries: state.config.allowed_registries.clone(),
        own_images,
        registry_auth,
    });
    // Read at the build's start: a quota changed while it runs applies to the next build.
    match state.db.storage_quota(&row.workspace).await {
        Ok(q) => req.storage_quota = q,
        Err(e) => return failed(format!("reading the workspace's quota: {e}")),
    }
    req.executor = state.config.executor;
    req.cancel = token.clone();

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Event>();
    let writer = tokio::spawn(write_events(
        state.db.clone(),
        row.id.clone(),
        claim.clone(),
        rx,
    ));
    let r = kiln_pipeline::run(&state.setup, req, Arc::new(tx)).await;
    // Every event is stored before the build ends.
    let _ = writer.await;
    match r {
        Ok(report) => {
            let check = match &spec.follow {
                Some(_) => {
                    match kiln_pipeline::RebuildCheck::of_build(state.setup.cache.as_ref(), &report)
                        .await
                    {
                        Ok(c) => Some(Box::new(c)),
                        Err(e) => {
                            // Followed without the config check rather than not at all.
                            tracing::warn!(build = %row.id, error = %e, "reading the configs a rebuild is checked against");
                            None
                        }
                    }
                }
                None => None,
            };
            Outcome::Succeeded(
                BuildResult {
                    image: report.final_image().map(|d| d.to_string()),
                    published: report.image.as_ref().map(|i| i.manifest.to_string()),
                    snapshot: report.snapshot.as_ref().map(|s| s.snapshot.to_string()),
                    oci_manifest: report.oci_manifest.digest.to_string(),
                    disk_bytes: report.image.as_ref().map(|i| i.disk_bytes),
                    steps_run: report.steps_run,
                    steps_cached: report.steps_cached,
                    base: report.image_base().map(|b| b.digest.to_string()),
                    new_stored_bytes: report.image.as_ref().map_or(0, |i| i.disk.new_stored_bytes),
                },
                check,
            )
        }
        Err(PipelineError::Cancelled) if SHUTDOWN_CANCEL.load(Ordering::SeqCst) => {
            failed(db::SERVER_SHUTDOWN.to_string())
        }
        Err(PipelineError::Cancelled) => Outcome::Cancelled,
        Err(e) => {
            let mut f = Failure {
                reason: chain(&e),
                stale_tag: is_stale_tag(&e),
                ..Default::default()
            };
            if let Ok(steps) = state.db.steps(&row.id).await
                && let Some(s) = steps
                    .iter()
                    .rev()
                    .find(|s| !s.cached && s.finished_ms.is_none())
            {
                f.location = Some(s.location.clone());
                f.last_lines = state
                    .db
                    .last_lines(&row.id, s.step, 20)
                    .await
                    .unwrap_or_default();
            }
            Outcome::Failed(f)
        }
    }
}

/// The registry credentials the tenant gave for build `id`, opened, for
/// [`Tenant::registry_auth`]; none when it gave none. Errors (a tenant-readable reason): the
/// build has credentials and this node has no key, or another key sealed them.
async fn registry_auth(
    state: &AppState,
    id: &str,
) -> Result<std::collections::BTreeMap<String, kiln_pipeline::Credentials>, String> {
    let sealed = match state.db.credentials(id).await {
        Ok(Some(s)) => s,
        Ok(None) => return Ok(Default::default()),
        Err(e) => return Err(format!("reading the build's registry credentials: {e}")),
    };
    let Some(key) = &state.config.credentials_key else {
        tracing::error!(build = %id, "a build with registry credentials, and no --credentials-key-file on this node");
        return Err("this server cannot open the build's registry credentials (its                     operator gave this node no credentials key)"
            .into());
    };
    let auth = key.open(id, &sealed).map_err(|e| e.to_string())?;
    Ok(auth
        .into_iter()
        .map(|(registry, l)| {
            (
                registry,
                kiln_pipeline::Credentials {
                    username: l.username,
                    password: l.password,
                },
            )
        })
        .collect())
}

/// The images workspace `ws` built, for [`Tenant::own_images`]: each digest of a succeeded
/// build's result (its image manifest, the one before its snapshot, its OCI manifest) → its
/// OCI manifest digest.
async fn own_images(
    state: &AppState,
    ws: &str,
) -> Result<std::collections::BTreeMap<String, kiln_store::BlobDigest>, db::DbError> {
    let mut out = std::collections::BTreeMap::new();
    for json in state.db.results(ws).await? {
        // A result this version cannot read (or whose OCI manifest digest is malformed) names
        // no image of the tenant's.
        let Ok(r) = serde_json::from_str::<BuildResult>(&json) else {
            continue;
        };
        let Ok(oci) = r.oci_manifest.parse::<kiln_store::BlobDigest>() else {
            continue;
        };
        for d in [&r.image, &r.published].into_iter().flatten() {
            out.insert(d.clone(), oci);
        }
        out.insert(r.oci_manifest.clone(), oci);
    }
    Ok(out)
}

/// Stores a build's events in order: log lines numbered on from the build's last line (1,
/// 2, ... in a first attempt), steps as they start and end; batched, one transaction per
/// batch, each written only while the build runs under `claim`.
async fn write_events(
    db: crate::Db,
    id: String,
    claim: Claim,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) {
    let mut seq = match db.last_seq(&id).await {
        Ok(n) => n,
        Err(e) => {
            tracing::error!(build = %id, error = %e, "reading the build's last log line");
            0
        }
    };
    let mut batch = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(e) = next {
            let now = now_ms();
            let mut log = |step: Option<i64>, text: String, batch: &mut Vec<Record>| {
                seq += 1;
                batch.push(Record::Log(LogLine {
                    seq,
                    time_ms: now,
                    step,
                    text,
                }));
            };
            match e {
                Event::Warning { location, message } => {
                    let text = match location {
                        Some(l) => format!("warning: {l}: {message}"),
                        None => format!("warning: {message}"),
                    };
                    log(None, text, &mut batch);
                }
                Event::StepStarted {
                    step,
                    stage,
                    location,
                    instruction,
                    executor,
                    why,
                } => {
                    // Why it ran, one build-level line (the step's own lines are its output).
                    if let Some(w) = kiln_pipeline::event::why_text(&why) {
                        log(None, format!("step {step} ran: {w}"), &mut batch);
                    }
                    batch.push(Record::Step(StepRow {
                        step: step as i64,
                        stage: stage as i64,
                        location,
                        instruction,
                        cached: false,
                        started_ms: now,
                        finished_ms: None,
                        layer: None,
                        executor: executor.map(|e| e.name().to_string()),
                        why,
                    }));
                }
                Event::CacheHit {
                    step,
                    stage,
                    location,
                    instruction,
                } => batch.push(Record::Step(StepRow {
                    step: step as i64,
                    stage: stage as i64,
                    location,
                    instruction,
                    cached: true,
                    started_ms: now,
                    finished_ms: Some(now),
                    layer: None,
                    executor: None,
                    why: Vec::new(),
                })),
                Event::Log { step, text } => log(Some(step as i64), text, &mut batch),
                Event::StepDone { step, layer, .. } => batch.push(Record::StepDone {
                    step: step as i64,
                    finished_ms: now,
                    layer,
                }),
                Event::Published { image, .. } => {
                    log(None, format!("published {image}"), &mut batch)
                }
                Event::Booting { image } => log(
                    None,
                    format!("booting {image} once for its snapshot"),
                    &mut batch,
                ),
                Event::SnapshotStored { snapshot, .. } => {
                    log(None, format!("snapshot {snapshot} stored"), &mut batch)
                }
                Event::Tagged { .. } | Event::Publishing | Event::Progress { .. } => {}
            }
            next = if batch.len() < 512 {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        if !batch.is_empty() {
            match db.write_batch(&id, &claim, &batch).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(build = %id, attempt = claim.attempt, "claim taken away: events dropped")
                }
                Err(e) => tracing::error!(build = %id, error = %e, "storing build events"),
            }
            batch.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_show_no_server_path() {
        let paths = vec![
            (std::path::PathBuf::from("/srv/kiln/store/.build"), "<work>"),
            (std::path::PathBuf::from("/srv/kiln/store"), "<local>"),
            (std::path::PathBuf::from("/srv/kiln/state"), "<state>"),
            (std::path::PathBuf::from("/"), "<root>"),
        ];
        assert_eq!(
            without_server_paths(
                "mke2fs /srv/kiln/store/.build/run/step-1/upper.raw: no space; \
                 /srv/kiln/state/kiln.db; /srv/kiln/store/blobs",
                &paths
            ),
            "mke2fs <work>/run/step-1/upper.raw: no space; <state>/kiln.db; <local>/blobs"
        );
        assert_eq!(without_server_paths("exit 3", &paths), "exit 3");
    }
}
