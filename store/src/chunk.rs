//! Chunks and chunk tables.
//!
//! A large artifact (ext4 image, memory file, disk overlay) is cut into chunks. Each chunk is
//! named by the sha256 of its raw (uncompressed) bytes ([`ChunkDigest`]) and stored at
//! `chunks/sha256/<hex>` as exactly one zstd frame compressed at [`ZSTD_LEVEL`]. A chunk whose
//! bytes are all zero is not stored: the table records a hole, and materializing leaves a hole
//! in the sparse output. Adjacent holes are merged into one entry.
//!
//! ## Chunking
//! - [`Chunking::Fixed`]: fixed-size, page-aligned chunks (a power of two, at least 4 KiB).
//!   Memory files use it ([`Chunking::MEMORY_DEFAULT`], 64 KiB: a guest page fault maps to
//!   one chunk by a shift, 16,384 objects per GiB of non-zero memory). A lazy clone fetches
//!   the whole chunk under each page it touches, so the chunk size rounds up what a start
//!   fetches: `ci/bench-clone.sh --store s3` (2026-12-06, TCG, cold from the local S3
//!   server) measured the guest RAM served before the clone answered at 14.4% (busybox,
//!   256 MiB) and 7.1% (Debian fixture, 512 MiB) with 256 KiB chunks, 9.1% and 4.5% with
//!   64 KiB; the pages the guest touched were 2.3% and 1.2%. Older snapshots keep the
//!   chunking their table records.
//! - [`Chunking::Cdc`]: content-defined chunking, FastCDC 2020 (Xia et al., "The Design of
//!   Fast Content-Defined Chunking for Data Deduplication Based Storage Systems", IEEE TPDS
//!   2020; the `fastcdc` crate's `v2020` module, normalization level 1, seed 0), for disk
//!   images ([`Chunking::DISK_DEFAULT`]: min/avg/max 16/64/256 KiB). DESIGN.md records that
//!   `mke2fs -d` shifts later files by whole blocks when one file is added, so fixed chunks
//!   above 4 KiB share almost nothing between two builds while CDC at 64 KiB average shared
//!   91% of chunks.
//! - CDC cuts around zero runs: whole zero 4 KiB blocks adding up to at least `min` bytes
//!   end the chunk before them and become holes, and chunking starts afresh after them. An
//!   ext4 image's metadata (bitmaps, inode tables, reserved GDT blocks) is mostly zero with
//!   a few live blocks, where a gear hash finds no cut: plain FastCDC made it `max`-sized
//!   chunks, so one changed inode made 256 KiB new. `kiln/tests/rebuild_dedup.rs` measured
//!   the share of a rebuild's new chunk bytes on an AMD EPYC host: 3.27% before (two
//!   256 KiB inode-table chunks), 1.61% after.
//!
//! ## Why FastCDC 16/64/256 KiB for disk images (measured 2026-11-30)
//! `ci/measure-chunking.sh` (tool: `store/examples/measure_chunking.rs`) builds two debootstrap
//! bookworm minbase trees, the second with one more package (`less`), makes deterministic
//! 1 GiB `mke2fs -d` images (4 KiB blocks, fixed UUID and hash seed, fake time) and chunks
//! both. "Reused" is the share of the second image's non-zero bytes whose chunk the first
//! image already has; "4K read" is the mean stored bytes fetched for a random 4 KiB miss;
//! "objects/GiB" is PUTs per GiB of non-zero data. Layouts: `dir` is `mke2fs -d TREE`;
//! `tar-layer` is a tarball with the first tree's entries in their old order and new entries
//! appended.
//!
//! | chunking | reused, `dir` | reused, `tar-layer` | 4K read (zstd) | objects/GiB |
//! | --- | ---: | ---: | ---: | ---: |
//! | fixed 4 KiB | 97.5% | 99.6% | 2.0 KiB | 262,144 |
//! | fixed 64 KiB | 4.8% | 99.0% | 28.3 KiB | 16,384 |
//! | fixed 1 MiB | 3.7% | 92.6% | 412 KiB | 1,024 |
//! | fixed 2 MiB | 3.6% | 87.3% | 798 KiB | 512 |
//! | FastCDC avg 16 KiB | 91.8% | 99.2% | 13.5 KiB | 48,758 |
//! | FastCDC avg 32 KiB | 88.4% | 98.6% | 24.6 KiB | 24,116 |
//! | FastCDC avg 64 KiB | 84.5% | 97.9% | 46.2 KiB | 11,999 |
//! | FastCDC avg 128 KiB | 78.0% | 96.4% | 92.5 KiB | 5,804 |
//!
//! Fixed chunks above 4 KiB reuse almost nothing once one file is inserted in walk order, and
//! do well only while no old block moves (moving the 10 changed files to the end drops fixed
//! 64 KiB to 64%); FastCDC stays at 78-99% in every layout, and with `nano` instead of `less`
//! (143 new paths) at 80% (`dir`) and 93.6% (`tar-layer`) for avg 64 KiB. avg 64 KiB costs
//! about 12,000 PUTs per GiB and a 46 KiB fetch plus 70-180 us of zstd per random miss, below
//! the cost of one GET to a remote store; avg 32 KiB buys 4 points of reuse for twice the
//! objects. Hence [`Chunking::DISK_DEFAULT`], and the builder should feed `mke2fs -d` a
//! layer-ordered tarball.
//!
//! ## Chunk table (stored inside manifests, JSON)
//! ```text
//! { "size": 3221225472,                      total raw bytes of the artifact
//!   "chunking": {"cdc": {"min":16384,"avg":65536,"max":262144}},
//!   "entries": [
//!     {"offset":0,      "rawLen":65536, "digest":"sha256:<hex>", "storedLen":812},
//!     {"offset":65536,  "rawLen":1048576},                 a hole: no digest, all zero
//!     ... ] }
//! ```
//! Entries are sorted, start at 0, each begins where the previous ends and the last ends at
//! `size` ([`ChunkTable::validate`] rejects gaps, overlaps, empty entries, chunks longer than
//! [`MAX_CHUNK_LEN`]). [`ChunkTable::find`] maps a byte offset to its entry by binary search,
//! O(log n).

use std::io::Read;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::digest::ChunkDigest;

