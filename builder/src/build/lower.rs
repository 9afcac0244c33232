//! Unpacked layers as overlayfs lower directories, one directory per layer digest.
//!
//! `<work>/layers/<hex>` holds the layer with digest `sha256:<hex>` on its own, in
//! overlayfs' form (Linux `Documentation/filesystems/overlayfs.rst`): an OCI whiteout
//! `.wh.x` becomes a character device 0/0 named `x`, and an opaque whiteout `.wh..wh..opq`
//! becomes the xattr `trusted.overlay.opaque=y` on its directory (as does `.wh.d` for a
//! directory `d` the same layer makes again), so stacking the directories as lowers gives the
//! same tree as applying the layers in order. A step's upper directory is already in that
//! form and is moved here once its layer is written, its times made the layer's first
//! ([`crate::layer::write::settle_times`]): a layer's directory is the same whether a step
//! made it or it was unpacked from the blob. Beside them, `<work>/layers/<hex>`
//! of a list of layers is their merged tree, made of hard links into their directories
//! ([`LayerDirs::squashed`]).
//!
//! A directory appears under its final name only when complete (unpacked under a temporary
//! name, then renamed), so a crash leaves at most a `*.tmp-*` directory, named after its
//! owner and removed by the next [`LayerDirs::open`] once that owner is dead
//! ([`crate::workdir`]). An open [`LayerDirs`] holds the shared lock on `layers/.lock`, so
//! `kiln store gc` ([`crate::workdir::collect_layers`]) never removes a layer while a build
//! may mount it.
//!
//! # The host's shared layers
//!
//! Opened with a shared directory ([`LayerDirs::open_shared`]; `kiln`'s `layer_dir`, default
//! `<cache>/layers`), a layer unpacked from a blob ([`LayerDirs::ensure`]: a base's layers, a
//! cached step's) is unpacked there instead, as `<shared>/<hex>`, and found there by every
//! later build of the host, whatever its store or work directory: a base is unpacked once
//! per host, not once per store; two builds that need the same layer at once unpack it once,
//! the second waiting on the first's lock (`<hex>.unpacking`, [`UNPACKING`]) within its own
//! deadline. The same promises hold there: complete-then-rename, dead
//! builds' `*.tmp-*` reaped on open, and a shared lock on `<shared>/.lock` held by every
//! build, which `kiln store gc` of any store takes exclusively, without waiting,
//! before it empties the directory ([`crate::workdir::collect_shared_layers`]).
//!
//! Why sharing it between builds, stores and tenants is safe: a directory there is made only
//! by [`LayerDirs::ensure`], from the blob the build's cache holds under `sha256:<hex>`,
//! after the blob's bytes were hashed and found to be `<hex>` ([`LowerError::Mismatch`]
//! otherwise), by the one deterministic unpack ([`unpack_overlay_form`]). So `<shared>/<hex>`
//! is a function of the digest alone: any build that names the digest would make the same
//! tree from its own blob, and no build's choice changes what another finds. Nothing else
//! writes there: a step's upper directory (what a tenant's command made) is adopted into
//! the build's own work directory only ([`LayerDirs::adopt`]), never under a name in the
//! shared directory, and steps mount layer directories read-only (as overlay lowers, or as
//! the microVM executor's disk images made from them). The directory is private (0700) as
//! `layers/` is. Squashed trees ([`LayerDirs::squashed`]) stay in the work directory; they
//! hard-link into the shared layers, so the shared directory is used only when it is on the
//! work directory's file system (else the build unpacks into its work directory, as without
//! one).

use std::fs;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, XattrFlags};
use rustix::io::Errno;

use kiln_store::BlobDigest;
use kiln_store::digest::{Hasher, Sha256Hash};

use crate::cache::BlobCache;
use crate::exec::rootless::overlay_opaque_xattr;
use crate::layer::whiteout::WhiteoutKind;
use crate::layer::{
    Compression, LayerError, LimitKind, Limits, Split, apply_layer_as, bounded_stream_as,
    split_name,
};
use crate::rootfs::root::{FsError, dir_names, open_dir_at, walk_fd};
use crate::rootfs::walk::{Walk, WalkError};

