//! Real guest boots under QEMU (`-M microvm`, the accelerator probe decides: TCG here):
//! Debian's cloud kernel (fetched by name, uncompressed vmlinux), the initramfs with the
//! static kiln-guest-init, a busybox ext4 root (`mke2fs -d` from the unpacked
//! KILN_TEST_BUSYBOX_OCI fixture), and the host side of the guest protocol spoken over the
//! virtio-serial socket by plain std code. QEMU is started by kiln-vmm's launcher
//! ([`launch::VmSpec`], [`launch::Vm::spawn`]): the tests boot exactly the machine kiln boots.
//!
//! Needs: ci/setup.sh (qemu-system-x86 10, e2fsprogs, umoci, apt lists for bookworm,
//! KILN_TEST_CACHE and KILN_TEST_BUSYBOX_OCI). Boot times are printed, never asserted.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kiln_guest::protocol::{self, FailureKind, Message, Ping, ReadyCheck, Restore, Start};
use kiln_vmm::{initramfs, kernel, launch};

/// What every boot shares: kernel, initramfs, the busybox root tree.
struct Artifacts {
    kernel: kernel::Kernel,
    initramfs: initramfs::Initramfs,
    rootfs: PathBuf,
    dir: tempfile::TempDir,
}

fn env_or_fail(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run `. ci/setup.sh` (or source its env file) first")
    })
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (run ci/setup.sh)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn artifacts() -> &'static Artifacts {
    static A: OnceLock<Artifacts> = OnceLock::new();
    A.get_or_init(|| {
        let cache = PathBuf::from(env_or_fail("KILN_TEST_CACHE"));
        let oci = env_or_fail("KILN_TEST_BUSYBOX_OCI");
        let k = kernel::fetch(&cache, kernel::DEFAULT_PACKAGE).expect("fetch the guest kernel");
        eprintln!(
            "kernel {} {} ({}), deb {}, vmlinux {}, PVH entry {:#x}",
            k.package, k.version, k.release, k.deb_sha256, k.vmlinux_sha256, k.pvh_entry
        );
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace().join("target"))
            .join("guest-init");
        let init = initramfs::build_guest_init(&workspace(), &target).expect("build the init");
        let dir = tempfile::tempdir().unwrap();
        let ird = initramfs::build(
            &k,
            &init,
            &kernel::GUEST_MODULES,
            &dir.path().join("initramfs.cpio"),
        )
        .expect("build the initramfs");
        eprintln!(
            "initramfs {} ({} bytes, modules {:?})",
            ird.sha256, ird.size, ird.modules
        );
        let bundle = dir.path().join("bundle");
        run(Command::new("umoci")
            .args(["unpack", "--image", &format!("{oci}:latest")])
            .arg(&bundle));
        Artifacts {
            kernel: k,
            initramfs: ird,
            rootfs: bundle.join("rootfs"),
            dir,
        }
    })
}

/// The Debian bookworm minbase fixture's root tree, with the empty /etc/machine-id a sandbox
/// image has.
fn debian_rootfs() -> &'static Path {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let oci = env_or_fail("KILN_TEST_DEBIAN_OCI");
        let bundle = artifacts().dir.path().join("debian");
        run(Command::new("umoci")
            .args(["unpack", "--image", &format!("{oci}:bookworm")])
            .arg(&bundle));
        let rootfs = bundle.join("rootfs");
        std::fs::write(rootfs.join("etc/machine-id"), b"").unwrap();
        rootfs
    })
}

/// The runtime the launcher's async API runs on (the tests themselves are synchronous).
fn rt() -> &'static tokio::runtime::Runtime {
    kiln_tests::vm::runtime()
}

/// This host's QEMU and the accelerator kiln picks for it, probed once.
fn host() -> &'static (launch::Host, launch::Accel) {
    static H: OnceLock<(launch::Host, launch::Accel)> = OnceLock::new();
    H.get_or_init(|| {
        kiln_pipeline::qemu_cgroups::install();
        let a = artifacts();
        kiln_tests::vm::probe_host(&a.kernel.vmlinux(), &a.initramfs.path)
    })
}

/// A running VM; QEMU is killed when the launcher's handle drops.
struct Vm {
    vm: launch::Vm,
    console: PathBuf,
    sock: PathBuf,
    _dir: tempfile::TempDir,
    started: Instant,
}

impl Vm {
    fn boot() -> Vm {
        Vm::boot_root(&artifacts().rootfs, "64M")
    }

