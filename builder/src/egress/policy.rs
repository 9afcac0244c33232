//! Matching a destination against an allow-list network's rules
//! ([`kiln_recipes::plan::Egress`]).
//!
//! A destination is the host a client asked for: a name (`pkg.example`) or an IP literal.
//! Names are matched by `Domain` and `Subdomains` rules, literals by `Address` and `Cidr`
//! rules; a name is never allowed by an address rule (the check is on what was asked for,
//! before any lookup). Deny always wins: a `deny` rule matching the name or literal refuses
//! it, and so does a `deny` address or range holding any address the name resolves to
//! ([`refused_address`]).

use std::net::IpAddr;

use kiln_recipes::plan::{Egress, EgressRule, ip_bits, prefix_mask};

/// What the rules say of a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed by this rule (its written form).
    Allowed(String),
    /// Refused; the reason names the rule (`deny *.cdn.example`) or says none matched.
    Refused(String),
}

/// Whether `rule` matches the destination `host` (a name, or an IP literal, IPv6 with or
/// without brackets). Names compare ASCII case-insensitively, a trailing dot ignored.
pub fn matches(rule: &EgressRule, host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<IpAddr>() {
        Ok(ip) => matches_addr(rule, ip),
        Err(_) => {
            let name = bare.strip_suffix('.').unwrap_or(bare).to_ascii_lowercase();
            match rule {
                EgressRule::Domain(d) => name == *d,
                EgressRule::Subdomains(d) => name
                    .strip_suffix(d.as_str())
                    .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
                EgressRule::Address(_) | EgressRule::Cidr { .. } => false,
            }
        }
    }
}

/// Whether an `Address` or `Cidr` rule holds `ip`. IPv4-mapped IPv6 addresses
/// (`::ffff:a.b.c.d`, RFC 4291 section 2.5.5.2) are compared as the IPv4 address inside.
pub fn matches_addr(rule: &EgressRule, ip: IpAddr) -> bool {
    let canon = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let ip = canon(ip);
    match rule {
        EgressRule::Address(a) => canon(*a) == ip,
        EgressRule::Cidr { addr, prefix } => {
            let width = if addr.is_ipv4() { 32 } else { 128 };
            addr.is_ipv4() == ip.is_ipv4() && {
                let mask = prefix_mask(*prefix, width);
                ip_bits(ip) & mask == ip_bits(*addr) & mask
            }
        }
        EgressRule::Domain(_) | EgressRule::Subdomains(_) => false,
    }
}

/// The verdict of `rules` on the destination `host`, before any lookup.
pub fn check(rules: &Egress, host: &str) -> Verdict {
    if let Some(d) = rules.deny.iter().find(|r| matches(r, host)) {
        return Verdict::Refused(format!("deny {d}"));
    }
    match rules.allow.iter().find(|r| matches(r, host)) {
        Some(a) => Verdict::Allowed(format!("allow {a}")),
        None => Verdict::Refused("not on the allow list".into()),
    }
}

/// The first `deny` address or range holding one of `addrs` (what an allowed name resolved
/// to), as the reason to refuse it (`deny 192.0.2.0/24`).
pub fn refused_address(rules: &Egress, addrs: &[IpAddr]) -> Option<String> {
    rules
        .deny
        .iter()
        .find(|r| addrs.iter().any(|ip| matches_addr(r, *ip)))
        .map(|d| format!("deny {d} (resolved address)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(allow: &[&str], deny: &[&str]) -> Egress {
        let p = |v: &[&str]| v.iter().map(|r| EgressRule::parse(r).unwrap()).collect();
        Egress {
            allow: p(allow),
            deny: p(deny),
        }
    }

    fn allowed(e: &Egress, host: &str) -> bool {
        matches!(check(e, host), Verdict::Allowed(_))
    }

    #[test]
    fn subdomain_rules_match_names_under_the_domain_only() {
        let e = rules(&["*.pkg.example"], &[]);
        assert!(allowed(&e, "a.pkg.example"));
        assert!(allowed(&e, "A.B.Pkg.Example."));
        assert!(!allowed(&e, "pkg.example"));
        assert!(!allowed(&e, "evilpkg.example"));
        assert!(!allowed(&e, "a.pkg.example.evil"));
        assert!(!allowed(&e, ".pkg.example"));
        let e = rules(&["pkg.example"], &[]);
        assert!(allowed(&e, "PKG.example"));
        assert!(!allowed(&e, "a.pkg.example"));
    }

    #[test]
    fn cidr_and_address_rules_match_literals_only() {
        let e = rules(&["192.0.2.0/24", "2001:db8::/32", "198.51.100.7"], &[]);
        assert!(allowed(&e, "192.0.2.200"));
        assert!(!allowed(&e, "192.0.3.1"));
        assert!(allowed(&e, "[2001:db8:1::5]"));
        assert!(allowed(&e, "2001:db8:ffff::"));
        assert!(!allowed(&e, "2001:db9::1"));
        assert!(allowed(&e, "198.51.100.7"));
        assert!(allowed(&e, "::ffff:198.51.100.7"));
        assert!(allowed(&e, "::ffff:192.0.2.9"));
        assert!(!allowed(&e, "198.51.100.8"));
        // A name is not allowed by an address rule, whatever it resolves to.
        assert!(!allowed(&e, "host.example"));
        let all = rules(&["0.0.0.0/0"], &[]);
        assert!(allowed(&all, "203.0.113.1"));
        assert!(!allowed(&all, "2001:db8::1"));
    }

    #[test]
    fn deny_wins_over_allow() {
        let e = rules(
            &["*.cdn.example", "cdn.example", "10.0.0.0/8"],
            &["bad.cdn.example", "10.1.0.0/16"],
        );
        assert!(allowed(&e, "good.cdn.example"));
        assert_eq!(
            check(&e, "BAD.cdn.example"),
            Verdict::Refused("deny bad.cdn.example".into())
        );
        assert!(allowed(&e, "10.2.0.1"));
        assert_eq!(
            check(&e, "10.1.2.3"),
            Verdict::Refused("deny 10.1.0.0/16".into())
        );
        assert_eq!(
            check(&e, "other.example"),
            Verdict::Refused("not on the allow list".into())
        );
        let ips = ["10.1.9.9".parse().unwrap()];
        assert_eq!(
            refused_address(&e, &ips).as_deref(),
            Some("deny 10.1.0.0/16 (resolved address)")
        );
        assert_eq!(refused_address(&e, &["10.2.0.1".parse().unwrap()]), None);
        // An empty allow list allows nothing.
        assert!(!allowed(&rules(&[], &[]), "a.example"));
    }
}
