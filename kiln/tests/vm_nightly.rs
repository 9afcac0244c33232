//! `kiln nightly` end to end (as root, real TCG boots) on a busybox YAML recipe with smoke
//! checks, four nights in one test to keep boots few:
//! 1. a night whose smoke check fails: exit 1, the check's output in the error, no tag;
//! 2. a night that passes: the tag and `NAME:nightly-YYYYMMDD` name the new image, which
//!    names a snapshot; the JSON report has the chunk counts and the checks; `--keep 1`
//!    untags the older `nightly-*` tag;
//! 3. another promotion moves the tag, then a night expecting the digest read before it:
//!    exit 4, the tag stays where the other promotion put it, only the night's tag is set;
//!    with `SOURCE_DATE_EPOCH` fixed in nights 2 and 3, night 3 stores no new ext4 chunk and
//!    reports no package changed;
//! 4. a night whose one dpkg package moved to a new version: the report names it.
//!
//! Each night's report is kept in the store beside the tag's history. Then `kiln nightly
//! --rollback` twice walks the tag back through the nights. Every night's smoke clones were
//! served lazily by a chunk server, as `kiln start`'s are (issue 35 §3).
//!
//! And one night fired on several nodes at once against one `s3://` store (issue 19,
//! "Nightly on many nodes"): exactly one run promotes, the others exit 4 saying another run
//! promoted.
//!
//! Needs what `ci/setup.sh` exports (`KILN_TEST_BUSYBOX_REF`, the moto S3 server, the guest
//! kernel and initramfs).

use std::path::Path;
use std::process::Output;

use kiln_store::{Manifest, ManifestDigest, Store, TagRef};
use kiln_tests::require_env;
use kiln_tests::vm::{kiln_in, show};
use kiln_vmm::lazy;
use serde_json::Value;

fn kiln(dir: &Path, args: &[&str]) -> Output {
    kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
        .args(args)
        .output()
        .expect("run kiln")
}

/// How many snapshots of the snapshot cache `cache` a chunk server served (a non-empty
/// chunks log), after checking that none was downloaded whole (no `complete` marker): the
/// nightly's smoke clones start lazily, through the path `kiln start` takes (issue 35 §3).
/// Waits (at most 60 s) for the idle servers to leave their mounts, so that the test's
/// temporary directory goes whole.
fn served_lazily(cache: &Path) -> usize {
    let mut served = 0;
    for e in std::fs::read_dir(cache).expect("snapshot cache") {
        let snap = e.expect("entry").path();
        if !snap.is_dir() {
            continue;
        }
        assert!(
            !snap.join("complete").exists(),
            "{}: downloaded whole",
            snap.display()
        );
        let log = std::fs::read_to_string(snap.join(lazy::CHUNK_LOG)).unwrap_or_default();
        served += usize::from(!log.trim().is_empty());
        assert!(
            kiln_tests::vm::wait_unmounted(&snap),
            "{}: the idle chunk server left",
            snap.display()
        );
    }
    served
}

/// A busybox recipe with a start command, a ready check and `smoke`.
fn recipe(dir: &Path, bb: &str, smoke: &str) -> String {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    let f = ctx.join("nightly.yaml");
    std::fs::write(
        &f,
        format!(
            "from: {bb}\n\
             args:\n  PKG_VERSION: \"1.0\"\n\
             commands:\n  - echo night > /greeting\n\
             \x20 - 'mkdir -p /var/lib/dpkg && printf \"Package: kiln-probe\\nStatus: install ok installed\\nVersion: %s\\n\" \"$PKG_VERSION\" > /var/lib/dpkg/status'\n\
             start:\n  command: [sh, -c, \"touch /tmp/up; exec sleep 1000000\"]\n\
             ready:\n  command: test -e /tmp/up\n  interval: 100ms\n  retries: 300\n\
             smoke:\n{smoke}"
        ),
    )
    .expect("write");
    f.to_str().expect("utf-8").to_string()
}

/// `kiln --json nightly RECIPE --tag bb:latest --day DAY EXTRA...`: the output and the
/// `nightly` report event.
fn night(dir: &Path, recipe: &str, day: &str, extra: &[&str]) -> (Output, Value) {
    let mut args = vec![
        "--json",
        "nightly",
        recipe,
        "--tag",
        "bb:latest",
        "--day",
        day,
        "--memory-mib",
        "256",
    ];
    args.extend_from_slice(extra);
    let o = kiln(dir, &args);
    let report = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "nightly")
        .unwrap_or_else(|| panic!("no nightly report: {}", show(&o)));
    (o, report)
}

