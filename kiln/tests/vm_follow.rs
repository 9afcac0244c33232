//! Issue 40 with real boots (as root, TCG): a tenant image that follows the default image and
//! took a snapshot is rebuilt when `kiln nightly` promotes a new default image, boots once and
//! passes its ready check again before its tag moves, as another workspace's following image
//! is rebuilt too, and an image that does not follow stays; when the next base makes the
//! ready check fail, the rebuild moves nothing and `GET /v1/follows` says why.
//!
//! The base `bb:latest` is a busybox YAML recipe whose dpkg status names the version of one
//! package (a build arg): 1.0 (`kiln build -t`), then 1.1 (`kiln nightly`, which promotes
//! it), then 2.0 (`kiln build -t`). The tenant's ready check accepts 1.x only.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, follows, get, json_of, rt, submit, tag_digest, terminal, wait_for,
};
use kiln_tests::vm::{StopClones, kiln_in, show};
use serde_json::{Value, json};

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

fn kiln(dir: &Path, args: &[&str]) -> Output {
    kiln_in(KILN, dir).args(args).output().expect("run kiln")
}

/// `kiln build -t bb:latest` of the base recipe with package version `version`; the image.
fn base_build(dir: &Path, recipe: &str, version: &str) -> String {
    let arg = format!("PKG_VERSION={version}");
    let o = kiln(
        dir,
        &[
            "build",
            "-f",
            recipe,
            "-t",
            "bb:latest",
            "--build-arg",
            &arg,
            "--progress",
            "plain",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .expect("digest")
        .to_string()
}

/// Waits until the follow of `tag` reports a rebuild for the base head `head` that ended.
async fn rebuilt_for(c: &reqwest::Client, s: &Server, key: &str, tag: &str, head: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let list = follows(c, s, key).await;
        let f = list
            .iter()
            .find(|f| f["tag"] == tag)
            .cloned()
            .unwrap_or_else(|| panic!("no follow of {tag}: {list:#?}"));
        if f["last"]["base_head"] == head && f["last"]["state"] != "queued" {
            return f;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(400),
            "no rebuild for {head}: {f:#}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[test]
fn a_nightly_promotion_rebuilds_a_following_snapshot_image_which_must_pass_its_ready_check() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let _stop = StopClones::new(KILN, d);
    let ctx = d.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    let recipe = ctx.join("base.yaml");
    std::fs::write(
        &recipe,
        format!(
            "from: {bb}\n\
             args:\n  PKG_VERSION: \"1.0\"\n\
             commands:\n  - echo night > /greeting\n\
             \x20 - 'mkdir -p /var/lib/dpkg && printf \"Package: kiln-probe\\nVersion: %s\\n\" \"$PKG_VERSION\" > /var/lib/dpkg/status'\n\
             start:\n  command: [sh, -c, \"touch /tmp/up; exec sleep 1000000\"]\n\
             ready:\n  command: test -e /tmp/up\n  interval: 100ms\n  retries: 300\n\
             smoke:\n  - {{command: cat /greeting, output: night}}\n"
        ),
    )
    .expect("write");
    let recipe = recipe.to_str().expect("utf-8");
    base_build(d, recipe, "1.0");

    let a = kiln_tests::vm::guest_assets();
    let (k, i) = (
        a.kernel.display().to_string(),
        a.initramfs.display().to_string(),
    );
    let s = Server::start(
        KILN.as_ref(),
        // Where `kiln nightly` finds the server's database (`$KILN_STATE_DIR/serve`).
        &d.join("state/serve"),
        &d.join("store"),
        &[
            "--base",
            "bb",
            "--kernel",
            &k,
            "--initramfs",
            &i,
            "--heartbeat",
            "1s",
            "--takeover-after",
            "3s",
        ],
    );
    let key = s.key("acme", &[]);
    let beta = s.key("beta", &[]);
    let c = client();
    let tenant = "from: bb\n\
                  commands:\n  - echo app > /app\n\
                  start:\n  command: [sh, -c, \"exec sleep 1000000\"]\n\
                  ready:\n  command: [grep, -q, \"Version: 1[.]\", /var/lib/dpkg/status]\n  interval: 100ms\n  retries: 20\n";
    rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"recipe": "app.yaml", "tags": ["app:1"], "snapshot": true,
                    "follow_base": true, "limits": {"memory_mib": 256}}),
            None,
            Some(tenant.as_bytes()),
            None,
        )
        .await;
        let status = r.status();
        let v = json_of(r).await;
        assert_eq!(status, 202, "{v:#}");
        let id = v["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let first = v["image"].as_str().expect("image").to_string();
        assert!(v["snapshot"].is_string(), "{v:#}");
        // Another workspace's following image (no snapshot), and one of acme's that does
        // not follow.
        let plain = "FROM bb\nRUN cat /var/lib/dpkg/status > /seen\n";
        let mut images = Vec::new();
        for (k, tag, follow) in [(&beta, "svc:1", true), (&key, "still:1", false)] {
            let r = submit(
                &c,
                &s,
                k,
                &json!({"tags": [tag], "follow_base": follow}),
                None,
                Some(plain.as_bytes()),
                None,
            )
            .await;
            let v = json_of(r).await;
            let id = v["id"].as_str().unwrap_or_else(|| panic!("{v:#}"));
            let v = wait_for(&c, &s, k, id, Duration::from_secs(300), terminal).await;
            assert_eq!(v["state"], "succeeded", "{v:#}");
            images.push(v["image"].as_str().expect("image").to_string());
        }

        // The nightly promotes 1.1: the image is rebuilt, booted, ready, and its tag moves.
        let o = kiln(
            d,
            &[
                "--json",
                "nightly",
                recipe,
                "--tag",
                "bb:latest",
                "--day",
                "20261205",
                "--memory-mib",
                "256",
                "--build-arg",
                "PKG_VERSION=1.1",
            ],
        );
        assert!(o.status.success(), "{}", show(&o));
        let night = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["event"] == "nightly")
            .unwrap_or_else(|| panic!("no nightly report: {}", show(&o)));
        assert_eq!(night["outcome"], "promoted", "{night:#}");
        // Its summary of the move: two images in two workspaces follow the tag.
        assert_eq!(
            night["follows"],
            json!({"images": 2, "workspaces": 2}),
            "{night:#}"
        );
        let head2 = night["image"].as_str().expect("image").to_string();
        let f = rebuilt_for(&c, &s, &key, "app:1", &head2).await;
        // The report of this move, as the closing note shows it.
        eprintln!("GET /v1/follows after the nightly's move: {f:#}");
        assert_eq!(f["last"]["state"], "rebuilt", "{f:#}");
        let second = f["last"]["image"].as_str().expect("image").to_string();
        assert_ne!(second, first);
        let rb = f["last"]["build"].as_str().expect("build");
        let v = json_of(get(&c, &s, &key, &format!("/v1/builds/{rb}")).await).await;
        assert!(v["snapshot"].is_string(), "the rebuild booted once: {v:#}");
        let t = tag_digest(&c, &s, &key, "app", "1").await;
        assert_eq!(t, second.as_str());
        let f = rebuilt_for(&c, &s, &beta, "svc:1", &head2).await;
        assert_eq!(f["last"]["state"], "rebuilt", "{f:#}");
        assert_ne!(f["image"], images[0].as_str());
        let t = json_of(get(&c, &s, &key, "/v1/images/still/tags/1").await).await;
        assert_eq!(
            t["digest"],
            images[1].as_str(),
            "an image that does not follow"
        );

        // 2.0 fails the tenant's ready check: the rebuild fails and the tag stays.
        let head3 = base_build(d, recipe, "2.0");
        let f = rebuilt_for(&c, &s, &key, "app:1", &head3).await;
        assert_eq!(f["last"]["state"], "failed", "{f:#}");
        let reason = f["last"]["reason"].as_str().expect("reason");
        assert!(reason.contains("ready"), "{reason}");
        let t = tag_digest(&c, &s, &key, "app", "1").await;
        assert_eq!(t, second.as_str());
        assert_eq!(f["image"], second.as_str());
    });
}
