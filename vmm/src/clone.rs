//! Clone start: wake copies of a snapshot, and the state of clones running on this host.
//!
//! [`start_clones`]:
//! 1. Resolve the image tag; its manifest's `snapshot` names the [`SnapshotManifest`].
//! 2. Pick the accelerator (`$KILN_ACCEL`, or probed once per host and remembered in
//!    `<cache>/accel.json`: [`launch::probe_accel_cached`]; only a probe fetches the
//!    snapshot's kernel and initramfs, digest-checked, into `<cache>/<snapshot hex>/`, to boot
//!    them), and compare this host's [`CompatKey`](crate::compat::CompatKey) with the stored
//!    one: a mismatch is refused ([`CloneError::Compat`]) and nothing is removed from the
//!    store. QEMU is handed [`launch::stub`]'s kernel and initramfs: a restore runs neither.
//! 3. Fetch the vmstate (digest-checked). Lazily ([`Serving::Lazy`], what `kiln start` and
//!    the nightly's smoke clones use): make sure the snapshot's chunk server runs
//!    ([`crate::lazy::ensure_server`]) and start the clones from its files
//!    `<cache>/<hex>/mnt/{memory,disk.raw}`, which fetch, verify and cache each chunk when a
//!    clone first reads it: nothing of memory or disk is fetched before QEMU starts. A
//!    chunk the server refuses (digest mismatch, store unreachable after its retries) makes
//!    the read fail and the start fail with [`CloneError::ChunkServer`] naming it. Only when
//!    asked ([`Serving::Materialized`]: `kiln start --materialize`, the tests of this path
//!    in `tests/tests/vm_clone.rs`), materialize the memory file and the disk (every chunk
//!    verified) before QEMU starts, unless a previous start already completed them (marker
//!    `complete`, written only after a verified materialize); the memory file is made
//!    read-only (0444).
//! 4. Per clone: a directory `<state>/<id>/`, a qcow2 overlay over the cached disk, QEMU with
//!    the memory file mapped `share=off,readonly=on,rom=off` (never shared again), `-S
//!    -incoming defer`; `x-ignore-shared`; `migrate-incoming file:vmstate`; `cont`; send
//!    `restore` (32 fresh bytes from `/dev/urandom`, the time, the env, the image's OCI
//!    config user and env for `exec`s: [`ImageDefaults`]); wait for `restored`.
//!    QEMU is then left running on its own; `clone.json` records it for [`list`] / [`stop`].
//!
//! A larger disk ([`CloneOptions::disk_mib`], checked against the image's size before
//! anything is fetched or started: [`clone_disk_bytes`]): the overlay is made at the image's
//! size, so the clone restores with the capacity its saved device state was taken with, and
//! after `cont` QMP `block_resize` grows it. QEMU reads virtio-blk's capacity from the drive
//! whenever the guest reads the device's configuration, but Linux reads it only when the
//! device is probed and on a configuration-change interrupt, so an overlay made larger
//! before the restore would restore but stay invisible to the guest; `block_resize` grows
//! the drive and raises that interrupt (QEMU `hw/block/virtio-blk.c`, its resize callback
//! calls `virtio_notify_config`). The `restore` message then carries the new size and the
//! guest init grows the root file system online before it answers (`fs_bytes` in
//! `restored`); a snapshot whose init does not answer it is refused
//! ([`CloneError::BadSnapshot`]).
//!
//! # The restore message
//! `kiln snapshot` saves the guest with the host still connected to its channel, so the
//! guest init is saved blocked in its read of the port. Without a disk to grow, a start
//! connects to the channel before `migrate-incoming`, waits until QEMU has accepted the
//! connection ([`wait_connected`]), and sends `restore` then: the device state loads with its
//! port connected (QEMU's virtio-serial tells the guest only of a change), and the guest's
//! read returns the message as soon as `cont` runs it. A guest saved disconnected (a snapshot
//! of an older kiln), or a host connecting after `cont`, has the guest init find the port
//! closed and read again every 20 ms until the host is there, so the message waits up to
//! that long. With a disk to grow, `restore` is sent after `block_resize`, as above.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_guest::protocol::{Message, Restore};
use kiln_store::owner::ProcessId;
use kiln_store::{
    Manifest, ManifestDigest, RawManifest, SnapshotManifest, Store, StoreError, TagRef,
};
use serde::{Deserialize, Serialize};

use crate::channel::{ChannelError, GuestChannel};
use crate::compat::CompatError;
use crate::launch::{self, Accel, Host, LaunchError, MemoryMode, Vm, VmSpec, io_err};
use crate::lazy;
use crate::qmp::{Qmp, QmpError};
use crate::snapshot::host_key;

mod verified;
use verified::{holds, stamp_verified};

