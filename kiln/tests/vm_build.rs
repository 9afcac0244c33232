//! `kiln build --isolation vm` (issue 14 §1): the microVM step executor against the namespace
//! executor, on the busybox fixture, TCG. A deterministic Dockerfile (a new file, a whiteout
//! of a lower file, a new directory, an opaque directory over an earlier step's, a `USER`
//! and a missing `WORKDIR`, a heredoc script run as that user, a step with a tmpfs, a
//! secret, the context bound read-write and read-only, and one file of it bound read-only on
//! a new mount point and read-write over a file of the image and on a new mount point in new
//! directories, the step checking what it reads and that its writes stay in its copy,
//! `SOURCE_DATE_EPOCH`) gives the same OCI manifest, so the same
//! layer digests, under both executors; the namespace build in the VM build's store runs no
//! step (cache keys do not depend on the executor). A failing step reports its exit code and
//! its log's tail; a step over the build's time limit is stopped by killing its VM, and no
//! QEMU is left. A 30-layer image (built with kiln, namespace executor) and 12 steps on top of
//! it (five `RUN` steps in VMs, seven `COPY` steps) give the same OCI manifest under both
//! executors, though the VM takes at most 16 lower disks: the lowest layers are squashed into
//! one directory and so one disk, a file deleted and a directory made opaque both inside the
//! squashed layers and over them, each squashed directory is made once per set of layers, and `kiln store gc`'s
//! collection removes the VM's disk images with the unpacked layers. A cache mount filled
//! by one VM build of a workspace is seen by the next builds of that workspace, two of which
//! at once take its `locked` disk one after the other, survives a guest crashing while it
//! writes, and is empty for another. As root, with the guest kernel and initramfs (`KILN_TEST_KERNEL`,
//! `KILN_TEST_INITRAMFS`).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kiln_pipeline::{
    BuildReport, BuildRequest, ContextSource, Executor, Output, PipelineError, Recipe, Setup,
};
use kiln_tests::require_env;
use kiln_tests::vm::guest_assets;

const EPOCH: &str = "1700000000";

fn dockerfile(bb: &str) -> String {
    format!(
        "FROM {bb}\n\
         RUN mkdir /o && echo 1 > /o/a && echo x > /f\n\
         RUN rm /bin/vi && rm -r /o && mkdir /o && echo 2 > /o/b && mkdir -p /d/e \
             && echo y > /d/e/g && ln /f /d/f2 && ln -s ../f /d/l && chmod 4755 /d/e/g\n\
         RUN --mount=type=tmpfs,target=/scratch --mount=type=secret,id=tok,target=/run/secrets/tok \
             --mount=type=bind,target=/ctx,rw --mount=type=bind,target=/ro \
             --mount=type=bind,source=conf.txt,target=/etc/app.conf \
             --mount=type=bind,source=conf.txt,target=/f,rw \
             --mount=type=bind,source=conf.txt,target=/n/e/rw,rw \
             echo t > /scratch/a && test \"$(cat /run/secrets/tok)\" = hunter2 \
             && echo w > /ctx/new && cp /ctx/Dockerfile /df && ! touch /ro/x 2>/dev/null \
             && test ! -e /ro/new && test \"$(cat /etc/app.conf)\" = conf-1 \
             && ! (echo x > /etc/app.conf) 2>/dev/null && test \"$(cat /f)\" = conf-1 \
             && echo w >> /f && test \"$(tail -n 1 /f)\" = w && echo v > /n/e/rw \
             && test \"$(cat /n/e/rw)\" = v && echo ok > /m\n\
         USER nobody\n\
         WORKDIR /w/x\n\
         RUN <<EOF\n#!/bin/sh\necho z > /tmp/z && id -u > /tmp/uid\nEOF\n"
    )
}

fn request(ctx: &Path, executor: Executor) -> BuildRequest {
    let file = ctx.join("Dockerfile");
    let mut req = BuildRequest::new(
        Recipe {
            name: file.display().to_string(),
            bytes: std::fs::read(&file).expect("read Dockerfile"),
        },
        ContextSource::dir(ctx, Some(&file)).expect("context"),
    );
    req.build_args
        .insert("SOURCE_DATE_EPOCH".into(), EPOCH.into());
    req.output = Output::Oci { refs: Vec::new() };
    req.executor = executor;
    req.secrets = kiln_builder::secrets::Secrets::load(&[kiln_builder::secrets::SecretSpec {
        id: "tok".into(),
        source: kiln_builder::secrets::SecretSource::File(ctx.join("tok.secret")),
    }])
    .expect("secret");
    req
}

