//! The HTTP API: routes, request and response bodies, errors.
//!
//! Every `/v1` route needs `Authorization: Bearer <key>` and acts within the key's
//! workspace. Error bodies are `{"error": "<code>", "message": "<text>"}`; a 404 body names
//! only the kind of object, so another workspace's object and a missing one get the same
//! bytes. Request bodies with unknown fields are refused (400).

use std::collections::BTreeMap;

use axum::Json;
use axum::body::Body;
use axum::extract::{FromRequest as _, Multipart, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use futures_util::StreamExt as _;
use serde::{Deserialize, Serialize};
use utoipa::{OpenApi, ToSchema};

use crate::AppState;
use crate::auth::Workspace;
use crate::context::{self, ContextError};
use crate::db::{DbError, Inserted, NewBuild};
use crate::spec::{AllowListSpec, EffectiveLimits, NetworkMode, NetworkSpec, StoredSpec};
use crate::tags;

mod doc;
mod error;
mod store;

pub use self::doc::ApiDoc;
use self::doc::openapi;
pub use self::error::{ApiError, ErrorBody};
pub use self::store::{BlobView, ImageView, TagBody, TagView};

/// Largest recipe, bytes (1 MiB).
pub const MAX_RECIPE_BYTES: u64 = 1 << 20;
/// Largest JSON body or `build` part, bytes (1 MiB).
pub const MAX_JSON_BYTES: usize = 1 << 20;
/// Seconds a 429 asks the client to wait (`Retry-After`).
pub const RETRY_AFTER_SECS: u64 = 10;
/// The smallest `limits.disk_mib`, MiB (a microVM step's upper disk is at least 64 MiB, so
/// that its file system fits).
pub const MIN_DISK_MIB: u64 = 64;
/// The largest and default `limits.disk_mib`, MiB (the builder's
/// [`kiln_pipeline::DEFAULT_WRITE_LIMIT_BYTES`], 10 GiB).
pub const MAX_DISK_MIB: u64 = kiln_pipeline::DEFAULT_WRITE_LIMIT_BYTES >> 20;

/// The limits a build asks for; each is capped by the workspace's quota.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// Time for the whole build, seconds (default and cap: the quota's, 900).
    pub timeout_secs: Option<u64>,
    /// Memory of each step, MiB (default and cap: the quota's, 1024).
    pub memory_mib: Option<u64>,
    /// vCPUs of the boot-once VM (default 1; cap: the quota's).
    pub vcpus: Option<u32>,
    /// Bytes each step may write, MiB: a microVM step's disk, which fills at this size
    /// ("disk full"); default and cap 10240 (the builder's 10 GiB write limit), at least 64.
    pub disk_mib: Option<u64>,
}

/// A build submission: the `build` part of a multipart body, the JSON body, or the
/// `Kiln-Build` header of a tar body.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildSpec {
    /// The recipe's name: its path inside the context (default `Dockerfile`), or, with a
    /// `recipe` part, the name its errors use. `*.yaml`/`*.yml`: a YAML recipe.
    pub recipe: Option<String>,
    /// An uploaded context blob (`PUT /v1/blobs/...`), instead of a `context` part.
    pub context: Option<String>,
    /// Tags to point at the image, `name:tag`, in the workspace's namespace.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Build arguments.
    #[serde(default)]
    pub build_args: BTreeMap<String, String>,
    /// Stage to build (name or index); default the last.
    pub target: Option<String>,
    /// `os/arch[/variant]`; default `linux/amd64`.
    pub platform: Option<String>,
    /// Boot the image once and store its snapshot.
    #[serde(default)]
    pub snapshot: bool,
    /// The steps' network.
    #[serde(default)]
    pub network: NetworkSpec,
    /// Limits, capped by the workspace's quota.
    #[serde(default)]
    pub limits: LimitsSpec,
    /// Look no step up in the build cache.
    #[serde(default)]
    pub no_cache: bool,
    /// Credentials for private registries this build pulls from: registry (`host[:port]`)
    /// → `{"username", "password"}`. Used for this build's pulls from that registry only,
    /// never logged, and kept only sealed until the build ends (the server needs
    /// `--credentials-key-file`; without it such a submission is refused).
    #[serde(default)]
    pub registry_auth: crate::sealed::RegistryAuth,
    /// Extra CA certificates (PEM text, one or more `CERTIFICATE` sections, at most 64 KiB
    /// and 32 certificates with the server's own `--ca-cert`): every `RUN` step sees them in
    /// its CA bundle and `ADD <url>` trusts them, for this build only; they change no layer
    /// and no cache key. Anything but certificates is a 400.
    pub ca_certs: Option<String>,
    /// Follow the base: when the global base the image is built `FROM` (by tag; `kiln serve
    /// --base`) moves, the server builds this submission again (same recipe, context and
    /// options; the context is kept while the image follows), checks the new image as
    /// described under `GET /v1/follows`, and moves the tags to it only from the image this
    /// build made. The build needs tags, and its target stage's `FROM`s must lead to a
    /// global base named by tag; anything else is a 400.
    #[serde(default)]
    pub follow_base: bool,
}

