//! Copying the selected items into the destination root, inside it, and recognising
//! archives `ADD` unpacks.

use super::*;

pub(super) struct Copier<'a> {
    pub(super) dest: Root,
    pub(super) meta: Meta,
    pub(super) filter: &'a Filter<'a>,
    /// `filter` without `.dockerignore`, for a git checkout (not the context).
    pub(super) plain_filter: Filter<'a>,
    /// Copying a git checkout: `plain_filter`, and root as the owner unless `--chown`.
    pub(super) in_git: bool,
    pub(super) limits: CopyLimits,
    pub(super) tar_limits: TarLimits,
    pub(super) unpack: bool,
    pub(super) report: CopyReport,
    /// The source currently copied, as written (for errors).
    pub(super) shown: String,
}

pub(super) fn copy_inner(
    step: &CopyStep,
    src: &Sources,
    dest_root: &Path,
    opts: &CopyOptions,
) -> Result<CopyReport, CopyError> {
    if step.checksum.is_some()
        && step
            .sources
            .iter()
            .any(|s| !matches!(s, CopySource::Url { .. }))
    {
        return Err(CopyError::Unsupported(
            "ADD --checksum with a source that is not a URL".into(),
        ));
    }
    let chmod = match &step.chmod {
        Some(s) => Some(Chmod::parse(s).map_err(|reason| CopyError::Chmod {
            spec: s.clone(),
            reason,
        })?),
        None => None,
    };
    let chown = match &step.chown {
        Some(s) => Some(resolve_chown(
            s,
            opts.user_db_root.as_deref().unwrap_or(dest_root),
        )?),
        None => None,
    };
    let src_root = Root::open(src.dir()).map_err(|e| CopyError::Io {
        path: src.dir().display().to_string(),
        op: "open source root",
        source: e,
    })?;
    let filter = Filter::new(step, src)?;
    let items = select(step, src, &src_root, &filter)?;
    let dest = Root::open(dest_root).map_err(|e| CopyError::Io {
        path: dest_root.display().to_string(),
        op: "open destination root",
        source: e,
    })?;
    let mut c = Copier {
        dest,
        meta: Meta {
            chown,
            chmod,
            context: src.is_context(),
            git: false,
        },
        filter: &filter,
        plain_filter: filter.without_ignore(),
        in_git: false,
        limits: opts.limits,
        tar_limits: opts.tar_limits.clone(),
        unpack: step.unpack,
        report: CopyReport::default(),
        shown: String::new(),
    };
    let dest_comps = components(&step.dest);
    let slash = step.dest.ends_with('/') || step.dest.ends_with("/.") || dest_comps.is_empty();
    let existing_dir = {
        let r = c.dest.resolve(&dest_comps, true, None);
        matches!(r, Ok(Resolved { stat: Some(st), .. })
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory)
    };
    let into_dir = slash || existing_dir || step.parents;
    if items.len() > 1 && !into_dir {
        return Err(CopyError::NeedsDirectory {
            dest: step.dest.clone(),
        });
    }
    for item in &items {
        c.copy_item(item, &dest_comps, into_dir, step.parents, &step.dest)?;
    }
    Ok(c.report)
}

