//! `RUN --mount` through the real executor, as root, on a busybox root built from Debian's
//! `busybox-static` (installed by `ci/setup.sh`), as `tests/exec.rs` builds it: binds
//! (read-only, read-write discarded), caches, tmpfs, secrets as files and environment
//! variables; nothing of a mount in the layer, no secret in a log or the layer, hostile
//! sources and targets kept inside their roots.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kiln_builder::exec::{
    ExecConfig, ExecError, LinuxExecutor, LogLine, MountInputs, StepExecutor, StepReport, StepSpec,
};
use kiln_builder::secrets::{SecretValue, Secrets};
use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{
    Action, CommandForm, Mount, Network, RunStep, Security, SourceLocation, Step, StepContext,
};

const BUSYBOX: &str = "/usr/bin/busybox";
const SECRET: &str = "s3cr3t-Value-42";
/// A secret file as keys come: several lines, a trailing newline.
const KEY: &str = "-----BEGIN KEY-----\nQUJDREVGR0hJSktMTU5PUA\n-----END KEY-----\n";

struct Fixture {
    tmp: tempfile::TempDir,
    root: PathBuf,
    ctx: PathBuf,
    cache: PathBuf,
    run_dir: PathBuf,
    cgroup: String,
}

fn fixture(name: &str) -> Fixture {
    assert!(
        rustix::process::geteuid().is_root(),
        "the executor tests need root (CI runs them as root)"
    );
    assert!(
        Path::new(BUSYBOX).exists(),
        "{BUSYBOX} missing: run ci/setup.sh (installs busybox-static)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("rootfs");
    for d in ["bin", "etc", "run", "tmp"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    fs::copy(BUSYBOX, root.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "cat", "echo", "ls", "touch", "dd", "stat", "mkdir", "test",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    let ctx = tmp.path().join("ctx");
    fs::create_dir_all(ctx.join("src")).unwrap();
    fs::write(ctx.join("src/hello.txt"), "hello from context\n").unwrap();
    fs::write(ctx.join("ignored.txt"), "ignored\n").unwrap();
    let cache = tmp.path().join("cache");
    let run_dir = tmp.path().join("run");
    Fixture {
        root,
        ctx,
        cache,
        run_dir,
        cgroup: format!("kiln-test-mounts-{name}-{}", std::process::id()),
        tmp,
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for ctrl in ["memory", "pids", ""] {
            let _ = fs::remove_dir(Path::new("/sys/fs/cgroup").join(ctrl).join(&self.cgroup));
        }
    }
}

fn run_step(script: &str, mounts: Vec<Mount>) -> Step {
    Step {
        location: SourceLocation {
            file: "Dockerfile".into(),
            start_line: 3,
            end_line: 3,
        },
        action: Action::Run(RunStep {
            form: CommandForm::Shell,
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            files: vec![],
            mounts,
            network: Network::None,
            security: Security::Sandbox,
            proxy_env: vec![],
        }),
        context: StepContext {
            env: vec![],
            user: None,
            workdir: "/".into(),
            shell: vec!["/bin/sh".into(), "-c".into()],
        },
    }
}

/// One step's upper directory and its outcome.
struct Ran {
    upper: PathBuf,
    result: Result<StepReport, ExecError>,
    lines: Vec<String>,
}

impl Fixture {
    fn inputs(&self) -> MountInputs {
        let mut secrets = Secrets::default();
        secrets.insert("tok", SecretValue::new(SECRET.as_bytes().to_vec()));
        secrets.insert("key", SecretValue::new(KEY.as_bytes().to_vec()));
        MountInputs {
            context: Some((
                self.ctx.clone(),
                Dockerignore::parse(".dockerignore", b"ignored.txt\n").unwrap(),
            )),
            cache_dir: Some(self.cache.clone()),
            scratch_dir: Some(self.tmp.path().join("scratch")),
            secrets,
            ..MountInputs::default()
        }
    }

    fn run(&self, n: &str, script: &str, mounts: Vec<Mount>) -> Ran {
        self.run_with(n, script, mounts, &self.inputs())
    }

    fn run_with(&self, n: &str, script: &str, mounts: Vec<Mount>, inputs: &MountInputs) -> Ran {
        let upper = self.tmp.path().join(format!("upper-{n}"));
        let work = self.tmp.path().join(format!("work-{n}"));
        fs::create_dir_all(&upper).unwrap();
        fs::create_dir_all(&work).unwrap();
        let spec = match StepSpec::from_plan_with_mounts(
            7,
            &run_step(script, mounts),
            vec![self.root.clone()],
            upper.clone(),
            work,
            Duration::from_secs(120),
            inputs,
        ) {
            Ok(spec) => spec,
            // Refused while the mounts were resolved: nothing ran.
            Err(e) => {
                return Ran {
                    upper,
                    result: Err(e),
                    lines: vec![],
                };
            }
        };
        let exec = LinuxExecutor::new(ExecConfig {
            run_dir: self.run_dir.clone(),
            cgroup_parent: self.cgroup.clone(),
            ..ExecConfig::default()
        });
        let mut lines = Vec::new();
        let result = exec.run(&spec, &AtomicBool::new(false), &mut |l: LogLine| {
            lines.push(l.text)
        });
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mountinfo.contains(self.tmp.path().to_str().unwrap()),
            "mount left behind"
        );
        Ran {
            upper,
            result,
            lines,
        }
    }
}

/// Every path under `dir`, relative, sorted.
fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if e.file_type().unwrap().is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Whether any file under `dir` contains `needle`.
fn contains_bytes(dir: &Path, needle: &[u8]) -> bool {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                let b = fs::read(e.path()).unwrap();
                if b.windows(needle.len()).any(|w| w == needle) {
                    return true;
                }
            }
        }
    }
    false
}

