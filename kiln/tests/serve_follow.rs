//! Tenant images that follow their base (issue 40), through the HTTP API of a real `kiln
//! serve` (SQLite, or two nodes on PostgreSQL; a local store, the namespace executor, a 1 s
//! heartbeat) with two
//! workspaces and the busybox fixture. The operator's global base `gbase:latest` moves as
//! `kiln nightly` moves it, by a tag move in the store (`kiln build -t`).
//!
//! - `follow_base` is refused without tags, for a base that is not a global base, and for a
//!   base pinned by digest.
//! - A move rebuilds the following images of both workspaces and moves their tags; an image
//!   built without `follow_base` is left alone.
//! - A tag moved meanwhile (outside the follow) is not touched: the rebuild is `skipped`.
//! - Past the move's budget, the newest follow is `skipped` and waits for the next move.
//! - A rebuild that fails on the new base moves nothing and records why.
//! - `GET /v1/follows` reports each, scoped to its workspace.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    QUICK_LIVENESS, Server, client, env, follows, get, json_of, postgres, psql, rt, submit,
    tag_digest, terminal, wait_for,
};
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// `kiln build -t tag` of `dockerfile` into `store` (the operator's CLI); the image digest.
fn operator_build(dir: &Path, store: &Path, dockerfile: &str, tag: &str) -> String {
    kiln_tests::serve::operator_build(KILN.as_ref(), dir, store, dockerfile, tag)
}

/// `DELETE` of `key`'s tag `name:tag`, which ends its follow.
async fn delete_tag(c: &reqwest::Client, s: &Server, key: &str, name: &str, tag: &str) {
    let r = c
        .delete(s.url(&format!("/v1/images/{name}/tags/{tag}")))
        .bearer_auth(key)
        .send()
        .await
        .expect("DELETE");
    assert_eq!(r.status(), 204);
}

/// Submits `dockerfile` for `key` with `spec`; the response status and body.
async fn submit_df(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    spec: &Value,
    dockerfile: &str,
) -> (u16, Value) {
    let r = submit(c, s, key, spec, None, Some(dockerfile.as_bytes()), None).await;
    let status = r.status().as_u16();
    (status, json_of(r).await)
}

/// Builds `dockerfile` tagged `tag` for `key` (following the base when `follow`) and waits
/// for its success; the image digest.
async fn build(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    dockerfile: &str,
    tag: &str,
    follow: bool,
) -> String {
    let (status, v) = submit_df(
        c,
        s,
        key,
        &json!({"tags": [tag], "follow_base": follow}),
        dockerfile,
    )
    .await;
    assert_eq!(status, 202, "{v:#}");
    let id = v["id"].as_str().expect("id");
    let v = wait_for(c, s, key, id, Duration::from_secs(300), terminal).await;
    assert_eq!(v["state"], "succeeded", "{v:#}");
    v["image"].as_str().expect("image").to_string()
}

fn follow_of<'a>(list: &'a [Value], tag: &str) -> &'a Value {
    list.iter()
        .find(|f| f["tag"] == tag)
        .unwrap_or_else(|| panic!("no follow of {tag}: {list:#?}"))
}

