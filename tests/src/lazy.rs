//! What a lazy clone start ([`kiln_vmm::lazy`]) fetched, counted one way for the test that
//! checks it (`kiln/tests/vm_lazy.rs`) and the benchmark that reports it
//! (`tests/examples/bench_clone.rs`, run by `ci/bench-clone.sh`): from the chunk server's
//! log ([`kiln_vmm::lazy::CHUNK_LOG`]) and the snapshot manifest's prefetch list.

use std::collections::HashSet;
use std::path::Path;

use kiln_store::{ChunkTable, Manifest, ManifestDigest, SnapshotManifest, Store, TagRef};

/// The `(file, index, digest)` lines of the chunk server's log in `snapdir` (the snapshot's
/// cache directory): every chunk served so far, once, in the order first served. Empty when
/// there is no log yet.
pub fn served_chunks(snapdir: &Path) -> Vec<(String, usize, String)> {
    std::fs::read_to_string(snapdir.join(kiln_vmm::lazy::CHUNK_LOG))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (
                f[0].to_string(),
                f[1].parse().expect("index"),
                f[2].to_string(),
            )
        })
        .collect()
}

/// How much of one file of a snapshot (its memory or its disk) a lazy start fetched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// `memory` or `disk`.
    pub file: &'static str,
    /// The file's size, bytes (for memory: the guest's RAM).
    pub size: u64,
    /// Its non-zero bytes: the uncompressed length of its stored chunks (zero chunks are
    /// holes of the table, never fetched).
    pub nonzero: u64,
    /// How many distinct chunks of it the server served.
    pub served_chunks: usize,
    /// Uncompressed bytes of those chunks.
    pub served: u64,
    /// Uncompressed bytes of the chunks served or on the prefetch list (a server of a
    /// remote store fetches the listed ones from its start, whether a clone reads them or
    /// not), each counted once.
    pub fetched: u64,
}

impl Fetched {
    /// `part` as a percentage of `of` (0 when `of` is 0).
    pub fn pct(part: u64, of: u64) -> f64 {
        100.0 * part as f64 / of.max(1) as f64
    }
}

/// [`Fetched`] for the memory file and the disk (in that order) of `snap`, from what the
/// server of `snapdir` has served so far and the snapshot's prefetch list.
pub fn fetched(snapdir: &Path, snap: &SnapshotManifest) -> [Fetched; 2] {
    let served = served_chunks(snapdir);
    let none = Vec::new();
    let (mem_list, disk_list) = snap
        .prefetch
        .as_ref()
        .map_or((&none, &none), |l| (&l.memory, &l.disk));
    let one = |file: &'static str, table: &ChunkTable, list: &[u32]| {
        let nonzero: u64 = table
            .entries
            .iter()
            .filter(|e| e.digest.is_some())
            .map(|e| e.raw_len)
            .sum();
        let s: HashSet<usize> = served
            .iter()
            .filter(|(n, _, _)| n == file)
            .map(|(_, i, _)| *i)
            .collect();
        let f: HashSet<usize> = s
            .iter()
            .copied()
            .chain(list.iter().map(|i| *i as usize))
            .collect();
        let bytes = |set: &HashSet<usize>| {
            set.iter()
                .filter_map(|i| table.entries.get(*i))
                .map(|e| e.raw_len)
                .sum::<u64>()
        };
        Fetched {
            file,
            size: table.size,
            nonzero,
            served_chunks: s.len(),
            served: bytes(&s),
            fetched: bytes(&f),
        }
    };
    [
        one("memory", &snap.memory, mem_list),
        one("disk", &snap.disk, disk_list),
    ]
}

/// The snapshot of the image tagged `tag` in `store`: its digest and manifest. Panics when
/// the tag, the image or the snapshot is missing.
pub async fn snapshot_of(store: &Store, tag: &TagRef) -> (ManifestDigest, SnapshotManifest) {
    let img = store.resolve_tag(tag).await.expect("tag");
    let Manifest::Image(m) = store.get_manifest(&img).await.expect("image") else {
        panic!("{tag} is not an image")
    };
    let sd = m.snapshot.expect("the image has a snapshot");
    let Manifest::Snapshot(snap) = store.get_manifest(&sd).await.expect("snapshot") else {
        panic!("{tag}'s snapshot is not a snapshot manifest")
    };
    (sd, snap)
}
