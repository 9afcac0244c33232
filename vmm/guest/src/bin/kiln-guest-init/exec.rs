//! `exec`: commands the host runs in the guest, several at once, each streaming its stdout
//! and stderr back as sequenced `output` chunks and ending with one `exit` frame.
//!
//! Per exec (one thread, plus one writing its stdin when it has any):
//! 1. Refuse an id that is running, or a 65th exec at once ([`MAX_RUNNING`]).
//! 2. Resolve the user (the exec's, else the image's: the last `restore`'s `image_user`, the
//!    OCI config's, else the start command's user from `start`; root without either) in the
//!    image's /etc/passwd and /etc/group.
//! 3. Environment, later entries replacing earlier ones of the same KEY: `PATH` (the init's
//!    default), `HOME` (the user's home), `HOSTNAME`; the image's (`restore`'s `image_env`,
//!    else the start command's `env`); the clone's (`kiln start --env`, from the last
//!    `restore`); the exec's own `env`.
//! 4. Working directory: the exec's, else the user's home directory from /etc/passwd (`/`
//!    when that does not exist, as login(1) does); with `make_workdir` its missing
//!    directories are created first, owned by the user.
//! 5. A cgroup v2 of its own, `/sys/fs/cgroup/kiln-exec-<id>` (cgroup2 is mounted there at
//!    the first exec, the memory and pids controllers enabled for the root's children),
//!    with the exec's `memory_max` as `memory.max` and its `pids_max` as `pids.max`; the
//!    child joins it before exec. After the exit its `memory.events` `oom_kill` counter says
//!    whether the kernel's OOM killer ended one of its processes: that is the `oom` flag.
//!    While it runs, a `max` count in its `pids.events` (a fork refused at `pids.max`) kills
//!    the cgroup and sets `pids_limit`; and a cgroup that has reached its `memory.max` and
//!    whose `memory.pressure` `full avg10` is at least [`STALL_PERCENT`] is killed and gets
//!    the `oom` flag: a command at its limit whose own file pages (its program's text) the
//!    kernel keeps evicting and rereading counts as progress, so the kernel's OOM killer may
//!    not end it for minutes (measured under TCG: a 64 MiB `tail` hog ran into a 60 s
//!    timeout). Why a cgroup and not `RLIMIT_NPROC`: that rlimit
//!    counts a uid's processes in the whole guest and does not hold for root
//!    (`CAP_SYS_RESOURCE`), which build steps usually run as; `pids.max` holds for everyone
//!    in the cgroup, and `pids.events` says that it was hit. Without cgroup2 (a kernel
//!    without it) the exec runs without limits, and `oom` and `pids_limit` are always false.
//!    When it has ended, `disk_full` says whether `/` has less than
//!    [`kiln_guest::protocol::DISK_FULL_BYTES`] free (`statvfs`).
//! 6. stdout and stderr are two pipes read with poll(2) in one thread, so `seq` follows the
//!    order the guest read them. Once the command's process has exited, what its pipes still
//!    hold is sent and the exec ends, even if a background process keeps them open.
//!
//! A connection's end ([`connection_ended`]) kills the cgroup (`cgroup.kill`, else the
//! process group) of every running exec not started with `detach`; a detached one runs on,
//! its output read and dropped.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use kiln_guest::protocol::{
    DISK_FILE_NAME, DISK_FULL_BYTES, Exec, ExecExit, ExecFailure, ExecFailureKind, ExecFile,
    ExecMount, ExecMountKind, MAX_CHUNK_LEN, Message, Output, PIPES_DIR, Stream,
};

use crate::proc::{self, Command, SpawnError};
use crate::serve::{Sender, base_env, merge_env, restore_env};
use crate::{log, sys};

/// Most execs running at once; one more is refused.
pub const MAX_RUNNING: usize = 64;

/// The share of the last 10 s (`memory.pressure`'s `full avg10`, percent) during which every
/// task of an exec at its `memory.max` stalled on memory, from which the guest stops it as
/// out of memory (50 %: systemd-oomd's default limit is 60 % over 30 s; this is over 10 s,
/// and only for a cgroup that has reached its limit).
pub const STALL_PERCENT: f64 = 50.0;

/// Where cgroup2 is mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// What the image gives every exec (from `start`: the image's user and environment).
#[derive(Debug, Default, Clone)]
pub struct ImageDefaults {
    /// The image's user; `None`: root.
    pub user: Option<String>,
    /// The image's environment, `KEY=value`.
    pub env: Vec<String>,
}

