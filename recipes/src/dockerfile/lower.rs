//! Lowering typed instructions into a [`BuildPlan`], with BuildKit's semantics
//! (`frontend/dockerfile/dockerfile2llb/convert.go` of moby/buildkit):
//!
//! - ARGs before the first `FROM` are the global scope, visible to `FROM` lines only (with
//!   the predefined platform ARGs); a stage sees a global ARG only after redeclaring it
//!   (`ARG NAME` without a value inherits the global value). `--build-arg` overrides any
//!   declared ARG. An ARG is visible from its declaration on; `ENV` wins over an ARG of the
//!   same name. Proxy ARGs given as build args reach `RUN` without a declaration.
//! - Substitution happens in `FROM`, `ARG` defaults, `ENV`, `LABEL`, `COPY`/`ADD` (sources,
//!   destination, flags, unquoted heredoc bodies), `EXPOSE`, `VOLUME`, `USER`, `WORKDIR`,
//!   `STOPSIGNAL`, `ONBUILD` (when triggered), and `RUN --mount` options; never in the
//!   `RUN`/`CMD`/`ENTRYPOINT`/`HEALTHCHECK` commands.
//! - Stages: every stage is first lowered on its own, errors kept; then the target's
//!   dependencies (`FROM` a stage, `COPY --from`, `RUN --mount from=`) are followed and
//!   only those stages are kept (a failure in an unneeded stage does not fail the build); a
//!   cycle through `COPY --from` is an error.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use super::env_map::EnvMap;
use super::instructions::{CommandLine, CopyArgs, HealthcheckArgs, Instr, InstrKind, SourceArg};
use super::syntax::{self, RunHeredoc};
use crate::Options;
use crate::error::Fault;
use crate::plan::{
    Action, Base, BuildArgs, BuildPlan, CommandForm, CopySource, CopyStep, DEFAULT_PATH,
    DEFAULT_PLATFORM, DEFAULT_SHELL, Directives, Frontend, Healthcheck, ImageConfig, InlineFile,
    Limits, MkdirStep, Mount, MountFrom, Network, ReadyCheck, RunStep, Sandbox, Security,
    SourceLocation, Stage, StartCommand, Step, StepContext, Warning,
};
use crate::shell_words::{ShellWordsError, expand_heredoc, expand_word_tracking};

/// A Dockerfile that parses but cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    /// `--target` names no stage.
    #[error("target stage '{0}' could not be found")]
    UnknownTarget(String),
    /// Stages depend on each other in a loop.
    #[error("circular dependency detected on stage: {0}")]
    Cycle(String),
    /// `COPY --from=N` / `from=N` with N past the last stage.
    #[error("stage index {0} is out of range")]
    StageIndex(i64),
    /// A `--mount`, `--network`, `--security`, `--chmod`, ... value kiln cannot use.
    #[error("{0}")]
    Invalid(String),
    /// A base image name that substitution left empty.
    #[error("base name ({0}) should not be blank")]
    BlankBase(String),
    /// The plan would exceed [`MAX_PLAN_BYTES`] (variables re-expanded into many steps).
    #[error("the recipe expands to a plan larger than {} MiB", MAX_PLAN_BYTES >> 20)]
    TooLarge,
    /// A stage name BuildKit would reject.
    #[error(
        "invalid name for build stage: '{0}', name can't start with a number or contain symbols"
    )]
    StageName(String),
    /// Two stages with one name.
    #[error("duplicate stage name '{0}'")]
    DuplicateStage(String),
    /// `--platform` (or `FROM --platform`) that is not `os/arch[/variant]`.
    #[error("invalid platform '{0}': expected os/arch[/variant]")]
    Platform(String),
}

/// The predefined proxy build args, by the upper-case spelling; a build arg is one of them
/// whatever its case (BuildKit's `proxyEnvFromBuildArgs` matches with `strings.EqualFold`).
const PROXY_ARGS: [&str; 5] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "FTP_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
];

/// The proxy variable `name` sets, in upper case, if it is one.
fn proxy_arg(name: &str) -> Option<&'static str> {
    PROXY_ARGS
        .into_iter()
        .find(|p| p.eq_ignore_ascii_case(name))
}

/// The proxy build args given, one value per variable: of several spellings of one, the
/// last in byte order wins, as BuildKit's `proxyEnvFromBuildArgs` visits them sorted.
fn proxy_env_of(build_args: &BTreeMap<String, String>) -> Vec<(&'static str, &str)> {
    let mut out: Vec<(&'static str, &str)> = Vec::new();
    for (name, value) in build_args {
        if let Some(upper) = proxy_arg(name) {
            match out.iter_mut().find(|(u, _)| *u == upper) {
                Some(slot) => slot.1 = value,
                None => out.push((upper, value)),
            }
        }
    }
    out.sort_by_key(|(u, _)| PROXY_ARGS.iter().position(|p| p == u));
    out
}

const SOURCE_DATE_EPOCH: &str = "SOURCE_DATE_EPOCH";

/// Label that sets the sandbox disk size in MiB.
pub const DISK_LABEL: &str = "kiln.disk-mib";

/// Largest total of expanded strings (env of every step, substituted words), bytes
/// (64 MiB). Each step carries its whole env, so a recipe of a few hundred KiB with large
/// values and many steps could otherwise make a plan of gigabytes.
pub const MAX_PLAN_BYTES: usize = 64 << 20;

/// Largest number of ports one `EXPOSE` range may expand to (defends against `1-65535`).
const MAX_EXPOSED_RANGE: u32 = 1024;

fn invalid(offset: usize, msg: impl Into<String>) -> Fault {
    Fault::new(offset, LowerError::Invalid(msg.into()))
}

/// `os/arch[/variant]`, validated.
pub(crate) fn parse_platform(p: &str) -> Option<(String, String, String)> {
    let parts: Vec<&str> = p.split('/').collect();
    let ok = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.-".contains(c))
    };
    match parts.as_slice() {
        [os, arch] if ok(os) && ok(arch) => Some((os.to_string(), arch.to_string(), String::new())),
        [os, arch, variant] if ok(os) && ok(arch) && ok(variant) => {
            Some((os.to_string(), arch.to_string(), variant.to_string()))
        }
        _ => None,
    }
}

/// Maps byte offsets to 1-based lines.
struct Lines {
    starts: Vec<usize>,
    file: String,
}

impl Lines {
    fn new(file: &str, text: &str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines {
            starts,
            file: file.to_string(),
        }
    }

    fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset).max(1)
    }

    fn location(&self, span: &Range<usize>) -> SourceLocation {
        let start = self.line(span.start);
        let end = self
            .line(span.end.saturating_sub(1).max(span.start))
            .max(start);
        SourceLocation {
            file: self.file.clone(),
            start_line: start,
            end_line: end,
        }
    }
}

/// The variables in scope at an instruction. Lookups go through name indexes, so a
/// hostile `ENV` with a hundred thousand pairs stays linear; env and ARGs are persistent
/// maps, so a stage built on another one shares its parent's rather than copying them
/// (issue 44 §3).
///
/// As in BuildKit, `ENV` and an `ARG` with a value write one environment, the one `$VAR`
/// expands from and `RUN` gets, and the later write of a name wins (`dispatchEnv` and
/// `dispatchArg` both add to the stage's state env); only `ENV` reaches the image config.
/// Here `env` is what `ENV` set (the config's env) and `args` the ARGs whose value is the
/// later write: [`Scope::set_env`] removes an ARG of its name.
#[derive(Debug, Clone, Default)]
struct Scope {
    /// `ENV`, in definition order.
    env: EnvMap,
    /// ARGs with a value no later `ENV` of their name replaced, in declaration order (an
    /// ARG without a value writes nothing).
    args: EnvMap,
    /// ARGs of this stage written over a name of the config's env, which a stage built on
    /// this one gets back from the config ([`Scope::for_child_stage`]).
    over_config: Vec<String>,
    /// The base's env is unknown: `$PATH` falls back to Docker's default PATH, which
    /// nearly every Linux base image sets (and BuildKit gives `RUN` when a base has none).
    default_path: bool,
}

impl Scope {
    /// Whether the image config's env has `name` (a base whose env is unknown has `PATH`).
    fn config_has(&self, name: &str) -> bool {
        self.env.contains(name) || (self.default_path && name == "PATH")
    }

    fn get(&self, name: &str) -> Option<String> {
        if let Some(v) = self.args.get(name) {
            return Some(v.to_string());
        }
        if let Some(v) = self.env.get(name) {
            return Some(v.to_string());
        }
        (self.default_path && name == "PATH").then(|| DEFAULT_PATH.to_string())
    }

    /// `ENV key=value`: it replaces the value of an ARG of that name.
    fn set_env(&mut self, key: &str, value: &str) {
        self.env.set(key, value);
        self.args.remove(key);
    }

    /// `ARG key[=value]`. Without a value it writes nothing, so a value the name had stays
    /// (BuildKit's `dispatchArg` and `buildMetaArgs` add nothing for an ARG without one).
    fn set_arg(&mut self, key: &str, value: Option<&str>) {
        if let Some(v) = value {
            if self.config_has(key) {
                self.over_config.push(key.to_string());
            }
            self.args.set(key, v);
        }
    }