/// URLs of a build.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BuildUrls {
    /// `GET` its state.
    #[serde(rename = "self")]
    pub this: String,
    /// `GET` its log.
    pub logs: String,
    /// `POST` to cancel it.
    pub cancel: String,
}

impl BuildUrls {
    fn new(id: &str) -> Self {
        BuildUrls {
            this: format!("/v1/builds/{id}"),
            logs: format!("/v1/builds/{id}/logs"),
            cancel: format!("/v1/builds/{id}/cancel"),
        }
    }
}

/// The answer to an accepted submission (the same for an idempotent retry).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Accepted {
    /// The build id.
    pub id: String,
    /// Its URLs.
    pub urls: BuildUrls,
}

/// One step of a build.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct StepView {
    /// Build-wide step number.
    pub step: i64,
    /// Stage index.
    pub stage: i64,
    /// `file:line` in the recipe.
    pub location: String,
    /// The instruction, shortened.
    pub instruction: String,
    /// Found in the build cache.
    pub cached: bool,
    /// Milliseconds it ran (none while running).
    pub duration_ms: Option<i64>,
    /// Its layer digest.
    pub layer: Option<String>,
    /// What ran its command: `vm` (a microVM of its own) or `namespace` (this host's
    /// namespace executor, a server started with `--trust-tenants`). None for a step found
    /// in the build cache and for one that runs no command (`COPY`, `ADD`, `WORKDIR`, the
    /// generated sandbox layer: kiln applies them itself).
    pub executor: Option<String>,
    /// Why it missed the build cache, against the nearest earlier build of the step in this
    /// workspace: one object per reason, `{"reason": "context_files", "files":
    /// ["src/app.py"], "more": 0}` (reasons: `no_earlier_build`, `no_cache`,
    /// `no_cache_filter`, `base`, `earlier_step`, `instruction`, `build_args`, `env`,
    /// `context_files`, `sources`, `mounts`, `network`, `user`, `workdir`, `entry_gone`).
    /// Empty for a hit.
    #[schema(value_type = Vec<Object>)]
    pub why: Vec<kiln_pipeline::event::MissReason>,
    /// The same as one short phrase (`context file src/app.py changed`); none for a hit.
    pub why_text: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FailureView {
    /// The error.
    pub reason: String,
    /// The failing step's `file:line`.
    pub location: Option<String>,
    /// Its last log lines.
    pub last_lines: Vec<String>,
}

/// A build's state.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BuildView {
    /// The id.
    pub id: String,
    /// `queued`, `running`, `succeeded`, `failed`, `cancelled`.
    pub state: String,
    /// RFC 3339 times.
    pub created_at: String,
    /// When a worker claimed it.
    pub started_at: Option<String>,
    /// When it ended.
    pub finished_at: Option<String>,
    /// The recipe's name.
    pub recipe: String,
    /// The tags it moves (when it succeeds), `name:tag`.
    pub tags: Vec<String>,
    /// The limits it runs with.
    pub limits: EffectiveLimits,
    /// Steps, in order.
    pub steps: Vec<StepView>,
    /// The image manifest its tags name.
    pub image: Option<String>,
    /// The snapshot manifest.
    pub snapshot: Option<String>,
    /// The OCI image manifest.
    pub oci_manifest: Option<String>,
    /// Why it failed (or was cancelled).
    pub failure: Option<FailureView>,
    /// Its URLs.
    pub urls: BuildUrls,
}

