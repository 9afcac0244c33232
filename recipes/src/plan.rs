//! The [`BuildPlan`]: the one value both front ends lower into and the builder consumes.
//!
//! A plan is a list of [`Stage`]s (a DAG: a stage's base or a `COPY --from` may name an
//! earlier stage by index), each with its base, its ordered [`Step`]s with everything
//! resolved (environment, user, working directory, shell, mounts, network), and the OCI image
//! config the stage ends with. The last stage is the target; stages the target does not need
//! are pruned before anything is resolved, so every stage in a plan is built.
//!
//! Serialization is stable: every map is a `BTreeMap` or an ordered `Vec`, and fields are
//! written in declaration order, so identical inputs give byte-identical JSON
//! ([`plan_to_json`]). Each step keeps its source location ([`SourceLocation`]) apart from
//! its canonical form ([`Step::canonical_json`]), which later feeds build cache keys and
//! does not change when only line numbers move.
//!
//! Image references are written as the recipe wrote them (after build-arg substitution);
//! resolving tags to digests belongs to the builder.

use std::collections::BTreeMap;

use serde::Serialize;

/// Default build timeout, seconds (15 minutes; DESIGN.md "Build limits").
pub const DEFAULT_TIMEOUT_SECS: u64 = 15 * 60;
/// Default build memory limit, MiB (1 GiB; DESIGN.md "Build limits").
pub const DEFAULT_MEMORY_MIB: u64 = 1024;
/// Default target and build platform when none is given.
pub const DEFAULT_PLATFORM: &str = "linux/amd64";
/// Docker's default shell for shell-form commands on Linux (Dockerfile reference, `SHELL`).
pub const DEFAULT_SHELL: [&str; 2] = ["/bin/sh", "-c"];
/// Docker's default `PATH` for Linux images without one (BuildKit `system.DefaultPathEnvUnix`).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A whole build: what the builder runs, and what the resulting image and sandbox look like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BuildPlan {
    /// Which front end produced the plan.
    pub frontend: Frontend,
    /// The recipe file as the caller named it (used in every [`SourceLocation`]).
    pub file: String,
    /// Parser directives (Dockerfile only; defaults for a YAML recipe).
    pub directives: Directives,
    /// The platform the image is built for, `os/arch[/variant]`.
    pub platform: String,
    /// The stages to build, in dependency order; the last one is the target.
    pub stages: Vec<Stage>,
    /// Index into `stages` of the target stage (always the last).
    pub target: usize,
    /// Build arguments: given, which were used, which were not.
    pub build_args: BuildArgs,
    /// How the built image is started as a sandbox.
    pub sandbox: Sandbox,
    /// Build limits (may only be lower than the defaults).
    pub limits: Limits,
    /// Non-fatal findings, in source order.
    pub warnings: Vec<Warning>,
}

/// The front end a plan came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Frontend {
    /// A Dockerfile (BuildKit semantics).
    Dockerfile,
    /// A kiln YAML recipe.
    Recipe,
}

/// Dockerfile parser directives (Dockerfile reference, "Parser directives").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Directives {
    /// `# syntax=`: recorded, never fetched.
    pub syntax: Option<String>,
    /// `# escape=`: the escape character (`\` by default).
    pub escape: char,
    /// `# check=`: recorded verbatim.
    pub check: Option<String>,
}

impl Default for Directives {
    fn default() -> Self {
        Directives {
            syntax: None,
            escape: '\\',
            check: None,
        }
    }
}

/// One stage of a multi-stage build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stage {
    /// The stage's name (`FROM ... AS name`), lowercased as BuildKit does.
    pub name: Option<String>,
    /// The stage's index in the source recipe (0-based, before pruning). `COPY --from=N`
    /// and `FROM` refer to this index.
    pub index: usize,
    /// What the stage starts from.
    pub base: Base,
    /// The stage's platform, `os/arch[/variant]` (from `FROM --platform` or the build's).
    pub platform: String,
    /// Where the stage begins (its `FROM` line, or the recipe's `from:` key).
    pub location: SourceLocation,
    /// The ordered steps.
    pub steps: Vec<Step>,
    /// The image config the stage ends with. As in BuildKit, a stage starts from its base's
    /// config, which the builder merges in under the fields set here (fields set win;
    /// `env` by key, labels, ports and volumes add up; ONBUILD is never inherited). Of an
    /// image base, the parts the caller gave in [`crate::Options::base_images`] (env, user,
    /// working directory) are included here. Of a stage base ([`Base::Stage`]), nothing is:
    /// this config holds only what this stage set (its `env` lists the variables its own
    /// `ENV`s set, in the order of their first setting, with their final values), so that
    /// a chain of n stages is not n copies of a growing config (issue 44 §3). The target's
    /// whole config is what [`BuildPlan::sandbox`] is made from.
    pub config: ImageConfig,
}

