//! The real executor: fork, namespaces, overlayfs, pivot_root, limits.
//!
//! Process shape. The (possibly multithreaded) caller forks once with glibc's `fork`
//! (which resets the allocator's locks in the child, so the child may allocate; it touches
//! no other lock: no stdio, no environment, no logging). That child, "the keeper", joins
//! the step's cgroup, unshares mount, pid, uts, ipc and (unless host) network namespaces,
//! waits for slirp4netns when the network is `default`, and forks the step's pid 1. Pid 1
//! makes the mounts in its private mount namespace (the step's trees through idmapped mounts
//! of the steps' user namespace, `userns.rs`), pivots into the overlay, enters that user
//! namespace as its root (the mount, pid, uts, ipc and network namespaces stay the host
//! root's, so the step can change none of them), drops privileges, installs Docker's
//! default seccomp profile (`seccomp.rs`) and execs the command. The keeper reports pid 1's wait status through a pipe
//! and exits. Setup errors travel as text through a close-on-exec pipe. When pid 1 exits,
//! the kernel kills the rest of its pid namespace; the mount namespace, and with it every
//! mount, goes with its last process.

mod child;

use child::{loopback_up, tie_to_parent};

use crate::workdir::tree_size;
use std::ffi::{CStr, CString};
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kiln_recipes::plan::{DEFAULT_PATH, Network, Security};
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

use super::cgroup::{CgroupLimits, StepCgroup};
use super::logs::LogShaper;
use super::userns::{IdMap, child as ns};
use super::{
    DEFAULT_CAPABILITIES, ExecConfig, ExecError, LogLine, StepExecutor, StepReport, StepSpec,
};
use crate::user::resolve_user;

/// Paths created as mount points, removed from the upper directory afterwards when the
/// step did not put anything there.
const MOUNT_POINTS: [&str; 5] = ["proc", "sys", "dev", "etc/hosts", "etc/resolv.conf"];
/// How often the write limit is checked while a step runs.
const WRITE_CHECK_EVERY: Duration = Duration::from_secs(1);
/// Exit code of the keeper or pid 1 when setup fails.
const SETUP_FAILED: i32 = 125;

static STEP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The real Linux executor (needs root).
#[derive(Debug, Clone, Default)]
pub struct LinuxExecutor {
    /// Its configuration.
    pub config: ExecConfig,
}

