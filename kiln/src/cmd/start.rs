//! `kiln start NAME:TAG [--count N] [--env K=V]... [--disk-mib N] [--materialize]`: start
//! clones of an image's snapshot on this host (refused when this host's compatibility key
//! differs from the snapshot's, or when `--disk-mib` is below the image's disk size). Memory
//! and disk are served on demand by the snapshot's chunk server, or, with `--materialize`,
//! downloaded whole first.

use kiln_store::TagRef;
use kiln_vmm::clone::{CloneOptions, Serving, default_cache_dir, default_state_dir, start_clones};
use serde_json::json;

use super::{CmdResult, Out, open_store};

/// Arguments of `kiln start`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image with a snapshot (`kiln snapshot`), `NAME:TAG` of this store.
    image: TagRef,
    /// How many clones.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// `KEY=value` for the clones' processes started after the restore (repeatable).
    #[arg(long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// The clones' disk size in MiB, at least the image's: the disk is grown and the guest
    /// grows its root file system online before the clone is reported started.
    #[arg(long, value_name = "MIB")]
    disk_mib: Option<u64>,
    /// Download the whole snapshot (memory and disk, every chunk verified) into the snapshot
    /// cache before the clones start, instead of serving them on demand through a chunk
    /// server, which fetches only what the clones read.
    #[arg(long)]
    materialize: bool,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, else
    /// `~/.local/share/kiln/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// The chunk server's command line: this program, run as `kiln __lazy-serve` with the same
/// store (`store`: the `--store` given, if any).
pub fn lazy_server(store: Option<&str>) -> Result<Vec<std::ffi::OsString>, anyhow::Error> {
    let exe = std::env::current_exe()
        .map_err(|e| anyhow::anyhow!("cannot find this program to run its chunk server: {e}"))?;
    let mut server = vec![exe.into_os_string(), "__lazy-serve".into()];
    if let Some(url) = store {
        server.extend(["--store".into(), url.into()]);
    }
    Ok(server)
}

/// Runs `kiln start`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    if let Some(bad) = a
        .env
        .iter()
        .find(|e| !e.contains('=') || e.starts_with('='))
    {
        return Err(anyhow::anyhow!("--env {bad:?}: expected KEY=value").into());
    }
    let store = open_store(out, a.store.as_deref()).await?;
    let serving = if a.materialize {
        Serving::Materialized
    } else {
        Serving::Lazy {
            server: lazy_server(a.store.as_deref())?,
        }
    };
    let mut opts = CloneOptions::new(default_state_dir(), default_cache_dir(), serving);
    opts.count = a.count;
    opts.env = a.env;
    opts.disk_mib = a.disk_mib;
    for c in start_clones(&store, &a.image, &opts).await? {
        out.event(
            "started",
            serde_json::to_value(&c).unwrap_or_else(|_| json!({"id": c.id})),
            || {
                format!(
                    "{} pid {} machine-id {} answered in {} ms",
                    c.id, c.pid, c.machine_id, c.start_ms
                )
            },
        );
    }
    Ok(())
}
