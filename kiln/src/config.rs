//! Configuration of the `kiln` binary: every setting is taken from the first of
//!
//! 1. a command-line flag (`--store URL`, `-v`),
//! 2. an environment variable (`KILN_STORE`, `KILN_CACHE`, ...),
//! 3. the config file: `$KILN_CONFIG`, else `$XDG_CONFIG_HOME/kiln/config.toml`, else
//!    `~/.config/kiln/config.toml` (XDG Base Directory Specification 0.8, `XDG_CONFIG_HOME`:
//!    used only when set to an absolute path),
//! 4. the built-in default,
//!
//! and remembers which one it came from ([`Origin`]), for `kiln config show`.
//!
//! | key (file) | environment | flag | default |
//! | --- | --- | --- | --- |
//! | `store` | `KILN_STORE` | `--store` | `$XDG_DATA_HOME/kiln/store`, else `~/.local/share/kiln/store` |
//! | `cache` | `KILN_CACHE` | | `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln` |
//! | `cache_max_mib` | `KILN_CACHE_MAX_MIB` | | `10240` |
//! | `layer_dir` | `KILN_LAYER_DIR` | | `<cache>/layers` |
//! | `log` | `KILN_LOG`, then `RUST_LOG` | `-v` (info), `-vv` (debug), `-vvv` (trace) | `warn` |
//! | `store_attempts` | `KILN_STORE_ATTEMPTS` | | `6` |
//! | `store_timeout_secs` | `KILN_STORE_TIMEOUT_SECS` | | `300` |
//! | `lazy_read_timeout_secs` | `KILN_LAZY_READ_TIMEOUT_SECS` | | `20` |
//! | `s3.endpoint` | `KILN_S3_ENDPOINT` | | unset: `AWS_ENDPOINT_URL` or the AWS default |
//! | `s3.region` | `KILN_S3_REGION` | | unset: `AWS_REGION` or `us-east-1` |
//! | `s3.allow_http` | `KILN_S3_ALLOW_HTTP` | | unset: `AWS_ALLOW_HTTP` or `false` |
//! | `s3.request_timeout_secs` | `KILN_S3_REQUEST_TIMEOUT_SECS` | | `30` |
//! | `bootstrap_mirror` | `KILN_BOOTSTRAP_MIRROR` | | the archive this host's apt uses |
//! | `serve.listen` | `KILN_LISTEN` | `kiln serve --listen` | `127.0.0.1:8080` |
//! | `serve.database` | `KILN_SERVE_DATABASE` | `kiln serve --database` | unset: SQLite, `<state_dir>/kiln.db` |
//! | `serve.state_dir` | `KILN_SERVE_STATE_DIR` | `kiln serve --state-dir` | `$KILN_STATE_DIR/serve`, else `$XDG_STATE_HOME/kiln/serve`, else `~/.local/state/kiln/serve` |
//!
//! `cache` is this machine's cache directory: chunks read from a remote (S3) store are kept
//! under `<cache>/chunks`, at most `cache_max_mib` MiB. `layer_dir` is this machine's shared
//! directory of unpacked layers: every build of the host (`kiln build`, `kiln serve`, `kiln
//! nightly`), whatever its store, unpacks a base's layers there once, digest checked, and
//! finds them there again (`kiln_builder::build::lower`); `kiln store gc` (any store)
//! empties it when no build runs. It is used only on the file system of the build's work
//! directory. S3 credentials are never read from
//! the config file: they come from the usual `AWS_*` variables. `bootstrap_mirror` is the
//! archive `kiln build` bootstraps `from: {bootstrap: ...}` recipes from when they name no
//! mirror; by default the first release suite (no `-updates`, `-security`...) in this host's
//! apt sources (`/etc/apt/sources.list`, `/etc/apt/sources.list.d/*.list` and `*.sources`).
//!
//! Every store operation (one get, put, list... of one object; a multipart upload of one file
//! is one operation) that fails transiently (5xx, throttling, a timeout, a reset connection) is
//! retried: `store_attempts` attempts in all, with waits of 100 ms doubling up to 5 s, each
//! retry logged as a warning (and with `--json` a `retry` event), and the operation gives up
//! after `store_timeout_secs` seconds whatever attempts remain. On S3, one request that gets
//! no answer is abandoned after `s3.request_timeout_secs` seconds. The defaults:
//! [`kiln_store::backend::retry::DEFAULT_MAX_ATTEMPTS`] and
//! [`kiln_store::backend::retry::DEFAULT_OPERATION_TIMEOUT`] (300 s: above the 6 × 30 s a
//! hung server costs with the other defaults), and [`DEFAULT_S3_REQUEST_TIMEOUT_SECS`]
//! (object_store's default).
//!
//! The chunk server of lazily started clones (`kiln __lazy-serve`) bounds each chunk read
//! tighter: `lazy_read_timeout_secs` for the whole read, every attempt included, and a third
//! of it for one S3 request ([`Config::lazy_store_options`]), so a store that stops answering
//! fails the clone's read with an error naming the chunk and the store well before the
//! clones' restore timeout ([`kiln_vmm::clone::DEFAULT_RESTORE_TIMEOUT`], 60 s), which is
//! why the setting must stay below it.
//!
//! The file is TOML with exactly these keys (unknown keys are an error, so a typo fails
//! loudly); it is read with a size bound of [`MAX_CONFIG_BYTES`]. A local store or cache path
//! in the file must be absolute or start with `~/`.
//!
//! ```toml
//! store = "s3://kiln-images/prod"
//! cache = "~/.cache/kiln"
//! cache_max_mib = 20480
//! log = "info"
//! store_attempts = 6
//! store_timeout_secs = 300
//! lazy_read_timeout_secs = 20
//!
//! [s3]
//! endpoint = "http://127.0.0.1:9000"
//! region = "us-east-1"
//! allow_http = true
//! request_timeout_secs = 30
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln_store::StoreOptions;
use kiln_store::StoreUrl;
use kiln_store::backend::retry;
use serde::Deserialize;

/// Largest config file read, in bytes (1 MiB; a real one is a few hundred bytes).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Default bound of the chunk read cache, MiB.
pub const DEFAULT_CACHE_MAX_MIB: u64 = 10240;

/// Default `s3.request_timeout_secs`: 30 s, object_store's default request timeout
/// (`ClientOptions`, which cites AWS's advice on timeouts for latency-sensitive applications
/// and rounds up).
pub const DEFAULT_S3_REQUEST_TIMEOUT_SECS: u64 = 30;

/// Largest `store_attempts` accepted: 100.
pub const MAX_STORE_ATTEMPTS: u64 = 100;

/// Largest `store_timeout_secs` and `s3.request_timeout_secs` accepted: 7 days, in seconds.
pub const MAX_TIMEOUT_SECS: u64 = 7 * 86400;

/// Default `lazy_read_timeout_secs`: 20 s, a third of the clones' 60 s restore timeout, so a
/// read that gives up still leaves the start time to report it.
pub const DEFAULT_LAZY_READ_TIMEOUT_SECS: u64 = 20;

