//! COPY/ADD on plain directories (root needed for owners, as CI runs the suite).

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::Path;

use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{CopySource, CopyStep, InlineFile, SourceLocation};

use super::fetch::{FetchError, FetchOptions, fetch_urls};
use super::*;

fn step(sources: &[&str], dest: &str) -> CopyStep {
    CopyStep {
        sources: sources
            .iter()
            .map(|p| {
                if p.starts_with("http://") {
                    CopySource::Url { url: p.to_string() }
                } else {
                    CopySource::Path {
                        path: p.to_string(),
                    }
                }
            })
            .collect(),
        dest: dest.into(),
        from: None,
        chown: None,
        chmod: None,
        link: false,
        parents: false,
        exclude: vec![],
        checksum: None,
        unpack: false,
        keep_git_dir: false,
    }
}

struct Dirs {
    _t: tempfile::TempDir,
    ctx: std::path::PathBuf,
    dest: std::path::PathBuf,
    outside: std::path::PathBuf,
}

fn dirs() -> Dirs {
    assert!(
        rustix::process::geteuid().is_root(),
        "the copy tests need root (owners); CI runs them as root"
    );
    let t = tempfile::tempdir().unwrap();
    let ctx = t.path().join("ctx");
    let dest = t.path().join("dest");
    let outside = t.path().join("outside");
    for d in [&ctx, &dest, &outside] {
        fs::create_dir(d).unwrap();
    }
    fs::create_dir_all(ctx.join("src/sub")).unwrap();
    fs::write(ctx.join("a.txt"), "A").unwrap();
    fs::write(ctx.join("b.txt"), "B").unwrap();
    fs::write(ctx.join("src/main.c"), "int main;").unwrap();
    fs::write(ctx.join("src/sub/x.h"), "x").unwrap();
    fs::write(outside.join("secret"), "host secret").unwrap();
    fs::create_dir(dest.join("etc")).unwrap();
    fs::write(
        dest.join("etc/passwd"),
        "root:x:0:0::/root:/bin/sh\nalice:x:1000:1001::/home/alice:/bin/sh\n",
    )
    .unwrap();
    fs::write(
        dest.join("etc/group"),
        "root:x:0:\nstaff:x:50:\nalice:x:1001:\n",
    )
    .unwrap();
    Dirs {
        _t: t,
        ctx,
        dest,
        outside,
    }
}

fn ctx_src(d: &Dirs) -> Sources {
    Sources::context(&d.ctx, Dockerignore::default())
}

fn copy(s: &CopyStep, src: &Sources, dest: &Path) -> Result<CopyReport, CopyError> {
    copy_into(s, src, dest, &CopyOptions::default())
}

#[test]
fn files_dirs_rename_and_trailing_slash() {
    let d = dirs();
    let src = ctx_src(&d);
    copy(&step(&["a.txt"], "/renamed"), &src, &d.dest).unwrap();
    assert_eq!(fs::read_to_string(d.dest.join("renamed")).unwrap(), "A");
    copy(&step(&["a.txt"], "/into/"), &src, &d.dest).unwrap();
    assert_eq!(fs::read_to_string(d.dest.join("into/a.txt")).unwrap(), "A");
    // A directory copies its contents.
    let r = copy(&step(&["src"], "/app"), &src, &d.dest).unwrap();
    assert_eq!(
        fs::read_to_string(d.dest.join("app/main.c")).unwrap(),
        "int main;"
    );
    assert_eq!(fs::read_to_string(d.dest.join("app/sub/x.h")).unwrap(), "x");
    assert!(!d.dest.join("app/src").exists());
    assert_eq!(r.files, 2);
    // An existing directory receives a file under its own name.
    copy(&step(&["b.txt"], "/app"), &src, &d.dest).unwrap();
    assert_eq!(fs::read_to_string(d.dest.join("app/b.txt")).unwrap(), "B");
    // Several sources need a directory.
    let e = copy(&step(&["a.txt", "b.txt"], "/single"), &src, &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::NeedsDirectory { .. }), "{e}");
    copy(&step(&["*.txt"], "/globbed/"), &src, &d.dest).unwrap();
    assert!(d.dest.join("globbed/a.txt").exists() && d.dest.join("globbed/b.txt").exists());
    // Context files become root's; parents made 0755.
    let md = fs::metadata(d.dest.join("globbed/a.txt")).unwrap();
    assert_eq!((md.uid(), md.gid()), (0, 0));
    assert_eq!(
        fs::metadata(d.dest.join("globbed")).unwrap().mode() & 0o7777,
        0o755
    );
    let e = copy(&step(&["nope*"], "/x/"), &src, &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::NotFound { .. }), "{e}");
    let e = copy(&step(&["missing"], "/x/"), &src, &d.dest).unwrap_err();
    assert!(e.to_string().contains("\"missing\" not found"), "{e}");
}

#[test]
fn errors_carry_the_step_location() {
    let d = dirs();
    let opts = CopyOptions {
        location: Some(SourceLocation {
            file: "Dockerfile".into(),
            start_line: 7,
            end_line: 7,
        }),
        ..CopyOptions::default()
    };
    let e = copy_into(&step(&["gone.txt"], "/x"), &ctx_src(&d), &d.dest, &opts).unwrap_err();
    assert_eq!(e.to_string(), "Dockerfile:7: source \"gone.txt\" not found");
}

