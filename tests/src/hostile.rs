//! The hostile-step cases (issue 36): one list that the namespace executor's tests
//! (`builder/tests/exec.rs`, and as a build without root `kiln/tests/build_rootless.rs`,
//! with the same outcomes) and the microVM executor's (`kiln/tests/vm_step_restore.rs`)
//! all run, each as one busybox `sh` step that runs every case.
//!
//! Each case is a snippet that prints one line, `<name>: <outcome>`, and the outcome
//! expected of each executor. Where they differ it is because the wall differs:
//! - **namespace executor**: the step shares the host's kernel, so the kernel's own checks
//!   are the wall: Docker's capability set, its seccomp profile, read-only `/proc` files,
//!   a pid namespace and (issue 36) a user namespace whose map holds 65,536 ids. Every case
//!   is refused (on a host kernel without `/proc/sysrq-trigger`, as this CI host's, the
//!   sysrq case says `absent` there and proves nothing; see [`Case::host_needs`]).
//! - **microVM executor**: the step is root in a guest of its own, on the guest's kernel,
//!   and the VM is the wall. Mounting, loading a module (the guest kernel is asked) and
//!   writing `/proc/sysrq-trigger` (the guest's; the case writes `h`, which only prints the
//!   help to the guest's console) all work and touch only the guest; `chown` to uid 70000
//!   works too and the file stays in the step's layer, owned by 70000 (the image may say
//!   so; the host never gives the step that id). The host's processes and files are not in
//!   the guest at all.
//!
//! Every case also has the outcome it gives with nothing in the way: [`run_unconfined`]
//! runs the same script on the host as root (in a private mount namespace, so that its
//! mount goes away with it), and the namespace executor's test checks that it gives exactly
//! those outcomes before it runs the step: a case that cannot print its unconfined outcome
//! proves nothing when it prints the contained one.
//!
//! The host's side of the cases is a [`Target`]: a host process (the one to ptrace, and
//! whose `/proc/<pid>/root` leads to the host's root) and a host file holding a random
//! token that no step may print.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Which executor ran the step, or none (the host itself, as root).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    /// `kiln_builder::exec::LinuxExecutor`: host namespaces.
    Namespace,
    /// `kiln_pipeline::vmexec::VmExecutor`: a microVM per step.
    MicroVm,
    /// No executor: the script on the host as root ([`run_unconfined`]).
    Unconfined,
}

/// One hostile case. In `script` and the outcomes, `{dir}` is a directory the step may
/// write (made by the script), `{pid}` the host process's pid, `{tag}` a word in its
/// command line, `{file}` the host file's path and `{token}` its content (never in a
/// script).
pub struct Case {
    /// The first word of its line.
    pub name: &'static str,
    /// A busybox `sh` snippet printing one line, `<name>: <outcome>`.
    pub script: &'static str,
    /// The line a namespace step prints.
    pub namespace: &'static str,
    /// The line a microVM step prints.
    pub microvm: &'static str,
    /// The line it prints when nothing stands in the way.
    pub unconfined: &'static str,
    /// A path of the host's kernel the case needs: where the host lacks it, a namespace
    /// step and the unconfined run print `<name>: absent` instead (and the case proves
    /// nothing for the namespace executor on that host).
    pub host_needs: Option<&'static str>,
}