/// Errors loading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file exists but cannot be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The config file is larger than [`MAX_CONFIG_BYTES`].
    #[error("config file {path}: larger than the {MAX_CONFIG_BYTES}-byte limit")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// The config file is not valid TOML or has unknown keys or wrong types.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A value, wherever it came from, is not acceptable.
    #[error("{key} = {value:?} (from {origin}): {reason}")]
    Invalid {
        /// The setting.
        key: &'static str,
        /// What was given.
        value: String,
        /// Where it was given.
        origin: Origin,
        /// Why it is refused.
        reason: String,
    },
    /// No home directory to put defaults under.
    #[error(
        "{key}: HOME is not set, so there is no default; set {env} or `{key}` in the config file"
    )]
    NoHome {
        /// The setting needing a default.
        key: &'static str,
        /// Its environment variable.
        env: &'static str,
    },
}

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag (its spelling, e.g. `--store`).
    Flag(&'static str),
    /// An environment variable (its name).
    Env(&'static str),
    /// The config file (its path).
    File(PathBuf),
    /// The built-in default.
    Default,
}

impl Origin {
    /// One word for the kind: `flag`, `env`, `file` or `default`.
    pub fn kind(&self) -> &'static str {
        match self {
            Origin::Flag(_) => "flag",
            Origin::Env(_) => "env",
            Origin::File(_) => "file",
            Origin::Default => "default",
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag(n) => write!(f, "flag {n}"),
            Origin::Env(n) => write!(f, "env {n}"),
            Origin::File(p) => write!(f, "file {}", p.display()),
            Origin::Default => f.write_str("default"),
        }
    }
}

/// One setting's value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    /// The value.
    pub value: T,
    /// Where it came from.
    pub origin: Origin,
}

/// What the command line said (every field optional: `None`/`0` means not given).
#[derive(Debug, Clone, Default)]
pub struct Flags {
    /// `--store URL`.
    pub store: Option<String>,
    /// `kiln serve --listen ADDR`.
    pub listen: Option<String>,
    /// `kiln serve --state-dir DIR`.
    pub serve_state_dir: Option<String>,
    /// `kiln serve --database URL`.
    pub serve_database: Option<String>,
    /// `-v` count.
    pub verbose: u8,
}

impl Flags {
    /// Only `--store` (what most subcommands have).
    pub fn store(store: Option<&str>) -> Self {
        Self {
            store: store.map(str::to_string),
            ..Self::default()
        }
    }
}

/// The `[s3]` table of the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileS3 {
    endpoint: Option<String>,
    region: Option<String>,
    allow_http: Option<bool>,
    request_timeout_secs: Option<u64>,
}

/// The `[serve]` table of the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileServe {
    listen: Option<String>,
    database: Option<String>,
    state_dir: Option<String>,
}

/// The file's schema.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    store: Option<String>,
    cache: Option<String>,
    cache_max_mib: Option<u64>,
    layer_dir: Option<String>,
    log: Option<String>,
    store_attempts: Option<u64>,
    store_timeout_secs: Option<u64>,
    lazy_read_timeout_secs: Option<u64>,
    bootstrap_mirror: Option<String>,
    #[serde(default)]
    s3: FileS3,
    #[serde(default)]
    serve: FileServe,
}

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The config file looked at, and whether it exists.
    pub file: (PathBuf, bool),
    /// The store URL (a path, `file://PATH` or `s3://bucket/prefix`).
    pub store: Setting<String>,
    /// This machine's cache directory.
    pub cache: Setting<PathBuf>,
    /// Bound of the chunk read cache, MiB.
    pub cache_max_mib: Setting<u64>,
    /// The host's shared directory of unpacked layers (the module documentation).
    pub layer_dir: Setting<PathBuf>,
    /// The tracing filter (`warn`, `info`, `debug`, `trace`, or an `EnvFilter` directive).
    pub log: Setting<String>,
    /// Attempts of one store operation in all, the first included (1 to
    /// [`MAX_STORE_ATTEMPTS`]).
    pub store_attempts: Setting<u32>,
    /// Bound on one store operation, every attempt and wait included, seconds (1 to
    /// [`MAX_TIMEOUT_SECS`]).
    pub store_timeout_secs: Setting<u64>,
    /// Bound on one chunk read of the lazy chunk server, every attempt included, seconds (1
    /// to one less than [`kiln_vmm::clone::DEFAULT_RESTORE_TIMEOUT`]).
    pub lazy_read_timeout_secs: Setting<u64>,
    /// S3 endpoint override.
    pub s3_endpoint: Setting<Option<String>>,
    /// S3 region override.
    pub s3_region: Setting<Option<String>>,
    /// Whether a plain-HTTP S3 endpoint is allowed (override).
    pub s3_allow_http: Setting<Option<bool>>,
    /// How long one S3 request may go unanswered before it is abandoned (and retried),
    /// seconds (1 to [`MAX_TIMEOUT_SECS`]).
    pub s3_request_timeout_secs: Setting<u64>,
    /// The archive to bootstrap from when a recipe names none (`None`: no default).
    pub bootstrap_mirror: Setting<Option<String>>,
    /// The address `kiln serve` listens on.
    pub serve_listen: Setting<std::net::SocketAddr>,
    /// `kiln serve`'s state directory (its SQLite database and uploaded contexts).
    pub serve_state_dir: Setting<PathBuf>,
    /// `kiln serve`'s PostgreSQL URL (`None`: SQLite in the state directory).
    pub serve_database: Setting<Option<String>>,
}

/// Where to look for the config file, given the environment.
pub fn config_path(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(p) = env("KILN_CONFIG") {
        return Some(PathBuf::from(p));
    }
    if let Some(x) = env("XDG_CONFIG_HOME").filter(|x| Path::new(x).is_absolute()) {
        return Some(Path::new(&x).join("kiln/config.toml"));
    }
    env("HOME").map(|h| Path::new(&h).join(".config/kiln/config.toml"))
}

/// The process environment, empty values treated as unset.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn read_file(path: &Path) -> Result<Option<String>, ConfigError> {
    use std::io::Read as _;
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ConfigError::Read {
                path: path.into(),
                source,
            });
        }
    };
    let mut text = String::new();
    let n = f
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
    if n as u64 > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge { path: path.into() });
    }
    Ok(Some(text))
}

impl Config {
    /// Puts this host's settings that every pipeline caller (`kiln build`, `kiln nightly`,
    /// `kiln serve`) shares on `setup`: the shared layer directory (`layer_dir`), the package
    /// download cache (`<cache>/packages`, never a tenant's build's) and the
    /// bootstrap mirror (`bootstrap_mirror`: `from: {bootstrap: ...}` without a mirror gets
    /// it, else this host's apt archive; see `kiln config show`).
    pub fn apply_host(&self, setup: &mut kiln_pipeline::Setup) {
        setup.layer_dir = Some(self.layer_dir.value.clone());
        setup.package_cache = Some(self.cache.value.join("packages"));
        setup.bootstrap_mirror = self.bootstrap_mirror.value.clone();
    }

