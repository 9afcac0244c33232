//! Issue 30's core: a microVM build step reaches the host's egress proxy over the guest's
//! egress port (`kiln_vmm::egress`, `kiln_guest::egress`), with real VMs (TCG here) and a
//! real HTTP server on 127.0.0.1. The address policy's test knobs (the private switch and
//! the hosts map) are not settings of `kiln build` yet, so the steps run through
//! [`kiln_pipeline::vmexec::VmExecutor`] directly, on a busybox root (busybox `wget`
//! honours `http_proxy`):
//! - a `default` step and an allow-list step fetch over HTTP from `pkg.test` (mapped to
//!   127.0.0.1, private switch on) into their layers; the `default` step also runs five
//!   downloads of 1 MiB at once beside a connection the server never answers, and all five
//!   arrive whole (per-stream flow control: a stalled stream blocks no other); the
//!   allow-list step also fetches through a `CONNECT` tunnel (busybox `nc`); its deny entry wins over its `*.test`, and a name off the list is refused,
//!   each with its log line;
//! - with the private switch off, a name mapped to 127.0.0.1, the metadata address and the
//!   host's loopback port are refused, each leaving its `egress: refused …` line;
//! - a `none` step has no proxy: nothing listens on `127.0.0.1:3128` in its guest.
//!
//! Four cold VM boots in all. As root, with the guest kernel and initramfs
//! (`KILN_TEST_KERNEL`, `KILN_TEST_INITRAMFS`; the init is rebuilt from this checkout when
//! those were not).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_builder::egress::address::AddressPolicy;
use kiln_builder::exec::{ExecConfig, LogLine, StepExecutor, StepSpec};
use kiln_pipeline::vmexec::{PROXY_ONLY_LINE, VmExecutor};
use kiln_recipes::plan::{Egress, EgressRule, Network};
use kiln_tests::vm::guest_assets;

/// Size of each concurrent download.
const BIG: usize = 1 << 20;
/// Concurrent downloads in the `default` step.
const PARALLEL: usize = 5;

/// The bytes of `/big/<n>`.
fn big_body(n: usize) -> Vec<u8> {
    (0..BIG).map(|i| ((i * 31 + n * 7) % 251) as u8).collect()
}

/// An HTTP/1.1 server on 127.0.0.1, a thread per connection (so that concurrent downloads
/// are concurrent): `/small` is `hello small`, `/big/<n>` is [`big_body`], `/held` is never
/// answered. Records each request line and `Host` field.
struct Server {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start() -> Server {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let record = record.clone();
                std::thread::spawn(move || {
                    let mut r = BufReader::new(conn.try_clone().unwrap());
                    let mut first = String::new();
                    if r.read_line(&mut first).is_err() {
                        return;
                    }
                    let mut host = String::new();
                    loop {
                        let mut l = String::new();
                        if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
                            break;
                        }
                        if let Some(v) = l.strip_prefix("Host: ") {
                            host = v.trim().to_string();
                        }
                    }
                    let line = first.trim().to_string();
                    record.lock().unwrap().push(format!("{line} host={host}"));
                    let path = line.split(' ').nth(1).unwrap_or("").to_string();
                    let body = if path == "/held" {
                        // Never answered: the connection stays open until the client goes.
                        let mut sink = Vec::new();
                        let _ = std::io::Read::read_to_end(&mut r, &mut sink);
                        return;
                    } else if path == "/small" {
                        b"hello small\n".to_vec()
                    } else if let Some(n) = path.strip_prefix("/big/") {
                        big_body(n.parse().unwrap_or(0))
                    } else {
                        let _ = conn.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        );
                        return;
                    };
                    let _ = write!(
                        conn,
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = conn.write_all(&body);
                });
            }
        });
        Server { port, seen }
    }

    fn hits(&self, path: &str) -> usize {
        let want = format!("GET {path} ");
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(&want))
            .count()
    }
}

/// A busybox root (the static busybox and its applets, root in `/etc/passwd`) and the
/// step's directories.
struct Fixture {
    tmp: tempfile::TempDir,
    root: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let root = kiln_tests::vm::busybox_root(&tmp.path().join("rootfs"));
    Fixture { tmp, root }
}

