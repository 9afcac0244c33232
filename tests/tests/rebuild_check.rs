//! Issue 40's rebuild check through real [`kiln_pipeline::run`]s into a local store, on the
//! busybox fixture of `ci/setup.sh` (pulled from the test registry): a base image is built
//! and tagged, an app image is built `FROM` that tag, the base moves, and the app is rebuilt
//! with [`kiln_pipeline::BuildRequest::rebuild_check`] set from the summaries taken after the
//! first build ([`kiln_pipeline::oci_config_summary`]). A rebuild whose config changed only
//! where the base's did moves its tag; one that changed a field the base kept fails with
//! [`PipelineError::RebuildCheck`] and leaves the tag alone. Also: which base a multi-stage
//! build's image inherits from ([`kiln_pipeline::BuildReport::image_base`]). As root, like
//! the other build tests.

use std::sync::Arc;

use kiln_pipeline::{
    BuildReport, BuildRequest, ContextSource, Event, Output, PipelineError, RebuildCheck, Recipe,
    Setup, StageFrom, TagExpect, TagMove, oci_config_summary,
};
use kiln_store::TagRef;
use kiln_tests::require_env;

fn root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the build tests need root (CI runs them as root)"
    );
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A request for the Dockerfile `text` (no context) whose image the `tags` name.
fn request(text: &str, tags: Vec<TagMove>) -> BuildRequest {
    let mut req = BuildRequest::new(
        Recipe {
            name: "Dockerfile".into(),
            bytes: text.as_bytes().to_vec(),
        },
        ContextSource::None,
    );
    req.output = Output::Image {
        tags,
        snapshot: None,
    };
    req
}

async fn build(setup: &Setup, req: BuildRequest) -> Result<BuildReport, PipelineError> {
    kiln_pipeline::run(setup, req, Arc::new(|_: Event| {})).await
}

fn tag(s: &str) -> TagRef {
    s.parse().expect("tag")
}