#[test]
fn dockerignore_applies_to_names_and_symlink_targets() {
    let d = dirs();
    fs::write(d.ctx.join("secret.env"), "TOKEN").unwrap();
    symlink("secret.env", d.ctx.join("innocent")).unwrap();
    let ig = Dockerignore::parse(".dockerignore", b"secret.env\nsrc/sub\n").unwrap();
    let src = Sources::context(&d.ctx, ig);
    copy(&step(&["."], "/all/"), &src, &d.dest).unwrap();
    assert!(d.dest.join("all/a.txt").exists());
    assert!(!d.dest.join("all/secret.env").exists());
    assert!(!d.dest.join("all/src/sub").exists());
    assert!(d.dest.join("all/src/main.c").exists());
    let e = copy(&step(&["secret.env"], "/x"), &src, &d.dest).unwrap_err();
    assert!(
        matches!(e, CopyError::NotFound { ignored: true, .. }),
        "{e}"
    );
    let e = copy(&step(&["innocent"], "/x"), &src, &d.dest).unwrap_err();
    assert!(
        matches!(e, CopyError::NotFound { ignored: true, .. }),
        "{e}"
    );
    assert!(!d.dest.join("x").exists());
    // Exceptions reach into an excluded directory.
    let ig = Dockerignore::parse(".dockerignore", b"src\n!src/sub/x.h\n").unwrap();
    let src = Sources::context(&d.ctx, ig);
    copy(&step(&["."], "/exc/"), &src, &d.dest).unwrap();
    assert!(d.dest.join("exc/src/sub/x.h").exists());
    assert!(!d.dest.join("exc/src/main.c").exists());
}

#[test]
fn sources_cannot_climb_out() {
    let d = dirs();
    let src = ctx_src(&d);
    for bad in ["../outside/secret", "src/../../outside/secret", ".."] {
        let e = copy(&step(&[bad], "/x"), &src, &d.dest).unwrap_err();
        assert!(matches!(e, CopyError::Escapes { .. }), "{bad}: {e}");
    }
    // Symlinks in the context resolve inside it: absolute ones and climbing ones alike.
    symlink(&d.outside, d.ctx.join("abs")).unwrap();
    symlink("../outside", d.ctx.join("rel")).unwrap();
    symlink("../../../../../../..", d.ctx.join("up")).unwrap();
    let outside_name = d.outside.file_name().unwrap().to_str().unwrap().to_string();
    for s in [
        "abs/secret".to_string(),
        "rel/secret".to_string(),
        format!("up/{outside_name}/secret"),
    ] {
        let e = copy(&step(&[&s], "/x"), &src, &d.dest).unwrap_err();
        assert!(matches!(e, CopyError::NotFound { .. }), "{s}: {e}");
    }
    // A symlink to a real file inside the context is followed when named as a source.
    symlink("/a.txt", d.ctx.join("abs-in")).unwrap();
    copy(&step(&["abs-in"], "/followed"), &src, &d.dest).unwrap();
    assert_eq!(fs::read_to_string(d.dest.join("followed")).unwrap(), "A");
    // Inside a copied directory, symlinks are copied as they are, never followed.
    symlink(&d.outside, d.ctx.join("src/escape")).unwrap();
    copy(&step(&["src"], "/tree"), &src, &d.dest).unwrap();
    let l = d.dest.join("tree/escape");
    assert!(l.symlink_metadata().unwrap().file_type().is_symlink());
    assert_eq!(fs::read_link(&l).unwrap(), d.outside);
}

#[test]
fn destination_symlinks_stay_inside_the_root() {
    let d = dirs();
    let src = ctx_src(&d);
    symlink(&d.outside, d.dest.join("abs")).unwrap();
    symlink("../../../../../../../../..", d.dest.join("up")).unwrap();
    copy(&step(&["a.txt"], "/abs/"), &src, &d.dest).unwrap();
    copy(&step(&["b.txt"], "/up/tmp/x/"), &src, &d.dest).unwrap();
    // Nothing reached the real outside directory.
    let listed: Vec<_> = fs::read_dir(&d.outside).unwrap().flatten().collect();
    assert_eq!(listed.len(), 1, "only the original secret");
    let inner = d.dest.join(d.outside.strip_prefix("/").unwrap());
    assert_eq!(fs::read_to_string(inner.join("a.txt")).unwrap(), "A");
    assert_eq!(fs::read_to_string(d.dest.join("tmp/x/b.txt")).unwrap(), "B");
    // A file written over a symlink replaces the symlink, not its target.
    symlink(d.outside.join("secret"), d.dest.join("victim")).unwrap();
    copy(&step(&["a.txt"], "/victim"), &src, &d.dest).unwrap();
    assert_eq!(
        fs::read_to_string(d.outside.join("secret")).unwrap(),
        "host secret"
    );
    assert!(d.dest.join("victim").symlink_metadata().unwrap().is_file());
    // A directory source merges through an image symlink such as /lib -> usr/lib.
    fs::create_dir_all(d.dest.join("usr/lib")).unwrap();
    symlink("usr/lib", d.dest.join("lib")).unwrap();
    fs::create_dir_all(d.ctx.join("root/lib")).unwrap();
    fs::write(d.ctx.join("root/lib/libx.so"), "so").unwrap();
    copy(&step(&["root"], "/"), &src, &d.dest).unwrap();
    assert_eq!(
        fs::read_to_string(d.dest.join("usr/lib/libx.so")).unwrap(),
        "so"
    );
    assert!(
        d.dest
            .join("lib")
            .symlink_metadata()
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

#[test]
fn chown_names_resolve_in_the_destination() {
    let d = dirs();
    let src = ctx_src(&d);
    let mut s = step(&["src"], "/owned/deep/");
    s.chown = Some("alice".into());
    copy(&s, &src, &d.dest).unwrap();
    let md = fs::metadata(d.dest.join("owned/deep/main.c")).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 1001));
    // Created parents belong to the --chown owner too.
    let md = fs::metadata(d.dest.join("owned")).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 1001));
    s.chown = Some("alice:staff".into());
    copy(&s, &src, &d.dest).unwrap();
    assert_eq!(
        fs::metadata(d.dest.join("owned/deep/main.c"))
            .unwrap()
            .gid(),
        50
    );
    s.chown = Some("4242".into());
    copy(&s, &src, &d.dest).unwrap();
    let md = fs::metadata(d.dest.join("owned/deep/main.c")).unwrap();
    assert_eq!((md.uid(), md.gid()), (4242, 4242));
    s.chown = Some("mallory".into());
    let e = copy(&s, &src, &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::Chown { .. }), "{e}");
    // /etc/passwd as an absolute symlink is the root's file, never the host's.
    fs::write(d.dest.join("etc/realpw"), "bob:x:7:7::/:/bin/sh\n").unwrap();
    fs::remove_file(d.dest.join("etc/passwd")).unwrap();
    symlink("/etc/realpw", d.dest.join("etc/passwd")).unwrap();
    s.chown = Some("bob".into());
    copy(&s, &src, &d.dest).unwrap();
    assert_eq!(
        fs::metadata(d.dest.join("owned/deep/main.c"))
            .unwrap()
            .uid(),
        7
    );
    s.chown = Some("root".into());
    assert!(
        copy(&s, &src, &d.dest).is_err(),
        "root is only in the host's file"
    );
}

