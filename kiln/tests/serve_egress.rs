//! What tenants' build steps trust and reach through `kiln serve` (README, "Network of build
//! steps"): extra CA certificates from the server's `--ca-cert` and a build's `ca_certs`,
//! and refusals of anything but certificates. Namespace executor (`--trust-tenants`), busybox
//! fixture, as root.

use std::time::Duration;

use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, context_dir, env, get, json_of, rt, submit, tar_dir, terminal, wait_for,
};
use kiln_tests::tls::make_certs;
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// The text lines of build `id`'s log.
async fn log_lines(c: &reqwest::Client, s: &Server, key: &str, id: &str) -> Vec<String> {
    let text = get(c, s, key, &format!("/v1/builds/{id}/logs"))
        .await
        .text()
        .await
        .expect("text");
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("ndjson"))
        .filter_map(|v| v["text"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn server_and_build_ca_certificates_reach_steps_and_keys_are_refused() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let server_ca = t.path().join("server-ca");
    let build_ca = t.path().join("build-ca");
    for d in [&server_ca, &build_ca] {
        std::fs::create_dir(d).expect("mkdir");
        make_certs(d, "pkg.test");
    }
    let ctx = context_dir(
        t.path(),
        &format!(
            "FROM {bb}\n\
             RUN mkdir -p /etc/ssl/certs && echo '# image bundle' > /etc/ssl/certs/ca-certificates.crt\n\
             RUN echo \"certs=$(grep -c 'BEGIN CERTIFICATE' \"$PIP_CERT\")\" \
             && echo \"first=$(head -n 1 \"$SSL_CERT_FILE\")\"\n"
        ),
    );
    let server_pem = server_ca.join("ca.pem");
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--ca-cert", server_pem.to_str().expect("utf-8")],
    );
    let key = s.key("acme", &[]);
    let c = client();
    let build_pem = std::fs::read_to_string(build_ca.join("ca.pem")).expect("read");
    let private_key = std::fs::read_to_string(build_ca.join("srv.key")).expect("read");
    rt().block_on(async {
        // A key where certificates belong, and text with no certificate: 400, naming the
        // field, and nothing is queued.
        for (bad, says) in [
            (
                format!("{build_pem}{private_key}"),
                "only CERTIFICATE sections",
            ),
            ("hello".to_string(), "no PEM certificate found"),
        ] {
            let r = submit(
                &c,
                &s,
                &key,
                &json!({"ca_certs": bad}),
                Some(&tar_dir(&ctx)),
                None,
                None,
            )
            .await;
            assert_eq!(r.status(), 400);
            let e = json_of(r).await;
            let m = e["message"].as_str().unwrap_or_default();
            assert!(
                m.starts_with("build spec: ca_certs: ") && m.contains(says),
                "{e:#}"
            );
            assert!(!m.contains("PRIVATE"), "the refusal echoes the key: {e:#}");
        }

        // The server's certificate, then the build's, after the image's own bundle.
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"ca_certs": build_pem}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let lines = log_lines(&c, &s, &key, &id).await;
        assert!(lines.iter().any(|l| l == "certs=2"), "{lines:#?}");
        assert!(
            lines.iter().any(|l| l == "first=# image bundle"),
            "{lines:#?}"
        );

        // Without the build's own: the server's alone (the certificates are in no cache
        // key, so the steps would be cached without `no_cache`).
        let r = submit(
            &c,
            &s,
            &key,
            &json!({"no_cache": true}),
            Some(&tar_dir(&ctx)),
            None,
            None,
        )
        .await;
        assert_eq!(r.status(), 202);
        let id = json_of(r).await["id"].as_str().expect("id").to_string();
        let v = wait_for(&c, &s, &key, &id, Duration::from_secs(300), terminal).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        let lines = log_lines(&c, &s, &key, &id).await;
        assert!(lines.iter().any(|l| l == "certs=1"), "{lines:#?}");
    });
}