/// Waits until every tag of `tags` in `key`'s follows has a last rebuild for the base head
/// `head` that is not `queued`; the follows then.
async fn settled(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    tags: &[&str],
    head: &str,
) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let list = follows(c, s, key).await;
        let done = tags.iter().all(|t| {
            let l = &follow_of(&list, t)["last"];
            l["base_head"] == head && l["state"] != "queued"
        });
        if done {
            return list;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "the rebuilds for {head} never ended: {list:#?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[test]
fn images_that_follow_a_global_base_are_rebuilt_checked_and_moved_when_it_moves() {
    follow_scenario(&[], 1);
}

/// The same with two nodes sharing a PostgreSQL database and the store: both sweep, and
/// each rebuild is queued once.
#[test]
fn postgres_two_nodes_queue_each_rebuild_once() {
    let db = postgres();
    follow_scenario(&db, 2);
    let url = &db[1];
    // app:1 (v2, v3), svc:latest (v2, v3), moved:1 (v2, v3): six rebuilds, each once.
    let n = psql(
        url,
        "SELECT COUNT(*) FROM builds WHERE spec LIKE '%\"rebuild\"%'",
    );
    assert_eq!(n, "6");
}

/// The scenario of the module doc, on `nodes` servers with the database `db` (empty:
/// SQLite, one node); the API calls go to the first.
fn follow_scenario(db: &[String], nodes: usize) {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, _state, store) = env();
    let base = |v: &str| format!("FROM {bb}\nRUN echo {v} > /base-version\n");
    let head1 = operator_build(&t.path().join("g1"), &store, &base("v1"), "gbase:latest");
    let extra = [
        "--base",
        "gbase",
        "--heartbeat",
        "1s",
        "--takeover-after",
        "3s",
        "--follow-budget",
        "3",
    ];
    let servers: Vec<Server> = (0..nodes)
        .map(|i| Server::start_numbered(KILN.as_ref(), t.path(), i, &store, db, &extra))
        .collect();
    let s = &servers[0];
    let acme = s.key("acme", &[]);
    let beta = s.key("beta", &[]);
    let c = client();
    rt().block_on(async {
        // Refused: no tags, a base that is not global, a base pinned by digest.
        let follow = |tags: Vec<&str>| json!({"tags": tags, "follow_base": true});
        let app = "FROM gbase\nRUN cat /base-version > /seen\n";
        for (spec, df, want) in [
            (follow(vec![]), app.to_string(), "has no tags"),
            (
                follow(vec!["x:1"]),
                format!("FROM {bb}\nRUN true\n"),
                "not a global base",
            ),
            (
                follow(vec!["x:1"]),
                format!("FROM gbase@{head1}\nRUN true\n"),
                "pinned by digest",
            ),
            (
                follow(vec!["x:1"]),
                "FROM scratch\nCOPY --from=gbase /base-version /\n".to_string(),
                "not built FROM an image",
            ),
        ] {
            let (status, v) = submit_df(&c, s, &acme, &spec, &df).await;
            assert_eq!(status, 400, "{df}: {v:#}");
            let m = v["message"].as_str().expect("message");
            assert!(m.contains(want), "{df}: {m}");
        }

        // Follows, in this order: acme app:1, beta svc:latest, acme moved:1, acme late:1.
        // `app:1` fails on v3 of the base.
        let app = "FROM gbase\nRUN cat /base-version > /seen && ! grep -q v3 /seen\n";
        let app1 = build(&c, s, &acme, app, "app:1", true).await;
        let svc1 = build(&c, s, &beta, app, "svc:latest", true).await;
        let moved1 = build(
            &c,
            s,
            &acme,
            "FROM gbase:latest\nRUN echo m > /m\n",
            "moved:1",
            true,
        )
        .await;
        let late1 = build(
            &c,
            s,
            &acme,
            "FROM gbase\nRUN echo l > /l\n",
            "late:1",
            true,
        )
        .await;
        // Not following.
        let still = build(
            &c,
            s,
            &acme,
            "FROM gbase\nRUN echo s > /s\n",
            "static:1",
            false,
        )
        .await;
        let list = follows(&c, s, &acme).await;
        let tags: Vec<&str> = list.iter().map(|f| f["tag"].as_str().unwrap()).collect();
        assert_eq!(tags, ["app:1", "late:1", "moved:1"], "{list:#?}");
        assert_eq!(follow_of(&list, "app:1")["image"], app1.as_str());
        assert_eq!(follow_of(&list, "app:1")["base"], "gbase:latest");
        assert!(follow_of(&list, "app:1")["last"].is_null());
        // Each workspace sees its own follows only.
        let list = follows(&c, s, &beta).await;
        assert_eq!(list.len(), 1, "{list:#?}");
        assert_eq!(list[0]["tag"], "svc:latest");
        assert_eq!(list[0]["image"], svc1.as_str());

        // `moved:1` moves outside its follow (the operator's CLI, as another writer would).
        let other = build(
            &c,
            s,
            &acme,
            "FROM gbase\nRUN echo o > /o\n",
            "other:1",
            false,
        )
        .await;
        let out = Command::new(KILN)
            .env("KILN_STORE", &store)
            .args(["tag", &other, "acme.moved:1"])
            .output()
            .expect("kiln tag");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );

        // The base moves.
        let head2 = operator_build(&t.path().join("g2"), &store, &base("v2"), "gbase:latest");
        let list = settled(&c, s, &acme, &["app:1", "moved:1", "late:1"], &head2).await;
        let app = &follow_of(&list, "app:1")["last"];
        assert_eq!(app["state"], "rebuilt", "{list:#?}");
        let app2 = app["image"].as_str().expect("image").to_string();
        assert_ne!(app2, app1);
        assert_eq!(tag_digest(&c, s, &acme, "app", "1").await, app2);
        assert_eq!(follow_of(&list, "app:1")["image"], app2.as_str());
        assert!(app["new_stored_bytes"].as_u64().is_some(), "{app:#}");
        // The rebuild is a build of the workspace, with its steps and tags.
        let id = app["build"].as_str().expect("build");
        let v = json_of(get(&c, s, &acme, &format!("/v1/builds/{id}")).await).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert_eq!(v["tags"], json!(["app:1"]));
        // Another writer's tag stays where it was put.
        let moved = &follow_of(&list, "moved:1")["last"];
        assert_eq!(moved["state"], "skipped", "{list:#?}");
        assert!(
            moved["reason"]
                .as_str()
                .unwrap()
                .contains("moved meanwhile"),
            "{moved:#}"
        );
        assert_eq!(tag_digest(&c, s, &acme, "moved", "1").await, other);
        assert_ne!(other, moved1);
        // Past the budget of 3 rebuilds (app, svc, moved), the newest follow waits.
        let late = &follow_of(&list, "late:1")["last"];
        assert_eq!(late["state"], "skipped", "{list:#?}");
        assert!(
            late["reason"].as_str().unwrap().contains("budget"),
            "{late:#}"
        );
        assert!(late["build"].is_null());
        assert_eq!(tag_digest(&c, s, &acme, "late", "1").await, late1);
        // The other workspace's follow was rebuilt too; the image that does not follow
        // was not.
        let list = settled(&c, s, &beta, &["svc:latest"], &head2).await;
        assert_eq!(list[0]["last"]["state"], "rebuilt", "{list:#?}");
        assert_ne!(tag_digest(&c, s, &beta, "svc", "latest").await, svc1);
        assert_eq!(tag_digest(&c, s, &acme, "static", "1").await, still);

        // The base moves again: `app:1` fails on it and keeps its image.
        let head3 = operator_build(&t.path().join("g3"), &store, &base("v3"), "gbase:latest");
        let list = settled(&c, s, &acme, &["app:1"], &head3).await;
        let app = &follow_of(&list, "app:1")["last"];
        assert_eq!(app["state"], "failed", "{list:#?}");
        assert!(app["reason"].as_str().unwrap().contains("exit"), "{app:#}");
        assert_eq!(tag_digest(&c, s, &acme, "app", "1").await, app2);
        assert_eq!(follow_of(&list, "app:1")["image"], app2.as_str());

        // Deleting a tag ends its follow.
        delete_tag(&c, s, &acme, "app", "1").await;
        let list = follows(&c, s, &acme).await;
        assert!(list.iter().all(|f| f["tag"] != "app:1"), "{list:#?}");
    });
}