async fn run(store: &Path, req: BuildRequest) -> Result<BuildReport, PipelineError> {
    let mut setup = Setup::open_local(store).await.expect("setup");
    setup.boot = Some(guest_assets());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    kiln_pipeline::run(&setup, req, Arc::new(tx)).await
}

fn context(dir: &Path, text: &str) -> std::path::PathBuf {
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), text).expect("write");
    // The secret of the `RUN --mount=type=secret` step (never in a layer).
    std::fs::write(ctx.join("tok.secret"), "hunter2").expect("write");
    // The file of the single-file binds.
    std::fs::write(ctx.join("conf.txt"), "conf-1\n").expect("write");
    ctx
}

/// QEMU processes whose command line mentions `dir`.
fn qemus_under(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.contains("qemu-system") && cmd.contains(&needle) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn vm_and_namespace_executors_give_the_same_layers_and_share_the_cache() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = context(t.path(), &dockerfile(&bb));
    let a = guest_assets();

    // The microVM build, through the binary.
    let vm_store = t.path().join("vm-store");
    let iid = t.path().join("iid");
    let t0 = std::time::Instant::now();
    // Issue 37: no step VM's QEMU runs as root.
    let uids = kiln_tests::vm::QemuUids::watch(t.path());
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", &vm_store)
        .env("KILN_KERNEL", &a.kernel)
        .env("KILN_INITRAMFS", &a.initramfs)
        .arg("build")
        .arg(&ctx)
        .args(["--isolation", "vm", "--oci-only", "--progress", "plain"])
        .args(["--build-arg", &format!("SOURCE_DATE_EPOCH={EPOCH}")])
        .arg("--secret")
        .arg(format!("id=tok,src={}", ctx.join("tok.secret").display()))
        .arg("--iidfile")
        .arg(&iid)
        .output()
        .expect("run kiln");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    eprintln!("vm build: {:?}", t0.elapsed());
    let steps = uids.assert_none_root("the vm build's steps");
    assert!(steps.len() >= 4, "a QEMU per RUN step: {steps:?}");
    let vm_oci = std::fs::read_to_string(&iid).expect("iid");

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    // The namespace executor in a fresh store: the same image.
    let t1 = std::time::Instant::now();
    let ns = rt
        .block_on(run(
            &t.path().join("ns-store"),
            request(&ctx, Executor::Namespace),
        ))
        .expect("namespace build");
    eprintln!("namespace build: {:?}", t1.elapsed());
    assert_eq!(ns.steps_run, 5, "four RUN steps and a WORKDIR");
    assert_eq!(
        ns.oci_manifest.digest.to_string(),
        vm_oci.trim(),
        "the same OCI manifest under both executors"
    );
    // In the microVM build's store, the namespace build finds every step in the cache.
    let again = rt
        .block_on(run(&vm_store, request(&ctx, Executor::Namespace)))
        .expect("namespace build in the vm build's store");
    assert_eq!((again.steps_run, again.steps_cached), (0, 5));
    assert_eq!(again.layers, ns.layers);
}

#[test]
fn vm_steps_report_failures_and_time_limits_kill_the_vm() {
    assert!(rustix::process::geteuid().is_root(), "needs root");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Runtime::new().expect("runtime");

    let ctx = context(
        &t.path().join("fail"),
        &format!("FROM {bb}\nRUN echo before; echo oops >&2; exit 7\n"),
    );
    let e = rt
        .block_on(run(&t.path().join("s1"), request(&ctx, Executor::Vm)))
        .expect_err("the step fails");
    let shown = format!("{e:#}");
    assert!(shown.contains("exited with code 7"), "{shown}");
    let tail = match &e {
        PipelineError::Build(b) => match &**b {
            kiln_builder::build::BuildError::Step {
                error: kiln_builder::exec::ExecError::Failed { tail, .. },
                ..
            } => tail.clone(),
            other => panic!("not a failed step: {other:?}"),
        },
        other => panic!("not a step error: {other:?}"),
    };
    assert!(tail.iter().any(|l| l == "oops"), "{tail:?}");
    assert!(tail.iter().any(|l| l == "before"), "{tail:?}");

    let ctx = context(
        &t.path().join("slow"),
        &format!("FROM {bb}\nRUN echo started; sleep 600\n"),
    );
    let store = t.path().join("s2");
    let mut req = request(&ctx, Executor::Vm);
    // The limit is the build's: the step gets what the setup before it (pull, lower disks:
    // a second or two) left, and its VM's boot waits on a bound of its own, the limit
    // checked only once the step runs; so the limit passes with the step running however
    // slowly the VM boots. 15 s, not the 30 s this test waited out before.
    req.limits.timeout = Some(Duration::from_secs(15));
    let e = rt
        .block_on(run(&store, req))
        .expect_err("the step is stopped");
    assert!(
        matches!(&e, PipelineError::Build(b)
            if matches!(&**b, kiln_builder::build::BuildError::Timeout { stopped: Some(s), .. }
                if s.contains(kiln_builder::exec::STOPPED_VM))),
        "the running step's VM is killed at the limit: {e:#}"
    );
    assert_eq!(qemus_under(&store), Vec::<u32>::new(), "no QEMU left");
}

