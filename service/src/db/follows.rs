//! The follows' side of the database ([`crate::follow`]): which workspace tags follow which
//! global base, and the rebuilds a base's move queues. Methods of [`Db`], in a file of their
//! own; the schema is in [`super`].

use sqlx::Row as _;

use super::*;

/// One workspace tag that follows a global base (a row of `follows`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowRow {
    /// The workspace.
    pub workspace: String,
    /// The store tag, `<ws>.NAME:TAG`.
    pub tag: String,
    /// The build whose recipe, context and spec a rebuild runs again: the last one that
    /// moved the tag (the tenant's, or a rebuild).
    pub build_id: String,
    /// The image manifest the tag named after that build: a rebuild moves the tag only from
    /// it.
    pub image: String,
    /// The global base tag followed, `NAME:TAG`.
    pub base_tag: String,
    /// The OCI manifest digest of the base that build resolved.
    pub base_oci: String,
    /// The config summaries a rebuild is checked against (JSON of
    /// [`crate::follow::Configs`]).
    pub configs: Option<String>,
    /// When the tag began to follow, Unix ms: rebuilds past a move's budget go oldest first.
    pub created_ms: i64,
    /// The base head (image manifest) a rebuild was last queued (or skipped) for.
    pub tried_head: Option<String>,
    /// The rebuild queued for [`FollowRow::tried_head`] (none: skipped, past the budget).
    pub rebuild_build: Option<String>,
    /// The last rebuild's report (JSON of [`crate::follow::Last`]).
    pub last: Option<String>,
}

fn follow_row(r: &AnyRow) -> Result<FollowRow, sqlx::Error> {
    Ok(FollowRow {
        workspace: r.try_get("workspace")?,
        tag: r.try_get("tag")?,
        build_id: r.try_get("build_id")?,
        image: r.try_get("image")?,
        base_tag: r.try_get("base_tag")?,
        base_oci: r.try_get("base_oci")?,
        configs: r.try_get("configs")?,
        created_ms: r.try_get("created_ms")?,
        tried_head: r.try_get("tried_head")?,
        rebuild_build: r.try_get("rebuild_build")?,
        last: r.try_get("last")?,
    })
}

/// A base's move as [`Db::queue_rebuilds`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseMove<'a> {
    /// The global base tag, `NAME:TAG`.
    pub tag: &'a str,
    /// The image manifest it names now.
    pub head: &'a str,
    /// That image's OCI manifest digest (what a build `FROM` the tag resolves).
    pub oci: &'a str,
    /// Most rebuilds queued for this head, all workspaces together.
    pub budget: u32,
}

/// The follows of one build that a move makes due, rebuilt together.
#[derive(Debug, Clone)]
pub struct DueGroup {
    /// The build they rerun (its row, for its spec, recipe and context).
    pub build: BuildRow,
    /// Its follows that are due (same workspace and build), oldest first.
    pub follows: Vec<FollowRow>,
    /// The workspace's quota now (a rebuild runs within it, not within the one its
    /// original was submitted under).
    pub quota: Quota,
}

/// Whether a move may queue a [`DueGroup`]'s rebuild now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Yes.
    Yes,
    /// No: the move's budget is spent (the group waits for the base's next move).
    PastBudget,
    /// No: the workspace's queue is full ([`Quota::max_queued`], as for its own
    /// submissions); the group stays due, and a later sweep queues it once there is room.
    QueueFull,
    /// No: a build of the workspace (not a rebuild) that moves one of the group's tags is
    /// queued or running. It goes first (a rebuild moving the tag before it ends would fail
    /// it: its tags move only from what they named when it started); the group stays due.
    TagBusy,
}

/// What [`Db::queue_rebuilds`] reads of a queued or running build's spec: the store tags it
/// moves, and whether it is a rebuild.
#[derive(serde::Deserialize)]
struct Moves {
    #[serde(default)]
    store_tags: Vec<String>,
    #[serde(default)]
    rebuild: Option<serde::de::IgnoredAny>,
}