/// Errors of clone start, list and stop.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    /// The image has no snapshot.
    #[error("{0} has no snapshot (make one with `kiln snapshot {0}`)")]
    NoSnapshot(String),
    /// The tag does not name an image, or its snapshot is not a snapshot manifest.
    #[error("{0} is not an image with a snapshot manifest")]
    NotAnImage(String),
    /// This host cannot restore the snapshot (the snapshot is kept).
    #[error("{image}: {source}")]
    Compat {
        /// The image.
        image: String,
        /// Which fields differ.
        source: CompatError,
    },
    /// The guest did not answer `restore`, or answered wrongly.
    #[error("clone {id}: {what}: {source}\n{console}")]
    Guest {
        /// The clone.
        id: String,
        /// Which step.
        what: String,
        /// The channel error.
        source: ChannelError,
        /// Serial console tail.
        console: String,
    },
    /// QEMU died while the clone started, which is why the step named by `source` failed.
    #[error("clone {id}: QEMU exited ({status}): {source}\n{log}")]
    QemuExited {
        /// The clone.
        id: String,
        /// QEMU's exit ([`Vm::exited`]: says when it was killed at its memory limit).
        status: String,
        /// The tail of QEMU's stderr log.
        log: String,
        /// What failed because of it.
        source: Box<CloneError>,
    },
    /// The guest answered something other than `restored` (an `error` with its message).
    #[error("clone {id}: the guest sent {got} instead of restored")]
    Unexpected {
        /// The clone.
        id: String,
        /// What arrived.
        got: String,
    },
    /// The snapshot manifest describes a machine kiln will not start (it comes from a store,
    /// which may be hostile).
    #[error("snapshot {snapshot}: {reason}")]
    BadSnapshot {
        /// The snapshot manifest.
        snapshot: String,
        /// What is wrong.
        reason: String,
    },
    /// `disk_mib` asks for a disk smaller than the image's (a clone's disk only grows).
    #[error(
        "a disk of {asked_mib} MiB ({asked_bytes} bytes) is smaller than the image's disk, {image_bytes} bytes ({image_mib} MiB): a clone's disk can only grow"
    )]
    DiskTooSmall {
        /// What was asked, MiB.
        asked_mib: u64,
        /// The same in bytes (saturated at `u64::MAX`).
        asked_bytes: u64,
        /// The image's disk, bytes.
        image_bytes: u64,
        /// The same in MiB, rounded up.
        image_mib: u64,
    },
    /// The image's OCI config is too large or not JSON.
    #[error("the image's OCI config: {0}")]
    BadConfig(String),
    /// No clone with that id here.
    #[error("no clone {0} on this host (see `kiln ps`)")]
    NoSuchClone(String),
    /// A clone state file that does not parse.
    #[error("{path}: {reason}")]
    State {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The chunk server refused a read the clone made (it names the chunk and the store).
    #[error(
        "snapshot {snapshot}: the chunk server refused a read: {reason} (the clone failed: {source})"
    )]
    ChunkServer {
        /// The snapshot manifest.
        snapshot: String,
        /// The server's first read error.
        reason: String,
        /// How the clone start failed.
        source: Box<CloneError>,
    },
    /// The chunk server could not be started.
    #[error(transparent)]
    Lazy(#[from] crate::lazy::LazyError),
    /// The store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// QEMU.
    #[error(transparent)]
    Launch(#[from] LaunchError),
}

impl From<QmpError> for CloneError {
    fn from(e: QmpError) -> Self {
        CloneError::Launch(e.into())
    }
}

/// Default [`CloneOptions::restore_timeout`]: 60 s from QEMU's start to the guest's
/// `restored`, which a lazily served clone's chunk reads must fail well within (see the
/// chunk server's read bound, [`crate::lazy`]).
pub const DEFAULT_RESTORE_TIMEOUT: Duration = Duration::from_secs(60);

/// Options of [`start_clones`].
#[derive(Debug, Clone)]
pub struct CloneOptions {
    /// How many clones (default 1).
    pub count: usize,
    /// `KEY=value` given to the guest in `restore` (for processes started after it).
    pub env: Vec<String>,
    /// Where running clones are recorded ([`default_state_dir`]).
    pub state_dir: PathBuf,
    /// Where materialized snapshots are cached ([`default_cache_dir`]).
    pub cache_dir: PathBuf,
    /// QEMU start → `restored`, per clone ([`DEFAULT_RESTORE_TIMEOUT`]).
    pub restore_timeout: Duration,
    /// Accelerator; `None`: [`launch::probe_accel_cached`].
    pub accel: Option<Accel>,
    /// The clones' disk size, MiB (`kiln start --disk-mib`); `None`: the image's. Smaller
    /// than the image's is refused ([`CloneError::DiskTooSmall`]).
    pub disk_mib: Option<u64>,
    /// Where memory and disk come from (step 3 of the module doc).
    pub serving: Serving,
}

/// Where a clone's memory file and disk come from (issue 35 §3): every caller chooses, and
/// every caller that starts clones to use them (`kiln start`, the nightly's smoke clones)
/// chooses [`Serving::Lazy`], the one lazy path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serving {
    /// Served on demand by the snapshot's chunk server ([`crate::lazy`]): nothing of memory
    /// or disk is fetched before QEMU starts, only what the clone reads. `server`: the
    /// program and its first arguments, to which the snapshot digest and its cache
    /// directory are appended (`kiln` passes itself and `__lazy-serve`).
    Lazy {
        /// The chunk server's command line.
        server: Vec<std::ffi::OsString>,
    },
    /// Downloaded whole into the cache (every chunk verified) before QEMU starts, once per
    /// snapshot and cache: `kiln start --materialize`, and tests of the materialized path.
    Materialized,
}

impl CloneOptions {
    /// Defaults with the given directories and serving.
    pub fn new(state_dir: PathBuf, cache_dir: PathBuf, serving: Serving) -> Self {
        Self {
            count: 1,
            env: Vec::new(),
            state_dir,
            cache_dir,
            restore_timeout: DEFAULT_RESTORE_TIMEOUT,
            accel: None,
            disk_mib: None,
            serving,
        }
    }
}

/// `$KILN_STATE_DIR`, else `$XDG_RUNTIME_DIR/kiln`, else `~/.local/state/kiln`, else
/// `/tmp/kiln-state`; clones live in `<it>/clones/`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KILN_STATE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("kiln");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".local/state/kiln"),
        None => PathBuf::from("/tmp/kiln-state"),
    }
}

/// `$KILN_SNAPSHOT_CACHE`, else `~/.cache/kiln/snapshots`, else `/tmp/kiln-snapshots`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KILN_SNAPSHOT_CACHE") {
        return PathBuf::from(d);
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/kiln/snapshots"),
        None => PathBuf::from("/tmp/kiln-snapshots"),
    }
}

/// A clone running on this host (`<state>/clones/<id>/clone.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneRecord {
    /// Clone id (16 hex digits).
    pub id: String,
    /// QEMU's pid.
    pub pid: u32,
    /// The image reference it was started from.
    pub image: String,
    /// The snapshot manifest.
    pub snapshot: String,
    /// The guest's new machine id.
    pub machine_id: String,
    /// Hex of 16 random bytes the guest read after the reseed.
    pub random: String,
    /// The guest's boot id (shared with the snapshot's other clones).
    pub boot_id: String,
    /// Unix seconds when it started.
    pub started_unix: u64,
    /// QEMU start → `restored`, ms.
    pub start_ms: u64,
    /// Where the start's time went, ms (all 0 in records written before this field existed).
    #[serde(default)]
    pub phases: StartPhases,
    /// The clone's directory (QMP socket, overlay, console log).
    pub dir: PathBuf,
    /// The clone's disk size, bytes (the image's unless grown with
    /// [`CloneOptions::disk_mib`]); 0 in records written before this field existed.
    #[serde(default)]
    pub disk_bytes: u64,
}

/// The phases of one clone's start, ms each, in order: what `kiln start` did before this
/// clone's QEMU was spawned, then the three parts of [`CloneRecord::start_ms`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartPhases {
    /// The call's start → this clone's QEMU spawned: the tag and manifests read, the kernel,
    /// initramfs and vmstate fetched or checked, the chunk server running, the overlay made
    /// (for the second clone of a call and later, from the previous clone's answer).
    pub prepare_ms: u64,
    /// QEMU spawned (jailed) → its QMP monitor answering.
    pub spawn_ms: u64,
    /// `migrate-incoming` of the vmstate, its end, `cont` (and `block_resize` when grown).
    pub resume_ms: u64,
    /// The guest channel connected, `restore` sent → `restored` received.
    pub guest_ms: u64,
}

impl CloneRecord {
    /// Whether its QEMU process still runs: the recorded pid is a QEMU whose command line
    /// names the clone's directory (so a pid reused by another process, another clone's QEMU
    /// too, is not taken for it).
    pub fn running(&self) -> bool {
        is_qemu_of(self.pid, &self.dir)
    }

