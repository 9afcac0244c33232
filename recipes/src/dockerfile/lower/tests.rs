use super::*;
use crate::{RecipeErrorKind, load_dockerfile};

fn plan_with(text: &str, options: &Options) -> BuildPlan {
    match load_dockerfile("Dockerfile", text.as_bytes(), options) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}

fn plan(text: &str) -> BuildPlan {
    plan_with(text, &Options::default())
}

fn error(text: &str, options: &Options) -> crate::RecipeError {
    match load_dockerfile("Dockerfile", text.as_bytes(), options) {
        Ok(p) => panic!("expected an error, got {}", crate::plan_to_json(&p)),
        Err(e) => e,
    }
}

fn run_argv(step: &Step) -> Vec<String> {
    match &step.action {
        Action::Run(r) => r.argv.clone(),
        other => panic!("not a run: {other:?}"),
    }
}

fn copy(step: &Step) -> &CopyStep {
    match &step.action {
        Action::Copy(c) | Action::Add(c) => c,
        other => panic!("not a copy: {other:?}"),
    }
}

fn args(pairs: &[(&str, &str)]) -> Options {
    Options {
        build_args: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Options::default()
    }
}

#[test]
fn basic_stage_and_run() {
    let p = plan("FROM alpine:3.20\nRUN echo $HOME \\\n  && true\n");
    assert_eq!(p.stages.len(), 1);
    let s = &p.stages[0];
    assert_eq!(
        s.base,
        Base::Image {
            reference: "alpine:3.20".into()
        }
    );
    assert_eq!(
        run_argv(&s.steps[0]),
        ["/bin/sh", "-c", "echo $HOME   && true"]
    );
    assert_eq!(s.steps[0].location.start_line, 2);
    assert_eq!(s.steps[0].location.end_line, 3);
    assert_eq!(s.steps[0].context.workdir, "/");
}

#[test]
fn substitution_in_the_right_instructions() {
    let p = plan(
        "FROM scratch\nENV A=one B=\"two words\" S=TERM\nENV C ${A}-x\nWORKDIR /srv/$A\nWORKDIR sub\n\
         COPY $A.txt ${B:+b}/\nUSER ${NOPE:-nobody}\nLABEL k=$A \"q\"='$A'\nEXPOSE 80 ${P:-53}/udp\n\
         VOLUME /data/$A\nSTOPSIGNAL SIG$S\nRUN echo $A\nCMD echo $A\n",
    );
    let s = &p.stages[0];
    assert_eq!(
        s.config.env,
        [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "A=one",
            "B=two words",
            "S=TERM",
            "C=one-x"
        ]
    );
    assert_eq!(s.config.workdir.as_deref(), Some("/srv/one/sub"));
    let c = copy(&s.steps[2]);
    assert_eq!(
        c.sources,
        [CopySource::Path {
            path: "one.txt".into()
        }]
    );
    assert_eq!(c.dest, "/srv/one/sub/b/");
    assert_eq!(s.config.user.as_deref(), Some("nobody"));
    assert_eq!(s.config.labels.get("k").map(String::as_str), Some("one"));
    assert_eq!(s.config.labels.get("q").map(String::as_str), Some("$A"));
    assert_eq!(s.config.exposed_ports, ["53/udp", "80/tcp"]);
    assert_eq!(s.config.volumes, ["/data/one"]);
    assert_eq!(s.config.stop_signal.as_deref(), Some("SIGTERM"));
    assert_eq!(run_argv(&s.steps[3]), ["/bin/sh", "-c", "echo $A"]);
    assert_eq!(
        s.config.cmd.as_deref(),
        Some(&["/bin/sh".to_string(), "-c".into(), "echo $A".into()][..])
    );
    assert_eq!(s.steps[3].context.user.as_deref(), Some("nobody"));
}

#[test]
fn escaped_dollar_stays_literal() {
    let p = plan("FROM scratch\nENV A=x\nENV B=\\$A C='$A'\n");
    assert!(p.stages[0].config.env.contains(&"B=$A".to_string()));
    assert!(p.stages[0].config.env.contains(&"C=$A".to_string()));
}

