//! The base-image subcommands, run as the `kiln` binary against the test registries and
//! fixtures of `ci/setup.sh` (as root).

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use kiln_tests::{require_env, tree_listing};

fn kiln(store: &Path, docker_config: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.args(args)
        .env("KILN_STORE", store)
        .env("DOCKER_CONFIG", docker_config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("run kiln");
    if let Some(s) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(s.as_bytes())
            .expect("write stdin");
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("kiln output")
}

fn ok(o: &Output, what: &str) -> String {
    kiln_tests::assert_success(o, what)
}

/// Done when: `kiln pull 127.0.0.1:5000/debian:bookworm` fills the store, and
/// `kiln unpack REF DIR` gives a tree identical to `umoci unpack` of the same image.
#[test]
fn pull_then_unpack_matches_umoci() {
    let reference = require_env("KILN_TEST_DEBIAN_REF");
    let layout = require_env("KILN_TEST_DEBIAN_OCI");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cfg) = (t.path().join("store"), t.path().join("docker"));
    let digest = ok(
        &kiln(&store, &cfg, &["pull", &reference], None),
        "kiln pull",
    );
    assert!(digest.starts_with("sha256:"), "{digest}");
    let blobs = std::fs::read_dir(store.join("blobs/sha256"))
        .expect("store blobs")
        .count();
    assert!(
        blobs >= 3,
        "manifest, config and layer in the store ({blobs})"
    );
    ok(
        &kiln(
            &store,
            &cfg,
            &[
                "unpack",
                "--offline",
                &reference,
                t.path().join("kiln").to_str().expect("utf8"),
            ],
            None,
        ),
        "kiln unpack",
    );
    let out = Command::new("umoci")
        .args(["unpack", "--image", &format!("{layout}:bookworm")])
        .arg(t.path().join("bundle"))
        .output()
        .expect("umoci");
    assert!(
        out.status.success(),
        "umoci: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let a = tree_listing(&t.path().join("kiln"));
    let b = tree_listing(&t.path().join("bundle/rootfs"));
    let diff: Vec<_> = a
        .iter()
        .filter(|l| !b.contains(l))
        .chain(b.iter().filter(|l| !a.contains(l)))
        .take(10)
        .collect();
    assert!(
        diff.is_empty() && a.len() == b.len(),
        "trees differ: {diff:#?}"
    );
}

#[test]
fn login_pull_export_import() {
    let host = require_env("KILN_TEST_REGISTRY_AUTH");
    let user = require_env("KILN_TEST_REGISTRY_USER");
    let password = require_env("KILN_TEST_REGISTRY_PASSWORD");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cfg) = (t.path().join("store"), t.path().join("docker"));
    let refused = kiln(
        &store,
        &cfg,
        &["login", &host, "-u", &user, "--password-stdin"],
        Some("nope\n"),
    );
    assert!(!refused.status.success(), "a wrong password is refused");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("authentication refused"));
    assert!(
        !cfg.join("config.json").exists(),
        "nothing stored on refusal"
    );
    ok(
        &kiln(
            &store,
            &cfg,
            &["login", &host, "-u", &user, "--password-stdin"],
            Some(&format!("{password}\n")),
        ),
        "kiln login",
    );
    let cfg_text = std::fs::read_to_string(cfg.join("config.json")).expect("config written");
    assert!(
        cfg_text.contains(&host) && !cfg_text.contains(&password),
        "auth is base64, in auths"
    );
    let reference = format!("{host}/busybox:latest");
    let digest = ok(
        &kiln(&store, &cfg, &["pull", &reference], None),
        "kiln pull with stored credentials",
    );
    let out = t.path().join("layout");
    let out_s = out.to_str().expect("utf8");
    ok(
        &kiln(
            &store,
            &cfg,
            &["export", &reference, "--format", "oci", "-o", out_s],
            None,
        ),
        "kiln export",
    );
    let store2 = t.path().join("store2");
    let spec = format!("oci:{out_s}:latest");
    let imported = ok(
        &kiln(
            &store2,
            &cfg,
            &["import", &spec, "-t", "localhost/bb:copy"],
            None,
        ),
        "kiln import",
    );
    assert_eq!(imported, digest);
    let dir = t.path().join("rootfs");
    ok(
        &kiln(
            &store2,
            &cfg,
            &[
                "unpack",
                "--offline",
                "localhost/bb:copy",
                dir.to_str().expect("utf8"),
            ],
            None,
        ),
        "kiln unpack of an imported image, offline",
    );
    assert!(dir.join("bin/busybox").is_file());
    // Push the imported image to the anonymous registry and pull it back: same digest.
    let plain = require_env("KILN_TEST_REGISTRY");
    let dst = format!("{plain}/kiln-test/cli-push:copy");
    let pushed = ok(
        &kiln(&store2, &cfg, &["push", "localhost/bb:copy", &dst], None),
        "kiln push",
    );
    assert_eq!(pushed, digest);
    let store3 = t.path().join("store3");
    let pulled = ok(
        &kiln(&store3, &cfg, &["pull", &dst], None),
        "kiln pull of the pushed image",
    );
    assert_eq!(pulled, digest);
    let missing = kiln(
        &store2,
        &cfg,
        &[
            "unpack",
            "--offline",
            "localhost/absent:x",
            "/nonexistent-kiln",
        ],
        None,
    );
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--offline"));
}

