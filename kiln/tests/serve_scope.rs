//! A tenant's recipe reaches nothing outside its workspace (issue 42), through the HTTP
//! API of a real `kiln serve` with two workspaces, `acme` and `evil`, a local store and
//! SQLite, the test registries on 127.0.0.1 and the busybox fixture.
//!
//! - Every way a recipe names an image (`FROM`, `COPY --from`, `RUN --mount=from=`, by tag,
//!   by `@sha256:` under any name, by a bare digest) finds another workspace's image exactly
//!   as it finds a missing one: the same failure reason, with the workspace's name swapped.
//! - `oci:DIR` and bootstrap bases are refused; a registry at a loopback address the
//!   operator did not name is refused; the operator's registry credentials are not used.
//! - An allowed global base, the tenant's own tag (also pinned by digest), its own image by
//!   digest under any name or bare, and a registry image named again by digest build.
//! - The build cache does not speak across workspaces.
//! - A workspace's storage quota: a build past it tags nothing.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kiln_tests::require_env;
use kiln_tests::serve::{
    Launch, Server, client, env, get, json_of, rt, submit, submit_recipe, terminal, wait_for,
};
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// Submits `recipe` (a Dockerfile, or a YAML recipe when `name` ends in `.yaml`) for `key`
/// and waits for its end; the build view.
async fn build(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    name: &str,
    recipe: &str,
    tags: &[&str],
) -> Value {
    let id = submit_recipe(c, s, key, &json!({"recipe": name, "tags": tags}), recipe).await;
    wait_for(c, s, key, &id, Duration::from_secs(300), terminal).await
}

fn reason(v: &Value) -> String {
    assert_eq!(v["state"], "failed", "{v:#}");
    v["failure"]["reason"].as_str().expect("reason").to_string()
}

fn succeeded(v: &Value) -> &Value {
    assert_eq!(v["state"], "succeeded", "{v:#}");
    v
}

/// `kiln build -t tag` of `dockerfile` into `store` (the operator's CLI).
fn operator_build(dir: &Path, store: &Path, dockerfile: &str, tag: &str) {
    kiln_tests::serve::operator_build(KILN.as_ref(), dir, store, dockerfile, tag);
}

/// The failure reason of `dockerfile` built for `key` (no tags).
async fn fails(c: &reqwest::Client, s: &Server, key: &str, dockerfile: &str) -> String {
    reason(&build(c, s, key, "Dockerfile", dockerfile, &[]).await)
}