    /// Loads the configuration from the process environment and the config file, under
    /// `flags`.
    pub fn load(flags: &Flags) -> Result<Self, ConfigError> {
        let path = config_path(&process_env);
        let text = match &path {
            Some(p) => read_file(p)?,
            None => None,
        };
        Self::resolve(flags, &process_env, path, text.as_deref(), host_apt_mirror)
    }

    /// Resolves the configuration from `flags`, an environment lookup, and the config file's
    /// path and text (`None`: no file); `apt_mirror` finds the host's archive, asked only when
    /// nothing else names a bootstrap mirror. Touches nothing else.
    pub fn resolve(
        flags: &Flags,
        env: &dyn Fn(&str) -> Option<String>,
        path: Option<PathBuf>,
        text: Option<&str>,
        apt_mirror: fn() -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let path = path.unwrap_or_default();
        let file: FileConfig = match text {
            Some(t) => toml::from_str(t).map_err(|e: toml::de::Error| ConfigError::Parse {
                path: path.clone(),
                message: match e.span() {
                    Some(span) => {
                        let before = &t[..span.start.min(t.len())];
                        let line = before.matches('\n').count() + 1;
                        let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                        format!("line {line}, column {col}: {}", e.message())
                    }
                    None => e.message().to_string(),
                },
            })?,
            None => FileConfig::default(),
        };
        let from_file = Origin::File(path.clone());
        let home = env("HOME");

        // First of flag, env vars, file; `None` if none of them says anything.
        let pick = |flag: Option<(String, &'static str)>,
                    envs: &[&'static str],
                    file: Option<String>|
         -> Option<Setting<String>> {
            if let Some((v, name)) = flag {
                return Some(Setting {
                    value: v,
                    origin: Origin::Flag(name),
                });
            }
            for name in envs {
                if let Some(v) = env(name) {
                    return Some(Setting {
                        value: v,
                        origin: Origin::Env(name),
                    });
                }
            }
            file.map(|v| Setting {
                value: v,
                origin: from_file.clone(),
            })
        };

        let store = match pick(
            flags.store.clone().map(|s| (s, "--store")),
            &["KILN_STORE"],
            file.store,
        ) {
            Some(s) => {
                let value = check_store(s.value, &s.origin, home.as_deref())?;
                Setting { value, ..s }
            }
            None => Setting {
                value: xdg_default(
                    env("XDG_DATA_HOME"),
                    "kiln/store",
                    home.as_deref(),
                    ".local/share/kiln/store",
                    "store",
                )?
                .to_string_lossy()
                .into_owned(),
                origin: Origin::Default,
            },
        };

        let cache = match pick(None, &["KILN_CACHE"], file.cache) {
            Some(s) => Setting {
                value: check_dir("cache", &s.value, &s.origin, home.as_deref())?,
                origin: s.origin,
            },
            None => Setting {
                value: xdg_default(
                    env("XDG_CACHE_HOME"),
                    "kiln",
                    home.as_deref(),
                    ".cache/kiln",
                    "cache",
                )?,
                origin: Origin::Default,
            },
        };

        let cache_max_mib = match pick(
            None,
            &["KILN_CACHE_MAX_MIB"],
            file.cache_max_mib.map(|n| n.to_string()),
        ) {
            Some(s) => Setting {
                value: parse_whole("cache_max_mib", &s.value, &s.origin, 1 << 40, "MiB")?,
                origin: s.origin,
            },
            None => Setting {
                value: DEFAULT_CACHE_MAX_MIB,
                origin: Origin::Default,
            },
        };

        let layer_dir = match pick(None, &["KILN_LAYER_DIR"], file.layer_dir) {
            Some(s) => Setting {
                value: check_dir("layer_dir", &s.value, &s.origin, home.as_deref())?,
                origin: s.origin,
            },
            None => Setting {
                value: cache.value.join("layers"),
                origin: Origin::Default,
            },
        };

        let verbose = match flags.verbose {
            0 => None,
            1 => Some(("info".to_string(), "-v")),
            2 => Some(("debug".to_string(), "-vv")),
            _ => Some(("trace".to_string(), "-vvv")),
        };
        let log = match pick(verbose, &["KILN_LOG", "RUST_LOG"], file.log) {
            Some(s) => {
                check_log(&s.value, &s.origin)?;
                s
            }
            None => Setting {
                value: "warn".into(),
                origin: Origin::Default,
            },
        };

        // A whole number from flag, env or file, else `default`.
        let whole = |s: Option<Setting<String>>,
                     key: &'static str,
                     max: u64,
                     unit: &str,
                     default: u64|
         -> Result<Setting<u64>, ConfigError> {
            Ok(match s {
                Some(s) => Setting {
                    value: parse_whole(key, &s.value, &s.origin, max, unit)?,
                    origin: s.origin,
                },
                None => Setting {
                    value: default,
                    origin: Origin::Default,
                },
            })
        };
        let store_attempts = whole(
            pick(
                None,
                &["KILN_STORE_ATTEMPTS"],
                file.store_attempts.map(|n| n.to_string()),
            ),
            "store_attempts",
            MAX_STORE_ATTEMPTS,
            "attempts",
            u64::from(retry::DEFAULT_MAX_ATTEMPTS),
        )?;
        let store_attempts = Setting {
            // At most MAX_STORE_ATTEMPTS (100), so it fits.
            value: u32::try_from(store_attempts.value).unwrap_or(retry::DEFAULT_MAX_ATTEMPTS),
            origin: store_attempts.origin,
        };
        let store_timeout_secs = whole(
            pick(
                None,
                &["KILN_STORE_TIMEOUT_SECS"],
                file.store_timeout_secs.map(|n| n.to_string()),
            ),
            "store_timeout_secs",
            MAX_TIMEOUT_SECS,
            "seconds",
            retry::DEFAULT_OPERATION_TIMEOUT.as_secs(),
        )?;
        let lazy_read_timeout_secs = whole(
            pick(
                None,
                &["KILN_LAZY_READ_TIMEOUT_SECS"],
                file.lazy_read_timeout_secs.map(|n| n.to_string()),
            ),
            "lazy_read_timeout_secs",
            kiln_vmm::clone::DEFAULT_RESTORE_TIMEOUT.as_secs() - 1,
            "seconds (below the clones' restore timeout)",
            DEFAULT_LAZY_READ_TIMEOUT_SECS,
        )?;
        let s3_request_timeout_secs = whole(
            pick(
                None,
                &["KILN_S3_REQUEST_TIMEOUT_SECS"],
                file.s3.request_timeout_secs.map(|n| n.to_string()),
            ),
            "s3.request_timeout_secs",
            MAX_TIMEOUT_SECS,
            "seconds",
            DEFAULT_S3_REQUEST_TIMEOUT_SECS,
        )?;

        let opt = |s: Option<Setting<String>>| match s {
            Some(s) => Setting {
                value: Some(s.value),
                origin: s.origin,
            },
            None => Setting {
                value: None,
                origin: Origin::Default,
            },
        };
        let s3_endpoint = opt(pick(None, &["KILN_S3_ENDPOINT"], file.s3.endpoint));
        if let Some(e) = &s3_endpoint.value
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return Err(ConfigError::Invalid {
                key: "s3.endpoint",
                value: e.clone(),
                origin: s3_endpoint.origin,
                reason: "not an http:// or https:// URL".into(),
            });
        }
        let s3_region = opt(pick(None, &["KILN_S3_REGION"], file.s3.region));
        let s3_allow_http = match pick(
            None,
            &["KILN_S3_ALLOW_HTTP"],
            file.s3.allow_http.map(|b| b.to_string()),
        ) {
            Some(s) => Setting {
                value: Some(parse_bool("s3.allow_http", &s.value, &s.origin)?),
                origin: s.origin,
            },
            None => Setting {
                value: None,
                origin: Origin::Default,
            },
        };

        let bootstrap_mirror = match pick(None, &["KILN_BOOTSTRAP_MIRROR"], file.bootstrap_mirror) {
            Some(s) => {
                let v = s.value.trim_end_matches('/').to_string();
                if !(v.starts_with("http://") || v.starts_with("https://"))
                    || v.chars().any(|c| c.is_whitespace() || c.is_control())
                {
                    return Err(ConfigError::Invalid {
                        key: "bootstrap_mirror",
                        value: s.value,
                        origin: s.origin,
                        reason: "not an http:// or https:// URL".into(),
                    });
                }
                Setting {
                    value: Some(v),
                    origin: s.origin,
                }
            }
            None => Setting {
                value: apt_mirror(),
                origin: Origin::Default,
            },
        };

        let serve_listen = match pick(
            flags.listen.clone().map(|s| (s, "--listen")),
            &["KILN_LISTEN"],
            file.serve.listen,
        ) {
            Some(s) => Setting {
                value: s.value.parse().map_err(|_| ConfigError::Invalid {
                    key: "serve.listen",
                    value: s.value.clone(),
                    origin: s.origin.clone(),
                    reason: "expected IP:PORT (e.g. 127.0.0.1:8080)".into(),
                })?,
                origin: s.origin,
            },
            None => Setting {
                value: std::net::SocketAddr::from(([127, 0, 0, 1], 8080)),
                origin: Origin::Default,
            },
        };
        let serve_state_dir = match pick(
            flags.serve_state_dir.clone().map(|s| (s, "--state-dir")),
            &["KILN_SERVE_STATE_DIR"],
            file.serve.state_dir,
        ) {
            Some(s) => Setting {
                value: check_dir("serve.state_dir", &s.value, &s.origin, home.as_deref())?,
                origin: s.origin,
            },
            // Never $XDG_RUNTIME_DIR: the database must outlive a reboot.
            None => Setting {
                value: match env("KILN_STATE_DIR") {
                    Some(d) => Path::new(&d).join("serve"),
                    None => xdg_default(
                        env("XDG_STATE_HOME"),
                        "kiln/serve",
                        home.as_deref(),
                        ".local/state/kiln/serve",
                        "serve.state_dir",
                    )?,
                },
                origin: Origin::Default,
            },
        };

        let serve_database = opt(pick(
            flags.serve_database.clone().map(|s| (s, "--database")),
            &["KILN_SERVE_DATABASE"],
            file.serve.database,
        ));
        if let Some(u) = &serve_database.value
            && !(u.starts_with("postgres://") || u.starts_with("postgresql://"))
        {
            return Err(ConfigError::Invalid {
                key: "serve.database",
                value: u.clone(),
                origin: serve_database.origin,
                reason: "not a postgres:// URL".into(),
            });
        }

        Ok(Config {
            file: (path.clone(), text.is_some()),
            store,
            cache,
            cache_max_mib,
            layer_dir,
            log,
            store_attempts,
            store_timeout_secs,
            lazy_read_timeout_secs,
            s3_endpoint,
            s3_region,
            s3_allow_http,
            s3_request_timeout_secs,
            bootstrap_mirror,
            serve_listen,
            serve_state_dir,
            serve_database,
        })
    }

    /// Options to open [`Config::store`] with: the retry policy's attempts and bound, the S3
    /// overrides and request timeout, and for a remote store the chunk read cache under
    /// `<cache>/chunks`.
    pub fn store_options(&self) -> StoreOptions {
        let mut o = StoreOptions::default();
        o.retry.max_attempts = self.store_attempts.value;
        o.retry.operation_timeout = Duration::from_secs(self.store_timeout_secs.value);
        o.s3.endpoint = self.s3_endpoint.value.clone();
        o.s3.region = self.s3_region.value.clone();
        o.s3.allow_http = self.s3_allow_http.value;
        o.s3.request_timeout = Some(Duration::from_secs(self.s3_request_timeout_secs.value));
        if matches!(StoreUrl::parse(&self.store.value), Ok(StoreUrl::S3 { .. })) {
            o.read_cache = Some((
                self.cache.value.join("chunks"),
                self.cache_max_mib.value.saturating_mul(1 << 20),
            ));
        }
        o
    }

    /// [`Config::store_options`] for the lazy chunk server: one operation is bounded by
    /// `lazy_read_timeout_secs` (or `store_timeout_secs` when that is shorter), and one S3
    /// request by a third of that bound (or `s3.request_timeout_secs` when shorter, and at
    /// least 100 ms), so a hung request is retried at least once before the read gives up.
    pub fn lazy_store_options(&self) -> StoreOptions {
        let mut o = self.store_options();
        let bound = Duration::from_secs(self.lazy_read_timeout_secs.value);
        o.retry.operation_timeout = o.retry.operation_timeout.min(bound);
        let per_request = (o.retry.operation_timeout / 3).max(Duration::from_millis(100));
        o.s3.request_timeout = Some(
            o.s3.request_timeout
                .map_or(per_request, |t| t.min(per_request)),
        );
        o
    }

    /// The directory on this host that holds the store's blobs as files, for the commands
    /// that need files (layers to unpack, an ext4 image to flatten): a local store's own
    /// directory; for an S3 store, `<cache>/stores/<16 hex>` (the first 16 hex digits of the
    /// sha256 of the store URL, so two stores never share OCI references), a cache that
    /// every command fills from the store and writes through to it (see the README's
    /// "Pointing kiln at S3").
    pub fn local_dir(&self) -> PathBuf {
        match StoreUrl::parse(&self.store.value) {
            Ok(StoreUrl::Local(p)) => p,
            _ => {
                let d = kiln_builder::cache::digest_of(self.store.value.as_bytes());
                let hex = d.hex();
                self.cache.value.join("stores").join(&hex[..16])
            }
        }
    }

    /// Every setting as `(key, value as text, origin)`, in the table's order. Unset optional
    /// values show as `None`.
    pub fn entries(&self) -> Vec<(&'static str, Option<String>, &Origin)> {
        vec![
            ("store", Some(self.store.value.clone()), &self.store.origin),
            (
                "cache",
                Some(self.cache.value.display().to_string()),
                &self.cache.origin,
            ),
            (
                "cache_max_mib",
                Some(self.cache_max_mib.value.to_string()),
                &self.cache_max_mib.origin,
            ),
            (
                "layer_dir",
                Some(self.layer_dir.value.display().to_string()),
                &self.layer_dir.origin,
            ),
            ("log", Some(self.log.value.clone()), &self.log.origin),
            (
                "store_attempts",
                Some(self.store_attempts.value.to_string()),
                &self.store_attempts.origin,
            ),
            (
                "store_timeout_secs",
                Some(self.store_timeout_secs.value.to_string()),
                &self.store_timeout_secs.origin,
            ),
            (
                "lazy_read_timeout_secs",
                Some(self.lazy_read_timeout_secs.value.to_string()),
                &self.lazy_read_timeout_secs.origin,
            ),
            (
                "s3.endpoint",
                self.s3_endpoint.value.clone(),
                &self.s3_endpoint.origin,
            ),
            (
                "s3.region",
                self.s3_region.value.clone(),
                &self.s3_region.origin,
            ),
            (
                "s3.allow_http",
                self.s3_allow_http.value.map(|b| b.to_string()),
                &self.s3_allow_http.origin,
            ),
            (
                "s3.request_timeout_secs",
                Some(self.s3_request_timeout_secs.value.to_string()),
                &self.s3_request_timeout_secs.origin,
            ),
            (
                "bootstrap_mirror",
                self.bootstrap_mirror.value.clone(),
                &self.bootstrap_mirror.origin,
            ),
            (
                "serve.listen",
                Some(self.serve_listen.value.to_string()),
                &self.serve_listen.origin,
            ),
            (
                "serve.database",
                self.serve_database.value.clone(),
                &self.serve_database.origin,
            ),
            (
                "serve.state_dir",
                Some(self.serve_state_dir.value.display().to_string()),
                &self.serve_state_dir.origin,
            ),
        ]
    }
}

/// The archive this host's apt uses for a release suite: the first `deb` source, in
/// `/etc/apt/sources.list` then `/etc/apt/sources.list.d/` (`*.list`, `*.sources`) in name
/// order, whose suite has no `-` (so not `-updates`, `-security`, `-backports`).
pub fn host_apt_mirror() -> Option<String> {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(rd) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    files.iter().find_map(|f| {
        let ext = f.extension()?.to_str()?;
        // Sources files are a few KiB; a bound keeps a strange one from being read whole.
        let text = read_file(f).ok().flatten()?;
        apt_mirror_in(ext, &text)
    })
}

/// The first release-suite `deb` URI in one apt sources file (`list`: one-line format,
/// `sources`: deb822), per sources.list(5).
fn apt_mirror_in(ext: &str, text: &str) -> Option<String> {
    let release = |suite: &str| !suite.is_empty() && !suite.contains('-') && !suite.contains('/');
    let http = |u: &str| u.starts_with("http://") || u.starts_with("https://");
    match ext {
        "list" => text.lines().find_map(|l| {
            let l = l.split('#').next()?.trim();
            let rest = l.strip_prefix("deb ")?.trim_start();
            // Skip an `[option=value ...]` block.
            let rest = match rest.strip_prefix('[') {
                Some(r) => r.split_once(']')?.1.trim_start(),
                None => rest,
            };
            let mut w = rest.split_whitespace();
            let (uri, suite) = (w.next()?, w.next()?);
            (http(uri) && release(suite)).then(|| uri.trim_end_matches('/').to_string())
        }),
        "sources" => text.split("\n\n").find_map(|stanza| {
            let field = |name: &str| {
                stanza.lines().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
                })
            };
            if field("Enabled").is_some_and(|v| v.eq_ignore_ascii_case("no"))
                || !field("Types")?.split_whitespace().any(|t| t == "deb")
                || !field("Suites")?.split_whitespace().any(release)
            {
                return None;
            }
            let uri = field("URIs")?.split_whitespace().next()?;
            http(uri).then(|| uri.trim_end_matches('/').to_string())
        }),
        _ => None,
    }
}

