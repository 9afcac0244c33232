//! Real boots under QEMU (TCG on this kind of host; the accelerator probe decides): a small
//! busybox image with the guest init boots once, reaches READY and is snapshotted into a
//! local store; three clones wake from it with distinct machine ids and random bytes; a ready
//! check that never succeeds fails with its timeout; a corrupted vmstate is caught before
//! QEMU starts; a host whose key differs is refused and the snapshot is kept.
//!
//! Needs `KILN_TEST_BUSYBOX_OCI`, and `KILN_TEST_KERNEL`/`KILN_TEST_INITRAMFS` (else
//! `KILN_TEST_CACHE` to build them), exported by `ci/setup.sh`, and `qemu-system-x86_64`,
//! `qemu-img`, `umoci`, `mke2fs` on PATH.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln_store::{
    Manifest, ObjectRef, ReadySpec, SandboxSpec, StartSpec, Store, StoreError, TagRef,
};
use kiln_tests::vm::{StopClones, busybox_image, guest_assets, oci_image, sh};
use kiln_vmm::clone::{self, CloneError, CloneOptions, Serving};
use kiln_vmm::launch::Accel;
use kiln_vmm::snapshot::{SnapshotError, SnapshotOptions, snapshot_image};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn snap_opts(work: &Path) -> SnapshotOptions {
    SnapshotOptions {
        memory_bytes: 256 << 20,
        boot_timeout: Duration::from_secs(180),
        ready_timeout: Duration::from_secs(180),
        work_dir: work.to_path_buf(),
        ..Default::default()
    }
}

struct Env {
    _dir: tempfile::TempDir,
    work: PathBuf,
    store_dir: PathBuf,
    store: Store,
}

async fn env() -> Env {
    kiln_pipeline::qemu_cgroups::install();
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&work).expect("work");
    let store = Store::open(store_dir.to_str().expect("utf-8"))
        .await
        .expect("store");
    Env {
        work,
        store_dir,
        store,
        _dir: dir,
    }
}

/// A start command that writes `/tmp/started` (the ready check's mark), keeps the vCPU busy
/// for 1 s more (guest uptime, centiseconds; `${c#0}` keeps `.09` from reading as octal),
/// writes a random UUID to `/tmp/settled` and sleeps.
const BUSY_AFTER_READY: &str = "echo up > /tmp/started; read u _ < /proc/uptime; c=${u#*.}; \
     end=$(( ${u%.*} * 100 + ${c#0} + 100 )); \
     while read u _ < /proc/uptime; c=${u#*.}; [ $(( ${u%.*} * 100 + ${c#0} )) -lt $end ]; \
     do :; done; cat /proc/sys/kernel/random/uuid > /tmp/settled; exec sleep 1000000";