fn bind(target: &str, source: &str, rw: bool) -> Mount {
    Mount::Bind {
        target: target.into(),
        source: source.into(),
        from: None,
        readwrite: rw,
    }
}

#[test]
fn binds_are_read_only_or_discarded_and_leave_no_trace() {
    let f = fixture("bind");
    let r = f.run(
        "ro",
        "cat /src/hello.txt; echo x > /src/new 2>/dev/null && echo WROTE; ls /ctx; echo done",
        vec![bind("/src", "src", false), bind("/ctx", "", false)],
    );
    r.result.unwrap();
    assert_eq!(r.lines[0], "hello from context");
    assert!(!r.lines.iter().any(|l| l == "WROTE"), "{:?}", r.lines);
    // .dockerignore applies to binds of the context.
    assert!(
        !r.lines.iter().any(|l| l.contains("ignored.txt")),
        "{:?}",
        r.lines
    );
    assert!(r.lines.iter().any(|l| l == "src"));
    assert_eq!(
        tree(&r.upper),
        Vec::<String>::new(),
        "mount points in the layer"
    );

    let r = f.run(
        "rw",
        "echo changed > /src/hello.txt && echo new > /src/new && cat /src/hello.txt",
        vec![bind("/src", "src", true)],
    );
    r.result.unwrap();
    assert_eq!(r.lines, vec!["changed"]);
    assert_eq!(
        fs::read_to_string(f.ctx.join("src/hello.txt")).unwrap(),
        "hello from context\n",
        "a rw bind wrote through to the context"
    );
    assert!(!f.ctx.join("src/new").exists());
    assert_eq!(tree(&r.upper), Vec::<String>::new());
}

#[test]
fn cache_persists_across_steps_and_stays_out_of_layers() {
    let f = fixture("cache");
    let cache = |sharing: &str| Mount::Cache {
        target: "/root/.cache/pkg".into(),
        id: "pkg".into(),
        sharing: sharing.into(),
        from: None,
        source: None,
        mode: 0o755,
        uid: 0,
        gid: 0,
        readonly: false,
    };
    let r = f.run(
        "c1",
        "echo cached > /root/.cache/pkg/f",
        vec![cache("shared")],
    );
    r.result.unwrap();
    assert_eq!(tree(&r.upper), Vec::<String>::new(), "cache in the layer");
    let r = f.run("c2", "cat /root/.cache/pkg/f", vec![cache("locked")]);
    r.result.unwrap();
    assert_eq!(r.lines, vec!["cached"]);
    let r = f.run("c3", "cat /root/.cache/pkg/f", vec![cache("private")]);
    r.result.unwrap();
    assert_eq!(r.lines, vec!["cached"]);
}