#[test]
fn global_args_are_for_from_only_unless_redeclared() {
    let text = "ARG TAG=3.20\nARG UNUSED_GLOBAL\nFROM alpine:$TAG\nENV X=${TAG:-none}\nARG TAG\nENV Y=$TAG\n";
    let p = plan(text);
    let s = &p.stages[0];
    assert_eq!(
        s.base,
        Base::Image {
            reference: "alpine:3.20".into()
        }
    );
    assert!(s.config.env.contains(&"X=none".to_string()));
    assert!(s.config.env.contains(&"Y=3.20".to_string()));
    let p = plan_with(text, &args(&[("TAG", "edge")]));
    assert_eq!(
        p.stages[0].base,
        Base::Image {
            reference: "alpine:edge".into()
        }
    );
    assert!(p.stages[0].config.env.contains(&"Y=edge".to_string()));
    assert_eq!(p.build_args.used, ["TAG"]);
    assert!(p.build_args.unused.is_empty());
}

#[test]
fn arg_visible_from_declaration_and_the_later_write_wins() {
    let p =
        plan("FROM scratch\nENV E=$V\nARG V=1\nENV F=$V\nENV V=env\nARG V=2\nENV G=$V\nRUN true\n");
    let env = &p.stages[0].config.env;
    assert!(env.contains(&"E=".to_string()));
    assert!(env.contains(&"F=1".to_string()));
    // `ARG V=2` after `ENV V=env` is the later write of the stage's env, which `$V` and
    // RUN see; the config keeps the ENV. BuildKit 73ed6825, convert.go: `dispatchArg`
    // adds the ARG's value to the stage's state env (line 1708) as `dispatchEnv` adds
    // the ENV's (1338), so the later one replaces the other; only `dispatchEnv` writes
    // the image config's Env (1339). (This test asserted G=env and RUN V=env before.)
    assert!(env.contains(&"G=2".to_string()));
    assert!(env.contains(&"V=env".to_string()));
    let run_env = &p.stages[0].steps[0].context.env;
    assert!(run_env.contains(&"V=2".to_string()));
    assert!(!run_env.contains(&"V=env".to_string()));
}

#[test]
fn arg_defaults_reach_run_env_and_build_args_override() {
    let p = plan_with(
        "FROM scratch\nARG A=1 B\nARG C=${A}0\nRUN env\n",
        &args(&[
            ("B", "bee"),
            ("ZZ", "nobody"),
            ("http_proxy", "http://p:3128"),
        ]),
    );
    let env = &p.stages[0].steps[0].context.env;
    assert!(env.contains(&"A=1".to_string()));
    assert!(env.contains(&"B=bee".to_string()));
    assert!(env.contains(&"C=10".to_string()));
    // The proxy build arg reaches RUN beside the step's env, not in it, so that it stays
    // out of the cache key as in BuildKit (solver/llbsolver/ops/exec.go 73ed6825, line
    // 132: the exec op's ProxyEnv is cleared before its cache key is made). This test
    // looked for it in `context.env` before.
    let Action::Run(run) = &p.stages[0].steps[0].action else {
        panic!("a RUN step")
    };
    assert!(
        run.proxy_env
            .contains(&"http_proxy=http://p:3128".to_string())
    );
    assert!(
        !env.iter()
            .any(|e| e.to_ascii_lowercase().starts_with("http_proxy="))
    );
    assert_eq!(p.build_args.unused, ["ZZ"]);
    assert!(p.warnings.iter().any(|w| w.message.contains("ZZ")));
    assert!(!p.stages[0].config.env.iter().any(|e| e.starts_with("A=")));
}

