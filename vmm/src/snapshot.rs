//! Boot once → snapshot: boot an image, run its start command until ready, pause, save.
//!
//! 1. Resolve the image tag; materialize its ext4 disk (verified chunks) as `base.raw` and
//!    put a qcow2 overlay over it; create the guest memory file (sparse, the guest RAM size).
//! 2. Boot QEMU ([`crate::launch`]) with the memory file `share=on`; wait for the guest's
//!    `hello` (bounded by [`SnapshotOptions::boot_timeout`]); send `start` built from the image
//!    manifest's `sandbox`; wait for `ready` or `failed` (bounded by
//!    [`SnapshotOptions::ready_timeout`]). The guest init sends `ready` once the check has
//!    passed and the guest is idle (at most 2 s later; kiln-guest-init's `idle` module), so
//!    that no clone finishes work the boot left half done; the wait is
//!    [`SnapshotReport::settle`], apart from [`SnapshotReport::boot_to_ready`].
//! 3. QMP `stop`; `migrate-set-capabilities` `x-ignore-shared` (RAM in the shared file is
//!    not copied into the stream); `migrate` to `file:vmstate`; wait until `completed`; quit.
//! 4. Flatten the overlay (`qemu-img convert -O raw`: the disk at that instant, not qcow2
//!    bytes). Store: memory file chunks (fixed 64 KiB, [`Chunking::MEMORY_DEFAULT`], zero
//!    chunks are holes), vmstate blob, kernel and initramfs blobs, disk chunks (FastCDC like
//!    images), then the [`SnapshotManifest`] with its [`CompatKey`], then a copy of the image
//!    manifest whose `snapshot` names it ([`snapshot_manifest`]), then the new tag
//!    ([`snapshot_image`]; chunks, manifest, tag order).
//! 5. With [`SnapshotOptions::record_prefetch`] (what `kiln snapshot` does): restore the
//!    stored snapshot through the chunk server ([`crate::lazy`]),
//!    [`SnapshotOptions::prefetch_restores`] times one after the other, each in a scratch
//!    cache of its own, until the clone answers `restored` and then its image's ready check
//!    (if any) has run once in it; the chunks every server served (their chunk logs,
//!    readahead included) become the snapshot's prefetch list
//!    ([`kiln_store::PrefetchList`]), in the order first read, and the snapshot manifest and
//!    the image manifest naming it are stored again with it (the first pair becomes garbage
//!    for GC). A recording that fails is a warning: the snapshot stays without a list.
//!    The listed chunks are then written again, in the order the chunk server fetches them,
//!    into a pack of their own ([`Store::pack_together`]; on S3 a cold start then reads them
//!    from one small pack; a failure is a warning too, the chunks being stored anyway).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_guest::protocol::{Message, ReadyCheck, Start};
use kiln_store::artifact::PutArtifactOptions;
use kiln_store::chunk::Chunking;
use kiln_store::manifest::{SCHEMA_VERSION, SNAPSHOT_MEDIA_TYPE};
use kiln_store::{
    BlobRef, ImageManifest, Manifest, ManifestDigest, SandboxSpec, SnapshotManifest, Store,
    StoreError, TagRef,
};

use crate::channel::{ChannelError, GuestChannel};
use crate::compat::CompatKey;
use crate::launch::{self, Accel, Host, LaunchError, MemoryMode, Vm, VmSpec, io_err};
use crate::qmp::QmpError;

/// Errors of boot-once snapshots.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Options kiln will not boot with.
    #[error("snapshot options: {0}")]
    Options(String),
    /// The tag names something that is not an image manifest.
    #[error("{0} is not an image")]
    NotAnImage(String),
    /// The guest reported that its start command or ready check failed.
    #[error("the guest's start failed: {reason}\n{console}")]
    GuestFailed {
        /// The guest's reason.
        reason: String,
        /// The serial console ([`launch::console_report`]).
        console: String,
    },
    /// No `hello` or no `ready` within the bound, or QEMU died meanwhile.
    #[error("{what}: {source}\n{console}")]
    Guest {
        /// Which step (`waiting for hello`, `waiting for ready`...).
        what: String,
        /// The channel error (timeout, closed...).
        source: ChannelError,
        /// The serial console ([`launch::console_report`]).
        console: String,
    },
    /// The guest answered something unexpected.
    #[error("the guest sent {got} while kiln waited for {want}")]
    Unexpected {
        /// What arrived.
        got: String,
        /// What was awaited.
        want: String,
    },
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// QEMU.
    #[error(transparent)]
    Launch(#[from] LaunchError),
}

