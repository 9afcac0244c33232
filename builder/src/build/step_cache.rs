//! A step's place in the build cache: the lower layers it runs on, its inputs and key,
//! the lookup of an earlier run, why it missed, and sharing its entry.

use super::*;

/// Lower directories for `layers` (bottom first) when a mount takes at most `fit` of them:
/// topmost first, unpacking what is missing. A layer digest that occurs more than once
/// (`RUN true` twice, a `WORKDIR` that changes nothing) is one directory, which overlayfs
/// refuses to take twice ("conflicting lowerdir path", ELOOP), so only its topmost
/// occurrence is kept ([`topmost_unique`]). Past `fit`, the lowest ones are one squashed
/// tree, hard links into their directories, instead ([`lower::squash_plan`],
/// [`LayerDirs::squashed`]):
/// overlayfs' 500 lowers on the host, the microVM's disks
/// ([`crate::exec::StepExecutor::max_lowers`]), less `reserve` the step's mount takes
/// besides ([`lower::squash_plan_reserving`]: a `RUN` step's package layer). With no room
/// every layer is given as it is, for the executor to refuse.
pub(super) async fn step_lowers(
    ctx: &Arc<Ctx>,
    layers: &[LayerRef],
    fit: usize,
    reserve: usize,
) -> Result<Vec<PathBuf>, BuildError> {
    let c = ctx.clone();
    let digests: Vec<BlobDigest> = layers.iter().map(|l| l.desc.digest).collect();
    tokio::task::spawn_blocking(move || {
        let unique = topmost_unique(&digests);
        let squash = lower::squash_plan_reserving(unique.len(), fit, reserve).unwrap_or(0);
        let keep = unique.len() - squash;
        let mut dirs = Vec::with_capacity(keep + 1);
        for d in &unique[..keep] {
            dirs.push(c.dirs.ensure(c.cache.as_ref(), d, &c.layer_limits())?);
        }
        if squash > 0 {
            let t0 = Instant::now();
            let bottom_first: Vec<BlobDigest> = unique[keep..].iter().rev().map(|d| **d).collect();
            dirs.push(
                c.dirs
                    .squashed(c.cache.as_ref(), &bottom_first, &c.layer_limits())?,
            );
            tracing::debug!(layers = squash, fit, took = ?t0.elapsed(), "squashed the lowest layers");
        }
        Ok::<_, BuildError>(dirs)
    })
    .await
    .map_err(|e| BuildError::Task(e.to_string()))?
}

/// `digests` (bottom first) as overlay lowers: topmost first, each digest once, at its
/// topmost position. Dropping the lower copies changes nothing: the upper copy holds the
/// same entries, so it already shadows every path the lower copy has, and its whiteouts and
/// opaque directories hide everything below it, the lower copy's range included.
pub(super) fn topmost_unique<D: Eq + std::hash::Hash>(digests: &[D]) -> Vec<&D> {
    let mut seen = std::collections::HashSet::new();
    digests.iter().rev().filter(|d| seen.insert(*d)).collect()
}

/// Writes build-cache entry `key` → `layer` in the store, after the layer blob itself
/// ([`crate::cache::share_blob`]): an entry never names a blob the store lacks, so any host
/// sharing the store gets the hit.
pub(super) async fn share_entry(
    ctx: &Ctx,
    key: &str,
    layer: &BlobDigest,
) -> Result<(), BuildError> {
    crate::cache::share_blob(ctx.cache.as_ref(), &ctx.store, layer, Some(&ctx.lease)).await?;
    ctx.store.put_cache_entry(key, *layer).await?;
    Ok(())
}

/// What step `step` of stage `stage` (key `key`, parent `parent`) was made from.
#[allow(clippy::too_many_arguments)]
pub(super) fn step_inputs(
    ctx: &Ctx,
    stage: usize,
    parent: &str,
    key: &str,
    step: &Step,
    env: &[String],
    user: Option<&str>,
    prepared: &Prepared,
) -> why::StepInputs {
    let base = match &ctx.bases[stage] {
        ResolvedBase::Scratch => "scratch".to_string(),
        ResolvedBase::Stage(s) => format!("stage {s}"),
        ResolvedBase::Image { digest, .. } => digest.to_string(),
    };
    let (args, env) = why::split_env(env, &ctx.plan.build_args.given);
    let mut action = step.action.clone();
    let (mut mounts, mut network) = (Vec::new(), String::new());
    if let Action::Run(r) = &mut action {
        // Plan types always serialize.
        mounts = r
            .mounts
            .drain(..)
            .map(|m| why::text_digest(&serde_json::to_string(&m).unwrap_or_default()))
            .collect();
        network = why::text_digest(&serde_json::to_string(&r.network).unwrap_or_default());
        r.network = Default::default();
    }
    let action = serde_json::to_string(&(&action, &step.context.shell)).unwrap_or_default();
    why::StepInputs {
        v: why::INPUTS_VERSION,
        key: key.to_string(),
        base,
        parent: parent.to_string(),
        instruction: why::text_digest(&describe(step)),
        action: crate::cache::digest_of(action.as_bytes()).to_string(),
        args,
        env,
        user: user.map(why::text_digest),
        workdir: why::text_digest(&step.context.workdir),
        network,
        mounts,
        sources: prepared.digest.clone(),
        files: prepared.files.clone(),
    }
}

