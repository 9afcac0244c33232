//! The S3 backend, through the `object_store` crate (also speaks to any S3-compatible server:
//! moto in tests, MinIO, R2...).
//!
//! Configuration comes from the environment as `object_store`'s `AmazonS3Builder::from_env`
//! reads it (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_ALLOW_HTTP` for a plain-HTTP test server...), then [`S3Options`] overrides (CLI flags).
//!
//! Primitives map onto S3 conditional requests (S3 API reference, PutObject, "Conditional
//! requests"): put-if-absent is `PutMode::Create` (`If-None-Match: *`), compare-and-swap is
//! `PutMode::Update` (`If-Match: <etag>`), or `PutMode::Create` when absence is expected.
//! Files above [`MULTIPART_THRESHOLD`] go up as multipart uploads in [`MULTIPART_PART_SIZE`]
//! parts. `object_store`'s own retry loop is switched off: [`super::retry::Retrying`] is the one
//! retry layer, and errors are classified here (5xx, 408, 429 and connection/timeout failures
//! are `Transient`).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as OsPath;
use object_store::{
    ClientOptions, GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion, WriteMultipart,
};
use tokio::io::AsyncReadExt;

use super::{Backend, BackendError, ObjectInfo, PutOutcome, Version, validate_key};
use crate::digest::{Hasher, Sha256Hash};

/// Files larger than this (bytes, 16 MiB) are uploaded with multipart upload.
pub const MULTIPART_THRESHOLD: u64 = 16 << 20;
/// Multipart part size in bytes (8 MiB; S3's minimum part size is 5 MiB).
pub const MULTIPART_PART_SIZE: usize = 8 << 20;
/// Parts of one multipart upload in flight at once.
pub const MULTIPART_CONCURRENCY: usize = 4;

/// Overrides on top of the environment. `None` keeps what the environment says.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    /// Endpoint URL, e.g. `http://127.0.0.1:9000`.
    pub endpoint: Option<String>,
    /// Region, e.g. `us-east-1`.
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Allow plain HTTP endpoints.
    pub allow_http: Option<bool>,
    /// Per-request timeout (default 30 s, `object_store`'s default).
    pub request_timeout: Option<Duration>,
    /// Connect timeout (default 5 s).
    pub connect_timeout: Option<Duration>,
}

impl S3Options {
    /// No overrides: everything from the environment (read when the store is opened).
    pub fn from_env() -> Self {
        Self::default()
    }
}

/// An S3 bucket and key prefix.
#[derive(Debug)]
pub struct S3Backend {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
}

impl S3Backend {
    /// Builds the client (no request is made). `prefix` has no leading or trailing `/`.
    pub fn open(bucket: &str, prefix: &str, opts: &S3Options) -> Result<Self, BackendError> {
        let url = if prefix.is_empty() {
            format!("s3://{bucket}")
        } else {
            format!("s3://{bucket}/{prefix}")
        };
        // reqwest is built without a TLS crypto provider of its own (the workspace's
        // "rustls-no-provider"): make ring the process's provider before a client exists, as the
        // registry client does. Err means one is installed already, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
        if let Some(e) = &opts.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(r) = &opts.region {
            b = b.with_region(r);
        }
        if let Some(k) = &opts.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(k) = &opts.secret_access_key {
            b = b.with_secret_access_key(k);
        }
        if let Some(a) = opts.allow_http {
            b = b.with_allow_http(a);
        }
        let mut client = ClientOptions::new()
            .with_timeout(opts.request_timeout.unwrap_or(Duration::from_secs(30)))
            .with_connect_timeout(opts.connect_timeout.unwrap_or(Duration::from_secs(5)));
        if let Some(a) = opts.allow_http {
            client = client.with_allow_http(a);
        } else if std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v == "true" || v == "1") {
            client = client.with_allow_http(true);
        }
        let retry = RetryConfig {
            max_retries: 0,
            ..RetryConfig::default()
        };
        let store = b
            .with_client_options(client)
            .with_retry(retry)
            .build()
            .map_err(|e| BackendError::Url {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            store: Arc::new(store),
            prefix: prefix.to_string(),
            url,
        })
    }

    fn path(&self, key: &str) -> Result<OsPath, BackendError> {
        validate_key(key)?;
        let full = if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{}", self.prefix, key)
        };
        OsPath::parse(full).map_err(|_| BackendError::InvalidKey(key.to_string()))
    }

    fn key_of(&self, loc: &OsPath) -> Option<String> {
        let s = loc.as_ref();
        if self.prefix.is_empty() {
            Some(s.to_string())
        } else {
            s.strip_prefix(&self.prefix)?
                .strip_prefix('/')
                .map(str::to_string)
        }
    }

    fn err(&self, op: &'static str, key: &str, e: object_store::Error) -> BackendError {
        classify(&self.url, op, key, e)
    }

    fn info(&self, meta: ObjectMeta) -> Option<ObjectInfo> {
        let key = self.key_of(&meta.location)?;
        Some(ObjectInfo {
            key,
            size: meta.size,
            modified: to_system_time(
                meta.last_modified.timestamp(),
                meta.last_modified.timestamp_subsec_nanos(),
            ),
            version: meta.e_tag.map(Version),
        })
    }
}

