//! QEMU jailed as Firecracker's jailer does it (issue 37): a user of its own, a mount and a pid
//! namespace of its own with a private read-only root ([`spawn`], [`root`]), `-sandbox on`.
//!
//! When kiln runs as root, every QEMU it starts ([`crate::launch::Vm::spawn`]: build steps'
//! VMs, the boot-once snapshot VM, clones, lazy clones, the accelerator probe) runs as an
//! unprivileged uid and gid, chosen per VM ([`QemuUsers`]). The child drops to it between
//! clone and exec ([`spawn`]: `setgroups(0)`, `setresgid`, `setresuid`, then
//! `PR_SET_PDEATHSIG`, which a change of uid clears, prctl(2)). Measured against the alternative, QEMU 10.0's own
//! `-run-with user=`: QEMU installs its `-sandbox` seccomp filter before it drops, and
//! `elevateprivileges=deny` (kept, [`crate::launch::SANDBOX`]) forbids `setuid`, so that
//! QEMU dies of `SIGSYS` ("Bad system call"; so does `elevateprivileges=children`). Dropping
//! before exec also means no guest code ever runs while QEMU is root, whereas `-run-with`
//! drops only at the end of QEMU's start.
//!
//! ## What the unprivileged QEMU can open
//! Nothing by path but what the launcher hands it. kiln's directories stay root's, and no
//! directory is made searchable for the VM's user: the directories that hold a VM's own files
//! are 0700 (a step VM's scratch directory, a clone's directory, the boot-once run's
//! temporary directory), so not even its own uid reaches them by path, nor a later VM given
//! the same uid; the files go back to root when the VM's handle reaps it ([`Owned`]). Instead the launcher opens each file QEMU needs and passes the descriptor
//! (`O_PATH`, close-on-exec cleared in the child only), and QEMU's command line names it
//! `/proc/self/fd/<n>`: opening that magic link reopens the very file without walking its
//! directories, and still checks the file's own mode against QEMU's uid (proc(5),
//! `/proc/pid/fd`). So:
//! - read-only inputs (kernel, initramfs, a clone's memory file and vmstate, the disk an
//!   overlay is backed by, a step's lower disks) must be readable by others, as kiln
//!   writes them (0644; the lazy chunk server's files are 0444 with `allow_other`);
//! - the VM's own writable files (its disk or overlay, a step's cache disks, a boot-once
//!   memory file, the console log, a vmstate to write) are chowned to the VM's uid and gid, mode 0600;
//! - sockets (QMP, the guest channel, the egress port) are bound and listened on by the
//!   launcher, as root, at the same paths, and passed as listening descriptors
//!   (`-chardev socket,fd=<n>,server=on`);
//! - `/dev/kvm` (0600 root here) is passed opened read-write through QEMU's fd sets
//!   (`-add-fd fd=<n>,set=1`, `-accel kvm,device=/dev/fdset/1`): qemu_open dups a set's
//!   descriptor instead of reopening it.
//!
//! A qcow2 overlay names its backing file by path in its header (qemu-img writes the
//! absolute path); QEMU would open it as the VM's user by that path, so the launcher reads it
//! from the header ([`qcow2_backing`]) and overrides it on the command line
//! (`backing.file.filename=/proc/self/fd/<n>`).
//!
//! QEMU's command line still names every file and socket by its absolute path, in its
//! `-name` ([`crate::launch::VmSpec::args_named`]), because kiln finds its QEMUs by what
//! their command lines name (`clone::qemus_in`, the lazy server's watcher, the tests).
//!
//! ## Which uid
//! Per VM, from a range ([`DEFAULT_UID_FIRST`]…, [`DEFAULT_UID_COUNT`] of them; or
//! `KILN_QEMU_USER=FIRST-LAST`), gid = uid. Per VM because a QEMU taken over by its guest
//! can `ptrace`, signal and read `/proc/<pid>/mem` of every other process of its uid: one
//! shared uid would hand it every other tenant's QEMU, their guest memory included. With a
//! uid of its own it reaches nothing it was not handed. A uid is free when no process runs
//! as it (every `/proc/<pid>/status` `Uid:` field is read); the choice and the start of the
//! QEMU that takes it are done under one host-wide lock ([`UID_LOCK`]), so two starts never
//! pick the same uid. `KILN_QEMU_USER=UID:GID` runs every QEMU as one shared user instead
//! (for hosts that must name it in their own policies), with the weaker isolation above.
//! When kiln does not run as root, QEMU runs as kiln's own user, as before.