#[test]
fn proxy_build_args_stay_out_of_the_canonical_step() {
    let text = "FROM scratch\nARG NO_PROXY\nRUN env\n";
    let a = plan_with(
        text,
        &args(&[("HTTPS_PROXY", "http://a:1"), ("NO_PROXY", "x")]),
    );
    let b = plan_with(
        text,
        &args(&[("https_proxy", "http://b:2"), ("NO_PROXY", "x")]),
    );
    let (a, b) = (&a.stages[0].steps[0], &b.stages[0].steps[0]);
    let Action::Run(run) = &a.action else {
        panic!("a RUN step")
    };
    // NO_PROXY is a declared ARG: in the step's env (and key); no_proxy and HTTPS_PROXY
    // are not.
    assert!(a.context.env.contains(&"NO_PROXY=x".to_string()));
    assert_eq!(
        run.proxy_env,
        [
            "HTTPS_PROXY=http://a:1",
            "https_proxy=http://a:1",
            "no_proxy=x"
        ]
    );
    assert_eq!(a.canonical_json(), b.canonical_json());
    assert!(!a.canonical_json().contains("http://a:1"));
    let c = plan_with(text, &args(&[("NO_PROXY", "y")]));
    assert_ne!(a.canonical_json(), c.stages[0].steps[0].canonical_json());
}

#[test]
fn predefined_platform_args() {
    let text = "FROM --platform=$BUILDPLATFORM golang AS b\nARG TARGETARCH\nRUN echo\n\
                FROM alpine-$TARGETARCH\nARG TARGETPLATFORM\nENV P=$TARGETPLATFORM O=$TARGETOS\nCOPY --from=b /x /x\n";
    let p = plan_with(
        text,
        &Options {
            platform: Some("linux/arm64/v8".into()),
            ..Options::default()
        },
    );
    assert_eq!(p.stages[0].platform, "linux/amd64");
    assert!(
        p.stages[0].steps[0]
            .context
            .env
            .contains(&"TARGETARCH=arm64".to_string())
    );
    assert_eq!(
        p.stages[1].base,
        Base::Image {
            reference: "alpine-arm64".into()
        }
    );
    assert_eq!(p.stages[1].platform, "linux/arm64/v8");
    assert!(
        p.stages[1]
            .config
            .env
            .contains(&"P=linux/arm64/v8".to_string())
    );
    assert!(p.stages[1].config.env.contains(&"O=".to_string()));
    let e = error(
        "FROM x\n",
        &Options {
            platform: Some("linux".into()),
            ..Options::default()
        },
    );
    assert!(matches!(
        e.kind,
        RecipeErrorKind::Lower(LowerError::Platform(_))
    ));
}

#[test]
fn source_date_epoch_is_a_predefined_arg() {
    let p = plan_with(
        "FROM scratch\nARG SOURCE_DATE_EPOCH\nRUN echo\n",
        &args(&[("SOURCE_DATE_EPOCH", "1700000000")]),
    );
    assert!(
        p.stages[0].steps[0]
            .context
            .env
            .contains(&"SOURCE_DATE_EPOCH=1700000000".to_string())
    );
    let p = plan_with(
        "FROM scratch\nRUN echo\n",
        &args(&[("SOURCE_DATE_EPOCH", "1")]),
    );
    assert!(p.build_args.unused.is_empty());
    assert!(
        !p.stages[0].steps[0]
            .context
            .env
            .iter()
            .any(|e| e.starts_with("SOURCE_DATE_EPOCH"))
    );
}

#[test]
fn run_heredocs() {
    let p = plan(
        "FROM scratch\nRUN <<EOF\necho $HOME\nEOF\nRUN <<-'EOT'\n\t#!/bin/sh\n\techo hi\nEOT\nRUN python3 <<A > /o && cat <<B\nprint(1)\nA\nb\nB\n",
    );
    let s = &p.stages[0];
    assert_eq!(run_argv(&s.steps[0]), ["/bin/sh", "-c", "echo $HOME\n"]);
    let Action::Run(r) = &s.steps[1].action else {
        panic!()
    };
    assert_eq!(r.argv, ["/bin/sh", "-c", "/dev/pipes/EOT"]);
    assert_eq!(r.files[0].data, "#!/bin/sh\necho hi\n");
    assert_eq!(r.files[0].mode, 0o755);
    assert_eq!(
        run_argv(&s.steps[2]),
        [
            "/bin/sh",
            "-c",
            "python3 <<A > /o && cat <<B\nprint(1)\nA\nb\nB"
        ]
    );
    assert_eq!(s.steps[2].location.start_line, 9);
    assert_eq!(s.steps[2].location.end_line, 13);
}

