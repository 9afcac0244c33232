//! `.dockerignore`: which paths of a build context are left out of it.
//!
//! The file format and matching rules are Docker's (Docker's build reference, section
//! ".dockerignore file", and the `moby/patternmatcher` module it points to):
//!
//! - one pattern per line; a line whose first byte (column 1, before any trimming) is `#` is a
//!   comment; a UTF-8 byte order mark at the start of the file is dropped;
//! - each line is trimmed of surrounding white space; a line that is then empty is skipped;
//! - a line starting with `!` is an exception: a path it matches is put back into the context;
//! - the pattern is cleaned the way Go's `filepath.Clean` cleans a path (`./a//b/` becomes
//!   `a/b`, `a/../b` becomes `b`), and one leading `/` is dropped, so `/foo`, `./foo` and `foo/`
//!   all mean `foo`;
//! - the glob syntax is Go's `filepath.Match`: `*` is any run of characters other than `/`, `?`
//!   one character other than `/`, `[...]` a character class (negated by a leading `^`, ranges
//!   `a-z`, `\` escapes inside it), `\` escapes the next character; plus Docker's `**`: `**/` (or
//!   `**` in the middle of a pattern) matches any number of whole directories, including none,
//!   and a trailing `**` matches any rest of the path;
//! - a pattern matches a path when it matches the path itself or one of its parent
//!   directories, so `node_modules` excludes everything below it;
//! - the last line that matches a path decides: a path is excluded when that line is not an
//!   exception.
//!
//! Quirks kept on purpose because Docker has them: a pattern that begins with `**` and has no
//! other wildcard is a plain suffix test (`**foo` excludes `barfoo`), a pattern ending in `**`
//! after only literal characters is a plain prefix test (`foo**` excludes `foobar/x`), and `**`
//! in the middle of a name matches whole directories only (`a**b` matches `ab` and `a/x/b` but
//! not `axb`). A character class never spans more than one character; Docker's regular
//! expression translation mangles wildcards inside a class (`[*]`), where this module keeps
//! `filepath.Match`'s meaning.
//!
//! A malformed pattern (an unterminated `[`, an empty or backwards range, a trailing `\`, a bare
//! `!`) is an error naming the file and line, where Docker fails the build too.
//!
//! Which file applies: for a Dockerfile at `<dir>/<name>`, the file `<dir>/<name>.dockerignore`
//! takes precedence over `<context>/.dockerignore` (Docker's build reference, "Filename and
//! location"); see [`ignore_file_candidates`] and [`Dockerignore::for_dockerfile`].

use std::path::{Path, PathBuf};

/// An error reading or parsing a `.dockerignore` file.
#[derive(Debug, thiserror::Error)]
pub enum DockerignoreError {
    /// A line that is not valid UTF-8.
    #[error("{file}:{line}: the line is not valid UTF-8")]
    InvalidUtf8 {
        /// The ignore file's name as given by the caller.
        file: String,
        /// 1-based line number.
        line: usize,
    },
    /// A pattern `filepath.Match` would refuse, or a bare `!`.
    #[error("{file}:{line}: bad pattern {pattern:?}: {reason}")]
    BadPattern {
        /// The ignore file's name as given by the caller.
        file: String,
        /// 1-based line number.
        line: usize,
        /// The line, trimmed.
        pattern: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The ignore file exists but cannot be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A parsed `.dockerignore` file: an ordered list of patterns, the last match wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dockerignore {
    patterns: Vec<Pattern>,
}

/// One line of the file, cleaned and compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    /// True for a `!` line: a match puts the path back.
    exception: bool,
    /// The cleaned pattern text, without the `!`.
    text: String,
    /// How the pattern is tested, as Docker decides it.
    kind: Kind,
    /// The compiled glob, used when `kind` is [`Kind::Glob`].
    tokens: Vec<Token>,
}

/// Docker's four ways of testing a pattern (`moby/patternmatcher`'s match types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// No wildcard: the path equals the pattern.
    Exact,
    /// Literal text then a trailing `**`: the path starts with the text.
    Prefix,
    /// A leading `**` then literal text: the path ends with the text.
    Suffix,
    /// Anything else: the compiled glob.
    Glob,
}