/// The configured store (`flag`, a command's `--store`, else as every other command
/// resolves it: `file://PATH` and `~/` understood) with the directory on this host where
/// the commands that need files keep them ([`Config::local_dir`]).
pub fn store_and_local_dir(flag: Option<&str>) -> Result<(Config, PathBuf), ConfigError> {
    let cfg = Config::load(&Flags::store(flag))?;
    let dir = cfg.local_dir();
    Ok((cfg, dir))
}

/// The default directory of `key`: `$XDG_…_HOME/<sub>` when that variable (`xdg`) is an
/// absolute path (XDG Base Directory Specification 0.8: a relative one is ignored), else
/// `$HOME/<home_rel>`. Errors: neither is set ([`ConfigError::NoHome`]).
fn xdg_default(
    xdg: Option<String>,
    sub: &str,
    home: Option<&str>,
    home_rel: &str,
    key: &'static str,
) -> Result<PathBuf, ConfigError> {
    match xdg.filter(|x| Path::new(x).is_absolute()) {
        Some(x) => Ok(Path::new(&x).join(sub)),
        None => default_under(home, home_rel, key),
    }
}

fn default_under(home: Option<&str>, rel: &str, key: &'static str) -> Result<PathBuf, ConfigError> {
    let env = match key {
        "store" => "KILN_STORE",
        "serve.state_dir" => "KILN_SERVE_STATE_DIR",
        _ => "KILN_CACHE",
    };
    home.map(|h| Path::new(h).join(rel))
        .ok_or(ConfigError::NoHome { key, env })
}

