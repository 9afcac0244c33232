//! Typed Dockerfile instructions (BuildKit's `frontend/dockerfile/instructions`): each
//! parse-dockerfile instruction becomes an [`Instr`] with its flags checked and its
//! arguments split, but nothing substituted yet (that depends on the ARG/ENV state at the
//! instruction, which [`super::lower`] tracks).

use std::ops::Range;

use parse_dockerfile::{Command, Flag, HealthcheckArguments, Instruction, JsonOrStringArray};

use super::syntax::{Parsed, RunHeredoc, join_continuations};
use crate::error::Fault;
use crate::shell_words::split_words;

/// A malformed instruction.
#[derive(Debug, thiserror::Error)]
pub enum InstructionError {
    /// A flag the instruction does not take.
    #[error("unknown flag --{flag} for {instruction}")]
    UnknownFlag {
        /// The instruction.
        instruction: &'static str,
        /// The flag name.
        flag: String,
    },
    /// A flag that needs a value was given none.
    #[error("flag --{0} needs a value")]
    MissingFlagValue(String),
    /// A boolean flag with a value other than true/false.
    #[error("flag --{flag} expects true or false, got '{value}'")]
    BadBool {
        /// The flag.
        flag: String,
        /// What was given.
        value: String,
    },
    /// A flag given twice that may appear once.
    #[error("flag --{0} given more than once")]
    DuplicateFlag(String),
    /// `ENV`/`LABEL`/`ARG` argument shapes.
    #[error("{0}")]
    Arguments(String),
    /// `ONBUILD` with an instruction it cannot trigger.
    #[error("{0} is not allowed as an ONBUILD trigger")]
    BadOnbuild(&'static str),
}

/// A command as written: shell form (continuations joined) or exec form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandLine {
    /// Shell form.
    Shell(String),
    /// Exec form (JSON array).
    Exec(Vec<String>),
}

/// One `COPY`/`ADD` source, unsubstituted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceArg {
    /// A path, URL or git address.
    Path(String),
    /// A heredoc: file name (the delimiter), content (tabs stripped for `<<-`), expand.
    Heredoc {
        /// Delimiter, used as the file name.
        name: String,
        /// Content.
        data: String,
        /// `false` when the delimiter was quoted.
        expand: bool,
    },
}

/// `COPY`/`ADD` arguments and flags, unsubstituted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyArgs {
    /// `--from`.
    pub from: Option<String>,
    /// `--chown`.
    pub chown: Option<String>,
    /// `--chmod`.
    pub chmod: Option<String>,
    /// `--link`.
    pub link: bool,
    /// `--parents`.
    pub parents: bool,
    /// `--exclude` (repeatable).
    pub exclude: Vec<String>,
    /// `--checksum` (ADD).
    pub checksum: Option<String>,
    /// `--keep-git-dir` (ADD).
    pub keep_git_dir: bool,
    /// `--unpack` (ADD), when given.
    pub unpack: Option<bool>,
    /// Sources.
    pub sources: Vec<SourceArg>,
    /// Destination.
    pub dest: String,
}

/// `HEALTHCHECK` arguments, unparsed durations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthcheckArgs {
    /// `--interval`.
    pub interval: Option<String>,
    /// `--timeout`.
    pub timeout: Option<String>,
    /// `--start-period`.
    pub start_period: Option<String>,
    /// `--start-interval`.
    pub start_interval: Option<String>,
    /// `--retries`.
    pub retries: Option<String>,
    /// The command; `None` for `HEALTHCHECK NONE`.
    pub test: Option<CommandLine>,
}