impl Copier<'_> {
    pub(super) fn create(&self) -> Create {
        let (uid, gid) = self.meta.parent_owner();
        Create {
            mode: 0o755,
            uid,
            gid,
        }
    }

    pub(super) fn resolve_err(&self, source: RootError) -> CopyError {
        CopyError::Resolve {
            path: self.shown.clone(),
            source,
        }
    }

    /// The directory at `comps` in the destination (symlinks followed inside the root),
    /// created (with missing parents) when missing; `new_meta` gives the created one's
    /// owner and mode. Returns its fd and its resolved path.
    pub(super) fn dest_dir(
        &mut self,
        comps: &[Vec<u8>],
        new_meta: Option<(u32, u32, u32)>,
    ) -> Result<(OwnedFd, Vec<Vec<u8>>), CopyError> {
        let create = self.create();
        let r = self
            .dest
            .resolve(comps, true, Some(create))
            .map_err(|e| self.resolve_err(e))?;
        let shown = format!("/{}", lossy(comps));
        match (&r.stat, &r.name) {
            (Some(st), _) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                let fd = r.open_dir().map_err(|e| CopyError::Io {
                    path: shown,
                    op: "open",
                    source: e,
                })?;
                Ok((fd, r.comps))
            }
            (None, Some(name)) => {
                let (uid, gid, mode) = new_meta.unwrap_or((create.uid, create.gid, 0o755));
                let fd = create_owned_dir(r.parent.as_fd(), name, uid, gid, mode, &shown)?;
                self.report.dirs += 1;
                Ok((fd, r.comps))
            }
            _ => Err(CopyError::NotADirectory { dest: shown }),
        }
    }

    pub(super) fn count_entry(&mut self) -> Result<(), CopyError> {
        let n = self.report.files + self.report.dirs + self.report.symlinks + self.report.specials;
        if n >= self.limits.max_entries {
            return Err(CopyError::Limit {
                path: self.shown.clone(),
                what: "entry count",
                max: self.limits.max_entries,
            });
        }
        Ok(())
    }

    pub(super) fn copy_item(
        &mut self,
        item: &Item,
        dest: &[Vec<u8>],
        into_dir: bool,
        parents: bool,
        dest_shown: &str,
    ) -> Result<(), CopyError> {
        match item {
            Item::Path {
                shown,
                node,
                keep,
                name,
            } => {
                self.shown = shown.clone();
                let st = node.stat.expect("selected items exist");
                let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
                // Where the item lands.
                let mut target: Vec<Vec<u8>> = dest.to_vec();
                if parents {
                    target.extend(keep.iter().cloned());
                } else if into_dir && !is_dir {
                    target.push(name.clone());
                }
                if is_dir {
                    let (uid, gid) = self.meta.owner(&st);
                    let mode = self.meta.mode(st.st_mode, true);
                    let (dfd, dcomps) = self.dest_dir(&target, Some((uid, gid, mode)))?;
                    let sfd = node.open_dir().map_err(|e| CopyError::Io {
                        path: shown.clone(),
                        op: "open",
                        source: e,
                    })?;
                    return self.copy_dir(sfd.as_fd(), &node.rel(), "", dfd.as_fd(), &dcomps, 0);
                }
                let Some(src_name) = &node.name else {
                    return Err(CopyError::NotFound {
                        path: shown.clone(),
                        ignored: false,
                    });
                };
                if self.unpack && FileType::from_raw_mode(st.st_mode) == FileType::RegularFile {
                    let (fd, _) = open_regular(node.parent.as_fd(), src_name, shown)?;
                    if is_tar(&fd) {
                        let dir = if parents {
                            target[..target.len() - 1].to_vec()
                        } else if into_dir {
                            dest.to_vec()
                        } else {
                            target.clone()
                        };
                        return self.extract(fd, &dir);
                    }
                }
                let (parent, fname) = split_target(&target, dest_shown)?;
                let (pfd, pcomps) = self.dest_dir(parent, None)?;
                self.copy_entry(
                    node.parent.as_fd(),
                    src_name,
                    &st,
                    pfd.as_fd(),
                    &pcomps,
                    fname,
                    &node.rel(),
                    "",
                    0,
                )
            }
            Item::Git { url, tree, .. } => {
                self.shown = url.clone();
                let sfd = rustix::fs::open(
                    tree,
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(ioe(url, "open the checkout"))?;
                let st = rustix::fs::fstat(&sfd).map_err(ioe(url, "stat"))?;
                // The checkout's root is copied by content into the destination directory.
                self.meta.git = true;
                self.in_git = true;
                let r = (|| {
                    let (uid, gid) = self.meta.owner(&st);
                    let mode = self.meta.mode(st.st_mode, true);
                    let (dfd, dcomps) = self.dest_dir(dest, Some((uid, gid, mode)))?;
                    self.copy_dir(sfd.as_fd(), "", "", dfd.as_fd(), &dcomps, 0)
                })();
                self.meta.git = false;
                self.in_git = false;
                r
            }
            Item::Download { url, file, name } => {
                self.shown = url.clone();
                let mut target = dest.to_vec();
                if into_dir {
                    target.push(name.clone().into_bytes());
                }
                let (parent, fname) = split_target(&target, dest_shown)?;
                let (pfd, _) = self.dest_dir(parent, None)?;
                let f = std::fs::File::open(file).map_err(|e| CopyError::Io {
                    path: file.display().to_string(),
                    op: "open download",
                    source: e,
                })?;
                let (uid, gid) = self.meta.parent_owner();
                let mode = self.meta.mode(0o600, false);
                self.write_file(pfd.as_fd(), fname, f, uid, gid, mode, &[], ts(0, 0))
            }
            Item::Inline { name, data, mode } => {
                self.shown = name.clone();
                let mut target = dest.to_vec();
                if into_dir {
                    target.push(name.clone().into_bytes());
                }
                let (parent, fname) = split_target(&target, dest_shown)?;
                let (pfd, _) = self.dest_dir(parent, None)?;
                let (uid, gid) = self.meta.parent_owner();
                let mode = self.meta.mode(*mode, false);
                self.write_file(
                    pfd.as_fd(),
                    fname,
                    io::Cursor::new(data.clone()),
                    uid,
                    gid,
                    mode,
                    &[],
                    ts(0, 0),
                )
            }
        }
    }

    /// Extracts the archive `fd` into the destination directory `dir`.
    pub(super) fn extract(&mut self, fd: OwnedFd, dir: &[Vec<u8>]) -> Result<(), CopyError> {
        let (dfd, _) = self.dest_dir(dir, None)?;
        let root = PathBuf::from(format!("/proc/self/fd/{}", dfd.as_raw_fd()));
        let stats = crate::layer::apply_layer(
            &root,
            std::fs::File::from(fd),
            &self.shown,
            &self.tar_limits,
        )
        .map_err(|source| CopyError::Archive {
            path: self.shown.clone(),
            source,
        })?;
        self.report.archives += 1;
        self.report.bytes += stats.bytes;
        Ok(())
    }

    /// Copies the contents of the source directory `sdir` into `ddir`. `ctx_rel` is `sdir`'s
    /// path from the source root (for `.dockerignore`), `src_rel` from the copied source
    /// (for `--exclude`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_dir(
        &mut self,
        sdir: BorrowedFd<'_>,
        ctx_rel: &str,
        src_rel: &str,
        ddir: BorrowedFd<'_>,
        dcomps: &[Vec<u8>],
        depth: usize,
    ) -> Result<(), CopyError> {
        if depth > MAX_TREE_DEPTH {
            return Err(CopyError::Limit {
                path: self.shown.clone(),
                what: "directory depth",
                max: MAX_TREE_DEPTH as u64,
            });
        }
        let shown = self.shown.clone();
        for name in list(sdir, &shown)? {
            let st = match rustix::fs::statat(sdir, os(&name), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(ioe(&shown, "stat")(e)),
            };
            let crel = join(ctx_rel, &name);
            let srel = join(src_rel, &name);
            let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
            let filter = if self.in_git {
                &self.plain_filter
            } else {
                self.filter
            };
            match filter.verdict(&crel, &srel, is_dir) {
                Verdict::Skip => continue,
                Verdict::Keep => {
                    self.copy_entry(sdir, &name, &st, ddir, dcomps, &name, &crel, &srel, depth)?
                }
                Verdict::Descend => {
                    let before = self.report.clone();
                    self.copy_entry(sdir, &name, &st, ddir, dcomps, &name, &crel, &srel, depth)?;
                    // Nothing kept inside: the directory itself is not part of the copy.
                    if self.report.files == before.files
                        && self.report.symlinks == before.symlinks
                        && self.report.specials == before.specials
                    {
                        let _ = rustix::fs::unlinkat(ddir, os(&name), AtFlags::REMOVEDIR);
                    }
                }
            }
        }
        Ok(())
    }

    /// Makes sure `name` in `ddir` can be replaced by a non-directory.
    pub(super) fn clear_for_file(
        &self,
        ddir: BorrowedFd<'_>,
        name: &[u8],
        dcomps: &[Vec<u8>],
    ) -> Result<(), CopyError> {
        match rustix::fs::statat(ddir, os(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                Err(CopyError::ReplaceDirectory {
                    dest: format!("/{}", lossy(&[dcomps, &[name.to_vec()]].concat())),
                    path: self.shown.clone(),
                })
            }
            Ok(_) => rustix::fs::unlinkat(ddir, os(name), AtFlags::empty())
                .map_err(ioe(&self.shown, "unlink")),
            Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(ioe(&self.shown, "stat")(e)),
        }
    }

    /// Copies one entry `sname` of `sdir` (lstat `st`) to `dname` in `ddir`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_entry(
        &mut self,
        sdir: BorrowedFd<'_>,
        sname: &[u8],
        st: &Stat,
        ddir: BorrowedFd<'_>,
        dcomps: &[Vec<u8>],
        dname: &[u8],
        ctx_rel: &str,
        src_rel: &str,
        depth: usize,
    ) -> Result<(), CopyError> {
        check_name(dname, &self.shown)?;
        self.count_entry()?;
        let shown = super::select::entry_shown(&self.shown, src_rel);
        let (uid, gid) = self.meta.owner(st);
        let mtime = ts(st.st_mtime, st.st_mtime_nsec as i64);
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let mut child = dcomps.to_vec();
                child.push(dname.to_vec());
                let mode = self.meta.mode(st.st_mode, true);
                let sfd = rustix::fs::openat(
                    sdir,
                    os(sname),
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(ioe(&shown, "open"))?;
                // An existing symlink to a directory (`/lib -> usr/lib`) is followed inside
                // the root; anything else in the way but a directory is replaced.
                let existing = match rustix::fs::statat(ddir, os(dname), AtFlags::SYMLINK_NOFOLLOW)
                {
                    Ok(st) => Some(FileType::from_raw_mode(st.st_mode)),
                    Err(Errno::NOENT) => None,
                    Err(e) => return Err(ioe(&shown, "stat")(e)),
                };
                let (dfd, dc) = match existing {
                    Some(FileType::Directory) => {
                        let fd = rustix::fs::openat(
                            ddir,
                            os(dname),
                            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(ioe(&shown, "open"))?;
                        self.report.dirs += 1;
                        (fd, child)
                    }
                    Some(FileType::Symlink) => {
                        let r = self
                            .dest
                            .resolve(&child, true, None)
                            .map_err(|e| self.resolve_err(e));
                        match r {
                            Ok(r)
                                if r.stat.is_some_and(|s| {
                                    FileType::from_raw_mode(s.st_mode) == FileType::Directory
                                }) =>
                            {
                                let fd = r.open_dir().map_err(|e| CopyError::Io {
                                    path: shown.clone(),
                                    op: "open",
                                    source: e,
                                })?;
                                self.report.dirs += 1;
                                (fd, r.comps)
                            }
                            _ => {
                                rustix::fs::unlinkat(ddir, os(dname), AtFlags::empty())
                                    .map_err(ioe(&shown, "unlink"))?;
                                self.make_dir(ddir, dname, uid, gid, mode, &sfd, child)?
                            }
                        }
                    }
                    Some(_) => {
                        rustix::fs::unlinkat(ddir, os(dname), AtFlags::empty())
                            .map_err(ioe(&shown, "unlink"))?;
                        self.make_dir(ddir, dname, uid, gid, mode, &sfd, child)?
                    }
                    None => self.make_dir(ddir, dname, uid, gid, mode, &sfd, child)?,
                };
                self.copy_dir(sfd.as_fd(), ctx_rel, src_rel, dfd.as_fd(), &dc, depth + 1)?;
                // The directory's mtime, once its content is in place (only ones we made
                // carry the source's; `make_dir` records nothing else).
                if existing.is_none() {
                    let _ = rustix::fs::futimens(&dfd, &mtime);
                }
                Ok(())
            }
            FileType::RegularFile => {
                let (fd, st2) = open_regular(sdir, sname, &shown)?;
                let x = xattrs(fd.as_fd());
                let mode = self.meta.mode(st2.st_mode, false);
                self.write_file(
                    ddir,
                    dname,
                    std::fs::File::from(fd),
                    uid,
                    gid,
                    mode,
                    &x,
                    mtime,
                )
                .map_err(|e| match e {
                    CopyError::Io { op, source, .. } => CopyError::Io {
                        path: shown.clone(),
                        op,
                        source,
                    },
                    e => e,
                })
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(sdir, os(sname), Vec::new())
                    .map_err(ioe(&shown, "readlink"))?;
                self.clear_for_file(ddir, dname, dcomps)?;
                rustix::fs::symlinkat(&target, ddir, os(dname)).map_err(ioe(&shown, "symlink"))?;
                rustix::fs::chownat(
                    ddir,
                    os(dname),
                    Some(Uid::from_raw(uid)),
                    Some(Gid::from_raw(gid)),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(ioe(&shown, "chown"))?;
                let _ = rustix::fs::utimensat(ddir, os(dname), &mtime, AtFlags::SYMLINK_NOFOLLOW);
                self.report.symlinks += 1;
                Ok(())
            }
            // Device nodes from the build context are not copied (a tenant's upload has
            // no business carrying them), nor is a character device 0/0 from anywhere: in
            // the step's upper directory it is an overlay whiteout, and would delete the
            // lower layers' file of that name from the image.
            FileType::CharacterDevice | FileType::BlockDevice
                if self.meta.context || st.st_rdev == 0 =>
            {
                Ok(())
            }
            ft @ (FileType::CharacterDevice | FileType::BlockDevice | FileType::Fifo) => {
                self.clear_for_file(ddir, dname, dcomps)?;
                rustix::fs::mknodat(ddir, os(dname), ft, Mode::from_raw_mode(0o600), st.st_rdev)
                    .map_err(ioe(&shown, "mknod"))?;
                rustix::fs::chownat(
                    ddir,
                    os(dname),
                    Some(Uid::from_raw(uid)),
                    Some(Gid::from_raw(gid)),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(ioe(&shown, "chown"))?;
                rustix::fs::chmodat(
                    ddir,
                    os(dname),
                    Mode::from_raw_mode(self.meta.mode(st.st_mode, false)),
                    AtFlags::empty(),
                )
                .map_err(ioe(&shown, "chmod"))?;
                let _ = rustix::fs::utimensat(ddir, os(dname), &mtime, AtFlags::SYMLINK_NOFOLLOW);
                self.report.specials += 1;
                Ok(())
            }
            // Sockets and unknown types are not copied (Docker's context skips sockets).
            _ => Ok(()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn make_dir(
        &mut self,
        ddir: BorrowedFd<'_>,
        name: &[u8],
        uid: u32,
        gid: u32,
        mode: u32,
        src: &OwnedFd,
        comps: Vec<Vec<u8>>,
    ) -> Result<(OwnedFd, Vec<Vec<u8>>), CopyError> {
        check_name(name, &self.shown)?;
        let shown = self.shown.clone();
        let fd = create_owned_dir(ddir, name, uid, gid, mode, &shown)?;
        for (k, v) in xattrs(src.as_fd()) {
            rustix::fs::fsetxattr(&fd, os(&k), &v, XattrFlags::empty())
                .map_err(ioe(&shown, "setxattr"))?;
        }
        self.report.dirs += 1;
        Ok((fd, comps))
    }

    /// Writes `data` as the new regular file `name` in `dir` (replacing a non-directory),
    /// with owner, mode, xattrs and times, within the size bounds.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_file(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &[u8],
        data: impl Read,
        uid: u32,
        gid: u32,
        mode: u32,
        xattrs: &[(Vec<u8>, Vec<u8>)],
        times: Timestamps,
    ) -> Result<(), CopyError> {
        check_name(name, &self.shown)?;
        self.count_entry()?;
        let shown = self.shown.clone();
        let dcomps: Vec<Vec<u8>> = Vec::new();
        self.clear_for_file(dir, name, &dcomps)?;
        let fd = rustix::fs::openat(
            dir,
            os(name),
            OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(ioe(&shown, "create"))?;
        let mut out = std::fs::File::from(fd);
        let file_max = self.limits.max_file_bytes;
        let total_left = self
            .limits
            .max_total_bytes
            .saturating_sub(self.report.bytes);
        let cap = file_max.min(total_left);
        let n = io::copy(&mut data.take(cap.saturating_add(1)), &mut out).map_err(|e| {
            CopyError::Io {
                path: shown.clone(),
                op: "copy",
                source: e,
            }
        })?;
        if n > cap {
            let (what, max) = if n > file_max {
                ("file size (bytes)", file_max)
            } else {
                ("total size (bytes)", self.limits.max_total_bytes)
            };
            return Err(CopyError::Limit {
                path: shown,
                what,
                max,
            });
        }
        self.report.bytes += n;
        let fd = out.as_fd();
        rustix::fs::fchown(fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(ioe(&shown, "chown"))?;
        rustix::fs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(ioe(&shown, "chmod"))?;
        for (k, v) in xattrs {
            rustix::fs::fsetxattr(fd, os(k), v, XattrFlags::empty())
                .map_err(ioe(&shown, "setxattr"))?;
        }
        rustix::fs::futimens(fd, &times).map_err(ioe(&shown, "utimens"))?;
        self.report.files += 1;
        Ok(())
    }
}

/// Refuses a name that is not one plain path component. Every `*at` call of the copy takes
/// a name relative to a directory fd it resolved inside the root; a name holding `/` or `..`
/// would make the kernel resolve it, following symlinks and climbing out of the root.
/// Names read from a directory are always plain; a heredoc delimiter (`COPY <<../../x /d/`)
/// or a destination ending in `..` are not.
pub(super) fn check_name(name: &[u8], shown: &str) -> Result<(), CopyError> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(CopyError::BadName {
            path: shown.to_string(),
            name: String::from_utf8_lossy(name).into_owned(),
        });
    }
    Ok(())
}

/// Splits a file target into its parent directory and name; the root cannot be a file.
pub(super) fn split_target<'t>(
    target: &'t [Vec<u8>],
    dest_shown: &str,
) -> Result<(&'t [Vec<u8>], &'t [u8]), CopyError> {
    match target.split_last() {
        Some((name, parent)) => Ok((parent, name)),
        None => Err(CopyError::NotADirectory {
            dest: dest_shown.to_string(),
        }),
    }
}

/// Whether the file looks like a tar archive (plain, gzip, zstd, xz or bzip2): its first 512-byte
/// block, once decompressed, is a tar header with a valid checksum (POSIX `ustar` and old
/// V7 headers alike; pax(1) "ustar Interchange Format"). The file offset is restored.
pub(crate) fn is_tar(fd: &OwnedFd) -> bool {
    use crate::layer::Compression;
    let Ok(dup) = fd.try_clone() else {
        return false;
    };
    let mut f = std::fs::File::from(dup);
    let mut head = [0u8; 8];
    let n = read_full(&mut f, &mut head).unwrap_or(0);
    let mut block = [0u8; 512];
    let ok = (|| -> io::Result<bool> {
        rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(0))?;
        let mut decoded = Compression::sniff(&head[..n]).decoder(io::BufReader::new(&mut f))?;
        let got = read_full(&mut decoded, &mut block)?;
        Ok(got == 512 && tar_checksum_ok(&block))
    })()
    .unwrap_or(false);
    let _ = rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(0));
    ok
}

pub(super) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Whether `block` is a tar header whose checksum field matches its bytes (POSIX.1-2017
/// `ustar` "chksum", as the tar crate reads and computes it). An all-zero block (end of
/// archive) is not a header.
pub(super) fn tar_checksum_ok(block: &[u8; 512]) -> bool {
    let header = tar::Header::from_byte_slice(block);
    let Ok(want) = header.cksum() else {
        return false;
    };
    let mut computed = header.clone();
    computed.set_cksum();
    computed.cksum().is_ok_and(|sum| sum == want) && block.iter().any(|b| *b != 0)
}
