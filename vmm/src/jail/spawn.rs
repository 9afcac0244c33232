//! Starting QEMU: one fork-like `clone(2)`, the jail set up in the child, then `execve(2)`.
//!
//! When kiln runs as root, the child is made in namespaces of its own ([`JAIL_NAMESPACES`]):
//! QEMU is pid 1 of a pid namespace of its own (it sees no other process; a QEMU cannot fork
//! anyway under `-sandbox`), with no network, in a mount namespace of its own, whose root is a fresh tmpfs holding only what
//! [`RootPlan`] lists, bound read-only, and a `/proc` of that pid namespace mounted
//! `subset=pid` (no `/proc/sys`, `/proc/kcore` or other host-wide files). The steps, all in
//! the child before the exec:
//! 0. its cgroup joined ([`super::cgroup`]), before anything else, and its file size limit
//!    set ([`super::file_size_limit`]);
//! 1. every mount made private (`MS_REC | MS_PRIVATE`): nothing propagates back to the host;
//! 2. a tmpfs mounted on [`ROOT_MOUNT_POINT`] (seen only in this namespace), its mount points
//!    made, each file and directory of the plan bound and remounted read-only, `nosuid`,
//!    `nodev`, `/proc` mounted;
//! 3. `pivot_root(".", ".")` into it and the old root detached (`umount2(MNT_DETACH)`): the
//!    host's mounts are gone from the namespace, not just hidden; the tmpfs remounted
//!    read-only, `noexec`;
//! 4. stdio, every other descriptor marked close-on-exec, the handed descriptors
//!    (close-on-exec cleared in the child only), the process
//!    group, then groups, gid and uid dropped (raw `setgroups`, `setresgid`, `setresuid`
//!    system calls: glibc's wrappers would signal the threads of the parent that the child
//!    does not have), the parent-death signal (after the drop, which clears it), and
//!    `execve` with an empty environment (kiln's own may hold store credentials).
//!
//! Descriptors handed as `/proc/self/fd/<n>` still open in the new root: a `/proc` magic link
//! reaches its file through the descriptor, not through the (now absent) host path.
//!
//! The child is a copy of one thread of a multithreaded process, so from the `clone` to the
//! `execve` it only makes system calls on data prepared beforehand: no allocation, no lock.
//! A failing step is reported through a close-on-exec pipe (step, item, errno) and the child
//! exits 127; an exec that succeeds closes the pipe. When kiln does not run as root, the same
//! path starts QEMU without namespaces, jail or change of user.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use super::QemuUser;
use super::root::RootPlan;
use crate::launch::LaunchError;

/// Where a jailed QEMU's root tmpfs is mounted inside its own mount namespace before it
/// pivots into it (the host sees an empty directory).
pub const ROOT_MOUNT_POINT: &str = "/run/kiln/qemu-root";
/// The namespaces a jailed QEMU gets of its own: mount and pid (its root, its process view);
/// network (no interface but a down loopback: QEMU needs no network, its sockets come as
/// descriptors, and this also gives it its own abstract unix socket namespace, so it reaches
/// no host TCP/UDP port and no host daemon's abstract socket); IPC (no host SysV shared
/// memory or message queue); UTS.
const JAIL_NAMESPACES: libc::c_int = libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS;
/// Size bound of the root tmpfs: it holds only empty mount points.
const ROOT_TMPFS: &std::ffi::CStr = c"mode=0755,size=64k,nr_inodes=1024";

/// One QEMU to start.
pub(crate) struct Launch<'a> {
    /// The binary (a bare name is looked up in `PATH`).
    pub program: &'a Path,
    /// Arguments, without the program.
    pub args: &'a [String],
    /// Where stdout and stderr go.
    pub log: &'a std::fs::File,
    /// Descriptors QEMU inherits (their close-on-exec is cleared in the child).
    pub keep: &'a [RawFd],
    /// Its user; `Some` also means the jail: namespaces and private root.
    pub user: Option<QemuUser>,
    /// What its private root holds ([`super::root::plan_for`]); `Some` with `user`.
    pub root: Option<&'a RootPlan>,
    /// Killed (`SIGKILL`) when the starting thread exits.
    pub tied: bool,
    /// `cgroup.procs` files, opened for writing, that the child joins first
    /// ([`super::cgroup`]).
    pub join: &'a [RawFd],
    /// `RLIMIT_FSIZE`, bytes ([`super::file_size_limit`]); with it `SIGXFSZ` is ignored, so a
    /// write past it fails (`EFBIG`) instead of killing QEMU.
    pub file_size_limit: Option<u64>,
    /// QEMU's `madvise(MADV_HUGEPAGE)` refused ([`no_huge_pages_filter`]), so that a fault on a
    /// file-backed guest RAM reads the pages around it, not 4 MiB
    /// ([`crate::launch::MemoryMode::Private`]).
    pub no_huge_pages: bool,
}

