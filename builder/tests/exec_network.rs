//! The real step executor's networks: none, host (an entitlement), default (slirp4netns,
//! without the host's loopback), an egress allow-list through kiln's proxy (apt and git
//! through it), and `RUN --mount=type=ssh`. Shares `exec.rs`'s fixture (`exec_fixture`).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kiln_builder::exec::ExecError;
use kiln_recipes::plan::Network;

mod exec_fixture;

use exec_fixture::*;

#[test]
fn network_none_has_only_loopback_and_no_host_services() {
    let f = fixture("netnone");
    let (listener, outside) = outside_listener();
    let registry = std::env::var("KILN_TEST_REGISTRY")
        .expect("KILN_TEST_REGISTRY unset: source /var/cache/kiln-ci/env (ci/setup.sh)");
    let script = format!(
        "REG={registry}; ls /sys/class/net; cat /sys/class/net/lo/operstate; \
         ping -c1 -W1 127.0.0.1 >/dev/null && echo lo-ok; \
         nc -w 2 ${{REG%:*}} ${{REG#*:}} </dev/null 2>/dev/null && echo REACHED || echo unreachable; \
         nc -w 2 {} {} </dev/null 2>/dev/null && echo REACHED || echo unreachable",
        outside.ip(),
        outside.port()
    );
    let (r, lines) = f.run(&f.spec(&script));
    r.unwrap();
    assert_eq!(lines[0], "lo");
    assert_eq!(lines[2], "lo-ok");
    assert_eq!(lines[3], "unreachable");
    assert_eq!(lines[4], "unreachable");
    drop(listener);
}

#[test]
fn network_host_refused_unless_allowed() {
    let f = fixture("nethost");
    let registry = std::env::var("KILN_TEST_REGISTRY")
        .expect("KILN_TEST_REGISTRY unset: source /var/cache/kiln-ci/env (ci/setup.sh)");
    let mut spec = f.spec(&format!(
        "REG={registry}; nc -w 5 ${{REG%:*}} ${{REG#*:}} </dev/null 2>/dev/null && echo REACHED || echo unreachable"
    ));
    spec.network = Network::Host;
    let (r, _) = f.run(&spec);
    assert!(matches!(r, Err(ExecError::NetworkHostRefused)));
    let mut cfg = f.config();
    cfg.allow_network_host = true;
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap();
    // The check in the other network tests can tell: the registry is reachable from here.
    assert_eq!(lines, vec!["REACHED"]);
}

#[test]
fn network_default_outbound_namespace_without_host_loopback() {
    let f = fixture("netdefault");
    let registry = std::env::var("KILN_TEST_REGISTRY")
        .expect("KILN_TEST_REGISTRY unset: source /var/cache/kiln-ci/env (ci/setup.sh)");
    let port = registry.rsplit(':').next().unwrap();
    let (listener, outside) = outside_listener();
    let mut spec = f.spec(&format!(
        "ls /sys/class/net | tr '\\n' ' '; echo; cat /etc/resolv.conf; \
         nc -w 3 127.0.0.1 {port} </dev/null 2>/dev/null && echo REACHED || echo unreachable; \
         nc -w 3 10.0.2.2 {port} </dev/null 2>/dev/null && echo REACHED || echo unreachable; \
         nc -w 10 {} {} </dev/null 2>/dev/null && echo REACHED || echo unreachable",
        outside.ip(),
        outside.port()
    ));
    spec.network = Network::Default;
    let (r, lines) = f.run(&spec);
    drop(listener);
    r.unwrap();
    assert_eq!(lines[0], "lo tap0 ");
    assert_eq!(lines[1], "nameserver 10.0.2.3");
    assert_eq!(lines[2], "unreachable");
    assert_eq!(lines[3], "unreachable");
    // Outbound works: a service on the host's own non-loopback address is reachable.
    assert_eq!(lines[4], "REACHED");
}

