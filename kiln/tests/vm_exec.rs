//! `kiln exec` and `kiln_vmm::exec` against one real clone (TCG) of the busybox fixture,
//! whose OCI config names the user `nobody` (home `/nonexistent`, which does not exist) and
//! image variables: exit codes, a signal, stdout/stderr separation, stdin, large output,
//! environment merging (image, `kiln start --env`, `--env`), user and workdir defaults,
//! 125/126/127, two commands at once, detached and non-detached commands when the connection
//! drops, and an OOM-killed command flagged; then a second clone of the same snapshot with a
//! grown disk (`kiln start --disk-mib`), and a size below the image's refused. One boot for
//! all of it.
//! Needs what `ci/setup.sh` exports (`KILN_TEST_BUSYBOX_OCI`, the guest kernel).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use kiln_store::{Manifest, Store, TagRef};
use kiln_tests::vm::{StopClones, busybox_image, kiln_in, sh, show};
use kiln_vmm::exec::{ExecEvent, ExecRequest, ExecSession, Stream};
use serde_json::Value;

fn kiln_cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = kiln_in(env!("CARGO_BIN_EXE_kiln"), dir);
    c.args(args);
    c
}

fn kiln(dir: &Path, args: &[&str]) -> Output {
    kiln_cmd(dir, args).output().expect("run kiln")
}

