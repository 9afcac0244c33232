//! One path opened inside a root: `openat2(2)` with `RESOLVE_IN_ROOT`, or the walk.

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::root::{components, os, walk_fd};
use super::walk::{Walk, WalkError};

/// Most times [`openat2_in_root`] asks again after `EAGAIN`.
const OPENAT2_ATTEMPTS: usize = 64;

/// `openat2(2)` (rustix's), asked again on `EAGAIN`, at most [`OPENAT2_ATTEMPTS`] times:
/// with `RESOLVE_IN_ROOT` or `RESOLVE_BENEATH`, the kernel answers `EAGAIN` when a rename or
/// a mount anywhere on the host raced the lookup of a `..` component, and openat2(2) says
/// the caller may retry. Busy hosts (a CI run, a server's other builds) hit it. `ENOSYS`
/// (a kernel before 5.6, or a seccomp filter that hides it) is the caller's to handle:
/// [`open_in_root`] does.
fn openat2_in_root<Fd: AsFd, P: rustix::path::Arg + Copy>(
    dirfd: Fd,
    path: P,
    oflags: OFlags,
    mode: Mode,
    resolve: ResolveFlags,
) -> rustix::io::Result<OwnedFd> {
    let mut tries = 0;
    loop {
        match rustix::fs::openat2(dirfd.as_fd(), path, oflags, mode, resolve) {
            Err(Errno::AGAIN) if tries + 1 < OPENAT2_ATTEMPTS => tries += 1,
            r => return r,
        }
    }
}

/// Opens `path` (`/`-separated; absolute or relative, both from `root`) inside the
/// directory `root` with `oflags` (no `O_CREAT`): symlinks on the way, and the last one
/// unless `O_NOFOLLOW`, resolve inside `root` (an absolute target restarts at it, `..`
/// stays at it; `/proc` magic links are not followed). `openat2(2)` with `RESOLVE_IN_ROOT |
/// RESOLVE_NO_MAGICLINKS` where the kernel has it, else ([`walk_in_root`]) the walk, which
/// reads each symlink and so never follows a magic link either. Errors are `openat2`'s:
/// `ENOENT` for a missing component, `ENOTDIR`, `ELOOP` past
/// [`super::MAX_SYMLINK_HOPS`], `ENAMETOOLONG` past [`super::MAX_DEPTH`].
pub(crate) fn open_in_root(
    root: impl AsFd,
    path: &str,
    oflags: OFlags,
) -> rustix::io::Result<OwnedFd> {
    let p = if path.trim_matches('/').is_empty() {
        "."
    } else {
        path
    };
    match openat2_in_root(
        &root,
        p,
        oflags,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    ) {
        Err(Errno::NOSYS) => walk_in_root(root, path, oflags),
        r => r,
    }
}

/// [`open_in_root`] without `openat2`: the walk to the last component, then one `openat`
/// of it with `O_NOFOLLOW` (a symlink swapped in since is not followed).
pub(crate) fn walk_in_root(
    root: impl AsFd,
    path: &str,
    oflags: OFlags,
) -> rustix::io::Result<OwnedFd> {
    let how = Walk::in_root(!oflags.contains(OFlags::NOFOLLOW), false);
    let mut comps = components(path);
    // A trailing `/` or `/.` asks for a directory: kept as a `.` the walk sees.
    if path.ends_with('/') || path.ends_with("/.") {
        comps.push(b".".to_vec());
    }
    let reached = walk_fd(root.as_fd(), &comps, &how, None).map_err(|e| match e {
        WalkError::Tree(e) => e.errno,
        WalkError::Missing | WalkError::Escape => Errno::NOENT,
        WalkError::NotADirectory => Errno::NOTDIR,
        WalkError::Loop => Errno::LOOP,
        WalkError::TooDeep => Errno::NAMETOOLONG,
    })?;
    let (dir, _) = reached.dirs.last().expect("the root stays");
    match &reached.last {
        Some((_, None)) => Err(Errno::NOENT),
        Some((name, Some(_))) => rustix::fs::openat(
            dir,
            os(name),
            oflags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ),
        // Ended on a directory entered (or the root): open it again as asked.
        None => rustix::fs::openat(dir, ".", oflags | OFlags::CLOEXEC, Mode::empty()),
    }
}
