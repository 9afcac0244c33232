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
    /// Bytes read past the end of what [`GuestChannel::sync_to`] looked for, served first.
    pending: Vec<u8>,
}

impl GuestChannel {
    /// Connects to QEMU's chardev socket at `path`, retrying until `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, ChannelError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match UnixStream::connect(path).await {
                Ok(stream) => return Ok(Self::from_stream(stream)),
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
        Self {
            stream,
            pending: Vec::new(),
        }
    }

    /// Discards received bytes up to and including the first occurrence of `frame` (a whole
    /// encoded frame the peer is known to send next), all within `timeout`; returns how many
    /// bytes came before it. Puts the stream in step after a connection that may begin with
    /// the tail of an older conversation (see `kiln_guest::protocol`'s module doc).
    ///
    /// Errors: [`ChannelError::Protocol`] when more than `max_skip` bytes come first;
    /// [`ChannelError::Timeout`], [`ChannelError::Closed`], [`ChannelError::Io`].
    pub async fn sync_to(
        &mut self,
        frame: &[u8],
        max_skip: usize,
        timeout: Duration,
    ) -> Result<usize, ChannelError> {
        let what = "the answer to connect";
        let mut window = std::mem::take(&mut self.pending);
        let mut skipped = 0usize;
        let scan = async {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                if let Some(i) = window.windows(frame.len()).position(|w| w == frame) {
                    self.pending = window.split_off(i + frame.len());
                    return Ok(skipped + i);
                }
                // Keep only what could still begin the frame.
                let keep = frame.len().saturating_sub(1).min(window.len());
                let drop_n = window.len() - keep;
                skipped += drop_n;
                window.drain(..drop_n);
                if skipped > max_skip {
                    return Err(ChannelError::Protocol(format!(
                        "more than {max_skip} bytes arrived before {what}"
                    )));
                }
                let n = self.stream.read(&mut buf).await?;
                if n == 0 {
                    return Err(ChannelError::Closed(what.to_string()));
                }
                window.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(timeout, scan)
            .await
            .map_err(|_| ChannelError::Timeout {
                what: what.to_string(),
                ms: timeout.as_millis(),
            })?
    }

    /// Sends one message.
    pub async fn send(&mut self, m: &Message) -> Result<(), ChannelError> {
        let frame = proto::encode(m).map_err(|e| ChannelError::Protocol(e.to_string()))?;
        self.stream.write_all(&frame).await?;
        Ok(())
    }

    /// Writes bytes as they are, unframed: for tests that play a hostile peer.
    #[cfg(test)]
    pub(crate) async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), ChannelError> {
        self.stream.write_all(bytes).await?;
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
        let from_pending = buf.len().min(self.pending.len());
        buf[..from_pending].copy_from_slice(&self.pending[..from_pending]);
        self.pending.drain(..from_pending);
        let buf = &mut buf[from_pending..];
        if buf.is_empty() {
            return Ok(());
        }
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
    async fn sync_to_skips_stale_bytes_and_keeps_what_follows() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut host = GuestChannel::from_stream(a);
        let want = proto::encode(&Message::Connected(Ping { nonce: 42 })).unwrap();
        // The tail of an older conversation, cut inside a frame, then the answer, then a
        // frame of the new conversation, split across writes.
        let old = proto::encode(&Message::Connected(Ping { nonce: 41 })).unwrap();
        let next = proto::encode(&Message::Pong(Ping { nonce: 7 })).unwrap();
        let mut stream = b"\x00\x00\x01\x00{\"v\":1,\"ty".to_vec();
        stream.extend(&old);
        stream.extend(&want);
        stream.extend(&next);
        let y = stream.split_off(want.len() + 20);
        b.write_all(&stream).await.unwrap();
        let writer = tokio::spawn(async move {
            tokio::task::yield_now().await;
            b.write_all(&y).await.unwrap();
            b
        });
        let skipped = host
            .sync_to(&want, 4096, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(skipped, 14 + old.len());
        let m = host.recv("pong", Duration::from_secs(5)).await.unwrap();
        assert_eq!(m.unwrap(), Message::Pong(Ping { nonce: 7 }));
        drop(writer.await.unwrap());

        // Too much before it is refused, and so is a stream that ends first.
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut host = GuestChannel::from_stream(a);
        b.write_all(&vec![0u8; 10_000]).await.unwrap();
        let r = host.sync_to(&want, 4096, Duration::from_secs(5)).await;
        assert!(matches!(r, Err(ChannelError::Protocol(_))), "{r:?}");
        drop(b);
        let (a, b) = UnixStream::pair().unwrap();
        let mut host = GuestChannel::from_stream(a);
        drop(b);
        let r = host.sync_to(&want, 4096, Duration::from_secs(5)).await;
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
                settled_ms: 0,
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
