//! `kiln build` end to end on the busybox fixture (as root): the digest as the last stdout
//! line, `--iidfile`, `--metadata-file`, tags that `kiln export --format oci` finds and that
//! skopeo and umoci accept; a failing build tags nothing; SIGTERM cancels and leaves no
//! process and no mount.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kiln_tests::require_env;

fn kiln(store: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("KILN_STORE", store);
    // `kiln build` takes the caller's SOURCE_DATE_EPOCH as a build arg: a test that wants
    // one sets it.
    c.env_remove("SOURCE_DATE_EPOCH");
    c
}

fn setup(dockerfile: &str) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = t.path().join("ctx");
    std::fs::create_dir(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), dockerfile).expect("write");
    let store = t.path().join("store");
    (t, ctx, store)
}

#[test]
fn build_tag_export_skopeo_umoci() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, ctx, store) = setup(&format!(
        "FROM {bb}\nRUN echo hi > /hi && rm /bin/vi\nWORKDIR /app\nCMD [\"cat\", \"/hi\"]\n"
    ));
    let iid = t.path().join("iid");
    let meta = t.path().join("meta.json");
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "demo:1", "--progress", "plain", "--iidfile"])
        .arg(&iid)
        .arg("--metadata-file")
        .arg(&meta)
        .output()
        .expect("run kiln");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let digest = stdout.lines().last().expect("a line").to_string();
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{stdout}"
    );
    // stdout: the kiln image manifest; --iidfile: the OCI manifest, as buildx.
    let oci = std::fs::read_to_string(&iid).expect("iid");
    assert!(oci.starts_with("sha256:") && oci != digest, "{oci}");
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta).expect("meta")).expect("json");
    assert_eq!(m["containerimage.digest"], oci.as_str());
    assert_eq!(m["kiln.image.manifest"], digest.as_str());
    assert!(stderr.contains("Dockerfile:2 RUN"), "{stderr}");

    let layout = t.path().join("layout");
    let exported = kiln_tests::run_ok(
        kiln(&store)
            .args(["export", "demo:1", "--format", "oci", "-o"])
            .arg(&layout),
    );
    let exported = String::from_utf8(exported.stdout).expect("utf-8");
    let exported = exported.trim();
    let out = Command::new("skopeo")
        .args(["inspect", &format!("oci:{}:1", layout.display())])
        .output()
        .expect("skopeo missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    // The build's zstd layer is gzipped in the layout (issue 34): a manifest of its own,
    // which export prints, over the build's config.
    assert_eq!(v["Digest"], exported);
    assert_ne!(exported, oci.as_str());
    let out = Command::new("skopeo")
        .args(["inspect", "--raw", &format!("oci:{}:1", layout.display())])
        .output()
        .expect("skopeo");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let raw: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(raw["config"]["digest"], m["containerimage.config.digest"]);
    for l in raw["layers"].as_array().expect("layers") {
        assert_eq!(
            l["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip",
            "{raw}"
        );
    }
    let bundle = t.path().join("bundle");
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:1", layout.display()))
        .arg(&bundle)
        .output()
        .expect("umoci missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(bundle.join("rootfs/hi")).expect("hi"),
        "hi\n"
    );
    assert!(!bundle.join("rootfs/bin/vi").exists());
    assert!(bundle.join("rootfs/app").is_dir());

    // A push gzips the layers as the export did (the same manifest, so the same digest);
    // with --layer-compression as-built it pushes the build's own manifest.
    let registry = require_env("KILN_TEST_REGISTRY");
    let repo = format!("{registry}/kiln-test/cli-{}", std::process::id());
    for (how, want) in [("gzip", exported), ("as-built", oci.as_str())] {
        let out = kiln_tests::run_ok(
            kiln(&store)
                .args([
                    "push",
                    "demo:1",
                    &format!("{repo}:{how}"),
                    "--layer-compression",
                ])
                .arg(how),
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            want,
            "kiln push --layer-compression {how}"
        );
        let out = Command::new("skopeo")
            .args([
                "inspect",
                "--tls-verify=false",
                &format!("docker://{repo}:{how}"),
            ])
            .output()
            .expect("skopeo");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v["Digest"], want, "the registry's digest after push {how}");
    }
    assert_eq!(
        std::fs::read_to_string(bundle.join("rootfs/etc/hostname")).expect("hostname"),
        "runtime-guest\n"
    );

    // The checked ext4 image is in the store under the tag.
    let ext4 = t.path().join("rootfs.ext4");
    let out = kiln_tests::run_ok(
        kiln(&store)
            .args(["export", "demo:1", "--format", "ext4", "-o"])
            .arg(&ext4),
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().last(),
        Some(digest.as_str())
    );
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(&ext4)
        .output()
        .expect("e2fsck missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Same build again: all cached, same digest.
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "demo:2"])
        .output()
        .expect("run kiln");
    assert!(out.status.success());
    let again = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(again.lines().last(), Some(digest.as_str()));
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 steps run"));
}

