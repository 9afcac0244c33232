//! [`RecipeError`]: every failure of a front end, located in its source.
//!
//! Display gives `file:line:column: message`, then the source line and a caret under the
//! column, e.g.
//!
//! ```text
//! Dockerfile:3:5: unknown flag --mount-type
//!     3 | RUN --mount-type=cache echo
//!       |     ^
//! ```

use std::fmt;

use crate::dockerfile::instructions::InstructionError;
use crate::dockerfile::lower::LowerError;
use crate::dockerfile::syntax::SyntaxError;
use crate::shell_words::ShellWordsError;
use crate::yaml::YamlError;

/// What went wrong, by module.
#[derive(Debug, thiserror::Error)]
pub enum RecipeErrorKind {
    /// Dockerfile syntax.
    #[error(transparent)]
    Syntax(#[from] SyntaxError),
    /// A Dockerfile instruction's arguments or flags.
    #[error(transparent)]
    Instruction(#[from] InstructionError),
    /// Lowering a Dockerfile (stages, args, unsupported features).
    #[error(transparent)]
    Lower(#[from] LowerError),
    /// Variable substitution.
    #[error(transparent)]
    ShellWords(#[from] ShellWordsError),
    /// The YAML recipe.
    #[error(transparent)]
    Yaml(#[from] YamlError),
    /// The recipe is not UTF-8.
    #[error("recipe is not valid UTF-8")]
    NotUtf8,
    /// The recipe is larger than [`crate::MAX_RECIPE_BYTES`].
    #[error("recipe is {0} bytes; the limit is {max} bytes", max = crate::MAX_RECIPE_BYTES)]
    TooLarge(usize),
    /// A build option given by the caller is invalid (e.g. `--platform`).
    #[error("invalid option: {0}")]
    Option(String),
}

/// A front-end failure with its place in the source.
#[derive(Debug)]
pub struct RecipeError {
    /// The recipe file as the caller named it.
    pub file: String,
    /// 1-based line (0 when the error has no place in the file).
    pub line: usize,
    /// 1-based column in characters (0 when unknown).
    pub column: usize,
    /// The source line the error points at (empty when unknown).
    pub source_line: String,
    /// What went wrong.
    pub kind: RecipeErrorKind,
}

impl RecipeError {
    /// Locates `kind` at byte `offset` of `text`. Offsets past the end point at the end;
    /// an offset inside a UTF-8 character points at that character.
    pub fn at_offset(file: &str, text: &str, offset: usize, kind: RecipeErrorKind) -> Self {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
        let line = text[..offset].matches('\n').count() + 1;
        let column = text[line_start..offset].chars().count() + 1;
        let source_line = text[line_start..line_end]
            .trim_end_matches('\r')
            .to_string();
        RecipeError {
            file: file.to_string(),
            line,
            column,
            source_line,
            kind,
        }
    }

    /// Locates `kind` at a 1-based `line` and `column` (in characters) of `text`.
    pub fn at_line_column(
        file: &str,
        text: &str,
        line: usize,
        column: usize,
        kind: RecipeErrorKind,
    ) -> Self {
        let source_line = if line == 0 {
            String::new()
        } else {
            text.lines()
                .nth(line - 1)
                .unwrap_or("")
                .trim_end_matches('\r')
                .to_string()
        };
        RecipeError {
            file: file.to_string(),
            line,
            column,
            source_line,
            kind,
        }
    }

    /// An error with no place in the file (reported as `file:0:0`).
    pub fn unlocated(file: &str, kind: RecipeErrorKind) -> Self {
        RecipeError {
            file: file.to_string(),
            line: 0,
            column: 0,
            source_line: String::new(),
            kind,
        }
    }
}

impl fmt::Display for RecipeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.column, self.kind
        )?;
        if self.line > 0 {
            let number = self.line.to_string();
            let pad = " ".repeat(number.len());
            // Tabs before the caret are kept so the caret lines up in a terminal.
            let lead: String = self
                .source_line
                .chars()
                .take(self.column.saturating_sub(1))
                .map(|c| if c == '\t' { '\t' } else { ' ' })
                .collect();
            write!(f, "\n {number} | {}\n {pad} | {lead}^", self.source_line)?;
        }
        Ok(())
    }
}

impl std::error::Error for RecipeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.kind)
    }
}

/// An error kind and the byte offset it belongs at, inside the front ends.
#[derive(Debug)]
pub(crate) struct Fault {
    pub(crate) offset: usize,
    pub(crate) kind: RecipeErrorKind,
}

impl Fault {
    pub(crate) fn new(offset: usize, kind: impl Into<RecipeErrorKind>) -> Self {
        Fault {
            offset,
            kind: kind.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_has_location_and_caret() {
        let text = "FROM x\nRUN --bogus echo\n";
        let err = RecipeError::at_offset(
            "Dockerfile",
            text,
            11,
            RecipeErrorKind::Option("bad".into()),
        );
        assert_eq!(err.line, 2);
        assert_eq!(err.column, 5);
        assert_eq!(
            err.to_string(),
            "Dockerfile:2:5: invalid option: bad\n 2 | RUN --bogus echo\n   |     ^"
        );
    }

    #[test]
    fn offsets_past_end_and_inside_chars_are_clamped() {
        let text = "é\n";
        let err = RecipeError::at_offset("f", text, 1, RecipeErrorKind::NotUtf8);
        assert_eq!((err.line, err.column), (1, 1));
        let err = RecipeError::at_offset("f", text, 99, RecipeErrorKind::NotUtf8);
        assert_eq!(err.line, 2);
    }
}
