//! The user namespace namespace-executor steps run in (issue 36).
//!
//! When kiln runs as root, a step's processes run in a user namespace whose map sends the
//! step's ids `0..count` to an unprivileged host range `first..first+count`: the
//! subordinate ids of one name in `/etc/subuid` and `/etc/subgid` (subuid(5), subgid(5);
//! the name is `kiln` unless `KILN_STEP_USERNS` names another, as Docker's `userns-remap`
//! uses `dockremap`'s). Root in a step is then uid `first` on the host, with no capability
//! outside the step's namespaces: it cannot load a module, mount over a host path, write a
//! file only host root may, or chown a file to an id outside the map (`EINVAL`).
//!
//! **One map per host, and idmapped mounts.** Every step of a process shares one user
//! namespace per map ([`namespace`]), made once and kept by a descriptor. The trees a step
//! sees (its lower layers, its upper directory, its scratch, bind and cache sources) stay on
//! disk with the image's own owners: the step's mount namespace sees them through idmapped
//! mounts (`mount_setattr(2)`, `MOUNT_ATTR_IDMAP`, with this namespace), which show a file
//! owned by `u` on disk as owned by host `first + u`, that is by `u` inside the step, and
//! write a file made by the step's `u` as `u` on disk. overlayfs takes idmapped layers
//! (Linux 5.19+, `Documentation/filesystems/overlayfs.rst`, "Idmapped layers"). So a layer
//! holds the same owners, and has the same digest, as without the namespace, and base trees
//! could be shared between builds whatever the map.
//!
//! `KILN_STEP_USERNS=host` turns it off: steps run as host root, as before issue 36 (trusted
//! builds only). `RUN --security=insecure` steps also run without it (as Docker's
//! `--privileged` needs `--userns=host` under `userns-remap`): their point is the host's
//! devices and capabilities.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::ExecError;

/// The fewest ids a step's map may have: 65,536, so that every 16-bit id (`nobody` is
/// 65534) an image may use is mapped, as Docker, Podman and BuildKit require.
pub const MIN_IDS: u32 = 65_536;
/// The name looked up in `/etc/subuid` and `/etc/subgid` by default.
pub const DEFAULT_SUBID_NAME: &str = "kiln";
/// The files the ranges are read from (subuid(5), subgid(5)).
pub const SUBUID_FILE: &str = "/etc/subuid";
/// See [`SUBUID_FILE`].
pub const SUBGID_FILE: &str = "/etc/subgid";

/// Whether steps run in a user namespace, and with which ids (`KILN_STEP_USERNS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepUserns {
    /// No user namespace: uid 0 in a step is uid 0 on the host (`KILN_STEP_USERNS=host`).
    Host,
    /// The subordinate ids of this name (or uid) in `/etc/subuid` and `/etc/subgid`.
    Subids(String),
    /// An explicit map (tests, and callers that manage their own ranges).
    Map(IdMap),
}

impl Default for StepUserns {
    /// From `KILN_STEP_USERNS` ([`StepUserns::parse`]; unset: the subordinate ids of
    /// [`DEFAULT_SUBID_NAME`], or [`StepUserns::Host`] in a process that already runs in a
    /// user namespace, a rootless kiln's: its steps stay in it, [`super::rootless`]).
    fn default() -> Self {
        match std::env::var("KILN_STEP_USERNS") {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v),
            _ if super::rootless::in_user_namespace() => StepUserns::Host,
            _ => Self::parse(""),
        }
    }
}

impl StepUserns {
    /// `host` → [`StepUserns::Host`]; empty → the subordinate ids of [`DEFAULT_SUBID_NAME`];
    /// anything else names the entries to use.
    pub fn parse(s: &str) -> Self {
        match s.trim() {
            "" => StepUserns::Subids(DEFAULT_SUBID_NAME.into()),
            "host" => StepUserns::Host,
            name => StepUserns::Subids(name.into()),
        }
    }