/// One element of a compiled glob.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    /// One given character.
    Lit(char),
    /// `?`: one character other than `/`.
    One,
    /// `*`: any run of characters other than `/`.
    Star,
    /// `[...]`: one character in (or, negated, not in) the ranges.
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    /// `**/` or a middle `**`: any number of whole directories (each ending in `/`), or none.
    Dirs,
    /// A trailing `**`: any rest of the path.
    Rest,
}

impl Dockerignore {
    /// Parses the bytes of an ignore file. `file` names it in errors (`file:line: ...`).
    ///
    /// Errors: [`DockerignoreError::InvalidUtf8`] for a line that is not UTF-8,
    /// [`DockerignoreError::BadPattern`] for a malformed pattern or a bare `!`.
    pub fn parse(file: &str, bytes: &[u8]) -> Result<Self, DockerignoreError> {
        let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
        let mut patterns = Vec::new();
        for (index, raw) in bytes.split(|b| *b == b'\n').enumerate() {
            let line = index + 1;
            if raw.first() == Some(&b'#') {
                continue;
            }
            let text = std::str::from_utf8(raw).map_err(|_| DockerignoreError::InvalidUtf8 {
                file: file.to_owned(),
                line,
            })?;
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            let bad = |reason| DockerignoreError::BadPattern {
                file: file.to_owned(),
                line,
                pattern: text.to_owned(),
                reason,
            };
            let (exception, body) = match text.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, text),
            };
            if body.is_empty() {
                return Err(bad("an exception needs a pattern after `!`"));
            }
            let mut cleaned = clean(body);
            if cleaned.len() > 1 && cleaned.starts_with('/') {
                cleaned.remove(0);
            }
            validate(&cleaned).map_err(bad)?;
            let (kind, tokens) = compile(&cleaned);
            patterns.push(Pattern {
                exception,
                text: cleaned,
                kind,
                tokens,
            });
        }
        Ok(Self { patterns })
    }

    /// Reads and parses the ignore file that applies to `dockerfile` in `context` (see
    /// [`ignore_file_candidates`]); no ignore file gives an empty set that excludes nothing.
    ///
    /// Errors: [`DockerignoreError::Io`] when the chosen file cannot be read, and the errors
    /// of [`Dockerignore::parse`].
    pub fn for_dockerfile(dockerfile: &Path, context: &Path) -> Result<Self, DockerignoreError> {
        match find_ignore_file(dockerfile, context) {
            None => Ok(Self::default()),
            Some(path) => {
                let bytes = std::fs::read(&path).map_err(|source| DockerignoreError::Io {
                    path: path.clone(),
                    source,
                })?;
                Self::parse(&path.display().to_string(), &bytes)
            }
        }
    }

    /// True when `path` (relative to the context root, `/`-separated; a leading `/` or `./`
    /// and a trailing `/` are ignored) is excluded from the context.
    pub fn matches(&self, path: &str) -> bool {
        let mut path = clean(path);
        if path.len() > 1 && path.starts_with('/') {
            path.remove(0);
        }
        let mut excluded = false;
        for pattern in &self.patterns {
            // Only a pattern that would change the answer needs testing.
            if pattern.exception != excluded {
                continue;
            }
            if pattern.test_with_parents(&path) {
                excluded = !pattern.exception;
            }
        }
        excluded
    }

    /// True when some line is a `!` exception (a walker may then not skip an excluded
    /// directory without looking inside it).
    pub fn has_exceptions(&self) -> bool {
        self.patterns.iter().any(|p| p.exception)
    }

    /// The cleaned patterns in file order, exceptions with their leading `!`.
    pub fn patterns(&self) -> Vec<String> {
        self.patterns
            .iter()
            .map(|p| {
                if p.exception {
                    format!("!{}", p.text)
                } else {
                    p.text.clone()
                }
            })
            .collect()
    }
}

/// The ignore files that may apply to a build, in order of precedence: the Dockerfile's own
/// `<dockerfile>.dockerignore` beside it, then `<context>/.dockerignore`.
///
/// `dockerfile` is the Dockerfile's path as the caller opens it; `context` the context root.
pub fn ignore_file_candidates(dockerfile: &Path, context: &Path) -> Vec<PathBuf> {
    let mut candidates = Vec::with_capacity(2);
    if let Some(name) = dockerfile.file_name() {
        let mut own = name.to_os_string();
        own.push(".dockerignore");
        candidates.push(dockerfile.with_file_name(own));
    }
    candidates.push(context.join(".dockerignore"));
    candidates
}

