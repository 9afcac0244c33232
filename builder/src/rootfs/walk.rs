//! The one walk of a path inside a root, over any tree: a directory of the host (through
//! descriptors, [`super::root`]) or the ext4 flattener's model of the image in memory.
//!
//! Components are taken one at a time from a queue. A symlink met on the way puts its
//! target's components in front of the rest: an absolute target restarts at the root, and a
//! `..` never leaves it (it stays at the root, as `openat2`'s `RESOLVE_IN_ROOT` does, or is
//! refused, as the layer appliers do: [`AboveRoot`]). Nothing is ever looked up outside the
//! root, whatever the tree holds. At most [`MAX_SYMLINK_HOPS`] symlinks are followed and at
//! most [`MAX_DEPTH`] directories entered below the root.

use std::collections::VecDeque;

use super::{MAX_DEPTH, MAX_SYMLINK_HOPS};

/// What a tree holds under one name of a directory.
#[derive(Debug)]
pub(crate) enum Lookup<L> {
    /// Nothing.
    Missing,
    /// A directory.
    Dir(L),
    /// A symlink.
    Symlink(L),
    /// Anything else: a file, a device, a FIFO, a socket.
    Other(L),
}

/// A tree a path is walked in: [`walk`] asks it about one name at a time and never gives it
/// a path. `Dir` is an open directory (a descriptor, or a path in a model); `Leaf` is what a
/// lookup learnt about a name (a `stat`, an inode number).
pub(crate) trait Tree {
    /// An entered directory.
    type Dir;
    /// What [`Tree::lookup`] learnt about a name.
    type Leaf;
    /// A failure of the tree itself (a system call).
    type Error;
    /// What `dir` holds under `name` (never `.` or `..`), without following it.
    fn lookup(&mut self, dir: &Self::Dir, name: &[u8]) -> Result<Lookup<Self::Leaf>, Self::Error>;
    /// The target of the symlink `name` in `dir` that [`Tree::lookup`] found.
    fn read_link(
        &mut self,
        dir: &Self::Dir,
        name: &[u8],
        leaf: &Self::Leaf,
    ) -> Result<Vec<u8>, Self::Error>;
    /// Enters the directory `name` of `dir` that [`Tree::lookup`] found (never following
    /// a symlink swapped in since).
    fn enter(
        &mut self,
        dir: &Self::Dir,
        name: &[u8],
        leaf: Self::Leaf,
    ) -> Result<Self::Dir, Self::Error>;
    /// Makes the missing directory `name` in `dir` and enters it (only when
    /// [`Walk::create`]).
    fn make_dir(&mut self, dir: &Self::Dir, name: &[u8]) -> Result<Self::Dir, Self::Error>;
    /// Removes the non-directory `name` of `dir` (a symlink is removed, not followed), makes
    /// a directory there and enters it (only when [`Walk::replace`]).
    fn replace_with_dir(&mut self, dir: &Self::Dir, name: &[u8]) -> Result<Self::Dir, Self::Error>;
}

/// What a `..` at the root does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AboveRoot {
    /// Stays at the root (`openat2`'s `RESOLVE_IN_ROOT`, `COPY` sources and destinations).
    Stay,
    /// Is refused ([`WalkError::Escape`]): a layer entry or hard link leading above the root.
    Refuse,
}

/// How to walk.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Walk {
    /// Every component names a directory (a parent path): the walk ends inside the last
    /// one. Otherwise the last component may be anything, and may be missing.
    pub dirs_only: bool,
    /// Symlinks on the way are followed (inside the root). When not, a symlink on the way
    /// is [`WalkError::NotADirectory`] (or replaced, [`Walk::replace`]).
    pub follow: bool,
    /// A symlink as the last component is followed too (only with `follow` and without
    /// `dirs_only`, under which every symlink on the way is).
    pub follow_last: bool,
    /// A non-directory on the way (not followed) is replaced by an empty directory
    /// ([`Tree::replace_with_dir`]): a layer's parent directories hiding what a lower layer
    /// had there, as overlayfs shows them.
    pub replace: bool,
    /// A missing directory on the way is made ([`Tree::make_dir`]); otherwise it is
    /// [`WalkError::Missing`].
    pub create: bool,
    /// What a `..` at the root does.
    pub above_root: AboveRoot,
}

impl Walk {
    /// A path inside the root, as `openat2`'s `RESOLVE_IN_ROOT` resolves it (a `..` at the
    /// root stays there): symlinks on the way followed, the last one when `follow_last`;
    /// the last component may be anything, or missing.
    pub(crate) fn in_root(follow_last: bool, create: bool) -> Walk {
        Walk {
            dirs_only: false,
            follow: true,
            follow_last,
            create,
            replace: false,
            above_root: AboveRoot::Stay,
        }
    }

    /// A layer entry's parent directories, as layer apply and the ext4 flattener resolve
    /// them: symlinks followed inside the root, a `..` above it refused; missing
    /// directories made when `create`.
    pub(crate) fn layer_parents(create: bool) -> Walk {
        Walk {
            dirs_only: true,
            follow: true,
            follow_last: true,
            create,
            replace: false,
            above_root: AboveRoot::Refuse,
        }
    }

