//! Each workspace's share of the tenants' listener: at most
//! [`crate::ServiceConfig::max_requests_per_workspace`] requests of one workspace in flight
//! at once, counted from the key's check until the response's body has been sent (a
//! `?follow=true` log stream counts for its whole life). One more gets 429 with
//! `Retry-After`; other workspaces' requests are not affected. Connections themselves,
//! with or without a key, are bounded per client address ([`crate::listen`]).

use std::collections::HashMap;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{FromRequestParts as _, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use hyper::body::{Body as HttpBody, Frame, SizeHint};

use crate::AppState;
use crate::api::ApiError;
use crate::auth::Workspace;

/// Places in flight per key (a workspace's requests here, a client address's connections
/// in [`crate::listen`]); only keys with one or more are kept.
#[derive(Debug)]
pub struct Shares<K = String> {
    max: usize,
    in_flight: Mutex<HashMap<K, usize>>,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    /// At most `max` places per key.
    pub fn new(max: usize) -> Self {
        Shares {
            max,
            in_flight: Mutex::default(),
        }
    }

    /// A place for one more under `key`, held until the guard drops; `None` when the key's
    /// share is in use.
    pub fn take(self: &Arc<Self>, key: &K) -> Option<ShareGuard<K>> {
        let mut m = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(key.clone()).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(ShareGuard {
            shares: Arc::clone(self),
            key: key.clone(),
        })
    }

    /// Places of `key` in use.
    pub fn in_flight(&self, key: &K) -> usize {
        let m = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        m.get(key).copied().unwrap_or(0)
    }
}

/// One place in its key's share, given back when dropped.
#[derive(Debug)]
pub struct ShareGuard<K: Hash + Eq = String> {
    shares: Arc<Shares<K>>,
    key: K,
}

impl<K: Hash + Eq> Drop for ShareGuard<K> {
    fn drop(&mut self) {
        let mut m = self
            .shares
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

/// The middleware of every `/v1` route: checks the key (401 without a valid one), takes a
/// place in the workspace's share (429 with `Retry-After` when it is in use), hands the
/// [`Workspace`] to the handler's extractor, and holds the place until the response's body
/// has ended.
pub async fn per_workspace(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let ws = match Workspace::from_request_parts(&mut parts, &s).await {
        Ok(ws) => ws,
        Err(e) => return e.into_response(),
    };
    let Some(guard) = s.shares.take(&ws.0) else {
        s.metrics
            .over_share
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            workspace = %ws.0,
            max = s.config.max_requests_per_workspace,
            "request refused: the workspace's requests in flight are at its share"
        );
        return ApiError::TooManyRequests(format!(
            "the workspace has {} requests in flight (log streams included), its share of \
             this server; retry when one has ended",
            s.config.max_requests_per_workspace
        ))
        .into_response();
    };
    parts.extensions.insert(ws);
    let resp = next.run(Request::from_parts(parts, body)).await;
    resp.map(|b| {
        Body::new(Held {
            inner: b,
            guard: Some(guard),
        })
    })
}

/// A response body that holds its request's [`ShareGuard`] until its last frame.
struct Held {
    inner: Body,
    guard: Option<ShareGuard>,
}

impl HttpBody for Held {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        // Released as the last frame is given, before the connection sends the end of the
        // body: a client that read the whole response finds the place free.
        match &r {
            Poll::Ready(None | Some(Err(_))) => this.guard = None,
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.guard = None,
            _ => {}
        }
        r
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

    #[test]
    fn a_workspace_gets_its_share_and_no_more() {
        let s = Arc::new(Shares::new(2));
        let a1 = s.take(&"a".to_string()).expect("first");
        let a2 = s.take(&"a".to_string()).expect("second");
        assert!(
            s.take(&"a".to_string()).is_none(),
            "a third of a is refused"
        );
        let b = s
            .take(&"b".to_string())
            .expect("another workspace is not affected");
        drop(a1);
        let a3 = s.take(&"a".to_string()).expect("a place came free");
        drop((a2, a3, b));
        assert_eq!(s.in_flight(&"a".to_string()), 0);
        assert!(
            s.in_flight.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }
}
