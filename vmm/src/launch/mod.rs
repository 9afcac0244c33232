//! The QEMU launcher: host facts, the accelerator probe, the command line, the process.
//!
//! The guest is a `-M microvm` machine (QEMU `docs/system/i386/microvm.rst`): an ISA serial
//! port (ttyS0, the kernel console, written to a log file) and virtio-mmio devices only, in a
//! fixed order ([`DEVICE_LAYOUT`], part of the compatibility key):
//! 1. `virtio-blk-device` on drive `disk0` (qcow2, opened read-write at boot and at restore:
//!    a mismatch breaks the virtio-blk state);
//! 2. `virtio-serial-device` with one `virtserialport` named [`crate::channel::PORT_NAME`],
//!    whose chardev is a unix socket QEMU listens on.
//!
//! A build step's VM with a network (`default` or an allow-list) has a second
//! `virtserialport` on the same `virtio-serial-device`, [`kiln_guest::egress::PORT_NAME`]
//! ([`VmSpec::egress_socket`], [`crate::egress`]); it is never snapshotted, and snapshot
//! VMs never have that port, so [`DEVICE_LAYOUT`] describes every VM a snapshot is taken of.
//!
//! Guest RAM is a `memory-backend-file`: `share=on` on a fresh file during the boot-once run
//! (so the file IS the guest memory at snapshot time and `x-ignore-shared` skips it in the
//! migration stream), and for clones `share=off,readonly=on,rom=off` (QEMU ≥ 8.2,
//! `backends/hostmem-file.c`): the saved file is opened read-only and mapped private and
//! writable, so clones share its page cache copy-on-write and can never write it. A clone's
//! QEMU has its `madvise(MADV_HUGEPAGE)` refused (a seccomp filter set before the exec,
//! [`crate::jail::spawn`]): with that advice the kernel reads 4 MiB of the file around each
//! fault, which for the lazy chunk server's memory file means 4 MiB fetched per fault
//! ([`crate::lazy`]).
//!
//! Machine: [`MACHINE`], `microvm` with its i8254 PIT turned off (`pit=off`). With the PIT
//! on, Debian's 6.1 cloud kernel under QEMU 10.0 TCG dies in most boots about 0.15 s in with
//! `divide error` in `start_kernel` (seen on AMD EPYC and Intel Xeon hosts of this kind). It
//! is not a division: the oops' RIP is a `ret` (`__x86_return_thunk`). It is the PIT's IRQ 0,
//! running since reset, delivered through the i8259 PIC on vector 0, the vector of #DE,
//! once `start_kernel` enables interrupts; whether a tick is pending then is timing, hence
//! the intermittence. Measured in loops of 6 boots each: PIT and PIC on, 5 of
//! 6 died; `pit=off`, 0 of 6; PIT on with `pic=off`, 0 of 6. The guest keeps time with the
//! TSC (`tsc_early_khz`) and the local APIC timer, so it needs no PIT. The machine string is
//! part of the compatibility key, so a snapshot taken with other machine options is refused
//! by name.
//!
//! Firmware: qboot (`firmware=qboot.rom`, QEMU's own minimal firmware), not the microvm
//! default, SeaBIOS's `bios-microvm.bin`. SeaBIOS drives every virtio-blk device at POST:
//! it puts each one's vring in the top pages of the RAM below 4 GiB (reserved in its e820
//! map, three pages a disk) and sets the device `DRIVER_OK`, which starts QEMU's ioeventfd
//! for it, and QEMU then kicks each queue once ("to begin processing requests already in
//! vring"); QEMU's main loop runs that kick, not the vCPU thread. QEMU's PVH loader puts the
//! initrd at the top of that same RAM, so its option ROM copies the initrd over those vrings
//! before the kernel starts (the kernel then moves the initrd out of the reserved range).
//! When the main loop runs the kicks only after that copy (a busy host, or a CPU quota that
//! throttles QEMU), QEMU takes the initrd's bytes for the rings: it logs `Guest says index
//! N is available` for each garbage head, and sets then clears `VRING_USED_F_NO_NOTIFY`
//! (bit 0) in each used ring's flags, i.e. clears bit 0 of the first byte of each ring's
//! used page, inside the initrd. That is the tail of the archive, where its last module
//! lies, and the guest fails with `virtio_ring.ko: Key was rejected by service`. Measured
//! with QEMU 10.0 TCG, seven disks, QEMU's main-loop thread at nice 19 beside two busy
//! loops: SeaBIOS, 5 of 12 boots failed so; qboot, 0 of 12; a dump of the guest's RAM after
//! such a boot differed from the archive in exactly four bytes, `0x83` → `0x82`, `0x05` →
//! `0x04`, `0x71` → `0x70`, `0x5f` → `0x5e`, at four used rings' first bytes, all in
//! `virtio_ring.ko`. qboot drives no virtio device, reserves no RAM at the top, and puts the
//! ACPI tables in low memory; the guest has no SMBIOS (DMI) tables.
//!
//! Kernel console: `earlyprintk=ttyS0` as well as `console=ttyS0`, so that a kernel dying
//! before its serial console driver registers still leaves its last words in the console log;
//! [`console_report`] puts the panic or oops line first in every error that carries the log.
//!
//! One command line: [`VmSpec::args`] is the only place that builds QEMU's arguments; the
//! KVM probe, the boot-once run, clones and the VM tests all go through it.
//!
//! Sandbox: every QEMU runs under its own seccomp filter, [`SANDBOX`] (`-sandbox`,
//! qemu-system(1)), installed before the machine is created, so a guest that takes over
//! QEMU's device emulation cannot fork or exec a program, change its uid or gid, or change
//! its CPU affinity or scheduling. Nothing kiln asks of QEMU needs those calls: migration
//! to and from `file:` (snapshot and restore) opens a file, QMP `block_resize` grows the
//! overlay in place, the guest channel and QMP are sockets QEMU opened at start, and vCPU
//! and migration threads are threads, which the filter allows. `exec:` migration would
//! need a fork, and fails (`Failed to fork (Operation not permitted)`); kiln uses none.
//!
//! User: when kiln runs as root, QEMU runs as a uid and gid of its own and opens only the
//! descriptors the launcher hands it ([`crate::jail`]); the filter stays as it is (QEMU's
//! own `-run-with user=` would need the `setuid` that `elevateprivileges=deny` refuses).
//!
//! CPU: [`CPU_MODEL`], a named model with AVX, AVX2 and FMA and no AVX-512, minus the four
//! features QEMU's TCG does not implement, passed with `enforce` so that QEMU refuses to
//! start instead of silently dropping a feature: the guest sees the same CPUID under TCG and
//! KVM, or does not start.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::qmp::{Qmp, QmpError};