    fn boot_root(rootfs: &Path, size: &str) -> Vm {
        let a = artifacts();
        let (host, accel) = host();
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("root.ext4");
        run(Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d"])
            .arg(rootfs)
            .arg(&disk)
            .arg(size));
        let overlay = dir.path().join("root.qcow2");
        rt().block_on(launch::qcow2_overlay(host, &disk, &overlay))
            .expect("qcow2 overlay");
        let memory_bytes = 256 << 20;
        let memory = dir.path().join("memory");
        std::fs::File::create(&memory)
            .and_then(|f| f.set_len(memory_bytes))
            .expect("memory file");
        let spec = launch::VmSpec {
            max_disk_bytes: None,
            accel: *accel,
            vcpus: 1,
            memory_bytes,
            kernel: a.kernel.vmlinux(),
            initramfs: a.initramfs.path.clone(),
            memory_file: memory,
            memory_mode: launch::MemoryMode::Shared,
            disk: overlay,
            disk_format: launch::DiskFormat::Qcow2,
            ro_disks: Vec::new(),
            rw_disks: Vec::new(),
            qmp_socket: dir.path().join("qmp.sock"),
            guest_socket: dir.path().join("guest.sock"),
            serial_log: dir.path().join("console.log"),
            incoming: false,
            tsc_khz: host.tsc_khz,
            egress_socket: None,
            kernel_args: vec![],
        };
        Vm::spawn(spec, dir)
    }

