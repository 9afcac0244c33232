//! API keys and the `Authorization: Bearer <key>` check.
//!
//! A key is `kiln_` and 64 hex digits (32 random bytes from the OS); its id is the first 12
//! hex digits of its sha256, and only the full sha256 (hex) is stored. A request without a
//! key, or with a key that is unknown or revoked, gets 401 with `WWW-Authenticate: Bearer`
//! (RFC 6750, section 3).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use sha2::{Digest as _, Sha256};

use crate::AppState;
use crate::api::ApiError;

/// A new key: what its holder is given once (`secret`) and what names it (`id`, for
/// revoking).
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The key id: the first 12 hex digits of the key's sha256.
    pub id: String,
    /// The key itself (`kiln_<64 hex>`); never stored.
    pub secret: String,
}

/// sha256 of `key`, hex.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Makes a key: 32 bytes from the OS's random source.
pub fn generate() -> Result<NewKey, getrandom::Error> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b)?;
    let secret = format!("kiln_{}", hex::encode(b));
    let id = hash_key(&secret)[..12].to_string();
    Ok(NewKey { id, secret })
}

/// The workspace a request acts for, from its bearer key. On `/v1` routes the key was
/// checked by [`crate::share::per_workspace`], which leaves the workspace in the request's
/// extensions; it is looked up only where it is not there.
#[derive(Debug, Clone)]
pub struct Workspace(pub String);

impl FromRequestParts<AppState> for Workspace {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        if let Some(ws) = parts.extensions.get::<Workspace>() {
            return Ok(ws.clone());
        }
        let key = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(ApiError::Unauthorized)?;
        match state.db.key_workspace(&hash_key(key)).await? {
            Some(ws) => Ok(Workspace(ws)),
            None => Err(ApiError::Unauthorized),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_and_ids_name_their_hash() {
        let a = generate().expect("random");
        let b = generate().expect("random");
        assert_ne!(a.secret, b.secret);
        assert_eq!(a.secret.len(), 5 + 64);
        assert!(hash_key(&a.secret).starts_with(&a.id));
    }
}
