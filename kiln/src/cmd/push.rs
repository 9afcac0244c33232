//! `kiln push NAME:TAG REF`: upload an image from the store to a registry.

use anyhow::Context as _;
use kiln_builder::base;
use kiln_builder::reference::Reference;

use super::common::{ImageOpts, runtime};

/// Arguments of `kiln push`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image in the store (a reference or sha256:<hex>).
    pub name: String,
    /// Where to push it (registry/repo:tag).
    pub reference: String,
    /// How its layers are pushed: `gzip` (the default) gzips the zstd layers a kiln build
    /// writes, under a manifest of their own; `as-built` pushes the image as it is.
    #[arg(long, value_enum, default_value = "gzip")]
    pub layer_compression: super::flags::LayerCompressionArg,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln push`; prints the digest of the manifest pushed.
pub fn run(a: Args) -> anyhow::Result<()> {
    let dst: Reference = a.reference.parse()?;
    let reg = a.opts.registry()?;
    let d = runtime()?.block_on(async {
        let s = a.opts.open().await?;
        s.fetch(&a.name).await?;
        let digest = base::lookup(&a.name, &s.cache)?
            .with_context(|| format!("{} is not in the store {}", a.name, s.store.url()))?;
        anyhow::Ok(
            reg.push(&s.cache, &digest, &dst, a.layer_compression.into())
                .await?,
        )
    })?;
    println!("{d}");
    Ok(())
}
