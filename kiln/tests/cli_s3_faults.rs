//! The `kiln` binary against an S3 server that misbehaves (issue 17, "Faults the store and the
//! builder must survive", fault 4): a server that stops answering mid-push (moto behind the
//! TCP fault injector of `kiln_tests::fault_proxy`, which stalls every connection from a
//! chosen point of the upload on, as a `kill -STOP` of the server does), and a bucket that
//! does not exist. Needs the S3 server of `ci/setup.sh` (`source /var/cache/kiln-ci/env`).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kiln_tests::fault_proxy::{Fault, FaultProxy};
use serde_json::Value;

fn kiln(store: &Path, env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.args(args).env("KILN_STORE", store);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn json_lines(o: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

fn s3_url(label: &str) -> String {
    let bucket = kiln_tests::stores::env("KILN_TEST_S3_BUCKET");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("s3://{bucket}/cli-{}-{nanos}-{label}", std::process::id())
}

/// A local store holding `img:v1`: 3 MiB of data and a 1 MiB hole.
fn local_image(dir: &Path) -> std::path::PathBuf {
    let store = dir.join("store");
    let file = dir.join("a.img");
    let mut bytes = kiln_tests::stores::test_bytes(41, 2 << 20);
    bytes.extend(std::iter::repeat_n(0u8, 1 << 20));
    bytes.extend(kiln_tests::stores::test_bytes(42, 1 << 20));
    std::fs::write(&file, &bytes).unwrap();
    let o = kiln(
        &store,
        &[],
        &["store", "import", file.to_str().unwrap(), "img:v1"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    store
}

/// The `kiln: ...` line a failed command ends with on stderr.
fn error_line(stderr: &str) -> &str {
    stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("kiln: "))
        .unwrap_or_else(|| panic!("no `kiln:` error line in {stderr}"))
}

/// Issue 17, fault 4: with the S3 server stopped mid-push, `kiln store push` printed nothing
/// for over 150 s (a 30 s request timeout, 6 attempts and backoff). Now every retry is a
/// warning on stderr and a `retry` event with `--json`, each naming the store, the key, the
/// attempt and the wait, and the command gives up within the configured bound on one store
/// operation (`KILN_STORE_TIMEOUT_SECS`, here 4 s with 1 s requests), saying so, with the
/// operation and the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_s3_server_is_retried_visibly_and_given_up_within_the_bound() {
    let proxy = FaultProxy::start(&kiln_tests::stores::s3_host_port())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = local_image(dir.path());
    let s3 = s3_url("hung");
    // From 300 kB into the upload on, every read from any connection stalls it for longer
    // than the test runs: the server has stopped answering, and stays stopped.
    proxy.arm((0..100_000).map(|i| (300_000 + i, Fault::Stall(Duration::from_secs(600)))));
    let bound_secs = 4;
    let endpoint = proxy.url();
    let env = [
        ("KILN_S3_ENDPOINT", endpoint.as_str()),
        ("KILN_S3_ALLOW_HTTP", "true"),
        ("KILN_STORE_TIMEOUT_SECS", "4"),
        ("KILN_S3_REQUEST_TIMEOUT_SECS", "1"),
    ];
    let mut cmd = tokio::process::Command::from(kiln(
        &store,
        &env,
        &["--json", "store", "push", "img:v1", "--to", &s3],
    ));
    cmd.kill_on_drop(true);
    let t = Instant::now();
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Well past the bound, well short of the old 150 s of silence.
    let limit = Duration::from_secs(30);
    let o = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "kiln store push still running {limit:?} after it started, with the server \
                 hung and a {bound_secs} s bound (stall fired {} times)",
                proxy.fired()
            )
        })
        .unwrap();
    let took = t.elapsed();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(proxy.fired() >= 1, "the stall never fired: {stderr}");
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    // (b) within the bound: the first operation to hang gives up at 4 s; the rest is the
    // push before the stall, and starting the process.
    assert!(
        took < Duration::from_secs(bound_secs + 6),
        "took {took:?}: {stderr}"
    );

    // (a) one warning per retry on stderr, and the same retries as JSON events.
    let events = json_lines(&o);
    let retries: Vec<&Value> = events.iter().filter(|e| e["event"] == "retry").collect();
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("retrying in"))
        .collect();
    assert!(!retries.is_empty(), "no retry event: {events:?}\n{stderr}");
    assert_eq!(retries.len(), warnings.len(), "{events:?}\n{stderr}");
    for r in &retries {
        assert_eq!(r["store"], s3.as_str(), "{r}");
        assert_eq!(r["maxAttempts"], 6, "{r}");
        assert_eq!(r["boundMs"], bound_secs * 1000, "{r}");
        let (op, key) = (r["op"].as_str().unwrap(), r["key"].as_str().unwrap());
        let attempt = r["attempt"].as_u64().unwrap();
        let wait = r["waitMs"].as_u64().unwrap();
        assert!(
            (1..6).contains(&attempt) && wait > 0 && !op.is_empty() && key.contains('/'),
            "{r}"
        );
        let line = format!("{s3}: {op} {key}: attempt {attempt} of 6 failed after ");
        assert!(
            warnings
                .iter()
                .any(|w| w.contains(&line) && w.contains("retrying in")),
            "no warning {line:?} in {stderr}"
        );
    }

    // The error: one line, giving up after N attempts because the bound ran out, naming the
    // operation and the key.
    let line = error_line(&stderr);
    let rest = line
        .strip_prefix(&format!("kiln: {s3}: "))
        .unwrap_or_else(|| panic!("{line}"));
    let mut words = rest.split(' ');
    let (op, key) = (words.next().unwrap(), words.next().unwrap());
    assert!(
        [
            "put_if_absent",
            "stage_if_absent",
            // Issue 33: an S3 push sends its chunks in packs, the last one at the commit.
            "flush_staged",
            "packed_present",
            "put_file_if_absent",
            "put",
            "head",
            "get",
            "compare_and_swap",
            "list"
        ]
        .contains(&op)
            && key.ends_with(':')
            && key.contains('/'),
        "{line}"
    );
    assert!(
        rest.contains(": gave up after ")
            && rest.contains(" attempt")
            && rest.contains("the 4s bound on one store operation ran out"),
        "{line}"
    );
    let error = events.iter().find(|e| e["event"] == "error").unwrap();
    assert_eq!(
        error["message"].as_str().unwrap(),
        line.trim_start_matches("kiln: ")
    );
}

/// Issue 17, fault 4: a missing bucket printed the server's raw XML (a list, which object_store
/// reports as a generic error with the response body). Every S3 error is one line that names
/// the bucket, the key and S3's error code.
#[test]
fn s3_errors_are_one_line_naming_bucket_key_and_code() {
    let dir = tempfile::tempdir().unwrap();
    let store = local_image(dir.path());
    let missing = "s3://kiln-no-such-bucket/x";
    for args in [
        &["tags", "--store", missing][..],
        &["store", "gc", "--grace", "0s", "--store", missing][..],
        &["store", "push", "img:v1", "--to", missing][..],
    ] {
        let o = kiln(&store, &[], args).output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {stderr}");
        let line = error_line(&stderr);
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            line.starts_with(&format!("kiln: {missing}: "))
                && line.contains("S3 NoSuchBucket, bucket kiln-no-such-bucket")
                && !line.contains('<'),
            "{args:?}: {line}"
        );
        // The key (or listed prefix) follows the operation.
        let rest = &line[format!("kiln: {missing}: ").len()..];
        let key = rest.split(' ').nth(1).unwrap_or_default();
        assert!(key.contains('/'), "{args:?}: no key in {line}");
    }
}