impl From<QmpError> for SnapshotError {
    fn from(e: QmpError) -> Self {
        SnapshotError::Launch(e.into())
    }
}

/// The guest kernel and initramfs to boot.
#[derive(Debug, Clone)]
pub struct BootAssets {
    /// Uncompressed vmlinux (a bzImage also boots, but Firecracker needs vmlinux).
    pub kernel: PathBuf,
    /// Initramfs with the guest init (`kiln-guest-init`).
    pub initramfs: PathBuf,
}

/// Options of [`snapshot_image`].
#[derive(Debug, Clone)]
pub struct SnapshotOptions {
    /// vCPUs (default 1).
    pub vcpus: u32,
    /// Guest RAM in bytes, a multiple of 1 MiB (default 512 MiB).
    pub memory_bytes: u64,
    /// From QEMU start to the guest's `hello` (default 120 s: TCG boots take about 4 s here).
    pub boot_timeout: Duration,
    /// From `start` to `ready`/`failed` (default 600 s; the guest's own ready check has its
    /// own interval, timeout and retries and normally reports `failed` first).
    pub ready_timeout: Duration,
    /// Scratch directory for the run (a temporary directory is made inside and removed).
    pub work_dir: PathBuf,
    /// Accelerator; `None`: [`launch::probe_accel`].
    pub accel: Option<Accel>,
    /// Extra kernel command-line arguments ([`VmSpec::kernel_args`]); empty by default.
    pub kernel_args: Vec<String>,
    /// The chunk server program to record the prefetch list with (step 5 of the module doc;
    /// as [`crate::clone::Serving::Lazy`]); `None` (the default): no list.
    pub record_prefetch: Option<Vec<std::ffi::OsString>>,
    /// Recording restores whose common chunks make the prefetch list (at least 1; default
    /// [`PREFETCH_RESTORES`]).
    pub prefetch_restores: u32,
}

/// Default [`SnapshotOptions::prefetch_restores`]: one. Keeping only the chunks that two
/// restores both read (as E2B's template optimizer does) was measured to fetch no less:
/// `kiln/tests/vm_lazy.rs` (busybox fixture, 256 MiB guest, cold from the local S3 server,
/// TCG, 2026-12-05), two runs each, listed chunks 168 and 178 with one restore against 175
/// and 173 with two, memory served or prefetched before the clone answered 14.75% and
/// 15.62% of guest RAM against 15.43% and 15.14%. A restore reads the same chunks each
/// time, so a second one costs a restore and removes nothing. Measured again with
/// `ci/bench-clone.sh --store s3` (`KILN_BENCH_RUNS=3`, `KILN_BENCH_PREFETCH_RESTORES=1|2`,
/// release kiln, TCG, 2026-12-06), memory served or prefetched when the clone answered,
/// one restore against two: busybox (256 MiB) 9.91% and 9.94% against 9.77% and 9.81%;
/// Debian fixture (512 MiB) 4.90% and 4.90% against 4.85% and 4.94%; disk the same or
/// alternating between runs either way (Debian 0.14% or 0.57% of its non-zero bytes, with
/// one restore and with two); the clones' start times within their run-to-run spread; and
/// `kiln snapshot` about 3 s longer (busybox: 5.7 and 5.5 s past the ready check against
/// 8.9 and 9.2 s). So one stays the default.
pub const PREFETCH_RESTORES: u32 = 1;

impl Default for SnapshotOptions {
    fn default() -> Self {
        Self {
            vcpus: 1,
            memory_bytes: 512 << 20,
            boot_timeout: Duration::from_secs(120),
            ready_timeout: Duration::from_secs(600),
            work_dir: std::env::temp_dir(),
            accel: None,
            kernel_args: Vec::new(),
            record_prefetch: None,
            prefetch_restores: PREFETCH_RESTORES,
        }
    }
}

