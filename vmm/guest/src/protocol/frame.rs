//! Framing of the host ⇄ guest protocol (the module doc of [`super`] gives the layout): a
//! big-endian u32 length, then that many bytes of JSON body. Reading checks the length before
//! it allocates or reads any body byte; [`FrameBuffer`] reassembles frames from arbitrary
//! chunks (the guest's non-blocking reads) and finds a `connect` after a cut frame.

use std::io::{self, Read, Write};

use super::{DecodeError, HEADER_LEN, MAX_FRAME_LEN, Message, encode_body};

/// Why a frame could not be read from a stream. After any of these the stream is out of step
/// (or closed) and the connection should be dropped.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// the frame announces {0} bytes; a frame body is 1 to 1048576 bytes
    #[error("the frame announces {0} bytes; a frame body is 1 to {MAX_FRAME_LEN} bytes")]
    BadLength(u64),
    /// the stream ended inside a frame
    #[error("the stream ended inside a frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes of the frame (header included) received.
        got: usize,
        /// Bytes the frame needs (header included).
        want: usize,
    },
    /// I/O error
    #[error("reading or writing a frame: {0}")]
    Io(#[from] io::Error),
}

/// One whole frame: header and body.
///
/// Errors: as [`encode_body`].
pub fn encode(msg: &Message) -> Result<Vec<u8>, DecodeError> {
    let body = encode_body(msg)?;
    let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
    // body.len() <= MAX_FRAME_LEN < u32::MAX, checked in encode_body.
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Check a frame header; returns the body length.
///
/// Errors: [`FrameError::BadLength`] for 0 or more than [`MAX_FRAME_LEN`].
pub fn body_len(header: [u8; HEADER_LEN]) -> Result<usize, FrameError> {
    let n = u32::from_be_bytes(header);
    if n == 0 || n as usize > MAX_FRAME_LEN {
        return Err(FrameError::BadLength(n.into()));
    }
    Ok(n as usize)
}

/// Read one frame's body from a blocking stream. `Ok(None)`: the stream ended cleanly between
/// frames.
///
/// Errors: [`FrameError`]; the length is checked before any body byte is read or allocated.
pub fn read_frame<R: Read>(r: &mut R) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; HEADER_LEN];
    let got = read_full(r, &mut header)?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(FrameError::Truncated {
            got,
            want: HEADER_LEN,
        });
    }
    let len = body_len(header)?;
    let mut body = vec![0u8; len];
    let got = read_full(r, &mut body)?;
    if got < len {
        return Err(FrameError::Truncated {
            got: HEADER_LEN + got,
            want: HEADER_LEN + len,
        });
    }
    Ok(Some(body))
}

