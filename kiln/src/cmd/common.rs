//! Options shared by the image subcommands (store location, registry access), and the
//! [`ImageStore`] they work on.

use anyhow::Context as _;
use kiln_builder::cache::LocalCache;
use kiln_builder::front::Fronted;
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
        let store = Store::open_with(&cfg.store.value, cfg.store_options()).await?;
        let kiln_pipeline::CachedStore {
            store,
            cache,
            front,
        } = kiln_pipeline::CachedStore::open(store, &dir)
            .await
            .with_context(|| format!("opening the store at {}", dir.display()))?;
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
    pub async fn publish(
        &self,
        digest: &kiln_store::BlobDigest,
        reference: Option<&str>,
    ) -> anyhow::Result<()> {
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

/// The sizes of the microVM executor's `RUN --mount=type=cache` disks on this host (`kiln
/// build --isolation vm`, `kiln serve`): README, "Cache mounts in microVM steps".
#[derive(Debug, Clone, clap::Args)]
pub struct CacheDiskArgs {
    /// Size of each cache disk, MiB: the most one cache holds (its file is sparse). A disk
    /// keeps the size it was made with.
    #[arg(
        long = "cache-disk-mib",
        value_name = "MIB",
        default_value_t = kiln_builder::exec::DEFAULT_CACHE_DISK_BYTES >> 20,
        value_parser = clap::value_parser!(u64).range(16..=1 << 30)
    )]
    pub cache_disk_mib: u64,
    /// Most MiB the cache disks of one workspace (of this host, for `kiln build`) take on
    /// the host together; past it the least recently used free ones are removed.
    #[arg(
        long = "cache-disks-total-mib",
        value_name = "MIB",
        default_value_t = kiln_builder::exec::DEFAULT_CACHE_DISKS_TOTAL_BYTES >> 20,
        value_parser = clap::value_parser!(u64).range(16..=1 << 40)
    )]
    pub cache_disks_total_mib: u64,
}

impl CacheDiskArgs {
    /// Puts these sizes on `setup`.
    pub fn apply(&self, setup: &mut kiln_pipeline::Setup) {
        setup.cache_disk_bytes = self.cache_disk_mib << 20;
        setup.cache_disks_total_bytes = self.cache_disks_total_mib << 20;
    }
}

/// What build steps trust and reach: extra CA certificates, and the address policy's two
/// settings for tests (`kiln build`, `kiln serve`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EgressArgs {
    /// A PEM file of CA certificates (a TLS-inspecting proxy's) that every `RUN` step sees in
    /// its CA bundle and `ADD <url>` trusts; repeatable. They change no layer and no cache
    /// key (README, "Network of build steps").
    #[arg(long = "ca-cert", value_name = "FILE")]
    pub ca_cert: Vec<std::path::PathBuf>,
    /// For tests only: let steps' egress proxy and `ADD <url>` reach loopback, private,
    /// link-local and metadata addresses. Never on a host that builds untrusted recipes.
    #[arg(long = "egress-allow-private-for-tests")]
    pub allow_private: bool,
    /// For tests only: answer NAME with ADDR (an IPv4 or IPv6 address) for steps' egress
    /// proxy and `ADD <url>`, before DNS; repeatable. The address is still checked (see
    /// --egress-allow-private-for-tests).
    #[arg(long = "egress-host-for-tests", value_name = "NAME=ADDR")]
    pub hosts: Vec<String>,
}

impl EgressArgs {
    /// The address policy these settings give (public addresses only by default).
    pub fn addresses(&self) -> anyhow::Result<kiln_builder::egress::address::AddressPolicy> {
        let mut p = kiln_builder::egress::address::AddressPolicy {
            allow_private_addresses: self.allow_private,
            ..Default::default()
        };
        for h in &self.hosts {
            let (name, addr) = h
                .split_once('=')
                .with_context(|| format!("--egress-host-for-tests {h:?}: expected NAME=ADDR"))?;
            let name = name.trim().trim_end_matches('.').to_ascii_lowercase();
            if name.is_empty() || name.parse::<std::net::IpAddr>().is_ok() {
                anyhow::bail!("--egress-host-for-tests {h:?}: NAME must be a host name");
            }
            let addr: std::net::IpAddr = addr
                .trim()
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse()
                .with_context(|| {
                    format!("--egress-host-for-tests {h:?}: ADDR must be an IP address")
                })?;
            p.hosts.entry(name).or_default().push(addr);
        }
        Ok(p)
    }

    /// The certificates of every --ca-cert file, in order; `None` without any.
    pub fn ca_certs(&self) -> anyhow::Result<Option<kiln_builder::egress::ca::CaCerts>> {
        use kiln_builder::egress::ca::{CaCerts, MAX_PEM_BYTES};
        use std::io::Read as _;
        let mut all: Option<CaCerts> = None;
        for f in &self.ca_cert {
            let mut text = Vec::new();
            std::fs::File::open(f)
                .and_then(|h| h.take(MAX_PEM_BYTES as u64 + 1).read_to_end(&mut text))
                .with_context(|| format!("--ca-cert {}", f.display()))?;
            let c = CaCerts::parse(&format!("--ca-cert {}", f.display()), &text)?;
            all = Some(match all {
                None => c,
                Some(a) => a.join(&c)?,
            });
        }
        Ok(all)
    }
}
