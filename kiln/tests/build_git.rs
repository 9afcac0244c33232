//! Issue 41: `ADD <git url>` through `kiln build`: the commit the ref resolved to is the
//! step's cache key, so the same build again is a hit, a moved branch a miss, and a pinned
//! commit stays a hit. A real repository served over git's "dumb" HTTP on 127.0.0.1
//! (`--egress-allow-private-for-tests`), `FROM scratch`; over ssh, the same repository
//! through a real `sshd` of the test's own and `kiln build --ssh default`. Needs root
//! (build).

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

/// `kiln build` of a context whose Dockerfile adds `src`, with `flags` and
/// `SSH_AUTH_SOCK` = `agent` (unset when `None`); whether it succeeded and its stderr, and
/// stdout.
fn try_build(
    dir: &Path,
    src: &str,
    flags: &[&str],
    agent: Option<&Path>,
) -> (bool, String, String) {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        format!("FROM scratch\nADD {src} /src\n"),
    )
    .unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_STORE", dir.join("store"))
        .env("TMPDIR", dir)
        .arg("build")
        .arg(&ctx)
        .args(["--progress", "plain", "--egress-allow-private-for-tests"])
        .args(flags);
    match agent {
        Some(a) => c.env("SSH_AUTH_SOCK", a),
        None => c.env_remove("SSH_AUTH_SOCK"),
    };
    let o = c.output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

/// [`try_build`] that must succeed: whether the ADD step was cached, and the image digest.
fn build_with(dir: &Path, src: &str, flags: &[&str], agent: Option<&Path>) -> (bool, String) {
    let (ok, stderr, stdout) = try_build(dir, src, flags, agent);
    assert!(ok, "{stderr}");
    let cached = stderr
        .lines()
        .any(|l| l.contains(&format!("ADD {src} /src")) && l.contains("CACHED"));
    let digest = stdout.lines().last().unwrap_or_default().to_string();
    (cached, digest)
}

fn build(dir: &Path, src: &str) -> (bool, String) {
    build_with(dir, src, &[], None)
}

/// A repository with one commit (`a.txt` = "one") in `dir/work`, cloned bare to
/// `dir/srv/r.git`; the work tree, the bare repository and the commit.
fn repository(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, String) {
    let work = dir.join("work");
    std::fs::create_dir(&work).unwrap();
    git(&work, &["init", "-q"]);
    std::fs::write(work.join("a.txt"), "one").unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "one"]);
    let c1 = git(&work, &["rev-parse", "HEAD"]);
    let srv = dir.join("srv");
    std::fs::create_dir(&srv).unwrap();
    let bare = srv.join("r.git");
    git(
        dir,
        &[
            "clone",
            "-q",
            "--bare",
            work.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    );
    git(&bare, &["update-server-info"]);
    (work, bare, c1)
}

#[test]
fn add_git_is_keyed_by_the_commit() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().unwrap();
    let (work, bare, c1) = repository(t.path());
    let srv = bare.parent().unwrap();
    let server = kiln_tests::http::LocalServer::serve_dir(srv);
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

/// Issue 41: `ADD ssh://…` with `kiln build --ssh default` fetches through the agent of
/// `$SSH_AUTH_SOCK` (a real `ssh-agent` and `sshd` on 127.0.0.1), keyed by the commit as
/// over http: the same build again is a hit, a moved branch a miss. Without `--ssh default`
/// (no `--ssh`, or only another id) the build fails before anything runs, naming the
/// Dockerfile line and the flag.
#[test]
fn add_git_over_ssh_needs_dash_dash_ssh_default() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().unwrap();
    let (work, bare, _) = repository(t.path());
    let keys = t.path().join("ssh");
    std::fs::create_dir(&keys).unwrap();
    let agent = kiln_tests::ssh::Agent::start(&keys);
    let sshd = kiln_tests::ssh::Sshd::start(&keys, &[&agent.public_key]);
    let src = format!("ssh://root@127.0.0.1:{}{}#main", sshd.port, bare.display());
    let ssh = ["--ssh", "default"];
    let (hit, d1) = build_with(t.path(), &src, &ssh, Some(&agent.socket));
    assert!(!hit, "the first build runs the step");
    assert!(
        sshd.logged().contains("Accepted publickey for root"),
        "{}",
        sshd.logged()
    );
    let (hit, d2) = build_with(t.path(), &src, &ssh, Some(&agent.socket));
    assert!(hit, "the same commit again is a hit");
    assert_eq!(d1, d2);
    std::fs::write(work.join("a.txt"), "two").unwrap();
    git(&work, &["commit", "-q", "-am", "two"]);
    git(&work, &["push", "-q", bare.to_str().unwrap(), "main"]);
    let (hit, d3) = build_with(t.path(), &src, &ssh, Some(&agent.socket));
    assert!(!hit, "a moved branch is a miss");
    assert_ne!(d3, d1);

    let connections = sshd.logged().matches("Connection from").count();
    assert!(
        connections > 0,
        "sshd logs its connections: {}",
        sshd.logged()
    );
    let other = format!("other={}", agent.socket.display());
    for flags in [&[][..], &["--ssh", other.as_str()][..]] {
        for source in [src.clone(), format!("root@127.0.0.1:{}", bare.display())] {
            let (ok, stderr, _) = try_build(t.path(), &source, flags, Some(&agent.socket));
            assert!(!ok, "{flags:?} {source}: {stderr}");
            assert!(
                stderr.contains(&format!(
                    "Dockerfile:2: ADD {source}: git over ssh needs an SSH agent: pass `kiln \
                     build --ssh default`"
                )),
                "{flags:?} {source}: {stderr}"
            );
        }
    }
    assert_eq!(
        sshd.logged().matches("Connection from").count(),
        connections,
        "refused before anything connected"
    );
}
