//! Attacks on the jail kiln starts every QEMU in as root (issue 37), from the point of view of
//! a guest that has taken over its QEMU. QMP stands in for "QEMU does what the attacker
//! wants": it opens files by path (`blockdev-add`, `chardev-add`, `pmemsave`,
//! `memory-backend-file`, HMP `drive_add`), connects and listens on sockets (`chardev-add`),
//! and starts threads (`iothread` objects). Each attack must fail, and QEMU keep running.
//!
//! No guest boot: QEMU waits paused for an incoming migration that never comes.
//!
//! Needs: ci/setup.sh (qemu-system-x86 10, the guest kernel and initramfs), root.

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kiln_vmm::launch;
use serde_json::{Value, json};

/// The runtime the launcher's async API runs on (the tests themselves are synchronous).
fn rt() -> &'static tokio::runtime::Runtime {
    kiln_tests::vm::runtime()
}

/// This host's QEMU and the accelerator kiln picks for it, probed once; QEMUs' cgroup maker
/// installed (a jailed QEMU is never started without its group).
fn host() -> &'static (launch::Host, launch::Accel) {
    static H: OnceLock<(launch::Host, launch::Accel)> = OnceLock::new();
    H.get_or_init(|| {
        kiln_pipeline::qemu_cgroups::install();
        let a = kiln_tests::vm::guest_assets();
        kiln_tests::vm::probe_host(&a.kernel, &a.initramfs)
    })
}

/// A jailed QEMU, paused, waiting for an incoming migration; killed when dropped.
struct Jailed {
    vm: launch::Vm,
    spec: launch::VmSpec,
    dir: tempfile::TempDir,
}

impl Jailed {
    /// A VM whose files are in a fresh directory: a 64 MiB shared memory file, an empty 1 MiB
    /// qcow2 disk over a raw backing file, its sockets and console log.
    fn start() -> Jailed {
        let (host, accel) = host();
        let a = kiln_tests::vm::guest_assets();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let spec = kiln_tests::vm::paused_spec(host, *accel, &a, d, 64 << 20, true);
        let vm = rt()
            .block_on(launch::Vm::spawn(
                host,
                &spec,
                &d.join("qemu.log"),
                Duration::from_secs(30),
                false,
            ))
            .unwrap_or_else(|e| panic!("start QEMU: {e}"));
        assert!(
            vm.user.is_some_and(|u| u.uid != 0),
            "kiln runs as root here, so QEMU must run as a user of its own: {:?}",
            vm.user
        );
        Jailed { vm, spec, dir }
    }

    /// A QMP command; its answer, or QEMU's error text.
    fn qmp(&mut self, cmd: &str, args: Value) -> Result<Value, String> {
        rt().block_on(
            self.vm
                .qmp
                .execute_within(cmd, Some(args), Duration::from_secs(20)),
        )
        .map_err(|e| e.to_string())
    }

    /// QEMU's name for a file handed to it (`/proc/self/fd/<n>`).
    fn handed(&self, path: &Path) -> String {
        let n = self.vm.qemu_path(path);
        assert!(
            n.starts_with("/proc/self/fd/"),
            "{} not handed: {n}",
            path.display()
        );
        n
    }

    fn assert_alive(&mut self) {
        assert_eq!(self.vm.exited(), None, "QEMU died: {}", self.vm.log_tail());
    }
}

/// The outcome of each attack of a list: what it did and what QEMU answered.
#[derive(Default)]
struct Attacks {
    /// (attack, why it must fail: the error it must give, one of).
    succeeded: Vec<String>,
    wrong_error: Vec<String>,
}

impl Attacks {
    /// `r` must be an error whose text contains one of `expect` (empty: any error).
    fn check(&mut self, what: &str, r: Result<Value, String>, expect: &[&str]) {
        match r {
            Ok(v) => {
                eprintln!("SUCCEEDED {what}: {v}");
                self.succeeded.push(format!("{what}: {v}"));
            }
            Err(e) => {
                eprintln!("blocked   {what}: {e}");
                if !expect.is_empty() && !expect.iter().any(|x| e.contains(x)) {
                    self.wrong_error
                        .push(format!("{what}: {e} (expected {expect:?})"));
                }
            }
        }
    }

