//! `RUN --mount=type=cache` in microVM steps ([`crate::vmexec`]): a cache is an ext4 disk
//! image on this host, attached read-write to one step VM at a time (serial `cache<i>`,
//! [`kiln_vmm::launch::VmSpec::rw_disks`]) and mounted by the guest on the target, never on
//! the host.
//!
//! **Where.** For the cache the namespace executor keeps in the directory `<base>/<hash>`
//! (`<base>`: the build's cache-mount directory, one per workspace for tenant builds
//! ([`crate::CacheMountScope::Workspace`]), `<hash>`: the first 16 bytes of the sha256 of
//! the cache id, in hex; [`kiln_builder::exec::mounts::resolve`]), the disk is
//! `<base>/vm/<hash>.ext4`, its lock `<hash>.lock` and its dirty marker `<hash>.dirty` beside
//! it; `<base>/vm` is root's, mode 0700. So a workspace's caches are its own, as its cache
//! directories are, and the two executors keep theirs apart. Caches are per host: nodes of a
//! scaled-out deployment do not share them (a build on another node starts with an empty
//! cache).
//!
//! **Made.** A missing disk is made sparse, of [`kiln_builder::exec::ExecConfig::cache_disk_bytes`]
//! (its most), with the tool and options of the step's other disks (`mke2fs -t ext4`, no
//! journal), its root directory given the mount's `uid`, `gid` and `mode` (`debugfs`), as
//! the namespace executor makes a new cache directory; under a temporary name, renamed once
//! made. An existing disk keeps its size. The disks of one cache base are bounded together
//! ([`kiln_builder::exec::ExecConfig::cache_disks_total_bytes`], allocated bytes): when a step
//! takes a cache, the least recently taken others that no step holds are removed until the
//! rest fit ([`evict`]).
//!
//! **Sharing.** `locked` takes an exclusive `flock(2)` on the lock file and holds it for the
//! step VM's whole life, so a second step waits (on a blocking-pool thread, never on an async
//! runtime's; a step cancelled or out of time while it waits stops waiting); `shared` is
//! treated as `locked` (one VM at a time can have an ext4 file system mounted read-write);
//! `private` tries the lock without waiting and, when another step holds it, gets a fresh
//! disk in the step's scratch directory, discarded with the step.
//!
//! **Crash safety.** The dirty marker is written before the VM starts and removed after a
//! clean end ([`CacheDisk::clean`]: the guest reported the command's exit, after it flushed
//! and unmounted the cache). A VM killed (the build's timeout, cancel, QEMU dying) leaves the
//! marker; the next step that takes the cache runs `e2fsck -p` on it first, and when that
//! cannot repair it (exit code 4 or more) the disk is thrown away and a fresh, empty one made:
//! a cache is only ever a cache, so no step runs on a disk e2fsck could not repair. Not
//! covered: a process the step leaves running that writes to the cache after the command's
//! exit (the guest has flushed and detached the mount by then).

use std::fs::File;
use std::path::{Path, PathBuf};

use kiln_builder::exec::ExecError;
use kiln_builder::exec::mounts::{CacheSharing, lock_cache};

/// The directory under a cache base that holds the microVM executor's cache disks.
pub const VM_CACHE_DIR: &str = "vm";

/// What [`ExecError::Timeout`] says of a step whose time ran out while it waited for a cache
/// (no VM started yet).
pub const STOPPED_WAITING: &str = "the step was still waiting for a cache another step holds";

/// What a cache disk is made with: the mount's options and the disk's size.
#[derive(Debug, Clone, Copy)]
pub struct CacheRoot {
    /// Permission bits of the root directory of a new disk.
    pub mode: u32,
    /// Owner of the root directory of a new disk.
    pub uid: u32,
    /// Group of the root directory of a new disk.
    pub gid: u32,
    /// Size of a new disk, bytes.
    pub bytes: u64,
    /// Most bytes the disks of this cache base take together (allocated blocks), bytes:
    /// past it, others are evicted ([`evict`]).
    pub total_bytes: u64,
}

