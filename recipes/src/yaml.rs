//! The kiln YAML recipe: a short, strict alternative to a Dockerfile for one-stage images.
//!
//! ```yaml
//! from: debian:bookworm            # image reference, `scratch`, or {bootstrap: {...}}
//! args:                            # build args with defaults (like ARG); --build-arg overrides
//!   NODE_MAJOR: "24"
//! files:                           # copied from the build context before any command runs
//!   - {src: app/, dest: /srv/app/, owner: "1000:1000", mode: "0755"}
//! env:                             # image env; also set for every command and for start
//!   LANG: C.UTF-8
//! commands:                        # run in order, as root, in `/`; one step (layer) each
//!   - apt-get update && apt-get install -y curl     # a string runs under /bin/sh -c
//!   - ["/usr/bin/env", "true"]                      # a list is an argv
//! user: runtime                    # image user (commands still run as root)
//! workdir: /workspace              # image working directory, created after the commands
//! labels: {org.example.team: sandbox}
//! start:                           # the sandbox start command
//!   command: ["/usr/bin/server", "--port", "8080"]
//!   user: runtime                  # optional: override user / env / workdir for start only
//!   env: {PORT: "8080"}
//!   workdir: /srv
//! ready:                           # ready check after start (default interval 30s, timeout 30s, retries 3)
//!   command: curl -fs localhost:8080/health
//!   interval: 2s
//!   timeout: 10s
//!   retries: 30
//! disk_mib: 4096                   # sandbox disk size, MiB
//! network: none                    # network during commands: default | none | {allow, deny}
//! # network: {allow: [pypi.example, "*.debian.example", 192.0.2.0/24], deny: [bad.debian.example]}
//! limits: {timeout: 10m, memory: 512MiB}   # may only lower the 15 min / 1 GiB defaults
//! smoke:                           # checks `kiln nightly` runs in a clone before it promotes
//!   - command: python3 --version   # string: /bin/sh -c; list: argv
//!     output: "Python 3"           # optional: a substring of stdout + stderr
//!   - {command: ["sudo", "-n", "true"], exit: 0}   # exit: expected code (default 0)
//! ```
//!
//! Unknown keys are errors. Values are taken literally: no `$VAR` substitution (commands
//! are run by the shell, which expands them itself, with `args` and `env` set).
//!
//! A recipe lowers exactly as this Dockerfile would (see the tests): `FROM`, one `ARG` per
//! arg, one `COPY` per file, `ENV`, one `RUN` per command, `USER`, `WORKDIR`, `LABEL`s,
//! `LABEL kiln.disk-mib`, `HEALTHCHECK` for `ready`, `CMD` for `start`. `smoke:` is not
//! part of the image: [`smoke_checks`] reads it for the nightly job.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_saphyr::Spanned;

use crate::dockerfile::instructions::{
    CommandLine, CopyArgs, HealthcheckArgs, Instr, InstrKind, SourceArg,
};
use crate::dockerfile::lower::{
    DISK_LABEL, SourceText, lower_instrs, parse_duration_ms, parse_size, valid_chmod,
};
use crate::plan::{
    Action, Base, Bootstrap, BuildPlan, DEFAULT_MEMORY_MIB, DEFAULT_TIMEOUT_SECS, Directives,
    Egress, EgressRule, Frontend, Limits, Network,
};
use crate::{Options, RecipeError, RecipeErrorKind};

/// A recipe that does not fit the schema.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Not YAML, or not the schema (unknown key, wrong type, missing `from`).
    #[error("{0}")]
    Schema(String),
    /// An empty command (`""` or `[]`).
    #[error("a command may not be empty")]
    EmptyCommand,
    /// `mode` that is neither octal nor symbolic.
    #[error("invalid mode '{0}': expected octal (\"0755\") or symbolic (\"u+x\")")]
    Mode(String),
    /// A duration that does not parse.
    #[error("invalid duration '{0}': expected e.g. 30s, 5m, 1h30m")]
    Duration(String),
    /// A memory size that does not parse.
    #[error("invalid memory size '{0}': expected e.g. 512MiB, 1GiB")]
    Memory(String),
    /// A limit above the default.
    #[error("limits may only lower the defaults: {0}")]
    LimitTooHigh(String),
    /// `disk_mib: 0`.
    #[error("disk_mib must be a positive number of MiB")]
    Disk,
    /// Empty `from`, `src`, `dest` or similar.
    #[error("{0} may not be empty")]
    Empty(&'static str),
    /// An empty `env`, `labels` or `args` key.
    #[error("{0} names can not be blank")]
    BlankName(&'static str),
    /// A `network: {allow, deny}` entry that does not parse.
    #[error("network {0} entry {1}")]
    Egress(&'static str, String),
    /// An `env` or `args` name with `=` in it.
    #[error("{0} name '{1}' may not contain '='")]
    NameWithEquals(&'static str, String),
}

/// The recipe document. See the module documentation for the meaning of each key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Base: image reference, `scratch`, or a bootstrap spec.
    pub from: Spanned<FromSpec>,
    /// Build args with defaults.
    pub args: Option<Spanned<BTreeMap<String, String>>>,
    /// Files copied from the context before the commands.
    #[serde(default)]
    pub files: Vec<Spanned<FileSpec>>,
    /// Image env, also set for commands and start.
    pub env: Option<Spanned<BTreeMap<String, String>>>,
    /// Commands run at build time as root.
    #[serde(default)]
    pub commands: Vec<Spanned<CommandSpec>>,
    /// Image user.
    pub user: Option<Spanned<String>>,
    /// Image working directory.
    pub workdir: Option<Spanned<String>>,
    /// Image labels.
    pub labels: Option<Spanned<BTreeMap<String, String>>>,
    /// Start command.
    pub start: Option<Spanned<StartSpec>>,
    /// Ready check.
    pub ready: Option<Spanned<ReadySpec>>,
    /// Disk size, MiB.
    pub disk_mib: Option<Spanned<u64>>,
    /// Network during the commands.
    pub network: Option<Spanned<NetworkSpec>>,
    /// Build limits.
    pub limits: Option<Spanned<LimitsSpec>>,
    /// Smoke checks run in a clone by the nightly job (not part of the image).
    #[serde(default)]
    pub smoke: Vec<Spanned<SmokeSpec>>,
}

/// One entry of `smoke:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SmokeSpec {
    /// The command: a string runs under `/bin/sh -c`, a list is an argv.
    pub command: CommandSpec,
    /// The exit code it must end with (default 0).
    #[serde(default)]
    pub exit: i32,
    /// A substring its stdout or stderr must contain.
    pub output: Option<String>,
}

/// A smoke check as the nightly job runs it: [`SmokeSpec`] checked and located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmokeCheck {
    /// `file:line` of the entry, to name the check in reports.
    pub location: String,
    /// The argv (a shell string becomes `["/bin/sh", "-c", string]`).
    pub argv: Vec<String>,
    /// The exit code expected.
    pub exit: i32,
    /// A substring of stdout + stderr expected, when given.
    pub output: Option<String>,
}