/// What [`snapshot_image`] did.
#[derive(Debug, Clone)]
pub struct SnapshotReport {
    /// The snapshot manifest.
    pub snapshot: ManifestDigest,
    /// The new image manifest (the old one plus `snapshot`), now at the new tag.
    pub image: ManifestDigest,
    /// The accelerator used.
    pub accel: Accel,
    /// QEMU spawned → the ready check passed (cold boot, init, start command, ready check):
    /// the guest's `ready` arrived [`SnapshotReport::settle`] later.
    pub boot_to_ready: Duration,
    /// The ready check passed → the guest idle and its `ready` sent (the guest init's wait
    /// for what still ran, which would otherwise run again in every clone; its
    /// `ready.settled_ms`, 0 from an init that does not wait).
    pub settle: Duration,
    /// `stop` → migration completed.
    pub save: Duration,
    /// Guest RAM, bytes.
    pub memory_bytes: u64,
    /// Memory chunks' stored (compressed) bytes.
    pub memory_stored_bytes: u64,
    /// Memory bytes that are not holes (raw).
    pub memory_nonzero_bytes: u64,
    /// vmstate blob size, bytes.
    pub vmstate_bytes: u64,
    /// The compatibility key recorded.
    pub key: CompatKey,
    /// Chunks in the recorded prefetch list (0 when none was recorded).
    pub prefetch_chunks: usize,
    /// Recording restores in which the image's ready check ran and passed (0 without a
    /// check or a list).
    pub prefetch_checks_passed: u32,
}

/// The host's compatibility key for booting `kernel`/`initramfs` with these settings.
pub fn host_key(
    host: &Host,
    accel: Accel,
    kernel: &BlobRef,
    initramfs: &BlobRef,
    vcpus: u32,
    memory_bytes: u64,
) -> CompatKey {
    CompatKey {
        vmm: "qemu".into(),
        vmm_version: host.qemu_version.clone(),
        accel: accel.name().into(),
        cpu: launch::CPU_MODEL.into(),
        kernel: kernel.digest.to_string(),
        initramfs: initramfs.digest.to_string(),
        vcpus,
        memory_bytes,
        machine: launch::MACHINE.into(),
        devices: launch::DEVICE_LAYOUT.into(),
    }
}

/// The `start` message for an image's sandbox spec (`None`: no start command, ready as soon
/// as the init runs).
pub fn start_message(sandbox: Option<&SandboxSpec>) -> Start {
    let Some(s) = sandbox else {
        return Start::default();
    };
    let mut m = Start::default();
    if let Some(st) = &s.start {
        m.argv = st.argv.clone();
        m.user = st.user.clone();
        m.env = st.env.clone();
        m.workdir = st.workdir.clone();
    }
    m.ready = s.ready.as_ref().map(|r| ReadyCheck {
        argv: r.argv.clone(),
        interval_ms: r.interval_ms,
        timeout_ms: r.timeout_ms,
        retries: r.retries,
    });
    m
}

/// Boots the image at `image_ref` once and stores its snapshot; tags the image manifest that
/// names the snapshot as `new_tag` (compare-and-swap against its current value). See
/// [`snapshot_manifest`] for the boot and what is stored.
pub async fn snapshot_image(
    store: &Store,
    image_ref: &TagRef,
    new_tag: &TagRef,
    assets: &BootAssets,
    opts: &SnapshotOptions,
) -> Result<SnapshotReport, SnapshotError> {
    check_options(opts)?;
    let image_digest = store.resolve_tag(image_ref).await?;
    let r = snapshot_manifest(store, image_digest, assets, opts).await?;
    let previous = store.get_tag(new_tag).await?.map(|t| t.manifest);
    store.set_tag(new_tag, previous, r.image).await?;
    Ok(r)
}

