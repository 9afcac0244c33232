//! `kiln serve` end to end (as root): the real server as a process on 127.0.0.1 (a free
//! port), a real local store and SQLite database, driven by a real HTTP client, building the
//! busybox fixture (`KILN_TEST_BUSYBOX_REF`).
//!
//! Cases: the same inputs give the same image digest through `kiln build` and the API; tags
//! by compare-and-swap; missing and wrong keys (401); another workspace's objects answer
//! byte for byte as missing ones (404); a recipe error is 400 with `kiln plan`'s text; an
//! idempotent retry; logs resumed after a disconnect at a random line with no gap and no
//! duplicate; cancel publishes nothing; over quota is 429; SIGTERM and kill -9 end every
//! accepted build in a terminal state (several nodes on one database: `serve_nodes.rs`);
//! `/metrics` only on the operator's listener; without `--trust-tenants` the server needs
//! the guest kernel and initramfs, and tenants' steps run in microVMs (TCG here: the guest
//! kernel and initramfs of `KILN_TEST_KERNEL`/`KILN_TEST_INITRAMFS`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, cli_build, client, context_dir, env, get, hex_sha256, json_of, postgres, rt,
    running_step, submit, submit_recipe, tar_dir, terminal, until, wait_for,
};
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

fn kiln() -> Command {
    Command::new(KILN)
}

#[test]
fn api_build_matches_kiln_build_and_moves_tags_by_cas() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let ctx = context_dir(
        t.path(),
        &format!("FROM {bb}\nCOPY hello.txt /hello.txt\nRUN cat /hello.txt > /copy.txt\n"),
    );
    // `kiln build` into its own store.
    let cli_digest = cli_build(
        KILN.as_ref(),
        &ctx,
        &t.path().join("cli-store"),
        &[],
        &[
            "-f",
            "Dockerfile",
            "--build-arg",
            "SOURCE_DATE_EPOCH=1700000000",
        ],
    );

    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--metrics-listen", "127.0.0.1:0"],
    );
    let key = s.key("acme", &[]);
    let other = s.key("rival", &[]);
    let c = client();
    rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            // SOURCE_DATE_EPOCH, as for any reproducible build: the RUN step writes a file.
            &json!({"tags": ["app:1"], "build_args": {"SOURCE_DATE_EPOCH": "1700000000"}}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let a = json_of(r).await;
        let id = a["id"].as_str().expect("id").to_string();
        assert_eq!(a["urls"]["logs"], format!("/v1/builds/{id}/logs"));
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert_eq!(
            v["image"],
            cli_digest.as_str(),
            "same inputs, same digest: {v:#}"
        );
        let steps = v["steps"].as_array().expect("steps");
        assert_eq!(steps[0]["location"], "Dockerfile:2");
        assert_eq!(steps[1]["location"], "Dockerfile:3");
        assert!(steps.iter().all(|s| s["duration_ms"].is_i64()), "{v:#}");

        // The tag, in the workspace's namespace.
        let r = get(&c, &s, &key, "/v1/images/app/tags/1").await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["etag"].to_str().expect("etag"),
            format!("\"{cli_digest}\"")
        );
        let images = json_of(get(&c, &s, &key, "/v1/images").await).await;
        assert_eq!(images[0]["name"], "app", "{images:#}");
        let store_tags = kiln_store_tags(&s.store);
        assert_eq!(store_tags, vec![format!("acme.app:1 {cli_digest}")]);

        // Another workspace sees none of it, exactly as if it did not exist.
        for p in [
            "/v1/images/app/tags/1".to_string(),
            "/v1/images/app/tags".to_string(),
            format!("/v1/builds/{id}"),
            format!("/v1/builds/{id}/logs"),
            format!("/v1/manifests/{cli_digest}"),
        ] {
            let theirs = get(&c, &s, &other, &p).await;
            let missing = get(
                &c,
                &s,
                &key,
                &p.replace(&id, "bnosuchbuild")
                    .replace("app", "nosuch")
                    .replace(&cli_digest[7..], &"0".repeat(64)),
            )
            .await;
            assert_eq!(theirs.status(), 404, "{p}");
            assert_eq!(missing.status(), 404, "{p}");
            assert_eq!(
                theirs.bytes().await.expect("b"),
                missing.bytes().await.expect("b"),
                "{p}"
            );
        }
        assert_eq!(
            json_of(get(&c, &s, &other, "/v1/images").await).await,
            json!([])
        );
        // Nor can it point its own tag at our image.
        let r = c
            .put(s.url("/v1/images/stolen/tags/1"))
            .bearer_auth(&other)
            .header("if-none-match", "*")
            .body(json!({"digest": cli_digest}).to_string())
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 404);

        // PUT moves by compare-and-swap.
        let put = |tag: &'static str, hdr: (&'static str, String)| {
            c.put(s.url(&format!("/v1/images/app/tags/{tag}")))
                .bearer_auth(&key)
                .header(hdr.0, hdr.1)
                .body(json!({"digest": cli_digest}).to_string())
                .send()
        };
        let zero = format!("\"sha256:{}\"", "0".repeat(64));
        assert_eq!(
            put("1", ("if-match", zero)).await.expect("PUT").status(),
            412
        );
        assert_eq!(
            put("2", ("if-none-match", "*".into()))
                .await
                .expect("PUT")
                .status(),
            200
        );
        assert_eq!(
            put("2", ("if-none-match", "*".into()))
                .await
                .expect("PUT")
                .status(),
            412
        );
        assert_eq!(
            put("1", ("if-match", format!("\"{cli_digest}\"")))
                .await
                .expect("PUT")
                .status(),
            200
        );
        let r = c
            .put(s.url("/v1/images/app/tags/3"))
            .bearer_auth(&key)
            .body(json!({"digest": cli_digest}).to_string())
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 428);
        let r = c
            .delete(s.url("/v1/images/app/tags/2"))
            .bearer_auth(&key)
            .send()
            .await
            .expect("DELETE");
        assert_eq!(r.status(), 204);
        assert_eq!(
            get(&c, &s, &key, "/v1/images/app/tags/2").await.status(),
            404
        );
        let m = json_of(get(&c, &s, &key, &format!("/v1/manifests/{cli_digest}")).await).await;
        assert_eq!(m["kind"], "image", "{m:#}");

        // The OpenAPI document and the metrics, on the operator's listener.
        let doc = json_of(c.get(s.url("/openapi.json")).send().await.expect("GET")).await;
        assert!(doc["paths"]["/v1/builds"]["post"].is_object(), "{doc:#}");
        let m = c
            .get(s.metrics_url())
            .send()
            .await
            .expect("GET")
            .text()
            .await
            .expect("text");
        assert!(m.contains("kiln_builds{state=\"succeeded\"} 1"), "{m}");
        assert!(
            m.contains("kiln_build_duration_seconds_count{state=\"succeeded\"} 1"),
            "{m}"
        );
        assert!(m.contains("kiln_queue_depth 0"), "{m}");
        // Not on the tenants' port, with a key or without; and the operator's listener
        // serves nothing of the API.
        assert_eq!(
            c.get(s.url("/metrics")).send().await.expect("GET").status(),
            404
        );
        assert_eq!(get(&c, &s, &key, "/metrics").await.status(), 404);
        let operator = s.metrics_url().replace("/metrics", "");
        let r = c
            .get(format!("{operator}/v1/builds/{id}"))
            .bearer_auth(&key)
            .send()
            .await
            .expect("GET");
        assert_eq!(r.status(), 404);
    });
}