/// The first of [`ignore_file_candidates`] that exists as a file, if any.
pub fn find_ignore_file(dockerfile: &Path, context: &Path) -> Option<PathBuf> {
    ignore_file_candidates(dockerfile, context)
        .into_iter()
        .find(|p| p.is_file())
}

impl Pattern {
    /// Whether this pattern alone matches exactly `path` (parents are the caller's business).
    fn test(&self, path: &str) -> bool {
        match self.kind {
            Kind::Exact => path == self.text,
            Kind::Prefix => path.starts_with(&self.text[..self.text.len() - 2]),
            Kind::Suffix => {
                let suffix = &self.text[2..];
                path.ends_with(suffix) || suffix.strip_prefix('/').is_some_and(|rest| path == rest)
            }
            Kind::Glob => glob_match(&self.tokens, path, false),
        }
    }

    /// Whether this pattern matches `path` or one of its parent directories.
    fn test_with_parents(&self, path: &str) -> bool {
        match self.kind {
            // One pass of the automaton sees every parent as a prefix that ends before a `/`.
            Kind::Glob => glob_match(&self.tokens, path, true),
            _ => {
                self.test(path)
                    || path
                        .char_indices()
                        .any(|(i, c)| c == '/' && i > 0 && self.test(&path[..i]))
            }
        }
    }
}

/// Lexical path cleaning with Go's `filepath.Clean` rules on `/`-separated paths: repeated
/// separators collapse, `.` elements go, `..` removes the element before it (or, at the root,
/// itself), no trailing separator; an empty result is `.`.
pub fn clean(path: &str) -> String {
    let rooted = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.last().is_some_and(|p| *p != "..") {
                    parts.pop();
                } else if !rooted {
                    parts.push("..");
                }
            }
            other => parts.push(other),
        }
    }
    let joined = parts.join("/");
    match (rooted, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".to_owned(),
        (false, false) => joined,
    }
}

/// Checks `pattern` against `filepath.Match`'s syntax, plus the backwards range that Docker's
/// regular expression translation refuses. Returns the reason on failure.
fn validate(pattern: &str) -> Result<(), &'static str> {
    let chars: Vec<char> = pattern.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' => {
                if i + 1 >= chars.len() {
                    return Err("a trailing `\\` escapes nothing");
                }
                i += 2;
            }
            '[' => {
                let (_, _, next) = parse_class(&chars, i)?;
                i = next;
            }
            _ => i += 1,
        }
    }
    Ok(())
}

/// Parses the class that opens at `chars[start] == '['`, with `filepath.Match`'s rules.
/// Returns (negated, ranges, index after the closing `]`).
#[allow(clippy::type_complexity)]
fn parse_class(
    chars: &[char],
    start: usize,
) -> Result<(bool, Vec<(char, char)>, usize), &'static str> {
    let mut i = start + 1;
    let negated = chars.get(i) == Some(&'^');
    if negated {
        i += 1;
    }
    let mut ranges = Vec::new();
    loop {
        if chars.get(i) == Some(&']') && !ranges.is_empty() {
            return Ok((negated, ranges, i + 1));
        }
        let lo = class_char(chars, &mut i)?;
        let mut hi = lo;
        if chars.get(i) == Some(&'-') {
            i += 1;
            hi = class_char(chars, &mut i)?;
            if hi < lo {
                return Err("a character range runs backwards");
            }
        }
        ranges.push((lo, hi));
    }
}

/// One possibly escaped character of a class (Go's `getEsc`): not `-` or `]` unescaped, and
/// something must follow it.
fn class_char(chars: &[char], i: &mut usize) -> Result<char, &'static str> {
    let unterminated = "a character class is not closed with `]`";
    let c = match chars.get(*i) {
        None => return Err(unterminated),
        Some('-') | Some(']') => return Err("a character class has an empty or stray range"),
        Some('\\') => {
            *i += 1;
            *chars.get(*i).ok_or(unterminated)?
        }
        Some(c) => *c,
    };
    *i += 1;
    if *i >= chars.len() {
        return Err(unterminated);
    }
    Ok(c)
}

