//! Issue 34: the package download cache of `RUN` steps (README "Package download cache";
//! `kiln_builder::exec::mounts::packages`). apt's, pip's and npm's download directories
//! (`/var/cache/apt`, `/root/.cache/pip`, `/root/.npm`) never enter a layer, whoever builds;
//! `kiln build` mounts the host's cache (`<cache>/packages`) there, a tenant's build through
//! `kiln serve` gets none. As root, on the busybox fixture (`KILN_TEST_BUSYBOX_REF`).
//!
//! The recipe's first stage says whether its step sees a file an earlier build's step left in
//! each directory (`/saw`), then leaves one there itself; the last stage, on the first,
//! fails when the first stage's tree (its layers, bound with `--mount=from=`) holds one, or
//! kiln's own directory of the caches.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kiln_tests::require_env;
use kiln_tests::serve::{Launch, Server, client, json_of, rt, submit, tar_dir, terminal, wait_for};
use serde_json::json;

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// The package download directories, as the step sees them.
const DIRS: &str = "/var/cache/apt /root/.cache/pip /root/.npm";

/// What `/saw` holds after a step that found no earlier build's file.
const UNSEEN: &str = "unseen /var/cache/apt\nunseen /root/.cache/pip\nunseen /root/.npm\n";

/// What `/saw` holds after a step that found all three.
const SEEN: &str = "seen /var/cache/apt\nseen /root/.cache/pip\nseen /root/.npm\n";

fn recipe(bb: &str) -> String {
    format!(
        "FROM {bb} AS s\n\
         RUN for d in {DIRS}; do if [ -e $d/marker ]; then echo seen $d; \
         else echo unseen $d; fi; done > /saw \
         && for d in {DIRS}; do mkdir -p $d && echo downloaded > $d/marker; done\n\
         FROM s\n\
         RUN --mount=type=bind,from=s,target=/s for d in {DIRS} /var/cache/kiln-packages; do \
         if [ -e /s$d/marker ] || [ -e /s$d/apt ]; then echo \"stage s has $d\" >&2; exit 1; fi; \
         done\n"
    )
}

/// `kiln build` of `ctx` into `store` with the host cache `cache`, tagged `tag`, with
/// `SOURCE_DATE_EPOCH` and `extra`: the image digest.
fn build(ctx: &Path, store: &Path, cache: &Path, tag: &str, extra: &[&str]) -> String {
    let out = kiln_tests::run_ok(
        Command::new(KILN)
            .env("KILN_STORE", store)
            .env("KILN_CACHE", cache)
            .env("KILN_CONFIG", cache.join("no-config.toml"))
            .arg("build")
            .arg(ctx)
            .args(["-t", tag, "--progress", "plain"])
            .args(["--build-arg", "SOURCE_DATE_EPOCH=1700000000"])
            .args(extra),
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .last()
        .expect("a digest line")
        .to_string()
}

/// The entries of each layer of store tag `tag`, bottom first (`kiln export --format oci
/// --layer-compression as-built`, zstd layers, listed with `tar --zstd -t`), and the content
/// of `/saw` in the image (the topmost layer that has it).
fn layers(store: &Path, cache: &Path, tag: &str) -> (Vec<Vec<String>>, String) {
    let out = store.with_extension(format!("export-{}", tag.replace(':', "-")));
    kiln_tests::run_ok(
        Command::new(KILN)
            .env("KILN_STORE", store)
            .env("KILN_CACHE", cache)
            .env("KILN_CONFIG", cache.join("no-config.toml"))
            .args(["export", tag, "--format", "oci"])
            .args(["--layer-compression", "as-built", "-o"])
            .arg(&out),
    );
    let json = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).expect("read")).expect("json")
    };
    let index = json(&out.join("index.json"));
    let m = index["manifests"][0]["digest"].as_str().expect("digest");
    let manifest = json(&out.join("blobs/sha256").join(&m["sha256:".len()..]));
    let (mut all, mut saw) = (Vec::new(), String::new());
    for l in manifest["layers"].as_array().expect("layers") {
        let d = l["digest"].as_str().expect("digest");
        let blob = out.join("blobs/sha256").join(&d["sha256:".len()..]);
        let tar = |args: &[&str]| {
            let o = kiln_tests::run_ok(Command::new("tar").arg("--zstd").args(args).arg(&blob));
            String::from_utf8(o.stdout).expect("utf-8")
        };
        let mut entries = Vec::new();
        for e in tar(&["-tf"]).lines() {
            let e = e.trim_start_matches("./").trim_end_matches('/').to_string();
            if e == "saw" {
                saw = tar(&["-xOf"]);
            }
            entries.push(e);
        }
        all.push(entries);
    }
    let _ = std::fs::remove_dir_all(&out);
    (all, saw)
}

