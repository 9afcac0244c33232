//! The package download cache of `RUN` steps (issue 34): the directories apt, pip and npm
//! download into ([`PACKAGE_CACHES`]) never enter a step's layer, whoever builds; a trusted
//! build (the CLI, the nightly) also gets a host-wide cache mounted on them, a tenant's build
//! never does.
//!
//! **The layers are the same for every caller.** After every `RUN` step, under either
//! executor and whether a cache was mounted or not, [`drop_package_dirs`] removes those
//! directories from the step's upper directory (what the step wrote there, and the
//! whiteouts of what it deleted there), then the parents made or copied up only for them,
//! by the rule that removes mount points ([`super::cleanup`]). So a tenant's step that
//! downloads into `/var/cache/apt` leaves the same layer as a CLI step whose downloads went
//! into the host's cache, and no later step of either sees the downloads. This changed
//! layers once, for every caller alike ([`crate::build::key::KEY_VERSION`] 2).
//!
//! **The cache.** For a trusted build ([`crate::build::BuildOptions::package_cache`]), each
//! `RUN` step gets one `type=cache` mount per entry of [`PACKAGE_CACHES`] ([`package_mounts`]),
//! through the cache-mount mechanism of [`super`] (a directory under the namespace executor,
//! an ext4 disk under the microVM executor), with `sharing=private`: a second step that
//! wants a cache another step holds gets a fresh, empty one for itself instead of waiting
//! (apt locks its directory and would fail rather than wait). A mount of the recipe's own on
//! the same target, on a parent of it or under it wins: the package mount is left out.
//! A tenant's build gets no mount: its step sees the image's own files there, writes beside
//! them in its own upper directory, and all of it is dropped after the step.
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

use std::fs;
use std::path::{Path, PathBuf};

use super::{CacheMount, CacheSharing, MountKind, StepMount};

/// One package download directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackageCache {
    /// The cache's name: its directory under the host's package cache.
    pub name: &'static str,
    /// Where the tool downloads to, absolute, inside the step.
    pub target: &'static str,
}

/// The package download directories. Changing this list changes layers: bump
/// [`crate::build::key::KEY_VERSION`] with it.
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

/// The package cache mounts of one step: for each of [`PACKAGE_CACHES`] whose target none of
/// the step's own mounts `own` overlaps (the same target, a parent or a child of it), a
/// read-write `type=cache` mount of `<base>/<name>` with `sharing=private`, whose new
/// directory is root's with mode 0755.
pub fn package_mounts(base: &Path, own: &[StepMount]) -> Vec<StepMount> {
    PACKAGE_CACHES
        .iter()
        .filter(|p| !own.iter().any(|m| overlaps(&m.target, p.target)))
        .map(|p| StepMount {
            target: p.target.to_string(),
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

/// Removes the package download directories ([`PACKAGE_CACHES`], each resolved through the
/// step's `lowers` as its mount is) from the step's upper directory `upper` after the step:
/// the directory itself with everything under it, or whatever the step left in its place
/// (a whiteout, a file, a symlink), unless a parent of it in `upper` is not a real
/// directory; then the parents made or copied up only for it ([`super::cleanup`]'s rule).
/// Both executors' steps go through it, whoever builds (module doc).
///
/// Errors: removing an entry of `upper`.
pub fn drop_package_dirs(upper: &Path, lowers: &[PathBuf]) -> std::io::Result<()> {
    let mut rels = Vec::new();
    for p in &PACKAGE_CACHES {
        let rel = super::canonical(lowers, p.target).join("/");
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
    super::cleanup_rels(rels.iter().map(String::as_str), upper, lowers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_at(target: &str) -> StepMount {
        StepMount {
            target: target.into(),
            kind: MountKind::Tmpfs { size_bytes: None },
        }
    }

    #[test]
    fn a_mount_of_the_recipe_on_or_around_a_target_wins() {
        let all = |own: &[StepMount]| -> Vec<String> {
            package_mounts(Path::new("/c"), own)
                .into_iter()
                .map(|m| m.target)
                .collect()
        };
        assert_eq!(
            all(&[]),
            ["/var/cache/apt", "/root/.cache/pip", "/root/.npm"]
        );
        // The same target (as written differently), a parent, a child.
        assert_eq!(
            all(&[cache_at("/var/cache/apt/"), cache_at("/root/.cache")]),
            ["/root/.npm"]
        );
        assert_eq!(
            all(&[
                cache_at("/root/./.npm/_cacache"),
                cache_at("/var/cache/aptx")
            ]),
            ["/var/cache/apt", "/root/.cache/pip"]
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
    fn the_package_dirs_leave_the_upper_with_the_parents_made_for_them() {
        let d = tempfile::tempdir().unwrap();
        let (upper, low) = (d.path().join("upper"), d.path().join("low"));
        // The image has /var/cache/apt and /root; not /root/.cache.
        fs::create_dir_all(low.join("var/cache/apt/archives")).unwrap();
        fs::create_dir_all(low.join("root")).unwrap();
        // The step downloaded into all three, and wrote one file of its own beside them.
        fs::create_dir_all(upper.join("var/cache/apt/archives/partial")).unwrap();
        fs::write(upper.join("var/cache/apt/archives/a.deb"), "deb").unwrap();
        fs::write(upper.join("var/cache/apt/pkgcache.bin"), "bin").unwrap();
        fs::create_dir_all(upper.join("root/.cache/pip/http")).unwrap();
        fs::write(upper.join("root/.cache/pip/http/x"), "x").unwrap();
        fs::create_dir_all(upper.join("root/.npm/_cacache")).unwrap();
        fs::create_dir_all(upper.join("var/lib")).unwrap();
        fs::write(upper.join("var/lib/kept"), "kept").unwrap();
        drop_package_dirs(&upper, std::slice::from_ref(&low)).unwrap();
        let mut left: Vec<String> = walkdir(&upper);
        left.sort();
        assert_eq!(left, ["var", "var/lib", "var/lib/kept"]);
    }

    fn walkdir(root: &Path) -> Vec<String> {
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
