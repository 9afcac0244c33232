//! Applying a layer's entries onto a root directory (see the module doc of `layer`).

use super::*;

/// Applies one layer stream to `root`. `digest` is used in errors only (the caller verifies
/// content). `root` must be a directory; the caller should run as root for devices and owners.
///
/// Errors: see [`LayerError`]; on error the tree may hold part of the layer (never anything
/// outside `root`).
pub fn apply_layer(
    root: &Path,
    layer: impl Read,
    digest: &str,
    limits: &Limits,
) -> Result<LayerStats, LayerError> {
    apply_layer_as(root, layer, None, digest, limits)
}

/// [`apply_layer`] of a stream whose compression is known (`Some`: not sniffed, e.g. a
/// layer's plain tar read from its shared copy, [`super::shared`]), or sniffed (`None`).
pub(crate) fn apply_layer_as(
    root: &Path,
    layer: impl Read,
    compression: Option<Compression>,
    digest: &str,
    limits: &Limits,
) -> Result<LayerStats, LayerError> {
    let root_fd = rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| LayerError::Io {
        digest: digest.to_string(),
        entry: "/".into(),
        op: "open root",
        source: e.into(),
    })?;
    let (stream, bounded) = bounded_stream_as(layer, compression, digest, limits)?;
    let mut applier = Applier {
        root: root_fd,
        digest: digest.to_string(),
        entry: String::from("(start)"),
        created: Created::default(),
        dirs: Vec::new(),
        limits: limits.clone(),
        left_out: 0,
        whiteouts: 0,
        last_walk: RefCell::new(None),
    };
    let mut archive = tar::Archive::new(stream);
    let mut entries_read = 0u64;
    let entries = archive.entries().map_err(|e| bounded.error(e, "(start)"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bounded.error(e, &applier.entry))?;
        entries_read += 1;
        applier.entry = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if entries_read > limits.max_entries {
            return Err(applier.limit(LimitKind::Entries, limits.max_entries));
        }
        match limits.stop() {
            Some(LimitKind::Cancelled) => {
                return Err(LayerError::Cancelled {
                    digest: digest.to_string(),
                    entry: applier.entry.clone(),
                });
            }
            Some(_) => {
                return Err(LayerError::Deadline {
                    digest: digest.to_string(),
                    entry: applier.entry.clone(),
                });
            }
            None => {}
        }
        match applier.apply_entry(&mut entry, &bounded) {
            Ok(()) => {}
            Err(ApplyFail::Layer(e)) => return Err(e),
            Err(ApplyFail::Read(e)) => return Err(bounded.error(e, &applier.entry)),
        }
    }
    applier.finish_dirs()?;
    if applier.left_out > 0 {
        tracing::warn!(
            "layer {digest}: {} device nodes are empty files in the tree steps see: a build \
             without root cannot make them (the image keeps them; COPY --from a stage copies \
             the empty files)",
            applier.left_out
        );
    }
    Ok(LayerStats {
        entries: entries_read,
        bytes: bounded.bytes(),
        whiteouts: applier.whiteouts,
    })
}

/// An entry failed either on our side or while reading its data from the stream.
pub(super) enum ApplyFail {
    Layer(LayerError),
    Read(io::Error),
}

impl From<LayerError> for ApplyFail {
    fn from(e: LayerError) -> Self {
        ApplyFail::Layer(e)
    }
}

pub(super) struct Applier {
    root: OwnedFd,
    digest: String,
    entry: String,
    /// Paths this layer created, with their ancestors.
    created: Created,
    /// Directories whose mtime is set at the end: (components, mtime seconds).
    dirs: Vec<(Vec<Vec<u8>>, u64)>,
    limits: Limits,
    /// Device nodes made empty files, in a user namespace.
    left_out: u64,
    /// Whiteout entries read ([`LayerStats::whiteouts`]).
    whiteouts: u64,
    /// The last walk's result, for the next entry in the same directory
    /// ([`Applier::walk_resolved`]).
    last_walk: RefCell<Option<LastWalk>>,
}

