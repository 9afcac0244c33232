//! `kiln import oci:DIR[:TAG]`: copy an image from an OCI layout into the local store.

use anyhow::Context as _;
use kiln_builder::cache::BlobCache as _;
use kiln_builder::image::Platform;
use kiln_builder::layout;
use kiln_builder::reference::Reference;

use super::common::ImageOpts;

/// Arguments of `kiln import`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The layout, spelled oci:DIR[:TAG].
    pub spec: String,
    /// Name the image in the local store (registry/repo:tag).
    #[arg(short, long)]
    pub tag: Option<String>,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln import`; prints the manifest digest.
pub fn run(a: Args) -> anyhow::Result<()> {
    let (dir, tag) = layout::parse_spec(&a.spec).context("expected oci:DIR[:TAG]")?;
    let cache = a.opts.cache("kiln import")?;
    let digest = layout::import(
        &dir,
        tag.as_deref(),
        &Platform::parse(&a.opts.platform)?,
        &cache,
    )?;
    if let Some(t) = a.tag {
        let r: Reference = t.parse()?;
        let tag = r.tag().unwrap_or("latest");
        cache.set_ref(&format!("{}:{tag}", r.name()), &digest)?;
    }
    println!("{digest}");
    Ok(())
}