/// The store's tags, `name:tag digest`, read with `kiln tags`.
fn kiln_store_tags(store: &Path) -> Vec<String> {
    let out = kiln()
        .args(["--json", "tags", "--store"])
        .arg(store)
        .output()
        .expect("kiln tags");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "tag")
        .map(|v| {
            format!(
                "{} {}",
                v["tag"].as_str().unwrap_or(""),
                v["manifest"].as_str().unwrap_or("")
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn keys_blobs_recipe_errors_and_idempotency() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let ctx = context_dir(t.path(), &format!("FROM {bb}\nRUN echo one\n"));
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--metrics-listen", "127.0.0.1:0"],
    );
    let key = s.key("acme", &[]);
    let other = s.key("rival", &[]);
    let c = client();
    rt().block_on(async {
        // Liveness and readiness need no key.
        let r = c.get(s.url("/healthz")).send().await.expect("GET");
        assert_eq!(r.status(), 200);
        let r = c.get(s.url("/readyz")).send().await.expect("GET");
        assert_eq!(r.status(), 200);

        // 401: no key, a wrong key, a revoked key.
        let r = c.get(s.url("/v1/images")).send().await.expect("GET");
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
        assert_eq!(get(&c, &s, "kiln_wrong", "/v1/images").await.status(), 401);
        let doomed = s.key("acme", &[]);
        assert_eq!(get(&c, &s, &doomed, "/v1/images").await.status(), 200);
        let id = &kiln_service::auth::hash_key(&doomed)[..12];
        let out = kiln()
            .args(["serve", "keys", "revoke", id, "--state-dir"])
            .arg(&s.state)
            .output()
            .expect("revoke");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(get(&c, &s, &doomed, "/v1/images").await.status(), 401);

        // Blobs: the digest is checked; HEAD answers absent for another workspace.
        let tarball = tar_dir(&ctx);
        let digest = format!("sha256:{}", hex_sha256(&tarball));
        let wrong = format!("sha256:{}", "1".repeat(64));
        let r = c
            .put(s.url(&format!("/v1/blobs/{wrong}")))
            .bearer_auth(&key)
            .body(tarball.clone())
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 400);
        let head = |k: &str| {
            c.head(s.url(&format!("/v1/blobs/{digest}")))
                .bearer_auth(k.to_string())
                .send()
        };
        assert_eq!(head(&key).await.expect("HEAD").status(), 404);
        let r = c
            .put(s.url(&format!("/v1/blobs/{digest}")))
            .bearer_auth(&key)
            .body(tarball.clone())
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 201);
        assert_eq!(head(&key).await.expect("HEAD").status(), 200);
        assert_eq!(head(&other).await.expect("HEAD").status(), 404);
        // Another workspace cannot build from it either.
        let r = c
            .post(s.url("/v1/builds"))
            .bearer_auth(&other)
            .header("content-type", "application/json")
            .body(json!({"context": digest}).to_string())
            .send()
            .await
            .expect("POST");
        assert_eq!(r.status(), 400);

        // Unknown fields are refused.
        let r = c
            .post(s.url("/v1/builds"))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(json!({"context": digest, "tagz": ["x:1"]}).to_string())
            .send()
            .await
            .expect("POST");
        assert_eq!(r.status(), 400);
        assert!(
            json_of(r).await["message"]
                .as_str()
                .expect("msg")
                .contains("tagz")
        );

        // A recipe error: 400 with the text `kiln plan` prints.
        let bad = t.path().join("bad");
        std::fs::create_dir(&bad).expect("mkdir");
        std::fs::write(
            bad.join("Dockerfile"),
            format!("FROM {bb}\nRUN true\nCOPPY a b\n"),
        )
        .expect("write");
        let plan = kiln()
            .current_dir(&bad)
            .args(["plan", "Dockerfile"])
            .output()
            .expect("kiln plan");
        assert!(!plan.status.success());
        let plan_err = String::from_utf8_lossy(&plan.stderr);
        let plan_err = plan_err
            .trim_end()
            .strip_prefix("error: ")
            .expect("error: prefix");
        assert!(plan_err.starts_with("Dockerfile:3:"), "{plan_err}");
        let r = submit(&c, &s, &key, &json!({}), Some(&tar_dir(&bad)), None, None).await;
        assert_eq!(r.status(), 400);
        assert_eq!(
            json_of(r).await["message"]
                .as_str()
                .expect("msg")
                .trim_end(),
            plan_err
        );
        let r = submit(
            &c,
            &s,
            &key,
            &json!({}),
            None,
            Some(&std::fs::read(bad.join("Dockerfile")).expect("read")),
            None,
        )
        .await;
        assert_eq!(r.status(), 400);
        // Issue 41: what only `kiln build` may be entitled to is a 400 naming the
        // instruction, file and line.
        for (recipe, want) in [
            (
                format!("FROM {bb}\nRUN true\nRUN --security=insecure true\n"),
                "Dockerfile:3: RUN --security=insecure needs the security.insecure entitlement",
            ),
            (
                format!("FROM {bb}\nRUN true\nRUN --mount=type=ssh true\n"),
                "Dockerfile:3: RUN --mount=type=ssh is not available here: the build host has no SSH agent of yours",
            ),
            (
                format!("FROM {bb}\nRUN true\nADD git@git.test:org/repo.git#main /src\n"),
                "Dockerfile:3: ADD git@git.test:org/repo.git#main: git over ssh is not available here",
            ),
            (
                format!("FROM {bb}\nADD ssh://git@git.test:2222/org/repo.git /src\n"),
                "Dockerfile:2: ADD ssh://git@git.test:2222/org/repo.git: git over ssh is not available here",
            ),
        ] {
            let r = submit(&c, &s, &key, &json!({}), None, Some(recipe.as_bytes()), None).await;
            assert_eq!(r.status(), 400, "{recipe}");
            let msg = json_of(r).await["message"]
                .as_str()
                .expect("msg")
                .to_string();
            assert!(msg.contains(want), "{msg}");
        }
        // A bad tag name cannot reach another namespace.
        // (`rival/app:1` is a valid Docker name, stored as `<own workspace>.rival/app`: the
        // tags unit tests check it stays in the workspace.)
        for tag in ["../rival.app:1", "rival/../app:1", "/rival.app:1", "x"] {
            let r = c
                .post(s.url("/v1/builds"))
                .bearer_auth(&key)
                .header("content-type", "application/json")
                .body(json!({"context": digest, "tags": [tag]}).to_string())
                .send()
                .await
                .expect("POST");
            assert_eq!(r.status(), 400, "{tag}");
        }

        // Idempotency: same key and body → the original build; another body → 422.
        let body = json!({"context": digest, "tags": ["idem:1"]});
        let post = |b: Value, k: &'static str| {
            c.post(s.url("/v1/builds"))
                .bearer_auth(&key)
                .header("content-type", "application/json")
                .header("idempotency-key", k)
                .body(b.to_string())
                .send()
        };
        let r1 = post(body.clone(), "retry-1").await.expect("POST");
        assert_eq!(r1.status(), 202);
        let b1 = r1.bytes().await.expect("b");
        let r2 = post(body.clone(), "retry-1").await.expect("POST");
        assert_eq!(r2.status(), 202);
        assert_eq!(r2.headers()["idempotent-replayed"], "true");
        assert_eq!(r2.bytes().await.expect("b"), b1);
        let r3 = post(json!({"context": digest, "tags": ["idem:2"]}), "retry-1")
            .await
            .expect("POST");
        assert_eq!(r3.status(), 422);
        // The same key in another workspace is another key.
        let r4 = c
            .post(s.url("/v1/builds"))
            .bearer_auth(&other)
            .header("content-type", "application/json")
            .header("idempotency-key", "retry-1")
            .body(json!({}).to_string())
            .send()
            .await
            .expect("POST");
        assert_eq!(r4.status(), 400);
        let id = serde_json::from_slice::<Value>(&b1).expect("json")["id"]
            .as_str()
            .expect("id")
            .to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let m = c
            .get(s.metrics_url())
            .send()
            .await
            .expect("GET")
            .text()
            .await
            .expect("text");
        assert!(
            m.contains("kiln_builds{state=\"succeeded\"} 1\n"),
            "one build for two POSTs: {m}"
        );
    });
}