/// The `cache-index/<id>` of a step, within the build's scope ([`why::index_id`]).
pub(super) fn index_of(ctx: &Ctx, stage: usize, position: usize, instruction: &str) -> String {
    let workspace = match &ctx.opts.resolve.scope {
        crate::base::Scope::Operator => None,
        crate::base::Scope::Tenant(t) => Some(t.workspace.as_str()),
    };
    why::index_id(
        workspace,
        ctx.opts.history.as_deref(),
        stage,
        position,
        instruction,
    )
}

/// Why a step missed: `--no-cache` or its filter (`use_cache` false), else against the
/// record at `cache-index/<id>` (one read). A record that cannot be read counts as none.
pub(super) async fn why_missed(
    ctx: &Ctx,
    use_cache: bool,
    id: &str,
    now: &why::StepInputs,
) -> Vec<why::MissReason> {
    if ctx.opts.no_cache {
        return vec![why::MissReason::NoCache];
    }
    if !use_cache {
        return vec![why::MissReason::NoCacheFilter];
    }
    let before = match ctx.store.get_cache_index(id).await {
        Ok(b) => b.and_then(|b| serde_json::from_slice::<why::StepInputs>(&b).ok()),
        Err(e) => {
            tracing::warn!(error = %e, "not reading the earlier build's step inputs");
            None
        }
    };
    let before = before.filter(|b| b.v == why::INPUTS_VERSION);
    why::reasons(before.as_ref(), now)
}

/// Writes the inputs record of entry `key` and its index copy `id`. A failure is logged:
/// the record only explains, the build does not depend on it.
pub(super) async fn record_inputs(ctx: &Ctx, key: &str, id: &str, inputs: &why::StepInputs) {
    // Plain structs of strings and maps always serialize.
    let bytes = serde_json::to_vec(inputs).unwrap_or_default();
    if let Err(e) = ctx.store.put_cache_inputs(key, Some(id), bytes).await {
        tracing::warn!(key, error = %e, "not recording the step's cache inputs");
    }
}

/// Looks `key` up; a hit whose layer blob is present gives the layer.
pub(super) async fn lookup(ctx: &Ctx, key: &str) -> Result<Option<LayerRef>, BuildError> {
    let Some(entry) = ctx.store.get_cache_entry(key).await? else {
        return Ok(None);
    };
    let digest = entry.layer;
    // An entry another host wrote names a layer only the store has (an S3 store).
    let Some(path) = crate::cache::fetch_blob(ctx.cache.as_ref(), &ctx.store, &digest).await?
    else {
        return Ok(None);
    };
    let size = fs::metadata(&path).map_err(io_err("reading", &path))?.len();
    // The layer's media type from its first bytes: an entry written before layers were zstd
    // (issue 34) names a gzip layer, and is used as it is.
    let mut head = [0u8; 6];
    let n = {
        use std::io::Read as _;
        let mut f = fs::File::open(&path).map_err(io_err("reading", &path))?;
        f.read(&mut head).map_err(io_err("reading", &path))?
    };
    let Some(media_type) = crate::layer::Compression::sniff(&head[..n]).oci_layer_media_type()
    else {
        return Ok(None);
    };
    let diff_path = ctx.opts.work_dir.join("diffids").join(entry.layer.hex());
    // A record that does not read as a digest is made again from the blob.
    let recorded = fs::read_to_string(&diff_path)
        .ok()
        .and_then(|s| Sha256Hash::parse_prefixed(s.trim()).ok());
    let diff_id = match recorded {
        Some(d) => d,
        None => {
            let p = path.clone();
            let d = tokio::task::spawn_blocking(move || lower::diff_id_of(&p))
                .await
                .map_err(|e| BuildError::Task(e.to_string()))?
                .map_err(io_err("reading", &path))?;
            remember_diff_id(&ctx.opts.work_dir, &digest, &d);
            d
        }
    };
    Ok(Some(LayerRef {
        desc: Descriptor {
            media_type: media_type.into(),
            digest,
            size,
            platform: None,
            annotations: None,
        },
        diff_id,
    }))
}

pub(super) fn remember_diff_id(work: &Path, digest: &BlobDigest, diff_id: &Sha256Hash) {
    let hex = digest.hex();
    let dir = work.join("diffids");
    let _ = fs::create_dir_all(&dir);
    let tmp = dir.join(format!(".{hex}.{}", std::process::id()));
    if fs::write(&tmp, diff_id.to_string()).is_ok() {
        let _ = fs::rename(&tmp, dir.join(hex));
    }
}
