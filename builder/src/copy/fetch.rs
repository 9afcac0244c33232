//! `ADD <url>`: downloading URL sources before the copy, with `--checksum`.
//!
//! [`fetch_urls`] runs on the host, before the step's copy (which may run where no async
//! runtime is), and leaves one file per URL in a directory the caller owns; the copy and
//! [`super::sources_digest`] read them from [`Downloads`]. Each body is bounded
//! ([`FetchOptions::max_bytes`]); `--checksum=sha256:<hex>` is checked before the file is
//! handed over (Dockerfile reference, "ADD --checksum").
//!
//! A tenant's recipe is hostile, and the fetch runs with the host's network: by default
//! addresses that are not public (loopback, private, link-local, CGNAT, unique-local,
//! multicast, unspecified: [`crate::egress::address`], the policy the egress proxy uses too)
//! are refused, the name is resolved once and the connection pinned to
//! the address checked (no DNS rebinding), and every redirect is checked the same way, at
//! most [`MAX_REDIRECTS`] of them. Only `http` and `https` are fetched, never through a proxy
//! named by the environment (`HTTP_PROXY`...), which would resolve names itself.
//!
//! Git sources (`ADD https://host/x.git#ref:subdir`) are fetched here too, by
//! [`super::git::fetch_git`], under the same address rules and size bound.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln_recipes::plan::{CopySource, CopyStep};
use kiln_store::digest::Sha256Hash;
use sha2::{Digest, Sha256};

use super::git::GitCheckout;
use crate::egress::address::{AddressError, AddressPolicy};

/// Most redirects followed for one URL (as curl's and Go's default of 10).
pub const MAX_REDIRECTS: usize = 10;

/// One downloaded URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Download {
    /// The file holding the body.
    pub file: PathBuf,
    /// The name the file is copied under: the last segment of the URL's path.
    pub name: String,
    /// `sha256:<hex>` of the body (no store object: a plain hash).
    pub digest: Sha256Hash,
    /// Body size, bytes.
    pub size: u64,
}

/// URL → download (and git source → checkout), for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Downloads {
    map: BTreeMap<String, Download>,
    git: BTreeMap<String, GitCheckout>,
}

impl Downloads {
    /// The download of `url`.
    pub fn get(&self, url: &str) -> Option<&Download> {
        self.map.get(url)
    }

    /// Records a download (for callers that fetched by other means).
    pub fn insert(&mut self, url: String, d: Download) {
        self.map.insert(url, d);
    }

    /// The checkout of git source `url` (as written).
    pub fn git(&self, url: &str) -> Option<&GitCheckout> {
        self.git.get(url)
    }

    /// Records a git checkout.
    pub fn insert_git(&mut self, url: String, c: GitCheckout) {
        self.git.insert(url, c);
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty() && self.git.is_empty()
    }
}

/// How URLs are fetched.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Largest body, bytes (default 4 GiB).
    pub max_bytes: u64,
    /// Whole-request timeout (default 10 minutes; the build's own timeout still applies).
    pub timeout: Duration,
    /// Which addresses may be fetched from ([`AddressPolicy::allow_private_addresses`]:
    /// tests and trusted builds only), shared with the egress proxy.
    pub addresses: AddressPolicy,
    /// The build's allow and deny lists (a build-wide allow-list network: `kiln build
    /// --network-allow`, the API's `{"allow": [...]}`), checked on the host asked for and
    /// its resolved addresses as the egress proxy checks them ([`crate::egress::policy`]);
    /// `None`: no lists, the address rules only.
    pub rules: Option<kiln_recipes::plan::Egress>,
    /// Extra CA certificates: `ADD <url>` trusts them besides its built-in roots, and every
    /// `RUN` step sees them in its CA bundle ([`crate::egress::ca`]). `None`: none.
    pub ca_certs: Option<crate::egress::ca::CaCerts>,
    /// The SSH agent a git source over ssh (`git@host:path`, `ssh://…`) authenticates with:
    /// the socket of `kiln build --ssh default` (BuildKit's git source mounts its `default`
    /// agent too, `client/llb/source.go`), reached read-only ([`super::git`]). `None`: such a
    /// source is refused, naming `--ssh default` (always so through the API).
    pub ssh_agent: Option<PathBuf>,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            max_bytes: 4 << 30,
            timeout: Duration::from_secs(600),
            addresses: AddressPolicy::default(),
            rules: None,
            ca_certs: None,
            ssh_agent: None,
        }
    }
}