fn image_defaults() -> &'static Mutex<ImageDefaults> {
    static D: OnceLock<Mutex<ImageDefaults>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(ImageDefaults::default()))
}

/// Record what `start` said the image's user and environment are.
pub fn set_image_defaults(d: ImageDefaults) {
    *image_defaults().lock().unwrap_or_else(|p| p.into_inner()) = d;
}

/// Replace what a `restore` gives of the image's user and environment (its OCI config's).
pub fn update_image_defaults(user: Option<String>, env: Option<Vec<String>>) {
    let mut d = image_defaults().lock().unwrap_or_else(|p| p.into_inner());
    if user.is_some() {
        d.user = user;
    }
    if let Some(env) = env {
        d.env = env;
    }
}

/// A running exec.
struct Running {
    /// Its process (and process group) id, once started.
    pid: Option<libc::pid_t>,
    /// Its cgroup, if it has one.
    cgroup: Option<PathBuf>,
    /// Survives the end of its connection.
    detach: bool,
}

fn running() -> &'static Mutex<HashMap<u64, Running>> {
    static R: OnceLock<Mutex<HashMap<u64, Running>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The host connection's number: bumped when one ends. An exec sends frames only while the
/// connection it came on lasts.
static CONNECTION: AtomicU64 = AtomicU64::new(0);

/// The host connection ended (`why`: disconnected, or a new one said `connect`): kill every
/// running exec that is not detached.
pub fn connection_ended(why: &str) {
    CONNECTION.fetch_add(1, Ordering::SeqCst);
    let r = running().lock().unwrap_or_else(|p| p.into_inner());
    for (id, ex) in r.iter().filter(|(_, e)| !e.detach) {
        if let Some(pid) = ex.pid {
            log!("exec {id:016x}: {why}; killing it");
            kill(pid, ex.cgroup.as_deref());
        }
    }
}

fn kill(pid: libc::pid_t, cgroup: Option<&Path>) {
    if let Some(cg) = cgroup
        && fs::write(cg.join("cgroup.kill"), "1").is_ok()
    {
        return;
    }
    proc::kill_group(pid);
}

/// Start `e` on its own thread; its frames go to `tx`.
pub fn start(e: Exec, tx: Sender) {
    let conn = CONNECTION.load(Ordering::SeqCst);
    {
        let mut r = running().lock().unwrap_or_else(|p| p.into_inner());
        let refuse = if r.contains_key(&e.id) {
            Some(format!("exec {:016x} is already running", e.id))
        } else if r.len() >= MAX_RUNNING {
            Some(format!(
                "{MAX_RUNNING} execs are running; wait for one to end"
            ))
        } else {
            None
        };
        if let Some(message) = refuse {
            drop(r);
            return tx.send(&failure(e.id, ExecFailureKind::Refused, message));
        }
        r.insert(
            e.id,
            Running {
                pid: None,
                cgroup: None,
                detach: e.detach,
            },
        );
    }
    std::thread::spawn(move || {
        let id = e.id;
        let exit = run(e, &tx, conn);
        let cgroup = running()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
            .and_then(|r| r.cgroup);
        if let Some(cg) = cgroup {
            // Fails (EBUSY) while a background process of the command lives on in it.
            let _ = fs::remove_dir(cg);
        }
        if CONNECTION.load(Ordering::SeqCst) == conn {
            tx.send(&exit);
        } else {
            log!("exec {id:016x} ended after its connection: {exit:?}");
        }
    });
}

fn failure(id: u64, kind: ExecFailureKind, message: String) -> Message {
    Message::Exit(ExecExit {
        id,
        seq: 0,
        failure: Some(ExecFailure { kind, message }),
        ..ExecExit::default()
    })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid out array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two new descriptors this function now owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Mount cgroup2 at [`CGROUP_ROOT`] and enable the memory and pids controllers for its
/// children, once; whether the memory controller (the first) is there.
fn cgroups_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let root = Path::new(CGROUP_ROOT);
        if !root.join("cgroup.controllers").exists()
            && let Err(e) = sys::mount(
                "cgroup2",
                root,
                "cgroup2",
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                "",
            )
        {
            log!("mounting cgroup2 at {CGROUP_ROOT}: {e}; execs get no OOM flag");
            return false;
        }
        if let Err(e) = fs::write(root.join("cgroup.subtree_control"), "+memory") {
            log!("enabling the memory controller: {e}; execs get no OOM flag");
            return false;
        }
        if let Err(e) = fs::write(root.join("cgroup.subtree_control"), "+pids") {
            log!("enabling the pids controller: {e}; execs get no pids limit");
        }
        true
    })
}