/// A TCP listener on the host's primary non-loopback address (the address the kernel would
/// use to reach a public one; no packet is sent), accepting in the background.
fn outside_listener() -> (std::net::TcpListener, std::net::SocketAddr) {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    probe
        .connect("192.0.2.255:9")
        .or_else(|_| probe.connect("10.255.255.255:9"))
        .expect("no non-loopback IPv4 route on this host");
    let ip = probe.local_addr().unwrap().ip();
    assert!(
        !ip.is_loopback(),
        "no non-loopback IPv4 address on this host"
    );
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let l = listener.try_clone().unwrap();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            drop(conn);
        }
    });
    (listener, addr)
}

/// A layer holding the host's `programs` (absolute paths) and the shared libraries they
/// load (Debian bookworm's, as the host's: `ldd` lists them), each at its host path, to
/// stack over a fixture's root.
fn host_programs_layer(f: &Fixture, name: &str, programs: &[PathBuf]) -> PathBuf {
    let layer = f._tmp.path().join(name);
    let mut files = programs.to_vec();
    for prog in programs {
        let ldd = std::process::Command::new("ldd")
            .arg(prog)
            .output()
            .expect("ldd missing (libc-bin)");
        assert!(
            ldd.status.success(),
            "ldd {} failed: is it installed?",
            prog.display()
        );
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(p) = path.filter(|p| p.starts_with('/')) {
                files.push(PathBuf::from(p));
            }
        }
    }
    for src in files {
        let dest = layer.join(src.strip_prefix("/").unwrap());
        fs::create_dir_all(dest.parent().unwrap()).unwrap();
        fs::copy(&src, &dest).unwrap_or_else(|e| panic!("copying {}: {e}", src.display()));
    }
    layer
}

/// [`host_programs_layer`] with the host's `curl`.
fn curl_layer(f: &Fixture) -> PathBuf {
    host_programs_layer(f, "curl-layer", &[PathBuf::from("/usr/bin/curl")])
}

fn egress_rules(allow: &[&str], deny: &[&str]) -> kiln_recipes::plan::Egress {
    let p = |v: &[&str]| {
        v.iter()
            .map(|r| kiln_recipes::plan::EgressRule::parse(r).unwrap())
            .collect()
    };
    kiln_recipes::plan::Egress {
        allow: p(allow),
        deny: p(deny),
    }
}

/// A hosts table pointing `names` at 127.0.0.1 (the test resolver of the egress proxy).
fn loopback_hosts(names: &[&str]) -> std::collections::BTreeMap<String, Vec<std::net::IpAddr>> {
    names
        .iter()
        .map(|n| (n.to_string(), vec![std::net::Ipv4Addr::LOCALHOST.into()]))
        .collect()
}