pub mod cgroup;
pub mod root;
pub mod spawn;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use crate::launch::{LaunchError, MemoryMode, VmSpec, io_err};

/// The first uid (and gid) of the default per-VM range: 0x70000000, in the range systemd's
/// `docs/UIDS-GIDS.md` leaves unused (1879048192…2147483647: above the container ranges,
/// below the 2^31 boundary that signed 32-bit uids break at).
pub const DEFAULT_UID_FIRST: u32 = 0x7000_0000;
/// How many uids the default range has (one per VM running at once on a host).
pub const DEFAULT_UID_COUNT: u32 = 65_536;
/// The host-wide lock held while a uid is chosen and its QEMU started (`flock(2)`, exclusive).
pub const UID_LOCK: &str = "/run/kiln/qemu-uid.lock";

/// The uid and gid one QEMU runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QemuUser {
    /// User id.
    pub uid: u32,
    /// Group id (no supplementary groups).
    pub gid: u32,
}

/// Which users QEMUs run as (`KILN_QEMU_USER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QemuUsers {
    /// A uid of its own per VM, `first..=last`, gid = uid (unset: [`DEFAULT_UID_FIRST`] and
    /// [`DEFAULT_UID_COUNT`] of them; `FIRST-LAST`).
    Range {
        /// First uid.
        first: u32,
        /// Last uid.
        last: u32,
    },
    /// One user for every QEMU (`UID:GID`).
    Shared(QemuUser),
}

impl QemuUsers {
    /// Parses `KILN_QEMU_USER`'s value (`FIRST-LAST` or `UID:GID`; empty: the default range).
    /// Uid or gid 0 is refused.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(QemuUsers::Range {
                first: DEFAULT_UID_FIRST,
                last: DEFAULT_UID_FIRST + (DEFAULT_UID_COUNT - 1),
            });
        }
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("{t:?} is not a uid or gid: {e}"))
        };
        let r = if let Some((a, b)) = s.split_once('-') {
            let (first, last) = (num(a)?, num(b)?);
            if first > last {
                return Err(format!("range {s:?}: {first} is above {last}"));
            }
            QemuUsers::Range { first, last }
        } else if let Some((u, g)) = s.split_once(':') {
            QemuUsers::Shared(QemuUser {
                uid: num(u)?,
                gid: num(g)?,
            })
        } else {
            return Err(format!("{s:?}: expected FIRST-LAST or UID:GID"));
        };
        let zero = match r {
            QemuUsers::Range { first, .. } => first == 0,
            QemuUsers::Shared(u) => u.uid == 0 || u.gid == 0,
        };
        if zero {
            return Err(format!("{s:?}: QEMU must not run as uid or gid 0"));
        }
        Ok(r)
    }

    /// From `KILN_QEMU_USER`.
    pub fn from_env() -> Result<Self, LaunchError> {
        Self::parse(&std::env::var("KILN_QEMU_USER").unwrap_or_default())
            .map_err(|e| LaunchError::Host(format!("KILN_QEMU_USER: {e}")))
    }
}

/// How QEMU uses a file the launcher hands it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read only: passed as it is (it must be readable by others).
    Read,
    /// Read and written by this VM only: chowned to the VM's user, mode 0600.
    Own,
    /// Written by this VM only, made empty first (a console log, a vmstate to write):
    /// created or truncated, chowned to the VM's user, mode 0600.
    Create,
}

/// The descriptors one jailed QEMU is started with, and how its command line names them.
#[derive(Debug, Default)]
pub(crate) struct Handed {
    /// Files, by the path the spec names them with.
    pub files: HashMap<PathBuf, OwnedFd>,
    /// Listening sockets, by path.
    pub sockets: HashMap<PathBuf, OwnedFd>,
    /// `/dev/kvm`, opened read-write.
    pub kvm: Option<OwnedFd>,
    /// The disk's qcow2 backing file (a key of `files`).
    pub backing: Option<PathBuf>,
    /// The files chowned to the VM's user, given back to root when dropped.
    pub owned: Owned,
}