/// What a stage starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Base {
    /// An empty root filesystem (`FROM scratch`).
    Scratch,
    /// An image reference as written (after substitution), not yet resolved to a digest.
    Image {
        /// The reference, e.g. `debian:bookworm` or `registry:5000/x@sha256:...`.
        reference: String,
    },
    /// An earlier stage of the same plan.
    Stage {
        /// Index into [`BuildPlan::stages`] of the base stage (after pruning).
        stage: usize,
    },
    /// A root filesystem made by debootstrap (YAML `from: {bootstrap: ...}`); a later
    /// issue implements it in the builder.
    Bootstrap(Bootstrap),
}

/// A debootstrap specification (`debootstrap --variant V --include I suite dir mirror`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bootstrap {
    /// Distribution family, e.g. `debian` or `ubuntu`.
    pub distro: String,
    /// Suite (release), e.g. `bookworm`, `noble`.
    pub suite: String,
    /// Mirror URL, if not the builder's default.
    pub mirror: Option<String>,
    /// debootstrap `--variant`, e.g. `minbase`.
    pub variant: Option<String>,
    /// Extra packages (`--include`), in order.
    pub include: Vec<String>,
}

/// Where a step or stage came from: a file and an inclusive 1-based line range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourceLocation {
    /// The recipe file.
    pub file: String,
    /// First line (1-based).
    pub start_line: usize,
    /// Last line (1-based, inclusive).
    pub end_line: usize,
}

/// One step: its location, and its canonical content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    /// Where the step was written; not part of the canonical form.
    pub location: SourceLocation,
    /// What the step does.
    pub action: Action,
    /// The resolved context the step runs in.
    pub context: StepContext,
}

#[derive(Serialize)]
struct CanonicalStep<'a> {
    action: &'a Action,
    context: &'a StepContext,
}

impl Step {
    /// The step without its location, as compact JSON (fields in declaration order, maps
    /// sorted). Two steps that do the same thing in the same context give the same bytes
    /// wherever they were written; this feeds build cache keys.
    pub fn canonical_json(&self) -> String {
        // Without the proxy env (see [`RunStep::proxy_env`]).
        let without_proxies;
        let action = match &self.action {
            Action::Run(r) if !r.proxy_env.is_empty() => {
                without_proxies = Action::Run(RunStep {
                    proxy_env: Vec::new(),
                    ..r.clone()
                });
                &without_proxies
            }
            a => a,
        };
        let canonical = CanonicalStep {
            action,
            context: &self.context,
        };
        // Serializing plain structs of strings, integers and ordered maps cannot fail.
        serde_json::to_string(&canonical).expect("plan types always serialize")
    }
}

/// The context a step runs in, fully resolved at the step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepContext {
    /// Environment as `KEY=value`, in definition order: image `ENV`, then build args in
    /// scope (for `RUN`; of an `ENV` and an `ARG` of one name, the later in the stage
    /// wins, as in BuildKit; proxy build args are in [`RunStep::proxy_env`]). For an image
    /// base whose
    /// env was not given in [`crate::Options::base_images`], only what the recipe set: the
    /// builder puts it over the base image's env, by key.
    pub env: Vec<String>,
    /// User at this step: the last `USER`, else the base's when known (a stage base, or an
    /// image base given in [`crate::Options::base_images`]). `None`: no user known here:
    /// an undescribed image base's own user (root if it has none), root for `scratch`.
    pub user: Option<String>,
    /// Working directory at this step (absolute). Before any `WORKDIR`, an image base's
    /// own working directory when the caller gave it ([`crate::BaseImage`]), else `/`.
    pub workdir: String,
    /// Shell for shell-form commands.
    pub shell: Vec<String>,
}

