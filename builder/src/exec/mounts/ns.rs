//! Mounting a step's `RUN --mount`s in its pid 1's private mount namespace, and checking
//! their owners against the step's user namespace before the step starts.

use super::*;

/// Creates the mount point `rel` under the root `root` (never following a symlink: the path
/// was resolved by [`canonical`]; a symlink met now is refused) and opens it `O_PATH`.
pub(in crate::exec) fn mount_point(
    root: &OwnedFd,
    rel: &str,
    file: bool,
) -> Result<OwnedFd, String> {
    let comps: Vec<&str> = rel.split('/').filter(|c| !c.is_empty()).collect();
    let Some((last, parents)) = comps.split_last() else {
        return Err("mount target is the root".into());
    };
    let mut dir = root.try_clone().map_err(|e| format!("dup: {e}"))?;
    for c in parents {
        match rustix::fs::mkdirat(&dir, *c, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("creating mount point /{rel}: {e}")),
        }
        dir = rustix::fs::openat(
            &dir,
            *c,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("mount point /{rel}: {c}: {e}"))?;
    }
    if file {
        match rustix::fs::openat(
            &dir,
            *last,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        ) {
            Ok(_) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("creating mount point /{rel}: {e}")),
        }
    } else {
        match rustix::fs::mkdirat(&dir, *last, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(format!("creating mount point /{rel}: {e}")),
        }
    }
    let mut flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    if !file {
        flags |= OFlags::DIRECTORY;
    }
    rustix::fs::openat(&dir, *last, flags, Mode::empty()).map_err(|e| {
        format!(
            "mount point /{rel} is not a {}: {e}",
            if file { "file" } else { "directory" }
        )
    })
}

/// Remounts the bind mount now on top of `rel` nosuid, nodev, and read-only when
/// `readonly`.
fn remount(root: &OwnedFd, rel: &str, file: bool, readonly: bool) -> Result<(), String> {
    let fd = mount_point(root, rel, file)?;
    let mut flags = MountFlags::BIND | MountFlags::NOSUID | MountFlags::NODEV;
    if readonly {
        flags |= MountFlags::RDONLY;
    }
    rustix::mount::mount_remount(fd_path(&fd).as_str(), flags, "")
        .map_err(|e| format!("remounting /{rel}: {e}"))
}

/// Checks that the owners `mounts` give the files they make (a new cache's root, a secret,
/// an SSH socket) are among the `count` ids (from 0) of the step's user namespace: an id
/// past them would show as 65534 in the step, which could not use the mount (as a `USER`
/// past them cannot run), and a rootless kiln could not even chown to it.
///
/// Errors: the first mount whose owner is outside the map, naming its target and owner.
pub(crate) fn check_owners(mounts: &[StepMount], count: u32) -> Result<(), crate::exec::ExecError> {
    for m in mounts {
        let (kind, uid, gid) = match &m.kind {
            MountKind::Cache(c) => ("cache", c.uid, c.gid),
            MountKind::Secret { uid, gid, .. } => ("secret", *uid, *gid),
            MountKind::Ssh { uid, gid, .. } => ("ssh", *uid, *gid),
            MountKind::Bind { .. } | MountKind::Tmpfs { .. } => continue,
        };
        if uid >= count || gid >= count {
            return Err(crate::exec::ExecError::Setup(format!(
                "--mount type={kind},target={}: owner {uid}:{gid} is outside the step's user \
                 namespace (ids 0-{})",
                m.target,
                count - 1
            )));
        }
    }
    Ok(())
}

/// The step's user namespace, as pid 1 mounts with it ([`crate::exec::userns`]).
pub(crate) struct Idmap {
    /// The namespace's descriptor (`MOUNT_ATTR_IDMAP`).
    pub ns: std::os::fd::RawFd,
    /// Directories already shown through it in pid 1's mount namespace: what lies below them
    /// is seen through the namespace already (and cannot be idmapped twice).
    pub covered: Vec<PathBuf>,
    /// Its map.
    pub map: crate::exec::userns::IdMap,
}

impl Idmap {
    /// `(uid, gid)` of the step as host ids, for files kiln makes on a file system no
    /// idmapped mount shows (the secrets tmpfs). Errors: an id outside the map.
    fn host_ids(&self, uid: u32, gid: u32) -> Result<(u32, u32), String> {
        if uid >= self.map.count || gid >= self.map.count {
            return Err(format!(
                "owner {uid}:{gid} is outside the step's user namespace (ids 0-{})",
                self.map.count - 1
            ));
        }
        Ok((self.map.uid_first + uid, self.map.gid_first + gid))
    }
}

/// A private copy of the tree at `src` (a descriptor, or a path: `under` is the directory it
/// lies in) to mount: shown through the step's user namespace when there is one and `under`
/// is not already (`open_tree(2)` and, if so, `MOUNT_ATTR_IDMAP`).
fn source_tree(src: &str, under: &Path, idmap: Option<&Idmap>) -> Result<OwnedFd, String> {
    match idmap {
        Some(m) if !m.covered.iter().any(|c| under.starts_with(c)) => {
            crate::exec::userns::child::idmapped_clone(Path::new(src), m.ns)
        }
        _ => rustix::mount::open_tree(
            rustix::fs::CWD,
            src,
            rustix::mount::OpenTreeFlags::OPEN_TREE_CLONE
                | rustix::mount::OpenTreeFlags::OPEN_TREE_CLOEXEC
                | rustix::mount::OpenTreeFlags::AT_RECURSIVE,
        )
        .map_err(|e| format!("open_tree: {e}")),
    }
}

