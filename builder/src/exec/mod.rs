//! Isolated execution of one `RUN` step (issue 5).
//!
//! A step runs on an overlayfs whose lower directories are the parent's unpacked layers
//! (topmost first) and whose upper directory is fresh: what the command writes lands in
//! [`StepSpec::upper_dir`], which the caller turns into a layer. The isolation itself sits
//! behind [`StepExecutor`]:
//!
//! - [`LinuxExecutor`] (module `linux`): the real one. New mount, pid, uts, ipc and network
//!   namespaces, `pivot_root`, fresh `/proc` (with `/proc/sys` and friends read-only), a
//!   minimal `/dev`, read-only `/sys`, hostname, `/etc/hosts` and `/etc/resolv.conf`, the
//!   network mode (`none`: only `lo`; `default`: slirp4netns; an allow-list: only `lo` and
//!   the egress proxy, [`crate::egress`]), `USER`
//!   ([`user`]), `WORKDIR`, `ENV`, Docker's default capabilities, `no_new_privs`, a cgroup
//!   ([`cgroup`]) for the memory and pids limits, a timeout, a write limit, and logs shaped by
//!   [`logs`], all in a user namespace whose root is an unprivileged host uid ([`userns`]).
//!   Needs root.
//! - [`RecordingExecutor`]: a recording fake that runs nothing and returns scripted results,
//!   for fast unit tests of whatever drives the executor.
//!
//! Every mount lives in the step's own mount namespace, which dies with its last process,
//! so nothing is left mounted on the host whatever the outcome; the step's cgroup is killed
//! and removed before [`StepExecutor::run`] returns.

pub mod cgroup;
mod linux;
pub mod logs;
pub mod mounts;
pub mod overlay;
pub mod rootless;
mod seccomp;
pub mod userns;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kiln_recipes::plan::{Action, InlineFile, Network, Security, Step};

use crate::workdir::tree_size;
pub use cgroup::{CgroupError, CgroupLayout};
pub use linux::{LinuxExecutor, cleanup_mount_points};
pub use logs::{LogLimits, LogLine};
pub use mounts::{
    CacheMount, GuestMount, MountInputs, MountKind, MountsError, PreparedMounts, StepMount,
};

/// Docker's default capability set (moby `oci/caps/defaults.go`): CHOWN, DAC_OVERRIDE,
/// FOWNER, FSETID, KILL, SETGID, SETUID, SETPCAP, NET_BIND_SERVICE, NET_RAW, SYS_CHROOT,
/// MKNOD, AUDIT_WRITE, SETFCAP, as a bit mask by capability number (linux/capability.h).
/// A root step shows it as `CapEff: 00000000a80425fb` in `/proc/self/status`.
pub const DEFAULT_CAPABILITIES: u64 = (1 << 0)
    | (1 << 1)
    | (1 << 3)
    | (1 << 4)
    | (1 << 5)
    | (1 << 6)
    | (1 << 7)
    | (1 << 8)
    | (1 << 10)
    | (1 << 13)
    | (1 << 18)
    | (1 << 27)
    | (1 << 29)
    | (1 << 31);

/// What [`ExecError::Timeout`] says was killed under the namespace executor.
pub const STOPPED_PROCESSES: &str = "the step's processes were killed";
/// What [`ExecError::Timeout`] says was killed under the microVM executor.
pub const STOPPED_VM: &str = "the step's microVM was killed";

/// Default per-step write limit, bytes (10 GiB): the blocks allocated in the upper directory.
pub const DEFAULT_WRITE_LIMIT_BYTES: u64 = 10 << 30;
/// Default size of one `RUN --mount=type=cache` disk of the microVM executor, bytes (2 GiB).
pub const DEFAULT_CACHE_DISK_BYTES: u64 = 2 << 30;
/// Default bound on the microVM executor's cache disks of one cache base together, bytes
/// (8 GiB).
pub const DEFAULT_CACHE_DISKS_TOTAL_BYTES: u64 = 8 << 30;
/// Default per-step limit on tasks (processes and threads).
pub const DEFAULT_PIDS_MAX: u64 = 4096;
/// The hostname every step sees (DESIGN.md: sandboxes are `runtime-guest`).
pub const DEFAULT_HOSTNAME: &str = "runtime-guest";

