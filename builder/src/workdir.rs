//! What builds leave in a work directory, and cleaning up after builds that died.
//!
//! Every directory a build makes for its own use is named after its owner: the build
//! process's [`ProcessId`] token (pid and start time, so a later process that reuses the pid
//! is not taken for the owner), as `<label>.tmp-p<pid>s<start>-<n>` under `layers/` and
//! `trees/`, `run/step-p<pid>s<start>-<n>` for a step's scratch, and the step cgroups
//! `step-p<pid>s<start>-<n>` (reaped with the directories by the build driver,
//! [`crate::build::clean_up_dead_builds`]). A build killed with
//! SIGKILL cannot remove them; [`reap_dead_builds`] (called by every build before it starts,
//! and by `kiln store gc`) removes the ones whose owner no longer runs and never touches a
//! live build's.
//!
//! `layers/<hex>` (one unpacked layer per digest, and one squashed tree per list of layers
//! for steps past the lowers a mount takes and for stages copied from,
//! [`crate::build::lower::LayerDirs`]) is a cache of what the blob cache holds, read as overlay lower directories by running steps.
//! Every build holds a shared lock on `layers/.lock` for its whole run; [`collect_layers`]
//! takes it exclusively, without waiting, and only then removes the unpacked layers, so a
//! build never loses a lower directory it mounted. A later build unpacks again what it needs.
//! The microVM executor's disk images of those layers, under `run/` ([`VM_LOWER_IMAGES`],
//! [`VM_SQUASHED_IMAGES`]), are a cache of the same kind and go with them.
//!
//! The host's shared layer directory (`kiln`'s `layer_dir` setting, default
//! `<cache>/layers`; [`crate::build::BuildOptions::shared_layers`]) holds the layers unpacked
//! from blobs whose digest was checked, for every work directory (every store) of the host
//! ([`crate::build::lower::LayerDirs`]). It keeps the same promises with the same lock: every
//! build holds a shared lock on its `.lock` too; [`collect_shared_layers`] (run by `kiln store
//! gc` of any store, local or S3) takes it exclusively without waiting, so it removes
//! nothing while any build of the host runs; unfinished `*.tmp-*` directories of dead builds
//! are removed by the next build that opens it and by `kiln store gc`
//! ([`remove_dead_entries`]).

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_store::owner::ProcessId;
use rustix::fs::{FlockOperation, Mode, OFlags};

/// The name of the lock file in `layers/` (see the module documentation).
pub const LAYERS_LOCK: &str = ".lock";
/// Where, under a build's `run/` directory, the microVM executor keeps one read-only ext4
/// image per unpacked layer directory (`<hex>.ext4`, `kiln_pipeline::vmexec::lower_image`).
pub const VM_LOWER_IMAGES: &str = "vm-lowers";
/// Where, under a build's `run/` directory, kiln before squashed layer directories
/// ([`crate::build::lower::LayerDirs::squashed`]) kept the microVM executor's squashed disk
/// images (`<hex>.ext4`); [`collect_layers`] still removes them. A squashed directory's
/// image is now one of [`VM_LOWER_IMAGES`].
pub const VM_SQUASHED_IMAGES: &str = "vm-squashed";

/// Where, under the work directory, the `RUN` steps' package layers are kept
/// (`<hex>`, [`crate::exec::mounts::packages::package_layer`]).
pub const PACKAGE_LAYERS: &str = "package-layers";

/// This process's owner token (`p<pid>s<start>`, [`ProcessId::token`]), read once.
pub fn owner_token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| ProcessId::current().token())
}

/// Whether the directory entry `name`, made by a build as `<prefix><token>-<n>`, belongs
/// to a process that no longer runs. Names without `prefix` are not a build's and are never
/// dead. After the prefix, an owner token ([`ProcessId::parse_token`]) is judged by pid and
/// start time; an older name with a bare pid (`<prefix><pid>-<n>`) by the pid alone; anything
/// else after the prefix is an unfinished directory of unknown owner, taken as dead.
pub fn owned_by_dead_process(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.find(prefix).map(|i| &name[i + prefix.len()..]) else {
        return false;
    };
    if let Some((owner, _)) = ProcessId::parse_token(rest) {
        return !owner.is_alive();
    }
    match rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) {
        Some(pid) => pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists(),
        None => true,
    }
}

