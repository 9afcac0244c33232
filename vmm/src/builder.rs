//! The per-host builder snapshot (issue 32): a build step's VM restored from a snapshot kiln
//! made of itself, instead of a cold boot per step.
//!
//! **The snapshot** ([`ensure`]). One QEMU booted with the fixed device set of a
//! [`BuilderShape`] (the upper disk, [`BuilderShape::ro_disks`] read-only disks with the
//! serials `lower<i>`, [`BuilderShape::rw_disks`] read-write disks with the serials
//! `cache<i>`, the guest channel and the egress port), the shape's RAM and vCPUs, and
//! `kiln.step=wait kiln.egress` on its command line: the guest init loads its modules, opens
//! its port, says `hello` and waits, having mounted none of the disks (only the kernel's
//! probe read their first blocks). Every disk is then a sparse placeholder of
//! [`PLACEHOLDER_BYTES`], so the capacity the guest's kernel reads at probe, and keeps, is
//! at least that of any file bound later. It is paused and saved as the image snapshots
//! are ([`crate::snapshot::save_vmstate`]: `x-ignore-shared`, the RAM staying in its memory
//! file). Files under `<cache>/builder-<key hash>/`: `memory` (the RAM) and `vmstate` (0444),
//! `snapshot.json` (the [`BuilderKey`], the vmstate's sha256 and the memory file's size),
//! written last. The key is the accelerator probe's ([`crate::launch::ProbeKey`]: the host's
//! boot, the QEMU binary, `/dev/kvm`) with the kernel's and the initramfs' sha256, the
//! accelerator, the host's TSC kHz (on the command line under TCG), the shape and the machine
//! with its firmware ([`crate::launch::MACHINE`]). Made under
//! an exclusive lock (`<cache>/builder.lock`), so two builds never race; a directory whose
//! `snapshot.json` is missing, unreadable, of another key, or disagrees with its files
//! (the vmstate's digest, the memory file's size) is removed and made again, never used;
//! those of an earlier boot of the host, which can never match again, are removed. A
//! failure to make one is remembered for [`FAILED_RETRY`] (`builder-<key hash>.failed`).
//!
//! **A step** ([`restore`], then [`start_step`]). QEMU starts with the same command line
//! ([`builder_spec`]: one function for the snapshot's boot and every restore) and `-incoming
//! defer`, its RAM the memory file mapped private (copy-on-write: the file never changes),
//! its drives the step's own files, each unused slot a small placeholder of its own;
//! [`crate::clone::resume_incoming`] restores it as clones are restored. Then, on the guest
//! channel, the `restore` clones get ([`crate::clone::fresh_restore`]: 32 fresh bytes the
//! guest adds to its entropy pool and reseeds from, and the time), and `mount_step`: the
//! guest drops every disk's cached blocks (`BLKFLSBUF`) and mounts the step's root as at a
//! cold boot. Why placeholders larger than the step's files rather than `block_resize`:
//! QEMU 10.0 refuses `block_resize` on a read-only drive ("Image is read-only", measured
//! here), and a lower disk must stay read-only. A guest that sees a larger capacity than its
//! file reads nothing past the file system, which is never larger than its file, and QEMU
//! refuses any request past the file's end (virtio-blk checks each request against the
//! drive's length). A step whose shape does not fit ([`BuilderShape::fits`]) is booted cold
//! by its caller.
//!
//! Isolation: each step's VM is a new QEMU from the same saved state; nothing one step's
//! guest writes (memory, its tmpfs, its disks' caches) reaches the file the next step
//! restores from.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln_guest::protocol::{Message, MountStep, Restored};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::channel::{ChannelError, GuestChannel};
use crate::launch::{self, Accel, DiskFormat, Host, LaunchError, MemoryMode, Vm, VmSpec, io_err};
use crate::qmp::QmpError;
use crate::snapshot::BootAssets;

/// The size of every disk slot's placeholder in the builder snapshot, bytes (1 TiB, sparse):
/// the capacity the guest keeps for each slot, so the largest step file a slot takes.
pub const PLACEHOLDER_BYTES: u64 = 1 << 40;

/// How long a failure to make the builder snapshot of a key is remembered (10 min): until
/// then [`ensure`] answers that failure at once (steps boot cold) instead of booting again.
/// An initramfs whose init predates `kiln.step=wait` powers the builder VM off at boot,
/// which every build would otherwise pay for (about 5 s under TCG here).
pub const FAILED_RETRY: Duration = Duration::from_secs(600);

