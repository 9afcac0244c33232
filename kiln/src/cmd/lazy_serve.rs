//! `kiln __lazy-serve [--store URL] DIGEST DIR` (hidden): the chunk server that `kiln start`
//! spawns to serve a snapshot's memory file and disk to its clones on demand
//! ([`kiln_vmm::lazy`]). Not for people: `kiln start` runs it, with the snapshot manifest's
//! bytes on its standard input (taken when their sha256 is DIGEST, else read from the store),
//! and it prints only "ready".

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_store::ManifestDigest;

use super::{Out, open_with_options};

/// Arguments of `kiln __lazy-serve`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The store to read chunks from (as `kiln start --store`).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// The snapshot manifest.
    snapshot: ManifestDigest,
    /// The snapshot's cache directory; the files are served at `<DIR>/mnt`.
    dir: PathBuf,
}

/// Runs the chunk server; must be called before any thread starts ([`kiln_vmm::lazy::run_daemon`]
/// forks).
pub fn main(a: Args) -> ExitCode {
    let url = a.store.clone();
    let code = kiln_vmm::lazy::run_daemon(a.snapshot, a.dir, move |rt| {
        // Retries of the chunk reads are warnings on stderr, in the server's log.
        // Each read is bounded by `lazy_read_timeout_secs`, below the clones' restore
        // timeout, so a store that stops answering fails the read naming the chunk.
        let out = Out::new(false);
        let cfg = crate::config::Config::load(&crate::config::Flags::store(url.as_deref()))
            .map_err(|e| e.to_string())?;
        rt.block_on(open_with_options(&out, &cfg, cfg.lazy_store_options()))
            .map_err(|f| super::one_line(&f.error))
    });
    ExitCode::from(code.clamp(0, 255) as u8)
}
