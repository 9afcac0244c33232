//! Pulling from and pushing to OCI registries, through `oci-client`.
//!
//! - Authentication: anonymous (bearer tokens fetched by `oci-client` from the registry's
//!   `WWW-Authenticate` challenge), basic auth, credentials from Docker's config
//!   ([`auth`]), or given explicitly.
//! - Transport: HTTPS, except plain HTTP for loopback registries (`127.0.0.0/8`,
//!   `localhost`, `[::1]`) and registries named in [`RegistryOptions::insecure`].
//! - Manifests are fetched raw; their digest is the sha256 of those bytes, checked against a
//!   pinned digest and against the index entry that named them. An index selects
//!   [`RegistryOptions::platform`] (linux/amd64 by default).
//! - Blobs stream to a file in the cache's ingest area (`pull_blob_stream`); a dropped
//!   connection resumes with a Range request (`pull_blob_stream_partial`) up to
//!   [`RegistryOptions::max_attempts`] times; the whole file is hashed before it becomes
//!   visible ([`BlobCache::commit`]); up to [`RegistryOptions::max_parallel`] blobs at once;
//!   blobs already cached are not fetched again.

pub mod auth;

use std::path::PathBuf;
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use oci_client::client::{BlobResponse, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};
use tokio::io::AsyncWriteExt;

use kiln_store::BlobDigest;

use crate::cache::{BlobCache, CacheError};
use crate::image::{AnyManifest, ImageError, MANIFEST_TYPES, Manifest, Platform};
use crate::oci_compat::LayerCompression;
use crate::reference::Reference;

pub use auth::Credentials;

/// Largest manifest or index response read from a registry, bytes: the 4 MiB bound the
/// distribution registry and containerd put on manifests. The body is read in pieces and the
/// read stops past this, so a hostile registry cannot make us buffer more.
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;

/// Errors talking to a registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry refused our credentials (or wants some).
    #[error("{registry}: authentication refused: {detail}")]
    Unauthorized {
        /// Registry host.
        registry: String,
        /// What the registry or client said.
        detail: String,
    },
    /// The manifest or blob does not exist.
    #[error("{reference}: not found: {detail}")]
    NotFound {
        /// The reference asked for.
        reference: String,
        /// What the registry said.
        detail: String,
    },
    /// Any other registry or transport failure.
    #[error("{reference}: {source}")]
    Client {
        /// The reference involved.
        reference: String,
        /// The client error.
        source: oci_client::errors::OciDistributionError,
    },
    /// Manifest bytes do not hash to the digest that named them.
    #[error("{reference}: manifest digest mismatch: expected {expected}, got {actual}")]
    ManifestDigest {
        /// The reference involved.
        reference: String,
        /// The digest asked for.
        expected: String,
        /// The digest of the bytes.
        actual: String,
    },
    /// A blob could not be fetched within the attempts allowed.
    #[error("{reference}: blob {digest}: gave up after {attempts} attempts: {last}")]
    BlobFetch {
        /// The reference involved.
        reference: String,
        /// Blob digest.
        digest: BlobDigest,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// A blob is larger than its descriptor says.
    #[error("{reference}: blob {digest}: more than the {size} bytes its descriptor gives")]
    BlobTooLarge {
        /// The reference involved.
        reference: String,
        /// Blob digest.
        digest: BlobDigest,
        /// Descriptor size, bytes.
        size: u64,
    },
    /// A manifest (or error) response longer than [`MAX_MANIFEST_BYTES`].
    #[error("{reference}: manifest response is over the {max}-byte limit")]
    ManifestTooLarge {
        /// The reference involved.
        reference: String,
        /// The limit, bytes.
        max: usize,
    },
    /// A file in the ingest area failed.
    #[error("ingest file {path}: {source}")]
    Ingest {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Plain HTTP to a registry not named insecure.
    #[error("{0}: refusing plain HTTP to a registry not named insecure")]
    Insecure(String),
    /// A manifest problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A cache problem.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A credentials file problem.
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    /// Something needed is not cached and the operation is offline.
    #[error("{0} is not in the store and --offline forbids asking a registry")]
    Offline(String),
    /// A zstd layer could not be gzipped for the push.
    #[error(transparent)]
    Compat(#[from] crate::oci_compat::CompatError),
    /// An index nests too deeply.
    #[error("{0}: indexes nested more than 4 levels")]
    NestedIndex(String),
}

/// How to talk to registries.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Registries (`host[:port]`) allowed over plain HTTP, besides loopback ones.
    pub insecure: Vec<String>,
    /// The platform an index resolves to.
    pub platform: Platform,
    /// Blobs fetched at once.
    pub max_parallel: usize,
    /// Attempts per blob (the first request plus resumes).
    pub max_attempts: u32,
    /// Docker config to read credentials from (`None`: none, as for a tenant's build).
    pub docker_config: Option<PathBuf>,
    /// Credentials that override the config file, for every registry.
    pub credentials: Option<Credentials>,
    /// An HTTP proxy (`http://HOST:PORT`) every connection of the client goes through:
    /// the registry, its token realm and the redirects it names. A tenant build's pulls
    /// use the egress proxy ([`crate::egress::proxy::Proxy::addresses_only`]). `None`:
    /// direct connections.
    pub proxy: Option<String>,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        RegistryOptions {
            insecure: Vec::new(),
            platform: Platform::linux_amd64(),
            max_parallel: 3,
            max_attempts: 6,
            docker_config: Some(auth::config_path()),
            credentials: None,
            proxy: None,
        }
    }
}

