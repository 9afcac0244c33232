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
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path as OsPath;
use object_store::{
    ClientOptions, GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion, WriteMultipart,
};
use tokio::io::AsyncReadExt;

use super::{
    Backend, BackendError, LIST_PAGE_MAX, ListPage, ObjectInfo, PutOutcome, Version, validate_key,
};
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
    /// The same client, for page-by-page listing (`Backend::list_page`).
    lister: Arc<AmazonS3>,
    bucket: String,
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
        let store = Arc::new(store);
        Ok(Self {
            store: store.clone(),
            lister: store,
            bucket: bucket.to_string(),
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
        classify(&self.url, &self.bucket, op, key, e)
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

/// `e` and each of its sources, rendered and joined with `: ` (a source whose text the line
/// already holds is not said again: object_store's errors mostly include their source), and
/// whether any source is an HTTP or I/O error (a failure below the HTTP status).
fn render_chain(e: &object_store::Error) -> (String, bool) {
    let mut message = e.to_string();
    let mut s = std::error::Error::source(e);
    let mut http = false;
    while let Some(inner) = s {
        let text = inner.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
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

/// The status line after "status code: " (`403 Forbidden`) and the response body after it,
/// as object_store renders `RequestError::Status` (`...status code: {status}: {body}`).
fn status_and_body(message: &str) -> Option<(&str, &str)> {
    let rest = message.split_once("status code: ")?.1;
    Some(rest.split_once(": ").unwrap_or((rest, "")))
}

/// The text of the first `<name>` element of an XML document (no attributes: S3's error
/// elements have none), a CDATA section unwrapped and the five predefined entities (XML 1.0
/// §4.6) replaced, on one line.
fn xml_element(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let start = xml.find(&open)? + open.len();
    let len = xml[start..].find(&format!("</{name}>"))?;
    let raw = xml[start..start + len].trim();
    let text = match raw
        .strip_prefix("<![CDATA[")
        .and_then(|r| r.strip_suffix("]]>"))
    {
        Some(cdata) => cdata.to_string(),
        None => raw
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&"),
    };
    Some(one_line(&text))
}

/// `text` with every run of whitespace (newlines included) made one space.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `text` without anything between `<` and `>` (the tags of an HTML or XML page), each tag
/// replaced by a space.
fn strip_markup(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_tag = false;
    for c in text.chars() {
        match (in_tag, c) {
            (false, '<') => in_tag = true,
            (true, '>') => {
                in_tag = false;
                out.push(' ');
            }
            (false, c) => out.push(c),
            (true, _) => {}
        }
    }
    out
}

/// Longest response body kept in a message that is not an S3 error document (an HTML page
/// from a proxy, say), in characters.
const MAX_BODY_CHARS: usize = 200;

/// An S3 error response in one line, from object_store's rendering of it: the status line
/// and, from the body (S3 API reference, "Error responses": `<Error><Code>` and
/// `<Message>`), S3's error code and message, with the bucket named; the body's XML itself is
/// never shown. A body that is no S3 error document (an HTML page from a proxy) is shown as
/// text, without its tags, cut at [`MAX_BODY_CHARS`]. Returns the S3 error code too (`None`:
/// the body had none). A failure with no HTTP status (connection, timeout) is its error chain
/// on one line.
fn describe(message: &str, bucket: &str) -> (String, Option<String>) {
    let Some((status, body)) = status_and_body(message) else {
        return (one_line(message), None);
    };
    let status = one_line(status);
    match xml_element(body, "Code") {
        Some(code) => {
            let text = xml_element(body, "Message").unwrap_or_default();
            let line = if text.is_empty() {
                format!("S3 error {code} (HTTP {status}, bucket {bucket})")
            } else {
                format!("S3 error {code} (HTTP {status}, bucket {bucket}): {text}")
            };
            (line, Some(code))
        }
        None => {
            let body = one_line(&strip_markup(body));
            let line = if body.is_empty() {
                format!("HTTP {status} from bucket {bucket}, no error body")
            } else if body.chars().count() > MAX_BODY_CHARS {
                let cut: String = body.chars().take(MAX_BODY_CHARS).collect();
                format!("HTTP {status} from bucket {bucket}: {cut}...")
            } else {
                format!("HTTP {status} from bucket {bucket}: {body}")
            };
            (line, None)
        }
    }
}

/// Whether `e` says the bucket is missing (S3 error code NoSuchBucket, whatever variant
/// object_store made of the 404: `NotFound` for most requests, `Generic` for a list).
fn no_such_bucket(e: &object_store::Error) -> bool {
    let (message, _) = render_chain(e);
    status_and_body(&message)
        .is_some_and(|(_, body)| xml_element(body, "Code").is_some_and(|c| c == "NoSuchBucket"))
}

/// Whether `e` is "no object at this key": a 404 that is not a missing bucket.
fn missing_key(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. }) && !no_such_bucket(e)
}

/// Whether `e` is S3's answer to a range wholly past the end of an object: 416 InvalidRange
/// (RFC 9110 §15.5.17), which object_store passes on as a generic error. A missing key is its
/// own variant and never counts, whatever digits its message carries.
fn range_not_satisfiable(e: &object_store::Error) -> bool {
    !matches!(e, object_store::Error::NotFound { .. })
        && http_status(&render_chain(e).0) == Some(416)
}

/// Maps an `object_store` error onto [`BackendError`], deciding what is transient. Every
/// message is one line naming the bucket and S3's error code ([`describe`]); the store URL
/// and the key are the error's own fields.
fn classify(
    url: &str,
    bucket: &str,
    op: &'static str,
    key: &str,
    e: object_store::Error,
) -> BackendError {
    use object_store::Error as E;
    let (chain, http) = render_chain(&e);
    let (message, code) = describe(&chain, bucket);
    // S3 answers 404 both for a missing key and for a missing bucket (S3 API reference,
    // error code NoSuchBucket); only the first means "no object here".
    if code.as_deref() == Some("NoSuchBucket") {
        return BackendError::Other {
            store: url.to_string(),
            op,
            key: key.to_string(),
            message: format!("the bucket does not exist (S3 NoSuchBucket, bucket {bucket})"),
        };
    }
    match &e {
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
    let status = http_status(&chain);
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
            .any(|m| chain.contains(m))
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
            Err(e) if missing_key(&e) => Ok(None),
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

    fn ordered_listing(&self) -> bool {
        true
    }

    async fn list_page(
        &self,
        prefix: &str,
        start_after: &str,
        max: usize,
    ) -> Result<ListPage, BackendError> {
        let full = |k: &str| {
            if self.prefix.is_empty() {
                k.to_string()
            } else {
                format!("{}/{k}", self.prefix)
            }
        };
        validate_key(prefix.trim_end_matches('/'))?;
        let opts = PaginatedListOptions {
            offset: (!start_after.is_empty()).then(|| full(start_after)),
            max_keys: Some(max.clamp(1, LIST_PAGE_MAX)),
            ..PaginatedListOptions::default()
        };
        let r = self
            .lister
            .list_paginated(Some(&full(prefix)), opts)
            .await
            .map_err(|e| self.err("list_page", prefix, e))?;
        let mut objects: Vec<ObjectInfo> = r
            .result
            .objects
            .into_iter()
            .filter_map(|m| self.info(m))
            .filter(|o| o.key.starts_with(prefix))
            .collect();
        // S3 lists in key order; sorting costs nothing then and keeps the promise anyway.
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(ListPage {
            objects,
            truncated: r.page_token.is_some(),
        })
    }

    async fn delete(&self, key: &str) -> Result<(), BackendError> {
        let p = self.path(key)?;
        match self.store.delete(&p).await {
            Ok(()) => Ok(()),
            Err(e) if missing_key(&e) => Ok(()),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }

    async fn rename(&self, from: &str, to: &str) -> Result<(), BackendError> {
        let (src, dest) = (self.path(from)?, self.path(to)?);
        // CopyObject, then DeleteObject (object_store's `rename` would do the same, but this
        // keeps each step's error naming its key).
        self.store
            .copy(&src, &dest)
            .await
            .map_err(|e| self.err("rename", from, e))?;
        self.delete(from).await
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

    /// object_store's rendering of an error response: `Error performing {method} {url} in
    /// {elapsed} - Server returned non-2xx status code: {status}: {body}`.
    fn response(method: &str, path: &str, status: &str, body: &str) -> String {
        format!(
            "Error performing {method} http://127.0.0.1:9000/{path} in 2.1ms - Server \
             returned non-2xx status code: {status}: {body}"
        )
    }

    /// Issue 17, fault 4: S3 errors printed the server's XML, over several lines. Each is
    /// one line naming the bucket, the key and the S3 error code. The bodies are moto's
    /// (5.1.22, the CI's S3 server; AccessDenied from a moto started with authentication
    /// on, `INITIAL_NO_AUTH_ACTION_COUNT`, for an IAM user with no policy).
    #[test]
    fn s3_errors_are_one_line_with_bucket_key_and_code() {
        let denied = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>\n    \
                      <Code>AccessDenied</Code>\n    <Message><![CDATA[Access Denied]]></Message>\n    \
                      \n    <RequestID>7a62c49f-347e-4fc4-9331-6e8eEXAMPLE</RequestID>\n</Error>";
        let e = object_store::Error::PermissionDenied {
            path: "p/chunks/sha256/ab".into(),
            source: boxed(&response(
                "PUT",
                "b/p/chunks/sha256/ab",
                "403 Forbidden",
                denied,
            )),
        };
        let msg = classify("s3://b/p", "b", "put", "chunks/sha256/ab", e).to_string();
        assert_eq!(
            msg,
            "s3://b/p: put chunks/sha256/ab: S3 error AccessDenied (HTTP 403 Forbidden, \
             bucket b): Access Denied"
        );

        let no_bucket = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>\n    \
                         <Code>NoSuchBucket</Code>\n    <Message><![CDATA[The specified bucket \
                         does not exist]]></Message>\n    <BucketName>b</BucketName>\n</Error>";
        // A list's 404 is a generic error, not NotFound: it was printed whole.
        let e = object_store::Error::Generic {
            store: "S3",
            source: boxed(&format!(
                "Error performing list request: {}",
                response(
                    "GET",
                    "b?list-type=2&prefix=p%2Ftags%2F",
                    "404 Not Found",
                    no_bucket
                )
            )),
        };
        let msg = classify("s3://b/p", "b", "list", "tags/", e).to_string();
        assert_eq!(
            msg,
            "s3://b/p: list tags/: the bucket does not exist (S3 NoSuchBucket, bucket b)"
        );

        let slow = "<Error><Code>SlowDown</Code><Message>Please reduce your request rate &amp; \
                    retry.</Message></Error>";
        let e = object_store::Error::Generic {
            store: "S3",
            source: boxed(&response("PUT", "b/k", "503 Service Unavailable", slow)),
        };
        match classify("s3://b", "b", "put", "k", e) {
            BackendError::Transient { message, .. } => assert_eq!(
                message,
                "S3 error SlowDown (HTTP 503 Service Unavailable, bucket b): Please reduce \
                 your request rate & retry."
            ),
            other => panic!("not transient: {other:?}"),
        }

        // moto's answer to an unsigned request once authentication is on: an HTML page.
        let html = "<!doctype html>\n<html lang=en>\n<title>500 Internal Server Error</title>\n\
                    <h1>Internal Server Error</h1>\n<p>The server encountered an internal error \
                    and was unable to complete your request.</p>\n";
        let e = object_store::Error::Generic {
            store: "S3",
            source: boxed(&response("GET", "b/k", "500 Internal Server Error", html)),
        };
        let msg = classify("s3://b", "b", "get", "k", e).to_string();
        assert!(
            msg.starts_with(
                "s3://b: transient failure on k: HTTP 500 Internal Server Error from bucket b: \
                 500 Internal Server Error Internal Server Error The server"
            ) && !msg.contains('<')
                && !msg.contains('\n'),
            "{msg}"
        );
    }

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
