//! The exec messages of the host ⇄ guest protocol (the module doc of [`super`] gives the
//! conversation): `exec`, `output`, `exit`, and a step VM's `diff`, `diff_data`,
//! `diff_end`, with their bounds checks.

use super::*;

/// `diff`: asks a step VM for its changes. The guest kills every process but itself first,
/// so nothing writes while it reads.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiffRequest {}

/// `diff_data`: one chunk of the step's changes, an uncompressed tar stream in OCI layer
/// form (image spec `layer.md`: `.wh.<name>` whiteouts, `.wh..wh..opq` opaque markers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffData {
    /// This chunk's number, from 0.
    pub seq: u64,
    /// 1 to [`MAX_CHUNK_LEN`] bytes; standard base64 on the wire.
    #[serde(with = "base64_bytes")]
    pub data: Vec<u8>,
}

/// `diff_end`: the last frame of a diff.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiffEnd {
    /// The number of `diff_data` frames sent before this one.
    pub seq: u64,
    /// Bytes of tar sent in all.
    pub bytes: u64,
    /// Why the stream is incomplete, when it is (then the host discards it).
    #[serde(default)]
    pub error: Option<String>,
}

/// `exec`: run one command in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Exec {
    /// The exec's id, chosen by the host, unique among the running execs.
    pub id: u64,
    /// argv, run directly (no shell); `argv[0]` without a `/` is looked up in the `PATH` of
    /// the command's environment. 1 to [`MAX_ARGS`] entries, [`MAX_ARGV_BYTES`] in all.
    pub argv: Vec<String>,
    /// `KEY=value` each, merged over the guest's environment (see the guest init's doc):
    /// these win. At most [`MAX_ENV_VARS`] entries and [`MAX_ENV_BYTES`].
    #[serde(default)]
    pub env: Vec<String>,
    /// User (`name`, `uid`, `name:group`, `uid:gid`, resolved in the image's `/etc/passwd`
    /// and `/etc/group`); `None`: the image's user (the last [`Restore::image_user`], else
    /// the start command's), root without one.
    #[serde(default)]
    pub user: Option<String>,
    /// Working directory (absolute); `None`: the user's home directory (`/` when it does
    /// not exist).
    #[serde(default)]
    pub workdir: Option<String>,
    /// Bytes given to the command's stdin, which is then closed; empty: stdin is
    /// `/dev/null`. Standard base64 on the wire, at most [`MAX_STDIN_LEN`] bytes decoded.
    #[serde(default, with = "base64_bytes", skip_serializing_if = "Vec::is_empty")]
    pub stdin: Vec<u8>,
    /// Keep running when the host connection drops (output and exit are then dropped).
    #[serde(default)]
    pub detach: bool,
    /// Create the missing directories of `workdir`, owned by the user, before the command
    /// starts (a build step's `WORKDIR`, as the namespace executor does).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub make_workdir: bool,
    /// Files written before the command starts, owned by root (a build step's heredocs,
    /// `RUN <<EOF`): each a plain name directly under [`PIPES_DIR`], which is not in a build
    /// step's layer. At most [`MAX_FILES`] of them, [`MAX_FILES_BYTES`] of data in all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<ExecFile>,
    /// File systems mounted before the command starts and unmounted when it has exited, in
    /// order (a build step's `RUN --mount=type=tmpfs|secret`). At most [`MAX_MOUNTS`]; secret
    /// bytes count against [`MAX_FILES_BYTES`] with the files.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<ExecMount>,
    /// The exec's memory limit, bytes: its cgroup v2 `memory.max` (a build step's memory
    /// limit); past it the kernel's OOM killer ends a process of the exec and its `exit`
    /// says `oom`. `None`: no limit but the VM's memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// The most tasks (processes and threads) the exec may have at once: its cgroup v2
    /// `pids.max` (a build step's pids limit). A fork refused there stops the exec at once
    /// (its cgroup is killed) and its `exit` says `pids_limit`: a fork bomb would otherwise
    /// run on at the limit until the host's timeout. `None`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
}

