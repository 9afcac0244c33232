//! ARG and ENV scoping, one row per combination, checked against BuildKit's Dockerfile
//! front end (issue 41). For each row: what the last `RUN` of the target stage sees, and
//! what the target's image config keeps in `Env`.
//!
//! The expected values come from BuildKit at commit
//! 73ed6825c4b7569379ef89df0aedcdbe64473d31 (github.com/moby/buildkit); each row cites the
//! lines, in `frontend/dockerfile/dockerfile2llb/convert.go` (`convert.go`) unless it names
//! `solver/llbsolver/ops/exec.go` (`exec.go`). The facts used:
//! - a stage's state has one env: `dispatchEnv` (convert.go:1338) and `dispatchArg`
//!   (convert.go:1708) both `AddEnv` to it, so the later write of a name wins, and `$VAR`
//!   expands from it (`dispatch`, convert.go:1040-1041); only `ENV` writes the config `Env`
//!   (convert.go:1339);
//! - `dispatchArg`: a build arg replaces the value (convert.go:1690-1693), else the default,
//!   expanded (convert.go:1694-1701), else, with neither, the global ARG's value
//!   (convert.go:1681-1687); an ARG left without a value adds nothing (convert.go:1706-1710);
//! - global ARGs (`buildMetaArgs`, convert.go:2144-2182) expand `FROM`
//!   (`buildDispatchStates`, convert.go:401) and nothing else;
//! - a stage on a stage takes its base's state and build args (`dispatchState.init`,
//!   convert.go:1215, 1225), then its config `Env` is added to the state again
//!   (`dispatchStages`, convert.go:804-808); a config without PATH gets the default one
//!   (convert.go:792-801);
//! - proxy build args reach `RUN` without an ARG (`proxyEnvFromBuildArgs`,
//!   convert.go:1874-1905; `dispatchRun`, convert.go:1415-1417), in both spellings
//!   (exec.go:572-590), after the state's env (exec.go:485-487), never in the config;
//! - ONBUILD triggers run first in the stage built on it, in its scope (`initOnBuildTriggers`,
//!   convert.go:1323; `resolveStages`, convert.go:557-579), and are not passed on
//!   (convert.go:1219).
//!
//! The builder puts a step's env over its base's config env by key, then the proxy build
//! args after it, and a stage's config over its base's (`kiln_builder::build::config::
//! merge_env`, `merge_run_config`, `StepSpec::from_plan`); [`seen`] and [`config_env`] do
//! the same here, so the rows check what the build gives.

use std::collections::BTreeMap;

use kiln_recipes::plan::{Action, Base, BuildPlan};
use kiln_recipes::{BaseImage, Options, load_dockerfile};

/// Docker's default PATH.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// `$PATH:/x` with Docker's default PATH.
const PATH_X: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/x";

struct Case {
    name: &'static str,
    dockerfile: &'static str,
    build_args: &'static [(&'static str, &'static str)],
    /// The config of image `base:1`: `Env` and `OnBuild`.
    base_env: &'static [&'static str],
    base_onbuild: &'static [&'static str],
    /// The target stage's base reference, when it is an image.
    from: Option<&'static str>,
    /// Variables the last `RUN` of the target stage sees (`None`: unset).
    run: &'static [(&'static str, Option<&'static str>)],
    /// Variables of the target's image config `Env` (`None`: absent).
    config: &'static [(&'static str, Option<&'static str>)],
}

const BASE_ENV: &[&str] = &["PATH=/usr/bin:/bin", "V=base"];

