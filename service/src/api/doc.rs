//! The OpenAPI document of the tenants' API.

use super::store::*;
use super::*;

/// The OpenAPI document.
#[derive(OpenApi)]
#[openapi(
    info(title = "kiln", description = "kiln's custom-image build API"),
    paths(
        submit,
        get_build,
        logs,
        cancel,
        put_blob,
        head_blob,
        list_images,
        list_tags,
        get_tag,
        put_tag,
        delete_tag,
        get_manifest,
        list_follows,
        healthz,
        readyz
    ),
    components(schemas(
        BuildSpec,
        LimitsSpec,
        NetworkSpec,
        NetworkMode,
        AllowListSpec,
        Accepted,
        BuildUrls,
        BuildView,
        StepView,
        FailureView,
        EffectiveLimits,
        ErrorBody,
        TagView,
        TagBody,
        ImageView,
        BlobView,
        crate::follow::FollowView,
        crate::follow::Last
    )),
    modifiers(&ListenerBounds)
)]
pub struct ApiDoc;

/// Adds to every `/v1` operation the answers of the tenants' listener's bounds
/// ([`crate::listen`], [`crate::share`]), which come before any handler: 429 past the
/// workspace's share of requests in flight (with `Retry-After`), and, for the operations
/// with a request body (`POST`, `PUT`), 408 for a body slower than the minimum rate or idle
/// past its timeout. Both carry an [`ErrorBody`].
struct ListenerBounds;

impl utoipa::Modify for ListenerBounds {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        let answer = |description: &str| {
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        ContentBuilder::new()
                            .schema(Some(Ref::from_schema_name("ErrorBody")))
                            .build(),
                    )
                    .build(),
            )
        };
        for (path, item) in doc.paths.paths.iter_mut() {
            if !path.starts_with("/v1/") {
                continue;
            }
            let with_body = [&mut item.post, &mut item.put];
            for op in with_body.into_iter().flatten() {
                op.responses.responses.insert(
                    "408".into(),
                    answer("the request body was slower than the minimum rate, or idle too long"),
                );
            }
            let all = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.head,
            ];
            for op in all.into_iter().flatten() {
                op.responses.responses.insert(
                    "429".into(),
                    answer("the workspace has its share of requests in flight (see Retry-After)"),
                );
            }
        }
    }
}

pub(super) async fn openapi() -> impl IntoResponse {
    Json(ApiDoc::openapi())
}
