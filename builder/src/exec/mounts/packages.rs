//! The package download cache of `RUN` steps (issue 34): the directories apt, pip and npm
//! download into ([`PACKAGE_CACHES`]) never enter a step's layer, whoever builds; a trusted
//! build (the CLI, the nightly) also gets a host-wide cache there, a tenant's build never
//! does.
//!
//! **What every step sees.** Each `RUN` step, whoever builds, gets one more lower layer on
//! top of its layers ([`package_layer`]): each download directory (`/var/cache/apt`, ...) is
//! a symlink to a directory of kiln's own, `/var/cache/kiln-packages/<name>` ([`PACKAGES_DIR`]),
//! with their parents as the image has them (owner, mode and times copied from the topmost
//! layer that has them). The symlink is what a recipe can remove: `rm -rf /root/.npm` or
//! `rm -rf /var/cache/apt` remove it (and nothing of the cache), where a mount there would
//! fail with "Device or resource busy". A download directory whose parent is not a real
//! directory of the image, or that a mount of the recipe's own is on, above or under, gets
//! no symlink.
//!
//! **The layers are the same for every caller.** After every `RUN` step, under either
//! executor and whether a cache was mounted or not, [`drop_package_dirs`] removes the
//! download directories and [`PACKAGES_DIR`] from the step's upper directory (what the step
//! wrote there, the whiteouts of what it deleted there), then the parents made or copied up
//! only for them, by the rule that removes mount points ([`super::cleanup`]). The package
//! layer itself is in no image. So a tenant's step that downloads into `/var/cache/apt`
//! leaves the same layer as a CLI step whose downloads went into the host's cache, and no
//! later step of either sees the downloads in its layers. This changed layers once, for
//! every caller alike ([`crate::build::key::KEY_VERSION`] 2).
//!
//! **The cache.** A trusted build ([`crate::build::BuildOptions::package_cache`]) mounts one
//! `type=cache` per entry of [`PACKAGE_CACHES`] on `/var/cache/kiln-packages/<name>`
//! ([`package_mounts`]), through the cache-mount mechanism of [`super`] (a directory under
//! the namespace executor, an ext4 disk under the microVM executor), with `sharing=private`:
//! a second step that wants a cache another step holds gets a fresh, empty one instead of
//! waiting (apt locks its directory and would fail rather than wait). A tenant's build
//! mounts nothing: its step writes into the package layer's empty directories, that is into
//! its own upper directory, and all of it is dropped after the step.
//!
//! **Trust.** apt checks every package against the hashes of its signed indexes before it
//! installs it, whatever directory it came from; pip checks hashes when the recipe asks for
//! them (`--require-hashes`), and npm checks every tarball against its lockfile's or the
//! registry's `integrity`. kiln changes none of that. What a host-wide cache adds is that
//! one build's steps can put files where another build's steps read them, which is why
//! tenants never get one: a tenant could leave a poisoned wheel or an HTTP response that
//! another tenant's pip would take.
//!
//! The paths are root's, the targets of BuildKit's documented cache mounts (`HOME` is
//! `/root` where most recipes install): a step as another user keeps its pip and npm caches
//! under its own home, in its layer, as before.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use super::{CacheMount, CacheSharing, MountKind, StepMount};

/// The directory of kiln's own that holds the package caches inside a step, one directory
/// per entry of [`PACKAGE_CACHES`] (`<PACKAGES_DIR>/<name>`): a mount point for a trusted
/// build's caches, a plain directory of the package layer otherwise.
pub const PACKAGES_DIR: &str = "/var/cache/kiln-packages";

/// One package download directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackageCache {
    /// The cache's name: its directory under [`PACKAGES_DIR`] and under the host's package
    /// cache.
    pub name: &'static str,
    /// Where the tool downloads to, absolute, inside the step: a symlink to
    /// [`PackageCache::dir`].
    pub target: &'static str,
}

impl PackageCache {
    /// Where the cache is inside the step, `<PACKAGES_DIR>/<name>`.
    pub fn dir(&self) -> String {
        format!("{PACKAGES_DIR}/{}", self.name)
    }
}

