//! The read cache's bound holds across processes: two processes (this test binary, run again
//! as a child with [`CHILD_DIR`] set) fill one cache directory at once, each with several
//! tasks putting and reading chunks, some of them the same chunks. Afterwards the directory
//! holds no temp file, its files (entries and index) sum to at most the bound, and every
//! entry hashes to its name; while they run, every look under the cache's lock finds the
//! bound kept (temp files in flight aside: they are outside the bound).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use kiln_store::ChunkDigest;
use kiln_store::readcache::ReadCache;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// Set (to the cache directory) in the children; the child test does nothing without it.
const CHILD_DIR: &str = "KILN_TEST_READCACHE_CHILD_DIR";
/// Set (to a path) in the children: each waits until it exists, so that both fill at once.
const CHILD_GO: &str = "KILN_TEST_READCACHE_CHILD_GO";
/// Which child this is (`0` or `1`): picks its own chunks beside the shared ones.
const CHILD_SEED: &str = "KILN_TEST_READCACHE_CHILD_SEED";
/// The bound of the shared cache, bytes: about 20 of the chunks below.
const BOUND: u64 = 256 * 1024;
/// Chunks each child puts.
const CHUNKS: u32 = 600;
/// Concurrent putting tasks per child.
const TASKS: u32 = 4;

/// Chunk `i` of `owner` (`u32::MAX` for the chunks both children put): 4 to 20 KiB of bytes
/// that differ per chunk.
fn chunk(owner: u32, i: u32) -> Vec<u8> {
    let len = 4096 + (i as usize * 997) % 16384;
    let mut out = vec![0; len];
    StdRng::seed_from_u64(u64::from(owner) << 32 | u64::from(i)).fill_bytes(&mut out);
    out
}

/// Entries of the cache directory: (name, bytes), excluding the cache's own files (dot names).
fn entries(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        // An entry evicted between the listing and the read is gone; skip it.
        if let Ok(b) = std::fs::read(e.path()) {
            out.push((name, b));
        }
    }
    out
}

#[test]
fn two_processes_fill_one_cache_within_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let go = tempfile::tempdir().unwrap();
    let go = go.path().join("go");
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|seed| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "fill_as_child",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_DIR, dir.path())
                .env(CHILD_SEED, seed.to_string())
                .env(CHILD_GO, &go)
                .stdin(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::fs::write(&go, b"").unwrap();
    // While they run: the total of entries and index, looked at under the cache's lock, stays
    // in bound.
    let mut looks = 0;
    loop {
        if children.iter_mut().all(|c| c.try_wait().unwrap().is_some()) {
            break;
        }
        let held = ReadCache::locked(dir.path(), || {
            let mut sum = 0;
            for e in std::fs::read_dir(dir.path()).unwrap() {
                let e = e.unwrap();
                if !e.file_name().to_string_lossy().starts_with(".tmp") {
                    sum += e.metadata().map(|m| m.size()).unwrap_or(0);
                }
            }
            sum
        })
        .unwrap();
        assert!(
            held <= BOUND,
            "{held} bytes held under the lock, over {BOUND}"
        );
        looks += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    for mut c in children {
        assert!(c.wait().unwrap().success(), "a child failed");
    }
    eprintln!("{looks} looks under the lock while the children ran");

    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with(".tmp")),
        "temp files left: {names:?}"
    );
    let es = entries(dir.path());
    let total: u64 = es.iter().map(|(_, b)| b.len() as u64).sum();
    let index = std::fs::metadata(dir.path().join(kiln_store::readcache::INDEX))
        .unwrap()
        .len();
    assert!(
        total + index <= BOUND,
        "{total} bytes of entries and {index} of index in the cache, over {BOUND}"
    );
    // Both filled it far past the bound, so it is close to full.
    assert!(total > BOUND / 2, "only {total} bytes left in the cache");
    for (name, b) in &es {
        assert_eq!(
            &ChunkDigest::of(b).hex(),
            name,
            "entry {name} does not verify"
        );
    }
    // The total the cache keeps is the directory's.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(ReadCache::open(dir.path(), BOUND)).unwrap();
    assert_eq!(c.size(), total);
    assert_eq!(c.len(), es.len());
}

/// The child's part of the test above; passes at once when run on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_as_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let seed: u32 = std::env::var(CHILD_SEED).unwrap().parse().unwrap();
    let go = std::env::var(CHILD_GO).unwrap();
    while !Path::new(&go).exists() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let cache = std::sync::Arc::new(ReadCache::open(Path::new(&dir), BOUND).await.unwrap());
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let cache = cache.clone();
        tasks.push(tokio::spawn(async move {
            let mut hits = 0;
            for i in (t..CHUNKS).step_by(TASKS as usize) {
                // Every third chunk is put by both children.
                let owner = if i % 3 == 0 { u32::MAX } else { seed };
                let raw = chunk(owner, i);
                let d = ChunkDigest::of(&raw);
                cache.put(&d, raw.into()).await;
                // Read back a recent chunk of this task: whole and right, or a miss.
                let back = i.saturating_sub(TASKS);
                let owner = if back % 3 == 0 { u32::MAX } else { seed };
                let raw = chunk(owner, back);
                let d = ChunkDigest::of(&raw);
                if let Some(b) = cache.get(&d).await {
                    assert_eq!(b, raw, "chunk {back} read back wrong");
                    hits += 1;
                }
            }
            hits
        }));
    }
    let mut hits = 0;
    for t in tasks {
        hits += t.await.unwrap();
    }
    eprintln!("child {seed}: {hits} hits");
}