/// RFC 3339 (UTC, milliseconds) of a Unix-ms time.
pub fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The tenants' router: `/v1`, `/openapi.json`, `/healthz`, `/readyz`. Anything else,
/// `/metrics` included, is 404.
pub fn router(state: AppState) -> axum::Router {
    let limit =
        state.config.max_context_bytes as usize + MAX_JSON_BYTES + MAX_RECIPE_BYTES as usize;
    // Every `/v1` route: the key's check and the workspace's share of requests in flight.
    let v1 = axum::Router::new()
        // Only a submission's multipart body is buffered past axum's 2 MB default (its
        // context part streams to disk; blob uploads stream without an extractor limit).
        .route(
            "/v1/builds",
            post(submit).layer(axum::extract::DefaultBodyLimit::max(limit)),
        )
        .route("/v1/builds/{id}", get(get_build))
        .route("/v1/builds/{id}/logs", get(logs))
        .route("/v1/builds/{id}/cancel", post(cancel))
        .route(
            "/v1/blobs/{digest}",
            put(store::put_blob).head(store::head_blob),
        )
        .route("/v1/images", get(store::list_images))
        .route("/v1/images/{name}/tags", get(store::list_tags))
        .route(
            "/v1/images/{name}/tags/{tag}",
            get(store::get_tag)
                .put(store::put_tag)
                .delete(store::delete_tag),
        )
        .route("/v1/manifests/{digest}", get(store::get_manifest))
        .route("/v1/follows", get(list_follows))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::share::per_workspace,
        ));
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(openapi))
        .merge(v1)
        .with_state(state)
}

/// The operator's router (`kiln serve --metrics-listen`): `GET /metrics`, Prometheus text
/// of every workspace's activity (builds by state, queue depth, build durations, bytes
/// uploaded), and `/healthz`. No key: the listener is the operator's, not the tenants'.
pub fn operator_router(state: AppState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(state)
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "alive")))]
async fn healthz() -> &'static str {
    "ok\n"
}

/// Readiness: the database answers and the server is not stopping.
#[utoipa::path(get, path = "/readyz", responses((status = 200, description = "ready"),
    (status = 503, description = "not ready")))]
async fn readyz(State(s): State<AppState>) -> Response {
    if !s.stopping.is_cancelled() && s.db.ping().await {
        "ready\n".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

/// Prometheus text metrics (the operator's listener only).
async fn metrics(State(s): State<AppState>) -> Result<Response, ApiError> {
    let by_state = s.db.count_by_state().await?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(&by_state),
    )
        .into_response())
}

fn parse_spec(bytes: &[u8]) -> Result<BuildSpec, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::BadRequest(format!("build spec: {e}")))
}

/// What a submission's body gave.
struct Submission {
    spec: BuildSpec,
    recipe: Option<Vec<u8>>,
    /// A context received with the submission.
    context: Option<String>,
}

async fn read_submission(s: &AppState, ws: &str, req: Request) -> Result<Submission, ApiError> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let limit = s.config.max_context_bytes;
    if ct.starts_with("multipart/form-data") {
        let mut mp = Multipart::from_request(req, s)
            .await
            .map_err(|e| ApiError::BadRequest(e.body_text()))?;
        let (mut spec, mut recipe, mut context) = (None, None, None);
        while let Some(field) = mp
            .next_field()
            .await
            .map_err(|e| ApiError::BadRequest(e.body_text()))?
        {
            let name = field.name().unwrap_or("").to_string();
            match name.as_str() {
                "build" if spec.is_none() => {
                    let b = read_field(field, MAX_JSON_BYTES as u64, "build").await?;
                    spec = Some(parse_spec(&b)?);
                }
                "recipe" if recipe.is_none() => {
                    recipe = Some(read_field(field, MAX_RECIPE_BYTES, "recipe").await?);
                }
                "context" if context.is_none() => {
                    let stream = field.map(|r| r.map_err(|e| e.body_text()));
                    let (d, n) = s.blobs.put(stream, None, limit).await?;
                    s.db.add_blob(ws, &d, n).await?;
                    s.metrics.uploaded(n);
                    context = Some(d);
                }
                other => {
                    return Err(ApiError::BadRequest(format!(
                        "multipart part {other:?}: expected one each of build, recipe, context"
                    )));
                }
            }
        }
        return Ok(Submission {
            spec: spec.unwrap_or_default(),
            recipe,
            context,
        });
    }
    if ct.starts_with("application/json") {
        let b = axum::body::to_bytes(req.into_body(), MAX_JSON_BYTES)
            .await
            .map_err(|e| ApiError::BadRequest(format!("reading the body: {e}")))?;
        return Ok(Submission {
            spec: parse_spec(&b)?,
            recipe: None,
            context: None,
        });
    }
    if ct.starts_with("application/x-tar") || ct.starts_with("application/gzip") {
        let spec = match req.headers().get("kiln-build") {
            Some(v) => parse_spec(v.as_bytes())?,
            None => BuildSpec::default(),
        };
        let stream = req.into_body().into_data_stream();
        let (d, n) = s.blobs.put(stream, None, limit).await?;
        s.db.add_blob(ws, &d, n).await?;
        s.metrics.uploaded(n);
        return Ok(Submission {
            spec,
            recipe: None,
            context: Some(d),
        });
    }
    Err(ApiError::BadRequest(format!(
        "Content-Type {ct:?}: expected multipart/form-data, application/json or application/x-tar"
    )))
}

