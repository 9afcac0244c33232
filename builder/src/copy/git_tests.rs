//! `ADD <git url>` against a real git repository served over HTTP on 127.0.0.1 (git's
//! "dumb" HTTP from a static file server, after `git update-server-info`), fetched with the
//! host's `git` and copied by [`copy_into`]. Root needed for owners, as CI runs the suite.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{CopySource, CopyStep};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use super::fetch::{FetchError, FetchOptions, fetch_urls};
use super::*;

/// Commit times of the fixture's commits (fixed, so the mtimes are known).
const T1: i64 = 1_700_000_000;
const T2: i64 = 1_700_086_400;

fn git(dir: &Path, args: &[&str], time: i64) -> String {
    let out = Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@e.test"])
        .args([
            "-c",
            "init.defaultBranch=main",
            "-c",
            "core.hooksPath=/dev/null",
        ])
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_DATE", format!("@{time} +0000"))
        .env("GIT_COMMITTER_DATE", format!("@{time} +0000"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A repository served over HTTP: commit 1 (tagged `v1`, annotated) has `a.txt` = "one",
/// `bin/run.sh` (executable), `sub/inner/x.txt`, a symlink `link -> a.txt`, a submodule
/// `evil` whose `.gitmodules` URL is a local path (`/etc`); commit 2 (`main`) changes `a.txt` to "two"; branch
/// `old` stays at commit 1.
struct Served {
    _t: tempfile::TempDir,
    base: String,
    work: PathBuf,
    bare: PathBuf,
    c1: String,
    c2: String,
    ctx: PathBuf,
    dest: PathBuf,
    dl: PathBuf,
    _server: kiln_tests::http::LocalServer,
}

fn served() -> Served {
    assert!(
        rustix::process::geteuid().is_root(),
        "the copy tests need root (owners); CI runs them as root"
    );
    let t = tempfile::tempdir().unwrap();
    let work = t.path().join("work");
    fs::create_dir_all(work.join("bin")).unwrap();
    fs::create_dir_all(work.join("sub/inner")).unwrap();
    git(&work, &["init", "-q"], T1);
    fs::write(work.join("a.txt"), "one").unwrap();
    fs::write(work.join("bin/run.sh"), "#!/bin/sh\n").unwrap();
    fs::set_permissions(work.join("bin/run.sh"), fs::Permissions::from_mode(0o775)).unwrap();
    fs::write(work.join("sub/inner/x.txt"), "x").unwrap();
    // 64 KiB that do not compress: past the size bound of the bounded test.
    let mut big = vec![0; 65536];
    StdRng::seed_from_u64(1).fill_bytes(&mut big);
    fs::write(work.join("big.bin"), big).unwrap();
    symlink("a.txt", work.join("link")).unwrap();
    fs::write(
        work.join(".gitmodules"),
        "[submodule \"evil\"]\n\tpath = evil\n\turl = /etc\n",
    )
    .unwrap();
    git(&work, &["add", "-A"], T1);
    // A submodule (a gitlink at `evil`) whose URL is a local path.
    git(
        &work,
        &[
            "update-index",
            "--add",
            "--cacheinfo",
            "160000,0123456789abcdef0123456789abcdef01234567,evil",
        ],
        T1,
    );
    // An unpopulated submodule's empty directory (else `commit -a` would drop the gitlink).
    fs::create_dir(work.join("evil")).unwrap();
    git(&work, &["commit", "-q", "-m", "one"], T1);
    let c1 = git(&work, &["rev-parse", "HEAD"], T1);
    git(&work, &["tag", "-a", "-m", "v1", "v1"], T1);
    git(&work, &["branch", "old"], T1);
    fs::write(work.join("a.txt"), "two").unwrap();
    git(&work, &["commit", "-q", "-am", "two"], T2);
    let c2 = git(&work, &["rev-parse", "HEAD"], T2);
    let srv = t.path().join("srv");
    fs::create_dir(&srv).unwrap();
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
        T2,
    );
    git(&bare, &["update-server-info"], T2);
    let server = kiln_tests::http::LocalServer::serve_dir(&srv);
    let [ctx, dest, dl] = ["ctx", "dest", "dl"].map(|n| {
        let p = t.path().join(n);
        fs::create_dir(&p).unwrap();
        p
    });
    Served {
        base: format!("http://127.0.0.1:{}/r.git", server.port),
        _t: t,
        work,
        bare,
        c1,
        c2,
        ctx,
        dest,
        dl,
        _server: server,
    }
}

impl Served {
    /// A fresh download directory.
    fn dl(&self) -> PathBuf {
        let d = self
            .dl
            .join(format!("{}", fs::read_dir(&self.dl).unwrap().count()));
        fs::create_dir(&d).unwrap();
        d
    }

    /// Pushes `main` one commit on (a moved branch).
    fn move_main(&self) -> String {
        fs::write(self.work.join("a.txt"), "three").unwrap();
        git(&self.work, &["commit", "-q", "-am", "three"], T2 + 1);
        let b = self.bare.to_str().unwrap();
        git(&self.work, &["push", "-q", b, "main"], T2 + 1);
        git(&self.bare, &["update-server-info"], T2 + 1);
        git(&self.work, &["rev-parse", "HEAD"], T2)
    }
}

fn allow() -> FetchOptions {
    FetchOptions {
        addresses: crate::egress::address::AddressPolicy {
            allow_private_addresses: true,
            ..Default::default()
        },
        timeout: std::time::Duration::from_secs(60),
        ..FetchOptions::default()
    }
}

fn git_step(url: &str, dest: &str) -> CopyStep {
    CopyStep {
        sources: vec![CopySource::Git { url: url.into() }],
        dest: dest.into(),
        from: None,
        chown: None,
        chmod: None,
        link: false,
        parents: false,
        exclude: vec![],
        checksum: None,
        unpack: false,
        keep_git_dir: false,
    }
}

/// Fetches and copies `s`; the sources (for digests) and the copy's result.
async fn add(sv: &Served, s: &CopyStep, opts: &FetchOptions) -> Result<Sources, FetchError> {
    let downloads = fetch_urls(s, &sv.dl(), opts).await?;
    // A .dockerignore of the context does not apply to the checkout.
    let ig = Dockerignore::parse(".dockerignore", b"*.txt\n").unwrap();
    let src = Sources::context(&sv.ctx, ig).with_downloads(downloads);
    copy_into(s, &src, &sv.dest, &CopyOptions::default()).unwrap();
    Ok(src)
}

fn read(sv: &Served, p: &str) -> String {
    fs::read_to_string(sv.dest.join(p)).unwrap()
}

#[tokio::test]
async fn add_git_branch_with_metadata_and_cache_key() {
    let sv = served();
    let s = git_step(&format!("{}#main", sv.base), "/src");
    let src = add(&sv, &s, &allow()).await.unwrap();
    assert_eq!(
        src.downloads
            .git(&format!("{}#main", sv.base))
            .unwrap()
            .commit,
        sv.c2
    );
    assert_eq!(read(&sv, "src/a.txt"), "two");
    assert_eq!(read(&sv, "src/sub/inner/x.txt"), "x");
    assert!(!sv.dest.join("src/.git").exists(), ".git is dropped");
    // Submodules are never fetched: the gitlink is the empty directory git checks out.
    assert_eq!(fs::read_dir(sv.dest.join("src/evil")).unwrap().count(), 0);
    assert!(sv.dest.join("src/.gitmodules").is_file());
    let m = |p: &str| fs::symlink_metadata(sv.dest.join(p)).unwrap();
    assert_eq!(
        fs::read_link(sv.dest.join("src/link")).unwrap(),
        Path::new("a.txt")
    );
    assert_eq!(m("src/a.txt").mode() & 0o7777, 0o644);
    assert_eq!(m("src/bin/run.sh").mode() & 0o7777, 0o755);
    assert_eq!(m("src/bin").mode() & 0o7777, 0o755);
    for p in ["src/a.txt", "src/bin", "src/link", "src/sub/inner/x.txt"] {
        assert_eq!((m(p).uid(), m(p).gid()), (0, 0), "{p}");
        assert_eq!(m(p).mtime(), T2, "{p}: the commit's time");
    }
    // No ref: the remote's HEAD, the same commit and key.
    let head = git_step(&sv.base, "/head/");
    let hsrc = add(&sv, &head, &allow()).await.unwrap();
    assert_eq!(read(&sv, "head/a.txt"), "two");
    // The cache key holds the commit: the branch moved is a new key.
    let k1 = sources_digest(&s, &src).unwrap();
    assert_eq!(sources_digest(&s, &src).unwrap(), k1);
    assert_ne!(
        sources_digest(&head, &hsrc).unwrap(),
        k1,
        "the URL is part of it"
    );
    let c3 = sv.move_main();
    let src3 = add(&sv, &s, &allow()).await.unwrap();
    assert_eq!(
        src3.downloads
            .git(&format!("{}#main", sv.base))
            .unwrap()
            .commit,
        c3
    );
    assert_ne!(
        sources_digest(&s, &src3).unwrap(),
        k1,
        "a moved branch is a miss"
    );
    assert_eq!(read(&sv, "src/a.txt"), "three");
    // --chown and --chmod apply as to a copied directory.
    let mut owned = git_step(&format!("{}#main", sv.base), "/owned");
    owned.chown = Some("1000:50".into());
    owned.chmod = Some("0640".into());
    add(&sv, &owned, &allow()).await.unwrap();
    let f = m("owned/a.txt");
    assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (1000, 50, 0o640));
}

#[tokio::test]
async fn add_git_tag_commit_and_pinned_key() {
    let sv = served();
    // An annotated tag resolves to its commit.
    let tag = git_step(&format!("{}#v1", sv.base), "/tag");
    let src = add(&sv, &tag, &allow()).await.unwrap();
    assert_eq!(read(&sv, "tag/a.txt"), "one");
    assert_eq!(
        src.downloads
            .git(&format!("{}#v1", sv.base))
            .unwrap()
            .commit,
        sv.c1
    );
    assert_eq!(fs::metadata(sv.dest.join("tag/a.txt")).unwrap().mtime(), T1);
    // A full commit id (a dumb HTTP server cannot serve one alone: fetched whole).
    let url = format!("{}#{}", sv.base, sv.c1);
    let pin = git_step(&url, "/pin");
    let psrc = add(&sv, &pin, &allow()).await.unwrap();
    assert_eq!(read(&sv, "pin/a.txt"), "one");
    let k = sources_digest(&pin, &psrc).unwrap();
    // The branch moves; the pinned commit keeps its key.
    sv.move_main();
    let again = add(&sv, &pin, &allow()).await.unwrap();
    assert_eq!(
        sources_digest(&pin, &again).unwrap(),
        k,
        "a pinned commit is a hit"
    );
    // A branch by name, not the default one.
    add(
        &sv,
        &git_step(&format!("{}#old", sv.base), "/old"),
        &allow(),
    )
    .await
    .unwrap();
    assert_eq!(read(&sv, "old/a.txt"), "one");
}

#[tokio::test]
async fn add_git_subdir_and_keep_git_dir() {
    let sv = served();
    add(
        &sv,
        &git_step(&format!("{}#main:sub", sv.base), "/s"),
        &allow(),
    )
    .await
    .unwrap();
    assert_eq!(read(&sv, "s/inner/x.txt"), "x");
    assert!(!sv.dest.join("s/a.txt").exists());
    // A subdirectory that is not there.
    let e = fetch_urls(
        &git_step(&format!("{}#main:nope", sv.base), "/n"),
        &sv.dl(),
        &allow(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("subdirectory 'nope'"), "{e}");
    // --keep-git-dir: a repository at the commit, on its branch.
    let mut keep = git_step(&format!("{}#main", sv.base), "/k");
    keep.keep_git_dir = true;
    add(&sv, &keep, &allow()).await.unwrap();
    let k = sv.dest.join("k");
    assert!(k.join(".git/HEAD").is_file());
    let head = Command::new("git")
        .args([
            "-c",
            "safe.directory=*",
            "rev-parse",
            "HEAD",
            "--abbrev-ref",
            "HEAD",
        ])
        .current_dir(&k)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&head.stdout);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [sv.c2.as_str(), "main"],
        "{out}"
    );
}

