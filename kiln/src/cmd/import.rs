//! `kiln import oci:DIR[:TAG]`: copy an image from an OCI layout into the store.

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
    /// Name the image in the store (registry/repo:tag).
    #[arg(short, long)]
    pub tag: Option<String>,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln import`; prints the manifest digest.
pub fn run(a: Args) -> anyhow::Result<()> {
    let layout = layout::LayoutRef::parse(&a.spec).context("expected oci:DIR[:TAG]")?;
    let platform = Platform::parse(&a.opts.platform)?;
    let digest = super::common::runtime()?.block_on(async {
        let s = a.opts.open().await?;
        let digest = layout.import(&platform, &s.cache)?;
        let mut name = None;
        if let Some(t) = &a.tag {
            let r: Reference = t.parse()?;
            let tag = r.tag().unwrap_or("latest");
            let n = format!("{}:{tag}", r.name());
            s.cache.set_ref(&n, &digest)?;
            name = Some(n);
        }
        s.publish(&digest, name.as_deref()).await?;
        anyhow::Ok(digest)
    })?;
    println!("{digest}");
    Ok(())
}