/// What a step does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Action {
    /// Run a command (`RUN`, a recipe command).
    Run(RunStep),
    /// Copy files (`COPY`, recipe `files`).
    Copy(CopyStep),
    /// Copy files, fetching URLs and unpacking local archives (`ADD`).
    Add(CopyStep),
    /// Create a directory with parents (`WORKDIR`, as BuildKit does).
    Mkdir(MkdirStep),
}

/// A command to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunStep {
    /// How the command was written.
    pub form: CommandForm,
    /// The argv to execute (shell form: the shell plus the command line).
    pub argv: Vec<String>,
    /// Files the command needs, from heredocs (written before the command runs).
    pub files: Vec<InlineFile>,
    /// Mounts during the command (`RUN --mount`).
    pub mounts: Vec<Mount>,
    /// Network during the command.
    pub network: Network,
    /// `RUN --security`: `insecure` needs the `security.insecure` entitlement
    /// (`kiln build --allow security.insecure`), refused otherwise by the builder.
    pub security: Security,
    /// The proxy build args (`HTTP_PROXY`... given with `--build-arg`, no `ARG` needed), in
    /// both spellings, `KEY=value`, each a name `context.env` does not have. The command
    /// gets them after `context.env`; like BuildKit (its exec op clears `ProxyEnv` before
    /// making the cache key), they are not part of [`Step::canonical_json`] nor of the
    /// build cache key, so a build behind another proxy reuses the cache.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub proxy_env: Vec<String>,
}

/// How a command was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommandForm {
    /// A string run by the shell.
    Shell,
    /// A JSON array / argv list, run directly.
    Exec,
}

/// A file made from a heredoc.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InlineFile {
    /// The heredoc delimiter (BuildKit uses it as the file name).
    pub name: String,
    /// Content (after `<<-` tab stripping and any expansion).
    pub data: String,
    /// Where the builder places the file for the command (`RUN`: under `/dev/pipes/`), or
    /// `None` when the content is passed inline to the shell.
    pub path: Option<String>,
    /// File mode (octal value as an integer).
    pub mode: u32,
}

/// A `RUN --mount` (Dockerfile reference, "RUN --mount").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Mount {
    /// Bind a directory of the context, a stage or an image.
    Bind {
        /// Mount point (absolute).
        target: String,
        /// Path in the source (default: its root).
        source: String,
        /// Stage index, image reference, or `None` for the build context.
        from: Option<MountFrom>,
        /// Writes allowed (discarded after the step).
        readwrite: bool,
    },
    /// A persistent cache directory.
    Cache {
        /// Mount point (absolute).
        target: String,
        /// Cache id (default: the target).
        id: String,
        /// `shared`, `private` or `locked`.
        sharing: String,
        /// Seed from a stage or image.
        from: Option<MountFrom>,
        /// Path in `from`.
        source: Option<String>,
        /// Directory mode (octal value), default 0o755.
        mode: u32,
        /// Owner uid, default 0.
        uid: u32,
        /// Owner gid, default 0.
        gid: u32,
        /// Read-only.
        readonly: bool,
    },
    /// A tmpfs.
    Tmpfs {
        /// Mount point (absolute).
        target: String,
        /// Size limit in bytes, if any.
        size: Option<u64>,
    },
    /// A build secret, as a file or an environment variable.
    Secret {
        /// Secret id (default: the target's file name).
        id: String,
        /// File path, when mounted as a file (default `/run/secrets/<id>`).
        target: Option<String>,
        /// Environment variable, when exposed as one.
        env: Option<String>,
        /// Fail when the secret is missing.
        required: bool,
        /// File mode (octal value), default 0o400.
        mode: u32,
        /// Owner uid.
        uid: u32,
        /// Owner gid.
        gid: u32,
    },
    /// An SSH agent of the build (`kiln build --ssh`) as a socket (BuildKit's ssh mount).
    /// The socket's host path is no part of the plan nor of the cache key; the id is.
    Ssh {
        /// The agent's id (`--ssh ID=...`), default `default`.
        id: String,
        /// The socket's path in the step; default `/run/buildkit/ssh_agent.<n>`, `n`
        /// counting the step's ssh mounts from 0.
        target: String,
        /// Fail when the build has no such agent (default false: the mount is left out).
        required: bool,
        /// Socket mode (octal value), default 0o600.
        mode: u32,
        /// Owner uid.
        uid: u32,
        /// Owner gid.
        gid: u32,
    },
}

