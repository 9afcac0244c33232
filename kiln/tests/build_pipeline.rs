//! `kiln build` and a direct [`kiln_pipeline::run`] call are one pipeline: the same
//! Dockerfile and context, built on the busybox fixture into two fresh stores, one through
//! the binary and one through the library, give the same OCI manifest and the same kiln
//! image manifest. Then, in the library's store: a rebuild reuses every ext4 chunk, a
//! compare-and-swap against a wrong digest (or against absence) moves no tag, one against
//! the right digest moves it, and a cancelled request moves nothing. As root, like the
//! other build tests.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use kiln_pipeline::{
    BuildRequest, ContextSource, Event, Output, PipelineError, Recipe, Setup, TagExpect, TagMove,
};
use kiln_store::{TagError, TagRef};
use kiln_tests::require_env;

/// The same bytes for both builds: a RUN (so the step really runs twice), a COPY from the
/// context with a `.dockerignore`d file beside it, and `SOURCE_DATE_EPOCH` (BuildKit's way
/// to pin the timestamps of what steps write).
const EPOCH: &str = "1700000000";

fn request(ctx: &Path, tag: TagMove) -> BuildRequest {
    let file = ctx.join("Dockerfile");
    let mut req = BuildRequest::new(
        Recipe {
            name: file.display().to_string(),
            bytes: std::fs::read(&file).expect("read Dockerfile"),
        },
        ContextSource::dir(ctx, Some(&file)).expect("context"),
    );
    req.build_args
        .insert("SOURCE_DATE_EPOCH".into(), EPOCH.into());
    req.output = Output::Image {
        tags: vec![tag],
        snapshot: None,
    };
    req
}

/// Runs `req` in a fresh setup on `store`, collecting its events.
async fn run(
    store: &Path,
    req: BuildRequest,
) -> (
    Result<kiln_pipeline::BuildReport, PipelineError>,
    Vec<Event>,
) {
    let setup = Setup::open_local(store).await.expect("setup");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let r = kiln_pipeline::run(&setup, req, Arc::new(tx)).await;
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    (r, events)
}

fn stale(r: Result<kiln_pipeline::BuildReport, PipelineError>) -> bool {
    match r {
        Err(PipelineError::Tag { source, .. }) => {
            matches!(*source, kiln_store::StoreError::Tag(TagError::Stale { .. }))
        }
        _ => false,
    }
}

#[test]
fn cli_and_library_build_the_same_image() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = t.path().join("ctx");
    std::fs::create_dir(&ctx).expect("mkdir");
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM {bb}\nCOPY . /app/\nRUN echo hi > /hi && rm /bin/vi\n\
             CMD [\"cat\", \"/hi\"]\n"
        ),
    )
    .expect("write");
    std::fs::write(ctx.join("data.txt"), "data\n").expect("write");
    std::fs::write(ctx.join("secret.key"), "not for the image\n").expect("write");
    std::fs::write(ctx.join(".dockerignore"), "*.key\n").expect("write");

    // Through the binary.
    let cli_store = t.path().join("cli-store");
    let iid = t.path().join("iid");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", &cli_store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "same:1", "--progress", "plain", "--build-arg"])
        .arg(format!("SOURCE_DATE_EPOCH={EPOCH}"))
        .arg("--iidfile")
        .arg(&iid)
        .output()
        .expect("run kiln");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("Dockerfile:3 RUN"), "{stderr}");
    let cli_image = String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .last()
        .expect("a digest line")
        .to_string();
    let cli_oci = std::fs::read_to_string(&iid).expect("iid");

    // Through the library, into another fresh store.
    let lib_store = t.path().join("lib-store");
    let tag: TagRef = "same:1".parse().expect("tag");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (r, events) = rt.block_on(run(&lib_store, request(&ctx, TagMove::force(tag.clone()))));
    let report = r.expect("pipeline build");
    assert_eq!(report.oci_manifest.digest.to_string(), cli_oci);
    let image = report.final_image().expect("an image manifest");
    assert_eq!(image.to_string(), cli_image);
    assert_eq!(report.tags, vec!["same:1".to_string()]);
    assert_eq!(report.steps_cached, 0, "{report:?}");
    let published = report.image.as_ref().expect("published");
    assert!(published.disk.new_chunks > 0, "{published:?}");
    assert_eq!(published.disk.reused_chunks, 0, "{published:?}");
    assert!(!published.reused, "{published:?}");
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::StepStarted { location, .. }
                if location.ends_with("Dockerfile:3"))),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| matches!(e, Event::StepDone { .. })),
        "{events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Event::Published { image: i, .. } if *i == image)),
        "{events:?}"
    );
    let store = rt
        .block_on(kiln_store::Store::open(lib_store.to_str().expect("utf-8")))
        .expect("store");
    let at = |t: &TagRef| {
        rt.block_on(store.get_tag(t))
            .expect("get tag")
            .map(|r| r.manifest)
    };
    assert_eq!(at(&tag), Some(image));

    // Rebuild: every step cached, every ext4 chunk already stored.
    let other: TagRef = "same:2".parse().expect("tag");
    let (r, _) = rt.block_on(run(
        &lib_store,
        request(
            &ctx,
            TagMove {
                tag: other.clone(),
                expect: TagExpect::Absent,
            },
        ),
    ));
    let again = r.expect("rebuild");
    assert_eq!(again.final_image(), Some(image));
    assert_eq!(again.steps_run, 0, "{again:?}");
    let disk = again.image.as_ref().expect("published").disk;
    assert_eq!(disk.new_chunks, 0, "{disk:?}");
    assert_eq!(disk.reused_chunks, published.disk.new_chunks, "{disk:?}");
    // ... and nothing was flattened: the first build's image manifest was reused.
    assert!(again.image.as_ref().expect("published").reused, "{again:?}");
    assert_eq!(at(&other), Some(image));

    // Compare-and-swap: a tag that exists is not absent, and a wrong digest is wrong.
    let third: TagRef = "same:3".parse().expect("tag");
    let (r, _) = rt.block_on(run(
        &lib_store,
        request(
            &ctx,
            TagMove {
                tag: tag.clone(),
                expect: TagExpect::Absent,
            },
        ),
    ));
    assert!(stale(r), "moved a tag expected absent");
    let mut req = request(
        &ctx,
        TagMove {
            tag: third.clone(),
            expect: TagExpect::Digest(image),
        },
    );
    // Two tags: the stale one must keep the other from moving too.
    if let Output::Image { tags, .. } = &mut req.output {
        tags.insert(0, TagMove::force("same:4".parse().expect("tag")));
    }
    let (r, _) = rt.block_on(run(&lib_store, req));
    assert!(
        stale(r),
        "moved a tag that does not name the expected digest"
    );
    assert_eq!(at(&third), None);
    assert_eq!(at(&"same:4".parse().expect("tag")), None);
    // A tag already at the digest expected stays; one expected absent moves.
    let (r, _) = rt.block_on(run(
        &lib_store,
        request(
            &ctx,
            TagMove {
                tag: tag.clone(),
                expect: TagExpect::Digest(image),
            },
        ),
    ));
    assert_eq!(r.expect("expected digest matches").tags, vec!["same:1"]);
    let (r, _) = rt.block_on(run(
        &lib_store,
        request(
            &ctx,
            TagMove {
                tag: third.clone(),
                expect: TagExpect::Absent,
            },
        ),
    ));
    assert_eq!(r.expect("absent as expected").tags, vec!["same:3"]);
    assert_eq!(at(&third), Some(image));

    // Cancelled before it starts: nothing moves.
    let fifth: TagRef = "same:5".parse().expect("tag");
    let req = request(&ctx, TagMove::force(fifth.clone()));
    req.cancel.cancel();
    let (r, _) = rt.block_on(run(&lib_store, req));
    assert!(matches!(r, Err(PipelineError::Cancelled)), "{r:?}");
    assert_eq!(at(&fifth), None);
}

