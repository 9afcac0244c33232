//! Every image command against an `s3://` store (issue 19, "Builds straight into a remote
//! store"), and tags that move by compare-and-swap: the `kiln` binary against the moto S3
//! server, the test registry and the busybox fixture of `ci/setup.sh` (`source
//! /var/cache/kiln-ci/env`), as root like the other build tests. Each "host" is a fresh
//! `KILN_CACHE`: what one host's command wrote reaches another only through the store.

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_tests::{assert_success, require_env};
use serde_json::Value;

/// The build inputs' timestamps (BuildKit's `SOURCE_DATE_EPOCH`).
const EPOCH: &str = "SOURCE_DATE_EPOCH=1700000000";

/// `kiln ARGS` with store `store` and host cache `cache`, no config file.
fn kiln(store: &str, cache: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.args(args)
        .env("KILN_STORE", store)
        .env("KILN_CACHE", cache)
        .env("KILN_CONFIG", cache.join("no-config.toml"));
    c
}

fn ok(mut c: impl std::borrow::BorrowMut<Command>, what: &str) -> String {
    let o = c
        .borrow_mut()
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_success(&o, what)
}

/// The last line of stdout: the digest the command printed.
fn last_line(s: &str) -> String {
    s.lines().last().unwrap_or_default().to_string()
}

fn s3_url(label: &str) -> String {
    let bucket = kiln_tests::stores::env("KILN_TEST_S3_BUCKET");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    format!("s3://{bucket}/build-{}-{nanos}-{label}", std::process::id())
}

fn need_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
}

/// A build context with `dockerfile`.
fn context(dir: &Path, dockerfile: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join("Dockerfile"), dockerfile).expect("write");
    dir.to_path_buf()
}

/// The `built` event of a `kiln --json build`.
fn built(stdout: &str) -> Value {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "built")
        .unwrap_or_else(|| panic!("no built event in {stdout}"))
}

/// Issue 19: `kiln build --store s3://…` was refused ("works on a local store directory
/// only"). Now a busybox build goes straight into S3; `kiln store verify --deep` finds that
/// store clean; `kiln export --format ext4` from it on another host gives the bytes of the
/// same build into a local store, which `e2fsck -fn` passes; a build on a third host runs no
/// step and flattens nothing: the build cache and the image cache are the store's; and on a
/// fourth host an `--offline` build `FROM` that image finds it in the store.
#[test]
fn a_build_straight_into_s3_verifies_exports_the_local_bytes_and_hits_the_shared_cache() {
    need_root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = context(
        &t.path().join("ctx"),
        &format!("FROM {bb}\nCOPY data.txt /app/\nRUN echo hi > /hi && rm /bin/vi\n"),
    );
    std::fs::write(ctx.join("data.txt"), "data\n").expect("write");
    let ctx = ctx.to_str().expect("utf-8");
    let build = ["build", ctx, "-t", "app:1", "--build-arg", EPOCH];

    let local = t.path().join("local-store");
    let local = local.to_str().expect("utf-8");
    let host_a = t.path().join("host-a");
    let local_image = last_line(&ok(
        kiln(local, &host_a, &build).arg("--progress=plain"),
        "kiln build into a local store",
    ));

    let s3 = s3_url("shared");
    let out = ok(
        kiln(&s3, &host_a, &["--json"]).args(build),
        "kiln build into S3",
    );
    let first = built(&out);
    assert_eq!(first["manifest"], local_image.as_str(), "{first}");
    assert_eq!(first["stepsRun"], 2, "{first}");

    let host_b = t.path().join("host-b");
    let verify = ok(
        kiln(&s3, &host_b, &["store", "verify", "--deep"]),
        "kiln store verify --deep of the S3 store",
    );
    assert!(!verify.is_empty(), "verify says what it checked");

    let from_s3 = t.path().join("from-s3.ext4");
    let from_local = t.path().join("from-local.ext4");
    for (store, file) in [(s3.as_str(), &from_s3), (local, &from_local)] {
        ok(
            kiln(
                store,
                &host_b,
                &["export", "app:1", "--format", "ext4", "-o"],
            )
            .arg(file),
            "kiln export --format ext4",
        );
    }
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&from_s3)
        .output()
        .expect("e2fsck");
    assert!(
        fsck.status.success(),
        "e2fsck -fn of the image exported from S3: {}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    kiln_tests::assert_same_bytes(&from_s3, &from_local);

    // Another host: every step a cache hit from the store, the image reused.
    let host_c = t.path().join("host-c");
    let second = built(&ok(
        kiln(&s3, &host_c, &["--json"]).args(build),
        "kiln build on another host",
    ));
    assert_eq!(second["manifest"], first["manifest"], "{second}");
    assert_eq!(second["stepsRun"], 0, "{second}");
    assert_eq!(second["stepsCached"], 2, "{second}");
    assert_eq!(second["imageReused"], true, "{second}");

    // And another: a FROM of the image built into the store, offline, finds it there.
    let child = context(
        &t.path().join("child"),
        "FROM app:1\nRUN cat /hi /app/data.txt\n",
    );
    let host_d = t.path().join("host-d");
    let third = built(&ok(
        kiln(
            &s3,
            &host_d,
            &["--json", "build", "--offline", "-t", "child:1"],
        )
        .arg(&child)
        .args(["--build-arg", EPOCH]),
        "kiln build --offline FROM the image in S3 on a fourth host",
    ));
    assert_eq!(third["stepsRun"], 1, "{third}");
}

