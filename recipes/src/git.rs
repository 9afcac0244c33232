//! Git sources of `ADD` (`ADD https://host/x.git#ref:subdir /dst`): which sources are git
//! repositories, and their remote, ref and subdirectory.
//!
//! The rules are BuildKit's (`util/gitutil/git_url.go`, `util/sshutil/scpurl.go`,
//! `frontend/dockerfile/dfgitutil/git_ref.go`), read, not copied:
//! - `<scheme>://…` with scheme `http` or `https` is a git source when its path (before `?`
//!   and `#`) ends in `.git`; otherwise it is a plain URL. `git://…` and `ssh://…` are
//!   always git sources.
//! - `user@host:path` (scp-like, `[A-Za-z0-9-_]+@[A-Za-z0-9-.]+:`) is a git source over ssh.
//!   It has no port: ssh's 22.
//! - The fragment is `ref[:subdir]`: the ref is a branch, tag or commit; the subdirectory
//!   is taken from the checkout.
//!
//! kiln is stricter than BuildKit where a tenant's recipe could make the host's `git` do
//! more than fetch over the network ([`GitRefError`]): a `<transport>::<address>` source
//! (`ext::sh -c …` runs a command), `file://` and other schemes, a ref or subdirectory
//! starting with `-` (read as an option), a ref git would not accept as a name, a `..`
//! component in the subdirectory (BuildKit cleans it away silently), user information in
//! the URL, and BuildKit's `?ref=…` query options (not supported yet; the fragment form
//! says the same). Over ssh, where git hands `[user@]host` and the path to `ssh` and the
//! remote shell, a user name or host starting with `-` (read by `ssh` as an option, e.g.
//! `-oProxyCommand=…`), a user name of other characters than `[A-Za-z0-9._-]`, a password
//! (`ssh://user:pass@…`) and a scp-like path starting with `-` are refused too.

/// How a git source is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GitScheme {
    /// `http://`.
    Http,
    /// `https://`.
    Https,
    /// `git://` (the git daemon protocol, port 9418).
    Git,
    /// `ssh://` or `user@host:path`.
    Ssh,
}

impl GitScheme {
    /// The default port.
    pub fn default_port(self) -> u16 {
        match self {
            GitScheme::Http => 80,
            GitScheme::Https => 443,
            GitScheme::Git => 9418,
            GitScheme::Ssh => 22,
        }
    }
}

/// A parsed git source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GitRef {
    /// The scheme.
    pub scheme: GitScheme,
    /// The URL git is given: the source without its fragment.
    pub remote: String,
    /// Host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// The port, as written or the scheme's default.
    pub port: u16,
    /// The ssh user name (`git` of `git@host:path`, `ssh://git@host/…`); `None` for the
    /// other schemes and for `ssh://host/…` (ssh's default, the local user's name).
    pub user: Option<String>,
    /// The ref (`#ref`): branch, tag or commit; `None`: the remote's `HEAD`.
    pub reference: Option<String>,
    /// The subdirectory (`#ref:subdir`), `/`-separated, without `.` or empty components;
    /// `None`: the whole repository.
    pub subdir: Option<String>,
}

/// Why a source that names a git repository (or another transport) is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_text}: {reason}")]
pub struct GitRefError {
    /// The source as written.
    pub source_text: String,
    /// What is wrong.
    pub reason: String,
}

