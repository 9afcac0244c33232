//! Tenant images that follow their base (issue 40): a build submitted with `follow_base:
//! true` whose image is built `FROM` a global base (`kiln serve --base NAME`) is built
//! again when that base's tag moves (e.g. when `kiln nightly` promotes the default image),
//! and its tags move to the new image only once it passed what the original did.
//!
//! - **Following.** A `follow_base` submission names, at its root (the target stage's chain
//!   of `FROM`s, [`kiln_recipes::plan::BuildPlan::image_base`]), a global base by tag, not
//!   pinned by digest, and has tags; anything else is a 400. When it succeeds, each of its
//!   tags follows that base tag (a `follows` row, [`crate::db::FollowRow`]): its build (for
//!   the recipe, context and options, all kept in the database; a remote store's context
//!   stays leased while a follow reruns it), the image the tag named, the base's OCI
//!   manifest it was built from, and the config summaries a rebuild is checked against
//!   ([`Configs`]). A build that moves the tag without `follow_base`, or the tenant moving or
//!   deleting the tag, ends its follow, and stops the rebuild queued or running for it
//!   ([`crate::db::Db::delete_follows`]); a rebuild that ends after its follow did makes no
//!   follow again. The tenant's own builds of a following tag go first
//!   ([`crate::db::Room::TagBusy`], [`crate::db::Db::preempt_rebuilds`]).
//! - **A move queues rebuilds.** Every node sweeps once per heartbeat interval
//!   ([`watch_bases`], [`sweep`]): it reads the head of
//!   each followed base tag; a follow built from another base and not yet tried for that
//!   head is due. The due follows of one build are rebuilt together by one build of the
//!   workspace (queued like any build: the workspace's executor, quota and scope, taken over
//!   when its node is lost), in one database transaction, so one node queues each. A
//!   rebuild is a submission of the workspace's today: its limits are lowered to the quota
//!   of the day, it waits while the workspace's queue is full (`max_queued`), and options
//!   the server refuses now skip it. At most
//!   [`crate::ServiceConfig::follow_budget`] rebuilds per head, oldest follow first; the
//!   rest are recorded `skipped` and wait for the next move, where they go first.
//! - **Before a tag moves.** The rebuild runs the original spec: a snapshot build boots the
//!   image once and passes its ready check again; every published ext4 image passes `e2fsck
//!   -fn` ([`kiln_pipeline`]'s publish); the rebuilt image's config must equal the original's
//!   except where the base's own config changed ([`kiln_pipeline::RebuildCheck`]); then each
//!   tag moves by compare-and-swap from the image the rebuild started from, so a tenant who
//!   built or moved the tag meanwhile keeps their image. A rebuild that fails moves nothing,
//!   and its reason is recorded.
//! - **The report.** `GET /v1/follows` lists the workspace's following tags with their last
//!   rebuild ([`Last`]): `queued`, `rebuilt`, `unchanged` (the same image digest), `failed`
//!   (with the reason) or `skipped` (past the budget, or the tag moved meanwhile), with the
//!   new bytes stored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::AppState;
use crate::db::{BaseMove, BuildRow, DueGroup, FollowRow, NewBuild, Planned, Room};
use crate::spec::{BuildResult, Failure, Rebuild, StoredSpec};

/// The config summaries a rebuild is checked against ([`kiln_pipeline::RebuildCheck`]): the
/// original image's and its base's, read when the follow was recorded (the `configs`
/// column, JSON). Kept in the database because the old base's config may be collected from
/// the store once the base moved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Configs {
    /// The image the tag named.
    pub original: kiln_pipeline::ConfigSummary,
    /// The base it was built from.
    pub old_base: kiln_pipeline::ConfigSummary,
}

impl Configs {
    /// The pipeline's check of a rebuild against these summaries.
    pub fn check(self) -> kiln_pipeline::RebuildCheck {
        kiln_pipeline::RebuildCheck {
            original: self.original,
            old_base: self.old_base,
        }
    }
}

