//! Host-side work on a step's merged overlay view (`WORKDIR` directories, and `COPY`/`ADD`
//! once they land), without leaving a mount behind whatever happens.
//!
//! The overlay (the parent's layer directories as lowers, a fresh upper) is mounted by a
//! dedicated thread that first unshares its file-system attributes and mount namespace
//! (`unshare(CLONE_FS | CLONE_NEWNS)`, allowed in a multithreaded process) and makes every
//! mount in it private. The mount exists only in that namespace, which dies with the thread,
//! or with the process if it crashes or is killed: nothing is left mounted on the host.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::{MountAttrFlags, MountPropagationFlags, UnmountFlags, mount_change, unmount};

/// Errors of merged-view work.
#[derive(Debug, thiserror::Error)]
pub enum MergedError {
    /// Setting up the private mount failed.
    #[error("mounting the merged view: {0}")]
    Mount(String),
    /// The work itself failed.
    #[error("{0}")]
    Work(String),
    /// The worker thread died.
    #[error("the merged-view worker thread panicked")]
    Panicked,
}

/// Mounts lowers (topmost first) + `upper` (with `work`) on `mountpoint` in a private mount
/// namespace of a fresh thread, runs `f` on the merged root, and returns its result. The
/// mount is gone when this returns.
pub fn with_merged<T: Send + 'static>(
    lowers: Vec<PathBuf>,
    upper: PathBuf,
    work: PathBuf,
    mountpoint: PathBuf,
    f: impl FnOnce(&Path) -> Result<T, String> + Send + 'static,
) -> Result<T, MergedError> {
    std::thread::spawn(move || -> Result<T, MergedError> {
        // SAFETY: unshare_unsafe is unsafe because unsharing CLONE_FILES (or the like) can
        // invalidate file descriptors other code holds; CLONE_FS and CLONE_NEWNS only give
        // this thread its own cwd/root/umask and mount namespace, which nothing else shares.
        unsafe {
            rustix::thread::unshare_unsafe(
                rustix::thread::UnshareFlags::FS | rustix::thread::UnshareFlags::NEWNS,
            )
        }
        .map_err(|e| MergedError::Mount(format!("unshare: {e}")))?;
        mount_change(
            "/",
            MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
        )
        .map_err(|e| MergedError::Mount(format!("making mounts private: {e}")))?;
        mount_overlay(&lowers, &upper, &work, &mountpoint).map_err(MergedError::Mount)?;
        let r = f(&mountpoint).map_err(MergedError::Work);
        let _ = unmount(&mountpoint, UnmountFlags::DETACH);
        r
    })
    .join()
    .map_err(|_| MergedError::Panicked)?
}