/// The package download directories. Changing this list (or [`PACKAGES_DIR`]) changes
/// layers: bump [`crate::build::key::KEY_VERSION`] with it.
///
/// - apt: `/var/cache/apt` (`Dir::Cache`): the downloaded packages (`archives/`) and the
///   binary caches apt makes from its lists (`pkgcache.bin`, `srcpkgcache.bin`; remade
///   when missing), as in BuildKit's documented `target=/var/cache/apt`.
/// - pip: `/root/.cache/pip`, pip's cache (HTTP responses, wheels it built) for `HOME=/root`.
/// - npm: `/root/.npm`, npm's cache (`_cacache`) and logs for `HOME=/root`.
pub const PACKAGE_CACHES: [PackageCache; 3] = [
    PackageCache {
        name: "apt",
        target: "/var/cache/apt",
    },
    PackageCache {
        name: "pip",
        target: "/root/.cache/pip",
    },
    PackageCache {
        name: "npm",
        target: "/root/.npm",
    },
];

/// The components of an absolute path, `.` and empty ones left out and `..` taken back
/// (textually: the mount's own resolution follows the layers' symlinks later).
fn components(path: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

/// Whether one of `a` and `b` is the other or under it.
fn overlaps(a: &str, b: &str) -> bool {
    let (a, b) = (components(a), components(b));
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

/// Whether a mount of `own` is on, above or under `p`'s download directory or its directory
/// under [`PACKAGES_DIR`].
fn taken(p: &PackageCache, own: &[StepMount]) -> bool {
    own.iter()
        .any(|m| overlaps(&m.target, p.target) || overlaps(&m.target, &p.dir()))
}

/// The package cache mounts of one step of a trusted build: for each of [`PACKAGE_CACHES`]
/// that no mount of the step's own `own` takes (on, above or under its download directory or
/// its directory under [`PACKAGES_DIR`]), a read-write `type=cache` mount of `<base>/<name>`
/// on `<PACKAGES_DIR>/<name>` with `sharing=private`, whose new directory is root's with
/// mode 0755.
pub fn package_mounts(base: &Path, own: &[StepMount]) -> Vec<StepMount> {
    PACKAGE_CACHES
        .iter()
        .filter(|p| !taken(p, own))
        .map(|p| StepMount {
            target: p.dir(),
            kind: MountKind::Cache(CacheMount {
                dir: base.join(p.name),
                sharing: CacheSharing::Private,
                readonly: false,
                mode: 0o755,
                uid: 0,
                gid: 0,
            }),
        })
        .collect()
}

/// One entry of the package layer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A directory: mode (permission bits), owner, group, modification time (seconds).
    Dir(u32, u32, u32, i64),
    /// A symlink to this target.
    Link(String),
}

/// A directory of the image as the step sees it, for the package layer: the owner, mode and
/// modification time of `rel` in the topmost of `lowers` that has it; root's, 0755 and time
/// 0 when none has it (or the topmost that has it holds a whiteout there); `None` when it
/// is something else than a directory there (a file, a symlink): no package directory under
/// it then.
fn image_dir(lowers: &[PathBuf], rel: &str) -> Option<Entry> {
    use std::os::unix::fs::FileTypeExt;
    for l in lowers {
        if !super::real_dirs_to(l, rel) {
            continue;
        }
        let Ok(md) = l.join(rel).symlink_metadata() else {
            continue;
        };
        if md.is_dir() {
            return Some(Entry::Dir(
                md.mode() & 0o7777,
                md.uid(),
                md.gid(),
                md.mtime(),
            ));
        }
        if md.file_type().is_char_device() && md.rdev() == 0 {
            break;
        }
        return None;
    }
    Some(Entry::Dir(0o755, 0, 0, 0))
}

/// What the package layer of a step over `lowers` (topmost first) holds, by path relative
/// to the root (module doc).
fn layer_entries(lowers: &[PathBuf], own: &[StepMount]) -> BTreeMap<String, Entry> {
    let mut out = BTreeMap::new();
    // Adds `comps`' parents (each as the image has it) when each is a directory there.
    let parents = |comps: &[&str], out: &mut BTreeMap<String, Entry>| -> bool {
        let mut add = Vec::new();
        for i in 1..comps.len() {
            let rel = comps[..i].join("/");
            match image_dir(lowers, &rel) {
                Some(e) => add.push((rel, e)),
                None => return false,
            }
        }
        out.extend(add);
        true
    };
    let kiln = components(PACKAGES_DIR);
    let mut kiln_ok = None;
    for p in PACKAGE_CACHES.iter().filter(|p| !taken(p, own)) {
        let ok = *kiln_ok.get_or_insert_with(|| {
            let mut whole = kiln.clone();
            whole.push("x");
            parents(&whole, &mut out)
        });
        if !ok {
            break;
        }
        let comps = components(p.target);
        // Only where the image's own path is the literal one (no symlinked parent), so the
        // symlink is where the tool looks and where the drop looks.
        if super::canonical(lowers, p.target) != comps || !parents(&comps, &mut out) {
            continue;
        }
        out.insert(
            format!("{}/{}", kiln.join("/"), p.name),
            Entry::Dir(0o755, 0, 0, 0),
        );
        out.insert(comps.join("/"), Entry::Link(p.dir()));
    }
    out
}

/// The package layer of a `RUN` step over `lowers` (its layers' directories, topmost first)
/// whose own mounts are `own` (module doc): a directory `<layers>/<hex>`, named by the
/// sha256 of what it holds (the first 16 bytes, in hex), made once (under a temporary name,
/// renamed) and never changed after, so that the microVM executor keeps one disk image of
/// it. To be put above `lowers`. `None`: nothing to put there (every download directory
/// taken by the recipe's mounts, or [`PACKAGES_DIR`]'s parents not directories).
///
/// Errors: making the directory, its entries, their owners, modes and times.
pub fn package_layer(
    layers: &Path,
    lowers: &[PathBuf],
    own: &[StepMount],
) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    let entries = layer_entries(lowers, own);
    if !entries.values().any(|e| matches!(e, Entry::Link(_))) {
        return Ok(None);
    }
    let mut h = Sha256::new();
    for (rel, e) in &entries {
        h.update(format!("{rel}\t{e:?}\n").as_bytes());
    }
    let dir = layers.join(hex::encode(&h.finalize()[..16]));
    if dir.is_dir() {
        return Ok(Some(dir));
    }
    fs::create_dir_all(layers)?;
    // Named after this process, so that a dead build's is reaped
    // ([`crate::workdir::reap_dead_builds`]).
    let tmp = crate::build::lower::temp_in(layers, "package");
    let made = (|| -> std::io::Result<()> {
        fs::create_dir(&tmp)?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))?;
        // Parents come first in the map's order; times last, deepest first.
        for (rel, e) in &entries {
            let path = tmp.join(rel);
            match e {
                Entry::Dir(mode, uid, gid, _) => {
                    fs::create_dir(&path)?;
                    std::os::unix::fs::lchown(&path, Some(*uid), Some(*gid))?;
                    fs::set_permissions(&path, fs::Permissions::from_mode(*mode))?;
                }
                Entry::Link(target) => {
                    std::os::unix::fs::symlink(target, &path)?;
                    std::os::unix::fs::lchown(&path, Some(0), Some(0))?;
                }
            }
        }
        for (rel, e) in entries.iter().rev() {
            let time = match e {
                Entry::Dir(.., t) => *t,
                Entry::Link(_) => 0,
            };
            crate::layer::write::set_times(&tmp.join(rel), time.max(0) as u64)?;
        }
        Ok(())
    })();
    let r = made.and_then(|()| match fs::rename(&tmp, &dir) {
        Ok(()) => Ok(()),
        // Another step made it first: the same content.
        Err(_) if dir.is_dir() => fs::remove_dir_all(&tmp),
        Err(e) => Err(e),
    });
    if r.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    r.map(|()| Some(dir))
}