impl GitRef {
    /// Parses `src` (an `ADD` source after substitution). `Ok(None)`: not a git source (a
    /// path, or a plain `http(s)` URL). Errors: [`GitRefError`] for a git source kiln
    /// refuses, and for transports and schemes `ADD` never fetches from.
    pub fn parse(src: &str) -> Result<Option<GitRef>, GitRefError> {
        let err = |reason: String| GitRefError {
            source_text: src.to_string(),
            reason,
        };
        // `<transport>::<address>`: git's remote helpers (`ext::` runs a command, `fd::`
        // uses the host's descriptors).
        if let Some((t, _)) = src.split_once("::")
            && !t.is_empty()
            && t.starts_with(|c: char| c.is_ascii_alphabetic())
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
        {
            return Err(err(format!(
                "git transport '{t}::' is not supported: ADD fetches git repositories over \
                 https, http, git:// and ssh only"
            )));
        }
        let proto = src
            .split_once("://")
            .map(|(s, _)| s)
            .filter(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric()));
        let (scheme, rest) = match proto {
            Some(p) => {
                let rest = &src[p.len() + 3..];
                let scheme = match p.to_ascii_lowercase().as_str() {
                    "http" => GitScheme::Http,
                    "https" => GitScheme::Https,
                    "git" => GitScheme::Git,
                    "ssh" => GitScheme::Ssh,
                    "file" => {
                        return Err(err("file:// URLs are not fetched: a build reads the \
                                        host's files only through its build context"
                            .into()));
                    }
                    other => {
                        return Err(err(format!(
                            "URL scheme '{other}' is not supported: ADD fetches http and https \
                             URLs, and git repositories over https, http, git:// and ssh"
                        )));
                    }
                };
                if matches!(scheme, GitScheme::Http | GitScheme::Https) {
                    let path_end = rest.find(['?', '#']).unwrap_or(rest.len());
                    let authority_end = rest[..path_end].find('/').unwrap_or(path_end);
                    if !rest[authority_end..path_end].ends_with(".git") {
                        return Ok(None);
                    }
                }
                (scheme, rest)
            }
            None => match scp_like(src) {
                Some(_) => (GitScheme::Ssh, src),
                None => return Ok(None),
            },
        };
        let (before, fragment) = match src.split_once('#') {
            Some((b, f)) => (b, Some(f)),
            None => (src, None),
        };
        if before.contains('?') {
            return Err(err(
                "query options in a git URL (?ref=, ?subdir=, ...) are not supported: write \
                 #ref:subdir"
                    .into(),
            ));
        }
        let (host, port, user) = if scheme == GitScheme::Ssh && proto.is_none() {
            let (user, host) = scp_like(src).unwrap_or_default();
            check_ssh_user(user).map_err(err)?;
            let path = before.split_once(':').map_or("", |(_, p)| p);
            if path.starts_with('-') {
                return Err(err(format!(
                    "path '{path}' starts with '-' (git would hand it to the remote as an option)"
                )));
            }
            if path.is_empty() {
                return Err(err("the ssh source has no repository path".into()));
            }
            if host.starts_with('-') {
                return Err(err(format!("bad host '{host}'")));
            }
            (host.to_string(), 22, Some(user.to_string()))
        } else {
            let rest = rest.split('#').next().unwrap_or_default();
            let mut authority = rest.split('/').next().unwrap_or_default();
            let mut user = None;
            if scheme == GitScheme::Ssh
                && let Some((u, host)) = authority.rsplit_once('@')
            {
                // `ssh://git@host/...`: a user name, the ssh way (no password).
                if u.contains(':') {
                    return Err(err(
                        "a password in a git URL is not supported: ssh authenticates with \
                         the agent of --ssh"
                            .into(),
                    ));
                }
                check_ssh_user(u).map_err(err)?;
                user = Some(u.to_string());
                authority = host;
            }
            if authority.contains('@') {
                return Err(err(
                    "user information in a git URL is not supported: it would be kept in \
                     the image's history"
                        .into(),
                ));
            }
            let (host, port) = host_port(authority, scheme.default_port()).map_err(err)?;
            (host, port, user)
        };
        let (reference, subdir) = match fragment {
            None => (None, None),
            Some(f) => {
                let (r, s) = match f.split_once(':') {
                    Some((r, s)) => (r, Some(s)),
                    None => (f, None),
                };
                let reference = if r.is_empty() {
                    None
                } else {
                    check_ref(r).map_err(err)?;
                    Some(r.to_string())
                };
                let subdir = match s {
                    None => None,
                    Some(s) => check_subdir(s).map_err(err)?,
                };
                (reference, subdir)
            }
        };
        Ok(Some(GitRef {
            scheme,
            remote: before.to_string(),
            host,
            port,
            user,
            reference,
            subdir,
        }))
    }

    /// Whether the ref is written as a full commit id (40 hex digits for SHA-1, 64 for
    /// SHA-256).
    pub fn is_commit(&self) -> bool {
        self.reference.as_deref().is_some_and(is_commit_id)
    }
}