/// `RUN --mount=type=cache` in microVM steps, workspace-scoped as for `kiln serve`: a
/// cache disk filled by one build (a new cache's root directory with the mount's `uid`,
/// `gid` and `mode`) is seen by the next builds of the same workspace, whose steps copy what
/// they read into their layers and fail if it is missing; two of them at once, each bumping a
/// counter in the `locked` cache over a second, take it one after the other (the counter
/// reaches 2: two VMs with the disk at once would both have read 0); a VM whose guest
/// crashes while its step writes to the cache leaves the dirty marker, and the next build
/// runs on the checked disk; the cache is empty for another workspace. Each workspace has one
/// disk under its cache base, sound (`e2fsck -fn`), with no dirty marker left after clean VM
/// exits and no namespace cache directory made.
#[test]
fn vm_cache_mounts_persist_per_workspace() {
    assert!(rustix::process::geteuid().is_root(), "needs root");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = t.path().join("store");
    let req = |name: &str, ws: &str, step: &str| {
        let ctx = context(&t.path().join(name), &format!("FROM {bb}\n{step}\n"));
        let mut req = request(&ctx, Executor::Vm);
        req.cache_mounts = kiln_pipeline::CacheMountScope::Workspace(ws.parse().expect("id"));
        req
    };
    let t0 = std::time::Instant::now();
    let fill = "RUN --mount=type=cache,target=/root/.cache/x,uid=1,gid=2,mode=0750 \
                ls -nd /root/.cache/x | grep -Eq '^drwxr-x--- +[0-9]+ +1 +2 ' \
                && echo filled > /root/.cache/x/f";
    rt.block_on(run(&store, req("fill", "alpha", fill)))
        .expect("the first build fills the cache");
    eprintln!("fill: {:?}", t0.elapsed());
    let read = |i: u32| {
        format!(
            "RUN --mount=type=cache,target=/root/.cache/x,sharing=locked \
             n=$(cat /root/.cache/x/count 2>/dev/null || echo 0) && sleep 1 \
             && echo $((n + 1)) > /root/.cache/x/count \
             && cat /root/.cache/x/f > /seen && test \"$(cat /seen)\" = filled && echo {i} > /who"
        )
    };
    let (a, b) = (
        req("read1", "alpha", &read(1)),
        req("read2", "alpha", &read(2)),
    );
    let t1 = std::time::Instant::now();
    let (a, b) = rt.block_on(async { tokio::join!(run(&store, a), run(&store, b)) });
    eprintln!("two reads at once: {:?}", t1.elapsed());
    for r in [a, b] {
        let r = r.expect("the same workspace's cache has the file");
        assert_eq!(r.steps_run, 1);
    }
    let base = store.join(".build/cache-mounts-by-workspace");
    let alpha = base.join("alpha").join("vm");
    let disk_of = |dir: &Path, ext: &str| {
        std::fs::read_dir(dir)
            .expect("the workspace's cache disks")
            .map(|e| e.expect("entry").path())
            .find(|p| p.extension().is_some_and(|e| e == ext))
    };
    let image = disk_of(&alpha, "ext4").expect("alpha's cache disk");
    // The disk as the two reads left it, read on the host (debugfs, not mounted).
    let out = Command::new("debugfs")
        .args(["-R", "cat /count"])
        .arg(&image)
        .output()
        .expect("run debugfs");
    let count = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        count.trim(),
        "2",
        "one step at a time with the locked cache"
    );

    // A VM that dies while its step writes to the cache (the guest kernel crashed on
    // purpose) leaves it dirty; the next build checks it (e2fsck -p, or a fresh disk) and
    // runs on it.
    let crash = "RUN --mount=type=cache,target=/root/.cache/x \
                 for i in 1 2 3 4 5 6 7 8; do \
                 dd if=/dev/zero of=/root/.cache/x/big$i bs=1M count=4 2>/dev/null; done; \
                 echo c > /proc/sysrq-trigger; sleep 60";
    let e = rt
        .block_on(run(&store, req("crash", "alpha", crash)))
        .expect_err("the step's VM dies");
    eprintln!("crashed: {e:#}");
    assert!(disk_of(&alpha, "dirty").is_some(), "the dirty marker stays");
    let after = "RUN --mount=type=cache,target=/root/.cache/x \
                 touch /root/.cache/x/after && ls /root/.cache/x > /after";
    rt.block_on(run(&store, req("after", "alpha", after)))
        .expect("the build after the crash runs on the checked cache");

    let other = "RUN --mount=type=cache,target=/root/.cache/x \
                 test ! -e /root/.cache/x/f && ls -a /root/.cache/x > /listed";
    rt.block_on(run(&store, req("other", "beta", other)))
        .expect("another workspace's cache is empty");

    for ws in ["alpha", "beta"] {
        let names: Vec<String> = std::fs::read_dir(base.join(ws).join("vm"))
            .expect("the workspace's cache disks")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        let disks: Vec<&String> = names.iter().filter(|n| n.ends_with(".ext4")).collect();
        assert_eq!(disks.len(), 1, "{names:?}");
        assert!(!names.iter().any(|n| n.ends_with(".dirty")), "{names:?}");
        let dirs: Vec<_> = std::fs::read_dir(base.join(ws))
            .expect("cache base")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(dirs, ["vm"], "no namespace cache directory");
        let fsck = Command::new("e2fsck")
            .arg("-fn")
            .arg(base.join(ws).join("vm").join(disks[0]))
            .output()
            .expect("run e2fsck");
        assert!(fsck.status.success(), "{ws}'s disk is sound: {fsck:?}");
    }
    eprintln!("whole test: {:?}", t0.elapsed());
}