    /// Why kiln stopped the clone, when it did: the chunk server's watcher writes it to
    /// `<dir>/stopped` ([`crate::lazy::STOPPED`]) when the server that served the clone's
    /// memory and disk died.
    pub fn stopped_reason(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join(crate::lazy::STOPPED)).ok()
    }
}

/// A snapshot materialized in the local cache.
#[derive(Debug, Clone)]
struct Cached {
    dir: PathBuf,
    kernel: PathBuf,
    initramfs: PathBuf,
    vmstate: PathBuf,
    memory: PathBuf,
    disk: PathBuf,
}

/// The snapshot manifest attached to the image manifest `d`, checked ([`check_snapshot`]):
/// parsed, and its bytes as stored (their digest is the snapshot's).
async fn snapshot_of(
    store: &Store,
    d: ManifestDigest,
    image_ref: &str,
) -> Result<(SnapshotManifest, RawManifest), CloneError> {
    let Manifest::Image(img) = store.get_manifest(&d).await? else {
        return Err(CloneError::NotAnImage(image_ref.to_string()));
    };
    let Some(sd) = img.snapshot else {
        return Err(CloneError::NoSnapshot(image_ref.to_string()));
    };
    let raw = store.get_raw_manifest(&sd).await?;
    match raw.parse().map_err(StoreError::from)? {
        Manifest::Snapshot(s) => {
            check_snapshot(&s).map_err(|reason| CloneError::BadSnapshot {
                snapshot: sd.to_string(),
                reason,
            })?;
            Ok((s, raw))
        }
        Manifest::Image(_) => Err(CloneError::NotAnImage(image_ref.to_string())),
    }
}

/// The image's user and environment, the defaults of `exec`s in its clones: its OCI config's
/// `config.User` (`0` when empty) and `config.Env` (image-spec `config.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDefaults {
    /// `config.User`, or `0`.
    pub user: String,
    /// `config.Env`.
    pub env: Vec<String>,
}

/// Largest OCI config read for [`ImageDefaults`], bytes (4 MiB; the store may be hostile).
const MAX_OCI_CONFIG_LEN: u64 = 4 << 20;

/// Reads [`ImageDefaults`] from the OCI config of the image manifest `image`; `None` when it
/// has none.
///
/// Errors: the store's; a config over 4 MiB or not JSON is [`CloneError::BadConfig`].
pub async fn image_defaults(
    store: &Store,
    image: &ManifestDigest,
) -> Result<Option<ImageDefaults>, CloneError> {
    let Manifest::Image(img) = store.get_manifest(image).await? else {
        return Err(CloneError::NotAnImage(image.to_string()));
    };
    let Some(cfg) = &img.oci_config else {
        return Ok(None);
    };
    if cfg.size > MAX_OCI_CONFIG_LEN {
        return Err(CloneError::BadConfig(format!(
            "{} bytes, more than {MAX_OCI_CONFIG_LEN}",
            cfg.size
        )));
    }
    let bytes = store.get_blob(&cfg.digest).await?;
    parse_image_defaults(&bytes).map(Some)
}

fn parse_image_defaults(bytes: &[u8]) -> Result<ImageDefaults, CloneError> {
    #[derive(Deserialize, Default)]
    struct Oci {
        #[serde(default)]
        config: Option<Config>,
    }
    #[derive(Deserialize, Default)]
    #[serde(rename_all = "PascalCase")]
    struct Config {
        #[serde(default)]
        user: Option<String>,
        #[serde(default)]
        env: Option<Vec<String>>,
    }
    let oci: Oci = serde_json::from_slice(bytes)
        .map_err(|e| CloneError::BadConfig(format!("not an OCI image config: {e}")))?;
    let c = oci.config.unwrap_or_default();
    Ok(ImageDefaults {
        user: c
            .user
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "0".into()),
        env: c.env.unwrap_or_default(),
    })
}

/// The disk size of a clone of an image whose disk is `image_bytes`, when `disk_mib` asks
/// for one: `Some(bytes)` to grow to, `None` when nothing is to grow (not asked, or the
/// image's size exactly).
///
/// Errors: [`CloneError::DiskTooSmall`] (naming both sizes) when `disk_mib` MiB is less than
/// `image_bytes`.
pub fn clone_disk_bytes(
    disk_mib: Option<u64>,
    image_bytes: u64,
) -> Result<Option<u64>, CloneError> {
    let Some(mib) = disk_mib else {
        return Ok(None);
    };
    let bytes = mib.saturating_mul(1 << 20);
    if bytes < image_bytes {
        return Err(CloneError::DiskTooSmall {
            asked_mib: mib,
            asked_bytes: bytes,
            image_bytes,
            image_mib: image_bytes.div_ceil(1 << 20),
        });
    }
    Ok((bytes > image_bytes).then_some(bytes))
}

/// Largest guest RAM a snapshot may ask for, bytes (256 GiB).
pub const MAX_MEMORY_BYTES: u64 = 256 << 30;
/// Most vCPUs a snapshot may ask for.
pub const MAX_VCPUS: u32 = 64;

/// Refuses snapshot manifests kiln would not have written: memory size not a whole number of
/// MiB, over [`MAX_MEMORY_BYTES`], or different from the memory table's size; vCPUs outside
/// 1..=[`MAX_VCPUS`]; a prefetch list naming a chunk out of its table or a hole.
pub fn check_snapshot(s: &SnapshotManifest) -> Result<(), String> {
    if s.memory_bytes == 0 || !s.memory_bytes.is_multiple_of(1 << 20) {
        return Err(format!(
            "memory size {} is not a positive whole number of MiB",
            s.memory_bytes
        ));
    }
    if s.memory_bytes > MAX_MEMORY_BYTES {
        return Err(format!(
            "memory size {} is over the {MAX_MEMORY_BYTES}-byte limit",
            s.memory_bytes
        ));
    }
    if s.memory.size != s.memory_bytes {
        return Err(format!(
            "memory table covers {} bytes, the manifest says {}",
            s.memory.size, s.memory_bytes
        ));
    }
    if !(1..=MAX_VCPUS).contains(&s.vcpus) {
        return Err(format!("{} vCPUs (1 to {MAX_VCPUS} accepted)", s.vcpus));
    }
    if let Some(p) = &s.prefetch {
        p.chunks(s)?;
    }
    Ok(())
}

/// What [`materialize`] fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fetch {
    /// Kernel and initramfs.
    Boot,
    /// The vmstate (the chunk server serves memory and disk).
    VmState,
    /// The vmstate, and memory and disk as local files.
    All,
}

