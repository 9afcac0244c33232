//! `kiln serve` end to end (as root): the real server as a process on 127.0.0.1 (a free
//! port), a real local store and SQLite database, driven by a real HTTP client, building the
//! busybox fixture (`KILN_TEST_BUSYBOX_REF`).
//!
//! Cases: the same inputs give the same image digest through `kiln build` and the API; tags
//! by compare-and-swap; missing and wrong keys (401); another workspace's objects answer
//! byte for byte as missing ones (404); a recipe error is 400 with `kiln plan`'s text; an
//! idempotent retry; logs resumed after a disconnect at a random line with no gap and no
//! duplicate; cancel publishes nothing; over quota is 429; SIGTERM and kill -9 end every
//! accepted build in a terminal state; three nodes on one PostgreSQL database and one S3
//! bucket run each build once, share the build cache and take over a killed node's build;
//! `/metrics` only on the operator's listener; without `--trust-tenants` the server needs
//! the guest kernel and initramfs, and tenants' steps run in microVMs (TCG here: the guest
//! kernel and initramfs of `KILN_TEST_KERNEL`/`KILN_TEST_INITRAMFS`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    QUICK_LIVENESS, Server, claimer, cli_build, client, context_dir, env, fetch_recipe, get,
    json_of, postgres, psql, rt, running_step, submit, submit_recipe, tagged_spec, tar_dir,
    terminal, until, wait_for,
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

fn hex_sha256(b: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(b))
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
/// with the build's allow-list, runs without one and its first log line says so; a `none`
/// step's does not. `network: "host"` is refused with 400. The tenants' port has no
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
        assert_eq!(
            line,
            "[kiln] this step runs without a network: microVM steps have no network card yet"
        );
        let none = step_of(&v, "Dockerfile:4")["step"].clone();
        assert!(
            !log.lines().any(|l| {
                let l: Value = serde_json::from_str(l).expect("log line");
                l["step"] == none && l["text"].as_str().is_some_and(|t| t.contains("network"))
            }),
            "{log}"
        );

        // An allow-list reaches nothing from a microVM, and the step says so.
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
        assert!(
            first_line(&log, &step["step"])
                .starts_with("[kiln] this step runs without a network, so its allow-list"),
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