impl FetchOptions {
    /// The addresses `host` with `port` may be reached at for `url`: the allow and deny
    /// lists ([`FetchOptions::rules`]) on the name asked for, then the address rules on
    /// what it resolves to, then the lists' deny addresses on those. Connect only to these.
    pub async fn resolve(
        &self,
        url: &str,
        host: &str,
        port: u16,
    ) -> Result<Vec<std::net::SocketAddr>, FetchError> {
        let refused = |rule: String| FetchError::NotAllowed {
            url: url.to_string(),
            host: host.to_string(),
            rule,
        };
        if let Some(rules) = &self.rules
            && let crate::egress::policy::Verdict::Refused(why) =
                crate::egress::policy::check(rules, host)
        {
            return Err(refused(why));
        }
        let addrs = self
            .addresses
            .resolve(host, port)
            .await
            .map_err(|e| match e {
                AddressError::NotPublic { addr, .. } => FetchError::Forbidden {
                    url: url.to_string(),
                    addr,
                },
                other => FetchError::Http {
                    url: url.to_string(),
                    detail: other.to_string(),
                },
            })?;
        if let Some(rules) = &self.rules {
            let ips: Vec<IpAddr> = addrs.iter().map(|a| a.ip()).collect();
            if let Some(why) = crate::egress::policy::refused_address(rules, &ips) {
                return Err(refused(why));
            }
        }
        Ok(addrs)
    }
}