/// A directory a walk reached, with its path from the root (symlinks resolved).
type ResolvedDir = (Rc<OwnedFd>, Vec<Vec<u8>>);

/// A walk [`Applier::walk_resolved`] made: the components it was given and where it ended.
struct LastWalk {
    comps: Vec<Vec<u8>>,
    reached: ResolvedDir,
}

/// An entry name split into its components by [`split_name`] (also used by the ext4
/// flattener, which must place entries exactly as [`apply_layer`] does).
pub(crate) enum Split {
    Ok(Vec<Vec<u8>>),
    DotDot,
    Nul,
}

impl Applier {
    fn limit(&self, kind: LimitKind, max: u64) -> LayerError {
        LayerError::Limit {
            digest: self.digest.clone(),
            entry: self.entry.clone(),
            kind,
            max,
        }
    }

    fn io(&self, op: &'static str, e: impl Into<io::Error>) -> LayerError {
        LayerError::Io {
            digest: self.digest.clone(),
            entry: self.entry.clone(),
            op,
            source: e.into(),
        }
    }

    fn err_entry(&self) -> (String, String) {
        (self.digest.clone(), self.entry.clone())
    }

    /// Walks the directory path `comps` from the root ([`crate::rootfs`]'s walk: symlinks
    /// followed inside the root, a `..` above it refused) and returns the fd of the
    /// directory reached. Missing directories are made (0755, root) when `create`; otherwise
    /// `Ok(None)` is returned for a missing component.
    fn walk(&self, comps: &[Vec<u8>], create: bool) -> Result<Option<Rc<OwnedFd>>, LayerError> {
        Ok(self.walk_resolved(comps, create)?.map(|(fd, _)| fd))
    }

    /// [`Applier::walk`], with the path of the directory reached, symlinks resolved (what
    /// [`Applier::created`] is keyed by: the flattener sees one node under every path that
    /// leads to it).
    ///
    /// The same `comps` as the walk before gives that walk's result again, without a
    /// system call: a layer lists a directory's entries one after the other, and a walk
    /// costs a `stat`, an `open` and a `close` per component. It is the result a new walk
    /// would give, because nothing the walk went through has changed since: each entry
    /// walks to its parent first (replacing the remembered walk unless it is the same), and
    /// then changes only names in that parent or below it (a removal, a replacement, a
    /// directory's owner and mode), never a directory or symlink on the way to it: the way
    /// to a directory never passes below it. That holds only for a walk that followed no
    /// symlink, so only such a walk is remembered (its resolved path is `comps` itself). A
    /// walk through a symlink may end above a component it went through (`a -> .` makes
    /// `a/x`'s parent the root, where `a` itself lives): the entry `a/a` then replaces the
    /// symlink `a` with a file, and the next entry `a/.wh.b` must find `a` no directory,
    /// as a new walk does (found by the `layer_tree_equivalence` fuzz target, where the
    /// flattener refused that whiteout and the apply, reusing the walk, took it). A walk
    /// that failed or found a directory missing is not remembered either.
    fn walk_resolved(
        &self,
        comps: &[Vec<u8>],
        create: bool,
    ) -> Result<Option<ResolvedDir>, LayerError> {
        if let Some(last) = self.last_walk.borrow().as_ref()
            && last.comps == comps
        {
            return Ok(Some((last.reached.0.clone(), last.reached.1.clone())));
        }
        let how = Walk::layer_parents(create);
        let (digest, entry) = self.err_entry();
        match walk_fd(self.root.as_fd(), comps, &how, None) {
            Ok(mut reached) => {
                let path: Vec<Vec<u8>> = reached.dirs[1..].iter().map(|(_, n)| n.clone()).collect();
                let Some((fd, _)) = reached.dirs.pop() else {
                    return Ok(None);
                };
                let fd = Rc::new(fd);
                *self.last_walk.borrow_mut() = (path == comps).then(|| LastWalk {
                    comps: comps.to_vec(),
                    reached: (fd.clone(), path.clone()),
                });
                Ok(Some((fd, path)))
            }
            Err(WalkError::Missing) => Ok(None),
            Err(WalkError::Tree(e)) => Err(self.io(e.op, e.errno)),
            Err(WalkError::Escape) => Err(LayerError::SymlinkEscape { digest, entry }),
            Err(WalkError::Loop) => Err(LayerError::SymlinkLoop { digest, entry }),
            Err(WalkError::TooDeep) => Err(LayerError::TooDeep { digest, entry }),
            Err(WalkError::NotADirectory) => Err(LayerError::NotADirectory { digest, entry }),
        }
    }

