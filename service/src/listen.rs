//! The tenants' HTTP listener: one hyper HTTP/1.1 connection per accepted socket, with the
//! bounds a port open to untrusted clients needs, so that slow or many clients cannot hold
//! the server's descriptors:
//! - a request head (request line and headers) must arrive within
//!   [`ConnLimits::header_timeout`] of the connection's start or of the previous response
//!   (hyper's `header_read_timeout`); past it the connection is closed;
//! - a request body is bounded in time, on every route, by [`bound_bodies`]: one that sends
//!   nothing for [`ConnLimits::body_idle_timeout`] (the wait between two body frames), or
//!   that falls behind [`ConnLimits::min_body_rate`] once [`ConnLimits::body_rate_grace`]
//!   has passed, fails its request, which is answered 408 and its connection closed;
//! - a response whose writes make no progress for [`ConnLimits::send_timeout`] (a client
//!   that stopped reading) closes its connection (`tokio-io-timeout`'s write timeout);
//! - at most [`ConnLimits::max_connections`] connections are open at once, and at most
//!   [`ConnLimits::max_connections_per_ip`] from one client address; one more is closed as
//!   soon as it is accepted, without a byte read. The per-address bound is what keeps
//!   clients without a key (which no workspace's share counts) from taking every
//!   connection with kept-alive requests.
//!
//! The operator's listener (`--metrics-listen`) is not open to tenants and is served
//! without these bounds.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::api::ApiError;

/// The bounds of the tenants' listener (`kiln serve --header-timeout`,
/// `--body-idle-timeout`, `--min-body-rate`, `--body-rate-grace`, `--max-connections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Longest wait for a complete request head (default 10 s).
    pub header_timeout: Duration,
    /// Longest wait between two pieces of a request body (default 60 s).
    pub body_idle_timeout: Duration,
    /// Slowest average a request body may arrive at, bytes/s, once
    /// [`ConnLimits::body_rate_grace`] has passed (default 64 KiB/s; 0: no such bound). As
    /// Apache's `mod_reqtimeout` does it: a body must have ended `body_rate_grace` plus one
    /// second per `min_body_rate` bytes received after the server began reading it. So the
    /// largest context (1 GiB by default) has at most 10 s + 4.5 h, and one client holding a
    /// connection must send at least this much each second: holding all of
    /// `--max-connections` (4,096) costs it 256 MiB/s of upload. A tenant's link slower than
    /// 0.5 Mbit/s cannot upload.
    pub min_body_rate: u64,
    /// Time a request body has before [`ConnLimits::min_body_rate`] counts (default 10 s):
    /// a small body sent over a slow start is not held to the rate.
    pub body_rate_grace: Duration,
    /// Most connections open at once (default 4,096; the process's file limit must leave
    /// room for builds).
    pub max_connections: usize,
    /// Most connections open at once from one client IP address (default 256: clients
    /// behind one NAT share it).
    pub max_connections_per_ip: usize,
    /// Longest a response write may wait for the client to read (default 60 s).
    pub send_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            body_idle_timeout: Duration::from_secs(60),
            min_body_rate: 64 << 10,
            body_rate_grace: Duration::from_secs(10),
            max_connections: 4096,
            max_connections_per_ip: 256,
            send_timeout: Duration::from_secs(60),
        }
    }
}

/// Serves `app` on `listener` under `limits` until `stop` fires; then accepts no more
/// connections, lets each open one finish the request it is in (hyper's graceful shutdown)
/// and returns when all have closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    stop: CancellationToken,
) {
    let app = app.layer(axum::middleware::from_fn(move |req, next| {
        bound_bodies(limits, req, next)
    }));
    let max = limits
        .max_connections
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    let per_ip = Arc::new(crate::share::Shares::new(
        limits.max_connections_per_ip.max(1),
    ));
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => break,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted:
                    // wait a moment rather than spin.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(%peer, max = limits.max_connections, "connection refused: at the connection limit");
            drop(stream);
            continue;
        };
        let Some(ip_slot) = per_ip.take(&peer.ip()) else {
            tracing::debug!(%peer, max = limits.max_connections_per_ip, "connection refused: at the limit of its address");
            drop(stream);
            continue;
        };
        let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
        stream.set_write_timeout(Some(limits.send_timeout));
        let stream = Box::pin(stream);
        let service = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let r = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
            drop(ip_slot);
            drop(slot);
        });
    }
    // Every connection holds a slot until it closes.
    let _ = slots.acquire_many(max as u32).await;
}