/// With the test-only switch on (servers on 127.0.0.1), an allow-list step reaches a listed
/// name through the proxy by plain HTTP and by CONNECT, `*.domain` covers names under it,
/// deny wins, a name not on the list is refused with one log line naming destination and
/// rule, and a program that ignores the proxy variables reaches nothing.
#[test]
fn egress_allow_list_reaches_listed_names_only() {
    let f = fixture("egress-allow");
    let server = kiln_tests::http::LocalServer::start();
    let port = server.port;
    let mut cfg = f.config();
    cfg.addresses = kiln_builder::egress::address::AddressPolicy {
        allow_private_addresses: true,
        hosts: loopback_hosts(&["pkg.test", "other.test", "a.cdn.test", "bad.cdn.test"]),
        ..Default::default()
    };
    let mut spec = f.spec(&format!(
        "env | grep -i _proxy= | sort | tr '\\n' ' '; echo; wc -c < /etc/resolv.conf; \
         curl -fsS 'http://pkg.test:{port}/plain?q=1'; \
         curl -fsS -p http://pkg.test:{port}/tunnel; \
         curl -fsS http://a.cdn.test:{port}/sub; \
         echo other $(curl -s -o /dev/null -w '%{{http_code}}' http://other.test:{port}/); \
         echo other-connect $(curl -s -p -o /dev/null -w '%{{http_connect}}' http://other.test:{port}/); \
         echo bad $(curl -s -o /dev/null -w '%{{http_code}}' http://bad.cdn.test:{port}/); \
         curl --noproxy '*' -s -o /dev/null -m 5 http://127.0.0.1:{port}/ && echo REACHED || echo direct-unreachable"
    ));
    spec.lower_dirs = vec![curl_layer(&f), f.root.clone()];
    spec.network = Network::Allow(egress_rules(&["pkg.test", "*.cdn.test"], &["bad.cdn.test"]));
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    let has = |l: &str| lines.iter().any(|x| x == l);
    assert_eq!(
        lines[0],
        "HTTPS_PROXY=http://127.0.0.1:3128 HTTP_PROXY=http://127.0.0.1:3128 \
         NO_PROXY=localhost,127.0.0.1,::1 http_proxy=http://127.0.0.1:3128 \
         https_proxy=http://127.0.0.1:3128 no_proxy=localhost,127.0.0.1,::1 ",
        "{lines:#?}"
    );
    assert_eq!(lines[1], "0", "resolv.conf is empty: {lines:#?}");
    for l in [
        "hello /plain?q=1",
        "hello /tunnel",
        "hello /sub",
        "other 403",
        "other-connect 403",
        "bad 403",
        "direct-unreachable",
    ] {
        assert!(has(l), "{l:?} missing: {lines:#?}");
    }
    for l in [
        format!("egress: refused GET other.test:{port}: not on the allow list"),
        format!("egress: refused CONNECT other.test:{port}: not on the allow list"),
        format!("egress: refused GET bad.cdn.test:{port}: deny bad.cdn.test"),
    ] {
        assert!(has(&l), "{l:?} missing: {lines:#?}");
    }
    let refusals = lines.iter().filter(|l| l.starts_with("egress: ")).count();
    assert_eq!(refusals, 3, "{lines:#?}");
    // The server saw the allowed requests only, in origin form, with their names.
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            format!("GET /plain?q=1 HTTP/1.1 host=pkg.test:{port}"),
            format!("GET /tunnel HTTP/1.1 host=pkg.test:{port}"),
            format!("GET /sub HTTP/1.1 host=a.cdn.test:{port}"),
        ]
    );
}

/// With the switch off (production), a listed name that resolves to a private address is
/// refused after the lookup, and the metadata addresses are refused even when listed.
#[test]
fn egress_refuses_private_and_metadata_addresses_even_when_listed() {
    let f = fixture("egress-private");
    let server = kiln_tests::http::LocalServer::start();
    let port = server.port;
    let mut cfg = f.config();
    cfg.addresses = kiln_builder::egress::address::AddressPolicy {
        allow_private_addresses: false,
        hosts: loopback_hosts(&["pkg.test"]),
        ..Default::default()
    };
    let mut spec = f.spec(&format!(
        "echo pkg $(curl -s -o /dev/null -w '%{{http_code}}' http://pkg.test:{port}/); \
         echo pkg-connect $(curl -s -p -o /dev/null -w '%{{http_connect}}' http://pkg.test:{port}/); \
         echo md $(curl -s -o /dev/null -w '%{{http_code}}' http://169.254.169.254/latest/meta-data/); \
         echo md6 $(curl -s -o /dev/null -w '%{{http_code}}' 'http://[fd00:ec2::254]/latest/meta-data/'); \
         echo lo $(curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/)"
    ));
    spec.lower_dirs = vec![curl_layer(&f), f.root.clone()];
    spec.network = Network::Allow(egress_rules(
        &[
            "pkg.test",
            "169.254.169.254",
            "fd00:ec2::254",
            "127.0.0.0/8",
        ],
        &[],
    ));
    // The step's own NO_PROXY would send 127.0.0.1 past the proxy; here it must ask it.
    spec.env = vec!["NO_PROXY=".into(), "no_proxy=".into()];
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    let has = |l: &str| lines.iter().any(|x| x == l);
    for l in ["pkg 403", "pkg-connect 403", "md 403", "md6 403", "lo 403"] {
        assert!(has(l), "{l:?} missing: {lines:#?}");
    }
    let why = "is not a public address (loopback, private, link-local, metadata or NAT64)";
    for l in [
        format!("egress: refused GET pkg.test:{port}: 127.0.0.1 {why}"),
        format!("egress: refused CONNECT pkg.test:{port}: 127.0.0.1 {why}"),
        format!("egress: refused GET 169.254.169.254:80: 169.254.169.254 {why}"),
        format!("egress: refused GET [fd00:ec2::254]:80: fd00:ec2::254 {why}"),
        format!("egress: refused GET 127.0.0.1:{port}: 127.0.0.1 {why}"),
    ] {
        assert!(has(&l), "{l:?} missing: {lines:#?}");
    }
    assert!(server.seen.lock().unwrap().is_empty());
}