async fn read_field(
    mut f: axum::extract::multipart::Field<'_>,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, ApiError> {
    let mut out = Vec::new();
    while let Some(c) = f
        .chunk()
        .await
        .map_err(|e| ApiError::BadRequest(e.body_text()))?
    {
        out.extend_from_slice(&c);
        if out.len() as u64 > limit {
            return Err(ApiError::TooLarge(format!(
                "the {what} part is larger than {limit} bytes"
            )));
        }
    }
    Ok(out)
}

/// Submit a build: multipart (`build` JSON, `context` tarball, optional `recipe`), a JSON
/// body naming an uploaded `context`, or a tar body with the JSON in `Kiln-Build`.
#[utoipa::path(post, path = "/v1/builds", request_body = BuildSpec,
    params(("Idempotency-Key" = Option<String>, Header, description = "retry key, 24 h")),
    responses((status = 202, body = Accepted), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 413, body = ErrorBody),
              (status = 422, body = ErrorBody), (status = 429, body = ErrorBody),
              (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
async fn submit(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    req: Request,
) -> Result<Response, ApiError> {
    if s.stopping.is_cancelled() {
        return Err(ApiError::Unavailable);
    }
    let idem = match req.headers().get("idempotency-key") {
        None => None,
        Some(v) => {
            let k = v
                .to_str()
                .ok()
                .filter(|k| !k.is_empty() && k.len() <= 255)
                .ok_or_else(|| {
                    ApiError::BadRequest(
                        "Idempotency-Key: expected 1 to 255 visible ASCII characters".into(),
                    )
                })?;
            Some(k.to_string())
        }
    };
    let sub = read_submission(&s, &ws, req).await?;
    let spec = sub.spec;
    let quota = s.db.quota(&ws).await?.ok_or(ApiError::Internal)?;
    let context = match (sub.context, &spec.context) {
        (Some(_), Some(_)) => {
            return Err(ApiError::BadRequest(
                "give the context either as a part or as an uploaded blob, not both".into(),
            ));
        }
        (Some(d), None) => Some(d),
        (None, Some(d)) => {
            context::parse_digest(d)?;
            // Uploaded to this node, or (a remote store) to any node.
            let here = s.db.blob(&ws, d).await?.is_some()
                && (s.blobs.exists(d)
                    || (s.contexts_in_store() && s.blobs.fetch(&s.setup.store, d).await?));
            if !here {
                return Err(ApiError::BadRequest(format!(
                    "context {d}: no such blob in this workspace (upload it with PUT /v1/blobs/{d})"
                )));
            }
            Some(d.clone())
        }
        (None, None) => None,
    };
    let recipe_name = spec.recipe.clone().unwrap_or_else(|| "Dockerfile".into());
    let member = context::check_member_path(&recipe_name).map_err(ApiError::BadRequest)?;
    let (recipe, in_context) = match (sub.recipe, &context) {
        (Some(r), _) => (r, false),
        (None, Some(d)) => {
            let path = s.blobs.path(d)?;
            let (m, max) = (member.clone(), s.config.max_unpacked_bytes);
            let r = tokio::task::spawn_blocking(move || {
                context::read_member(&path, &m, MAX_RECIPE_BYTES, max)
            })
            .await
            .map_err(|_| ApiError::Internal)??;
            match r {
                Some(r) => (r, true),
                None => {
                    return Err(ApiError::BadRequest(format!(
                        "recipe {recipe_name:?} is not a file in the context"
                    )));
                }
            }
        }
        (None, None) => {
            return Err(ApiError::BadRequest(
                "no recipe: send a recipe part or a context holding it".into(),
            ));
        }
    };
    let mut store_tags = Vec::new();
    for t in &spec.tags {
        let (n, tag) = t
            .split_once(':')
            .ok_or_else(|| ApiError::BadRequest(format!("tag {t:?}: expected name:tag")))?;
        tags::check_not_global(n, &s.config.global_bases).map_err(ApiError::BadRequest)?;
        store_tags.push(
            tags::to_store(&ws, n, tag)
                .map_err(ApiError::BadRequest)?
                .to_string(),
        );
    }
    if spec.snapshot && s.setup.boot.is_none() {
        return Err(ApiError::BadRequest(
            "snapshot: this server has no guest kernel and initramfs (start it with --kernel and --initramfs)".into(),
        ));
    }
    let limits = EffectiveLimits {
        timeout_secs: spec
            .limits
            .timeout_secs
            .unwrap_or(quota.max_timeout_secs)
            .clamp(1, quota.max_timeout_secs),
        memory_mib: spec
            .limits
            .memory_mib
            .unwrap_or(quota.max_memory_mib)
            .clamp(16, quota.max_memory_mib.max(16)),
        vcpus: spec
            .limits
            .vcpus
            .unwrap_or(1)
            .clamp(1, quota.max_vcpus.max(1)),
        disk_mib: spec
            .limits
            .disk_mib
            .map(|d| d.clamp(MIN_DISK_MIB, MAX_DISK_MIB)),
    };
    let ca_certs = match &spec.ca_certs {
        None => None,
        Some(text) => {
            let c = kiln_pipeline::CaCerts::parse("build spec: ca_certs", text.as_bytes())
                .map_err(|e| ApiError::BadRequest(e.to_string()))?;
            // With the server's own, as the build will join them.
            if let Some(own) = &s.setup.ca_certs {
                own.join(&c).map_err(|_| {
                    ApiError::BadRequest(format!(
                        "build spec: ca_certs: {} certificates with this server's {} are more \
                         than {}",
                        c.len(),
                        own.len(),
                        kiln_pipeline::MAX_CA_CERTS
                    ))
                })?;
            }
            Some(c)
        }
    };
    if spec.network == NetworkSpec::Mode(NetworkMode::Host)
        && s.config.executor == kiln_pipeline::Executor::Vm
    {
        return Err(ApiError::BadRequest(
            "build spec: network \"host\" is not available: build steps run in microVMs, \
             which cannot reach the host's network (use \"sandboxed\" or \"none\")"
                .into(),
        ));
    }

    let registry_auth = if spec.registry_auth.is_empty() {
        None
    } else {
        if s.config.credentials_key.is_none() {
            return Err(ApiError::BadRequest(
                "registry_auth: this server takes no registry credentials (its operator \
                 starts it without --credentials-key-file)"
                    .into(),
            ));
        }
        Some(crate::sealed::check(&spec.registry_auth).map_err(ApiError::BadRequest)?)
    };

    let stored = StoredSpec {
        recipe: recipe_name,
        recipe_in_context: in_context,
        recipe_digest: kiln_store::digest::Sha256Hash::of(&recipe).to_string(),
        context,
        tags: spec.tags.clone(),
        store_tags,
        build_args: spec.build_args.clone(),
        target: spec.target.clone(),
        platform: spec.platform.clone(),
        snapshot: spec.snapshot,
        network: spec.network.clone(),
        limits,
        no_cache: spec.no_cache,
        registry_auth: registry_auth
            .as_ref()
            .map(|a| a.keys().cloned().collect())
            .unwrap_or_default(),
        ca_certs: ca_certs.map(|c| c.pem().to_string()),
        follow: None,
        rebuild: None,
    };
    // The recipe error `kiln plan` would print, before anything is queued, checked on the
    // request the worker will run (the same mapping, without the context).
    let check = stored
        .request(
            recipe.clone(),
            kiln_pipeline::ContextSource::None,
            &ws,
            s.config.step_pids_max,
        )
        .map_err(ApiError::BadRequest)?;
    let plan =
        kiln_pipeline::check_recipe(&check).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let mut stored = stored;
    if spec.follow_base {
        if stored.store_tags.is_empty() {
            return Err(ApiError::BadRequest(
                "follow_base: the build has no tags, so a rebuild would have nothing to move"
                    .into(),
            ));
        }
        let base = crate::follow::followed_base(&ws, plan.image_base(), &s.config.global_bases)
            .map_err(ApiError::BadRequest)?;
        // A tag of the global base's name that the store lacks is no base of the
        // operator's: the build would pull it from a registry, whose bases cannot be
        // followed.
        let tag: kiln_store::TagRef = base.parse().map_err(|_| ApiError::Internal)?;
        if s.setup.store.get_tag(&tag).await?.is_none() {
            return Err(ApiError::BadRequest(format!(
                "follow_base: the global base {base} is no tag of this server (a build FROM it \
                 would pull it from a registry, and registry bases cannot be followed)"
            )));
        }
        stored.follow = Some(base);
    }
    let spec_json = serde_json::to_string(&stored).map_err(|_| ApiError::Internal)?;
    let hash = kiln_store::digest::Sha256Hash::of(spec_json.as_bytes()).hex();
    let id = crate::db::new_build_id().map_err(|e| {
        tracing::error!(error = %e, "random source");
        ApiError::Internal
    })?;
    let credentials = match (&registry_auth, &s.config.credentials_key) {
        (Some(a), Some(key)) => Some(key.seal(&id, a).map_err(|e| {
            tracing::error!(error = %e, "sealing registry credentials");
            ApiError::Internal
        })?),
        _ => None,
    };
    let new = NewBuild {
        id: id.clone(),
        workspace: ws.clone(),
        spec: spec_json,
        recipe,
        context: stored.context.clone(),
        idempotency: idem.map(|k| (k, hash)),
        credentials,
    };
    // A remote store: the context goes there under the build's lease, so that any node can
    // run the build (see `context`). The lease's row first: whatever happens next, the sweep
    // deletes the lease (at once once the build ended; one renewal interval later when it
    // was never queued: over quota, a replay, a failure here).
    if let (Some(d), true) = (&stored.context, s.contexts_in_store()) {
        s.db.add_context_lease(&id, d).await?;
        s.setup
            .store
            .put_shared_lease(
                &context::lease_id(&id),
                s.config.context_lease,
                [context::store_object(d)?],
            )
            .await?;
        s.blobs.upload(&s.setup.store, d).await?;
    }
    let window = s.config.idempotency_window.as_millis() as i64;
    let (id, replayed) = match s.db.insert_build(&new, quota.max_queued, window).await? {
        Inserted::Queued => (id, false),
        Inserted::Existing(old) => (old, true),
        Inserted::KeyReused => {
            return Err(ApiError::Unprocessable(
                "Idempotency-Key was used with a different request in the last 24 h".into(),
            ));
        }
        Inserted::OverQuota => {
            s.metrics
                .throttled
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(ApiError::TooManyRequests(
                "the workspace has too many queued builds; retry later".into(),
            ));
        }
    };
    if !replayed {
        // The tenant's build of a following tag goes first: a rebuild queued or running for
        // it gives way ([`crate::db::Room::TagBusy`]).
        if !stored.store_tags.is_empty()
            && let Err(e) = s.db.preempt_rebuilds(&ws, &stored.store_tags).await
        {
            tracing::warn!(build = %id, error = %e, "stopping the rebuilds of the build's tags");
        }
        s.queued.notify_one();
    }
    let urls = BuildUrls::new(&id);
    let location = urls.this.clone();
    let mut r = (StatusCode::ACCEPTED, Json(Accepted { id, urls })).into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    if replayed {
        r.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(r)
}

async fn view(s: &AppState, ws: &str, id: &str) -> Result<BuildView, ApiError> {
    let row =
        s.db.build(ws, id)
            .await?
            .ok_or(ApiError::NotFound("build"))?;
    let spec: StoredSpec = serde_json::from_str(&row.spec).map_err(|_| ApiError::Internal)?;
    let result: Option<crate::spec::BuildResult> = row
        .result
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok());
    let failure: Option<crate::spec::Failure> = row
        .failure
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok());
    let steps =
        s.db.steps(id)
            .await?
            .into_iter()
            .map(|st| StepView {
                duration_ms: st.finished_ms.map(|f| f - st.started_ms),
                step: st.step,
                stage: st.stage,
                location: st.location,
                instruction: st.instruction,
                cached: st.cached,
                layer: st.layer,
                executor: st.executor,
                why_text: kiln_pipeline::event::why_text(&st.why),
                why: st.why,
            })
            .collect();
    Ok(BuildView {
        id: row.id.clone(),
        state: row.state,
        created_at: rfc3339(row.created_ms),
        started_at: row.started_ms.map(rfc3339),
        finished_at: row.finished_ms.map(rfc3339),
        recipe: spec.recipe,
        tags: spec.tags,
        limits: spec.limits,
        steps,
        image: result.as_ref().and_then(|r| r.image.clone()),
        snapshot: result.as_ref().and_then(|r| r.snapshot.clone()),
        oci_manifest: result.as_ref().map(|r| r.oci_manifest.clone()),
        failure: failure.map(|f| FailureView {
            reason: f.reason,
            location: f.location,
            last_lines: f.last_lines,
        }),
        urls: BuildUrls::new(&row.id),
    })
}

