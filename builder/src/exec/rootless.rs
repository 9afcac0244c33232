//! `kiln build` without root (issue 36 §2), as rootless BuildKit and Podman do it.
//!
//! A non-root `kiln build` re-executes itself ([`reexec`]) in a new user namespace and a new
//! mount namespace owned by it, whose map sends id 0 to the user and ids `1..=65535` to the
//! user's subordinate ids (subuid(5), subgid(5)), written by the setuid `newuidmap` and
//! `newgidmap` (shadow's `uidmap` package), which check the ranges against `/etc/subuid` and
//! `/etc/subgid`. The build then runs as root of that namespace: it unpacks layers with their
//! owners, mounts overlayfs (with `userxattr`: [`overlay_xattr_prefix`]) and runs its steps
//! with the namespace executor, whose steps stay in this namespace
//! ([`super::userns::StepUserns`] is `Host` here: a nested map would need idmapped mounts of
//! the host's file systems, which only host root may make). On the host, the files kiln
//! makes belong to the user, and those of other in-image owners to the user's subordinate
//! ids; `kiln store gc` by such a user runs in the same namespace, to remove them.
//!
//! What a user namespace cannot do, and what kiln does instead:
//! - **Device nodes** cannot be made (`mknod` needs `CAP_MKNOD` in the host's namespace): a
//!   step's `/dev/null`, `/dev/zero`, ... are bind mounts of the host's, as in rootless
//!   runc; device nodes in base layers are empty regular files in the tree steps see
//!   ([`crate::layer`]'s applier) and stay in the image.
//! - **cgroups** of the host's v1 hierarchies (and v2's, outside a delegated subtree) belong
//!   to host root: without a delegated parent (v1: `kiln-<uid>` per controller; v2: the
//!   cgroup kiln runs in, [`super::cgroup::delegated_v2_parent`]), steps run without their
//!   memory and pids limits, with a warning naming the directory or the missing controller.
//! - **Refused with an error naming what is missing:** `debootstrap` bases (device nodes and
//!   chroot setup), `RUN --network=host` (the host's network namespace belongs to host root:
//!   no `CAP_NET_ADMIN` there), `--isolation vm` and `--snapshot` (QEMU's jail gives each
//!   QEMU a uid and a cgroup of its own, which needs `CAP_SETUID` and `CAP_SYS_ADMIN` on the
//!   host).

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt as _;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

use super::userns::{MIN_IDS, SUBGID_FILE, SUBUID_FILE, read_subid_file, subid_range};

/// The ids a rootless kiln maps beyond its user's own: 65,535 subordinate ids, so that the
/// namespace has ids `0..=65535`, exactly those a root build's steps have
/// ([`super::userns::MIN_IDS`] from id 0): every 16-bit id an image may use, and a step
/// that chowns to 65536 fails either way, so both give one digest. (The user's range in
/// `/etc/subuid` must still hold [`MIN_IDS`] ids, as for any user namespace tool.)
pub const SUBORDINATE_IDS: u32 = MIN_IDS - 1;

/// Why a rootless re-execution could not start.
#[derive(Debug, thiserror::Error)]
#[error("rootless kiln build: {0}")]
pub struct RootlessError(String);

/// Whether this process runs as root (effective uid 0, of whatever user namespace): a
/// `kiln build` that is not re-executes itself ([`reexec`]).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// This process's `/proc/self/uid_map`, read once (a process's map never changes after it
/// is written; empty if it cannot be read).
fn own_uid_map() -> &'static str {
    static MAP: OnceLock<String> = OnceLock::new();
    MAP.get_or_init(|| std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default())
}

/// Whether this process runs in a user namespace that is not the host's (its `uid_map` is
/// not the host's `0 0 4294967295`). True in a rootless kiln ([`reexec`]), and for a kiln
/// that is root of some other user namespace (a container's): both lack the host-root
/// powers the module doc lists.
pub fn in_user_namespace() -> bool {
    !own_uid_map().is_empty() && !is_host_map(own_uid_map())
}

/// The cgroup parent of this process's step groups, relative to each hierarchy, decided
/// once per process: `kiln` for host root. In a user namespace (a rootless kiln), on a pure
/// v2 host whose cgroup of this process is delegated to its user, `<that cgroup>/kiln`
/// ([`super::cgroup::delegated_v2_parent`], which moves the cgroup's processes into a leaf
/// beside it); otherwise `kiln-<uid>`, where `<uid>` is the host uid its root maps to (the
/// user who ran a rootless kiln): the parent an administrator delegates to that user on
/// cgroup v1 (README, "Builds without root"). A delegated v2 cgroup that cannot give the
/// limits (a missing controller) gets a warning naming why, and `kiln-<uid>`.
pub fn cgroup_parent() -> String {
    if !in_user_namespace() {
        return "kiln".into();
    }
    static PARENT: OnceLock<String> = OnceLock::new();
    PARENT
        .get_or_init(|| {
            match super::cgroup::delegated_v2_parent() {
                Ok(Some(parent)) => return parent,
                Ok(None) => {}
                Err(why) => super::cgroup::warn_unlimited(&why),
            }
            match root_maps_to(own_uid_map()) {
                Some(uid) => format!("kiln-{uid}"),
                None => "kiln-userns".into(),
            }
        })
        .clone()
}

