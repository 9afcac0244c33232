//! The microVM step executor (issue 14 §1): each `RUN` step in a microVM of its own, on kiln's
//! guest kernel and init, where [`kiln_builder::exec::LinuxExecutor`] uses host namespaces.
//! It lives here because it needs both the builder's step interface and the VMM (the layout
//! table of DESIGN.md: builder never imports vmm).
//!
//! Per step (restored from the per-host builder snapshot when the step fits it, else a cold
//! boot; see "Restore" below):
//! 1. **Disks.** The upper disk is a sparse raw file of the step's write limit (`mke2fs -t
//!    ext4`, no journal: the VM never outlives the step), so the guest can write no more
//!    than that. Each lower directory becomes a read-only disk (serial `lower<i>`, topmost
//!    first, [`kiln_vmm::launch::VmSpec::ro_disks`]): an ext4 image made once per layer
//!    directory with `mke2fs -d` ([`lower_image`]), which copies overlayfs' whiteouts (0/0
//!    character devices) and opaque xattrs as they are. The VM takes at most [`MAX_LOWERS`]
//!    lower disks ([`MAX_DISKS`] with its bind mounts, [`VmExecutor::max_lowers`]); past
//!    that the builder gives the step its lowest layers squashed into one directory
//!    ([`kiln_builder::build::lower::squash_plan`]), the mechanism that keeps the namespace
//!    executor under overlayfs' 500 lowers, and that directory is one more disk. The guest
//!    sees the step's layers and nothing else of the host's file system. Why disks and not
//!    9p: Debian's cloud kernel, kiln's guest kernel, has no 9p (`modules.order` lists none),
//!    and virtio-fs needs `virtiofsd`, which bookworm lacks. There is no network card
//!    (item 5).
//! 2. **Boot.** The one QEMU command line ([`kiln_vmm::launch::VmSpec`]) with anonymous memory
//!    of the step's memory limit plus [`STEP_VM_HEADROOM_BYTES`] for the guest's kernel and
//!    init (at least [`STEP_VM_MIN_BYTES`]), the step's vCPUs, and
//!    `kiln.step=<lowers>`: the guest init mounts the overlay of the lower disks under an upper
//!    directory on the disk and makes it `/`.
//! 3. **Run.** One `exec` over the guest channel with the step's argv, environment, user and
//!    working directory (created when missing, owned by the user), and its memory and pids
//!    limits, which the guest init puts on the command's cgroup (`memory.max`, `pids.max`);
//!    stdout and stderr go through the builder's [`LogShaper`] (4 KiB lines, the build's
//!    1 MiB log). The host enforces the timeout and cancellation by killing QEMU. How the
//!    step failed is worded from the guest's `exit` ([`step_failure`]): out of memory, the
//!    pids limit, a full disk, a signal, an exit code.
//! 4. **Changes.** After a zero exit, `diff`: the guest kills every process and streams its
//!    upper directory as a tar in OCI layer form. The host writes at most
//!    [`diff_bound`] bytes of it to a file beside the disk, then unpacks it into
//!    [`StepSpec::upper_dir`] with [`kiln_builder::build::lower::unpack_overlay_form`], the
//!    layer reader that stays inside its root, so the build's layer capture runs on it
//!    unchanged. A hostile guest's frames (out of sequence, over the bound) and tar entries
//!    (climbing out, bad types, over the layer bounds) are refused ([`ExecError::Guest`]).
//!
//! 5. **Network.** A step VM has no network card. A step whose network is `default` or an
//!    allow-list reaches the host's egress proxy ([`kiln_builder::egress`]) through a second
//!    virtio-serial port ([`kiln_vmm::launch::VmSpec::egress_socket`], `kiln.egress` on the
//!    kernel command line): the guest init listens on `127.0.0.1:3128` and carries each
//!    connection as one stream of [`kiln_vmm::egress`]'s multiplexed, flow-controlled
//!    protocol (`kiln_guest::egress`) to a proxy made for the step, as the namespace
//!    executor's: an allow-list is [`kiln_builder::egress::proxy::Proxy::new`] with the
//!    step's rules (deny wins), `default` is
//!    [`kiln_builder::egress::proxy::Proxy::addresses_only`], any name whose addresses the
//!    address policy permits (public ones). Names are resolved on the host, after the rule
//!    check. The step gets [`kiln_builder::egress::proxy_env`] at exec time (not in its cache
//!    key), an empty `/etc/resolv.conf` bound over its image's for the command only (as a
//!    namespace allow-list step; not in its layer), and its first log line says what it can reach ([`PROXY_ONLY_LINE`]): HTTP, and
//!    HTTPS by `CONNECT`; `git://`, ssh and UDP do not work, unlike a namespace step with the
//!    default network (slirp4netns). Each refusal is one `egress: refused …` line of the
//!    step's log, through the same [`LogShaper`]. A `none` step's VM has no egress port (a
//!    restored one has it, as every builder VM does, but the host never serves it) and
//!    nothing listens on the proxy port; `host` is refused. Why a serial port and not a
//!    network card: no packet of the step reaches the host's network stack, only the byte
//!    streams the proxy checks, exactly as in a namespace step's allow-list; and the port is
//!    part of the VM from its start (the microvm machine has no hotplug), only in step VMs,
//!    never in a snapshot VM, whose device layout (the snapshot compatibility key) is
//!    unchanged.
//!
//! Heredoc files (`RUN <<EOF`) go in the exec request; the guest writes them under
//! `/dev/pipes/` (its devtmpfs, outside the layer), where the namespace executor puts them.
//!
//! `RUN --mount=type=tmpfs`, `type=secret` and `type=bind` are prepared on the host as for
//! namespace steps ([`kiln_builder::exec::mounts::prepare`]: targets resolved through the
//! lowers) and mounted by the guest around the command: a secret on a private tmpfs under
//! `/dev`, bound read-only; a bind's tree (the context, a stage or an image, opened inside its
//! root) as one more read-only ext4 disk made for the step, mounted read-only or, with `rw`,
//! under an overlay whose tmpfs upper is discarded. A bind of one (regular) file is the same
//! disk made from a tree of that file alone (a copy,
//! [`kiln_builder::exec::mounts::copy_bind_file`], named [`kiln_vmm::exec::DISK_FILE_NAME`]):
//! the guest mounts it, read-only or under the discarded overlay, on a private directory
//! under `/dev` and binds the file onto a file mount point, as the namespace executor binds
//! the file (or, with `rw`, a discarded copy of it). Its disk is sized as a tree's
//! ([`lower_image`]), from the blocks the file takes: the copy keeps its holes, so a sparse
//! file's apparent size is never written on the host. `RUN --mount=type=cache` is a
//! read-write ext4 disk per cache (and workspace) on this host, kept between steps and builds
//! and never mounted on the host ([`crate::vm_cache`]: where it lives, its size, the bound
//! on a workspace's disks together and their eviction, `sharing=`,
//! and the `e2fsck -p` of a disk whose VM was killed, or its replacement by an empty one when
//! that fails): attached with the serial `cache<i>`
//! ([`kiln_vmm::launch::VmSpec::rw_disks`]) and mounted by the guest directly on the target,
//! `nosuid,nodev`, flushed and unmounted before the guest reports the command's exit. Caches
//! are per host, not shared across nodes. Their mount points are removed from the layer with
//! the same cleanup.
//!
//! **Restore** (issue 32). Instead of step 2's cold boot (about 2.7 s to the guest's answer
//! under TCG here), a step that fits the builder snapshot's shape ([`builder_shape`]:
//! [`BUILDER_STEP_MEMORY_BYTES`] of step memory limit, this executor's vCPUs,
//! [`BUILDER_RO_SLOTS`] read-only and [`BUILDER_RW_SLOTS`] cache disks) gets a QEMU restored
//! from it with its disks bound to the slots ([`kiln_vmm::builder`]: made once per host and
//! key, under a lock, by the first step that needs it; the guest reseeds its entropy as a
//! clone's does, then mounts the step's root as at a cold boot). The step's memory limit is
//! still the command's `memory.max` in the guest. A step that does not fit (a larger memory
//! limit, more disks, other vCPUs), or any step when the snapshot cannot be made or
//! restored or `KILN_VM_STEP_SNAPSHOT=0`, boots cold, and says why in the log (`tracing`, info);
//! [`VmExecutor::step_counts`] counts both. Each step's phases (disks, restore or boot, exec,
//! diff) are logged at info as `microVM step done` (what `ci/bench-vmexec.sh` reports).
//! Measured 2026-12-05 on this 2-core TCG host, release build of this branch,
//! `KILN=target/release/kiln KILN_BENCH_RUNS=3 ci/bench-vmexec.sh` (three `RUN echo` steps):
//! 0.78 s per step above the namespace executor (runs 0.76–0.94 s; phases, medians: disks
//! 15 ms, restore 435 ms, exec 268 ms, diff 117 ms), against 3.39 s (3.34–3.97 s; boot
//! 3,316 ms) with a cold boot per step.
//! A realistic tenant recipe (`ci/tenant-recipe/`: apt install of three packages, pip, npm,
//! a `COPY`; eight steps, four `RUN`) from local servers, `KILN=target/release/kiln
//! KILN_BENCH_RUNS=3 ci/bench-tenant.sh`, 2026-12-05 on a busier host (load average 11):
//! 63.9 s in microVMs (57.3–68.0 s) against 4.4 s (4.2–6.7 s) in namespaces; the fixed cost
//! measured beside it, 1.52 s per step (1.18–1.60 s), is 6.1 s of that, and the rest, 57.5 s
//! (51.3–63.3 s), is the steps' own work emulated by TCG (restore about 0.7 s, exec 10.6 s
//! apt, 13.0 s pip, 26.9 s npm, 7.7 s the app's check, medians).
//!
//! Not yet: the host network
//! (refused, as [`VmExecutor::run`] says); the empty `/etc/resolv.conf` of a step with the
//! proxy when its image's `/etc/resolv.conf` (or `/etc`) is a symlink (it then sees its
//! image's file, which names no server it can reach). A build's extra CA certificates need nothing here: the builder
//! adds their bundle to the step's heredoc files and its variables to its environment
//! ([`kiln_builder::egress::ca`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kiln_builder::exec::logs::LogShaper;
use kiln_builder::exec::{
    ExecConfig, ExecError, GuestMount, LogLine, PreparedMounts, StepExecutor, StepReport, StepSpec,
    cleanup_mount_points,
};
use kiln_recipes::plan::Network;
use kiln_vmm::builder::{BuilderShape, BuilderSnapshot, StepDisks};
use kiln_vmm::channel::GuestChannel;
use kiln_vmm::exec::{ExecEvent, ExecMount, ExecMountKind, ExecRequest, ExecSession, ExecStatus};
use kiln_vmm::launch::{self, Accel, DiskFormat, Host, MemoryMode, Vm, VmSpec};
use kiln_vmm::snapshot::BootAssets;

