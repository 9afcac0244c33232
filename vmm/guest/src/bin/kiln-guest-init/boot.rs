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

/// Boot options from the kernel command line (`kiln.root=`, `kiln.rootfstype=`).
pub struct BootOptions {
    /// The root block device (default `/dev/vda`).
    pub root: String,
    /// Its file system type (default `ext4`).
    pub fstype: String,
}

impl BootOptions {
    /// Parse `/proc/cmdline`'s words.
    pub fn from_cmdline(cmdline: &str) -> Self {
        let mut opts = BootOptions {
            root: "/dev/vda".into(),
            fstype: "ext4".into(),
        };
        for word in cmdline.split_ascii_whitespace() {
            if let Some(v) = word.strip_prefix("kiln.root=") {
                opts.root = v.into();
            } else if let Some(v) = word.strip_prefix("kiln.rootfstype=") {
                opts.fstype = v.into();
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
    if !wait_for(Path::new(&opts.root), ROOT_WAIT) {
        return Err(BootError::NoRoot(opts.root.clone()));
    }
    mount_at(&opts.root, NEW_ROOT, &opts.fstype, 0, "")?;
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
    mount_at("tmpfs", "/run", "tmpfs", nosuid, "mode=0755")?;
    mount_at("tmpfs", "/tmp", "tmpfs", nosuid, "mode=1777")?;
    // mkdir honours the umask; make sure the sticky bits are as asked.
    for p in ["/tmp", "/dev/shm"] {
        let _ = fs::set_permissions(p, fs::Permissions::from_mode(0o1777));
    }
    log!("root {} ({}) mounted as /", opts.root, opts.fstype);
    Ok(())
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
    }
}
