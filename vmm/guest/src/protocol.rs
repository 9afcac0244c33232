//! The host ⇄ guest protocol of a kiln microVM (version 1).
//!
//! Transport: the virtio-serial port named [`PORT_NAME`] (QEMU: `-device
//! virtio-serial-device -chardev socket,id=guest,path=SOCK,server=on,wait=off -device
//! virtserialport,chardev=guest,name=org.kiln.guest.0`). The guest finds its character device
//! through `/sys/class/virtio-ports/*/name`.
//!
//! Frame (both directions):
//!
//! ```text
//! +-------------------+------------------------------------------------+
//! | N: u32 big-endian | N bytes: one JSON object {"v": 1, "type": ...} |
//! +-------------------+------------------------------------------------+
//!                       1 <= N <= MAX_FRAME_LEN (1 MiB)
//! ```
//!
//! A length of 0 or above [`MAX_FRAME_LEN`] is a [`FrameError`]: the stream cannot be
//! resynchronised and the reader drops the connection. A frame of the right length whose body
//! is not JSON, has another `v`, or an unknown `type` is a [`DecodeError`]: the reader answers
//! with [`Message::Error`] and goes on. Fields a side does not know are ignored.
//!
//! Conversation:
//!
//! ```text
//! guest → host  hello    {init_version}                      once the init runs
//! host → guest  start    {argv, user, env, workdir, ready}   the image manifest's sandbox
//! guest → host  ready    {elapsed_ms, attempts, settled_ms}  ready check passed, guest idle
//!            or failed   {kind, reason}                      check timed out, command died
//! host → guest  restore  {entropy, time_unix_ns, env,        after a snapshot is restored
//!                         image_user, image_env}
//! guest → host  restored {machine_id, random, boot_id}
//! either        ping {nonce} → pong {nonce}                  liveness
//! either        error {message}                              answer to a frame it refused
//!
//! host → guest  connect  {nonce}                             first frame of a new connection
//! guest → host  connected {nonce}, then hello
//! host → guest  exec     {id, argv, env, user, workdir, stdin, detach,
//!                         memory_max, pids_max}
//! guest → host  output   {id, seq, stream, data}             0 or more per exec
//! guest → host  exit     {id, seq, code | signal, oom,       exactly one per exec
//!                         pids_limit, disk_full, failure}
//!
//! host → guest  diff     {}                                  step VMs: send the changes
//! guest → host  diff_data {seq, data}                        0 or more: a tar stream
//! guest → host  diff_end {seq, bytes, error}                 exactly one per diff
//!
//! host → guest  mount_step {lowers, egress}                  builder VMs (`kiln.step=wait`),
//!                                                            after `restore`: mount the step
//! guest → host  step_mounted {}                              its root is `/`; or `error`
//! ```
//!
//! ## Commands (`exec`)
//!
//! The host picks each exec's `id` (any u64 not running now; kiln-vmm draws 64 random bits).
//! Several execs may run at once; their frames interleave, each carrying its `id`. `seq`
//! numbers one exec's `output` frames from 0 in the order the guest read them (stdout and
//! stderr share the counter, so their relative order is kept); the `exit` frame carries the
//! next number, so a receiver knows that nothing was lost. A chunk holds 1 to
//! [`MAX_CHUNK_LEN`] bytes.
//!
//! A host connection ends when the guest's reads of the port return 0 (QEMU's chardev lost
//! its client) or when a `connect` arrives. Either way the guest kills (SIGKILL, the whole
//! process group) every running exec that was not started with `detach`. A detached exec goes
//! on running; its later output and its exit are dropped (logged on the guest console).
//!
//! Because QEMU keeps guest bytes it could not deliver and hands them to the next client, a
//! new connection can begin with the tail of an older conversation, even in the middle of a
//! frame. The host therefore opens with `connect {nonce}` (a fresh random nonce) and discards
//! bytes until the exact frame [`encode`] makes of `connected {nonce}`; from there on the
//! stream is in step. The other way round, the guest may miss a disconnect (the host left and
//! came back between two of its reads) and hold the cut frame of an older host; it drops
//! what comes before a `connect` frame ([`FrameBuffer::push_watching_connect`]).
//!
//! Bounds, checked by [`encode_body`] before sending and by [`decode_body`] on receipt (a
//! hostile host or guest gets a [`DecodeError::BadField`]): see [`MAX_ARGS`],
//! [`MAX_ARGV_BYTES`], [`MAX_ENV_VARS`], [`MAX_ENV_BYTES`], [`MAX_USER_LEN`],
//! [`MAX_WORKDIR_LEN`], [`MAX_STDIN_LEN`], [`MAX_CHUNK_LEN`].

use base64::Engine as _;
use serde::{Deserialize, Serialize};

mod exec;
mod frame;
pub use exec::*;
pub use frame::{
    CONNECT_PREFIX, FrameBuffer, FrameError, WriteError, body_len, encode, read_frame,
    write_message,
};

/// The virtio-serial port name the guest init opens (`/sys/class/virtio-ports/vportNpM/name`).
pub const PORT_NAME: &str = "org.kiln.guest.0";

/// The protocol version this module speaks: the `"v"` field of every message.
pub const PROTOCOL_VERSION: u64 = 1;

/// Largest frame body, bytes (1 MiB). Frames announcing more are refused before reading them.
pub const MAX_FRAME_LEN: usize = 1 << 20;

/// Length of the frame header (the big-endian u32 body length), bytes.
pub const HEADER_LEN: usize = 4;

/// Fewest entropy bytes a [`Restore`] must carry (after base64 decoding).
pub const MIN_ENTROPY_LEN: usize = 32;

