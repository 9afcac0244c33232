//! Base images: turn a FROM (or a `kiln pull` / `kiln unpack` argument) into a manifest
//! digest in the local cache, and unpack an image into a directory.
//!
//! Resolution order, as Docker uses local images: an `oci:DIR[:TAG]` spec imports from a
//! layout; a reference pinned by digest whose manifest is cached is used as is; otherwise the
//! local store is looked at first: its own tags (`kiln tag` / `kiln build -t`: a spec as
//! written that is a store tag `NAME[:TAG]` whose kiln image manifest has an OCI manifest
//! gives that OCI image), then its OCI references (`registry/repo:tag`, from `kiln pull` and
//! `kiln import`), then the registry. An image found locally whose config or layers are not
//! all in the store counts as not found. [`PullPolicy::Always`] (`--pull`) always asks the
//! registry; [`PullPolicy::Never`] (`--offline`) never does and fails with
//! [`BaseError::NotCached`], naming what was looked for. The digest, never the tag, is what
//! callers should record.
//!
//! That is the [`Scope::Operator`] resolution, for the CLI and the nightly. A tenant build
//! of `kiln serve` resolves under [`Scope::Tenant`], where a recipe names nothing outside its
//! workspace ([`resolve_in`]):
//! - a store tag `NAME[:TAG]` is the workspace's `<ws>.NAME[:TAG]`, or the global
//!   `NAME[:TAG]` when the operator allows `NAME` ([`Tenant::global_bases`]); another
//!   workspace's tag is looked for as the workspace's own, so it is "not found" exactly as a
//!   tag nobody has;
//! - a digest names a store image with the tag it is under (`NAME:TAG@sha256:…`, or
//!   `NAME@sha256:…` for `:latest`), checked against what that tag names, or when the
//!   workspace built that image ([`Tenant::own_images`]: under any name, or bare as
//!   `sha256:…`); anything else pinned by digest goes to its registry, which decides what
//!   the tenant may read. The store's cached manifests and the pulled references other
//!   builds left are never answered by digest or name alone;
//! - registry names are always asked of the registry (as `--pull` does), never with the
//!   operator's credentials (anonymously, or with those the tenant gave for that registry,
//!   [`Tenant::registry_auth`]), and only at public addresses unless the operator names
//!   the registry ([`Tenant::registries`]);
//! - host paths (`oci:DIR`) are refused.

use std::path::Path;

use std::collections::{BTreeMap, BTreeSet};

use kiln_store::BlobDigest;

use crate::cache::{BlobCache, parse_digest};
use crate::egress::address::{AddressError, AddressPolicy};
use crate::image::{AnyManifest, ImageError, Manifest};
use crate::layer::{LayerError, LayerStats, Limits, apply_layer};
use crate::layout::{self, LayoutError};
use crate::reference::{Reference, ReferenceError};
use crate::registry::{Registry, RegistryError};