/// How the executor is set up (one per build or per process).
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// Memory limit of a step, bytes (default 1 GiB, DESIGN.md "Build limits").
    pub memory_bytes: u64,
    /// Maximum tasks in a step (default [`DEFAULT_PIDS_MAX`]).
    pub pids_max: u64,
    /// Maximum bytes a step may write (the blocks allocated in its upper directory, `st_blocks`
    /// × 512, so holes of sparse files do not count; checked about
    /// every second while it runs and once after; default [`DEFAULT_WRITE_LIMIT_BYTES`]).
    pub write_limit_bytes: u64,
    /// Size of each `RUN --mount=type=cache` disk of the microVM executor, bytes (its ext4
    /// file system's size, so the most a cache holds; the image file is sparse): used when a
    /// cache disk is made, an existing one keeps its size. Default
    /// [`DEFAULT_CACHE_DISK_BYTES`]. The namespace executor's cache directories are unbounded.
    pub cache_disk_bytes: u64,
    /// Most bytes the microVM executor's cache disks of one cache base (one workspace's, for
    /// `kiln serve`'s builds; else the host's) take together on the host: their allocated
    /// blocks (`st_blocks` × 512; the images are sparse). Past it, when a step takes a cache,
    /// the least recently taken other disks that no step holds are removed until the rest
    /// fit. Default [`DEFAULT_CACHE_DISKS_TOTAL_BYTES`].
    pub cache_disks_total_bytes: u64,
    /// Whether `RUN --network=host` is allowed (`--allow network.host`).
    pub allow_network_host: bool,
    /// Whether `RUN --security=insecure` is allowed (`--allow security.insecure`).
    pub allow_insecure: bool,
    /// Hostname inside steps.
    pub hostname: String,
    /// Parent of the per-step cgroups, relative to each hierarchy (default `kiln`; in a
    /// user namespace `kiln-<host uid>`, [`rootless::cgroup_parent`]).
    pub cgroup_parent: String,
    /// Directory for per-step scratch (mount point, hosts files); default
    /// `$TMPDIR/kiln-exec`. Must not contain `:` or `,` (overlayfs option syntax).
    pub run_dir: PathBuf,
    /// Log limits.
    pub log_limits: LogLimits,
    /// The `slirp4netns` program for [`Network::Default`].
    pub slirp4netns: PathBuf,
    /// What the egress proxy of [`Network::Allow`] steps may connect to
    /// ([`crate::egress`]); the build sets it to its `ADD` fetch's policy.
    pub addresses: crate::egress::address::AddressPolicy,
    /// The user namespace steps of the namespace executor run in ([`userns`]; default from
    /// `KILN_STEP_USERNS`: the subordinate ids of `kiln`).
    pub userns: userns::StepUserns,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            memory_bytes: kiln_recipes::plan::DEFAULT_MEMORY_MIB << 20,
            pids_max: DEFAULT_PIDS_MAX,
            write_limit_bytes: DEFAULT_WRITE_LIMIT_BYTES,
            cache_disk_bytes: DEFAULT_CACHE_DISK_BYTES,
            cache_disks_total_bytes: DEFAULT_CACHE_DISKS_TOTAL_BYTES,
            allow_network_host: false,
            allow_insecure: false,
            hostname: DEFAULT_HOSTNAME.to_string(),
            cgroup_parent: rootless::cgroup_parent(),
            run_dir: std::env::temp_dir().join("kiln-exec"),
            log_limits: LogLimits::default(),
            slirp4netns: PathBuf::from("slirp4netns"),
            addresses: Default::default(),
            userns: userns::StepUserns::default(),
        }
    }
}