/// A typed instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstrKind {
    /// `FROM [--platform=P] image [AS name]`.
    From {
        /// `--platform`.
        platform: Option<String>,
        /// Image, `scratch` or a stage name.
        image: String,
        /// `AS name`.
        name: Option<String>,
    },
    /// `ARG name[=value] ...`: raw words (quotes kept).
    Arg(Vec<(String, Option<String>)>),
    /// `ENV`: raw key and value words.
    Env(Vec<(String, String)>),
    /// `LABEL`: raw key and value words.
    Label(Vec<(String, String)>),
    /// `MAINTAINER name`.
    Maintainer(String),
    /// `RUN`.
    Run {
        /// `--mount` values, raw.
        mounts: Vec<(String, usize)>,
        /// `--network`.
        network: Option<String>,
        /// `--security`.
        security: Option<String>,
        /// The command.
        command: CommandLine,
        /// Heredocs.
        heredocs: Vec<RunHeredoc>,
    },
    /// `CMD`.
    Cmd(CommandLine),
    /// `ENTRYPOINT`.
    Entrypoint(CommandLine),
    /// `COPY`.
    Copy(CopyArgs),
    /// `ADD`.
    Add(CopyArgs),
    /// `EXPOSE`.
    Expose(Vec<String>),
    /// `VOLUME`.
    Volume(Vec<String>),
    /// `USER`.
    User(String),
    /// `WORKDIR`.
    Workdir(String),
    /// `STOPSIGNAL`.
    Stopsignal(String),
    /// `HEALTHCHECK`.
    Healthcheck(HealthcheckArgs),
    /// `SHELL`.
    Shell(Vec<String>),
    /// `ONBUILD`: the trigger text as written (after `ONBUILD `), and the parsed trigger.
    Onbuild {
        /// Text of the trigger, continuations joined.
        trigger: String,
        /// The trigger instruction.
        inner: Box<Instr>,
    },
}

/// A typed instruction with its byte range in the Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instr {
    /// From the keyword to the end of its last argument or heredoc.
    pub span: Range<usize>,
    /// The instruction.
    pub kind: InstrKind,
}

/// Converts every parsed instruction, in order.
pub(crate) fn convert_all(parsed: &Parsed<'_>, original: &str) -> Result<Vec<Instr>, Fault> {
    parsed
        .dockerfile
        .instructions
        .iter()
        .map(|i| convert(parsed, original, i))
        .collect()
}

struct FlagSet<'f, 'a> {
    instruction: &'static str,
    flags: &'f [Flag<'a>],
    allowed: &'static [&'static str],
}

impl FlagSet<'_, '_> {
    fn check(&self) -> Result<(), Fault> {
        for f in self.flags {
            if !self.allowed.contains(&f.name.value.as_ref()) {
                return Err(Fault::new(
                    f.span().start,
                    InstructionError::UnknownFlag {
                        instruction: self.instruction,
                        flag: f.name.value.to_string(),
                    },
                ));
            }
        }
        Ok(())
    }

    fn all(&self, name: &str) -> Vec<(String, usize)> {
        self.flags
            .iter()
            .filter(|f| f.name.value == name)
            .map(|f| {
                (
                    f.value
                        .as_ref()
                        .map(|v| v.value.to_string())
                        .unwrap_or_default(),
                    f.span().start,
                )
            })
            .collect()
    }

    fn one(&self, name: &str) -> Result<Option<String>, Fault> {
        let mut found = None;
        for f in self.flags.iter().filter(|f| f.name.value == name) {
            if found.is_some() {
                return Err(Fault::new(
                    f.span().start,
                    InstructionError::DuplicateFlag(name.into()),
                ));
            }
            match &f.value {
                Some(v) => found = Some(v.value.to_string()),
                None => {
                    return Err(Fault::new(
                        f.span().start,
                        InstructionError::MissingFlagValue(name.into()),
                    ));
                }
            }
        }
        Ok(found)
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>, Fault> {
        let mut found = None;
        for f in self.flags.iter().filter(|f| f.name.value == name) {
            if found.is_some() {
                return Err(Fault::new(
                    f.span().start,
                    InstructionError::DuplicateFlag(name.into()),
                ));
            }
            found = Some(match f.value.as_ref().map(|v| v.value.as_ref()) {
                None | Some("true") => true,
                Some("false") => false,
                Some(other) => {
                    return Err(Fault::new(
                        f.span().start,
                        InstructionError::BadBool {
                            flag: name.into(),
                            value: other.into(),
                        },
                    ));
                }
            });
        }
        Ok(found)
    }
}

fn command_line(cmd: &Command<'_>, original: &str, escape: char) -> CommandLine {
    match cmd {
        Command::Exec(v) => {
            CommandLine::Exec(v.value.iter().map(|s| s.value.to_string()).collect())
        }
        Command::Shell(s) => {
            let raw = original.get(s.span.clone()).unwrap_or(s.value);
            if raw.trim() == "[]" {
                // `ENTRYPOINT []`, which the syntax layer hid from parse-dockerfile.
                return CommandLine::Exec(Vec::new());
            }
            CommandLine::Shell(join_continuations(raw, escape))
        }
        _ => CommandLine::Shell(String::new()),
    }
}

fn command_end(cmd: &Command<'_>) -> usize {
    match cmd {
        Command::Exec(v) => v.span.end,
        Command::Shell(s) => s.span.end,
        _ => 0,
    }
}

/// BuildKit's `parseNameVal`: `KEY value` (old form, one pair) or `K=V K2=V2`.
fn name_values(
    raw: &str,
    escape: char,
    what: &str,
    offset: usize,
) -> Result<Vec<(String, String)>, Fault> {
    let words = split_words(raw, escape);
    let Some(first) = words.first() else {
        return Err(Fault::new(
            offset,
            InstructionError::Arguments(format!("{what} requires at least one argument")),
        ));
    };
    if !first.contains('=') {
        let trimmed = raw.trim_start();
        let mut parts = trimmed.splitn(2, char::is_whitespace);
        let key = parts.next().unwrap_or_default().to_string();
        let value = parts.next().map(str::trim_start).unwrap_or_default();
        if value.is_empty() {
            return Err(Fault::new(
                offset,
                InstructionError::Arguments(format!("{what} must have two arguments")),
            ));
        }
        return Ok(vec![(key, value.to_string())]);
    }
    words
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => Ok((k.to_string(), v.to_string())),
            None => Err(Fault::new(
                offset,
                InstructionError::Arguments(format!(
                    "syntax error - can't find = in \"{w}\"; must be of the form: name=value"
                )),
            )),
        })
        .collect()
}

