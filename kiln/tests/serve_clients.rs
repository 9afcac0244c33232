//! The tenants' port holds up against slow and many clients (issue 44 §4), through a real
//! `kiln serve` and raw TCP sockets: a client that stalls in its request head, and one that
//! stalls in its body, are both closed by the server within its timeouts while other
//! requests are served; past `--max-connections`, a new connection is closed at once and the
//! open ones still work. A body trickled slower than `--min-body-rate` is answered 408 and
//! closed; a workspace past `--max-requests-per-workspace` (its log streams counted) gets
//! 429 while another workspace is served. Past `--max-connections-per-ip`, a new connection
//! from that address is closed at once while another address is served; a client that
//! stops reading its responses is closed after `--send-timeout`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kiln_tests::http::LocalServer;
use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, env, fetch_recipe, get, json_of, rt, submit_recipe, tagged_spec, until,
};

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
    assert!(sent.starts_with("HTTP/1.1 408"), "{sent}");
    assert!(sent.contains("sent nothing for 1 s"), "{sent}");
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

/// A raw connection to the server from the local address `from` (any of 127.0.0.0/8).
fn connect_from(s: &Server, from: [u8; 4]) -> TcpStream {
    let addr: std::net::SocketAddr = s
        .url("")
        .trim_start_matches("http://")
        .parse()
        .expect("address");
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.bind(&std::net::SocketAddr::from((from, 0)).into())
        .expect("bind");
    sock.connect(&addr.into()).expect("connect");
    let c: TcpStream = sock.into();
    c.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    c
}

/// Clients without a key cannot take every connection with kept-alive requests: one
/// address gets `--max-connections-per-ip`, and another is still served.
#[test]
fn past_the_limit_of_an_address_a_new_connection_from_it_is_closed_at_once() {
    let (_t, state, store) = env();
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--max-connections-per-ip", "2"],
    );
    let mut open: Vec<TcpStream> = (0..2).map(|_| connect_from(&s, [127, 0, 0, 2])).collect();
    for c in &mut open {
        assert!(healthz(c));
    }
    let mut third = connect_from(&s, [127, 0, 0, 2]);
    let (sent, after) = until_closed(&mut third);
    assert!(sent.is_empty(), "{sent}");
    assert!(after < Duration::from_secs(5), "{after:?}");
    let mut other = connect_from(&s, [127, 0, 0, 3]);
    assert!(healthz(&mut other), "another address is served");
    for c in &mut open {
        assert!(healthz(c), "an open connection still works");
    }
}

/// A client that sends requests and never reads the answers holds its connection only
/// until a write has waited `--send-timeout`: the one connection its address may have
/// (`--max-connections-per-ip 1`) comes free.
#[test]
fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    let (_t, state, store) = env();
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--max-connections-per-ip", "1", "--send-timeout", "1s"],
    );
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.set_recv_buffer_size(4096)
        .expect("small receive buffer");
    let addr: std::net::SocketAddr = s
        .url("")
        .trim_start_matches("http://")
        .parse()
        .expect("address");
    sock.connect(&addr.into()).expect("connect");
    let mut stalled: TcpStream = sock.into();
    // Far more answer bytes than the two socket buffers hold (the document is tens of KB).
    let req = b"GET /openapi.json HTTP/1.1\r\nHost: kiln\r\n\r\n".repeat(300);
    stalled
        .set_write_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = stalled.write_all(&req);
    let t0 = Instant::now();
    loop {
        let mut c = connect(&s);
        if healthz(&mut c) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the stalled connection still holds the address's one place"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(stalled);
}

