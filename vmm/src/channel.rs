//! The host end of the guest protocol (BRIEF "The guest protocol"; the guest end is the
//! `kiln-guest` crate's init).
//!
//! Transport: QEMU's virtio-serial port `org.kiln.guest.0`, whose chardev is a unix socket
//! QEMU listens on; the host connects. Frame: u32 big-endian length N (1 ≤ N ≤
//! [`MAX_FRAME`]), then N bytes of one JSON object with `"v": 1` and `"type"`. Fields not
//! known here are ignored; a frame of an unknown type is returned as [`GuestMsg::Other`] so
//! the caller decides.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Largest frame body, bytes (1 MiB, as the protocol says).
pub const MAX_FRAME: usize = 1 << 20;
/// The protocol version spoken.
pub const VERSION: u64 = 1;
/// The virtio-serial port name the guest looks for.
pub const PORT_NAME: &str = "org.kiln.guest.0";

/// Errors of the guest channel.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Connecting to QEMU's chardev socket failed before the timeout.
    #[error("guest channel {path}: cannot connect: {source}")]
    Connect {
        /// The socket.
        path: String,
        /// The last error.
        source: std::io::Error,
    },
    /// Reading or writing failed.
    #[error("guest channel: {0}")]
    Io(#[from] std::io::Error),
    /// The socket closed (QEMU exited).
    #[error("guest channel closed while waiting for {0}")]
    Closed(String),
    /// Nothing within the bound.
    #[error("guest channel: no {what} within {ms} ms")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The bound, ms.
        ms: u128,
    },
    /// A frame of length 0 or over [`MAX_FRAME`], not JSON, or of another version.
    #[error("guest channel protocol: {0}")]
    Protocol(String),
}

/// The readiness check sent in `start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyCheck {
    /// argv of the check; exit 0 = ready.
    pub argv: Vec<String>,
    /// Interval between checks, ms.
    pub interval_ms: u64,
    /// Timeout of one check, ms.
    pub timeout_ms: u64,
    /// Failures tolerated before `failed`.
    pub retries: u32,
}

/// A message, either way. Serialized with `"v": 1` and `"type"` (snake_case of the variant).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GuestMsg {
    /// guest → host: the init runs.
    Hello {
        /// The init's version.
        #[serde(default)]
        init_version: String,
    },
    /// host → guest: what to run and how to know it is ready.
    Start {
        /// Start command argv (empty: no start command).
        argv: Vec<String>,
        /// User to run it as (`None`: root).
        user: Option<String>,
        /// `KEY=value` environment.
        env: Vec<String>,
        /// Working directory (`None`: `/`).
        workdir: Option<String>,
        /// Ready check (`None`: ready once started).
        ready: Option<ReadyCheck>,
    },
    /// guest → host: the ready check passed.
    Ready {
        /// Time from `start` to ready, ms.
        #[serde(default)]
        elapsed_ms: u64,
    },
    /// guest → host: the ready check timed out or the start command died.
    Failed {
        /// Why.
        #[serde(default)]
        reason: String,
    },
    /// host → guest, after a restore: fresh entropy, time and environment.
    Restore {
        /// Base64 of at least 32 random bytes.
        entropy: String,
        /// Host time, ns since the Unix epoch.
        time_unix_ns: u64,
        /// `KEY=value` for processes started from now on.
        env: Vec<String>,
    },
    /// guest → host: restore applied.
    Restored {
        /// The new `/etc/machine-id`.
        #[serde(default)]
        machine_id: String,
        /// Hex of 16 bytes read from the reseeded RNG.
        #[serde(default)]
        random: String,
        /// The kernel's boot id (shared by clones).
        #[serde(default)]
        boot_id: String,
    },
    /// Liveness probe.
    Ping,
    /// Answer to `ping`.
    Pong,
    /// Either way: the other side's message was not understood.
    Error {
        /// Why.
        #[serde(default)]
        message: String,
    },
    /// A type this side does not know (kept raw).
    #[serde(skip)]
    Other(Value),
}

