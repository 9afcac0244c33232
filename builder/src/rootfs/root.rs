//! A host directory as a root: the [`Tree`] of descriptors that [`walk`] resolves paths in,
//! for `COPY` (sources, destinations, the user database) and layer apply.
//!
//! Every directory on the way is opened with `O_NOFOLLOW | O_DIRECTORY` relative to the one
//! before it, so a symlink swapped in between a `stat` and an `open` makes the `open` fail
//! instead of being followed. Unlike `openat2`, the walk knows the resolved path, which the
//! build context needs to apply `.dockerignore` to what a symlink points at.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;

use super::walk::{Lookup, Reached, Tree, Walk, WalkError, walk};
use super::{MAX_DEPTH, MAX_SYMLINK_HOPS};

/// Why a path could not be resolved inside its root.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// A component (not the last) is missing.
    #[error("{path}: no such file or directory")]
    NotFound {
        /// The path being resolved, as given.
        path: String,
    },
    /// A component (not the last) is not a directory.
    #[error("{path}: a component is not a directory")]
    NotADirectory {
        /// The path being resolved, as given.
        path: String,
    },
    /// More than [`MAX_SYMLINK_HOPS`] symlinks.
    #[error("{path}: too many levels of symbolic links (more than {MAX_SYMLINK_HOPS})")]
    SymlinkLoop {
        /// The path being resolved, as given.
        path: String,
    },
    /// More than [`MAX_DEPTH`] components deep.
    #[error("{path}: deeper than {MAX_DEPTH} components")]
    TooDeep {
        /// The path being resolved, as given.
        path: String,
    },
    /// A system call failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The path being resolved, as given.
        path: String,
        /// The operation.
        op: &'static str,
        /// The cause.
        source: io::Error,
    },
}

/// A directory used as a root: paths under it never resolve outside it.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
}

/// What a resolution reached.
#[derive(Debug)]
pub struct Resolved {
    /// The directory holding the node (the root itself for the root).
    pub parent: OwnedFd,
    /// The node's name in `parent`; `None` for the root itself.
    pub name: Option<Vec<u8>>,
    /// The node's path from the root, symlinks resolved (empty for the root).
    pub comps: Vec<Vec<u8>>,
    /// The node's `lstat`, `None` when it does not exist (its parent does).
    pub stat: Option<Stat>,
}

/// Owner and mode for directories a resolution creates.
#[derive(Debug, Clone, Copy)]
pub struct Create {
    /// Permission bits.
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
}

pub(crate) fn os(c: &[u8]) -> &OsStr {
    OsStr::from_bytes(c)
}

/// Splits `/`-separated `path` into components (empty and `.` dropped, `..` kept).
pub fn components(path: &str) -> Vec<Vec<u8>> {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(|c| c.as_bytes().to_vec())
        .collect()
}

impl Root {
    /// Opens `dir` as a root (following symlinks in `dir` itself: it is the caller's path).
    pub fn open(dir: &Path) -> io::Result<Root> {
        let fd = rustix::fs::open(
            dir,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Root { fd })
    }

