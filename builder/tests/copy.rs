//! COPY onto a step's overlay, then RUN on top of it, on the busybox OCI fixture
//! (`KILN_TEST_BUSYBOX_OCI`, made by `ci/setup.sh`), unpacked with umoci as `tests/exec.rs`
//! unpacks the Debian one. The copy runs as the build driver runs it: in a thread with its own
//! mount namespace holding the overlay (parent layers as lowers, a fresh upper); what the
//! copy wrote is the upper directory, i.e. the step's layer.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kiln_builder::copy::{CopyOptions, CopyReport, Sources, copy_into, sources_digest};
use kiln_builder::exec::{ExecConfig, LinuxExecutor, StepExecutor, StepSpec};
use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{CopySource, CopyStep, Network, SourceLocation};

fn busybox_root(tmp: &Path) -> PathBuf {
    assert!(
        rustix::process::geteuid().is_root(),
        "the copy tests need root (CI runs them as root)"
    );
    let layout = std::env::var("KILN_TEST_BUSYBOX_OCI").expect(
        "KILN_TEST_BUSYBOX_OCI unset: run ci/setup.sh (ci/fixtures.sh) and source /var/cache/kiln-ci/env",
    );
    let bundle = tmp.join("bundle");
    let out = std::process::Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:latest", layout.trim_end_matches('/')))
        .arg(&bundle)
        .output()
        .expect("umoci missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    bundle.join("rootfs")
}

/// Runs `copy_into` on the overlay of `lowers` + `upper`, from a thread with a private mount
/// namespace.
fn copy_on_overlay(
    step: CopyStep,
    src: Sources,
    lowers: &[PathBuf],
    upper: &Path,
    scratch: &Path,
) -> Result<CopyReport, String> {
    let work = scratch.join("work");
    let mnt = scratch.join("mnt");
    fs::create_dir_all(&work).unwrap();
    fs::create_dir_all(&mnt).unwrap();
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lowers
            .iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(":"),
        upper.display(),
        work.display()
    );
    std::thread::spawn(move || {
        // SAFETY: only this thread's fs attributes and mount namespace are unshared.
        unsafe {
            rustix::thread::unshare_unsafe(
                rustix::thread::UnshareFlags::FS | rustix::thread::UnshareFlags::NEWNS,
            )
        }
        .map_err(|e| e.to_string())?;
        rustix::mount::mount_change(
            "/",
            rustix::mount::MountPropagationFlags::REC
                | rustix::mount::MountPropagationFlags::PRIVATE,
        )
        .map_err(|e| e.to_string())?;
        let data = std::ffi::CString::new(data).unwrap();
        rustix::mount::mount(
            "overlay",
            &mnt,
            "overlay",
            rustix::mount::MountFlags::empty(),
            Some(data.as_c_str()),
        )
        .map_err(|e| e.to_string())?;
        let opts = CopyOptions {
            location: Some(SourceLocation {
                file: "Dockerfile".into(),
                start_line: 4,
                end_line: 4,
            }),
            ..CopyOptions::default()
        };
        copy_into(&step, &src, &mnt, &opts).map_err(|e| e.to_string())
    })
    .join()
    .unwrap()
}