/// zstd compression level for every chunk, pinned so that the stored bytes of a chunk do not
/// depend on the library's default. 3 is zstd's own default level (zstd manual,
/// `ZSTD_CLEVEL_DEFAULT`): about 300+ MB/s per core on this class of machine, and changing it
/// never changes a chunk's name (names hash raw bytes).
pub const ZSTD_LEVEL: i32 = 3;

/// Largest raw chunk accepted anywhere (bytes, 16 MiB). Bounds memory when reading hostile
/// tables and decompressing hostile frames.
pub const MAX_CHUNK_LEN: u64 = 16 << 20;

/// Largest stored (compressed) chunk object read, bytes: zstd's worst case for a
/// [`MAX_CHUNK_LEN`] input (`ZSTD_COMPRESSBOUND` in `zstd.h`: `n + n/256` plus under 128 KiB
/// for small inputs), with the 128 KiB margin added. A larger object under a chunk key is
/// planted or corrupt, and is refused before it is read into memory.
pub const MAX_STORED_CHUNK_LEN: u64 = MAX_CHUNK_LEN + (MAX_CHUNK_LEN >> 8) + (128 << 10);

/// Errors about chunks and chunk tables.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// A chunking configuration outside the allowed range.
    #[error("invalid chunking {0}")]
    InvalidChunking(String),
    /// A chunk table with a gap, overlap, bad length or wrong total size.
    #[error("invalid chunk table: {0}")]
    InvalidTable(String),
    /// A stored chunk that does not decompress (truncated, not zstd, too large).
    #[error("chunk {digest} in {store}: cannot decompress: {reason}")]
    Corrupt {
        /// The chunk.
        digest: ChunkDigest,
        /// The store it came from.
        store: String,
        /// What failed.
        reason: String,
    },
    /// A chunk whose decompressed bytes hash to something other than its name.
    #[error("chunk {digest} in {store}: decompressed bytes hash to {actual}")]
    DigestMismatch {
        /// The chunk.
        digest: ChunkDigest,
        /// The store it came from.
        store: String,
        /// What the bytes hash to.
        actual: ChunkDigest,
    },
    /// Reading the input artifact failed.
    #[error("reading input: {0}")]
    Io(#[from] std::io::Error),
    /// A chunk whose read failed a moment ago, not asked for again
    /// ([`crate::artifact::ArtifactReader::remembering_failures`]).
    #[error("chunk {digest}: its read failed {ago:.1?} ago, not tried again yet: {reason}")]
    FailedRecently {
        /// The chunk.
        digest: ChunkDigest,
        /// How long ago the read failed.
        ago: std::time::Duration,
        /// That read's error (it names the store).
        reason: String,
    },
}

/// How an artifact is cut into chunks. Recorded in its [`ChunkTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Chunking {
    /// Fixed-size chunks of `size` bytes (power of two, 4 KiB ..= 16 MiB); the last may be
    /// shorter.
    Fixed {
        /// Chunk size in bytes.
        size: u32,
    },
    /// FastCDC 2020 with these bounds in bytes (fastcdc v2020 limits: min 64 B..1 MiB,
    /// avg 256 B..4 MiB, max 1 KiB..16 MiB; min <= avg <= max), over the input's non-zero
    /// runs: a run of whole zero 4 KiB blocks (aligned to the input's start) of at least
    /// `min` bytes ends the chunk before it and is recorded as a hole.
    Cdc {
        /// Minimum chunk size in bytes.
        min: u32,
        /// Average (target) chunk size in bytes.
        avg: u32,
        /// Maximum chunk size in bytes.
        max: u32,
    },
}

impl Chunking {
    /// Default for memory files: fixed 64 KiB chunks (see the module doc).
    pub const MEMORY_DEFAULT: Chunking = Chunking::Fixed { size: 64 << 10 };
    /// Default for disk images: FastCDC min/avg/max 16/64/256 KiB.
    pub const DISK_DEFAULT: Chunking = Chunking::Cdc {
        min: 16 << 10,
        avg: 64 << 10,
        max: 256 << 10,
    };

    /// Checks the bounds documented on each variant.
    pub fn validate(&self) -> Result<(), ChunkError> {
        use fastcdc::v2020 as f;
        let ok = match *self {
            Chunking::Fixed { size } => {
                size.is_power_of_two() && size >= 4096 && u64::from(size) <= MAX_CHUNK_LEN
            }
            Chunking::Cdc { min, avg, max } => {
                let (min, avg, max) = (min as usize, avg as usize, max as usize);
                (f::MINIMUM_MIN..=f::MINIMUM_MAX).contains(&min)
                    && (f::AVERAGE_MIN..=f::AVERAGE_MAX).contains(&avg)
                    && (f::MAXIMUM_MIN..=f::MAXIMUM_MAX).contains(&max)
                    && min <= avg
                    && avg <= max
                    && max as u64 <= MAX_CHUNK_LEN
            }
        };
        if ok {
            Ok(())
        } else {
            Err(ChunkError::InvalidChunking(format!("{self:?}")))
        }
    }

    /// Largest chunk this chunking produces, in bytes.
    pub fn max_len(&self) -> usize {
        match *self {
            Chunking::Fixed { size } => size as usize,
            Chunking::Cdc { max, .. } => max as usize,
        }
    }
}

/// One entry of a chunk table: a stored chunk, or a hole (all zero, not stored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChunkEntry {
    /// Offset of the chunk's first byte in the artifact (raw bytes).
    pub offset: u64,
    /// Raw (uncompressed) length in bytes.
    pub raw_len: u64,
    /// The chunk's name; `None` for a hole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<ChunkDigest>,
    /// Stored (zstd frame) length in bytes; 0 for a hole.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stored_len: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ChunkEntry {
    /// True when the entry is a hole (all-zero bytes, nothing stored).
    pub fn is_hole(&self) -> bool {
        self.digest.is_none()
    }
    /// One past the last byte: `offset + raw_len`.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.raw_len)
    }
}

/// The chunk table of one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChunkTable {
    /// Total raw size of the artifact in bytes.
    pub size: u64,
    /// How it was cut.
    pub chunking: Chunking,
    /// Entries in offset order.
    pub entries: Vec<ChunkEntry>,
}

