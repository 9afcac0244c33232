//! Commands in a running clone: the host end of the guest protocol's `exec`.
//!
//! How a second process reaches a clone's guest: a clone outlives the `kiln start` that made
//! it, and its QEMU keeps listening on the guest channel's chardev socket
//! `<state>/clones/<id>/guest.sock` (`server=on,wait=off`). QEMU serves one client at a
//! time and listens again when it leaves, so the socket is connectable again by any later
//! process: `kiln start` disconnects once the guest answered `restore`, and an
//! [`ExecSession`] connects. The guest init reads 0 bytes while no client is there and
//! carries on with the next client's bytes: it accepts a new host connection without
//! being told.
//!
//! An [`ExecSession`] is one such connection:
//! 1. It takes an exclusive `flock` on `<clone dir>/exec.lock` first, so a second session on
//!    the same clone (another `kiln exec`) waits for the first to end instead of queueing
//!    unseen behind QEMU's single client. Two `kiln exec` processes on one clone therefore
//!    take turns; several commands at once run over one session ([`ExecSession::start`]
//!    any number of times, then [`ExecSession::next_event`]).
//! 2. It connects and sends `connect {nonce}` (64 random bits); the guest kills the
//!    commands of earlier connections that were not detached and answers `connected
//!    {nonce}`. Bytes before that exact frame are the tail of an older conversation and are
//!    discarded (at most [`MAX_STALE_BYTES`]). The guest, for its part, drops whatever an
//!    older host left before the `connect` frame, even a frame cut in its middle.
//! 3. Each [`ExecSession::start`] sends one `exec` with a random id; the guest's `output`
//!    frames of that id must come with `seq` 0, 1, 2, … and end with one `exit` carrying the
//!    next number, else [`ExecError::Protocol`]. Frames of ids this session did not start
//!    (a detached command of an earlier connection) are ignored.
//!
//! Dropping the session closes the connection: the guest then kills every command it
//! started that was not asked to `detach`.
//!
//! The image's user and environment, the defaults of every exec, reach the guest in the
//! clone's `restore` ([`clone::ImageDefaults`], from the image's OCI config).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use kiln_guest::protocol::{
    self as proto, DecodeError, Exec, ExecExit, ExecFailure, ExecFailureKind, Message, Ping,
};

use crate::channel::{ChannelError, GuestChannel};
use crate::clone::{self, CloneError, CloneRecord};

pub use kiln_guest::protocol::{
    DISK_FILE_NAME, DiffData, DiffEnd, ExecFile, ExecMount, ExecMountKind, MAX_CHUNK_LEN,
    MAX_FILES, MAX_FILES_BYTES, MAX_MOUNTS, MAX_STDIN_LEN, PIPES_DIR, Stream,
};

/// Most bytes discarded before the guest's `connected` answer: one partial frame of an older
/// connection (at most [`proto::MAX_FRAME_LEN`] plus its header) and what QEMU had queued
/// behind it, with room to spare.
pub const MAX_STALE_BYTES: usize = 4 * proto::MAX_FRAME_LEN;