/// A reference resolved to a platform manifest.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The digest of the platform manifest.
    pub digest: BlobDigest,
    /// Its raw bytes.
    pub bytes: Vec<u8>,
    /// Parsed.
    pub manifest: Manifest,
    /// The index it was selected from: (digest, raw bytes).
    pub index: Option<(BlobDigest, Vec<u8>)>,
}

/// What a pull did.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The platform manifest digest now in the cache.
    pub digest: BlobDigest,
    /// Blobs downloaded (the others were cached already).
    pub fetched: usize,
    /// Bytes downloaded.
    pub fetched_bytes: u64,
}

/// A registry client for one set of options.
pub struct Registry {
    opts: RegistryOptions,
}

/// Installs rustls's ring provider once (reqwest is built without a default provider).
pub(crate) fn crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err means another provider is already installed, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn map_err(r: &Reference, e: oci_client::errors::OciDistributionError) -> RegistryError {
    use oci_client::errors::OciDistributionError as O;
    let text = e.to_string();
    match &e {
        O::AuthenticationFailure(_) | O::UnauthorizedError { .. } => RegistryError::Unauthorized {
            registry: r.registry().to_string(),
            detail: text,
        },
        O::ServerError {
            code: 401 | 403, ..
        } => RegistryError::Unauthorized {
            registry: r.registry().to_string(),
            detail: text,
        },
        O::ImageManifestNotFoundError(_) | O::ServerError { code: 404, .. } => {
            RegistryError::NotFound {
                reference: r.to_string(),
                detail: text,
            }
        }
        O::RegistryError { envelope, .. }
            if envelope.errors.iter().any(|x| {
                matches!(
                    x.code,
                    oci_client::errors::OciErrorCode::Unauthorized
                        | oci_client::errors::OciErrorCode::Denied
                )
            }) =>
        {
            RegistryError::Unauthorized {
                registry: r.registry().to_string(),
                detail: text,
            }
        }
        O::RegistryError { envelope, .. }
            if envelope.errors.iter().any(|x| {
                matches!(
                    x.code,
                    oci_client::errors::OciErrorCode::ManifestUnknown
                        | oci_client::errors::OciErrorCode::BlobUnknown
                        | oci_client::errors::OciErrorCode::NameUnknown
                )
            }) =>
        {
            RegistryError::NotFound {
                reference: r.to_string(),
                detail: text,
            }
        }
        _ => RegistryError::Client {
            reference: r.to_string(),
            source: e,
        },
    }
}

impl Registry {
    /// A client with these options.
    pub fn new(opts: RegistryOptions) -> Registry {
        crypto_provider();
        Registry { opts }
    }

    /// The options.
    pub fn options(&self) -> &RegistryOptions {
        &self.opts
    }

