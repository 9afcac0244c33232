//! `kiln unpack REF DIR [--merge]`: write an image's root filesystem into a directory (an empty
//! one, unless `--merge`).

use kiln_builder::base::{self, PullPolicy};
use kiln_builder::layer::Limits;

use super::common::{ImageOpts, runtime};

/// Arguments of `kiln unpack`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image: a reference (local first, then its registry), sha256:<hex>, or oci:DIR[:TAG].
    pub reference: String,
    /// Target directory (created if missing; must be empty unless --merge).
    pub dir: std::path::PathBuf,
    /// Apply the image over what a non-empty DIR already holds (whiteouts remove from it).
    #[arg(long)]
    pub merge: bool,
    /// Never ask a registry.
    #[arg(long)]
    pub offline: bool,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln unpack`.
pub fn run(a: Args) -> anyhow::Result<()> {
    if !a.merge
        && let Ok(mut entries) = std::fs::read_dir(&a.dir)
        && entries.next().is_some()
    {
        anyhow::bail!(
            "{} is not empty; unpack into an empty directory, or pass --merge to apply the \
             image over its contents",
            a.dir.display()
        );
    }
    let reg = a.opts.registry()?;
    let (s, digest) = runtime()?.block_on(async {
        let s = a.opts.open().await?;
        let cached = if a.reference.starts_with("oci:") {
            None
        } else {
            s.fetch(&a.reference).await?;
            base::lookup(&a.reference, &s.cache)?
        };
        let digest = match cached {
            Some(d) => d,
            None => {
                let policy = if a.offline {
                    PullPolicy::Never
                } else {
                    PullPolicy::Missing
                };
                let d = base::resolve(&a.reference, policy, &reg, &s.cache).await?.0;
                s.publish(&d, super::pull::written_ref(&a.reference).as_deref())
                    .await?;
                d
            }
        };
        anyhow::Ok((s, digest))
    })?;
    let stats = base::unpack(&s.cache, &digest, &a.dir, &Limits::default())?;
    eprintln!(
        "unpacked {digest}: {} entries, {} bytes",
        stats.entries, stats.bytes
    );
    Ok(())
}
