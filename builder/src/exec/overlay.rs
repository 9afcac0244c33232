//! The one way kiln mounts overlayfs: a namespace step's root, a step's read-write bind
//! mounts, and a build's merged view of layers ([`crate::build::merged`]).
//!
//! With the new mount API and one `lowerdir+` per layer (Linux 6.8+,
//! `Documentation/filesystems/overlayfs.rst`), which takes no option string but is still
//! bounded by overlayfs' own limit on lower layers, `OVL_MAX_STACK` (500 in Linux 6.x, in
//! `fs/overlayfs/`; more fail with EINVAL, "too many lower directories"); else with
//! mount(2) and one option string of at most [`MAX_MOUNT_DATA`] bytes, which bounds the
//! number of layers by the length of their paths first, and cannot name a path holding
//! `:`, `,` or a newline (overlayfs' option syntax). In a user namespace (a rootless kiln)
//! both add `userxattr`: overlayfs then keeps its markers in `user.overlay.*`
//! ([`super::rootless::overlay_xattr_prefix`]).
//!
//! # Volatile overlays
//!
//! Every overlay kiln mounts today has a scratch upper directory: a step's upper (captured as
//! a layer after the step, or removed), a `rw` bind's upper (removed with the step's scratch
//! directory), the upper of a merged view ([`crate::build::merged`]: a `WORKDIR`, `COPY` or
//! `ADD` step's upper, captured the same way, or a throwaway one). If the host crashes
//! while one is mounted, the build dies with it and nothing reads that upper again as it
//! stood. The durable copy of what a step made is its layer blob, which the build cache
//! writes with its own syncs. So [`mount`] always mounts with overlayfs'
//! `volatile` option (Linux 5.10+, `Documentation/filesystems/overlayfs.rst`, "Volatile
//! mount"), with which `fsync`, `fdatasync`, `syncfs` and `sync` through the overlay skip the
//! upper file system. Measured on a cold `kiln build` of the peer's `apt` case
//! (`strace -w -f -c`): dpkg made 1,599 `fsync` calls, 1.14 s of wall time in the step,
//! none of which bought anything.
//!
//! overlayfs marks a work directory mounted volatile with `work/incompat/volatile` and
//! refuses to mount those directories again while the marker is there (the upper may have
//! lost writes in a crash). kiln never mounts one upper twice, but [`mount`] removes the
//! marker before a volatile mount all the same ([`clear_volatile_marker`]): its fallback to
//! mount(2) may follow a new-API attempt that got as far as creating the superblock, and
//! every upper kiln mounts is one whose content may be lost. An overlay whose upper must
//! survive a crash would need a mount without the option; no caller needs one.

use std::ffi::CString;
use std::path::Path;

use rustix::mount::{
    FsMountFlags, FsOpenFlags, MountAttrFlags, MountFlags, MoveMountFlags, fsconfig_create,
    fsconfig_set_flag, fsconfig_set_string, fsmount, fsopen, move_mount,
};

use super::rootless::in_user_namespace;

/// The most bytes of options mount(2) takes: it copies at most a page (4096 bytes on
/// x86-64); kept a little under it.
pub const MAX_MOUNT_DATA: usize = 4000;

/// Where overlayfs marks a work directory that was mounted volatile: `work/incompat/volatile`
/// under the work directory (`fs/overlayfs/`: `OVL_WORKDIR_NAME`, `"incompat"`,
/// `"volatile"`), a directory that holds a file `dirty` on Linux 6.18, seen here.
fn incompat_dir(work: &Path) -> std::path::PathBuf {
    work.join("work").join("incompat")
}

/// Removes overlayfs' marker of a volatile mount from `work`: its whole `incompat` directory,
/// which is overlayfs' own (a mount finding any entry in it fails, "overlay with incompat
/// feature ... cannot be mounted"), so that the directories can be mounted again. Missing is
/// fine.
pub fn clear_volatile_marker(work: &Path) -> Result<(), String> {
    let d = incompat_dir(work);
    match std::fs::remove_dir_all(&d) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("removing {}: {e}", d.display())),
    }
}