impl Fixture {
    /// Runs `script` in a step VM with `network` under `addresses`; its log lines and upper
    /// directory.
    fn run(
        &self,
        name: &str,
        network: Network,
        addresses: AddressPolicy,
        env: &[&str],
        script: &str,
    ) -> (Vec<String>, PathBuf) {
        let dir = self.tmp.path().join(name);
        let upper = dir.join("upper");
        let work = dir.join("work");
        std::fs::create_dir_all(&upper).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let config = ExecConfig {
            run_dir: dir.join("run"),
            memory_bytes: 256 << 20,
            addresses,
            ..ExecConfig::default()
        };
        let exec = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(VmExecutor::new(guest_assets(), config, 1))
            .expect("the VM executor");
        let spec = StepSpec {
            index: 3,
            lower_dirs: vec![self.root.clone()],
            layer_limits: Default::default(),
            upper_dir: upper.clone(),
            work_dir: work,
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: env.iter().map(|s| s.to_string()).collect(),
            user: None,
            workdir: "/".into(),
            files: vec![],
            network,
            security: kiln_recipes::plan::Security::Sandbox,
            mounts: vec![],
            secrets: vec![],
            timeout: Duration::from_secs(600),
            log_budget: None,
        };
        let mut lines = Vec::new();
        // Outside any runtime: the executor runs the step on a runtime of its own.
        let r = exec.run(&spec, &AtomicBool::new(false), &mut |l: LogLine| {
            lines.push(l.text)
        });
        r.unwrap_or_else(|e| panic!("{name}: {e}\n{lines:#?}"));
        (lines, upper)
    }
}

fn loopback_hosts(names: &[&str]) -> BTreeMap<String, Vec<IpAddr>> {
    names
        .iter()
        .map(|n| (n.to_string(), vec![Ipv4Addr::LOCALHOST.into()]))
        .collect()
}

fn rules(allow: &[&str], deny: &[&str]) -> Egress {
    let p = |v: &[&str]| v.iter().map(|r| EgressRule::parse(r).unwrap()).collect();
    Egress {
        allow: p(allow),
        deny: p(deny),
    }
}

fn has(lines: &[String], l: &str) -> bool {
    lines.iter().any(|x| x == l)
}

/// A `default` step and an allow-list step fetch from a local server through the proxy
/// (private switch on); the `default` step's concurrent downloads all arrive whole while
/// one connection stays stalled; the allow-list's deny wins and a name off it is refused.
#[test]
fn vm_steps_fetch_through_the_egress_proxy_concurrently_and_by_their_rules() {
    let f = fixture();
    let server = Server::start();
    let port = server.port;
    let addresses = AddressPolicy {
        allow_private_addresses: true,
        hosts: loopback_hosts(&["pkg.test", "other.example", "bad.test"]),
        ..Default::default()
    };

    // `default`: any name whose addresses the policy permits.
    let mut script = format!(
        "env | grep -i _proxy= | sort | tr '\\n' ' '; echo; \
         echo resolv $(wc -c < /etc/resolv.conf); \
         wget -q -O /got-default http://pkg.test:{port}/small && echo small-ok; \
         wget -q -O /dev/null http://pkg.test:{port}/held & held=$!; \
         mkdir /dl; pids=; "
    );
    for n in 0..PARALLEL {
        script.push_str(&format!(
            "wget -q -O /dl/{n} http://pkg.test:{port}/big/{n} & pids=\"$pids $!\"; "
        ));
    }
    script.push_str(
        "ok=0; for p in $pids; do wait $p && ok=$((ok+1)); done; echo parallel-ok $ok; \
         kill $held; wait $held; echo done",
    );
    let (lines, upper) = f.run("default", Network::Default, addresses.clone(), &[], &script);
    assert_eq!(format!("{}\n", lines[0]), PROXY_ONLY_LINE, "{lines:#?}");
    assert_eq!(
        lines[1],
        "HTTPS_PROXY=http://127.0.0.1:3128 HTTP_PROXY=http://127.0.0.1:3128 \
         NO_PROXY=localhost,127.0.0.1,::1 http_proxy=http://127.0.0.1:3128 \
         https_proxy=http://127.0.0.1:3128 no_proxy=localhost,127.0.0.1,::1 ",
        "{lines:#?}"
    );
    for l in [
        "resolv 0",
        "small-ok",
        &format!("parallel-ok {PARALLEL}"),
        "done",
    ] {
        assert!(has(&lines, l), "{l:?} missing: {lines:#?}");
    }
    assert_eq!(
        std::fs::read(upper.join("got-default")).unwrap(),
        b"hello small\n"
    );
    for n in 0..PARALLEL {
        let got = std::fs::read(upper.join(format!("dl/{n}"))).unwrap();
        assert!(got == big_body(n), "download {n}: {} bytes", got.len());
    }
    assert_eq!(server.hits("/held"), 1);
    // The empty resolv.conf was the step's view only: the image had none, the layer has none.
    assert!(!upper.join("etc").exists(), "{lines:#?}");
    assert!(
        !lines.iter().any(|l| l.starts_with("egress: ")),
        "{lines:#?}"
    );

    // An allow-list: `*.test` but not `bad.test` (deny wins); `other.example` is off it.
    let (lines, upper) = f.run(
        "allow",
        Network::Allow(rules(&["*.test"], &["bad.test"])),
        addresses,
        &[],
        &format!(
            "wget -q -O /got-allow http://pkg.test:{port}/small && echo allow-ok; \
             wget -q -O - http://bad.test:{port}/small || echo bad-refused; \
             wget -q -O - http://other.example:{port}/small || echo other-refused; \
             (printf 'CONNECT pkg.test:{port} HTTP/1.1\\r\\nHost: pkg.test:{port}\\r\\n\\r\\n\
             GET /small HTTP/1.0\\r\\nHost: pkg.test\\r\\n\\r\\n'; sleep 3) \
             | nc 127.0.0.1 3128 | grep -q '^hello small' && echo connect-ok"
        ),
    );
    assert_eq!(format!("{}\n", lines[0]), PROXY_ONLY_LINE, "{lines:#?}");
    for l in [
        "allow-ok",
        "bad-refused",
        "other-refused",
        "connect-ok",
        &format!("egress: refused GET bad.test:{port}: deny bad.test"),
        &format!("egress: refused GET other.example:{port}: not on the allow list"),
    ] {
        assert!(has(&lines, l), "{l:?} missing: {lines:#?}");
    }
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("egress: ")).count(),
        2,
        "{lines:#?}"
    );
    assert_eq!(
        std::fs::read(upper.join("got-allow")).unwrap(),
        b"hello small\n"
    );
    // The server saw the allowed requests only (the tunnelled one too).
    assert_eq!(server.hits("/small"), 3);
    assert_eq!(server.seen.lock().unwrap().len(), 3 + 1 + PARALLEL);
}

