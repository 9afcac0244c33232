//! The maker of QEMUs' cgroups (issue 37), where the builder's cgroups and the VMM meet: each
//! QEMU kiln starts as root gets a group of the builder's kind
//! ([`kiln_builder::exec::cgroup::StepCgroup`]) under [`QEMU_CGROUP_PARENT`], with the memory,
//! pids and CPU limits [`kiln_vmm::jail::cgroup::QemuLimits`] gives it. The pipeline's own
//! paths that start VMs (the microVM executor, the boot-once snapshot, the nightly's smoke
//! clones) install it ([`install`], once per process), and so does the `kiln` binary at start
//! (for `kiln start`, `kiln exec` and the rest that call the VMM directly); any other program
//! that starts VMs as root through the VMM alone must too.

use std::sync::Arc;

use kiln_builder::exec::cgroup::{CgroupLimits, CpuLimit, StepCgroup, remove_empty_dead};
use kiln_vmm::jail::cgroup::{QemuCgroup, QemuCgroups, QemuLimits};

/// The cgroup, under each hierarchy's root, that holds QEMUs' groups (apart from build
/// steps' `kiln`, whose groups of dead builds are killed: a clone's QEMU outlives the
/// `kiln start` that made its group).
pub const QEMU_CGROUP_PARENT: &str = "kiln-qemu";

struct Maker;

#[derive(Debug)]
struct Group {
    cg: StepCgroup,
    limits: QemuLimits,
}

impl QemuCgroups for Maker {
    fn create(&self, limits: QemuLimits) -> Result<Box<dyn QemuCgroup>, String> {
        // The groups that kept clones' QEMUs, once those are gone.
        remove_empty_dead(QEMU_CGROUP_PARENT);
        let cg = StepCgroup::create_with_cpu(
            QEMU_CGROUP_PARENT,
            CgroupLimits {
                memory_bytes: limits.memory_bytes,
                pids_max: limits.pids_max,
            },
            CpuLimit {
                quota_us: limits.cpu_quota_us,
                period_us: limits.cpu_period_us,
                weight: limits.cpu_weight,
            },
        )
        .map_err(|e| e.to_string())?;
        Ok(Box::new(Group { cg, limits }))
    }
}

impl QemuCgroup for Group {
    fn procs_files(&self) -> Vec<std::path::PathBuf> {
        self.cg.procs_files()
    }

    fn oom_killed(&self) -> bool {
        self.cg.events().oom_kills > 0
    }

    fn limits(&self) -> QemuLimits {
        self.limits
    }

    fn keep(self: Box<Self>) {
        self.cg.keep();
    }
}

/// Installs the maker for this process ([`kiln_vmm::jail::cgroup::install`]).
pub fn install() {
    kiln_vmm::jail::cgroup::install(Arc::new(Maker));
}