/// Most lower directories one step VM takes (the guest init's bound, `kiln.step=`; each is
/// a virtio-mmio device of the microvm machine).
pub const MAX_LOWERS: usize = 16;
/// Most extra disks of one step VM, lower layers, bind mounts and cache mounts together: the
/// microvm machine's 24 virtio-mmio transports less the upper disk and the guest channel.
pub const MAX_DISKS: usize = 22;
/// Memory a step VM has beyond the step's memory limit, bytes (128 MiB): the guest kernel,
/// its init and the page cache of the lower disks' metadata, outside the command's cgroup,
/// whose `memory.max` is the step's limit. A cgroup limit below what the guest has free
/// makes the guest's OOM killer act at the limit: a step filling the whole VM instead
/// livelocked under TCG (the kernel evicting and rereading the command's own pages,
/// `kiln/tests/vm_exec.rs`). Measured (Debian's 6.1 cloud kernel, busybox step): a 192 MiB
/// VM shows `MemTotal` 158,204 kB and `MemAvailable` 120,436 kB, so 64 MiB of headroom left
/// a 64 MiB step less than its limit and its memory hog ran into the build's timeout.
pub const STEP_VM_HEADROOM_BYTES: u64 = 128 << 20;
/// The smallest step VM, bytes (128 MiB).
pub const STEP_VM_MIN_BYTES: u64 = 128 << 20;
/// How long a step VM may take from QEMU's start to the guest's answer.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the host waits for each frame of the step's changes.
pub const DIFF_FRAME_TIMEOUT: Duration = Duration::from_secs(60);
/// The first log line of a step with the default network or an allow-list: what it can
/// reach, which is less than a namespace step with the default network (slirp4netns).
pub const PROXY_ONLY_LINE: &str = "[kiln] this microVM step reaches the network only through \
     kiln's egress proxy (HTTP_PROXY, HTTPS_PROXY): HTTP, and HTTPS by CONNECT; git://, ssh \
     and UDP do not work\n";

/// The largest step memory limit the builder snapshot takes, bytes (1 GiB, a build's
/// default limit, DESIGN.md): its RAM is [`step_vm_bytes`] of it; a step with a larger limit
/// boots cold.
pub const BUILDER_STEP_MEMORY_BYTES: u64 = 1 << 30;
/// Read-only disk slots of the builder snapshot (lower layers and bind trees): [`MAX_LOWERS`]
/// and two bind trees. With [`BUILDER_RW_SLOTS`], 20 disks: measured here (QEMU 10.0 TCG,
/// Debian's 6.1 cloud kernel), a builder VM with 22 disks of 1 TiB (all 24 virtio-mmio
/// transports in use) never got past the disks' probe within 30 s, one with 20 booted in
/// 3.8 s to its snapshot.
pub const BUILDER_RO_SLOTS: usize = MAX_LOWERS + 2;
/// Cache disk slots of the builder snapshot.
pub const BUILDER_RW_SLOTS: usize = 2;

/// The builder snapshot's shape for step VMs of `vcpus`.
pub fn builder_shape(vcpus: u32) -> BuilderShape {
    BuilderShape {
        vcpus,
        memory_bytes: step_vm_bytes(BUILDER_STEP_MEMORY_BYTES),
        ro_disks: BUILDER_RO_SLOTS,
        rw_disks: BUILDER_RW_SLOTS,
    }
}