/// The entries of `layers` in or at a package download directory or kiln's directory of
/// them (or a parent made for one).
fn package_entries(layers: &[Vec<String>]) -> Vec<&String> {
    layers
        .iter()
        .flatten()
        .filter(|e| {
            [
                "var/cache/apt",
                "var/cache/kiln-packages",
                "root/.cache",
                "root/.npm",
            ]
            .iter()
            .any(|p| e.starts_with(p))
                || e.ends_with("marker")
        })
        .collect()
}

fn context(dir: &Path, dockerfile: &str) -> std::path::PathBuf {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), dockerfile).expect("write");
    ctx
}

/// A file one `kiln build`'s step writes in a package download directory is there for the
/// next `kiln build`'s step on the host (same host cache), in no layer of either, and not in
/// the first stage's tree that the build's later step reads; `--no-package-cache` builds
/// without it, to the first build's digest.
#[test]
fn cli_builds_share_the_package_cache_and_no_layer_holds_it() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = context(t.path(), &recipe(&bb));
    let (store, cache) = (t.path().join("store"), t.path().join("cache"));

    let first = build(&ctx, &store, &cache, "pkg:1", &[]);
    let (entries, saw) = layers(&store, &cache, "pkg:1");
    assert_eq!(saw, UNSEEN, "a new host cache is empty");
    assert_eq!(
        package_entries(&entries),
        Vec::<&String>::new(),
        "{entries:?}"
    );
    assert!(
        cache.join("packages/apt/data/marker").is_file(),
        "the step's download is in the host's cache"
    );

    // Another build on the host: its step sees the first build's files.
    let second = build(&ctx, &store, &cache, "pkg:2", &["--no-cache"]);
    let (entries, saw) = layers(&store, &cache, "pkg:2");
    assert_eq!(saw, SEEN, "the second build's step sees the host's cache");
    assert_eq!(
        package_entries(&entries),
        Vec::<&String>::new(),
        "{entries:?}"
    );
    assert_ne!(second, first, "/saw differs");

    // Without the cache: nothing seen, the first build's image.
    let off = build(
        &ctx,
        &store,
        &cache,
        "pkg:3",
        &["--no-cache", "--no-package-cache"],
    );
    assert_eq!(
        off, first,
        "--no-package-cache gives the layers of an empty cache"
    );
}

/// A recipe's own mount on a package download directory wins over the host's cache: what the
/// step writes there goes to the recipe's cache, which the next build's mount finds, and
/// not to the host's package cache.
#[test]
fn a_recipes_own_cache_mount_on_a_package_dir_wins() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cache) = (t.path().join("store"), t.path().join("cache"));
    let own = context(
        &t.path().join("own"),
        &format!(
            "FROM {bb}\n\
             RUN --mount=type=cache,target=/root/.npm,id=mine echo own > /root/.npm/own\n"
        ),
    );
    build(&own, &store, &cache, "own:1", &[]);
    let check = context(
        &t.path().join("check"),
        &format!(
            "FROM {bb}\n\
             RUN --mount=type=cache,target=/root/.npm/,id=mine cat /root/.npm/own > /own\n\
             RUN if [ -e /root/.npm/own ]; then echo in the host cache >&2; exit 1; fi\n"
        ),
    );
    build(&check, &store, &cache, "own:2", &[]);
    assert!(
        !cache.join("packages/npm/data/own").exists(),
        "the recipe's mount, not the host's package cache, took the file"
    );
}

/// A tenant's build through `kiln serve` (with the same host cache as the `kiln build` before
/// it, which left its files there) sees none of the host's package cache and gives the
/// image, so the layers, of the CLI's build from an empty cache.
#[test]
fn an_api_build_sees_no_package_cache_and_gives_the_cli_digest() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = kiln_tests::serve::env();
    let ctx = context(t.path(), &recipe(&bb));
    let cache = t.path().join("cache");
    let cli = build(&ctx, &store, &cache, "pkg:1", &[]);
    assert!(cache.join("packages/pip/data/marker").is_file());

    let s = Server::launch(&Launch {
        bin: KILN.as_ref(),
        state: &state,
        store: &store,
        db: &[],
        cache: Some(&cache),
        listen: "127.0.0.1:0",
        netns: None,
        env: &[],
        extra: &[],
    });
    let key = s.key("acme", &[]);
    let c = client();
    rt().block_on(async {
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"tags": ["app:1"], "build_args": {"SOURCE_DATE_EPOCH": "1700000000"}}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert_eq!(
            v["image"],
            cli.as_str(),
            "the tenant's step saw no host cache, and its layers are the CLI's: {v:#}"
        );
    });
}