/// The exec's cgroup directory, with `memory_max` (bytes) as its `memory.max` and
/// `pids_max` as its `pids.max` when given, and its `cgroup.procs` open for writing.
fn make_cgroup(
    id: u64,
    memory_max: Option<u64>,
    pids_max: Option<u64>,
) -> Option<(PathBuf, fs::File)> {
    if !cgroups_ready() {
        return None;
    }
    let dir = Path::new(CGROUP_ROOT).join(format!("kiln-exec-{id:016x}"));
    // A leftover of an earlier exec with this id (its background processes ended since).
    let _ = fs::remove_dir(&dir);
    let made = fs::create_dir(&dir).and_then(|()| {
        if let Some(m) = memory_max {
            fs::write(dir.join("memory.max"), m.to_string())?;
        }
        if let Some(p) = pids_max {
            fs::write(dir.join("pids.max"), p.to_string())?;
        }
        fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
    });
    match made {
        Ok(f) => Some((dir, f)),
        Err(e) => {
            log!("exec {id:016x}: cgroup {}: {e}", dir.display());
            None
        }
    }
}

/// The `oom_kill` counter of `cgroup`'s `memory.events` (0 when unreadable).
fn oom_kills(cgroup: &Path) -> u64 {
    let events = fs::read_to_string(cgroup.join("memory.events")).unwrap_or_default();
    parse_event(&events, "oom_kill")
}

/// The `max` counter of `cgroup`'s `pids.events`: forks refused at its `pids.max` (0 when
/// unreadable).
fn pids_hits(cgroup: &Path) -> u64 {
    let events = fs::read_to_string(cgroup.join("pids.events")).unwrap_or_default();
    parse_event(&events, "max")
}

/// Whether `cgroup` has reached its `memory.max` (`memory.events` `max`) and stalls on
/// memory ([`STALL_PERCENT`] of `memory.pressure`'s `full avg10`).
fn memory_stalled(cgroup: &Path) -> bool {
    let events = fs::read_to_string(cgroup.join("memory.events")).unwrap_or_default();
    if parse_event(&events, "max") == 0 {
        return false;
    }
    let pressure = fs::read_to_string(cgroup.join("memory.pressure")).unwrap_or_default();
    parse_full_avg10(&pressure).is_some_and(|p| p >= STALL_PERCENT)
}

/// The `avg10` of the `full` line of a PSI file (`full avg10=12.34 avg60=... total=...`).
fn parse_full_avg10(pressure: &str) -> Option<f64> {
    pressure
        .lines()
        .find_map(|l| l.strip_prefix("full "))?
        .split_whitespace()
        .find_map(|f| f.strip_prefix("avg10="))?
        .parse()
        .ok()
}

