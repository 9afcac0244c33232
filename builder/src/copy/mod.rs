//! `COPY` and `ADD` (issue 5): copying sources into a writable root directory.
//!
//! [`copy_into`] reads the sources of one [`CopyStep`] from [`Sources`] (the build context
//! with its `.dockerignore`, or a read-only tree: another stage's or an image's root) and
//! writes them under `dest_root`, the step's writable merged root (the build driver mounts the
//! overlay; this module only sees directories). [`sources_digest`] hashes the same selection
//! for the build cache key.
//!
//! Semantics are Docker's (Dockerfile reference, "COPY" and "ADD"; BuildKit's behaviour where
//! the reference is silent):
//! - a source may be a glob (Go `filepath.Match`, per component, [`mode::glob_match`]); a
//!   directory source copies its *contents*; a symlink given as a source is followed (inside
//!   its root), symlinks inside a copied directory are copied as symlinks;
//! - a destination ending in `/`, or an existing directory, receives sources under their own
//!   names; otherwise a single file source is written *as* the destination (renamed); several
//!   sources need a directory destination; missing destination directories are created
//!   (0755, owned by the `--chown` owner, else root);
//! - files from the build context become root-owned, files from a tree keep their owner;
//!   `--chown user[:group]` names are looked up in the destination's `/etc/passwd` and
//!   `/etc/group` (a numeric user without a group gets gid = uid, Dockerfile reference
//!   "COPY --chown"); `--chmod` ([`mode::Chmod`]) applies to every copied file and directory;
//! - `--parents` keeps each source's path (from the root, or from a `/./` pivot in the
//!   source) under the destination; `--exclude` patterns (`.dockerignore` syntax) are matched
//!   against each copied path relative to its source, and against the source's own path;
//! - `ADD` of a local tar archive (plain, gzip, zstd, xz or bzip2, as Docker; told by content,
//!   not name) extracts it into the destination directory with [`crate::layer::apply_layer`]
//!   and its bounds;
//!   `ADD` of a URL copies the file [`fetch::fetch_urls`] downloaded beforehand (mode 0600),
//!   never unpacked; `ADD` of a git repository copies the contents of the checkout
//!   [`git::fetch_git`] made beforehand into the destination directory (as BuildKit copies
//!   `/` of its git source), root-owned unless `--chown`, `.dockerignore` not applied
//!   (it is not the context), `--exclude` and `--chmod` applied;
//! - `--link` changes how the driver stacks the result (on an empty root, as its own layer);
//!   here it only means names for `--chown` are looked up in [`CopyOptions::user_db_root`].
//!
//! How the build driver uses it, per `COPY`/`ADD` step: [`fetch::fetch_urls`] for URL
//! sources (on the host, async), [`Sources::with_downloads`], [`sources_digest`] for the
//! step's cache key, then, on a miss, [`copy_into`] onto the step's merged root (synchronous,
//! no threads: it may run in a forked child that holds the overlay mount).
//!
//! Hostile input: a source path that climbs above its root (`../x`) is refused; every path, on
//! both sides, is resolved inside its root by [`crate::rootfs::Root`] (symlinks, absolute or relative,
//! cannot lead out; a symlink in `dest_root` pointing at `/etc` means the root's `/etc`);
//! `.dockerignore` applies to what a symlink resolves to as well as to its own name; sizes and
//! counts are bounded by [`CopyLimits`]; FIFOs and devices are never opened; device nodes
//! from the context and character devices 0/0 (overlay whiteouts) are never written, nor are
//! `trusted.overlay.*` xattrs.

mod copier;
mod digest;
pub mod fetch;
pub mod git;
mod meta;
pub mod mode;
mod select;

pub(crate) use copier::*;
pub(crate) use meta::*;
pub(crate) use select::*;

use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{CopySource, CopyStep, SourceLocation};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat, Timespec, Timestamps, XattrFlags};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

pub use self::digest::{
    ContextFiles, MAX_CONTEXT_FILES, MAX_CONTEXT_PATH_BYTES, RestFiles, sources_digest,
    sources_digest_with_files,
};
use self::fetch::Downloads;
use self::mode::{Chmod, glob_match, has_glob};
use crate::layer::{LayerError, Limits as TarLimits};
use crate::rootfs::root::os;
use crate::rootfs::{Create, Resolved, Root, RootError, components};

/// How deep a copied (or hashed) directory tree may go below its source, in directories.
pub const MAX_TREE_DEPTH: usize = 1024;
/// Stack of the thread a copy or digest walks on, bytes (64 MiB of address space; only what
/// is used is backed). The walk recurses; a debug build needs about 10 KiB per level, so
/// [`MAX_TREE_DEPTH`] levels fit with room to spare (a test walks 1000), whatever stack the
/// caller's thread has (2 MiB for a spawned one).
const WALK_STACK_BYTES: usize = 64 << 20;

