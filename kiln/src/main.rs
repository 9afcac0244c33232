//! The `kiln` binary: CLI and HTTP service. Thin: parse, wire, print.
//!
//! Exit codes (every subcommand): see [`cmd::exit`].

mod cmd;
mod config;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kiln: image builder and snapshot store for microVM sandboxes.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about)]
struct Cli {
    /// Print one JSON object per line on stdout (events, results, errors) instead of text;
    /// `plan` prints the plan as one indented JSON document (its errors stay text on stderr).
    #[arg(long, global = true)]
    json: bool,
    /// More log output on stderr: -v info, -vv debug, -vvv trace (else $KILN_LOG, the config
    /// file's `log`, or warnings only).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

/// The subcommands, one module each under `cmd/`.
// Parsed once per process; boxing `build`'s many flags would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Build a Dockerfile or YAML recipe into the local store; prints the image digest.
    Build(Box<cmd::build::Args>),
    /// Lower a Dockerfile or YAML recipe into a build plan and print it.
    Plan(cmd::plan::PlanArgs),
    /// Fetch an image from a registry into the local store.
    Pull(cmd::pull::Args),
    /// Upload an image from the local store to a registry.
    Push(cmd::push::Args),
    /// Store registry credentials where Docker keeps them.
    Login(cmd::login::Args),
    /// Copy an image from an OCI layout (oci:DIR[:TAG]) into the local store.
    Import(cmd::import::Args),
    /// Write an image from the local store as an OCI layout.
    Export(cmd::export::Args),
    /// Write an image's root filesystem into a directory.
    Unpack(cmd::unpack::Args),
    /// Point NAME:TAG at a manifest (by digest or by another tag).
    Tag(cmd::tag::Args),
    /// List tags, optionally of one NAME.
    Tags(cmd::tags::Args),
    /// Remove a tag.
    Untag(cmd::untag::Args),
    /// Fetch the guest kernel and build its initramfs; prints `export KILN_KERNEL=…` lines.
    Kernel(cmd::kernel::Args),
    /// Boot an image once and store its snapshot.
    Snapshot(cmd::snapshot::Args),
    /// Start clones of an image's snapshot on this host.
    Start(cmd::start::Args),
    /// List clones started on this host.
    Ps(cmd::ps::Args),
    /// Stop clones started on this host.
    Stop(cmd::stop::Args),
    /// Run a command in a running clone; exits with its exit code (125/126/127: see README).
    Exec(cmd::exec::Args),
    /// Rebuild an image with fresh inputs, smoke-test a clone, promote its tag on success.
    Nightly(Box<cmd::nightly::Args>),
    /// Store maintenance and copies between stores.
    #[command(subcommand)]
    Store(cmd::store::Command),
    /// List the images of the store (tags naming image manifests).
    Images(cmd::images::Args),
    /// Show one image: sizes, chunk table, file system, config, sandbox, provenance.
    Inspect(cmd::inspect::Args),
    /// Remove image tags (the data stays until `kiln store gc`).
    Rmi(cmd::rmi::Args),
    /// Run the custom-image HTTP API; `keys create|revoke` manage its API keys.
    Serve(Box<cmd::serve::Args>),
    /// Show the configuration (flags, then environment, then config file, then defaults).
    #[command(subcommand)]
    Config(cmd::config::Command),
    /// The chunk server `kiln start` spawns (not for people).
    #[command(name = "__lazy-serve", hide = true)]
    LazyServe(cmd::lazy_serve::Args),
}