    fn assert_all_blocked(self) {
        assert!(
            self.succeeded.is_empty() && self.wrong_error.is_empty(),
            "attacks that succeeded: {:#?}\nblocked by something else than the jail: {:#?}",
            self.succeeded,
            self.wrong_error
        );
    }
}

const ENOENT: &str = "No such file or directory";
const EACCES: &str = "Permission denied";
const EROFS: &str = "Read-only file system";

/// Issue 37: a QEMU taken over by its guest opens no host file by any path. Neither through
/// `/proc` (`/proc/1/root`, `/proc/self/root/..`, `/proc/self/cwd/..`, a handed descriptor's
/// `..`), nor by absolute host path (secrets, kiln's directories, the VM's own directory and
/// files, host sockets); it reopens none of its read-only inputs for writing (the kernel, the
/// qcow2 backing file); it creates no file anywhere (its root is read-only, `/proc` takes no
/// new file, there is no `/tmp` or `/dev/shm`); and no descriptor it inherited names a host
/// file it was not handed. QEMU keeps running through all of it.
#[test]
fn a_jailed_qemu_opens_no_host_file_by_any_path() {
    let mut j = Jailed::start();
    let d = j.dir.path().to_path_buf();
    let kernel = j.handed(&j.spec.kernel.clone());
    let backing = j.handed(&d.join("base.raw"));
    let mut a = Attacks::default();
    let mut n = 0;
    let mut read = |j: &mut Jailed, a: &mut Attacks, path: &str, ro: bool, expect: &[&str]| {
        n += 1;
        let r = j.qmp(
            "blockdev-add",
            json!({"driver": "file", "node-name": format!("n{n}"), "filename": path,
                   "read-only": ro}),
        );
        let mode = if ro { "read" } else { "read-write" };
        a.check(&format!("blockdev-add file {path} {mode}"), r, expect);
    };
    // Host files by absolute path, and through /proc's magic links.
    let shadow = "/etc/shadow";
    for p in [
        shadow.to_string(),
        "/etc/passwd".into(),
        "/root/.bashrc".into(),
        "/var/cache/kiln-ci/env".into(),
        "/run/kiln/qemu-uid.lock".into(),
        d.join("memory").display().to_string(),
        d.join("base.raw").display().to_string(),
        j.spec.kernel.display().to_string(),
        format!("/proc/1/root{shadow}"),
        format!("/proc/self/root/..{shadow}"),
        format!("/proc/self/root/../../..{shadow}"),
        format!("/proc/self/cwd/..{shadow}"),
        format!("/proc/1/cwd/../..{shadow}"),
        format!("/proc/self/fd/0/..{shadow}"),
        format!("{kernel}/../..{shadow}"),
        format!("/proc/self/exe/../..{shadow}"),
        format!("/proc/self/map_files/..{shadow}"),
        "/proc/kcore".into(),
        "/proc/sys/kernel/core_pattern".into(),
        "/proc/sysrq-trigger".into(),
        "/sys/kernel/notes".into(),
        "/dev/kvm".into(),
        "/dev/mem".into(),
        "/dev/sda".into(),
    ] {
        read(
            &mut j,
            &mut a,
            &p,
            true,
            &[ENOENT, "Not a directory", EACCES],
        );
    }
    // Its read-only inputs, reopened through their descriptors for writing.
    read(&mut j, &mut a, &kernel, false, &[EACCES]);
    read(&mut j, &mut a, &backing, false, &[EACCES]);
    read(&mut j, &mut a, "/proc/self/fd/1", false, &[EACCES]);
    // HMP opens by path too.
    let r = j.qmp(
        "human-monitor-command",
        json!({"command-line": format!("drive_add 0 if=none,id=h1,readonly=on,file={shadow}")}),
    );
    let r = match r {
        Ok(Value::String(s)) if s.contains("Could not open") || s.contains(ENOENT) => Err(s),
        other => other,
    };
    a.check("HMP drive_add /etc/shadow", r, &[ENOENT]);
    // New files: a chardev's output file, a memory dump, a memory backend's file.
    let mut c = 0;
    for (p, expect) in [
        ("/x".to_string(), [EROFS, EROFS]),
        ("/usr/x".into(), [EROFS, EROFS]),
        ("/proc/x".into(), [ENOENT, EACCES]),
        ("/proc/1/x".into(), [ENOENT, EACCES]),
        ("/proc/1/root/x".into(), [EROFS, EROFS]),
        ("/tmp/x".into(), [ENOENT, ENOENT]),
        ("/dev/shm/x".into(), [ENOENT, ENOENT]),
        (d.join("written").display().to_string(), [ENOENT, ENOENT]),
        (kernel.clone(), [EACCES, EACCES]),
        (backing.clone(), [EACCES, EACCES]),
    ] {
        c += 1;
        let r = j.qmp(
            "chardev-add",
            json!({"id": format!("f{c}"), "backend": {"type": "file", "data": {"out": p}}}),
        );
        a.check(&format!("chardev-add file out={p}"), r, &expect);
        let r = j.qmp("pmemsave", json!({"val": 0, "size": 4096, "filename": p}));
        a.check(&format!("pmemsave {p}"), r, &expect);
    }
    let mut m = 0;
    for p in [
        "/dev/shm",
        "/tmp",
        "/",
        "/usr/share",
        "/proc",
        "/proc/self",
        kernel.as_str(),
    ] {
        m += 1;
        let r = j.qmp(
            "object-add",
            json!({"qom-type": "memory-backend-file", "id": format!("m{m}"), "size": 1 << 20,
                   "mem-path": p, "share": true}),
        );
        a.check(
            &format!("memory-backend-file mem-path={p}"),
            r,
            &[ENOENT, EROFS, EACCES],
        );
    }
    // Sockets by path: the test's QMP socket, its channel, host daemons' sockets; a listening
    // socket made in its root.
    for p in [
        j.spec.qmp_socket.display().to_string(),
        j.spec.guest_socket.display().to_string(),
        "/run/dbus/system_bus_socket".into(),
        "/run/postgresql/.s.PGSQL.5433".into(),
        "/var/run/postgresql/.s.PGSQL.5433".into(),
        "/run/systemd/private".into(),
    ] {
        c += 1;
        let r = j.qmp(
            "chardev-add",
            json!({"id": format!("u{c}"), "backend": {"type": "socket", "data": {
                "addr": {"type": "unix", "data": {"path": p}}, "server": false}}}),
        );
        a.check(&format!("chardev-add unix connect {p}"), r, &[ENOENT]);
    }
    for (p, expect) in [("/x.sock", EROFS), ("/proc/x.sock", ENOENT)] {
        c += 1;
        let r = j.qmp(
            "chardev-add",
            json!({"id": format!("s{c}"), "backend": {"type": "socket", "data": {
                "addr": {"type": "unix", "data": {"path": p}}, "server": true, "wait": false}}}),
        );
        a.check(
            &format!("chardev-add unix listen {p}"),
            r,
            &[expect, EACCES],
        );
    }
    // A migration's output file (refused while QEMU waits for an incoming one; either way no
    // file appears).
    let beside = d.join("migrated");
    for uri in [
        "file:/x".to_string(),
        "file:/proc/x".into(),
        format!("file:{}", beside.display()),
    ] {
        let r = j.qmp("migrate", json!({"uri": uri}));
        if r.is_ok() {
            let _ = rt().block_on(j.vm.qmp.wait_migration(Duration::from_secs(10)));
        }
        a.check(&format!("migrate {uri}"), r, &[]);
    }
    j.assert_alive();
    for f in ["written", "migrated"] {
        assert!(!d.join(f).exists(), "QEMU wrote {f} in its VM's directory");
    }
    a.assert_all_blocked();
}

