//! Running a stage's steps: scratch directories, the executor's run of a `RUN`, `COPY` and
//! `ADD` applied by the builder, and committing a step's upper directory as a layer.

use super::*;

/// A step's fresh upper and work directories, removed on drop unless taken.
pub(super) struct Scratch {
    pub(super) upper: Option<PathBuf>,
    pub(super) work: PathBuf,
    pub(super) mnt: PathBuf,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(u) = &self.upper {
            let _ = fs::remove_dir_all(u);
        }
        let _ = fs::remove_dir_all(&self.work);
        let _ = fs::remove_dir_all(self.work.with_extension("empty"));
        let _ = fs::remove_dir(&self.mnt);
    }
}

pub(super) fn scratch(ctx: &Ctx) -> Result<Scratch, BuildError> {
    let s = Scratch {
        upper: Some(ctx.dirs.temp("upper")),
        work: ctx.dirs.temp("work"),
        mnt: ctx.dirs.temp("mnt"),
    };
    for d in [s.upper.as_deref().unwrap_or(&s.work), &s.work, &s.mnt] {
        fs::create_dir(d).map_err(io_err("creating", d))?;
    }
    Ok(s)
}

/// Writes the upper directory as a layer into the store and adopts it as that layer's
/// lower directory.
pub(super) async fn commit_upper(ctx: &Arc<Ctx>, mut s: Scratch) -> Result<LayerRef, BuildError> {
    let upper = s
        .upper
        .take()
        .ok_or_else(|| BuildError::Task("upper directory taken twice".into()))?;
    let c = ctx.clone();
    let r = tokio::task::spawn_blocking(move || -> Result<LayerRef, BuildError> {
        let staged = c
            .cache
            .scratch_path(&format!("layer-{}", c.step_counter.load(Ordering::Relaxed)));
        let staged = staged.with_file_name(format!(
            "{}-{}",
            staged
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            upper
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        if let Some(p) = staged.parent() {
            fs::create_dir_all(p).map_err(io_err("creating", p))?;
        }
        let f = fs::File::create(&staged).map_err(io_err("creating", &staged))?;
        let w = crate::layer::write::write_upper_layer(&upper, std::io::BufWriter::new(f), c.epoch);
        let w = match w {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&staged);
                // Out of space is about the file being written (its free space measured
                // without the partial layer, beside the step's files), not the directory read.
                let e = if kiln_store::space::is_no_space(&e) {
                    kiln_store::space::NoSpace::at("writing the layer", &staged, None).into()
                } else {
                    io_err("writing a layer from", &upper)(e)
                };
                let _ = fs::remove_dir_all(&upper);
                return Err(e);
            }
        };
        c.cache.commit(&staged, &w.digest)?;
        remember_diff_id(&c.opts.work_dir, &w.digest, &w.diff_id);
        crate::layer::write::settle_times(&upper, c.epoch)
            .map_err(io_err("setting the times of", &upper))?;
        c.dirs.adopt(&upper, &w.digest)?;
        Ok(LayerRef {
            desc: Descriptor {
                media_type: w.media_type.into(),
                digest: w.digest,
                size: w.size,
                platform: None,
                annotations: None,
            },
            diff_id: w.diff_id,
        })
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?;
    drop(s);
    r
}

pub(super) fn check_cancel(ctx: &Ctx, loc: &str) -> Result<(), BuildError> {
    if ctx.opts.cancel.load(Ordering::Relaxed) || ctx.cancel.load(Ordering::Relaxed) {
        return Err(BuildError::Cancelled);
    }
    if Instant::now() >= ctx.deadline {
        return Err(BuildError::Timeout {
            location: loc.to_string(),
            after: ctx.timeout,
            stopped: None,
        });
    }
    Ok(())
}

pub(super) async fn run_stage(
    ctx: Arc<Ctx>,
    i: usize,
    inputs: BTreeMap<usize, StageOut>,
) -> Result<StageOut, BuildError> {
    let mut st = stage_base(&ctx, i, &inputs)?;
    hold(&ctx, st.layers.iter().map(|l| l.desc.digest)).await?;
    config::default_path(st.config.config.env.get_or_insert_with(Vec::new));
    let base_run = st.config.config.clone();
    let use_cache = stage_uses_cache(&ctx, i);
    let stage = ctx.plan.stages[i].clone();
    for (position, step) in stage.steps.iter().enumerate() {
        let loc = location(step);
        check_cancel(&ctx, &loc)?;
        let index = ctx.step_counter.fetch_add(1, Ordering::Relaxed);
        let env = config::merge_env(base_run.env.as_deref().unwrap_or(&[]), &step.context.env);
        let user = step.context.user.clone().or_else(|| base_run.user.clone());
        let canonical = step.canonical_json();
        let prepared = prepare_inputs(&ctx, step, &inputs, &stage.platform, &loc).await?;
        let sources = prepared.digest.clone();
        // `COPY --link`: the layer's key has no parent, and no environment or user (a copy
        // reads neither), so a change below it leaves it a hit; the stage's key still
        // chains through it (below).
        let link = matches!(&step.action, Action::Copy(c) | Action::Add(c) if c.link);
        let parent = if link {
            ctx.scoped_key(key::root_key("link", "", &stage.platform))
        } else {
            st.key.clone()
        };
        let key = key::StepKey {
            parent: &parent,
            step: &canonical,
            env: if link { &[] } else { &env },
            user: if link { None } else { user.as_deref() },
            workdir: &step.context.workdir,
            sources: sources.as_deref(),
        }
        .key();
        let instruction = short(&describe(step));
        let hit = if use_cache {
            lookup(&ctx, &key).await?
        } else {
            None
        };
        // A miss only: what the key was made from, and why the nearest earlier build's
        // entry is not this one (one read).
        let missed = match hit {
            Some(_) => None,
            None => {
                let inputs = step_inputs(
                    &ctx,
                    i,
                    &parent,
                    &key,
                    step,
                    &env,
                    user.as_deref(),
                    &prepared,
                );
                let id = index_of(&ctx, i, position, &inputs.instruction);
                let why = why_missed(&ctx, use_cache, &id, &inputs).await;
                Some((inputs, id, why))
            }
        };
        (ctx.events)(BuildEvent::Step {
            index,
            stage: i,
            location: loc.clone(),
            instruction: instruction.clone(),
            cached: hit.is_some(),
            why: missed.as_ref().map(|m| m.2.clone()).unwrap_or_default(),
            runs_command: matches!(step.action, Action::Run(_)),
        });
        let layer = match hit {
            Some(l) => {
                ctx.cached.fetch_add(1, Ordering::Relaxed);
                l
            }
            None => {
                let l =
                    run_step(&ctx, step, index, &st, &env, user.clone(), &loc, prepared).await?;
                ctx.run.fetch_add(1, Ordering::Relaxed);
                share_entry(&ctx, &key, &l.desc.digest).await?;
                if let Some((inputs, id, _)) = &missed {
                    record_inputs(&ctx, &key, id, inputs).await;
                }
                (ctx.events)(BuildEvent::Layer {
                    index,
                    digest: l.desc.digest,
                    size: l.desc.size,
                });
                l
            }
        };
        hold(&ctx, [layer.desc.digest]).await?;
        st.config.rootfs.diff_ids.push(layer.diff_id.to_string());
        st.config.history.push(History {
            created: ctx.epoch.map(config::rfc3339),
            created_by: Some(describe(step)),
            comment: None,
            empty_layer: false,
        });
        st.layers.push(layer);
        st.key = if link {
            key::chained(&st.key, &key)
        } else {
            key
        };
    }
    st.config.config = config::merge_run_config(&base_run, &stage.config);
    st.config.created = ctx.epoch.map(config::rfc3339);
    Ok(st)
}

/// The image's own CA bundle as a step over `lowers` (topmost first) sees it: the first of
/// [`ca::SYSTEM_BUNDLES`] that is a regular file in the merged view, read inside it
/// (symlinks resolved within the root), or `None` when there is none, none that resolves (a
/// symlink loop), or it is larger than [`ca::MAX_SYSTEM_BUNDLE_BYTES`] (the step's bundle then
/// holds the extra certificates alone, and says nothing more: the step fails its TLS checks
/// as the image alone would).
pub(super) async fn image_ca_bundle(
    ctx: &Arc<Ctx>,
    lowers: Vec<PathBuf>,
) -> Result<Option<Vec<u8>>, ExecError> {
    if lowers.is_empty() {
        return Ok(None);
    }
    let s = scratch(ctx).map_err(|e| ExecError::Setup(e.to_string()))?;
    let (upper, work, mnt) = (
        s.upper.clone().unwrap_or_default(),
        s.work.clone(),
        s.mnt.clone(),
    );
    let r = tokio::task::spawn_blocking(move || {
        merged::with_merged(lowers, upper, work, mnt, |root| {
            use crate::rootfs::{Root, read_bounded};
            let root = Root::open(root).map_err(|e| e.to_string())?;
            for p in ca::SYSTEM_BUNDLES {
                match read_bounded(&root, p, ca::MAX_SYSTEM_BUNDLE_BYTES + 1) {
                    Ok(None) => continue,
                    Ok(Some(b)) if b.len() as u64 > ca::MAX_SYSTEM_BUNDLE_BYTES => {
                        return Ok(None);
                    }
                    Ok(Some(b)) => return Ok(Some(b)),
                    // A symlink loop, a path through a file: the image has no usable bundle
                    // there, and its own tools fail on it as they would without kiln.
                    Err(_) => continue,
                }
            }
            Ok(None)
        })
    })
    .await
    .map_err(|e| ExecError::Setup(format!("reading the image's CA bundle: {e}")))?;
    drop(s);
    r.map_err(|e| ExecError::Setup(format!("reading the image's CA bundle: {e}")))
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn run_step(
    ctx: &Arc<Ctx>,
    step: &Step,
    index: usize,
    st: &StageOut,
    env: &[String],
    user: Option<String>,
    loc: &str,
    prepared: Prepared,
) -> Result<LayerRef, BuildError> {
    let s = scratch(ctx)?;
    let upper = s.upper.clone().unwrap_or_default();
    match &step.action {
        Action::Run(_) => {
            let remaining = ctx.deadline.saturating_duration_since(Instant::now());
            let mounts = prepared.mounts.clone().unwrap_or_default();
            let mut spec = StepSpec::from_plan_with_mounts(
                index,
                step,
                Vec::new(),
                upper.clone(),
                s.work.clone(),
                remaining,
                &mounts,
            )
            .map_err(|e| BuildError::Step {
                location: loc.to_string(),
                instruction: short(&describe(step)),
                error: e,
            })?;
            // The package download directories (issue 34,
            // [`crate::exec::mounts::packages`]): the host's cache for a trusted build, the
            // package layer above the step's layers for every build.
            let own = spec.mounts.clone();
            if let Some(dir) = &ctx.opts.package_cache {
                spec.mounts
                    .extend(crate::exec::mounts::packages::package_mounts(dir, &own));
            }
            let max = ctx.executor.max_lowers(&spec);
            let lowers = step_lowers(ctx, &st.layers, max, 1).await?;
            let layers = ctx.opts.work_dir.join(crate::workdir::PACKAGE_LAYERS);
            let (dir, l) = (layers.clone(), lowers.clone());
            let package_layer = tokio::task::spawn_blocking(move || {
                crate::exec::mounts::packages::package_layer(&dir, &l, &own)
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?
            .map_err(io_err("making the package layer in", &layers))?;
            spec.lower_dirs = package_layer.into_iter().chain(lowers.clone()).collect();
            // The plan's env merged over the base's, then what the spec adds after it (the
            // proxy build args, secret env).
            let added: Vec<String> = spec
                .env
                .split_off(step.context.env.len().min(spec.env.len()));
            spec.env = env.to_vec();
            spec.env.extend(added);
            spec.user = user;
            if let Some(ca) = &ctx.opts.fetch.ca_certs {
                let step_err = |error| BuildError::Step {
                    location: loc.to_string(),
                    instruction: short(&describe(step)),
                    error,
                };
                if spec
                    .files
                    .iter()
                    .any(|f| f.path.as_deref() == Some(ca::BUNDLE_PATH))
                {
                    return Err(step_err(ExecError::Setup(format!(
                        "a heredoc named {} would replace the extra CA certificates' bundle",
                        ca::BUNDLE_PATH
                    ))));
                }
                let system = image_ca_bundle(ctx, spec.lower_dirs.clone())
                    .await
                    .map_err(step_err)?;
                spec.files.push(ca.bundle_file(system.as_deref()));
                spec.env.extend(ca::bundle_env());
            }
            spec.layer_limits = ctx.layer_limits();
            let used = ctx.log_bytes.load(Ordering::Relaxed);
            spec.log_budget = Some(ctx.opts.exec.log_limits.total_max.saturating_sub(used));
            let c = ctx.clone();
            let r = tokio::task::spawn_blocking(move || {
                let events = c.events.clone();
                c.executor
                    .run(&spec, &c.cancel, &mut |l| events(BuildEvent::Log(l)))
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
            match r {
                Ok(report) => {
                    ctx.log_bytes.fetch_add(report.log_bytes, Ordering::Relaxed);
                    // Whoever builds, and whether a package cache was mounted or not.
                    let up = upper.clone();
                    tokio::task::spawn_blocking(move || {
                        crate::exec::mounts::packages::drop_package_dirs(&up, &lowers)
                    })
                    .await
                    .map_err(|e| BuildError::Task(e.to_string()))?
                    .map_err(|e| BuildError::Step {
                        location: loc.to_string(),
                        instruction: short(&describe(step)),
                        error: ExecError::Io {
                            what: "dropping the package download directories from the layer".into(),
                            source: e,
                        },
                    })?;
                }
                Err(ExecError::Cancelled) => return Err(BuildError::Cancelled),
                Err(ExecError::Timeout { stopped, .. }) if Instant::now() >= ctx.deadline => {
                    return Err(BuildError::Timeout {
                        location: loc.to_string(),
                        after: ctx.timeout,
                        stopped: Some(format!("{}: {stopped}", short(&describe(step)))),
                    });
                }
                Err(e) => {
                    return Err(BuildError::Step {
                        location: loc.to_string(),
                        instruction: short(&describe(step)),
                        error: e,
                    });
                }
            }
        }
        Action::Mkdir(m) => {
            let lowers = step_lowers(ctx, &st.layers, OVERLAY_MAX_LOWERS, 0).await?;
            let (path, mode) = (m.path.clone(), m.mode);
            let user = user.clone();
            let r = tokio::task::spawn_blocking({
                let (upper, work, mnt) = (upper.clone(), s.work.clone(), s.mnt.clone());
                move || {
                    merged::with_merged(lowers, upper, work, mnt, move |root| {
                        let (uid, gid) = match &user {
                            None => (0, 0),
                            Some(u) => {
                                let passwd =
                                    fs::read_to_string(root.join("etc/passwd")).unwrap_or_default();
                                let group =
                                    fs::read_to_string(root.join("etc/group")).unwrap_or_default();
                                let eu = crate::user::resolve_user(Some(u), &passwd, &group)
                                    .map_err(|e| e.to_string())?;
                                (eu.uid, eu.gid)
                            }
                        };
                        merged::mkdir_in_root(root, &path, mode, uid, gid)
                            .map(|_| ())
                            .map_err(|e| format!("creating {path}: {e}"))
                    })
                }
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
            r.map_err(|source| BuildError::Merged {
                location: loc.to_string(),
                source,
            })?;
        }
        Action::Copy(c) | Action::Add(c) if c.link => {
            // `--link`: onto an empty root, the step's upper directory itself, so the layer
            // holds the copied files and their parent directories and nothing of the layers
            // below (BuildKit's independent layer). `--chown` is numeric or root
            // ([`check_supported`]), so no user database is read.
            let sources = prepared.sources.clone().ok_or_else(|| BuildError::Copy {
                location: loc.to_string(),
                message: "sources were not prepared".into(),
            })?;
            let mut c = c.clone();
            c.chown = c.chown.as_deref().map(numeric_chown);
            let opts = CopyOptions {
                tar_limits: ctx.layer_limits(),
                ..CopyOptions::default()
            };
            let root = upper.clone();
            tokio::task::spawn_blocking(move || crate::copy::copy_into(&c, &sources, &root, &opts))
                .await
                .map_err(|e| BuildError::Task(e.to_string()))?
                .map_err(copy_err(loc))?;
        }
        Action::Copy(c) | Action::Add(c) => {
            let lowers = step_lowers(ctx, &st.layers, OVERLAY_MAX_LOWERS, 0).await?;
            let sources = prepared.sources.clone().ok_or_else(|| BuildError::Copy {
                location: loc.to_string(),
                message: "sources were not prepared".into(),
            })?;
            let c = c.clone();
            let limits = ctx.layer_limits();
            let r = tokio::task::spawn_blocking({
                let (upper, work, mnt) = (upper.clone(), s.work.clone(), s.mnt.clone());
                move || {
                    merged::with_merged(lowers, upper, work, mnt, move |root| {
                        let opts = CopyOptions {
                            tar_limits: limits,
                            ..CopyOptions::default()
                        };
                        crate::copy::copy_into(&c, &sources, root, &opts)
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    })
                }
            })
            .await
            .map_err(|e| BuildError::Task(e.to_string()))?;
            r.map_err(|source| BuildError::Merged {
                location: loc.to_string(),
                source,
            })?;
        }
    }
    drop(prepared);
    commit_upper(ctx, s).await
}