/// Removes the package download directories ([`PACKAGE_CACHES`], each resolved through the
/// step's layers `lowers` as the image has them, without the package layer) and
/// [`PACKAGES_DIR`] from the step's upper directory `upper` after the step: each with
/// everything under it, or whatever the step left in its place (a whiteout, a file, a
/// symlink), unless a parent of it in `upper` is not a real directory; then the parents made
/// or copied up only for them ([`super::cleanup`]'s rule). Both executors' steps go through
/// it, whoever builds (module doc).
///
/// Errors: removing an entry of `upper`.
pub fn drop_package_dirs(upper: &Path, lowers: &[PathBuf]) -> std::io::Result<()> {
    let mut rels = Vec::new();
    for target in PACKAGE_CACHES
        .iter()
        .map(|p| p.target)
        .chain([PACKAGES_DIR])
    {
        let rel = super::canonical(lowers, target).join("/");
        if rel.is_empty() || !super::real_dirs_to(upper, &rel) {
            continue;
        }
        let path = upper.join(&rel);
        match path.symlink_metadata() {
            Ok(md) if md.is_dir() => fs::remove_dir_all(&path)?,
            Ok(_) => fs::remove_file(&path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        rels.push(rel);
    }
    // A parent the step removed and made again is opaque in `upper`. When it is empty now
    // and no layer has it (the package layer made it up), nothing is hidden by it: it goes,
    // as it would had the package layer not been there.
    let mut parents: Vec<String> = Vec::new();
    for rel in &rels {
        let comps: Vec<&str> = rel.split('/').collect();
        for i in 1..comps.len() {
            let p = comps[..i].join("/");
            if !parents.contains(&p) {
                parents.push(p);
            }
        }
    }
    parents.sort_by_key(|r| std::cmp::Reverse(r.matches('/').count()));
    for rel in &parents {
        let path = upper.join(rel);
        let mut opaque = [0u8; 8];
        if super::real_dirs_to(upper, rel)
            && path.symlink_metadata().is_ok_and(|m| m.is_dir())
            && rustix::fs::lgetxattr(
                &path,
                crate::exec::rootless::overlay_opaque_xattr(),
                &mut opaque,
            )
            .is_ok()
            && fs::read_dir(&path).is_ok_and(|mut d| d.next().is_none())
            && !lowers
                .iter()
                .any(|l| super::real_dirs_to(l, rel) && l.join(rel).symlink_metadata().is_ok())
        {
            fs::remove_dir(&path)?;
        }
    }
    super::cleanup_rels(rels.iter().map(String::as_str), upper, lowers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn tmpfs_at(target: &str) -> StepMount {
        StepMount {
            target: target.into(),
            kind: MountKind::Tmpfs { size_bytes: None },
        }
    }

    #[test]
    fn a_mount_of_the_recipe_on_or_around_a_package_dir_wins() {
        let all = |own: &[StepMount]| -> Vec<String> {
            package_mounts(Path::new("/c"), own)
                .into_iter()
                .map(|m| m.target)
                .collect()
        };
        assert_eq!(
            all(&[]),
            [
                "/var/cache/kiln-packages/apt",
                "/var/cache/kiln-packages/pip",
                "/var/cache/kiln-packages/npm"
            ]
        );
        // The same target (as written differently), a parent, a child, kiln's directory.
        assert_eq!(
            all(&[tmpfs_at("/var/cache/apt/"), tmpfs_at("/root/.cache")]),
            ["/var/cache/kiln-packages/npm"]
        );
        assert_eq!(
            all(&[
                tmpfs_at("/root/./.npm/_cacache"),
                tmpfs_at("/var/cache/aptx"),
                tmpfs_at("/var/cache/kiln-packages/pip/x"),
            ]),
            ["/var/cache/kiln-packages/apt"]
        );
        let m = &package_mounts(Path::new("/c"), &[])[0];
        assert_eq!(
            m.kind,
            MountKind::Cache(CacheMount {
                dir: "/c/apt".into(),
                sharing: CacheSharing::Private,
                readonly: false,
                mode: 0o755,
                uid: 0,
                gid: 0,
            })
        );
    }

    #[test]
    fn the_package_layer_links_each_dir_under_the_images_parents() {
        let d = tempfile::tempdir().unwrap();
        let (top, low, layers) = (
            d.path().join("top"),
            d.path().join("low"),
            d.path().join("l"),
        );
        // The image: /root 0700 (in the top layer, over the low one's), /var/cache, no apt.
        fs::create_dir_all(low.join("root")).unwrap();
        fs::create_dir_all(low.join("var/cache")).unwrap();
        fs::create_dir_all(top.join("root")).unwrap();
        fs::set_permissions(top.join("root"), fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::lchown(top.join("root"), Some(7), Some(8)).unwrap();
        let lowers = [top.clone(), low.clone()];
        let l = package_layer(&layers, &lowers, &[])
            .unwrap()
            .expect("a layer");
        let md = |p: &str| l.join(p).symlink_metadata().unwrap();
        assert_eq!(md("root").mode() & 0o7777, 0o700);
        assert_eq!((md("root").uid(), md("root").gid()), (7, 8));
        assert_eq!(
            fs::read_link(l.join("root/.npm")).unwrap(),
            Path::new("/var/cache/kiln-packages/npm")
        );
        assert_eq!(
            fs::read_link(l.join("var/cache/apt")).unwrap(),
            Path::new("/var/cache/kiln-packages/apt")
        );
        assert!(md("root/.cache").is_dir() && md("var/cache/kiln-packages/pip").is_dir());
        // Made once: the same lowers give the same directory.
        assert_eq!(
            package_layer(&layers, &lowers, &[]).unwrap(),
            Some(l.clone())
        );
        // A recipe's own mount on /root/.npm: no npm link there, another layer.
        let other = package_layer(&layers, &lowers, &[tmpfs_at("/root/.npm")])
            .unwrap()
            .expect("a layer");
        assert_ne!(other, l);
        assert!(other.join("root/.npm").symlink_metadata().is_err());
        // /root a file in the image: no pip or npm link.
        fs::remove_dir(top.join("root")).unwrap();
        fs::write(top.join("root"), "").unwrap();
        let f = package_layer(&layers, &lowers, &[])
            .unwrap()
            .expect("a layer");
        assert!(f.join("root").symlink_metadata().is_err());
        assert!(f.join("var/cache/apt").symlink_metadata().is_ok());
    }

    #[test]
    fn the_package_dirs_leave_the_upper_with_the_parents_made_for_them() {
        let d = tempfile::tempdir().unwrap();
        let (upper, low) = (d.path().join("upper"), d.path().join("low"));
        // The image has /var/cache/apt and /root; not /root/.cache.
        fs::create_dir_all(low.join("var/cache/apt/archives")).unwrap();
        fs::create_dir_all(low.join("root")).unwrap();
        // The step downloaded into all three (the first through kiln's directory, as
        // through the package layer's link), removed /root/.npm's link and made it a
        // directory, and wrote one file of its own beside them.
        fs::create_dir_all(upper.join("var/cache/kiln-packages/apt/archives/partial")).unwrap();
        fs::write(
            upper.join("var/cache/kiln-packages/apt/archives/a.deb"),
            "deb",
        )
        .unwrap();
        fs::create_dir_all(upper.join("var/cache/apt")).unwrap();
        fs::write(upper.join("var/cache/apt/pkgcache.bin"), "bin").unwrap();
        fs::create_dir_all(upper.join("root/.cache/pip/http")).unwrap();
        fs::write(upper.join("root/.cache/pip/http/x"), "x").unwrap();
        fs::create_dir_all(upper.join("root/.npm/_cacache")).unwrap();
        fs::create_dir_all(upper.join("var/lib")).unwrap();
        fs::write(upper.join("var/lib/kept"), "kept").unwrap();
        drop_package_dirs(&upper, std::slice::from_ref(&low)).unwrap();
        let mut left = kiln_listing(&upper);
        left.sort();
        assert_eq!(left, ["var", "var/lib", "var/lib/kept"]);
    }

    fn kiln_listing(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
                if p.symlink_metadata().unwrap().is_dir() {
                    stack.push(p);
                }
            }
        }
        out
    }
}
