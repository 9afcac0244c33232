//! The layer's byte stream under its bounds: decompression, the framer that counts and
//! bounds the tar stream's bytes and reads GNU sparse maps from it, and the bounded stream
//! and entry data reader that other readers of layers (the ext4 flattener) share.

use super::*;

/// Counters shared between the reader stack and the apply loop.
#[derive(Default)]
pub(super) struct Counters {
    uncompressed: Cell<u64>,
    hit: Cell<Option<LimitKind>>,
    /// The map of the last GNU sparse entry the framer read whole, for
    /// [`BoundedStream::extents`].
    sparse: std::cell::RefCell<Option<SparseMap>>,
}

/// The map of one GNU sparse entry as the framer read it from the raw stream (GNU tar
/// manual, "Sparse Formats", "Old GNU Format").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SparseMap {
    /// Stream position of the entry's own header (`tar::Entry::raw_header_position`).
    header_pos: u64,
    /// The file's apparent size (the header's `realsize`), bytes.
    real_size: u64,
    /// (offset, length) of each piece of data, in stream order.
    segments: Vec<(u64, u64)>,
}

/// Follows the tar framing of the uncompressed stream (512-byte headers, data padded to
/// 512), to bound extension headers before `tar` buffers them and to read the maps of GNU
/// sparse entries (their extension headers included, bounded alike). Honours a PAX `size`
/// record for the next entry, as the `tar` reader does.
#[derive(Default)]
pub(super) struct Framer {
    header: Vec<u8>,
    skip: u64,
    /// Bytes fed so far (the stream position).
    pos: u64,
    /// Data of the PAX header being read, and how much of it remains.
    pax: Option<(Vec<u8>, u64)>,
    pending_size: Option<u64>,
    /// A GNU sparse entry whose extension headers are being read: its map so far, its data
    /// size (read after the extension headers) and the extension bytes read.
    sparse: Option<(SparseMap, u64, u64)>,
    /// The last sparse map read whole, for the counters.
    done: Option<SparseMap>,
}

pub(super) enum FrameFault {
    Metadata,
    Malformed,
}

/// Adds the non-empty pieces of a sparse header's slots to `m` (the `tar` crate's reading:
/// a slot whose offset or length field starts with a NUL is unused).
pub(super) fn add_slots(
    m: &mut SparseMap,
    slots: &[tar::GnuSparseHeader],
) -> Result<(), FrameFault> {
    for s in slots {
        if s.is_empty() {
            continue;
        }
        let off = s.offset().map_err(|_| FrameFault::Malformed)?;
        let len = s.length().map_err(|_| FrameFault::Malformed)?;
        m.segments.push((off, len));
    }
    Ok(())
}

pub(super) fn parse_octal_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        // base-256, big-endian in the remaining bytes
        let mut v: u64 = 0;
        for b in &field[1..] {
            v = v.checked_mul(256)?.checked_add(*b as u64)?;
        }
        return Some(v);
    }
    let t: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|c| *c == b' ' || *c == 0)
        .take_while(|c| *c != b' ' && *c != 0)
        .collect();
    if t.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(std::str::from_utf8(&t).ok()?, 8).ok()
}

/// The `size` a PAX header gives the next entry, read exactly as the `tar` crate (0.4.46,
/// `pax::pax_extensions_value`) reads it, so the framer and the reader agree on where every
/// header is: records split on newlines, each line's length field must be the line's length
/// plus one, the *first* `size` record wins and its value must parse whole as a `u64`; a
/// malformed record before it, or an unparsable value, means no size at all. (Reading records
/// by their length, or taking the last `size`, or trimming blanks, would make the framer
/// skip what the reader reads as headers: a sparse entry or a huge long name would hide
/// there.)
pub(super) fn pax_size(data: &[u8]) -> Option<u64> {
    for line in data.split(|b| *b == b'\n') {
        if line.is_empty() {
            return None;
        }
        let sp = line.iter().position(|c| *c == b' ')?;
        let len: usize = std::str::from_utf8(&line[..sp]).ok()?.parse().ok()?;
        if line.len() + 1 != len {
            return None;
        }
        let kv = &line[sp + 1..];
        let eq = kv.iter().position(|c| *c == b'=')?;
        if &kv[..eq] != b"size" {
            continue;
        }
        return std::str::from_utf8(&kv[eq + 1..]).ok()?.parse().ok();
    }
    None
}

