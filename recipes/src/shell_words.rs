//! BuildKit's word handling for the instructions it substitutes in (`frontend/dockerfile/shell`
//! and `parser/line_parsers.go` of moby/buildkit): splitting an argument string into raw words
//! ([`split_words`]), and expanding one word ([`expand_word`]): quote removal, the escape
//! character, and `$VAR`, `${VAR}`, `${VAR:-word}`, `${VAR-word}`, `${VAR:+word}`,
//! `${VAR+word}`, `${VAR:?msg}`, `${VAR?msg}`, and the glob operators `${VAR#p}`, `${VAR##p}`,
//! `${VAR%p}`, `${VAR%%p}`, `${VAR/p/r}`, `${VAR//p/r}`. An unset variable expands to the empty
//! string. Nesting and pattern work are bounded ([`MAX_NESTING`], [`PATTERN_BUDGET`]).
//!
//! `RUN`, `CMD` and `ENTRYPOINT` are not substituted here: the shell does that at run time.

/// A substitution failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShellWordsError {
    /// `${` without a closing `}`.
    #[error("syntax error: missing '}}' in variable substitution")]
    MissingBrace,
    /// `${}`, `${:x}`, `${{x}` and the like.
    #[error("syntax error: bad substitution")]
    BadSubstitution,
    /// An expansion larger than [`MAX_WORD_BYTES`].
    #[error("variable substitution produces more than {MAX_WORD_BYTES} bytes")]
    TooLong,
    /// A `${V#p}`-style operator that would take too long.
    #[error("pattern substitution too expensive (value or pattern too long)")]
    TooExpensive,
    /// `${A:-${B:-...}}` nested deeper than [`MAX_NESTING`].
    #[error("variable substitution nested more than {MAX_NESTING} levels deep")]
    TooDeep,
    /// A modifier kiln does not support (`${x%y}`, `${x/y/z}`, ...).
    #[error("unsupported modifier ({0}) in substitution")]
    UnsupportedModifier(String),
    /// A `'` without its closing quote.
    #[error("unexpected end of statement while looking for matching single-quote")]
    UnclosedSingleQuote,
    /// A `"` without its closing quote.
    #[error("unexpected end of statement while looking for matching double-quote")]
    UnclosedDoubleQuote,
    /// `${VAR?message}` or `${VAR:?message}` with `VAR` unset (or empty for `:?`).
    #[error("{name}: {message}")]
    Required {
        /// The variable.
        name: String,
        /// The message written after `?`, or BuildKit's default.
        message: String,
    },
}

/// Splits an argument string into raw words at unquoted whitespace, keeping quotes and
/// escapes in the words (BuildKit's `parseWords`): `a "b c" d\ e` gives `a`, `"b c"`,
/// `d\ e`. An escape character at the very end is dropped.
pub fn split_words(s: &str, escape: char) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut blank_ok = false;
    let mut chars = s.chars().peekable();
    while let Some(ch) = chars.next() {
        if let Some(q) = quote {
            if ch == q {
                quote = None;
            }
            if ch == escape && q != '\'' {
                match chars.next() {
                    None => {
                        quote = None;
                        continue;
                    }
                    Some(next) => {
                        word.push(ch);
                        word.push(next);
                        continue;
                    }
                }
            }
            word.push(ch);
            continue;
        }
        if !in_word {
            if ch.is_whitespace() {
                continue;
            }
            in_word = true;
        }
        if ch.is_whitespace() {
            if blank_ok || !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            in_word = false;
            blank_ok = false;
            continue;
        }
        if ch == '\'' || ch == '"' {
            quote = Some(ch);
            blank_ok = true;
        }
        if ch == escape {
            match chars.next() {
                None => continue,
                Some(next) => {
                    word.push(ch);
                    word.push(next);
                    continue;
                }
            }
        }
        word.push(ch);
    }
    if in_word && (blank_ok || !word.is_empty()) {
        words.push(word);
    }
    words
}

/// Looks a variable up; `None` means unset.
pub type Lookup<'a> = dyn FnMut(&str) -> Option<String> + 'a;

