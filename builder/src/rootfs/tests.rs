//! The walk against the kernel's `RESOLVE_IN_ROOT`: the same hostile trees, the same
//! answers.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::symlink;

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::open::walk_in_root;
use super::*;

/// What an open reached: the node's (device, inode), or the error.
fn reached(r: rustix::io::Result<OwnedFd>) -> Result<(u64, u64), Errno> {
    r.map(|fd| {
        let st = rustix::fs::fstat(&fd).unwrap();
        (st.st_dev, st.st_ino)
    })
}

/// A root holding escapes of every kind, beside a sentinel outside it.
fn hostile_root() -> (tempfile::TempDir, std::path::PathBuf) {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("outside"), b"host").unwrap();
    let root = d.path().join("root");
    for dir in ["etc", "a/b/c", "deep"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), b"root:x:0:0::/:/bin/sh\n").unwrap();
    std::fs::write(root.join("outside"), b"inside").unwrap();
    symlink("../../..", root.join("a/up")).unwrap();
    symlink("/", root.join("a/abs")).unwrap();
    symlink("/etc/passwd", root.join("a/pw")).unwrap();
    symlink("../outside", root.join("rel-out")).unwrap();
    symlink(d.path().join("outside"), root.join("host-abs")).unwrap();
    symlink("loop2", root.join("loop1")).unwrap();
    symlink("loop1", root.join("loop2")).unwrap();
    symlink("missing/x", root.join("dangling")).unwrap();
    symlink("/proc/self/root", root.join("magic")).unwrap();
    symlink("b/c/../../b", root.join("a/twisty")).unwrap();
    let mut deep = root.join("deep");
    for _ in 0..MAX_DEPTH + 2 {
        deep.push("d");
    }
    // Deeper than PATH_MAX lets one mkdir say: made a level at a time.
    let mut at = rustix::fs::open(root.join("deep"), OFlags::DIRECTORY, Mode::empty()).unwrap();
    for _ in 0..MAX_DEPTH + 2 {
        rustix::fs::mkdirat(&at, "d", Mode::from_raw_mode(0o755)).unwrap();
        at = rustix::fs::openat(&at, "d", OFlags::DIRECTORY, Mode::empty()).unwrap();
    }
    (d, root)
}

