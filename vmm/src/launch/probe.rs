//! Which accelerator a QEMU gets ([`probe_accel`]), and the probe's answer remembered per
//! host ([`probe_accel_cached`], keyed by [`ProbeKey`]).

use super::*;

/// Picks the accelerator: `$KILN_ACCEL` (`tcg`/`kvm`) when set; else KVM when `/dev/kvm`
/// opens and QEMU starts our CPU model under KVM with `enforce` and then boots `kernel` +
/// `initramfs` to the point where the kernel runs `/init` (looked for on the serial console
/// within 20 s); else TCG. On this host KVM is PVM: QEMU refuses the CPU model (PVM's CPUID
/// lacks most of it), so the probe ends in well under a second.
pub async fn probe_accel(
    host: &Host,
    kernel: &Path,
    initramfs: &Path,
    scratch: &Path,
) -> Result<Accel, LaunchError> {
    if let Some(a) = forced_accel()? {
        return Ok(a);
    }
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(KVM_DEV)
        .is_err()
    {
        return Ok(Accel::Tcg);
    }
    Ok(if kvm_boots(host, kernel, initramfs, scratch).await {
        Accel::Kvm
    } else {
        Accel::Tcg
    })
}

/// The accelerator `$KILN_ACCEL` forces (`tcg` or `kvm`), if set and not empty.
fn forced_accel() -> Result<Option<Accel>, LaunchError> {
    match std::env::var("KILN_ACCEL").as_deref() {
        Ok("tcg") => Ok(Some(Accel::Tcg)),
        Ok("kvm") => Ok(Some(Accel::Kvm)),
        Ok(other) if !other.is_empty() => Err(LaunchError::Accel(
            other.to_string(),
            "KILN_ACCEL must be tcg or kvm".into(),
        )),
        _ => Ok(None),
    }
}

/// What a remembered [`probe_accel`] answer depends on, so that any change probes again:
/// this boot of the host (`/proc/sys/kernel/random/boot_id`, random(4): a reboot may bring
/// another kernel, KVM module or module parameters), the QEMU binary (its resolved path,
/// size, modification time and `--version`), `/dev/kvm` (present or not, its mode, owner,
/// group and device number, and whether this process can open it read-write), and the guest
/// kernel and initramfs the probe boots.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProbeKey {
    /// The host's boot id.
    pub boot_id: String,
    /// The QEMU binary, resolved on `PATH` when [`Host::qemu`] is a bare name.
    pub qemu_path: PathBuf,
    /// Its size, bytes.
    pub qemu_size: u64,
    /// Its modification time: seconds and nanoseconds since the Unix epoch (stat(2)).
    pub qemu_mtime: (i64, i64),
    /// Its version ([`Host::qemu_version`]).
    pub qemu_version: String,
    /// `/dev/kvm`; `None` when it does not exist.
    pub kvm: Option<KvmNode>,
    /// Names the guest kernel and initramfs the probe boots (the caller's choice: kiln uses
    /// their digests).
    pub guest: String,
}

/// The facts about `/dev/kvm` in a [`ProbeKey`] (stat(2) fields).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvmNode {
    /// `st_mode` (type and permission bits).
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Group gid.
    pub gid: u32,
    /// `st_rdev`, the device number.
    pub rdev: u64,
    /// Whether this process could open it read-write (what the probe needs first).
    pub opens_rw: bool,
}

/// The boot id file (random(4)).
pub(super) const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";
/// The KVM device.
const KVM_DEV: &str = "/dev/kvm";

impl ProbeKey {
    /// The key of this host now, for `host`'s QEMU and the guest named `guest`; `None` when
    /// a part of it cannot be read (then nothing is cached).
    pub fn current(host: &Host, guest: &str) -> Option<ProbeKey> {
        let qemu = resolve_program(&host.qemu)?;
        Self::read(
            Path::new(BOOT_ID),
            &qemu,
            Path::new(KVM_DEV),
            &host.qemu_version,
            guest,
        )
    }

