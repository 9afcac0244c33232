//! The host end of a build step VM's egress port ([`kiln_guest::egress`], which defines the
//! frames, the flow control and the rules against hostile input): connects to the port's
//! chardev socket ([`crate::launch::VmSpec::egress_socket`]), demultiplexes the guest's
//! streams and hands each one, as a [`DuplexStream`], to a function of the caller's. The
//! pipeline passes the egress proxy's `serve`, so this crate knows nothing of proxies or
//! rules (builder and vmm never import each other).
//!
//! Tasks: one reads the port and keeps the stream table, and never waits to write (its
//! `window` and `close` frames go through a bounded queue; a guest that lets it fill is not
//! reading its port and loses the channel); one writes the port (those frames first, then
//! the streams' own through a bounded queue, so a guest that stops reading its port stops
//! the streams' senders instead of growing a queue); per stream, one task sends what the handler
//! writes, within the credit the guest gives back, and one writes what the guest sent to the
//! handler, giving credit back as it goes. A guest whose framing is bad loses the channel
//! (every stream ends); a stream that breaks a rule is closed; neither can make the host
//! buffer more than [`kiln_guest::egress::INITIAL_WINDOW`] per stream.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_guest::egress::{
    Frame, FrameDecoder, Kind, MAX_CREDIT, MAX_PAYLOAD, Side, Table, Verdict,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{Notify, mpsc};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

pub use kiln_guest::egress::PROXY_PORT;

/// `data`, `eof` and `close` frames of the streams' own tasks queued for the port's writer
/// (those tasks wait when it is full).
const WRITE_QUEUE: usize = 64;
/// `window` and `close` frames of the control loop queued for the port's writer. The control
/// loop never waits on the port (it must keep reading it, or a guest writing to it while
/// the host writes to the guest could deadlock both); a guest that lets this many pile up
/// is not reading its port and loses the channel.
const CONTROL_QUEUE: usize = 4096;