pub mod facts;
mod probe;
pub mod stub;

pub(crate) use self::probe::resolve_program;
pub use self::probe::{KvmNode, ProbeKey, known_accel, probe_accel, probe_accel_cached};

/// The id of the guest channel's chardev (the unix socket [`VmSpec::guest_socket`] QEMU
/// listens on, behind the `virtserialport` the guest init reads).
pub(crate) const GUEST_CHARDEV: &str = "guest";

/// Machine type and its options, as passed to `-M` (before `memory-backend=`); recorded in
/// the compatibility key. `pit=off`: see the module doc (QEMU `docs/system/i386/microvm.rst`
/// lists `pit`, `pic`, `rtc` and `isa-serial` as optional devices of this machine).
/// `firmware=qboot.rom` (what `-bios` sets, found in QEMU's data directories): see the
/// module doc; a snapshot's firmware ROM is part of its migration stream, so a snapshot
/// taken under another firmware could not be restored, and the key refuses it by name.
pub const MACHINE: &str = "microvm,pit=off,firmware=qboot.rom";
/// The `-cpu` model: Haswell (no TSX, IBRS: `Haswell-v4`) has AVX, AVX2, FMA, no AVX-512;
/// `pcid`, `tsc-deadline`, `invpcid` and `spec-ctrl` are removed because QEMU 10.0's TCG
/// refuses them under `enforce` (measured on this host, see the module doc).
pub const CPU_MODEL: &str = "Haswell-v4,-pcid,-tsc-deadline,-invpcid,-spec-ctrl";
/// QEMU's seccomp filter, as passed to `-sandbox` (qemu-system(1), "-sandbox"; the system
/// calls of each group are listed in QEMU's system/qemu-seccomp.c). `on` installs the filter
/// with QEMU's default deny set (`reboot`, `swapon`, `mount`, `kexec_load`, `syslog`, ...);
/// `obsolete=deny` adds calls modern C libraries no longer make (`_sysctl`, `uselib`,
/// `ustat`, ...); `elevateprivileges=deny` adds `setuid`, `setgid`, `setsid`, `setpgid` and
/// the `setre*`/`setres*`/`setfs*` variants; `spawn=deny` adds `fork`, `vfork`, `execve`
/// (and, since QEMU 8.2, `execveat`, `setns`, `unshare` and a `clone` that makes a process:
/// threads stay allowed); `resourcecontrol=deny` adds `setpriority`, `sched_setparam`,
/// `sched_setscheduler` (except to SCHED_IDLE) and `sched_setaffinity`. Each option has its
/// tightest value (`elevateprivileges=children` would allow what `deny` refuses). Not part of
/// the compatibility key: it changes no guest-visible state.
pub const SANDBOX: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";
/// The device layout, in QEMU's creation order; recorded in the compatibility key.
pub const DEVICE_LAYOUT: &str =
    "isa-serial:ttyS0,virtio-blk-device:disk0,virtio-serial-device,virtserialport:org.kiln.guest.0";
/// Drive id of the root disk (also its block backend's name in QMP, e.g. `block_resize`).
pub(crate) const DRIVE_ID: &str = "disk0";

/// Errors of the launcher.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A program could not be run.
    #[error("{program}: {source} (is qemu-system-x86 installed? see ci/setup.sh)")]
    Exec {
        /// The program.
        program: String,
        /// Why.
        source: std::io::Error,
    },
    /// A program ran and failed.
    #[error("{program} failed: {stderr}")]
    Failed {
        /// The program and its arguments.
        program: String,
        /// Its stderr (last 4 KiB).
        stderr: String,
    },
    /// QEMU exited before it could be driven.
    #[error("QEMU exited early ({status}): {log}\n{console}")]
    Exited {
        /// Exit status.
        status: String,
        /// The tail of its stderr log.
        log: String,
        /// The guest's console ([`console_report`]): a guest that died at once says why.
        console: String,
    },
    /// Setting up QEMU's jail failed in the child before the exec ([`crate::jail::spawn`]).
    #[error("{what}{}{path}: {source}", if path.is_empty() { "" } else { " " })]
    Jail {
        /// The step (`binding a file into QEMU's root`).
        what: &'static str,
        /// The host path the step was about; empty when none.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A host fact could not be read.
    #[error("host: {0}")]
    Host(String),
    /// The accelerator asked for (`KILN_ACCEL`) is not usable.
    #[error("accelerator {0:?} is not usable here: {1}")]
    Accel(String, String),
    /// Talking to QEMU failed.
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// A local file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LaunchError + '_ {
    move |source| LaunchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Takes an exclusive `flock` on `path` (created if missing) on a blocking thread; the lock
/// lasts as long as the returned file.
pub(crate) async fn lock_file(path: &Path) -> Result<std::fs::File, LaunchError> {
    let p = path.to_path_buf();
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(io_err(&p))?;
    tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor this function owns; no memory is shared.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_err(&p)(std::io::Error::last_os_error()));
        }
        Ok(f)
    })
    .await
    .map_err(|e| LaunchError::Host(e.to_string()))?
}

/// The accelerator (`tcg` or `kvm` in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// QEMU's binary translator (always available, slower).
    Tcg,
    /// Linux KVM (only when it runs a stock guest kernel; see [`probe_accel`]).
    Kvm,
}

impl Accel {
    /// `tcg` or `kvm`.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

/// Facts about this host's QEMU.
#[derive(Debug, Clone)]
pub struct Host {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// `qemu-img`.
    pub qemu_img: PathBuf,
    /// QEMU's version (`10.0.2`), from `--version`.
    pub qemu_version: String,
    /// Host TSC frequency, kHz (`cpu MHz` of `/proc/cpuinfo` × 1000; on this host the TSC is
    /// invariant, `constant_tsc nonstop_tsc`), given to TCG guests as `tsc_early_khz`.
    pub tsc_khz: Option<u64>,
    /// Where QEMU's version and its jail's root plan are remembered ([`facts`]); `None`:
    /// read afresh by each process.
    pub facts_file: Option<PathBuf>,
}

impl Host {
    /// Finds QEMU (`$KILN_QEMU` or `qemu-system-x86_64` on `PATH`, and `qemu-img`) and reads
    /// its version.
    pub async fn detect() -> Result<Self, LaunchError> {
        Self::detect_with(None).await
    }

    /// [`Host::detect`], with QEMU's version (and later its jail's root plan) remembered in
    /// `facts_file` ([`facts`]) while the binary stays the same.
    pub async fn detect_cached(facts_file: &Path) -> Result<Self, LaunchError> {
        Self::detect_with(Some(facts_file)).await
    }