struct Scanner<'s, 'l> {
    chars: Vec<char>,
    pos: usize,
    escape: char,
    lookup: &'s mut Lookup<'l>,
    /// Quotes are kept and only `$` and escaped `$` are processed (heredoc bodies).
    raw: bool,
    /// Names referenced as `$NAME` or `${NAME}` that were unset.
    unset: Vec<String>,
    /// The same names as a set (a word may reference thousands).
    unset_seen: std::collections::HashSet<String>,
    /// Nesting of `${...}` words being processed.
    depth: usize,
    /// Glob steps left for pattern operators in this word ([`PATTERN_BUDGET`]).
    budget: u64,
}

/// Largest expansion of one word, bytes (1 MiB): `ENV B=$A$A` repeated doubles a value
/// each line, so without a cap a few lines of recipe expand to gigabytes.
pub const MAX_WORD_BYTES: usize = 1 << 20;

/// Glob matching steps one word may spend on `${V#p}`-style operators; hostile patterns
/// over long values are refused rather than left to run for minutes.
pub const PATTERN_BUDGET: u64 = 5_000_000;

/// Deepest `${A:-${B:-...}}` nesting accepted; hostile input could otherwise exhaust the
/// stack.
pub const MAX_NESTING: usize = 64;

impl Scanner<'_, '_> {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<char> {
        let ch = self.peek();
        if ch.is_some() {
            self.pos += 1;
        }
        ch
    }

    /// Processes until one of `stops` (consumed, and returned) or the end (`None`).
    fn process(&mut self, stops: &[char]) -> Result<(String, Option<char>), ShellWordsError> {
        let mut out = String::new();
        while let Some(ch) = self.peek() {
            if stops.contains(&ch) {
                self.pos += 1;
                return Ok((out, Some(ch)));
            }
            match ch {
                '\'' if !self.raw => out.push_str(&self.single_quote()?),
                '"' if !self.raw => out.push_str(&self.double_quote()?),
                '$' => {
                    out.push_str(&self.dollar()?);
                    if out.len() > MAX_WORD_BYTES {
                        return Err(ShellWordsError::TooLong);
                    }
                }
                _ => {
                    self.pos += 1;
                    if ch == self.escape {
                        match self.next() {
                            None => break,
                            Some(next) => {
                                // In a heredoc body, as in a shell heredoc, only `\$` and the
                                // escape character itself are escapes.
                                if self.raw && next != '$' && next != self.escape {
                                    out.push(ch);
                                }
                                out.push(next);
                            }
                        }
                    } else {
                        out.push(ch);
                    }
                }
            }
        }
        Ok((out, None))
    }