/// Stops rebuild `id` when it is queued (cancelled) or running (asked to stop), and makes
/// the follows it was for due again; whether it was stopped.
async fn stop_rebuild(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    id: &str,
    why: &str,
) -> Result<bool, DbError> {
    let failure = serde_json::json!({ "reason": format!("cancelled before it started: {why}") });
    let stopped = sqlx::query(
        "UPDATE builds SET state = 'cancelled', finished_ms = $1, cancel_requested = 1,
         failure = $2 WHERE id = $3 AND state = 'queued'",
    )
    .bind(now_ms())
    .bind(failure.to_string())
    .bind(id)
    .execute(&mut **tx)
    .await?
    .rows_affected()
        + sqlx::query("UPDATE builds SET cancel_requested = 1 WHERE id = $1 AND state = 'running'")
            .bind(id)
            .execute(&mut **tx)
            .await?
            .rows_affected();
    if stopped > 0 {
        sqlx::query("UPDATE follows SET tried_head = NULL WHERE rebuild_build = $1")
            .bind(id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(stopped > 0)
}

/// What [`Db::queue_rebuilds`] did with one [`DueGroup`].
#[derive(Debug, Clone)]
pub enum Planned {
    /// Queue this build (a rebuild), and record `last` (JSON) on the group's follows.
    Queue(NewBuild, String),
    /// Queue nothing; record `last` (JSON) on the group's follows (skipped, past the
    /// budget, or a spec that cannot be rebuilt).
    Skip(String),
    /// Queue nothing yet; record `last` (JSON) on the group's follows, which stay due for
    /// this move ([`Room::QueueFull`]).
    Wait(String),
}

impl Db {
    /// Records that the store tags `tags` of `row.workspace` follow `row.base_tag` from the
    /// build `row.build_id` (each tag as `row.tag`; the others fields as given): a new row, or
    /// the tag's row replaced except for when it began to follow and the last head a
    /// rebuild was queued for.
    pub async fn upsert_follows(&self, row: &FollowRow, tags: &[String]) -> Result<(), DbError> {
        let mut tx = self.write_tx().await?;
        for t in tags {
            sqlx::query(
                "INSERT INTO follows (workspace, tag, build_id, image, base_tag, base_oci,
                 configs, created_ms, tried_head, rebuild_build, last)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
                 ON CONFLICT(workspace, tag) DO UPDATE SET build_id = excluded.build_id,
                 image = excluded.image, base_tag = excluded.base_tag,
                 base_oci = excluded.base_oci, configs = excluded.configs,
                 last = COALESCE(excluded.last, follows.last)",
            )
            .bind(&row.workspace)
            .bind(t)
            .bind(&row.build_id)
            .bind(&row.image)
            .bind(&row.base_tag)
            .bind(&row.base_oci)
            .bind(&row.configs)
            .bind(row.created_ms)
            .bind(&row.tried_head)
            .bind(&row.rebuild_build)
            .bind(&row.last)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Ends the follows of the store tags `tags` of workspace `ws` (a build that does not
    /// follow moved them, or the tenant moved or deleted them); the number ended. A rebuild
    /// queued or running for an ended follow is stopped (cancelled, or asked to stop): it
    /// would move a tag that follows nothing any more whenever the tag still names the
    /// image the rebuild started from. The other tags of its group are due again, for a
    /// rebuild of their own.
    pub async fn delete_follows(&self, ws: &str, tags: &[String]) -> Result<u64, DbError> {
        let mut tx = self.write_tx().await?;
        let mut n = 0;
        for t in tags {
            let r = sqlx::query(
                "DELETE FROM follows WHERE workspace = $1 AND tag = $2 RETURNING rebuild_build",
            )
            .bind(ws)
            .bind(t)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(r) = r else { continue };
            n += 1;
            let Some(rebuild) = r.try_get::<Option<String>, _>("rebuild_build")? else {
                continue;
            };
            stop_rebuild(
                &mut tx,
                &rebuild,
                "a tag it was to move follows its base no more",
            )
            .await?;
        }
        tx.commit().await?;
        Ok(n)
    }

    /// Stops the rebuilds queued or running for the follows of the store tags `tags` of
    /// workspace `ws`, for the tenant's own build of one of them, just queued, which goes
    /// first ([`Room::TagBusy`]); the number stopped. Their follows are due again.
    pub async fn preempt_rebuilds(&self, ws: &str, tags: &[String]) -> Result<u64, DbError> {
        // Read first, once (a submission may have many tags): most find no rebuild queued or
        // running for their tags, and take no write lock.
        let rows = sqlx::query(
            "SELECT f.tag, f.rebuild_build FROM follows f JOIN builds b ON b.id = f.rebuild_build
             WHERE f.workspace = $1 AND b.state IN ('queued', 'running')",
        )
        .bind(ws)
        .fetch_all(&self.pool)
        .await?;
        let tags: std::collections::BTreeSet<&str> = tags.iter().map(String::as_str).collect();
        let mut ids = std::collections::BTreeSet::new();
        for r in &rows {
            let tag: String = r.try_get("tag")?;
            if tags.contains(tag.as_str()) {
                ids.insert(r.try_get::<String, _>("rebuild_build")?);
            }
        }
        if ids.is_empty() {
            return Ok(0);
        }
        let mut tx = self.write_tx().await?;
        let mut n = 0;
        for id in &ids {
            if stop_rebuild(
                &mut tx,
                id,
                "the tenant submitted a build of a tag it was to move",
            )
            .await?
            {
                n += 1;
            }
        }
        tx.commit().await?;
        Ok(n)
    }

    /// Records that rebuild `row.build_id` moved the store tags `tags` (each as `row.tag`;
    /// the other fields as given, but for when it began to follow and the last head tried):
    /// only the follows that still wait for this rebuild, so that a follow ended meanwhile
    /// does not begin again.
    pub async fn rebuilt_follows(&self, row: &FollowRow, tags: &[String]) -> Result<(), DbError> {
        let mut tx = self.write_tx().await?;
        for t in tags {
            sqlx::query(
                "UPDATE follows SET build_id = $1, image = $2, base_tag = $3, base_oci = $4,
                 configs = $5, last = COALESCE($6, last)
                 WHERE workspace = $7 AND tag = $8 AND rebuild_build = $1",
            )
            .bind(&row.build_id)
            .bind(&row.image)
            .bind(&row.base_tag)
            .bind(&row.base_oci)
            .bind(&row.configs)
            .bind(&row.last)
            .bind(&row.workspace)
            .bind(t)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The follows of workspace `ws`, by tag.
    pub async fn follows(&self, ws: &str) -> Result<Vec<FollowRow>, DbError> {
        let rows = sqlx::query("SELECT * FROM follows WHERE workspace = $1 ORDER BY tag")
            .bind(ws)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(follow_row).collect::<Result<_, _>>()?)
    }

    /// The global base tags some tag follows.
    /// Bounded ([`Db::bounded`]): the liveness sweep calls it.
    pub async fn followed_bases(&self) -> Result<Vec<String>, DbError> {
        self.bounded("reading the followed bases", async |conn| {
            let rows = sqlx::query("SELECT DISTINCT base_tag FROM follows ORDER BY base_tag")
                .fetch_all(conn)
                .await?;
            Ok(rows
                .iter()
                .map(|r| r.try_get("base_tag"))
                .collect::<Result<_, _>>()?)
        })
        .await
    }

    /// How many tags follow the global base tag `base_tag`, and in how many workspaces.
    pub async fn follow_counts(&self, base_tag: &str) -> Result<(u64, u64), DbError> {
        let r = sqlx::query(
            "SELECT COUNT(*) AS n, COUNT(DISTINCT workspace) AS w FROM follows
             WHERE base_tag = $1",
        )
        .bind(base_tag)
        .fetch_one(&self.pool)
        .await?;
        let (n, w): (i64, i64) = (r.try_get("n")?, r.try_get("w")?);
        Ok((n.max(0) as u64, w.max(0) as u64))
    }

    /// The bytes of the build contexts workspace `ws` keeps for its follows (each distinct
    /// context blob once, at its uploaded size): they count against its storage quota.
    pub async fn kept_context_bytes(&self, ws: &str) -> Result<u64, DbError> {
        let n: Option<i64> = sqlx::query(
            "SELECT SUM(size) AS n FROM blobs WHERE workspace = $1 AND digest IN
             (SELECT b.context FROM follows f JOIN builds b ON b.id = f.build_id
              WHERE f.workspace = $1 AND b.context IS NOT NULL)",
        )
        .bind(ws)
        .fetch_one(&self.pool)
        .await?
        .try_get("n")?;
        Ok(n.unwrap_or(0).max(0) as u64)
    }

    /// The storage quota of workspace `ws` as a build's tags (or a tenant's tag move) are
    /// checked against it: its tags' prefix, its cap, and the contexts it keeps for its
    /// follows. `None`: no cap (or no such workspace).
    pub async fn storage_quota(
        &self,
        ws: &str,
    ) -> Result<Option<kiln_pipeline::StorageQuota>, DbError> {
        let Some(max_bytes) = self.quota(ws).await?.and_then(|q| q.max_storage_bytes) else {
            return Ok(None);
        };
        Ok(Some(kiln_pipeline::StorageQuota {
            tag_prefix: crate::tags::store_prefix(ws),
            max_bytes,
            kept_bytes: self.kept_context_bytes(ws).await?,
        }))
    }

    /// Records `last` (JSON) on the follows whose last rebuild is `build` (it ended without
    /// moving their tags).
    pub async fn end_rebuild(&self, build: &str, last: &str) -> Result<u64, DbError> {
        Ok(
            sqlx::query("UPDATE follows SET last = $1 WHERE rebuild_build = $2")
                .bind(last)
                .bind(build)
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }

    /// Queues the rebuilds a base's move `m` makes due, in one transaction (so that of the
    /// nodes that see the move, one queues each rebuild). Due: a follow of `m.tag` built
    /// from another base than `m.oci`, not yet tried for `m.head`, and with no rebuild
    /// queued or running. Its follows are grouped by the build they rerun (one rebuild moves
    /// all the group's tags), those skipped at an earlier move (past its budget) first, then
    /// the oldest follow first; `plan` says what to do with each group,
    /// given whether there is [`Room`]: in the move's budget (rebuilds already queued for
    /// `m.head` count), and in the workspace's queue (its `max_queued`, as a submission).
    /// Each group's follows are then marked tried for `m.head`, but for
    /// [`Planned::Wait`]'s, which stay due. Returns the builds queued, with their contexts.
    pub async fn queue_rebuilds(
        &self,
        m: &BaseMove<'_>,
        mut plan: impl FnMut(&DueGroup, Room) -> Planned,
    ) -> Result<Vec<(String, Option<String>)>, DbError> {
        let mut tx = self.write_tx().await?;
        let due = sqlx::query(
            "SELECT f.* FROM follows f WHERE f.base_tag = $1 AND f.base_oci <> $2
             AND (f.tried_head IS NULL OR f.tried_head <> $3)
             AND NOT EXISTS (SELECT 1 FROM builds b WHERE b.id = f.rebuild_build
                             AND b.state IN ('queued', 'running'))
             ORDER BY CASE WHEN f.tried_head IS NOT NULL AND f.rebuild_build IS NULL
                           THEN 0 ELSE 1 END,
                      f.created_ms, f.workspace, f.tag",
        )
        .bind(m.tag)
        .bind(m.oci)
        .bind(m.head)
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(follow_row)
        .collect::<Result<Vec<_>, _>>()?;
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let mut used: i64 = sqlx::query(
            "SELECT COUNT(DISTINCT rebuild_build) AS n FROM follows
             WHERE base_tag = $1 AND tried_head = $2 AND rebuild_build IS NOT NULL",
        )
        .bind(m.tag)
        .bind(m.head)
        .fetch_one(&mut *tx)
        .await?
        .try_get("n")?;
        // In the order of their first follow; found by (workspace, build) in a map, not by a
        // scan of the groups so far (a workspace may follow from many builds).
        let mut groups: Vec<Vec<FollowRow>> = Vec::new();
        let mut index: std::collections::HashMap<(String, String), usize> = Default::default();
        for f in due {
            match index.entry((f.workspace.clone(), f.build_id.clone())) {
                std::collections::hash_map::Entry::Occupied(e) => groups[*e.get()].push(f),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(groups.len());
                    groups.push(vec![f]);
                }
            }
        }
        let mut queued = Vec::new();
        let now = now_ms();
        for follows in groups {
            let r = sqlx::query("SELECT * FROM builds WHERE id = $1")
                .bind(&follows[0].build_id)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(r) = r else {
                // The build it reruns is gone (a damaged database): nothing to rerun.
                tracing::error!(build = %follows[0].build_id, "a followed build's row is missing");
                continue;
            };
            let build = build_row(&r)?;
            let quota = sqlx::query("SELECT * FROM workspaces WHERE id = $1")
                .bind(&build.workspace)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(quota) = quota.as_ref().map(quota_row).transpose()? else {
                tracing::error!(workspace = %build.workspace, "a following workspace's row is missing");
                continue;
            };
            // Its queued and running builds, the rebuilds queued above included.
            let active = sqlx::query(
                "SELECT spec FROM builds WHERE workspace = $1 AND state IN ('queued', 'running')",
            )
            .bind(&build.workspace)
            .fetch_all(&mut *tx)
            .await?;
            let group_tags: std::collections::HashSet<&str> =
                follows.iter().map(|f| f.tag.as_str()).collect();
            let mut busy = false;
            for r in &active {
                let spec: String = r.try_get("spec")?;
                if let Ok(b) = serde_json::from_str::<Moves>(&spec)
                    && b.rebuild.is_none()
                    && b.store_tags.iter().any(|t| group_tags.contains(t.as_str()))
                {
                    busy = true;
                    break;
                }
            }
            let active = active.len() as i64;
            let room = if busy {
                Room::TagBusy
            } else if used >= i64::from(m.budget) {
                Room::PastBudget
            } else if active >= i64::from(quota.max_queued) {
                Room::QueueFull
            } else {
                Room::Yes
            };
            let group = DueGroup {
                build,
                follows,
                quota,
            };
            let (rebuild, last) = match plan(&group, room) {
                Planned::Queue(b, last) => (Some(b), last),
                Planned::Skip(last) => (None, last),
                Planned::Wait(last) => {
                    for f in &group.follows {
                        sqlx::query(
                            "UPDATE follows SET last = $1 WHERE workspace = $2 AND tag = $3",
                        )
                        .bind(&last)
                        .bind(&f.workspace)
                        .bind(&f.tag)
                        .execute(&mut *tx)
                        .await?;
                    }
                    continue;
                }
            };
            if let Some(b) = &rebuild {
                insert_build_row(&mut tx, b, now).await?;
                if let Some(d) = &b.context {
                    sqlx::query(&format!(
                        "INSERT INTO context_leases (build_id, digest, renewed_ms)
                         VALUES ($1, $2, {})",
                        self.now_sql()
                    ))
                    .bind(&b.id)
                    .bind(d)
                    .execute(&mut *tx)
                    .await?;
                }
                used += 1;
                queued.push((b.id.clone(), b.context.clone()));
            }
            for f in &group.follows {
                sqlx::query(
                    "UPDATE follows SET tried_head = $1, rebuild_build = $2, last = $3
                     WHERE workspace = $4 AND tag = $5",
                )
                .bind(m.head)
                .bind(rebuild.as_ref().map(|b| &b.id))
                .bind(&last)
                .bind(&f.workspace)
                .bind(&f.tag)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(queued)
    }
}

#[cfg(test)]
#[path = "follows_tests.rs"]
mod tests;
