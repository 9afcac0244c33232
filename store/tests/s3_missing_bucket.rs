//! A store URL naming an S3 bucket that does not exist (newcomer review, 2026-11-30): every
//! operation must say the bucket is missing, not "no object at <key>" (which read as if the
//! store were there and merely empty). Runs against moto (`KILN_TEST_S3_ENDPOINT`).

use kiln_store::backend::s3::S3Options;
use kiln_store::{Store, StoreOptions};

#[tokio::test]
async fn missing_bucket_is_named() {
    let endpoint = std::env::var("KILN_TEST_S3_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "KILN_TEST_S3_ENDPOINT is not set: run ci/setup.sh and source \
             /var/cache/kiln-ci/env (S3 tests never skip)"
        )
    });
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let opts = StoreOptions {
        s3: S3Options {
            endpoint: Some(endpoint),
            allow_http: Some(true),
            region: Some(env("AWS_REGION", "us-east-1")),
            access_key_id: Some(env("AWS_ACCESS_KEY_ID", "kiln-test")),
            secret_access_key: Some(env("AWS_SECRET_ACCESS_KEY", "kiln-test")),
            ..S3Options::default()
        },
        ..StoreOptions::default()
    };
    let store = Store::open_with("s3://kiln-no-such-bucket/x", opts)
        .await
        .expect("opening does not touch the bucket");
    let put = store
        .put_blob(bytes::Bytes::from_static(b"x"))
        .await
        .expect_err("no bucket to write to");
    assert!(
        put.to_string().contains("bucket does not exist"),
        "put: {put}"
    );
    let tag = store
        .get_tag(&"app:v1".parse().expect("tag"))
        .await
        .expect_err("a missing bucket is not an empty store");
    assert!(
        tag.to_string().contains("bucket does not exist"),
        "get_tag: {tag}"
    );
}