/// Removes the entries of `dir` named `<prefix><owner>-<n>` whose owner is dead
/// ([`owned_by_dead_process`]); returns them. A missing `dir` has none; entries that cannot
/// be removed are left (and not returned).
pub fn remove_dead_entries(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return removed;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        if !owned_by_dead_process(&name.to_string_lossy(), prefix) {
            continue;
        }
        let path = e.path();
        let gone = match e.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// Removes what dead builds left in `work_dir` (the build's work directory, `.build` of a
/// local store): `run/step-*` scratch, unfinished `layers/*.tmp-*` (step upper, work and
/// unpack directories), `trees/*.tmp-*`, `package-layers/*.tmp-*` and the microVM
/// executor's unfinished disk images (`run/vm-lowers/*.tmp-*`, `run/vm-squashed/*.tmp-*`),
/// of owners that no longer run. Returns the paths removed.
pub fn reap_dead_builds(work_dir: &Path) -> Vec<PathBuf> {
    let run = work_dir.join("run");
    let mut removed = remove_dead_entries(&run, "step-");
    removed.extend(remove_dead_entries(&work_dir.join("layers"), ".tmp-"));
    removed.extend(remove_dead_entries(&work_dir.join("trees"), ".tmp-"));
    removed.extend(remove_dead_entries(&work_dir.join(PACKAGE_LAYERS), ".tmp-"));
    for images in [VM_LOWER_IMAGES, VM_SQUASHED_IMAGES] {
        removed.extend(remove_dead_entries(&run.join(images), ".tmp-"));
    }
    removed
}

/// A lock on `layers/.lock`: shared while a build uses `layers/`, exclusive while
/// [`collect_layers`] empties it. Released when dropped.
#[derive(Debug)]
pub struct LayersLock {
    _fd: OwnedFd,
}

fn open_lock(layers: &Path) -> io::Result<OwnedFd> {
    fs::create_dir_all(layers)?;
    Ok(rustix::fs::open(
        layers.join(LAYERS_LOCK),
        OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )?)
}

impl LayersLock {
    /// Takes the shared lock on `layers/` (a build's), waiting while [`collect_layers`]
    /// runs. Errors: the lock file cannot be created or locked.
    pub fn shared(layers: &Path) -> io::Result<LayersLock> {
        let fd = open_lock(layers)?;
        rustix::fs::flock(&fd, FlockOperation::LockShared)?;
        Ok(LayersLock { _fd: fd })
    }

    /// [`LayersLock::shared`] for a work directory's `layers/` (`work_dir/layers`), first
    /// dropping every cache of unpacked layers the work directory kept from an earlier boot
    /// of the host. Those are written without syncs (adopted step uppers, layers unpacked
    /// from the blob cache, squashed trees, `trees/image-*`, the microVM executor's disk
    /// images of them, the `RUN` steps' package layers) and renamed into place complete,
    /// so after a host crash one can be there by its final name with files the crash
    /// emptied or cut short (ext4 journals the rename but writes delayed data back later),
    /// and every later build would read it as that layer. All of them are caches of blobs
    /// the store keeps or of the recipe, made again when needed.
    ///
    /// How: `layers/` names the boot it was last opened in ([`BOOT_STAMP`], the host's
    /// `/proc/sys/kernel/random/boot_id`, random(4)). When it names another boot (or none:
    /// a work directory of an older kiln), this takes the lock exclusively, waiting for any
    /// [`collect_layers`], looks again (another build of this boot may have been first),
    /// removes the caches ([`BootCheck::dropped`]), writes the stamp, and only then takes
    /// the lock shared. In the boot that wrote them the stamp is read and nothing else is
    /// done. The stamp needs no sync: a crash always changes the boot id, so a lost stamp
    /// only makes the next boot drop the caches, as it must anyway. Where the boot id
    /// cannot be read, nothing is dropped. Errors: the lock file cannot be created or
    /// locked, a cache cannot be removed, or the stamp cannot be written (each named).
    pub fn shared_this_boot(layers: &Path) -> io::Result<BootCheck> {
        let fd = open_lock(layers)?;
        let stamp = layers.join(BOOT_STAMP);
        let stamped = || {
            fs::read_to_string(&stamp)
                .ok()
                .map(|s| s.trim().to_string())
        };
        let mut dropped = None;
        if let Some(boot) = boot_id().filter(|b| stamped().as_ref() != Some(b)) {
            rustix::fs::flock(&fd, FlockOperation::LockExclusive)?;
            if stamped().as_ref() != Some(&boot) {
                let work_dir = layers.parent().unwrap_or(layers);
                let mut out = remove_layer_dirs(layers, false)?;
                remove_layer_images(&work_dir.join("run"), false, &mut out)?;
                out.dirs += remove_image_trees(&work_dir.join("trees"), &mut out.bytes)?;
                remove_package_layers(&work_dir.join(PACKAGE_LAYERS), false, &mut out)?;
                let tmp = layers.join(format!("{BOOT_STAMP}.tmp-{}", owner_token()));
                fs::write(&tmp, format!("{boot}\n")).map_err(named(&tmp))?;
                fs::rename(&tmp, &stamp).map_err(named(&stamp))?;
                dropped = Some(out);
            }
        }
        // flock(2) converts the lock, not atomically: a `kiln store gc` taking it in between
        // finds nothing of this build's to remove yet.
        rustix::fs::flock(&fd, FlockOperation::LockShared)?;
        Ok(BootCheck {
            lock: LayersLock { _fd: fd },
            dropped,
        })
    }
}

/// The file in a work directory's `layers/` naming the boot of the host in which it was
/// last opened ([`LayersLock::shared_this_boot`]): the boot id, one line.
pub const BOOT_STAMP: &str = ".boot-id";

/// What [`LayersLock::shared_this_boot`] found.
#[derive(Debug)]
pub struct BootCheck {
    /// The shared lock, held.
    pub lock: LayersLock,
    /// The caches of an earlier boot it removed, when `layers/` named another boot (or
    /// none): [`LayersCollected::dirs`] counts the unpacked and squashed layer directories
    /// and `trees/image-*`, [`LayersCollected::images`] the microVM executor's disk images.
    pub dropped: Option<LayersCollected>,
}

/// This boot of the host: `/proc/sys/kernel/random/boot_id` (random(4)), or `None` where it
/// cannot be read.
fn boot_id() -> Option<String> {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// What [`collect_layers`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayersCollected {
    /// A build was using `layers/`, so nothing was removed.
    pub busy: bool,
    /// Unpacked layer directories removed (or that would be, in a dry run).
    pub dirs: usize,
    /// The microVM executor's disk images of layers removed (or that would be).
    pub images: usize,
    /// The allocated size of both (`st_blocks` × 512: the disk space freed), bytes.
    pub bytes: u64,
}

/// Removes every unpacked layer directory (`<64 hex>`) under `work_dir/layers`, every
/// disk image the microVM executor made of layers (`<64 hex>.ext4` under
/// `work_dir/run/vm-lowers` and `work_dir/run/vm-squashed`), and every package layer
/// (`work_dir/package-layers/<32 hex>`, counted in [`LayersCollected::dirs`]), when no build holds
/// `layers/` (the exclusive lock is taken without waiting; a busy directory is reported, not
/// waited for). With `dry_run`, only counts. Errors: the lock file cannot be created, or a
/// directory or image cannot be removed (named in the error).
pub fn collect_layers(work_dir: &Path, dry_run: bool) -> io::Result<LayersCollected> {
    let layers = work_dir.join("layers");
    if !layers.is_dir() {
        return Ok(LayersCollected::default());
    }
    let Some((mut out, _held)) = collect_dirs(&layers, dry_run)? else {
        return Ok(LayersCollected {
            busy: true,
            ..LayersCollected::default()
        });
    };
    remove_layer_images(&work_dir.join("run"), dry_run, &mut out)?;
    remove_package_layers(&work_dir.join(PACKAGE_LAYERS), dry_run, &mut out)?;
    Ok(out)
}

/// Removes (with `dry_run`, counts) the `RUN` steps' package layers (`<32 hex>` directories
/// of `dir`, [`PACKAGE_LAYERS`]), adding them to `out`'s directories and bytes: like the
/// unpacked layers, made again by the next step that needs one. The caller holds
/// `layers/.lock` exclusively (a build holds it shared while it uses them). A missing `dir`
/// has none. Errors: as [`remove_dirs_named`].
fn remove_package_layers(dir: &Path, dry_run: bool, out: &mut LayersCollected) -> io::Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let is_layer = |name: &str| name.len() == 32 && name.bytes().all(|b| b.is_ascii_hexdigit());
    remove_dirs_named(dir, is_layer, dry_run, out)
}

