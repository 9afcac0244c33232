//! Issue 32: microVM build steps restored from the per-host builder snapshot
//! (`kiln_vmm::builder`) instead of a cold boot each, through
//! [`kiln_pipeline::vmexec::VmExecutor`] directly on a busybox root, TCG here:
//! - isolation: a step of one build writes outside its layer (`/dev/shm`, the guest's
//!   devtmpfs `/dev`) and leaves a process running; a step of the next build (another
//!   executor, so another build) sees none of it, and the two read different random bytes
//!   (each restored VM reseeds: without it both would read what the snapshot's entropy pool
//!   gives); both steps were restored, not booted;
//! - a step whose memory limit is above the snapshot's ([`BUILDER_STEP_MEMORY_BYTES`]) boots
//!   cold, and one with restores off does too; each still gives its layer;
//! - the builder snapshot is made once and found again (a second `ensure` with the same key
//!   answers from the cache), and one whose vmstate was damaged is made again, not used;
//! - issue 36's hostile-step list (`kiln_tests::hostile`), all of it in one restored step.
//!
//! As root, with the guest kernel and initramfs (`KILN_TEST_KERNEL`, `KILN_TEST_INITRAMFS`;
//! the init is rebuilt from this checkout when those were not).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kiln_builder::exec::{ExecConfig, LogLine, StepExecutor, StepSpec};
use kiln_pipeline::vmexec::{BUILDER_STEP_MEMORY_BYTES, VmExecutor, builder_shape};
use kiln_recipes::plan::Network;
use kiln_tests::vm::{busybox_root, guest_assets};

/// A new executor (a new build's) with step memory limit `memory_bytes`, its run directory
/// under `dir`.
fn executor(dir: &Path, memory_bytes: u64) -> VmExecutor {
    let config = ExecConfig {
        run_dir: dir.join("run"),
        memory_bytes,
        ..ExecConfig::default()
    };
    kiln_tests::vm::runtime()
        .block_on(VmExecutor::new(guest_assets(), config, 1))
        .expect("the VM executor")
}