/// Errors of [`serve`].
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The chardev socket did not accept a connection in time.
    #[error("connecting to the egress port {path}: {source}")]
    Connect {
        /// The socket.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// The running host end of one VM's egress port; dropping it ends every stream.
#[derive(Debug)]
pub struct EgressChannel {
    task: JoinHandle<()>,
}

impl EgressChannel {
    /// Whether the channel ended (the VM closed it or broke its framing).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for EgressChannel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Connects to the egress chardev socket `path` (retrying for up to `timeout` while QEMU
/// makes it) and serves it until the VM closes it or the returned value is dropped: each
/// stream the guest opens is given to `handler` as a [`DuplexStream`], on a task of its own.
///
/// Errors: [`EgressError::Connect`].
pub async fn serve<F, Fut>(
    path: &Path,
    timeout: Duration,
    handler: F,
) -> Result<EgressChannel, EgressError>
where
    F: Fn(DuplexStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let stream = loop {
        match UnixStream::connect(path).await {
            Ok(s) => break s,
            Err(source) if tokio::time::Instant::now() >= deadline => {
                return Err(EgressError::Connect {
                    path: path.display().to_string(),
                    source,
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    Ok(EgressChannel {
        task: tokio::spawn(run(stream, handler)),
    })
}

/// What the control loop hears from a stream's own tasks.
enum Event {
    /// The stream's sender sent `eof`.
    SentEof(u32),
    /// One of the stream's tasks sent `close` (its local end failed).
    Aborted(u32),
    /// The stream's writer wrote `n` bytes to the handler's end.
    Drained(u32, u32),
}

/// What the control loop gives a stream's writer.
enum Down {
    Data(Vec<u8>),
    Eof,
}

/// Sending credit of one stream: bytes the guest will still take.
struct Credit {
    bytes: Mutex<u64>,
    notify: Notify,
}

impl Credit {
    /// Takes between 1 and `max` bytes of credit, waiting for some.
    async fn take(&self, max: u64) -> u64 {
        loop {
            {
                let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
                if *b > 0 {
                    let k = (*b).min(max);
                    *b -= k;
                    return k;
                }
            }
            self.notify.notified().await;
        }
    }

    /// Gives `n` bytes back; false when that is more than a stream can hold.
    fn give(&self, n: u64) -> bool {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        if *b + n > MAX_CREDIT {
            return false;
        }
        *b += n;
        drop(b);
        self.notify.notify_one();
        true
    }
}

struct Stream {
    down: mpsc::UnboundedSender<Down>,
    credit: Arc<Credit>,
    tasks: [AbortHandle; 2],
}

impl Stream {
    fn abort(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

async fn run<F, Fut>(port: UnixStream, handler: F)
where
    F: Fn(DuplexStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (mut rd, mut wr) = port.into_split();
    let (out_tx, mut out_rx) = mpsc::channel::<Frame>(WRITE_QUEUE);
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<Frame>(CONTROL_QUEUE);
    // Every task of the channel (writer, streams, handlers) lives in this set, so that when
    // this task ends, or is aborted by dropping [`EgressChannel`], they all end with it: a
    // proxy relaying to a server that never closes must not outlive the VM.
    let mut tasks = JoinSet::new();
    tasks.spawn(async move {
        loop {
            let f = tokio::select! {
                biased;
                Some(f) = ctl_rx.recv() => f,
                Some(f) = out_rx.recv() => f,
                else => break,
            };
            if wr.write_all(&f.encode()).await.is_err() {
                break;
            }
        }
    });
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<Event>();
    let mut table = Table::new(Side::Host);
    let mut streams: HashMap<u32, Stream> = HashMap::new();
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; MAX_PAYLOAD + kiln_guest::egress::HEADER_LEN];
    'outer: loop {
        tokio::select! {
            r = rd.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                decoder.push(&buf[..n]);
                loop {
                    let f = match decoder.next_frame() {
                        Ok(Some(f)) => f,
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "egress port: dropping the channel");
                            break 'outer;
                        }
                    };
                    let id = f.stream;
                    match table.incoming(f) {
                        Verdict::Open => {
                            let (near, far) = tokio::io::duplex(MAX_PAYLOAD);
                            // Reap what has finished, so the set holds live tasks only.
                            while tasks.try_join_next().is_some() {}
                            let s = open_stream(id, near, &out_tx, &ev_tx, &mut tasks);
                            streams.insert(id, s);
                            tasks.spawn(handler(far));
                        }
                        Verdict::Data(bytes) => {
                            if let Some(s) = streams.get(&id) {
                                let _ = s.down.send(Down::Data(bytes));
                            }
                        }
                        Verdict::Eof { finished } => {
                            let s = if finished { streams.remove(&id) } else { None };
                            if let Some(s) = s.as_ref().or_else(|| streams.get(&id)) {
                                let _ = s.down.send(Down::Eof);
                            }
                        }
                        Verdict::Closed => {
                            if let Some(s) = streams.remove(&id) {
                                s.abort();
                            }
                        }
                        Verdict::Window(n) => {
                            let ok = streams.get(&id).is_none_or(|s| s.credit.give(n.into()));
                            if !ok {
                                table.close(id);
                                if !refuse(id, "a window past the credit", &mut streams, &ctl_tx) {
                                    break 'outer;
                                }
                            }
                        }
                        Verdict::Refuse(why) => {
                            if !refuse(id, why, &mut streams, &ctl_tx) {
                                break 'outer;
                            }
                        }
                        Verdict::Ignore => {}
                    }
                }
            }
            Some(ev) = ev_rx.recv() => match ev {
                Event::SentEof(id) => {
                    if table.sent_eof(id) {
                        // Both ways done: the writer ends once it has written what it holds.
                        streams.remove(&id);
                    }
                }
                Event::Aborted(id) => {
                    table.close(id);
                    if let Some(s) = streams.remove(&id) {
                        s.abort();
                    }
                }
                Event::Drained(id, n) => {
                    if table.drained(id, n) && !control(&ctl_tx, Frame::window(id, n)) {
                        break;
                    }
                }
            },
        }
    }
    tasks.shutdown().await;
}

/// Queues a control frame; false when the queue is full (the guest is not reading its
/// port: the channel is dropped) or the writer is gone.
fn control(ctl: &mpsc::Sender<Frame>, f: Frame) -> bool {
    match ctl.try_send(f) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "egress port: the guest is not reading; dropping the channel");
            false
        }
    }
}

/// Closes stream `id`, which broke a rule (`why`): ends its tasks and tells the guest
/// (false: the channel is to be dropped, [`control`]).
fn refuse(
    id: u32,
    why: &str,
    streams: &mut HashMap<u32, Stream>,
    ctl: &mpsc::Sender<Frame>,
) -> bool {
    tracing::debug!(stream = id, why, "egress port: closing a stream");
    if let Some(s) = streams.remove(&id) {
        s.abort();
    }
    control(ctl, Frame::bare(id, Kind::Close))
}

/// Starts the two tasks of stream `id` over `near`, the end the handler's stream is paired
/// with.
fn open_stream(
    id: u32,
    near: DuplexStream,
    out: &mpsc::Sender<Frame>,
    ev: &mpsc::UnboundedSender<Event>,
    tasks: &mut JoinSet<()>,
) -> Stream {
    let (r, w) = tokio::io::split(near);
    let credit = Arc::new(Credit {
        bytes: Mutex::new(MAX_CREDIT),
        notify: Notify::new(),
    });
    let (down_tx, down_rx) = mpsc::unbounded_channel();
    let up = tasks.spawn(send_up(id, r, credit.clone(), out.clone(), ev.clone()));
    let down = tasks.spawn(write_down(id, w, down_rx, out.clone(), ev.clone()));
    Stream {
        down: down_tx,
        credit,
        tasks: [up, down],
    }
}

/// Handler → guest: `data` within the credit, then `eof` (or `close` on an error).
async fn send_up(
    id: u32,
    mut r: ReadHalf<DuplexStream>,
    credit: Arc<Credit>,
    out: mpsc::Sender<Frame>,
    ev: mpsc::UnboundedSender<Event>,
) {
    let mut buf = vec![0u8; MAX_PAYLOAD];
    loop {
        let k = credit.take(MAX_PAYLOAD as u64).await as usize;
        match r.read(&mut buf[..k]).await {
            Ok(0) => {
                let _ = out.send(Frame::bare(id, Kind::Eof)).await;
                let _ = ev.send(Event::SentEof(id));
                return;
            }
            Ok(n) => {
                credit.give((k - n) as u64);
                if out.send(Frame::data(id, buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
            Err(_) => {
                let _ = out.send(Frame::bare(id, Kind::Close)).await;
                let _ = ev.send(Event::Aborted(id));
                return;
            }
        }
    }
}

/// Guest → handler: writes what arrived, gives the credit back, shuts down on `eof`.
async fn write_down(
    id: u32,
    mut w: WriteHalf<DuplexStream>,
    mut rx: mpsc::UnboundedReceiver<Down>,
    out: mpsc::Sender<Frame>,
    ev: mpsc::UnboundedSender<Event>,
) {
    while let Some(d) = rx.recv().await {
        match d {
            Down::Data(bytes) => {
                if w.write_all(&bytes).await.is_err() {
                    let _ = out.send(Frame::bare(id, Kind::Close)).await;
                    let _ = ev.send(Event::Aborted(id));
                    return;
                }
                let _ = ev.send(Event::Drained(id, bytes.len() as u32));
            }
            Down::Eof => {
                let _ = w.shutdown().await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_guest::egress::INITIAL_WINDOW;

    /// A host end whose handler echoes, except a stream beginning `stal`, which it never
    /// reads again; returns the guest's end of the port.
    async fn echo_host() -> (UnixStream, EgressChannel) {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("egress.sock");
        let l = tokio::net::UnixListener::bind(&path).unwrap();
        let ch = serve(
            &path,
            Duration::from_secs(5),
            |mut s: DuplexStream| async move {
                let _live = Live::new();
                let mut first = [0u8; 4];
                if s.read_exact(&mut first).await.is_err() {
                    return;
                }
                if &first == b"stal" {
                    std::future::pending::<()>().await;
                }
                if s.write_all(&first).await.is_err() {
                    return;
                }
                let mut buf = vec![0u8; 8192];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = s.shutdown().await;
            },
        )
        .await
        .unwrap();
        let (g, _) = l.accept().await.unwrap();
        (g, ch)
    }

    /// Handlers running (each holds one).
    static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    struct Live;

    impl Live {
        fn new() -> Live {
            LIVE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Live
        }
    }

    impl Drop for Live {
        fn drop(&mut self) {
            LIVE.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    async fn send(g: &mut UnixStream, f: Frame) {
        g.write_all(&f.encode()).await.unwrap();
    }

    async fn recv(g: &mut UnixStream, d: &mut FrameDecoder) -> Frame {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(f) = d.next_frame().unwrap() {
                return f;
            }
            let n = tokio::time::timeout(Duration::from_secs(5), g.read(&mut buf))
                .await
                .expect("a frame in time")
                .unwrap();
            assert!(n > 0, "the host closed the channel");
            d.push(&buf[..n]);
        }
    }

    #[tokio::test]
    async fn streams_echo_a_stalled_one_blocks_no_other_and_breaches_close() {
        // No handler yet (this is the one test counting them).
        assert_eq!(LIVE.load(std::sync::atomic::Ordering::SeqCst), 0);
        let (mut g, _ch) = echo_host().await;
        let mut d = FrameDecoder::new();
        // Stream 1: its handler stops reading after 4 bytes; the guest sends a whole window.
        send(&mut g, Frame::bare(1, Kind::Open)).await;
        let mut first = b"stal".to_vec();
        first.resize(MAX_PAYLOAD, 9);
        send(&mut g, Frame::data(1, first)).await;
        let chunk = vec![9u8; MAX_PAYLOAD];
        for _ in 1..(INITIAL_WINDOW as usize / MAX_PAYLOAD) {
            send(&mut g, Frame::data(1, chunk.clone())).await;
        }
        // Stream 2 works meanwhile, to its end both ways.
        send(&mut g, Frame::bare(2, Kind::Open)).await;
        send(&mut g, Frame::data(2, b"ping".to_vec())).await;
        send(&mut g, Frame::bare(2, Kind::Eof)).await;
        let mut got2 = Vec::new();
        let mut windows1 = 0u64;
        // Stream 1's handler took its first chunk into the pipe's 64 KiB buffer and no more:
        // exactly that much credit comes back.
        loop {
            let f = recv(&mut g, &mut d).await;
            match (f.stream, f.kind) {
                (1, Kind::Window) => windows1 += u64::from(f.credit()),
                (2, Kind::Data) => got2.extend_from_slice(&f.payload),
                (2, Kind::Eof) => break,
                (2, Kind::Window) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(got2, b"ping");
        while windows1 < MAX_PAYLOAD as u64 {
            let f = recv(&mut g, &mut d).await;
            assert_eq!((f.stream, f.kind), (1, Kind::Window), "{f:?}");
            windows1 += u64::from(f.credit());
        }
        assert_eq!(windows1, MAX_PAYLOAD as u64);
        // What was given back fits; one byte more is past the window: stream 1 is closed.
        send(&mut g, Frame::data(1, chunk.clone())).await;
        send(&mut g, Frame::data(1, vec![1])).await;
        assert_eq!(recv(&mut g, &mut d).await, Frame::bare(1, Kind::Close));
        // Too many opens: the one past MAX_STREAMS is closed at once.
        let max = kiln_guest::egress::MAX_STREAMS as u32;
        for id in 10..(10 + max + 1) {
            send(&mut g, Frame::bare(id, Kind::Open)).await;
        }
        assert_eq!(
            recv(&mut g, &mut d).await,
            Frame::bare(10 + max, Kind::Close)
        );
        // A window past the credit closes its stream (the guest never spent any of it).
        send(&mut g, Frame::window(10, INITIAL_WINDOW)).await;
        assert_eq!(recv(&mut g, &mut d).await, Frame::bare(10, Kind::Close));
        // A bad header drops the channel: the host's end closes.
        g.write_all(&[0, 0, 0, 1, 77, 0, 0, 0, 0]).await.unwrap();
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), g.read_to_end(&mut rest))
            .await
            .expect("closed in time")
            .unwrap();
        // Every handler ended with the channel, the stalled one and the 64 waiting for
        // their first bytes too.
        let t0 = std::time::Instant::now();
        while LIVE.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "handlers outlived the channel"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn dropping_the_channel_ends_every_handler() {
        static ENDED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        struct Flag;
        impl Drop for Flag {
            fn drop(&mut self) {
                ENDED.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("egress.sock");
        let l = tokio::net::UnixListener::bind(&path).unwrap();
        let (started_tx, mut started) = mpsc::unbounded_channel::<()>();
        let ch = serve(&path, Duration::from_secs(5), move |s: DuplexStream| {
            let started_tx = started_tx.clone();
            async move {
                let _flag = Flag;
                let _s = s;
                let _ = started_tx.send(());
                // A relay to a server that never closes.
                std::future::pending::<()>().await;
            }
        })
        .await
        .unwrap();
        let (mut g, _) = l.accept().await.unwrap();
        send(&mut g, Frame::bare(0, Kind::Open)).await;
        tokio::time::timeout(Duration::from_secs(5), started.recv())
            .await
            .expect("the handler started");
        assert!(!ENDED.load(std::sync::atomic::Ordering::SeqCst));
        drop(ch);
        let t0 = std::time::Instant::now();
        while !ENDED.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the handler outlived the channel"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
