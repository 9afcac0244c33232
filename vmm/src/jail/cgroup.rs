//! Each QEMU's cgroup (issue 37): memory, pids and CPU limits, on cgroup v1 or v2.
//!
//! The CPU limit ([`QemuLimits::cpu_quota_us`] over [`QemuLimits::cpu_period_us`], and a
//! weight, [`QemuLimits::cpu_weight`]): v1 `cpu.cfs_quota_us`, `cpu.cfs_period_us` and
//! `cpu.shares`, v2 `cpu.max` and `cpu.weight`. It was first added without the weight and
//! taken out again, because two of three CI runs then had `kiln serve` step VMs whose guest
//! rejected the signature of its first module (`virtio_ring.ko: Key was rejected by
//! service`). The quota was not the cause, only a way of making QEMU's main loop late: the
//! firmware of then (SeaBIOS) left virtio-blk rings where the initrd is copied, and a late
//! main loop cleared bits of the initrd there; kiln boots qboot since, and no firmware sets a
//! device up (`crate::launch`'s module doc, "Firmware"; test
//! `guest_boot::the_firmware_hands_every_virtio_device_to_the_kernel_in_reset`).
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
/// The CFS bandwidth period of a QEMU's CPU limit, µs: the kernel's default (100 ms). The
/// quota is a ceiling, not a share, so a finer period would only throttle in finer slices
/// at more accounting cost; a longer one would let a group run at the whole host for longer
/// before it is held back.
pub const CPU_PERIOD_US: u64 = 100_000;
/// A QEMU group's CPU weight per vCPU, in cgroup v2 `cpu.weight` units: 100, a group's
/// default (v1 `cpu.shares` 1024).
pub const CPU_WEIGHT_PER_VCPU: u64 = 100;

/// The limits of one QEMU's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QemuLimits {
    /// Memory, bytes: the guest's RAM plus the headroom.
    pub memory_bytes: u64,
    /// Tasks (threads; QEMU cannot fork under `-sandbox`).
    pub pids_max: u64,
    /// CPU time QEMU's threads may use together in each [`QemuLimits::cpu_period_us`], µs:
    /// one CPU per vCPU and one more, `(vcpus + 1) · period`. Under TCG each vCPU is a
    /// thread that runs flat out while its guest is busy, and QEMU's main loop (device
    /// emulation: the disks, the guest channel) and its I/O workers need a CPU beside them;
    /// so a guest keeps all it was given, and a QEMU its guest took over cannot spread over
    /// more of the host with threads of its own. On the 2-core test host a 1-vCPU VM's quota
    /// is the whole host: the limit matters on larger hosts, where many VMs run.
    pub cpu_quota_us: u64,
    /// The CFS bandwidth period, µs ([`CPU_PERIOD_US`]).
    pub cpu_period_us: u64,
    /// The group's weight when the CPUs are contended, in v2 `cpu.weight` units (v1
    /// `cpu.shares` is `weight · 1024 / 100`): [`CPU_WEIGHT_PER_VCPU`] per vCPU, at most
    /// 10000 (v2's maximum). The kernel shares contended CPUs between sibling groups (here,
    /// the QEMUs under one parent) in proportion to their weights, so VMs get CPU time in
    /// proportion to their vCPUs rather than one group's default each.
    pub cpu_weight: u64,
}

impl QemuLimits {
    /// The limits of the QEMU that runs `spec`, with `headroom_mib` of memory beyond its RAM.
    pub fn for_spec(spec: &VmSpec, headroom_mib: u64) -> Self {
        let vcpus = u64::from(spec.vcpus);
        QemuLimits {
            memory_bytes: spec.memory_bytes + (headroom_mib << 20),
            pids_max: vcpus + PIDS_BEYOND_VCPUS,
            cpu_quota_us: (vcpus + 1) * CPU_PERIOD_US,
            cpu_period_us: CPU_PERIOD_US,
            cpu_weight: (vcpus * CPU_WEIGHT_PER_VCPU).clamp(1, 10_000),
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