#[test]
fn vm_boot_once_snapshot_and_three_clones() {
    rt().block_on(async {
        let e = env().await;
        let tag: TagRef = "bb:latest".parse().expect("tag");
        let snap_tag: TagRef = "bb:snap".parse().expect("tag");
        busybox_image(
            &e.store,
            &e.work,
            &tag,
            SandboxSpec {
                start: Some(StartSpec {
                    // Still busy for 1 s after the ready check can pass (guest uptime, in
                    // centiseconds): the snapshot must wait for it (kiln-guest-init's idle
                    // wait), or every clone finishes it after its restore.
                    argv: sh(BUSY_AFTER_READY),
                    user: None,
                    env: vec!["FROM_IMAGE=1".into()],
                    workdir: Some("/".into()),
                }),
                ready: Some(ReadySpec {
                    argv: sh("test -f /tmp/started"),
                    interval_ms: 100,
                    timeout_ms: 2000,
                    retries: 100,
                }),
            },
        )
        .await;

        // Boot once → READY → snapshot stored and attached under the new tag.
        let r = snapshot_image(
            &e.store,
            &tag,
            &snap_tag,
            &guest_assets(),
            &snap_opts(&e.work),
        )
        .await
        .expect("boot once and snapshot");
        let Manifest::Image(img) = e
            .store
            .get_manifest(&e.store.resolve_tag(&snap_tag).await.expect("snap tag"))
            .await
            .expect("image manifest")
        else {
            panic!("not an image")
        };
        assert_eq!(img.snapshot, Some(r.snapshot));
        let Manifest::Snapshot(s) = e.store.get_manifest(&r.snapshot).await.expect("snapshot")
        else {
            panic!("not a snapshot")
        };
        assert_eq!(s.memory.size, 256 << 20);
        assert_eq!(s.memory_bytes, 256 << 20);
        assert_eq!(s.compatibility_key, r.key.render());
        assert!(
            r.memory_stored_bytes < r.memory_bytes,
            "stored {} of {} memory bytes",
            r.memory_stored_bytes,
            r.memory_bytes
        );
        for o in [
            ObjectRef::Blob(s.vmstate.digest),
            ObjectRef::Blob(s.kernel.digest),
            ObjectRef::Blob(s.initramfs.digest),
        ] {
            assert!(e.store.has(&o).await.expect("head"), "{o} missing");
        }

        // Three clones: each answers restore with its own machine id and random bytes.
        let state = e.work.join("state");
        let cache = e.work.join("cache");
        let _stop = StopClones::library(&e.work, &state);
        let mut opts = CloneOptions::new(state.clone(), cache.clone(), Serving::Materialized);
        opts.count = 3;
        opts.env = vec!["CLONE_ENV=yes".into()];
        opts.restore_timeout = Duration::from_secs(120);
        let clones = clone::start_clones(&e.store, &snap_tag, &opts)
            .await
            .expect("start 3 clones");
        assert_eq!(clones.len(), 3);
        let distinct = |f: fn(&clone::CloneRecord) -> &str| {
            let mut v: Vec<&str> = clones.iter().map(f).collect();
            v.sort();
            v.dedup();
            v.len()
        };
        // The start command's work after the check was done before the snapshot: every
        // clone has the same mark, a random UUID drawn at its end. Drawn after a clone's
        // restore (the snapshot saved while the command was busy), it would differ from
        // clone to clone: each reseeds its random pool before it answers, long before the
        // command's remaining busy time is up.
        let mut marks = Vec::new();
        for c in &clones {
            let mut out = Vec::new();
            let status = kiln_vmm::exec::exec(
                &state,
                &c.id,
                &kiln_vmm::exec::ExecRequest {
                    argv: vec!["cat".into(), "/tmp/settled".into()],
                    ..Default::default()
                },
                |_, data| out.extend_from_slice(data),
            )
            .await
            .expect("exec in a clone");
            assert_eq!(status.code, Some(0), "clone {}: no /tmp/settled", c.id);
            marks.push(String::from_utf8_lossy(&out).trim().to_string());
        }
        assert!(
            marks.iter().all(|m| m.len() == 36 && *m == marks[0]),
            "the start command's work ran after the restore in each clone (snapshot saved \
             while it was busy; the guest waited {:?} for idle): {marks:?}",
            r.settle
        );
        assert!(
            r.settle > Duration::ZERO && r.settle < Duration::from_secs(5),
            "{:?}",
            r.settle
        );
        assert_eq!(distinct(|c| &c.machine_id), 3, "{clones:#?}");
        assert_eq!(distinct(|c| &c.random), 3, "{clones:#?}");
        assert!(
            clones.iter().all(|c| c.machine_id.len() == 32),
            "{clones:#?}"
        );
        assert!(clones.iter().all(|c| c.random.len() == 32), "{clones:#?}");
        let listed = clone::list(&state).expect("ps");
        assert_eq!(listed.len(), 3);
        assert!(listed.iter().all(|c| c.running()), "{listed:#?}");
        // The saved memory file is read-only and the running clones never wrote it: its
        // chunks still hash to the snapshot's table (root ignores the mode; this does not).
        let mem = cache.join(r.snapshot.hex()).join("memory");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&mem).expect("memory file").permissions(),
        );
        assert_eq!(mode & 0o222, 0, "memory file mode {mode:o}");
        let bytes = std::fs::read(&mem).expect("memory file");
        for entry in &s.memory.entries {
            let part = &bytes[entry.offset as usize..(entry.offset + entry.raw_len) as usize];
            match entry.digest {
                Some(d) => assert_eq!(kiln_store::ChunkDigest::of(part), d, "{entry:?}"),
                None => assert!(part.iter().all(|b| *b == 0), "{entry:?}"),
            }
        }
        drop(bytes);
        for c in &listed {
            assert!(clone::stop(&state, &c.id).await.expect("stop"));
        }
        assert!(clone::list(&state).expect("ps").is_empty());

        // A host whose key differs (here: KVM asked for a TCG snapshot) is refused before
        // anything starts, and the snapshot stays in the store.
        let mut other = CloneOptions::new(
            state.clone(),
            e.work.join("cache-kvm"),
            Serving::Materialized,
        );
        other.accel = Some(match r.accel {
            Accel::Tcg => Accel::Kvm,
            Accel::Kvm => Accel::Tcg,
        });
        match clone::start_clones(&e.store, &snap_tag, &other).await {
            Err(CloneError::Compat { source, .. }) => {
                assert!(source.to_string().contains("accel"), "{source}")
            }
            other => panic!("expected a compatibility refusal, got {other:?}"),
        }
        assert!(
            e.store
                .has(&ObjectRef::Manifest(r.snapshot))
                .await
                .expect("head")
        );
        assert!(clone::list(&state).expect("ps").is_empty());

        // A corrupted vmstate in the store is caught before QEMU starts.
        let victim = e.store_dir.join(s.vmstate.digest.key());
        let mut bytes = std::fs::read(&victim).expect("vmstate blob");
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&victim, bytes).expect("corrupt");
        let fresh = CloneOptions::new(
            state.clone(),
            e.work.join("cache-fresh"),
            Serving::Materialized,
        );
        match clone::start_clones(&e.store, &snap_tag, &fresh).await {
            Err(CloneError::Store(StoreError::Blob(b))) => {
                assert!(b.to_string().contains(&s.vmstate.digest.hex()), "{b}")
            }
            other => panic!("expected the vmstate digest mismatch, got {other:?}"),
        }
        assert!(clone::list(&state).expect("ps").is_empty());
        let clones_dir = state.join("clones");
        assert_eq!(
            std::fs::read_dir(&clones_dir).expect("clones dir").count(),
            0,
            "no clone directory (no QEMU) for a refused start"
        );
    });
}