/// Most entropy bytes a [`Restore`] may carry (after base64 decoding); the kernel's
/// `RNDADDENTROPY` accepts any size, this only bounds what a host can make the guest allocate.
pub const MAX_ENTROPY_LEN: usize = 4096;

/// Most argv entries an [`Exec`] may carry (1 at least). Linux's own limit is the
/// argument-and-environment bytes below; this bounds what a host can make the guest allocate.
pub const MAX_ARGS: usize = 4096;

/// Most bytes all argv entries of an [`Exec`] may hold together (128 KiB, the size Linux
/// guarantees for one argument string, `MAX_ARG_STRLEN`).
pub const MAX_ARGV_BYTES: usize = 128 << 10;

/// Most `KEY=value` entries in an [`Exec`]'s `env`.
pub const MAX_ENV_VARS: usize = 4096;

/// Most bytes all `env` entries of an [`Exec`] may hold together (128 KiB).
pub const MAX_ENV_BYTES: usize = 128 << 10;

/// Longest `user` of an [`Exec`], bytes.
pub const MAX_USER_LEN: usize = 256;

/// Longest `workdir` of an [`Exec`], bytes (Linux's `PATH_MAX`).
pub const MAX_WORKDIR_LEN: usize = 4096;

/// Most stdin bytes an [`Exec`] may carry (512 KiB; base64 makes it 683 KiB of the 1 MiB
/// frame, leaving room for argv and env).
pub const MAX_STDIN_LEN: usize = 512 << 10;

/// Most bytes one [`Output`] chunk may carry (64 KiB, the size of a Linux pipe buffer).
pub const MAX_CHUNK_LEN: usize = 64 << 10;

/// Longest `diff_end` error text, bytes.
pub const MAX_ERROR_LEN: usize = 4096;
/// The directory of [`Exec::files`] (the namespace executor puts a step's heredocs there too:
/// a tmpfs of the step's, never part of its layer).
pub const PIPES_DIR: &str = "/dev/pipes/";
/// Most [`Exec::files`] in one exec.
pub const MAX_FILES: usize = 64;
/// Most [`Exec::mounts`] in one exec.
pub const MAX_MOUNTS: usize = 64;
/// Most lower disks of a step VM ([`MountStep::lowers`], `kiln.step=N`): the microvm
/// machine's 24 virtio-mmio transports less the upper disk and the host port.
pub const MAX_STEP_LOWERS: usize = 22;
/// Most bytes of [`Exec::files`] data in one exec (512 KiB: heredocs and a step's CA bundle,
/// an image's own of about 220 KB with the build's extra certificates; base64 on the wire,
/// and the whole frame must still fit in [`MAX_FRAME_LEN`]).
pub const MAX_FILES_BYTES: usize = 512 << 10;

/// One protocol message. Serialised as a JSON object with `"v": 1` and `"type"` set to the
/// variant's snake_case name; the variant's fields sit beside them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// guest → host: the init runs and listens.
    Hello(Hello),
    /// host → guest: what to start, and how to know it is ready.
    Start(Start),
    /// guest → host: the start command runs and its ready check passed (or it has none).
    Ready(Ready),
    /// guest → host: the start command could not start or died, or the ready check gave up.
    Failed(Failed),
    /// host → guest: this VM is a copy restored from a snapshot; refresh what must differ.
    Restore(Restore),
    /// guest → host: the restore is applied.
    Restored(Restored),
    /// either side: are you alive? Answered with [`Message::Pong`] carrying the same nonce.
    Ping(Ping),
    /// either side: answer to a [`Message::Ping`].
    Pong(Ping),
    /// either side: a frame was refused (bad JSON, other version, unknown type, bad field,
    /// a message not expected now).
    Error(ErrorMessage),
    /// host → guest: the first frame of a new host connection.
    Connect(Ping),
    /// guest → host: answer to [`Message::Connect`], same nonce; everything before it on the
    /// stream belongs to an older connection.
    Connected(Ping),
    /// host → guest: run a command.
    Exec(Exec),
    /// guest → host: a chunk of an exec's stdout or stderr.
    Output(Output),
    /// guest → host: an exec ended (or never started); its last frame.
    Exit(ExecExit),
    /// host → guest (step VMs, booted with `kiln.step=`): end every process, then send the
    /// step's upper directory as a tar stream.
    Diff(DiffRequest),
    /// guest → host: a chunk of that tar stream.
    DiffData(DiffData),
    /// guest → host: the tar stream is complete, or could not be made; its last frame.
    DiffEnd(DiffEnd),
    /// host → guest (builder VMs, booted with `kiln.step=wait` and restored from the
    /// per-host builder snapshot): the step's disks are bound now; drop what the block
    /// layer cached of them, mount the step's root and make it `/`.
    MountStep(MountStep),
    /// guest → host: the step's root is mounted ([`Message::MountStep`]); an
    /// [`Message::Error`] says why not.
    StepMounted(StepMounted),
}

/// `mount_step`: what a builder VM mounts as the step's root (the disks are found by
/// serial, as at a cold step boot: `upper`, `lower0` … `lower<lowers-1>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountStep {
    /// The step's lower disks, topmost first; at most [`MAX_STEP_LOWERS`].
    pub lowers: u32,
    /// Start the egress listener (`127.0.0.1:3128`, as `kiln.egress` does at a cold boot).
    #[serde(default)]
    pub egress: bool,
}

/// `step_mounted`: the answer to [`MountStep`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepMounted {}

/// `hello`: sent by the guest init once it runs and has opened the port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The init's version (its crate version, e.g. `0.1.0`).
    pub init_version: String,
}