/// Issue 37: a jailed QEMU holds no descriptor of its starter's but the ones it was handed.
/// The starter (kiln) may hold descriptors without close-on-exec that it never meant to give
/// away: inherited from its own parent (a service manager's sockets, a pipe), or opened by a
/// library. Here the test opens a root-only file of the host read-write, without
/// close-on-exec, before QEMU starts: QEMU must not hold it (it could read and write that
/// file as root's descriptor allows, whatever its uid), nor any other descriptor naming a
/// host file it was not handed, nor a pipe.
#[test]
fn a_jailed_qemu_inherits_no_descriptor_it_was_not_handed() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;
    let secret_dir = tempfile::tempdir().unwrap();
    let secret = secret_dir.path().join("root-only");
    std::fs::write(&secret, b"a host secret").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let planted = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&secret)
        .unwrap();
    rustix::io::fcntl_setfd(&planted, rustix::io::FdFlags::empty()).unwrap();
    let j = Jailed::start();
    let d = j.dir.path();
    let allowed: Vec<String> = [
        j.spec.kernel.clone(),
        j.spec.initramfs.clone(),
        j.spec.memory_file.clone(),
        j.spec.disk.clone(),
        j.spec.serial_log.clone(),
        d.join("base.raw"),
        d.join("qemu.log"),
        "/dev/null".into(),
    ]
    .iter()
    .map(|p| p.display().to_string())
    .collect();
    let mut stray = Vec::new();
    let mut holds_planted = false;
    for e in std::fs::read_dir(format!("/proc/{}/fd", j.vm.pid)).unwrap() {
        let e = e.unwrap();
        let fd = e.file_name().to_string_lossy().into_owned();
        let t = std::fs::read_link(e.path()).unwrap_or_default();
        let t = t.display().to_string();
        eprintln!("QEMU fd {fd} -> {t}");
        if t == secret.display().to_string() {
            holds_planted = true;
        }
        if (t.starts_with('/') && !allowed.contains(&t)) || t.starts_with("pipe:") {
            stray.push(format!("{fd} -> {t}"));
        }
    }
    assert!(
        !holds_planted && stray.is_empty(),
        "QEMU inherited descriptors it was not handed: {stray:?} (the root-only file this \
         test opened read-write as fd {} is among them: {holds_planted})",
        planted.as_raw_fd()
    );
}