/// One cache disk taken for one step VM: its image, and the lock held until it is dropped.
#[derive(Debug)]
pub struct CacheDisk {
    /// The image to attach read-write.
    pub image: PathBuf,
    /// The dirty marker (`None`: a temporary disk, discarded with the step's scratch).
    dirty: Option<PathBuf>,
    _lock: Option<File>,
}

/// The paths of the cache whose namespace directory is `dir`: image, lock, dirty marker.
fn paths(dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf), ExecError> {
    let (Some(base), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(ExecError::Setup(format!(
            "cache directory {} has no parent",
            dir.display()
        )));
    };
    let vm = base.join(VM_CACHE_DIR);
    let name = name.to_string_lossy();
    Ok((
        vm.join(format!("{name}.ext4")),
        vm.join(format!("{name}.lock")),
        vm.join(format!("{name}.dirty")),
    ))
}

impl CacheDisk {
    /// Takes the cache whose namespace directory is `dir` (module doc) with `sharing`:
    /// waits for it (`locked`, `shared`) or, for `private` when it is held, makes a fresh
    /// disk `<scratch>/<name>` instead. A disk left dirty is checked (and thrown away when it
    /// cannot be repaired); a missing one is made with `root`. `stop` is asked about every
    /// 50 ms while the lock is waited for: `Some(error)` (the step cancelled or out of time)
    /// ends the wait with that error (the waiting thread drops the lock once it gets it).
    ///
    /// Errors: `stop`'s; I/O on the cache's files, the lock, mke2fs or debugfs failing
    /// ([`ExecError::Io`], [`ExecError::Setup`]).
    pub async fn take(
        dir: &Path,
        sharing: CacheSharing,
        root: CacheRoot,
        scratch: &Path,
        name: &str,
        stop: &(dyn Fn() -> Option<ExecError> + Sync),
    ) -> Result<CacheDisk, ExecError> {
        let (image, lock_path, dirty) = paths(dir)?;
        let vm = image.parent().unwrap_or(Path::new("/"));
        make_guard(vm)?;
        let wait = match sharing {
            CacheSharing::Private => CacheSharing::Private,
            CacheSharing::Shared | CacheSharing::Locked => CacheSharing::Locked,
        };
        let mut waiting = tokio::task::spawn_blocking(move || lock_cache(&lock_path, wait));
        let lock = loop {
            tokio::select! {
                r = &mut waiting => break r.map_err(|e| {
                    ExecError::Setup(format!("waiting for a cache lock: {e}"))
                })??,
                _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {
                    if let Some(e) = stop() {
                        return Err(e);
                    }
                }
            }
        };
        let Some(lock) = lock else {
            // `private`, held by another step: a fresh disk of this step's own.
            let tmp = scratch.join(name);
            make_disk(&tmp, root).await?;
            return Ok(CacheDisk {
                image: tmp,
                dirty: None,
                _lock: None,
            });
        };
        if dirty.exists() && image.exists() && !repair(&image).await? {
            tracing::warn!(
                image = %image.display(),
                "a cache disk left dirty could not be repaired (e2fsck -p): thrown away"
            );
            std::fs::remove_file(&image).map_err(|source| ExecError::Io {
                what: format!("removing {}", image.display()),
                source,
            })?;
        }
        if !image.exists() {
            let tmp = image.with_extension(format!(
                "tmp-{}-{}",
                kiln_builder::workdir::owner_token(),
                std::process::id()
            ));
            crate::vmexec::rename_into_place(make_disk(&tmp, root).await, &tmp, &image)?;
        }
        // Its last use, for the eviction order of the others.
        if let Err(e) = lock.set_modified(std::time::SystemTime::now()) {
            tracing::warn!(error = %e, "marking a cache's use");
        }
        let (vm, keep, total) = (vm.to_path_buf(), image.clone(), root.total_bytes);
        tokio::task::spawn_blocking(move || evict(&vm, &keep, total))
            .await
            .map_err(|e| ExecError::Setup(format!("evicting caches: {e}")))??;
        Ok(CacheDisk {
            image,
            dirty: Some(dirty),
            _lock: Some(lock),
        })
    }