/// A step may remove the download directories (`rm -rf /root/.npm`, as
/// `base-images/debian.yaml` does after `npm install -g`): it removes the package layer's
/// symlink, not the host's cache (a mount there would fail with "Device or resource busy").
/// What the step then writes at those paths is dropped from its layer too.
#[test]
fn a_step_may_remove_the_package_dirs() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cache) = (t.path().join("store"), t.path().join("cache"));
    let ctx = context(
        t.path(),
        &format!(
            "FROM {bb}\n\
             RUN set -e; for d in {DIRS}; do echo kept > $d/kept; done; \
             rm -rf /var/cache/apt /root/.cache /root/.npm; \
             for d in {DIRS}; do test ! -e $d/kept; mkdir -p $d; echo again > $d/marker; done; \
             echo done > /done\n"
        ),
    );
    build(&ctx, &store, &cache, "rm:1", &[]);
    for name in ["apt", "pip", "npm"] {
        let kept = cache.join("packages").join(name).join("data/kept");
        assert!(
            kept.is_file(),
            "{} stays in the host's cache",
            kept.display()
        );
    }
    let (entries, _) = layers(&store, &cache, "rm:1");
    assert!(entries.iter().flatten().any(|e| e == "done"), "{entries:?}");
    assert_eq!(
        package_entries(&entries),
        Vec::<&String>::new(),
        "{entries:?}"
    );
}

/// apt, pip and npm themselves (the tools fixture, `KILN_TEST_TOOLS_REF`, from the local
/// package servers of `kiln_tests::pkgs` through the egress proxy): a second `kiln build` on
/// the host installs the same packages without fetching apt's `.deb` or npm's tarball again,
/// and no layer of either holds anything of the caches. pip keeps its cache on through the
/// symlink (`pip cache info` fails when pip disabled it); the test's index sends no caching
/// headers, so pip stores nothing from it. The recipe
/// removes Debian's `docker-clean`, as BuildKit's documentation does.
#[test]
fn apt_pip_and_npm_take_their_downloads_from_the_hosts_cache() {
    use kiln_tests::pkgs::{HELLO, PackageServers};
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let tools = require_env("KILN_TEST_TOOLS_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let (store, cache) = (t.path().join("store"), t.path().join("cache"));
    let PackageServers { apt, pypi, npm } = PackageServers::start(&t.path().join("servers"));
    let ctx = context(
        t.path(),
        &format!(
            "FROM {tools}\n\
             RUN set -e; rm -f /etc/apt/apt.conf.d/docker-clean /etc/apt/sources.list \
             /etc/apt/sources.list.d/*; \
             echo 'deb [trusted=yes] http://apt.test:{}/ test main' > /etc/apt/sources.list.d/t.list; \
             apt-get -q update; apt-get -q install -y kiln-hello; \
             pip install -q --break-system-packages --index-url http://pypi.test:{}/simple \
             --trusted-host pypi.test kiln-hello; pip cache info > /dev/null; \
             mkdir -p /app; cd /app; npm install --no-audit --no-fund --no-update-notifier \
             --registry http://npm.test:{}/ kiln-hello; \
             cat /usr/share/kiln-hello/hello.txt > /hello; \
             python3 -c 'import kiln_hello; print(kiln_hello.MSG)' >> /hello; \
             node -p \"require('kiln-hello')\" >> /hello\n",
            apt.port, pypi.port, npm.port
        ),
    );
    let mut args = vec![
        "--egress-allow-private-for-tests".to_string(),
        "--no-cache".to_string(),
    ];
    for name in PackageServers::HOSTS {
        args.extend([
            "--network-allow".into(),
            name.into(),
            "--egress-host-for-tests".into(),
            format!("{name}=127.0.0.1"),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fetched = |server: &kiln_tests::http::LocalServer, path: &str| {
        let seen = server.seen.lock().expect("lock").clone();
        seen.iter().filter(|l| l.starts_with(path)).count()
    };
    let (deb, tgz) = (
        "GET /pool/kiln-hello_1.0_all.deb ",
        "GET /tarballs/kiln-hello-1.0.0.tgz ",
    );
    for (n, tag) in ["tools:1", "tools:2"].into_iter().enumerate() {
        build(&ctx, &store, &cache, tag, &args);
        // The step's layer and the sandbox layer over it; the base's hold apt's own.
        let (all, _) = layers(&store, &cache, tag);
        let own = &all[all.len() - 2..];
        assert_eq!(package_entries(own), Vec::<&String>::new(), "{own:?}");
        assert!(own[0].iter().any(|e| e == "hello"), "{own:?}");
        // The first build fetched each once; the second, nothing more.
        assert_eq!(
            (fetched(&apt, deb), fetched(&npm, tgz)),
            (1, 1),
            "build {n}"
        );
    }
    let _ = HELLO;
}
