//! The errors of a build ([`BuildError`]): what failed, with the recipe file and line for
//! a step, and the conversions from the errors of the parts a build calls.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::lower::LowerError;
use super::merged;
use crate::cache::CacheError;
use crate::exec::ExecError;

/// Errors of a build. Step failures name the recipe file and line.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A step failed (non-zero exit, limit, setup problem). Display: `file:line: what:
    /// why`, then the last log lines, indented.
    /// The executor's error is part of this message, not a `source()`, so an error chain
    /// printed by the CLI does not say it twice.
    #[error("{location}: {instruction}: {error}{}", tail_text(.error))]
    Step {
        /// `file:line`.
        location: String,
        /// The step, shortened.
        instruction: String,
        /// What the executor said.
        error: ExecError,
    },
    /// The build's timeout passed. Display: `file:line: build timeout of Ns exceeded`, then,
    /// when a step was running, `: <step>: <what was killed>`.
    #[error("{location}: build timeout of {}s exceeded{}", .after.as_secs(),
        .stopped.as_ref().map(|s| format!(": {s}")).unwrap_or_default())]
    Timeout {
        /// Where the build was.
        location: String,
        /// The build's timeout.
        after: Duration,
        /// The step that was running and what was killed of it
        /// ([`crate::exec::STOPPED_VM`]...), when a step was running.
        stopped: Option<String>,
    },
    /// The build was cancelled (SIGINT, SIGTERM, or the caller's flag).
    #[error("build cancelled")]
    Cancelled,
    /// Something the driver does not do yet.
    #[error("{location}: unsupported: {what}")]
    Unsupported {
        /// `file:line`.
        location: String,
        /// What.
        what: String,
    },
    /// The plan and its resolved bases do not match.
    #[error("invalid plan: {0}")]
    Plan(String),
    /// A base image's manifest or config is missing or malformed.
    #[error("stage {stage}: base image {digest}: {reason}")]
    Base {
        /// Stage index.
        stage: usize,
        /// Manifest digest.
        digest: kiln_store::BlobDigest,
        /// What is wrong.
        reason: String,
    },
    /// Preparing lower directories failed.
    #[error(transparent)]
    Lower(#[from] LowerError),
    /// The blob cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The store (cache entries) failed.
    #[error(transparent)]
    Store(Box<kiln_store::StoreError>),
    /// Work on a merged view failed.
    #[error("{location}: {source}")]
    Merged {
        /// `file:line`.
        location: String,
        /// Why.
        source: merged::MergedError,
    },
    /// The host file system ran out of space ([`crate::space`]).
    #[error(transparent)]
    NoSpace(#[from] kiln_store::space::NoSpace),
    /// A file-system operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A worker task died.
    #[error("internal: a build task failed: {0}")]
    Task(String),
    /// A `COPY`/`ADD` could not select, fetch or hash its sources.
    #[error("{location}: {message}")]
    Copy {
        /// `file:line`.
        location: String,
        /// Why.
        message: String,
    },
    /// The recipe does not lower into a plan.
    #[error(transparent)]
    Recipe(Box<kiln_recipes::RecipeError>),
    /// A base could not be resolved.
    #[error(transparent)]
    Resolve(Box<crate::resolve::ResolveError>),
}

impl From<kiln_store::StoreError> for BuildError {
    fn from(e: kiln_store::StoreError) -> Self {
        BuildError::Store(Box::new(e))
    }
}

impl From<kiln_recipes::RecipeError> for BuildError {
    fn from(e: kiln_recipes::RecipeError) -> Self {
        BuildError::Recipe(Box::new(e))
    }
}

impl From<crate::resolve::ResolveError> for BuildError {
    fn from(e: crate::resolve::ResolveError) -> Self {
        BuildError::Resolve(Box::new(e))
    }
}

fn tail_text(e: &ExecError) -> String {
    let tail = match e {
        ExecError::Failed { tail, .. }
        | ExecError::Signaled { tail, .. }
        | ExecError::MemoryLimit { tail, .. }
        | ExecError::PidsLimit { tail, .. }
        | ExecError::DiskFull { tail, .. } => tail,
        _ => return String::new(),
    };
    if tail.is_empty() {
        return String::new();
    }
    let mut s = String::from("\nlast log lines:");
    for l in tail {
        s.push_str("\n  ");
        s.push_str(l);
    }
    s
}

impl BuildError {
    /// The exit code of a failed command, if that is what failed.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            BuildError::Step {
                error: ExecError::Failed { exit_code, .. },
                ..
            } => Some(*exit_code),
            _ => None,
        }
    }
}

pub(super) fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> BuildError + 'a {
    move |source| {
        if kiln_store::space::is_no_space(&source) {
            return kiln_store::space::NoSpace::at(what, path, None).into();
        }
        BuildError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}
