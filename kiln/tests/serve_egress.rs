//! What tenants' build steps trust and reach through `kiln serve` (README, "Network of build
//! steps"), as root:
//! - extra CA certificates from the server's `--ca-cert` and a build's `ca_certs`, and
//!   refusals of anything but certificates (namespace executor, `--trust-tenants`, busybox);
//! - microVM steps (the default executor) install with apt, pip and npm, clone with git and
//!   fetch with curl over HTTPS, all through the egress proxy, from local servers on 127.0.0.1
//!   under names the server's `--egress-host-for-tests` maps, with
//!   `--egress-allow-private-for-tests` on (the tools fixture, `KILN_TEST_TOOLS_REF`);
//! - with that switch off, microVM steps are refused a mapped name at a loopback address, the
//!   metadata address and the server's own port, each refusal one line of the build log,
//!   and a `none` step reaches nothing.

use std::time::Duration;

use kiln_tests::http::LocalServer;
use kiln_tests::pkgs::PackageServers;
use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, context_dir, env, get, json_of, rt, submit, tar_dir, terminal, wait_for,
};
use kiln_tests::tls::{TlsServer, make_certs};
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// Most extra CA certificates a build trusts, the server's with its own (README).
const MAX_CERTS: usize = 32;

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
    let dockerfile = format!(
        "FROM {bb}\n\
         RUN mkdir -p /etc/ssl/certs && echo '# image bundle' > /etc/ssl/certs/ca-certificates.crt\n\
         RUN echo \"certs=$(grep -c 'BEGIN CERTIFICATE' \"$PIP_CERT\")\" \
         && echo \"first=$(head -n 1 \"$SSL_CERT_FILE\")\"\n"
    );
    let ctx = context_dir(t.path(), &dockerfile);
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
        // The message of a submission with `ca_certs` that must be a 400.
        let refused = |bad: String| {
            let (c, s, key, ctx) = (&c, &s, &key, &ctx);
            async move {
                let spec = json!({"ca_certs": bad});
                let r = submit(c, s, key, &spec, Some(&tar_dir(ctx)), None, None).await;
                assert_eq!(r.status(), 400);
                let e = json_of(r).await;
                e["message"].as_str().unwrap_or_default().to_string()
            }
        };
        // A key where certificates belong, and text with no certificate: 400, naming the
        // field, and nothing is queued.
        for (bad, says) in [
            (
                format!("{build_pem}{private_key}"),
                "only CERTIFICATE sections",
            ),
            ("hello".to_string(), "no PEM certificate found"),
        ] {
            let m = refused(bad).await;
            assert!(
                m.starts_with("build spec: ca_certs: ") && m.contains(says),
                "{m}"
            );
            assert!(!m.contains("PRIVATE"), "the refusal echoes the key: {m}");
        }

        // 32 certificates at most, the server's one with the build's.
        let m = refused(build_pem.repeat(MAX_CERTS)).await;
        assert!(m.contains("32 certificates with this server's 1"), "{m}");

        // The server's certificate, then the build's, after the image's own bundle.
        let spec = json!({"ca_certs": build_pem});
        let (v, lines) = build_to_end(&c, &s, &key, t.path(), &dockerfile, &spec).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert!(lines.iter().any(|l| l == "certs=2"), "{lines:#?}");
        assert!(
            lines.iter().any(|l| l == "first=# image bundle"),
            "{lines:#?}"
        );

        // Without the build's own: the server's alone (the certificates are in no cache
        // key, so the steps would be cached without `no_cache`).
        let spec = json!({"no_cache": true});
        let (v, lines) = build_to_end(&c, &s, &key, t.path(), &dockerfile, &spec).await;
        assert_eq!(v["state"], "succeeded", "{v:#}");
        assert!(lines.iter().any(|l| l == "certs=1"), "{lines:#?}");
    });
}

/// Submits the context of `dockerfile` with `spec` and waits for the build's end; the build
/// view and its log lines.
async fn build_to_end(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    dir: &std::path::Path,
    dockerfile: &str,
    spec: &Value,
) -> (Value, Vec<String>) {
    let ctx = context_dir(dir, dockerfile);
    let r = submit(c, s, key, spec, Some(&tar_dir(&ctx)), None, None).await;
    assert_eq!(r.status(), 202);
    let id = json_of(r).await["id"].as_str().expect("id").to_string();
    let v = wait_for(c, s, key, &id, Duration::from_secs(900), terminal).await;
    let lines = log_lines(c, s, key, &id).await;
    (v, lines)
}