    /// The root's directory fd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Resolves `comps` (from [`components`]) inside the root. Symlinks on the way are
    /// followed inside the root; the last one too when `follow_last`. A `..` at the root
    /// stays there. A missing last component gives `stat: None`; a missing directory before
    /// it is created with `create` when given, else [`RootError::NotFound`].
    pub fn resolve(
        &self,
        comps: &[Vec<u8>],
        follow_last: bool,
        create: Option<Create>,
    ) -> Result<Resolved, RootError> {
        let shown = || {
            let mut s = String::from("/");
            s.push_str(
                &comps
                    .iter()
                    .map(|c| String::from_utf8_lossy(c).into_owned())
                    .collect::<Vec<_>>()
                    .join("/"),
            );
            s
        };
        let how = Walk::in_root(follow_last, create.is_some());
        let reached = self.walk(comps, &how, create).map_err(|e| match e {
            WalkError::Tree(FsError { op, errno }) => RootError::Io {
                path: shown(),
                op,
                source: errno.into(),
            },
            WalkError::Missing => RootError::NotFound { path: shown() },
            WalkError::NotADirectory => RootError::NotADirectory { path: shown() },
            WalkError::Loop => RootError::SymlinkLoop { path: shown() },
            WalkError::TooDeep => RootError::TooDeep { path: shown() },
            // AboveRoot::Stay: a `..` at the root is never refused.
            WalkError::Escape => RootError::NotFound { path: shown() },
        })?;
        let io_err = |op: &'static str, e: Errno| RootError::Io {
            path: shown(),
            op,
            source: e.into(),
        };
        let Reached { mut dirs, last } = reached;
        let mut comps_out: Vec<Vec<u8>> = dirs[1..].iter().map(|(_, n)| n.clone()).collect();
        if let Some((name, stat)) = last {
            comps_out.push(name.clone());
            let (parent, _) = dirs.pop().expect("the root stays");
            return Ok(Resolved {
                parent,
                name: Some(name),
                comps: comps_out,
                stat,
            });
        }
        // Ended on a directory entered (through `..`, `.`, a symlink), or the root itself.
        let (dir, name) = dirs.pop().expect("the root stays");
        let st = rustix::fs::fstat(&dir).map_err(|e| io_err("stat", e))?;
        match dirs.pop() {
            None => Ok(Resolved {
                parent: dir,
                name: None,
                comps: comps_out,
                stat: Some(st),
            }),
            Some((parent, _)) => Ok(Resolved {
                parent,
                name: Some(name),
                comps: comps_out,
                stat: Some(st),
            }),
        }
    }

    /// Walks `comps` in the root ([`walk`]); missing directories are made with `create`
    /// (and [`Walk::create`]).
    pub(crate) fn walk(
        &self,
        comps: &[Vec<u8>],
        how: &Walk,
        create: Option<Create>,
    ) -> Result<Reached<OwnedFd, Stat>, WalkError<FsError>> {
        walk_fd(self.fd.as_fd(), comps, how, create)
    }
}

/// [`walk`] from the directory `root` of the host; missing directories are made with
/// `create` (and [`Walk::create`]): 0755 and root's when `None`.
pub(crate) fn walk_fd(
    root: BorrowedFd<'_>,
    comps: &[Vec<u8>],
    how: &Walk,
    create: Option<Create>,
) -> Result<Reached<OwnedFd, Stat>, WalkError<FsError>> {
    let start = root.try_clone_to_owned().map_err(|e| FsError {
        op: "dup",
        errno: Errno::from_io_error(&e).unwrap_or(Errno::IO),
    })?;
    walk(
        &mut Fs {
            create: create.unwrap_or(Create {
                mode: 0o755,
                uid: 0,
                gid: 0,
            }),
        },
        start,
        comps,
        how,
    )
}

/// A failed system call of the walk: which, and its error.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FsError {
    /// The operation (`stat`, `open`, `readlink`, `mkdir`, `chown`, `chmod`, `dup`).
    pub op: &'static str,
    /// Its error.
    pub errno: Errno,
}

/// Host directories through descriptors, as a [`Tree`].
struct Fs {
    /// Mode and owner of a directory made on the way.
    create: Create,
}

fn fs_err(op: &'static str) -> impl FnOnce(Errno) -> FsError {
    move |errno| FsError { op, errno }
}

impl Tree for Fs {
    type Dir = OwnedFd;
    type Leaf = Stat;
    type Error = FsError;

    fn lookup(&mut self, dir: &OwnedFd, name: &[u8]) -> Result<Lookup<Stat>, FsError> {
        let st = match rustix::fs::statat(dir, os(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(Lookup::Missing),
            Err(e) => return Err(fs_err("stat")(e)),
        };
        Ok(match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => Lookup::Dir(st),
            FileType::Symlink => Lookup::Symlink(st),
            _ => Lookup::Other(st),
        })
    }

