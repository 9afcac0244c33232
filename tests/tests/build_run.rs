//! The build driver (`kiln_builder::build`) as root on the busybox and Debian fixtures of
//! `ci/setup.sh`, pulled from the test registry: RUN, WORKDIR, USER, ENV, heredocs, the
//! cache, the sandbox preparation layer, failures and limits, and that nothing (mount,
//! scratch directory) is left behind.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_builder::build::{BuildError, BuildEvent, BuildOptions, BuildOutput, build};
use kiln_builder::cache::{BlobCache as _, LocalCache};
use kiln_builder::exec::ExecError;
use kiln_builder::registry::RegistryOptions;
use kiln_builder::resolve::ResolveOptions;
use kiln_tests::require_env;

struct Fx {
    tmp: tempfile::TempDir,
    cache: Arc<LocalCache>,
    store: kiln_store::Store,
    rt: tokio::runtime::Runtime,
    cgroup: String,
}

fn fx(name: &str) -> Fx {
    assert!(
        rustix::process::geteuid().is_root(),
        "the build tests need root (CI runs them as root)"
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("store");
    let cache = Arc::new(LocalCache::open(&root).expect("cache"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt
        .block_on(kiln_store::Store::open(root.to_str().expect("utf-8")))
        .expect("store");
    Fx {
        tmp,
        cache,
        store,
        rt,
        cgroup: format!("kiln-test-build-{name}-{}", std::process::id()),
    }
}

impl Fx {
    fn work(&self) -> PathBuf {
        self.tmp.path().join("work")
    }

    fn ctx(&self) -> PathBuf {
        self.tmp.path().join("ctx")
    }

    /// Writes `files` (path, content) into the build context.
    fn write_ctx(&self, files: &[(&str, &str)]) {
        for (p, c) in files {
            let path = self.ctx().join(p);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, c).expect("write");
        }
    }

    fn options(&self) -> BuildOptions {
        let mut o = BuildOptions::new(self.work());
        o.exec.run_dir = self.tmp.path().join("run");
        o.exec.cgroup_parent = self.cgroup.clone();
        let ctx = self.ctx();
        std::fs::create_dir_all(&ctx).expect("mkdir");
        let ignore = match std::fs::read(ctx.join(".dockerignore")) {
            Ok(b) => kiln_recipes::dockerignore::Dockerignore::parse(".dockerignore", &b)
                .expect("dockerignore"),
            Err(_) => Default::default(),
        };
        o.context = Some((ctx, ignore));
        o
    }

    /// Plans, resolves and builds `text` (named `file`).
    fn build_with(
        &self,
        file: &str,
        text: &str,
        opts: &BuildOptions,
        edit: impl FnOnce(&mut kiln_recipes::BuildPlan),
    ) -> (Result<BuildOutput, BuildError>, Vec<BuildEvent>) {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = {
            let e = events.clone();
            Arc::new(move |ev: BuildEvent| e.lock().expect("lock").push(ev))
        };
        let resolve = ResolveOptions {
            registry: RegistryOptions {
                docker_config: Some("/nonexistent/kiln-test/config.json".into()),
                ..Default::default()
            },
            work_dir: self.tmp.path().join("bootstrap"),
            ..Default::default()
        };
        let r = self.rt.block_on(async {
            let (mut plan, bases) = kiln_builder::resolve::resolve_recipe(
                file,
                text.as_bytes(),
                &kiln_recipes::Options::default(),
                &resolve,
                self.cache.as_ref(),
            )
            .await?;
            edit(&mut plan);
            build(&plan, &bases, self.cache.clone(), &self.store, opts, sink).await
        });
        let ev = events.lock().expect("lock").clone();
        (r, ev)
    }

    fn build(&self, text: &str) -> (Result<BuildOutput, BuildError>, Vec<BuildEvent>) {
        self.build_with("Dockerfile", text, &self.options(), |_| {})
    }

    /// Unpacks the built image (all layers, whiteouts applied) into a fresh directory.
    fn unpack(&self, out: &BuildOutput) -> PathBuf {
        let dir = self.tmp.path().join(format!(
            "unpacked-{}",
            &out.image.oci_manifest.digest.hex()[..12]
        ));
        kiln_builder::base::unpack(
            self.cache.as_ref(),
            &out.image.oci_manifest.digest,
            &dir,
            &Default::default(),
        )
        .expect("unpack the built image");
        dir
    }

    /// No mount under the test directory, no scratch directory left, no cgroup left.
    fn assert_clean(&self) {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let t = self.tmp.path().to_str().expect("utf-8");
        assert!(!mounts.contains(t), "a mount is left under {t}:\n{mounts}");
        let layers = self.work().join("layers");
        if let Ok(rd) = std::fs::read_dir(&layers) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                assert!(!n.contains(".tmp-"), "scratch directory left: {n}");
            }
        }
        for h in [
            "/sys/fs/cgroup/memory",
            "/sys/fs/cgroup/pids",
            "/sys/fs/cgroup",
        ] {
            let p = Path::new(h).join(&self.cgroup);
            if let Ok(rd) = std::fs::read_dir(&p) {
                let steps = rd
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .count();
                assert_eq!(steps, 0, "step cgroups left under {}", p.display());
            }
        }
    }
}

