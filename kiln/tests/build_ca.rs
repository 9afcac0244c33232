//! Extra CA certificates (`kiln build --ca-cert`, README "Network of build steps"), with the
//! address policy's settings for tests (`--egress-allow-private-for-tests`,
//! `--egress-host-for-tests`), on the busybox fixture, as root:
//! - `ADD https://…` trusts a test CA only when it is given, from a real TLS server
//!   (`openssl s_server`, on 127.0.0.1 under a name the hosts setting maps);
//! - a `RUN` step sees the image's own bundle followed by the extra certificate in the file
//!   its `SSL_CERT_FILE`… variables name, under the namespace executor and in a microVM, and
//!   neither the file nor the variables reach the image;
//! - the certificates change no digest: the same recipe built with and without them gives
//!   the same image.

use std::path::{Path, PathBuf};
use std::process::Output;

use kiln_tests::require_env;
use kiln_tests::tls::{TlsServer, make_certs};
use kiln_tests::vm::kiln_in;

fn need_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
}

fn build(dir: &Path, ctx: &Path, extra: &[&str]) -> Output {
    kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
        .arg("build")
        .arg(ctx)
        .args(["--progress", "plain"])
        .args(extra)
        .output()
        .expect("run kiln")
}

fn ok(o: &Output) -> String {
    kiln_tests::assert_success(o, "kiln build");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .expect("the digest line")
        .to_string()
}

/// The root file system and the OCI config of store tag `tag` of `dir`'s store (through
/// `kiln export --format oci` and `kiln unpack oci:…`).
fn unpack(dir: &Path, tag: &str) -> (PathBuf, serde_json::Value) {
    let name = tag.replace(':', "-");
    let layout = dir.join(format!("layout-{name}"));
    kiln_tests::run_ok(
        kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
            .args(["export", tag, "--format", "oci", "-o"])
            .arg(&layout),
    );
    let out = dir.join(format!("rootfs-{name}"));
    kiln_tests::run_ok(
        kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
            .arg("unpack")
            .arg(format!(
                "oci:{}:{}",
                layout.display(),
                tag.rsplit(':').next().expect("a tag")
            ))
            .arg(&out)
            .arg("--offline"),
    );
    let blob = |digest: &str| -> serde_json::Value {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        serde_json::from_slice(&std::fs::read(layout.join("blobs/sha256").join(hex)).expect("blob"))
            .expect("json")
    };
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).expect("index"))
            .expect("json");
    let manifest = blob(index["manifests"][0]["digest"].as_str().expect("digest"));
    let config = blob(manifest["config"]["digest"].as_str().expect("digest"));
    (out, config)
}

fn context(dir: &Path, dockerfile: &str) -> PathBuf {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir ctx");
    std::fs::write(ctx.join("Dockerfile"), dockerfile).expect("write Dockerfile");
    ctx
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// What a step saw of its bundle, written into the image by the recipe below.
const SEE_BUNDLE: &str = "RUN grep -c 'BEGIN CERTIFICATE' \"$SSL_CERT_FILE\" > /count \
     && head -n 1 \"$SSL_CERT_FILE\" > /first \
     && echo \"$SSL_CERT_FILE $CURL_CA_BUNDLE $GIT_SSL_CAINFO $REQUESTS_CA_BUNDLE $PIP_CERT $NODE_EXTRA_CA_CERTS\" > /vars\n";

#[test]
fn add_trusts_a_given_ca_and_steps_see_it_beside_the_image_bundle_without_keeping_it() {
    need_root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let certs = t.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir");
    make_certs(&certs, "files.test");
    std::fs::write(certs.join("hello.txt"), "hello over tls\n").expect("write");
    let server = TlsServer::start(&certs);
    let ca = certs.join("ca.pem");
    let ca = ca.to_str().expect("utf-8");
    let reach = [
        "--egress-allow-private-for-tests",
        "--egress-host-for-tests",
        "files.test=127.0.0.1",
    ];
    let dockerfile = format!(
        "FROM {bb}\n\
         RUN mkdir -p /etc/ssl/certs && echo '# the image bundle' > /etc/ssl/certs/ca-certificates.crt\n\
         ADD https://files.test:{}/hello.txt /hello.txt\n\
         {SEE_BUNDLE}",
        server.port
    );

    // Without the CA, the server's certificate is not trusted.
    let a = t.path().join("without");
    let ctx = context(&a, &dockerfile);
    let o = build(&a, &ctx, &reach);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "built without the CA: {stderr}");
    assert!(
        stderr.contains(&format!("ADD https://files.test:{}/hello.txt", server.port)),
        "{stderr}"
    );
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");

    // With it, namespace executor.
    let b = t.path().join("with");
    let ctx = context(&b, &dockerfile);
    let mut args = reach.to_vec();
    args.extend(["--ca-cert", ca, "-t", "ca:1"]);
    ok(&build(&b, &ctx, &args));
    let (root, config) = unpack(&b, "ca:1");
    assert_eq!(read(&root.join("hello.txt")), "hello over tls\n");
    // The image's bundle, then the one extra certificate.
    assert_eq!(read(&root.join("count")).trim(), "1");
    assert_eq!(read(&root.join("first")).trim(), "# the image bundle");
    let bundle = "/dev/pipes/kiln-ca-certificates.crt";
    assert_eq!(read(&root.join("vars")).trim(), [bundle; 6].join(" "));
    // The image's own bundle is untouched, and the step's bundle is not in the image.
    assert_eq!(
        read(&root.join("etc/ssl/certs/ca-certificates.crt")),
        "# the image bundle\n"
    );
    assert!(
        !root.join("dev/pipes").exists(),
        "the bundle reached the layer"
    );
    let env = config["config"]["Env"].to_string();
    assert!(
        env.contains("PATH=") && !env.contains("SSL_CERT_FILE"),
        "the variables reached the image config: {env}"
    );

    // In a microVM: the same bundle and variables.
    let vm_file = format!(
        "FROM {bb}\nRUN mkdir -p /etc/ssl/certs && echo '# vm bundle' > /etc/ssl/certs/ca-certificates.crt\n{SEE_BUNDLE}"
    );
    let c = t.path().join("vm");
    let ctx = context(&c, &vm_file);
    ok(&build(
        &c,
        &ctx,
        &["--isolation", "vm", "--ca-cert", ca, "-t", "vm:1"],
    ));
    let (root, _) = unpack(&c, "vm:1");
    assert_eq!(read(&root.join("count")).trim(), "1");
    assert_eq!(read(&root.join("first")).trim(), "# vm bundle");
    assert_eq!(read(&root.join("vars")).trim(), [bundle; 6].join(" "));
    assert!(!root.join("dev/pipes").exists());
}

