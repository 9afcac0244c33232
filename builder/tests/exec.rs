//! The real step executor as root on a busybox root filesystem built from Debian's
//! `busybox-static` (installed by `ci/setup.sh`): effects, isolation, limits, and that
//! nothing (mount, process, cgroup) is left behind on any outcome.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kiln_builder::exec::userns::StepUserns;
use kiln_builder::exec::{ExecError, LinuxExecutor, StepExecutor};
use kiln_recipes::plan::InlineFile;

mod exec_fixture;

use exec_fixture::*;

#[test]
fn write_lands_in_upper_and_mount_points_do_not() {
    let f = fixture("upper");
    let (r, lines) = f.run(&f.spec("echo hello > /out.txt && echo done"));
    let report = r.unwrap();
    assert_eq!(lines, vec!["done"]);
    assert_eq!(
        fs::read_to_string(f.upper.join("out.txt")).unwrap(),
        "hello\n"
    );
    // proc, sys, dev and etc/hosts were created as mount points; none is in the layer.
    assert_eq!(upper_entries(&f), vec!["out.txt"]);
    assert!(report.written_bytes >= 6);
    // The lower layer is untouched.
    assert!(!f.root.join("out.txt").exists());
}

/// Issue 36: by default a step runs in a user namespace mapped to the subordinate ids of
/// `kiln` (`ci/setup.sh` writes `kiln:100000:65536`), not as host root, and what it writes
/// keeps the image's owners on disk: root's files are uid 0 in the upper directory, alice's
/// 1000, a copied-up base file its base owner. With `KILN_STEP_USERNS=host` the map is the
/// host's own.
#[test]
fn steps_run_in_a_user_namespace_and_keep_the_image_owners() {
    let f = fixture("userns");
    let mut spec = f.spec(
        "cat /proc/self/uid_map /proc/self/gid_map; id -u; \
         echo r > /by-root; echo a > /by-alice; chown alice:wheel /by-alice; \
         echo more >> /home/alice/.profile; stat -c '%u %g' /home/alice",
    );
    fs::write(f.root.join("home/alice/.profile"), "x\n").unwrap();
    std::os::unix::fs::chown(f.root.join("home/alice/.profile"), Some(1000), Some(1000)).unwrap();
    let (r, lines) = f.run(&spec);
    r.unwrap();
    let squash = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    let lines: Vec<String> = lines.iter().map(|l| squash(l)).collect();
    assert_eq!(
        lines,
        vec!["0 100000 65536", "0 100000 65536", "0", "1000 1000"],
        "the step's map (ci/setup.sh's kiln:100000:65536)"
    );
    let owner = |p: &str| {
        let md = fs::symlink_metadata(f.upper.join(p)).unwrap();
        (md.uid(), md.gid())
    };
    assert_eq!(owner("by-root"), (0, 0));
    assert_eq!(owner("by-alice"), (1000, 10));
    assert_eq!(owner("home/alice/.profile"), (1000, 1000));
    assert_eq!(owner("home/alice"), (1000, 1000));

    fs::remove_dir_all(&f.upper).unwrap();
    fs::create_dir(&f.upper).unwrap();
    spec.argv[2] = "cat /proc/self/uid_map; echo r > /by-root".into();
    let mut host = f.config();
    host.userns = StepUserns::Host;
    let (r, lines) = f.run_with(host, &spec, &AtomicBool::new(false));
    r.unwrap();
    assert_eq!(
        lines.iter().map(|l| squash(l)).collect::<Vec<_>>(),
        vec!["0 0 4294967295"]
    );
    assert_eq!(owner("by-root"), (0, 0));
}

/// Issue 36: no subordinate range for the configured name fails before the step runs, with
/// an error naming the file, the name and how to add a range; a `USER` outside the map
/// fails naming the id.
#[test]
fn a_missing_subordinate_range_or_a_user_outside_the_map_is_a_clear_error() {
    let f = fixture("userns-missing");
    let mut cfg = f.config();
    cfg.userns = StepUserns::Subids("kiln-no-such-user".into());
    let (r, lines) = f.run_with(cfg, &f.spec("echo RAN"), &AtomicBool::new(false));
    let e = r.unwrap_err().to_string();
    assert!(lines.is_empty(), "{lines:?}");
    for part in [
        "/etc/subuid",
        "no range for \"kiln-no-such-user\"",
        "usermod --add-subuids",
        "KILN_STEP_USERNS=host",
    ] {
        assert!(e.contains(part), "{part:?} not in: {e}");
    }
    let mut spec = f.spec("echo RAN");
    spec.user = Some("70000".into());
    let (r, lines) = f.run(&spec);
    let e = r.unwrap_err().to_string();
    assert!(lines.is_empty(), "{lines:?}");
    assert!(
        e.contains("id 70000 is outside the step's user namespace, which maps ids 0-65535"),
        "{e}"
    );
}