#[test]
fn chmod_octal_and_symbolic() {
    let d = dirs();
    let src = ctx_src(&d);
    fs::set_permissions(d.ctx.join("a.txt"), fs::Permissions::from_mode(0o640)).unwrap();
    let mut s = step(&["a.txt"], "/m1");
    s.chmod = Some("0755".into());
    copy(&s, &src, &d.dest).unwrap();
    assert_eq!(
        fs::metadata(d.dest.join("m1")).unwrap().mode() & 0o7777,
        0o755
    );
    s.chmod = Some("u+x,o=r".into());
    s.dest = "/m2".into();
    copy(&s, &src, &d.dest).unwrap();
    assert_eq!(
        fs::metadata(d.dest.join("m2")).unwrap().mode() & 0o7777,
        0o744
    );
    let mut s = step(&["src"], "/m3");
    s.chmod = Some("a=rX".into());
    copy(&s, &src, &d.dest).unwrap();
    assert_eq!(
        fs::metadata(d.dest.join("m3/sub")).unwrap().mode() & 0o7777,
        0o555
    );
    assert_eq!(
        fs::metadata(d.dest.join("m3/main.c")).unwrap().mode() & 0o7777,
        0o444
    );
    s.chmod = Some("u+q".into());
    assert!(matches!(
        copy(&s, &src, &d.dest).unwrap_err(),
        CopyError::Chmod { .. }
    ));
}

#[test]
fn parents_and_exclude() {
    let d = dirs();
    let src = ctx_src(&d);
    let mut s = step(&["src/sub/x.h", "a.txt"], "/p/");
    s.parents = true;
    copy(&s, &src, &d.dest).unwrap();
    assert!(d.dest.join("p/src/sub/x.h").exists());
    assert!(d.dest.join("p/a.txt").exists());
    let mut s = step(&["src/./sub/x.h"], "/q/");
    s.parents = true;
    copy(&s, &src, &d.dest).unwrap();
    assert!(d.dest.join("q/sub/x.h").exists());
    let mut s = step(&["."], "/e/");
    s.exclude = vec!["*.txt".into(), "src/sub".into()];
    copy(&s, &src, &d.dest).unwrap();
    assert!(!d.dest.join("e/a.txt").exists());
    assert!(!d.dest.join("e/src/sub").exists());
    assert!(d.dest.join("e/src/main.c").exists());
    let mut s = step(&["*.txt"], "/f/");
    s.exclude = vec!["b.txt".into()];
    copy(&s, &src, &d.dest).unwrap();
    assert!(d.dest.join("f/a.txt").exists() && !d.dest.join("f/b.txt").exists());
}