/// One mount of [`Exec::mounts`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecMount {
    /// The mount point relative to `/`, already resolved (no `.`, `..` or empty component,
    /// at most [`MAX_WORKDIR_LEN`] bytes, no NUL); missing directories are made, mode 0755.
    pub rel: String,
    /// What is mounted there.
    #[serde(flatten)]
    pub kind: ExecMountKind,
}

/// The name of the one file on the disk of a single-file bind ([`ExecMountKind::Disk`] with
/// `file`), at the root of its ext4 file system.
pub const DISK_FILE_NAME: &str = "file";

/// What an [`ExecMount`] mounts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExecMountKind {
    /// A tmpfs (`mode=1777`), `nosuid,nodev`.
    Tmpfs {
        /// Size limit, bytes (absent: the kernel's default, half of RAM).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        size_bytes: Option<u64>,
    },
    /// The ext4 file system of the read-only disk with this serial (`lower<i>`, a bind
    /// mount's tree): mounted read-only, or with `readwrite` under an overlay whose upper
    /// directory is a tmpfs (the writes are discarded with the exec). With `file`, the bind
    /// is of one file: the disk's root holds it as [`DISK_FILE_NAME`], the file system is
    /// mounted (as above) on a private directory under `/dev`, and that file is bound onto a
    /// file mount point.
    Disk {
        /// The disk's serial (`/sys/block/vd*/serial`): `lower` and digits.
        serial: String,
        /// Writes allowed (and discarded).
        #[serde(default)]
        readwrite: bool,
        /// The bind is of the one file [`DISK_FILE_NAME`] at the disk's root (else of the
        /// disk's whole tree).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        file: bool,
    },
    /// The ext4 file system of the read-write disk with this serial (`cache<i>`, a
    /// `RUN --mount=type=cache` disk kept by the host between steps), mounted directly on the
    /// mount point (no overlay: the writes stay on the disk), `nosuid,nodev`, read-only with
    /// `readonly`. The guest flushes it (`syncfs`) and unmounts it when the exec ends, before
    /// its `exit`.
    Cache {
        /// The disk's serial (`/sys/block/vd*/serial`): `cache` and digits.
        serial: String,
        /// Mounted read-only.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        readonly: bool,
    },
    /// A file with these bytes, bound read-only onto a file mount point.
    Secret {
        /// Content; standard base64 on the wire.
        #[serde(default, with = "base64_bytes")]
        data: Vec<u8>,
        /// Permission bits (`& 0o7777`).
        mode: u32,
        /// Owner.
        uid: u32,
        /// Group.
        gid: u32,
    },
}

impl ExecMount {
    /// Whether `rel` is a relative path of normal components within the bounds.
    pub fn rel_ok(rel: &str) -> bool {
        !rel.is_empty()
            && rel.len() <= MAX_WORKDIR_LEN
            && !rel.contains('\0')
            && rel
                .split('/')
                .all(|c| !c.is_empty() && c != "." && c != "..")
    }
}

/// One file of [`Exec::files`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecFile {
    /// `/dev/pipes/NAME`: NAME not empty, not `.` or `..`, without `/` or NUL.
    pub path: String,
    /// Content; standard base64 on the wire.
    #[serde(default, with = "base64_bytes")]
    pub data: Vec<u8>,
    /// Permission bits (`& 0o7777`).
    pub mode: u32,
}

impl ExecFile {
    /// Whether `path` is a plain name directly under [`PIPES_DIR`].
    pub fn path_ok(path: &str) -> bool {
        path.strip_prefix(PIPES_DIR).is_some_and(|name| {
            !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
        })
    }
}

/// Which output stream a chunk comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// fd 1.
    Stdout,
    /// fd 2.
    Stderr,
}

/// `output`: a chunk of an exec's stdout or stderr.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Output {
    /// The exec.
    pub id: u64,
    /// This exec's frame number, from 0 (see the module doc).
    pub seq: u64,
    /// Which stream.
    pub stream: Stream,
    /// 1 to [`MAX_CHUNK_LEN`] bytes; standard base64 on the wire.
    #[serde(with = "base64_bytes")]
    pub data: Vec<u8>,
}