/// Runs `f` on a scoped thread with a [`WALK_STACK_BYTES`] stack.
fn on_walk_stack<T: Send>(f: impl FnOnce() -> Result<T, CopyError> + Send) -> Result<T, CopyError> {
    std::thread::scope(|s| {
        let h = std::thread::Builder::new()
            .name("kiln-copy".into())
            .stack_size(WALK_STACK_BYTES)
            .spawn_scoped(s, f)
            .map_err(|e| CopyError::Io {
                path: String::new(),
                op: "spawning the copy thread",
                source: e,
            })?;
        // A panic in the walk is a bug; carry it to the caller as one.
        h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Where a copy's sources are read from.
#[derive(Debug, Clone)]
pub enum SourceRoot {
    /// The build context: a directory and its parsed `.dockerignore`.
    Context {
        /// The context directory.
        dir: PathBuf,
        /// What `.dockerignore` leaves out (paths relative to `dir`).
        ignore: Dockerignore,
    },
    /// A read-only tree: an earlier stage's or an image's merged root.
    Tree {
        /// The root directory.
        root: PathBuf,
    },
}

/// The sources of one copy: a root, plus the files `ADD` downloaded for its URLs.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Paths are read from here.
    pub root: SourceRoot,
    /// URL sources, fetched beforehand by [`fetch::fetch_urls`] (empty when there are none).
    pub downloads: Downloads,
}

impl Sources {
    /// The build context `dir` with `ignore`.
    pub fn context(dir: impl Into<PathBuf>, ignore: Dockerignore) -> Sources {
        Sources {
            root: SourceRoot::Context {
                dir: dir.into(),
                ignore,
            },
            downloads: Downloads::default(),
        }
    }

    /// A read-only tree (another stage's or an image's root).
    pub fn tree(root: impl Into<PathBuf>) -> Sources {
        Sources {
            root: SourceRoot::Tree { root: root.into() },
            downloads: Downloads::default(),
        }
    }

    /// The same sources with `downloads` for the step's URLs.
    pub fn with_downloads(mut self, downloads: Downloads) -> Sources {
        self.downloads = downloads;
        self
    }

    fn dir(&self) -> &Path {
        match &self.root {
            SourceRoot::Context { dir, .. } => dir,
            SourceRoot::Tree { root } => root,
        }
    }

    fn ignore(&self) -> Option<&Dockerignore> {
        match &self.root {
            SourceRoot::Context { ignore, .. } => Some(ignore),
            SourceRoot::Tree { .. } => None,
        }
    }

    fn is_context(&self) -> bool {
        matches!(self.root, SourceRoot::Context { .. })
    }
}

/// Bounds on one copy (also used by [`sources_digest`]).
#[derive(Debug, Clone, Copy)]
pub struct CopyLimits {
    /// Total bytes of file content copied, bytes (default 32 GiB).
    pub max_total_bytes: u64,
    /// One file's size, bytes (default 16 GiB, as [`crate::layer::Limits`]).
    pub max_file_bytes: u64,
    /// Entries (files, directories, links) copied (default 4 Mi).
    pub max_entries: u64,
}

impl Default for CopyLimits {
    fn default() -> Self {
        CopyLimits {
            max_total_bytes: 32 << 30,
            max_file_bytes: 16 << 30,
            max_entries: 4 << 20,
        }
    }
}

/// How [`copy_into`] runs.
#[derive(Debug, Clone, Default)]
pub struct CopyOptions {
    /// Bounds on what is copied.
    pub limits: CopyLimits,
    /// Bounds on an archive `ADD` extracts.
    pub tar_limits: TarLimits,
    /// Root whose `/etc/passwd` and `/etc/group` resolve `--chown` names (default:
    /// `dest_root`; with `--link` the driver passes the stage's root while copying onto an
    /// empty one).
    pub user_db_root: Option<PathBuf>,
    /// The step's place in the recipe, put in front of every error message.
    pub location: Option<SourceLocation>,
}

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Regular files written.
    pub files: u64,
    /// Directories created or merged into.
    pub dirs: u64,
    /// Symlinks written.
    pub symlinks: u64,
    /// Devices and FIFOs written.
    pub specials: u64,
    /// Bytes of file content written (archives: uncompressed tar bytes read).
    pub bytes: u64,
    /// Archives extracted.
    pub archives: u64,
}

/// Why a copy (or its digest) failed. Messages name the source path as written.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The error, at a recipe location (`file:line`).
    #[error("{at}: {source}")]
    At {
        /// `file:line`.
        at: String,
        /// The error.
        source: Box<CopyError>,
    },
    /// A source path names nothing (or only what `.dockerignore` leaves out).
    #[error("source {path:?} not found{}", if *.ignored { " (excluded by .dockerignore)" } else { "" })]
    NotFound {
        /// The source as written.
        path: String,
        /// It exists but `.dockerignore` excludes it.
        ignored: bool,
    },
    /// A source path climbs above its root with `..`.
    #[error("source {path:?} is outside the build context (it climbs above its root)")]
    Escapes {
        /// The source as written.
        path: String,
    },
    /// A path could not be resolved inside its root.
    #[error("source {path:?}: {source}")]
    Resolve {
        /// The source or destination as written.
        path: String,
        /// The cause.
        source: RootError,
    },
    /// A name a file would be written under is not one plain path component (empty, `.`,
    /// `..`, or holding a `/` or NUL): a heredoc delimiter such as `../../x` or a URL's last
    /// segment used as a file name.
    #[error("{path:?}: {name:?} cannot be used as a file name (not a single path component)")]
    BadName {
        /// The source as written.
        path: String,
        /// The name.
        name: String,
    },
    /// Several sources (or a glob) and a destination that is not a directory.
    #[error("destination {dest:?} must be a directory ending in '/' when copying several sources")]
    NeedsDirectory {
        /// The destination as written.
        dest: String,
    },
    /// A destination (or one of its parents) exists and is not a directory.
    #[error("destination {dest:?} is not a directory")]
    NotADirectory {
        /// The destination path.
        dest: String,
    },
    /// A file or link would replace an existing directory.
    #[error("cannot replace directory {dest:?} with a non-directory from {path:?}")]
    ReplaceDirectory {
        /// The destination path.
        dest: String,
        /// The source as written.
        path: String,
    },
    /// A malformed glob or `--exclude` pattern.
    #[error("bad pattern {pattern:?}: {reason}")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// What is wrong.
        reason: String,
    },
    /// `--chown` names a user or group the destination's databases lack, or is malformed.
    #[error("--chown={spec}: {source}")]
    Chown {
        /// The `--chown` value.
        spec: String,
        /// The cause.
        source: crate::user::UserError,
    },
    /// A malformed `--chmod`.
    #[error("--chmod={spec}: {reason}")]
    Chmod {
        /// The `--chmod` value.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// A bound of [`CopyLimits`] was exceeded.
    #[error("source {path:?}: {what} limit of {max} exceeded")]
    Limit {
        /// The source as written.
        path: String,
        /// Which bound.
        what: &'static str,
        /// The bound.
        max: u64,
    },
    /// What kiln does not do.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Extracting a local archive failed.
    #[error("extracting {path:?}: {source}")]
    Archive {
        /// The source as written.
        path: String,
        /// The cause.
        source: LayerError,
    },
    /// A URL source with no download ([`fetch::fetch_urls`] was not run for the step).
    #[error("URL {url} was not downloaded before the copy")]
    NotDownloaded {
        /// The URL.
        url: String,
    },
    /// Fetching a URL failed.
    #[error(transparent)]
    Fetch(#[from] fetch::FetchError),
    /// A system call failed.
    #[error("{path:?}: {op}: {source}")]
    Io {
        /// The path concerned.
        path: String,
        /// The operation.
        op: &'static str,
        /// The cause.
        source: io::Error,
    },
}

impl CopyError {
    /// The error placed at `loc` (`file:line: ...`), unless it already has a place.
    pub fn at(self, loc: &SourceLocation) -> CopyError {
        match self {
            e @ CopyError::At { .. } => e,
            e => CopyError::At {
                at: format!("{}:{}", loc.file, loc.start_line),
                source: Box::new(e),
            },
        }
    }
}

fn ioe<'p>(path: &'p str, op: &'static str) -> impl FnOnce(Errno) -> CopyError + 'p {
    move |e| CopyError::Io {
        path: path.to_string(),
        op,
        source: e.into(),
    }
}

/// Creates directory `name` in `dir` private (0700) first, then gives it its owner and
/// `mode` through the opened fd, so it is never reachable with the wrong owner or bits.
fn create_owned_dir(
    dir: BorrowedFd<'_>,
    name: &[u8],
    uid: u32,
    gid: u32,
    mode: u32,
    shown: &str,
) -> Result<OwnedFd, CopyError> {
    rustix::fs::mkdirat(dir, os(name), Mode::from_raw_mode(0o700)).map_err(ioe(shown, "mkdir"))?;
    let fd = rustix::fs::openat(
        dir,
        os(name),
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(ioe(shown, "open"))?;
    rustix::fs::fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(ioe(shown, "chown"))?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(ioe(shown, "chmod"))?;
    Ok(fd)
}

/// Copies the sources of `step` from `src` into `dest_root` (a writable directory: the
/// step's merged root). Paths in `step` are absolute in the destination; see the module
/// documentation for the semantics. Needs root for owners and devices.
///
/// Errors: [`CopyError`], wrapped in [`CopyError::At`] when [`CopyOptions::location`] is set.
/// On error the destination may hold part of the copy (never anything outside `dest_root`).
pub fn copy_into(
    step: &CopyStep,
    src: &Sources,
    dest_root: &Path,
    opts: &CopyOptions,
) -> Result<CopyReport, CopyError> {
    let r = on_walk_stack(|| copy_inner(step, src, dest_root, opts));
    match (&opts.location, r) {
        (Some(loc), Err(e)) => Err(e.at(loc)),
        (_, r) => r,
    }
}
#[cfg(test)]
mod git_tests;
#[cfg(test)]
mod tests;