fn span_end(i: &Instruction<'_>, parsed: &Parsed<'_>) -> usize {
    match i {
        Instruction::Add(a) => a
            .dest
            .span
            .end
            .max(heredoc_end(&a.src))
            .max(body_end(parsed, a.add.span.start)),
        Instruction::Copy(a) => a
            .dest
            .span
            .end
            .max(heredoc_end(&a.src))
            .max(body_end(parsed, a.copy.span.start)),
        Instruction::Arg(a) => a.arguments.span.end,
        Instruction::Cmd(c) => command_end(&c.arguments),
        Instruction::Entrypoint(c) => command_end(&c.arguments),
        Instruction::Env(e) => e.arguments.span.end,
        Instruction::Expose(e) => e.arguments.last().map_or(e.expose.span.end, |a| a.span.end),
        Instruction::From(f) => f.as_.as_ref().map_or(f.image.span.end, |(_, n)| n.span.end),
        Instruction::Healthcheck(h) => match &h.arguments {
            HealthcheckArguments::Cmd { arguments, .. } => command_end(arguments),
            HealthcheckArguments::None { none, .. } => none.span.end,
            _ => h.healthcheck.span.end,
        },
        Instruction::Label(l) => l.arguments.span.end,
        Instruction::Maintainer(m) => m.name.span.end,
        Instruction::Onbuild(o) => span_end(&o.instruction, parsed),
        Instruction::Run(r) => {
            let docs = parsed.heredocs_at(r.run.span.start);
            let body = docs.iter().map(|d| d.body.end).max().unwrap_or(0);
            let own = r.here_docs.iter().map(|d| d.span.end).max().unwrap_or(0);
            command_end(&r.arguments).max(body).max(own)
        }
        Instruction::Shell(s) => s
            .arguments
            .last()
            .map_or(s.shell.span.end, |a| a.span.end + 1),
        Instruction::Stopsignal(s) => s.arguments.span.end,
        Instruction::User(u) => u.arguments.span.end,
        Instruction::Volume(v) => match &v.arguments {
            JsonOrStringArray::Json(j) => j.span.end,
            JsonOrStringArray::String(s) => s.last().map_or(v.volume.span.end, |a| a.span.end),
        },
        Instruction::Workdir(w) => w.arguments.span.end,
        _ => 0,
    }
}

/// End of the last heredoc body (terminator line included) of the instruction at `keyword`.
fn body_end(parsed: &Parsed<'_>, keyword: usize) -> usize {
    parsed
        .heredocs_at(keyword)
        .iter()
        .map(|d| d.body.end)
        .max()
        .unwrap_or(0)
}