/// Fetches the snapshot's kernel and initramfs ([`Fetch::Boot`]), or its vmstate, each
/// digest-checked every time (a copy already in the cache is hashed, and fetched again only
/// when it no longer holds its blob), and, for [`Fetch::All`], its memory and disk (verified
/// chunks) unless already complete in the cache.
async fn materialize(
    store: &Store,
    digest: &ManifestDigest,
    snap: &SnapshotManifest,
    cache_dir: &Path,
    what: Fetch,
) -> Result<Cached, CloneError> {
    let dir = cache_dir.join(digest.hex());
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let c = Cached {
        kernel: dir.join("vmlinux"),
        initramfs: dir.join("initramfs"),
        vmstate: dir.join("vmstate"),
        memory: dir.join("memory"),
        disk: dir.join("disk.raw"),
        dir,
    };
    // Replaced by rename, never rewritten in place: a QEMU of another start may be reading
    // the previous copy. A copy an earlier start left is kept when it still holds the blob
    // ([`holds`]): a warm start then reads the 50 MB kernel from the local disk instead of
    // the store (measured: 435 ms of a 1,018 ms warm start from S3).
    let fetch = async |digest: &kiln_store::BlobDigest, dest: &Path| {
        let (d, p) = (*digest, dest.to_path_buf());
        if tokio::task::spawn_blocking(move || holds(&p, &d))
            .await
            .unwrap_or(false)
        {
            return Ok(());
        }
        let tmp = dest.with_extension(format!("tmp-{}", std::process::id()));
        store.get_blob_to_file(digest, &tmp).await?;
        std::fs::rename(&tmp, dest).map_err(io_err(dest))?;
        // Hashed as it came (get_blob_to_file): stamped so that the next start need not.
        stamp_verified(dest, digest);
        Ok::<_, CloneError>(())
    };
    if what == Fetch::Boot {
        // Both at once: the kernel (about 50 MB) is most of a cold start's wait before QEMU.
        tokio::try_join!(
            fetch(&snap.kernel.digest, &c.kernel),
            fetch(&snap.initramfs.digest, &c.initramfs)
        )?;
        return Ok(c);
    }
    // The vmstate first: small, and a corrupted one must fail before any QEMU starts.
    fetch(&snap.vmstate.digest, &c.vmstate).await?;
    if what == Fetch::VmState {
        return Ok(c);
    }
    // One materializer at a time per snapshot (flock on `<dir>/lock`, released on drop).
    let _lock = launch::lock_file(&c.dir.join("lock")).await?;
    let marker = c.dir.join("complete");
    if !marker.exists() {
        let _ = std::fs::remove_file(&c.memory);
        store.materialize(&snap.memory, &c.memory, None).await?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&c.memory, std::fs::Permissions::from_mode(0o444))
            .map_err(io_err(&c.memory))?;
        store.materialize(&snap.disk, &c.disk, None).await?;
        std::fs::write(&marker, digest.to_string()).map_err(io_err(&marker))?;
    }
    Ok(c)
}

/// The accelerator probe's answer on this host, remembered beside the cached snapshots
/// (`<cache>/accel.json`, [`launch::probe_accel_cached`]).
pub const PROBE_CACHE: &str = "accel.json";

/// QEMU's version and its jail's root plan, remembered beside the cached snapshots
/// (`<cache>/qemu.json`, [`launch::facts`]).
pub const QEMU_FACTS: &str = "qemu.json";

/// Starts `opts.count` clones of the snapshot attached to `image_ref`, all or none: when one
/// fails, those already started by this call are stopped before the error returns. See the
/// module doc.
pub async fn start_clones(
    store: &Store,
    image_ref: &TagRef,
    opts: &CloneOptions,
) -> Result<Vec<CloneRecord>, CloneError> {
    let d = store.resolve_tag(image_ref).await?;
    start_clones_of(store, d, &image_ref.to_string(), opts).await
}

/// [`start_clones`] of the image manifest `image` itself (no tag needs to name it; the
/// nightly job smoke-tests an image before any tag moves); `name` is what the clone records
/// say it is a clone of.
pub async fn start_clones_of(
    store: &Store,
    image: ManifestDigest,
    name: &str,
    opts: &CloneOptions,
) -> Result<Vec<CloneRecord>, CloneError> {
    let begun = Instant::now();
    let image_ref = name;
    let (snap, raw_snap) = snapshot_of(store, image, image_ref).await?;
    let digest = raw_snap.digest;
    // Refused before anything is fetched or started.
    let grow = clone_disk_bytes(opts.disk_mib, snap.disk.size)?;
    let host = Host::detect_cached(&opts.cache_dir.join(QEMU_FACTS)).await?;
    let guest = format!("{} {}", snap.kernel.digest, snap.initramfs.digest);
    let check = |accel: Accel| {
        host_key(
            &host,
            accel,
            &snap.kernel,
            &snap.initramfs,
            snap.vcpus,
            snap.memory_bytes,
        )
        .check(&snap.compatibility_key)
        .map_err(|source| CloneError::Compat {
            image: image_ref.to_string(),
            source,
        })
    };
    // An accelerator known without a probe ($KILN_ACCEL, or this host's remembered probe)
    // lets the compatibility check come first and everything after it overlap: the vmstate,
    // the chunk server's start, the image's config. Measured cold from the local S3 server
    // (issue 35, busybox): one after the other, the chunk server, whose prefetch the clone
    // then waited for, was spawned 540 ms into the start; overlapped, it is spawned at once.
    // Otherwise the probe needs the kernel (53 MB from the store on a cold host) first.
    let known = match opts.accel {
        Some(a) => Some(a),
        None => launch::known_accel(&host, &guest, &opts.cache_dir.join(PROBE_CACHE))?,
    };
    if let Some(a) = known {
        check(a)?;
    }
    // A restore runs none of the kernel and initramfs it is given (launch::stub): they are
    // fetched only for the accelerator probe, which boots them.
    let boot = async {
        let accel = match known {
            Some(a) => a,
            None => {
                let cached =
                    materialize(store, &digest, &snap, &opts.cache_dir, Fetch::Boot).await?;
                let a = launch::probe_accel_cached(
                    &host,
                    &cached.kernel,
                    &cached.initramfs,
                    &cached.dir,
                    &guest,
                    &opts.cache_dir.join(PROBE_CACHE),
                )
                .await?;
                check(a)?;
                a
            }
        };
        let stub = launch::stub::restore_stub(&opts.cache_dir)?;
        Ok::<_, CloneError>((stub, accel))
    };
    // With a chunk server, nothing of memory or disk is fetched before QEMU runs: the
    // server fetches what the clones read (module doc, step 3).
    let serve = async {
        match &opts.serving {
            Serving::Lazy { server: program } => {
                // The server (and its prefetch) starts while the vmstate comes.
                let dir = opts.cache_dir.join(digest.hex());
                let (c, served) = tokio::try_join!(
                    materialize(store, &digest, &snap, &opts.cache_dir, Fetch::VmState),
                    async {
                        lazy::ensure_server(program, &raw_snap, &dir, opts.restore_timeout)
                            .await
                            .map_err(CloneError::Lazy)
                    }
                )?;
                Ok::<_, CloneError>((c, Some(served)))
            }
            Serving::Materialized => Ok((
                materialize(store, &digest, &snap, &opts.cache_dir, Fetch::All).await?,
                None,
            )),
        }
    };
    let defaults = image_defaults(store, &snap.image);
    let ((boot, accel), (mut cached, served), defaults) = if known.is_some() {
        tokio::try_join!(boot, serve, defaults)?
    } else {
        // Nothing of the snapshot before the probe has said it may run here.
        let b = boot.await?;
        let (s, d) = tokio::try_join!(serve, defaults)?;
        (b, s, d)
    };
    (cached.kernel, cached.initramfs) = boot;
    if let Some(s) = &served {
        cached.memory = s.memory.clone();
        cached.disk = s.disk.clone();
    }
    let clones_dir = opts.state_dir.join("clones");
    std::fs::create_dir_all(&clones_dir).map_err(io_err(&clones_dir))?;
    let mut out: Vec<CloneRecord> = Vec::new();
    let mut since = begun;
    for _ in 0..opts.count {
        match start_one(
            since,
            &host,
            accel,
            &snap,
            &digest,
            image_ref,
            &cached,
            &clones_dir,
            opts,
            defaults.as_ref(),
            grow,
        )
        .await
        {
            Ok(rec) => {
                since = Instant::now();
                out.push(rec)
            }
            Err(e) => {
                // A read the chunk server refused (a corrupt chunk, an unreachable store) is
                // why the clone died: say so, naming the chunk.
                let e = match served.as_ref().and_then(|s| lazy::failure(&s.dir)) {
                    Some(reason) => CloneError::ChunkServer {
                        snapshot: digest.to_string(),
                        reason,
                        source: Box::new(e),
                    },
                    None => e,
                };
                // All or nothing: the clones this call already started are stopped.
                for rec in &out {
                    if let Err(se) = stop(&opts.state_dir, &rec.id).await {
                        tracing::warn!(id = %rec.id, error = %se, "stopping an earlier clone");
                    }
                }
                return Err(e);
            }
        }
    }
    // The use lock is released only now that every clone's QEMU runs.
    drop(served);
    Ok(out)
}