/// The size of an unused slot's placeholder at a step's restore, bytes (1 MiB, sparse).
const UNUSED_SLOT_BYTES: u64 = 1 << 20;

/// Errors of the builder snapshot.
#[derive(Debug, thiserror::Error)]
pub enum BuilderError {
    /// Starting or driving QEMU failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// QMP failed (the save or the restore).
    #[error("QMP: {0}")]
    Qmp(#[from] QmpError),
    /// The guest channel failed.
    #[error("builder VM: {what}: {source}\n{console}")]
    Guest {
        /// What was being done.
        what: String,
        /// Why.
        source: ChannelError,
        /// The guest's console ([`launch::console_report`]).
        console: String,
    },
    /// The guest answered something else.
    #[error("builder VM: {what}: the guest answered {got}")]
    Unexpected {
        /// What was being done.
        what: String,
        /// What came.
        got: String,
    },
}

/// The fixed shape of a builder VM: what the snapshot has, so the most a step restored from
/// it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuilderShape {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM, bytes (a multiple of 1 MiB).
    pub memory_bytes: u64,
    /// Read-only disk slots (serials `lower0` …): a step's lower layers and bind trees.
    pub ro_disks: usize,
    /// Read-write disk slots (serials `cache0` …): a step's cache disks.
    pub rw_disks: usize,
}

/// The disks of one step, bound to a builder VM's slots at its restore.
#[derive(Debug, Clone)]
pub struct StepDisks {
    /// The upper disk (serial `upper`).
    pub upper: PathBuf,
    /// Read-only disks, in slot order (`lower<i>`).
    pub ro: Vec<PathBuf>,
    /// Read-write disks, in slot order (`cache<i>`).
    pub rw: Vec<PathBuf>,
}

impl BuilderShape {
    /// Whether a step VM of `memory_bytes` of RAM and `vcpus` with `disks` fits this shape:
    /// `Ok`, or why not (its caller then boots it cold). Each disk must be at most
    /// [`PLACEHOLDER_BYTES`].
    pub fn fits(&self, memory_bytes: u64, vcpus: u32, disks: &StepDisks) -> Result<(), String> {
        if memory_bytes > self.memory_bytes {
            return Err(format!(
                "the step's VM needs {} MiB, the builder snapshot has {} MiB",
                memory_bytes >> 20,
                self.memory_bytes >> 20
            ));
        }
        if vcpus != self.vcpus {
            return Err(format!(
                "{vcpus} vCPUs, the builder snapshot has {}",
                self.vcpus
            ));
        }
        if disks.ro.len() > self.ro_disks || disks.rw.len() > self.rw_disks {
            return Err(format!(
                "{} read-only and {} read-write disks, the builder snapshot has {} and {}",
                disks.ro.len(),
                disks.rw.len(),
                self.ro_disks,
                self.rw_disks
            ));
        }
        for d in std::iter::once(&disks.upper)
            .chain(&disks.ro)
            .chain(&disks.rw)
        {
            let len = std::fs::metadata(d).map_err(|e| format!("{}: {e}", d.display()))?;
            if len.len() > PLACEHOLDER_BYTES {
                return Err(format!(
                    "{} is larger than a builder slot ({PLACEHOLDER_BYTES} bytes)",
                    d.display()
                ));
            }
        }
        Ok(())
    }
}

/// What a builder snapshot depends on; see the module doc.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuilderKey {
    /// The accelerator probe's key (host boot, QEMU binary, `/dev/kvm`), its `guest` naming
    /// the kernel's and initramfs' sha256.
    pub probe: launch::ProbeKey,
    /// The accelerator.
    pub accel: Accel,
    /// The host's TSC kHz (on the command line under TCG).
    pub tsc_khz: Option<u64>,
    /// The shape.
    pub shape: BuilderShape,
    /// [`PLACEHOLDER_BYTES`].
    pub placeholder_bytes: u64,
    /// The machine and its firmware ([`launch::MACHINE`]): a snapshot made under another
    /// firmware does not restore (its ROM is in the migration stream), so a kiln that
    /// changed them makes the snapshot again instead of booting every step cold.
    pub machine: String,
}

/// What `snapshot.json` holds.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    key: BuilderKey,
    vmstate_sha256: String,
    memory_bytes: u64,
}

