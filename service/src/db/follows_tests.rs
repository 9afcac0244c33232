//! Attacks on the follows' side of the database (issue 40), on SQLite and PostgreSQL.

use super::*;
use crate::db::tests::postgres;

const IMG: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const OLD_OCI: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";
const HEAD: &str = "sha256:3333333333333333333333333333333333333333333333333333333333333333";
const NEW_OCI: &str = "sha256:4444444444444444444444444444444444444444444444444444444444444444";

fn new_build(id: &str, ws: &str) -> NewBuild {
    NewBuild {
        id: id.into(),
        workspace: ws.into(),
        spec: "{}".into(),
        recipe: b"FROM kiln-default\n".to_vec(),
        context: None,
        idempotency: None,
        credentials: None,
    }
}

fn quota(max_queued: u32) -> Quota {
    Quota {
        max_queued,
        ..Quota::default()
    }
}

/// Workspace `ws` (queue of `max_queued`) whose tags `tags` follow `kiln-default:latest`
/// from its succeeded build `build`.
async fn following(db: &Db, ws: &str, max_queued: u32, build: &str, tags: &[&str]) {
    db.upsert_workspace(ws, &quota(max_queued), true)
        .await
        .expect("ws");
    db.insert_build(&new_build(build, ws), 100, 1000)
        .await
        .expect("insert");
    let claim = db
        .claim("n1")
        .await
        .expect("claim")
        .expect("claimed")
        .claim()
        .expect("claim");
    assert!(
        db.finish(build, &claim, "succeeded", Some(IMG), None, None)
            .await
            .expect("finish")
    );
    let row = FollowRow {
        workspace: ws.into(),
        tag: String::new(),
        build_id: build.into(),
        image: IMG.into(),
        base_tag: "kiln-default:latest".into(),
        base_oci: OLD_OCI.into(),
        configs: None,
        created_ms: now_ms(),
        tried_head: None,
        rebuild_build: None,
        last: None,
    };
    let tags: Vec<String> = tags.iter().map(|t| format!("{ws}.{t}")).collect();
    db.upsert_follows(&row, &tags).await.expect("follow");
}

fn the_move(budget: u32) -> BaseMove<'static> {
    BaseMove {
        tag: "kiln-default:latest",
        head: HEAD,
        oci: NEW_OCI,
        budget,
    }
}

/// A plan that queues each group it has room for as `r-<n>`.
fn queue_all(n: &std::cell::Cell<u32>) -> impl FnMut(&DueGroup, Room) -> Planned + '_ {
    move |g, room| match room {
        Room::Yes => {
            n.set(n.get() + 1);
            Planned::Queue(
                new_build(&format!("r-{}", n.get()), &g.build.workspace),
                "{\"state\":\"queued\"}".into(),
            )
        }
        Room::PastBudget => Planned::Skip("{\"state\":\"skipped\"}".into()),
        Room::QueueFull | Room::TagBusy => Planned::Wait("{\"state\":\"waiting\"}".into()),
    }
}

async fn state(db: &Db, id: &str) -> Option<String> {
    db.state(id).await.expect("state")
}

/// A rebuild is a build of its workspace, within its quota: one whose queue is full gets no
/// rebuild queued past `max_queued` (it waits, still due, for a later sweep), and other
/// workspaces' rebuilds are not held up by it.
#[tokio::test]
async fn rebuilds_stay_within_the_workspaces_queue() {
    let t = tempfile::tempdir().expect("tmp");
    rebuilds_within_quota(Db::open(&t.path().join("kiln.db")).await.expect("open")).await;
    rebuilds_within_quota(postgres().await).await;
}

