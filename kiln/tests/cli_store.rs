//! The `kiln` binary's store subcommands, end to end: exit codes, `--json` events, a push to
//! moto's S3 and a pull back, verify finding a corrupt chunk, gc --dry-run. Needs the S3 server
//! of `ci/setup.sh` (`source /var/cache/kiln-ci/env`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use serde_json::Value;

fn kiln(store: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_STORE", store)
        .output()
        .unwrap()
}

fn json_lines(o: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

fn last_event<'a>(events: &'a [Value], kind: &str) -> &'a Value {
    events
        .iter()
        .rev()
        .find(|e| e["event"] == kind)
        .unwrap_or_else(|| panic!("no {kind} event in {events:?}"))
}

fn s3_url(label: &str) -> String {
    let bucket = std::env::var("KILN_TEST_S3_BUCKET").unwrap_or_else(|_| {
        panic!("KILN_TEST_S3_BUCKET is not set: run ci/setup.sh and source /var/cache/kiln-ci/env")
    });
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("s3://{bucket}/cli-{}-{nanos}-{label}", std::process::id())
}

/// 2 MiB of data, 1 MiB of zeros, 1 MiB of data: chunks and a hole.
fn artifact(path: &Path, seed: u8) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed.into());
    let mut b = vec![0; 4 << 20];
    rng.fill_bytes(&mut b[..2 << 20]);
    rng.fill_bytes(&mut b[3 << 20..]);
    std::fs::write(path, &b).unwrap();
    b
}

