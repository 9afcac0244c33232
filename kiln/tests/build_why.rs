//! Issue 39: `kiln build` says, for each step that missed the build cache, why, against the
//! nearest earlier build of the step: the first build has none; a changed context file is
//! named alone; a changed build arg by name; a changed base; `--no-cache` and
//! `--no-cache-filter`. Real builds on the busybox fixture, namespace executor, one store.
//! Needs root (build).

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

/// Runs `kiln build` of `ctx` into `store` tagged `tag` with `extra` arguments; with `json`,
/// the step events (stdout, global `--json`), else the stderr lines (`--progress plain`).
fn build(store: &Path, ctx: &Path, tag: &str, extra: &[&str], json: bool) -> (Vec<Value>, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_STORE", store);
    if json {
        c.arg("--json");
    }
    let o = c
        .arg("build")
        .arg(ctx)
        .args(["-t", tag, "--progress", "plain"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let events = if json {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
            .filter(|e: &Value| e["event"] == "step")
            .collect()
    } else {
        Vec::new()
    };
    (events, String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The `why` of the step event whose instruction starts with `prefix` (`null` for a hit).
fn why(events: &[Value], prefix: &str) -> Value {
    let e = events
        .iter()
        .find(|e| e["instruction"].as_str().unwrap_or("").starts_with(prefix))
        .unwrap_or_else(|| panic!("no step {prefix}: {events:?}"));
    if e["cached"] == true {
        return Value::Null;
    }
    e["why"].clone()
}

#[test]
fn a_missed_step_says_why() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = kiln_tests::require_env("KILN_TEST_BUSYBOX_REF");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let (base, app) = (dir.path().join("base"), dir.path().join("app"));
    std::fs::create_dir(&base).unwrap();
    std::fs::create_dir(&app).unwrap();
    std::fs::write(
        base.join("Dockerfile"),
        format!("FROM {bb}\nRUN echo one > /one\n"),
    )
    .unwrap();
    build(&store, &base, "why-base:1", &[], true);
    std::fs::write(
        app.join("Dockerfile"),
        "FROM why-base:1\nARG V\nARG W\nCOPY . /app\nRUN echo $V $W > /v\n",
    )
    .unwrap();
    std::fs::write(app.join("a.txt"), "a\n").unwrap();
    std::fs::write(app.join("b.txt"), "b\n").unwrap();
    let args = ["--build-arg", "V=1", "--build-arg", "W=1"];

    // The first build: no earlier build, for every step.
    let (ev, _) = build(&store, &app, "why-app:1", &args, true);
    let none = json!([{"reason": "no_earlier_build"}]);
    assert_eq!(why(&ev, "COPY"), none, "{ev:?}");
    assert_eq!(why(&ev, "RUN"), none, "{ev:?}");

    // One context file changed: the COPY names it and nothing else; the RUN after it ran
    // because the COPY did.
    std::fs::write(app.join("a.txt"), "a2\n").unwrap();
    let (ev, _) = build(&store, &app, "why-app:1", &args, true);
    assert_eq!(
        why(&ev, "COPY"),
        json!([{"reason": "context_files", "files": ["a.txt"], "more": 0}]),
        "{ev:?}"
    );
    let copy = ev
        .iter()
        .find(|e| e["instruction"] == "COPY . /app")
        .unwrap();
    assert_eq!(copy["whyText"], "context file a.txt changed", "{copy}");
    assert_eq!(
        why(&ev, "RUN"),
        json!([{"reason": "earlier_step"}]),
        "{ev:?}"
    );

    // One build arg changed: the COPY is a hit, the RUN names the arg (plain output: one
    // line per missed step).
    let (_, plain) = build(
        &store,
        &app,
        "why-app:1",
        &["--build-arg", "V=2", "--build-arg", "W=1"],
        false,
    );
    assert!(plain.contains("COPY . /app CACHED"), "{plain}");
    let ran: Vec<&str> = plain.lines().filter(|l| l.contains(" ran: ")).collect();
    assert!(
        ran.first()
            .is_some_and(|l| l.starts_with("step ") && l.ends_with(" ran: build arg V changed")),
        "{plain}"
    );

    // --no-cache says so, for every step.
    let (ev, _) = build(&store, &app, "why-app:1", &["--no-cache"], true);
    for s in ["COPY", "RUN"] {
        assert_eq!(why(&ev, s), json!([{"reason": "no_cache"}]), "{ev:?}");
    }

    // --no-cache-filter naming the stage (by index) says so, for each of its steps.
    let (ev, _) = build(
        &store,
        &app,
        "why-app:1",
        &[
            "--no-cache-filter",
            "0",
            "--build-arg",
            "V=2",
            "--build-arg",
            "W=1",
        ],
        true,
    );
    for s in ["COPY", "RUN"] {
        assert_eq!(
            why(&ev, s),
            json!([{"reason": "no_cache_filter"}]),
            "{ev:?}"
        );
    }

    // The base changed: the first step names the base alone.
    std::fs::write(
        base.join("Dockerfile"),
        format!("FROM {bb}\nRUN echo two > /one\n"),
    )
    .unwrap();
    let (ev, _) = build(&store, &base, "why-base:1", &[], true);
    assert_eq!(
        why(&ev, "RUN"),
        json!([{"reason": "instruction"}]),
        "{ev:?}"
    );
    let (ev, _) = build(
        &store,
        &app,
        "why-app:1",
        &["--build-arg", "V=2", "--build-arg", "W=1"],
        true,
    );
    let w = why(&ev, "COPY");
    assert_eq!(w[0]["reason"], "base", "{ev:?}");
    assert_eq!(w.as_array().map(Vec::len), Some(1), "{ev:?}");

    // No build-arg value is stored in the records, also where it reaches the instruction,
    // the working directory and a mount; a file name's control characters are
    // escaped in the reason.
    let canary = dir.path().join("canary");
    std::fs::create_dir(&canary).unwrap();
    std::fs::write(
        canary.join("Dockerfile"),
        format!(
            "FROM {bb}\nARG S\nWORKDIR /w/$S\n\
             RUN --mount=type=tmpfs,target=/t/$S echo $S > /s\nCOPY . /c\n"
        ),
    )
    .unwrap();
    let evil = "evil\nstep 9 ran: forged\u{1b}[31m";
    std::fs::write(canary.join(evil), "1\n").unwrap();
    let value = ["--build-arg", "S=kiln-canary-value-7431"];
    build(&store, &canary, "why-canary:1", &value, true);
    std::fs::write(canary.join(evil), "2\n").unwrap();
    let (_, plain) = build(&store, &canary, "why-canary:1", &value, false);
    assert!(
        plain.contains("context file evil\\u{a}step 9 ran: forged\\u{1b}[31m changed"),
        "{plain}"
    );
    assert!(!plain.contains("step 9 ran: forged\u{1b}"), "{plain}");
    for sub in ["cache-inputs", "cache-index"] {
        let d = store.join(sub);
        let entries: Vec<_> = std::fs::read_dir(&d).expect("records").flatten().collect();
        assert!(!entries.is_empty(), "{}", d.display());
        for e in entries {
            let text = std::fs::read(e.path()).unwrap();
            assert!(
                !String::from_utf8_lossy(&text).contains("kiln-canary-value-7431"),
                "{}",
                e.path().display()
            );
        }
    }
}