impl ChunkTable {
    /// Rejects gaps, overlaps, unsorted or empty entries, chunks over [`MAX_CHUNK_LEN`], holes
    /// with a stored length, and a total that differs from `size`.
    pub fn validate(&self) -> Result<(), ChunkError> {
        let mut pos = 0u64;
        for (i, e) in self.entries.iter().enumerate() {
            if e.offset != pos {
                let kind = if e.offset > pos { "gap" } else { "overlap" };
                return Err(ChunkError::InvalidTable(format!(
                    "{kind} at entry {i}: starts at {} but the previous entry ends at {pos}",
                    e.offset
                )));
            }
            if e.raw_len == 0 {
                return Err(ChunkError::InvalidTable(format!("entry {i} is empty")));
            }
            if !e.is_hole() && e.raw_len > MAX_CHUNK_LEN {
                return Err(ChunkError::InvalidTable(format!(
                    "entry {i} is {} bytes, over the {MAX_CHUNK_LEN}-byte limit",
                    e.raw_len
                )));
            }
            if e.is_hole() && e.stored_len != 0 {
                return Err(ChunkError::InvalidTable(format!(
                    "entry {i} is a hole with a stored length"
                )));
            }
            pos = e
                .offset
                .checked_add(e.raw_len)
                .ok_or_else(|| ChunkError::InvalidTable(format!("entry {i} ends past 2^64")))?;
        }
        if pos != self.size {
            return Err(ChunkError::InvalidTable(format!(
                "entries cover {pos} bytes but size is {}",
                self.size
            )));
        }
        Ok(())
    }

    /// Index of the entry containing byte `offset`, or `None` past the end. O(log n); assumes
    /// a validated table.
    pub fn find(&self, offset: u64) -> Option<usize> {
        if offset >= self.size {
            return None;
        }
        let i = self.entries.partition_point(|e| e.offset <= offset);
        i.checked_sub(1)
    }

    /// Distinct stored chunks in first-use order.
    pub fn chunk_digests(&self) -> Vec<ChunkDigest> {
        let mut seen = std::collections::HashSet::new();
        self.entries
            .iter()
            .filter_map(|e| e.digest)
            .filter(|d| seen.insert(*d))
            .collect()
    }

    /// Sum of stored lengths of distinct chunks, in bytes.
    pub fn stored_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.entries
            .iter()
            .filter(|e| e.digest.is_some_and(|d| seen.insert(d)))
            .map(|e| e.stored_len)
            .sum()
    }

    /// Appends an entry, merging a hole into a preceding hole.
    pub fn push(&mut self, entry: ChunkEntry) {
        if entry.is_hole()
            && let Some(last) = self.entries.last_mut()
            && last.is_hole()
            && last.end() == entry.offset
        {
            last.raw_len += entry.raw_len;
            return;
        }
        self.entries.push(entry);
    }
}

/// A chunk compressed for storage.
#[derive(Debug, Clone)]
pub struct EncodedChunk {
    /// sha256 of the raw bytes.
    pub digest: ChunkDigest,
    /// Raw length in bytes.
    pub raw_len: u64,
    /// The zstd frame (stored bytes).
    pub stored: Bytes,
}

/// True when every byte is zero.
pub fn is_all_zero(data: &[u8]) -> bool {
    // Compare in 16-byte blocks; the tail byte by byte.
    let (chunks, tail) = data.as_chunks::<16>();
    chunks.iter().all(|c| u128::from_ne_bytes(*c) == 0) && tail.iter().all(|b| *b == 0)
}

thread_local! {
    /// This thread's zstd compression context at [`ZSTD_LEVEL`], made on first use and kept:
    /// making one per chunk (what `zstd::bulk::compress` does) allocates and clears the
    /// level's tables every time, a large share of the work for a 64 KiB chunk. A reused
    /// context writes the same frame (the parameters are set once and never changed).
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Hashes and compresses one raw chunk (CPU-bound: call from a blocking thread for big ones).
pub fn encode(raw: &[u8]) -> Result<EncodedChunk, ChunkError> {
    encode_hashed(raw, ChunkDigest::of(raw))
}

/// [`encode`] of `raw` whose sha256 the caller has computed: `digest` (not checked).
pub fn encode_hashed(raw: &[u8], digest: ChunkDigest) -> Result<EncodedChunk, ChunkError> {
    let stored = COMPRESSOR.with(|c| -> std::io::Result<Vec<u8>> {
        let mut c = c.borrow_mut();
        let c = match &mut *c {
            Some(c) => c,
            none => none.insert(zstd::bulk::Compressor::new(ZSTD_LEVEL)?),
        };
        let mut out = c.compress(raw)?;
        // The buffer was sized for the worst case; keep only the frame.
        out.shrink_to_fit();
        Ok(out)
    })?;
    Ok(EncodedChunk {
        digest,
        raw_len: raw.len() as u64,
        stored: Bytes::from(stored),
    })
}

/// Decompresses a stored chunk and checks it: exactly one zstd frame, at most `max_raw_len`
/// raw bytes (never allocates more), hashing to `digest`. `store` names the source in errors.
pub fn decode(
    digest: &ChunkDigest,
    stored: &[u8],
    max_raw_len: u64,
    store: &str,
) -> Result<Vec<u8>, ChunkError> {
    let corrupt = |reason: String| ChunkError::Corrupt {
        digest: *digest,
        store: store.to_string(),
        reason,
    };
    let cap = max_raw_len.min(MAX_CHUNK_LEN) as usize;
    let raw = zstd::bulk::decompress(stored, cap).map_err(|e| corrupt(e.to_string()))?;
    let actual = ChunkDigest::of(&raw);
    if actual != *digest {
        return Err(ChunkError::DigestMismatch {
            digest: *digest,
            store: store.to_string(),
            actual,
        });
    }
    Ok(raw)
}

/// One raw chunk cut from an input.
#[derive(Debug)]
pub struct RawChunk {
    /// Offset in the input, bytes.
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
}

/// Cuts `input` into raw chunks by `chunking`, streaming, one chunk at a time: each chunk
/// comes out as soon as the bytes that decide it have been read, so an input that stalls
/// has everything before the stall cut (memory: about one max chunk). For an input whose
/// reads do not stall, such as a file, [`split_parallel`] gives the same chunks faster.
pub fn split<R: Read + Send + 'static>(
    input: R,
    chunking: Chunking,
) -> Result<Box<dyn Iterator<Item = Result<RawChunk, ChunkError>> + Send>, ChunkError> {
    split_with(input, chunking, CDC_SEGMENT, 1)
}

