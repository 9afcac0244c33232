//! The resolve phase of a build: before anything runs, every base of the plan becomes a
//! manifest digest in the local cache, so caches and provenance record digests, never tags.
//!
//! - `FROM scratch` and `FROM <stage>` need nothing.
//! - `FROM <reference>`: a build context of that name (`--build-context
//!   NAME=oci-layout://DIR[:TAG]`, buildx's spelling) imports from an OCI layout; otherwise
//!   [`crate::base::resolve`] (the store's tags first, then pulled images, then the registry,
//!   per [`PullPolicy`]),
//!   with the stage's platform selecting from an index. Each distinct (reference, platform)
//!   is resolved once.
//! - `from: {bootstrap: ...}` runs [`crate::bootstrap`] (cached by its inputs); a spec without
//!   a mirror takes [`ResolveOptions::default_mirror`].
//!
//! The base image config's `OnBuild` triggers are returned with the stage, as written, and
//! [`resolve_recipe`] applies them: it lowers the recipe, resolves every base, then lowers it
//! again with what each base's config says ([`base_images`]: env, working directory, user,
//! ONBUILD triggers, as [`kiln_recipes::BaseImage`]). kiln-recipes splices the triggers right
//! after the FROM, in the stage's context, as Docker does; they are not inherited further,
//! and `FROM`, `MAINTAINER` and `ONBUILD` triggers are refused.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use kiln_recipes::plan::{Base, BuildPlan};
use kiln_store::BlobDigest;

use crate::base::{self, BaseError, PullPolicy, Scope};
use crate::bootstrap::{self, BootstrapError, BootstrapSpec};
use crate::cache::BlobCache;
use crate::image::Platform;
use crate::registry::{Registry, RegistryOptions};

/// Errors of the resolve phase; each names the stage.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// A base image could not be resolved.
    #[error("stage {stage}: {source}")]
    Base {
        /// Stage index.
        stage: usize,
        /// Why (boxed: base errors are large).
        source: Box<BaseError>,
    },
    /// A bootstrap base could not be built.
    #[error("stage {stage}: {source}")]
    Bootstrap {
        /// Stage index.
        stage: usize,
        /// Why (boxed: bootstrap errors are large).
        source: Box<BootstrapError>,
    },
    /// A stage platform does not parse (`os/arch[/variant]`).
    #[error("stage {stage}: invalid platform {platform:?}")]
    Platform {
        /// Stage index.
        stage: usize,
        /// The platform as written.
        platform: String,
    },
    /// A tenant build asked for a bootstrap base (it would run debootstrap on the server).
    #[error(
        "stage {0}: a bootstrap base cannot be built for a tenant; name an image of this \
         workspace, a global base or a registry image"
    )]
    BootstrapRefused(usize),
    /// A bootstrap spec has no mirror and no default was given.
    #[error("stage {0}: bootstrap has no mirror and the builder has no default mirror")]
    NoMirror(usize),
    /// The recipe did not lower (first pass, or the second with the bases' configs, e.g. a
    /// refused ONBUILD trigger).
    #[error(transparent)]
    Recipe(Box<kiln_recipes::RecipeError>),
    /// The second lowering gave stages other bases than the first (cannot happen: bases
    /// depend on global ARGs only).
    #[error("the plan's bases changed between lowering passes")]
    BasesChanged,
    /// An image config is not JSON of the expected shape.
    #[error("stage {stage}: image config {digest}: {reason}")]
    Config {
        /// Stage index.
        stage: usize,
        /// Config digest.
        digest: BlobDigest,
        /// What is wrong.
        reason: String,
    },
}

/// How to resolve.
#[derive(Debug, Clone, Default)]
pub struct ResolveOptions {
    /// `--pull` / `--offline` / neither.
    pub policy: PullPolicy,
    /// Named build contexts (`--build-context NAME=oci-layout://DIR[:TAG]`): a `FROM NAME`
    /// is that layout's image. An operator's builds only: a tenant's is refused.
    pub build_contexts: BTreeMap<String, crate::layout::LayoutRef>,
    /// Mirror for bootstrap specs that name none.
    pub default_mirror: Option<String>,
    /// Scratch directory for bootstrap trees.
    pub work_dir: PathBuf,
    /// Registry access (its platform is replaced by each stage's).
    pub registry: RegistryOptions,
    /// The remote store the cache fronts, when it is not the cache's own directory: each
    /// image base is first fetched from it ([`crate::front::Fronted::fetch`]), so a FROM
    /// finds the store's built images and pulled references whichever host made them.
    pub front: Option<crate::front::Fronted>,
    /// Whose build it is: under [`Scope::Tenant`] every image the recipe names goes through
    /// the workspace's rules ([`crate::base`]), registries are asked without the operator's
    /// credentials ([`RegistryOptions::docker_config`] and `credentials` are dropped), and
    /// bootstrap bases are refused.
    pub scope: Scope,
}