/// Removes (with `dry_run`, counts) the microVM executor's disk images of layers
/// (`<64 hex>.ext4` under `run/vm-lowers` and `run/vm-squashed`), adding them to `out`.
/// The caller holds `layers/.lock` exclusively. Errors: an image cannot be removed.
fn remove_layer_images(run: &Path, dry_run: bool, out: &mut LayersCollected) -> io::Result<()> {
    for images in [VM_LOWER_IMAGES, VM_SQUASHED_IMAGES] {
        let Ok(rd) = fs::read_dir(run.join(images)) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let is_image = name.strip_suffix(".ext4").is_some_and(is_hex);
            if !is_image || !e.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let path = e.path();
            out.bytes += e.metadata().map_or(0, |m| m.blocks() * 512);
            out.images += 1;
            if !dry_run {
                fs::remove_file(&path).map_err(named(&path))?;
            }
        }
    }
    Ok(())
}

/// Removes the images unpacked as trees (`trees/image-<64 hex>`, [`crate::build`]'s
/// `COPY --from=<image>`) and adds their allocated bytes to `bytes`; returns how many. The
/// caller holds `layers/.lock` exclusively. Errors: one cannot be removed.
fn remove_image_trees(trees: &Path, bytes: &mut u64) -> io::Result<usize> {
    let Ok(rd) = fs::read_dir(trees) else {
        return Ok(0);
    };
    let mut n = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let is_tree = name
            .to_string_lossy()
            .strip_prefix("image-")
            .is_some_and(is_hex);
        if is_tree && e.file_type().is_ok_and(|t| t.is_dir()) {
            let path = e.path();
            *bytes += tree_size(&path);
            fs::remove_dir_all(&path).map_err(named(&path))?;
            n += 1;
        }
    }
    Ok(n)
}