/// Whether `s` is a full commit id (40 or 64 hex digits).
pub fn is_commit_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `user@host:path` as BuildKit's scp-like pattern takes it: the user and host.
fn scp_like(s: &str) -> Option<(&str, &str)> {
    let (user, rest) = s.split_once('@')?;
    let (host, _) = rest.split_once(':')?;
    let user_ok = !user.is_empty()
        && user
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    (user_ok && host_ok).then_some((user, host))
}

/// A user name ssh is given as `user@host`: not empty, `[A-Za-z0-9._-]` only, not starting
/// with `-` (which `ssh` would read as an option).
fn check_ssh_user(u: &str) -> Result<(), String> {
    if u.is_empty()
        || u.starts_with('-')
        || !u
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        return Err(format!(
            "bad ssh user name '{u}' (letters, digits, '.', '_' and '-', not first)"
        ));
    }
    Ok(())
}

/// Host and port of `authority` (`host`, `host:port`, `[v6]`, `[v6]:port`).
fn host_port(authority: &str, default: u16) -> Result<(String, u16), String> {
    let (host, port) = if let Some(r) = authority.strip_prefix('[') {
        let (h, after) = r
            .split_once(']')
            .ok_or_else(|| "unclosed '[' in the host".to_string())?;
        (h, after.strip_prefix(':'))
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("the URL has no host".into());
    }
    if host.starts_with('-')
        || !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._:".contains(c))
    {
        return Err(format!("bad host '{host}'"));
    }
    let port = match port {
        None | Some("") => default,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("bad port '{p}'"))?,
    };
    Ok((host.to_string(), port))
}

/// A ref git takes as a name and nothing else (`git check-ref-format` rules, and no
/// leading `-`, which a command line would read as an option).
fn check_ref(r: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("ref '{r}' {why}"));
    if r.starts_with('-') {
        return bad("starts with '-'");
    }
    if r.len() > 1024 {
        return bad("is longer than 1024 bytes");
    }
    if r.chars()
        .any(|c| c.is_ascii_control() || c == ' ' || "~^:?*[\\".contains(c))
    {
        return bad("has a character git does not allow in a ref (space, ~ ^ : ? * [ \\)");
    }
    if r.contains("..") || r.contains("@{") || r.contains("//") || r == "@" {
        return bad("is not a valid git ref ('..', '@{', '//' or '@')");
    }
    if r.ends_with('/') || r.ends_with('.') || r.ends_with(".lock") || r.starts_with('/') {
        return bad(
            "is not a valid git ref (it starts or ends with '/', or ends with '.' or '.lock')",
        );
    }
    if r.split('/').any(|c| c.starts_with('.')) {
        return bad("is not a valid git ref (a component starts with '.')");
    }
    Ok(())
}