    /// The map steps run with; `None`: no user namespace.
    ///
    /// Errors ([`ExecError::Userns`]): a file that cannot be read, or no range of at least
    /// [`MIN_IDS`] ids for the name in either file.
    pub fn map(&self) -> Result<Option<IdMap>, ExecError> {
        match self {
            StepUserns::Host => Ok(None),
            StepUserns::Map(m) => Ok(Some(*m)),
            StepUserns::Subids(name) if super::rootless::in_user_namespace() => {
                Err(ExecError::Userns(format!(
                    "KILN_STEP_USERNS={name}: this kiln already runs in a user namespace \
                     (rootless, or root of a container's), where steps stay: unset \
                     KILN_STEP_USERNS, or run kiln as host root"
                )))
            }
            StepUserns::Subids(name) => {
                let read = |path: &str| {
                    read_subid_file(path)
                        .map_err(|e| ExecError::Userns(format!("reading {path}: {e}")))
                };
                let uid_of_name = uid_of(name);
                let uid = subid_range(&read(SUBUID_FILE)?, name, uid_of_name)
                    .map_err(|e| ExecError::Userns(missing(SUBUID_FILE, name, &e)))?;
                let gid = subid_range(&read(SUBGID_FILE)?, name, uid_of_name)
                    .map_err(|e| ExecError::Userns(missing(SUBGID_FILE, name, &e)))?;
                Ok(Some(IdMap {
                    uid_first: uid,
                    gid_first: gid,
                    count: MIN_IDS,
                }))
            }
        }
    }
}

fn missing(file: &str, name: &str, why: &str) -> String {
    format!(
        "{file}: {why}. Build steps run in a user namespace mapped to the subordinate ids of \
         {name:?} (at least {MIN_IDS}); add them, e.g. `usermod --add-subuids \
         100000-165535 --add-subgids 100000-165535 {name}` or the lines \
         `{name}:100000:65536` in /etc/subuid and /etc/subgid, name other entries with \
         KILN_STEP_USERNS=NAME, or run steps as host root with KILN_STEP_USERNS=host \
         (trusted builds only)"
    )
}

/// The text of a subuid(5) or subgid(5) file; a missing file has no ranges (empty).
pub(crate) fn read_subid_file(path: &str) -> std::io::Result<String> {
    match std::fs::read_to_string(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        r => r,
    }
}

/// The uid of user `name` in `/etc/passwd`, for entries written by uid (subuid(5)).
fn uid_of(name: &str) -> Option<u32> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == name).then_some(())?;
        f.nth(1)?.parse().ok()
    })
}

/// The first id of the first range of `name` (or of `uid`, the name's uid) in the text of a
/// subuid(5) or subgid(5) file (`name:first:count` lines) that has at least [`MIN_IDS`] ids
/// and does not reach past `u32::MAX` or include id 0.
///
/// Errors: the reason no range fits, for the caller's message.
pub fn subid_range(text: &str, name: &str, uid: Option<u32>) -> Result<u32, String> {
    let mut small = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut f = line.split(':');
        let (Some(who), Some(first), Some(count), None) = (f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let ours = who == name || uid.is_some_and(|u| who.parse::<u32>().ok() == Some(u));
        let (Ok(first), Ok(count)) = (first.parse::<u32>(), count.parse::<u32>()) else {
            continue;
        };
        if !ours {
            continue;
        }
        if count < MIN_IDS || first == 0 || first.checked_add(MIN_IDS - 1).is_none() {
            small = Some(format!("{who}:{first}:{count}"));
            continue;
        }
        return Ok(first);
    }
    Err(match small {
        Some(entry) => {
            format!("the range {entry} is too small or unusable (at least {MIN_IDS} ids, not id 0)")
        }
        None => format!("no range for {name:?}"),
    })
}

/// A step's id map: ids `0..count` in the step are `uid_first..` and `gid_first..` on the
/// host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdMap {
    /// Host uid of the step's uid 0.
    pub uid_first: u32,
    /// Host gid of the step's gid 0.
    pub gid_first: u32,
    /// How many ids are mapped (uids and gids alike).
    pub count: u32,
}

/// The user namespaces made so far in this process, one per map.
static NAMESPACES: Mutex<Vec<(IdMap, Arc<OwnedFd>)>> = Mutex::new(Vec::new());

