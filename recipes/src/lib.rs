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
    let text = std::str::from_utf8(bytes).map_err(|e| utf8_error(path, bytes, e.valid_up_to()))?;
    dockerfile::lower::lower(path, text, options)
        .map_err(|f| RecipeError::at_offset(path, text, f.offset, f.kind))
}

/// Lowers a YAML recipe whatever its name.
pub fn load_yaml(path: &str, bytes: &[u8], options: &Options) -> Result<BuildPlan, RecipeError> {
    let text = std::str::from_utf8(bytes).map_err(|e| utf8_error(path, bytes, e.valid_up_to()))?;
    yaml::lower(path, text, options)
}

fn utf8_error(path: &str, bytes: &[u8], valid_up_to: usize) -> RecipeError {
    // The prefix up to `valid_up_to` is valid UTF-8 by definition of `valid_up_to`.
    let text = std::str::from_utf8(&bytes[..valid_up_to]).unwrap_or("");
    RecipeError::at_offset(path, text, valid_up_to, RecipeErrorKind::NotUtf8)
}