#[test]
fn copy_heredocs_expand_unless_quoted() {
    let p = plan(
        "FROM scratch\nARG V=7\nWORKDIR /etc\nCOPY <<A <<'B' ./\nv=$V\nA\nv=$V\nB\nCOPY --chmod=0755 <<-EOF /usr/bin/x\n\t#!/bin/sh\nEOF\n",
    );
    let s = &p.stages[0];
    let c = copy(&s.steps[1]);
    assert_eq!(c.dest, "/etc/");
    let CopySource::Inline(a) = &c.sources[0] else {
        panic!()
    };
    assert_eq!((a.name.as_str(), a.data.as_str()), ("A", "v=7\n"));
    let CopySource::Inline(b) = &c.sources[1] else {
        panic!()
    };
    assert_eq!((b.name.as_str(), b.data.as_str()), ("B", "v=$V\n"));
    let c = copy(&s.steps[2]);
    let CopySource::Inline(x) = &c.sources[0] else {
        panic!()
    };
    assert_eq!(x.data, "#!/bin/sh\n");
    assert_eq!(c.chmod.as_deref(), Some("0755"));
}

#[test]
fn copy_and_add_flags() {
    let p = plan(
        "FROM scratch\nCOPY --chown=1:1 --chmod=u+x,g-w --link --parents --exclude=*.md --exclude=x a b /d/\n\
         ADD --checksum=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef https://e.test/a.tgz /\n\
         ADD app.tar.gz /opt/\nADD --unpack=false b.tar /opt/\nADD --keep-git-dir git@git.test:x/y.git /src\n",
    );
    let s = &p.stages[0];
    let c = copy(&s.steps[0]);
    assert_eq!(c.chown.as_deref(), Some("1:1"));
    assert!(c.link && c.parents && !c.unpack);
    assert_eq!(c.exclude, ["*.md", "x"]);
    let a = copy(&s.steps[1]);
    assert!(matches!(a.sources[0], CopySource::Url { .. }));
    assert!(!a.unpack);
    assert!(copy(&s.steps[2]).unpack);
    assert!(!copy(&s.steps[3]).unpack);
    assert!(matches!(
        copy(&s.steps[4]).sources[0],
        CopySource::Git { .. }
    ));
    assert!(copy(&s.steps[4]).keep_git_dir);
}

#[test]
fn copy_errors() {
    let o = Options::default();
    for (text, needle) in [
        ("FROM x\nADD ext::sh%20-c%20id /\n", "transport 'ext::'"),
        ("FROM x\nADD file:///srv/r.git /\n", "file://"),
        ("FROM x\nADD https://e.test/r.git#-b /\n", "starts with '-'"),
        ("FROM x\nADD https://e.test/r.git#main:../.. /\n", "'..'"),
        ("FROM x\nCOPY https://e.test/r.git /\n", "use ADD"),
        ("FROM x\nCOPY https://e.test/a /\n", "use ADD"),
        ("FROM x\nCOPY --chmod=9z9 a /\n", "--chmod"),
        (
            "FROM x\nADD --checksum=md5:00 https://e.test/a /\n",
            "--checksum",
        ),
        (
            "FROM x\nADD --checksum=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef a /\n",
            "URL",
        ),
        ("FROM x\nCOPY --bogus a /\n", "unknown flag --bogus"),
        ("FROM x\nCOPY --link=maybe a /\n", "true or false"),
        ("FROM x\nADD --from=y a /\n", "unknown flag --from"),
    ] {
        let e = error(text, &o);
        assert!(e.to_string().contains(needle), "{text:?}: {e}");
        assert_eq!(e.line, 2, "{text:?}");
    }
}