/// How long a session waits for the guest's `connected` by default (TCG guests are slow).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// Errors of exec sessions.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// No such clone, or its state is unreadable.
    #[error(transparent)]
    Clone(#[from] CloneError),
    /// The clone's QEMU is not running; with why, when kiln stopped it
    /// ([`CloneRecord::stopped_reason`]).
    #[error("clone {0} is not running{reason} (see `kiln ps`)", reason = .1.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    NotRunning(String, Option<String>),
    /// The clone's `exec.lock` could not be taken.
    #[error("locking {path}: {source}")]
    Lock {
        /// The lock file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The guest channel failed: connecting, I/O, a timeout, or a closed connection.
    #[error("clone {id}: {source}")]
    Channel {
        /// The clone.
        id: String,
        /// The channel's error.
        source: ChannelError,
    },
    /// Reading `/dev/urandom` (for a nonce or an exec id) failed.
    #[error("reading /dev/urandom: {0}")]
    Random(std::io::Error),
    /// The request breaks the protocol's bounds (too many or too long arguments, stdin
    /// too large...); nothing was sent.
    #[error("the command cannot be sent: {0}")]
    Request(DecodeError),
    /// The guest refused a frame (an init without `exec`, or a request it would not take).
    #[error("clone {id}: the guest refused the request: {message}")]
    Refused {
        /// The clone.
        id: String,
        /// The guest's `error` message.
        message: String,
    },
    /// The guest sent something the protocol does not allow (a frame out of sequence, a
    /// message that does not decode, a chunk over the bounds).
    #[error("clone {id}: protocol error from the guest: {reason}")]
    Protocol {
        /// The clone.
        id: String,
        /// What was wrong.
        reason: String,
    },
}

/// What to run: an [`Exec`] message without its id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecRequest {
    /// argv (no shell); `argv[0]` without `/` is looked up in the command's `PATH`.
    pub argv: Vec<String>,
    /// `KEY=value`, over the image's and `kiln start --env`'s environment.
    pub env: Vec<String>,
    /// User; `None`: the image's (its OCI config's `User`, else its start command's), root
    /// without one.
    pub user: Option<String>,
    /// Working directory; `None`: the user's home directory (`/` when it does not exist).
    pub workdir: Option<String>,
    /// Bytes for stdin (at most [`proto::MAX_STDIN_LEN`]); empty: `/dev/null`.
    pub stdin: Vec<u8>,
    /// Keep running when the session ends.
    pub detach: bool,
    /// Create the missing directories of `workdir`, owned by the user (build steps).
    pub make_workdir: bool,
    /// Files the guest writes under [`proto::PIPES_DIR`] before the command starts (a build
    /// step's heredocs); at most [`proto::MAX_FILES`], [`proto::MAX_FILES_BYTES`] in all.
    pub files: Vec<proto::ExecFile>,
    /// File systems the guest mounts before the command and unmounts after it (a build
    /// step's `RUN --mount=type=tmpfs|secret`); at most [`proto::MAX_MOUNTS`].
    pub mounts: Vec<proto::ExecMount>,
    /// Memory limit of the command's cgroup in the guest, bytes ([`proto::Exec::memory_max`]);
    /// `None`: the VM's memory only.
    pub memory_max: Option<u64>,
    /// Most tasks of the command's cgroup in the guest ([`proto::Exec::pids_max`]); `None`:
    /// no limit.
    pub pids_max: Option<u64>,
}

/// How an exec ended: the guest's `exit` frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecStatus {
    /// Exit status, when it exited.
    pub code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// The kernel's OOM killer ended it (or one of its processes).
    pub oom: bool,
    /// The guest stopped it when its pids limit refused a fork ([`ExecExit::pids_limit`]).
    pub pids_limit: bool,
    /// `/` in the guest was (almost) full when it ended ([`ExecExit::disk_full`]).
    pub disk_full: bool,
    /// It did not start, and why.
    pub failure: Option<ExecFailure>,
}

impl ExecStatus {
    fn from_exit(x: ExecExit) -> Self {
        Self {
            code: x.code,
            signal: x.signal,
            oom: x.oom,
            pids_limit: x.pids_limit,
            disk_full: x.disk_full,
            failure: x.failure,
        }
    }

    /// The exit code a shell (and `docker exec`) reports: the status; 128 + N for signal N;
    /// 127 for a command not found, 126 for one that cannot be run, 125 for a request the
    /// guest refused.
    pub fn exit_code(&self) -> i32 {
        match (&self.failure, self.code, self.signal) {
            (Some(f), _, _) => match f.kind {
                ExecFailureKind::NotFound => 127,
                ExecFailureKind::CannotRun => 126,
                ExecFailureKind::Refused | ExecFailureKind::Other => 125,
            },
            (None, Some(c), _) => c,
            (None, None, Some(s)) => 128 + s,
            // ExecExit::check allows no other shape.
            (None, None, None) => 125,
        }
    }
}

/// One event of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// A chunk of an exec's stdout or stderr, in the order the guest read them.
    Output {
        /// The exec ([`ExecSession::start`]'s id).
        id: u64,
        /// Which stream.
        stream: Stream,
        /// The bytes (1 to [`proto::MAX_CHUNK_LEN`]).
        data: Vec<u8>,
    },
    /// An exec ended; no more events of it follow.
    Exit {
        /// The exec.
        id: u64,
        /// How.
        status: ExecStatus,
    },
}