/// The user namespace of `map` (a `/proc/<pid>/ns/user` descriptor), made on first use and
/// kept for the life of the process: a child unshares a new user namespace, this process
/// writes its `uid_map` and `gid_map` (user_namespaces(7): a writer with `CAP_SETUID` in the
/// parent namespace may map any range; `setgroups` stays allowed), opens its namespace and
/// lets it exit.
///
/// Errors: fork, unshare, or writing the maps failing (e.g. not root).
pub fn namespace(map: IdMap) -> Result<Arc<OwnedFd>, ExecError> {
    let mut made = NAMESPACES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, fd)) = made.iter().find(|(m, _)| *m == map) {
        return Ok(fd.clone());
    }
    let fd = Arc::new(make_namespace(map)?);
    made.push((map, fd.clone()));
    Ok(fd)
}

fn make_namespace(map: IdMap) -> Result<OwnedFd, ExecError> {
    namespace_child(None, libc::CLONE_NEWUSER, "user", |proc| {
        let write = |file: &str, first: u32| {
            let path = format!("{proc}/{file}");
            std::fs::write(&path, format!("0 {first} {}\n", map.count))
                .map_err(|e| ExecError::Userns(format!("writing {path}: {e}")))
        };
        write("uid_map", map.uid_first)?;
        write("gid_map", map.gid_first)
    })
}

/// A new network namespace owned by the user namespace `userns`, for one step: then the
/// step's root has its network capabilities there (`CAP_NET_RAW` for ping,
/// `CAP_NET_BIND_SERVICE` for ports below 1024, as in Docker's default set), which a network
/// namespace of the host's root would deny it (network_namespaces(7): capabilities over a
/// namespace are those held in the user namespace that owns it). kiln, as host root, still
/// configures it (loopback, slirp4netns, the egress proxy).
///
/// Errors: fork, or the child failing to enter `userns` or to unshare.
pub fn net_namespace(userns: &OwnedFd) -> Result<OwnedFd, ExecError> {
    namespace_child(Some(userns.as_raw_fd()), libc::CLONE_NEWNET, "net", |_| {
        Ok(())
    })
}

/// Forks a child that enters the user namespace `enter` (if any) and unshares `flag`; runs
/// `setup` with the child's `/proc/<pid>` while the child waits; opens the child's
/// `/proc/<pid>/ns/<ns>`, then lets it exit. The namespace lives on through the descriptor.
fn namespace_child(
    enter: Option<RawFd>,
    flag: libc::c_int,
    ns: &str,
    setup: impl FnOnce(&str) -> Result<(), ExecError>,
) -> Result<OwnedFd, ExecError> {
    let err = |what: &str, e: std::io::Error| ExecError::Userns(format!("{what}: {e}"));
    let pipe = || -> Result<(OwnedFd, OwnedFd), ExecError> {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| err("pipe", e.into()))
    };
    let (ready_r, ready_w) = pipe()?;
    let (done_r, done_w) = pipe()?;
    let (ready_w_fd, done_r_fd) = (ready_w.as_raw_fd(), done_r.as_raw_fd());
    let (ready_r_fd, done_w_fd) = (ready_r.as_raw_fd(), done_w.as_raw_fd());
    let enter_fd = enter.unwrap_or(-1);
    // SAFETY: fork(2) in a possibly multithreaded process: the child calls only
    // async-signal-safe functions (close, setns, unshare, write, read, _exit) and touches
    // no lock.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(err("fork", std::io::Error::last_os_error()));
    }
    if child == 0 {
        // SAFETY: as above; the child exits without returning. It closes its copies of the
        // parent's ends first, so that its read ends when the parent's end closes; the
        // parent also writes a byte there first, because a child forked at the same time by
        // another thread holds a copy of that end too (a fork copies every descriptor, and
        // close-on-exec does nothing without an exec), and with an end-of-file alone the two
        // children waited for each other forever, their parents in `waitpid` (a `kiln serve`
        // running builds at once hung: serve_api's identical_builds_at_once_all_succeed, 1
        // run in 5).
        unsafe {
            libc::close(ready_r_fd);
            libc::close(done_w_fd);
            let entered = enter_fd < 0 || libc::setns(enter_fd, libc::CLONE_NEWUSER) == 0;
            let ok = entered && libc::unshare(flag) == 0;
            let b: u8 = if ok { b'1' } else { b'0' };
            libc::write(ready_w_fd, (&b as *const u8).cast(), 1);
            let mut x = 0u8;
            libc::read(done_r_fd, (&mut x as *mut u8).cast(), 1);
            libc::_exit(0)
        }
    }
    drop((ready_w, done_r));
    let reap = |done_w: OwnedFd| {
        // The byte ends the child's read (see the child); a failed write (the child is gone)
        // leaves nothing to wake.
        let _ = rustix::io::write(&done_w, b"x");
        drop(done_w);
        let mut st = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut st, 0) };
    };
    let mut b = [0u8; 1];
    let got = rustix::io::read(&ready_r, &mut b).unwrap_or(0);
    if got != 1 || b[0] != b'1' {
        reap(done_w);
        return Err(ExecError::Userns(format!(
            "a child could not make a {ns} namespace"
        )));
    }
    let result = (|| {
        let proc = format!("/proc/{child}");
        setup(&proc)?;
        let path = format!("{proc}/ns/{ns}");
        let f = std::fs::File::open(&path).map_err(|e| err(&format!("opening {path}"), e))?;
        Ok(OwnedFd::from(f))
    })();
    reap(done_w);
    result
}

