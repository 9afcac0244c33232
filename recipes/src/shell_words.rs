//! BuildKit's word handling for the instructions it substitutes in (`frontend/dockerfile/shell`
//! and `parser/line_parsers.go` of moby/buildkit): splitting an argument string into raw words
//! ([`split_words`]), and expanding one word ([`expand_word`]): quote removal, the escape
//! character, and `$VAR`, `${VAR}`, `${VAR:-word}`, `${VAR-word}`, `${VAR:+word}`,
//! `${VAR+word}`, `${VAR:?msg}`, `${VAR?msg}`. An unset variable expands to the empty string.
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
}

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

    /// Processes until `stop` (consumed) or the end.
    fn process(&mut self, stop: Option<char>) -> Result<(String, bool), ShellWordsError> {
        let mut out = String::new();
        while let Some(ch) = self.peek() {
            if Some(ch) == stop {
                self.pos += 1;
                return Ok((out, true));
            }
            match ch {
                '\'' if !self.raw => out.push_str(&self.single_quote()?),
                '"' if !self.raw => out.push_str(&self.double_quote()?),
                '$' => out.push_str(&self.dollar()?),
                _ => {
                    self.pos += 1;
                    if ch == self.escape {
                        match self.next() {
                            None => break,
                            Some(next) => {
                                if self.raw && next != '$' {
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
        Ok((out, false))
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
                Some('$') => out.push_str(&self.dollar()?),
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

    fn dollar(&mut self) -> Result<String, ShellWordsError> {
        self.pos += 1;
        if self.peek() != Some('{') {
            let name = self.name();
            if name.is_empty() {
                return Ok("$".to_string());
            }
            return Ok((self.lookup)(&name).unwrap_or_default());
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
            '}' => return Ok((self.lookup)(&name).unwrap_or_default()),
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
        if !matches!(op, '-' | '+' | '?') {
            return Err(ShellWordsError::UnsupportedModifier(modifier));
        }
        // The word is itself expanded (nested quotes and variables), up to the `}`.
        let raw = self.raw;
        self.raw = false;
        let result = self.process(Some('}'));
        self.raw = raw;
        let (word, closed) = result?;
        if !closed {
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

/// Expands one word (BuildKit's `ProcessWord`): removes quotes (`'...'` literal, `"..."`
/// with `$` expanded and `"`, `$` and the escape character escapable), applies the escape
/// character outside quotes, and substitutes variables through `lookup`.
pub fn expand_word(
    word: &str,
    escape: char,
    lookup: &mut Lookup<'_>,
) -> Result<String, ShellWordsError> {
    let mut scanner = Scanner {
        chars: word.chars().collect(),
        pos: 0,
        escape,
        lookup,
        raw: false,
    };
    Ok(scanner.process(None)?.0)
}

/// Expands variables in a heredoc body (`COPY <<EOF` with an unquoted delimiter): `$` forms
/// are substituted and an escaped `$` gives a literal `$`; quotes and other escapes are
/// kept as written, since the body is file content, not a word.
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
    };
    Ok(scanner.process(None)?.0)
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
            ex("${A%x}"),
            Err(ShellWordsError::UnsupportedModifier("%".into()))
        );
        assert_eq!(
            ex("${A:x}"),
            Err(ShellWordsError::UnsupportedModifier(":x".into()))
        );
        assert_eq!(ex("'abc"), Err(ShellWordsError::UnclosedSingleQuote));
        assert_eq!(ex("\"abc"), Err(ShellWordsError::UnclosedDoubleQuote));
    }

    #[test]
    fn heredoc_bodies_keep_quotes() {
        let out = expand_heredoc("echo \"$A\" '$A' \\$A \\n\n", '\\', &mut env).unwrap();
        assert_eq!(out, "echo \"apple\" 'apple' $A \\n\n");
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
