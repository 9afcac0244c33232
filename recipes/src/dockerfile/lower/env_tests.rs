use super::*;
use crate::load_dockerfile;

#[test]
fn undefined_variables_warn_and_base_env_fills_them() {
    let text = "FROM golang:1.22\nENV PATH=/usr/local/go/bin:$PATH GOFLAGS=${GOFLAGS:-x} G=$GOPATH/bin\nRUN go version\n";
    let p = load_dockerfile("Dockerfile", text.as_bytes(), &Options::default()).unwrap();
    // Unknown base env: PATH falls back to Docker's default, anything else is empty.
    assert_eq!(
        p.stages[0].config.env,
        [
            "PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "GOFLAGS=x",
            "G=/bin"
        ]
    );
    assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
    assert!(p.warnings[0].message.contains("GOPATH"));
    assert_eq!(p.warnings[0].location.as_ref().unwrap().start_line, 2);
    let base = crate::BaseImage {
        env: vec!["PATH=/usr/bin".to_string(), "GOPATH=/go".into()],
        workdir: Some("/go".into()),
        user: Some("gopher".into()),
        onbuild: Vec::new(),
    };
    let options = Options {
        base_images: [("golang:1.22".to_string(), base)].into(),
        ..Options::default()
    };
    let p = load_dockerfile("Dockerfile", text.as_bytes(), &options).unwrap();
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    assert_eq!(
        p.stages[0].config.env,
        [
            "PATH=/usr/local/go/bin:/usr/bin",
            "GOPATH=/go",
            "GOFLAGS=x",
            "G=/go/bin"
        ]
    );
    assert_eq!(p.stages[0].steps[0].context.env, p.stages[0].config.env);
    assert_eq!(p.stages[0].steps[0].context.workdir, "/go");
    assert_eq!(p.stages[0].steps[0].context.user.as_deref(), Some("gopher"));
    // The known base's user and working directory are the image's too, so the start
    // command runs where and as whom Docker would run it.
    assert_eq!(p.stages[0].config.user.as_deref(), Some("gopher"));
    assert_eq!(p.stages[0].config.workdir.as_deref(), Some("/go"));
}

#[test]
fn known_base_user_and_workdir_reach_the_start_command() {
    let base = crate::BaseImage {
        env: vec!["PATH=/usr/bin".to_string()],
        workdir: Some("srv/".into()),
        user: Some("app".into()),
        onbuild: Vec::new(),
    };
    let options = Options {
        base_images: [("img".to_string(), base)].into(),
        ..Options::default()
    };
    let start = |text: &str| {
        let p = load_dockerfile("Dockerfile", text.as_bytes(), &options).unwrap();
        let s = p.sandbox.start.unwrap();
        (s.user, s.workdir)
    };
    let some = |s: &str| Some(s.to_string());
    // Inherited as they are (a relative base WorkingDir is taken from `/`).
    assert_eq!(
        start("FROM img\nCMD [\"x\"]\n"),
        (some("app"), some("/srv"))
    );
    // A relative WORKDIR resolves against the base's; USER replaces the base's.
    assert_eq!(
        start("FROM img\nWORKDIR w\nUSER root\nCMD [\"x\"]\n"),
        (some("root"), some("/srv/w"))
    );
    // A stage built on that stage inherits them in turn.
    assert_eq!(
        start("FROM img AS a\nFROM a\nCMD [\"x\"]\n"),
        (some("app"), some("/srv"))
    );
    // An unknown image base contributes nothing: the builder merges its config.
    let p = load_dockerfile("Dockerfile", b"FROM other\nCMD [\"x\"]\n", &options).unwrap();
    assert_eq!(p.stages[0].config.user, None);
    assert_eq!(p.stages[0].config.workdir, None);
    // A base without user or working directory leaves both unset (root in `/`).
    let bare = Options {
        base_images: [("img".to_string(), crate::BaseImage::default())].into(),
        ..Options::default()
    };
    let p = load_dockerfile("Dockerfile", b"FROM img\nCMD [\"x\"]\n", &bare).unwrap();
    assert_eq!(p.stages[0].config.user, None);
    assert_eq!(p.stages[0].config.workdir, None);
}

#[test]
fn entrypoint_clears_inherited_cmd() {
    let p = load_dockerfile(
        "Dockerfile",
        b"FROM x\nENTRYPOINT [\"e\"]\n",
        &Options::default(),
    )
    .unwrap();
    assert_eq!(p.stages[0].config.cmd, Some(vec![]));
    let p = load_dockerfile(
        "Dockerfile",
        b"FROM x\nCMD [\"c\"]\nENTRYPOINT [\"e\"]\n",
        &Options::default(),
    )
    .unwrap();
    assert_eq!(p.stages[0].config.cmd, Some(vec!["c".to_string()]));
}