/// Issue 36: a cache or SSH mount owned by an id past the user namespace's map fails before
/// the step runs, as a secret's does, instead of giving the step a cache it cannot write
/// (shown as 65534) or a socket it cannot open; with `KILN_STEP_USERNS=host` the same cache
/// is made with its owner.
#[test]
fn a_cache_mount_owned_outside_the_map_is_a_clear_error() {
    use kiln_builder::exec::mounts::{CacheMount, CacheSharing, MountKind, StepMount};
    let f = fixture("userns-cache-owner");
    let cache = f._tmp.path().join("cache");
    let mut spec = f.spec("touch /c/x && echo WROTE");
    spec.mounts = vec![StepMount {
        target: "/c".into(),
        kind: MountKind::Cache(CacheMount {
            dir: cache.clone(),
            sharing: CacheSharing::Shared,
            readonly: false,
            mode: 0o700,
            uid: 70000,
            gid: 70001,
        }),
    }];
    let (r, lines) = f.run(&spec);
    let e = r.unwrap_err().to_string();
    assert!(lines.is_empty(), "{lines:?}");
    assert!(
        e.contains("/c: owner 70000:70001 is outside the step's user namespace (ids 0-65535)"),
        "{e}"
    );
    let mut host = f.config();
    host.userns = StepUserns::Host;
    let (r, lines) = f.run_with(host, &spec, &AtomicBool::new(false));
    r.unwrap();
    assert_eq!(lines, ["WROTE"]);
}

#[test]
fn user_workdir_env() {
    let f = fixture("user");
    let mut spec = f.spec("id -u; id -g; id -G; pwd; echo \"$FOO|$HOME|$PATH\"; touch here");
    spec.user = Some("alice".into());
    spec.workdir = "/work/a/b".into();
    spec.env = vec!["FOO=1".into(), "FOO=bar baz".into()];
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(
        lines,
        vec![
            "1000",
            "1000",
            "1000 10",
            "/work/a/b",
            "bar baz|/home/alice|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ]
    );
    for d in ["work", "work/a", "work/a/b"] {
        let md = fs::metadata(f.upper.join(d)).unwrap();
        assert_eq!((md.uid(), md.gid()), (1000, 1000), "{d}");
    }
    assert_eq!(
        fs::metadata(f.upper.join("work/a/b/here")).unwrap().uid(),
        1000
    );

    // A numeric user unknown to /etc/passwd runs with gid = uid.
    let f = fixture("user2");
    let mut spec = f.spec("id -u; id -g");
    spec.user = Some("4242".into());
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines, vec!["4242", "4242"]);

    // A FIFO as /etc/passwd (a hostile base) is no user database: never opened for
    // reading, which would block until the step's time limit.
    let f = fixture("user-fifo");
    fs::remove_file(f.root.join("etc/passwd")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        f.root.join("etc/passwd"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let mut spec = f.spec("cat /proc/self/status | grep ^Uid: | cut -f2");
    spec.user = Some("4343".into());
    spec.timeout = std::time::Duration::from_secs(20);
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines, vec!["4343"]);

    // An unknown name is a setup error naming it.
    let f = fixture("user3");
    let mut spec = f.spec("true");
    spec.user = Some("mallory".into());
    let (r, _) = f.run(&spec);
    let e = r.unwrap_err();
    assert!(
        matches!(e, ExecError::Setup(ref m) if m.contains("mallory")),
        "{e}"
    );
}

#[test]
fn exec_form_heredoc_files_hostname_dev() {
    let f = fixture("exec");
    let mut spec = f.spec("");
    spec.argv = vec!["sh".into(), "/dev/pipes/EOF".into()];
    spec.files = vec![InlineFile {
        name: "EOF".into(),
        data: "hostname\nls /dev | tr '\\n' ' '\necho\necho x > /dev/null && echo null-ok\n".into(),
        path: Some("/dev/pipes/EOF".into()),
        mode: 0o644,
    }];
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines[0], "runtime-guest");
    for d in [
        "full", "null", "pts", "ptmx", "random", "shm", "tty", "urandom", "zero", "pipes",
    ] {
        assert!(
            lines[1].split(' ').any(|x| x == d),
            "{d} missing: {}",
            lines[1]
        );
    }
    assert_eq!(lines[2], "null-ok");
    // Heredoc files live on /dev's tmpfs, not in the layer.
    assert!(upper_entries(&f).is_empty(), "{:?}", upper_entries(&f));
}

