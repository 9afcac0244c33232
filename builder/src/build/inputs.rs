//! What a step reads besides its lowers: stage trees, source roots of `COPY --from` and
//! `RUN --mount from=`, images as trees, and the digests of its sources.

use super::*;

/// A directory removed when dropped.
pub(super) struct TempDir(pub(super) PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// What a step needs besides its parent: copy sources, mount inputs, and the digest of
/// what it reads for its cache key.
#[derive(Default)]
pub(super) struct Prepared {
    /// `COPY`/`ADD`: the sources (with `ADD`'s downloads).
    pub(super) sources: Option<Sources>,
    /// `RUN --mount`: what the mounts resolve against.
    pub(super) mounts: Option<MountInputs>,
    /// Digest of the sources or bound inputs, for the cache key.
    pub(super) digest: Option<String>,
    /// The build-context entries read (for [`why::StepInputs::files`]).
    pub(super) files: crate::copy::ContextFiles,
    /// Scratch removed after the step.
    pub(super) _temps: Vec<TempDir>,
}

/// The merged tree of a finished stage as a plain directory: its layers' directories merged
/// into one of hard links ([`LayerDirs::squashed`], each layer once at its topmost place as
/// for lowers), made once per list of layers and collected with the layer directories.
pub(super) async fn stage_tree(ctx: &Arc<Ctx>, st: &StageOut) -> Result<PathBuf, BuildError> {
    let c = ctx.clone();
    let digests: Vec<BlobDigest> = st.layers.iter().map(|l| l.desc.digest).collect();
    tokio::task::spawn_blocking(move || {
        let bottom_first: Vec<BlobDigest> = topmost_unique(&digests)
            .into_iter()
            .rev()
            .cloned()
            .collect();
        let t0 = Instant::now();
        let tree = c
            .dirs
            .squashed(c.cache.as_ref(), &bottom_first, &c.layer_limits())?;
        tracing::debug!(layers = bottom_first.len(), took = ?t0.elapsed(), "a stage's tree");
        Ok(tree)
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?
}

pub(super) fn copy_err(loc: &str) -> impl FnOnce(crate::copy::CopyError) -> BuildError + '_ {
    move |e| BuildError::Copy {
        location: loc.to_string(),
        message: e.to_string(),
    }
}

/// Sources of a copy from `from`, resolved against the stages built so far.
pub(super) async fn source_root(
    ctx: &Arc<Ctx>,
    from: Option<&MountFrom>,
    inputs: &BTreeMap<usize, StageOut>,
    platform: &str,
    loc: &str,
) -> Result<Sources, BuildError> {
    match from {
        None => {
            let (dir, ignore) = ctx.opts.context.clone().ok_or_else(|| BuildError::Copy {
                location: loc.to_string(),
                message: "this build has no build context".into(),
            })?;
            Ok(Sources::context(dir, ignore))
        }
        Some(MountFrom::Stage { stage }) => {
            let so = inputs.get(stage).ok_or_else(|| {
                BuildError::Plan(format!(
                    "{loc}: stage {stage} is not built before this step"
                ))
            })?;
            Ok(Sources::tree(stage_tree(ctx, so).await?))
        }
        Some(MountFrom::Image { reference }) => Ok(Sources::tree(
            image_tree(ctx, reference, platform, loc).await?,
        )),
    }
}

/// The root of image `reference` (resolved as a FROM is, for `platform`) as a plain
/// directory `work/trees/image-<hex>`, unpacked once per manifest digest.
pub(super) async fn image_tree(
    ctx: &Arc<Ctx>,
    reference: &str,
    platform: &str,
    loc: &str,
) -> Result<PathBuf, BuildError> {
    let platform = crate::image::Platform::parse(platform).map_err(|e| BuildError::Copy {
        location: loc.to_string(),
        message: e.to_string(),
    })?;
    let digest = crate::resolve::resolve_reference(
        &ctx.opts.resolve,
        reference,
        platform,
        ctx.cache.as_ref(),
    )
    .await
    .map_err(|e| BuildError::Copy {
        location: loc.to_string(),
        message: format!("--from={reference}: {e}"),
    })?;
    let dir = ctx
        .opts
        .work_dir
        .join("trees")
        .join(format!("image-{}", digest.hex()));
    if dir.is_dir() {
        return Ok(dir);
    }
    let c = ctx.clone();
    let loc = loc.to_string();
    tokio::task::spawn_blocking(move || {
        let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::create_dir_all(&parent).map_err(io_err("creating", &parent))?;
        // Private, as layers/ is (LayerDirs::open): an image's device nodes are in its tree.
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&parent, fs::Permissions::from_mode(0o700))
                .map_err(io_err("making private", &parent))?;
        }
        let tmp = parent.join(c.dirs.temp("image").file_name().unwrap_or_default());
        let guard = TempDir(tmp.clone());
        crate::base::unpack(c.cache.as_ref(), &digest, &tmp, &c.layer_limits()).map_err(|e| {
            BuildError::Copy {
                location: loc.clone(),
                message: e.to_string(),
            }
        })?;
        if let Err(e) = fs::rename(&tmp, &dir)
            && !dir.is_dir()
        {
            return Err(io_err("moving an image tree to", &dir)(e));
        }
        drop(guard);
        Ok(dir)
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?
}

/// Digest of the sources of `c` in `src`, with the context entries read (blocking work on
/// a worker thread).
pub(super) async fn digest_sources(
    c: &CopyStep,
    src: &Sources,
    loc: &str,
) -> Result<(String, crate::copy::ContextFiles), BuildError> {
    let (c2, s2) = (c.clone(), src.clone());
    tokio::task::spawn_blocking(move || crate::copy::sources_digest_with_files(&c2, &s2))
        .await
        .map_err(|e| BuildError::Task(e.to_string()))?
        .map_err(copy_err(loc))
}

pub(super) async fn prepare_inputs(
    ctx: &Arc<Ctx>,
    step: &Step,
    inputs: &BTreeMap<usize, StageOut>,
    platform: &str,
    loc: &str,
) -> Result<Prepared, BuildError> {
    let mut p = Prepared::default();
    match &step.action {
        Action::Copy(c) | Action::Add(c) => {
            let mut src = source_root(ctx, c.from.as_ref(), inputs, platform, loc).await?;
            if c.sources
                .iter()
                .any(|s| matches!(s, CopySource::Url { .. } | CopySource::Git { .. }))
            {
                let dir = ctx.dirs.temp("download");
                fs::create_dir(&dir).map_err(io_err("creating", &dir))?;
                p._temps.push(TempDir(dir.clone()));
                // A build-wide allow-list holds for ADD's downloads too.
                let mut fetch = ctx.opts.fetch.clone();
                if let Some(kiln_recipes::plan::Network::Allow(rules)) = &ctx.opts.network {
                    fetch.rules = Some(rules.clone());
                }
                // A git source over ssh authenticates with the `default` agent (BuildKit's).
                fetch.ssh_agent = ctx.opts.ssh.get("default").cloned();
                let d = crate::copy::fetch::fetch_urls(c, &dir, &fetch)
                    .await
                    .map_err(|e| BuildError::Copy {
                        location: loc.to_string(),
                        message: e.to_string(),
                    })?;
                src = src.with_downloads(d);
            }
            let (digest, files) = digest_sources(c, &src, loc).await?;
            p.digest = Some(digest);
            p.files = files;
            p.sources = Some(src);
        }
        Action::Run(r) if !r.mounts.is_empty() => {
            let mut mi = MountInputs {
                context: ctx.opts.context.clone(),
                cache_dir: Some(
                    ctx.opts
                        .cache_mount_dir
                        .clone()
                        .unwrap_or_else(|| ctx.opts.work_dir.join("cache-mounts")),
                ),
                secrets: ctx.opts.secrets.clone(),
                ssh: ctx.opts.ssh.clone(),
                ..MountInputs::default()
            };
            let scratch = ctx.dirs.temp("mount-scratch");
            fs::create_dir(&scratch).map_err(io_err("creating", &scratch))?;
            p._temps.push(TempDir(scratch.clone()));
            mi.scratch_dir = Some(scratch);
            // What bind mounts read enters the key: a stage by its key, the context by the
            // digest of the bound path's content.
            let mut parts: Vec<String> = Vec::new();
            for m in &r.mounts {
                let (from, source) = match m {
                    Mount::Bind { from, source, .. } => (from.as_ref(), Some(source.clone())),
                    Mount::Cache { from, source, .. } => (from.as_ref(), source.clone()),
                    _ => continue,
                };
                match from {
                    Some(MountFrom::Stage { stage }) => {
                        let so = inputs.get(stage).ok_or_else(|| {
                            BuildError::Plan(format!("{loc}: stage {stage} is not built yet"))
                        })?;
                        mi.stage_roots.insert(*stage, stage_tree(ctx, so).await?);
                        parts.push(format!("stage:{}", so.key));
                    }
                    Some(MountFrom::Image { reference }) => {
                        let tree = image_tree(ctx, reference, platform, loc).await?;
                        parts.push(format!(
                            "image:{}",
                            tree.file_name()
                                .map(|n| n.to_string_lossy().into_owned())
                                .unwrap_or_default()
                        ));
                        mi.image_roots.insert(reference.clone(), tree);
                    }
                    None if matches!(m, Mount::Bind { .. }) => {
                        let src = source_root(ctx, None, inputs, platform, loc).await?;
                        let path = source.unwrap_or_else(|| ".".into());
                        let sel = CopyStep {
                            sources: vec![CopySource::Path { path }],
                            dest: "/".into(),
                            from: None,
                            chown: None,
                            chmod: None,
                            link: false,
                            parents: false,
                            exclude: Vec::new(),
                            checksum: None,
                            unpack: false,
                            keep_git_dir: false,
                        };
                        let (digest, files) = digest_sources(&sel, &src, loc).await?;
                        parts.push(format!("context:{digest}"));
                        p.files.merge(files);
                    }
                    None => {}
                }
            }
            if !parts.is_empty() {
                p.digest = Some(crate::cache::digest_of(parts.join("\n").as_bytes()).to_string());
            }
            p.mounts = Some(mi);
        }
        _ => {}
    }
    Ok(p)
}

/// The plan's JSON with file names cut to their last component.
pub(super) fn plan_json_without_paths(plan: &BuildPlan) -> String {
    pub(super) fn base(f: &mut String) {
        if let Some((_, b)) = f.rsplit_once('/') {
            *f = b.to_string();
        }
    }
    let mut p = plan.clone();
    base(&mut p.file);
    for st in &mut p.stages {
        base(&mut st.location.file);
        for step in &mut st.steps {
            base(&mut step.location.file);
        }
    }
    for w in &mut p.warnings {
        if let Some(l) = &mut w.location {
            base(&mut l.file);
        }
    }
    kiln_recipes::plan_to_json(&p)
}