impl LinuxExecutor {
    /// An executor with `config`.
    pub fn new(config: ExecConfig) -> Self {
        LinuxExecutor { config }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ExecError {
    let what = what.into();
    move |source| ExecError::Io { what, source }
}

fn overlay_path(p: &Path) -> Result<String, ExecError> {
    let s = p
        .to_str()
        .ok_or_else(|| ExecError::BadPath(p.to_path_buf()))?;
    if s.contains([':', ',', '\n']) || !s.starts_with('/') {
        return Err(ExecError::BadPath(p.to_path_buf()));
    }
    Ok(s.to_string())
}

/// Heredoc files go only directly under `/dev/pipes/` (the step's own tmpfs), one plain
/// name each: never over `/proc`, `/etc/hosts` or into the layer.
fn check_pipe_path(path: &str) -> Result<(), ExecError> {
    let ok = path.strip_prefix("/dev/pipes/").is_some_and(|name| {
        !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
    });
    if ok {
        Ok(())
    } else {
        Err(ExecError::Unsupported(format!(
            "heredoc file {path:?} is not a plain name under /dev/pipes/"
        )))
    }
}

/// Host-side scratch of one step: mount point and the hosts / resolv.conf sources.
struct Scratch {
    dir: PathBuf,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Everything the forked children need, prepared before fork.
struct ChildPlan {
    parent: rustix::process::Pid,
    procs_files: Vec<PathBuf>,
    unshare_net: bool,
    wait_for_net: bool,
    /// Lower directories, topmost first.
    lowers: Vec<String>,
    merged: PathBuf,
    hosts: PathBuf,
    resolv: PathBuf,
    hostname: String,
    spec: StepSpec,
    bring_lo_up: bool,
    /// `RUN --mount`s (cache locks held until the plan is dropped, after the step).
    mounts: super::mounts::PreparedMounts,
    /// The seccomp filter pid 1 installs right before `execve` (compiled before the fork).
    seccomp: &'static super::seccomp::StepFilter,
    /// The user namespace the step runs in ([`super::userns`]): its map and a descriptor of
    /// it (held open by [`LinuxExecutor::run`] until the step is done); `None`: host root.
    userns: Option<(IdMap, RawFd)>,
    /// How many ids (from 0) the step's user namespace has: [`IdMap::count`] of `userns`, or
    /// in a rootless kiln's own namespace [`super::rootless::namespace_ids`]; `None`: host
    /// root's, every id. A `USER` past them fails naming the range.
    step_ids: Option<u32>,
    /// What pid 1 shows through the user namespace's idmapped mounts: the step's scratch,
    /// the parent of its upper and work directories, its lower directories.
    idmapped: Vec<PathBuf>,
    /// The step's network namespace, made owned by its user namespace
    /// ([`super::userns::net_namespace`]), which the keeper joins instead of unsharing one.
    net_ns: Option<OwnedFd>,
}

struct Fds {
    log_w: RawFd,
    err_w: RawFd,
    status_w: RawFd,
    sync_w: RawFd,
    go_r: RawFd,
}

fn write_all_fd(fd: RawFd, data: &[u8]) {
    let mut off = 0;
    while off < data.len() {
        // SAFETY: writing from a valid slice to a file descriptor we own.
        let n = unsafe { libc::write(fd, data[off..].as_ptr().cast(), data.len() - off) };
        if n <= 0 {
            return;
        }
        off += n as usize;
    }
}

fn fail(fds: &Fds, msg: &str) -> ! {
    write_all_fd(fds.err_w, msg.as_bytes());
    // SAFETY: _exit never returns and skips atexit handlers, as a forked child must.
    unsafe { libc::_exit(SETUP_FAILED) }
}

impl StepExecutor for LinuxExecutor {
    fn run(
        &self,
        spec: &StepSpec,
        cancel: &AtomicBool,
        sink: &mut (dyn FnMut(LogLine) + Send),
    ) -> Result<StepReport, ExecError> {
        let cfg = &self.config;
        if spec.argv.is_empty() {
            return Err(ExecError::EmptyCommand);
        }
        // In a user namespace (a build without root) neither can be had, entitled or not.
        let rootless = super::rootless::in_user_namespace();
        if spec.network == Network::Host && (rootless || !cfg.allow_network_host) {
            return Err(if rootless {
                ExecError::NeedsHostRoot(
                    "RUN --network=host: the host's network namespace, where a user namespace \
                     has no CAP_NET_ADMIN",
                )
            } else {
                ExecError::NetworkHostRefused
            });
        }
        if spec.security == Security::Insecure && (rootless || !cfg.allow_insecure) {
            return Err(if rootless {
                ExecError::NeedsHostRoot(
                    "RUN --security=insecure: the host's devices and every capability on the host",
                )
            } else {
                ExecError::InsecureRefused
            });
        }
        for f in &spec.files {
            if let Some(path) = &f.path {
                check_pipe_path(path)?;
            }
        }
        fs::create_dir_all(&cfg.run_dir).map_err(io("creating the run directory"))?;
        let scratch = Scratch {
            // Named after this process, so that the next build can tell a dead build's
            // scratch from a live one's (crate::workdir::reap_dead_builds).
            dir: cfg.run_dir.join(format!(
                "step-{}-{}",
                crate::workdir::owner_token(),
                STEP_COUNTER.fetch_add(1, Ordering::Relaxed)
            )),
        };
        let merged = scratch.dir.join("root");
        let empty_lower = scratch.dir.join("empty");
        fs::create_dir_all(&merged).map_err(io("creating the mount point"))?;
        fs::create_dir_all(&empty_lower).map_err(io("creating the mount point"))?;

        // Overlay options.
        let mut lowers = Vec::new();
        for l in &spec.lower_dirs {
            lowers.push(overlay_path(l)?);
        }
        if lowers.is_empty() {
            lowers.push(overlay_path(&empty_lower)?);
        }
        // The upper and work directories too are named in mount(2)'s option syntax when the
        // new mount API is missing (super::overlay).
        overlay_path(&spec.upper_dir)?;
        overlay_path(&spec.work_dir)?;

        // /etc/hosts and /etc/resolv.conf.
        let hosts = scratch.dir.join("hosts");
        let resolv = scratch.dir.join("resolv.conf");
        let hosts_text = format!(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{}\n",
            cfg.hostname
        );
        let resolv_text = match spec.network {
            Network::Default => "nameserver 10.0.2.3\n".to_string(),
            Network::Host => fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
            // Names are resolved by the egress proxy, on the host.
            Network::None | Network::Allow(_) => String::new(),
        };
        fs::write(&hosts, hosts_text).map_err(io("writing hosts"))?;
        fs::write(&resolv, resolv_text).map_err(io("writing resolv.conf"))?;

        // The user namespace: none for `--security=insecure` (the host's capabilities are
        // its point; Docker's `--privileged` needs `--userns=host` likewise).
        let map = if spec.security == Security::Insecure {
            None
        } else {
            cfg.userns.map()?
        };
        // The ids of the step's user namespace: its map's, or a rootless kiln's own.
        let step_ids = map.map(|m| m.count).or_else(super::rootless::namespace_ids);
        if let Some(count) = step_ids {
            super::mounts::check_owners(&spec.mounts, count)?;
        }
        let mounts = super::mounts::prepare(&spec.mounts, &spec.lower_dirs, &scratch.dir)?;

        let ns_fd = map.map(super::userns::namespace).transpose()?;
        let mut idmapped = Vec::new();
        if map.is_some() {
            // overlayfs wants upper and work directories on one mount: their parent.
            let parent = spec.upper_dir.parent();
            if parent.is_none() || parent != spec.work_dir.parent() {
                return Err(ExecError::Userns(format!(
                    "the upper directory {} and the work directory {} must share a parent \
                     (one idmapped mount shows both)",
                    spec.upper_dir.display(),
                    spec.work_dir.display()
                )));
            }
            idmapped.push(scratch.dir.clone());
            idmapped.extend(parent.map(Path::to_path_buf));
            idmapped.extend(spec.lower_dirs.iter().cloned());
        }

        let cgroup = StepCgroup::create(
            &cfg.cgroup_parent,
            CgroupLimits {
                memory_bytes: cfg.memory_bytes,
                pids_max: cfg.pids_max,
            },
        )?;

        let plan = ChildPlan {
            parent: rustix::process::getpid(),
            procs_files: cgroup.procs_files(),
            unshare_net: spec.network != Network::Host,
            wait_for_net: matches!(spec.network, Network::Default | Network::Allow(_)),
            lowers,
            merged: merged.clone(),
            hosts,
            resolv,
            hostname: cfg.hostname.clone(),
            spec: child_spec(spec),
            bring_lo_up: spec.network != Network::Host,
            mounts,
            seccomp: super::seccomp::step_filter().map_err(ExecError::Seccomp)?,
            userns: map.zip(ns_fd.as_ref().map(|fd| fd.as_raw_fd())),
            step_ids,
            idmapped,
            net_ns: match &ns_fd {
                Some(userns) if spec.network != Network::Host => {
                    Some(super::userns::net_namespace(userns)?)
                }
                _ => None,
            },
        };
        let pipe = || {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| io("pipe")(e.into()))
        };
        let (log_r, log_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let (status_r, status_w) = pipe()?;
        let (sync_r, sync_w) = pipe()?;
        let (go_r, go_w) = pipe()?;
        let fds = Fds {
            log_w: log_w.as_raw_fd(),
            err_w: err_w.as_raw_fd(),
            status_w: status_w.as_raw_fd(),
            sync_w: sync_w.as_raw_fd(),
            go_r: go_r.as_raw_fd(),
        };

        // SAFETY: fork(2) has no memory-safety preconditions; the child only runs
        // `keeper`, which never returns (it calls _exit), uses no lock but the allocator's
        // (reset by glibc's fork) and touches no Rust-side shared state.
        let keeper = unsafe { libc::fork() };
        if keeper < 0 {
            return Err(io("fork")(std::io::Error::last_os_error()));
        }
        if keeper == 0 {
            child::keeper_main(&plan, &fds);
        }
        // The egress proxy writes its refusals into the step's log, as the step does.
        let proxy_log = match spec.network {
            Network::Allow(_) => Some(log_w.try_clone().map_err(io("dup of the log pipe"))?),
            _ => None,
        };
        drop((log_w, err_w, status_w, sync_w, go_r));
        let mut guard = KeeperGuard {
            pid: keeper,
            reaped: false,
        };

        let mut slirp: Option<SlirpGuard> = None;
        let mut proxy: Option<crate::egress::proxy::ProxyThread> = None;
        if plan.wait_for_net {
            let mut b = [0u8; 1];
            let mut sync = fs::File::from(sync_r);
            if sync.read(&mut b).ok() == Some(1) {
                let up = match (&spec.network, proxy_log) {
                    (Network::Allow(rules), Some(log)) => {
                        start_proxy(keeper, rules, &cfg.addresses, log).map(|p| proxy = Some(p))
                    }
                    _ => start_slirp(&cfg.slirp4netns, keeper, plan.parent)
                        .map(|child| slirp = Some(SlirpGuard(child))),
                };
                if let Err(e) = up {
                    cgroup.kill_all();
                    guard.reap();
                    return Err(e);
                }
            }
            if slirp.is_some() || proxy.is_some() {
                let mut go = fs::File::from(go_w);
                let _ = go.write_all(b"g");
            }
        } else {
            drop((sync_r, go_w));
        }

        // Logs on their own thread; the wait loop here.
        let mut limits = cfg.log_limits;
        if let Some(budget) = spec.log_budget {
            limits.total_max = limits.total_max.min(budget);
        }
        let mut shaper = LogShaper::new(spec.index, limits, &spec.secrets);
        let outcome = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut f = fs::File::from(log_r);
                let mut buf = vec![0u8; 16384];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => shaper.push(&buf[..n], sink),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                shaper.finish(sink);
                shaper
            });
            let deadline = Instant::now() + spec.timeout;
            let mut next_write_check = Instant::now() + WRITE_CHECK_EVERY;
            let mut stop: Option<ExecError> = None;
            loop {
                if guard.try_reap() {
                    break;
                }
                if stop.is_none() {
                    let now = Instant::now();
                    if cancel.load(Ordering::Relaxed) {
                        stop = Some(ExecError::Cancelled);
                    } else if now >= deadline {
                        stop = Some(ExecError::Timeout {
                            after: spec.timeout,
                            stopped: super::STOPPED_PROCESSES,
                        });
                    } else if now >= next_write_check {
                        next_write_check = now + WRITE_CHECK_EVERY;
                        let written = tree_size(&spec.upper_dir);
                        if written > cfg.write_limit_bytes {
                            stop = Some(ExecError::WriteLimit {
                                limit_bytes: cfg.write_limit_bytes,
                                written_bytes: written,
                            });
                        }
                    }
                    if stop.is_some() {
                        cgroup.kill_all();
                        // Without a group (a rootless kiln's, StepCgroup::create), the
                        // keeper's death takes pid 1, and with it the pid namespace.
                        guard.reap();
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            // The keeper is gone; anything left (there should be nothing) is killed, and
            // the proxy stopped (it holds a writer), so the log pipe closes.
            cgroup.kill_all();
            drop(proxy);
            // A thread that panicked has already reported the panic; keep its default.
            let shaper = reader
                .join()
                .unwrap_or_else(|_| LogShaper::new(0, cfg.log_limits, &[]));
            (stop, shaper)
        });
        let (stop, shaper) = outcome;
        drop(slirp);
        let events = cgroup.events();
        drop(cgroup);

        let mut setup_err = String::new();
        let _ = fs::File::from(err_r).read_to_string(&mut setup_err);
        let mut status_buf = [0u8; 4];
        let got_status = fs::File::from(status_r).read_exact(&mut status_buf).is_ok();
        cleanup_mount_points(spec);
        super::mounts::cleanup(&plan.mounts, &spec.upper_dir, &spec.lower_dirs);

        if let Some(e) = stop {
            return Err(e);
        }
        if !setup_err.is_empty() {
            return Err(ExecError::Setup(setup_err));
        }
        let tail = shaper.tail();
        if !got_status {
            return Err(ExecError::Setup(
                "the step's keeper died without a status".into(),
            ));
        }
        let status = i32::from_ne_bytes(status_buf);
        if libc::WIFSIGNALED(status) {
            let signal = libc::WTERMSIG(status);
            if signal == libc::SIGKILL && events.oom_kills > 0 {
                return Err(ExecError::MemoryLimit {
                    limit_bytes: cfg.memory_bytes,
                    tail,
                });
            }
            return Err(ExecError::Signaled { signal, tail });
        }
        let exit_code = libc::WEXITSTATUS(status);
        if exit_code != 0 {
            if events.oom_kills > 0 {
                return Err(ExecError::MemoryLimit {
                    limit_bytes: cfg.memory_bytes,
                    tail,
                });
            }
            if events.pids_hits > 0 {
                return Err(ExecError::PidsLimit {
                    limit: cfg.pids_max,
                    exit_code: Some(exit_code),
                    tail,
                });
            }
            return Err(ExecError::Failed { exit_code, tail });
        }
        StepReport::of_success(&spec.upper_dir, cfg.write_limit_bytes, &shaper, tail)
    }
}

/// Reaps the keeper on every path out of `run`.
struct KeeperGuard {
    pid: libc::pid_t,
    reaped: bool,
}

impl KeeperGuard {
    fn try_reap(&mut self) -> bool {
        if self.reaped {
            return true;
        }
        let mut st = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        let r = unsafe { libc::waitpid(self.pid, &mut st, libc::WNOHANG) };
        if r == self.pid || r < 0 {
            self.reaped = true;
        }
        self.reaped
    }

    fn reap(&mut self) {
        if self.reaped {
            return;
        }
        // SAFETY: signalling and waiting for our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            let mut st = 0;
            libc::waitpid(self.pid, &mut st, 0);
        }
        self.reaped = true;
    }
}

impl Drop for KeeperGuard {
    fn drop(&mut self) {
        self.reap();
    }
}

struct SlirpGuard(Child);

impl Drop for SlirpGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts slirp4netns for the network namespace of `pid` and waits until it is ready
/// (`--ready-fd`, slirp4netns(1)). `--disable-host-loopback` keeps the host's 127.0.0.1
/// out of reach through the gateway address.
///
/// slirp4netns dies with the thread that starts it (`PR_SET_PDEATHSIG`, prctl(2)): the
/// thread running [`LinuxExecutor::run`], which waits for the step, so a SIGKILLed kiln leaves
/// no slirp4netns behind (the keeper and pid 1 die the same way). `parent` is this process:
/// a child whose parent died before the prctl took effect exits at once.
fn start_slirp(
    program: &Path,
    pid: libc::pid_t,
    parent: rustix::process::Pid,
) -> Result<Child, ExecError> {
    let (ready_r, ready_w) = rustix::pipe::pipe().map_err(|e| io("pipe")(e.into()))?;
    let ready_fd = ready_w.as_raw_fd();
    let mut cmd = Command::new(program);
    cmd.args([
        "--configure",
        "--mtu=65520",
        "--disable-host-loopback",
        "--enable-sandbox",
        "--enable-seccomp",
        &format!("--ready-fd={ready_fd}"),
        &pid.to_string(),
        "tap0",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2),
    // getppid(2) and _exit(2), which are async-signal-safe; it touches no memory of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            tie_to_parent(parent);
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| ExecError::Slirp(format!("{}: {e}", program.display())))?;
    drop(ready_w);
    let mut b = [0u8; 1];
    let mut r = fs::File::from(ready_r);
    if r.read(&mut b).ok() != Some(1) {
        let _ = child.kill();
        let out = child.wait_with_output().ok();
        let msg = out
            .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_string())
            .unwrap_or_default();
        return Err(ExecError::Slirp(format!("not ready: {msg}")));
    }
    Ok(child)
}