#[test]
fn failing_build_tags_nothing() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (_t, ctx, store) = setup(&format!("FROM {bb}\nRUN echo doomed; exit 7\n"));
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "doomed:1"])
        .output()
        .expect("run kiln");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Dockerfile:2: RUN"), "{stderr}");
    assert!(
        stderr.contains("exited with code 7") && stderr.contains("  doomed"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    let out = kiln(&store)
        .args(["export", "doomed:1", "-o", "/nonexistent-kiln-test"])
        .output()
        .expect("run kiln export");
    assert!(!out.status.success(), "nothing was tagged");
}

#[test]
fn sigterm_cancels_and_leaves_nothing() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let marker = 700_000 + std::process::id() % 100_000;
    let (t, ctx, store) = setup(&format!("FROM {bb}\nRUN echo started; sleep {marker}\n"));
    let mut child = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "cancelled:1", "--progress", "plain", "--oci-only"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let l = lines
            .next()
            .expect("kiln ended before the step started")
            .expect("read");
        if l.ends_with(" started") {
            break;
        }
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .expect("kill");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("wait");
    assert!(!status.success());
    assert!(rest.iter().any(|l| l.contains("cancel")), "{rest:?}");
    // No process of the step, no mount under the test directory, nothing tagged.
    let needle = format!("sleep\0{marker}");
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            assert!(
                !String::from_utf8_lossy(&c).contains(&needle),
                "step process left: {:?}",
                e.path()
            );
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(
        !mounts.contains(t.path().to_str().expect("utf-8")),
        "{mounts}"
    );
    let out = kiln(&store)
        .args(["export", "cancelled:1", "-o", "/nonexistent-kiln-test"])
        .output()
        .expect("run kiln export");
    assert!(!out.status.success(), "nothing was tagged");
}

/// Processes of a `kiln build` run with `KILN_STORE=store` (slirp4netns and the step's
/// keeper inherit its environment) or of the step `sleep <marker>`, as `pid: cmdline`.
fn processes_of(store: &Path, marker: u32) -> Vec<String> {
    let env_needle = format!("KILN_STORE={}", store.display());
    let cmd_needle = format!("sleep\0{marker}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let environ = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let ours = environ
            .split(|&b| b == 0)
            .any(|v| v == env_needle.as_bytes());
        if ours || String::from_utf8_lossy(&cmdline).contains(&cmd_needle) {
            found.push(format!(
                "{}: {}",
                e.file_name().to_string_lossy(),
                String::from_utf8_lossy(&cmdline).replace('\0', " ")
            ));
        }
    }
    found
}

/// Step cgroups named after the build process `pid` (`step-p<pid>s<start>-<n>`, or
/// `step-<pid>-<n>` as they were named before).
fn cgroups_of(pid: u32) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for parent in [
        "/sys/fs/cgroup/kiln",
        "/sys/fs/cgroup/memory/kiln",
        "/sys/fs/cgroup/pids/kiln",
    ] {
        for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("step-p{pid}s"))
                || name.starts_with(&format!("step-{pid}-"))
            {
                found.push(e.path());
            }
        }
    }
    found
}

/// Entries of `dir` whose names start with `prefix`.
fn entries(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Starts `kiln build` of a `RUN sleep <marker>` step (default network: slirp4netns runs),
/// SIGKILLs it once the step runs, and checks that no process of the build or its step is
/// left (each dies with its parent) while its step directory and lease are. Returns the
/// test directory, the store, the marker and the killed kiln's pid.
fn sigkill_during_run() -> (tempfile::TempDir, std::path::PathBuf, u32, u32) {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let marker = 600_000 + std::process::id() % 100_000;
    let (t, ctx, store) = setup(&format!("FROM {bb}\nRUN echo started; sleep {marker}\n"));
    let mut child = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "killed:1", "--progress", "plain", "--oci-only"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    let pid = child.id();
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let l = lines
            .next()
            .expect("kiln ended before the step started")
            .expect("read");
        if l.ends_with(" started") {
            break;
        }
    }
    assert!(
        processes_of(&store, marker)
            .iter()
            .any(|p| p.contains("slirp4netns")),
        "the step runs with slirp4netns: {:?}",
        processes_of(&store, marker)
    );
    child.kill().expect("SIGKILL kiln");
    child.wait().expect("wait");
    drop(lines);
    // Parent-death signals are sent as kiln exits; the processes take a moment to go.
    let t0 = std::time::Instant::now();
    let mut left = processes_of(&store, marker);
    while !left.is_empty() && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(100));
        left = processes_of(&store, marker);
    }
    assert!(
        left.is_empty(),
        "processes of the killed build left after 10 s: {left:?}"
    );
    // What only a later build or GC can clean up.
    assert_eq!(entries(&store.join(".build/run"), "step-").len(), 1);
    // One lease: its record and the parts later adds wrote (`leases/<id>~<n>`).
    let mut ids: Vec<String> = entries(&store.join("leases"), "build-")
        .into_iter()
        .map(|n| n.split('~').next().unwrap_or_default().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    (t, store, marker, pid)
}

/// `kill -9` of a build during a RUN leaves no process (slirp4netns, keeper, pid 1), and
/// `kiln store gc` then removes its step directory, cgroups and lease (75 minutes before the
/// lease would expire) and the unpacked layers.
#[test]
fn sigkilled_build_leaves_no_process_and_gc_cleans_up() {
    let (_t, store, _marker, pid) = sigkill_during_run();
    let out = kiln(&store)
        .args(["store", "gc", "--grace", "0s"])
        .output()
        .expect("run kiln store gc");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        entries(&store.join(".build/run"), "step-"),
        Vec::<String>::new()
    );
    // The lock and the boot stamp (kiln_builder::workdir::BOOT_STAMP) stay.
    let mut layers = entries(&store.join(".build/layers"), "");
    layers.sort();
    assert_eq!(layers, [".boot-id", ".lock"], "{stdout}");
    assert_eq!(
        entries(&store.join("leases"), ""),
        Vec::<String>::new(),
        "{stdout}"
    );
    assert_eq!(cgroups_of(pid), Vec::<std::path::PathBuf>::new());
}

