//! `kiln inspect REF`: one image in detail: its digests and sizes, the chunk table (count,
//! holes, stored bytes, size spread; every entry with `--chunks`), the ext4 file system as
//! recorded, the OCI config it was built with, the sandbox start command and ready check,
//! provenance (recipe digest, base digests, kiln version) and when each tag naming it got it
//! (tag history). `--fsck` writes the image to a temporary file and runs `e2fsck -fn` on it.

use std::collections::BTreeMap;

use anyhow::Context as _;
use kiln_store::manifest::{BlobRef, ImageManifest, Manifest};
use kiln_store::{Backend as _, ChunkTable, Chunking, ManifestDigest, Store, TagRef};
use serde_json::{Value, json};

use super::images::{ImageRef, created, format_time, human};
use super::{CmdResult, Failure, Out, exit, open_existing_store};

/// The largest OCI config blob shown, in bytes (4 MiB; real ones are a few KiB).
const MAX_CONFIG_SHOWN: u64 = 4 << 20;

/// Arguments of `kiln inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image: `NAME:TAG`, `NAME` (`NAME:latest`) or `sha256:<hex>` (a manifest digest).
    reference: ImageRef,
    /// Also list every chunk table entry (offset, raw and stored length, digest).
    #[arg(long)]
    chunks: bool,
    /// Check the file system: write the image to a temporary file and run `e2fsck -fn`
    /// (exit code 3 when it finds a problem).
    #[arg(long)]
    fsck: bool,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, then
    /// the config file, then `~/.local/share/kiln/store` (see `kiln config show`).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Summary figures of a chunk table.
fn table_summary(t: &ChunkTable) -> Value {
    let data: Vec<_> = t.entries.iter().filter(|e| !e.is_hole()).collect();
    let holes = t.entries.len() - data.len();
    let hole_bytes: u64 = t
        .entries
        .iter()
        .filter(|e| e.is_hole())
        .map(|e| e.raw_len)
        .sum();
    let chunking = match t.chunking {
        Chunking::Fixed { size } => json!({"kind": "fixed", "size": size}),
        Chunking::Cdc { min, avg, max } => {
            json!({"kind": "cdc", "min": min, "avg": avg, "max": max})
        }
    };
    json!({
        "size": t.size,
        "chunking": chunking,
        "entries": t.entries.len(),
        "chunks": data.len(),
        "distinctChunks": t.chunk_digests().len(),
        "holes": holes,
        "holeBytes": hole_bytes,
        "dataBytes": t.size - hole_bytes,
        "storedBytes": t.stored_bytes(),
        "smallestChunk": data.iter().map(|e| e.raw_len).min(),
        "largestChunk": data.iter().map(|e| e.raw_len).max(),
    })
}

/// The OCI config blob, parsed, when it is present and small enough to show.
async fn oci_config(store: &Store, r: &BlobRef) -> Result<Option<Value>, Failure> {
    let Some(info) = store.backend().head(&r.digest.key()).await? else {
        return Ok(None);
    };
    if info.size > MAX_CONFIG_SHOWN {
        return Ok(None);
    }
    let bytes = store.get_blob(&r.digest).await?;
    Ok(serde_json::from_slice(&bytes).ok())
}