#[tokio::test]
async fn add_git_missing_ref_is_named() {
    let sv = served();
    let e = fetch_urls(
        &git_step(&format!("{}#nope", sv.base), "/x"),
        &sv.dl(),
        &allow(),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, FetchError::Git { .. }), "{e}");
    assert!(e.to_string().contains("ref 'nope' not found"), "{e}");
    let missing = "0123456789abcdef0123456789abcdef01234567";
    let e = fetch_urls(
        &git_step(&format!("{}#{missing}", sv.base), "/x"),
        &sv.dl(),
        &allow(),
    )
    .await
    .unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("commit {missing} not found")),
        "{e}"
    );
    // A repository that is not there.
    let gone = sv.base.replace("r.git", "gone.git");
    let e = fetch_urls(&git_step(&gone, "/x"), &sv.dl(), &allow())
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::Git { .. }), "{e}");
}

#[tokio::test]
async fn add_git_hostile_sources_are_refused() {
    let sv = served();
    let port = sv
        .base
        .split(':')
        .nth(2)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let marker = sv.dl.join("pwned");
    let m = marker.display();
    for (url, needle) in [
        (format!("ext::sh -c touch% {m}"), "transport 'ext::'"),
        (format!("file://{}", sv.bare.display()), "file://"),
        (
            format!("{}#--upload-pack=touch {m}", sv.base),
            "starts with '-'",
        ),
        (format!("{}#main:-x", sv.base), "starts with '-'"),
        (format!("{}#main:../..", sv.base), "'..'"),
        ("git@127.0.0.1:r.git".to_string(), "--ssh"),
        (format!("ssh://127.0.0.1:{port}/r.git"), "--ssh"),
    ] {
        let e = fetch_urls(&git_step(&url, "/x"), &sv.dl(), &allow())
            .await
            .unwrap_err();
        assert!(matches!(e, FetchError::BadUrl { .. }), "{url}: {e}");
        assert!(e.to_string().contains(needle), "{url}: {e}");
    }
    assert!(!marker.exists(), "nothing ran");
    // The build's address rules: the host's loopback is refused before git connects.
    let before = sv._server.seen.lock().unwrap().len();
    let e = fetch_urls(
        &git_step(&sv.base, "/x"),
        &sv.dl(),
        &FetchOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, FetchError::Forbidden { .. }), "{e}");
    assert_eq!(
        sv._server.seen.lock().unwrap().len(),
        before,
        "no request was made"
    );
    // A redirect is not followed (it would lead past the address check).
    let hop = redirecting(&sv.base);
    let e = fetch_urls(
        &git_step(&format!("http://127.0.0.1:{hop}/r.git"), "/x"),
        &sv.dl(),
        &allow(),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, FetchError::Git { .. }), "{e}");
    // The fetched size is bounded.
    let small = FetchOptions {
        max_bytes: 4096,
        ..allow()
    };
    let e = fetch_urls(&git_step(&sv.base, "/x"), &sv.dl(), &small)
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::TooLarge { .. }), "{e}");
    // --checksum is for URLs.
    let mut sum = git_step(&sv.base, "/x");
    sum.checksum = Some(format!("sha256:{}", "0".repeat(64)));
    let e = fetch_urls(&sum, &sv.dl(), &allow()).await.unwrap_err();
    assert!(
        e.to_string().contains("--checksum with a git source"),
        "{e}"
    );
}

