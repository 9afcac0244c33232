//! `kiln serve` nodes when one is cut off from the database and the store (issue 19), as
//! root: one node runs as another host in a network namespace the test makes
//! ([`kiln_tests::netns`]), the other on the host, sharing the PostgreSQL test database and
//! one S3 bucket of the moto test server. From the namespace those (and the registry and
//! the test's web server) are reached on the host side of the veth pair, through plain
//! forwarders to their 127.0.0.1 ports; the host node uses 127.0.0.1.

use std::io::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use kiln_tests::fault_proxy::FaultProxy;
use kiln_tests::http::LocalServer;
use kiln_tests::netns::Netns;
use kiln_tests::require_env;
use kiln_tests::serve::{
    Launch, QUICK_LIVENESS, Server, claimer, client, env, fetch_recipe, get, postgres, psql, rt,
    submit_recipe, tagged_spec, terminal, until, wait_for,
};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// `url` (`postgres://USER@HOST:PORT/DB`) with `HOST:PORT` replaced by `addr`.
fn with_host(url: &str, addr: &str) -> String {
    let (scheme_user, rest) = url.split_once('@').expect("postgres://USER@HOST:PORT/DB");
    let (_, db) = rest.split_once('/').expect("postgres://USER@HOST:PORT/DB");
    format!("{scheme_user}@{addr}/{db}")
}

/// What a held request of `web` is answered with when the cut-off node is back: a body no
/// other attempt got, so an attempt that went on would build, and try to publish, an image
/// that differs from the takeover's.
const LATE_BODY: &str = "late answer to the cut-off attempt\n";