    /// Start QEMU with `spec`, whose files are in `dir` (kept until the VM drops).
    fn spawn(spec: launch::VmSpec, dir: tempfile::TempDir) -> Vm {
        let started = Instant::now();
        let vm = rt()
            .block_on(launch::Vm::spawn(
                &host().0,
                &spec,
                &dir.path().join("qemu.log"),
                Duration::from_secs(30),
                true,
            ))
            .unwrap_or_else(|e| panic!("start QEMU: {e}"));
        Vm {
            vm,
            console: spec.serial_log,
            sock: spec.guest_socket,
            _dir: dir,
            started,
        }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// The console as the launcher summarises it for errors (the kernel's panic or oops
    /// line first, then the tail).
    fn report(&self) -> String {
        launch::console_report(&self.console)
    }

    /// Connect to the guest port's socket (QEMU creates it shortly after starting).
    fn connect(&mut self) -> Guest {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(s) = UnixStream::connect(&self.sock) {
                // A hang guard, not a timing assertion: TCG boots take seconds.
                s.set_read_timeout(Some(Duration::from_secs(180))).unwrap();
                return Guest { s };
            }
            if let Some(status) = self.vm.exited() {
                panic!(
                    "QEMU exited ({status}): {}\n{}",
                    self.vm.log_tail(),
                    self.report()
                );
            }
            assert!(Instant::now() < deadline, "qemu made no socket");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

struct Guest {
    s: UnixStream,
}

impl Guest {
    fn recv(&mut self, vm: &mut Vm) -> Message {
        match protocol::read_frame(&mut self.s) {
            Ok(Some(body)) => protocol::decode_body(&body)
                .unwrap_or_else(|e| panic!("guest sent a bad message: {e}\n{}", vm.report())),
            other => panic!(
                "no message from the guest: {other:?} (QEMU: {})\n{}",
                vm.vm.exited().unwrap_or_else(|| "running".into()),
                vm.report()
            ),
        }
    }

    fn send(&mut self, msg: &Message) {
        protocol::write_message(&mut self.s, msg).expect("write to the guest port");
    }
}

fn hello(vm: &mut Vm) -> Guest {
    let mut g = vm.connect();
    match g.recv(vm) {
        Message::Hello(h) => assert_eq!(h.init_version, env!("CARGO_PKG_VERSION")),
        other => panic!("expected hello, got {other:?}"),
    }
    eprintln!(
        "hello after {:?} (qemu start → hello)",
        vm.started.elapsed()
    );
    g
}

/// The host side is hardened as Firecracker's jailer does it (issue 14): QEMU runs under its
/// seccomp sandbox (`launch::SANDBOX`), so the guest boots and QEMU's process has a seccomp
/// filter (`Seccomp: 2`, filter mode, in /proc/<pid>/status), and a request that makes QEMU
/// fork (a migration to `exec:`) is refused while QEMU runs on. Without `-sandbox` QEMU has
/// no filter (`Seccomp: 0`) and forks the command.
#[test]
fn qemu_runs_under_its_seccomp_sandbox_and_cannot_fork() {
    let mut vm = Vm::boot();
    let _g = hello(&mut vm);
    let status = std::fs::read_to_string(format!("/proc/{}/status", vm.vm.pid))
        .expect("QEMU's /proc status");
    let seccomp: Vec<&str> = status
        .lines()
        .filter(|l| l.starts_with("Seccomp"))
        .collect();
    assert!(
        seccomp.contains(&"Seccomp:\t2"),
        "QEMU (pid {}) has no seccomp filter: {seccomp:?}",
        vm.vm.pid
    );
    // Issue 37: kiln (root here) started it as a user of its own, with no groups.
    let user = vm.vm.user.expect("root starts QEMU as a user of its own");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (uid, gid) = (user.uid.to_string(), user.gid.to_string());
    assert_ne!(user.uid, 0);
    assert_eq!(field("Uid:"), [uid.as_str(); 4].join(" "), "{status}");
    assert_eq!(field("Gid:"), [gid.as_str(); 4].join(" "), "{status}");
    assert_eq!(field("Groups:"), "", "{status}");
    let r = rt().block_on(vm.vm.qmp.execute(
        "migrate",
        Some(serde_json::json!({"uri": "exec:cat > /dev/null"})),
    ));
    match r {
        Err(kiln_vmm::qmp::QmpError::Command { desc, .. }) => {
            assert!(desc.contains("fork"), "{desc}")
        }
        other => panic!("QEMU was let fork for an exec: migration: {other:?}"),
    }
    // Issue 37: QEMU opens no host path it was not handed: not a secret of the host (not in
    // its private root at all), not a new file beside its own (its root is read-only, and the
    // VM's directory is not in it).
    let r = rt().block_on(vm.vm.qmp.execute(
        "blockdev-add",
        Some(serde_json::json!({
            "driver": "file", "node-name": "secret", "filename": "/etc/shadow", "read-only": true
        })),
    ));
    match r {
        Err(kiln_vmm::qmp::QmpError::Command { desc, .. }) => {
            assert!(desc.contains("No such file or directory"), "{desc}")
        }
        other => panic!("QEMU opened /etc/shadow: {other:?}"),
    }
    let beside = vm.console.with_file_name("written-by-qemu");
    let r = rt().block_on(vm.vm.qmp.execute(
        "migrate",
        Some(serde_json::json!({"uri": format!("file:{}", beside.display())})),
    ));
    if r.is_ok() {
        // An error may also come as the migration's own state.
        let _ = rt().block_on(vm.vm.qmp.wait_migration(Duration::from_secs(10)));
    }
    assert!(!beside.exists(), "QEMU wrote {}: {r:?}", beside.display());
    assert_eq!(vm.vm.exited(), None, "QEMU died: {}", vm.vm.log_tail());
}

/// [`kiln_tests::vm::paused_spec`] with this file's kernel and initramfs: a VM in `d` that
/// QEMU starts paused (no guest boot), its disk an empty 1 MiB qcow2.
/// A build step's VM (1 vCPU, 256 MiB of anonymous memory, raw disks) with its files in
/// `d`: the initramfs, the upper disk, lower (read-only) and cache (read-write) disks, and
/// the kernel's extra arguments.
fn step_spec(
    d: &Path,
    initramfs: PathBuf,
    disk: PathBuf,
    ro_disks: Vec<PathBuf>,
    rw_disks: Vec<PathBuf>,
    kernel_args: Vec<String>,
) -> launch::VmSpec {
    let (host, accel) = host();
    launch::VmSpec {
        max_disk_bytes: None,
        accel: *accel,
        vcpus: 1,
        memory_bytes: 256 << 20,
        kernel: artifacts().kernel.vmlinux(),
        initramfs,
        memory_file: d.join("unused-memory"),
        memory_mode: launch::MemoryMode::Anonymous,
        disk,
        disk_format: launch::DiskFormat::Raw,
        ro_disks,
        rw_disks,
        qmp_socket: d.join("qmp.sock"),
        guest_socket: d.join("guest.sock"),
        serial_log: d.join("console.log"),
        incoming: false,
        tsc_khz: host.tsc_khz,
        egress_socket: None,
        kernel_args,
    }
}

fn paused_spec(d: &Path, memory_bytes: u64) -> launch::VmSpec {
    let a = artifacts();
    let (host, accel) = host();
    let boot = kiln_vmm::snapshot::BootAssets {
        kernel: a.kernel.vmlinux(),
        initramfs: a.initramfs.path.clone(),
    };
    kiln_tests::vm::paused_spec(host, *accel, &boot, d, memory_bytes, false)
}

/// Starts `spec` (from [`paused_spec`] in `d`), not tied to this thread.
fn start_paused(spec: &launch::VmSpec, d: &Path) -> launch::Vm {
    rt().block_on(launch::Vm::spawn(
        &host().0,
        spec,
        &d.join("qemu.log"),
        Duration::from_secs(30),
        false,
    ))
    .unwrap_or_else(|e| panic!("start QEMU: {e}"))
}

/// Issue 37: QEMU drops root between fork and exec, and a change of uid clears the
/// parent-death signal (prctl(2)); the launcher sets it after the drop, so a tied QEMU (a
/// build step's, a boot-once run's) still dies with the thread that started it. No guest
/// boot: QEMU waits paused for a migration, and is left to itself once QMP answers.
#[test]
fn a_tied_qemu_that_dropped_root_dies_with_the_thread_that_started_it() {
    let (host, _) = host();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The guest never runs, so nothing but the signal ends this QEMU.
    let spec = paused_spec(d, 256 << 20);
    let log = d.join("qemu.log");
    let (pid, user) = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let vm = rt
            .block_on(launch::Vm::spawn(
                host,
                &spec,
                &log,
                Duration::from_secs(30),
                true,
            ))
            .unwrap_or_else(|e| panic!("start QEMU: {e}"));
        let r = (vm.pid, vm.user);
        // Not killed by the handle's Drop: only the parent-death signal may end it.
        std::mem::forget(vm);
        r
    })
    .join()
    .expect("the starting thread");
    assert!(user.is_some_and(|u| u.uid != 0), "{user:?}");
    // Dead: gone, or a zombie this process never reaps (the handle was forgotten).
    let dead = || {
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_or(true, |s| {
            s.lines()
                .any(|l| l.starts_with("State:") && l.contains("Z (zombie)"))
        })
    };
    let t0 = Instant::now();
    while !dead() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        dead(),
        "QEMU (pid {pid}) outlived the thread that started it by 10 s"
    );
}