/// Errors resolving or unpacking a base image.
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    /// The egress proxy of a tenant's registry pulls could not start.
    #[error("starting the registry pulls' egress proxy: {0}")]
    Proxy(#[source] std::io::Error),
    /// The reference does not parse.
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    /// A registry problem (including `--offline` misses).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A tenant's pull failed because its egress proxy refused a connection of it (the
    /// registry's, its token realm's, a redirect's) or could not make one: what the proxy
    /// said, not what the registry client made of its answer.
    #[error("{registry}: {source}")]
    Egress {
        /// The registry (`host[:port]`).
        registry: String,
        /// The proxy's refusal or failure.
        source: crate::egress::proxy::EgressError,
    },
    /// An OCI layout problem.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A layer could not be applied.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// A manifest problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A cache problem.
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    /// `--offline` and the image is not (completely) in the store (local or S3).
    #[error(
        "{spec} is not in the store and --offline forbids asking a registry \
         (looked for {looked}; kiln pull or kiln import it, or build and tag it, first)"
    )]
    NotCached {
        /// The reference as written.
        spec: String,
        /// What was looked for, e.g. `store tag debian:bookworm, pulled image
        /// docker.io/library/debian:bookworm`, or the blob that is missing.
        looked: String,
    },
    /// A layer blob the manifest names is not cached.
    #[error("layer {0} is not in the local store (pull the image first)")]
    MissingBlob(String),
    /// A tenant build named something tenants may not name (an OCI layout on the server, a
    /// bootstrap base).
    #[error("{spec}: {why}")]
    Refused {
        /// The reference as written.
        spec: String,
        /// Why, in the tenant's terms.
        why: String,
    },
    /// A tenant build named a registry at an address tenants may not reach, or whose name
    /// does not resolve (then the text says so, not that it was refused).
    #[error("{registry}: {}", registry_address_text(source))]
    RegistryAddress {
        /// The registry (`host[:port]`).
        registry: String,
        /// The address check's answer.
        source: AddressError,
    },
    /// The unpack target could not be prepared or a blob not opened.
    #[error("{path}: {source}")]
    Io {
        /// The path involved.
        path: std::path::PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

/// What [`BaseError::RegistryAddress`] says: a refusal for an address tenants may not
/// reach, the resolver's failure as it is.
fn registry_address_text(e: &AddressError) -> String {
    match e {
        AddressError::NotPublic { .. } => format!("registry refused for this build: {e}"),
        _ => e.to_string(),
    }
}

/// When to ask the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PullPolicy {
    /// Local references first, the registry when missing (Docker's default for FROM).
    #[default]
    Missing,
    /// Always ask the registry (`--pull`).
    Always,
    /// Never ask (`--offline`).
    Never,
}

/// Where an image came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Found in the local cache.
    Local,
    /// Imported from an OCI layout.
    Layout,
    /// Pulled from a registry: blobs downloaded and bytes.
    Registry {
        /// Blobs downloaded.
        fetched: usize,
        /// Bytes downloaded.
        bytes: u64,
    },
}

/// Whose build this is: what its recipe may name (module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Scope {
    /// The CLI and the nightly: every form, the store's tags and cached images, OCI
    /// layouts on this host, the operator's registry credentials.
    #[default]
    Operator,
    /// A tenant of `kiln serve`: only its workspace's images, the global bases the operator
    /// allows, and registries.
    Tenant(Tenant),
}

/// A tenant build's workspace and what the operator lets every tenant use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// The workspace id (`[a-z0-9]+([_-][a-z0-9]+)*`): its store tags are `<ws>.NAME:TAG`.
    pub workspace: String,
    /// Store tag names every tenant may name, with any tag (`kiln serve --base NAME`), e.g.
    /// the image the nightly rebuilds. No workspace may create a tag of such a name.
    pub global_bases: BTreeSet<String>,
    /// Registries (`host[:port]`, as a reference writes them) tenants may pull from although
    /// they are at a loopback, private or link-local address (`kiln serve
    /// --allow-registry`).
    pub registries: BTreeSet<String>,
    /// The images this workspace built, by each of their digests (`sha256:…`: the kiln
    /// image manifest, the one before its snapshot, the OCI manifest) → the OCI manifest
    /// digest. The tenant names them by digest under any name (`NAME@sha256:…`) or bare
    /// (`sha256:…`).
    pub own_images: BTreeMap<String, BlobDigest>,
    /// Credentials the tenant gave for this build, by registry (`host[:port]`, as its
    /// references write it): a pull from that registry uses them, and no other. `Debug`
    /// hides the passwords.
    pub registry_auth: BTreeMap<String, crate::registry::Credentials>,
}

impl Tenant {
    /// The store tag `spec` names in this workspace when it is written as one (`NAME`,
    /// `NAME:TAG`, either with `@sha256:…`): `NAME:TAG` itself for a global base, else
    /// `<ws>.NAME:TAG`. `None` when `spec` is not in the store tag grammar (or is too long
    /// once prefixed).
    pub fn store_tag(&self, spec: &str) -> Option<kiln_store::TagRef> {
        let name = spec.split_once('@').map_or(spec, |(n, _)| n);
        let t = as_store_tag(name)?;
        if self.global_bases.contains(&t.name) {
            return Some(t);
        }
        kiln_store::TagRef::new(&format!("{}.{}", self.workspace, t.name), &t.tag).ok()
    }