impl GuestMsg {
    /// The `type` string.
    pub fn kind(&self) -> &str {
        match self {
            GuestMsg::Hello { .. } => "hello",
            GuestMsg::Start { .. } => "start",
            GuestMsg::Ready { .. } => "ready",
            GuestMsg::Failed { .. } => "failed",
            GuestMsg::Restore { .. } => "restore",
            GuestMsg::Restored { .. } => "restored",
            GuestMsg::Ping => "ping",
            GuestMsg::Pong => "pong",
            GuestMsg::Error { .. } => "error",
            GuestMsg::Other(v) => v["type"].as_str().unwrap_or("?"),
        }
    }

    /// Encodes one frame (length prefix + JSON with `"v": 1`).
    pub fn encode(&self) -> Result<Vec<u8>, ChannelError> {
        let mut v = match self {
            GuestMsg::Other(v) => v.clone(),
            m => serde_json::to_value(m).map_err(|e| ChannelError::Protocol(e.to_string()))?,
        };
        v["v"] = VERSION.into();
        let body = serde_json::to_vec(&v).map_err(|e| ChannelError::Protocol(e.to_string()))?;
        if body.len() > MAX_FRAME {
            return Err(ChannelError::Protocol(format!(
                "a {}-byte message is over the {MAX_FRAME}-byte frame limit",
                body.len()
            )));
        }
        let mut out = (body.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decodes one frame body. Unknown types become [`GuestMsg::Other`]; a wrong `v` or a
    /// body that is not a JSON object is an error.
    pub fn decode(body: &[u8]) -> Result<Self, ChannelError> {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| ChannelError::Protocol(format!("frame is not JSON: {e}")))?;
        if !v.is_object() {
            return Err(ChannelError::Protocol("frame is not a JSON object".into()));
        }
        if v["v"].as_u64() != Some(VERSION) {
            return Err(ChannelError::Protocol(format!(
                "frame has protocol version {}, this host speaks {VERSION}",
                v["v"]
            )));
        }
        if !v["type"].is_string() {
            return Err(ChannelError::Protocol("frame has no type".into()));
        }
        match serde_json::from_value::<GuestMsg>(v.clone()) {
            Ok(m) => Ok(m),
            Err(e) => {
                let known = [
                    "hello", "start", "ready", "failed", "restore", "restored", "ping", "pong",
                    "error",
                ];
                if known.contains(&v["type"].as_str().unwrap_or("")) {
                    Err(ChannelError::Protocol(format!(
                        "bad {} message: {e}",
                        v["type"]
                    )))
                } else {
                    Ok(GuestMsg::Other(v))
                }
            }
        }
    }
}

/// A connected guest channel.
#[derive(Debug)]
pub struct GuestChannel {
    stream: UnixStream,
}

impl GuestChannel {
    /// Connects to QEMU's chardev socket at `path`, retrying until `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, ChannelError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match UnixStream::connect(path).await {
                Ok(stream) => return Ok(Self { stream }),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(ChannelError::Connect {
                        path: path.display().to_string(),
                        source: e,
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Wraps a connected stream.
    pub fn from_stream(stream: UnixStream) -> Self {
        Self { stream }
    }

    /// Sends one message.
    pub async fn send(&mut self, m: &GuestMsg) -> Result<(), ChannelError> {
        let frame = m.encode()?;
        self.stream.write_all(&frame).await?;
        Ok(())
    }

    /// Receives one message within `timeout` (`what` names it in errors).
    pub async fn recv(&mut self, what: &str, timeout: Duration) -> Result<GuestMsg, ChannelError> {
        let read = async {
            let mut len = [0u8; 4];
            self.read_exact(&mut len, what).await?;
            let n = u32::from_be_bytes(len) as usize;
            if n == 0 || n > MAX_FRAME {
                return Err(ChannelError::Protocol(format!(
                    "frame length {n} outside 1..={MAX_FRAME}"
                )));
            }
            let mut body = vec![0u8; n];
            self.read_exact(&mut body, what).await?;
            GuestMsg::decode(&body)
        };
        tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| ChannelError::Timeout {
                what: what.to_string(),
                ms: timeout.as_millis(),
            })?
    }

    /// Receives until a message other than `ping`/`pong`/unknown arrives (answering pings),
    /// all within `timeout`.
    pub async fn recv_significant(
        &mut self,
        what: &str,
        timeout: Duration,
    ) -> Result<GuestMsg, ChannelError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let m = self.recv(what, left).await.map_err(|e| match e {
                ChannelError::Timeout { what, .. } => ChannelError::Timeout {
                    what,
                    ms: timeout.as_millis(),
                },
                e => e,
            })?;
            match m {
                GuestMsg::Ping => self.send(&GuestMsg::Pong).await?,
                GuestMsg::Pong | GuestMsg::Other(_) => {}
                m => return Ok(m),
            }
        }
    }