/// A server on 127.0.0.1 answering every request with a redirect to `to` + its path; its
/// port.
fn redirecting(to: &str) -> u16 {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let to = to.trim_end_matches("/r.git").to_string();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let mut r = BufReader::new(c.try_clone().unwrap());
            let mut first = String::new();
            let _ = r.read_line(&mut first);
            let path = first.split(' ').nth(1).unwrap_or("/").to_string();
            let _ = write!(
                c,
                "HTTP/1.1 301 Moved\r\nLocation: {to}{path}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    port
}

/// A build-wide allow-list holds for `ADD <git url>` and `ADD <url>` alike: the name asked
/// for against the lists, then the address it resolved to against the deny ranges.
#[tokio::test]
async fn add_git_and_url_follow_the_allow_and_deny_lists() {
    let sv = served();
    let port = sv._server.port;
    let mut opts = allow();
    opts.addresses.hosts.insert(
        "git.test".into(),
        vec![std::net::Ipv4Addr::LOCALHOST.into()],
    );
    let git_url = format!("http://git.test:{port}/r.git#main");
    let mut file = git_step("", "/f");
    file.sources = vec![CopySource::Url {
        url: format!("http://git.test:{port}/r.git/HEAD"),
    }];
    let parse = |v: &[&str]| {
        v.iter()
            .map(|r| kiln_recipes::plan::EgressRule::parse(r).unwrap())
            .collect()
    };
    for (allow, deny, ok) in [
        (&["git.test"][..], &[][..], true),
        (&["*.test"], &[], true),
        (&["other.test"], &[], false),
        (&["git.test"], &["127.0.0.0/8"], false),
        (&["*.test"], &["git.test"], false),
    ] {
        opts.rules = Some(kiln_recipes::plan::Egress {
            allow: parse(allow),
            deny: parse(deny),
        });
        for s in [git_step(&git_url, "/x"), file.clone()] {
            let r = fetch_urls(&s, &sv.dl(), &opts).await;
            match (ok, r) {
                (true, Ok(_)) => {}
                (false, Err(e @ FetchError::NotAllowed { .. })) => {
                    assert!(e.to_string().contains("git.test is refused"), "{e}")
                }
                (_, r) => panic!("{allow:?} {deny:?} {:?}: {r:?}", s.sources),
            }
        }
    }
}

/// Over https, git trusts the build's extra CA certificates as `ADD <url>` does, and only
/// with them (`openssl s_server -WWW` serving the repository, under a name the hosts
/// setting maps to 127.0.0.1).
#[tokio::test]
async fn add_git_over_https_trusts_the_builds_ca_certificates() {
    let sv = served();
    let certs = sv.dl.join("certs");
    fs::create_dir(&certs).unwrap();
    kiln_tests::tls::make_certs(&certs, "git.test");
    let repo = certs.join("r.git");
    let out = Command::new("cp")
        .arg("-a")
        .arg(&sv.bare)
        .arg(&repo)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // A static server that keeps the query in the file name: git's first request.
    fs::copy(
        repo.join("info/refs"),
        repo.join("info/refs?service=git-upload-pack"),
    )
    .unwrap();
    let server = kiln_tests::tls::TlsServer::start(&certs);
    let mut opts = allow();
    opts.addresses.hosts.insert(
        "git.test".into(),
        vec![std::net::Ipv4Addr::LOCALHOST.into()],
    );
    let url = format!("https://git.test:{}/r.git#main", server.port);
    let e = fetch_urls(&git_step(&url, "/x"), &sv.dl(), &opts)
        .await
        .unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    let pem = fs::read(certs.join("ca.pem")).unwrap();
    opts.ca_certs = Some(crate::egress::ca::CaCerts::parse("ca.pem", &pem).unwrap());
    let d = fetch_urls(&git_step(&url, "/x"), &sv.dl(), &opts)
        .await
        .unwrap();
    assert_eq!(d.git(&url).unwrap().commit, sv.c2);
}

/// git's smart HTTP: `git http-backend` (CGI) behind a small HTTP/1.1 server on 127.0.0.1,
/// one request per connection, serving the repositories under `root`; its port.
fn smart_server(root: &Path) -> u16 {
    use std::io::{BufRead, BufReader, Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let root = root.to_path_buf();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let root = root.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(c.try_clone().unwrap());
                let mut first = String::new();
                let _ = r.read_line(&mut first);
                let mut parts = first.split(' ');
                let method = parts.next().unwrap_or("GET").to_string();
                let target = parts.next().unwrap_or("/").to_string();
                let (path, query) = target.split_once('?').unwrap_or((&target, ""));
                let mut headers = std::collections::BTreeMap::new();
                loop {
                    let mut l = String::new();
                    if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = l.split_once(':') {
                        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
                    }
                }
                let len: usize = headers
                    .get("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let mut body = vec![0u8; len];
                let _ = r.read_exact(&mut body);
                let h = |k: &str| headers.get(k).cloned().unwrap_or_default();
                let mut child = Command::new("git")
                    .arg("http-backend")
                    .env_clear()
                    .env("PATH", "/usr/bin:/bin")
                    .env("GIT_CONFIG_NOSYSTEM", "1")
                    .env("GIT_PROJECT_ROOT", &root)
                    .env("GIT_HTTP_EXPORT_ALL", "1")
                    .env("REQUEST_METHOD", &method)
                    .env("PATH_INFO", path)
                    .env("QUERY_STRING", query)
                    .env("CONTENT_TYPE", h("content-type"))
                    .env("CONTENT_LENGTH", len.to_string())
                    .env("HTTP_CONTENT_ENCODING", h("content-encoding"))
                    .env("GIT_PROTOCOL", h("git-protocol"))
                    .env("REMOTE_ADDR", "127.0.0.1")
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                child.stdin.take().unwrap().write_all(&body).unwrap();
                let out = child.wait_with_output().unwrap();
                let split = out
                    .stdout
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .unwrap_or(0);
                let head = String::from_utf8_lossy(&out.stdout[..split]).into_owned();
                let rest = &out.stdout[(split + 4).min(out.stdout.len())..];
                let mut status = "200 OK".to_string();
                let mut reply = String::new();
                for l in head.lines() {
                    match l.split_once(':') {
                        Some((k, v)) if k.eq_ignore_ascii_case("status") => {
                            status = v.trim().to_string()
                        }
                        Some(_) => reply.push_str(&format!("{l}\r\n")),
                        None => {}
                    }
                }
                let _ = write!(
                    c,
                    "HTTP/1.1 {status}\r\n{reply}Content-Length: {}\r\nConnection: close\r\n\r\n",
                    rest.len()
                );
                let _ = c.write_all(rest);
            });
        }
    });
    port
}