    fn single_quote(&mut self) -> Result<String, ShellWordsError> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            match self.next() {
                None => return Err(ShellWordsError::UnclosedSingleQuote),
                Some('\'') => return Ok(out),
                Some(ch) => out.push(ch),
            }
        }
    }

    fn double_quote(&mut self) -> Result<String, ShellWordsError> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            match self.peek() {
                None => return Err(ShellWordsError::UnclosedDoubleQuote),
                Some('"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some('$') => {
                    out.push_str(&self.dollar()?);
                    if out.len() > MAX_WORD_BYTES {
                        return Err(ShellWordsError::TooLong);
                    }
                }
                Some(ch) => {
                    self.pos += 1;
                    if ch == self.escape {
                        match self.peek() {
                            None => continue,
                            Some(n) if n == '"' || n == '$' || n == self.escape => {
                                self.pos += 1;
                                out.push(n);
                                continue;
                            }
                            Some(_) => {}
                        }
                    }
                    out.push(ch);
                }
            }
        }
    }

    fn name(&mut self) -> String {
        let mut name = String::new();
        while let Some(ch) = self.peek() {
            if name.is_empty() && ch.is_ascii_digit() {
                while let Some(d) = self.peek().filter(char::is_ascii_digit) {
                    self.pos += 1;
                    name.push(d);
                }
                return name;
            }
            if name.is_empty() && matches!(ch, '@' | '*' | '#' | '?' | '-' | '$' | '!' | '0') {
                self.pos += 1;
                return ch.to_string();
            }
            if !ch.is_alphanumeric() && ch != '_' {
                break;
            }
            self.pos += 1;
            name.push(ch);
        }
        name
    }

    /// Processes a nested word up to one of `stops`, counting nesting depth.
    fn nested(&mut self, stops: &[char]) -> Result<(String, Option<char>), ShellWordsError> {
        if self.depth >= MAX_NESTING {
            return Err(ShellWordsError::TooDeep);
        }
        let raw = self.raw;
        self.raw = false;
        self.depth += 1;
        let result = self.process(stops);
        self.depth -= 1;
        self.raw = raw;
        result
    }

    /// `${V#p}`, `${V##p}`, `${V%p}`, `${V%%p}` (remove the shortest/longest prefix/suffix
    /// matching the glob `p`) and `${V/p/r}`, `${V//p/r}` (replace the first/every longest
    /// match), as BuildKit's shell lexer does. Patterns know `*` and `?`.
    fn pattern_op(&mut self, name: String, op: char) -> Result<String, ShellWordsError> {
        let doubled = self.peek() == Some(op);
        if doubled {
            self.pos += 1;
        }
        let (pattern, replacement) = if op == '/' {
            let (pattern, end) = self.nested(&['/', '}'])?;
            match end {
                None => return Err(ShellWordsError::MissingBrace),
                Some('}') => (pattern, String::new()),
                Some(_) => {
                    let (replacement, end) = self.nested(&['}'])?;
                    if end.is_none() {
                        return Err(ShellWordsError::MissingBrace);
                    }
                    (pattern, replacement)
                }
            }
        } else {
            let (pattern, end) = self.nested(&['}'])?;
            if end.is_none() {
                return Err(ShellWordsError::MissingBrace);
            }
            (pattern, String::new())
        };
        let value: Vec<char> = self.plain(name).chars().collect();
        let pattern: Vec<char> = pattern.chars().collect();
        let n = value.len();
        let text = |range: std::ops::Range<usize>| value[range].iter().collect::<String>();
        let mut budget = self.budget;
        let mut glob = |p: &[char], t: &[char]| {
            // Every attempt costs at least one step, so empty texts count too. Once the
            // budget is spent every attempt "matches", which ends the searches at once;
            // the result is then discarded for an error.
            budget = budget.saturating_sub(1);
            glob_counted(p, t, &mut budget) || budget == 0
        };
        let result = match (op, doubled) {
            ('#', false) => match (0..=n).find(|&i| glob(&pattern, &value[..i])) {
                Some(i) => text(i..n),
                None => text(0..n),
            },
            ('#', true) => match (0..=n).rev().find(|&i| glob(&pattern, &value[..i])) {
                Some(i) => text(i..n),
                None => text(0..n),
            },
            ('%', false) => match (0..=n).rev().find(|&i| glob(&pattern, &value[i..])) {
                Some(i) => text(0..i),
                None => text(0..n),
            },
            ('%', true) => match (0..=n).find(|&i| glob(&pattern, &value[i..])) {
                Some(i) => text(0..i),
                None => text(0..n),
            },
            _ => {
                let mut out = String::new();
                let mut i = 0;
                let mut replaced = false;
                while i < n {
                    let found = if (replaced && !doubled) || pattern.is_empty() {
                        None
                    } else {
                        (i + 1..=n).rev().find(|&j| glob(&pattern, &value[i..j]))
                    };
                    match found {
                        Some(j) => {
                            out.push_str(&replacement);
                            replaced = true;
                            i = j;
                        }
                        None => {
                            out.push(value[i]);
                            i += 1;
                        }
                    }
                }
                out
            }
        };
        self.budget = budget;
        if budget == 0 {
            return Err(ShellWordsError::TooExpensive);
        }
        Ok(result)
    }

    fn plain(&mut self, name: String) -> String {
        match (self.lookup)(&name) {
            Some(v) => v,
            None => {
                if self.unset_seen.insert(name.clone()) {
                    self.unset.push(name);
                }
                String::new()
            }
        }
    }

    fn dollar(&mut self) -> Result<String, ShellWordsError> {
        self.pos += 1;
        if self.peek() != Some('{') {
            let name = self.name();
            if name.is_empty() {
                return Ok("$".to_string());
            }
            return Ok(self.plain(name));
        }
        self.pos += 1;
        match self.peek() {
            None => return Err(ShellWordsError::MissingBrace),
            Some('{' | '}' | ':') => return Err(ShellWordsError::BadSubstitution),
            Some(_) => {}
        }
        let name = self.name();
        let Some(ch) = self.next() else {
            return Err(ShellWordsError::MissingBrace);
        };
        let mut modifier = ch.to_string();
        let mut null_is_unset = false;
        let mut op = ch;
        match ch {
            '}' => return Ok(self.plain(name)),
            ':' => {
                null_is_unset = true;
                let Some(next) = self.next() else {
                    return Err(ShellWordsError::MissingBrace);
                };
                modifier.push(next);
                op = next;
            }
            _ => {}
        }
        if !null_is_unset && matches!(op, '#' | '%' | '/') {
            return self.pattern_op(name, op);
        }
        if !matches!(op, '-' | '+' | '?') {
            return Err(ShellWordsError::UnsupportedModifier(modifier));
        }
        // The word is itself expanded (nested quotes and variables), up to the `}`.
        let (word, closed) = self.nested(&['}'])?;
        if closed.is_none() {
            return Err(ShellWordsError::MissingBrace);
        }
        let value = (self.lookup)(&name);
        let empty = value
            .as_deref()
            .is_none_or(|v| null_is_unset && v.is_empty());
        Ok(match op {
            '-' => {
                if empty {
                    word
                } else {
                    value.unwrap_or_default()
                }
            }
            '+' => {
                if empty {
                    String::new()
                } else {
                    word
                }
            }
            _ => match value {
                None => {
                    let message = if word.is_empty() {
                        "is not allowed to be unset".into()
                    } else {
                        word
                    };
                    return Err(ShellWordsError::Required { name, message });
                }
                Some(v) if null_is_unset && v.is_empty() => {
                    let message = if word.is_empty() {
                        "is not allowed to be empty".into()
                    } else {
                        word
                    };
                    return Err(ShellWordsError::Required { name, message });
                }
                Some(v) => v,
            },
        })
    }
}