/// A build held in its step on the node in the namespace; the namespace's link is cut.
///
/// - The host node takes the build over (attempt 2), runs it and publishes its tag; a build
///   submitted during the cut runs on the host node.
/// - The link comes back as soon as those ended. By then the cut-off node had fenced itself
///   (cancelled its build, claimed nothing), having written no heartbeat for the takeover
///   time; it heartbeats again. The held request of attempt 1 is answered (a different body,
///   [`LATE_BODY`], so a going-on attempt would make a different image). Then the host node
///   stops and a new build is submitted: the cut-off node, alone and with one worker, claims
///   it again and runs it, so its attempt 1 is over by then.
/// - The build's end is the takeover's (succeeded, attempt 2, its image); its tag names that
///   image; its log has no line of attempt 1 after the takeover; `kiln store verify --deep`
///   is clean.
///
/// Before the fence had its own timer, the cut-off node never fenced: its heartbeat waited
/// on a dead connection (the pool's 30 s, or TCP's retransmissions on one in use), its
/// attempt ran beside the takeover, and this test failed waiting for the fence. With its
/// attempt let go on (no cancel by the fence or the lost claim), the tag's compare-and-swap
/// refuses that attempt's image and the claim its end; without the compare-and-swap the tag
/// names that image, and without the claim check the build ends failed ("stale").
#[test]
fn a_cut_off_node_stops_claiming_its_build_is_taken_over_and_it_publishes_nothing_when_back() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let registry = require_env("KILN_TEST_REGISTRY");
    let (t, _, _) = env();
    let db = postgres();
    let url = db[1].clone();
    let store = PathBuf::from(kiln_tests::stores::fresh_url(
        kiln_tests::stores::Kind::S3,
        t.path(),
        "cutoff",
    ));
    let net = Netns::new();
    let host_ip = IpAddr::V4(net.host_ip);

    // Forwarders on the host side of the pair to the servers on 127.0.0.1, on a runtime of
    // their own that runs for the whole test.
    let fwd = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let upstream_pg = url
        .split_once('@')
        .and_then(|(_, r)| r.split_once('/'))
        .map(|(hp, _)| hp.to_string())
        .expect("postgres://USER@HOST:PORT/DB");
    let upstream_s3 = kiln_tests::stores::s3_host_port();
    let (pg, s3, reg) = fwd.block_on(async {
        let start = |up: String| async move {
            FaultProxy::start_on(host_ip, &up)
                .await
                .expect("start a forwarder")
        };
        (
            start(upstream_pg).await,
            start(upstream_s3).await,
            start(registry.clone()).await,
        )
    });
    let ns_db = vec![
        "--database".to_string(),
        with_host(&url, &pg.addr().to_string()),
    ];
    let reg_addr = reg.addr().to_string();
    let base = bb.replacen(&registry, &reg_addr, 1);
    assert_ne!(base, bb, "{bb} is on {registry}");
    let web = LocalServer::holding_on(host_ip, "/hold/", 1);

    let args = [
        &["--workers", "1"][..],
        &QUICK_LIVENESS,
        // The registry's forwarder is on the veth's private address.
        &[
            "--insecure-registry",
            &reg_addr,
            "--allow-registry",
            &reg_addr,
        ],
    ]
    .concat();
    let dir = |n: &str| t.path().join(n);
    let (cut_state, cut_cache) = (dir("cut").join("state"), dir("cut").join("cache"));
    let listen = format!("{}:0", net.ns_ip);
    let s3_url = s3.url();
    let cut = Server::launch(&Launch {
        bin: KILN.as_ref(),
        state: &cut_state,
        store: &store,
        db: &ns_db,
        cache: Some(&cut_cache),
        listen: &listen,
        netns: Some(&net.name),
        env: &[("AWS_ENDPOINT_URL", &s3_url)],
        extra: &args,
    });
    let host = host_ip.to_string();
    let recipe = |path: &str| fetch_recipe(&base, &host, web.port, path);
    let spec = tagged_spec;
    let c = client();
    let key = cut.key("acme", &["--max-concurrent", "4", "--max-queued", "100"]);
    let submit_to = |s: &Server, tag: &str, path: &str| {
        rt().block_on(submit_recipe(&c, s, &key, &spec(tag), &recipe(path)))
    };

    // The node in the namespace, alone, claims `b` and is held in its step.
    let b = submit_to(&cut, "b:1", "/hold/b");
    until(
        "the cut-off node's attempt reached its step",
        Duration::from_secs(300),
        || web.hits("/hold/b") == 1,
    );
    let mut nodes = vec![cut];
    assert_eq!(claimer(&url, &nodes, &b), Some((0, 1)));
    let cut_id = psql(
        &url,
        &format!("SELECT claimed_by FROM builds WHERE id = '{b}'"),
    );
    let host_dir = dir("host");
    nodes.push(Server::start_node(
        KILN.as_ref(),
        &host_dir.join("state"),
        &store,
        &db,
        Some(&host_dir.join("cache")),
        &args,
    ));

    // Cut off: the host node takes `b` over and runs it to its end.
    net.cut();
    until(
        "attempt 2 claimed by the host node",
        Duration::from_secs(120),
        || claimer(&url, &nodes, &b) == Some((1, 2)),
    );
    let during = submit_to(&nodes[1], "d:1", "/run/d");
    let (taken, during_v) = rt().block_on(async {
        let h = &nodes[1];
        let limit = Duration::from_secs(300);
        (
            wait_for(&c, h, &key, &b, limit, terminal).await,
            wait_for(&c, h, &key, &during, limit, terminal).await,
        )
    });
    assert_eq!(taken["state"], "succeeded", "{taken:#}");
    assert_eq!(during_v["state"], "succeeded", "{during_v:#}");
    let image = taken["image"].as_str().expect("image").to_string();
    assert_eq!(web.hits("/hold/b"), 2, "ran again after the takeover");
    let host_id = psql(
        &url,
        &format!("SELECT claimed_by FROM builds WHERE id = '{b}'"),
    );
    assert_ne!(host_id, cut_id);
    assert_eq!(
        psql(
            &url,
            &format!("SELECT claimed_by FROM builds WHERE id = '{during}'")
        ),
        host_id,
        "a build submitted during the cut runs on the host node"
    );
    let tag_of = |s: &Server| {
        let r = rt().block_on(get(&c, s, &key, "/v1/images/b/tags/1"));
        assert_eq!(r.status(), 200);
        r.headers()["etag"].to_str().expect("etag").to_string()
    };
    assert_eq!(tag_of(&nodes[1]), format!("\"{image}\""));
    let lines_before = log_of(&c, &nodes[1], &key, &b);

    // Back as soon as the takeover has ended. The cut-off node fenced itself while cut off:
    // it stopped claiming and cancelled its build once it had not written a heartbeat for the
    // takeover time, by the time the other node took the build over, whatever its database
    // calls do meanwhile; now it heartbeats and claims again.
    net.restore();
    until(
        "the cut-off node heartbeats again after fencing itself",
        Duration::from_secs(120),
        || nodes[0].logged("heartbeat written again"),
    );
    assert!(nodes[0].logged("no heartbeat written for the takeover time"));
    // Answer attempt 1's held request (when its connection is still open) with a body of its
    // own.
    for mut conn in web.held.lock().expect("held").drain(..) {
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{LATE_BODY}",
            LATE_BODY.len()
        );
    }
    // The host node stops; the cut-off node, alone, claims and runs a new build with its one
    // worker, which is then done with attempt 1 of `b`.
    nodes[1].signal(rustix::process::Signal::TERM);
    assert!(nodes[1].wait(Duration::from_secs(60)).success());
    drop(nodes.remove(1));
    let after = submit_to(&nodes[0], "a:1", "/run/a");
    let after_v = rt().block_on(wait_for(
        &c,
        &nodes[0],
        &key,
        &after,
        Duration::from_secs(300),
        terminal,
    ));
    assert_eq!(after_v["state"], "succeeded", "{after_v:#}");
    assert_eq!(
        psql(
            &url,
            &format!("SELECT claimed_by FROM builds WHERE id = '{after}'")
        ),
        cut_id,
        "the node claims again once it is back"
    );

    // `b` is the takeover's: its end, its tag, its log.
    let v = rt().block_on(wait_for(
        &c,
        &nodes[0],
        &key,
        &b,
        Duration::from_secs(10),
        terminal,
    ));
    assert_eq!(v["state"], "succeeded", "{v:#}");
    assert_eq!(v["image"], image.as_str(), "{v:#}");
    assert_eq!(
        psql(
            &url,
            &format!("SELECT claimed_by || ' ' || attempt FROM builds WHERE id = '{b}'")
        ),
        format!("{host_id} 2")
    );
    assert_eq!(tag_of(&nodes[0]), format!("\"{image}\""), "tag b:1");
    let lines_after = log_of(&c, &nodes[0], &key, &b);
    assert_eq!(
        lines_after, lines_before,
        "no log line of attempt 1 after the takeover"
    );
    assert!(
        lines_before.contains(&format!("node {cut_id} stopped heartbeating"))
            && !lines_before.contains("listening on")
            && lines_before.contains("attempt 1 of 2 lost, build queued again"),
        "{lines_before}"
    );
    kiln_tests::serve::verify_deep(KILN.as_ref(), t.path(), &store);
    drop(nodes);
    drop(net);
}

/// The build's whole log, as text.
fn log_of(c: &reqwest::Client, s: &Server, key: &str, id: &str) -> String {
    rt().block_on(async {
        get(c, s, key, &format!("/v1/builds/{id}/logs"))
            .await
            .text()
            .await
            .expect("logs")
    })
}

#[test]
fn with_host_replaces_only_the_address() {
    assert_eq!(
        with_host("postgres://kiln@127.0.0.1:5433/kiln_x", "10.0.0.1:1234"),
        "postgres://kiln@10.0.0.1:1234/kiln_x"
    );
}
