//! The nodes' side of the database: registration, heartbeats, the takeover sweep (lost
//! claims queued again or failed), a fenced node's give-back, pruning of long-gone nodes' rows,
//! and the store leases of uploaded contexts that every node's sweep renews. Methods of
//! [`Db`], in a file of their own; the schema and the builds' side are in [`super`].

use sqlx::Row as _;

use super::*;

impl Db {
    /// Registers node `n` with its first heartbeat, and stops the rows of its previous
    /// processes (same [`NodeInfo::name`]: one server per state directory), so the next
    /// [`Db::take_over`] re-queues what they ran at once, without waiting for the takeover
    /// time.
    pub async fn register_node(&self, n: &NodeInfo) -> Result<(), DbError> {
        let now = self.now_sql();
        let mut tx = self.write_tx().await?;
        sqlx::query(&format!(
            "UPDATE nodes SET stopped_ms = {now} WHERE id <> $1 AND name = $2
             AND stopped_ms IS NULL"
        ))
        .bind(&n.id)
        .bind(&n.name)
        .execute(&mut *tx)
        .await?;
        sqlx::query(&format!(
            "INSERT INTO nodes (id, name, listen, pid, started_ms, heartbeat_ms)
             VALUES ($1, $2, $3, $4, {now}, {now})"
        ))
        .bind(&n.id)
        .bind(&n.name)
        .bind(&n.listen)
        .bind(i64::from(n.pid))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Node `id`'s heartbeat, on the database's clock. False when its row is stopped (a
    /// newer process of the same name took over) or gone.
    /// Bounded ([`Db::bounded`]).
    pub async fn heartbeat(&self, id: &str) -> Result<bool, DbError> {
        let sql = format!(
            "UPDATE nodes SET heartbeat_ms = {} WHERE id = $1 AND stopped_ms IS NULL",
            self.now_sql()
        );
        self.bounded("writing the heartbeat", async |conn| {
            let r = sqlx::query(&sql).bind(id).execute(conn).await?;
            Ok(r.rows_affected() == 1)
        })
        .await
    }

    /// Marks node `id` stopped (a clean shutdown): what it still holds is taken over at the
    /// next sweep rather than after the takeover time.
    pub async fn stop_node(&self, id: &str) -> Result<(), DbError> {
        sqlx::query(&format!(
            "UPDATE nodes SET stopped_ms = {} WHERE id = $1 AND stopped_ms IS NULL",
            self.now_sql()
        ))
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The sweep every node runs on its heartbeat interval: each running build whose claim
    /// names a node that stopped, that has no row (a server before nodes existed), or whose
    /// last heartbeat is older than `takeover_ms` (database clock) is lost. A lost build
    /// that has had fewer than `max_attempts` attempts goes back to the queue (its next claim
    /// is attempt `n + 1`); one that has had them all ends failed with a reason that starts
    /// with [`SERVER_STOPPED`] and names the node. Either way its log gets a line saying so.
    /// Each move is conditional on the claim still being the lost one.
    ///
    /// Bounded ([`Db::bounded`]): a sweep that does not end in time commits nothing.
    pub async fn take_over(
        &self,
        takeover_ms: i64,
        max_attempts: u32,
    ) -> Result<Vec<TakenOver>, DbError> {
        self.bounded("sweeping for lost nodes' builds", async |conn| {
            self.take_over_on(conn, takeover_ms, max_attempts).await
        })
        .await
    }

    async fn take_over_on(
        &self,
        conn: &mut sqlx::AnyConnection,
        takeover_ms: i64,
        max_attempts: u32,
    ) -> Result<Vec<TakenOver>, DbError> {
        let now = self.now_sql();
        let mut tx = self.write_tx_on(conn).await?;
        let lost = sqlx::query(&format!(
            "SELECT b.id, b.claimed_by, b.attempt, n.listen, n.name, n.heartbeat_ms,
                    n.stopped_ms, {now} AS now_ms
             FROM builds b LEFT JOIN nodes n ON n.id = b.claimed_by
             WHERE b.state = 'running' AND (n.id IS NULL OR n.stopped_ms IS NOT NULL
               OR n.heartbeat_ms < {now} - $1)
             ORDER BY b.id"
        ))
        .bind(takeover_ms)
        .fetch_all(&mut *tx)
        .await?;
        let mut out = Vec::new();
        for r in &lost {
            let id: String = r.try_get("id")?;
            let node: Option<String> = r.try_get("claimed_by")?;
            let node = node.unwrap_or_default();
            let attempt: i64 = r.try_get("attempt")?;
            let listen: Option<String> = r.try_get("listen")?;
            let name: Option<String> = r.try_get("name")?;
            let heartbeat: Option<i64> = r.try_get("heartbeat_ms")?;
            let stopped: Option<i64> = r.try_get("stopped_ms")?;
            let db_now: i64 = r.try_get("now_ms")?;
            // The tenant reads `why` (its build's reason and log): the node by id only. Its
            // host, state directory and address go to the server's log.
            let why = match (heartbeat, stopped) {
                (Some(_), Some(_)) => format!("node {node} stopped"),
                (Some(h), None) => format!(
                    "node {node} stopped heartbeating: last heartbeat {:.1} s ago, takeover \
                     after {:.1} s",
                    (db_now - h) as f64 / 1000.0,
                    takeover_ms as f64 / 1000.0
                ),
                _ => format!("worker {node} is gone"),
            };
            if let Some(mut t) =
                Self::lose_attempt(&mut tx, &id, &node, attempt, max_attempts, &why).await?
            {
                if let (Some(n), Some(l)) = (name, listen) {
                    t.node_detail = format!("{n}, listening on {l}");
                }
                out.push(t);
            }
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Deletes the rows of nodes last heard of more than `retention_ms` ago (database clock:
    /// a stopped node stopped heartbeating when it stopped) that no running build is claimed
    /// by, so that the table does not grow by one row per server start. Run in every node's
    /// sweep, after [`Db::take_over`] (which leaves a lost node's builds queued or ended, so
    /// its row goes at the sweep after the retention). Ended builds keep the id of the node
    /// that ran them. A node whose row is gone is treated as stopped: its heartbeat writes
    /// nothing ([`Db::heartbeat`] is false), and a build still claimed by it would be taken
    /// over. Returns the ids deleted. Bounded ([`Db::bounded`]), as the rest of the sweep.
    pub async fn prune_nodes(&self, retention_ms: i64) -> Result<Vec<String>, DbError> {
        let sql = format!(
            "DELETE FROM nodes WHERE heartbeat_ms < {} - $1
               AND NOT EXISTS (SELECT 1 FROM builds b
                               WHERE b.claimed_by = nodes.id AND b.state = 'running')
             RETURNING id",
            self.now_sql()
        );
        let rows = self
            .bounded("removing the rows of long-gone nodes", async |conn| {
                Ok(sqlx::query(&sql).bind(retention_ms).fetch_all(conn).await?)
            })
            .await?;
        let mut ids = rows
            .iter()
            .map(|r| r.try_get::<String, _>("id"))
            .collect::<Result<Vec<_>, _>>()?;
        ids.sort();
        Ok(ids)
    }

    /// Records that the store holds build `build`'s context `digest` under a shared lease
    /// renewed now. Written before the lease and before the build itself: a row whose build
    /// does not exist is dropped only once it is due for renewal.
    pub async fn add_context_lease(&self, build: &str, digest: &str) -> Result<(), DbError> {
        sqlx::query(&format!(
            "INSERT INTO context_leases (build_id, digest, renewed_ms) VALUES ($1, $2, {})",
            self.now_sql()
        ))
        .bind(build)
        .bind(digest)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The context leases to act on: those of builds that ended and that no follow reruns
    /// (to delete), and those renewed more than `renew_after_ms` ago (database clock): renew
    /// them if the build is queued or running or a follow reruns it ([`crate::follow`]: its
    /// context must outlive it), else delete them (a build that was never inserted).
    pub async fn context_leases_due(
        &self,
        renew_after_ms: i64,
    ) -> Result<Vec<ContextLease>, DbError> {
        let sql = format!(
            "SELECT l.build_id, l.digest, l.renewed_ms, b.state,
               (SELECT COUNT(*) FROM follows f WHERE f.build_id = l.build_id) AS follows
             FROM context_leases l LEFT JOIN builds b ON b.id = l.build_id
             WHERE (b.state IN ('succeeded', 'failed', 'cancelled')
                    AND NOT EXISTS (SELECT 1 FROM follows f WHERE f.build_id = l.build_id))
               OR l.renewed_ms < {} - $1
             ORDER BY l.build_id",
            self.now_sql()
        );
        let rows = self
            .bounded("reading the context leases due", async |conn| {
                Ok(sqlx::query(&sql)
                    .bind(renew_after_ms)
                    .fetch_all(conn)
                    .await?)
            })
            .await?;
        rows.iter()
            .map(|r| {
                let state: Option<String> = r.try_get("state")?;
                let follows: i64 = r.try_get("follows")?;
                Ok(ContextLease {
                    build: r.try_get("build_id")?,
                    digest: r.try_get("digest")?,
                    renewed_ms: r.try_get("renewed_ms")?,
                    live: matches!(state.as_deref(), Some("queued" | "running")) || follows > 0,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(DbError::from)
    }

    /// Marks `l` renewed now, if no other node renewed or dropped it since it was read: true
    /// when this node is to rewrite the store lease.
    pub async fn renew_context_lease(&self, l: &ContextLease) -> Result<bool, DbError> {
        let sql = format!(
            "UPDATE context_leases SET renewed_ms = {} WHERE build_id = $1 AND renewed_ms = $2",
            self.now_sql()
        );
        self.bounded("renewing a context lease", async |conn| {
            let r = sqlx::query(&sql)
                .bind(&l.build)
                .bind(l.renewed_ms)
                .execute(conn)
                .await?;
            Ok(r.rows_affected() == 1)
        })
        .await
    }

    /// Deletes `l`'s row, if no other node renewed or dropped it since it was read: true
    /// when this node is to delete the store lease.
    pub async fn drop_context_lease(&self, l: &ContextLease) -> Result<bool, DbError> {
        self.bounded("dropping a context lease", async |conn| {
            let r =
                sqlx::query("DELETE FROM context_leases WHERE build_id = $1 AND renewed_ms = $2")
                    .bind(&l.build)
                    .bind(l.renewed_ms)
                    .execute(conn)
                    .await?;
            Ok(r.rows_affected() == 1)
        })
        .await
    }

    /// Ends attempt `attempt` of build `id`, claimed by `node` and lost for the reason `why`
    /// (which names the node): queued again while it has had fewer than `max_attempts`,
    /// otherwise failed ([`SERVER_STOPPED`]); a log line says which. Conditional on the claim
    /// still being that one: `None` when it is not.
    async fn lose_attempt(
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: &str,
        node: &str,
        attempt: i64,
        max_attempts: u32,
        why: &str,
    ) -> Result<Option<TakenOver>, DbError> {
        let requeued = attempt < i64::from(max_attempts);
        let text = if requeued {
            format!("{why}; attempt {attempt} of {max_attempts} lost, build queued again")
        } else {
            format!("{SERVER_STOPPED}: {why}; attempt {attempt} of {max_attempts}")
        };
        let changed = if requeued {
            sqlx::query(
                "UPDATE builds SET state = 'queued', started_ms = NULL, claimed_by = NULL
                 WHERE id = $1 AND state = 'running' AND claimed_by = $2 AND attempt = $3",
            )
            .bind(id)
            .bind(node)
            .bind(attempt)
            .execute(&mut **tx)
            .await?
        } else {
            sqlx::query(
                "UPDATE builds SET state = 'failed', finished_ms = $1, failure = $2
                 WHERE id = $3 AND state = 'running' AND claimed_by = $4 AND attempt = $5",
            )
            .bind(now_ms())
            .bind(serde_json::json!({ "reason": text }).to_string())
            .bind(id)
            .bind(node)
            .bind(attempt)
            .execute(&mut **tx)
            .await?
        };
        if changed.rows_affected() != 1 {
            return Ok(None);
        }
        sqlx::query(
            "INSERT INTO build_logs (build_id, seq, time_ms, step, text)
             SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, NULL, $3 FROM build_logs
             WHERE build_id = $1",
        )
        .bind(id)
        .bind(now_ms())
        .bind(&text)
        .execute(&mut **tx)
        .await?;
        Ok(Some(TakenOver {
            build: id.to_string(),
            node: node.to_string(),
            attempt,
            requeued,
            node_detail: String::new(),
        }))
    }

    /// Gives back the claim `claim` of build `id` when its node fenced itself (cancelled
    /// the attempt because it could not heartbeat) but still holds it: as
    /// [`Db::take_over`] does to a lost node's build, queued again or, past `max_attempts`,
    /// failed, with `why` in its log. `None` when the claim was taken already. Bounded
    /// ([`Db::bounded`]).
    pub async fn give_back(
        &self,
        id: &str,
        claim: &Claim,
        max_attempts: u32,
        why: &str,
    ) -> Result<Option<TakenOver>, DbError> {
        self.bounded("giving a claim back", async |conn| {
            let mut tx = self.write_tx_on(conn).await?;
            let t = Self::lose_attempt(&mut tx, id, &claim.node, claim.attempt, max_attempts, why)
                .await?;
            tx.commit().await?;
            Ok(t)
        })
        .await
    }

    /// Which database this is.
    pub fn backend(&self) -> Backend {
        self.backend
    }
}
