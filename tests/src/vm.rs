//! Shared by the VM tests and the clone benchmark: the guest kernel and initramfs, and a
//! small busybox image in a store.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use kiln_store::artifact::PutArtifactOptions;
use kiln_store::{ImageManifest, Manifest, SandboxSpec, StartSpec, Store, TagRef};
use kiln_vmm::initramfs;
use kiln_vmm::kernel::KernelRecipe;
use kiln_vmm::snapshot::BootAssets;

use crate::require_env;

/// The host's static busybox (Debian's `busybox-static`, installed by `ci/setup.sh`).
pub const BUSYBOX: &str = "/usr/bin/busybox";

/// A busybox root at `root` for VM steps: the static busybox and its applets in `/bin`,
/// root in `/etc/passwd` and `/etc/group`, an empty `/tmp`. Returns `root`. Asserts that
/// this process is root (VM steps need it) and that [`BUSYBOX`] exists.
pub fn busybox_root(root: &Path) -> PathBuf {
    assert!(
        rustix::process::geteuid().is_root(),
        "VM step tests need root (CI runs them as root)"
    );
    assert!(
        Path::new(BUSYBOX).exists(),
        "{BUSYBOX} missing: run ci/setup.sh (installs busybox-static)"
    );
    for d in ["bin", "etc", "tmp"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy(BUSYBOX, root.join("bin/busybox")).unwrap();
    let list = std::process::Command::new(BUSYBOX)
        .arg("--list")
        .output()
        .unwrap();
    for applet in String::from_utf8(list.stdout).unwrap().lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
        }
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    root.to_path_buf()
}

/// The guest kernel (vmlinux) and initramfs: `KILN_TEST_KERNEL` and `KILN_TEST_INITRAMFS`
/// when `ci/setup.sh` exported them and that initramfs's stamp ([`init_stamp`]) names this
/// checkout's guest init sources ([`guest_init_sources_digest`]), else built once per process
/// like `ci/setup.sh` does (the kernel of `base-images/kernel.yaml` fetched into
/// `KILN_TEST_CACHE`, kiln-guest-init built static from this checkout), so that a test never
/// boots an init older than the code it tests (a worktree whose env file names another
/// checkout's initramfs).
pub fn guest_assets() -> BootAssets {
    static A: OnceLock<BootAssets> = OnceLock::new();
    A.get_or_init(|| {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace is the parent of tests/")
            .to_path_buf();
        let sources = guest_init_sources_digest(&workspace);
        if let (Ok(k), Ok(i)) = (
            std::env::var("KILN_TEST_KERNEL"),
            std::env::var("KILN_TEST_INITRAMFS"),
        ) {
            let stamp = std::fs::read_to_string(init_stamp(Path::new(&i))).unwrap_or_default();
            if stamp.trim() == sources {
                return BootAssets {
                    kernel: k.into(),
                    initramfs: i.into(),
                };
            }
            eprintln!(
                "KILN_TEST_INITRAMFS={i} was not built from this checkout's guest init \
                 sources: building the init from this checkout"
            );
        }
        let cache = PathBuf::from(require_env("KILN_TEST_CACHE"));
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace.join("target"))
            .join("guest-init");
        let init = initramfs::build_guest_init(&workspace, &target).expect("build the init");
        let a = initramfs::guest_artifacts(&cache, &KernelRecipe::shipped(), &init)
            .expect("kernel and initramfs");
        let _ = std::fs::write(init_stamp(&a.initramfs.path), &sources);
        BootAssets {
            kernel: a.kernel.vmlinux(),
            initramfs: a.initramfs.path,
        }
    })
    .clone()
}

/// The file beside an initramfs that holds the [`guest_init_sources_digest`] of the sources
/// its init was built from: `<initramfs>.init-sources`.
pub fn init_stamp(initramfs: &Path) -> PathBuf {
    let mut s = initramfs.as_os_str().to_owned();
    s.push(".init-sources");
    PathBuf::from(s)
}