/// Issue 19: `kiln pull`, `push`, `import`, `export --format oci` and `unpack` refused an S3
/// store. Now what `kiln pull` and `kiln import` put into an S3 store is there for another
/// host: `kiln unpack --offline` there gives the same tree, `kiln export` an OCI layout with
/// the same manifest, and `kiln push` uploads it to a registry.
#[test]
fn image_commands_work_against_s3_across_hosts() {
    let reference = require_env("KILN_TEST_BUSYBOX_REF");
    let layout = require_env("KILN_TEST_BUSYBOX_OCI");
    let registry = require_env("KILN_TEST_REGISTRY");
    let t = tempfile::tempdir().expect("tempdir");
    let s3 = s3_url("images");
    let (host_a, host_b) = (t.path().join("host-a"), t.path().join("host-b"));

    let pulled = last_line(&ok(
        kiln(&s3, &host_a, &["pull", &reference]),
        "kiln pull into S3",
    ));
    let imported = last_line(&ok(
        kiln(
            &s3,
            &host_a,
            &[
                "import",
                &format!("oci:{layout}:latest"),
                "-t",
                "local/busybox:imported",
            ],
        ),
        "kiln import into S3",
    ));
    assert!(pulled.starts_with("sha256:") && imported.starts_with("sha256:"));

    let mut trees = Vec::new();
    for name in [reference.as_str(), "local/busybox:imported"] {
        let dir = t.path().join(format!("tree-{}", trees.len()));
        ok(
            kiln(&s3, &host_b, &["unpack", "--offline", name]).arg(&dir),
            "kiln unpack --offline from S3 on another host",
        );
        trees.push(kiln_tests::tree_listing(&dir));
    }
    assert!(!trees[0].is_empty());
    assert_eq!(trees[0], trees[1], "the pulled and the imported busybox");

    let out = t.path().join("layout");
    let exported = last_line(&ok(
        kiln(
            &s3,
            &host_b,
            &["export", &reference, "--format", "oci", "-o"],
        )
        .arg(&out),
        "kiln export --format oci from S3",
    ));
    assert_eq!(exported, pulled);
    assert!(out.join("index.json").is_file());

    let host_c = t.path().join("host-c");
    let target = format!("{registry}/s3-push/busybox:{}", std::process::id());
    let pushed = last_line(&ok(
        kiln(&s3, &host_c, &["push", &reference, &target]),
        "kiln push from S3",
    ));
    assert_eq!(pushed, pulled, "manifest bytes kept");
}

/// A one-shot HTTP server on 127.0.0.1 whose one answer waits for the test: a build step
/// that fetches from it (`RUN --network=host wget`) is held inside the step until
/// [`Gate::open`], so another writer can move the tag meanwhile, in order and without timing.
struct Gate {
    port: u16,
    conn: std::sync::mpsc::Receiver<std::net::TcpStream>,
}

impl Gate {
    fn start() -> Gate {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let (tx, conn) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            if let Ok((s, _)) = l.accept() {
                let _ = tx.send(s);
            }
        });
        Gate { port, conn }
    }

    /// Blocks until the step has connected, returning the connection.
    fn reached(&self) -> std::net::TcpStream {
        self.conn.recv().expect("the build step connected")
    }

    /// Answers the step, letting it end.
    fn open(mut s: std::net::TcpStream) {
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n");
    }
}

/// Two builds race for one tag. Before, publish moved the tags whatever they held
/// (`force_tag`), so the build that finished last silently replaced the other's image. Now
/// each build moves its tags by compare-and-swap against what they named when it started:
/// the build that finishes first wins, the overtaken one moves nothing, exits 4 and names
/// the tag, the digest it expected (absent) and the one it found (the winner's).
fn overtaken_build_reports_the_lost_race(store: &str, t: &Path) {
    need_root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let gate = Gate::start();
    let slow = context(
        &t.join("slow"),
        &format!(
            "FROM {bb}\nRUN --network=host wget -q -O /got http://127.0.0.1:{}/\n",
            gate.port
        ),
    );
    let fast = context(&t.join("fast"), &format!("FROM {bb}\nRUN echo a > /a\n"));
    let host_a = t.join("host-a");
    let host_b = t.join("host-b");
    let tag = "race:1";
    let loser = kiln(
        store,
        &host_a,
        &["build", "--allow", "network.host", "-t", tag],
    )
    .args(["--progress=plain", "--build-arg", EPOCH])
    .arg(&slow)
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("start the slow build");
    let held = gate.reached();
    let winner = last_line(&ok(
        kiln(store, &host_b, &["build", "-t", tag, "--build-arg", EPOCH]).arg(&fast),
        "the fast build",
    ));
    Gate::open(held);
    let o: Output = loser.wait_with_output().expect("the slow build ends");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "lost race exits 4: {stderr}");
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("kiln: "))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    assert!(
        line.contains(tag) && line.contains("expected absent") && line.contains(&winner),
        "{line}"
    );
    let tags = ok(kiln(store, &host_b, &["tags"]), "kiln tags");
    assert!(
        tags.lines()
            .any(|l| l.contains("race") && l.contains(&winner)),
        "the winner's tag stays: {tags}"
    );
}

#[test]
fn overtaken_build_reports_the_lost_race_local() {
    let t = tempfile::tempdir().expect("tempdir");
    let store = t.path().join("store");
    overtaken_build_reports_the_lost_race(store.to_str().expect("utf-8"), t.path());
}

#[test]
fn overtaken_build_reports_the_lost_race_s3() {
    let t = tempfile::tempdir().expect("tempdir");
    overtaken_build_reports_the_lost_race(&s3_url("race"), t.path());
}