async fn rebuilds_within_quota(db: Db) {
    // `full`: a queue of 2, holding one queued build of its own, and two followed builds.
    following(&db, "full", 2, "f1", &["app:1"]).await;
    following(&db, "full", 2, "f2", &["app:2"]).await;
    following(&db, "other", 20, "o1", &["app:1"]).await;
    db.insert_build(&new_build("mine", "full"), 2, 1000)
        .await
        .expect("insert");
    let n = std::cell::Cell::new(0);
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    // One rebuild of `full` (its queue then holds 2) and one of `other`.
    assert_eq!(queued.len(), 2, "{queued:?}");
    let active = |ws: &'static str| {
        let db = db.clone();
        async move {
            let mut n = 0;
            for f in db.follows(ws).await.expect("follows") {
                if let Some(b) = &f.rebuild_build
                    && matches!(state(&db, b).await.as_deref(), Some("queued" | "running"))
                {
                    n += 1;
                }
            }
            n
        }
    };
    assert_eq!(active("full").await, 1);
    assert_eq!(active("other").await, 1);
    // The one left waits, due still: once `full`'s own build ended, a sweep queues it.
    let rows = db.follows("full").await.expect("follows");
    let waiting: Vec<_> = rows.iter().filter(|f| f.rebuild_build.is_none()).collect();
    assert_eq!(waiting.len(), 1, "{rows:?}");
    assert_eq!(waiting[0].tried_head, None, "{rows:?}");
    assert_eq!(
        db.request_cancel("full", "mine").await.expect("cancel"),
        Some("queued".into())
    );
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued.len(), 1, "{queued:?}");
    assert_eq!(active("full").await, 2);
}

/// Ending a follow (the tenant deleted or moved the tag, or a build without `follow_base`
/// moved it) stops the rebuild queued for it, which would otherwise move the tag (when it
/// still names the image the rebuild started from, e.g. a cached build of the same recipe
/// without `follow_base`) and make it follow again; the group's other tags are due again.
#[tokio::test]
async fn ending_a_follow_stops_its_rebuild() {
    let t = tempfile::tempdir().expect("tmp");
    ending_a_follow(Db::open(&t.path().join("kiln.db")).await.expect("open")).await;
    ending_a_follow(postgres().await).await;
}

async fn ending_a_follow(db: Db) {
    following(&db, "a", 20, "b1", &["app:1", "app:2"]).await;
    let n = std::cell::Cell::new(0);
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued.len(), 1, "{queued:?}");
    let r1 = queued[0].0.clone();
    assert_eq!(state(&db, &r1).await.as_deref(), Some("queued"));
    assert_eq!(
        db.delete_follows("a", &["a.app:1".into()])
            .await
            .expect("end"),
        1
    );
    assert_eq!(state(&db, &r1).await.as_deref(), Some("cancelled"));
    // The tag still following gets a rebuild of its own, for this same move.
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued.len(), 1, "{queued:?}");
    let rows = db.follows("a").await.expect("follows");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].tag, "a.app:2");
    assert_eq!(rows[0].rebuild_build.as_deref(), Some(queued[0].0.as_str()));

    // A running rebuild is asked to stop.
    let claim = loop {
        let b = db.claim("n1").await.expect("claim").expect("queued");
        if b.id == queued[0].0 {
            break b.claim().expect("claim");
        }
    };
    db.delete_follows("a", &["a.app:2".into()])
        .await
        .expect("end");
    assert!(db.watch(&queued[0].0, &claim).await.expect("watch").cancel);

    // And a rebuild that ended after its follow did makes no follow again.
    let row = FollowRow {
        workspace: "a".into(),
        tag: String::new(),
        build_id: queued[0].0.clone(),
        image: NEW_OCI.into(),
        base_tag: "kiln-default:latest".into(),
        base_oci: NEW_OCI.into(),
        configs: None,
        created_ms: now_ms(),
        tried_head: None,
        rebuild_build: None,
        last: None,
    };
    db.rebuilt_follows(&row, &["a.app:2".into()])
        .await
        .expect("rebuilt");
    assert_eq!(db.follows("a").await.expect("follows"), vec![]);
}

fn tenant_build(id: &str, ws: &str, tags: &[&str]) -> NewBuild {
    let tags: Vec<String> = tags.iter().map(|t| format!("{ws}.{t}")).collect();
    NewBuild {
        spec: serde_json::json!({ "store_tags": tags }).to_string(),
        ..new_build(id, ws)
    }
}

