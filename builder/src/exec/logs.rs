//! Step log shaping: the command's output split into lines tagged with the step index, each
//! line at most [`LogLimits::line_max`] bytes, the step's log at most
//! [`LogLimits::total_max`] bytes with one truncation marker, secret values replaced by
//! [`REDACTED`] before anything is cut or emitted. Limits from DESIGN.md "Build limits"
//! (4 KiB per message, 1 MiB per build log).

use std::collections::VecDeque;

/// What replaces a secret value in a log line.
pub const REDACTED: &str = "****";
/// Appended to a line cut at the line limit.
pub const LINE_TRUNCATED: &str = " [line truncated]";
/// The last line of a log cut at its limit.
pub const LOG_TRUNCATED: &str = "[log truncated: limit reached]";
/// How many of the last lines a failure report keeps.
pub const TAIL_LINES: usize = 20;

/// Log size limits, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// One message, bytes (default 4 KiB).
    pub line_max: usize,
    /// The whole step log, bytes, newlines counted (default 1 MiB).
    pub total_max: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        LogLimits {
            line_max: 4096,
            total_max: 1 << 20,
        }
    }
}

/// What to redact for one secret `value`, given that logs are redacted line by line: the
/// value itself when it is one line (a trailing newline dropped), else each of its lines
/// (without `\r`) of 3 bytes or more. A key file's lines are redacted wherever they appear.
pub fn secret_pieces(value: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(value);
    let lines: Vec<&str> = text
        .split('\n')
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| !l.is_empty())
        .collect();
    match lines.as_slice() {
        [] => Vec::new(),
        [one] => vec![one.to_string()],
        many => many
            .iter()
            .filter(|l| l.len() >= 3)
            .map(|l| l.to_string())
            .collect(),
    }
}

/// One log message of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// The step's index (as the caller numbered it in [`super::StepSpec::index`]).
    pub step: usize,
    /// The text, without its newline, secrets redacted, invalid UTF-8 replaced.
    pub text: String,
}

/// Turns a byte stream into [`LogLine`]s.
pub struct LogShaper {
    step: usize,
    limits: LogLimits,
    secrets: Vec<Vec<u8>>,
    longest_secret: usize,
    buf: Vec<u8>,
    discarding: bool,
    emitted: usize,
    truncated: bool,
    tail: VecDeque<String>,
}

fn redact(line: &[u8], secrets: &[Vec<u8>]) -> Vec<u8> {
    let mut out = line.to_vec();
    for s in secrets {
        let mut result = Vec::with_capacity(out.len());
        let mut i = 0;
        while i < out.len() {
            if out[i..].starts_with(s) {
                result.extend_from_slice(REDACTED.as_bytes());
                i += s.len();
            } else {
                result.push(out[i]);
                i += 1;
            }
        }
        out = result;
    }
    out
}

