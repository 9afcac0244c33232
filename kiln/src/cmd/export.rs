//! `kiln export REF --format oci -o DIR`: write an image from the store as an OCI layout.
//! `kiln export NAME:TAG --format ext4 -o FILE`: write a kiln image's ext4 root file system
//! (its chunks materialized, verified, as a sparse file).

use anyhow::Context as _;
use kiln_builder::{base, layout};

use super::common::ImageOpts;

/// Output formats of `kiln export`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    /// An OCI image layout directory.
    Oci,
    /// The ext4 root file system of a kiln image (a store tag `name:tag` or a manifest
    /// digest `sha256:<hex>`), as one file.
    Ext4,
}

/// Arguments of `kiln export`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image in the store (a reference or sha256:<hex>).
    pub reference: String,
    /// Output format.
    #[arg(long, value_enum, default_value = "oci")]
    pub format: Format,
    /// Output directory (oci) or file (ext4).
    #[arg(short, long)]
    pub output: std::path::PathBuf,
    /// Tag inside the layout (default: the reference's tag, else latest).
    #[arg(long)]
    pub tag: Option<String>,
    /// How the layers are written (oci): `gzip` (the default) gzips the zstd layers a kiln
    /// build writes, under a manifest of their own; `as-built` writes the image as it is.
    #[arg(long, value_enum, default_value = "gzip")]
    pub layer_compression: super::flags::LayerCompressionArg,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln export`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let rt = super::common::runtime()?;
    let s = rt.block_on(a.opts.open())?;
    if let Format::Ext4 = a.format {
        return rt.block_on(ext4(&a, &s.store));
    }
    rt.block_on(s.fetch(&a.reference))?;
    let cache = &s.cache;
    let digest = base::lookup(&a.reference, cache)?
        .with_context(|| format!("{} is not in the store {}", a.reference, s.store.url()))?;
    let tag = match a.tag {
        Some(t) => t,
        None if a.reference.starts_with("sha256:") => "latest".to_string(),
        None => a
            .reference
            .parse::<kiln_builder::reference::Reference>()?
            .tag()
            .unwrap_or("latest")
            .to_string(),
    };
    // The digest written: the image's own, or that of its zstd layers gzipped.
    let written = layout::export(cache, &digest, &a.output, &tag, a.layer_compression.into())?;
    println!("{written}");
    Ok(())
}

/// `--format ext4`: resolve the tag (or digest) in the store and materialize the disk
/// (chunks read through the store's read cache when it has one).
async fn ext4(a: &Args, store: &kiln_store::Store) -> anyhow::Result<()> {
    let digest = if a.reference.starts_with("sha256:") {
        a.reference.parse::<kiln_store::ManifestDigest>()?
    } else {
        let t: kiln_store::TagRef = a.reference.parse()?;
        store.resolve_tag(&t).await?
    };
    let kiln_store::Manifest::Image(m) = store.get_manifest(&digest).await? else {
        anyhow::bail!("{} is not an image manifest", a.reference);
    };
    store.materialize(&m.disk, &a.output, None).await?;
    println!("{digest}");
    Ok(())
}