/// Whether the `tar` crate treats a header's extension type (`x`, `g`, `L`, `K`) as one: only
/// with the POSIX `ustar\000` or the GNU `ustar  \0` magic; otherwise it is an ordinary
/// entry (which the applier then refuses as an unsupported type).
pub(super) fn recognized(h: &[u8]) -> bool {
    let (magic, version) = (&h[257..263], &h[263..265]);
    (magic == b"ustar\0" && version == b"00") || (magic == b"ustar " && version == b" \0")
}

impl Framer {
    fn feed(&mut self, data: &[u8]) -> Result<(), FrameFault> {
        self.pos += data.len() as u64;
        self.feed_inner(data)
    }

    fn feed_inner(&mut self, mut data: &[u8]) -> Result<(), FrameFault> {
        // Stream position just past `data`'s last byte (`feed` counted it).
        let end = self.pos;
        while !data.is_empty() {
            if self.skip > 0 {
                let n = (self.skip.min(data.len() as u64)) as usize;
                if let Some((buf, left)) = &mut self.pax {
                    let take = (*left).min(n as u64) as usize;
                    buf.extend_from_slice(&data[..take]);
                    *left -= take as u64;
                    if *left == 0 {
                        self.pending_size = pax_size(buf);
                        self.pax = None;
                    }
                }
                self.skip -= n as u64;
                data = &data[n..];
                continue;
            }
            let n = (512 - self.header.len()).min(data.len());
            self.header.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.header.len() < 512 {
                break;
            }
            let h = std::mem::take(&mut self.header);
            let header_pos = end - data.len() as u64 - 512;
            if let Some((mut map, size, ext)) = self.sparse.take() {
                // An extension header of a GNU sparse entry: 21 more slots.
                let ext = ext + 512;
                if ext > MAX_METADATA_BYTES {
                    return Err(FrameFault::Metadata);
                }
                let mut e = tar::GnuExtSparseHeader::new();
                e.as_mut_bytes().copy_from_slice(&h);
                add_slots(&mut map, e.sparse())?;
                if e.is_extended() {
                    self.sparse = Some((map, size, ext));
                } else {
                    self.done = Some(map);
                    self.skip = size.checked_add(511).ok_or(FrameFault::Malformed)? & !511;
                }
                continue;
            }
            if h.iter().all(|b| *b == 0) {
                continue;
            }
            let kind = h[156];
            let header_size = parse_octal_size(&h[124..136]).ok_or(FrameFault::Malformed)?;
            // As the tar reader: a PAX size applies to the next header that is not an
            // extension type (recognised or not), and only recognised `x`, `L`, `K`
            // headers are read as extension data (into memory: bounded here).
            let ext_type = matches!(kind, b'x' | b'g' | b'L' | b'K');
            let ext = ext_type && recognized(&h);
            let size = if ext_type {
                if ext && header_size > MAX_METADATA_BYTES {
                    return Err(FrameFault::Metadata);
                }
                header_size
            } else {
                self.pending_size.take().unwrap_or(header_size)
            };
            if !ext || kind == b'g' {
                // An entry of its own: the PAX header before it was used up.
                self.pending_size = None;
            }
            if kind == b'S' {
                // As the `tar` reader: a sparse entry needs a GNU header; its extension
                // headers follow it, then `size` bytes of data.
                let hdr = tar::Header::from_byte_slice(&h);
                let g = hdr.as_gnu().ok_or(FrameFault::Malformed)?;
                let mut map = SparseMap {
                    header_pos,
                    real_size: g.real_size().map_err(|_| FrameFault::Malformed)?,
                    segments: Vec::new(),
                };
                add_slots(&mut map, &g.sparse)?;
                if g.is_extended() {
                    self.sparse = Some((map, size, 0));
                } else {
                    self.done = Some(map);
                    self.skip = size.checked_add(511).ok_or(FrameFault::Malformed)? & !511;
                }
                continue;
            }
            if kind == b'x' && ext {
                self.pending_size = None;
                if size > 0 {
                    self.pax = Some((Vec::new(), size));
                }
            }
            self.skip = size.checked_add(511).ok_or(FrameFault::Malformed)? & !511;
        }
        Ok(())
    }
}

pub(super) struct CountOut<R> {
    inner: R,
    c: Rc<Counters>,
    limits: Limits,
    framer: Framer,
}