/// Everything one `RUN` step needs. Its `Debug` form redacts [`StepSpec::secrets`] wherever
/// they appear (the environment, heredoc files) and shows only how many there are.
#[derive(Clone, PartialEq, Eq)]
pub struct StepSpec {
    /// The step's index, carried by every [`LogLine`].
    pub index: usize,
    /// Lower directories, topmost first (overlayfs `lowerdir` order); empty for `scratch`.
    /// At most [`StepExecutor::max_lowers`] of them: the builder squashes the lowest of a
    /// step's layers into one directory past that ([`crate::build::lower::squash_plan`]).
    pub lower_dirs: Vec<PathBuf>,
    /// The build's layer limits, for what the executor reads back as layers (a microVM
    /// step's changes).
    pub layer_limits: crate::layer::Limits,
    /// Fresh, empty upper directory: receives what the step writes.
    pub upper_dir: PathBuf,
    /// Empty overlayfs work directory on the same filesystem as `upper_dir`.
    pub work_dir: PathBuf,
    /// argv (shell form already wrapped in the shell by the plan).
    pub argv: Vec<String>,
    /// Environment, `KEY=value`; later entries win. `PATH` defaults to
    /// [`kiln_recipes::plan::DEFAULT_PATH`] and `HOME` to the user's home.
    pub env: Vec<String>,
    /// `USER` (`None`: root).
    pub user: Option<String>,
    /// Working directory (absolute); missing directories are created, owned by the user.
    pub workdir: String,
    /// Heredoc files written before the command (under `/dev/pipes/` they stay out of the
    /// layer).
    pub files: Vec<InlineFile>,
    /// Network mode.
    pub network: Network,
    /// `RUN --security`: [`Security::Insecure`] runs the command with every capability,
    /// without the seccomp filter and without masked or read-only kernel paths (BuildKit's
    /// `security.insecure`); the executor refuses it unless
    /// [`ExecConfig::allow_insecure`].
    pub security: Security,
    /// `RUN --mount`s, resolved ([`mounts::resolve`]); mounted after the overlay, never part
    /// of the upper directory.
    pub mounts: Vec<StepMount>,
    /// Values redacted from the logs.
    pub secrets: Vec<String>,
    /// Time this step may run (what is left of the build's timeout).
    pub timeout: Duration,
    /// Log bytes this step may still emit (what is left of the build's 1 MiB log;
    /// `None`: [`LogLimits::total_max`] of the executor's config).
    pub log_budget: Option<usize>,
}

impl std::fmt::Debug for StepSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hide = |s: &str| -> String {
            let mut out = s.to_string();
            for secret in self.secrets.iter().filter(|x| !x.is_empty()) {
                out = out.replace(secret.as_str(), logs::REDACTED);
            }
            out
        };
        let env: Vec<String> = self.env.iter().map(|e| hide(e)).collect();
        let argv: Vec<String> = self.argv.iter().map(|a| hide(a)).collect();
        let files: Vec<(String, Option<String>, String)> = self
            .files
            .iter()
            .map(|fl| (fl.name.clone(), fl.path.clone(), hide(&fl.data)))
            .collect();
        f.debug_struct("StepSpec")
            .field("index", &self.index)
            .field("lower_dirs", &self.lower_dirs)
            .field("layer_limits", &self.layer_limits)
            .field("upper_dir", &self.upper_dir)
            .field("work_dir", &self.work_dir)
            .field("argv", &argv)
            .field("env", &env)
            .field("user", &self.user)
            .field("workdir", &self.workdir)
            .field("files", &files)
            .field("network", &self.network)
            .field("security", &self.security)
            .field("mounts", &self.mounts)
            .field(
                "secrets",
                &format_args!("<{} redacted>", self.secrets.len()),
            )
            .field("timeout", &self.timeout)
            .field("log_budget", &self.log_budget)
            .finish()
    }
}

