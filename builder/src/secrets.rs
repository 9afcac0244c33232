//! Build secrets: where each comes from ([`SecretSpec`]: a file or an environment variable of
//! the build's caller, as `kiln build --secret` names them) and the values `RUN
//! --mount=type=secret` exposes. A value is at most [`MAX_SECRET_BYTES`].
//!
//! [`SecretValue`] never prints its bytes (`Debug` shows the length), and the executor adds
//! every secret value a step can see to the values its logs redact
//! ([`crate::exec::logs::REDACTED`]). SSH agents (`--ssh`, for `RUN --mount=type=ssh`)
//! are given to the build as id → socket.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;

/// Largest secret, bytes (500 KiB, BuildKit's limit for secrets, `secrets/secrets.go`).
pub const MAX_SECRET_BYTES: u64 = 500 << 10;

/// A bad `--secret` flag, or a secret that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// Two flags give the same id.
    #[error("--secret id {0:?} given twice")]
    Duplicate(String),
    /// The file cannot be read.
    #[error("secret {id:?}: reading {path}: {source}")]
    Read {
        /// Secret id.
        id: String,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The environment variable is not set (or not UTF-8).
    #[error("secret {id:?}: environment variable {var} is not set")]
    MissingEnv {
        /// Secret id.
        id: String,
        /// The variable.
        var: String,
    },
    /// The value is larger than [`MAX_SECRET_BYTES`].
    #[error("secret {id:?} is larger than {MAX_SECRET_BYTES} bytes")]
    TooLarge {
        /// Secret id.
        id: String,
    },
}

/// Where a secret's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// A file's bytes.
    File(PathBuf),
    /// An environment variable of the caller.
    Env(String),
}

/// One parsed `--secret` flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretSpec {
    /// The id `RUN --mount=type=secret,id=...` names.
    pub id: String,
    /// Where the value comes from.
    pub source: SecretSource,
}

/// A secret's bytes; `Debug` prints only the length.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretValue(Vec<u8>);

impl SecretValue {
    /// Wraps `bytes`.
    pub fn new(bytes: Vec<u8>) -> Self {
        SecretValue(bytes)
    }

    /// The bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretValue({} bytes)", self.0.len())
    }
}

/// The secrets given to one build, by id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Secrets {
    map: BTreeMap<String, SecretValue>,
}

impl Secrets {
    /// Reads every spec's value. Errors: [`SecretsError`].
    pub fn load(specs: &[SecretSpec]) -> Result<Secrets, SecretsError> {
        let mut map = BTreeMap::new();
        for s in specs {
            if map.contains_key(&s.id) {
                return Err(SecretsError::Duplicate(s.id.clone()));
            }
            let value = match &s.source {
                SecretSource::File(path) => {
                    let read_err = |source| SecretsError::Read {
                        id: s.id.clone(),
                        path: path.clone(),
                        source,
                    };
                    let f = std::fs::File::open(path).map_err(read_err)?;
                    let mut buf = Vec::new();
                    f.take(MAX_SECRET_BYTES + 1)
                        .read_to_end(&mut buf)
                        .map_err(read_err)?;
                    buf
                }
                SecretSource::Env(var) => std::env::var(var)
                    .map_err(|_| SecretsError::MissingEnv {
                        id: s.id.clone(),
                        var: var.clone(),
                    })?
                    .into_bytes(),
            };
            if value.len() as u64 > MAX_SECRET_BYTES {
                return Err(SecretsError::TooLarge { id: s.id.clone() });
            }
            map.insert(s.id.clone(), SecretValue(value));
        }
        Ok(Secrets { map })
    }

    /// Adds a value directly (callers that hold it already, and tests).
    pub fn insert(&mut self, id: impl Into<String>, value: SecretValue) {
        self.map.insert(id.into(), value);
    }

    /// The value of `id`.
    pub fn get(&self, id: &str) -> Option<&SecretValue> {
        self.map.get(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_load_bounded_and_never_print() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s");
        std::fs::write(&p, "hunter2").unwrap();
        let s = Secrets::load(&[SecretSpec {
            id: "a".into(),
            source: SecretSource::File(p.clone()),
        }])
        .unwrap();
        assert_eq!(s.get("a").unwrap().expose(), b"hunter2");
        assert!(!format!("{s:?}").contains("hunter2"));
        std::fs::write(&p, vec![b'x'; MAX_SECRET_BYTES as usize + 1]).unwrap();
        let e = Secrets::load(&[SecretSpec {
            id: "a".into(),
            source: SecretSource::File(p),
        }])
        .unwrap_err();
        assert!(matches!(e, SecretsError::TooLarge { .. }));
        let e = Secrets::load(&[SecretSpec {
            id: "b".into(),
            source: SecretSource::Env("KILN_TEST_SURELY_UNSET_VAR".into()),
        }])
        .unwrap_err();
        assert!(matches!(e, SecretsError::MissingEnv { .. }));
    }
}