#[test]
fn tmpfs_is_sized_and_not_in_the_layer() {
    let f = fixture("tmpfs");
    let r = f.run(
        "t",
        "echo x > /scratch/a && cat /scratch/a && \
         (dd if=/dev/zero of=/scratch/big bs=1024 count=2048 2>/dev/null || echo FULL)",
        vec![Mount::Tmpfs {
            target: "/scratch".into(),
            size: Some(1 << 20),
        }],
    );
    r.result.unwrap();
    assert_eq!(r.lines, vec!["x", "FULL"]);
    assert_eq!(tree(&r.upper), Vec::<String>::new());
}

#[test]
fn secrets_reach_the_step_but_no_log_or_layer() {
    let f = fixture("secret");
    let secret = |target: Option<&str>, env: Option<&str>| Mount::Secret {
        id: "tok".into(),
        target: target.map(str::to_string),
        env: env.map(str::to_string),
        required: true,
        mode: 0o400,
        uid: 0,
        gid: 0,
    };
    let r = f.run(
        "s",
        "cat /run/secrets/tok; echo; echo \"env=$TOKEN\"; stat -c %a /run/secrets/tok; \
         { echo x > /run/secrets/tok; } 2>/dev/null || echo RO; \
         test \"$(cat /etc/app.key)\" = \"$TOKEN\" && echo SAME; echo keep > /kept",
        vec![
            secret(None, Some("TOKEN")),
            secret(None, None),
            secret(Some("/etc/app.key"), None),
        ],
    );
    r.result.unwrap();
    assert_eq!(r.lines, vec!["****", "env=****", "400", "RO", "SAME"]);
    assert!(!r.lines.iter().any(|l| l.contains(SECRET)));
    // A multi-line secret is redacted line by line.
    let k = f.run(
        "k",
        "cat /run/secrets/key; echo done",
        vec![Mount::Secret {
            id: "key".into(),
            target: None,
            env: None,
            required: true,
            mode: 0o400,
            uid: 0,
            gid: 0,
        }],
    );
    k.result.unwrap();
    assert_eq!(k.lines, vec!["****", "****", "****", "done"]);
    // Only what the step wrote itself is in the layer: no mount point, no secret.
    assert_eq!(tree(&r.upper), vec!["kept"]);
    assert!(!contains_bytes(&r.upper, SECRET.as_bytes()));
    // A required secret the build was not given.
    let e = StepSpec::from_plan_with_mounts(
        0,
        &run_step(
            "true",
            vec![Mount::Secret {
                id: "absent".into(),
                target: None,
                env: None,
                required: true,
                mode: 0o400,
                uid: 0,
                gid: 0,
            }],
        ),
        vec![],
        "/u".into(),
        "/w".into(),
        Duration::ZERO,
        &f.inputs(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("absent"), "{e}");
}

#[test]
fn hostile_sources_and_targets_stay_inside_their_roots() {
    let f = fixture("hostile");
    let host = f.tmp.path().join("host-only");
    fs::create_dir_all(&host).unwrap();
    fs::write(host.join("secret"), "HOST\n").unwrap();
    // The context holds an absolute symlink to a host directory, the image a symlink that
    // would lead a mount point out of the root.
    std::os::unix::fs::symlink(&host, f.ctx.join("evil")).unwrap();
    std::os::unix::fs::symlink(&host, f.root.join("out")).unwrap();
    let mut inputs = f.inputs();
    // Without .dockerignore patterns: the context is copied all the same (owned 0:0).
    inputs.context = Some((f.ctx.clone(), Dockerignore::default()));
    let r = f.run_with(
        "h",
        "cat /m/secret 2>/dev/null || echo NOPE; ls /up; echo planted > /out/x/f; echo ok",
        vec![
            bind("/m", "evil", false),
            bind("/up", "../../../..", false),
            Mount::Tmpfs {
                target: "/out/x".into(),
                size: None,
            },
        ],
        &inputs,
    );
    // The symlinked source resolves inside the context, where it names nothing: refused
    // when the context's part is copied, before anything runs.
    match r.result {
        Err(e @ ExecError::Mounts(_)) => assert!(e.to_string().contains("evil"), "{e}"),
        other => panic!("expected a mount error, got {other:?} {:?}", r.lines),
    }
    let r = f.run_with(
        "h2",
        "ls /up; echo planted > /out/x/f; echo ok",
        vec![
            bind("/up", "../../../..", false),
            Mount::Tmpfs {
                target: "/out/x".into(),
                size: None,
            },
        ],
        &inputs,
    );
    r.result.unwrap();
    // `../../..` is the context root itself.
    assert!(r.lines.iter().any(|l| l == "src"), "{:?}", r.lines);
    assert!(r.lines.iter().any(|l| l == "ok"));
    // The mount point went inside the root, never into the host directory.
    assert!(!host.join("x").exists());
    assert_eq!(fs::read_dir(&host).unwrap().count(), 1);
    assert_eq!(fs::metadata(host.join("secret")).unwrap().uid(), 0);
}

#[test]
fn single_file_binds_are_read_only_or_a_discarded_copy_and_leave_no_trace() {
    let f = fixture("filebind");
    fs::write(f.root.join("etc/existing"), "image's\n").unwrap();
    let r = f.run(
        "ro",
        "cat /etc/app.conf; (echo x > /etc/app.conf) 2>/dev/null && echo WROTE; cat /new/deep/f; \
         echo done",
        vec![
            bind("/etc/app.conf", "src/hello.txt", false),
            bind("/new/deep/f", "src/hello.txt", false),
        ],
    );
    r.result.unwrap();
    assert_eq!(
        r.lines,
        vec!["hello from context", "hello from context", "done"]
    );
    assert_eq!(
        tree(&r.upper),
        Vec::<String>::new(),
        "mount points in the layer"
    );

    // rw: the step writes to a copy, over a file of the image and on a new mount point.
    let r = f.run(
        "rw",
        "echo changed >> /etc/existing && cat /etc/existing && echo new > /n/rw && cat /n/rw",
        vec![
            bind("/etc/existing", "src/hello.txt", true),
            bind("/n/rw", "src/hello.txt", true),
        ],
    );
    r.result.unwrap();
    assert_eq!(r.lines, vec!["hello from context", "changed", "new"]);
    assert_eq!(
        fs::read_to_string(f.ctx.join("src/hello.txt")).unwrap(),
        "hello from context\n",
        "a rw bind wrote through to the context"
    );
    assert_eq!(
        fs::read_to_string(f.root.join("etc/existing")).unwrap(),
        "image's\n"
    );
    assert_eq!(tree(&r.upper), Vec::<String>::new());
}

#[test]
fn hostile_single_file_sources_and_targets_stay_inside_their_roots() {
    let f = fixture("filehostile");
    let host = f.tmp.path().join("host-only");
    fs::create_dir_all(&host).unwrap();
    fs::write(host.join("secret"), "HOST\n").unwrap();
    // An absolute symlink to a host file and one to a file of the context, both resolved
    // inside the context; an image symlink that would lead a mount point out of the root.
    std::os::unix::fs::symlink(host.join("secret"), f.ctx.join("evil")).unwrap();
    std::os::unix::fs::symlink("/src/hello.txt", f.ctx.join("good")).unwrap();
    std::os::unix::fs::symlink(&host, f.root.join("out")).unwrap();
    let mut inputs = f.inputs();
    inputs.context = Some((f.ctx.clone(), Dockerignore::default()));
    for rw in [false, true] {
        let r = f.run_with(
            &format!("evil-{rw}"),
            "cat /m; echo ok",
            vec![bind("/m", "evil", rw)],
            &inputs,
        );
        // Refused when the context's part is copied, before anything runs.
        match r.result {
            Err(e @ ExecError::Mounts(_)) => assert!(e.to_string().contains("evil"), "{e}"),
            other => panic!("expected a mount error, got {other:?} {:?}", r.lines),
        }
        let r = f.run_with(
            &format!("good-{rw}"),
            "cat /out/f; echo ok",
            vec![bind("/out/f", "good", rw)],
            &inputs,
        );
        r.result.unwrap();
        assert_eq!(r.lines, vec!["hello from context", "ok"]);
        assert_eq!(tree(&r.upper), Vec::<String>::new());
    }
    // The mount point went inside the root, never into the host directory.
    assert_eq!(fs::read_dir(&host).unwrap().count(), 1);
}