/// A started QEMU: a child of this process, waited for by pid (as `std::process::Child`
/// is: the pid stays ours until it is reaped).
#[derive(Debug)]
pub struct Process {
    pid: libc::pid_t,
    status: Option<ExitStatus>,
}

impl Process {
    /// Its pid, as this process's pid namespace sees it.
    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// Its exit status once it has exited (reaping it), without waiting.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.wait_flags(libc::WNOHANG)
    }

    /// Waits for it to exit (reaping it).
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        loop {
            if let Some(s) = self.wait_flags(0)? {
                return Ok(s);
            }
        }
    }

    /// `SIGKILL`, unless it was already reaped.
    pub fn kill(&mut self) -> std::io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        // SAFETY: kill(2) on our own unreaped child: the pid cannot have been reused.
        if unsafe { libc::kill(self.pid, libc::SIGKILL) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait_flags(&mut self, flags: libc::c_int) -> std::io::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut raw = 0;
        loop {
            // SAFETY: waitpid(2) on our own child, into a valid int.
            let r = unsafe { libc::waitpid(self.pid, &mut raw, flags) };
            if r == self.pid {
                let s = ExitStatus::from_raw(raw);
                self.status = Some(s);
                return Ok(Some(s));
            }
            if r == 0 {
                return Ok(None);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// The seccomp filter that answers `madvise(_, _, MADV_HUGEPAGE)` with `EINVAL`, what a
/// kernel without transparent huge pages answers, and allows everything else (compiled by
/// seccompiler, as the builder's step filter is). QEMU advises all guest RAM
/// `MADV_HUGEPAGE` (`ram_block_add`) and ignores the answer. On a file mapping that advice
/// makes the kernel read 4 MiB around each fault (`do_sync_mmap_readahead`: two PMD-sized
/// folios, whatever the file's readahead size), so a lazy clone's fault on the chunk
/// server's memory file fetched 4 MiB. `PR_SET_THP_DISABLE` does not stop that: measured on
/// this host's kernel (6.18, THP `madvise`) with a private mapping of a file on a
/// 128 KiB-readahead device, one touched page left 4096 KiB in the page cache with
/// `MADV_HUGEPAGE`, with or without the prctl, and 128 KiB without the advice.
///
/// Compiled once per process, in the parent (compiling allocates; the child only installs
/// it). Errors: a filter seccompiler refuses, as text (a bug here, never input-dependent).
fn no_huge_pages_filter() -> Result<&'static seccompiler::BpfProgram, String> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };
    static FILTER: std::sync::OnceLock<Result<seccompiler::BpfProgram, String>> =
        std::sync::OnceLock::new();
    FILTER
        .get_or_init(|| {
            let advice = SeccompCondition::new(
                2,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::Eq,
                libc::MADV_HUGEPAGE as u64,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(|e| format!("the MADV_HUGEPAGE rule: {e}"))?;
            let arch = TargetArch::try_from(std::env::consts::ARCH)
                .map_err(|e| format!("the MADV_HUGEPAGE filter: {e}"))?;
            SeccompFilter::new(
                std::collections::BTreeMap::from([(libc::SYS_madvise, vec![advice])]),
                SeccompAction::Allow,
                SeccompAction::Errno(libc::EINVAL as u32),
                arch,
            )
            .and_then(|f| f.try_into())
            .map_err(|e| format!("the MADV_HUGEPAGE filter: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The steps of the child, as its error report names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Step {
    Cgroup = 1,
    FileSize,
    Private,
    Tmpfs,
    Mkdir,
    BindFile,
    BindDir,
    ReadOnly,
    Proc,
    Pivot,
    RootReadOnly,
    Stdio,
    Fds,
    Group,
    Drop,
    DeathSignal,
    HugePages,
    Exec,
}

impl Step {
    const ALL: [Step; 18] = [
        Step::Cgroup,
        Step::FileSize,
        Step::Private,
        Step::Tmpfs,
        Step::Mkdir,
        Step::BindFile,
        Step::BindDir,
        Step::ReadOnly,
        Step::Proc,
        Step::Pivot,
        Step::RootReadOnly,
        Step::Stdio,
        Step::Fds,
        Step::Group,
        Step::Drop,
        Step::DeathSignal,
        Step::HugePages,
        Step::Exec,
    ];

    fn what(self) -> &'static str {
        match self {
            Step::Cgroup => "joining QEMU's cgroup",
            Step::FileSize => "setting QEMU's file size limit",
            Step::Private => "making the mounts of QEMU's namespace private",
            Step::Tmpfs => "mounting the tmpfs of QEMU's root",
            Step::Mkdir => "making a mount point in QEMU's root",
            Step::BindFile => "binding a file into QEMU's root",
            Step::BindDir => "binding a directory into QEMU's root",
            Step::ReadOnly => "remounting a bind of QEMU's root read-only",
            Step::Proc => "mounting /proc in QEMU's root",
            Step::Pivot => "pivoting into QEMU's root",
            Step::RootReadOnly => "remounting QEMU's root read-only",
            Step::Stdio => "setting QEMU's stdio",
            Step::Fds => "handing QEMU its descriptors",
            Step::Group => "starting QEMU's process group",
            Step::Drop => "dropping to QEMU's user",
            Step::DeathSignal => "setting QEMU's parent-death signal",
            Step::HugePages => "installing QEMU's filter of MADV_HUGEPAGE",
            Step::Exec => "executing QEMU",
        }
    }
}

/// Everything the child needs, made before the `clone`.
struct Prepared {
    exe: CString,
    _argv: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: [*const libc::c_char; 1],
    stdin: OwnedFd,
    log: RawFd,
    keep: Vec<RawFd>,
    /// One past the highest descriptor this process may have (`RLIMIT_NOFILE`, capped).
    max_fd: RawFd,
    join: Vec<RawFd>,
    fsize: Option<libc::rlimit>,
    user: Option<QemuUser>,
    tied: bool,
    /// [`no_huge_pages_filter`], when asked for.
    no_huge_pages: Option<&'static seccompiler::BpfProgram>,
    jail: Option<Jail>,
}

/// The jail's paths, each under [`ROOT_MOUNT_POINT`] where it is a target.
struct Jail {
    mount_point: CString,
    /// Mount points, parents first.
    mkdirs: Vec<CString>,
    /// (host file, target).
    files: Vec<(CString, CString)>,
    /// (host directory, target).
    dirs: Vec<(CString, CString)>,
    proc_: CString,
    /// The items named by (step, index) in an error report.
    names: Vec<PathBuf>,
}

fn cstr(s: &OsStr) -> Result<CString, LaunchError> {
    CString::new(s.as_bytes())
        .map_err(|_| LaunchError::Host(format!("{s:?}: a NUL byte in a path or argument")))
}

fn under(root: &Path, p: &Path) -> PathBuf {
    root.join(p.strip_prefix("/").unwrap_or(p))
}

impl Jail {
    fn new(plan: &RootPlan) -> Result<Self, LaunchError> {
        let root = Path::new(ROOT_MOUNT_POINT);
        let mut names = Vec::new();
        let mkdirs = plan
            .mount_points()
            .into_iter()
            .map(|d| {
                let c = cstr(under(root, &d).as_os_str());
                names.push(d);
                c
            })
            .collect::<Result<Vec<_>, _>>()?;
        let pairs = |list: &[PathBuf]| {
            list.iter()
                .map(|p| Ok((cstr(p.as_os_str())?, cstr(under(root, p).as_os_str())?)))
                .collect::<Result<Vec<_>, LaunchError>>()
        };
        Ok(Jail {
            mount_point: cstr(root.as_os_str())?,
            mkdirs,
            files: pairs(&plan.files)?,
            dirs: pairs(&plan.dirs)?,
            proc_: cstr(under(root, Path::new("/proc")).as_os_str())?,
            names,
        })
    }
}

/// Starts QEMU as `l` says ([`Launch`]); returns once `execve` succeeded.
///
/// Errors: a step of the child failing ([`LaunchError::Jail`] naming the step and the path;
/// an exec that fails says the program, [`LaunchError::Exec`]).
pub(crate) fn spawn(l: &Launch<'_>) -> Result<Process, LaunchError> {
    let plan = l.root;
    let exe = match plan {
        Some(p) => p.exe.clone(),
        None => super::root::find_exe(l.program)?,
    };
    let mut argv_c = vec![cstr(exe.as_os_str())?];
    for a in l.args {
        argv_c.push(cstr(OsStr::new(a))?);
    }
    let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
    argv.push(std::ptr::null());
    let jail = match plan {
        Some(p) => {
            std::fs::create_dir_all(ROOT_MOUNT_POINT)
                .map_err(crate::launch::io_err(Path::new(ROOT_MOUNT_POINT)))?;
            Some(Jail::new(p)?)
        }
        None => None,
    };
    let stdin: OwnedFd = std::fs::File::open("/dev/null")
        .map_err(crate::launch::io_err(Path::new("/dev/null")))?
        .into();
    let prepared = Prepared {
        exe: cstr(exe.as_os_str())?,
        _argv: argv_c,
        argv,
        envp: [std::ptr::null()],
        stdin,
        log: l.log.as_raw_fd(),
        keep: l.keep.to_vec(),
        max_fd: max_fd(),
        join: l.join.to_vec(),
        fsize: l.file_size_limit.map(|b| libc::rlimit {
            rlim_cur: b,
            rlim_max: b,
        }),
        user: l.user,
        tied: l.tied,
        no_huge_pages: match l.no_huge_pages {
            true => Some(no_huge_pages_filter().map_err(LaunchError::Host)?),
            false => None,
        },
        jail,
    };
    let (err_r, err_w) = pipe()?;
    let flags = libc::SIGCHLD as libc::c_ulong
        | if prepared.jail.is_some() {
            JAIL_NAMESPACES as libc::c_ulong
        } else {
            0
        };
    // SAFETY: a fork-like clone (no CLONE_VM: the child has a copy of this address space and
    // runs on its copy of this stack). The child only runs `child`, which makes system calls
    // on `prepared` and never returns.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    if pid < 0 {
        return Err(LaunchError::Exec {
            program: exe.display().to_string(),
            source: std::io::Error::last_os_error(),
        });
    }
    if pid == 0 {
        // SAFETY: in the child; see `child`.
        unsafe { child(&prepared, err_w.as_raw_fd()) }
    }
    drop(err_w);
    let mut proc_ = Process {
        pid: pid as libc::pid_t,
        status: None,
    };
    let mut report = [0u8; 12];
    let n = read_full(&err_r, &mut report);
    if n == 0 {
        return Ok(proc_);
    }
    let _ = proc_.wait();
    let word =
        |i: usize| u32::from_ne_bytes(report[i * 4..i * 4 + 4].try_into().unwrap_or_default());
    let (step, item, errno) = (word(0), word(1) as usize, word(2) as i32);
    let step = Step::ALL.into_iter().find(|s| *s as u32 == step);
    let source = std::io::Error::from_raw_os_error(errno);
    let program = exe.display().to_string();
    Err(match step {
        Some(Step::Exec) | None => LaunchError::Exec { program, source },
        Some(s) => {
            let item = prepared.jail.as_ref().and_then(|j| match s {
                Step::Mkdir => j.names.get(item).cloned(),
                Step::BindFile | Step::ReadOnly => j
                    .files
                    .get(item)
                    .map(|f| PathBuf::from(OsStr::from_bytes(f.0.as_bytes()))),
                Step::BindDir => j
                    .dirs
                    .get(item)
                    .map(|f| PathBuf::from(OsStr::from_bytes(f.0.as_bytes()))),
                _ => None,
            });
            LaunchError::Jail {
                what: s.what(),
                path: item.map(|p| p.display().to_string()).unwrap_or_default(),
                source,
            }
        }
    })
}

/// One past the highest descriptor number this process may have (its `RLIMIT_NOFILE` soft
/// limit, at most 1 Mi).
fn max_fd() -> RawFd {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) into a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1 << 16;
    }
    r.rlim_cur.min(1 << 20) as RawFd
}

fn pipe() -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2(2) into a valid two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(LaunchError::Host(format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: both descriptors were just made and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads until `buf` is full or end of file; the bytes read.
fn read_full(fd: &OwnedFd, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        // SAFETY: reading into the unfilled rest of a valid buffer.
        let r = unsafe { libc::read(fd.as_raw_fd(), buf[n..].as_mut_ptr().cast(), buf.len() - n) };
        if r > 0 {
            n += r as usize;
        } else if r == 0
            || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            break;
        }
    }
    n
}

/// The child, after the `clone`: the jail, then `execve`. Never returns.
///
/// # Safety
/// Only in the child of [`spawn`]'s clone: it makes system calls on data prepared before the
/// clone, and allocates nothing.
unsafe fn child(p: &Prepared, err_w: RawFd) -> ! {
    let fail = |step: Step, item: usize| -> ! {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let mut buf = [0u8; 12];
        buf[0..4].copy_from_slice(&(step as u32).to_ne_bytes());
        buf[4..8].copy_from_slice(&(item as u32).to_ne_bytes());
        buf[8..12].copy_from_slice(&(errno as u32).to_ne_bytes());
        // SAFETY: writing a valid buffer to our pipe, then exiting without running anything
        // of the parent's (no atexit handlers, no destructors).
        unsafe {
            libc::write(err_w, buf.as_ptr().cast(), buf.len());
            libc::_exit(127)
        }
    };
    // SAFETY: system calls on valid NUL-terminated strings, descriptors and buffers
    // prepared before the clone (the whole body).
    unsafe {
        // The starting thread's mask and kiln's ignored SIGPIPE must not reach QEMU.
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // Until the exec, this child dies with the thread that started it, tied or not: a
        // `kiln start` killed while its clone's jail is being set up (a few ms of mounts
        // during which this process still shows kiln's command line, so no reaper can find
        // it by QEMU's) must not leave a QEMU to start later, unseen. A starter already gone
        // before the prctl took effect has closed the error pipe's read end: its write end
        // then polls as an error (pipe(7)).
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            fail(Step::DeathSignal, 0);
        }
        let mut pfd = libc::pollfd {
            fd: err_w,
            events: libc::POLLOUT,
            revents: 0,
        };
        if libc::poll(&mut pfd, 1, 0) == 1 && pfd.revents & libc::POLLERR != 0 {
            libc::_exit(127);
        }
        for (i, &fd) in p.join.iter().enumerate() {
            // `0`: the writing process itself (cgroups(7)).
            if libc::write(fd, c"0".as_ptr().cast(), 1) != 1 {
                fail(Step::Cgroup, i);
            }
        }
        if let Some(l) = &p.fsize {
            if libc::setrlimit(libc::RLIMIT_FSIZE, l) != 0 {
                fail(Step::FileSize, 0);
            }
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        }
        if let Some(j) = &p.jail {
            let none = std::ptr::null::<libc::c_char>();
            let ms = |src: *const libc::c_char,
                      dst: *const libc::c_char,
                      fstype: *const libc::c_char,
                      flags: libc::c_ulong,
                      data: *const libc::c_char| {
                libc::mount(src, dst, fstype, flags, data.cast()) == 0
            };
            if !ms(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                none,
            ) {
                fail(Step::Private, 0);
            }
            if !ms(
                c"tmpfs".as_ptr(),
                j.mount_point.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                ROOT_TMPFS.as_ptr(),
            ) {
                fail(Step::Tmpfs, 0);
            }
            for (i, d) in j.mkdirs.iter().enumerate() {
                if libc::mkdir(d.as_ptr(), 0o755) != 0 {
                    fail(Step::Mkdir, i);
                }
            }
            let ro = libc::MS_REMOUNT
                | libc::MS_BIND
                | libc::MS_RDONLY
                | libc::MS_NOSUID
                | libc::MS_NODEV;
            for (i, (src, dst)) in j.files.iter().enumerate() {
                let fd = libc::open(
                    dst.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o444,
                );
                if fd < 0 {
                    fail(Step::BindFile, i);
                }
                libc::close(fd);
                if !ms(src.as_ptr(), dst.as_ptr(), none, libc::MS_BIND, none) {
                    fail(Step::BindFile, i);
                }
                if !ms(none, dst.as_ptr(), none, ro, none) {
                    fail(Step::ReadOnly, i);
                }
            }
            for (i, (src, dst)) in j.dirs.iter().enumerate() {
                if !ms(
                    src.as_ptr(),
                    dst.as_ptr(),
                    none,
                    libc::MS_BIND | libc::MS_REC,
                    none,
                ) {
                    fail(Step::BindDir, i);
                }
                if !ms(none, dst.as_ptr(), none, ro | libc::MS_NOEXEC, none) {
                    fail(Step::BindDir, i);
                }
            }
            // This process is pid 1 of its new pid namespace: the proc it mounts shows that
            // namespace alone; `subset=pid` leaves out every file that is not a process's.
            if !ms(
                c"proc".as_ptr(),
                j.proc_.as_ptr(),
                c"proc".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                c"subset=pid".as_ptr(),
            ) {
                fail(Step::Proc, 0);
            }
            // pivot_root(".", "."): the old root ends up stacked on the new one, and is
            // detached at once (pivot_root(2), "NOTES").
            if libc::chdir(j.mount_point.as_ptr()) != 0
                || libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0
                || libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0
                || libc::chdir(c"/".as_ptr()) != 0
            {
                fail(Step::Pivot, 0);
            }
            if !ms(none, c"/".as_ptr(), none, ro | libc::MS_NOEXEC, none) {
                fail(Step::RootReadOnly, 0);
            }
        }
        let stdin = p.stdin.as_raw_fd();
        if libc::dup2(stdin, 0) < 0 || libc::dup2(p.log, 1) < 0 || libc::dup2(p.log, 2) < 0 {
            fail(Step::Stdio, 0);
        }
        // Every other descriptor closes at the exec, whoever opened it without close-on-exec
        // (kiln's own parent, a library): close_range(2)'s CLOSE_RANGE_CLOEXEC (Linux 5.11),
        // else each one up to the descriptor limit read before the clone.
        if libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        ) != 0
        {
            for fd in 3..p.max_fd {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
        }
        for (i, &fd) in p.keep.iter().enumerate() {
            // Only the child's copy loses close-on-exec: no other child inherits it.
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                fail(Step::Fds, i);
            }
        }
        if libc::setpgid(0, 0) != 0 {
            fail(Step::Group, 0);
        }
        if let Some(u) = p.user {
            // Groups first (that needs root), then gid, then uid; raw system calls, for this
            // thread alone (see the module doc).
            if libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) != 0
                || libc::syscall(libc::SYS_setresgid, u.gid, u.gid, u.gid) != 0
                || libc::syscall(libc::SYS_setresuid, u.uid, u.uid, u.uid) != 0
            {
                fail(Step::Drop, 0);
            }
        }
        // After the uid change, which clears the parent-death signal (prctl(2)): set again
        // for a tied QEMU, cleared for one that outlives its starter (a clone; without a
        // change of uid nothing cleared it).
        let death = if p.tied { libc::SIGKILL } else { 0 };
        if libc::prctl(libc::PR_SET_PDEATHSIG, death) != 0 {
            fail(Step::DeathSignal, 0);
        }
        // Kept across the exec and by QEMU's threads, and under QEMU's own `-sandbox` filter
        // (seccomp(2): the stricter answer wins). `no_new_privs` is what an unprivileged
        // filter needs; QEMU's `-sandbox` sets it too.
        // seccompiler's install allocates nothing (prctl(2) and seccomp(2)).
        if let Some(filter) = p.no_huge_pages
            && seccompiler::apply_filter(filter).is_err()
        {
            fail(Step::HugePages, 0);
        }
        libc::execve(p.exe.as_ptr(), p.argv.as_ptr(), p.envp.as_ptr());
        fail(Step::Exec, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`no_huge_pages_filter`] refuses `madvise(MADV_HUGEPAGE)` alone: in a forked child (a filter
    /// cannot be removed), that advice fails with `EINVAL` and other advice on the same
    /// mapping still succeeds. The child's exit code names the check that failed.
    #[test]
    fn the_filter_refuses_madv_hugepage_and_nothing_else() {
        let filter = no_huge_pages_filter().unwrap();
        // SAFETY: fork(2) in a test; the child makes system calls only, then `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: in the forked child: system calls on a mapping it makes itself.
            unsafe {
                if seccompiler::apply_filter(filter).is_err() {
                    libc::_exit(10);
                }
                let len = 4 << 20;
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if p == libc::MAP_FAILED {
                    libc::_exit(11);
                }
                if libc::madvise(p, len, libc::MADV_HUGEPAGE) != -1
                    || *libc::__errno_location() != libc::EINVAL
                {
                    libc::_exit(12);
                }
                for advice in [
                    libc::MADV_NOHUGEPAGE,
                    libc::MADV_DONTNEED,
                    libc::MADV_NORMAL,
                ] {
                    if libc::madvise(p, len, advice) != 0 {
                        libc::_exit(13);
                    }
                }
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child with a valid out pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child failed: {}",
            describe(status)
        );
    }

    fn describe(status: i32) -> String {
        if libc::WIFSIGNALED(status) {
            format!("killed by signal {}", libc::WTERMSIG(status))
        } else {
            format!("exit code {}", libc::WEXITSTATUS(status))
        }
    }
}