/// Whether `text` matches the glob `pattern` (`*`: any run, `?`: any one character, other
/// characters literally). Iterative with one backtrack point, no recursion.
#[cfg(test)]
fn glob(pattern: &[char], text: &[char]) -> bool {
    let mut unlimited = u64::MAX;
    glob_counted(pattern, text, &mut unlimited)
}

/// [`glob`], taking one from `budget` per step; false once the budget is spent.
fn glob_counted(pattern: &[char], text: &[char], budget: &mut u64) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while t < text.len() {
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        match pattern.get(p) {
            Some('*') => {
                backtrack = Some((p, t));
                p += 1;
            }
            Some(&c) if c == '?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match backtrack {
                Some((bp, bt)) => {
                    p = bp + 1;
                    t = bt + 1;
                    backtrack = Some((bp, bt + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// Expands one word (BuildKit's `ProcessWord`): removes quotes (`'...'` literal, `"..."`
/// with `$` expanded and `"`, `$` and the escape character escapable), applies the escape
/// character outside quotes, and substitutes variables through `lookup`.
pub fn expand_word(
    word: &str,
    escape: char,
    lookup: &mut Lookup<'_>,
) -> Result<String, ShellWordsError> {
    Ok(expand_word_tracking(word, escape, lookup)?.0)
}

/// [`expand_word`], also returning the names referenced as `$NAME` or `${NAME}` that were
/// unset (BuildKit's `UndefinedVar` check; the `${NAME:-word}` forms are not reported).
pub fn expand_word_tracking(
    word: &str,
    escape: char,
    lookup: &mut Lookup<'_>,
) -> Result<(String, Vec<String>), ShellWordsError> {
    let mut scanner = Scanner {
        chars: word.chars().collect(),
        pos: 0,
        escape,
        lookup,
        raw: false,
        unset: Vec::new(),
        unset_seen: Default::default(),
        depth: 0,
        budget: PATTERN_BUDGET,
    };
    let out = scanner.process(&[])?.0;
    Ok((out, scanner.unset))
}

/// Expands variables in a heredoc body (`COPY <<EOF` with an unquoted delimiter): `$` forms
/// are substituted, an escaped `$` gives a literal `$` and a doubled escape character one
/// escape character (as in a shell heredoc); quotes and other escapes are kept as
/// written, since the body is file content, not a word.
pub fn expand_heredoc(
    body: &str,
    escape: char,
    lookup: &mut Lookup<'_>,
) -> Result<String, ShellWordsError> {
    let mut scanner = Scanner {
        chars: body.chars().collect(),
        pos: 0,
        escape,
        lookup,
        raw: true,
        unset: Vec::new(),
        unset_seen: Default::default(),
        depth: 0,
        budget: PATTERN_BUDGET,
    };
    Ok(scanner.process(&[])?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "A" => Some("apple".into()),
            "EMPTY" => Some(String::new()),
            "SP" => Some("a b".into()),
            _ => None,
        }
    }

    fn ex(word: &str) -> Result<String, ShellWordsError> {
        expand_word(word, '\\', &mut env)
    }

    #[test]
    fn plain_forms() {
        assert_eq!(ex("$A").unwrap(), "apple");
        assert_eq!(ex("${A}").unwrap(), "apple");
        assert_eq!(ex("x${A}y").unwrap(), "xappley");
        assert_eq!(ex("$A.txt").unwrap(), "apple.txt");
        assert_eq!(ex("$UNSET").unwrap(), "");
        assert_eq!(ex("$").unwrap(), "$");
        assert_eq!(ex("a$").unwrap(), "a$");
        assert_eq!(ex("$SP").unwrap(), "a b");
    }

    #[test]
    fn modifiers() {
        assert_eq!(ex("${A:-w}").unwrap(), "apple");
        assert_eq!(ex("${UNSET:-w}").unwrap(), "w");
        assert_eq!(ex("${EMPTY:-w}").unwrap(), "w");
        assert_eq!(ex("${EMPTY-w}").unwrap(), "");
        assert_eq!(ex("${UNSET-w}").unwrap(), "w");
        assert_eq!(ex("${A:+w}").unwrap(), "w");
        assert_eq!(ex("${EMPTY:+w}").unwrap(), "");
        assert_eq!(ex("${EMPTY+w}").unwrap(), "w");
        assert_eq!(ex("${UNSET+w}").unwrap(), "");
        assert_eq!(ex("${UNSET:-$A}").unwrap(), "apple");
        assert_eq!(ex("${UNSET:-'a b'}").unwrap(), "a b");
        assert_eq!(ex("${UNSET:-${A:+x}y}").unwrap(), "xy");
        assert_eq!(ex("${A?}").unwrap(), "apple");
        assert_eq!(
            ex("${UNSET?need it}"),
            Err(ShellWordsError::Required {
                name: "UNSET".into(),
                message: "need it".into()
            })
        );
        assert!(matches!(
            ex("${EMPTY:?}"),
            Err(ShellWordsError::Required { .. })
        ));
        assert_eq!(ex("${EMPTY?}").unwrap(), "");
    }

    #[test]
    fn escapes_and_quotes() {
        assert_eq!(ex(r"\$A").unwrap(), "$A");
        assert_eq!(ex(r"\${A}").unwrap(), "${A}");
        assert_eq!(ex("'$A'").unwrap(), "$A");
        assert_eq!(ex("\"$A\"").unwrap(), "apple");
        assert_eq!(ex(r#""\$A""#).unwrap(), "$A");
        assert_eq!(ex(r#""a\b""#).unwrap(), r"a\b");
        assert_eq!(ex(r#""a\"b""#).unwrap(), "a\"b");
        assert_eq!(ex(r"a\ b").unwrap(), "a b");
        assert_eq!(ex(r"a\").unwrap(), "a");
        assert_eq!(expand_word("`$A", '`', &mut env).unwrap(), "$A");
        assert_eq!(expand_word(r"\$A", '`', &mut env).unwrap(), r"\apple");
    }

    #[test]
    fn errors() {
        assert_eq!(ex("${A"), Err(ShellWordsError::MissingBrace));
        assert_eq!(ex("${"), Err(ShellWordsError::MissingBrace));
        assert_eq!(ex("${A:-x"), Err(ShellWordsError::MissingBrace));
        assert_eq!(ex("${}"), Err(ShellWordsError::BadSubstitution));
        assert_eq!(ex("${:-x}"), Err(ShellWordsError::BadSubstitution));
        assert_eq!(
            ex("${A:#x}"),
            Err(ShellWordsError::UnsupportedModifier(":#".into()))
        );
        assert_eq!(
            ex("${A^x}"),
            Err(ShellWordsError::UnsupportedModifier("^".into()))
        );
        assert_eq!(ex("${A#x"), Err(ShellWordsError::MissingBrace));
        assert_eq!(ex("${A/x"), Err(ShellWordsError::MissingBrace));
        assert_eq!(
            ex("${A:x}"),
            Err(ShellWordsError::UnsupportedModifier(":x".into()))
        );
        assert_eq!(ex("'abc"), Err(ShellWordsError::UnclosedSingleQuote));
        assert_eq!(ex("\"abc"), Err(ShellWordsError::UnclosedDoubleQuote));
    }

    #[test]
    fn unset_plain_references_are_reported() {
        let (out, unset) =
            expand_word_tracking("$A $NOPE ${NOPE2} ${NOPE3:-x} $NOPE", '\\', &mut env).unwrap();
        assert_eq!(out, "apple   x ");
        assert_eq!(unset, ["NOPE", "NOPE2"]);
    }

    #[test]
    fn heredoc_bodies_keep_quotes() {
        let out = expand_heredoc("echo \"$A\" '$A' \\$A \\n \\\\n\n", '\\', &mut env).unwrap();
        assert_eq!(out, "echo \"apple\" 'apple' $A \\n \\n\n");
    }

    #[test]
    fn splitting() {
        assert_eq!(
            split_words(r#"a "b c" d\ e"#, '\\'),
            vec!["a", "\"b c\"", r"d\ e"]
        );
        assert_eq!(
            split_words("  x=1   y='2 3'  ", '\\'),
            vec!["x=1", "y='2 3'"]
        );
        assert_eq!(split_words(r#"k="""#, '\\'), vec![r#"k="""#]);
        assert_eq!(split_words("", '\\'), Vec::<String>::new());
        assert_eq!(split_words("a\\", '\\'), vec!["a"]);
    }

    #[test]
    fn pattern_removal_and_replacement() {
        let mut env = |n: &str| match n {
            "V" => Some("v1.2.3-rc1".to_string()),
            "P" => Some("/usr/local/bin".to_string()),
            _ => None,
        };
        let mut e = |w: &str| expand_word(w, '\\', &mut env).unwrap();
        assert_eq!(e("${V#v}"), "1.2.3-rc1");
        assert_eq!(e("${V#*.}"), "2.3-rc1");
        assert_eq!(e("${V##*.}"), "3-rc1");
        assert_eq!(e("${V%-*}"), "v1.2.3");
        assert_eq!(e("${V%.*}"), "v1.2");
        assert_eq!(e("${V%%.*}"), "v1");
        assert_eq!(e("${V#nomatch}"), "v1.2.3-rc1");
        assert_eq!(e("${P/local/opt}"), "/usr/opt/bin");
        assert_eq!(e("${P//o/0}"), "/usr/l0cal/bin");
        assert_eq!(e("${P/?sr}"), "//local/bin");
        assert_eq!(e("${UNSET#x}"), "");
        assert!(glob(&['a', '*', 'c'], &['a', 'b', 'b', 'c']));
        assert!(!glob(&['a', '?'], &['a']));
    }

    #[test]
    fn expensive_patterns_are_refused() {
        let long = "a".repeat(20_000);
        let mut env = |_: &str| Some(long.clone());
        let e = expand_word("${V//*b*/x}", '\\', &mut env);
        assert_eq!(e, Err(ShellWordsError::TooExpensive));
    }

    #[test]
    fn amplification_is_capped() {
        let big = "x".repeat(600_000);
        let mut env = |_: &str| Some(big.clone());
        assert_eq!(
            expand_word("$A", '\\', &mut env).map(|s| s.len()),
            Ok(600_000)
        );
        assert_eq!(
            expand_word("$A$A", '\\', &mut env),
            Err(ShellWordsError::TooLong)
        );
        assert_eq!(
            expand_word("\"$A${A}\"", '\\', &mut env),
            Err(ShellWordsError::TooLong)
        );
        assert_eq!(
            expand_heredoc("$A\n$A\n", '\\', &mut env),
            Err(ShellWordsError::TooLong)
        );
    }

    #[test]
    fn deep_nesting_is_refused() {
        let ok = format!(
            "{}x{}",
            "${U:-".repeat(MAX_NESTING),
            "}".repeat(MAX_NESTING)
        );
        assert_eq!(ex(&ok).unwrap(), "x");
        let deep = format!("{}x{}", "${U:-".repeat(20_000), "}".repeat(20_000));
        assert_eq!(ex(&deep), Err(ShellWordsError::TooDeep));
    }

    #[test]
    fn hostile_input_does_not_panic() {
        for s in [
            "${",
            "${:",
            "${a:",
            "$'",
            "\"\\",
            "'",
            "${a:-${b:-${",
            "\\",
            "$${{}}",
        ] {
            let _ = ex(s);
            let _ = expand_heredoc(s, '\\', &mut env);
            let _ = split_words(s, '\\');
        }
    }
}