const CASES: &[Case] = &[
    // Global ARG in FROM, its default: buildMetaArgs (convert.go:2144-2182) and
    // buildDispatchStates (convert.go:401); not in the stage, which declares nothing
    // (only dispatchArg adds to the state, convert.go:1708).
    Case {
        name: "global arg in FROM, default",
        dockerfile: "ARG T=1\nFROM base:$T\nRUN env\n",
        build_args: &[],
        base_env: BASE_ENV,
        base_onbuild: &[],
        from: Some("base:1"),
        run: &[("T", None)],
        config: &[("T", None)],
    },
    // Global ARG in FROM, --build-arg: buildMetaArgs takes the build arg (convert.go:2150,
    // 2174-2176); the stage still does not see it (convert.go:1708 only).
    Case {
        name: "global arg in FROM, build arg",
        dockerfile: "ARG T=1\nFROM img:$T\nRUN env\n",
        build_args: &[("T", "2")],
        base_env: BASE_ENV,
        base_onbuild: &[],
        from: Some("img:2"),
        run: &[("T", None)],
        config: &[("T", None)],
    },
    // Global ARG redeclared without a value: the global value (dispatchArg,
    // convert.go:1681-1687), in the state (convert.go:1708), not in the config.
    Case {
        name: "global arg redeclared",
        dockerfile: "ARG T=1\nFROM scratch\nARG T\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("T", Some("1"))],
        config: &[("T", None)],
    },
    // ... with --build-arg: the build arg, in FROM and in the stage (convert.go:1690-1693,
    // 2150).
    Case {
        name: "global arg redeclared, build arg",
        dockerfile: "ARG T=1\nFROM img:$T\nARG T\nRUN env\n",
        build_args: &[("T", "2")],
        base_env: &[],
        base_onbuild: &[],
        from: Some("img:2"),
        run: &[("T", Some("2"))],
        config: &[("T", None)],
    },
    // Global ARG redeclared with a default: the default, not the global value (the global
    // one is looked up only without a default, convert.go:1681-1682).
    Case {
        name: "global arg redeclared with a default",
        dockerfile: "ARG T=1\nFROM scratch\nARG T=3\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("T", Some("3"))],
        config: &[("T", None)],
    },
    // A global ARG's default is not expanded when a build arg is given (buildMetaArgs
    // expands only when there is none, convert.go:2150-2152).
    Case {
        name: "global arg default not expanded under a build arg",
        dockerfile: "ARG T=${MISSING:?unset}\nFROM img:$T\nRUN env\n",
        build_args: &[("T", "4")],
        base_env: &[],
        base_onbuild: &[],
        from: Some("img:4"),
        run: &[("T", None)],
        config: &[],
    },
    // Stage ARG, no default, no build arg: no value, nothing in the state
    // (convert.go:1706-1710).
    Case {
        name: "stage arg without value",
        dockerfile: "FROM scratch\nARG A\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", None)],
        config: &[("A", None)],
    },
    // Stage ARG with an empty default: set, empty (convert.go:1694-1701, 1708).
    Case {
        name: "stage arg with an empty default",
        dockerfile: "FROM scratch\nARG A=\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some(""))],
        config: &[("A", None)],
    },
    // Stage ARG, no default, --build-arg: the build arg (convert.go:1690-1693).
    Case {
        name: "stage arg without default, build arg",
        dockerfile: "FROM scratch\nARG A\nRUN env\n",
        build_args: &[("A", "b")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some("b"))],
        config: &[("A", None)],
    },
    // Stage ARG with a default expanded from the state (convert.go:1694-1701).
    Case {
        name: "stage arg default",
        dockerfile: "FROM scratch\nENV E=e\nARG A=$E-d\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some("e-d"))],
        config: &[("A", None), ("E", Some("e"))],
    },
    // ... and --build-arg: the build arg, the default unexpanded (convert.go:1690-1693).
    Case {
        name: "stage arg default, build arg",
        dockerfile: "FROM scratch\nARG A=${MISSING:?unset}\nRUN env\n",
        build_args: &[("A", "b")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some("b"))],
        config: &[("A", None)],
    },
    // ARG redeclared without a value keeps the value it had: nothing is added to the state
    // (convert.go:1706-1710).
    Case {
        name: "stage arg redeclared without a value",
        dockerfile: "FROM scratch\nARG A=1\nARG A\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some("1"))],
        config: &[("A", None)],
    },
    // ENV after ARG of one name: the ENV, the later write of the state (convert.go:1338
    // after 1708), and in the config (convert.go:1339).
    Case {
        name: "env after arg",
        dockerfile: "FROM scratch\nARG V=a\nENV V=e W=$V\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("e")), ("W", Some("a"))],
        config: &[("V", Some("e")), ("W", Some("a"))],
    },
    // ARG after ENV of one name: the ARG is the later write of the state
    // (convert.go:1708 after 1338), so RUN and `$V` see it; the config keeps the ENV
    // (convert.go:1339).
    Case {
        name: "arg after env",
        dockerfile: "FROM scratch\nENV V=e\nARG V=a\nENV W=$V\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("a")), ("W", Some("a"))],
        config: &[("V", Some("e")), ("W", Some("a"))],
    },
    // ARG after ENV, then ENV again: the ENV (convert.go:1338).
    Case {
        name: "env, arg, env",
        dockerfile: "FROM scratch\nENV V=e\nARG V=a\nENV V=f\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("f"))],
        config: &[("V", Some("f"))],
    },
    // ARG without a value after ENV of one name: nothing added, the ENV stays
    // (convert.go:1706-1710).
    Case {
        name: "arg without value after env",
        dockerfile: "FROM scratch\nENV V=e\nARG V\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("e"))],
        config: &[("V", Some("e"))],
    },
    // ... with --build-arg: the build arg wins in the state (convert.go:1690-1693, 1708).
    Case {
        name: "arg without value after env, build arg",
        dockerfile: "FROM scratch\nENV V=e\nARG V\nRUN env\n",
        build_args: &[("V", "b")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("b"))],
        config: &[("V", Some("e"))],
    },
    // A global ARG redeclared after an ENV of its name: the global value is the later
    // write (convert.go:1681-1687, 1708).
    Case {
        name: "global arg redeclared after env",
        dockerfile: "ARG V=g\nFROM scratch\nENV V=e\nARG V\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("g"))],
        config: &[("V", Some("e"))],
    },
    // ENV of the base image, ARG of the stage with a default: the base config's env is in
    // the state first (convert.go:804-808), the ARG after it (convert.go:1708); the config
    // keeps the base's value.
    Case {
        name: "base image env, stage arg default",
        dockerfile: "FROM base:1\nARG V=a\nRUN env\n",
        build_args: &[],
        base_env: BASE_ENV,
        base_onbuild: &[],
        from: Some("base:1"),
        run: &[("V", Some("a"))],
        config: &[("V", Some("base"))],
    },
    // ENV of the base image, ARG without a value: the base's (convert.go:1706-1710).
    Case {
        name: "base image env, stage arg without value",
        dockerfile: "FROM base:1\nARG V\nRUN env\n",
        build_args: &[],
        base_env: BASE_ENV,
        base_onbuild: &[],
        from: Some("base:1"),
        run: &[("V", Some("base"))],
        config: &[("V", Some("base"))],
    },
    // ... with --build-arg: the build arg (convert.go:1690-1693, 1708).
    Case {
        name: "base image env, stage arg, build arg",
        dockerfile: "FROM base:1\nARG V\nRUN env\n",
        build_args: &[("V", "b")],
        base_env: BASE_ENV,
        base_onbuild: &[],
        from: Some("base:1"),
        run: &[("V", Some("b"))],
        config: &[("V", Some("base"))],
    },
    // A base image without PATH: the stage's config gets the default one, and `$PATH`
    // expands to it (convert.go:792-801, 804-808).
    Case {
        name: "base image without PATH",
        dockerfile: "FROM base:1\nENV P=$PATH:/x\nRUN env\n",
        build_args: &[],
        base_env: &["V=base"],
        base_onbuild: &[],
        from: Some("base:1"),
        run: &[("P", Some(PATH_X))],
        config: &[("PATH", Some(PATH)), ("P", Some(PATH_X))],
    },
    // ENV of the base stage, ARG of the stage on it: the state the stage takes holds the
    // ENV (convert.go:1215, 804-808), the ARG is written after (convert.go:1708).
    Case {
        name: "base stage env, stage arg default",
        dockerfile: "FROM scratch AS b\nENV V=e\nFROM b\nARG V=a\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("a"))],
        config: &[("V", Some("e"))],
    },
    // An ARG of the base stage reaches the stage on it: state and build args are taken
    // (convert.go:1215, 1225); never the config.
    Case {
        name: "base stage arg inherited",
        dockerfile: "FROM scratch AS b\nARG A=1\nFROM b\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some("1"))],
        config: &[("A", None)],
    },
    // ... and the stage's `ARG A` without a value keeps it (convert.go:1706-1710).
    Case {
        name: "base stage arg inherited, redeclared without value",
        dockerfile: "FROM scratch AS b\nARG A=1\nFROM b\nARG A\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("A", Some("1"))],
        config: &[("A", None)],
    },
    // The base stage wrote ARG V over its ENV V: the stage on it adds the config's env to
    // the state again, so it sees the ENV (convert.go:804-808).
    Case {
        name: "base stage arg over its env, stage on it",
        dockerfile: "FROM scratch AS b\nENV V=e\nARG V=a\nFROM b\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("V", Some("e"))],
        config: &[("V", Some("e"))],
    },
    // A proxy build arg without an ARG: RUN sees it in both spellings
    // (convert.go:1874-1905, 1415-1417; exec.go:572-590); not the config; `$http_proxy`
    // does not expand from it (it is not in the state, convert.go:1040-1041).
    Case {
        name: "proxy build arg, undeclared",
        dockerfile: "FROM scratch\nENV X=[$http_proxy]\nRUN env\n",
        build_args: &[("http_proxy", "http://p:1")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[
            ("HTTP_PROXY", Some("http://p:1")),
            ("http_proxy", Some("http://p:1")),
            ("X", Some("[]")),
        ],
        config: &[
            ("HTTP_PROXY", None),
            ("http_proxy", None),
            ("X", Some("[]")),
        ],
    },
    // A build arg is a proxy arg whatever its case (`strings.EqualFold`,
    // convert.go:1881-1898); NO_PROXY and ALL_PROXY too (exec.go:584-589).
    Case {
        name: "proxy build args, any case",
        dockerfile: "FROM scratch\nRUN env\n",
        build_args: &[("No_Proxy", "localhost"), ("ALL_PROXY", "socks5://s:1")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[
            ("NO_PROXY", Some("localhost")),
            ("no_proxy", Some("localhost")),
            ("No_Proxy", None),
            ("ALL_PROXY", Some("socks5://s:1")),
            ("all_proxy", Some("socks5://s:1")),
        ],
        config: &[("NO_PROXY", None), ("ALL_PROXY", None)],
    },
    // A declared proxy ARG given as a build arg: the ARG's value in the state
    // (convert.go:1690-1693, 1708) and the other spelling from the proxy env
    // (exec.go:572-590); still not the config.
    Case {
        name: "proxy arg declared, build arg",
        dockerfile: "FROM scratch\nARG HTTPS_PROXY\nENV Y=$HTTPS_PROXY\nRUN env\n",
        build_args: &[("HTTPS_PROXY", "http://s:2")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[
            ("HTTPS_PROXY", Some("http://s:2")),
            ("https_proxy", Some("http://s:2")),
        ],
        config: &[("HTTPS_PROXY", None), ("Y", Some("http://s:2"))],
    },
    // A declared proxy ARG with a default and no build arg: an ordinary ARG, no proxy env
    // (proxyEnvFromBuildArgs reads build args only, convert.go:1874-1905).
    Case {
        name: "proxy arg declared with a default",
        dockerfile: "FROM scratch\nARG FTP_PROXY=ftp://f:3\nRUN env\n",
        build_args: &[],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("FTP_PROXY", Some("ftp://f:3")), ("ftp_proxy", None)],
        config: &[("FTP_PROXY", None)],
    },
    // ONBUILD of a base stage: the triggers run first in the stage on it, in its scope, so
    // `ONBUILD ARG` takes the build arg and `ONBUILD ENV` writes its config
    // (convert.go:1323, 557-579); the base stage's config does not get the ENV.
    Case {
        name: "onbuild arg and env of a base stage",
        dockerfile: "FROM scratch AS b\nONBUILD ARG O\nONBUILD ENV P=$O\nFROM b\nRUN env\n",
        build_args: &[("O", "o")],
        base_env: &[],
        base_onbuild: &[],
        from: None,
        run: &[("O", Some("o")), ("P", Some("o"))],
        config: &[("O", None), ("P", Some("o"))],
    },
    // ONBUILD of the base image: the same, and a trigger's ARG after the image's ENV of its
    // name is the later write (convert.go:1323, 804-808, 1708).
    Case {
        name: "onbuild of a base image",
        dockerfile: "FROM base:1\nRUN env\n",
        build_args: &[],
        base_env: BASE_ENV,
        base_onbuild: &["ARG V=t", "ENV Q=$V"],
        from: Some("base:1"),
        run: &[("V", Some("t")), ("Q", Some("t"))],
        config: &[("V", Some("base")), ("Q", Some("t"))],
    },
];

/// `over` put over `base` by key, as the builder's `merge_env` does.
fn merge(base: &[String], over: &[String]) -> Vec<String> {
    let key = |e: &String| e.split_once('=').map_or(e.clone(), |(k, _)| k.to_string());
    let mut out = base.to_vec();
    for e in over {
        match out.iter().position(|b| key(b) == key(e)) {
            Some(i) => out[i] = e.clone(),
            None => out.push(e.clone()),
        }
    }
    out
}

/// The env the base of stage `i` gives it.
fn base_env(plan: &BuildPlan, options: &Options, i: usize) -> Vec<String> {
    match &plan.stages[i].base {
        Base::Image { reference } => options
            .base_images
            .get(reference)
            .map(|b| b.env.clone())
            .unwrap_or_default(),
        Base::Stage { stage } => config_env(plan, options, *stage),
        _ => Vec::new(),
    }
}

/// The config `Env` of stage `i`, its base's under it.
fn config_env(plan: &BuildPlan, options: &Options, i: usize) -> Vec<String> {
    merge(&base_env(plan, options, i), &plan.stages[i].config.env)
}

/// The env the last `RUN` of stage `i` gets.
fn seen(plan: &BuildPlan, options: &Options, i: usize) -> Vec<String> {
    let step = plan.stages[i]
        .steps
        .iter()
        .rev()
        .find(|s| matches!(s.action, Action::Run(_)))
        .expect("the stage has a RUN");
    let Action::Run(run) = &step.action else {
        unreachable!()
    };
    let env = merge(&base_env(plan, options, i), &step.context.env);
    merge(&env, &run.proxy_env)
}

fn value<'a>(env: &'a [String], name: &str) -> Option<&'a str> {
    env.iter()
        .rev()
        .find_map(|e| e.strip_prefix(name)?.strip_prefix('='))
}

