//! `kiln serve` on several nodes (as root): three server processes on 127.0.0.1, each with
//! its own state directory and host cache, on one PostgreSQL database and one S3 store, run
//! each build once, share the build cache, take over a killed node's build, and build a
//! context uploaded to another node through the store. Moved out of `serve_api.rs`, whose
//! harness (`kiln_tests::serve`) they share.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    QUICK_LIVENESS, Server, claimer, client, context_dir, env, fetch_recipe, get, hex_sha256,
    json_of, postgres, psql, rt, submit, submit_recipe, tagged_spec, tar_dir, terminal, until,
    wait_for,
};
use serde_json::json;

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// Three `kiln serve` nodes, each with its own state directory and host cache, share one
/// PostgreSQL database and one S3 store (issue 19). Each build's one `RUN` step fetches its
/// own path from a local server, which counts the step's runs; `/hold/` paths are left
/// unanswered, holding the build inside its step, so the kill -9 needs no timing.
///
/// - A build done by node 0 alone is a full cache hit on the others, with the same image.
/// - 30 builds (the count) submitted round robin across the three: each succeeds and
///   its step ran once, in attempt 1.
/// - kill -9 of the node holding a build: after the takeover time (3 s here) another node
///   runs it again, as attempt 2, and it succeeds and moves its tag.
/// - A build whose two attempts (`--max-attempts 2`) are both killed ends failed, naming the
///   node of the last one, and moves no tag.
/// - `kiln store verify --deep` is clean afterwards.
///
/// Before nodes, heartbeats and takeover: a killed node's build stayed `running` until that
/// node's host restarted, and a starting node failed every running build of its host, those
/// of the other two nodes on this host too.
#[test]
fn three_nodes_share_one_queue_cache_and_store_and_take_over_a_killed_nodes_build() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, _, _) = env();
    let db = postgres();
    let url = db[1].clone();
    let store = PathBuf::from(kiln_tests::stores::fresh_url(
        kiln_tests::stores::Kind::S3,
        t.path(),
        "nodes",
    ));
    let web = kiln_tests::http::LocalServer::holding("/hold/", 1);
    let args = [&["--workers", "2"][..], &QUICK_LIVENESS].concat();
    let start = |i: usize| Server::start_numbered(KILN.as_ref(), t.path(), i, &store, &db, &args);
    let recipe = |path: &str| fetch_recipe(&bb, "127.0.0.1", web.port, path);
    let spec = tagged_spec;
    let c = client();
    let submit_to = |s: &Server, key: &str, tag: &str, path: &str| {
        rt().block_on(submit_recipe(&c, s, key, &spec(tag), &recipe(path)))
    };

    // Node 0 alone builds `c`; then it stops and nodes 1 and 2 build `c` again from the
    // shared cache.
    let mut first = start(0);
    let key = first.key("acme", &["--max-concurrent", "6", "--max-queued", "100"]);
    let id = submit_to(&first, &key, "c:1", "/run/c");
    let done = rt().block_on(wait_for(
        &c,
        &first,
        &key,
        &id,
        Duration::from_secs(300),
        terminal,
    ));
    assert_eq!(done["state"], "succeeded", "{done:#}");
    first.signal(rustix::process::Signal::TERM);
    assert!(first.wait(Duration::from_secs(60)).success());
    drop(first);
    let mut nodes = vec![start(1), start(2)];
    let id = submit_to(&nodes[0], &key, "c:1", "/run/c");
    let again = rt().block_on(wait_for(
        &c,
        &nodes[1],
        &key,
        &id,
        Duration::from_secs(300),
        terminal,
    ));
    assert_eq!(again["state"], "succeeded", "{again:#}");
    assert_eq!(again["image"], done["image"], "same inputs, same image");
    let steps = again["steps"].as_array().expect("steps");
    assert!(
        !steps.is_empty() && steps.iter().all(|s| s["cached"] == true),
        "a full cache hit on another node: {again:#}"
    );
    assert_eq!(web.hits("/run/c"), 1, "the step ran once, on node 0");
    nodes.insert(0, start(0));

    // 30 builds across the three nodes: each ran its step once, in its first attempt.
    const BUILDS: usize = 30;
    let ids: Vec<String> = (0..BUILDS)
        .map(|i| submit_to(&nodes[i % 3], &key, &format!("b:{i}"), &format!("/run/{i}")))
        .collect();
    rt().block_on(async {
        for (i, id) in ids.iter().enumerate() {
            let v = wait_for(
                &c,
                &nodes[i % 3],
                &key,
                id,
                Duration::from_secs(300),
                terminal,
            )
            .await;
            assert_eq!(v["state"], "succeeded", "{v:#}");
        }
    });
    for i in 0..BUILDS {
        assert_eq!(
            web.hits(&format!("/run/{i}")),
            1,
            "build {i}'s step ran once"
        );
    }
    let list = ids
        .iter()
        .map(|i| format!("'{i}'"))
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(
        psql(
            &url,
            &format!("SELECT COUNT(*) FROM builds WHERE id IN ({list}) AND attempt = 1")
        ),
        BUILDS.to_string()
    );
    eprintln!(
        "builds per node: {}",
        psql(
            &url,
            &format!(
                "SELECT string_agg(n || '=' || c, ' ') FROM (SELECT claimed_by AS n, COUNT(*) \
                 AS c FROM builds WHERE id IN ({list}) GROUP BY claimed_by) x"
            )
        )
    );

    // kill -9 of the node holding `h`: another node takes it over and it succeeds.
    let h = submit_to(&nodes[0], &key, "h:1", "/hold/h");
    until(
        "the first attempt reached its step",
        Duration::from_secs(120),
        || web.hits("/hold/h") == 1,
    );
    let (k, attempt) = claimer(&url, &nodes, &h).expect("h is claimed");
    assert_eq!(attempt, 1);
    let killed_id = psql(
        &url,
        &format!("SELECT claimed_by FROM builds WHERE id = '{h}'"),
    );
    nodes[k].signal(rustix::process::Signal::KILL);
    nodes[k].wait(Duration::from_secs(30));
    let t_kill = Instant::now();
    let dead = nodes.remove(k);
    until("attempt 2 claimed", Duration::from_secs(60), || {
        claimer(&url, &nodes, &h).is_some_and(|(_, a)| a == 2)
    });
    eprintln!(
        "takeover after kill -9: {:?} (takeover time 3 s, heartbeat 1 s)",
        t_kill.elapsed()
    );
    let v = rt().block_on(wait_for(
        &c,
        &nodes[0],
        &key,
        &h,
        Duration::from_secs(300),
        terminal,
    ));
    assert_eq!(v["state"], "succeeded", "{v:#}");
    assert_eq!(web.hits("/hold/h"), 2, "ran again after the takeover");
    let logs = rt().block_on(async {
        get(&c, &nodes[0], &key, &format!("/v1/builds/{h}/logs"))
            .await
            .text()
            .await
            .expect("logs")
    });
    assert!(
        logs.contains(&format!("node {killed_id} stopped heartbeating"))
            && !logs.contains("listening on")
            && logs.contains("attempt 1 of 2 lost, build queued again"),
        "{logs}"
    );
    let tag = rt().block_on(get(&c, &nodes[0], &key, "/v1/images/h/tags/1"));
    assert_eq!(
        tag.headers()["etag"].to_str().expect("etag"),
        format!("\"{}\"", v["image"].as_str().expect("image"))
    );
    drop(dead);

    // Both attempts of `f` killed: it fails naming the node of the second.
    web.hold_more("/hold/", 2);
    let f = submit_to(&nodes[0], &key, "f:1", "/hold/f");
    until(
        "attempt 1 of f reached its step",
        Duration::from_secs(120),
        || web.hits("/hold/f") == 1,
    );
    let (k1, _) = claimer(&url, &nodes, &f).expect("f is claimed");
    nodes[k1].signal(rustix::process::Signal::KILL);
    nodes[k1].wait(Duration::from_secs(30));
    drop(nodes.remove(k1));
    until(
        "attempt 2 of f reached its step",
        Duration::from_secs(120),
        || web.hits("/hold/f") == 2,
    );
    let (k2, attempt) = claimer(&url, &nodes, &f).expect("f is claimed again");
    assert_eq!(attempt, 2);
    let last_id = psql(
        &url,
        &format!("SELECT claimed_by FROM builds WHERE id = '{f}'"),
    );
    let last_state = nodes[k2].state.clone();
    nodes[k2].signal(rustix::process::Signal::KILL);
    nodes[k2].wait(Duration::from_secs(30));
    drop(nodes.remove(k2));
    // No node is left: the restart of the last one's state directory ends `f`.
    let restarted = Server::start_node(
        KILN.as_ref(),
        &last_state,
        &store,
        &db,
        Some(&last_state.with_file_name("cache")),
        &args,
    );
    let v = rt().block_on(wait_for(
        &c,
        &restarted,
        &key,
        &f,
        Duration::from_secs(60),
        terminal,
    ));
    assert_eq!(v["state"], "failed", "{v:#}");
    let reason = v["failure"]["reason"].as_str().expect("reason");
    assert!(
        reason.starts_with(&format!(
            "server stopped during the build: node {last_id} stopped"
        )) && reason.ends_with("attempt 2 of 2"),
        "{reason}"
    );
    assert_eq!(web.hits("/hold/f"), 2);
    let tag = rt().block_on(get(&c, &restarted, &key, "/v1/images/f/tags/1"));
    assert_eq!(tag.status(), 404, "no tag moved");
    drop(restarted);

    // Every tag names data the store holds.
    kiln_tests::serve::verify_deep(KILN.as_ref(), t.path(), &store);
}

