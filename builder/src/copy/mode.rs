//! `--chmod` values and source globs.
//!
//! `--chmod` takes an octal mode (`755`, `0644`) or a symbolic one as chmod(1) writes it
//! (`u+x,g-w`, `go=rX`, `+x`): clauses `[ugoa]*[+-=][rwxXst]*` separated by commas. As
//! chmod(1), `X` sets execute only on directories or when some execute bit is already set, and
//! a clause without `ugoa` applies to all. BuildKit (Dockerfile reference, "COPY --chmod")
//! accepts both forms and applies the mode to every copied file and directory.
//!
//! Globs in sources follow Go's `filepath.Match`, component by component (Dockerfile
//! reference, "COPY": "matching is done using Go's filepath.Match rules"): `*` any run of
//! characters, `?` one character, `[...]` a class (`^` negates, `a-z` ranges), `\` escapes.

/// A parsed `--chmod`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chmod {
    /// An absolute mode (permission bits and setuid/setgid/sticky).
    Octal(u32),
    /// Symbolic clauses, applied in order.
    Symbolic(Vec<Clause>),
}

/// One symbolic clause: who, operator, permissions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clause {
    /// Bit mask of the classes (`u` 0o4700, `g` 0o2070, `o` 0o1007 with their special bits).
    who: u32,
    op: u8,
    perms: Vec<u8>,
}

impl Chmod {
    /// Parses a `--chmod` value. Errors: a message saying what is wrong.
    pub fn parse(s: &str) -> Result<Chmod, String> {
        if s.is_empty() {
            return Err("empty mode".into());
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            let m = u32::from_str_radix(s, 8).map_err(|_| format!("{s:?} is not octal"))?;
            if m > 0o7777 {
                return Err(format!("{s:?} is larger than 7777"));
            }
            return Ok(Chmod::Octal(m));
        }
        let mut clauses = Vec::new();
        for part in s.split(',') {
            let b = part.as_bytes();
            let mut i = 0;
            let mut who = 0;
            while i < b.len() && b"ugoa".contains(&b[i]) {
                who |= match b[i] {
                    b'u' => 0o4700,
                    b'g' => 0o2070,
                    b'o' => 0o1007,
                    _ => 0o7777,
                };
                i += 1;
            }
            if who == 0 {
                who = 0o7777;
            }
            if i >= b.len() || !b"+-=".contains(&b[i]) {
                return Err(format!("clause {part:?} has no +, - or ="));
            }
            let op = b[i];
            i += 1;
            let perms = b[i..].to_vec();
            if let Some(bad) = perms.iter().find(|p| !b"rwxXst".contains(p)) {
                return Err(format!(
                    "clause {part:?}: unknown permission {:?}",
                    *bad as char
                ));
            }
            clauses.push(Clause { who, op, perms });
        }
        Ok(Chmod::Symbolic(clauses))
    }

    /// The mode a file whose current mode is `mode` (permission bits) gets; `is_dir` for `X`.
    pub fn apply(&self, mode: u32, is_dir: bool) -> u32 {
        match self {
            Chmod::Octal(m) => *m,
            Chmod::Symbolic(clauses) => {
                let mut mode = mode & 0o7777;
                for c in clauses {
                    let mut bits = 0;
                    for p in &c.perms {
                        bits |= match p {
                            b'r' => 0o444,
                            b'w' => 0o222,
                            b'x' => 0o111,
                            b'X' if is_dir || mode & 0o111 != 0 => 0o111,
                            b's' => 0o6000,
                            b't' => 0o1000,
                            _ => 0,
                        };
                    }
                    let bits = bits & c.who;
                    match c.op {
                        b'+' => mode |= bits,
                        b'-' => mode &= !bits,
                        _ => mode = (mode & !c.who) | bits,
                    }
                }
                mode
            }
        }
    }
}

/// Whether `s` has glob characters (`*`, `?`, `[`).
pub fn has_glob(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

/// Go `filepath.Match` of one path component. Errors: a malformed pattern.
pub fn glob_match(pattern: &str, name: &str) -> Result<bool, String> {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Validate once, so a malformed pattern is an error even when matching stops early.
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '\\' => {
                if i + 1 >= p.len() {
                    return Err(format!("pattern {pattern:?} ends in \\"));
                }
                i += 2;
            }
            '[' => i = class_end(&p, i).ok_or(format!("pattern {pattern:?}: bad [...]"))?,
            _ => i += 1,
        }
    }
    Ok(match_from(&p, &n))
}