/// The next build cleans up after a SIGKILLed one: step directory, cgroups and lease.
#[test]
fn next_build_cleans_up_after_a_sigkilled_build() {
    let (t, store, _marker, pid) = sigkill_during_run();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let ctx = t.path().join("ctx2");
    std::fs::create_dir(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), format!("FROM {bb}\nRUN true\n")).expect("write");
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "next:1", "--progress", "plain", "--oci-only"])
        .output()
        .expect("run kiln build");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        entries(&store.join(".build/run"), "step-"),
        Vec::<String>::new()
    );
    assert_eq!(entries(&store.join("leases"), ""), Vec::<String>::new());
    assert_eq!(cgroups_of(pid), Vec::<std::path::PathBuf>::new());
}

/// Bytes of the files below `dir` (apparent sizes), 0 when it does not exist.
fn bytes_below(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.map(|e| e.expect("dir entry"))
        .map(|e| {
            let md = e.metadata().expect("stat");
            if md.is_dir() {
                bytes_below(&e.path())
            } else {
                md.len()
            }
        })
        .sum()
}

/// Issue 17, case 4: `RUN truncate -s 16G` failed with "write limit of 10737418240 bytes
/// exceeded" (the limit counted apparent size), and a smaller sparse file became a layer of
/// gzip'd zeros that applying refused for its decompression ratio. The build succeeds; the
/// step's layer blob is under 1 MiB (GNU tar lists the file in it with its size); the ext4 image holds the file with its apparent size,
/// its data at 8 GiB and nearly no blocks, `e2fsck -fn` is clean; the image's chunks in the
/// store are a few MiB.
#[test]
fn a_16_gib_sparse_file_builds_into_a_small_layer_and_image() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, ctx, store) = setup(&format!(
        "FROM {bb}\nRUN mkdir -p /var && truncate -s 16G /var/sparse.img && printf kiln | dd of=/var/sparse.img \
         bs=1 seek=8589934592 conv=notrunc\n"
    ));
    let out = kiln(&store)
        .arg("build")
        .arg(&ctx)
        .args(["-t", "sparse:1", "--progress", "plain"])
        .output()
        .expect("run kiln");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let layout = t.path().join("layout");
    kiln_tests::run_ok(
        kiln(&store)
            .args(["export", "sparse:1", "--format", "oci", "-o"])
            .arg(&layout),
    );
    let json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&p).expect("read")).expect("json")
    };
    let blob = |d: &serde_json::Value| {
        let d = d.as_str().expect("a digest");
        layout.join("blobs/sha256").join(&d["sha256:".len()..])
    };
    let index = json(layout.join("index.json"));
    let manifest = json(blob(&index["manifests"][0]["digest"]));
    // The RUN layer is the one GNU tar lists the file in, with its apparent size (the last
    // layer is kiln's /etc/hostname one).
    let layers = manifest["layers"].as_array().expect("layers");
    let run: Vec<_> = layers
        .iter()
        .filter(|l| {
            let out = Command::new("tar")
                .arg("-tvzf")
                .arg(blob(&l["digest"]))
                .output()
                .expect("GNU tar");
            assert!(out.status.success(), "tar -tvzf {l}");
            let list = String::from_utf8_lossy(&out.stdout).into_owned();
            list.lines()
                .any(|l| l.ends_with("var/sparse.img") && l.contains(" 17179869184 "))
        })
        .collect();
    assert_eq!(run.len(), 1, "one layer holds var/sparse.img: {layers:?}");
    let size = run[0]["size"].as_u64().expect("a size");
    assert!(size < 1 << 20, "the RUN layer blob has {size} bytes");
    assert_eq!(
        std::fs::metadata(blob(&run[0]["digest"]))
            .expect("blob")
            .len(),
        size
    );

    let ext4 = t.path().join("rootfs.ext4");
    kiln_tests::run_ok(
        kiln(&store)
            .args(["export", "sparse:1", "--format", "ext4", "-o"])
            .arg(&ext4),
    );
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(&ext4)
        .output()
        .expect("e2fsck missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let debugfs = |req: &str| {
        let out = Command::new("debugfs")
            .args(["-R", req])
            .arg(&ext4)
            .output()
            .expect("debugfs missing: run ci/setup.sh");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let stat = debugfs("stat /var/sparse.img");
    assert!(stat.contains("Size: 17179869184"), "{stat}");
    let blocks: u64 = stat
        .split("Blockcount: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no Blockcount in {stat}"));
    assert!(
        blocks <= 64,
        "Blockcount {blocks} (512-byte units):\n{stat}"
    );
    let extents = debugfs("dump_extents /var/sparse.img");
    assert!(
        extents.contains("2097152"),
        "no data block at 8 GiB:\n{extents}"
    );
    let image = std::fs::metadata(&ext4).expect("image").len();
    assert!(image < 1 << 30, "a {image}-byte image");
    // Loose chunk files and packs (an upload's chunks share one pack).
    let chunks = bytes_below(&store.join("chunks")) + bytes_below(&store.join(".packs"));
    assert!(
        chunks > 0 && chunks < 16 << 20,
        "{chunks} bytes of chunks in the store"
    );
}