    async fn detect_with(facts_file: Option<&Path>) -> Result<Self, LaunchError> {
        let qemu = PathBuf::from(
            std::env::var("KILN_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into()),
        );
        let qemu_img =
            PathBuf::from(std::env::var("KILN_QEMU_IMG").unwrap_or_else(|_| "qemu-img".into()));
        let key = facts_file.and_then(|f| facts::BinaryKey::current(&qemu).map(|k| (f, k)));
        let known = key.as_ref().and_then(|(f, k)| facts::read(f, k).version);
        let qemu_version = match known {
            Some(v) => v,
            None => {
                let out = run(&qemu, &["--version"]).await?;
                let v = parse_qemu_version(&out).ok_or_else(|| {
                    LaunchError::Host(format!("cannot read QEMU's version from {out:?}"))
                })?;
                if let Some((f, k)) = &key {
                    facts::update(f, k, |x| x.version = Some(v.clone()));
                }
                v
            }
        };
        let tsc_khz = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| parse_tsc_khz(&s));
        Ok(Self {
            qemu,
            qemu_img,
            qemu_version,
            tsc_khz,
            facts_file: facts_file.map(Path::to_path_buf),
        })
    }
}

/// `QEMU emulator version 10.0.2 (Debian ...)` → `10.0.2`.
pub fn parse_qemu_version(out: &str) -> Option<String> {
    let rest = out.split("version ").nth(1)?;
    let v: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    (!v.is_empty()).then_some(v)
}

/// The first `cpu MHz : 2596.140` line of `/proc/cpuinfo`, in kHz (`2596140`).
pub fn parse_tsc_khz(cpuinfo: &str) -> Option<u64> {
    let line = cpuinfo.lines().find(|l| l.starts_with("cpu MHz"))?;
    let mhz: f64 = line.split(':').nth(1)?.trim().parse().ok()?;
    (mhz > 0.0).then(|| (mhz * 1000.0).round() as u64)
}

pub(crate) async fn run(program: &Path, args: &[&str]) -> Result<String, LaunchError> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| LaunchError::Exec {
            program: program.display().to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(LaunchError::Failed {
            program: format!("{} {}", program.display(), args.join(" ")),
            stderr: tail(&String::from_utf8_lossy(&out.stderr), 4096),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `qemu-img` with `args`; its stdout.
pub(crate) async fn run_img(host: &Host, args: &[&str]) -> Result<String, LaunchError> {
    run(&host.qemu_img, args).await
}

/// QEMU's exit status in words, saying when the OOM killer ended it at its cgroup's memory
/// limit.
fn status_text(
    status: std::process::ExitStatus,
    cgroup: Option<&dyn crate::jail::cgroup::QemuCgroup>,
) -> String {
    match cgroup.filter(|c| c.oom_killed()) {
        Some(c) => format!(
            "{status}: killed by the kernel at its cgroup's memory limit of {} MiB \
             (guest RAM plus KILN_QEMU_HEADROOM_MIB)",
            c.limits().memory_bytes >> 20
        ),
        None => status.to_string(),
    }
}

/// The last 4 KiB of QEMU's stderr log at `log`, each file QEMU was handed as
/// `/proc/self/fd/<n>` ([`crate::jail`]) named by its host path again, so that a message such
/// as "Could not open '/proc/self/fd/12': Permission denied" says which file.
fn log_tail(log: &Path, names: &std::collections::HashMap<PathBuf, String>) -> String {
    tail(
        &with_paths(&std::fs::read_to_string(log).unwrap_or_default(), names),
        4096,
    )
}

/// `text` with each name of `names` (path → `/proc/self/fd/<n>`) replaced by its path; a
/// name followed by a digit is another descriptor's and is left alone.
pub(crate) fn with_paths(text: &str, names: &std::collections::HashMap<PathBuf, String>) -> String {
    let mut out = text.to_string();
    for (path, name) in names {
        let mut done = String::with_capacity(out.len());
        let mut rest = out.as_str();
        while let Some(i) = rest.find(name.as_str()) {
            let after = &rest[i + name.len()..];
            done.push_str(&rest[..i]);
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                done.push_str(name);
            } else {
                done.push_str(&path.display().to_string());
            }
            rest = after;
        }
        done.push_str(rest);
        out = done;
    }
    out
}

fn tail(s: &str, n: usize) -> String {
    let s = s.trim();
    if s.len() <= n {
        return s.to_string();
    }
    let mut start = s.len() - n;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &s[start..])
}

/// How guest RAM maps its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryMode {
    /// `share=on`: guest writes go to the file (boot-once run).
    Shared,
    /// `share=off,readonly=on,rom=off`: file opened read-only, mapped private (clones).
    Private,
    /// `memory-backend-ram`: anonymous memory, no file (build steps' VMs, never
    /// snapshotted); [`VmSpec::memory_file`] is unused.
    Anonymous,
}

/// The root disk's image format, as QEMU's `-drive format=` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskFormat {
    /// qcow2 (images, snapshots and clones: an overlay over the image).
    Qcow2,
    /// A raw file (a build step's upper disk, made with mke2fs).
    Raw,
}

