//! Options shared by the image subcommands (store location, registry access), and the
//! [`ImageStore`] they work on.

use anyhow::Context as _;
use kiln_builder::base;
use kiln_builder::cache::LocalCache;
use kiln_builder::image::Platform;
use kiln_builder::reference::{DEFAULT_TAG, Reference};
use kiln_builder::registry::{Registry, RegistryOptions};
use kiln_store::copy::{CopyOptions, copy_oci_manifest, copy_oci_ref};
use kiln_store::{BlobDigest, Manifest, ObjectRef, OciRef, Store};

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
        let local = if store.local_root().is_some() {
            None
        } else {
            Some(Store::open(&dir.to_string_lossy()).await?)
        };
        Ok(ImageStore {
            cache,
            store,
            local,
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
/// to the store after a command wrote. So every command reads and writes the same images
/// whichever the store is.
pub struct ImageStore {
    /// The blob files the builder's code reads and writes (OCI manifests, configs, layers,
    /// OCI references, and copies of store tags).
    pub cache: LocalCache,
    /// The configured store.
    pub store: Store,
    /// [`ImageStore::cache`]'s directory as a store, when it is not [`ImageStore::store`].
    local: Option<Store>,
}

impl ImageStore {
    /// Copies what `spec` names in a remote store into the cache, so that
    /// [`base::lookup`] finds it there: a store tag (`NAME:TAG`: its image manifest, the
    /// tag itself and the OCI image it was built as), an OCI reference `kiln pull` or
    /// `kiln import` wrote (`registry/repo:tag`), or an OCI manifest digest
    /// (`sha256:<hex>`, `repo@sha256:<hex>`), each with every blob it reaches, verified. The
    /// same order as [`base::lookup`]: store tags first. Nothing for a local store, or when
    /// the store has nothing by that name. Errors: the store's (a missing or corrupt blob
    /// names its key and the store).
    pub async fn fetch(&self, spec: &str) -> anyhow::Result<()> {
        let Some(local) = &self.local else {
            return Ok(());
        };
        let remote = &self.store;
        let opts = CopyOptions::default();
        if spec.starts_with("sha256:") {
            let d: BlobDigest = spec.parse()?;
            if remote.has(&ObjectRef::Blob(d)).await? {
                copy_oci_manifest(remote, local, d, &opts).await?;
            }
            return Ok(());
        }
        if let Some(t) = base::as_store_tag(spec)
            && let Some(rec) = remote.get_tag(&t).await?
        {
            let raw = remote.get_raw_manifest(&rec.manifest).await?;
            if let Manifest::Image(m) = raw.parse()?
                && let Some(oci) = m.oci_manifest
            {
                copy_oci_manifest(remote, local, oci.digest, &opts).await?;
                local.put_raw_manifest(&raw).await?;
                local.force_tag(&t, rec.manifest).await?;
                return Ok(());
            }
        }
        let Ok(r) = spec.parse::<Reference>() else {
            return Ok(());
        };
        if let Some(d) = r.digest() {
            let d: BlobDigest = d.parse()?;
            if remote.has(&ObjectRef::Blob(d)).await? {
                copy_oci_manifest(remote, local, d, &opts).await?;
            }
        } else if let Some(o) = oci_ref_of(&r)
            && remote.get_oci_ref(&o).await?.is_some()
        {
            copy_oci_ref(remote, local, &o, &opts).await?;
        }
        Ok(())
    }

    /// After a command put the OCI image `digest` into the cache (a pull, an import, an
    /// unpack that fetched its image), writes it through to a remote store: every blob it
    /// reaches, then the OCI reference `reference` (`registry/repo:tag`, as the command set
    /// it in the cache) when given. Nothing for a local store. Errors: the store's, a
    /// reference that is not a valid OCI reference name.
    pub async fn publish(&self, digest: &str, reference: Option<&str>) -> anyhow::Result<()> {
        let Some(local) = &self.local else {
            return Ok(());
        };
        let opts = CopyOptions::default();
        match reference {
            Some(name) => {
                let o: OciRef = name
                    .parse()
                    .with_context(|| format!("{name}: not an OCI reference name"))?;
                copy_oci_ref(local, &self.store, &o, &opts).await?;
            }
            None => {
                copy_oci_manifest(local, &self.store, digest.parse()?, &opts).await?;
            }
        }
        Ok(())
    }
}

/// The OCI reference (`registry/repo:tag`) a pull of `r` sets, `None` for a digest-pinned
/// reference (a pull of one sets none).
pub fn oci_ref_of(r: &Reference) -> Option<OciRef> {
    if r.digest().is_some() {
        return None;
    }
    format!("{}:{}", r.name(), r.tag().unwrap_or(DEFAULT_TAG))
        .parse()
        .ok()
}

/// A runtime for one command.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}