    /// The scope a stage built on this one starts with: the same env and ARGs, with the
    /// config's env put over them again, so an ARG written over a name of the config's env
    /// loses there (BuildKit's `dispatchState.init` takes the base's state and build args,
    /// then `dispatchStages` adds each config `Env` entry to the state again).
    fn for_child_stage(&self) -> Scope {
        let mut child = Scope {
            env: self.env.clone(),
            args: self.args.clone(),
            over_config: Vec::new(),
            default_path: self.default_path,
        };
        for k in &self.over_config {
            if child.config_has(k) {
                child.args.remove(k);
            }
        }
        child
    }

    /// The env as `KEY=value` strings, in definition order.
    fn env_strings(&self) -> Vec<String> {
        self.env
            .entries()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }
}

/// Shared state of one lowering.
struct Lowering<'o> {
    options: &'o Options,
    lines: Lines,
    escape: char,
    /// Global ARG values (including the predefined platform ARGs).
    global: Scope,
    /// Build args an ARG consumed.
    used: BTreeSet<String>,
    /// Unset variables referenced since the last instruction was finished.
    undefined: RefCell<Vec<String>>,
    /// The same names as a set (an instruction may reference thousands).
    undefined_set: RefCell<HashSet<String>>,
    /// Bytes of expanded strings so far (see [`MAX_PLAN_BYTES`]).
    plan_bytes: std::cell::Cell<usize>,
    /// The env of each base image given in [`Options::base_images`], made once and shared
    /// by every stage on that image.
    base_envs: HashMap<String, EnvMap>,
    /// Source index of each named stage (names are unique).
    stage_index: HashMap<String, usize>,
}

/// Where a stage reference points before pruning.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ref {
    Stage(usize),
    Image(String),
}

/// A stage lowered on its own, before pruning: stage references use source indices.
#[derive(Debug, Clone)]
struct Draft {
    name: Option<String>,
    base: Base,
    base_stage: Option<usize>,
    platform: String,
    location: SourceLocation,
    steps: Vec<Step>,
    /// Source stage indices referenced by steps, with the offset of the first reference.
    deps: BTreeMap<usize, usize>,
    /// Offset of the FROM line.
    offset: usize,
    /// The image config so far. For a stage on another stage, only what this stage sets
    /// (see [`Stage::config`]); its `env`, `exposed_ports` and `volumes` are filled in by
    /// [`Draft::finish_config`].
    config: ImageConfig,
    /// Names this stage's own `ENV` set, in the order of their first setting here, and
    /// the same as a set.
    own_env: Vec<String>,
    own_env_set: HashSet<String>,
    /// `EXPOSE` and `VOLUME` of this stage (a stage image's own included), sorted.
    ports: BTreeSet<String>,
    volumes: BTreeSet<String>,
    scope: Scope,
    state: StageState,
    used_args: BTreeSet<String>,
    warnings: Vec<Warning>,
    disk_mib: Option<u64>,
    cmd_set: bool,
    /// Whether the base's environment is known (scratch, a stage, or `Options::base_images`).
    base_env_known: bool,
}

/// User, working directory and shell at a point of a stage; each is shared, so a stage on
/// another one takes its parent's without copying them.
#[derive(Debug, Clone, Default)]
struct StageState {
    user: Option<Arc<str>>,
    workdir: Arc<str>,
    shell: Arc<Vec<String>>,
}

impl Draft {
    /// An empty draft, left in the list where a finished one was taken out.
    fn placeholder() -> Draft {
        Draft {
            name: None,
            base: Base::Scratch,
            base_stage: None,
            platform: String::new(),
            location: SourceLocation {
                file: String::new(),
                start_line: 0,
                end_line: 0,
            },
            steps: Vec::new(),
            deps: BTreeMap::new(),
            offset: 0,
            config: ImageConfig::default(),
            own_env: Vec::new(),
            own_env_set: HashSet::new(),
            ports: BTreeSet::new(),
            volumes: BTreeSet::new(),
            scope: Scope::default(),
            state: StageState::default(),
            used_args: BTreeSet::new(),
            warnings: Vec::new(),
            disk_mib: None,
            cmd_set: false,
            base_env_known: true,
        }
    }

    /// Fills in the config's `env`, `exposed_ports` and `volumes`: for a stage on another
    /// stage, the variables this stage set (with their final values) and its own ports
    /// and volumes, which the builder puts over its base stage's config; else the whole
    /// env. Returns the bytes added, for [`MAX_PLAN_BYTES`].
    fn finish_config(&mut self) -> usize {
        self.config.env = if self.base_stage.is_some() {
            self.own_env
                .iter()
                .map(|k| format!("{k}={}", self.scope.env.get(k).unwrap_or_default()))
                .collect()
        } else {
            self.scope.env_strings()
        };
        self.config.exposed_ports = std::mem::take(&mut self.ports).into_iter().collect();
        self.config.volumes = std::mem::take(&mut self.volumes).into_iter().collect();
        [
            &self.config.env,
            &self.config.exposed_ports,
            &self.config.volumes,
        ]
        .iter()
        .flat_map(|v| v.iter())
        .map(|e| e.len() + 24)
        .sum()
    }
}

/// Lowers Dockerfile `text` named `file`.
pub(crate) fn lower(file: &str, text: &str, options: &Options) -> Result<BuildPlan, Fault> {
    let (masked, heredocs) = syntax::mask_run_heredocs(text)?;
    let parsed = syntax::parse(text, &masked, heredocs)?;
    let instrs = super::instructions::convert_all(&parsed, text)?;
    let pd = &parsed.dockerfile.parser_directives;
    let directives = Directives {
        syntax: pd.syntax.as_ref().map(|d| d.value.value.to_string()),
        escape: parsed.escape,
        check: pd.check.as_ref().map(|d| d.value.value.to_string()),
    };
    let source = SourceText {
        file,
        text,
        frontend: Frontend::Dockerfile,
        directives,
    };
    lower_instrs(&source, &instrs, options)
}

/// What [`lower_instrs`] needs to know about the text the instructions came from.
pub(crate) struct SourceText<'a> {
    /// File name for locations.
    pub(crate) file: &'a str,
    /// The text instruction spans index.
    pub(crate) text: &'a str,
    /// Which front end.
    pub(crate) frontend: Frontend,
    /// Directives (the escape character is used for substitution).
    pub(crate) directives: Directives,
}