/// What a stage starts from, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedBase {
    /// Empty root.
    Scratch,
    /// An earlier stage (index into the plan's stages).
    Stage(usize),
    /// An image in the local cache.
    Image {
        /// The reference as written in the recipe (for messages).
        reference: String,
        /// The platform manifest digest.
        digest: BlobDigest,
        /// The config's `OnBuild` triggers, as written.
        onbuild: Vec<String>,
    },
}

/// The parts of image `digest`'s config that lowering needs (OCI image spec, config.md:
/// `config.Env`, `config.WorkingDir`, `config.User`, and Docker's `config.OnBuild`).
pub fn base_image_of(
    cache: &dyn BlobCache,
    stage: usize,
    digest: &BlobDigest,
) -> Result<kiln_recipes::BaseImage, ResolveError> {
    let m = base::manifest(cache, digest).map_err(|e| ResolveError::Base {
        stage,
        source: Box::new(e),
    })?;
    let cfg_err = |reason: String| ResolveError::Config {
        stage,
        digest: m.config.digest,
        reason,
    };
    let bytes = cache
        .read_blob(&m.config.digest)
        .map_err(|e| cfg_err(e.to_string()))?
        .ok_or_else(|| cfg_err("not in the local store".into()))?;
    base_image_of_config(stage, &m.config.digest, &bytes)
}

/// [`base_image_of`]'s reading of the config bytes themselves (`bytes`: an image config
/// JSON, OCI image spec config.md, as stored under `config_digest`): `config.Env` and
/// `config.OnBuild` as lists of strings, `config.WorkingDir` and `config.User` as strings
/// (empty or null: unset). Other fields are not looked at.
///
/// Errors: [`ResolveError::Config`] naming `stage`, `config_digest` and what is wrong (not
/// JSON, a field of another type).
pub fn base_image_of_config(
    stage: usize,
    config_digest: &BlobDigest,
    bytes: &[u8],
) -> Result<kiln_recipes::BaseImage, ResolveError> {
    let cfg_err = |reason: String| ResolveError::Config {
        stage,
        digest: *config_digest,
        reason,
    };
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| cfg_err(e.to_string()))?;
    let config = v.get("config");
    let strings = |key: &str| -> Result<Vec<String>, ResolveError> {
        match config.and_then(|c| c.get(key)) {
            None | Some(serde_json::Value::Null) => Ok(Vec::new()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| cfg_err(format!("{key} holds a non-string")))
                })
                .collect(),
            Some(_) => Err(cfg_err(format!("{key} is not a list"))),
        }
    };
    let string = |key: &str| -> Result<Option<String>, ResolveError> {
        match config.and_then(|c| c.get(key)) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) if s.is_empty() => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(cfg_err(format!("{key} is not a string"))),
        }
    };
    Ok(kiln_recipes::BaseImage {
        env: strings("Env")?,
        workdir: string("WorkingDir")?,
        user: string("User")?,
        onbuild: strings("OnBuild")?,
    })
}

fn onbuild_of(
    cache: &dyn BlobCache,
    stage: usize,
    digest: &BlobDigest,
) -> Result<Vec<String>, ResolveError> {
    Ok(base_image_of(cache, stage, digest)?.onbuild)
}

/// What lowering needs of every image base of `plan` (env, working directory, user, ONBUILD
/// triggers), keyed by the reference as the plan writes it, for
/// [`kiln_recipes::Options::base_images`]. `resolved` is [`resolve_plan`]'s answer for `plan`.
pub fn base_images(
    plan: &BuildPlan,
    resolved: &[ResolvedBase],
    cache: &dyn BlobCache,
) -> Result<BTreeMap<String, kiln_recipes::BaseImage>, ResolveError> {
    let mut out = BTreeMap::new();
    for (i, (stage, r)) in plan.stages.iter().zip(resolved).enumerate() {
        if let (Base::Image { reference }, ResolvedBase::Image { digest, .. }) = (&stage.base, r)
            && !out.contains_key(reference)
        {
            out.insert(reference.clone(), base_image_of(cache, i, digest)?);
        }
    }
    Ok(out)
}