/// The sha256 (hex) of what kiln-guest-init is built from in the workspace `workspace`: every
/// file under `vmm/guest/` (by relative path, sorted; `target` directories left out) and
/// `Cargo.lock`, each as its path, a NUL, its length and its bytes.
pub fn guest_init_sources_digest(workspace: &Path) -> String {
    use sha2::{Digest, Sha256};
    let root = workspace.join("vmm/guest");
    let mut files = vec![workspace.join("Cargo.lock")];
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() && e.file_name() != "target" => stack.push(p),
                Ok(t) if t.is_file() => files.push(p),
                _ => {}
            }
        }
    }
    files.sort();
    let mut h = Sha256::new();
    for f in files {
        let rel = f.strip_prefix(workspace).unwrap_or(&f);
        let data = std::fs::read(&f).unwrap_or_default();
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update([0]);
        h.update((data.len() as u64).to_le_bytes());
        h.update(&data);
    }
    format!("{:x}", h.finalize())
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (see ci/setup.sh)"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The kiln binary `bin` (a test's `env!("CARGO_BIN_EXE_kiln")`) set up for one VM test: its
/// store (`dir/store`), state dir (`dir/state`) and snapshot cache (`dir/cache`), the guest
/// kernel and initramfs of [`guest_assets`], and `TMPDIR=dir`.
pub fn kiln_in(bin: &str, dir: &Path) -> Command {
    let a = guest_assets();
    let mut c = Command::new(bin);
    c.env("KILN_STORE", dir.join("store"))
        .env("KILN_STATE_DIR", dir.join("state"))
        .env("KILN_SNAPSHOT_CACHE", dir.join("cache"))
        .env("KILN_LAYER_DIR", dir.join("host-layers"))
        .env("KILN_KERNEL", &a.kernel)
        .env("KILN_INITRAMFS", &a.initramfs)
        .env("TMPDIR", dir);
    c
}

/// Stops every clone of a VM test's state directory when dropped, so that a test that fails
/// or panics half-way leaves no QEMU or chunk server running: with `kiln stop --all` for the
/// clones a `kiln` binary started ([`StopClones::new`]), with `kiln_vmm`'s own
/// [`clone::list`](kiln_vmm::clone::list) and [`clone::stop`](kiln_vmm::clone::stop) for the
/// clones a test started through the library ([`StopClones::library`]). Declare it
/// after the temporary directory it names, so it drops first.
pub struct StopClones {
    how: Stopper,
    /// The directory under which the clones' mounts are waited for after the stop.
    dir: PathBuf,
}

/// How [`StopClones`] stops the clones.
enum Stopper {
    /// `bin stop --all`, set up by [`kiln_in`].
    Binary(String),
    /// `clone::list` and `clone::stop` on this state directory.
    Library(PathBuf),
}

impl StopClones {
    /// A guard for the clones [`kiln_in`]`(bin, dir)` starts.
    pub fn new(bin: &str, dir: &Path) -> Self {
        Self {
            how: Stopper::Binary(bin.to_string()),
            dir: dir.to_path_buf(),
        }
    }

    /// A guard for the clones a test starts through `kiln_vmm::clone` with `state_dir` as
    /// their state directory ([`CloneOptions`](kiln_vmm::clone::CloneOptions)), whose
    /// snapshot cache directories (where lazy clones mount) are under `dir`.
    pub fn library(dir: &Path, state_dir: &Path) -> Self {
        Self {
            how: Stopper::Library(state_dir.to_path_buf()),
            dir: dir.to_path_buf(),
        }
    }
}

/// Stops every clone recorded under `state_dir`, as `kiln stop --all` does, on a thread
/// with a runtime of its own: the guard is dropped inside a test's `block_on` (where
/// another `block_on` would panic), as well as outside any runtime.
fn stop_all_in(state_dir: &Path) {
    let state_dir = state_dir.to_path_buf();
    let stopper = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            for c in kiln_vmm::clone::list(&state_dir).unwrap_or_default() {
                let _ = kiln_vmm::clone::stop(&state_dir, &c.id).await;
            }
        });
    });
    let _ = stopper.join();
}

