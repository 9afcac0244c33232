//! The forked side of a namespace step ([`super::LinuxExecutor::run`]): the keeper, which
//! joins the step's cgroup and network namespace, unshares the others and forks pid 1; and
//! pid 1, which mounts the step's root and runs its command. Everything here runs in a
//! forked child and never returns.

use super::*;

/// Closes every descriptor of this process but `keep` (listed from `/proc/self/fd`), so no
/// descriptor of the (possibly busy, multithreaded) caller reaches a step: neither a host
/// file nor another step's pipes.
fn close_other_fds(keep: &[RawFd]) -> Result<(), String> {
    let fds: Vec<RawFd> = fs::read_dir("/proc/self/fd")
        .map_err(|e| format!("listing /proc/self/fd: {e}"))?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    for fd in fds {
        if !keep.contains(&fd) {
            // SAFETY: closing a descriptor number; nothing in this process refers to it
            // afterwards (the forked child holds no Rust-owned descriptors but `keep`).
            unsafe {
                libc::close(fd);
            }
        }
    }
    Ok(())
}

/// Makes this forked child die (SIGKILL) when the thread that forked it exits
/// (`PR_SET_PDEATHSIG`, prctl(2)), and exits at once if `parent` already died before that
/// took effect (the child was then reparented, and no signal will come).
pub(super) fn tie_to_parent(parent: rustix::process::Pid) {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    if rustix::process::getppid() != Some(parent) {
        // SAFETY: exiting a forked child.
        unsafe { libc::_exit(SETUP_FAILED) }
    }
}