    /// Writes the dirty marker (before the VM starts).
    ///
    /// Errors: writing it ([`ExecError::Io`]).
    pub fn mark_dirty(&self) -> Result<(), ExecError> {
        if let Some(d) = &self.dirty {
            let f = File::create(d).map_err(|source| ExecError::Io {
                what: format!("writing {}", d.display()),
                source,
            })?;
            f.sync_all().map_err(|source| ExecError::Io {
                what: format!("syncing {}", d.display()),
                source,
            })?;
        }
        Ok(())
    }

    /// Removes the dirty marker: the VM ended cleanly (the guest flushed and unmounted the
    /// cache before it reported the command's exit).
    pub fn clean(&self) {
        if let Some(d) = &self.dirty
            && let Err(e) = std::fs::remove_file(d)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %d.display(), error = %e, "removing a cache's dirty marker");
        }
    }
}

/// Removes the least recently taken cache disks of the directory `vm` (by their lock file's
/// modification time, set when a step takes the cache) other than `keep`, each only when its
/// lock can be taken without waiting (no step holds it), with its dirty marker, until the
/// disks there take at most `total` bytes (allocated blocks, `st_blocks` × 512). Lock files
/// stay: a step waiting on one must find the same file. Returns how many were removed.
///
/// Errors: reading the directory, removing a disk ([`ExecError::Io`]).
pub fn evict(vm: &Path, keep: &Path, total: u64) -> Result<usize, ExecError> {
    use std::os::unix::fs::MetadataExt;
    let io = |what: String| move |source| ExecError::Io { what, source };
    let mut disks = Vec::new();
    let mut used = 0u64;
    for e in std::fs::read_dir(vm).map_err(io(format!("reading {}", vm.display())))? {
        let path = e.map_err(io(format!("reading {}", vm.display())))?.path();
        if path.extension().is_none_or(|x| x != "ext4") {
            continue;
        }
        let Ok(md) = path.symlink_metadata() else {
            continue;
        };
        used += md.blocks() * 512;
        if path != keep {
            let lock = path.with_extension("lock");
            let taken = lock.metadata().and_then(|m| m.modified()).ok();
            disks.push((taken, md.blocks() * 512, path, lock));
        }
    }
    disks.sort();
    let mut removed = 0;
    for (_, bytes, image, lock) in disks {
        if used <= total {
            break;
        }
        let Some(_held) = lock_cache(&lock, CacheSharing::Private)? else {
            continue;
        };
        std::fs::remove_file(&image).map_err(io(format!("removing {}", image.display())))?;
        let _ = std::fs::remove_file(image.with_extension("dirty"));
        used = used.saturating_sub(bytes);
        removed += 1;
        tracing::info!(image = %image.display(), bytes, "cache disk evicted (least recently used)");
    }
    Ok(removed)
}

/// `<base>/vm`: made when missing, root's and 0700 (checked on every use, never a symlink).
fn make_guard(vm: &Path) -> Result<(), ExecError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |what: &str| {
        let what = format!("{what} {}", vm.display());
        move |source| ExecError::Io { what, source }
    };
    std::fs::create_dir_all(vm).map_err(io("creating"))?;
    if !vm.symlink_metadata().map_err(io("reading"))?.is_dir() {
        return Err(ExecError::Setup(format!(
            "{} is not a directory",
            vm.display()
        )));
    }
    std::os::unix::fs::lchown(vm, Some(0), Some(0)).map_err(io("chown of"))?;
    std::fs::set_permissions(vm, std::fs::Permissions::from_mode(0o700)).map_err(io("chmod of"))
}

