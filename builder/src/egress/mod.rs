//! Egress of build steps: the network modes `none`, `default` and an allow-list
//! ([`kiln_recipes::plan::Network`]), and how an allow-list is enforced.
//!
//! - [`address`]: which addresses a build may reach from the host at all. Loopback,
//!   private, link-local, metadata (169.254.169.254, fd00:ec2::254), CGNAT, NAT64 and the
//!   other non-public ranges are refused whatever a recipe says, unless the test-only
//!   switch [`address::AddressPolicy::allow_private_addresses`] is on. `ADD <url>` downloads
//!   use the same policy.
//! - [`policy`]: matching the destination a client asked for against the step's rules
//!   (domains, `*.domain`, addresses, CIDR ranges; deny wins).
//! - [`proxy`]: an HTTP proxy on the host (absolute-form HTTP, HTTPS by `CONNECT`) that
//!   checks the name asked for, resolves it on the host only after the check, re-checks
//!   every resolved address against the address policy and connects to one of those
//!   addresses (pinned: nothing is looked up twice). Every refused or failed connection is
//!   one line in the step's log: destination and rule.
//! - [`ca`]: extra CA certificates a build trusts (a TLS-inspecting proxy's), and the bundle
//!   a step sees them in.
//!
//! How an allow-list step reaches the proxy (namespace executor, `exec::LinuxExecutor`).
//! The step gets its own network namespace with nothing but `lo`: no slirp4netns, no route
//! anywhere. While the step's keeper waits after `unshare(CLONE_NEWNET)`, the executor opens
//! a TCP listener *inside that namespace* from a short-lived host thread that joins it with
//! `setns(2)` (a socket stays in the namespace it was made in, whichever namespace its
//! owner later runs in), brings `lo` up and binds `127.0.0.1:`[`PROXY_PORT`]. The host
//! process keeps the listening socket and serves it with [`proxy::spawn`]; the step sees a
//! local proxy at that address and is given `HTTP_PROXY`, `HTTPS_PROXY`, `http_proxy`,
//! `https_proxy` (`http://127.0.0.1:3128`) and `NO_PROXY`/`no_proxy`
//! (`localhost,127.0.0.1,::1`, its own loopback). No unix socket or forwarder process is
//! needed, and no packet of the step ever leaves its namespace: the bytes cross into the
//! host inside the kernel, as the accepted connection's data. A program that ignores the
//! proxy variables reaches nothing. Its `/etc/resolv.conf` is empty: names are resolved by
//! the proxy, on the host.
//!
//! The microVM executor (`kiln_pipeline::vmexec`) reaches the same [`proxy::Proxy`] by
//! handing [`proxy::Proxy::serve`] a stream from the VM's egress port instead of an
//! accepted TCP connection: the guest init listens on `127.0.0.1:`[`PROXY_PORT`] and carries
//! each connection over a virtio-serial port, multiplexed with per-stream flow control
//! (`kiln_guest::egress`, `kiln_vmm::egress`). A VM step has no network card, so there a
//! `default` step also goes through a proxy ([`proxy::Proxy::addresses_only`]: any name,
//! public addresses only) and reaches HTTP and HTTPS by `CONNECT` only, where a namespace
//! step's `default` is slirp4netns and carries any protocol. Both get [`proxy_env`].

pub mod address;
pub mod ca;
pub mod policy;
pub mod proxy;

use kiln_recipes::plan::Network;

/// The port of the proxy inside an allow-list step (`127.0.0.1:3128`: Squid's default
/// `http_port`, the port proxy-aware tools are most often pointed at).
pub const PROXY_PORT: u16 = 3128;

/// The network a step gets when the build sets one for all its steps (`over`; `None`: the
/// recipe's own `step`). A build-wide `none` makes every step `none`; a build-wide
/// allow-list replaces `default` and allow-list steps' network with it, keeps `none` steps
/// as they are and leaves `host` steps to the `network.host` entitlement; a build-wide
/// `host` (`docker build --network host`) gives `default` steps the host's network and
/// keeps `none` and allow-list steps as they are (each asked for less than the default);
/// a build-wide `default` changes nothing. Whether a `host` step may run is the
/// executor's check of the `network.host` entitlement, whichever way it got `host`.
pub fn effective_network(step: &Network, over: Option<&Network>) -> Network {
    match (over, step) {
        (Some(Network::Host), Network::Default) => Network::Host,
        (None | Some(Network::Default | Network::Host), s) => s.clone(),
        (Some(Network::None), _) => Network::None,
        (Some(Network::Allow(e)), Network::Default | Network::Allow(_)) => {
            Network::Allow(e.clone())
        }
        (Some(Network::Allow(_)), s) => s.clone(),
    }
}

/// `plan` with every `RUN` step's network replaced by [`effective_network`] under `over`.
pub fn with_network(plan: &kiln_recipes::BuildPlan, over: &Network) -> kiln_recipes::BuildPlan {
    let mut plan = plan.clone();
    for step in plan.stages.iter_mut().flat_map(|s| s.steps.iter_mut()) {
        if let kiln_recipes::plan::Action::Run(r) = &mut step.action {
            r.network = effective_network(&r.network, Some(over));
        }
    }
    plan
}

/// The proxy variables an allow-list step gets, `KEY=value` (curl, apt, pip, npm, git and
/// Python's `urllib` read the lowercase forms; some tools only the uppercase ones).
pub fn proxy_env() -> Vec<String> {
    let url = format!("http://127.0.0.1:{PROXY_PORT}");
    let mut env = Vec::new();
    for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        env.push(format!("{k}={url}"));
    }
    for k in ["NO_PROXY", "no_proxy"] {
        env.push(format!("{k}=localhost,127.0.0.1,::1"));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_recipes::plan::{Egress, EgressRule};

    #[test]
    fn build_wide_network_overrides_as_documented() {
        let e = Egress {
            allow: vec![EgressRule::parse("a.example").unwrap()],
            deny: vec![],
        };
        let other = Network::Allow(Egress::default());
        let allow = Network::Allow(e);
        assert_eq!(effective_network(&Network::Default, None), Network::Default);
        assert_eq!(effective_network(&other, None), other);
        assert_eq!(
            effective_network(&Network::Host, Some(&Network::None)),
            Network::None
        );
        assert_eq!(effective_network(&Network::Default, Some(&allow)), allow);
        assert_eq!(effective_network(&other, Some(&allow)), allow);
        assert_eq!(
            effective_network(&Network::None, Some(&allow)),
            Network::None
        );
        assert_eq!(
            effective_network(&Network::Host, Some(&allow)),
            Network::Host
        );
        assert_eq!(effective_network(&other, Some(&Network::Default)), other);
        let host = Some(&Network::Host);
        assert_eq!(effective_network(&Network::Default, host), Network::Host);
        assert_eq!(effective_network(&Network::None, host), Network::None);
        assert_eq!(effective_network(&allow, host), allow);
        assert_eq!(effective_network(&Network::Host, host), Network::Host);
    }
}
