//! The egress channel of a build step's microVM: the guest's TCP connections to its proxy
//! port carried to the host's egress proxy over a second virtio-serial port,
//! [`PORT_NAME`], multiplexed. Both ends use this module: the guest init (threads, blocking
//! reads of the port) and `kiln_vmm::egress` (tokio).
//!
//! Why a port of its own and not messages of [`crate::protocol`]: that protocol is JSON
//! frames of one conversation (exec output, the step's changes), and a proxied download is
//! bulk binary data that must never stall it, nor be stalled by it. A second port is one more
//! chardev socket of the same `virtio-serial-device`; the microvm machine has no hotplug, so
//! it is there from the VM's start, in step VMs whose network is `default` or an allow-list
//! only. Snapshot VMs (boot-once, clones) never have it, so their device layout, part of the
//! snapshot compatibility key, is unchanged.
//!
//! # Frames
//!
//! `stream id: u32 BE | kind: u8 | length: u32 BE | payload (length bytes)`, [`HEADER_LEN`]
//! bytes of header. Kinds ([`Kind`]):
//! - `open` (empty): the guest accepted a connection; only the guest opens streams, with
//!   ids that only grow (an id is never reused, so a late frame of a finished stream can
//!   never be taken for a new one's);
//! - `data` (1 to [`MAX_PAYLOAD`] bytes): bytes of the stream in the sender's direction;
//! - `eof` (empty): the sender's direction is finished (a half-close, TCP's `FIN`);
//! - `close` (empty): the stream is aborted both ways;
//! - `window` (4 bytes, a u32 BE `n` > 0): the receiver drained `n` more bytes of the
//!   stream, so the sender may send `n` more.
//!
//! # Flow control
//!
//! Per stream and per direction, credit-based: a sender starts with [`INITIAL_WINDOW`] bytes
//! of credit and spends it on `data`; the receiver gives it back with `window` once the bytes
//! have left its buffer (written to the local socket). A receiver therefore buffers at most
//! [`INITIAL_WINDOW`] bytes per stream, [`MAX_STREAMS`] × [`INITIAL_WINDOW`] (16 MiB) in
//! all, and one connection whose reader stalls stops only its own stream: the port itself is
//! always read.
//!
//! # Hostile input
//!
//! Either end may be hostile (the guest runs a tenant's code). [`FrameDecoder`] refuses an
//! unknown kind or a length out of bounds for its kind: nothing after a bad header can be
//! trusted, so the whole channel is dropped (the host closes its socket; the guest, which
//! cannot close a port, ends every stream and starts decoding afresh). [`Table`] keeps the
//! per-stream rules, and a breach closes the offending stream only: `data` past the window
//! or after the sender's `eof`, a second `eof`, an `open` by the host, of an id not above
//! every earlier one, or past [`MAX_STREAMS`]; and, checked by each end's sending credit, a
//! `window` that gives back more than was sent (credit past [`MAX_CREDIT`]). Frames of ids
//! that are not open are ignored (they may be the tail of a stream this end has just
//! closed).

use std::collections::HashMap;

/// The name of the egress virtio-serial port.
pub const PORT_NAME: &str = "org.kiln.egress.0";
/// The guest's proxy port on its loopback, `127.0.0.1:3128`: the same value as
/// `kiln_builder::egress::PROXY_PORT` (this crate cannot import the builder; a test of
/// `kiln-pipeline` asserts they are equal), so a step sees the same proxy variables under
/// either executor.
pub const PROXY_PORT: u16 = 3128;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 9;
/// Largest `data` payload, bytes (64 KiB).
pub const MAX_PAYLOAD: usize = 64 << 10;
/// Credit of each direction of a new stream, bytes (256 KiB).
pub const INITIAL_WINDOW: u32 = 256 << 10;
/// Most streams open at once: the egress proxy's `MAX_CONNECTIONS`.
pub const MAX_STREAMS: usize = 64;

