//! The grammar of `kiln build`'s flags that name things outside the build, in buildx's
//! spellings (`docker buildx build --build-arg`, `--secret`, `--ssh`, `--build-context`): the
//! CLI reads them here and gives the builder typed values (build args, [`SecretSpec`], agent
//! sockets, [`LayoutRef`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_builder::layout::LayoutRef;
use kiln_builder::secrets::{SecretSource, SecretSpec};

/// The build argument that sets the build's timestamps (reproducible-builds.org's
/// `SOURCE_DATE_EPOCH`, decimal Unix seconds).
pub const SOURCE_DATE_EPOCH: &str = "SOURCE_DATE_EPOCH";

/// The build args of `--build-arg` values (`kiln build`, `kiln plan`), NAME → value, as
/// `docker buildx build` makes them: `NAME=VALUE` sets NAME (a later one of the same name
/// wins), `NAME` alone takes the value of the caller's environment variable NAME and is left
/// out when it is not set. Then, as buildx does (`toControllerOptions` in its
/// `commands/build.go`), a `SOURCE_DATE_EPOCH` set and not empty in the environment is taken
/// as `--build-arg SOURCE_DATE_EPOCH` when no `--build-arg` gave that name: an explicit one
/// wins. `env` reads the caller's environment (a variable that is not set, or not UTF-8:
/// `None`).
///
/// The value is not checked here: the recipe's lowering refuses one that is not Unix
/// seconds, with the same error whichever way it came
/// ([`kiln_recipes::plan::parse_source_date_epoch`]).
pub fn parse_build_args(
    flags: &[String],
    env: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for a in flags {
        match a.split_once('=') {
            Some((k, v)) => {
                out.insert(k.to_string(), v.to_string());
            }
            None => {
                if let Some(v) = env(a) {
                    out.insert(a.clone(), v);
                }
            }
        }
    }
    if !out.contains_key(SOURCE_DATE_EPOCH)
        && let Some(v) = env(SOURCE_DATE_EPOCH).filter(|v| !v.is_empty())
    {
        out.insert(SOURCE_DATE_EPOCH.to_string(), v);
    }
    out
}

/// Reads one `--secret` value (buildx's spelling, `docker buildx build --secret`):
/// comma-separated `key=value` pairs, `id=ID` (required), then either `src=PATH` (also
/// `source=PATH`: the secret is the file's bytes) or `env=VAR` (the secret is that
/// environment variable of the caller), optionally `type=file|env`. As buildx does,
/// `type=file` without `src` reads the file named by the id, and `type=env` without `env`
/// the variable named by the id.
///
/// Errors: `--secret "<value>": <what is wrong>`.
pub fn parse_secret_flag(flag: &str) -> anyhow::Result<SecretSpec> {
    let bad = |reason: &str| anyhow::anyhow!("--secret {flag:?}: {reason}");
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
) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    use std::os::unix::fs::FileTypeExt;
    let mut out = BTreeMap::new();
    for flag in flags {
        let bad = |reason: String| anyhow::anyhow!("--ssh {flag:?}: {reason}");
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

/// Reads `--build-context NAME=oci-layout://DIR[:TAG]`, buildx's form, of which kiln takes
/// OCI layouts only (a digest-pinned `DIR@sha256:…` too is refused).
///
/// Errors: a value of another form, naming it and the form expected.
pub fn parse_build_context(s: &str) -> anyhow::Result<(String, LayoutRef)> {
    let bad =
        || anyhow::anyhow!("invalid --build-context {s:?}: expected NAME=oci-layout://DIR[:TAG]");
    let (name, value) = s.split_once('=').ok_or_else(bad)?;
    let rest = value.strip_prefix("oci-layout://").ok_or_else(bad)?;
    if name.is_empty() || rest.contains('@') {
        return Err(bad());
    }
    let layout = LayoutRef::from_dir_and_tag(rest).ok_or_else(bad)?;
    Ok((name.to_string(), layout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_args_take_source_date_epoch_from_the_environment_unless_given() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |n: &str| {
                vars.iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            }
        };
        let args = |f: &[&str]| {
            let flags: Vec<String> = f.iter().map(|s| s.to_string()).collect();
            move |vars| parse_build_args(&flags, env(vars))
        };
        let map = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // docker's grammar: NAME=VALUE, a later one wins, NAME alone from the environment.
        assert_eq!(
            args(&["A=1", "B=x=y", "A=2", "HOME", "UNSET"])(&[("HOME", "/root")]),
            map(&[("A", "2"), ("B", "x=y"), ("HOME", "/root")])
        );
        // The environment's SOURCE_DATE_EPOCH, as buildx takes it.
        assert_eq!(
            args(&["A=1"])(&[("SOURCE_DATE_EPOCH", "1700000000")]),
            map(&[("A", "1"), ("SOURCE_DATE_EPOCH", "1700000000")])
        );
        // An explicit --build-arg wins, whatever its value (checked later, by the lowering).
        for (given, want) in [
            ("SOURCE_DATE_EPOCH=1600000000", "1600000000"),
            ("SOURCE_DATE_EPOCH=", ""),
            ("SOURCE_DATE_EPOCH", "1700000000"),
        ] {
            assert_eq!(
                args(&[given])(&[("SOURCE_DATE_EPOCH", "1700000000")]),
                map(&[("SOURCE_DATE_EPOCH", want)]),
                "{given}"
            );
        }
        // Not set, or set empty (buildx ignores an empty one): no SOURCE_DATE_EPOCH.
        assert_eq!(args(&[])(&[]), map(&[]));
        assert_eq!(args(&[])(&[("SOURCE_DATE_EPOCH", "")]), map(&[]));
        // An invalid value is passed on as it is, for the lowering to refuse.
        assert_eq!(
            args(&[])(&[("SOURCE_DATE_EPOCH", "yesterday")]),
            map(&[("SOURCE_DATE_EPOCH", "yesterday")])
        );
    }

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
    fn build_contexts() {
        let (name, l) = parse_build_context("base=oci-layout:///srv/l:bookworm").expect("ok");
        assert_eq!(name, "base");
        assert_eq!(l.dir, std::path::Path::new("/srv/l"));
        assert_eq!(l.tag.as_deref(), Some("bookworm"));
        for bad in [
            "base=docker-image://x",
            "=oci-layout:///x",
            "b=oci-layout:///x@sha256:00",
            "b=oci-layout://",
            "b",
        ] {
            let e = parse_build_context(bad).expect_err(bad).to_string();
            assert!(e.contains("expected NAME=oci-layout://DIR[:TAG]"), "{e}");
        }
    }
}

/// `--layer-compression`: how an image's layers leave kiln (`kiln export --format oci`,
/// `kiln push`).
#[derive(Debug, Clone, Copy, Default, clap::ValueEnum)]
pub enum LayerCompressionArg {
    /// zstd layers (what kiln builds write) gzipped, under a manifest of their own: what
    /// every OCI consumer reads (umoci 0.4 and Docker before 23 read no zstd).
    #[default]
    Gzip,
    /// The layers as the image has them, under the manifest digest the build reported: for
    /// consumers that read zstd (Docker 23+, containerd 1.5+, podman, skopeo).
    AsBuilt,
}

impl From<LayerCompressionArg> for kiln_builder::layout::LayerCompression {
    fn from(a: LayerCompressionArg) -> Self {
        match a {
            LayerCompressionArg::Gzip => Self::Gzip,
            LayerCompressionArg::AsBuilt => Self::AsBuilt,
        }
    }
}
