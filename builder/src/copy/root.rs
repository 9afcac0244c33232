//! Path resolution inside a root directory, component by component, from a directory fd.
//!
//! Every directory on the way is opened with `O_NOFOLLOW | O_DIRECTORY` relative to the one
//! before it; a symlink met on the way is read and its target resolved *inside* the root (an
//! absolute target restarts at the root, `..` stops at the root), as `openat2`'s
//! `RESOLVE_IN_ROOT` and [`crate::layer`]'s walk do. Nothing outside the root is ever opened,
//! whatever symlinks the tree holds, and a symlink swapped in between a `stat` and an `open`
//! makes the `open` fail instead of being followed. Unlike `openat2`, the walk knows the
//! resolved path, which the build context needs to apply `.dockerignore` to what a symlink
//! points at.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;

/// How many symlinks one resolution may follow (Linux's `MAXSYMLINKS` is 40).
pub const MAX_SYMLINK_HOPS: usize = 40;
/// How deep a resolved path may go, in components.
pub const MAX_DEPTH: usize = 1024;

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
    /// followed inside the root; the last one too when `follow_last`. A missing last
    /// component gives `stat: None`; a missing directory before it is created with `create`
    /// when given, else [`RootError::NotFound`].
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
        let io_err = |op: &'static str, e: Errno| RootError::Io {
            path: shown(),
            op,
            source: e.into(),
        };
        // (directory fd, its name); the root has an empty name and is never popped.
        let mut stack: Vec<(OwnedFd, Vec<u8>)> = vec![(
            self.fd.try_clone().map_err(|e| RootError::Io {
                path: shown(),
                op: "dup",
                source: e,
            })?,
            Vec::new(),
        )];
        let mut queue: std::collections::VecDeque<Vec<u8>> = comps.iter().cloned().collect();
        let mut hops = 0;
        while let Some(c) = queue.pop_front() {
            if c.is_empty() || c == b"." {
                continue;
            }
            if c == b".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            if stack.len() > MAX_DEPTH {
                return Err(RootError::TooDeep { path: shown() });
            }
            let last = queue.iter().all(|q| q.is_empty() || q == b".");
            // The root is never popped, so the stack is never empty.
            let cur = stack.last().map(|(f, _)| f.as_fd()).expect("root stays");
            let st = match rustix::fs::statat(cur, os(&c), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => Some(st),
                Err(Errno::NOENT) => None,
                Err(e) => return Err(io_err("stat", e)),
            };
            let here = |stack: &Vec<(OwnedFd, Vec<u8>)>| -> Vec<Vec<u8>> {
                let mut v: Vec<Vec<u8>> = stack[1..].iter().map(|(_, n)| n.clone()).collect();
                v.push(c.clone());
                v
            };
            let st = match st {
                Some(st) => st,
                None if last => {
                    return Ok(Resolved {
                        parent: cur.try_clone_to_owned().map_err(|e| RootError::Io {
                            path: shown(),
                            op: "dup",
                            source: e,
                        })?,
                        name: Some(c.clone()),
                        comps: here(&stack),
                        stat: None,
                    });
                }
                None => match create {
                    Some(cr) => {
                        rustix::fs::mkdirat(cur, os(&c), Mode::from_raw_mode(cr.mode))
                            .map_err(|e| io_err("mkdir", e))?;
                        let fd = rustix::fs::openat(
                            cur,
                            os(&c),
                            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(|e| io_err("open", e))?;
                        rustix::fs::fchown(
                            &fd,
                            Some(rustix::process::Uid::from_raw(cr.uid)),
                            Some(rustix::process::Gid::from_raw(cr.gid)),
                        )
                        .map_err(|e| io_err("chown", e))?;
                        // mkdir is subject to the umask.
                        rustix::fs::fchmod(&fd, Mode::from_raw_mode(cr.mode))
                            .map_err(|e| io_err("chmod", e))?;
                        stack.push((fd, c));
                        continue;
                    }
                    None => return Err(RootError::NotFound { path: shown() }),
                },
            };
            let ft = FileType::from_raw_mode(st.st_mode);
            if ft == FileType::Symlink && (!last || follow_last) {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(RootError::SymlinkLoop { path: shown() });
                }
                let target = rustix::fs::readlinkat(cur, os(&c), Vec::new())
                    .map_err(|e| io_err("readlink", e))?;
                let target = target.as_bytes();
                if target.first() == Some(&b'/') {
                    stack.truncate(1);
                }
                for t in target.split(|b| *b == b'/').rev() {
                    if !t.is_empty() {
                        queue.push_front(t.to_vec());
                    }
                }
                continue;
            }
            if last {
                return Ok(Resolved {
                    parent: cur.try_clone_to_owned().map_err(|e| RootError::Io {
                        path: shown(),
                        op: "dup",
                        source: e,
                    })?,
                    name: Some(c.clone()),
                    comps: here(&stack),
                    stat: Some(st),
                });
            }
            if ft != FileType::Directory {
                return Err(RootError::NotADirectory { path: shown() });
            }
            let fd = rustix::fs::openat(
                cur,
                os(&c),
                OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| io_err("open", e))?;
            stack.push((fd, c));
        }
        // Ended on a directory reached through `..`, `.`, a symlink, or the root itself.
        let comps_out: Vec<Vec<u8>> = stack[1..].iter().map(|(_, n)| n.clone()).collect();
        if stack.len() == 1 {
            let (fd, _) = stack.pop().expect("root stays");
            let st = rustix::fs::fstat(&fd).map_err(|e| io_err("stat", e))?;
            return Ok(Resolved {
                parent: fd,
                name: None,
                comps: comps_out,
                stat: Some(st),
            });
        }
        let (dir, name) = stack.pop().expect("len > 1");
        let st = rustix::fs::fstat(&dir).map_err(|e| io_err("stat", e))?;
        let (parent, _) = stack.pop().expect("len > 1");
        Ok(Resolved {
            parent,
            name: Some(name),
            comps: comps_out,
            stat: Some(st),
        })
    }
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
