//! Per-step cgroups for the memory and pids limits (and a CPU limit for QEMU's groups), on
//! cgroup v1 or v2, detected at run time (kernel `Documentation/admin-guide/cgroup-v1/memory.rst`, `cgroup-v2.rst`).
//!
//! - v2 (`/sys/fs/cgroup/cgroup.controllers` exists): one group
//!   `/sys/fs/cgroup/<parent>/<name>` with `memory.max`, `memory.swap.max = 0`, `pids.max`;
//!   `memory` and `pids` are enabled in the ancestors' `cgroup.subtree_control`. A memory kill
//!   shows as `oom_kill` in `memory.events`, a refused fork as `max` in `pids.events`.
//! - v1 or hybrid (the test hosts: `memory` and `pids` controllers under
//!   `/sys/fs/cgroup/<controller>`): one group per controller, `memory.limit_in_bytes` (and
//!   `memory.memsw.limit_in_bytes` when swap accounting is on), `pids.max`; a memory kill shows
//!   as `oom_kill` in `memory.oom_control` (Linux 4.13+), `memory.failcnt` otherwise.
//!
//! - a CPU limit, for the groups made with one ([`StepCgroup::create_with_cpu`]: QEMU's;
//!   build steps' groups have none): v2 `cpu.max` (`<quota> <period>`) and `cpu.weight`,
//!   `cpu` enabled in the ancestors; v1 `cpu.cfs_period_us`, `cpu.cfs_quota_us` and
//!   `cpu.shares` in a group of the `cpu` controller (kernel
//!   `Documentation/scheduler/sched-bwc.rst`).
//!
//! [`StepCgroup::kill_all`] kills every process of the group until it is empty;
//! dropping a [`StepCgroup`] kills what is left and removes the directories, unless it was
//! [`StepCgroup::keep`]t for a process that outlives its maker (a clone's QEMU); such groups
//! are removed once empty and their maker gone ([`remove_empty_dead`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Where cgroups are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The child group that the processes of a delegated v2 cgroup move into
/// ([`delegated_v2_parent`]), so that the cgroup itself holds none and may enable
/// controllers for its children (cgroup-v2.rst, "No Internal Process Constraint"). The name
/// rootlesskit's `--evacuate-cgroup2` and Docker's rootless entrypoint use.
pub const DELEGATED_LEAF: &str = "init";

/// The group under a delegated v2 cgroup that holds a rootless kiln's step groups, beside
/// [`DELEGATED_LEAF`].
pub const DELEGATED_STEPS: &str = "kiln";

/// A cgroup failure.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Neither a v2 hierarchy with controllers nor v1 memory and pids controllers.
    #[error("no usable cgroup hierarchy under {CGROUP_ROOT} (need v2, or v1 memory and pids)")]
    NoHierarchy,
    /// A cgroup file could not be written or read.
    #[error("cgroup {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// Which cgroup layout the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupLayout {
    /// Pure v2 at [`CGROUP_ROOT`].
    Unified,
    /// v1 controllers under [`CGROUP_ROOT`]`/<controller>` (legacy or hybrid).
    Legacy,
}

/// Detects the layout of this host.
pub fn detect() -> Result<CgroupLayout, CgroupError> {
    let root = Path::new(CGROUP_ROOT);
    if root.join("cgroup.controllers").exists() {
        Ok(CgroupLayout::Unified)
    } else if root.join("memory/memory.limit_in_bytes").exists() && root.join("pids").is_dir() {
        Ok(CgroupLayout::Legacy)
    } else {
        Err(CgroupError::NoHierarchy)
    }
}

