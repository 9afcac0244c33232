//! `kiln unpack REF DIR`: write an image's root filesystem into a directory.

use kiln_builder::base::{self, PullPolicy};
use kiln_builder::layer::Limits;

use super::common::{ImageOpts, runtime};

/// Arguments of `kiln unpack`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The image: a reference (local first, then its registry), sha256:<hex>, or oci:DIR[:TAG].
    pub reference: String,
    /// Target directory (created if missing).
    pub dir: std::path::PathBuf,
    /// Never ask a registry.
    #[arg(long)]
    pub offline: bool,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln unpack`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let cache = a.opts.cache()?;
    let cached = if a.reference.starts_with("oci:") {
        None
    } else {
        base::lookup(&a.reference, &cache)?
    };
    let digest = match cached {
        Some(d) => d,
        None => {
            let policy = if a.offline {
                PullPolicy::Never
            } else {
                PullPolicy::Missing
            };
            let reg = a.opts.registry()?;
            runtime()?
                .block_on(base::resolve(&a.reference, policy, &reg, &cache))?
                .0
        }
    };
    let stats = base::unpack(&cache, &digest, &a.dir, &Limits::default())?;
    eprintln!(
        "unpacked {digest}: {} entries, {} bytes",
        stats.entries, stats.bytes
    );
    Ok(())
}
