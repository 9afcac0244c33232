//! The guest end of the egress port ([`kiln_guest::egress`]): a TCP listener on
//! `127.0.0.1:`[`PROXY_PORT`] whose connections are carried, one stream each, to the host's
//! egress proxy. There is no network card: a step reaches the network only through this
//! listener, with the proxy variables the host puts in its environment. Without the port
//! (a `none` step, a sandbox) nothing listens, so a connection to the proxy port is refused.
//!
//! Threads, like the rest of the init: one reads the port and applies the host's frames
//! (it never writes to the port, so it always reads: a host writing to us while we write to
//! it cannot deadlock the two); one writes every frame to the port, in the order they were
//! queued; one accepts connections, at most [`MAX_STREAMS`] at once (the rest wait in the
//! listen backlog); per connection, one sends what the connection reads, within the credit
//! the host gives back, and one writes to the connection what the host sent, giving credit
//! back as it goes. What the writer holds is bounded by the credits: at most
//! [`kiln_guest::egress::INITIAL_WINDOW`] of `data` per stream.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use kiln_guest::egress::{
    Frame, FrameDecoder, HEADER_LEN, Kind, MAX_CREDIT, MAX_PAYLOAD, MAX_STREAMS, PORT_NAME,
    PROXY_PORT, Side, Table, Verdict,
};

use crate::{log, serve};

/// Looks for the egress port (waiting up to [`serve::PORT_WAIT`] when `wait`: the host said
/// it is there, `kiln.egress`) and, when there is one, starts listening and serving it.
/// Failures are logged: the step then reaches no proxy, as without the port.
pub fn start(wait: bool) {
    let wait = if wait {
        serve::PORT_WAIT
    } else {
        Duration::ZERO
    };
    let port = match serve::open_port_named(PORT_NAME, wait) {
        Ok(Some(p)) => p,
        Ok(None) => {
            if !wait.is_zero() {
                log!("no egress port {PORT_NAME}: the step reaches no proxy");
            }
            return;
        }
        Err(e) => {
            log!("the egress port: {e}");
            return;
        }
    };
    let listener = match TcpListener::bind((Ipv4Addr::LOCALHOST, PROXY_PORT)) {
        Ok(l) => l,
        Err(e) => {
            log!("listening on 127.0.0.1:{PROXY_PORT}: {e}");
            return;
        }
    };
    let reader = match port.try_clone() {
        Ok(r) => r,
        Err(e) => {
            log!("duplicating the egress port: {e}");
            return;
        }
    };
    let (out, rx) = mpsc::channel::<Frame>();
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            table: Table::new(Side::Guest),
            streams: HashMap::new(),
        }),
        slot: Condvar::new(),
        out,
    });
    spawn("egress-writer", move || write_port(port, rx));
    let s = shared.clone();
    spawn("egress-reader", move || read_port(reader, &s));
    spawn("egress-accept", move || accept(listener, &shared));
    log!("egress port {PORT_NAME} open; proxy on 127.0.0.1:{PROXY_PORT}");
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new().name(name.into()).spawn(f) {
        log!("starting {name}: {e}");
    }
}

struct Shared {
    state: Mutex<State>,
    /// Told when a stream ends (the acceptor waits for a free slot).
    slot: Condvar,
    /// Frames for the port's writer.
    out: mpsc::Sender<Frame>,
}

struct State {
    table: Table,
    streams: HashMap<u32, Local>,
}

/// The guest side of one stream.
struct Local {
    /// To the thread writing to the connection.
    down: mpsc::Sender<Down>,
    credit: Arc<Credit>,
    /// The connection, to shut it down when the stream is aborted.
    sock: TcpStream,
}

enum Down {
    Data(Vec<u8>),
    Eof,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, f: Frame) {
        let _ = self.out.send(f);
    }

    /// Forgets stream `id` (already gone from the table) and aborts its connection.
    fn drop_local(&self, st: &mut State, id: u32) {
        if let Some(l) = st.streams.remove(&id) {
            l.credit.close();
            let _ = l.sock.shutdown(Shutdown::Both);
        }
        self.slot.notify_all();
    }

    /// This end aborts `id`: tells the host once.
    fn abort(&self, id: u32) {
        let mut st = self.lock();
        if st.table.close(id) {
            self.send(Frame::bare(id, Kind::Close));
        }
        self.drop_local(&mut st, id);
    }

    /// Every stream ends (the host went away, or its framing broke).
    fn abort_all(&self) {
        let mut st = self.lock();
        let ids: Vec<u32> = st.streams.keys().copied().collect();
        for id in ids {
            st.table.close(id);
            self.drop_local(&mut st, id);
        }
    }
}

/// Sending credit of one stream; `None` once the stream is aborted.
struct Credit {
    bytes: Mutex<Option<u64>>,
    cv: Condvar,
}