/// `start`: the image's start command and ready check (from its manifest's `sandbox`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Start {
    /// argv of the start command, run directly (no shell); empty: the image has none, and the
    /// guest is ready once its ready check passes (or at once without one).
    #[serde(default)]
    pub argv: Vec<String>,
    /// User to run as: `name`, `uid`, `name:group` or `uid:gid`, resolved in the image's
    /// `/etc/passwd` and `/etc/group`; `None`: root.
    #[serde(default)]
    pub user: Option<String>,
    /// Environment, `KEY=value` each, on top of the init's defaults (`PATH`, `HOME`).
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory (absolute); `None`: `/`.
    #[serde(default)]
    pub workdir: Option<String>,
    /// The ready check; `None`: ready as soon as the start command is started.
    #[serde(default)]
    pub ready: Option<ReadyCheck>,
}

/// The ready check: run `argv` (as the start command's user, env and workdir) every
/// `interval_ms` until it exits 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyCheck {
    /// argv of the check; exit status 0 means ready.
    pub argv: Vec<String>,
    /// Time between the end of one attempt and the start of the next, ms.
    pub interval_ms: u64,
    /// Time one attempt may take before it is killed and counted as failed, ms.
    pub timeout_ms: u64,
    /// Failed attempts tolerated: the guest sends [`Message::Failed`] with
    /// [`FailureKind::ReadyTimeout`] when attempt `retries + 1` fails.
    pub retries: u32,
}

/// `ready`: the guest is ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// Time from receiving `start` to the passing check, ms (guest monotonic clock).
    pub elapsed_ms: u64,
    /// Ready-check attempts run, the passing one included (0 without a check).
    #[serde(default)]
    pub attempts: u32,
    /// Time from the passing check to this message, ms: the init waits until the guest is
    /// idle (nothing runnable but itself, nothing waiting for I/O), at most 2 s, so that the
    /// snapshot saved at `ready` has nothing half done for every clone to finish. 0 from an
    /// init that does not wait.
    #[serde(default)]
    pub settled_ms: u64,
}

/// Why the guest failed to become ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The ready check failed `retries + 1` times.
    ReadyTimeout,
    /// The start command exited (or was killed) before the check passed.
    StartExited,
    /// The start command could not be started (no such file, bad user, bad workdir...).
    StartFailed,
    /// A failure kind this version does not know.
    #[serde(other)]
    Other,
}

/// `failed`: the guest will not become ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failed {
    /// What failed.
    pub kind: FailureKind,
    /// Human-readable detail (at most a few KiB).
    pub reason: String,
}

/// `restore`: sent by the host right after a clone resumes from a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restore {
    /// Fresh entropy from the host, standard base64 (RFC 4648 §4, padded), at least
    /// [`MIN_ENTROPY_LEN`] and at most [`MAX_ENTROPY_LEN`] bytes once decoded.
    pub entropy: String,
    /// The host's wall clock, nanoseconds since the Unix epoch (CLOCK_REALTIME).
    pub time_unix_ns: u64,
    /// The clone's environment, `KEY=value` each, applied to processes started from now on.
    #[serde(default)]
    pub env: Vec<String>,
    /// The image's user (its OCI config's `User`, `0` when that is empty), the default user
    /// of `exec`s from now on; `None` (an image without a config): the start command's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_user: Option<String>,
    /// The image's environment (its OCI config's `Env`), under every `exec`'s from now on;
    /// `None` (an image without a config): the start command's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_env: Option<Vec<String>>,
    /// The size the host grew the root disk to, bytes (`kiln start --disk-mib`): the guest
    /// waits until its root block device is at least this large, then grows the root file
    /// system online to the device's size before it answers. `None`: the disk keeps the
    /// image's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
}

impl Restore {
    /// A restore message carrying `entropy` (base64-encoded here), without image defaults.
    pub fn new(entropy: &[u8], time_unix_ns: u64, env: Vec<String>) -> Self {
        Self {
            entropy: base64::engine::general_purpose::STANDARD.encode(entropy),
            time_unix_ns,
            env,
            image_user: None,
            image_env: None,
            disk_bytes: None,
        }
    }

    /// The decoded entropy bytes.
    ///
    /// Errors: [`DecodeError::BadField`] when it is not base64 or its length is outside
    /// [`MIN_ENTROPY_LEN`]..=[`MAX_ENTROPY_LEN`].
    pub fn entropy_bytes(&self) -> Result<Vec<u8>, DecodeError> {
        // Bound before decoding: base64 is 4 characters per 3 bytes.
        if self.entropy.len() > MAX_ENTROPY_LEN.div_ceil(3) * 4 {
            return Err(DecodeError::BadField {
                field: "entropy",
                reason: format!("longer than {MAX_ENTROPY_LEN} bytes"),
            });
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&self.entropy)
            .map_err(|e| DecodeError::BadField {
                field: "entropy",
                reason: format!("not base64: {e}"),
            })?;
        if !(MIN_ENTROPY_LEN..=MAX_ENTROPY_LEN).contains(&bytes.len()) {
            return Err(DecodeError::BadField {
                field: "entropy",
                reason: format!(
                    "{} bytes, must be {MIN_ENTROPY_LEN} to {MAX_ENTROPY_LEN}",
                    bytes.len()
                ),
            });
        }
        Ok(bytes)
    }
}

/// `restored`: the guest applied a restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restored {
    /// The new `/etc/machine-id`: 32 lowercase hex digits.
    pub machine_id: String,
    /// 16 bytes from `getrandom(2)` read after the reseed, 32 lowercase hex digits.
    pub random: String,
    /// The kernel's boot ID (`/proc/sys/kernel/random/boot_id`); clones of one snapshot share it.
    pub boot_id: String,
    /// When the restore asked for a grown disk ([`Restore::disk_bytes`]): the root file
    /// system's size after growing it, bytes (statfs(2) `f_blocks × f_bsize`). `None` when no
    /// grow was asked, or from an init that cannot grow disks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_bytes: Option<u64>,
}