impl StepSpec {
    /// A spec for plan step `step` (a `RUN`), numbered `index`, over `lower_dirs` (topmost
    /// first), writing to `upper_dir` with `work_dir`. Errors: not a `RUN`, or a `RUN --mount`
    /// (use [`StepSpec::from_plan_with_mounts`], which is given what mounts need).
    pub fn from_plan(
        index: usize,
        step: &Step,
        lower_dirs: Vec<PathBuf>,
        upper_dir: PathBuf,
        work_dir: PathBuf,
        timeout: Duration,
    ) -> Result<StepSpec, ExecError> {
        let Action::Run(run) = &step.action else {
            return Err(ExecError::Unsupported("only RUN steps are executed".into()));
        };
        if !run.mounts.is_empty() {
            return Err(ExecError::Unsupported(
                "RUN --mount needs StepSpec::from_plan_with_mounts".into(),
            ));
        }
        Ok(StepSpec {
            index,
            lower_dirs,
            layer_limits: crate::layer::Limits::default(),
            upper_dir,
            work_dir,
            argv: run.argv.clone(),
            // The proxy build args after the step's env ([`RunStep::proxy_env`]).
            env: [&step.context.env[..], &run.proxy_env[..]].concat(),
            user: step.context.user.clone(),
            workdir: step.context.workdir.clone(),
            files: run.files.clone(),
            network: run.network.clone(),
            security: run.security,
            mounts: Vec::new(),
            secrets: Vec::new(),
            timeout,
            log_budget: None,
        })
    }

    /// As [`StepSpec::from_plan`], with the step's `RUN --mount`s resolved from `inputs`
    /// ([`mounts::resolve`]): secrets exposed as environment variables are appended to the
    /// environment, and every secret value the step sees is redacted from its logs.
    pub fn from_plan_with_mounts(
        index: usize,
        step: &Step,
        lower_dirs: Vec<PathBuf>,
        upper_dir: PathBuf,
        work_dir: PathBuf,
        timeout: Duration,
        inputs: &MountInputs,
    ) -> Result<StepSpec, ExecError> {
        let Action::Run(run) = &step.action else {
            return Err(ExecError::Unsupported("only RUN steps are executed".into()));
        };
        let resolved = mounts::resolve(&run.mounts, inputs)?;
        let mut bare = step.clone();
        if let Action::Run(r) = &mut bare.action {
            r.mounts.clear();
        }
        let mut spec = StepSpec::from_plan(index, &bare, lower_dirs, upper_dir, work_dir, timeout)?;
        spec.mounts = resolved.mounts;
        spec.env.extend(resolved.env);
        // BuildKit's exec op: `SSH_AUTH_SOCK` names the step's first ssh mount (given or
        // not) unless the step's env sets it.
        let first_ssh = run.mounts.iter().find_map(|m| match m {
            kiln_recipes::plan::Mount::Ssh { target, .. } => Some(target),
            _ => None,
        });
        if let Some(target) = first_ssh
            && !spec.env.iter().any(|e| e.starts_with("SSH_AUTH_SOCK="))
        {
            spec.env.push(format!("SSH_AUTH_SOCK={target}"));
        }
        spec.secrets.extend(resolved.redact);
        Ok(spec)
    }
}

/// A step that ran to completion with exit code 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepReport {
    /// Bytes allocated in the upper directory after the step (`st_blocks` × 512).
    pub written_bytes: u64,
    /// Log bytes emitted (texts plus one newline each), to charge to the build's budget.
    pub log_bytes: usize,
    /// Whether the log hit its total limit.
    pub log_truncated: bool,
    /// The last lines of the log (at most [`logs::TAIL_LINES`]).
    pub tail: Vec<String>,
}

impl StepReport {
    /// The report of a step whose command exited 0, as every executor makes it: the bytes
    /// allocated in `upper_dir` ([`tree_size`]) checked against `write_limit_bytes`
    /// ([`ExecError::WriteLimit`] past it), and the log counts of `shaper` with its `tail`.
    pub fn of_success(
        upper_dir: &std::path::Path,
        write_limit_bytes: u64,
        shaper: &logs::LogShaper,
        tail: Vec<String>,
    ) -> Result<Self, ExecError> {
        let written = tree_size(upper_dir);
        if written > write_limit_bytes {
            return Err(ExecError::WriteLimit {
                limit_bytes: write_limit_bytes,
                written_bytes: written,
            });
        }
        Ok(StepReport {
            written_bytes: written,
            log_bytes: shaper.emitted_bytes(),
            log_truncated: shaper.truncated(),
            tail,
        })
    }
}

