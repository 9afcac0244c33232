//! Dockerfile syntax: bytes to parse-dockerfile instructions, plus the `RUN` heredocs.
//!
//! parse-dockerfile handles parser directives, the escape character, exec vs shell form,
//! spans, and heredocs on `COPY`/`ADD` (several per instruction). For `RUN` it accepts only
//! one heredoc, and only as the first word; BuildKit accepts any number anywhere on the
//! line (`RUN python3 <<EOF`, `RUN <<A <<B`). So before parsing, [`parse`] finds every
//! `RUN` heredoc itself (BuildKit's `heredocsFromLine` rules: a word `[n]<<[-]DELIM`), takes
//! out its body, and hands parse-dockerfile a copy of the text in which each body line is a
//! comment of the same length and the marker's first `<` is hidden, so every byte offset
//! still points into the original text.

use std::ops::Range;

use crate::error::Fault;
use crate::shell_words;

/// A Dockerfile syntax error.
#[derive(Debug, thiserror::Error)]
pub enum SyntaxError {
    /// parse-dockerfile rejected the text (its message).
    #[error("{0}")]
    Parse(String),
    /// A heredoc whose delimiter line never comes.
    #[error("unterminated heredoc: no line '{0}' before the end of the file")]
    UnterminatedHeredoc(String),
}

/// A heredoc body taken from a `RUN` instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunHeredoc {
    /// Delimiter with quotes removed (BuildKit uses it as the file name).
    pub name: String,
    /// Body as written: every line with its newline, leading tabs kept.
    pub raw: String,
    /// `<<-`: leading tabs are stripped from body lines.
    pub chomp: bool,
    /// `false` when the delimiter was quoted.
    pub expand: bool,
    /// Byte range of the marker word in the text.
    pub marker: Range<usize>,
    /// Byte range of the body and terminator lines.
    pub body: Range<usize>,
}

impl RunHeredoc {
    /// The body with `<<-` tab stripping applied.
    pub fn content(&self) -> String {
        if self.chomp {
            strip_leading_tabs(&self.raw)
        } else {
            self.raw.clone()
        }
    }
}

/// Strips leading tabs from every line (`<<-`).
pub fn strip_leading_tabs(s: &str) -> String {
    s.split_inclusive('\n')
        .map(|l| l.trim_start_matches('\t'))
        .collect()
}

/// The parsed Dockerfile: parse-dockerfile's tree over the masked text, and the `RUN`
/// heredocs keyed by the byte offset of their `RUN` keyword.
#[derive(Debug)]
pub struct Parsed<'a> {
    /// parse-dockerfile's result (spans index the original text).
    pub dockerfile: parse_dockerfile::Dockerfile<'a>,
    /// Heredocs: (offset of the instruction keyword, heredocs in order).
    pub run_heredocs: HeredocsByInstruction,
    /// The escape character.
    pub escape: char,
}

impl Parsed<'_> {
    /// The heredocs of the `RUN` whose keyword starts at `offset`.
    pub fn heredocs_at(&self, offset: usize) -> &[RunHeredoc] {
        self.run_heredocs
            .iter()
            .find(|(at, _)| *at == offset)
            .map_or(&[], |(_, docs)| docs.as_slice())
    }
}

/// Prepares `text` for parse-dockerfile: returns the masked text and the `RUN` heredocs.
/// Heredocs of each `RUN`/`COPY`/`ADD`, keyed by the byte offset of its keyword.
pub type HeredocsByInstruction = Vec<(usize, Vec<RunHeredoc>)>;

