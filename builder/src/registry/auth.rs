//! Registry credentials in Docker's client config (`~/.docker/config.json`, or
//! `$DOCKER_CONFIG/config.json`), as the Docker CLI documents it ("docker login",
//! "Credential stores"): `{"auths": {"<registry>": {"auth": base64("user:password")}}}`.
//! Docker Hub's key is `https://index.docker.io/v1/`. Credential helpers (`credsStore`,
//! `credHelpers`) are not run; a registry found only there is treated as anonymous.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::{Map, Value};

/// Docker Hub's key in `auths`.
pub const DOCKER_HUB_KEY: &str = "https://index.docker.io/v1/";

/// Errors reading or writing the Docker config.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The file could not be read or written.
    #[error("docker config {path}: {source}")]
    Io {
        /// The config file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The file is not JSON of the expected shape.
    #[error("docker config {path}: {reason}")]
    Format {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// A user name and password. `Debug` hides the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password or token.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.username)
    }
}

/// The config file path: `$DOCKER_CONFIG/config.json`, else `$HOME/.docker/config.json`.
pub fn config_path() -> PathBuf {
    if let Some(d) = std::env::var_os("DOCKER_CONFIG").filter(|d| !d.is_empty()) {
        return Path::new(&d).join("config.json");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    Path::new(&home).join(".docker/config.json")
}

fn key_for(registry: &str) -> String {
    if registry == "docker.io" || registry == "index.docker.io" {
        DOCKER_HUB_KEY.to_string()
    } else {
        registry.to_string()
    }
}

/// Strips a scheme and path from an `auths` key (`https://host:port/v1/` → `host:port`).
fn normalize_key(k: &str) -> &str {
    let k = k
        .strip_prefix("https://")
        .or_else(|| k.strip_prefix("http://"))
        .unwrap_or(k);
    k.split('/').next().unwrap_or(k)
}

fn read(path: &Path) -> Result<Option<Map<String, Value>>, AuthError> {
    match std::fs::read(path) {
        Ok(b) => match serde_json::from_slice::<Value>(&b) {
            Ok(Value::Object(m)) => Ok(Some(m)),
            Ok(_) => Err(AuthError::Format {
                path: path.to_path_buf(),
                reason: "not a JSON object".into(),
            }),
            Err(e) => Err(AuthError::Format {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(AuthError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Looks up credentials for `registry` (`host[:port]`, or `docker.io`) in the config at
/// `path`. `Ok(None)`: no file or no entry (anonymous).
pub fn lookup(path: &Path, registry: &str) -> Result<Option<Credentials>, AuthError> {
    let Some(cfg) = read(path)? else {
        return Ok(None);
    };
    let Some(Value::Object(auths)) = cfg.get("auths") else {
        return Ok(None);
    };
    let want = key_for(registry);
    let entry = auths.get(&want).or_else(|| {
        auths
            .iter()
            .find(|(k, _)| normalize_key(k) == normalize_key(&want))
            .map(|(_, v)| v)
    });
    let Some(Value::Object(entry)) = entry else {
        return Ok(None);
    };
    let fmt = |reason: &str| AuthError::Format {
        path: path.to_path_buf(),
        reason: format!("auths[{want}]: {reason}"),
    };
    if let Some(Value::String(a)) = entry.get("auth") {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(a.trim())
            .map_err(|_| fmt("auth is not base64"))?;
        let s = String::from_utf8(raw).map_err(|_| fmt("auth is not UTF-8"))?;
        let (u, p) = s
            .split_once(':')
            .ok_or_else(|| fmt("auth is not user:password"))?;
        return Ok(Some(Credentials {
            username: u.to_string(),
            password: p.to_string(),
        }));
    }
    if let (Some(Value::String(u)), Some(Value::String(p))) =
        (entry.get("username"), entry.get("password"))
    {
        return Ok(Some(Credentials {
            username: u.clone(),
            password: p.clone(),
        }));
    }
    Ok(None)
}

/// Stores credentials for `registry` in the config at `path` (as `docker login` does without
/// a credential store), keeping every other key; the file is written with mode 0600.
pub fn store(path: &Path, registry: &str, creds: &Credentials) -> Result<(), AuthError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut cfg = read(path)?.unwrap_or_default();
    let auths = cfg
        .entry("auths")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(auths) = auths else {
        return Err(AuthError::Format {
            path: path.to_path_buf(),
            reason: "auths is not an object".into(),
        });
    };
    let auth = base64::engine::general_purpose::STANDARD
        .encode(format!("{}:{}", creds.username, creds.password));
    let mut entry = Map::new();
    entry.insert("auth".into(), Value::String(auth));
    auths.insert(key_for(registry), Value::Object(entry));
    let io = |source| AuthError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    // A map of JSON values always serializes.
    let body = serde_json::to_vec_pretty(&Value::Object(cfg)).expect("JSON values serialize");
    f.write_all(&body).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_lookup() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("docker/config.json");
        assert_eq!(lookup(&p, "127.0.0.1:5001").expect("no file"), None);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(
            &p,
            r#"{"credsStore":"x","auths":{"https://index.docker.io/v1/":{"auth":"dTpw"}}}"#,
        )
        .expect("write");
        let hub = lookup(&p, "docker.io").expect("read").expect("hub entry");
        assert_eq!((hub.username.as_str(), hub.password.as_str()), ("u", "p"));
        let c = Credentials {
            username: "kiln".into(),
            password: "pa:ss".into(),
        };
        store(&p, "127.0.0.1:5001", &c).expect("store");
        assert_eq!(lookup(&p, "127.0.0.1:5001").expect("read"), Some(c));
        assert!(
            lookup(&p, "docker.io").expect("read").is_some(),
            "other entries kept"
        );
        let raw: Value = serde_json::from_slice(&std::fs::read(&p).expect("read")).expect("json");
        assert_eq!(raw["credsStore"], "x");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&p).expect("stat").permissions().mode() & 0o777,
            0o600
        );
        assert!(format!("{:?}", lookup(&p, "127.0.0.1:5001").expect("r")).contains("redacted"));
        std::fs::write(&p, r#"{"auths":{"h":{"auth":"!!"}}}"#).expect("write");
        assert!(matches!(lookup(&p, "h"), Err(AuthError::Format { .. })));
    }
}