impl Drop for Fx {
    fn drop(&mut self) {
        for h in [
            "/sys/fs/cgroup/memory",
            "/sys/fs/cgroup/pids",
            "/sys/fs/cgroup",
        ] {
            let _ = std::fs::remove_dir(Path::new(h).join(&self.cgroup));
        }
    }
}

fn ran(events: &[BuildEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            BuildEvent::Step {
                instruction,
                cached: false,
                ..
            } if instruction.starts_with("RUN") => Some(instruction.clone()),
            _ => None,
        })
        .collect()
}

fn logs(events: &[BuildEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            BuildEvent::Log(l) => Some(l.text.clone()),
            _ => None,
        })
        .collect()
}

fn busybox_dockerfile() -> String {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    format!(
        r#"FROM {bb}
ENV GREETING=hello
RUN echo "$GREETING" > /greeting && echo 'bob:x:1234:1234::/home/bob:/bin/sh' >> /etc/passwd \
 && echo 'bob:x:1234:' >> /etc/group && rm /bin/vi && mkdir -p /opq/sub && touch /opq/old
RUN rm -rf /opq && mkdir /opq && touch /opq/new
USER bob
WORKDIR /work/dir
RUN <<EOF
set -e
echo "uid=$(id -u) pwd=$(pwd) greeting=$GREETING" > seen
echo built
EOF
ENTRYPOINT ["/bin/sh"]
CMD ["-c", "cat /work/dir/seen"]
LABEL org.example=yes
EXPOSE 8080
STOPSIGNAL SIGINT
"#
    )
}

