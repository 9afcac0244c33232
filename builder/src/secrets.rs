//! Build secrets: the `--secret` flag (buildx spelling, `docker buildx build --secret`) and
//! the values `RUN --mount=type=secret` exposes.
//!
//! A flag is comma-separated `key=value` pairs: `id=ID` (required), then either
//! `src=PATH` (also `source=PATH`: the secret is the file's bytes) or `env=VAR` (the secret is
//! that environment variable of the build's caller), optionally `type=file|env`. As buildx
//! does, `type=file` without `src` reads the file named by the id, and `type=env` without
//! `env` reads the variable named by the id. A value is at most [`MAX_SECRET_BYTES`].
//!
//! [`SecretValue`] never prints its bytes (`Debug` shows the length), and the executor adds
//! every secret value a step can see to the values its logs redact
//! ([`crate::exec::logs::REDACTED`]). SSH agents (`--ssh`, for `RUN --mount=type=ssh`):
//! [`parse_ssh_flags`].

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;

/// Largest secret, bytes (500 KiB, BuildKit's limit for secrets, `secrets/secrets.go`).
pub const MAX_SECRET_BYTES: u64 = 500 << 10;

/// A bad `--secret` flag, or a secret that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// The flag is malformed.
    #[error("--secret {flag:?}: {reason}")]
    BadFlag {
        /// The flag as given.
        flag: String,
        /// What is wrong.
        reason: String,
    },
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
    /// A bad `--ssh` value.
    #[error("--ssh {flag:?}: {reason}")]
    BadSsh {
        /// The flag's value.
        flag: String,
        /// Why.
        reason: String,
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

/// Parses one `--secret` flag value (see the module documentation).
pub fn parse_secret_flag(flag: &str) -> Result<SecretSpec, SecretsError> {
    let bad = |reason: &str| SecretsError::BadFlag {
        flag: flag.to_string(),
        reason: reason.to_string(),
    };
    let (mut id, mut src, mut env, mut kind) = (None, None, None, None);
    for part in flag.split(',') {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| bad(&format!("{part:?} is not key=value")))?;
        if v.is_empty() {
            return Err(bad(&format!("{k} is empty")));
        }
        let slot = match k.trim() {
            "id" => &mut id,
            "src" | "source" => &mut src,
            "env" => &mut env,
            "type" => &mut kind,
            other => return Err(bad(&format!("unknown key {other:?}"))),
        };
        if slot.replace(v.to_string()).is_some() {
            return Err(bad(&format!("{k} given twice")));
        }
    }
    let id = id.ok_or_else(|| bad("id is required"))?;
    let source = match (kind.as_deref(), src, env) {
        (_, Some(_), Some(_)) => return Err(bad("give src or env, not both")),
        (Some("env"), Some(_), None) => return Err(bad("type=env takes env=, not src=")),
        (Some("file"), None, Some(_)) => return Err(bad("type=file takes src=, not env=")),
        (None | Some("file"), Some(p), None) => SecretSource::File(PathBuf::from(p)),
        (None | Some("env"), None, Some(v)) => SecretSource::Env(v),
        (Some("env"), None, None) => SecretSource::Env(id.clone()),
        (None | Some("file"), None, None) => SecretSource::File(PathBuf::from(&id)),
        (Some(t), _, _) => return Err(bad(&format!("unknown type {t:?} (file or env)"))),
    };
    Ok(SecretSpec { id, source })
}

/// The SSH agents of `--ssh` flags (buildx's spelling, `docker buildx build --ssh`), id →
/// the agent's socket: `default` or `ID` alone take `ssh_auth_sock` (the caller's
/// `$SSH_AUTH_SOCK`), `ID=SOCKET` that socket. Each id once; a path must be a socket
/// (buildx also takes private key files and loads them into an agent of its own: kiln does
/// not, load the key with `ssh-add` into an agent and give its socket), one per id.
pub fn parse_ssh_flags(
    flags: &[String],
    ssh_auth_sock: Option<&std::ffi::OsStr>,
) -> Result<BTreeMap<String, PathBuf>, SecretsError> {
    use std::os::unix::fs::FileTypeExt;
    let mut out = BTreeMap::new();
    for flag in flags {
        let bad = |reason: String| SecretsError::BadSsh {
            flag: flag.clone(),
            reason,
        };
        let (id, paths) = match flag.split_once('=') {
            Some((id, p)) => (id, Some(p)),
            None => (flag.as_str(), None),
        };
        if id.is_empty() {
            return Err(bad("expected default, ID or ID=SOCKET".into()));
        }
        let path = match paths {
            None | Some("") => PathBuf::from(
                ssh_auth_sock
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| bad("SSH_AUTH_SOCK is not set (no agent to forward)".into()))?,
            ),
            Some(p) if p.contains(',') => {
                return Err(bad("one agent socket per id".into()));
            }
            Some(p) => PathBuf::from(p),
        };
        let md = std::fs::metadata(&path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        if !md.file_type().is_socket() {
            return Err(bad(format!(
                "{} is not a socket (key files are not supported: add the key to an ssh-agent \
                 with ssh-add and give the agent's socket)",
                path.display()
            )));
        }
        if out.insert(id.to_string(), path).is_some() {
            return Err(bad(format!("agent id {id:?} given twice")));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags() {
        assert_eq!(
            parse_secret_flag("id=tok,src=/run/tok").unwrap(),
            SecretSpec {
                id: "tok".into(),
                source: SecretSource::File("/run/tok".into())
            }
        );
        assert_eq!(
            parse_secret_flag("id=aws,env=AWS_TOKEN").unwrap().source,
            SecretSource::Env("AWS_TOKEN".into())
        );
        assert_eq!(
            parse_secret_flag("type=env,id=HOME").unwrap().source,
            SecretSource::Env("HOME".into())
        );
        assert_eq!(
            parse_secret_flag("id=f").unwrap().source,
            SecretSource::File("f".into())
        );
        for bad in [
            "src=/x",
            "id=a,src=/x,env=Y",
            "id=a,bogus=1",
            "id=a,type=env,src=/x",
            "id=a,type=ssh",
            "id=",
            "id=a,id=b",
            "nonsense",
        ] {
            assert!(parse_secret_flag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ssh_flags() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("agent.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let file = d.path().join("id_ed25519");
        std::fs::write(&file, "key").unwrap();
        let env = Some(sock.as_os_str());
        let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let m =
            parse_ssh_flags(&flags(&["default", &format!("gh={}", sock.display())]), env).unwrap();
        assert_eq!(m["default"], sock);
        assert_eq!(m["gh"], sock);
        assert_eq!(parse_ssh_flags(&flags(&["x"]), env).unwrap()["x"], sock);
        for (bad, why) in [
            (vec!["default".to_string()], "SSH_AUTH_SOCK is not set"),
            (vec![format!("a={}", file.display())], "is not a socket"),
            (
                vec![format!("a={},{}", sock.display(), sock.display())],
                "one agent socket per id",
            ),
            (vec!["=x".to_string()], "expected default"),
        ] {
            let e = parse_ssh_flags(&bad, None).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        let e = parse_ssh_flags(&flags(&["a", "a"]), env).unwrap_err();
        assert!(e.to_string().contains("given twice"), "{e}");
    }

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