#[test]
fn a_tenant_recipe_names_only_its_workspace_global_bases_and_registries() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let auth_registry = require_env("KILN_TEST_REGISTRY_AUTH");
    let token_registry = require_env("KILN_TEST_REGISTRY_TOKEN");
    let (t, state, store) = env();
    // The operator's images: `gbase:1`, allowed to tenants, and `optag:1`, not allowed.
    operator_build(
        &t.path().join("g"),
        &store,
        &format!("FROM {bb}\nRUN echo global > /global\n"),
        "gbase:1",
    );
    operator_build(
        &t.path().join("o"),
        &store,
        &format!("FROM {bb}\nRUN echo operator > /operator\n"),
        "optag:1",
    );
    // The operator's own credentials for the registry that wants them (`kiln login`): a
    // tenant build must not use them.
    let docker = t.path().join("docker");
    let mut login = Command::new(KILN)
        .env("DOCKER_CONFIG", &docker)
        .args([
            "login",
            &auth_registry,
            "-u",
            &require_env("KILN_TEST_REGISTRY_USER"),
        ])
        .arg("--password-stdin")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("kiln login");
    {
        use std::io::Write as _;
        let mut stdin = login.stdin.take().expect("stdin");
        writeln!(stdin, "{}", require_env("KILN_TEST_REGISTRY_PASSWORD")).expect("password");
    }
    assert!(login.wait().expect("kiln login").success());
    let s = Server::launch(&Launch {
        bin: KILN.as_ref(),
        state: &state,
        store: &store,
        db: &[],
        cache: None,
        listen: "127.0.0.1:0",
        netns: None,
        env: &[("DOCKER_CONFIG", docker.to_str().expect("utf-8"))],
        extra: &["--base", "gbase"],
    });
    let acme = s.key("acme", &[]);
    let evil = s.key("evil", &[]);
    let c = client();
    rt().block_on(async {
        // acme's image, with a file only acme wrote.
        let a = build(
            &c,
            &s,
            &acme,
            "Dockerfile",
            &format!("FROM {bb}\nRUN echo acme-secret > /secret\n"),
            &["app:1"],
        )
        .await;
        let oci = succeeded(&a)["oci_manifest"]
            .as_str()
            .expect("oci manifest")
            .to_string();
        let image = a["image"].as_str().expect("image").to_string();
        let zeros = format!("sha256:{}", "0".repeat(64));

        // Each form naming acme's image, from evil, fails exactly as the same form naming
        // a workspace nobody has (`zzzz`, as long as `acme`), or a digest nobody has.
        let forms = [
            "FROM acme.app:1\n".to_string(),
            "FROM acme.app\n".to_string(),
            format!("FROM acme.app:1@{oci}\n"),
            format!("FROM acme.app@{oci}\n"),
            format!("FROM {bb}\nCOPY --from=acme.app:1 /secret /stolen\n"),
            format!("FROM {bb}\nRUN --mount=type=bind,from=acme.app:1,target=/m cat /m/secret\n"),
            "FROM optag:1\n".to_string(),
        ];
        for f in &forms {
            let theirs = fails(&c, &s, &evil, f).await;
            let missing = f.replace("acme", "zzzz").replace("optag", "nopet");
            let missing = fails(&c, &s, &evil, &missing).await;
            assert_eq!(
                theirs.replace("acme", "zzzz").replace("optag", "nopet"),
                missing,
                "{f}"
            );
        }
        // Digests under any name, also on a registry the server may reach: acme's OCI
        // manifest and image manifest digests.
        let registry = require_env("KILN_TEST_REGISTRY");
        for name in [
            "anyname@".to_string(),
            format!("{registry}/anyname@"),
            String::new(),
        ] {
            for d in [&oci, &image] {
                let f = |d: &str| format!("FROM {name}{d}\n");
                let theirs = fails(&c, &s, &evil, &f(d)).await;
                let missing = fails(&c, &s, &evil, &f(&zeros)).await;
                assert_eq!(theirs.replace(d.as_str(), &zeros), missing, "{name}@{d}");
            }
        }

        // Refused: a host path, a bootstrap base, a loopback registry not allowed.
        let r = fails(&c, &s, &evil, "FROM oci:/etc:latest\n").await;
        assert!(r.contains("OCI layout on the server"), "{r}");
        assert!(!r.contains("/etc/"), "{r}");
        let r = reason(
            &build(
                &c,
                &s,
                &evil,
                "recipe.yaml",
                "from:\n  bootstrap:\n    distro: debian\n    suite: bookworm\n    \
                 mirror: http://127.0.0.1:1/debian\n",
                &[],
            )
            .await,
        );
        assert!(
            r.contains("bootstrap base cannot be built for a tenant"),
            "{r}"
        );
        let r = fails(
            &c,
            &s,
            &evil,
            &format!("FROM {token_registry}/busybox:latest\n"),
        )
        .await;
        assert!(r.contains("not public"), "{r}");
        // The operator's credentials are not used: the registry wants some.
        let r = fails(
            &c,
            &s,
            &evil,
            &format!("FROM {auth_registry}/busybox:latest\n"),
        )
        .await;
        assert!(r.contains("authentication refused"), "{r}");
        // A tenant cannot take a global base's name.
        let r = submit(
            &c,
            &s,
            &evil,
            &json!({"tags": ["gbase:2"]}),
            None,
            Some(format!("FROM {bb}\n").as_bytes()),
            None,
        )
        .await;
        assert_eq!(r.status(), 400);
        let body = json_of(r).await;
        assert!(body.to_string().contains("global base"), "{body}");

        // What works: the global base, the tenant's own tag (also by digest), and a
        // registry image named again by digest.
        succeeded(
            &build(
                &c,
                &s,
                &evil,
                "Dockerfile",
                "FROM gbase:1\nRUN test -f /global\n",
                &[],
            )
            .await,
        );
        // The workspace's own image also by its digests, under any name or bare.
        let own = [
            "app:1".to_string(),
            format!("app:1@{oci}"),
            format!("anyname@{oci}"),
            format!("{registry}/anyname@{image}"),
            oci.clone(),
            image.clone(),
        ];
        for own in own {
            succeeded(
                &build(
                    &c,
                    &s,
                    &acme,
                    "Dockerfile",
                    &format!("FROM {own}\nRUN grep -q acme-secret /secret\n"),
                    &[],
                )
                .await,
            );
        }
        succeeded(&build(&c, &s, &evil, "Dockerfile", &format!("FROM {bb}\n"), &[]).await);
        let (repo, tag) = bb.rsplit_once(':').expect("tag");
        let (host, path) = repo.split_once('/').expect("registry/repository");
        let pulled = c
            .head(format!("http://{host}/v2/{path}/manifests/{tag}"))
            .header(
                "accept",
                "application/vnd.oci.image.manifest.v1+json, \
                 application/vnd.docker.distribution.manifest.v2+json",
            )
            .send()
            .await
            .expect("HEAD manifest")
            .headers()["docker-content-digest"]
            .to_str()
            .expect("digest")
            .to_string();
        succeeded(
            &build(
                &c,
                &s,
                &evil,
                "Dockerfile",
                &format!("FROM {repo}@{pulled}\nRUN true\n"),
                &[],
            )
            .await,
        );

        // The build cache is the workspace's own: the same recipe runs its step in each
        // workspace once, then is a hit in the same workspace.
        let same = format!("FROM {bb}\nRUN echo same > /same\n");
        for (key, cached) in [(&acme, false), (&evil, false), (&evil, true)] {
            let v = build(&c, &s, key, "Dockerfile", &same, &[]).await;
            let steps = succeeded(&v)["steps"].as_array().expect("steps").clone();
            let run = steps
                .iter()
                .find(|s| {
                    s["instruction"]
                        .as_str()
                        .is_some_and(|i| i.contains("echo same"))
                })
                .unwrap_or_else(|| panic!("the RUN step: {v:#}"));
            assert_eq!(run["cached"], cached, "{v:#}");
        }
        // No tag of evil's moved, and acme's is where it was.
        let r = get(&c, &s, &acme, "/v1/images/app/tags/1").await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["etag"].to_str().expect("etag"),
            format!("\"{image}\"")
        );
        let evil_images = json_of(get(&c, &s, &evil, "/v1/images").await).await;
        assert_eq!(evil_images, json!([]), "{evil_images:#}");
    });
}