/// Every file under `dir` (not following symlinks, not entering `skip`), by its path
/// relative to `dir` made absolute (`/usr/bin/qemu-system-x86_64`); directories are listed
/// too, with a trailing `/`.
fn tree(dir: &Path, skip: &Path) -> Vec<String> {
    fn walk(root: &Path, d: &Path, skip: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let e = e.unwrap();
            let p = e.path();
            let rel = format!("/{}", p.strip_prefix(root).unwrap().display());
            if e.file_type().unwrap().is_dir() {
                out.push(format!("{rel}/"));
                if p != skip {
                    walk(root, &p, skip, out);
                }
            } else {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, skip, &mut out);
    out.sort();
    out
}

/// Issue 37: QEMU runs as Firecracker's jailer runs it, in a mount and a pid namespace of
/// its own. Its root (`/proc/<pid>/root`) holds only QEMU's binary, the shared libraries it
/// loads with the loader's cache, its firmware directories (as `qemu -L help` lists them),
/// and a `/proc` that shows QEMU alone, as pid 1; nothing of the host besides (no `/etc`
/// files, `/dev`, `/sys`, `/tmp`, kiln's directories, the VM's own directory), and nothing
/// in it can be written, not even by root. No guest boot: QEMU waits paused for a migration.
#[test]
fn qemu_runs_in_a_private_read_only_root_and_pid_namespace_of_its_own() {
    let (host, _) = host();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = paused_spec(d, 64 << 20);
    let rt = rt();
    let vm = start_paused(&spec, d);
    let pid = vm.pid;
    for ns in ["mnt", "pid"] {
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        let its = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
        assert_ne!(ours, its, "QEMU shares this process's {ns} namespace");
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"));
    assert_eq!(
        nspid.map(|l| l.split_whitespace().collect::<Vec<_>>()),
        Some(vec![pid.to_string().as_str(), "1"]),
        "QEMU is pid 1 of a pid namespace of its own: {status}"
    );
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let exe = if host.qemu.components().count() > 1 {
        host.qemu.clone()
    } else {
        std::env::split_paths(&std::env::var_os("PATH").unwrap())
            .map(|p| p.join(&host.qemu))
            .find(|p| p.is_file())
            .expect("QEMU on PATH")
    };
    let out = Command::new(&exe).args(["-L", "help"]).output().unwrap();
    let firmware: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| format!("{}/", l.trim()))
        .collect();
    let files = tree(&root, &root.join("proc"));
    let stray: Vec<&String> = files
        .iter()
        .filter(|f| {
            !(f.ends_with('/')
                || **f == exe.display().to_string()
                || **f == "/etc/ld.so.cache"
                || f.rsplit('/').next().is_some_and(|n| n.contains(".so"))
                || firmware.iter().any(|w| f.starts_with(w.as_str())))
        })
        .collect();
    assert!(
        stray.is_empty(),
        "more than QEMU needs in its root: {stray:?}"
    );
    for absent in [
        "/etc/passwd",
        "/etc/shadow",
        "/dev",
        "/sys",
        "/tmp",
        "/root",
        "/home",
        "/var",
        "/run",
    ] {
        assert!(
            !files.iter().any(|f| f.trim_end_matches('/') == absent),
            "{absent} is in QEMU's root: {files:?}"
        );
    }
    assert!(
        !files.iter().any(|f| f.contains(&*d.display().to_string())),
        "the VM's directory is in QEMU's root: {files:?}"
    );
    assert!(files.contains(&exe.display().to_string()), "{files:?}");
    let procs: Vec<String> = std::fs::read_dir(root.join("proc"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        .collect();
    assert_eq!(procs, ["1"], "QEMU's /proc shows more than QEMU");
    for target in [root.join("written"), root.join("usr/written")] {
        let r = std::fs::File::create(&target);
        assert!(r.is_err(), "{} was written", target.display());
    }
    let r = std::fs::OpenOptions::new()
        .append(true)
        .open(root.join(exe.strip_prefix("/").unwrap()));
    assert!(r.is_err(), "QEMU's binary in its root opens for writing");
    rt.block_on(vm.kill());
}

/// The cgroup directories `pid` is in, from `/proc/<pid>/cgroup` (cgroups(7)): for each v1
/// controller of `controllers` its `/sys/fs/cgroup/<controller>/<path>`, or on a pure v2
/// host the one `/sys/fs/cgroup/<path>`.
fn cgroup_dirs(pid: u32, controllers: &[&str]) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let unified = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let mut dirs = Vec::new();
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctrls, path) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
        let rel = path.trim_start_matches('/');
        if unified && ctrls.is_empty() {
            dirs.push(Path::new("/sys/fs/cgroup").join(rel));
        } else if !unified
            && controllers
                .iter()
                .any(|c| ctrls.split(',').any(|x| x == *c))
        {
            dirs.push(Path::new("/sys/fs/cgroup").join(ctrls).join(rel));
        }
    }
    dirs
}