/// Files chowned to a VM's user ([`Access::Own`], [`Access::Create`]). Dropping it gives them
/// back to root (`lchown` 0:0, mode kept; a file gone is skipped): once that VM's QEMU is
/// gone, a later VM that is given the same uid (uids are reused once no process runs as them)
/// owns nothing of this one's, its disk, memory file, console log or vmstate. A VM handle
/// ([`crate::launch::Vm`]) holds it until QEMU is reaped, and hands it over untouched to a
/// QEMU that outlives the handle (a clone, [`Owned::keep`]), whose directory `kiln stop`
/// removes.
#[derive(Debug, Default)]
pub struct Owned(Vec<PathBuf>);

impl Owned {
    /// Leaves the files to the VM's user: its QEMU keeps running without this handle.
    pub fn keep(&mut self) {
        self.0.clear();
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        for p in self.0.drain(..) {
            match std::os::unix::fs::lchown(&p, Some(0), Some(0)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "giving a VM's file back to root")
                }
            }
        }
    }
}

impl Handed {
    /// The descriptors whose close-on-exec the child clears.
    pub fn raw_fds(&self) -> Vec<RawFd> {
        self.files
            .values()
            .chain(self.sockets.values())
            .chain(self.kvm.iter())
            .map(|f| f.as_raw_fd())
            .collect()
    }

    /// What QEMU is to open for `path`: `/proc/self/fd/<n>` when it was handed over.
    pub fn file_name(&self, path: &Path) -> Option<String> {
        self.files
            .get(path)
            .map(|f| format!("/proc/self/fd/{}", f.as_raw_fd()))
    }

    /// The listening socket handed over for `path`.
    pub fn socket_fd(&self, path: &Path) -> Option<RawFd> {
        self.sockets.get(path).map(|f| f.as_raw_fd())
    }
}

/// Opens, creates, chowns and binds everything `spec` and `extra` make QEMU open, for
/// `user` (see the module doc).
pub(crate) fn hand_over(
    spec: &VmSpec,
    extra: &[(&Path, Access)],
    user: QemuUser,
) -> Result<Handed, LaunchError> {
    let mut h = Handed::default();
    let mut files: Vec<(&Path, Access)> = vec![
        (spec.kernel.as_path(), Access::Read),
        (spec.initramfs.as_path(), Access::Read),
        (spec.disk.as_path(), Access::Own),
        (spec.serial_log.as_path(), Access::Create),
    ];
    match spec.memory_mode {
        MemoryMode::Shared => files.push((spec.memory_file.as_path(), Access::Own)),
        MemoryMode::Private => files.push((spec.memory_file.as_path(), Access::Read)),
        MemoryMode::Anonymous => {}
    }
    files.extend(spec.ro_disks.iter().map(|d| (d.as_path(), Access::Read)));
    files.extend(spec.rw_disks.iter().map(|d| (d.as_path(), Access::Own)));
    let backing = match spec.disk_format {
        crate::launch::DiskFormat::Qcow2 => qcow2_backing(&spec.disk)?,
        crate::launch::DiskFormat::Raw => None,
    };
    if let Some(b) = &backing {
        files.push((b.as_path(), Access::Read));
    }
    files.extend(extra.iter().copied());
    for (path, access) in files {
        if h.files.contains_key(path) {
            continue;
        }
        if access != Access::Read {
            // Before the chown, so that a failure further on gives it back too.
            h.owned.0.push(path.to_path_buf());
        }
        h.files
            .insert(path.to_path_buf(), hand_file(path, access, user)?);
    }
    h.backing = backing;
    let mut sockets = vec![&spec.qmp_socket, &spec.guest_socket];
    sockets.extend(spec.egress_socket.iter());
    for s in sockets {
        h.sockets.insert(s.clone(), listen(s)?);
    }
    if spec.accel == crate::launch::Accel::Kvm {
        let kvm = Path::new("/dev/kvm");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(kvm)
            .map_err(io_err(kvm))?;
        h.kvm = Some(f.into());
    }
    Ok(h)
}

fn hand_file(path: &Path, access: Access, user: QemuUser) -> Result<OwnedFd, LaunchError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if access == Access::Create {
        std::fs::File::create(path).map_err(io_err(path))?;
    }
    if access != Access::Read {
        std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).map_err(io_err(path))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(path))?;
    }
    // O_PATH: a handle to reopen through /proc/self/fd, with QEMU's own flags and its uid's
    // permission (open(2)); it reads nothing itself (a FUSE file sees no open).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(path)
        .map_err(io_err(path))?;
    Ok(f.into())
}

