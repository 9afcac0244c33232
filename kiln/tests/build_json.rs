//! Issue 17, item 7: `kiln build` honours the global `--json`: stdout is one JSON object per
//! line (the step, log and layer events, then a `built` event with the digests and tags), as
//! for every other command. Needs root (build).

use std::process::Command;

#[test]
fn build_with_json_prints_only_json_events() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = kiln_tests::require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().unwrap();
    let ctx = dir.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(ctx.join("hi"), "hi\n").unwrap();
    std::fs::write(ctx.join("Dockerfile"), format!("FROM {bb}\nCOPY hi /hi\n")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", dir.path().join("store"))
        .args(["--json", "build"])
        .arg(&ctx)
        .args(["-t", "j:1", "--progress", "plain"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect();
    let step = events
        .iter()
        .find(|e| e["event"] == "step")
        .unwrap_or_else(|| panic!("no step event: {events:?}"));
    assert!(
        step["location"].as_str().unwrap().ends_with("Dockerfile:2"),
        "{step}"
    );
    let built = events.last().unwrap();
    assert_eq!(built["event"], "built", "{events:?}");
    assert_eq!(built["tags"], serde_json::json!(["j:1"]));
    for k in ["manifest", "ociManifest"] {
        let d = built[k].as_str().unwrap_or_default();
        assert!(d.starts_with("sha256:") && d.len() == 71, "{k}: {built}");
    }
    // A fresh store: the COPY runs.
    assert_eq!(
        (built["stepsRun"].as_u64(), built["stepsCached"].as_u64()),
        (Some(1), Some(0)),
        "{built}"
    );
}