#[test]
fn failing_command_reports_exit_code_and_tail() {
    let f = fixture("fail");
    let (r, _) = f.run(&f.spec("echo before; echo oops >&2; exit 3"));
    match r {
        Err(ExecError::Failed { exit_code, tail }) => {
            assert_eq!(exit_code, 3);
            assert_eq!(tail, vec!["before", "oops"]);
        }
        other => panic!("{other:?}"),
    }
    let f = fixture("notfound");
    let mut spec = f.spec("");
    spec.argv = vec!["no-such-program".into()];
    let (r, _) = f.run(&spec);
    assert!(matches!(r, Err(ExecError::Setup(ref m)) if m.contains("no-such-program")));
}

#[test]
fn capabilities_no_new_privs_and_read_only_kernel_interfaces() {
    let f = fixture("caps");
    let (r, lines) = f.run(&f.spec(
        "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status | tr -s '\\t ' ' '; \
         cat /proc/sys/kernel/hostname; \
         w() { if [ ! -e \"$1\" ]; then echo \"$2-absent\"; \
               elif { echo \"$3\" > \"$1\"; } 2>/dev/null; then echo \"$2-WRITABLE\"; \
               else echo \"$2-ro\"; fi; }; \
         w /sys/kernel/rcu_expedited sys \"$(cat /sys/kernel/rcu_expedited 2>/dev/null)\"; \
         w /proc/sys/vm/swappiness procsys \"$(cat /proc/sys/vm/swappiness 2>/dev/null)\"; \
         w /proc/sysrq-trigger sysrq h; \
         mount -t tmpfs none /tmp 2>/dev/null && echo MOUNTED || echo no-mount",
    ));
    r.unwrap();
    // Each write puts back the value the file has (harmless if it ever worked), or `h`
    // (sysrq's help). The step sees the host's kernel: a file this kernel lacks (this CI
    // host's has no /proc/sysrq-trigger, no CONFIG_MAGIC_SYSRQ) is `absent` in the step too,
    // and that line then proves nothing.
    let ro = |path: &str, name: &str| {
        if Path::new(path).exists() {
            format!("{name}-ro")
        } else {
            format!("{name}-absent")
        }
    };
    assert_eq!(
        lines,
        vec![
            "CapInh: 00000000a80425fb".to_string(),
            "CapPrm: 00000000a80425fb".into(),
            "CapEff: 00000000a80425fb".into(),
            "CapBnd: 00000000a80425fb".into(),
            "CapAmb: 0000000000000000".into(),
            "NoNewPrivs: 1".into(),
            "runtime-guest".into(),
            ro("/sys/kernel/rcu_expedited", "sys"),
            ro("/proc/sys/vm/swappiness", "procsys"),
            ro("/proc/sysrq-trigger", "sysrq"),
            "no-mount".into(),
        ]
    );
    let f = fixture("caps2");
    let mut spec = f.spec("grep -E '^(CapEff|CapBnd)' /proc/self/status | tr -s '\\t ' ' '");
    spec.user = Some("alice".into());
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(
        lines,
        vec!["CapEff: 0000000000000000", "CapBnd: 00000000a80425fb"]
    );
}

/// Issue 41: `RUN --security=insecure` (BuildKit's `security.insecure` entitlement) is
/// refused unless the executor allows it; allowed, the step has every capability the kernel
/// has (ambient too, so also as another user), no seccomp filter, no no_new_privs, writable
/// /proc/sys and /sys, and can mount, which the default set cannot.
#[test]
fn security_insecure_needs_the_entitlement_and_gives_every_capability() {
    use kiln_recipes::plan::Security;
    // Every capability this (root) process has: all the kernel knows where nothing
    // narrowed the bounding set.
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let all = status
        .lines()
        .find_map(|l| l.strip_prefix("CapPrm:"))
        .unwrap()
        .trim()
        .to_string();
    let f = fixture("insecure");
    let mut spec = f.spec(
        "grep -E '^(CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status | tr -s '\\t ' ' '; \
         grep -q ' /proc/sys ' /proc/self/mountinfo && echo procsys-ro || echo procsys-writable; \
         awk '$5 == \"/sys\" { print \"sys\", substr($6, 1, 2) }' /proc/self/mountinfo; \
         mount -t tmpfs none /tmp && echo MOUNTED || echo no-mount; \
         test -c /dev/fuse && echo fuse-node",
    );
    spec.security = Security::Insecure;
    let (r, lines) = f.run(&spec);
    assert!(matches!(r, Err(ExecError::InsecureRefused)), "{r:?}");
    assert!(lines.is_empty());
    assert!(
        ExecError::InsecureRefused
            .to_string()
            .contains("--allow security.insecure")
    );
    let mut cfg = f.config();
    cfg.allow_insecure = true;
    let (r, lines) = f.run_with(cfg.clone(), &spec, &AtomicBool::new(false));
    r.unwrap();
    assert_eq!(
        lines,
        vec![
            format!("CapEff: {all}"),
            format!("CapBnd: {all}"),
            format!("CapAmb: {all}"),
            "NoNewPrivs: 0".into(),
            "Seccomp: 0".into(),
            "procsys-writable".into(),
            "sys rw".into(),
            "MOUNTED".into(),
            "fuse-node".into(),
        ]
    );
    // Another user keeps them (ambient), as under runc.
    let f = fixture("insecure2");
    let mut spec = f.spec("grep -E '^CapEff:' /proc/self/status | tr -s '\\t ' ' '; id -u");
    spec.security = Security::Insecure;
    spec.user = Some("alice".into());
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap();
    assert_eq!(lines, vec![format!("CapEff: {all}"), "1000".into()]);
}