/// Everything one QEMU run needs.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Accelerator.
    pub accel: Accel,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM, bytes (a multiple of 1 MiB).
    pub memory_bytes: u64,
    /// Uncompressed vmlinux (PVH entry).
    pub kernel: PathBuf,
    /// Initramfs (cpio newc).
    pub initramfs: PathBuf,
    /// Guest RAM file.
    pub memory_file: PathBuf,
    /// How it is mapped.
    pub memory_mode: MemoryMode,
    /// The root disk.
    pub disk: PathBuf,
    /// Its format.
    pub disk_format: DiskFormat,
    /// Read-only raw disks after the guest channel, in order, as `virtio-blk-device`s with
    /// the serial `lower<i>` (a build step's lower layers, then the trees of its bind
    /// mounts, each an ext4 image); the root
    /// disk then gets the serial `upper`, so the guest finds each by serial
    /// (`/sys/block/vd*/serial`), whatever names the kernel gives them. Empty for
    /// sandboxes, whose device layout ([`DEVICE_LAYOUT`]) stays as it is.
    pub ro_disks: Vec<PathBuf>,
    /// Read-write raw disks after the read-only ones, in order, as `virtio-blk-device`s with
    /// the serial `cache<i>` (a build step's `RUN --mount=type=cache` disks, each an ext4
    /// image the host keeps between steps); with any, the root disk gets the serial `upper`
    /// too. A jailed QEMU gets each as one of its own files ([`crate::jail::Access::Own`]),
    /// given back to root when it is reaped. Empty for sandboxes.
    pub rw_disks: Vec<PathBuf>,
    /// QMP socket (QEMU listens).
    pub qmp_socket: PathBuf,
    /// Guest channel socket (QEMU listens).
    pub guest_socket: PathBuf,
    /// The egress port's chardev socket (QEMU listens): a second `virtserialport` named
    /// [`kiln_guest::egress::PORT_NAME`] on the same `virtio-serial-device`, after the
    /// guest channel's, carrying a build step's proxy connections ([`crate::egress`]).
    /// `Some` only for the VM of a step whose network is `default` or an allow-list, and for
    /// every builder VM ([`crate::builder`]: the device set is fixed, the guest listens only
    /// when its step has a network); image snapshot VMs (boot-once, clones) never have it,
    /// so their device layout ([`DEVICE_LAYOUT`], the compatibility key) stays as it is.
    pub egress_socket: Option<PathBuf>,
    /// Serial console log.
    pub serial_log: PathBuf,
    /// Start paused waiting for `migrate-incoming` (`-incoming defer`).
    pub incoming: bool,
    /// Host TSC kHz (TCG: `tsc_early_khz`).
    pub tsc_khz: Option<u64>,
    /// Extra kernel command-line arguments, appended after kiln's own (later ones win in
    /// Linux's parser): for debugging (`loglevel=8`) and for tests that make a guest fail
    /// on purpose (`init=/nonexistent`). Empty for every normal run.
    pub kernel_args: Vec<String>,
    /// The size the disk may grow to while QEMU runs (a clone's `block_resize`), bytes;
    /// `None`: its size at start. Part of the bound on what a jailed QEMU may write
    /// ([`crate::jail::file_size_limit`]).
    pub max_disk_bytes: Option<u64>,
}

impl VmSpec {
    /// The kernel command line: early and normal console on ttyS0, reboot/panic make QEMU
    /// exit, root on the virtio disk; under TCG `tsc_early_khz=<host kHz> tsc=reliable`
    /// (without it about half the TCG boots on microvm hang calibrating the TSC: with
    /// `pit=off` there is no PIT to calibrate against); then [`VmSpec::kernel_args`].
    pub fn cmdline(&self) -> String {
        let mut c =
            String::from("earlyprintk=ttyS0 console=ttyS0 reboot=t panic=-1 root=/dev/vda rw");
        if self.accel == Accel::Tcg
            && let Some(khz) = self.tsc_khz
        {
            c.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
        }
        for a in &self.kernel_args {
            c.push(' ');
            c.push_str(a);
        }
        c
    }

    /// QEMU's arguments (without the program), naming every file and socket by its path.
    pub fn args(&self) -> Vec<String> {
        self.args_named(None)
    }

    /// QEMU's arguments (without the program). With `handed` (a QEMU that runs as a user of
    /// its own, [`crate::jail`]), each file and socket is named by the descriptor handed to
    /// it instead of its path: files `/proc/self/fd/<n>`, sockets `fd=<n>` (QMP then is a
    /// `-chardev` with `-mon mode=control`), `/dev/kvm` through fd set 1, the qcow2 backing
    /// file overridden; and `-name` lists every path so named (`guest=kiln <what>=<path> ...`,
    /// commas doubled as QEMU's option syntax wants), so that kiln still finds its QEMUs by
    /// the paths their command lines name.
    pub(crate) fn args_named(&self, handed: Option<&crate::jail::Handed>) -> Vec<String> {
        let p = |path: &Path| {
            handed
                .and_then(|h| h.file_name(path))
                .unwrap_or_else(|| path.display().to_string())
        };
        let chardev = |id: &str, path: &Path| match handed.and_then(|h| h.socket_fd(path)) {
            Some(fd) => format!("socket,id={id},fd={fd},server=on,wait=off"),
            None => format!("socket,id={id},path={},server=on,wait=off", path.display()),
        };
        let mib = self.memory_bytes >> 20;
        let mem = match self.memory_mode {
            MemoryMode::Shared => format!(
                "memory-backend-file,id=mem,size={mib}M,mem-path={},share=on",
                p(&self.memory_file)
            ),
            MemoryMode::Private => format!(
                "memory-backend-file,id=mem,size={mib}M,mem-path={},share=off,readonly=on,rom=off",
                p(&self.memory_file)
            ),
            MemoryMode::Anonymous => format!("memory-backend-ram,id=mem,size={mib}M"),
        };
        let format = match self.disk_format {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
        };
        let mut a: Vec<String> = vec![
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-sandbox".into(),
            SANDBOX.into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-accel".into(),
            match handed.and_then(|h| h.kvm.as_ref()) {
                Some(_) => format!("{},device=/dev/fdset/1", self.accel.name()),
                None => self.accel.name().into(),
            },
            "-M".into(),
            format!("{MACHINE},memory-backend=mem"),
            "-cpu".into(),
            format!("{CPU_MODEL},enforce"),
            "-smp".into(),
            self.vcpus.to_string(),
            "-m".into(),
            format!("{mib}M"),
            "-object".into(),
            mem,
            "-kernel".into(),
            p(&self.kernel),
            "-initrd".into(),
            p(&self.initramfs),
            "-append".into(),
            self.cmdline(),
            "-serial".into(),
            format!("file:{}", p(&self.serial_log)),
            "-drive".into(),
            format!(
                "file={},format={format},if=none,id={DRIVE_ID},readonly=off{}",
                p(&self.disk),
                match handed.and_then(|h| h.backing.as_deref()) {
                    Some(b) => format!(",backing.file.filename={}", p(b)),
                    None => String::new(),
                }
            ),
            "-device".into(),
            if self.ro_disks.is_empty() && self.rw_disks.is_empty() {
                format!("virtio-blk-device,drive={DRIVE_ID}")
            } else {
                format!("virtio-blk-device,drive={DRIVE_ID},serial=upper")
            },
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            chardev(GUEST_CHARDEV, &self.guest_socket),
            "-device".into(),
            format!(
                "virtserialport,chardev={GUEST_CHARDEV},name={}",
                crate::channel::PORT_NAME
            ),
        ];
        match handed.and_then(|h| h.socket_fd(&self.qmp_socket)) {
            Some(fd) => a.extend([
                "-chardev".into(),
                format!("socket,id=qmp,fd={fd},server=on,wait=off"),
                "-mon".into(),
                "chardev=qmp,mode=control".into(),
            ]),
            None => a.extend([
                "-qmp".into(),
                format!("unix:{},server=on,wait=off", self.qmp_socket.display()),
            ]),
        }
        if let Some(egress) = &self.egress_socket {
            a.extend([
                "-chardev".into(),
                chardev("egress", egress),
                "-device".into(),
                format!(
                    "virtserialport,chardev=egress,name={}",
                    kiln_guest::egress::PORT_NAME
                ),
            ]);
        }
        for (i, d) in self.ro_disks.iter().enumerate() {
            a.extend([
                "-drive".into(),
                format!("file={},format=raw,if=none,id=lower{i},readonly=on", p(d)),
                "-device".into(),
                format!("virtio-blk-device,drive=lower{i},serial=lower{i}"),
            ]);
        }
        for (i, d) in self.rw_disks.iter().enumerate() {
            a.extend([
                "-drive".into(),
                format!("file={},format=raw,if=none,id=cache{i},readonly=off", p(d)),
                "-device".into(),
                format!("virtio-blk-device,drive=cache{i},serial=cache{i}"),
            ]);
        }
        if let Some(h) = handed {
            if let Some(kvm) = &h.kvm {
                a.extend([
                    "-add-fd".into(),
                    format!("fd={},set=1", std::os::fd::AsRawFd::as_raw_fd(kvm)),
                ]);
            }
            a.extend(["-name".into(), self.name_paths(h)]);
        }
        if self.incoming {
            a.extend(["-S".into(), "-incoming".into(), "defer".into()]);
        }
        a
    }

