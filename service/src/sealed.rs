//! Registry credentials a tenant gives for one build (`registry_auth` of a submission),
//! sealed while the build waits in the database: ChaCha20-Poly1305 (RFC 8439, through
//! `ring`) under the operator's key (`kiln serve --credentials-key-file`), a random 96-bit
//! nonce per seal, and the build id as associated data, so a sealed value opens only for
//! the build it was made for. The database holds only sealed bytes, and holds them only
//! until the build ends ([`crate::Db::drop_ended_credentials`]).
//!
//! Sealed form: the 12-byte nonce, then the ciphertext with its 16-byte tag. The opened
//! form is the JSON of [`RegistryAuth`].

use std::collections::BTreeMap;
use std::path::Path;

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use serde::{Deserialize, Serialize};

/// One registry's credentials. `Debug` hides the password.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Login {
    /// User name.
    pub username: String,
    /// Password or token.
    pub password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Login({}, <redacted>)", self.username)
    }
}

/// A build's credentials: registry (`host[:port]`, as its references write it) → login.
pub type RegistryAuth = BTreeMap<String, Login>;

/// Most registries one build gives credentials for.
pub const MAX_REGISTRIES: usize = 16;
/// Longest user name or password, bytes (a registry token fits).
pub const MAX_FIELD_BYTES: usize = 8 << 10;

/// `auth` as a submission gives it, checked and with each registry written as its
/// references write it (`index.docker.io` → `docker.io`). Errors name the registry and what
/// was expected, never a password.
pub fn check(auth: &RegistryAuth) -> Result<RegistryAuth, String> {
    if auth.len() > MAX_REGISTRIES {
        return Err(format!(
            "registry_auth: at most {MAX_REGISTRIES} registries, got {}",
            auth.len()
        ));
    }
    let mut out = RegistryAuth::new();
    for (registry, login) in auth {
        let bad = || {
            format!(
                "registry_auth: {registry:?}: expected a registry host[:port], such as ghcr.io or registry.example:5000"
            )
        };
        if registry.is_empty() || registry.contains(['/', '@', ' ']) || registry.contains("://") {
            return Err(bad());
        }
        // The registry of a reference on it, as the pull compares it.
        let r: kiln_pipeline::Reference = format!("{registry}/x").parse().map_err(|_| bad())?;
        // A name without a `.` or a port (other than `localhost`) is a Docker Hub path.
        if r.registry() != registry && registry != "index.docker.io" {
            return Err(bad());
        }
        // A `:` in the user name would make HTTP Basic's `user:password` ambiguous (RFC
        // 7617 section 2).
        if login.username.contains(':') {
            return Err(format!(
                "registry_auth: {registry}: the username may not hold ':' (HTTP Basic \
                 authentication)"
            ));
        }
        if login.username.is_empty()
            || login.username.len() > MAX_FIELD_BYTES
            || login.password.is_empty()
            || login.password.len() > MAX_FIELD_BYTES
        {
            return Err(format!(
                "registry_auth: {registry}: expected a username and a password of 1 to \
                 {MAX_FIELD_BYTES} bytes each"
            ));
        }
        out.insert(r.registry().to_string(), login.clone());
    }
    Ok(out)
}

/// Why a key or a sealed value is unusable.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The key file cannot be read.
    #[error("credentials key {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The key file does not hold a key.
    #[error(
        "credentials key {0}: expected 64 hex digits (32 random bytes, e.g. from `openssl rand \
         -hex 32`)"
    )]
    Format(String),
    /// The system's random source failed.
    #[error("random source: {0}")]
    Random(String),
    /// A sealed value does not open with this key for this build: another key sealed it, or
    /// it was altered.
    #[error("the build's registry credentials do not open with this server's credentials key")]
    Open,
}

/// The operator's key that seals tenants' registry credentials.
pub struct CredentialsKey(LessSafeKey);

impl std::fmt::Debug for CredentialsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CredentialsKey(<redacted>)")
    }
}