/// Why a URL could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The URL is malformed or of a scheme other than http(s).
    #[error("ADD {url}: {reason}")]
    BadUrl {
        /// The URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// The host resolves to an address builds may not reach.
    #[error("ADD {url}: address {addr} is not public (loopback, private or link-local)")]
    Forbidden {
        /// The URL (or the redirect target).
        url: String,
        /// The address refused.
        addr: IpAddr,
    },
    /// The host is not allowed by the build's allow and deny lists.
    #[error("ADD {url}: {host} is refused by the build's network rules: {rule}")]
    NotAllowed {
        /// The URL (or the redirect target).
        url: String,
        /// The host asked for.
        host: String,
        /// The rule (`deny x`, `not on the allow list`).
        rule: String,
    },
    /// The request failed, or the server answered with an error.
    #[error("ADD {url}: {detail}")]
    Http {
        /// The URL.
        url: String,
        /// What happened.
        detail: String,
    },
    /// Fetching a git source failed (git's message, or a ref that is not there).
    #[error("ADD {url}: {detail}")]
    Git {
        /// The source as written.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The body (or a git repository) is larger than [`FetchOptions::max_bytes`].
    #[error("ADD {url}: larger than {max} bytes")]
    TooLarge {
        /// The URL.
        url: String,
        /// The bound, bytes.
        max: u64,
    },
    /// `--checksum` does not match the body.
    #[error("ADD {url}: checksum mismatch: expected {expected}, got {actual}")]
    Checksum {
        /// The URL.
        url: String,
        /// The `--checksum` value.
        expected: String,
        /// The body's digest.
        actual: String,
    },
    /// Writing the download failed.
    #[error("ADD {url}: writing {path}: {source}")]
    Io {
        /// The URL.
        url: String,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The name a URL's file is copied under: its path's last segment (percent-decoding is
/// not applied, as Docker keeps it). Errors when there is none (`http://h/`).
pub fn url_file_name(url: &reqwest::Url) -> Option<String> {
    let seg = url.path_segments()?.next_back()?;
    if seg.is_empty() || seg == "." || seg == ".." {
        None
    } else {
        Some(seg.to_string())
    }
}

/// Downloads every URL source of `step` into `dir` (which must exist; the caller removes
/// it), verifying `--checksum` when given, and fetches every git source
/// ([`super::git::fetch_git`]). Errors: [`FetchError`].
pub async fn fetch_urls(
    step: &CopyStep,
    dir: &Path,
    opts: &FetchOptions,
) -> Result<Downloads, FetchError> {
    let urls: Vec<&String> = step
        .sources
        .iter()
        .filter_map(|s| match s {
            CopySource::Url { url } => Some(url),
            _ => None,
        })
        .collect();
    let gits: Vec<&String> = step
        .sources
        .iter()
        .filter_map(|s| match s {
            CopySource::Git { url } => Some(url),
            _ => None,
        })
        .collect();
    let mut out = Downloads::default();
    if let (Some(_), Some(g)) = (&step.checksum, gits.first()) {
        return Err(FetchError::BadUrl {
            url: g.to_string(),
            reason: "--checksum with a git source is not supported: pin the commit in the \
                     URL (#<full commit id>)"
                .into(),
        });
    }
    if let Some(sum) = &step.checksum
        && urls.len() != 1
    {
        return Err(FetchError::BadUrl {
            url: sum.clone(),
            reason: "--checksum needs exactly one URL source".into(),
        });
    }
    for (i, url) in urls.into_iter().enumerate() {
        let file = dir.join(format!("download-{i}"));
        let d = fetch_one(url, &file, step.checksum.as_deref(), opts).await?;
        out.insert(url.clone(), d);
    }
    for (i, url) in gits.into_iter().enumerate() {
        let sub = dir.join(format!("git-{i}"));
        std::fs::create_dir(&sub).map_err(|source| FetchError::Io {
            url: url.clone(),
            path: sub.clone(),
            source,
        })?;
        let c = super::git::fetch_git(url, step.keep_git_dir, &sub, opts).await?;
        out.insert_git(url.clone(), c);
    }
    Ok(out)
}

async fn fetch_one(
    url_text: &str,
    file: &Path,
    checksum: Option<&str>,
    opts: &FetchOptions,
) -> Result<Download, FetchError> {
    let bad = |reason: &str| FetchError::BadUrl {
        url: url_text.to_string(),
        reason: reason.to_string(),
    };
    let first = reqwest::Url::parse(url_text).map_err(|e| bad(&e.to_string()))?;
    let name = url_file_name(&first).ok_or_else(|| bad("the URL has no file name"))?;
    let expected = match checksum {
        None => None,
        Some(c) => {
            // Parsed once, here; upper-case hex is taken as Docker takes it.
            let hex = c
                .strip_prefix("sha256:")
                .ok_or_else(|| bad("--checksum must be sha256:<64 hex digits>"))?;
            Some(
                Sha256Hash::from_hex(&hex.to_ascii_lowercase())
                    .map_err(|_| bad("--checksum must be sha256:<64 hex digits>"))?,
            )
        }
    };
    crate::registry::crypto_provider();
    let mut url = first;
    let mut redirects = 0;
    let resp = loop {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad(&format!(
                "scheme {:?} is not http or https",
                url.scheme()
            )));
        }
        let host = url
            .host_str()
            .ok_or_else(|| bad("the URL has no host"))?
            .to_string();
        let port = url.port_or_known_default().ok_or_else(|| bad("no port"))?;
        let http_err = |detail: String| FetchError::Http {
            url: url_text.to_string(),
            detail,
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addrs = opts
            .resolve(url.as_str(), &host, port)
            .await
            .map_err(|e| match e {
                FetchError::Http { detail, .. } => http_err(detail),
                e => e,
            })?;
        let addr = addrs[0];
        // No proxy from the environment: it would resolve the name itself, past the check
        // and the pinning.
        let mut client = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(30))
            .timeout(opts.timeout)
            .resolve(bare, addr);
        if let Some(ca) = &opts.ca_certs {
            let certs = reqwest::Certificate::from_pem_bundle(ca.pem().as_bytes())
                .map_err(|e| http_err(format!("the extra CA certificates: {e}")))?;
            client = client.tls_certs_merge(certs);
        }
        let client = client.build().map_err(|e| http_err(e.to_string()))?;
        let resp = client
            .get(url.clone())
            .send()
            .await
            .map_err(|e| http_err(e.to_string()))?;
        if resp.status().is_redirection() {
            redirects += 1;
            if redirects > MAX_REDIRECTS {
                return Err(http_err(format!("more than {MAX_REDIRECTS} redirects")));
            }
            let loc = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| http_err(format!("{} without Location", resp.status())))?;
            url = url
                .join(loc)
                .map_err(|e| http_err(format!("bad redirect {loc:?}: {e}")))?;
            continue;
        }
        if !resp.status().is_success() {
            return Err(http_err(format!("HTTP {}", resp.status())));
        }
        break resp;
    };
    if let Some(len) = resp.content_length()
        && len > opts.max_bytes
    {
        return Err(FetchError::TooLarge {
            url: url_text.to_string(),
            max: opts.max_bytes,
        });
    }
    let io_err = |source| FetchError::Io {
        url: url_text.to_string(),
        path: file.to_path_buf(),
        source,
    };
    let mut out = std::fs::File::create(file).map_err(io_err)?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut resp = resp;
    loop {
        let chunk = resp.chunk().await.map_err(|e| FetchError::Http {
            url: url_text.to_string(),
            detail: e.to_string(),
        })?;
        let Some(chunk) = chunk else { break };
        size += chunk.len() as u64;
        if size > opts.max_bytes {
            drop(out);
            let _ = std::fs::remove_file(file);
            return Err(FetchError::TooLarge {
                url: url_text.to_string(),
                max: opts.max_bytes,
            });
        }
        hasher.update(&chunk);
        out.write_all(&chunk).map_err(io_err)?;
    }
    out.flush().map_err(io_err)?;
    let digest = Sha256Hash(hasher.finalize().into());
    if let Some(expected) = expected
        && expected != digest
    {
        drop(out);
        let _ = std::fs::remove_file(file);
        return Err(FetchError::Checksum {
            url: url_text.to_string(),
            expected: expected.to_string(),
            actual: digest.to_string(),
        });
    }
    Ok(Download {
        file: file.to_path_buf(),
        name,
        digest,
        size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxy from the environment (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`) would get the
    /// host name and resolve it itself, past the address check and the pinning (DNS
    /// rebinding, or a proxy that reaches the host's private networks). The child process
    /// runs a fetch with `HTTP_PROXY` pointing at a listener of the parent's; nothing may
    /// connect to it.
    #[test]
    fn proxies_from_the_environment_are_not_used() {
        if std::env::var_os("KILN_TEST_PROXY_CHILD").is_some() {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let dir = tempfile::tempdir().unwrap();
            let step = CopyStep {
                sources: vec![CopySource::Url {
                    // Public (the check passes), and on a port nothing listens on.
                    url: "http://8.8.8.8:9/file".into(),
                }],
                dest: "/".into(),
                from: None,
                chown: None,
                chmod: None,
                link: false,
                parents: false,
                exclude: vec![],
                checksum: None,
                unpack: false,
                keep_git_dir: false,
            };
            let opts = FetchOptions {
                timeout: Duration::from_secs(3),
                ..FetchOptions::default()
            };
            let r = rt.block_on(fetch_urls(&step, dir.path(), &opts));
            eprintln!("child fetch: {r:?}");
            return;
        }
        let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = proxy.local_addr().unwrap().port();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "copy::fetch::tests::proxies_from_the_environment_are_not_used",
                "--nocapture",
            ])
            .env("KILN_TEST_PROXY_CHILD", "1")
            .env("HTTP_PROXY", format!("http://127.0.0.1:{port}"))
            .env("http_proxy", format!("http://127.0.0.1:{port}"))
            .env("ALL_PROXY", format!("http://127.0.0.1:{port}"))
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed: {log}");
        assert!(
            log.contains("child fetch"),
            "the child did not fetch: {log}"
        );
        proxy.set_nonblocking(true).unwrap();
        assert!(
            proxy.accept().is_err(),
            "the fetch went through the environment's proxy: {log}"
        );
    }

    #[test]
    fn file_names() {
        let n = |u: &str| url_file_name(&reqwest::Url::parse(u).unwrap());
        assert_eq!(n("http://h/a/b.tar.gz?x=1").as_deref(), Some("b.tar.gz"));
        assert_eq!(n("http://h/"), None);
        assert_eq!(n("http://h/a/"), None);
    }
}