#[test]
fn tags_and_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let file = dir.path().join("a.img");
    artifact(&file, 1);

    let o = kiln(
        &store,
        &[
            "--json",
            "store",
            "import",
            file.to_str().unwrap(),
            "img:v1",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ev = json_lines(&o);
    let imported = last_event(&ev, "imported");
    let digest = imported["manifest"].as_str().unwrap().to_string();
    assert!(imported["chunks"].as_u64().unwrap() > 10);
    // FastCDC boundaries fall inside the zero run, so most (not all) of it is a hole.
    assert!(imported["holeBytes"].as_u64().unwrap() >= 512 << 10);
    assert!(ev.iter().any(|e| e["event"] == "chunk"), "no chunk events");

    // tag by tag and by digest; tags lists both.
    assert!(kiln(&store, &["tag", "img:v1", "img:v2"]).status.success());
    assert!(kiln(&store, &["tag", &digest, "other:x"]).status.success());
    let ev = json_lines(&kiln(&store, &["--json", "tags", "img"]));
    let tags: Vec<&str> = ev.iter().map(|e| e["tag"].as_str().unwrap()).collect();
    assert_eq!(tags, ["img:v1", "img:v2"]);
    assert!(ev.iter().all(|e| e["manifest"] == digest.as_str()));

    // A stale expectation loses with exit 4 and says why.
    let zero = format!("sha256:{}", "0".repeat(64));
    let o = kiln(&store, &["tag", "img:v1", "img:v2", "--expect", &zero]);
    assert_eq!(o.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&o.stderr).contains("stale"));
    let o = kiln(&store, &["tag", "img:v1", "img:v3", "--expect", "absent"]);
    assert!(o.status.success());

    // untag; a missing tag is exit 5, a malformed one exit 1, a usage error exit 2.
    assert!(kiln(&store, &["untag", "img:v1"]).status.success());
    assert_eq!(kiln(&store, &["untag", "img:v1"]).status.code(), Some(5));
    assert_eq!(
        kiln(&store, &["tag", "img:nope", "img:v4"]).status.code(),
        Some(5)
    );
    let o = kiln(&store, &["--json", "tag", "../etc:x", "img:v4"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(last_event(&json_lines(&o), "error")["code"], 1);
    assert_eq!(kiln(&store, &["tag"]).status.code(), Some(2));
}

#[test]
fn push_pull_verify_gc() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let pulled = dir.path().join("pulled");
    let file = dir.path().join("a.img");
    let bytes = artifact(&file, 2);
    let s3 = s3_url("pushpull");
    assert!(
        kiln(
            &store,
            &["store", "import", file.to_str().unwrap(), "img:v1"]
        )
        .status
        .success()
    );

    // Push twice: the second moves nothing.
    let o = kiln(&store, &["--json", "store", "push", "img:v1", "--to", &s3]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first = last_event(&json_lines(&o), "pushed").clone();
    assert!(first["stats"]["chunksTransferred"].as_u64().unwrap() > 10);
    let o = kiln(&store, &["--json", "store", "push", "img:v1", "--to", &s3]);
    let second = last_event(&json_lines(&o), "pushed").clone();
    assert_eq!(second["stats"]["chunksTransferred"], 0);
    assert_eq!(second["dedupRatio"], 1.0);

    // Pull into a fresh store, export, compare.
    let p = pulled.to_str().unwrap();
    let o = kiln(
        &store,
        &["store", "pull", "img:v1", "--from", &s3, "--store", p],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = dir.path().join("out.img");
    let o = kiln(
        &store,
        &[
            "store",
            "export",
            "img:v1",
            out.to_str().unwrap(),
            "--store",
            p,
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&out).unwrap() == bytes);
    for s in [p, s3.as_str()] {
        let o = kiln(&store, &["store", "verify", "--deep", "--store", s]);
        assert!(
            o.status.success(),
            "{s}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }

    // The pull wrote its chunks into one pack, not one file each.
    let packs: Vec<PathBuf> = std::fs::read_dir(pulled.join(".packs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let ends = |ext: &str| -> Vec<&PathBuf> {
        packs
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == ext))
            .collect()
    };
    assert_eq!(ends("pack").len(), 1, "{packs:?}");
    assert_eq!(ends("idx").len(), 1, "{packs:?}");
    let loose = std::fs::read_dir(pulled.join("chunks/sha256"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(loose, 0, "no loose chunk file");

    // Corrupt one chunk of the pulled store (its bytes inside the pack, at the place the
    // pack's index gives for its first entry: `KILNPIDX`, version u32, count u64, then
    // sha256, offset u64 LE, length u64 LE): deep verify names it, exit 3.
    let idx = std::fs::read(ends("idx")[0]).unwrap();
    let entry = &idx[8 + 4 + 8..8 + 4 + 8 + 48];
    let name: String = entry[..32].iter().map(|b| format!("{b:02x}")).collect();
    let offset = u64::from_le_bytes(entry[32..40].try_into().unwrap());
    let len = u64::from_le_bytes(entry[40..48].try_into().unwrap());
    assert!(len >= 8);
    let (pack_file, idx_file) = (ends("pack")[0].clone(), ends("idx")[0].clone());
    let dead_file = pack_file.with_extension("dead");
    {
        use std::os::unix::fs::FileExt;
        let pack = std::fs::OpenOptions::new()
            .write(true)
            .open(&pack_file)
            .unwrap();
        pack.write_all_at(b"not zstd", offset).unwrap();
    }
    let o = kiln(
        &store,
        &["--json", "store", "verify", "--deep", "--store", p],
    );
    assert_eq!(o.status.code(), Some(3));
    let ev = json_lines(&o);
    let finding = last_event(&ev, "finding");
    assert_eq!(finding["finding"], "corruptChunk");
    assert!(finding["chunk"].as_str().unwrap().ends_with(&name));
    // A shallow verify does not read chunks: exit 0.
    assert!(
        kiln(&store, &["store", "verify", "--store", p])
            .status
            .success()
    );

    // Untag, then gc --dry-run lists everything and deletes nothing; gc deletes it.
    assert!(
        kiln(&store, &["untag", "img:v1", "--store", p])
            .status
            .success()
    );
    let o = kiln(
        &store,
        &[
            "--json",
            "store",
            "gc",
            "--dry-run",
            "--grace",
            "0s",
            "--store",
            p,
        ],
    );
    let ev = json_lines(&o);
    let n = last_event(&ev, "gc")["collected"].as_u64().unwrap();
    assert!(n > 10, "{ev:?}");
    // A packed chunk's delete appends to its pack's dead file; a pack goes with its last chunk.
    assert!(
        pack_file.exists()
            && idx_file.exists()
            && std::fs::metadata(&dead_file).unwrap().len() == 0,
        "dry run deleted something"
    );
    let o = kiln(
        &store,
        &["--json", "store", "gc", "--grace", "1h", "--store", p],
    );
    assert_eq!(
        last_event(&json_lines(&o), "gc")["collected"],
        0,
        "young objects deleted"
    );
    let o = kiln(
        &store,
        &["--json", "store", "gc", "--grace", "0s", "--store", p],
    );
    assert_eq!(last_event(&json_lines(&o), "gc")["collected"], n);
    assert!(
        !pack_file.exists() && !idx_file.exists(),
        "the pack of the collected chunks is removed"
    );
    assert!(
        kiln(&store, &["store", "gc", "--grace", "soon"])
            .status
            .code()
            == Some(2)
    );
}

/// Regression (newcomer review, 2026-11-30): read-only commands on a mistyped local store
/// path created an empty store there and reported it healthy (`verify` exited 0). They now
/// refuse with exit code 5 and create nothing; a writing command still creates the store.
#[test]
fn read_only_commands_refuse_a_missing_local_store() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo");
    let m = missing.to_str().unwrap();
    let file_url = format!("file://{m}");
    for args in [
        vec!["store", "verify", "--store", m],
        vec!["store", "gc", "--dry-run", "--store", m],
        vec!["tags", "--store", m],
        vec!["store", "verify", "--store", file_url.as_str()],
        vec!["store", "pull", "app:v1", "--from", m],
    ] {
        let o = kiln(&dir.path().join("default"), &args);
        assert_eq!(o.status.code(), Some(5), "{args:?}: {o:?}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("no store at"), "{args:?}: {stderr}");
        assert!(!missing.exists(), "{args:?} created {m}");
    }
    let file = dir.path().join("artifact");
    std::fs::write(&file, b"some bytes").unwrap();
    let o = kiln(
        &missing,
        &["store", "import", file.to_str().unwrap(), "app:v1"],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(missing.is_dir());
}

/// Sum of the sizes of a local store's pack files.
fn pack_bytes(store: &Path) -> u64 {
    std::fs::read_dir(store.join(".packs"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".pack"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// `kiln store gc` compacts the pack of a collected image whose chunks another image
/// partly reuses: it reports the pack and the bytes reclaimed (the dry run the same), the
/// packs' bytes come down to the stored bytes of the live chunks, and `kiln store verify`
/// is clean, with no dead bytes left.
#[test]
fn gc_compacts_a_partly_dead_pack() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let a = dir.path().join("a.img");
    let b = dir.path().join("b.img");
    let bytes = artifact(&a, 7);
    // The first MiB of `a` (its chunks reused), then 1 MiB of other data.
    let mut other = bytes[..1 << 20].to_vec();
    other.extend(artifact(&b, 8).into_iter().take(1 << 20));
    std::fs::write(&b, &other).unwrap();
    for (f, t) in [(&a, "img:a"), (&b, "img:b")] {
        let o = kiln(&store, &["store", "import", f.to_str().unwrap(), t]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(kiln(&store, &["untag", "img:a"]).status.success());
    let before = pack_bytes(&store);
    let gc = |dry: bool| {
        let mut args = vec!["--json", "store", "gc", "--grace", "0s"];
        if dry {
            args.push("--dry-run");
        }
        let o = kiln(&store, &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        json_lines(&o)
    };
    let dry = gc(true);
    let would = last_event(&dry, "compacted").clone();
    assert_eq!(would["packs"], 1, "{would}");
    assert_eq!(would["dryRun"], true);
    assert_eq!(pack_bytes(&store), before, "a dry run changes nothing");
    let ev = gc(false);
    let done = last_event(&ev, "compacted");
    assert_eq!(done["packs"], 1, "{done}");
    assert_eq!(done["bytesReclaimed"], would["bytesReclaimed"]);
    let reclaimed = done["bytesReclaimed"].as_u64().unwrap();
    let summary = last_event(&ev, "gc");
    assert_eq!(summary["packsCompacted"], 1);
    assert_eq!(summary["packBytesReclaimed"], reclaimed);
    let after = pack_bytes(&store);
    assert_eq!(before - after, reclaimed);
    let o = kiln(&store, &["--json", "store", "verify", "--deep"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let v = last_event(&json_lines(&o), "verified").clone();
    assert_eq!(v["packDeadBytes"], 0, "{v}");
    eprintln!("pack bytes before gc {before}, after {after}: {done}");
    // The text form names the compaction too.
    let o = kiln(&store, &["store", "gc", "--grace", "0s", "--dry-run"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("would compact 0 packs"));
    let out = dir.path().join("b.out");
    let o = kiln(&store, &["store", "export", "img:b", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&out).unwrap() == other);
}