/// Lowers typed instructions (from a Dockerfile, or made by the YAML front end) into a plan.
pub(crate) fn lower_instrs(
    source: &SourceText<'_>,
    instrs: &[Instr],
    options: &Options,
) -> Result<BuildPlan, Fault> {
    let (file, text, directives) = (source.file, source.text, source.directives.clone());
    let target_platform = options
        .platform
        .clone()
        .unwrap_or_else(|| DEFAULT_PLATFORM.into());
    let build_platform = options
        .build_platform
        .clone()
        .unwrap_or_else(|| DEFAULT_PLATFORM.into());
    let Some((tos, tarch, tvariant)) = parse_platform(&target_platform) else {
        return Err(Fault::new(0, LowerError::Platform(target_platform)));
    };
    let Some((bos, barch, bvariant)) = parse_platform(&build_platform) else {
        return Err(Fault::new(0, LowerError::Platform(build_platform)));
    };
    let mut global = Scope::default();
    for (k, v) in [
        ("TARGETPLATFORM", target_platform.clone()),
        ("TARGETOS", tos),
        ("TARGETARCH", tarch),
        ("TARGETVARIANT", tvariant),
        ("BUILDPLATFORM", build_platform.clone()),
        ("BUILDOS", bos),
        ("BUILDARCH", barch),
        ("BUILDVARIANT", bvariant),
    ] {
        global.set_arg(k, Some(&v));
    }
    let mut lw = Lowering {
        options,
        lines: Lines::new(file, text),
        escape: directives.escape,
        global,
        used: BTreeSet::new(),
        undefined: RefCell::new(Vec::new()),
        undefined_set: RefCell::new(HashSet::new()),
        plan_bytes: std::cell::Cell::new(0),
        base_envs: HashMap::new(),
        stage_index: HashMap::new(),
    };

    // Global ARGs: everything before the first FROM.
    let first_from = instrs
        .iter()
        .position(|i| matches!(i.kind, InstrKind::From { .. }))
        .unwrap_or(0);
    for instr in &instrs[..first_from] {
        if let InstrKind::Arg(pairs) = &instr.kind {
            let mut scope = std::mem::take(&mut lw.global);
            let declared = lw.declare_args(&mut scope, pairs, instr.span.start, true);
            lw.global = scope;
            declared?;
        }
    }

    // Stages as written.
    let mut stage_instrs: Vec<(&Instr, Vec<&Instr>)> = Vec::new();
    for instr in &instrs[first_from..] {
        match &instr.kind {
            InstrKind::From { .. } => stage_instrs.push((instr, Vec::new())),
            _ => {
                if let Some(last) = stage_instrs.last_mut() {
                    last.1.push(instr);
                }
            }
        }
    }
    // Stage names first: COPY --from may name a later stage.
    let mut names: Vec<Option<String>> = Vec::new();
    for (from, _) in &stage_instrs {
        let InstrKind::From { name, .. } = &from.kind else {
            continue;
        };
        let name = name.as_ref().map(|n| n.to_ascii_lowercase());
        if let Some(n) = &name {
            let valid = n.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c));
            if !valid {
                return Err(Fault::new(
                    from.span.start,
                    LowerError::StageName(n.clone()),
                ));
            }
            if lw.stage_index.contains_key(n) {
                return Err(Fault::new(
                    from.span.start,
                    LowerError::DuplicateStage(n.clone()),
                ));
            }
            lw.stage_index.insert(n.clone(), names.len());
        }
        names.push(name);
    }

    let mut drafts: Vec<Result<Draft, Fault>> = Vec::new();
    for (index, (from, body)) in stage_instrs.iter().enumerate() {
        let draft = lw.lower_stage(index, from, body, &names, &drafts);
        drafts.push(draft);
    }
    if drafts.is_empty() {
        return Err(Fault::new(
            0,
            LowerError::Invalid("expected at least one FROM".into()),
        ));
    }

    // Target and pruning.
    let target = match &options.target {
        None => drafts.len() - 1,
        Some(t) => {
            let lower = t.to_ascii_lowercase();
            match names
                .iter()
                .position(|n| n.as_deref() == Some(lower.as_str()))
            {
                Some(i) => i,
                None => match t.parse::<usize>() {
                    Ok(i) if i < drafts.len() => i,
                    _ => return Err(Fault::new(0, LowerError::UnknownTarget(t.clone()))),
                },
            }
        }
    };
    let needed = match visit(target, &drafts, &names) {
        Ok(needed) => needed,
        Err(Visit::Fault(f)) => return Err(f),
        Err(Visit::Stage(i)) => {
            return Err(match drafts.swap_remove(i) {
                Err(f) => f,
                Ok(_) => Fault::new(0, LowerError::StageIndex(i as i64)),
            });
        }
    };
    let order = topological(&needed, &drafts);
    let renumber: BTreeMap<usize, usize> = order
        .iter()
        .enumerate()
        .map(|(plan, &src)| (src, plan))
        .collect();

    // The target's whole env, for its start command (its config may hold only what it set
    // over a base stage).
    let target_env = match drafts.get(target) {
        Some(Ok(d)) => {
            lw.charge(d.scope.env.len() * 24, 0)?;
            d.scope.env_strings()
        }
        _ => Vec::new(),
    };
    let mut stages = Vec::new();
    let mut warnings = Vec::new();
    let mut used = lw.used.clone();
    let mut disk_mib = None;
    for &src in &order {
        // `visit` returned the first error among needed stages, so each is Ok here; each
        // is taken once (order lists a stage once).
        let Some(Ok(draft)) = drafts.get_mut(src) else {
            continue;
        };
        let mut draft = std::mem::replace(draft, Draft::placeholder());
        lw.charge(draft.finish_config(), draft.offset)?;
        remap_stage_refs(&mut draft, &renumber);
        used.extend(std::mem::take(&mut draft.used_args));
        warnings.append(&mut draft.warnings);
        if src == target {
            disk_mib = draft.disk_mib;
        }
        stages.push(Stage {
            name: draft.name,
            index: src,
            base: draft.base,
            platform: draft.platform,
            location: draft.location,
            steps: draft.steps,
            config: draft.config,
        });
    }

    let given = options.build_args.clone();
    let mut unused = Vec::new();
    for name in given.keys() {
        let special = proxy_arg(name).is_some() || name == SOURCE_DATE_EPOCH;
        if !used.contains(name) && !special {
            unused.push(name.clone());
            warnings.push(Warning {
                location: None,
                message: format!("build argument {name} was given but not consumed by any ARG"),
            });
        }
    }
    // The builder clamps timestamps to it; a value that is not Unix seconds is refused here,
    // where `kiln plan` sees it too, rather than ignored as BuildKit does: a reproducible
    // build that silently used the current time would not be one.
    if let Some(epoch) = given.get(SOURCE_DATE_EPOCH) {
        crate::plan::parse_source_date_epoch(epoch)
            .map_err(|e| invalid(0, format!("--build-arg {e}")))?;
    }
    let used: Vec<String> = used.into_iter().filter(|n| given.contains_key(n)).collect();

    let plan_target = stages.len().saturating_sub(1);
    let sandbox = if stages.is_empty() {
        Sandbox::default()
    } else {
        let mut config = effective_config(&stages, plan_target);
        config.env = target_env;
        sandbox_of(&config, disk_mib, options)
    };
    Ok(BuildPlan {
        frontend: source.frontend,
        file: file.to_string(),
        directives,
        platform: target_platform,
        stages,
        target: plan_target,
        build_args: BuildArgs {
            given,
            used,
            unused,
        },
        sandbox,
        limits: Limits::default(),
        warnings,
    })
}

/// The needed stages in dependency order, choosing the lowest source index among the
/// stages whose dependencies are all placed (so a plan without forward references keeps
/// source order).
fn topological(needed: &BTreeSet<usize>, drafts: &[Result<Draft, Fault>]) -> Vec<usize> {
    let mut waiting: BTreeMap<usize, usize> = BTreeMap::new();
    let mut dependents: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for &i in needed {
        let deps: BTreeSet<usize> = match drafts.get(i) {
            Some(Ok(d)) => d.base_stage.iter().chain(d.deps.keys()).copied().collect(),
            _ => BTreeSet::new(),
        };
        let deps: Vec<usize> = deps.into_iter().filter(|d| needed.contains(d)).collect();
        waiting.insert(i, deps.len());
        for d in deps {
            dependents.entry(d).or_default().push(i);
        }
    }
    let mut ready: BTreeSet<usize> = waiting
        .iter()
        .filter(|(_, n)| **n == 0)
        .map(|(&i, _)| i)
        .collect();
    let mut placed = Vec::with_capacity(needed.len());
    // `visit` rejected cycles, so every needed stage becomes ready in turn.
    while let Some(next) = ready.pop_first() {
        placed.push(next);
        for &d in dependents.get(&next).map(Vec::as_slice).unwrap_or_default() {
            if let Some(n) = waiting.get_mut(&d) {
                *n -= 1;
                if *n == 0 {
                    ready.insert(d);
                }
            }
        }
    }
    placed
}

/// Whether `s` names a Linux signal (`TERM`, `SIGTERM`, `sigkill`, `SIGRTMIN+3`), as
/// Docker's signal parsing accepts it.
fn is_signal_name(s: &str) -> bool {
    const NAMES: [&str; 34] = [
        "ABRT", "ALRM", "BUS", "CHLD", "CLD", "CONT", "FPE", "HUP", "ILL", "INT", "IO", "IOT",
        "KILL", "PIPE", "POLL", "PROF", "PWR", "QUIT", "SEGV", "STKFLT", "STOP", "SYS", "TERM",
        "TRAP", "TSTP", "TTIN", "TTOU", "UNUSED", "URG", "USR1", "USR2", "VTALRM", "WINCH", "XCPU",
    ];
    let upper = s.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    if NAMES.contains(&name) || name == "XFSZ" || name == "RTMIN" || name == "RTMAX" {
        return true;
    }
    for (base, sep) in [("RTMIN", '+'), ("RTMAX", '-')] {
        if let Some(n) = name.strip_prefix(base).and_then(|r| r.strip_prefix(sep)) {
            return n.parse::<u32>().is_ok_and(|n| (1..=30).contains(&n));
        }
    }
    false
}

/// Why [`visit`] stopped.
enum Visit {
    /// A dependency problem.
    Fault(Fault),
    /// A needed stage failed to lower: its own error is reported.
    Stage(usize),
}

/// The stages `target` needs (itself included), walking `FROM` stages, `COPY --from` and
/// `RUN --mount from=` without recursion (a hostile chain of thousands of stages must not
/// exhaust the stack); stops on a cycle and on a needed stage that failed to lower.
fn visit(
    target: usize,
    drafts: &[Result<Draft, Fault>],
    names: &[Option<String>],
) -> Result<BTreeSet<usize>, Visit> {
    const NEW: u8 = 0;
    const OPEN: u8 = 1;
    let deps_of = |i: usize| -> Result<Vec<(usize, usize)>, Visit> {
        match drafts.get(i) {
            None => Err(Visit::Fault(Fault::new(
                0,
                LowerError::StageIndex(i as i64),
            ))),
            Some(Err(_)) => Err(Visit::Stage(i)),
            Some(Ok(d)) => Ok(d
                .base_stage
                .iter()
                .map(|&b| (b, d.offset))
                .chain(d.deps.iter().map(|(&k, &v)| (k, v)))
                .collect()),
        }
    };
    let mut state = vec![NEW; drafts.len()];
    let mut needed = BTreeSet::new();
    // (stage, its dependencies with the offset of each reference, next dependency to visit)
    type Frame = (usize, Vec<(usize, usize)>, usize);
    let mut stack: Vec<Frame> = vec![(target, deps_of(target)?, 0)];
    if let Some(s) = state.get_mut(target) {
        *s = OPEN;
    }
    while let Some(top) = stack.len().checked_sub(1) {
        let (node, next) = (stack[top].0, stack[top].2);
        if next >= stack[top].1.len() {
            needed.insert(node);
            state[node] = 2;
            stack.pop();
            continue;
        }
        stack[top].2 += 1;
        let (dep, offset) = stack[top].1[next];
        match state.get(dep).copied() {
            None => {
                return Err(Visit::Fault(Fault::new(
                    offset,
                    LowerError::StageIndex(dep as i64),
                )));
            }
            Some(OPEN) => {
                let name = names
                    .get(dep)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| dep.to_string());
                return Err(Visit::Fault(Fault::new(offset, LowerError::Cycle(name))));
            }
            Some(NEW) => {
                state[dep] = OPEN;
                stack.push((dep, deps_of(dep)?, 0));
            }
            Some(_) => {}
        }
    }
    Ok(needed)
}