/// The resolve phase of a build from recipe bytes: lowers the recipe (`path` picks the front
/// end, see [`kiln_recipes::load`]), resolves every base ([`resolve_plan`]), then lowers it
/// again with the bases' configs ([`base_images`], merged over any the caller gave), so the
/// plan has the bases' env, working directory and user and their ONBUILD triggers spliced in.
/// Returns that plan and its resolved bases. Errors: [`ResolveError::Recipe`] (either pass,
/// including a refused trigger), any [`resolve_plan`] error.
pub async fn resolve_recipe(
    path: &str,
    bytes: &[u8],
    options: &kiln_recipes::Options,
    opts: &ResolveOptions,
    cache: &dyn BlobCache,
) -> Result<(BuildPlan, Vec<ResolvedBase>), ResolveError> {
    let recipe = |o: &kiln_recipes::Options| {
        kiln_recipes::load(path, bytes, o).map_err(|e| ResolveError::Recipe(Box::new(e)))
    };
    let first = recipe(options)?;
    let resolved = resolve_plan(&first, opts, cache).await?;
    let mut second_opts = options.clone();
    for (k, v) in base_images(&first, &resolved, cache)? {
        second_opts.base_images.insert(k, v);
    }
    let plan = recipe(&second_opts)?;
    let bases = |p: &BuildPlan| p.stages.iter().map(|s| s.base.clone()).collect::<Vec<_>>();
    if bases(&plan) != bases(&first) {
        return Err(ResolveError::BasesChanged);
    }
    Ok((plan, resolved))
}

/// The egress proxy of a tenant's registry pulls, on a free port of 127.0.0.1: any name
/// whose addresses are public, or one of the registries the operator allows
/// ([`crate::base::Tenant::registries`]); each refusal is logged (`tracing`, warn). Its
/// thread, its URL (`http://127.0.0.1:PORT`) and what it refused or could not reach, in
/// order. Errors: [`BaseError::Proxy`].
fn tenant_proxy(t: &crate::base::Tenant) -> Result<TenantProxy, BaseError> {
    use crate::egress::address::AddressPolicy;
    use crate::egress::proxy::{Proxy, spawn};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(BaseError::Proxy)?;
    let addr = listener.local_addr().map_err(BaseError::Proxy)?;
    let policy = AddressPolicy {
        exempt: t.registries.clone(),
        ..Default::default()
    };
    let workspace = t.workspace.clone();
    let refused = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = std::sync::Arc::clone(&refused);
    let proxy = Proxy::addresses_only(policy, move |line| {
        tracing::warn!(workspace = %workspace, "registry pull: {line}");
    })
    .recording(move |e| {
        record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(e.clone());
    });
    let thread = spawn(listener, proxy).map_err(BaseError::Proxy)?;
    Ok(TenantProxy {
        _thread: thread,
        url: format!("http://{addr}"),
        refused,
    })
}

/// A tenant's pull proxy ([`tenant_proxy`]); it stops when dropped.
struct TenantProxy {
    _thread: crate::egress::proxy::ProxyThread,
    url: String,
    refused: std::sync::Arc<std::sync::Mutex<Vec<crate::egress::proxy::EgressError>>>,
}

impl TenantProxy {
    /// `e`, a failed pull of `spec`, as the tenant should read it: when the proxy refused or
    /// could not make a connection of the pull, what it said ([`BaseError::Egress`]), rather
    /// than what the registry client made of the proxy's answer (such as "authentication
    /// refused" for its 403).
    fn explain(&self, spec: &str, e: BaseError) -> BaseError {
        if !matches!(e, BaseError::Registry(_)) {
            return e;
        }
        let first = self
            .refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first()
            .cloned();
        match first {
            Some(source) => BaseError::Egress {
                registry: spec
                    .parse::<crate::reference::Reference>()
                    .map_or_else(|_| spec.to_string(), |r| r.registry().to_string()),
                source,
            },
            None => e,
        }
    }
}

