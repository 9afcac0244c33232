//! Clone benchmark (issue 8), run by `ci/bench-clone.sh`; not a test.
//!
//! Same image, same run: the busybox fixture with the guest init (start command + ready
//! check), booted cold to READY `KILN_BENCH_RUNS` times (each a full boot-once snapshot into a
//! local store), and started from its snapshot `KILN_BENCH_RUNS` times (one clone at a time,
//! stopped before the next: QEMU spawned → the guest answered `restore`). Prints the median,
//! min and max of both, and the snapshot's stored memory bytes against guest RAM.
//!
//! Env: `KILN_TEST_CACHE`, `KILN_TEST_BUSYBOX_OCI` (from ci/setup.sh), `KILN_BENCH_RUNS`
//! (default 10), `KILN_BENCH_MEMORY_MIB` (default 256), `KILN_BENCH_DIR` (work directory).

use std::path::PathBuf;
use std::time::Duration;

use kiln_store::{ReadySpec, SandboxSpec, StartSpec, Store, TagRef};
use kiln_tests::vm::{busybox_image, guest_assets, sh};
use kiln_vmm::clone::{self, CloneOptions, Serving};
use kiln_vmm::snapshot::{SnapshotOptions, snapshot_image};

fn stats(mut v: Vec<Duration>) -> String {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    format!(
        "median {:8.1} ms   min {:8.1}   max {:8.1}   (n={})",
        ms(v[v.len() / 2]),
        ms(v[0]),
        ms(v[v.len() - 1]),
        v.len()
    )
}

#[tokio::main]
async fn main() {
    kiln_pipeline::qemu_cgroups::install();
    let runs: usize = std::env::var("KILN_BENCH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let mem_mib: u64 = std::env::var("KILN_BENCH_MEMORY_MIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    let work = PathBuf::from(
        std::env::var("KILN_BENCH_DIR").unwrap_or_else(|_| "/tmp/kiln-bench-clone".into()),
    );
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("work dir");

    let assets = guest_assets();
    let store = Store::open(work.join("store").to_str().expect("utf-8"))
        .await
        .expect("store");
    let tag: TagRef = "bench:latest".parse().expect("tag");
    let snap: TagRef = "bench:snap".parse().expect("tag");
    busybox_image(
        &store,
        &work,
        &tag,
        SandboxSpec {
            start: Some(StartSpec {
                argv: sh("echo up > /tmp/started; exec sleep 1000000"),
                user: None,
                env: vec![],
                workdir: None,
            }),
            ready: Some(ReadySpec {
                argv: sh("test -f /tmp/started"),
                interval_ms: 50,
                timeout_ms: 2000,
                retries: 200,
            }),
        },
    )
    .await;

    let opts = SnapshotOptions {
        memory_bytes: mem_mib << 20,
        work_dir: work.clone(),
        ..Default::default()
    };
    let mut boots = Vec::new();
    let mut last = None;
    for i in 0..runs {
        let r = snapshot_image(&store, &tag, &snap, &assets, &opts)
            .await
            .expect("boot once");
        eprintln!(
            "cold boot {i}: ready in {:?} (save {:?})",
            r.boot_to_ready, r.save
        );
        boots.push(r.boot_to_ready);
        last = Some(r);
    }
    let r = last.expect("at least one run");

    let mut copts = CloneOptions::new(
        work.join("state"),
        work.join("cache"),
        Serving::Materialized,
    );
    copts.count = 1;
    let mut starts = Vec::new();
    let mut walls = Vec::new();
    for i in 0..=runs {
        let t = std::time::Instant::now();
        let c = clone::start_clones(&store, &snap, &copts)
            .await
            .expect("clone");
        let wall = t.elapsed();
        let c = &c[0];
        if i == 0 {
            // The first start also materializes the snapshot into the cache: reported apart.
            eprintln!(
                "first clone start (materializes memory and disk): {wall:?}, QEMU → answered {} ms",
                c.start_ms
            );
        } else {
            eprintln!(
                "clone start {}: answered in {} ms (whole call {wall:?})",
                i - 1,
                c.start_ms
            );
            starts.push(Duration::from_millis(c.start_ms));
            walls.push(wall);
        }
        clone::stop(&copts.state_dir, &c.id).await.expect("stop");
    }

    // Three clones at once: how much guest RAM they share (Rss vs Pss of each QEMU, from
    // /proc/<pid>/smaps_rollup, kB).
    copts.count = 3;
    let three = clone::start_clones(&store, &snap, &copts)
        .await
        .expect("3 clones");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rollup = |pid: u32, field: &str| kiln_tests::vm::smaps_rollup_kb(pid.into(), field);
    let (rss, pss): (Vec<u64>, Vec<u64>) = three
        .iter()
        .map(|c| (rollup(c.pid, "Rss:"), rollup(c.pid, "Pss:")))
        .unzip();
    for c in &three {
        clone::stop(&copts.state_dir, &c.id).await.expect("stop");
    }

    println!("accelerator           {}", r.accel.name());
    println!("cold boot to READY    {}", stats(boots));
    println!("clone start→answered  {}", stats(starts));
    println!("start_clones (cached) {}", stats(walls));
    println!(
        "guest RAM {} MiB; memory file non-zero {:.1} MiB; stored (zstd chunks) {:.1} MiB = {:.1}% of RAM; vmstate {} KiB",
        r.memory_bytes >> 20,
        r.memory_nonzero_bytes as f64 / 1048576.0,
        r.memory_stored_bytes as f64 / 1048576.0,
        100.0 * r.memory_stored_bytes as f64 / r.memory_bytes as f64,
        r.vmstate_bytes >> 10
    );
    println!(
        "3 clones at once: QEMU Rss {:?} MiB, Pss {:?} MiB (Pss < Rss: pages shared)",
        rss.iter().map(|k| k >> 10).collect::<Vec<_>>(),
        pss.iter().map(|k| k >> 10).collect::<Vec<_>>()
    );
}