/// The subdirectory, cleaned (`None`: the root). Refuses `..`, a leading `-` and NUL.
fn check_subdir(s: &str) -> Result<Option<String>, String> {
    if s.starts_with('-') {
        return Err(format!("subdirectory '{s}' starts with '-'"));
    }
    if s.contains('\0') {
        return Err("the subdirectory has a NUL byte".into());
    }
    let comps: Vec<&str> = s
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if comps.contains(&"..") {
        return Err(format!(
            "subdirectory '{s}' has a '..' component: it must stay inside the repository"
        ));
    }
    Ok((!comps.is_empty()).then(|| comps.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> GitRef {
        GitRef::parse(s)
            .unwrap()
            .unwrap_or_else(|| panic!("{s}: not git"))
    }

    #[test]
    fn which_sources_are_git() {
        for plain in [
            "https://e.test/a.tar.gz",
            "http://e.test/x.git/file",
            "https://e.test/",
            "src/app",
            "/abs/path",
            "./x.git",
            "a@b",
            "dir:x",
        ] {
            assert_eq!(GitRef::parse(plain).unwrap(), None, "{plain}");
        }
        let g = ok("https://e.test:8443/org/repo.git#v1.2:sub/./dir/");
        assert_eq!(g.scheme, GitScheme::Https);
        assert_eq!(g.remote, "https://e.test:8443/org/repo.git");
        assert_eq!((g.host.as_str(), g.port), ("e.test", 8443));
        assert_eq!(g.reference.as_deref(), Some("v1.2"));
        assert_eq!(g.subdir.as_deref(), Some("sub/dir"));
        let g = ok("HTTP://[::1]/r.git#:only/sub");
        assert_eq!(
            (g.scheme, g.host.as_str(), g.port),
            (GitScheme::Http, "::1", 80)
        );
        assert_eq!((g.reference, g.subdir.as_deref()), (None, Some("only/sub")));
        let g = ok("git://e.test/r");
        assert_eq!(
            (g.scheme, g.port, g.reference),
            (GitScheme::Git, 9418, None)
        );
        let g = ok("git@github.com:moby/buildkit.git#main:docs");
        assert_eq!((g.scheme, g.host.as_str()), (GitScheme::Ssh, "github.com"));
        assert_eq!((g.port, g.user.as_deref()), (22, Some("git")));
        assert_eq!(g.remote, "git@github.com:moby/buildkit.git");
        assert_eq!(
            (g.reference.as_deref(), g.subdir.as_deref()),
            (Some("main"), Some("docs"))
        );
        let g = ok("ssh://git@e.test/x.git");
        assert_eq!(
            (g.scheme, g.port, g.user.as_deref()),
            (GitScheme::Ssh, 22, Some("git"))
        );
        let g = ok("ssh://root@127.0.0.1:2222/srv/r.git#v1");
        assert_eq!((g.host.as_str(), g.port), ("127.0.0.1", 2222));
        assert_eq!(g.remote, "ssh://root@127.0.0.1:2222/srv/r.git");
        let g = ok("ssh://[::1]:22/r.git");
        assert_eq!((g.host.as_str(), g.user), ("::1", None));
        assert_eq!(ok("https://e.test/r.git").user, None);
        assert!(ok(&format!("https://e.test/r.git#{}", "a".repeat(40))).is_commit());
        assert!(!ok("https://e.test/r.git#main").is_commit());
    }

    #[test]
    fn hostile_sources_are_refused() {
        for (src, needle) in [
            ("ext::sh -c touch% /tmp/pwned", "transport 'ext::'"),
            ("fd::3", "transport 'fd::'"),
            ("file:///srv/repo.git#main", "file://"),
            ("FILE://x/y.git", "file://"),
            ("ftp://e.test/r.git", "scheme 'ftp'"),
            (
                "https://e.test/r.git#--upload-pack=touch /tmp/x",
                "starts with '-'",
            ),
            ("https://e.test/r.git#-b", "starts with '-'"),
            ("https://e.test/r.git#main:-x", "starts with '-'"),
            ("https://e.test/r.git#main:../../etc", "'..'"),
            ("https://e.test/r.git#main:a/../..", "'..'"),
            ("https://e.test/r.git#a..b", "not a valid git ref"),
            ("https://e.test/r.git#a b", "character"),
            ("https://e.test/r.git#x.lock", "not a valid git ref"),
            ("https://u:p@e.test/r.git", "user information"),
            ("https://e.test/r.git?ref=main", "query options"),
            ("https://-oProxyCommand=x/r.git", "bad host"),
            ("https:///r.git", "no host"),
            ("ssh://-oProxyCommand=touch%20x/r.git", "bad host"),
            ("ssh://git@-oProxyCommand=x/r.git", "bad host"),
            ("ssh://-oProxyCommand=x@e.test/r.git", "bad ssh user name"),
            ("ssh://a@b@e.test/r.git", "bad ssh user name"),
            ("ssh://u:secret@e.test/r.git", "a password"),
            ("ssh://@e.test/r.git", "bad ssh user name"),
            ("ssh://e.test:0/r.git", "bad port"),
            ("-oProxyCommand@e.test:r.git", "bad ssh user name"),
            ("git@e.test:-r.git", "starts with '-'"),
            ("git@e.test:--upload-pack=touch x", "starts with '-'"),
            ("git@e.test:", "no repository path"),
            ("git@e.test:r.git#-b", "starts with '-'"),
            ("ext::ssh -oProxyCommand=x e.test", "transport 'ext::'"),
            ("https://e.test:0/r.git", "bad port"),
        ] {
            let e = GitRef::parse(src).unwrap_err();
            assert!(e.to_string().contains(needle), "{src}: {e}");
        }
    }
}