/// The v2 cgroup (relative to [`CGROUP_ROOT`], no leading `/`) that a `/proc/<pid>/cgroup`
/// text names in its `0::` line, or `None` for the root (or no v2 line). A name ending in
/// [`DELEGATED_LEAF`] names its parent: the cgroup an earlier kiln moved this one's
/// processes out of.
fn own_v2_cgroup(proc_cgroup: &str) -> Option<String> {
    let path = proc_cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut parts: Vec<&str> = path.trim().split('/').filter(|p| !p.is_empty()).collect();
    if parts.last() == Some(&DELEGATED_LEAF) {
        parts.pop();
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Whether this process may write `path` (access(2), as the real ids of its user namespace:
/// the owner of a delegated cgroup is its user, and root of a user namespace may not write
/// the host root's cgroup files).
fn writable(path: &Path) -> bool {
    rustix::fs::access(path, rustix::fs::Access::WRITE_OK).is_ok()
}

/// On a pure v2 host, the parent for this process's step groups inside the cgroup it runs
/// in, when that cgroup is delegated to it (its directory, `cgroup.procs` and
/// `cgroup.subtree_control` are writable: what systemd's `Delegate=yes` gives, e.g.
/// `systemd-run --user --scope -p Delegate=yes kiln build ...`, or what root gives with
/// `chown`). Returns `Ok(None)` off v2.
///
/// With a delegated cgroup `D` it moves every process of `D` (this kiln, its rootless parent,
/// a shell) into `D/`[`DELEGATED_LEAF`], enables `memory` and `pids` in
/// `D/cgroup.subtree_control`, and returns `D/`[`DELEGATED_STEPS`]. Step groups made there
/// are siblings of the leaf, so a step's keeper may move itself into one: v2 lets a process
/// move between two groups only where it may write their common ancestor's `cgroup.procs`
/// (cgroup-v2.rst, "Delegation Containment"), which a parent at the hierarchy's root, as v1
/// delegation uses, is not. Concurrent kilns in one `D` do the same steps and agree.
///
/// Errors (text for a warning): this process in the root cgroup, or in one not delegated to
/// it; `D` delegated but without the `memory` or `pids` controller in its
/// `cgroup.controllers` (its parent does not give them; named); the move or the enable
/// failing.
pub fn delegated_v2_parent() -> Result<Option<String>, String> {
    if detect().ok() != Some(CgroupLayout::Unified) {
        return Ok(None);
    }
    let text = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let Some(own) = own_v2_cgroup(&text) else {
        return Err(format!(
            "kiln runs in the root cgroup {CGROUP_ROOT}, which is host root's"
        ));
    };
    let dir = Path::new(CGROUP_ROOT).join(&own);
    let control = dir.join("cgroup.subtree_control");
    let procs = dir.join("cgroup.procs");
    if !(writable(&dir) && writable(&procs) && writable(&control)) {
        return Err(format!(
            "kiln's cgroup {} is not delegated to this user (it may not write its \
             cgroup.procs and cgroup.subtree_control; e.g. run kiln under systemd-run --user \
             --scope -p Delegate=yes)",
            dir.display()
        ));
    }
    let available = fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
    let missing: Vec<&str> = ["memory", "pids"]
        .into_iter()
        .filter(|c| !available.split_whitespace().any(|a| a == *c))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "cgroup {} is delegated to this user without the {} controller{} (its \
             cgroup.controllers: {:?}; the parent must enable {} in its cgroup.subtree_control, \
             e.g. systemd's Delegate=memory pids)",
            dir.display(),
            missing.join(" and "),
            if missing.len() > 1 { "s" } else { "" },
            available.trim(),
            missing.join(" and "),
        ));
    }
    let leaf = dir.join(DELEGATED_LEAF);
    match fs::create_dir(&leaf) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            return Err(format!("cgroup {}: {e}", leaf.display()));
        }
        _ => {}
    }
    // A process forked between the move and the enable lands in `dir` again, and the enable
    // fails with EBUSY: move again.
    let mut last = String::new();
    for _ in 0..20 {
        for pid in fs::read_to_string(&procs).unwrap_or_default().lines() {
            match fs::write(leaf.join("cgroup.procs"), pid.trim()) {
                Err(e) if e.raw_os_error() != Some(libc::ESRCH) => {
                    return Err(format!(
                        "moving process {} into cgroup {}: {e}",
                        pid.trim(),
                        leaf.display()
                    ));
                }
                _ => {}
            }
        }
        match fs::write(&control, "+memory +pids") {
            Ok(()) => return Ok(Some(format!("{own}/{DELEGATED_STEPS}"))),
            Err(e) => last = format!("cgroup {}: {e}", control.display()),
        }
    }
    Err(last)
}

/// Warns, once per process, that steps run without their memory and pids limits, and
/// `why`.
pub(crate) fn warn_unlimited(why: &dyn std::fmt::Display) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "steps run without their memory and pids limits: {why} (a build without root \
             needs a cgroup delegated to its user: README, \"Builds without root\")"
        )
    });
}

/// Limits applied to one step's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Memory limit, bytes.
    pub memory_bytes: u64,
    /// Maximum number of tasks (processes and threads).
    pub pids_max: u64,
}

