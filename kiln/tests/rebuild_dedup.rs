//! A rebuild with one small change stores few new bytes (issue 16): two `kiln build`s of one
//! Dockerfile into one store, the second with one line added to one context file. The share
//! of the second image's non-hole ext4 chunk bytes that the first image did not already have
//! must stay at or below 3% (the goal). With a file-system UUID per image digest it
//! was far above: `metadata_csum` spreads the UUID into every inode table, bitmap and
//! directory block, so about every chunk holding metadata was new.

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

use kiln_store::{Manifest, Store, TagRef};
use kiln_tests::require_env;

fn build(store: &Path, ctx: &Path, tag: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", store)
        .arg("build")
        .arg(ctx)
        .args(["-t", tag, "--progress", "plain"])
        .output()
        .expect("run kiln");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn one_changed_context_file_adds_at_most_three_percent_new_chunk_bytes() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let ctx = t.path().join("ctx");
    let store_dir = t.path().join("store");
    std::fs::create_dir_all(ctx.join("app")).expect("mkdir");
    std::fs::write(
        ctx.join("Dockerfile"),
        format!("FROM {bb}\nCOPY app /app\nRUN cat /app/0.txt > /copied\n"),
    )
    .expect("write");
    // 400 files of distinct text, about 16 MiB: large against the chunks (64 KiB on average),
    // as real images are. On a tree of a few MiB the three 4 KiB blocks that such a change
    // really touches (the file's data, its inode, its directory) make three whole chunks new,
    // which alone is several percent.
    for i in 0..400 {
        let body: String = (0..2000)
            .map(|l| format!("file {i:03} line {l:05}\n"))
            .collect();
        std::fs::write(ctx.join(format!("app/{i}.txt")), body).expect("write");
    }
    build(&store_dir, &ctx, "dedup:1");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(ctx.join("app/200.txt"))
        .expect("open");
    std::io::Write::write_all(&mut f, b"one more line\n").expect("append");
    drop(f);
    build(&store_dir, &ctx, "dedup:2");

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let store = Store::open(store_dir.to_str().expect("utf-8"))
            .await
            .expect("store");
        let disk = |tag: &'static str| {
            let store = &store;
            async move {
                let t: TagRef = tag.parse().expect("tag");
                let d = store.resolve_tag(&t).await.expect("tag set");
                match store.get_manifest(&d).await.expect("manifest") {
                    Manifest::Image(m) => m.disk,
                    other => panic!("{tag} names {other:?}"),
                }
            }
        };
        let (a, b) = (disk("dedup:1").await, disk("dedup:2").await);
        assert_ne!(a, b, "the second image holds the changed file");
        let have: HashSet<_> = a.entries.iter().filter_map(|e| e.digest).collect();
        let data = b.entries.iter().filter(|e| !e.is_hole());
        let (mut total, mut new) = (0u64, 0u64);
        for e in data {
            total += e.raw_len;
            if !e.digest.is_some_and(|d| have.contains(&d)) {
                new += e.raw_len;
            }
        }
        let share = new as f64 / total as f64;
        eprintln!("new chunk bytes: {new} of {total} ({:.2}%)", share * 100.0);
        assert!(total > 0);
        assert!(
            share <= 0.03,
            "{new} of {total} non-hole bytes are new ({:.2}%)",
            share * 100.0
        );
    });
}