/// RUN, ENV, USER, WORKDIR and a heredoc over busybox; deletions reach the image as
/// whiteouts; the sandbox layer is last; a second build runs nothing and gives the same
/// digest; the exported layout passes skopeo and umoci.
#[test]
fn busybox_steps_cache_and_export() {
    let f = fx("busybox");
    let text = busybox_dockerfile();
    let (r, ev) = f.build(&text);
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    f.assert_clean();
    assert_eq!(ran(&ev).len(), 3, "{ev:?}");
    assert!(logs(&ev).contains(&"built".to_string()), "{ev:?}");
    assert_eq!(out.stats.steps_run, 4, "3 RUN + 1 WORKDIR");

    let root = f.unpack(&out);
    let read =
        |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    assert_eq!(read("greeting"), "hello\n");
    assert_eq!(
        read("work/dir/seen"),
        "uid=1234 pwd=/work/dir greeting=hello\n"
    );
    assert!(!root.join("bin/vi").exists(), "deleted file whited out");
    assert!(root.join("bin/ls").exists());
    assert!(root.join("opq/new").exists() && !root.join("opq/old").exists());
    assert!(
        !root.join("opq/sub").exists(),
        "opaque directory hides the lower's"
    );
    assert_eq!(read("etc/hostname"), "runtime-guest\n");
    assert_eq!(read("etc/machine-id"), "");
    assert!(
        read("etc/hosts").contains("127.0.1.1\truntime-guest\n"),
        "the hostname resolves: {}",
        read("etc/hosts")
    );
    {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(root.join("work/dir")).expect("workdir");
        assert_eq!(md.uid(), 1234, "WORKDIR after USER is owned by the user");
    }

    let c = &out.config;
    assert_eq!(c.config.user.as_deref(), Some("bob"));
    assert_eq!(c.config.working_dir.as_deref(), Some("/work/dir"));
    assert!(
        c.config
            .env
            .as_ref()
            .is_some_and(|e| e.contains(&"GREETING=hello".to_string())
                && e.iter().any(|v| v.starts_with("PATH="))),
        "{:?}",
        c.config.env
    );
    assert_eq!(
        c.config.entrypoint.as_deref(),
        Some(&["/bin/sh".to_string()][..])
    );
    assert_eq!(c.config.stop_signal.as_deref(), Some("SIGINT"));
    assert!(
        c.config
            .exposed_ports
            .as_ref()
            .is_some_and(|p| p.contains_key("8080/tcp"))
    );
    assert!(c.created.is_none(), "no build time in the config");
    assert_eq!(c.rootfs.diff_ids.len(), out.image.layers.len());
    let last = c.history.last().expect("history");
    assert!(
        last.created_by
            .as_deref()
            .is_some_and(|s| s.contains("sandbox preparation"))
    );
    assert!(
        c.history
            .iter()
            .any(|h| h.created_by.as_deref() == Some("WORKDIR /work/dir"))
    );

    // Second identical build: nothing runs, same digest.
    let (r2, ev2) = f.build(&text);
    let out2 = r2.unwrap_or_else(|e| panic!("second build: {e}"));
    assert!(ran(&ev2).is_empty(), "{ev2:?}");
    assert_eq!(out2.stats.steps_run, 0);
    assert_eq!(
        out2.image.oci_manifest.digest,
        out.image.oci_manifest.digest
    );

    // --no-cache runs everything again; --no-cache-filter on another stage does not.
    let mut o = f.options();
    o.no_cache_filter = vec!["other".into()];
    let (r3, ev3) = f.build_with("Dockerfile", &text, &o, |_| {});
    r3.expect("filtered build");
    assert!(ran(&ev3).is_empty());
    let mut o = f.options();
    o.no_cache = true;
    let (r4, ev4) = f.build_with("Dockerfile", &text, &o, |_| {});
    r4.expect("no-cache build");
    assert_eq!(ran(&ev4).len(), 3);
    f.assert_clean();

    // Export as an OCI layout; skopeo and umoci accept it.
    let layout = f.tmp.path().join("layout");
    let exported = kiln_builder::layout::export(
        f.cache.as_ref(),
        &out.image.oci_manifest.digest,
        &layout,
        "t",
        Default::default(),
    )
    .expect("export");
    // The steps' zstd layers are gzipped in the layout (issue 34): a manifest of its own.
    assert_ne!(exported, out.image.oci_manifest.digest);
    let o = std::process::Command::new("skopeo")
        .args(["inspect", &format!("oci:{}:t", layout.display())])
        .output()
        .expect("skopeo missing: run ci/setup.sh");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let inspected: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(inspected["Digest"], exported.to_string());
    let bundle = f.tmp.path().join("bundle");
    let o = std::process::Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:t", layout.display()))
        .arg(&bundle)
        .output()
        .expect("umoci missing: run ci/setup.sh");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(bundle.join("rootfs/work/dir/seen")).expect("seen"),
        "uid=1234 pwd=/work/dir greeting=hello\n"
    );
    assert!(!bundle.join("rootfs/bin/vi").exists());
}

/// A failing RUN names its file:line, exit code and last lines; nothing is left behind.
#[test]
fn failing_run_reports_location_exit_code_and_tail() {
    let f = fx("fail");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let text = format!("FROM {bb}\nRUN echo ok\nRUN echo one; echo two; exit 3\nRUN echo never\n");
    let (r, ev) = f.build(&text);
    let e = r.expect_err("must fail");
    assert_eq!(e.exit_code(), Some(3), "{e}");
    let msg = e.to_string();
    assert!(msg.starts_with("Dockerfile:3: RUN"), "{msg}");
    assert!(
        msg.contains("exited with code 3") && msg.contains("\n  two"),
        "{msg}"
    );
    assert!(!ran(&ev).iter().any(|r| r.contains("never")));
    assert!(
        f.rt.block_on(f.store.list_leases())
            .expect("leases")
            .is_empty(),
        "a failed build releases its lease"
    );
    f.assert_clean();
}

/// Issue 44 §1: a step starts with no signal ignored or blocked (kiln's runtime ignores
/// SIGPIPE), so `yes | head` ends when `head` does instead of spinning until the timeout.
#[test]
fn steps_start_with_default_signals() {
    let f = fx("signals");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (r, _) = f.build_with(
        "Dockerfile",
        &format!(
            "FROM {bb}\nRUN grep -E '^Sig(Blk|Ign):' /proc/self/status > /signals && \
             yes line | head -c 10000000 > /lines\n"
        ),
        &f.options(),
        |p| p.limits.timeout_secs = 60,
    );
    let out = r.expect("builds within the timeout");
    let dir = f.unpack(&out);
    assert_eq!(
        std::fs::read_to_string(dir.join("signals")).expect("signals"),
        "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"
    );
    assert_eq!(
        std::fs::metadata(dir.join("lines")).expect("lines").len(),
        10_000_000
    );
    f.assert_clean();
}

