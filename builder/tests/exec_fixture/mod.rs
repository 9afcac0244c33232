//! The step executor's test fixture, shared by `exec.rs` and `exec_network.rs`: a busybox
//! root filesystem from Debian's `busybox-static`, a fresh upper, work and run directory and
//! cgroup parent per test, and the checks that nothing is left behind.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kiln_builder::exec::{
    ExecConfig, ExecError, LinuxExecutor, LogLine, StepExecutor, StepReport, StepSpec,
};
use kiln_recipes::plan::Network;

pub const BUSYBOX: &str = "/usr/bin/busybox";
/// For [`helper_step_forever`]: where its fixture lives, and its cgroup parent.
pub const HELPER_TMP: &str = "KILN_EXEC_HELPER_TMP";
pub const HELPER_CGROUP: &str = "KILN_EXEC_HELPER_CGROUP";

pub struct Fixture {
    pub _tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub run_dir: PathBuf,
    pub cgroup_parent: String,
}

pub fn fixture(name: &str) -> Fixture {
    assert!(
        rustix::process::geteuid().is_root(),
        "the executor tests need root (CI runs them as root)"
    );
    assert!(
        Path::new(BUSYBOX).exists(),
        "{BUSYBOX} missing: run ci/setup.sh (installs busybox-static)"
    );
    let tmp = match std::env::var_os(HELPER_TMP) {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let root = tmp.path().join("rootfs");
    for d in ["bin", "etc", "home/alice", "tmp"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    fs::copy(BUSYBOX, root.join("bin/busybox")).unwrap();
    let list = std::process::Command::new(BUSYBOX)
        .arg("--list")
        .output()
        .unwrap();
    for applet in String::from_utf8(list.stdout).unwrap().lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
        }
    }
    fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000:Alice:/home/alice:/bin/sh\n",
    )
    .unwrap();
    fs::write(
        root.join("etc/group"),
        "root:x:0:\nalice:x:1000:\nwheel:x:10:alice\n",
    )
    .unwrap();
    std::os::unix::fs::chown(root.join("home/alice"), Some(1000), Some(1000)).unwrap();
    let upper = tmp.path().join("upper");
    let work = tmp.path().join("work");
    fs::create_dir(&upper).unwrap();
    fs::create_dir(&work).unwrap();
    let run_dir = tmp.path().join("run");
    Fixture {
        root,
        upper,
        work,
        run_dir,
        cgroup_parent: std::env::var(HELPER_CGROUP)
            .unwrap_or_else(|_| format!("kiln-test-{name}-{}", std::process::id())),
        _tmp: tmp,
    }
}

impl Fixture {
    pub fn config(&self) -> ExecConfig {
        ExecConfig {
            run_dir: self.run_dir.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            ..ExecConfig::default()
        }
    }

    pub fn spec(&self, script: &str) -> StepSpec {
        StepSpec {
            index: 7,
            lower_dirs: vec![self.root.clone()],
            layer_limits: Default::default(),
            upper_dir: self.upper.clone(),
            work_dir: self.work.clone(),
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![],
            user: None,
            workdir: "/".into(),
            files: vec![],
            network: Network::None,
            security: kiln_recipes::plan::Security::Sandbox,
            mounts: vec![],
            secrets: vec![],
            timeout: Duration::from_secs(120),
            log_budget: None,
        }
    }

    /// Runs and checks nothing is left behind.
    pub fn run_with(
        &self,
        config: ExecConfig,
        spec: &StepSpec,
        cancel: &AtomicBool,
    ) -> (Result<StepReport, ExecError>, Vec<String>) {
        let exec = LinuxExecutor::new(config);
        let mut lines = Vec::new();
        let r = exec.run(spec, cancel, &mut |l: LogLine| {
            assert_eq!(l.step, 7);
            lines.push(l.text)
        });
        self.assert_clean();
        (r, lines)
    }

    pub fn run(&self, spec: &StepSpec) -> (Result<StepReport, ExecError>, Vec<String>) {
        self.run_with(self.config(), spec, &AtomicBool::new(false))
    }

    pub fn assert_clean(&self) {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let tmp = self._tmp.path().to_str().unwrap();
        assert!(
            !mountinfo.contains(tmp),
            "mount left behind:\n{}",
            mountinfo
                .lines()
                .filter(|l| l.contains(tmp))
                .collect::<Vec<_>>()
                .join("\n")
        );
        // Every step cgroup removed, so no process is left in one.
        for ctrl in ["memory", "pids", "unified", ""] {
            let parent = Path::new("/sys/fs/cgroup")
                .join(ctrl)
                .join(&self.cgroup_parent);
            if let Ok(rd) = fs::read_dir(&parent) {
                let left: Vec<_> = rd
                    .flatten()
                    .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
                    .map(|e| e.path())
                    .collect();
                assert!(left.is_empty(), "cgroups left behind: {left:?}");
            }
        }
        assert!(
            fs::read_dir(&self.run_dir)
                .map(|rd| rd.count() == 0)
                .unwrap_or(true),
            "scratch left in the run directory"
        );
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for ctrl in ["memory", "pids", ""] {
            let _ = fs::remove_dir(
                Path::new("/sys/fs/cgroup")
                    .join(ctrl)
                    .join(&self.cgroup_parent),
            );
        }
    }
}

pub fn upper_entries(f: &Fixture) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(&f.upper)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The Debian bookworm minbase fixture (ci/fixtures.sh), unpacked with umoci under `f`.
pub fn debian_root(f: &Fixture) -> PathBuf {
    let layout = std::env::var("KILN_TEST_DEBIAN_OCI")
        .expect("KILN_TEST_DEBIAN_OCI unset: run ci/setup.sh (ci/fixtures.sh) and source /var/cache/kiln-ci/env");
    let bundle = f._tmp.path().join("bundle");
    let out = std::process::Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:bookworm", layout.trim_end_matches('/')))
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
