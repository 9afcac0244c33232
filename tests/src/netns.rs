//! A network namespace joined to the host by a veth pair, for tests that run a server as
//! another host and cut it off (as root; `ip` from iproute2, which `ci/setup.sh` installs).
//!
//! The pair's host side holds `host_ip`, the namespace side `ns_ip`, in a /30 of 10.128.0.0/9
//! picked from the process id and a counter (one not on any interface yet), so concurrent
//! tests and runs do not collide. From inside the namespace only `host_ip` of the host is
//! reachable (not its 127.0.0.1): servers the namespace needs listen there, or a forwarder
//! does ([`crate::fault_proxy::FaultProxy::start_on`]). [`Netns::cut`] sets the host side
//! down: the namespace's packets are then dropped, not refused, so its connections hang as
//! in a real network partition, while the host still reaches `host_ip` itself.
//! Dropping the value deletes the pair and the namespace, also when the test panics.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A network namespace, its veth pair and addresses; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    /// Its name (`/run/netns/NAME`, `ip netns exec NAME`, `nsenter --net=/run/netns/NAME`).
    pub name: String,
    /// The host side of the veth pair.
    pub host_if: String,
    /// The host side's address (a /30 with [`Netns::ns_ip`]).
    pub host_ip: Ipv4Addr,
    /// The namespace side's address.
    pub ns_ip: Ipv4Addr,
}

/// Runs `ip ARGS`, panicking with its stderr when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2) missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether `addr` is on some interface of the host already.
fn in_use(addr: Ipv4Addr) -> bool {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .expect("ip (iproute2) missing: run ci/setup.sh");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .any(|w| w.split('/').next() == Some(&addr.to_string()))
}

impl Netns {
    /// Makes a new namespace and veth pair, both sides up, the namespace's loopback up.
    pub fn new() -> Netns {
        static N: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        loop {
            let n = N.fetch_add(1, Ordering::SeqCst);
            // A /30 of 10.128.0.0/9: 2^21 of them.
            let idx = (pid.wrapping_mul(64).wrapping_add(n)) % (1 << 21);
            let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + idx * 4;
            let (host_ip, ns_ip) = (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2));
            if in_use(host_ip) || in_use(ns_ip) {
                continue;
            }
            let ns = Netns {
                name: format!("kiln-test-{pid}-{n}"),
                host_if: format!("kt{pid}x{n}h"),
                host_ip,
                ns_ip,
            };
            let ns_if = format!("kt{pid}x{n}n");
            assert!(ns.host_if.len() <= 15, "interface name {}", ns.host_if);
            // Left over by a killed run with this pid: gone before it is made again.
            ns.remove();
            ip(&["netns", "add", &ns.name]);
            ip(&[
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &ns_if,
            ]);
            ip(&["link", "set", &ns_if, "netns", &ns.name]);
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &ns.host_if]);
            ip(&["link", "set", &ns.host_if, "up"]);
            ip(&[
                "-n",
                &ns.name,
                "addr",
                "add",
                &format!("{ns_ip}/30"),
                "dev",
                &ns_if,
            ]);
            ip(&["-n", &ns.name, "link", "set", &ns_if, "up"]);
            ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
            return ns;
        }
    }

    /// Cuts the namespace off: the host side of the pair goes down, and every packet between
    /// the namespace and the host is dropped.
    pub fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]);
    }

    /// Joins it again after [`Netns::cut`]: connections that were not given up go on.
    pub fn restore(&self) {
        ip(&["link", "set", &self.host_if, "up"]);
    }

    fn remove(&self) {
        // Each may be missing (never made, or gone with the other): errors are expected.
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.remove();
    }
}

impl Default for Netns {
    fn default() -> Self {
        Self::new()
    }
}