/// A workspace's storage quota (`keys create --max-storage-gib`) counts the raw bytes of the
/// distinct chunks its tags hold: a second image that shares the first's chunks fits where
/// two copies would not, and a build past the quota fails with a reason naming it and moves
/// no tag. Another workspace's images count nothing against it.
#[test]
fn a_build_past_the_workspace_storage_quota_tags_nothing() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (_t, state, store) = env();
    let s = Server::start(KILN.as_ref(), &state, &store, &[]);
    let ws = s.key("quota", &[]);
    let other = s.key("other", &[]);
    let c = client();
    rt().block_on(async {
        let image_of = |v: &Value| {
            succeeded(v)["image"]
                .as_str()
                .expect("image")
                .parse::<kiln_store::ManifestDigest>()
                .expect("digest")
        };
        let a = build(
            &c,
            &s,
            &ws,
            "Dockerfile",
            &format!("FROM {bb}\nRUN echo a > /a\n"),
            &["a:1"],
        )
        .await;
        let a = image_of(&a);
        let st = kiln_store::Store::open(store.to_str().expect("utf-8"))
            .await
            .expect("open the store");
        let one = st.chunk_bytes([a]).await.expect("usage");
        assert!(
            one > 2 << 20,
            "a busybox image holds more than 2 MiB: {one}"
        );
        // Another workspace's big image does not count.
        succeeded(
            &build(
                &c,
                &s,
                &other,
                "Dockerfile",
                &format!("FROM {bb}\nRUN head -c 8000000 /dev/urandom > /big\n"),
                &["big:1"],
            )
            .await,
        );
        // The quota: the first image and 2 MiB more, in GiB.
        let limit = one + (2 << 20);
        s.key(
            "quota",
            &[
                "--max-storage-gib",
                &format!("{:.9}", limit as f64 / f64::from(1u32 << 30)),
            ],
        );
        // A second image sharing the first's chunks fits: shared chunks count once.
        let b = build(
            &c,
            &s,
            &ws,
            "Dockerfile",
            &format!("FROM {bb}\nRUN echo b > /b\n"),
            &["b:1"],
        )
        .await;
        let b = image_of(&b);
        let both = st.chunk_bytes([a, b]).await.expect("usage");
        assert!(both <= limit && 2 * one > limit, "{one} {both} {limit}");
        // 4 MB of new chunks do not: the build fails and its tag does not exist.
        let big = build(
            &c,
            &s,
            &ws,
            "Dockerfile",
            &format!("FROM {bb}\nRUN head -c 4000000 /dev/urandom > /big\n"),
            &["big:1", "a:1"],
        )
        .await;
        let r = reason(&big);
        assert!(r.contains("storage quota exceeded"), "{r}");
        assert!(r.contains("nothing was tagged"), "{r}");
        assert!(
            r.contains(&format!("{:.1} MiB", limit as f64 / f64::from(1u32 << 20))),
            "the reason names the quota: {r}"
        );
        assert!(!r.contains(state.to_str().expect("utf-8")), "{r}");
        let r = get(&c, &s, &ws, "/v1/images/big/tags/1").await;
        assert_eq!(r.status(), 404);
        // An untagged build holds nothing of the quota and builds; pointing a tag at its
        // image is checked as a build's tags are: refused, 409, no tag.
        let untagged = build(
            &c,
            &s,
            &ws,
            "Dockerfile",
            &format!("FROM {bb}\nRUN head -c 4000000 /dev/urandom > /big\n"),
            &[],
        )
        .await;
        let big_image = succeeded(&untagged)["image"]
            .as_str()
            .expect("image")
            .to_string();
        let r = c
            .put(s.url("/v1/images/big/tags/2"))
            .bearer_auth(&ws)
            .header("if-none-match", "*")
            .json(&json!({ "digest": big_image }))
            .send()
            .await
            .expect("PUT tag");
        assert_eq!(r.status(), 409);
        let body = json_of(r).await.to_string();
        assert!(body.contains("storage quota exceeded"), "{body}");
        let r = get(&c, &s, &ws, "/v1/images/big/tags/2").await;
        assert_eq!(r.status(), 404);
        for (tag, d) in [("a", a), ("b", b)] {
            let r = get(&c, &s, &ws, &format!("/v1/images/{tag}/tags/1")).await;
            assert_eq!(r.status(), 200);
            assert_eq!(
                r.headers()["etag"].to_str().expect("etag"),
                format!("\"{d}\""),
                "{tag}:1 did not move"
            );
        }
    });
}

