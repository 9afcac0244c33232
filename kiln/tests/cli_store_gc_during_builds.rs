//! GC with no grace period while builds and a push write into the same local store (issue
//! 17, "Faults the store and the builder must survive", 1): every object a build or push
//! writes or reuses is under its lease from before it is written or found, so `kiln store gc
//! --grace 0s` in a loop beside them deletes none of it. Every build and push succeeds,
//! every tag resolves, and `kiln store verify --deep` finds nothing wrong. Runs `kiln` as
//! processes, as a user would; needs root (builds run steps), the test registry's busybox
//! image (`KILN_TEST_BUSYBOX_REF`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kiln_tests::require_env;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

fn kiln(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_STORE", store)
        .output()
        .expect("run kiln")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// 1 MiB of pseudo-random data from `seed` (distinct chunks per seed).
fn artifact(path: &Path, seed: u32) {
    let mut b = vec![0; 1 << 20];
    StdRng::seed_from_u64(seed.into()).fill_bytes(&mut b);
    std::fs::write(path, b).expect("write artifact");
}

/// Builders, rounds per builder, pushes: 3 × 2 builds and 3 pushes beside the GC loop.
const BUILDERS: usize = 3;
const ROUNDS: usize = 2;
const PUSHES: u32 = 3;

#[test]
fn gc_with_no_grace_during_builds_and_a_push_loses_nothing() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let t = tempfile::tempdir().expect("tempdir");
    let store = t.path().join("store");
    let source = t.path().join("source");
    let dest = store.to_str().expect("utf-8 path").to_string();
    // An empty store, so that GC has one to look at from the start.
    std::fs::create_dir(&store).expect("mkdir store");

    // The images a push copies in, imported into another store first.
    for i in 0..PUSHES {
        let f = t.path().join(format!("push-{i}.img"));
        artifact(&f, i);
        let tag = format!("pushed:{i}");
        let o = kiln(&source, &["store", "import", f.to_str().unwrap(), &tag]);
        assert!(o.status.success(), "import {tag}: {}", text(&o));
    }

    let done = Arc::new(AtomicBool::new(false));
    let gc = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let mut runs = 0usize;
            let mut failures = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let o = kiln(&store, &["store", "gc", "--grace", "0s"]);
                if !o.status.success() {
                    failures.push(text(&o));
                }
                runs += 1;
            }
            (runs, failures)
        })
    };

    let mut workers = Vec::new();
    for b in 0..BUILDERS {
        let (store, bb, dir) = (store.clone(), bb.clone(), t.path().join(format!("ctx-{b}")));
        workers.push(std::thread::spawn(move || {
            let mut results: Vec<(String, Output)> = Vec::new();
            for r in 0..ROUNDS {
                let ctx: PathBuf = dir.join(r.to_string());
                std::fs::create_dir_all(&ctx).expect("mkdir");
                // A step every build shares (cache hits, reused chunks) and one of its own.
                std::fs::write(
                    ctx.join("Dockerfile"),
                    format!("FROM {bb}\nRUN echo shared > /shared\nRUN echo {b}-{r} > /mine\n"),
                )
                .expect("write Dockerfile");
                let tag = format!("built{b}:r{r}");
                let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
                    .env("KILN_STORE", &store)
                    .arg("build")
                    .arg(&ctx)
                    .args(["-t", &tag, "--progress", "plain"])
                    .output()
                    .expect("run kiln build");
                results.push((tag, o));
            }
            results
        }));
    }
    let pusher = {
        let (source, dest) = (source.clone(), dest.clone());
        std::thread::spawn(move || {
            (0..PUSHES)
                .map(|i| {
                    let tag = format!("pushed:{i}");
                    let o = kiln(&source, &["store", "push", &tag, "--to", &dest]);
                    (tag, o)
                })
                .collect::<Vec<_>>()
        })
    };

    let mut results = Vec::new();
    for w in workers {
        results.extend(w.join().expect("builder thread"));
    }
    results.extend(pusher.join().expect("pusher thread"));
    done.store(true, Ordering::Relaxed);
    let (runs, gc_failures) = gc.join().expect("gc thread");
    // One more GC with everything finished: only what no tag reaches may go.
    let o = kiln(&store, &["store", "gc", "--grace", "0s"]);
    assert!(o.status.success(), "{}", text(&o));

    let failed: Vec<String> = results
        .iter()
        .filter(|(_, o)| !o.status.success())
        .map(|(tag, o)| format!("{tag}: {}", text(o)))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} builds and pushes failed beside {runs} GC runs:\n{}",
        failed.len(),
        results.len(),
        failed.join("\n")
    );
    assert!(gc_failures.is_empty(), "GC failed: {gc_failures:?}");
    for (tag, _) in &results {
        let out = t.path().join(format!("{}.img", tag.replace(':', "-")));
        let o = kiln(&store, &["store", "export", tag, out.to_str().unwrap()]);
        assert!(
            o.status.success(),
            "tag {tag} does not resolve: {}",
            text(&o)
        );
    }
    let o = kiln(&store, &["store", "verify", "--deep", "--grace", "0s"]);
    assert!(
        o.status.success(),
        "verify --deep after {runs} GC runs: {}",
        text(&o)
    );
    assert!(runs > 0);
}