/// Read until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Write one message as a frame and flush.
///
/// Errors: [`WriteError`]: the message is too large, or I/O.
pub fn write_message<W: Write>(w: &mut W, msg: &Message) -> Result<(), WriteError> {
    let frame = encode(msg)?;
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Why a message could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The message cannot be encoded.
    #[error(transparent)]
    Encode(#[from] DecodeError),
    /// I/O error.
    #[error("writing a frame: {0}")]
    Io(#[from] io::Error),
}

/// The bytes every `connect` frame body begins with ([`encode_body`] writes `v`, then
/// `type`). Inside any other valid frame they cannot appear: in a JSON string the quotes
/// would be escaped.
pub const CONNECT_PREFIX: &[u8] = br#"{"v":1,"type":"connect","#;

/// Incremental frame splitter for non-blocking readers (an async socket, a poll loop): push the
/// bytes as they arrive, take whole frame bodies out.
#[derive(Debug, Default)]
pub struct FrameBuffer {
    buf: Vec<u8>,
}

impl FrameBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Append received bytes, then drop everything before the first `connect` frame that
    /// starts anywhere but at the front (its body begins with [`CONNECT_PREFIX`]): what
    /// came before it belongs to an older host connection, possibly cut inside a frame whose
    /// announced length would otherwise swallow the new connection's frames. Returns the
    /// bytes dropped. Only the new bytes (and the few before them a prefix could start in)
    /// are searched.
    pub fn push_watching_connect(&mut self, bytes: &[u8]) -> usize {
        let old = self.buf.len();
        self.buf.extend_from_slice(bytes);
        let from = old
            .saturating_sub(CONNECT_PREFIX.len() - 1)
            .max(HEADER_LEN + 1);
        let Some(i) = self
            .buf
            .get(from..)
            .and_then(|tail| {
                tail.windows(CONNECT_PREFIX.len())
                    .position(|w| w == CONNECT_PREFIX)
            })
            .map(|p| from + p)
        else {
            return 0;
        };
        let start = i - HEADER_LEN;
        self.buf.drain(..start);
        start
    }

    /// Bytes held that do not make a whole frame yet.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame body, if one has arrived.
    ///
    /// Errors: [`FrameError::BadLength`] as soon as a bad header is seen (the buffer then
    /// never yields again: drop the connection). Memory held is bounded by
    /// [`MAX_FRAME_LEN`] + [`HEADER_LEN`] plus what one `push` adds.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        let Some(header) = self.buf.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let len = body_len(*header)?;
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let body = self.buf[HEADER_LEN..HEADER_LEN + len].to_vec();
        self.buf.drain(..HEADER_LEN + len);
        Ok(Some(body))
    }

    /// Call at end of stream: an error if a partial frame is left.
    ///
    /// Errors: [`FrameError::Truncated`].
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let want = match self.buf.first_chunk::<HEADER_LEN>() {
            Some(h) => HEADER_LEN + u32::from_be_bytes(*h) as usize,
            None => HEADER_LEN,
        };
        Err(FrameError::Truncated {
            got: self.buf.len(),
            want,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::all_messages;
    use super::super::*;

    #[test]
    fn every_message_round_trips_through_a_frame() {
        for msg in all_messages() {
            let frame = encode(&msg).unwrap();
            let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
            assert_eq!(len, frame.len() - 4);
            let body: serde_json::Value = serde_json::from_slice(&frame[4..]).unwrap();
            assert_eq!(body["v"], 1);
            assert_eq!(body["type"], msg.type_name());
            let back = read_frame(&mut &frame[..]).unwrap().unwrap();
            assert_eq!(decode_body(&back).unwrap(), msg);
        }
    }

    #[test]
    fn oversize_frame_is_refused_before_reading_its_body() {
        let mut frame = ((MAX_FRAME_LEN + 1) as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(b"{}");
        let err = read_frame(&mut &frame[..]).unwrap_err();
        assert!(matches!(err, FrameError::BadLength(n) if n == MAX_FRAME_LEN as u64 + 1));
        let huge = u32::MAX.to_be_bytes();
        assert!(matches!(
            read_frame(&mut &huge[..]),
            Err(FrameError::BadLength(_))
        ));
        let mut fb = FrameBuffer::new();
        fb.push(&huge);
        assert!(matches!(fb.next_frame(), Err(FrameError::BadLength(_))));
    }

    #[test]
    fn zero_length_frame_is_refused() {
        let zero = 0u32.to_be_bytes();
        assert!(matches!(
            read_frame(&mut &zero[..]),
            Err(FrameError::BadLength(0))
        ));
    }

    #[test]
    fn largest_frame_is_accepted_and_larger_message_is_not_encoded() {
        let pad = "x".repeat(MAX_FRAME_LEN - 64);
        let msg = Message::Error(ErrorMessage { message: pad });
        let frame = encode(&msg).unwrap();
        assert!(frame.len() - 4 <= MAX_FRAME_LEN);
        assert_eq!(
            decode_body(&read_frame(&mut &frame[..]).unwrap().unwrap()).unwrap(),
            msg
        );
        let msg = Message::Error(ErrorMessage {
            message: "x".repeat(MAX_FRAME_LEN),
        });
        assert!(matches!(encode(&msg), Err(DecodeError::TooLarge(_))));
    }

    #[test]
    fn truncated_frames_are_errors_and_clean_end_is_none() {
        assert!(read_frame(&mut &b""[..]).unwrap().is_none());
        assert!(matches!(
            read_frame(&mut &[0u8, 0][..]),
            Err(FrameError::Truncated { got: 2, want: 4 })
        ));
        let frame = encode(&Message::Ping(Ping { nonce: 1 })).unwrap();
        let cut = &frame[..frame.len() - 1];
        assert!(matches!(
            read_frame(&mut &cut[..]),
            Err(FrameError::Truncated { .. })
        ));
        let mut fb = FrameBuffer::new();
        fb.push(cut);
        assert!(fb.next_frame().unwrap().is_none());
        assert!(matches!(fb.finish(), Err(FrameError::Truncated { .. })));
    }

    #[test]
    fn frame_buffer_splits_byte_by_byte_input() {
        let mut stream = Vec::new();
        for msg in all_messages() {
            stream.extend(encode(&msg).unwrap());
        }
        let mut fb = FrameBuffer::new();
        let mut got = Vec::new();
        for b in &stream {
            fb.push(std::slice::from_ref(b));
            while let Some(body) = fb.next_frame().unwrap() {
                got.push(decode_body(&body).unwrap());
            }
        }
        fb.finish().unwrap();
        assert_eq!(got, all_messages());
    }

    #[test]
    fn a_connect_after_a_cut_frame_is_found() {
        let connect = encode(&Message::Connect(Ping { nonce: 3 })).unwrap();
        let exec = encode(&Message::Exec(Exec {
            id: 1,
            argv: vec![String::from_utf8(CONNECT_PREFIX.to_vec()).unwrap()],
            ..Exec::default()
        }))
        .unwrap();
        // An older connection's frame announcing 600000 bytes, cut after 100, then the new
        // connection's connect and exec (whose argv holds the prefix as text, escaped).
        let mut fb = FrameBuffer::new();
        let mut stale = 600_000u32.to_be_bytes().to_vec();
        stale.extend(vec![b'x'; 100]);
        assert_eq!(fb.push_watching_connect(&stale), 0);
        let mut new = connect.clone();
        new.extend(&exec);
        // Byte by byte, so the prefix straddles pushes.
        let mut dropped = 0;
        for b in &new {
            dropped += fb.push_watching_connect(std::slice::from_ref(b));
        }
        assert_eq!(dropped, stale.len());
        assert_eq!(
            decode_body(&fb.next_frame().unwrap().unwrap()).unwrap(),
            Message::Connect(Ping { nonce: 3 })
        );
        assert!(matches!(
            decode_body(&fb.next_frame().unwrap().unwrap()).unwrap(),
            Message::Exec(_)
        ));
        assert_eq!(fb.pending(), 0);
        // A connect at the front is left alone.
        let mut fb = FrameBuffer::new();
        assert_eq!(fb.push_watching_connect(&connect), 0);
        assert!(fb.next_frame().unwrap().is_some());
    }
}