/// The contexts kept for images that follow their base count against the workspace's
/// storage quota, and deleting the following tag gives their room back.
#[test]
fn kept_contexts_count_against_the_storage_quota() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, _state, store) = env();
    operator_build(
        &t.path().join("g1"),
        &store,
        &format!("FROM {bb}\nRUN echo v1 > /base-version\n"),
        "gbase:latest",
    );
    let s = Server::start_numbered(
        KILN.as_ref(),
        t.path(),
        0,
        &store,
        &[],
        &["--base", "gbase"],
    );
    let ws = s.key("q", &[]);
    let c = client();
    rt().block_on(async {
        let st = kiln_store::Store::open(store.to_str().expect("utf-8"))
            .await
            .expect("open the store");
        let a = build(&c, &s, &ws, "FROM gbase\nRUN echo a > /a\n", "a:1", false).await;
        let one = st
            .chunk_bytes([a.parse().expect("digest")])
            .await
            .expect("usage");
        // The quota: that image and 2 MiB more, in GiB.
        let limit = one + (2 << 20);
        s.key(
            "q",
            &[
                "--max-storage-gib",
                &format!("{:.9}", limit as f64 / f64::from(1u32 << 30)),
            ],
        );
        // A following image whose context holds 3 MB the image does not copy.
        let ctx = t.path().join("ctx");
        std::fs::create_dir_all(&ctx).expect("mkdir");
        std::fs::write(
            ctx.join("Dockerfile"),
            "FROM gbase\nCOPY small.txt /small\n",
        )
        .expect("write");
        std::fs::write(ctx.join("small.txt"), "small\n").expect("write");
        // The context counts at its uploaded size (a plain tarball here), whatever it holds.
        std::fs::write(ctx.join("big.bin"), vec![7u8; 3_000_000]).expect("write");
        let tarball = kiln_tests::serve::tar_dir(&ctx);
        let r = submit(
            &c,
            &s,
            &ws,
            &json!({"tags": ["f:1"], "follow_base": true}),
            Some(&tarball),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &ws, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        // Now its kept context counts: a small new image does not fit.
        let small = "FROM gbase\nRUN echo c > /c\n";
        let spec = json!({"tags": ["c:1"]});
        let (status, v) = submit_df(&c, &s, &ws, &spec, small).await;
        assert_eq!(status, 202, "{v:#}");
        let v = wait_for(
            &c,
            &s,
            &ws,
            v["id"].as_str().unwrap(),
            Duration::from_secs(300),
            terminal,
        )
        .await;
        assert_eq!(v["state"], "failed", "{v:#}");
        let reason = v["failure"]["reason"].as_str().expect("reason");
        assert!(reason.contains("storage quota exceeded"), "{reason}");
        assert!(reason.contains("build contexts kept"), "{reason}");
        // Deleting the following tag ends its follow and releases its context's room.
        delete_tag(&c, &s, &ws, "f", "1").await;
        assert!(follows(&c, &s, &ws).await.is_empty());
        build(&c, &s, &ws, small, "c:1", false).await;
    });
}