/// One connection to a running clone's guest; see the module doc.
#[derive(Debug)]
pub struct ExecSession {
    id: String,
    ch: GuestChannel,
    /// exec id → the `seq` its next frame must carry.
    running: HashMap<u64, u64>,
    /// Held for the session's life.
    _lock: Option<std::fs::File>,
}

/// Waits no longer than this for a frame once execs run (their commands may take any time).
const FOREVER: Duration = Duration::from_secs(100 * 365 * 86400);

fn random_u64() -> Result<u64, ExecError> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(ExecError::Random)?;
    Ok(u64::from_le_bytes(b))
}

impl ExecSession {
    /// Opens a session on the clone `id` recorded under `state_dir`
    /// ([`clone::default_state_dir`]), waiting `timeout` for the guest's answer once
    /// connected (the wait for another session's lock is not bounded).
    ///
    /// Errors: [`CloneError::NoSuchClone`] (in [`ExecError::Clone`]),
    /// [`ExecError::NotRunning`], [`ExecError::Lock`], [`ExecError::Channel`],
    /// [`ExecError::Protocol`].
    pub async fn open(state_dir: &Path, id: &str, timeout: Duration) -> Result<Self, ExecError> {
        let rec = clone::list(state_dir)?
            .into_iter()
            .find(|r| r.id == id)
            .ok_or_else(|| CloneError::NoSuchClone(id.to_string()))?;
        Self::open_record(&rec, timeout).await
    }

    /// [`ExecSession::open`] for a clone record in hand (from [`clone::start_clones`] or
    /// [`clone::list`]).
    pub async fn open_record(rec: &CloneRecord, timeout: Duration) -> Result<Self, ExecError> {
        if !rec.running() {
            return Err(ExecError::NotRunning(rec.id.clone(), rec.stopped_reason()));
        }
        let lock = lock(&rec.dir.join("exec.lock"), &rec.id).await?;
        let ch = GuestChannel::connect(&rec.dir.join("guest.sock"), timeout)
            .await
            .map_err(|source| ExecError::Channel {
                id: rec.id.clone(),
                source,
            })?;
        let mut s = Self::over(rec.id.clone(), ch, timeout).await?;
        s._lock = Some(lock);
        Ok(s)
    }

    /// A session over a connected channel `ch` (the clone's id names it in errors): the
    /// `connect` handshake of the module doc.
    pub async fn over(
        id: String,
        mut ch: GuestChannel,
        timeout: Duration,
    ) -> Result<Self, ExecError> {
        let nonce = random_u64()?;
        let chan = |source| ExecError::Channel {
            id: id.clone(),
            source,
        };
        ch.send(&Message::Connect(Ping { nonce }))
            .await
            .map_err(chan)?;
        let want =
            proto::encode(&Message::Connected(Ping { nonce })).map_err(ExecError::Request)?;
        match ch.sync_to(&want, MAX_STALE_BYTES, timeout).await {
            Ok(skipped) if skipped > 0 => {
                tracing::debug!(clone = %id, skipped, "discarded bytes of an older connection")
            }
            Ok(_) => {}
            Err(ChannelError::Protocol(reason)) => return Err(ExecError::Protocol { id, reason }),
            Err(e) => return Err(chan(e)),
        }
        Ok(Self {
            id,
            ch,
            running: HashMap::new(),
            _lock: None,
        })
    }