#[test]
fn extra_certificates_change_no_digest_and_bad_ones_are_refused_naming_the_file() {
    need_root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let certs = t.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir");
    make_certs(&certs, "files.test");
    let ca = certs.join("ca.pem");
    let dockerfile = format!("FROM {bb}\nRUN echo made > /made\n");
    let plain = t.path().join("plain");
    let ctx = context(&plain, &dockerfile);
    let epoch = ["--build-arg", "SOURCE_DATE_EPOCH=1700000000"];
    let d1 = ok(&build(&plain, &ctx, &epoch));
    let with = t.path().join("with");
    let ctx = context(&with, &dockerfile);
    let mut args = epoch.to_vec();
    args.extend(["--ca-cert", ca.to_str().expect("utf-8")]);
    let d2 = ok(&build(&with, &ctx, &args));
    assert_eq!(d1, d2, "the CA changed the image");

    // A private key where certificates belong is refused, naming the file.
    let key = certs.join("srv.key");
    let o = build(&plain, &ctx, &["--ca-cert", key.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("--ca-cert {}", key.display()))
            && stderr.contains("only CERTIFICATE sections"),
        "{stderr}"
    );
    // So is a file with no certificate.
    let empty = certs.join("ext.cnf");
    let o = build(&plain, &ctx, &["--ca-cert", empty.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("no PEM certificate found"), "{stderr}");
}

#[test]
fn a_hostile_image_bundle_is_read_inside_the_image_or_left_out() {
    need_root();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let certs = t.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir");
    make_certs(&certs, "files.test");
    let ca = certs.join("ca.pem");
    // Each bundle in turn: a symlink loop, a FIFO (never opened, so nothing blocks), a
    // symlink to /dev/zero, and a relative symlink climbing past the root, which resolves to
    // the image's own /etc/passwd (busybox's root line ends in /bin/sh; a host's would be
    // read only if the walk left the root).
    let count = "grep -c 'BEGIN CERTIFICATE' \"$SSL_CERT_FILE\"";
    let dockerfile = format!(
        "FROM {bb}\n\
         RUN mkdir -p /etc/ssl/certs && ln -s loop /etc/ssl/certs/ca-certificates.crt \
         && ln -s ca-certificates.crt /etc/ssl/certs/loop\n\
         RUN {count} > /loop\n\
         RUN rm /etc/ssl/certs/* && mkfifo /etc/ssl/certs/ca-certificates.crt\n\
         RUN {count} > /fifo\n\
         RUN rm /etc/ssl/certs/* && ln -s /dev/zero /etc/ssl/certs/ca-certificates.crt\n\
         RUN {count} > /zero\n\
         RUN rm /etc/ssl/certs/* \
         && ln -s ../../../../../../../../etc/passwd /etc/ssl/certs/ca-certificates.crt\n\
         RUN head -n 1 \"$SSL_CERT_FILE\" > /escape\n"
    );
    let d = t.path().join("hostile");
    let ctx = context(&d, &dockerfile);
    ok(&build(
        &d,
        &ctx,
        &["--ca-cert", ca.to_str().expect("utf-8"), "-t", "hostile:1"],
    ));
    let (root, _) = unpack(&d, "hostile:1");
    for f in ["loop", "fifo", "zero"] {
        assert_eq!(read(&root.join(f)).trim(), "1", "{f}");
    }
    assert_eq!(
        read(&root.join("escape")).trim(),
        "root:x:0:0:root:/root:/bin/sh"
    );
}
