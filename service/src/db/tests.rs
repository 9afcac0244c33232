//! Tests of [`super::Db`] on SQLite and on the PostgreSQL test server
//! (`KILN_TEST_POSTGRES_URL`).

use super::*;

fn quota(max_concurrent: u32, max_queued: u32) -> Quota {
    Quota {
        max_concurrent,
        max_queued,
        ..Quota::default()
    }
}

fn build(id: &str, ws: &str) -> NewBuild {
    NewBuild {
        id: id.into(),
        workspace: ws.into(),
        spec: "{}".into(),
        recipe: b"FROM scratch\n".to_vec(),
        context: None,
        idempotency: None,
        credentials: None,
    }
}

/// A new, empty PostgreSQL database on the test server (`KILN_TEST_POSTGRES_URL`, which
/// `ci/setup.sh` starts).
pub(crate) async fn postgres() -> Db {
    Db::connect(&postgres_url().await).await.expect("open")
}

/// The URL of a new, empty PostgreSQL database on the test server.
async fn postgres_url() -> String {
    let url = std::env::var("KILN_TEST_POSTGRES_URL").unwrap_or_else(|_| {
        panic!(
            "KILN_TEST_POSTGRES_URL is not set: run `. ci/setup.sh` (or source \
             /var/cache/kiln-ci/env) first; it starts PostgreSQL on 127.0.0.1"
        )
    });
    sqlx::any::install_default_drivers();
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("random");
    let name = format!("kiln_test_{}", hex::encode(b));
    let admin = sqlx::AnyPool::connect(&url)
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .expect("create database");
    let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
    format!("{base}/{name}")
}

