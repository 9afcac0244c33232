//! Chunking measurement for disk images (issue 3): given two images, the second a slightly
//! changed build of the first, print one Markdown table row per chunking scheme.
//!
//! Usage: `measure_chunking OLD.img NEW.img` (driven by `ci/measure-chunking.sh`).
//!
//! Schemes: fixed chunks of 4 KiB, 64 KiB, 1 MiB, 2 MiB, and FastCDC v2020 (the `fastcdc`
//! crate's `v2020` module, normalization level 1) at average 16, 32, 64, 128 KiB with
//! min = avg / 4 and max = avg * 4. All-zero chunks are elided, as the store does.
//!
//! Columns:
//! - `chunks`: non-zero chunks of NEW; `mean KiB`: their mean raw length.
//! - `reused`: share of NEW's non-zero chunks (and of their bytes) whose digest OLD already has:
//!   what a push of NEW after OLD need not upload.
//! - `upload`: raw and zstd-3 MiB of the distinct chunks of NEW that OLD lacks.
//! - `4K read`: for every 4 KiB-aligned non-zero block of NEW, the raw and stored (zstd-3) bytes of
//!   the chunks that overlap it (what a lazy reader fetches and decompresses), averaged; and the
//!   measured mean time to zstd-decompress those chunks for 2000 random blocks (µs, one core).
//! - `objects/GiB`: non-zero chunks per GiB of non-zero data (PUT requests per GiB pushed cold).
//!
//! Figures are measurements of this machine, not assertions: this is a benchmark, never a test.

use std::collections::HashSet;
use std::time::Instant;

use sha2::{Digest, Sha256};

/// One chunk of an image: byte offset, raw length in bytes, sha256 of the raw bytes (None for
/// an all-zero chunk, which the store does not keep).
struct Piece {
    offset: usize,
    len: usize,
    digest: Option<[u8; 32]>,
}

/// A chunking scheme.
#[derive(Clone, Copy)]
enum Scheme {
    /// Fixed-size chunks of this many bytes.
    Fixed(usize),
    /// FastCDC v2020 with this average size in bytes.
    Cdc(usize),
}

impl Scheme {
    fn name(self) -> String {
        match self {
            Scheme::Fixed(n) => format!("fixed {}", human(n)),
            Scheme::Cdc(n) => format!("fastcdc avg {}", human(n)),
        }
    }

    fn cut(self, data: &[u8]) -> Vec<Piece> {
        let bounds: Vec<(usize, usize)> = match self {
            Scheme::Fixed(n) => (0..data.len())
                .step_by(n)
                .map(|o| (o, n.min(data.len() - o)))
                .collect(),
            Scheme::Cdc(avg) => fastcdc::v2020::FastCDC::new(data, avg / 4, avg, avg * 4)
                .map(|c| (c.offset, c.length))
                .collect(),
        };
        bounds
            .into_iter()
            .map(|(offset, len)| {
                let bytes = &data[offset..offset + len];
                let digest = if bytes.iter().all(|&b| b == 0) {
                    None
                } else {
                    Some(Sha256::digest(bytes).into())
                };
                Piece {
                    offset,
                    len,
                    digest,
                }
            })
            .collect()
    }
}

fn human(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{} KiB", n >> 10)
    }
}

/// A small deterministic generator (xorshift64*), so runs pick the same blocks.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

const BLOCK: usize = 4096;
const LEVEL: i32 = 3;
const SAMPLES: usize = 2000;