/// The counter `key` of a cgroup v2 events file (`key value` lines; 0 when missing).
fn parse_event(events: &str, key: &str) -> u64 {
    events
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether the file system of `/` has less than [`DISK_FULL_BYTES`] free for unprivileged
/// writers (`statvfs`'s `f_bavail` × `f_frsize`; false when it cannot be read).
fn root_disk_full() -> bool {
    // SAFETY: an all-zero statvfs is a valid out value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out pointer.
    if unsafe { libc::statvfs(c"/".as_ptr(), &mut st) } != 0 {
        return false;
    }
    (st.f_bavail as u64).saturating_mul(st.f_frsize as u64) < DISK_FULL_BYTES
}

fn spawn_failure(id: u64, e: &SpawnError) -> Message {
    let kind = match e {
        SpawnError::NotFound(_) | SpawnError::Missing(_) => ExecFailureKind::NotFound,
        _ => ExecFailureKind::CannotRun,
    };
    failure(id, kind, e.to_string())
}

/// Creates the missing directories of `workdir` (absolute), each owned by `user` (mode 0755
/// less the umask), as the namespace executor makes a build step's `WORKDIR`.
fn make_workdir(workdir: &str, user: &proc::User) -> Result<(), String> {
    let mut cur = PathBuf::from("/");
    for comp in Path::new(workdir).components().skip(1) {
        cur.push(comp);
        if fs::metadata(&cur).is_err() {
            fs::create_dir(&cur).map_err(|e| format!("creating WORKDIR {}: {e}", cur.display()))?;
            std::os::unix::fs::chown(&cur, Some(user.uid), Some(user.gid))
                .map_err(|e| format!("chown {}: {e}", cur.display()))?;
        }
    }
    Ok(())
}

/// Writes the exec's files (a build step's heredocs) under [`PIPES_DIR`], owned by root with
/// their mode. The paths were checked when the frame was decoded ([`ExecFile::path_ok`]);
/// the directory is made once, mode 0755, and a file is created anew (`O_EXCL` after
/// removing what is there, `O_NOFOLLOW`), so nothing a command left there is written through.
fn write_files(files: &[ExecFile]) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    if files.is_empty() {
        return Ok(());
    }
    let dir = Path::new(PIPES_DIR);
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{PIPES_DIR} is not a directory")),
        Err(_) => fs::DirBuilder::new()
            .mode(0o755)
            .create(dir)
            .map_err(|e| format!("creating {PIPES_DIR}: {e}"))?,
    }
    for f in files {
        if !ExecFile::path_ok(&f.path) {
            return Err(format!(
                "{:?} is not a plain name under {PIPES_DIR}",
                f.path
            ));
        }
        let _ = fs::remove_file(&f.path);
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&f.path)
            .map_err(|e| format!("writing {}: {e}", f.path))?;
        out.write_all(&f.data)
            .map_err(|e| format!("writing {}: {e}", f.path))?;
        out.set_permissions(fs::Permissions::from_mode(f.mode & 0o7777))
            .map_err(|e| format!("chmod {}: {e}", f.path))?;
    }
    Ok(())
}

/// An exec's mounts, unmounted (lazily, newest first) when dropped, with its secrets' tmpfs.
struct Mounted {
    points: Vec<PathBuf>,
    /// Staging mounts under `/dev` (a read-write or single-file bind's tmpfs, read-only disk
    /// and a file's overlay).
    stages: Vec<PathBuf>,
    secrets: Option<PathBuf>,
    /// Cache disks' mount points (also in `points`): flushed (`syncfs`) first, so that what
    /// the exec wrote is on the disk before its `exit` is sent and the host stops the VM.
    caches: Vec<PathBuf>,
}

impl Drop for Mounted {
    fn drop(&mut self) {
        for c in &self.caches {
            if let Ok(d) = fs::File::open(c) {
                // SAFETY: d is an open descriptor for the duration of the call.
                if unsafe { libc::syncfs(d.as_raw_fd()) } != 0 {
                    log!(
                        "syncfs of the cache on {}: {}",
                        c.display(),
                        io::Error::last_os_error()
                    );
                }
            }
        }
        let staged = self.stages.iter().rev().chain(self.secrets.iter());
        for p in self.points.iter().rev().chain(staged) {
            if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
                // SAFETY: c is a NUL-terminated path that outlives the call.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
        for d in self.stages.iter().rev().chain(self.secrets.iter()) {
            let _ = fs::remove_dir(d);
        }
    }
}

/// Creates the mount point `/rel` (directories mode 0755 as needed, then a directory, or an
/// empty file for `file`) without following a symlink anywhere on the way.
fn mount_point(rel: &str, file: bool) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let mut cur = PathBuf::from("/");
    let comps: Vec<&str> = rel.split('/').collect();
    for (i, c) in comps.iter().enumerate() {
        cur.push(c);
        let last = i + 1 == comps.len();
        let want_file = last && file;
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(format!(
                    "mount point {}: a symlink on the way",
                    cur.display()
                ));
            }
            Ok(m) if want_file && !m.is_file() => {
                return Err(format!("mount point {} is not a file", cur.display()));
            }
            Ok(m) if !want_file && !m.is_dir() => {
                return Err(format!("mount point {} is not a directory", cur.display()));
            }
            Ok(_) => {}
            Err(_) if want_file => {
                fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(0o644)
                    .open(&cur)
                    .map_err(|e| format!("creating mount point {}: {e}", cur.display()))?;
            }
            Err(_) => fs::DirBuilder::new()
                .mode(0o755)
                .create(&cur)
                .map_err(|e| format!("creating mount point {}: {e}", cur.display()))?,
        }
    }
    Ok(cur)
}