#[test]
fn run_mounts_network_security() {
    let p = plan(
        "FROM scratch AS src\nFROM scratch\nWORKDIR /w\n\
         RUN --mount=type=cache,target=/root/.cache,sharing=locked,mode=0700,uid=1 \
         --mount=type=bind,from=src,source=/x,target=x,rw \
         --mount=type=tmpfs,target=/t,size=64m \
         --mount=type=secret,id=tok,env=TOKEN \
         --mount=type=secret,target=/run/s/key,required=true \
         --network=none true\nRUN --network=host --security=sandbox true\n",
    );
    let s = &p.stages[1];
    let Action::Run(r) = &s.steps[1].action else {
        panic!()
    };
    assert_eq!(r.network, Network::None);
    assert_eq!(
        r.mounts[0],
        Mount::Cache {
            target: "/root/.cache".into(),
            id: "/root/.cache".into(),
            sharing: "locked".into(),
            from: None,
            source: None,
            mode: 0o700,
            uid: 1,
            gid: 0,
            readonly: false,
        }
    );
    assert_eq!(
        r.mounts[1],
        Mount::Bind {
            target: "/w/x".into(),
            source: "/x".into(),
            from: Some(MountFrom::Stage { stage: 0 }),
            readwrite: true,
        }
    );
    assert_eq!(
        r.mounts[2],
        Mount::Tmpfs {
            target: "/t".into(),
            size: Some(64 << 20)
        }
    );
    assert!(
        matches!(&r.mounts[3], Mount::Secret { id, target: None, env: Some(e), .. } if id == "tok" && e == "TOKEN")
    );
    assert!(
        matches!(&r.mounts[4], Mount::Secret { id, required: true, mode: 0o400, .. } if id == "key")
    );
    let Action::Run(r) = &s.steps[2].action else {
        panic!()
    };
    assert_eq!(r.network, Network::Host);
    assert_eq!(r.security, Security::Sandbox);
}

/// `--security=insecure` is in the plan (the builder asks for the entitlement), and the
/// step's canonical form, so its cache key, differs from the same step without it;
/// `--security=sandbox` is the default, the same step as none.
#[test]
fn run_security_insecure_is_planned_and_keyed() {
    let p =
        plan("FROM scratch\nRUN --security=insecure true\nRUN true\nRUN --security=sandbox true\n");
    let steps = &p.stages[0].steps;
    let Action::Run(r) = &steps[0].action else {
        panic!()
    };
    assert_eq!(r.security, Security::Insecure);
    assert_ne!(steps[0].canonical_json(), steps[1].canonical_json());
    assert_eq!(steps[1].canonical_json(), steps[2].canonical_json());
    let e = error("FROM x\nRUN --security=bogus true\n", &Options::default());
    assert!(
        e.to_string().contains("expected sandbox or insecure"),
        "{e}"
    );
}

/// `RUN --mount=type=ssh` with BuildKit's defaults (`dispatchSSH`, `AddSSHSocket`): id
/// `default`, target `/run/buildkit/ssh_agent.<n>` by the mount's place among the step's
/// ssh mounts, mode 0600, owner 0:0, optional. Its options are in the cache key.
#[test]
fn run_mount_ssh_defaults_and_options() {
    let p = plan(
        "FROM scratch\nWORKDIR /w\n\
         RUN --mount=type=ssh --mount=type=tmpfs,target=/t \
         --mount=type=ssh,id=gh,target=s,required=true,mode=0660,uid=1000,gid=100 \
         --mount=type=ssh,id=other true\n\
         RUN --mount=type=ssh,id=gh true\n",
    );
    let steps = &p.stages[0].steps;
    let Action::Run(r) = &steps[1].action else {
        panic!()
    };
    let ssh = |id: &str, target: &str, required, mode, uid, gid| Mount::Ssh {
        id: id.into(),
        target: target.into(),
        required,
        mode,
        uid,
        gid,
    };
    assert_eq!(
        r.mounts,
        vec![
            ssh("default", "/run/buildkit/ssh_agent.0", false, 0o600, 0, 0),
            Mount::Tmpfs {
                target: "/t".into(),
                size: None
            },
            ssh("gh", "/w/s", true, 0o660, 1000, 100),
            ssh("other", "/run/buildkit/ssh_agent.2", false, 0o600, 0, 0),
        ]
    );
    assert_ne!(steps[1].canonical_json(), steps[2].canonical_json());
}