#[test]
fn trees_keep_owners_and_specials_are_not_opened() {
    let d = dirs();
    let tree = d.outside.join("tree");
    fs::create_dir_all(tree.join("opt")).unwrap();
    fs::write(tree.join("opt/tool"), "bin").unwrap();
    std::os::unix::fs::chown(tree.join("opt/tool"), Some(123), Some(456)).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        tree.join("opt/fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let r = copy(&step(&["/opt"], "/opt"), &Sources::tree(&tree), &d.dest).unwrap();
    let md = fs::metadata(d.dest.join("opt/tool")).unwrap();
    assert_eq!((md.uid(), md.gid()), (123, 456));
    let ft = fs::symlink_metadata(d.dest.join("opt/fifo"))
        .unwrap()
        .file_type();
    use std::os::unix::fs::FileTypeExt;
    assert!(ft.is_fifo());
    assert_eq!(r.specials, 1);
    // A FIFO named as a source is not read (it would block), and is copied as a FIFO.
    copy(&step(&["/opt/fifo"], "/f2"), &Sources::tree(&tree), &d.dest).unwrap();
    assert!(
        fs::symlink_metadata(d.dest.join("f2"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
}

#[test]
fn limits_are_enforced() {
    let d = dirs();
    fs::write(d.ctx.join("big"), vec![7u8; 10_000]).unwrap();
    let opts = CopyOptions {
        limits: CopyLimits {
            max_file_bytes: 4096,
            ..CopyLimits::default()
        },
        ..CopyOptions::default()
    };
    let e = copy_into(&step(&["big"], "/big"), &ctx_src(&d), &d.dest, &opts).unwrap_err();
    assert!(matches!(e, CopyError::Limit { .. }), "{e}");
    let opts = CopyOptions {
        limits: CopyLimits {
            max_entries: 3,
            ..CopyLimits::default()
        },
        ..CopyOptions::default()
    };
    let e = copy_into(&step(&["."], "/all/"), &ctx_src(&d), &d.dest, &opts).unwrap_err();
    assert!(matches!(e, CopyError::Limit { .. }), "{e}");
}

fn tar_gz(entries: &[(&str, &[u8])], symlinks: &[(&str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        // Names are set raw so hostile ones ("../x") get through the builder.
        let raw = &mut h.as_old_mut().name;
        raw[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    for (name, target) in symlinks {
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_link_name(target).unwrap();
        h.set_mode(0o777);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        let raw = &mut h.as_old_mut().name;
        raw[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, &[][..]).unwrap();
    }
    let tar = b.into_inner().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &tar).unwrap();
    gz.finish().unwrap()
}

/// Issue 17, item 7: an xz or bzip2 tar in `ADD` is extracted, as Docker extracts it, through
/// the same layer applier (and its bounds) as a gzip one; one that is not a tar is copied.
#[test]
fn add_extracts_xz_and_bzip2_archives_as_docker_does() {
    use std::io::Write as _;
    let d = dirs();
    let gz = tar_gz(&[("bin/tool", b"T"), ("README", b"R")], &[]);
    let mut tar = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut tar).unwrap();
    let mut xz = liblzma::write::XzEncoder::new(Vec::new(), 6);
    xz.write_all(&tar).unwrap();
    let xz = xz.finish().unwrap();
    let mut bz = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::default());
    bz.write_all(&tar).unwrap();
    let bz = bz.finish().unwrap();
    assert_eq!(
        crate::layer::Compression::sniff(&xz),
        crate::layer::Compression::Xz
    );
    assert_eq!(
        crate::layer::Compression::sniff(&bz),
        crate::layer::Compression::Bzip2
    );
    for (name, bytes) in [("app.tar.xz", &xz), ("app.tar.bz2", &bz)] {
        fs::write(d.ctx.join(name), bytes).unwrap();
        let dest = format!("/opt/{name}/");
        let mut s = step(&[name], &dest);
        s.unpack = true;
        let r = copy(&s, &ctx_src(&d), &d.dest).unwrap();
        assert_eq!(r.archives, 1, "{name}");
        let got = d.dest.join(dest.trim_start_matches('/'));
        assert_eq!(
            fs::read_to_string(got.join("bin/tool")).unwrap(),
            "T",
            "{name}"
        );
        assert_eq!(
            fs::read_to_string(got.join("README")).unwrap(),
            "R",
            "{name}"
        );
    }
    // Compressed bytes that are no tar are copied as they are, as Docker does.
    let mut not_tar = liblzma::write::XzEncoder::new(Vec::new(), 6);
    not_tar.write_all(&[b'x'; 2000]).unwrap();
    fs::write(d.ctx.join("notes.xz"), not_tar.finish().unwrap()).unwrap();
    let mut s = step(&["notes.xz"], "/n/");
    s.unpack = true;
    let r = copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert_eq!(r.archives, 0);
    assert!(d.dest.join("n/notes.xz").is_file());
    // The applier's bounds hold for xz and bzip2 as for gzip, and so does its path rule.
    let big = tar_gz_plain(&[("f", &[1u8; 5000])]);
    let evil = tar_gz_plain(&[("../escaped", b"E")]);
    let opts = CopyOptions {
        tar_limits: crate::layer::Limits {
            max_file_bytes: 1000,
            ..crate::layer::Limits::default()
        },
        ..CopyOptions::default()
    };
    for (name, tar, opts) in [
        ("big.tar.xz", &big, &opts),
        ("evil.tar.xz", &evil, &CopyOptions::default()),
        ("evil.tar.bz2", &evil, &CopyOptions::default()),
    ] {
        let bytes = if name.ends_with(".xz") {
            let mut z = liblzma::write::XzEncoder::new(Vec::new(), 6);
            z.write_all(tar).unwrap();
            z.finish().unwrap()
        } else {
            let mut z = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::default());
            z.write_all(tar).unwrap();
            z.finish().unwrap()
        };
        fs::write(d.ctx.join(name), bytes).unwrap();
        let mut s = step(&[name], "/b/");
        s.unpack = true;
        let e = copy_into(&s, &ctx_src(&d), &d.dest, opts).unwrap_err();
        assert!(matches!(e, CopyError::Archive { .. }), "{name}: {e}");
    }
    assert!(!d.dest.join("escaped").exists() && !d.outside.join("escaped").exists());
}

/// The plain tar of `entries` (what [`tar_gz`] compresses).
fn tar_gz_plain(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut tar = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(&tar_gz(entries, &[])[..]),
        &mut tar,
    )
    .unwrap();
    tar
}

#[test]
fn add_extracts_local_archives_within_bounds() {
    let d = dirs();
    fs::write(
        d.ctx.join("app.tgz"),
        tar_gz(&[("bin/tool", b"T"), ("README", b"R")], &[]),
    )
    .unwrap();
    let mut s = step(&["app.tgz"], "/opt/app");
    s.unpack = true;
    let r = copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert_eq!(r.archives, 1);
    assert_eq!(
        fs::read_to_string(d.dest.join("opt/app/bin/tool")).unwrap(),
        "T"
    );
    // COPY never unpacks.
    s.unpack = false;
    s.dest = "/copied.tgz".into();
    copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert!(d.dest.join("copied.tgz").is_file());
    // A hostile archive: `..` names and a symlink then a write through it.
    fs::write(d.ctx.join("evil.tgz"), tar_gz(&[("../escaped", b"E")], &[])).unwrap();
    let mut s = step(&["evil.tgz"], "/x/");
    s.unpack = true;
    let e = copy(&s, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::Archive { .. }), "{e}");
    let out = d.outside.display().to_string();
    fs::write(
        d.ctx.join("evil2.tgz"),
        tar_gz(&[("link/planted", b"P")], &[("link", &out)]),
    )
    .unwrap();
    let mut s = step(&["evil2.tgz"], "/y/");
    s.unpack = true;
    copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert!(!d.outside.join("planted").exists());
    // Bounds of the layer applier hold.
    fs::write(d.ctx.join("big.tgz"), tar_gz(&[("f", &[1u8; 5000])], &[])).unwrap();
    let mut s = step(&["big.tgz"], "/z/");
    s.unpack = true;
    let opts = CopyOptions {
        tar_limits: crate::layer::Limits {
            max_file_bytes: 1000,
            ..crate::layer::Limits::default()
        },
        ..CopyOptions::default()
    };
    let e = copy_into(&s, &ctx_src(&d), &d.dest, &opts).unwrap_err();
    assert!(e.to_string().contains("file size"), "{e}");
}

#[test]
fn inline_heredoc_files() {
    let d = dirs();
    let mut s = step(&[], "/etc/motd");
    s.sources = vec![CopySource::Inline(InlineFile {
        name: "EOF".into(),
        data: "hello\n".into(),
        path: None,
        mode: 0o644,
    })];
    copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert_eq!(
        fs::read_to_string(d.dest.join("etc/motd")).unwrap(),
        "hello\n"
    );
}

#[test]
fn digest_ignores_mtime_but_not_content_or_mode() {
    let d = dirs();
    let src = ctx_src(&d);
    let s = step(&["src", "a.txt"], "/app/");
    let d0 = sources_digest(&s, &src).unwrap();
    assert!(d0.starts_with("sha256:") && d0.len() == 71);
    let f = fs::File::options()
        .write(true)
        .open(d.ctx.join("src/main.c"))
        .unwrap();
    f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(12345))
        .unwrap();
    drop(f);
    assert_eq!(
        sources_digest(&s, &src).unwrap(),
        d0,
        "mtime changed the digest"
    );
    fs::write(d.ctx.join("src/main.c"), "int main2;").unwrap();
    let d1 = sources_digest(&s, &src).unwrap();
    assert_ne!(d1, d0);
    fs::set_permissions(d.ctx.join("src/main.c"), fs::Permissions::from_mode(0o755)).unwrap();
    let d2 = sources_digest(&s, &src).unwrap();
    assert_ne!(d2, d1);
    // A file the copy does not select does not count.
    fs::write(d.ctx.join("b.txt"), "changed").unwrap();
    assert_eq!(sources_digest(&s, &src).unwrap(), d2);
    // Nor one .dockerignore leaves out.
    let ig = Dockerignore::parse(".dockerignore", b"src/sub\n").unwrap();
    let src2 = Sources::context(&d.ctx, ig);
    let d3 = sources_digest(&s, &src2).unwrap();
    fs::write(d.ctx.join("src/sub/x.h"), "changed").unwrap();
    assert_eq!(sources_digest(&s, &src2).unwrap(), d3);
    assert_ne!(sources_digest(&s, &src).unwrap(), d2);
    // A new symlink changes it.
    symlink("a.txt", d.ctx.join("src/l")).unwrap();
    assert_ne!(sources_digest(&s, &src2).unwrap(), d3);
    let e = sources_digest(&step(&["../x"], "/"), &src).unwrap_err();
    assert!(matches!(e, CopyError::Escapes { .. }));
}