/// Mounts an exec's [`ExecMount`]s in order: a tmpfs (`mode=1777`, its size, `nosuid,nodev`);
/// a disk's ext4 (a bind mount's tree) read-only, or under an overlay with a tmpfs upper, or
/// for a bind of one file, that file of it bound onto a file mount point; or
/// a cache disk's ext4 read-write (or read-only) on its mount point; or
/// a secret: a file on a private tmpfs under `/dev` (outside a build step's layer), bound
/// read-only onto its file mount point.
fn mount_all(id: u64, mounts: &[ExecMount]) -> Result<Mounted, String> {
    use std::os::unix::fs::PermissionsExt;
    let mut done = Mounted {
        points: Vec::new(),
        stages: Vec::new(),
        secrets: None,
        caches: Vec::new(),
    };
    let nsd = libc::MS_NOSUID | libc::MS_NODEV;
    for (i, m) in mounts.iter().enumerate() {
        if !ExecMount::rel_ok(&m.rel) {
            return Err(format!(
                "mount point {:?} is not a plain relative path",
                m.rel
            ));
        }
        match &m.kind {
            ExecMountKind::Tmpfs { size_bytes } => {
                let at = mount_point(&m.rel, false)?;
                let data = match size_bytes {
                    Some(n) => format!("mode=1777,size={n}"),
                    None => "mode=1777".to_string(),
                };
                sys::mount("tmpfs", &at, "tmpfs", nsd, &data)
                    .map_err(|e| format!("mounting a tmpfs on {}: {e}", at.display()))?;
                done.points.push(at);
            }
            ExecMountKind::Disk {
                serial,
                readwrite,
                file,
            } => {
                let dev = crate::boot::disks_by_serial()
                    .remove(serial)
                    .ok_or_else(|| format!("no disk with the serial {serial}"))?;
                let at = mount_point(&m.rel, *file)?;
                if !readwrite && !file {
                    sys::mount(&dev, &at, "ext4", nsd | libc::MS_RDONLY, "")
                        .map_err(|e| format!("mounting {dev} on {}: {e}", at.display()))?;
                    done.points.push(at);
                    continue;
                }
                // Staged under /dev (outside a build step's layer): the disk read-only, and
                // for `readwrite` an overlay of it with a tmpfs upper (writes discarded).
                let stage = PathBuf::from(format!("/dev/kiln-bind-{id:016x}-{i}"));
                fs::create_dir(&stage).map_err(|e| format!("creating {}: {e}", stage.display()))?;
                sys::mount("tmpfs", &stage, "tmpfs", nsd, "mode=0700")
                    .map_err(|e| format!("mounting a tmpfs on {}: {e}", stage.display()))?;
                done.stages.push(stage.clone());
                for d in ["lower", "upper", "work", "merged"] {
                    fs::create_dir(stage.join(d))
                        .map_err(|e| format!("creating {}: {e}", stage.join(d).display()))?;
                }
                let lower = stage.join("lower");
                sys::mount(&dev, &lower, "ext4", nsd | libc::MS_RDONLY, "")
                    .map_err(|e| format!("mounting {dev} on {}: {e}", lower.display()))?;
                done.stages.push(lower.clone());
                // The tree the bind shows: the disk, or the overlay over it.
                let tree = if *readwrite {
                    let data = format!(
                        "lowerdir={},upperdir={},workdir={}",
                        lower.display(),
                        stage.join("upper").display(),
                        stage.join("work").display()
                    );
                    // A tree's overlay goes on the mount point itself; a file's on the stage.
                    let on = if *file {
                        stage.join("merged")
                    } else {
                        at.clone()
                    };
                    sys::mount("overlay", &on, "overlay", nsd, &data)
                        .map_err(|e| format!("mounting the rw bind on {}: {e}", on.display()))?;
                    if !file {
                        done.points.push(at);
                        continue;
                    }
                    done.stages.push(on.clone());
                    on
                } else {
                    lower
                };
                // One file: bound from the tree onto the file mount point, nosuid and
                // nodev, read-only unless `readwrite`.
                let src = tree.join(DISK_FILE_NAME);
                match fs::symlink_metadata(&src) {
                    Ok(md) if md.is_file() => {}
                    _ => return Err(format!("disk {serial} holds no file {DISK_FILE_NAME}")),
                }
                sys::mount(&src.display().to_string(), &at, "", libc::MS_BIND, "")
                    .map_err(|e| format!("binding {} on {}: {e}", src.display(), at.display()))?;
                done.points.push(at.clone());
                let ro = if *readwrite { 0 } else { libc::MS_RDONLY };
                sys::mount("", &at, "", libc::MS_REMOUNT | libc::MS_BIND | ro | nsd, "")
                    .map_err(|e| format!("remounting the bind on {}: {e}", at.display()))?;
            }
            ExecMountKind::Cache { serial, readonly } => {
                let dev = crate::boot::disks_by_serial()
                    .remove(serial)
                    .ok_or_else(|| format!("no disk with the serial {serial}"))?;
                let at = mount_point(&m.rel, false)?;
                let ro = if *readonly { libc::MS_RDONLY } else { 0 };
                sys::mount(&dev, &at, "ext4", nsd | ro, "")
                    .map_err(|e| format!("mounting the cache {dev} on {}: {e}", at.display()))?;
                done.points.push(at.clone());
                done.caches.push(at);
            }
            ExecMountKind::Secret {
                data,
                mode,
                uid,
                gid,
            } => {
                let dir = match &done.secrets {
                    Some(d) => d.clone(),
                    None => {
                        let d = PathBuf::from(format!("/dev/kiln-secrets-{id:016x}"));
                        fs::create_dir(&d).map_err(|e| format!("creating {}: {e}", d.display()))?;
                        sys::mount(
                            "tmpfs",
                            &d,
                            "tmpfs",
                            nsd | libc::MS_NOEXEC,
                            "mode=0711,size=4m",
                        )
                        .map_err(|e| format!("mounting the secrets tmpfs: {e}"))?;
                        done.secrets = Some(d.clone());
                        d
                    }
                };
                let f = dir.join(format!("s{i}"));
                fs::write(&f, data).map_err(|e| format!("writing a secret: {e}"))?;
                std::os::unix::fs::chown(&f, Some(*uid), Some(*gid))
                    .map_err(|e| format!("chown of a secret: {e}"))?;
                fs::set_permissions(&f, fs::Permissions::from_mode(*mode & 0o7777))
                    .map_err(|e| format!("chmod of a secret: {e}"))?;
                let at = mount_point(&m.rel, true)?;
                sys::mount(&f.display().to_string(), &at, "", libc::MS_BIND, "")
                    .map_err(|e| format!("binding a secret on {}: {e}", at.display()))?;
                done.points.push(at.clone());
                sys::mount(
                    "",
                    &at,
                    "",
                    libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | nsd,
                    "",
                )
                .map_err(|e| format!("making the secret on {} read-only: {e}", at.display()))?;
            }
        }
    }
    Ok(done)
}