/// Resolves one image `reference` as a recipe writes it (a `FROM`, `COPY --from`, `RUN
/// --mount=from=`) for `platform`: a named build context of that name first, then the
/// remote store's copy of what it names ([`crate::front::Fronted::fetch`]), then
/// [`base::resolve_in`] under [`ResolveOptions::scope`] with the registry options of the
/// build (for a tenant, without the operator's credentials). The platform manifest digest in
/// `cache`. Errors: [`BaseError`] (a fetch from the remote store as
/// [`BaseError::Cache`]).
pub async fn resolve_reference(
    opts: &ResolveOptions,
    reference: &str,
    platform: Platform,
    cache: &dyn BlobCache,
) -> Result<BlobDigest, BaseError> {
    if let Some(l) = opts.build_contexts.get(reference) {
        if let Scope::Tenant(_) = &opts.scope {
            return Err(BaseError::Refused {
                spec: reference.to_string(),
                why: format!(
                    "the build context {reference} is an OCI layout on the server ({l}), which \
                     a tenant build cannot name"
                ),
            });
        }
        return Ok(l.import(&platform, cache)?);
    }
    let mut ropts = RegistryOptions {
        platform,
        ..opts.registry.clone()
    };
    // A tenant's pulls: never with the operator's credentials, and every connection through
    // an egress proxy that checks each address (the registry's, its token realm's, a
    // redirect's) and resolves each name once. It stops when this resolution ends.
    let mut proxy = None;
    if let Scope::Tenant(t) = &opts.scope {
        ropts.docker_config = None;
        // The tenant's own credentials for this reference's registry, if it gave some.
        ropts.credentials = reference
            .parse::<crate::reference::Reference>()
            .ok()
            .and_then(|r| t.registry_auth.get(r.registry()).cloned());
        let p = tenant_proxy(t)?;
        ropts.proxy = Some(p.url.clone());
        proxy = Some(p);
    }
    let registry = Registry::new(ropts);
    // What the store may hold of it: under a tenant, only its own or a global base's tag.
    let fetch = match &opts.scope {
        Scope::Operator => Some(reference.to_string()),
        Scope::Tenant(t) => t.store_tag(reference).map(|t| t.to_string()),
    };
    if let (Some(f), Some(fetch)) = (&opts.front, fetch) {
        f.fetch(&fetch).await?;
    }
    match base::resolve_in(&opts.scope, reference, opts.policy, &registry, cache).await {
        Ok((d, _)) => Ok(d),
        Err(e) => Err(match &proxy {
            Some(p) => p.explain(reference, e),
            None => e,
        }),
    }
}

