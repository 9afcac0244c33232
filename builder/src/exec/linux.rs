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
            return Err(match rootless {
                true => ExecError::NeedsHostRoot(
                    "RUN --network=host: the host's network namespace, where a user namespace has no CAP_NET_ADMIN",
                ),
                false => ExecError::NetworkHostRefused,
            });
        }
        if spec.security == Security::Insecure && (rootless || !cfg.allow_insecure) {
            return Err(match rootless {
                true => ExecError::NeedsHostRoot(
                    "RUN --security=insecure: the host's devices and every capability on the host",
                ),
                false => ExecError::InsecureRefused,
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
            keeper_main(&plan, &fds);
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

// ---------------------------------------------------------------------------------------
// Forked side. Everything below runs in the keeper or in pid 1 and never returns.

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
fn tie_to_parent(parent: rustix::process::Pid) {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    if rustix::process::getppid() != Some(parent) {
        // SAFETY: exiting a forked child.
        unsafe { libc::_exit(SETUP_FAILED) }
    }
}

fn keeper_main(plan: &ChildPlan, fds: &Fds) -> ! {
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

/// Mounts the step's overlay on `merged` ([`super::overlay::mount`]; nodev: device nodes the
/// step makes with CAP_MKNOD cannot be opened). The builder gives a step at most
/// [`super::OVERLAY_MAX_LOWERS`] lower directories, squashing the lowest past that
/// ([`crate::build::lower::squash_plan`]), under overlayfs' own limit.
fn mount_overlay(plan: &ChildPlan, merged: &str) -> Result<(), String> {
    let lowers: Vec<&Path> = plan.lowers.iter().map(Path::new).collect();
    super::overlay::mount(
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
            Some(super::mounts::Idmap {
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
    super::mounts::mount_all(&root_fd, &plan.mounts, idmap.as_ref())?;
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
        let at = super::mounts::mount_point(&root_fd, dir, false)?;
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
    let host_devices = if super::rootless::in_user_namespace() {
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
    use rustix::thread::{CapabilitySet, CapabilitySets};
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
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: set,
            permitted: set,
            inheritable: set,
        },
    )
    .map_err(|e| format!("capset: {e}"))?;

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
        rustix::thread::set_capabilities(
            None,
            CapabilitySets {
                effective: set,
                permitted: set,
                inheritable: set,
            },
        )
        .map_err(|e| format!("capset: {e}"))?;
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
        super::seccomp::install(plan.seccomp)?;
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
fn loopback_up() -> Result<(), String> {
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

    #[test]
    fn program_lookup() {
        assert_eq!(find_program("/bin/x", "").unwrap(), "/bin/x");
        assert!(find_program("definitely-not-here", "/nonexistent").is_err());
        assert_eq!(find_program("sh", "/nonexistent:/bin").unwrap(), "/bin/sh");
    }
}