/// Why an exec did not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecFailureKind {
    /// `argv[0]` is not in `PATH`, or the file does not exist (`docker exec`: 127).
    NotFound,
    /// It exists but cannot be run: not executable, bad format, unknown user, bad working
    /// directory (`docker exec`: 126).
    CannotRun,
    /// The guest refused the request: a running exec has this id, too many run at once
    /// (`docker exec`: 125, the runtime's own error).
    Refused,
    /// A kind this version does not know.
    #[serde(other)]
    Other,
}

/// The reason an exec did not start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecFailure {
    /// Which kind.
    pub kind: ExecFailureKind,
    /// Human-readable detail.
    pub message: String,
}

/// `exit`: the last frame of an exec. Exactly one of `code`, `signal` and `failure` is set.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExecExit {
    /// The exec.
    pub id: u64,
    /// The number of `output` frames sent before this one.
    pub seq: u64,
    /// Exit status (0 to 255) when the command exited.
    #[serde(default)]
    pub code: Option<i32>,
    /// The signal (1 to 64) that ended it.
    #[serde(default)]
    pub signal: Option<i32>,
    /// The kernel's OOM killer ended it (or one of its processes): the `oom_kill` counter of
    /// the exec's own cgroup v2 `memory.events` went up. The guest kernel counts there for a
    /// cgroup limit and for the whole VM running out of memory alike. Also set when the guest
    /// stopped an exec that stalled at its [`Exec::memory_max`] (`signal` 9).
    #[serde(default)]
    pub oom: bool,
    /// The exec's pids limit ([`Exec::pids_max`]) refused a fork, and the guest stopped the
    /// exec (`signal` 9).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pids_limit: bool,
    /// The file system of `/` had less than [`DISK_FULL_BYTES`] free when the command ended
    /// (in a build step's VM, its upper disk, which is the step's write limit): a command
    /// that failed then most likely failed for want of space (`ENOSPC`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disk_full: bool,
    /// The command did not start.
    #[serde(default)]
    pub failure: Option<ExecFailure>,
}

/// Free bytes of `/` below which an ended exec is [`ExecExit::disk_full`] (1 MiB: ext4 stops
/// a writer with `ENOSPC` when its free blocks, less those it keeps for delayed allocation,
/// reach zero; a few blocks may stay free after the failed write).
pub const DISK_FULL_BYTES: u64 = 1 << 20;