impl<R: Read> Read for CountOut<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        match self.framer.feed(&buf[..n]) {
            Ok(()) => {}
            Err(FrameFault::Metadata) => {
                self.c.hit.set(Some(LimitKind::MetadataBytes));
                return Err(io::Error::other("extension header too large"));
            }
            Err(FrameFault::Malformed) => {
                return Err(io::Error::other("malformed tar header size or sparse map"));
            }
        }
        if let Some(map) = self.framer.done.take() {
            *self.c.sparse.borrow_mut() = Some(map);
        }
        let total = self.c.uncompressed.get() + n as u64;
        self.c.uncompressed.set(total);
        let kind = if total > self.limits.max_total_bytes {
            Some(LimitKind::TotalBytes)
        } else {
            self.limits.stop()
        };
        if let Some(k) = kind {
            self.c.hit.set(Some(k));
            return Err(io::Error::other(format!("{k} limit exceeded")));
        }
        Ok(n)
    }
}

/// A layer's decompressed tar stream with the bounds of [`Limits`] enforced, for readers of
/// layers other than [`apply_layer`] (the ext4 flattener): the same compression sniffing,
/// byte, extension-header and time bounds and GNU-sparse refusal.
pub(crate) struct BoundedStream {
    counters: Rc<Counters>,
    limits: Limits,
    digest: String,
    compression: Compression,
}

/// Opens `layer` (gzip, zstd or plain) as a bounded tar stream. Errors: [`LayerError::Tar`]
/// when the compression header is unreadable.
pub(crate) fn bounded_stream<'a>(
    layer: impl Read + 'a,
    digest: &str,
    limits: &Limits,
) -> Result<(Box<dyn Read + 'a>, BoundedStream), LayerError> {
    bounded_stream_as(layer, None, digest, limits)
}

/// [`bounded_stream`] of a stream whose compression is known (`Some`: not sniffed, e.g. the
/// plain tar a compressed layer inflated to, whose first name could start like a gzip
/// member), or sniffed from its first bytes (`None`).
pub(crate) fn bounded_stream_as<'a>(
    layer: impl Read + 'a,
    compression: Option<Compression>,
    digest: &str,
    limits: &Limits,
) -> Result<(Box<dyn Read + 'a>, BoundedStream), LayerError> {
    let counters = Rc::new(Counters::default());
    let mut raw = BufReader::with_capacity(256 << 10, layer);
    let tar_err = |e: io::Error| LayerError::Tar {
        digest: digest.to_string(),
        entry: "(start)".into(),
        source: e,
    };
    let compression = match compression {
        Some(c) => c,
        None => Compression::sniff(raw.fill_buf().map_err(tar_err)?),
    };
    let decoded: Box<dyn Read + 'a> = compression.decoder(raw).map_err(tar_err)?;
    let counted = CountOut {
        inner: decoded,
        c: counters.clone(),
        limits: limits.clone(),
        framer: Framer::default(),
    };
    Ok((
        Box::new(counted),
        BoundedStream {
            counters,
            limits: limits.clone(),
            digest: digest.to_string(),
            compression,
        },
    ))
}

impl BoundedStream {
    /// Turns a read error of the stream into the [`LayerError`] it stands for (a bound hit,
    /// or a plain tar error at `entry`).
    pub(crate) fn error(&self, e: io::Error, entry: &str) -> LayerError {
        let digest = self.digest.clone();
        match self.counters.hit.get() {
            Some(LimitKind::Deadline) => LayerError::Deadline {
                digest,
                entry: entry.to_string(),
            },
            Some(LimitKind::Cancelled) => LayerError::Cancelled {
                digest,
                entry: entry.to_string(),
            },
            Some(kind) => LayerError::Limit {
                digest,
                entry: entry.to_string(),
                kind,
                max: match kind {
                    LimitKind::TotalBytes => self.limits.max_total_bytes,
                    LimitKind::Deadline | LimitKind::Cancelled => 0,
                    LimitKind::Entries => self.limits.max_entries,
                    LimitKind::FileBytes => self.limits.max_file_bytes,
                    LimitKind::MetadataBytes => MAX_METADATA_BYTES,
                },
            },
            None => LayerError::Tar {
                digest,
                entry: entry.to_string(),
                source: e,
            },
        }
    }