#[test]
fn unsupported_run_features_are_plan_errors() {
    let o = Options::default();
    let e = error("FROM x\nRUN --mount=type=bogus true\n", &o);
    assert_eq!((e.line, e.column), (2, 5));
    for (text, needle) in [
        (
            "FROM x\nRUN --mount=type=ssh,source=/a true\n",
            "unexpected key 'source'",
        ),
        ("FROM x\nRUN --mount=type=ssh,mode=9 true\n", "invalid mode"),
        ("FROM x\nRUN --network=bridge true\n", "--network"),
        (
            "FROM x\nRUN --mount=type=weird,target=/x true\n",
            "mount type",
        ),
        ("FROM x\nRUN --mount=type=cache true\n", "needs a target"),
        (
            "FROM x\nRUN --mount=type=cache,target=/c,sharing=bad true\n",
            "sharing",
        ),
        (
            "FROM x\nRUN --mount=type=tmpfs,target=/c,bogus=1 true\n",
            "unexpected key",
        ),
        ("FROM x\nRUN --mount=type=secret true\n", "id or a target"),
    ] {
        let e = error(text, &o);
        assert!(e.to_string().contains(needle), "{text:?}: {e}");
    }
}

#[test]
fn multi_stage_refs_pruning_and_target() {
    let text = "FROM golang AS build\nRUN go build\n\
                FROM scratch AS unused\nRUN --security=bogus true\n\
                FROM build AS test\nRUN go test\n\
                FROM alpine\nCOPY --from=build /app /app\nCOPY --from=0 /b /b\nCOPY --from=nginx:1 /etc/nginx /n\n";
    let p = plan(text);
    let names: Vec<_> = p.stages.iter().map(|s| (s.index, s.name.clone())).collect();
    assert_eq!(names, [(0, Some("build".into())), (3, None)]);
    assert_eq!(p.target, 1);
    let s = &p.stages[1];
    assert_eq!(copy(&s.steps[0]).from, Some(MountFrom::Stage { stage: 0 }));
    assert_eq!(copy(&s.steps[1]).from, Some(MountFrom::Stage { stage: 0 }));
    assert_eq!(
        copy(&s.steps[2]).from,
        Some(MountFrom::Image {
            reference: "nginx:1".into()
        })
    );
    let p = plan_with(
        text,
        &Options {
            target: Some("TEST".into()),
            ..Options::default()
        },
    );
    assert_eq!(p.stages.len(), 2);
    assert_eq!(p.stages[1].base, Base::Stage { stage: 0 });
    let e = error(
        text,
        &Options {
            target: Some("unused".into()),
            ..Options::default()
        },
    );
    assert!(e.to_string().contains("--security"));
    let e = error(
        text,
        &Options {
            target: Some("nope".into()),
            ..Options::default()
        },
    );
    assert!(matches!(
        e.kind,
        RecipeErrorKind::Lower(LowerError::UnknownTarget(_))
    ));
}

#[test]
fn stage_base_inherits_config_and_runs_onbuild() {
    let p = plan(
        "FROM scratch AS base\nENV A=1\nWORKDIR /app\nUSER u\nONBUILD COPY . /app/src\nONBUILD RUN make $A\n\
         FROM base\nRUN test\n",
    );
    assert_eq!(
        p.stages[0].config.onbuild,
        ["COPY . /app/src", "RUN make $A"]
    );
    let s = &p.stages[1];
    assert!(s.config.onbuild.is_empty());
    // Its config holds only what it sets (the builder puts it over the base stage's);
    // its steps run in what it inherited.
    assert!(s.config.env.is_empty(), "{:?}", s.config.env);
    assert_eq!(s.config.workdir, None);
    assert!(s.steps[1].context.env.contains(&"A=1".to_string()));
    assert_eq!(s.steps[1].context.workdir, "/app");
    assert_eq!(copy(&s.steps[0]).dest, "/app/src");
    assert_eq!(run_argv(&s.steps[1]), ["/bin/sh", "-c", "make $A"]);
    assert_eq!(s.steps[1].context.user.as_deref(), Some("u"));
    assert_eq!(s.steps[1].location.start_line, 7);
    let e = error("FROM x\nONBUILD FROM y\n", &Options::default());
    assert!(e.to_string().contains("ONBUILD"), "{e}");
}

