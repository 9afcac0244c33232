//! Each QEMU's cgroup (issue 37): memory and pids limits, on cgroup v1 or v2.
//!
//! No CPU limit: with a CFS quota of one CPU per vCPU plus one (v1 `cpu.cfs_quota_us`), two of
//! three CI runs on the 2-core test host had `kiln serve` step VMs whose guest rejected the
//! signature of the first module it loaded (its bytes not what was signed), while they
//! competed with the suite's largest test; before the quota (and the rest of the jail) CI had
//! never shown it. The cause was not found (CFS bandwidth control throttles a group on one CPU while quota is left on
//! another, pausing the vCPU thread; a TCG fault under such pauses is the suspicion). A CPU
//! limit needs that understood first.
//!
//! The cgroup code is the builder's (its step cgroups, `kiln_builder::exec::cgroup`), and this
//! crate may not import the builder (DESIGN.md's layout: builder and vmm meet only in the
//! pipeline). So this crate says what a QEMU's group must be ([`QemuLimits`]) and how it uses
//! one ([`QemuCgroup`]); the pipeline installs the maker once per process ([`install`],
//! `kiln_pipeline::qemu_cgroups::install`). When kiln runs as root (QEMU jailed), a QEMU is
//! never started without a group: with no maker installed, the start fails.
//!
//! The child joins its group before anything else ([`super::spawn`]: it writes `0` to each
//! `cgroup.procs`, opened by the parent), so every page and thread of QEMU's life is counted.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::launch::{LaunchError, VmSpec};

/// Memory a QEMU may use beyond its guest's RAM, MiB, by default (`KILN_QEMU_HEADROOM_MIB`):
/// QEMU's own code and heap, TCG's translation cache, the page tables and the page cache of
/// its disks. Measured on the 2-core test host under TCG, sampling every QEMU group's v1
/// `memory.max_usage_in_bytes` every 0.5 s through the suite's VM tests (guests of at most
/// 256 MiB): the largest peaked at 419 MiB, most at 200–235 MiB; 512 MiB leaves TCG's
/// translation cache room to grow on longer builds.
pub const DEFAULT_HEADROOM_MIB: u64 = 512;
/// Tasks a QEMU may have beyond one per vCPU: its main loop, RCU, I/O and the block layer's
/// worker pool (QEMU's `thread-pool` has at most 64 workers by default).
pub const PIDS_BEYOND_VCPUS: u64 = 128;

/// The limits of one QEMU's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QemuLimits {
    /// Memory, bytes: the guest's RAM plus the headroom.
    pub memory_bytes: u64,
    /// Tasks (threads; QEMU cannot fork under `-sandbox`).
    pub pids_max: u64,
}

impl QemuLimits {
    /// The limits of the QEMU that runs `spec`, with `headroom_mib` of memory beyond its RAM.
    pub fn for_spec(spec: &VmSpec, headroom_mib: u64) -> Self {
        QemuLimits {
            memory_bytes: spec.memory_bytes + (headroom_mib << 20),
            pids_max: u64::from(spec.vcpus) + PIDS_BEYOND_VCPUS,
        }
    }

    /// [`QemuLimits::for_spec`] with `KILN_QEMU_HEADROOM_MIB` (a number of MiB; unset:
    /// [`DEFAULT_HEADROOM_MIB`]).
    pub fn from_env(spec: &VmSpec) -> Result<Self, LaunchError> {
        let headroom = match std::env::var("KILN_QEMU_HEADROOM_MIB") {
            Ok(v) => v.trim().parse::<u64>().map_err(|e| {
                LaunchError::Host(format!(
                    "KILN_QEMU_HEADROOM_MIB={v:?}: expected a number of MiB: {e}"
                ))
            })?,
            Err(_) => DEFAULT_HEADROOM_MIB,
        };
        Ok(Self::for_spec(spec, headroom))
    }
}

/// One QEMU's group, made by the installed [`QemuCgroups`]. Dropping it kills what is left in
/// it and removes it, unless [`QemuCgroup::keep`] was called.
pub trait QemuCgroup: Send + Sync + std::fmt::Debug {
    /// The `cgroup.procs` files QEMU joins (one per v1 controller, or the v2 one).
    fn procs_files(&self) -> Vec<PathBuf>;
    /// Whether the kernel's OOM killer killed a process of the group at its memory limit.
    fn oom_killed(&self) -> bool;
    /// The limits it was made with.
    fn limits(&self) -> QemuLimits;
    /// Leaves the group in place for a QEMU that outlives its handle (a clone).
    fn keep(self: Box<Self>);
}

/// Makes QEMUs' groups.
pub trait QemuCgroups: Send + Sync {
    /// A new group with `limits`.
    fn create(&self, limits: QemuLimits) -> Result<Box<dyn QemuCgroup>, String>;
}

static MAKER: OnceLock<Arc<dyn QemuCgroups>> = OnceLock::new();

/// Installs the maker of QEMUs' groups for this process (the first one installed stays).
pub fn install(maker: Arc<dyn QemuCgroups>) {
    let _ = MAKER.set(maker);
}

/// A group for the QEMU that runs `spec` ([`QemuLimits::from_env`]).
///
/// Errors: no maker installed ([`install`]), or the maker failing.
pub(crate) fn create(spec: &VmSpec) -> Result<Box<dyn QemuCgroup>, LaunchError> {
    let maker = MAKER.get().ok_or_else(|| {
        LaunchError::Host(
            "no cgroup maker for QEMU is installed (kiln_vmm::jail::cgroup::install; \
             kiln_pipeline::qemu_cgroups::install does it)"
                .into(),
        )
    })?;
    let limits = QemuLimits::from_env(spec)?;
    maker
        .create(limits)
        .map_err(|e| LaunchError::Host(format!("QEMU's cgroup: {e}")))
}
