//! Any bytes as what the host reads from a guest (`kiln_vmm::channel::GuestChannel`, the
//! host side of the guest protocol) over a real unix socket pair: the first byte picks
//! whether the host first syncs to a `connected` frame (`sync_to`, as a new connection
//! does), then it receives with `recv_significant` (answering pings, skipping unknown types)
//! until the stream ends or is refused. Errors are fine, panics and hangs are not.
#![no_main]

use std::time::Duration;

use kiln_guest::protocol::{Ping, encode};
use kiln_vmm::channel::{GuestChannel, Message};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, stream)) = data.split_first() else {
        return;
    };
    let stream = stream.to_vec();
    runtime().block_on(async move {
        let (host, guest) = UnixStream::pair().expect("socket pair");
        let (mut guest_rx, mut guest_tx) = guest.into_split();
        // The guest side writes the input, then ends its half; it reads what the host
        // answers (pongs) so that the host never blocks on a full socket. An input within
        // the socket buffer (libFuzzer's inputs are a few KiB) is written whole at once, even
        // when the host refuses it early.
        let writer = tokio::spawn(async move {
            let _ = guest_tx.write_all(&stream).await;
            let _ = guest_tx.shutdown().await;
            guest_tx
        });
        let reader = tokio::spawn(async move {
            let mut sink = Vec::new();
            let _ = guest_rx.read_to_end(&mut sink).await;
        });
        let mut ch = GuestChannel::from_stream(host);
        let t = Duration::from_secs(20);
        let mut go_on = true;
        if mode & 1 == 1 {
            let want = encode(&Message::Connected(Ping { nonce: 42 })).expect("encodes");
            if let Err(e) = ch.sync_to(&want, 64 << 10, t).await {
                let _ = e.to_string();
                go_on = false;
            }
        }
        while go_on {
            match ch.recv_significant("a message", t).await {
                Ok(m) => {
                    let _ = m.type_name();
                }
                Err(e) => {
                    let _ = e.to_string();
                    go_on = false;
                }
            }
        }
        drop(ch);
        drop(writer.await.expect("writer"));
        reader.await.expect("reader");
    });
});