/// Runs `kiln inspect`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    let digest = match &a.reference {
        ImageRef::Tag(t) => store.resolve_tag(t).await?,
        ImageRef::Digest(d) => *d,
    };
    let m = match store.get_manifest(&digest).await? {
        Manifest::Image(m) => m,
        Manifest::Snapshot(_) => {
            return Err(anyhow::anyhow!(
                "{} is a snapshot manifest ({digest}), not an image",
                a.reference
            )
            .into());
        }
    };
    // Every tag naming this manifest, with when it got it.
    let mut tags = Vec::new();
    for (t, d) in store.list_tags(None).await? {
        if d == digest {
            let when = created(&store, &t, &digest).await?;
            tags.push((t, when));
        }
    }
    let config = match &m.oci_config {
        Some(r) => oci_config(&store, r).await?,
        None => None,
    };
    let fsck = if a.fsck {
        Some(fsck(&store, &m).await?)
    } else {
        None
    };
    let summary = table_summary(&m.disk);
    let v = json!({
        "reference": a.reference.to_string(),
        "manifest": digest,
        "tags": tags.iter().map(|(t, w)| json!({
            "tag": t.to_string(),
            "created": w.as_ref().map(|w| w.0),
            "createdBy": w.as_ref().map(|w| &w.1),
        })).collect::<Vec<_>>(),
        "size": m.disk.size,
        "chunkTable": summary,
        "filesystem": m.filesystem,
        "sandbox": m.sandbox,
        "ociManifest": m.oci_manifest,
        "ociConfig": m.oci_config,
        "blobs": m.blobs.len(),
        "blobBytes": m.blobs.iter().map(|b| b.size).sum::<u64>(),
        "config": config.as_ref().and_then(|c| c.get("config")),
        "history": config.as_ref().and_then(|c| c.get("history")),
        "recipeDigest": m.recipe_digest,
        "provenance": m.provenance,
        "snapshot": m.snapshot,
        "fsck": fsck.as_ref().map(|(ok, log)| json!({"clean": ok, "output": log})),
    });
    out.event("inspect", v.clone(), || text(&v, &tags, &m));
    if a.chunks {
        for e in &m.disk.entries {
            out.event(
                "chunk",
                json!({"offset": e.offset, "rawLen": e.raw_len, "storedLen": e.stored_len,
                       "digest": e.digest}),
                || {
                    format!(
                        "{:>14} {:>8} {:>8} {}",
                        e.offset,
                        e.raw_len,
                        e.stored_len,
                        e.digest
                            .map_or_else(|| "(hole)".to_string(), |d| d.to_string())
                    )
                },
            );
        }
    }
    match fsck {
        Some((false, _)) => Err(Failure {
            code: exit::DAMAGED,
            error: anyhow::anyhow!("{}: e2fsck found problems in the file system", a.reference),
        }),
        _ => Ok(()),
    }
}

/// Writes the image to a temporary file and runs `e2fsck -fn` on it: (clean, output).
async fn fsck(store: &Store, m: &ImageManifest) -> Result<(bool, String), Failure> {
    let dir = tempfile::Builder::new()
        .prefix("kiln-inspect-")
        .tempdir()
        .context("creating a temporary directory for --fsck")?;
    let file = dir.path().join("image.ext4");
    store.materialize(&m.disk, &file, None).await?;
    let o = tokio::process::Command::new("e2fsck")
        .env("PATH", kiln_builder::ext4::TOOL_PATH)
        .arg("-fn")
        .arg(&file)
        .output()
        .await
        .context("running e2fsck (Debian package e2fsprogs)")?;
    // stdout ends with the summary line (`FILE: N/M files (...), N/M blocks`); stderr has
    // the version banner and any complaint.
    let log = String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
    Ok((o.status.success(), log.trim_end().to_string()))
}