/// The last rebuild of a following tag (the `last` column, JSON; `last` in the API).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Last {
    /// `queued` (the rebuild is queued or running: see `build`), `rebuilt`, `unchanged`
    /// (the rebuild gave the same image digest), `failed` or `skipped` (past the move's
    /// budget, or the tag had moved meanwhile).
    pub state: String,
    /// The base's image manifest this rebuild was for.
    pub base_head: String,
    /// The rebuild (none when skipped for the budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<String>,
    /// The image the tag names after it (`rebuilt`, `unchanged`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Why it failed or was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Stored (compressed) bytes of the disk chunks the rebuild added to the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_stored_bytes: Option<u64>,
    /// When this state was recorded, RFC 3339.
    pub at: String,
}

impl Last {
    fn new(state: &str, base_head: &str) -> Self {
        Last {
            state: state.into(),
            base_head: base_head.into(),
            build: None,
            image: None,
            reason: None,
            new_stored_bytes: None,
            at: crate::api::rfc3339(crate::db::now_ms()),
        }
    }

    fn json(&self) -> String {
        // Strings and numbers only: always serializes.
        serde_json::to_string(self).expect("a Last serializes")
    }
}

/// A following tag, as `GET /v1/follows` shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FollowView {
    /// The tag, `name:tag`.
    pub tag: String,
    /// The image manifest it names (as of its last build).
    pub image: String,
    /// The global base tag it follows, `NAME:TAG`.
    pub base: String,
    /// The OCI manifest digest of the base it was built from.
    pub base_image: String,
    /// The build whose recipe, context and options a rebuild runs again.
    pub build: String,
    /// When it began to follow, RFC 3339.
    pub since: String,
    /// Its last rebuild (none yet: the base has not moved since).
    pub last: Option<Last>,
}

/// The view of `row` for its workspace.
pub fn view(row: &FollowRow) -> FollowView {
    FollowView {
        tag: crate::tags::from_store(&row.workspace, &row.tag)
            .unwrap_or(&row.tag)
            .to_string(),
        image: row.image.clone(),
        base: row.base_tag.clone(),
        base_image: row.base_oci.clone(),
        build: row.build_id.clone(),
        since: crate::api::rfc3339(row.created_ms),
        last: row
            .last
            .as_deref()
            .and_then(|l| serde_json::from_str(l).ok()),
    }
}

/// The global base tag a `follow_base` submission of workspace `ws` follows: the reference
/// at the root of its target stage's `FROM`s (`image_base`, from the lowered plan), when it
/// names a global base of `global_bases` by tag. Errors (a 400's message): no image base,
/// one pinned by digest, or one that is not a global base.
pub fn followed_base(
    ws: &str,
    image_base: Option<&str>,
    global_bases: &std::collections::BTreeSet<String>,
) -> Result<String, String> {
    let Some(reference) = image_base else {
        return Err(
            "follow_base: the image is not built FROM an image (scratch or a bootstrap): \
             there is no base to follow"
                .into(),
        );
    };
    let known = || {
        if global_bases.is_empty() {
            "this server has none".to_string()
        } else {
            format!(
                "this server's are {}",
                global_bases.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        }
    };
    if reference.contains('@') {
        return Err(format!(
            "follow_base: the base {reference:?} is pinned by digest, so it never moves: \
             name a global base by tag ({})",
            known()
        ));
    }
    let tenant = kiln_pipeline::Tenant {
        workspace: ws.to_string(),
        global_bases: global_bases.clone(),
        registries: Default::default(),
        own_images: Default::default(),
        registry_auth: Default::default(),
    };
    match tenant.store_tag(reference) {
        Some(t) if global_bases.contains(&t.name) => Ok(t.to_string()),
        _ => Err(format!(
            "follow_base: the base {reference:?} is not a global base of this server, and \
             only those can be followed ({})",
            known()
        )),
    }
}

/// Sweeps for moved bases ([`sweep`]) every heartbeat interval until `done` fires. A task
/// of its own, beside the node's liveness, which it must never hold up.
pub async fn watch_bases(state: AppState, done: tokio_util::sync::CancellationToken) {
    loop {
        tokio::select! {
            _ = sweep(&state) => {}
            _ = done.cancelled() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(state.config.heartbeat) => {}
            _ = done.cancelled() => return,
        }
    }
}

/// For each followed base tag, its head now, and the rebuilds that makes due
/// ([`crate::db::Db::queue_rebuilds`]). Errors are logged; the next sweep tries again.
pub async fn sweep(state: &AppState) {
    let bases = match state.db.followed_bases().await {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "reading the followed bases");
            return;
        }
    };
    for base in bases {
        // A base the operator no longer allows: no tenant build may name it, so a rebuild
        // could only fail. Its follows wait until it is allowed again.
        let name = base.split_once(':').map_or(base.as_str(), |(n, _)| n);
        if !state.config.global_bases.contains(name) {
            continue;
        }
        if let Err(e) = sweep_base(state, &base).await {
            tracing::warn!(base = %base, error = %e, "queueing the rebuilds of a base's move");
        }
    }
}