fn check_options(opts: &SnapshotOptions) -> Result<(), SnapshotError> {
    if opts.memory_bytes == 0
        || !opts.memory_bytes.is_multiple_of(1 << 20)
        || opts.memory_bytes > crate::clone::MAX_MEMORY_BYTES
    {
        return Err(SnapshotError::Options(format!(
            "guest RAM {} bytes: must be a whole number of MiB, at most {}",
            opts.memory_bytes,
            crate::clone::MAX_MEMORY_BYTES
        )));
    }
    if !(1..=crate::clone::MAX_VCPUS).contains(&opts.vcpus) {
        return Err(SnapshotError::Options(format!(
            "{} vCPUs: must be 1 to {}",
            opts.vcpus,
            crate::clone::MAX_VCPUS
        )));
    }
    Ok(())
}

/// Boots the image manifest `image_digest` once and stores its snapshot and a copy of the
/// image manifest whose `snapshot` names it; moves no tag (the caller does, so that a build
/// can move all its tags at the end). Returns what was stored; [`SnapshotReport::image`] is
/// the new image manifest.
///
/// Errors: [`SnapshotError`]; a failed boot or ready check stores no manifest (chunks and
/// blobs already stored stay, for GC).
pub async fn snapshot_manifest(
    store: &Store,
    image_digest: ManifestDigest,
    assets: &BootAssets,
    opts: &SnapshotOptions,
) -> Result<SnapshotReport, SnapshotError> {
    check_options(opts)?;
    let Manifest::Image(image) = store.get_manifest(&image_digest).await? else {
        return Err(SnapshotError::NotAnImage(image_digest.to_string()));
    };
    let host = Host::detect().await?;
    std::fs::create_dir_all(&opts.work_dir).map_err(io_err(&opts.work_dir))?;
    let tmp = tempfile::Builder::new()
        .prefix("kiln-boot-")
        .tempdir_in(&opts.work_dir)
        .map_err(io_err(&opts.work_dir))?;
    let dir = tmp.path();
    let accel = match opts.accel {
        Some(a) => a,
        None => launch::probe_accel(&host, &assets.kernel, &assets.initramfs, dir).await?,
    };

    // 1. Disk and memory file.
    let base = dir.join("base.raw");
    store.materialize(&image.disk, &base, None).await?;
    let overlay = dir.join("disk.qcow2");
    launch::qcow2_overlay(&host, &base, &overlay).await?;
    let memory = dir.join("memory");
    std::fs::File::create(&memory)
        .and_then(|f| f.set_len(opts.memory_bytes))
        .map_err(io_err(&memory))?;

    // 2. Boot, start, ready.
    let spec = VmSpec {
        max_disk_bytes: None,
        accel,
        vcpus: opts.vcpus,
        memory_bytes: opts.memory_bytes,
        kernel: assets.kernel.clone(),
        initramfs: assets.initramfs.clone(),
        memory_file: memory.clone(),
        memory_mode: MemoryMode::Shared,
        disk: overlay.clone(),
        disk_format: crate::launch::DiskFormat::Qcow2,
        ro_disks: Vec::new(),
        rw_disks: Vec::new(),
        qmp_socket: dir.join("qmp.sock"),
        guest_socket: dir.join("guest.sock"),
        serial_log: dir.join("console.log"),
        incoming: false,
        tsc_khz: host.tsc_khz,
        egress_socket: None,
        kernel_args: opts.kernel_args.clone(),
    };
    let t0 = Instant::now();
    let vmstate = dir.join("vmstate");
    // QEMU writes the vmstate through QMP `migrate` long after its start: handed to it now
    // (it cannot open a path in this directory as its own user, crate::jail).
    let mut vm = Vm::spawn_with(
        &host,
        &spec,
        &dir.join("qemu.log"),
        opts.boot_timeout,
        true,
        &[(vmstate.as_path(), crate::jail::Access::Create)],
    )
    .await?;
    let (channel, settle) = run_to_ready(&mut vm, &spec, image.sandbox.as_ref(), opts).await?;
    let boot_to_ready = t0.elapsed().saturating_sub(settle);
    tracing::info!(?boot_to_ready, ?settle, "guest ready");

    // 3. Pause and save the device state, the guest channel still connected: the guest is
    // saved waiting in its read of the port, which a clone whose host connected before its
    // `cont` answers at once (crate::clone, "The restore message").
    let t1 = Instant::now();
    save_vmstate(&mut vm, &vmstate).await?;
    let save = t1.elapsed();
    drop(channel);
    vm.quit().await;

    // 4. Flatten the disk and store everything.
    let flat = dir.join("disk.raw");
    launch::run_img(
        &host,
        &[
            "convert",
            "-O",
            "raw",
            &overlay.display().to_string(),
            &flat.display().to_string(),
        ],
    )
    .await?;
    let (kernel, _) = store.put_blob_file(&assets.kernel).await?;
    let (initramfs, _) = store.put_blob_file(&assets.initramfs).await?;
    let (vmstate_ref, _) = store.put_blob_file(&vmstate).await?;
    let (mem_table, _) = store
        .put_artifact(
            &memory,
            &PutArtifactOptions {
                chunking: Some(Chunking::MEMORY_DEFAULT),
                ..Default::default()
            },
        )
        .await?;
    let (disk_table, _) = store
        .put_artifact(&flat, &PutArtifactOptions::default())
        .await?;
    let key = host_key(
        &host,
        accel,
        &kernel,
        &initramfs,
        opts.vcpus,
        opts.memory_bytes,
    );
    let memory_stored_bytes = mem_table.stored_bytes();
    let memory_nonzero_bytes = mem_table
        .entries
        .iter()
        .filter(|e| !e.is_hole())
        .map(|e| e.raw_len)
        .sum();
    let mut snap = SnapshotManifest {
        schema_version: SCHEMA_VERSION,
        media_type: SNAPSHOT_MEDIA_TYPE.to_string(),
        memory: mem_table,
        vmstate: vmstate_ref.clone(),
        disk: disk_table,
        compatibility_key: key.render(),
        image: image_digest,
        kernel,
        initramfs,
        vcpus: opts.vcpus,
        memory_bytes: opts.memory_bytes,
        prefetch: None,
    };
    let with_snapshot = |d: ManifestDigest| ImageManifest {
        snapshot: Some(d),
        ..image.clone()
    };
    let mut snap_raw = store
        .put_manifest(&Manifest::Snapshot(snap.clone()))
        .await?;
    let mut img_raw = store
        .put_manifest(&Manifest::Image(with_snapshot(snap_raw.digest)))
        .await?;
    let mut prefetch_chunks = 0;
    let mut prefetch_checks_passed = 0;
    if let Some(program) = &opts.record_prefetch {
        match record_prefetch(
            store,
            img_raw.digest,
            &snap_raw.digest,
            image.sandbox.as_ref().and_then(|s| s.ready.as_ref()),
            program,
            accel,
            opts,
        )
        .await
        {
            Ok((list, passed)) => {
                prefetch_chunks = list.memory.len() + list.disk.len();
                prefetch_checks_passed = passed;
                snap.prefetch = Some(list);
                // Its chunks again, in fetch order, in a pack of their own: on S3 a cold
                // start reads them with a few ranged GETs of one small pack instead of spans
                // of the 32 MiB packs the uploads left them in; locally nothing.
                store.pack_prefetch(&snap).await;
                snap_raw = store.put_manifest(&Manifest::Snapshot(snap)).await?;
                img_raw = store
                    .put_manifest(&Manifest::Image(with_snapshot(snap_raw.digest)))
                    .await?;
            }
            Err(e) => {
                tracing::warn!(error = %e, "recording the prefetch list failed; the snapshot has none");
            }
        }
    }
    Ok(SnapshotReport {
        snapshot: snap_raw.digest,
        image: img_raw.digest,
        accel,
        boot_to_ready,
        settle,
        save,
        memory_bytes: opts.memory_bytes,
        memory_stored_bytes,
        memory_nonzero_bytes,
        vmstate_bytes: vmstate_ref.size,
        key,
        prefetch_chunks,
        prefetch_checks_passed,
    })
}