/// The text form.
fn text(v: &Value, tags: &[(TagRef, Option<(u64, String)>)], m: &ImageManifest) -> String {
    let mut s = String::new();
    let mut line = |k: &str, val: String| s.push_str(&format!("{k:<12} {val}\n"));
    line(
        "manifest",
        v["manifest"].as_str().unwrap_or_default().into(),
    );
    for (t, w) in tags {
        line(
            "tag",
            match w {
                Some((time, host)) => format!("{t} (since {} on {host})", format_time(*time)),
                None => format!("{t}"),
            },
        );
    }
    line(
        "size",
        format!("{} ({} bytes)", human(m.disk.size), m.disk.size),
    );
    let c = &v["chunkTable"];
    let chunking = match m.disk.chunking {
        Chunking::Fixed { size } => format!("fixed {}", human(size.into())),
        Chunking::Cdc { min, avg, max } => format!(
            "FastCDC {}/{}/{}",
            human(min.into()),
            human(avg.into()),
            human(max.into())
        ),
    };
    line(
        "chunks",
        format!(
            "{} ({} distinct) + {} holes ({}), {chunking}; stored {} for {} of data; \
             chunk sizes {}..{}",
            c["chunks"],
            c["distinctChunks"],
            c["holes"],
            human(c["holeBytes"].as_u64().unwrap_or(0)),
            human(c["storedBytes"].as_u64().unwrap_or(0)),
            human(c["dataBytes"].as_u64().unwrap_or(0)),
            human(c["smallestChunk"].as_u64().unwrap_or(0)),
            human(c["largestChunk"].as_u64().unwrap_or(0)),
        ),
    );
    match &m.filesystem {
        Some(f) => {
            let tool: Vec<String> = f.tool.iter().map(|(k, v)| format!("{k} {v}")).collect();
            line(
                "filesystem",
                format!(
                    "{}, {}-byte blocks, uuid {}, features {}{}",
                    f.kind,
                    f.block_size,
                    f.uuid,
                    f.features.join(","),
                    if tool.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", tool.join(", "))
                    }
                ),
            );
        }
        None => line("filesystem", "(not recorded)".into()),
    }
    if let Some(f) = v["fsck"].as_object() {
        let clean = f["clean"].as_bool() == Some(true);
        let out = f["output"].as_str().unwrap_or("");
        // The summary line, without the temporary file's name.
        let last = out.lines().last().unwrap_or("");
        let last = last.split_once(": ").map_or(last, |(_, rest)| rest);
        line(
            "fsck",
            format!("{}: {last}", if clean { "clean" } else { "PROBLEMS" }),
        );
    }
    if let Some(o) = &m.oci_manifest {
        line("oci", format!("manifest {} ({} bytes)", o.digest, o.size));
    }
    if let Some(o) = &m.oci_config {
        line("oci config", format!("{} ({} bytes)", o.digest, o.size));
    }
    if !m.blobs.is_empty() {
        line(
            "blobs",
            format!(
                "{} ({})",
                m.blobs.len(),
                human(m.blobs.iter().map(|b| b.size).sum())
            ),
        );
    }
    if let Some(cfg) = v["config"].as_object() {
        for key in ["User", "WorkingDir", "Entrypoint", "Cmd", "Env", "Labels"] {
            if let Some(val) = cfg.get(key).filter(|x| !x.is_null()) {
                line(&format!("  {key}"), val.to_string());
            }
        }
    }
    match &m.sandbox {
        Some(sb) => {
            if let Some(st) = &sb.start {
                line(
                    "start",
                    format!(
                        "{:?} as {} in {}",
                        st.argv,
                        st.user.as_deref().unwrap_or("root"),
                        st.workdir.as_deref().unwrap_or("/")
                    ),
                );
            }
            if let Some(r) = &sb.ready {
                line(
                    "ready",
                    format!(
                        "{:?} every {} ms, timeout {} ms, {} retries",
                        r.argv, r.interval_ms, r.timeout_ms, r.retries
                    ),
                );
            }
            if sb.start.is_none() && sb.ready.is_none() {
                line("start", "(none)".into());
            }
        }
        None => line("start", "(none)".into()),
    }
    line(
        "recipe",
        m.recipe_digest
            .clone()
            .unwrap_or_else(|| "(unknown)".into()),
    );
    let prov: &BTreeMap<String, String> = &m.provenance;
    for (k, val) in prov {
        line(&format!("  {k}"), val.clone());
    }
    line(
        "snapshot",
        m.snapshot
            .map_or_else(|| "(none)".to_string(), |d: ManifestDigest| d.to_string()),
    );
    s.trim_end().to_string()
}