/// A server that can (smart HTTP): the ref and a commit by id are fetched shallow.
#[tokio::test]
async fn add_git_is_shallow_where_the_server_can() {
    let sv = served();
    let port = smart_server(sv.bare.parent().unwrap());
    let base = format!("http://127.0.0.1:{port}/r.git");
    let mut keep = git_step(&format!("{base}#main"), "/k");
    keep.keep_git_dir = true;
    add(&sv, &keep, &allow()).await.unwrap();
    assert_eq!(read(&sv, "k/a.txt"), "two");
    assert_eq!(
        fs::read_to_string(sv.dest.join("k/.git/shallow"))
            .unwrap()
            .trim(),
        sv.c2,
        "one commit fetched"
    );
    let mut pin = git_step(&format!("{base}#{}", sv.c1), "/p");
    pin.keep_git_dir = true;
    add(&sv, &pin, &allow()).await.unwrap();
    assert_eq!(read(&sv, "p/a.txt"), "one");
    assert_eq!(
        fs::read_to_string(sv.dest.join("p/.git/shallow"))
            .unwrap()
            .trim(),
        sv.c1
    );
    let e = fetch_urls(&git_step(&format!("{base}#nope"), "/x"), &sv.dl(), &allow())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("ref 'nope' not found"), "{e}");
}