#[test]
fn a_rebuild_moves_its_tag_only_where_its_config_follows_the_base() {
    root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let rt = runtime();
    rt.block_on(async {
        let setup = Setup::open_local(&t.path().join("store"))
            .await
            .expect("setup");
        let (base_tag, app_tag) = (tag("base:1"), tag("app:1"));
        let base_v1 = build(
            &setup,
            request(
                &format!("FROM {bb}\nENV BASE=1 KEEP=k\nWORKDIR /srv\n"),
                vec![TagMove::force(base_tag.clone())],
            ),
        )
        .await
        .expect("base v1");
        let app_text = "FROM base:1\nENV APP=1\nCMD [\"sh\"]\n";
        let app = build(
            &setup,
            request(app_text, vec![TagMove::force(app_tag.clone())]),
        )
        .await
        .expect("app");
        // What the service keeps when the app starts following its base.
        let base_use = app.image_base().expect("the app has an image base");
        assert_eq!(base_use.reference, "base:1");
        assert_eq!(base_use.digest, base_v1.oci_manifest.digest);
        let cache = setup.cache.as_ref();
        let original = oci_config_summary(cache, &app.oci_manifest.digest)
            .await
            .expect("the app's summary");
        let old_base = oci_config_summary(cache, &base_use.digest)
            .await
            .expect("the base's summary");
        assert_eq!(original.env.get("APP").map(String::as_str), Some("1"));
        assert_eq!(original.env.get("BASE").map(String::as_str), Some("1"));
        assert_eq!(original.workdir.as_deref(), Some("/srv"));
        assert_eq!(original.cmd, Some(vec!["sh".to_string()]));
        assert_eq!(old_base.env.get("APP"), None);
        let app_image = app.final_image().expect("published");
        let check = RebuildCheck { original, old_base };
        assert_eq!(
            RebuildCheck::of_build(cache, &app)
                .await
                .expect("of the build"),
            check
        );

        // The base moves: BASE and the working directory change, KEEP does not.
        let base_v2 = build(
            &setup,
            request(
                &format!("FROM {bb}\nENV BASE=2 KEEP=k\nWORKDIR /srv2\n"),
                vec![TagMove::force(base_tag.clone())],
            ),
        )
        .await
        .expect("base v2");
        assert_ne!(base_v2.oci_manifest.digest, base_v1.oci_manifest.digest);

        // A rebuild that differs from the original only where the base changed: no move
        // yet (the check fails on a changed field the base kept, below), then it moves.
        let pinned = |from| TagMove {
            tag: app_tag.clone(),
            expect: TagExpect::Digest(from),
        };
        let mut bad = request(
            "FROM base:1\nENV APP=2\nCMD [\"sh\"]\n",
            vec![pinned(app_image)],
        );
        bad.rebuild_check = Some(check.clone());
        match build(&setup, bad).await {
            Err(PipelineError::RebuildCheck {
                field,
                expected,
                found,
            }) => assert_eq!(
                (field.as_str(), expected.as_str(), found.as_str()),
                ("env APP", "\"1\"", "\"2\"")
            ),
            other => panic!("expected the rebuild check to fail: {other:?}"),
        }
        assert_eq!(
            setup.store.resolve_tag(&app_tag).await.expect("app tag"),
            app_image,
            "a failed check moves no tag"
        );

        let mut good = request(app_text, vec![pinned(app_image)]);
        good.rebuild_check = Some(check.clone());
        let rebuilt = build(&setup, good).await.expect("the rebuild passes");
        let new_image = rebuilt.final_image().expect("published");
        assert_ne!(new_image, app_image, "a new image on the new base");
        assert_eq!(
            rebuilt.image_base().map(|b| b.digest),
            Some(base_v2.oci_manifest.digest)
        );
        assert_eq!(rebuilt.tags, vec![app_tag.to_string()]);
        assert_eq!(
            setup.store.resolve_tag(&app_tag).await.expect("app tag"),
            new_image
        );
        let summary = oci_config_summary(cache, &rebuilt.oci_manifest.digest)
            .await
            .expect("the rebuild's summary");
        assert_eq!(summary.env.get("BASE").map(String::as_str), Some("2"));
        assert_eq!(summary.workdir.as_deref(), Some("/srv2"));
        // What the next rebuild is checked against: the rebuilt image on the new base.
        let next = RebuildCheck::of_build(cache, &rebuilt).await.expect("next");
        assert_eq!(next.original, summary);
        assert_eq!(next.old_base.env.get("BASE").map(String::as_str), Some("2"));
    });
}

#[test]
fn a_multi_stage_builds_image_base_is_its_targets_root() {
    root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let rt = runtime();
    rt.block_on(async {
        let setup = Setup::open_local(&t.path().join("store"))
            .await
            .expect("setup");
        build(
            &setup,
            request(
                &format!("FROM {bb}\nENV BASE=1\n"),
                vec![TagMove::force(tag("base:1"))],
            ),
        )
        .await
        .expect("base");
        let text = format!(
            "FROM base:1 AS one\nENV ONE=1\n\
             FROM {bb} AS two\nENV TWO=1\n\
             FROM one\nCOPY --from=two /bin/busybox /bb2\nENV X=1\n"
        );
        let r = build(&setup, request(&text, vec![TagMove::force(tag("multi:1"))]))
            .await
            .expect("multi-stage build");
        let mut refs: Vec<&str> = r.bases.iter().map(|b| b.reference.as_str()).collect();
        refs.sort_unstable();
        let mut want = ["base:1", bb.as_str()];
        want.sort_unstable();
        assert_eq!(refs, want, "{:?}", r.bases);
        assert!(
            matches!(r.froms.get(r.target_stage), Some(StageFrom::Stage(_))),
            "{:?} (target {})",
            r.froms,
            r.target_stage
        );
        let base = r.image_base().expect("an image base");
        assert_eq!(base.reference, "base:1");
        assert_eq!(r.froms[base.stage], StageFrom::Image);
        let summary = oci_config_summary(setup.cache.as_ref(), &base.digest)
            .await
            .expect("its summary");
        assert_eq!(summary.env.get("BASE").map(String::as_str), Some("1"));
    });
}