impl Credit {
    /// Between 1 and `max` bytes of credit, waiting for some; `None`: the stream is aborted.
    fn take(&self, max: u64) -> Option<u64> {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match *b {
                None => return None,
                Some(n) if n > 0 => {
                    let k = n.min(max);
                    *b = Some(n - k);
                    return Some(k);
                }
                Some(_) => b = self.cv.wait(b).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }

    /// Gives `n` back; false when that is more than a stream can hold.
    fn give(&self, n: u64) -> bool {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = b.as_mut() {
            if *c + n > MAX_CREDIT {
                return false;
            }
            *c += n;
        }
        self.cv.notify_all();
        true
    }

    fn close(&self) {
        *self.bytes.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.cv.notify_all();
    }

    fn is_closed(&self) -> bool {
        self.bytes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }
}

fn write_port(mut port: fs::File, rx: mpsc::Receiver<Frame>) {
    for f in rx {
        // Blocks while the host is not connected (virtio-console), which it is from launch.
        if let Err(e) = port.write_all(&f.encode()) {
            log!("writing the egress port: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn read_port(mut port: fs::File, sh: &Shared) {
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; HEADER_LEN + MAX_PAYLOAD];
    let mut connected = false;
    loop {
        let n = match port.read(&mut buf) {
            Ok(0) => {
                // The host is not connected (virtio-console reads return 0): what depended on
                // it ends; a partial frame is dropped.
                if connected {
                    connected = false;
                    log!("the host left the egress port");
                    sh.abort_all();
                    decoder = FrameDecoder::new();
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log!("reading the egress port: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        connected = true;
        decoder.push(&buf[..n]);
        loop {
            let f = match decoder.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    // Nothing after a bad header can be trusted: every stream ends.
                    log!("bad frame on the egress port: {e}");
                    sh.abort_all();
                    decoder = FrameDecoder::new();
                    break;
                }
            };
            apply(sh, f);
        }
    }
}

/// Applies one frame of the host's.
fn apply(sh: &Shared, f: Frame) {
    let id = f.stream;
    let mut st = sh.lock();
    match st.table.incoming(f) {
        Verdict::Data(bytes) => {
            if let Some(l) = st.streams.get(&id) {
                let _ = l.down.send(Down::Data(bytes));
            }
        }
        Verdict::Eof { finished } => {
            if let Some(l) = st.streams.get(&id) {
                let _ = l.down.send(Down::Eof);
            }
            if finished {
                // The writer ends once it has written what it holds.
                st.streams.remove(&id);
                sh.slot.notify_all();
            }
        }
        Verdict::Closed => sh.drop_local(&mut st, id),
        Verdict::Window(n) => {
            let ok = st
                .streams
                .get(&id)
                .is_none_or(|l| l.credit.give(u64::from(n)));
            if !ok {
                st.table.close(id);
                sh.send(Frame::bare(id, Kind::Close));
                sh.drop_local(&mut st, id);
            }
        }
        Verdict::Refuse(why) => {
            log!("egress stream {id}: {why}; closing it");
            sh.send(Frame::bare(id, Kind::Close));
            sh.drop_local(&mut st, id);
        }
        Verdict::Open | Verdict::Ignore => {}
    }
}

fn accept(listener: TcpListener, sh: &Arc<Shared>) {
    loop {
        {
            let mut st = sh.lock();
            while st.table.len() >= MAX_STREAMS {
                st = sh.slot.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        }
        let sock = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                log!("accepting on the proxy port: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if let Err(e) = open(sh, sock) {
            log!("an egress stream: {e}");
        }
    }
}

/// Opens a stream for `sock` and starts its two threads.
fn open(sh: &Arc<Shared>, sock: TcpStream) -> std::io::Result<()> {
    let _ = sock.set_nodelay(true);
    let up_sock = sock.try_clone()?;
    let down_sock = sock.try_clone()?;
    let credit = Arc::new(Credit {
        bytes: Mutex::new(Some(MAX_CREDIT)),
        cv: Condvar::new(),
    });
    let (down, rx) = mpsc::channel();
    let id = {
        let mut st = sh.lock();
        let Some(id) = st.table.open() else {
            return Err(std::io::Error::other("no stream id left"));
        };
        st.streams.insert(
            id,
            Local {
                down,
                credit: credit.clone(),
                sock,
            },
        );
        // Queued before any frame of the stream's threads.
        sh.send(Frame::bare(id, Kind::Open));
        id
    };
    let s = sh.clone();
    let up = std::thread::Builder::new()
        .name(format!("egress-up-{id}"))
        .spawn(move || send_up(id, up_sock, &credit, &s));
    let s = sh.clone();
    let down = std::thread::Builder::new()
        .name(format!("egress-down-{id}"))
        .spawn(move || write_down(id, down_sock, rx, &s));
    if let Err(e) = up.and(down) {
        sh.abort(id);
        return Err(e);
    }
    Ok(())
}

/// Connection → host: `data` within the credit, then `eof` (`close` on an error).
fn send_up(id: u32, mut sock: TcpStream, credit: &Credit, sh: &Shared) {
    let mut buf = vec![0u8; MAX_PAYLOAD];
    loop {
        let Some(k) = credit.take(MAX_PAYLOAD as u64) else {
            return;
        };
        let k = k as usize;
        match sock.read(&mut buf[..k]) {
            Ok(0) => {
                if credit.is_closed() {
                    return;
                }
                let mut st = sh.lock();
                if st.table.contains(id) {
                    sh.send(Frame::bare(id, Kind::Eof));
                    if st.table.sent_eof(id) {
                        st.streams.remove(&id);
                        sh.slot.notify_all();
                    }
                }
                return;
            }
            Ok(n) => {
                credit.give((k - n) as u64);
                sh.send(Frame::data(id, buf[..n].to_vec()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                credit.give(k as u64);
            }
            Err(_) => {
                sh.abort(id);
                return;
            }
        }
    }
}

/// Host → connection: writes what arrived, gives the credit back, half-closes on `eof`.
fn write_down(id: u32, mut sock: TcpStream, rx: mpsc::Receiver<Down>, sh: &Shared) {
    for d in rx {
        match d {
            Down::Data(bytes) => {
                if sock.write_all(&bytes).is_err() {
                    sh.abort(id);
                    return;
                }
                let mut st = sh.lock();
                if st.table.drained(id, bytes.len() as u32) {
                    sh.send(Frame::window(id, bytes.len() as u32));
                }
            }
            Down::Eof => {
                let _ = sock.shutdown(Shutdown::Write);
                return;
            }
        }
    }
}