/// `none` reaches nothing: no proxy listens in the step, so even a client pointed at the
/// proxy's address gets no connection, and the host's loopback server is out of reach.
#[test]
fn egress_none_reaches_nothing_even_through_the_proxy_address() {
    let f = fixture("egress-none");
    let server = kiln_tests::http::LocalServer::start();
    let port = server.port;
    let mut spec = f.spec(&format!(
        "curl -s -m 5 -x http://127.0.0.1:3128 http://pkg.test:{port}/ && echo REACHED || echo proxy-unreachable; \
         curl -s -m 5 http://127.0.0.1:{port}/ && echo REACHED || echo direct-unreachable"
    ));
    spec.lower_dirs = vec![curl_layer(&f), f.root.clone()];
    spec.network = Network::None;
    let mut cfg = f.config();
    cfg.addresses.allow_private_addresses = true;
    cfg.addresses.hosts = loopback_hosts(&["pkg.test"]);
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap();
    assert_eq!(lines, vec!["proxy-unreachable", "direct-unreachable"]);
    assert!(server.seen.lock().unwrap().is_empty());
}

/// apt through the proxy: an allow-list step on the Debian fixture runs `apt-get update`
/// and `apt-get install` against an apt repository served on 127.0.0.1 (a `.deb` made
/// with `dpkg-deb`, a hand-written `Release` with its SHA256, `[trusted=yes]`); apt reads
/// `http_proxy` from the environment.
#[test]
fn egress_apt_installs_from_a_local_repository_through_the_proxy() {
    let f = fixture("egress-apt");
    let base = debian_root(&f);
    let repo = f._tmp.path().join("repo");
    kiln_tests::pkgs::apt_repo(&repo);
    let server = kiln_tests::http::LocalServer::serve_dir(&repo);
    let port = server.port;
    let mut cfg = f.config();
    cfg.addresses = kiln_builder::egress::address::AddressPolicy {
        allow_private_addresses: true,
        hosts: loopback_hosts(&["apt.test"]),
        ..Default::default()
    };
    let mut spec = f.spec(&format!(
        "set -e; rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*; \
         echo 'deb [trusted=yes] http://apt.test:{port}/ test main' > /etc/apt/sources.list.d/t.list; \
         apt-get -q update >/dev/null; apt-get -q install -y kiln-hello >/dev/null; \
         cat /usr/share/kiln-hello/hello.txt"
    ));
    spec.lower_dirs = vec![base];
    spec.network = Network::Allow(egress_rules(&["apt.test"], &[]));
    spec.timeout = Duration::from_secs(300);
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    assert_eq!(
        lines.last().map(String::as_str),
        Some(kiln_tests::pkgs::HELLO),
        "{lines:#?}"
    );
    let seen = server.seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|l| l.starts_with("GET /pool/kiln-hello_1.0_all.deb ")),
        "{seen:#?}"
    );
}