/// A step that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// Something the executor does not do (yet).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// `--network=host` without the entitlement.
    #[error("RUN --network=host needs the network.host entitlement (--allow network.host)")]
    NetworkHostRefused,
    /// What a build without root cannot have ([`rootless`]): what, and what it needs.
    #[error("{0}: needs host root; a build without root runs in a user namespace. Run it as root")]
    NeedsHostRoot(&'static str),
    /// `--security=insecure` without the entitlement.
    #[error(
        "RUN --security=insecure needs the security.insecure entitlement (--allow security.insecure)"
    )]
    InsecureRefused,
    /// The step's argv is empty.
    #[error("step has an empty command")]
    EmptyCommand,
    /// A path the executor cannot hand to overlayfs.
    #[error("path {0:?} cannot be used in overlayfs options (contains ':' or ',', or too long)")]
    BadPath(PathBuf),
    /// Setting up the isolated root failed (message from inside the step's namespaces).
    #[error("step setup failed: {0}")]
    Setup(String),
    /// The step seccomp filter (Docker's default profile, `exec/seccomp.rs`) could not be
    /// compiled.
    #[error("{0}")]
    Seccomp(String),
    /// The steps' user namespace could not be set up ([`userns`]).
    #[error("user namespace for build steps: {0}")]
    Userns(String),
    /// A host-side operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The step's cgroup could not be made.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// A `RUN --mount` could not be resolved.
    #[error(transparent)]
    Mounts(#[from] MountsError),
    /// slirp4netns did not come up.
    #[error("network: slirp4netns: {0}")]
    Slirp(String),
    /// The command exited non-zero.
    #[error("command exited with code {exit_code}")]
    Failed {
        /// Exit code.
        exit_code: i32,
        /// Last log lines.
        tail: Vec<String>,
    },
    /// The command was killed by a signal (not a limit of ours).
    #[error("command killed by signal {signal}")]
    Signaled {
        /// Signal number.
        signal: i32,
        /// Last log lines.
        tail: Vec<String>,
    },
    /// The memory limit was hit and the kernel killed the step.
    #[error(
        "out of memory: memory limit of {} MiB ({limit_bytes} bytes) exceeded; the step was killed",
        .limit_bytes >> 20
    )]
    MemoryLimit {
        /// The limit, bytes.
        limit_bytes: u64,
        /// Last log lines.
        tail: Vec<String>,
    },
    /// The pids limit refused a fork: the command failed (the namespace executor), or the
    /// step was stopped at once (the microVM executor's guest init, `exit_code` `None`).
    #[error("pids limit of {limit} tasks reached ({})", match .exit_code {
        Some(c) => format!("command exited with code {c}"),
        None => "the step was stopped".to_string(),
    })]
    PidsLimit {
        /// The limit, tasks.
        limit: u64,
        /// Exit code, when the command exited on its own.
        exit_code: Option<i32>,
        /// Last log lines.
        tail: Vec<String>,
    },
    /// The step wrote more than allowed.
    #[error("write limit of {limit_bytes} bytes exceeded ({written_bytes} bytes written)")]
    WriteLimit {
        /// The limit, bytes.
        limit_bytes: u64,
        /// Bytes allocated in the upper directory when checked (`st_blocks` × 512).
        written_bytes: u64,
    },
    /// A microVM step failed with its upper disk full: the disk is the step's write limit,
    /// so the guest's writes ran out of space there (`ENOSPC`) rather than being stopped.
    #[error(
        "disk full: the step's disk of {} MiB ({limit_bytes} bytes, its write limit) is full (command exited with code {exit_code})",
        .limit_bytes >> 20
    )]
    DiskFull {
        /// The disk's size, bytes.
        limit_bytes: u64,
        /// Exit code.
        exit_code: i32,
        /// Last log lines.
        tail: Vec<String>,
    },
    /// A microVM step's VM stopped while the step ran: the guest kernel panicked, or the
    /// guest powered off or rebooted (what a step running as root in its VM can do), so the
    /// guest channel closed. `detail` is the guest kernel's own line when it has one.
    #[error("the step's microVM stopped while the step ran: {detail}")]
    VmStopped {
        /// How, in words, with no path of the host.
        detail: String,
    },
    /// The timeout passed; the step was killed.
    #[error("timeout of {}s exceeded; {stopped}", .after.as_secs())]
    Timeout {
        /// The step's timeout.
        after: Duration,
        /// What was killed, in words ([`STOPPED_PROCESSES`], [`STOPPED_VM`]).
        stopped: &'static str,
    },
    /// The caller cancelled the step; it was killed.
    #[error("cancelled")]
    Cancelled,
    /// A microVM step's guest sent something the host refuses: a frame out of sequence or
    /// over its bounds, or changes that are not a layer the layer reader takes (an entry
    /// climbing out of the root, a bad type, a bound).
    #[error("the step's microVM sent something refused: {0}")]
    Guest(String),
}