/// Index just past the class starting at `p[start] == '['`; `None` when malformed.
fn class_end(p: &[char], start: usize) -> Option<usize> {
    let mut i = start + 1;
    if p.get(i) == Some(&'^') {
        i += 1;
    }
    let mut first = true;
    loop {
        let c = *p.get(i)?;
        if c == ']' && !first {
            return Some(i + 1);
        }
        first = false;
        let lo = if c == '\\' {
            i += 1;
            *p.get(i)?
        } else {
            c
        };
        i += 1;
        if p.get(i) == Some(&'-') && p.get(i + 1).is_some_and(|c| *c != ']') {
            i += 1;
            let hi = if p[i] == '\\' {
                i += 1;
                *p.get(i)?
            } else {
                p[i]
            };
            if hi < lo {
                return None;
            }
            i += 1;
        }
    }
}

fn class_matches(p: &[char], start: usize, c: char) -> bool {
    let mut i = start + 1;
    let negated = p.get(i) == Some(&'^');
    if negated {
        i += 1;
    }
    let mut hit = false;
    let mut first = true;
    while i < p.len() {
        if p[i] == ']' && !first {
            break;
        }
        first = false;
        let lo = if p[i] == '\\' {
            i += 1;
            p[i]
        } else {
            p[i]
        };
        i += 1;
        let mut hi = lo;
        if p.get(i) == Some(&'-') && p.get(i + 1).is_some_and(|c| *c != ']') {
            i += 1;
            hi = if p[i] == '\\' {
                i += 1;
                p[i]
            } else {
                p[i]
            };
            i += 1;
        }
        if lo <= c && c <= hi {
            hit = true;
        }
    }
    hit != negated
}

fn match_from(p: &[char], n: &[char]) -> bool {
    if p.is_empty() {
        return n.is_empty();
    }
    match p[0] {
        '*' => (0..=n.len()).any(|k| match_from(&p[1..], &n[k..])),
        '?' => !n.is_empty() && match_from(&p[1..], &n[1..]),
        '[' => {
            // Validated by the caller.
            let end = class_end(p, 0).unwrap_or(p.len());
            !n.is_empty() && class_matches(p, 0, n[0]) && match_from(&p[end..], &n[1..])
        }
        '\\' => n.first() == p.get(1) && match_from(&p[2..], &n[1..]),
        c => n.first() == Some(&c) && match_from(&p[1..], &n[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn octal_and_symbolic() {
        assert_eq!(Chmod::parse("755").unwrap().apply(0o600, false), 0o755);
        assert_eq!(Chmod::parse("0644").unwrap().apply(0o777, true), 0o644);
        assert!(Chmod::parse("8").is_err());
        assert!(Chmod::parse("17777").is_err());
        assert_eq!(Chmod::parse("u+x").unwrap().apply(0o644, false), 0o744);
        assert_eq!(
            Chmod::parse("go-w,u=rw").unwrap().apply(0o777, false),
            0o655
        );
        assert_eq!(Chmod::parse("+x").unwrap().apply(0o644, false), 0o755);
        assert_eq!(Chmod::parse("a=rX").unwrap().apply(0o600, true), 0o555);
        assert_eq!(Chmod::parse("a=rX").unwrap().apply(0o600, false), 0o444);
        assert_eq!(Chmod::parse("u+s").unwrap().apply(0o755, false), 0o4755);
        for bad in ["", "u", "u+q", "z+x", "u+x,"] {
            assert!(Chmod::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn globs() {
        assert!(glob_match("*.txt", "a.txt").unwrap());
        assert!(!glob_match("*.txt", "a.txt.bak").unwrap());
        assert!(glob_match("a?c", "abc").unwrap());
        assert!(glob_match("[a-c]x", "bx").unwrap());
        assert!(!glob_match("[^a-c]x", "bx").unwrap());
        assert!(glob_match("\\*", "*").unwrap());
        assert!(!glob_match("\\*", "a").unwrap());
        assert!(glob_match("[", "[").is_err());
        assert!(glob_match("a\\", "a").is_err());
        assert!(glob_match("[z-a]", "b").is_err());
        assert!(has_glob("a*") && !has_glob("abc"));
    }
}