/// A builder snapshot on this host, ready to restore.
#[derive(Debug, Clone)]
pub struct BuilderSnapshot {
    /// Its shape.
    pub shape: BuilderShape,
    accel: Accel,
    boot: BootAssets,
    memory: PathBuf,
    vmstate: PathBuf,
}

/// The one command line of a builder VM: the snapshot's boot (`memory` shared, no
/// `-incoming`) and every step's restore (`memory` private, `-incoming defer`), with the
/// sockets and console in `dir` and `disks` bound to the slots (unused slots: `unused`).
#[allow(clippy::too_many_arguments)]
fn builder_spec(
    host: &Host,
    accel: Accel,
    boot: &BootAssets,
    shape: &BuilderShape,
    memory: &Path,
    restoring: bool,
    dir: &Path,
    disks: &StepDisks,
    unused: &dyn Fn(&str) -> PathBuf,
) -> VmSpec {
    let slots = |files: &[PathBuf], n: usize, kind: &str| -> Vec<PathBuf> {
        (0..n)
            .map(|i| {
                files
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| unused(&format!("{kind}{i}")))
            })
            .collect()
    };
    VmSpec {
        accel,
        vcpus: shape.vcpus,
        memory_bytes: shape.memory_bytes,
        kernel: boot.kernel.clone(),
        initramfs: boot.initramfs.clone(),
        memory_file: memory.to_path_buf(),
        memory_mode: if restoring {
            MemoryMode::Private
        } else {
            MemoryMode::Shared
        },
        disk: disks.upper.clone(),
        disk_format: DiskFormat::Raw,
        ro_disks: slots(&disks.ro, shape.ro_disks, "lower"),
        rw_disks: slots(&disks.rw, shape.rw_disks, "cache"),
        qmp_socket: dir.join("qmp.sock"),
        guest_socket: dir.join("guest.sock"),
        egress_socket: Some(dir.join("egress.sock")),
        serial_log: dir.join("console.log"),
        incoming: restoring,
        tsc_khz: host.tsc_khz,
        kernel_args: vec!["kiln.step=wait".into(), "kiln.egress".into()],
        max_disk_bytes: None,
    }
}

/// The sha256 of the file at `path`, lowercase hex.
fn file_sha256(path: &Path) -> Result<String, LaunchError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io_err(path))?;
    Ok(hex::encode(h.finalize()))
}

/// A sparse file of `bytes` at `path`.
fn sparse(path: &Path, bytes: u64) -> Result<(), LaunchError> {
    std::fs::File::create(path)
        .and_then(|f| f.set_len(bytes))
        .map_err(io_err(path))
}