/// A tenant's registry pull connects only through the egress proxy, which checks every
/// connection: the token realm a registry names is refused when it is at an address the
/// operator did not allow, although the registry itself is allowed (the token-auth test
/// registry's realm is another port of 127.0.0.1). With the realm's address allowed too,
/// the same pull builds.
#[test]
fn a_registry_token_realm_is_checked_as_the_registry_is() {
    let token_registry = require_env("KILN_TEST_REGISTRY_TOKEN");
    let realm = "127.0.0.1:5003";
    let recipe = format!("FROM {token_registry}/busybox:latest\nRUN true\n");
    for allow_realm in [false, true] {
        let (_t, state, store) = env();
        let mut extra = vec!["--allow-registry", token_registry.as_str()];
        if allow_realm {
            extra.extend(["--allow-registry", realm]);
        }
        let s = Server::start(KILN.as_ref(), &state, &store, &extra);
        let key = s.key("acme", &[]);
        let c = client();
        rt().block_on(async {
            let v = build(&c, &s, &key, "Dockerfile", &recipe, &[]).await;
            if allow_realm {
                succeeded(&v);
            } else {
                let r = reason(&v);
                assert!(
                    r.contains(&format!("refused GET {realm}"))
                        && r.contains("not a public address"),
                    "{r}"
                );
                assert!(!r.contains(state.to_str().expect("utf-8")), "{r}");
                assert!(
                    s.logged(&format!("egress: refused GET {realm}")),
                    "the proxy refused the realm: {r}"
                );
            }
        });
    }
}