/// `~/x` → `$HOME/x`; in the file, a relative path is refused (relative to what?).
fn expand(
    key: &'static str,
    value: &str,
    origin: &Origin,
    home: Option<&str>,
) -> Result<PathBuf, ConfigError> {
    let invalid = |reason: &str| ConfigError::Invalid {
        key,
        value: value.to_string(),
        origin: origin.clone(),
        reason: reason.to_string(),
    };
    if value.contains('\0') {
        return Err(invalid("contains a NUL byte"));
    }
    if let Some(rest) = value.strip_prefix("~/") {
        let h = home.ok_or_else(|| invalid("starts with ~/ but HOME is not set"))?;
        return Ok(Path::new(h).join(rest));
    }
    if matches!(origin, Origin::File(_)) && !Path::new(value).is_absolute() {
        return Err(invalid(
            "a path in the config file must be absolute or start with ~/",
        ));
    }
    Ok(PathBuf::from(value))
}

fn check_store(value: String, origin: &Origin, home: Option<&str>) -> Result<String, ConfigError> {
    let invalid = |reason: String| ConfigError::Invalid {
        key: "store",
        value: value.clone(),
        origin: origin.clone(),
        reason,
    };
    match StoreUrl::parse(&value).map_err(|e| invalid(e.to_string()))? {
        StoreUrl::S3 { .. } => Ok(value),
        StoreUrl::Local(p) => {
            let p = p.to_string_lossy();
            let expanded = expand("store", &p, origin, home)?;
            Ok(if value.starts_with("file://") {
                format!("file://{}", expanded.display())
            } else {
                expanded.to_string_lossy().into_owned()
            })
        }
    }
}

