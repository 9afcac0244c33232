//! Attacks on tenant images that follow their base (issue 40), through the HTTP API of a
//! real `kiln serve` (SQLite, a local store, the namespace executor, a 1 s heartbeat) with
//! the busybox fixture. One move of the global base `gbase:latest`, while:
//!
//! - the tenant's own build of a following tag (without `follow_base`) is running: it
//!   succeeds and keeps its image (a rebuild that moved the tag first would fail it, its
//!   tags moving only from what they named when it started), and the tag follows nothing
//!   after it;
//! - the tenant ends a follow (moving the tag to the image it already names) while its
//!   rebuild runs: the rebuild stops, the tag keeps its image, and the follow stays ended
//!   (the rebuild, moving the tag from the image it started from, used to move it anyway
//!   and make it follow again);
//! - the workspace's quota was lowered since the original build: the rebuild runs within
//!   the quota of the day, not with the limits its original was given.

use std::path::Path;
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, env, follows, get, json_of, rt, submit, tag_digest, terminal, wait_for,
};
use serde_json::json;

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

fn operator_build(dir: &Path, store: &Path, dockerfile: &str, tag: &str) -> String {
    kiln_tests::serve::operator_build(KILN.as_ref(), dir, store, dockerfile, tag)
}

/// Submits `dockerfile` tagged `tag` for `key` (following the base when `follow`); its id.
async fn start(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    dockerfile: &str,
    tag: &str,
    follow: bool,
) -> String {
    let spec = json!({"tags": [tag], "follow_base": follow});
    let r = submit(c, s, key, &spec, None, Some(dockerfile.as_bytes()), None).await;
    assert_eq!(r.status(), 202);
    json_of(r).await["id"].as_str().expect("id").to_string()
}

async fn succeeded(c: &reqwest::Client, s: &Server, key: &str, id: &str) -> String {
    let v = wait_for(c, s, key, id, Duration::from_secs(300), terminal).await;
    assert_eq!(v["state"], "succeeded", "{v:#}");
    v["image"].as_str().expect("image").to_string()
}