/// `--network` and `--network-allow` set every step's network over the recipe's: the step's
/// log shows which interfaces it has (with `--network host`, the host's) and whether it got
/// the egress proxy; contradicting flags, `--network host` without its entitlement and a
/// bad entry are refused before anything runs.
#[test]
fn network_flags_set_every_steps_network() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (_t, ctx, store) = setup(&format!(
        "FROM {bb}\nRUN x=nets; echo \"$x:$(ls /sys/class/net | tr '\\n' ,) proxy=${{HTTP_PROXY:-unset}}\"\n"
    ));
    let step_line = |flags: &[&str]| {
        let out = kiln(&store)
            .args(["build", "--oci-only", "--progress", "plain"])
            .args(flags)
            .arg(&ctx)
            .output()
            .expect("run kiln");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{flags:?}: {stderr}");
        stderr
            .lines()
            .find_map(|l| l.find("nets:").map(|i| l[i..].to_string()))
            .unwrap_or_else(|| panic!("{flags:?}: no step output in {stderr}"))
    };
    let default = step_line(&[]);
    assert!(
        default.contains("proxy=unset") && default.trim_start_matches("nets:").contains("tap0"),
        "slirp4netns's tap0: {default}"
    );
    assert_eq!(step_line(&["--network", "none"]), "nets:lo, proxy=unset");
    // `docker build --network host`: the step is in this process's network namespace (the
    // host's), a `none` step still in one of its own.
    let (_t2, ctx2, store2) = setup(&format!(
        "FROM {bb}\nRUN x=netns; echo \"$x:$(readlink /proc/self/ns/net)\"\n\
         RUN --network=none x=nonens; echo \"$x:$(readlink /proc/self/ns/net)\"\n"
    ));
    let netns = |flags: &[&str]| {
        let out = kiln(&store2)
            .args([
                "build",
                "--oci-only",
                "--progress",
                "plain",
                "--network",
                "host",
            ])
            .args(flags)
            .arg(&ctx2)
            .output()
            .expect("run kiln");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{flags:?}: {stderr}");
        let line = |tag: &str| {
            stderr
                .lines()
                .find_map(|l| l.find(tag).map(|i| l[i + tag.len()..].trim().to_string()))
                .unwrap_or_else(|| panic!("{flags:?}: no {tag} in {stderr}"))
        };
        (line("netns:"), line("nonens:"))
    };
    let ours = std::fs::read_link("/proc/self/ns/net").expect("our network namespace");
    let (host, none) = netns(&["--allow", "network.host"]);
    assert_eq!(host, ours.to_string_lossy(), "--network host");
    assert!(
        none.starts_with("net:[") && none != host,
        "RUN --network=none: {none}"
    );
    assert_eq!(
        step_line(&[
            "--network-allow",
            "pypi.example",
            "--network-deny",
            "*.cdn.example"
        ]),
        "nets:lo, proxy=http://127.0.0.1:3128"
    );
    for (flags, want) in [
        (
            &["--network", "none", "--network-allow", "pypi.example"][..],
            "--network none and --network-allow contradict each other",
        ),
        (
            &["--network-allow", "10.0.0.1/99"][..],
            "--network-allow entry",
        ),
        (
            &["--network", "none", "--allow", "network.host"][..],
            "--network none and --allow network.host contradict each other",
        ),
        (
            &["--network", "host"][..],
            "--network host needs the network.host entitlement (--allow network.host)",
        ),
        (
            &[
                "--network",
                "host",
                "--allow",
                "network.host",
                "--network-allow",
                "a.example",
            ][..],
            "--network host and --network-allow contradict each other",
        ),
    ] {
        let out = kiln(&store)
            .args(["build", "--oci-only"])
            .args(flags)
            .arg(&ctx)
            .output()
            .expect("run kiln");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(want),
            "{flags:?}: {stderr}"
        );
    }
}

/// `kiln` with a store, work, cache and state directories of its own under `dir` (named
/// by `label`, all fresh), and `SOURCE_DATE_EPOCH` in its environment set to `epoch` (`None`:
/// not set).
fn fresh_kiln(dir: &Path, label: &str, epoch: Option<&str>) -> Command {
    let mut c = kiln(&dir.join(format!("store-{label}")));
    c.env("KILN_BUILD_DIR", dir.join(format!("work-{label}")))
        .env("KILN_CACHE", dir.join(format!("cache-{label}")))
        .env("KILN_STATE_DIR", dir.join(format!("state-{label}")));
    if let Some(e) = epoch {
        c.env("SOURCE_DATE_EPOCH", e);
    }
    c
}

/// What one [`build_fresh`] gave.
struct Fresh {
    /// The image manifest digest (the last stdout line).
    manifest: String,
    /// The OCI manifest digest (`--iidfile`).
    oci: String,
    /// The ext4 image, exported from the build's store.
    ext4: PathBuf,
}

/// `--build-context` for a `FROM bb` of the busybox fixture's OCI layout (no registry).
fn busybox_layout() -> String {
    format!(
        "bb=oci-layout://{}:latest",
        require_env("KILN_TEST_BUSYBOX_OCI")
    )
}

/// `kiln build CTX -t repro:1 --build-context` [`busybox_layout`] `FLAGS` by
/// [`fresh_kiln`]`(dir, label, epoch)`; fails the test if the build fails.
fn build_fresh(dir: &Path, ctx: &Path, label: &str, flags: &[&str], epoch: Option<&str>) -> Fresh {
    build_fresh_with(dir, ctx, label, flags, epoch, &[])
}

