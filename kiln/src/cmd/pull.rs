//! `kiln pull REF`: fetch an image from a registry into the local store.

use kiln_builder::base::{self, PullPolicy, Source};

use super::common::{ImageOpts, runtime};

/// Arguments of `kiln pull`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Image reference (e.g. 127.0.0.1:5000/debian:bookworm, debian@sha256:...).
    pub reference: String,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln pull`: always asks the registry; prints the manifest digest.
pub fn run(a: Args) -> anyhow::Result<()> {
    let cache = a.opts.cache("kiln pull")?;
    let reg = a.opts.registry()?;
    let (digest, src) = runtime()?.block_on(base::resolve(
        &a.reference,
        PullPolicy::Always,
        &reg,
        &cache,
    ))?;
    if let Source::Registry { fetched, bytes } = src {
        eprintln!(
            "pulled {}: {fetched} blobs, {bytes} bytes downloaded",
            a.reference
        );
    }
    println!("{digest}");
    Ok(())
}