fn lower(text: &str) -> Result<BuildPlan, crate::RecipeError> {
    load_dockerfile("Dockerfile", text.as_bytes(), &Options::default())
}

#[test]
fn env_pairs_see_the_env_before_the_instruction() {
    let p = lower("FROM scratch\nENV A=1\nENV A=2 B=$A\n").unwrap();
    assert!(p.stages[0].config.env.contains(&"B=1".to_string()));
}

#[test]
fn stage_refs_in_dependency_order() {
    let text = "FROM alpine AS final\nCOPY --from=later /x /x\nFROM alpine AS later\nRUN true\n";
    let options = Options {
        target: Some("final".into()),
        ..Options::default()
    };
    let p = load_dockerfile("Dockerfile", text.as_bytes(), &options).unwrap();
    let names: Vec<_> = p
        .stages
        .iter()
        .map(|s| s.name.clone().unwrap_or_default())
        .collect();
    assert_eq!(names, ["later", "final"]);
    assert_eq!(p.target, 1);
    let Action::Copy(c) = &p.stages[1].steps[0].action else {
        panic!()
    };
    assert_eq!(c.from, Some(MountFrom::Stage { stage: 0 }));
    let e = lower("FROM alpine\nCOPY --from=-1 /x /x\n").unwrap_err();
    assert_eq!(
        e.to_string().lines().next(),
        Some("Dockerfile:2:1: stage index -1 is out of range")
    );
}