    /// Starts `req`; returns its exec id, which its [`ExecEvent`]s carry.
    ///
    /// Errors: [`ExecError::Request`] when it breaks the protocol's bounds (nothing is
    /// sent); [`ExecError::Channel`].
    pub async fn start(&mut self, req: &ExecRequest) -> Result<u64, ExecError> {
        let mut exec_id = random_u64()?;
        while self.running.contains_key(&exec_id) {
            exec_id = exec_id.wrapping_add(1);
        }
        let msg = Message::Exec(Exec {
            id: exec_id,
            argv: req.argv.clone(),
            env: req.env.clone(),
            user: req.user.clone(),
            workdir: req.workdir.clone(),
            stdin: req.stdin.clone(),
            detach: req.detach,
            make_workdir: req.make_workdir,
            files: req.files.clone(),
            mounts: req.mounts.clone(),
            memory_max: req.memory_max,
            pids_max: req.pids_max,
        });
        // Checked here so a bad request is the caller's error, not a channel one.
        proto::encode(&msg).map_err(ExecError::Request)?;
        self.ch
            .send(&msg)
            .await
            .map_err(|source| ExecError::Channel {
                id: self.id.clone(),
                source,
            })?;
        self.running.insert(exec_id, 0);
        Ok(exec_id)
    }

    /// How many started execs have not ended.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The next event of an exec this session started (waits as long as it takes).
    ///
    /// Errors: [`ExecError::Channel`] (a closed connection: the clone stopped, or its QEMU
    /// died), [`ExecError::Refused`], [`ExecError::Protocol`].
    pub async fn next_event(&mut self) -> Result<ExecEvent, ExecError> {
        loop {
            let m = self
                .ch
                .recv("the output or exit of a command", FOREVER)
                .await
                .map_err(|source| ExecError::Channel {
                    id: self.id.clone(),
                    source,
                })?;
            let protocol = |reason: String| ExecError::Protocol {
                id: self.id.clone(),
                reason,
            };
            match m {
                Ok(Message::Output(o)) => {
                    let Some(next) = self.running.get_mut(&o.id) else {
                        continue; // not ours: a detached command of an earlier connection
                    };
                    if o.seq != *next {
                        return Err(protocol(format!(
                            "exec {:016x}: output frame {} where {} was due",
                            o.id, o.seq, next
                        )));
                    }
                    *next += 1;
                    return Ok(ExecEvent::Output {
                        id: o.id,
                        stream: o.stream,
                        data: o.data,
                    });
                }
                Ok(Message::Exit(x)) => {
                    let Some(&next) = self.running.get(&x.id) else {
                        continue;
                    };
                    if x.seq != next {
                        return Err(protocol(format!(
                            "exec {:016x}: exit says {} output frames, {} arrived",
                            x.id, x.seq, next
                        )));
                    }
                    self.running.remove(&x.id);
                    return Ok(ExecEvent::Exit {
                        id: x.id,
                        status: ExecStatus::from_exit(x),
                    });
                }
                Ok(Message::Ping(p)) => {
                    self.ch
                        .send(&Message::Pong(p))
                        .await
                        .map_err(|source| ExecError::Channel {
                            id: self.id.clone(),
                            source,
                        })?
                }
                Ok(Message::Error(e)) => {
                    return Err(ExecError::Refused {
                        id: self.id.clone(),
                        message: e.message,
                    });
                }
                // Liveness, the hello after connected, and what an older connection left.
                Ok(_) | Err(DecodeError::UnknownType(_)) => {}
                Err(e) => return Err(protocol(e.to_string())),
            }
        }
    }
}