/// Issue 37: each QEMU runs in a cgroup of its own, with a memory limit of its guest's RAM
/// plus a headroom, a pids limit, and a CPU limit of one CPU per vCPU plus one (a CFS quota
/// over a 100 ms period) with a weight of one default group per vCPU; a QEMU that
/// takes more memory than that (here, asked over QMP to preallocate 1 GiB for a 64 MiB
/// guest, as a QEMU taken over by its guest could) is killed by the kernel, and its handle
/// says why. The group is gone once the handle has reaped QEMU. No guest boot.
#[test]
fn a_qemu_over_its_cgroups_memory_limit_is_killed_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = paused_spec(d, 64 << 20);
    let rt = rt();
    let mut vm = start_paused(&spec, d);
    let limits = vm.cgroup_limits().expect("a jailed QEMU has a cgroup");
    assert!(
        limits.memory_bytes > 64 << 20 && limits.memory_bytes < 1 << 30,
        "{limits:?}"
    );
    assert_eq!(
        (limits.cpu_quota_us, limits.cpu_period_us, limits.cpu_weight),
        (200_000, 100_000, 100),
        "one vCPU: two CPUs' worth (the vCPU, QEMU's own threads), a default weight"
    );
    let dirs = cgroup_dirs(vm.pid, &["memory", "pids", "cpu"]);
    assert!(!dirs.is_empty());
    for d in &dirs {
        assert!(
            d.to_string_lossy().contains("/kiln-qemu/step-"),
            "QEMU is not in a group of its own: {}",
            d.display()
        );
    }
    let read = |name: &str| -> String {
        dirs.iter()
            .map(|d| d.join(name))
            .find(|p| p.exists())
            .map(|p| std::fs::read_to_string(p).unwrap().trim().to_string())
            .unwrap_or_else(|| panic!("no {name} in {dirs:?}"))
    };
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        assert_eq!(read("memory.max"), limits.memory_bytes.to_string());
        assert_eq!(read("pids.max"), limits.pids_max.to_string());
        assert_eq!(read("cpu.max"), "200000 100000");
        assert_eq!(read("cpu.weight"), "100");
    } else {
        assert_eq!(
            read("memory.limit_in_bytes"),
            limits.memory_bytes.to_string()
        );
        assert_eq!(read("pids.max"), limits.pids_max.to_string());
        assert_eq!(read("cpu.cfs_quota_us"), "200000");
        assert_eq!(read("cpu.cfs_period_us"), "100000");
        assert_eq!(read("cpu.shares"), "1024");
    }
    let r = rt.block_on(vm.qmp.execute_within(
        "object-add",
        Some(serde_json::json!({
            "qom-type": "memory-backend-ram", "id": "hog", "size": 1u64 << 30, "prealloc": true
        })),
        Duration::from_secs(60),
    ));
    let status = rt
        .block_on(vm.wait_exited(Duration::from_secs(30)))
        .unwrap_or_else(|| panic!("QEMU outlived 1 GiB over its memory limit: {r:?}"));
    assert!(
        status.contains("memory limit"),
        "QEMU's end does not say it hit its memory limit: {status}"
    );
    rt.block_on(vm.kill());
    for d in &dirs {
        assert!(!d.exists(), "{} is left once QEMU is reaped", d.display());
    }
}

/// Issue 37: the files a VM's QEMU owns while it runs (its disk, memory file, console log)
/// are root's again once the handle has reaped it, so a later VM given the same uid owns
/// nothing of this one's. No guest boot: QEMU waits paused for a migration.
#[test]
fn a_reaped_qemu_gives_its_files_back_to_root() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = paused_spec(d, 64 << 20);
    let owners = || {
        ["disk.qcow2", "memory", "console.log"].map(|f| {
            let m = std::fs::metadata(d.join(f)).expect(f);
            (m.uid(), m.gid())
        })
    };
    let rt = rt();
    let vm = start_paused(&spec, d);
    let user = vm.user.expect("root starts QEMU as a user of its own");
    assert_eq!(owners(), [(user.uid, user.gid); 3], "owned while it runs");
    rt.block_on(vm.kill());
    assert_eq!(owners(), [(0, 0); 3], "given back once reaped");
}