    /// `guest=kiln <what>=<path> ...` for `-name`: every path handed to a jailed QEMU, in a
    /// fixed order, commas doubled (QEMU's option syntax).
    fn name_paths(&self, h: &crate::jail::Handed) -> String {
        let mut named: Vec<(String, &Path)> = vec![
            ("qmp".into(), &self.qmp_socket),
            ("channel".into(), &self.guest_socket),
        ];
        named.extend(
            self.egress_socket
                .iter()
                .map(|e| ("egress".into(), e.as_path())),
        );
        named.extend([
            ("kernel".into(), self.kernel.as_path()),
            ("initrd".into(), self.initramfs.as_path()),
            ("disk".into(), self.disk.as_path()),
            ("serial".into(), self.serial_log.as_path()),
        ]);
        if self.memory_mode != MemoryMode::Anonymous {
            named.push(("memory".into(), &self.memory_file));
        }
        named.extend(h.backing.iter().map(|b| ("backing".into(), b.as_path())));
        named.extend(
            self.ro_disks
                .iter()
                .enumerate()
                .map(|(i, d)| (format!("lower{i}"), d.as_path())),
        );
        named.extend(
            self.rw_disks
                .iter()
                .enumerate()
                .map(|(i, d)| (format!("cache{i}"), d.as_path())),
        );
        let mut extra: Vec<&PathBuf> = h
            .files
            .keys()
            .filter(|k| !named.iter().any(|(_, p)| p == k))
            .collect();
        extra.sort();
        named.extend(extra.into_iter().map(|e| ("file".into(), e.as_path())));
        let mut s = String::from("guest=kiln");
        for (what, path) in named {
            s.push_str(&format!(" {what}={}", path.display()).replace(',', ",,"));
        }
        s
    }
}

/// A QEMU process and its QMP session.
#[derive(Debug)]
pub struct Vm {
    /// QEMU's pid.
    pub pid: u32,
    /// The user QEMU runs as ([`crate::jail`]); `None` when kiln is not root and QEMU runs
    /// as kiln's own user.
    pub user: Option<crate::jail::QemuUser>,
    child: Option<crate::jail::spawn::Process>,
    /// QMP, in command mode.
    pub qmp: Qmp,
    /// QEMU's stderr log.
    pub stderr_log: PathBuf,
    /// What QEMU calls the files handed to it (`/proc/self/fd/<n>`), by path.
    names: std::collections::HashMap<PathBuf, String>,
    /// The files chowned to [`Vm::user`], given back to root when this handle is dropped,
    /// after QEMU is reaped (fields drop after [`Drop::drop`]).
    owned: crate::jail::Owned,
    /// QEMU's cgroup ([`crate::jail::cgroup`]) when it is jailed; removed when this handle
    /// is dropped, after QEMU is reaped.
    cgroup: Option<Box<dyn crate::jail::cgroup::QemuCgroup>>,
}

impl Vm {
    /// Starts QEMU with `spec` (in its own process group, stdin closed, stdout and stderr to
    /// `stderr_log`) and connects QMP within `timeout`. With `tied`, QEMU is killed
    /// (`PR_SET_PDEATHSIG`) when the thread that started it exits, so a killed boot-once run
    /// leaves no QEMU behind; without it, QEMU keeps running if this process exits (clones
    /// outlive `kiln start`). [`Vm::kill`] and dropping the handle end it.
    ///
    /// When kiln runs as root, QEMU runs as a user of its own ([`crate::jail`]): the files of
    /// `spec` are handed to it as descriptors, its own writable ones chowned to that user.
    pub async fn spawn(
        host: &Host,
        spec: &VmSpec,
        stderr_log: &Path,
        timeout: Duration,
        tied: bool,
    ) -> Result<Self, LaunchError> {
        Self::spawn_with(host, spec, stderr_log, timeout, tied, &[]).await
    }