fn to_system_time(secs: i64, nanos: u32) -> SystemTime {
    if secs < 0 {
        return UNIX_EPOCH;
    }
    UNIX_EPOCH + Duration::new(secs as u64, nanos)
}

/// Maps an `object_store` error onto [`BackendError`], deciding what is transient.
/// `e` and each of its sources, rendered and joined with `: `, and whether any source is an
/// HTTP or I/O error (a failure below the HTTP status).
fn render_chain(e: &object_store::Error) -> (String, bool) {
    let mut message = e.to_string();
    let mut s = std::error::Error::source(e);
    let mut http = false;
    while let Some(inner) = s {
        message.push_str(": ");
        message.push_str(&inner.to_string());
        http |= inner
            .downcast_ref::<object_store::client::HttpError>()
            .is_some()
            || inner.downcast_ref::<std::io::Error>().is_some();
        s = inner.source();
    }
    (message, http)
}

/// The HTTP status in a rendered object_store error chain: the three digits after
/// "status code: " (object_store's `RequestError::Status` rendering), `None` without one.
fn http_status(message: &str) -> Option<u16> {
    message
        .split("status code: ")
        .nth(1)
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
}

/// Whether `e` is S3's answer to a range wholly past the end of an object: 416 InvalidRange
/// (RFC 9110 §15.5.17), which object_store passes on as a generic error. A missing key is its
/// own variant and never counts, whatever digits its message carries.
fn range_not_satisfiable(e: &object_store::Error) -> bool {
    !matches!(e, object_store::Error::NotFound { .. })
        && http_status(&render_chain(e).0) == Some(416)
}

fn classify(url: &str, op: &'static str, key: &str, e: object_store::Error) -> BackendError {
    use object_store::Error as E;
    let (message, http) = render_chain(&e);
    match &e {
        // S3 answers 404 both for a missing key and for a missing bucket (S3 API reference,
        // error code NoSuchBucket); only the first means "no object here".
        E::NotFound { .. } if message.contains("NoSuchBucket") => {
            return BackendError::Other {
                store: url.to_string(),
                op,
                key: key.to_string(),
                message: "the bucket does not exist (S3 NoSuchBucket)".to_string(),
            };
        }
        E::NotFound { .. } => {
            return BackendError::NotFound {
                store: url.to_string(),
                key: key.to_string(),
            };
        }
        E::AlreadyExists { .. } | E::Precondition { .. } => {
            return BackendError::Conflict {
                store: url.to_string(),
                key: key.to_string(),
            };
        }
        _ => {}
    }
    // object_store keeps its status-carrying error type private, so classify by its rendering:
    // "status code: 5xx/408/429", S3 error codes of retryable responses (S3 API reference,
    // "Error responses"), or a connection/IO-level failure with no HTTP status at all.
    let status = http_status(&message);
    let transient = match status {
        Some(c) => c >= 500 || c == 408 || c == 429,
        None => {
            http || [
                "InternalError",
                "ServiceUnavailable",
                "SlowDown",
                "RequestTimeout",
                "connection",
                "timed out",
            ]
            .iter()
            .any(|m| message.contains(m))
        }
    };
    if transient {
        BackendError::Transient {
            store: url.to_string(),
            key: key.to_string(),
            message,
        }
    } else {
        BackendError::Other {
            store: url.to_string(),
            op,
            key: key.to_string(),
            message,
        }
    }
}