/// How long [`wait_connected`] waits for QEMU to accept the host's connection.
const ACCEPT_WAIT: Duration = Duration::from_millis(200);

/// Waits until QEMU has accepted the host's connection to the socket chardev `label`, so that
/// the device state loaded next finds its port connected: QMP `query-chardev` describes an
/// unaccepted socket with a `filename` beginning `disconnected:` (QEMU
/// `chardev/char-socket.c`). Polled every millisecond, at most [`ACCEPT_WAIT`]. Best effort:
/// past the bound, or on a QMP error, the start goes on, and the guest is told the host left
/// and came back, as when the host connects after `cont`, and reads the message on its next
/// poll (module doc, "The restore message").
async fn wait_connected(qmp: &mut Qmp, label: &str) {
    let deadline = Instant::now() + ACCEPT_WAIT;
    loop {
        let Ok(v) = qmp.execute("query-chardev", None).await else {
            return;
        };
        let accepted = v.as_array().into_iter().flatten().any(|c| {
            c["label"] == label
                && c["filename"]
                    .as_str()
                    .is_some_and(|f| !f.starts_with("disconnected:"))
        });
        if accepted {
            return;
        }
        if Instant::now() >= deadline {
            tracing::debug!(label, "QEMU had not accepted the channel's connection");
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Resumes a QEMU started with `-incoming defer` ([`VmSpec::incoming`]) from the device
/// state in `vmstate` (handed to a jailed QEMU at its start), its RAM being the memory file
/// it maps: `x-ignore-shared`, `migrate-incoming file:<vmstate>`, the migration's end within
/// `timeout`, `cont`. Clones and builder VMs ([`crate::builder`]) alike.
///
/// Errors: QMP's ([`QmpError`]), a failed or late migration among them.
pub(crate) async fn resume_incoming(
    vm: &mut Vm,
    vmstate: &Path,
    timeout: Duration,
) -> Result<(), QmpError> {
    vm.qmp
        .set_capabilities(crate::qmp::MIGRATION_CAPABILITIES)
        .await?;
    vm.qmp
        .execute(
            "migrate-incoming",
            Some(serde_json::json!({"uri": format!("file:{}", vm.qemu_path(vmstate))})),
        )
        .await?;
    vm.qmp.wait_migration(timeout).await?;
    vm.qmp.execute("cont", None).await?;
    Ok(())
}

/// The `restore` a copy of a snapshot gets first: 32 fresh bytes of `/dev/urandom` for the
/// guest's reseed, the host's wall clock, `env`; no image defaults, no disk growth. Clones
/// and builder VMs ([`crate::builder`]) alike.
///
/// Errors: `/dev/urandom` unreadable ([`LaunchError::Io`]).
pub(crate) fn fresh_restore(env: Vec<String>) -> Result<Restore, LaunchError> {
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    Ok(Restore::new(&random_bytes(32)?, now_ns, env))
}

fn random_bytes(n: usize) -> Result<Vec<u8>, LaunchError> {
    use std::io::Read;
    let mut b = vec![0u8; n];
    let p = Path::new("/dev/urandom");
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(io_err(p))?;
    Ok(b)
}

#[allow(clippy::too_many_arguments)]
async fn start_one(
    since: Instant,
    host: &Host,
    accel: Accel,
    snap: &SnapshotManifest,
    digest: &ManifestDigest,
    image_ref: &str,
    cached: &Cached,
    clones_dir: &Path,
    opts: &CloneOptions,
    defaults: Option<&ImageDefaults>,
    grow: Option<u64>,
) -> Result<CloneRecord, CloneError> {
    let id = hex::encode(random_bytes(8)?);
    let dir = clones_dir.join(&id);
    // 0700: the clone's QEMU runs as a uid of its own and owns its overlay and console log
    // here (crate::jail); no other uid reaches them by path, a later holder of that uid
    // included.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(&dir)
        .map_err(io_err(&dir))?;
    // Say whose directory this is before any process is started in it: a start killed from
    // here on leaves a record that [`list`] reaps.
    write_starting(&dir, None)?;
    let overlay = dir.join("disk.qcow2");
    launch::qcow2_overlay(host, &cached.disk, &overlay).await?;
    let spec = VmSpec {
        max_disk_bytes: grow,
        accel,
        vcpus: snap.vcpus,
        memory_bytes: snap.memory_bytes,
        kernel: cached.kernel.clone(),
        initramfs: cached.initramfs.clone(),
        memory_file: cached.memory.clone(),
        memory_mode: MemoryMode::Private,
        disk: overlay,
        disk_format: crate::launch::DiskFormat::Qcow2,
        ro_disks: Vec::new(),
        rw_disks: Vec::new(),
        qmp_socket: dir.join("qmp.sock"),
        guest_socket: dir.join("guest.sock"),
        serial_log: dir.join("console.log"),
        incoming: true,
        tsc_khz: host.tsc_khz,
        egress_socket: None,
        kernel_args: vec![],
    };
    let t0 = Instant::now();
    let mut phases = StartPhases {
        prepare_ms: millis(t0 - since),
        ..StartPhases::default()
    };
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // The vmstate is read through QMP `migrate-incoming` after QEMU's start: handed to it
    // now (crate::jail).
    let vm = Vm::spawn_with(
        host,
        &spec,
        &dir.join("qemu.log"),
        opts.restore_timeout,
        false,
        &[(cached.vmstate.as_path(), crate::jail::Access::Read)],
    )
    .await;
    let mut vm = match vm {
        Ok(vm) => vm,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e.into());
        }
    };
    let res = async {
        let vm = &mut vm;
        // QEMU outlives this process from here on; a reaper finds it by its command line even
        // if this process dies before this line.
        write_starting(&dir, Some(vm.pid))?;
        phases.spawn_ms = millis(t0.elapsed());
        let resuming = Instant::now();
        let guest_err = |what: &str, source: ChannelError| CloneError::Guest {
            id: id.clone(),
            what: what.to_string(),
            source,
            console: launch::console_report(&spec.serial_log),
        };
        let restore_message = || -> Result<Message, CloneError> {
            Ok(Message::Restore(Restore {
                image_user: defaults.map(|d| d.user.clone()),
                image_env: defaults.map(|d| d.env.clone()),
                disk_bytes: grow,
                ..fresh_restore(opts.env.clone())?
            }))
        };
        // The restore message waits in the channel before the guest runs, unless the disk
        // grows first (module doc, "The restore message").
        let mut early = None;
        if grow.is_none() {
            let mut ch = GuestChannel::connect(&spec.guest_socket, opts.restore_timeout)
                .await
                .map_err(|e| guest_err("connecting to the guest channel", e))?;
            wait_connected(&mut vm.qmp, launch::GUEST_CHARDEV).await;
            ch.send(&restore_message()?)
                .await
                .map_err(|e| guest_err("sending restore", e))?;
            early = Some(ch);
        }
        resume_incoming(vm, &cached.vmstate, opts.restore_timeout).await?;
        if let Some(size) = grow {
            // Grows the overlay and tells the guest (see the module doc).
            vm.qmp
                .execute(
                    "block_resize",
                    Some(serde_json::json!({"device": launch::DRIVE_ID, "size": size})),
                )
                .await?;
        }
        phases.resume_ms = millis(resuming.elapsed());
        let answering = Instant::now();
        let mut ch = match early {
            Some(ch) => ch,
            None => {
                let mut ch = GuestChannel::connect(&spec.guest_socket, opts.restore_timeout)
                    .await
                    .map_err(|e| guest_err("connecting to the guest channel", e))?;
                ch.send(&restore_message()?)
                    .await
                    .map_err(|e| guest_err("sending restore", e))?;
                ch
            }
        };
        let left = opts.restore_timeout.saturating_sub(t0.elapsed());
        let r = match ch
            .recv_significant("restored", left)
            .await
            .map_err(|e| guest_err("waiting for restored", e))?
        {
            Message::Restored(r) if grow.is_some() && r.fs_bytes.is_none() => {
                return Err(CloneError::BadSnapshot {
                    snapshot: digest.to_string(),
                    reason: "its guest init does not grow the root file system (it answered \
                             restore without fs_bytes); a larger disk needs a snapshot made by \
                             this kiln"
                        .into(),
                });
            }
            Message::Restored(r) => r,
            m => {
                return Err(CloneError::Unexpected {
                    id: id.clone(),
                    // A restore the guest could not apply (a disk it could not grow) says why.
                    got: match m {
                        Message::Error(e) => format!("error ({})", e.message),
                        m => m.type_name().into(),
                    },
                });
            }
        };
        phases.guest_ms = millis(answering.elapsed());
        Ok::<_, CloneError>(r)
    }
    .await;
    let r = match res {
        Ok(x) => x,
        Err(e) => {
            // A QEMU that died (killed at its cgroup's memory limit, say) is why: say so.
            let e = match vm.wait_exited(Duration::from_millis(200)).await {
                Some(status) => CloneError::QemuExited {
                    id: id.clone(),
                    status,
                    log: vm.log_tail(),
                    source: Box::new(e),
                },
                None => e,
            };
            // Dropping the handle kills QEMU; leave no directory behind.
            drop(vm);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    let rec = CloneRecord {
        id: id.clone(),
        pid: vm.pid,
        image: image_ref.to_string(),
        snapshot: digest.to_string(),
        machine_id: r.machine_id,
        random: r.random,
        boot_id: r.boot_id,
        started_unix,
        start_ms: millis(t0.elapsed()),
        phases,
        dir: dir.clone(),
        disk_bytes: grow.unwrap_or(snap.disk.size),
    };
    let path = dir.join("clone.json");
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&rec).map_err(|e| CloneError::State {
            path: path.clone(),
            reason: e.to_string(),
        })?,
    )
    .map_err(io_err(&path))?;
    let _ = std::fs::remove_file(dir.join(STARTING));
    vm.detach();
    Ok(rec)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The file of a clone being started (`<clone dir>/starting.json`), written (atomically, by
/// rename) when its directory is made and again once QEMU runs, and removed once `clone.json`
/// is: the pid of the `kiln start` that owns the directory and, once known, QEMU's pid. A
/// clone directory that has it but no `clone.json`, and whose starter is gone, is a start that
/// was killed midway; [`list`] stops every QEMU whose command line names the directory and
/// removes it.
const STARTING: &str = "starting.json";

/// What [`STARTING`] holds.
#[derive(Debug, Serialize, Deserialize)]
struct Starting {
    /// QEMU's pid, `null` until QEMU runs.
    qemu: Option<u32>,
    /// The starting process: pid and start time, so that a pid reused by another process
    /// after the starter died does not keep the start alive ([`kiln_store::owner`]).
    starter: ProcessId,
}

fn write_starting(dir: &Path, qemu: Option<u32>) -> Result<(), CloneError> {
    let path = dir.join(STARTING);
    let tmp = dir.join(format!("{STARTING}.tmp"));
    let s = Starting {
        qemu,
        starter: ProcessId::current(),
    };
    // Serializing two integers cannot fail.
    let bytes = serde_json::to_vec(&s).unwrap_or_default();
    std::fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(())
}

/// Whether process `pid` is a QEMU (qemu-system-*, qemu-img: its program's file name starts
/// `qemu-`) whose command line names a path inside `dir`, from `/proc/<pid>/cmdline`
/// (proc(5): the arguments, each ended by a NUL byte).
fn is_qemu_of(pid: u32, dir: &Path) -> bool {
    let Ok(c) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let mut prefix = dir.as_os_str().as_encoded_bytes().to_vec();
    prefix.push(b'/');
    let mut args = c.split(|b| *b == 0);
    let is_qemu = args
        .next()
        .and_then(|a0| a0.rsplit(|b| *b == b'/').next())
        .is_some_and(|name| name.starts_with(b"qemu-"));
    is_qemu && args.any(|a| a.windows(prefix.len()).any(|w| w == prefix.as_slice()))
}

/// The pids of the QEMU processes whose command line names a path inside `dir`
/// ([`is_qemu_of`]).
pub(crate) fn qemus_in(dir: &Path) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| is_qemu_of(*pid, dir))
        .collect()
}

/// How long [`reap_abandoned`] waits for the QEMUs it killed to exit.
const REAP_WAIT: Duration = Duration::from_secs(10);

/// Stops and removes the clone in `dir` if it is a start whose starter died (see
/// [`STARTING`]): SIGKILL of every QEMU whose command line names the directory. Returns
/// whether it was removed.
fn reap_abandoned(dir: &Path) -> bool {
    let Ok(bytes) = std::fs::read(dir.join(STARTING)) else {
        return false;
    };
    let Ok(s) = serde_json::from_slice::<Starting>(&bytes) else {
        return false;
    };
    if s.starter.is_alive() || dir.join("clone.json").exists() {
        return false;
    }
    for pid in qemus_in(dir) {
        // SAFETY: kill(2) of a pid whose command line we just read as a QEMU of this clone's
        // directory; no memory is touched.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
    // SIGKILL is delivered at once but a QEMU takes a while to exit (it unmaps its guest
    // RAM first): wait until none is left, so that a listing that returns has left no QEMU
    // it does not list (at most REAP_WAIT; one still there is only logged).
    let deadline = Instant::now() + REAP_WAIT;
    while !qemus_in(dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(pid) = qemus_in(dir).first() {
        tracing::warn!(pid, dir = %dir.display(), "a killed QEMU has not exited yet");
    }
    tracing::warn!(dir = %dir.display(), "removing a clone whose kiln start died while starting it");
    std::fs::remove_dir_all(dir).is_ok()
}

/// The clones recorded under `state_dir` (running or not), sorted by start time. A start
/// that was killed before it recorded its clone is stopped and removed on the way.
pub fn list(state_dir: &Path) -> Result<Vec<CloneRecord>, CloneError> {
    let dir = state_dir.join("clones");
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(&dir)(e).into()),
    };
    let mut out = Vec::new();
    for ent in rd.flatten() {
        let p = ent.path().join("clone.json");
        let Ok(bytes) = std::fs::read(&p) else {
            // A clone still starting, a start that was killed midway (stopped and removed
            // here), or a stray directory.
            reap_abandoned(&ent.path());
            continue;
        };
        let rec: CloneRecord = serde_json::from_slice(&bytes).map_err(|e| CloneError::State {
            path: p.clone(),
            reason: e.to_string(),
        })?;
        out.push(rec);
    }
    out.sort_by(|a, b| (a.started_unix, &a.id).cmp(&(b.started_unix, &b.id)));
    Ok(out)
}

/// Stops the clone `id`: QMP `quit` (2 s), else SIGKILL of its recorded pid (only if that pid
/// is still a QEMU); removes its directory. Returns whether it was running.
pub async fn stop(state_dir: &Path, id: &str) -> Result<bool, CloneError> {
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(CloneError::NoSuchClone(id.to_string()));
    }
    let rec = list(state_dir)?
        .into_iter()
        .find(|r| r.id == id)
        .ok_or_else(|| CloneError::NoSuchClone(id.to_string()))?;
    let was_running = rec.running();
    if was_running {
        if let Ok(mut q) = Qmp::connect(&rec.dir.join("qmp.sock"), Duration::from_secs(2)).await {
            let _ = q.execute_within("quit", None, Duration::from_secs(2)).await;
        }
        for _ in 0..100 {
            if !rec.running() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if rec.running() {
            // SAFETY: kill(2) with a pid we recorded and just checked is a QEMU; no memory
            // is touched.
            unsafe {
                libc::kill(rec.pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
    std::fs::remove_dir_all(&rec.dir).map_err(io_err(&rec.dir))?;
    Ok(was_running)
}

/// A snapshot manifest for unit tests: `memory_bytes` of guest RAM in a memory table of
/// `table` bytes (one hole), a 1 MiB disk (one hole), `vcpus`; every blob the same.
#[cfg(test)]
pub(crate) fn test_snapshot(memory_bytes: u64, table: u64, vcpus: u32) -> SnapshotManifest {
    use kiln_store::chunk::{ChunkEntry, ChunkTable, Chunking};
    use kiln_store::manifest::{SCHEMA_VERSION, SNAPSHOT_MEDIA_TYPE};
    use kiln_store::{BlobDigest, BlobRef};
    let blob = BlobRef {
        digest: BlobDigest::of(b"x"),
        size: 1,
        media_type: None,
    };
    let t = |size| ChunkTable {
        size,
        chunking: Chunking::MEMORY_DEFAULT,
        entries: vec![ChunkEntry {
            offset: 0,
            raw_len: size,
            digest: None,
            stored_len: 0,
        }],
    };
    SnapshotManifest {
        schema_version: SCHEMA_VERSION,
        media_type: SNAPSHOT_MEDIA_TYPE.into(),
        memory: t(table),
        vmstate: blob.clone(),
        disk: t(1 << 20),
        compatibility_key: String::new(),
        image: ManifestDigest::of(b"i"),
        kernel: blob.clone(),
        initramfs: blob,
        vcpus,
        memory_bytes,
        prefetch: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A start killed between QEMU's spawn and its record must still be reaped: the reaper
    /// finds the clone's QEMU processes by the directory in their command line, and only those.
    #[test]
    fn abandoned_start_reaps_the_qemus_that_name_its_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("qemu-system-x86_64");
        // A shell under QEMU's name, blocked reading its stdin (no child processes).
        std::fs::copy("/bin/sh", &fake).unwrap();
        let ours = tmp.path().join("clones/aa");
        let theirs = tmp.path().join("clones/aab");
        std::fs::create_dir_all(&ours).unwrap();
        std::fs::create_dir_all(&theirs).unwrap();
        let spawn = |arg: &Path| {
            std::process::Command::new(&fake)
                .args(["-c", "read x", "qemu"])
                .arg(arg)
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let mut q_ours = spawn(&ours.join("qmp.sock"));
        let mut q_theirs = spawn(&theirs.join("qmp.sock"));
        let mut not_qemu = std::process::Command::new("/bin/sh")
            .args(["-c", "read x", "sh"])
            .arg(ours.join("x"))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Wait until the children have exec'd (their command lines are theirs).
        let deadline = Instant::now() + Duration::from_secs(10);
        while qemus_in(&ours).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(qemus_in(&ours), vec![q_ours.id()]);
        // A starter that is alive keeps its clone; a dead one (a pid past pid_max) does not.
        write_starting(&ours, None).unwrap();
        assert!(!reap_abandoned(&ours));
        let dead = Starting {
            qemu: None,
            starter: ProcessId {
                pid: u32::MAX / 2,
                start_ticks: 0,
            },
        };
        std::fs::write(ours.join(STARTING), serde_json::to_vec(&dead).unwrap()).unwrap();
        assert!(reap_abandoned(&ours));
        assert!(!ours.exists());
        assert!(
            q_ours.wait().unwrap().code().is_none(),
            "killed by a signal"
        );
        assert!(
            q_theirs.try_wait().unwrap().is_none(),
            "another clone's QEMU runs on"
        );
        assert!(
            not_qemu.try_wait().unwrap().is_none(),
            "not a QEMU: left alone"
        );
        let _ = q_theirs.kill();
        let _ = not_qemu.kill();
        let _ = q_theirs.wait();
        let _ = not_qemu.wait();
    }

    /// A starter judged by its pid alone stays "alive" as long as any process has that pid:
    /// the start of a `kiln start` that died and whose pid was reused was never reaped. The
    /// starter is its pid and start time; here the pid is this test's own (alive) with
    /// another start time, as a reused pid looks.
    #[test]
    fn a_recycled_starter_pid_does_not_keep_a_dead_start_alive() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("clones/ab");
        std::fs::create_dir_all(&dir).unwrap();
        let me = std::process::id();
        let ticks = kiln_store::owner::start_ticks(me).unwrap();
        let starting = |start_ticks: u64| {
            serde_json::json!({"qemu": null, "starter": {"pid": me, "start_ticks": start_ticks}})
                .to_string()
        };
        std::fs::write(dir.join(STARTING), starting(ticks)).unwrap();
        assert!(!reap_abandoned(&dir), "its starter runs: kept");
        std::fs::write(dir.join(STARTING), starting(ticks + 1)).unwrap();
        assert!(reap_abandoned(&dir), "a reused pid is not the starter");
        assert!(!dir.exists());
    }

    /// `running` is true only for a QEMU whose command line names the clone's directory: a
    /// recorded pid now held by another clone's QEMU (or by anything whose command line merely
    /// contains "qemu") is not the clone.
    #[test]
    fn running_means_a_qemu_of_this_clone() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("qemu-system-x86_64");
        std::fs::copy("/bin/sh", &fake).unwrap();
        let ours = tmp.path().join("clones/aa");
        let theirs = tmp.path().join("clones/aab");
        let spawn = |program: &Path, arg: &Path| {
            std::process::Command::new(program)
                .args(["-c", "read x", "qemu"])
                .arg(arg)
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let mut q_ours = spawn(&fake, &ours.join("qmp.sock"));
        let mut q_theirs = spawn(&fake, &theirs.join("qmp.sock"));
        let mut sh = spawn(Path::new("/bin/sh"), &ours.join("qemu"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while qemus_in(&ours).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let rec = |pid: u32| CloneRecord {
            id: "aa".into(),
            pid,
            image: "i:t".into(),
            snapshot: String::new(),
            machine_id: String::new(),
            random: String::new(),
            boot_id: String::new(),
            started_unix: 0,
            start_ms: 0,
            phases: StartPhases::default(),
            dir: ours.clone(),
            disk_bytes: 0,
        };
        assert!(rec(q_ours.id()).running());
        assert!(!rec(q_theirs.id()).running(), "another clone's QEMU");
        assert!(!rec(sh.id()).running(), "not a QEMU, though it says qemu");
        assert!(!rec(u32::MAX / 2).running(), "no such process");
        for c in [&mut q_ours, &mut q_theirs, &mut sh] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    #[test]
    fn image_defaults_come_from_the_oci_config() {
        let d = parse_image_defaults(
            br#"{"architecture":"amd64","config":{"User":"runtime","Env":["PATH=/x","A=1"]}}"#,
        )
        .unwrap();
        assert_eq!(d.user, "runtime");
        assert_eq!(d.env, ["PATH=/x", "A=1"]);
        let d = parse_image_defaults(br#"{"config":{"User":""}}"#).unwrap();
        assert_eq!((d.user.as_str(), d.env.len()), ("0", 0));
        let d = parse_image_defaults(br#"{"os":"linux"}"#).unwrap();
        assert_eq!(d.user, "0");
        for bad in [&b"{"[..], br#"{"config":{"Env":"A=1"}}"#, b"\"str\""] {
            assert!(matches!(
                parse_image_defaults(bad),
                Err(CloneError::BadConfig(_))
            ));
        }
    }

    #[test]
    fn disk_below_the_image_is_refused_naming_both_sizes() {
        let image = 64 << 20;
        assert_eq!(clone_disk_bytes(None, image).unwrap(), None);
        assert_eq!(clone_disk_bytes(Some(64), image).unwrap(), None);
        assert_eq!(clone_disk_bytes(Some(256), image).unwrap(), Some(256 << 20));
        let e = clone_disk_bytes(Some(32), image).unwrap_err();
        assert!(matches!(e, CloneError::DiskTooSmall { .. }), "{e}");
        let msg = e.to_string();
        for want in ["32 MiB", "33554432 bytes", "67108864 bytes", "64 MiB"] {
            assert!(msg.contains(want), "{want} not in {msg}");
        }
        // An image of a size that is not whole MiB: one MiB less than its rounded-up size
        // is too small.
        assert!(clone_disk_bytes(Some(64), image + 1).is_err());
        assert_eq!(
            clone_disk_bytes(Some(65), image + 1).unwrap(),
            Some(65 << 20)
        );
        assert_eq!(
            clone_disk_bytes(Some(u64::MAX), image).unwrap(),
            Some(u64::MAX)
        );
    }

    #[test]
    fn hostile_snapshot_shapes_are_refused() {
        assert!(check_snapshot(&test_snapshot(256 << 20, 256 << 20, 1)).is_ok());
        for (m, t, v) in [
            (0, 0, 1),
            ((256 << 20) + 1, (256 << 20) + 1, 1),
            (1 << 50, 1 << 50, 1),
            (256 << 20, 128 << 20, 1),
            (256 << 20, 256 << 20, 0),
            (256 << 20, 256 << 20, 10_000),
        ] {
            assert!(
                check_snapshot(&test_snapshot(m, t, v)).is_err(),
                "{m} {t} {v}"
            );
        }
    }

    #[test]
    fn list_and_stop_refuse_unknown_or_path_like_ids() {
        let dir = tempfile::tempdir().unwrap();
        assert!(list(dir.path()).unwrap().is_empty());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for id in ["", "../etc", "abc/def", "0123456789abcdef"] {
            assert!(matches!(
                rt.block_on(stop(dir.path(), id)),
                Err(CloneError::NoSuchClone(_))
            ));
        }
        // A clone.json that does not parse is an error naming it, not a skip.
        let c = dir.path().join("clones/00");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(c.join("clone.json"), "{").unwrap();
        assert!(matches!(list(dir.path()), Err(CloneError::State { .. })));
    }
}