/// Run one exec to its end; returns its `exit` frame.
fn run(e: Exec, tx: &Sender, conn: u64) -> Message {
    let defaults = image_defaults()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let spec = e.user.as_deref().or(defaults.user.as_deref());
    let user = match proc::resolve_user(spec) {
        Ok(u) => u,
        Err(err) => return failure(e.id, ExecFailureKind::CannotRun, err.to_string()),
    };
    let env = {
        let clone_env = restore_env().lock().unwrap_or_else(|p| p.into_inner());
        let env = merge_env(&base_env(&user), &defaults.env);
        let env = merge_env(&env, &clone_env);
        merge_env(&env, &e.env)
    };
    // As login(1) does, a home directory that does not exist (`nobody`'s `/nonexistent`)
    // gives `/`; a workdir asked for that does not exist is the exec's failure (126).
    let workdir = e.workdir.clone().unwrap_or_else(|| {
        if Path::new(&user.home).is_dir() {
            user.home.clone()
        } else {
            "/".into()
        }
    });
    if e.make_workdir
        && let Err(err) = make_workdir(&workdir, &user)
    {
        return failure(e.id, ExecFailureKind::CannotRun, err);
    }
    if let Err(err) = write_files(&e.files) {
        return failure(e.id, ExecFailureKind::CannotRun, err);
    }
    // Unmounted when this function returns, whichever way: after the command has exited.
    let _mounted = match mount_all(e.id, &e.mounts) {
        Ok(m) => m,
        Err(err) => return failure(e.id, ExecFailureKind::CannotRun, err),
    };
    let io = (|| {
        Ok::<_, io::Error>((
            pipe()?,
            pipe()?,
            (!e.stdin.is_empty()).then(pipe).transpose()?,
        ))
    })();
    let ((out_r, out_w), (err_r, err_w), stdin) = match io {
        Ok(p) => p,
        Err(err) => return failure(e.id, ExecFailureKind::CannotRun, format!("pipe: {err}")),
    };
    let cgroup = make_cgroup(e.id, e.memory_max, e.pids_max);
    if cgroup.is_none() && (e.memory_max.is_some() || e.pids_max.is_some()) {
        log!("exec {:016x}: no cgroup, so no memory or pids limit", e.id);
    }
    let cmd = Command {
        argv: &e.argv,
        env: &env,
        workdir: &workdir,
        user: &user,
        console: false,
        output: Some(out_w.as_raw_fd()),
        stderr: Some(err_w.as_raw_fd()),
        stdin: stdin.as_ref().map(|(r, _)| r.as_raw_fd()),
        cgroup_procs: cgroup.as_ref().map(|(_, f)| f.as_raw_fd()),
    };
    let spawned = proc::spawn(&cmd);
    // Our copies of the child's ends: the pipes reach EOF when the command's side closes.
    drop((out_w, err_w));
    let cgroup = cgroup.map(|(dir, _)| dir);
    let (stdin_r, stdin_w) = stdin.unzip();
    drop(stdin_r);
    let child = match spawned {
        Ok(c) => c,
        Err(err) => {
            if let Some(cg) = &cgroup {
                let _ = fs::remove_dir(cg);
            }
            return spawn_failure(e.id, &err);
        }
    };
    {
        let mut r = running().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = r.get_mut(&e.id) {
            slot.pid = Some(child.pid);
            slot.cgroup = cgroup.clone();
        }
    }
    // The connection may have ended while the command was being started.
    if !e.detach && CONNECTION.load(Ordering::SeqCst) != conn {
        kill(child.pid, cgroup.as_deref());
    }
    log!(
        "exec {:016x}: {:?} as uid {} pid {}",
        e.id,
        e.argv,
        user.uid,
        child.pid
    );
    if let Some(w) = stdin_w {
        let bytes = e.stdin;
        std::thread::spawn(move || {
            let mut f = fs::File::from(w);
            // EPIPE when the command does not read it all: not an error of the exec.
            let _ = f.write_all(&bytes);
        });
    }
    let watch = Watch {
        pid: child.pid,
        cgroup: cgroup.as_deref(),
        pids: e.pids_max.is_some(),
        memory: e.memory_max.is_some(),
        pids_hit: false,
        stalled: false,
    };
    let pids_cgroup = watch.cgroup.filter(|_| watch.pids);
    let (seq, stopped, stalled) = pump(e.id, watch, out_r, err_r, tx, conn);
    // Also a fork refused just before the command's process exited.
    let pids_limit = stopped || pids_cgroup.is_some_and(|cg| pids_hits(cg) > 0);
    let status = proc::wait(child.pid, None).unwrap_or(0);
    // Reaped: its pid may be reused from now on, so a connection's end must not signal it.
    if let Some(slot) = running()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_mut(&e.id)
    {
        slot.pid = None;
    }
    let oom = stalled || cgroup.as_deref().is_some_and(|cg| oom_kills(cg) > 0);
    let disk_full = root_disk_full();
    if pids_limit || oom || disk_full {
        log!(
            "exec {:016x}: pids limit {pids_limit}, oom {oom}, disk full {disk_full}",
            e.id
        );
    }
    let (code, signal) = if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (Some(libc::WEXITSTATUS(status)), None)
    };
    Message::Exit(ExecExit {
        id: e.id,
        seq,
        code,
        signal,
        oom,
        pids_limit,
        disk_full,
        failure: None,
    })
}

