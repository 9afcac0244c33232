//! `kiln images`, `kiln inspect` and `kiln rmi` through the binary, on image manifests made
//! directly with kiln-store (as `kiln build` will publish them): a real ext4 file from
//! `mke2fs` chunked into the store, an OCI config blob, the file system, sandbox and
//! provenance fields; tag times from the tag history.

use std::path::Path;
use std::process::{Command, Output};

use kiln_store::artifact::PutArtifactOptions;
use kiln_store::manifest::{
    Filesystem, ImageManifest, Manifest, ReadySpec, SandboxSpec, StartSpec,
};
use kiln_store::{ManifestDigest, Store, TagRef};
use serde_json::Value;

fn kiln(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_STORE", store)
        .env_remove("KILN_CONFIG")
        .env("XDG_CONFIG_HOME", store.join("no-config"))
        .output()
        .unwrap()
}

fn events(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "{o:?}");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

/// A 32 MiB ext4 image holding a few files, made by e2fsprogs.
fn ext4(dir: &Path, marker: &str) -> std::path::PathBuf {
    let root = dir.join(format!("root-{marker}"));
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/marker"), marker).unwrap();
    std::fs::write(root.join("data"), vec![0x5a; 300_000]).unwrap();
    let img = dir.join(format!("{marker}.ext4"));
    let o = Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d"])
        .arg(&root)
        .arg(&img)
        .arg("32M")
        .output()
        .expect("mke2fs (e2fsprogs; ci/setup.sh installs it)");
    assert!(o.status.success(), "{o:?}");
    img
}