/// Step 5 of the module doc: [`SnapshotOptions::prefetch_restores`] recordings
/// ([`record_restore`]), one after the other; the list is the chunks every one of them read,
/// in the order the first read them, with the number of recordings whose ready check passed.
async fn record_prefetch(
    store: &Store,
    image: ManifestDigest,
    snapshot: &ManifestDigest,
    ready: Option<&kiln_store::ReadySpec>,
    program: &[std::ffi::OsString],
    accel: Accel,
    opts: &SnapshotOptions,
) -> Result<(kiln_store::PrefetchList, u32), String> {
    let mut list: Option<kiln_store::PrefetchList> = None;
    let mut passed = 0;
    for _ in 0..opts.prefetch_restores.max(1) {
        let (log, check_passed) =
            record_restore(store, image, snapshot, ready, program, accel, opts).await?;
        passed += u32::from(check_passed);
        let this = parse_chunk_log(&log);
        list = Some(match list {
            None => this,
            Some(l) => common_chunks(&l, &this),
        });
    }
    let list = list.unwrap_or_default();
    if list.memory.is_empty() && list.disk.is_empty() {
        return Err("the recording clones read no chunk in common".into());
    }
    Ok((list, passed))
}

/// Time a recording clone's ready check may take beyond its own `timeout_ms`: the exec's
/// connection, and the first run of the check in a clone that has just been restored, whose
/// every page is faulted in through the chunk server. Under TCG here, a `test -e` check
/// whose timeout is 1 s did not finish within that second.
const RECORD_CHECK_SLACK: Duration = Duration::from_secs(10);