/// How many ids, from 0 and without a gap, this process's user namespace maps in both its
/// `uid_map` and its `gid_map` (a rootless kiln's: 65,536), or `None` in the host's. Read
/// once per process.
pub fn namespace_ids() -> Option<u32> {
    static IDS: OnceLock<Option<u32>> = OnceLock::new();
    *IDS.get_or_init(|| {
        in_user_namespace().then(|| {
            let gid_map = std::fs::read_to_string("/proc/self/gid_map").unwrap_or_default();
            ids_from_zero(own_uid_map()).min(ids_from_zero(&gid_map))
        })
    })
}

/// The ids from 0 up that a `uid_map`/`gid_map` text maps without a gap.
fn ids_from_zero(map: &str) -> u32 {
    let mut ranges: Vec<(u64, u64)> = map
        .lines()
        .filter_map(|l| {
            let f: Vec<u64> = l
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            (f.len() == 3).then(|| (f[0], f[2]))
        })
        .collect();
    ranges.sort_unstable();
    let mut next = 0u64;
    for (first, count) in ranges {
        if first == next {
            next += count;
        }
    }
    u32::try_from(next).unwrap_or(u32::MAX)
}

/// The host id a `uid_map`'s text sends id 0 to.
fn root_maps_to(map: &str) -> Option<u32> {
    map.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.first() == Some(&"0")).then(|| f.get(1)?.parse().ok())?
    })
}

/// Whether a `uid_map`'s text is the initial namespace's identity map of every id.
fn is_host_map(map: &str) -> bool {
    map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]
}

/// The xattr namespace overlayfs keeps its markers in for this process (opaque directories:
/// `<prefix>opaque` = `y`): `trusted.overlay.` for host root; `user.overlay.` in a user
/// namespace, where `trusted.*` is host root's and overlayfs is mounted with `userxattr`
/// (Linux 5.11+, `Documentation/filesystems/overlayfs.rst`, "Non-standard behavior").
pub fn overlay_xattr_prefix() -> &'static str {
    if in_user_namespace() {
        "user.overlay."
    } else {
        "trusted.overlay."
    }
}

/// The name of overlayfs' opaque-directory marker for this process
/// ([`overlay_xattr_prefix`] + `opaque`).
pub fn overlay_opaque_xattr() -> &'static str {
    if in_user_namespace() {
        "user.overlay.opaque"
    } else {
        "trusted.overlay.opaque"
    }
}

/// The child a signal sent to the rootless parent goes on to (0: none yet).
static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A terminal's ^C reaches the whole foreground process group, the child included
    // (`si_code` SI_KERNEL); only a signal sent to this process alone (kill(2): SI_USER,
    // sigqueue(3): SI_QUEUE, tgkill: SI_TKILL, all ≤ 0) is passed on, so that the child
    // sees each one once.
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    let child = CHILD.load(Ordering::Relaxed);
    if code <= 0 && child > 0 {
        // SAFETY: kill(2) is async-signal-safe.
        unsafe { libc::kill(child, sig) };
    }
}

/// Runs this program again (`/proc/self/exe` with this process's arguments) as root of a
/// new user namespace mapped to the calling user and their subordinate ids, and a new mount
/// namespace; waits for it and returns its exit code
/// (128 + the signal's number if a signal ended it). SIGINT, SIGTERM, SIGHUP and SIGQUIT
/// sent to this process go on to the child, and the child gets SIGTERM if this process dies.
///
/// Errors: no range of at least [`SUBORDINATE_IDS`] ids for the user in `/etc/subuid` or
/// `/etc/subgid` (the message gives the `usermod` line), `newuidmap` or `newgidmap` missing
/// or refusing the map, or the child failing to start.
pub fn reexec() -> Result<u8, RootlessError> {
    let (uid, gid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
    );
    let (subuid, subgid) = subordinate_ids()?;

    let pipe = || {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| RootlessError(format!("pipe: {e}")))
    };
    let (ready_r, ready_w) = pipe()?;
    let (go_r, go_w) = pipe()?;
    let (ready_w_fd, go_r_fd) = (ready_w.as_raw_fd(), go_r.as_raw_fd());
    let mut cmd = Command::new("/proc/self/exe");
    let mut args = std::env::args_os();
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    cmd.args(args);
    // SAFETY: runs in the forked child before exec: only async-signal-safe calls (prctl,
    // unshare, write, read, mount, _exit) on data made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong);
            let ok = libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) == 0;
            let mut msg = [if ok { b'1' } else { b'0' }, 0, 0, 0, 0];
            msg[1..].copy_from_slice(&libc::getpid().to_ne_bytes());
            libc::write(ready_w_fd, msg.as_ptr().cast(), msg.len());
            if !ok {
                return Err(std::io::Error::last_os_error());
            }
            let mut go = 0u8;
            if libc::read(go_r_fd, (&mut go as *mut u8).cast(), 1) != 1 || go != b'1' {
                libc::_exit(125);
            }
            // Mounts made from here on stay in this namespace.
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // Command::spawn returns once the child has exec'd, and the child waits for its map
    // first: the map is written from a thread, with the pid the child sends.
    let mapper = std::thread::spawn(move || {
        let mut msg = [0u8; 5];
        let n = rustix::io::read(&ready_r, &mut msg).unwrap_or(0);
        let mapped = if n != msg.len() || msg[0] != b'1' {
            Err(RootlessError(
                "the child could not make a user namespace (unprivileged user namespaces \
                 may be off: sysctl user.max_user_namespaces, \
                 kernel.apparmor_restrict_unprivileged_userns)"
                    .into(),
            ))
        } else {
            let pid = u32::from_ne_bytes([msg[1], msg[2], msg[3], msg[4]]);
            id_map("newuidmap", pid, uid, subuid)
                .and_then(|()| id_map("newgidmap", pid, gid, subgid))
        };
        let go: u8 = if mapped.is_ok() { b'1' } else { b'0' };
        let _ = rustix::io::write(&go_w, &[go]);
        mapped
    });
    let spawned = cmd.spawn();
    drop((ready_w, go_r));
    let mapped = mapper
        .join()
        .unwrap_or_else(|_| Err(RootlessError("the id mapper panicked".into())));
    let mut child = match (spawned, mapped) {
        (_, Err(e)) => return Err(e),
        (Err(e), _) => return Err(RootlessError(format!("starting /proc/self/exe: {e}"))),
        (Ok(c), Ok(())) => c,
    };
    CHILD.store(child.id() as i32, Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: installs a handler that only calls kill(2).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = forward as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    let status = child
        .wait()
        .map_err(|e| RootlessError(format!("waiting for the child: {e}")))?;
    use std::os::unix::process::ExitStatusExt as _;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    Ok(u8::try_from(code).unwrap_or(u8::MAX))
}