/// Mounts an overlay of `lowers` (topmost first; at least one), `upper` and `work` on
/// `target`, with the mount attributes `attrs` (`MOUNT_ATTR_NODEV`, `_NOSUID`, `_NOEXEC`)
/// and the `volatile` option (the module documentation, "Volatile overlays"; after removing
/// a marker an earlier mount of `work` left, [`clear_volatile_marker`]).
///
/// Errors: what failed, as text (the new API's error when mount(2) cannot take the
/// options either, with the number of layers).
pub fn mount(
    lowers: &[&Path],
    upper: &Path,
    work: &Path,
    target: &Path,
    attrs: MountAttrFlags,
) -> Result<(), String> {
    clear_volatile_marker(work)?;
    let new_api = || -> Result<(), String> {
        let fs =
            fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC).map_err(|e| format!("fsopen: {e}"))?;
        for l in lowers {
            fsconfig_set_string(&fs, "lowerdir+", *l)
                .map_err(|e| format!("overlay lowerdir+ {}: {e}", l.display()))?;
        }
        fsconfig_set_string(&fs, "upperdir", upper)
            .map_err(|e| format!("overlay upperdir: {e}"))?;
        fsconfig_set_string(&fs, "workdir", work).map_err(|e| format!("overlay workdir: {e}"))?;
        if in_user_namespace() {
            fsconfig_set_flag(&fs, "userxattr").map_err(|e| format!("overlay userxattr: {e}"))?;
        }
        fsconfig_set_flag(&fs, "volatile").map_err(|e| format!("overlay volatile: {e}"))?;
        fsconfig_create(&fs).map_err(|e| format!("creating the overlay: {e}"))?;
        let mnt = fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs)
            .map_err(|e| format!("fsmount: {e}"))?;
        move_mount(
            &mnt,
            "",
            rustix::fs::CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .map_err(|e| format!("move_mount: {e}"))
    };
    let Err(e) = new_api() else {
        return Ok(());
    };
    // The attempt may have made the superblock, and with it the marker.
    clear_volatile_marker(work)?;
    let Some(data) = options(lowers, upper, work, true) else {
        return Err(format!(
            "{} layers need the new mount API's lowerdir+ (Linux 6.8+): {e}",
            lowers.len()
        ));
    };
    let mut flags = MountFlags::empty();
    for (attr, flag) in [
        (MountAttrFlags::MOUNT_ATTR_NODEV, MountFlags::NODEV),
        (MountAttrFlags::MOUNT_ATTR_NOSUID, MountFlags::NOSUID),
        (MountAttrFlags::MOUNT_ATTR_NOEXEC, MountFlags::NOEXEC),
    ] {
        if attrs.contains(attr) {
            flags |= flag;
        }
    }
    rustix::mount::mount("overlay", target, "overlay", flags, Some(data.as_c_str()))
        .map_err(|e| format!("mounting overlay on {}: {e}", target.display()))
}

/// The name an xattr of an overlay's upper directory has for the file it is on, or `None`
/// for overlayfs' own markers (`<prefix>opaque`, `redirect`, `origin`, ...; the prefix is
/// [`super::rootless::overlay_xattr_prefix`]). An xattr of that namespace a process set
/// through the overlay is stored escaped, as `<prefix>overlay.X` (Linux 6.7+,
/// `Documentation/filesystems/overlayfs.rst`, "Nesting overlayfs mounts"), and is `<prefix>X`
/// again; any other xattr is its own name.
pub fn upper_xattr_name(name: &str) -> Option<String> {
    let prefix = super::rootless::overlay_xattr_prefix();
    match name.strip_prefix(prefix) {
        None => Some(name.to_string()),
        Some(rest) => rest
            .strip_prefix("overlay.")
            .map(|x| format!("{prefix}{x}")),
    }
}

/// The option string of mount(2) for these directories, if it can say them: no path holds
/// `:`, `,`, a newline or NUL, and the whole fits [`MAX_MOUNT_DATA`].
fn options(lowers: &[&Path], upper: &Path, work: &Path, volatile: bool) -> Option<CString> {
    let text = |p: &Path| {
        p.to_str()
            .filter(|s| !s.contains([':', ',', '\n', '\0']))
            .map(str::to_string)
    };
    let lowers: Vec<String> = lowers.iter().map(|l| text(l)).collect::<Option<_>>()?;
    let data = format!(
        "lowerdir={},upperdir={},workdir={}{}{}",
        lowers.join(":"),
        text(upper)?,
        text(work)?,
        if in_user_namespace() {
            ",userxattr"
        } else {
            ""
        },
        if volatile { ",volatile" } else { "" }
    );
    (data.len() <= MAX_MOUNT_DATA).then(|| CString::new(data).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_xattrs_of_an_upper_get_their_names_back_and_markers_go() {
        let p = super::super::rootless::overlay_xattr_prefix();
        assert_eq!(upper_xattr_name("user.kiln").as_deref(), Some("user.kiln"));
        assert_eq!(upper_xattr_name(&format!("{p}opaque")), None);
        assert_eq!(upper_xattr_name(&format!("{p}origin")), None);
        assert_eq!(
            upper_xattr_name(&format!("{p}overlay.opaque")),
            Some(format!("{p}opaque"))
        );
        assert_eq!(
            upper_xattr_name(&format!("{p}overlay.overlay.x")),
            Some(format!("{p}overlay.x"))
        );
    }

    #[test]
    fn options_say_only_what_mount2_can() {
        let p = Path::new;
        let o = options(&[p("/l/a"), p("/l/b")], p("/u"), p("/w"), false).expect("fits");
        let o = o.to_str().expect("utf-8");
        assert!(
            o.starts_with("lowerdir=/l/a:/l/b,upperdir=/u,workdir=/w"),
            "{o}"
        );
        assert!(!o.contains("volatile"), "{o}");
        let v = options(&[p("/l/a")], p("/u"), p("/w"), true).expect("fits");
        assert!(v.to_str().expect("utf-8").ends_with(",volatile"), "{v:?}");
        assert!(options(&[p("/a:b")], p("/u"), p("/w"), false).is_none());
        assert!(options(&[p("/a")], p("/u,lowerdir=/x"), p("/w"), false).is_none());
        let long = "/x".repeat(1100);
        assert!(options(&[p(&long), p(&long)], p("/u"), p("/w"), false).is_none());
    }
}