fn heredoc_end(src: &[parse_dockerfile::Source<'_>]) -> usize {
    src.iter()
        .map(|s| match s {
            parse_dockerfile::Source::HereDoc(h) => h.span.end,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}

fn keyword_start(i: &Instruction<'_>) -> usize {
    match i {
        Instruction::Add(x) => x.add.span.start,
        Instruction::Arg(x) => x.arg.span.start,
        Instruction::Cmd(x) => x.cmd.span.start,
        Instruction::Copy(x) => x.copy.span.start,
        Instruction::Entrypoint(x) => x.entrypoint.span.start,
        Instruction::Env(x) => x.env.span.start,
        Instruction::Expose(x) => x.expose.span.start,
        Instruction::From(x) => x.from.span.start,
        Instruction::Healthcheck(x) => x.healthcheck.span.start,
        Instruction::Label(x) => x.label.span.start,
        Instruction::Maintainer(x) => x.maintainer.span.start,
        Instruction::Onbuild(x) => x.onbuild.span.start,
        Instruction::Run(x) => x.run.span.start,
        Instruction::Shell(x) => x.shell.span.start,
        Instruction::Stopsignal(x) => x.stopsignal.span.start,
        Instruction::User(x) => x.user.span.start,
        Instruction::Volume(x) => x.volume.span.start,
        Instruction::Workdir(x) => x.workdir.span.start,
        _ => 0,
    }
}

fn copy_args(
    instruction: &'static str,
    options: &[Flag<'_>],
    src: &[parse_dockerfile::Source<'_>],
    dest: &str,
    heredocs: &[RunHeredoc],
) -> Result<CopyArgs, Fault> {
    let is_add = instruction == "ADD";
    let flags = FlagSet {
        instruction,
        flags: options,
        allowed: if is_add {
            &[
                "chown",
                "chmod",
                "link",
                "exclude",
                "checksum",
                "keep-git-dir",
                "unpack",
            ]
        } else {
            &["from", "chown", "chmod", "link", "parents", "exclude"]
        },
    };
    flags.check()?;
    let mut docs = heredocs.iter();
    let sources = src
        .iter()
        .map(|s| match s {
            parse_dockerfile::Source::Path(p) => SourceArg::Path(p.value.to_string()),
            parse_dockerfile::Source::HereDoc(h) => {
                let name = docs
                    .next()
                    .map_or_else(|| "EOF".to_string(), |d| d.name.clone());
                SourceArg::Heredoc {
                    name,
                    // Lines end in `\n` only, as BuildKit's line scanner leaves them.
                    data: h.value.replace("\r\n", "\n"),
                    expand: h.expand,
                }
            }
            _ => SourceArg::Path(String::new()),
        })
        .collect();
    Ok(CopyArgs {
        from: flags.one("from")?,
        chown: flags.one("chown")?,
        chmod: flags.one("chmod")?,
        link: flags.boolean("link")?.unwrap_or(false),
        parents: flags.boolean("parents")?.unwrap_or(false),
        exclude: flags.all("exclude").into_iter().map(|(v, _)| v).collect(),
        checksum: flags.one("checksum")?,
        keep_git_dir: flags.boolean("keep-git-dir")?.unwrap_or(false),
        unpack: flags.boolean("unpack")?,
        sources,
        dest: dest.to_string(),
    })
}

/// Converts one parsed instruction.
pub(crate) fn convert(
    parsed: &Parsed<'_>,
    original: &str,
    i: &Instruction<'_>,
) -> Result<Instr, Fault> {
    let escape = parsed.escape;
    let start = keyword_start(i);
    let span = start..span_end(i, parsed).max(start);
    let kind = match i {
        Instruction::From(f) => {
            let flags = FlagSet {
                instruction: "FROM",
                flags: &f.options,
                allowed: &["platform"],
            };
            flags.check()?;
            InstrKind::From {
                platform: flags.one("platform")?,
                image: f.image.value.to_string(),
                name: f.as_.as_ref().map(|(_, n)| n.value.to_string()),
            }
        }
        Instruction::Arg(a) => {
            let words = split_words(&a.arguments.value, escape);
            if words.is_empty() {
                return Err(Fault::new(
                    start,
                    InstructionError::Arguments("ARG requires at least one argument".into()),
                ));
            }
            InstrKind::Arg(
                words
                    .into_iter()
                    .map(|w| match w.split_once('=') {
                        Some((k, v)) => (k.to_string(), Some(v.to_string())),
                        None => (w, None),
                    })
                    .collect(),
            )
        }
        Instruction::Env(e) => InstrKind::Env(name_values(
            &e.arguments.value,
            escape,
            "ENV",
            e.arguments.span.start,
        )?),
        Instruction::Label(l) => InstrKind::Label(name_values(
            &l.arguments.value,
            escape,
            "LABEL",
            l.arguments.span.start,
        )?),
        Instruction::Maintainer(m) => InstrKind::Maintainer(m.name.value.to_string()),
        Instruction::Run(r) => {
            let flags = FlagSet {
                instruction: "RUN",
                flags: &r.options,
                allowed: &["mount", "network", "security"],
            };
            flags.check()?;
            let mut heredocs = parsed.heredocs_at(r.run.span.start).to_vec();
            if heredocs.is_empty() {
                // Only reachable for text parse-dockerfile saw unmasked (ONBUILD triggers).
                heredocs = r
                    .here_docs
                    .iter()
                    .map(|h| RunHeredoc {
                        name: "EOF".into(),
                        raw: h.value.to_string(),
                        chomp: false,
                        expand: h.expand,
                        marker: h.span.clone(),
                        body: h.span.clone(),
                    })
                    .collect();
            }
            InstrKind::Run {
                mounts: flags.all("mount"),
                network: flags.one("network")?,
                security: flags.one("security")?,
                command: command_line(&r.arguments, original, escape),
                heredocs,
            }
        }
        Instruction::Cmd(c) => InstrKind::Cmd(command_line(&c.arguments, original, escape)),
        Instruction::Entrypoint(c) => {
            InstrKind::Entrypoint(command_line(&c.arguments, original, escape))
        }
        Instruction::Copy(c) => InstrKind::Copy(copy_args(
            "COPY",
            &c.options,
            &c.src,
            &c.dest.value,
            parsed.heredocs_at(c.copy.span.start),
        )?),
        Instruction::Add(c) => InstrKind::Add(copy_args(
            "ADD",
            &c.options,
            &c.src,
            &c.dest.value,
            parsed.heredocs_at(c.add.span.start),
        )?),
        Instruction::Expose(e) => {
            InstrKind::Expose(e.arguments.iter().map(|a| a.value.to_string()).collect())
        }
        Instruction::Volume(v) => InstrKind::Volume(match &v.arguments {
            JsonOrStringArray::Json(j) => j.value.iter().map(|a| a.value.to_string()).collect(),
            JsonOrStringArray::String(s) => s.iter().map(|a| a.value.to_string()).collect(),
        }),
        Instruction::User(u) => InstrKind::User(u.arguments.value.to_string()),
        Instruction::Workdir(w) => InstrKind::Workdir(w.arguments.value.to_string()),
        Instruction::Stopsignal(s) => InstrKind::Stopsignal(s.arguments.value.to_string()),
        Instruction::Healthcheck(h) => {
            let flags = FlagSet {
                instruction: "HEALTHCHECK",
                flags: &h.options,
                allowed: &[
                    "interval",
                    "timeout",
                    "start-period",
                    "start-interval",
                    "retries",
                ],
            };
            flags.check()?;
            InstrKind::Healthcheck(HealthcheckArgs {
                interval: flags.one("interval")?,
                timeout: flags.one("timeout")?,
                start_period: flags.one("start-period")?,
                start_interval: flags.one("start-interval")?,
                retries: flags.one("retries")?,
                test: match &h.arguments {
                    HealthcheckArguments::Cmd { arguments, .. } => {
                        Some(command_line(arguments, original, escape))
                    }
                    _ => None,
                },
            })
        }
        Instruction::Shell(s) => {
            InstrKind::Shell(s.arguments.iter().map(|a| a.value.to_string()).collect())
        }
        Instruction::Onbuild(o) => {
            let inner = convert(parsed, original, &o.instruction)?;
            match &inner.kind {
                InstrKind::From { .. } => {
                    return Err(Fault::new(start, InstructionError::BadOnbuild("FROM")));
                }
                InstrKind::Maintainer(_) => {
                    return Err(Fault::new(
                        start,
                        InstructionError::BadOnbuild("MAINTAINER"),
                    ));
                }
                InstrKind::Onbuild { .. } => {
                    return Err(Fault::new(start, InstructionError::BadOnbuild("ONBUILD")));
                }
                _ => {}
            }
            let raw = original.get(inner.span.clone()).unwrap_or_default();
            InstrKind::Onbuild {
                trigger: join_continuations(raw, escape),
                inner: Box::new(inner),
            }
        }
        _ => {
            return Err(Fault::new(
                start,
                InstructionError::Arguments("instruction not supported".into()),
            ));
        }
    };
    Ok(Instr { span, kind })
}
