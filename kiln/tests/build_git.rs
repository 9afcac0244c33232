//! Issue 41: `ADD <git url>` through `kiln build`: the commit the ref resolved to is the
//! step's cache key, so the same build again is a hit, a moved branch a miss, and a pinned
//! commit stays a hit. A real repository served over git's "dumb" HTTP on 127.0.0.1
//! (`--egress-allow-private-for-tests`), `FROM scratch`. Needs root (build).

use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@e.test"])
        .args(["-c", "init.defaultBranch=main"])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .expect("run git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `kiln build` of a context whose Dockerfile adds `src`; whether the ADD step was cached,
/// and the image digest.
fn build(dir: &Path, src: &str) -> (bool, String) {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        format!("FROM scratch\nADD {src} /src\n"),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", dir.join("store"))
        .env("TMPDIR", dir)
        .arg("build")
        .arg(&ctx)
        .args(["--progress", "plain", "--egress-allow-private-for-tests"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let cached = stderr
        .lines()
        .any(|l| l.contains(&format!("ADD {src} /src")) && l.contains("CACHED"));
    let digest = String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    (cached, digest)
}

#[test]
fn add_git_is_keyed_by_the_commit() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().unwrap();
    let work = t.path().join("work");
    std::fs::create_dir(&work).unwrap();
    git(&work, &["init", "-q"]);
    std::fs::write(work.join("a.txt"), "one").unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "one"]);
    let c1 = git(&work, &["rev-parse", "HEAD"]);
    let srv = t.path().join("srv");
    std::fs::create_dir(&srv).unwrap();
    let bare = srv.join("r.git");
    git(
        t.path(),
        &[
            "clone",
            "-q",
            "--bare",
            work.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    );
    git(&bare, &["update-server-info"]);
    let server = kiln_tests::http::LocalServer::serve_dir(&srv);
    let base = format!("http://127.0.0.1:{}/r.git", server.port);
    let move_main = |text: &str| {
        std::fs::write(work.join("a.txt"), text).unwrap();
        git(&work, &["commit", "-q", "-am", text]);
        git(&work, &["push", "-q", bare.to_str().unwrap(), "main"]);
        git(&bare, &["update-server-info"]);
    };

    let branch = format!("{base}#main");
    let (hit, d1) = build(t.path(), &branch);
    assert!(!hit, "the first build runs the step");
    let (hit, d2) = build(t.path(), &branch);
    assert!(hit, "the same commit again is a hit");
    assert_eq!(d1, d2);
    move_main("two");
    let (hit, d3) = build(t.path(), &branch);
    assert!(!hit, "a moved branch is a miss");
    assert_ne!(d3, d1);

    let pinned = format!("{base}#{c1}");
    let (_, p1) = build(t.path(), &pinned);
    move_main("three");
    let (hit, p2) = build(t.path(), &pinned);
    assert!(hit, "a pinned commit stays a hit when the branch moves");
    assert_eq!(p1, p2);
}