impl Drop for StopClones {
    /// Stops every clone, then waits (at most 15 s) for the mounts under the directory to
    /// go: a lazy clone's chunk server unmounts on its own once its last clone has closed
    /// its files (`vmm`'s `lazy` module doc), not at once, and a `TempDir` dropped before
    /// that could not remove its mount point and left the whole directory in `/tmp` (0.5 GB
    /// a run for `vm_lazy_debian`).
    /// What is still mounted then is detached (`umount -l`).
    fn drop(&mut self) {
        match &self.how {
            Stopper::Binary(bin) => {
                let _ = kiln_in(bin, &self.dir).args(["stop", "--all"]).output();
            }
            Stopper::Library(state_dir) => stop_all_in(state_dir),
        }
        let dir = self.dir.canonicalize().unwrap_or_else(|_| self.dir.clone());
        let mounts_under = || -> Vec<String> {
            let prefix = format!("{}/", dir.display());
            std::fs::read_to_string("/proc/self/mounts")
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.split(' ').nth(1))
                .filter(|m| m.starts_with(&prefix))
                .map(str::to_string)
                .collect()
        };
        for _ in 0..150 {
            if mounts_under().is_empty() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        for m in mounts_under() {
            let _ = std::process::Command::new("umount")
                .args(["-l", &m])
                .status();
        }
    }
}

/// A finished command's exit code, stdout and stderr, for assertion messages.
pub fn show(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The `started` event of a `kiln --json start`'s output (its stdout, one JSON object a
/// line). Panics, showing the output, without one.
pub fn started(o: &Output) -> serde_json::Value {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "started")
        .unwrap_or_else(|| panic!("no started event: {}", show(o)))
}

/// The clone id of a `kiln --json start`'s [`started`] event.
pub fn started_id(o: &Output) -> String {
    started(o)["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no id: {}", show(o)))
        .to_string()
}

/// `["/bin/sh", "-c", script]`.
pub fn sh(script: &str) -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into(), script.into()]
}

/// A sandbox whose start command sleeps as root and that has no ready check: the image of
/// tests that only need a running clone to exec in.
pub fn sleeping_sandbox() -> SandboxSpec {
    SandboxSpec {
        start: Some(StartSpec {
            argv: sh("exec sleep 1000000"),
            user: None,
            env: vec![],
            workdir: None,
        }),
        ready: None,
    }
}

/// The `KILN_TEST_BUSYBOX_OCI` fixture as a 64 MiB image; see [`oci_image`].
pub async fn busybox_image(store: &Store, work: &Path, tag: &TagRef, sandbox: SandboxSpec) {
    oci_image(
        store,
        work,
        "KILN_TEST_BUSYBOX_OCI",
        "latest",
        64,
        tag,
        sandbox,
    )
    .await
}

/// The image `oci_tag` of the OCI layout fixture named by the environment variable
/// `layout_env`, unpacked (umoci,
/// once per `work`) with an empty `/etc/machine-id`, made into a `size_mib` ext4 with
/// `mke2fs -d` (until the ext4 branch's writer is used here), stored as an image manifest
/// carrying `sandbox`, and tagged `tag`.
pub async fn oci_image(
    store: &Store,
    work: &Path,
    layout_env: &str,
    oci_tag: &str,
    size_mib: u64,
    tag: &TagRef,
    sandbox: SandboxSpec,
) {
    let layout = require_env(layout_env);
    let root = work.join(format!("rootfs-{}", layout_env.to_lowercase()));
    if !root.exists() {
        unpack(&layout, oci_tag, &root);
    }
    image_of_rootfs(store, work, &root, size_mib, tag, sandbox).await;
}

/// `umoci raw unpack` of `<layout>:<oci_tag>` into `root`, with an empty `/etc/machine-id`
/// (what the builder's sandbox preparation layer does).
fn unpack(layout: &str, oci_tag: &str, root: &Path) {
    run(Command::new("umoci").args([
        "raw",
        "unpack",
        "--image",
        &format!("{layout}:{oci_tag}"),
        &root.display().to_string(),
    ]));
    std::fs::write(root.join("etc/machine-id"), "").expect("machine-id");
}

