//! The README's main job, end to end: the command in README.md's "main job" block, run as
//! written from the repository root on a clean store, must print an image manifest digest as
//! its last line; the image must be in the store, pass `kiln inspect --fsck` (e2fsck -fn) and
//! have a chunk table and the recorded ext4 file system; `kiln store push` to the S3 test
//! server and `kiln store pull` into an empty local store must reproduce the same ext4 bytes
//! (compared byte for byte). Needs root, the packages of `ci/setup.sh` and its S3 server (`source
//! /var/cache/kiln-ci/env`), and the package archives.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The shell command of README.md's main-job block: the first fenced block after the
/// `<!-- main job` marker.
fn main_job_command() -> String {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let at = readme
        .find("<!-- main job")
        .expect("README.md has no `<!-- main job` marker before its main-job command");
    let rest = &readme[at..];
    let open = rest
        .find("```sh\n")
        .expect("no ```sh block after the marker")
        + 6;
    let close = rest[open..].find("```").unwrap();
    let cmd = rest[open..open + close].trim().to_string();
    assert!(
        !cmd.is_empty() && cmd.lines().count() == 1,
        "one command: {cmd:?}"
    );
    cmd
}

fn kiln(store: &Path, args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_STORE", store)
        .output()
        .unwrap();
    assert!(o.status.success(), "kiln {args:?}: {o:?}");
    o
}

#[test]
fn readme_main_job_builds_a_checked_image_that_survives_s3() {
    let bucket = std::env::var("KILN_TEST_S3_BUCKET").unwrap_or_else(|_| {
        panic!("KILN_TEST_S3_BUCKET is not set: run ci/setup.sh and source /var/cache/kiln-ci/env")
    });
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let cmd = main_job_command();
    let o = Command::new("bash")
        .args(["-c", &cmd])
        .current_dir(repo_root())
        .env("KILN_STORE", &store)
        // This test's kiln: `cargo build` from inside `cargo test` would rebuild with other
        // features for minutes; everything else runs as written.
        .env("KILN_BIN", env!("CARGO_BIN_EXE_kiln"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "`{cmd}` failed: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    // Its timing line, for the test log.
    let stderr = String::from_utf8_lossy(&o.stderr);
    for l in stderr.lines().filter(|l| l.starts_with("main-job:")) {
        eprintln!("{l}");
    }
    let stdout = String::from_utf8_lossy(&o.stdout);
    let digest = stdout.lines().last().unwrap_or("").trim().to_string();
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "last line is not a digest: {stdout}"
    );

    // The image is in the clean store, tagged, checked, with its chunk table.
    let o = kiln(&store, &["--json", "images"]);
    let images: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let img = images
        .iter()
        .find(|i| i["manifest"] == digest.as_str())
        .unwrap_or_else(|| panic!("{digest} is not tagged: {images:?}"));
    let tag = format!(
        "{}:{}",
        img["name"].as_str().unwrap(),
        img["tag"].as_str().unwrap()
    );
    let o = kiln(&store, &["--json", "inspect", &digest, "--fsck"]);
    let i: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(i["fsck"]["clean"], true, "{i}");
    assert_eq!(i["size"], 3072u64 << 20, "disk_mib 3072");
    assert!(i["chunkTable"]["chunks"].as_u64().unwrap() > 100, "{i}");
    assert_eq!(i["filesystem"]["kind"], "ext4", "{i}");
    assert_eq!(i["config"]["User"], "runtime", "{i}");

    // Push to S3, pull into an empty store: the same ext4 bytes.
    let built = dir.path().join("built.ext4");
    kiln(&store, &["store", "export", &tag, built.to_str().unwrap()]);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let s3 = format!(
        "s3://{bucket}/readme-main-job-{}-{nanos}",
        std::process::id()
    );
    kiln(&store, &["store", "push", &tag, "--to", &s3]);
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    kiln(&empty, &["store", "pull", &tag, "--from", &s3]);
    let pulled = dir.path().join("pulled.ext4");
    kiln(&empty, &["store", "export", &tag, pulled.to_str().unwrap()]);
    kiln_tests::assert_same_bytes(&built, &pulled);
    let o = kiln(&empty, &["--json", "inspect", &tag]);
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        j["manifest"],
        digest.as_str(),
        "same manifest after the round trip"
    );
}