/// What a frame says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A new stream (guest to host).
    Open = 1,
    /// Bytes.
    Data = 2,
    /// The sender's direction is finished.
    Eof = 3,
    /// The stream is aborted.
    Close = 4,
    /// Credit given back.
    Window = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Open,
            2 => Kind::Data,
            3 => Kind::Eof,
            4 => Kind::Close,
            5 => Kind::Window,
            _ => return None,
        })
    }

    /// Whether `len` is a valid payload length of this kind.
    fn valid_len(self, len: usize) -> bool {
        match self {
            Kind::Open | Kind::Eof | Kind::Close => len == 0,
            Kind::Data => (1..=MAX_PAYLOAD).contains(&len),
            Kind::Window => len == 4,
        }
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The stream.
    pub stream: u32,
    /// What it says.
    pub kind: Kind,
    /// Its payload (`data` bytes, `window`'s 4 bytes, else empty).
    pub payload: Vec<u8>,
}

impl Frame {
    /// An `open`, `eof` or `close` frame.
    pub fn bare(stream: u32, kind: Kind) -> Frame {
        Frame {
            stream,
            kind,
            payload: Vec::new(),
        }
    }

    /// A `data` frame (`bytes`: 1 to [`MAX_PAYLOAD`] bytes).
    pub fn data(stream: u32, bytes: Vec<u8>) -> Frame {
        debug_assert!(Kind::Data.valid_len(bytes.len()));
        Frame {
            stream,
            kind: Kind::Data,
            payload: bytes,
        }
    }

    /// A `window` frame giving back `n` bytes of credit.
    pub fn window(stream: u32, n: u32) -> Frame {
        Frame {
            stream,
            kind: Kind::Window,
            payload: n.to_be_bytes().to_vec(),
        }
    }

    /// `window`'s credit (0 for other kinds).
    pub fn credit(&self) -> u32 {
        match (self.kind, <[u8; 4]>::try_from(&self.payload[..])) {
            (Kind::Window, Ok(b)) => u32::from_be_bytes(b),
            _ => 0,
        }
    }

    /// The frame's bytes, header and payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        out.extend_from_slice(&self.stream.to_be_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&(self.payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.payload);
        out
    }
}

/// Why the channel is dropped: its framing cannot be trusted any more.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A kind this protocol does not have.
    #[error("egress frame of unknown kind {kind} (stream {stream})")]
    UnknownKind {
        /// The stream.
        stream: u32,
        /// The kind byte.
        kind: u8,
    },
    /// A length out of bounds for the frame's kind.
    #[error("egress {kind:?} frame of {len} bytes (stream {stream})")]
    BadLength {
        /// The stream.
        stream: u32,
        /// The kind.
        kind: Kind,
        /// The length it claimed.
        len: u32,
    },
}

/// Reassembles frames from the bytes read off the port; holds at most one header and one
/// payload of [`MAX_PAYLOAD`] bytes beyond what was pushed and not yet taken.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
}

impl FrameDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read from the port. Callers push at most one read buffer at a time
    /// and then take every frame ([`FrameDecoder::next_frame`]) before pushing more.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that are not yet a whole frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame, `None` when more bytes are needed.
    ///
    /// Errors: [`FrameError`] (the channel must be dropped).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let stream = u32::from_be_bytes(self.buf[0..4].try_into().expect("4 bytes"));
        let kind_byte = self.buf[4];
        let len = u32::from_be_bytes(self.buf[5..9].try_into().expect("4 bytes"));
        let kind = Kind::from_u8(kind_byte).ok_or(FrameError::UnknownKind {
            stream,
            kind: kind_byte,
        })?;
        if !kind.valid_len(len as usize) {
            return Err(FrameError::BadLength { stream, kind, len });
        }
        let end = HEADER_LEN + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let payload = self.buf[HEADER_LEN..end].to_vec();
        self.buf.drain(..end);
        Ok(Some(Frame {
            stream,
            kind,
            payload,
        }))
    }
}

/// Which end of the channel a [`Table`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The guest: opens streams, never accepts an `open`.
    Guest,
    /// The host: accepts `open`s.
    Host,
}

