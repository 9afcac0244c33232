//! The store's routes: blobs, images, tags and manifests of the key's workspace.

use super::*;

/// An uploaded blob.
#[derive(Debug, Serialize, ToSchema)]
pub struct BlobView {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Bytes.
    pub size: u64,
}

/// Upload a context tarball by its digest; the body's sha256 must match.
#[utoipa::path(put, path = "/v1/blobs/{digest}", params(("digest" = String, Path)),
    request_body(content_type = "application/octet-stream", description = "the tarball (plain or gzip)"),
    responses((status = 201, body = BlobView), (status = 400, body = ErrorBody),
              (status = 401, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub(super) async fn put_blob(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(digest): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    context::parse_digest(&digest)?;
    let (d, n) = s
        .blobs
        .put(
            body.into_data_stream(),
            Some(&digest),
            s.config.max_context_bytes,
        )
        .await?;
    s.db.add_blob(&ws, &d, n).await?;
    // A remote store: there too, for a submission to another node (named by no build yet, it
    // is kept by GC's grace period; a build that names it leases it).
    if s.contexts_in_store() {
        s.blobs.upload(&s.setup.store, &d).await?;
    }
    s.metrics.uploaded(n);
    Ok((StatusCode::CREATED, Json(BlobView { digest: d, size: n })).into_response())
}

/// Whether this workspace has uploaded the blob (another workspace's blob: 404), to this
/// node or, with a remote store, to any node.
#[utoipa::path(head, path = "/v1/blobs/{digest}", params(("digest" = String, Path)),
    responses((status = 200, description = "present"), (status = 404, description = "absent")),
    security(("bearer" = [])))]
pub(super) async fn head_blob(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(digest): Path<String>,
) -> Result<Response, ApiError> {
    if context::parse_digest(&digest).is_err() {
        return Err(ApiError::NotFound("blob"));
    }
    let Some(n) = s.db.blob(&ws, &digest).await? else {
        return Err(ApiError::NotFound("blob"));
    };
    let here = s.blobs.exists(&digest)
        || (s.contexts_in_store() && s.setup.store.has(&context::store_object(&digest)?).await?);
    if !here {
        return Err(ApiError::NotFound("blob"));
    }
    Ok(([(header::CONTENT_LENGTH, n.to_string())], StatusCode::OK).into_response())
}

/// An image name and its tags.
#[derive(Debug, Serialize, ToSchema)]
pub struct ImageView {
    /// The name.
    pub name: String,
    /// Its tags.
    pub tags: Vec<TagView>,
}

/// A tag.
#[derive(Debug, Serialize, ToSchema)]
pub struct TagView {
    /// The image name.
    pub name: String,
    /// The tag.
    pub tag: String,
    /// The manifest it names.
    pub digest: String,
}

pub(super) async fn workspace_tags(s: &AppState, ws: &str) -> Result<Vec<TagView>, ApiError> {
    let mut out = Vec::new();
    for (t, d) in s
        .setup
        .store
        .list_tags_named_from(&tags::store_prefix(ws))
        .await?
    {
        if let Some(n) = tags::from_store(ws, &t.name) {
            out.push(TagView {
                name: n.to_string(),
                tag: t.tag.clone(),
                digest: d.to_string(),
            });
        }
    }
    Ok(out)
}

/// The workspace's images (names with tags).
#[utoipa::path(get, path = "/v1/images", responses((status = 200, body = Vec<ImageView>)),
    security(("bearer" = [])))]
pub(super) async fn list_images(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
) -> Result<Json<Vec<ImageView>>, ApiError> {
    let mut by: BTreeMap<String, Vec<TagView>> = BTreeMap::new();
    for t in workspace_tags(&s, &ws).await? {
        by.entry(t.name.clone()).or_default().push(t);
    }
    Ok(Json(
        by.into_iter()
            .map(|(name, tags)| ImageView { name, tags })
            .collect(),
    ))
}