/// Publishes `img` as a full image manifest (chunks, config blob, manifest) and tags it.
async fn publish(store: &Store, img: &Path, tag: &str) -> ManifestDigest {
    let (table, _) = store
        .put_artifact(img, &PutArtifactOptions::default())
        .await
        .unwrap();
    let config = br#"{"architecture":"amd64","os":"linux","config":{"User":"runtime","WorkingDir":"/workspace","Env":["HOME=/workspace","LANG=C.UTF-8"],"Cmd":["bash"]},"history":[{"created_by":"kiln bootstrap debian bookworm minbase"}]}"#;
    let mut m = ImageManifest::new(table);
    m.oci_config = Some(store.put_blob(config.to_vec().into()).await.unwrap());
    m.recipe_digest = Some(format!("sha256:{}", "7".repeat(64)));
    m.provenance.insert("kiln.version".into(), "0.1.0".into());
    m.provenance.insert(
        "base.0".into(),
        format!("kiln-bootstrap/debian@sha256:{}", "b".repeat(64)),
    );
    m.filesystem = Some(Filesystem {
        kind: "ext4".into(),
        block_size: 4096,
        features: vec!["has_journal".into(), "extent".into()],
        uuid: "d3f1a6b4-0000-4000-8000-000000000001".into(),
        tool: [("mke2fs".to_string(), "1.47.2".to_string())].into(),
    });
    m.sandbox = Some(SandboxSpec {
        start: Some(StartSpec {
            argv: vec!["/usr/sbin/chronyd".into(), "-d".into()],
            user: Some("root".into()),
            env: vec![],
            workdir: Some("/".into()),
        }),
        ready: Some(ReadySpec {
            argv: vec!["true".into()],
            interval_ms: 500,
            timeout_ms: 1000,
            retries: 3,
        }),
    });
    let raw = store.put_manifest(&Manifest::Image(m)).await.unwrap();
    let t: TagRef = tag.parse().unwrap();
    store.force_tag(&t, raw.digest).await.unwrap();
    raw.digest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_inspect_rmi() {
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("store");
    let store = Store::open(s.to_str().unwrap()).await.unwrap();
    let a = publish(&store, &ext4(dir.path(), "a"), "base:bookworm").await;
    let b = publish(&store, &ext4(dir.path(), "b"), "app:v1").await;
    store
        .force_tag(&"app:latest".parse().unwrap(), b)
        .await
        .unwrap();

    // images: one line per tag, sorted, with the manifest's disk size and the tag's time.
    let ev = events(&kiln(&s, &["--json", "images"]));
    let names: Vec<String> = ev
        .iter()
        .map(|e| {
            format!(
                "{}:{}",
                e["name"].as_str().unwrap(),
                e["tag"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(names, ["app:latest", "app:v1", "base:bookworm"]);
    assert_eq!(ev[2]["manifest"], a.to_string());
    assert_eq!(ev[2]["size"], 32 << 20);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let created = ev[2]["created"].as_u64().unwrap();
    assert!(created <= now && created + 3600 > now, "{created} vs {now}");
    let ev = events(&kiln(&s, &["--json", "images", "base"]));
    assert_eq!(ev.len(), 1);
    let text = String::from_utf8(kiln(&s, &["images"]).stdout).unwrap();
    assert!(text.lines().next().unwrap().starts_with("NAME"), "{text}");
    assert!(
        text.contains(&format!("sha256:{}", &a.hex()[..12])),
        "{text}"
    );

    // inspect: JSON fields, by tag and by digest; --fsck really checks the ext4 image.
    let ev = events(&kiln(&s, &["--json", "inspect", "app:v1", "--fsck"]));
    let i = &ev[0];
    assert_eq!(i["manifest"], b.to_string());
    assert_eq!(i["tags"].as_array().unwrap().len(), 2);
    assert_eq!(i["chunkTable"]["size"], 32 << 20);
    let chunks = i["chunkTable"]["chunks"].as_u64().unwrap();
    assert!(
        chunks >= 1 && i["chunkTable"]["holes"].as_u64().unwrap() >= 1,
        "{i}"
    );
    assert_eq!(i["filesystem"]["blockSize"], 4096);
    assert_eq!(i["sandbox"]["start"]["argv"][0], "/usr/sbin/chronyd");
    assert_eq!(i["config"]["User"], "runtime");
    assert_eq!(i["provenance"]["kiln.version"], "0.1.0");
    assert_eq!(i["recipeDigest"], format!("sha256:{}", "7".repeat(64)));
    assert_eq!(i["fsck"]["clean"], true, "{i}");
    let ev = events(&kiln(
        &s,
        &["--json", "inspect", &a.to_string(), "--chunks"],
    ));
    assert_eq!(ev[0]["tags"][0]["tag"], "base:bookworm");
    let entries: Vec<_> = ev.iter().filter(|e| e["event"] == "chunk").collect();
    assert_eq!(
        entries.len() as u64,
        ev[0]["chunkTable"]["entries"].as_u64().unwrap()
    );
    let text = String::from_utf8(kiln(&s, &["inspect", "app"]).stdout).unwrap();
    for want in [
        "manifest",
        "chunks",
        "filesystem   ext4, 4096-byte blocks",
        "start",
        "ready",
        "kiln.version",
        "  User",
    ] {
        assert!(text.contains(want), "{want:?} missing in:\n{text}");
    }

    // A damaged image: --fsck reports it with exit code 3.
    let bad = dir.path().join("bad.ext4");
    std::fs::copy(dir.path().join("a.ext4"), &bad).unwrap();
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&bad).unwrap();
        // The primary superblock's magic (offset 1024 + 0x38).
        f.seek(SeekFrom::Start(1024 + 0x38)).unwrap();
        f.write_all(&[0, 0]).unwrap();
    }
    publish(&store, &bad, "bad:v1").await;
    let o = kiln(&s, &["inspect", "bad:v1", "--fsck"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");

    // Errors: unknown tag (5), a truncated digest (1, one line), a snapshot-free store.
    let o = kiln(&s, &["inspect", "nope:v1"]);
    assert_eq!(o.status.code(), Some(5));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("kiln: tag nope:v1 not found"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(kiln(&s, &["inspect", "sha256:83bb"]).status.code(), Some(2));

    // rmi: a tag, then a digest (every tag naming it); data stays for gc.
    let ev = events(&kiln(&s, &["--json", "rmi", "base:bookworm"]));
    assert_eq!(ev[0]["manifest"], a.to_string());
    assert!(
        store.get_manifest(&a).await.is_ok(),
        "rmi leaves the data to gc"
    );
    let ev = events(&kiln(&s, &["--json", "rmi", &b.to_string()]));
    assert_eq!(ev.len(), 2);
    let ev = events(&kiln(&s, &["--json", "images"]));
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(kiln(&s, &["rmi", "app:v1"]).status.code(), Some(5));
    assert_eq!(kiln(&s, &["rmi", &b.to_string()]).status.code(), Some(5));
    assert_eq!(kiln(&s, &["rmi"]).status.code(), Some(2));
}

/// The same commands on an S3 store (moto, from `ci/setup.sh`): the configured cache
/// directory (`KILN_CACHE`) receives the chunks `inspect --fsck` reads, and `rmi` untags there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_inspect_rmi_on_s3_through_the_read_cache() {
    let bucket = std::env::var("KILN_TEST_S3_BUCKET").unwrap_or_else(|_| {
        panic!("KILN_TEST_S3_BUCKET is not set: run ci/setup.sh and source /var/cache/kiln-ci/env")
    });
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let url = format!("s3://{bucket}/cli-images-{}-{nanos}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&url).await.unwrap();
    let d = publish(&store, &ext4(dir.path(), "s3"), "remote:v1").await;
    let cache = dir.path().join("cache");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .env("KILN_STORE", &url)
            .env("KILN_CACHE", &cache)
            .env("XDG_CONFIG_HOME", dir.path().join("no-config"))
            .env_remove("KILN_CONFIG")
            .output()
            .unwrap()
    };
    let ev = events(&run(&["--json", "images"]));
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0]["manifest"], d.to_string());
    let ev = events(&run(&["--json", "inspect", "remote:v1", "--fsck"]));
    assert_eq!(ev[0]["fsck"]["clean"], true, "{}", ev[0]);
    let cached = std::fs::read_dir(cache.join("chunks")).unwrap().count() as u64;
    assert!(
        cached >= ev[0]["chunkTable"]["distinctChunks"].as_u64().unwrap(),
        "{cached} chunks in the read cache"
    );
    events(&run(&["--json", "rmi", "remote:v1"]));
    assert!(
        store
            .get_tag(&"remote:v1".parse().unwrap())
            .await
            .unwrap()
            .is_none()
    );
}
