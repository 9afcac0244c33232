//! Issue 17, item 6: image names as Docker users write them, through every store command that
//! takes one: `myorg/app:v1` (a repository path of `/`-separated components), and `app` for
//! `app:latest`. A nested name and its neighbours (`myorg:app`, `myorg/app/sub:v1`) live side
//! by side in one local store without colliding.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn kiln(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_STORE", store)
        .output()
        .unwrap()
}

/// Runs kiln and insists on success; returns its `--json` events.
fn ok(store: &Path, args: &[&str]) -> Vec<Value> {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let o = kiln(store, &a);
    assert!(o.status.success(), "kiln {args:?}: {o:?}");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

fn tags(store: &Path, args: &[&str]) -> Vec<String> {
    let mut a = vec!["tags"];
    a.extend_from_slice(args);
    ok(store, &a)
        .iter()
        .filter_map(|e| e["tag"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn docker_style_names_through_every_store_command() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let disk = |name: &str, byte: u8| {
        let p = dir.path().join(name);
        std::fs::write(&p, vec![byte; 300_000]).unwrap();
        p.to_str().unwrap().to_string()
    };
    let (one, two) = (disk("one.img", 1), disk("two.img", 2));

    // `store import` with a nested name and with a bare name (`:latest`).
    let ev = ok(&store, &["store", "import", &one, "myorg/app:v1"]);
    let digest = ev.last().unwrap()["manifest"].as_str().unwrap().to_string();
    ok(&store, &["store", "import", &two, "app"]);
    // `tag`: to a bare nested name, and to the neighbour whose key could collide.
    ok(&store, &["tag", "myorg/app:v1", "myorg/app"]);
    ok(&store, &["tag", "app", "myorg:app"]);
    ok(&store, &["tag", &digest, "myorg/app/sub:v1"]);
    assert!(store.join("tags/myorg/app").is_file());
    assert!(store.join("tags/myorg~2fapp/v1").is_file());

    assert_eq!(
        tags(&store, &[]),
        [
            "app:latest",
            "myorg:app",
            "myorg/app:latest",
            "myorg/app:v1",
            "myorg/app/sub:v1"
        ]
    );
    assert_eq!(
        tags(&store, &["myorg/app"]),
        ["myorg/app:latest", "myorg/app:v1"]
    );
    assert_eq!(tags(&store, &["myorg"]), ["myorg:app"]);

    // `images`, `inspect` (bare nested name = :latest), `store export`.
    let images = ok(&store, &["images"]);
    assert!(
        images
            .iter()
            .any(|e| e["name"] == "myorg/app" && e["tag"] == "v1" && e["manifest"] == *digest),
        "{images:?}"
    );
    let ev = ok(&store, &["inspect", "myorg/app"]);
    assert_eq!(ev.last().unwrap()["manifest"], *digest);
    let out = dir.path().join("out.img");
    ok(
        &store,
        &["store", "export", "myorg/app:v1", out.to_str().unwrap()],
    );
    assert_eq!(std::fs::read(&out).unwrap(), vec![1u8; 300_000]);

    // `store push` / `store pull` of a nested name between two local stores.
    let other = dir.path().join("other");
    let o = other.to_str().unwrap();
    ok(&store, &["store", "push", "myorg/app:v1", "--to", o]);
    assert_eq!(tags(&other, &[]), ["myorg/app:v1"]);
    let third = dir.path().join("third");
    ok(&third, &["store", "pull", "myorg/app:v1", "--from", o]);
    assert_eq!(tags(&third, &[]), ["myorg/app:v1"]);

    // verify is clean and GC with no grace keeps everything tagged.
    let ev = ok(&store, &["store", "verify", "--deep"]);
    assert!(!ev.iter().any(|e| e["event"] == "finding"), "{ev:?}");
    let ev = ok(&store, &["store", "gc", "--grace", "0s"]);
    assert!(!ev.iter().any(|e| e["event"] == "collected"), "{ev:?}");

    // `untag` and `rmi` take the same names, and remove only the one named.
    ok(&store, &["untag", "myorg/app"]);
    ok(&store, &["rmi", "myorg/app:v1"]);
    assert_eq!(
        tags(&store, &[]),
        ["app:latest", "myorg:app", "myorg/app/sub:v1"]
    );

    // What Docker refuses too: empty or dot components, upper case, a registry host.
    for bad in [
        "myorg//app:v1",
        "myorg/../app:v1",
        "/app:v1",
        "myorg/:v1",
        "MyOrg/app:v1",
        "localhost:5000/app:v1",
    ] {
        let o = kiln(&store, &["tag", "app", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}: {o:?}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("invalid tag reference"), "{bad}: {stderr}");
    }
}

/// `kiln build -t myorg/app:v1 -t app` tags both; a later `FROM myorg/app:v1` finds the built
/// image in the store with `--offline`; `kiln export`, `kiln unpack` and `kiln push` take it
/// by that name.
#[test]
fn build_tags_nested_and_bare_names_and_from_finds_them() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = kiln_tests::require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let ctx = dir.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(ctx.join("hi"), "hi\n").unwrap();
    std::fs::write(ctx.join("Dockerfile"), format!("FROM {bb}\nCOPY hi /hi\n")).unwrap();
    let build = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .env("KILN_STORE", &store)
            .arg("build")
            .arg(&ctx)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "kiln build {args:?}: {o:?}");
        String::from_utf8(o.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap()
            .to_string()
    };
    let first = build(&["-t", "myorg/app:v1", "-t", "app"]);
    assert_eq!(tags(&store, &[]), ["app:latest", "myorg/app:v1"]);
    std::fs::write(ctx.join("Dockerfile"), "FROM myorg/app:v1\nCOPY hi /hi2\n").unwrap();
    let second = build(&["--offline", "-t", "myorg/app/child"]);
    assert_ne!(first, second);
    assert_eq!(
        tags(&store, &["myorg/app/child"]),
        ["myorg/app/child:latest"]
    );
    let layout = dir.path().join("layout");
    let o = kiln(
        &store,
        &[
            "export",
            "myorg/app:v1",
            "--format",
            "oci",
            "-o",
            layout.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let index = std::fs::read_to_string(layout.join("index.json")).unwrap();
    assert!(index.contains("\"v1\""), "{index}");
    // `kiln unpack` and `kiln push` (to the test registry) find it by the same name.
    let rootfs = dir.path().join("rootfs");
    let o = kiln(
        &store,
        &["unpack", "myorg/app:v1", rootfs.to_str().unwrap()],
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(std::fs::read_to_string(rootfs.join("hi")).unwrap(), "hi\n");
    let registry = kiln_tests::require_env("KILN_TEST_REGISTRY");
    let dst = format!("{registry}/names-{}/app:v1", std::process::id());
    let o = kiln(&store, &["push", "myorg/app:v1", &dst]);
    assert!(o.status.success(), "{o:?}");
}