/// A rebuild survives a kill -9 of its server: the restarted server takes it over like any
/// build, and it ends rebuilt.
#[test]
fn a_rebuild_is_taken_over_after_a_kill_9() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let base = |v: &str| format!("FROM {bb}\nRUN echo {v} > /base-version\n");
    operator_build(&t.path().join("g1"), &store, &base("v1"), "gbase:latest");
    let mut args = vec!["--base", "gbase"];
    args.extend(QUICK_LIVENESS);
    let s = Server::start(KILN.as_ref(), &state, &store, &args);
    let key = s.key("acme", &[]);
    let c = client();
    // Long enough a step to be caught running.
    let app = "FROM gbase\nRUN sleep 4 && cat /base-version > /seen\n";
    let rebuild = rt().block_on(async {
        build(&c, &s, &key, app, "app:1", true).await;
        let head2 = operator_build(&t.path().join("g2"), &store, &base("v2"), "gbase:latest");
        // Wait for the rebuild to run.
        let t0 = Instant::now();
        loop {
            let list = follows(&c, &s, &key).await;
            let last = &follow_of(&list, "app:1")["last"];
            if last["base_head"] == head2.as_str()
                && let Some(id) = last["build"].as_str()
            {
                let v = json_of(get(&c, &s, &key, &format!("/v1/builds/{id}")).await).await;
                if v["state"] == "running" {
                    break (id.to_string(), head2);
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "{list:#?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let (id, head2) = rebuild;
    s.signal(rustix::process::Signal::KILL);
    let mut s = s;
    s.wait(Duration::from_secs(30));
    drop(s);
    let s = Server::start(KILN.as_ref(), &state, &store, &args);
    rt().block_on(async {
        let list = settled(&c, &s, &key, &["app:1"], &head2).await;
        let last = &follow_of(&list, "app:1")["last"];
        assert_eq!(last["state"], "rebuilt", "{list:#?}");
        assert_eq!(last["build"], id.as_str(), "the same build, taken over");
        let logs = get(&c, &s, &key, &format!("/v1/builds/{id}/logs")).await;
        let text = logs.text().await.expect("logs");
        assert!(text.contains("queued again"), "{text}");
        assert_eq!(
            tag_digest(&c, &s, &key, "app", "1").await,
            last["image"].as_str().expect("image")
        );
    });
}

/// A base the operator stops allowing (`--base` dropped) queues no rebuild when it moves: no
/// tenant build may name it. Allowed again, its follows are rebuilt.
#[test]
fn a_base_no_longer_allowed_queues_no_rebuild_until_it_is_again() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let base = |v: &str| format!("FROM {bb}\nRUN echo {v} > /base-version\n");
    operator_build(&t.path().join("g1"), &store, &base("v1"), "gbase:latest");
    let mut allowed = vec!["--base", "gbase"];
    allowed.extend(QUICK_LIVENESS);
    let s = Server::start(KILN.as_ref(), &state, &store, &allowed);
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(build(
        &c,
        &s,
        &key,
        "FROM gbase\nRUN cat /base-version > /seen\n",
        "app:1",
        true,
    ));
    drop(s);
    let s = Server::start(KILN.as_ref(), &state, &store, &QUICK_LIVENESS);
    let head2 = operator_build(&t.path().join("g2"), &store, &base("v2"), "gbase:latest");
    rt().block_on(async {
        // Several sweeps (1 s apart) go by.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let list = follows(&c, &s, &key).await;
        assert!(follow_of(&list, "app:1")["last"].is_null(), "{list:#?}");
    });
    drop(s);
    let s = Server::start(KILN.as_ref(), &state, &store, &allowed);
    rt().block_on(async {
        let list = settled(&c, &s, &key, &["app:1"], &head2).await;
        assert_eq!(
            follow_of(&list, "app:1")["last"]["state"],
            "rebuilt",
            "{list:#?}"
        );
    });
}