    fn read(
        boot_id: &Path,
        qemu: &Path,
        kvm: &Path,
        qemu_version: &str,
        guest: &str,
    ) -> Option<ProbeKey> {
        use std::os::unix::fs::MetadataExt;
        let boot_id = std::fs::read_to_string(boot_id).ok()?.trim().to_string();
        let q = std::fs::metadata(qemu).ok()?;
        let kvm = match std::fs::metadata(kvm) {
            Ok(m) => Some(KvmNode {
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                rdev: m.rdev(),
                opens_rw: std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(kvm)
                    .is_ok(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(_) => return None,
        };
        Some(ProbeKey {
            boot_id,
            qemu_path: qemu.to_path_buf(),
            qemu_size: q.len(),
            qemu_mtime: (q.mtime(), q.mtime_nsec()),
            qemu_version: qemu_version.to_string(),
            kvm,
            guest: guest.to_string(),
        })
    }
}

/// `program` when it names a path (has a `/`), else the first executable file of that name
/// in a `PATH` directory (as execvp(3) searches), absolute.
pub(crate) fn resolve_program(program: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.as_os_str().as_encoded_bytes().contains(&b'/') {
        return std::path::absolute(program).ok();
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .and_then(|p| std::path::absolute(p).ok())
}

/// What the probe cache file holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct CachedProbe {
    key: ProbeKey,
    accel: Accel,
}

/// [`probe_accel`], remembered per host in `cache_file` (JSON: the [`ProbeKey`] and the
/// answer). `$KILN_ACCEL` wins as in [`probe_accel`] and is not written. A file whose key
/// differs from this host's now ([`ProbeKey::current`]), or that is unreadable or not the
/// expected JSON, is ignored: the probe runs and the file is replaced (written to a temporary
/// name in the same directory, then renamed over it, so a reader never sees half a file). A
/// failure to write it is logged and the answer still returned.
///
/// Errors: [`probe_accel`]'s.
pub async fn probe_accel_cached(
    host: &Host,
    kernel: &Path,
    initramfs: &Path,
    scratch: &Path,
    guest: &str,
    cache_file: &Path,
) -> Result<Accel, LaunchError> {
    if let Some(a) = forced_accel()? {
        return Ok(a);
    }
    cached_probe(
        cache_file,
        ProbeKey::current(host, guest),
        probe_accel(host, kernel, initramfs, scratch),
    )
    .await
}

/// The accelerator [`probe_accel_cached`] would answer without probing: `$KILN_ACCEL`, or a
/// remembered answer whose key is this host's now; `None` when only a probe can tell.
///
/// Errors: a `$KILN_ACCEL` that is neither `tcg` nor `kvm`.
pub fn known_accel(
    host: &Host,
    guest: &str,
    cache_file: &Path,
) -> Result<Option<Accel>, LaunchError> {
    if let Some(a) = forced_accel()? {
        return Ok(Some(a));
    }
    Ok(ProbeKey::current(host, guest).and_then(|k| read_probe_cache(cache_file, &k)))
}

async fn cached_probe(
    cache_file: &Path,
    key: Option<ProbeKey>,
    probe: impl std::future::Future<Output = Result<Accel, LaunchError>>,
) -> Result<Accel, LaunchError> {
    let Some(key) = key else {
        return probe.await;
    };
    if let Some(a) = read_probe_cache(cache_file, &key) {
        return Ok(a);
    }
    let accel = probe.await?;
    if let Err(e) = write_probe_cache(cache_file, key, accel) {
        tracing::warn!(error = %e, "not remembering the accelerator probe");
    }
    Ok(accel)
}

fn read_probe_cache(file: &Path, key: &ProbeKey) -> Option<Accel> {
    match super::facts::read_json::<CachedProbe>(file)? {
        c if c.key == *key => Some(c.accel),
        _ => {
            tracing::debug!(file = %file.display(), "accelerator probe cache is stale");
            None
        }
    }
}

fn write_probe_cache(file: &Path, key: ProbeKey, accel: Accel) -> Result<(), LaunchError> {
    super::facts::write_json(file, &CachedProbe { key, accel })
}

/// Boots `kernel` + `initramfs` under KVM with kiln's own command line ([`VmSpec::args`], a
/// blank disk, `rdinit=` and `init=` pointing nowhere) and reports whether the kernel got as
/// far as looking for an init within 20 s.
async fn kvm_boots(host: &Host, kernel: &Path, initramfs: &Path, scratch: &Path) -> bool {
    let Ok(dir) = tempfile::Builder::new()
        .prefix("kvm-probe")
        .tempdir_in(scratch)
    else {
        return false;
    };
    let d = dir.path();
    let memory_bytes = 256 << 20;
    let memory = d.join("memory");
    let disk = d.join("disk.qcow2");
    if std::fs::File::create(&memory)
        .and_then(|f| f.set_len(memory_bytes))
        .is_err()
        || run(
            &host.qemu_img,
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                &disk.display().to_string(),
                "1M",
            ],
        )
        .await
        .is_err()
    {
        return false;
    }
    let spec = VmSpec {
        max_disk_bytes: None,
        accel: Accel::Kvm,
        vcpus: 1,
        memory_bytes,
        kernel: kernel.to_path_buf(),
        initramfs: initramfs.to_path_buf(),
        memory_file: memory,
        memory_mode: MemoryMode::Shared,
        disk,
        disk_format: DiskFormat::Qcow2,
        ro_disks: Vec::new(),
        rw_disks: Vec::new(),
        qmp_socket: d.join("qmp.sock"),
        guest_socket: d.join("guest.sock"),
        serial_log: d.join("console.log"),
        incoming: false,
        tsc_khz: None,
        egress_socket: None,
        kernel_args: vec![
            "rdinit=/nonexistent-kiln-probe".into(),
            "init=/nonexistent-kiln-probe".into(),
        ],
    };
    let Ok(mut vm) = Vm::spawn(
        host,
        &spec,
        &d.join("qemu.log"),
        Duration::from_secs(10),
        true,
    )
    .await
    else {
        // QEMU refused the CPU model or the accelerator.
        return false;
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&spec.serial_log).unwrap_or_default();
        // The kernel got as far as looking for an init or its root (the blank disk holds no
        // file system): it runs under KVM.
        if ["Run /", "Requested init", "VFS: Unable to mount root"]
            .iter()
            .any(|m| text.contains(m))
        {
            vm.kill().await;
            return true;
        }
        if vm.exited().is_some() || tokio::time::Instant::now() >= deadline {
            vm.kill().await;
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_key_follows_boot_qemu_kvm_and_guest() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let boot = t.path().join("boot_id");
        let qemu = t.path().join("qemu-system-x86_64");
        let kvm = t.path().join("kvm");
        std::fs::write(&boot, "3f1c\n").unwrap();
        std::fs::write(&qemu, "qemu").unwrap();
        std::fs::write(&kvm, "").unwrap();
        let key = |g: &str| ProbeKey::read(&boot, &qemu, &kvm, "10.0.2", g).unwrap();
        let k0 = key("k1 i1");
        assert_eq!(k0.boot_id, "3f1c");
        assert_eq!(key("k1 i1"), k0, "nothing changed: same key");
        assert_ne!(key("k2 i1"), k0, "another guest kernel");
        assert_ne!(
            ProbeKey::read(&boot, &qemu, &kvm, "10.1.0", "k1 i1").unwrap(),
            k0,
            "another QEMU version"
        );
        std::fs::write(&boot, "77aa\n").unwrap();
        assert_ne!(key("k1 i1"), k0, "a reboot");
        std::fs::write(&boot, "3f1c\n").unwrap();
        std::fs::write(&qemu, "qemu, upgraded").unwrap();
        assert_ne!(key("k1 i1"), k0, "another QEMU binary (size)");
        std::fs::write(&qemu, "qemu").unwrap();
        let f = std::fs::File::options().write(true).open(&qemu).unwrap();
        f.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1))
            .unwrap();
        let k1 = key("k1 i1");
        assert_ne!(k1, k0, "another QEMU binary (mtime)");
        std::fs::set_permissions(&kvm, std::fs::Permissions::from_mode(0o600)).unwrap();
        let k2 = key("k1 i1");
        std::fs::set_permissions(&kvm, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_ne!(key("k1 i1"), k2, "/dev/kvm's permissions");
        std::fs::remove_file(&kvm).unwrap();
        let gone = key("k1 i1");
        assert_eq!(gone.kvm, None);
        assert_ne!(gone, k1, "/dev/kvm gone");
        // No boot id (or no QEMU): no key, so nothing is cached.
        assert!(ProbeKey::read(&t.path().join("none"), &qemu, &kvm, "10.0.2", "g").is_none());
        assert!(ProbeKey::read(&boot, &t.path().join("none"), &kvm, "10.0.2", "g").is_none());
    }

    #[test]
    fn corrupt_or_stale_probe_cache_is_probed_again() {
        let t = tempfile::tempdir().unwrap();
        let file = t.path().join("cache/accel.json");
        let boot = t.path().join("boot_id");
        std::fs::write(&boot, "b1").unwrap();
        let qemu = t.path().join("qemu");
        std::fs::write(&qemu, "q").unwrap();
        let key = |g: &str| ProbeKey::read(&boot, &qemu, &t.path().join("no-kvm"), "10.0.2", g);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let probes = std::cell::Cell::new(0);
        let run = |k: Option<ProbeKey>, answer: Accel| {
            rt.block_on(cached_probe(&file, k, async {
                probes.set(probes.get() + 1);
                Ok(answer)
            }))
            .unwrap()
        };
        // No file yet: probed and written; then remembered.
        assert_eq!(run(key("g"), Accel::Kvm), Accel::Kvm);
        assert_eq!(run(key("g"), Accel::Tcg), Accel::Kvm);
        assert_eq!(probes.get(), 1);
        // Corrupt files: ignored, probed again, replaced by a good one.
        for junk in [
            &b""[..],
            b"{",
            b"\x00\xff garbage",
            br#"{"key":{},"accel":"kvm"}"#,
        ] {
            std::fs::write(&file, junk).unwrap();
            assert_eq!(run(key("g"), Accel::Tcg), Accel::Tcg);
        }
        assert_eq!(probes.get(), 5);
        assert_eq!(
            run(key("g"), Accel::Kvm),
            Accel::Tcg,
            "the last answer kept"
        );
        assert_eq!(probes.get(), 5);
        // A key that no longer matches (another guest here): stale, probed again.
        assert_eq!(run(key("other"), Accel::Kvm), Accel::Kvm);
        assert_eq!(probes.get(), 6);
        // No key: always probed, the file left alone.
        let before = std::fs::read(&file).unwrap();
        assert_eq!(run(None, Accel::Tcg), Accel::Tcg);
        assert_eq!(probes.get(), 7);
        assert_eq!(std::fs::read(&file).unwrap(), before);
        // No temporary files left beside it.
        let names: Vec<_> = std::fs::read_dir(file.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["accel.json"]);
    }
}