/// Issue 37: a QEMU taken over by its guest reaches no host socket outside its jail: not a
/// TCP service on the host's loopback (the test services: registry, S3, PostgreSQL listen
/// there), not an abstract unix socket (a namespace of the network namespace, not of the
/// file system), and it opens no listening port on the host. Each is a `chardev-add` socket
/// to a listener this test made.
#[test]
fn a_jailed_qemu_reaches_no_host_network_or_abstract_socket() {
    let mut j = Jailed::start();
    let mut a = Attacks::default();
    let shared: Vec<&str> = ["net", "ipc", "uts", "cgroup", "user"]
        .into_iter()
        .filter(|ns| {
            let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
            ours == std::fs::read_link(format!("/proc/{}/ns/{ns}", j.vm.pid)).unwrap()
        })
        .collect();
    eprintln!("namespaces QEMU shares with the host: {shared:?}");
    // TCP to a host service on loopback.
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    tcp.set_nonblocking(true).unwrap();
    let port = tcp.local_addr().unwrap().port();
    let r = j.qmp(
        "chardev-add",
        json!({"id": "tcp", "backend": {"type": "socket", "data": {
            "addr": {"type": "inet", "data": {"host": "127.0.0.1", "port": port.to_string()}},
            "server": false}}}),
    );
    a.check(&format!("chardev-add tcp connect 127.0.0.1:{port}"), r, &[]);
    // An abstract unix socket on the host.
    let name = format!("kiln-jail-test-{}", std::process::id());
    let abs = {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        std::os::unix::net::UnixListener::bind_addr(&addr).unwrap()
    };
    abs.set_nonblocking(true).unwrap();
    let r = j.qmp(
        "chardev-add",
        json!({"id": "abs", "backend": {"type": "socket", "data": {
            "addr": {"type": "unix", "data": {"path": name, "abstract": true}},
            "server": false}}}),
    );
    a.check(&format!("chardev-add unix connect @{name}"), r, &[]);
    // A listening port on the host, that the test connects to.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let lport = free.local_addr().unwrap().port();
    drop(free);
    let r = j.qmp(
        "chardev-add",
        json!({"id": "listen", "backend": {"type": "socket", "data": {
            "addr": {"type": "inet", "data": {"host": "127.0.0.1", "port": lport.to_string()}},
            "server": true, "wait": false}}}),
    );
    // Listening is allowed to succeed inside QEMU's own network namespace, which nothing on
    // the host can reach; the breach would be the host connecting to it (`listened` below).
    eprintln!("chardev-add tcp listen 127.0.0.1:{lport}: {r:?}");
    // What reached the host, whatever QEMU answered.
    let tcp_in = tcp.accept().is_ok();
    let abs_in = abs.accept().is_ok();
    let listened = std::net::TcpStream::connect(("127.0.0.1", lport)).is_ok();
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let r = j.qmp(
        "chardev-add",
        json!({"id": "udp", "backend": {"type": "udp", "data": {
            "remote": {"type": "inet", "data": {"host": "127.0.0.1",
                "port": udp.local_addr().unwrap().port().to_string()}}}}}),
    );
    a.check("chardev-add udp to a host port", r, &[]);
    eprintln!("reached the host: tcp {tcp_in}, abstract {abs_in}, listened {listened}");
    j.assert_alive();
    assert!(
        !tcp_in && !abs_in && !listened,
        "a jailed QEMU reached the host: TCP connect {tcp_in}, abstract unix connect {abs_in}, \
         TCP listen {listened}"
    );
    a.assert_all_blocked();
}