/// Reads NDJSON frames of a log stream until `stop` says so (or it ends).
async fn read_frames(r: reqwest::Response, mut stop: impl FnMut(&Value) -> bool) -> Vec<Value> {
    let mut r = r;
    let mut buf = Vec::new();
    let mut out = Vec::new();
    while let Some(chunk) = r.chunk().await.expect("chunk") {
        buf.extend_from_slice(&chunk);
        while let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            let v: Value = serde_json::from_slice(&line).expect("ndjson");
            let done = stop(&v);
            out.push(v);
            if done {
                return out;
            }
        }
    }
    out
}

#[test]
fn logs_resume_without_gaps_or_duplicates_and_cancel_publishes_nothing() {
    logs_and_cancel(&[]);
}

#[test]
fn postgres_logs_resume_without_gaps_or_duplicates_and_cancel_publishes_nothing() {
    logs_and_cancel(&postgres());
}

fn logs_and_cancel(db: &[String]) {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let ctx = context_dir(
        t.path(),
        &format!("FROM {bb}\nRUN for i in $(seq 1 300); do echo line $i; sleep 0.01; done\n"),
    );
    let s = Server::start_db(KILN.as_ref(), &state, &store, db, &[]);
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["logs:1"]}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        // Disconnect at a random line, then resume after it.
        let cut = 1
            + (std::process::id() as i64 * 7919 + Instant::now().elapsed().subsec_nanos() as i64)
                % 250;
        let logs = format!("/v1/builds/{id}/logs");
        let first = read_frames(
            get(&c, &s, &key, &format!("{logs}?follow=true")).await,
            |v| v["seq"].as_i64() == Some(cut),
        )
        .await;
        let last_seq = first.last().expect("a frame")["seq"].as_i64().expect("seq");
        assert_eq!(last_seq, cut);
        let rest = read_frames(
            get(
                &c,
                &s,
                &key,
                &format!("{logs}?follow=true&after={last_seq}"),
            )
            .await,
            |_| false,
        )
        .await;
        let end = rest.last().expect("final frame");
        assert_eq!(end["end"], true, "{end}");
        assert_eq!(end["state"], "succeeded", "{end}");
        let seqs: Vec<i64> = first
            .iter()
            .chain(&rest)
            .filter_map(|v| v["seq"].as_i64())
            .collect();
        let want: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(seqs, want, "no gap and no duplicate");
        let texts: Vec<&str> = first
            .iter()
            .chain(&rest)
            .filter_map(|v| v["text"].as_str())
            .collect();
        for i in 1..=300 {
            assert!(texts.contains(&format!("line {i}").as_str()), "line {i}");
        }
        // Without follow: the same lines after N, no final frame.
        let plain = get(&c, &s, &key, &format!("{logs}?after={cut}"))
            .await
            .text()
            .await
            .expect("text");
        let plain: Vec<Value> = plain
            .lines()
            .map(|l| serde_json::from_str(l).expect("ndjson"))
            .collect();
        assert_eq!(plain.first().expect("line")["seq"], cut + 1);
        assert_eq!(plain.len(), seqs.len() - cut as usize);

        // Cancel a running build: it ends cancelled, publishes nothing and moves no tag.
        let sleeper = context_dir(
            &t.path().join("s"),
            &format!("FROM {bb}\nRUN echo start && sleep 120\n"),
        );
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["logs:1", "sleepy:1"]}),
            Some(&tar_dir(&sleeper)),
            None,
            None,
        )
        .await;
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        wait_for(&c, &s, &key, &id, Duration::from_secs(120), running_step).await;
        let before = kiln_store_tags(&s.store);
        let r = c
            .post(s.url(&format!("/v1/builds/{id}/cancel")))
            .bearer_auth(&key)
            .send()
            .await
            .expect("cancel");
        assert_eq!(r.status(), 202);
        let t0 = Instant::now();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(60), terminal).await;
        eprintln!("cancel took {:?}", t0.elapsed());
        assert_eq!(v["state"], "cancelled", "{v:#}");
        assert!(v["image"].is_null(), "{v:#}");
        assert_eq!(kiln_store_tags(&s.store), before, "no tag moved");
        assert_eq!(
            get(&c, &s, &key, "/v1/images/sleepy/tags/1").await.status(),
            404
        );
        let r = c
            .post(s.url(&format!("/v1/builds/{id}/cancel")))
            .bearer_auth(&key)
            .send()
            .await
            .expect("cancel");
        assert_eq!(r.status(), 409);
    });
}