/// [`build_fresh`] with `envs` set for the build too.
fn build_fresh_with(
    dir: &Path,
    ctx: &Path,
    label: &str,
    flags: &[&str],
    epoch: Option<&str>,
    envs: &[(&str, &Path)],
) -> Fresh {
    let iid = dir.join(format!("iid-{label}"));
    let mut build = fresh_kiln(dir, label, epoch);
    build.envs(envs.iter().copied());
    let out = kiln_tests::run_ok(
        build
            .arg("build")
            .arg(ctx)
            .args(["-t", "repro:1", "--progress", "plain"])
            .args(["--build-context", &busybox_layout()])
            .args(flags)
            .arg("--iidfile")
            .arg(&iid),
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let manifest = stdout.lines().last().expect("a line").to_string();
    let oci = std::fs::read_to_string(&iid).expect("iid");
    let ext4 = dir.join(format!("{label}.ext4"));
    kiln_tests::run_ok(
        fresh_kiln(dir, label, None)
            .args(["store", "export", "repro:1"])
            .arg(&ext4),
    );
    Fresh {
        manifest,
        oci,
        ext4,
    }
}

/// A recipe `FROM bb` (the busybox fixture, [`busybox_layout`]) whose steps write files with
/// the times they run as mtimes: a `RUN` step writes files of several owners, a symlink with
/// an owner of its own, a hard link, a directory, an empty file made by `touch`, and removes
/// a base file; `WORKDIR` makes two directories; `COPY` copies context files (the
/// Dockerfile, a directory tree) and `ADD` unpacks a local archive ([`write_context`]).
/// Another stage's step writes files with mtimes past and before the epoch, which `COPY
/// --from` copies.
fn repro_recipe() -> (tempfile::TempDir, PathBuf) {
    let (t, ctx, _) = setup(
        "FROM bb AS one\n\
         RUN mkdir -p /built && echo x > /built/x \
         && touch -d '2100-01-01 00:00:00' /built/future \
         && touch -d '2000-01-01 00:00:00' /built/past\n\
         FROM bb\n\
         RUN mkdir -p /d/e && echo hi > /d/f && ln -s f /d/l && touch /d/e/t \
         && rm /bin/vi && echo 'u:x:4242:4242::/d:/bin/sh' >> /etc/passwd \
         && chown u:4242 /d/f && echo two > /d/g && chown 1000:100 /d/g \
         && chown -h 4243:4244 /d/l && chown 65534:65534 /d/e && ln /d/f /d/hard\n\
         WORKDIR /w/inner\n\
         COPY Dockerfile /copied\n\
         COPY sub /ctx/sub\n\
         ADD local.tar /unpacked/\n\
         COPY --from=one /built /from-one\n",
    );
    write_context(&ctx);
    (t, ctx)
}

/// Writes `ctx`'s files (again), as a fresh checkout does: the same bytes, with the current
/// time as their mtimes. The Dockerfile, `sub/deeper/c.txt`, and `local.tar`, an archive of
/// `tarme/t.txt` whose entry has the current time as its mtime (whole seconds, as tar keeps
/// them).
fn write_context(ctx: &Path) {
    let p = ctx.join("Dockerfile");
    let bytes = std::fs::read(&p).expect("read");
    std::fs::write(&p, bytes).expect("write");
    std::fs::create_dir_all(ctx.join("sub/deeper")).expect("mkdir");
    std::fs::write(ctx.join("sub/deeper/c.txt"), "c\n").expect("write");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let mut archive = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_size(2);
    h.set_mtime(now);
    archive
        .append_data(&mut h, "tarme/t.txt", &b"t\n"[..])
        .expect("tar");
    std::fs::write(ctx.join("local.tar"), archive.into_inner().expect("tar")).expect("write");
}

/// Issue 34, a base unpacked once per host: a build into a fresh store (its own work, cache
/// and state directories) with the host's shared layer directory (`KILN_LAYER_DIR`) of an
/// earlier build into another store finds its base's layers there, unpacked by the earlier
/// build, and unpacks none again (the same directories, the same inodes, none of them in its
/// own work directory), and gives the same image. The steps' own layers stay in each build's
/// work directory; `kiln store gc` then empties the shared directory, as no build runs.
#[test]
fn a_second_store_reuses_the_hosts_unpacked_base() {
    let (t, ctx) = repro_recipe();
    let shared = t.path().join("host-layers");
    let epoch = ["--build-arg", "SOURCE_DATE_EPOCH=1700000000"];
    let envs = [("KILN_LAYER_DIR", shared.as_path())];
    let unpacked = || -> std::collections::BTreeMap<String, u64> {
        std::fs::read_dir(&shared)
            .expect("the shared layer directory")
            .map(|e| e.expect("entry"))
            .filter(|e| e.file_name().len() == 64)
            .map(|e| {
                let ino = std::os::unix::fs::MetadataExt::ino(&e.metadata().expect("stat"));
                (e.file_name().to_string_lossy().into_owned(), ino)
            })
            .collect()
    };
    let a = build_fresh_with(t.path(), &ctx, "a", &epoch, None, &envs);
    let first = unpacked();
    assert!(
        !first.is_empty(),
        "the base was unpacked into {}",
        shared.display()
    );
    let own = |label: &str| -> Vec<String> {
        std::fs::read_dir(t.path().join(format!("work-{label}/layers")))
            .expect("the work directory's layers")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.len() == 64)
            .collect()
    };
    let own_a = own("a");
    assert!(
        !own_a.is_empty(),
        "the steps' layers are the work directory's"
    );
    assert!(own_a.iter().all(|n| !first.contains_key(n)), "{own_a:?}");
    let b = build_fresh_with(t.path(), &ctx, "b", &epoch, None, &envs);
    assert_eq!(
        unpacked(),
        first,
        "the same directories, not unpacked again"
    );
    let own_b = own("b");
    assert!(own_b.iter().all(|n| !first.contains_key(n)), "{own_b:?}");
    assert_eq!(a.manifest, b.manifest, "image manifest digest");
    assert_eq!(a.oci, b.oci, "OCI manifest digest");
    kiln_tests::assert_same_bytes(&a.ext4, &b.ext4);
    // And the same image as a build with a shared directory of its own.
    let c = build_fresh(t.path(), &ctx, "c", &epoch, None);
    assert_eq!(a.manifest, c.manifest, "image manifest digest");

    let gc = kiln_tests::run_ok(
        fresh_kiln(t.path(), "b", None)
            .env("KILN_LAYER_DIR", &shared)
            .args(["store", "gc", "--grace", "0s"]),
    );
    assert!(
        unpacked().is_empty(),
        "{}",
        String::from_utf8_lossy(&gc.stdout)
    );
}