/// The `smoke:` checks of the YAML recipe `text` named `file`, in order (none when the key
/// is absent). Errors: the recipe does not parse, or a check's command is empty.
pub fn smoke_checks(file: &str, text: &str) -> Result<Vec<SmokeCheck>, RecipeError> {
    let ctx = Ctx { file, text };
    let recipe = parse(file, text)?;
    let mut out = Vec::with_capacity(recipe.smoke.len());
    for s in &recipe.smoke {
        let at = ctx.at(s);
        let argv = match command_line(&s.value.command).map_err(|e| ctx.err(at, e))? {
            CommandLine::Shell(c) => vec!["/bin/sh".to_string(), "-c".to_string(), c],
            CommandLine::Exec(v) => v,
        };
        out.push(SmokeCheck {
            location: format!("{file}:{}", s.referenced.line()),
            argv,
            exit: s.value.exit,
            output: s.value.output.clone(),
        });
    }
    Ok(out)
}

/// `from:`: a string (image reference or `scratch`) or `{bootstrap: {...}}`.
#[derive(Debug)]
pub enum FromSpec {
    /// An image reference or `scratch`.
    Image(String),
    /// `{bootstrap: {...}}`.
    Bootstrap {
        /// The debootstrap spec.
        bootstrap: BootstrapSpec,
    },
}

/// `from: {bootstrap: ...}`: a debootstrap root filesystem (built by a later issue).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootstrapSpec {
    /// `debian` or `ubuntu`.
    pub distro: String,
    /// Suite, e.g. `bookworm`.
    pub suite: String,
    /// Mirror URL.
    pub mirror: Option<String>,
    /// debootstrap variant, e.g. `minbase`.
    pub variant: Option<String>,
    /// Extra packages.
    #[serde(default)]
    pub include: Vec<String>,
}

/// A command: a shell string or an argv list.
#[derive(Debug, Clone)]
pub enum CommandSpec {
    /// Run by `/bin/sh -c`.
    Shell(String),
    /// Run directly.
    Exec(Vec<String>),
}

/// One entry of `files:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    /// Path in the build context (a trailing `/` copies a directory's contents).
    pub src: String,
    /// Destination in the image (absolute; a trailing `/` means "into this directory").
    pub dest: String,
    /// `user[:group]` owning the copied files.
    pub owner: Option<String>,
    /// Mode as a string: octal (`"0755"`) or symbolic (`"u+x"`).
    pub mode: Option<String>,
}

/// `start:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartSpec {
    /// The command.
    pub command: CommandSpec,
    /// User for the start command (default: the image user).
    pub user: Option<String>,
    /// Extra env for the start command (added to the image env).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory for the start command (default: the image's).
    pub workdir: Option<String>,
}

/// `ready:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadySpec {
    /// The check; exit 0 means ready.
    pub command: CommandSpec,
    /// Interval between checks (Go-style duration, e.g. `2s`).
    pub interval: Option<String>,
    /// Timeout of one check.
    pub timeout: Option<String>,
    /// Failures tolerated.
    pub retries: Option<u32>,
}

/// `network:`: `default`, `none`, or `{allow: [...], deny: [...]}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetworkSpec {
    /// The builder's default.
    Default,
    /// No network during commands.
    None,
    /// Only the destinations allowed, through the builder's egress proxy.
    Allow(AllowSpec),
}

/// `network: {allow: [...], deny: [...]}`: entries as [`crate::plan::EgressRule::parse`]
/// reads them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowSpec {
    /// Destinations allowed.
    pub allow: Vec<String>,
    /// Destinations refused even when allowed (deny wins).
    #[serde(default)]
    pub deny: Vec<String>,
}