#[test]
fn quotas_sigterm_and_kill_9_end_every_build() {
    quotas_and_faults(&[]);
}

#[test]
fn postgres_quotas_sigterm_and_kill_9_end_every_build() {
    quotas_and_faults(&postgres());
}

fn quotas_and_faults(db: &[String]) {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let sleeper = context_dir(
        t.path(),
        &format!("FROM {bb}\nRUN echo start && sleep 120\n"),
    );
    let quick = context_dir(&t.path().join("q"), &format!("FROM {bb}\nRUN echo quick\n"));
    // One attempt: the build a kill -9 interrupts ends failed at the restart (the takeover
    // of a build on another node is `three_nodes_...`). The workspace's share of requests in
    // flight is above the burst below, so that what refuses its submissions is the queue cap.
    let args = [
        "--shutdown-grace",
        "1s",
        "--max-attempts",
        "1",
        "--max-requests-per-workspace",
        "1000",
    ];
    let mut s = Server::start_db(KILN.as_ref(), &state, &store, db, &args);
    let key = s.key("acme", &["--max-concurrent", "1", "--max-queued", "2"]);
    let c = client();
    let (running, queued) = rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["slow:1"]}),
            Some(&tar_dir(&sleeper)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let running = json_of(r).await["id"].as_str().expect("id").to_string();
        wait_for(
            &c,
            &s,
            &key,
            &running,
            Duration::from_secs(120),
            running_step,
        )
        .await;
        // The workspace runs one build at once: the next waits in the queue.
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["quick:1"]}),
            Some(&tar_dir(&quick)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let queued = json_of(r).await["id"].as_str().expect("id").to_string();
        // Past the queue cap: 429 with Retry-After.
        let r = submit(&c, &s, &key, &json!({}), Some(&tar_dir(&quick)), None, None).await;
        assert_eq!(r.status(), 429);
        assert!(
            r.headers()["retry-after"]
                .to_str()
                .expect("h")
                .parse::<u64>()
                .is_ok()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        let v = json_of(get(&c, &s, &key, &format!("/v1/builds/{queued}")).await).await;
        assert_eq!(v["state"], "queued", "{v:#}");
        (running, queued)
    });

    // kill -9 mid-build, then restart: the running build ends failed, the queued one runs.
    s.signal(rustix::process::Signal::KILL);
    s.wait(Duration::from_secs(30));
    drop(s);
    let mut s = Server::start_db(KILN.as_ref(), &state, &store, db, &args);
    rt().block_on(async {
        let v = json_of(get(&c, &s, &key, &format!("/v1/builds/{running}")).await).await;
        assert_eq!(v["state"], "failed", "{v:#}");
        // The reason names the server's node (its previous process, stopped by the restart)
        // by its id, and nothing of where it ran.
        let reason = v["failure"]["reason"].as_str().expect("reason");
        assert!(
            reason.starts_with("server stopped during the build: node n")
                && !reason.contains(state.to_str().expect("utf-8"))
                && !reason.contains("listening on")
                && reason.ends_with(" stopped; attempt 1 of 1"),
            "{reason}"
        );
        let v = wait_for(&c, &s, &key, &queued, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert_eq!(
            get(&c, &s, &key, "/v1/images/slow/tags/1").await.status(),
            404
        );

        // 100 concurrent submissions: each accepted or 429; every accepted one ends.
        let tarball = tar_dir(&quick);
        let digest = format!("sha256:{}", hex_sha256(&tarball));
        let r = c
            .put(s.url(&format!("/v1/blobs/{digest}")))
            .bearer_auth(&key)
            .body(tarball)
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 201);
        let body = json!({"context": digest}).to_string();
        let posts = (0..100).map(|_| {
            c.post(s.url("/v1/builds"))
                .bearer_auth(&key)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
        });
        let answers = futures_util::future::join_all(posts).await;
        let mut accepted = Vec::new();
        for a in answers {
            let a = a.expect("POST");
            match a.status().as_u16() {
                202 => accepted.push(json_of(a).await["id"].as_str().expect("id").to_string()),
                429 => {}
                other => panic!("status {other}: {}", a.text().await.unwrap_or_default()),
            }
        }
        // The cap bounds builds queued or running at once, not the burst's total: a cached
        // build can finish while the burst is still being answered and free its slot (3 of
        // 100 were accepted so in a loaded CI run). So: some were refused, and at no instant
        // were more than 2 active (from each build's created_at..finished_at).
        assert!(
            !accepted.is_empty() && accepted.len() < 100,
            "{}",
            accepted.len()
        );
        let mut views = Vec::new();
        for id in &accepted {
            let v = wait_for(&c, &s, &key, id, Duration::from_secs(300), terminal).await;
            assert_eq!(v["state"], "succeeded", "{v:#}");
            views.push(v);
        }
        assert!(max_active(&views) <= 2, "{views:#?}");
    });

    // SIGTERM: running builds get the grace period (1 s here), then end failed, "server
    // shutdown", moving no tag; the server exits.
    let running = rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["slow:1"]}),
            Some(&tar_dir(&sleeper)),
            None,
            None,
        )
        .await;
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        wait_for(&c, &s, &key, &id, Duration::from_secs(120), running_step).await;
        id
    });
    s.signal(rustix::process::Signal::TERM);
    let status = s.wait(Duration::from_secs(120));
    assert!(status.success(), "{status:?}");
    drop(s);
    let s = Server::start_db(KILN.as_ref(), &state, &store, db, &[]);
    rt().block_on(async {
        let v = json_of(get(&c, &s, &key, &format!("/v1/builds/{running}")).await).await;
        assert_eq!(v["state"], "failed", "{v:#}");
        assert_eq!(v["failure"]["reason"], "server shutdown");
        assert_eq!(
            get(&c, &s, &key, "/v1/images/slow/tags/1").await.status(),
            404
        );
    });
}

