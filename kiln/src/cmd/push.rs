//! `kiln push NAME:TAG REF`: upload an image from the local store to a registry.

use anyhow::Context as _;
use kiln_builder::base;
use kiln_builder::reference::Reference;

use super::common::{ImageOpts, runtime};

/// Arguments of `kiln push`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image in the local store (a reference or sha256:<hex>).
    pub name: String,
    /// Where to push it (registry/repo:tag).
    pub reference: String,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln push`; prints the pushed manifest digest.
pub fn run(a: Args) -> anyhow::Result<()> {
    let cache = a.opts.cache("kiln push")?;
    let digest = base::lookup(&a.name, &cache)?
        .with_context(|| format!("{} is not in the local store", a.name))?;
    let dst: Reference = a.reference.parse()?;
    let reg = a.opts.registry()?;
    let d = runtime()?.block_on(reg.push(&cache, &digest, &dst))?;
    println!("{d}");
    Ok(())
}