/// [`split`] with content-defined cuts found on [`cdc_threads`] threads: the same chunks
/// (same offsets and bytes, hence the same digests; see [`cdc_cuts`] for why), but data is
/// read a batch of `T × CDC_SEGMENT` bytes ahead before its chunks come out, so use it for
/// inputs whose reads do not stall (files). Memory for [`Chunking::Cdc`]: the batch, at most
/// `T × CDC_SEGMENT + 2 × max + 4 KiB` bytes, where `T` is the cutting threads (16.5 MiB on a
/// 2-core machine with [`Chunking::DISK_DEFAULT`], 32.5 MiB at most), plus the chunks the
/// caller holds (each is copied out as it is taken).
/// [`Chunking::Fixed`] is cut as by [`split`].
pub fn split_parallel<R: Read + Send + 'static>(
    input: R,
    chunking: Chunking,
) -> Result<Box<dyn Iterator<Item = Result<RawChunk, ChunkError>> + Send>, ChunkError> {
    split_with(input, chunking, CDC_SEGMENT, cdc_threads())
}

/// Bytes of data one thread finds content-defined cuts in at a time (8 MiB): a batch is this
/// many bytes per cutting thread, and each segment but the first costs the stitch a few
/// chunks cut twice (see [`cdc_cuts`]).
pub const CDC_SEGMENT: usize = 8 << 20;

/// Threads that cut a batch of content-defined chunks in [`split_parallel`]: the machine's
/// cores, at most 4 (the batch, and so the memory, grows with them).
pub fn cdc_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// [`split`] with the CDC batch shape given: `segment` bytes per thread, `threads` threads;
/// one thread cuts one chunk at a time as soon as `max` bytes wait (no batch). The chunks
/// are the same for every `segment >= 1` and `threads >= 1` (the tests compare them); only
/// speed, memory and how far ahead of its chunks the input is read differ.
fn split_with<R: Read + Send + 'static>(
    input: R,
    chunking: Chunking,
    segment: usize,
    threads: usize,
) -> Result<Box<dyn Iterator<Item = Result<RawChunk, ChunkError>> + Send>, ChunkError> {
    chunking.validate()?;
    Ok(match chunking {
        Chunking::Fixed { size } => Box::new(FixedSplit {
            input,
            size: size as usize,
            offset: 0,
            done: false,
        }),
        Chunking::Cdc { min, avg, max } => {
            let (segment, threads) = (segment.max(1), threads.max(1));
            let cutter = Cutter {
                min: min as usize,
                avg: avg as usize,
                max: max as usize,
            };
            Box::new(CdcSplit {
                input,
                cutter,
                segment,
                threads,
                buf: Vec::with_capacity(batch(segment, threads) + 2 * cutter.max + ZERO_BLOCK),
                start: 0,
                offset: 0,
                zeros: 0,
                out: std::collections::VecDeque::new(),
                done: false,
            })
        }
    })
}

/// Bytes of data [`CdcSplit`] collects (beyond `max`) before cutting: `segment × threads`,
/// or none with one thread (a chunk is cut as soon as `max` bytes wait).
fn batch(segment: usize, threads: usize) -> usize {
    if threads > 1 { segment * threads } else { 0 }
}

/// The block size zero runs are found in, bytes: the ext4 block and the page.
const ZERO_BLOCK: usize = 4096;

/// The content-defined cut rule, the one place it is applied: FastCDC 2020 (`fastcdc`'s
/// `v2020`, normalization level 1, seed 0) with these bounds in bytes.
#[derive(Debug, Clone, Copy)]
struct Cutter {
    min: usize,
    avg: usize,
    max: usize,
}

impl Cutter {
    /// Length in bytes of the chunk that starts at `rest[0]`, where `rest` is the data up to
    /// the end of its run (a zero run or the input's end), or any longer prefix of it than
    /// `max`: the cut depends only on `rest[..max]` (FastCDC looks at most `max` bytes ahead).
    /// Never 0 for a non-empty `rest`.
    fn len(&self, rest: &[u8]) -> usize {
        let left = rest.len();
        let (_, n) = fastcdc::v2020::FastCDC::new(rest, self.min, self.avg, self.max).cut(0, left);
        if n == 0 { left } else { n }
    }

    /// The chain of cuts in `data` from `from`: `from`, then each next cut, until one at or
    /// past `until`, or where cutting stops: at the end of `data`, or, unless `all`, where
    /// fewer than `max` bytes are left (the data that follows may move that cut). Positions
    /// are offsets in `data`, increasing; the last is where the chain ended.
    fn chain(&self, data: &[u8], all: bool, from: usize, until: usize) -> Vec<usize> {
        let mut v = vec![from];
        let mut p = from;
        while p < until && !self.stops(data.len(), all, p) {
            p += self.len(&data[p..]);
            v.push(p);
        }
        v
    }

    /// True when the chain stops at `p` in data of `len` bytes (see [`Cutter::chain`]).
    fn stops(&self, len: usize, all: bool, p: usize) -> bool {
        p == len || (!all && len - p < self.max)
    }
}