#[test]
fn logs_keep_the_message_and_build_limits_with_one_marker() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    // A 6000-byte line, then about 1.3 MiB of 31-byte lines; the build goes on past the cut.
    let ctx = context_dir(
        t.path(),
        &format!(
            "FROM {bb}\nRUN printf '%6000s\\n' x | tr ' ' a; \
             yes 0123456789012345678901234567890 | head -n 45000; echo after > /after\n"
        ),
    );
    let s = Server::start(KILN.as_ref(), &state, &store, &[]);
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["big:1"]}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let text = get(&c, &s, &key, &format!("/v1/builds/{id}/logs"))
            .await
            .text()
            .await
            .expect("text");
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("ndjson"))
            .collect();
        let texts: Vec<&str> = lines.iter().filter_map(|v| v["text"].as_str()).collect();
        let long = texts
            .iter()
            .find(|t| t.starts_with("aaaa"))
            .expect("the long line");
        assert!(
            long.len() <= 4096 + 64 && long.ends_with("[line truncated]"),
            "{}",
            long.len()
        );
        let markers = texts
            .iter()
            .filter(|t| t.contains("[log truncated"))
            .count();
        assert_eq!(markers, 1, "one truncation marker");
        let step_bytes: usize = lines
            .iter()
            .filter(|v| v["step"].is_i64())
            .map(|v| v["text"].as_str().map_or(0, |t| t.len() + 1))
            .sum();
        assert!(step_bytes <= (1 << 20) + 4096, "{step_bytes}");
        let seqs: Vec<i64> = lines.iter().filter_map(|v| v["seq"].as_i64()).collect();
        assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    });
}