    /// [`Vm::spawn`], also handing QEMU the files of `extra`, which it opens later through
    /// QMP (a vmstate to migrate to or from): name them to QEMU with [`Vm::qemu_path`].
    pub async fn spawn_with(
        host: &Host,
        spec: &VmSpec,
        stderr_log: &Path,
        timeout: Duration,
        tied: bool,
        extra: &[(&Path, crate::jail::Access)],
    ) -> Result<Self, LaunchError> {
        let log = std::fs::File::create(stderr_log).map_err(io_err(stderr_log))?;
        // Before the uid lock: nothing may await while it is held (`choose` takes it with a
        // blocking flock, so a task awaiting under it can starve the thread another start
        // blocks on it).
        let root = if crate::jail::can_drop() {
            Some(crate::jail::root::plan_for(host).await?)
        } else {
            None
        };
        let chosen = if crate::jail::can_drop() {
            Some(crate::jail::choose(crate::jail::QemuUsers::from_env()?)?)
        } else {
            None
        };
        let user = chosen.as_ref().map(|c| c.user);
        let handed = match user {
            Some(u) => Some(crate::jail::hand_over(spec, extra, u)?),
            None => None,
        };
        let names: std::collections::HashMap<PathBuf, String> = match &handed {
            Some(h) => h
                .files
                .keys()
                .filter_map(|k| Some((k.clone(), h.file_name(k)?)))
                .collect(),
            None => Default::default(),
        };
        let fds = handed.as_ref().map(|h| h.raw_fds()).unwrap_or_default();
        let args = spec.args_named(handed.as_ref());
        // A jailed QEMU runs in a cgroup of its own, joined before its exec.
        let cgroup = match user {
            Some(_) => Some(crate::jail::cgroup::create(spec)?),
            None => None,
        };
        let join: Vec<OwnedFd> = cgroup
            .iter()
            .flat_map(|c| c.procs_files())
            .map(|p| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .map(OwnedFd::from)
                    .map_err(io_err(&p))
            })
            .collect::<Result<_, _>>()?;
        let join_fds: Vec<std::os::fd::RawFd> = join.iter().map(|f| f.as_raw_fd()).collect();
        let t0 = std::time::Instant::now();
        let mut child = crate::jail::spawn::spawn(&crate::jail::spawn::Launch {
            program: &host.qemu,
            root: root.as_deref(),
            args: &args,
            log: &log,
            keep: &fds,
            user,
            tied,
            join: &join_fds,
            file_size_limit: match user {
                Some(_) => Some(crate::jail::file_size_limit(spec)?),
                None => None,
            },
            // A clone's RAM is a file read on fault (a snapshot's memory file, or the lazy
            // chunk server's): page-sized faults, not 2 MiB ones (crate::lazy).
            no_huge_pages: spec.memory_mode == MemoryMode::Private,
        })?;
        drop(join);
        drop(log);
        tracing::debug!(
            pid = child.id(),
            jailed = user.is_some(),
            micros = t0.elapsed().as_micros() as u64,
            "QEMU executed (clone, jail, exec)"
        );
        // QEMU runs as its user now (spawn returns once exec succeeded): the uid lock can go,
        // and so can this process's copies of the descriptors (so that a QEMU that dies
        // closes its sockets).
        drop(chosen);
        let mut owned = crate::jail::Owned::default();
        if let Some(mut h) = handed {
            owned = std::mem::take(&mut h.owned);
        }
        let pid = child.id();
        let deadline = tokio::time::Instant::now() + timeout;
        let qmp = loop {
            if let Some(status) = child.try_wait().map_err(io_err(&host.qemu))? {
                return Err(LaunchError::Exited {
                    status: status_text(status, cgroup.as_deref()),
                    log: log_tail(stderr_log, &names),
                    console: console_report(&spec.serial_log),
                });
            }
            if spec.qmp_socket.exists() {
                match Qmp::connect(&spec.qmp_socket, timeout).await {
                    Ok(q) => break q,
                    Err(e) if tokio::time::Instant::now() >= deadline => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(e.into());
                    }
                    Err(_) => {}
                }
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(QmpError::Timeout {
                    what: "QMP socket".into(),
                    ms: timeout.as_millis(),
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Ok(Self {
            pid,
            user,
            child: Some(child),
            qmp,
            stderr_log: stderr_log.to_path_buf(),
            names,
            owned,
            cgroup,
        })
    }

    /// How QEMU names `path`, a file handed to it at start ([`Vm::spawn_with`]):
    /// `/proc/self/fd/<n>` for a QEMU that runs as its own user, else the path itself.
    pub fn qemu_path(&self, path: &Path) -> String {
        self.names
            .get(path)
            .cloned()
            .unwrap_or_else(|| path.display().to_string())
    }

    /// Whether QEMU has exited (reaping it), with its status.
    pub fn exited(&mut self) -> Option<String> {
        let s = self.exit_status()?;
        Some(status_text(s, self.cgroup.as_deref()))
    }

    /// The limits of QEMU's cgroup, when it has one (a jailed QEMU).
    pub fn cgroup_limits(&self) -> Option<crate::jail::cgroup::QemuLimits> {
        self.cgroup.as_ref().map(|c| c.limits())
    }

    /// [`Vm::exited`], waiting up to `within` for QEMU to go (a guest channel that closed
    /// means QEMU is on its way out, but it may not have been reaped yet).
    pub async fn wait_exited(&mut self, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// QEMU's exit status once it has exited (reaping it); `None` while it runs or after
    /// [`Vm::detach`].
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// The tail of QEMU's stderr log (for error messages).
    pub fn log_tail(&self) -> String {
        log_tail(&self.stderr_log, &self.names)
    }

    /// `quit` over QMP, then waits up to 5 s for the process; kills it if still there.
    pub async fn quit(mut self) {
        let _ = self
            .qmp
            .execute_within("quit", None, Duration::from_secs(2))
            .await;
        self.reap(Duration::from_secs(5)).await;
    }

    /// Kills QEMU (SIGKILL) and reaps it.
    pub async fn kill(mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
        }
        self.reap(Duration::from_secs(5)).await;
    }

    /// Leaves QEMU running on its own (clones): the handle no longer owns the process.
    pub fn detach(mut self) -> u32 {
        self.child = None;
        self.owned.keep();
        if let Some(c) = self.cgroup.take() {
            c.keep();
        }
        self.pid
    }

    async fn reap(&mut self, within: Duration) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // A VM handle dropped on an error path must not leave QEMU running.
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `qemu-img create -f qcow2 -o extended_l2=on -b BASE -F raw OVERLAY` (BASE by absolute
/// path): the per-run copy-on-write disk over a raw ext4 image.
///
/// With extended L2 entries ([`OVERLAY_OPTIONS`]) each 64 KiB cluster has 32 subclusters of
/// 2 KiB, each allocated on its own: a guest write of a 4 KiB block is copied into the
/// overlay alone. Without them QEMU allocates the whole cluster at the first write into it
/// and first reads the rest of it from the base, so every ext4 block a clone writes (the
/// journal, a bitmap, an inode table block) fetched the 64 KiB around it from a lazily
/// served disk ([`crate::lazy`]). Measured with `ci/bench-clone.sh --store s3` (issue 35):
/// the busybox clone's disk fetched before it answered was mostly those reads.
pub async fn qcow2_overlay(host: &Host, base: &Path, overlay: &Path) -> Result<(), LaunchError> {
    let base = std::path::absolute(base).map_err(io_err(base))?;
    run_img(
        host,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            OVERLAY_OPTIONS,
            "-b",
            &base.display().to_string(),
            "-F",
            "raw",
            &overlay.display().to_string(),
        ],
    )
    .await?;
    Ok(())
}

/// The qcow2 creation options of [`qcow2_overlay`]: extended L2 entries (subclusters,
/// QEMU >= 5.2) over the default 64 KiB clusters.
pub const OVERLAY_OPTIONS: &str = "extended_l2=on,cluster_size=65536";

/// Bytes of console log kept in errors.
const CONSOLE_TAIL_BYTES: usize = 4096;

/// Markers of a kernel that died, as Linux prints them (`kernel/panic.c`,
/// `arch/x86/kernel/dumpstack.c`): the first console line holding one is quoted in errors.
const DEATH_MARKERS: [&str; 5] = [
    "Kernel panic - not syncing",
    "divide error:",
    "general protection fault",
    "BUG: ",
    "Oops: ",
];

/// The first line of the console log at `path` where the guest kernel reports its death (a
/// panic, an oops, a divide error), without the kernel's `[seconds]` stamp; `None` when there
/// is none or no log.
pub fn guest_death(path: &Path) -> Option<String> {
    let b = std::fs::read(path).ok()?;
    let text = String::from_utf8_lossy(&b);
    let line = death_line(&text)?;
    let bare = match line.strip_prefix('[').and_then(|r| r.split_once(']')) {
        Some((_, rest)) => rest.trim(),
        None => line,
    };
    Some(bare.to_string())
}

fn death_line(text: &str) -> Option<&str> {
    text.lines()
        .find(|l| DEATH_MARKERS.iter().any(|m| l.contains(m)))
        .map(str::trim)
}

/// The console log at `path` summarised for an error message: the first line where the
/// kernel reports its death (a panic, an oops, a divide error) when there is one, then the
/// last 4 KiB of the log; `console: empty` when the guest wrote nothing at all (with
/// `earlyprintk` even a kernel that dies early writes something, so an empty console means
/// QEMU never ran the kernel).
pub fn console_report(path: &Path) -> String {
    let text = std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    if text.trim().is_empty() {
        return format!("console: empty ({})", path.display());
    }
    let death = death_line(&text)
        .map(|l| format!("guest kernel: {l}\n"))
        .unwrap_or_default();
    format!(
        "{death}console (tail):\n{}",
        tail(&text, CONSOLE_TAIL_BYTES)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4 KiB block written into the overlay is all the overlay holds afterwards: nothing
    /// else of the 64 KiB cluster around it was copied from the base (which, served lazily,
    /// would have been fetched for it). Without extended L2 entries the whole cluster is.
    #[tokio::test]
    async fn a_block_written_to_the_overlay_copies_nothing_else_from_its_base() {
        let host = Host::detect().await.expect("QEMU on this host");
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![7u8; 1 << 20]).unwrap();
        let overlay = dir.path().join("disk.qcow2");
        qcow2_overlay(&host, &base, &overlay).await.unwrap();
        let o = overlay.to_str().unwrap();
        let qemu_io = host.qemu_img.with_file_name("qemu-io");
        run(&qemu_io, &["-f", "qcow2", "-c", "write -P 1 4096 4096", o])
            .await
            .unwrap();
        let map = run_img(&host, &["map", "--output=json", "-f", "qcow2", o])
            .await
            .unwrap();
        let map: Vec<serde_json::Value> = serde_json::from_str(&map).unwrap();
        let own: Vec<(u64, u64)> = map
            .iter()
            .filter(|e| e["depth"] == 0)
            .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
            .collect();
        assert_eq!(own, [(4096, 4096)], "the overlay's own ranges: {map:?}");
    }

    #[test]
    fn qemu_messages_name_handed_files_by_their_paths() {
        let names = std::collections::HashMap::from([
            (
                PathBuf::from("/s/disk.qcow2"),
                "/proc/self/fd/1".to_string(),
            ),
            (PathBuf::from("/s/mem"), "/proc/self/fd/12".to_string()),
        ]);
        assert_eq!(
            with_paths(
                "Could not open '/proc/self/fd/12': Permission denied; /proc/self/fd/1: bad",
                &names
            ),
            "Could not open '/s/mem': Permission denied; /s/disk.qcow2: bad"
        );
    }

    fn spec() -> VmSpec {
        VmSpec {
            max_disk_bytes: None,
            accel: Accel::Tcg,
            vcpus: 1,
            memory_bytes: 256 << 20,
            kernel: "/k/vmlinux".into(),
            initramfs: "/k/initrd".into(),
            memory_file: "/s/mem".into(),
            memory_mode: MemoryMode::Shared,
            disk: "/s/disk.qcow2".into(),
            disk_format: DiskFormat::Qcow2,
            ro_disks: Vec::new(),
            rw_disks: Vec::new(),
            qmp_socket: "/s/qmp.sock".into(),
            guest_socket: "/s/guest.sock".into(),
            serial_log: "/s/console.log".into(),
            incoming: false,
            tsc_khz: Some(2_596_140),
            egress_socket: None,
            kernel_args: vec![],
        }
    }

    #[test]
    fn versions_and_tsc_parse() {
        assert_eq!(
            parse_qemu_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\nCopyright"),
            Some("10.0.2".into())
        );
        assert_eq!(parse_qemu_version("nothing"), None);
        assert_eq!(
            parse_tsc_khz("processor\t: 0\ncpu MHz\t\t: 2596.140\n"),
            Some(2_596_140)
        );
        assert_eq!(parse_tsc_khz("cpu MHz : x"), None);
    }

    #[test]
    fn boot_args_share_memory_and_tcg_gets_the_tsc() {
        let s = spec();
        let a = s.args().join(" ");
        assert!(a.contains("-accel tcg"), "{a}");
        // No PIT: its IRQ 0 reached early kernels as a "divide error" (module doc).
        // No SeaBIOS: it left virtio-blk rings where the initrd goes (module doc).
        assert!(
            a.contains("-M microvm,pit=off,firmware=qboot.rom,memory-backend=mem"),
            "{a}"
        );
        // Early kernel output reaches the console log too.
        assert!(
            s.cmdline().starts_with("earlyprintk=ttyS0 console=ttyS0 "),
            "{a}"
        );
        assert!(a.contains(&format!("-cpu {CPU_MODEL},enforce")), "{a}");
        assert!(
            a.contains("memory-backend-file,id=mem,size=256M,mem-path=/s/mem,share=on"),
            "{a}"
        );
        assert!(
            a.contains("format=qcow2,if=none,id=disk0,readonly=off"),
            "{a}"
        );
        assert!(a.contains("name=org.kiln.guest.0"), "{a}");
        assert!(!a.contains("-incoming"), "{a}");
        assert!(
            a.contains(
                "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
            ),
            "{a}"
        );
        assert!(
            s.cmdline().ends_with("tsc_early_khz=2596140 tsc=reliable"),
            "{}",
            s.cmdline()
        );
        let kvm = VmSpec {
            max_disk_bytes: None,
            accel: Accel::Kvm,
            ..spec()
        };
        assert!(!kvm.cmdline().contains("tsc_early_khz"));
        let debug = VmSpec {
            max_disk_bytes: None,
            kernel_args: vec!["loglevel=8".into(), "init=/x".into()],
            ..spec()
        };
        assert!(
            debug.cmdline().ends_with("tsc=reliable loglevel=8 init=/x"),
            "{}",
            debug.cmdline()
        );
    }

    #[test]
    fn only_a_step_with_a_network_gets_the_egress_port() {
        let a = spec().args().join(" ");
        assert!(!a.contains("egress"), "{a}");
        assert_eq!(a.matches("virtserialport").count(), 1, "{a}");
        let s = VmSpec {
            max_disk_bytes: None,
            egress_socket: Some("/s/egress.sock".into()),
            ..spec()
        };
        let a = s.args().join(" ");
        assert!(
            a.contains(
                "-chardev socket,id=egress,path=/s/egress.sock,server=on,wait=off \
                 -device virtserialport,chardev=egress,name=org.kiln.egress.0"
            ),
            "{a}"
        );
        // On the one virtio-serial-device: no new virtio-mmio transport.
        assert_eq!(a.matches("virtio-serial-device").count(), 1, "{a}");
    }

    #[test]
    fn a_jailed_qemu_is_named_its_descriptors_and_keeps_its_sandbox() {
        use std::os::fd::AsRawFd;
        let null = || -> std::os::fd::OwnedFd { std::fs::File::open("/dev/null").unwrap().into() };
        let s = VmSpec {
            max_disk_bytes: None,
            accel: Accel::Kvm,
            disk: "/s,x/disk.qcow2".into(),
            egress_socket: Some("/s/egress.sock".into()),
            ro_disks: vec!["/c/lower.ext4".into()],
            rw_disks: vec!["/c/cache.ext4".into()],
            ..spec()
        };
        let mut h = crate::jail::Handed::default();
        for p in [
            &s.kernel,
            &s.initramfs,
            &s.memory_file,
            &s.disk,
            &s.serial_log,
            &s.ro_disks[0],
            &s.rw_disks[0],
        ] {
            h.files.insert(p.clone(), null());
        }
        h.files.insert("/b/base.raw".into(), null());
        h.backing = Some("/b/base.raw".into());
        for p in [&s.qmp_socket, &s.guest_socket] {
            h.sockets.insert(p.clone(), null());
        }
        h.sockets.insert("/s/egress.sock".into(), null());
        h.kvm = Some(null());
        let fd = |p: &str| h.files[Path::new(p)].as_raw_fd();
        let sock = |p: &str| h.sockets[Path::new(p)].as_raw_fd();
        let a = s.args_named(Some(&h));
        let name = a
            .windows(2)
            .find(|w| w[0] == "-name")
            .map(|w| w[1].clone())
            .expect("-name");
        // No argument but -name's names a host path: QEMU opens only what it was handed.
        for arg in a.iter().filter(|x| **x != name) {
            for p in ["/s/", "/s,x/", "/k/", "/c/", "/b/"] {
                assert!(!arg.contains(p), "{arg} names {p}");
            }
        }
        let j = a.join(" ");
        assert!(
            j.contains(&format!("-kernel /proc/self/fd/{}", fd("/k/vmlinux"))),
            "{j}"
        );
        assert!(
            j.contains(&format!("mem-path=/proc/self/fd/{},share=on", fd("/s/mem"))),
            "{j}"
        );
        assert!(
            j.contains(&format!(
                "file=/proc/self/fd/{},format=qcow2,if=none,id=disk0,readonly=off,\
                 backing.file.filename=/proc/self/fd/{}",
                fd("/s,x/disk.qcow2"),
                fd("/b/base.raw")
            )),
            "{j}"
        );
        assert!(
            j.contains(&format!(
                "-serial file:/proc/self/fd/{}",
                fd("/s/console.log")
            )),
            "{j}"
        );
        assert!(
            j.contains(&format!(
                "-chardev socket,id=qmp,fd={},server=on,wait=off -mon chardev=qmp,mode=control",
                sock("/s/qmp.sock")
            )),
            "{j}"
        );
        assert!(
            j.contains(&format!(
                "-chardev socket,id=egress,fd={},server=on,wait=off",
                sock("/s/egress.sock")
            )),
            "{j}"
        );
        assert!(
            j.contains("-accel kvm,device=/dev/fdset/1 -M microvm")
                && j.contains(&format!(
                    "-add-fd fd={},set=1",
                    h.kvm.as_ref().unwrap().as_raw_fd()
                )),
            "{j}"
        );
        assert!(!j.contains("-qmp"), "{j}");
        // The cache disk: read-write, after the read-only one, with its serial; the root
        // disk named `upper`.
        assert!(
            j.contains(&format!(
                "id=lower0,readonly=on -device virtio-blk-device,drive=lower0,serial=lower0 \
                 -drive file=/proc/self/fd/{},format=raw,if=none,id=cache0,readonly=off \
                 -device virtio-blk-device,drive=cache0,serial=cache0",
                fd("/c/cache.ext4")
            )) && j.contains("drive=disk0,serial=upper"),
            "{j}"
        );
        // The sandbox is the same.
        assert!(j.contains(&format!("-sandbox {SANDBOX}")), "{j}");
        // -name lists every path (commas doubled), so kiln still finds the QEMU by them.
        assert!(
            name.starts_with("guest=kiln qmp=/s/qmp.sock channel=/s/guest.sock"),
            "{name}"
        );
        for p in [
            " disk=/s,,x/disk.qcow2",
            " memory=/s/mem",
            " backing=/b/base.raw",
            " lower0=/c/lower.ext4",
            " cache0=/c/cache.ext4",
            " egress=/s/egress.sock",
            " serial=/s/console.log",
        ] {
            assert!(name.contains(p), "{p} in {name}");
        }
        // The same devices in the same order as with paths.
        let devices = |a: &[String]| -> Vec<String> {
            a.windows(2)
                .filter(|w| w[0] == "-device")
                .map(|w| w[1].clone())
                .collect()
        };
        assert_eq!(devices(&a), devices(&s.args()));
    }

    #[test]
    fn clone_args_map_the_file_private_and_wait_for_incoming() {
        let s = VmSpec {
            max_disk_bytes: None,
            memory_mode: MemoryMode::Private,
            incoming: true,
            ..spec()
        };
        let a = s.args();
        let j = a.join(" ");
        assert!(j.contains("share=off,readonly=on,rom=off"), "{j}");
        assert!(!j.contains("share=on"), "{j}");
        assert!(j.ends_with("-S -incoming defer"), "{j}");
        // Same devices in the same order as the boot run.
        let devices = |a: &[String]| -> Vec<String> {
            a.windows(2)
                .filter(|w| w[0] == "-device")
                .map(|w| w[1].clone())
                .collect()
        };
        assert_eq!(devices(&a), devices(&spec().args()));
    }
}
