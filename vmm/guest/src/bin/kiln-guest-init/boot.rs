//! Early boot: API file systems, kernel modules, the image root, switch root.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::sys;
use crate::{BootError, log};

/// Where the initramfs lists the modules to load, one path a line, dependencies first
/// (written by kiln-vmm's initramfs builder).
pub const MODULE_LIST: &str = "/kiln/modules";

/// Where the image root is mounted before it becomes `/`.
const NEW_ROOT: &str = "/newroot";

/// How long to wait for the root block device to appear after loading virtio_blk.
const ROOT_WAIT: Duration = Duration::from_secs(10);

/// Boot options from the kernel command line (`kiln.root=`, `kiln.rootfstype=`,
/// `kiln.step=`).
pub struct BootOptions {
    /// The root block device (default `/dev/vda`).
    pub root: String,
    /// Its file system type (default `ext4`).
    pub fstype: String,
    /// `kiln.step=N`: a build step's VM. The root is an overlay of the read-only disks with
    /// the serials `lower0` … `lower<N-1>` (topmost first; none: an empty lower) under an
    /// upper directory on the disk with the serial `upper` ([`STEP_UPPER`]); see
    /// [`switch_root`].
    pub step_lowers: Option<usize>,
    /// `kiln.step=wait`: a builder VM (the per-host builder snapshot, kiln-vmm's
    /// `builder` module): the init boots with every step disk slot present but touches
    /// none of them (only the kernel's probe read them), answers the host, and mounts the
    /// step's root when a `mount_step` comes after a restore ([`mount_waiting_step`]).
    pub step_wait: bool,
    /// `kiln.egress`: the VM has the egress port ([`kiln_guest::egress::PORT_NAME`]); the
    /// init waits for it to appear before it answers the host ([`crate::egress`]).
    pub egress: bool,
}

/// Most lower disks a step VM takes (`kiln.step=`, `mount_step`).
pub use kiln_guest::protocol::MAX_STEP_LOWERS;

/// Where a step VM's upper disk is mounted (in the initramfs, outside the step's root).
const STEP_DISK: &str = "/kiln/upper-disk";
/// The overlay's upper directory on that disk.
pub const STEP_UPPER: &str = "/kiln/upper-disk/upper";
/// The overlay's work directory on that disk.
const STEP_WORK: &str = "/kiln/upper-disk/work";

/// The step VM's upper directory, opened before the switch to the step's root (which hides
/// it) and kept for `diff`; `None` outside step VMs.
pub fn step_upper() -> Option<&'static fs::File> {
    STEP_UPPER_DIR.get()
}

static STEP_UPPER_DIR: OnceLock<fs::File> = OnceLock::new();

impl BootOptions {
    /// Parse `/proc/cmdline`'s words.
    pub fn from_cmdline(cmdline: &str) -> Self {
        let mut opts = BootOptions {
            root: "/dev/vda".into(),
            fstype: "ext4".into(),
            step_lowers: None,
            step_wait: false,
            egress: false,
        };
        for word in cmdline.split_ascii_whitespace() {
            if let Some(v) = word.strip_prefix("kiln.root=") {
                opts.root = v.into();
            } else if let Some(v) = word.strip_prefix("kiln.rootfstype=") {
                opts.fstype = v.into();
            } else if word == "kiln.step=wait" {
                opts.step_wait = true;
            } else if let Some(v) = word.strip_prefix("kiln.step=") {
                opts.step_lowers = v.parse::<usize>().ok().map(|n| n.min(MAX_STEP_LOWERS));
            } else if word == "kiln.egress" {
                opts.egress = true;
            }
        }
        opts
    }
}