/// A fresh scratch directory name under `work_dir` for one recording restore: short, because
/// the clone's QMP and guest sockets go three levels below it
/// (`state/clones/<16 hex>/qmp.sock`, 38 bytes), and a Unix socket's path holds at most 107
/// bytes (`sun_path`, unix(7)). With the name `kiln-prefetch-<pid>-<nanos>` a `TMPDIR` of
/// 29 bytes was already too long, and every snapshot silently lost its prefetch list.
fn recording_dir(work_dir: &Path) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    work_dir.join(format!("kpf-{}-{n}", std::process::id()))
}

/// The chunks of `first` that `other` lists too, in `first`'s order.
fn common_chunks(
    first: &kiln_store::PrefetchList,
    other: &kiln_store::PrefetchList,
) -> kiln_store::PrefetchList {
    use std::collections::HashSet;
    let keep = |a: &[u32], b: &[u32]| {
        let b: HashSet<u32> = b.iter().copied().collect();
        a.iter().copied().filter(|i| b.contains(i)).collect()
    };
    kiln_store::PrefetchList {
        memory: keep(&first.memory, &other.memory),
        disk: keep(&first.disk, &other.disk),
    }
}

/// One recording: a lazily served clone of the stored image manifest `image` (snapshot
/// `snapshot`) in a scratch state and cache directory under [`SnapshotOptions::work_dir`],
/// restored until it answers, then, when the image has a ready check (`ready`), that check
/// run once in it (bounded by its `timeout_ms` plus [`RECORD_CHECK_SLACK`]; a failure is a
/// warning), so that the pages
/// and disk blocks the check touches, and the service it asks, are listed too. Returns the
/// chunk log of its server ([`crate::lazy::CHUNK_LOG`]) and whether the check ran and
/// exited 0. The clone is stopped,
/// and the scratch directory removed once the idle server has left its mount (bounded:
/// 20 s, then detached).
async fn record_restore(
    store: &Store,
    image: ManifestDigest,
    snapshot: &ManifestDigest,
    ready: Option<&kiln_store::ReadySpec>,
    program: &[std::ffi::OsString],
    accel: Accel,
    opts: &SnapshotOptions,
) -> Result<(String, bool), String> {
    let work = recording_dir(&opts.work_dir);
    let mut c = crate::clone::CloneOptions::new(
        work.join("state"),
        work.join("cache"),
        crate::clone::Serving::Lazy {
            server: program.to_vec(),
        },
    );
    c.accel = Some(accel);
    let started = crate::clone::start_clones_of(store, image, "prefetch recording", &c).await;
    let mut check_passed = false;
    if let (Ok(clones), Some(r)) = (&started, ready) {
        for clone in clones {
            let req = crate::exec::ExecRequest {
                argv: r.argv.clone(),
                ..Default::default()
            };
            let run = crate::exec::exec(&c.state_dir, &clone.id, &req, |_, _| {});
            let bound = Duration::from_millis(r.timeout_ms) + RECORD_CHECK_SLACK;
            match tokio::time::timeout(bound, run).await {
                Ok(Ok(status)) if status.exit_code() == 0 => check_passed = true,
                Ok(Ok(status)) => tracing::warn!(
                    code = status.exit_code(),
                    "the ready check failed in the recording clone"
                ),
                Ok(Err(e)) => tracing::warn!(error = %e, "the ready check in the recording clone"),
                Err(_) => tracing::warn!("the ready check in the recording clone timed out"),
            }
        }
    }
    let dir = c.cache_dir.join(snapshot.hex());
    let log = std::fs::read_to_string(dir.join(crate::lazy::CHUNK_LOG)).unwrap_or_default();
    if let Ok(clones) = &started {
        for r in clones {
            if let Err(e) = crate::clone::stop(&c.state_dir, &r.id).await {
                tracing::warn!(id = %r.id, error = %e, "stopping the recording clone");
            }
        }
    }
    let mnt = dir.join(crate::lazy::MOUNT_DIR);
    let deadline = Instant::now() + Duration::from_secs(20);
    while crate::lazy::is_mounted(&mnt) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    crate::lazy::detach(&mnt);
    if let Err(e) = std::fs::remove_dir_all(&work) {
        tracing::warn!(dir = %work.display(), error = %e, "removing the recording's scratch directory");
    }
    started.map_err(|e| format!("restoring the snapshot once: {e}"))?;
    Ok((log, check_passed))
}