    fn read_link(&mut self, dir: &OwnedFd, name: &[u8], _: &Stat) -> Result<Vec<u8>, FsError> {
        rustix::fs::readlinkat(dir, os(name), Vec::new())
            .map(|t| t.into_bytes())
            .map_err(fs_err("readlink"))
    }

    fn enter(&mut self, dir: &OwnedFd, name: &[u8], _: Stat) -> Result<OwnedFd, FsError> {
        open_dir_at(dir.as_fd(), name).map_err(fs_err("open"))
    }

    fn make_dir(&mut self, dir: &OwnedFd, name: &[u8]) -> Result<OwnedFd, FsError> {
        let cr = self.create;
        rustix::fs::mkdirat(dir, os(name), Mode::from_raw_mode(cr.mode))
            .map_err(fs_err("mkdir"))?;
        let fd = open_dir_at(dir.as_fd(), name).map_err(fs_err("open"))?;
        rustix::fs::fchown(
            &fd,
            Some(rustix::process::Uid::from_raw(cr.uid)),
            Some(rustix::process::Gid::from_raw(cr.gid)),
        )
        .map_err(fs_err("chown"))?;
        // mkdir is subject to the umask.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(cr.mode)).map_err(fs_err("chmod"))?;
        Ok(fd)
    }

    fn replace_with_dir(&mut self, dir: &OwnedFd, name: &[u8]) -> Result<OwnedFd, FsError> {
        rustix::fs::unlinkat(dir, os(name), AtFlags::empty()).map_err(fs_err("unlink"))?;
        self.make_dir(dir, name)
    }
}

/// The names in the open directory `dir`, `.` and `..` left out, in the order the file
/// system gives them.
pub(crate) fn dir_names(dir: BorrowedFd<'_>) -> rustix::io::Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for ent in rustix::fs::Dir::read_from(dir)? {
        let n = ent?.file_name().to_bytes().to_vec();
        if n != b"." && n != b".." {
            out.push(n);
        }
    }
    Ok(out)
}

/// Opens the directory `name` of `dir`, never following a symlink.
pub(crate) fn open_dir_at(dir: BorrowedFd<'_>, name: &[u8]) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        os(name),
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

impl Resolved {
    /// Opens the node as a directory (`O_NOFOLLOW`).
    pub fn open_dir(&self) -> io::Result<OwnedFd> {
        match &self.name {
            None => Ok(self.parent.try_clone()?),
            Some(n) => Ok(rustix::fs::openat(
                &self.parent,
                os(n),
                OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )?),
        }
    }

    /// The resolved path, `/`-separated, without a leading `/` (empty for the root).
    pub fn rel(&self) -> String {
        self.comps
            .iter()
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect::<Vec<_>>()
            .join("/")
    }
}

/// Reads at most `max` bytes of the regular file `path` inside `root` (symlinks resolved
/// inside it). `Ok(None)`: missing, or not a regular file (a FIFO or device is never opened
/// for reading, so it cannot block).
pub fn read_bounded(root: &Root, path: &str, max: u64) -> Result<Option<Vec<u8>>, RootError> {
    use std::io::Read;
    let r = match root.resolve(&components(path), true, None) {
        Ok(r) => r,
        Err(RootError::NotFound { .. } | RootError::NotADirectory { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let (Some(st), Some(name)) = (r.stat, &r.name) else {
        return Ok(None);
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Ok(None);
    }
    let fd = rustix::fs::openat(
        &r.parent,
        os(name),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| RootError::Io {
        path: path.to_string(),
        op: "open",
        source: e.into(),
    })?;
    let mut buf = Vec::new();
    std::fs::File::from(fd)
        .take(max)
        .read_to_end(&mut buf)
        .map_err(|e| RootError::Io {
            path: path.to_string(),
            op: "read",
            source: e,
        })?;
    Ok(Some(buf))
}