    /// Whether a tenant build may pull from `r`'s registry: one the operator named, or a
    /// name all of whose addresses are public ([`AddressPolicy`] with no exception; HTTPS,
    /// port 443 unless the reference gives one). Errors: [`BaseError::RegistryAddress`].
    ///
    /// This check, before the pull, gives the clear error; the pull itself connects only
    /// through the tenant's egress proxy ([`crate::resolve::resolve_reference`]), which
    /// checks every connection the same way: the registry's, its token realm's and each
    /// redirect's.
    pub async fn check_registry(&self, r: &Reference) -> Result<(), BaseError> {
        let registry = r.registry();
        // `host`, `host:port`, `[v6]` or `[v6]:port`.
        let (host, port) = match registry.rsplit_once(':') {
            Some((h, p)) if !p.ends_with(']') => (h, p.parse().unwrap_or(443)),
            _ => (registry, 443),
        };
        let host = if host == crate::reference::DEFAULT_REGISTRY {
            "registry-1.docker.io"
        } else {
            host
        };
        AddressPolicy {
            exempt: self.registries.clone(),
            ..Default::default()
        }
        .resolve(host, port)
        .await
        .map(|_| ())
        .map_err(|source| BaseError::RegistryAddress {
            registry: registry.to_string(),
            source,
        })
    }
}

/// Resolves `spec` (`oci:DIR[:TAG]` or an image reference) to a cached manifest digest, as
/// the operator's builds do ([`resolve_in`] under [`Scope::Operator`]).
pub async fn resolve(
    spec: &str,
    policy: PullPolicy,
    registry: &Registry,
    cache: &dyn BlobCache,
) -> Result<(BlobDigest, Source), BaseError> {
    resolve_in(&Scope::Operator, spec, policy, registry, cache).await
}

/// Resolves `spec` to a cached manifest digest under `scope` (module doc). Under
/// [`Scope::Tenant`], `registry` must carry no credentials of the operator's (the resolve
/// phase gives it none). Errors: as [`resolve`], plus [`BaseError::Refused`] and
/// [`BaseError::RegistryAddress`] for a tenant.
pub async fn resolve_in(
    scope: &Scope,
    spec: &str,
    policy: PullPolicy,
    registry: &Registry,
    cache: &dyn BlobCache,
) -> Result<(BlobDigest, Source), BaseError> {
    if let Scope::Tenant(t) = scope {
        return resolve_tenant(t, spec, policy, registry, cache).await;
    }
    if let Some(l) = layout::LayoutRef::parse(spec) {
        return Ok((
            l.import(&registry.options().platform, cache)?,
            Source::Layout,
        ));
    }
    let r: Reference = spec.parse()?;
    if policy != PullPolicy::Always {
        let found = match store_tag(spec, cache)? {
            Some(d) => Some(d),
            None => local(&r, cache)?,
        };
        if let Some(d) = &found {
            match first_missing(cache, d)? {
                None => return Ok((*d, Source::Local)),
                Some(missing) if policy == PullPolicy::Never => {
                    return Err(BaseError::NotCached {
                        spec: spec.to_string(),
                        looked: format!("image {d}, whose blob {missing} is missing"),
                    });
                }
                Some(_) => {}
            }
        }
        if policy == PullPolicy::Never {
            return Err(BaseError::NotCached {
                spec: spec.to_string(),
                looked: looked_for(spec, &r),
            });
        }
    }
    pull(registry, &r, cache).await
}

/// Pulls `r` into `cache`: its digest, as [`Source::Registry`].
async fn pull(
    registry: &Registry,
    r: &Reference,
    cache: &dyn BlobCache,
) -> Result<(BlobDigest, Source), BaseError> {
    let p = registry.pull(r, cache).await?;
    Ok((
        p.digest,
        Source::Registry {
            fetched: p.fetched,
            bytes: p.fetched_bytes,
        },
    ))
}