/// Regression: two workers publishing the same image at once shared one scratch file for
/// the ext4 image (`scratch-<pid>-ext4-<digest>`) and failed ("No such file or directory",
/// e2fsck "short read"); every identical build must succeed with the same digest.
#[test]
fn identical_builds_at_once_all_succeed() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let ctx = context_dir(t.path(), &format!("FROM {bb}\nRUN echo same > /same\n"));
    let s = Server::start(KILN.as_ref(), &state, &store, &["--workers", "4"]);
    let key = s.key("acme", &["--max-concurrent", "4", "--max-queued", "100"]);
    let c = client();
    rt().block_on(async {
        let tarball = tar_dir(&ctx);
        let digest = format!("sha256:{}", hex_sha256(&tarball));
        let r = c
            .put(s.url(&format!("/v1/blobs/{digest}")))
            .bearer_auth(&key)
            .body(tarball)
            .send()
            .await
            .expect("PUT");
        assert_eq!(r.status(), 201);
        let body = json!({"context": digest, "build_args": {"SOURCE_DATE_EPOCH": "1700000000"}})
            .to_string();
        let mut ids = Vec::new();
        for _ in 0..24 {
            let r = c
                .post(s.url("/v1/builds"))
                .bearer_auth(&key)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .expect("POST");
            assert_eq!(r.status(), 202);
            ids.push(json_of(r).await["id"].as_str().expect("id").to_string());
        }
        let mut images = std::collections::BTreeSet::new();
        for id in &ids {
            let v = wait_for(&c, &s, &key, id, Duration::from_secs(300), terminal).await;
            assert_eq!(v["state"], "succeeded", "{v:#}");
            images.insert(v["image"].as_str().expect("image").to_string());
        }
        assert_eq!(images.len(), 1, "{images:?}");
    });
}