static STEP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Bytes of tar the host accepts for a step whose upper disk has `disk_bytes`: twice the
/// disk (headers, long names and PAX records of many small files) plus 16 MiB.
pub fn diff_bound(disk_bytes: u64) -> u64 {
    disk_bytes.saturating_mul(2).saturating_add(16 << 20)
}

/// Runs each step in a microVM; see the module doc.
#[derive(Debug, Clone)]
pub struct VmExecutor {
    host: Host,
    boot: BootAssets,
    accel: Accel,
    vcpus: u32,
    /// Memory (the VM's size), write limit (the upper disk's size), scratch and log limits.
    pub config: ExecConfig,
    /// Whether steps may be restored from the builder snapshot (module doc, "Restore").
    restore: bool,
    /// The builder snapshot, made or found by the first step that fits it; `None` inside
    /// when it could not be (every step then boots cold).
    builder: std::sync::Arc<tokio::sync::OnceCell<Option<BuilderSnapshot>>>,
    /// Steps restored and steps booted cold.
    counts: std::sync::Arc<[AtomicU64; 2]>,
}

impl VmExecutor {
    /// An executor booting `boot`'s kernel and initramfs with `vcpus` vCPUs under `config`'s
    /// limits; finds QEMU and picks the accelerator ([`launch::probe_accel`], `KILN_ACCEL`)
    /// once, in `config.run_dir`.
    ///
    /// Errors: QEMU missing or unusable ([`ExecError::Setup`]).
    pub async fn new(boot: BootAssets, config: ExecConfig, vcpus: u32) -> Result<Self, ExecError> {
        let setup = |e: launch::LaunchError| ExecError::Setup(format!("microVM executor: {e}"));
        crate::qemu_cgroups::install();
        let host = Host::detect().await.map_err(setup)?;
        std::fs::create_dir_all(&config.run_dir).map_err(|source| ExecError::Io {
            what: format!("creating {}", config.run_dir.display()),
            source,
        })?;
        let probe = tempfile::Builder::new()
            .prefix("vm-probe-")
            .tempdir_in(&config.run_dir)
            .map_err(|source| ExecError::Io {
                what: "making the accelerator probe's directory".into(),
                source,
            })?;
        let accel = launch::probe_accel(&host, &boot.kernel, &boot.initramfs, probe.path())
            .await
            .map_err(setup)?;
        Ok(Self {
            host,
            boot,
            accel,
            vcpus: vcpus.max(1),
            config,
            restore: std::env::var("KILN_VM_STEP_SNAPSHOT").as_deref() != Ok("0"),
            builder: Default::default(),
            counts: Default::default(),
        })
    }

    /// This executor with restores from the builder snapshot on or off (on unless
    /// `KILN_VM_STEP_SNAPSHOT=0`); off, every step boots cold.
    pub fn with_restore(mut self, on: bool) -> Self {
        self.restore = on;
        self
    }

    /// Steps run so far: (restored from the builder snapshot, booted cold).
    pub fn step_counts(&self) -> (u64, u64) {
        (
            self.counts[0].load(Ordering::Relaxed),
            self.counts[1].load(Ordering::Relaxed),
        )
    }

    /// The builder snapshot (made on first use, in [`kiln_vmm::clone::default_cache_dir`]);
    /// `None` when restores are off or it cannot be made (logged once).
    async fn builder_snapshot(&self) -> Option<&BuilderSnapshot> {
        if !self.restore {
            return None;
        }
        self.builder
            .get_or_init(|| async {
                match kiln_vmm::builder::ensure(
                    &self.host,
                    self.accel,
                    &self.boot,
                    builder_shape(self.vcpus),
                    &kiln_vmm::clone::default_cache_dir(),
                    BOOT_TIMEOUT,
                )
                .await
                {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "no builder snapshot: microVM steps boot cold");
                        None
                    }
                }
            })
            .await
            .as_ref()
    }

    /// The accelerator the step VMs use.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// The egress proxy of one step with `network` (`default`: any name whose addresses
    /// the address policy permits, public ones only unless the test switch is on; an
    /// allow-list: its rules, deny winning, and the address policy), each refusal line sent
    /// to `log` (with its newline).
    fn step_proxy(
        &self,
        network: &Network,
        log: tokio::sync::mpsc::UnboundedSender<String>,
    ) -> std::sync::Arc<kiln_builder::egress::proxy::Proxy> {
        use kiln_builder::egress::proxy::Proxy;
        let log = move |line: &str| {
            let _ = log.send(format!("{line}\n"));
        };
        let addresses = self.config.addresses.clone();
        std::sync::Arc::new(match network {
            Network::Allow(rules) => Proxy::new(rules.clone(), addresses, log),
            _ => Proxy::addresses_only(addresses, log),
        })
    }
}

impl StepExecutor for VmExecutor {
    /// Runs `spec` in a microVM (module doc). Refused with [`ExecError::Unsupported`]: the
    /// host network, more lower directories than [`VmExecutor::max_lowers`] (the builder
    /// squashes them to fit), more than [`MAX_DISKS`]` - 1` bind and cache mounts, one cache
    /// mounted twice in a step. A step with the default network or an allow-list
    /// reaches the network through the egress proxy only (module doc), and its first log
    /// line says so ([`PROXY_ONLY_LINE`]).
    fn run(
        &self,
        spec: &StepSpec,
        cancel: &AtomicBool,
        sink: &mut (dyn FnMut(LogLine) + Send),
    ) -> Result<StepReport, ExecError> {
        if spec.argv.is_empty() {
            return Err(ExecError::EmptyCommand);
        }
        let unsupported = |what: &str| {
            Err(ExecError::Unsupported(format!(
                "{what} in a microVM step (kiln build --isolation vm)"
            )))
        };
        if spec.network == Network::Host {
            return unsupported("RUN --network=host");
        }
        // The step's own VM is its sandbox: a root step there already has every
        // capability and no seccomp filter, so `--security=insecure` changes nothing in
        // the guest; it still needs the entitlement.
        if spec.security == kiln_recipes::plan::Security::Insecure && !self.config.allow_insecure {
            return Err(ExecError::InsecureRefused);
        }
        let mut cache_dirs = std::collections::HashSet::new();
        for m in &spec.mounts {
            if let kiln_builder::exec::MountKind::Cache(c) = &m.kind
                && !cache_dirs.insert(&c.dir)
            {
                return unsupported(&format!(
                    "one cache mounted twice in one step (at {})",
                    m.target
                ));
            }
        }
        if let Some(m) = spec
            .mounts
            .iter()
            .find(|m| matches!(m.kind, kiln_builder::exec::MountKind::Ssh { .. }))
        {
            return unsupported(&format!(
                "RUN --mount=type=ssh (at {}: the SSH agent is not forwarded over the guest channel)",
                m.target
            ));
        }
        let binds = mount_disks(spec);
        if binds > MAX_DISKS {
            return unsupported(&format!(
                "{binds} bind and cache mounts (at most {MAX_DISKS})"
            ));
        }
        let disks = self.max_lowers(spec);
        if spec.lower_dirs.len() > disks {
            return unsupported(&if disks == 0 {
                format!(
                    "{binds} bind and cache mounts (at most {} with any layers)",
                    MAX_DISKS - 1
                )
            } else {
                format!(
                    "{} lower layers (at most {disks} disks)",
                    spec.lower_dirs.len()
                )
            });
        }
        let scratch = Scratch::new(&self.config.run_dir)?;
        // Targets resolved through the lowers as the step sees them, as for namespace steps.
        let mounts = kiln_builder::exec::mounts::prepare_for_guest(
            &spec.mounts,
            &spec.lower_dirs,
            &scratch.0.join("mounts"),
        )?;
        let run = self.run_in(spec, &mounts, cancel, sink, &scratch.0);
        match tokio::runtime::Handle::try_current() {
            Ok(h) => h.block_on(run),
            Err(_) => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|source| ExecError::Io {
                    what: "starting a runtime".into(),
                    source,
                })?
                .block_on(run),
        }
    }

    /// The disks a step VM has for lower directories: [`MAX_LOWERS`], fewer when its bind
    /// and cache mounts take the rest of [`MAX_DISKS`] (0 when they take all of them).
    fn max_lowers(&self, spec: &StepSpec) -> usize {
        MAX_LOWERS.min(MAX_DISKS.saturating_sub(mount_disks(spec)))
    }
}