/// Removes every unpacked layer directory (`<64 hex>`) of the host's shared layer directory
/// `dir` (the module documentation), when no build of the host holds it (the exclusive lock
/// is taken without waiting; a busy directory is reported, not waited for), and first the
/// unfinished `*.tmp-*` directories of dead builds (not counted), and then the lock files
/// of unpacks (`<64 hex>.unpacking`, [`crate::build::lower::UNPACKING`]). With `dry_run`,
/// only counts. A missing `dir` has nothing. [`LayersCollected::images`] is always 0: the
/// microVM executor's images of these layers are in each work directory's `run/`
/// ([`collect_layers`]). Errors: as [`collect_layers`].
pub fn collect_shared_layers(dir: &Path, dry_run: bool) -> io::Result<LayersCollected> {
    if !dir.is_dir() {
        return Ok(LayersCollected::default());
    }
    if !dry_run {
        remove_dead_entries(dir, ".tmp-");
    }
    Ok(match collect_dirs(dir, dry_run)? {
        Some((out, _held)) => {
            // No build holds the directory, so none holds a lock of an unpack in it.
            if !dry_run {
                for e in fs::read_dir(dir)?.flatten() {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    let unpacking = name
                        .strip_suffix(crate::build::lower::UNPACKING)
                        .is_some_and(is_hex);
                    if unpacking && e.file_type().is_ok_and(|t| t.is_file()) {
                        fs::remove_file(e.path()).map_err(named(&e.path()))?;
                    }
                }
            }
            out
        }
        None => LayersCollected {
            busy: true,
            ..LayersCollected::default()
        },
    })
}