/// Where a mount or copy reads from, besides the build context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum MountFrom {
    /// An earlier stage (index into [`BuildPlan::stages`]).
    Stage {
        /// Stage index in the plan.
        stage: usize,
    },
    /// An image reference, unresolved.
    Image {
        /// The reference.
        reference: String,
    },
}

/// Network for a `RUN` step.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Network {
    /// The builder's default (isolated, with outbound access).
    #[default]
    Default,
    /// No network.
    None,
    /// The host's network: accepted here, refused by the builder unless allowed.
    Host,
    /// Only through the builder's egress proxy, to the destinations the rules allow
    /// (YAML `network: {allow: [...], deny: [...]}`). Serialized as
    /// `{"allow": {"allow": [...], "deny": [...]}}`, each rule in its written form.
    Allow(Egress),
}

/// The rules of an allow-list network: a destination is reachable when some `allow` rule
/// matches it and no `deny` rule does (deny always wins). Whatever the rules say, the
/// builder refuses addresses that are not public (loopback, private, link-local, metadata,
/// NAT64...).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Egress {
    /// Destinations allowed.
    pub allow: Vec<EgressRule>,
    /// Destinations refused even when an `allow` rule matches.
    pub deny: Vec<EgressRule>,
}

/// One allow-list or deny-list entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressRule {
    /// `example.com`: that name only (ASCII, compared case-insensitively, a trailing dot
    /// ignored).
    Domain(String),
    /// `*.example.com`: every name under `example.com`, not `example.com` itself.
    Subdomains(String),
    /// `192.0.2.7`, `2001:db8::1`: that address, asked for as a literal.
    Address(std::net::IpAddr),
    /// `192.0.2.0/24`, `2001:db8::/32`: every address in the range (RFC 4632 section 3.1
    /// prefix notation), asked for as a literal. Bits past the prefix must be zero.
    Cidr {
        /// The network address.
        addr: std::net::IpAddr,
        /// Prefix length, bits (at most 32 for IPv4, 128 for IPv6).
        prefix: u8,
    },
}

impl EgressRule {
    /// Parses an entry: `*.domain`, a domain, an IPv4 or IPv6 address (IPv6 without
    /// brackets), or `addr/prefix`. Domains are LDH labels of 1 to 63 bytes (RFC 1123
    /// section 2.1), at most 253 bytes in all, and are lowercased. Errors: the reason, for
    /// the caller to place.
    pub fn parse(text: &str) -> Result<EgressRule, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err("an empty entry".into());
        }
        if let Some((a, p)) = t.split_once('/') {
            let addr: std::net::IpAddr = a
                .parse()
                .map_err(|_| format!("'{t}': '{a}' is not an IP address"))?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let prefix: u8 =
                p.parse().ok().filter(|n| *n <= max).ok_or_else(|| {
                    format!("'{t}': prefix '{p}' is not a number from 0 to {max}")
                })?;
            let bits = ip_bits(addr);
            let mask = prefix_mask(prefix, max);
            if bits & !mask != 0 {
                return Err(format!(
                    "'{t}': bits are set past the /{prefix} prefix (write the network address)"
                ));
            }
            return Ok(EgressRule::Cidr { addr, prefix });
        }
        if let Ok(addr) = t.trim_start_matches('[').trim_end_matches(']').parse() {
            return Ok(EgressRule::Address(addr));
        }
        let (wild, name) = match t.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, t),
        };
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(format!(
                "'{t}': expected a domain, *.domain, an IP address or a CIDR range"
            ));
        }
        Ok(if wild {
            EgressRule::Subdomains(name)
        } else {
            EgressRule::Domain(name)
        })
    }
}