impl LogShaper {
    /// A shaper for step `step`; empty secrets are ignored.
    pub fn new(step: usize, limits: LogLimits, secrets: &[String]) -> Self {
        let mut secrets: Vec<Vec<u8>> = secrets
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.as_bytes().to_vec())
            .collect();
        // Longest first, so a secret containing another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        let longest_secret = secrets.first().map_or(0, Vec::len);
        LogShaper {
            step,
            limits,
            secrets,
            longest_secret,
            buf: Vec::new(),
            discarding: false,
            emitted: 0,
            truncated: false,
            tail: VecDeque::new(),
        }
    }

    /// Feeds output bytes; complete lines go to `sink`.
    pub fn push(&mut self, mut data: &[u8], sink: &mut dyn FnMut(LogLine)) {
        while !data.is_empty() {
            match data.iter().position(|&b| b == b'\n') {
                Some(nl) => {
                    if !self.discarding {
                        self.buf.extend_from_slice(&data[..nl]);
                        let line = std::mem::take(&mut self.buf);
                        self.emit(&line, false, sink);
                    }
                    self.buf.clear();
                    self.discarding = false;
                    data = &data[nl + 1..];
                }
                None => {
                    if !self.discarding {
                        self.buf.extend_from_slice(data);
                        // Keep enough to redact a secret straddling the cut, then cut.
                        if self.buf.len() > self.limits.line_max + self.longest_secret {
                            let line = std::mem::take(&mut self.buf);
                            self.emit(&line, true, sink);
                            self.discarding = true;
                        }
                    }
                    data = &[];
                }
            }
        }
    }

    /// Flushes a last line without a newline.
    pub fn finish(&mut self, sink: &mut dyn FnMut(LogLine)) {
        if !self.buf.is_empty() && !self.discarding {
            let line = std::mem::take(&mut self.buf);
            self.emit(&line, false, sink);
        }
    }

    /// Whether the total limit cut the log.
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Bytes emitted so far (texts plus one newline each, markers included).
    pub fn emitted_bytes(&self) -> usize {
        self.emitted
    }

    /// The last [`TAIL_LINES`] lines emitted.
    pub fn tail(&self) -> Vec<String> {
        self.tail.iter().cloned().collect()
    }

    fn emit(&mut self, raw: &[u8], force_cut: bool, sink: &mut dyn FnMut(LogLine)) {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let red = redact(raw, &self.secrets);
        let mut text = String::from_utf8_lossy(&red).into_owned();
        if force_cut || text.len() > self.limits.line_max {
            let mut end = self.limits.line_max.saturating_sub(LINE_TRUNCATED.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push_str(LINE_TRUNCATED);
        }
        // The tail keeps the last lines even past the total limit: a step that fails after
        // the build's log budget is spent still reports why (redacted and cut like any line).
        if self.tail.len() == TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(text.clone());
        if self.truncated {
            return;
        }
        if self.emitted + text.len() + 1 > self.limits.total_max {
            self.truncated = true;
            text = LOG_TRUNCATED.to_string();
        }
        self.emitted += text.len() + 1;
        sink(LogLine {
            step: self.step,
            text,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(limits: LogLimits, secrets: &[&str], chunks: &[&[u8]]) -> (Vec<String>, bool) {
        let secrets: Vec<String> = secrets.iter().map(|s| s.to_string()).collect();
        let mut s = LogShaper::new(3, limits, &secrets);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut |l| {
                assert_eq!(l.step, 3);
                out.push(l.text)
            });
        }
        s.finish(&mut |l| out.push(l.text));
        (out, s.truncated())
    }

    #[test]
    fn lines_across_chunks() {
        let (out, t) = run(
            LogLimits::default(),
            &[],
            &[b"he", b"llo\nwor", b"ld\r\n", b"end"],
        );
        assert_eq!(out, vec!["hello", "world", "end"]);
        assert!(!t);
    }

    #[test]
    fn secrets_redacted_even_split_across_writes() {
        let (out, _) = run(
            LogLimits::default(),
            &["hunter2", "", "hunter2-long"],
            &[b"pw=hunt", b"er2 and hunter2-long!\n"],
        );
        assert_eq!(out, vec!["pw=**** and ****!"]);
    }

    #[test]
    fn long_line_cut_and_secret_at_the_cut_never_leaks() {
        let limits = LogLimits {
            line_max: 64,
            total_max: 1 << 20,
        };
        let mut line = vec![b'a'; 60];
        line.extend_from_slice(b"SECRETVALUE");
        line.extend_from_slice(&[b'b'; 500]);
        line.push(b'\n');
        let (out, _) = run(limits, &["SECRETVALUE"], &[&line, b"next\n"]);
        assert_eq!(out.len(), 2);
        assert!(out[0].len() <= 64, "{}", out[0].len());
        assert!(out[0].ends_with(LINE_TRUNCATED));
        assert!(!out[0].contains("SECRET"));
        assert_eq!(out[1], "next");
    }

    #[test]
    fn total_limit_marker_once() {
        let limits = LogLimits {
            line_max: 4096,
            total_max: 100,
        };
        let data = "0123456789\n".repeat(50);
        let (out, t) = run(limits, &[], &[data.as_bytes()]);
        assert!(t);
        assert_eq!(out.last().unwrap(), LOG_TRUNCATED);
        assert_eq!(out.iter().filter(|l| *l == LOG_TRUNCATED).count(), 1);
        let body: usize = out[..out.len() - 1].iter().map(|l| l.len() + 1).sum();
        assert!(body <= 100);
    }

    /// A step that fails after the build's log budget is spent still reports its last lines
    /// (the error shows them), redacted like any line; the log itself stays cut.
    #[test]
    fn tail_outlives_the_total_limit() {
        let limits = LogLimits {
            line_max: 4096,
            total_max: 100,
        };
        let secrets = vec!["hunter2".to_string()];
        let mut s = LogShaper::new(1, limits, &secrets);
        let mut out = Vec::new();
        s.push("0123456789\n".repeat(50).as_bytes(), &mut |l| {
            out.push(l.text)
        });
        s.push(b"E: Unable to locate package hunter2\n", &mut |l| {
            out.push(l.text)
        });
        s.finish(&mut |l| out.push(l.text));
        assert!(s.truncated());
        assert_eq!(out.last().map(String::as_str), Some(LOG_TRUNCATED));
        assert!(out.iter().all(|l| !l.contains("Unable to locate")));
        let tail = s.tail();
        assert_eq!(tail.len(), TAIL_LINES);
        assert_eq!(
            tail.last().map(String::as_str),
            Some("E: Unable to locate package ****")
        );
    }

    #[test]
    fn secret_pieces_cover_lines() {
        assert_eq!(secret_pieces(b"tok\n"), vec!["tok"]);
        assert_eq!(secret_pieces(b"ab"), vec!["ab"]);
        assert_eq!(
            secret_pieces(b"-----BEGIN-----\r\nAAAA\nx\n-----END-----\n"),
            vec!["-----BEGIN-----", "AAAA", "-----END-----"]
        );
        assert!(secret_pieces(b"\n\n").is_empty());
    }
}