pub(crate) fn mask_run_heredocs(text: &str) -> Result<(String, HeredocsByInstruction), Fault> {
    let escape = escape_directive(text);
    let mut masked = text.as_bytes().to_vec();
    let mut found = Vec::new();
    let lines = line_starts(text);
    let mut i = 0;
    while i < lines.len() {
        let (start, end) = lines[i];
        let line = &text[start..end];
        let trimmed = line.trim_start();
        i += 1;
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        // Gather the logical line: continuation lines, skipping comment and blank lines.
        let mut logical = String::new();
        let mut current = line.trim_end_matches('\r');
        loop {
            match strip_continuation(current, escape) {
                Some(head) => {
                    logical.push_str(head);
                    loop {
                        if i >= lines.len() {
                            break;
                        }
                        let (s, e) = lines[i];
                        let next = text[s..e].trim_end_matches('\r');
                        let t = next.trim_start();
                        if t.starts_with('#') || t.is_empty() {
                            i += 1;
                            continue;
                        }
                        break;
                    }
                    if i >= lines.len() {
                        break;
                    }
                    let (s, e) = lines[i];
                    current = text[s..e].trim_end_matches('\r');
                    i += 1;
                }
                None => {
                    logical.push_str(current);
                    break;
                }
            }
        }
        let mut words = shell_words::split_words(&logical, '\\').into_iter();
        let keyword = words.next().unwrap_or_default().to_ascii_uppercase();
        let is_run = keyword == "RUN";
        if keyword == "ENTRYPOINT" {
            // BuildKit accepts `ENTRYPOINT []` (clear the entrypoint); parse-dockerfile does
            // not, so the brackets become `""` here and `[]` again in `instructions`.
            let instruction_end = lines[i - 1].1;
            let raw = &text[start..instruction_end];
            let after = raw.trim_start()["ENTRYPOINT".len().min(raw.trim_start().len())..].trim();
            if after == "[]"
                && let Some(at) = raw.rfind("[]")
            {
                masked[start + at] = b'"';
                masked[start + at + 1] = b'"';
            }
            continue;
        }
        if !(is_run || keyword == "COPY" || keyword == "ADD") {
            continue;
        }
        let rest: Vec<String> = words.skip_while(|w| w.starts_with("--")).collect();
        if rest.first().is_some_and(|w| w.starts_with('[')) {
            continue;
        }
        let markers: Vec<(String, bool, bool, String)> =
            rest.iter().filter_map(|w| heredoc_marker(w)).collect();
        if markers.is_empty() {
            continue;
        }
        let keyword_offset = start + (line.len() - trimmed.len());
        let instruction_end = if i > 0 { lines[i - 1].1 } else { end };
        let mut docs = Vec::new();
        for (name, chomp, expand, word) in markers {
            let marker_at = text[keyword_offset..instruction_end]
                .find(word.as_str())
                .map_or(keyword_offset, |o| keyword_offset + o);
            let body_start = lines.get(i).map_or(text.len(), |l| l.0);
            let mut raw = String::new();
            let mut terminated = false;
            while i < lines.len() {
                let (s, e) = lines[i];
                i += 1;
                let l = text[s..e].trim_end_matches('\r');
                let candidate = if chomp { l.trim_start_matches('\t') } else { l };
                if candidate == name {
                    terminated = true;
                    break;
                }
                raw.push_str(l);
                raw.push('\n');
            }
            if !terminated {
                return Err(Fault::new(
                    marker_at,
                    SyntaxError::UnterminatedHeredoc(name),
                ));
            }
            let body_end = lines[i - 1].1;
            docs.push(RunHeredoc {
                name,
                raw,
                chomp,
                expand,
                marker: marker_at..marker_at + word.len(),
                body: body_start..body_end,
            });
            if is_run {
                // Hide the marker from parse-dockerfile, which would otherwise read the
                // (masked) body itself.
                masked[marker_at] = b'_';
            }
        }
        if is_run {
            for doc in &docs {
                mask_lines(&mut masked, doc.body.clone());
            }
        }
        found.push((keyword_offset, docs));
    }
    // Only ASCII bytes were written over whole lines and a '<', so the text stays UTF-8;
    // fall back to the original on the impossible error rather than panic.
    let masked = String::from_utf8(masked).unwrap_or_else(|_| text.to_string());
    Ok((masked, found))
}

/// Turns every line in `range` into a same-length comment (`#` then spaces).
fn mask_lines(bytes: &mut [u8], range: Range<usize>) {
    let mut at_line_start = true;
    for b in &mut bytes[range] {
        if *b == b'\n' {
            at_line_start = true;
            continue;
        }
        if *b == b'\r' {
            continue;
        }
        *b = if at_line_start { b'#' } else { b' ' };
        at_line_start = false;
    }
}

/// `(start, end)` byte offsets of each line, without the `\n`.
fn line_starts(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, b) in text.bytes().enumerate() {
        if b == b'\n' {
            out.push((start, i));
            start = i + 1;
        }
    }
    if start < text.len() {
        out.push((start, text.len()));
    }
    out
}

/// If `line` ends with the escape character (then optional spaces/tabs), the line without it.
pub fn strip_continuation(line: &str, escape: char) -> Option<&str> {
    let t = line.trim_end_matches([' ', '\t']);
    t.strip_suffix(escape)
}

/// The `# escape=` directive's character, `\` by default.
fn escape_directive(text: &str) -> char {
    for line in text.lines() {
        let t = line.trim();
        let Some(body) = t.strip_prefix('#') else {
            break;
        };
        let Some((key, value)) = body.split_once('=') else {
            break;
        };
        if key.trim().eq_ignore_ascii_case("escape") {
            return if value.trim() == "`" { '`' } else { '\\' };
        }
    }
    '\\'
}

/// Parses a heredoc marker word (`[n]<<[-]DELIM`): (name, chomp, expand, word).
fn heredoc_marker(word: &str) -> Option<(String, bool, bool, String)> {
    let after_fd = word.trim_start_matches(|c: char| c.is_ascii_digit());
    let rest = after_fd.strip_prefix("<<")?;
    let (chomp, rest) = match rest.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    if rest.is_empty() || rest.contains('<') {
        return None;
    }
    let expand = !rest.contains(['\'', '"']);
    let name = shell_words::expand_word(rest, '\\', &mut |n| Some(format!("${n}"))).ok()?;
    if name.is_empty() {
        return None;
    }
    Some((name, chomp, expand, word.to_string()))
}