/// The address as a 128-bit number (IPv4 in the low 32 bits).
pub fn ip_bits(ip: std::net::IpAddr) -> u128 {
    match ip {
        std::net::IpAddr::V4(v4) => u32::from(v4) as u128,
        std::net::IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The mask of a `prefix`-bit prefix of a `width`-bit address (32 or 128), as [`ip_bits`]
/// lays it out.
pub fn prefix_mask(prefix: u8, width: u8) -> u128 {
    let ones = if width == 128 {
        u128::MAX
    } else {
        (1u128 << width) - 1
    };
    ones & !ones.checked_shr(u32::from(prefix)).unwrap_or(0)
}

impl std::fmt::Display for EgressRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EgressRule::Domain(d) => f.write_str(d),
            EgressRule::Subdomains(d) => write!(f, "*.{d}"),
            EgressRule::Address(a) => write!(f, "{a}"),
            EgressRule::Cidr { addr, prefix } => write!(f, "{addr}/{prefix}"),
        }
    }
}

impl Serialize for EgressRule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// `RUN --security`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Security {
    /// The default sandbox: Docker's default capabilities and seccomp profile.
    #[default]
    Sandbox,
    /// BuildKit's `security.insecure`: every capability, no seccomp filter, no masked or
    /// read-only kernel paths. Part of the step's canonical form, so of its cache key.
    Insecure,
}

/// A `COPY` or `ADD`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CopyStep {
    /// Sources, in order.
    pub sources: Vec<CopySource>,
    /// Destination (absolute, after resolving against the working directory; a trailing
    /// `/` is kept: it means "into this directory").
    pub dest: String,
    /// Where sources are read from (`None`: the build context).
    pub from: Option<MountFrom>,
    /// `--chown` as written after substitution (`user[:group]`).
    pub chown: Option<String>,
    /// `--chmod`: octal (`0755`) or symbolic (`u+x,g-w`), as written after substitution.
    pub chmod: Option<String>,
    /// `--link`.
    pub link: bool,
    /// `--parents`.
    pub parents: bool,
    /// `--exclude` patterns.
    pub exclude: Vec<String>,
    /// `ADD --checksum` (`sha256:<hex>`).
    pub checksum: Option<String>,
    /// `ADD` unpacks local tar archives (`--unpack`, default true for local sources;
    /// always false for `COPY`).
    pub unpack: bool,
    /// `ADD --keep-git-dir`.
    pub keep_git_dir: bool,
}

/// One source of a copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum CopySource {
    /// A path (or glob) in the context, stage or image.
    Path {
        /// The path as written after substitution.
        path: String,
    },
    /// A URL fetched by `ADD`.
    Url {
        /// The URL.
        url: String,
    },
    /// A git repository fetched by `ADD`.
    Git {
        /// The repository URL (with `#ref:subdir` if written).
        url: String,
    },
    /// Content from a heredoc.
    Inline(InlineFile),
}

/// A `WORKDIR`'s directory creation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MkdirStep {
    /// Absolute path, created with parents.
    pub path: String,
    /// Mode (octal value), 0o755.
    pub mode: u32,
}

/// The OCI image config a stage ends with (OCI image spec, `config` object), in kiln's
/// plain form. Durations are milliseconds.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ImageConfig {
    /// `ENTRYPOINT` (exec form; shell form already wrapped in the shell).
    pub entrypoint: Option<Vec<String>>,
    /// `CMD` (same). `None`: inherit the base's; `Some([])`: cleared (an `ENTRYPOINT`
    /// without a later `CMD` drops the inherited one, as BuildKit does).
    pub cmd: Option<Vec<String>>,
    /// Environment as `KEY=value` in definition order (see [`StepContext::env`] for what
    /// an image base contributes).
    pub env: Vec<String>,
    /// Labels (`MAINTAINER` becomes `maintainer`).
    pub labels: BTreeMap<String, String>,
    /// Exposed ports, `port/proto` (proto defaults to `tcp`).
    pub exposed_ports: Vec<String>,
    /// Volumes (absolute paths), sorted, no duplicates.
    pub volumes: Vec<String>,
    /// `STOPSIGNAL`.
    pub stop_signal: Option<String>,
    /// `HEALTHCHECK`.
    pub healthcheck: Option<Healthcheck>,
    /// The image's user: the last `USER`, else the base's when known (see
    /// [`Stage::config`]). `None`: none set or known (the builder keeps an image base's,
    /// root otherwise).
    pub user: Option<String>,
    /// The image's working directory (absolute): the last `WORKDIR`, else the base's when
    /// known. `None`: none set or known (the builder keeps an image base's, `/` otherwise).
    pub workdir: Option<String>,
    /// `ONBUILD` triggers, as written.
    pub onbuild: Vec<String>,
    /// `SHELL` (`None`: the default `/bin/sh -c`).
    pub shell: Option<Vec<String>>,
}