#[test]
fn cycles_are_errors() {
    let text = "FROM scratch AS a\nCOPY --from=b /x /x\nFROM scratch AS b\nCOPY --from=a /y /y\n";
    let e = error(text, &Options::default());
    assert!(
        matches!(e.kind, RecipeErrorKind::Lower(LowerError::Cycle(_))),
        "{e}"
    );
    let e = error(
        "FROM scratch AS a\nCOPY --from=a /x /x\n",
        &Options::default(),
    );
    assert!(
        matches!(e.kind, RecipeErrorKind::Lower(LowerError::Cycle(_))),
        "{e}"
    );
    let e = error("FROM scratch\nCOPY --from=5 /x /x\n", &Options::default());
    assert!(
        matches!(e.kind, RecipeErrorKind::Lower(LowerError::StageIndex(5))),
        "{e}"
    );
}

#[test]
fn stage_name_errors() {
    let e = error("FROM x AS a\nFROM y AS A\n", &Options::default());
    assert!(e.to_string().contains("duplicate stage name"), "{e}");
    let e = error("FROM x AS 1a\n", &Options::default());
    assert!(
        matches!(e.kind, RecipeErrorKind::Lower(LowerError::StageName(_))),
        "{e}"
    );
    let e = error("ARG E\nFROM $E\n", &Options::default());
    assert!(
        matches!(e.kind, RecipeErrorKind::Lower(LowerError::BlankBase(_))),
        "{e}"
    );
}

#[test]
fn image_config_and_sandbox() {
    let p = plan(
        "FROM scratch\nMAINTAINER Jo <jo@e.test>\nSHELL [\"/bin/bash\", \"-eo\", \"pipefail\", \"-c\"]\n\
         RUN echo\nLABEL kiln.disk-mib=4096\nUSER app\nWORKDIR /srv\n\
         ENTRYPOINT [\"/bin/server\"]\nCMD [\"--port\", \"80\"]\n\
         HEALTHCHECK --interval=5s --timeout=1m30s --retries=4 CMD curl -f localhost\n",
    );
    let s = &p.stages[0];
    assert_eq!(
        s.config.labels.get("maintainer").map(String::as_str),
        Some("Jo <jo@e.test>")
    );
    assert_eq!(
        run_argv(&s.steps[0]),
        ["/bin/bash", "-eo", "pipefail", "-c", "echo"]
    );
    let start = p.sandbox.start.as_ref().unwrap();
    assert_eq!(start.argv, ["/bin/server", "--port", "80"]);
    assert_eq!(start.user.as_deref(), Some("app"));
    assert_eq!(start.workdir.as_deref(), Some("/srv"));
    let ready = p.sandbox.ready.as_ref().unwrap();
    assert_eq!(
        ready.argv,
        ["/bin/bash", "-eo", "pipefail", "-c", "curl -f localhost"]
    );
    assert_eq!(
        (ready.interval_ms, ready.timeout_ms, ready.retries),
        (5_000, 90_000, 4)
    );
    assert_eq!(p.sandbox.disk_mib, Some(4096));
    let p = plan_with(
        "FROM scratch\nLABEL kiln.disk-mib=4096\n",
        &Options {
            disk_mib: Some(8192),
            ..Options::default()
        },
    );
    assert_eq!(p.sandbox.disk_mib, Some(8192));
    let e = error("FROM x\nLABEL kiln.disk-mib=lots\n", &Options::default());
    assert!(e.to_string().contains("kiln.disk-mib"));
}

#[test]
fn entrypoint_and_cmd_combine_as_docker_does() {
    let p = plan("FROM scratch\nCMD [\"a\"]\nENTRYPOINT run it\n");
    assert_eq!(
        p.sandbox.start.unwrap().argv,
        ["/bin/sh", "-c", "run it", "a"]
    );
    let p = plan("FROM scratch AS b\nCMD [\"a\"]\nFROM b\nENTRYPOINT [\"e\"]\n");
    assert_eq!(p.sandbox.start.unwrap().argv, ["e"]);
    let p = plan("FROM scratch\nHEALTHCHECK NONE\n");
    assert!(p.sandbox.ready.is_none() && p.sandbox.start.is_none());
    assert_eq!(
        p.stages[0].config.healthcheck.as_ref().unwrap().test,
        ["NONE"]
    );
}