impl ExecSession {
    /// Asks a step VM (booted with `kiln.step=`) for its changes (`diff`) and writes the tar
    /// stream it sends to `out`, at most `max_bytes` bytes. Returns the bytes written. The
    /// guest's `diff_data` frames must come with `seq` 0, 1, 2, … and end with one
    /// `diff_end` carrying the next number and the byte count, without an error.
    ///
    /// Errors: [`ExecError::Protocol`] for a frame out of sequence, a stream over
    /// `max_bytes`, a count that does not match or an `error` the guest reports;
    /// [`ExecError::Channel`] (timeouts included: `within` bounds each frame's wait);
    /// [`ExecError::Refused`].
    pub async fn diff(
        &mut self,
        out: &mut (dyn std::io::Write + Send),
        max_bytes: u64,
        within: Duration,
    ) -> Result<u64, ExecError> {
        let chan = |id: &str, source| ExecError::Channel {
            id: id.to_string(),
            source,
        };
        self.ch
            .send(&Message::Diff(proto::DiffRequest {}))
            .await
            .map_err(|e| chan(&self.id, e))?;
        let mut seq = 0u64;
        let mut bytes = 0u64;
        loop {
            let m = self
                .ch
                .recv("the step's changes", within)
                .await
                .map_err(|e| chan(&self.id, e))?;
            let protocol = |reason: String| ExecError::Protocol {
                id: self.id.clone(),
                reason,
            };
            match m {
                Ok(Message::DiffData(d)) => {
                    if d.seq != seq {
                        return Err(protocol(format!(
                            "diff frame {} where {seq} was due",
                            d.seq
                        )));
                    }
                    seq += 1;
                    bytes += d.data.len() as u64;
                    if bytes > max_bytes {
                        return Err(protocol(format!(
                            "the step's changes exceed {max_bytes} bytes"
                        )));
                    }
                    out.write_all(&d.data)
                        .map_err(|e| chan(&self.id, ChannelError::Io(e)))?;
                }
                Ok(Message::DiffEnd(end)) => {
                    if let Some(e) = end.error {
                        return Err(protocol(format!(
                            "the guest could not send its changes: {e}"
                        )));
                    }
                    if end.seq != seq || end.bytes != bytes {
                        return Err(protocol(format!(
                            "diff_end says {} frames and {} bytes, {seq} and {bytes} arrived",
                            end.seq, end.bytes
                        )));
                    }
                    return Ok(bytes);
                }
                Ok(Message::Ping(p)) => self
                    .ch
                    .send(&Message::Pong(p))
                    .await
                    .map_err(|e| chan(&self.id, e))?,
                Ok(Message::Error(e)) => {
                    return Err(ExecError::Refused {
                        id: self.id.clone(),
                        message: e.message,
                    });
                }
                // Output and exits of earlier execs, liveness.
                Ok(_) | Err(DecodeError::UnknownType(_)) => {}
                Err(e) => return Err(protocol(e.to_string())),
            }
        }
    }
}

/// Runs one command in the clone `id` (recorded under `state_dir`) and waits for its end,
/// handing each output chunk to `sink` as it arrives. The library form of `kiln exec`.
///
/// Errors: as [`ExecSession::open`], [`ExecSession::start`] and
/// [`ExecSession::next_event`].
pub async fn exec(
    state_dir: &Path,
    id: &str,
    req: &ExecRequest,
    mut sink: impl FnMut(Stream, &[u8]),
) -> Result<ExecStatus, ExecError> {
    let mut s = ExecSession::open(state_dir, id, DEFAULT_CONNECT_TIMEOUT).await?;
    let exec_id = s.start(req).await?;
    loop {
        match s.next_event().await? {
            ExecEvent::Output { id, stream, data } if id == exec_id => sink(stream, &data),
            ExecEvent::Exit { id, status } if id == exec_id => return Ok(status),
            _ => {}
        }
    }
}