/// A health check (OCI config `Healthcheck`, as Docker defines it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Healthcheck {
    /// `["NONE"]`, `["CMD", args...]` or `["CMD-SHELL", command]`.
    pub test: Vec<String>,
    /// Interval between checks, ms (`None`: Docker's default 30 s).
    pub interval_ms: Option<u64>,
    /// Timeout of one check, ms (`None`: default 30 s).
    pub timeout_ms: Option<u64>,
    /// Start period, ms (`None`: default 0).
    pub start_period_ms: Option<u64>,
    /// Interval during the start period, ms (`None`: default 5 s).
    pub start_interval_ms: Option<u64>,
    /// Consecutive failures before unhealthy (`None`: default 3).
    pub retries: Option<u32>,
}

/// How the built image runs as a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Sandbox {
    /// The start command, if any.
    pub start: Option<StartCommand>,
    /// The ready check, if any.
    pub ready: Option<ReadyCheck>,
    /// Disk size in MiB, if asked for (`LABEL kiln.disk-mib`, `--disk-mib`, `disk_mib:`).
    pub disk_mib: Option<u64>,
}

/// The start command: argv plus its context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StartCommand {
    /// ENTRYPOINT and CMD combined as Docker does (exec-form entrypoint + cmd; a shell-form
    /// entrypoint ignores CMD).
    pub argv: Vec<String>,
    /// User to run as: the image config's [`ImageConfig::user`] (a YAML `start.user`
    /// overrides it). `None`: the user the builder's merged image config gives (an
    /// undescribed image base's), root when there is none.
    pub user: Option<String>,
    /// Environment, `KEY=value` (the image config's env, plus YAML `start.env`).
    pub env: Vec<String>,
    /// Working directory: the image config's [`ImageConfig::workdir`] (a YAML
    /// `start.workdir` overrides it). `None`: the merged image config's, `/` when there is
    /// none.
    pub workdir: Option<String>,
}

/// The ready check run after the start command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadyCheck {
    /// argv of the check; exit status 0 means ready.
    pub argv: Vec<String>,
    /// Interval between checks, ms.
    pub interval_ms: u64,
    /// Timeout of one check, ms.
    pub timeout_ms: u64,
    /// Failures tolerated before giving up.
    pub retries: u32,
}

/// Build limits. They may only lower [`DEFAULT_TIMEOUT_SECS`] and [`DEFAULT_MEMORY_MIB`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Whole-build timeout, seconds.
    pub timeout_secs: u64,
    /// Memory limit, MiB.
    pub memory_mib: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout_secs: DEFAULT_TIMEOUT_SECS,
            memory_mib: DEFAULT_MEMORY_MIB,
        }
    }
}

/// The last Unix second RFC 3339 can write with a four-digit year, 9999-12-31T23:59:59Z
/// (RFC 3339 section 5.6, `date-fullyear = 4DIGIT`).
pub const MAX_UNIX_SECONDS: u64 = 253_402_300_799;

/// `SOURCE_DATE_EPOCH` (reproducible-builds.org's specification: decimal Unix seconds) as
/// seconds. Errors: the message naming the value and what was expected, for text that is not
/// a decimal number or a time past [`MAX_UNIX_SECONDS`].
pub fn parse_source_date_epoch(v: &str) -> Result<u64, String> {
    match v.trim().parse::<u64>() {
        Ok(t) if t <= MAX_UNIX_SECONDS => Ok(t),
        Ok(_) => Err(format!(
            "SOURCE_DATE_EPOCH {v:?} is past 9999-12-31T23:59:59Z: expected Unix seconds up to {MAX_UNIX_SECONDS}"
        )),
        Err(_) => Err(format!(
            "SOURCE_DATE_EPOCH {v:?} is not Unix seconds: expected a decimal number of seconds since 1970-01-01T00:00:00Z"
        )),
    }
}

/// Build arguments given to the build and what became of them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct BuildArgs {
    /// The `--build-arg` values given. `SOURCE_DATE_EPOCH` among them (Unix seconds) is
    /// what the builder uses for timestamps, as BuildKit does; it never counts as unused.
    pub given: BTreeMap<String, String>,
    /// Names of given args some `ARG` consumed (or predefined args used).
    pub used: Vec<String>,
    /// Names of given args no `ARG` in a built stage declared (each also a warning).
    pub unused: Vec<String>,
}

