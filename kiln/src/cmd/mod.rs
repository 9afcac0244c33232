//! Subcommands, one file each, plus what they share: output ([`Out`]: text or JSON lines),
//! opening a store, and the exit codes ([`exit`]).

pub mod build;
pub mod common;
pub mod config;
pub mod exec;
pub mod export;
pub mod flags;
pub mod images;
pub mod import;
pub mod inspect;
pub mod kernel;
pub mod lazy_serve;
pub mod login;
pub mod nightly;
pub mod plan;
pub mod progress;
pub mod ps;
pub mod pull;
pub mod push;
pub mod rmi;
pub mod serve;
pub mod snapshot;
pub mod start;
pub mod stop;
pub mod store;
pub mod tag;
pub mod tags;
pub mod unpack;
pub mod untag;

use std::process::ExitCode;

use kiln_store::{StoreError, TagError};
use serde_json::{Value, json};

/// Exit codes of every `kiln` subcommand.
///
/// | code | meaning |
/// | ---: | --- |
/// | 0 | success |
/// | 1 | failure (I/O, network, corrupt data, invalid input) |
/// | 2 | command-line usage error (clap) |
/// | 3 | `kiln store verify` found damage (missing or corrupt objects, broken tags) |
/// | 4 | a tag moved under us: a compare-and-swap lost to another writer (retry may succeed) |
/// | 5 | the tag or manifest asked for does not exist |
/// | 6 | the configuration is invalid (config file unreadable or malformed, a bad `KILN_*` value) |
/// | 7 | this host cannot restore the snapshot: its compatibility key differs (the snapshot is kept) |
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// Any other failure.
    pub const FAILURE: u8 = 1;
    /// `kiln store verify` found damage.
    pub const DAMAGED: u8 = 3;
    /// A tag compare-and-swap lost.
    pub const STALE: u8 = 4;
    /// The tag or manifest does not exist.
    pub const NOT_FOUND: u8 = 5;
    /// The configuration is invalid.
    pub const CONFIG: u8 = 6;
    /// The snapshot's compatibility key differs from this host's
    /// ([`kiln_vmm::compat::CompatError::Mismatch`]).
    pub const INCOMPATIBLE: u8 = 7;
}

/// A failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    /// The exit code (see [`exit`]).
    pub code: u8,
    /// What went wrong.
    pub error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        let error = e.into();
        // A store error, or one the pipeline met while tagging or holding its lease.
        let store = error.downcast_ref::<StoreError>().or_else(|| {
            match error.downcast_ref::<kiln_pipeline::PipelineError>()? {
                kiln_pipeline::PipelineError::Tag { source, .. }
                | kiln_pipeline::PipelineError::Store(source) => Some(&**source),
                _ => None,
            }
        });
        let code = match store {
            Some(StoreError::Tag(TagError::Stale { .. })) => exit::STALE,
            Some(StoreError::Tag(TagError::NotFound { .. } | TagError::MissingManifest { .. })) => {
                exit::NOT_FOUND
            }
            _ if error.is::<crate::config::ConfigError>() => exit::CONFIG,
            _ if error.chain().any(|e| {
                matches!(
                    e.downcast_ref::<kiln_vmm::compat::CompatError>(),
                    Some(kiln_vmm::compat::CompatError::Mismatch { .. })
                )
            }) =>
            {
                exit::INCOMPATIBLE
            }
            _ => exit::FAILURE,
        };
        Failure { code, error }
    }
}

/// What a subcommand returns.
pub type CmdResult = Result<(), Failure>;

/// Where results go: text on stdout (messages on stderr), or JSON lines on stdout.
#[derive(Debug, Clone, Copy)]
pub struct Out {
    /// `--json` was given.
    pub json: bool,
}

impl Out {
    /// Output in the mode `--json` asks for.
    pub fn new(json: bool) -> Self {
        Self { json }
    }

    /// Emits one event: in JSON mode `{"event": kind, ...fields}` on one stdout line, else
    /// `text` (when not empty) on stdout.
    pub fn event(&self, kind: &str, fields: Value, text: impl FnOnce() -> String) {
        if self.json {
            let mut obj = serde_json::Map::new();
            obj.insert("event".into(), Value::String(kind.into()));
            if let Value::Object(m) = fields {
                obj.extend(m);
            }
            println!("{}", Value::Object(obj));
        } else {
            let t = text();
            if !t.is_empty() {
                println!("{t}");
            }
        }
    }
}

/// Runs a subcommand on a tokio runtime and turns its result into the exit code, printing a
/// failure as `kiln: <error chain>` on stderr (and as an `error` event with `--json`).
pub fn run<F>(out: &Out, f: F) -> ExitCode
where
    F: AsyncFnOnce(&Out) -> CmdResult,
{
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kiln: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    finish(out, rt.block_on(f(out)))
}

/// Turns the result of a subcommand that runs its own runtime into the exit code, printing a
/// failure as [`run`] does.
pub fn report(out: &Out, r: anyhow::Result<()>) -> ExitCode {
    finish(out, r.map_err(Failure::from))
}

/// Turns the result of a synchronous subcommand into the exit code, printing a failure as
/// [`run`] does.
pub fn report_cmd(out: &Out, r: CmdResult) -> ExitCode {
    finish(out, r)
}