/// Without `--trust-tenants` tenants' steps run in microVMs, so the server starts only with
/// the guest kernel and initramfs: without them (no flag, no variable, and no `kiln kernel`
/// default: no guest init to build one with), with one of the two, or with files that do not
/// exist, it refuses to start, sets nothing up, and its error names the flags, `kiln kernel`
/// and `--trust-tenants`; its help says what `--trust-tenants` means.
#[test]
fn serve_refuses_to_start_without_boot_assets() {
    let t = tempfile::tempdir().expect("tempdir");
    let state = t.path().join("state");
    let missing = t.path().join("missing");
    let serve = |args: &[&std::ffi::OsStr]| {
        let out = kiln()
            .env_remove("KILN_KERNEL")
            .env_remove("KILN_INITRAMFS")
            .env("KILN_GUEST_INIT", &missing)
            .env("KILN_CACHE_DIR", t.path().join("cache"))
            .args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(&state)
            .arg("--store")
            .arg(t.path().join("store"))
            .args(args)
            .output()
            .expect("kiln serve");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        for flag in [
            "--kernel",
            "--initramfs",
            "`kiln kernel`",
            "--trust-tenants",
        ] {
            assert!(err.contains(flag), "{flag}: {err}");
        }
        assert!(!err.contains("listening on"), "{err}");
        assert!(!state.join("kiln.db").exists(), "nothing set up: {err}");
        err
    };
    // Nothing given: the `kiln kernel` default finds no guest init.
    let err = serve(&[]);
    assert!(err.contains(&missing.display().to_string()), "{err}");
    // One of the two.
    let err = serve(&["--kernel".as_ref(), missing.as_os_str()]);
    assert!(err.contains("give both"), "{err}");
    // Files that do not exist.
    let err = serve(&[
        "--kernel".as_ref(),
        missing.join("vmlinux").as_os_str(),
        "--initramfs".as_ref(),
        missing.join("initramfs.cpio").as_os_str(),
    ]);
    assert!(
        err.contains(&format!(
            "{}: not a file",
            missing.join("vmlinux").display()
        )),
        "{err}"
    );
    let help = kiln().args(["serve", "--help"]).output().expect("help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("DEVELOPMENT ONLY"), "{help}");
}

/// The first log line of step `step` in the NDJSON log `log`.
fn first_line(log: &str, step: &Value) -> String {
    log.lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("log line"))
        .find(|l| l["step"] == *step)
        .and_then(|l| l["text"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no line of step {step}: {log}"))
}

/// The step of build view `v` at `location` (`file:line`).
fn step_of<'a>(v: &'a Value, location: &str) -> &'a Value {
    v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["location"] == location)
        .unwrap_or_else(|| panic!("no step at {location}: {v:#}"))
}