fn mount_overlay(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<(), String> {
    let empty;
    let lowers: Vec<&Path> = if lowers.is_empty() {
        // overlayfs needs one lower; an empty directory beside the upper will do.
        empty = work.with_extension("empty");
        std::fs::create_dir_all(&empty).map_err(|e| format!("{}: {e}", empty.display()))?;
        vec![empty.as_path()]
    } else {
        lowers.iter().map(PathBuf::as_path).collect()
    };
    // Volatile: the upper is a step's scratch (captured as a layer, whose blob the build
    // cache syncs, or removed), never read again as it stood after a crash.
    crate::exec::overlay::mount(
        &lowers,
        upper,
        work,
        target,
        MountAttrFlags::MOUNT_ATTR_NODEV | MountAttrFlags::MOUNT_ATTR_NOSUID,
    )
}

/// Opens `path` (absolute, inside the root `root`) as a directory, resolving every symlink
/// inside the root ([`crate::rootfs::open_in_root`]), creating missing directories with `mode`
/// owned by `uid:gid`. Returns the directory.
pub fn mkdir_in_root(
    root: &Path,
    path: &str,
    mode: u32,
    uid: u32,
    gid: u32,
) -> io::Result<OwnedFd> {
    let rootfd = rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let flags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let comps: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    let mut so_far = String::from(".");
    let mut parent = crate::rootfs::open_in_root(&rootfd, ".", flags)?;
    for c in comps {
        if c == ".." {
            so_far.push_str("/..");
            parent = crate::rootfs::open_in_root(&rootfd, so_far.as_str(), flags)?;
            continue;
        }
        so_far.push('/');
        so_far.push_str(c);
        parent = match crate::rootfs::open_in_root(&rootfd, so_far.as_str(), flags) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                let name = OsStr::from_bytes(c.as_bytes());
                match rustix::fs::mkdirat(parent.as_fd(), name, Mode::from_raw_mode(mode)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                // A dangling symlink named `c` resolves to its target inside the root: open
                // the final path again, inside the root.
                let fd = match crate::rootfs::open_in_root(&rootfd, so_far.as_str(), flags) {
                    Ok(fd) => fd,
                    Err(Errno::NOENT) => {
                        return Err(io::Error::other(format!(
                            "{path}: {c} is a dangling symlink"
                        )));
                    }
                    Err(e) => return Err(e.into()),
                };
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
                rustix::fs::fchown(
                    &fd,
                    Some(rustix::process::Uid::from_raw(uid)),
                    Some(rustix::process::Gid::from_raw(gid)),
                )?;
                fd
            }
            Err(e) => return Err(e.into()),
        };
    }
    Ok(parent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::MetadataExt;

    /// A directory made through the merged view lands in the upper directory, symlinks
    /// resolve inside the root, and nothing stays mounted.
    #[test]
    fn mkdir_through_merged_view() {
        assert!(
            rustix::process::geteuid().is_root(),
            "needs root (overlayfs); CI runs as root"
        );
        let t = tempfile::tempdir().unwrap();
        let lower = t.path().join("lower");
        fs::create_dir_all(lower.join("srv")).unwrap();
        std::os::unix::fs::symlink("/srv", lower.join("link")).unwrap();
        std::os::unix::fs::symlink("/../../../..", lower.join("up")).unwrap();
        let (upper, work, mnt) = (
            t.path().join("upper"),
            t.path().join("work"),
            t.path().join("mnt"),
        );
        for d in [&upper, &work, &mnt] {
            fs::create_dir(d).unwrap();
        }
        with_merged(
            vec![lower.clone()],
            upper.clone(),
            work,
            mnt.clone(),
            |root| {
                mkdir_in_root(root, "/link/app/x", 0o755, 1000, 1000).map_err(|e| e.to_string())?;
                mkdir_in_root(root, "/up/escaped", 0o755, 0, 0).map_err(|e| e.to_string())?;
                Ok(())
            },
        )
        .unwrap();
        let md = fs::metadata(upper.join("srv/app/x")).unwrap();
        assert_eq!((md.uid(), md.mode() & 0o7777), (1000, 0o755));
        assert!(upper.join("escaped").is_dir(), "`up` resolves to the root");
        assert!(!t.path().join("escaped").exists());
        assert_eq!(
            fs::read_dir(&mnt).unwrap().count(),
            0,
            "nothing stays mounted"
        );
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mounts.contains(mnt.to_str().unwrap()));
    }

    /// Issue 34: the merged view is a volatile overlay (its upper is a step's scratch), and
    /// the same upper and work directories mount again (overlayfs' marker of a volatile
    /// mount is cleared first).
    #[test]
    fn the_merged_view_is_volatile_and_mounts_again() {
        assert!(
            rustix::process::geteuid().is_root(),
            "needs root (overlayfs); CI runs as root"
        );
        let t = tempfile::tempdir().unwrap();
        let lower = t.path().join("lower");
        fs::create_dir_all(&lower).unwrap();
        let (upper, work, mnt) = (
            t.path().join("upper"),
            t.path().join("work"),
            t.path().join("mnt"),
        );
        for d in [&upper, &work, &mnt] {
            fs::create_dir(d).unwrap();
        }
        for round in 0..2 {
            let at = mnt.clone();
            let line = with_merged(
                vec![lower.clone()],
                upper.clone(),
                work.clone(),
                mnt.clone(),
                move |root| {
                    fs::write(root.join(format!("f{round}")), "x").map_err(|e| e.to_string())?;
                    // This thread's own mount namespace.
                    let mounts = fs::read_to_string("/proc/thread-self/mountinfo")
                        .map_err(|e| e.to_string())?;
                    let at = format!(" {} ", at.display());
                    Ok(mounts.lines().find(|l| l.contains(&at)).map(str::to_string))
                },
            )
            .unwrap()
            .expect("the view's mount");
            let options = line.rsplit(' ').next().unwrap();
            assert!(
                options
                    .split(',')
                    .any(|o| o == "volatile" || o == "fsync=volatile"),
                "{line}"
            );
            assert!(work.join("work/incompat/volatile").is_dir());
        }
        assert!(upper.join("f0").is_file() && upper.join("f1").is_file());
    }
}