/// Joins a shell-form command's raw text as BuildKit's parser does: an escape character
/// ending a line is removed with the newline, comment and blank lines inside the
/// continuation are dropped, and the result is trimmed.
pub fn join_continuations(raw: &str, escape: char) -> String {
    let mut out = String::new();
    let mut first = true;
    let mut continuing = true;
    for line in raw.split('\n') {
        let line = line.trim_end_matches('\r');
        if !first {
            if !continuing {
                // A line past the logical line's end (only heredoc bodies can follow).
                break;
            }
            let t = line.trim_start();
            if t.starts_with('#') || t.trim().is_empty() {
                continue;
            }
        }
        first = false;
        match strip_continuation(line, escape) {
            Some(head) => out.push_str(head),
            None => {
                out.push_str(line);
                continuing = false;
            }
        }
    }
    out.trim().to_string()
}

/// Parses `text` (the caller has already masked it with [`mask_run_heredocs`]).
pub(crate) fn parse<'a>(
    original: &str,
    masked: &'a str,
    run_heredocs: HeredocsByInstruction,
) -> Result<Parsed<'a>, Fault> {
    let dockerfile = parse_dockerfile::parse(masked).map_err(|e| {
        let offset = offset_of(original, e.line(), e.column());
        Fault::new(offset, SyntaxError::Parse(format!("{e:#}")))
    })?;
    let escape = dockerfile
        .parser_directives
        .escape
        .as_ref()
        .map_or('\\', |d| d.value.value);
    Ok(Parsed {
        dockerfile,
        run_heredocs,
        escape,
    })
}

/// Byte offset of 1-based `line` and byte `column` (0 for unknown).
fn offset_of(text: &str, line: usize, column: usize) -> usize {
    if line == 0 {
        return 0;
    }
    let line_start = text
        .split_inclusive('\n')
        .take(line - 1)
        .map(str::len)
        .sum::<usize>();
    (line_start + column.saturating_sub(1)).min(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_heredocs_are_taken_out_and_masked() {
        let text = "FROM x\nRUN python3 <<EOF > /out\nprint('hi')\nEOF\nRUN echo\n";
        let (masked, docs) = mask_run_heredocs(text).unwrap();
        assert_eq!(masked.len(), text.len());
        assert_eq!(
            masked,
            "FROM x\nRUN python3 _<EOF > /out\n#          \n#  \nRUN echo\n"
        );
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].0, 7);
        let doc = &docs[0].1[0];
        assert_eq!(doc.name, "EOF");
        assert_eq!(doc.raw, "print('hi')\n");
        assert!(doc.expand && !doc.chomp);
    }

    #[test]
    fn several_heredocs_quoted_and_chomped() {
        let text = "FROM x\nRUN <<-A cat - 3<<'B'\n\t\tone\n\tA\n$two\nB\n";
        let (_, docs) = mask_run_heredocs(text).unwrap();
        let docs = &docs[0].1;
        assert_eq!(docs.len(), 2);
        assert_eq!((docs[0].name.as_str(), docs[0].chomp), ("A", true));
        assert_eq!(docs[0].content(), "one\n");
        assert_eq!(docs[0].raw, "\t\tone\n");
        assert_eq!((docs[1].name.as_str(), docs[1].expand), ("B", false));
        assert_eq!(docs[1].raw, "$two\n");
    }

    #[test]
    fn copy_heredoc_bodies_are_skipped_not_masked() {
        let text = "FROM x\nCOPY <<EOF /f\nRUN <<X\nEOF\nRUN true\n";
        let (masked, docs) = mask_run_heredocs(text).unwrap();
        assert_eq!(masked, text);
        assert_eq!(docs[0].1[0].name, "EOF");
        assert_eq!(docs[0].1[0].raw, "RUN <<X\n");
    }

    #[test]
    fn unterminated_heredoc_is_an_error() {
        let err = mask_run_heredocs("FROM x\nRUN <<EOF\necho\n").unwrap_err();
        assert!(matches!(
            err.kind,
            crate::RecipeErrorKind::Syntax(SyntaxError::UnterminatedHeredoc(_))
        ));
        assert_eq!(err.offset, 11);
    }

    #[test]
    fn continuations_join_like_buildkit() {
        assert_eq!(
            join_continuations(
                "apt-get update && \\\n  # c\n\n    apt-get install x  ",
                '\\'
            ),
            "apt-get update &&     apt-get install x"
        );
        assert_eq!(join_continuations("a `\nb", '`'), "a b");
        assert_eq!(join_continuations("a\\b", '\\'), "a\\b");
    }

    #[test]
    fn parse_errors_are_located() {
        let text = "FROM x\nFOO bar\n";
        let err = parse(text, text, vec![]).unwrap_err();
        assert_eq!(err.offset, 7);
    }
}