/// The text a build's steps logged.
fn logged(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Log { text, .. } => Some(text.clone()),
            _ => None,
        })
        .collect()
}

/// Cache mounts scoped to a workspace are that workspace's only; the request's time limit
/// lowers the recipe's, and a build over it fails and tags nothing.
#[test]
fn workspace_cache_mounts_and_time_limit() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = t.path().join("ctx");
    std::fs::create_dir(&ctx).expect("mkdir");
    let store = t.path().join("store");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let build = |ws: &str| {
        let mut req = request(&ctx, TagMove::force("ws:1".parse().expect("tag")));
        req.no_cache = true;
        req.build_args.insert("WS".into(), ws.into());
        req.cache_mounts = kiln_pipeline::CacheMountScope::Workspace(ws.parse().expect("id"));
        let (r, events) = rt.block_on(run(&store, req));
        r.expect("build");
        logged(&events)
    };
    // Each build logs what the previous build of its workspace left in the cache mount.
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM {bb}\nARG WS\nRUN --mount=type=cache,target=/c \
             sh -c 'echo seen:$(cat /c/mark 2>/dev/null || echo nothing); echo $WS > /c/mark'\n"
        ),
    )
    .expect("write");
    assert!(build("alpha").contains(&"seen:nothing".to_string()));
    let beta = build("beta");
    assert!(beta.contains(&"seen:nothing".to_string()), "{beta:?}");
    let alpha = build("alpha");
    assert!(alpha.contains(&"seen:alpha".to_string()), "{alpha:?}");

    // A step longer than the request's time limit fails the build; no tag moves.
    std::fs::write(
        ctx.join("Dockerfile"),
        format!("FROM {bb}\nRUN sleep 600\n"),
    )
    .expect("write");
    let tag: TagRef = "slow:1".parse().expect("tag");
    let mut req = request(&ctx, TagMove::force(tag.clone()));
    req.limits.timeout = Some(std::time::Duration::from_secs(2));
    let (r, _) = rt.block_on(run(&store, req));
    match r {
        Err(PipelineError::Build(e)) => assert!(
            matches!(*e, kiln_builder::build::BuildError::Timeout { .. }),
            "{e}"
        ),
        r => panic!("not a timeout: {r:?}"),
    }
    let s = rt
        .block_on(kiln_store::Store::open(store.to_str().expect("utf-8")))
        .expect("store");
    assert_eq!(rt.block_on(s.get_tag(&tag)).expect("get tag"), None);
}