/// With the private switch off, a name mapped to 127.0.0.1, the metadata address and the
/// host's loopback are refused, each with its log line; a `none` step reaches nothing:
/// nothing listens on the proxy port in its guest.
#[test]
fn vm_steps_refuse_private_addresses_and_none_reaches_nothing() {
    let f = fixture();
    let server = Server::start();
    let port = server.port;
    let addresses = AddressPolicy {
        allow_private_addresses: false,
        hosts: loopback_hosts(&["pkg.test"]),
        ..Default::default()
    };
    // The step's own NO_PROXY would keep 127.0.0.1 off the proxy; here it must ask it.
    let (lines, upper) = f.run(
        "private",
        Network::Default,
        addresses.clone(),
        &["NO_PROXY=", "no_proxy="],
        &format!(
            "wget -q -O /got http://pkg.test:{port}/small || echo pkg-refused; \
             wget -q -O - http://169.254.169.254/latest/meta-data/ || echo md-refused; \
             wget -q -O - http://127.0.0.1:{port}/small || echo lo-refused"
        ),
    );
    let why = "is not a public address (loopback, private, link-local, metadata or NAT64)";
    for l in [
        "pkg-refused",
        "md-refused",
        "lo-refused",
        &format!("egress: refused GET pkg.test:{port}: 127.0.0.1 {why}"),
        &format!("egress: refused GET 169.254.169.254:80: 169.254.169.254 {why}"),
        &format!("egress: refused GET 127.0.0.1:{port}: 127.0.0.1 {why}"),
    ] {
        assert!(has(&lines, l), "{l:?} missing: {lines:#?}");
    }
    assert!(!upper.join("got").exists() || std::fs::read(upper.join("got")).unwrap().is_empty());

    // `none`: no proxy variables, no port, no listener; pointing wget at the proxy's
    // address by hand gets a refused connection.
    let (lines, _) = f.run(
        "none",
        Network::None,
        AddressPolicy {
            allow_private_addresses: true,
            ..addresses
        },
        &[],
        &format!(
            "env | grep -ci _proxy=; \
             http_proxy=http://127.0.0.1:3128 wget -q -T 5 -O - http://pkg.test:{port}/small \
             2>/dev/null && echo REACHED || echo proxy-unreachable; \
             wget -q -T 5 -O - http://127.0.0.1:{port}/small 2>/dev/null && echo REACHED \
             || echo direct-unreachable"
        ),
    );
    assert_eq!(lines, vec!["0", "proxy-unreachable", "direct-unreachable"]);
    assert!(server.seen.lock().unwrap().is_empty());
}