/// The spec pid 1 runs: an allow-list step also gets the proxy variables, before its own
/// environment (so an `ENV` of the recipe still wins; one that points elsewhere reaches
/// nothing).
fn child_spec(spec: &StepSpec) -> StepSpec {
    let mut s = spec.clone();
    if matches!(spec.network, Network::Allow(_)) {
        let mut env = crate::egress::proxy_env();
        env.append(&mut s.env);
        s.env = env;
    }
    s
}

/// Opens the egress proxy's listener inside the network namespace of `pid` (the keeper,
/// after its `unshare`) and serves it on the host ([`crate::egress`] explains the shape):
/// a host thread joins the namespace (`setns(2)`), brings `lo` up, binds
/// `127.0.0.1:`[`crate::egress::PROXY_PORT`] and ends; the socket stays in the step's
/// namespace. Refusals are written to `log` (the step's log pipe).
fn start_proxy(
    pid: libc::pid_t,
    rules: &kiln_recipes::plan::Egress,
    addresses: &crate::egress::address::AddressPolicy,
    log: OwnedFd,
) -> Result<crate::egress::proxy::ProxyThread, ExecError> {
    let ns_path = format!("/proc/{pid}/ns/net");
    let ns = fs::File::open(&ns_path).map_err(io(format!("opening {ns_path}")))?;
    let listener = std::thread::scope(|s| {
        s.spawn(|| -> Result<std::net::TcpListener, String> {
            // SAFETY: setns(2) on a descriptor we own; it changes only this thread's network
            // namespace, and the thread ends right after.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!(
                    "setns {ns_path}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            loopback_up()?;
            std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, crate::egress::PROXY_PORT))
                .map_err(|e| format!("binding the egress proxy in the step: {e}"))
        })
        .join()
        .unwrap_or_else(|_| Err("the egress listener thread panicked".into()))
    })
    .map_err(ExecError::Setup)?;
    let log = fs::File::from(log);
    let proxy = crate::egress::proxy::Proxy::new(rules.clone(), addresses.clone(), move |line| {
        let mut l = line.to_string();
        l.push('\n');
        // One write per line: a pipe write of at most PIPE_BUF bytes is atomic (pipe(7)),
        // so the line does not interleave with the step's own output.
        let _ = (&log).write_all(l.as_bytes());
    });
    crate::egress::proxy::spawn(listener, proxy).map_err(io("starting the egress proxy"))
}