/// The 28 steps over busybox's one layer of the 30-layer base (kiln adds the 30th, its
/// sandbox preparation layer): files copied one per layer, two namespace `RUN` layers, the
/// second deleting a file of the first (a whiteout) and replacing a directory of it (an
/// opaque directory), all below the VM's disk count.
fn base_dockerfile(bb: &str) -> String {
    let mut d = format!("FROM {bb}\n");
    d.push_str("RUN mkdir -p /o /g && echo 1 > /o/x && echo keep > /g/k && echo gone > /g/gone\n");
    for i in 0..13 {
        d.push_str(&format!("COPY f{i} /b/f{i}\n"));
    }
    d.push_str("RUN rm /g/gone && rm -r /o && mkdir /o && echo 2 > /o/y\n");
    for i in 13..26 {
        d.push_str(&format!("COPY f{i} /b/f{i}\n"));
    }
    d
}

/// Twelve steps over the base, five of them `RUN` steps at the points where the squash
/// changes, with one of the 16 disks the step's package layer
/// (`kiln_builder::exec::mounts::packages`): over 30 lowers (the lowest 16 squashed), 31 and
/// 32 (24 squashed, the second step reusing the disk), then seven `COPY` steps (no VM), then
/// 40 and 41 (32 squashed, the second reusing it). Each `RUN` step reads the tree as the squash must show it and
/// writes something of its own (so no two layers are the same).
fn top_dockerfile() -> String {
    let mut d = String::from("FROM squash-base:1\n");
    // The base's whiteout and opaque directory, as overlayfs shows them; and the step starts
    // with no signal blocked or ignored under both executors (issue 44 §1).
    d.push_str(
        "RUN test ! -e /g/gone && test ! -e /o/x && test \"$(cat /o/y)\" = 2 \
         && test \"$(cat /g/k)\" = keep && ls /o /g /b > /seen \
         && grep -E '^Sig(Blk|Ign):' /proc/self/status > /signals \
         && test \"$(cat /signals)\" = \"$(printf 'SigBlk:\\t0000000000000000\\nSigIgn:\\t0000000000000000')\"\n",
    );
    // A whiteout and an opaque directory over squashed layers, a copy-up of a squashed file.
    d.push_str("RUN rm /b/f3 && rm -r /g && mkdir /g && echo new > /g/n\n");
    d.push_str("RUN echo more >> /b/f5 && cat /b/f0 /b/f25 > /cat\n");
    for i in 3..10 {
        d.push_str(&format!("COPY c{i} /c/c{i}\n"));
    }
    // The second step's whiteout and opaque directory, now inside the squashed disk.
    for i in 10..12 {
        d.push_str(&format!(
            "RUN test ! -e /b/f3 && test ! -e /g/k && test \"$(cat /g/n)\" = new \
             && test \"$(cat /b/f5)\" = \"$(printf 'file 5\\nmore')\" \
             && echo {i} > /t{i} && ls /b /g /c >> /t{i}\n"
        ));
    }
    d
}