/// [`oci_image`] from a root file system unpacked once per fixture and machine, in
/// `$KILN_TEST_CACHE/rootfs/` (keyed by the layout's path, whose name carries the fixture's
/// key, and `oci_tag`), never written after: only the ext4 image is made in `work`. Returns
/// that root file system (read it, never write it). For tests that need the image, not the
/// unpacking: unpacking the Debian fixture (about 6,700 files) took 8.4 s here and removing
/// it with the test's directory 2.9 s (one run each, load about 4, 2 cores).
pub async fn cached_oci_image(
    store: &Store,
    work: &Path,
    layout_env: &str,
    oci_tag: &str,
    size_mib: u64,
    tag: &TagRef,
    sandbox: SandboxSpec,
) -> PathBuf {
    let layout = require_env(layout_env);
    let cache = PathBuf::from(require_env("KILN_TEST_CACHE")).join("rootfs");
    std::fs::create_dir_all(&cache).expect("rootfs cache");
    let key = kiln_store::BlobDigest::of(format!("{layout}:{oci_tag}").as_bytes()).hex();
    let root = cache.join(&key[..16]);
    if !root.join("etc").exists() {
        // Unpacked aside and renamed into place, so a reader never sees half of it; a
        // process that loses the race drops its copy.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = cache.join(format!(".tmp-{}-{nanos}", std::process::id()));
        unpack(&layout, oci_tag, &tmp);
        if std::fs::rename(&tmp, &root).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        assert!(root.join("etc").exists(), "{} unpacked", root.display());
    }
    image_of_rootfs(store, work, &root, size_mib, tag, sandbox).await;
    root
}

/// The rest of [`oci_image`]: `root` made into a `size_mib` ext4 in `work` with
/// `mke2fs -d`, stored as an image manifest carrying `sandbox`, and tagged `tag`.
async fn image_of_rootfs(
    store: &Store,
    work: &Path,
    root: &Path,
    size_mib: u64,
    tag: &TagRef,
    sandbox: SandboxSpec,
) {
    let img = work.join(format!("{}.ext4", tag.to_string().replace(':', "-")));
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d"])
        .arg(root)
        .arg(&img)
        .arg(format!("{size_mib}M")));
    let (table, _) = store
        .put_artifact(&img, &PutArtifactOptions::default())
        .await
        .expect("put ext4");
    let mut m = ImageManifest::new(table);
    m.sandbox = Some(sandbox);
    let raw = store
        .put_manifest(&Manifest::Image(m))
        .await
        .expect("manifest");
    store.force_tag(tag, raw.digest).await.expect("tag");
}

/// Watches, from a thread, for the QEMU processes (program `qemu-system-*`) whose command
/// line names `needle` (a test's directory), polling `/proc` every 10 ms, and records each
/// one's real and effective uid (the first two fields of its `/proc/<pid>/status` `Uid:`
/// line, proc(5)) as soon as it is seen: issue 37 wants no QEMU kiln starts to run as uid 0.
pub struct QemuUids {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(u32, u32, u32)>>>,
}

impl QemuUids {
    /// Starts watching for QEMUs that name `needle`.
    pub fn watch(needle: &Path) -> Self {
        let needle = needle.display().to_string();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen: Vec<(u32, u32, u32)> = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                for (pid, ruid, euid) in qemu_uids(&needle) {
                    if !seen.iter().any(|(p, _, _)| *p == pid) {
                        seen.push((pid, ruid, euid));
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            seen
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops watching; every QEMU seen, as (pid, real uid, effective uid).
    pub fn seen(mut self) -> Vec<(u32, u32, u32)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().expect("QEMU watcher"))
            .unwrap_or_default()
    }

    /// Stops watching and asserts that at least one QEMU was seen and none ran as uid 0
    /// (real or effective); `what` names the phase in the message.
    pub fn assert_none_root(self, what: &str) -> Vec<(u32, u32, u32)> {
        let seen = self.seen();
        assert!(!seen.is_empty(), "{what}: no QEMU was seen");
        assert!(
            seen.iter().all(|(_, r, e)| *r != 0 && *e != 0),
            "{what}: a QEMU ran as root (pid, ruid, euid): {seen:?}"
        );
        seen
    }
}

impl Drop for QemuUids {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The QEMU processes naming `needle` now, as (pid, real uid, effective uid).
pub fn qemu_uids(needle: &str) -> Vec<(u32, u32, u32)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let c = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let argv0 = c.split(|b| *b == 0).next()?;
            let name = argv0.rsplit(|b| *b == b'/').next()?;
            if !name.starts_with(b"qemu-system") || !String::from_utf8_lossy(&c).contains(needle) {
                return None;
            }
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            let mut f = uid.split_whitespace().filter_map(|t| t.parse::<u32>().ok());
            Some((pid, f.next()?, f.next()?))
        })
        .collect()
}

