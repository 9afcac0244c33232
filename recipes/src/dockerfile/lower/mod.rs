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

#[cfg(test)]
mod env_tests;
mod scope;
mod stages;
mod steps;
#[cfg(test)]
mod tests;
mod values;

use scope::{Scope, proxy_arg, proxy_env_of};
use stages::{Visit, effective_config, remap_stage_refs, sandbox_of, topological, visit};
use values::{
    csv_fields, expand_ports, is_signal_name, parse_duration_exact_ms, parse_trigger, resolve_path,
    url_has_host, words_fault,
};
pub(crate) use values::{parse_duration_ms, parse_platform, parse_size, valid_chmod};

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
}
