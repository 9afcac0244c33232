//! Issue 17, item 7: `kiln plan --resolve` prints the plan that `kiln build` builds: the
//! base image's env and working directory, and its ONBUILD triggers spliced in (without
//! `--resolve`, the plan is lowered from the file alone). Needs root (it builds the base).

use std::path::Path;
use std::process::{Command, Output};

fn kiln(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", store)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn plan_resolve_applies_the_base_config_and_onbuild() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = kiln_tests::require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let base = dir.path().join("base");
    std::fs::create_dir(&base).unwrap();
    std::fs::write(
        base.join("Dockerfile"),
        format!("FROM {bb}\nENV GREETING=hi\nWORKDIR /w\nONBUILD RUN echo triggered > /t\n"),
    )
    .unwrap();
    let o = kiln(
        &store,
        &["build", base.to_str().unwrap(), "-t", "myorg/onbase:1"],
    );
    assert!(o.status.success(), "{o:?}");
    let child = dir.path().join("Dockerfile");
    std::fs::write(&child, "FROM myorg/onbase:1\nRUN echo child\n").unwrap();
    let plan = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["--json", "plan", child.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = kiln(&store, &args);
        assert!(o.status.success(), "{extra:?}: {o:?}");
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let steps = |p: &serde_json::Value| p["stages"][0]["steps"].as_array().unwrap().clone();

    let alone = plan(&[]);
    assert_eq!(steps(&alone).len(), 1, "{alone}");
    assert!(!alone.to_string().contains("GREETING=hi"));

    let built = plan(&["--resolve", "--offline"]);
    let s = steps(&built);
    assert_eq!(s.len(), 2, "{built}");
    assert_eq!(s[0]["action"]["argv"][2], "echo triggered > /t", "{built}");
    assert_eq!(s[1]["action"]["argv"][2], "echo child", "{built}");
    for step in &s {
        assert_eq!(step["context"]["workdir"], "/w", "{step}");
        let env = step["context"]["env"].as_array().unwrap();
        assert!(env.iter().any(|e| e == "GREETING=hi"), "{step}");
    }
}
