//! kiln-recipes: the front ends.
//!
//! A Dockerfile or a YAML recipe goes in; one [`plan::BuildPlan`] comes out. The crate is pure:
//! it reads only the bytes it is handed and never touches the network or the file system
//! beyond the files named by its caller.
//!
//! - [`load`] picks the front end by file name (`.yaml`/`.yml`: [`yaml`], anything else: a
//!   Dockerfile) and returns the plan or a [`RecipeError`] whose Display is
//!   `file:line:column: message` plus a caret snippet.
//! - [`dockerfile`]: `syntax` (parse-dockerfile plus heredoc handling), `instructions`
//!   (typed instructions), `lower` (ARG scoping, stages, image config) — BuildKit semantics.
//! - [`shell_words`]: BuildKit's variable substitution (`$VAR`, `${VAR:-word}`, ...).
//! - [`yaml`]: the kiln YAML recipe schema.
//! - [`plan`]: the `BuildPlan` type and [`plan::plan_to_json`].

use std::collections::BTreeMap;

pub mod dockerfile;
pub mod dockerignore;
pub mod error;
pub mod git;
pub mod plan;
pub mod shell_words;
pub mod yaml;

pub use error::{RecipeError, RecipeErrorKind};
pub use plan::{BuildPlan, plan_to_json};

/// Build options given by the caller (the CLI flags of `kiln plan` / `kiln build`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// Stage to build (`--target`, name or index); `None`: the last stage.
    pub target: Option<String>,
    /// `--build-arg NAME=value` pairs.
    pub build_args: BTreeMap<String, String>,
    /// Target platform `os/arch[/variant]` (`--platform`); `None`: `linux/amd64`.
    pub platform: Option<String>,
    /// Platform the build runs on; `None`: `linux/amd64`.
    pub build_platform: Option<String>,
    /// Disk size in MiB (`--disk-mib`); overrides the recipe's.
    pub disk_mib: Option<u64>,
    /// What the caller knows of base images, by reference as written after substitution
    /// (the builder's second pass, once it has resolved them). With it, `$VAR` from a base
    /// image's env expands as BuildKit expands it, steps carry the full env, steps start
    /// in the base's working directory as its user, and the stage's image config (hence the
    /// start command) inherits that env, user and working directory, as a Docker image
    /// built `FROM` the base does; without it `$PATH` is Docker's default PATH, other base
    /// variables expand to empty (with a warning), and steps start in `/` as the base's
    /// (unknown) user. Either way the builder merges the rest of the base's config
    /// (entrypoint, cmd, labels, ...) under the plan's, as [`plan::Stage::config`] says.
    pub base_images: BTreeMap<String, BaseImage>,
}

/// The parts of a base image's OCI config that lowering depends on (OCI image spec,
/// `config.Env`, `config.WorkingDir`, `config.User`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BaseImage {
    /// `Env`, each `KEY=value`.
    pub env: Vec<String>,
    /// `WorkingDir` (`None`: `/`).
    pub workdir: Option<String>,
    /// `User` (`None`: root).
    pub user: Option<String>,
    /// `OnBuild`: the base's ONBUILD triggers, each one Dockerfile instruction as written
    /// (e.g. `RUN make`). Lowering runs them right after the stage's FROM, in the stage's
    /// context, before the stage's own instructions, as Docker does; the stage's image does
    /// not inherit them. A trigger that is not exactly one instruction, or is `FROM`,
    /// `MAINTAINER` or `ONBUILD`, is an error naming the trigger.
    pub onbuild: Vec<String>,
}

/// Which front end a file name selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecipeFormat {
    /// A Dockerfile (any name not ending in `.yaml` or `.yml`).
    Dockerfile,
    /// A YAML recipe (`*.yaml`, `*.yml`).
    Yaml,
}

impl RecipeFormat {
    /// The format for a file path, by its extension (case-insensitive).
    pub fn for_path(path: &str) -> RecipeFormat {
        let lower = path.to_ascii_lowercase();
        if lower.ends_with(".yaml") || lower.ends_with(".yml") {
            RecipeFormat::Yaml
        } else {
            RecipeFormat::Dockerfile
        }
    }
}

/// Largest recipe accepted, bytes (4 MiB; real Dockerfiles are a few KiB, heredoc-heavy
/// ones rarely reach 100 KiB).
pub const MAX_RECIPE_BYTES: usize = 4 << 20;

