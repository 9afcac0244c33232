//! Base images against the real test registries (`ci/setup.sh`: anonymous :5000, basic auth
//! :5001) and the fixtures of `ci/fixtures.sh` (busybox, debian bookworm minbase, a
//! multi-platform index), as root.

use std::io::{Read, Write};
use std::net::TcpStream as StdTcp;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_builder::base::{self, PullPolicy, Source};
use kiln_builder::cache::{BlobCache, LocalCache};
use kiln_builder::image::{ImageError, Platform};
use kiln_builder::layer::Limits;
use kiln_builder::registry::{Credentials, Registry, RegistryError, RegistryOptions};
use kiln_tests::{require_env, tree_listing};

fn store() -> (tempfile::TempDir, LocalCache) {
    let d = tempfile::tempdir().expect("tempdir");
    let c = LocalCache::open(d.path()).expect("open store");
    (d, c)
}

fn registry(opts: RegistryOptions) -> Registry {
    Registry::new(RegistryOptions {
        // Never read the machine's own ~/.docker/config.json.
        docker_config: Some("/nonexistent/kiln-test/config.json".into()),
        ..opts
    })
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn umoci_unpack(layout: &str, tag: &str, bundle: &Path) -> std::path::PathBuf {
    let out = Command::new("umoci")
        .args(["unpack", "--image", &format!("{layout}:{tag}")])
        .arg(bundle)
        .output()
        .expect("umoci (installed by ci/setup.sh)");
    assert!(
        out.status.success(),
        "umoci unpack: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bundle.join("rootfs")
}

/// The done-when test: pulling debian:bookworm fills the store, and unpacking it gives the
/// same tree as `umoci unpack` of the same image.
#[test]
fn debian_pull_unpack_matches_umoci() {
    let reference = require_env("KILN_TEST_DEBIAN_REF");
    let layout = require_env("KILN_TEST_DEBIAN_OCI");
    let (_d, cache) = store();
    let reg = registry(RegistryOptions::default());
    let rt = rt();
    let (digest, src) = rt
        .block_on(base::resolve(&reference, PullPolicy::Always, &reg, &cache))
        .expect("pull");
    assert!(
        matches!(src, Source::Registry { fetched: 2, .. }),
        "{src:?}"
    );
    let m = base::manifest(&cache, &digest).expect("manifest cached");
    for l in std::iter::once(&m.config).chain(&m.layers) {
        assert!(
            cache.blob_path(&l.digest).expect("ok").is_some(),
            "{} cached",
            l.digest
        );
    }
    // A second pull downloads nothing; a plain resolve finds the local tag first.
    let (d2, src2) = rt
        .block_on(base::resolve(&reference, PullPolicy::Always, &reg, &cache))
        .expect("pull again");
    assert_eq!(
        (d2, src2),
        (
            digest,
            Source::Registry {
                fetched: 0,
                bytes: 0
            }
        )
    );
    let (d3, src3) = rt
        .block_on(base::resolve(&reference, PullPolicy::Missing, &reg, &cache))
        .expect("resolve");
    assert_eq!((d3, src3), (digest, Source::Local));

    let work = tempfile::tempdir().expect("tempdir");
    let ours = work.path().join("kiln");
    let stats = base::unpack(&cache, &digest, &ours, &Limits::default()).expect("unpack");
    assert!(stats.entries > 1000, "{stats:?}");
    let theirs = umoci_unpack(&layout, "bookworm", &work.path().join("umoci"));
    let a = tree_listing(&ours);
    let b = tree_listing(&theirs);
    assert!(
        a.iter().any(|l| l.starts_with("usr/bin/dpkg f 755 0:0")),
        "sanity: dpkg present"
    );
    assert!(
        a.iter().any(|l| l.starts_with("dev/null c")),
        "sanity: device nodes present"
    );
    let only_a: Vec<_> = a.iter().filter(|l| !b.contains(l)).take(10).collect();
    let only_b: Vec<_> = b.iter().filter(|l| !a.contains(l)).take(10).collect();
    assert!(
        only_a.is_empty() && only_b.is_empty() && a.len() == b.len(),
        "trees differ ({} vs {} entries)\nonly kiln: {only_a:#?}\nonly umoci: {only_b:#?}",
        a.len(),
        b.len()
    );
}

#[test]
fn pull_by_tag_and_by_digest() {
    let reference = require_env("KILN_TEST_BUSYBOX_REF");
    let reg = registry(RegistryOptions::default());
    let rt = rt();
    let (_d1, c1) = store();
    let p = rt
        .block_on(reg.pull(&reference.parse().expect("ref"), &c1))
        .expect("pull by tag");
    let name = reference.rsplit_once(':').expect("has a tag").0;
    let pinned = format!("{name}@{}", p.digest);
    let (_d2, c2) = store();
    let q = rt
        .block_on(reg.pull(&pinned.parse().expect("ref"), &c2))
        .expect("pull by digest");
    assert_eq!(p.digest, q.digest);
    // A digest the registry does not hold.
    let missing = format!("{name}@sha256:{}", "0".repeat(64));
    match rt.block_on(reg.pull(&missing.parse().expect("ref"), &c2)) {
        Err(RegistryError::NotFound { .. }) => {}
        other => panic!("expected NotFound, got {other:?}"),
    }
    // Unpacked busybox has its applets as symlinks.
    let root = tempfile::tempdir().expect("tempdir");
    base::unpack(&c2, &q.digest, root.path(), &Limits::default()).expect("unpack");
    assert_eq!(
        std::fs::read_link(root.path().join("bin/sh"))
            .expect("sh")
            .as_os_str(),
        "busybox"
    );
    assert!(root.path().join("bin/busybox").is_file());
}

#[test]
fn auth_accepted_and_refused() {
    let host = require_env("KILN_TEST_REGISTRY_AUTH");
    let user = require_env("KILN_TEST_REGISTRY_USER");
    let password = require_env("KILN_TEST_REGISTRY_PASSWORD");
    let reference = format!("{host}/busybox:latest");
    let rt = rt();
    let good = Credentials {
        username: user.clone(),
        password: password.clone(),
    };
    let bad = Credentials {
        username: user.clone(),
        password: "wrong".into(),
    };
    let (_d, cache) = store();
    let with = |c: Option<Credentials>| {
        registry(RegistryOptions {
            credentials: c,
            ..Default::default()
        })
    };
    rt.block_on(with(Some(good.clone())).pull(&reference.parse().expect("ref"), &cache))
        .expect("correct credentials are accepted");
    for (what, creds) in [
        ("wrong password", Some(bad.clone())),
        ("no credentials", None),
    ] {
        let (_d, cache) = store();
        match rt.block_on(with(creds).pull(&reference.parse().expect("ref"), &cache)) {
            Err(RegistryError::Unauthorized { .. }) => {}
            other => panic!("{what}: expected Unauthorized, got {other:?}"),
        }
    }
    // Credentials from a Docker config file (auths with base64 auth), as `kiln login` writes.
    let cfgdir = tempfile::tempdir().expect("tempdir");
    let cfg = cfgdir.path().join("config.json");
    let reg = Registry::new(RegistryOptions {
        docker_config: Some(cfg.clone()),
        ..Default::default()
    });
    match rt.block_on(reg.check_login(&host, &bad)) {
        Err(RegistryError::Unauthorized { .. }) => {}
        other => panic!("login with a wrong password: {other:?}"),
    }
    rt.block_on(reg.check_login(&host, &good))
        .expect("login accepted");
    kiln_builder::registry::auth::store(&cfg, &host, &good).expect("store credentials");
    let (_d, cache) = store();
    rt.block_on(reg.pull(&reference.parse().expect("ref"), &cache))
        .expect("pull with credentials from the config file");
}

#[test]
fn platform_selection_from_index() {
    let reference = require_env("KILN_TEST_MULTI_REF");
    let amd = require_env("KILN_TEST_MULTI_AMD64_DIGEST");
    let arm = require_env("KILN_TEST_MULTI_ARM64_DIGEST");
    let rt = rt();
    let pick = |p: &str| {
        let reg = registry(RegistryOptions {
            platform: Platform::parse(p).expect("platform"),
            ..Default::default()
        });
        rt.block_on(reg.resolve(&reference.parse().expect("ref")))
    };
    let r = pick("linux/amd64").expect("amd64");
    assert_eq!(r.digest.to_string(), amd);
    assert!(r.index.is_some());
    assert_eq!(pick("linux/arm64").expect("arm64").digest.to_string(), arm);
    assert_eq!(
        pick("linux/arm64/v8").expect("arm64/v8").digest.to_string(),
        arm
    );
    match pick("linux/s390x") {
        Err(RegistryError::Image(ImageError::NoPlatform { .. })) => {}
        other => panic!("expected NoPlatform, got {other:?}"),
    }
}

/// A fault injector: a TCP proxy to the test registry that cuts the first `cuts` responses
/// after `after` bytes, and counts requests carrying a Range header.
struct CuttingProxy {
    port: u16,
    cuts_done: Arc<AtomicUsize>,
    range_requests: Arc<AtomicUsize>,
}

fn cutting_proxy(upstream: String, cuts: usize, after: usize) -> CuttingProxy {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let cuts_done = Arc::new(AtomicUsize::new(0));
    let range_requests = Arc::new(AtomicUsize::new(0));
    let (cd, rr) = (cuts_done.clone(), range_requests.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(client) = conn else { return };
            let Ok(up) = StdTcp::connect(&upstream) else {
                return;
            };
            let (cd, rr) = (cd.clone(), rr.clone());
            let (mut c_read, mut u_write) = (
                client.try_clone().expect("clone"),
                up.try_clone().expect("clone"),
            );
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 << 10];
                loop {
                    let n = match c_read.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if String::from_utf8_lossy(&buf[..n])
                        .to_ascii_lowercase()
                        .contains("\r\nrange: bytes=")
                    {
                        rr.fetch_add(1, Ordering::SeqCst);
                    }
                    if u_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = u_write.shutdown(std::net::Shutdown::Write);
            });
            let (mut u_read, mut c_write) = (up, client);
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 << 10];
                let mut sent = 0usize;
                loop {
                    let n = match u_read.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    sent += n;
                    if sent > after && cd.load(Ordering::SeqCst) < cuts {
                        cd.fetch_add(1, Ordering::SeqCst);
                        let _ = c_write.shutdown(std::net::Shutdown::Both);
                        let _ = u_read.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    if c_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c_write.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    CuttingProxy {
        port,
        cuts_done,
        range_requests,
    }
}

#[test]
fn resume_after_dropped_connection() {
    let upstream = require_env("KILN_TEST_REGISTRY");
    let direct = require_env("KILN_TEST_DEBIAN_REF");
    let rt = rt();
    let reg = registry(RegistryOptions {
        max_parallel: 1,
        ..Default::default()
    });
    let want = rt
        .block_on(reg.resolve(&direct.parse().expect("ref")))
        .expect("resolve directly")
        .digest;
    // Cut the debian layer's download (tens of MiB) twice, 2 MiB into a response.
    let proxy = cutting_proxy(upstream, 2, 2 << 20);
    let (_d, cache) = store();
    let via = format!("127.0.0.1:{}/debian:bookworm", proxy.port);
    let p = rt
        .block_on(reg.pull(&via.parse().expect("ref"), &cache))
        .expect("pull through the cutting proxy");
    assert_eq!(p.digest, want);
    assert_eq!(
        proxy.cuts_done.load(Ordering::SeqCst),
        2,
        "the proxy cut twice"
    );
    assert!(
        proxy.range_requests.load(Ordering::SeqCst) >= 2,
        "resumed with Range requests"
    );
    let m = base::manifest(&cache, &p.digest).expect("manifest");
    let total: u64 = std::iter::once(&m.config)
        .chain(&m.layers)
        .map(|d| d.size)
        .sum();
    assert!(
        p.fetched_bytes <= total + (64 << 10),
        "resumed, not restarted: {} of {total}",
        p.fetched_bytes
    );
    for l in &m.layers {
        let path = cache
            .blob_path(&l.digest)
            .expect("ok")
            .expect("layer cached");
        assert_eq!(
            kiln_store::BlobDigest(kiln_builder::cache::digest_of_file(&path).expect("hash")),
            l.digest
        );
    }
}

#[test]
fn offline_from_oci_layout_and_export() {
    let layout = require_env("KILN_TEST_BUSYBOX_OCI");
    let registry_host = require_env("KILN_TEST_REGISTRY");
    let rt = rt();
    let reg = registry(RegistryOptions::default());
    let (_d, cache) = store();
    // Offline: a reference that is not cached fails clearly.
    match rt.block_on(base::resolve(
        "127.0.0.1:5000/busybox:latest",
        PullPolicy::Never,
        &reg,
        &cache,
    )) {
        Err(e @ base::BaseError::NotCached { .. }) => assert!(
            e.to_string()
                .contains("pulled image 127.0.0.1:5000/busybox:latest"),
            "{e}"
        ),
        other => panic!("expected NotCached, got {other:?}"),
    }
    let spec = format!("oci:{layout}:latest");
    let (digest, src) = rt
        .block_on(base::resolve(&spec, PullPolicy::Never, &reg, &cache))
        .expect("import from the layout with no registry");
    assert_eq!(src, Source::Layout);
    let root = tempfile::tempdir().expect("tempdir");
    base::unpack(&cache, &digest, root.path(), &Limits::default()).expect("unpack");
    assert!(root.path().join("bin/busybox").is_file());
    // A missing tag in the layout is a clear error.
    match rt.block_on(base::resolve(
        &format!("oci:{layout}:nope"),
        PullPolicy::Never,
        &reg,
        &cache,
    )) {
        Err(base::BaseError::Layout(e)) => assert!(e.to_string().contains("nope"), "{e}"),
        other => panic!("expected a layout error, got {other:?}"),
    }
    // Export to a new layout that skopeo reads, then push it and pull it back by digest.
    let out = tempfile::tempdir().expect("tempdir");
    let dir = out.path().join("layout");
    kiln_builder::layout::export(&cache, &digest, &dir, "exported", Default::default())
        .expect("export");
    let inspect = Command::new("skopeo")
        .args(["inspect", &format!("oci:{}:exported", dir.display())])
        .output()
        .expect("skopeo (installed by ci/setup.sh)");
    assert!(
        inspect.status.success(),
        "skopeo inspect: {}",
        String::from_utf8_lossy(&inspect.stderr)
    );
    let (_d2, again) = store();
    let d2 = kiln_builder::layout::import(&dir, Some("exported"), &Platform::linux_amd64(), &again)
        .expect("re-import");
    assert_eq!(d2, digest);
    let dst = format!("{registry_host}/kiln-test/pushed:exported");
    let pushed = rt
        .block_on(reg.push(
            &cache,
            &digest,
            &dst.parse().expect("ref"),
            Default::default(),
        ))
        .expect("push");
    assert_eq!(pushed, digest);
    let (_d3, back) = store();
    let name = dst.rsplit_once(':').expect("tag").0;
    let p = rt
        .block_on(reg.pull(&format!("{name}@{digest}").parse().expect("ref"), &back))
        .expect("pull back by digest");
    assert_eq!(
        p.digest, digest,
        "raw manifest bytes kept their digest through push"
    );
}

/// The kiln store is the blob cache: a local store on the cache directory sees pulled blobs,
/// and an image published to the S3 store (moto) is unpacked on an empty cache by digest,
/// without the registry.
#[test]
fn store_as_shared_blob_cache() {
    let reference = require_env("KILN_TEST_BUSYBOX_REF");
    let bucket = require_env("KILN_TEST_S3_BUCKET");
    require_env("KILN_TEST_S3_ENDPOINT");
    let rt = rt();
    let reg = registry(RegistryOptions::default());
    let (dir, cache) = store();
    let p = rt
        .block_on(reg.pull(&reference.parse().expect("ref"), &cache))
        .expect("pull");
    let m = base::manifest(&cache, &p.digest).expect("manifest");
    let local = rt
        .block_on(kiln_store::Store::open(dir.path().to_str().expect("utf8")))
        .expect("open the same directory as a kiln store");
    for d in [&p.digest, &m.config.digest, &m.layers[0].digest] {
        let bd: kiln_store::BlobDigest = *d;
        rt.block_on(local.get_blob(&bd))
            .expect("the store reads the pulled blob, verified");
    }
    let prefix = format!(
        "s3://{bucket}/kiln-test-base-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos()
    );
    let s3 = rt
        .block_on(kiln_store::Store::open(&prefix))
        .expect("open S3 store");
    let uploaded = rt
        .block_on(kiln_builder::remote::publish(&cache, &p.digest, &s3))
        .expect("publish");
    assert_eq!(uploaded, 2 + m.layers.len());
    assert_eq!(
        rt.block_on(kiln_builder::remote::publish(&cache, &p.digest, &s3))
            .expect("again"),
        0,
        "put-if-absent: nothing uploaded twice"
    );
    let (_d2, empty) = store();
    let fetched = rt
        .block_on(kiln_builder::remote::materialize(&s3, &p.digest, &empty))
        .expect("materialize");
    assert_eq!(fetched, 1 + m.layers.len());
    let name = reference.rsplit_once(':').expect("tag").0;
    let (d, src) = rt
        .block_on(base::resolve(
            &format!("{name}@{}", p.digest),
            PullPolicy::Never,
            &reg,
            &empty,
        ))
        .expect("offline resolve by digest after materialize");
    assert_eq!((d, src), (p.digest, Source::Local));
    let root = tempfile::tempdir().expect("tempdir");
    base::unpack(&empty, &d, root.path(), &Limits::default()).expect("unpack");
    assert!(root.path().join("bin/busybox").is_file());
}

/// Two pulls of one image into one store at once: each blob is downloaded once (the second
/// waits for the first's partial file, then finds the blob committed).
#[test]
fn concurrent_pulls_download_once() {
    let reference = require_env("KILN_TEST_DEBIAN_REF");
    let rt = rt();
    let reg = registry(RegistryOptions::default());
    let (_d, cache) = store();
    let r: kiln_builder::reference::Reference = reference.parse().expect("ref");
    let (a, b) = rt.block_on(async { tokio::join!(reg.pull(&r, &cache), reg.pull(&r, &cache)) });
    let (a, b) = (a.expect("first pull"), b.expect("second pull"));
    assert_eq!(a.digest, b.digest);
    let m = base::manifest(&cache, &a.digest).expect("manifest");
    let total: u64 = std::iter::once(&m.config)
        .chain(&m.layers)
        .map(|d| d.size)
        .sum();
    assert_eq!(
        a.fetched_bytes + b.fetched_bytes,
        total,
        "every blob downloaded once"
    );
}

/// Regression (newcomer review, 2026-11-30): `kiln store gc` on the local store collected the
/// blobs of an image `kiln pull` had just stored, because the OCI reference under `refs/oci/`
/// was not a GC root. The pulled image must survive a GC with no grace period, while a real
/// orphan is still collected.
#[test]
fn store_gc_keeps_pulled_images() {
    let reference = require_env("KILN_TEST_BUSYBOX_REF");
    let reg = registry(RegistryOptions::default());
    let rt = rt();
    let (dir, cache) = store();
    rt.block_on(reg.pull(&reference.parse().expect("ref"), &cache))
        .expect("pull");
    let blobs = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d.join("blobs/sha256"))
            .expect("blobs dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let pulled = blobs(dir.path());
    assert!(
        pulled.len() >= 3,
        "manifest, config and a layer: {pulled:?}"
    );
    let report = rt.block_on(async {
        let store = kiln_store::Store::open(dir.path().to_str().expect("utf-8 path"))
            .await
            .expect("open store");
        let orphan = store
            .put_blob(bytes::Bytes::from_static(b"nothing refers to this"))
            .await
            .expect("put orphan");
        let opts = kiln_store::gc::GcOptions {
            grace: std::time::Duration::ZERO,
            ..kiln_store::gc::GcOptions::default()
        };
        let report = store.gc(&opts).await.expect("gc");
        (report, orphan)
    });
    let (report, orphan) = report;
    assert_eq!(
        blobs(dir.path()),
        pulled,
        "gc removed pulled blobs: {report:?}"
    );
    assert!(
        !dir.path()
            .join("blobs/sha256")
            .join(orphan.digest.hex())
            .exists(),
        "the orphan survived: {report:?}"
    );
}

/// FROM looks first among the store's own tags (a kiln image whose manifest has an OCI
/// manifest), then at pulled images, then at the registry; `--pull` always asks the registry;
/// `--offline` names what it looked for.
#[test]
fn from_looks_at_store_tags_then_pulled_images_then_the_registry() {
    let reference = require_env("KILN_TEST_BUSYBOX_REF");
    let multi_layout = require_env("KILN_TEST_BUSYBOX_OCI");
    let rt = rt();
    let reg = registry(RegistryOptions::default());
    let (dir, cache) = store();
    // The busybox image from its layout (no registry), then a kiln image tagged `mybase:v1`
    // in the same store whose OCI manifest is that image.
    let (busybox, _) = rt
        .block_on(base::resolve(
            &format!("oci:{multi_layout}:latest"),
            PullPolicy::Never,
            &reg,
            &cache,
        ))
        .expect("import");
    let size = std::fs::metadata(cache.blob_path(&busybox).expect("ok").expect("cached"))
        .expect("stat")
        .len();
    rt.block_on(async {
        let store = kiln_store::Store::open(dir.path().to_str().expect("utf8"))
            .await
            .expect("store");
        let (table, _) = store
            .put_artifact_reader(
                std::io::Cursor::new(vec![1u8; 10_000]),
                &kiln_store::artifact::PutArtifactOptions::default(),
            )
            .await
            .expect("artifact");
        let mut m = kiln_store::ImageManifest::new(table);
        m.oci_manifest = Some(kiln_store::BlobRef {
            digest: busybox,
            size,
            media_type: Some("application/vnd.oci.image.manifest.v1+json".into()),
        });
        let raw = store
            .put_manifest(&kiln_store::Manifest::Image(m))
            .await
            .expect("manifest");
        for t in ["mybase:v1", "mybase:latest"] {
            store
                .set_tag(&t.parse().expect("tag"), None, raw.digest)
                .await
                .expect("tag");
        }
    });
    for (spec, policy) in [
        ("mybase:v1", PullPolicy::Missing),
        ("mybase:v1", PullPolicy::Never),
        ("mybase", PullPolicy::Never),
    ] {
        let (d, src) = rt
            .block_on(base::resolve(spec, policy, &reg, &cache))
            .unwrap_or_else(|e| panic!("{spec} {policy:?}: {e}"));
        assert_eq!((d, src), (busybox, Source::Local), "{spec}");
    }
    assert_eq!(
        base::lookup("mybase:v1", &cache).expect("lookup"),
        Some(busybox)
    );
    let err = rt
        .block_on(base::resolve("mybase:v2", PullPolicy::Never, &reg, &cache))
        .expect_err("not cached");
    let msg = err.to_string();
    assert!(
        msg.contains("store tag mybase:v2")
            && msg.contains("pulled image docker.io/library/mybase:v2")
            && msg.contains("--offline"),
        "{msg}"
    );
    // A pulled reference pointing at another image: used as is without --pull; --pull asks
    // the registry, gets its busybox and moves the reference.
    let other = {
        let amd64 = require_env("KILN_TEST_MULTI_AMD64_DIGEST");
        let (d, _) = rt
            .block_on(base::resolve(
                &format!(
                    "{}@{amd64}",
                    require_env("KILN_TEST_MULTI_REF")
                        .rsplit_once(':')
                        .expect("tag")
                        .0
                ),
                PullPolicy::Missing,
                &reg,
                &cache,
            ))
            .expect("pull multi amd64");
        d
    };
    let r: kiln_builder::reference::Reference = reference.parse().expect("ref");
    let name = format!("{}:{}", r.name(), r.tag().expect("tag"));
    cache.set_ref(&name, &other).expect("set ref");
    let (d, src) = rt
        .block_on(base::resolve(&reference, PullPolicy::Missing, &reg, &cache))
        .expect("local");
    assert_eq!((d, src), (other, Source::Local));
    let (d, src) = rt
        .block_on(base::resolve(&reference, PullPolicy::Always, &reg, &cache))
        .expect("--pull");
    assert!(matches!(src, Source::Registry { .. }), "{src:?}");
    assert_eq!(d, busybox, "the registry's busybox is the fixture's");
    assert_eq!(cache.get_ref(&name).expect("ref"), Some(busybox));
    // A locally found image with a missing layer: --offline names the blob; without it the
    // registry fills the gap.
    let m = base::manifest(&cache, &busybox).expect("manifest");
    let layer = &m.layers[0].digest;
    std::fs::remove_file(cache.blob_path(layer).expect("ok").expect("cached")).expect("rm");
    let err = rt
        .block_on(base::resolve(&reference, PullPolicy::Never, &reg, &cache))
        .expect_err("incomplete");
    assert!(err.to_string().contains(&layer.to_string()), "{err}");
    rt.block_on(base::resolve(&reference, PullPolicy::Missing, &reg, &cache))
        .expect("re-pull");
    assert!(cache.blob_path(layer).expect("ok").is_some());
}

/// Issue 44 §2: a registry layer holding a file of 256 MiB of zeros (gzip makes it about
/// 250 KiB, a ratio past 1,000) is pushed to the test registry, pulled into an empty store
/// and applies under the default bounds: no ratio bound refuses it. The image is made with
/// umoci (an empty image, then `umoci insert` of the file) and pushed by kiln.
#[test]
fn registry_layer_of_zeros_applies() {
    let registry_host = require_env("KILN_TEST_REGISTRY");
    let rt = rt();
    let reg = registry(RegistryOptions::default());
    let d = tempfile::tempdir().expect("tempdir");
    let layout = d.path().join("layout");
    let src = d.path().join("big");
    {
        // Real zeros, not a hole: what `dd if=/dev/zero` writes.
        let mut f = std::fs::File::create(&src).expect("create");
        let mib = vec![0u8; 1 << 20];
        for _ in 0..256 {
            f.write_all(&mib).expect("write");
        }
    }
    let image = format!("{}:zeros", layout.display());
    for args in [
        vec!["init", "--layout", layout.to_str().expect("utf-8")],
        vec!["new", "--image", &image],
        vec![
            "insert",
            "--image",
            &image,
            src.to_str().expect("utf-8"),
            "/big",
        ],
    ] {
        let out = Command::new("umoci")
            .args(&args)
            .output()
            .expect("umoci (installed by ci/setup.sh)");
        assert!(
            out.status.success(),
            "umoci {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (_d1, cache) = store();
    let (digest, _) = rt
        .block_on(base::resolve(
            &format!("oci:{}:zeros", layout.display()),
            PullPolicy::Never,
            &reg,
            &cache,
        ))
        .expect("import the layout");
    let m = base::manifest(&cache, &digest).expect("manifest");
    let compressed: u64 = m.layers.iter().map(|l| l.size).sum();
    assert!(compressed < 8 << 20, "layers are {compressed} bytes");
    let dst = format!("{registry_host}/kiln-test/zeros:256m");
    rt.block_on(reg.push(
        &cache,
        &digest,
        &dst.parse().expect("ref"),
        Default::default(),
    ))
    .expect("push");
    let (_d2, fresh) = store();
    let (pulled, src) = rt
        .block_on(base::resolve(&dst, PullPolicy::Always, &reg, &fresh))
        .expect("pull");
    assert_eq!(pulled, digest);
    assert!(matches!(src, Source::Registry { .. }), "{src:?}");
    let root = tempfile::tempdir().expect("tempdir");
    let stats =
        base::unpack(&fresh, &pulled, root.path(), &Limits::default()).expect("apply the layer");
    assert!(stats.bytes > 256 << 20, "{stats:?}");
    let big = root.path().join("big");
    assert_eq!(std::fs::metadata(&big).expect("big").len(), 256 << 20);
    let mut data = Vec::new();
    std::fs::File::open(&big)
        .expect("open")
        .read_to_end(&mut data)
        .expect("read");
    assert!(data.iter().all(|&b| b == 0), "the file holds zeros");
}