#[async_trait::async_trait]
impl Backend for S3Backend {
    fn url(&self) -> &str {
        &self.url
    }

    async fn get(&self, key: &str) -> Result<Bytes, BackendError> {
        let p = self.path(key)?;
        let r = self
            .store
            .get(&p)
            .await
            .map_err(|e| self.err("get", key, e))?;
        r.bytes().await.map_err(|e| self.err("get", key, e))
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes, BackendError> {
        let p = self.path(key)?;
        if range.start >= range.end {
            return Ok(Bytes::new());
        }
        let opts = GetOptions {
            range: Some(range.into()),
            ..GetOptions::default()
        };
        match self.store.get_opts(&p, opts).await {
            Ok(r) => r.bytes().await.map_err(|e| self.err("get", key, e)),
            // A range wholly past the end reads as empty, as on the local backend.
            Err(e) if range_not_satisfiable(&e) => Ok(Bytes::new()),
            Err(e) => Err(self.err("get", key, e)),
        }
    }

    async fn get_versioned(&self, key: &str) -> Result<(Bytes, Version), BackendError> {
        let p = self.path(key)?;
        let r = self
            .store
            .get(&p)
            .await
            .map_err(|e| self.err("get", key, e))?;
        if r.meta.size > super::MAX_MUTABLE_LEN {
            return Err(super::too_large(&self.url, key, r.meta.size));
        }
        let etag = r.meta.e_tag.clone();
        let bytes = r.bytes().await.map_err(|e| self.err("get", key, e))?;
        let etag = etag.ok_or_else(|| BackendError::Other {
            store: self.url.clone(),
            op: "get",
            key: key.to_string(),
            message: "server returned no ETag".into(),
        })?;
        Ok((bytes, Version(etag)))
    }

    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, BackendError> {
        let p = self.path(key)?;
        match self.store.head(&p).await {
            Ok(m) => Ok(self.info(m)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", key, e)),
        }
    }

    async fn put_if_absent(
        &self,
        key: &str,
        data: Bytes,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let p = self.path(key)?;
        if let Some(expected) = expect_sha256 {
            let actual = Sha256Hash::of(&data);
            if actual != expected {
                return Err(BackendError::DigestMismatch {
                    store: self.url.clone(),
                    key: key.to_string(),
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        let opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self.store.put_opts(&p, PutPayload::from(data), opts).await {
            Ok(_) => Ok(PutOutcome::Created),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(PutOutcome::AlreadyExists),
            Err(e) => Err(self.err("put", key, e)),
        }
    }

    async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
        expect_sha256: Option<Sha256Hash>,
    ) -> Result<PutOutcome, BackendError> {
        let io = |e: std::io::Error| BackendError::Other {
            store: self.url.clone(),
            op: "put",
            key: key.to_string(),
            message: format!("reading {}: {e}", path.display()),
        };
        let size = tokio::fs::metadata(path).await.map_err(io)?.len();
        if size <= MULTIPART_THRESHOLD {
            let data = tokio::fs::read(path).await.map_err(io)?;
            return self
                .put_if_absent(key, Bytes::from(data), expect_sha256)
                .await;
        }
        if self.head(key).await?.is_some() {
            return Ok(PutOutcome::AlreadyExists);
        }
        // Hash first so that a mismatch never uploads anything.
        if let Some(expected) = expect_sha256 {
            let mut f = tokio::fs::File::open(path).await.map_err(io)?;
            let mut h = Hasher::new();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).await.map_err(io)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
            let actual = h.finish();
            if actual != expected {
                return Err(BackendError::DigestMismatch {
                    store: self.url.clone(),
                    key: key.to_string(),
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        let p = self.path(key)?;
        let upload = self
            .store
            .put_multipart(&p)
            .await
            .map_err(|e| self.err("put", key, e))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, MULTIPART_PART_SIZE);
        let mut f = tokio::fs::File::open(path).await.map_err(io)?;
        let mut buf = vec![0u8; MULTIPART_PART_SIZE];
        loop {
            let n = match read_full(&mut f, &mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(io(e));
                }
            };
            if n == 0 {
                break;
            }
            if let Err(e) = w.wait_for_capacity(MULTIPART_CONCURRENCY).await {
                let _ = w.abort().await;
                return Err(self.err("put", key, e));
            }
            w.write(&buf[..n]);
        }
        w.finish().await.map_err(|e| self.err("put", key, e))?;
        Ok(PutOutcome::Created)
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<Version, BackendError> {
        let p = self.path(key)?;
        let r = self
            .store
            .put(&p, PutPayload::from(data))
            .await
            .map_err(|e| self.err("put", key, e))?;
        Ok(Version(r.e_tag.unwrap_or_default()))
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Option<&Version>,
        data: Bytes,
    ) -> Result<Version, BackendError> {
        let p = self.path(key)?;
        let mode = match expected {
            None => PutMode::Create,
            Some(v) => PutMode::Update(UpdateVersion {
                e_tag: Some(v.0.clone()),
                version: None,
            }),
        };
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        let r = self
            .store
            .put_opts(&p, PutPayload::from(data), opts)
            .await
            .map_err(|e| self.err("cas", key, e))?;
        Ok(Version(r.e_tag.unwrap_or_default()))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let list_path = if dir.is_empty() {
            if self.prefix.is_empty() {
                None
            } else {
                Some(
                    OsPath::parse(&self.prefix)
                        .map_err(|_| BackendError::InvalidKey(prefix.into()))?,
                )
            }
        } else {
            Some(self.path(dir)?)
        };
        let metas: Vec<ObjectMeta> = self
            .store
            .list(list_path.as_ref())
            .try_collect()
            .await
            .map_err(|e| self.err("list", prefix, e))?;
        Ok(metas
            .into_iter()
            .filter_map(|m| self.info(m))
            .filter(|o| o.key.starts_with(prefix))
            .collect())
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        let p = self.path(key)?;
        match self.store.delete(&p).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }
}

async fn read_full(f: &mut tokio::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let r = f.read(&mut buf[n..]).await?;
        if r == 0 {
            break;
        }
        n += r;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boxed(m: &str) -> Box<dyn std::error::Error + Send + Sync> {
        m.into()
    }

    /// A missing key stayed "not found" for ranged reads only by chance: the message carries
    /// the request's elapsed time, and "in 1.416ms" was read as a 416 (seen in CI as an OCI
    /// reference that read as "" after its delete).
    #[test]
    fn a_missing_key_is_never_a_range_past_the_end() {
        let not_found = object_store::Error::NotFound {
            path: "refs/oci/x".into(),
            source: boxed(
                "Error performing GET http://127.0.0.1:4166/b/refs/oci/x in 1.416ms - \
                 Server returned non-2xx status code: 404 Not Found: NoSuchKey",
            ),
        };
        assert!(!range_not_satisfiable(&not_found));
        let past_end = object_store::Error::Generic {
            store: "S3",
            source: boxed(
                "Error performing GET http://127.0.0.1:4166/b/k in 2ms - \
                 Server returned non-2xx status code: 416 Range Not Satisfiable: InvalidRange",
            ),
        };
        assert!(range_not_satisfiable(&past_end));
        let other = object_store::Error::Generic {
            store: "S3",
            source: boxed("Error performing GET http://h/k in 4.16ms - connection reset"),
        };
        assert!(!range_not_satisfiable(&other));
        assert_eq!(
            http_status("status code: 503 Service Unavailable"),
            Some(503)
        );
        assert_eq!(http_status("no status"), None);
    }
}