/// `GET p` on `c` (kept alive) with the key `key`: the status line and the rest.
fn get_raw(c: &mut TcpStream, p: &str, key: &str) -> String {
    write!(
        c,
        "GET {p} HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer {key}\r\n\r\n"
    )
    .expect("write");
    let mut buf = [0u8; 4096];
    let n = c.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn a_body_slower_than_the_minimum_rate_is_answered_408_and_closed() {
    let (_t, state, store) = env();
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &["--min-body-rate", "1000000", "--body-rate-grace", "1s"],
    );
    let key = s.key("acme", &[]);
    let other = s.key("other", &[]);
    // An upload of 100,000 bytes, one byte each 100 ms: 10 bytes/s, never idle for long.
    let mut slow = connect(&s);
    write!(
        slow,
        "PUT /v1/blobs/sha256:{} HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n",
        "0".repeat(64)
    )
    .expect("write");
    let mut w = slow.try_clone().expect("clone");
    let trickle = std::thread::spawn(move || {
        for _ in 0..600 {
            if w.write_all(b"x").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // Meanwhile the server answers others, of this workspace and another.
    let mut c = connect(&s);
    assert!(get_raw(&mut c, "/v1/images", &other).starts_with("HTTP/1.1 200"));
    assert!(get_raw(&mut c, "/v1/images", &key).starts_with("HTTP/1.1 200"));
    let (sent, _) = until_closed(&mut slow);
    assert!(sent.starts_with("HTTP/1.1 408"), "{sent}");
    assert!(sent.contains("\"error\":\"request_timeout\""), "{sent}");
    assert!(sent.contains("slower than 1000000 bytes/s"), "{sent}");
    assert!(
        sent.to_ascii_lowercase().contains("connection: close"),
        "{sent}"
    );
    trickle.join().expect("trickle");
    let mut c = connect(&s);
    assert!(healthz(&mut c), "the server still serves");
    assert!(get_raw(&mut c, "/v1/images", &key).starts_with("HTTP/1.1 200"));
}

#[test]
fn a_workspace_past_its_share_of_requests_gets_429_and_others_are_served() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (_t, state, store) = env();
    // Each build's one step waits on this server until the test lets it go.
    let web = LocalServer::holding("/hold/", 2);
    let s = Server::start(
        KILN.as_ref(),
        &state,
        &store,
        &[
            "--max-requests-per-workspace",
            "2",
            "--workers",
            "2",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let acme = s.key("acme", &[]);
    let other = s.key("other", &[]);
    let c = client();
    let rt = rt();
    let recipe = |p: &str| fetch_recipe(&bb, "127.0.0.1", web.port, p);
    let a = rt.block_on(submit_recipe(
        &c,
        &s,
        &acme,
        &tagged_spec("a:1"),
        &recipe("/hold/a"),
    ));
    until("build a reached its step", Duration::from_secs(120), || {
        web.hits("/hold/a") == 1
    });
    let b = rt.block_on(submit_recipe(
        &c,
        &s,
        &acme,
        &tagged_spec("b:1"),
        &recipe("/hold/b"),
    ));
    rt.block_on(async {
        // Two log streams: acme's whole share.
        let follow = |id: &str| format!("/v1/builds/{id}/logs?follow=true");
        let sa = get(&c, &s, &acme, &follow(&a)).await;
        assert_eq!(sa.status(), 200);
        let sb = get(&c, &s, &acme, &follow(&b)).await;
        assert_eq!(sb.status(), 200);
        let r = get(&c, &s, &acme, &format!("/v1/builds/{a}")).await;
        assert_eq!(r.status(), 429);
        assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
        let v = json_of(r).await;
        assert_eq!(v["error"], "too_many_requests", "{v}");
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("2 requests in flight")),
            "{v}"
        );
        // The operator sees the refusal.
        let m = c
            .get(s.metrics_url())
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics");
        assert!(m.contains("\nkiln_requests_over_share_total 1\n"), "{m}");
        // Another workspace is served.
        let r = get(&c, &s, &other, "/v1/images").await;
        assert_eq!(r.status(), 200);
        // Build a's step is let go (its fetch fails): its stream ends, and acme is served.
        drop(web.held.lock().expect("held").remove(0));
        let text = sa.text().await.expect("stream");
        let end: serde_json::Value =
            serde_json::from_str(text.lines().last().expect("a frame")).expect("json");
        assert_eq!(end["end"], true, "{text}");
        let r = get(&c, &s, &acme, &format!("/v1/builds/{a}")).await;
        assert_eq!(r.status(), 200);
        let v = json_of(r).await;
        assert_eq!(v["state"], "failed", "{v}");
        drop(sb);
    });
}