/// A group's CPU limit ([`StepCgroup::create_with_cpu`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuLimit {
    /// CPU time the group's tasks may use together in each period, µs (v1
    /// `cpu.cfs_quota_us`, the first field of v2 `cpu.max`); twice the period is two CPUs'
    /// worth. At least 1000 (the kernel's minimum).
    pub quota_us: u64,
    /// The CFS bandwidth period, µs (v1 `cpu.cfs_period_us`, the second field of v2
    /// `cpu.max`; 1000 to 1 000 000).
    pub period_us: u64,
    /// The group's weight against its siblings when the CPUs are contended, in v2
    /// `cpu.weight` units (1 to 10000; a group's default is 100); v1 `cpu.shares` is
    /// `weight · 1024 / 100` (its default is 1024).
    pub weight: u64,
}

/// What a step's cgroup saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupEvents {
    /// Processes killed by the OOM killer at the memory limit.
    pub oom_kills: u64,
    /// Times the memory limit was reached (v1 `failcnt`; v2 `max` events).
    pub memory_hits: u64,
    /// Forks refused at the pids limit.
    pub pids_hits: u64,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err(path))
}

fn keyed(path: &Path, key: &str) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
        })
        .unwrap_or(0)
}

/// One step's cgroup (one directory per v1 controller, or one v2 directory).
#[derive(Debug)]
pub struct StepCgroup {
    layout: CgroupLayout,
    /// `memory`, `pids` and, with a CPU limit, `cpu` directories (v1), or the one v2
    /// directory.
    dirs: Vec<PathBuf>,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

impl StepCgroup {
    /// Creates a fresh group under `parent` (a relative path such as `kiln`) with `limits`.
    ///
    /// In a user namespace (a rootless kiln, [`super::rootless`]), a parent this process may
    /// not write (the host's cgroups belong to host root unless a parent is delegated to the
    /// user: README, "Builds without root"; on v2 [`delegated_v2_parent`]) gives a group
    /// that enforces nothing ([`StepCgroup::enforced`] is false), with one warning per
    /// process naming the directory, as rootless Podman runs without limits on cgroup v1.
    pub fn create(parent: &str, limits: CgroupLimits) -> Result<StepCgroup, CgroupError> {
        match Self::make(parent, limits, None) {
            Err(CgroupError::Io { path, source })
                if super::rootless::in_user_namespace()
                    && matches!(
                        source.raw_os_error(),
                        Some(libc::EACCES | libc::EPERM | libc::EROFS)
                    ) =>
            {
                warn_unlimited(&format_args!("cgroup {}: {source}", path.display()));
                Ok(StepCgroup {
                    layout: detect().unwrap_or(CgroupLayout::Legacy),
                    dirs: Vec::new(),
                })
            }
            r => r,
        }
    }

    /// Whether the group exists and enforces its limits (see [`StepCgroup::create`]).
    pub fn enforced(&self) -> bool {
        !self.dirs.is_empty()
    }

    /// [`StepCgroup::create`] with a CPU limit as well (QEMU's groups, made by root only).
    /// Fails if the host has no `cpu` controller to give it (v1 `/sys/fs/cgroup/cpu`, or
    /// `cpu` in v2 `cgroup.controllers`).
    pub fn create_with_cpu(
        parent: &str,
        limits: CgroupLimits,
        cpu: CpuLimit,
    ) -> Result<StepCgroup, CgroupError> {
        Self::make(parent, limits, Some(cpu))
    }