async fn tag(store: &Store, t: &str) -> Option<ManifestDigest> {
    let t: TagRef = t.parse().expect("tag");
    store
        .get_tag(&t)
        .await
        .expect("get tag")
        .map(|r| r.manifest)
}

#[test]
fn vm_nightly_promotes_only_on_success() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = rt
        .block_on(Store::open(d.join("store").to_str().expect("utf-8")))
        .expect("store");

    // 1. A failing check: nothing promoted, the check's output said.
    let bad = recipe(
        d,
        &bb,
        "  - {command: cat /greeting, output: night}\n  - command: echo smoke-says-no; exit 3\n",
    );
    let (o, r) = night(d, &bad, "20261130", &[]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("smoke-says-no"), "{}", show(&o));
    assert!(stderr.contains("exited 3, expected 0"), "{}", show(&o));
    assert_eq!(r["outcome"], "failed", "{r}");
    assert_eq!(r["step"], "smoke", "{r}");
    assert_eq!(r["checks"][0]["passed"], true, "{r}");
    assert_eq!(r["checks"][1]["passed"], false, "{r}");
    let failed_image: ManifestDigest = r["image"].as_str().expect("image").parse().unwrap();
    assert_eq!(rt.block_on(tag(&store, "bb:latest")), None);
    assert_eq!(rt.block_on(tag(&store, "bb:nightly-20261130")), None);
    let ps = kiln(d, &["--json", "ps"]);
    assert!(
        !String::from_utf8_lossy(&ps.stdout).contains("\"id\""),
        "the smoke clone was stopped: {}",
        show(&ps)
    );

    // 2. Every check passes: promoted; `--keep 1` untags the older night (an older
    // `nightly-*` tag set by hand here), not other tags.
    for t in ["bb:nightly-20261101", "bb:keep-me"] {
        let o = kiln(d, &["tag", &failed_image.to_string(), t]);
        assert!(o.status.success(), "{}", show(&o));
    }
    let good = recipe(
        d,
        &bb,
        "  - {command: cat /greeting, output: night}\n  - {command: [hostname], output: runtime-guest}\n  - {command: [sh, -c, \"exit 5\"], exit: 5}\n",
    );
    let epoch = "SOURCE_DATE_EPOCH=1700000000";
    let (o, r) = night(d, &good, "20261201", &["--keep", "1", "--build-arg", epoch]);
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(r["outcome"], "promoted", "{r}");
    assert_eq!(r["previous"], Value::Null, "{r}");
    assert_eq!(r["packages"], Value::Null, "nothing to compare with: {r}");
    assert_eq!(r["checks"].as_array().map(Vec::len), Some(4), "{r}");
    // The built-in check after the recipe's: two clones, two different machine-ids.
    assert_eq!(
        r["checks"][3]["location"],
        kiln_pipeline::nightly::MACHINE_ID_CHECK,
        "{r}"
    );
    assert_eq!(r["checks"][3]["passed"], true, "{r}");
    assert_eq!(
        r["untagged"],
        serde_json::json!(["bb:nightly-20261101"]),
        "{r}"
    );
    assert_eq!(rt.block_on(tag(&store, "bb:nightly-20261101")), None);
    assert_eq!(rt.block_on(tag(&store, "bb:keep-me")), Some(failed_image));
    assert!(r["disk"]["new_chunks"].as_u64().is_some(), "{r}");
    assert!(r["disk"]["reused_chunks"].as_u64().is_some(), "{r}");
    assert!(r["steps_run"].as_u64() >= Some(1), "no cache: {r}");
    assert_eq!(r["steps_cached"], 0, "no cache: {r}");
    let first: ManifestDigest = r["image"].as_str().expect("image").parse().unwrap();
    assert_eq!(rt.block_on(tag(&store, "bb:latest")), Some(first));
    assert_eq!(rt.block_on(tag(&store, "bb:nightly-20261201")), Some(first));
    match rt.block_on(store.get_manifest(&first)).expect("manifest") {
        Manifest::Image(m) => assert_eq!(
            m.snapshot.map(|s| s.to_string()),
            r["snapshot"].as_str().map(str::to_string)
        ),
        m => panic!("not an image: {m:?}"),
    }

    // 3. Another promotion between the night's start and its end: exit 4, nothing moved
    // but the night's own tag.
    let o = kiln(d, &["tag", &failed_image.to_string(), "bb:latest"]);
    assert!(o.status.success(), "{}", show(&o));
    let (o, r) = night(
        d,
        &good,
        "20261202",
        &[
            "--expect",
            &first.to_string(),
            "--keep",
            "2",
            "--build-arg",
            epoch,
        ],
    );
    assert_eq!(o.status.code(), Some(4), "{}", show(&o));
    assert_eq!(r["outcome"], "lost_race", "{r}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("moved during the night"),
        "{}",
        show(&o)
    );
    let second: ManifestDigest = r["image"].as_str().expect("image").parse().unwrap();
    // The same recipe, SOURCE_DATE_EPOCH fixed, nothing changed upstream: every step reran
    // (no cache) and the ext4 image is made of the chunks the night before stored.
    assert_eq!(r["steps_cached"], 0, "{r}");
    assert_eq!(r["disk"]["new_chunks"], 0, "{r}");
    assert_eq!(
        r["packages"],
        serde_json::json!({"added": [], "removed": [], "changed": []}),
        "the same dpkg status: {r}"
    );
    assert!(r["disk"]["reused_chunks"].as_u64() > Some(0), "{r}");
    assert_eq!(rt.block_on(tag(&store, "bb:latest")), Some(failed_image));
    assert_eq!(
        rt.block_on(tag(&store, "bb:nightly-20261202")),
        Some(second)
    );

    // 4. One package changed (its version is a build arg): the report names it, against the
    // image the tag names when the night starts (night 1's, tagged by hand above).
    let (o, r) = night(
        d,
        &good,
        "20261203",
        &["--build-arg", epoch, "--build-arg", "PKG_VERSION=1.1"],
    );
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(r["previous"], failed_image.to_string(), "{r}");
    assert_eq!(
        r["packages"],
        serde_json::json!({"added": [], "removed": [],
            "changed": [{"name": "kiln-probe", "from": "1.0", "to": "1.1"}]}),
        "{r}"
    );
    let fourth: ManifestDigest = r["image"].as_str().expect("image").parse().unwrap();
    let o = kiln(d, &["nightly", "--rollback", "--tag", "bb:latest"]);
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(rt.block_on(tag(&store, "bb:latest")), Some(second));
    let o = kiln(d, &["tag", &fourth.to_string(), "bb:latest"]);
    assert!(o.status.success(), "{}", show(&o));

    // Each night's report is kept beside the tag's history.
    let kept = rt
        .block_on(store.tag_reports(&"bb:latest".parse().unwrap()))
        .expect("reports");
    let outcomes: Vec<&Value> = kept.iter().map(|r| &r["outcome"]).collect();
    assert_eq!(
        outcomes,
        ["failed", "promoted", "lost_race", "promoted"],
        "{kept:?}"
    );

    // Rollback: the newest night first (the tag names no night), then the one before it.
    for want in [second, first] {
        let o = kiln(d, &["nightly", "--rollback", "--tag", "bb:latest"]);
        assert!(o.status.success(), "{}", show(&o));
        assert_eq!(rt.block_on(tag(&store, "bb:latest")), Some(want));
    }
    let o = kiln(d, &["nightly", "--rollback", "--tag", "bb:latest"]);
    assert!(
        !o.status.success(),
        "no night before the first: {}",
        show(&o)
    );
    assert_eq!(rt.block_on(tag(&store, "bb:latest")), Some(first));
    // Four nights, each with a snapshot of its own (night 3's may repeat night 2's).
    assert!(
        served_lazily(&d.join("cache")) >= 3,
        "smoke clones served lazily"
    );
}