/// How many disks `spec`'s mounts take: one per bind mount and one per cache mount.
fn mount_disks(spec: &StepSpec) -> usize {
    use kiln_builder::exec::MountKind;
    spec.mounts
        .iter()
        .filter(|m| matches!(m.kind, MountKind::Bind { .. } | MountKind::Cache(_)))
        .count()
}

/// A step's scratch directory (its disk, sockets, console log and changes), removed when
/// dropped. Named `step-<owner token>-vm<n>` like the namespace executor's, so that the next
/// build removes what a killed build left ([`kiln_builder::workdir::remove_dead_entries`]).
struct Scratch(PathBuf);

impl Scratch {
    fn new(run_dir: &Path) -> Result<Self, ExecError> {
        let dir = run_dir.join(format!(
            "step-{}-vm{}",
            kiln_builder::workdir::owner_token(),
            STEP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        // 0700: the step's QEMU runs as a uid of its own and owns its disk and console log
        // here (kiln_vmm::jail); no other uid reaches them by path, a later holder of that
        // uid included (a kill -9 of kiln leaves them until the next build reaps the
        // directory).
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&dir)
            .map_err(|source| ExecError::Io {
                what: format!("creating {}", dir.display()),
                source,
            })?;
        Ok(Self(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The step's environment as the namespace executor gives it: `PATH` defaulted, the proxy
/// variables ([`kiln_builder::egress::proxy_env`]) for a step with the egress proxy, then
/// the spec's entries in order (later ones win in the guest's merge, so a recipe's own `ENV`
/// still wins). Added at exec time: not part of the step's cache key.
fn step_env(spec: &StepSpec) -> Vec<String> {
    let mut env = vec![format!("PATH={}", kiln_recipes::plan::DEFAULT_PATH)];
    if has_egress(&spec.network) {
        env.extend(kiln_builder::egress::proxy_env());
    }
    env.extend(spec.env.iter().filter(|e| e.contains('=')).cloned());
    env
}

/// Whether the empty `/etc/resolv.conf` of a step with the proxy can be bound in: neither
/// `/etc` nor `/etc/resolv.conf`, as the topmost of the `lowers` that has each shows it, is
/// a symlink (the guest refuses a mount point behind one; such a step keeps its image's
/// file, which names no server it can reach: there is no network card).
fn resolv_conf_mountable(lowers: &[PathBuf]) -> bool {
    for rel in ["etc", "etc/resolv.conf"] {
        if let Some(md) = lowers
            .iter()
            .find_map(|l| l.join(rel).symlink_metadata().ok())
            && md.file_type().is_symlink()
        {
            return false;
        }
    }
    true
}

/// Whether a step with `network` gets the egress port and the proxy (`default` and an
/// allow-list).
fn has_egress(network: &Network) -> bool {
    matches!(network, Network::Default | Network::Allow(_))
}

/// Makes the sparse raw disk `path` of `bytes` with an ext4 file system (no journal, 4 KiB
/// blocks, no reserved blocks), with `extra` arguments for mke2fs.
pub(crate) async fn mke2fs(path: &Path, bytes: u64, extra: &[String]) -> Result<(), ExecError> {
    let f = std::fs::File::create(path).map_err(|source| ExecError::Io {
        what: format!("creating {}", path.display()),
        source,
    })?;
    f.set_len(bytes).map_err(|source| ExecError::Io {
        what: format!("sizing {}", path.display()),
        source,
    })?;
    drop(f);
    let out = tokio::process::Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-O", "^has_journal", "-b", "4096"])
        .args(["-m", "0", "-E", "lazy_itable_init=1,nodiscard"])
        .args(extra)
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|source| ExecError::Io {
            what: "running mke2fs (e2fsprogs)".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(ExecError::Setup(format!(
            "mke2fs {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// The read-only ext4 image of the lower directory `lower` in `cache`, made when missing:
/// `<cache>/<sha256 of the directory's path>.ext4`. A layer directory never changes once it
/// has its name (`kiln_builder::build::lower`), so its image does not either. Made under a
/// temporary name and renamed, so a crash leaves no half image under the final name (the
/// temporary one, named after its owner, goes once that owner is dead:
/// [`kiln_builder::workdir::reap_dead_builds`]); `kiln store gc` removes the images with
/// the unpacked layers when no build runs ([`kiln_builder::workdir::collect_layers`]). Size:
/// the tree's allocated bytes × 1.5, plus 1 KiB per entry and 32 MiB, with one inode per
/// entry and 256 spare (`mke2fs -N`); the file is sparse.
///
/// Errors: the walk or mke2fs failed ([`ExecError::Io`], [`ExecError::Setup`]).
pub async fn lower_image(cache: &Path, lower: &Path) -> Result<PathBuf, ExecError> {
    use std::os::unix::ffi::OsStrExt;
    let digest = kiln_builder::cache::digest_of(lower.as_os_str().as_bytes());
    let hex = digest.hex();
    let img = cache.join(format!("{hex}.ext4"));
    if img.is_file() {
        return Ok(img);
    }
    std::fs::create_dir_all(cache).map_err(|source| ExecError::Io {
        what: format!("creating {}", cache.display()),
        source,
    })?;
    let tmp = cache.join(format!(
        "{hex}.tmp-{}-{}",
        kiln_builder::workdir::owner_token(),
        STEP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    rename_into_place(tree_image(&tmp, lower).await, &tmp, &img)?;
    Ok(img)
}

/// Renames `tmp`, a disk image `made` just wrote, over `dest`, so that a reader of `dest`
/// sees a whole image or none; removes `tmp` when making or renaming it failed.
///
/// Errors: `made`'s, or the rename's ([`ExecError::Io`]).
pub(crate) fn rename_into_place(
    made: Result<(), ExecError>,
    tmp: &Path,
    dest: &Path,
) -> Result<(), ExecError> {
    let r = made.and_then(|()| {
        std::fs::rename(tmp, dest).map_err(|source| ExecError::Io {
            what: format!("renaming {}", tmp.display()),
            source,
        })
    });
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
}

/// An ext4 image at `img` of the tree `dir` (`mke2fs -d`), sized as [`lower_image`] says.
///
/// Errors: the walk or mke2fs failed ([`ExecError::Io`], [`ExecError::Setup`]).
async fn tree_image(img: &Path, dir: &Path) -> Result<(), ExecError> {
    let walk = dir.to_path_buf();
    let (bytes, entries) = tokio::task::spawn_blocking(move || tree_counts(&walk))
        .await
        .map_err(|e| ExecError::Setup(e.to_string()))?;
    let size = bytes / 2 * 3 + entries * 1024 + (32 << 20);
    mke2fs(
        img,
        size,
        &[
            "-N".to_string(),
            (entries + 256).to_string(),
            "-d".to_string(),
            dir.display().to_string(),
        ],
    )
    .await
}

/// Allocated bytes (`st_blocks` × 512) and entries under `dir`, not following symlinks.
fn tree_counts(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            entries += 1;
            bytes += md.blocks() * 512;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (bytes, entries)
}

/// Asks the step VM on `session` for its changes (`diff`), writes at most `bound` bytes of
/// the tar stream to `dir/changes.tar`, and unpacks it into the empty `upper` with the
/// builder's layer reader in overlayfs' form
/// ([`kiln_builder::build::lower::unpack_overlay_form`]) under `limits` (the step's
/// [`kiln_builder::exec::StepSpec::layer_limits`], with the build's deadline). Returns the
/// tar's bytes.
///
/// Errors: [`ExecError::Guest`] for what a hostile guest can cause (a frame out of sequence
/// or over the bound, a tar the layer reader refuses); [`ExecError::Setup`] for the channel;
/// [`ExecError::Io`].
pub async fn receive_changes(
    session: &mut ExecSession,
    dir: &Path,
    upper: &Path,
    bound: u64,
    step: usize,
    limits: &kiln_builder::layer::Limits,
) -> Result<u64, ExecError> {
    let tar_path = dir.join("changes.tar");
    let mut tar = std::fs::File::create(&tar_path).map_err(|source| ExecError::Io {
        what: format!("creating {}", tar_path.display()),
        source,
    })?;
    let bytes = match session.diff(&mut tar, bound, DIFF_FRAME_TIMEOUT).await {
        Ok(b) => b,
        Err(kiln_vmm::exec::ExecError::Protocol { reason, .. }) => {
            return Err(ExecError::Guest(reason));
        }
        Err(e) => return Err(ExecError::Setup(e.to_string())),
    };
    drop(tar);
    let upper = upper.to_path_buf();
    let name = format!("step {step} changes");
    let limits = limits.clone();
    tokio::task::spawn_blocking(move || {
        kiln_builder::build::lower::unpack_overlay_form(&upper, &tar_path, &name, &limits)
    })
    .await
    .map_err(|e| ExecError::Setup(e.to_string()))?
    .map_err(|e| ExecError::Guest(e.to_string()))?;
    Ok(bytes)
}

/// The limits a step VM ran under, for [`step_failure`]'s words.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    /// The command's `memory.max`, bytes.
    pub memory_bytes: u64,
    /// The command's `pids.max`, tasks.
    pub pids_max: u64,
    /// The upper disk's size, bytes (the step's write limit, at least 64 MiB).
    pub disk_bytes: u64,
}

/// Why a step whose guest sent `status` failed, in the builder's words ([`ExecError`], the
/// one place that words a step's failure for every executor), or `None` when it exited 0.
/// In order: it did not start; the OOM killer ended a process ([`ExecError::MemoryLimit`]);
/// the pids limit stopped it ([`ExecError::PidsLimit`]); it failed with its disk full
/// ([`ExecError::DiskFull`]); a signal; its exit code.
pub fn step_failure(
    status: &ExecStatus,
    limits: &StepLimits,
    tail: Vec<String>,
) -> Option<ExecError> {
    if let Some(f) = &status.failure {
        return Some(ExecError::Setup(format!(
            "the step did not start: {}",
            f.message
        )));
    }
    let exit_code = status.exit_code();
    if exit_code == 0 {
        return None;
    }
    Some(if status.oom {
        ExecError::MemoryLimit {
            limit_bytes: limits.memory_bytes,
            tail,
        }
    } else if status.pids_limit {
        ExecError::PidsLimit {
            limit: limits.pids_max,
            exit_code: status.code,
            tail,
        }
    } else if status.disk_full {
        ExecError::DiskFull {
            limit_bytes: limits.disk_bytes,
            exit_code,
            tail,
        }
    } else if let Some(signal) = status.signal {
        ExecError::Signaled { signal, tail }
    } else {
        ExecError::Failed { exit_code, tail }
    })
}

/// A step VM's memory, bytes, for a step memory limit of `limit` bytes: the limit plus
/// [`STEP_VM_HEADROOM_BYTES`], in whole MiB, at least [`STEP_VM_MIN_BYTES`].
pub fn step_vm_bytes(limit: u64) -> u64 {
    (limit.saturating_add(STEP_VM_HEADROOM_BYTES) >> 20).max(STEP_VM_MIN_BYTES >> 20) << 20
}

/// How the step's wait ended.
enum Waited {
    Exit(ExecStatus),
    Stopped(ExecError),
    /// The guest channel failed (closed, or an I/O error): the VM most likely stopped.
    Lost(String),
}

impl VmExecutor {
    async fn run_in(
        &self,
        spec: &StepSpec,
        mounts: &PreparedMounts,
        cancel: &AtomicBool,
        sink: &mut (dyn FnMut(LogLine) + Send),
        dir: &Path,
    ) -> Result<StepReport, ExecError> {
        let t0 = Instant::now();
        let deadline = t0 + spec.timeout;
        let disk = dir.join("upper.raw");
        // At least 64 MiB, so that the file system itself fits.
        let disk_bytes = self.config.write_limit_bytes.max(64 << 20);
        mke2fs(&disk, disk_bytes, &[]).await?;
        let cache = self
            .config
            .run_dir
            .join(kiln_builder::workdir::VM_LOWER_IMAGES);
        let mut lowers = Vec::with_capacity(spec.lower_dirs.len());
        for l in &spec.lower_dirs {
            lowers.push(lower_image(&cache, l).await?);
        }
        let step_lowers = lowers.len();
        let egress = has_egress(&spec.network);
        let mut kernel_args = vec![format!("kiln.step={step_lowers}")];
        if egress {
            // The guest init waits for the egress port before it answers (kiln-guest-init).
            kernel_args.push("kiln.egress".into());
        }
        // Each bind mount's tree as one more read-only disk, made for this step only; each
        // cache mount's disk, taken (locked) until the VM is gone (dropped after `vm`).
        let mut guest_mounts = Vec::new();
        let mut caches: Vec<crate::vm_cache::CacheDisk> = Vec::new();
        // Why a wait for a cache ends early: the build cancelled or out of time.
        let stopped = || {
            if cancel.load(Ordering::Relaxed) {
                Some(ExecError::Cancelled)
            } else if Instant::now() >= deadline {
                Some(ExecError::Timeout {
                    after: spec.timeout,
                    stopped: crate::vm_cache::STOPPED_WAITING,
                })
            } else {
                None
            }
        };
        for m in mounts.guest_view() {
            let (rel, kind) = match m {
                GuestMount::Tmpfs { rel, size_bytes } => (rel, ExecMountKind::Tmpfs { size_bytes }),
                GuestMount::Secret {
                    rel,
                    value,
                    mode,
                    uid,
                    gid,
                } => (
                    rel,
                    ExecMountKind::Secret {
                        data: value.to_vec(),
                        mode,
                        uid,
                        gid,
                    },
                ),
                GuestMount::Bind {
                    rel,
                    root,
                    path,
                    readwrite,
                    file,
                } => {
                    let src = kiln_builder::exec::mounts::open_bind_source(root, path)
                        .map_err(|e| ExecError::Setup(format!("--mount source {path:?}: {e}")))?;
                    let img = dir.join(format!("bind{}.ext4", lowers.len()));
                    if file {
                        // One file: a tree of it alone, as the guest's DISK_FILE_NAME.
                        let tree = dir.join(format!("bind{}.d", lowers.len()));
                        std::fs::create_dir(&tree).map_err(|source| ExecError::Io {
                            what: format!("creating {}", tree.display()),
                            source,
                        })?;
                        kiln_builder::exec::mounts::copy_bind_file(
                            &src,
                            &tree.join(kiln_vmm::exec::DISK_FILE_NAME),
                        )
                        .map_err(|e| ExecError::Setup(format!("--mount source {path:?}: {e}")))?;
                        drop(src);
                        tree_image(&img, &tree).await?;
                        let _ = std::fs::remove_dir_all(&tree);
                    } else {
                        let tree = PathBuf::from(format!(
                            "/proc/{}/fd/{}",
                            std::process::id(),
                            std::os::fd::AsRawFd::as_raw_fd(&src)
                        ));
                        tree_image(&img, &tree).await?;
                        drop(src);
                    }
                    let serial = format!("lower{}", lowers.len());
                    lowers.push(img);
                    (
                        rel,
                        ExecMountKind::Disk {
                            serial,
                            readwrite,
                            file,
                        },
                    )
                }
                GuestMount::Cache { rel, cache } => {
                    let serial = format!("cache{}", caches.len());
                    let root = crate::vm_cache::CacheRoot {
                        mode: cache.mode,
                        uid: cache.uid,
                        gid: cache.gid,
                        bytes: self.config.cache_disk_bytes,
                        total_bytes: self.config.cache_disks_total_bytes,
                    };
                    let name = format!("{serial}.ext4");
                    caches.push(
                        crate::vm_cache::CacheDisk::take(
                            &cache.dir,
                            cache.sharing,
                            root,
                            dir,
                            &name,
                            &stopped,
                        )
                        .await?,
                    );
                    (
                        rel,
                        ExecMountKind::Cache {
                            serial,
                            readonly: cache.readonly,
                        },
                    )
                }
            };
            guest_mounts.push(ExecMount {
                rel: rel.to_string(),
                kind,
            });
        }
        // A step with the proxy sees an empty /etc/resolv.conf (names are resolved on the
        // host), as a namespace allow-list step does: an empty file bound over it for the
        // command only, first, so that the step's own mounts go over it. Its mount point,
        // when the image has none, is removed from the layer by `cleanup_mount_points` below.
        if egress && resolv_conf_mountable(&spec.lower_dirs) {
            guest_mounts.insert(
                0,
                ExecMount {
                    rel: "etc/resolv.conf".into(),
                    kind: ExecMountKind::Secret {
                        data: Vec::new(),
                        mode: 0o644,
                        uid: 0,
                        gid: 0,
                    },
                },
            );
        }
        let disks_made = t0.elapsed();
        let step_disks = StepDisks {
            upper: disk.clone(),
            ro: lowers.clone(),
            rw: caches.iter().map(|c| c.image.clone()).collect(),
        };
        let vm_bytes = step_vm_bytes(self.config.memory_bytes);
        let builder = match self.builder_snapshot().await {
            Some(b) => match b.shape.fits(vm_bytes, self.vcpus, &step_disks) {
                Ok(()) => Some(b),
                Err(why) => {
                    tracing::info!(step = spec.index, %why, "this microVM step boots cold");
                    None
                }
            },
            None => None,
        };
        let vm_spec = VmSpec {
            max_disk_bytes: None,
            accel: self.accel,
            vcpus: self.vcpus,
            memory_bytes: vm_bytes,
            kernel: self.boot.kernel.clone(),
            initramfs: self.boot.initramfs.clone(),
            memory_file: dir.join("unused-memory"),
            memory_mode: MemoryMode::Anonymous,
            disk: disk.clone(),
            disk_format: DiskFormat::Raw,
            kernel_args,
            ro_disks: lowers,
            rw_disks: caches.iter().map(|c| c.image.clone()).collect(),
            qmp_socket: dir.join("qmp.sock"),
            guest_socket: dir.join("guest.sock"),
            serial_log: dir.join("console.log"),
            incoming: false,
            tsc_khz: self.host.tsc_khz,
            egress_socket: egress.then(|| dir.join("egress.sock")),
        };
        let console = vm_spec.serial_log.clone();
        let guest = |what: &str, e: &dyn std::fmt::Display| {
            ExecError::Setup(format!(
                "step VM: {what}: {e}\n{}",
                launch::console_report(&console)
            ))
        };
        for c in &caches {
            c.mark_dirty()?;
        }
        let restored = match builder {
            Some(b) => match kiln_vmm::builder::restore(
                &self.host,
                b,
                dir,
                &step_disks,
                &dir.join("qemu.log"),
                BOOT_TIMEOUT,
            )
            .await
            {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(step = spec.index, error = %e, "restoring the builder snapshot failed: this microVM step boots cold");
                    None
                }
            },
            None => None,
        };
        let builder = builder.filter(|_| restored.is_some());
        let (mut vm, vm_spec) = match restored {
            Some(r) => r,
            None => (
                Vm::spawn(
                    &self.host,
                    &vm_spec,
                    &dir.join("qemu.log"),
                    BOOT_TIMEOUT,
                    true,
                )
                .await
                .map_err(|e| guest("starting QEMU", &e))?,
                vm_spec,
            ),
        };
        self.counts[usize::from(builder.is_none())].fetch_add(1, Ordering::Relaxed);
        let mut limits = self.config.log_limits;
        if let Some(budget) = spec.log_budget {
            limits.total_max = limits.total_max.min(budget);
        }
        let mut shaper = LogShaper::new(spec.index, limits, &spec.secrets);
        // The step's first log line, before the guest says anything.
        if egress {
            shaper.push(PROXY_ONLY_LINE.as_bytes(), sink);
        }
        // The egress port, served by a proxy of the step's own; its refusal lines come to
        // the loop below, which puts them in the step's log as the step's output goes.
        let (proxy_log, mut refusals) = tokio::sync::mpsc::unbounded_channel::<String>();
        let egress_sock = vm_spec.egress_socket.as_deref().filter(|_| egress);
        let _egress = match egress_sock.map(|sock| {
            let proxy = self.step_proxy(&spec.network, proxy_log);
            kiln_vmm::egress::serve(sock, BOOT_TIMEOUT, move |stream| {
                let proxy = proxy.clone();
                async move { proxy.serve(stream).await }
            })
        }) {
            None => None,
            Some(f) => match f.await {
                Ok(ch) => Some(ch),
                Err(e) => {
                    vm.kill().await;
                    return Err(guest("connecting to the egress port", &e));
                }
            },
        };
        // A VM that dies while booting says why in QEMU's own log as much as on the console.
        let mut booting = |what: &str, e: &dyn std::fmt::Display| {
            let qemu = match vm.exited() {
                Some(status) => format!("QEMU exited ({status}): {}", vm.log_tail()),
                None => format!("QEMU still running: {}", vm.log_tail()),
            };
            guest(what, &format!("{e}\n{qemu}"))
        };
        let mut ch = match GuestChannel::connect(&vm_spec.guest_socket, BOOT_TIMEOUT).await {
            Ok(ch) => ch,
            Err(e) => return Err(booting("connecting to the guest channel", &e)),
        };
        match builder {
            Some(_) => {
                if let Err(e) = kiln_vmm::builder::start_step(
                    &mut ch,
                    step_lowers,
                    egress,
                    BOOT_TIMEOUT,
                    &vm_spec.serial_log,
                )
                .await
                {
                    return Err(booting("starting the step in the restored VM", &e));
                }
            }
            None => {
                if let Err(e) = ch.recv_significant("the guest's hello", BOOT_TIMEOUT).await {
                    return Err(booting("waiting for the guest's hello", &e));
                }
            }
        }
        let mut session =
            match ExecSession::over(format!("step {}", spec.index), ch, BOOT_TIMEOUT).await {
                Ok(s) => s,
                Err(e) => return Err(booting("connecting to the guest", &e)),
            };
        let booted = t0.elapsed();
        let req = ExecRequest {
            argv: spec.argv.clone(),
            env: step_env(spec),
            user: spec.user.clone(),
            workdir: Some(spec.workdir.clone()),
            stdin: Vec::new(),
            detach: false,
            make_workdir: true,
            files: spec
                .files
                .iter()
                .filter_map(|f| {
                    Some(kiln_vmm::exec::ExecFile {
                        path: f.path.clone()?,
                        data: f.data.clone().into_bytes(),
                        mode: f.mode,
                    })
                })
                .collect(),
            mounts: guest_mounts,
            memory_max: Some(self.config.memory_bytes),
            pids_max: Some(self.config.pids_max),
        };
        let exec_id = session.start(&req).await.map_err(|e| match e {
            kiln_vmm::exec::ExecError::Request(d) => ExecError::Setup(format!("the step: {d}")),
            e => guest("starting the step", &e),
        })?;
        let waited = loop {
            let ev = session.next_event();
            tokio::pin!(ev);
            let r = loop {
                tokio::select! {
                    r = &mut ev => break Some(r),
                    Some(line) = refusals.recv() => shaper.push(line.as_bytes(), sink),
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {
                        if cancel.load(Ordering::Relaxed) {
                            break None;
                        }
                        if Instant::now() >= deadline {
                            break None;
                        }
                    }
                }
            };
            match r {
                None if cancel.load(Ordering::Relaxed) => {
                    break Waited::Stopped(ExecError::Cancelled);
                }
                None => {
                    break Waited::Stopped(ExecError::Timeout {
                        after: spec.timeout,
                        stopped: kiln_builder::exec::STOPPED_VM,
                    });
                }
                Some(Ok(ExecEvent::Output { id, data, .. })) if id == exec_id => {
                    shaper.push(&data, sink)
                }
                Some(Ok(ExecEvent::Exit { id, status })) if id == exec_id => {
                    break Waited::Exit(status);
                }
                Some(Ok(_)) => {}
                Some(Err(kiln_vmm::exec::ExecError::Protocol { reason, .. })) => {
                    break Waited::Stopped(ExecError::Guest(reason));
                }
                Some(Err(e)) => break Waited::Lost(e.to_string()),
            }
        };
        while let Ok(line) = refusals.try_recv() {
            shaper.push(line.as_bytes(), sink);
        }
        shaper.finish(sink);
        let tail = shaper.tail();
        let status = match waited {
            Waited::Stopped(e) => {
                vm.kill().await;
                return Err(e);
            }
            Waited::Lost(e) => {
                // A closed channel: QEMU is on its way out (-no-reboot, panic=-1).
                let exited = vm.wait_exited(Duration::from_secs(5)).await;
                tracing::info!(
                    step = spec.index,
                    error = %e,
                    ?exited,
                    console = %launch::console_report(&vm_spec.serial_log),
                    "step VM stopped while the step ran"
                );
                let detail = match (launch::guest_death(&vm_spec.serial_log), exited) {
                    (Some(line), _) => format!("guest kernel: {line}"),
                    (None, Some(_)) => "it powered off or rebooted".to_string(),
                    (None, None) => format!("its guest channel failed ({e})"),
                };
                vm.kill().await;
                return Err(ExecError::VmStopped { detail });
            }
            // The guest flushed and unmounted the caches before it sent the exit.
            Waited::Exit(s) => {
                caches.iter().for_each(crate::vm_cache::CacheDisk::clean);
                s
            }
        };
        let ran = t0.elapsed() - booted;
        let t_diff = Instant::now();
        let limits = StepLimits {
            memory_bytes: self.config.memory_bytes,
            pids_max: self.config.pids_max,
            disk_bytes,
        };
        if let Some(e) = step_failure(&status, &limits, tail.clone()) {
            vm.kill().await;
            return Err(e);
        }

        // The changes.
        let got = tokio::select! {
            r = receive_changes(&mut session, dir, &spec.upper_dir, diff_bound(disk_bytes), spec.index, &spec.layer_limits) => Some(r),
            _ = async {
                while !cancel.load(Ordering::Relaxed) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            } => None,
        };
        drop(session);
        vm.kill().await;
        let bytes = match got {
            None if cancel.load(Ordering::Relaxed) => return Err(ExecError::Cancelled),
            None => {
                return Err(ExecError::Timeout {
                    after: spec.timeout,
                    stopped: kiln_builder::exec::STOPPED_VM,
                });
            }
            Some(r) => r.map_err(|e| match e {
                ExecError::Setup(m) => guest("receiving the step's changes", &m),
                e => e,
            })?,
        };
        kiln_builder::exec::mounts::cleanup(mounts, &spec.upper_dir, &spec.lower_dirs);
        cleanup_mount_points(spec);
        tracing::info!(
            step = spec.index,
            start = if builder.is_some() {
                "restored"
            } else {
                "booted"
            },
            disks_ms = disks_made.as_millis() as u64,
            start_ms = (booted - disks_made).as_millis() as u64,
            exec_ms = ran.as_millis() as u64,
            diff_ms = t_diff.elapsed().as_millis() as u64,
            diff_bytes = bytes,
            total_ms = t0.elapsed().as_millis() as u64,
            "microVM step done"
        );
        StepReport::of_success(
            &spec.upper_dir,
            self.config.write_limit_bytes,
            &shaper,
            tail,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_vmm::channel::Message;
    use kiln_vmm::exec::{DiffData, DiffEnd, MAX_CHUNK_LEN};

    #[test]
    fn step_failures_are_worded_from_the_guest_exit() {
        let limits = StepLimits {
            memory_bytes: 64 << 20,
            pids_max: 32,
            disk_bytes: 64 << 20,
        };
        let st = |code, signal, oom, pids_limit, disk_full| ExecStatus {
            code,
            signal,
            oom,
            pids_limit,
            disk_full,
            failure: None,
        };
        let words = |s: ExecStatus| step_failure(&s, &limits, vec![]).map(|e| e.to_string());
        assert_eq!(words(st(Some(0), None, true, true, true)), None);
        let oom = words(st(Some(137), None, true, false, false)).unwrap();
        assert!(
            oom.starts_with("out of memory: memory limit of 64 MiB"),
            "{oom}"
        );
        let pids = words(st(None, Some(9), false, true, false)).unwrap();
        assert_eq!(
            pids,
            "pids limit of 32 tasks reached (the step was stopped)"
        );
        let disk = words(st(Some(1), None, false, false, true)).unwrap();
        assert!(
            disk.starts_with("disk full: the step's disk of 64 MiB"),
            "{disk}"
        );
        let sig = words(st(None, Some(15), false, false, false)).unwrap();
        assert_eq!(sig, "command killed by signal 15");
        let code = words(st(Some(3), None, false, false, false)).unwrap();
        assert_eq!(code, "command exited with code 3");
        assert_eq!(step_vm_bytes(16 << 20), 144 << 20);
        assert_eq!(step_vm_bytes(1 << 30), (1 << 30) + (128 << 20));
    }

    #[test]
    fn the_guest_listens_where_the_proxy_variables_point() {
        assert_eq!(
            kiln_vmm::egress::PROXY_PORT,
            kiln_builder::egress::PROXY_PORT
        );
        let url = format!(
            "http_proxy=http://127.0.0.1:{}",
            kiln_vmm::egress::PROXY_PORT
        );
        assert!(kiln_builder::egress::proxy_env().contains(&url));
        assert!(has_egress(&Network::Default));
        assert!(!has_egress(&Network::None));
        assert!(!has_egress(&Network::Host));
    }

    #[test]
    fn diff_bound_covers_headers_and_saturates() {
        assert_eq!(diff_bound(1 << 20), (2 << 20) + (16 << 20));
        assert_eq!(diff_bound(u64::MAX), u64::MAX);
    }

    /// A session whose other end is a fault injector standing in for a step VM's guest: it
    /// answers `connect`, then answers `diff` with `tar` in chunks.
    async fn fake_guest(tar: Vec<u8>) -> ExecSession {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        tokio::spawn(async move {
            let mut g = GuestChannel::from_stream(b);
            let t = Duration::from_secs(5);
            let Ok(Message::Connect(p)) = g.recv("connect", t).await.unwrap() else {
                panic!("no connect")
            };
            g.send(&Message::Connected(p)).await.unwrap();
            let Ok(Message::Diff(_)) = g.recv("diff", t).await.unwrap() else {
                panic!("no diff")
            };
            let mut seq = 0;
            for c in tar.chunks(MAX_CHUNK_LEN) {
                let data = c.to_vec();
                g.send(&Message::DiffData(DiffData { seq, data }))
                    .await
                    .unwrap();
                seq += 1;
            }
            let bytes = tar.len() as u64;
            g.send(&Message::DiffEnd(DiffEnd {
                seq,
                bytes,
                error: None,
            }))
            .await
            .unwrap();
        });
        ExecSession::over("fake".into(), GuestChannel::from_stream(a), BOOT_TIMEOUT)
            .await
            .unwrap()
    }

    /// A tar entry named `name` as is (no checks: what a hostile guest writes).
    fn raw_entry(b: &mut tar::Builder<Vec<u8>>, name: &[u8], kind: tar::EntryType, data: &[u8]) {
        let mut h = tar::Header::new_old();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }

    fn tar_of(entries: &[(&[u8], tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (n, k, d) in entries {
            raw_entry(&mut b, n, *k, d);
        }
        b.into_inner().unwrap()
    }

    #[tokio::test]
    async fn changes_unpack_in_overlay_form_and_hostile_ones_are_refused() {
        assert!(rustix::process::geteuid().is_root(), "needs root (mknod)");
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        let reg = tar::EntryType::Regular;
        let dir = tar::EntryType::Directory;
        let good = tar_of(&[
            (b"f", reg, b"x\n"),
            (b".wh.gone", reg, b""),
            (b"d/", dir, b""),
            (b"d/.wh..wh..opq", reg, b""),
            (b"d/n", reg, b"n"),
        ]);
        let mut s = fake_guest(good.clone()).await;
        let n = receive_changes(&mut s, t.path(), &upper, 1 << 20, 1, &Default::default())
            .await
            .unwrap();
        assert_eq!(n, good.len() as u64);
        assert_eq!(std::fs::read(upper.join("f")).unwrap(), b"x\n");
        let wh = std::fs::symlink_metadata(upper.join("gone")).unwrap();
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0, "{wh:?}");
        let mut v = [0u8; 4];
        let got = rustix::fs::lgetxattr(upper.join("d"), "trusted.overlay.opaque", &mut v[..]);
        assert_eq!((got.ok(), v[0]), (Some(1), b'y'));
        assert_eq!(std::fs::read(upper.join("d/n")).unwrap(), b"n");

        // Climbing out of the upper directory.
        let upper = t.path().join("upper2");
        std::fs::create_dir(&upper).unwrap();
        let mut s = fake_guest(tar_of(&[(b"../escape", reg, b"owned")])).await;
        let r = receive_changes(&mut s, t.path(), &upper, 1 << 20, 2, &Default::default()).await;
        assert!(matches!(r, Err(ExecError::Guest(_))), "{r:?}");
        assert!(!t.path().join("escape").exists());

        // A stream over its bound.
        let upper = t.path().join("upper3");
        std::fs::create_dir(&upper).unwrap();
        let big = tar_of(&[(b"big", reg, &vec![7u8; 200 << 10])]);
        let mut s = fake_guest(big).await;
        let r = receive_changes(&mut s, t.path(), &upper, 100 << 10, 3, &Default::default()).await;
        assert!(matches!(r, Err(ExecError::Guest(_))), "{r:?}");
    }
}