fn finish(out: &Out, r: CmdResult) -> ExitCode {
    match r {
        Ok(()) => ExitCode::from(exit::OK),
        Err(Failure { code, error }) => {
            let msg = one_line(&error);
            if out.json {
                out.event("error", json!({"code": code, "message": msg}), String::new);
            }
            eprintln!("kiln: {msg}");
            ExitCode::from(code)
        }
    }
}

/// An error and its causes on one line, `what: why: why…`, as anyhow's `{:#}` prints them,
/// except that a cause whose text the line already holds is not said again (many errors
/// include their source in their own message, `writing X: No space left on device`).
pub fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

/// Opens the store `url` (a `--store` flag), else the configured one (`$KILN_STORE`, else the
/// config file's `store`, else `~/.local/share/kiln/store`; see [`crate::config`]), with the
/// configured retry policy, S3 settings and read cache. Every retry of an operation on it is
/// a warning on stderr (the store logs it) and, with `--json`, a `retry` event on stdout
/// ([`progress::retry_observer`]).
pub async fn open_store(out: &Out, url: Option<&str>) -> Result<kiln_store::Store, Failure> {
    let cfg = crate::config::Config::load(&crate::config::Flags::store(url))?;
    open_configured(out, &cfg).await
}

/// [`open_store`], with the directory on this host where the commands that need files keep
/// them ([`crate::config::Config::local_dir`]: the store's own directory, or the cache of an
/// S3 store's blobs).
pub async fn open_store_and_local_dir(
    out: &Out,
    url: Option<&str>,
) -> Result<(kiln_store::Store, std::path::PathBuf), Failure> {
    let (cfg, dir) = crate::config::store_and_local_dir(url)?;
    Ok((open_configured(out, &cfg).await?, dir))
}

async fn open_configured(
    out: &Out,
    cfg: &crate::config::Config,
) -> Result<kiln_store::Store, Failure> {
    open_with_options(out, cfg, cfg.store_options()).await
}

/// Opens the configured store with `options` (derived from the same configuration, such as
/// [`crate::config::Config::lazy_store_options`]), its retries reported to `out`.
pub async fn open_with_options(
    out: &Out,
    cfg: &crate::config::Config,
    options: kiln_store::StoreOptions,
) -> Result<kiln_store::Store, Failure> {
    let store = kiln_store::Store::open_with(&cfg.store.value, options).await?;
    store
        .backend()
        .set_observer(progress::retry_observer(out, None));
    Ok(store)
}

/// Opens a store that must already exist, for commands that only read or maintain one
/// (`tags`, `untag`, `store verify`, `store gc`, `store export`, the source of a copy). A
/// local directory named explicitly (`--store`, `$KILN_STORE` or the config file; a path or
/// `file://PATH`) that does not exist is refused with exit code 5 instead of being created
/// empty, so a mistyped store cannot pass for an empty, healthy store. Remote stores and the
/// default local store open as with [`open_store`].
pub async fn open_existing_store(
    out: &Out,
    url: Option<&str>,
) -> Result<kiln_store::Store, Failure> {
    let cfg = crate::config::Config::load(&crate::config::Flags::store(url))?;
    if cfg.store.origin != crate::config::Origin::Default
        && let kiln_store::StoreUrl::Local(p) = kiln_store::StoreUrl::parse(&cfg.store.value)?
        && !p.is_dir()
    {
        return Err(Failure {
            code: exit::NOT_FOUND,
            error: anyhow::anyhow!(
                "no store at {} (from {}): the directory does not exist (commands that \
                 write, such as `kiln store import` or `kiln pull`, create it)",
                p.display(),
                cfg.store.origin
            ),
        });
    }
    open_configured(out, &cfg).await
}

/// A lease id unique to this process and moment: `<what>-<host>-<pid>-<nanos>`, within the
/// store's key grammar.
pub fn lease_id(what: &str) -> String {
    let host: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{what}-{host}-{}-{nanos}", std::process::id())
}

/// Parses a duration: a number followed by `s`, `m`, `h` or `d` (`90s`, `30m`, `1h`, `14d`);
/// a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (examples: 90s, 30m, 1h, 14d)"))?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("invalid duration unit in {s:?} (use s, m, h or d)")),
    };
    n.checked_mul(mult)
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 17, fault 3: `writing a layer from …: No space left on device (os error 28)` was
    /// followed by the same cause again, from the error chain.
    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        #[derive(Debug, thiserror::Error)]
        #[error("writing {path}: {source}")]
        struct Says {
            path: &'static str,
            source: std::io::Error,
        }
        let e = anyhow::Error::from(Says {
            path: "/s/upper",
            source: std::io::Error::from_raw_os_error(28),
        });
        assert_eq!(
            one_line(&e),
            "writing /s/upper: No space left on device (os error 28)"
        );
        assert_eq!(format!("{e:#}").matches("os error 28").count(), 2);
        // A cause that adds something is kept, as `{:#}` keeps it.
        let e = anyhow::Error::from(std::io::Error::from_raw_os_error(28)).context("put chunk");
        assert_eq!(
            one_line(&e),
            "put chunk: No space left on device (os error 28)"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90").unwrap().as_secs(), 90);
        assert_eq!(parse_duration("0s").unwrap().as_secs(), 0);
        assert_eq!(parse_duration("30m").unwrap().as_secs(), 1800);
        assert_eq!(parse_duration("1h").unwrap().as_secs(), 3600);
        assert_eq!(parse_duration("14d").unwrap().as_secs(), 14 * 86400);
        for bad in [
            "",
            "h",
            "1x",
            "-1s",
            "1.5h",
            "99999999999999999999d",
            "1h30m",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
