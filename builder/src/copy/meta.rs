//! The owner, mode, times and xattrs a copy gives what it writes.

use super::*;

/// Owner and mode rules of one copy.
pub(super) struct Meta {
    pub(super) chown: Option<(u32, u32)>,
    pub(super) chmod: Option<Chmod>,
    pub(super) context: bool,
    /// Copying a git checkout: root-owned, as the context.
    pub(super) git: bool,
}

impl Meta {
    pub(super) fn owner(&self, st: &Stat) -> (u32, u32) {
        match (self.chown, self.context || self.git) {
            (Some(o), _) => o,
            (None, true) => (0, 0),
            (None, false) => (st.st_uid, st.st_gid),
        }
    }

    pub(super) fn mode(&self, st_mode: u32, is_dir: bool) -> u32 {
        match &self.chmod {
            Some(c) => c.apply(st_mode & 0o7777, is_dir),
            None => st_mode & 0o7777,
        }
    }

    /// Owner of directories the copy creates on the way.
    pub(super) fn parent_owner(&self) -> (u32, u32) {
        self.chown.unwrap_or((0, 0))
    }
}

/// `--chown` resolved in `db_root`'s `/etc/passwd` and `/etc/group`.
pub(super) fn resolve_chown(spec: &str, db_root: &Path) -> Result<(u32, u32), CopyError> {
    let root = Root::open(db_root).map_err(|e| CopyError::Io {
        path: db_root.display().to_string(),
        op: "open",
        source: e,
    })?;
    let read = |p: &str| -> Result<String, CopyError> {
        let b = crate::rootfs::read_bounded(&root, p, crate::user::MAX_DB_BYTES as u64).map_err(
            |source| CopyError::Resolve {
                path: p.into(),
                source,
            },
        )?;
        Ok(String::from_utf8_lossy(&b.unwrap_or_default()).into_owned())
    };
    let passwd = read("/etc/passwd")?;
    let group = read("/etc/group")?;
    let u = crate::user::resolve_user(Some(spec), &passwd, &group).map_err(|source| {
        CopyError::Chown {
            spec: spec.into(),
            source,
        }
    })?;
    // Dockerfile reference: "a UID without GID will use the same numeric UID as the GID".
    let numeric_alone = !spec.contains(':') && spec.parse::<u32>().is_ok();
    Ok((u.uid, if numeric_alone { u.uid } else { u.gid }))
}

// Which xattrs are copied: the layer applier's rule, so that neither overlayfs' own xattrs
// (obeyed in the step's upper directory) nor host policy (`security.selinux`, ACLs) pass
// into a layer.
use crate::layer::keep_xattr;

/// The kept xattrs of an open file or directory, sorted by name.
pub(crate) fn xattrs(fd: BorrowedFd<'_>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut names = vec![0u8; 64 << 10];
    let Ok(n) = rustix::fs::flistxattr(fd, &mut names[..]) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if !keep_xattr(name) {
            continue;
        }
        let mut val = vec![0u8; 64 << 10];
        if let Ok(k) = rustix::fs::fgetxattr(fd, os(name), &mut val[..]) {
            val.truncate(k);
            out.push((name.to_vec(), val));
        }
    }
    out.sort();
    out
}

/// Opens a regular file `name` in `dir` for reading, refusing anything but a regular file
/// (`O_NONBLOCK`: a FIFO swapped in cannot block the open).
pub(crate) fn open_regular(
    dir: BorrowedFd<'_>,
    name: &[u8],
    shown: &str,
) -> Result<(OwnedFd, Stat), CopyError> {
    let fd = rustix::fs::openat(
        dir,
        os(name),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(ioe(shown, "open"))?;
    let st = rustix::fs::fstat(&fd).map_err(ioe(shown, "stat"))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(CopyError::Io {
            path: shown.into(),
            op: "open",
            source: io::Error::other("changed while being copied (no longer a regular file)"),
        });
    }
    Ok((fd, st))
}

pub(super) fn ts(sec: i64, nsec: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}