fn check_dir(
    key: &'static str,
    value: &str,
    origin: &Origin,
    home: Option<&str>,
) -> Result<PathBuf, ConfigError> {
    if value.is_empty() {
        return Err(ConfigError::Invalid {
            key,
            value: String::new(),
            origin: origin.clone(),
            reason: "empty path".into(),
        });
    }
    expand(key, value, origin, home)
}

/// A whole number of `unit`, 1 to `max`, for setting `key`.
fn parse_whole(
    key: &'static str,
    value: &str,
    origin: &Origin,
    max: u64,
    unit: &str,
) -> Result<u64, ConfigError> {
    match value.trim().parse::<u64>() {
        Ok(n) if n > 0 && n <= max => Ok(n),
        _ => Err(ConfigError::Invalid {
            key,
            value: value.to_string(),
            origin: origin.clone(),
            reason: format!("expected a whole number of {unit}, 1 to {max}"),
        }),
    }
}

fn parse_bool(key: &'static str, value: &str, origin: &Origin) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ConfigError::Invalid {
            key,
            value: value.to_string(),
            origin: origin.clone(),
            reason: "expected true or false".into(),
        }),
    }
}

fn check_log(value: &str, origin: &Origin) -> Result<(), ConfigError> {
    tracing_subscriber::EnvFilter::try_new(value)
        .map(|_| ())
        .map_err(|e| ConfigError::Invalid {
            key: "log",
            value: value.to_string(),
            origin: origin.clone(),
            reason: format!("not a log level or filter: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn resolve(flags: &Flags, env: &[(&str, &str)], file: Option<&str>) -> Config {
        let env = env_of(env);
        let path = config_path(&env);
        Config::resolve(flags, &env, path, file, || None).unwrap()
    }

    #[test]
    fn defaults_live_under_home() {
        let c = resolve(&Flags::default(), &[("HOME", "/home/u")], None);
        assert_eq!(c.store.value, "/home/u/.local/share/kiln/store");
        assert_eq!(c.store.origin, Origin::Default);
        assert_eq!(c.cache.value, Path::new("/home/u/.cache/kiln"));
        assert_eq!(c.cache_max_mib.value, DEFAULT_CACHE_MAX_MIB);
        assert_eq!(c.log.value, "warn");
        assert_eq!(c.s3_endpoint.value, None);
        assert_eq!(
            c.file,
            (PathBuf::from("/home/u/.config/kiln/config.toml"), false)
        );
    }

    #[test]
    fn flag_beats_env_beats_file_beats_default() {
        let file = "store = \"/srv/file-store\"\ncache = \"~/c\"\nlog = \"debug\"\n";
        let env = [("HOME", "/h"), ("KILN_STORE", "/srv/env-store")];
        let c = resolve(&Flags::store(Some("/srv/flag-store")), &env, Some(file));
        assert_eq!(c.store.value, "/srv/flag-store");
        assert_eq!(c.store.origin, Origin::Flag("--store"));

        let c = resolve(&Flags::default(), &env, Some(file));
        assert_eq!(c.store.value, "/srv/env-store");
        assert_eq!(c.store.origin, Origin::Env("KILN_STORE"));

        let c = resolve(&Flags::default(), &[("HOME", "/h")], Some(file));
        assert_eq!(c.store.value, "/srv/file-store");
        assert_eq!(
            c.store.origin,
            Origin::File("/h/.config/kiln/config.toml".into())
        );
        assert_eq!(c.cache.value, Path::new("/h/c"));
        assert_eq!(c.log.value, "debug");

        let c = resolve(
            &Flags {
                verbose: 2,
                ..Flags::default()
            },
            &[("HOME", "/h"), ("KILN_LOG", "info")],
            Some(file),
        );
        assert_eq!(c.log.value, "debug");
        assert_eq!(c.log.origin, Origin::Flag("-vv"));
    }

    #[test]
    fn serve_settings_flag_env_file_default() {
        let c = resolve(&Flags::default(), &[("HOME", "/h")], None);
        assert_eq!(c.serve_listen.value.to_string(), "127.0.0.1:8080");
        assert_eq!(
            c.serve_state_dir.value,
            Path::new("/h/.local/state/kiln/serve")
        );
        let c = resolve(
            &Flags::default(),
            &[("HOME", "/h"), ("KILN_STATE_DIR", "/run/k")],
            None,
        );
        assert_eq!(c.serve_state_dir.value, Path::new("/run/k/serve"));
        let file = "[serve]\nlisten = \"127.0.0.1:9000\"\nstate_dir = \"~/srv\"\n";
        let c = resolve(&Flags::default(), &[("HOME", "/h")], Some(file));
        assert_eq!(c.serve_listen.value.to_string(), "127.0.0.1:9000");
        assert_eq!(c.serve_state_dir.value, Path::new("/h/srv"));
        let env = [("HOME", "/h"), ("KILN_LISTEN", "127.0.0.1:9100")];
        let c = resolve(&Flags::default(), &env, Some(file));
        assert_eq!(c.serve_listen.origin, Origin::Env("KILN_LISTEN"));
        let flags = Flags {
            listen: Some("127.0.0.1:0".into()),
            serve_state_dir: Some("/x".into()),
            ..Flags::default()
        };
        let c = resolve(&flags, &env, Some(file));
        assert_eq!(c.serve_listen.value.to_string(), "127.0.0.1:0");
        assert_eq!(c.serve_state_dir.value, Path::new("/x"));
        assert_eq!(c.serve_database.value, None);
        let env = [
            ("HOME", "/h"),
            ("KILN_SERVE_DATABASE", "postgres://k@127.0.0.1/db"),
        ];
        let c = resolve(&Flags::default(), &env, None);
        assert_eq!(
            c.serve_database.value.as_deref(),
            Some("postgres://k@127.0.0.1/db")
        );
        let env = env_of(&[("HOME", "/h"), ("KILN_SERVE_DATABASE", "mysql://x")]);
        let e = Config::resolve(&Flags::default(), &env, None, None, || None).unwrap_err();
        assert!(e.to_string().contains("serve.database"), "{e}");
        let env = env_of(&[("HOME", "/h"), ("KILN_LISTEN", "localhost")]);
        let e = Config::resolve(&Flags::default(), &env, None, None, || None).unwrap_err();
        assert!(e.to_string().contains("serve.listen"), "{e}");
    }

    #[test]
    fn xdg_and_kiln_config_choose_the_file() {
        let env = env_of(&[("HOME", "/h"), ("XDG_CONFIG_HOME", "/x")]);
        assert_eq!(
            config_path(&env),
            Some(PathBuf::from("/x/kiln/config.toml"))
        );
        // A relative XDG_CONFIG_HOME is ignored, as the spec says.
        let env = env_of(&[("HOME", "/h"), ("XDG_CONFIG_HOME", "rel")]);
        assert_eq!(
            config_path(&env),
            Some(PathBuf::from("/h/.config/kiln/config.toml"))
        );
        let env = env_of(&[("HOME", "/h"), ("KILN_CONFIG", "/etc/kiln.toml")]);
        assert_eq!(config_path(&env), Some(PathBuf::from("/etc/kiln.toml")));
        let c = resolve(
            &Flags::default(),
            &[("HOME", "/h"), ("XDG_CACHE_HOME", "/xc")],
            None,
        );
        assert_eq!(c.cache.value, Path::new("/xc/kiln"));
        // The store follows XDG_DATA_HOME (issue 36: a rootless user's store), the serve
        // state XDG_STATE_HOME; relative values are ignored.
        let c = resolve(
            &Flags::default(),
            &[
                ("HOME", "/h"),
                ("XDG_DATA_HOME", "/xd"),
                ("XDG_STATE_HOME", "/xs"),
            ],
            None,
        );
        assert_eq!(c.store.value, "/xd/kiln/store");
        assert_eq!(c.serve_state_dir.value, Path::new("/xs/kiln/serve"));
        let c = resolve(
            &Flags::default(),
            &[
                ("HOME", "/h"),
                ("XDG_DATA_HOME", "xd"),
                ("XDG_STATE_HOME", "xs"),
            ],
            None,
        );
        assert_eq!(c.store.value, "/h/.local/share/kiln/store");
        assert_eq!(
            c.serve_state_dir.value,
            Path::new("/h/.local/state/kiln/serve")
        );
    }

    #[test]
    fn s3_settings_reach_the_store_options() {
        let file = "store = \"s3://bucket/prefix\"\ncache_max_mib = 5\n[s3]\nendpoint = \"http://127.0.0.1:9000\"\nallow_http = true\n";
        let c = resolve(
            &Flags::default(),
            &[("HOME", "/h"), ("KILN_S3_REGION", "eu-west-1")],
            Some(file),
        );
        let o = c.store_options();
        assert_eq!(o.s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(o.s3.region.as_deref(), Some("eu-west-1"));
        assert_eq!(o.s3.allow_http, Some(true));
        assert_eq!(
            o.read_cache,
            Some((PathBuf::from("/h/.cache/kiln/chunks"), 5 << 20))
        );
        // A local store needs no read cache.
        let c = resolve(&Flags::store(Some("/tmp/s")), &[("HOME", "/h")], None);
        assert_eq!(c.store_options().read_cache, None);
    }

    /// Issue 17, fault 4: the attempts, the bound on one store operation and the S3 request
    /// timeout are settings (env, file, default), and reach the store's retry policy.
    #[test]
    fn store_retry_settings_reach_the_store_options() {
        let c = resolve(&Flags::default(), &[("HOME", "/h")], None);
        assert_eq!(
            (
                c.store_attempts.value,
                c.store_timeout_secs.value,
                c.s3_request_timeout_secs.value
            ),
            (6, 300, 30)
        );
        assert_eq!(c.store_timeout_secs.origin, Origin::Default);
        let o = c.store_options();
        assert_eq!(o.retry.max_attempts, retry::DEFAULT_MAX_ATTEMPTS);
        assert_eq!(o.retry.operation_timeout, retry::DEFAULT_OPERATION_TIMEOUT);
        assert_eq!(o.s3.request_timeout, Some(Duration::from_secs(30)));

        let file = "store_attempts = 3\nstore_timeout_secs = 40\n[s3]\nrequest_timeout_secs = 7\n";
        let c = resolve(&Flags::default(), &[("HOME", "/h")], Some(file));
        let o = c.store_options();
        assert_eq!(o.retry.max_attempts, 3);
        assert_eq!(o.retry.operation_timeout, Duration::from_secs(40));
        assert_eq!(o.s3.request_timeout, Some(Duration::from_secs(7)));
        assert!(matches!(c.store_timeout_secs.origin, Origin::File(_)));

        let env = [
            ("HOME", "/h"),
            ("KILN_STORE_ATTEMPTS", "2"),
            ("KILN_STORE_TIMEOUT_SECS", "5"),
            ("KILN_S3_REQUEST_TIMEOUT_SECS", "1"),
        ];
        let c = resolve(&Flags::default(), &env, Some(file));
        assert_eq!(
            c.store_timeout_secs.origin,
            Origin::Env("KILN_STORE_TIMEOUT_SECS")
        );
        let o = c.store_options();
        assert_eq!(o.retry.max_attempts, 2);
        assert_eq!(o.retry.operation_timeout, Duration::from_secs(5));
        assert_eq!(o.s3.request_timeout, Some(Duration::from_secs(1)));
        let shown: Vec<_> = c.entries().into_iter().map(|(k, v, _)| (k, v)).collect();
        for (k, v) in [
            ("store_attempts", "2"),
            ("store_timeout_secs", "5"),
            ("s3.request_timeout_secs", "1"),
        ] {
            assert!(shown.contains(&(k, Some(v.to_string()))), "{k}: {shown:?}");
        }

        for (var, bad) in [
            ("KILN_STORE_TIMEOUT_SECS", "0"),
            ("KILN_STORE_TIMEOUT_SECS", "1.5"),
            ("KILN_STORE_ATTEMPTS", "101"),
            ("KILN_S3_REQUEST_TIMEOUT_SECS", "soon"),
        ] {
            let pairs = [("HOME", "/h"), (var, bad)];
            let env = env_of(&pairs);
            let e = Config::resolve(&Flags::default(), &env, None, None, || None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(var) && e.contains("whole number"), "{e}");
        }
    }

    /// Issue 18: the chunk server's reads are bounded below the clones' restore timeout
    /// (`lazy_read_timeout_secs`), one S3 request by a third of that, and a bound at or above
    /// the restore timeout is refused.
    #[test]
    fn lazy_read_timeout_bounds_the_chunk_servers_store_options() {
        let c = resolve(&Flags::default(), &[("HOME", "/h")], None);
        assert_eq!(
            c.lazy_read_timeout_secs.value,
            DEFAULT_LAZY_READ_TIMEOUT_SECS
        );
        let o = c.lazy_store_options();
        assert_eq!(o.retry.operation_timeout, Duration::from_secs(20));
        assert_eq!(o.s3.request_timeout, Some(Duration::from_secs(20) / 3));
        assert_eq!(o.retry.max_attempts, retry::DEFAULT_MAX_ATTEMPTS);
        // The ordinary commands keep theirs.
        assert_eq!(
            c.store_options().retry.operation_timeout,
            retry::DEFAULT_OPERATION_TIMEOUT
        );
        let env = [("HOME", "/h"), ("KILN_LAZY_READ_TIMEOUT_SECS", "3")];
        let c = resolve(&Flags::default(), &env, None);
        let o = c.lazy_store_options();
        assert_eq!(o.retry.operation_timeout, Duration::from_secs(3));
        assert_eq!(o.s3.request_timeout, Some(Duration::from_secs(1)));
        // A shorter store_timeout_secs and s3.request_timeout_secs still win.
        let file = "store_timeout_secs = 2\n[s3]\nrequest_timeout_secs = 1\n";
        let c = resolve(&Flags::default(), &[("HOME", "/h")], Some(file));
        let o = c.lazy_store_options();
        assert_eq!(o.retry.operation_timeout, Duration::from_secs(2));
        assert_eq!(o.s3.request_timeout, Some(Duration::from_secs(2) / 3));
        for bad in ["0", "60", "600"] {
            let pairs = [("HOME", "/h"), ("KILN_LAZY_READ_TIMEOUT_SECS", bad)];
            let env = env_of(&pairs);
            let e = Config::resolve(&Flags::default(), &env, None, None, || None)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("lazy_read_timeout_secs") && e.contains("1 to 59"),
                "{e}"
            );
        }
    }

    /// Issue 19 (replacing issue 17's item 7, which refused an S3 store): every command
    /// takes `--store s3://…` and `KILN_STORE=s3://…`; its files live under the cache
    /// directory, one directory per store URL, never in a local directory called `s3:`.
    #[test]
    fn an_s3_store_keeps_its_files_under_the_cache_by_url() {
        let home = [("HOME", "/h")];
        let s3 = [("HOME", "/h"), ("KILN_STORE", "s3://bucket/prefix")];
        let mut dirs = Vec::new();
        for (flags, env) in [
            (Flags::store(Some("s3://bucket/prefix")), &home[..]),
            (Flags::default(), &s3[..]),
        ] {
            let c = resolve(&flags, env, None);
            assert_eq!(c.store.value, "s3://bucket/prefix");
            let d = c.local_dir();
            assert!(d.starts_with("/h/.cache/kiln/stores"), "{}", d.display());
            dirs.push(d);
        }
        assert_eq!(dirs[0], dirs[1], "one store, one directory");
        let other = resolve(&Flags::store(Some("s3://bucket/other")), &home, None);
        assert_ne!(
            other.local_dir(),
            dirs[0],
            "another store, another directory"
        );
        let c = resolve(&Flags::store(Some("file:///srv/s")), &home, None);
        assert_eq!(c.local_dir(), PathBuf::from("/srv/s"));
        let c = resolve(
            &Flags::default(),
            &[("HOME", "/h"), ("KILN_STORE", "~/s")],
            None,
        );
        assert_eq!(c.local_dir(), PathBuf::from("/h/s"));
    }

    #[test]
    fn bad_input_is_refused_with_its_origin() {
        let env = env_of(&[("HOME", "/h")]);
        let path = config_path(&env);
        let err = |flags: &Flags, env: &dyn Fn(&str) -> Option<String>, text: Option<&str>| {
            Config::resolve(flags, env, path.clone(), text, || None)
                .unwrap_err()
                .to_string()
        };
        let f = Flags::default();
        // Unknown key (a typo), wrong type, not TOML at all.
        assert!(err(&f, &env, Some("stor = \"/x\"")).contains("unknown field"));
        assert!(err(&f, &env, Some("cache_max_mib = \"lots\"")).contains("config.toml"));
        assert!(err(&f, &env, Some("store = [")).contains("config file"));
        assert!(err(&f, &env, Some("[s3]\nsecret_access_key = \"x\"")).contains("unknown field"));
        // Relative paths in the file; unknown schemes anywhere.
        let e = err(&f, &env, Some("store = \"rel/store\""));
        assert!(e.contains("must be absolute"), "{e}");
        let e = err(&Flags::store(Some("ftp://x/y")), &env, None);
        assert!(
            e.contains("flag --store") && e.contains("unknown scheme"),
            "{e}"
        );
        let bad_env = env_of(&[("HOME", "/h"), ("KILN_CACHE_MAX_MIB", "-3")]);
        let e = err(&f, &bad_env, None);
        assert!(e.contains("env KILN_CACHE_MAX_MIB"), "{e}");
        let bad_env = env_of(&[("HOME", "/h"), ("KILN_S3_ALLOW_HTTP", "perhaps")]);
        assert!(err(&f, &bad_env, None).contains("true or false"));
        let bad_env = env_of(&[("HOME", "/h"), ("KILN_S3_ENDPOINT", "127.0.0.1:9000")]);
        assert!(err(&f, &bad_env, None).contains("http://"));
        let bad_env = env_of(&[("HOME", "/h"), ("KILN_LOG", "kiln=loud[")]);
        assert!(err(&f, &bad_env, None).contains("log"));
        // No HOME and nothing set: the error says what to set.
        let e = err(&f, &env_of(&[]), None);
        assert!(e.contains("KILN_STORE"), "{e}");
    }

    #[test]
    fn bootstrap_mirror_from_env_file_or_apt() {
        let c = resolve(&Flags::default(), &[("HOME", "/h")], None);
        assert_eq!(c.bootstrap_mirror.value, None);
        let env = env_of(&[("HOME", "/h")]);
        let c = Config::resolve(&Flags::default(), &env, None, None, || {
            Some("http://archive.example/debian".into())
        })
        .unwrap();
        assert_eq!(
            c.bootstrap_mirror.value.as_deref(),
            Some("http://archive.example/debian")
        );
        let c = resolve(
            &Flags::default(),
            &[
                ("HOME", "/h"),
                ("KILN_BOOTSTRAP_MIRROR", "https://m.example/d/"),
            ],
            Some("bootstrap_mirror = \"http://f.example/d\""),
        );
        assert_eq!(
            c.bootstrap_mirror.value.as_deref(),
            Some("https://m.example/d")
        );
        assert_eq!(
            c.bootstrap_mirror.origin,
            Origin::Env("KILN_BOOTSTRAP_MIRROR")
        );
        let bad = env_of(&[("HOME", "/h"), ("KILN_BOOTSTRAP_MIRROR", "ftp://x")]);
        assert!(Config::resolve(&Flags::default(), &bad, None, None, || None).is_err());
    }

    #[test]
    fn apt_sources_formats() {
        let deb822 = "Types: deb\nURIs: http://a.example/debian-security\nSuites: bookworm-security\n\n\
                      Types: deb-src deb\nURIs: http://a.example/debian/ http://b.example/\n\
                      Suites: bookworm bookworm-updates\nComponents: main\n";
        assert_eq!(
            apt_mirror_in("sources", deb822).as_deref(),
            Some("http://a.example/debian")
        );
        let disabled = "Enabled: no\nTypes: deb\nURIs: http://a.example/d\nSuites: bookworm\n";
        assert_eq!(apt_mirror_in("sources", disabled), None);
        let list = "# comment\ndeb-src http://s.example/d bookworm main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://x.example/d bookworm-backports main\n\
                    deb [arch=amd64] http://x.example/debian/ bookworm main # trailing\n";
        assert_eq!(
            apt_mirror_in("list", list).as_deref(),
            Some("http://x.example/debian")
        );
        assert_eq!(
            apt_mirror_in("list", "deb file:/cdrom bookworm main\n"),
            None
        );
        assert_eq!(apt_mirror_in("disabled", list), None);
    }

    #[test]
    fn oversized_file_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.toml");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(1 << 40).unwrap(); // sparse: costs nothing on disk
        let e = read_file(&p).unwrap_err();
        assert!(matches!(e, ConfigError::TooLarge { .. }), "{e}");
        assert_eq!(read_file(&dir.path().join("absent")).unwrap(), None);
    }
}