/// A pulled image is a store-level OCI reference: `kiln tags` lists it, `kiln store push`
/// copies it (blobs, then the reference) to another store, `kiln store verify` finds both
/// stores clean, and `kiln store gc` keeps it.
#[test]
fn pulled_images_are_store_references() {
    let reference = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cfg) = (t.path().join("store"), t.path().join("docker"));
    let other = t.path().join("other");
    let digest = ok(&kiln(&store, &cfg, &["pull", &reference], None), "pull");
    let tags = ok(&kiln(&store, &cfg, &["tags"], None), "tags");
    assert_eq!(tags, format!("{reference}\t{digest}\toci"));
    let repo = reference.rsplit_once(':').expect("tag").0;
    let tags = ok(&kiln(&store, &cfg, &["tags", repo], None), "tags REPO");
    assert_eq!(tags, format!("{reference}\t{digest}\toci"));
    ok(
        &kiln(
            &store,
            &cfg,
            &[
                "store",
                "push",
                &reference,
                "--to",
                other.to_str().expect("utf8"),
            ],
            None,
        ),
        "store push",
    );
    let tags = ok(
        &kiln(
            &other,
            &cfg,
            &["--json", "tags", "--store", other.to_str().expect("utf8")],
            None,
        ),
        "tags in the other store",
    );
    let ev: serde_json::Value = serde_json::from_str(&tags).expect("json");
    assert_eq!(ev["reference"], reference.as_str());
    assert_eq!(ev["digest"], digest.as_str());
    for s in [&store, &other] {
        let s = s.to_str().expect("utf8");
        ok(
            &kiln(
                &store,
                &cfg,
                &["store", "verify", "--deep", "--store", s],
                None,
            ),
            "verify",
        );
        ok(
            &kiln(
                &store,
                &cfg,
                &["store", "gc", "--grace", "0s", "--store", s],
                None,
            ),
            "gc",
        );
    }
    // The other store can unpack it without any registry.
    ok(
        &kiln(
            &other,
            &cfg,
            &[
                "unpack",
                "--offline",
                &reference,
                t.path().join("tree").to_str().expect("utf8"),
            ],
            None,
        ),
        "unpack from the copy",
    );
    assert!(t.path().join("tree/bin/busybox").exists());
    // A non-empty destination is refused unless --merge.
    let tree = t.path().join("tree");
    let again = kiln(
        &other,
        &cfg,
        &[
            "unpack",
            "--offline",
            &reference,
            tree.to_str().expect("utf8"),
        ],
        None,
    );
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        err.contains("not empty") && err.contains("--merge"),
        "{err}"
    );
    std::fs::write(tree.join("mine"), b"kept").expect("write");
    ok(
        &kiln(
            &other,
            &cfg,
            &[
                "unpack",
                "--offline",
                "--merge",
                &reference,
                tree.to_str().expect("utf8"),
            ],
            None,
        ),
        "unpack --merge",
    );
    assert_eq!(std::fs::read(tree.join("mine")).expect("kept"), b"kept");
}

/// Anonymous bearer tokens: the token-auth registry of `ci/setup.sh` (:5002, tokens from
/// `ci/token-server.py`) answers 401 with a Bearer challenge; `kiln pull` with no
/// credentials fetches an anonymous token from the realm and pulls by tag. The token grants
/// pull only, so an anonymous push is refused.
#[test]
fn anonymous_bearer_token_pull() {
    let registry = require_env("KILN_TEST_REGISTRY_TOKEN");
    let plain = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cfg) = (t.path().join("store"), t.path().join("docker"));
    // The registry really asks for a token.
    let out = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-D", "-"])
        .arg(format!("http://{registry}/v2/busybox/manifests/latest"))
        .output()
        .expect("curl");
    let head = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 401") && head.contains("www-authenticate: bearer realm="),
        "{head}"
    );
    let reference = format!("{registry}/busybox:latest");
    let digest = ok(&kiln(&store, &cfg, &["pull", &reference], None), "pull");
    // The same image as on the anonymous registry (pushed with its digests preserved).
    let other = t.path().join("other");
    let expected = ok(&kiln(&other, &cfg, &["pull", &plain], None), "pull plain");
    assert_eq!(digest, expected);
    let tags = ok(&kiln(&store, &cfg, &["tags"], None), "tags");
    assert_eq!(tags, format!("{reference}\t{digest}\toci"));
    let push = kiln(
        &store,
        &cfg,
        &["push", &reference, &format!("{registry}/kiln-anon-push:x")],
        None,
    );
    assert!(
        !push.status.success(),
        "an anonymous push must be refused: {}",
        String::from_utf8_lossy(&push.stdout)
    );
    let err = String::from_utf8_lossy(&push.stderr);
    assert!(err.contains("authentication refused"), "{err}");
}
