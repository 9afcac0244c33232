//! The host end of the guest protocol: async transport for [`kiln_guest::protocol`] messages.
//!
//! Transport: QEMU's virtio-serial port [`PORT_NAME`], whose chardev is a unix socket QEMU
//! listens on; the host connects. Frames and messages are `kiln_guest::protocol`'s (u32
//! big-endian length, 1 ≤ N ≤ 1 MiB, then one JSON object with `"v": 1` and `"type"`). A
//! frame of an unknown type is skipped by [`GuestChannel::recv_significant`]; a bad length
//! or a message that does not decode is a [`ChannelError::Protocol`].

use std::path::Path;
use std::time::Duration;

use kiln_guest::protocol::{self as proto, DecodeError};
pub use kiln_guest::protocol::{Message, PORT_NAME, ReadyCheck};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

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
    /// A bad frame length, or a message that does not decode.
    #[error("guest channel protocol: {0}")]
    Protocol(String),
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
    pub async fn send(&mut self, m: &Message) -> Result<(), ChannelError> {
        let frame = proto::encode(m).map_err(|e| ChannelError::Protocol(e.to_string()))?;
        self.stream.write_all(&frame).await?;
        Ok(())
    }

    /// Receives one frame within `timeout` and decodes it (`what` names it in errors).
    /// `Ok(Err(_))`: a whole frame arrived but is not a message this side knows.
    pub async fn recv(
        &mut self,
        what: &str,
        timeout: Duration,
    ) -> Result<Result<Message, DecodeError>, ChannelError> {
        let read = async {
            let mut header = [0u8; proto::HEADER_LEN];
            self.read_exact(&mut header, what).await?;
            let n = proto::body_len(header).map_err(|e| ChannelError::Protocol(e.to_string()))?;
            let mut body = vec![0u8; n];
            self.read_exact(&mut body, what).await?;
            Ok(proto::decode_body(&body))
        };
        tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| ChannelError::Timeout {
                what: what.to_string(),
                ms: timeout.as_millis(),
            })?
    }

    /// Receives until a message other than `ping`, `pong` or an unknown type arrives
    /// (answering pings), all within `timeout`. A known type that does not decode is a
    /// [`ChannelError::Protocol`].
    pub async fn recv_significant(
        &mut self,
        what: &str,
        timeout: Duration,
    ) -> Result<Message, ChannelError> {
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
                Ok(Message::Ping(p)) => self.send(&Message::Pong(p)).await?,
                Ok(Message::Pong(_)) | Err(DecodeError::UnknownType(_)) => {}
                Ok(m) => return Ok(m),
                Err(e) => return Err(ChannelError::Protocol(e.to_string())),
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
    use kiln_guest::protocol::{Ping, Ready};

    #[tokio::test]
    async fn oversized_zero_and_truncated_frames_are_refused() {
        for frame in [
            ((proto::MAX_FRAME_LEN as u32) + 1).to_be_bytes().to_vec(),
            0u32.to_be_bytes().to_vec(),
        ] {
            let (a, mut b) = UnixStream::pair().unwrap();
            b.write_all(&frame).await.unwrap();
            let mut ch = GuestChannel::from_stream(a);
            let r = ch.recv_significant("hello", Duration::from_secs(5)).await;
            assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
        }
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&[0, 0, 0, 10, b'{']).await.unwrap();
        drop(b);
        let mut ch = GuestChannel::from_stream(a);
        let r = ch.recv_significant("hello", Duration::from_secs(5)).await;
        assert!(matches!(r, Err(ChannelError::Closed(_))), "{r:?}");
    }

    #[tokio::test]
    async fn pings_and_unknown_types_are_skipped_bad_messages_are_not() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut host = GuestChannel::from_stream(a);
        let unknown = br#"{"v":1,"type":"stats","x":1}"#;
        b.write_all(&(unknown.len() as u32).to_be_bytes())
            .await
            .unwrap();
        b.write_all(unknown).await.unwrap();
        let mut guest = GuestChannel::from_stream(b);
        guest.send(&Message::Ping(Ping { nonce: 7 })).await.unwrap();
        guest
            .send(&Message::Ready(Ready {
                elapsed_ms: 3,
                attempts: 1,
            }))
            .await
            .unwrap();
        let m = host
            .recv_significant("ready", Duration::from_secs(5))
            .await
            .unwrap();
        assert!(matches!(m, Message::Ready(Ready { elapsed_ms: 3, .. })));
        let pong = guest.recv("pong", Duration::from_secs(5)).await.unwrap();
        assert_eq!(pong.unwrap(), Message::Pong(Ping { nonce: 7 }));
        let bad = br#"{"v":1,"type":"restored","machine_id":5}"#;
        guest
            .stream
            .write_all(&(bad.len() as u32).to_be_bytes())
            .await
            .unwrap();
        guest.stream.write_all(bad).await.unwrap();
        let r = host
            .recv_significant("restored", Duration::from_secs(5))
            .await;
        assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
        let r = host
            .recv_significant("nothing", Duration::from_millis(30))
            .await;
        assert!(
            matches!(r, Err(ChannelError::Timeout { ms: 30, .. })),
            "{r:?}"
        );
    }
}