    fn mark_created(&mut self, comps: &[Vec<u8>]) {
        self.created.insert(comps);
    }

    fn meta(&self, entry: &mut tar::Entry<'_, impl Read>) -> Result<Meta, ApplyFail> {
        read_meta(entry).map_err(ApplyFail::Read)
    }

    /// What a whiteout does to `name` in `dir` (whose path, symlinks resolved, is `path`):
    /// removes it and everything below it that this layer has not made
    /// ([`Applier::created`]), and keeps what it made, at any depth: a whiteout hides only
    /// lower layers' entries, whatever its place in the stream ([`whiteout`]). `path` is
    /// returned as it was given.
    fn remove_lower(
        &self,
        dir: BorrowedFd<'_>,
        path: &mut Vec<Vec<u8>>,
        name: &[u8],
        depth: usize,
    ) -> Result<(), LayerError> {
        self.remove_tree(dir, name, depth, Some(path))
    }

    /// Removes `name` in `dir`, recursively for directories, never following symlinks.
    fn remove_all(&self, dir: BorrowedFd<'_>, name: &[u8], depth: usize) -> Result<(), LayerError> {
        self.remove_tree(dir, name, depth, None)
    }

    /// The one removal walk: `name` in `dir` and everything below it, never following
    /// symlinks, at most [`MAX_DEPTH`] deep. With `spare` (the path of `dir`, symlinks
    /// resolved), what this layer made ([`Applier::created`]) stays, its lower entries
    /// going; below a path it did not make it made nothing (the record holds every made
    /// path's ancestors), so nothing is spared there. `spare` is returned as it was given.
    fn remove_tree(
        &self,
        dir: BorrowedFd<'_>,
        name: &[u8],
        depth: usize,
        mut spare: Option<&mut Vec<Vec<u8>>>,
    ) -> Result<(), LayerError> {
        let st = match rustix::fs::statat(dir, os(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(self.io("stat for removal", e)),
        };
        if let Some(path) = spare.as_deref_mut() {
            path.push(name.to_vec());
        }
        let keep = spare.as_deref().is_some_and(|p| self.created.contains(p));
        let r = self.remove_node(
            dir,
            name,
            depth,
            &st,
            keep,
            spare.as_deref_mut().filter(|_| keep),
        );
        if let Some(path) = spare {
            path.pop();
        }
        r
    }

    /// [`Applier::remove_tree`] once `name` is stat'ed (`st`): its children, then `name`
    /// itself unless `keep`.
    fn remove_node(
        &self,
        dir: BorrowedFd<'_>,
        name: &[u8],
        depth: usize,
        st: &rustix::fs::Stat,
        keep: bool,
        mut spare: Option<&mut Vec<Vec<u8>>>,
    ) -> Result<(), LayerError> {
        if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
            if keep {
                return Ok(());
            }
            return rustix::fs::unlinkat(dir, os(name), AtFlags::empty())
                .map_err(|e| self.io("unlink", e));
        }
        if depth > MAX_DEPTH {
            let (digest, entry) = self.err_entry();
            return Err(LayerError::TooDeep { digest, entry });
        }
        let fd = rustix::fs::openat(
            dir,
            os(name),
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| self.io("open for removal", e))?;
        for child in self.list(fd.as_fd())? {
            self.remove_tree(fd.as_fd(), &child, depth + 1, spare.as_deref_mut())?;
        }
        if keep {
            return Ok(());
        }
        rustix::fs::unlinkat(dir, os(name), AtFlags::REMOVEDIR).map_err(|e| self.io("rmdir", e))
    }