pub(super) fn keeper_main(plan: &ChildPlan, fds: &Fds) -> ! {
    // Die with the caller: a keeper whose executor is gone kills its step (pid 1 below dies
    // with the keeper, and the kernel then kills the rest of its pid namespace).
    tie_to_parent(plan.parent);
    let mut keep = vec![
        0,
        1,
        2,
        fds.log_w,
        fds.err_w,
        fds.status_w,
        fds.sync_w,
        fds.go_r,
    ];
    keep.extend(plan.userns.map(|(_, fd)| fd));
    keep.extend(plan.net_ns.as_ref().map(|fd| fd.as_raw_fd()));
    if let Err(msg) = close_other_fds(&keep) {
        fail(fds, &msg);
    }
    for f in &plan.procs_files {
        if let Err(e) = fs::write(f, "0") {
            fail(fds, &format!("joining cgroup {}: {e}", f.display()));
        }
    }
    use rustix::thread::UnshareFlags as U;
    let mut flags = U::NEWNS | U::NEWPID | U::NEWUTS | U::NEWIPC;
    if let Some(net) = &plan.net_ns {
        // SAFETY: setns(2) on a descriptor we own, in this single-threaded keeper.
        if unsafe { libc::setns(net.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let e = std::io::Error::last_os_error();
            fail(fds, &format!("joining the step's network namespace: {e}"));
        }
    } else if plan.unshare_net {
        flags |= U::NEWNET;
    }
    // SAFETY: the keeper is single-threaded (a fresh fork) and holds no file-table or
    // fs-struct sharing assumptions.
    if let Err(e) = unsafe { rustix::thread::unshare_unsafe(flags) } {
        fail(fds, &format!("unshare: {e}"));
    }
    if plan.wait_for_net {
        write_all_fd(fds.sync_w, b"s");
        let mut b = [0u8; 1];
        // SAFETY: reading into a valid one-byte buffer.
        let n = unsafe { libc::read(fds.go_r, b.as_mut_ptr().cast(), 1) };
        if n != 1 {
            fail(fds, "the executor went away before the network was ready");
        }
    }
    // Pid 1 cannot see its parent (getppid is 0 across the pid namespace), so it learns
    // whether the keeper is still there from this pipe: the keeper holds the write end
    // until it exits.
    let mut alive = [0 as RawFd; 2];
    // SAFETY: pipe2 into a valid two-element array.
    if unsafe { libc::pipe2(alive.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        fail(fds, &format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: as for the first fork; the keeper is single-threaded.
    let pid1 = unsafe { libc::fork() };
    if pid1 < 0 {
        fail(fds, &format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid1 == 0 {
        // SAFETY: closing our copy of the write end.
        unsafe { libc::close(alive[1]) };
        die_with_keeper(alive[0]);
        if let Err(msg) = pid1_main(plan, fds, alive[0]) {
            fail(fds, &msg);
        }
        // pid1_main only returns on error; exec replaced us otherwise.
        fail(fds, "exec returned");
    }
    // SAFETY: closing our copies so the log and error pipes close when pid 1 is done.
    unsafe {
        libc::close(fds.log_w);
        libc::close(fds.err_w);
    }
    let mut st = 0;
    loop {
        // SAFETY: waiting for our own child with a valid status pointer.
        let r = unsafe { libc::waitpid(pid1, &mut st, 0) };
        if r == pid1 {
            break;
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // SAFETY: exiting a forked child.
            unsafe { libc::_exit(SETUP_FAILED) }
        }
    }
    write_all_fd(fds.status_w, &st.to_ne_bytes());
    // SAFETY: exiting a forked child.
    unsafe { libc::_exit(0) }
}

fn cstr(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("NUL byte in {s:?}"))
}

fn mnt(
    src: &str,
    target: &str,
    fstype: &str,
    flags: MountFlags,
    data: Option<&CStr>,
) -> Result<(), String> {
    rustix::mount::mount(src, target, fstype, flags, data)
        .map_err(|e| format!("mounting {fstype} on {target}: {e}"))
}

/// Mounts the step's overlay on `merged` ([`crate::exec::overlay::mount`]; nodev: device
/// nodes the step makes with CAP_MKNOD cannot be opened). The builder gives a step at most
/// [`crate::exec::OVERLAY_MAX_LOWERS`] lower directories, squashing the lowest past that
/// ([`crate::build::lower::squash_plan`]), under overlayfs' own limit. Volatile
/// (the `volatile` option, [`crate::exec::overlay`]): the upper is the step's scratch, captured
/// as a layer (whose blob the build cache syncs) or removed after the step, so the step's
/// own `fsync` calls (dpkg's, one per package file) need not reach the disk.
fn mount_overlay(plan: &ChildPlan, merged: &str) -> Result<(), String> {
    let lowers: Vec<&Path> = plan.lowers.iter().map(Path::new).collect();
    crate::exec::overlay::mount(
        &lowers,
        &plan.spec.upper_dir,
        &plan.spec.work_dir,
        Path::new(merged),
        rustix::mount::MountAttrFlags::MOUNT_ATTR_NODEV,
    )
}

/// Creates `path` (a directory) and its missing parents inside the new root.
fn mkdir_p(path: &str) -> Result<(), String> {
    fs::create_dir_all(path).map_err(|e| format!("creating {path}: {e}"))
}

/// Makes pid 1 die (SIGKILL) with the keeper (`PR_SET_PDEATHSIG`), and exits at once if the
/// keeper died before that took effect: with the keeper's write end of `keeper_alive`
/// closed, the pipe reads as hung up. Called again after each change of pid 1's
/// credentials, which clears the setting (prctl(2): a change of effective or file-system
/// uid or gid).
fn die_with_keeper(keeper_alive: RawFd) {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let mut pfd = libc::pollfd {
        fd: keeper_alive,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one valid pollfd, no wait.
    let hung_up = unsafe { libc::poll(&mut pfd, 1, 0) != 0 && pfd.revents & libc::POLLHUP != 0 };
    if hung_up {
        // SAFETY: exiting a forked child.
        unsafe { libc::_exit(SETUP_FAILED) }
    }
}

/// The device nodes every step's `/dev` has: name, major, minor (devices.txt of Linux's
/// `Documentation/admin-guide/devices.txt`), as Docker's default set.
const STEP_DEVICES: [(&str, u32, u32); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

fn pid1_main(plan: &ChildPlan, fds: &Fds, keeper_alive: RawFd) -> Result<(), String> {
    let spec = &plan.spec;
    use rustix::mount::{mount_bind, mount_change, mount_remount, unmount};
    mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(|e| format!("making / private: {e}"))?;
    let merged = plan.merged.to_str().ok_or("mount point is not UTF-8")?;
    // In a user namespace: the trees on disk keep the image's owners and the step sees them
    // through idmapped mounts; from here on, pid 1 makes files as the step's root (fsuid
    // `first`), so what it creates (mount points, /dev) is root's inside the step and, through
    // an idmapped mount, on disk. The overlay records these credentials as its mounter's and
    // copies up and makes whiteouts with them.
    let idmap = match plan.userns {
        Some((map, fd)) => {
            let dirs: Vec<&Path> = plan.idmapped.iter().map(PathBuf::as_path).collect();
            let covered = ns::idmap_dirs(&dirs, fd)?;
            ns::set_fs_ids(map.uid_first, map.gid_first)?;
            die_with_keeper(keeper_alive);
            Some(crate::exec::mounts::Idmap {
                ns: fd,
                covered,
                map,
            })
        }
        None => None,
    };
    mount_overlay(plan, merged)?;
    // /etc/hosts and /etc/resolv.conf, bound in before the host's root goes away; the
    // targets are resolved inside the new root (RESOLVE_IN_ROOT), so a symlink in the image
    // cannot point the bind at a host path.
    let nsd = MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC;
    let root_fd = rustix::fs::open(
        merged,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| format!("opening the new root: {e}"))?;
    let mut bound = Vec::new();
    for (src, target) in [
        (&plan.hosts, "etc/hosts"),
        (&plan.resolv, "etc/resolv.conf"),
    ] {
        let Some(fd) = open_in_root(&root_fd, target)? else {
            continue;
        };
        bound.push(format!("/{target}"));
        let fd_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        mount_bind(src.as_path(), fd_path.as_str())
            .map_err(|e| format!("binding /{target}: {e}"))?;
    }
    // RUN --mount, while host paths (binds, caches) can still be reached.
    crate::exec::mounts::mount_all(&root_fd, &plan.mounts, idmap.as_ref())?;
    // /proc (of the step's pid namespace) and /sys, while the host's are still in this
    // mount namespace: in a user namespace (a rootless kiln) the kernel mounts either only
    // where one is fully visible already (`mount_too_revealing`, fs/namespace.c).
    // `--security=insecure` (BuildKit's `WithInsecureSpec`, `WithWriteableSysfs`): no
    // read-only or masked kernel paths, a writable /sys, the host's usual devices, every
    // capability, no seccomp filter.
    let insecure = spec.security == Security::Insecure;
    let sys_flags = if insecure {
        nsd
    } else {
        nsd | MountFlags::RDONLY
    };
    for (dir, fstype, flags) in [("proc", "proc", nsd), ("sys", "sysfs", sys_flags)] {
        let at = crate::exec::mounts::mount_point(&root_fd, dir, false)?;
        mnt(
            fstype,
            &format!("/proc/self/fd/{}", at.as_raw_fd()),
            fstype,
            flags,
            None,
        )?;
    }
    drop(root_fd);
    // In a user namespace (a rootless kiln) no device node can be made: the step's /dev
    // nodes are copies of the host's own mounts of them, taken while the host's root is
    // still here (as rootless runc binds them).
    let host_devices = if crate::exec::rootless::in_user_namespace() {
        let mut fds = Vec::new();
        for (name, _, _) in STEP_DEVICES {
            let path = format!("/dev/{name}");
            let fd = rustix::mount::open_tree(
                rustix::fs::CWD,
                path.as_str(),
                rustix::mount::OpenTreeFlags::OPEN_TREE_CLONE
                    | rustix::mount::OpenTreeFlags::OPEN_TREE_CLOEXEC,
            )
            .map_err(|e| format!("taking the host's {path}: {e}"))?;
            fds.push(fd);
        }
        Some(fds)
    } else {
        None
    };

    rustix::process::chdir(merged).map_err(|e| format!("chdir: {e}"))?;
    rustix::process::pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    unmount(".", UnmountFlags::DETACH).map_err(|e| format!("detaching the old root: {e}"))?;
    rustix::process::chdir("/").map_err(|e| format!("chdir /: {e}"))?;

    // From here on every path resolves inside the step's root, symlinks included.
    for p in [
        "/proc/sys",
        "/proc/sysrq-trigger",
        "/proc/irq",
        "/proc/bus",
        "/proc/fs",
    ] {
        if !insecure && Path::new(p).exists() {
            mount_bind(p, p).map_err(|e| format!("binding {p}: {e}"))?;
            mount_remount(p, MountFlags::BIND | MountFlags::RDONLY | nsd, "")
                .map_err(|e| format!("making {p} read-only: {e}"))?;
        }
    }
    for target in &bound {
        mount_remount(
            target.as_str(),
            MountFlags::BIND | MountFlags::RDONLY | nsd,
            "",
        )
        .map_err(|e| format!("making {target} read-only: {e}"))?;
    }

    mkdir_p("/dev")?;
    mnt(
        "tmpfs",
        "/dev",
        "tmpfs",
        MountFlags::NOSUID,
        Some(c"mode=755,size=65536k"),
    )?;
    let mut host_devices = host_devices.map(Vec::into_iter);
    for (name, major, minor) in STEP_DEVICES {
        let path = format!("/dev/{name}");
        // Each taken node is attached, then its descriptor closed here: pid 1 closes every
        // descriptor it does not hand on before exec, behind any owner's back.
        if let Some(dev) = host_devices.as_mut().and_then(Iterator::next) {
            fs::File::create(&path).map_err(|e| format!("creating {path}: {e}"))?;
            ns::attach(&dev, Path::new(&path))?;
            continue;
        }
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path.as_str(),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::from_raw_mode(0o666),
            rustix::fs::makedev(major, minor),
        )
        .map_err(|e| format!("mknod {path}: {e}"))?;
        // mknod is subject to the umask.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666))
            .map_err(|e| format!("chmod {path}: {e}"))?;
    }
    if insecure {
        // BuildKit's insecure devices (`security_linux.go`): nodes only; a driver the host
        // lacks answers ENODEV when opened.
        mkdir_p("/dev/net")?;
        let mut nodes: Vec<(String, rustix::fs::FileType, u32, u32)> = [
            ("kmsg", 1, 11),
            ("cuse", 10, 203),
            ("fuse", 10, 229),
            ("kvm", 10, 232),
            ("net/tun", 10, 200),
            ("loop-control", 10, 237),
        ]
        .into_iter()
        .map(|(n, ma, mi)| (n.to_string(), rustix::fs::FileType::CharacterDevice, ma, mi))
        .collect();
        for i in 0..8 {
            nodes.push((format!("loop{i}"), rustix::fs::FileType::BlockDevice, 7, i));
        }
        for (name, kind, major, minor) in nodes {
            let path = format!("/dev/{name}");
            rustix::fs::mknodat(
                rustix::fs::CWD,
                path.as_str(),
                kind,
                rustix::fs::Mode::from_raw_mode(0o660),
                rustix::fs::makedev(major, minor),
            )
            .map_err(|e| format!("mknod {path}: {e}"))?;
        }
    }
    mkdir_p("/dev/pts")?;
    // gid 5 (`tty`) of the step: read in the mounter's (host) user namespace.
    let tty_gid = plan.userns.map_or(5, |(m, _)| m.gid_first + 5);
    let pts = cstr(&format!(
        "newinstance,ptmxmode=0666,mode=0620,gid={tty_gid}"
    ))?;
    mnt(
        "devpts",
        "/dev/pts",
        "devpts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        Some(pts.as_c_str()),
    )?;
    mkdir_p("/dev/shm")?;
    mnt(
        "shm",
        "/dev/shm",
        "tmpfs",
        nsd,
        Some(c"mode=1777,size=65536k"),
    )?;
    for (link, target) in [
        ("/dev/ptmx", "pts/ptmx"),
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, link).map_err(|e| format!("symlink {link}: {e}"))?;
    }
    // Docker's masked paths (moby `oci/defaults.go`): kernel data a build has no use for.
    for p in [
        "/proc/kcore",
        "/proc/keys",
        "/proc/latency_stats",
        "/proc/timer_list",
        "/proc/timer_stats",
        "/proc/sched_debug",
    ] {
        if !insecure && Path::new(p).exists() {
            mount_bind("/dev/null", p).map_err(|e| format!("masking {p}: {e}"))?;
        }
    }
    for p in ["/proc/acpi", "/proc/scsi", "/sys/firmware"] {
        if !insecure && Path::new(p).is_dir() {
            mnt(
                "tmpfs",
                p,
                "tmpfs",
                nsd | MountFlags::RDONLY,
                Some(c"size=0"),
            )?;
        }
    }
    for f in &spec.files {
        let path = match &f.path {
            Some(p) => p.clone(),
            None => continue,
        };
        if let Some(parent) = Path::new(&path).parent() {
            fs::create_dir_all(parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        fs::write(&path, &f.data).map_err(|e| format!("writing {path}: {e}"))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(f.mode & 0o7777))
            .map_err(|e| format!("chmod {path}: {e}"))?;
    }

    // Device nodes: Docker keeps CAP_MKNOD and relies on the devices cgroup to make new
    // nodes useless. Here no filesystem the step can write honours device nodes: the
    // overlay is mounted nodev, /dev/shm is nodev, and /dev itself (which must not be
    // nodev, for the nodes above) becomes read-only once populated.
    mount_remount(
        "/dev",
        MountFlags::RDONLY | MountFlags::NOSUID,
        "mode=755,size=65536k",
    )
    .map_err(|e| format!("making /dev read-only: {e}"))?;

    rustix::system::sethostname(plan.hostname.as_bytes())
        .map_err(|e| format!("sethostname: {e}"))?;
    if plan.bring_lo_up {
        loopback_up()?;
    }

    // Every mount is made: into the user namespace, as its root (the mount namespace stays
    // the host's root's, so nothing can be mounted or unmounted in it from now on).
    if let Some((_, fd)) = plan.userns {
        ns::enter(fd)?;
        die_with_keeper(keeper_alive);
    }

    // USER, resolved in the step's own root.
    let passwd = read_bounded("/etc/passwd");
    let group = read_bounded("/etc/group");
    let user = resolve_user(spec.user.as_deref(), &passwd, &group).map_err(|e| e.to_string())?;
    if let Some(count) = plan.step_ids {
        let outside = std::iter::once(user.uid)
            .chain(std::iter::once(user.gid))
            .chain(user.groups.iter().copied())
            .find(|&id| id >= count);
        if let Some(id) = outside {
            return Err(format!(
                "USER {}: id {id} is outside the step's user namespace, which maps ids 0-{}",
                spec.user.as_deref().unwrap_or("root"),
                count - 1
            ));
        }
    }

    // WORKDIR: missing directories are created owned by the user.
    if !spec.workdir.starts_with('/') {
        return Err(format!("WORKDIR {:?} is not absolute", spec.workdir));
    }
    let mut cur = PathBuf::from("/");
    for comp in Path::new(&spec.workdir).components().skip(1) {
        cur.push(comp);
        if fs::metadata(&cur).is_err() {
            fs::create_dir(&cur).map_err(|e| format!("creating WORKDIR {}: {e}", cur.display()))?;
            std::os::unix::fs::chown(&cur, Some(user.uid), Some(user.gid))
                .map_err(|e| format!("chown {}: {e}", cur.display()))?;
        }
    }
    rustix::process::chdir(spec.workdir.as_str())
        .map_err(|e| format!("chdir {}: {e}", spec.workdir))?;

    // Environment: the spec's, PATH and HOME defaulted.
    let mut env: Vec<(String, String)> = Vec::new();
    for kv in &spec.env {
        let (k, v) = kv.split_once('=').unwrap_or((kv.as_str(), ""));
        env.retain(|(ek, _)| ek != k);
        env.push((k.to_string(), v.to_string()));
    }
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    if !env.iter().any(|(k, _)| k == "HOME") {
        env.push(("HOME".into(), user.home.clone()));
    }
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let program = find_program(&spec.argv[0], &path_var)?;
    let c_prog = cstr(&program)?;
    let c_argv: Vec<CString> = spec
        .argv
        .iter()
        .map(|a| cstr(a))
        .collect::<Result<_, _>>()?;
    let c_env: Vec<CString> = env
        .iter()
        .map(|(k, v)| cstr(&format!("{k}={v}")))
        .collect::<Result<_, _>>()?;

    // A session of its own, without a controlling terminal: kiln's terminal (the user's
    // shell's) must not be the step's /dev/tty, where TIOCSTI would type into that shell
    // (runc's init calls setsid too).
    rustix::process::setsid().map_err(|e| format!("setsid: {e}"))?;
    // stdio: stdin from /dev/null, stdout and stderr into the log pipe.
    let devnull = fs::File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
    // SAFETY: dup2 onto the standard descriptors of this single-threaded process.
    unsafe {
        if libc::dup2(devnull.as_raw_fd(), 0) < 0
            || libc::dup2(fds.log_w, 1) < 0
            || libc::dup2(fds.log_w, 2) < 0
        {
            return Err(format!("dup2: {}", std::io::Error::last_os_error()));
        }
    }
    drop(devnull);
    // `keeper_alive` is close-on-exec: it goes with the exec.
    close_other_fds(&[0, 1, 2, fds.err_w, keeper_alive])?;

    // Capabilities: Docker's default set in the bounding, permitted, effective and
    // inheritable sets, no ambient ones; `--security=insecure`: every capability kiln has
    // (BuildKit's `getAllCaps`: the current process's), in every set, ambient too (kept
    // across the change of user, as runc keeps them).
    use rustix::thread::CapabilitySet;
    let last_cap: u32 = fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    let caps = if insecure {
        rustix::thread::capabilities(None)
            .map_err(|e| format!("capget: {e}"))?
            .permitted
            .bits()
    } else {
        DEFAULT_CAPABILITIES
    };
    for cap in 0..=last_cap.min(63) {
        if caps & (1u64 << cap) == 0 {
            match rustix::thread::remove_capability_from_bounding_set(
                CapabilitySet::from_bits_retain(1u64 << cap),
            ) {
                Ok(()) | Err(rustix::io::Errno::INVAL) => {}
                Err(e) => return Err(format!("dropping capability {cap}: {e}")),
            }
        }
    }
    let _ = rustix::thread::clear_ambient_capability_set();
    let set = CapabilitySet::from_bits_retain(caps);
    set_all_capabilities(set)?;

    if insecure {
        rustix::thread::set_keep_capabilities(true).map_err(|e| format!("keepcaps: {e}"))?;
    }
    let groups: Vec<rustix::fs::Gid> = user
        .groups
        .iter()
        .map(|&g| rustix::fs::Gid::from_raw(g))
        .collect();
    rustix::thread::set_thread_groups(&groups).map_err(|e| format!("setgroups: {e}"))?;
    rustix::thread::set_thread_res_gid(
        rustix::fs::Gid::from_raw(user.gid),
        rustix::fs::Gid::from_raw(user.gid),
        rustix::fs::Gid::from_raw(user.gid),
    )
    .map_err(|e| format!("setgid {}: {e}", user.gid))?;
    rustix::thread::set_thread_res_uid(
        rustix::fs::Uid::from_raw(user.uid),
        rustix::fs::Uid::from_raw(user.uid),
        rustix::fs::Uid::from_raw(user.uid),
    )
    .map_err(|e| format!("setuid {}: {e}", user.uid))?;
    // The change of user cleared the parent-death signal (a non-root `USER`, or any step
    // in the user namespace).
    die_with_keeper(keeper_alive);
    if insecure {
        // The change of user cleared the effective set; the ambient set carries them all
        // across execve for any user. No no_new_privs, no seccomp filter.
        set_all_capabilities(set)?;
        for cap in (0..=last_cap.min(63)).filter(|c| caps & (1u64 << c) != 0) {
            rustix::thread::configure_capability_in_ambient_set(
                CapabilitySet::from_bits_retain(1u64 << cap),
                true,
            )
            .map_err(|e| format!("raising ambient capability {cap}: {e}"))?;
        }
        default_signals();
    } else {
        rustix::thread::set_no_new_privs(true).map_err(|e| format!("no_new_privs: {e}"))?;
        default_signals();
        // Docker's default seccomp profile, last: nothing after it but execve.
        crate::exec::seccomp::install(plan.seccomp)?;
    }

    let mut argv_p: Vec<*const libc::c_char> = c_argv.iter().map(|c| c.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let mut env_p: Vec<*const libc::c_char> = c_env.iter().map(|c| c.as_ptr()).collect();
    env_p.push(std::ptr::null());
    // SAFETY: NUL-terminated arrays of pointers into CStrings that outlive the call.
    unsafe {
        libc::execve(c_prog.as_ptr(), argv_p.as_ptr(), env_p.as_ptr());
    }
    Err(format!(
        "exec {program}: {}",
        std::io::Error::last_os_error()
    ))
}

/// Sets this thread's effective, permitted and inheritable capability sets to `set`.
fn set_all_capabilities(set: rustix::thread::CapabilitySet) -> Result<(), String> {
    rustix::thread::set_capabilities(
        None,
        rustix::thread::CapabilitySets {
            effective: set,
            permitted: set,
            inheritable: set,
        },
    )
    .map_err(|e| format!("capset: {e}"))
}

/// Every signal's disposition back to its default and an empty signal mask, as runc starts
/// a container's process. An ignored signal stays ignored across `execve(2)` (signal(7),
/// "Signal disposition"), and the Rust runtime ignores SIGPIPE, so without this a step's
/// `yes | head` spins on EPIPE instead of dying with the pipe. The raw `rt_sigaction(2)`,
/// because the C library's wrappers refuse the numbers it keeps for itself (glibc's 32 and
/// 33), which a parent may still have left ignored; SIGKILL and SIGSTOP refuse a change,
/// which is no harm.
fn default_signals() {
    /// The kernel's `struct sigaction` on x86_64 and aarch64 (`rt_sigaction(2)`, NOTES).
    #[repr(C)]
    struct KernelSigaction {
        handler: libc::c_ulong,
        flags: libc::c_ulong,
        restorer: libc::c_ulong,
        mask: u64,
    }
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL as libc::c_ulong,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    // SAFETY: rt_sigaction(2) with a valid struct of the kernel's layout and size 8 (its
    // sigset), and sigprocmask(2) with a set sigemptyset initialised: both change only this
    // process's signal state and install no handler.
    unsafe {
        for sig in 1..=libc::SIGRTMAX() {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                &dfl as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                8usize,
            );
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
}

/// Opens `rel` (a file, `O_PATH`) inside the root `root`, creating it empty (and `etc`)
/// when missing; symlinks resolve inside `root`. `None`: `rel` is a dangling symlink.
fn open_in_root(root: &OwnedFd, rel: &str) -> Result<Option<OwnedFd>, String> {
    use crate::rootfs::open_in_root as open;
    use rustix::fs::{Mode, OFlags, openat};
    let path_flags = OFlags::PATH | OFlags::CLOEXEC;
    match open(root, rel, path_flags) {
        Ok(fd) => return Ok(Some(fd)),
        Err(rustix::io::Errno::NOENT) => {}
        Err(e) => return Err(format!("opening /{rel}: {e}")),
    }
    let (dir, name) = rel.rsplit_once('/').unwrap_or((".", rel));
    let dir_fd = match open(root, dir, path_flags | OFlags::DIRECTORY) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => {
            rustix::fs::mkdirat(root, dir, Mode::from_raw_mode(0o755))
                .map_err(|e| format!("creating /{dir}: {e}"))?;
            open(root, dir, path_flags | OFlags::DIRECTORY)
                .map_err(|e| format!("opening /{dir}: {e}"))?
        }
        Err(e) => return Err(format!("opening /{dir}: {e}")),
    };
    // A dangling symlink is not followed: O_EXCL | O_NOFOLLOW refuse it.
    let dir_rw = open(
        root,
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
    )
    .map_err(|e| format!("opening /{dir}: {e}"))?;
    drop(dir_fd);
    match openat(
        &dir_rw,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    ) {
        Ok(_) => {}
        // A dangling symlink: left alone (not bound), rather than creating its target.
        Err(rustix::io::Errno::EXIST) => return Ok(None),
        Err(e) => return Err(format!("creating /{rel}: {e}")),
    }
    open(root, rel, path_flags)
        .map(Some)
        .map_err(|e| format!("opening /{rel}: {e}"))
}

/// At most [`crate::user::MAX_DB_BYTES`] of a file of the step's root, lossily decoded;
/// empty when it cannot be read. Only regular files are read (a FIFO or device would block
/// or never end).
fn read_bounded(path: &str) -> String {
    let Ok(root) = crate::rootfs::Root::open(Path::new("/")) else {
        return String::new();
    };
    match crate::rootfs::read_bounded(&root, path, crate::user::MAX_DB_BYTES as u64) {
        Ok(Some(buf)) => String::from_utf8_lossy(&buf).into_owned(),
        Ok(None) | Err(_) => String::new(),
    }
}

/// `argv[0]` as execvp(3) would find it in `path`.
fn find_program(name: &str, path: &str) -> Result<String, String> {
    if name.contains('/') {
        return Ok(name.to_string());
    }
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let cand = format!("{dir}/{name}");
        if let Ok(md) = fs::metadata(&cand)
            && md.is_file()
            && md.mode() & 0o111 != 0
        {
            return Ok(cand);
        }
    }
    Err(format!("{name}: not found in PATH {path:?}"))
}

/// Brings `lo` up in the current network namespace (SIOCSIFFLAGS, netdevice(7)).
pub(super) fn loopback_up() -> Result<(), String> {
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo".iter().enumerate() {
        req.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: ioctl with a valid ifreq for SIOCGIFFLAGS / SIOCSIFFLAGS.
    unsafe {
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(format!(
                "SIOCGIFFLAGS lo: {}",
                std::io::Error::last_os_error()
            ));
        }
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(format!(
                "SIOCSIFFLAGS lo: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_lookup() {
        assert_eq!(find_program("/bin/x", "").unwrap(), "/bin/x");
        assert!(find_program("definitely-not-here", "/nonexistent").is_err());
        assert_eq!(find_program("sh", "/nonexistent:/bin").unwrap(), "/bin/sh");
    }
}