#[test]
fn arg_and_env_scoping_match_buildkit() {
    let mut failures = Vec::new();
    for case in CASES {
        let base = BaseImage {
            env: case.base_env.iter().map(|e| e.to_string()).collect(),
            onbuild: case.base_onbuild.iter().map(|e| e.to_string()).collect(),
            ..BaseImage::default()
        };
        let options = Options {
            build_args: case
                .build_args
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            base_images: [("base:1".to_string(), base)].into(),
            ..Options::default()
        };
        let plan = match load_dockerfile("Dockerfile", case.dockerfile.as_bytes(), &options) {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("{}: {e}", case.name));
                continue;
            }
        };
        let t = plan.target;
        if let Some(from) = case.from {
            let want = Base::Image {
                reference: from.into(),
            };
            if plan.stages[t].base != want {
                failures.push(format!("{}: FROM {:?}", case.name, plan.stages[t].base));
            }
        }
        let run = seen(&plan, &options, t);
        let config = config_env(&plan, &options, t);
        for (what, env, want) in [("RUN", &run, case.run), ("config", &config, case.config)] {
            for (name, expected) in want {
                let got = value(env, name);
                if got != *expected {
                    failures.push(format!(
                        "{}: {what} {name}: got {got:?}, BuildKit {expected:?} (env {env:?})",
                        case.name
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}