/// The cases, in the order of their lines.
pub const CASES: &[Case] = &[
    Case {
        name: "mount",
        script: "mkdir -p {dir}/mnt; \
                 if mount -t tmpfs none {dir}/mnt 2>/dev/null; \
                 then umount {dir}/mnt; echo 'mount: mounted'; \
                 else echo 'mount: refused'; fi",
        namespace: "mount: refused",
        microvm: "mount: mounted",
        unconfined: "mount: mounted",
        host_needs: None,
    },
    // A file that is no module: `init_module` fails in the kernel either way, so only the
    // error says whether the call was allowed (EPERM: refused, by the missing
    // CAP_SYS_MODULE and the seccomp profile) or went to the kernel's module loader
    // (ENOEXEC, or ENOSYS on a kernel without modules, as this CI host's).
    Case {
        name: "module",
        script: "echo junk > {dir}/m.ko; \
                 case \"$(insmod {dir}/m.ko 2>&1)\" in \
                 *'not permitted'*) echo 'module: refused';; \
                 *) echo 'module: not refused';; esac",
        namespace: "module: refused",
        microvm: "module: not refused",
        unconfined: "module: not refused",
        host_needs: None,
    },
    // busybox has no ptrace(2) applet; reading /proc/<pid>/mem takes the same access check
    // as PTRACE_ATTACH (PTRACE_MODE_ATTACH). The process must be the host's (its command
    // line holds the tag), not one of the step's or the guest's with the same number.
    Case {
        name: "ptrace",
        script: "if grep -q {tag} /proc/{pid}/cmdline 2>/dev/null; then \
                 a=$(sed -n '1s/-.*//p' /proc/{pid}/maps 2>/dev/null); \
                 if [ -n \"$a\" ] && [ \"$(dd if=/proc/{pid}/mem bs=1 count=1 skip=$((0x$a)) \
                 2>/dev/null | wc -c)\" = 1 ]; \
                 then echo 'ptrace: read host memory'; else echo 'ptrace: refused'; fi; \
                 else echo 'ptrace: no host process'; fi",
        namespace: "ptrace: no host process",
        microvm: "ptrace: no host process",
        unconfined: "ptrace: read host memory",
        host_needs: None,
    },
    // `h` prints the help to the kernel log and changes nothing. A kernel without
    // CONFIG_MAGIC_SYSRQ (this CI host's) has no such file, in a step or not.
    Case {
        name: "sysrq",
        script: "if [ ! -e /proc/sysrq-trigger ]; then echo 'sysrq: absent'; \
                 elif { echo h > /proc/sysrq-trigger; } 2>/dev/null; \
                 then echo 'sysrq: written'; else echo 'sysrq: refused'; fi",
        host_needs: Some("/proc/sysrq-trigger"),
        namespace: "sysrq: refused",
        microvm: "sysrq: written",
        unconfined: "sysrq: written",
    },
    // Through the host process's root, by the host path itself, and through the root of
    // every process the step can see.
    Case {
        name: "host-file",
        script: "t=$(cat /proc/{pid}/root{file} {file} /proc/[0-9]*/root{file} 2>/dev/null \
                 | head -n 1); \
                 if [ -n \"$t\" ]; then echo \"host-file: read $t\"; \
                 else echo 'host-file: unreadable'; fi",
        namespace: "host-file: unreadable",
        microvm: "host-file: unreadable",
        unconfined: "host-file: read {token}",
        host_needs: None,
    },
    // Outside a user namespace map of 65,536 ids (issue 36): EINVAL in the namespace
    // executor. In a microVM the guest kernel allows it and the file keeps uid 70000 in the
    // step's layer ([`CHOWNED`]).
    Case {
        name: "chown-70000",
        script: "echo x > {dir}/owned; \
                 if chown 70000:70000 {dir}/owned 2>/dev/null; \
                 then echo 'chown-70000: allowed'; else echo 'chown-70000: refused'; fi",
        namespace: "chown-70000: refused",
        microvm: "chown-70000: allowed",
        unconfined: "chown-70000: allowed",
        host_needs: None,
    },
];

/// The directory a step's script writes in (made by it): the file [`CHOWNED`] is in the
/// step's layer.
pub const STEP_DIR: &str = "/hostile";

/// The file the `chown-70000` case chowns, relative to the step's root.
pub const CHOWNED: &str = "hostile/owned";

/// The host's side of the cases: a host process and a host file with a random token.
/// Dropping it kills the process and removes the file.
pub struct Target {
    dir: tempfile::TempDir,
    child: Child,
    tag: String,
    token: String,
}

