//! The resolve phase on real plans (from the recipes front end) against the test registry
//! and fixtures of `ci/setup.sh`.

use kiln_builder::base::PullPolicy;
use kiln_builder::cache::{BlobCache, LocalCache};
use kiln_builder::registry::{Registry, RegistryOptions};
use kiln_builder::resolve::{
    ResolveError, ResolveOptions, ResolvedBase, resolve_plan, resolve_recipe,
};
use kiln_store::BlobDigest;
use kiln_tests::require_env;

fn plan(dockerfile: &str) -> kiln_recipes::BuildPlan {
    kiln_recipes::load_dockerfile(
        "Dockerfile",
        dockerfile.as_bytes(),
        &kiln_recipes::Options::default(),
    )
    .unwrap_or_else(|e| panic!("plan: {e}"))
}

fn opts() -> ResolveOptions {
    ResolveOptions {
        registry: RegistryOptions {
            docker_config: Some("/nonexistent/kiln-test/config.json".into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn every_base_becomes_a_digest() {
    let busybox = require_env("KILN_TEST_BUSYBOX_REF");
    let layout = require_env("KILN_TEST_BUSYBOX_OCI");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = LocalCache::open(dir.path()).expect("cache");
    // An image whose config carries ONBUILD triggers, on busybox's layer.
    let reg = Registry::new(opts().registry);
    let pulled = rt
        .block_on(reg.pull(&busybox.parse().expect("ref"), &cache))
        .expect("pull busybox");
    let m = kiln_builder::base::manifest(&cache, &pulled.digest).expect("manifest");
    let base_cfg: serde_json::Value = serde_json::from_slice(
        &cache
            .read_blob(&m.config.digest)
            .expect("ok")
            .expect("config"),
    )
    .expect("json");
    let cfg = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": { "OnBuild": ["RUN echo triggered", "ENV FROM_ONBUILD=1"] },
        "rootfs": base_cfg["rootfs"],
    });
    let cfg_bytes = serde_json::to_vec(&cfg).expect("json");
    let cfg_digest = BlobDigest::of(&cfg_bytes);
    cache
        .put_bytes(&cfg_digest, &cfg_bytes)
        .expect("put config");
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg_bytes.len() },
        "layers": [ { "mediaType": m.layers[0].media_type, "digest": m.layers[0].digest, "size": m.layers[0].size } ],
    });
    let mb = serde_json::to_vec(&manifest).expect("json");
    let md = BlobDigest::of(&mb);
    cache.put_bytes(&md, &mb).expect("put manifest");
    cache.set_ref("localhost/onbuild-base:1", &md).expect("tag");

    let p = plan(&format!(
        "FROM {busybox} AS a\nFROM layoutbase AS b\nCOPY --from=a /bin/busybox /bb\nFROM localhost/onbuild-base:1\nCOPY --from=b /bb /bb\n"
    ));
    let mut o = opts();
    o.build_contexts.insert(
        "layoutbase".into(),
        kiln_builder::layout::LayoutRef {
            dir: layout.into(),
            tag: Some("latest".into()),
        },
    );
    let r = rt.block_on(resolve_plan(&p, &o, &cache)).expect("resolve");
    assert_eq!(r.len(), 3, "{r:?}");
    match &r[0] {
        ResolvedBase::Image {
            digest, onbuild, ..
        } => {
            assert_eq!(digest, &pulled.digest);
            assert!(onbuild.is_empty());
        }
        other => panic!("stage 0: {other:?}"),
    }
    match &r[1] {
        // The layout holds the very image that was pushed (digests preserved).
        ResolvedBase::Image { digest, .. } => assert_eq!(digest, &pulled.digest),
        other => panic!("stage 1: {other:?}"),
    }
    match &r[2] {
        ResolvedBase::Image {
            digest, onbuild, ..
        } => {
            assert_eq!(digest, &md);
            assert_eq!(onbuild, &["RUN echo triggered", "ENV FROM_ONBUILD=1"]);
        }
        other => panic!("stage 2: {other:?}"),
    }

    // The resolve phase applies the triggers: lowered after the FROM, in the stage's context,
    // not inherited by the image.
    let df = "FROM localhost/onbuild-base:1\nRUN echo own $FROM_ONBUILD\n";
    let (p, r) = rt
        .block_on(resolve_recipe(
            "Dockerfile",
            df.as_bytes(),
            &kiln_recipes::Options::default(),
            &opts(),
            &cache,
        ))
        .expect("resolve recipe");
    assert!(matches!(&r[0], ResolvedBase::Image { digest, .. } if digest == &md));
    let argv: Vec<Vec<String>> = p.stages[0]
        .steps
        .iter()
        .map(|s| match &s.action {
            kiln_recipes::plan::Action::Run(r) => r.argv.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        argv,
        [
            vec!["/bin/sh", "-c", "echo triggered"],
            vec!["/bin/sh", "-c", "echo own $FROM_ONBUILD"]
        ]
    );
    assert!(
        p.stages[0].steps[1]
            .context
            .env
            .contains(&"FROM_ONBUILD=1".to_string())
    );
    assert!(p.stages[0].config.onbuild.is_empty(), "not inherited");
    // A hostile base whose trigger is FROM is refused, naming the trigger.
    let hostile = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": { "OnBuild": ["FROM evil"] },
        "rootfs": base_cfg["rootfs"],
    });
    let hb = serde_json::to_vec(&hostile).expect("json");
    let hd = BlobDigest::of(&hb);
    cache.put_bytes(&hd, &hb).expect("put config");
    let mut hm = manifest.clone();
    hm["config"]["digest"] = hd.to_string().into();
    hm["config"]["size"] = hb.len().into();
    let hmb = serde_json::to_vec(&hm).expect("json");
    let hmd = BlobDigest::of(&hmb);
    cache.put_bytes(&hmd, &hmb).expect("put manifest");
    cache
        .set_ref("localhost/hostile-base:1", &hmd)
        .expect("tag");
    let err = rt
        .block_on(resolve_recipe(
            "Dockerfile",
            b"FROM localhost/hostile-base:1\nRUN true\n",
            &kiln_recipes::Options::default(),
            &opts(),
            &cache,
        ))
        .expect_err("refused trigger");
    assert!(
        matches!(err, ResolveError::Recipe(_))
            && err
                .to_string()
                .contains("FROM is not allowed as an ONBUILD trigger"),
        "{err}"
    );

    // A stage on a stage, and scratch.
    let p = plan(&format!(
        "FROM {busybox} AS a\nFROM a\nRUN true\nFROM scratch\nCOPY --from=1 /bin/busybox /\n"
    ));
    let r = rt
        .block_on(resolve_plan(&p, &opts(), &cache))
        .expect("resolve");
    assert!(matches!(r[1], ResolvedBase::Stage(0)), "{r:?}");
    assert_eq!(r[2], ResolvedBase::Scratch);

    // Offline and not cached: a clear error naming the stage.
    let p = plan("FROM 127.0.0.1:5000/kiln-absent:x\n");
    let mut o = opts();
    o.policy = PullPolicy::Never;
    match rt.block_on(resolve_plan(&p, &o, &cache)) {
        Err(e @ ResolveError::Base { stage: 0, .. }) => {
            assert!(e.to_string().contains("--offline"), "{e}")
        }
        other => panic!("expected an offline error, got {other:?}"),
    }
}