#[test]
fn stop_signals_are_checked() {
    for ok in ["SIGTERM", "term", "9", "SIGRTMIN+3", "SIGWINCH"] {
        assert!(lower(&format!("FROM x\nSTOPSIGNAL {ok}\n")).is_ok(), "{ok}");
    }
    for bad in ["SIGNOPE", "0", "99", "SIGRTMIN+99"] {
        assert!(
            lower(&format!("FROM x\nSTOPSIGNAL {bad}\n")).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn empty_entrypoint_and_bom() {
    let p = lower("\u{feff}# syntax=x\nFROM scratch\nCMD [\"c\"]\nENTRYPOINT []\n").unwrap();
    assert_eq!(p.stages[0].config.entrypoint, Some(vec![]));
    assert_eq!(p.stages[0].config.cmd, Some(vec!["c".to_string()]));
    assert_eq!(p.stages[0].location.start_line, 2);
    assert_eq!(p.directives.syntax.as_deref(), Some("x"));
}

#[test]
fn copy_heredoc_location_covers_the_body() {
    let p = lower("FROM scratch\nCOPY <<EOF /empty\nEOF\nCOPY <<A /a\nx\nA\n").unwrap();
    let l: Vec<_> = p.stages[0]
        .steps
        .iter()
        .map(|s| (s.location.start_line, s.location.end_line))
        .collect();
    assert_eq!(l, [(2, 3), (4, 6)]);
    // As in BuildKit (the node's EndLine is the line of the last terminator), for COPY
    // as for RUN: the terminator line is the last, the next instruction is not included.
    let text =
        "FROM scratch\nCOPY <<A <<B /d/\na\nA\nb\nB\nRUN <<R\nr\nR\nCOPY <<'Q' /q\nq\nQ\nENV X=1\n";
    let p = lower(text).unwrap();
    let l: Vec<_> = p.stages[0]
        .steps
        .iter()
        .map(|s| (s.location.start_line, s.location.end_line))
        .collect();
    assert_eq!(l, [(2, 6), (7, 9), (10, 12)]);
}

#[test]
fn stage_base_keeps_its_platform_and_references_are_checked() {
    let p = lower("FROM --platform=linux/arm64 alpine AS a\nFROM a\n").unwrap();
    assert_eq!(p.stages[1].platform, "linux/arm64");
    let e = lower("ARG I=\"a b\"\nFROM $I\n").unwrap_err();
    assert!(e.to_string().contains("invalid reference format"), "{e}");
}

#[test]
fn args_of_pruned_stages_do_not_count_as_used() {
    let text = "FROM alpine AS unused\nARG ONLY_HERE\nFROM alpine\nRUN true\n";
    let options = Options {
        build_args: [("ONLY_HERE".to_string(), "1".to_string())].into(),
        ..Options::default()
    };
    let p = load_dockerfile("Dockerfile", text.as_bytes(), &options).unwrap();
    assert_eq!(p.build_args.unused, ["ONLY_HERE"]);
    assert!(p.build_args.used.is_empty());
}

#[test]
fn stage_on_image_stage_keeps_unknown_base_env() {
    let p = lower("FROM golang AS a\nFROM a\nENV P=$PATH:/x G=$GOPATH\n").unwrap();
    let env = &p.stages[1].config.env;
    assert!(
        env.contains(
            &"P=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/x".to_string()
        ),
        "{env:?}"
    );
    assert!(
        p.warnings
            .iter()
            .any(|w| w.message.contains("not known at plan time"))
    );
}

#[test]
fn crlf_line_endings() {
    let p = lower("FROM alpine\r\nRUN <<EOF\r\necho hi\r\nEOF\r\nCOPY <<X /x\r\nbody\r\nX\r\n")
        .unwrap();
    let s = &p.stages[0];
    let Action::Run(r) = &s.steps[0].action else {
        panic!()
    };
    assert_eq!(r.argv[2], "echo hi\n");
    let Action::Copy(c) = &s.steps[1].action else {
        panic!()
    };
    assert!(matches!(&c.sources[0], CopySource::Inline(f) if f.data == "body\n"));
}

#[test]
fn source_date_epoch_must_be_unix_seconds() {
    let options = |v: &str| Options {
        build_args: [("SOURCE_DATE_EPOCH".to_string(), v.to_string())].into(),
        ..Options::default()
    };
    let p = load_dockerfile("Dockerfile", b"FROM scratch\n", &options("1700000000")).unwrap();
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    assert!(p.build_args.unused.is_empty());
    // Refused by the plan, as the builder refuses it (not ignored with a warning, as it
    // once was here while `kiln build` failed on it).
    for bad in ["yesterday", "-1", "1.5", "253402300800"] {
        let e = load_dockerfile("Dockerfile", b"FROM scratch\n", &options(bad)).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("--build-arg SOURCE_DATE_EPOCH"), "{text}");
        assert!(text.contains(&format!("{bad:?}")), "{text}");
        assert!(text.contains("expected"), "{text}");
    }
}

#[test]
fn expose_splits_expanded_words() {
    let p = load_dockerfile(
        "Dockerfile",
        b"FROM scratch\nARG PORTS=\"80 443/udp\"\nEXPOSE $PORTS 8000-8002\n",
        &Options::default(),
    )
    .unwrap();
    assert_eq!(
        p.stages[0].config.exposed_ports,
        ["443/udp", "80/tcp", "8000/tcp", "8001/tcp", "8002/tcp"]
    );
    let e = load_dockerfile(
        "Dockerfile",
        b"FROM scratch\nEXPOSE 1-65535\n",
        &Options::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("names 65535 ports; kiln accepts ranges of at most 1024"),
        "{e}"
    );
    let e = load_dockerfile(
        "Dockerfile",
        b"FROM scratch\nEXPOSE 9-8\n",
        &Options::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("invalid port range"), "{e}");
    // The largest range accepted.
    let p = load_dockerfile(
        "Dockerfile",
        b"FROM scratch\nEXPOSE 1-1024\n",
        &Options::default(),
    )
    .unwrap();
    assert_eq!(p.stages[0].config.exposed_ports.len(), 1024);
}

#[test]
fn healthcheck_durations_below_one_millisecond_are_refused() {
    let plan = |d: &str| {
        let text = format!("FROM scratch\nHEALTHCHECK --interval={d} CMD [\"x\"]\n");
        load_dockerfile("Dockerfile", text.as_bytes(), &Options::default())
    };
    for d in ["500us", "400us", "999999ns"] {
        let e = plan(d).unwrap_err().to_string();
        assert!(e.contains("less than the minimum of 1ms"), "{d}: {e}");
    }
    // 0 keeps the default, as in BuildKit; 1ms and 1500us are accepted (rounded).
    let interval = |d: &str| {
        plan(d).unwrap().stages[0]
            .config
            .healthcheck
            .clone()
            .unwrap()
    };
    assert_eq!(interval("0").interval_ms, None);
    assert_eq!(interval("1ms").interval_ms, Some(1));
    assert_eq!(interval("1500us").interval_ms, Some(2));
}

#[test]
fn add_url_without_host_is_refused() {
    for url in [
        "https://",
        "http:///x",
        "https://user@/x",
        "https://:80/x",
        "HTTPS://?q",
    ] {
        let text = format!("FROM scratch\nADD {url} /z\n");
        let e = load_dockerfile("Dockerfile", text.as_bytes(), &Options::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no host"), "{url}: {e}");
    }
    for url in ["https://e.test", "http://u:p@e.test:8080/a?b#c"] {
        let text = format!("FROM scratch\nADD {url} /z\n");
        load_dockerfile("Dockerfile", text.as_bytes(), &Options::default()).unwrap();
    }
}

#[test]
fn env_and_label_legacy_forms() {
    let p = load_dockerfile(
        "Dockerfile",
        b"FROM scratch\nENV A  b c \"d\"\nLABEL k v w\n",
        &Options::default(),
    )
    .unwrap();
    assert!(p.stages[0].config.env.contains(&"A=b c d".to_string()));
    assert_eq!(
        p.stages[0].config.labels.get("k").map(String::as_str),
        Some("v w")
    );
}
