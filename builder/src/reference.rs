//! Image references as Docker parses them.
//!
//! Grammar and defaults follow the distribution project's `reference` package
//! (`reference/normalize.go`, `reference/regexp.go`), which Docker uses for every `FROM`
//! and `docker pull`:
//!
//! - `NAME[:TAG][@ALGO:HEX]`; `NAME` is `[DOMAIN/]PATH`.
//! - The first path component is a registry domain when it contains `.` or `:`, is
//!   `localhost`, or holds an upper-case letter; otherwise the domain is `docker.io`.
//! - On `docker.io`, a one-component path gets the `library/` prefix; `index.docker.io`
//!   is rewritten to `docker.io`.
//! - Path components are `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`; a tag is
//!   `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`; the name is at most 255 bytes.
//! - With neither tag nor digest the tag is `latest`; with a digest only, no tag is implied.
//! - Digests are `sha256:` + 64 lower-case hex digits, or `sha512:` + 128.

use std::fmt;
use std::str::FromStr;

/// The registry Docker uses when a name has no domain.
pub const DEFAULT_REGISTRY: &str = "docker.io";
/// The tag Docker uses when a name has neither tag nor digest.
pub const DEFAULT_TAG: &str = "latest";

/// Why a reference string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReferenceError {
    /// The reference string is empty.
    #[error("empty image reference")]
    Empty,
    /// A path component breaks the grammar (lower case letters, digits, separators).
    #[error(
        "invalid repository name {name:?}: component {component:?} must match [a-z0-9]+((.|_|__|-+)[a-z0-9]+)*"
    )]
    BadComponent {
        /// The whole name.
        name: String,
        /// The bad component.
        component: String,
    },
    /// The registry domain is not a host name with an optional port.
    #[error("invalid registry domain {0:?}")]
    BadDomain(String),
    /// A `:` with nothing after it.
    #[error(
        "invalid image reference {0:?}: empty tag after ':' (write NAME:TAG, or NAME for :latest)"
    )]
    EmptyTag(String),
    /// A repository path component with upper-case letters.
    #[error(
        "invalid repository name {name:?}: repository names must be lower case ({component:?})"
    )]
    UpperCase {
        /// The whole name.
        name: String,
        /// The component with upper-case letters.
        component: String,
    },
    /// The tag breaks the grammar.
    #[error("invalid tag {0:?}: must match [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}")]
    BadTag(String),
    /// The digest is not `sha256:<64 hex>` or `sha512:<128 hex>`.
    #[error("invalid digest {0:?}: expected sha256:<64 lower-case hex digits>")]
    BadDigest(String),
    /// The name is longer than 255 bytes.
    #[error("repository name {0:?} is longer than 255 bytes")]
    TooLong(String),
}

/// A parsed, normalized image reference: registry, repository, optional tag and digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reference {
    registry: String,
    repository: String,
    tag: Option<String>,
    digest: Option<String>,
}

impl Reference {
    /// The registry domain, e.g. `docker.io` or `127.0.0.1:5000`.
    pub fn registry(&self) -> &str {
        &self.registry
    }
    /// The repository path, e.g. `library/debian`.
    pub fn repository(&self) -> &str {
        &self.repository
    }
    /// The tag, if the reference names one (or `latest` was implied).
    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }
    /// The digest (`sha256:<hex>`), if the reference pins one.
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }
    /// `registry/repository`, the name without tag or digest.
    pub fn name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }
    /// The same name pinned to `digest` (the tag is kept for display).
    pub fn with_digest(&self, digest: &kiln_store::BlobDigest) -> Reference {
        Reference {
            digest: Some(digest.to_string()),
            ..self.clone()
        }
    }
    /// The same reference in `oci-client`'s type.
    pub fn to_oci(&self) -> oci_client::Reference {
        match (&self.digest, &self.tag) {
            (Some(d), _) => oci_client::Reference::with_digest(
                self.registry.clone(),
                self.repository.clone(),
                d.clone(),
            ),
            (None, t) => oci_client::Reference::with_tag(
                self.registry.clone(),
                self.repository.clone(),
                t.clone().unwrap_or_else(|| DEFAULT_TAG.to_string()),
            ),
        }
    }
    /// Whether plain HTTP is allowed without naming the registry insecure: loopback only.
    pub fn is_loopback(&self) -> bool {
        let host = host_of(&self.registry);
        host == "localhost" || host == "127.0.0.1" || host == "[::1]" || host.starts_with("127.")
    }
}

/// The host part of a `host[:port]` domain.
fn host_of(domain: &str) -> &str {
    if domain.starts_with('[') {
        return domain
            .split(']')
            .next()
            .map_or(domain, |h| &domain[..=h.len()]);
    }
    domain.split(':').next().unwrap_or(domain)
}