/// Runs `script` as a step over `root` with `exec`; its log lines and upper directory.
fn step(exec: &VmExecutor, dir: &Path, root: &Path, script: &str) -> (Vec<String>, PathBuf) {
    let upper = dir.join("upper");
    let work = dir.join("work");
    std::fs::create_dir_all(&upper).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let spec = StepSpec {
        index: 1,
        lower_dirs: vec![root.to_path_buf()],
        layer_limits: Default::default(),
        upper_dir: upper.clone(),
        work_dir: work,
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: vec![],
        user: None,
        workdir: "/".into(),
        files: vec![],
        network: Network::None,
        security: kiln_recipes::plan::Security::Sandbox,
        mounts: vec![],
        secrets: vec![],
        timeout: Duration::from_secs(600),
        log_budget: None,
    };
    let mut lines = Vec::new();
    let r = exec.run(&spec, &AtomicBool::new(false), &mut |l: LogLine| {
        lines.push(l.text)
    });
    r.unwrap_or_else(|e| panic!("{}: {e}\n{lines:#?}", dir.display()));
    (lines, upper)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn restored_steps_keep_nothing_of_an_earlier_build_and_reseed() {
    let t = tempfile::tempdir().unwrap();
    let root = busybox_root(&t.path().join("rootfs"));
    let first = executor(&t.path().join("a"), 256 << 20);
    let (_, up1) = step(
        &first,
        &t.path().join("a"),
        &root,
        "echo leak > /dev/shm/leak && echo leak > /dev/leak && (sleep 1001 >/dev/null 2>&1 &) \
         && head -c 16 /dev/urandom | od -An -tx1 > /random && echo ok > /done",
    );
    assert_eq!(first.step_counts(), (1, 0), "the first step was restored");
    assert_eq!(read(&up1.join("done")), "ok\n");
    assert!(!up1.join("dev").exists(), "/dev is not in the layer");

    let second = executor(&t.path().join("b"), 256 << 20);
    let (lines, up2) = step(
        &second,
        &t.path().join("b"),
        &root,
        "ls -a /dev/shm; test ! -e /dev/shm/leak && test ! -e /dev/leak \
         && ! pgrep -f 'sleep 100[1]'; echo $? > /clean; \
         head -c 16 /dev/urandom | od -An -tx1 > /random",
    );
    assert_eq!(second.step_counts(), (1, 0), "the second step was restored");
    assert_eq!(read(&up2.join("clean")), "0\n", "{lines:#?}");
    let (r1, r2) = (read(&up1.join("random")), read(&up2.join("random")));
    assert!(r1.trim().len() >= 32, "{r1:?}");
    assert_ne!(r1, r2, "two restored step VMs read the same random bytes");
}

/// Issue 36: the hostile-step list (`kiln_tests::hostile`, shared with the namespace
/// executor's test) in one step VM: the guest kernel is the wall, so mounting, loading a
/// module and writing `/proc/sysrq-trigger` touch only the guest, a chown to uid 70000 stays
/// in the step's layer (owned by 70000 there), and no host process or host file is in reach.
#[test]
fn hostile_step_list_stays_in_the_guest() {
    use kiln_tests::hostile::{Executor, STEP_DIR, Target, chowned_owner};
    let t = tempfile::tempdir().unwrap();
    let root = busybox_root(&t.path().join("rootfs"));
    let target = Target::start();
    let exec = executor(&t.path().join("h"), 256 << 20);
    let (lines, upper) = step(&exec, &t.path().join("h"), &root, &target.script(STEP_DIR));
    target.assert_lines(Executor::MicroVm, &lines);
    assert_eq!(chowned_owner(&upper), (70000, 70000));
}

#[test]
fn steps_that_do_not_fit_the_builder_snapshot_boot_cold() {
    let t = tempfile::tempdir().unwrap();
    let root = busybox_root(&t.path().join("rootfs"));
    let big = executor(
        &t.path().join("big"),
        BUILDER_STEP_MEMORY_BYTES + (64 << 20),
    );
    assert!(
        kiln_pipeline::vmexec::step_vm_bytes(BUILDER_STEP_MEMORY_BYTES + (64 << 20))
            > builder_shape(1).memory_bytes
    );
    let (_, up) = step(&big, &t.path().join("big"), &root, "echo big > /big");
    assert_eq!(
        big.step_counts(),
        (0, 1),
        "a larger memory limit boots cold"
    );
    assert_eq!(read(&up.join("big")), "big\n");

    let off = executor(&t.path().join("off"), 256 << 20).with_restore(false);
    let (_, up) = step(&off, &t.path().join("off"), &root, "echo off > /off");
    assert_eq!(off.step_counts(), (0, 1), "restores off: booted cold");
    assert_eq!(read(&up.join("off")), "off\n");
}

#[test]
fn the_builder_snapshot_is_made_once_and_a_damaged_one_again() {
    let t = tempfile::tempdir().unwrap();
    let cache = t.path().join("cache");
    kiln_pipeline::qemu_cgroups::install();
    let rt = kiln_tests::vm::runtime();
    let host = rt.block_on(kiln_vmm::launch::Host::detect()).unwrap();
    let boot = guest_assets();
    let accel = kiln_vmm::launch::Accel::Tcg;
    let shape = kiln_vmm::builder::BuilderShape {
        vcpus: 1,
        memory_bytes: 256 << 20,
        ro_disks: 2,
        rw_disks: 1,
    };
    let ensure = || {
        rt.block_on(kiln_vmm::builder::ensure(
            &host,
            accel,
            &boot,
            shape,
            &cache,
            Duration::from_secs(120),
        ))
        .expect("the builder snapshot")
        .expect("this host has a key")
    };
    ensure();
    let dirs: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let vmstate = dirs[0].join("vmstate");
    let made = std::fs::metadata(&vmstate).unwrap().modified().unwrap();
    ensure();
    assert_eq!(
        std::fs::metadata(&vmstate).unwrap().modified().unwrap(),
        made,
        "found again, not made again"
    );
    // A damaged vmstate: made again.
    let mut bytes = std::fs::read(&vmstate).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0xff;
    std::fs::write(&vmstate, &bytes).unwrap();
    ensure();
    assert_ne!(std::fs::read(&vmstate).unwrap(), bytes, "made again");
}