fn remap(from: &mut MountFrom, renumber: &BTreeMap<usize, usize>) {
    if let MountFrom::Stage { stage } = from {
        *stage = renumber.get(stage).copied().unwrap_or(*stage);
    }
}

fn remap_stage_refs(draft: &mut Draft, renumber: &BTreeMap<usize, usize>) {
    if let Base::Stage { stage } = &mut draft.base {
        *stage = renumber.get(stage).copied().unwrap_or(*stage);
    }
    for step in &mut draft.steps {
        match &mut step.action {
            Action::Copy(c) | Action::Add(c) => {
                if let Some(f) = &mut c.from {
                    remap(f, renumber);
                }
            }
            Action::Run(r) => {
                for m in &mut r.mounts {
                    match m {
                        Mount::Bind { from: Some(f), .. } | Mount::Cache { from: Some(f), .. } => {
                            remap(f, renumber)
                        }
                        _ => {}
                    }
                }
            }
            Action::Mkdir(_) => {}
        }
    }
}

/// The whole config of `stages[i]`: the configs down its chain of base stages, each put
/// over the one below as the builder does (`merge_run_config`): fields set win, labels,
/// ports and volumes add up, ONBUILD is the stage's own. The env is left as the stages
/// give it (the caller has the whole env from the scope). Linear in the chain's configs.
fn effective_config(stages: &[Stage], i: usize) -> ImageConfig {
    fn or<T: Clone>(over: &Option<T>, base: &mut Option<T>) {
        if over.is_some() {
            base.clone_from(over);
        }
    }
    // Stages are in dependency order, so a base stage comes before its child.
    let mut chain = vec![i];
    let mut at = i;
    while let Some(Base::Stage { stage }) = stages.get(at).map(|s| &s.base) {
        if *stage >= at {
            break;
        }
        at = *stage;
        chain.push(at);
    }
    let mut out = ImageConfig::default();
    let mut ports = BTreeSet::new();
    let mut volumes = BTreeSet::new();
    for &j in chain.iter().rev() {
        let c = &stages[j].config;
        or(&c.entrypoint, &mut out.entrypoint);
        or(&c.cmd, &mut out.cmd);
        or(&c.user, &mut out.user);
        or(&c.workdir, &mut out.workdir);
        or(&c.stop_signal, &mut out.stop_signal);
        or(&c.healthcheck, &mut out.healthcheck);
        or(&c.shell, &mut out.shell);
        out.labels
            .extend(c.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        ports.extend(c.exposed_ports.iter().cloned());
        volumes.extend(c.volumes.iter().cloned());
        out.env.clone_from(&c.env);
        out.onbuild.clone_from(&c.onbuild);
    }
    out.exposed_ports = ports.into_iter().collect();
    out.volumes = volumes.into_iter().collect();
    out
}

fn sandbox_of(config: &ImageConfig, disk_mib: Option<u64>, options: &Options) -> Sandbox {
    let mut argv = Vec::new();
    argv.extend(config.entrypoint.clone().unwrap_or_default());
    argv.extend(config.cmd.clone().unwrap_or_default());
    let start = (!argv.is_empty()).then(|| StartCommand {
        argv,
        user: config.user.clone(),
        env: config.env.clone(),
        workdir: config.workdir.clone(),
    });
    let ready = config.healthcheck.as_ref().and_then(|h| {
        let argv = match h.test.first().map(String::as_str) {
            Some("CMD") => h.test[1..].to_vec(),
            Some("CMD-SHELL") => {
                let mut v: Vec<String> = config
                    .shell
                    .clone()
                    .unwrap_or_else(|| DEFAULT_SHELL.map(String::from).to_vec());
                v.extend(h.test[1..].iter().cloned());
                v
            }
            _ => return None,
        };
        Some(ReadyCheck {
            argv,
            interval_ms: h.interval_ms.unwrap_or(30_000),
            timeout_ms: h.timeout_ms.unwrap_or(30_000),
            retries: h.retries.unwrap_or(3),
        })
    });
    Sandbox {
        start,
        ready,
        disk_mib: options.disk_mib.or(disk_mib),
    }
}

/// Parses a Go duration (`1h2m3s`, `500ms`, `1.5s`) into milliseconds, rounded.
pub(crate) fn parse_duration_ms(s: &str) -> Option<u64> {
    // Bounded to 1e15 ms by `parse_duration_exact_ms`, so the cast cannot saturate.
    parse_duration_exact_ms(s).map(|ms| ms.round() as u64)
}

/// Parses a Go duration into milliseconds, unrounded (so `500us` is 0.5). `None`: not a
/// duration, or above 1e15 ms.
fn parse_duration_exact_ms(s: &str) -> Option<f64> {
    if s == "0" {
        return Some(0.0);
    }
    let mut total: f64 = 0.0;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_len] {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * factor;
    }
    if !total.is_finite() || total > 1e15 {
        return None;
    }
    Some(total)
}

fn is_octal_mode(s: &str) -> bool {
    (1..=4).contains(&s.len()) && s.chars().all(|c| ('0'..='7').contains(&c))
}

/// `--chmod`: octal, or symbolic clauses like `u+x,g-w,o=r` (BuildKit 1.14+).
pub(crate) fn valid_chmod(s: &str) -> bool {
    if is_octal_mode(s) {
        return true;
    }
    !s.is_empty()
        && s.split(',').all(|clause| {
            let who_len = clause
                .find(|c: char| !"ugoa".contains(c))
                .unwrap_or(clause.len());
            let rest = &clause[who_len..];
            let mut chars = rest.chars();
            matches!(chars.next(), Some('+' | '-' | '=')) && chars.all(|c| "rwxXst+-=".contains(c))
        })
}

