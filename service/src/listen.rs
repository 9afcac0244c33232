//! The tenants' HTTP listener: one hyper HTTP/1.1 connection per accepted socket, with the
//! bounds a port open to untrusted clients needs, so that slow or many clients cannot hold
//! the server's descriptors:
//! - a request head (request line and headers) must arrive within
//!   [`ConnLimits::header_timeout`] of the connection's start or of the previous response
//!   (hyper's `header_read_timeout`); past it the connection is closed;
//! - a request body that sends nothing for [`ConnLimits::body_idle_timeout`] fails its
//!   request (tower-http's request body timeout: the wait between two body frames), which
//!   is answered and the connection closed;
//! - at most [`ConnLimits::max_connections`] connections are open at once; one more is
//!   closed as soon as it is accepted, without a byte read.
//!
//! The operator's listener (`--metrics-listen`) is not open to tenants and is served
//! without these bounds.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio_util::sync::CancellationToken;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// The bounds of the tenants' listener (`kiln serve --header-timeout`,
/// `--body-idle-timeout`, `--max-connections`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Longest wait for a complete request head (default 10 s).
    pub header_timeout: Duration,
    /// Longest wait between two pieces of a request body (default 60 s).
    pub body_idle_timeout: Duration,
    /// Most connections open at once (default 4,096; the process's file limit must leave
    /// room for builds).
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_timeout: Duration::from_secs(10),
            body_idle_timeout: Duration::from_secs(60),
            max_connections: 4096,
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
    let app = app.layer(RequestBodyTimeoutLayer::new(limits.body_idle_timeout));
    let max = limits
        .max_connections
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
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
            drop(slot);
        });
    }
    // Every connection holds a slot until it closes.
    let _ = slots.acquire_many(max as u32).await;
}