/// The tags of one image name.
#[utoipa::path(get, path = "/v1/images/{name}/tags", params(("name" = String, Path)),
    responses((status = 200, body = Vec<TagView>), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(super) async fn list_tags(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(name): Path<String>,
) -> Result<Json<Vec<TagView>>, ApiError> {
    let t = tags::to_store(&ws, &name, "x").map_err(|_| ApiError::NotFound("image"))?;
    let list: Vec<TagView> = s
        .setup
        .store
        .list_tags(Some(&t.name))
        .await?
        .into_iter()
        .map(|(t, d)| TagView {
            name: name.clone(),
            tag: t.tag,
            digest: d.to_string(),
        })
        .collect();
    if list.is_empty() {
        return Err(ApiError::NotFound("image"));
    }
    Ok(Json(list))
}

fn store_tag(ws: &str, name: &str, tag: &str) -> Result<kiln_store::TagRef, ApiError> {
    tags::to_store(ws, name, tag).map_err(|_| ApiError::NotFound("tag"))
}

fn etag(d: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{d}\"")).unwrap_or(HeaderValue::from_static("\"\""))
}

/// One tag; its `ETag` is the digest it names.
#[utoipa::path(get, path = "/v1/images/{name}/tags/{tag}",
    params(("name" = String, Path), ("tag" = String, Path)),
    responses((status = 200, body = TagView), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(super) async fn get_tag(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path((name, tag)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let t = store_tag(&ws, &name, &tag)?;
    let rec = s
        .setup
        .store
        .get_tag(&t)
        .await?
        .ok_or(ApiError::NotFound("tag"))?;
    let d = rec.manifest.to_string();
    let mut r = Json(TagView {
        name,
        tag,
        digest: d.clone(),
    })
    .into_response();
    r.headers_mut().insert(header::ETAG, etag(&d));
    Ok(r)
}

/// Body of `PUT /v1/images/{name}/tags/{tag}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TagBody {
    /// The image manifest to point at (one built in this workspace).
    pub digest: String,
}

fn precondition(h: &HeaderMap) -> Result<Option<Option<kiln_store::ManifestDigest>>, ApiError> {
    if let Some(v) = h.get(header::IF_MATCH) {
        let s = v.to_str().unwrap_or("").trim().trim_matches('"');
        let d = s.parse().map_err(|_| {
            ApiError::BadRequest(format!("If-Match {s:?}: expected \"sha256:<hex>\""))
        })?;
        return Ok(Some(Some(d)));
    }
    if let Some(v) = h.get(header::IF_NONE_MATCH) {
        if v.as_bytes() == b"*" {
            return Ok(Some(None));
        }
        return Err(ApiError::BadRequest(
            "If-None-Match: only * is supported".into(),
        ));
    }
    Ok(None)
}

/// Move a tag by compare-and-swap: `If-Match: "<digest it holds>"`, or `If-None-Match: *`
/// to create it.
#[utoipa::path(put, path = "/v1/images/{name}/tags/{tag}",
    params(("name" = String, Path), ("tag" = String, Path),
           ("If-Match" = Option<String>, Header, description = "\"<digest the tag holds>\""),
           ("If-None-Match" = Option<String>, Header, description = "* : the tag must not exist")),
    request_body = TagBody,
    responses((status = 200, body = TagView), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
              (status = 412, body = ErrorBody), (status = 428, body = ErrorBody)),
    security(("bearer" = [])))]
