//! Real guest boots under QEMU (`-M microvm`, TCG): Debian's cloud kernel (fetched by name,
//! uncompressed vmlinux), the initramfs with the static kiln-guest-init, a busybox ext4 root
//! (`mke2fs -d` from the unpacked KILN_TEST_BUSYBOX_OCI fixture), and the host side of the
//! guest protocol spoken over the virtio-serial socket by plain std code.
//!
//! Needs: ci/setup.sh (qemu-system-x86 10, e2fsprogs, umoci, apt lists for bookworm,
//! KILN_TEST_CACHE and KILN_TEST_BUSYBOX_OCI). Boot times are printed, never asserted.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

/// A running VM; killed on drop.
struct Vm {
    qemu: Child,
    console: PathBuf,
    sock: PathBuf,
    _dir: tempfile::TempDir,
    started: Instant,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
    }
}

impl Vm {
    fn boot() -> Vm {
        Vm::boot_root(&artifacts().rootfs, "64M")
    }

    fn boot_root(rootfs: &Path, size: &str) -> Vm {
        let a = artifacts();
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("root.ext4");
        run(Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d"])
            .arg(rootfs)
            .arg(&disk)
            .arg(size));
        let console = dir.path().join("console.log");
        let sock = dir.path().join("guest.sock");
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let tsc_khz = launch::parse_tsc_khz(&cpuinfo).expect("cpu MHz in /proc/cpuinfo");
        let append =
            format!("console=ttyS0 tsc_early_khz={tsc_khz} tsc=reliable panic=-1 reboot=t quiet");
        let p = |x: &Path| x.display().to_string();
        let started = Instant::now();
        let qemu = Command::new("qemu-system-x86_64")
            .args(["-M", "microvm", "-accel", "tcg", "-m", "256", "-smp", "1"])
            .args(["-cpu", &format!("{},enforce", launch::CPU_MODEL)])
            .args([
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-no-reboot",
            ])
            .args(["-serial", &format!("file:{}", p(&console))])
            .args(["-kernel", &p(&a.kernel.vmlinux())])
            .args(["-initrd", &p(&a.initramfs.path)])
            .args(["-append", &append])
            .args([
                "-drive",
                &format!("id=root,file={},format=raw,if=none", p(&disk)),
            ])
            .args(["-device", "virtio-blk-device,drive=root"])
            .args(["-device", "virtio-serial-device"])
            .args([
                "-chardev",
                &format!("socket,id=guest,path={},server=on,wait=off", p(&sock)),
            ])
            .args([
                "-device",
                &format!("virtserialport,chardev=guest,name={}", protocol::PORT_NAME),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start qemu-system-x86_64 (run ci/setup.sh)");
        Vm {
            qemu,
            console,
            sock,
            _dir: dir,
            started,
        }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
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
            if let Ok(Some(status)) = self.qemu.try_wait() {
                let mut err = String::new();
                if let Some(e) = self.qemu.stderr.take() {
                    for l in BufReader::new(e).lines().map_while(Result::ok) {
                        err.push_str(&l);
                        err.push('\n');
                    }
                }
                panic!(
                    "qemu exited ({status}): {err}\nconsole:\n{}",
                    self.console()
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
    fn recv(&mut self, vm: &Vm) -> Message {
        match protocol::read_frame(&mut self.s) {
            Ok(Some(body)) => protocol::decode_body(&body).unwrap_or_else(|e| {
                panic!("guest sent a bad message: {e}\nconsole:\n{}", vm.console())
            }),
            other => panic!(
                "no message from the guest: {other:?}\nconsole:\n{}",
                vm.console()
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
    match g.recv(&vm) {
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
    match g.recv(&vm) {
        Message::Ready(r) => {
            assert!(r.attempts >= 1);
            eprintln!(
                "ready after {:?} (qemu start → ready; guest start → ready {} ms, {} checks)",
                vm.started.elapsed(),
                r.elapsed_ms,
                r.attempts
            );
        }
        other => panic!("expected ready, got {other:?}\nconsole:\n{}", vm.console()),
    }
    g.send(&Message::Ping(Ping { nonce: 42 }));
    assert_eq!(g.recv(&vm), Message::Pong(Ping { nonce: 42 }));

    let now = 1_900_000_000_000_000_000u64;
    let mut seen = Vec::new();
    for round in 0..2u8 {
        g.send(&Message::Restore(Restore::new(
            &[round; 32],
            now,
            vec!["CLONE=1".into()],
        )));
        match g.recv(&vm) {
            Message::Restored(r) => {
                assert_eq!(r.machine_id.len(), 32, "{r:?}");
                assert_eq!(r.random.len(), 32, "{r:?}");
                assert!(r.machine_id.bytes().all(|b| b.is_ascii_hexdigit()));
                assert_eq!(r.boot_id.len(), 36, "{r:?}");
                seen.push(r);
            }
            other => panic!(
                "expected restored, got {other:?}\nconsole:\n{}",
                vm.console()
            ),
        }
    }
    assert_ne!(seen[0].machine_id, seen[1].machine_id);
    assert_ne!(seen[0].random, seen[1].random);
    assert_eq!(seen[0].boot_id, seen[1].boot_id);
    // Too little entropy is refused with an error, and the guest goes on answering.
    g.send(&Message::Restore(Restore::new(&[1; 8], now, vec![])));
    assert!(matches!(g.recv(&vm), Message::Error(_)));
    g.send(&Message::Ping(Ping { nonce: 7 }));
    assert_eq!(g.recv(&vm), Message::Pong(Ping { nonce: 7 }));
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
    match g.recv(&vm) {
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
        other => panic!("expected failed, got {other:?}\nconsole:\n{}", vm.console()),
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
    match g.recv(&vm) {
        Message::Failed(f) => assert_eq!(f.kind, FailureKind::StartFailed, "{}", f.reason),
        other => panic!("expected failed, got {other:?}\nconsole:\n{}", vm.console()),
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
    match g.recv(&vm) {
        Message::Ready(r) => eprintln!(
            "debian ready after {:?} (qemu start → ready; {} checks)",
            vm.started.elapsed(),
            r.attempts
        ),
        other => panic!("expected ready, got {other:?}\nconsole:\n{}", vm.console()),
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
    match g.recv(&vm) {
        Message::Ready(_) => {}
        other => panic!("expected ready, got {other:?}\nconsole:\n{}", vm.console()),
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
        if let Some(s) = vm.qemu.try_wait().unwrap() {
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