/// Waits until `tag` of `key` has a rebuild for `head` queued; its build id.
async fn rebuild_of(c: &reqwest::Client, s: &Server, key: &str, tag: &str, head: &str) -> String {
    let t0 = Instant::now();
    loop {
        let list = follows(c, s, key).await;
        if let Some(f) = list.iter().find(|f| f["tag"] == tag)
            && f["last"]["base_head"] == head
            && let Some(b) = f["last"]["build"].as_str()
        {
            return b.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no rebuild of {tag} for {head}: {list:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn a_move_leaves_the_tenants_own_choices_alone() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, _state, store) = env();
    let base = |v: &str| format!("FROM {bb}\nRUN echo {v} > /base-version\n");
    operator_build(&t.path().join("g1"), &store, &base("v1"), "gbase:latest");
    let s = Server::start(
        KILN.as_ref(),
        &t.path().join("state"),
        &store,
        &["--base", "gbase", "--heartbeat", "1s", "--workers", "3"],
    );
    let acme = s.key("acme", &["--max-concurrent", "3"]);
    let c = client();
    rt().block_on(async {
        let fast = "FROM gbase\nRUN cat /base-version > /seen\n";
        let slow = "FROM gbase\nRUN sleep 8 && cat /base-version > /seen\n";
        let id = start(&c, &s, &acme, fast, "app:1", true).await;
        succeeded(&c, &s, &acme, &id).await;
        let id = start(&c, &s, &acme, slow, "res:1", true).await;
        let res1 = succeeded(&c, &s, &acme, &id).await;
        let id = start(
            &c,
            &s,
            &acme,
            "FROM gbase\nRUN cat /base-version > /lim\n",
            "lim:1",
            true,
        )
        .await;
        succeeded(&c, &s, &acme, &id).await;
        let original = json_of(get(&c, &s, &acme, &format!("/v1/builds/{id}")).await).await;
        assert_eq!(original["limits"]["timeout_secs"], 900, "{original:#}");
        // The operator lowers acme's quota.
        s.key(
            "acme",
            &["--max-timeout-secs", "120", "--max-memory-mib", "256"],
        );

        // The tenant's own build of app:1, without follow_base, runs across the move.
        let mine = start(
            &c,
            &s,
            &acme,
            "FROM gbase\nRUN sleep 12 && echo mine > /mine\n",
            "app:1",
            false,
        )
        .await;
        wait_for(
            &c,
            &s,
            &acme,
            &mine,
            Duration::from_secs(60),
            kiln_tests::serve::running_step,
        )
        .await;

        // The base moves.
        let head2 = operator_build(&t.path().join("g2"), &store, &base("v2"), "gbase:latest");

        // A rebuild runs within the quota of its day.
        let lim = rebuild_of(&c, &s, &acme, "lim:1", &head2).await;
        let v = json_of(get(&c, &s, &acme, &format!("/v1/builds/{lim}")).await).await;
        assert_eq!(v["limits"]["timeout_secs"], 120, "{v:#}");
        assert_eq!(v["limits"]["memory_mib"], 256, "{v:#}");

        // res:1's rebuild runs; the tenant pins the tag to the image it names, which ends
        // its follow.
        let rb = rebuild_of(&c, &s, &acme, "res:1", &head2).await;
        wait_for(
            &c,
            &s,
            &acme,
            &rb,
            Duration::from_secs(60),
            kiln_tests::serve::running_step,
        )
        .await;
        let r = c
            .put(s.url("/v1/images/res/tags/1"))
            .bearer_auth(&acme)
            .header("If-Match", format!("\"{res1}\""))
            .json(&json!({"digest": res1}))
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 200, "{:#}", json_of(r).await);
        let v = wait_for(&c, &s, &acme, &rb, Duration::from_secs(120), terminal).await;
        assert_eq!(v["state"], "cancelled", "{v:#}");
        assert_eq!(tag_digest(&c, &s, &acme, "res", "1").await, res1);

        // The tenant's own build succeeds and keeps its image.
        let v = wait_for(&c, &s, &acme, &mine, Duration::from_secs(120), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let mine_image = v["image"].as_str().expect("image").to_string();
        assert_eq!(tag_digest(&c, &s, &acme, "app", "1").await, mine_image);

        // A few sweeps later: neither app:1 nor res:1 follows, nor has either moved.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let list = follows(&c, &s, &acme).await;
        let tags: Vec<&str> = list.iter().map(|f| f["tag"].as_str().unwrap()).collect();
        assert_eq!(tags, ["lim:1"], "{list:#?}");
        assert_eq!(tag_digest(&c, &s, &acme, "app", "1").await, mine_image);
        assert_eq!(tag_digest(&c, &s, &acme, "res", "1").await, res1);
    });
}

/// `follow_base` names a global base by a tag the store lacks (`kiln serve --base NAME`
/// allows every tag of NAME): the build would pull an image of that name from a registry
/// (Docker Hub for `ubuntu:anything`), and registry bases cannot be followed, so it is
/// refused (it was accepted, and its tags followed a base tag no move of the operator's
/// would ever touch).
#[test]
fn following_a_global_base_tag_the_store_lacks_is_refused() {
    let (t, _state, store) = env();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    operator_build(
        &t.path().join("g1"),
        &store,
        &format!("FROM {bb}\nRUN true\n"),
        "gbase:latest",
    );
    let s = Server::start(
        KILN.as_ref(),
        &t.path().join("state"),
        &store,
        &["--base", "gbase"],
    );
    let acme = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let spec = json!({"tags": ["x:1"], "follow_base": true});
        let r = submit(
            &c,
            &s,
            &acme,
            &spec,
            None,
            Some(b"FROM gbase:nosuch\nRUN true\n"),
            None,
        )
        .await;
        let status = r.status().as_u16();
        let v = json_of(r).await;
        assert_eq!(status, 400, "{v:#}");
        assert!(
            v["message"]
                .as_str()
                .unwrap()
                .contains("no tag of this server"),
            "{v:#}"
        );
        // The tag the store has is followed.
        let r = submit(
            &c,
            &s,
            &acme,
            &spec,
            None,
            Some(b"FROM gbase:latest\nRUN true\n"),
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
    });
}