pub(crate) fn parse_size(s: &str) -> Option<u64> {
    let lower = s.to_ascii_lowercase();
    let trimmed = lower.trim_end_matches('b').trim_end_matches('i');
    let (num, mult) = match trimmed.char_indices().last()? {
        (i, 'k') => (&trimmed[..i], 1u64 << 10),
        (i, 'm') => (&trimmed[..i], 1 << 20),
        (i, 'g') => (&trimmed[..i], 1 << 30),
        (i, 't') => (&trimmed[..i], 1 << 40),
        _ => (trimmed, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

/// Joins `p` to `workdir` unless absolute, as BuildKit's `pathRelativeToWorkingDir`.
fn resolve_path(workdir: &str, p: &str) -> String {
    if p.starts_with('/') {
        return p.to_string();
    }
    clean_path(&format!("{workdir}/{p}"))
}

/// Lexical cleaning like Go's `path.Clean` for absolute paths.
fn clean_path(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Splits a `--mount` value into key=value fields (CSV with optional quotes).
fn csv_fields(s: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quote = false;
    for c in s.chars() {
        match c {
            '"' => quote = !quote,
            ',' if !quote => fields.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    fields.push(cur);
    fields.into_iter().filter(|f| !f.is_empty()).collect()
}

impl Lowering<'_> {
    fn expand(&self, word: &str, scope: &Scope, offset: usize) -> Result<String, Fault> {
        let mut lookup = |name: &str| scope.get(name);
        let (out, unset) = expand_word_tracking(word, self.escape, &mut lookup)
            .map_err(|e| words_fault(offset, e))?;
        self.charge(out.len(), offset)?;
        let mut undefined = self.undefined.borrow_mut();
        let mut seen = self.undefined_set.borrow_mut();
        for name in unset {
            if seen.insert(name.clone()) {
                undefined.push(name);
            }
        }
        Ok(out)
    }

    /// Counts `bytes` against [`MAX_PLAN_BYTES`].
    fn charge(&self, bytes: usize, offset: usize) -> Result<(), Fault> {
        let total = self.plan_bytes.get().saturating_add(bytes);
        self.plan_bytes.set(total);
        if total > MAX_PLAN_BYTES {
            return Err(Fault::new(offset, LowerError::TooLarge));
        }
        Ok(())
    }

    /// Turns the unset variables referenced by the instruction just lowered into warnings.
    fn flush_undefined(&self, draft: &mut Draft, location: &SourceLocation) {
        let names = std::mem::take(&mut *self.undefined.borrow_mut());
        self.undefined_set.borrow_mut().clear();
        for name in names {
            let note = if draft.base_env_known {
                ""
            } else {
                " (the base image's own environment is not known at plan time)"
            };
            draft.warnings.push(Warning {
                location: Some(location.clone()),
                message: format!("variable {name} is not defined and expands to empty{note}"),
            });
        }
    }

    /// Declares ARGs into `scope`, applying build args and global inheritance.
    fn declare_args(
        &mut self,
        scope: &mut Scope,
        pairs: &[(String, Option<String>)],
        offset: usize,
        is_global: bool,
    ) -> Result<BTreeSet<String>, Fault> {
        let mut used = BTreeSet::new();
        for (raw_name, raw_default) in pairs {
            let name = self.expand(raw_name, scope, offset)?;
            if name.is_empty() {
                return Err(invalid(offset, "ARG names can not be blank"));
            }
            // A build arg replaces the default unexpanded, so a default such as
            // `${X:?missing}` is not evaluated (BuildKit's `dispatchArg`, `buildMetaArgs`).
            let value = match (self.options.build_args.get(&name), raw_default) {
                (Some(v), _) => {
                    used.insert(name.clone());
                    Some(v.clone())
                }
                (None, Some(d)) => Some(self.expand(d, scope, offset)?),
                (None, None) if !is_global => self.global.get(&name),
                (None, None) => None,
            };
            scope.set_arg(&name, value.as_deref());
        }
        if is_global {
            // Stage ARGs count only if their stage is built (`Draft::used_args`).
            self.used.extend(used.iter().cloned());
        }
        Ok(used)
    }

    fn resolve_ref(&self, word: &str, count: usize, offset: usize) -> Result<Ref, Fault> {
        let lower = word.to_ascii_lowercase();
        if let Some(&i) = self.stage_index.get(&lower) {
            return Ok(Ref::Stage(i));
        }
        let digits = word.strip_prefix('-').unwrap_or(word);
        if !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()) {
            return match word.parse::<i64>() {
                Ok(i) if i >= 0 && (i as usize) < count => Ok(Ref::Stage(i as usize)),
                Ok(i) => Err(Fault::new(offset, LowerError::StageIndex(i))),
                Err(_) => Err(Fault::new(offset, LowerError::StageIndex(i64::MAX))),
            };
        }
        if word.is_empty() || word.chars().any(char::is_whitespace) {
            return Err(invalid(
                offset,
                format!("invalid stage or image reference '{word}'"),
            ));
        }
        Ok(Ref::Image(word.to_string()))
    }

    fn lower_stage(
        &mut self,
        index: usize,
        from: &Instr,
        body: &[&Instr],
        names: &[Option<String>],
        drafts: &[Result<Draft, Fault>],
    ) -> Result<Draft, Fault> {
        let InstrKind::From {
            platform, image, ..
        } = &from.kind
        else {
            return Err(invalid(from.span.start, "expected FROM"));
        };
        let offset = from.span.start;
        let image_name = self.expand(image, &self.global, offset)?;
        if image_name.is_empty() {
            return Err(Fault::new(offset, LowerError::BlankBase(image.clone())));
        }
        if image_name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                offset,
                format!("invalid reference format: '{image_name}'"),
            ));
        }
        let explicit_platform = platform.is_some();
        let stage_platform = match platform {
            Some(p) => {
                let p = self.expand(p, &self.global, offset)?;
                if parse_platform(&p).is_none() {
                    return Err(Fault::new(offset, LowerError::Platform(p)));
                }
                p
            }
            None => self
                .global
                .get("TARGETPLATFORM")
                .unwrap_or_else(|| DEFAULT_PLATFORM.into()),
        };
        let lower_name = image_name.to_ascii_lowercase();
        let earlier = self
            .stage_index
            .get(&lower_name)
            .copied()
            .filter(|&i| i < index);
        let mut draft = Draft {
            name: names.get(index).cloned().flatten(),
            base: Base::Scratch,
            base_stage: None,
            platform: stage_platform,
            location: self.lines.location(&from.span),
            steps: Vec::new(),
            deps: BTreeMap::new(),
            offset,
            config: ImageConfig::default(),
            own_env: Vec::new(),
            own_env_set: HashSet::new(),
            ports: BTreeSet::new(),
            volumes: BTreeSet::new(),
            scope: Scope::default(),
            state: StageState {
                user: None,
                workdir: "/".into(),
                shell: Arc::new(DEFAULT_SHELL.map(String::from).to_vec()),
            },
            used_args: BTreeSet::new(),
            warnings: Vec::new(),
            disk_mib: None,
            cmd_set: false,
            base_env_known: true,
        };
        let mut triggers = Vec::new();
        let mut trigger_source = "base stage";
        if let Some(parent) = earlier {
            draft.base = Base::Stage { stage: parent };
            draft.base_stage = Some(parent);
            if let Some(Ok(p)) = drafts.get(parent) {
                if !explicit_platform {
                    // A stage built on another stage runs on that stage's platform.
                    draft.platform = p.platform.clone();
                }
                // The config starts empty: what this stage sets goes over its base stage's
                // config ([`Stage::config`]); env, user, working directory and shell are
                // shared with the parent, not copied.
                draft.scope = p.scope.for_child_stage();
                draft.base_env_known = p.base_env_known;
                draft.state = p.state.clone();
                draft.disk_mib = p.disk_mib;
                // The parent's ONBUILD triggers run in this stage, as BuildKit does.
                triggers = p.config.onbuild.clone();
            }
        } else if image_name == "scratch" {
            draft.base = Base::Scratch;
            draft.scope.set_env("PATH", DEFAULT_PATH);
        } else {
            match self.options.base_images.get(&image_name) {
                Some(base) => {
                    let env = self.base_envs.entry(image_name.clone()).or_insert_with(|| {
                        let mut env = EnvMap::default();
                        for entry in &base.env {
                            let (k, v) = entry.split_once('=').unwrap_or((entry.as_str(), ""));
                            env.set(k, v);
                        }
                        // BuildKit's `dispatchStages` adds Docker's default PATH to a
                        // stage's config env when its base has none.
                        if !env.contains("PATH") {
                            env.set("PATH", DEFAULT_PATH);
                        }
                        env
                    });
                    draft.scope.env = env.clone();
                    // BuildKit starts the stage's image config from the base's, so its
                    // known env, working directory and user stay in the config (and reach
                    // the start command) until the Dockerfile changes them.
                    if let Some(w) = base.workdir.as_deref().filter(|w| !w.is_empty()) {
                        let w = resolve_path("/", w);
                        self.charge(w.len(), offset)?;
                        draft.config.workdir = Some(w.clone());
                        draft.state.workdir = w.into();
                    }
                    draft.state.user = base
                        .user
                        .as_deref()
                        .filter(|u| !u.is_empty())
                        .map(Arc::from);
                    draft.config.user = draft.state.user.as_deref().map(String::from);
                    self.charge(draft.config.user.as_ref().map_or(0, String::len), offset)?;
                    // The base image's ONBUILD triggers run first, as a stage base's do.
                    triggers = base.onbuild.clone();
                    trigger_source = "base image";
                }
                None => {
                    draft.base_env_known = false;
                    draft.scope.default_path = true;
                }
            }
            draft.base = Base::Image {
                reference: image_name,
            };
        }
        let from_location = draft.location.clone();
        self.flush_undefined(&mut draft, &from_location);
        for trigger in &triggers {
            // Each stage on the parent runs its triggers again: counted, so that many
            // stages on one with many triggers cannot go quadratic unnoticed.
            self.charge(trigger.len(), offset)?;
            let instr = parse_trigger(trigger, self.escape).map_err(|msg| {
                invalid(
                    offset,
                    format!("ONBUILD trigger '{trigger}' of the {trigger_source}: {msg}"),
                )
            })?;
            let located = Instr {
                span: from.span.clone(),
                kind: instr.kind,
            };
            self.lower_instr(&mut draft, &located, names.len())?;
        }
        for instr in body {
            self.lower_instr(&mut draft, instr, names.len())?;
        }
        Ok(draft)
    }

    /// The context of a step at this point of the stage; its bytes count against
    /// [`MAX_PLAN_BYTES`].
    fn context(&self, draft: &Draft, with_args: bool, offset: usize) -> Result<StepContext, Fault> {
        // Counted before it is made: the env is the large part.
        self.charge(draft.scope.env.len() * 24, offset)?;
        let scope = &draft.scope;
        let env: Vec<String> = if with_args {
            // The env, but where an ARG is the later write, then the ARGs.
            let env = scope.env.entries().into_iter();
            env.filter(|(k, _)| !scope.args.contains(k))
                .chain(scope.args.entries())
                .map(|(k, v)| format!("{k}={v}"))
                .collect()
        } else {
            scope.env_strings()
        };
        let state = &draft.state;
        let shell: usize = state.shell.iter().map(|w| w.len() + 24).sum();
        let user = state.user.as_deref().map_or(0, str::len);
        self.charge(
            env.iter().map(|e| e.len()).sum::<usize>() + shell + user + state.workdir.len(),
            offset,
        )?;
        Ok(StepContext {
            env,
            user: state.user.as_deref().map(String::from),
            workdir: state.workdir.to_string(),
            shell: state.shell.to_vec(),
        })
    }

    /// The argv of a `CMD` or `ENTRYPOINT`; its bytes count against [`MAX_PLAN_BYTES`] (a
    /// shell form copies the stage's shell).
    fn command_argv(
        &self,
        draft: &Draft,
        cmd: &CommandLine,
        offset: usize,
    ) -> Result<Vec<String>, Fault> {
        let argv = match cmd {
            CommandLine::Exec(v) => v.clone(),
            CommandLine::Shell(s) => {
                let mut v = draft.state.shell.to_vec();
                v.push(s.clone());
                v
            }
        };
        self.charge(argv.iter().map(|w| w.len() + 24).sum(), offset)?;
        Ok(argv)
    }

    fn lower_instr(&mut self, draft: &mut Draft, instr: &Instr, count: usize) -> Result<(), Fault> {
        self.undefined.borrow_mut().clear();
        self.undefined_set.borrow_mut().clear();
        self.lower_instr_inner(draft, instr, count)?;
        let location = self.lines.location(&instr.span);
        self.flush_undefined(draft, &location);
        Ok(())
    }

    fn lower_instr_inner(
        &mut self,
        draft: &mut Draft,
        instr: &Instr,
        count: usize,
    ) -> Result<(), Fault> {
        let offset = instr.span.start;
        let location = self.lines.location(&instr.span);
        match &instr.kind {
            InstrKind::From { .. } => return Err(invalid(offset, "unexpected FROM")),
            InstrKind::Arg(pairs) => {
                let used = self.declare_args(&mut draft.scope, pairs, offset, false)?;
                draft.used_args.extend(used);
            }
            InstrKind::Env(pairs) => {
                // BuildKit expands every pair against the env before the instruction, so
                // `ENV A=2 B=$A` sees the old A.
                let mut expanded = Vec::with_capacity(pairs.len());
                for (k, v) in pairs {
                    let key = self.expand(k, &draft.scope, offset)?;
                    let value = self.expand(v, &draft.scope, offset)?;
                    if key.is_empty() {
                        return Err(invalid(offset, "ENV names can not be blank"));
                    }
                    expanded.push((key, value));
                }
                for (key, value) in expanded {
                    draft.scope.set_env(&key, &value);
                    if draft.own_env_set.insert(key.clone()) {
                        draft.own_env.push(key);
                    }
                }
                // The config's env is made once, when the stage is finished
                // ([`Draft::finish_config`]), not on each ENV.
            }
            InstrKind::Label(pairs) => {
                for (k, v) in pairs {
                    let key = self.expand(k, &draft.scope, offset)?;
                    let value = self.expand(v, &draft.scope, offset)?;
                    if key.is_empty() {
                        return Err(invalid(offset, "LABEL names can not be blank"));
                    }
                    if key == DISK_LABEL {
                        match value.parse::<u64>() {
                            Ok(n) if n > 0 => draft.disk_mib = Some(n),
                            _ => {
                                return Err(invalid(
                                    offset,
                                    format!(
                                        "{DISK_LABEL} must be a positive integer (MiB), got '{value}'"
                                    ),
                                ));
                            }
                        }
                    }
                    draft.config.labels.insert(key, value);
                }
            }
            InstrKind::Maintainer(name) => {
                draft
                    .config
                    .labels
                    .insert("maintainer".into(), name.clone());
            }
            InstrKind::Run {
                mounts,
                network,
                security,
                command,
                heredocs,
            } => {
                let run = self.lower_run(
                    draft, mounts, network, security, command, heredocs, count, offset,
                )?;
                let context = self.context(draft, true, offset)?;
                draft.steps.push(Step {
                    location,
                    action: Action::Run(run),
                    context,
                });
            }
            InstrKind::Cmd(c) => {
                draft.config.cmd = Some(self.command_argv(draft, c, offset)?);
                draft.cmd_set = true;
            }
            InstrKind::Entrypoint(c) => {
                draft.config.entrypoint = Some(self.command_argv(draft, c, offset)?);
                if !draft.cmd_set {
                    // BuildKit drops an inherited CMD when ENTRYPOINT is set; `Some([])`
                    // tells the builder not to take the base image's CMD either.
                    draft.config.cmd = Some(Vec::new());
                }
            }
            InstrKind::Copy(args) | InstrKind::Add(args) => {
                let is_add = matches!(instr.kind, InstrKind::Add(_));
                let step = self.lower_copy(draft, args, is_add, count, offset)?;
                let context = self.context(draft, false, offset)?;
                let action = if is_add {
                    Action::Add(step)
                } else {
                    Action::Copy(step)
                };
                draft.steps.push(Step {
                    location,
                    action,
                    context,
                });
            }
            InstrKind::Expose(ports) => {
                for p in ports {
                    // BuildKit expands EXPOSE with word splitting: `$PORTS` may hold several.
                    let expanded = self.expand(p, &draft.scope, offset)?;
                    for p in expanded.split_whitespace() {
                        for port in expand_ports(p).map_err(|m| invalid(offset, m))? {
                            draft.ports.insert(port);
                        }
                    }
                }
            }
            InstrKind::Volume(paths) => {
                for p in paths {
                    let p = self.expand(p, &draft.scope, offset)?;
                    if p.trim().is_empty() {
                        return Err(invalid(
                            offset,
                            "VOLUME specified can not be an empty string",
                        ));
                    }
                    draft.volumes.insert(p);
                }
            }
            InstrKind::User(u) => {
                let u = self.expand(u, &draft.scope, offset)?;
                draft.state.user = Some(Arc::from(u.as_str()));
                draft.config.user = Some(u);
            }
            InstrKind::Workdir(w) => {
                let w = self.expand(w, &draft.scope, offset)?;
                if w.is_empty() {
                    return Err(invalid(offset, "WORKDIR path can not be empty"));
                }
                let path = resolve_path(&draft.state.workdir, &w);
                draft.state.workdir = Arc::from(path.as_str());
                draft.config.workdir = Some(path.clone());
                let context = self.context(draft, false, offset)?;
                draft.steps.push(Step {
                    location,
                    action: Action::Mkdir(MkdirStep { path, mode: 0o755 }),
                    context,
                });
            }
            InstrKind::Stopsignal(s) => {
                let s = self.expand(s, &draft.scope, offset)?;
                let numeric = s.parse::<u32>().is_ok_and(|n| (1..=64).contains(&n));
                if !numeric && !is_signal_name(&s) {
                    return Err(invalid(offset, format!("invalid stop signal '{s}'")));
                }
                draft.config.stop_signal = Some(s);
            }
            InstrKind::Healthcheck(h) => {
                draft.config.healthcheck = Some(self.lower_healthcheck(draft, h, offset)?);
            }
            InstrKind::Shell(v) => {
                if v.is_empty() {
                    return Err(invalid(offset, "SHELL requires at least one argument"));
                }
                draft.state.shell = Arc::new(v.clone());
                draft.config.shell = Some(v.clone());
            }
            InstrKind::Onbuild { trigger, .. } => {
                draft.config.onbuild.push(trigger.clone());
            }
        }
        Ok(())
    }

    fn lower_healthcheck(
        &self,
        draft: &Draft,
        h: &HealthcheckArgs,
        offset: usize,
    ) -> Result<Healthcheck, Fault> {
        let dur = |name: &str, v: &Option<String>| -> Result<Option<u64>, Fault> {
            match v {
                None => Ok(None),
                // BuildKit's `parseOptInterval`: 0 means the default, and anything else
                // below `container.MinimumDuration` (1 ms) is refused.
                Some(s) => match parse_duration_exact_ms(s) {
                    Some(0.0) => Ok(None),
                    Some(ms) if ms < 1.0 => Err(invalid(
                        offset,
                        format!("HEALTHCHECK --{name}: '{s}' is less than the minimum of 1ms"),
                    )),
                    // At most 1e15 (checked by the parser): the cast cannot saturate.
                    Some(ms) => Ok(Some(ms.round() as u64)),
                    None => Err(invalid(
                        offset,
                        format!("HEALTHCHECK --{name}: invalid duration '{s}'"),
                    )),
                },
            }
        };
        let retries = match &h.retries {
            None => None,
            Some(r) => match r.parse::<u32>() {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(invalid(
                        offset,
                        format!("HEALTHCHECK --retries: invalid number '{r}'"),
                    ));
                }
            },
        };
        let test = match &h.test {
            None => vec!["NONE".to_string()],
            Some(CommandLine::Exec(v)) => {
                let mut t = vec!["CMD".to_string()];
                t.extend(v.iter().cloned());
                t
            }
            Some(CommandLine::Shell(s)) => vec!["CMD-SHELL".to_string(), s.clone()],
        };
        let _ = draft;
        Ok(Healthcheck {
            test,
            interval_ms: dur("interval", &h.interval)?,
            timeout_ms: dur("timeout", &h.timeout)?,
            start_period_ms: dur("start-period", &h.start_period)?,
            start_interval_ms: dur("start-interval", &h.start_interval)?,
            retries,
        })
    }

    fn mount_from(
        &self,
        draft: &mut Draft,
        word: &str,
        count: usize,
        offset: usize,
    ) -> Result<MountFrom, Fault> {
        Ok(match self.resolve_ref(word, count, offset)? {
            Ref::Stage(i) => {
                draft.deps.entry(i).or_insert(offset);
                MountFrom::Stage { stage: i }
            }
            Ref::Image(reference) => MountFrom::Image { reference },
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn lower_run(
        &self,
        draft: &mut Draft,
        mounts: &[(String, usize)],
        network: &Option<String>,
        security: &Option<String>,
        command: &CommandLine,
        heredocs: &[RunHeredoc],
        count: usize,
        offset: usize,
    ) -> Result<RunStep, Fault> {
        let network = match network.as_deref() {
            None | Some("default") => Network::Default,
            Some("none") => Network::None,
            Some("host") => Network::Host,
            Some(other) => {
                return Err(invalid(
                    offset,
                    format!("invalid --network '{other}': expected default, none or host"),
                ));
            }
        };
        let security = match security.as_deref() {
            None | Some("sandbox") => Security::Sandbox,
            // In the plan; the builder runs it only with the security.insecure entitlement.
            Some("insecure") => Security::Insecure,
            Some(other) => {
                return Err(invalid(
                    offset,
                    format!("invalid --security '{other}': expected sandbox or insecure"),
                ));
            }
        };
        let mut lowered = Vec::new();
        let mut ssh_mounts = 0;
        for (raw, at) in mounts {
            let mut m = self.lower_mount(draft, raw, *at, count)?;
            if let Mount::Ssh { target, .. } = &mut m {
                if target.is_empty() {
                    *target = format!("/run/buildkit/ssh_agent.{ssh_mounts}");
                }
                ssh_mounts += 1;
            }
            lowered.push(m);
        }
        let (form, argv, files) = match command {
            CommandLine::Exec(v) => (CommandForm::Exec, v.clone(), Vec::new()),
            CommandLine::Shell(cmd) if heredocs.is_empty() => {
                let mut argv = draft.state.shell.to_vec();
                argv.push(cmd.clone());
                (CommandForm::Shell, argv, Vec::new())
            }
            CommandLine::Shell(cmd) => {
                let words = crate::shell_words::split_words(cmd, '\\');
                let single = words.len() == 1 && heredocs.len() == 1;
                if single {
                    let doc = &heredocs[0];
                    let data = doc.content();
                    if data.starts_with("#!") {
                        let path = format!("/dev/pipes/{}", doc.name);
                        let file = InlineFile {
                            name: doc.name.clone(),
                            data,
                            path: Some(path.clone()),
                            mode: 0o755,
                        };
                        // BuildKit prepends the shell to the script path too.
                        let mut argv = draft.state.shell.to_vec();
                        argv.push(path);
                        (CommandForm::Shell, argv, vec![file])
                    } else {
                        let mut argv = draft.state.shell.to_vec();
                        argv.push(data);
                        (CommandForm::Shell, argv, Vec::new())
                    }
                } else {
                    let mut full = cmd.clone();
                    for doc in heredocs {
                        full.push('\n');
                        full.push_str(&doc.raw);
                        full.push_str(&doc.name);
                    }
                    let mut argv = draft.state.shell.to_vec();
                    argv.push(full);
                    (CommandForm::Shell, argv, Vec::new())
                }
            }
        };
        self.charge(argv.iter().map(|w| w.len() + 24).sum(), offset)?;
        // The proxy build args reach `RUN` without an ARG, in both spellings, after the
        // stage's env (BuildKit: `proxyEnvFromBuildArgs`, the exec op's `proxyEnvList`); a
        // name the stage's env has keeps its value there.
        let mut proxy_env = Vec::new();
        for (upper, value) in proxy_env_of(&self.options.build_args) {
            for name in [upper.to_string(), upper.to_ascii_lowercase()] {
                if draft.scope.get(&name).is_none() {
                    proxy_env.push(format!("{name}={value}"));
                }
            }
        }
        Ok(RunStep {
            form,
            argv,
            files,
            mounts: lowered,
            network,
            security,
            proxy_env,
        })
    }

    fn lower_mount(
        &self,
        draft: &mut Draft,
        raw: &str,
        offset: usize,
        count: usize,
    ) -> Result<Mount, Fault> {
        let mut fields: BTreeMap<String, Option<String>> = BTreeMap::new();
        let mut kind = "bind".to_string();
        for field in csv_fields(raw) {
            let (k, v) = match field.split_once('=') {
                Some((k, v)) => (
                    k.trim().to_ascii_lowercase(),
                    Some(self.expand(v, &draft.scope, offset)?),
                ),
                None => (field.trim().to_ascii_lowercase(), None),
            };
            let key = match k.as_str() {
                "dst" | "destination" => "target".to_string(),
                "src" => "source".to_string(),
                "ro" => "readonly".to_string(),
                "rw" => "readwrite".to_string(),
                _ => k,
            };
            if key == "type" {
                kind = v.clone().unwrap_or_default();
                continue;
            }
            let allowed: &[&str] = match kind.as_str() {
                "bind" => &["target", "source", "from", "readonly", "readwrite"],
                "cache" => &[
                    "target",
                    "id",
                    "sharing",
                    "from",
                    "source",
                    "mode",
                    "uid",
                    "gid",
                    "readonly",
                    "readwrite",
                ],
                "tmpfs" => &["target", "size"],
                "secret" => &["target", "id", "required", "mode", "uid", "gid", "env"],
                "ssh" => &["target", "id", "required", "mode", "uid", "gid"],
                other => return Err(invalid(offset, format!("unsupported mount type '{other}'"))),
            };
            if !allowed.contains(&key.as_str()) {
                return Err(invalid(
                    offset,
                    format!("unexpected key '{key}' in --mount type={kind}"),
                ));
            }
            fields.insert(key, v);
        }
        let get = |k: &str| fields.get(k).cloned().flatten();
        let flag = |k: &str| -> Result<bool, Fault> {
            match fields.get(k) {
                None => Ok(false),
                Some(None) => Ok(true),
                Some(Some(v)) => match v.as_str() {
                    "true" | "1" => Ok(true),
                    "false" | "0" => Ok(false),
                    _ => Err(invalid(offset, format!("invalid value for {k}: '{v}'"))),
                },
            }
        };
        let number = |k: &str, radix: u32, default: u32| -> Result<u32, Fault> {
            match get(k) {
                None => Ok(default),
                Some(v) => u32::from_str_radix(&v, radix)
                    .map_err(|_| invalid(offset, format!("invalid {k} '{v}' in --mount"))),
            }
        };
        let target = get("target").map(|t| resolve_path(&draft.state.workdir, &t));
        let from = match get("from") {
            Some(f) => Some(self.mount_from(draft, &f, count, offset)?),
            None => None,
        };
        let readonly = flag("readonly")?;
        let readwrite = flag("readwrite")?;
        Ok(match kind.as_str() {
            "bind" => Mount::Bind {
                target: target
                    .ok_or_else(|| invalid(offset, "--mount type=bind needs a target"))?,
                source: get("source").unwrap_or_default(),
                from,
                readwrite: readwrite && !readonly,
            },
            "cache" => {
                let target =
                    target.ok_or_else(|| invalid(offset, "--mount type=cache needs a target"))?;
                let sharing = get("sharing").unwrap_or_else(|| "shared".into());
                if !["shared", "private", "locked"].contains(&sharing.as_str()) {
                    return Err(invalid(
                        offset,
                        format!("unsupported sharing value '{sharing}'"),
                    ));
                }
                Mount::Cache {
                    id: get("id").unwrap_or_else(|| target.clone()),
                    target,
                    sharing,
                    from,
                    source: get("source"),
                    mode: number("mode", 8, 0o755)?,
                    uid: number("uid", 10, 0)?,
                    gid: number("gid", 10, 0)?,
                    readonly,
                }
            }
            // BuildKit's `dispatchSSH` and `AddSSHSocket`: id `default`, mode 0600, owner
            // 0:0, optional unless `required`; an empty target is given its default by
            // `lower_run`, which knows the mount's place among the step's ssh mounts.
            "ssh" => Mount::Ssh {
                id: get("id")
                    .filter(|i| !i.is_empty())
                    .unwrap_or_else(|| "default".into()),
                target: target.unwrap_or_default(),
                required: flag("required")?,
                mode: number("mode", 8, 0o600)?,
                uid: number("uid", 10, 0)?,
                gid: number("gid", 10, 0)?,
            },
            "tmpfs" => Mount::Tmpfs {
                target: target
                    .ok_or_else(|| invalid(offset, "--mount type=tmpfs needs a target"))?,
                size: match get("size") {
                    None => None,
                    Some(s) => Some(
                        parse_size(&s)
                            .ok_or_else(|| invalid(offset, format!("invalid tmpfs size '{s}'")))?,
                    ),
                },
            },
            _ => {
                let env = get("env");
                let id = match (get("id"), &target) {
                    (Some(id), _) => id,
                    (None, Some(t)) => t.rsplit('/').next().unwrap_or_default().to_string(),
                    (None, None) => {
                        return Err(invalid(
                            offset,
                            "--mount type=secret needs an id or a target",
                        ));
                    }
                };
                let target = match (target, &env) {
                    (Some(t), _) => Some(t),
                    (None, None) => Some(format!("/run/secrets/{id}")),
                    (None, Some(_)) => None,
                };
                Mount::Secret {
                    id,
                    target,
                    env,
                    required: flag("required")?,
                    mode: number("mode", 8, 0o400)?,
                    uid: number("uid", 10, 0)?,
                    gid: number("gid", 10, 0)?,
                }
            }
        })
    }

    fn lower_copy(
        &self,
        draft: &mut Draft,
        args: &CopyArgs,
        is_add: bool,
        count: usize,
        offset: usize,
    ) -> Result<CopyStep, Fault> {
        let scope = draft.scope.clone();
        let ex = |w: &str| self.expand(w, &scope, offset);
        let from = match &args.from {
            Some(f) => {
                let f = ex(f)?;
                Some(self.mount_from(draft, &f, count, offset)?)
            }
            None => None,
        };
        let mut sources = Vec::new();
        let mut all_local = true;
        for s in &args.sources {
            sources.push(match s {
                SourceArg::Path(p) => {
                    let p = ex(p)?;
                    let lower = p.to_ascii_lowercase();
                    // Git sources as BuildKit tells them; transports and schemes ADD never
                    // fetches from are refused here (crate::git).
                    let is_git = crate::git::GitRef::parse(&p)
                        .map_err(|e| invalid(offset, e.to_string()))?
                        .is_some();
                    let is_url =
                        !is_git && (lower.starts_with("http://") || lower.starts_with("https://"));
                    if is_url && !url_has_host(&p) {
                        return Err(invalid(offset, format!("URL '{p}' has no host")));
                    }
                    if (is_url || is_git) && !is_add {
                        return Err(invalid(
                            offset,
                            format!("COPY cannot fetch '{p}': use ADD for URLs"),
                        ));
                    }
                    if (is_url || is_git) && from.is_some() {
                        return Err(invalid(
                            offset,
                            "a URL source cannot be combined with --from",
                        ));
                    }
                    if is_git {
                        all_local = false;
                        CopySource::Git { url: p }
                    } else if is_url {
                        all_local = false;
                        CopySource::Url { url: p }
                    } else {
                        CopySource::Path { path: p }
                    }
                }
                SourceArg::Heredoc { name, data, expand } => {
                    let data = if *expand {
                        let mut lookup = |n: &str| scope.get(n);
                        expand_heredoc(data, self.escape, &mut lookup)
                            .map_err(|e| words_fault(offset, e))?
                    } else {
                        data.clone()
                    };
                    CopySource::Inline(InlineFile {
                        name: name.clone(),
                        data,
                        path: None,
                        mode: 0o644,
                    })
                }
            });
        }
        let raw_dest = ex(&args.dest)?;
        let mut dest = resolve_path(&draft.state.workdir, &raw_dest);
        if (raw_dest == "." || raw_dest.is_empty() || raw_dest.ends_with('/'))
            && !dest.ends_with('/')
        {
            dest.push('/');
        }
        let chown = args.chown.as_deref().map(ex).transpose()?;
        let chmod = args.chmod.as_deref().map(ex).transpose()?;
        if let Some(m) = &chmod
            && !valid_chmod(m)
        {
            return Err(invalid(
                offset,
                format!("invalid --chmod '{m}': expected octal (0755) or symbolic (u+x,g-w)"),
            ));
        }
        let checksum = args.checksum.as_deref().map(ex).transpose()?;
        if let Some(c) = &checksum {
            let ok = c.split_once(':').is_some_and(|(alg, hex)| {
                let len = match alg {
                    "sha256" => 64,
                    "sha384" => 96,
                    "sha512" => 128,
                    _ => 0,
                };
                len > 0 && hex.len() == len && hex.chars().all(|c| c.is_ascii_hexdigit())
            });
            if !ok {
                return Err(invalid(
                    offset,
                    format!("invalid --checksum '{c}': expected sha256:<hex>"),
                ));
            }
            if all_local {
                return Err(invalid(
                    offset,
                    "--checksum is only supported with URL sources",
                ));
            }
        }
        let exclude = args
            .exclude
            .iter()
            .map(|e| ex(e))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CopyStep {
            sources,
            dest,
            from,
            chown,
            chmod,
            link: args.link,
            parents: args.parents,
            exclude,
            checksum,
            unpack: is_add && args.unpack.unwrap_or(all_local),
            keep_git_dir: args.keep_git_dir,
        })
    }
}

fn words_fault(offset: usize, e: ShellWordsError) -> Fault {
    Fault::new(offset, e)
}

/// `80`, `80/udp`, `8000-8002/tcp` into `port/proto` strings.
fn expand_ports(p: &str) -> Result<Vec<String>, String> {
    let (ports, proto) = match p.split_once('/') {
        Some((ports, proto)) => (ports, proto.to_ascii_lowercase()),
        None => (p, "tcp".to_string()),
    };
    if !["tcp", "udp", "sctp"].contains(&proto.as_str()) {
        return Err(format!("invalid protocol in EXPOSE '{p}'"));
    }
    let parse = |s: &str| {
        s.parse::<u16>()
            .map_err(|_| format!("invalid port in EXPOSE '{p}'"))
    };
    let (lo, hi) = match ports.split_once('-') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => {
            let n = parse(ports)?;
            (n, n)
        }
    };
    if hi < lo {
        return Err(format!("invalid port range in EXPOSE '{p}'"));
    }
    if u32::from(hi - lo) >= MAX_EXPOSED_RANGE {
        // Docker expands any range; kiln bounds the plan a hostile recipe can produce.
        return Err(format!(
            "EXPOSE '{p}' names {} ports; kiln accepts ranges of at most {MAX_EXPOSED_RANGE}",
            u32::from(hi - lo) + 1
        ));
    }
    Ok((lo..=hi).map(|n| format!("{n}/{proto}")).collect())
}

/// Whether an `http://` or `https://` URL names a host (`https://` alone, or
/// `https:///path`, cannot be fetched).
fn url_has_host(url: &str) -> bool {
    let rest = url.split_once("://").map_or("", |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = authority.rsplit('@').next().unwrap_or_default();
    !host.is_empty() && !host.starts_with(':')
}

/// Parses an ONBUILD trigger's text into an instruction.
fn parse_trigger(trigger: &str, escape: char) -> Result<Instr, String> {
    let prefix = if escape == '`' {
        "# escape=`\nFROM scratch\n"
    } else {
        "FROM scratch\n"
    };
    let text = format!("{prefix}{trigger}\n");
    let (masked, docs) = syntax::mask_run_heredocs(&text).map_err(|f| f.kind.to_string())?;
    let parsed = syntax::parse(&text, &masked, docs).map_err(|f| f.kind.to_string())?;
    let instrs =
        super::instructions::convert_all(&parsed, &text).map_err(|f| f.kind.to_string())?;
    if instrs.len() > 2 {
        return Err("a trigger is exactly one instruction".to_string());
    }
    let instr = instrs
        .into_iter()
        .nth(1)
        .ok_or_else(|| "empty trigger".to_string())?;
    // Docker refuses these as triggers; a base image's config may still hold them.
    let refused = match &instr.kind {
        InstrKind::From { .. } => Some("FROM"),
        InstrKind::Maintainer(_) => Some("MAINTAINER"),
        InstrKind::Onbuild { .. } => Some("ONBUILD"),
        _ => None,
    };
    match refused {
        Some(k) => Err(format!("{k} is not allowed as an ONBUILD trigger")),
        None => Ok(instr),
    }
}

#[cfg(test)]
mod tests {
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
        let p = plan(
            "FROM scratch\nENV E=$V\nARG V=1\nENV F=$V\nENV V=env\nARG V=2\nENV G=$V\nRUN true\n",
        );
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
        let p = plan(
            "FROM scratch\nRUN --security=insecure true\nRUN true\nRUN --security=sandbox true\n",
        );
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
        let text =
            "FROM scratch AS a\nCOPY --from=b /x /x\nFROM scratch AS b\nCOPY --from=a /y /y\n";
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
        let e =
            load_dockerfile("Dockerfile", b"FROM x\nRUN \xff\n", &Options::default()).unwrap_err();
        assert_eq!(e.line, 2);
    }
}

#[cfg(test)]
mod env_tests {
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
        let text =
            "FROM alpine AS final\nCOPY --from=later /x /x\nFROM alpine AS later\nRUN true\n";
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
        let text = "FROM scratch\nCOPY <<A <<B /d/\na\nA\nb\nB\nRUN <<R\nr\nR\nCOPY <<'Q' /q\nq\nQ\nENV X=1\n";
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
}