async fn resolve_tenant(
    t: &Tenant,
    spec: &str,
    policy: PullPolicy,
    registry: &Registry,
    cache: &dyn BlobCache,
) -> Result<(BlobDigest, Source), BaseError> {
    if layout::LayoutRef::parse(spec).is_some() {
        return Err(BaseError::Refused {
            spec: spec.to_string(),
            why: "an OCI layout on the server (oci:DIR) cannot be named by a tenant build; \
                  name a registry image, an image of this workspace or a global base"
                .into(),
        });
    }
    // An image this workspace built, named by one of its digests.
    let pinned = match spec.rsplit_once('@') {
        Some((_, d)) => d,
        None => spec,
    };
    if let Some(d) = t.own_images.get(pinned)
        && cache.blob_path(d)?.is_some()
        && first_missing(cache, d)?.is_none()
    {
        return Ok((*d, Source::Local));
    }
    let r: Reference = spec.parse()?;
    if let Some(tag) = t.store_tag(spec)
        && let Some(d) = cache.store_tag(&tag.to_string())?
        && r.digest().is_none_or(|want| want == d.to_string())
        && cache.blob_path(&d)?.is_some()
        && first_missing(cache, &d)?.is_none()
    {
        return Ok((d, Source::Local));
    }
    if policy == PullPolicy::Never {
        return Err(BaseError::NotCached {
            spec: spec.to_string(),
            looked: match t.store_tag(spec) {
                Some(tag) => format!("store tag {}", tenant_name(t, &tag)),
                None => "no store tag".into(),
            },
        });
    }
    t.check_registry(&r).await?;
    pull(registry, &r, cache).await
}

/// A tenant's store tag as the tenant writes it (`<ws>.` taken off).
fn tenant_name(t: &Tenant, tag: &kiln_store::TagRef) -> String {
    let s = tag.to_string();
    match s
        .strip_prefix(&t.workspace)
        .and_then(|r| r.strip_prefix('.'))
    {
        Some(own) => own.to_string(),
        None => s,
    }
}

/// The store tag a spec as written names (`NAME:TAG`, or `NAME` for `NAME:latest`; `NAME` may
/// be `myorg/app`), if it is one in kiln's tag grammar. A digest-pinned spec never is.
pub fn as_store_tag(spec: &str) -> Option<kiln_store::TagRef> {
    if spec.contains('@') {
        return None;
    }
    spec.parse().ok()
}

/// The OCI manifest digest of the kiln image the store tag `spec` names, when it is a store
/// tag, exists, and its image has an OCI manifest in the store.
pub fn store_tag(spec: &str, cache: &dyn BlobCache) -> Result<Option<BlobDigest>, BaseError> {
    let Some(t) = as_store_tag(spec) else {
        return Ok(None);
    };
    match cache.store_tag(&t.to_string())? {
        Some(d) if cache.blob_path(&d)?.is_some() => Ok(Some(d)),
        _ => Ok(None),
    }
}

fn looked_for(spec: &str, r: &Reference) -> String {
    let pulled = match r.digest() {
        Some(d) => format!("image {d}"),
        None => format!(
            "pulled image {}:{}",
            r.name(),
            r.tag().unwrap_or(crate::reference::DEFAULT_TAG)
        ),
    };
    match as_store_tag(spec) {
        Some(t) => format!("store tag {t}, {pulled}"),
        None => pulled,
    }
}

/// The first blob (config, then layers) of image manifest `digest` that the cache lacks;
/// `None` when the image is complete.
fn first_missing(
    cache: &dyn BlobCache,
    digest: &BlobDigest,
) -> Result<Option<BlobDigest>, BaseError> {
    let m = manifest(cache, digest)?;
    for d in std::iter::once(&m.config).chain(&m.layers) {
        if cache.blob_path(&d.digest)?.is_none() {
            return Ok(Some(d.digest));
        }
    }
    Ok(None)
}

/// The cached platform manifest for a reference, if any: by its digest, or by its name.
/// A digest that names a cached index is not followed here (pull resolves platforms).
pub fn local(r: &Reference, cache: &dyn BlobCache) -> Result<Option<BlobDigest>, BaseError> {
    if let Some(d) = r.digest() {
        let d = parse_digest(d, &format!("reference {r}"))?;
        if let Some(b) = cache.read_blob(&d)?
            && matches!(AnyManifest::parse(&b, &d)?, AnyManifest::Image(_))
        {
            return Ok(Some(d));
        }
        return Ok(None);
    }
    let tag = r.tag().unwrap_or(crate::reference::DEFAULT_TAG);
    match cache.get_ref(&format!("{}:{tag}", r.name()))? {
        Some(d) if cache.blob_path(&d)?.is_some() => Ok(Some(d)),
        _ => Ok(None),
    }
}

