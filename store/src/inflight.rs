//! Chunk reads in flight in one process, so that a read of a chunk another task is already
//! fetching waits for that fetch and takes its bytes instead of sending a request of its own.
//!
//! Why (issue 35): a lazy clone's chunk server prefetches its list in batches while the
//! clone's first page faults ask for the same chunks. Each fault fetched the chunk again: in
//! a Debian clone cold from the local S3 server, about 85 of the 290 requests of the start
//! were such second reads (a ranged GET of the pack and a HEAD of its dead marker each),
//! queued behind the prefetch on the one server.
//!
//! A read [`InFlight::claim`]s each digest it is about to fetch. The first claim of a digest
//! gets a [`Fetching`] guard, which hands the raw (verified) bytes to every waiter when the
//! fetch succeeds ([`Fetching::done`]); dropped without them (an error, a cancelled read), it
//! lets the waiters go without bytes, and each then reads the chunk itself, as it would have
//! without this map; so does a waiter that has waited as long as one read of its own may
//! take ([`Waiter::bytes`]). A later claim of a digest in flight gets a [`Waiter`]. Nothing is kept
//! once a fetch ends: the read cache ([`crate::readcache`]) is what keeps chunks.
//!
//! A reader fetches everything it claimed before it waits for anything another reader
//! claimed, so no two readers wait for each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;

use crate::digest::ChunkDigest;

type Map = Mutex<HashMap<ChunkDigest, watch::Receiver<Option<Bytes>>>>;

/// The chunk reads in flight, shared by every clone of one [`crate::Store`].
#[derive(Debug, Default, Clone)]
pub(crate) struct InFlight {
    map: Arc<Map>,
}

/// What [`InFlight::claim`] gives.
pub(crate) enum Claim {
    /// This reader fetches the chunk.
    Mine(Fetching),
    /// Another reader is fetching it.
    Theirs(Waiter),
}

/// The claim of the reader that fetches a chunk: its waiters are released when it is dropped,
/// with the bytes if [`Fetching::done`] gave them.
pub(crate) struct Fetching {
    digest: ChunkDigest,
    tx: watch::Sender<Option<Bytes>>,
    map: Arc<Map>,
}

/// A reader waiting for another's fetch of a chunk.
pub(crate) struct Waiter(watch::Receiver<Option<Bytes>>);

impl InFlight {
    /// Claims `digest`: [`Claim::Mine`] if no read of it is in flight in this process,
    /// else [`Claim::Theirs`].
    pub(crate) fn claim(&self, digest: ChunkDigest) -> Claim {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rx) = map.get(&digest) {
            return Claim::Theirs(Waiter(rx.clone()));
        }
        let (tx, rx) = watch::channel(None);
        map.insert(digest, rx);
        Claim::Mine(Fetching {
            digest,
            tx,
            map: self.map.clone(),
        })
    }

    /// How many chunks are being fetched (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Fetching {
    /// The fetch succeeded: `raw` (decoded and verified) goes to every waiter, and to every
    /// claim of the digest until this guard is dropped (the fetcher keeps it while it writes
    /// the chunk into the read cache, so that no read in between fetches it again).
    pub(crate) fn done(&self, raw: &Bytes) {
        self.tx.send_replace(Some(raw.clone()));
    }
}

impl Drop for Fetching {
    fn drop(&mut self) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.digest);
        // The sender goes with `self`: a waiter still waiting sees the channel closed.
    }
}

impl Waiter {
    /// The bytes the fetching reader got, or `None` if it ended without them or had not
    /// got them within `within` (the waiter then reads the chunk itself). The bound is the
    /// store's on one read ([`crate::backend::retry::RetryPolicy::operation_timeout`]): a
    /// waiter gives up no later than its own read would have, whatever bounds the fetcher
    /// (a lazy clone's page fault must fail within the chunk server's read bound even when
    /// the prefetch it waits for is stalled; `kiln/tests/vm_lazy.rs`, case 4).
    pub(crate) async fn bytes(mut self, within: Duration) -> Option<Bytes> {
        match tokio::time::timeout(within, self.0.wait_for(Option::is_some)).await {
            Ok(Ok(v)) => return v.clone(),
            Ok(Err(_)) => {}
            Err(_) => return None,
        }
        // Closed: the fetcher is gone; it may still have sent the bytes just before.
        self.0.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_read_waits_for_the_first_and_gets_its_bytes() {
        let f = InFlight::default();
        let d = ChunkDigest::of(b"x");
        let Claim::Mine(mine) = f.claim(d) else {
            panic!("the first claim fetches")
        };
        let Claim::Theirs(w) = f.claim(d) else {
            panic!("the second claim waits")
        };
        let waiting = tokio::spawn(w.bytes(Duration::from_secs(60)));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        mine.done(&Bytes::from_static(b"raw"));
        assert_eq!(waiting.await.unwrap().as_deref(), Some(&b"raw"[..]));
        // Done, but the fetcher still holds its claim (it writes the read cache): a claim
        // now takes the bytes at once, and fetches nothing.
        let Claim::Theirs(late) = f.claim(d) else {
            panic!("a claim between done and the end of the fetch waits")
        };
        assert_eq!(
            late.bytes(Duration::from_millis(1)).await.as_deref(),
            Some(&b"raw"[..])
        );
        drop(mine);
        assert_eq!(f.len(), 0, "nothing kept once the fetch ended");
        assert!(matches!(f.claim(d), Claim::Mine(_)));
    }

    #[tokio::test]
    async fn a_failed_or_cancelled_fetch_lets_its_waiters_go_without_bytes() {
        let f = InFlight::default();
        let d = ChunkDigest::of(b"y");
        let Claim::Mine(mine) = f.claim(d) else {
            panic!("the first claim fetches")
        };
        let Claim::Theirs(w) = f.claim(d) else {
            panic!("the second claim waits")
        };
        let waiting = tokio::spawn(w.bytes(Duration::from_secs(60)));
        drop(mine);
        assert_eq!(waiting.await.unwrap(), None);
        assert_eq!(f.len(), 0);
    }

    #[tokio::test]
    async fn a_waiter_stops_waiting_for_a_stalled_fetch_at_its_bound() {
        let f = InFlight::default();
        let d = ChunkDigest::of(b"z");
        let Claim::Mine(_stalled) = f.claim(d) else {
            panic!("the first claim fetches")
        };
        let Claim::Theirs(w) = f.claim(d) else {
            panic!("the second claim waits")
        };
        let t = std::time::Instant::now();
        assert_eq!(w.bytes(Duration::from_millis(200)).await, None);
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(10),
            "{waited:?}"
        );
    }
}