/// Helpers for the step's pid 1 (it forked from the executor; no allocation-free promise is
/// needed there, glibc's fork reset the allocator).
pub(crate) mod child {
    use super::*;
    use rustix::mount::{MountAttrFlags, MoveMountFlags, OpenTreeFlags};

    /// The `struct mount_attr` of mount_setattr(2).
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }

    /// A detached copy of the mount tree at `dir`, shown through the user namespace `ns`
    /// (`open_tree(2)` with `OPEN_TREE_CLONE | AT_RECURSIVE`, then `mount_setattr(2)` with
    /// `MOUNT_ATTR_IDMAP`, private propagation).
    ///
    /// Errors: the file system cannot be idmapped (EINVAL), or the mount already is (EPERM).
    pub fn idmapped_clone(dir: &Path, ns: RawFd) -> Result<OwnedFd, String> {
        let tree = rustix::mount::open_tree(
            rustix::fs::CWD,
            dir,
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_RECURSIVE,
        )
        .map_err(|e| format!("open_tree {}: {e}", dir.display()))?;
        set_idmap(&tree, ns).map_err(|e| {
            let hint = if e.raw_os_error() == Some(libc::EINVAL) {
                " (its file system cannot be shown through an idmapped mount; \
                 KILN_STEP_USERNS=host runs steps without a user namespace)"
            } else {
                ""
            };
            format!("idmapping {}: {e}{hint}", dir.display())
        })?;
        Ok(tree)
    }

    fn set_idmap(tree: &OwnedFd, ns: RawFd) -> Result<(), std::io::Error> {
        let attr = MountAttr {
            attr_set: u64::from(MountAttrFlags::MOUNT_ATTR_IDMAP.bits()),
            attr_clr: 0,
            propagation: libc::MS_PRIVATE,
            userns_fd: ns as u64,
        };
        // SAFETY: mount_setattr(2) on a descriptor we own, with a valid struct of the
        // kernel's layout and its size.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Attaches `tree` on the directory `target` (`move_mount(2)`).
    pub fn attach(tree: &OwnedFd, target: &Path) -> Result<(), String> {
        rustix::mount::move_mount(
            tree,
            "",
            rustix::fs::CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| format!("attaching a mount on {}: {e}", target.display()))
    }

    /// Attaches `tree` on the mount point `target` (an open descriptor, `O_PATH` will do).
    pub fn attach_to(tree: &OwnedFd, target: &OwnedFd) -> Result<(), String> {
        rustix::mount::move_mount(
            tree,
            "",
            target,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e| format!("move_mount: {e}"))
    }

    /// Shows each of `dirs` through the namespace `ns`, in this (private) mount namespace:
    /// an idmapped copy of each is mounted over it. A directory below another of the list is
    /// left to the one above it (an idmapped mount cannot be idmapped again).
    pub fn idmap_dirs(dirs: &[&Path], ns: RawFd) -> Result<Vec<std::path::PathBuf>, String> {
        let mut top: Vec<std::path::PathBuf> = Vec::new();
        let mut sorted: Vec<&Path> = dirs.to_vec();
        sorted.sort_by_key(|p| p.components().count());
        for d in sorted {
            if top.iter().any(|t| d.starts_with(t)) {
                continue;
            }
            top.push(d.to_path_buf());
        }
        for d in &top {
            let tree = idmapped_clone(d, ns)?;
            attach(&tree, d)?;
        }
        Ok(top)
    }

    /// Sets this process's file-system uid and gid (setfsuid(2), setfsgid(2)) and raises its
    /// effective capabilities back to its permitted ones (a change of fsuid from 0 clears
    /// the file-system capabilities from the effective set, capabilities(7)).
    pub fn set_fs_ids(uid: u32, gid: u32) -> Result<(), String> {
        // SAFETY: setfsuid/setfsgid change only this thread's credentials.
        unsafe {
            libc::setfsgid(gid);
            libc::setfsuid(uid);
        }
        let caps = rustix::thread::capabilities(None).map_err(|e| format!("capget: {e}"))?;
        rustix::thread::set_capabilities(
            None,
            rustix::thread::CapabilitySets {
                effective: caps.permitted,
                ..caps
            },
        )
        .map_err(|e| format!("capset: {e}"))
    }

    /// Enters the user namespace `ns` (setns(2)) as its root: uid and gid 0 inside.
    pub fn enter(ns: RawFd) -> Result<(), String> {
        // SAFETY: setns(2) on a descriptor we own, in a single-threaded process.
        if unsafe { libc::setns(ns, libc::CLONE_NEWUSER) } != 0 {
            return Err(format!(
                "entering the steps' user namespace: {}",
                std::io::Error::last_os_error()
            ));
        }
        let zero_g = rustix::fs::Gid::from_raw(0);
        let zero_u = rustix::fs::Uid::from_raw(0);
        rustix::thread::set_thread_res_gid(zero_g, zero_g, zero_g)
            .map_err(|e| format!("setgid 0 in the user namespace: {e}"))?;
        rustix::thread::set_thread_res_uid(zero_u, zero_u, zero_u)
            .map_err(|e| format!("setuid 0 in the user namespace: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subid_ranges_are_found_by_name_or_uid_and_checked() {
        let text = "# comment\nalice:100000:65536\nkiln:200000:1000\nkiln:300000:65536\n0:5:9\n";
        assert_eq!(subid_range(text, "alice", None), Ok(100000));
        // The small range is skipped for the next one.
        assert_eq!(subid_range(text, "kiln", None), Ok(300000));
        assert_eq!(
            subid_range("1001:400000:70000\n", "bob", Some(1001)),
            Ok(400000)
        );
        let e = subid_range("kiln:200000:1000\n", "kiln", None).unwrap_err();
        assert!(
            e.contains("kiln:200000:1000") && e.contains("too small"),
            "{e}"
        );
        let e = subid_range(text, "nobody", None).unwrap_err();
        assert!(e.contains("no range for \"nobody\""), "{e}");
        // Past u32::MAX, or starting at 0: refused.
        assert!(subid_range("kiln:4294967000:65536\n", "kiln", None).is_err());
        assert!(subid_range("kiln:0:65536\n", "kiln", None).is_err());
        // Malformed lines are skipped.
        assert_eq!(
            subid_range(
                "kiln:x:65536\nkiln:7:8:9\nkiln:500000:65536\n",
                "kiln",
                None
            ),
            Ok(500000)
        );
    }

    #[test]
    fn parse() {
        assert_eq!(StepUserns::parse(""), StepUserns::Subids("kiln".into()));
        assert_eq!(StepUserns::parse(" host "), StepUserns::Host);
        assert_eq!(
            StepUserns::parse("builder"),
            StepUserns::Subids("builder".into())
        );
    }
}