    /// A layer's own directories in overlayfs' form: no symlink followed; missing
    /// directories made when `create`, non-directories replaced when `replace`.
    pub(crate) fn own_dirs(create: bool, replace: bool) -> Walk {
        Walk {
            dirs_only: true,
            follow: false,
            follow_last: false,
            create,
            replace,
            above_root: AboveRoot::Refuse,
        }
    }
}

/// Why a walk stopped.
#[derive(Debug)]
pub(crate) enum WalkError<E> {
    /// The tree failed.
    Tree(E),
    /// A directory on the way is missing (and the walk does not create).
    Missing,
    /// A component on the way is neither a directory nor a symlink.
    NotADirectory,
    /// A `..` at the root, under [`AboveRoot::Refuse`].
    Escape,
    /// More than [`MAX_SYMLINK_HOPS`] symlinks followed.
    Loop,
    /// More than [`MAX_DEPTH`] directories below the root.
    TooDeep,
}

impl<E> From<E> for WalkError<E> {
    fn from(e: E) -> Self {
        WalkError::Tree(e)
    }
}

/// Where a walk ended.
#[derive(Debug)]
pub(crate) struct Reached<D, L> {
    /// The directories entered, the root first (its name empty), each with its name: the
    /// path walked, symlinks resolved.
    pub dirs: Vec<(D, Vec<u8>)>,
    /// The last component, when the walk did not enter it: its name in the last of `dirs`
    /// and what the lookup found (`None`: missing). `None` when the path ended on a
    /// directory entered (through `..`, `.`, a symlink followed, or the root itself), and
    /// always under [`Walk::dirs_only`].
    pub last: Option<(Vec<u8>, Option<L>)>,
}

/// What [`walk`] gives in `T`.
pub(crate) type WalkResult<T> =
    Result<Reached<<T as Tree>::Dir, <T as Tree>::Leaf>, WalkError<<T as Tree>::Error>>;

/// Walks `comps` (components; empty and `.` ones skipped, `..` kept; a component followed only
/// by `.` or empty ones must be a directory, as before a trailing `/`) from `root` in `tree`.
pub(crate) fn walk<T: Tree>(
    tree: &mut T,
    root: T::Dir,
    comps: &[Vec<u8>],
    how: &Walk,
) -> WalkResult<T> {
    let mut dirs: Vec<(T::Dir, Vec<u8>)> = vec![(root, Vec::new())];
    let mut queue: VecDeque<Vec<u8>> = comps.iter().cloned().collect();
    let mut hops = 0;
    while let Some(c) = queue.pop_front() {
        if c.is_empty() || c == b"." {
            continue;
        }
        if c == b".." {
            if dirs.len() > 1 {
                dirs.pop();
            } else if how.above_root == AboveRoot::Refuse {
                return Err(WalkError::Escape);
            }
            continue;
        }
        if dirs.len() > MAX_DEPTH {
            return Err(WalkError::TooDeep);
        }
        // A component followed only by `.` or empty ones (a trailing `/`) is not the last:
        // it must be a directory, and a symlink there is followed, as the kernel does.
        let last = !how.dirs_only && queue.is_empty();
        // The root is never popped: `dirs` is never empty.
        let cur = &dirs[dirs.len() - 1].0;
        match tree.lookup(cur, &c)? {
            Lookup::Missing if last => {
                return Ok(Reached {
                    dirs,
                    last: Some((c, None)),
                });
            }
            Lookup::Missing if how.create => {
                let d = tree.make_dir(cur, &c)?;
                dirs.push((d, c));
            }
            Lookup::Missing => return Err(WalkError::Missing),
            Lookup::Symlink(leaf) if how.follow && (!last || how.follow_last) => {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(WalkError::Loop);
                }
                let target = tree.read_link(cur, &c, &leaf)?;
                if target.first() == Some(&b'/') {
                    dirs.truncate(1);
                }
                // A target ending in `/` names a directory (`ENOTDIR` otherwise).
                if target.len() > 1 && target.last() == Some(&b'/') {
                    queue.push_front(b".".to_vec());
                }
                for t in target.split(|b| *b == b'/').rev() {
                    if !t.is_empty() {
                        queue.push_front(t.to_vec());
                    }
                }
            }
            Lookup::Dir(leaf) | Lookup::Symlink(leaf) | Lookup::Other(leaf) if last => {
                return Ok(Reached {
                    dirs,
                    last: Some((c, Some(leaf))),
                });
            }
            Lookup::Dir(leaf) => {
                let d = tree.enter(cur, &c, leaf)?;
                dirs.push((d, c));
            }
            Lookup::Symlink(_) | Lookup::Other(_) if how.replace => {
                let d = tree.replace_with_dir(cur, &c)?;
                dirs.push((d, c));
            }
            Lookup::Symlink(_) | Lookup::Other(_) => return Err(WalkError::NotADirectory),
        }
    }
    Ok(Reached { dirs, last: None })
}