/// A chunk log ([`crate::lazy::CHUNK_LOG`]: `memory|disk <index> <digest> <bytes>` lines) as
/// a prefetch list, in the order logged, each chunk once; lines that do not parse are skipped.
fn parse_chunk_log(log: &str) -> kiln_store::PrefetchList {
    let mut list = kiln_store::PrefetchList::default();
    let mut seen = std::collections::HashSet::new();
    for l in log.lines() {
        let mut f = l.split(' ');
        let (Some(name), Some(Ok(i))) = (f.next(), f.next().map(str::parse::<u32>)) else {
            continue;
        };
        if !seen.insert((name.to_string(), i)) {
            continue;
        }
        match name {
            crate::lazy::MEMORY_FILE => list.memory.push(i),
            "disk" => list.disk.push(i),
            _ => {}
        }
    }
    list
}

/// Pauses `vm` and saves its device state to `vmstate` (handed to a jailed QEMU at its start
/// with [`crate::jail::Access::Create`]), its RAM staying in the shared memory file
/// (`x-ignore-shared`): `stop`, `migrate file:<vmstate>`, its end within 120 s. Image
/// snapshots and the builder snapshot ([`crate::builder`]) alike.
///
/// Errors: QMP's ([`QmpError`]), a failed or late migration among them.
pub(crate) async fn save_vmstate(vm: &mut Vm, vmstate: &std::path::Path) -> Result<(), QmpError> {
    vm.qmp.execute("stop", None).await?;
    vm.qmp
        .set_capabilities(crate::qmp::MIGRATION_CAPABILITIES)
        .await?;
    vm.qmp
        .execute(
            "migrate",
            Some(serde_json::json!({"uri": format!("file:{}", vm.qemu_path(vmstate))})),
        )
        .await?;
    vm.qmp.wait_migration(Duration::from_secs(120)).await
}

/// A guest-channel failure as a [`SnapshotError::Guest`]: whether QEMU has gone too (a closed
/// channel means it is exiting: up to 2 s are given for it to be reaped), then the console,
/// where a guest that died early says why.
async fn guest_err(vm: &mut Vm, spec: &VmSpec, what: &str, source: ChannelError) -> SnapshotError {
    let wait = match source {
        ChannelError::Closed(_) => Duration::from_secs(2),
        _ => Duration::ZERO,
    };
    SnapshotError::Guest {
        what: match vm.wait_exited(wait).await {
            Some(status) => format!("{what} (QEMU exited: {status})"),
            None => what.to_string(),
        },
        source,
        console: launch::console_report(&spec.serial_log),
    }
}

