//! The tenants' port holds up against slow and many clients (issue 44 §4), through a real
//! `kiln serve` and raw TCP sockets: a client that stalls in its request head, and one that
//! stalls in its body, are both closed by the server within its timeouts while other
//! requests are served; past `--max-connections`, a new connection is closed at once and the
//! open ones still work.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kiln_tests::serve::{Server, env};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// A raw connection to the server.
fn connect(s: &Server) -> TcpStream {
    let addr = s.url("").trim_start_matches("http://").to_string();
    let c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    c
}

/// Reads until the server closes `c` (EOF or reset); what it sent, and how long that took.
fn until_closed(c: &mut TcpStream) -> (String, Duration) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), t0.elapsed())
}

/// `GET /healthz` on `c` (kept alive): whether it was answered 200.
fn healthz(c: &mut TcpStream) -> bool {
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: kiln\r\n\r\n")
        .expect("write");
    let mut buf = [0u8; 4096];
    let n = c.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200")
}

#[test]
fn stalled_heads_and_bodies_are_closed_while_others_are_served() {
    let (_t, state, store) = env();
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--header-timeout", "1s", "--body-idle-timeout", "1s"],
    );
    let key = s.key("acme", &[]);
    // A head without its final blank line.
    let mut head = connect(&s);
    head.write_all(b"GET /healthz HTTP/1.1\r\nHost: kiln\r\n")
        .expect("write");
    // A body that promises 100,000 bytes and sends 10.
    let mut body = connect(&s);
    write!(
        body,
        "POST /v1/builds HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"recipe\":"
    )
    .expect("write");
    // Meanwhile the server answers others.
    let mut other = connect(&s);
    assert!(healthz(&mut other));
    let (sent, after) = until_closed(&mut head);
    assert!(after < Duration::from_secs(10), "head held for {after:?}");
    assert!(!sent.contains("200"), "{sent}");
    let (sent, after) = until_closed(&mut body);
    assert!(after < Duration::from_secs(10), "body held for {after:?}");
    assert!(!sent.starts_with("HTTP/1.1 2"), "{sent}");
    let mut other = connect(&s);
    assert!(healthz(&mut other), "the server still serves");
}

#[test]
fn past_the_connection_limit_a_new_connection_is_closed_at_once() {
    let (_t, state, store) = env();
    let s = Server::start(KILN.as_ref(), &state, &store, &["--max-connections", "4"]);
    let mut open: Vec<TcpStream> = (0..4).map(|_| connect(&s)).collect();
    // Each is accepted and served before the next: the four hold their slots.
    for c in &mut open {
        assert!(healthz(c));
    }
    let mut fifth = connect(&s);
    let (sent, after) = until_closed(&mut fifth);
    assert!(sent.is_empty(), "{sent}");
    assert!(after < Duration::from_secs(5), "{after:?}");
    for c in &mut open {
        assert!(healthz(c), "an open connection still works");
    }
    // One closes; a new one is served in its slot.
    drop(open.pop());
    let t0 = Instant::now();
    loop {
        let mut c = connect(&s);
        if healthz(&mut c) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no slot came free");
        std::thread::sleep(Duration::from_millis(50));
    }
}