/// Binds and listens on a unix socket at `path` (an old one there is removed first, as QEMU
/// itself did).
fn listen(path: &Path) -> Result<OwnedFd, LaunchError> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(path)(e)),
    }
    let l = std::os::unix::net::UnixListener::bind(path).map_err(io_err(path))?;
    Ok(l.into())
}

/// `RLIMIT_FSIZE` of the jailed QEMU that runs `spec`, bytes: the largest file it may
/// legitimately write (its disk at its largest: a raw disk's length, a qcow2 image's virtual
/// size or [`VmSpec::max_disk_bytes`], or a read-write disk's length ([`VmSpec::rw_disks`]); its memory file when shared, which a vmstate with the
/// guest's RAM in it does not exceed), plus 1/64 of that (qcow2 metadata) and 16 MiB (device
/// state). A QEMU taken over by its guest can then not fill the host's disk through the files
/// it was handed (its console and stderr logs among them; QMP's `pmemsave` writes any length),
/// as Firecracker's jailer bounds it with `--resource-limit fsize=`.
///
/// Errors: the disk unreadable.
pub fn file_size_limit(spec: &VmSpec) -> Result<u64, LaunchError> {
    let disk = match spec.disk_format {
        crate::launch::DiskFormat::Qcow2 => qcow2_virtual_size(&spec.disk)?,
        crate::launch::DiskFormat::Raw => std::fs::metadata(&spec.disk)
            .map_err(io_err(&spec.disk))?
            .len(),
    };
    let mut disk = disk.max(spec.max_disk_bytes.unwrap_or(0));
    for d in &spec.rw_disks {
        disk = disk.max(std::fs::metadata(d).map_err(io_err(d))?.len());
    }
    let memory = match spec.memory_mode {
        MemoryMode::Shared => spec.memory_bytes,
        MemoryMode::Private | MemoryMode::Anonymous => 0,
    };
    let big = disk.max(memory);
    Ok(big.saturating_add(big / 64).saturating_add(16 << 20))
}

/// The virtual size of the qcow2 image at `path`, bytes: `size` (u64, big-endian) at offset
/// 24 of the header (QEMU's `docs/interop/qcow2.txt`).
pub fn qcow2_virtual_size(path: &Path) -> Result<u64, LaunchError> {
    let (_, head) = qcow2_header(path)?;
    Ok(u64::from_be_bytes(
        head[24..32].try_into().unwrap_or_default(),
    ))
}

/// The qcow2 image at `path`, open, and the first 32 bytes of its header, its magic checked
/// (`QFI\xfb` at 0, QEMU's `docs/interop/qcow2.txt`).
fn qcow2_header(path: &Path) -> Result<(std::fs::File, [u8; 32]), LaunchError> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut head = [0u8; 32];
    f.read_exact_at(&mut head, 0).map_err(io_err(path))?;
    if head[..4] != *b"QFI\xfb" {
        return Err(LaunchError::Host(format!(
            "{}: not a qcow2 image (no QFI\\xfb magic)",
            path.display()
        )));
    }
    Ok((f, head))
}

/// The backing file named in the header of the qcow2 image at `path`, absolute (a relative
/// name is relative to the image's directory, as QEMU resolves it); `None` when it has none.
/// Header layout from QEMU's `docs/interop/qcow2.txt`: magic `QFI\xfb` at 0,
/// `backing_file_offset` (u64, big-endian) at 8, `backing_file_size` (u32) at 16; the name is
/// not NUL-terminated and at most 1023 bytes.
pub fn qcow2_backing(path: &Path) -> Result<Option<PathBuf>, LaunchError> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileExt;
    let (f, head) = qcow2_header(path)?;
    let off = u64::from_be_bytes(head[8..16].try_into().unwrap_or_default());
    let len = u32::from_be_bytes(head[16..20].try_into().unwrap_or_default());
    if off == 0 || len == 0 {
        return Ok(None);
    }
    if len > 1023 {
        return Err(LaunchError::Host(format!(
            "{}: qcow2 backing file name of {len} bytes (at most 1023)",
            path.display()
        )));
    }
    let mut name = vec![0u8; len as usize];
    f.read_exact_at(&mut name, off).map_err(io_err(path))?;
    let name = PathBuf::from(std::ffi::OsStr::from_bytes(&name));
    Ok(Some(if name.is_absolute() {
        name
    } else {
        path.parent().unwrap_or(Path::new("/")).join(name)
    }))
}