fn measure(scheme: Scheme, old: &[u8], new: &[u8]) -> String {
    let old_set: HashSet<[u8; 32]> = scheme
        .cut(old)
        .into_iter()
        .filter_map(|p| p.digest)
        .collect();
    let pieces = scheme.cut(new);

    let mut nonzero = 0usize;
    let mut nonzero_bytes = 0usize;
    let mut reused = 0usize;
    let mut reused_bytes = 0usize;
    let mut upload_raw = 0usize;
    let mut upload_stored = 0usize;
    let mut seen: HashSet<[u8; 32]> = HashSet::new();
    // Stored (zstd) length of each piece, 0 for zero pieces.
    let mut stored = vec![0usize; pieces.len()];
    for (i, p) in pieces.iter().enumerate() {
        let Some(d) = p.digest else { continue };
        nonzero += 1;
        nonzero_bytes += p.len;
        let bytes = &new[p.offset..p.offset + p.len];
        // Compressing from a slice into a Vec cannot fail at a valid level.
        let frame = zstd::bulk::compress(bytes, LEVEL).expect("zstd compress");
        stored[i] = frame.len();
        if old_set.contains(&d) {
            reused += 1;
            reused_bytes += p.len;
        } else if seen.insert(d) {
            upload_raw += p.len;
            upload_stored += frame.len();
        }
    }

    // Random 4 KiB reads: every non-zero 4 KiB block of NEW, and the pieces overlapping it.
    let starts: Vec<usize> = pieces.iter().map(|p| p.offset).collect();
    let overlapping = |block: usize| -> std::ops::RangeInclusive<usize> {
        let lo = block * BLOCK;
        let hi = (lo + BLOCK).min(new.len()) - 1;
        let first = starts.partition_point(|&s| s <= lo) - 1;
        let last = starts.partition_point(|&s| s <= hi) - 1;
        first..=last
    };
    let mut blocks = Vec::new();
    let (mut sum_raw, mut sum_stored) = (0usize, 0usize);
    for b in 0..new.len().div_ceil(BLOCK) {
        let lo = b * BLOCK;
        let hi = (lo + BLOCK).min(new.len());
        if new[lo..hi].iter().all(|&x| x == 0) {
            continue;
        }
        blocks.push(b);
        for i in overlapping(b) {
            if pieces[i].digest.is_some() {
                sum_raw += pieces[i].len;
                sum_stored += stored[i];
            }
        }
    }
    let mean_raw = sum_raw as f64 / blocks.len() as f64;
    let mean_stored = sum_stored as f64 / blocks.len() as f64;

    // Timed decompression of the pieces a random block read needs.
    let mut rng = Rng(0x6b69_6c6e);
    let mut frames = Vec::new();
    for _ in 0..SAMPLES {
        let b = blocks[(rng.next() % blocks.len() as u64) as usize];
        for i in overlapping(b) {
            let p = &pieces[i];
            if p.digest.is_some() {
                let frame = zstd::bulk::compress(&new[p.offset..p.offset + p.len], LEVEL)
                    .expect("zstd compress");
                frames.push((frame, p.len));
            }
        }
    }
    let mut dec = zstd::bulk::Decompressor::new().expect("zstd decompressor");
    let t0 = Instant::now();
    let mut total = 0usize;
    for (frame, len) in &frames {
        total += dec.decompress(frame, *len).expect("zstd decompress").len();
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / SAMPLES as f64;
    std::hint::black_box(total);

    let gib = nonzero_bytes as f64 / (1u64 << 30) as f64;
    format!(
        "| {} | {} | {:.1} | {:.1}% | {:.1}% | {:.2} / {:.2} | {:.1} / {:.1} | {:.0} | {:.0} |",
        scheme.name(),
        nonzero,
        nonzero_bytes as f64 / nonzero as f64 / 1024.0,
        100.0 * reused as f64 / nonzero as f64,
        100.0 * reused_bytes as f64 / nonzero_bytes as f64,
        upload_raw as f64 / (1 << 20) as f64,
        upload_stored as f64 / (1 << 20) as f64,
        mean_raw / 1024.0,
        mean_stored / 1024.0,
        us,
        nonzero as f64 / gib,
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: measure_chunking OLD.img NEW.img");
        std::process::exit(2);
    }
    let read = |p: &str| {
        std::fs::read(p).unwrap_or_else(|e| {
            eprintln!("measure_chunking: {p}: {e}");
            std::process::exit(1)
        })
    };
    let old = read(&args[1]);
    let new = read(&args[2]);
    println!(
        "| chunking | chunks | mean KiB | reused (chunks) | reused (bytes) | upload MiB raw / zstd | 4K read KiB raw / zstd | decompress µs | objects/GiB |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let schemes = [
        Scheme::Fixed(4 << 10),
        Scheme::Fixed(64 << 10),
        Scheme::Fixed(1 << 20),
        Scheme::Fixed(2 << 20),
        Scheme::Cdc(16 << 10),
        Scheme::Cdc(32 << 10),
        Scheme::Cdc(64 << 10),
        Scheme::Cdc(128 << 10),
    ];
    for s in schemes {
        println!("{}", measure(s, &old, &new));
    }
}
