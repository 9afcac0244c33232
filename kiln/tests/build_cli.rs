//! `kiln build` end to end on the busybox fixture (as root): the digest as the last stdout
//! line, `--iidfile`, `--metadata-file`, tags that `kiln export --format oci` finds and that
//! skopeo and umoci accept; a failing build tags nothing; SIGTERM cancels and leaves no
//! process and no mount.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use kiln_tests::require_env;

fn kiln(store: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_STORE", store);
    c
}

fn setup(dockerfile: &str) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = t.path().join("ctx");
    std::fs::create_dir(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), dockerfile).expect("write");
    let store = t.path().join("store");
    (t, ctx, store)
}

#[test]
fn build_tag_export_skopeo_umoci() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, ctx, store) = setup(&format!(
        "FROM {bb}\nRUN echo hi > /hi && rm /bin/vi\nWORKDIR /app\nCMD [\"cat\", \"/hi\"]\n"
    ));
    let iid = t.path().join("iid");
    let meta = t.path().join("meta.json");
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "demo:1", "--progress", "plain", "--iidfile"])
        .arg(&iid)
        .arg("--metadata-file")
        .arg(&meta)
        .output()
        .expect("run kiln");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let digest = stdout.lines().last().expect("a line").to_string();
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{stdout}"
    );
    // stdout: the kiln image manifest; --iidfile: the OCI manifest, as buildx.
    let oci = std::fs::read_to_string(&iid).expect("iid");
    assert!(oci.starts_with("sha256:") && oci != digest, "{oci}");
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta).expect("meta")).expect("json");
    assert_eq!(m["containerimage.digest"], oci.as_str());
    assert_eq!(m["kiln.image.manifest"], digest.as_str());
    assert!(stderr.contains("Dockerfile:2 RUN"), "{stderr}");

    let layout = t.path().join("layout");
    let out = kiln(&store)
        .args(["export", "demo:1", "--format", "oci", "-o"])
        .arg(&layout)
        .output()
        .expect("run kiln export");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("skopeo")
        .args(["inspect", &format!("oci:{}:1", layout.display())])
        .output()
        .expect("skopeo missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["Digest"], oci.as_str());
    let bundle = t.path().join("bundle");
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:1", layout.display()))
        .arg(&bundle)
        .output()
        .expect("umoci missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(bundle.join("rootfs/hi")).expect("hi"),
        "hi\n"
    );
    assert!(!bundle.join("rootfs/bin/vi").exists());
    assert!(bundle.join("rootfs/app").is_dir());
    assert_eq!(
        std::fs::read_to_string(bundle.join("rootfs/etc/hostname")).expect("hostname"),
        "runtime-guest\n"
    );

    // The checked ext4 image is in the store under the tag.
    let ext4 = t.path().join("rootfs.ext4");
    let out = kiln(&store)
        .args(["export", "demo:1", "--format", "ext4", "-o"])
        .arg(&ext4)
        .output()
        .expect("run kiln export");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().last(),
        Some(digest.as_str())
    );
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(&ext4)
        .output()
        .expect("e2fsck missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Same build again: all cached, same digest.
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "demo:2"])
        .output()
        .expect("run kiln");
    assert!(out.status.success());
    let again = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(again.lines().last(), Some(digest.as_str()));
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 steps run"));
}

#[test]
fn failing_build_tags_nothing() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (_t, ctx, store) = setup(&format!("FROM {bb}\nRUN echo doomed; exit 7\n"));
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "doomed:1"])
        .output()
        .expect("run kiln");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Dockerfile:2: RUN"), "{stderr}");
    assert!(
        stderr.contains("exited with code 7") && stderr.contains("  doomed"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    let out = kiln(&store)
        .args(["export", "doomed:1", "-o", "/nonexistent-kiln-test"])
        .output()
        .expect("run kiln export");
    assert!(!out.status.success(), "nothing was tagged");
}

#[test]
fn sigterm_cancels_and_leaves_nothing() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let marker = 700_000 + std::process::id() % 100_000;
    let (t, ctx, store) = setup(&format!("FROM {bb}\nRUN echo started; sleep {marker}\n"));
    let mut child = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "cancelled:1", "--progress", "plain", "--oci-only"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let l = lines
            .next()
            .expect("kiln ended before the step started")
            .expect("read");
        if l.ends_with(" started") {
            break;
        }
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .expect("kill");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("wait");
    assert!(!status.success());
    assert!(rest.iter().any(|l| l.contains("cancel")), "{rest:?}");
    // No process of the step, no mount under the test directory, nothing tagged.
    let needle = format!("sleep\0{marker}");
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            assert!(
                !String::from_utf8_lossy(&c).contains(&needle),
                "step process left: {:?}",
                e.path()
            );
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(
        !mounts.contains(t.path().to_str().expect("utf-8")),
        "{mounts}"
    );
    let out = kiln(&store)
        .args(["export", "cancelled:1", "-o", "/nonexistent-kiln-test"])
        .output()
        .expect("run kiln export");
    assert!(!out.status.success(), "nothing was tagged");
}