/// Issue 37: a QEMU taken over by its guest cannot fill the host's disk through the files it
/// was handed to write. Its console log is one (created empty, owned by its user); QMP's
/// `pmemsave` writes any length of "physical memory" (unbacked addresses read as filler) to
/// a file QEMU opens, here `/proc/self/fd/<console log>`: 96 MiB, 1.5 times the guest's RAM.
/// The log must stay within QEMU's `RLIMIT_FSIZE` (Firecracker's jailer:
/// `--resource-limit fsize=`), which kiln sets to the VM's largest legitimate file plus
/// slack ([`kiln_vmm::jail::file_size_limit`]: here the 64 MiB shared memory file, so about
/// 81 MiB), and QEMU lives on (the write fails with `EFBIG`).
#[test]
fn a_jailed_qemu_cannot_grow_its_console_log_past_a_bound() {
    let mut j = Jailed::start();
    let console = j.handed(&j.spec.serial_log.clone());
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", j.vm.pid)).unwrap();
    let fsize = limits
        .lines()
        .find(|l| l.starts_with("Max file size"))
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    eprintln!("{fsize}");
    let size: u64 = 96 << 20;
    let t0 = Instant::now();
    let r = rt().block_on(j.vm.qmp.execute_within(
        "pmemsave",
        Some(json!({"val": 0, "size": size, "filename": console})),
        Duration::from_secs(120),
    ));
    let written = std::fs::metadata(&j.spec.serial_log).unwrap().len();
    eprintln!(
        "pmemsave {size} bytes to the console log: {r:?} in {:?}; the log has {written} bytes",
        t0.elapsed()
    );
    // The bytes are the host's disk's: give them back now.
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .open(&j.spec.serial_log)
        .and_then(|f| f.set_len(0));
    j.assert_alive();
    let bound = kiln_vmm::jail::file_size_limit(&j.spec).unwrap();
    assert!(
        bound < size && bound <= j.spec.memory_bytes + (j.spec.memory_bytes / 64) + (16 << 20),
        "the file size limit {bound} does not bound this VM's files"
    );
    assert!(
        written <= bound,
        "QEMU wrote {written} bytes into its console log on the host's disk (bound: \
         {bound}; QEMU's {fsize:?})"
    );
}