/// What [`pump`] watches besides the pipes: the command's process, and its cgroup's pids
/// and memory limits when it has them.
struct Watch<'a> {
    pid: libc::pid_t,
    /// The cgroup whose `pids.events`, `memory.events` and `memory.pressure` are read about
    /// every 100 ms while the process runs.
    cgroup: Option<&'a Path>,
    /// It has a pids limit.
    pids: bool,
    /// It has a memory limit.
    memory: bool,
    /// Its pids limit refused a fork, and the cgroup was killed.
    pids_hit: bool,
    /// It stalled at its memory limit ([`memory_stalled`]), and the cgroup was killed.
    stalled: bool,
}

impl Watch<'_> {
    /// Kills the exec's cgroup once its pids limit has refused a fork, or once it stalls at
    /// its memory limit.
    fn check(&mut self) {
        let Some(cg) = self.cgroup else {
            return;
        };
        if self.pids_hit || self.stalled {
            return;
        }
        if self.pids && pids_hits(cg) > 0 {
            log!(
                "pid {}: the pids limit refused a fork; stopping it",
                self.pid
            );
            kill(self.pid, Some(cg));
            self.pids_hit = true;
        } else if self.memory && memory_stalled(cg) {
            log!("pid {}: stalled at its memory limit; stopping it", self.pid);
            kill(self.pid, Some(cg));
            self.stalled = true;
        }
    }
}

