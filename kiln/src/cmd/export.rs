//! `kiln export REF --format oci -o DIR`: write an image from the local store as an OCI layout.

use anyhow::Context as _;
use kiln_builder::{base, layout};

use super::common::ImageOpts;

/// Output formats of `kiln export`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    /// An OCI image layout directory.
    Oci,
}

/// Arguments of `kiln export`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image in the local store (a reference or sha256:<hex>).
    pub reference: String,
    /// Output format.
    #[arg(long, value_enum, default_value = "oci")]
    pub format: Format,
    /// Output directory.
    #[arg(short, long)]
    pub output: std::path::PathBuf,
    /// Tag inside the layout (default: the reference's tag, else latest).
    #[arg(long)]
    pub tag: Option<String>,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln export`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let cache = a.opts.cache()?;
    let digest = base::lookup(&a.reference, &cache)?
        .with_context(|| format!("{} is not in the local store", a.reference))?;
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
    match a.format {
        Format::Oci => layout::export(&cache, &digest, &a.output, &tag)?,
    }
    println!("{digest}");
    Ok(())
}