#[test]
fn vm_ready_check_that_never_succeeds_fails_with_its_timeout() {
    rt().block_on(async {
        let e = env().await;
        let tag: TagRef = "never:latest".parse().expect("tag");
        busybox_image(
            &e.store,
            &e.work,
            &tag,
            SandboxSpec {
                start: Some(StartSpec {
                    argv: sh("exec sleep 1000000"),
                    user: None,
                    env: vec![],
                    workdir: None,
                }),
                ready: Some(ReadySpec {
                    argv: sh("exit 1"),
                    interval_ms: 100,
                    timeout_ms: 500,
                    retries: 3,
                }),
            },
        )
        .await;
        let new: TagRef = "never:snap".parse().expect("tag");
        match snapshot_image(&e.store, &tag, &new, &guest_assets(), &snap_opts(&e.work)).await {
            Err(SnapshotError::GuestFailed { reason, .. }) => {
                assert!(reason.contains("ReadyTimeout"), "{reason}")
            }
            other => panic!("expected the ready check to fail, got {other:?}"),
        }
        assert!(e.store.get_tag(&new).await.expect("get tag").is_none());
    });
}

/// The Debian fixture (bookworm, debootstrap minbase) boots through the guest init to a
/// READY whose check uses Debian's own tools, and a clone of it answers.
/// Issue 12: a guest that dies before its init speaks must fail the boot with the kernel's own
/// panic line in kiln's error, not "no message from the guest". Here the initramfs' init is
/// pointed nowhere, so nothing loads the virtio-blk module and the kernel cannot mount a root.
#[test]
fn vm_kernel_panic_before_the_init_speaks_is_quoted_in_the_error() {
    rt().block_on(async {
        let e = env().await;
        let tag: TagRef = "panics:latest".parse().expect("tag");
        busybox_image(&e.store, &e.work, &tag, SandboxSpec::default()).await;
        let new: TagRef = "panics:snap".parse().expect("tag");
        let opts = SnapshotOptions {
            kernel_args: vec!["rdinit=/nonexistent-kiln-test".into()],
            ..snap_opts(&e.work)
        };
        let err = snapshot_image(&e.store, &tag, &new, &guest_assets(), &opts)
            .await
            .expect_err("a kernel without an init cannot become ready");
        assert!(
            matches!(err, SnapshotError::Guest { .. }),
            "expected the guest to be gone, got {err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.lines().any(|l| l.starts_with("guest kernel: ")
                && l.contains("Kernel panic - not syncing: VFS: Unable to mount root fs")),
            "{msg}"
        );
        assert!(msg.contains("QEMU exited"), "{msg}");
        assert!(e.store.get_tag(&new).await.expect("get tag").is_none());
    });
}

#[test]
fn vm_debian_image_boots_to_ready_and_clones() {
    rt().block_on(async {
        let e = env().await;
        let tag: TagRef = "debian:bookworm".parse().expect("tag");
        oci_image(
            &e.store,
            &e.work,
            "KILN_TEST_DEBIAN_OCI",
            "bookworm",
            512,
            &tag,
            SandboxSpec {
                start: Some(StartSpec {
                    argv: vec![
                        "/usr/bin/bash".into(),
                        "-c".into(),
                        "echo ready > /run/kiln-ready; exec sleep infinity".into(),
                    ],
                    user: None,
                    env: vec![],
                    workdir: Some("/root".into()),
                }),
                ready: Some(ReadySpec {
                    argv: vec![
                        "/usr/bin/test".into(),
                        "-s".into(),
                        "/run/kiln-ready".into(),
                    ],
                    interval_ms: 100,
                    timeout_ms: 2000,
                    retries: 300,
                }),
            },
        )
        .await;
        let snap: TagRef = "debian:snap".parse().expect("tag");
        let r = snapshot_image(&e.store, &tag, &snap, &guest_assets(), &snap_opts(&e.work))
            .await
            .expect("Debian boots once to READY");
        let state = e.work.join("state");
        let _stop = StopClones::library(&e.work, &state);
        let opts = CloneOptions::new(state.clone(), e.work.join("cache"), Serving::Materialized);
        let clones = clone::start_clones(&e.store, &snap, &opts)
            .await
            .expect("a Debian clone");
        assert_eq!(clones.len(), 1);
        assert_eq!(clones[0].machine_id.len(), 32, "{clones:?}");
        assert_eq!(clones[0].snapshot, r.snapshot.to_string());
        assert!(clone::stop(&state, &clones[0].id).await.expect("stop"));
    });
}