/// Errors preparing lower directories.
#[derive(Debug, thiserror::Error)]
pub enum LowerError {
    /// The layer blob is not in the store.
    #[error("layer {0} is not in the local store")]
    Missing(BlobDigest),
    /// A digest is malformed.
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    /// The layer could not be applied.
    #[error(transparent)]
    Layer(#[from] crate::layer::LayerError),
    /// The layer blob's bytes do not hash to its digest: not unpacked into the host's
    /// shared layers ([`LayerDirs::open_shared`]).
    #[error("layer {digest}: the blob at {path} hashes to sha256:{actual}")]
    Mismatch {
        /// The digest the blob is stored under.
        digest: BlobDigest,
        /// The blob.
        path: PathBuf,
        /// What its bytes hash to (hex).
        actual: String,
    },
    /// A file-system operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The per-digest layer directories under one work directory, and the host's shared ones
/// (the module documentation).
#[derive(Debug, Clone)]
pub struct LayerDirs {
    root: PathBuf,
    /// The host's shared layer directory, when used.
    shared: Option<PathBuf>,
    /// Held while any clone lives: the layers are in use (the work directory's, then the
    /// shared directory's).
    _locks: std::sync::Arc<Vec<crate::workdir::LayersLock>>,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LowerError + 'a {
    move |source| LowerError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

impl LayerDirs {
    /// Opens (creating) `root` and takes its shared lock (waiting while `kiln store gc`
    /// collects layers), then removes unfinished directories of builds that died. `root` is
    /// made 0700: layers hold what their images hold, device nodes at any mode included
    /// (a registry layer's `b 254:0` made `brw-rw-rw-`; found by the attack pass), which no
    /// other user may reach by path.
    pub fn open(root: &Path) -> Result<LayerDirs, LowerError> {
        LayerDirs::open_shared(root, None)
    }

    /// [`LayerDirs::open`], and with `shared` the host's shared layer directory (the module
    /// documentation) opened the same way (created 0700, its shared lock taken, waiting
    /// while `kiln store gc` collects it, dead builds' unfinished directories removed).
    /// `shared` is used only when it is on `root`'s file system (the squashed trees in
    /// `root` hard-link into it); else it is only created, that is logged, and layers are
    /// unpacked into `root`. Errors: [`LowerError::Io`] (either directory cannot be made, made
    /// private or locked).
    pub fn open_shared(root: &Path, shared: Option<&Path>) -> Result<LayerDirs, LowerError> {
        use std::os::unix::fs::MetadataExt;
        let root_lock = open_private(root)?;
        let mut locks = vec![root_lock];
        let shared = match shared {
            Some(dir) => {
                let dev = |p: &Path| {
                    fs::metadata(p)
                        .map(|m| m.dev())
                        .map_err(io_err("reading", p))
                };
                fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
                if dev(root)? == dev(dir)? {
                    locks.push(open_private(dir)?);
                    Some(dir.to_path_buf())
                } else {
                    tracing::info!(
                        shared = %dir.display(),
                        work = %root.display(),
                        "the shared layer directory is on another file system: \
                         unpacking layers into the work directory"
                    );
                    None
                }
            }
            None => None,
        };
        Ok(LayerDirs {
            root: root.to_path_buf(),
            shared,
            _locks: std::sync::Arc::new(locks),
        })
    }

    /// The host's shared layer directory this build unpacks into, when it uses one
    /// ([`LayerDirs::open_shared`]).
    pub fn shared(&self) -> Option<&Path> {
        self.shared.as_deref()
    }

    /// The directory of layer `digest`: the host's shared one when it is there, else the
    /// work directory's (whether or not it exists yet).
    pub fn path(&self, digest: &BlobDigest) -> PathBuf {
        if let Some(shared) = &self.shared {
            let p = shared.join(digest.hex());
            if p.is_dir() {
                return p;
            }
        }
        self.root.join(digest.hex())
    }

    /// A fresh temporary directory name under the root (same file system).
    pub fn temp(&self, label: &str) -> PathBuf {
        temp_in(&self.root, label)
    }

    /// Moves a finished directory in as layer `digest` (an upper directory whose layer was
    /// just written). When the layer is already there, `dir` is removed instead.
    pub fn adopt(&self, dir: &Path, digest: &BlobDigest) -> Result<PathBuf, LowerError> {
        self.adopt_as(dir, self.path(digest))
    }

    fn adopt_as(&self, dir: &Path, dst: PathBuf) -> Result<PathBuf, LowerError> {
        if dst.is_dir() {
            let _ = fs::remove_dir_all(dir);
            return Ok(dst);
        }
        match fs::rename(dir, &dst) {
            Ok(()) => Ok(dst),
            Err(_) if dst.is_dir() => {
                let _ = fs::remove_dir_all(dir);
                Ok(dst)
            }
            Err(e) => Err(io_err("moving a layer directory to", &dst)(e)),
        }
    }

    /// The directory of layer `digest`, unpacking the blob from `cache` first if needed
    /// (from the layer's shared inflated stream when the flatten's scan of the build's base
    /// is making or keeping one, [`crate::layer::shared`]): into the host's shared directory
    /// when there is one (the module documentation; waiting, within `limits`' deadline and
    /// cancel, while another build unpacks the same layer there), else into the work
    /// directory. Errors: [`LowerError::Missing`] (no blob), [`LowerError::Mismatch`] (the
    /// blob's bytes are not `digest`; only with a shared directory), [`LowerError::Layer`]
    /// (a bad or hostile layer, a bound, the deadline or a cancel), [`LowerError::Io`];
    /// nothing is left under the layer's name then.
    pub fn ensure(
        &self,
        cache: &dyn BlobCache,
        digest: &BlobDigest,
        limits: &Limits,
    ) -> Result<PathBuf, LowerError> {
        let dst = self.path(digest);
        if dst.is_dir() {
            return Ok(dst);
        }
        let blob = cache
            .blob_path(digest)?
            .ok_or(LowerError::Missing(*digest))?;
        // Into the host's shared directory only from a blob whose bytes are its digest
        // (the module documentation): a function of the digest alone.
        let mut _unpacking = None;
        let into = match &self.shared {
            Some(shared) => {
                // One unpack of a digest at a time on the host: a build that finds another
                // unpacking it waits, then finds it made.
                _unpacking = Some(lock_unpacking(shared, digest, limits)?);
                let dst = shared.join(digest.hex());
                if dst.is_dir() {
                    return Ok(dst);
                }
                let actual = Sha256Hash::of_file(&blob).map_err(io_err("hashing", &blob))?;
                if actual != digest.0 {
                    return Err(LowerError::Mismatch {
                        digest: *digest,
                        path: blob,
                        actual: actual.hex(),
                    });
                }
                shared
            }
            None => &self.root,
        };
        let tmp = temp_in(into, &digest.hex());
        fs::create_dir(&tmp).map_err(io_err("creating", &tmp))?;
        if let Err(e) = unpack_overlay_form(&tmp, &blob, &digest.to_string(), limits) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        self.adopt_as(&tmp, into.join(digest.hex()))
    }

    /// The tree of layers `digests` (bottom first) as one plain directory, made when missing:
    /// what their layer directories ([`LayerDirs::ensure`], each unpacked from `cache` under
    /// `limits` if it is not here yet) show stacked as overlayfs lowers, the tree the steps
    /// over them saw, with whiteouts and opaque directories applied and no marker left
    /// ([`merge_lowers`]). As the lowest lower of a mount it shows what those layers stacked
    /// as lowers show ([`squash_plan`]); on its own it is their merged root file system (a
    /// stage's tree for `COPY --from`).
    ///
    /// Its directories are new (owner, mode, kept xattrs and times of the topmost layer's
    /// directory); every other entry is a hard link to the layer directory's file, so no
    /// data is inflated or written again. The tree is read-only input, as the layer
    /// directories are: read by `COPY --from`, bound read-only (a `rw` bind writes to an
    /// overlay upper over it), mounted as a lower; nothing writes into it or changes the
    /// metadata of its files.
    ///
    /// Named `<hex>`, the sha256 of [`SQUASH_KEY_VERSION`] and the digests one per line, beside
    /// the layer directories (a name no layer digest gives): made once per list of layers,
    /// under a temporary name and renamed, and collected with the layers by `kiln store gc`.
    ///
    /// Errors: a blob not in `cache` ([`LowerError::Missing`]), a layer refused or over
    /// `limits`, the deadline or a cancel while merging ([`LowerError::Layer`]),
    /// [`LowerError::Io`] (a file linked more times than the file system allows, `EMLINK`,
    /// included); nothing is left behind but the layer directories made.
    pub fn squashed(
        &self,
        cache: &dyn BlobCache,
        digests: &[BlobDigest],
        limits: &Limits,
    ) -> Result<PathBuf, LowerError> {
        let mut names = String::from(SQUASH_KEY_VERSION);
        for d in digests {
            names.push_str(&d.to_string());
            names.push('\n');
        }
        let hex = Sha256Hash::of(names.as_bytes()).hex();
        let dst = self.root.join(&hex);
        if dst.is_dir() {
            return Ok(dst);
        }
        let mut lowers = Vec::with_capacity(digests.len());
        for d in digests.iter().rev() {
            lowers.push((self.ensure(cache, d, limits)?, d.to_string()));
        }
        let tmp = self.temp(&hex);
        fs::create_dir(&tmp).map_err(io_err("creating", &tmp))?;
        if let Err(e) = merge_lowers(&lowers, &tmp, limits) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        self.adopt_as(&tmp, dst)
    }
}

/// Creates `dir` (and its parents) when missing, makes it 0700 and takes its shared lock
/// ([`crate::workdir::LayersLock::shared`]), then removes the unfinished directories of
/// builds that died in it.
fn open_private(dir: &Path) -> Result<crate::workdir::LayersLock, LowerError> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(io_err("making private", dir))?;
    let lock = crate::workdir::LayersLock::shared(dir)
        .map_err(io_err("locking", &dir.join(crate::workdir::LAYERS_LOCK)))?;
    crate::workdir::remove_dead_entries(dir, ".tmp-");
    Ok(lock)
}

/// The suffix of the lock file `<hex>.unpacking` that a build holds in the host's shared
/// layer directory while it unpacks layer `<hex>` there ([`lock_unpacking`]).
pub const UNPACKING: &str = ".unpacking";

/// Takes the exclusive lock on `<shared>/<hex>.unpacking` (created when missing), retrying
/// every 20 ms while another build holds it, so that two builds of the host never unpack the
/// same layer at once: the second then finds the first's directory. Released when dropped.
/// The files stay (empty); `kiln store gc` removes them with the layers
/// ([`crate::workdir::collect_shared_layers`]). Errors: [`LowerError::Layer`] when `limits`'
/// deadline passes or the build is cancelled while waiting, [`LowerError::Io`].
fn lock_unpacking(
    shared: &Path,
    digest: &BlobDigest,
    limits: &Limits,
) -> Result<OwnedFd, LowerError> {
    let path = shared.join(format!("{}{UNPACKING}", digest.hex()));
    let fd = rustix::fs::open(
        &path,
        OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| io_err("opening", &path)(e.into()))?;
    loop {
        match rustix::fs::flock(&fd, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(fd),
            Err(Errno::WOULDBLOCK) => {}
            Err(e) => return Err(io_err("locking", &path)(e.into())),
        }
        let (digest, entry) = (
            digest.to_string(),
            "(waiting for another build's unpack)".into(),
        );
        match limits.stop() {
            Some(LimitKind::Cancelled) => {
                return Err(LayerError::Cancelled { digest, entry }.into());
            }
            Some(_) => return Err(LayerError::Deadline { digest, entry }.into()),
            None => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

/// A fresh temporary directory name under `dir`, named after this process
/// ([`crate::workdir::owner_token`]) so that it is reaped once the process is dead.
fn temp_in(dir: &Path, label: &str) -> PathBuf {
    dir.join(format!(
        "{label}.tmp-{}-{}",
        crate::workdir::owner_token(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Makes in the empty directory `out` the tree that the layer directories `lowers`
/// (topmost first, each with its digest for errors) show stacked as overlayfs lowers
/// (Linux `Documentation/filesystems/overlayfs.rst`, "Multiple lower layers"), as plain
/// entries: a name is what the topmost layer holding it holds; a character device 0/0 (a
/// whiteout) hides it and everything of it below; a directory merges with the same
/// directory of the layers below, down to the first one that is opaque
/// (`trusted.overlay.opaque=y`, [`crate::layer::write::is_opaque_fd`]) or where the path is
/// no directory (a file or whiteout there ends the merge). `out` itself is left as it is,
/// as a layer's root's metadata is never applied.
///
/// A directory of `out` is made with the owner, mode, kept xattrs ([`crate::layer::keep_xattr`],
/// as a layer's are applied) and access and modification times of its topmost layer's
/// directory; anything else is hard-linked to the layer's file (symlinks, devices and FIFOs
/// too, never followed), so it has the layer's inode with all its metadata, and files linked
/// together in a layer stay linked together. Every directory is reached from a layer's root
/// by [`crate::rootfs`]'s walk following no symlink, with a descriptor per layer only for
/// the directory being merged; at most [`crate::rootfs::MAX_DEPTH`] deep. `limits`' deadline
/// and cancel are checked before each directory.
///
/// Errors: [`LowerError::Layer`] (deadline, cancel, too deep), [`LowerError::Io`].
fn merge_lowers(
    lowers: &[(PathBuf, String)],
    out: &Path,
    limits: &Limits,
) -> Result<(), LowerError> {
    let open_root = |p: &Path| {
        rustix::fs::open(
            p,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("opening", p)(e.into()))
    };
    let roots = lowers
        .iter()
        .map(|(p, _)| open_root(p))
        .collect::<Result<Vec<_>, _>>()?;
    let out_root = open_root(out)?;
    let how = Walk::own_dirs(false, false);
    let at = |comps: &[Vec<u8>]| {
        let mut p = out.to_path_buf();
        p.extend(comps.iter().map(|c| std::ffi::OsStr::from_bytes(c)));
        p
    };
    // Opens the directory `comps` below `root`, following nothing.
    let open_dir = |root: &OwnedFd, comps: &[Vec<u8>]| -> Result<OwnedFd, LowerError> {
        match walk_fd(root.as_fd(), comps, &how, None) {
            Ok(mut reached) => Ok(reached.dirs.pop().expect("the root stays").0),
            Err(e) => Err(io_err("reaching a layer directory for", &at(comps))(
                walk_io(e),
            )),
        }
    };
    // Directories to merge: their path and the layers (indices into `lowers`, topmost
    // first) whose directory they merge.
    let mut todo: Vec<(Vec<Vec<u8>>, Vec<usize>)> = vec![(Vec::new(), (0..lowers.len()).collect())];
    // Directories made, with the times they get once their content is in place.
    let mut made: Vec<(Vec<Vec<u8>>, rustix::fs::Timestamps)> = Vec::new();
    while let Some((comps, stack)) = todo.pop() {
        let shown = || String::from_utf8_lossy(&comps.join(&b'/')).into_owned();
        let stop = |digest: &str| match limits.stop() {
            Some(LimitKind::Cancelled) => Err(LayerError::Cancelled {
                digest: digest.to_string(),
                entry: shown(),
            }),
            Some(_) => Err(LayerError::Deadline {
                digest: digest.to_string(),
                entry: shown(),
            }),
            None if comps.len() > crate::rootfs::MAX_DEPTH => Err(LayerError::TooDeep {
                digest: digest.to_string(),
                entry: shown(),
            }),
            None => Ok(()),
        };
        stop(
            stack
                .first()
                .map_or("(no layer)", |&i| lowers[i].1.as_str()),
        )?;
        let dest = open_dir(&out_root, &comps)?;
        let dirs = stack
            .iter()
            .map(|&i| Ok((i, open_dir(&roots[i], &comps)?)))
            .collect::<Result<Vec<_>, LowerError>>()?;
        let mut seen = std::collections::HashSet::new();
        for (k, (layer, dir)) in dirs.iter().enumerate() {
            let ioe = |what| io_err(what, &lowers[*layer].0);
            for name in
                dir_names(dir.as_fd()).map_err(|e| ioe("listing a directory of")(e.into()))?
            {
                if !seen.insert(name.clone()) {
                    continue;
                }
                let name_os = std::ffi::OsStr::from_bytes(&name);
                let st = rustix::fs::statat(dir, name_os, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|e| ioe("reading an entry of")(e.into()))?;
                match FileType::from_raw_mode(st.st_mode) {
                    FileType::CharacterDevice if st.st_rdev == 0 => {}
                    FileType::Directory => {
                        let mut child = comps.clone();
                        child.push(name.clone());
                        let top = open_dir_at(dir.as_fd(), &name)
                            .map_err(|e| ioe("opening a directory of")(e.into()))?;
                        let mut below = vec![*layer];
                        if !crate::layer::write::is_opaque_fd(top.as_fd())
                            .map_err(ioe("reading the opaque marker in"))?
                        {
                            for (lower, ldir) in &dirs[k + 1..] {
                                let lst = match rustix::fs::statat(
                                    ldir,
                                    name_os,
                                    AtFlags::SYMLINK_NOFOLLOW,
                                ) {
                                    Ok(st) => st,
                                    Err(Errno::NOENT) => continue,
                                    Err(e) => {
                                        return Err(io_err(
                                            "reading an entry of",
                                            &lowers[*lower].0,
                                        )(
                                            e.into()
                                        ));
                                    }
                                };
                                if FileType::from_raw_mode(lst.st_mode) != FileType::Directory {
                                    break;
                                }
                                below.push(*lower);
                                let sub = open_dir_at(ldir.as_fd(), &name).map_err(|e| {
                                    io_err("opening a directory of", &lowers[*lower].0)(e.into())
                                })?;
                                if crate::layer::write::is_opaque_fd(sub.as_fd()).map_err(
                                    io_err("reading the opaque marker in", &lowers[*lower].0),
                                )? {
                                    break;
                                }
                            }
                        }
                        copy_dir(top.as_fd(), &st, dest.as_fd(), name_os)
                            .map_err(io_err("making the directory", &at(&child)))?;
                        made.push((child.clone(), times_of(&st)));
                        todo.push((child, below));
                    }
                    _ => rustix::fs::linkat(dir, name_os, &dest, name_os, AtFlags::empty())
                        .map_err(|e| {
                            io_err(
                                "hard-linking",
                                &at(&[comps.clone(), vec![name.clone()]].concat()),
                            )(e.into())
                        })?,
                }
            }
        }
    }
    // Deepest first: a directory's time is set once nothing more is made in it.
    made.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
    for (comps, times) in made {
        let Some((name, parent)) = comps.split_last() else {
            continue;
        };
        let dir = open_dir(&out_root, parent)?;
        rustix::fs::utimensat(
            &dir,
            std::ffi::OsStr::from_bytes(name),
            &times,
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io_err("setting the times of", &at(&comps))(e.into()))?;
    }
    Ok(())
}

/// The access and modification times of `st`, to set again.
fn times_of(st: &rustix::fs::Stat) -> rustix::fs::Timestamps {
    let time = |tv_sec, tv_nsec| rustix::fs::Timespec { tv_sec, tv_nsec };
    rustix::fs::Timestamps {
        last_access: time(st.st_atime as _, st.st_atime_nsec as _),
        last_modification: time(st.st_mtime as _, st.st_mtime_nsec as _),
    }
}

/// Makes the directory `name` in `dest` with the owner, mode and kept xattrs
/// ([`crate::layer::keep_xattr`]) of the directory `src` (whose `lstat` is `st`): owner
/// first, as chown clears setuid and setgid.
fn copy_dir(
    src: std::os::fd::BorrowedFd<'_>,
    st: &rustix::fs::Stat,
    dest: std::os::fd::BorrowedFd<'_>,
    name: &std::ffi::OsStr,
) -> io::Result<()> {
    rustix::fs::mkdirat(dest, name, Mode::from_raw_mode(0o700))?;
    let fd = open_dir_at(dest, name.as_bytes())?;
    rustix::fs::fchown(
        &fd,
        Some(rustix::process::Uid::from_raw(st.st_uid)),
        Some(rustix::process::Gid::from_raw(st.st_gid)),
    )?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(st.st_mode & 0o7777))?;
    let mut names = vec![0u8; 64 << 10];
    let n = match rustix::fs::flistxattr(src, &mut names[..]) {
        Ok(n) => n,
        Err(Errno::NOTSUP) => 0,
        Err(e) => return Err(e.into()),
    };
    let mut value = vec![0u8; 64 << 10];
    for key in names[..n].split(|b| *b == 0).filter(|k| !k.is_empty()) {
        if !crate::layer::keep_xattr(key) {
            continue;
        }
        let key = std::ffi::OsStr::from_bytes(key);
        let m = rustix::fs::fgetxattr(src, key, &mut value[..])?;
        rustix::fs::fsetxattr(&fd, key, &value[..m], XattrFlags::empty())?;
    }
    Ok(())
}

/// The first line of what names a squashed tree ([`LayerDirs::squashed`]): a new version
/// when the way one is made changes, so that no older tree is reused.
pub const SQUASH_KEY_VERSION: &str = "kiln squashed layers v2\n";

/// How many of a step's `lowers` lower directories (topmost first) go into one squashed tree
/// ([`LayerDirs::squashed`]) when the mount takes at most `fit` lowers: 0 when all fit; else
/// the lowest ones, in a multiple of `fit / 2` (all of them when that is more), so that the
/// rest plus the squashed tree fit, and the next steps of a build (one more layer each)
/// reuse the same tree for up to `fit / 2` steps before a larger one is made. `None`: `fit`
/// is 0, so no squash fits.
pub fn squash_plan(lowers: usize, fit: usize) -> Option<usize> {
    if lowers <= fit {
        return Some(0);
    }
    if fit == 0 {
        return None;
    }
    // The top `fit - 1` stay; the rest, rounded up to a multiple of the step, squash.
    let step = (fit / 2).max(1);
    let need = lowers - (fit - 1);
    Some(need.div_ceil(step).saturating_mul(step).min(lowers))
}

/// Unpacks the layer blob at `blob` (a tar stream, compressed or not) into the empty
/// directory `dir` in overlayfs' form (the module doc): [`apply_layer`](crate::layer::apply_layer), with its bounds
/// `limits` and its walk that stays inside `dir`, then the whiteouts turned into overlayfs
/// markers (a second read of the blob, only when [`apply_layer`](crate::layer::apply_layer) counted whiteouts). `digest` names the layer in errors. What a microVM step sends back (its upper
/// directory as a tar stream) is unpacked this way into the step's upper directory.
///
/// Errors: [`LowerError::Layer`] (a bad or hostile stream, a bound), [`LowerError::Io`]; the
/// directory may then hold part of the layer (never anything outside it).
pub fn unpack_overlay_form(
    dir: &Path,
    blob: &Path,
    digest: &str,
    limits: &Limits,
) -> Result<(), LowerError> {
    let (f, compression) = layer_stream(blob, digest)?;
    let stats = apply_layer_as(dir, f, compression, digest, limits)?;
    // Most layers (a base's, a step's that removed nothing) have no whiteout: then the
    // marker pass would read the whole blob again for nothing.
    if stats.whiteouts == 0 {
        return Ok(());
    }
    let (f, compression) = layer_stream(blob, digest)?;
    mark_whiteouts(dir, f, compression, digest, limits)
}

/// The stream of layer `digest` (blob at `blob`) and its compression when known: the plain
/// tar of its live shared copy when the flattener's scan of the build's base is inflating or
/// keeping it ([`crate::layer::shared`]; the base is then inflated once, not once per
/// reader), else the blob itself (its compression sniffed by the reader).
fn layer_stream(
    blob: &Path,
    digest: &str,
) -> Result<(Box<dyn Read>, Option<Compression>), LowerError> {
    if let Some(copy) = crate::layer::shared::follow(digest, blob) {
        tracing::debug!(
            layer = digest,
            "unpacking from the scan's shared inflated copy"
        );
        return Ok((Box::new(copy), Some(Compression::None)));
    }
    let f = fs::File::open(blob).map_err(io_err("opening", blob))?;
    Ok((Box::new(f), None))
}

/// A decompressing reader for a layer blob (by magic bytes: [`crate::layer::Compression`]).
pub fn decompressed(blob: impl Read + 'static) -> io::Result<Box<dyn Read>> {
    let mut raw = io::BufReader::with_capacity(256 << 10, blob);
    let head = io::BufRead::fill_buf(&mut raw)?;
    crate::layer::Compression::sniff(head).decoder(raw)
}

/// `sha256:` of a layer blob's uncompressed tar (its `diff_id`, OCI image spec `config.md`).
pub fn diff_id_of(blob: &Path) -> io::Result<Sha256Hash> {
    let mut r = decompressed(fs::File::open(blob)?)?;
    let mut h = Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finish())
}

/// Second pass over a layer already applied to the empty directory `root`: its whiteouts
/// become overlayfs markers, a character device 0/0 in a directory whose times stay as the
/// layer set them. A whiteout of a directory this same layer makes (`.wh.d` and `d/`) makes
/// that directory opaque, so that it hides the lower layers' `d` instead of merging with it;
/// of any other entry it made, it is dropped (the entry shadows the lower ones). A whiteout
/// under a path this layer made a symlink (or any non-directory) is dropped: overlayfs could
/// not honour it either. Parents are walked with [`crate::rootfs`]'s walk, following no
/// symlink.
fn mark_whiteouts(
    root: &Path,
    blob: impl Read,
    compression: Option<Compression>,
    digest: &str,
    limits: &Limits,
) -> Result<(), LowerError> {
    let how = Walk::own_dirs(true, false);
    for_each_entry_path(
        root,
        blob,
        compression,
        digest,
        limits,
        "marking whiteouts in",
        |root_fd, comps| {
            let Some((base, parent)) = comps.split_last() else {
                return Ok(());
            };
            // apply_layer already refused malformed whiteouts.
            let kind = match WhiteoutKind::parse(base) {
                Ok(k) => k,
                Err(_) => return Ok(()),
            };
            if matches!(kind, WhiteoutKind::None | WhiteoutKind::Meta) {
                return Ok(());
            }
            let dir = match walk_fd(root_fd.as_fd(), parent, &how, None) {
                Ok(mut reached) => reached.dirs.pop().expect("the root stays").0,
                Err(WalkError::NotADirectory) => return Ok(()),
                Err(e) => return Err(walk_io(e)),
            };
            match kind {
                WhiteoutKind::Remove(target) => {
                    let target = std::ffi::OsStr::from_bytes(target);
                    match rustix::fs::statat(&dir, target, AtFlags::SYMLINK_NOFOLLOW) {
                        // Made by this same layer: the whiteout hides only lower layers' entry.
                        // A directory made again would merge with theirs: it is opaque.
                        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                            let made = open_dir_at(dir.as_fd(), target.as_bytes())?;
                            rustix::fs::fsetxattr(
                                &made,
                                overlay_opaque_xattr(),
                                b"y",
                                XattrFlags::empty(),
                            )?
                        }
                        // Any other entry shadows the lower ones already.
                        Ok(_) => {}
                        Err(Errno::NOENT) => {
                            // The marker keeps the directory's times as the layer set them.
                            let st = rustix::fs::fstat(&dir)?;
                            rustix::fs::mknodat(
                                &dir,
                                target,
                                FileType::CharacterDevice,
                                Mode::empty(),
                                rustix::fs::makedev(0, 0),
                            )?;
                            rustix::fs::futimens(&dir, &times_of(&st))?
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                WhiteoutKind::Opaque => {
                    rustix::fs::fsetxattr(&dir, overlay_opaque_xattr(), b"y", XattrFlags::empty())?
                }
                WhiteoutKind::None | WhiteoutKind::Meta => {}
            }
            Ok(())
        },
    )
}

/// A walk's failure as an I/O error of the pass that walked.
fn walk_io(e: WalkError<FsError>) -> io::Error {
    match e {
        WalkError::Tree(e) => io::Error::other(format!("{}: {}", e.op, io::Error::from(e.errno))),
        e => io::Error::other(format!("walking a layer's parents: {e:?}")),
    }
}

/// Calls `f` with a directory descriptor of `root` and the path components of each entry
/// of the layer `blob` ([`crate::layer::split_name`]'s; entries it refuses are skipped, as
/// [`apply_layer`](crate::layer::apply_layer) refuses them), in stream order: the one read of entry names of the passes
/// over a layer besides [`apply_layer`](crate::layer::apply_layer)'s ([`mark_whiteouts`]; the blob-made squash the tests
/// check [`merge_lowers`] against), through the same bounded reader under `limits` (bytes,
/// time, entries). `what` names the pass in errors.
fn for_each_entry_path(
    root: &Path,
    blob: impl Read,
    compression: Option<Compression>,
    digest: &str,
    limits: &Limits,
    what: &'static str,
    mut f: impl FnMut(&OwnedFd, &[Vec<u8>]) -> io::Result<()>,
) -> Result<(), LowerError> {
    let root_fd = rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("opening", root)(e.into()))?;
    let (stream, bounded) = bounded_stream_as(blob, compression, digest, limits)?;
    let mut archive = tar::Archive::new(stream);
    let mut last = String::from("(start)");
    let entries = archive.entries().map_err(|e| bounded.error(e, &last))?;
    for (n, entry) in entries.enumerate() {
        let entry = entry.map_err(|e| bounded.error(e, &last))?;
        let name = entry.path_bytes().into_owned();
        last = String::from_utf8_lossy(&name).into_owned();
        if n as u64 >= limits.max_entries {
            return Err(LayerError::Limit {
                digest: digest.to_string(),
                entry: last,
                kind: LimitKind::Entries,
                max: limits.max_entries,
            }
            .into());
        }
        if let Split::Ok(comps) = split_name(&name) {
            f(&root_fd, &comps).map_err(io_err(what, root))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::apply_layer;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    /// The squash as kiln made it before [`merge_lowers`], from the blobs (`digests` bottom
    /// first, from `cache`) into the empty directory `root`: each layer applied in order by
    /// [`apply_layer`](crate::layer::apply_layer), after its parents were made its own ([`own_parents`]). The oracle
    /// the merged trees are checked against.
    fn squash_from_blobs(
        root: &Path,
        cache: &dyn BlobCache,
        digests: &[BlobDigest],
        limits: &Limits,
    ) -> Result<(), LowerError> {
        for d in digests {
            let blob = cache.blob_path(d)?.ok_or(LowerError::Missing(*d))?;
            let label = d.to_string();
            let f = fs::File::open(&blob).map_err(io_err("opening", &blob))?;
            own_parents(root, f, &label, limits)?;
            let f = fs::File::open(&blob).map_err(io_err("opening", &blob))?;
            apply_layer(root, f, &label, limits)?;
        }
        Ok(())
    }

    /// Before layer `blob` is applied to the tree `root` (the layers below it, applied): every
    /// parent path of its entries whose component is not a directory in the tree (a symlink, a
    /// file) is replaced by an empty directory (0755, root), as overlayfs shows this layer's
    /// directory over a lower non-directory. Nothing is followed ([`crate::rootfs`]'s walk with
    /// [`Walk::replace`]); a missing parent is left for the layer's apply to make. Entries are
    /// read as [`mark_whiteouts`] reads them ([`for_each_entry_path`]).
    fn own_parents(
        root: &Path,
        blob: impl Read,
        digest: &str,
        limits: &Limits,
    ) -> Result<(), LowerError> {
        let how = Walk::own_dirs(false, true);
        for_each_entry_path(
            root,
            blob,
            None,
            digest,
            limits,
            "making the parents of a layer in",
            |root_fd, comps| {
                let Some((_, parents)) = comps.split_last() else {
                    return Ok(());
                };
                match walk_fd(root_fd.as_fd(), parents, &how, None) {
                    Ok(_) | Err(WalkError::Missing) => Ok(()),
                    Err(e) => Err(walk_io(e)),
                }
            },
        )
    }

    fn hdr() -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    }

    fn tar_gz(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        for (name, data) in entries {
            let mut h = hdr();
            match data {
                Some(d) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(d.len() as u64);
                    h.set_mode(0o644);
                    b.append_data(&mut h, name, *d).unwrap();
                }
                None => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o755);
                    b.append_data(&mut h, name, io::empty()).unwrap();
                }
            }
        }
        b.into_inner().unwrap().finish().unwrap()
    }

    /// OCI whiteouts become overlay markers; what the same layer adds stays; an upper
    /// directory written back as a layer gives the OCI form again.
    #[test]
    fn whiteouts_round_trip_through_overlay_form() {
        if !rustix::process::geteuid().is_root() {
            panic!("needs root (mknod, trusted.* xattrs); CI runs as root");
        }
        let t = tempfile::tempdir().unwrap();
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let blob = tar_gz(&[
            ("a/", None),
            ("a/.wh.gone", Some(b"")),
            ("b/", None),
            ("b/.wh..wh..opq", Some(b"")),
            ("b/kept", Some(b"k")),
            ("c/d/.wh.x", Some(b"")),
            (".wh.top", Some(b"")),
            ("f", Some(b"data")),
        ]);
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
        let d = dirs.ensure(&cache, &digest, &Limits::default()).unwrap();
        let wh = |p: &str| {
            let m = fs::symlink_metadata(d.join(p)).unwrap();
            m.file_type().is_char_device() && m.rdev() == 0
        };
        assert!(wh("a/gone") && wh("c/d/x") && wh("top"));
        assert!(crate::layer::write::is_opaque(&d.join("b")).unwrap());
        assert!(!crate::layer::write::is_opaque(&d.join("a")).unwrap());
        assert_eq!(fs::read(d.join("b/kept")).unwrap(), b"k");
        // Second call: cached, same directory.
        assert_eq!(dirs.ensure(&cache, &digest, &Limits::default()).unwrap(), d);

        let mut out = Vec::new();
        crate::layer::write::write_upper_layer(&d, &mut out, None).unwrap();
        let mut names = Vec::new();
        let mut a = tar::Archive::new(decompressed(io::Cursor::new(out.clone())).unwrap());
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            names.push(String::from_utf8(e.path_bytes().into_owned()).unwrap());
            // Strict readers (the ext4 flattener) need every numeric field.
            let h = e.header();
            h.uid().unwrap();
            h.gid().unwrap();
            h.mtime().unwrap();
            h.mode().unwrap();
            for x in e.pax_extensions().unwrap().into_iter().flatten() {
                let x = x.unwrap();
                assert!(!x.key().unwrap().contains("overlay"), "{:?}", x.key());
            }
        }
        assert_eq!(
            names,
            [
                ".wh.top",
                "a/",
                "a/.wh.gone",
                "b/",
                "b/.wh..wh..opq",
                "b/kept",
                "c/",
                "c/d/",
                "c/d/.wh.x",
                "f"
            ]
        );
        // The diff_id is the sha256 of the uncompressed tar.
        let p = t.path().join("l.tar.zst");
        fs::write(&p, &out).unwrap();
        let mut raw = Vec::new();
        decompressed(io::Cursor::new(out.clone()))
            .unwrap()
            .read_to_end(&mut raw)
            .unwrap();
        assert_eq!(diff_id_of(&p).unwrap(), crate::cache::digest_of(&raw));
    }

    /// A layer whose inflated stream a flatten scan keeps (the prescan of a build's base) is
    /// unpacked from that shared copy, not from its blob ([`layer_stream`]): the same
    /// directory as unpacked from the blob, whiteouts marked (a second read of the copy),
    /// with the blob gone meanwhile; and the image the scan continues to is the image made
    /// from the blob. Once the scan is gone, unpacks read the blob again.
    #[test]
    fn a_layer_being_scanned_is_unpacked_from_the_scans_copy() {
        use crate::ext4::{self, Keep, LayerBlob, Prescan};
        if !rustix::process::geteuid().is_root() {
            panic!("needs root (mknod, trusted.* xattrs); CI runs as root");
        }
        let t = tempfile::tempdir().unwrap();
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        // Past the copy's 1 MiB write-behind, so it is appended in pieces.
        let big: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
        let blob = tar_gz(&[
            ("a/", None),
            ("a/.wh.gone", Some(b"")),
            ("b/", None),
            ("b/.wh..wh..opq", Some(b"")),
            ("b/kept", Some(b"k")),
            ("big", Some(&big)),
            ("f", Some(b"data")),
        ]);
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        let path = cache.blob_path(&digest).unwrap().unwrap();
        let layer = LayerBlob {
            digest: digest.to_string(),
            path: path.clone(),
        };
        let unpack = |name: &str| {
            let dir = t.path().join(name);
            fs::create_dir(&dir).unwrap();
            unpack_overlay_form(&dir, &path, &layer.digest, &Limits::default()).map(|()| dir)
        };
        // A whiteout's own times are those of its making (`mknodat`), so two unpacks differ
        // there and nowhere else.
        let tree = |dir: &Path| -> Vec<String> {
            describe(dir)
                .into_iter()
                .map(|l| match l.contains("\"dev 0\"") {
                    true => format!("{} whiteout", l.split(' ').next().unwrap_or_default()),
                    false => l,
                })
                .collect()
        };
        let opts = ext4::Ext4Options {
            disk_mib: None,
            max_mib: ext4::DEFAULT_MAX_MIB,
            source_date_epoch: Some(1_700_000_000),
            limits: Limits::default(),
        };

        // The reference: from the blob, no copy alive.
        assert!(crate::layer::shared::follow(&layer.digest, &path).is_none());
        let want = unpack("want").unwrap();
        let want_img = t.path().join("want.ext4");
        ext4::build(std::slice::from_ref(&layer), &want_img, &opts).unwrap();
        assert!(crate::layer::shared::follow(&layer.digest, &path).is_none());

        let keep = Keep {
            dir: t.path().to_path_buf(),
            max_bytes: u64::MAX,
        };
        let p = Prescan::start(
            vec![layer.clone()],
            &Limits::default(),
            Some(1_700_000_000),
            keep,
        );
        // Its copy is there from the start: an unpack that comes before the scan's thread
        // reads anything follows it too.
        assert!(crate::layer::shared::follow(&layer.digest, &path).is_some());
        let scan = p.take().expect("the prescan read the layer");
        // The blob gone: what is unpacked comes from the scan's copy.
        let aside = t.path().join("aside");
        fs::rename(&path, &aside).unwrap();
        let got = unpack("got").unwrap();
        assert!(tree(&got) == tree(&want), "the same tree as from the blob");
        assert!(crate::layer::write::is_opaque(&got.join("b")).unwrap());
        let got_img = t.path().join("got.ext4");
        ext4::build_from(Some(scan), std::slice::from_ref(&layer), &got_img, &opts).unwrap();
        assert!(fs::read(&got_img).unwrap() == fs::read(&want_img).unwrap());

        // The scan and its copy are gone: the blob is read again (here: missing).
        assert!(crate::layer::shared::follow(&layer.digest, &path).is_none());
        assert!(unpack("after").is_err());
        fs::rename(&aside, &path).unwrap();
        assert!(tree(&unpack("again").unwrap()) == tree(&want));
    }

    /// Issue 34: a layer unpacked from its blob by a build of one work directory goes into
    /// the host's shared directory, and a build of another work directory (another store, its
    /// own blob cache) finds it there and unpacks nothing (the same inode); a step's adopted
    /// directory stays in its own work directory; a blob whose bytes are not its digest is
    /// never unpacked there.
    #[test]
    fn the_hosts_shared_layers_are_unpacked_once() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("host/layers");
        let blob = tar_gz(&[("etc/", None), ("etc/os-release", Some(b"debian"))]);
        let digest = BlobDigest::of(&blob);
        let limits = Limits::default();
        let store = |name: &str| {
            let cache = crate::cache::LocalCache::open(&t.path().join(name)).unwrap();
            cache.put_bytes(&digest, &blob).unwrap();
            let dirs =
                LayerDirs::open_shared(&t.path().join(name).join(".build/layers"), Some(&shared))
                    .unwrap();
            (cache, dirs)
        };
        let (cache_a, a) = store("a");
        assert_eq!(a.shared(), Some(shared.as_path()));
        let d = a.ensure(&cache_a, &digest, &limits).unwrap();
        assert_eq!(d, shared.join(digest.hex()));
        assert!(!t.path().join("a/.build/layers").join(digest.hex()).exists());
        let mode = fs::metadata(&shared).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "the shared directory is private");
        let ino = |p: &Path| fs::symlink_metadata(p).unwrap().ino();
        let (dir_ino, file_ino) = (ino(&d), ino(&d.join("etc/os-release")));

        // Another store: found, not unpacked again (its blob even gone).
        let (cache_b, b) = store("b");
        let blob_b = cache_b.blob_path(&digest).unwrap().unwrap();
        fs::remove_file(&blob_b).unwrap();
        assert_eq!(b.path(&digest), d);
        assert_eq!(b.ensure(&cache_b, &digest, &limits).unwrap(), d);
        assert_eq!(
            (ino(&d), ino(&d.join("etc/os-release"))),
            (dir_ino, file_ino)
        );
        // Its squashed trees are its own, linking the shared files.
        let sq = b.squashed(&cache_b, &[digest], &limits).unwrap();
        assert!(
            sq.starts_with(t.path().join("b/.build/layers")),
            "{}",
            sq.display()
        );
        assert_eq!(ino(&sq.join("etc/os-release")), file_ino);

        // A step's upper directory is adopted into its own work directory.
        let upper = b.temp("upper");
        fs::create_dir_all(upper.join("made")).unwrap();
        let step = BlobDigest::of(b"a step's layer");
        let adopted = b.adopt(&upper, &step).unwrap();
        assert_eq!(adopted, t.path().join("b/.build/layers").join(step.hex()));
        assert!(!shared.join(step.hex()).exists());

        // A blob whose bytes are not its digest: refused, nothing left in the shared
        // directory (and nothing in the work directory).
        let other = tar_gz(&[("x", Some(b"x"))]);
        let odigest = BlobDigest::of(&other);
        cache_b.put_bytes(&odigest, &other).unwrap();
        let opath = cache_b.blob_path(&odigest).unwrap().unwrap();
        let mut perms = fs::metadata(&opath).unwrap().permissions();
        perms.set_mode(0o644);
        fs::set_permissions(&opath, perms).unwrap();
        fs::write(&opath, tar_gz(&[("y", Some(b"swapped"))])).unwrap();
        let e = b.ensure(&cache_b, &odigest, &limits).unwrap_err();
        assert!(matches!(e, LowerError::Mismatch { .. }), "{e}");
        let names = |dir: &Path| -> Vec<String> {
            let mut v: Vec<String> = fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let mut want = vec![
            ".lock".to_string(),
            digest.hex(),
            format!("{}{UNPACKING}", digest.hex()),
            format!("{}{UNPACKING}", odigest.hex()),
        ];
        want.sort();
        assert_eq!(names(&shared), want);

        // Without a shared directory, layers are the work directory's, as before.
        let (cache_c, _) = store("c");
        let c = LayerDirs::open(&t.path().join("c/.build/own")).unwrap();
        assert_eq!(c.shared(), None);
        let own = c.ensure(&cache_c, &digest, &limits).unwrap();
        assert_eq!(own, t.path().join("c/.build/own").join(digest.hex()));
    }

    /// Issue 34: `kiln store gc`'s collection of the host's shared layers removes nothing
    /// while a build (of any work directory) holds them, and everything once none does;
    /// an unfinished directory of a dead build there is removed by the next build that opens
    /// the directory, and by the collection; a live build's is kept.
    #[test]
    fn the_hosts_shared_layers_are_collected_only_when_no_build_holds_them() {
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let blob = tar_gz(&[("f", Some(b"data"))]);
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        let limits = Limits::default();
        let dead = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            let start_ticks = kiln_store::owner::start_ticks(pid).unwrap_or(1);
            child.wait().unwrap();
            kiln_store::owner::ProcessId { pid, start_ticks }
        };
        let crashed = shared.join(format!("{}.tmp-{}-0", digest.hex(), dead.token()));
        fs::create_dir_all(crashed.join("etc")).unwrap();
        let a = LayerDirs::open_shared(&t.path().join("a"), Some(&shared)).unwrap();
        assert!(!crashed.exists(), "a dead build's unpack is reaped on open");
        let d = a.ensure(&cache, &digest, &limits).unwrap();
        let live = temp_in(&shared, "live");
        fs::create_dir(&live).unwrap();

        // A build of another work directory holds the shared directory too.
        let b = LayerDirs::open_shared(&t.path().join("b"), Some(&shared)).unwrap();
        drop(a);
        fs::create_dir_all(&crashed).unwrap();
        let busy = crate::workdir::collect_shared_layers(&shared, false).unwrap();
        assert!(busy.busy && busy.dirs == 0, "{busy:?}");
        assert!(d.is_dir() && live.is_dir());
        assert!(
            !crashed.exists(),
            "dead builds' leftovers go even while builds run"
        );
        drop(b);
        let dry = crate::workdir::collect_shared_layers(&shared, true).unwrap();
        assert_eq!((dry.busy, dry.dirs, dry.images), (false, 1, 0));
        assert!(d.is_dir());
        assert!(
            shared
                .join(format!("{}{UNPACKING}", digest.hex()))
                .is_file()
        );
        let done = crate::workdir::collect_shared_layers(&shared, false).unwrap();
        assert_eq!(done, dry);
        assert!(!d.exists());
        assert!(!shared.join(format!("{}{UNPACKING}", digest.hex())).exists());
        assert!(
            live.is_dir(),
            "a live build's unfinished directory is its own"
        );
        // Unpacked again on use.
        let c = LayerDirs::open_shared(&t.path().join("c"), Some(&shared)).unwrap();
        assert_eq!(c.ensure(&cache, &digest, &limits).unwrap(), d);
        assert_eq!(fs::read(d.join("f")).unwrap(), b"data");
        assert_eq!(
            crate::workdir::collect_shared_layers(&t.path().join("none"), false).unwrap(),
            crate::workdir::LayersCollected::default()
        );
    }

    /// Issue 34: a build that needs a layer another build of the host is unpacking into the
    /// shared directory waits for it, unpacks nothing itself and finds the other's directory;
    /// a wait stops at the build's deadline.
    #[test]
    fn a_layer_being_unpacked_by_another_build_is_waited_for() {
        let t = tempfile::tempdir().unwrap();
        let shared = t.path().join("shared");
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let blob = tar_gz(&[("f", Some(b"data"))]);
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        let a = LayerDirs::open_shared(&t.path().join("a"), Some(&shared)).unwrap();
        let b = LayerDirs::open_shared(&t.path().join("b"), Some(&shared)).unwrap();
        // Build a is unpacking (holds the lock, its directory not there yet).
        let held = lock_unpacking(&shared, &digest, &Limits::default()).unwrap();
        let late = Limits {
            deadline: Some(std::time::Instant::now() + std::time::Duration::from_millis(200)),
            ..Limits::default()
        };
        let e = b.ensure(&cache, &digest, &late).unwrap_err();
        assert!(
            matches!(e, LowerError::Layer(LayerError::Deadline { .. })),
            "{e}"
        );
        let waiting = {
            let (b, cache) = (b.clone(), cache.clone());
            std::thread::spawn(move || b.ensure(&cache, &digest, &Limits::default()))
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!waiting.is_finished(), "b waits for a's unpack");
        let temps = |dir: &Path| {
            fs::read_dir(dir)
                .unwrap()
                .filter(|e| {
                    let n = e.as_ref().unwrap().file_name();
                    n.to_string_lossy().contains(".tmp-")
                })
                .count()
        };
        assert_eq!(temps(&shared), 0, "b unpacks nothing meanwhile");
        // a's unpack completes (as LayerDirs::ensure does it), then releases the lock.
        let tmp = temp_in(&shared, &digest.hex());
        fs::create_dir(&tmp).unwrap();
        fs::write(tmp.join("made-by-a"), b"").unwrap();
        fs::rename(&tmp, shared.join(digest.hex())).unwrap();
        drop(held);
        let got = waiting.join().unwrap().unwrap();
        assert_eq!(got, shared.join(digest.hex()));
        assert!(got.join("made-by-a").is_file(), "b found a's directory");
        assert_eq!(a.ensure(&cache, &digest, &Limits::default()).unwrap(), got);
    }

    #[test]
    fn only_dead_processes_temps_are_stale() {
        let stale_temp = |name: &str| crate::workdir::owned_by_dead_process(name, ".tmp-");
        assert!(!stale_temp("0123abcd"));
        assert!(!stale_temp(&format!("upper.tmp-{}-3", std::process::id())));
        assert!(!stale_temp("upper.tmp-1-0"), "pid 1 is alive");
        assert!(stale_temp("upper.tmp-2147483646-0"));
        assert!(stale_temp("upper.tmp-x"));
        let me = kiln_store::owner::ProcessId::current();
        assert!(!stale_temp(&format!("upper.tmp-{}-3", me.token())));
        let reused = kiln_store::owner::ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(stale_temp(&format!("upper.tmp-{}-3", reused.token())));
    }

    #[test]
    fn squash_plans_fit_the_mount_and_grow_in_steps() {
        assert_eq!(squash_plan(0, 0), Some(0));
        assert_eq!(squash_plan(16, 16), Some(0));
        assert_eq!(squash_plan(1, 0), None);
        // 17 lowers where 16 fit: the lowest 8 squash, 9 + 1 lowers.
        assert_eq!(squash_plan(17, 16), Some(8));
        // The same squash serves the next steps, until 15 + 1 are mounted.
        for n in 17..=23 {
            assert_eq!(squash_plan(n, 16), Some(8), "{n}");
        }
        assert_eq!(squash_plan(24, 16), Some(16));
        assert_eq!(squash_plan(30, 16), Some(16));
        assert_eq!(squash_plan(32, 16), Some(24));
        // overlayfs' 500: the lowest 250 squash at 501, 500 at 750.
        assert_eq!(squash_plan(501, 500), Some(250));
        assert_eq!(squash_plan(749, 500), Some(250));
        assert_eq!(squash_plan(750, 500), Some(500));
        // A mount of one lower takes the whole squash.
        assert_eq!(squash_plan(5, 1), Some(5));
        for lowers in 0..=1200 {
            for fit in [1, 2, 3, 7, 16, 22, 500] {
                let s = squash_plan(lowers, fit).unwrap();
                let mounted = lowers - s + usize::from(s > 0);
                assert!(s <= lowers && mounted <= fit, "{lowers} on {fit}: {s}");
            }
        }
    }

    /// A squashed tree is the layers applied in order: a whiteout and an opaque directory
    /// of a later layer remove what earlier ones made and leave no marker; it is made once
    /// per list of digests, and another order is another tree.
    #[test]
    fn squashed_tree_applies_the_layers_in_order_once() {
        if !rustix::process::geteuid().is_root() {
            panic!("needs root (owners); CI runs as root");
        }
        let t = tempfile::tempdir().unwrap();
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let put = |entries: &[(&str, Option<&[u8]>)]| {
            let blob = tar_gz(entries);
            let digest = BlobDigest::of(&blob);
            cache.put_bytes(&digest, &blob).unwrap();
            digest
        };
        let l1 = put(&[
            ("a", Some(b"a1")),
            ("gone", Some(b"x")),
            ("o/", None),
            ("o/x", Some(b"x")),
        ]);
        let l2 = put(&[
            (".wh.gone", Some(b"")),
            ("o/", None),
            ("o/.wh..wh..opq", Some(b"")),
            ("o/y", Some(b"y")),
            ("a", Some(b"a2")),
        ]);
        let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(t.path().join("layers"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o700, "layers/ is private");
        }
        let both = [l1, l2];
        let d = dirs.squashed(&cache, &both, &Limits::default()).unwrap();
        assert_eq!(fs::read(d.join("a")).unwrap(), b"a2");
        assert!(fs::symlink_metadata(d.join("gone")).is_err());
        assert!(fs::symlink_metadata(d.join("o/x")).is_err());
        assert_eq!(fs::read(d.join("o/y")).unwrap(), b"y");
        assert!(!crate::layer::write::is_opaque(&d.join("o")).unwrap());
        assert_eq!(dirs.squashed(&cache, &both, &Limits::default()).unwrap(), d);
        // No layers (a stage FROM scratch with no step): an empty tree.
        let none = dirs.squashed(&cache, &[], &Limits::default()).unwrap();
        assert_eq!(fs::read_dir(&none).unwrap().count(), 0);
        let other = dirs
            .squashed(&cache, &[l2, l1], &Limits::default())
            .unwrap();
        assert_ne!(other, d);
        assert_eq!(fs::read(other.join("a")).unwrap(), b"a1");
        // A missing blob is named, and leaves nothing behind.
        let missing = format!("sha256:{}", "0".repeat(64));
        let e = dirs
            .squashed(&cache, &[l1, missing.parse().unwrap()], &Limits::default())
            .unwrap_err();
        assert!(e.to_string().contains(&missing), "{e}");
        // The lock, three trees and the two layers' directories they are made of.
        assert_eq!(fs::read_dir(t.path().join("layers")).unwrap().count(), 6);
    }

    /// A lower layer's symlink (or file) where a later layer has a directory is replaced by
    /// that directory in the squashed tree, as overlayfs stacks them: the later layer's
    /// entries and whiteouts below it are never applied through the symlink (found by the
    /// attack pass: `/tmp/attack/repro_squash_symlink.sh`, `repro_stage_tree.sh`).
    #[test]
    fn squashed_tree_never_writes_through_a_lower_symlink() {
        if !rustix::process::geteuid().is_root() {
            panic!("needs root (owners); CI runs as root");
        }
        let t = tempfile::tempdir().unwrap();
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let put = |blob: Vec<u8>| {
            let digest = BlobDigest::of(&blob);
            cache.put_bytes(&digest, &blob).unwrap();
            digest
        };
        let mut b = tar::Builder::new(Vec::new());
        for (name, target) in [("t/in", "/etc"), ("t/out", "../../../x")] {
            let mut h = hdr();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_mode(0o777);
            b.append_link(&mut h, name, target).unwrap();
        }
        let lower = put(tar_gz(&[
            ("etc/", None),
            ("etc/passwd", Some(b"root")),
            ("t/", None),
            ("t/file", Some(b"f")),
        ]));
        let links = put(b.into_inner().unwrap());
        let upper = put(tar_gz(&[
            ("t/in/.wh.passwd", Some(b"")),
            ("t/in/new", Some(b"n")),
            ("t/out/f", Some(b"o")),
            ("t/file/under", Some(b"u")),
        ]));
        let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
        let d = dirs
            .squashed(&cache, &[lower, links, upper], &Limits::default())
            .unwrap();
        assert_eq!(fs::read(d.join("etc/passwd")).unwrap(), b"root");
        assert!(!d.join("etc/new").exists());
        for (dir, file, data) in [
            ("t/in", "new", "n"),
            ("t/out", "f", "o"),
            ("t/file", "under", "u"),
        ] {
            assert!(fs::symlink_metadata(d.join(dir)).unwrap().is_dir(), "{dir}");
            assert_eq!(fs::read_to_string(d.join(dir).join(file)).unwrap(), data);
        }
        assert!(!t.path().join("x").exists());
    }

    /// An entry of a test layer ([`layer_of`]).
    enum E<'a> {
        /// A directory: name, mode, uid, gid.
        Dir(&'a str, u32, u32, u32),
        /// A regular file: name, content, mode, uid.
        File(&'a str, &'a [u8], u32, u32),
        /// A symlink and its target.
        Sym(&'a str, &'a str),
        /// A hard link and its target.
        Hard(&'a str, &'a str),
        /// A FIFO.
        Fifo(&'a str),
        /// A character device: name, major, minor.
        Dev(&'a str, u32, u32),
        /// The xattr (name, value) of the next entry.
        Xattr(&'a str, &'a [u8]),
    }

    /// A gzip layer of `entries`, the n-th with mtime `mtime + n`.
    fn layer_of(mtime: u64, entries: &[E<'_>]) -> Vec<u8> {
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        for (n, e) in entries.iter().enumerate() {
            let mut h = hdr();
            h.set_mtime(mtime + n as u64);
            h.set_size(0);
            match *e {
                E::Dir(name, mode, uid, gid) => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(mode);
                    h.set_uid(uid.into());
                    h.set_gid(gid.into());
                    b.append_data(&mut h, name, io::empty()).unwrap();
                }
                E::File(name, data, mode, uid) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(mode);
                    h.set_uid(uid.into());
                    h.set_size(data.len() as u64);
                    b.append_data(&mut h, name, data).unwrap();
                }
                E::Sym(name, target) | E::Hard(name, target) => {
                    h.set_entry_type(match e {
                        E::Sym(..) => tar::EntryType::Symlink,
                        _ => tar::EntryType::Link,
                    });
                    h.set_mode(0o777);
                    b.append_link(&mut h, name, target).unwrap();
                }
                E::Fifo(name) | E::Dev(name, ..) => {
                    h.set_entry_type(match e {
                        E::Fifo(_) => tar::EntryType::Fifo,
                        _ => tar::EntryType::Char,
                    });
                    if let E::Dev(_, major, minor) = *e {
                        h.set_device_major(major).unwrap();
                        h.set_device_minor(minor).unwrap();
                    }
                    h.set_mode(0o640);
                    b.append_data(&mut h, name, io::empty()).unwrap();
                }
                E::Xattr(key, value) => b
                    .append_pax_extensions([(format!("SCHILY.xattr.{key}").as_str(), value)])
                    .unwrap(),
            }
        }
        b.into_inner().unwrap().finish().unwrap()
    }

    /// Every entry below `root`, sorted by path, as one line each: path, type, mode, owner,
    /// mtime, kept xattrs, content (a file's bytes, a symlink's target, a device's numbers)
    /// and the first path of its inode in the tree (hard links), as `COPY --from` and a mount
    /// over the tree would see them.
    fn describe(root: &Path) -> Vec<String> {
        fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, fs::Metadata, String)>) {
            let mut names: Vec<_> = fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            for name in names {
                let path = dir.join(&name);
                let rel = format!("{rel}/{}", name.to_string_lossy());
                let md = match fs::symlink_metadata(&path) {
                    Ok(md) => md,
                    // Overlayfs lists a whiteout in a directory it merges with no lower one
                    // (`/t/in` here), and finds nothing by its name.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        eprintln!("{rel}: listed, not found");
                        continue;
                    }
                    Err(e) => panic!("{rel}: {e}"),
                };
                let ft = md.file_type();
                let content = if ft.is_file() {
                    String::from_utf8_lossy(&fs::read(&path).unwrap()).into_owned()
                } else if ft.is_symlink() {
                    fs::read_link(&path).unwrap().display().to_string()
                } else if ft.is_char_device() || ft.is_block_device() {
                    format!("dev {}", md.rdev())
                } else {
                    String::new()
                };
                let mut xattrs = Vec::new();
                let mut buf = vec![0u8; 4096];
                let n = rustix::fs::llistxattr(&path, &mut buf[..]).unwrap();
                for k in buf[..n].split(|b| *b == 0).filter(|k| !k.is_empty()) {
                    if crate::layer::keep_xattr(k) {
                        let mut v = vec![0u8; 4096];
                        let m = rustix::fs::lgetxattr(
                            &path,
                            std::ffi::OsStr::from_bytes(k),
                            &mut v[..],
                        )
                        .unwrap();
                        xattrs.push(format!(
                            "{}={}",
                            String::from_utf8_lossy(k),
                            String::from_utf8_lossy(&v[..m])
                        ));
                    }
                }
                xattrs.sort();
                let line = format!(
                    "{rel} {:?} {:o} {}:{} {}.{} [{}] {content:?}",
                    ft,
                    md.mode() & 0o7777,
                    md.uid(),
                    md.gid(),
                    md.mtime(),
                    md.mtime_nsec(),
                    xattrs.join(",")
                );
                let is_dir = ft.is_dir();
                out.push((rel.clone(), md, line));
                if is_dir {
                    walk(&path, &rel, out);
                }
            }
        }
        let mut entries = Vec::new();
        walk(root, "", &mut entries);
        let mut first: std::collections::HashMap<(u64, u64), String> = Default::default();
        entries
            .into_iter()
            .map(|(rel, md, line)| {
                if md.is_dir() {
                    return line;
                }
                let group = first.entry((md.dev(), md.ino())).or_insert(rel);
                format!("{line} inode of {group}")
            })
            .collect()
    }

    /// The merged tree of a stage is the tree its layers' blobs applied in order give (the
    /// squash kiln made before, [`squash_from_blobs`]) and the tree an overlay mount of its
    /// layer directories shows: whiteouts of files and directories, opaque directories, a
    /// whiteout and the directory made again in one layer, a file replaced by a directory
    /// and a directory by a file, hard links (one of them replaced later), a symlink of a
    /// lower layer under a later layer's entries, owners, modes, setgid, xattrs, mtimes,
    /// devices and FIFOs. Its files are the layer directories' inodes, not copies.
    #[test]
    fn squashed_tree_is_the_blob_squash_and_the_overlay_view() {
        if !rustix::process::geteuid().is_root() {
            panic!("needs root (owners, devices, overlay mounts); CI runs as root");
        }
        let t = tempfile::tempdir().unwrap();
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let put = |blob: Vec<u8>| {
            let digest = BlobDigest::of(&blob);
            cache.put_bytes(&digest, &blob).unwrap();
            digest
        };
        let l1 = put(layer_of(
            1_000,
            &[
                E::Dir("etc/", 0o755, 0, 0),
                E::File("etc/passwd", b"root", 0o644, 0),
                E::Dir("d/", 0o755, 0, 0),
                E::File("d/a", b"a", 0o644, 0),
                E::File("d/b", b"b", 0o600, 3),
                E::Dir("o/", 0o755, 0, 0),
                E::File("o/x", b"x", 0o644, 0),
                E::Dir("o/sub/", 0o755, 0, 0),
                E::File("o/sub/y", b"y", 0o644, 0),
                E::File("f", b"f1", 0o644, 0),
                E::Dir("dd/", 0o755, 0, 0),
                E::File("dd/z", b"z", 0o644, 0),
                E::File("h1", b"hard", 0o4755, 1000),
                E::Hard("h2", "h1"),
                E::Hard("h3", "h1"),
                E::Sym("lnk", "d"),
                E::Dir("t/", 0o755, 0, 0),
                E::File("t/file", b"f", 0o644, 0),
                E::File("gone", b"x", 0o644, 0),
                E::Dir("rm/", 0o755, 0, 0),
                E::File("rm/q", b"q", 0o644, 0),
                E::Dir("w/", 0o755, 0, 0),
                E::File("w/old", b"old", 0o644, 0),
                E::Fifo("fifo"),
                E::Dev("null", 1, 3),
                E::Xattr("user.k", b"v1"),
                E::File("xf", b"xf", 0o644, 0),
                E::Xattr("user.d", b"1"),
                E::Dir("xd/", 0o755, 0, 0),
                E::Dir("s/", 0o2775, 1000, 50),
                E::File("s/g", b"g", 0o664, 1000),
            ],
        ));
        let l2 = put(layer_of(
            2_000,
            &[
                E::File(".wh.gone", b"", 0o644, 0),
                E::File(".wh.rm", b"", 0o644, 0),
                E::Dir("d/", 0o750, 5, 6),
                E::File("d/.wh.a", b"", 0o644, 0),
                E::File("d/c", b"c", 0o644, 0),
                E::Dir("o/", 0o755, 0, 0),
                E::File("o/.wh..wh..opq", b"", 0o644, 0),
                E::File("o/new", b"n", 0o644, 0),
                E::Dir("f/", 0o711, 0, 0),
                E::File("f/inner", b"i", 0o644, 0),
                E::File("dd", b"now a file", 0o644, 0),
                E::Dir("t/", 0o755, 0, 0),
                E::Sym("t/in", "/etc"),
                E::Sym("t/out", "../../../x"),
                E::File("k1", b"k", 0o644, 0),
                E::Hard("k2", "k1"),
                E::Xattr("user.k", b"v2"),
                E::File("xf", b"xf2", 0o644, 0),
            ],
        ));
        let l3 = put(layer_of(
            3_000,
            &[
                E::Dir("t/", 0o755, 0, 0),
                E::Dir("t/in/", 0o755, 0, 0),
                E::File("t/in/.wh.passwd", b"", 0o644, 0),
                E::File("t/in/new", b"n", 0o644, 0),
                E::Dir("t/out/", 0o755, 0, 0),
                E::File("t/out/f", b"o", 0o644, 0),
                E::Dir("t/file/", 0o755, 0, 0),
                E::File("t/file/under", b"u", 0o644, 0),
                E::Dir("lnk/", 0o755, 0, 0),
                E::File("lnk/new", b"n", 0o644, 0),
                E::File(".wh.w", b"", 0o644, 0),
                E::Dir("w/", 0o755, 0, 0),
                E::File("w/new", b"new", 0o644, 0),
                E::Xattr("user.m", b"3"),
                E::Dir("d/", 0o700, 7, 8),
                E::File("h2", b"h2 again", 0o644, 0),
            ],
        ));
        let digests = [l1, l2, l3];
        let limits = Limits::default();
        let expected = t.path().join("from-blobs");
        fs::create_dir(&expected).unwrap();
        squash_from_blobs(&expected, &cache, &digests, &limits).unwrap();
        let want = describe(&expected);
        assert!(want.iter().any(|l| l.starts_with("/w/new ")), "{want:#?}");
        assert!(!want.iter().any(|l| l.starts_with("/w/old ")), "{want:#?}");

        let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
        let merged = dirs.squashed(&cache, &digests, &limits).unwrap();
        assert_eq!(describe(&merged), want);

        // The files are the layer directories' own.
        let ino = |p: &Path| fs::symlink_metadata(p).unwrap().ino();
        assert_eq!(ino(&merged.join("h1")), ino(&dirs.path(&l1).join("h1")));
        assert_eq!(ino(&merged.join("d/c")), ino(&dirs.path(&l2).join("d/c")));

        // What the steps saw: the layer directories stacked as overlay lowers.
        let lowers: Vec<PathBuf> = digests.iter().rev().map(|d| dirs.path(d)).collect();
        let scratch = t.path().join("mount");
        for d in ["upper", "work", "mnt"] {
            fs::create_dir_all(scratch.join(d)).unwrap();
        }
        let seen = crate::build::merged::with_merged(
            lowers,
            scratch.join("upper"),
            scratch.join("work"),
            scratch.join("mnt"),
            |root| Ok(describe(root)),
        )
        .unwrap();
        assert_eq!(seen, want);
    }

    /// The passes of their own over a layer (parents before a squash, whiteouts after an
    /// unpack) read it through the bounded entry reader: a layer past the entry bound is
    /// refused by the pass itself, before anything is applied, naming the bound.
    #[test]
    fn own_passes_over_a_layer_are_bounded() {
        let t = tempfile::tempdir().unwrap();
        let blob = tar_gz(&[
            ("a/", None),
            ("a/x", Some(b"x")),
            ("a/y", Some(b"y")),
            ("a/.wh.z", Some(b"")),
        ]);
        let limits = Limits {
            max_entries: 2,
            ..Limits::default()
        };
        let root = t.path().join("root");
        fs::create_dir(&root).unwrap();
        let err = own_parents(&root, &blob[..], "sha256:many", &limits).unwrap_err();
        assert!(
            matches!(
                err,
                LowerError::Layer(LayerError::Limit {
                    kind: LimitKind::Entries,
                    ..
                })
            ),
            "{err}"
        );
        assert_eq!(fs::read_dir(&root).unwrap().count(), 0);
        let err = mark_whiteouts(&root, &blob[..], None, "sha256:many", &limits).unwrap_err();
        assert!(err.to_string().contains("entry count exceeds"), "{err}");
    }

    /// A whiteout below a symlink the layer planted is dropped, never followed.
    #[test]
    fn whiteout_below_symlink_is_not_followed() {
        if !rustix::process::geteuid().is_root() {
            panic!("needs root; CI runs as root");
        }
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        fs::create_dir(&victim).unwrap();
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        let mut h = hdr();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, "s", &victim).unwrap();
        let mut h = hdr();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(0);
        h.set_mode(0o644);
        b.append_data(&mut h, "s/.wh.x", io::empty()).unwrap();
        let blob = b.into_inner().unwrap().finish().unwrap();
        let cache = crate::cache::LocalCache::open(&t.path().join("store")).unwrap();
        let digest = BlobDigest::of(&blob);
        cache.put_bytes(&digest, &blob).unwrap();
        let dirs = LayerDirs::open(&t.path().join("layers")).unwrap();
        dirs.ensure(&cache, &digest, &Limits::default()).unwrap();
        assert_eq!(fs::read_dir(&victim).unwrap().count(), 0);
    }
}
