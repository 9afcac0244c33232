//! The grammar of `kiln build`'s flags that name things outside the build, in buildx's
//! spellings (`docker buildx build --secret`, `--ssh`, `--build-context`): the CLI reads them
//! here and gives the builder typed values ([`SecretSpec`], agent sockets, [`LayoutRef`]).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_builder::layout::LayoutRef;
use kiln_builder::secrets::{SecretSource, SecretSpec};

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
