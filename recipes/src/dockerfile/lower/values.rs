//! Parsers and checks of the values instructions take: platforms, signals, durations,
//! modes, sizes, paths, `--mount` fields, ports, URLs and `ONBUILD` triggers.

use super::*;

/// `os/arch[/variant]`, validated.
pub(crate) fn parse_platform(p: &str) -> Option<(String, String, String)> {
    let parts: Vec<&str> = p.split('/').collect();
    let ok = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.-".contains(c))
    };
    match parts.as_slice() {
        [os, arch] if ok(os) && ok(arch) => Some((os.to_string(), arch.to_string(), String::new())),
        [os, arch, variant] if ok(os) && ok(arch) && ok(variant) => {
            Some((os.to_string(), arch.to_string(), variant.to_string()))
        }
        _ => None,
    }
}

/// Whether `s` names a Linux signal (`TERM`, `SIGTERM`, `sigkill`, `SIGRTMIN+3`), as
/// Docker's signal parsing accepts it.
pub(super) fn is_signal_name(s: &str) -> bool {
    const NAMES: [&str; 34] = [
        "ABRT", "ALRM", "BUS", "CHLD", "CLD", "CONT", "FPE", "HUP", "ILL", "INT", "IO", "IOT",
        "KILL", "PIPE", "POLL", "PROF", "PWR", "QUIT", "SEGV", "STKFLT", "STOP", "SYS", "TERM",
        "TRAP", "TSTP", "TTIN", "TTOU", "UNUSED", "URG", "USR1", "USR2", "VTALRM", "WINCH", "XCPU",
    ];
    let upper = s.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    if NAMES.contains(&name) || name == "XFSZ" || name == "RTMIN" || name == "RTMAX" {
        return true;
    }
    for (base, sep) in [("RTMIN", '+'), ("RTMAX", '-')] {
        if let Some(n) = name.strip_prefix(base).and_then(|r| r.strip_prefix(sep)) {
            return n.parse::<u32>().is_ok_and(|n| (1..=30).contains(&n));
        }
    }
    false
}

/// Parses a Go duration (`1h2m3s`, `500ms`, `1.5s`) into milliseconds, rounded.
pub(crate) fn parse_duration_ms(s: &str) -> Option<u64> {
    // Bounded to 1e15 ms by `parse_duration_exact_ms`, so the cast cannot saturate.
    parse_duration_exact_ms(s).map(|ms| ms.round() as u64)
}

/// Parses a Go duration into milliseconds, unrounded (so `500us` is 0.5). `None`: not a
/// duration, or above 1e15 ms.
pub(super) fn parse_duration_exact_ms(s: &str) -> Option<f64> {
    if s == "0" {
        return Some(0.0);
    }
    let mut total: f64 = 0.0;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_len] {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * factor;
    }
    if !total.is_finite() || total > 1e15 {
        return None;
    }
    Some(total)
}

pub(super) fn is_octal_mode(s: &str) -> bool {
    (1..=4).contains(&s.len()) && s.chars().all(|c| ('0'..='7').contains(&c))
}

/// `--chmod`: octal, or symbolic clauses like `u+x,g-w,o=r` (BuildKit 1.14+).
pub(crate) fn valid_chmod(s: &str) -> bool {
    if is_octal_mode(s) {
        return true;
    }
    !s.is_empty()
        && s.split(',').all(|clause| {
            let who_len = clause
                .find(|c: char| !"ugoa".contains(c))
                .unwrap_or(clause.len());
            let rest = &clause[who_len..];
            let mut chars = rest.chars();
            matches!(chars.next(), Some('+' | '-' | '=')) && chars.all(|c| "rwxXst+-=".contains(c))
        })
}