/// Issue 34, reproducible: [`repro_recipe`] built twice with `SOURCE_DATE_EPOCH` into fresh
/// stores with fresh work, cache and state directories, a second apart and with the context
/// written again in between (so every file the steps write, copy and unpack gets another
/// mtime), gives the same image manifest digest, the same OCI manifest and the same ext4
/// bytes, with those mtimes clamped to the epoch. (Here and not in `tests/tests/ext4_images.rs`: only this package's tests have the
/// `kiln` binary.) [`without_source_date_epoch_builds_a_second_apart_differ`] shows the same
/// builds differ without it.
#[test]
fn a_build_with_a_run_step_is_reproducible_into_fresh_stores() {
    let (t, ctx) = repro_recipe();
    let epoch = ["--build-arg", "SOURCE_DATE_EPOCH=1700000000"];
    let a = build_fresh(t.path(), &ctx, "a", &epoch, None);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write_context(&ctx);
    let b = build_fresh(t.path(), &ctx, "b", &epoch, None);
    assert_eq!(a.manifest, b.manifest, "image manifest digest");
    assert_eq!(a.oci, b.oci, "OCI manifest digest");
    kiln_tests::assert_same_bytes(&a.ext4, &b.ext4);
    // What the step wrote is in the image as written, mtimes clamped to the epoch.
    let tree = kiln_tests::ext4::image_tree(&a.ext4);
    let at = |p: &str| {
        let o = tree
            .get(p)
            .unwrap_or_else(|| panic!("{p} not in the image"));
        (o.kind, o.uid, o.gid, o.mtime)
    };
    assert_eq!(at("d/f"), ('f', 4242, 4242, 1_700_000_000));
    assert_eq!(at("d/hard"), ('f', 4242, 4242, 1_700_000_000));
    assert_eq!(at("d/g"), ('f', 1000, 100, 1_700_000_000));
    assert_eq!(at("d/l"), ('l', 4243, 4244, 1_700_000_000));
    assert_eq!(at("d/e"), ('d', 65534, 65534, 1_700_000_000));
    assert_eq!(at("d/e/t"), ('f', 0, 0, 1_700_000_000));
    assert_eq!(at("w/inner"), ('d', 0, 0, 1_700_000_000));
    assert_eq!(at("copied"), ('f', 0, 0, 1_700_000_000));
    assert_eq!(at("ctx/sub/deeper"), ('d', 0, 0, 1_700_000_000));
    assert_eq!(at("ctx/sub/deeper/c.txt"), ('f', 0, 0, 1_700_000_000));
    assert_eq!(at("unpacked/tarme/t.txt"), ('f', 0, 0, 1_700_000_000));
    assert_eq!(at("from-one/future"), ('f', 0, 0, 1_700_000_000));
    // An mtime before the epoch is kept (clamped, not set).
    assert_eq!(at("from-one/past"), ('f', 0, 0, 946_684_800));
    assert!(!tree.contains_key("bin/vi"), "the removed base file");
}

/// The control of [`a_build_with_a_run_step_is_reproducible_into_fresh_stores`]: the same
/// two builds without `SOURCE_DATE_EPOCH` (neither the build arg nor the environment) give
/// two image manifests and two OCI manifests. Guaranteed, not by chance: without it the
/// layer keeps each file's mtime (whole seconds, `kiln_builder::layer::write`), the step
/// writes `/d/f` when it runs, and the second build runs more than a second after the first
/// (the wall clock would have to step back for them to meet). So the first test's equality
/// is the epoch's work, and it would fail if the clamp did not happen.
#[test]
fn without_source_date_epoch_builds_a_second_apart_differ() {
    let (t, ctx) = repro_recipe();
    let a = build_fresh(t.path(), &ctx, "a", &[], None);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write_context(&ctx);
    let b = build_fresh(t.path(), &ctx, "b", &[], None);
    assert_ne!(a.manifest, b.manifest, "image manifest digest");
    assert_ne!(a.oci, b.oci, "OCI manifest digest");
    let (ta, tb) = (
        kiln_tests::ext4::image_tree(&a.ext4),
        kiln_tests::ext4::image_tree(&b.ext4),
    );
    let (ma, mb) = (ta["d/f"].mtime, tb["d/f"].mtime);
    assert!(
        ma > 1_700_000_000 && mb > ma,
        "/d/f written at {ma}, then at {mb}: the times the step ran"
    );
}

/// As `docker buildx build` does, `kiln build` takes a `SOURCE_DATE_EPOCH` in its
/// environment as `--build-arg SOURCE_DATE_EPOCH`: [`repro_recipe`] built with the variable
/// alone gives the image manifest of the build with the build arg alone (fresh stores, a
/// second apart, the context written again); an explicit `--build-arg` wins over the
/// variable (the variable set to another epoch, the build arg to the same one: the same
/// image manifest again).
#[test]
fn source_date_epoch_in_the_environment_is_the_build_arg() {
    let (t, ctx) = repro_recipe();
    let arg = build_fresh(
        t.path(),
        &ctx,
        "arg",
        &["--build-arg", "SOURCE_DATE_EPOCH=1700000000"],
        None,
    );
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write_context(&ctx);
    let env = build_fresh(t.path(), &ctx, "env", &[], Some("1700000000"));
    assert_eq!(
        env.manifest, arg.manifest,
        "the environment's SOURCE_DATE_EPOCH gives the build arg's image"
    );
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write_context(&ctx);
    let both = build_fresh(
        t.path(),
        &ctx,
        "both",
        &["--build-arg", "SOURCE_DATE_EPOCH=1700000000"],
        Some("1600000000"),
    );
    assert_eq!(
        both.manifest, arg.manifest,
        "an explicit --build-arg SOURCE_DATE_EPOCH wins over the environment"
    );
}