/// Compiles a validated, cleaned pattern: decides Docker's match kind and builds the glob.
fn compile(pattern: &str) -> (Kind, Vec<Token>) {
    let chars: Vec<char> = pattern.chars().collect();
    let mut kind = Kind::Exact;
    let mut tokens = Vec::new();
    let mut i = 0;
    let mut first = true;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        match c {
            '*' if chars.get(i) == Some(&'*') => {
                i += 1;
                if chars.get(i) == Some(&'/') {
                    i += 1;
                }
                if i >= chars.len() {
                    if kind == Kind::Exact {
                        kind = Kind::Prefix;
                    } else {
                        kind = Kind::Glob;
                    }
                    tokens.push(Token::Rest);
                } else {
                    kind = Kind::Glob;
                    tokens.push(Token::Dirs);
                }
                if first {
                    kind = Kind::Suffix;
                }
            }
            '*' => {
                kind = Kind::Glob;
                tokens.push(Token::Star);
            }
            '?' => {
                kind = Kind::Glob;
                tokens.push(Token::One);
            }
            '\\' => {
                // validate() guarantees a following character.
                if let Some(next) = chars.get(i) {
                    tokens.push(Token::Lit(*next));
                    i += 1;
                    kind = Kind::Glob;
                }
            }
            '[' => {
                kind = Kind::Glob;
                match parse_class(&chars, i - 1) {
                    Ok((negated, ranges, next)) => {
                        tokens.push(Token::Class { negated, ranges });
                        i = next;
                    }
                    // validate() refused such patterns already; keep the text literal.
                    Err(_) => tokens.push(Token::Lit('[')),
                }
            }
            ']' => {
                kind = Kind::Glob;
                tokens.push(Token::Lit(']'));
            }
            other => tokens.push(Token::Lit(other)),
        }
        first = false;
    }
    (kind, tokens)
}

/// Runs the glob over `path` as a nondeterministic automaton: linear in the path for each
/// token, so no input makes it backtrack exponentially. With `parents`, a match of any prefix
/// that ends just before a `/` (a parent directory) counts too.
fn glob_match(tokens: &[Token], path: &str, parents: bool) -> bool {
    let n = tokens.len();
    // at[i]: the glob has matched tokens[..i]; inside[i]: within the directories of a Dirs
    // token i, after at least one character and before the `/` that closes a directory.
    let mut at = vec![false; n + 1];
    let mut inside = vec![false; n];
    at[0] = true;
    close(tokens, &mut at);
    for (index, c) in path.char_indices() {
        if parents && c == '/' && index > 0 && at[n] {
            return true;
        }
        let mut next_at = vec![false; n + 1];
        let mut next_inside = vec![false; n];
        for i in 0..n {
            if inside[i] {
                next_inside[i] = true;
                if c == '/' {
                    next_at[i + 1] = true;
                }
            }
            if !at[i] {
                continue;
            }
            match &tokens[i] {
                Token::Lit(l) => next_at[i + 1] |= c == *l,
                Token::One => next_at[i + 1] |= c != '/',
                Token::Star => next_at[i] |= c != '/',
                Token::Rest => next_at[i] = true,
                Token::Class { negated, ranges } => {
                    let member = ranges.iter().any(|(lo, hi)| *lo <= c && c <= *hi);
                    next_at[i + 1] |= member != *negated;
                }
                Token::Dirs => {
                    next_inside[i] = true;
                    if c == '/' {
                        next_at[i + 1] = true;
                    }
                }
            }
        }
        at = next_at;
        inside = next_inside;
        close(tokens, &mut at);
        if !at.iter().any(|b| *b) && !inside.iter().any(|b| *b) {
            return false;
        }
    }
    at[n]
}