/// A build's state, steps, digests and failure.
#[utoipa::path(get, path = "/v1/builds/{id}", params(("id" = String, Path)),
    responses((status = 200, body = BuildView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
async fn get_build(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(id): Path<String>,
) -> Result<Json<BuildView>, ApiError> {
    Ok(Json(view(&s, &ws, &id).await?))
}

/// The workspace's tags that follow a global base (`follow_base`), by tag, each with its
/// last rebuild. When the base's tag moves, each following image is built again (at most
/// the server's budget of rebuilds per move, oldest first; the rest are `skipped` until the
/// next move). A rebuilt image must boot and pass its ready check again when the original
/// took a snapshot, pass `e2fsck`, and keep the original's config (user, env, working
/// directory, entrypoint, command) except where the base's own config changed; only then
/// does the tag move, and only from the image the rebuild started from.
#[utoipa::path(get, path = "/v1/follows",
    responses((status = 200, body = Vec<crate::follow::FollowView>)),
    security(("bearer" = [])))]
async fn list_follows(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
) -> Result<Json<Vec<crate::follow::FollowView>>, ApiError> {
    let rows = s.db.follows(&ws).await?;
    Ok(Json(rows.iter().map(crate::follow::view).collect()))
}

/// Query of `GET /v1/builds/{id}/logs`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// Lines after this sequence number (default 0: from the first).
    pub after: Option<i64>,
    /// Stream until the build ends, then send a final frame.
    pub follow: Option<bool>,
}