    /// The layer's compression (sniffed, or as given to [`bounded_stream_as`]).
    pub(crate) fn compression(&self) -> Compression {
        self.compression
    }

    /// Uncompressed bytes read so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.counters.uncompressed.get()
    }

    /// Where the data of a regular-file entry (`0`, `7` or GNU sparse `S`) of this stream
    /// goes in the file. For a sparse entry, the map the framer read with its header; for
    /// others, all of its size is one piece of data.
    ///
    /// Errors (`InvalidData`): a sparse entry whose map the framer did not read with this
    /// entry's header, or whose map disagrees with the `tar` reader's size.
    pub(crate) fn extents(&self, entry: &tar::Entry<'_, impl Read>) -> io::Result<Extents> {
        if !entry.header().entry_type().is_gnu_sparse() {
            return Ok(Extents {
                size: entry.size(),
                segments: vec![(0, entry.size())],
                sparse: false,
            });
        }
        match self.counters.sparse.borrow_mut().take() {
            Some(m)
                if m.header_pos == entry.raw_header_position() && m.real_size == entry.size() =>
            {
                Ok(Extents {
                    size: m.real_size,
                    segments: m.segments,
                    sparse: true,
                })
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "GNU sparse entry whose map was not read with its header",
            )),
        }
    }
}

/// Where a regular file's bytes go, as [`BoundedStream::extents`] reads it: its apparent
/// size and its pieces of data; everything else is a hole (zeros, no blocks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Extents {
    /// Apparent size, bytes.
    pub(crate) size: u64,
    /// (offset, length) in bytes of each piece of data, in file order, none overlapping
    /// (the `tar` reader refuses a map that is out of order or overlaps).
    pub(crate) segments: Vec<(u64, u64)>,
    /// Whether the entry was a sparse one (`S`).
    pub(crate) sparse: bool,
}

/// Reads an entry's data piece by piece as its [`Extents`] lay it out: the `tar` reader
/// makes a sparse entry's holes up as zeros between the pieces, and those are read past
/// (they never come from the stream, so they cost no stream bytes), never handed out.
pub(crate) struct DataReader<'e, R> {
    inner: R,
    /// Where the made-up zeros of holes are read to (64 KiB: it stays in the CPU's cache,
    /// so a 16 GiB hole costs well under a second).
    scratch: Vec<u8>,
    segments: &'e [(u64, u64)],
    /// Apparent offset of the next byte `inner` gives.
    at: u64,
    /// Index of the piece being read, and its bytes left.
    idx: usize,
    left: u64,
}

impl<'e, R: Read> DataReader<'e, R> {
    /// `inner`: the entry's data as the `tar` reader gives it (apparent bytes).
    pub(crate) fn new(inner: R, extents: &'e Extents) -> Self {
        DataReader {
            inner,
            scratch: Vec::new(),
            segments: &extents.segments,
            at: 0,
            idx: 0,
            left: extents.segments.first().map_or(0, |s| s.1),
        }
    }

    /// The next piece of data into `buf`: `Some((file offset, length))`, `None` at the end.
    /// Errors: the entry's read errors; `UnexpectedEof` when it ends before its map does.
    pub(crate) fn next_piece(&mut self, buf: &mut [u8]) -> io::Result<Option<(u64, usize)>> {
        loop {
            let Some(&(off, _)) = self.segments.get(self.idx) else {
                return Ok(None);
            };
            if self.left == 0 {
                self.idx += 1;
                self.left = self.segments.get(self.idx).map_or(0, |s| s.1);
                continue;
            }
            // The hole before the piece (zeros made up by the reader).
            if self.at < off && self.scratch.is_empty() {
                self.scratch = vec![0u8; 64 << 10];
            }
            while self.at < off {
                let want = (off - self.at).min(self.scratch.len() as u64) as usize;
                let n = self.inner.read(&mut self.scratch[..want])?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                self.at += n as u64;
            }
            let want = self.left.min(buf.len() as u64) as usize;
            let n = self.inner.read(&mut buf[..want])?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let at = self.at;
            self.at += n as u64;
            self.left -= n as u64;
            return Ok(Some((at, n)));
        }
    }
}

impl<R: Read> Read for DataReader<'_, R> {
    /// The data bytes only, in order (what a sparse entry stores after its map).
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(self.next_piece(buf)?.map_or(0, |(_, n)| n))
    }
}
