//! The host conversation: the virtio-serial port, `start` (start command and ready check),
//! `restore`, `ping`, `connect`, `exec` (in [`crate::exec`]).

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kiln_guest::protocol::{
    self, DecodeError, ErrorMessage, Failed, FailureKind, FrameBuffer, Hello, Message, Ready,
    ReadyCheck, Restore, Restored, Start, StepMounted,
};

use crate::proc::{self, Command, User};
use crate::{BootError, exec, log, sys};

/// How long to wait for the port's device to appear after loading virtio_console.
pub const PORT_WAIT: Duration = Duration::from_secs(10);

/// The environment every command starts with, before the image's and the host's.
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the environment a restore set is written for processes started outside the init
/// (`KEY=value` lines, mode 0600).
const RESTORE_ENV_FILE: &str = "/run/kiln/env";

/// Find the virtio-serial port named [`protocol::PORT_NAME`] under `/sys/class/virtio-ports`
/// and open its character device (made with mknod from its `dev` file when /dev lacks it).
pub fn open_port() -> Result<fs::File, BootError> {
    open_port_named(protocol::PORT_NAME, PORT_WAIT)?.ok_or_else(|| {
        BootError::Port(format!(
            "no virtio-serial port named {} in /sys/class/virtio-ports",
            protocol::PORT_NAME
        ))
    })
}