/// `limits:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// Build timeout (duration, at most 15m).
    pub timeout: Option<String>,
    /// Memory (`512MiB`, `1GiB`; a bare number is MiB; at most 1 GiB).
    pub memory: Option<MemorySpec>,
}

/// A memory size: a string with a unit or a number of MiB.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MemorySpec {
    /// MiB.
    Mib(u64),
    /// With a unit.
    Text(String),
}

// Hand-written visitors instead of `#[serde(untagged)]`, so that a mistake inside a
// bootstrap spec or a command gets a precise message and location.
impl<'de> Deserialize<'de> for FromSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = FromSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an image reference, `scratch`, or {bootstrap: {distro, suite, ...}}")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FromSpec, E> {
                Ok(FromSpec::Image(v.to_string()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<FromSpec, A::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Wrapper {
                    bootstrap: BootstrapSpec,
                }
                let w = Wrapper::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(FromSpec::Bootstrap {
                    bootstrap: w.bootstrap,
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for NetworkSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = NetworkSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("default, none, or {allow: [...], deny: [...]}")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NetworkSpec, E> {
                match v {
                    "default" => Ok(NetworkSpec::Default),
                    "none" => Ok(NetworkSpec::None),
                    other => Err(E::custom(format!(
                        "network '{other}': expected default, none, or {{allow: [...], deny: [...]}}"
                    ))),
                }
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<NetworkSpec, A::Error> {
                AllowSpec::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(NetworkSpec::Allow)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for CommandSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = CommandSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a shell command string or an argv list of strings")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<CommandSpec, E> {
                Ok(CommandSpec::Shell(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<CommandSpec, A::Error> {
                let v =
                    Vec::<String>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
                Ok(CommandSpec::Exec(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// Single-quotes `s` for the substitution layer so it comes out literally.
/// Whether a `USER` value (`user[:group]`) names root, by name or id.
fn is_root_user(u: &str) -> bool {
    let user = u.split(':').next().unwrap_or(u);
    user.is_empty() || user == "root" || user == "0"
}

fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Byte offset of a 1-based line and character column.
fn offset_of(text: &str, line: u64, column: u64) -> usize {
    if line == 0 {
        return 0;
    }
    let mut offset = 0;
    for (i, l) in text.split_inclusive('\n').enumerate() {
        if i as u64 + 1 == line {
            let col = l
                .char_indices()
                .nth(column.saturating_sub(1) as usize)
                .map_or(l.len(), |(b, _)| b);
            return offset + col;
        }
        offset += l.len();
    }
    text.len()
}

/// Byte offset of `key` in the block mapping starting at `map_at`, or `map_at` when the
/// key cannot be found on its own line (flow mappings, odd quoting).
fn key_offset(text: &str, map_at: usize, key: &str) -> usize {
    let line_start = text[..map_at.min(text.len())]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let mut offset = line_start;
    for line in text[line_start..].split_inclusive('\n') {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        for candidate in [
            format!("{key}:"),
            format!("\"{key}\":"),
            format!("'{key}':"),
        ] {
            if trimmed.starts_with(&candidate) {
                return offset + indent;
            }
        }
        offset += line.len();
    }
    map_at
}

/// Checks the names of an `env`/`labels`/`args` map.
fn check_names(
    ctx: &Ctx<'_>,
    map: &Spanned<BTreeMap<String, String>>,
    what: &'static str,
    key_name: Option<&'static str>,
) -> Result<(), RecipeError> {
    let at = ctx.at(map);
    for key in map.value.keys() {
        if key.trim().is_empty() {
            return Err(ctx.err(key_offset(ctx.text, at, key), YamlError::BlankName(what)));
        }
        if let Some(key_name) = key_name
            && key.contains('=')
        {
            return Err(ctx.err(
                key_offset(ctx.text, at, key),
                YamlError::NameWithEquals(key_name, key.clone()),
            ));
        }
    }
    Ok(())
}

struct Ctx<'a> {
    file: &'a str,
    text: &'a str,
}

impl Ctx<'_> {
    fn at<T>(&self, s: &Spanned<T>) -> usize {
        offset_of(self.text, s.referenced.line(), s.referenced.column())
    }

    fn err(&self, offset: usize, e: YamlError) -> RecipeError {
        RecipeError::at_offset(self.file, self.text, offset, RecipeErrorKind::Yaml(e))
    }
}

fn command_line(c: &CommandSpec) -> Result<CommandLine, YamlError> {
    match c {
        CommandSpec::Shell(s) if s.trim().is_empty() => Err(YamlError::EmptyCommand),
        CommandSpec::Exec(v) if v.is_empty() => Err(YamlError::EmptyCommand),
        CommandSpec::Shell(s) => Ok(CommandLine::Shell(s.clone())),
        CommandSpec::Exec(v) => Ok(CommandLine::Exec(v.clone())),
    }
}

/// Strips serde-saphyr's " at line N column M" suffix (the location is reported our way)
/// and rewords its messages that give advice about its own API to a recipe's author.
fn schema_message(e: &serde_saphyr::Error) -> String {
    let plain = e.without_snippet().to_string();
    let first = plain.lines().next().unwrap_or_default();
    let first = match first.rfind(" at line ") {
        Some(i) => &first[..i],
        None => first,
    };
    reword_schema_message(first)
}

/// serde-saphyr's wording for a duplicate key and for a second document names its own
/// API (`DuplicateKeyPolicy`, `from_str_multiple`); a recipe's author gets a plain one.
fn reword_schema_message(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("duplicate mapping key: ") {
        let key = rest
            .split(", set DuplicateKeyPolicy")
            .next()
            .unwrap_or(rest);
        return format!("duplicate key '{key}'");
    }
    if message.starts_with("multiple YAML documents detected") {
        return "a recipe is a single YAML document; found more than one".to_string();
    }
    message.to_string()
}

/// Parses the YAML recipe `text` named `file` against the schema.
fn parse(file: &str, text: &str) -> Result<Recipe, RecipeError> {
    serde_saphyr::from_str(text).map_err(|e| {
        let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
        RecipeError::at_offset(
            file,
            text,
            offset_of(text, line, column),
            RecipeErrorKind::Yaml(YamlError::Schema(schema_message(&e))),
        )
    })
}

/// Sentinel base replaced by the bootstrap spec after lowering.
const BOOTSTRAP_SENTINEL: &str = "kiln-internal/bootstrap";

/// Lowers the YAML recipe `text` named `file`.
pub(crate) fn lower(file: &str, text: &str, options: &Options) -> Result<BuildPlan, RecipeError> {
    let ctx = Ctx { file, text };
    let recipe = parse(file, text)?;

    let mut instrs = Vec::new();
    let here = |offset: usize| offset..offset + 1;
    let from_at = ctx.at(&recipe.from);
    let image = match &recipe.from.value {
        FromSpec::Image(s) if s.trim().is_empty() => {
            return Err(ctx.err(from_at, YamlError::Empty("from")));
        }
        FromSpec::Image(s) => s.clone(),
        FromSpec::Bootstrap { .. } => BOOTSTRAP_SENTINEL.to_string(),
    };
    instrs.push(Instr {
        span: here(from_at),
        kind: InstrKind::From {
            platform: None,
            image: literal(&image),
            name: None,
        },
    });
    if let Some(args) = recipe.args.as_ref().filter(|a| !a.value.is_empty()) {
        check_names(&ctx, args, "ARG", Some("args"))?;
        instrs.push(Instr {
            span: here(ctx.at(args)),
            kind: InstrKind::Arg(
                args.value
                    .iter()
                    .map(|(k, v)| (literal(k), Some(literal(v))))
                    .collect(),
            ),
        });
    }
    for f in &recipe.files {
        let at = ctx.at(f);
        if f.value.src.is_empty() {
            return Err(ctx.err(at, YamlError::Empty("src")));
        }
        if f.value.dest.is_empty() {
            return Err(ctx.err(at, YamlError::Empty("dest")));
        }
        if let Some(m) = &f.value.mode
            && !valid_chmod(m)
        {
            return Err(ctx.err(at, YamlError::Mode(m.clone())));
        }
        instrs.push(Instr {
            span: here(at),
            kind: InstrKind::Copy(CopyArgs {
                chown: f.value.owner.as_deref().map(literal),
                chmod: f.value.mode.as_deref().map(literal),
                sources: vec![SourceArg::Path(literal(&f.value.src))],
                dest: literal(&f.value.dest),
                ..CopyArgs::default()
            }),
        });
    }
    if let Some(env) = recipe.env.as_ref().filter(|e| !e.value.is_empty()) {
        check_names(&ctx, env, "ENV", Some("env"))?;
        instrs.push(Instr {
            span: here(ctx.at(env)),
            kind: InstrKind::Env(
                env.value
                    .iter()
                    .map(|(k, v)| (literal(k), literal(v)))
                    .collect(),
            ),
        });
    }
    let network = match recipe.network.as_ref().map(|n| &n.value) {
        Some(NetworkSpec::None) => Some("none".to_string()),
        _ => None,
    };
    // An allow-list has no Dockerfile spelling: its steps lower as `default` and get the
    // rules after lowering.
    let egress = match &recipe.network {
        Some(n) => match &n.value {
            NetworkSpec::Allow(a) => Some(lower_egress(&ctx, ctx.at(n), a)?),
            _ => None,
        },
        None => None,
    };
    // Commands run as root. A base image described with another user gets `USER root` before
    // them and, unless the recipe names its own user, its user back after them, as the
    // equivalent Dockerfile would write it.
    let base_user = match &recipe.from.value {
        FromSpec::Image(s) => options
            .base_images
            .get(s.as_str())
            .and_then(|b| b.user.clone())
            .filter(|u| !is_root_user(u)),
        FromSpec::Bootstrap { .. } => None,
    };
    let switch_user = base_user.is_some() && !recipe.commands.is_empty();
    if switch_user {
        instrs.push(Instr {
            span: here(ctx.at(&recipe.commands[0])),
            kind: InstrKind::User("root".to_string()),
        });
    }
    for c in &recipe.commands {
        let at = ctx.at(c);
        let command = command_line(&c.value).map_err(|e| ctx.err(at, e))?;
        instrs.push(Instr {
            span: here(at),
            kind: InstrKind::Run {
                mounts: Vec::new(),
                network: network.clone(),
                security: None,
                command,
                heredocs: Vec::new(),
            },
        });
    }
    if let (true, Some(u), None) = (switch_user, &base_user, &recipe.user) {
        let last = recipe.commands.last().map_or(from_at, |c| ctx.at(c));
        instrs.push(Instr {
            span: here(last),
            kind: InstrKind::User(literal(u)),
        });
    }
    if let Some(u) = &recipe.user {
        if u.value.is_empty() {
            return Err(ctx.err(ctx.at(u), YamlError::Empty("user")));
        }
        instrs.push(Instr {
            span: here(ctx.at(u)),
            kind: InstrKind::User(literal(&u.value)),
        });
    }
    if let Some(w) = &recipe.workdir {
        if w.value.is_empty() {
            return Err(ctx.err(ctx.at(w), YamlError::Empty("workdir")));
        }
        instrs.push(Instr {
            span: here(ctx.at(w)),
            kind: InstrKind::Workdir(literal(&w.value)),
        });
    }
    let mut labels: Vec<(String, String)> = Vec::new();
    let mut labels_at = from_at;
    if let Some(l) = &recipe.labels {
        check_names(&ctx, l, "LABEL", None)?;
        labels_at = ctx.at(l);
        labels.extend(l.value.iter().map(|(k, v)| (literal(k), literal(v))));
    }
    if let Some(d) = &recipe.disk_mib {
        if d.value == 0 {
            return Err(ctx.err(ctx.at(d), YamlError::Disk));
        }
        labels.push((literal(DISK_LABEL), literal(&d.value.to_string())));
    }
    if !labels.is_empty() {
        instrs.push(Instr {
            span: here(labels_at),
            kind: InstrKind::Label(labels),
        });
    }
    if let Some(r) = &recipe.ready {
        let at = ctx.at(r);
        for d in [&r.value.interval, &r.value.timeout].into_iter().flatten() {
            if parse_duration_ms(d).is_none() {
                return Err(ctx.err(at, YamlError::Duration(d.clone())));
            }
        }
        instrs.push(Instr {
            span: here(at),
            kind: InstrKind::Healthcheck(HealthcheckArgs {
                interval: r.value.interval.clone(),
                timeout: r.value.timeout.clone(),
                retries: r.value.retries.map(|n| n.to_string()),
                test: Some(command_line(&r.value.command).map_err(|e| ctx.err(at, e))?),
                ..HealthcheckArgs::default()
            }),
        });
    }
    if let Some(s) = &recipe.start {
        let at = ctx.at(s);
        let command = command_line(&s.value.command).map_err(|e| ctx.err(at, e))?;
        instrs.push(Instr {
            span: here(at),
            kind: InstrKind::Cmd(command),
        });
    }
    let limits = match &recipe.limits {
        None => Limits::default(),
        Some(l) => lower_limits(&ctx, l)?,
    };

    let source = SourceText {
        file,
        text,
        frontend: Frontend::Recipe,
        directives: Directives::default(),
    };
    let mut plan = lower_instrs(&source, &instrs, options)
        .map_err(|f| RecipeError::at_offset(file, text, f.offset, f.kind))?;
    plan.limits = limits;
    if let Some(egress) = egress {
        for step in plan.stages.iter_mut().flat_map(|st| st.steps.iter_mut()) {
            if let Action::Run(r) = &mut step.action {
                r.network = Network::Allow(egress.clone());
            }
        }
    }
    if let FromSpec::Bootstrap { bootstrap: b } = &recipe.from.value
        && let Some(stage) = plan.stages.first_mut()
    {
        stage.base = Base::Bootstrap(Bootstrap {
            distro: b.distro.clone(),
            suite: b.suite.clone(),
            mirror: b.mirror.clone(),
            variant: b.variant.clone(),
            include: b.include.clone(),
        });
    }
    if let (Some(s), Some(start)) = (&recipe.start, plan.sandbox.start.as_mut()) {
        if let Some(u) = &s.value.user {
            start.user = Some(u.clone());
        }
        if let Some(w) = &s.value.workdir {
            start.workdir = Some(w.clone());
        }
        for (k, v) in &s.value.env {
            let prefix = format!("{k}=");
            start.env.retain(|e| !e.starts_with(&prefix));
            start.env.push(format!("{k}={v}"));
        }
    }
    Ok(plan)
}

/// The rules of `network: {allow, deny}` whose map starts at `at`; a bad entry's error
/// points at the entry.
fn lower_egress(ctx: &Ctx<'_>, at: usize, a: &AllowSpec) -> Result<Egress, RecipeError> {
    let mut search = at;
    let mut rules = |list: &[String],
                     which: &'static str|
     -> Result<Vec<EgressRule>, RecipeError> {
        let mut out = Vec::with_capacity(list.len());
        for e in list {
            let offset = ctx.text[search.min(ctx.text.len())..]
                .find(e.as_str())
                .map_or(at, |i| search + i);
            search = offset.max(search);
            out.push(
                EgressRule::parse(e).map_err(|m| ctx.err(offset, YamlError::Egress(which, m)))?,
            );
        }
        Ok(out)
    };
    let allow = rules(&a.allow, "allow")?;
    let deny = rules(&a.deny, "deny")?;
    Ok(Egress { allow, deny })
}

fn lower_limits(ctx: &Ctx<'_>, l: &Spanned<LimitsSpec>) -> Result<Limits, RecipeError> {
    let at = ctx.at(l);
    let mut limits = Limits::default();
    if let Some(t) = &l.value.timeout {
        let ms = parse_duration_ms(t).ok_or_else(|| ctx.err(at, YamlError::Duration(t.clone())))?;
        let secs = ms.div_ceil(1000);
        if secs == 0 || secs > DEFAULT_TIMEOUT_SECS {
            return Err(ctx.err(
                at,
                YamlError::LimitTooHigh(format!("timeout {t} is not within 1s..15m")),
            ));
        }
        limits.timeout_secs = secs;
    }
    if let Some(m) = &l.value.memory {
        let mib = match m {
            MemorySpec::Mib(n) => *n,
            MemorySpec::Text(s) => {
                let bytes =
                    parse_size(s).ok_or_else(|| ctx.err(at, YamlError::Memory(s.clone())))?;
                bytes / (1 << 20)
            }
        };
        if mib == 0 || mib > DEFAULT_MEMORY_MIB {
            return Err(ctx.err(
                at,
                YamlError::LimitTooHigh(format!("memory {mib} MiB is not within 1 MiB..1 GiB")),
            ));
        }
        limits.memory_mib = mib;
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Action, Step};
    use crate::{load, plan_to_json};

    fn yaml(text: &str) -> BuildPlan {
        match load("recipe.yaml", text.as_bytes(), &Options::default()) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        }
    }

    fn yaml_err(text: &str) -> RecipeError {
        match load("recipe.yaml", text.as_bytes(), &Options::default()) {
            Ok(p) => panic!("expected an error, got {}", plan_to_json(&p)),
            Err(e) => e,
        }
    }

    #[test]
    fn parser_messages_speak_to_the_author() {
        let e = yaml_err("from: alpine\nfrom: x\n").to_string();
        assert!(
            e.starts_with("recipe.yaml:2:1: duplicate key 'from'\n"),
            "{e}"
        );
        let e = yaml_err("from: alpine\n---\nfrom: x\n").to_string();
        assert!(
            e.starts_with(
                "recipe.yaml:3:1: a recipe is a single YAML document; found more than one\n"
            ),
            "{e}"
        );
        // Any other message passes through.
        assert_eq!(
            reword_schema_message("missing field `from`"),
            "missing field `from`"
        );
    }

    #[test]
    fn empty_user_is_refused() {
        let e = yaml_err("from: alpine\nuser: ''\n").to_string();
        assert!(
            e.starts_with("recipe.yaml:2:7: user may not be empty\n"),
            "{e}"
        );
    }

    fn docker(text: &str) -> BuildPlan {
        match load("Dockerfile", text.as_bytes(), &Options::default()) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        }
    }

    fn canonical(p: &BuildPlan) -> Vec<(String, Vec<String>, String)> {
        p.stages
            .iter()
            .map(|s| {
                let steps = s.steps.iter().map(Step::canonical_json).collect();
                let config = serde_json::to_string(&s.config).unwrap_or_default();
                (
                    format!("{:?}/{}/{:?}", s.base, s.platform, s.name),
                    steps,
                    config,
                )
            })
            .collect()
    }

    fn assert_equivalent(recipe: &str, dockerfile: &str) {
        let (r, d) = (yaml(recipe), docker(dockerfile));
        assert_eq!(
            canonical(&r),
            canonical(&d),
            "\n{}\n---\n{}",
            plan_to_json(&r),
            plan_to_json(&d)
        );
        assert_eq!(r.sandbox, d.sandbox);
    }

    #[test]
    fn recipe_equals_dockerfile_web_app() {
        assert_equivalent(
            "from: python:3.12-slim\nargs:\n  PIP_VERSION: \"24.2\"\nfiles:\n  - src: requirements.txt\n    dest: /app/\n  - {src: app/, dest: /app/app/, owner: \"1000:1000\", mode: \"0755\"}\nenv:\n  LANG: C.UTF-8\n  PYTHONUNBUFFERED: \"1\"\ncommands:\n  - pip install pip==$PIP_VERSION && pip install -r /app/requirements.txt\n  - [\"python3\", \"-m\", \"compileall\", \"/app\"]\nuser: app\nworkdir: /app\nlabels:\n  org.example.team: web\ndisk_mib: 4096\nready:\n  command: curl -fs localhost:8000/health\n  interval: 2s\n  retries: 30\nstart:\n  command: [\"gunicorn\", \"-b\", \"0.0.0.0:8000\", \"app:app\"]\n",
            "FROM python:3.12-slim\nARG PIP_VERSION=24.2\nCOPY requirements.txt /app/\nCOPY --chown=1000:1000 --chmod=0755 app/ /app/app/\nENV LANG=C.UTF-8 PYTHONUNBUFFERED=1\nRUN pip install pip==$PIP_VERSION && pip install -r /app/requirements.txt\nRUN [\"python3\", \"-m\", \"compileall\", \"/app\"]\nUSER app\nWORKDIR /app\nLABEL org.example.team=web kiln.disk-mib=4096\nHEALTHCHECK --interval=2s --retries=30 CMD curl -fs localhost:8000/health\nCMD [\"gunicorn\", \"-b\", \"0.0.0.0:8000\", \"app:app\"]\n",
        );
    }

    #[test]
    fn recipe_equals_dockerfile_scratch_tools() {
        assert_equivalent(
            "from: scratch\nfiles:\n  - {src: busybox, dest: /bin/busybox, mode: \"u+x\"}\ncommands:\n  - [\"/bin/busybox\", \"--install\", \"-s\", \"/bin\"]\n  - echo 'it''s \"quoted\" $HOME' > /motd\nnetwork: none\nstart:\n  command: exec sh\n",
            "FROM scratch\nCOPY --chmod=u+x busybox /bin/busybox\nRUN --network=none [\"/bin/busybox\", \"--install\", \"-s\", \"/bin\"]\nRUN --network=none echo 'it''s \"quoted\" $HOME' > /motd\nCMD exec sh\n",
        );
    }

    #[test]
    fn recipe_equals_dockerfile_minimal() {
        assert_equivalent(
            "from: debian:bookworm\ncommands: [\"apt-get update\"]\n",
            "FROM debian:bookworm\nRUN apt-get update\n",
        );
    }

    /// Issue 2: each command runs as root, even on a base image whose config names another
    /// user; the image keeps the base's user unless the recipe sets one.
    #[test]
    fn commands_run_as_root_on_a_non_root_base() {
        let base = crate::BaseImage {
            user: Some("node".to_string()),
            ..crate::BaseImage::default()
        };
        let options = Options {
            base_images: [("node:22".to_string(), base)].into(),
            ..Options::default()
        };
        let plan = |text: &str| {
            crate::load("recipe.yaml", text.as_bytes(), &options).expect("valid recipe")
        };
        let p = plan("from: node:22\ncommands: [\"id -u\", \"id -g\"]\n");
        let s = &p.stages[0];
        assert_eq!(s.steps.len(), 2);
        for step in &s.steps {
            assert!(matches!(step.action, Action::Run(_)));
            assert_eq!(step.context.user.as_deref(), Some("root"));
        }
        assert_eq!(s.config.user.as_deref(), Some("node"));
        assert_eq!(p.sandbox.start, None);

        let p = plan("from: node:22\ncommands: [\"id -u\"]\nuser: app\n");
        assert_eq!(p.stages[0].steps[0].context.user.as_deref(), Some("root"));
        assert_eq!(p.stages[0].config.user.as_deref(), Some("app"));

        // Without commands nothing is added, and a root base needs no switch.
        let p = plan("from: node:22\n");
        assert_eq!(p.stages[0].config.user.as_deref(), Some("node"));
        let p = yaml("from: debian:bookworm\ncommands: [\"id -u\"]\n");
        assert_eq!(p.stages[0].steps[0].context.user, None);
    }

    #[test]
    fn semantics() {
        let p = yaml(
            "from: {bootstrap: {distro: debian, suite: bookworm, variant: minbase, include: [curl]}}\n\
             env: {A: \"$B\"}\nuser: runtime\nworkdir: /workspace\ncommands: [\"id\"]\n\
             start: {command: \"serve\", user: root, env: {PORT: \"80\", A: x}, workdir: /srv}\n\
             limits: {timeout: 10m, memory: 512MiB}\nnetwork: default\n",
        );
        let s = &p.stages[0];
        assert!(
            matches!(&s.base, Base::Bootstrap(b) if b.suite == "bookworm" && b.include == ["curl"])
        );
        assert_eq!(p.frontend, Frontend::Recipe);
        let run = &s.steps[0];
        assert!(matches!(&run.action, Action::Run(r) if r.network == Network::Default));
        assert_eq!(run.context.user, None);
        assert_eq!(run.context.workdir, "/");
        assert_eq!(run.context.env, ["A=$B"]);
        assert!(matches!(&s.steps[1].action, Action::Mkdir(m) if m.path == "/workspace"));
        assert_eq!(s.config.user.as_deref(), Some("runtime"));
        let start = p.sandbox.start.as_ref().unwrap();
        assert_eq!(start.argv, ["/bin/sh", "-c", "serve"]);
        assert_eq!(start.user.as_deref(), Some("root"));
        assert_eq!(start.workdir.as_deref(), Some("/srv"));
        assert_eq!(start.env, ["A=x", "PORT=80"]);
        assert_eq!(
            p.limits,
            Limits {
                timeout_secs: 600,
                memory_mib: 512
            }
        );
        assert_eq!(s.steps[0].location.start_line, 5);
    }

    #[test]
    fn build_args_override_recipe_args() {
        let o = Options {
            build_args: [("V".to_string(), "2".to_string()), ("X".into(), "1".into())].into(),
            ..Options::default()
        };
        let p = load(
            "r.yml",
            b"from: scratch\nargs: {V: \"1\"}\ncommands: [\"echo $V\"]\n",
            &o,
        )
        .unwrap();
        assert!(
            p.stages[0].steps[0]
                .context
                .env
                .contains(&"V=2".to_string())
        );
        assert_eq!(p.build_args.unused, ["X"]);
    }

    #[test]
    fn errors_are_located() {
        for (text, line, needle) in [
            ("from: x\ncomands: [a]\n", 2, "comands"),
            ("commands: [a]\n", 1, "from"),
            ("from: x\ncommands: [\"\"]\n", 2, "empty"),
            ("from: x\ncommands:\n  - []\n", 3, "empty"),
            (
                "from: x\nfiles:\n  - {src: a, dest: /b, mode: \"999\"}\n",
                3,
                "mode",
            ),
            (
                "from: x\nfiles:\n  - {src: a, dest: /b, bogus: 1}\n",
                3,
                "bogus",
            ),
            ("from: x\nlimits: {timeout: 1h}\n", 2, "15m"),
            ("from: x\nlimits: {memory: 2GiB}\n", 2, "1 GiB"),
            ("from: x\nlimits: {memory: lots}\n", 2, "memory"),
            (
                "from: x\nready: {command: x, interval: soon}\n",
                2,
                "duration",
            ),
            ("from: x\nnetwork: host\n", 2, "host"),
            ("from: x\ndisk_mib: 0\n", 2, "disk_mib"),
            ("from: \"\"\n", 1, "from"),
            ("from: x\nstart: {command: x, extra: 1}\n", 2, "extra"),
            ("from: [x\n", 1, ""),
            ("from: {bootstrap: {distro: debian}}\n", 1, ""),
        ] {
            let e = yaml_err(text);
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.to_string().contains(needle), "{text:?}: {e}");
            assert!(
                e.to_string().starts_with(&format!("recipe.yaml:{line}:")),
                "{e}"
            );
        }
    }

    #[test]
    fn network_allow_list_reaches_every_command_and_bad_entries_are_located() {
        let plan = yaml(
            "from: x\ncommands:\n  - a\n  - b\nnetwork:\n  allow: [pkg.example, \"*.cdn.example\", 192.0.2.0/24, \"2001:db8::1\"]\n  deny: [bad.cdn.example]\n",
        );
        let steps: Vec<_> = plan.stages[0]
            .steps
            .iter()
            .filter_map(|s| match &s.action {
                Action::Run(r) => Some(&r.network),
                _ => None,
            })
            .collect();
        assert_eq!(steps.len(), 2);
        for n in steps {
            let Network::Allow(e) = n else {
                panic!("{n:?}")
            };
            let shown: Vec<String> = e.allow.iter().map(|r| r.to_string()).collect();
            assert_eq!(
                shown,
                [
                    "pkg.example",
                    "*.cdn.example",
                    "192.0.2.0/24",
                    "2001:db8::1"
                ]
            );
            assert_eq!(e.deny.len(), 1);
        }
        let json: serde_json::Value = serde_json::from_str(&plan_to_json(&plan)).unwrap();
        let run = &json["stages"][0]["steps"][0]["action"]["network"];
        assert_eq!(run["allow"]["allow"][1], "*.cdn.example", "{json}");
        assert_eq!(run["allow"]["deny"][0], "bad.cdn.example", "{json}");
        let e = yaml_err("from: x\nnetwork:\n  allow:\n    - ok.example\n    - 10.0.0.1/8\n");
        assert_eq!(e.line, 5, "{e}");
        assert!(
            e.to_string().contains("network allow entry '10.0.0.1/8'"),
            "{e}"
        );
        let e = yaml_err("from: x\nnetwork: {allow: [a.example], bogus: 1}\n");
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn map_names_are_checked_at_the_key() {
        let e = yaml_err("from: x\nenv:\n  OK: 1\n  A=B: x\n");
        assert_eq!((e.line, e.column), (4, 3));
        assert!(
            e.to_string().contains("env name 'A=B' may not contain '='"),
            "{e}"
        );
        let e = yaml_err("from: x\nenv:\n  \"\": x\n");
        assert_eq!((e.line, e.column), (3, 3));
        assert!(e.to_string().contains("ENV names can not be blank"), "{e}");
        let e = yaml_err("from: x\nlabels:\n  '': x\n");
        assert!(
            e.to_string().contains("LABEL names can not be blank"),
            "{e}"
        );
        let e = yaml_err("from: x\nargs: {\"A=B\": x}\n");
        assert!(e.to_string().contains("args name"), "{e}");
    }

    #[test]
    fn smoke_checks_are_read_and_checked() {
        let text = "from: x\nsmoke:\n  - command: echo hi\n    output: hi\n  - {command: [\"false\"], exit: 1}\n";
        let checks = crate::smoke_checks("r.yaml", text.as_bytes()).expect("smoke");
        assert_eq!(
            checks,
            vec![
                SmokeCheck {
                    location: "r.yaml:3".into(),
                    argv: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
                    exit: 0,
                    output: Some("hi".into()),
                },
                SmokeCheck {
                    location: "r.yaml:5".into(),
                    argv: vec!["false".into()],
                    exit: 1,
                    output: None,
                },
            ]
        );
        // The image does not change with its checks: they lower to nothing.
        load("r.yaml", text.as_bytes(), &Options::default()).expect("lowers");
        let e = yaml_err("from: x\nsmoke:\n  - {command: x, expect: 1}\n");
        assert_eq!(e.line, 3, "{e}");
        assert!(e.to_string().contains("expect"), "{e}");
        let e = crate::smoke_checks("r.yaml", b"from: x\nsmoke:\n  - command: []\n")
            .expect_err("empty");
        assert!(e.to_string().contains("may not be empty"), "{e}");
        assert!(
            crate::smoke_checks("Dockerfile", b"FROM x\n")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn hostile_yaml_does_not_panic() {
        let bomb = "a: &a [x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b]\nd: [*c,*c,*c,*c,*c,*c,*c,*c]\nfrom: x\n";
        for text in [
            bomb,
            "",
            "---\n---\n",
            "from: !!binary x\n",
            "{{{{",
            "from: x\ncommands: 7\n",
            &"[".repeat(10_000),
        ] {
            let _ = load("r.yaml", text.as_bytes(), &Options::default());
        }
    }
}