/// A `SOURCE_DATE_EPOCH` in `kiln build`'s (and `kiln plan`'s) environment that is not Unix
/// seconds fails as the same `--build-arg` does: the same exit code and the same stderr (the
/// error naming the value and what was expected, at the recipe's first line), before any
/// step runs.
#[test]
fn an_invalid_source_date_epoch_in_the_environment_fails_as_the_build_arg_does() {
    let (t, ctx) = repro_recipe();
    for (value, want) in [
        ("yesterday", "expected a decimal number of seconds"),
        ("253402300800", "expected Unix seconds up to 253402300799"),
    ] {
        let flag = format!("SOURCE_DATE_EPOCH={value}");
        let run = |cmd: &mut Command| {
            let out = cmd.output().expect("run kiln");
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(!out.status.success(), "{value}: {stderr}");
            assert!(stderr.contains(want), "{value}: {stderr}");
            assert!(!stderr.contains("RUN mkdir"), "no step ran: {stderr}");
            (out.status.code(), stderr)
        };
        let by_arg = run(fresh_kiln(t.path(), "arg", None)
            .arg("build")
            .arg(&ctx)
            .args(["--progress", "plain", "--build-context", &busybox_layout()])
            .args(["--build-arg", &flag]));
        let by_env = run(fresh_kiln(t.path(), "env", Some(value))
            .arg("build")
            .arg(&ctx)
            .args(["--progress", "plain", "--build-context", &busybox_layout()]));
        assert_eq!(by_env, by_arg, "kiln build, SOURCE_DATE_EPOCH={value}");
        let dockerfile = ctx.join("Dockerfile");
        let by_arg = run(fresh_kiln(t.path(), "arg", None)
            .arg("plan")
            .arg(&dockerfile)
            .args(["--build-arg", &flag]));
        let by_env = run(fresh_kiln(t.path(), "env", Some(value))
            .arg("plan")
            .arg(&dockerfile));
        assert_eq!(by_env, by_arg, "kiln plan, SOURCE_DATE_EPOCH={value}");
    }
}

/// Issue 36: a build whose steps run in the user namespace (the default: the subordinate
/// ids of `kiln`, `ci/setup.sh`) gives the same image manifest digest, so the same layers and
/// cache keys, as the same build with `KILN_STEP_USERNS=host` (steps as host root). The
/// steps write files of several owners (root, 1000, 4242, 65534, set as the step's `USER`
/// and by chown), setuid and sticky bits, a hard link, a FIFO, a symlink, a whiteout (a
/// removed base file), an opaque directory (a base directory removed and made again), a
/// changed base file and a cache mount's contents.
#[test]
fn steps_in_the_user_namespace_give_the_layers_of_host_root_steps() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, ctx, _) = setup(&format!(
        "FROM {bb}\n\
         RUN echo 'u:x:4242:4242::/home/u:/bin/sh' >> /etc/passwd \
         && echo 'u:x:4242:' >> /etc/group && mkdir -p /home/u /d/e && chown 4242:4242 /home/u \
         && echo hi > /d/f && ln /d/f /d/hard && ln -s f /d/l && mkfifo /d/fifo \
         && chown 1000:1000 /d/f && chown 65534:65534 /d/e && chmod 4755 /d/f \
         && chmod 1777 /d/e && rm /bin/vi && rm -rf /etc/network && mkdir /etc/network \
         && chmod 0775 /bin/busybox\n\
         RUN --mount=type=cache,target=/cache,uid=4242 echo cached > /cache/c \
         && cp -a /cache/c /d/from-cache && stat -c '%u:%g %a %n' /cache /cache/c > /d/cache-owners\n\
         USER u\n\
         RUN echo mine > /home/u/mine && id > /home/u/id\n"
    ));
    let (userns, host) = digests_with_and_without_userns(t.path(), &ctx);
    assert_eq!(
        userns, host,
        "image manifest digest in the user namespace and as host root"
    );
}

/// The image manifest digests of `ctx` built into two fresh stores under `dir`, with
/// `SOURCE_DATE_EPOCH` set: with the steps' user namespace (the default), then with
/// `KILN_STEP_USERNS=host`.
fn digests_with_and_without_userns(dir: &Path, ctx: &Path) -> (String, String) {
    let build = |userns: &str| {
        let store = dir.join(format!("store-userns-{userns}"));
        let out = kiln_tests::run_ok(
            kiln(&store)
                .env("KILN_STEP_USERNS", userns)
                .arg("build")
                .arg(ctx)
                .args(["-t", "userns:1", "--progress", "plain"])
                .args(["--build-arg", "SOURCE_DATE_EPOCH=1700000000"]),
        );
        let stdout = String::from_utf8(out.stdout).expect("utf-8");
        stdout.lines().last().expect("a line").to_string()
    };
    (build(""), build("host"))
}