/// Issue 44 §2: a step writing 256 MiB of zeros (real blocks, as `dd if=/dev/zero`
/// writes them) builds. Its layer compresses past 1,000:1 and is read back three ways: as
/// the lower of the next step, as a stage tree for `COPY --from`, and by unpacking the
/// image; a ratio bound refused it from 64 MiB on.
#[test]
fn step_writing_256_mib_of_zeros_builds() {
    let f = fx("zeros");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (r, _) = f.build_with(
        "Dockerfile",
        &format!(
            "FROM {bb} AS z\nRUN dd if=/dev/zero of=/big bs=1M count=256\n\
             RUN test \"$(wc -c < /big)\" -eq 268435456\n\
             FROM {bb}\nCOPY --from=z /big /copied\n"
        ),
        &f.options(),
        |p| p.limits.timeout_secs = 300,
    );
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    let dir = f.unpack(&out);
    assert_eq!(
        std::fs::metadata(dir.join("copied")).expect("copied").len(),
        256 << 20
    );
    f.assert_clean();
}

/// The build timeout kills the step; the error names the limit.
#[test]
fn timeout_stops_the_build() {
    let f = fx("timeout");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (r, _) = f.build_with(
        "Dockerfile",
        &format!("FROM {bb}\nRUN sleep 600\n"),
        &f.options(),
        |p| p.limits.timeout_secs = 2,
    );
    let e = r.expect_err("must time out");
    assert!(matches!(e, BuildError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("timeout of 2s"), "{e}");
    f.assert_clean();
}

/// A step over the build's memory limit is killed and the error says so.
#[test]
fn memory_limit_is_named() {
    let f = fx("memory");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (r, _) = f.build_with(
        "Dockerfile",
        &format!("FROM {bb}\nRUN dd if=/dev/zero of=/dev/null bs=256M count=1\n"),
        &f.options(),
        |p| p.limits.memory_mib = 64,
    );
    let e = r.expect_err("must hit the limit");
    assert!(
        matches!(
            e,
            BuildError::Step {
                error: ExecError::MemoryLimit { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("memory limit"), "{e}");
    f.assert_clean();
}

/// Cancelling (what SIGINT/SIGTERM do in `kiln build`) kills the running step.
#[test]
fn cancel_stops_the_build() {
    let f = fx("cancel");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let o = f.options();
    let flag = o.cancel.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        flag.store(true, Ordering::Relaxed);
    });
    let (r, ev) = f.build_with(
        "Dockerfile",
        &format!("FROM {bb}\nRUN echo started; sleep 600\n"),
        &o,
        |_| {},
    );
    setter.join().expect("setter");
    assert!(matches!(r, Err(BuildError::Cancelled)), "{r:?}");
    assert!(logs(&ev).contains(&"started".to_string()));
    f.assert_clean();
}

/// A YAML recipe and the Dockerfile it corresponds to give the same image digest.
#[test]
fn yaml_recipe_matches_dockerfile() {
    let f = fx("yaml");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let docker = format!("FROM {bb}\nENV A=1\nRUN echo \"$A\" > /a\n");
    let yaml = format!("from: {bb}\nenv:\n  A: \"1\"\ncommands:\n  - echo \"$A\" > /a\n");
    let (r1, _) = f.build(&docker);
    let d1 = r1.unwrap_or_else(|e| panic!("dockerfile: {e}"));
    let (r2, ev2) = f.build_with("recipe.yaml", &yaml, &f.options(), |_| {});
    let d2 = r2.unwrap_or_else(|e| panic!("yaml: {e}"));
    assert_eq!(d1.image.oci_manifest.digest, d2.image.oci_manifest.digest);
    assert!(ran(&ev2).is_empty(), "the same step: a cache hit");
    // Where the recipe lies does not change its digest.
    let (r3, _) = f.build_with("/some/other/dir/Dockerfile", &docker, &f.options(), |_| {});
    let d3 = r3.unwrap_or_else(|e| panic!("dockerfile: {e}"));
    assert_eq!(d3.image.recipe_digest, d1.image.recipe_digest);
    assert_eq!(d3.image.oci_manifest, d1.image.oci_manifest);
    // Each build holds a lease on what it made until the caller releases it.
    let leases = f.rt.block_on(f.store.list_leases()).expect("leases");
    assert_eq!(leases.len(), 3, "{leases:?}");
    let hex = &d3.image.oci_manifest.digest.hex();
    assert!(
        leases
            .iter()
            .all(|l| l.objects.iter().any(|o| o.ends_with(hex))),
        "{leases:?}"
    );
    for d in [&d1, &d2, &d3] {
        f.rt.block_on(d.lease.release()).expect("release");
    }
    assert!(
        f.rt.block_on(f.store.list_leases())
            .expect("leases")
            .is_empty()
    );
}

fn steps(events: &[BuildEvent]) -> Vec<(String, bool)> {
    events
        .iter()
        .filter_map(|e| match e {
            BuildEvent::Step {
                instruction,
                cached,
                ..
            } => Some((instruction.clone(), *cached)),
            _ => None,
        })
        .collect()
}

/// COPY from the context with `--chown`/`--chmod` and `.dockerignore`; changing one
/// context file invalidates the steps from its COPY on, and only those.
#[test]
fn context_copy_and_invalidation() {
    let f = fx("copy");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    f.write_ctx(&[
        ("f.txt", "one\n"),
        ("dir/a", "A\n"),
        ("secret.txt", "do not copy\n"),
        (".dockerignore", "secret.txt\n"),
    ]);
    let text = format!(
        "FROM {bb}\nRUN echo first > /first\nCOPY --chmod=0600 --chown=1234:1234 f.txt /data/f.txt\n\
         COPY dir /ctx/dir/\nCOPY . /all/\nRUN cat /data/f.txt > /data/g.txt\n"
    );
    let (r, ev) = f.build(&text);
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    assert!(steps(&ev).iter().all(|(_, c)| !c), "{ev:?}");
    let root = f.unpack(&out);
    {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(root.join("data/f.txt")).expect("f.txt");
        assert_eq!(
            (md.mode() & 0o7777, md.uid(), md.gid()),
            (0o600, 1234, 1234)
        );
    }
    assert_eq!(
        std::fs::read_to_string(root.join("data/g.txt")).expect("g"),
        "one\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("ctx/dir/a")).expect("a"),
        "A\n"
    );
    assert!(root.join("all/f.txt").exists());
    assert!(
        !root.join("all/secret.txt").exists(),
        ".dockerignore applies"
    );

    // Touching a file without changing it changes nothing.
    f.write_ctx(&[("dir/a", "A\n")]);
    let (r, ev) = f.build(&text);
    assert_eq!(
        r.expect("rebuild").image.oci_manifest.digest,
        out.image.oci_manifest.digest
    );
    assert!(steps(&ev).iter().all(|(_, c)| *c), "{ev:?}");

    f.write_ctx(&[("f.txt", "two\n")]);
    let (r, ev) = f.build(&text);
    let out2 = r.unwrap_or_else(|e| panic!("rebuild: {e}"));
    let cached: Vec<bool> = steps(&ev).iter().map(|(_, c)| *c).collect();
    // RUN first, COPY f.txt, COPY dir, COPY ., RUN cat, sandbox layer.
    assert_eq!(cached, [true, false, false, false, false, false], "{ev:?}");
    let root = f.unpack(&out2);
    assert_eq!(
        std::fs::read_to_string(root.join("data/g.txt")).expect("g"),
        "two\n"
    );
    f.assert_clean();
}

/// `COPY --link` (issue 41): the layer holds the copied files and their parent directories
/// only, copied onto an empty root (a symlink of the image at the destination is not
/// followed, as BuildKit documents), and its cache key has no parent: a new base below it
/// keeps the same layer as a cache hit, while the steps after it run again. `--chown` with
/// a name is refused, as BuildKit refuses it.
#[test]
fn copy_link_layer_is_independent_of_the_layers_below() {
    use std::os::unix::fs::MetadataExt;
    let f = fx("link");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    f.write_ctx(&[("f.txt", "linked\n"), ("dir/a", "A\n")]);
    let text = |base: &str| {
        format!(
            "FROM {bb}\nRUN echo {base} > /base && ln -s /tmp /dest\n\
             COPY --link --chown=1234:root --chmod=0640 f.txt /dest/f.txt\n\
             COPY --link dir /opt/app/\n\
             RUN cat /opt/app/a /dest/f.txt /base > /seen\n"
        )
    };
    let (r, ev) = f.build(&text("one"));
    let one = r.unwrap_or_else(|e| panic!("build: {e}"));
    assert!(steps(&ev).iter().all(|(_, c)| !c), "{ev:?}");
    let root = f.unpack(&one);
    assert_eq!(
        std::fs::read_to_string(root.join("seen")).expect("seen"),
        "A\nlinked\none\n"
    );
    // The image's symlink at the destination was replaced, not followed.
    assert!(root.join("dest").symlink_metadata().expect("dest").is_dir());
    assert!(!root.join("tmp/f.txt").exists());
    let md = std::fs::metadata(root.join("dest/f.txt")).expect("f.txt");
    assert_eq!((md.mode() & 0o7777, md.uid(), md.gid()), (0o640, 1234, 0));
    let md = std::fs::metadata(root.join("opt")).expect("opt");
    assert_eq!((md.mode() & 0o7777, md.uid()), (0o755, 0));

    // A new layer below: the linked layers are hits with the same digests, the rest runs.
    let (r, ev) = f.build(&text("two"));
    let two = r.unwrap_or_else(|e| panic!("rebuild: {e}"));
    let cached: Vec<bool> = steps(&ev).iter().map(|(_, c)| *c).collect();
    // RUN, COPY --link, COPY --link, RUN cat, sandbox layer.
    assert_eq!(cached, [false, true, true, false, false], "{ev:?}");
    let (l1, l2) = (&one.image.layers, &two.image.layers);
    let n = l1.len();
    assert_eq!(l2.len(), n);
    assert_eq!(l1[n - 4..n - 2], l2[n - 4..n - 2], "the linked layers");
    assert_ne!(l1[n - 5], l2[n - 5]);
    assert_ne!(l1[n - 2], l2[n - 2], "the step after them ran again");
    assert_eq!(
        std::fs::read_to_string(f.unpack(&two).join("seen")).expect("seen"),
        "A\nlinked\ntwo\n"
    );

    let (r, _) = f.build(&format!("FROM {bb}\nCOPY --link --chown=nobody f.txt /f\n"));
    let e = r.expect_err("a name with --link").to_string();
    assert!(
        e.contains("Dockerfile:2") && e.contains("--chown=nobody"),
        "{e}"
    );
    // A copied file named as a whiteout would delete /bin from the image (found by the
    // attack pass): the layer writer refuses it, with or without --link.
    for link in ["", "--link "] {
        let (r, _) = f.build(&format!("FROM {bb}\nCOPY {link}f.txt /.wh.bin\n"));
        let e = r.expect_err("a whiteout name").to_string();
        assert!(
            e.contains("/.wh.bin") && e.contains("marks a deletion"),
            "{e}"
        );
    }
    f.assert_clean();
}

/// Independent stages build at once (--jobs 2); COPY --from takes each one's tree.
#[test]
fn multi_stage_copy_from() {
    let f = fx("stages");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let text = format!(
        "FROM {bb} AS a\nRUN echo A > /a.txt && rm /bin/vi\nFROM {bb} AS b\nRUN echo B > /b.txt\n\
         FROM a\nCOPY --from=b /b.txt /out/\nCOPY --from=a /a.txt /out/\nCOPY --from={bb} /bin/vi /out/vi\n\
         RUN cat /out/a.txt /out/b.txt\n"
    );
    let (r, ev) = f.build(&text);
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    let l = logs(&ev);
    assert!(
        l.contains(&"A".to_string()) && l.contains(&"B".to_string()),
        "{l:?}"
    );
    let root = f.unpack(&out);
    assert_eq!(
        std::fs::read_to_string(root.join("out/b.txt")).expect("b"),
        "B\n"
    );
    assert!(!root.join("bin/vi").exists(), "FROM a keeps a's whiteout");
    assert!(root.join("out/vi").exists(), "COPY --from=<image>");
    f.assert_clean();
}

/// A stage on another stage: its plan config holds only what it sets (issue 44 §3), and
/// the image config it builds is still its base stage's with its own settings over it:
/// env by key (a variable set again keeps its place), user, working directory, CMD,
/// labels and ports inherited; the start command has the whole config.
#[test]
fn stage_on_stage_builds_its_base_stages_config() {
    let f = fx("stageconfig");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (r, _) = f.build(&format!(
        "FROM {bb} AS base\nENV A=1 B=1\nUSER 1234\nWORKDIR /app\nCMD [\"run\"]\n\
         LABEL l=base\nEXPOSE 80\nFROM base AS mid\nENV B=2 C=2\nLABEL m=mid\n\
         FROM mid\nEXPOSE 81\nRUN echo \"$A$B$C\" > seen\n"
    ));
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    let c = &out.config.config;
    let env = c.env.clone().unwrap_or_default();
    let mine: Vec<&String> = env.iter().filter(|e| !e.starts_with("PATH=")).collect();
    assert_eq!(mine, ["A=1", "B=2", "C=2"], "{env:?}");
    assert_eq!(c.user.as_deref(), Some("1234"));
    assert_eq!(c.working_dir.as_deref(), Some("/app"));
    assert_eq!(c.cmd.as_deref(), Some(&["run".to_string()][..]));
    let labels = c.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("l").map(String::as_str), Some("base"));
    assert_eq!(labels.get("m").map(String::as_str), Some("mid"));
    let ports = c.exposed_ports.clone().unwrap_or_default();
    assert!(
        ports.contains_key("80/tcp") && ports.contains_key("81/tcp"),
        "{ports:?}"
    );
    let start = out.image.sandbox.start.clone().expect("a start command");
    assert_eq!(start.argv, ["run"]);
    assert!(start.env.contains(&"C=2".to_string()), "{:?}", start.env);
    assert_eq!(start.workdir.as_deref(), Some("/app"));
    let root = f.unpack(&out);
    assert_eq!(
        std::fs::read_to_string(root.join("app/seen")).expect("seen"),
        "122\n"
    );
    f.assert_clean();
}

/// A secret given to the build reaches its RUN --mount and appears in no log and no layer.
#[test]
fn secret_in_no_layer_and_no_log() {
    let f = fx("secret");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let value = "s3cr3t-kiln-value-42";
    let mut o = f.options();
    o.secrets.insert(
        "tok",
        kiln_builder::secrets::SecretValue::new(value.as_bytes().to_vec()),
    );
    let text = format!(
        "FROM {bb}\nRUN --mount=type=secret,id=tok cat /run/secrets/tok; echo; \
         test \"$(cat /run/secrets/tok)\" = {value} && echo present\n"
    );
    let (r, ev) = f.build_with("Dockerfile", &text, &o, |_| {});
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    let l = logs(&ev);
    assert!(l.contains(&"present".to_string()), "{l:?}");
    assert!(!l.iter().any(|x| x.contains(value)), "{l:?}");
    for d in &out.image.layers {
        let p = f.cache.blob_path(&d.digest).expect("ok").expect("layer");
        let mut raw = Vec::new();
        std::io::Read::read_to_end(
            &mut kiln_builder::build::lower::decompressed(std::fs::File::open(p).expect("open"))
                .expect("decompress"),
            &mut raw,
        )
        .expect("decompress");
        assert!(
            !raw.windows(value.len()).any(|w| w == value.as_bytes()),
            "secret in layer {}",
            d.digest
        );
    }
    let root = f.unpack(&out);
    assert!(!root.join("run/secrets/tok").exists());
    f.assert_clean();
}

/// A C program compiled with gcc on Debian (installed with apt-get from Debian's mirror
/// through the default network) and copied into a busybox stage.
#[test]
fn gcc_multi_stage_into_busybox() {
    let f = fx("gcc");
    let deb = require_env("KILN_TEST_DEBIAN_REF");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    f.write_ctx(&[(
        "hello.c",
        "#include <stdio.h>\nint main(void) { puts(\"hello from gcc\"); return 0; }\n",
    )]);
    let text = format!(
        "FROM {deb} AS build\n\
         RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null\n\
         COPY hello.c /src/\nRUN gcc -static -O2 -o /hello /src/hello.c\n\
         FROM {bb}\nCOPY --from=build /hello /usr/local/bin/hello\nRUN hello\n"
    );
    let (r, ev) = f.build(&text);
    let out = r.unwrap_or_else(|e| panic!("build: {e}"));
    assert!(
        logs(&ev).contains(&"hello from gcc".to_string()),
        "{:?}",
        logs(&ev)
    );
    let root = f.unpack(&out);
    assert!(root.join("usr/local/bin/hello").is_file());
    assert!(
        !root.join("usr/bin/gcc").exists(),
        "only the busybox stage is in the image"
    );
    f.assert_clean();
}

/// The log limit holds for the whole build, not per step: a later step gets what is left.
#[test]
fn log_budget_is_build_wide() {
    let f = fx("logs");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let mut o = f.options();
    o.exec.log_limits.total_max = 3000;
    // Each step prints 100 lines of 20 bytes (2100 bytes with newlines).
    let text = format!(
        "FROM {bb}\nRUN seq 100 | sed 's/^/first-step-line-/' | cut -c1-20\n\
         RUN seq 100 | sed 's/^/second-step-line-/' | cut -c1-20\n"
    );
    let (r, ev) = f.build_with("Dockerfile", &text, &o, |_| {});
    r.unwrap_or_else(|e| panic!("build: {e}"));
    let l = logs(&ev);
    let total: usize = l.iter().map(|x| x.len() + 1).sum();
    assert!(total <= 3000 + 64, "{total} bytes of log");
    assert_eq!(
        l.iter().filter(|x| x.starts_with("first-step")).count(),
        100
    );
    assert!(l.iter().filter(|x| x.starts_with("second-step")).count() < 100);
    assert!(
        l.iter()
            .any(|x| x == kiln_builder::exec::logs::LOG_TRUNCATED),
        "{l:?}"
    );
}

/// Issue 17, case 1: one layer digest twice in a stage's lowers ("overlayfs: conflicting
/// lowerdir path", ELOOP at the next RUN). `RUN true` three times gives three identical empty
/// layers; two `WORKDIR /src` change nothing the second time; a step re-creating what an
/// earlier one wrote gives that layer again.
#[test]
fn identical_layers_in_one_stage_do_not_break_the_next_run() {
    let f = fx("identical-layers");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (r, ev) = f.build(&format!(
        "FROM {bb}\nRUN true\nRUN true\nRUN true\nWORKDIR /src\nWORKDIR /src\n\
         RUN echo x > /f\nRUN rm /f\nRUN echo x > /f\nRUN test \"$(cat /f)\" = x && pwd > /where\n"
    ));
    let out = r.unwrap_or_else(|e| panic!("build: {e}\n{}", logs(&ev).join("\n")));
    let root = f.unpack(&out);
    assert_eq!(
        std::fs::read_to_string(root.join("where")).expect("/where"),
        "/src\n"
    );
    assert_eq!(std::fs::read_to_string(root.join("f")).expect("/f"), "x\n");
    f.assert_clean();
}

/// The network modes through the whole builder: a YAML recipe's allow-list reaches each
/// command's step (busybox `wget` honours `http_proxy`) with the build's address policy
/// (`fetch.addresses`, the one ADD uses) handed to the proxy, and refusals land in the build
/// log; a build-wide `none` or allow-list (`BuildOptions::network`) overrides a
/// Dockerfile's default network.
#[test]
fn network_allow_list_and_build_wide_modes_reach_the_steps() {
    use kiln_recipes::plan::{Egress, EgressRule, Network};
    let f = fx("egress");
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let server = kiln_tests::http::LocalServer::start();
    let port = server.port;
    let mut o = f.options();
    o.fetch.addresses.allow_private_addresses = true;
    for n in ["pkg.test", "other.test"] {
        o.fetch
            .addresses
            .hosts
            .insert(n.into(), vec![std::net::Ipv4Addr::LOCALHOST.into()]);
    }
    let fetch = |name: &str, path: &str| {
        format!("wget -q -O- http://{name}:{port}/{path} || echo {path}-refused")
    };
    let yaml = format!(
        "from: {bb}\ncommands:\n  - {}\n  - {}\nnetwork:\n  allow: [pkg.test]\n",
        fetch("pkg.test", "yaml"),
        fetch("other.test", "yaml-other")
    );
    let (r, ev) = f.build_with("recipe.yaml", &yaml, &o, |_| {});
    r.unwrap_or_else(|e| panic!("yaml: {e}"));
    let l = logs(&ev);
    assert!(l.iter().any(|x| x == "hello /yaml"), "{l:#?}");
    assert!(l.iter().any(|x| x == "yaml-other-refused"), "{l:#?}");
    assert!(
        l.iter()
            .any(|x| *x == format!("egress: refused GET other.test:{port}: not on the allow list")),
        "{l:#?}"
    );

    let docker = format!("FROM {bb}\nRUN {}\n", fetch("pkg.test", "docker"));
    o.network = Some(Network::None);
    let (r, ev) = f.build_with("Dockerfile", &docker, &o, |_| {});
    r.unwrap_or_else(|e| panic!("none: {e}"));
    let l = logs(&ev);
    assert!(l.iter().any(|x| x == "docker-refused"), "{l:#?}");
    o.network = Some(Network::Allow(Egress {
        allow: vec![EgressRule::parse("pkg.test").expect("rule")],
        deny: vec![],
    }));
    // The build-wide mode is part of the step's cache key: the `none` build's layer (whose
    // fetch failed) is not reused, the step runs again and reaches the server.
    let (r, ev) = f.build_with("Dockerfile", &docker, &o, |_| {});
    r.unwrap_or_else(|e| panic!("allow: {e}"));
    assert_eq!(ran(&ev).len(), 1, "{:#?}", steps(&ev));
    let l = logs(&ev);
    assert!(l.iter().any(|x| x == "hello /docker"), "{l:#?}");
    // And the same build again is a cache hit.
    let (r, ev) = f.build_with("Dockerfile", &docker, &o, |_| {});
    r.unwrap_or_else(|e| panic!("allow again: {e}"));
    assert!(ran(&ev).is_empty(), "{:#?}", steps(&ev));
    let seen = server.seen.lock().expect("lock").clone();
    assert_eq!(
        seen,
        vec![
            format!("GET /yaml HTTP/1.1 host=pkg.test:{port}"),
            format!("GET /docker HTTP/1.1 host=pkg.test:{port}"),
        ]
    );
    f.assert_clean();
}