/// Finds an image in the cache by `sha256:<hex>`, store tag, or reference (pulled or
/// imported).
pub fn lookup(spec: &str, cache: &dyn BlobCache) -> Result<Option<BlobDigest>, BaseError> {
    if spec.starts_with("sha256:") {
        let d = parse_digest(spec, "the image name")?;
        return Ok(cache.blob_path(&d)?.map(|_| d));
    }
    if let Some(d) = store_tag(spec, cache)? {
        return Ok(Some(d));
    }
    local(&spec.parse()?, cache)
}

/// The parsed manifest `digest` from the cache.
pub fn manifest(cache: &dyn BlobCache, digest: &BlobDigest) -> Result<Manifest, BaseError> {
    let b = cache
        .read_blob(digest)?
        .ok_or_else(|| BaseError::MissingBlob(digest.to_string()))?;
    match AnyManifest::parse(&b, digest)? {
        AnyManifest::Image(m) => Ok(m),
        AnyManifest::Index(_) => Err(BaseError::MissingBlob(format!("{digest} (an index)"))),
    }
}

/// Unpacks the image `digest` into `dir` (created if missing), layer by layer. Returns the
/// summed [`LayerStats`].
pub fn unpack(
    cache: &dyn BlobCache,
    digest: &BlobDigest,
    dir: &Path,
    limits: &Limits,
) -> Result<LayerStats, BaseError> {
    let m = manifest(cache, digest)?;
    std::fs::create_dir_all(dir).map_err(|source| BaseError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut total = LayerStats::default();
    for l in &m.layers {
        let p = cache
            .blob_path(&l.digest)?
            .ok_or_else(|| BaseError::MissingBlob(l.digest.to_string()))?;
        let f = std::fs::File::open(&p).map_err(|source| BaseError::Io { path: p, source })?;
        let s = apply_layer(dir, f, &l.digest.to_string(), limits)?;
        total.entries += s.entries;
        total.bytes += s.bytes;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acme() -> Tenant {
        Tenant {
            workspace: "acme".into(),
            global_bases: ["gbase".to_string()].into(),
            registries: ["127.0.0.1:5000".to_string()].into(),
            own_images: BTreeMap::new(),
            registry_auth: BTreeMap::new(),
        }
    }

    #[test]
    fn a_tenant_store_tag_is_its_workspace_or_a_global_base() {
        let t = acme();
        let d = format!("sha256:{}", "a".repeat(64));
        for (spec, want) in [
            ("app:1".to_string(), Some("acme.app:1")),
            ("app".to_string(), Some("acme.app:latest")),
            (format!("app:1@{d}"), Some("acme.app:1")),
            (format!("app@{d}"), Some("acme.app:latest")),
            // Another workspace's name stays inside this one.
            ("evil.app:1".to_string(), Some("acme.evil.app:1")),
            ("gbase:7".to_string(), Some("gbase:7")),
            ("myorg/app:2".to_string(), Some("acme.myorg/app:2")),
            ("127.0.0.1:5000/x:y".to_string(), None),
            ("oci:/srv/layout:1".to_string(), None),
        ] {
            assert_eq!(
                t.store_tag(&spec).map(|t| t.to_string()).as_deref(),
                want,
                "{spec}"
            );
        }
    }

    #[tokio::test]
    async fn a_tenant_reaches_only_public_registries_and_those_allowed() {
        let t = acme();
        let check = |s: &str| {
            let r: Reference = s.parse().expect("reference");
            let t = t.clone();
            async move { t.check_registry(&r).await }
        };
        check("127.0.0.1:5000/x:1").await.expect("allowed by name");
        for refused in [
            "127.0.0.1:5002/x:1",
            "localhost:5000/x:1",
            "[::1]:5000/x:1",
            "169.254.169.254/x:1",
            "10.0.0.1:443/x:1",
            "192.168.1.1/x:1",
        ] {
            match check(refused).await {
                Err(BaseError::RegistryAddress {
                    source: AddressError::NotPublic { .. },
                    ..
                }) => {}
                other => panic!("{refused}: {other:?}"),
            }
        }
    }
}
