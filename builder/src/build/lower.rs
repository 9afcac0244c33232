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
//! ([`crate::workdir`]). Those renames are not made durable (a step's upper is written
//! without syncs), so a host crash can leave a directory under its final name with files
//! cut short; the first [`LayerDirs::open`] of a work directory after a reboot removes every
//! `<hex>` an earlier boot left ([`crate::workdir::LayersLock::shared_this_boot`]), and they
//! are unpacked again from their blobs. An open [`LayerDirs`] holds the shared lock on `layers/.lock`, so
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
//! deadline. The same promises hold there: complete-then-rename (made durable first there,
//! [`sync_file_system`]: a torn directory would outlive any one build), dead
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
        let root_lock = open_private(root, true)?;
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
                    locks.push(open_private(dir, false)?);
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
        if self.shared.is_some()
            && let Err(e) = sync_file_system(&tmp)
        {
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
/// builds that died in it. With `work_dir` (a work directory's `layers/`, not the host's
/// shared directory, whose layers are made durable before they are named), the lock is
/// taken by [`crate::workdir::LayersLock::shared_this_boot`], which first drops what an
/// earlier boot of the host left.
fn open_private(dir: &Path, work_dir: bool) -> Result<crate::workdir::LayersLock, LowerError> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(io_err("making private", dir))?;
    let lock_file = dir.join(crate::workdir::LAYERS_LOCK);
    let locking = io_err("locking", &lock_file);
    let lock = if work_dir {
        let check = crate::workdir::LayersLock::shared_this_boot(dir).map_err(locking)?;
        if let Some(d) = check.dropped.filter(|d| d.dirs + d.images > 0) {
            tracing::info!(
                dir = %dir.display(),
                dirs = d.dirs,
                images = d.images,
                bytes = d.bytes,
                "removed the unpacked layers an earlier boot of the host left \
                 (a crash may have cut them short); they are unpacked again when needed"
            );
        }
        check.lock
    } else {
        crate::workdir::LayersLock::shared(dir).map_err(locking)?
    };
    crate::workdir::remove_dead_entries(dir, ".tmp-");
    Ok(lock)
}

/// Makes everything written under `dir` durable before it is renamed to its final name in
/// the host's shared layer directory: one `syncfs(2)` of its file system. Without it, a host
/// crash could leave the rename on disk (ext4 journals it) but not the files' data (delayed
/// allocation writes it back later): a `<hex>` directory whose files are empty or short,
/// which every later build of the host would mount as that layer. Once per layer and host
/// (bases are unpacked once), so the cost is one flush of the unpacked tree. Errors:
/// [`LowerError::Io`].
fn sync_file_system(dir: &Path) -> Result<(), LowerError> {
    let fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err("opening", dir)(e.into()))?;
    rustix::fs::syncfs(&fd).map_err(|e| io_err("syncing the file system of", dir)(e.into()))
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
pub(crate) fn temp_in(dir: &Path, label: &str) -> PathBuf {
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
    squash_plan_reserving(lowers, fit, 0)
}

/// [`squash_plan`] for a mount that also takes `reserve` lower directories of its own (a
/// `RUN` step's package layer, [`crate::exec::mounts::packages::package_layer`]): at most
/// `fit - reserve` of the step's lowers, squashed in the same multiples of `fit / 2`, so
/// that a `RUN` step reuses the squashed tree of a `COPY` step beside it. `None`: no room.
pub fn squash_plan_reserving(lowers: usize, fit: usize, reserve: usize) -> Option<usize> {
    let room = fit.saturating_sub(reserve);
    if lowers <= room {
        return Some(0);
    }
    if room == 0 {
        return None;
    }
    // The top `room - 1` stay; the rest, rounded up to a multiple of the step, squash.
    let step = (fit / 2).max(1);
    let need = lowers - (room - 1);
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
mod tests;
