//! The seccomp filter every build step runs under: Docker's default profile, as it applies
//! to a process holding Docker's default capabilities ([`super::DEFAULT_CAPABILITIES`]) on
//! x86-64.
//!
//! Source: moby's `profiles/seccomp/default.json` (the profile `docker run` and BuildKit's
//! `RUN` apply unless told otherwise). That profile is an allow-list with per-capability
//! additions; kiln's steps never hold CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_BOOT,
//! CAP_SYS_PTRACE, CAP_SYS_RAWIO, CAP_SYS_TIME, CAP_SYS_NICE, CAP_SYSLOG, CAP_BPF or
//! CAP_PERFMON, so of its capability-gated rules only CAP_SYS_CHROOT's (`chroot`) applies.
//! What follows from that, as in Docker:
//! - every system call that is not listed fails with `EPERM` (the profile's
//!   `defaultErrnoRet: 1`): `mount`, `umount2`, `unshare`, `setns`, `pivot_root`,
//!   `init_module`/`finit_module`/`delete_module`, `kexec_load`, `reboot`, `bpf`,
//!   `perf_event_open`, `keyctl`/`add_key`/`request_key`, `swapon`, `settimeofday`, ...;
//! - `clone` is allowed only without namespace flags (mask `0x7E020000`: CLONE_NEWNS,
//!   CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
//!   CLONE_NEWNET), and `clone3`, whose flags live in memory a filter cannot read, fails with
//!   `ENOSYS` so that the C library falls back to `clone` (glibc ≥ 2.34 does);
//! - `socket` is allowed for every family but AF_VSOCK (40), `personality` only for the
//!   values 0, 8, 0x20000, 0x20008 and 0xffffffff (a query);
//! - `ptrace`, `process_vm_readv` and `process_vm_writev` are allowed (the profile's
//!   `minKernel: 4.8` rule): a step sees only its own pid namespace.
//!
//! Differences from Docker, by design: only the x86-64 system call ABI is allowed. A call
//! through the i386 (`int 0x80`) or x32 ABI kills the step (seccompiler's architecture
//! check), where Docker also allows the i386 and x32 tables; 32-bit programs do not run in
//! kiln's steps.
//!
//! The filter is compiled once per process, in the parent ([`step_filter`]), and installed
//! by the step's pid 1 after `no_new_privs` and right before `execve` ([`install`]), so
//! that the setup before it (mounts, `pivot_root`, capabilities) is not filtered.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Docker's unconditional allow-list (the profile's first rule), the names that exist on
/// x86-64, plus `arch_prctl` and `modify_ldt` (its amd64-only rules) and `chroot`
/// (CAP_SYS_CHROOT's rule).
const ALLOWED: &[(&str, libc::c_long)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("access", libc::SYS_access),
    ("adjtimex", libc::SYS_adjtimex),
    ("alarm", libc::SYS_alarm),
    ("arch_prctl", libc::SYS_arch_prctl),
    ("bind", libc::SYS_bind),
    ("brk", libc::SYS_brk),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    ("chdir", libc::SYS_chdir),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("chroot", libc::SYS_chroot),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("clock_getres", libc::SYS_clock_getres),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("close", libc::SYS_close),
    ("close_range", libc::SYS_close_range),
    ("connect", libc::SYS_connect),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("creat", libc::SYS_creat),
    ("dup", libc::SYS_dup),
    ("dup2", libc::SYS_dup2),
    ("dup3", libc::SYS_dup3),
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_ctl_old", libc::SYS_epoll_ctl_old),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("epoll_wait_old", libc::SYS_epoll_wait_old),
    ("eventfd", libc::SYS_eventfd),
    ("eventfd2", libc::SYS_eventfd2),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    ("fadvise64", libc::SYS_fadvise64),
    ("fallocate", libc::SYS_fallocate),
    ("fanotify_mark", libc::SYS_fanotify_mark),
    ("fchdir", libc::SYS_fchdir),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchown", libc::SYS_fchown),
    ("fchownat", libc::SYS_fchownat),
    ("fcntl", libc::SYS_fcntl),
    ("fdatasync", libc::SYS_fdatasync),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("flock", libc::SYS_flock),
    ("fork", libc::SYS_fork),
    ("fremovexattr", libc::SYS_fremovexattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("fstat", libc::SYS_fstat),
    ("fstatfs", libc::SYS_fstatfs),
    ("fsync", libc::SYS_fsync),
    ("ftruncate", libc::SYS_ftruncate),
    ("futex", libc::SYS_futex),
    ("futex_waitv", libc::SYS_futex_waitv),
    ("futimesat", libc::SYS_futimesat),
    ("getcpu", libc::SYS_getcpu),
    ("getcwd", libc::SYS_getcwd),
    ("getdents", libc::SYS_getdents),
    ("getdents64", libc::SYS_getdents64),
    ("getegid", libc::SYS_getegid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getgroups", libc::SYS_getgroups),
    ("getitimer", libc::SYS_getitimer),
    ("getpeername", libc::SYS_getpeername),
    ("getpgid", libc::SYS_getpgid),
    ("getpgrp", libc::SYS_getpgrp),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("getpriority", libc::SYS_getpriority),
    ("getrandom", libc::SYS_getrandom),
    ("getresgid", libc::SYS_getresgid),
    ("getresuid", libc::SYS_getresuid),
    ("getrlimit", libc::SYS_getrlimit),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("getrusage", libc::SYS_getrusage),
    ("getsid", libc::SYS_getsid),
    ("getsockname", libc::SYS_getsockname),
    ("getsockopt", libc::SYS_getsockopt),
    ("get_thread_area", libc::SYS_get_thread_area),
    ("gettid", libc::SYS_gettid),
    ("gettimeofday", libc::SYS_gettimeofday),
    ("getuid", libc::SYS_getuid),
    ("getxattr", libc::SYS_getxattr),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_init", libc::SYS_inotify_init),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    ("io_cancel", libc::SYS_io_cancel),
    ("ioctl", libc::SYS_ioctl),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_getevents", libc::SYS_io_getevents),
    // The libc crate has no constant for it: x86-64 number 333
    // (`arch/x86/entry/syscalls/syscall_64.tbl`).
    ("io_pgetevents", 333),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("ioprio_set", libc::SYS_ioprio_set),
    ("io_setup", libc::SYS_io_setup),
    ("io_submit", libc::SYS_io_submit),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("kill", libc::SYS_kill),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("lchown", libc::SYS_lchown),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("link", libc::SYS_link),
    ("linkat", libc::SYS_linkat),
    ("listen", libc::SYS_listen),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("lseek", libc::SYS_lseek),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("lstat", libc::SYS_lstat),
    ("madvise", libc::SYS_madvise),
    ("membarrier", libc::SYS_membarrier),
    ("memfd_create", libc::SYS_memfd_create),
    ("memfd_secret", libc::SYS_memfd_secret),
    ("mincore", libc::SYS_mincore),
    ("mkdir", libc::SYS_mkdir),
    ("mkdirat", libc::SYS_mkdirat),
    ("mknod", libc::SYS_mknod),
    ("mknodat", libc::SYS_mknodat),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("mlockall", libc::SYS_mlockall),
    ("mmap", libc::SYS_mmap),
    ("modify_ldt", libc::SYS_modify_ldt),
    ("mprotect", libc::SYS_mprotect),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_open", libc::SYS_mq_open),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mremap", libc::SYS_mremap),
    ("msgctl", libc::SYS_msgctl),
    ("msgget", libc::SYS_msgget),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgsnd", libc::SYS_msgsnd),
    ("msync", libc::SYS_msync),
    ("munlock", libc::SYS_munlock),
    ("munlockall", libc::SYS_munlockall),
    ("munmap", libc::SYS_munmap),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("nanosleep", libc::SYS_nanosleep),
    ("newfstatat", libc::SYS_newfstatat),
    ("open", libc::SYS_open),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    ("pause", libc::SYS_pause),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("pipe", libc::SYS_pipe),
    ("pipe2", libc::SYS_pipe2),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("prctl", libc::SYS_prctl),
    ("pread64", libc::SYS_pread64),
    ("preadv", libc::SYS_preadv),
    ("preadv2", libc::SYS_preadv2),
    ("prlimit64", libc::SYS_prlimit64),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("pselect6", libc::SYS_pselect6),
    ("ptrace", libc::SYS_ptrace),
    ("pwrite64", libc::SYS_pwrite64),
    ("pwritev", libc::SYS_pwritev),
    ("pwritev2", libc::SYS_pwritev2),
    ("read", libc::SYS_read),
    ("readahead", libc::SYS_readahead),
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    ("readv", libc::SYS_readv),
    ("recvfrom", libc::SYS_recvfrom),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("removexattr", libc::SYS_removexattr),
    ("rename", libc::SYS_rename),
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("rmdir", libc::SYS_rmdir),
    ("rseq", libc::SYS_rseq),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_yield", libc::SYS_sched_yield),
    ("seccomp", libc::SYS_seccomp),
    ("select", libc::SYS_select),
    ("semctl", libc::SYS_semctl),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semtimedop", libc::SYS_semtimedop),
    ("sendfile", libc::SYS_sendfile),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("sendmsg", libc::SYS_sendmsg),
    ("sendto", libc::SYS_sendto),
    ("setfsgid", libc::SYS_setfsgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setgid", libc::SYS_setgid),
    ("setgroups", libc::SYS_setgroups),
    ("setitimer", libc::SYS_setitimer),
    ("setpgid", libc::SYS_setpgid),
    ("setpriority", libc::SYS_setpriority),
    ("setregid", libc::SYS_setregid),
    ("setresgid", libc::SYS_setresgid),
    ("setresuid", libc::SYS_setresuid),
    ("setreuid", libc::SYS_setreuid),
    ("setrlimit", libc::SYS_setrlimit),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("setsid", libc::SYS_setsid),
    ("setsockopt", libc::SYS_setsockopt),
    ("set_thread_area", libc::SYS_set_thread_area),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("setuid", libc::SYS_setuid),
    ("setxattr", libc::SYS_setxattr),
    ("shmat", libc::SYS_shmat),
    ("shmctl", libc::SYS_shmctl),
    ("shmdt", libc::SYS_shmdt),
    ("shmget", libc::SYS_shmget),
    ("shutdown", libc::SYS_shutdown),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("signalfd", libc::SYS_signalfd),
    ("signalfd4", libc::SYS_signalfd4),
    ("socketpair", libc::SYS_socketpair),
    ("splice", libc::SYS_splice),
    ("stat", libc::SYS_stat),
    ("statfs", libc::SYS_statfs),
    ("statx", libc::SYS_statx),
    ("symlink", libc::SYS_symlink),
    ("symlinkat", libc::SYS_symlinkat),
    ("sync", libc::SYS_sync),
    ("sync_file_range", libc::SYS_sync_file_range),
    ("syncfs", libc::SYS_syncfs),
    ("sysinfo", libc::SYS_sysinfo),
    ("tee", libc::SYS_tee),
    ("tgkill", libc::SYS_tgkill),
    ("time", libc::SYS_time),
    ("timer_create", libc::SYS_timer_create),
    ("timer_delete", libc::SYS_timer_delete),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_settime", libc::SYS_timer_settime),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("times", libc::SYS_times),
    ("tkill", libc::SYS_tkill),
    ("truncate", libc::SYS_truncate),
    ("umask", libc::SYS_umask),
    ("uname", libc::SYS_uname),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("utime", libc::SYS_utime),
    ("utimensat", libc::SYS_utimensat),
    ("utimes", libc::SYS_utimes),
    ("vfork", libc::SYS_vfork),
    ("vmsplice", libc::SYS_vmsplice),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
];

/// The namespace flags `clone` may not be given (Docker's mask, `0x7E020000`).
const CLONE_NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// The `personality(2)` arguments allowed: PER_LINUX (0), UNAME26 (8), ADDR_NO_RANDOMIZE
/// (0x20000), both (0x20008), and 0xffffffff, which only queries.
const PERSONALITIES: [u64; 5] = [0, 8, 0x20000, 0x20008, 0xffff_ffff];

/// AF_VSOCK, the one socket family refused.
const AF_VSOCK: u64 = 40;

/// The compiled filters: the allow-list, then the one that answers `clone3` with `ENOSYS`.
/// Both are installed; for `clone3` the first allows and the second refuses, so the
/// kernel returns the second's `ENOSYS` (seccomp(2): the most restrictive action wins).
#[derive(Debug)]
pub(crate) struct StepFilter {
    allow: BpfProgram,
    clone3: BpfProgram,
}

fn arg(index: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, value: u64) -> SeccompCondition {
    SeccompCondition::new(index, len, op, value).expect("argument index below 6")
}

fn compile() -> Result<StepFilter, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|&(_, nr)| (nr, Vec::new())).collect();
    // clone3 is allowed here and refused with ENOSYS by the second filter.
    rules.insert(libc::SYS_clone3, Vec::new());
    let rule = |conds: Vec<SeccompCondition>| SeccompRule::new(conds).map_err(|e| e.to_string());
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![arg(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(CLONE_NAMESPACE_FLAGS),
            0,
        )])?],
    );
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![arg(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Ne,
            AF_VSOCK,
        )])?],
    );
    rules.insert(
        libc::SYS_personality,
        PERSONALITIES
            .iter()
            .map(|&p| rule(vec![arg(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, p)]))
            .collect::<Result<_, _>>()?,
    );
    let allow = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| format!("the step seccomp filter: {e}"))?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| format!("the step clone3 filter: {e}"))?;
    Ok(StepFilter {
        allow: allow
            .try_into()
            .map_err(|e| format!("compiling the step seccomp filter: {e}"))?,
        clone3: clone3
            .try_into()
            .map_err(|e| format!("compiling the step clone3 filter: {e}"))?,
    })
}