    async fn read_exact(&mut self, buf: &mut [u8], what: &str) -> Result<(), ChannelError> {
        match self.stream.read_exact(buf).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(ChannelError::Closed(what.to_string()))
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_with_version_and_type() {
        let m = GuestMsg::Restore {
            entropy: "AAAA".into(),
            time_unix_ns: 1_700_000_000_000_000_000,
            env: vec!["A=1".into()],
        };
        let f = m.encode().unwrap();
        let n = u32::from_be_bytes(f[..4].try_into().unwrap()) as usize;
        assert_eq!(n, f.len() - 4);
        let v: Value = serde_json::from_slice(&f[4..]).unwrap();
        assert_eq!(v["v"], 1);
        assert_eq!(v["type"], "restore");
        assert_eq!(GuestMsg::decode(&f[4..]).unwrap(), m);
        let ping = GuestMsg::Ping.encode().unwrap();
        assert_eq!(&ping[4..], br#"{"type":"ping","v":1}"#);
    }

    #[test]
    fn unknown_types_fields_and_versions() {
        // Unknown fields are ignored.
        let m = GuestMsg::decode(br#"{"v":1,"type":"ready","elapsed_ms":5,"extra":true}"#);
        assert_eq!(m.unwrap(), GuestMsg::Ready { elapsed_ms: 5 });
        // An unknown type is kept, not an error.
        let m = GuestMsg::decode(br#"{"v":1,"type":"stats","x":1}"#).unwrap();
        assert_eq!(m.kind(), "stats");
        // Wrong version, no type, not an object, a known type with bad fields: errors.
        for bad in [
            &br#"{"v":2,"type":"ready"}"#[..],
            br#"{"v":1}"#,
            b"[1]",
            b"\xff",
            br#"{"v":1,"type":"restored","machine_id":5}"#,
        ] {
            assert!(
                matches!(GuestMsg::decode(bad), Err(ChannelError::Protocol(_))),
                "{bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn oversized_zero_and_truncated_frames_are_refused() {
        for frame in [
            ((MAX_FRAME as u32) + 1).to_be_bytes().to_vec(),
            0u32.to_be_bytes().to_vec(),
        ] {
            let (a, mut b) = UnixStream::pair().unwrap();
            b.write_all(&frame).await.unwrap();
            let mut ch = GuestChannel::from_stream(a);
            let r = ch.recv("hello", Duration::from_secs(5)).await;
            assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
        }
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&[0, 0, 0, 10, b'{']).await.unwrap();
        drop(b);
        let mut ch = GuestChannel::from_stream(a);
        let r = ch.recv("hello", Duration::from_secs(5)).await;
        assert!(matches!(r, Err(ChannelError::Closed(_))), "{r:?}");
    }

    #[tokio::test]
    async fn pings_are_answered_while_waiting() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut host = GuestChannel::from_stream(a);
        let mut guest = GuestChannel::from_stream(b);
        guest.send(&GuestMsg::Ping).await.unwrap();
        guest
            .send(&GuestMsg::Ready { elapsed_ms: 3 })
            .await
            .unwrap();
        let m = host
            .recv_significant("ready", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(m, GuestMsg::Ready { elapsed_ms: 3 });
        let pong = guest.recv("pong", Duration::from_secs(5)).await.unwrap();
        assert_eq!(pong, GuestMsg::Pong);
        let r = host.recv("nothing", Duration::from_millis(30)).await;
        assert!(matches!(r, Err(ChannelError::Timeout { .. })));
    }
}