/// A one-shot HTTP/1.1 server on 127.0.0.1 answering every request with `body` (or a
/// redirect to `redirect` when given).
async fn serve(body: Vec<u8>, redirect: Option<String>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let mut buf = vec![0u8; 4096];
            let _ = c.read(&mut buf).await;
            let head = match &redirect {
                Some(to) => format!(
                    "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                ),
                None => format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                ),
            };
            let _ = c.write_all(head.as_bytes()).await;
            if redirect.is_none() {
                let _ = c.write_all(&body).await;
            }
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn add_url_with_checksum_and_address_policy() {
    let d = dirs();
    let base = serve(b"payload".to_vec(), None).await;
    let url = format!("{base}/files/tool.bin");
    let dl = d.outside.join("dl");
    fs::create_dir(&dl).unwrap();
    let allow = FetchOptions {
        addresses: crate::egress::address::AddressPolicy {
            allow_private_addresses: true,
            ..Default::default()
        },
        ..FetchOptions::default()
    };
    let mut s = step(&[&url], "/opt/");
    s.checksum = Some(format!(
        "sha256:{}",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"payload"))
    ));
    let downloads = fetch_urls(&s, &dl, &allow).await.unwrap();
    let src = ctx_src(&d).with_downloads(downloads);
    copy(&s, &src, &d.dest).unwrap();
    let f = d.dest.join("opt/tool.bin");
    assert_eq!(fs::read(&f).unwrap(), b"payload");
    assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o600);
    let dg = sources_digest(&s, &src).unwrap();
    assert!(dg.starts_with("sha256:"));
    // A wrong checksum.
    s.checksum = Some(format!("sha256:{}", "0".repeat(64)));
    let e = fetch_urls(&s, &dl, &allow).await.unwrap_err();
    assert!(matches!(e, FetchError::Checksum { .. }), "{e}");
    // A malformed one is refused before anything is fetched; upper-case hex is accepted.
    for bad in ["sha256:xyz", "SHA256:00", "md5:00"] {
        s.checksum = Some(bad.to_string());
        let e = fetch_urls(&s, &dl, &allow).await.unwrap_err();
        assert!(
            matches!(&e, FetchError::BadUrl { reason, .. } if reason.contains("--checksum")),
            "{bad}: {e}"
        );
    }
    s.checksum = Some(format!(
        "sha256:{}",
        hex::encode_upper(<sha2::Sha256 as sha2::Digest>::digest(b"payload"))
    ));
    fetch_urls(&s, &dl, &allow).await.expect("upper-case hex");
    // The default policy refuses the host's loopback, also behind a redirect.
    s.checksum = None;
    let e = fetch_urls(&s, &dl, &FetchOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, FetchError::Forbidden { .. }), "{e}");
    // Bounded size.
    let small = FetchOptions {
        max_bytes: 3,
        ..allow.clone()
    };
    let e = fetch_urls(&s, &dl, &small).await.unwrap_err();
    assert!(matches!(e, FetchError::TooLarge { .. }), "{e}");
    // Redirects are followed, each hop checked by the same policy.
    let hop = serve(Vec::new(), Some(url.clone())).await;
    let s2 = step(&[&format!("{hop}/r/x")], "/opt/");
    let ok = fetch_urls(&s2, &dl, &allow).await.unwrap();
    assert_eq!(ok.get(&format!("{hop}/r/x")).unwrap().size, 7);
    // --checksum is for URLs only.
    let mut local = step(&["a.txt"], "/x");
    local.checksum = Some(format!("sha256:{}", "0".repeat(64)));
    let e = copy(&local, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::Unsupported(_)), "{e}");
    // COPY of a URL without a fetch is a clear error.
    let e = copy(&s2, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::NotDownloaded { .. }), "{e}");
}