/// A tenant who builds a following tag anew keeps their image: a rebuild, which would move
/// the tag first and so fail the tenant's build (its tags move only from what they named
/// when it started), waits while a build of the workspace that moves one of its tags is
/// queued or running, and a rebuild already queued or running when the tenant submits one
/// gives way (it is stopped, and due again).
#[tokio::test]
async fn a_tenants_own_build_of_the_tag_goes_first() {
    let t = tempfile::tempdir().expect("tmp");
    tenant_first(Db::open(&t.path().join("kiln.db")).await.expect("open")).await;
    tenant_first(postgres().await).await;
}

async fn tenant_first(db: Db) {
    following(&db, "a", 20, "b1", &["app:1"]).await;
    following(&db, "a", 20, "b2", &["other:1"]).await;
    // The tenant's build of app:1 is queued when the base moves: only other:1 is rebuilt.
    db.insert_build(&tenant_build("t1", "a", &["app:1"]), 20, 1000)
        .await
        .expect("insert");
    let n = std::cell::Cell::new(0);
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued.len(), 1, "{queued:?}");
    let rows = db.follows("a").await.expect("follows");
    let app = rows.iter().find(|f| f.tag == "a.app:1").expect("app:1");
    assert_eq!(app.rebuild_build, None, "{rows:?}");
    assert_eq!(app.tried_head, None, "{rows:?}");
    // Once it ended (failed, say: the follow stays), app:1 is rebuilt.
    db.request_cancel("a", "t1").await.expect("cancel");
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued.len(), 1, "{queued:?}");
    let r = queued[0].0.clone();
    // The tenant submits a build of app:1 while that rebuild waits: the rebuild gives way.
    db.insert_build(&tenant_build("t2", "a", &["app:1"]), 20, 1000)
        .await
        .expect("insert");
    assert_eq!(
        db.preempt_rebuilds("a", &["a.app:1".into()])
            .await
            .expect("preempt"),
        1
    );
    assert_eq!(state(&db, &r).await.as_deref(), Some("cancelled"));
    let queued = db
        .queue_rebuilds(&the_move(10), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued, vec![]);
    // A build of other tags preempts nothing.
    assert_eq!(
        db.preempt_rebuilds("a", &["a.third:1".into()])
            .await
            .expect("preempt"),
        0
    );
}

/// Past a move's budget the rest wait for the next move: there, they go first. Ordered by
/// when each began to follow only, the oldest follows took the budget at every move, and
/// those past it were never rebuilt.
#[tokio::test]
async fn those_past_the_budget_go_first_at_the_next_move() {
    let t = tempfile::tempdir().expect("tmp");
    past_the_budget(Db::open(&t.path().join("kiln.db")).await.expect("open")).await;
    past_the_budget(postgres().await).await;
}

async fn past_the_budget(db: Db) {
    following(&db, "old", 20, "b1", &["app:1"]).await;
    following(&db, "new", 20, "b2", &["app:1"]).await;
    let n = std::cell::Cell::new(0);
    let queued = db
        .queue_rebuilds(&the_move(1), queue_all(&n))
        .await
        .expect("queue");
    assert_eq!(queued.len(), 1);
    let b = db.build("old", &queued[0].0).await.expect("build");
    assert!(b.is_some(), "the oldest follow goes first: {queued:?}");
    // The rebuild of `old` ends (failed, say); the base moves again.
    db.request_cancel("old", &queued[0].0)
        .await
        .expect("cancel");
    let head2 = "sha256:5555555555555555555555555555555555555555555555555555555555555555";
    let m = BaseMove {
        head: head2,
        ..the_move(1)
    };
    let queued = db.queue_rebuilds(&m, queue_all(&n)).await.expect("queue");
    assert_eq!(queued.len(), 1);
    let b = db.build("new", &queued[0].0).await.expect("build");
    assert!(
        b.is_some(),
        "the follow past the last budget goes first: {queued:?}"
    );
}
