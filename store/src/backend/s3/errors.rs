//! How the S3 backend reads `object_store`'s errors: each one becomes a [`BackendError`] of
//! one line naming the bucket, the key and S3's error code, and transient or final
//! ([`classify`]); and the few answers the backend treats as outcomes, not failures (a
//! missing key, a range past the end, a missing bucket).

use super::*;

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
///
/// A DeleteObjects answer that names the key with the code `NoSuchKey` counts too: S3 answers
/// "Deleted" for an absent key, some S3-compatible servers `NoSuchKey`, and either way
/// nothing is there (object_store 0.14 makes every delete a DeleteObjects request, and
/// renders the key's error as "... (code: NoSuchKey)").
pub(super) fn missing_key(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::NotFound { .. } => !no_such_bucket(e),
        object_store::Error::Generic { .. } => {
            let (chain, _) = render_chain(e);
            chain.contains("DeleteObjects request failed for key")
                && chain.contains("(code: NoSuchKey)")
        }
        _ => false,
    }
}

/// Whether `e` is S3's answer to a range wholly past the end of an object: 416 InvalidRange
/// (RFC 9110 §15.5.17), which object_store passes on as a generic error. A missing key is its
/// own variant and never counts, whatever digits its message carries.
pub(super) fn range_not_satisfiable(e: &object_store::Error) -> bool {
    !matches!(e, object_store::Error::NotFound { .. })
        && http_status(&render_chain(e).0) == Some(416)
}

/// Maps an `object_store` error onto [`BackendError`], deciding what is transient. Every
/// message is one line naming the bucket and S3's error code ([`describe`]); the store URL
/// and the key are the error's own fields.
pub(super) fn classify(
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
                // A DeleteObjects answer that could not be read (not XML, cut short, a key
                // that is not a key): what the server did is unknown, as with a lost reply,
                // and deleting again is harmless.
                "Got invalid DeleteObjects response",
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