fn is_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn named(path: &Path) -> impl FnOnce(io::Error) -> io::Error {
    let shown = path.display().to_string();
    move |err: io::Error| io::Error::new(err.kind(), format!("{shown}: {err}"))
}

/// Takes `layers/.lock` (of the existing directory `layers`) exclusively without waiting and
/// removes (with `dry_run`, counts) the `<64 hex>` directories of `layers`; returns what was
/// done and the lock, to hold while anything else that goes with the layers is removed.
/// `None` when a build holds the directory: nothing was done.
fn collect_dirs(layers: &Path, dry_run: bool) -> io::Result<Option<(LayersCollected, OwnedFd)>> {
    let fd = open_lock(layers)?;
    match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    Ok(Some((remove_layer_dirs(layers, dry_run)?, fd)))
}

/// Removes (with `dry_run`, counts) the `<64 hex>` directories of `layers`. The caller holds
/// `layers/.lock` exclusively. Errors: as [`remove_dirs_named`].
fn remove_layer_dirs(layers: &Path, dry_run: bool) -> io::Result<LayersCollected> {
    let mut out = LayersCollected::default();
    remove_dirs_named(layers, is_hex, dry_run, &mut out)?;
    Ok(out)
}

/// Removes (with `dry_run`, counts in `out`'s directories and bytes) the directories of
/// `dir` whose names `is_cache` takes. Errors: `dir` cannot be read, or one cannot be
/// removed (named).
fn remove_dirs_named(
    dir: &Path,
    is_cache: impl Fn(&str) -> bool,
    dry_run: bool,
    out: &mut LayersCollected,
) -> io::Result<()> {
    for e in fs::read_dir(dir)?.flatten() {
        let name = e.file_name();
        if !is_cache(&name.to_string_lossy()) || !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = e.path();
        out.bytes += tree_size(&path);
        out.dirs += 1;
        if !dry_run {
            fs::remove_dir_all(&path).map_err(named(&path))?;
        }
    }
    Ok(())
}