#[test]
fn microvm_steps_install_with_apt_pip_npm_git_and_curl_through_the_proxy() {
    let tools = require_env("KILN_TEST_TOOLS_REF");
    let (t, state, store) = env();
    let root = |n: &str| {
        let d = t.path().join(n);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    };
    let PackageServers { apt, pypi, npm } = PackageServers::start(t.path());
    let git = root("git");
    kiln_tests::pkgs::git_repo(&git);
    let git = LocalServer::serve_dir(&git);
    let certs = root("certs");
    make_certs(&certs, "files.test");
    std::fs::write(certs.join("hello.txt"), "over tls\n").expect("write");
    let tls = TlsServer::start(&certs);
    let ca = std::fs::read_to_string(certs.join("ca.pem")).expect("read");

    let mut extra = vec!["--egress-allow-private-for-tests".to_string()];
    for name in PackageServers::HOSTS
        .into_iter()
        .chain(["git.test", "files.test"])
    {
        extra.extend([
            "--egress-host-for-tests".into(),
            format!("{name}=127.0.0.1"),
        ]);
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let s = Server::start_vm(KILN.as_ref(), &state, &store, &extra);
    let key = s.key("acme", &[]);
    let c = client();
    // One step (one microVM boot under TCG costs seconds), each tool in turn.
    let dockerfile = format!(
        "FROM {tools}\n\
         RUN set -e; rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*; \
         echo 'deb [trusted=yes] http://apt.test:{}/ test main' > /etc/apt/sources.list.d/t.list; \
         apt-get -q update; apt-get -q install -y kiln-hello; \
         echo \"apt: $(cat /usr/share/kiln-hello/hello.txt)\"; \
         pip install -q --break-system-packages --index-url http://pypi.test:{}/simple \
         --trusted-host pypi.test kiln-hello; \
         echo \"pip: $(python3 -c 'import kiln_hello; print(kiln_hello.MSG)')\"; \
         mkdir -p /app; cd /app; npm install --no-audit --no-fund --no-update-notifier \
         --registry http://npm.test:{}/ kiln-hello; \
         echo \"npm: $(node -p \"require('kiln-hello')\")\"; \
         git clone -q http://git.test:{}/repo.git /repo; echo \"git: $(cat /repo/README)\"; \
         echo \"https: $(curl -fsS https://files.test:{}/hello.txt)\"\n",
        apt.port, pypi.port, npm.port, git.port, tls.port
    );
    rt().block_on(async {
        let spec = json!({"ca_certs": ca, "limits": {"memory_mib": 512, "timeout_secs": 900}});
        let (v, lines) = build_to_end(&c, &s, &key, t.path(), &dockerfile, &spec).await;
        assert_eq!(v["state"], "succeeded", "{v:#}\n{lines:#?}");
        let hello = kiln_tests::pkgs::HELLO;
        for want in [
            format!("apt: {hello}"),
            format!("pip: {hello}"),
            format!("npm: {hello}"),
            format!("git: {hello}"),
            "https: over tls".to_string(),
        ] {
            assert!(lines.contains(&want), "{want:?} missing: {lines:#?}");
        }
        assert!(
            !lines.iter().any(|l| l.contains("egress: refused")),
            "{lines:#?}"
        );
    });
    // Each went through the proxy to its server.
    for (server, path) in [
        (&apt, "GET /pool/kiln-hello_1.0_all.deb "),
        (&pypi, "GET /packages/kiln_hello-1.0-py3-none-any.whl "),
        (&npm, "GET /tarballs/kiln-hello-1.0.0.tgz "),
        (&git, "GET /repo.git/info/refs"),
    ] {
        let seen = server.seen.lock().expect("lock").clone();
        assert!(
            seen.iter().any(|l| l.starts_with(path)),
            "{path}: {seen:#?}"
        );
    }
}

#[test]
fn microvm_steps_are_refused_private_metadata_and_the_servers_own_port_and_none_reaches_nothing() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, state, store) = env();
    let pkg = LocalServer::start();
    let s = Server::start_vm(
        KILN.as_ref(),
        &state,
        &store,
        &["--egress-host-for-tests", "pkg.test=127.0.0.1"],
    );
    let own = s
        .url("/")
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .expect("port")
        .to_string();
    let key = s.key("acme", &[]);
    let c = client();
    // wget skips the proxy for the names in no_proxy (127.0.0.1 among them): unset for the
    // loopback case, so that the request reaches the proxy and its rule.
    let dockerfile = format!(
        "FROM {bb}\n\
         RUN wget -q -O- http://pkg.test:{p}/a || echo 'pkg: failed'; \
         wget -q -O- http://169.254.169.254/latest/meta-data/ || echo 'metadata: failed'; \
         env -u no_proxy -u NO_PROXY wget -q -O- http://127.0.0.1:{own}/v1/builds || echo 'own: failed'\n\
         RUN --network=none wget -q -T 5 -O- http://pkg.test:{p}/none || echo 'none: failed'\n",
        p = pkg.port
    );
    rt().block_on(async {
        let spec = json!({"limits": {"memory_mib": 256, "timeout_secs": 600}});
        let (v, lines) = build_to_end(&c, &s, &key, t.path(), &dockerfile, &spec).await;
        assert_eq!(v["state"], "succeeded", "{v:#}\n{lines:#?}");
        let has = |p: &str| lines.iter().any(|l| l.starts_with(p));
        for want in [
            format!("egress: refused GET pkg.test:{}", pkg.port),
            "egress: refused GET 169.254.169.254:80".to_string(),
            format!("egress: refused GET 127.0.0.1:{own}"),
        ] {
            assert!(has(&want), "{want:?} missing: {lines:#?}");
        }
        for want in [
            "pkg: failed",
            "metadata: failed",
            "own: failed",
            "none: failed",
        ] {
            assert!(
                lines.iter().any(|l| l == want),
                "{want:?} missing: {lines:#?}"
            );
        }
        // Three refusals, none of them the `none` step's: it reached no proxy at all.
        let refusals = lines.iter().filter(|l| l.starts_with("egress: ")).count();
        assert_eq!(refusals, 3, "{lines:#?}");
    });
    assert!(
        pkg.seen.lock().expect("lock").is_empty(),
        "the server was reached"
    );
}
