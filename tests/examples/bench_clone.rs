//! Clone benchmark (issues 8 and 35), run by `ci/bench-clone.sh`; not a test. Every VM is
//! started by the `kiln` binary `KILN_BENCH_KILN` (the script builds it, release by default),
//! so the times are those of the real commands; this program only drives them and counts.
//!
//! Same image, same run:
//! 1. the image (`busybox`: the busybox fixture, 64 MiB; `debian`: the Debian fixture,
//!    512 MiB; each with a start command and a ready check) is put into a local build store
//!    and booted cold to READY `KILN_BENCH_RUNS` times by `kiln snapshot` (each a full
//!    boot-once snapshot; QEMU spawned → ready check passed, the guest's wait for idle
//!    after it reported apart);
//! 2. the last snapshot is pushed to the store `KILN_BENCH_STORE` (a local directory by
//!    default, `s3://…` for the local S3 server);
//! 3. lazy starts, cold and warm taking turns, `KILN_BENCH_RUNS` of each: a cold `kiln start`
//!    from that store with an empty snapshot cache and chunk cache (a chunk server of its own
//!    each time; only the host's QEMU facts are copied in, [`host_facts`]), with what the
//!    chunk server had fetched when `kiln start` returned (the clone answered) and after one
//!    `kiln exec` in it, counted by [`kiln_tests::lazy::fetched`] as `kiln/tests/vm_lazy.rs`
//!    counts it; then a warm `kiln start` on the first cold start's cache and running chunk
//!    server (that clone kept running meanwhile, so the server stays);
//! 4. two more clones beside the first cold one: three at once, summed Pss against summed
//!    Rss of their QEMUs;
//! 5. `kiln start --materialize`: `KILN_BENCH_MATERIALIZE_RUNS` cold (empty cache, the
//!    whole snapshot downloaded first) and `KILN_BENCH_RUNS` warm (cache filled).
//!
//! Every start has the accelerator the snapshot was made with in `KILN_ACCEL` (a host that
//! has probed before; the probe is not part of a start's time), and the QEMU facts of an
//! earlier start on this host. Times: "answered" is the
//! start's `start_ms` (QEMU spawned → the guest answered `restore`), "whole" the wall time
//! of the `kiln start` process; a start's phases (`prepare_ms`, `spawn_ms`, `resume_ms`,
//! `guest_ms` of its `started` event), warm and cold, say where that time went. Prints a
//! table on stdout, progress on stderr.
//!
//! Env: `KILN_BENCH_KILN` (required), `KILN_BENCH_IMAGE` (`busybox`|`debian`, default
//! busybox), `KILN_BENCH_STORE` (default: the build store), `KILN_BENCH_MEMORY_MIB`
//! (default 256), `KILN_BENCH_RUNS` (default 10), `KILN_BENCH_MATERIALIZE_RUNS` (default 3),
//! `KILN_BENCH_DIR` (work directory, emptied first), `KILN_BENCH_PREFETCH_RESTORES`
//! (`kiln snapshot --prefetch-restores`; default: kiln's); `KILN_TEST_BUSYBOX_OCI` or
//! `KILN_TEST_DEBIAN_OCI`, the guest kernel and, for S3, the `AWS_*` variables (from
//! ci/setup.sh's env file).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kiln_store::{ReadySpec, SandboxSpec, StartSpec, Store, TagRef};
use kiln_tests::lazy::{Fetched, fetched, snapshot_of};
use kiln_tests::vm::{StopClones, busybox_image, guest_assets, oci_image, sh, smaps_rollup_kb};
use serde_json::Value;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Median, min and max of `v` (milliseconds), as text.
fn stats(v: &[f64]) -> String {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return "-".into();
    }
    format!(
        "{:8.0} ms ({:.0}–{:.0}, n={})",
        v[v.len() / 2],
        v[0],
        v[v.len() - 1],
        v.len()
    )
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `kiln` with its store, state dir, snapshot cache and chunk cache, the guest kernel and
/// initramfs, and the accelerator.
struct Kiln {
    bin: PathBuf,
    work: PathBuf,
    accel: Option<String>,
}

