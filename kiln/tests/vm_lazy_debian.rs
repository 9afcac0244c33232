//! A lazy clone of a Debian-based image from S3 (issue 35, "Tests"): the Debian fixture (the
//! `debootstrap --variant=minbase` tree setup makes, not the full sandbox image) as a
//! 512 MiB image is snapshotted with a 256 MiB guest into a local store and pushed to the
//! real S3 server (moto); `kiln start` from S3 with empty caches answers and runs a command
//! of Debian's userland (`dpkg-query`, `cat /etc/debian_version`) through the chunk server,
//! having fetched a strict subset of the snapshot's chunks and materialized nothing. The
//! busybox case, with the faults and the lease, is `vm_lazy.rs`.
//! Needs what `ci/setup.sh` exports (`KILN_TEST_DEBIAN_OCI`, the guest kernel, the S3
//! server's `AWS_*` and `KILN_TEST_S3_*`).

use std::collections::HashSet;
use std::path::Path;
use std::process::Output;

use kiln_store::{Store, TagRef};
use kiln_tests::stores::{Kind, fresh_url};
use kiln_tests::vm::{StopClones, cached_oci_image, kiln_in, show, sleeping_sandbox, started_id};

/// `kiln` of this test's directory `d` ([`kiln_in`]) on `store`, with its snapshot and
/// chunk caches under `cache` (a fresh one holds nothing of any snapshot).
fn kiln(d: &Path, store: &str, cache: &Path, args: &[&str]) -> Output {
    kiln_in(env!("CARGO_BIN_EXE_kiln"), d)
        .env("KILN_STORE", store)
        .env("KILN_SNAPSHOT_CACHE", cache)
        .env("KILN_CACHE", cache.join("kcache"))
        .args(args)
        .output()
        .expect("run kiln")
}

#[test]
fn a_debian_image_starts_lazily_from_s3_and_runs_a_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let _stop = StopClones::new(env!("CARGO_BIN_EXE_kiln"), d);
    let local = d.join("store").to_str().expect("utf-8").to_string();
    let s3 = fresh_url(Kind::S3, d, "lazy-debian");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let root = rt.block_on(async {
        let store = Store::open(&local).await.expect("store");
        let tag: TagRef = "deb:latest".parse().expect("tag");
        cached_oci_image(
            &store,
            d,
            "KILN_TEST_DEBIAN_OCI",
            "bookworm",
            512,
            &tag,
            sleeping_sandbox(),
        )
        .await
    });
    // The fixture's own answer, read on the host from the tree the image was made of.
    let version = std::fs::read_to_string(root.join("etc/debian_version"))
        .expect("the fixture's /etc/debian_version");

    let c0 = d.join("cache0");
    let o = kiln(
        d,
        &local,
        &c0,
        &[
            "snapshot",
            "deb:latest",
            "-t",
            "deb:snap",
            "--memory-mib",
            "256",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    let o = kiln(d, &local, &c0, &["store", "push", "deb:snap", "--to", &s3]);
    assert!(o.status.success(), "{}", show(&o));

    let (snap_digest, snap) = rt.block_on(async {
        let s = Store::open(&s3).await.expect("s3 store");
        kiln_tests::lazy::snapshot_of(&s, &"deb:snap".parse().expect("tag")).await
    });
    let chunks = [&snap.memory, &snap.disk]
        .iter()
        .map(|t| t.entries.iter().filter(|e| e.digest.is_some()).count())
        .sum::<usize>();

    // Cold from S3: new caches, nothing of the snapshot on this host.
    let c1 = d.join("cache1");
    let o = kiln(d, &s3, &c1, &["--json", "start", "deb:snap"]);
    assert!(o.status.success(), "{}", show(&o));
    let id = started_id(&o);
    let o = kiln(
        d,
        &s3,
        &c1,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "cat /etc/debian_version && dpkg-query -W -f '${Package}\\n' dpkg",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        format!("{version}dpkg\n"),
        "{}",
        show(&o)
    );
    let snapdir = c1.join(snap_digest.hex());
    assert!(
        !snapdir.join("memory").exists() && !snapdir.join("disk.raw").exists(),
        "nothing materialized"
    );
    let served: HashSet<(String, usize)> = kiln_tests::lazy::served_chunks(&snapdir)
        .into_iter()
        .map(|(file, i, _)| (file, i))
        .collect();
    assert!(!served.is_empty(), "the chunk server served the clone");
    assert!(
        served.len() < chunks,
        "a strict subset of the snapshot's chunks: {} of {chunks}",
        served.len()
    );
    // The figures for this image, printed (its goals are benchmarks:
    // `ci/bench-clone.sh --image debian`).
    for f in kiln_tests::lazy::fetched(&snapdir, &snap) {
        eprintln!(
            "lazy Debian start from S3, {}: served {:.2}% of {} bytes, {:.2}% of its non-zero \
             bytes",
            f.file,
            kiln_tests::lazy::Fetched::pct(f.served, f.size),
            f.size,
            kiln_tests::lazy::Fetched::pct(f.served, f.nonzero)
        );
    }
}
