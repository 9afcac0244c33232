//! e2fsprogs run without their syncs: a seccomp filter, installed in the child right before
//! `execve`, makes `fsync`, `fdatasync`, `syncfs`, `sync` and `sync_file_range` return 0
//! without doing anything (`SECCOMP_RET_ERRNO` with errno 0: the call is skipped and
//! returns 0, seccomp(2)).
//!
//! Why that is sound: every image this module writes is a scratch file. [`super::build`]'s
//! caller reads it (the publish chunks it into the store, whose pack commit makes the chunks
//! durable with its own fsync, [`kiln_store::artifact`]) and removes it; nothing relies on
//! the image's bytes being on disk, before or after a crash (a crash mid-publish leaves a
//! scratch file that no manifest names). A caller that keeps an image must sync it itself.
//!
//! Why it matters: mke2fs closes the image with `fsync` (libext2fs' `unix_flush`), which
//! forces the write-back of every data block it wrote, on the publish's critical path, and
//! `debugfs -w` and `e2fsck -fpD` sync again. Measured (2026-12-07, 2-core machine, the
//! peer's `apt` case, 325 MiB image, 254 MB of file data, `strace -T -e fsync mke2fs -d -`):
//! mke2fs's last `fsync` took 0.12–0.19 s of its 1.1 s. Without it the blocks are written
//! back later, or never when the scratch file is removed first.
//!
//! Best effort: where the filter cannot be built (an architecture seccompiler does not know)
//! or installed (seccomp unavailable), the tools run as before, syncs and all.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt as _;
use std::process::Command;
use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

/// The system calls the filter turns into no-ops.
const SYNCS: &[libc::c_long] = &[
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_syncfs,
    libc::SYS_sync,
    libc::SYS_sync_file_range,
];

/// The filter, compiled once per process (in the parent, before any fork); `None` where it
/// cannot be built.
fn filter() -> Option<&'static BpfProgram> {
    static FILTER: OnceLock<Option<BpfProgram>> = OnceLock::new();
    FILTER
        .get_or_init(|| {
            let arch = TargetArch::try_from(std::env::consts::ARCH).ok()?;
            let rules: BTreeMap<_, _> = SYNCS.iter().map(|&n| (n, Vec::new())).collect();
            let f = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(0), arch)
                .ok()?;
            f.try_into().ok()
        })
        .as_ref()
}

/// Makes `cmd`'s process (and whatever it starts) run with its syncs skipped, when the
/// filter exists; see the module doc.
pub(super) fn without_syncs(cmd: &mut Command) {
    let Some(prog) = filter() else { return };
    // SAFETY: the closure runs in the child between fork and exec. It only makes the
    // `prctl(PR_SET_NO_NEW_PRIVS)` and `seccomp` calls of `apply_filter` on a program built
    // before the fork (no allocation, no lock on success); a failure is ignored (the tool
    // then runs with its syncs), so nothing is allocated on that path either beyond the
    // error value, which is dropped at once.
    unsafe {
        cmd.pre_exec(move || {
            let _ = seccompiler::apply_filter(prog);
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process under the filter gets 0 from `sync` and `fsync` of a closed descriptor
    /// (which would fail with EBADF if the call ran), and its other calls run as usual.
    #[test]
    fn syncs_return_zero_without_running() {
        if filter().is_none() {
            eprintln!("no seccomp filter on this architecture; skipping");
            return;
        }
        let mut cmd = Command::new("python3");
        cmd.args([
            "-c",
            "import os; os.sync(); os.fsync(987); print('ran', os.getpid() > 0)",
        ]);
        without_syncs(&mut cmd);
        let out = cmd.output().expect("run python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ran True");
        // The control: without the filter, fsync of a closed descriptor fails.
        let out = Command::new("python3")
            .args(["-c", "import os; os.fsync(987)"])
            .output()
            .expect("run python3");
        assert!(!out.status.success());
    }
}