/// The step filter, compiled on first use (in the parent, before any fork). Errors: a
/// filter seccompiler refuses, as text (a bug in the table above, never input-dependent).
pub(crate) fn step_filter() -> Result<&'static StepFilter, String> {
    static FILTER: OnceLock<Result<StepFilter, String>> = OnceLock::new();
    FILTER.get_or_init(compile).as_ref().map_err(Clone::clone)
}

/// Installs `filter` on the calling thread (the step's pid 1, single-threaded, after
/// `no_new_privs`), so that it and every process it starts run under it. Errors: the
/// `seccomp(2)` call failed, as text.
pub(crate) fn install(filter: &StepFilter) -> Result<(), String> {
    seccompiler::apply_filter(&filter.allow).map_err(|e| format!("seccomp: {e}"))?;
    seccompiler::apply_filter(&filter.clone3).map_err(|e| format!("seccomp (clone3): {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_filter_compiles_and_names_each_call_once() {
        let f = step_filter().unwrap();
        assert!(f.allow.len() > ALLOWED.len(), "{}", f.allow.len());
        let mut names: Vec<&str> = ALLOWED.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a name is listed twice");
        for refused in ["mount", "umount2", "unshare", "setns", "init_module", "bpf"] {
            assert!(!names.contains(&refused), "{refused} is allowed");
        }
    }

    /// The filter's answers, checked in a forked child that installs it (seccomp needs
    /// `no_new_privs`, not root): `clone3` gets ENOSYS (so glibc falls back to `clone`),
    /// a user namespace, an AF_VSOCK socket and a BSD personality get EPERM, a plain
    /// `clone`-free call and an AF_UNIX socket work. The child reports one bit per
    /// expectation that failed in its exit code.
    #[test]
    fn filter_answers_clone3_with_enosys_and_refuses_namespaces_and_vsock() {
        let f = step_filter().unwrap();
        // SAFETY: the child makes system calls only (no allocation, no locks) and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            let mut bad = 0;
            // SAFETY: plain system calls with scalar or null arguments.
            unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || install(f).is_err() {
                    libc::_exit(100);
                }
                if libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) != -1
                    || errno() != libc::ENOSYS
                {
                    bad |= 1;
                }
                if libc::unshare(libc::CLONE_NEWUSER) != -1 || errno() != libc::EPERM {
                    bad |= 2;
                }
                if libc::socket(AF_VSOCK as i32, libc::SOCK_STREAM, 0) != -1
                    || errno() != libc::EPERM
                {
                    bad |= 4;
                }
                if libc::personality(6) != -1 || errno() != libc::EPERM {
                    bad |= 8;
                }
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                if s < 0 || libc::getpid() <= 0 || libc::personality(0xffff_ffff) < 0 {
                    bad |= 16;
                }
                libc::_exit(bad);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "bits of failed expectations");
    }
}
