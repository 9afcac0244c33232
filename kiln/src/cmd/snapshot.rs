//! `kiln snapshot NAME:TAG [-t NEW]`: boot an image once, run its start command until ready,
//! and store the snapshot; the image manifest naming it is tagged NEW (default: NAME:TAG).

use std::path::PathBuf;
use std::time::Duration;

use kiln_store::TagRef;
use kiln_vmm::snapshot::{SnapshotOptions, snapshot_image};
use serde_json::json;

use super::{CmdResult, Out, open_store};

/// Arguments of `kiln snapshot`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image, `NAME:TAG` of this store.
    image: TagRef,
    /// The tag to give the image with its snapshot (default: the image's own tag).
    #[arg(short = 't', long = "tag", value_name = "NAME:TAG")]
    tag: Option<TagRef>,
    /// Guest kernel (uncompressed vmlinux); default: `kiln kernel`'s (fetched and cached).
    #[arg(long, env = "KILN_KERNEL", value_name = "FILE")]
    kernel: Option<PathBuf>,
    /// Guest initramfs with kiln-guest-init; default: `kiln kernel`'s (built with the init
    /// from `$KILN_GUEST_INIT`, else beside this executable).
    #[arg(long, env = "KILN_INITRAMFS", value_name = "FILE")]
    initramfs: Option<PathBuf>,
    /// Guest RAM, MiB.
    #[arg(long, default_value_t = 512)]
    memory_mib: u64,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
    /// Seconds to wait for the start command's ready check (after the guest's hello).
    #[arg(long, default_value_t = 600)]
    ready_timeout: u64,
    /// Restores that record the prefetch list: it holds the chunks all of them read until
    /// the clone answered and its ready check ran once.
    #[arg(long, default_value_t = kiln_vmm::snapshot::PREFETCH_RESTORES,
          value_parser = clap::value_parser!(u32).range(1..=8))]
    prefetch_restores: u32,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs `kiln snapshot`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_store(out, a.store.as_deref()).await?;
    let tag = a.tag.clone().unwrap_or_else(|| a.image.clone());
    let opts = SnapshotOptions {
        vcpus: a.vcpus,
        memory_bytes: a.memory_mib << 20,
        ready_timeout: Duration::from_secs(a.ready_timeout),
        // Lazily served restores record the chunks a clone reads first.
        record_prefetch: Some(super::start::lazy_server(a.store.as_deref())?),
        prefetch_restores: a.prefetch_restores,
        ..Default::default()
    };
    let (kernel, initramfs) = (a.kernel, a.initramfs);
    let assets = tokio::task::spawn_blocking(move || super::kernel::boot_assets(kernel, initramfs))
        .await
        .map_err(anyhow::Error::from)??;
    let r = snapshot_image(&store, &a.image, &tag, &assets, &opts).await?;
    out.event(
        "snapshot",
        json!({
            "tag": tag.to_string(), "image": r.image, "snapshot": r.snapshot,
            "accel": r.accel.name(), "boot_to_ready_ms": r.boot_to_ready.as_millis() as u64,
            "settle_ms": r.settle.as_millis() as u64,
            "save_ms": r.save.as_millis() as u64, "memory_bytes": r.memory_bytes,
            "memory_stored_bytes": r.memory_stored_bytes, "vmstate_bytes": r.vmstate_bytes,
            "compatibility_key": r.key.render(), "prefetch_chunks": r.prefetch_chunks,
            "prefetch_checks_passed": r.prefetch_checks_passed,
        }),
        || {
            format!(
                "{tag} -> {} (snapshot {}, {}: ready in {} ms, saved in {} ms; memory {} MiB stored as {} KiB; {} chunks to prefetch)",
                r.image,
                r.snapshot,
                r.accel.name(),
                r.boot_to_ready.as_millis(),
                r.save.as_millis(),
                r.memory_bytes >> 20,
                r.memory_stored_bytes >> 10,
                r.prefetch_chunks
            )
        },
    );
    Ok(())
}