async fn sqlite(t: &tempfile::TempDir) -> Db {
    Db::open(&t.path().join("kiln.db")).await.expect("open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_build_is_claimed_once_within_the_caps() {
    let t = tempfile::tempdir().expect("tmp");
    claims(sqlite(&t).await).await;
    claims(postgres().await).await;
}

/// Issue 43 §2: two workspaces submit a burst each, the first a little earlier; the
/// first two claims (two workers) take one build of each, and the next goes to the
/// oldest again once both run one.
#[tokio::test]
async fn claims_are_fair_between_workspaces() {
    let t = tempfile::tempdir().expect("tmp");
    fair(sqlite(&t).await).await;
    fair(postgres().await).await;
}

async fn fair(db: Db) {
    for ws in ["a", "b"] {
        db.upsert_workspace(ws, &quota(2, 100), true)
            .await
            .expect("ws");
    }
    for ws in ["a", "b"] {
        for i in 0..5 {
            db.insert_build(&build(&format!("{ws}{i}"), ws), 100, 1000)
                .await
                .expect("insert");
            // Distinct creation times: `a`'s burst is older than `b`'s.
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(db.claim("w").await.expect("claim").expect("a build").id);
    }
    assert_eq!(got, ["a0", "b0", "a1", "b1"], "claims in order");
    // Both at their cap of two: nothing more.
    assert!(db.claim("w").await.expect("claim").is_none());
}

#[tokio::test]
async fn queue_cap_idempotency_and_restart() {
    let t = tempfile::tempdir().expect("tmp");
    queue(sqlite(&t).await).await;
    queue(postgres().await).await;
}

/// A database made before steps named their executor gets the column when opened (once:
/// a second open changes nothing), its old steps read as having none, and steps written
/// then read theirs back.
#[tokio::test]
async fn steps_name_their_executor_also_in_a_database_made_before() {
    let t = tempfile::tempdir().expect("tmp");
    let sqlite = format!("sqlite://{}?mode=rwc", t.path().join("kiln.db").display());
    executor_column(&sqlite).await;
    executor_column(&postgres_url().await).await;
}

/// A database made before workspaces had a storage quota gets the column when opened: its
/// old workspaces have none, and a quota set then is read back (SQLite and PostgreSQL).
#[tokio::test]
async fn storage_quota_also_in_a_database_made_before() {
    let t = tempfile::tempdir().expect("tmp");
    let sqlite = format!("sqlite://{}?mode=rwc", t.path().join("kiln.db").display());
    storage_column(&sqlite).await;
    storage_column(&postgres_url().await).await;
}

async fn storage_column(url: &str) {
    sqlx::any::install_default_drivers();
    let old = sqlx::AnyPool::connect(url).await.expect("connect");
    for sql in [
        "CREATE TABLE workspaces (
            id TEXT PRIMARY KEY,
            created_ms BIGINT NOT NULL,
            max_concurrent BIGINT NOT NULL,
            max_queued BIGINT NOT NULL,
            max_timeout_secs BIGINT NOT NULL,
            max_memory_mib BIGINT NOT NULL,
            max_vcpus BIGINT NOT NULL)",
        "INSERT INTO workspaces VALUES ('old', 1, 3, 30, 600, 512, 1)",
    ] {
        sqlx::query(sql).execute(&old).await.expect(sql);
    }
    old.close().await;
    let db = Db::connect(url).await.expect("open the old database");
    let q = db
        .quota("old")
        .await
        .expect("quota")
        .expect("old workspace");
    assert_eq!((q.max_concurrent, q.max_storage_bytes), (3, None));
    let capped = Quota {
        max_storage_bytes: Some(5 << 30),
        ..q
    };
    db.upsert_workspace("old", &capped, true)
        .await
        .expect("set");
    db.upsert_workspace("new", &capped, false)
        .await
        .expect("insert");
    for ws in ["old", "new"] {
        assert_eq!(db.quota(ws).await.expect("quota"), Some(capped), "{ws}");
    }
    // Without `replace`, an existing workspace keeps its quota.
    db.upsert_workspace("old", &Quota::default(), false)
        .await
        .expect("keep");
    assert_eq!(db.quota("old").await.expect("quota"), Some(capped));
}

/// Sealed credentials live exactly while their build is queued or running: stored with the
/// build, gone when its worker ends it, and gone after the sweep when it ended otherwise (a
/// cancel while queued).
#[tokio::test]
async fn credentials_live_while_their_build_does() {
    let t = tempfile::tempdir().expect("tmp");
    credentials(sqlite(&t).await).await;
    credentials(postgres().await).await;
}

async fn credentials(db: Db) {
    db.upsert_workspace("a", &quota(1, 10), true)
        .await
        .expect("ws");
    for id in ["b1", "b2"] {
        let b = NewBuild {
            credentials: Some(format!("sealed-{id}").into_bytes()),
            ..build(id, "a")
        };
        assert_eq!(
            db.insert_build(&b, 10, 1000).await.expect("insert"),
            Inserted::Queued
        );
    }
    assert_eq!(
        db.credentials("b1").await.expect("read"),
        Some(b"sealed-b1".to_vec())
    );
    assert_eq!(db.credentials("none").await.expect("read"), None);
    // One runs and ends; the other is cancelled while queued.
    let row = db.claim("n1").await.expect("claim").expect("claimed");
    let (run, queued) = if row.id == "b1" {
        ("b1", "b2")
    } else {
        ("b2", "b1")
    };
    let claim = row.claim().expect("a claim");
    assert_eq!(db.drop_ended_credentials().await.expect("sweep"), 0);
    assert!(
        db.finish(run, &claim, "succeeded", None, None, None)
            .await
            .expect("finish")
    );
    assert_eq!(db.credentials(run).await.expect("read"), None);
    db.request_cancel("a", queued).await.expect("cancel");
    assert!(db.credentials(queued).await.expect("read").is_some());
    assert_eq!(db.drop_ended_credentials().await.expect("sweep"), 1);
    assert_eq!(db.credentials(queued).await.expect("read"), None);
}

async fn executor_column(url: &str) {
    sqlx::any::install_default_drivers();
    let old = sqlx::AnyPool::connect(url).await.expect("connect");
    for sql in [
        "CREATE TABLE build_steps (
            build_id TEXT NOT NULL,
            step BIGINT NOT NULL,
            stage BIGINT NOT NULL,
            location TEXT NOT NULL,
            instruction TEXT NOT NULL,
            cached BIGINT NOT NULL,
            started_ms BIGINT NOT NULL,
            finished_ms BIGINT,
            layer TEXT,
            PRIMARY KEY (build_id, step))",
        "INSERT INTO build_steps VALUES ('old', 1, 0, 'Dockerfile:2', 'RUN true', 0, 1, 2, 'sha256:00')",
    ] {
        sqlx::query(sql).execute(&old).await.expect(sql);
    }
    old.close().await;
    drop(Db::connect(url).await.expect("open the old database"));
    let db = Db::connect(url).await.expect("open it again");
    let old = db.steps("old").await.expect("steps");
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].layer.as_deref(), Some("sha256:00"));
    assert_eq!(old[0].executor, None);

    db.upsert_workspace("a", &quota(1, 10), true)
        .await
        .expect("ws");
    db.insert_build(&build("b1", "a"), 10, 1000)
        .await
        .expect("insert");
    let claim = db
        .claim("n1")
        .await
        .expect("claim")
        .and_then(|r| r.claim())
        .expect("claimed");
    let step = |n: i64, executor: Option<&str>| {
        Record::Step(StepRow {
            step: n,
            stage: 0,
            location: format!("Dockerfile:{n}"),
            instruction: "RUN true".into(),
            cached: false,
            started_ms: 1,
            finished_ms: None,
            layer: None,
            executor: executor.map(str::to_string),
            why: if n == 1 {
                vec![kiln_pipeline::event::MissReason::NoEarlierBuild]
            } else {
                Vec::new()
            },
        })
    };
    assert!(
        db.write_batch(
            "b1",
            &claim,
            &[
                step(1, Some("vm")),
                step(2, None),
                step(3, Some("namespace"))
            ]
        )
        .await
        .expect("write")
    );
    let got: Vec<_> = db
        .steps("b1")
        .await
        .expect("steps")
        .into_iter()
        .map(|s| (s.executor, s.why.len()))
        .collect();
    assert_eq!(
        got,
        [
            (Some("vm".to_string()), 1),
            (None, 0),
            (Some("namespace".to_string()), 0)
        ]
    );
}

