//! The resolve phase on real plans (from the recipes front end) against the test registry
//! and fixtures of `ci/setup.sh`.

use kiln_builder::base::PullPolicy;
use kiln_builder::cache::{BlobCache, LocalCache, digest_of};
use kiln_builder::registry::{Registry, RegistryOptions};
use kiln_builder::resolve::{
    ResolveError, ResolveOptions, ResolvedBase, parse_build_context, resolve_plan,
};
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
            docker_config: "/nonexistent/kiln-test/config.json".into(),
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
    let cfg_digest = digest_of(&cfg_bytes);
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
    let md = digest_of(&mb);
    cache.put_bytes(&md, &mb).expect("put manifest");
    cache.set_ref("localhost/onbuild-base:1", &md).expect("tag");

    let p = plan(&format!(
        "FROM {busybox} AS a\nFROM layoutbase AS b\nCOPY --from=a /bin/busybox /bb\nFROM localhost/onbuild-base:1\nCOPY --from=b /bb /bb\n"
    ));
    let mut o = opts();
    let (name, spec) =
        parse_build_context(&format!("layoutbase=oci-layout://{layout}:latest")).expect("context");
    o.build_contexts.insert(name, spec);
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