/// git over HTTP through the proxy: an allow-list step clones a repository served on
/// 127.0.0.1 with git's "dumb" HTTP protocol (static files after `git update-server-info`,
/// gitprotocol-http(5)); git's `git-remote-http` reads `http_proxy` through libcurl.
#[test]
fn egress_git_clones_over_http_through_the_proxy() {
    let f = fixture("egress-git");
    let served = f._tmp.path().join("served");
    kiln_tests::pkgs::git_repo(&served);
    let server = kiln_tests::http::LocalServer::serve_dir(&served);
    let port = server.port;
    let which = |prog: &str| {
        let o = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {prog}")])
            .output()
            .unwrap();
        PathBuf::from(String::from_utf8(o.stdout).unwrap().trim())
    };
    let git = which("git");
    let exec_path = String::from_utf8(
        kiln_tests::run_ok(std::process::Command::new(&git).arg("--exec-path")).stdout,
    )
    .unwrap();
    let remote_http = Path::new(exec_path.trim()).join("git-remote-http");
    let layer = host_programs_layer(&f, "git-layer", &[git.clone(), remote_http]);
    let mut cfg = f.config();
    cfg.addresses = kiln_builder::egress::address::AddressPolicy {
        allow_private_addresses: true,
        hosts: loopback_hosts(&["git.test"]),
        ..Default::default()
    };
    let mut spec = f.spec(&format!(
        "{} clone -q http://git.test:{port}/repo.git /tmp/r && cat /tmp/r/README",
        git.display()
    ));
    spec.env = vec!["HOME=/tmp".into()];
    spec.lower_dirs = vec![layer, f.root.clone()];
    spec.network = Network::Allow(egress_rules(&["git.test"], &[]));
    let (r, lines) = f.run_with(cfg, &spec, &AtomicBool::new(false));
    r.unwrap_or_else(|e| panic!("{e}: {lines:#?}"));
    assert_eq!(
        lines.last().map(String::as_str),
        Some(kiln_tests::pkgs::HELLO),
        "{lines:#?}"
    );
    let seen = server.seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|l| l.starts_with("GET /repo.git/info/refs")),
        "{seen:#?}"
    );
}

/// Issue 41: a `RUN --mount=type=ssh` step reaches a real `ssh-agent` of the host through
/// the socket at its target (owned and moded as the mount says), lists its key, and cannot
/// remove it (the read-only agent BuildKit forwards). The step runs the host's `ssh-add`
/// (its `/usr` bound in read-only).
#[test]
fn ssh_mount_reaches_the_agent_read_only() {
    use kiln_builder::exec::{MountKind, StepMount};
    use std::process::Command;
    let f = fixture("ssh");
    std::os::unix::fs::symlink("usr/lib", f.root.join("lib")).unwrap();
    std::os::unix::fs::symlink("usr/lib64", f.root.join("lib64")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let agent = kiln_tests::ssh::Agent::start(dir.path());
    let sock = agent.socket.clone();
    let ok = |c: &mut Command| {
        let out = c.output().unwrap();
        assert!(out.status.success(), "{c:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let target = "/run/buildkit/ssh_agent.0";
    let mut spec = f.spec(
        "echo sock=$SSH_AUTH_SOCK; ls -ln $SSH_AUTH_SOCK | awk '{print $1, $3, $4}'; \
         /usr/bin/ssh-add -l | awk '{print $3}'; \
         /usr/bin/ssh-add -D >/dev/null 2>&1 && echo removed || echo refused",
    );
    spec.env = vec![format!("SSH_AUTH_SOCK={target}")];
    spec.mounts = vec![
        StepMount {
            target: "/usr".into(),
            kind: MountKind::Bind {
                root: "/".into(),
                path: "usr".into(),
                readwrite: false,
            },
        },
        StepMount {
            target: target.into(),
            kind: MountKind::Ssh {
                id: "default".into(),
                agent: sock.clone(),
                mode: 0o660,
                uid: 1000,
                gid: 1000,
            },
        },
    ];
    let (r, lines) = f.run(&spec);
    let listed = ok(Command::new("/usr/bin/ssh-add")
        .env("SSH_AUTH_SOCK", &sock)
        .arg("-l"));
    drop(agent);
    r.unwrap();
    assert_eq!(
        lines,
        vec![
            format!("sock={target}"),
            "srw-rw---- 1000 1000".into(),
            kiln_tests::ssh::KEY_COMMENT.into(),
            "refused".into(),
        ]
    );
    assert!(listed.contains(kiln_tests::ssh::KEY_COMMENT), "{listed}");
    // Nothing of the mount is in the layer.
    assert!(!f.upper.join("run").exists());
}