/// Nodes firing one night at once in [`one_night_on_several_nodes_promotes_once`]: three
/// nights with their boots and two smoke clones each share the machine's two cores.
const NODES: usize = 3;

/// Issue 19, "Nightly on many nodes": `kiln nightly` fired on [`NODES`] nodes at once (one
/// process each, with its own cache, state and snapshot directories) against one `s3://`
/// store. Every run builds the same image manifest (the same inputs, `SOURCE_DATE_EPOCH`
/// fixed) and boots its own snapshot; exactly one promotes (exit 0), and every other exits 4
/// saying that another run of this night promoted first, naming the winner's image and that
/// it is the same build. `bb:latest` and `bb:nightly-DAY` both name the winner's image, the
/// store verifies clean (`--deep`), and the store keeps every run's report.
///
/// Before the night's tag moved by compare-and-swap, each run forced `bb:nightly-DAY` to its
/// own image, so it ended naming the last run's image rather than the promoted one, and the
/// losers reported `lost_race` ("moved during the night").
#[test]
fn one_night_on_several_nodes_promotes_once() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let url = kiln_tests::stores::fresh_url(kiln_tests::stores::Kind::S3, d, "nightly-nodes");
    let recipe = recipe(d, &bb, "  - {command: cat /greeting, output: night}\n");
    let node = |i: usize| {
        let home = d.join(format!("node{i}"));
        std::fs::create_dir_all(&home).expect("mkdir");
        let mut c = kiln_in(env!("CARGO_BIN_EXE_kiln"), &home);
        c.env("KILN_STORE", &url)
            .env("KILN_CACHE", home.join("kiln-cache"))
            .env("KILN_CONFIG", home.join("no-config.toml"));
        c
    };
    // Started together: each reads both tags when its night starts, long before any night
    // reaches its promotion (after a build, a boot and a smoke clone).
    let runs: Vec<_> = (0..NODES)
        .map(|i| {
            node(i)
                .args([
                    "--json",
                    "nightly",
                    &recipe,
                    "--tag",
                    "bb:latest",
                    "--day",
                    "20261204",
                    "--memory-mib",
                    "256",
                    "--build-arg",
                    "SOURCE_DATE_EPOCH=1700000000",
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start kiln nightly")
        })
        .collect();
    let runs: Vec<(Output, Value)> = runs
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().expect("kiln nightly");
            let report = String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["event"] == "nightly")
                .unwrap_or_else(|| panic!("no nightly report: {}", show(&o)));
            (o, report)
        })
        .collect();
    let all = runs
        .iter()
        .map(|(o, _)| show(o))
        .collect::<Vec<_>>()
        .join("\n---\n");

    let winners: Vec<&(Output, Value)> = runs.iter().filter(|(o, _)| o.status.success()).collect();
    assert_eq!(winners.len(), 1, "exactly one run promotes:\n{all}");
    let (_, w) = winners[0];
    assert_eq!(w["outcome"], "promoted", "{w}");
    let image = w["image"].as_str().expect("image").to_string();
    let built = w["built"].as_str().expect("built image").to_string();
    for (o, r) in &runs {
        assert_eq!(
            r["built"],
            built.as_str(),
            "the same build everywhere:\n{all}"
        );
        if o.status.success() {
            continue;
        }
        assert_eq!(o.status.code(), Some(4), "{}", show(o));
        assert_eq!(r["outcome"], "promoted_by_another_run", "{r}");
        assert_eq!(r["night"], image.as_str(), "{r}");
        assert_eq!(r["night_built"], built.as_str(), "{r}");
        assert_eq!(r["tag_names_night"], true, "{r}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            stderr.contains("another run of this night promoted first")
                && stderr.contains(&format!("the same build {built}"))
                && stderr.contains("bb:latest names it")
                && stderr.contains("this night moved no tag"),
            "{}",
            show(o)
        );
    }

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = rt.block_on(Store::open(&url)).expect("store");
    let image: ManifestDigest = image.parse().expect("digest");
    assert_eq!(rt.block_on(tag(&store, "bb:latest")), Some(image));
    assert_eq!(rt.block_on(tag(&store, "bb:nightly-20261204")), Some(image));
    let kept = rt
        .block_on(store.tag_reports(&"bb:latest".parse().unwrap()))
        .expect("reports");
    let promoted = kept.iter().filter(|r| r["outcome"] == "promoted").count();
    assert_eq!((kept.len(), promoted), (NODES, 1), "{kept:?}");
    let o = node(0)
        .args(["store", "verify", "--deep"])
        .output()
        .expect("kiln store verify");
    assert!(o.status.success(), "verify --deep: {}", show(&o));
    for i in 0..NODES {
        assert_eq!(
            served_lazily(&d.join(format!("node{i}/cache"))),
            1,
            "node {i}: its smoke clones served lazily from S3"
        );
    }
}
