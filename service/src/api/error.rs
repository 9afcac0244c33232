//! The API's error answers: [`ApiError`] and its JSON body.

use super::*;

/// An error answer.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No key, or an unknown or revoked one.
    #[error("a valid API key is required (Authorization: Bearer <key>)")]
    Unauthorized,
    /// No such object in this workspace (or in another one: the same answer).
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The request is malformed; the text says where.
    #[error("{0}")]
    BadRequest(String),
    /// The `Idempotency-Key` was used with another request.
    #[error("{0}")]
    Unprocessable(String),
    /// The object is not in a state that allows it.
    #[error("{0}")]
    Conflict(String),
    /// A compare-and-swap lost: the tag holds another digest.
    #[error("{0}")]
    PreconditionFailed(String),
    /// `PUT` of a tag without `If-Match` or `If-None-Match`.
    #[error("{0}")]
    PreconditionRequired(String),
    /// The workspace's queue is full, or its share of requests in flight is in use; the text
    /// says which.
    #[error("{0}")]
    TooManyRequests(String),
    /// The request body arrived too slowly ([`crate::listen::bound_bodies`]); the text names
    /// the bound.
    #[error("{0}")]
    RequestTimeout(String),
    /// A body past its limit.
    #[error("{0}")]
    TooLarge(String),
    /// The server is stopping.
    #[error("the server is shutting down")]
    Unavailable,
    /// Something failed on our side (logged; the text is generic).
    #[error("internal error")]
    Internal,
}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        tracing::error!(error = %e, "database");
        ApiError::Internal
    }
}

impl From<kiln_store::StoreError> for ApiError {
    fn from(e: kiln_store::StoreError) -> Self {
        tracing::error!(error = %e, "store");
        ApiError::Internal
    }
}

impl From<ContextError> for ApiError {
    fn from(e: ContextError) -> Self {
        match e {
            ContextError::Io { .. } | ContextError::Store { .. } => {
                tracing::error!(error = %e, "blob storage");
                ApiError::Internal
            }
            ContextError::TooLarge { .. } => ApiError::TooLarge(e.to_string()),
            e => ApiError::BadRequest(e.to_string()),
        }
    }
}

/// An error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// `unauthorized`, `not_found`, `bad_request`, `unprocessable`, `conflict`,
    /// `precondition_failed`, `precondition_required`, `request_timeout`,
    /// `too_many_requests`, `too_large`, `unavailable`, `internal`.
    pub error: String,
    /// What went wrong.
    pub message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match &self {
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::Unprocessable(_) => (StatusCode::UNPROCESSABLE_ENTITY, "unprocessable"),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ApiError::PreconditionFailed(_) => {
                (StatusCode::PRECONDITION_FAILED, "precondition_failed")
            }
            ApiError::PreconditionRequired(_) => {
                (StatusCode::PRECONDITION_REQUIRED, "precondition_required")
            }
            ApiError::TooManyRequests(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_requests"),
            ApiError::RequestTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            ApiError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            ApiError::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        let body = ErrorBody {
            error: code.into(),
            message: self.to_string(),
        };
        let mut r = (status, Json(body)).into_response();
        match self {
            ApiError::Unauthorized => {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ApiError::TooManyRequests(_) => {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            }
            _ => {}
        }
        r
    }
}