/// The builder snapshot of `shape` for `boot` on this host under `cache`, made when missing,
/// stale or inconsistent (module doc), under the lock `<cache>/builder.lock`; `None` when
/// this host's key cannot be read (nothing is cached then: the caller boots cold).
///
/// Errors: making it failed ([`BuilderError`]).
pub async fn ensure(
    host: &Host,
    accel: Accel,
    boot: &BootAssets,
    shape: BuilderShape,
    cache: &Path,
    timeout: Duration,
) -> Result<Option<BuilderSnapshot>, BuilderError> {
    let (k, i) = {
        let (k, i) = (boot.kernel.clone(), boot.initramfs.clone());
        tokio::task::spawn_blocking(move || {
            Ok::<_, LaunchError>((file_sha256(&k)?, file_sha256(&i)?))
        })
        .await
        .map_err(|e| LaunchError::Host(e.to_string()))??
    };
    let Some(probe) = launch::ProbeKey::current(host, &format!("kernel={k} initramfs={i}")) else {
        return Ok(None);
    };
    let key = BuilderKey {
        probe,
        accel,
        tsc_khz: host.tsc_khz,
        shape,
        placeholder_bytes: PLACEHOLDER_BYTES,
        machine: launch::MACHINE.into(),
    };
    // Serializing strings and integers cannot fail.
    let key_json = serde_json::to_vec(&key).unwrap_or_default();
    let name = format!("builder-{}", &hex::encode(Sha256::digest(&key_json))[..16]);
    std::fs::create_dir_all(cache).map_err(io_err(cache))?;
    let _lock = launch::lock_file(&cache.join("builder.lock")).await?;
    let dir = cache.join(&name);
    let snap = BuilderSnapshot {
        shape,
        accel,
        boot: boot.clone(),
        memory: dir.join("memory"),
        vmstate: dir.join("vmstate"),
    };
    remove_other_boots(cache, &name, &key.probe.boot_id);
    if valid(&dir, &key) {
        return Ok(Some(snap));
    }
    let failed = cache.join(format!("{name}.failed"));
    if let Ok(md) = std::fs::metadata(&failed)
        && md
            .modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|a| a < FAILED_RETRY)
    {
        let reason = std::fs::read_to_string(&failed).unwrap_or_default();
        return Err(LaunchError::Host(format!(
            "making the builder snapshot failed less than {} s ago ({}): {reason}",
            FAILED_RETRY.as_secs(),
            failed.display()
        ))
        .into());
    }
    if dir.exists() {
        tracing::info!(dir = %dir.display(), "builder snapshot stale or inconsistent: making it again");
        std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    }
    let tmp = cache.join(format!("{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    let t0 = std::time::Instant::now();
    let made = make(host, accel, boot, &shape, &tmp, timeout).await;
    let record = made.and_then(|()| {
        let memory = tmp.join("memory");
        let vmstate_sha256 = file_sha256(&tmp.join("vmstate"))?;
        let rec = Record {
            key: key.clone(),
            vmstate_sha256,
            memory_bytes: shape.memory_bytes,
        };
        // Read-only for all: a jailed QEMU reopens each through `/proc/self/fd/<n>`, which
        // checks the file's mode against its own uid.
        use std::os::unix::fs::PermissionsExt;
        for f in [&memory, &tmp.join("vmstate")] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o444))
                .map_err(io_err(f))?;
        }
        let at = tmp.join("snapshot.json");
        std::fs::write(&at, serde_json::to_vec_pretty(&rec).unwrap_or_default())
            .map_err(io_err(&at))?;
        std::fs::rename(&tmp, &dir).map_err(io_err(&dir))?;
        Ok(())
    });
    if let Err(e) = record {
        let _ = std::fs::remove_dir_all(&tmp);
        let _ = std::fs::write(&failed, e.to_string());
        return Err(e.into());
    }
    let _ = std::fs::remove_file(&failed);
    tracing::info!(took = ?t0.elapsed(), dir = %dir.display(), "builder snapshot made");
    Ok(Some(snap))
}