fn is_alnum_lower(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn valid_component(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() || !is_alnum_lower(b[0]) || !is_alnum_lower(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if is_alnum_lower(b[i]) {
            i += 1;
            continue;
        }
        // A separator run: ".", "_", "__" or "-+".
        let start = i;
        while i < b.len() && !is_alnum_lower(b[i]) {
            i += 1;
        }
        let sep = &s[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|c| c == b'-');
        if !ok {
            return false;
        }
    }
    true
}

/// A domain: host name components (`[A-Za-z0-9]` with inner `-`) joined by `.`, or an
/// IPv6 literal in brackets, then an optional `:port`.
fn valid_domain(d: &str) -> bool {
    let (host, port) = if let Some(rest) = d.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, after)) => {
                if ip.parse::<std::net::Ipv6Addr>().is_err() {
                    return false;
                }
                (None, after.strip_prefix(':'))
            }
            None => return false,
        }
    } else {
        match d.split_once(':') {
            Some((h, p)) => (Some(h), Some(p)),
            None => (Some(d), None),
        }
    };
    if let Some(p) = port
        && (p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()))
    {
        return false;
    }
    if let Some(h) = host {
        if h.is_empty() {
            return false;
        }
        for label in h.split('.') {
            let b = label.as_bytes();
            if b.is_empty()
                || !b[0].is_ascii_alphanumeric()
                || !b[b.len() - 1].is_ascii_alphanumeric()
                || !b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
            {
                return false;
            }
        }
    }
    true
}

fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// Checks `sha256:<64 hex>` / `sha512:<128 hex>` (lower case).
pub fn valid_digest(d: &str) -> bool {
    let Some((algo, hex)) = d.split_once(':') else {
        return false;
    };
    let len = match algo {
        "sha256" => 64,
        "sha512" => 128,
        _ => return false,
    };
    hex.len() == len
        && hex
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

impl FromStr for Reference {
    type Err = ReferenceError;

    fn from_str(s: &str) -> Result<Self, ReferenceError> {
        if s.is_empty() {
            return Err(ReferenceError::Empty);
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !valid_digest(d) {
                    return Err(ReferenceError::BadDigest(d.to_string()));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        // A tag is after the last ':' that follows the last '/'.
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let t = &rest[last_slash + i + 1..];
                if t.is_empty() {
                    return Err(ReferenceError::EmptyTag(s.to_string()));
                }
                if !valid_tag(t) {
                    return Err(ReferenceError::BadTag(t.to_string()));
                }
                (&rest[..last_slash + i], Some(t.to_string()))
            }
            None => (rest, None),
        };
        if name.is_empty() {
            return Err(ReferenceError::Empty);
        }
        let (domain, path) = match name.split_once('/') {
            Some((first, rest))
                if first.contains(['.', ':'])
                    || first == "localhost"
                    || first.bytes().any(|c| c.is_ascii_uppercase()) =>
            {
                (first.to_string(), rest.to_string())
            }
            _ => (DEFAULT_REGISTRY.to_string(), name.to_string()),
        };
        let domain = if domain == "index.docker.io" {
            DEFAULT_REGISTRY.to_string()
        } else {
            domain
        };
        if !valid_domain(&domain) {
            return Err(ReferenceError::BadDomain(domain));
        }
        let path = if domain == DEFAULT_REGISTRY && !path.contains('/') {
            format!("library/{path}")
        } else {
            path
        };
        for c in path.split('/') {
            if c.bytes().any(|b| b.is_ascii_uppercase()) && valid_component(&c.to_ascii_lowercase())
            {
                return Err(ReferenceError::UpperCase {
                    name: name.to_string(),
                    component: c.to_string(),
                });
            }
            if !valid_component(c) {
                return Err(ReferenceError::BadComponent {
                    name: name.to_string(),
                    component: c.to_string(),
                });
            }
        }
        if name.len() > 255 {
            return Err(ReferenceError::TooLong(name.to_string()));
        }
        let tag = match (&tag, &digest) {
            (None, None) => Some(DEFAULT_TAG.to_string()),
            _ => tag,
        };
        Ok(Reference {
            registry: domain,
            repository: path,
            tag,
            digest,
        })
    }
}

impl fmt::Display for Reference {
    /// The fully qualified form: `registry/repository[:tag][@digest]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// The OCI reference (`registry/repo:tag`) that a pull of `r` sets, `None` for a
/// digest-pinned reference (a pull of one sets none).
pub fn oci_ref_of(r: &Reference) -> Option<kiln_store::OciRef> {
    if r.digest().is_some() {
        return None;
    }
    format!("{}:{}", r.name(), r.tag().unwrap_or(DEFAULT_TAG))
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn p(s: &str) -> Reference {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn docker_defaults() {
        let r = p("debian");
        assert_eq!(r.to_string(), "docker.io/library/debian:latest");
        assert_eq!(
            p("library/debian:bookworm").to_string(),
            "docker.io/library/debian:bookworm"
        );
        assert_eq!(
            p("docker.io/debian").to_string(),
            "docker.io/library/debian:latest"
        );
        assert_eq!(
            p("index.docker.io/debian").to_string(),
            "docker.io/library/debian:latest"
        );
        assert_eq!(p("user/repo").to_string(), "docker.io/user/repo:latest");
        assert_eq!(p("a/b/c:t").to_string(), "docker.io/a/b/c:t");
    }

    #[test]
    fn domains_and_ports() {
        let r = p("127.0.0.1:5000/x:y");
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5000", "x", Some("y"))
        );
        assert!(r.is_loopback());
        let r = p("localhost/foo");
        assert_eq!((r.registry(), r.repository()), ("localhost", "foo"));
        let r = p("localhost:5000/foo/bar");
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("localhost:5000", "foo/bar", Some("latest"))
        );
        let r = p("ghcr.io/o/r");
        assert_eq!(r.registry(), "ghcr.io");
        assert!(!r.is_loopback());
        // A first component with a capital letter is a domain.
        assert_eq!(p("Foo/bar").registry(), "Foo");
        // A port with no dot is still a domain.
        assert_eq!(p("myhost:443/r").registry(), "myhost:443");
        assert_eq!(p("[::1]:5000/r").registry(), "[::1]:5000");
        assert!(p("[::1]:5000/r").is_loopback());
    }

    #[test]
    fn digests() {
        let r = p(&format!("ghcr.io/o/r@{D}"));
        assert_eq!(r.digest(), Some(D));
        assert_eq!(r.tag(), None);
        assert_eq!(r.to_string(), format!("ghcr.io/o/r@{D}"));
        let r = p(&format!("debian:12@{D}"));
        assert_eq!((r.tag(), r.digest()), (Some("12"), Some(D)));
        assert_eq!(r.to_oci().digest(), Some(D));
    }

    #[test]
    fn refusals() {
        assert_eq!("".parse::<Reference>(), Err(ReferenceError::Empty));
        // Upper case and an empty tag are named as such (the newcomer review's leftovers).
        for s in ["Debian", "127.0.0.1:5000/BusyBox:1", "ghcr.io/Org/x"] {
            let e = s.parse::<Reference>().unwrap_err();
            assert!(matches!(e, ReferenceError::UpperCase { .. }), "{s}: {e}");
            assert!(e.to_string().contains("lower case"), "{e}");
        }
        // A domain may have upper case (it is not a repository component).
        assert_eq!(p("Registry.Example/x").registry(), "Registry.Example");
        for s in ["debian:", "127.0.0.1:5000/x:"] {
            let e = s.parse::<Reference>().unwrap_err();
            assert_eq!(e, ReferenceError::EmptyTag(s.to_string()));
            assert!(e.to_string().contains("empty tag"), "{e}");
        }
        assert!(matches!(
            "Deb!an".parse::<Reference>(),
            Err(ReferenceError::BadComponent { .. })
        ));
        assert!(matches!(
            "debian:-x".parse::<Reference>(),
            Err(ReferenceError::BadTag(_))
        ));
        assert!(matches!(
            "debian@sha256:abc".parse::<Reference>(),
            Err(ReferenceError::BadDigest(_))
        ));
        assert!(matches!(
            format!("debian@md5:{}", &D[7..]).parse::<Reference>(),
            Err(ReferenceError::BadDigest(_))
        ));
        assert!(matches!(
            "a//b".parse::<Reference>(),
            Err(ReferenceError::BadComponent { .. })
        ));
        assert!(matches!(
            "a/-b".parse::<Reference>(),
            Err(ReferenceError::BadComponent { .. })
        ));
        assert!(matches!(
            "a/b..c".parse::<Reference>(),
            Err(ReferenceError::BadComponent { .. })
        ));
        assert!(matches!(
            "host:port/x".parse::<Reference>(),
            Err(ReferenceError::BadDomain(_))
        ));
        assert!(matches!(
            "-bad.io/x".parse::<Reference>(),
            Err(ReferenceError::BadDomain(_))
        ));
        let long = "a".repeat(256);
        assert!(matches!(
            long.parse::<Reference>(),
            Err(ReferenceError::TooLong(_))
        ));
        assert!(matches!(
            format!("x:{}", "t".repeat(129)).parse::<Reference>(),
            Err(ReferenceError::BadTag(_))
        ));
    }

    #[test]
    fn separators() {
        assert!(valid_component("a.b_c__d---e"));
        assert!(!valid_component("a___b"));
        assert!(!valid_component("a._b"));
        assert!(!valid_component("a-"));
    }
}