#[test]
fn guest_boots_starts_as_its_user_and_becomes_ready_then_restores() {
    let mut vm = Vm::boot();
    let mut g = hello(&mut vm);
    // A frame the guest must refuse without dying.
    g.send(&Message::Pong(Ping { nonce: 0 }));
    use std::io::Write;
    g.s.write_all(&14u32.to_be_bytes()).unwrap();
    g.s.write_all(br#"{"v":2,"x":1}"#).unwrap();
    g.s.write_all(b" ").unwrap();
    match g.recv(&mut vm) {
        Message::Error(e) => assert!(e.message.contains("version"), "{}", e.message),
        other => panic!("expected error, got {other:?}"),
    }
    g.send(&Message::Start(Start {
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            // Two orphans that exit at once: re-parented to PID 1, which must reap them.
            "(true &); (true &); echo started > /tmp/started; exec sleep 1000".into(),
        ],
        user: Some("nobody".into()),
        env: vec!["FOO=bar".into()],
        workdir: Some("/tmp".into()),
        ready: Some(ReadyCheck {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                r#"test -s /tmp/started && test "$(id -u):$(id -g)" = 65534:65534 && test "$FOO" = bar && test "$PWD" = /tmp && test "$(hostname)" = runtime-guest && ip addr show lo | grep -q "inet 127.0.0.1" && sleep 0.3 && ! ps -o stat | grep -q Z"#.into(),
            ],
            interval_ms: 100,
            timeout_ms: 5000,
            retries: 100,
        }),
    }));
    match g.recv(&mut vm) {
        Message::Ready(r) => {
            assert!(r.attempts >= 1);
            eprintln!(
                "ready after {:?} (qemu start → ready; guest start → ready {} ms, {} checks)",
                vm.started.elapsed(),
                r.elapsed_ms,
                r.attempts
            );
        }
        other => panic!("expected ready, got {other:?}\n{}", vm.report()),
    }
    g.send(&Message::Ping(Ping { nonce: 42 }));
    assert_eq!(g.recv(&mut vm), Message::Pong(Ping { nonce: 42 }));

    let now = 1_900_000_000_000_000_000u64;
    let mut seen = Vec::new();
    for round in 0..2u8 {
        g.send(&Message::Restore(Restore::new(
            &[round; 32],
            now,
            vec!["CLONE=1".into()],
        )));
        match g.recv(&mut vm) {
            Message::Restored(r) => {
                assert_eq!(r.machine_id.len(), 32, "{r:?}");
                assert_eq!(r.random.len(), 32, "{r:?}");
                assert!(r.machine_id.bytes().all(|b| b.is_ascii_hexdigit()));
                assert_eq!(r.boot_id.len(), 36, "{r:?}");
                seen.push(r);
            }
            other => panic!("expected restored, got {other:?}\n{}", vm.report()),
        }
    }
    assert_ne!(seen[0].machine_id, seen[1].machine_id);
    assert_ne!(seen[0].random, seen[1].random);
    assert_eq!(seen[0].boot_id, seen[1].boot_id);
    // Too little entropy is refused with an error, and the guest goes on answering.
    g.send(&Message::Restore(Restore::new(&[1; 8], now, vec![])));
    assert!(matches!(g.recv(&mut vm), Message::Error(_)));
    g.send(&Message::Ping(Ping { nonce: 7 }));
    assert_eq!(g.recv(&mut vm), Message::Pong(Ping { nonce: 7 }));
}

/// Where the entries of an archive written by [`initramfs::Cpio`] end, before the writer's
/// padding: just past the trailer's name and its own 4-byte padding.
fn entries_end(archive: &[u8]) -> usize {
    let text = archive.iter().rposition(|&b| b != 0).expect("an archive") + 1;
    assert!(archive[..text].ends_with(b"TRAILER!!!"));
    (text + 1).next_multiple_of(4)
}

/// QEMU puts the initrd at the top of the microvm's RAM, where SeaBIOS, the firmware kiln
/// booted then, wrote the ACPI tables ([`initramfs::ARCHIVE_ALIGN`] says how they collided).
/// Four archives whose entries end at four different places in a page (a filler file of the
/// right size added to the guest initramfs), each padded by the writer, boot a build step's VM
/// with the most lower disks (the largest tables) to the guest's hello. Under SeaBIOS and
/// without the padding, the two that end past the middle of the page overwrote the tables and
/// every boot hung in ACPI setup; qboot keeps its tables in low memory.
#[test]
fn initramfs_ending_anywhere_in_a_page_boots_a_step_vm_with_every_disk() {
    let a = artifacts();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"))
        .join("guest-init");
    let init = initramfs::build_guest_init(&workspace(), &target).expect("build the init");
    let init = std::fs::read(init).expect("read the init");
    let modules: Vec<(String, Vec<u8>)> =
        kernel::module_closure(&a.kernel.modules_dir(), &kernel::GUEST_MODULES)
            .expect("modules")
            .into_iter()
            .map(|m| (m.name, kernel::module_bytes(&m.path).expect("module")))
            .collect();
    let archive = |filler: usize| {
        let mut c = initramfs::guest_initramfs(init.clone(), modules.clone()).expect("archive");
        c.file("filler", 0o644, vec![0x5a; filler]).expect("filler");
        c.to_bytes()
    };
    let page = initramfs::ARCHIVE_ALIGN as usize;
    let base = entries_end(&archive(0)) % page;
    let lowers = 16;
    for target_end in [500, 1500, 2500, 3500] {
        let filler = (target_end + page - base) % page;
        let bytes = archive(filler);
        assert_eq!(
            entries_end(&bytes) % page,
            target_end,
            "filler of {filler} bytes"
        );
        assert_eq!(bytes.len() % page, 0, "the writer pads to a page");
        let dir = tempfile::tempdir().unwrap();
        let ird = dir.path().join("initramfs.cpio");
        std::fs::write(&ird, &bytes).unwrap();
        let mut ro_disks = Vec::new();
        for i in 0..lowers {
            let d = dir.path().join(format!("lower{i}.ext4"));
            run(Command::new("mke2fs")
                .args(["-q", "-F", "-t", "ext4", "-b", "4096"])
                .arg(&d)
                .arg("4M"));
            ro_disks.push(d);
        }
        let upper = dir.path().join("upper.ext4");
        run(Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-O", "^has_journal"])
            .arg(&upper)
            .arg("64M"));
        let spec = step_spec(
            dir.path(),
            ird,
            upper,
            ro_disks,
            Vec::new(),
            vec![format!("kiln.step={lowers}")],
        );
        eprintln!("entries end {target_end} bytes into the last page");
        let mut vm = Vm::spawn(spec, dir);
        hello(&mut vm);
    }
}