/// The uids some process runs as now (every field of each `/proc/<pid>/status` `Uid:`
/// line: real, effective, saved, file system; proc(5)).
fn uids_in_use() -> std::collections::HashSet<u32> {
    let mut used = std::collections::HashSet::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return used;
    };
    for e in rd.flatten() {
        if !e
            .file_name()
            .as_encoded_bytes()
            .iter()
            .all(u8::is_ascii_digit)
        {
            continue;
        }
        let Ok(s) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        if let Some(l) = s.lines().find(|l| l.starts_with("Uid:")) {
            used.extend(
                l[4..]
                    .split_whitespace()
                    .filter_map(|t| t.parse::<u32>().ok()),
            );
        }
    }
    used
}

/// A user chosen for one QEMU; for a per-VM range, holds [`UID_LOCK`] until dropped (after
/// the QEMU runs as that uid).
#[derive(Debug)]
pub(crate) struct Chosen {
    pub user: QemuUser,
    _lock: Option<std::fs::File>,
}

/// Chooses the user of the next QEMU (see the module doc), taking [`UID_LOCK`] for a range.
pub(crate) fn choose(users: QemuUsers) -> Result<Chosen, LaunchError> {
    let (first, last) = match users {
        QemuUsers::Shared(user) => return Ok(Chosen { user, _lock: None }),
        QemuUsers::Range { first, last } => (first, last),
    };
    let lock_path = Path::new(UID_LOCK);
    if let Some(dir) = lock_path.parent() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir))?;
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path)
        .map_err(io_err(lock_path))?;
    // SAFETY: flock(2) on a descriptor we own; held for the length of a fork and exec.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io_err(lock_path)(std::io::Error::last_os_error()));
    }
    let used = uids_in_use();
    let n = u64::from(last - first) + 1;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    // Start at a varying place so that uids are not reused at once after a VM ends.
    let start = (u64::from(nanos) ^ u64::from(std::process::id())) % n;
    for i in 0..n {
        let uid = first + ((start + i) % n) as u32;
        if !used.contains(&uid) {
            return Ok(Chosen {
                user: QemuUser { uid, gid: uid },
                _lock: Some(lock),
            });
        }
    }
    Err(LaunchError::Host(format!(
        "every QEMU uid {first}-{last} is in use (KILN_QEMU_USER)"
    )))
}

/// Whether this process may give QEMU another user (it runs as root).
pub(crate) fn can_drop() -> bool {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_parse() {
        assert_eq!(
            QemuUsers::parse("").unwrap(),
            QemuUsers::Range {
                first: 0x7000_0000,
                last: 0x7000_ffff
            }
        );
        assert_eq!(
            QemuUsers::parse("2000-2099").unwrap(),
            QemuUsers::Range {
                first: 2000,
                last: 2099
            }
        );
        assert_eq!(
            QemuUsers::parse("64055:64055").unwrap(),
            QemuUsers::Shared(QemuUser {
                uid: 64055,
                gid: 64055
            })
        );
        for bad in ["0-10", "0:5", "5:0", "9-3", "x", "1-y", "nobody"] {
            assert!(QemuUsers::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn qcow2_header_names_its_backing_file() {
        let t = tempfile::tempdir().unwrap();
        let img = t.path().join("o.qcow2");
        // A header as qemu-img writes it: the name right after the 104-byte v3 header.
        let mut h = vec![0u8; 200];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[8..16].copy_from_slice(&120u64.to_be_bytes());
        h[16..20].copy_from_slice(&8u32.to_be_bytes());
        h[120..128].copy_from_slice(b"base.raw");
        std::fs::write(&img, &h).unwrap();
        assert_eq!(
            qcow2_backing(&img).unwrap(),
            Some(t.path().join("base.raw"))
        );
        h[120..128].copy_from_slice(b"/b/a.raw");
        std::fs::write(&img, &h).unwrap();
        assert_eq!(qcow2_backing(&img).unwrap(), Some("/b/a.raw".into()));
        h[8..20].fill(0);
        std::fs::write(&img, &h).unwrap();
        assert_eq!(qcow2_backing(&img).unwrap(), None);
        std::fs::write(&img, b"not qcow2 at all, 20+").unwrap();
        assert!(qcow2_backing(&img).is_err());
    }

    #[test]
    fn a_running_process_uid_is_never_chosen() {
        // This process's own uid (root in CI) shows as in use.
        // SAFETY: getuid(2) cannot fail.
        let me = unsafe { libc::getuid() };
        assert!(uids_in_use().contains(&me));
    }
}