    fn list(&self, dir: BorrowedFd<'_>) -> Result<Vec<Vec<u8>>, LayerError> {
        crate::rootfs::root::dir_names(dir).map_err(|e| self.io("readdir", e))
    }

    fn apply_entry(
        &mut self,
        entry: &mut tar::Entry<'_, impl Read>,
        bounded: &BoundedStream,
    ) -> Result<(), ApplyFail> {
        let raw = entry.path_bytes().into_owned();
        let comps = match split_name(&raw) {
            Split::Ok(c) => c,
            Split::DotDot => {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::DotDot { digest, entry }.into());
            }
            Split::Nul => {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::NulInName { digest, entry }.into());
            }
        };
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            return Ok(());
        }
        let Some((base, parent)) = comps.split_last() else {
            // The root itself ("./"): its metadata is the caller's.
            return Ok(());
        };
        let wh = WhiteoutKind::parse(base).map_err(|source| {
            let (digest, entry) = self.err_entry();
            LayerError::Whiteout {
                digest,
                entry,
                source,
            }
        })?;
        match wh {
            WhiteoutKind::None => {}
            WhiteoutKind::Meta => return Ok(()),
            WhiteoutKind::Remove(name) => {
                self.whiteouts += 1;
                let Some((dir, resolved)) = self.walk_resolved(parent, false)? else {
                    return Ok(());
                };
                let mut path = resolved;
                self.remove_lower(dir.as_fd(), &mut path, name, 0)?;
                return Ok(());
            }
            WhiteoutKind::Opaque => {
                self.whiteouts += 1;
                let Some((dir, mut resolved)) = self.walk_resolved(parent, true)? else {
                    return Ok(());
                };
                for child in self.list(dir.as_fd())? {
                    self.remove_lower(dir.as_fd(), &mut resolved, &child, 0)?;
                }
                self.mark_created(&resolved);
                return Ok(());
            }
        }
        let meta = self.meta(entry)?;
        let (dir, mut resolved) = self
            .walk_resolved(parent, true)?
            .ok_or_else(|| self.io("walk", io::Error::from(io::ErrorKind::NotFound)))?;
        resolved.push(base.clone());
        let dir = dir.as_fd();
        use tar::EntryType as T;
        // What is at the name already. A regular file's is found by its exclusive create
        // instead ([`Applier::create_file`]): most names are new.
        let existing = match kind {
            T::Regular | T::Continuous | T::GNUSparse => None,
            _ => match rustix::fs::statat(dir, os(base), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => Some(FileType::from_raw_mode(st.st_mode)),
                Err(Errno::NOENT) => None,
                Err(e) => return Err(self.io("stat", e).into()),
            },
        };
        match kind {
            T::Directory => {
                if existing.is_some_and(|t| t != FileType::Directory) {
                    self.remove_all(dir, base, 0)?;
                }
                if existing != Some(FileType::Directory) {
                    rustix::fs::mkdirat(dir, os(base), Mode::from_raw_mode(0o700))
                        .map_err(|e| self.io("mkdirat", e))?;
                }
                let fd = rustix::fs::openat(
                    dir,
                    os(base),
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| self.io("open dir", e))?;
                self.set_fd_meta(fd.as_fd(), &meta)?;
                self.dirs.push((comps.clone(), meta.mtime));
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                let extents = bounded.extents(entry).map_err(ApplyFail::Read)?;
                if extents.size > self.limits.max_file_bytes {
                    return Err(self
                        .limit(LimitKind::FileBytes, self.limits.max_file_bytes)
                        .into());
                }
                let file = std::fs::File::from(self.create_file(dir, base, existing.is_some())?);
                let mut data = DataReader::new(entry, &extents);
                let mut buf = vec![0u8; 128 << 10];
                let mut end = 0;
                while let Some((off, n)) = data.next_piece(&mut buf).map_err(ApplyFail::Read)? {
                    let written = write_skipping_zero_blocks(&file, off, &buf[..n])
                        .map_err(|e| self.io("write", e))?;
                    end = end.max(written);
                }
                // A hole at the end (a sparse file's, or zero blocks left out) is made by the
                // length; a file written to its end has it already.
                if end != extents.size {
                    file.set_len(extents.size)
                        .map_err(|e| self.io("set length", e))?;
                }
                self.set_fd_meta(file.as_fd(), &meta)?;
                self.set_mtime(dir, base, meta.mtime)?;
            }
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.io("symlink", io::Error::other("no link target")))?
                    .into_owned();
                if existing.is_some() {
                    self.remove_all(dir, base, 0)?;
                }
                rustix::fs::symlinkat(os(&target), dir, os(base))
                    .map_err(|e| self.io("symlinkat", e))?;
                self.chown_at(dir, base, &meta)?;
                self.set_path_xattrs(dir, base, &meta)?;
                self.set_mtime(dir, base, meta.mtime)?;
            }
            T::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| self.io("link", io::Error::other("no link target")))?
                    .into_owned();
                self.hard_link(dir, base, &target, existing.is_some())?;
            }
            T::Char | T::Block if crate::exec::rootless::in_user_namespace() => {
                // No device node can be made in a user namespace (mknod(2) needs CAP_MKNOD
                // in the host's). The layer, and the image made from the layers, keep it;
                // the tree steps see has an empty regular file in its place, with its owner
                // and mode, so that an entry of a lower layer it replaced does not show
                // through and a hard link to it is one too. (A whiteout would hide a lower
                // entry too, but in a directory no lower layer has, overlayfs lists it and
                // stat answers ENOENT.) Moby's, containerd's and containers/storage's
                // appliers leave the node out there.
                let fd = self.create_file(dir, base, existing.is_some())?;
                self.set_fd_meta(fd.as_fd(), &meta)?;
                drop(fd);
                self.set_mtime(dir, base, meta.mtime)?;
                self.left_out += 1;
            }
            T::Char | T::Block | T::Fifo => {
                let h = entry.header();
                let major = h.device_major().ok().flatten().unwrap_or(0);
                let minor = h.device_minor().ok().flatten().unwrap_or(0);
                let ft = match kind {
                    T::Char => FileType::CharacterDevice,
                    T::Block => FileType::BlockDevice,
                    _ => FileType::Fifo,
                };
                if existing.is_some() {
                    self.remove_all(dir, base, 0)?;
                }
                rustix::fs::mknodat(
                    dir,
                    os(base),
                    ft,
                    Mode::from_raw_mode(0o600),
                    rustix::fs::makedev(major, minor),
                )
                .map_err(|e| self.io("mknodat", e))?;
                self.chown_at(dir, base, &meta)?;
                rustix::fs::chmodat(
                    dir,
                    os(base),
                    Mode::from_raw_mode(meta.mode),
                    AtFlags::empty(),
                )
                .map_err(|e| self.io("chmodat", e))?;
                self.set_path_xattrs(dir, base, &meta)?;
                self.set_mtime(dir, base, meta.mtime)?;
            }
            other => {
                let (digest, entry) = self.err_entry();
                return Err(LayerError::UnsupportedType {
                    digest,
                    entry,
                    kind: other.as_byte() as char,
                }
                .into());
            }
        }
        self.mark_created(&resolved);
        Ok(())
    }

    fn hard_link(
        &self,
        dir: BorrowedFd<'_>,
        base: &[u8],
        target: &[u8],
        existing: bool,
    ) -> Result<(), LayerError> {
        let tname = String::from_utf8_lossy(target).into_owned();
        let escape = || LayerError::HardLinkEscape {
            digest: self.digest.clone(),
            entry: self.entry.clone(),
            target: tname.clone(),
        };
        let tcomps = match split_name(target) {
            Split::Ok(c) => c,
            _ => return Err(escape()),
        };
        let Some((tbase, tparent)) = tcomps.split_last() else {
            return Err(LayerError::HardLinkToDirectory {
                digest: self.digest.clone(),
                entry: self.entry.clone(),
                target: tname,
            });
        };
        let tdir = match self.walk(tparent, false) {
            Ok(Some(d)) => d,
            Ok(None) => {
                return Err(LayerError::HardLinkMissing {
                    digest: self.digest.clone(),
                    entry: self.entry.clone(),
                    target: tname,
                });
            }
            Err(LayerError::SymlinkEscape { .. }) => return Err(escape()),
            Err(e) => return Err(e),
        };
        let st = match rustix::fs::statat(&tdir, os(tbase), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => {
                return Err(LayerError::HardLinkMissing {
                    digest: self.digest.clone(),
                    entry: self.entry.clone(),
                    target: tname,
                });
            }
            Err(e) => return Err(self.io("stat link target", e)),
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            return Err(LayerError::HardLinkToDirectory {
                digest: self.digest.clone(),
                entry: self.entry.clone(),
                target: tname,
            });
        }
        if existing {
            if let Ok(cur) = rustix::fs::statat(dir, os(base), AtFlags::SYMLINK_NOFOLLOW)
                && cur.st_ino == st.st_ino
                && cur.st_dev == st.st_dev
            {
                return Ok(());
            }
            self.remove_all(dir, base, 0)?;
        }
        // The target gone now was below what the link replaced (`d` linked to `d/f`).
        rustix::fs::linkat(&tdir, os(tbase), dir, os(base), AtFlags::empty()).map_err(|e| {
            if e == Errno::NOENT {
                LayerError::HardLinkMissing {
                    digest: self.digest.clone(),
                    entry: self.entry.clone(),
                    target: tname.clone(),
                }
            } else {
                self.io("linkat", e)
            }
        })
    }

    /// Creates the regular file `base` in `dir` (mode 0600 until its metadata is set),
    /// removing what is there first: when `existing` says something is, or when the
    /// exclusive create finds something (a symlink there is removed, never followed).
    fn create_file(
        &self,
        dir: BorrowedFd<'_>,
        base: &[u8],
        existing: bool,
    ) -> Result<OwnedFd, LayerError> {
        if existing {
            self.remove_all(dir, base, 0)?;
        }
        let create = || {
            rustix::fs::openat(
                dir,
                os(base),
                OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
        };
        match create() {
            Err(Errno::EXIST) if !existing => {
                self.remove_all(dir, base, 0)?;
                create()
            }
            r => r,
        }
        .map_err(|e| self.io("create file", e))
    }

    fn chown_at(&self, dir: BorrowedFd<'_>, base: &[u8], m: &Meta) -> Result<(), LayerError> {
        rustix::fs::chownat(
            dir,
            os(base),
            Some(Uid::from_raw(m.uid)),
            Some(Gid::from_raw(m.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.owner_err("chown", e, m))
    }

    /// The error of chown(2) of an entry to `m`'s owner: [`LayerError::UnmappedOwner`] for
    /// `EINVAL` in a user namespace, else [`LayerError::Io`].
    fn owner_err(&self, op: &'static str, e: rustix::io::Errno, m: &Meta) -> LayerError {
        if e == rustix::io::Errno::INVAL && crate::exec::rootless::in_user_namespace() {
            return LayerError::UnmappedOwner {
                digest: self.digest.clone(),
                entry: self.entry.clone(),
                uid: m.uid,
                gid: m.gid,
            };
        }
        self.io(op, e)
    }

    /// Owner, then mode (chown clears setuid/setgid), then xattrs, on an open file or dir.
    fn set_fd_meta(&self, fd: BorrowedFd<'_>, m: &Meta) -> Result<(), LayerError> {
        rustix::fs::fchown(fd, Some(Uid::from_raw(m.uid)), Some(Gid::from_raw(m.gid)))
            .map_err(|e| self.owner_err("fchown", e, m))?;
        rustix::fs::fchmod(fd, Mode::from_raw_mode(m.mode)).map_err(|e| self.io("fchmod", e))?;
        for (k, v) in &m.xattrs {
            rustix::fs::fsetxattr(fd, os(k), v, XattrFlags::empty())
                .map_err(|e| self.io("fsetxattr", e))?;
        }
        Ok(())
    }

    /// Xattrs on a symlink or device, through `/proc/self/fd/<dir>/<name>` with `lsetxattr`
    /// (there is no `setxattrat` before Linux 6.13).
    fn set_path_xattrs(
        &self,
        dir: BorrowedFd<'_>,
        base: &[u8],
        m: &Meta,
    ) -> Result<(), LayerError> {
        if m.xattrs.is_empty() {
            return Ok(());
        }
        use std::os::fd::AsRawFd;
        let mut p = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
        p.extend_from_slice(base);
        for (k, v) in &m.xattrs {
            rustix::fs::lsetxattr(os(&p), os(k), v, XattrFlags::empty())
                .map_err(|e| self.io("lsetxattr", e))?;
        }
        Ok(())
    }

    fn set_mtime(&self, dir: BorrowedFd<'_>, base: &[u8], mtime: u64) -> Result<(), LayerError> {
        let t = Timespec {
            tv_sec: mtime.min(i64::MAX as u64) as i64,
            tv_nsec: 0,
        };
        rustix::fs::utimensat(
            dir,
            os(base),
            &Timestamps {
                last_access: t,
                last_modification: t,
            },
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io("utimensat", e))
    }

    /// Sets the directories' mtimes, deepest first, once all their content is in place.
    fn finish_dirs(&mut self) -> Result<(), LayerError> {
        let mut dirs = std::mem::take(&mut self.dirs);
        dirs.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        for (comps, mtime) in dirs {
            self.entry = String::from_utf8_lossy(&comps.join(&b'/')).into_owned();
            let Some((base, parent)) = comps.split_last() else {
                continue;
            };
            // A directory removed by a later whiteout of the same layer is simply skipped.
            let Ok(Some(dir)) = self.walk(parent, false) else {
                continue;
            };
            match rustix::fs::statat(&dir, os(base), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                    self.set_mtime(dir.as_fd(), base, mtime)?
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Block size of the zero test in [`write_skipping_zero_blocks`], bytes (ext4's, and the
/// page size).
pub(super) const ZERO_BLOCK: u64 = 4096;

/// Writes `data` at `off` into a new file, leaving out every 4 KiB block (aligned to the
/// file's start) that is all zero: the file is new, so those read back as zeros, and they
/// stay holes (a layer written without sparse entries, or a sparse file's data with zero
/// runs, costs no blocks for them). Returns the end of the last block written (bytes from
/// the file's start; 0 when every block was zero): the file's length now, if nothing was
/// written further on before.
pub(super) fn write_skipping_zero_blocks(
    file: &std::fs::File,
    off: u64,
    data: &[u8],
) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    // Runs of blocks that are not all zero are written with one call each.
    let mut run: Option<usize> = None;
    let mut pos = 0usize;
    let mut end = 0u64;
    while pos < data.len() {
        let at = off + pos as u64;
        let n = ((ZERO_BLOCK - at % ZERO_BLOCK) as usize).min(data.len() - pos);
        let zero = kiln_store::chunk::is_all_zero(&data[pos..pos + n]);
        match (zero, run) {
            (false, None) => run = Some(pos),
            (true, Some(start)) => {
                file.write_all_at(&data[start..pos], off + start as u64)?;
                end = off + pos as u64;
                run = None;
            }
            _ => {}
        }
        pos += n;
    }
    if let Some(start) = run {
        file.write_all_at(&data[start..], off + start as u64)?;
        end = off + data.len() as u64;
    }
    Ok(end)
}