/// Connects the guest channel, waits for `hello`, sends `start`, waits for `ready`; returns
/// the channel, still connected, and the guest's wait for idle after its check passed
/// (`ready.settled_ms`).
async fn run_to_ready(
    vm: &mut Vm,
    spec: &VmSpec,
    sandbox: Option<&SandboxSpec>,
    opts: &SnapshotOptions,
) -> Result<(GuestChannel, Duration), SnapshotError> {
    let ch = GuestChannel::connect(&spec.guest_socket, opts.boot_timeout)
        .await
        .map_err(|e| ("connecting to the guest channel", e));
    let mut ch = match ch {
        Ok(ch) => ch,
        Err((what, e)) => return Err(guest_err(vm, spec, what, e).await),
    };
    let hello = match ch.recv_significant("hello", opts.boot_timeout).await {
        Ok(m) => m,
        Err(e) => return Err(guest_err(vm, spec, "waiting for the guest's hello", e).await),
    };
    match hello {
        Message::Hello(h) => tracing::debug!(init = %h.init_version, "guest hello"),
        m => {
            return Err(SnapshotError::Unexpected {
                got: m.type_name().into(),
                want: "hello".into(),
            });
        }
    }
    if let Err(e) = ch.send(&Message::Start(start_message(sandbox))).await {
        return Err(guest_err(vm, spec, "sending start", e).await);
    }
    let ready = match ch.recv_significant("ready", opts.ready_timeout).await {
        Ok(m) => m,
        Err(e) => return Err(guest_err(vm, spec, "waiting for ready", e).await),
    };
    match ready {
        Message::Ready(r) => Ok((ch, Duration::from_millis(r.settled_ms))),
        Message::Failed(f) => Err(SnapshotError::GuestFailed {
            reason: format!("{:?}: {}", f.kind, f.reason),
            console: launch::console_report(&spec.serial_log),
        }),
        m => Err(SnapshotError::Unexpected {
            got: m.type_name().into(),
            want: "ready".into(),
        }),
    }
    .inspect_err(|_| {
        if let Some(s) = vm.exited() {
            tracing::warn!(status = %s, log = %vm.log_tail(), "QEMU exited");
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recording_clones_sockets_fit_below_a_long_tmpdir() {
        // The bench's TMPDIR (29 bytes) failed with the old name; 50 bytes fit now.
        let tmpdir = Path::new("/var/cache/kiln-ci/bench-clone/with-more-room-xyzw");
        assert_eq!(tmpdir.as_os_str().len(), 50);
        let sock = recording_dir(tmpdir).join("state/clones/52139a4b30942840/qmp.sock");
        assert!(
            sock.as_os_str().len() < 108,
            "{} is {} bytes",
            sock.display(),
            sock.as_os_str().len()
        );
        assert_ne!(
            recording_dir(tmpdir),
            recording_dir(tmpdir),
            "one directory per call"
        );
    }

    /// The chunk log becomes the prefetch list in the order first read, each chunk once.
    #[test]
    fn chunk_log_becomes_a_prefetch_list_in_first_read_order() {
        let log = "memory 5 sha256:aa 262144\ndisk 2 sha256:bb 9\nmemory 1 sha256:cc 262144\n\
                   memory 5 sha256:aa 262144\nbogus\ndisk x y z\n";
        let l = parse_chunk_log(log);
        assert_eq!((l.memory, l.disk), (vec![5, 1], vec![2]));
    }

    /// Two recordings keep the chunks both read, in the first one's order, per table (the
    /// same index in memory and disk are different chunks).
    #[test]
    fn two_recordings_keep_the_chunks_both_read_in_the_first_ones_order() {
        let first = parse_chunk_log("memory 7 a 1\nmemory 3 b 1\ndisk 3 c 1\nmemory 9 d 1\n");
        let second = parse_chunk_log("memory 9 d 1\nmemory 7 a 1\ndisk 4 e 1\nmemory 3 b 1\n");
        let l = common_chunks(&first, &second);
        assert_eq!((l.memory, l.disk), (vec![7, 3, 9], vec![]));
        let third = parse_chunk_log("memory 3 b 1\n");
        assert_eq!(common_chunks(&first, &third).memory, vec![3]);
    }
}