/// Every path, with and without `O_NOFOLLOW` and `O_PATH`, opens the same node (or fails
/// with the same error) through the walk as through `openat2(RESOLVE_IN_ROOT |
/// RESOLVE_NO_MAGICLINKS)`, and nothing outside the root is ever reached.
#[test]
fn the_walk_answers_as_resolve_in_root_does() {
    let (_d, root) = hostile_root();
    let root_fd =
        rustix::fs::open(&root, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    let outside = reached(rustix::fs::open(
        root.parent().unwrap().join("outside"),
        OFlags::RDONLY,
        Mode::empty(),
    ))
    .unwrap();
    let too_deep = format!("deep/{}", "d/".repeat(MAX_DEPTH + 1));
    let paths = [
        "",
        "/",
        ".",
        "..",
        "../../..",
        "/../outside",
        "outside",
        "etc/passwd",
        "/etc/passwd",
        "etc/../../../etc/passwd",
        "a/up",
        "a/up/outside",
        "a/up/etc/passwd",
        "a/abs/outside",
        "a/pw",
        "rel-out",
        "host-abs",
        "loop1",
        "loop1/x",
        "dangling",
        "magic",
        "magic/outside",
        "a/twisty/c",
        "etc/passwd/x",
        "missing",
        "missing/x",
        too_deep.as_str(),
    ];
    for path in paths {
        for flags in [
            OFlags::RDONLY,
            OFlags::RDONLY | OFlags::NOFOLLOW,
            OFlags::PATH,
            OFlags::PATH | OFlags::NOFOLLOW,
            OFlags::PATH | OFlags::DIRECTORY,
        ] {
            let p = if path.trim_matches('/').is_empty() {
                "."
            } else {
                path
            };
            let kernel = reached(rustix::fs::openat2(
                root_fd.as_fd(),
                p,
                flags | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
            ));
            let ours = reached(walk_in_root(&root_fd, path, flags));
            assert_ne!(
                ours,
                Ok(outside),
                "{path:?} {flags:?} reached the host file"
            );
            match (&kernel, &ours) {
                // The kernel bounds a path by its bytes (PATH_MAX) and the walk by the
                // directories it enters (MAX_DEPTH): this path passes the one, not the
                // other.
                _ if path == too_deep => assert_eq!(ours, Err(Errno::NAMETOOLONG), "{flags:?}"),
                _ => assert_eq!(ours, kernel, "{path:?} {flags:?}"),
            }
        }
    }
}

/// A trailing `/` (or `/.`) asks for a directory: the kernel refuses a non-directory there
/// (`ENOTDIR`) and follows a symlink there even under `O_NOFOLLOW` (it is not the last
/// component). The walk drops empty and `.` components, so it must answer the same.
#[test]
fn the_walk_answers_trailing_slashes_as_resolve_in_root_does() {
    let (_d, root) = hostile_root();
    symlink("etc/passwd/", root.join("pw-slash")).unwrap();
    let root_fd =
        rustix::fs::open(&root, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    let mut wrong = Vec::new();
    for path in [
        "etc/passwd/",
        "etc/passwd/.",
        "/etc/passwd//",
        "a/pw/",
        "a/abs/",
        "a/abs/.",
        "a/up/",
        "a/twisty/",
        "pw-slash",
        "dangling/",
        "missing/",
    ] {
        for flags in [
            OFlags::RDONLY,
            OFlags::RDONLY | OFlags::NOFOLLOW,
            OFlags::PATH,
            OFlags::PATH | OFlags::NOFOLLOW,
        ] {
            let kernel = reached(rustix::fs::openat2(
                root_fd.as_fd(),
                path,
                flags | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
            ));
            let ours = reached(walk_in_root(&root_fd, path, flags));
            if ours != kernel {
                wrong.push(format!(
                    "{path:?} {flags:?}: kernel {kernel:?}, walk {ours:?}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Symlink chains about the 40-hop limit, as the last component and on the way, with and
/// without `O_NOFOLLOW`: the walk gives up (or not) exactly where the kernel does.
#[test]
fn the_walk_counts_symlink_hops_as_resolve_in_root_does() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("root");
    std::fs::create_dir_all(root.join("dir")).unwrap();
    std::fs::write(root.join("dir/f"), b"f").unwrap();
    // c<n>_<i> -> c<n>_<i+1> -> ... -> c<n>_<n> -> dir: n links to reach `dir`.
    for n in [38usize, 39, 40, 41, 42] {
        for i in 1..=n {
            let target = if i == n {
                "dir".to_string()
            } else {
                format!("c{n}_{}", i + 1)
            };
            symlink(&target, root.join(format!("c{n}_{i}"))).unwrap();
        }
    }
    let root_fd =
        rustix::fs::open(&root, OFlags::DIRECTORY | OFlags::RDONLY, Mode::empty()).unwrap();
    let mut wrong = Vec::new();
    for n in [38usize, 39, 40, 41, 42] {
        for path in [
            format!("c{n}_1"),
            format!("c{n}_1/"),
            format!("c{n}_1/f"),
            format!("/c{n}_1/../c{n}_1/f"),
        ] {
            for flags in [
                OFlags::RDONLY,
                OFlags::RDONLY | OFlags::NOFOLLOW,
                OFlags::PATH,
            ] {
                let kernel = reached(rustix::fs::openat2(
                    root_fd.as_fd(),
                    path.as_str(),
                    flags | OFlags::CLOEXEC,
                    Mode::empty(),
                    ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
                ));
                let ours = reached(walk_in_root(&root_fd, &path, flags));
                if ours != kernel {
                    wrong.push(format!(
                        "{path:?} {flags:?}: kernel {kernel:?}, walk {ours:?}"
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
