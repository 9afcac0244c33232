//! A TCP fault injector: a proxy on 127.0.0.1 in front of a real server (moto's S3, a
//! registry) that forwards bytes both ways and, at chosen points of the upload stream, resets
//! or stalls the connection carrying them. It stands in for a network failure the real server
//! cannot produce; everything it forwards is real protocol to the real server.
//!
//! Faults are placed by the cumulative count of client-to-server bytes across all connections
//! (so "drop at 3 MiB" hits mid-upload whatever the request boundaries are): [`FaultProxy::arm`]
//! takes the byte offsets and what to do there. Each offset fires once.
//!
//! It can also stall by what a request asks for ([`FaultProxy::stall_requests_containing`]):
//! a connection whose client bytes contain a given text (such as `/chunks/sha256/`, in the
//! request line of every chunk GET) forwards nothing more, standing in for a store that stops
//! answering those reads while the rest of the protocol goes on.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What happens to the connection that carries the byte at an armed offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward up to the offset, then close both sides at once with a TCP reset (the client
    /// sees "connection reset" mid-request).
    Reset,
    /// Forward up to the offset, then forward nothing more in either direction for this long,
    /// then close (the client sees a hung request; its timeout should fire first).
    Stall(Duration),
}

#[derive(Debug, Default)]
struct Plan {
    /// (cumulative upload offset in bytes, fault), ascending.
    pending: VecDeque<(u64, Fault)>,
    /// Client bytes that make their connection stall (forward nothing more) for this long,
    /// any of them.
    stall_matching: Vec<(Vec<u8>, Duration)>,
}

/// A running proxy. Dropping it stops accepting (connections in flight finish on their own).
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    plan: Arc<Mutex<Plan>>,
    uploaded: Arc<AtomicU64>,
    fired: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on an ephemeral 127.0.0.1 port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST.into(), upstream).await
    }

    /// Starts a proxy on an ephemeral port of the local address `on` forwarding to
    /// `upstream` (`host:port`): with no fault armed, a plain forwarder, such as one that
    /// makes a server on 127.0.0.1 reachable from a network namespace
    /// ([`crate::netns::Netns::host_ip`]).
    pub async fn start_on(on: std::net::IpAddr, upstream: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind((on, 0)).await?;
        let addr = listener.local_addr()?;
        let plan = Arc::new(Mutex::new(Plan::default()));
        let uploaded = Arc::new(AtomicU64::new(0));
        let fired = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let upstream = upstream.to_string();
        let accept = {
            let (plan, uploaded, fired, connections) = (
                plan.clone(),
                uploaded.clone(),
                fired.clone(),
                connections.clone(),
            );
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::SeqCst);
                    let (plan, uploaded, fired, upstream) = (
                        plan.clone(),
                        uploaded.clone(),
                        fired.clone(),
                        upstream.clone(),
                    );
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(&upstream).await {
                            relay(client, server, plan, uploaded, fired).await;
                        }
                    });
                }
            })
        };
        Ok(Self {
            addr,
            plan,
            uploaded,
            fired,
            connections,
            accept,
        })
    }

    /// Its `ADDR:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR:PORT`, to use as the client's endpoint.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Arms faults at cumulative upload offsets (bytes from now, client to server), in any
    /// order. Replaces faults armed before that have not fired.
    pub fn arm(&self, faults: impl IntoIterator<Item = (u64, Fault)>) {
        let base = self.uploaded.load(Ordering::SeqCst);
        let mut v: Vec<(u64, Fault)> = faults.into_iter().map(|(o, f)| (base + o, f)).collect();
        v.sort_by_key(|(o, _)| *o);
        lock(&self.plan).pending = v.into();
    }

    /// From now on, a client read that contains `needle` is not forwarded, and its connection
    /// forwards nothing more in either direction for `stall` (then closes); other
    /// connections go on. Each such stall counts as a fault fired. Each call adds a needle: a
    /// read containing any of them stalls.
    pub fn stall_requests_containing(&self, needle: &[u8], stall: Duration) {
        lock(&self.plan)
            .stall_matching
            .push((needle.to_vec(), stall));
    }

    /// Faults fired so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::SeqCst)
    }

    /// Faults armed and not fired yet.
    pub fn pending(&self) -> usize {
        lock(&self.plan).pending.len()
    }

    /// Client-to-server bytes forwarded so far.
    pub fn uploaded(&self) -> u64 {
        self.uploaded.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn lock(plan: &Mutex<Plan>) -> std::sync::MutexGuard<'_, Plan> {
    // No code panics while holding this lock; recover the data if it ever were poisoned.
    plan.lock().unwrap_or_else(|p| p.into_inner())
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    plan: Arc<Mutex<Plan>>,
    uploaded: Arc<AtomicU64>,
    fired: Arc<AtomicU64>,
) {
    let (mut client_rd, mut client_wr) = client.into_split();
    let (mut server_rd, mut server_wr) = server.into_split();
    // Server to client: plain copy until either side closes or the fault asks for the write
    // half back (to reset the client connection).
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let down = tokio::spawn(async move {
        tokio::select! {
            _ = tokio::io::copy(&mut server_rd, &mut client_wr) => {
                let _ = client_wr.shutdown().await;
            }
            _ = stopped => {}
        }
        client_wr
    });
    let mut buf = vec![0u8; 64 << 10];
    let fault = loop {
        let n = match client_rd.read(&mut buf).await {
            Ok(0) | Err(_) => break None,
            Ok(n) => n as u64,
        };
        // Claim this read's byte range [start, start + n) and see whether a fault falls in it.
        let matched = {
            let p = lock(&plan);
            p.stall_matching.iter().find_map(|(needle, d)| {
                buf[..n as usize]
                    .windows(needle.len())
                    .any(|w| w == needle.as_slice())
                    .then_some(*d)
            })
        };
        if let Some(d) = matched {
            fired.fetch_add(1, Ordering::SeqCst);
            break Some(Fault::Stall(d));
        }
        let (start, hit) = {
            let mut p = lock(&plan);
            let start = uploaded.fetch_add(n, Ordering::SeqCst);
            let hit = match p.pending.front() {
                Some(&(at, f)) if at < start + n => {
                    p.pending.pop_front();
                    Some((at.max(start), f))
                }
                _ => None,
            };
            (start, hit)
        };
        match hit {
            None => {
                if server_wr.write_all(&buf[..n as usize]).await.is_err() {
                    break None;
                }
            }
            Some((at, f)) => {
                let keep = (at - start) as usize;
                let _ = server_wr.write_all(&buf[..keep]).await;
                fired.fetch_add(1, Ordering::SeqCst);
                break Some(f);
            }
        }
    };
    match fault {
        None => {
            let _ = server_wr.shutdown().await;
            let _ = down.await;
        }
        Some(Fault::Stall(d)) => {
            tokio::time::sleep(d).await;
            let _ = stop.send(());
            let _ = down.await;
        }
        Some(Fault::Reset) => {
            let _ = stop.send(());
            if let Ok(wr) = down.await
                && let Ok(c) = client_rd.reunite(wr)
            {
                // Linger 0 turns the close into a TCP reset.
                let _ = c.set_zero_linger();
            }
        }
    }
}