/// Takes an exclusive `flock` on `path` (created if missing) on a blocking thread, warning
/// (tracing) when another session of the clone `id` holds it.
async fn lock(path: &Path, id: &str) -> Result<std::fs::File, ExecError> {
    let p = path.to_path_buf();
    let err = |source| ExecError::Lock {
        path: path.display().to_string(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(err)?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor this function owns; no memory is shared.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(f);
    }
    tracing::warn!("clone {id}: waiting for another exec session (kiln exec) to end");
    tokio::task::spawn_blocking(move || {
        // SAFETY: as above.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(f)
    })
    .await
    .map_err(|e| err(std::io::Error::other(e.to_string())))?
    .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_guest::protocol::{ExecExit, Output};
    use tokio::io::AsyncWriteExt;
    use tokio::net::UnixStream;

    /// A guest on the other end of a socket pair: answers `connect` (after `junk`), then
    /// returns the channel and the exec it receives.
    async fn session(junk: &[u8]) -> (ExecSession, GuestChannel, u64) {
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(junk).await.unwrap();
        let mut guest = GuestChannel::from_stream(b);
        let host = tokio::spawn(async move {
            let mut s = ExecSession::over(
                "c0".into(),
                GuestChannel::from_stream(a),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            let id = s
                .start(&ExecRequest {
                    argv: vec!["true".into()],
                    ..ExecRequest::default()
                })
                .await
                .unwrap();
            (s, id)
        });
        let Ok(Message::Connect(p)) = guest.recv("connect", Duration::from_secs(5)).await.unwrap()
        else {
            panic!("no connect")
        };
        guest.send(&Message::Connected(p)).await.unwrap();
        guest
            .send(&Message::Hello(proto::Hello {
                init_version: "0".into(),
            }))
            .await
            .unwrap();
        let Ok(Message::Exec(e)) = guest.recv("exec", Duration::from_secs(5)).await.unwrap() else {
            panic!("no exec")
        };
        let (s, id) = host.await.unwrap();
        assert_eq!(e.id, id);
        (s, guest, id)
    }

    fn output(id: u64, seq: u64, data: &[u8]) -> Message {
        Message::Output(Output {
            id,
            seq,
            stream: Stream::Stdout,
            data: data.to_vec(),
        })
    }

    #[tokio::test]
    async fn output_in_sequence_then_exit_and_foreign_ids_ignored() {
        let (mut s, mut g, id) = session(b"\x00\x00\x00\x09{\"v\":1,").await;
        g.send(&output(id ^ 1, 0, b"not ours")).await.unwrap();
        g.send(&output(id, 0, b"a")).await.unwrap();
        g.send(&Message::Output(Output {
            id,
            seq: 1,
            stream: Stream::Stderr,
            data: b"b".to_vec(),
        }))
        .await
        .unwrap();
        g.send(&Message::Exit(ExecExit {
            id,
            seq: 2,
            signal: Some(9),
            oom: true,
            ..ExecExit::default()
        }))
        .await
        .unwrap();
        assert_eq!(
            s.next_event().await.unwrap(),
            ExecEvent::Output {
                id,
                stream: Stream::Stdout,
                data: b"a".to_vec()
            }
        );
        assert!(matches!(
            s.next_event().await.unwrap(),
            ExecEvent::Output {
                stream: Stream::Stderr,
                ..
            }
        ));
        let ExecEvent::Exit { status, .. } = s.next_event().await.unwrap() else {
            panic!()
        };
        assert!(status.oom);
        assert_eq!(status.exit_code(), 137);
        assert_eq!(s.running(), 0);
    }

    #[tokio::test]
    async fn frames_out_of_sequence_or_over_bounds_are_refused() {
        let (mut s, mut g, id) = session(b"").await;
        g.send(&output(id, 1, b"skipped 0")).await.unwrap();
        assert!(matches!(
            s.next_event().await,
            Err(ExecError::Protocol { .. })
        ));

        let (mut s, mut g, id) = session(b"").await;
        g.send(&output(id, 0, b"x")).await.unwrap();
        g.send(&Message::Exit(ExecExit {
            id,
            seq: 0,
            code: Some(0),
            ..ExecExit::default()
        }))
        .await
        .unwrap();
        s.next_event().await.unwrap();
        assert!(matches!(
            s.next_event().await,
            Err(ExecError::Protocol { .. })
        ));

        // A chunk over MAX_CHUNK_LEN, written raw as a hostile guest would.
        let (mut s, mut g, id) = session(b"").await;
        use base64::Engine as _;
        let body = serde_json::to_vec(&serde_json::json!({
            "v": 1, "type": "output", "id": id, "seq": 0, "stream": "stdout",
            "data": base64::engine::general_purpose::STANDARD.encode(vec![0u8; proto::MAX_CHUNK_LEN + 1]),
        }))
        .unwrap();
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend(body);
        g.write_raw(&frame).await.unwrap();
        assert!(matches!(
            s.next_event().await,
            Err(ExecError::Protocol { .. })
        ));

        // The connection closing before the exit is a channel error (kiln exec's 125).
        let (mut s, g, _) = session(b"").await;
        drop(g);
        assert!(matches!(
            s.next_event().await,
            Err(ExecError::Channel {
                source: ChannelError::Closed(_),
                ..
            })
        ));
    }

    #[tokio::test]
    async fn requests_over_the_bounds_are_not_sent() {
        let (mut s, _g, _) = session(b"").await;
        let r = s
            .start(&ExecRequest {
                argv: vec!["cat".into()],
                stdin: vec![0; proto::MAX_STDIN_LEN + 1],
                ..ExecRequest::default()
            })
            .await;
        assert!(matches!(r, Err(ExecError::Request(_))), "{r:?}");
        let r = s.start(&ExecRequest::default()).await;
        assert!(matches!(r, Err(ExecError::Request(_))), "{r:?}");
    }

    fn data(seq: u64, d: &[u8]) -> Message {
        Message::DiffData(proto::DiffData {
            seq,
            data: d.to_vec(),
        })
    }

    fn end(seq: u64, bytes: u64, error: Option<&str>) -> Message {
        Message::DiffEnd(proto::DiffEnd {
            seq,
            bytes,
            error: error.map(str::to_string),
        })
    }

    /// A hostile step VM's `diff` answers, from a fault injector standing in for the guest.
    #[tokio::test]
    async fn diff_frames_out_of_sequence_over_the_bound_or_miscounted_are_refused() {
        let ms = Duration::from_secs(5);
        // In order: the bytes arrive, with frames of other execs ignored.
        let (mut s, mut g, id) = session(b"").await;
        g.send(&output(id ^ 1, 0, b"not ours")).await.unwrap();
        g.send(&data(0, b"ab")).await.unwrap();
        g.send(&data(1, b"c")).await.unwrap();
        g.send(&end(2, 3, None)).await.unwrap();
        let mut out = Vec::new();
        assert_eq!(s.diff(&mut out, 3, ms).await.unwrap(), 3);
        assert_eq!(out, b"abc");
        let Ok(Message::Diff(_)) = g.recv("diff", ms).await.unwrap() else {
            panic!("no diff request")
        };

        type Script = Vec<Message>;
        let cases: Vec<(&str, Script, u64)> = vec![
            ("skipped frame", vec![data(1, b"x")], 100),
            ("over the bound", vec![data(0, b"xy"), data(1, b"z")], 2),
            (
                "miscounted frames",
                vec![data(0, b"x"), end(2, 1, None)],
                100,
            ),
            (
                "miscounted bytes",
                vec![data(0, b"x"), end(1, 5, None)],
                100,
            ),
            ("guest error", vec![end(0, 0, Some("disk"))], 100),
        ];
        for (what, script, bound) in cases {
            let (mut s, mut g, _) = session(b"").await;
            for m in &script {
                g.send(m).await.unwrap();
            }
            let mut out = Vec::new();
            let r = s.diff(&mut out, bound, ms).await;
            assert!(
                matches!(r, Err(ExecError::Protocol { .. })),
                "{what}: {r:?}"
            );
        }

        // A chunk over MAX_CHUNK_LEN, written raw as a hostile guest would.
        let (mut s, mut g, _) = session(b"").await;
        use base64::Engine as _;
        let body = serde_json::to_vec(&serde_json::json!({
            "v": 1, "type": "diff_data", "seq": 0,
            "data": base64::engine::general_purpose::STANDARD.encode(vec![0u8; proto::MAX_CHUNK_LEN + 1]),
        }))
        .unwrap();
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend(body);
        g.write_raw(&frame).await.unwrap();
        let mut out = Vec::new();
        let r = s.diff(&mut out, u64::MAX, ms).await;
        assert!(matches!(r, Err(ExecError::Protocol { .. })), "{r:?}");
        assert!(out.is_empty());
    }

    #[test]
    fn exit_codes_follow_docker_exec() {
        let st = |code, signal, kind: Option<ExecFailureKind>| ExecStatus {
            code,
            signal,
            oom: false,
            pids_limit: false,
            disk_full: false,
            failure: kind.map(|kind| ExecFailure {
                kind,
                message: String::new(),
            }),
        };
        assert_eq!(st(Some(3), None, None).exit_code(), 3);
        assert_eq!(st(None, Some(15), None).exit_code(), 143);
        assert_eq!(
            st(None, None, Some(ExecFailureKind::NotFound)).exit_code(),
            127
        );
        assert_eq!(
            st(None, None, Some(ExecFailureKind::CannotRun)).exit_code(),
            126
        );
        assert_eq!(
            st(None, None, Some(ExecFailureKind::Refused)).exit_code(),
            125
        );
    }
}
