//! Issue 39 through the API: `GET /v1/builds/{id}` carries, per step that missed the build
//! cache, the same reasons as `kiln build` (`why`, `why_text`), and a reason never names
//! another workspace's inputs: a workspace's first build of a recipe another workspace built
//! says "no earlier build". The real server on 127.0.0.1, the busybox fixture. Needs root.

use std::time::Duration;

use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, context_dir, env, get, json_of, rt, submit, tar_dir, terminal, wait_for,
};
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

#[test]
fn the_build_record_says_why_each_step_ran_within_its_workspace() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let ctx = context_dir(
        t.path(),
        &format!("FROM {bb}\nCOPY hello.txt /hello.txt\nRUN cat /hello.txt > /copy.txt\n"),
    );
    let s = Server::start(KILN.as_ref(), &state, &store, &[]);
    let (acme, rival) = (s.key("acme", &[]), s.key("rival", &[]));
    let c = client();
    rt().block_on(async {
        let build = |key: String| {
            let (c, s, body) = (&c, &s, tar_dir(&ctx));
            async move {
                let r = submit(
                    c,
                    s,
                    &key,
                    &json!({"tags": ["app:1"]}),
                    Some(&body),
                    None,
                    None,
                )
                .await;
                assert_eq!(r.status(), 202);
                let id = json_of(r).await["id"].as_str().expect("id").to_string();
                let v = wait_for(c, s, &key, &id, Duration::from_secs(300), terminal).await;
                assert_eq!(v["state"], "succeeded", "{v:#}");
                let log = get(c, s, &key, &format!("/v1/builds/{id}/logs"))
                    .await
                    .text()
                    .await
                    .expect("log");
                (v["steps"].as_array().expect("steps").clone(), log)
            }
        };
        let step = |steps: &[Value], location: &str| {
            steps
                .iter()
                .find(|s| s["location"] == location)
                .unwrap_or_else(|| panic!("no step at {location}: {steps:?}"))
                .clone()
        };
        let (first, _) = build(acme.clone()).await;
        let copy = step(&first, "Dockerfile:2");
        assert_eq!(
            copy["why"],
            json!([{"reason": "no_earlier_build"}]),
            "{copy}"
        );
        assert_eq!(copy["why_text"], "no earlier build", "{copy}");

        std::fs::write(ctx.join("hello.txt"), "changed\n").expect("write");
        let (second, log) = build(acme.clone()).await;
        let copy = step(&second, "Dockerfile:2");
        assert_eq!(
            copy["why"],
            json!([{"reason": "context_files", "files": ["hello.txt"], "more": 0}]),
            "{copy}"
        );
        assert_eq!(copy["why_text"], "context file hello.txt changed", "{copy}");
        // The log says it too, as a line of the build (not of the step's output).
        let line = format!("step {} ran: context file hello.txt changed", copy["step"]);
        assert!(
            log.lines().any(|l| {
                let v: Value = serde_json::from_str(l).expect("log line");
                v["text"] == line.as_str() && v["step"].is_null()
            }),
            "{log}"
        );
        assert_eq!(
            step(&second, "Dockerfile:3")["why"],
            json!([{"reason": "earlier_step"}])
        );

        // Another workspace, the first context: acme's builds are not its earlier builds.
        std::fs::write(ctx.join("hello.txt"), "hello from the context\n").expect("write");
        let (theirs, _) = build(rival.clone()).await;
        for l in ["Dockerfile:2", "Dockerfile:3"] {
            let st = step(&theirs, l);
            assert_eq!(st["why"], json!([{"reason": "no_earlier_build"}]), "{st}");
        }
    });
}