impl CredentialsKey {
    /// The key in `path`: 64 hex digits (surrounding white space ignored). Every node of one
    /// database needs the same key, since any node may run a queued build.
    pub fn load(path: &Path) -> Result<Self, SealError> {
        let text = std::fs::read_to_string(path).map_err(|source| SealError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let bytes = hex::decode(text.trim())
            .ok()
            .filter(|b| b.len() == 32)
            .ok_or_else(|| SealError::Format(path.display().to_string()))?;
        Self::from_bytes(&bytes).ok_or_else(|| SealError::Format(path.display().to_string()))
    }

    /// A key of 32 bytes.
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let k = UnboundKey::new(&CHACHA20_POLY1305, bytes).ok()?;
        Some(CredentialsKey(LessSafeKey::new(k)))
    }

    /// `auth` sealed for build `build_id`.
    pub fn seal(&self, build_id: &str, auth: &RegistryAuth) -> Result<Vec<u8>, SealError> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| SealError::Random(e.to_string()))?;
        let mut data = serde_json::to_vec(auth).map_err(|e| SealError::Random(e.to_string()))?;
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(build_id.as_bytes()),
                &mut data,
            )
            .map_err(|_| SealError::Open)?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&data);
        Ok(out)
    }

    /// What [`CredentialsKey::seal`] sealed for `build_id`. Errors: [`SealError::Open`].
    pub fn open(&self, build_id: &str, sealed: &[u8]) -> Result<RegistryAuth, SealError> {
        if sealed.len() < NONCE_LEN {
            return Err(SealError::Open);
        }
        let (nonce, data) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Open)?;
        let mut data = data.to_vec();
        let plain = self
            .0
            .open_in_place(nonce, Aad::from(build_id.as_bytes()), &mut data)
            .map_err(|_| SealError::Open)?;
        serde_json::from_slice(plain).map_err(|_| SealError::Open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth() -> RegistryAuth {
        [(
            "registry.example:5000".to_string(),
            Login {
                username: "me".into(),
                password: "hunter2-secret".into(),
            },
        )]
        .into()
    }

    /// Sealed bytes hold no password, open only for their build with their key, and an
    /// altered byte fails; a key file must hold 32 bytes in hex.
    #[test]
    fn sealed_credentials_open_only_for_their_build() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, format!("{}\n", "ab".repeat(32))).unwrap();
        let key = CredentialsKey::load(&path).unwrap();
        let sealed = key.seal("b1", &auth()).unwrap();
        assert!(!sealed.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(key.open("b1", &sealed).unwrap(), auth());
        assert!(matches!(key.open("b2", &sealed), Err(SealError::Open)));
        let mut bad = sealed.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(matches!(key.open("b1", &bad), Err(SealError::Open)));
        assert!(matches!(key.open("b1", &sealed[..5]), Err(SealError::Open)));
        std::fs::write(&path, "cd".repeat(32)).unwrap();
        let other = CredentialsKey::load(&path).unwrap();
        assert!(matches!(other.open("b1", &sealed), Err(SealError::Open)));
        // Two seals of the same value differ (fresh nonces).
        assert_ne!(key.seal("b1", &auth()).unwrap(), sealed);
        for bad in ["", "abc", &"ab".repeat(31), &"zz".repeat(32)] {
            std::fs::write(&path, bad).unwrap();
            assert!(matches!(
                CredentialsKey::load(&path),
                Err(SealError::Format(_))
            ));
        }
        let login = auth()["registry.example:5000"].clone();
        let one = |r: &str| check(&[(r.to_string(), login.clone())].into());
        assert_eq!(
            one("index.docker.io").unwrap().keys().collect::<Vec<_>>(),
            ["docker.io"]
        );
        assert!(one("ghcr.io").is_ok() && one("127.0.0.1:5001").is_ok());
        for bad in ["", "https://ghcr.io", "ghcr.io/org", "myregistry", "a b"] {
            let e = one(bad).unwrap_err();
            assert!(e.contains("expected a registry host[:port]"), "{bad}: {e}");
        }
        let empty = Login {
            username: "me".into(),
            password: String::new(),
        };
        let e = check(&[("ghcr.io".to_string(), empty)].into()).unwrap_err();
        assert!(e.contains("expected a username and a password"), "{e}");
        let colon = Login {
            username: "a:b".into(),
            password: "p".into(),
        };
        let e = check(&[("ghcr.io".to_string(), colon)].into()).unwrap_err();
        assert!(e.contains("may not hold ':'"), "{e}");
        assert!(format!("{:?}", auth()).contains("<redacted>"));
        assert!(!format!("{:?}", auth()).contains("hunter2"));
    }
}