async fn claims(db: Db) {
    db.upsert_workspace("a", &quota(100, 1000), true)
        .await
        .expect("ws");
    db.upsert_workspace("b", &quota(1, 1000), true)
        .await
        .expect("ws");
    for i in 0..60 {
        let r = db
            .insert_build(&build(&format!("a{i}"), "a"), 1000, 1000)
            .await
            .expect("insert");
        assert_eq!(r, Inserted::Queued);
    }
    for i in 0..3 {
        db.insert_build(&build(&format!("b{i}"), "b"), 1000, 1000)
            .await
            .expect("insert");
    }
    let tasks: Vec<_> = (0..8)
        .map(|w| {
            let db = db.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                while let Some(b) = db.claim(&format!("w{w}")).await.expect("claim") {
                    assert_eq!(b.attempt, 1);
                    got.push(b.id);
                }
                got
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "a build was claimed twice");
    // Every build of `a`; one of `b`, whose cap is one running build.
    assert_eq!(all.iter().filter(|i| i.starts_with('a')).count(), 60);
    assert_eq!(all.iter().filter(|i| i.starts_with('b')).count(), 1);
    let b = all.iter().find(|i| i.starts_with('b')).expect("b").clone();
    let claim = db
        .build("b", &b)
        .await
        .expect("row")
        .and_then(|r| r.claim())
        .expect("claimed");
    assert!(
        db.finish(&b, &claim, "succeeded", None, None, None)
            .await
            .expect("finish")
    );
    assert!(
        !db.finish(&b, &claim, "failed", None, None, None)
            .await
            .expect("finish"),
        "ends once"
    );
    assert!(
        db.claim("w")
            .await
            .expect("claim")
            .is_some_and(|r| r.workspace == "b")
    );
}

async fn queue(db: Db) {
    db.upsert_workspace("a", &quota(1, 2), true)
        .await
        .expect("ws");
    let mut b = build("x1", "a");
    b.idempotency = Some(("k".into(), "h1".into()));
    assert_eq!(
        db.insert_build(&b, 2, 1000).await.expect("ins"),
        Inserted::Queued
    );
    let mut again = build("x2", "a");
    again.idempotency = Some(("k".into(), "h1".into()));
    assert_eq!(
        db.insert_build(&again, 2, 1000).await.expect("ins"),
        Inserted::Existing("x1".into())
    );
    again.idempotency = Some(("k".into(), "h2".into()));
    assert_eq!(
        db.insert_build(&again, 2, 1000).await.expect("ins"),
        Inserted::KeyReused
    );
    // Past the window the key names a new build.
    assert_eq!(
        db.insert_build(&again, 2, 0).await.expect("ins"),
        Inserted::Queued
    );
    assert_eq!(
        db.insert_build(&build("x3", "a"), 2, 1000)
            .await
            .expect("ins"),
        Inserted::OverQuota
    );
    // A restart (a new process of the same node name, max 1 attempt) fails what was
    // running, and only that.
    register(&db, "n1", "host:/state").await;
    let claimed = db.claim("n1").await.expect("claim").expect("one");
    register(&db, "n2", "host:/state").await;
    let taken = db.take_over(60_000, 1).await.expect("take over");
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert!(!taken[0].requeued);
    let row = db.build("a", &claimed.id).await.expect("row").expect("row");
    assert_eq!(row.state, "failed");
    let reason = row.failure.expect("failure");
    // The tenant's reason names the node by id; where it ran is for the server's log.
    assert!(
        reason.contains(SERVER_STOPPED) && reason.contains("node n1 stopped"),
        "{reason}"
    );
    assert!(!reason.contains("host:/state"), "{reason}");
    assert!(taken[0].node_detail.starts_with("host:/state"), "{taken:?}");
    let other = if claimed.id == "x1" { "x2" } else { "x1" };
    assert_eq!(
        db.state(other).await.expect("state").as_deref(),
        Some("queued")
    );
}

async fn register(db: &Db, id: &str, name: &str) {
    db.register_node(&NodeInfo {
        id: id.into(),
        name: name.into(),
        listen: "127.0.0.1:1".into(),
        pid: 1,
    })
    .await
    .expect("register");
}

#[tokio::test]
async fn rows_of_long_gone_nodes_without_claims_are_pruned() {
    let t = tempfile::tempdir().expect("tmp");
    prune(sqlite(&t).await, Backend::Sqlite).await;
    prune(postgres().await, Backend::Postgres).await;
}

async fn node_ids(db: &Db) -> Vec<String> {
    sqlx::query("SELECT id FROM nodes ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .expect("nodes")
        .iter()
        .map(|r| r.try_get("id").expect("id"))
        .collect()
}

async fn prune(db: Db, backend: Backend) {
    db.upsert_workspace("a", &quota(5, 10), true)
        .await
        .expect("ws");
    db.insert_build(&build("p1", "a"), 10, 1000)
        .await
        .expect("insert");
    // n1 stopped, n2 runs a build, n3 is idle.
    for (id, name) in [("n1", "h:/one"), ("n2", "h:/two"), ("n3", "h:/three")] {
        register(&db, id, name).await;
    }
    db.stop_node("n1").await.expect("stop");
    let claim = db
        .claim("n2")
        .await
        .expect("claim")
        .expect("p1")
        .claim()
        .expect("claimed");
    // Within the retention every row stays, the stopped one too.
    assert_eq!(
        db.prune_nodes(3_600_000).await.expect("prune"),
        Vec::<String>::new()
    );
    assert_eq!(node_ids(&db).await, ["n1", "n2", "n3"], "{backend:?}");
    // Past it (5 ms), the rows without a running build go; n2 holds its claim.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(
        db.prune_nodes(5).await.expect("prune"),
        ["n1", "n3"],
        "{backend:?}"
    );
    assert_eq!(node_ids(&db).await, ["n2"], "{backend:?}");
    assert!(
        !db.heartbeat("n3").await.expect("heartbeat"),
        "a pruned row is gone"
    );
    // Once its build ended, n2's row goes too; the build keeps naming the node.
    assert!(
        db.finish("p1", &claim, "succeeded", None, None, None)
            .await
            .expect("finish")
    );
    assert_eq!(
        db.prune_nodes(5).await.expect("prune"),
        ["n2"],
        "{backend:?}"
    );
    assert_eq!(node_ids(&db).await, Vec::<String>::new(), "{backend:?}");
    let row = db.build("a", "p1").await.expect("row").expect("row");
    assert_eq!(row.claimed_by.as_deref(), Some("n2"));
}

#[tokio::test]
async fn context_leases_are_renewed_while_the_build_lives_then_dropped_once() {
    let t = tempfile::tempdir().expect("tmp");
    context_leases(sqlite(&t).await, Backend::Sqlite).await;
    context_leases(postgres().await, Backend::Postgres).await;
}

async fn context_leases(db: Db, backend: Backend) {
    db.upsert_workspace("a", &quota(5, 10), true)
        .await
        .expect("ws");
    let d = format!("sha256:{}", "ab".repeat(32));
    // `c1` is queued; `c2` was never inserted (over quota, say).
    db.add_context_lease("c1", &d).await.expect("lease");
    db.add_context_lease("c2", &d).await.expect("lease");
    db.insert_build(&build("c1", "a"), 10, 1000)
        .await
        .expect("insert");
    // Renewed just now: nothing is due.
    assert_eq!(db.context_leases_due(3_600_000).await.expect("due"), vec![]);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let due = db.context_leases_due(5).await.expect("due");
    assert_eq!(
        due.iter()
            .map(|l| (l.build.as_str(), l.live))
            .collect::<Vec<_>>(),
        [("c1", true), ("c2", false)],
        "{backend:?}"
    );
    // One node wins each move; a second with the same reading changes nothing.
    assert!(db.renew_context_lease(&due[0]).await.expect("renew"));
    assert!(!db.renew_context_lease(&due[0]).await.expect("renew"));
    assert!(db.drop_context_lease(&due[1]).await.expect("drop"));
    assert!(!db.drop_context_lease(&due[1]).await.expect("drop"));
    assert_eq!(db.context_leases_due(3_600_000).await.expect("due"), vec![]);
    // Once the build ended, its lease is due at once, to drop.
    let claim = db
        .claim("n1")
        .await
        .expect("claim")
        .expect("c1")
        .claim()
        .expect("claimed");
    assert_eq!(db.context_leases_due(3_600_000).await.expect("due"), vec![]);
    assert!(
        db.finish("c1", &claim, "failed", None, None, None)
            .await
            .expect("finish")
    );
    let due = db.context_leases_due(3_600_000).await.expect("due");
    assert_eq!(due.len(), 1, "{due:?}");
    assert!(!due[0].live && due[0].digest == d, "{due:?}");
    assert!(db.drop_context_lease(&due[0]).await.expect("drop"));
    assert_eq!(db.context_leases_due(0).await.expect("due"), vec![]);
}

#[tokio::test]
async fn lost_claims_are_requeued_then_failed_and_the_old_claim_writes_nothing() {
    let t = tempfile::tempdir().expect("tmp");
    takeover(sqlite(&t).await, Backend::Sqlite).await;
    takeover(postgres().await, Backend::Postgres).await;
}

async fn takeover(db: Db, backend: Backend) {
    db.upsert_workspace("a", &quota(5, 10), true)
        .await
        .expect("ws");
    db.insert_build(&build("t1", "a"), 10, 1000)
        .await
        .expect("insert");
    register(&db, "n1", "h:/one").await;
    register(&db, "n2", "h:/two").await;
    let first = db.claim("n1").await.expect("claim").expect("t1");
    let old = first.claim().expect("claimed");
    assert_eq!(
        old,
        Claim {
            node: "n1".into(),
            attempt: 1
        }
    );
    let log = |seq| {
        Record::Log(LogLine {
            seq,
            time_ms: 0,
            step: None,
            text: format!("line {seq}"),
        })
    };
    assert!(db.write_batch("t1", &old, &[log(1)]).await.expect("write"));
    // n1 heartbeats: nothing is lost.
    assert!(db.heartbeat("n1").await.expect("heartbeat"));
    assert_eq!(db.take_over(60_000, 2).await.expect("sweep"), vec![]);
    // n1 falls silent (a takeover time of 0 ms: any heartbeat is too old); n2 stays.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let taken = db.take_over(5, 2).await.expect("sweep");
    assert_eq!(
        taken,
        vec![TakenOver {
            build: "t1".into(),
            node: "n1".into(),
            attempt: 1,
            requeued: true,
            node_detail: "h:/one, listening on 127.0.0.1:1".into(),
        }]
    );
    // The old claim can neither write nor end the build, nor does its watcher hold it.
    assert!(!db.write_batch("t1", &old, &[log(2)]).await.expect("write"));
    assert!(!db.watch("t1", &old).await.expect("watch").held);
    let second = db.claim("n2").await.expect("claim").expect("t1 again");
    let new = second.claim().expect("claimed");
    assert_eq!(
        new,
        Claim {
            node: "n2".into(),
            attempt: 2
        }
    );
    assert!(
        !db.finish("t1", &old, "succeeded", None, None, None)
            .await
            .expect("finish"),
        "the lost claim cannot end the build"
    );
    assert!(db.watch("t1", &new).await.expect("watch").held);
    // Its log goes on after the takeover's line.
    assert_eq!(db.last_seq("t1").await.expect("seq"), 2);
    let lines = db.logs("t1", 0, 10).await.expect("logs");
    assert!(
        lines[1].text.contains("node n1 stopped heartbeating"),
        "{lines:?}"
    );
    assert!(!lines[1].text.contains("h:/one"), "{lines:?}");
    assert!(lines[1].text.contains("queued again"), "{lines:?}");
    // n2 is lost too, in the last attempt: failed, naming it.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let taken = db.take_over(0, 2).await.expect("sweep");
    assert_eq!(taken.len(), 1);
    assert!(!taken[0].requeued);
    let row = db.build("a", "t1").await.expect("row").expect("row");
    assert_eq!(row.state, "failed");
    let reason = row.failure.expect("failure");
    assert!(
        reason.contains(SERVER_STOPPED)
            && reason.contains("node n2 stopped heartbeating")
            && reason.contains("attempt 2 of 2"),
        "{reason}"
    );
    assert!(!reason.contains("h:/two"), "{reason}");
    // A stopped node's builds go at once, whatever the takeover time.
    db.insert_build(&build("t2", "a"), 10, 1000)
        .await
        .expect("insert");
    register(&db, "n3", "h:/three").await;
    db.claim("n3").await.expect("claim").expect("t2");
    db.stop_node("n3").await.expect("stop");
    assert!(!db.heartbeat("n3").await.expect("heartbeat"));
    let taken = db.take_over(3_600_000, 2).await.expect("sweep");
    assert_eq!(taken.len(), 1, "{taken:?} on {backend:?}");
    assert!(taken[0].requeued);
}

#[tokio::test]
async fn a_fenced_nodes_claim_goes_back_unless_another_node_took_it() {
    let t = tempfile::tempdir().expect("tmp");
    give_back(sqlite(&t).await).await;
    give_back(postgres().await).await;
}

async fn give_back(db: Db) {
    db.upsert_workspace("a", &quota(5, 10), true)
        .await
        .expect("ws");
    db.insert_build(&build("g1", "a"), 10, 1000)
        .await
        .expect("insert");
    register(&db, "n1", "h:/one").await;
    let first = db.claim("n1").await.expect("claim").expect("g1");
    let old = first.claim().expect("claimed");
    let back = db
        .give_back("g1", &old, 2, "node n1 fenced")
        .await
        .expect("give back")
        .expect("held");
    assert!(back.requeued);
    assert_eq!(
        db.state("g1").await.expect("state").as_deref(),
        Some("queued")
    );
    // Given back once: the old claim gives nothing back again.
    assert_eq!(
        db.give_back("g1", &old, 2, "again")
            .await
            .expect("give back"),
        None
    );
    let second = db.claim("n1").await.expect("claim").expect("g1 again");
    let new = second.claim().expect("claimed");
    assert_eq!(new.attempt, 2);
    // The last attempt given back ends the build failed, with the reason.
    let back = db
        .give_back("g1", &new, 2, "node n1 fenced")
        .await
        .expect("give back")
        .expect("held");
    assert!(!back.requeued);
    let row = db.build("a", "g1").await.expect("row").expect("row");
    assert_eq!(row.state, "failed");
    let reason = row.failure.expect("failure");
    assert!(
        reason.contains("node n1 fenced") && reason.contains("attempt 2 of 2"),
        "{reason}"
    );
}

/// A node cut off from PostgreSQL inside a transaction leaves its session idle in it,
/// holding the advisory lock every claim, sweep and submission takes. The server ends
/// that session after the database timeout, so another node's claim gets through; and a
/// heartbeat stuck behind a lock fails after the timeout instead of waiting, and the
/// next one, on a new connection, is written.
#[tokio::test]
async fn a_session_stuck_in_a_transaction_or_a_lock_blocks_no_node_past_the_timeout() {
    let url = postgres_url().await;
    let bound = std::time::Duration::from_millis(500);
    let cut = Db::connect_bounded(&url, bound).await.expect("open");
    let other = Db::connect_bounded(&url, bound).await.expect("open");
    other
        .upsert_workspace("a", &quota(5, 10), true)
        .await
        .expect("ws");
    other
        .insert_build(&build("s1", "a"), 10, 1000)
        .await
        .expect("insert");
    register(&other, "n2", "h:/two").await;
    let held = cut.write_tx().await.expect("lock");
    let claimed = tokio::time::timeout(std::time::Duration::from_secs(60), other.claim("n2"))
        .await
        .expect("a claim waited on the cut-off node's transaction")
        .expect("claim");
    assert!(claimed.is_some());
    drop(held);

    // A row lock held by a session of an unbounded database handle (a long timeout).
    let locker = Db::connect_bounded(&url, std::time::Duration::from_secs(3600))
        .await
        .expect("open");
    let mut lock = locker.pool.begin().await.expect("begin");
    sqlx::query("SELECT id FROM nodes WHERE id = 'n2' FOR UPDATE")
        .execute(&mut *lock)
        .await
        .expect("lock the node row");
    let beat = tokio::time::timeout(std::time::Duration::from_secs(60), other.heartbeat("n2"))
        .await
        .expect("the heartbeat waited on the lock");
    assert!(matches!(beat, Err(DbError::Timeout { .. })), "{beat:?}");
    lock.rollback().await.expect("unlock");
    assert!(other.heartbeat("n2").await.expect("heartbeat"));
}