    fn make(
        parent: &str,
        limits: CgroupLimits,
        cpu: Option<CpuLimit>,
    ) -> Result<StepCgroup, CgroupError> {
        let layout = detect()?;
        let name = format!(
            "step-{}-{}",
            crate::workdir::owner_token(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let root = Path::new(CGROUP_ROOT);
        let mut cg = StepCgroup {
            layout,
            dirs: Vec::new(),
        };
        match layout {
            CgroupLayout::Unified => {
                // `cpu` apart: a write naming a controller that cannot be enabled changes
                // nothing, and groups without a CPU limit need only the other two.
                let enable: &[&str] = if cpu.is_some() {
                    &["+memory +pids", "+cpu"]
                } else {
                    &["+memory +pids"]
                };
                let mut dir = root.to_path_buf();
                for part in Path::new(parent).components() {
                    for e in enable {
                        let _ = fs::write(dir.join("cgroup.subtree_control"), e);
                    }
                    dir.push(part);
                    if !dir.is_dir() {
                        fs::create_dir(&dir).map_err(io_err(&dir))?;
                    }
                }
                for e in enable {
                    write(&dir.join("cgroup.subtree_control"), e)?;
                }
                dir.push(&name);
                fs::create_dir(&dir).map_err(io_err(&dir))?;
                cg.dirs.push(dir.clone());
                write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    write(&swap, "0")?;
                }
                write(&dir.join("pids.max"), &limits.pids_max.to_string())?;
                if let Some(c) = cpu {
                    write(
                        &dir.join("cpu.max"),
                        &format!("{} {}", c.quota_us.max(1000), c.period_us),
                    )?;
                    write(
                        &dir.join("cpu.weight"),
                        &c.weight.clamp(1, 10_000).to_string(),
                    )?;
                }
            }
            CgroupLayout::Legacy => {
                let controllers: &[&str] = if cpu.is_some() {
                    &["memory", "pids", "cpu"]
                } else {
                    &["memory", "pids"]
                };
                for ctrl in controllers {
                    let dir = root.join(ctrl).join(parent).join(&name);
                    fs::create_dir_all(&dir).map_err(io_err(&dir))?;
                    cg.dirs.push(dir);
                }
                let mem = &cg.dirs[0];
                write(
                    &mem.join("memory.limit_in_bytes"),
                    &limits.memory_bytes.to_string(),
                )?;
                let memsw = mem.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    write(&memsw, &limits.memory_bytes.to_string())?;
                }
                write(&mem.join("memory.swappiness"), "0").ok();
                write(&cg.dirs[1].join("pids.max"), &limits.pids_max.to_string())?;
                if let Some(c) = cpu {
                    let d = &cg.dirs[2];
                    // The period first: the quota is checked against it.
                    write(&d.join("cpu.cfs_period_us"), &c.period_us.to_string())?;
                    write(
                        &d.join("cpu.cfs_quota_us"),
                        &c.quota_us.max(1000).to_string(),
                    )?;
                    write(&d.join("cpu.shares"), &v1_shares(c.weight).to_string())?;
                }
            }
        }
        Ok(cg)
    }

    /// Leaves the group in place when this handle goes: for a process that outlives its
    /// maker (a clone's QEMU). [`remove_empty_dead`] removes it once it is empty.
    pub fn keep(mut self) {
        self.dirs.clear();
    }

    /// The layout in use.
    pub fn layout(&self) -> CgroupLayout {
        self.layout
    }