fn mkdir(path: &Path, mode: u32) -> io::Result<()> {
    match fs::DirBuilder::new().mode(mode).create(path) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

fn mount_at(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), BootError> {
    let target = Path::new(target);
    mkdir(target, 0o755).map_err(|e| BootError::Mount(target.display().to_string(), e))?;
    sys::mount(source, target, fstype, flags, data)
        .map_err(|e| BootError::Mount(target.display().to_string(), e))
}

/// Mount /proc, /sys and /dev (devtmpfs) in the initramfs.
pub fn mount_early() -> Result<(), BootError> {
    let nodev = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount_at("proc", "/proc", "proc", nodev, "")?;
    mount_at("sysfs", "/sys", "sysfs", nodev, "")?;
    mount_at("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755")?;
    Ok(())
}

/// Load the modules listed in [`MODULE_LIST`], in order. A missing list loads nothing (a
/// kernel with the drivers built in).
pub fn load_modules() -> Result<usize, BootError> {
    let list = match fs::read_to_string(MODULE_LIST) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(BootError::Module(MODULE_LIST.into(), e)),
    };
    let mut n = 0;
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let file = fs::File::open(line).map_err(|e| BootError::Module(line.into(), e))?;
        sys::finit_module(file.as_raw_fd()).map_err(|e| BootError::Module(line.into(), e))?;
        n += 1;
    }
    Ok(n)
}

/// The root block device mounted as `/` ([`BootOptions::root`]), once [`switch_root`] has
/// mounted it; `/dev/vda` before.
pub fn root_device() -> &'static str {
    ROOT_DEVICE.get().map_or("/dev/vda", String::as_str)
}

static ROOT_DEVICE: OnceLock<String> = OnceLock::new();

/// Wait for `path` to exist, polling every 10 ms up to `limit`.
pub fn wait_for(path: &Path, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    path.exists()
}

/// Mount the image root read-write, move /proc, /sys and /dev into it, make it `/` (MS_MOVE
/// and chroot: this process stays PID 1), then mount /dev/pts, /dev/shm, /run and /tmp.
pub fn switch_root(opts: &BootOptions) -> Result<(), BootError> {
    if opts.step_lowers.is_none() && !wait_for(Path::new(&opts.root), ROOT_WAIT) {
        return Err(BootError::NoRoot(opts.root.clone()));
    }
    match opts.step_lowers {
        None => mount_at(&opts.root, NEW_ROOT, &opts.fstype, 0, "")?,
        Some(n) => mount_step_root(opts, n)?,
    }
    let _ = ROOT_DEVICE.set(opts.root.clone());
    for dir in ["dev", "proc", "sys"] {
        let old = Path::new("/").join(dir);
        let new = Path::new(NEW_ROOT).join(dir);
        // Before the chroot a symlink in the image would resolve in the initramfs: the image
        // (untrusted) could aim these mounts anywhere. Only a real directory (or none) is used.
        if let Ok(meta) = fs::symlink_metadata(&new)
            && !meta.is_dir()
        {
            return Err(BootError::Mount(
                new.display().to_string(),
                io::Error::other("the image has a non-directory (or a symlink) here"),
            ));
        }
        mkdir(&new, 0o755).map_err(|e| BootError::Mount(new.display().to_string(), e))?;
        sys::mount(&old.display().to_string(), &new, "", libc::MS_MOVE, "")
            .map_err(|e| BootError::Mount(new.display().to_string(), e))?;
    }
    // The initramfs files are freed with the rootfs they live in only when unlinked; drop the
    // big ones (the modules; our own binary stays mapped until exec, which never happens).
    if let Ok(list) = fs::read_to_string(MODULE_LIST) {
        for line in list.lines() {
            let _ = fs::remove_file(line.trim());
        }
    }
    std::env::set_current_dir(NEW_ROOT).map_err(|e| BootError::Mount(NEW_ROOT.into(), e))?;
    sys::mount(".", Path::new("/"), "", libc::MS_MOVE, "")
        .map_err(|e| BootError::Mount("/ (move)".into(), e))?;
    sys::chroot(Path::new(".")).map_err(|e| BootError::Mount("/ (chroot)".into(), e))?;
    std::env::set_current_dir("/").map_err(|e| BootError::Mount("/".into(), e))?;

    let nosuid = libc::MS_NOSUID | libc::MS_NODEV;
    mount_at(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "mode=0620,ptmxmode=0666,gid=5",
    )?;
    mount_at("shm", "/dev/shm", "tmpfs", nosuid, "mode=1777")?;
    if opts.step_lowers.is_some() {
        // A build step writes /run and /tmp into its layer, as under the namespace
        // executor, which mounts no tmpfs there either.
        log!("step root (overlay) mounted as /");
        return Ok(());
    }
    mount_at("tmpfs", "/run", "tmpfs", nosuid, "mode=0755")?;
    mount_at("tmpfs", "/tmp", "tmpfs", nosuid, "mode=1777")?;
    // mkdir honours the umask; make sure the sticky bits are as asked.
    for p in ["/tmp", "/dev/shm"] {
        let _ = fs::set_permissions(p, fs::Permissions::from_mode(0o1777));
    }
    log!("root {} ({}) mounted as /", opts.root, opts.fstype);
    Ok(())
}

