//! The build driver ([`build_with`]) against [`RecordingExecutor`], which runs nothing: the
//! order stages run in, cache hits and misses, `--target` pruning and what a failed step
//! leaves. The layers, caches and stores are real (a local store in a temporary directory);
//! only the command is scripted, writing the files a step would have made into its upper
//! directory. The same driver with the real executor is tested in `tests/tests/build_run.rs`.

use std::sync::Mutex;

use super::*;
use crate::cache::LocalCache;
use crate::exec::{RecordingExecutor, StepReport};

/// A local store and blob cache, and the build's work directory, in one temporary directory.
struct Fx {
    tmp: tempfile::TempDir,
    cache: Arc<LocalCache>,
    store: Store,
    rt: tokio::runtime::Runtime,
}

fn fx() -> Fx {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("store");
    let cache = Arc::new(LocalCache::open(&root).expect("cache"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt.block_on(Store::open_dir(&root)).expect("store");
    Fx {
        tmp,
        cache,
        store,
        rt,
    }
}

/// A fake whose every `RUN` writes `/out` (the step's command line) into its upper
/// directory, and fails when its command line contains `fail`.
fn writing_fake() -> Arc<RecordingExecutor> {
    Arc::new(RecordingExecutor::with_script(Box::new(|s: &StepSpec| {
        let cmd = s.argv.join(" ");
        if cmd.contains("fail") {
            return Err(ExecError::Failed {
                exit_code: 7,
                tail: vec![],
            });
        }
        fs::write(s.upper_dir.join("out"), &cmd).map_err(|e| ExecError::Setup(e.to_string()))?;
        Ok(StepReport::default())
    })))
}

impl Fx {
    fn options(&self) -> BuildOptions {
        let mut o = BuildOptions::new(self.tmp.path().join("work"));
        o.exec.run_dir = self.tmp.path().join("run");
        o
    }

    /// Lowers `text` (with `target`, if any) and builds it with `fake`; the events too.
    fn build(
        &self,
        text: &str,
        target: Option<&str>,
        fake: &Arc<RecordingExecutor>,
    ) -> (Result<BuildOutput, BuildError>, Vec<BuildEvent>) {
        let options = kiln_recipes::Options {
            target: target.map(str::to_string),
            ..Default::default()
        };
        let plan = kiln_recipes::load_dockerfile("Dockerfile", text.as_bytes(), &options)
            .expect("the recipe lowers");
        let bases: Vec<ResolvedBase> = plan.stages.iter().map(|_| ResolvedBase::Scratch).collect();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink: EventSink = {
            let e = events.clone();
            Arc::new(move |ev| e.lock().expect("lock").push(ev))
        };
        let r = self.rt.block_on(build_with(
            &plan,
            &bases,
            self.cache.clone(),
            &self.store,
            &self.options(),
            sink,
            fake.clone(),
        ));
        let ev = events.lock().expect("lock").clone();
        (r, ev)
    }
}

/// The command lines the fake ran, in order.
fn ran(fake: &RecordingExecutor) -> Vec<String> {
    fake.specs().iter().map(|s| s.argv.join(" ")).collect()
}

/// `(instruction, cached)` of every step event.
fn steps(events: &[BuildEvent]) -> Vec<(String, bool)> {
    events
        .iter()
        .filter_map(|e| match e {
            BuildEvent::Step {
                instruction,
                cached,
                ..
            } => Some((instruction.clone(), *cached)),
            _ => None,
        })
        .collect()
}

/// Entries left under `dir` (none when it does not exist).
fn entries(dir: &Path) -> Vec<String> {
    match fs::read_dir(dir) {
        Ok(d) => d
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => vec![],
    }
}

const TWO_STAGES: &str = "FROM scratch AS a\nRUN echo a1\nRUN echo a2\n\
                          FROM scratch AS b\nRUN echo b1\n\
                          FROM scratch\nCOPY --from=a /out /from-a\nCOPY --from=b /out /from-b\n\
                          RUN echo final\n";

#[test]
fn a_stage_runs_after_the_stages_it_copies_from_and_its_steps_in_order() {
    let f = fx();
    let fake = writing_fake();
    let (r, _) = f.build(TWO_STAGES, None, &fake);
    r.expect("the build succeeds");
    let ran = ran(&fake);
    let at = |c: &str| {
        ran.iter()
            .position(|r| r.ends_with(c))
            .unwrap_or_else(|| panic!("{c} ran: {ran:?}"))
    };
    assert_eq!(ran.len(), 4, "{ran:?}");
    assert!(at("echo a1") < at("echo a2"), "{ran:?}");
    assert!(at("echo a2") < at("echo final"), "{ran:?}");
    assert!(at("echo b1") < at("echo final"), "{ran:?}");
    // The final step ran on the copies: its lowers hold what a2 and b1 wrote.
    let last = fake.specs().pop().expect("a spec");
    let copied: Vec<String> = last
        .lower_dirs
        .iter()
        .flat_map(|d| {
            ["from-a", "from-b"]
                .into_iter()
                .filter_map(|n| fs::read_to_string(d.join(n)).ok())
        })
        .collect();
    assert!(
        copied.iter().any(|c| c.ends_with("echo a2"))
            && copied.iter().any(|c| c.ends_with("echo b1")),
        "{copied:?}"
    );
}

#[test]
fn a_second_build_runs_nothing_and_a_changed_step_runs_with_those_after_it() {
    let f = fx();
    let fake = writing_fake();
    let (first, _) = f.build(TWO_STAGES, None, &fake);
    let first = first.expect("first build");

    let again = writing_fake();
    let (second, events) = f.build(TWO_STAGES, None, &again);
    let second = second.expect("second build");
    assert!(ran(&again).is_empty(), "{:?}", ran(&again));
    assert!(
        steps(&events).iter().all(|(_, cached)| *cached),
        "{events:?}"
    );
    assert_eq!(
        second.image.oci_manifest.digest, first.image.oci_manifest.digest,
        "a build from the cache makes the same image"
    );

    // b1 changed: b1 runs, and the final stage's steps after the copy from b; a's do not.
    let changed = TWO_STAGES.replace("echo b1", "echo b1 changed");
    let third_fake = writing_fake();
    let (third, events) = f.build(&changed, None, &third_fake);
    third.expect("third build");
    assert_eq!(
        ran(&third_fake)
            .iter()
            .map(|c| c.rsplit(' ').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>(),
        ["changed", "final"],
        "{:?}",
        ran(&third_fake)
    );
    let cached: Vec<(String, bool)> = steps(&events);
    assert!(
        cached.iter().any(|(i, c)| i.contains("echo a1") && *c),
        "{cached:?}"
    );
}

#[test]
fn a_target_builds_only_the_stages_it_needs() {
    let f = fx();
    let fake = writing_fake();
    let (r, events) = f.build(TWO_STAGES, Some("a"), &fake);
    r.expect("the build of stage a succeeds");
    assert_eq!(
        ran(&fake)
            .iter()
            .map(|c| c.rsplit(' ').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>(),
        ["a1", "a2"]
    );
    assert!(
        steps(&events)
            .iter()
            .all(|(i, _)| !i.contains("b1") && !i.contains("final")),
        "{events:?}"
    );
}

#[test]
fn a_failed_step_leaves_no_scratch_and_no_cache_entry_and_runs_again() {
    let f = fx();
    let text = "FROM scratch\nRUN echo before\nRUN echo fail here\nRUN echo after\n";
    let fake = writing_fake();
    let (r, _) = f.build(text, None, &fake);
    match r {
        Err(BuildError::Step { location, .. }) => assert_eq!(location, "Dockerfile:3"),
        other => panic!("expected the step's failure, got {other:?}"),
    }
    assert_eq!(
        ran(&fake)
            .iter()
            .map(|c| c.rsplit(' ').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>(),
        ["before", "here"],
        "the step after the failure did not run"
    );
    // No step scratch (`upper.tmp-*`, `work.tmp-*`, `mnt.tmp-*` beside the layers) is left
    // in the work directory, nor anything in the run directory.
    let work = f.tmp.path().join("work");
    let left: Vec<String> = entries(&work)
        .into_iter()
        .flat_map(|e| {
            let sub = entries(&work.join(&e));
            if sub.is_empty() {
                vec![e]
            } else {
                sub.into_iter().map(|s| format!("{e}/{s}")).collect()
            }
        })
        .filter(|p| p.contains(".tmp-"))
        .collect();
    assert!(
        entries(&work).iter().any(|e| e == "layers"),
        "the layers directory is where scratch would be: {:?}",
        entries(&work)
    );
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(
        entries(&f.tmp.path().join("run")).is_empty(),
        "{:?}",
        entries(&f.tmp.path().join("run"))
    );

    // The step before the failure is in the cache; the failed one is not, so it runs again.
    let again = writing_fake();
    let (r, events) = f.build(text, None, &again);
    assert!(r.is_err());
    assert_eq!(
        ran(&again)
            .iter()
            .map(|c| c.rsplit(' ').next().unwrap_or_default().to_string())
            .collect::<Vec<_>>(),
        ["here"],
        "{events:?}"
    );
}

/// A base image's config whose `rootfs.diff_ids` holds a malformed digest is refused where
/// the build reads it, naming the image and its config, before any step runs.
#[test]
fn a_malformed_diff_id_in_a_base_config_is_refused_naming_the_config() {
    let f = fx();
    let layer = BlobDigest::of(b"not read: the config is refused first");
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:../../x"]}}"#;
    let config_digest = BlobDigest::of(config);
    f.cache.put_bytes(&config_digest, config).expect("config");
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest.to_string(), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer.to_string(), "size": 1}],
    });
    let manifest = serde_json::to_vec(&manifest).expect("json");
    let image = BlobDigest::of(&manifest);
    f.cache.put_bytes(&image, &manifest).expect("manifest");
    let plan = kiln_recipes::load_dockerfile(
        "Dockerfile",
        b"FROM base\nRUN echo never\n",
        &kiln_recipes::Options::default(),
    )
    .expect("the recipe lowers");
    let bases = vec![ResolvedBase::Image {
        reference: "base".into(),
        digest: image,
        onbuild: Vec::new(),
    }];
    let fake = writing_fake();
    let r = f.rt.block_on(build_with(
        &plan,
        &bases,
        f.cache.clone(),
        &f.store,
        &f.options(),
        Arc::new(|_| {}),
        fake.clone(),
    ));
    match r {
        Err(e @ BuildError::Base { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(&image.to_string())
                    && text.contains(&config_digest.to_string())
                    && text.contains("sha256:../../x"),
                "{text}"
            );
        }
        other => panic!("expected BuildError::Base, got {other:?}"),
    }
    assert!(ran(&fake).is_empty());
}
