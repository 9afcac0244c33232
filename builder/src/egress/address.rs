//! Which addresses builds may reach, and resolving a host name under that rule: one policy
//! for everything a build reaches from the host (`ADD <url>` downloads and the egress proxy
//! of allow-list steps).
//!
//! A name is resolved once, every address it gives is checked, and the caller connects only
//! to the addresses checked (no second lookup, so a name that changes its answer between the
//! check and the connection, DNS rebinding, reaches nothing new).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

/// What a build may connect to from the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    /// Allow loopback, private and link-local addresses (tests, with servers on 127.0.0.1;
    /// trusted builds only). Off in production: then only [`is_public`] addresses are
    /// reached.
    pub allow_private_addresses: bool,
    /// Names answered before the system resolver, as a hosts(5) file would (lowercase name
    /// → addresses). Tests point names at local servers with it; empty in production.
    pub hosts: BTreeMap<String, Vec<IpAddr>>,
    /// Destinations that may be at any address, as written (`host` for every port, or
    /// `host:port`; a name or IP literal, IPv6 in brackets): the registries the operator
    /// names with `kiln serve --allow-registry`. Empty by default.
    pub exempt: BTreeSet<String>,
}

/// Why a host gave no address a build may reach.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// The resolver failed.
    #[error("could not resolve {host}: {detail}")]
    Resolve {
        /// The name.
        host: String,
        /// The resolver's message.
        detail: String,
    },
    /// The resolver answered with no address.
    #[error("could not resolve {host}: the name has no address")]
    NoAddress {
        /// The name.
        host: String,
    },
    /// The host is, or resolves to, an address that is not public.
    #[error("{host}: address {addr} is not public (loopback, private or link-local)")]
    NotPublic {
        /// The name or literal asked for.
        host: String,
        /// The first address refused.
        addr: IpAddr,
    },
}

impl AddressPolicy {
    /// Whether `ip` may be reached under this policy.
    pub fn permits(&self, ip: IpAddr) -> bool {
        self.allow_private_addresses || is_public(ip)
    }

    /// Whether `host` with `port` is one of [`AddressPolicy::exempt`].
    pub fn is_exempt(&self, host: &str, port: u16) -> bool {
        if self.exempt.is_empty() {
            return false;
        }
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let host = if bare.contains(':') {
            format!("[{bare}]")
        } else {
            bare.to_ascii_lowercase()
        };
        self.exempt.contains(&host) || self.exempt.contains(&format!("{host}:{port}"))
    }

    /// The addresses of `host` (a name, or an IP literal with or without brackets) with
    /// `port`, every one checked with [`AddressPolicy::permits`] unless the destination is
    /// [`AddressPolicy::exempt`]: connect only to these.
    /// Errors: [`AddressError`]; one address that is not permitted refuses the whole name
    /// (a name with a private address among public ones is not trusted with any).
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, AddressError> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = if let Ok(ip) = bare.parse::<IpAddr>() {
            vec![SocketAddr::new(ip, port)]
        } else if let Some(ips) = self.hosts.get(&bare.to_ascii_lowercase()) {
            ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect()
        } else {
            tokio::net::lookup_host((bare, port))
                .await
                .map_err(|e| AddressError::Resolve {
                    host: host.to_string(),
                    detail: e.to_string(),
                })?
                .collect()
        };
        if addrs.is_empty() {
            return Err(AddressError::NoAddress {
                host: host.to_string(),
            });
        }
        if self.is_exempt(host, port) {
            return Ok(addrs);
        }
        if let Some(a) = addrs.iter().find(|a| !self.permits(a.ip())) {
            return Err(AddressError::NotPublic {
                host: host.to_string(),
                addr: a.ip(),
            });
        }
        Ok(addrs)
    }
}