/// Something that runs one `RUN` step in isolation.
pub trait StepExecutor: Send + Sync {
    /// Runs `spec`, sending each log line to `sink` as it comes. Returns when the step and
    /// every process it started are gone. Setting `cancel` kills the step
    /// ([`ExecError::Cancelled`]).
    fn run(
        &self,
        spec: &StepSpec,
        cancel: &AtomicBool,
        sink: &mut (dyn FnMut(LogLine) + Send),
    ) -> Result<StepReport, ExecError>;

    /// Most lower directories this executor can give `spec` (whose other fields, its mounts
    /// among them, are final): the builder squashes the lowest of a step's layers into one
    /// directory past that ([`crate::build::lower::squash_plan`]). 0: none at all, so a step
    /// with layers is refused by [`StepExecutor::run`]. Default: what one overlay mount on
    /// the host takes, [`OVERLAY_MAX_LOWERS`].
    fn max_lowers(&self, spec: &StepSpec) -> usize {
        let _ = spec;
        OVERLAY_MAX_LOWERS
    }
}

/// Most lower directories of one overlay mount: overlayfs' `OVL_MAX_STACK` (500 in Linux
/// 6.x, in `fs/overlayfs/`; one more is EINVAL, "too many lower directories"). kiln
/// mounts its overlays with the new mount API, one `lowerdir+` per directory (Linux 6.8+),
/// so no option string bounds them first.
pub const OVERLAY_MAX_LOWERS: usize = 500;

/// A scripted result for [`RecordingExecutor`].
pub type Scripted = Box<dyn Fn(&StepSpec) -> Result<StepReport, ExecError> + Send + Sync>;

/// A recording fake: runs nothing, records every spec, emits the argv as one log line, and
/// answers with the script (default: success).
#[derive(Default)]
pub struct RecordingExecutor {
    /// Specs received, in order.
    pub recorded: Arc<Mutex<Vec<StepSpec>>>,
    script: Option<Scripted>,
}

impl RecordingExecutor {
    /// A fake whose every step succeeds.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fake answering with `script`.
    pub fn with_script(script: Scripted) -> Self {
        RecordingExecutor {
            recorded: Arc::default(),
            script: Some(script),
        }
    }

