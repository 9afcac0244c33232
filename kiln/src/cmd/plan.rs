//! `kiln plan FILE [--target T] [--build-arg K=V]... [--platform P] [--disk-mib N] [--json]`:
//! lowers a Dockerfile or a YAML recipe (`.yaml`/`.yml`) into its build plan and prints it.
//! `--resolve` first resolves the base images as `kiln build` does, so the plan printed has
//! their config and ONBUILD triggers, as built.
//! Errors print `file:line:column: message` with a caret snippet and exit with status 1.

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_recipes::plan::{Action, Base, BuildPlan, Step};
use kiln_recipes::{Options, load, plan_to_json};

/// Flags of `kiln plan`.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The Dockerfile, or a YAML recipe (`*.yaml`, `*.yml`).
    pub file: PathBuf,
    /// Stage to build (name or index); default: the last stage.
    #[arg(long)]
    pub target: Option<String>,
    /// Build argument `NAME=value`; `NAME` alone takes the value from the environment. A
    /// `SOURCE_DATE_EPOCH` set (not empty) in the environment is taken as `--build-arg
    /// SOURCE_DATE_EPOCH` unless this flag gives one, as `kiln build` takes it.
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    pub build_args: Vec<String>,
    /// Target platform, `os/arch[/variant]` (default linux/amd64).
    #[arg(long)]
    pub platform: Option<String>,
    /// Sandbox disk size in MiB (overrides `LABEL kiln.disk-mib` / `disk_mib:`).
    #[arg(long = "disk-mib", value_name = "MIB")]
    pub disk_mib: Option<u64>,
    /// Resolve the base images first, as `kiln build` does (the local store, then the
    /// registry), and print the plan that is built: with the bases' env, working directory
    /// and user, and their ONBUILD triggers. Without it the plan is lowered from the file
    /// alone.
    #[arg(long)]
    pub resolve: bool,
    /// With --resolve: never contact a registry (bases must be in the local store).
    #[arg(long, requires = "resolve")]
    pub offline: bool,
    /// With --resolve: the local store directory (default: as for `kiln build`).
    #[arg(long, value_name = "DIR", requires = "resolve")]
    pub store: Option<String>,
    /// With --resolve: a registry (host[:port]) allowed over plain HTTP.
    #[arg(long = "insecure-registry", requires = "resolve")]
    pub insecure: Vec<String>,
}

/// The plan as `kiln build` builds it: the recipe lowered again with its resolved bases'
/// configs ([`kiln_builder::resolve::resolve_recipe`]).
fn resolved(
    args: &PlanArgs,
    name: &str,
    bytes: &[u8],
    options: &Options,
) -> anyhow::Result<BuildPlan> {
    use kiln_builder::base::PullPolicy;
    let (_, root) = crate::config::store_and_local_dir(args.store.as_deref())?;
    let cache = kiln_builder::cache::LocalCache::open(&root)?;
    let config = crate::config::Config::load(&crate::config::Flags::default())?;
    let resolve = kiln_builder::resolve::ResolveOptions {
        policy: if args.offline {
            PullPolicy::Never
        } else {
            PullPolicy::Missing
        },
        work_dir: root.join(".build").join("bootstrap"),
        default_mirror: config.bootstrap_mirror.value.clone(),
        registry: kiln_builder::registry::RegistryOptions {
            insecure: args.insecure.clone(),
            ..Default::default()
        },
        ..Default::default()
    };
    let (plan, _) = super::common::runtime()?.block_on(kiln_builder::resolve::resolve_recipe(
        name, bytes, options, &resolve, &cache,
    ))?;
    Ok(plan)
}

/// Runs `kiln plan`.
/// `json` is the global `--json`: print the plan as stable JSON.
pub fn run(args: &PlanArgs, json: bool) -> ExitCode {
    let name = args.file.display().to_string();
    let bytes = match std::fs::read(&args.file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: cannot read {name}: {e}");
            return ExitCode::FAILURE;
        }
    };
    // As `kiln build` takes them, the environment's SOURCE_DATE_EPOCH too.
    let build_args = super::flags::parse_build_args(&args.build_args, |n| std::env::var(n).ok());
    let options = Options {
        target: args.target.clone(),
        build_args,
        platform: args.platform.clone(),
        disk_mib: args.disk_mib,
        ..Options::default()
    };
    let plan = match load(&name, &bytes, &options) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let plan = if args.resolve {
        match resolved(args, &name, &bytes, &options) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: {}", super::one_line(&e));
                return ExitCode::FAILURE;
            }
        }
    } else {
        plan
    };
    // A plan that lowers but that kiln cannot build is refused here, not at build time.
    if let Err(e) = kiln_builder::build::check_supported(&plan) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    for w in &plan.warnings {
        match &w.location {
            Some(l) => eprintln!("warning: {}:{}: {}", l.file, l.start_line, w.message),
            None => eprintln!("warning: {}", w.message),
        }
    }
    if json {
        print!("{}", plan_to_json(&plan));
    } else {
        print!("{}", summary(&plan));
    }
    ExitCode::SUCCESS
}

/// A short human-readable listing: one line per stage and per step.
fn summary(plan: &BuildPlan) -> String {
    let mut out = String::new();
    for (i, stage) in plan.stages.iter().enumerate() {
        let name = stage
            .name
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        let target = if i == plan.target { " [target]" } else { "" };
        out.push_str(&format!(
            "stage {i}{name}{target}: from {} on {}\n",
            base(&stage.base),
            stage.platform
        ));
        for step in &stage.steps {
            out.push_str(&format!(
                "  {}:{} {}\n",
                step.location.file,
                step.location.start_line,
                describe(step)
            ));
        }
    }
    if let Some(start) = &plan.sandbox.start {
        out.push_str(&format!("start: {:?}\n", start.argv));
    }
    if let Some(ready) = &plan.sandbox.ready {
        out.push_str(&format!("ready: {:?}\n", ready.argv));
    }
    if let Some(disk) = plan.sandbox.disk_mib {
        out.push_str(&format!("disk: {disk} MiB\n"));
    }
    out
}

fn base(base: &Base) -> String {
    match base {
        Base::Scratch => "scratch".to_string(),
        Base::Image { reference } => reference.clone(),
        Base::Stage { stage } => format!("stage {stage}"),
        Base::Bootstrap(b) => format!("debootstrap {} {}", b.distro, b.suite),
    }
}

fn describe(step: &Step) -> String {
    match &step.action {
        Action::Run(r) => format!("run {:?}", r.argv),
        Action::Copy(c) => format!("copy {} source(s) -> {}", c.sources.len(), c.dest),
        Action::Add(c) => format!("add {} source(s) -> {}", c.sources.len(), c.dest),
        Action::Mkdir(m) => format!("mkdir {}", m.path),
    }
}