/// A non-fatal finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Warning {
    /// Where, if it has a place in the source.
    pub location: Option<SourceLocation>,
    /// What.
    pub message: String,
}

/// The plan as pretty JSON with a trailing newline: stable (same plan, same bytes), used
/// by `kiln plan --json` and the golden tests.
pub fn plan_to_json(plan: &BuildPlan) -> String {
    // Plain structs of strings, integers and BTreeMaps: serialization cannot fail.
    let mut out = serde_json::to_string_pretty(plan).expect("plan types always serialize");
    out.push('\n');
    out
}

impl BuildPlan {
    /// The target stage (`None` only for a hand-made plan without stages).
    pub fn target_stage(&self) -> Option<&Stage> {
        self.stages.get(self.target)
    }

    /// The image reference (as written, after substitution) at the root of the target
    /// stage's chain of `FROM`s: the image the built image inherits its config from. A stage
    /// `FROM` an earlier stage is followed to that stage's base. `None` when the chain ends
    /// at `scratch` or a bootstrap base, or the plan has no stages.
    pub fn image_base(&self) -> Option<&str> {
        let mut stage = self.target_stage()?;
        // Each step goes to an earlier stage (`Base::Stage` indexes one before it), so the
        // walk ends; the bound only guards a hand-made plan.
        for _ in 0..=self.stages.len() {
            match &stage.base {
                Base::Image { reference } => return Some(reference),
                Base::Stage { stage: i } => stage = self.stages.get(*i)?,
                Base::Scratch | Base::Bootstrap(_) => return None,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn egress_rules_parse_and_print_as_written() {
        use super::EgressRule as R;
        for (text, shown) in [
            ("Example.COM.", "example.com"),
            ("*.pkg.example", "*.pkg.example"),
            ("192.0.2.7", "192.0.2.7"),
            ("[2001:db8::1]", "2001:db8::1"),
            ("10.0.0.0/8", "10.0.0.0/8"),
            ("2001:db8::/32", "2001:db8::/32"),
            ("0.0.0.0/0", "0.0.0.0/0"),
            ("::/0", "::/0"),
            ("2001:db8::1/128", "2001:db8::1/128"),
        ] {
            let r = R::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(r.to_string(), shown);
        }
        for bad in [
            "",
            "*.",
            "*",
            "a..b",
            "-a.b",
            "a_b.c",
            "http://x",
            "10.0.0.1/8",
            "10.0.0.0/33",
            "2001:db8::/129",
            "x/8",
            "*.*.a",
        ] {
            assert!(R::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    use super::*;

    #[test]
    fn image_base_follows_the_target_stages_chain_of_froms() {
        let plan = |text: &str| {
            crate::load("Dockerfile", text.as_bytes(), &Default::default()).expect("lowers")
        };
        assert_eq!(plan("FROM gbase\nRUN true\n").image_base(), Some("gbase"));
        let p = plan(
            "FROM other:1 AS tools\nRUN true\nFROM gbase:2 AS app\nRUN true\n\
             FROM app\nCOPY --from=tools /x /x\n",
        );
        assert_eq!(p.image_base(), Some("gbase:2"));
        assert_eq!(plan("FROM scratch\nCOPY a /a\n").image_base(), None);
        assert_eq!(
            plan("FROM gbase AS a\nFROM scratch AS b\nFROM b\n").image_base(),
            None
        );
    }

    #[test]
    fn source_date_epoch_past_year_9999_is_refused() {
        assert_eq!(parse_source_date_epoch(" 1700000000\n"), Ok(1_700_000_000));
        assert_eq!(
            parse_source_date_epoch("253402300799"),
            Ok(MAX_UNIX_SECONDS)
        );
        let e = parse_source_date_epoch("253402300800").unwrap_err();
        assert!(e.contains("up to 253402300799"), "{e}");
        let e = parse_source_date_epoch("18446744073709551615").unwrap_err();
        assert!(e.contains("past 9999"), "{e}");
        let e = parse_source_date_epoch("-1").unwrap_err();
        assert!(e.contains("not Unix seconds"), "{e}");
    }
}