fn copy_step(sources: &[&str], dest: &str) -> CopyStep {
    CopyStep {
        sources: sources
            .iter()
            .map(|p| CopySource::Path {
                path: p.to_string(),
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

#[test]
fn copy_layers_then_run_on_busybox() {
    let tmp = tempfile::tempdir().unwrap();
    let base = busybox_root(tmp.path());
    let ctx = tmp.path().join("ctx");
    fs::create_dir_all(ctx.join("app/conf")).unwrap();
    fs::write(
        ctx.join("app/run.sh"),
        "#!/bin/sh\necho app ran as $(id -u)\n",
    )
    .unwrap();
    fs::write(ctx.join("app/conf/app.ini"), "x=1\n").unwrap();
    fs::write(ctx.join("app/.env"), "SECRET=1\n").unwrap();
    fs::write(ctx.join(".dockerignore"), "**/.env\n").unwrap();
    let ignore = Dockerignore::parse(".dockerignore", b"**/.env\n").unwrap();

    // Step 1: COPY --chown=nobody:nogroup --chmod=u+x app /srv/app (names from busybox's
    // /etc/passwd and /etc/group).
    let upper1 = tmp.path().join("upper1");
    fs::create_dir(&upper1).unwrap();
    let mut s1 = copy_step(&["app"], "/srv/app");
    s1.chown = Some("nobody:nogroup".into());
    s1.chmod = Some("u+x".into());
    let src = Sources::context(&ctx, ignore.clone());
    let key1 = sources_digest(&s1, &src).unwrap();
    let r = copy_on_overlay(
        s1.clone(),
        src.clone(),
        std::slice::from_ref(&base),
        &upper1,
        &tmp.path().join("s1"),
    )
    .unwrap();
    assert_eq!(r.files, 2);
    // The upper directory (the layer) holds exactly the copy.
    let md = fs::metadata(upper1.join("srv/app/run.sh")).unwrap();
    assert_eq!((md.uid(), md.gid()), (65534, 65534));
    assert_eq!(md.mode() & 0o777, 0o744);
    assert!(!upper1.join("srv/app/.env").exists());
    assert!(!upper1.join("bin").exists());

    // Step 2: COPY --from=<busybox tree> /bin/busybox /usr/local/bin/bb: owners kept, the
    // symlinks of /bin not followed out of the tree.
    let upper2 = tmp.path().join("upper2");
    fs::create_dir(&upper2).unwrap();
    copy_on_overlay(
        copy_step(&["/bin/busybox", "/bin/sh"], "/usr/local/bin/"),
        Sources::tree(&base),
        &[upper1.clone(), base.clone()],
        &upper2,
        &tmp.path().join("s2"),
    )
    .unwrap();
    assert!(upper2.join("usr/local/bin/busybox").is_file());
    // `sh` is a symlink in the tree; named as a source it is followed (a regular file).
    assert!(
        fs::symlink_metadata(upper2.join("usr/local/bin/sh"))
            .unwrap()
            .is_file()
    );

    // Step 3: RUN on top of both layers, as nobody.
    let upper3 = tmp.path().join("upper3");
    let work3 = tmp.path().join("work3");
    fs::create_dir(&upper3).unwrap();
    fs::create_dir(&work3).unwrap();
    let spec = StepSpec {
        index: 0,
        lower_dirs: vec![upper2.clone(), upper1.clone(), base.clone()],
        layer_limits: Default::default(),
        upper_dir: upper3,
        work_dir: work3,
        argv: vec![
            "/usr/local/bin/sh".into(),
            "-c".into(),
            "/srv/app/run.sh; cat /srv/app/conf/app.ini; ls -a /srv/app".into(),
        ],
        env: vec![],
        user: Some("nobody".into()),
        workdir: "/".into(),
        files: vec![],
        network: Network::None,
        security: kiln_recipes::plan::Security::Sandbox,
        mounts: vec![],
        secrets: vec![],
        timeout: Duration::from_secs(120),
        log_budget: None,
    };
    let exec = LinuxExecutor::new(ExecConfig {
        run_dir: tmp.path().join("run"),
        cgroup_parent: format!("kiln-test-copy-{}", std::process::id()),
        ..ExecConfig::default()
    });
    let mut lines = Vec::new();
    exec.run(&spec, &AtomicBool::new(false), &mut |l| lines.push(l.text))
        .unwrap();
    assert_eq!(lines[0], "app ran as 65534");
    assert_eq!(lines[1], "x=1");
    assert!(!lines.iter().any(|l| l == ".env"), "{lines:?}");
    for ctrl in ["memory", "pids", ""] {
        let _ = fs::remove_dir(
            Path::new("/sys/fs/cgroup")
                .join(ctrl)
                .join(format!("kiln-test-copy-{}", std::process::id())),
        );
    }

    // The cache key: same sources, same key; a changed byte, another key; an error names
    // the step's place.
    assert_eq!(sources_digest(&s1, &src).unwrap(), key1);
    fs::write(ctx.join("app/conf/app.ini"), "x=2\n").unwrap();
    assert_ne!(sources_digest(&s1, &src).unwrap(), key1);
    let e = copy_on_overlay(
        copy_step(&["../etc"], "/x"),
        src,
        std::slice::from_ref(&base),
        &tmp.path().join("upper1"),
        &tmp.path().join("s4"),
    )
    .unwrap_err();
    assert!(e.starts_with("Dockerfile:4: "), "{e}");
}
