//! Which stages a target needs and in what order, and what a stage inherits: its
//! effective image config and the sandbox of the final one.

use super::*;

/// The needed stages in dependency order, choosing the lowest source index among the
/// stages whose dependencies are all placed (so a plan without forward references keeps
/// source order).
pub(super) fn topological(needed: &BTreeSet<usize>, drafts: &[Result<Draft, Fault>]) -> Vec<usize> {
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

/// Why [`visit`] stopped.
pub(super) enum Visit {
    /// A dependency problem.
    Fault(Fault),
    /// A needed stage failed to lower: its own error is reported.
    Stage(usize),
}

/// The stages `target` needs (itself included), walking `FROM` stages, `COPY --from` and
/// `RUN --mount from=` without recursion (a hostile chain of thousands of stages must not
/// exhaust the stack); stops on a cycle and on a needed stage that failed to lower.
pub(super) fn visit(
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

pub(super) fn remap(from: &mut MountFrom, renumber: &BTreeMap<usize, usize>) {
    if let MountFrom::Stage { stage } = from {
        *stage = renumber.get(stage).copied().unwrap_or(*stage);
    }
}

pub(super) fn remap_stage_refs(draft: &mut Draft, renumber: &BTreeMap<usize, usize>) {
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
pub(super) fn effective_config(stages: &[Stage], i: usize) -> ImageConfig {
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

pub(super) fn sandbox_of(
    config: &ImageConfig,
    disk_mib: Option<u64>,
    options: &Options,
) -> Sandbox {
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
