//! `kiln pull REF`: fetch an image from a registry into the store (through this host's blob
//! cache when the store is S3).

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
    let reg = a.opts.registry()?;
    let (digest, src) = runtime()?.block_on(async {
        let s = a.opts.open().await?;
        let (digest, src) = base::resolve(&a.reference, PullPolicy::Always, &reg, &s.cache).await?;
        s.publish(&digest, written_ref(&a.reference).as_deref())
            .await?;
        anyhow::Ok((digest, src))
    })?;
    if let Source::Registry { fetched, bytes } = src {
        eprintln!(
            "pulled {}: {fetched} blobs, {bytes} bytes downloaded",
            a.reference
        );
    }
    println!("{digest}");
    Ok(())
}

/// The OCI reference a resolve of `spec` set in the blob cache (`registry/repo:tag`), `None`
/// for an OCI layout (`oci:DIR`) or a digest-pinned reference.
pub fn written_ref(spec: &str) -> Option<String> {
    if kiln_builder::layout::LayoutRef::parse(spec).is_some() {
        return None;
    }
    let r = spec.parse().ok()?;
    kiln_builder::reference::oci_ref_of(&r).map(|o| o.to_string())
}