pub(super) async fn put_tag(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path((name, tag)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let b: TagBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::BadRequest(format!("tag body: {e}")))?;
    tags::check_not_global(&name, &s.config.global_bases).map_err(ApiError::BadRequest)?;
    let t = tags::to_store(&ws, &name, &tag).map_err(ApiError::BadRequest)?;
    let expected = precondition(&headers)?.ok_or_else(|| {
        ApiError::PreconditionRequired(
            "moving a tag needs If-Match: \"<digest it holds>\" or If-None-Match: *".into(),
        )
    })?;
    let new: kiln_store::ManifestDigest = b.digest.parse().map_err(|_| {
        ApiError::BadRequest(format!("digest {:?}: expected sha256:<hex>", b.digest))
    })?;
    if !s.db.owns_manifest(&ws, &b.digest).await? {
        return Err(ApiError::NotFound("manifest"));
    }
    // The workspace's storage quota, as a build's tags are checked.
    if let Some(q) = s.db.storage_quota(&ws).await? {
        match kiln_pipeline::check_storage_quota(&s.setup.store, &q, std::slice::from_ref(&t), new)
            .await
        {
            Ok(()) => {}
            Err(e @ kiln_pipeline::PipelineError::StorageQuota { .. }) => {
                return Err(ApiError::Conflict(e.to_string()));
            }
            Err(e) => {
                tracing::error!(error = %e, "checking a storage quota");
                return Err(ApiError::Internal);
            }
        }
    }
    match s.setup.store.set_tag(&t, expected, new).await {
        // The tenant chose the tag's image: it follows no base any more.
        Ok(()) => {
            s.db.delete_follows(&ws, &[t.to_string()]).await?;
        }
        Err(kiln_store::StoreError::Tag(e @ kiln_store::TagError::Stale { .. })) => {
            return Err(ApiError::PreconditionFailed(
                e.to_string().replace(&format!("{ws}."), ""),
            ));
        }
        Err(e) => return Err(e.into()),
    }
    let mut r = Json(TagView {
        name,
        tag,
        digest: b.digest.clone(),
    })
    .into_response();
    r.headers_mut().insert(header::ETAG, etag(&b.digest));
    Ok(r)
}

/// Remove a tag (with `If-Match`, only while it names that digest).
#[utoipa::path(delete, path = "/v1/images/{name}/tags/{tag}",
    params(("name" = String, Path), ("tag" = String, Path),
           ("If-Match" = Option<String>, Header, description = "\"<digest the tag holds>\"")),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 412, body = ErrorBody)),
    security(("bearer" = [])))]
pub(super) async fn delete_tag(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path((name, tag)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let t = store_tag(&ws, &name, &tag)?;
    let expected = match precondition(&headers)? {
        Some(Some(d)) => Some(d),
        Some(None) => return Err(ApiError::BadRequest("If-None-Match: not for DELETE".into())),
        None => None,
    };
    match s.setup.store.untag(&t, expected).await {
        Ok(_) => {
            // Its follow ends with it (and with the last follow of its build, the lease of
            // the build's context).
            s.db.delete_follows(&ws, &[t.to_string()]).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        Err(kiln_store::StoreError::Tag(kiln_store::TagError::NotFound { .. })) => {
            Err(ApiError::NotFound("tag"))
        }
        Err(kiln_store::StoreError::Tag(kiln_store::TagError::Stale { .. })) => Err(
            ApiError::PreconditionFailed("the tag names another digest".into()),
        ),
        Err(e) => Err(e.into()),
    }
}

/// The summary of an image or snapshot manifest built in this workspace.
#[utoipa::path(get, path = "/v1/manifests/{digest}", params(("digest" = String, Path)),
    responses((status = 200, description = "summary"), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(super) async fn get_manifest(
    State(s): State<AppState>,
    Workspace(ws): Workspace,
    Path(digest): Path<String>,
) -> Result<Response, ApiError> {
    let d: kiln_store::ManifestDigest =
        digest.parse().map_err(|_| ApiError::NotFound("manifest"))?;
    if !s.db.owns_manifest(&ws, &digest).await? {
        return Err(ApiError::NotFound("manifest"));
    }
    let m = s.setup.store.get_manifest(&d).await?;
    let v = match m {
        kiln_store::manifest::Manifest::Image(i) => serde_json::json!({
            "digest": digest,
            "kind": "image",
            "disk_bytes": i.disk.size,
            "oci_manifest": i.oci_manifest.map(|b| b.digest.to_string()),
            "recipe_digest": i.recipe_digest,
            "snapshot": i.snapshot.map(|d| d.to_string()),
            "start": i.sandbox.as_ref().map(|s| serde_json::to_value(s).unwrap_or_default()),
        }),
        kiln_store::manifest::Manifest::Snapshot(sn) => serde_json::json!({
            "digest": digest,
            "kind": "snapshot",
            "memory_bytes": sn.memory.size,
            "disk_bytes": sn.disk.size,
        }),
    };
    Ok(Json(v).into_response())
}