/// A step VM's root on [`NEW_ROOT`]: the upper disk (the virtio disk with the serial
/// `upper`) on [`STEP_DISK`] with `upper/` and `work/` on it, the `n` lower disks (serials
/// `lower0` …, read-only ext4 images of the step's layers, topmost first) on
/// `/kiln/lower/<i>`, and overlayfs over them (no lower: an empty directory of the
/// initramfs). Disks are found by serial (`/sys/block/vd*/serial`), not by name, which
/// depends on probe order. The upper directory is kept open for `diff` ([`step_upper`]).
fn mount_step_root(opts: &BootOptions, n: usize) -> Result<(), BootError> {
    let mut want: Vec<String> = (0..n).map(|i| format!("lower{i}")).collect();
    want.push("upper".into());
    let start = Instant::now();
    let disks = loop {
        let found = disks_by_serial();
        if want.iter().all(|w| found.contains_key(w)) {
            break found;
        }
        if start.elapsed() > ROOT_WAIT {
            let missing: Vec<&String> = want.iter().filter(|w| !found.contains_key(*w)).collect();
            return Err(BootError::NoRoot(format!("the step's disks {missing:?}")));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let dev = |serial: &str| disks.get(serial).cloned().unwrap_or_default();
    mount_at(&dev("upper"), STEP_DISK, &opts.fstype, libc::MS_NOSUID, "")?;
    for d in [STEP_UPPER, STEP_WORK] {
        mkdir(Path::new(d), 0o755).map_err(|e| BootError::Mount(d.into(), e))?;
    }
    let mut lowers = Vec::new();
    for i in 0..n {
        let at = format!("/kiln/lower/{i}");
        fs::create_dir_all(&at).map_err(|e| BootError::Mount(at.clone(), e))?;
        mount_at(
            &dev(&format!("lower{i}")),
            &at,
            "ext4",
            libc::MS_RDONLY | libc::MS_NOSUID,
            "",
        )?;
        lowers.push(at);
    }
    if lowers.is_empty() {
        let empty = "/kiln/lower/empty";
        fs::create_dir_all(empty).map_err(|e| BootError::Mount(empty.into(), e))?;
        lowers.push(empty.into());
    }
    // `volatile` (Linux 5.10+, `Documentation/filesystems/overlayfs.rst`, "Volatile mount"):
    // fsync and syncfs through the step's root skip the upper disk. The disk is the step's
    // scratch (a new file per step, the VM never outlives the step, and the host takes the
    // step's changes from `diff`, read through this kernel's page cache), so a step's own
    // syncs (dpkg's, one per package file) buy nothing, and each costs a flush of the
    // virtio disk. The work directory is new on every boot: no earlier volatile mount's
    // marker to refuse.
    let data = format!(
        "lowerdir={},upperdir={STEP_UPPER},workdir={STEP_WORK},volatile",
        lowers.join(":")
    );
    mount_at("overlay", NEW_ROOT, "overlay", 0, &data)?;
    let upper = fs::File::open(STEP_UPPER).map_err(|e| BootError::Mount(STEP_UPPER.into(), e))?;
    let _ = STEP_UPPER_DIR.set(upper);
    Ok(())
}

/// Whether this is a builder VM still waiting for its step (`kiln.step=wait` and no
/// [`mount_waiting_step`] yet).
pub fn waiting_for_step() -> bool {
    WAITING.load(std::sync::atomic::Ordering::SeqCst)
}

static WAITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks this VM a builder VM waiting for its step (`kiln.step=wait`).
pub fn wait_for_step() {
    WAITING.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `_IO(0x12, 97)`: drop a block device's cached buffers (linux/fs.h).
const BLKFLSBUF: libc::c_ulong = 0x1261;

/// A builder VM's step, once the host has bound the step's files to the disk slots and
/// restored the VM: every virtio disk's cached blocks are dropped (`BLKFLSBUF`; the
/// kernel's probe at the snapshot's boot read the placeholders' first blocks, and a mount
/// must read the step's files), then the root is mounted as at a cold step boot
/// ([`switch_root`] with `lowers`). The capacity the guest holds for each disk is the
/// placeholder's, which the host makes larger than any step file it binds (QEMU refuses
/// `block_resize` on a read-only drive, measured under QEMU 10.0): a file system is never
/// larger than its file, and QEMU refuses I/O past the file's end.
///
/// Errors: not waiting (no `kiln.step=wait`, or mounted already), a flush or a mount.
pub fn mount_waiting_step(lowers: usize, fstype: &str) -> Result<(), BootError> {
    if WAITING
        .compare_exchange(
            true,
            false,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        )
        .is_err()
    {
        return Err(BootError::Mount(
            "the step root".into(),
            io::Error::other("not a builder VM waiting for its step"),
        ));
    }
    for dev in disks_by_serial().into_values() {
        let f = fs::File::open(&dev).map_err(|e| BootError::Mount(dev.clone(), e))?;
        // SAFETY: an argument-less ioctl on a descriptor this function owns.
        if unsafe { libc::ioctl(f.as_raw_fd(), BLKFLSBUF as _) } != 0 {
            return Err(BootError::Mount(
                format!("{dev} (BLKFLSBUF)"),
                io::Error::last_os_error(),
            ));
        }
    }
    switch_root(&BootOptions {
        root: "/dev/vda".into(),
        fstype: fstype.into(),
        step_lowers: Some(lowers.min(MAX_STEP_LOWERS)),
        step_wait: false,
        egress: false,
    })
}

/// Virtio block devices by serial: `serial` → `/dev/vdX` (made with mknod from its `dev`
/// file when devtmpfs has not made it yet).
pub fn disks_by_serial() -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let Ok(dir) = fs::read_dir("/sys/block") else {
        return out;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("vd") {
            continue;
        }
        let Ok(serial) = fs::read_to_string(e.path().join("serial")) else {
            continue;
        };
        let dev = format!("/dev/{name}");
        if !Path::new(&dev).exists() {
            continue;
        }
        out.insert(serial.trim().to_string(), dev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_options_default_and_override() {
        let o = BootOptions::from_cmdline("console=ttyS0 quiet");
        assert_eq!((o.root.as_str(), o.fstype.as_str()), ("/dev/vda", "ext4"));
        let o = BootOptions::from_cmdline("kiln.root=/dev/vdb kiln.rootfstype=ext2 x");
        assert_eq!((o.root.as_str(), o.fstype.as_str()), ("/dev/vdb", "ext2"));
        assert_eq!(o.step_lowers, None);
        assert_eq!(
            BootOptions::from_cmdline("kiln.step=3").step_lowers,
            Some(3)
        );
        assert_eq!(
            BootOptions::from_cmdline("kiln.step=99").step_lowers,
            Some(MAX_STEP_LOWERS)
        );
        let w = BootOptions::from_cmdline("kiln.step=wait kiln.egress");
        assert_eq!((w.step_lowers, w.step_wait, w.egress), (None, true, true));
    }
}