fn check_size(path: &str, bytes: &[u8]) -> Result<(), RecipeError> {
    if bytes.len() > MAX_RECIPE_BYTES {
        return Err(RecipeError::unlocated(
            path,
            RecipeErrorKind::TooLarge(bytes.len()),
        ));
    }
    Ok(())
}

/// Lowers the recipe `bytes`, named `path` (used in locations and to pick the front end by
/// [`RecipeFormat::for_path`]), into a [`BuildPlan`].
///
/// Errors: a [`RecipeError`] located at the offending line and column; never panics on
/// any input.
pub fn load(path: &str, bytes: &[u8], options: &Options) -> Result<BuildPlan, RecipeError> {
    match RecipeFormat::for_path(path) {
        RecipeFormat::Dockerfile => load_dockerfile(path, bytes, options),
        RecipeFormat::Yaml => load_yaml(path, bytes, options),
    }
}

/// Lowers a Dockerfile whatever its name.
pub fn load_dockerfile(
    path: &str,
    bytes: &[u8],
    options: &Options,
) -> Result<BuildPlan, RecipeError> {
    check_size(path, bytes)?;
    let text = std::str::from_utf8(bytes).map_err(|e| utf8_error(path, bytes, e.valid_up_to()))?;
    // A UTF-8 byte order mark is not part of the first line (BuildKit strips it too).
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    dockerfile::lower::lower(path, text, options)
        .map_err(|f| RecipeError::at_offset(path, text, f.offset, f.kind))
}

/// Lowers a YAML recipe whatever its name.
pub fn load_yaml(path: &str, bytes: &[u8], options: &Options) -> Result<BuildPlan, RecipeError> {
    check_size(path, bytes)?;
    let text = std::str::from_utf8(bytes).map_err(|e| utf8_error(path, bytes, e.valid_up_to()))?;
    yaml::lower(path, text, options)
}

/// The `smoke:` checks of the YAML recipe `bytes` named `path` ([`yaml::smoke_checks`]);
/// a Dockerfile has none.
pub fn smoke_checks(path: &str, bytes: &[u8]) -> Result<Vec<yaml::SmokeCheck>, RecipeError> {
    if RecipeFormat::for_path(path) != RecipeFormat::Yaml {
        return Ok(Vec::new());
    }
    check_size(path, bytes)?;
    let text = std::str::from_utf8(bytes).map_err(|e| utf8_error(path, bytes, e.valid_up_to()))?;
    yaml::smoke_checks(path, text)
}