/// Issue 14, part 3: every step runs under Docker's default seccomp profile
/// (`builder/src/exec/seccomp.rs`). What the capabilities alone leave open is closed: a
/// user namespace (no capability needed, the door to most container escapes through kernel
/// bugs) and a namespace flag to `clone`; a chroot (CAP_SYS_CHROOT's rule) and ordinary
/// processes still work.
#[test]
fn steps_run_under_dockers_default_seccomp_profile() {
    let f = fixture("seccomp");
    let (r, lines) = f.run(&f.spec(
        "grep -E '^Seccomp:' /proc/self/status | tr -s '\\t ' ' '; \
         unshare -U true 2>/dev/null && echo USERNS || echo no-userns; \
         unshare -n true 2>/dev/null && echo NETNS || echo no-netns; \
         unshare -p -f true 2>/dev/null && echo PIDNS || echo no-pidns; \
         chroot / true && echo chroot-ok; \
         sh -c 'echo child-ok' & wait",
    ));
    r.unwrap();
    assert_eq!(
        lines,
        vec![
            "Seccomp: 2",
            "no-userns",
            "no-netns",
            "no-pidns",
            "chroot-ok",
            "child-ok",
        ]
    );
}

/// Issue 14, part 3, hostile steps on the namespace executor: loading or removing a kernel
/// module, swapping, rebooting, renaming the host, entering another namespace and signalling
/// a host process all fail, and the step goes on (a reboot that worked would have killed
/// its pid namespace). Capabilities and the seccomp profile both stand in the way; either
/// alone makes these fail.
#[test]
fn hostile_steps_cannot_load_modules_reboot_or_reach_host_processes() {
    let f = fixture("hostile");
    let host_pid = std::process::id();
    let host_name = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let (r, lines) = f.run(&f.spec(&format!(
        "echo x > /tmp/m.ko; \
         insmod /tmp/m.ko 2>/dev/null && echo INSMOD || echo no-insmod; \
         rmmod loop 2>/dev/null && echo RMMOD || echo no-rmmod; \
         swapon /tmp/m.ko 2>/dev/null && echo SWAPON || echo no-swapon; \
         reboot -f 2>/dev/null; sleep 0.2; echo after-reboot; \
         hostname evil 2>/dev/null && echo HOSTNAME || echo no-hostname; \
         nsenter -t 1 -n true 2>/dev/null && echo NSENTER || echo no-nsenter; \
         kill -0 {host_pid} 2>/dev/null && echo HOST-PID || echo no-host-pid"
    )));
    r.unwrap();
    assert_eq!(
        lines,
        vec![
            "no-insmod",
            "no-rmmod",
            "no-swapon",
            "after-reboot",
            "no-hostname",
            "no-nsenter",
            "no-host-pid",
        ]
    );
    assert_eq!(
        rustix::system::uname().nodename().to_string_lossy(),
        host_name
    );
}

/// Issue 36: the hostile-step list (`kiln_tests::hostile`, shared with the microVM
/// executor's test) in one namespace step: mount, load a module, ptrace a host process,
/// write `/proc/sysrq-trigger`, read a host file through `/proc/<host pid>/root`, chown to
/// a uid outside the user namespace's map. First the same script on the host as root, which
/// must print each case's unconfined outcome (so each case can fail), then the step, which
/// must print each contained one and never the host file's token.
#[test]
fn hostile_step_list_is_contained() {
    use kiln_tests::hostile::{Executor, STEP_DIR, Target, run_unconfined};
    let target = Target::start();
    target.assert_lines(Executor::Unconfined, &run_unconfined(&target));
    let f = fixture("hostile36");
    let (r, lines) = f.run(&f.spec(&target.script(STEP_DIR)));
    r.unwrap();
    target.assert_lines(Executor::Namespace, &lines);
}

#[test]
fn timeout_kills_everything() {
    let f = fixture("timeout");
    let mut spec = f.spec("sleep 300 & sleep 300 & echo started; sleep 300");
    spec.timeout = Duration::from_secs(2);
    let (r, lines) = f.run(&spec);
    assert!(matches!(r, Err(ExecError::Timeout { .. })), "{r:?}");
    assert_eq!(lines, vec!["started"]);
}