/// The first of this process's user's subordinate uids and gids (at least
/// [`SUBORDINATE_IDS`] of each, `/etc/subuid` and `/etc/subgid`, by name or uid).
///
/// Errors: a file that cannot be read, or no such range (the message says how to add one).
pub fn subordinate_ids() -> Result<(u32, u32), RootlessError> {
    let uid = rustix::process::getuid().as_raw();
    let name = user_name(uid).unwrap_or_else(|| uid.to_string());
    let range = |file: &str| -> Result<u32, RootlessError> {
        let text =
            read_subid_file(file).map_err(|e| RootlessError(format!("reading {file}: {e}")))?;
        subid_range(&text, &name, Some(uid)).map_err(|why| {
            RootlessError(format!(
                "{file}: {why}. A build without root runs as root of a user namespace \
                 mapped to your subordinate ids (a range of at least {MIN_IDS}); ask an \
                 administrator to add a range no other user has (see /etc/subuid), e.g. \
                 `usermod --add-subuids 200000-265535 --add-subgids 200000-265535 {name}`, \
                 or run kiln as root"
            ))
        })
    };
    Ok((range(SUBUID_FILE)?, range(SUBGID_FILE)?))
}

/// Runs `newuidmap`/`newgidmap` for `pid`: 0 → `own`, `1..=SUBORDINATE_IDS` → `first..`.
fn id_map(tool: &str, pid: u32, own: u32, first: u32) -> Result<(), RootlessError> {
    let out = Command::new(tool)
        .args([
            pid.to_string(),
            "0".into(),
            own.to_string(),
            "1".into(),
            "1".into(),
            first.to_string(),
            SUBORDINATE_IDS.to_string(),
        ])
        .output()
        .map_err(|e| {
            RootlessError(if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "{tool} not found: a build without root needs newuidmap and newgidmap \
                     (Debian's package uidmap)"
                )
            } else {
                format!("running {tool}: {e}")
            })
        })?;
    if !out.status.success() {
        return Err(RootlessError(format!(
            "{tool} {pid} 0 {own} 1 1 {first} {SUBORDINATE_IDS} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// The name of user `uid` in `/etc/passwd`.
fn user_name(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        (f.nth(1)?.parse::<u32>().ok()? == uid).then(|| name.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_identity_map_of_every_id_is_the_hosts() {
        assert!(is_host_map("         0          0 4294967295\n"));
        assert!(!is_host_map(
            "         0       1001          1\n         1     165536      65536\n"
        ));
        assert!(!is_host_map("0 100000 65536\n"));
        assert!(!is_host_map(""));
    }

    #[test]
    fn the_ids_from_zero_are_counted_up_to_the_first_gap() {
        let m = "         0       1001          1\n         1     165536      65535\n";
        assert_eq!(ids_from_zero(m), 65536);
        assert_eq!(ids_from_zero("0 100000 10\n20 200000 10\n"), 10);
        assert_eq!(ids_from_zero("1 100000 10\n"), 0);
    }

    #[test]
    fn the_host_uid_of_root_is_read_from_the_map() {
        let m = "         0       1001          1\n         1     165536      65536\n";
        assert_eq!(root_maps_to(m), Some(1001));
        assert_eq!(root_maps_to("         1     165536      65536\n"), None);
    }
}