impl Kiln {
    fn run(&self, store: &str, cache: &Path, args: &[&str]) -> (Output, Duration) {
        let a = guest_assets();
        let mut c = Command::new(&self.bin);
        c.args(args)
            .env("KILN_STORE", store)
            .env("KILN_STATE_DIR", self.work.join("state"))
            .env("KILN_SNAPSHOT_CACHE", cache)
            .env("KILN_CACHE", cache.join("kcache"))
            .env("KILN_KERNEL", &a.kernel)
            .env("KILN_INITRAMFS", &a.initramfs)
            .env("TMPDIR", &self.work);
        if let Some(accel) = &self.accel {
            c.env("KILN_ACCEL", accel);
        }
        let t = Instant::now();
        let o = c.output().expect("run kiln");
        let wall = t.elapsed();
        assert!(
            o.status.success(),
            "kiln {args:?}: exit {:?}\nstdout: {}\nstderr: {}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o, wall)
    }

    /// `kiln --json start ARGS…`: the `started` events and the wall time, ms.
    fn start(&self, store: &str, cache: &Path, args: &[&str]) -> (Vec<Value>, f64) {
        let mut a = vec!["--json", "start", "bench:snap"];
        a.extend_from_slice(args);
        let (o, wall) = self.run(store, cache, &a);
        (events(&o, "started"), wall.as_secs_f64() * 1000.0)
    }

    fn stop(&self, store: &str, cache: &Path, id: &str) {
        self.run(store, cache, &["stop", id]);
    }
}

/// A cold start's host is not a new host: the QEMU facts an earlier start on it remembered
/// (`kiln_vmm::clone::QEMU_FACTS` in the snapshot cache: QEMU's version and its jail's root
/// plan, from `ldd` and `-L help`) are copied from `from` into the empty cache `to`, as the
/// accelerator probe's answer is handed to every start in `KILN_ACCEL`. Nothing of the
/// snapshot is copied. Without it each cold start also ran those two commands: about 100 ms
/// more in `spawn_ms` (three Debian cold starts, issue 35).
fn host_facts(from: &Path, to: &Path) {
    let facts = from.join(kiln_vmm::clone::QEMU_FACTS);
    if facts.is_file() {
        std::fs::create_dir_all(to).expect("cache dir");
        std::fs::copy(&facts, to.join(kiln_vmm::clone::QEMU_FACTS)).expect("copy QEMU facts");
    }
}

fn events(o: &Output, name: &str) -> Vec<Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == name)
        .collect()
}

/// The phases of a `started` event (`phases`, kiln-vmm's `StartPhases`): before QEMU, then
/// the three parts of "answered". The whole `kiln start` less their sum is the process's own
/// start and exit.
const PHASES: [&str; 4] = ["prepare_ms", "spawn_ms", "resume_ms", "guest_ms"];

/// The [`PHASES`] of a run of starts, ms, one list per phase.
#[derive(Default)]
struct Phases([Vec<f64>; 4]);

impl Phases {
    /// Adds the phases of one `started` event.
    fn push(&mut self, started: &Value) {
        for (v, name) in self.0.iter_mut().zip(PHASES) {
            v.push(started["phases"][name].as_f64().unwrap_or(0.0));
        }
    }

    /// One table line per phase, labelled `what` (warm, cold).
    fn print(&self, what: &str) {
        for (v, name) in self.0.iter().zip(PHASES) {
            println!("  {what} phase {name:21} {}", stats(v));
        }
    }
}

fn ms_of(v: &Value, field: &str) -> f64 {
    v[field].as_u64().unwrap_or(0) as f64
}