/// The content-defined cuts of `data` (one run of data: no zero run inside), exactly those of
/// `cutter.chain(data, all, 0, usize::MAX)`, found with up to `threads` threads over
/// segments of `segment` bytes.
///
/// The argument (the usual one for parallel CDC; e.g. Xia et al. leave it to the caller, and
/// `ci/bench-store.sh` measures the result): a cut depends only on the bytes from the
/// previous cut on ([`Cutter::len`]). So the chain from any position is a function of that
/// position alone, and two chains that share one position share every position after it.
/// Segment `j`'s candidates are the chain from the segment's start `q_j` to its first
/// position at or past `q_{j+1}`, found in parallel; the true chain is known through segment
/// 0, and from its first position `p >= q_j` it is followed one cut at a time until it lands
/// on one of segment `j`'s candidates, from where it *is* the candidates (through the first
/// one past the segment). It usually lands within a few chunks (cuts of two chains fall on
/// the same content once past `min`); where it never does (data without cut points, where
/// every chunk is `max` long) segment `j` is cut twice, and the result is still exact.
fn cdc_cuts(cutter: &Cutter, data: &[u8], all: bool, segment: usize, threads: usize) -> Vec<usize> {
    let segments = data.len().div_ceil(segment);
    if threads <= 1 || segments <= 1 {
        return cutter.chain(data, all, 0, usize::MAX);
    }
    let bound = |j: usize| (j * segment).min(data.len());
    // Candidates of segments 1.., spread over threads - 1 helpers while this thread cuts
    // segment 0 for real.
    let (mut out, cands) = std::thread::scope(|s| {
        let helpers: Vec<_> = (0..threads - 1)
            .map(|w| {
                s.spawn(move || {
                    (1..segments)
                        .filter(|j| (j - 1) % (threads - 1) == w)
                        .map(|j| (j, cutter.chain(data, all, bound(j), bound(j + 1))))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let out = cutter.chain(data, all, 0, bound(1));
        let mut cands = vec![Vec::new(); segments];
        for h in helpers {
            // A helper panics only if the cut rule does; pass that on.
            for (j, c) in h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)) {
                cands[j] = c;
            }
        }
        (out, cands)
    });
    for (j, cand) in cands.iter().enumerate().skip(1) {
        loop {
            // `out` is never empty: it starts with 0.
            let p = out[out.len() - 1];
            if p >= bound(j + 1) || cutter.stops(data.len(), all, p) {
                break;
            }
            if let Ok(i) = cand.binary_search(&p) {
                out.extend_from_slice(&cand[i + 1..]);
                break;
            }
            out.push(p + cutter.len(&data[p..]));
        }
    }
    out
}

/// FastCDC over the input's non-zero runs (see [`Chunking::Cdc`]): whole [`ZERO_BLOCK`]s of
/// zeros, aligned to the input's start, that add up to at least `min` bytes in a row end the
/// content-defined chunk before them and come out as zero chunks (at most `max` each, which
/// the table records as holes). Shorter zero runs are data. Between zero runs the cut points
/// are exactly `fastcdc::v2020::StreamCDC`'s (each cut is chosen from at least `max` bytes
/// when that many remain).
///
/// With one thread, a chunk is cut as soon as `max` bytes wait (memory: about one max chunk
/// plus one block). With more, data is collected until `segment × threads + max` bytes wait
/// (or a zero run or the input's end ends the run of data) and then cut by [`cdc_cuts`] on
/// `threads` threads; the cuts are those of cutting one chunk at a time, since a cut never
/// looks more than `max` bytes ahead. Memory: the batch, kept in `buf` until its last chunk
/// is taken (under `segment × threads + 2 × max + ZERO_BLOCK` bytes); each chunk is copied
/// out as it is taken.
struct CdcSplit<R> {
    input: R,
    cutter: Cutter,
    segment: usize,
    threads: usize,
    /// Data not yet cut is `buf[start..]`, starting at `offset` in the input.
    buf: Vec<u8>,
    start: usize,
    offset: u64,
    /// Zero bytes read after `buf`, in whole blocks, not yet placed.
    zeros: usize,
    /// Chunks cut and not yet taken, in order.
    out: std::collections::VecDeque<Pending>,
    done: bool,
}

/// A chunk [`CdcSplit`] has cut and not yet given out.
enum Pending {
    /// A zero chunk.
    Ready(RawChunk),
    /// Data at `buf[at..at + len]`, `offset` in the input; `buf` keeps it until taken.
    Data { offset: u64, at: usize, len: usize },
}

impl<R: Read> CdcSplit<R> {
    /// Cuts the data in `buf` while at least `max` bytes remain, or all of it at the end of
    /// a run of data (`all`); with more than one thread, only once a batch waits.
    fn cut(&mut self, all: bool) {
        let left = self.buf.len() - self.start;
        if left == 0 || (!all && left < batch(self.segment, self.threads) + self.cutter.max) {
            return;
        }
        let rest = &self.buf[self.start..];
        let cuts = cdc_cuts(&self.cutter, rest, all, self.segment, self.threads);
        // Chunks are copied out of `buf` as they are taken (Pending::Data), so a batch's
        // chunks are not all held twice.
        for w in cuts.windows(2) {
            self.out.push_back(Pending::Data {
                offset: self.offset + w[0] as u64,
                at: self.start + w[0],
                len: w[1] - w[0],
            });
        }
        // `cuts` is never empty: it starts with 0.
        let n = cuts[cuts.len() - 1];
        self.offset += n as u64;
        self.start += n;
    }

    /// Drops the cut part of `buf` once nothing in `out` points into it and it has reached
    /// `max` bytes, so what is left (under `max` bytes) moves about once per `max` bytes cut
    /// (once per batch) rather than once per chunk.
    fn compact(&mut self) {
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start >= self.cutter.max {
            self.buf.drain(..self.start);
            self.start = 0;
        }
    }

    /// Emits `n` zero bytes after the data (a zero run): as chunks of at most `max`.
    fn zero_chunks(&mut self, mut n: usize) {
        while n > 0 {
            let k = n.min(self.cutter.max);
            self.out.push_back(Pending::Ready(RawChunk {
                offset: self.offset,
                data: vec![0; k],
            }));
            self.offset += k as u64;
            n -= k;
        }
    }

    /// Places the pending zeros: a run of at least `min` ends the segment; a shorter one is
    /// data.
    fn place_zeros(&mut self) {
        let z = std::mem::take(&mut self.zeros);
        if z >= self.cutter.min {
            self.cut(true);
            self.zero_chunks(z);
        } else {
            self.buf.resize(self.buf.len() + z, 0);
            self.cut(false);
        }
    }

    /// Reads up to one block; fewer bytes only at the end of the input.
    fn read_block(&mut self, block: &mut [u8]) -> std::io::Result<usize> {
        let mut n = 0;
        while n < block.len() {
            match self.input.read(&mut block[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }
}

impl<R: Read> Iterator for CdcSplit<R> {
    type Item = Result<RawChunk, ChunkError>;
    fn next(&mut self) -> Option<Self::Item> {
        let mut block = [0u8; ZERO_BLOCK];
        loop {
            match self.out.pop_front() {
                Some(Pending::Ready(c)) => return Some(Ok(c)),
                Some(Pending::Data { offset, at, len }) => {
                    return Some(Ok(RawChunk {
                        offset,
                        data: self.buf[at..at + len].to_vec(),
                    }));
                }
                None => {}
            }
            if self.done {
                return None;
            }
            self.compact();
            let n = match self.read_block(&mut block) {
                Ok(n) => n,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e.into()));
                }
            };
            if n == ZERO_BLOCK && is_all_zero(&block) {
                self.zeros += n;
                // A long run goes out as it grows, so memory stays bounded.
                if self.zeros >= self.cutter.min + self.cutter.max {
                    self.cut(true);
                    self.zero_chunks(self.cutter.max);
                    self.zeros -= self.cutter.max;
                }
                continue;
            }
            self.place_zeros();
            if n == 0 {
                self.cut(true);
                self.done = true;
                continue;
            }
            self.buf.extend_from_slice(&block[..n]);
            self.cut(false);
        }
    }
}

struct FixedSplit<R> {
    input: R,
    size: usize,
    offset: u64,
    done: bool,
}

impl<R: Read> Iterator for FixedSplit<R> {
    type Item = Result<RawChunk, ChunkError>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let mut buf = vec![0u8; self.size];
        let mut n = 0;
        while n < self.size {
            match self.input.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.done = true;
                    return Some(Err(e.into()));
                }
            }
        }
        if n < self.size {
            self.done = true;
        }
        if n == 0 {
            return None;
        }
        buf.truncate(n);
        let c = RawChunk {
            offset: self.offset,
            data: buf,
        };
        self.offset += n as u64;
        Some(Ok(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::random_bytes;

    fn entry(offset: u64, raw_len: u64, hole: bool) -> ChunkEntry {
        ChunkEntry {
            offset,
            raw_len,
            digest: (!hole).then(|| ChunkDigest::of(&offset.to_le_bytes())),
            stored_len: if hole { 0 } else { 10 },
        }
    }

    fn table(entries: Vec<ChunkEntry>, size: u64) -> ChunkTable {
        ChunkTable {
            size,
            chunking: Chunking::DISK_DEFAULT,
            entries,
        }
    }

    #[test]
    fn validate_rejects_gaps_overlaps_and_bad_sizes() {
        let good = table(
            vec![entry(0, 10, false), entry(10, 5, true), entry(15, 5, false)],
            20,
        );
        good.validate().unwrap();
        let gap = table(vec![entry(0, 10, false), entry(11, 9, false)], 20);
        assert!(gap.validate().unwrap_err().to_string().contains("gap"));
        let overlap = table(vec![entry(0, 10, false), entry(9, 11, false)], 20);
        assert!(
            overlap
                .validate()
                .unwrap_err()
                .to_string()
                .contains("overlap")
        );
        assert!(table(vec![entry(0, 10, false)], 20).validate().is_err());
        assert!(table(vec![entry(0, 0, false)], 0).validate().is_err());
        assert!(
            table(vec![entry(0, MAX_CHUNK_LEN + 1, false)], MAX_CHUNK_LEN + 1)
                .validate()
                .is_err()
        );
        assert!(
            table(vec![entry(0, u64::MAX, true), entry(u64::MAX, 2, true)], 1)
                .validate()
                .is_err()
        );
        let mut bad_hole = entry(0, 4, true);
        bad_hole.stored_len = 3;
        assert!(table(vec![bad_hole], 4).validate().is_err());
        table(vec![], 0).validate().unwrap();
    }

    #[test]
    fn hostile_table_json_is_refused() {
        let j = r#"{"size":10,"chunking":{"fixed":{"size":4096}},"entries":[{"offset":0,"rawLen":10,"digest":"sha256:../../x"}]}"#;
        assert!(serde_json::from_str::<ChunkTable>(j).is_err());
        let j = r#"{"size":10,"chunking":{"fixed":{"size":4096}},"entries":[],"extra":1}"#;
        assert!(serde_json::from_str::<ChunkTable>(j).is_err());
        let j = r#"{"size":10,"chunking":{"fixed":{"size":4096}},"entries":[{"offset":0,"rawLen":-1}]}"#;
        assert!(serde_json::from_str::<ChunkTable>(j).is_err());
    }

    #[test]
    fn find_is_exact_at_boundaries() {
        let t = table(
            vec![entry(0, 10, false), entry(10, 5, true), entry(15, 5, false)],
            20,
        );
        assert_eq!(t.find(0), Some(0));
        assert_eq!(t.find(9), Some(0));
        assert_eq!(t.find(10), Some(1));
        assert_eq!(t.find(14), Some(1));
        assert_eq!(t.find(15), Some(2));
        assert_eq!(t.find(19), Some(2));
        assert_eq!(t.find(20), None);
        assert_eq!(table(vec![], 0).find(0), None);
    }

    #[test]
    fn holes_merge() {
        let mut t = table(vec![], 0);
        t.push(entry(0, 4, true));
        t.push(entry(4, 4, true));
        t.push(entry(8, 4, false));
        t.push(entry(12, 4, true));
        assert_eq!(t.entries.len(), 3);
        assert_eq!(t.entries[0].raw_len, 8);
    }

    #[test]
    fn encode_decode_and_corruption() {
        let raw: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let enc = encode(&raw).unwrap();
        assert_eq!(
            decode(&enc.digest, &enc.stored, raw.len() as u64, "s").unwrap(),
            raw
        );
        // Truncated frame.
        let cut = &enc.stored[..enc.stored.len() / 2];
        assert!(matches!(
            decode(&enc.digest, cut, raw.len() as u64, "s"),
            Err(ChunkError::Corrupt { .. })
        ));
        // Valid frame of other bytes.
        let other = encode(b"other bytes").unwrap();
        let err = decode(&enc.digest, &other.stored, 1 << 20, "s").unwrap_err();
        assert!(matches!(err, ChunkError::DigestMismatch { .. }));
        assert!(err.to_string().contains(&enc.digest.to_string()));
        // Garbage.
        assert!(decode(&enc.digest, b"not zstd", 1 << 20, "s").is_err());
        // A frame larger than allowed is refused, not allocated.
        assert!(decode(&enc.digest, &enc.stored, 1000, "s").is_err());
    }

    #[test]
    fn zero_detection() {
        assert!(is_all_zero(&[0u8; 4099]));
        let mut v = vec![0u8; 4099];
        v[4098] = 1;
        assert!(!is_all_zero(&v));
        v[4098] = 0;
        v[17] = 1;
        assert!(!is_all_zero(&v));
    }

    fn cuts(data: &[u8]) -> Vec<(u64, usize, bool)> {
        split(std::io::Cursor::new(data.to_vec()), Chunking::DISK_DEFAULT)
            .unwrap()
            .map(|c| {
                let c = c.unwrap();
                (c.offset, c.data.len(), is_all_zero(&c.data))
            })
            .collect()
    }

    #[test]
    fn cdc_without_zero_runs_cuts_where_fastcdc_streaming_does() {
        let data = random_bytes(7, 3_000_001);
        let Chunking::Cdc { min, avg, max } = Chunking::DISK_DEFAULT else {
            unreachable!()
        };
        let want: Vec<(u64, usize, bool)> = fastcdc::v2020::StreamCDC::new(
            std::io::Cursor::new(data.clone()),
            min as usize,
            avg as usize,
            max as usize,
        )
        .map(|c| {
            let c = c.unwrap();
            (c.offset, c.length, false)
        })
        .collect();
        assert!(want.len() > 20);
        assert_eq!(cuts(&data), want);
    }

    #[test]
    fn cdc_cuts_around_zero_runs_and_keeps_short_ones_as_data() {
        // data (100 KiB) | 1 MiB + 4 KiB of zero blocks | data | 8 KiB of zeros | data
        let a = random_bytes(1, 100 << 10);
        let b = random_bytes(2, 300 << 10);
        let mut data = a.clone();
        data.resize(data.len() + (1 << 20) + 4096, 0);
        let run_end = data.len() as u64;
        data.extend_from_slice(&b);
        let short_at = data.len();
        data.resize(data.len() + 8192, 0);
        data.extend_from_slice(&a);
        let c = cuts(&data);
        // Covers the input exactly; every chunk at most max.
        let mut pos = 0;
        for &(off, len, _) in &c {
            assert_eq!(off, pos);
            assert!(len <= 256 << 10);
            pos += len as u64;
        }
        assert_eq!(pos, data.len() as u64);
        // A chunk ends where the long run starts and one starts where it ends; the run is
        // only zero chunks.
        assert!(c.iter().any(|&(o, _, z)| o == (100 << 10) && z), "{c:?}");
        assert!(c.iter().any(|&(o, _, z)| o == run_end && !z), "{c:?}");
        for &(o, len, z) in &c {
            if o >= 100 << 10 && o < run_end {
                assert!(z && o + len as u64 <= run_end, "{c:?}");
            }
        }
        // The short run (8 KiB < min) is inside a data chunk.
        assert!(
            c.iter().any(|&(o, len, z)| !z
                && (o as usize) < short_at
                && o as usize + len > short_at + 8192),
            "{c:?}"
        );
        // A change before the run changes no chunk after it.
        let mut changed = data.clone();
        changed[50 << 10] ^= 0xff;
        let d = cuts(&changed);
        let after = |v: &[(u64, usize, bool)]| {
            v.iter()
                .filter(|x| x.0 >= run_end)
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(after(&c), after(&d));
        // An input of only zeros is all zero chunks; an empty one has none.
        assert!(cuts(&vec![0; 3 << 20]).iter().all(|x| x.2));
        assert!(cuts(&[]).is_empty());
    }

    /// The chunks of `data` straight from the definition in [`Chunking::Cdc`], one chunk at a
    /// time over the whole input in memory: the long zero runs first, then each run of data
    /// between them cut by [`Cutter::len`] from its start. The reference the streaming and
    /// parallel cutting are compared with.
    fn reference(data: &[u8], chunking: Chunking) -> Vec<(u64, usize, bool)> {
        let Chunking::Cdc { min, avg, max } = chunking else {
            unreachable!()
        };
        let c = Cutter {
            min: min as usize,
            avg: avg as usize,
            max: max as usize,
        };
        let blocks = data.len() / ZERO_BLOCK;
        let zero = |b: usize| is_all_zero(&data[b * ZERO_BLOCK..(b + 1) * ZERO_BLOCK]);
        let mut runs = Vec::new();
        let mut b = 0;
        while b < blocks {
            if zero(b) {
                let s = b;
                while b < blocks && zero(b) {
                    b += 1;
                }
                if (b - s) * ZERO_BLOCK >= c.min {
                    runs.push((s * ZERO_BLOCK, b * ZERO_BLOCK));
                }
            } else {
                b += 1;
            }
        }
        let mut out = Vec::new();
        let data_run = |out: &mut Vec<(u64, usize, bool)>, from: usize, to: usize| {
            let mut p = from;
            while p < to {
                let n = c.len(&data[p..to]);
                out.push((p as u64, n, is_all_zero(&data[p..p + n])));
                p += n;
            }
        };
        let mut pos = 0;
        for (s, e) in runs {
            data_run(&mut out, pos, s);
            let mut p = s;
            while p < e {
                let n = (e - p).min(c.max);
                out.push((p as u64, n, true));
                p += n;
            }
            pos = e;
        }
        data_run(&mut out, pos, data.len());
        out
    }

    fn cuts_with(
        data: &[u8],
        chunking: Chunking,
        segment: usize,
        threads: usize,
    ) -> Vec<(u64, usize, bool)> {
        split_with(
            std::io::Cursor::new(data.to_vec()),
            chunking,
            segment,
            threads,
        )
        .unwrap()
        .map(|c| {
            let c = c.unwrap();
            (c.offset, c.data.len(), is_all_zero(&c.data))
        })
        .collect()
    }

    /// Every batch shape cuts `data` as the reference does.
    fn assert_same_cuts(what: &str, data: &[u8], chunking: Chunking) {
        let want = reference(data, chunking);
        let max = chunking.max_len();
        let shapes = [
            (CDC_SEGMENT, 1),
            (CDC_SEGMENT, cdc_threads()),
            (4096, 2),
            (max - 1, 2),
            (max, 3),
            (max + 1, 4),
            (3 * max + 12_345, 2),
            (1 << 20, 3),
        ];
        for (segment, threads) in shapes {
            let got = cuts_with(data, chunking, segment, threads);
            assert!(
                got == want,
                "{what} ({} bytes), segment {segment}, {threads} threads: {} chunks, the \
                 reference {}; first difference at {:?}",
                data.len(),
                got.len(),
                want.len(),
                got.iter().zip(&want).position(|(a, b)| a != b)
            );
        }
    }

    /// Small bounds so that short inputs hold many chunks and many segments.
    const SMALL: Chunking = Chunking::Cdc {
        min: 4096,
        avg: 8192,
        max: 16384,
    };

    #[test]
    fn parallel_cuts_are_the_sequential_cuts() {
        for chunking in [Chunking::DISK_DEFAULT, SMALL] {
            let max = chunking.max_len();
            // Random data.
            assert_same_cuts("random", &random_bytes(7, 3_000_001), chunking);
            // Highly repetitive: a short period (cut points repeat with it) and one byte
            // (no cut point: every chunk is max long, crossing every segment border).
            let period: Vec<u8> = random_bytes(3, 1000).repeat(3000);
            assert_same_cuts("period 1000", &period, chunking);
            assert_same_cuts("one byte", &vec![0x55; 2_000_003], chunking);
            // Tiny inputs and inputs around a block, min, max and batch sizes.
            let r = random_bytes(11, 3 * max + 8192);
            for n in [
                0,
                1,
                100,
                4095,
                4096,
                4097,
                max - 1,
                max,
                max + 1,
                2 * max,
                2 * max + 1,
                3 * max + 8192,
            ] {
                assert_same_cuts("short", &r[..n], chunking);
            }
            for n in [(1 << 20) - 1, 1 << 20, (1 << 20) + 1, (3 << 20) + 1] {
                assert_same_cuts("segment-sized", &random_bytes(5, n), chunking);
            }
        }
    }

    #[test]
    fn parallel_cuts_keep_zero_runs() {
        let max = 256 << 10;
        let mut data = random_bytes(9, 4 << 20);
        // Zero runs long and short, block-aligned and not, across 1 MiB borders, one
        // longer than min + max (it goes out while it grows), one at the end.
        for (at, len) in [
            ((1 << 20) - 8192, 16384),      // exactly min, across a border
            ((2 << 20) - 4096, 12288),      // shorter than min, across a border
            ((2 << 20) + 100, 40000),       // not aligned
            ((3 << 20) - 200_000, 700_000), // longer than min + max, across a border
            ((4 << 20) - 20480, 20480),     // at the end
        ] {
            data[at..at + len].fill(0);
        }
        assert_same_cuts("zero runs", &data, Chunking::DISK_DEFAULT);
        assert_same_cuts("zero runs", &data, SMALL);
        // A run of max chunks (one byte repeated) up to a zero run and after it.
        let mut flat = vec![7u8; 3 << 20];
        flat[(1 << 20) + 4096..(1 << 20) + 4096 + max].fill(0);
        assert_same_cuts("flat and zeros", &flat, Chunking::DISK_DEFAULT);
        assert_same_cuts(
            "only zeros",
            &vec![0; (3 << 20) + 4096],
            Chunking::DISK_DEFAULT,
        );
    }

    /// A reader that gives at most `step` bytes per read, and sometimes `Interrupted`.
    struct Trickle {
        data: Vec<u8>,
        pos: usize,
        step: usize,
        reads: usize,
    }

    impl Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            self.reads += 1;
            if self.reads.is_multiple_of(7) {
                return Err(std::io::ErrorKind::Interrupted.into());
            }
            let n = out.len().min(self.step).min(self.data.len() - self.pos);
            out[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    #[test]
    fn cuts_do_not_depend_on_how_the_input_is_read() {
        // Data with zero runs long and short, aligned and not, and a partial last block.
        let mut data = random_bytes(21, (3 << 20) + 1234);
        for (at, len) in [(100_000, 20480), (1 << 20, 300_000), (2 << 20, 8192)] {
            data[at..at + len].fill(0);
        }
        for chunking in [Chunking::DISK_DEFAULT, SMALL] {
            let want = reference(&data, chunking);
            for step in [1, 4095, 4096, 4097, 65_537, 1 << 20, usize::MAX] {
                for threads in [1, 2] {
                    let input = Trickle {
                        data: data.clone(),
                        pos: 0,
                        step,
                        reads: 0,
                    };
                    let got: Vec<_> = split_with(input, chunking, CDC_SEGMENT / 8, threads)
                        .unwrap()
                        .map(|c| {
                            let c = c.unwrap();
                            let at = c.offset as usize;
                            assert_eq!(c.data, data[at..at + c.data.len()]);
                            (c.offset, c.data.len(), is_all_zero(&c.data))
                        })
                        .collect();
                    assert!(got == want, "step {step}, {threads} threads");
                }
            }
        }
    }

    #[test]
    fn cdc_cuts_match_the_chain_on_every_shape() {
        // The stitch alone, without zero runs or streaming, for both ends of data.
        let c = Cutter {
            min: 4096,
            avg: 8192,
            max: 16384,
        };
        let mut data = random_bytes(13, 1 << 20);
        data[300_000..500_000].fill(0x33);
        for all in [false, true] {
            let want = c.chain(&data, all, 0, usize::MAX);
            for segment in [1000, 4095, 16384, 16385, 100_000, 300_001] {
                for threads in 2..5 {
                    assert_eq!(
                        cdc_cuts(&c, &data, all, segment, threads),
                        want,
                        "all {all}, segment {segment}, {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn split_covers_input_exactly() {
        let data = random_bytes(1, 1_000_003);
        for chunking in [Chunking::DISK_DEFAULT, Chunking::Fixed { size: 65536 }] {
            let mut pos = 0u64;
            for c in split(std::io::Cursor::new(data.clone()), chunking).unwrap() {
                let c = c.unwrap();
                assert_eq!(c.offset, pos);
                assert!(c.data.len() <= chunking.max_len());
                assert_eq!(
                    &data[pos as usize..pos as usize + c.data.len()],
                    &c.data[..]
                );
                pos += c.data.len() as u64;
            }
            assert_eq!(pos, data.len() as u64);
        }
        assert!(Chunking::Fixed { size: 1000 }.validate().is_err());
        assert!(
            Chunking::Cdc {
                min: 10,
                avg: 20,
                max: 30
            }
            .validate()
            .is_err()
        );
    }
}