/// The runtime the launcher's async API runs on in the synchronous VM tests: one worker,
/// made once per process.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static R: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    R.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

/// This host's QEMU and the accelerator kiln picks for it with `kernel` and `initramfs`,
/// probed on [`runtime`]. Panics naming `ci/setup.sh` when QEMU is missing.
pub fn probe_host(
    kernel: &Path,
    initramfs: &Path,
) -> (kiln_vmm::launch::Host, kiln_vmm::launch::Accel) {
    use kiln_vmm::launch;
    runtime().block_on(async {
        let host = launch::Host::detect()
            .await
            .expect("QEMU (run ci/setup.sh)");
        let dir = tempfile::tempdir().expect("tempdir");
        let accel = launch::probe_accel(&host, kernel, initramfs, dir.path())
            .await
            .expect("accelerator");
        (host, accel)
    })
}

/// The spec of a VM in `d` that QEMU starts paused, waiting for an incoming migration that
/// never comes (no guest boot), booting `boot` under `accel` on `host`: a `memory_bytes`
/// shared memory file, an empty 1 MiB qcow2 disk (with `backing`, over a 1 MiB raw backing
/// file `base.raw`), its sockets and console log.
pub fn paused_spec(
    host: &kiln_vmm::launch::Host,
    accel: kiln_vmm::launch::Accel,
    boot: &BootAssets,
    d: &Path,
    memory_bytes: u64,
    backing: bool,
) -> kiln_vmm::launch::VmSpec {
    use kiln_vmm::launch;
    std::fs::File::create(d.join("memory"))
        .and_then(|f| f.set_len(memory_bytes))
        .expect("memory file");
    let mut img = Command::new(&host.qemu_img);
    img.args(["create", "-q", "-f", "qcow2"]);
    if backing {
        std::fs::File::create(d.join("base.raw"))
            .and_then(|f| f.set_len(1 << 20))
            .expect("backing file");
        img.args(["-F", "raw", "-b"]).arg(d.join("base.raw"));
    }
    img.arg(d.join("disk.qcow2"));
    if !backing {
        img.arg("1M");
    }
    run(&mut img);
    launch::VmSpec {
        max_disk_bytes: None,
        accel,
        vcpus: 1,
        memory_bytes,
        kernel: boot.kernel.clone(),
        initramfs: boot.initramfs.clone(),
        memory_file: d.join("memory"),
        memory_mode: launch::MemoryMode::Shared,
        disk: d.join("disk.qcow2"),
        disk_format: launch::DiskFormat::Qcow2,
        ro_disks: Vec::new(),
        rw_disks: Vec::new(),
        qmp_socket: d.join("qmp.sock"),
        guest_socket: d.join("guest.sock"),
        serial_log: d.join("console.log"),
        incoming: true,
        tsc_khz: host.tsc_khz,
        egress_socket: None,
        kernel_args: vec![],
    }
}

/// One field of `/proc/<pid>/smaps_rollup` (proc(5)), kB: `field` with its colon (`"Rss:"`,
/// `"Pss:"`); 0 when the process or the field is gone. What a QEMU shares with others of
/// the same snapshot shows as Pss below Rss.
pub fn smaps_rollup_kb(pid: u64, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Waits (at most 30 s) for the chunk server of the snapshot directory `snapdir` to leave its
/// mount ([`kiln_vmm::lazy::MOUNT_DIR`]); true when it did.
pub fn wait_unmounted(snapdir: &Path) -> bool {
    let mnt = snapdir.join(kiln_vmm::lazy::MOUNT_DIR);
    for _ in 0..600 {
        if !kiln_vmm::lazy::is_mounted(&mnt) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    false
}