impl Exec {
    /// Check the bounds (see the module doc) and the shapes: argv not empty, env entries
    /// `KEY=value` with a non-empty KEY, workdir absolute, no NUL anywhere.
    ///
    /// Errors: [`DecodeError::BadField`].
    pub fn check(&self) -> Result<(), DecodeError> {
        if self.argv.is_empty() {
            return Err(bad("argv", "empty".into()));
        }
        check_strings("argv", &self.argv, MAX_ARGS, MAX_ARGV_BYTES)?;
        check_strings("env", &self.env, MAX_ENV_VARS, MAX_ENV_BYTES)?;
        if let Some(e) = self
            .env
            .iter()
            .find(|e| e.split_once('=').is_none_or(|(k, _)| k.is_empty()))
        {
            return Err(bad(
                "env",
                format!("{:?} is not KEY=value", truncate(e, 64)),
            ));
        }
        if let Some(u) = &self.user
            && (u.is_empty() || u.len() > MAX_USER_LEN || u.contains('\0'))
        {
            return Err(bad(
                "user",
                format!("must be 1 to {MAX_USER_LEN} bytes without NUL"),
            ));
        }
        if let Some(w) = &self.workdir
            && (!w.starts_with('/') || w.len() > MAX_WORKDIR_LEN || w.contains('\0'))
        {
            return Err(bad(
                "workdir",
                format!("must be an absolute path of at most {MAX_WORKDIR_LEN} bytes"),
            ));
        }
        if self.stdin.len() > MAX_STDIN_LEN {
            return Err(bad(
                "stdin",
                format!("{} bytes, at most {MAX_STDIN_LEN}", self.stdin.len()),
            ));
        }
        if self.mounts.len() > MAX_MOUNTS {
            return Err(bad(
                "mounts",
                format!("{} mounts, at most {MAX_MOUNTS}", self.mounts.len()),
            ));
        }
        // A read-only disk's serial is lower<N>, a cache disk's cache<N> (N: 1 to 3 digits).
        let numbered = |serial: &str, prefix: &str| {
            serial.strip_prefix(prefix).is_some_and(|n| {
                !n.is_empty() && n.len() <= 3 && n.bytes().all(|b| b.is_ascii_digit())
            })
        };
        if let Some((serial, want)) = self.mounts.iter().find_map(|m| match &m.kind {
            ExecMountKind::Disk { serial, .. } if !numbered(serial, "lower") => {
                Some((serial, "lower<N>"))
            }
            ExecMountKind::Cache { serial, .. } if !numbered(serial, "cache") => {
                Some((serial, "cache<N>"))
            }
            _ => None,
        }) {
            return Err(bad(
                "mounts",
                format!("disk serial {:?} is not {want}", truncate(serial, 64)),
            ));
        }
        if let Some(m) = self.mounts.iter().find(|m| !ExecMount::rel_ok(&m.rel)) {
            return Err(bad(
                "mounts",
                format!(
                    "{:?} is not a relative path of plain names",
                    truncate(&m.rel, 64)
                ),
            ));
        }
        let secret_bytes: usize = self
            .mounts
            .iter()
            .map(|m| match &m.kind {
                ExecMountKind::Secret { data, .. } => data.len(),
                ExecMountKind::Tmpfs { .. }
                | ExecMountKind::Disk { .. }
                | ExecMountKind::Cache { .. } => 0,
            })
            .sum();
        let bytes: usize = self.files.iter().map(|f| f.data.len()).sum::<usize>() + secret_bytes;
        if self.files.len() > MAX_FILES || bytes > MAX_FILES_BYTES {
            return Err(bad(
                "files",
                format!(
                    "{} files and {bytes} bytes of files and secrets, at most {MAX_FILES} and {MAX_FILES_BYTES}",
                    self.files.len()
                ),
            ));
        }
        if let Some(f) = self.files.iter().find(|f| !ExecFile::path_ok(&f.path)) {
            return Err(bad(
                "files",
                format!(
                    "{:?} is not a plain name under {PIPES_DIR}",
                    truncate(&f.path, 64)
                ),
            ));
        }
        Ok(())
    }
}

impl Output {
    /// Check that `data` holds 1 to [`MAX_CHUNK_LEN`] bytes.
    ///
    /// Errors: [`DecodeError::BadField`].
    pub fn check(&self) -> Result<(), DecodeError> {
        check_chunk(&self.data)
    }
}

/// Check that a chunk holds 1 to [`MAX_CHUNK_LEN`] bytes.
pub(super) fn check_chunk(data: &[u8]) -> Result<(), DecodeError> {
    if data.is_empty() || data.len() > MAX_CHUNK_LEN {
        return Err(bad(
            "data",
            format!("{} bytes, must be 1 to {MAX_CHUNK_LEN}", data.len()),
        ));
    }
    Ok(())
}

impl ExecExit {
    /// Check that exactly one of `code` (0 to 255), `signal` (1 to 64) and `failure` is set.
    ///
    /// Errors: [`DecodeError::BadField`].
    pub fn check(&self) -> Result<(), DecodeError> {
        let set = [
            self.code.is_some(),
            self.signal.is_some(),
            self.failure.is_some(),
        ];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err(bad(
                "code",
                "exactly one of code, signal and failure must be set".into(),
            ));
        }
        if let Some(c) = self.code
            && !(0..=255).contains(&c)
        {
            return Err(bad("code", format!("{c}, must be 0 to 255")));
        }
        if let Some(s) = self.signal
            && !(1..=64).contains(&s)
        {
            return Err(bad("signal", format!("{s}, must be 1 to 64")));
        }
        Ok(())
    }
}