    /// The plain HTTP client of the requests kiln makes itself (the manifest GET), with the
    /// registry client's timeouts and, as every request of a pull, through
    /// [`RegistryOptions::proxy`] when there is one: the request and each redirect it
    /// follows.
    fn http_client(&self) -> Result<reqwest::Client, reqwest::Error> {
        let mut b = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .read_timeout(Duration::from_secs(120));
        if let Some(p) = &self.opts.proxy {
            b = b.proxy(reqwest::Proxy::all(p)?);
        }
        b.build()
    }

    fn client_for(&self, r: &Reference) -> Client {
        let plain = r.is_loopback() || self.opts.insecure.iter().any(|i| i == r.registry());
        Client::new(ClientConfig {
            protocol: if plain {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            platform_resolver: None,
            connect_timeout: Some(Duration::from_secs(30)),
            read_timeout: Some(Duration::from_secs(120)),
            http_proxy: self.opts.proxy.clone(),
            https_proxy: self.opts.proxy.clone(),
            ..ClientConfig::default()
        })
    }

    fn auth_for(&self, r: &Reference) -> Result<RegistryAuth, RegistryError> {
        let creds = match &self.opts.credentials {
            Some(c) => Some(c.clone()),
            None => match &self.opts.docker_config {
                Some(p) => auth::lookup(p, r.registry())?,
                None => None,
            },
        };
        Ok(match creds {
            Some(c) => RegistryAuth::Basic(c.username, c.password),
            None => RegistryAuth::Anonymous,
        })
    }

    /// Checks credentials against a registry (`GET /v2/_catalog?n=1` with them): Ok when the
    /// registry accepts them (or does not offer a catalog), [`RegistryError::Unauthorized`]
    /// when it refuses them.
    pub async fn check_login(
        &self,
        registry: &str,
        creds: &Credentials,
    ) -> Result<(), RegistryError> {
        let r: Reference = format!("{registry}/kiln-login-check")
            .parse()
            .map_err(|_| RegistryError::Insecure(registry.to_string()))?;
        let client = self.client_for(&r);
        let a = RegistryAuth::Basic(creds.username.clone(), creds.password.clone());
        match client.catalog(&r.to_oci(), &a, Some(1), None).await {
            Ok(_) => Ok(()),
            // oci-client reports a 401 as `UnauthorizedError` and a refused token request as
            // `AuthenticationFailure`; `map_err` makes both `Unauthorized`. Anything else
            // (no catalog, 404, 405) says nothing about the credentials.
            Err(e) => match map_err(&r, e) {
                e @ RegistryError::Unauthorized { .. } => Err(e),
                _ => Ok(()),
            },
        }
    }

    async fn fetch_manifest(
        &self,
        client: &Client,
        r: &Reference,
        auth: &RegistryAuth,
    ) -> Result<(BlobDigest, Vec<u8>), RegistryError> {
        // Not `pull_manifest_raw`: it buffers the whole body, however long. We take the
        // token from the client and read the body ourselves, bounded.
        use oci_client::errors::OciDistributionError as O;
        let oref = r.to_oci();
        let token = client
            .auth(&oref, auth, RegistryOperation::Pull)
            .await
            .map_err(|e| map_err(r, e))?;
        let plain = r.is_loopback() || self.opts.insecure.iter().any(|i| i == r.registry());
        let url = format!(
            "{}://{}/v2/{}/manifests/{}",
            if plain { "http" } else { "https" },
            oref.resolve_registry(),
            oref.repository(),
            oref.digest().or(oref.tag()).unwrap_or("latest"),
        );
        let http = self
            .http_client()
            .map_err(|e| map_err(r, O::RequestError(e)))?;
        let mut req = http
            .get(&url)
            .header(reqwest::header::ACCEPT, MANIFEST_TYPES.join(", "));
        req = match (token, auth) {
            (Some(t), _) => req.bearer_auth(t),
            (None, RegistryAuth::Basic(u, p)) => req.basic_auth(u, Some(p)),
            _ => req,
        };
        let mut res = req
            .send()
            .await
            .map_err(|e| map_err(r, O::RequestError(e)))?;
        let status = res.status();
        let mut bytes = Vec::new();
        while let Some(piece) = res
            .chunk()
            .await
            .map_err(|e| map_err(r, O::RequestError(e)))?
        {
            if bytes.len() + piece.len() > MAX_MANIFEST_BYTES {
                return Err(RegistryError::ManifestTooLarge {
                    reference: r.to_string(),
                    max: MAX_MANIFEST_BYTES,
                });
            }
            bytes.extend_from_slice(&piece);
        }
        if !status.is_success() {
            let message = String::from_utf8_lossy(&bytes[..bytes.len().min(4096)]).into_owned();
            return Err(map_err(
                r,
                O::ServerError {
                    code: status.as_u16(),
                    url,
                    message,
                },
            ));
        }
        let digest = BlobDigest::of(&bytes);
        if let Some(want) = r.digest()
            && want != digest.to_string()
        {
            return Err(RegistryError::ManifestDigest {
                reference: r.to_string(),
                expected: want.to_string(),
                actual: digest.to_string(),
            });
        }
        Ok((digest, bytes))
    }

    /// Resolves a reference to its platform manifest (through an index when there is one).
    pub async fn resolve(&self, r: &Reference) -> Result<Resolved, RegistryError> {
        let client = self.client_for(r);
        let auth = self.auth_for(r)?;
        self.resolve_with(&client, &auth, r).await
    }

    async fn resolve_with(
        &self,
        client: &Client,
        auth: &RegistryAuth,
        r: &Reference,
    ) -> Result<Resolved, RegistryError> {
        let (mut digest, mut bytes) = self.fetch_manifest(client, r, auth).await?;
        let mut index = None;
        for _ in 0..4 {
            match AnyManifest::parse(&bytes, &digest)? {
                AnyManifest::Image(manifest) => {
                    return Ok(Resolved {
                        digest,
                        bytes,
                        manifest,
                        index,
                    });
                }
                AnyManifest::Index(i) => {
                    let d = i.select(&self.opts.platform, &digest)?.digest;
                    let pinned = r.with_digest(&d);
                    let (got, b) = self.fetch_manifest(client, &pinned, auth).await?;
                    if index.is_none() {
                        index = Some((digest, bytes));
                    }
                    digest = got;
                    bytes = b;
                }
            }
        }
        Err(RegistryError::NestedIndex(r.to_string()))
    }

    /// Pulls an image into the cache: manifest (and index), config and every layer not
    /// cached yet; then points the reference's name at the manifest (when it has a tag).
    pub async fn pull(
        &self,
        r: &Reference,
        cache: &dyn BlobCache,
    ) -> Result<Pulled, RegistryError> {
        let client = self.client_for(r);
        let auth = self.auth_for(r)?;
        let res = self.resolve_with(&client, &auth, r).await?;
        let oref = r.to_oci();
        let mut descs = vec![res.manifest.config.clone()];
        descs.extend(res.manifest.layers.iter().cloned());
        let results: Vec<u64> = futures_util::stream::iter(descs.into_iter().map(|d| {
            let client = &client;
            let oref = &oref;
            async move {
                self.fetch_blob(client, r, oref, &d.digest, d.size, cache)
                    .await
            }
        }))
        .buffer_unordered(self.opts.max_parallel.max(1))
        .try_collect()
        .await?;
        if let Some((d, b)) = &res.index {
            cache.put_bytes(d, b)?;
        }
        cache.put_bytes(&res.digest, &res.bytes)?;
        if let Some(tag) = r.tag() {
            cache.set_ref(&format!("{}:{tag}", r.name()), &res.digest)?;
        }
        Ok(Pulled {
            digest: res.digest,
            fetched: results.iter().filter(|n| **n > 0).count(),
            fetched_bytes: results.iter().sum(),
        })
    }

    /// Fetches one blob into the cache, resuming after dropped connections. Returns the
    /// bytes downloaded (0 when it was cached).
    async fn fetch_blob(
        &self,
        client: &Client,
        r: &Reference,
        oref: &oci_client::Reference,
        digest: &BlobDigest,
        size: u64,
        cache: &dyn BlobCache,
    ) -> Result<u64, RegistryError> {
        if cache.blob_path(digest)?.is_some() {
            return Ok(0);
        }
        let part = cache.ingest_path(digest)?;
        let ingest = |source| RegistryError::Ingest {
            path: part.clone(),
            source,
        };
        // One writer per partial file: another pull of the same blob (in this process or
        // another) waits here, then finds the blob committed.
        let lock_path = part.with_extension("lock");
        let lock = {
            let lp = lock_path.clone();
            tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&lp)?;
                rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive)?;
                Ok(f)
            })
            .await
            .map_err(|e| ingest(std::io::Error::other(e)))?
            .map_err(ingest)?
        };
        if cache.blob_path(digest)?.is_some() {
            return Ok(0);
        }
        let _lock = lock;
        let mut attempts = 0u32;
        let mut downloaded = 0u64;
        let mut last = String::new();
        loop {
            let have = match tokio::fs::metadata(&part).await {
                Ok(m) => m.len(),
                Err(_) => 0,
            };
            if have == size && size > 0 {
                match cache.commit(&part, digest) {
                    Ok(_) => return Ok(downloaded),
                    // A bad partial file is gone now; start over (counts as an attempt).
                    Err(CacheError::Mismatch { actual, .. }) => {
                        last = format!("content hashed to {actual}");
                    }
                    Err(e) => return Err(e.into()),
                }
            } else if have > size {
                let _ = tokio::fs::remove_file(&part).await;
                continue;
            }
            if attempts >= self.opts.max_attempts {
                return Err(RegistryError::BlobFetch {
                    reference: r.to_string(),
                    digest: *digest,
                    attempts,
                    last,
                });
            }
            if attempts > 0 {
                tokio::time::sleep(Duration::from_millis(200 * (1 << attempts.min(5)))).await;
            }
            attempts += 1;
            let have = match tokio::fs::metadata(&part).await {
                Ok(m) => m.len(),
                Err(_) => 0,
            };
            let digest_str = digest.to_string();
            let resp = if have == 0 {
                client
                    .pull_blob_stream(oref, digest_str.as_str())
                    .await
                    .map(BlobResponse::Full)
            } else {
                client
                    .pull_blob_stream_partial(oref, digest_str.as_str(), have, None)
                    .await
            };
            let (stream, append) = match resp {
                Ok(BlobResponse::Full(s)) => (s, false),
                Ok(BlobResponse::Partial(s)) => (s, true),
                Err(e) => match map_err(r, e) {
                    e @ (RegistryError::Unauthorized { .. } | RegistryError::NotFound { .. }) => {
                        return Err(e);
                    }
                    e => {
                        last = e.to_string();
                        continue;
                    }
                },
            };
            let mut file = tokio::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(append)
                .truncate(!append)
                .open(&part)
                .await
                .map_err(ingest)?;
            let mut written = if append { have } else { 0 };
            let mut stream = stream.stream;
            let mut failed = false;
            while let Some(chunk) = stream.next().await {
                match chunk {
                    Ok(b) => {
                        written += b.len() as u64;
                        if written > size {
                            drop(file);
                            let _ = tokio::fs::remove_file(&part).await;
                            return Err(RegistryError::BlobTooLarge {
                                reference: r.to_string(),
                                digest: *digest,
                                size,
                            });
                        }
                        file.write_all(&b).await.map_err(ingest)?;
                        downloaded += b.len() as u64;
                    }
                    Err(e) => {
                        last = format!("stream broke at byte {written}: {e}");
                        tracing::warn!(%digest, written, "blob download interrupted; resuming");
                        failed = true;
                        break;
                    }
                }
            }
            file.flush().await.map_err(ingest)?;
            file.sync_all().await.map_err(ingest)?;
            if !failed && written < size {
                last = format!("stream ended at byte {written} of {size}");
            }
            if !failed && size == 0 {
                cache.commit(&part, digest)?;
                return Ok(downloaded);
            }
        }
    }

    /// Pushes an image from the cache (manifest `digest`) to `dst`, blobs first (skipping
    /// those the registry has), then the manifest's raw bytes, so its digest is unchanged;
    /// unless, with [`LayerCompression::Gzip`], it has zstd layers (a kiln build's), which
    /// are pushed gzipped, under a manifest of their own, for consumers that read no zstd
    /// ([`crate::oci_compat`]). Returns the digest of the manifest pushed.
    pub async fn push(
        &self,
        cache: &dyn BlobCache,
        digest: &BlobDigest,
        dst: &Reference,
        layers: LayerCompression,
    ) -> Result<BlobDigest, RegistryError> {
        let client = self.client_for(dst);
        let auth = self.auth_for(dst)?;
        let oref = dst.to_oci();
        client
            .auth(&oref, &auth, RegistryOperation::Push)
            .await
            .map_err(|e| map_err(dst, e))?;
        client
            .store_auth_if_needed(oref.resolve_registry(), &auth)
            .await;
        let bytes = cache
            .read_blob(digest)?
            .ok_or_else(|| RegistryError::Offline(digest.to_string()))?;
        let AnyManifest::Image(m) = AnyManifest::parse(&bytes, digest)? else {
            return Err(RegistryError::Offline(format!(
                "{digest} (an index; push a platform manifest)"
            )));
        };
        let tmp = std::env::temp_dir();
        let crate::oci_compat::Outgoing {
            bytes,
            digest,
            manifest: m,
            mut gzipped,
        } = crate::oci_compat::outgoing(cache, bytes, digest, m, layers, &tmp)?;
        let digest = &digest;
        let media_type = m
            .media_type
            .clone()
            .unwrap_or_else(|| crate::image::OCI_MANIFEST.to_string());
        for d in std::iter::once(&m.config).chain(&m.layers) {
            let digest_str = d.digest.to_string();
            if client
                .blob_exists(&oref, &digest_str)
                .await
                .map_err(|e| map_err(dst, e))?
            {
                continue;
            }
            let data = match gzipped.iter_mut().find(|g| g.digest == d.digest) {
                Some(g) => {
                    let mut data = Vec::with_capacity(g.size as usize);
                    std::io::Read::read_to_end(&mut g.file, &mut data).map_err(|source| {
                        crate::oci_compat::CompatError::Io {
                            digest: g.from,
                            dir: tmp.clone(),
                            source,
                        }
                    })?;
                    data
                }
                None => cache
                    .read_blob(&d.digest)?
                    .ok_or_else(|| RegistryError::Offline(digest_str.clone()))?,
            };
            client
                .push_blob(&oref, data, &digest_str)
                .await
                .map_err(|e| map_err(dst, e))?;
        }
        let ct = reqwest_header(&media_type);
        client
            .push_manifest_raw(&oref, bytes, ct)
            .await
            .map_err(|e| map_err(dst, e))?;
        Ok(*digest)
    }
}