/// Binds the tree at `src` (in `under`, [`source_tree`]) onto the mount point `target`.
fn bind(src: &str, under: &Path, target: &OwnedFd, idmap: Option<&Idmap>) -> Result<(), String> {
    let tree = source_tree(src, under, idmap)?;
    crate::exec::userns::child::attach_to(&tree, target)
}

/// In the step's pid 1, before `pivot_root`: mounts everything onto the new root `root`,
/// through the step's user namespace `idmap` when it has one (bind and cache sources are
/// shown through it; secret files are owned by the mapped ids).
pub(crate) fn mount_all(
    root: &OwnedFd,
    p: &PreparedMounts,
    idmap: Option<&Idmap>,
) -> Result<(), String> {
    use rustix::mount::mount;
    let nsd = MountFlags::NOSUID | MountFlags::NODEV;
    if p.mounts
        .iter()
        .any(|m| matches!(m.kind, PreparedKind::Secret { .. }))
    {
        let dir = p.secrets_dir.to_str().ok_or("secrets dir is not UTF-8")?;
        mount(
            "tmpfs",
            dir,
            "tmpfs",
            nsd | MountFlags::NOEXEC,
            Some(c"mode=0711,size=4m"),
        )
        .map_err(|e| format!("mounting the secrets tmpfs: {e}"))?;
    }
    for m in &p.mounts {
        let target = mount_point(root, &m.rel, m.file)?;
        let t = fd_path(&target);
        match &m.kind {
            PreparedKind::Bind {
                root: src_root,
                path,
                rw,
            } => {
                let src =
                    open_in(src_root, path).map_err(|e| format!("--mount source {path:?}: {e}"))?;
                // The source as the step sees it (its owners through the user namespace).
                let src = source_tree(&fd_path(&src), src_root, idmap)
                    .map_err(|e| format!("--mount source {path:?}: {e}"))?;
                match rw {
                    None => {
                        crate::exec::userns::child::attach_to(&src, &target)
                            .map_err(|e| format!("binding /{}: {e}", m.rel))?;
                        drop(target);
                        remount(root, &m.rel, m.file, true)?;
                    }
                    Some((upper, _)) if m.file => {
                        // A writable copy of the file, discarded with the scratch directory.
                        let copy = upper.join(RW_FILE_COPY);
                        copy_bind_file(&src, &copy)
                            .map_err(|e| format!("--mount source {path:?}: {e}"))?;
                        bind(&copy.to_string_lossy(), upper, &target, idmap)
                            .map_err(|e| format!("binding /{}: {e}", m.rel))?;
                        drop(target);
                        remount(root, &m.rel, m.file, false)?;
                    }
                    Some((upper, work)) => {
                        // The source attached first, so that overlayfs takes it as a mount
                        // of this namespace; the overlay then goes on top of it.
                        crate::exec::userns::child::attach_to(&src, &target)
                            .map_err(|e| format!("binding /{}: {e}", m.rel))?;
                        drop(target);
                        let lower = mount_point(root, &m.rel, false)?;
                        let lower = fd_path(&lower);
                        crate::exec::overlay::mount(
                            &[Path::new(&lower)],
                            upper,
                            work,
                            Path::new(&lower),
                            MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV,
                        )
                        .map_err(|e| format!("mounting rw bind /{}: {e}", m.rel))?;
                    }
                }
            }
            PreparedKind::Dir { dir, readonly } => {
                bind(&dir.to_string_lossy(), dir, &target, idmap)
                    .map_err(|e| format!("binding cache /{}: {e}", m.rel))?;
                drop(target);
                remount(root, &m.rel, m.file, *readonly)?;
            }
            PreparedKind::GuestCache(_) => {
                return Err(format!(
                    "cache /{}: prepared for a guest (prepare_for_guest), not for this step",
                    m.rel
                ));
            }
            PreparedKind::Tmpfs { data, .. } => {
                mount("tmpfs", t.as_str(), "tmpfs", nsd, Some(data.as_c_str()))
                    .map_err(|e| format!("mounting tmpfs /{}: {e}", m.rel))?;
            }
            PreparedKind::Secret {
                name,
                value,
                mode,
                uid,
                gid,
            } => {
                let f = p.secrets_dir.join(name);
                let (uid, gid) = match idmap {
                    Some(im) => im
                        .host_ids(*uid, *gid)
                        .map_err(|e| format!("secret /{}: {e}", m.rel))?,
                    None => (*uid, *gid),
                };
                fs::write(&f, value.expose()).map_err(|e| format!("writing a secret: {e}"))?;
                std::os::unix::fs::chown(&f, Some(uid), Some(gid))
                    .map_err(|e| format!("chown of a secret: {e}"))?;
                fs::set_permissions(&f, fs::Permissions::from_mode(*mode))
                    .map_err(|e| format!("chmod of a secret: {e}"))?;
                // The secrets tmpfs is no idmapped mount: its files carry host ids already.
                rustix::mount::mount_bind(f.as_path(), t.as_str())
                    .map_err(|e| format!("binding secret /{}: {e}", m.rel))?;
                drop(target);
                remount(root, &m.rel, m.file, true)?;
            }
            PreparedKind::Ssh { proxy } => {
                let socket = proxy.socket();
                bind(
                    &socket.to_string_lossy(),
                    socket.parent().unwrap_or(socket),
                    &target,
                    idmap,
                )
                .map_err(|e| format!("binding the SSH agent socket /{}: {e}", m.rel))?;
                drop(target);
                remount(root, &m.rel, m.file, false)?;
            }
        }
    }
    Ok(())
}