/// The time bounds of a request body, on every route of the tenants' listener: the body
/// [`BoundedBody`] reads fails past [`ConnLimits::body_idle_timeout`] between two frames,
/// or past [`ConnLimits::min_body_rate`] after [`ConnLimits::body_rate_grace`]; then,
/// whatever the handler made of that error, the answer is 408 with an error body naming the
/// bound, and `Connection: close`.
pub async fn bound_bodies(limits: ConnLimits, req: Request, next: Next) -> Response {
    let tripped = Arc::new(OnceLock::new());
    let req = req.map(|b| Body::new(BoundedBody::new(b, limits, Arc::clone(&tripped))));
    let resp = next.run(req).await;
    match tripped.get() {
        None => resp,
        Some(why) => {
            let why: &String = why;
            tracing::info!(reason = %why, "request body too slow: answered 408, connection closed");
            let mut r = ApiError::RequestTimeout(why.clone()).into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        }
    }
}

/// A request body held to the time bounds of [`ConnLimits`]. Time counts from its first
/// read, and only while the reader waits for the client: a frame that has arrived is always
/// given.
pub struct BoundedBody {
    inner: Body,
    limits: ConnLimits,
    /// When the first read began.
    started: Option<Instant>,
    /// When the last frame arrived (or the first read began).
    last: Instant,
    /// Bytes received.
    bytes: u64,
    timer: Pin<Box<Sleep>>,
    /// Set, with the reason, when a bound was passed.
    tripped: Arc<OnceLock<String>>,
}

impl BoundedBody {
    /// `inner` under `limits`; `tripped` gets the reason when a bound is passed.
    pub fn new(inner: Body, limits: ConnLimits, tripped: Arc<OnceLock<String>>) -> Self {
        let now = Instant::now();
        BoundedBody {
            inner,
            limits,
            started: None,
            last: now,
            bytes: 0,
            timer: Box::pin(tokio::time::sleep_until(now)),
            tripped,
        }
    }

    /// The first moment a bound is passed, and which.
    fn deadline(&self, started: Instant) -> (Instant, String) {
        let idle = (
            self.last + self.limits.body_idle_timeout,
            format!(
                "the request body sent nothing for {} s",
                self.limits.body_idle_timeout.as_secs_f64()
            ),
        );
        if self.limits.min_body_rate == 0 {
            return idle;
        }
        let earned = Duration::from_secs_f64(self.bytes as f64 / self.limits.min_body_rate as f64);
        let rate = (
            started + self.limits.body_rate_grace + earned,
            format!(
                "the request body arrived slower than {} bytes/s (after the first {} s); \
                 {} bytes came in {:.1} s",
                self.limits.min_body_rate,
                self.limits.body_rate_grace.as_secs_f64(),
                self.bytes,
                started.elapsed().as_secs_f64()
            ),
        );
        if rate.0 < idle.0 { rate } else { idle }
    }
}

impl HttpBody for BoundedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(why) = this.tripped.get() {
            return Poll::Ready(Some(Err(axum::Error::new(why.clone()))));
        }
        let started = *this.started.get_or_insert_with(|| {
            this.last = Instant::now();
            this.last
        });
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => {
                    if let Some(d) = f.data_ref() {
                        this.bytes += d.len() as u64;
                    }
                    this.last = Instant::now();
                    return Poll::Ready(Some(Ok(f)));
                }
                Poll::Ready(other) => return Poll::Ready(other),
                Poll::Pending => {}
            }
            let (at, why) = this.deadline(started);
            if Instant::now() >= at {
                let why = this.tripped.get_or_init(|| why).clone();
                return Poll::Ready(Some(Err(axum::Error::new(why))));
            }
            this.timer.as_mut().reset(at);
            ready!(this.timer.as_mut().poll(cx));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounds as `mod_reqtimeout` counts them: the grace plus one second per
    /// `min_body_rate` bytes, unless the idle timeout comes first.
    #[test]
    fn a_body_must_end_the_grace_plus_a_second_per_rate_bytes() {
        let limits = ConnLimits {
            body_idle_timeout: Duration::from_secs(60),
            min_body_rate: 1000,
            body_rate_grace: Duration::from_secs(10),
            ..ConnLimits::default()
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let _g = rt.enter();
        let mut b = BoundedBody::new(Body::empty(), limits, Arc::default());
        let t0 = b.last;
        let (at, why) = b.deadline(t0);
        assert_eq!(at, t0 + Duration::from_secs(10));
        assert!(
            why.contains("slower than 1000 bytes/s (after the first 10 s)"),
            "{why}"
        );
        b.bytes = 5000;
        assert_eq!(b.deadline(t0).0, t0 + Duration::from_secs(15));
        // Past the idle timeout's moment, that one decides.
        b.bytes = 100_000;
        let (at, why) = b.deadline(t0);
        assert_eq!(at, t0 + Duration::from_secs(60));
        assert!(why.contains("sent nothing for 60 s"), "{why}");
        // No rate bound: the idle timeout alone.
        b.limits.min_body_rate = 0;
        b.bytes = 0;
        assert_eq!(b.deadline(t0).0, t0 + Duration::from_secs(60));
    }
}