fn is_terminal(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled")
}

fn log_frame(l: &crate::db::LogLine) -> bytes::Bytes {
    let mut v = serde_json::to_vec(&serde_json::json!({
        "seq": l.seq,
        "time": rfc3339(l.time_ms),
        "step": l.step,
        "text": l.text,
    }))
    .unwrap_or_default();
    v.push(b'\n');
    v.into()
}

/// A build's log, NDJSON: `{"seq", "time", "step", "text"}` per line; with `follow`, a
/// final `{"end": true, "state": ...}` once the build has ended.
#[utoipa::path(get, path = "/v1/builds/{id}/logs", params(("id" = String, Path), LogQuery),
    responses((status = 200, description = "NDJSON lines", content_type = "application/x-ndjson"),
              (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
async fn logs(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Result<Response, ApiError> {
    s.db.build(&ws, &id)
        .await?
        .ok_or(ApiError::NotFound("build"))?;
    let after = q.after.unwrap_or(0).max(0);
    let ndjson = [(header::CONTENT_TYPE, "application/x-ndjson")];
    if !q.follow.unwrap_or(false) {
        let mut out = Vec::new();
        let mut last = after;
        loop {
            let lines = s.db.logs(&id, last, 1000).await?;
            if lines.is_empty() {
                break;
            }
            for l in &lines {
                out.extend_from_slice(&log_frame(l));
                last = l.seq;
            }
        }
        return Ok((ndjson, out).into_response());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(64);
    let db = s.db.clone();
    tokio::spawn(async move {
        let mut last = after;
        loop {
            // The state first: a build ends only after its last line is stored, so lines
            // read after seeing the end are all of them.
            let state = match db.state(&id).await {
                Ok(Some(st)) => st,
                _ => return,
            };
            let mut got = false;
            loop {
                let Ok(lines) = db.logs(&id, last, 1000).await else {
                    return;
                };
                if lines.is_empty() {
                    break;
                }
                got = true;
                for l in &lines {
                    if tx.send(Ok(log_frame(l))).await.is_err() {
                        return;
                    }
                    last = l.seq;
                }
            }
            if is_terminal(&state) {
                let mut v = serde_json::to_vec(&serde_json::json!({
                    "end": true, "state": state, "last_seq": last,
                }))
                .unwrap_or_default();
                v.push(b'\n');
                let _ = tx.send(Ok(v.into())).await;
                return;
            }
            if !got {
                // Wait for more lines; a client that went away ends the stream now.
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                    _ = tx.closed() => return,
                }
            }
        }
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Ok((ndjson, Body::from_stream(stream)).into_response())
}

/// Cancel a build: a queued one at once; a running one stops, publishes nothing and moves
/// no tag. 409 when it has already ended.
#[utoipa::path(post, path = "/v1/builds/{id}/cancel", params(("id" = String, Path)),
    responses((status = 202, body = BuildView), (status = 401, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("bearer" = [])))]
async fn cancel(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let prev =
        s.db.request_cancel(&ws, &id)
            .await?
            .ok_or(ApiError::NotFound("build"))?;
    if is_terminal(&prev) {
        return Err(ApiError::Conflict(format!(
            "the build has already ended ({prev})"
        )));
    }
    if let Some(t) = s.running.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
        t.cancel();
    }
    Ok((StatusCode::ACCEPTED, Json(view(&s, &ws, &id).await?)).into_response())
}
#[cfg(test)]
mod tests {
    use super::*;

    fn spec(network: serde_json::Value) -> Result<BuildSpec, serde_json::Error> {
        serde_json::from_value(serde_json::json!({ "network": network }))
    }

    /// The build options' network: the modes (with `default` for `sandboxed`), an
    /// allow-list checked entry by entry, unknown keys refused; the default mode stays out
    /// of the stored spec, so stored hashes of earlier submissions do not change.
    #[test]
    fn network_modes_and_allow_lists_in_build_options() {
        use kiln_pipeline::NetworkPolicy as P;
        for (v, want) in [
            (serde_json::json!("sandboxed"), P::Sandboxed),
            (serde_json::json!("default"), P::Sandboxed),
            (serde_json::json!("host"), P::AllowHost),
            (serde_json::json!("none"), P::None),
        ] {
            assert_eq!(
                spec(v.clone()).unwrap().network.policy().unwrap(),
                want,
                "{v}"
            );
        }
        let s = spec(serde_json::json!({"allow": ["pkg.example", "*.cdn.example", "192.0.2.0/24"], "deny": ["bad.cdn.example"]}))
            .unwrap();
        let P::Allow(e) = s.network.policy().unwrap() else {
            panic!("{:?}", s.network)
        };
        assert_eq!(e.allow.len(), 3);
        assert_eq!(e.deny[0].to_string(), "bad.cdn.example");
        let bad = spec(serde_json::json!({"allow": ["10.0.0.1/8"]})).unwrap();
        let err = bad.network.policy().unwrap_err();
        assert!(err.starts_with("allow entry '10.0.0.1/8'"), "{err}");
        assert!(spec(serde_json::json!({"allow": [], "bogus": 1})).is_err());
        assert!(spec(serde_json::json!("bridge")).is_err());
        let stored = |network: NetworkSpec| StoredSpec {
            recipe: "Dockerfile".into(),
            recipe_in_context: true,
            recipe_digest: String::new(),
            context: None,
            tags: vec![],
            store_tags: vec![],
            build_args: BTreeMap::new(),
            target: None,
            platform: None,
            snapshot: false,
            network,
            limits: EffectiveLimits {
                timeout_secs: 1,
                memory_mib: 1,
                vcpus: 1,
                disk_mib: None,
            },
            no_cache: false,
            registry_auth: vec![],
            ca_certs: None,
            follow: None,
            rebuild: None,
        };
        let plain = serde_json::to_string(&stored(NetworkSpec::default())).unwrap();
        assert!(!plain.contains("\"network\""), "{plain}");
        // Nor do specs stored before follows.
        assert!(
            !plain.contains("follow") && !plain.contains("rebuild"),
            "{plain}"
        );
        // Specs stored before registry credentials and CA certificates existed hash as
        // they did.
        assert!(!plain.contains("registry_auth"), "{plain}");
        assert!(!plain.contains("ca_certs"), "{plain}");
        let listed = serde_json::to_string(&stored(s.network.clone())).unwrap();
        let back: StoredSpec = serde_json::from_str(&listed).unwrap();
        assert_eq!(back.network, s.network);
        let old: StoredSpec = serde_json::from_str(&plain).unwrap();
        assert!(old.network.is_sandboxed());
        // The row keeps the form it had: `network_host` always, `network` when not the
        // default; a row from before `network` with `network_host: true` is `host`.
        assert!(plain.contains("\"network_host\":false"), "{plain}");
        let host = serde_json::to_string(&stored(NetworkSpec::Mode(NetworkMode::Host))).unwrap();
        assert!(
            host.contains("\"network_host\":true,\"network\":\"host\""),
            "{host}"
        );
        let legacy = plain.replace("\"network_host\":false", "\"network_host\":true");
        let legacy: StoredSpec = serde_json::from_str(&legacy).unwrap();
        assert_eq!(legacy.network, NetworkSpec::Mode(NetworkMode::Host));
        assert_eq!(serde_json::to_string(&legacy).unwrap(), host);
    }

    /// The OpenAPI document lists the listener's 429 on every `/v1` operation and its 408 on
    /// those with a body, and neither on the probes.
    #[test]
    fn the_document_lists_the_listeners_answers() {
        let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
        let codes = |path: &str, method: &str| -> Vec<String> {
            doc["paths"][path][method]["responses"]
                .as_object()
                .unwrap_or_else(|| panic!("{method} {path}"))
                .keys()
                .cloned()
                .collect()
        };
        for (path, method) in [("/v1/builds", "post"), ("/v1/blobs/{digest}", "put")] {
            let c = codes(path, method);
            assert!(
                c.contains(&"408".into()) && c.contains(&"429".into()),
                "{c:?}"
            );
        }
        let c = codes("/v1/builds/{id}", "get");
        assert!(
            c.contains(&"429".into()) && !c.contains(&"408".into()),
            "{c:?}"
        );
        let c = codes("/healthz", "get");
        assert!(!c.contains(&"429".into()), "{c:?}");
    }
}