/// The number of threads of `pid` (`Threads:` of /proc/<pid>/status); `None` once gone.
fn threads(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Issue 37: a QEMU taken over by its guest starts no more threads than its cgroup's pids
/// limit allows: asked over QMP for more `iothread` objects (one thread each) than the
/// limit, it never has more threads than the limit, and it either refuses the objects past
/// it or dies of it alone (QEMU 10 aborts when a thread cannot be made, `qemu_thread_create`:
/// a guest can end its own QEMU, nothing else).
#[test]
fn a_jailed_qemu_starts_no_threads_past_its_pids_limit() {
    let mut j = Jailed::start();
    let pids_max =
        j.vm.cgroup_limits()
            .expect("a jailed QEMU has a cgroup")
            .pids_max;
    let pid = j.vm.pid;
    let before = threads(pid).unwrap();
    eprintln!("pids.max {pids_max}, threads at start {before}");
    let mut most = before;
    let mut refused = None;
    let t0 = Instant::now();
    for i in 0..pids_max + 32 {
        let r = j.qmp(
            "object-add",
            json!({"qom-type": "iothread", "id": format!("io{i}")}),
        );
        match threads(pid) {
            Some(n) => most = most.max(n),
            None => break,
        }
        if let Err(e) = r {
            refused = Some((i, e));
            break;
        }
    }
    // A thread QEMU fails to make aborts it (qemu_thread_create): give it time to go.
    let status = match &refused {
        Some(_) => rt().block_on(j.vm.wait_exited(Duration::from_secs(5))),
        None => j.vm.exited(),
    };
    eprintln!(
        "most threads {most}, refused {refused:?}, QEMU exited {status:?} after {:?}; log: {}",
        t0.elapsed(),
        j.vm.log_tail()
    );
    assert!(
        most <= pids_max,
        "QEMU ran {most} threads, over its pids limit of {pids_max}"
    );
    assert!(
        refused.is_some() || status.is_some(),
        "QEMU started {} iothreads past its pids limit of {pids_max} without refusing one",
        pids_max + 32
    );
}

/// Issue 37: two jailed QEMUs run as different users, each in a pid namespace of its own, so
/// one taken over by its guest reaches nothing of the other: not its memory
/// (`/proc/<pid>/mem`), its environment, its root, its descriptors (the other's memory file)
/// by the other's host pid, nor the other's files by host path.
#[test]
fn a_jailed_qemu_reaches_nothing_of_another() {
    let mut a_vm = Jailed::start();
    let b_vm = Jailed::start();
    let (ua, ub) = (a_vm.vm.user.unwrap(), b_vm.vm.user.unwrap());
    assert_ne!(ua.uid, ub.uid, "two QEMUs share a uid");
    assert_ne!(ua.gid, ub.gid, "two QEMUs share a gid");
    let its_pidns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap();
    assert_ne!(its_pidns(a_vm.vm.pid), its_pidns(b_vm.vm.pid));
    // What A's /proc shows: itself alone.
    let procs: Vec<String> = std::fs::read_dir(format!("/proc/{}/root/proc", a_vm.vm.pid))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        .collect();
    assert_eq!(procs, ["1"], "QEMU's /proc shows more than QEMU");
    let b_memory = b_vm.handed(&b_vm.spec.memory_file);
    let b_fd = b_memory.rsplit('/').next().unwrap().to_string();
    let mut a = Attacks::default();
    let mut n = 0;
    // B's host pid (its own pid namespace's 1 is A itself in A's view; A's pids 2, 3...
    // are A's own threads).
    for pid in [b_vm.vm.pid.to_string()] {
        for f in [
            "mem".to_string(),
            "environ".into(),
            "root/usr".into(),
            format!("fd/{b_fd}"),
            "map_files/x".into(),
        ] {
            let p = format!("/proc/{pid}/{f}");
            n += 1;
            let r = a_vm.qmp(
                "blockdev-add",
                json!({"driver": "file", "node-name": format!("b{n}"), "filename": p,
                       "read-only": true}),
            );
            a.check(&format!("blockdev-add file {p}"), r, &[ENOENT]);
        }
    }
    for p in [
        b_vm.spec.memory_file.clone(),
        b_vm.spec.disk.clone(),
        b_vm.dir.path().join("base.raw"),
    ] {
        n += 1;
        let r = a_vm.qmp(
            "blockdev-add",
            json!({"driver": "file", "node-name": format!("b{n}"), "filename": p,
                   "read-only": true}),
        );
        a.check(&format!("blockdev-add file {}", p.display()), r, &[ENOENT]);
    }
    a_vm.assert_alive();
    a.assert_all_blocked();
}