#[test]
fn symlink_loops_and_non_archives() {
    let d = dirs();
    symlink("loop", d.ctx.join("loop")).unwrap();
    symlink("b2", d.ctx.join("a2")).unwrap();
    symlink("a2", d.ctx.join("b2")).unwrap();
    for s in ["loop", "a2/x"] {
        let e = copy(&step(&[s], "/x"), &ctx_src(&d), &d.dest).unwrap_err();
        assert!(e.to_string().contains("symbolic links"), "{s}: {e}");
    }
    // A loop inside a copied directory is copied as the symlinks it is.
    symlink("self", d.ctx.join("src/self")).unwrap();
    copy(&step(&["src"], "/s"), &ctx_src(&d), &d.dest).unwrap();
    assert!(
        d.dest
            .join("s/self")
            .symlink_metadata()
            .unwrap()
            .file_type()
            .is_symlink()
    );
    // ADD of a compressed file that is not a tar copies it as it is.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &[b'z'; 2000]).unwrap();
    fs::write(d.ctx.join("data.gz"), gz.finish().unwrap()).unwrap();
    let mut s = step(&["data.gz"], "/d/");
    s.unpack = true;
    let r = copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert_eq!(r.archives, 0);
    assert!(d.dest.join("d/data.gz").is_file());
}

