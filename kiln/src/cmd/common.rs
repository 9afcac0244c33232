//! Options shared by the image subcommands (store location, registry access).

use anyhow::Context as _;
use kiln_builder::cache::LocalCache;
use kiln_builder::image::Platform;
use kiln_builder::registry::{Registry, RegistryOptions};

/// Where the local store is and how registries are reached.
#[derive(Debug, Clone, clap::Args)]
pub struct ImageOpts {
    /// The local store directory or `file://PATH` (default: $KILN_STORE, else the config
    /// file's `store`, else ~/.local/share/kiln/store). An S3 store is refused: these commands
    /// work on a local store only.
    #[arg(long, value_name = "DIR")]
    pub store: Option<String>,
    /// Platform to pick from a multi-platform index, os/arch[/variant].
    #[arg(long, default_value = "linux/amd64")]
    pub platform: String,
    /// A registry (host[:port]) allowed over plain HTTP; loopback registries always are.
    #[arg(long = "insecure-registry")]
    pub insecure: Vec<String>,
    /// Layers downloaded at once (pull, unpack; other commands ignore it).
    #[arg(long, default_value_t = 3)]
    pub jobs: usize,
}

impl ImageOpts {
    /// Opens the local store for `command` (`kiln pull`: named in the error for an S3 store).
    pub fn cache(&self, command: &'static str) -> anyhow::Result<LocalCache> {
        let root = crate::config::local_store_dir(self.store.as_deref(), command)?;
        LocalCache::open(&root).with_context(|| format!("opening the store at {}", root.display()))
    }

    /// A registry client for these options.
    pub fn registry(&self) -> anyhow::Result<Registry> {
        Ok(Registry::new(RegistryOptions {
            insecure: self.insecure.clone(),
            platform: Platform::parse(&self.platform)?,
            max_parallel: self.jobs,
            ..RegistryOptions::default()
        }))
    }
}

/// A runtime for one command.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}