fn main() {
    let bin = PathBuf::from(std::env::var("KILN_BENCH_KILN").expect("KILN_BENCH_KILN"));
    let image: String = env_or("KILN_BENCH_IMAGE", "busybox".to_string());
    let runs: usize = env_or("KILN_BENCH_RUNS", 10).max(1);
    let mat_runs: usize = env_or("KILN_BENCH_MATERIALIZE_RUNS", 3).max(1);
    let mem_mib: u64 = env_or("KILN_BENCH_MEMORY_MIB", 256);
    let work = PathBuf::from(env_or(
        "KILN_BENCH_DIR",
        "/tmp/kiln-bench-clone".to_string(),
    ));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("work dir");
    let build = work
        .join("build-store")
        .to_str()
        .expect("utf-8")
        .to_string();
    let store_url: String = env_or("KILN_BENCH_STORE", build.clone());
    let _stop = StopClones::new(bin.to_str().expect("utf-8"), &work);
    let mut k = Kiln {
        bin,
        work: work.clone(),
        accel: None,
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");

    // 1. The image, and cold boots to READY.
    let sandbox = SandboxSpec {
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
    };
    rt.block_on(async {
        let store = Store::open(&build).await.expect("build store");
        let tag: TagRef = "bench:img".parse().expect("tag");
        match image.as_str() {
            "busybox" => busybox_image(&store, &work, &tag, sandbox).await,
            "debian" => {
                oci_image(
                    &store,
                    &work,
                    "KILN_TEST_DEBIAN_OCI",
                    "bookworm",
                    512,
                    &tag,
                    sandbox,
                )
                .await
            }
            other => panic!("KILN_BENCH_IMAGE={other}: busybox or debian"),
        }
    });
    let build_cache = work.join("cache-build");
    let mem = mem_mib.to_string();
    let (mut boots, mut settles, mut snap_walls) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = Value::Null;
    let restores = std::env::var("KILN_BENCH_PREFETCH_RESTORES").ok();
    let mut snap_args = vec![
        "--json",
        "snapshot",
        "bench:img",
        "-t",
        "bench:snap",
        "--memory-mib",
        &mem,
    ];
    if let Some(n) = &restores {
        snap_args.extend(["--prefetch-restores", n.as_str()]);
    }
    for i in 0..runs {
        let (o, wall) = k.run(&build, &build_cache, &snap_args);
        let e = events(&o, "snapshot").pop().expect("a snapshot event");
        eprintln!(
            "cold boot {i}: ready in {} ms, idle {} ms later, saved in {} ms, kiln snapshot {:?}",
            e["boot_to_ready_ms"], e["settle_ms"], e["save_ms"], wall
        );
        boots.push(ms_of(&e, "boot_to_ready_ms"));
        settles.push(ms_of(&e, "settle_ms"));
        snap_walls.push(wall.as_secs_f64() * 1000.0);
        last = e;
    }
    k.accel = last["accel"].as_str().map(str::to_string);

    // 2. Into the store measured.
    if store_url != build {
        k.run(
            &build,
            &build_cache,
            &["store", "push", "bench:snap", "--to", &store_url],
        );
    }
    let (digest, snap) = rt.block_on(async {
        let s = Store::open(&store_url).await.expect("store");
        snapshot_of(&s, &"bench:snap".parse().expect("tag")).await
    });

    // 3. Cold and warm lazy starts, taking turns: a cold start (empty caches), then a warm one
    //    beside the first cold clone (kept running, so its chunk server stays), and so on, so
    //    each pair meets the host in the same state (a 2-core host's load and the S3 server's
    //    drift over a run: measured one block after the other, runs of one binary gave
    //    cold/warm from 1.76x to 2.82x, issue 35).
    let (mut cold_ans, mut cold_whole) = (Vec::new(), Vec::new());
    let (mut warm_ans, mut warm_whole) = (Vec::new(), Vec::new());
    let (mut cold_phases, mut warm_phases) = (Phases::default(), Phases::default());
    let (mut at_answer, mut after_exec): (Vec<[Fetched; 2]>, Vec<[Fetched; 2]>) =
        (Vec::new(), Vec::new());
    let mut anchor: Option<(PathBuf, String)> = None;
    for i in 0..runs {
        let cache = work.join(format!("cache-cold-{i}"));
        host_facts(&build_cache, &cache);
        let (started, whole) = k.start(&store_url, &cache, &[]);
        let c = &started[0];
        cold_phases.push(c);
        let snapdir = cache.join(digest.hex());
        let f = fetched(&snapdir, &snap);
        let id = c["id"].as_str().expect("id").to_string();
        k.run(&store_url, &cache, &["exec", &id, "--", "true"]);
        let g = fetched(&snapdir, &snap);
        eprintln!(
            "cold lazy start {i}: answered in {} ms, whole {whole:.0} ms; memory served {:.2}% \
             of RAM, disk served {:.2}% of non-zero",
            c["start_ms"],
            Fetched::pct(f[0].served, f[0].size),
            Fetched::pct(f[1].served, f[1].nonzero)
        );
        cold_ans.push(ms_of(c, "start_ms"));
        cold_whole.push(whole);
        at_answer.push(f);
        after_exec.push(g);
        if anchor.is_none() {
            anchor = Some((cache, id));
        } else {
            k.stop(&store_url, &cache, &id);
        }
        let (warm_cache, _) = anchor.as_ref().expect("the first cold start");
        let (started, whole) = k.start(&store_url, warm_cache, &[]);
        let c = &started[0];
        warm_phases.push(c);
        eprintln!(
            "warm lazy start {i}: answered in {} ms, whole {whole:.0} ms",
            c["start_ms"]
        );
        warm_ans.push(ms_of(c, "start_ms"));
        warm_whole.push(whole);
        k.stop(&store_url, warm_cache, c["id"].as_str().expect("id"));
    }
    let (warm_cache, anchor_id) = anchor.expect("a cold start");

    // 4. Three lazy clones at once: two more beside the first cold one.
    let (two, _) = k.start(&store_url, &warm_cache, &["--count", "2"]);
    std::thread::sleep(Duration::from_secs(2));
    let mut pids: Vec<u64> = two.iter().filter_map(|c| c["pid"].as_u64()).collect();
    let anchor_rec: Value = serde_json::from_slice(
        &std::fs::read(
            work.join("state/clones")
                .join(&anchor_id)
                .join("clone.json"),
        )
        .expect("the cold clone's record"),
    )
    .expect("clone.json");
    pids.extend(anchor_rec["pid"].as_u64());
    let (rss, pss) = pids.iter().fold((0, 0), |(r, p), pid| {
        (
            r + smaps_rollup_kb(*pid, "Rss:"),
            p + smaps_rollup_kb(*pid, "Pss:"),
        )
    });
    for c in &two {
        k.stop(&store_url, &warm_cache, c["id"].as_str().expect("id"));
    }
    k.stop(&store_url, &warm_cache, &anchor_id);

    // 5. Materialized starts.
    let (mut mat_cold_ans, mut mat_cold_whole) = (Vec::new(), Vec::new());
    let mut mat_cache = work.clone();
    for i in 0..mat_runs {
        mat_cache = work.join(format!("cache-mat-{i}"));
        host_facts(&build_cache, &mat_cache);
        let (started, whole) = k.start(&store_url, &mat_cache, &["--materialize"]);
        let c = &started[0];
        eprintln!(
            "cold materialized start {i}: answered in {} ms, whole {whole:.0} ms",
            c["start_ms"]
        );
        mat_cold_ans.push(ms_of(c, "start_ms"));
        mat_cold_whole.push(whole);
        k.stop(&store_url, &mat_cache, c["id"].as_str().expect("id"));
    }
    let (mut mat_ans, mut mat_whole) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let (started, whole) = k.start(&store_url, &mat_cache, &["--materialize"]);
        let c = &started[0];
        eprintln!(
            "warm materialized start {i}: answered in {} ms, whole {whole:.0} ms",
            c["start_ms"]
        );
        mat_ans.push(ms_of(c, "start_ms"));
        mat_whole.push(whole);
        k.stop(&store_url, &mat_cache, c["id"].as_str().expect("id"));
    }

    // The table.
    let pcts = |v: &[[Fetched; 2]], file: usize, of_nonzero: bool, prefetched: bool| {
        let xs: Vec<f64> = v
            .iter()
            .map(|f| {
                let f = &f[file];
                let part = if prefetched { f.fetched } else { f.served };
                Fetched::pct(part, if of_nonzero { f.nonzero } else { f.size })
            })
            .collect();
        let (mut lo, mut hi) = (f64::MAX, f64::MIN);
        for x in &xs {
            lo = lo.min(*x);
            hi = hi.max(*x);
        }
        format!("{:6.2}% ({lo:.2}–{hi:.2})", median(&xs))
    };
    let m = &at_answer[0][0];
    let d = &at_answer[0][1];
    println!(
        "image {image}; guest RAM {mem_mib} MiB; store {store_url}; accelerator {}; runs {runs}; \
         prefetch restores {}",
        k.accel.as_deref().unwrap_or("?"),
        restores.as_deref().unwrap_or("default")
    );
    println!(
        "snapshot: memory {} MiB, {:.1} MiB non-zero in {} chunks of {} KiB; disk {} MiB, \
         {:.1} MiB non-zero; prefetch list {} memory + {} disk chunks",
        m.size >> 20,
        m.nonzero as f64 / 1048576.0,
        snap.memory
            .entries
            .iter()
            .filter(|e| e.digest.is_some())
            .count(),
        snap.memory.entries.first().map_or(0, |e| e.raw_len >> 10),
        d.size >> 20,
        d.nonzero as f64 / 1048576.0,
        snap.prefetch.as_ref().map_or(0, |l| l.memory.len()),
        snap.prefetch.as_ref().map_or(0, |l| l.disk.len()),
    );
    println!("cold boot to READY (kiln snapshot) {}", stats(&boots));
    println!("  ready check passed → guest idle  {}", stats(&settles));
    println!("  whole kiln snapshot              {}", stats(&snap_walls));
    println!("lazy cold, answered                {}", stats(&cold_ans));
    println!("lazy cold, whole kiln start        {}", stats(&cold_whole));
    println!("lazy warm, answered                {}", stats(&warm_ans));
    println!("lazy warm, whole kiln start        {}", stats(&warm_whole));
    warm_phases.print("warm");
    cold_phases.print("cold");
    println!(
        "materialize cold, answered         {}",
        stats(&mat_cold_ans)
    );
    println!(
        "materialize cold, whole kiln start {}",
        stats(&mat_cold_whole)
    );
    println!("materialize warm, answered         {}", stats(&mat_ans));
    println!("materialize warm, whole kiln start {}", stats(&mat_whole));
    println!(
        "fetched (median, range of {runs} cold lazy starts)   served only      served or prefetched"
    );
    for (label, v) in [("at answer", &at_answer), ("after exec", &after_exec)] {
        println!(
            "  memory, of guest RAM, {label:10}    {}   {}",
            pcts(v, 0, false, false),
            pcts(v, 0, false, true)
        );
        println!(
            "  disk, of non-zero,    {label:10}    {}   {}",
            pcts(v, 1, true, false),
            pcts(v, 1, true, true)
        );
    }
    let ratio = |a: &[f64], b: &[f64]| median(a) / median(b);
    println!(
        "cold/warm lazy: answered {:.2}x, whole {:.2}x (goal <= 2x)",
        ratio(&cold_ans, &warm_ans),
        ratio(&cold_whole, &warm_whole)
    );
    println!(
        "cold boot / warm lazy: answered {:.1}x (goal >= 20x), whole kiln start {:.1}x (goal >= 10x)",
        ratio(&boots, &warm_ans),
        ratio(&boots, &warm_whole)
    );
    println!(
        "3 lazy clones at once: summed Pss {} MiB, summed Rss {} MiB",
        pss >> 10,
        rss >> 10
    );
}