fn reqwest_header(v: &str) -> http::HeaderValue {
    http::HeaderValue::from_str(v)
        .unwrap_or_else(|_| http::HeaderValue::from_static(crate::image::OCI_MANIFEST))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};

    /// A fault injector for what a real registry never does: answers `/v2/` with 200 and every
    /// manifest request with a 200 body of `body_len` bytes (no length header, then close).
    /// Returns its address.
    fn endless_registry(body_len: usize) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut c) = conn else { return };
                let mut r = BufReader::new(c.try_clone().expect("clone"));
                let mut first = String::new();
                let _ = r.read_line(&mut first);
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                        break;
                    }
                }
                if first.starts_with("GET /v2/ ") {
                    let _ = c.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
                    );
                    continue;
                }
                let _ = c.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nConnection: close\r\n\r\n",
                );
                let block = vec![b' '; 64 << 10];
                let mut sent = 0;
                while sent < body_len {
                    if c.write_all(&block).is_err() {
                        break;
                    }
                    sent += block.len();
                }
            }
        });
        addr
    }

    #[test]
    fn an_oversized_manifest_response_is_refused_not_buffered() {
        // 1 GiB offered; the client must stop reading just past the 4 MiB bound.
        let addr = endless_registry(1 << 30);
        let reg = Registry::new(RegistryOptions::default());
        let r: Reference = format!("{addr}/x:t").parse().expect("reference");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        match rt.block_on(reg.resolve(&r)) {
            Err(RegistryError::ManifestTooLarge { max, .. }) => assert_eq!(max, MAX_MANIFEST_BYTES),
            other => panic!("expected ManifestTooLarge, got {other:?}"),
        }
    }
}