#[test]
fn cancellation_kills_everything() {
    let f = fixture("cancel");
    let spec = f.spec("sleep 300 & echo started; sleep 300");
    let cancel = AtomicBool::new(false);
    let (r, lines) = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_secs(2));
            cancel.store(true, Ordering::Relaxed);
        });
        f.run_with(f.config(), &spec, &cancel)
    });
    assert!(matches!(r, Err(ExecError::Cancelled)), "{r:?}");
    assert_eq!(lines, vec!["started"]);
}

#[test]
fn memory_limit_named() {
    let f = fixture("memory");
    let mut cfg = f.config();
    cfg.memory_bytes = 64 << 20;
    let (r, _) = f.run_with(
        cfg,
        &f.spec("head -c 2000000000 /dev/zero | tail"),
        &AtomicBool::new(false),
    );
    match r {
        Err(e @ ExecError::MemoryLimit { limit_bytes, .. }) => {
            assert_eq!(limit_bytes, 64 << 20);
            assert!(e.to_string().contains("memory limit"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn pids_limit_named() {
    let f = fixture("pids");
    let mut cfg = f.config();
    cfg.pids_max = 8;
    let (r, _) = f.run_with(
        cfg,
        &f.spec("i=0; while [ $i -lt 20 ]; do sleep 300 & i=$((i+1)); done; echo all-started"),
        &AtomicBool::new(false),
    );
    match r {
        Err(e @ ExecError::PidsLimit { limit: 8, .. }) => {
            assert!(e.to_string().contains("pids limit"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn write_limit_named() {
    let f = fixture("write");
    let mut cfg = f.config();
    cfg.write_limit_bytes = 1 << 20;
    let (r, _) = f.run_with(
        cfg,
        &f.spec("head -c 5000000 /dev/zero > /big"),
        &AtomicBool::new(false),
    );
    match r {
        Err(e @ ExecError::WriteLimit { .. }) => {
            assert!(e.to_string().contains("write limit"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

/// The write limit counts the blocks a step allocated, not apparent sizes: a 1 GiB sparse
/// file (`truncate -s`, as `useradd` makes `/var/log/lastlog`) writes next to nothing, and
/// passes a 1 MiB limit; real data past the limit is still stopped ([`write_limit_named`]).
#[test]
fn write_limit_counts_allocated_blocks_not_apparent_size() {
    let f = fixture("sparse-write");
    let mut cfg = f.config();
    cfg.write_limit_bytes = 1 << 20;
    let (r, _) = f.run_with(
        cfg,
        &f.spec("truncate -s 1G /sparse.img && echo tail >> /sparse.img"),
        &AtomicBool::new(false),
    );
    let report = r.expect("a sparse file within the limit");
    assert!(
        report.written_bytes < 1 << 20,
        "written_bytes {} counts holes",
        report.written_bytes
    );
    let md = fs::metadata(f.upper.join("sparse.img")).expect("sparse.img in the upper dir");
    assert_eq!(md.len(), (1 << 30) + 5);
}

#[test]
fn secrets_redacted_and_lines_bounded() {
    let f = fixture("logs");
    let mut spec =
        f.spec("echo token=s3cr3t-value; head -c 10000 /dev/zero | tr '\\0' a; echo; echo end");
    spec.secrets = vec!["s3cr3t-value".into()];
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines[0], "token=****");
    assert!(lines[1].len() <= 4096 && lines[1].ends_with("[line truncated]"));
    assert_eq!(lines[2], "end");

    // A build-wide budget smaller than the step's output: cut with the marker.
    let f = fixture("budget");
    let mut spec = f.spec("i=0; while [ $i -lt 100 ]; do echo line-$i; i=$((i+1)); done");
    spec.log_budget = Some(50);
    let (r, lines) = f.run(&spec);
    let report = r.unwrap();
    assert!(report.log_truncated);
    assert_eq!(
        lines.last().unwrap(),
        kiln_builder::exec::logs::LOG_TRUNCATED
    );
    // Seven lines of 7 bytes fit in 50, then the marker.
    assert_eq!(lines.len(), 8, "{lines:?}");
}

#[test]
fn no_descriptor_of_the_caller_reaches_the_step() {
    let f = fixture("fds");
    // A host file opened without close-on-exec, as a careless library might.
    let leaky = fs::File::open(&f.root).unwrap();
    rustix::io::fcntl_setfd(&leaky, rustix::io::FdFlags::empty()).unwrap();
    let (r, lines) = f.run(&f.spec("ls /proc/self/fd | tr '\\n' ' '; echo; wc -c < /proc/keys"));
    r.unwrap();
    // 0, 1, 2 and the descriptor ls itself opens on /proc/self/fd.
    assert_eq!(lines[0], "0 1 2 3 ");
    assert_eq!(lines[1].trim(), "0", "/proc/keys is masked");
    drop(leaky);
}

#[test]
fn concurrent_steps_do_not_wait_for_each_other() {
    let slow = fixture("slow");
    let quick = fixture("quick");
    let cancel_slow = AtomicBool::new(false);
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            slow.run_with(
                slow.config(),
                &slow.spec("echo slow; sleep 300"),
                &cancel_slow,
            )
        });
        // Let the slow step start first, so its keeper exists when the quick one forks.
        std::thread::sleep(Duration::from_secs(1));
        let mut spec = quick.spec("echo quick");
        spec.timeout = Duration::from_secs(60);
        let (r, lines) = quick.run(&spec);
        // The quick step ends while the slow one is still running (it only ends when
        // cancelled below): its log pipe is not held open by the other step's processes.
        r.unwrap();
        assert_eq!(lines, vec!["quick"]);
        assert!(!h.is_finished());
        cancel_slow.store(true, Ordering::Relaxed);
        let (r, lines) = h.join().unwrap();
        assert!(matches!(r, Err(ExecError::Cancelled)), "{r:?}");
        assert_eq!(lines, vec!["slow"]);
    });
}

#[test]
fn hostile_hosts_symlinks_stay_inside_the_root() {
    let f = fixture("symlinks");
    // /etc/hosts points at a host path by absolute symlink, /etc/resolv.conf dangles.
    let victim = f._tmp.path().join("victim");
    fs::write(&victim, "host file\n").unwrap();
    std::os::unix::fs::symlink(&victim, f.root.join("etc/hosts")).unwrap();
    // The same absolute path inside the root: where the bind must land.
    let inside = f.root.join(victim.strip_prefix("/").unwrap());
    fs::create_dir_all(inside.parent().unwrap()).unwrap();
    fs::write(&inside, "image file\n").unwrap();
    std::os::unix::fs::symlink("../run/nowhere/resolv.conf", f.root.join("etc/resolv.conf"))
        .unwrap();
    let (r, lines) = f
        .run(&f.spec("grep -c runtime-guest /etc/hosts; ls -l /etc/resolv.conf | grep -c nowhere"));
    r.unwrap();
    assert_eq!(lines, vec!["1", "1"]);
    assert_eq!(fs::read_to_string(&victim).unwrap(), "host file\n");
    assert_eq!(fs::read_to_string(&inside).unwrap(), "image file\n");
    // The dangling symlink's target was not created.
    assert!(!f.upper.join("run").exists());
}

/// Issue 34: the step's root overlay is mounted `volatile` (its upper is the step's scratch,
/// so a step's fsync need not reach the disk), and the same upper and work directories mount
/// again for another step: overlayfs' `work/incompat/volatile` marker, which would refuse
/// that, is cleared before a volatile mount. (Linux 6.18 shows the option as
/// `fsync=volatile`, older kernels as `volatile`.)
#[test]
fn the_step_root_is_volatile_and_its_directories_mount_again() {
    let f = fixture("volatile");
    let (r, lines) = f.run(&f.spec(
        "grep ' / / ' /proc/self/mountinfo; echo a | dd of=/a conv=fsync 2>/dev/null; echo ok",
    ));
    r.unwrap();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let options = lines[0].rsplit(' ').next().unwrap();
    assert!(
        lines[0].contains(" - overlay ")
            && options
                .split(',')
                .any(|o| o == "volatile" || o == "fsync=volatile"),
        "the root's mount: {}",
        lines[0]
    );
    assert_eq!(lines[1], "ok");
    assert!(
        f.work.join("work/incompat/volatile").is_dir(),
        "overlayfs marks a volatile mount's work directory"
    );
    assert_eq!(fs::read_to_string(f.upper.join("a")).unwrap(), "a\n");
    let (r, lines) = f.run(&f.spec("cat /a; echo b > /b"));
    r.unwrap();
    assert_eq!(lines, vec!["a"]);
    assert_eq!(fs::read_to_string(f.upper.join("b")).unwrap(), "b\n");
}

/// Two steps stacked on the Debian bookworm minbase fixture (ci/fixtures.sh), unpacked with
/// umoci: the second step's lower directories are the first step's upper over the base, and
/// its USER comes from the /etc/passwd the first step wrote.
#[test]
fn debian_two_stacked_steps() {
    let f = fixture("debian");
    let base = debian_root(&f);

    let mut spec = f.spec(
        ". /etc/os-release; echo $VERSION_CODENAME; useradd -m -u 1234 -U bob && id bob; \
         getent hosts localhost | head -1",
    );
    spec.lower_dirs = vec![base.clone()];
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines[0], "bookworm");
    assert_eq!(lines[1], "uid=1234(bob) gid=1234(bob) groups=1234(bob)");
    assert!(
        lines[2].starts_with("127.0.0.1") || lines[2].starts_with("::1"),
        "{}",
        lines[2]
    );
    assert!(
        fs::read_to_string(f.upper.join("etc/passwd"))
            .unwrap()
            .contains("bob:x:1234")
    );
    // /etc/hosts was only a mount point: not in the layer; the image's resolv.conf untouched.
    assert!(!f.upper.join("etc/hosts").exists());
    assert!(!f.upper.join("etc/resolv.conf").exists());

    let upper2 = f._tmp.path().join("upper2");
    let work2 = f._tmp.path().join("work2");
    fs::create_dir(&upper2).unwrap();
    fs::create_dir(&work2).unwrap();
    let mut spec = f.spec("id; pwd; echo $HOME; touch made");
    spec.lower_dirs = vec![f.upper.clone(), base];
    spec.upper_dir = upper2.clone();
    spec.work_dir = work2;
    spec.user = Some("bob".into());
    spec.workdir = "/srv/app".into();
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(
        lines,
        vec![
            "uid=1234(bob) gid=1234(bob) groups=1234(bob)",
            "/srv/app",
            "/home/bob"
        ]
    );
    let md = fs::metadata(upper2.join("srv/app/made")).unwrap();
    assert_eq!((md.uid(), md.gid()), (1234, 1234));
}

/// Not a test: the process [`killed_executor_leaves_no_process`] starts and kills. Runs a
/// step that never ends on its own.
#[test]
#[ignore = "helper process for killed_executor_leaves_no_process"]
fn helper_step_forever() {
    assert!(
        std::env::var_os(HELPER_TMP).is_some(),
        "run only by killed_executor_leaves_no_process"
    );
    let f = fixture("helper");
    let mut spec = f.spec("sleep 600");
    spec.timeout = Duration::from_secs(600);
    let _ = LinuxExecutor::new(f.config()).run(&spec, &AtomicBool::new(false), &mut |_| {});
}

fn alive(pid: i32) -> bool {
    // Gone, or a zombie waiting for init to reap it.
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The executor's process is SIGKILLed mid-step (nothing of it runs to clean up): its step's
/// processes still die, through the parent-death signal of the keeper and pid 1.
#[test]
fn killed_executor_leaves_no_process() {
    assert!(rustix::process::geteuid().is_root(), "needs root");
    let tmp = tempfile::tempdir().unwrap();
    let parent = format!("kiln-test-killed-{}", std::process::id());
    let mut helper = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "helper_step_forever", "--nocapture"])
        .env(HELPER_TMP, tmp.path())
        .env(HELPER_CGROUP, &parent)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait (bounded) for the step's pid 1 to run `sleep`: keeper and pid 1 in the cgroup.
    let cg_parent = Path::new("/sys/fs/cgroup/pids").join(&parent);
    let mut pids: Vec<i32> = Vec::new();
    for _ in 0..600 {
        pids = fs::read_dir(&cg_parent)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| fs::read_to_string(e.path().join("cgroup.procs")).ok())
            .flat_map(|s| {
                s.lines()
                    .filter_map(|l| l.parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect();
        let running_sleep = pids.iter().any(|p| {
            fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "sleep")
        });
        if running_sleep {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(pids.len() >= 2, "the helper's step did not start: {pids:?}");
    helper.kill().unwrap();
    helper.wait().unwrap();
    let mut left = pids.clone();
    for _ in 0..300 {
        left.retain(|&p| alive(p));
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Nothing could clean the cgroups up; do it here before asserting.
    for ctrl in ["memory", "pids"] {
        let dir = Path::new("/sys/fs/cgroup").join(ctrl).join(&parent);
        if let Ok(rd) = fs::read_dir(&dir) {
            for e in rd.flatten() {
                let _ = fs::remove_dir(e.path());
            }
        }
        let _ = fs::remove_dir(&dir);
    }
    assert!(
        left.is_empty(),
        "processes left after the executor was killed: {left:?}"
    );
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mountinfo.contains(tmp.path().to_str().unwrap()));
}

/// More layers than one mount(2) option page can name (about 60 here): mounted with
/// `lowerdir+`, each layer visible, the topmost winning.
#[test]
fn many_layers() {
    let f = fixture("layers");
    let mut lowers = Vec::new();
    for i in 0..120 {
        let dir = f
            ._tmp
            .path()
            .join(format!("layer-with-a-long-name-to-fill-the-page-{i:03}"));
        fs::create_dir_all(dir.join("l")).unwrap();
        fs::write(dir.join(format!("l/{i}")), "").unwrap();
        fs::write(dir.join("l/top"), format!("{i}")).unwrap();
        lowers.push(dir);
    }
    // Topmost first: the last one made is on top.
    lowers.reverse();
    lowers.push(f.root.clone());
    let mut spec = f.spec("ls /l | wc -l; cat /l/top");
    spec.lower_dirs = lowers;
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines, vec!["121", "119"]);
}

/// CAP_MKNOD is in Docker's set: with `KILN_STEP_USERNS=host` a step may make a node for a
/// host device (here the host's first loop device, which root on this host can open), but
/// never open it (nodev overlay, read-only /dev, nodev /dev/shm). In the steps' user
/// namespace (the default) the kernel refuses the node itself: CAP_MKNOD counts only in the
/// initial user namespace (mknod(2)).
#[test]
fn device_nodes_made_by_a_step_cannot_be_opened() {
    let f = fixture("mknod");
    let dev = fs::read_to_string("/sys/class/block/loop0/dev")
        .expect("no /dev/loop0 on this host (the loop module: ci/setup.sh)");
    let (major, minor) = dev.trim().split_once(':').unwrap();
    // The host can open it: so only the step's isolation can make the opens below fail.
    fs::File::open("/dev/loop0").expect("the host cannot open /dev/loop0");
    let spec = f.spec(&format!(
        "mknod /disk b {major} {minor} 2>/dev/null && echo made || echo no-mknod; \
         [ -e /disk ] && {{ ( : </disk ) 2>/dev/null && echo OPENED || echo denied; }}; \
         mknod /dev/shm/disk b {major} {minor} 2>/dev/null && {{ ( : </dev/shm/disk ) 2>/dev/null && echo OPENED || echo denied; }} || echo no-mknod-shm; \
         mknod /dev/disk b {major} {minor} 2>/dev/null && echo MADE-IN-DEV || echo dev-ro; \
         echo x > /dev/null && head -c 1 /dev/zero | wc -c"
    ));
    let mut host = f.config();
    host.userns = StepUserns::Host;
    let (r, lines) = f.run_with(host, &spec, &AtomicBool::new(false));
    r.unwrap();
    assert_eq!(lines, vec!["made", "denied", "denied", "dev-ro", "1"]);
    fs::remove_dir_all(&f.upper).unwrap();
    fs::create_dir(&f.upper).unwrap();
    let (r, lines) = f.run(&spec);
    r.unwrap();
    assert_eq!(lines, vec!["no-mknod", "no-mknod-shm", "dev-ro", "1"]);
}

/// A step renames /etc away (allowed: it only holds mount points) and puts a symlink to a
/// host directory in its place: cleaning the mount points up must not follow it on the host.
#[test]
fn mount_point_cleanup_does_not_follow_step_symlinks() {
    let f = fixture("cleanup");
    let victim_dir = f._tmp.path().join("victim");
    fs::create_dir(&victim_dir).unwrap();
    fs::write(victim_dir.join("hosts"), "").unwrap();
    fs::write(victim_dir.join("resolv.conf"), "").unwrap();
    // A root without /etc, so /etc/hosts is the executor's own mount point.
    fs::remove_dir_all(f.root.join("etc")).unwrap();
    let (r, _) = f.run(&f.spec(&format!(
        "mv /etc /etc-moved && ln -s {} /etc && echo moved",
        victim_dir.display()
    )));
    r.unwrap();
    assert!(victim_dir.join("hosts").exists());
    assert!(victim_dir.join("resolv.conf").exists());
}

/// An image whose `/proc` (or `/sys`) is a symlink: the step's proc and sysfs are mounted
/// on the root's own directories (made, never followed: `mount_point`), so a symlink there
/// is refused naming it, as runc refuses a symlinked `/proc` and the microVM executor
/// refuses one (`guest_boot::image_with_a_symlinked_proc_is_refused_and_the_vm_powers_off`);
/// the symlink's target stays as it was.
#[test]
fn a_symlinked_proc_or_sys_in_the_image_is_refused() {
    for dir in ["proc", "sys"] {
        let f = fixture(&format!("symlinked-{dir}"));
        let _ = fs::remove_dir(f.root.join(dir));
        fs::create_dir_all(f.root.join("tmp/elsewhere")).unwrap();
        std::os::unix::fs::symlink("tmp/elsewhere", f.root.join(dir)).unwrap();
        let (r, _) = f.run(&f.spec("echo ran"));
        let e = r.expect_err("a symlinked mount point").to_string();
        assert!(e.contains(&format!("/{dir}")), "{dir}: {e}");
        assert_eq!(
            fs::read_dir(f.root.join("tmp/elsewhere")).unwrap().count(),
            0
        );
    }
}