/// A tenant pulls from a registry that wants credentials with its own, given with the build
/// (`registry_auth`): the build succeeds, the password is in no file of the server's state
/// directory (the database holds it sealed, and only while the build runs) nor in its log,
/// and the next build without credentials gets 401 again. A server without
/// `--credentials-key-file` refuses such a submission.
#[test]
fn a_tenant_pulls_with_its_own_registry_credentials() {
    let auth_registry = require_env("KILN_TEST_REGISTRY_AUTH");
    let user = require_env("KILN_TEST_REGISTRY_USER");
    let password = require_env("KILN_TEST_REGISTRY_PASSWORD");
    let (t, state, store) = env();
    let key_file = t.path().join("credentials.key");
    std::fs::write(&key_file, format!("{}\n", "5a".repeat(32))).expect("key");
    let recipe = format!("FROM {auth_registry}/busybox:latest\nRUN true\n");
    let spec = json!({
        "recipe": "Dockerfile",
        "registry_auth": {auth_registry.clone(): {"username": user, "password": password}},
    });
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--credentials-key-file", key_file.to_str().expect("utf-8")],
    );
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let id = submit_recipe(&c, &s, &key, &spec, &recipe).await;
        succeeded(&wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await);
        let r = fails(&c, &s, &key, &recipe).await;
        assert!(r.contains("authentication refused"), "{r}");
        // A wrong password fails as the registry says, and is not echoed.
        let mut wrong = spec.clone();
        wrong["registry_auth"][&auth_registry]["password"] = json!("not-the-password-x9");
        let id = submit_recipe(&c, &s, &key, &wrong, &recipe).await;
        let r = reason(&wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await);
        assert!(!r.contains("not-the-password-x9"), "{r}");
        // Bad credentials specs are 400s naming what was expected.
        let bad = json!({"recipe": "Dockerfile",
            "registry_auth": {"https://x.example": {"username": "u", "password": "p"}}});
        let r = submit(&c, &s, &key, &bad, None, Some(recipe.as_bytes()), None).await;
        assert_eq!(r.status(), 400);
        let body = json_of(r).await.to_string();
        assert!(body.contains("expected a registry host[:port]"), "{body}");
    });
    assert!(!s.logged(&password), "the password is in the server's log");
    assert!(!s.logged("not-the-password-x9"));
    for f in walk(&state) {
        let bytes = std::fs::read(&f).expect("read");
        for p in [password.as_bytes(), b"not-the-password-x9"] {
            assert!(
                !bytes.windows(p.len()).any(|w| w == p),
                "a password in {}",
                f.display()
            );
        }
    }
    drop(s);

    // Without a credentials key, the submission is refused.
    let (_t2, state2, store2) = env();
    let s = Server::start(KILN.as_ref(), &state2, &store2, &[]);
    let key = s.key("acme", &[]);
    rt().block_on(async {
        let r = submit(&c, &s, &key, &spec, None, Some(recipe.as_bytes()), None).await;
        assert_eq!(r.status(), 400);
        let body = json_of(r).await.to_string();
        assert!(body.contains("--credentials-key-file"), "{body}");
    });
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => out.extend(walk(&p)),
            Ok(t) if t.is_file() => out.push(p),
            _ => {}
        }
    }
    out
}

/// A fault injector for a registry the operator allows that redirects its manifests to an
/// address nobody allowed (the real registry cannot be made to): `GET /v2/` answers 200,
/// every other request `307` to `target`. Its port.
fn redirecting_registry(target: String) -> u16 {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut r = BufReader::new(conn.try_clone().expect("clone"));
            let mut first = String::new();
            if r.read_line(&mut first).is_err() {
                continue;
            }
            loop {
                let mut l = String::new();
                if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
                    break;
                }
            }
            let head = if first.split(' ').nth(1) == Some("/v2/") {
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}".to_string()
            } else {
                format!(
                    "HTTP/1.1 307 Temporary Redirect\r\nLocation: {target}\r\n\
                     Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
            };
            let _ = conn.write_all(head.as_bytes());
        }
    });
    port
}

/// Every request of a tenant's pull goes through the egress proxy, the manifest's too: an
/// allowed registry that redirects its manifest to an address nobody allowed gets the build
/// refused naming that address, and the address is never reached.
#[test]
fn a_registry_redirect_is_checked_as_the_registry_is() {
    let internal = kiln_tests::http::LocalServer::start();
    let registry =
        redirecting_registry(format!("http://127.0.0.1:{}/internal/admin", internal.port));
    let allowed = format!("127.0.0.1:{registry}");
    let (_t, state, store) = env();
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--allow-registry", &allowed],
    );
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let r = fails(&c, &s, &key, &format!("FROM {allowed}/app:latest\n")).await;
        assert!(
            r.contains(&format!("refused GET 127.0.0.1:{}", internal.port))
                && r.contains("not a public address"),
            "{r}"
        );
        assert!(!r.contains("hello"), "{r}");
    });
    assert_eq!(
        internal.hits("/internal/admin"),
        0,
        "the internal address was reached"
    );
}