/// Bytes allocated to everything under `dir` (`st_blocks` × 512: what was really written,
/// so a file's holes cost nothing: `truncate -s 16G` allocates no block), directories and
/// symlinks counting their own blocks, not following symlinks.
pub fn tree_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            if let Ok(md) = e.metadata() {
                total += md.blocks() * 512;
                if md.is_dir() {
                    stack.push(e.path());
                }
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_size_counts_files() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir(d.path().join("a")).unwrap();
        fs::write(d.path().join("a/f"), vec![0u8; 1000]).unwrap();
        assert!(tree_size(d.path()) >= 1000);
    }

    fn dead_pid() -> ProcessId {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start_ticks = kiln_store::owner::start_ticks(pid).unwrap_or(1);
        child.wait().unwrap();
        ProcessId { pid, start_ticks }
    }

    /// Directories of a dead build are removed, a live build's are kept even when its pid
    /// was once a dead build's (the start time tells them apart).
    #[test]
    fn dead_builds_dirs_are_reaped_and_live_ones_kept() {
        let t = tempfile::tempdir().unwrap();
        let w = t.path();
        let dead = dead_pid();
        let me = ProcessId::current();
        let reused = ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        for d in [
            format!("run/step-{}-0", dead.token()),
            format!("run/step-{}-1", reused.token()),
            format!("run/step-{}-2", me.token()),
            format!("layers/upper.tmp-{}-3", dead.token()),
            format!("layers/upper.tmp-{}-4", me.token()),
            format!("trees/tree.tmp-{}-5", dead.token()),
            "layers/aaaa".to_string(),
            "run/other".to_string(),
        ] {
            fs::create_dir_all(w.join(&d).join("x")).unwrap();
        }
        // The microVM executor's unfinished disk images are files.
        for d in [
            format!("run/{VM_LOWER_IMAGES}/aa.tmp-{}-6", dead.token()),
            format!("run/{VM_SQUASHED_IMAGES}/bb.tmp-{}-7", dead.token()),
            format!("run/{VM_SQUASHED_IMAGES}/cc.tmp-{}-8", me.token()),
        ] {
            fs::create_dir_all(w.join(&d).parent().unwrap()).unwrap();
            fs::write(w.join(&d), b"half an image").unwrap();
        }
        let mut removed: Vec<String> = reap_dead_builds(w)
            .iter()
            .map(|p| p.strip_prefix(w).unwrap().display().to_string())
            .collect();
        removed.sort();
        let mut expected = [
            format!("layers/upper.tmp-{}-3", dead.token()),
            format!("run/step-{}-0", dead.token()),
            format!("run/step-{}-1", reused.token()),
            format!("trees/tree.tmp-{}-5", dead.token()),
            format!("run/{VM_LOWER_IMAGES}/aa.tmp-{}-6", dead.token()),
            format!("run/{VM_SQUASHED_IMAGES}/bb.tmp-{}-7", dead.token()),
        ];
        expected.sort();
        assert_eq!(removed, expected);
        for kept in [
            format!("run/step-{}-2", me.token()),
            format!("layers/upper.tmp-{}-4", me.token()),
            "layers/aaaa".to_string(),
            "run/other".to_string(),
        ] {
            assert!(w.join(&kept).is_dir(), "{kept}");
        }
        assert!(
            w.join(format!("run/{VM_SQUASHED_IMAGES}/cc.tmp-{}-8", me.token()))
                .is_file()
        );
    }

    /// Unpacked layers and the microVM executor's images of them go only when no build
    /// holds the layers directory; nothing else in those directories goes.
    #[test]
    fn layers_are_collected_only_when_no_build_holds_them() {
        let t = tempfile::tempdir().unwrap();
        let layers = t.path().join("layers");
        let hex = "ab".repeat(32);
        fs::create_dir_all(layers.join(&hex).join("etc")).unwrap();
        fs::write(layers.join(&hex).join("etc/f"), vec![0u8; 1000]).unwrap();
        fs::create_dir_all(layers.join("not-a-layer")).unwrap();
        let run = t.path().join("run");
        let package = t.path().join(PACKAGE_LAYERS).join("ef".repeat(16));
        fs::create_dir_all(package.join("var/cache")).unwrap();
        std::os::unix::fs::symlink(
            "/var/cache/kiln-packages/apt",
            package.join("var/cache/apt"),
        )
        .unwrap();
        let mut images = Vec::new();
        for (dir, byte) in [(VM_LOWER_IMAGES, 1u8), (VM_SQUASHED_IMAGES, 2u8)] {
            fs::create_dir_all(run.join(dir)).unwrap();
            let img = run.join(dir).join(format!("{}.ext4", "cd".repeat(32)));
            fs::write(&img, vec![byte; 8192]).unwrap();
            fs::write(run.join(dir).join("notes.ext4"), b"x").unwrap();
            images.push(img);
        }
        let lock = LayersLock::shared(&layers).unwrap();
        let busy = collect_layers(t.path(), false).unwrap();
        assert!(busy.busy && busy.dirs == 0 && busy.images == 0, "{busy:?}");
        assert!(layers.join(&hex).is_dir() && images.iter().all(|i| i.is_file()));
        assert!(package.is_dir());
        drop(lock);
        let dry = collect_layers(t.path(), true).unwrap();
        assert_eq!((dry.busy, dry.dirs, dry.images), (false, 2, 2));
        assert!(dry.bytes >= 1000 + 2 * 8192, "{dry:?}");
        assert!(layers.join(&hex).is_dir() && images.iter().all(|i| i.is_file()));
        assert!(package.is_dir());
        let done = collect_layers(t.path(), false).unwrap();
        assert_eq!(done, dry);
        assert!(!layers.join(&hex).exists() && !package.exists());
        assert!(images.iter().all(|i| !i.exists()), "{images:?}");
        assert!(layers.join("not-a-layer").is_dir());
        for dir in [VM_LOWER_IMAGES, VM_SQUASHED_IMAGES] {
            assert!(run.join(dir).join("notes.ext4").is_file());
        }
    }

    /// A work directory whose `layers/` names another boot (or none) loses every unpacked
    /// layer, squashed tree, image tree, package layer and disk image of them on its first
    /// open, and nothing else; in the boot that stamped it, an open removes nothing.
    #[test]
    fn the_first_open_after_a_reboot_drops_an_earlier_boots_layers() {
        let t = tempfile::tempdir().unwrap();
        let (layers, run, trees) = (
            t.path().join("layers"),
            t.path().join("run"),
            t.path().join("trees"),
        );
        let (a, b) = ("ab".repeat(32), "cd".repeat(32));
        let earlier_boot = |stamp: Option<&str>| {
            fs::create_dir_all(layers.join(&a).join("etc")).unwrap();
            fs::write(layers.join(&a).join("etc/f"), b"torn?").unwrap();
            fs::create_dir_all(trees.join(format!("image-{a}"))).unwrap();
            fs::create_dir_all(t.path().join(PACKAGE_LAYERS).join("ef".repeat(16))).unwrap();
            fs::create_dir_all(run.join(VM_LOWER_IMAGES)).unwrap();
            fs::write(
                run.join(VM_LOWER_IMAGES).join(format!("{a}.ext4")),
                [1; 4096],
            )
            .unwrap();
            match stamp {
                Some(s) => fs::write(layers.join(BOOT_STAMP), s).unwrap(),
                None => {
                    let _ = fs::remove_file(layers.join(BOOT_STAMP));
                }
            }
        };
        let kept = [
            layers.join("not-a-layer"),
            trees.join("image-short"),
            run.join(VM_LOWER_IMAGES).join("notes"),
            t.path().join(PACKAGE_LAYERS).join("ef"),
        ];
        for k in &kept {
            fs::create_dir_all(k).unwrap();
        }
        let now = boot_id().expect("this host's boot id");
        // A stamp of another boot, then none at all (a work directory of an older kiln).
        for stamp in [Some("00000000-0000-0000-0000-000000000000\n"), None] {
            earlier_boot(stamp);
            let check = LayersLock::shared_this_boot(&layers).unwrap();
            let d = check.dropped.expect("an earlier boot's layers are dropped");
            assert_eq!((d.dirs, d.images), (3, 1), "{d:?}");
            assert!(!layers.join(&a).exists());
            assert!(!t.path().join(PACKAGE_LAYERS).join("ef".repeat(16)).exists());
            assert!(!trees.join(format!("image-{a}")).exists());
            assert!(!run.join(VM_LOWER_IMAGES).join(format!("{a}.ext4")).exists());
            assert!(kept.iter().all(|k| k.is_dir()));
            let stamped = fs::read_to_string(layers.join(BOOT_STAMP)).unwrap();
            assert_eq!(stamped.trim(), now);
        }
        // In this boot, a layer made after the check stays through the next open, which
        // holds the lock shared: a second build of the boot opens beside it.
        fs::create_dir_all(layers.join(&b)).unwrap();
        let first = LayersLock::shared_this_boot(&layers).unwrap();
        let second = LayersLock::shared_this_boot(&layers).unwrap();
        assert!(first.dropped.is_none() && second.dropped.is_none());
        assert!(layers.join(&b).is_dir());
        assert!(collect_layers(t.path(), true).unwrap().busy);
    }
}