/// The firmware hands every virtio device to the kernel in reset (launch's module doc,
/// "Firmware"). SeaBIOS, the microvm's default, left each virtio-blk device `DRIVER_OK` with
/// its vring in the RAM where the initrd is then copied; QEMU's main loop kicks such a queue
/// once, and on a busy host did so after the copy, clearing bits inside the initramfs's last
/// module (`virtio_ring.ko: Key was rejected by service`). A build step's VM with lower and
/// cache disks whose kernel loads no virtio driver (`rdinit=` a missing file: it panics
/// mounting its root, `panic=0` keeps it there) shows over QMP, once it has panicked, no
/// status bit on any virtio device: nothing but the guest's own drivers ever set one up.
/// Under SeaBIOS every virtio-blk device shows `DRIVER_OK` here, on every boot.
#[test]
fn the_firmware_hands_every_virtio_device_to_the_kernel_in_reset() {
    let a = artifacts();
    let dir = tempfile::tempdir().unwrap();
    let disk = |name: &str| {
        let p = dir.path().join(name);
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(4 << 20))
            .expect("disk");
        p
    };
    let (lowers, caches) = (4, 2);
    let spec = step_spec(
        dir.path(),
        a.initramfs.path.clone(),
        disk("upper.img"),
        (0..lowers)
            .map(|i| disk(&format!("lower{i}.img")))
            .collect(),
        (0..caches)
            .map(|i| disk(&format!("cache{i}.img")))
            .collect(),
        vec!["rdinit=/nonexistent".into(), "panic=0".into()],
    );
    let mut vm = Vm::spawn(spec, dir);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !vm.console().contains("Kernel panic") {
        if let Some(status) = vm.vm.exited() {
            panic!(
                "QEMU exited ({status}): {}\n{}",
                vm.vm.log_tail(),
                vm.report()
            );
        }
        assert!(Instant::now() < deadline, "no panic: {}", vm.report());
        std::thread::sleep(Duration::from_millis(100));
    }
    let rt = rt();
    let devices = rt
        .block_on(vm.vm.qmp.execute("x-query-virtio", None))
        .expect("x-query-virtio");
    let devices = devices.as_array().expect("a list of devices");
    let blk = devices.iter().filter(|d| d["name"] == "virtio-blk").count();
    assert_eq!(blk, 1 + lowers + caches, "{devices:?}");
    for d in devices {
        let status = rt
            .block_on(vm.vm.qmp.execute(
                "x-query-virtio-status",
                Some(serde_json::json!({"path": d["path"]})),
            ))
            .expect("x-query-virtio-status");
        assert_eq!(
            status["status"]["statuses"],
            serde_json::json!([]),
            "{} was set up before the kernel's drivers: {status}",
            d["name"]
        );
    }
}

#[test]
fn ready_check_that_never_passes_fails_with_its_timeout() {
    let mut vm = Vm::boot();
    let mut g = hello(&mut vm);
    g.send(&Message::Start(Start {
        argv: vec!["/bin/sleep".into(), "1000".into()],
        user: None,
        env: vec![],
        workdir: None,
        ready: Some(ReadyCheck {
            // Never exits by itself: each attempt is killed at its timeout.
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                "echo not listening yet >&2; exec sleep 1000".into(),
            ],
            interval_ms: 50,
            timeout_ms: 300,
            retries: 2,
        }),
    }));
    match g.recv(&mut vm) {
        Message::Failed(f) => {
            assert_eq!(f.kind, FailureKind::ReadyTimeout, "{}", f.reason);
            assert!(f.reason.contains("failed 3 times"), "{}", f.reason);
            assert!(f.reason.contains("timed out after 300 ms"), "{}", f.reason);
            assert!(
                f.reason.ends_with("output: not listening yet"),
                "{}",
                f.reason
            );
        }
        other => panic!("expected failed, got {other:?}\n{}", vm.report()),
    }
}