async fn sweep_base(state: &AppState, base: &str) -> Result<(), String> {
    let store = &state.setup.store;
    let tag: kiln_store::TagRef = base.parse().map_err(|e| format!("{e}"))?;
    let Some(head) = store.get_tag(&tag).await.map_err(|e| e.to_string())? else {
        // Untagged: nothing to rebuild against until it names an image again.
        return Ok(());
    };
    let head = head.manifest;
    let oci = match store.get_manifest(&head).await.map_err(|e| e.to_string())? {
        kiln_store::manifest::Manifest::Image(i) => i.oci_manifest.map(|b| b.digest),
        kiln_store::manifest::Manifest::Snapshot(_) => None,
    };
    let Some(oci) = oci else {
        return Err(format!(
            "{base} names {head}, which is no image with an OCI manifest (a build FROM it \
             would fail too)"
        ));
    };
    let (head_s, oci_s) = (head.to_string(), oci.to_string());
    let server = Server {
        executor: state.config.executor,
        boot: state.setup.boot.is_some(),
    };
    let m = BaseMove {
        tag: base,
        head: &head_s,
        oci: &oci_s,
        budget: state.config.follow_budget,
    };
    let queued = state
        .db
        .queue_rebuilds(&m, |g, room| plan(g, &m, room, &server))
        .await
        .map_err(|e| e.to_string())?;
    if queued.is_empty() {
        return Ok(());
    }
    tracing::info!(base = %base, head = %head, rebuilds = queued.len(), "a followed base moved: rebuilds queued");
    // A remote store: each rebuild holds its context (already there: the original's) with
    // a lease of its own, as a submission does; the sweep renews it.
    if state.contexts_in_store() {
        for (id, ctx) in &queued {
            let Some(d) = ctx else { continue };
            let r = match crate::context::store_object(d) {
                Ok(obj) => store
                    .put_shared_lease(
                        &crate::context::lease_id(id),
                        state.config.context_lease,
                        [obj],
                    )
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = r {
                tracing::warn!(build = %id, error = %e, "leasing a rebuild's context");
            }
        }
    }
    state.queued.notify_waiters();
    Ok(())
}

/// What a submission to this server may ask for, beyond the workspace's quota: what a
/// rebuild is checked against when it is queued, as its original was when submitted.
#[derive(Debug, Clone, Copy)]
struct Server {
    executor: kiln_pipeline::Executor,
    /// Whether it has a guest kernel and initramfs (snapshots).
    boot: bool,
}

/// What to do with a due group of follows: a rebuild of its build, with its tags and their
/// compare-and-swap expectations, when there is `room`; else skipped (past the move's
/// budget), or left waiting (the workspace's queue is full). The rebuild is a submission
/// of the workspace today: its limits are the original's within the workspace's quota now,
/// and what this server would refuse now (the host network under microVMs, a snapshot
/// without a guest kernel) is skipped.
fn plan(g: &DueGroup, m: &BaseMove<'_>, room: Room, server: &Server) -> Planned {
    let skip = |reason: String| {
        let mut l = Last::new("skipped", m.head);
        l.reason = Some(reason);
        Planned::Skip(l.json())
    };
    match room {
        Room::Yes => {}
        Room::PastBudget => {
            return skip(format!(
                "past this move's rebuild budget ({} rebuilds): waits for the base's next move",
                m.budget
            ));
        }
        Room::QueueFull => {
            let mut l = Last::new("skipped", m.head);
            l.reason = Some(format!(
                "the workspace's queue is full ({} builds queued or running): queued once it \
                 has room",
                g.quota.max_queued
            ));
            return Planned::Wait(l.json());
        }
        Room::TagBusy => {
            let mut l = Last::new("skipped", m.head);
            l.reason = Some(
                "a build of the workspace that moves the tag is queued or running: it goes \
                 first (queued once it ended, if the tag still follows)"
                    .into(),
            );
            return Planned::Wait(l.json());
        }
    }
    let mut spec: StoredSpec = match serde_json::from_str(&g.build.spec) {
        Ok(s) => s,
        Err(e) => return skip(format!("the followed build's spec does not read: {e}")),
    };
    spec.limits = spec.limits.within(&g.quota);
    if spec.network == crate::spec::NetworkSpec::Mode(crate::spec::NetworkMode::Host)
        && server.executor == kiln_pipeline::Executor::Vm
    {
        return skip(
            "the build asked for the host network, which this server no longer gives: its \
             build steps run in microVMs"
                .into(),
        );
    }
    if spec.snapshot && !server.boot {
        return skip(
            "the build took a snapshot, and this server has no guest kernel and initramfs \
             any more"
                .into(),
        );
    }
    let ws = &g.build.workspace;
    spec.store_tags = g.follows.iter().map(|f| f.tag.clone()).collect();
    spec.tags = g
        .follows
        .iter()
        .map(|f| {
            crate::tags::from_store(ws, &f.tag)
                .unwrap_or(&f.tag)
                .to_string()
        })
        .collect();
    spec.rebuild = Some(Rebuild {
        expect: g
            .follows
            .iter()
            .map(|f| (f.tag.clone(), f.image.clone()))
            .collect::<BTreeMap<_, _>>(),
        base_head: m.head.to_string(),
        configs: g.follows[0].configs.clone(),
    });
    // The tenant's credentials were for the original build only (sealed, then deleted).
    spec.registry_auth.clear();
    let id = match crate::db::new_build_id() {
        Ok(id) => id,
        Err(e) => return skip(format!("no build id: {e}")),
    };
    let spec_json = match serde_json::to_string(&spec) {
        Ok(j) => j,
        Err(e) => return skip(format!("the rebuild's spec does not serialize: {e}")),
    };
    let mut last = Last::new("queued", m.head);
    last.build = Some(id.clone());
    Planned::Queue(
        NewBuild {
            id,
            workspace: ws.clone(),
            spec: spec_json,
            recipe: g.build.recipe.clone(),
            context: g.build.context.clone(),
            idempotency: None,
            credentials: None,
        },
        last.json(),
    )
}

/// How a build ended, for [`after_build`].
pub enum End<'a> {
    /// It succeeded.
    Succeeded {
        /// Its result.
        result: &'a BuildResult,
        /// What a rebuild of it is checked against (a build that follows its base).
        check: Option<&'a kiln_pipeline::RebuildCheck>,
    },
    /// It failed (or was cancelled: `cancelled`).
    Failed {
        /// Why.
        failure: &'a Failure,
        /// Cancelled rather than failed.
        cancelled: bool,
    },
}