pub(crate) fn parse_size(s: &str) -> Option<u64> {
    let lower = s.to_ascii_lowercase();
    let trimmed = lower.trim_end_matches('b').trim_end_matches('i');
    let (num, mult) = match trimmed.char_indices().last()? {
        (i, 'k') => (&trimmed[..i], 1u64 << 10),
        (i, 'm') => (&trimmed[..i], 1 << 20),
        (i, 'g') => (&trimmed[..i], 1 << 30),
        (i, 't') => (&trimmed[..i], 1 << 40),
        _ => (trimmed, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

/// Joins `p` to `workdir` unless absolute, as BuildKit's `pathRelativeToWorkingDir`.
pub(super) fn resolve_path(workdir: &str, p: &str) -> String {
    if p.starts_with('/') {
        return p.to_string();
    }
    clean_path(&format!("{workdir}/{p}"))
}

/// Lexical cleaning like Go's `path.Clean` for absolute paths.
pub(super) fn clean_path(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Splits a `--mount` value into key=value fields (CSV with optional quotes).
pub(super) fn csv_fields(s: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quote = false;
    for c in s.chars() {
        match c {
            '"' => quote = !quote,
            ',' if !quote => fields.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    fields.push(cur);
    fields.into_iter().filter(|f| !f.is_empty()).collect()
}

pub(super) fn words_fault(offset: usize, e: ShellWordsError) -> Fault {
    Fault::new(offset, e)
}

/// `80`, `80/udp`, `8000-8002/tcp` into `port/proto` strings.
pub(super) fn expand_ports(p: &str) -> Result<Vec<String>, String> {
    let (ports, proto) = match p.split_once('/') {
        Some((ports, proto)) => (ports, proto.to_ascii_lowercase()),
        None => (p, "tcp".to_string()),
    };
    if !["tcp", "udp", "sctp"].contains(&proto.as_str()) {
        return Err(format!("invalid protocol in EXPOSE '{p}'"));
    }
    let parse = |s: &str| {
        s.parse::<u16>()
            .map_err(|_| format!("invalid port in EXPOSE '{p}'"))
    };
    let (lo, hi) = match ports.split_once('-') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => {
            let n = parse(ports)?;
            (n, n)
        }
    };
    if hi < lo {
        return Err(format!("invalid port range in EXPOSE '{p}'"));
    }
    if u32::from(hi - lo) >= MAX_EXPOSED_RANGE {
        // Docker expands any range; kiln bounds the plan a hostile recipe can produce.
        return Err(format!(
            "EXPOSE '{p}' names {} ports; kiln accepts ranges of at most {MAX_EXPOSED_RANGE}",
            u32::from(hi - lo) + 1
        ));
    }
    Ok((lo..=hi).map(|n| format!("{n}/{proto}")).collect())
}

/// Whether an `http://` or `https://` URL names a host (`https://` alone, or
/// `https:///path`, cannot be fetched).
pub(super) fn url_has_host(url: &str) -> bool {
    let rest = url.split_once("://").map_or("", |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = authority.rsplit('@').next().unwrap_or_default();
    !host.is_empty() && !host.starts_with(':')
}

/// Parses an ONBUILD trigger's text into an instruction.
pub(super) fn parse_trigger(trigger: &str, escape: char) -> Result<Instr, String> {
    let prefix = if escape == '`' {
        "# escape=`\nFROM scratch\n"
    } else {
        "FROM scratch\n"
    };
    let text = format!("{prefix}{trigger}\n");
    let (masked, docs) = syntax::mask_run_heredocs(&text).map_err(|f| f.kind.to_string())?;
    let parsed = syntax::parse(&text, &masked, docs).map_err(|f| f.kind.to_string())?;
    let instrs =
        super::super::instructions::convert_all(&parsed, &text).map_err(|f| f.kind.to_string())?;
    if instrs.len() > 2 {
        return Err("a trigger is exactly one instruction".to_string());
    }
    let instr = instrs
        .into_iter()
        .nth(1)
        .ok_or_else(|| "empty trigger".to_string())?;
    // Docker refuses these as triggers; a base image's config may still hold them.
    let refused = match &instr.kind {
        InstrKind::From { .. } => Some("FROM"),
        InstrKind::Maintainer(_) => Some("MAINTAINER"),
        InstrKind::Onbuild { .. } => Some("ONBUILD"),
        _ => None,
    };
    match refused {
        Some(k) => Err(format!("{k} is not allowed as an ONBUILD trigger")),
        None => Ok(instr),
    }
}