fn main() -> ExitCode {
    quiet_broken_pipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // `kiln exec`'s own failures, usage errors included, are 125 as in `docker exec`, so
        // that they cannot pass for the command's exit code 2.
        Err(e) if e.use_stderr() && subcommand_is("exec") => {
            let _ = e.print();
            return ExitCode::from(cmd::exec::KILN_ERROR);
        }
        Err(e) => e.exit(),
    };
    // A broken configuration is reported by the commands that need it; logging falls back.
    let log = config::Config::load(&config::Flags {
        verbose: cli.verbose,
        ..config::Flags::default()
    })
    .map_or_else(|_| "warn".to_string(), |c| c.log.value);
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(log))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(cmd::progress::LogWriter)
        .try_init();
    // Every QEMU started as root runs in a cgroup of its own (issue 37).
    kiln_pipeline::qemu_cgroups::install();
    let out = cmd::Out::new(cli.json);
    match cli.command {
        // Without root: the same command again, as root of a user namespace.
        Command::Build(a) if !kiln_builder::exec::rootless::is_root() => {
            match cmd::build::run_without_root(&a) {
                Ok(code) => ExitCode::from(code),
                Err(e) => cmd::report(&out, Err(e)),
            }
        }
        Command::Build(a) => cmd::report(&out, cmd::build::run(*a, &out)),
        // A user with subordinate ids may have built without root: the unpacked layers of
        // its store belong to those ids too, and only the namespace may remove them.
        Command::Store(cmd::store::Command::Gc(_))
            if !kiln_builder::exec::rootless::is_root()
                && kiln_builder::exec::rootless::subordinate_ids().is_ok() =>
        {
            match kiln_builder::exec::rootless::reexec() {
                Ok(code) => ExitCode::from(code),
                Err(e) => cmd::report(&out, Err(e.into())),
            }
        }
        Command::Plan(a) => cmd::plan::run(&a, out.json),
        // These run their own runtime.
        Command::Pull(a) => cmd::report(&out, cmd::pull::run(a)),
        Command::Push(a) => cmd::report(&out, cmd::push::run(a)),
        Command::Login(a) => cmd::report(&out, cmd::login::run(a)),
        Command::Import(a) => cmd::report(&out, cmd::import::run(a)),
        Command::Export(a) => cmd::report(&out, cmd::export::run(a)),
        Command::Unpack(a) => cmd::report(&out, cmd::unpack::run(a)),
        Command::Tag(a) => cmd::run(&out, async |out| cmd::tag::run(out, a).await),
        Command::Tags(a) => cmd::run(&out, async |out| cmd::tags::run(out, a).await),
        Command::Untag(a) => cmd::run(&out, async |out| cmd::untag::run(out, a).await),
        Command::Kernel(a) => cmd::run(&out, async |out| cmd::kernel::run(out, a).await),
        Command::Snapshot(a) => cmd::run(&out, async |out| cmd::snapshot::run(out, a).await),
        Command::Start(a) => cmd::run(&out, async |out| cmd::start::run(out, a).await),
        Command::Ps(a) => cmd::run(&out, async |out| cmd::ps::run(out, a).await),
        Command::Stop(a) => cmd::run(&out, async |out| cmd::stop::run(out, a).await),
        Command::Exec(a) => cmd::exec::main(&out, a),
        Command::Nightly(a) => cmd::run(&out, async |out| cmd::nightly::run(out, *a).await),
        Command::Store(c) => cmd::run(&out, async |out| cmd::store::run(out, c).await),
        Command::Images(a) => cmd::run(&out, async |out| cmd::images::run(out, a).await),
        Command::Inspect(a) => cmd::run(&out, async |out| cmd::inspect::run(out, a).await),
        Command::Rmi(a) => cmd::run(&out, async |out| cmd::rmi::run(out, a).await),
        Command::Serve(a) => cmd::report(&out, cmd::serve::run(*a)),
        Command::Config(c) => cmd::report_cmd(&out, cmd::config::run(&out, c, cli.verbose)),
        // Forks: no runtime may exist yet.
        Command::LazyServe(a) => cmd::lazy_serve::main(a),
    }
}

/// Whether the first argument that is not a flag (the global flags take no values) names
/// the subcommand `name`.
fn subcommand_is(name: &str) -> bool {
    std::env::args_os()
        .skip(1)
        .find(|a| !a.to_string_lossy().starts_with('-'))
        .is_some_and(|a| a == name)
}

/// `kiln images | head -1`: when the reader of stdout goes away, `println!` panics with
/// "failed printing to stdout: Broken pipe". Like other command-line tools, exit quietly with
/// the shell's code for a SIGPIPE death (128 + 13) instead of printing a panic. SIGPIPE itself
/// stays ignored (Rust's default), because kiln also writes to sockets (S3, registries, QMP,
/// the guest channel), where a peer that went away must be an error, not a killed process.
fn quiet_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

#[cfg(test)]
mod tests {
    /// clap's own checks of the whole command tree (unique argument names across flattened
    /// groups, valid defaults, ...), which otherwise run only when a subcommand is parsed.
    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory as _;
        super::Cli::command().debug_assert();
    }
}
