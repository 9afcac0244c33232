//! Build-step limits on a pure cgroup v2 host: the test hosts are hybrid (cgroup v1
//! controllers), so the v2 side of `kiln_builder::exec::cgroup` runs here inside a guest
//! (TCG), whose init mounts only cgroup2 at `/sys/fs/cgroup`. The guest image is the busybox
//! fixture with this kiln binary, the C libraries it links and an inner build context; `kiln
//! build` run in the clone must stop a step at its memory limit and name the limit (issue 14,
//! "cgroup v2 limits have never run").
//! Needs what `ci/setup.sh` exports (`KILN_TEST_BUSYBOX_OCI`, the guest kernel).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_store::{Store, TagRef};
use kiln_tests::vm::{StopClones, kiln_in, oci_image, show, sleeping_sandbox, started_id};

fn kiln(dir: &Path, args: &[&str]) -> Output {
    kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
        .args(args)
        .output()
        .expect("run kiln")
}

/// Copies `from` to the same absolute path under `root`.
fn copy_into(root: &Path, from: &Path) {
    let to = root.join(from.strip_prefix("/").expect("absolute path"));
    std::fs::create_dir_all(to.parent().expect("parent")).expect("mkdir");
    std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
}

/// The shared libraries `bin` loads (ldd(1)'s absolute paths), the dynamic loader among them.
fn libraries(bin: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(bin).output().expect("run ldd");
    assert!(out.status.success(), "ldd {}", bin.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// The guest's user who builds without root.
const USER: &str = "builder";

#[test]
fn a_memory_limit_stops_a_step_on_a_pure_cgroup2_guest() {
    assert!(
        rustix::process::geteuid().is_root(),
        "VM tests need root (CI runs them as root)"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let kiln_bin = Path::new(env!("CARGO_BIN_EXE_kiln"));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let store = Store::open(d.join("store").to_str().expect("utf-8"))
            .await
            .expect("store");
        let tag: TagRef = "cg2:latest".parse().expect("tag");
        let bb = "KILN_TEST_BUSYBOX_OCI";
        // The first call unpacks the fixture's root under `d`; the second makes the image of
        // that root with kiln and the inner context added.
        oci_image(&store, d, bb, "latest", 64, &tag, sleeping_sandbox()).await;
        let root = d.join("rootfs-kiln_test_busybox_oci");
        let inside = root.join("usr/local/bin/kiln");
        std::fs::create_dir_all(inside.parent().expect("parent")).expect("mkdir");
        std::fs::copy(kiln_bin, &inside).expect("copy kiln");
        for lib in libraries(kiln_bin) {
            copy_into(&root, &lib);
        }
        // A host that runs kiln's steps in a user namespace has subordinate ids for it
        // (issue 36; ci/setup.sh writes the same lines on the test host), and a user who
        // builds without root has a range of its own and the setuid `newuidmap` and
        // `newgidmap` (Debian's `uidmap`, which setup installs on the test host).
        for f in ["etc/subuid", "etc/subgid"] {
            std::fs::write(
                root.join(f),
                format!("kiln:100000:65536\n{USER}:200000:65536\n"),
            )
            .expect("subordinate ids");
        }
        for (f, line) in [
            (
                "etc/passwd",
                format!("{USER}:x:1000:1000:{USER}:/home/{USER}:/bin/sh\n"),
            ),
            ("etc/group", format!("{USER}:x:1000:\n")),
        ] {
            let mut text = std::fs::read_to_string(root.join(f)).expect("read");
            text.push_str(&line);
            std::fs::write(root.join(f), text).expect("write");
        }
        let home = root.join("home").join(USER);
        std::fs::create_dir_all(&home).expect("mkdir");
        std::os::unix::fs::chown(&home, Some(1000), Some(1000)).expect("chown home");
        for tool in ["newuidmap", "newgidmap"] {
            let bin = Path::new("/usr/bin").join(tool);
            copy_into(&root, &bin);
            std::fs::set_permissions(
                root.join("usr/bin").join(tool),
                std::os::unix::fs::PermissionsExt::from_mode(0o4755),
            )
            .expect("setuid");
            for lib in libraries(&bin) {
                copy_into(&root, &lib);
            }
        }
        let inner = root.join("inner");
        std::fs::create_dir_all(&inner).expect("mkdir");
        let status = Command::new("cp")
            .arg("-a")
            .arg(kiln_tests::require_env(bb))
            .arg(inner.join("busybox-oci"))
            .status()
            .expect("cp");
        assert!(status.success(), "copy the OCI layout");
        // The fixture's files are root's alone (0600); the user builds from them too.
        let status = Command::new("chmod")
            .args(["-R", "a+rX"])
            .arg(&inner)
            .status()
            .expect("chmod");
        assert!(status.success(), "chmod the OCI layout");
        // dd allocates its whole block at once and fills it: 256 MiB of anonymous memory
        // passes the limit at once (a hog that grows slowly, like `tail` of /dev/zero, spent
        // over 200 s under TCG in the kernel's reclaim before the OOM kill). The same step
        // with an 8 MiB block fits.
        // The step prints its cgroup (`0::/<path>`) for the rootless builds.
        for (name, block) in [("hog", "256M"), ("fits", "8M")] {
            std::fs::write(
                inner.join(format!("{name}.yaml")),
                format!(
                    "from: bb\nnetwork: none\nlimits: {{memory: 48MiB}}\ncommands:\n  \
                     - echo step-started && cat /proc/self/cgroup \
                     && dd if=/dev/zero of=/dev/null bs={block} count=1\n"
                ),
            )
            .expect("recipe");
        }
        oci_image(&store, d, bb, "latest", 512, &tag, sleeping_sandbox()).await;
    });
    let o = kiln(
        d,
        &[
            "snapshot",
            "cg2:latest",
            "-t",
            "cg2:snap",
            "--memory-mib",
            "512",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    let _stop = StopClones::new(env!("CARGO_BIN_EXE_kiln"), d);
    let o = kiln(d, &["--json", "start", "cg2:snap"]);
    assert!(o.status.success(), "{}", show(&o));
    let id = started_id(&o);

    // The guest's only cgroup hierarchy is cgroup2.
    let o = kiln(
        d,
        &[
            "exec",
            "-u",
            "root",
            &id,
            "--",
            "sh",
            "-c",
            "grep cgroup /proc/mounts",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    let mounts = String::from_utf8_lossy(&o.stdout).into_owned();
    let kinds: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    assert_eq!(kinds, ["cgroup2"], "{mounts}");

    let build = |recipe: &str| {
        kiln(
            d,
            &[
                "exec",
                "-u",
                "root",
                &id,
                "--",
                "sh",
                "-c",
                // The store and scratch on the guest's ext4 disk, not its /tmp: the guest
                // kernel (6.1) cannot show a tmpfs through an idmapped mount (Linux 6.3+),
                // which the steps' user namespace needs.
                &format!(
                    "mkdir -p /var/kiln/tmp && KILN_STORE=/var/kiln/store TMPDIR=/var/kiln/tmp \
                     kiln build -f /inner/{recipe}.yaml \
                     --oci-only --progress plain \
                     --build-context bb=oci-layout:///inner/busybox-oci:latest /inner"
                ),
            ],
        )
    };
    let o = build("fits");
    assert!(
        o.status.success(),
        "a step under the limit builds: {}",
        show(&o)
    );
    let o = build("hog");
    let text = show(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("step-started"), "the step ran: {text}");
    assert!(text.contains(&limit_hit()), "{text}");

    // Issue 36: a build without root, by a user whose cgroup is delegated to it the way
    // systemd's `Delegate=yes` does (the directory, `cgroup.procs`, `cgroup.subtree_control`
    // and `cgroup.threads` chowned), gets its limits in that cgroup. `nopids` is delegated
    // under a parent that gives it `memory` alone.
    let o = root_sh(
        d,
        &id,
        "set -e; cg=/sys/fs/cgroup; echo '+memory +pids' > $cg/cgroup.subtree_control; \
         mkdir $cg/outer; echo +memory > $cg/outer/cgroup.subtree_control; \
         for g in deleg outer/nopids; do mkdir $cg/$g; \
           for f in '' cgroup.procs cgroup.subtree_control cgroup.threads; do \
             chown 1000:1000 $cg/$g/$f; done; done",
    );
    assert!(o.status.success(), "{}", show(&o));
    // Each build into a store of its own, so that none is a cache hit. `cgroup`: where
    // root puts the user's shell first, `None` for the group `kiln exec` made for it.
    let rootless = |cgroup: Option<&str>, recipe: &str, store: &str| {
        let join = cgroup
            .map(|g| format!("echo $$ > /sys/fs/cgroup/{g}/cgroup.procs && "))
            .unwrap_or_default();
        root_sh(
            d,
            &id,
            &format!(
                "{join}exec su {USER} -c 'mkdir -p $HOME/tmp && KILN_STORE=$HOME/{store} \
                 TMPDIR=$HOME/tmp kiln build -f /inner/{recipe}.yaml --oci-only \
                 --progress plain --build-context bb=oci-layout:///inner/busybox-oci:latest \
                 /inner'"
            ),
        )
    };
    let warning = "steps run without their memory and pids limits";
    let o = rootless(Some("deleg"), "fits", "s1");
    let text = show(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("0::/deleg/kiln/step-"),
        "the step ran in a group under the delegated cgroup: {text}"
    );
    assert!(!text.contains(warning), "{text}");
    // The first build moved the cgroup's processes into `deleg/init` and enabled the
    // controllers, so no process may join `deleg` itself any more (the no-internal-process
    // rule): a shell there started again in the leaf, and a build from it uses `deleg` too.
    let o = rootless(Some("deleg/init"), "hog", "s2");
    let text = show(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("0::/deleg/kiln/step-"), "{text}");
    assert!(text.contains(&limit_hit()), "{text}");
    // kiln moved the cgroup's processes into its leaf, and left no step group behind.
    let o = root_sh(
        d,
        &id,
        "cd /sys/fs/cgroup/deleg && cat cgroup.subtree_control cgroup.procs && find kiln -mindepth 1 -type d",
    );
    assert!(o.status.success(), "{}", show(&o));
    let listing = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(listing.trim(), "memory pids", "{listing}");

    // Not delegated: kiln's own group belongs to root. Delegated without `pids`: the
    // warning names the controller. Both build, without limits.
    let o = rootless(None, "fits", "s3");
    let text = show(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains(warning) && text.contains("is not delegated to this user"),
        "{text}"
    );
    let o = rootless(Some("outer/nopids"), "fits", "s4");
    let text = show(&o);
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains(warning) && text.contains("without the pids controller"),
        "{text}"
    );
}

/// What kiln says when a step passes its 48 MiB memory limit.
fn limit_hit() -> String {
    format!("memory limit of 48 MiB ({} bytes) exceeded", 48u64 << 20)
}

/// Runs `script` with `sh -c` as root in clone `id`.
fn root_sh(dir: &Path, id: &str, script: &str) -> Output {
    kiln(dir, &["exec", "-u", "root", id, "--", "sh", "-c", script])
}