/// What to do with a frame that arrived, per [`Table::incoming`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A new stream (host only): start serving it.
    Open,
    /// Deliver these bytes to the stream's local end.
    Data(Vec<u8>),
    /// The peer's direction is finished: shut down writing to the local end once what was
    /// delivered is written. `finished`: both directions are done, the stream is forgotten.
    Eof {
        /// Both directions are done.
        finished: bool,
    },
    /// The peer aborted the stream; it is forgotten: abort the local end.
    Closed,
    /// The peer gave back credit: add it to the stream's sending credit.
    Window(u32),
    /// The frame breached the stream's rules (named): the stream is forgotten; send
    /// `close` and abort the local end.
    Refuse(&'static str),
    /// A frame of a stream that is not open (one this end just closed, or a stranger):
    /// nothing to do.
    Ignore,
}

#[derive(Debug)]
struct Entry {
    /// Bytes the peer may still send before a `window` of ours.
    recv_window: u32,
    /// The peer sent `eof`.
    got_eof: bool,
    /// This end sent `eof`.
    sent_eof: bool,
}

/// The per-stream rules of one end: which streams are open, each one's receive window and
/// half-closes. Sending credit is kept by the sender of each stream (its `window`s come from
/// [`Verdict::Window`]); the sender caps it (see [`MAX_CREDIT`]).
#[derive(Debug)]
pub struct Table {
    side: Side,
    streams: HashMap<u32, Entry>,
    /// The highest id opened so far (`None`: none yet).
    last_open: Option<u32>,
}

/// Most sending credit a stream may hold: its initial window. A peer whose `window`s add up
/// to more gave back what it was never sent ([`Verdict::Refuse`]).
pub const MAX_CREDIT: u64 = INITIAL_WINDOW as u64;

impl Table {
    /// An empty table of `side`.
    pub fn new(side: Side) -> Self {
        Table {
            side,
            streams: HashMap::new(),
            last_open: None,
        }
    }

    /// Streams open.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Whether no stream is open.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Whether `id` is open.
    pub fn contains(&self, id: u32) -> bool {
        self.streams.contains_key(&id)
    }

    /// The guest opens a stream: the id to send `open` with, `None` when [`MAX_STREAMS`] are
    /// open (wait for one to end) or every id was used.
    pub fn open(&mut self) -> Option<u32> {
        if self.streams.len() >= MAX_STREAMS {
            return None;
        }
        let id = match self.last_open {
            None => 0,
            Some(l) => l.checked_add(1)?,
        };
        self.last_open = Some(id);
        self.streams.insert(id, Entry::new());
        Some(id)
    }

    /// This end sent `eof` on `id`; true when the stream is finished and forgotten.
    pub fn sent_eof(&mut self, id: u32) -> bool {
        let Some(e) = self.streams.get_mut(&id) else {
            return false;
        };
        e.sent_eof = true;
        if e.got_eof {
            self.streams.remove(&id);
            return true;
        }
        false
    }

    /// This end aborted `id` (and sends `close`): forgets it. False when it was not open.
    pub fn close(&mut self, id: u32) -> bool {
        self.streams.remove(&id).is_some()
    }

    /// `n` bytes of `id` left this end's buffer: its receive window grows back by `n`; send
    /// a `window` of `n` when this returns true (the stream is still open).
    pub fn drained(&mut self, id: u32, n: u32) -> bool {
        match self.streams.get_mut(&id) {
            Some(e) => {
                e.recv_window = e.recv_window.saturating_add(n).min(INITIAL_WINDOW);
                true
            }
            None => false,
        }
    }

    /// Applies the peer's frame `f` to the table and says what to do with it.
    pub fn incoming(&mut self, f: Frame) -> Verdict {
        let id = f.stream;
        if f.kind == Kind::Open {
            if self.side == Side::Guest {
                // Only the guest opens; the id's stream, if any, is the offender's.
                self.streams.remove(&id);
                return Verdict::Refuse("an open from the host");
            }
            if self.last_open.is_some_and(|l| id <= l) {
                self.streams.remove(&id);
                return Verdict::Refuse("an open of an id not above the last one");
            }
            self.last_open = Some(id);
            if self.streams.len() >= MAX_STREAMS {
                return Verdict::Refuse("too many streams");
            }
            self.streams.insert(id, Entry::new());
            return Verdict::Open;
        }
        let Some(e) = self.streams.get_mut(&id) else {
            return Verdict::Ignore;
        };
        match f.kind {
            Kind::Open => unreachable!("handled above"),
            Kind::Data => {
                let n = f.payload.len() as u32;
                if e.got_eof {
                    self.streams.remove(&id);
                    return Verdict::Refuse("data after eof");
                }
                if n > e.recv_window {
                    self.streams.remove(&id);
                    return Verdict::Refuse("data past the window");
                }
                e.recv_window -= n;
                Verdict::Data(f.payload)
            }
            Kind::Eof => {
                if e.got_eof {
                    self.streams.remove(&id);
                    return Verdict::Refuse("a second eof");
                }
                e.got_eof = true;
                let finished = e.sent_eof;
                if finished {
                    self.streams.remove(&id);
                }
                Verdict::Eof { finished }
            }
            Kind::Close => {
                self.streams.remove(&id);
                Verdict::Closed
            }
            Kind::Window => Verdict::Window(f.credit()),
        }
    }
}