fn utf8_error(path: &str, bytes: &[u8], valid_up_to: usize) -> RecipeError {
    // The prefix up to `valid_up_to` is valid UTF-8 by definition of `valid_up_to`.
    let text = std::str::from_utf8(&bytes[..valid_up_to]).unwrap_or("");
    RecipeError::at_offset(path, text, valid_up_to, RecipeErrorKind::NotUtf8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds for the mutation test: one of each feature.
    const SEEDS: [&str; 6] = [
        "# syntax=docker/dockerfile:1\nARG V=1\nFROM alpine:$V AS a\nENV A=${V:-x} B=\"q $V\"\nRUN --mount=type=cache,target=/c echo \\\n  hi\nCOPY --from=a --chmod=0755 x* /d/\n",
        "FROM scratch\nRUN <<EOF cat - <<-'E2'\nbody $X\nEOF\n\tline\n\tE2\nCOPY <<A <<B /etc/\na\nA\nb\nB\n",
        "FROM x AS b\nONBUILD RUN make\nHEALTHCHECK --interval=5s CMD [\"true\"]\nFROM b\nENTRYPOINT [\"/e\"]\nCMD a b\nEXPOSE 80-82/udp\nLABEL kiln.disk-mib=10\n",
        "# escape=`\nFROM x\nRUN echo `\n  a\nSHELL [\"bash\", \"-c\"]\nWORKDIR ${W:-/w}\nUSER ${U#u}\nSTOPSIGNAL SIGTERM\nVOLUME [\"/v\"]\n",
        "from: debian:bookworm\nargs: {A: \"1\"}\nfiles:\n  - {src: a, dest: /b, mode: \"0644\"}\nenv: {E: x}\ncommands: [\"echo\", [\"ls\", \"-l\"]]\nuser: u\nworkdir: /w\nstart: {command: s}\nready: {command: r, interval: 1s}\nlimits: {timeout: 1m, memory: 64}\n",
        "from: {bootstrap: {distro: debian, suite: bookworm, include: [curl]}}\nnetwork: none\ndisk_mib: 4096\nlabels: {a: b}\n",
    ];

    #[test]
    fn oversized_recipes_are_refused() {
        let big = vec![b'#'; MAX_RECIPE_BYTES + 1];
        for name in ["Dockerfile", "r.yaml"] {
            let e = load(name, &big, &Options::default()).unwrap_err();
            assert!(matches!(e.kind, RecipeErrorKind::TooLarge(_)), "{e}");
        }
    }

    #[test]
    fn amplification_through_steps_is_refused() {
        // Each line doubles A (up to the per-word cap), then thousands of RUN steps would
        // each carry it in their env.
        let mut text = String::from("FROM scratch\nENV A=0123456789abcdef\n");
        for _ in 0..16 {
            text.push_str("ENV A=$A$A\n");
        }
        text.push_str(&"RUN true\n".repeat(200));
        let e = load("Dockerfile", text.as_bytes(), &Options::default()).unwrap_err();
        assert!(e.to_string().contains("larger than 64 MiB"), "{e}");
        let mut text = String::from("FROM scratch\nENV A=0123456789abcdef\n");
        for _ in 0..20 {
            text.push_str("ENV A=$A$A\n");
        }
        let e = load("Dockerfile", text.as_bytes(), &Options::default()).unwrap_err();
        assert!(e.to_string().contains("more than 1048576 bytes"), "{e}");
    }

    #[test]
    fn wide_env_stays_linear() {
        let pairs: String = (0..100_000).map(|i| format!(" V{i}=1")).collect();
        let text = format!("FROM scratch\nENV{pairs}\nENV X=$V99999\n");
        let plan = load("Dockerfile", text.as_bytes(), &Options::default()).unwrap();
        assert!(plan.stages[0].config.env.contains(&"X=1".to_string()));
    }

    #[test]
    fn many_env_and_arg_lines_end_quickly() {
        let mut text = String::from("FROM scratch\n");
        for i in 0..8_000 {
            text.push_str(&format!("ARG A{i}=1\nENV E{i}=$A{i}\n"));
        }
        // Either a plan or the size error; what matters is that it ends (a quadratic
        // implementation takes minutes here).
        match load("Dockerfile", text.as_bytes(), &Options::default()) {
            Ok(_) => {}
            Err(e) => assert!(e.to_string().contains("larger than"), "{e}"),
        }
    }

    /// Mutates the seeds byte by byte (a small LCG, fixed seed, so failures reproduce) and
    /// checks every outcome is a plan or a located error: no panic, no hang.
    #[test]
    fn mutated_recipes_never_panic() {
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as usize
        };
        let alphabet = b"\\`$'\"{}[]<>-=:#\n\t /*?!,.0123456789ABCDEFEOF";
        for round in 0..20_000 {
            let seed = SEEDS[round % SEEDS.len()];
            let mut bytes = seed.as_bytes().to_vec();
            for _ in 0..(1 + next() % 6) {
                let at = next() % (bytes.len() + 1);
                match next() % 4 {
                    0 if at < bytes.len() => {
                        bytes.remove(at);
                    }
                    1 => bytes.insert(at, alphabet[next() % alphabet.len()]),
                    2 if at < bytes.len() => bytes[at] = alphabet[next() % alphabet.len()],
                    _ => {
                        let from = next() % bytes.len();
                        let len = (next() % 16).min(bytes.len() - from);
                        let chunk: Vec<u8> = bytes[from..from + len].to_vec();
                        bytes.splice(at..at, chunk);
                    }
                }
            }
            let name = if round % SEEDS.len() >= 4 {
                "r.yaml"
            } else {
                "Dockerfile"
            };
            match load(name, &bytes, &Options::default()) {
                Ok(plan) => {
                    let _ = plan_to_json(&plan);
                }
                Err(e) => {
                    let text = e.to_string();
                    assert!(text.starts_with(name), "round {round}: {text}");
                }
            }
        }
    }
}