    /// The `cgroup.procs` files a process must join (write its pid, or `0` for itself).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Pids now in the group.
    pub fn pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        for d in &self.dirs {
            if let Ok(s) = fs::read_to_string(d.join("cgroup.procs")) {
                out.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Kills every process in the group (SIGKILL; `cgroup.kill` on v2 when present) and
    /// waits, bounded, until the group is empty. Returns whether it is empty.
    pub fn kill_all(&self) -> bool {
        if self.layout == CgroupLayout::Unified
            && let Some(d) = self.dirs.first()
        {
            let _ = fs::write(d.join("cgroup.kill"), "1");
        }
        for _ in 0..2000 {
            let pids = self.pids();
            if pids.is_empty() {
                return true;
            }
            for pid in pids {
                if pid > 0 {
                    // SAFETY: kill(2) with a positive pid read from our own cgroup and a
                    // constant signal has no memory-safety preconditions.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        self.pids().is_empty()
    }

    /// Limit events so far.
    pub fn events(&self) -> CgroupEvents {
        let Some(d) = self.dirs.first() else {
            return CgroupEvents::default();
        };
        match self.layout {
            CgroupLayout::Unified => CgroupEvents {
                oom_kills: keyed(&d.join("memory.events"), "oom_kill"),
                memory_hits: keyed(&d.join("memory.events"), "max"),
                pids_hits: keyed(&d.join("pids.events"), "max"),
            },
            CgroupLayout::Legacy => CgroupEvents {
                oom_kills: keyed(&d.join("memory.oom_control"), "oom_kill"),
                memory_hits: fs::read_to_string(d.join("memory.failcnt"))
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(0),
                pids_hits: keyed(&self.dirs[1].join("pids.events"), "max"),
            },
        }
    }
}

/// v1 `cpu.shares` for a v2 `cpu.weight` of `weight`: the default weight, 100, is the
/// default share, 1024; at least 2, the kernel's minimum.
fn v1_shares(weight: u64) -> u64 {
    (weight.saturating_mul(1024) / 100).max(2)
}

/// The directories under which groups of `parent` live: the v2 parent, or one per v1
/// controller kiln uses (`memory`, `pids`, and `cpu` for the groups with a CPU limit).
fn parent_dirs(layout: CgroupLayout, parent: &str) -> Vec<PathBuf> {
    let root = Path::new(CGROUP_ROOT);
    match layout {
        CgroupLayout::Unified => vec![root.join(parent)],
        CgroupLayout::Legacy => ["memory", "pids", "cpu"]
            .iter()
            .map(|c| root.join(c).join(parent))
            .collect(),
    }
}

/// Removes every group under `parent` (named `step-<owner>-<n>`) that is empty and whose
/// maker no longer runs ([`crate::workdir::owned_by_dead_process`]), killing nothing: the
/// groups [`StepCgroup::keep`] left for processes that outlived their maker, once those are
/// gone. `rmdir(2)` of a cgroup that still has a process fails (`EBUSY`), and is skipped.
/// Returns the directories removed.
pub fn remove_empty_dead(parent: &str) -> Vec<PathBuf> {
    let Ok(layout) = detect() else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for p in parent_dirs(layout, parent) {
        let Ok(rd) = fs::read_dir(&p) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type().is_ok_and(|t| t.is_dir())
                && name.starts_with("step-")
                && crate::workdir::owned_by_dead_process(&name, "step-")
                && fs::remove_dir(e.path()).is_ok()
            {
                removed.push(e.path());
            }
        }
    }
    removed
}

/// Kills the processes of, and removes, every step cgroup under `parent` (as
/// [`StepCgroup::create`] names them, `step-<owner>-<n>`) whose owning build no longer runs
/// ([`crate::workdir::owned_by_dead_process`]); a live build's are not touched. Returns the
/// directories removed. Without a usable hierarchy there is nothing to reap.
pub fn reap_dead(parent: &str) -> Vec<PathBuf> {
    let Ok(layout) = detect() else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for p in parent_dirs(layout, parent) {
        let Ok(rd) = fs::read_dir(&p) else { continue };
        for e in rd.flatten() {
            let name = e.file_name();
            if !e.file_type().is_ok_and(|t| t.is_dir())
                || !name.to_string_lossy().starts_with("step-")
                || !crate::workdir::owned_by_dead_process(&name.to_string_lossy(), "step-")
            {
                continue;
            }
            // Dropping kills what is left in it and removes the directory.
            let dir = e.path();
            drop(StepCgroup {
                layout,
                dirs: vec![dir.clone()],
            });
            if !dir.exists() {
                removed.push(dir);
            }
        }
    }
    removed
}

impl Drop for StepCgroup {
    fn drop(&mut self) {
        self.kill_all();
        for d in &self.dirs {
            // An emptied cgroup can take a moment to become removable.
            for _ in 0..200 {
                if fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("memory.events");
        fs::write(&p, "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n").unwrap();
        assert_eq!(keyed(&p, "oom_kill"), 1);
        assert_eq!(keyed(&p, "max"), 12);
        assert_eq!(keyed(&p, "absent"), 0);
        assert_eq!(keyed(&dir.path().join("missing"), "max"), 0);
    }

    #[test]
    fn the_own_v2_cgroup_is_read_from_the_unified_line() {
        let scope = "user.slice/user-1000.slice/user@1000.service/app.slice/run-r1.scope";
        // A hybrid host lists v1 hierarchies first; only `0::` is the v2 one.
        let hybrid = format!("12:pids:/user.slice\n4:memory:/user.slice\n0::/{scope}\n");
        assert_eq!(own_v2_cgroup(&hybrid).as_deref(), Some(scope));
        // Moved into the leaf by an earlier kiln: the delegated cgroup is its parent.
        let moved = format!("0::/{scope}/{DELEGATED_LEAF}\n");
        assert_eq!(own_v2_cgroup(&moved).as_deref(), Some(scope));
        assert_eq!(own_v2_cgroup("0::/\n"), None, "the root is host root's");
        assert_eq!(
            own_v2_cgroup("0::/init\n"),
            None,
            "a leaf of the root names the root"
        );
        assert_eq!(own_v2_cgroup("4:memory:/a\n"), None, "no v2 line");
        assert_eq!(own_v2_cgroup(""), None);
    }

    #[test]
    fn v1_shares_follow_v2_weights() {
        assert_eq!(v1_shares(100), 1024, "the defaults match");
        assert_eq!(v1_shares(200), 2048);
        assert_eq!(v1_shares(1), 10);
        assert_eq!(v1_shares(0), 2, "the kernel's minimum");
    }
}