#[test]
fn vm_steps_over_thirty_layers_squash_the_lowest_and_match_the_namespace_executor() {
    assert!(rustix::process::geteuid().is_root(), "needs root");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = t.path().join("store");
    let t0 = std::time::Instant::now();

    // The 30-layer base, namespace executor, as a local OCI reference in the store.
    let ctx = context(&t.path().join("base"), &base_dockerfile(&bb));
    for i in 0..26 {
        std::fs::write(ctx.join(format!("f{i}")), format!("file {i}\n")).expect("write");
    }
    let mut req = request(&ctx, Executor::Namespace);
    req.output = Output::Oci {
        refs: vec!["squash-base:1".parse().expect("reference")],
    };
    let base = rt.block_on(run(&store, req)).expect("base build");
    assert_eq!(base.layers.len(), 30, "{:?}", base.layers);
    eprintln!("30-layer base: {:?}", t0.elapsed());

    // Twelve steps on top, in a microVM each.
    let top = context(&t.path().join("top"), &top_dockerfile());
    for i in 3..10 {
        std::fs::write(top.join(format!("c{i}")), format!("copied {i}\n")).expect("write");
    }
    let t1 = std::time::Instant::now();
    let vm = rt
        .block_on(run(&store, request(&top, Executor::Vm)))
        .expect("vm build over 30 layers");
    eprintln!("12 steps, 5 in a vm: {:?}", t1.elapsed());
    // The base's 30, the steps' 12 and this build's sandbox preparation layer.
    assert_eq!((vm.steps_run, vm.layers.len()), (12, 43));
    // `RUN` steps over 30, 31, 32, 40 and 41 lowers on 15 disks (the package layer takes the
    // 16th): the lowest 16, then 24, then 32 squashed, each made once: three squashed directories beside the unpacked
    // layers (named after no layer), each made a disk image once.
    let known: std::collections::HashSet<String> =
        vm.layers.iter().map(|l| l.digest.hex()).collect();
    let squashed: Vec<_> = std::fs::read_dir(store.join(".build/layers"))
        .expect("layer directories")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.len() == 64 && !known.contains(n))
        .collect();
    assert_eq!(squashed.len(), 3, "{squashed:?}");

    // The same steps under the namespace executor, run again (not from the cache).
    let mut req = request(&top, Executor::Namespace);
    req.no_cache = true;
    let ns = rt
        .block_on(run(&store, req))
        .expect("namespace build over 30 layers");
    assert_eq!(ns.steps_run, 12);
    assert_eq!(
        vm.oci_manifest.digest, ns.oci_manifest.digest,
        "the same OCI manifest under both executors"
    );
    assert_eq!(vm.layers, ns.layers);

    // `kiln store gc`'s collection takes the VM's disk images of layers with the unpacked
    // layers, now that no build runs.
    let work = store.join(".build");
    let c = kiln_builder::workdir::collect_layers(&work, false).expect("collect layers");
    assert!(!c.busy && c.dirs >= 30 + 3 && c.images >= 3 + 14, "{c:?}");
    let left: Vec<_> = std::fs::read_dir(
        work.join("run")
            .join(kiln_builder::workdir::VM_LOWER_IMAGES),
    )
    .expect("image dir")
    .collect();
    assert!(left.is_empty(), "{left:?}");
    for s in &squashed {
        assert!(!work.join("layers").join(s).exists(), "{s}");
    }
    eprintln!("whole test: {:?}", t0.elapsed());
}