    /// The specs received so far.
    pub fn specs(&self) -> Vec<StepSpec> {
        // A poisoned lock only means a test panicked while holding it.
        self.recorded.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl StepExecutor for RecordingExecutor {
    fn run(
        &self,
        spec: &StepSpec,
        _cancel: &AtomicBool,
        sink: &mut (dyn FnMut(LogLine) + Send),
    ) -> Result<StepReport, ExecError> {
        if let Ok(mut v) = self.recorded.lock() {
            v.push(spec.clone());
        }
        sink(LogLine {
            step: spec.index,
            text: spec.argv.join(" "),
        });
        match &self.script {
            Some(f) => f(spec),
            None => Ok(StepReport::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_recipes::plan::{CommandForm, RunStep, Security, SourceLocation, StepContext};

    fn run_step(mounts: bool) -> Step {
        Step {
            location: SourceLocation {
                file: "Dockerfile".into(),
                start_line: 3,
                end_line: 3,
            },
            action: Action::Run(RunStep {
                form: CommandForm::Shell,
                argv: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
                files: vec![],
                mounts: if mounts {
                    vec![kiln_recipes::plan::Mount::Tmpfs {
                        target: "/t".into(),
                        size: None,
                    }]
                } else {
                    vec![]
                },
                network: Network::None,
                security: Security::Sandbox,
                proxy_env: vec![],
            }),
            context: StepContext {
                env: vec!["A=1".into()],
                user: Some("1000".into()),
                workdir: "/w".into(),
                shell: vec!["/bin/sh".into(), "-c".into()],
            },
        }
    }

    #[test]
    fn proxy_build_args_come_after_the_step_env() {
        let mut step = run_step(false);
        if let Action::Run(r) = &mut step.action {
            r.proxy_env = vec![
                "HTTP_PROXY=http://p:1".into(),
                "http_proxy=http://p:1".into(),
            ];
        }
        let s = StepSpec::from_plan(2, &step, vec![], "/u".into(), "/w".into(), Duration::ZERO)
            .unwrap();
        assert_eq!(
            s.env,
            ["A=1", "HTTP_PROXY=http://p:1", "http_proxy=http://p:1"]
        );
    }

    #[test]
    fn spec_from_plan() {
        let s = StepSpec::from_plan(
            2,
            &run_step(false),
            vec!["/l".into()],
            "/u".into(),
            "/w".into(),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(s.argv[2], "echo hi");
        assert_eq!(s.user.as_deref(), Some("1000"));
        assert_eq!(s.workdir, "/w");
        assert_eq!(s.network, Network::None);
        assert!(matches!(
            StepSpec::from_plan(
                2,
                &run_step(true),
                vec![],
                "/u".into(),
                "/w".into(),
                Duration::ZERO
            ),
            Err(ExecError::Unsupported(_))
        ));
        let s = StepSpec::from_plan_with_mounts(
            2,
            &run_step(true),
            vec![],
            "/u".into(),
            "/w".into(),
            Duration::ZERO,
            &MountInputs::default(),
        )
        .unwrap();
        assert_eq!(s.mounts.len(), 1);
        assert_eq!(s.mounts[0].target, "/t");
        let mut s = s;
        s.env.push("TOKEN=hunter2".into());
        s.secrets.push("hunter2".into());
        let shown = format!("{s:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("TOKEN=****"),
            "{shown}"
        );
    }

    #[test]
    fn recording_executor_records_and_scripts() {
        let fake = RecordingExecutor::with_script(Box::new(|s: &StepSpec| {
            if s.index == 1 {
                Err(ExecError::Failed {
                    exit_code: 3,
                    tail: vec![],
                })
            } else {
                Ok(StepReport::default())
            }
        }));
        let step = run_step(false);
        let cancel = AtomicBool::new(false);
        let mut lines = Vec::new();
        for i in 0..2 {
            let spec = StepSpec::from_plan(
                i,
                &step,
                vec![],
                "/u".into(),
                "/w".into(),
                Duration::from_secs(1),
            )
            .unwrap();
            let r = fake.run(&spec, &cancel, &mut |l| lines.push(l));
            assert_eq!(r.is_ok(), i == 0);
        }
        assert_eq!(fake.specs().len(), 2);
        assert_eq!(lines[1].step, 1);
    }

    #[test]
    fn docker_default_caps_mask() {
        assert_eq!(DEFAULT_CAPABILITIES, 0xa80425fb);
    }
}