impl Entry {
    fn new() -> Self {
        Entry {
            recv_window: INITIAL_WINDOW,
            got_eof: false,
            sent_eof: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(bytes: &[u8]) -> Result<Vec<Frame>, FrameError> {
        let mut d = FrameDecoder::new();
        let mut out = Vec::new();
        // Byte by byte: frames split anywhere reassemble.
        for b in bytes {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame()? {
                out.push(f);
            }
        }
        assert_eq!(d.pending(), 0);
        Ok(out)
    }

    #[test]
    fn frames_round_trip_split_anywhere() {
        let frames = vec![
            Frame::bare(7, Kind::Open),
            Frame::data(7, b"GET / HTTP/1.1\r\n\r\n".to_vec()),
            Frame::data(7, vec![0xAB; MAX_PAYLOAD]),
            Frame::window(7, 65536),
            Frame::bare(7, Kind::Eof),
            Frame::bare(u32::MAX, Kind::Close),
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(|f| f.encode()).collect();
        assert_eq!(
            &frames[0].encode(),
            &[0, 0, 0, 7, 1, 0, 0, 0, 0],
            "header layout"
        );
        assert_eq!(decode_all(&bytes).unwrap(), frames);
        assert_eq!(frames[3].credit(), 65536);
        assert_eq!(frames[1].credit(), 0);
    }

    #[test]
    fn bad_headers_drop_the_channel_before_any_payload_is_buffered() {
        let header = |kind: u8, len: u32| {
            let mut h = 3u32.to_be_bytes().to_vec();
            h.push(kind);
            h.extend_from_slice(&len.to_be_bytes());
            h
        };
        let mut d = FrameDecoder::new();
        d.push(&header(9, 0));
        assert_eq!(
            d.next_frame(),
            Err(FrameError::UnknownKind { stream: 3, kind: 9 })
        );
        for (kind, len) in [
            (2u8, 0u32),
            (2, MAX_PAYLOAD as u32 + 1),
            (2, u32::MAX),
            (1, 1),
            (3, 4),
            (4, 100),
            (5, 3),
            (5, 8),
        ] {
            let mut d = FrameDecoder::new();
            // The header alone is refused: a huge length is never waited for.
            d.push(&header(kind, len));
            assert!(
                matches!(d.next_frame(), Err(FrameError::BadLength { .. })),
                "{kind} {len}"
            );
        }
    }

    #[test]
    fn streams_open_in_order_and_at_most_max_streams() {
        let mut host = Table::new(Side::Host);
        let mut guest = Table::new(Side::Guest);
        for i in 0..MAX_STREAMS as u32 {
            let id = guest.open().unwrap();
            assert_eq!(id, i);
            assert_eq!(host.incoming(Frame::bare(id, Kind::Open)), Verdict::Open);
        }
        assert_eq!(guest.open(), None, "the guest waits for a free slot");
        // A hostile guest opening more: refused, the others untouched.
        assert_eq!(
            host.incoming(Frame::bare(1000, Kind::Open)),
            Verdict::Refuse("too many streams")
        );
        assert_eq!(host.len(), MAX_STREAMS);
        // An id reused or going back: the offending stream is closed.
        assert_eq!(
            host.incoming(Frame::bare(5, Kind::Open)),
            Verdict::Refuse("an open of an id not above the last one")
        );
        assert!(!host.contains(5));
        assert_eq!(host.len(), MAX_STREAMS - 1);
        assert_eq!(host.incoming(Frame::bare(1001, Kind::Open)), Verdict::Open);
        // The host never opens.
        assert_eq!(
            guest.incoming(Frame::bare(3, Kind::Open)),
            Verdict::Refuse("an open from the host")
        );
        assert!(!guest.contains(3));
        assert!(guest.open().is_some(), "a slot is free again");
    }

    #[test]
    fn data_is_bounded_by_the_window_and_replenished_when_drained() {
        let mut host = Table::new(Side::Host);
        assert_eq!(host.incoming(Frame::bare(1, Kind::Open)), Verdict::Open);
        let chunk = vec![1u8; MAX_PAYLOAD];
        for _ in 0..(INITIAL_WINDOW as usize / MAX_PAYLOAD) {
            assert!(matches!(
                host.incoming(Frame::data(1, chunk.clone())),
                Verdict::Data(_)
            ));
        }
        // One byte past the window closes the stream.
        assert_eq!(
            host.incoming(Frame::data(1, vec![0])),
            Verdict::Refuse("data past the window")
        );
        assert!(!host.contains(1));
        // Later frames of it are ignored, not answered.
        assert_eq!(host.incoming(Frame::data(1, vec![0])), Verdict::Ignore);
        assert!(!host.drained(1, 10));

        assert_eq!(host.incoming(Frame::bare(2, Kind::Open)), Verdict::Open);
        for _ in 0..(INITIAL_WINDOW as usize / MAX_PAYLOAD) {
            host.incoming(Frame::data(2, chunk.clone()));
        }
        assert!(host.drained(2, MAX_PAYLOAD as u32));
        assert!(matches!(
            host.incoming(Frame::data(2, chunk.clone())),
            Verdict::Data(_)
        ));
        assert_eq!(
            host.incoming(Frame::data(2, vec![0])),
            Verdict::Refuse("data past the window")
        );
        // A window never grows past its initial size, whatever is claimed drained.
        assert_eq!(host.incoming(Frame::bare(3, Kind::Open)), Verdict::Open);
        host.drained(3, u32::MAX);
        for _ in 0..(INITIAL_WINDOW as usize / MAX_PAYLOAD) {
            host.incoming(Frame::data(3, chunk.clone()));
        }
        assert!(matches!(
            host.incoming(Frame::data(3, vec![0])),
            Verdict::Refuse(_)
        ));
    }

    #[test]
    fn half_closes_finish_a_stream_and_breaches_close_it() {
        let mut guest = Table::new(Side::Guest);
        let a = guest.open().unwrap();
        assert!(!guest.sent_eof(a));
        assert_eq!(
            guest.incoming(Frame::data(a, b"reply".to_vec())),
            Verdict::Data(b"reply".to_vec())
        );
        assert_eq!(
            guest.incoming(Frame::bare(a, Kind::Eof)),
            Verdict::Eof { finished: true }
        );
        assert!(!guest.contains(a));

        let b = guest.open().unwrap();
        assert_eq!(
            guest.incoming(Frame::bare(b, Kind::Eof)),
            Verdict::Eof { finished: false }
        );
        assert_eq!(
            guest.incoming(Frame::data(b, vec![1])),
            Verdict::Refuse("data after eof")
        );
        assert!(!guest.contains(b));

        let c = guest.open().unwrap();
        assert_eq!(guest.incoming(Frame::window(c, 10)), Verdict::Window(10));
        assert_eq!(guest.incoming(Frame::bare(c, Kind::Close)), Verdict::Closed);
        assert_eq!(guest.incoming(Frame::bare(c, Kind::Close)), Verdict::Ignore);
        assert!(guest.is_empty());

        let d = guest.open().unwrap();
        guest.incoming(Frame::bare(d, Kind::Eof));
        assert_eq!(
            guest.incoming(Frame::bare(d, Kind::Eof)),
            Verdict::Refuse("a second eof")
        );
        // Frames of ids never opened are ignored.
        assert_eq!(guest.incoming(Frame::data(99, vec![1])), Verdict::Ignore);
        assert_eq!(guest.incoming(Frame::window(99, 1)), Verdict::Ignore);
    }
}