/// Whether builds may reach `ip` (a public unicast address).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || o[0] == 0
                // 100.64.0.0/10 (RFC 6598) and 198.18.0.0/15 (RFC 2544).
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                // 192.0.0.0/24, IETF protocol assignments (RFC 6890), incl. NAT64 discovery
                || (o[0] == 192 && o[1] == 0 && o[2] == 0)
                || o[0] >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            let o = v6.octets();
            let v4_at = |i: usize| IpAddr::from([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            // Forms that carry an IPv4 address something on the way turns back into IPv4:
            // the NAT64 well-known prefix 64:ff9b::/96 (RFC 6052, reaching 169.254.169.254 or
            // 10/8 through an IPv6-only network's NAT64 gateway), IPv4-compatible ::/96
            // (RFC 4291 2.5.5.1) and 6to4 2002::/16 (RFC 3056): as public as the IPv4 inside.
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..6] == [0; 6] {
                return !v6.is_loopback() && !v6.is_unspecified() && is_public(v4_at(12));
            }
            if s[0] == 0x2002 {
                return is_public(v4_at(2));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                // link-local fe80::/10 and the deprecated site-local fec0::/10
                || (s[0] & 0xff80) == 0xfe80
                // local-use NAT64 64:ff9b:1::/48 (RFC 8215)
                || s[..3] == [0x64, 0xff9b, 1]
                // discard-only 100::/64 (RFC 6666)
                || s[..4] == [0x100, 0, 0, 0]
                // documentation 2001:db8::/32 (RFC 3849), Teredo 2001::/32 (RFC 4380)
                || s[..2] == [0x2001, 0xdb8]
                || s[..2] == [0x2001, 0])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `host` exempts every port, `host:port` that port; IPv6 in brackets; names compare
    /// case-insensitively; what is not exempt is still checked.
    #[tokio::test]
    async fn exempt_destinations() {
        let p = AddressPolicy {
            exempt: ["127.0.0.1:5000", "reg.internal", "[::1]:5001"]
                .map(String::from)
                .into(),
            hosts: [(
                "reg.internal".to_string(),
                vec!["10.0.0.7".parse().unwrap()],
            )]
            .into(),
            ..Default::default()
        };
        assert!(p.is_exempt("127.0.0.1", 5000));
        assert!(!p.is_exempt("127.0.0.1", 5003));
        assert!(p.is_exempt("REG.internal", 443) && p.is_exempt("reg.internal", 9999));
        assert!(p.is_exempt("::1", 5001) && p.is_exempt("[::1]", 5001));
        assert!(!p.is_exempt("[::1]", 5000));
        assert!(p.resolve("127.0.0.1", 5000).await.is_ok());
        assert!(p.resolve("reg.internal", 443).await.is_ok());
        assert!(matches!(
            p.resolve("127.0.0.1", 5003).await,
            Err(AddressError::NotPublic { .. })
        ));
        assert!(matches!(
            p.resolve("169.254.169.254", 80).await,
            Err(AddressError::NotPublic { .. })
        ));
    }

    #[test]
    fn public_addresses() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!is_public(a.parse().unwrap()), "{a}");
        }
        for a in ["8.8.8.8", "151.101.1.1", "2a00:1450::1"] {
            assert!(is_public(a.parse().unwrap()), "{a}");
        }
    }

    /// IPv6 forms that carry an IPv4 address a gateway or the kernel turns back into IPv4
    /// (NAT64 `64:ff9b::/96` reaches 169.254.169.254 or 10/8 through the NAT64 gateway of an
    /// IPv6-only network; IPv4-compatible `::/96`, 6to4 `2002::/16`), and IPv6 ranges that
    /// are not global (site-local, discard, documentation, local-use NAT64, Teredo) are not
    /// public either.
    #[test]
    fn translated_and_special_ipv6_addresses_are_not_public() {
        for a in [
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::7f00:1",
            "64:ff9b::a00:1",
            "64:ff9b:1::a00:1",
            "::7f00:1",
            "::a9fe:a9fe",
            "2002:7f00:1::1",
            "2002:a9fe:a9fe::",
            "2002:c0a8:101::1",
            "fec0::1",
            "100::1",
            "2001:db8::1",
            "2001::1",
            "192.0.0.170",
        ] {
            assert!(!is_public(a.parse().unwrap()), "{a}");
        }
        // What they wrap when it is public is still reachable.
        for a in ["64:ff9b::808:808", "2002:808:808::1"] {
            assert!(is_public(a.parse().unwrap()), "{a}");
        }
    }

    /// The cloud metadata service's addresses (169.254.169.254; AWS's IPv6 one,
    /// fd00:ec2::254, in the unique-local fc00::/7) are never public.
    #[test]
    fn metadata_addresses_are_not_public() {
        for a in ["169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254"] {
            assert!(!is_public(a.parse().unwrap()), "{a}");
        }
    }

    /// A name whose answer includes one private address is refused, even with public ones
    /// beside it; the test-only switch lets it through; a literal is checked as it is.
    #[test]
    fn resolve_checks_every_address() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut p = AddressPolicy::default();
        p.hosts.insert(
            "mixed.test".into(),
            vec!["8.8.8.8".parse().unwrap(), "10.0.0.1".parse().unwrap()],
        );
        p.hosts
            .insert("public.test".into(), vec!["8.8.4.4".parse().unwrap()]);
        let e = rt.block_on(p.resolve("MIXED.test", 80)).unwrap_err();
        assert!(
            matches!(e, AddressError::NotPublic { addr, .. } if addr.to_string() == "10.0.0.1"),
            "{e}"
        );
        let ok = rt.block_on(p.resolve("public.test", 443)).unwrap();
        assert_eq!(ok, vec!["8.8.4.4:443".parse().unwrap()]);
        assert!(rt.block_on(p.resolve("[::1]", 80)).is_err());
        p.allow_private_addresses = true;
        assert_eq!(rt.block_on(p.resolve("mixed.test", 80)).unwrap().len(), 2);
        assert_eq!(
            rt.block_on(p.resolve("[::1]", 80)).unwrap(),
            vec!["[::1]:80".parse().unwrap()]
        );
    }
}