#[test]
fn start_command_that_cannot_start_fails() {
    let mut vm = Vm::boot();
    let mut g = hello(&mut vm);
    g.send(&Message::Start(Start {
        argv: vec!["/no/such/binary".into()],
        user: Some("nobody".into()),
        ..Start::default()
    }));
    match g.recv(&mut vm) {
        Message::Failed(f) => assert_eq!(f.kind, FailureKind::StartFailed, "{}", f.reason),
        other => panic!("expected failed, got {other:?}\n{}", vm.report()),
    }
}

#[test]
fn debian_root_boots_with_a_fresh_machine_id() {
    let mut vm = Vm::boot_root(debian_rootfs(), "512M");
    let mut g = hello(&mut vm);
    g.send(&Message::Start(Start {
        argv: vec!["/bin/sleep".into(), "1000".into()],
        user: Some("daemon".into()),
        env: vec!["LANG=C.UTF-8".into()],
        workdir: None,
        ready: Some(ReadyCheck {
            argv: vec![
                "/bin/bash".into(),
                "-c".into(),
                r#"[[ $(id -un) == daemon && $PWD == / && $(wc -c < /etc/machine-id) == 33 && $(stat -c %a /tmp) == 1777 && -d /run && -e /dev/pts/ptmx && $(cat /proc/1/comm) == init ]]"#.into(),
            ],
            interval_ms: 200,
            timeout_ms: 5000,
            retries: 50,
        }),
    }));
    match g.recv(&mut vm) {
        Message::Ready(r) => eprintln!(
            "debian ready after {:?} (qemu start → ready; {} checks)",
            vm.started.elapsed(),
            r.attempts
        ),
        other => panic!("expected ready, got {other:?}\n{}", vm.report()),
    }
}

/// A root tree: a copy of the busybox fixture changed by `edit`.
fn busybox_variant(name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let root = artifacts().dir.path().join(name);
    run(Command::new("cp")
        .arg("-a")
        .arg(&artifacts().rootfs)
        .arg(&root));
    edit(&root);
    root
}

#[test]
fn planted_machine_id_symlink_is_replaced_not_written_through() {
    let root = busybox_variant("symlinked-machine-id", |r| {
        std::os::unix::fs::symlink("/etc/passwd", r.join("etc/machine-id")).unwrap();
        std::os::unix::fs::symlink("/etc/group", r.join("etc/machine-id.kiln-tmp")).unwrap();
    });
    let mut vm = Vm::boot_root(&root, "64M");
    let mut g = hello(&mut vm);
    g.send(&Message::Start(Start {
        ready: Some(ReadyCheck {
            argv: vec![
                "/bin/sh".into(),
                "-c".into(),
                r#"grep -q "^nobody:" /etc/passwd && grep -q "^nogroup:" /etc/group && test ! -L /etc/machine-id && test "$(wc -c < /etc/machine-id)" = 33"#.into(),
            ],
            interval_ms: 100,
            timeout_ms: 5000,
            retries: 20,
        }),
        ..Start::default()
    }));
    match g.recv(&mut vm) {
        Message::Ready(_) => {}
        other => panic!("expected ready, got {other:?}\n{}", vm.report()),
    }
}

#[test]
fn image_with_a_symlinked_proc_is_refused_and_the_vm_powers_off() {
    let root = busybox_variant("symlinked-proc", |r| {
        std::fs::remove_dir(r.join("proc")).unwrap();
        std::os::unix::fs::symlink("/kiln", r.join("proc")).unwrap();
    });
    let mut vm = Vm::boot_root(&root, "64M");
    // The init powers the VM off (QEMU runs with -no-reboot and exits); bounded wait.
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = vm.vm.exit_status() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the VM did not power off\nconsole:\n{}",
            vm.console()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let console = vm.console();
    assert!(status.success(), "{status}\n{console}");
    assert!(
        console.contains("fatal: mounting /newroot/proc") && console.contains("symlink"),
        "{console}"
    );
}

#[test]
fn kernel_cache_entry_whose_vmlinux_changed_is_refused() {
    let k = &artifacts().kernel;
    let cache = tempfile::tempdir().unwrap();
    let entry = cache.path().join("kernel").join(k.dir.file_name().unwrap());
    std::fs::create_dir_all(&entry).unwrap();
    std::fs::copy(k.dir.join("kernel.json"), entry.join("kernel.json")).unwrap();
    let mut bytes = std::fs::read(k.vmlinux()).unwrap();
    bytes[4096] ^= 1;
    std::fs::write(entry.join("vmlinux"), bytes).unwrap();
    match kernel::fetch(cache.path(), &k.requested) {
        Err(kernel::KernelError::Cache(dir, why)) => {
            assert_eq!(dir, entry);
            assert!(why.contains("digest"), "{why}");
        }
        other => panic!("expected a cache error, got {other:?}"),
    }
}