/// Issue 36, found by the attack pass: a bind mount of the context shows its files owned by
/// 0:0 (as BuildKit resets the context's owners), whatever their owners on the host and with
/// or without `.dockerignore`: a 0600 file and a 0700 directory of host uid 1234567 (past
/// the steps' user namespace) are readable by the step and copied as root's, and the image
/// digest is the same with and without the user namespace.
#[test]
fn a_context_bind_shows_root_owned_files_whatever_the_host_owners() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, ctx, _) = setup(&format!(
        "FROM {bb}\n\
         RUN --mount=type=bind,target=/ctx cp -a /ctx/pub /pub-copy \
         && cat /ctx/priv/f > /priv-copy && stat -c '%u:%g %a %n' /ctx/pub /ctx/priv > /owners\n"
    ));
    std::fs::write(ctx.join("pub"), "pub\n").expect("write");
    std::fs::create_dir(ctx.join("priv")).expect("mkdir");
    std::fs::write(ctx.join("priv/f"), "priv\n").expect("write");
    use std::os::unix::fs::PermissionsExt;
    for (p, mode) in [("pub", 0o600), ("priv/f", 0o600), ("priv", 0o700)] {
        let p = ctx.join(p);
        std::os::unix::fs::chown(&p, Some(1_234_567), Some(1_234_567)).expect("chown");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let (userns, host) = digests_with_and_without_userns(t.path(), &ctx);
    assert_eq!(
        userns, host,
        "image digest with and without the user namespace"
    );
}

/// Issue 41: `RUN --security=insecure` fails the build before any step runs, naming the
/// file, line and flag, unless `--allow security.insecure` is given; with it, the step can
/// mount (a capability Docker's default set lacks) and has every capability.
#[test]
fn security_insecure_needs_allow_security_insecure() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (_t, ctx, store) = setup(&format!(
        "FROM {bb}\nRUN echo ran-$((40+2))\n\
         RUN --security=insecure mkdir -p /mnt && mount -t tmpfs none /mnt && grep CapEff /proc/self/status \
         && echo insecure-$((40+2))\n"
    ));
    let build = |flags: &[&str]| {
        let out = kiln(&store)
            .args(["build", "--oci-only", "--progress", "plain"])
            .args(flags)
            .arg(&ctx)
            .output()
            .expect("run kiln");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, stderr) = build(&[]);
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(
            "Dockerfile:3: RUN --security=insecure needs the security.insecure entitlement"
        ) && stderr.contains("--allow security.insecure"),
        "{stderr}"
    );
    assert!(!stderr.contains("ran-42"), "a step ran: {stderr}");
    let (ok, stderr) = build(&["--allow", "bogus"]);
    assert!(
        !ok && stderr.contains("network.host and security.insecure"),
        "{stderr}"
    );
    let (ok, stderr) = build(&["--allow", "security.insecure"]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("insecure-42"), "{stderr}");
}

/// Issue 41: `kiln build --ssh default` gives a `RUN --mount=type=ssh` step the socket of
/// `$SSH_AUTH_SOCK` at `/run/buildkit/ssh_agent.0`, named by `SSH_AUTH_SOCK`; the agent's
/// path is not in the cache key (another socket: a cache hit); without `--ssh` an optional
/// mount is left out and a `required` one fails the build naming the line and the flag.
#[test]
fn ssh_mount_gets_the_agent_of_dash_dash_ssh() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (t, ctx, store) = setup(&format!(
        "FROM {bb}\n\
         RUN --mount=type=ssh test -S \"$SSH_AUTH_SOCK\" && echo \"ssh-$((40+2)) $SSH_AUTH_SOCK\"\n"
    ));
    // A listening socket stands in for the agent (the step only checks it is there).
    let sock = |n: u32| {
        let p = t.path().join(format!("agent{n}.sock"));
        (std::os::unix::net::UnixListener::bind(&p).expect("bind"), p)
    };
    let build = |ctx: &Path, flags: &[&str], agent: Option<&Path>| {
        let mut c = kiln(&store);
        c.args(["build", "--oci-only", "--progress", "plain"])
            .args(flags)
            .arg(ctx);
        match agent {
            Some(a) => c.env("SSH_AUTH_SOCK", a),
            None => c.env_remove("SSH_AUTH_SOCK"),
        };
        let out = c.output().expect("run kiln");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (_l1, a1) = sock(1);
    let (ok, stderr) = build(&ctx, &["--ssh", "default"], Some(&a1));
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("ssh-42 /run/buildkit/ssh_agent.0"),
        "{stderr}"
    );
    let (_l2, a2) = sock(2);
    let (ok, stderr) = build(&ctx, &["--ssh", &format!("default={}", a2.display())], None);
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("ssh-42"), "the step ran again: {stderr}");
    // `--ssh default` without SSH_AUTH_SOCK is a usage error.
    let (ok, stderr) = build(&ctx, &["--ssh", "default"], None);
    assert!(
        !ok && stderr.contains("SSH_AUTH_SOCK is not set"),
        "{stderr}"
    );

    let req = t.path().join("req");
    std::fs::create_dir(&req).expect("mkdir");
    std::fs::write(
        req.join("Dockerfile"),
        format!(
            "FROM {bb}\nRUN --mount=type=ssh echo optional-${{SSH_AUTH_SOCK}}-$(test -S /run/buildkit/ssh_agent.0 && echo there || echo absent)\n\
             RUN --mount=type=ssh,id=gh,required=true true\n"
        ),
    )
    .expect("write");
    let (ok, stderr) = build(&req, &[], None);
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(
            "Dockerfile:3: RUN --mount=type=ssh: SSH agent \"gh\" is required but was not given (kiln build --ssh gh[=SOCKET])"
        ),
        "{stderr}"
    );
    let (ok, stderr) = build(&req, &["--ssh", &format!("gh={}", a1.display())], None);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("optional-/run/buildkit/ssh_agent.0-absent"),
        "{stderr}"
    );
}