/// Without `--trust-tenants` (the default), a tenant's build through the API runs each RUN
/// step in a microVM of its own (TCG here) and gives the image `kiln build` gives with the
/// namespace executor. The server says so at startup; each RUN step's `executor` is `vm`
/// (none for COPY and the generated sandbox layer). A step with the default network, or
/// with the build's allow-list, reaches the network through kiln's egress proxy only and its
/// first log line says so; a `none` step's does not. `network: "host"` is refused with 400. The tenants' port has no
/// `/metrics`, and without `--metrics-listen` there is no other.
#[test]
fn serve_runs_tenant_steps_in_microvms() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let ctx = context_dir(
        t.path(),
        &format!(
            "FROM {bb}\nCOPY hello.txt /hello.txt\nRUN cat /hello.txt > /copy.txt\n\
             RUN --network=none echo offline > /none.txt\n"
        ),
    );
    let cli_digest = cli_build(
        KILN.as_ref(),
        &ctx,
        &t.path().join("cli-store"),
        &[],
        &[
            "-f",
            "Dockerfile",
            "--build-arg",
            "SOURCE_DATE_EPOCH=1700000000",
        ],
    );

    let s = Server::start_vm(KILN.as_ref(), &state, &store, &[]);
    until("the executor's line", Duration::from_secs(10), || {
        s.logged("kiln serve: executor vm")
    });
    assert!(s.metrics.is_none());
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let limits = json!({"memory_mib": 256, "timeout_secs": 300});
        // The host network is not a tenant's.
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"network": "host", "limits": limits}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 400);
        let e = json_of(r).await;
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("\"host\"")),
            "{e:#}"
        );

        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["app:1"], "limits": limits,
                    "build_args": {"SOURCE_DATE_EPOCH": "1700000000"}}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert_eq!(v["image"], cli_digest.as_str(), "{v:#}");
        for st in v["steps"].as_array().expect("steps") {
            let runs = st["instruction"]
                .as_str()
                .is_some_and(|i| i.starts_with("RUN"));
            let want = if runs { json!("vm") } else { Value::Null };
            assert_eq!(st["executor"], want, "{st:#}");
        }
        let log = get(&c, &s, &key, &format!("/v1/builds/{id}/logs"))
            .await
            .text()
            .await
            .expect("log");
        let line = first_line(&log, &step_of(&v, "Dockerfile:3")["step"]);
        // The default network of a microVM step is the egress proxy, and the step says so.
        assert_eq!(line, kiln_pipeline::vmexec::PROXY_ONLY_LINE.trim_end());
        let none = step_of(&v, "Dockerfile:4")["step"].clone();
        assert!(
            !log.lines().any(|l| {
                let l: Value = serde_json::from_str(l).expect("log line");
                l["step"] == none && l["text"].as_str().is_some_and(|t| t.contains("network"))
            }),
            "{log}"
        );

        // An allow-list step in a microVM goes through the same proxy, and says so.
        let id = submit_recipe(
            &c,
            &s,
            &key,
            &json!({"network": {"allow": ["example.com"]}, "limits": limits}),
            &format!("FROM {bb}\nRUN echo allowed > /allowed.txt\n"),
        )
        .await;
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let step = step_of(&v, "Dockerfile:2");
        assert_eq!(step["executor"], "vm", "{v:#}");
        let log = get(&c, &s, &key, &format!("/v1/builds/{id}/logs"))
            .await
            .text()
            .await
            .expect("log");
        assert_eq!(
            first_line(&log, &step["step"]),
            kiln_pipeline::vmexec::PROXY_ONLY_LINE.trim_end(),
            "{log}"
        );

        // The operator's metrics are not on the tenants' port.
        assert_eq!(
            c.get(s.url("/metrics")).send().await.expect("GET").status(),
            404
        );
        assert_eq!(get(&c, &s, &key, "/metrics").await.status(), 404);
    });
}

/// schemathesis against `/openapi.json` with a valid key: no response is a server error, and
/// every response matches the document (status, content type, schema).
#[test]
fn schemathesis_finds_no_server_error_or_schema_violation() {
    let st = require_env("KILN_TEST_SCHEMATHESIS");
    let (t, state, store) = env();
    let s = Server::start(KILN.as_ref(), &state, &store, &[]);
    let key = s.key("acme", &[]);
    // Its cache (`.schemathesis/`) goes into the test's directory, not the checkout.
    let out = Command::new(&st)
        .current_dir(t.path())
        .args(["run", &s.url("/openapi.json"), "-H"])
        .arg(format!("Authorization: Bearer {key}"))
        .args([
            "--checks",
            "not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance",
            "--max-examples",
            "50",
            "--seed",
            "1",
        ])
        .output()
        .unwrap_or_else(|e| panic!("{st}: {e} (run ci/setup.sh)"));
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The most builds active at one instant among `views` (build JSON with RFC 3339 `created_at`
/// and `finished_at`, millisecond strings that sort as times). At one millisecond a finish
/// counts before a creation: the server counts a slot free once the finish has committed.
fn max_active(views: &[Value]) -> usize {
    let mut events: Vec<(String, i32)> = Vec::new();
    for v in views {
        let at = |k: &str| {
            v[k].as_str()
                .unwrap_or_else(|| panic!("{k} in {v:#}"))
                .to_string()
        };
        events.push((at("created_at"), 1));
        events.push((at("finished_at"), -1));
    }
    events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    most as usize
}