/// Removes the builder snapshots in `cache` other than `keep` that were made in another
/// boot of this host than `boot_id` (their key can never match again), or are unreadable,
/// and the temporary directories of makes that died. Called under the lock. Snapshots of
/// this boot with another key stay: another shape (vCPUs), or another kiln on this host.
fn remove_other_boots(cache: &Path, keep: &str, boot_id: &str) {
    let Ok(rd) = std::fs::read_dir(cache) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("builder-") || name == keep || name == format!("{keep}.failed") {
            continue;
        }
        if !e.path().is_dir() {
            // Another key's failure marker: that key may be tried again.
            let _ = std::fs::remove_file(e.path());
            continue;
        }
        let stale = name.ends_with(".tmp")
            || std::fs::read(e.path().join("snapshot.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<Record>(&b).ok())
                .is_none_or(|r| r.key.probe.boot_id != boot_id);
        if stale {
            tracing::info!(dir = %e.path().display(), "removing a stale builder snapshot");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Whether `dir` holds a whole builder snapshot of `key` (module doc).
fn valid(dir: &Path, key: &BuilderKey) -> bool {
    let Ok(bytes) = std::fs::read(dir.join("snapshot.json")) else {
        return false;
    };
    let Ok(rec) = serde_json::from_slice::<Record>(&bytes) else {
        return false;
    };
    rec.key == *key
        && std::fs::metadata(dir.join("memory")).is_ok_and(|m| m.len() == rec.memory_bytes)
        && file_sha256(&dir.join("vmstate")).is_ok_and(|d| d == rec.vmstate_sha256)
}

/// Boots the builder VM in `dir` (made here), waits for its `hello`, saves it.
async fn make(
    host: &Host,
    accel: Accel,
    boot: &BootAssets,
    shape: &BuilderShape,
    dir: &Path,
    timeout: Duration,
) -> Result<(), LaunchError> {
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(dir)
        .map_err(io_err(dir))?;
    let slot = |name: &str| dir.join(format!("{name}.placeholder"));
    let disks = StepDisks {
        upper: slot("upper"),
        ro: Vec::new(),
        rw: Vec::new(),
    };
    let memory = dir.join("memory");
    sparse(&memory, shape.memory_bytes)?;
    let spec = builder_spec(host, accel, boot, shape, &memory, false, dir, &disks, &slot);
    for d in std::iter::once(&spec.disk)
        .chain(&spec.ro_disks)
        .chain(&spec.rw_disks)
    {
        sparse(d, PLACEHOLDER_BYTES)?;
    }
    let vmstate = dir.join("vmstate");
    let mut vm = Vm::spawn_with(
        host,
        &spec,
        &dir.join("qemu.log"),
        timeout,
        true,
        &[(vmstate.as_path(), crate::jail::Access::Create)],
    )
    .await?;
    let hello = async {
        let mut ch = GuestChannel::connect(&spec.guest_socket, timeout).await?;
        ch.recv_significant("hello", timeout).await
    }
    .await;
    match hello {
        Ok(Message::Hello(_)) => {}
        Ok(m) => {
            return Err(LaunchError::Host(format!(
                "builder VM answered {} instead of hello",
                m.type_name()
            )));
        }
        Err(e) => {
            return Err(LaunchError::Host(format!(
                "builder VM: waiting for hello: {e}\n{}",
                launch::console_report(&spec.serial_log)
            )));
        }
    }
    crate::snapshot::save_vmstate(&mut vm, &vmstate).await?;
    vm.quit().await;
    // Only the memory file and the vmstate are kept.
    let sockets = [&spec.qmp_socket, &spec.guest_socket, &spec.serial_log];
    for d in std::iter::once(&spec.disk)
        .chain(&spec.ro_disks)
        .chain(&spec.rw_disks)
        .chain(sockets)
        .chain(spec.egress_socket.as_ref())
    {
        let _ = std::fs::remove_file(d);
    }
    let _ = std::fs::remove_file(dir.join("qemu.log"));
    Ok(())
}

/// QEMU restored from `snap` in `dir` (the step's scratch directory, where the sockets, the
/// console log and the unused slots' placeholders go) with `disks` bound to its slots, with
/// `stderr_log`; running (after `cont`), its guest waiting for [`start_step`]. The returned
/// spec names its sockets and console. QEMU is tied to the calling thread as a cold step
/// VM's is.
///
/// Errors: QEMU's start or the restore ([`BuilderError`]).
pub async fn restore(
    host: &Host,
    snap: &BuilderSnapshot,
    dir: &Path,
    disks: &StepDisks,
    stderr_log: &Path,
    timeout: Duration,
) -> Result<(Vm, VmSpec), BuilderError> {
    let unused = |name: &str| dir.join(format!("{name}.unused"));
    let spec = builder_spec(
        host,
        snap.accel,
        &snap.boot,
        &snap.shape,
        &snap.memory,
        true,
        dir,
        disks,
        &unused,
    );
    for i in disks.ro.len()..snap.shape.ro_disks {
        sparse(&unused(&format!("lower{i}")), UNUSED_SLOT_BYTES)?;
    }
    for i in disks.rw.len()..snap.shape.rw_disks {
        sparse(&unused(&format!("cache{i}")), UNUSED_SLOT_BYTES)?;
    }
    let mut vm = Vm::spawn_with(
        host,
        &spec,
        stderr_log,
        timeout,
        true,
        &[(snap.vmstate.as_path(), crate::jail::Access::Read)],
    )
    .await?;
    crate::clone::resume_incoming(&mut vm, &snap.vmstate, timeout).await?;
    Ok((vm, spec))
}

/// On a restored builder VM's guest channel `ch`: `restore` (fresh entropy and the time,
/// [`crate::clone::fresh_restore`]), then `mount_step` with `lowers` read-only disks and the
/// egress listener when `egress`. Returns the guest's `restored` (its `random`: 16 bytes it
/// read after the reseed).
///
/// Errors: the channel, or an answer other than `restored` / `step_mounted`
/// ([`BuilderError`]; a guest `error` says why).
pub async fn start_step(
    ch: &mut GuestChannel,
    lowers: usize,
    egress: bool,
    timeout: Duration,
    console: &Path,
) -> Result<Restored, BuilderError> {
    let guest = |what: &str| {
        let what = what.to_string();
        move |source| BuilderError::Guest {
            what,
            source,
            console: launch::console_report(console),
        }
    };
    let unexpected = |what: &str, m: Message| BuilderError::Unexpected {
        what: what.into(),
        got: match m {
            Message::Error(e) => format!("error ({})", e.message),
            m => m.type_name().into(),
        },
    };
    ch.send(&Message::Restore(crate::clone::fresh_restore(Vec::new())?))
        .await
        .map_err(guest("sending restore"))?;
    let restored = match ch
        .recv_significant("restored", timeout)
        .await
        .map_err(guest("waiting for restored"))?
    {
        Message::Restored(r) => r,
        m => return Err(unexpected("restore", m)),
    };
    ch.send(&Message::MountStep(MountStep {
        lowers: lowers as u32,
        egress,
    }))
    .await
    .map_err(guest("sending mount_step"))?;
    match ch
        .recv_significant("step_mounted", timeout)
        .await
        .map_err(guest("waiting for step_mounted"))?
    {
        Message::StepMounted(_) => Ok(restored),
        m => Err(unexpected("mount_step", m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of `boot_id` in `cache/name`.
    fn record(cache: &Path, name: &str, boot_id: &str) {
        let dir = cache.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let rec = Record {
            key: BuilderKey {
                probe: launch::ProbeKey {
                    boot_id: boot_id.into(),
                    qemu_path: "/usr/bin/qemu-system-x86_64".into(),
                    qemu_size: 1,
                    qemu_mtime: (0, 0),
                    qemu_version: "10.0.2".into(),
                    kvm: None,
                    guest: "kernel=k initramfs=i".into(),
                },
                accel: Accel::Tcg,
                tsc_khz: None,
                shape: BuilderShape {
                    vcpus: 1,
                    memory_bytes: 128 << 20,
                    ro_disks: 1,
                    rw_disks: 0,
                },
                placeholder_bytes: PLACEHOLDER_BYTES,
                machine: launch::MACHINE.into(),
            },
            vmstate_sha256: String::new(),
            memory_bytes: 0,
        };
        std::fs::write(dir.join("snapshot.json"), serde_json::to_vec(&rec).unwrap()).unwrap();
    }

    #[test]
    fn snapshots_of_other_boots_and_dead_makes_are_removed_others_stay() {
        let t = tempfile::tempdir().unwrap();
        let c = t.path();
        record(c, "builder-keep", "now");
        record(c, "builder-othershape", "now");
        record(c, "builder-oldboot", "before");
        std::fs::create_dir_all(c.join("builder-broken")).unwrap();
        std::fs::create_dir_all(c.join("builder-x.tmp")).unwrap();
        std::fs::write(c.join("builder-keep.failed"), "mine").unwrap();
        std::fs::write(c.join("builder-other.failed"), "theirs").unwrap();
        std::fs::write(c.join("builder.lock"), "").unwrap();
        std::fs::create_dir_all(c.join("0123abcd")).unwrap();
        remove_other_boots(c, "builder-keep", "now");
        let mut left: Vec<String> = std::fs::read_dir(c)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "0123abcd",
                "builder-keep",
                "builder-keep.failed",
                "builder-othershape",
                "builder.lock"
            ]
        );
    }

    #[test]
    fn a_step_fits_the_shape_or_says_why_not() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("d");
        sparse(&f, 64 << 20).unwrap();
        let shape = BuilderShape {
            vcpus: 1,
            memory_bytes: 1152 << 20,
            ro_disks: 2,
            rw_disks: 1,
        };
        let disks = |ro: usize, rw: usize| StepDisks {
            upper: f.clone(),
            ro: vec![f.clone(); ro],
            rw: vec![f.clone(); rw],
        };
        assert_eq!(shape.fits(1152 << 20, 1, &disks(2, 1)), Ok(()));
        assert!(
            shape
                .fits(1153 << 20, 1, &disks(0, 0))
                .unwrap_err()
                .contains("MiB")
        );
        assert!(
            shape
                .fits(128 << 20, 2, &disks(0, 0))
                .unwrap_err()
                .contains("vCPUs")
        );
        assert!(
            shape
                .fits(128 << 20, 1, &disks(3, 0))
                .unwrap_err()
                .contains("disks")
        );
        assert!(
            shape
                .fits(128 << 20, 1, &disks(0, 2))
                .unwrap_err()
                .contains("disks")
        );
        let big = t.path().join("big");
        sparse(&big, PLACEHOLDER_BYTES + 1).unwrap();
        let over = StepDisks {
            upper: big,
            ro: vec![],
            rw: vec![],
        };
        assert!(
            shape
                .fits(128 << 20, 1, &over)
                .unwrap_err()
                .contains("larger")
        );
    }
}