/// Follows the empty matches: a `*`, `**` or `**/` may match nothing.
fn close(tokens: &[Token], at: &mut [bool]) {
    for i in 0..tokens.len() {
        if at[i] && matches!(tokens[i], Token::Star | Token::Dirs | Token::Rest) {
            at[i + 1] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ignore(lines: &[&str]) -> Dockerignore {
        Dockerignore::parse(".dockerignore", lines.join("\n").as_bytes()).expect("valid file")
    }

    /// One pattern alone, tested with parent directories as Docker does.
    fn hit(pattern: &str, path: &str) -> bool {
        ignore(&[pattern]).matches(path)
    }

    /// One pattern alone, against the path itself only.
    fn exact(pattern: &str, path: &str) -> bool {
        let set = ignore(&[pattern]);
        set.patterns[0].test(path)
    }

    #[test]
    fn reference_example_rules() {
        // The example in Docker's build reference.
        let set = ignore(&["# comment", "*/temp*", "*/*/temp*", "temp?"]);
        assert!(set.matches("somedir/temporary.txt"));
        assert!(set.matches("somedir/temp"));
        assert!(set.matches("somedir/subdir/temporary.txt"));
        assert!(set.matches("tempa"));
        assert!(set.matches("tempb"));
        assert!(!set.matches("temp"));
        assert!(!set.matches("temporary.txt"));
        assert!(!set.matches("a/b/c/temp.txt"));
        assert!(!set.matches("# comment"));
    }

    #[test]
    fn double_star_any_depth() {
        let set = ignore(&["**/*.go"]);
        assert!(set.matches("main.go"));
        assert!(set.matches("cmd/tool/main.go"));
        assert!(!set.matches("main.goo"));
        assert!(!set.matches("README.md"));
    }

    #[test]
    fn exception_after_exclusion() {
        let set = ignore(&["*.md", "!README.md"]);
        assert!(set.matches("CHANGELOG.md"));
        assert!(!set.matches("README.md"));
        assert!(!set.matches("main.rs"));
    }

    #[test]
    fn last_matching_line_wins() {
        let set = ignore(&["*.md", "!README*.md", "README-secret.md"]);
        assert!(set.matches("README-secret.md"));
        assert!(!set.matches("README.md"));
        assert!(!set.matches("README-public.md"));
        assert!(set.matches("notes.md"));

        let set = ignore(&["*.md", "README-secret.md", "!README*.md"]);
        assert!(!set.matches("README-secret.md"));
        assert!(!set.matches("README.md"));
        assert!(set.matches("notes.md"));
    }

    #[test]
    fn exception_before_exclusion_is_overridden() {
        let set = ignore(&["!fileutils.go", "*.go"]);
        assert!(set.matches("fileutils.go"));
    }

    #[test]
    fn everything_but_allow_list() {
        let set = ignore(&["*", "!src", "!Cargo.toml"]);
        assert!(set.matches("target"));
        assert!(set.matches("target/debug/kiln"));
        assert!(!set.matches("src"));
        assert!(!set.matches("src/main.rs"));
        assert!(!set.matches("Cargo.toml"));
        assert!(set.matches("Cargo.lock"));
    }

    #[test]
    fn directory_covers_its_contents() {
        assert!(hit("node_modules", "node_modules"));
        assert!(hit("node_modules", "node_modules/left-pad/index.js"));
        assert!(!hit("node_modules", "src/node_modules"));
        assert!(!hit("node_modules", "node_modules2"));
        assert!(hit("docs/", "docs/README.md"));
        assert!(hit("docs/*", "docs/README.md"));
        assert!(hit("a*", "ab/c"));
        // Directory match with a later exception for a file inside it.
        let set = ignore(&["docs", "!docs/README.md"]);
        assert!(!set.matches("docs/README.md"));
        assert!(set.matches("docs/other.md"));
    }

    #[test]
    fn exception_covers_contents_of_directory() {
        let set = ignore(&["**", "!util/docker/web"]);
        assert!(!set.matches("util/docker/web/foo"));
        assert!(set.matches("util/docker/other"));
        let set = ignore(&["**", "!util/docker/web", "util/docker/web/foo"]);
        assert!(set.matches("util/docker/web/foo"));
        let set = ignore(&["**", "!dist/*.whl"]);
        assert!(!set.matches("dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl"));
    }

    #[test]
    fn leading_slash_and_dot_slash_are_stripped() {
        for pattern in [
            "/foo/bar",
            "foo/bar",
            "./foo/bar",
            "foo/bar/",
            "foo//bar",
            "foo/./bar",
        ] {
            assert!(hit(pattern, "foo/bar"), "{pattern}");
            assert!(hit(pattern, "foo/bar/baz"), "{pattern}");
            assert!(!hit(pattern, "foo"), "{pattern}");
            assert!(!hit(pattern, "x/foo/bar"), "{pattern}");
        }
        assert_eq!(
            ignore(&["/test2", "/a/file/here", "! /inverted/abs/path", "x/../y"]).patterns(),
            ["test2", "a/file/here", "!inverted/abs/path", "y"]
        );
    }

    #[test]
    fn paths_are_cleaned_too() {
        let set = ignore(&["foo/bar"]);
        assert!(set.matches("./foo/bar"));
        assert!(set.matches("/foo/bar/"));
        assert!(set.matches("foo//bar"));
    }

    #[test]
    fn comments_blank_lines_and_whitespace() {
        let set = ignore(&[
            "# a comment",
            "",
            "   ",
            "\t*.log  ",
            " # not a comment",
            "x\r",
        ]);
        assert_eq!(set.patterns(), ["*.log", "# not a comment", "x"]);
        assert!(set.matches("build.log"));
        assert!(set.matches("# not a comment"));
        assert!(set.matches("x"));
        assert!(!set.matches("# a comment"));
        // Only column 1 makes a comment; `!` then spaces is an exception.
        let set = ignore(&["*", "!  keep"]);
        assert!(!set.matches("keep"));
    }

    #[test]
    fn byte_order_mark_is_dropped() {
        let set = Dockerignore::parse("f", b"\xEF\xBB\xBFsecret\n").unwrap();
        assert!(set.matches("secret"));
        let set = Dockerignore::parse("f", b"\xEF\xBB\xBF# comment\n").unwrap();
        assert!(set.patterns().is_empty());
    }

    #[test]
    fn empty_file_excludes_nothing() {
        let set = Dockerignore::parse("f", b"").unwrap();
        assert!(!set.matches("anything"));
        assert!(!set.has_exceptions());
    }

    #[test]
    fn patternmatcher_table() {
        // (pattern, path, matches the path itself, matches it or a parent)
        let table: &[(&str, &str, bool, bool)] = &[
            ("**", "file", true, true),
            ("**/", "file", true, true),
            ("**", "dir/file", true, true),
            ("**/**", "dir/file", true, true),
            ("dir/**", "dir/file", true, true),
            ("dir/**", "dir/dir2/file", true, true),
            ("**/dir", "dir", true, true),
            ("**/dir", "dir/file", false, true),
            ("**/dir2/*", "dir/dir2/file", true, true),
            ("**/dir2/**", "dir/dir2/dir3/file", true, true),
            ("**file", "file", true, true),
            ("**file", "dir/file", true, true),
            ("**/file", "dir/file", true, true),
            ("**file", "dir/dir/file", true, true),
            ("**/file", "dir/dir/file", true, true),
            ("**/file*", "dir/dir/file", true, true),
            ("**/file*", "dir/dir/file.txt", true, true),
            ("**/file*txt", "dir/dir/file.txt", true, true),
            ("**/file*.txt", "dir/dir/file.txt", true, true),
            ("**/file*.txt*", "dir/dir/file.txt", true, true),
            ("**/**/*.txt", "dir/dir/file.txt", true, true),
            ("**/**/*.txt2", "dir/dir/file.txt", false, false),
            ("**/*.txt", "file.txt", true, true),
            ("**/**/*.txt", "file.txt", true, true),
            ("a**/*.txt", "a/file.txt", true, true),
            ("a**/*.txt", "a/dir/file.txt", true, true),
            ("a**/*.txt", "a/dir/dir/file.txt", true, true),
            ("a/*.txt", "a/dir/file.txt", false, false),
            ("a/*.txt", "a/file.txt", true, true),
            ("a/*.txt**", "a/file.txt", true, true),
            ("a[b-d]e", "ae", false, false),
            ("a[b-d]e", "ace", true, true),
            ("a[b-d]e", "aae", false, false),
            ("a[^b-d]e", "aze", true, true),
            (".*", ".foo", true, true),
            (".*", "foo", false, false),
            ("abc.def", "abcdef", false, false),
            ("abc.def", "abc.def", true, true),
            ("abc.def", "abcZdef", false, false),
            ("abc?def", "abcZdef", true, true),
            ("abc?def", "abcdef", false, false),
            ("**/foo/bar", "foo/bar", true, true),
            ("**/foo/bar", "dir/foo/bar", true, true),
            ("**/foo/bar", "dir/dir2/foo/bar", true, true),
            ("abc/**", "abc", false, false),
            ("abc/**", "abc/def", true, true),
            ("abc/**", "abc/def/ghi", true, true),
            ("**/.foo", ".foo", true, true),
            ("**/.foo", "bar.foo", false, false),
            ("a(b)c/def", "a(b)c/def", true, true),
            ("a(b)c/def", "a(b)c/xyz", false, false),
            ("a.|)$(}+{bc", "a.|)$(}+{bc", true, true),
            (
                "dist/*.whl",
                "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl",
                true,
                true,
            ),
            ("a\\\\", "a\\", true, true),
            ("a\\*b", "a*b", true, true),
            ("a\\*b", "axb", false, false),
        ];
        for (pattern, path, itself, with_parents) in table {
            assert_eq!(exact(pattern, path), *itself, "{pattern} on {path} itself");
            assert_eq!(hit(pattern, path), *with_parents, "{pattern} on {path}");
        }
    }

    #[test]
    fn docker_quirks_of_double_star() {
        // A leading `**` with only literal text after it is a plain suffix test.
        assert!(exact("**foo", "barfoo"));
        // A trailing `**` after literal text is a plain prefix test.
        assert!(exact("foo**", "foobar/x"));
        // `**` inside a name matches whole directories only.
        assert!(exact("a**b", "ab"));
        assert!(exact("a**b", "a/x/b"));
        assert!(!exact("a**b", "axb"));
    }

    #[test]
    fn go_filepath_match_table() {
        let table: &[(&str, &str, bool)] = &[
            ("abc", "abc", true),
            ("*", "abc", true),
            ("*c", "abc", true),
            ("a*", "a", true),
            ("a*", "abc", true),
            ("a*/b", "abc/b", true),
            ("a*/b", "a/c/b", false),
            ("a*b*c*d*e*/f", "axbxcxdxe/f", true),
            ("a*b*c*d*e*/f", "axbxcxdxexxx/f", true),
            ("a*b*c*d*e*/f", "axbxcxdxe/xxx/f", false),
            ("a*b*c*d*e*/f", "axbxcxdxexxx/fff", false),
            ("a*b?c*x", "abxbbxdbxebxczzx", true),
            ("a*b?c*x", "abxbbxdbxebxczzy", false),
            ("ab[c]", "abc", true),
            ("ab[b-d]", "abc", true),
            ("ab[e-g]", "abc", false),
            ("ab[^c]", "abc", false),
            ("ab[^b-d]", "abc", false),
            ("ab[^e-g]", "abc", true),
            ("a?b", "a☺b", true),
            ("a[^a]b", "a☺b", true),
            ("a???b", "a☺b", false),
            ("a[^a][^a][^a]b", "a☺b", false),
            ("[a-ζ]*", "α", true),
            ("*[a-ζ]", "A", false),
            ("a?b", "a/b", false),
            ("a*b", "a/b", false),
            ("[\\]a]", "]", true),
            ("[\\-]", "-", true),
            ("[x\\-]", "x", true),
            ("[x\\-]", "-", true),
            ("[x\\-]", "z", false),
            ("[\\-x]", "x", true),
            ("[\\-x]", "-", true),
            ("[\\-x]", "a", false),
            ("*x", "xxx", true),
            ("[!a]", "!", true),
            ("[!a]", "b", false),
        ];
        for (pattern, path, want) in table {
            assert_eq!(exact(pattern, path), *want, "{pattern} on {path}");
        }
    }

    #[test]
    fn malformed_patterns_are_errors_naming_file_and_line() {
        for bad in [
            "[]a]", "[-]", "[x-]", "[-x]", "\\", "[a-b-c]", "[", "[^", "[^bc", "a[", "[z-a]", "!",
            "! ", "foo/[ab",
        ] {
            let text = format!("ok\n# comment\n{bad}\n");
            let err =
                Dockerignore::parse("app.Dockerfile.dockerignore", text.as_bytes()).expect_err(bad);
            let message = err.to_string();
            assert!(
                message.starts_with("app.Dockerfile.dockerignore:3: bad pattern"),
                "{bad}: {message}"
            );
        }
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let err = Dockerignore::parse("ctx/.dockerignore", b"a\n\xff\xfe\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "ctx/.dockerignore:2: the line is not valid UTF-8"
        );
        // In a comment line the bytes do not matter.
        assert!(Dockerignore::parse("f", b"#\xff\n").is_ok());
    }

    #[test]
    fn hostile_patterns_stay_linear() {
        // Many stars against a long non-matching path: an exponential backtracker hangs here.
        let pattern = "*a".repeat(200) + "b";
        let path = "a".repeat(5000);
        assert!(!hit(&pattern, &path));
        let pattern = "**/".repeat(200) + "x";
        let path = "d/".repeat(2000) + "y";
        assert!(!hit(&pattern, &path));
        assert!(hit(&pattern, &("d/".repeat(2000) + "x")));
        assert!(hit(&pattern, &("d/".repeat(2000) + "x/y")));
        // Deep paths with literal patterns test every parent cheaply.
        assert!(!hit("**/nope", &("d/".repeat(5000) + "y")));
        assert!(hit("d/d/d", &("d/".repeat(5000) + "y")));
    }

    #[test]
    fn clean_follows_go() {
        let table = [
            ("", "."),
            (".", "."),
            ("./", "."),
            ("a/b/", "a/b"),
            ("a//b", "a/b"),
            ("a/./b", "a/b"),
            ("a/../b", "b"),
            ("../a", "../a"),
            ("a/../../b", "../b"),
            ("/../a", "/a"),
            ("/", "/"),
            ("//a", "/a"),
            ("abc/def/../../..", ".."),
        ];
        for (input, want) in table {
            assert_eq!(clean(input), want, "{input}");
        }
    }

    fn scratch_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kiln-dockerignore-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("build")).expect("temp dir is writable");
        dir
    }

    #[test]
    fn dockerfile_specific_ignore_file_takes_precedence() {
        let ctx = scratch_dir("precedence");
        let dockerfile = ctx.join("build/app.Dockerfile");
        std::fs::write(&dockerfile, "FROM scratch\n").unwrap();
        assert_eq!(
            ignore_file_candidates(&dockerfile, &ctx),
            [
                ctx.join("build/app.Dockerfile.dockerignore"),
                ctx.join(".dockerignore")
            ]
        );
        assert_eq!(find_ignore_file(&dockerfile, &ctx), None);
        assert!(
            !Dockerignore::for_dockerfile(&dockerfile, &ctx)
                .unwrap()
                .matches("x")
        );

        std::fs::write(ctx.join(".dockerignore"), "context-wide\n").unwrap();
        assert_eq!(
            find_ignore_file(&dockerfile, &ctx),
            Some(ctx.join(".dockerignore"))
        );
        let set = Dockerignore::for_dockerfile(&dockerfile, &ctx).unwrap();
        assert!(set.matches("context-wide"));

        std::fs::write(ctx.join("build/app.Dockerfile.dockerignore"), "own\n").unwrap();
        let set = Dockerignore::for_dockerfile(&dockerfile, &ctx).unwrap();
        assert!(set.matches("own"));
        assert!(!set.matches("context-wide"));

        // Another Dockerfile in the same directory still gets the context's file.
        let other = ctx.join("build/Dockerfile");
        let set = Dockerignore::for_dockerfile(&other, &ctx).unwrap();
        assert!(set.matches("context-wide"));
        std::fs::remove_dir_all(&ctx).unwrap();
    }

    #[test]
    fn error_in_chosen_file_names_it() {
        let ctx = scratch_dir("error");
        let dockerfile = ctx.join("Dockerfile");
        let own = ctx.join("Dockerfile.dockerignore");
        std::fs::write(&own, "fine\n[oops\n").unwrap();
        let err = Dockerignore::for_dockerfile(&dockerfile, &ctx).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("{}:2: bad pattern", own.display())),
            "{err}"
        );
        std::fs::remove_dir_all(&ctx).unwrap();
    }
}
