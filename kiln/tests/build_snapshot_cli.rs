//! `kiln build --snapshot` end to end (as root, real TCG boots): a busybox Dockerfile whose
//! `CMD` is the start command and whose `HEALTHCHECK` is the ready check is built, booted
//! once and snapshotted, with a prefetch list; `kiln start x:y --count 3` right after starts
//! three clones that
//! answer with distinct machine-ids; `kiln stop --all` stops them. A build whose ready check
//! never passes fails and leaves the tag where it was. Needs what `ci/setup.sh` exports
//! (`KILN_TEST_BUSYBOX_REF`, `KILN_TEST_KERNEL`/`KILN_TEST_INITRAMFS` or `KILN_TEST_CACHE`).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Output;

use kiln_store::{Manifest, Store, TagRef};
use kiln_tests::require_env;
use kiln_tests::vm::{StopClones, kiln_in};
use serde_json::Value;

fn kiln(dir: &Path, args: &[&str]) -> Output {
    kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
        .args(args)
        .output()
        .expect("run kiln")
}

fn ok(o: &Output) {
    kiln_tests::assert_success(o, "kiln");
}

fn build(dir: &Path, dockerfile: &str, tag: &str) -> Output {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), dockerfile).expect("write");
    let f = ctx.join("Dockerfile");
    kiln(
        dir,
        &[
            "build",
            "-f",
            f.to_str().expect("utf-8"),
            "--snapshot",
            "--memory-mib",
            "256",
            "--progress",
            "plain",
            "-t",
            tag,
        ],
    )
}

async fn tagged(dir: &Path, tag: &str) -> Option<kiln_store::ManifestDigest> {
    let store = Store::open(dir.join("store").to_str().expect("utf-8"))
        .await
        .expect("store");
    let t: TagRef = tag.parse().expect("tag");
    store
        .get_tag(&t)
        .await
        .expect("get tag")
        .map(|r| r.manifest)
}

#[test]
fn build_snapshot_then_start_three_clones() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let _stop = StopClones::new(env!("CARGO_BIN_EXE_kiln"), d);
    let rt = tokio::runtime::Runtime::new().expect("runtime");

    let o = build(
        d,
        &format!(
            "FROM {bb}\nRUN echo hello > /greeting\n\
             CMD [\"sh\", \"-c\", \"touch /tmp/up; exec sleep 1000000\"]\n\
             HEALTHCHECK --interval=100ms --timeout=1s --retries=300 CMD test -e /tmp/up\n"
        ),
        "x:y",
    );
    ok(&o);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let printed = stdout.lines().last().expect("a digest line").to_string();
    // The tag names the image manifest printed, and that manifest names a snapshot.
    let at_tag = rt.block_on(tagged(d, "x:y")).expect("x:y is tagged");
    assert_eq!(at_tag.to_string(), printed);
    let snapshot = rt.block_on(async {
        let store = Store::open(d.join("store").to_str().expect("utf-8"))
            .await
            .expect("store");
        let snapshot = match store.get_manifest(&at_tag).await.expect("manifest") {
            Manifest::Image(m) => m.snapshot.expect("the image names its snapshot"),
            m => panic!("not an image: {m:?}"),
        };
        // As `kiln snapshot`, the build recorded the chunks a restore reads (issue 35 §2).
        match store
            .get_manifest(&snapshot)
            .await
            .expect("snapshot manifest")
        {
            Manifest::Snapshot(s) => {
                let list = s.prefetch.expect("the snapshot has a prefetch list");
                assert!(!list.memory.is_empty(), "{list:?}");
            }
            m => panic!("not a snapshot: {m:?}"),
        }
        snapshot
    });

    let o = kiln(d, &["--json", "start", "x:y", "--count", "3"]);
    ok(&o);
    let started: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .filter(|v| v["event"] == "started")
        .collect();
    assert_eq!(started.len(), 3, "{started:?}");
    let ids: BTreeSet<String> = started
        .iter()
        .map(|s| s["machine_id"].as_str().expect("machine_id").to_string())
        .collect();
    assert_eq!(ids.len(), 3, "machine-ids not distinct: {started:?}");
    assert!(ids.iter().all(|i| i.len() == 32), "{ids:?}");
    assert!(
        started
            .iter()
            .all(|s| s["snapshot"] == snapshot.to_string()),
        "{started:?}"
    );
    ok(&kiln(d, &["stop", "--all"]));

    // A ready check that never passes fails the build; x:y does not move.
    let o = build(
        d,
        &format!(
            "FROM {bb}\nCMD [\"sleep\", \"1000000\"]\n\
             HEALTHCHECK --interval=100ms --timeout=1s --retries=3 CMD false\n"
        ),
        "x:y",
    );
    assert!(!o.status.success(), "a failing ready check built: {o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("nothing tagged"), "{err}");
    assert_eq!(rt.block_on(tagged(d, "x:y")), Some(at_tag));
}