/// `ping` and `pong`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Ping {
    /// Chosen by the pinging side, echoed in the pong.
    #[serde(default)]
    pub nonce: u64,
}

/// `error`: a refused frame or an unexpected message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMessage {
    /// What was wrong.
    pub message: String,
}

impl Message {
    /// The `"type"` string of this message.
    pub fn type_name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Start(_) => "start",
            Message::Ready(_) => "ready",
            Message::Failed(_) => "failed",
            Message::Restore(_) => "restore",
            Message::Restored(_) => "restored",
            Message::Ping(_) => "ping",
            Message::Pong(_) => "pong",
            Message::Error(_) => "error",
            Message::Connect(_) => "connect",
            Message::Connected(_) => "connected",
            Message::Exec(_) => "exec",
            Message::Output(_) => "output",
            Message::Exit(_) => "exit",
            Message::Diff(_) => "diff",
            Message::DiffData(_) => "diff_data",
            Message::DiffEnd(_) => "diff_end",
            Message::MountStep(_) => "mount_step",
            Message::StepMounted(_) => "step_mounted",
        }
    }

    /// Check the bounds of the messages that have them ([`Exec`], [`Output`], [`ExecExit`]).
    ///
    /// Errors: [`DecodeError::BadField`] naming the field.
    pub fn check(&self) -> Result<(), DecodeError> {
        match self {
            Message::Exec(e) => e.check(),
            Message::Output(o) => o.check(),
            Message::Exit(x) => x.check(),
            Message::DiffData(d) => check_chunk(&d.data),
            Message::DiffEnd(d) => match &d.error {
                Some(e) if e.len() > MAX_ERROR_LEN => Err(bad(
                    "error",
                    format!("{} bytes, at most {MAX_ERROR_LEN}", e.len()),
                )),
                _ => Ok(()),
            },
            Message::MountStep(m) if m.lowers as usize > MAX_STEP_LOWERS => Err(bad(
                "lowers",
                format!("{} disks, at most {MAX_STEP_LOWERS}", m.lowers),
            )),
            _ => Ok(()),
        }
    }

    /// An `error` message answering a refused frame.
    pub fn error(err: &DecodeError) -> Self {
        Message::Error(ErrorMessage {
            message: err.to_string(),
        })
    }
}

const KNOWN_TYPES: [&str; 19] = [
    "hello",
    "start",
    "ready",
    "failed",
    "restore",
    "restored",
    "ping",
    "pong",
    "error",
    "connect",
    "connected",
    "exec",
    "output",
    "exit",
    "diff",
    "diff_data",
    "diff_end",
    "mount_step",
    "step_mounted",
];

fn bad(field: &'static str, reason: String) -> DecodeError {
    DecodeError::BadField { field, reason }
}

/// Check a list of strings: at most `max_n` entries and `max_bytes` in all, no NUL.
fn check_strings(
    field: &'static str,
    v: &[String],
    max_n: usize,
    max_bytes: usize,
) -> Result<(), DecodeError> {
    if v.len() > max_n {
        return Err(bad(field, format!("{} entries, at most {max_n}", v.len())));
    }
    let bytes: usize = v.iter().map(String::len).sum();
    if bytes > max_bytes {
        return Err(bad(field, format!("{bytes} bytes, at most {max_bytes}")));
    }
    if v.iter().any(|s| s.contains('\0')) {
        return Err(bad(field, "an entry contains a NUL byte".into()));
    }
    Ok(())
}

/// serde for `Vec<u8>` as a standard base64 string (RFC 4648 §4, padded).
mod base64_bytes {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        // The string is bounded by the frame (1 MiB); the decoded length by the message's
        // check.
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map_err(|e| serde::de::Error::custom(format!("not base64: {e}")))
    }
}

/// Why a frame body is not a message this version accepts. The connection stays usable: answer
/// with [`Message::error`].
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The body is not one JSON object.
    #[error("the frame is not a JSON object: {0}")]
    NotJson(String),
    /// `"v"` is missing or not [`PROTOCOL_VERSION`].
    #[error("unsupported protocol version {0} (this side speaks v{PROTOCOL_VERSION})")]
    UnknownVersion(String),
    /// `"type"` is missing or not a string.
    #[error("the message has no \"type\" string")]
    MissingType,
    /// `"type"` names no message of this version.
    #[error("unknown message type {0:?}")]
    UnknownType(String),
    /// A known type with missing or ill-typed fields.
    #[error("bad {type_name} message: {reason}")]
    BadMessage {
        /// The message's `"type"`.
        type_name: String,
        /// serde's description.
        reason: String,
    },
    /// A field's value is out of its domain.
    #[error("bad field {field}: {reason}")]
    BadField {
        /// The field's name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A message is larger than [`MAX_FRAME_LEN`] once encoded.
    #[error("the message is {0} bytes once encoded; the limit is {MAX_FRAME_LEN}")]
    TooLarge(usize),
}

/// The JSON body of `msg` (no frame header), with `"v": 1` first.
///
/// Errors: [`DecodeError::BadField`] when the message breaks its bounds ([`Message::check`]);
/// [`DecodeError::TooLarge`] when it exceeds [`MAX_FRAME_LEN`].
pub fn encode_body(msg: &Message) -> Result<Vec<u8>, DecodeError> {
    msg.check()?;
    let value = serde_json::to_value(msg).map_err(|e| DecodeError::BadMessage {
        type_name: msg.type_name().to_string(),
        reason: e.to_string(),
    })?;
    let serde_json::Value::Object(fields) = value else {
        // Every variant is a struct newtype in an internally tagged enum: always an object.
        return Err(DecodeError::BadMessage {
            type_name: msg.type_name().to_string(),
            reason: "did not serialise to an object".into(),
        });
    };
    let mut out = serde_json::Map::new();
    out.insert("v".into(), PROTOCOL_VERSION.into());
    out.extend(fields);
    // Serialising a Value to a Vec cannot fail (no I/O, string keys only).
    let body = serde_json::to_vec(&serde_json::Value::Object(out)).unwrap_or_default();
    if body.len() > MAX_FRAME_LEN {
        return Err(DecodeError::TooLarge(body.len()));
    }
    Ok(body)
}