/// Read both pipes until both end, or until the command's process has exited and the pipes
/// hold nothing more; send each read as an `output` chunk while the connection lasts. Every
/// 100 ms or so, `watch` checks the limits ([`Watch::check`]). Returns the number of chunks
/// sent, whether the pids limit stopped the command, and whether it was stopped stalled at its
/// memory limit.
fn pump(
    id: u64,
    mut watch: Watch<'_>,
    out: OwnedFd,
    err: OwnedFd,
    tx: &Sender,
    conn: u64,
) -> (u64, bool, bool) {
    let pid = watch.pid;
    let mut next_check = std::time::Instant::now();
    let mut fds = [(Some(out), Stream::Stdout), (Some(err), Stream::Stderr)];
    let mut buf = vec![0u8; MAX_CHUNK_LEN];
    let mut seq = 0u64;
    // Reads taken after the process exited: a background process that keeps writing must not
    // keep the exec from ending.
    let mut after_exit = 0;
    loop {
        let exited = proc::exited(pid).is_some();
        if !exited && std::time::Instant::now() >= next_check {
            watch.check();
            next_check = std::time::Instant::now() + std::time::Duration::from_millis(100);
        }
        if exited {
            after_exit += 1;
            if after_exit > 64 {
                return (seq, watch.pids_hit, watch.stalled);
            }
        }
        let mut polls: Vec<libc::pollfd> = fds
            .iter()
            .filter_map(|(fd, _)| fd.as_ref())
            .map(|fd| libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if polls.is_empty() {
            return (seq, watch.pids_hit, watch.stalled);
        }
        // Wake every 100 ms to notice the process's exit (pipes a background process keeps
        // open never reach EOF); once it has exited, only take what is there now.
        let timeout = if exited { 0 } else { 100 };
        // SAFETY: polls is a valid array of pollfd of the given length.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            log!("exec {id:016x}: poll: {err}");
            return (seq, watch.pids_hit, watch.stalled);
        }
        if n == 0 {
            if exited {
                return (seq, watch.pids_hit, watch.stalled);
            }
            continue;
        }
        for p in polls.iter().filter(|p| p.revents != 0) {
            let Some(slot) = fds
                .iter_mut()
                .find(|(fd, _)| fd.as_ref().is_some_and(|f| f.as_raw_fd() == p.fd))
            else {
                continue;
            };
            // SAFETY: reading into buf, which is valid for buf.len() bytes, from an open fd.
            let got = unsafe { libc::read(p.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if got < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
            }
            if got <= 0 {
                slot.0 = None;
                continue;
            }
            if CONNECTION.load(Ordering::SeqCst) != conn {
                continue; // nobody to send it to; keep draining so the command never blocks
            }
            tx.send(&Message::Output(Output {
                id,
                seq,
                stream: slot.1,
                data: buf[..got as usize].to_vec(),
            }));
            seq += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_events_files() {
        let events = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_event(events, "oom_kill"), 2);
        assert_eq!(parse_event(events, "max"), 3);
        assert_eq!(parse_event("oom 1\noom_group_kill 0\n", "oom_kill"), 0);
        assert_eq!(parse_event("", "oom_kill"), 0);
        // pids.events
        assert_eq!(parse_event("max 7\n", "max"), 7);
        let psi = "some avg10=91.50 avg60=20.00 avg300=4.00 total=123\n\
                   full avg10=88.25 avg60=19.00 avg300=3.00 total=120\n";
        assert_eq!(parse_full_avg10(psi), Some(88.25));
        assert_eq!(parse_full_avg10("some avg10=1.00 total=1\n"), None);
    }
}