/// Removes from `spec`'s upper directory the mount points a step's root needs (`proc`,
/// `sys`, `dev`, `etc/hosts`, `etc/resolv.conf`, and `etc` when only they made it) where no
/// lower has them and the step left them empty: they are the executor's, not the step's. Both
/// executors call it, so that a step gives the same layer under either.
pub fn cleanup_mount_points(spec: &StepSpec) {
    for mp in MOUNT_POINTS.iter().rev() {
        if spec
            .lower_dirs
            .iter()
            .any(|l| l.join(mp).symlink_metadata().is_ok())
        {
            continue;
        }
        // The step may have renamed a parent away and put a symlink in its place (a
        // directory holding a mount point can be renamed): never follow one on the host.
        if !super::mounts::real_dirs_to(&spec.upper_dir, mp) {
            continue;
        }
        let p = spec.upper_dir.join(mp);
        let Ok(md) = p.symlink_metadata() else {
            continue;
        };
        if md.is_dir() {
            let _ = fs::remove_dir(&p);
        } else if md.is_file() && md.len() == 0 {
            let _ = fs::remove_file(&p);
        }
    }
    // `etc` itself, when making the mount points created or copied it up and the step
    // left it empty with the lower's owner and mode (and not opaque).
    let etc = spec.upper_dir.join("etc");
    let Ok(md) = etc.symlink_metadata() else {
        return;
    };
    let empty = fs::read_dir(&etc)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if !md.is_dir() || !empty {
        return;
    }
    let mut buf = [0u8; 8];
    if rustix::fs::lgetxattr(&etc, super::rootless::overlay_opaque_xattr(), &mut buf).is_ok() {
        return;
    }
    let lower = spec
        .lower_dirs
        .iter()
        .find_map(|l| l.join("etc").symlink_metadata().ok());
    let same = match lower {
        None => true,
        Some(l) => {
            l.is_dir() && l.mode() == md.mode() && l.uid() == md.uid() && l.gid() == md.gid()
        }
    };
    if same {
        let _ = fs::remove_dir(&etc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_paths_refuse_option_syntax() {
        assert!(overlay_path(Path::new("/a/b")).is_ok());
        assert!(overlay_path(Path::new("/a:b")).is_err());
        assert!(overlay_path(Path::new("/a,upperdir=/x")).is_err());
        assert!(overlay_path(Path::new("relative")).is_err());
    }

    #[test]
    fn heredoc_paths_stay_in_dev_pipes() {
        assert!(check_pipe_path("/dev/pipes/EOF").is_ok());
        for bad in [
            "/dev/pipes/",
            "/dev/pipes/..",
            "/dev/pipes/../../proc/sys/kernel/core_pattern",
            "/dev/pipes/a/b",
            "/etc/hosts",
            "/dev/pipes/a\0b",
        ] {
            assert!(check_pipe_path(bad).is_err(), "{bad}");
        }
    }
}