/// Resolves every stage base of `plan` (one entry per stage, in order).
pub async fn resolve_plan(
    plan: &BuildPlan,
    opts: &ResolveOptions,
    cache: &dyn BlobCache,
) -> Result<Vec<ResolvedBase>, ResolveError> {
    let mut done: HashMap<(String, String), BlobDigest> = HashMap::new();
    let mut out = Vec::with_capacity(plan.stages.len());
    for (i, stage) in plan.stages.iter().enumerate() {
        let resolved = match &stage.base {
            Base::Scratch => ResolvedBase::Scratch,
            Base::Stage { stage } => ResolvedBase::Stage(*stage),
            Base::Image { reference } => {
                let key = (reference.clone(), stage.platform.clone());
                let digest = match done.get(&key) {
                    Some(d) => *d,
                    None => {
                        let platform = Platform::parse(&stage.platform).map_err(|_| {
                            ResolveError::Platform {
                                stage: i,
                                platform: stage.platform.clone(),
                            }
                        })?;
                        let d = resolve_reference(opts, reference, platform, cache)
                            .await
                            .map_err(|e| ResolveError::Base {
                                stage: i,
                                source: Box::new(e),
                            })?;
                        done.insert(key, d);
                        d
                    }
                };
                ResolvedBase::Image {
                    reference: reference.clone(),
                    onbuild: onbuild_of(cache, i, &digest)?,
                    digest,
                }
            }
            Base::Bootstrap(_) if opts.scope != Scope::Operator => {
                return Err(ResolveError::BootstrapRefused(i));
            }
            Base::Bootstrap(b) => {
                let mirror = b
                    .mirror
                    .clone()
                    .or_else(|| opts.default_mirror.clone())
                    .ok_or(ResolveError::NoMirror(i))?;
                let spec = BootstrapSpec {
                    distro: b.distro.clone(),
                    suite: b.suite.clone(),
                    mirror,
                    variant: b.variant.clone(),
                    include: b.include.clone(),
                };
                let r = bootstrap::bootstrap(&spec, cache, &opts.work_dir)
                    .await
                    .map_err(|e| ResolveError::Bootstrap {
                        stage: i,
                        source: Box::new(e),
                    })?;
                ResolvedBase::Image {
                    reference: format!("bootstrap:{}:{}", spec.distro, spec.suite),
                    onbuild: Vec::new(),
                    digest: r.digest,
                }
            }
        };
        out.push(resolved);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry (on 127.0.0.1, allowed by its port) whose token realm is at a port the
    /// tenant may not reach: the pull fails saying that the egress proxy refused the realm
    /// and why, not "authentication refused" (what the registry client makes of the
    /// proxy's 403).
    #[test]
    fn a_pull_the_egress_proxy_refuses_names_the_proxy_and_its_rule() {
        use std::io::{BufRead, BufReader, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut c) = conn else { return };
                let mut r = BufReader::new(c.try_clone().expect("clone"));
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                        break;
                    }
                }
                let _ = c.write_all(
                    b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer \
                      realm=\"http://127.0.0.1:1/token\",service=\"x\"\r\n\
                      Content-Length: 0\r\nConnection: close\r\n\r\n",
                );
            }
        });
        let t = crate::base::Tenant {
            workspace: "acme".into(),
            global_bases: Default::default(),
            registries: [format!("127.0.0.1:{port}")].into(),
            own_images: Default::default(),
            registry_auth: Default::default(),
        };
        let p = tenant_proxy(&t).expect("proxy");
        let reg = Registry::new(RegistryOptions {
            proxy: Some(p.url.clone()),
            ..Default::default()
        });
        let spec = format!("127.0.0.1:{port}/x:t");
        let r: crate::reference::Reference = spec.parse().expect("reference");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let e = rt.block_on(reg.resolve(&r)).expect_err("refused");
        let text = p.explain(&spec, BaseError::Registry(e)).to_string();
        assert!(
            text.starts_with(&format!(
                "127.0.0.1:{port}: the egress proxy refused GET 127.0.0.1:1: "
            )),
            "{text}"
        );
        assert!(text.contains("is not a public address"), "{text}");
        assert!(!text.contains("authentication"), "{text}");
    }

    /// A registry name that does not resolve is said so, not "refused".
    #[test]
    fn a_name_that_does_not_resolve_is_not_called_refused() {
        use crate::egress::address::AddressError;
        use crate::egress::proxy::EgressError;
        let e = BaseError::RegistryAddress {
            registry: "reg.example".into(),
            source: AddressError::Resolve {
                host: "reg.example".into(),
                detail: "failed to lookup address information".into(),
            },
        };
        assert_eq!(
            e.to_string(),
            "reg.example: could not resolve reg.example: failed to lookup address information"
        );
        let e = BaseError::Egress {
            registry: "reg.example".into(),
            source: EgressError::Unresolved {
                host: "auth.reg.example".into(),
                detail: "no answer".into(),
            },
        };
        assert_eq!(
            e.to_string(),
            "reg.example: could not resolve auth.reg.example: no answer"
        );
        let e = BaseError::RegistryAddress {
            registry: "10.0.0.1".into(),
            source: AddressError::NotPublic {
                host: "10.0.0.1".into(),
                addr: "10.0.0.1".parse().expect("ip"),
            },
        };
        assert!(
            e.to_string().contains("registry refused for this build"),
            "{e}"
        );
    }

    #[test]
    fn base_image_of_config_reads_env_user_workdir_onbuild_and_names_bad_fields() {
        let cfg = br#"{"architecture":"amd64","os":"linux","config":{"Env":["A=1"],
            "User":"1000","WorkingDir":"","OnBuild":["RUN make"]}}"#;
        let cfg_digest = BlobDigest::of(cfg);
        let b = base_image_of_config(2, &cfg_digest, cfg).expect("reads");
        assert_eq!(b.env, ["A=1"]);
        assert_eq!(b.user.as_deref(), Some("1000"));
        assert_eq!(b.workdir, None, "an empty WorkingDir is unset");
        assert_eq!(b.onbuild, ["RUN make"]);
        let b = base_image_of_config(0, &cfg_digest, br#"{"config":null}"#).expect("reads");
        assert!(b.env.is_empty() && b.user.is_none() && b.onbuild.is_empty());
        for bad in [
            &br#"{"config":{"Env":"A=1"}}"#[..],
            br#"{"config":{"User":7}}"#,
            b"{",
        ] {
            let e = base_image_of_config(3, &cfg_digest, bad).expect_err("refused");
            assert!(
                matches!(&e, ResolveError::Config { stage: 3, digest, .. } if *digest == cfg_digest),
                "{e}"
            );
        }
    }
}