/// Opens the character device of the virtio-serial port named `port_name`, waiting up to
/// `wait` for it to appear; `None` when it did not.
pub fn open_port_named(port_name: &str, wait: Duration) -> Result<Option<fs::File>, BootError> {
    let start = Instant::now();
    loop {
        if let Some(path) = find_port_named(port_name)? {
            return fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY)
                .open(&path)
                .map(Some)
                .map_err(|e| BootError::Port(format!("opening {}: {e}", path.display())));
        }
        if start.elapsed() > wait {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The character device of the virtio-serial port named `port_name` (made with mknod from
/// its `dev` file when /dev lacks it), `None` when there is no such port (yet).
fn find_port_named(port_name: &str) -> Result<Option<PathBuf>, BootError> {
    let Ok(dir) = fs::read_dir("/sys/class/virtio-ports") else {
        return Ok(None);
    };
    for entry in dir.flatten() {
        let name = fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim() != port_name {
            continue;
        }
        let dev_name = entry.file_name();
        let dev = Path::new("/dev").join(&dev_name);
        if !dev.exists() {
            let numbers = fs::read_to_string(entry.path().join("dev"))
                .map_err(|e| BootError::Port(format!("reading its dev number: {e}")))?;
            let (maj, min) = numbers
                .trim()
                .split_once(':')
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
                .ok_or_else(|| BootError::Port(format!("bad dev number {numbers:?}")))?;
            sys::mknod_char(&dev, 0o600, maj, min)
                .map_err(|e| BootError::Port(format!("mknod {}: {e}", dev.display())))?;
        }
        return Ok(Some(dev));
    }
    Ok(None)
}

/// The sending half, shared by the threads that answer the host.
#[derive(Clone)]
pub struct Sender(Arc<Mutex<fs::File>>);

impl Sender {
    /// Send one message; failures are logged (the host may be gone; it reconnects later).
    pub fn send(&self, msg: &Message) {
        let mut port = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match protocol::write_message(&mut *port, msg) {
            // Liveness traffic and output chunks are not logged: there may be many. Nor is
            // `ready`: its line comes before it (a line after it would still be on its way
            // out of the serial port when the snapshot is saved, and every clone would send
            // it again).
            Ok(())
                if matches!(
                    msg,
                    Message::Pong(_)
                        | Message::Output(_)
                        | Message::DiffData(_)
                        | Message::Ready(_)
                ) => {}
            Ok(()) => log!("sent {}", msg.type_name()),
            Err(e) => log!("sending {}: {e}", msg.type_name()),
        }
    }
}

/// Environment set by the last restore, applied to every process started after it.
pub fn restore_env() -> &'static Mutex<Vec<String>> {
    static E: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(Vec::new()))
}

/// `base` with `overlay` applied: a `KEY=value` in `overlay` replaces the same KEY in place,
/// new keys are appended. Entries without `=` are dropped.
pub fn merge_env(base: &[String], overlay: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(base.len() + overlay.len());
    for v in base.iter().chain(overlay) {
        let Some((key, _)) = v.split_once('=') else {
            continue;
        };
        match out
            .iter_mut()
            .find(|o| o.split_once('=').map(|(k, _)| k) == Some(key))
        {
            Some(slot) => *slot = v.clone(),
            None => out.push(v.clone()),
        }
    }
    out
}

/// Serve the host forever: send hello, answer each message.
pub fn serve(port: fs::File) -> ! {
    let mut reader = match port.try_clone() {
        Ok(r) => r,
        Err(e) => crate::fatal(&format!("duplicating the port: {e}")),
    };
    let tx = Sender(Arc::new(Mutex::new(port)));
    tx.send(&hello());
    // Read now, so that a copy of this VM answers `restore` without reading it.
    if let Err(e) = boot_id() {
        log!("reading the boot id: {e}");
    }
    let mut started = false;
    // Data arrived since the host connection last ended.
    let mut connected = false;
    let mut frames = FrameBuffer::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => {
                // The host side is not connected: virtio-console reads return 0. End what
                // depended on the connection, drop any partial frame and wait for it to come
                // back.
                if connected {
                    connected = false;
                    exec::connection_ended("the host disconnected");
                }
                if frames.pending() > 0 {
                    log!(
                        "host disconnected inside a frame; dropped {} bytes",
                        frames.pending()
                    );
                    frames = FrameBuffer::new();
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log!("reading the port: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        connected = true;
        let stale = frames.push_watching_connect(&buf[..n]);
        if stale > 0 {
            // A disconnect this loop did not see (the host left and came back between two
            // reads), in the middle of a frame.
            log!("dropped {stale} bytes of an older host connection");
            exec::connection_ended("a new host connection");
        }
        loop {
            let body = match frames.next_frame() {
                Ok(Some(b)) => b,
                Ok(None) => break,
                Err(e) => {
                    // Out of step: nothing after a bad header can be trusted. Refuse, drop
                    // what is buffered, resynchronise on the next connection's data.
                    log!("bad frame from the host: {e}");
                    tx.send(&Message::Error(ErrorMessage {
                        message: e.to_string(),
                    }));
                    frames = FrameBuffer::new();
                    break;
                }
            };
            match protocol::decode_body(&body) {
                Ok(msg) => handle(msg, &tx, &mut started),
                Err(e) => {
                    log!("refused a message: {e}");
                    tx.send(&Message::error(&e));
                }
            }
        }
    }
}

fn hello() -> Message {
    Message::Hello(Hello {
        init_version: env!("CARGO_PKG_VERSION").into(),
    })
}

fn handle(msg: Message, tx: &Sender, started: &mut bool) {
    // A restore is logged once answered: a console line costs the clone's wait about 10 ms
    // under TCG (the serial port's emulation, measured on the clone's console log).
    if !matches!(
        msg,
        Message::Ping(_) | Message::Pong(_) | Message::Restore(_)
    ) {
        log!("received {}", msg.type_name());
    }
    match msg {
        Message::Start(start) if !*started => {
            *started = true;
            exec::set_image_defaults(exec::ImageDefaults {
                user: start.user.clone(),
                env: start.env.clone(),
            });
            let tx = tx.clone();
            std::thread::spawn(move || run_start(start, tx));
        }
        Message::Start(_) => tx.send(&Message::Error(ErrorMessage {
            message: "already started".into(),
        })),
        Message::Restore(r) => match restore(&r) {
            Ok((done, mut steps)) => {
                let id = done.machine_id.clone();
                tx.send(&Message::Restored(done));
                steps.mark("answer");
                // After the answer, before the next message is read: every exec comes
                // later and sees the new machine id.
                settle(&id, &mut steps);
                log!("restored: machine-id {id}; {}", steps.report());
            }
            Err(e) => {
                log!("restore failed: {e}");
                tx.send(&Message::Error(ErrorMessage {
                    message: format!("restore failed: {e}"),
                }))
            }
        },
        Message::MountStep(m) => match crate::boot::mount_waiting_step(m.lowers as usize, "ext4") {
            Ok(()) => {
                crate::egress::start(m.egress);
                tx.send(&Message::StepMounted(StepMounted {}))
            }
            Err(e) => {
                log!("mount_step failed: {e}");
                tx.send(&Message::Error(ErrorMessage {
                    message: format!("mount_step failed: {e}"),
                }))
            }
        },
        Message::Ping(p) => tx.send(&Message::Pong(p)),
        Message::Connect(p) => {
            exec::connection_ended("a new host connection");
            tx.send(&Message::Connected(p));
            tx.send(&hello());
        }
        Message::Exec(e) => exec::start(e, tx.clone()),
        Message::Diff(_) => crate::diff::start(tx.clone()),
        Message::Pong(_) | Message::Error(_) => {}
        other => tx.send(&Message::Error(ErrorMessage {
            message: format!("{} is not a host → guest message", other.type_name()),
        })),
    }
}

/// The environment every command starts with, before the image's and the host's: `PATH`,
/// `HOME` (the user's home directory) and `HOSTNAME`.
pub fn base_env(user: &User) -> Vec<String> {
    vec![
        DEFAULT_PATH.to_string(),
        format!("HOME={}", user.home),
        "HOSTNAME=runtime-guest".to_string(),
    ]
}

fn elapsed_ms(t0: Instant) -> u64 {
    t0.elapsed().as_millis().try_into().unwrap_or(u64::MAX)
}

fn run_start(start: Start, tx: Sender) {
    let t0 = Instant::now();
    let fail = |kind: FailureKind, reason: String| {
        log!("failed: {reason}");
        tx.send(&Message::Failed(Failed { kind, reason }));
    };
    let user = match proc::resolve_user(start.user.as_deref()) {
        Ok(u) => u,
        Err(e) => return fail(FailureKind::StartFailed, e.to_string()),
    };
    let env = merge_env(&base_env(&user), &start.env);
    let workdir = start.workdir.clone().unwrap_or_else(|| "/".into());
    let child = if start.argv.is_empty() {
        None
    } else {
        let cmd = Command {
            argv: &start.argv,
            env: &env,
            workdir: &workdir,
            user: &user,
            console: true,
            output: None,
            stderr: None,
            stdin: None,
            cgroup_procs: None,
        };
        match proc::spawn(&cmd) {
            Ok(c) => {
                log!("started {:?} as pid {}", start.argv, c.pid);
                Some(c.pid)
            }
            Err(e) => return fail(FailureKind::StartFailed, e.to_string()),
        }
    };
    let attempts = match &start.ready {
        None => 0,
        Some(check) => match ready_loop(check, child, &env, &workdir, &user, t0) {
            Ok(n) => n,
            Err((kind, reason)) => {
                if let Some(pid) = child
                    && kind != FailureKind::StartExited
                {
                    proc::kill_group(pid);
                }
                return fail(kind, reason);
            }
        },
    };
    let elapsed_ms = elapsed_ms(t0);
    // The snapshot is taken after `ready`: the paths every clone's restore looks up are
    // looked up now, so that their dentries (a missing file's too) are in the memory it
    // keeps and no clone reads their directories from its lazily served disk.
    let _ = ssh_host_keys_missing();
    // What still runs is saved half done and runs again in every clone (crate::idle).
    let settled = crate::idle::wait_idle(crate::idle::MAX_WAIT);
    let settled_ms = settled.waited.as_millis().try_into().unwrap_or(u64::MAX);
    if settled.idle {
        log!("ready after {elapsed_ms} ms ({attempts} checks); idle {settled_ms} ms later");
    } else {
        log!(
            "ready after {elapsed_ms} ms ({attempts} checks); still busy {settled_ms} ms later, \
             saved busy"
        );
    }
    tx.send(&Message::Ready(Ready {
        elapsed_ms,
        attempts,
        settled_ms,
    }));
    if let Some(pid) = child
        && let Some(status) = proc::wait(pid, None)
    {
        log!(
            "start command (pid {pid}) ended: {}",
            proc::describe(status)
        );
    }
}

/// Run the check until it passes (returns the attempts made) or fails `retries + 1` times.
fn ready_loop(
    check: &ReadyCheck,
    child: Option<libc::pid_t>,
    env: &[String],
    workdir: &str,
    user: &User,
    t0: Instant,
) -> Result<u32, (FailureKind, String)> {
    let mut attempts = 0u32;
    loop {
        if let Some(pid) = child
            && let Some(status) = proc::exited(pid)
        {
            return Err((
                FailureKind::StartExited,
                format!(
                    "the start command ended ({}) before it was ready",
                    proc::describe(status)
                ),
            ));
        }
        attempts += 1;
        let env_now = {
            let extra = restore_env().lock().unwrap_or_else(|p| p.into_inner());
            merge_env(env, &extra)
        };
        // The attempt's output goes to a tmpfs file (never blocks the check, unlike a pipe),
        // whose tail explains a failure.
        let log = open_check_log();
        let cmd = Command {
            argv: &check.argv,
            env: &env_now,
            workdir,
            user,
            console: false,
            output: log.as_ref().map(|f| f.as_raw_fd()),
            stderr: None,
            stdin: None,
            cgroup_procs: None,
        };
        let mut last = match proc::spawn(&cmd) {
            Ok(c) => match proc::wait(c.pid, Some(Duration::from_millis(check.timeout_ms))) {
                Some(0) => return Ok(attempts),
                Some(status) => proc::describe(status),
                None => {
                    proc::kill_group(c.pid);
                    let _ = proc::wait(c.pid, None);
                    format!("timed out after {} ms", check.timeout_ms)
                }
            },
            Err(e) => e.to_string(),
        };
        if let Some(tail) = log.and_then(|f| output_tail(f, CHECK_OUTPUT_TAIL)) {
            last = format!("{last}; output: {tail}");
        }
        if attempts > check.retries {
            return Err((
                FailureKind::ReadyTimeout,
                format!(
                    "ready check {:?} failed {attempts} times over {} ms (interval {} ms, timeout {} ms, retries {}); last: {last}",
                    check.argv,
                    elapsed_ms(t0),
                    check.interval_ms,
                    check.timeout_ms,
                    check.retries
                ),
            ));
        }
        // Sleep the interval, waking early if the start command dies.
        match child {
            Some(pid) => {
                if let Some(status) =
                    proc::wait(pid, Some(Duration::from_millis(check.interval_ms)))
                {
                    return Err((
                        FailureKind::StartExited,
                        format!(
                            "the start command ended ({}) before it was ready",
                            proc::describe(status)
                        ),
                    ));
                }
            }
            None => std::thread::sleep(Duration::from_millis(check.interval_ms)),
        }
    }
}

/// Where each ready-check attempt's stdout and stderr go (tmpfs; truncated per attempt).
const CHECK_LOG: &str = "/run/kiln/ready-check.log";

/// Bytes of a failed check's output quoted in `failed.reason`.
const CHECK_OUTPUT_TAIL: u64 = 1024;

fn open_check_log() -> Option<fs::File> {
    let _ = fs::create_dir_all("/run/kiln");
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(0o600)
        .open(CHECK_LOG)
        .map_err(|e| log!("opening {CHECK_LOG}: {e}"))
        .ok()
}

/// The last `max` bytes of `f` (lossy UTF-8, trimmed), if any.
fn output_tail(mut f: fs::File, max: u64) -> Option<String> {
    use std::io::{Seek, SeekFrom};
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(max))).ok()?;
    let mut buf = Vec::new();
    f.take(max).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// Why a restore could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// bad message
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// a step failed
    #[error("{0}: {1}")]
    Step(&'static str, io::Error),
    /// growing the root file system failed
    #[error("growing the root file system: {0}")]
    Grow(#[from] crate::grow::GrowError),
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh machine ID: 128 random bits formatted as systemd does (a v4 UUID, 32 hex digits).
pub fn new_machine_id() -> io::Result<String> {
    let mut id = [0u8; 16];
    sys::getrandom(&mut id)?;
    id[6] = (id[6] & 0x0f) | 0x40;
    id[8] = (id[8] & 0x3f) | 0x80;
    Ok(hex(&id))
}

/// Write `/etc/machine-id` (via a temporary file and rename, not synced: [`write_atomic`]).
pub fn write_machine_id(id: &str) -> io::Result<()> {
    write_atomic(
        Path::new("/etc/machine-id"),
        format!("{id}\n").as_bytes(),
        0o444,
    )
}

/// Writes `bytes` to `path` through `<path>.kiln-tmp` and a rename: a reader sees the old
/// file or the new one, whole. Not synced: what it writes (the machine id, the restore's env
/// in `/run`) lives as long as the VM, whose page cache a snapshot saves with its disk, and
/// a clone's disk does not outlive a crash of its host. Measured (issue 35, busybox clone
/// under TCG, the restore's step times on its console): the machine id's fsync (an ext4
/// journal commit and a flush through virtio-blk and the qcow2 overlay) took 90-105 ms of a
/// 150 ms restore.
fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let tmp = path.with_extension("kiln-tmp");
    // The image is untrusted: never follow a planted symlink at the temporary name; the
    // rename replaces a symlink at `path` itself rather than writing through it.
    let _ = fs::remove_file(&tmp);
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
    }
    fs::rename(&tmp, path)
}

/// OpenSSH's key generator (ssh-keygen(1)); images without it get no host keys.
const SSH_KEYGEN: &str = "/usr/bin/ssh-keygen";

/// The host key types `ssh-keygen -A` makes (ssh-keygen(1), `-A`: rsa, ecdsa, ed25519).
const SSH_HOST_KEY_TYPES: [&str; 3] = ["rsa", "ecdsa", "ed25519"];

/// Whether the image has ssh-keygen and `/etc/ssh` but not every host key. Its lookups are
/// also made before `ready` (the snapshot then keeps their dentries): measured with
/// `ci/bench-clone.sh --store s3` (busybox, issue 35), a clone's restore otherwise read the
/// directory blocks of `/usr` and `/usr/bin` from its lazily served disk, one 163 KiB chunk
/// of its 2.2 MiB of non-zero bytes, before it answered.
fn ssh_host_keys_missing() -> bool {
    Path::new(SSH_KEYGEN).is_file()
        && Path::new("/etc/ssh").is_dir()
        && SSH_HOST_KEY_TYPES
            .iter()
            .any(|t| !Path::new(&format!("/etc/ssh/ssh_host_{t}_key")).exists())
}

/// A clone's first start: host keys are per machine, so the sandbox images hold none, and
/// `ssh-keygen -A` makes the missing ones (it leaves existing keys alone). It runs in the
/// background: RSA key generation can take seconds under TCG, and the restore reply (so the
/// clone's start) does not wait for it; the reaper collects it. Nothing happens in an image
/// without ssh-keygen or `/etc/ssh`.
fn start_ssh_host_keys() {
    if !ssh_host_keys_missing() {
        return;
    }
    match std::process::Command::new(SSH_KEYGEN)
        .arg("-A")
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        Ok(c) => log!("restored: ssh-keygen -A started (pid {})", c.id()),
        Err(e) => log!("restored: cannot run ssh-keygen -A: {e}"),
    }
}

/// Applies a `restore`; returns the answer and how long each step took (for the console
/// log).
fn restore(r: &Restore) -> Result<(Restored, Steps), RestoreError> {
    let mut steps = Steps::new();
    let entropy = r.entropy_bytes()?;
    let urandom = fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| RestoreError::Step("opening /dev/urandom", e))?;
    sys::add_entropy_and_reseed(urandom.as_raw_fd(), &entropy)
        .map_err(|e| RestoreError::Step("RNDADDENTROPY/RNDRESEEDCRNG", e))?;
    steps.mark("reseed");
    sys::set_realtime(r.time_unix_ns).map_err(|e| RestoreError::Step("clock_settime", e))?;
    steps.mark("clock");
    *restore_env().lock().unwrap_or_else(|p| p.into_inner()) = merge_env(&[], &r.env);
    if r.image_user.is_some() || r.image_env.is_some() {
        exec::update_image_defaults(r.image_user.clone(), r.image_env.clone());
    }
    steps.mark("env");
    let machine_id = new_machine_id().map_err(|e| RestoreError::Step("getrandom", e))?;
    let fs_bytes = match r.disk_bytes {
        Some(want) => Some(crate::grow::grow_root(crate::boot::root_device(), want)?),
        None => None,
    };
    steps.mark("grow");
    let mut random = [0u8; 16];
    sys::getrandom(&mut random).map_err(|e| RestoreError::Step("getrandom", e))?;
    let boot_id = boot_id().map_err(|e| RestoreError::Step("reading boot_id", e))?;
    steps.mark("ids");
    Ok((
        Restored {
            machine_id,
            random: hex(&random),
            boot_id,
            fs_bytes,
        },
        steps,
    ))
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`), read once: it is the same in
/// every copy of a snapshot, and [`serve`] reads it before `ready`, so a restore finds it in
/// memory.
fn boot_id() -> io::Result<String> {
    static ID: OnceLock<String> = OnceLock::new();
    if let Some(id) = ID.get() {
        return Ok(id.clone());
    }
    let id = fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string();
    Ok(ID.get_or_init(|| id).clone())
}

/// What a restore does once answered: writes its environment to [`RESTORE_ENV_FILE`] and
/// the new machine id to `/etc/machine-id`, and starts `ssh-keygen -A` when host keys are
/// missing. The host has the id from `restored`, and the init's execs take the environment
/// from memory; the files can follow, because [`serve`] reads the host's next message only
/// after this returns, so every exec starts after them. Measured (issue 35, busybox clone under TCG, the
/// step times on its console log): the write took 90-240 ms of a 150-330 ms restore, most
/// of it the first run of ext4's create and rename paths in a QEMU whose translation cache
/// is empty, not the disk: the same write in a clone that has run them once takes 1-2 ms.
/// A failure is logged: the clone keeps running with the image's machine id file.
fn settle(machine_id: &str, steps: &mut Steps) {
    // A builder VM waiting for its step is still in the initramfs; its step, like a cold
    // step VM, writes nothing of its own into the step's layer.
    let body: String = restore_env()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|v| format!("{v}\n"))
        .collect();
    if let Err(e) = fs::create_dir_all("/run/kiln")
        .and_then(|()| write_atomic(Path::new(RESTORE_ENV_FILE), body.as_bytes(), 0o600))
    {
        log!("restored: writing {RESTORE_ENV_FILE}: {e}");
    }
    steps.mark("env file");
    if crate::boot::waiting_for_step() {
        return;
    }
    if let Err(e) = write_machine_id(machine_id) {
        log!("restored: writing /etc/machine-id: {e}");
    }
    steps.mark("machine-id");
    start_ssh_host_keys();
    steps.mark("ssh");
}

/// How long the steps of one restore took, each from the end of the one before.
struct Steps {
    last: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Steps {
    fn new() -> Self {
        Steps {
            last: Instant::now(),
            done: Vec::new(),
        }
    }

    fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }

    /// `reseed 0.1 ms, clock 0.0 ms, …`.
    fn report(&self) -> String {
        self.done
            .iter()
            .map(|(n, d)| format!("{n} {:.1} ms", d.as_secs_f64() * 1000.0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overlay_replaces_in_place_and_appends() {
        let base = vec!["PATH=/bin".to_string(), "HOME=/".to_string()];
        let over = vec![
            "HOME=/workspace".to_string(),
            "A=1".to_string(),
            "junk".to_string(),
            "A=2".to_string(),
        ];
        assert_eq!(
            merge_env(&base, &over),
            vec!["PATH=/bin", "HOME=/workspace", "A=2"]
        );
    }

    #[test]
    fn atomic_write_never_writes_through_planted_symlinks() {
        let dir = std::env::temp_dir().join(format!("kiln-init-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("passwd");
        fs::write(&victim, "root:x:0:0::/root:/bin/sh\n").unwrap();
        let path = dir.join("machine-id");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        std::os::unix::fs::symlink(&victim, path.with_extension("kiln-tmp")).unwrap();
        write_atomic(&path, b"abc\n", 0o444).unwrap();
        assert_eq!(
            fs::read_to_string(&victim).unwrap(),
            "root:x:0:0::/root:/bin/sh\n"
        );
        assert!(
            !fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(fs::read_to_string(&path).unwrap(), "abc\n");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn machine_ids_are_v4_uuids_in_hex() {
        let a = new_machine_id().unwrap();
        let b = new_machine_id().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_eq!(&a[12..13], "4");
        assert!(matches!(&a[16..17], "8" | "9" | "a" | "b"), "{a}");
    }

    #[test]
    fn output_tail_keeps_the_last_bytes() {
        let path = std::env::temp_dir().join(format!("kiln-tail-{}", std::process::id()));
        fs::write(&path, format!("{}\nthe end\n", "x".repeat(5000))).unwrap();
        let tail = output_tail(fs::File::open(&path).unwrap(), 8).unwrap();
        assert_eq!(tail, "the end");
        fs::write(&path, "").unwrap();
        assert_eq!(output_tail(fs::File::open(&path).unwrap(), 8), None);
        fs::remove_file(&path).unwrap();
    }

    #[test]
    fn hex_is_lowercase_two_digits_a_byte() {
        assert_eq!(hex(&[0, 0xab, 0x0f]), "00ab0f");
    }
}