impl Target {
    /// Starts the host process (busybox `sh` waiting on its stdin, its tag as `$0`) and
    /// writes the host file.
    pub fn start() -> Target {
        let dir = tempfile::tempdir().expect("tempdir");
        let random = random_hex();
        let tag = format!("kiln-hostile-target-{random}");
        let token = format!("kiln-hostile-token-{}", random_hex());
        std::fs::write(dir.path().join("secret"), format!("{token}\n")).expect("write");
        let child = Command::new("busybox")
            .args(["sh", "-c", "read _", &tag])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("busybox (busybox-static) on the host");
        Target {
            dir,
            child,
            tag,
            token,
        }
    }

    /// The host process's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The host file's path.
    pub fn file(&self) -> PathBuf {
        self.dir.path().join("secret")
    }

    /// What the host file holds (no step may print it).
    pub fn token(&self) -> &str {
        &self.token
    }

    fn fill(&self, text: &str, dir: &str) -> String {
        text.replace("{dir}", dir)
            .replace("{pid}", &self.pid().to_string())
            .replace("{tag}", &self.tag)
            .replace("{file}", &self.file().display().to_string())
            .replace("{token}", &self.token)
    }

    /// The script of every case, in order, each in a subshell of its own; `dir` is where
    /// it writes ([`STEP_DIR`] in a step).
    pub fn script(&self, dir: &str) -> String {
        let mut s = format!("mkdir -p {dir}\n");
        for c in CASES {
            s.push_str(&format!("( {} )\n", self.fill(c.script, dir)));
        }
        assert!(!s.contains(&self.token), "a script holds the token");
        s
    }

    /// The lines `exec` must print, in order.
    pub fn expected(&self, exec: Executor) -> Vec<String> {
        CASES
            .iter()
            .map(|c| {
                let line = match exec {
                    Executor::Namespace => c.namespace,
                    Executor::MicroVm => c.microvm,
                    Executor::Unconfined => c.unconfined,
                };
                match c.host_needs {
                    Some(p) if exec != Executor::MicroVm && !Path::new(p).exists() => {
                        format!("{}: absent", c.name)
                    }
                    _ => self.fill(line, ""),
                }
            })
            .collect()
    }

    /// Asserts that a step (or [`run_unconfined`]) under `exec` printed exactly the
    /// expected lines and, for an executor, nothing holding the token.
    pub fn assert_lines(&self, exec: Executor, lines: &[String]) {
        let want = self.expected(exec);
        let got: Vec<&str> = lines.iter().map(String::as_str).collect();
        let want: Vec<&str> = want.iter().map(String::as_str).collect();
        assert_eq!(got, want, "hostile cases under {exec:?}");
        if exec != Executor::Unconfined {
            assert!(
                !lines.iter().any(|l| l.contains(&self.token)),
                "a step printed the host file's token: {lines:#?}"
            );
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs every case's script on the host as root, with busybox `sh` in a private mount
/// namespace (`unshare -m`) and a temporary directory for `{dir}`: what a step could do
/// with nothing in its way. Its output lines.
pub fn run_unconfined(target: &Target) -> Vec<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let scratch = dir.path().join("hostile");
    let script = target.script(&scratch.display().to_string());
    let o = crate::run_ok(
        Command::new("unshare")
            .args(["-m", "--propagation", "private", "busybox", "sh", "-c"])
            .arg(&script)
            .stdin(Stdio::null()),
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// 16 random bytes in hex, from the kernel.
fn random_hex() -> String {
    let mut b = [0u8; 16];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").expect("/dev/urandom"),
        &mut b,
    )
    .expect("read /dev/urandom");
    hex::encode(b)
}

/// For the microVM test: the owner of [`CHOWNED`] in a step's upper directory.
pub fn chowned_owner(upper: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::symlink_metadata(upper.join(CHOWNED))
        .unwrap_or_else(|e| panic!("{CHOWNED} in {}: {e}", upper.display()));
    (m.uid(), m.gid())
}