/// The follows' bookkeeping once build `row` (its spec `spec`) ended as `end`: a succeeded
/// `follow_base` build (or rebuild) makes its tags follow from it; a succeeded build without
/// it ends its tags' follows; a rebuild that did not succeed records why. Errors are
/// logged: the build's own end is already recorded.
pub async fn after_build(state: &AppState, row: &BuildRow, spec: &StoredSpec, end: End<'_>) {
    if let Err(e) = record(state, row, spec, end).await {
        tracing::error!(build = %row.id, error = %e, "recording the build's follows");
    }
}

async fn record(
    state: &AppState,
    row: &BuildRow,
    spec: &StoredSpec,
    end: End<'_>,
) -> Result<(), String> {
    let db = &state.db;
    let head = spec.rebuild.as_ref().map(|r| r.base_head.as_str());
    let (r, check) = match end {
        End::Succeeded { result, check } => (result, check),
        End::Failed { failure, cancelled } => {
            if let Some(head) = head {
                let state = if failure.stale_tag && !cancelled {
                    "skipped"
                } else {
                    "failed"
                };
                let mut l = Last::new(state, head);
                l.build = Some(row.id.clone());
                l.reason = Some(if failure.stale_tag {
                    format!(
                        "the tag moved meanwhile, so it was left alone: {}",
                        failure.reason
                    )
                } else {
                    failure.reason.clone()
                });
                db.end_rebuild(&row.id, &l.json())
                    .await
                    .map_err(|e| e.to_string())?;
            }
            return Ok(());
        }
    };
    if spec.store_tags.is_empty() {
        return Ok(());
    }
    let (Some(base_tag), Some(image), Some(base_oci)) = (&spec.follow, &r.image, &r.base) else {
        // Not following (or, unexpectedly, no image base after all): the tags it moved follow
        // nothing now.
        db.delete_follows(&row.workspace, &spec.store_tags)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    };
    // The base tag must be the operator's still: had the store lacked it, the build pulled
    // an image of its name from a registry, and registry bases cannot be followed.
    let in_store = match base_tag.parse::<kiln_store::TagRef>() {
        Ok(t) => state
            .setup
            .store
            .get_tag(&t)
            .await
            .map_err(|e| e.to_string())?
            .is_some(),
        Err(_) => false,
    };
    if !in_store {
        tracing::warn!(build = %row.id, base = %base_tag, "a follow_base build's base is no tag of the store: its tags follow nothing");
        db.delete_follows(&row.workspace, &spec.store_tags)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(());
    }
    let configs = match check {
        Some(c) => Some(
            serde_json::to_string(&Configs {
                original: c.original.clone(),
                old_base: c.old_base.clone(),
            })
            .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let last = head.map(|head| {
        let unchanged = spec
            .rebuild
            .as_ref()
            .is_some_and(|rb| rb.expect.values().all(|d| d == image));
        let mut l = Last::new(if unchanged { "unchanged" } else { "rebuilt" }, head);
        l.build = Some(row.id.clone());
        l.image = Some(image.clone());
        l.new_stored_bytes = Some(r.new_stored_bytes);
        l.json()
    });
    let follow = FollowRow {
        workspace: row.workspace.clone(),
        tag: String::new(),
        build_id: row.id.clone(),
        image: image.clone(),
        base_tag: base_tag.clone(),
        base_oci: base_oci.clone(),
        configs,
        created_ms: crate::db::now_ms(),
        tried_head: None,
        rebuild_build: None,
        last,
    };
    if spec.rebuild.is_some() {
        // Only the follows still waiting for it: one ended meanwhile stays ended.
        db.rebuilt_follows(&follow, &spec.store_tags).await
    } else {
        db.upsert_follows(&follow, &spec.store_tags).await
    }
    .map_err(|e| e.to_string())
}

/// The rebuild check a rebuild's spec carries, when its follow recorded config summaries.
pub fn rebuild_check(spec: &StoredSpec) -> Result<Option<kiln_pipeline::RebuildCheck>, String> {
    let Some(json) = spec.rebuild.as_ref().and_then(|r| r.configs.as_deref()) else {
        return Ok(None);
    };
    let c: Configs =
        serde_json::from_str(json).map_err(|e| format!("the follow's config summaries: {e}"))?;
    Ok(Some(c.check()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{EffectiveLimits, NetworkMode, NetworkSpec};

    fn spec(network: NetworkSpec, snapshot: bool) -> StoredSpec {
        StoredSpec {
            recipe: "Dockerfile".into(),
            recipe_in_context: false,
            recipe_digest: "sha256:00".into(),
            context: None,
            tags: vec!["app:1".into()],
            store_tags: vec!["a.app:1".into()],
            build_args: Default::default(),
            target: None,
            platform: None,
            snapshot,
            network,
            limits: EffectiveLimits {
                timeout_secs: 3600,
                memory_mib: 8192,
                vcpus: 8,
                disk_mib: None,
            },
            no_cache: false,
            registry_auth: vec![],
            ca_certs: None,
            follow: Some("kiln-default:latest".into()),
            rebuild: None,
        }
    }

    fn group(spec: &StoredSpec, quota: crate::Quota) -> DueGroup {
        DueGroup {
            build: BuildRow {
                id: "b1".into(),
                workspace: "a".into(),
                state: "succeeded".into(),
                spec: serde_json::to_string(spec).expect("json"),
                recipe: b"FROM kiln-default\n".to_vec(),
                context: None,
                created_ms: 0,
                started_ms: None,
                finished_ms: None,
                image: None,
                result: None,
                failure: None,
                claimed_by: None,
                attempt: 1,
            },
            follows: vec![FollowRow {
                workspace: "a".into(),
                tag: "a.app:1".into(),
                build_id: "b1".into(),
                image: "sha256:11".into(),
                base_tag: "kiln-default:latest".into(),
                base_oci: "sha256:22".into(),
                configs: None,
                created_ms: 0,
                tried_head: None,
                rebuild_build: None,
                last: None,
            }],
            quota,
        }
    }

    const MOVE: BaseMove<'static> = BaseMove {
        tag: "kiln-default:latest",
        head: "sha256:33",
        oci: "sha256:44",
        budget: 10,
    };
    const NS: Server = Server {
        executor: kiln_pipeline::Executor::Namespace,
        boot: true,
    };

    fn queued(p: Planned) -> StoredSpec {
        match p {
            Planned::Queue(b, _) => serde_json::from_str(&b.spec).expect("spec"),
            other => panic!("not queued: {other:?}"),
        }
    }

    fn skipped(p: Planned) -> Last {
        match p {
            Planned::Skip(l) => serde_json::from_str(&l).expect("last"),
            other => panic!("not skipped: {other:?}"),
        }
    }

    /// A rebuild is a submission of the workspace today: the original's limits, taken
    /// under the quota of its day, are lowered to the workspace's quota now.
    #[test]
    fn a_rebuild_runs_within_the_quota_of_its_day() {
        let s = spec(NetworkSpec::default(), false);
        let now = crate::Quota {
            max_timeout_secs: 600,
            max_memory_mib: 512,
            max_vcpus: 1,
            ..Default::default()
        };
        let r = queued(plan(&group(&s, now), &MOVE, Room::Yes, &NS));
        assert_eq!(
            r.limits,
            EffectiveLimits {
                timeout_secs: 600,
                memory_mib: 512,
                vcpus: 1,
                disk_mib: None,
            }
        );
        // Limits within the quota stay as they were.
        let r = queued(plan(
            &group(
                &s,
                crate::Quota {
                    max_timeout_secs: 7200,
                    max_memory_mib: 16384,
                    max_vcpus: 16,
                    ..Default::default()
                },
            ),
            &MOVE,
            Room::Yes,
            &NS,
        ));
        assert_eq!(r.limits, s.limits);
        assert!(r.rebuild.is_some());
    }

    /// Nor does a rebuild ask for what this server refuses today to a submission: the host
    /// network once steps run in microVMs, a snapshot without a guest kernel.
    #[test]
    fn a_rebuild_asks_for_nothing_the_server_refuses_now() {
        let vm = Server {
            executor: kiln_pipeline::Executor::Vm,
            boot: true,
        };
        let host = spec(NetworkSpec::Mode(NetworkMode::Host), false);
        let l = skipped(plan(
            &group(&host, Default::default()),
            &MOVE,
            Room::Yes,
            &vm,
        ));
        assert_eq!(l.state, "skipped");
        assert!(l.reason.expect("reason").contains("host network"));
        // Under the namespace executor it is still given.
        queued(plan(
            &group(&host, Default::default()),
            &MOVE,
            Room::Yes,
            &NS,
        ));
        let snap = spec(NetworkSpec::default(), true);
        let no_boot = Server {
            executor: kiln_pipeline::Executor::Vm,
            boot: false,
        };
        let l = skipped(plan(
            &group(&snap, Default::default()),
            &MOVE,
            Room::Yes,
            &no_boot,
        ));
        assert!(l.reason.expect("reason").contains("snapshot"));
        queued(plan(
            &group(&snap, Default::default()),
            &MOVE,
            Room::Yes,
            &vm,
        ));
        // A full queue leaves the group waiting (due still), not skipped.
        let full = plan(
            &group(&snap, Default::default()),
            &MOVE,
            Room::QueueFull,
            &vm,
        );
        assert!(matches!(full, Planned::Wait(_)), "{full:?}");
    }
}