fn kiln_stdin(dir: &Path, args: &[&str], input: &[u8]) -> Output {
    let mut child = kiln_cmd(dir, args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("wait kiln");
    writer.join().expect("writer").expect("write stdin");
    out
}

/// `kiln exec ID args...`: (exit code, stdout, stderr).
fn exec(dir: &Path, id: &str, args: &[&str]) -> (i32, String, String) {
    let mut full = vec!["exec", id];
    full.extend_from_slice(args);
    let o = kiln(dir, &full);
    (
        o.status
            .code()
            .unwrap_or_else(|| panic!("killed: {}", show(&o))),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn req(user: &str, script: &str) -> ExecRequest {
    ExecRequest {
        argv: sh(script),
        user: Some(user.into()),
        ..ExecRequest::default()
    }
}

/// Runs the session until every exec ended; stdout per exec id and the exit codes.
async fn drain(s: &mut ExecSession) -> Vec<(u64, String, i32)> {
    let mut out: Vec<(u64, String, i32)> = Vec::new();
    let mut text = std::collections::HashMap::<u64, String>::new();
    while s.running() > 0 {
        match s.next_event().await.expect("event") {
            ExecEvent::Output { id, stream, data } => {
                if stream == Stream::Stdout {
                    text.entry(id)
                        .or_default()
                        .push_str(&String::from_utf8_lossy(&data));
                }
            }
            ExecEvent::Exit { id, status } => {
                out.push((id, text.remove(&id).unwrap_or_default(), status.exit_code()))
            }
        }
    }
    out
}

#[test]
fn vm_exec_in_one_clone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let _stop = StopClones::new(env!("CARGO_BIN_EXE_kiln"), d);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let store = Store::open(d.join("store").to_str().expect("utf-8"))
            .await
            .expect("store");
        let tag: TagRef = "bb:latest".parse().expect("tag");
        busybox_image(&store, d, &tag, kiln_tests::vm::sleeping_sandbox()).await;
        // An ssh-keygen (a stand-in that records the clone's machine-id in each key) and an
        // empty /etc/ssh, as in the sandbox images: a clone's first start makes the keys.
        let root = d.join("rootfs-kiln_test_busybox_oci");
        std::fs::create_dir_all(root.join("etc/ssh")).expect("mkdir");
        let keygen = root.join("usr/bin/ssh-keygen");
        std::fs::create_dir_all(keygen.parent().expect("parent")).expect("mkdir");
        std::fs::write(
            &keygen,
            "#!/bin/sh\n[ \"$1\" = -A ] || exit 2\n\
             for t in rsa ecdsa ed25519; do f=/etc/ssh/ssh_host_${t}_key; \
             [ -e $f ] || echo \"$t $(cat /etc/machine-id)\" > $f; done\n",
        )
        .expect("write");
        std::fs::set_permissions(&keygen, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        busybox_image(&store, d, &tag, kiln_tests::vm::sleeping_sandbox()).await;
        // The image's OCI config names its user and environment, as a built image's does
        // (the start command itself runs as root).
        let config = d.join("config.json");
        std::fs::write(
            &config,
            serde_json::json!({"architecture": "amd64", "os": "linux", "config": {
                "User": "nobody",
                "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_VAR=img", "SHARED=image"],
            }})
            .to_string(),
        )
        .expect("config");
        let (blob, _) = store.put_blob_file(&config).await.expect("config blob");
        let digest = store.resolve_tag(&tag).await.expect("tag");
        let Manifest::Image(mut m) = store.get_manifest(&digest).await.expect("manifest") else {
            panic!("not an image")
        };
        m.oci_config = Some(blob);
        let raw = store
            .put_manifest(&Manifest::Image(m))
            .await
            .expect("put manifest");
        store.force_tag(&tag, raw.digest).await.expect("tag");
    });
    let o = kiln(
        d,
        &[
            "snapshot",
            "bb:latest",
            "-t",
            "bb:snap",
            "--memory-mib",
            "256",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    let o = kiln(
        d,
        &[
            "--json",
            "start",
            "bb:snap",
            "--env",
            "START_VAR=s",
            "--env",
            "SHARED=start",
        ],
    );
    assert!(o.status.success(), "{}", show(&o));
    let started: Value = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .find(|v| v["event"] == "started")
        .expect("started event");
    let id = started["id"].as_str().expect("id").to_string();
    let id = id.as_str();

    // The first start made the SSH host keys, for this clone's machine-id (in the
    // background: wait a little for the last one).
    let (_, mid, _) = exec(d, id, &["--", "cat", "/etc/machine-id"]);
    let mut keys = String::new();
    for _ in 0..100 {
        let (code, out, _) = exec(
            d,
            id,
            &[
                "-u",
                "root",
                "--",
                "sh",
                "-c",
                "cat /etc/ssh/ssh_host_*_key",
            ],
        );
        keys = out;
        if code == 0 && keys.lines().count() == 3 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let want: String = ["ecdsa", "ed25519", "rsa"]
        .iter()
        .map(|t| format!("{t} {}", mid))
        .collect();
    assert_eq!(keys, want, "host keys made at the first start");

    // Exit code passthrough, stdout and stderr apart.
    let (code, out, err) = exec(d, id, &["--", "sh", "-c", "echo out; echo err >&2; exit 3"]);
    assert_eq!((code, out.as_str(), err.as_str()), (3, "out\n", "err\n"));
    // A signal: 128 + N.
    let (code, _, _) = exec(d, id, &["--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(code, 143);

    // The image's user (its OCI config's, nobody) by default, in its home, which does not
    // exist here: `/`, with HOME still set from /etc/passwd.
    let (code, out, _) = exec(d, id, &["--", "sh", "-c", "id -u; pwd; echo $HOME"]);
    assert_eq!((code, out.as_str()), (0, "65534\n/\n/nonexistent\n"));
    // Another user: its uid, and its home as working directory; --workdir wins.
    let (code, out, _) = exec(d, id, &["--user", "root", "--", "sh", "-c", "id -u; pwd"]);
    assert_eq!((code, out.as_str()), (0, "0\n/root\n"));
    let (code, out, _) = exec(d, id, &["-u", "root", "-w", "/tmp", "--", "pwd"]);
    assert_eq!((code, out.as_str()), (0, "/tmp\n"));

    // The environment: the image's, under kiln start --env's, under the command's own.
    let script = "echo $IMAGE_VAR $START_VAR $SHARED $X";
    let (code, out, _) = exec(d, id, &["--", "sh", "-c", script]);
    assert_eq!((code, out.as_str()), (0, "img s start\n"));
    let (code, out, _) = exec(
        d,
        id,
        &["--env", "SHARED=cmd", "-e", "X=1", "--", "sh", "-c", script],
    );
    assert_eq!((code, out.as_str()), (0, "img s cmd 1\n"));

    // A command starts with no signal blocked or ignored (issue 44 §1), so `yes | head`
    // ends when head does.
    let (code, out, _) = exec(
        d,
        id,
        &[
            "--",
            "sh",
            "-c",
            "grep -E '^Sig(Blk|Ign):' /proc/self/status; yes | head -c 1000000 | wc -c",
        ],
    );
    assert_eq!(
        (code, out.as_str()),
        (
            0,
            "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n1000000\n"
        )
    );

    // stdin with -i, and without it /dev/null.
    let o = kiln_stdin(d, &["exec", "-i", id, "--", "cat"], b"hello\x00 there");
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert_eq!(o.stdout, b"hello\x00 there");
    let o = kiln_stdin(d, &["exec", id, "--", "wc", "-c"], b"ignored");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "0",
        "{}",
        show(&o)
    );
    // Large output arrives whole and in order (many chunks), stdin at its limit too.
    let (code, out, _) = exec(d, id, &["--", "seq", "1", "100000"]);
    assert_eq!(code, 0);
    let want: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
    assert!(out == want, "seq output differs ({} bytes)", out.len());
    let big: Vec<u8> = (0..512u32 << 10).map(|i| (i % 251) as u8).collect();
    let o = kiln_stdin(d, &["exec", "-i", id, "--", "cat"], &big);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(o.stdout == big, "cat of 512 KiB differs");
    let o = kiln_stdin(
        d,
        &["exec", "-i", id, "--", "cat"],
        &vec![0u8; (512 << 10) + 1],
    );
    assert_eq!(o.status.code(), Some(125), "{}", show(&o));

    // kiln's own failures and the command's: docker exec's codes.
    let (code, _, err) = exec(d, id, &["--", "no-such-command"]);
    assert_eq!(code, 127, "{err}");
    assert!(err.contains("no-such-command"), "{err}");
    let (code, _, _) = exec(d, id, &["--", "/no/such/file"]);
    assert_eq!(code, 127);
    let (code, _, err) = exec(d, id, &["-u", "root", "--", "/etc/passwd"]);
    assert_eq!(code, 126, "{err}");
    let (code, _, _) = exec(d, id, &["-w", "/no/such/dir", "--", "true"]);
    assert_eq!(code, 126);
    let (code, _, err) = exec(d, id, &["--user", "no-such-user", "--", "true"]);
    assert_eq!(code, 126, "{err}");
    let (code, _, err) = exec(d, "0123456789abcdef", &["--", "true"]);
    assert_eq!(code, 125, "{err}");
    let (code, _, _) = exec(d, id, &["--env", "NOEQUALS", "--", "true"]);
    assert_eq!(code, 125);
    let (code, _, err) = exec(d, id, &["--no-such-flag", "--", "true"]);
    assert_eq!(code, 125, "a usage error is kiln's: {err}");

    // kiln exec processes started together all get their turn on the guest channel.
    let children: Vec<_> = (0..3)
        .map(|i| {
            kiln_cmd(d, &["exec", id, "--", "sh", "-c", &format!("echo {i}")])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn kiln exec")
        })
        .collect();
    for (i, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().expect("wait");
        assert_eq!(o.status.code(), Some(0), "{}", show(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{i}\n"));
    }

    let state = d.join("state");
    rt.block_on(async {
        // Two commands at once in one session: the first waits (at most 30 s) for a file only
        // the second makes, so it passes only if both run together.
        let mut s = ExecSession::open(&state, id, Duration::from_secs(60))
            .await
            .expect("session");
        let a = s
            .start(&req(
                "root",
                "i=0; while [ ! -e /tmp/b ]; do i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done; echo a",
            ))
            .await
            .expect("start a");
        let b = s
            .start(&req("root", "touch /tmp/b; echo b"))
            .await
            .expect("start b");
        let mut ends = drain(&mut s).await;
        ends.sort();
        let mut want = vec![(a, "a\n".to_string(), 0), (b, "b\n".to_string(), 0)];
        want.sort();
        assert_eq!(ends, want);

        // A dropped connection kills the commands not detached, and only those.
        let wait_for = |f: &str| {
            format!("i=0; while [ ! -s {f} ]; do i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done")
        };
        s.start(&req("root", "echo $$ > /tmp/attached.pid; exec sleep 1000000"))
            .await
            .expect("attached");
        let mut detached = req("root", "echo $$ > /tmp/detached.pid; exec sleep 1000000");
        detached.detach = true;
        s.start(&detached).await.expect("detached");
        let w = s
            .start(&req(
                "root",
                &format!("{}; {}", wait_for("/tmp/attached.pid"), wait_for("/tmp/detached.pid")),
            ))
            .await
            .expect("wait");
        loop {
            if let ExecEvent::Exit { id, status } = s.next_event().await.expect("event")
                && id == w
            {
                assert_eq!(status.exit_code(), 0);
                break;
            }
        }
        drop(s);
    });
    // The attached one is gone (waiting at most 30 s for the kill to land), the detached
    // one runs.
    let (code, _, err) = exec(
        d,
        id,
        &[
            "-u",
            "root",
            "--",
            "sh",
            "-c",
            "p=$(cat /tmp/attached.pid); i=0; while kill -0 $p 2>/dev/null; do i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done; kill -0 $(cat /tmp/detached.pid)",
        ],
    );
    assert_eq!(code, 0, "{err}");
    // kiln exec -d returns at once; its command runs on.
    let (code, _, err) = exec(
        d,
        id,
        &[
            "-d",
            "-u",
            "root",
            "--",
            "sh",
            "-c",
            "sleep 1; echo done > /tmp/d",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = exec(
        d,
        id,
        &[
            "--",
            "sh",
            "-c",
            "i=0; while [ ! -s /tmp/d ]; do i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.1; done; cat /tmp/d",
        ],
    );
    assert_eq!((code, out.as_str()), (0, "done\n"));

    // The kernel's OOM killer: 137 and the flag (busybox tail keeps a line without a
    // newline whole). The command caps its own exec cgroup at 32 MiB first: filling the whole
    // 256 MiB guest instead livelocked under TCG on a loaded host (the kernel evicting and
    // rereading file pages; no OOM kill in 294 s), and the flag counts a cgroup's OOM kills
    // and the whole VM's alike. The zeros come from dd in 1 MB blocks: busybox `head -c`
    // copies a byte at a time, which under TCG took 10.8 s here against dd's 4.0 s.
    let o = kiln(
        d,
        &[
            "--json",
            "exec",
            "-u",
            "root",
            id,
            "--",
            "sh",
            "-c",
            "cg=$(cut -d: -f3 /proc/self/cgroup); echo 32M > /sys/fs/cgroup$cg/memory.max \
             && dd if=/dev/zero bs=1000000 count=2000 | tail >/dev/null",
        ],
    );
    let exit: Value = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "exit")
        .unwrap_or_else(|| panic!("no exit event: {}", show(&o)));
    assert_eq!(exit["oom"], true, "{exit}");
    // The shell reports its killed pipeline as 128 + SIGKILL.
    assert_eq!(o.status.code(), Some(137), "{}", show(&o));

    // `kiln start --disk-mib`: a size below the image's (64 MiB) is refused before anything
    // starts, naming both sizes, with exit 1 (invalid input, the README's table).
    let clones = || {
        std::fs::read_dir(d.join("state/clones"))
            .expect("clones dir")
            .count()
    };
    let before = clones();
    let o = kiln(d, &["start", "bb:snap", "--disk-mib", "32"]);
    assert_eq!(o.status.code(), Some(1), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("32 MiB") && err.contains("64 MiB") && err.contains("only grow"),
        "{err}"
    );
    assert_eq!(clones(), before, "a refused start leaves no clone");
    // A larger one: a second clone of the same snapshot whose root file system the guest
    // grew online before `kiln start` returned. df shows the new size, the image's files are
    // the same as in the first clone, and a file larger than the image's whole disk fits.
    let o = kiln(d, &["--json", "start", "bb:snap", "--disk-mib", "256"]);
    assert!(o.status.success(), "{}", show(&o));
    let started: Value = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .find(|v| v["event"] == "started")
        .expect("started event");
    assert_eq!(started["disk_bytes"], 256u64 << 20, "{started}");
    let grown = started["id"].as_str().expect("id").to_string();
    let (code, out, err) = exec(d, &grown, &["--", "df", "-k", "/"]);
    assert_eq!(code, 0, "{err}");
    let kib: u64 = out
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df -k output: {out}"));
    // The file system's own metadata (journal, inode tables) is not counted by df.
    assert!(
        (192 << 10..=256 << 10).contains(&kib),
        "df -k / says {kib} KiB on a 256 MiB disk grown from 64 MiB:\n{out}"
    );
    let sums = "md5sum /bin/busybox /etc/passwd";
    let (_, image_files, _) = exec(d, id, &["-u", "root", "--", "sh", "-c", sums]);
    let (code, grown_files, _) = exec(d, &grown, &["-u", "root", "--", "sh", "-c", sums]);
    assert_eq!(code, 0);
    assert_eq!(grown_files, image_files, "the image's data is still there");
    let (code, out, err) = exec(
        d,
        &grown,
        &[
            "-u",
            "root",
            "--",
            "sh",
            "-c",
            // Real blocks written by dd in 1 MB writes (busybox `head -c`, a byte at a time,
            // took 34 s of TCG on these 100 MB, dd 14 s).
            "dd if=/dev/zero of=/big bs=1000000 count=100 && sync && wc -c < /big \
             && rm /big",
        ],
    );
    assert_eq!(
        (code, out.trim()),
        (0, "100000000"),
        "a 100 MB file on the grown disk: {err}"
    );
    // The grown file system is sound: made read-only in the guest (which writes back
    // everything, QEMU's qcow2 metadata too), then a raw copy of the clone's disk passes
    // `e2fsck -fn` and holds 256 MiB of 4 KiB blocks.
    let (code, _, err) = exec(
        d,
        &grown,
        &["-u", "root", "--", "mount", "-o", "remount,ro", "/"],
    );
    assert_eq!(code, 0, "remount read-only: {err}");
    let raw = d.join("grown.raw");
    let o = Command::new("qemu-img")
        .args(["convert", "-U", "-f", "qcow2", "-O", "raw"])
        .arg(d.join("state/clones").join(&grown).join("disk.qcow2"))
        .arg(&raw)
        .output()
        .expect("qemu-img");
    assert!(o.status.success(), "{}", show(&o));
    let o = Command::new("e2fsck")
        .arg("-fn")
        .arg(&raw)
        .output()
        .expect("e2fsck");
    assert!(
        o.status.success(),
        "e2fsck -fn of the grown disk: {}",
        show(&o)
    );
    let o = Command::new("dumpe2fs")
        .arg("-h")
        .arg(&raw)
        .output()
        .expect("dumpe2fs");
    let header = String::from_utf8_lossy(&o.stdout);
    assert!(
        header
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Block", "count:", "65536"]),
        "{header}"
    );
    std::fs::remove_file(&raw).expect("rm raw copy");

    assert!(kiln(d, &["stop", "--all"]).status.success());
}