/// The store's lease ids and whether a dry-run GC with no grace period would collect `key`.
fn leases_and_collectable(store: &Path, key: &str) -> (Vec<String>, bool) {
    rt().block_on(async {
        let s = kiln_store::Store::open(store.to_str().expect("utf-8"))
            .await
            .expect("open the store");
        let leases = s
            .list_leases()
            .await
            .expect("leases")
            .into_iter()
            .map(|l| l.id)
            .collect();
        let gc = kiln_store::gc::GcOptions {
            grace: Duration::ZERO,
            dry_run: true,
            ..Default::default()
        };
        let r = s.gc(&gc).await.expect("gc --dry-run");
        (leases, r.collected.iter().any(|c| c.key == key))
    })
}

/// Issue 19: build contexts uploaded to one node are built by another, through the S3
/// store the nodes share (`--workers 1` each; node 0's one worker is held by a build that
/// never ends, so the others claim what node 0 receives).
///
/// - A context sent with a submission to node 0 is built by node 1; while its build runs
///   (held in its `RUN`, after the `COPY` from the context), the store holds the context
///   blob under the lease `context-<build id>`, and GC (dry run, no grace period) would
///   not collect it.
/// - kill -9 of node 1: node 2, which never saw the context, runs attempt 2 from the store's
///   copy, and the build succeeds.
/// - A context uploaded to node 0 (`PUT /v1/blobs/...`) is present for node 2 (`HEAD`),
///   and a JSON submission to node 2 naming it builds.
/// - Once the builds ended, the sweep deletes their leases: GC would collect the first
///   context.
///
/// Before: node 1 failed the first build at once ("context blob ... is not on node ...").
#[test]
fn a_context_uploaded_to_one_node_is_built_by_another_through_the_store() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, _, _) = env();
    let db = postgres();
    let url = db[1].clone();
    let store = PathBuf::from(kiln_tests::stores::fresh_url(
        kiln_tests::stores::Kind::S3,
        t.path(),
        "contexts",
    ));
    // Held: node 0's build, and the context build's first attempt.
    let web = kiln_tests::http::LocalServer::holding("/hold/", 2);
    let args = [&["--workers", "1"][..], &QUICK_LIVENESS].concat();
    let start = |i: usize| Server::start_numbered(KILN.as_ref(), t.path(), i, &store, &db, &args);
    let c = client();
    let spec = tagged_spec;
    let node_of = |id: &str| {
        psql(
            &url,
            &format!(
                "SELECT n.listen || ' ' || b.attempt FROM builds b JOIN nodes n \
                 ON n.id = b.claimed_by WHERE b.id = '{id}'"
            ),
        )
    };

    // Node 0's one worker is held.
    let a = start(0);
    let key = a.key("acme", &["--max-concurrent", "6", "--max-queued", "100"]);
    let recipe = format!(
        "FROM {bb}\nRUN --network=host wget -q -O /fetched http://127.0.0.1:{}/hold/a\n",
        web.port
    );
    rt().block_on(submit_recipe(&c, &a, &key, &spec("a:1"), &recipe));
    until(
        "node 0's build reached its step",
        Duration::from_secs(120),
        || web.hits("/hold/a") == 1,
    );

    // A context sent to node 0, built by node 1.
    let mut b = start(1);
    let ctx = context_dir(
        &t.path().join("one"),
        &format!(
            "FROM {bb}\nCOPY hello.txt /hello.txt\n\
             RUN --network=host wget -q -O /fetched http://127.0.0.1:{}/hold/x\n",
            web.port
        ),
    );
    let tarball = tar_dir(&ctx);
    let blob_key = format!("blobs/sha256/{}", hex_sha256(&tarball));
    let x = rt().block_on(async {
        let r = submit(&c, &a, &key, &spec("x:1"), Some(&tarball), None, None).await;
        assert_eq!(r.status(), 202);
        json_of(r).await["id"].as_str().expect("id").to_string()
    });
    until(
        "the build reached its step or ended",
        Duration::from_secs(120),
        || {
            web.hits("/hold/x") == 1
                || terminal(&rt().block_on(async {
                    json_of(get(&c, &a, &key, &format!("/v1/builds/{x}")).await).await
                }))
        },
    );
    let view =
        rt().block_on(async { json_of(get(&c, &a, &key, &format!("/v1/builds/{x}")).await).await });
    assert_eq!(web.hits("/hold/x"), 1, "node 1 ran the step: {view:#}");
    assert_eq!(
        node_of(&x),
        format!("{} 1", b.base.trim_start_matches("http://"))
    );
    let (leases, collectable) = leases_and_collectable(&store, &blob_key);
    assert!(leases.contains(&format!("context-{x}")), "{leases:?}");
    assert!(!collectable, "the running build's context is leased");

    // Node 1 is lost; node 2 runs attempt 2 from the store's copy.
    b.signal(rustix::process::Signal::KILL);
    b.wait(Duration::from_secs(30));
    drop(b);
    let n2 = start(2);
    let v = rt().block_on(wait_for(
        &c,
        &n2,
        &key,
        &x,
        Duration::from_secs(300),
        terminal,
    ));
    assert_eq!(v["state"], "succeeded", "{v:#}");
    assert_eq!(web.hits("/hold/x"), 2, "attempt 2 ran the step");
    assert_eq!(
        node_of(&x),
        format!("{} 2", n2.base.trim_start_matches("http://"))
    );

    // Uploaded to node 0, submitted to and built by node 2.
    let ctx = context_dir(
        &t.path().join("two"),
        &format!("FROM {bb}\nCOPY hello.txt /again.txt\n"),
    );
    let tarball = tar_dir(&ctx);
    let digest = format!("sha256:{}", hex_sha256(&tarball));
    let y = rt().block_on(async {
        let r = c
            .put(a.url(&format!("/v1/blobs/{digest}")))
            .bearer_auth(&key)
            .body(tarball.clone())
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 201);
        let r = c
            .head(n2.url(&format!("/v1/blobs/{digest}")))
            .bearer_auth(&key)
            .send()
            .await
            .expect("HEAD");
        assert_eq!(r.status(), 200, "node 2 finds node 0's upload");
        let mut s = spec("y:1");
        s["context"] = json!(digest);
        let r = c
            .post(n2.url("/v1/builds"))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(s.to_string())
            .send()
            .await
            .expect("POST");
        assert_eq!(r.status(), 202);
        json_of(r).await["id"].as_str().expect("id").to_string()
    });
    let v = rt().block_on(wait_for(
        &c,
        &n2,
        &key,
        &y,
        Duration::from_secs(300),
        terminal,
    ));
    assert_eq!(v["state"], "succeeded", "{v:#}");

    // The ended builds' leases go at the next sweeps.
    until(
        "the context leases are deleted",
        Duration::from_secs(60),
        || psql(&url, "SELECT COUNT(*) FROM context_leases") == "0",
    );
    let (leases, collectable) = leases_and_collectable(&store, &blob_key);
    assert!(
        !leases.iter().any(|l| l.starts_with("context-")),
        "{leases:?}"
    );
    assert!(collectable, "no longer leased once its build ended");
    drop(n2);
    drop(a);
}