/// Makes the sparse cache disk `path` of `root.bytes` (at least 64 MiB) with an empty ext4
/// whose root directory has `root`'s mode, owner and group.
async fn make_disk(path: &Path, root: CacheRoot) -> Result<(), ExecError> {
    crate::vmexec::mke2fs(path, root.bytes.max(64 << 20), &[]).await?;
    let script = format!(
        "set_inode_field / mode 0{:o}\nset_inode_field / uid {}\nset_inode_field / gid {}\n",
        0o040000 | (root.mode & 0o7777),
        root.uid,
        root.gid
    );
    let mut child = tokio::process::Command::new("debugfs")
        .args(["-w", "-f", "-"])
        .arg(path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|source| ExecError::Io {
            what: "running debugfs (e2fsprogs)".into(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(|source| ExecError::Io {
                what: "writing to debugfs".into(),
                source,
            })?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|source| ExecError::Io {
            what: "running debugfs (e2fsprogs)".into(),
            source,
        })?;
    // debugfs exits 0 even when a command fails; its errors are the lines after its banner.
    let err = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = err
        .lines()
        .filter(|l| !l.starts_with("debugfs ") && !l.trim().is_empty())
        .collect();
    if !out.status.success() || !errors.is_empty() {
        return Err(ExecError::Setup(format!(
            "debugfs {} (the cache's root directory): {}",
            path.display(),
            errors.join("; ")
        )));
    }
    Ok(())
}

/// Runs `e2fsck -p` on the cache disk `image`: `true` when its file system is usable (exit
/// code below 4: clean, or repaired), `false` when e2fsck could not repair it.
///
/// Errors: e2fsck could not be run ([`ExecError::Io`]).
pub async fn repair(image: &Path) -> Result<bool, ExecError> {
    let out = tokio::process::Command::new("e2fsck")
        .arg("-p")
        .arg(image)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|source| ExecError::Io {
            what: "running e2fsck (e2fsprogs)".into(),
            source,
        })?;
    let code = out.status.code().unwrap_or(8);
    tracing::info!(
        image = %image.display(),
        code,
        output = %String::from_utf8_lossy(&out.stdout).trim(),
        "e2fsck -p of a cache disk left dirty"
    );
    Ok(code < 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `debugfs -R <request>` on `image`: its standard output.
    fn debugfs(image: &Path, request: &str) -> String {
        let out = std::process::Command::new("debugfs")
            .args(["-w", "-R", request])
            .arg(image)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Whether `e2fsck -fn` finds the file system of `image` clean.
    fn fsck_clean(image: &Path) -> bool {
        std::process::Command::new("e2fsck")
            .arg("-fn")
            .arg(image)
            .output()
            .unwrap()
            .status
            .success()
    }

    #[tokio::test]
    async fn dirty_disks_are_checked_and_thrown_away_when_beyond_repair() {
        assert!(rustix::process::geteuid().is_root(), "needs root (chown)");
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("base").join("0123abcd");
        let scratch = t.path().join("scratch");
        std::fs::create_dir(&scratch).unwrap();
        // 64 MiB, 4 KiB blocks: one block group, so no backup superblock.
        let root = CacheRoot {
            mode: 0o750,
            uid: 1,
            gid: 2,
            bytes: 64 << 20,
            total_bytes: 1 << 40,
        };
        let take =
            |sharing| CacheDisk::take(&dir, sharing, root, &scratch, "cache0.ext4", &|| None);

        // A new disk: sparse, its root directory with the mount's mode and owner.
        let c = take(CacheSharing::Locked).await.unwrap();
        let image = t.path().join("base/vm/0123abcd.ext4");
        assert_eq!(c.image, image);
        assert!(fsck_clean(&image));
        let stat = debugfs(&image, "stat /");
        assert!(stat.contains("Mode:  0750") && stat.contains("User:     1   Group:     2"));
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(&image).unwrap();
        assert_eq!(md.len(), 64 << 20);
        assert!(
            md.blocks() * 512 < 16 << 20,
            "sparse: {} blocks",
            md.blocks()
        );
        // `private` while it is held: a disk of the step's own, in its scratch.
        let p = take(CacheSharing::Private).await.unwrap();
        assert_eq!(p.image, scratch.join("cache0.ext4"));
        assert!(p.dirty.is_none() && fsck_clean(&p.image));
        drop(p);
        // `locked` while it is held: waits, until the step is stopped.
        let t0 = std::time::Instant::now();
        let stop = || {
            (t0.elapsed() > std::time::Duration::from_millis(300)).then_some(ExecError::Cancelled)
        };
        let waited = CacheDisk::take(&dir, CacheSharing::Locked, root, &scratch, "c", &stop).await;
        assert!(matches!(waited, Err(ExecError::Cancelled)), "{waited:?}");
        assert!(t0.elapsed() >= std::time::Duration::from_millis(300));

        // A VM that ended cleanly: no marker left.
        debugfs(&image, "mkdir kept");
        c.mark_dirty().unwrap();
        let dirty = t.path().join("base/vm/0123abcd.dirty");
        assert!(dirty.exists());
        c.clean();
        assert!(!dirty.exists());
        // A VM killed: the marker stays; the next take checks the disk, which is fine, and
        // keeps it.
        c.mark_dirty().unwrap();
        drop(c);
        let c = take(CacheSharing::Shared).await.unwrap();
        assert!(debugfs(&image, "ls /").contains("kept"));
        // Killed again, and the disk's superblock lost: beyond repair, so a fresh disk.
        c.mark_dirty().unwrap();
        drop(c);
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&image)
                .unwrap();
            f.write_all_at(&[0u8; 1024], 1024).unwrap();
        }
        assert!(!fsck_clean(&image));
        assert!(!repair(&image).await.unwrap());
        let c = take(CacheSharing::Locked).await.unwrap();
        assert!(fsck_clean(&image));
        assert!(!debugfs(&image, "ls /").contains("kept"));
        c.clean();
        assert!(!dirty.exists());
    }
    #[tokio::test]
    async fn least_recently_taken_free_disks_are_evicted_past_the_bound() {
        assert!(rustix::process::geteuid().is_root(), "needs root (chown)");
        let t = tempfile::tempdir().unwrap();
        let base = t.path().join("base");
        let root = |total_bytes| CacheRoot {
            mode: 0o755,
            uid: 0,
            gid: 0,
            bytes: 64 << 20,
            total_bytes,
        };
        let take = |id: &str, total| {
            let dir = base.join(id);
            let scratch = t.path().to_path_buf();
            async move {
                CacheDisk::take(
                    &dir,
                    CacheSharing::Locked,
                    root(total),
                    &scratch,
                    "x",
                    &|| None,
                )
                .await
                .unwrap()
            }
        };
        let vm = base.join(VM_CACHE_DIR);
        let a = take("a", 1 << 40).await;
        drop(a);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = take("b", 1 << 40).await;
        drop(b);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let c = take("c", 1 << 40).await;
        let exists = |id: &str| vm.join(format!("{id}.ext4")).exists();
        assert!(exists("a") && exists("b") && exists("c"));
        use std::os::unix::fs::MetadataExt;
        let one = std::fs::metadata(vm.join("a.ext4")).unwrap().blocks() * 512;
        // Room for three and a half: the least recently taken free one (a) goes, only.
        let _d = take("d", 3 * one + one / 2).await;
        assert!(!exists("a") && exists("b") && exists("c") && exists("d"));
        // Room for one: b goes; c is held by a step, d is the one being taken.
        assert_eq!(evict(&vm, &vm.join("d.ext4"), one).unwrap(), 1);
        assert!(!exists("b") && exists("c") && exists("d"));
        drop(c);
        // Lock files stay.
        assert!(vm.join("a.lock").exists() && vm.join("b.lock").exists());
    }
}
