//! Options shared by the image subcommands (store location, registry access), and the
//! [`ImageStore`] they work on.

use anyhow::Context as _;
use kiln_builder::cache::{Fronted, LocalCache};
use kiln_builder::image::Platform;
use kiln_builder::registry::{Registry, RegistryOptions};
use kiln_store::Store;

/// Where the store is and how registries are reached.
#[derive(Debug, Clone, clap::Args)]
pub struct ImageOpts {
    /// The store: a directory, `file://PATH` or `s3://BUCKET/PREFIX` (default: $KILN_STORE,
    /// else the config file's `store`, else ~/.local/share/kiln/store). With S3, blobs are
    /// kept as files in this host's cache (`<cache>/stores/…`) in front of the store.
    #[arg(long, value_name = "STORE")]
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
    /// Opens the configured store with its local blob directory.
    pub async fn open(&self) -> anyhow::Result<ImageStore> {
        let (cfg, dir) = crate::config::store_and_local_dir(self.store.as_deref())?;
        let cache = LocalCache::open(&dir)
            .with_context(|| format!("opening the store at {}", dir.display()))?;
        let store = Store::open_with(&cfg.store.value, cfg.store_options()).await?;
        let front = if store.local_root().is_some() {
            None
        } else {
            Some(Fronted {
                remote: store.clone(),
                local: Store::open(&dir.to_string_lossy()).await?,
            })
        };
        Ok(ImageStore {
            cache,
            store,
            front,
        })
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

/// The store an image command works on, with its blobs as files in [`ImageStore::cache`]:
/// a local store is its own blob cache; a remote (S3) store is fronted by a directory of
/// this host's cache ([`crate::config::Config::local_dir`]), which [`ImageStore::fetch`]
/// fills from the store before a command reads and [`ImageStore::publish`] writes through
/// to the store after a command wrote ([`Fronted`]). So every command reads and writes the
/// same images whichever the store is.
pub struct ImageStore {
    /// The blob files the builder's code reads and writes (OCI manifests, configs, layers,
    /// OCI references, and copies of store tags).
    pub cache: LocalCache,
    /// The configured store.
    pub store: Store,
    /// The store and the cache's directory as a store, when the store is remote.
    front: Option<Fronted>,
}

impl ImageStore {
    /// Copies what `spec` names in a remote store into the cache ([`Fronted::fetch`]), so
    /// that [`kiln_builder::base::lookup`] finds it there. Nothing for a local store.
    pub async fn fetch(&self, spec: &str) -> anyhow::Result<()> {
        if let Some(f) = &self.front {
            f.fetch(spec).await?;
        }
        Ok(())
    }

    /// After a command put the OCI image `digest` into the cache, writes it and the OCI
    /// reference `reference` through to a remote store ([`Fronted::publish`]). Nothing for
    /// a local store.
    pub async fn publish(&self, digest: &str, reference: Option<&str>) -> anyhow::Result<()> {
        if let Some(f) = &self.front {
            f.publish(digest, reference).await?;
        }
        Ok(())
    }
}

/// A runtime for one command.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}