#[test]
fn no_whiteouts_devices_or_overlay_xattrs_reach_the_upper_dir() {
    let d = dirs();
    let mk = |p: &Path, ft, dev| {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p,
            ft,
            rustix::fs::Mode::from_raw_mode(0o644),
            dev,
        )
        .unwrap()
    };
    use rustix::fs::FileType as T;
    mk(
        &d.ctx.join("src/null"),
        T::CharacterDevice,
        rustix::fs::makedev(1, 3),
    );
    mk(&d.ctx.join("src/passwd"), T::CharacterDevice, 0);
    fs::create_dir(d.ctx.join("src/opaque")).unwrap();
    rustix::fs::setxattr(
        d.ctx.join("src/opaque"),
        "trusted.overlay.opaque",
        b"y",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    rustix::fs::setxattr(
        d.ctx.join("src/opaque"),
        "user.kept",
        b"1",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    copy(&step(&["src"], "/etc"), &ctx_src(&d), &d.dest).unwrap();
    assert!(
        d.dest.join("etc/passwd").is_file(),
        "the whiteout replaced /etc/passwd"
    );
    assert!(d.dest.join("etc/null").symlink_metadata().is_err());
    let mut buf = [0u8; 16];
    assert!(
        rustix::fs::getxattr(
            d.dest.join("etc/opaque"),
            "trusted.overlay.opaque",
            &mut buf[..]
        )
        .is_err()
    );
    assert_eq!(
        rustix::fs::getxattr(d.dest.join("etc/opaque"), "user.kept", &mut buf[..]).unwrap(),
        1
    );
    // From a tree, devices are kept but a 0/0 one is not.
    let tree = d.outside.join("t");
    fs::create_dir(&tree).unwrap();
    mk(
        &tree.join("null"),
        T::CharacterDevice,
        rustix::fs::makedev(1, 3),
    );
    mk(&tree.join("wh"), T::CharacterDevice, 0);
    copy(&step(&["/"], "/t"), &Sources::tree(&tree), &d.dest).unwrap();
    assert!(d.dest.join("t/null").symlink_metadata().is_ok());
    assert!(d.dest.join("t/wh").symlink_metadata().is_err());
}

#[test]
fn deep_trees_are_bounded_and_fit_a_thread_stack() {
    let d = dirs();
    let make = |name: &str, depth: usize| {
        // Built with *at calls: the path grows past PATH_MAX.
        let mut fd = rustix::fs::open(
            &d.ctx,
            rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        for i in 0..depth {
            let n = if i == 0 { name } else { "d" };
            rustix::fs::mkdirat(&fd, n, rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
            fd = rustix::fs::openat(
                &fd,
                n,
                rustix::fs::OFlags::DIRECTORY,
                rustix::fs::Mode::empty(),
            )
            .unwrap();
        }
        rustix::fs::openat(
            &fd,
            "leaf",
            rustix::fs::OFlags::CREATE | rustix::fs::OFlags::WRONLY,
            rustix::fs::Mode::from_raw_mode(0o644),
        )
        .unwrap();
    };
    make("ok", 1000);
    make("deep", MAX_TREE_DEPTH + 10);
    let (ctx, dest) = (d.ctx.clone(), d.dest.clone());
    // A spawned thread has the default 2 MiB stack, as the build driver's workers do.
    std::thread::spawn(move || {
        let src = Sources::context(&ctx, Dockerignore::default());
        let r = copy(&step(&["ok"], "/ok"), &src, &dest).unwrap();
        assert_eq!(r.files, 1);
        sources_digest(&step(&["ok"], "/ok"), &src).unwrap();
        let e = copy(&step(&["deep"], "/deep"), &src, &dest).unwrap_err();
        assert!(matches!(e, CopyError::Limit { .. }), "{e}");
        let e = sources_digest(&step(&["deep"], "/deep"), &src).unwrap_err();
        assert!(matches!(e, CopyError::Limit { .. }), "{e}");
    })
    .join()
    .unwrap();
}

/// The build driver copies from a thread with its own mount namespace, where the step's
/// overlay is mounted; the copy's own walk thread must see that mount.
#[test]
fn copies_inside_a_threads_private_mount_namespace() {
    let d = dirs();
    let mnt = d.outside.join("mnt");
    fs::create_dir(&mnt).unwrap();
    let (ctx, mnt2) = (d.ctx.clone(), mnt.clone());
    let seen = std::thread::spawn(move || {
        // SAFETY: only this thread's fs attributes and mount namespace are unshared.
        unsafe {
            rustix::thread::unshare_unsafe(
                rustix::thread::UnshareFlags::FS | rustix::thread::UnshareFlags::NEWNS,
            )
        }
        .unwrap();
        rustix::mount::mount_change(
            "/",
            rustix::mount::MountPropagationFlags::REC
                | rustix::mount::MountPropagationFlags::PRIVATE,
        )
        .unwrap();
        rustix::mount::mount(
            "tmpfs",
            &mnt2,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .unwrap();
        let src = Sources::context(&ctx, Dockerignore::default());
        copy(&step(&["a.txt"], "/in-ns"), &src, &mnt2).unwrap();
        fs::read_to_string(mnt2.join("in-ns")).unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(seen, "A");
    // The namespace died with the thread: nothing on the host side.
    assert!(!mnt.join("in-ns").exists());
}

/// An inline file's name is the heredoc delimiter, the tenant's text: `COPY <<../../x /d/`
/// must not become a path that `openat` resolves out of the destination root.
#[test]
fn inline_names_with_slashes_or_dots_are_refused() {
    let d = dirs();
    fs::create_dir(d.dest.join("app")).unwrap();
    symlink(&d.outside, d.dest.join("app/link")).unwrap();
    let outside_name = d.outside.file_name().unwrap().to_str().unwrap().to_string();
    for name in [
        format!("../../{outside_name}/pwned"),
        format!("../../../../../../../../..{}/pwned", d.outside.display()),
        "link/pwned".to_string(),
        "..".to_string(),
        ".".to_string(),
        "a/b".to_string(),
        String::new(),
    ] {
        let mut s = step(&[], "/app/");
        s.sources = vec![CopySource::Inline(InlineFile {
            name: name.clone(),
            data: "owned\n".into(),
            path: None,
            mode: 0o644,
        })];
        let e = copy(&s, &ctx_src(&d), &d.dest).unwrap_err();
        assert!(matches!(e, CopyError::BadName { .. }), "{name:?}: {e}");
    }
    let listed: Vec<_> = fs::read_dir(&d.outside).unwrap().flatten().collect();
    assert_eq!(listed.len(), 1, "only the original secret");
    // The Dockerfile front end hands such a delimiter over as the name.
    let plan = kiln_recipes::load_dockerfile(
        "Dockerfile",
        b"FROM scratch\nCOPY <<../../x /app/\nowned\n../../x\n",
        &kiln_recipes::Options::default(),
    )
    .unwrap();
    let copied = plan.stages[0].steps.iter().find_map(|s| match &s.action {
        kiln_recipes::plan::Action::Copy(c) => Some(c.clone()),
        _ => None,
    });
    let copied = copied.expect("a COPY step");
    assert!(
        matches!(&copied.sources[0], CopySource::Inline(f) if f.name == "../../x"),
        "{copied:?}"
    );
    let e = copy(&copied, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::BadName { .. }), "{e}");
    // A file destination names the file itself: the delimiter is not used.
    let mut s = step(&[], "/app/named");
    s.sources = vec![CopySource::Inline(InlineFile {
        name: "../../x".into(),
        data: "ok\n".into(),
        path: None,
        mode: 0o644,
    })];
    copy(&s, &ctx_src(&d), &d.dest).unwrap();
    assert_eq!(
        fs::read_to_string(d.dest.join("app/named")).unwrap(),
        "ok\n"
    );
}

/// File names are bytes: two contexts that differ only in a name that is not UTF-8 must not
/// share a cache key (a lossy conversion maps `\xff` and `\xfe` alike to U+FFFD, and a hit
/// would reuse a layer holding the other name).
#[test]
fn digest_tells_apart_names_that_are_not_utf8() {
    use std::os::unix::ffi::OsStrExt;
    let digest_with = |name: &[u8]| {
        let d = dirs();
        fs::write(
            d.ctx.join("src").join(std::ffi::OsStr::from_bytes(name)),
            "same",
        )
        .unwrap();
        sources_digest(&step(&["src"], "/app/"), &ctx_src(&d)).unwrap()
    };
    let a = digest_with(b"f\xff");
    let b = digest_with(b"f\xfe");
    let c = digest_with("f\u{fffd}".as_bytes());
    assert_ne!(a, b);
    assert_ne!(a, c);
    assert_ne!(b, c);
}

/// Attacks that hold (kept as regressions): `.dockerignore` exceptions written for a symlink's
/// name do not re-include what it resolves to; a symlink one source plants in the
/// destination is followed inside the root by the next source; FIFOs and sockets in the
/// context never block the copy or the digest.
#[test]
fn hostile_sources_that_hold() {
    let d = dirs();
    fs::create_dir(d.ctx.join("secrets")).unwrap();
    fs::write(d.ctx.join("secrets/key"), "KEY").unwrap();
    symlink("secrets", d.ctx.join("public")).unwrap();
    symlink("/secrets/key", d.ctx.join("keylink")).unwrap();
    let ig =
        Dockerignore::parse(".dockerignore", b"secrets\n!public\n!public/**\n!keylink\n").unwrap();
    let src = Sources::context(&d.ctx, ig);
    for s in [
        "public",
        "public/key",
        "public/*",
        "pub*/key",
        "keylink",
        "*",
    ] {
        let _ = copy(&step(&[s], &format!("/x/{}/", s.len())), &src, &d.dest);
        let _ = sources_digest(&step(&[s], "/y/"), &src);
    }
    fn walk(p: &Path, out: &mut Vec<Vec<u8>>) {
        for e in fs::read_dir(p).unwrap().flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                walk(&e.path(), out);
            } else if ft.is_file() {
                out.push(fs::read(e.path()).unwrap());
            }
        }
    }
    let mut contents = Vec::new();
    walk(&d.dest, &mut contents);
    assert!(
        !contents.iter().any(|c| c == b"KEY"),
        "an excluded file was copied"
    );

    // One source plants /out/sub -> <outside>; the next one's sub/ never reaches the real
    // <outside>.
    fs::create_dir_all(d.ctx.join("one")).unwrap();
    symlink(&d.outside, d.ctx.join("one/sub")).unwrap();
    fs::create_dir_all(d.ctx.join("two/sub")).unwrap();
    fs::write(d.ctx.join("two/sub/f"), "F").unwrap();
    let src = ctx_src(&d);
    copy(&step(&["one", "two"], "/out/"), &src, &d.dest).unwrap();
    let listed: Vec<_> = fs::read_dir(&d.outside).unwrap().flatten().collect();
    assert_eq!(listed.len(), 1, "only the original secret");
    // The link's target does not exist inside the root: the link gives way to a directory.
    assert_eq!(fs::read_to_string(d.dest.join("out/sub/f")).unwrap(), "F");

    // A FIFO and a socket: copied as a FIFO and skipped, never opened.
    use std::os::unix::fs::FileTypeExt;
    fs::create_dir(d.ctx.join("spec")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        d.ctx.join("spec/fifo"),
        FileType::Fifo,
        Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let _sock = std::os::unix::net::UnixListener::bind(d.ctx.join("spec/sock")).unwrap();
    sources_digest(&step(&["spec"], "/spec/"), &src).unwrap();
    sources_digest(&step(&["spec/fifo"], "/f"), &src).unwrap();
    copy(&step(&["spec"], "/spec/"), &src, &d.dest).unwrap();
    copy(&step(&["spec/fifo"], "/f"), &src, &d.dest).unwrap();
    let ft = fs::symlink_metadata(d.dest.join("spec/fifo"))
        .unwrap()
        .file_type();
    assert!(ft.is_fifo());
    assert!(fs::symlink_metadata(d.dest.join("spec/sock")).is_err());
    assert!(
        fs::symlink_metadata(d.dest.join("f"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
}

/// Overlayfs reads its own xattrs from `user.overlay.*` too when mounted with `userxattr`
/// (Linux `Documentation/filesystems/overlayfs.rst`, as rootless builders mount it): a
/// context file carrying `user.overlay.redirect` or `.metacopy` must not carry it into the
/// step's upper directory, as [`crate::layer`] drops them from layers.
#[test]
fn user_overlay_xattrs_are_not_copied() {
    let d = dirs();
    for (k, v) in [
        ("user.overlay.redirect", &b"/etc/shadow"[..]),
        ("user.overlay.metacopy", b""),
        ("user.overlay.opaque", b"y"),
        ("user.kept", b"1"),
    ] {
        rustix::fs::setxattr(d.ctx.join("a.txt"), k, v, rustix::fs::XattrFlags::empty()).unwrap();
    }
    copy(&step(&["a.txt"], "/a"), &ctx_src(&d), &d.dest).unwrap();
    let mut names = vec![0u8; 4096];
    let n = rustix::fs::listxattr(d.dest.join("a"), &mut names[..]).unwrap();
    let names: Vec<&[u8]> = names[..n]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .collect();
    assert_eq!(names, [&b"user.kept"[..]]);
}

/// `--chown` reads the destination's `/etc/passwd` and `/etc/group` inside its root: a
/// symlink to a host file reads the root's file of that path, a FIFO or a device is not
/// opened (no hang), and a huge file is read only up to its bound.
#[test]
fn chown_databases_that_hold() {
    let d = dirs();
    let host_passwd = d.outside.join("passwd");
    fs::write(&host_passwd, "mallory:x:4242:4242::/:/bin/sh\n").unwrap();
    fs::remove_file(d.dest.join("etc/passwd")).unwrap();
    symlink(&host_passwd, d.dest.join("etc/passwd")).unwrap();
    fs::remove_file(d.dest.join("etc/group")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        d.dest.join("etc/group"),
        FileType::Fifo,
        Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let mut s = step(&["a.txt"], "/a");
    s.chown = Some("mallory".into());
    let e = copy(&s, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::Chown { .. }), "{e}");
    s.chown = Some("1000:staff".into());
    let e = copy(&s, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::Chown { .. }), "{e}");
    // A passwd far over the bound, its one user past it: not found, read in bounded time.
    fs::remove_file(d.dest.join("etc/passwd")).unwrap();
    let mut big = "#".repeat(crate::user::MAX_DB_BYTES + 10);
    big.push_str("\nlate:x:7:7::/:/bin/sh\n");
    fs::write(d.dest.join("etc/passwd"), big).unwrap();
    s.chown = Some("late".into());
    let e = copy(&s, &ctx_src(&d), &d.dest).unwrap_err();
    assert!(matches!(e, CopyError::Chown { .. }), "{e}");
    s.chown = Some("7".into());
    copy(&s, &ctx_src(&d), &d.dest).unwrap();
    let md = fs::metadata(d.dest.join("a")).unwrap();
    assert_eq!((md.uid(), md.gid()), (7, 7));
}

#[test]
fn tar_header_sniffing_checks_the_checksum() {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_size(3);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, "f", &b"abc"[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let block: [u8; 512] = tar[..512].try_into().unwrap();
    assert!(super::tar_checksum_ok(&block), "a real header");
    let mut flipped = block;
    flipped[0] ^= 1;
    assert!(!super::tar_checksum_ok(&flipped), "one name byte changed");
    assert!(!super::tar_checksum_ok(&[0; 512]), "end-of-archive block");
    assert!(!super::tar_checksum_ok(&[b'a'; 512]), "text");
}