/// `git://`: the name is resolved and checked, and git is given the address checked (the
/// git daemon protocol has no way to pin a name); refused under the default address rules.
#[tokio::test]
async fn add_git_over_the_git_protocol_is_pinned_and_checked() {
    let sv = served();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let srv = sv.bare.parent().unwrap();
    struct Daemon(std::process::Child);
    impl Drop for Daemon {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    // git-daemon itself, not the `git daemon` wrapper (whose child would outlive a kill).
    let exec_path = git(srv, &["--exec-path"], T1);
    let _daemon = Daemon(
        Command::new(Path::new(&exec_path).join("git-daemon"))
            .arg("--export-all")
            .arg("--listen=127.0.0.1")
            .arg(format!("--port={port}"))
            .arg(format!("--base-path={}", srv.display()))
            .arg(srv)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "git daemon did not listen"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut opts = allow();
    opts.addresses.hosts.insert(
        "git.test".into(),
        vec![std::net::Ipv4Addr::LOCALHOST.into()],
    );
    // The name is not in DNS: only the address the policy gave reaches the daemon.
    let url = format!("git://git.test:{port}/r.git#v1");
    let d = fetch_urls(&git_step(&url, "/x"), &sv.dl(), &opts)
        .await
        .unwrap();
    assert_eq!(d.git(&url).unwrap().commit, sv.c1);
    let e = fetch_urls(
        &git_step(&format!("git://127.0.0.1:{port}/r.git"), "/x"),
        &sv.dl(),
        &FetchOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, FetchError::Forbidden { .. }), "{e}");
}

/// Issue 41: `ADD ssh://…` and `ADD user@host:path` with the build's agent (`kiln build
/// --ssh default`), against a real `sshd` on 127.0.0.1 started by the test, which serves
/// the fixture's repository through `git-upload-pack` and lets in only the agent's key.
/// The ref resolves as over http (branch, tag, commit; the commit in the cache key); a
/// build without the agent, the address rules, the allow and deny lists and hostile forms
/// are refused before anything connects.
#[tokio::test]
async fn add_git_over_ssh_with_the_builds_agent() {
    let sv = served();
    let keys = sv.dl.join("ssh");
    fs::create_dir(&keys).unwrap();
    let agent = kiln_tests::ssh::Agent::start(&keys);
    let sshd = kiln_tests::ssh::Sshd::start(&keys, &[&agent.public_key]);
    let connections = || sshd.logged().matches("Connection from").count();
    let base = format!("ssh://root@127.0.0.1:{}{}", sshd.port, sv.bare.display());
    let opts = FetchOptions {
        ssh_agent: Some(agent.socket.clone()),
        ..allow()
    };
    // A branch: the files, the commit, through the agent's key.
    let branch = format!("{base}#main");
    let s = git_step(&branch, "/src");
    let src = add(&sv, &s, &opts)
        .await
        .unwrap_or_else(|e| panic!("{e}\nsshd: {}", sshd.logged()));
    assert_eq!(src.downloads.git(&branch).unwrap().commit, sv.c2);
    assert_eq!(read(&sv, "src/a.txt"), "two");
    assert!(!sv.dest.join("src/.git").exists(), ".git is dropped");
    assert!(
        sshd.logged().contains("Accepted publickey for root"),
        "{}",
        sshd.logged()
    );
    // The host key was accepted without being recorded in root's known_hosts (ssh finds
    // `~` in the password database: root's is /root, as the suite runs).
    let known = fs::read_to_string("/root/.ssh/known_hosts").unwrap_or_default();
    assert!(
        !known.contains(&format!("[127.0.0.1]:{}", sshd.port)),
        "nothing written to root's known_hosts"
    );
    // A tag, and a commit by id whose key stays when the branch moves.
    let tag = format!("{base}#v1:sub");
    let t = add(&sv, &git_step(&tag, "/tag"), &opts).await.unwrap();
    assert_eq!(t.downloads.git(&tag).unwrap().commit, sv.c1);
    assert_eq!(read(&sv, "tag/inner/x.txt"), "x");
    let pin = git_step(&format!("{base}#{}", sv.c1), "/pin");
    let p = add(&sv, &pin, &opts).await.unwrap();
    assert_eq!(read(&sv, "pin/a.txt"), "one");
    let k = sources_digest(&s, &src).unwrap();
    let kp = sources_digest(&pin, &p).unwrap();
    sv.move_main();
    let moved = add(&sv, &s, &opts).await.unwrap();
    assert_ne!(
        sources_digest(&s, &moved).unwrap(),
        k,
        "a moved branch is a miss"
    );
    let again = add(&sv, &pin, &opts).await.unwrap();
    assert_eq!(
        sources_digest(&pin, &again).unwrap(),
        kp,
        "a pinned commit is a hit"
    );
    // --keep-git-dir keeps the remote as written.
    let mut keep = git_step(&branch, "/keep");
    keep.keep_git_dir = true;
    add(&sv, &keep, &opts).await.unwrap();
    assert!(
        fs::read_to_string(sv.dest.join("keep/.git/config"))
            .unwrap()
            .contains(&base),
        "the remote of the kept .git"
    );

    // Refused before anything connects: no agent, the address rules, the lists.
    let before = connections();
    assert!(before > 0, "sshd logs its connections: {}", sshd.logged());
    let e = fetch_urls(&git_step(&branch, "/x"), &sv.dl(), &allow())
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::BadUrl { .. }), "{e}");
    assert!(e.to_string().contains("kiln build --ssh default"), "{e}");
    let public_only = FetchOptions {
        ssh_agent: Some(agent.socket.clone()),
        ..FetchOptions::default()
    };
    let e = fetch_urls(&git_step(&branch, "/x"), &sv.dl(), &public_only)
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::Forbidden { .. }), "{e}");
    let mut listed = opts.clone();
    listed.addresses.hosts.insert(
        "ssh.test".into(),
        vec![std::net::Ipv4Addr::LOCALHOST.into()],
    );
    let named = format!(
        "ssh://root@ssh.test:{}{}#main",
        sshd.port,
        sv.bare.display()
    );
    let rule = |r: &str| kiln_recipes::plan::EgressRule::parse(r).unwrap();
    listed.rules = Some(kiln_recipes::plan::Egress {
        allow: vec![rule("other.test")],
        deny: vec![],
    });
    let e = fetch_urls(&git_step(&named, "/x"), &sv.dl(), &listed)
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::NotAllowed { .. }), "{e}");
    listed.rules = Some(kiln_recipes::plan::Egress {
        allow: vec![rule("ssh.test")],
        deny: vec![rule("127.0.0.0/8")],
    });
    let e = fetch_urls(&git_step(&named, "/x"), &sv.dl(), &listed)
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::NotAllowed { .. }), "{e}");
    let marker = sv.dl.join("pwned");
    let m = marker.display();
    let p = sshd.port;
    for (url, needle) in [
        (
            format!("ssh://-oProxyCommand=touch%20{m}/r.git"),
            "bad host",
        ),
        (
            format!("ssh://-oProxyCommand=touch%20pwned@127.0.0.1:{p}/r.git"),
            "bad ssh user name",
        ),
        (
            format!("-oProxyCommand@127.0.0.1:{}", sv.bare.display()),
            "bad ssh user name",
        ),
        (
            format!("root@-oProxyCommand:{}", sv.bare.display()),
            "bad host",
        ),
        (
            "root@127.0.0.1:--upload-pack=touch x".to_string(),
            "starts with '-'",
        ),
        (format!("{base}#--upload-pack=touch {m}"), "starts with '-'"),
        (
            format!("ext::ssh -oProxyCommand=touch%20{m} x"),
            "transport 'ext::'",
        ),
        (format!("ssh://u:pw@127.0.0.1:{p}/r.git"), "a password"),
    ] {
        let e = fetch_urls(&git_step(&url, "/x"), &sv.dl(), &opts)
            .await
            .unwrap_err();
        assert!(matches!(e, FetchError::BadUrl { .. }), "{url}: {e}");
        assert!(e.to_string().contains(needle), "{url}: {e}");
    }
    assert!(!marker.exists(), "nothing ran");
    assert_eq!(connections(), before, "sshd saw no connection");

    // A key the server does not know: git's error, no prompt.
    let other_dir = keys.join("other");
    fs::create_dir(&other_dir).unwrap();
    let other = kiln_tests::ssh::Agent::start(&other_dir);
    let stranger = FetchOptions {
        ssh_agent: Some(other.socket.clone()),
        ..allow()
    };
    let e = fetch_urls(&git_step(&branch, "/x"), &sv.dl(), &stranger)
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::Git { .. }), "{e}");
    assert!(
        e.to_string().contains("Permission denied (publickey)"),
        "{e}"
    );
    // The scp-like form has no port: ssh's 22 on the address checked (no sshd of ours).
    let scp = format!("root@127.0.0.1:{}#main", sv.bare.display());
    let e = fetch_urls(&git_step(&scp, "/x"), &sv.dl(), &opts)
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::Git { .. }), "{e}");
    assert!(
        e.to_string().contains("127.0.0.1 port 22") || e.to_string().contains("Permission denied"),
        "{e}"
    );
}