/// Decode one frame body (without its header).
///
/// Errors: [`DecodeError`] naming what is wrong (bounds included: [`Message::check`]);
/// unknown fields are ignored.
pub fn decode_body(body: &[u8]) -> Result<Message, DecodeError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| DecodeError::NotJson(e.to_string()))?;
    let serde_json::Value::Object(mut fields) = value else {
        return Err(DecodeError::NotJson("not an object".into()));
    };
    match fields.get("v") {
        Some(v) if v.as_u64() == Some(PROTOCOL_VERSION) => {}
        Some(v) => return Err(DecodeError::UnknownVersion(truncate(&v.to_string(), 64))),
        None => return Err(DecodeError::UnknownVersion("(missing)".into())),
    }
    fields.remove("v");
    let type_name = match fields.get("type") {
        Some(serde_json::Value::String(t)) => t.clone(),
        _ => return Err(DecodeError::MissingType),
    };
    if !KNOWN_TYPES.contains(&type_name.as_str()) {
        return Err(DecodeError::UnknownType(truncate(&type_name, 64)));
    }
    let msg: Message = serde_json::from_value(serde_json::Value::Object(fields)).map_err(|e| {
        DecodeError::BadMessage {
            type_name,
            reason: e.to_string(),
        }
    })?;
    msg.check()?;
    Ok(msg)
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn all_messages() -> Vec<Message> {
        vec![
            Message::Hello(Hello {
                init_version: "0.1.0".into(),
            }),
            Message::Start(Start {
                argv: vec!["/bin/sh".into(), "-c".into(), "sleep 100".into()],
                user: Some("runtime:runtime".into()),
                env: vec!["A=b".into()],
                workdir: Some("/workspace".into()),
                ready: Some(ReadyCheck {
                    argv: vec!["true".into()],
                    interval_ms: 100,
                    timeout_ms: 1000,
                    retries: 3,
                }),
            }),
            Message::Start(Start::default()),
            Message::Ready(Ready {
                elapsed_ms: 12,
                attempts: 2,
                settled_ms: 40,
            }),
            Message::Failed(Failed {
                kind: FailureKind::ReadyTimeout,
                reason: "gave up".into(),
            }),
            Message::Restore(Restore::new(&[7u8; 32], 1_700_000_000_000_000_000, vec![])),
            Message::Restore(Restore {
                image_user: Some("runtime".into()),
                image_env: Some(vec!["PATH=/workspace/.local/bin:/bin".into()]),
                ..Restore::new(&[7u8; 32], 0, vec!["A=1".into()])
            }),
            Message::Restore(Restore {
                disk_bytes: Some(256 << 20),
                ..Restore::new(&[7u8; 32], 0, vec![])
            }),
            Message::Restored(Restored {
                machine_id: "0".repeat(32),
                random: "ab".repeat(16),
                boot_id: "b".into(),
                fs_bytes: None,
            }),
            Message::Restored(Restored {
                machine_id: "0".repeat(32),
                random: "ab".repeat(16),
                boot_id: "b".into(),
                fs_bytes: Some(268_435_456),
            }),
            Message::Ping(Ping { nonce: 9 }),
            Message::Pong(Ping { nonce: 9 }),
            Message::MountStep(MountStep {
                lowers: MAX_STEP_LOWERS as u32,
                egress: true,
            }),
            Message::StepMounted(StepMounted {}),
            Message::Error(ErrorMessage {
                message: "no".into(),
            }),
            Message::Connect(Ping { nonce: u64::MAX }),
            Message::Connected(Ping { nonce: 1 }),
            Message::Exec(Exec {
                id: 5,
                argv: vec!["sh".into(), "-c".into(), "cat".into()],
                env: vec!["A=b=c".into()],
                user: Some("nobody".into()),
                workdir: Some("/tmp".into()),
                stdin: b"in\0put".to_vec(),
                detach: true,
                make_workdir: true,
                files: vec![ExecFile {
                    path: "/dev/pipes/EOF".into(),
                    data: b"echo hi\n".to_vec(),
                    mode: 0o755,
                }],
                mounts: vec![
                    ExecMount {
                        rel: "scratch".into(),
                        kind: ExecMountKind::Tmpfs {
                            size_bytes: Some(1 << 20),
                        },
                    },
                    ExecMount {
                        rel: "src".into(),
                        kind: ExecMountKind::Disk {
                            serial: "lower3".into(),
                            readwrite: true,
                            file: false,
                        },
                    },
                    ExecMount {
                        rel: "etc/app.conf".into(),
                        kind: ExecMountKind::Disk {
                            serial: "lower4".into(),
                            readwrite: false,
                            file: true,
                        },
                    },
                    ExecMount {
                        rel: "root/.cache/pip".into(),
                        kind: ExecMountKind::Cache {
                            serial: "cache0".into(),
                            readonly: false,
                        },
                    },
                    ExecMount {
                        rel: "var/cache/apt".into(),
                        kind: ExecMountKind::Cache {
                            serial: "cache12".into(),
                            readonly: true,
                        },
                    },
                    ExecMount {
                        rel: "run/secrets/tok".into(),
                        kind: ExecMountKind::Secret {
                            data: b"hunter2".to_vec(),
                            mode: 0o400,
                            uid: 0,
                            gid: 0,
                        },
                    },
                ],
                memory_max: Some(64 << 20),
                pids_max: Some(64),
            }),
            Message::Exec(Exec {
                id: 6,
                argv: vec!["true".into()],
                ..Exec::default()
            }),
            Message::Output(Output {
                id: 5,
                seq: 0,
                stream: Stream::Stderr,
                data: vec![0, 255, 10],
            }),
            Message::Exit(ExecExit {
                id: 5,
                seq: 1,
                code: Some(3),
                ..ExecExit::default()
            }),
            Message::Exit(ExecExit {
                id: 6,
                seq: 0,
                signal: Some(9),
                oom: true,
                pids_limit: true,
                disk_full: true,
                ..ExecExit::default()
            }),
            Message::Exit(ExecExit {
                id: 7,
                seq: 0,
                failure: Some(ExecFailure {
                    kind: ExecFailureKind::NotFound,
                    message: "nope".into(),
                }),
                ..ExecExit::default()
            }),
            Message::Diff(DiffRequest {}),
            Message::DiffData(DiffData {
                seq: 0,
                data: vec![1, 2, 3],
            }),
            Message::DiffEnd(DiffEnd {
                seq: 1,
                bytes: 3,
                error: Some("disk".into()),
            }),
        ]
    }

    fn exec(argv: &[&str]) -> Exec {
        Exec {
            id: 1,
            argv: argv.iter().map(|s| s.to_string()).collect(),
            ..Exec::default()
        }
    }

    /// A frame body with `"v": 1` made from `json` without the sending side's checks, as a
    /// hostile peer would send it.
    fn raw(json: serde_json::Value) -> Vec<u8> {
        let mut m = serde_json::Map::new();
        m.insert("v".into(), 1.into());
        if let serde_json::Value::Object(f) = json {
            m.extend(f);
        }
        serde_json::to_vec(&serde_json::Value::Object(m)).unwrap()
    }

    fn refused_field(body: &[u8]) -> &'static str {
        match decode_body(body) {
            Err(DecodeError::BadField { field, .. }) => field,
            other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
        }
    }

    #[test]
    fn exec_bounds_are_refused_by_the_guest_and_never_sent_by_the_host() {
        let many = vec!["x"; MAX_ARGS + 1];
        let long = "a".repeat(MAX_ARGV_BYTES + 1);
        let big_env: Vec<String> = (0..MAX_ENV_VARS + 1).map(|i| format!("K{i}=v")).collect();
        let fat_env = vec![format!("K={}", "v".repeat(MAX_ENV_BYTES))];
        let mut cases: Vec<(Exec, &str)> = vec![
            (exec(&[]), "argv"),
            (exec(&many), "argv"),
            (exec(&[&long]), "argv"),
            (exec(&["a\0b"]), "argv"),
            (
                Exec {
                    env: big_env,
                    ..exec(&["true"])
                },
                "env",
            ),
            (
                Exec {
                    env: fat_env,
                    ..exec(&["true"])
                },
                "env",
            ),
            (
                Exec {
                    env: vec!["NOEQUALS".into()],
                    ..exec(&["true"])
                },
                "env",
            ),
            (
                Exec {
                    env: vec!["=v".into()],
                    ..exec(&["true"])
                },
                "env",
            ),
            (
                Exec {
                    user: Some("u".repeat(MAX_USER_LEN + 1)),
                    ..exec(&["true"])
                },
                "user",
            ),
            (
                Exec {
                    user: Some(String::new()),
                    ..exec(&["true"])
                },
                "user",
            ),
            (
                Exec {
                    workdir: Some("relative".into()),
                    ..exec(&["true"])
                },
                "workdir",
            ),
            (
                Exec {
                    workdir: Some(format!("/{}", "d".repeat(MAX_WORKDIR_LEN))),
                    ..exec(&["true"])
                },
                "workdir",
            ),
            (
                Exec {
                    stdin: vec![0; MAX_STDIN_LEN + 1],
                    ..exec(&["true"])
                },
                "stdin",
            ),
        ];
        let file = |path: &str, n: usize| ExecFile {
            path: path.into(),
            data: vec![b'x'; n],
            mode: 0o644,
        };
        for path in [
            "/dev/pipes/",
            "/dev/pipes/..",
            "/dev/pipes/a/b",
            "/dev/pipes/../../etc/passwd",
            "/etc/passwd",
            "/dev/pipes/a\0b",
        ] {
            cases.push((
                Exec {
                    files: vec![file(path, 1)],
                    ..exec(&["true"])
                },
                "files",
            ));
        }
        for rel in ["", "/etc", "a/../b", "a//b", "./a", "a\0b"] {
            cases.push((
                Exec {
                    mounts: vec![ExecMount {
                        rel: rel.into(),
                        kind: ExecMountKind::Tmpfs { size_bytes: None },
                    }],
                    ..exec(&["true"])
                },
                "mounts",
            ));
        }
        for serial in [
            "upper",
            "lower",
            "lowerx",
            "lower1234",
            "../lower1",
            "cache0",
        ] {
            cases.push((
                Exec {
                    mounts: vec![ExecMount {
                        rel: "src".into(),
                        kind: ExecMountKind::Disk {
                            serial: serial.into(),
                            readwrite: false,
                            file: false,
                        },
                    }],
                    ..exec(&["true"])
                },
                "mounts",
            ));
        }
        for serial in ["lower0", "cache", "cachex", "cache1234", "upper"] {
            cases.push((
                Exec {
                    mounts: vec![ExecMount {
                        rel: "c".into(),
                        kind: ExecMountKind::Cache {
                            serial: serial.into(),
                            readonly: false,
                        },
                    }],
                    ..exec(&["true"])
                },
                "mounts",
            ));
        }
        cases.push((
            Exec {
                mounts: (0..=MAX_MOUNTS)
                    .map(|i| ExecMount {
                        rel: format!("m{i}"),
                        kind: ExecMountKind::Tmpfs { size_bytes: None },
                    })
                    .collect(),
                ..exec(&["true"])
            },
            "mounts",
        ));
        cases.push((
            Exec {
                files: vec![file("/dev/pipes/a", MAX_FILES_BYTES / 2)],
                mounts: vec![ExecMount {
                    rel: "run/secrets/s".into(),
                    kind: ExecMountKind::Secret {
                        data: vec![1; MAX_FILES_BYTES / 2 + 1],
                        mode: 0o400,
                        uid: 0,
                        gid: 0,
                    },
                }],
                ..exec(&["true"])
            },
            "files",
        ));
        cases.push((
            Exec {
                files: (0..=MAX_FILES)
                    .map(|i| file(&format!("/dev/pipes/f{i}"), 1))
                    .collect(),
                ..exec(&["true"])
            },
            "files",
        ));
        cases.push((
            Exec {
                files: vec![
                    file("/dev/pipes/a", MAX_FILES_BYTES / 2),
                    file("/dev/pipes/b", MAX_FILES_BYTES / 2 + 1),
                ],
                ..exec(&["true"])
            },
            "files",
        ));
        for (e, field) in cases {
            // The sending side refuses to encode it...
            assert!(
                matches!(encode(&Message::Exec(e.clone())), Err(DecodeError::BadField { field: f, .. }) if f == field),
                "{field}"
            );
            // ...and the receiving side refuses it when a hostile peer sends it anyway.
            let mut json = serde_json::to_value(Message::Exec(e)).unwrap();
            json["v"] = 1.into();
            let body = serde_json::to_vec(&json).unwrap();
            assert_eq!(refused_field(&body), field);
        }
        // The largest allowed values pass.
        let ok = Exec {
            stdin: vec![7; MAX_STDIN_LEN],
            env: vec!["K=v".into()],
            ..exec(&["true"])
        };
        let frame = encode(&Message::Exec(ok.clone())).unwrap();
        assert_eq!(decode_body(&frame[4..]).unwrap(), Message::Exec(ok));
        let ok = Exec {
            files: (0..MAX_FILES)
                .map(|i| file(&format!("/dev/pipes/f{i}"), MAX_FILES_BYTES / MAX_FILES))
                .collect(),
            ..exec(&["true"])
        };
        let frame = encode(&Message::Exec(ok.clone())).unwrap();
        assert_eq!(decode_body(&frame[4..]).unwrap(), Message::Exec(ok));
        // stdin that is not base64 is a bad message.
        let body = raw(serde_json::json!({"type": "exec", "id": 1, "argv": ["x"], "stdin": "!!"}));
        assert!(matches!(
            decode_body(&body),
            Err(DecodeError::BadMessage { .. })
        ));
    }

    #[test]
    fn output_and_exit_bounds_are_refused_by_the_host() {
        use base64::Engine as _;
        let b64 = |n: usize| base64::engine::general_purpose::STANDARD.encode(vec![1u8; n]);
        let chunk = |n: usize| {
            raw(
                serde_json::json!({"type": "output", "id": 1, "seq": 0, "stream": "stdout", "data": b64(n)}),
            )
        };
        assert!(decode_body(&chunk(MAX_CHUNK_LEN)).is_ok());
        assert_eq!(refused_field(&chunk(MAX_CHUNK_LEN + 1)), "data");
        assert_eq!(refused_field(&chunk(0)), "data");
        let body = raw(
            serde_json::json!({"type": "output", "id": 1, "seq": 0, "stream": "stdin", "data": b64(1)}),
        );
        assert!(matches!(
            decode_body(&body),
            Err(DecodeError::BadMessage { .. })
        ));
        for (json, field) in [
            (
                serde_json::json!({"type": "exit", "id": 1, "seq": 0}),
                "code",
            ),
            (
                serde_json::json!({"type": "exit", "id": 1, "seq": 0, "code": 0, "signal": 9}),
                "code",
            ),
            (
                serde_json::json!({"type": "exit", "id": 1, "seq": 0, "code": 256}),
                "code",
            ),
            (
                serde_json::json!({"type": "exit", "id": 1, "seq": 0, "code": -1}),
                "code",
            ),
            (
                serde_json::json!({"type": "exit", "id": 1, "seq": 0, "signal": 0}),
                "signal",
            ),
            (
                serde_json::json!({"type": "exit", "id": 1, "seq": 0, "signal": 65}),
                "signal",
            ),
        ] {
            assert_eq!(refused_field(&raw(json)), field);
        }
        // An unknown failure kind from a newer guest still decodes.
        let body = raw(serde_json::json!({"type": "exit", "id": 1, "seq": 0,
            "failure": {"kind": "quota", "message": "m"}}));
        let Ok(Message::Exit(x)) = decode_body(&body) else {
            panic!()
        };
        assert_eq!(x.failure.unwrap().kind, ExecFailureKind::Other);
    }

    #[test]
    fn exec_wire_names_are_the_documented_ones() {
        let body = encode_body(&Message::Output(Output {
            id: 2,
            seq: 3,
            stream: Stream::Stdout,
            data: b"hi".to_vec(),
        }))
        .unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"v":1,"type":"output","id":2,"seq":3,"stream":"stdout","data":"aGk="}"#
        );
        let body = encode_body(&Message::Connected(Ping { nonce: 4 })).unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"v":1,"type":"connected","nonce":4}"#
        );
    }

    #[test]
    fn wire_names_are_the_documented_ones() {
        let body = encode_body(&Message::Hello(Hello {
            init_version: "1".into(),
        }))
        .unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"v":1,"type":"hello","init_version":"1"}"#
        );
        let start = decode_body(
            br#"{"v":1,"type":"start","argv":["x"],"user":null,"env":[],"workdir":null,
                "ready":{"argv":["y"],"interval_ms":5,"timeout_ms":6,"retries":7}}"#,
        )
        .unwrap();
        let Message::Start(start) = start else {
            panic!("not a start: {start:?}")
        };
        assert_eq!(start.ready.unwrap().retries, 7);
    }

    #[test]
    fn a_ready_from_an_init_that_does_not_wait_for_idle_reads_as_no_wait() {
        let msg = decode_body(br#"{"v":1,"type":"ready","elapsed_ms":9,"attempts":2}"#).unwrap();
        assert_eq!(
            msg,
            Message::Ready(Ready {
                elapsed_ms: 9,
                attempts: 2,
                settled_ms: 0,
            })
        );
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let msg = decode_body(br#"{"v":1,"type":"ping","nonce":3,"future":{"x":[1,2]}}"#).unwrap();
        assert_eq!(msg, Message::Ping(Ping { nonce: 3 }));
        let msg =
            decode_body(br#"{"v":1,"type":"failed","kind":"kernel_panic","reason":"r"}"#).unwrap();
        assert_eq!(
            msg,
            Message::Failed(Failed {
                kind: FailureKind::Other,
                reason: "r".into()
            })
        );
    }

    #[test]
    fn bad_json_is_a_decode_error_not_a_crash() {
        for body in [
            &b"{"[..],
            b"not json",
            b"\xff\xfe",
            b"[1,2]",
            b"\"hello\"",
            b"null",
        ] {
            let err = decode_body(body).unwrap_err();
            assert!(matches!(err, DecodeError::NotJson(_)), "{body:?}: {err:?}");
            // The answer is itself a valid message.
            let answer = encode(&Message::error(&err)).unwrap();
            decode_body(&answer[4..]).unwrap();
        }
        // Deep nesting is refused by serde_json's recursion limit, not a stack overflow.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(decode_body(deep.as_bytes()).is_err());
    }

    #[test]
    fn unknown_or_missing_version_is_refused() {
        for body in [
            &br#"{"type":"ping"}"#[..],
            br#"{"v":2,"type":"ping"}"#,
            br#"{"v":"1","type":"ping"}"#,
            br#"{"v":1.5,"type":"ping"}"#,
            br#"{"v":-1,"type":"ping"}"#,
        ] {
            assert!(
                matches!(decode_body(body), Err(DecodeError::UnknownVersion(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn unknown_or_missing_type_is_refused() {
        assert!(matches!(
            decode_body(br#"{"v":1,"type":"reboot"}"#),
            Err(DecodeError::UnknownType(t)) if t == "reboot"
        ));
        assert!(matches!(
            decode_body(br#"{"v":1}"#),
            Err(DecodeError::MissingType)
        ));
        assert!(matches!(
            decode_body(br#"{"v":1,"type":7}"#),
            Err(DecodeError::MissingType)
        ));
        // A long hostile type name is truncated in the error.
        let long = format!(r#"{{"v":1,"type":"{}"}}"#, "a".repeat(10_000));
        let err = decode_body(long.as_bytes()).unwrap_err().to_string();
        assert!(err.len() < 200, "{err}");
    }

    #[test]
    fn known_type_with_bad_fields_is_refused() {
        for body in [
            &br#"{"v":1,"type":"hello"}"#[..],
            br#"{"v":1,"type":"start","argv":"sh"}"#,
            br#"{"v":1,"type":"ready","elapsed_ms":-1}"#,
            br#"{"v":1,"type":"restore","entropy":"AA==","time_unix_ns":"now"}"#,
            br#"{"v":1,"type":"start","ready":{"argv":[],"interval_ms":1}}"#,
        ] {
            assert!(
                matches!(decode_body(body), Err(DecodeError::BadMessage { .. })),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn mount_step_lowers_are_bounded_both_ways() {
        let over = Message::MountStep(MountStep {
            lowers: MAX_STEP_LOWERS as u32 + 1,
            egress: false,
        });
        assert_eq!(
            refused_field(&raw(serde_json::json!({
                "v": 1, "type": "mount_step", "lowers": MAX_STEP_LOWERS + 1
            }))),
            "lowers"
        );
        assert!(matches!(
            encode_body(&over),
            Err(DecodeError::BadField {
                field: "lowers",
                ..
            })
        ));
        let body = br#"{"v":1,"type":"mount_step","lowers":2}"#;
        assert_eq!(
            decode_body(body).unwrap(),
            Message::MountStep(MountStep {
                lowers: 2,
                egress: false
            })
        );
        for body in [
            &br#"{"v":1,"type":"mount_step"}"#[..],
            br#"{"v":1,"type":"mount_step","lowers":-1}"#,
            br#"{"v":1,"type":"mount_step","lowers":4294967296}"#,
        ] {
            assert!(
                matches!(decode_body(body), Err(DecodeError::BadMessage { .. })),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn restore_entropy_is_bounded_and_checked() {
        let ok = Restore::new(&[1u8; 32], 0, vec![]);
        assert_eq!(ok.entropy_bytes().unwrap(), vec![1u8; 32]);
        for bad in [
            Restore::new(&[1u8; 31], 0, vec![]),
            Restore::new(&vec![1u8; MAX_ENTROPY_LEN + 1], 0, vec![]),
            Restore {
                entropy: "!!!not base64!!!".into(),
                ..Restore::new(&[], 0, vec![])
            },
            Restore {
                entropy: "A".repeat(10 << 20),
                ..Restore::new(&[], 0, vec![])
            },
        ] {
            assert!(matches!(
                bad.entropy_bytes(),
                Err(DecodeError::BadField {
                    field: "entropy",
                    ..
                })
            ));
        }
    }
}