#[test]
fn directives_are_recorded() {
    let p = plan(
        "# syntax=docker/dockerfile:1.7\n# check=skip=all\n# escape=`\nFROM scratch\nRUN echo a `\n  b\n",
    );
    assert_eq!(
        p.directives.syntax.as_deref(),
        Some("docker/dockerfile:1.7")
    );
    assert_eq!(p.directives.check.as_deref(), Some("skip=all"));
    assert_eq!(p.directives.escape, '`');
    assert_eq!(
        run_argv(&p.stages[0].steps[0]),
        ["/bin/sh", "-c", "echo a   b"]
    );
}

#[test]
fn canonical_form_ignores_location() {
    let a = plan("FROM scratch\nRUN echo hi\n");
    let b = plan("FROM scratch\n\n\n# moved\nRUN echo hi\n");
    let (sa, sb) = (&a.stages[0].steps[0], &b.stages[0].steps[0]);
    assert_ne!(sa.location, sb.location);
    assert_eq!(sa.canonical_json(), sb.canonical_json());
    assert!(!sa.canonical_json().contains("line"));
    assert_eq!(crate::plan_to_json(&a), crate::plan_to_json(&a.clone()));
}

#[test]
fn syntax_errors_have_location_and_caret() {
    let e = error("FROM x\nRUN <<EOF\necho\n", &Options::default());
    assert_eq!((e.line, e.column), (2, 5));
    assert!(
        e.to_string()
            .starts_with("Dockerfile:2:5: unterminated heredoc")
    );
    assert!(
        e.to_string().contains("\n 2 | RUN <<EOF\n   |     ^"),
        "{e}"
    );
    let e = error("FROM x\nBOGUS y\n", &Options::default());
    assert_eq!(e.line, 2);
    let e = error("RUN x\n", &Options::default());
    assert_eq!(e.line, 1);
    let e = error("", &Options::default());
    assert!(e.to_string().contains("FROM"), "{e}");
    let e = error("FROM x\nENV A=${B\n", &Options::default());
    assert!(matches!(e.kind, RecipeErrorKind::ShellWords(_)), "{e}");
    assert_eq!(e.line, 2);
}

#[test]
fn hostile_inputs_do_not_panic() {
    let cases = [
        "FROM x\nRUN <<",
        "FROM x\nRUN <<''\n",
        "FROM x\nCOPY <<EOF",
        "FROM x\nRUN \\",
        "\u{0}",
        "FROM x\nEXPOSE 1-65535\n",
        "FROM x\nEXPOSE 99999\n",
        "FROM x\nHEALTHCHECK --interval=9999999999999h CMD x\n",
        "FROM x\nRUN --mount=type=tmpfs,target=/x,size=99999999999999999999t x\n",
        "FROM x\nCOPY --from= a b\n",
        "FROM x\nONBUILD ONBUILD RUN x\n",
        "FROM x\nRUN --mount= x\n",
        "FROM x\nWORKDIR $X\n",
        "# escape=`\nFROM x\nRUN a`",
        "FROM x AS\n",
        "FROM --platform= x\n",
        "FROM x\nSHELL []\n",
        "FROM x\nUSER\n",
        "FROM x\nENV\n",
        "FROM x\nENV A\n",
        "FROM x\nLABEL =\n",
        "FROM x\nARG =\n",
        "FROM x\nCOPY <<A <<B /\nA\n",
        "FROM é\nRUN é<<é\né\n",
        "FROM x\nVOLUME [\"\"]\n",
        "FROM x\nSTOPSIGNAL \n",
        "FROM x\nSTOPSIGNAL ::\n",
        "FROM x\nCMD [\n",
    ];
    for text in cases {
        let _ = load_dockerfile("Dockerfile", text.as_bytes(), &Options::default());
    }
    let e = load_dockerfile("Dockerfile", b"FROM x\nRUN \xff\n", &Options::default()).unwrap_err();
    assert_eq!(e.line, 2);
}
