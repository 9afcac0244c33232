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
//! both sides, is resolved inside its root by [`root::Root`] (symlinks, absolute or relative,
//! cannot lead out; a symlink in `dest_root` pointing at `/etc` means the root's `/etc`);
//! `.dockerignore` applies to what a symlink resolves to as well as to its own name; sizes and
//! counts are bounded by [`CopyLimits`]; FIFOs and devices are never opened; device nodes
//! from the context and character devices 0/0 (overlay whiteouts) are never written, nor are
//! `trusted.overlay.*` xattrs.

mod digest;
pub mod fetch;
pub mod git;
pub mod mode;
pub mod root;

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
use self::root::{Create, Resolved, Root, RootError, components, os};
use crate::layer::{LayerError, Limits as TarLimits};

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
        source: crate::exec::UserError,
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

/// One selected source.
#[allow(clippy::large_enum_variant)] // a handful per step
pub(crate) enum Item {
    /// A path in the source root.
    Path {
        /// The source as written.
        shown: String,
        /// What it resolved to (exists).
        node: Resolved,
        /// Path to keep under the destination with `--parents` (the match's components
        /// after the pivot), including the name.
        keep: Vec<Vec<u8>>,
        /// The name it is copied under (the last component of the match, as written).
        name: Vec<u8>,
    },
    /// A fetched git source: the contents of its tree.
    Git {
        /// The source as written.
        url: String,
        /// The checkout (or its subdirectory).
        tree: PathBuf,
        /// The commit.
        commit: String,
    },
    /// A downloaded URL.
    Download {
        /// The URL.
        url: String,
        /// The file holding its content.
        file: PathBuf,
        /// The name it is copied under (last segment of the URL path).
        name: String,
    },
    /// Heredoc content.
    Inline {
        /// File name.
        name: String,
        /// Content.
        data: Vec<u8>,
        /// Mode (permission bits).
        mode: u32,
    },
}

/// Path filtering shared by the copy and the digest: `.dockerignore` (context only, on paths
/// relative to the context root) and `--exclude` (on paths relative to the source).
pub(crate) struct Filter<'a> {
    ignore: Option<&'a Dockerignore>,
    exclude: Dockerignore,
}

/// What a filter says about one path.
#[derive(PartialEq, Eq)]
pub(crate) enum Verdict {
    Keep,
    Skip,
    /// An excluded directory that exception patterns may reach into: look inside, but only
    /// what is kept there counts.
    Descend,
}

impl<'a> Filter<'a> {
    pub(crate) fn new(step: &CopyStep, src: &'a Sources) -> Result<Filter<'a>, CopyError> {
        let exclude = Dockerignore::parse("--exclude", step.exclude.join("\n").as_bytes())
            .map_err(|e| CopyError::Pattern {
                pattern: step.exclude.join(" "),
                reason: e.to_string(),
            })?;
        Ok(Filter {
            ignore: src.ignore(),
            exclude,
        })
    }

    /// The same `--exclude`, without `.dockerignore`.
    pub(crate) fn without_ignore(&self) -> Filter<'a> {
        Filter {
            ignore: None,
            exclude: self.exclude.clone(),
        }
    }

    pub(crate) fn verdict(&self, ctx_rel: &str, src_rel: &str, is_dir: bool) -> Verdict {
        let mut v = Verdict::Keep;
        for (m, p) in [(self.ignore, ctx_rel), (Some(&self.exclude), src_rel)] {
            let Some(m) = m else { continue };
            if !p.is_empty() && m.matches(p) {
                if is_dir && m.has_exceptions() {
                    v = Verdict::Descend;
                } else {
                    return Verdict::Skip;
                }
            }
        }
        v
    }
}

fn lossy(c: &[Vec<u8>]) -> String {
    c.iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

fn join(a: &str, b: &[u8]) -> String {
    let b = String::from_utf8_lossy(b);
    if a.is_empty() {
        b.into_owned()
    } else {
        format!("{a}/{b}")
    }
}

/// Lists the names in `dir` (without `.` and `..`), sorted bytewise.
pub(crate) fn list(dir: BorrowedFd<'_>, shown: &str) -> Result<Vec<Vec<u8>>, CopyError> {
    let mut out = Vec::new();
    let d = rustix::fs::Dir::read_from(dir).map_err(ioe(shown, "readdir"))?;
    for ent in d {
        let ent = ent.map_err(ioe(shown, "readdir"))?;
        let n = ent.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(n.to_vec());
        }
    }
    out.sort();
    Ok(out)
}

/// Expands the step's sources into items, in order.
pub(crate) fn select(
    step: &CopyStep,
    src: &Sources,
    root: &Root,
    filter: &Filter<'_>,
) -> Result<Vec<Item>, CopyError> {
    let mut items = Vec::new();
    for source in &step.sources {
        match source {
            CopySource::Path { path } => select_path(path, src, root, filter, &mut items)?,
            CopySource::Url { url } => {
                let d = src
                    .downloads
                    .get(url)
                    .ok_or_else(|| CopyError::NotDownloaded { url: url.clone() })?;
                items.push(Item::Download {
                    url: url.clone(),
                    file: d.file.clone(),
                    name: d.name.clone(),
                });
            }
            CopySource::Git { url } => {
                let c = src
                    .downloads
                    .git(url)
                    .ok_or_else(|| CopyError::NotDownloaded { url: url.clone() })?;
                items.push(Item::Git {
                    url: url.clone(),
                    tree: c.tree.clone(),
                    commit: c.commit.clone(),
                });
            }
            CopySource::Inline(f) => items.push(Item::Inline {
                name: f.name.clone(),
                data: f.data.clone().into_bytes(),
                mode: f.mode & 0o7777,
            }),
        }
    }
    Ok(items)
}

fn select_path(
    path: &str,
    src: &Sources,
    root: &Root,
    filter: &Filter<'_>,
    items: &mut Vec<Item>,
) -> Result<(), CopyError> {
    // Lexical climb check on the path as written.
    let mut depth = 0i64;
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    return Err(CopyError::Escapes { path: path.into() });
                }
            }
            _ => depth += 1,
        }
    }
    // `--parents` pivot: what comes before a `/./` is not kept.
    let pivot = path
        .find("/./")
        .map(|i| components(&kiln_recipes::dockerignore::clean(&path[..i])).len())
        .unwrap_or(0);
    let comps = components(&kiln_recipes::dockerignore::clean(path));
    let mut matches: Vec<Vec<Vec<u8>>> = vec![Vec::new()];
    let mut globbed = false;
    for c in &comps {
        let pat = String::from_utf8_lossy(c).into_owned();
        if !has_glob(&pat) {
            for m in &mut matches {
                m.push(c.clone());
            }
            continue;
        }
        globbed = true;
        // Validate once, so a bad pattern fails even with nothing to match.
        glob_match(&pat, "").map_err(|reason| CopyError::Pattern {
            pattern: path.into(),
            reason,
        })?;
        let mut next = Vec::new();
        for m in &matches {
            let r = match root.resolve(m, true, None) {
                Ok(r) => r,
                Err(RootError::NotFound { .. } | RootError::NotADirectory { .. }) => continue,
                Err(source) => {
                    return Err(CopyError::Resolve {
                        path: path.into(),
                        source,
                    });
                }
            };
            if r.stat
                .is_none_or(|s| FileType::from_raw_mode(s.st_mode) != FileType::Directory)
            {
                continue;
            }
            let dir = r.open_dir().map_err(|e| CopyError::Io {
                path: path.into(),
                op: "open",
                source: e,
            })?;
            for name in list(dir.as_fd(), path)? {
                let s = String::from_utf8_lossy(&name);
                if glob_match(&pat, &s).unwrap_or(false) {
                    // Names .dockerignore leaves out are not in the context at all.
                    let mut resolved = r.comps.clone();
                    resolved.push(name.clone());
                    if let Some(ig) = src.ignore()
                        && ig.matches(&lossy(&resolved))
                    {
                        continue;
                    }
                    let mut m2 = m.clone();
                    m2.push(name);
                    next.push(m2);
                }
            }
        }
        matches = next;
    }
    let mut found = 0;
    for m in matches {
        let node = match root.resolve(&m, true, None) {
            Ok(r) => r,
            Err(RootError::NotFound { .. } | RootError::NotADirectory { .. }) if globbed => {
                continue;
            }
            Err(RootError::NotFound { .. } | RootError::NotADirectory { .. }) => {
                return Err(CopyError::NotFound {
                    path: path.into(),
                    ignored: false,
                });
            }
            Err(source) => {
                return Err(CopyError::Resolve {
                    path: path.into(),
                    source,
                });
            }
        };
        let Some(st) = node.stat else {
            if globbed {
                continue;
            }
            return Err(CopyError::NotFound {
                path: path.into(),
                ignored: false,
            });
        };
        let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
        // `.dockerignore` on both the name as written and what it resolved to.
        if let Some(ig) = src.ignore() {
            let lexical = lossy(&m);
            let resolved = node.rel();
            let hit = |p: &str| !p.is_empty() && ig.matches(p);
            if (hit(&lexical) || hit(&resolved)) && !(is_dir && ig.has_exceptions()) {
                if globbed {
                    continue;
                }
                return Err(CopyError::NotFound {
                    path: path.into(),
                    ignored: true,
                });
            }
        }
        // `--exclude` on the source's own path and name.
        let name = m.last().cloned().unwrap_or_default();
        let lexical = lossy(&m);
        if !lexical.is_empty()
            && (filter.exclude.matches(&lexical)
                || filter.exclude.matches(&String::from_utf8_lossy(&name)))
        {
            continue;
        }
        found += 1;
        let name = if name.is_empty() {
            // The root itself (`COPY . /x`): copied by content, the name is never used.
            b".".to_vec()
        } else {
            name
        };
        items.push(Item::Path {
            shown: path.to_string(),
            keep: m[pivot.min(m.len())..].to_vec(),
            name,
            node,
        });
    }
    if found == 0 && !globbed {
        // Everything the path named was excluded with --exclude: nothing to copy.
        return Ok(());
    }
    if found == 0 {
        return Err(CopyError::NotFound {
            path: path.into(),
            ignored: false,
        });
    }
    Ok(())
}

/// Owner and mode rules of one copy.
struct Meta {
    chown: Option<(u32, u32)>,
    chmod: Option<Chmod>,
    context: bool,
    /// Copying a git checkout: root-owned, as the context.
    git: bool,
}

impl Meta {
    fn owner(&self, st: &Stat) -> (u32, u32) {
        match (self.chown, self.context || self.git) {
            (Some(o), _) => o,
            (None, true) => (0, 0),
            (None, false) => (st.st_uid, st.st_gid),
        }
    }

    fn mode(&self, st_mode: u32, is_dir: bool) -> u32 {
        match &self.chmod {
            Some(c) => c.apply(st_mode & 0o7777, is_dir),
            None => st_mode & 0o7777,
        }
    }

    /// Owner of directories the copy creates on the way.
    fn parent_owner(&self) -> (u32, u32) {
        self.chown.unwrap_or((0, 0))
    }
}

/// `--chown` resolved in `db_root`'s `/etc/passwd` and `/etc/group`.
fn resolve_chown(spec: &str, db_root: &Path) -> Result<(u32, u32), CopyError> {
    let root = Root::open(db_root).map_err(|e| CopyError::Io {
        path: db_root.display().to_string(),
        op: "open",
        source: e,
    })?;
    let read = |p: &str| -> Result<String, CopyError> {
        let b = root::read_bounded(&root, p, crate::exec::user::MAX_DB_BYTES as u64).map_err(
            |source| CopyError::Resolve {
                path: p.into(),
                source,
            },
        )?;
        Ok(String::from_utf8_lossy(&b.unwrap_or_default()).into_owned())
    };
    let passwd = read("/etc/passwd")?;
    let group = read("/etc/group")?;
    let u = crate::exec::user::resolve_user(Some(spec), &passwd, &group).map_err(|source| {
        CopyError::Chown {
            spec: spec.into(),
            source,
        }
    })?;
    // Dockerfile reference: "a UID without GID will use the same numeric UID as the GID".
    let numeric_alone = !spec.contains(':') && spec.parse::<u32>().is_ok();
    Ok((u.uid, if numeric_alone { u.uid } else { u.gid }))
}

/// Whether an xattr is copied: not `system.*` (ACLs) nor `security.selinux` (host policy),
/// as [`crate::layer`] does, and never overlayfs's own `trusted.overlay.*` or
/// `user.overlay.*` (read instead of `trusted.` on a `userxattr` mount): in the step's upper
/// directory overlayfs would obey them (an opaque marker hides the lower layers, a redirect
/// points at another path of them), and the layer writer turns opaque markers into
/// whiteouts.
pub(crate) fn keep_xattr(name: &[u8]) -> bool {
    !(name.starts_with(b"system.")
        || name == b"security.selinux"
        || name.starts_with(b"trusted.overlay.")
        || name.starts_with(b"user.overlay."))
}

/// The kept xattrs of an open file or directory, sorted by name.
pub(crate) fn xattrs(fd: BorrowedFd<'_>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut names = vec![0u8; 64 << 10];
    let Ok(n) = rustix::fs::flistxattr(fd, &mut names[..]) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if !keep_xattr(name) {
            continue;
        }
        let mut val = vec![0u8; 64 << 10];
        if let Ok(k) = rustix::fs::fgetxattr(fd, os(name), &mut val[..]) {
            val.truncate(k);
            out.push((name.to_vec(), val));
        }
    }
    out.sort();
    out
}

/// Opens a regular file `name` in `dir` for reading, refusing anything but a regular file
/// (`O_NONBLOCK`: a FIFO swapped in cannot block the open).
pub(crate) fn open_regular(
    dir: BorrowedFd<'_>,
    name: &[u8],
    shown: &str,
) -> Result<(OwnedFd, Stat), CopyError> {
    let fd = rustix::fs::openat(
        dir,
        os(name),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(ioe(shown, "open"))?;
    let st = rustix::fs::fstat(&fd).map_err(ioe(shown, "stat"))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(CopyError::Io {
            path: shown.into(),
            op: "open",
            source: io::Error::other("changed while being copied (no longer a regular file)"),
        });
    }
    Ok((fd, st))
}

fn ts(sec: i64, nsec: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

struct Copier<'a> {
    dest: Root,
    meta: Meta,
    filter: &'a Filter<'a>,
    /// `filter` without `.dockerignore`, for a git checkout (not the context).
    plain_filter: Filter<'a>,
    /// Copying a git checkout: `plain_filter`, and root as the owner unless `--chown`.
    in_git: bool,
    limits: CopyLimits,
    tar_limits: TarLimits,
    unpack: bool,
    report: CopyReport,
    /// The source currently copied, as written (for errors).
    shown: String,
}

fn copy_inner(
    step: &CopyStep,
    src: &Sources,
    dest_root: &Path,
    opts: &CopyOptions,
) -> Result<CopyReport, CopyError> {
    if step.checksum.is_some()
        && step
            .sources
            .iter()
            .any(|s| !matches!(s, CopySource::Url { .. }))
    {
        return Err(CopyError::Unsupported(
            "ADD --checksum with a source that is not a URL".into(),
        ));
    }
    let chmod = match &step.chmod {
        Some(s) => Some(Chmod::parse(s).map_err(|reason| CopyError::Chmod {
            spec: s.clone(),
            reason,
        })?),
        None => None,
    };
    let chown = match &step.chown {
        Some(s) => Some(resolve_chown(
            s,
            opts.user_db_root.as_deref().unwrap_or(dest_root),
        )?),
        None => None,
    };
    let src_root = Root::open(src.dir()).map_err(|e| CopyError::Io {
        path: src.dir().display().to_string(),
        op: "open source root",
        source: e,
    })?;
    let filter = Filter::new(step, src)?;
    let items = select(step, src, &src_root, &filter)?;
    let dest = Root::open(dest_root).map_err(|e| CopyError::Io {
        path: dest_root.display().to_string(),
        op: "open destination root",
        source: e,
    })?;
    let mut c = Copier {
        dest,
        meta: Meta {
            chown,
            chmod,
            context: src.is_context(),
            git: false,
        },
        filter: &filter,
        plain_filter: filter.without_ignore(),
        in_git: false,
        limits: opts.limits,
        tar_limits: opts.tar_limits.clone(),
        unpack: step.unpack,
        report: CopyReport::default(),
        shown: String::new(),
    };
    let dest_comps = components(&step.dest);
    let slash = step.dest.ends_with('/') || step.dest.ends_with("/.") || dest_comps.is_empty();
    let existing_dir = {
        let r = c.dest.resolve(&dest_comps, true, None);
        matches!(r, Ok(Resolved { stat: Some(st), .. })
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory)
    };
    let into_dir = slash || existing_dir || step.parents;
    if items.len() > 1 && !into_dir {
        return Err(CopyError::NeedsDirectory {
            dest: step.dest.clone(),
        });
    }
    for item in &items {
        c.copy_item(item, &dest_comps, into_dir, step.parents, &step.dest)?;
    }
    Ok(c.report)
}

impl Copier<'_> {
    fn create(&self) -> Create {
        let (uid, gid) = self.meta.parent_owner();
        Create {
            mode: 0o755,
            uid,
            gid,
        }
    }

    fn resolve_err(&self, source: RootError) -> CopyError {
        CopyError::Resolve {
            path: self.shown.clone(),
            source,
        }
    }

    /// The directory at `comps` in the destination (symlinks followed inside the root),
    /// created (with missing parents) when missing; `new_meta` gives the created one's
    /// owner and mode. Returns its fd and its resolved path.
    fn dest_dir(
        &mut self,
        comps: &[Vec<u8>],
        new_meta: Option<(u32, u32, u32)>,
    ) -> Result<(OwnedFd, Vec<Vec<u8>>), CopyError> {
        let create = self.create();
        let r = self
            .dest
            .resolve(comps, true, Some(create))
            .map_err(|e| self.resolve_err(e))?;
        let shown = format!("/{}", lossy(comps));
        match (&r.stat, &r.name) {
            (Some(st), _) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                let fd = r.open_dir().map_err(|e| CopyError::Io {
                    path: shown,
                    op: "open",
                    source: e,
                })?;
                Ok((fd, r.comps))
            }
            (None, Some(name)) => {
                let (uid, gid, mode) = new_meta.unwrap_or((create.uid, create.gid, 0o755));
                let fd = create_owned_dir(r.parent.as_fd(), name, uid, gid, mode, &shown)?;
                self.report.dirs += 1;
                Ok((fd, r.comps))
            }
            _ => Err(CopyError::NotADirectory { dest: shown }),
        }
    }

    fn count_entry(&mut self) -> Result<(), CopyError> {
        let n = self.report.files + self.report.dirs + self.report.symlinks + self.report.specials;
        if n >= self.limits.max_entries {
            return Err(CopyError::Limit {
                path: self.shown.clone(),
                what: "entry count",
                max: self.limits.max_entries,
            });
        }
        Ok(())
    }

    fn copy_item(
        &mut self,
        item: &Item,
        dest: &[Vec<u8>],
        into_dir: bool,
        parents: bool,
        dest_shown: &str,
    ) -> Result<(), CopyError> {
        match item {
            Item::Path {
                shown,
                node,
                keep,
                name,
            } => {
                self.shown = shown.clone();
                let st = node.stat.expect("selected items exist");
                let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
                // Where the item lands.
                let mut target: Vec<Vec<u8>> = dest.to_vec();
                if parents {
                    target.extend(keep.iter().cloned());
                } else if into_dir && !is_dir {
                    target.push(name.clone());
                }
                if is_dir {
                    let (uid, gid) = self.meta.owner(&st);
                    let mode = self.meta.mode(st.st_mode, true);
                    let (dfd, dcomps) = self.dest_dir(&target, Some((uid, gid, mode)))?;
                    let sfd = node.open_dir().map_err(|e| CopyError::Io {
                        path: shown.clone(),
                        op: "open",
                        source: e,
                    })?;
                    return self.copy_dir(sfd.as_fd(), &node.rel(), "", dfd.as_fd(), &dcomps, 0);
                }
                let Some(src_name) = &node.name else {
                    return Err(CopyError::NotFound {
                        path: shown.clone(),
                        ignored: false,
                    });
                };
                if self.unpack && FileType::from_raw_mode(st.st_mode) == FileType::RegularFile {
                    let (fd, _) = open_regular(node.parent.as_fd(), src_name, shown)?;
                    if is_tar(&fd) {
                        let dir = if parents {
                            target[..target.len() - 1].to_vec()
                        } else if into_dir {
                            dest.to_vec()
                        } else {
                            target.clone()
                        };
                        return self.extract(fd, &dir);
                    }
                }
                let (parent, fname) = split_target(&target, dest_shown)?;
                let (pfd, pcomps) = self.dest_dir(parent, None)?;
                self.copy_entry(
                    node.parent.as_fd(),
                    src_name,
                    &st,
                    pfd.as_fd(),
                    &pcomps,
                    fname,
                    &node.rel(),
                    "",
                    0,
                )
            }
            Item::Git { url, tree, .. } => {
                self.shown = url.clone();
                let sfd = rustix::fs::open(
                    tree,
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(ioe(url, "open the checkout"))?;
                let st = rustix::fs::fstat(&sfd).map_err(ioe(url, "stat"))?;
                // The checkout's root is copied by content into the destination directory.
                self.meta.git = true;
                self.in_git = true;
                let r = (|| {
                    let (uid, gid) = self.meta.owner(&st);
                    let mode = self.meta.mode(st.st_mode, true);
                    let (dfd, dcomps) = self.dest_dir(dest, Some((uid, gid, mode)))?;
                    self.copy_dir(sfd.as_fd(), "", "", dfd.as_fd(), &dcomps, 0)
                })();
                self.meta.git = false;
                self.in_git = false;
                r
            }
            Item::Download { url, file, name } => {
                self.shown = url.clone();
                let mut target = dest.to_vec();
                if into_dir {
                    target.push(name.clone().into_bytes());
                }
                let (parent, fname) = split_target(&target, dest_shown)?;
                let (pfd, _) = self.dest_dir(parent, None)?;
                let f = std::fs::File::open(file).map_err(|e| CopyError::Io {
                    path: file.display().to_string(),
                    op: "open download",
                    source: e,
                })?;
                let (uid, gid) = self.meta.parent_owner();
                let mode = self.meta.mode(0o600, false);
                self.write_file(pfd.as_fd(), fname, f, uid, gid, mode, &[], ts(0, 0))
            }
            Item::Inline { name, data, mode } => {
                self.shown = name.clone();
                let mut target = dest.to_vec();
                if into_dir {
                    target.push(name.clone().into_bytes());
                }
                let (parent, fname) = split_target(&target, dest_shown)?;
                let (pfd, _) = self.dest_dir(parent, None)?;
                let (uid, gid) = self.meta.parent_owner();
                let mode = self.meta.mode(*mode, false);
                self.write_file(
                    pfd.as_fd(),
                    fname,
                    io::Cursor::new(data.clone()),
                    uid,
                    gid,
                    mode,
                    &[],
                    ts(0, 0),
                )
            }
        }
    }

    /// Extracts the archive `fd` into the destination directory `dir`.
    fn extract(&mut self, fd: OwnedFd, dir: &[Vec<u8>]) -> Result<(), CopyError> {
        let (dfd, _) = self.dest_dir(dir, None)?;
        let root = PathBuf::from(format!("/proc/self/fd/{}", dfd.as_raw_fd()));
        let stats = crate::layer::apply_layer(
            &root,
            std::fs::File::from(fd),
            &self.shown,
            &self.tar_limits,
        )
        .map_err(|source| CopyError::Archive {
            path: self.shown.clone(),
            source,
        })?;
        self.report.archives += 1;
        self.report.bytes += stats.bytes;
        Ok(())
    }

    /// Copies the contents of the source directory `sdir` into `ddir`. `ctx_rel` is `sdir`'s
    /// path from the source root (for `.dockerignore`), `src_rel` from the copied source
    /// (for `--exclude`).
    #[allow(clippy::too_many_arguments)]
    fn copy_dir(
        &mut self,
        sdir: BorrowedFd<'_>,
        ctx_rel: &str,
        src_rel: &str,
        ddir: BorrowedFd<'_>,
        dcomps: &[Vec<u8>],
        depth: usize,
    ) -> Result<(), CopyError> {
        if depth > MAX_TREE_DEPTH {
            return Err(CopyError::Limit {
                path: self.shown.clone(),
                what: "directory depth",
                max: MAX_TREE_DEPTH as u64,
            });
        }
        let shown = self.shown.clone();
        for name in list(sdir, &shown)? {
            let st = match rustix::fs::statat(sdir, os(&name), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(ioe(&shown, "stat")(e)),
            };
            let crel = join(ctx_rel, &name);
            let srel = join(src_rel, &name);
            let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
            let filter = if self.in_git {
                &self.plain_filter
            } else {
                self.filter
            };
            match filter.verdict(&crel, &srel, is_dir) {
                Verdict::Skip => continue,
                Verdict::Keep => {
                    self.copy_entry(sdir, &name, &st, ddir, dcomps, &name, &crel, &srel, depth)?
                }
                Verdict::Descend => {
                    let before = self.report.clone();
                    self.copy_entry(sdir, &name, &st, ddir, dcomps, &name, &crel, &srel, depth)?;
                    // Nothing kept inside: the directory itself is not part of the copy.
                    if self.report.files == before.files
                        && self.report.symlinks == before.symlinks
                        && self.report.specials == before.specials
                    {
                        let _ = rustix::fs::unlinkat(ddir, os(&name), AtFlags::REMOVEDIR);
                    }
                }
            }
        }
        Ok(())
    }

    /// Makes sure `name` in `ddir` can be replaced by a non-directory.
    fn clear_for_file(
        &self,
        ddir: BorrowedFd<'_>,
        name: &[u8],
        dcomps: &[Vec<u8>],
    ) -> Result<(), CopyError> {
        match rustix::fs::statat(ddir, os(name), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                Err(CopyError::ReplaceDirectory {
                    dest: format!("/{}", lossy(&[dcomps, &[name.to_vec()]].concat())),
                    path: self.shown.clone(),
                })
            }
            Ok(_) => rustix::fs::unlinkat(ddir, os(name), AtFlags::empty())
                .map_err(ioe(&self.shown, "unlink")),
            Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(ioe(&self.shown, "stat")(e)),
        }
    }

    /// Copies one entry `sname` of `sdir` (lstat `st`) to `dname` in `ddir`.
    #[allow(clippy::too_many_arguments)]
    fn copy_entry(
        &mut self,
        sdir: BorrowedFd<'_>,
        sname: &[u8],
        st: &Stat,
        ddir: BorrowedFd<'_>,
        dcomps: &[Vec<u8>],
        dname: &[u8],
        ctx_rel: &str,
        src_rel: &str,
        depth: usize,
    ) -> Result<(), CopyError> {
        check_name(dname, &self.shown)?;
        self.count_entry()?;
        let shown = self.shown.clone();
        let (uid, gid) = self.meta.owner(st);
        let mtime = ts(st.st_mtime, st.st_mtime_nsec as i64);
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let mut child = dcomps.to_vec();
                child.push(dname.to_vec());
                let mode = self.meta.mode(st.st_mode, true);
                let sfd = rustix::fs::openat(
                    sdir,
                    os(sname),
                    OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(ioe(&shown, "open"))?;
                // An existing symlink to a directory (`/lib -> usr/lib`) is followed inside
                // the root; anything else in the way but a directory is replaced.
                let existing = match rustix::fs::statat(ddir, os(dname), AtFlags::SYMLINK_NOFOLLOW)
                {
                    Ok(st) => Some(FileType::from_raw_mode(st.st_mode)),
                    Err(Errno::NOENT) => None,
                    Err(e) => return Err(ioe(&shown, "stat")(e)),
                };
                let (dfd, dc) = match existing {
                    Some(FileType::Directory) => {
                        let fd = rustix::fs::openat(
                            ddir,
                            os(dname),
                            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(ioe(&shown, "open"))?;
                        self.report.dirs += 1;
                        (fd, child)
                    }
                    Some(FileType::Symlink) => {
                        let r = self
                            .dest
                            .resolve(&child, true, None)
                            .map_err(|e| self.resolve_err(e));
                        match r {
                            Ok(r)
                                if r.stat.is_some_and(|s| {
                                    FileType::from_raw_mode(s.st_mode) == FileType::Directory
                                }) =>
                            {
                                let fd = r.open_dir().map_err(|e| CopyError::Io {
                                    path: shown.clone(),
                                    op: "open",
                                    source: e,
                                })?;
                                self.report.dirs += 1;
                                (fd, r.comps)
                            }
                            _ => {
                                rustix::fs::unlinkat(ddir, os(dname), AtFlags::empty())
                                    .map_err(ioe(&shown, "unlink"))?;
                                self.make_dir(ddir, dname, uid, gid, mode, &sfd, child)?
                            }
                        }
                    }
                    Some(_) => {
                        rustix::fs::unlinkat(ddir, os(dname), AtFlags::empty())
                            .map_err(ioe(&shown, "unlink"))?;
                        self.make_dir(ddir, dname, uid, gid, mode, &sfd, child)?
                    }
                    None => self.make_dir(ddir, dname, uid, gid, mode, &sfd, child)?,
                };
                self.copy_dir(sfd.as_fd(), ctx_rel, src_rel, dfd.as_fd(), &dc, depth + 1)?;
                // The directory's mtime, once its content is in place (only ones we made
                // carry the source's; `make_dir` records nothing else).
                if existing.is_none() {
                    let _ = rustix::fs::futimens(&dfd, &mtime);
                }
                Ok(())
            }
            FileType::RegularFile => {
                let (fd, st2) = open_regular(sdir, sname, &shown)?;
                let x = xattrs(fd.as_fd());
                let mode = self.meta.mode(st2.st_mode, false);
                self.write_file(
                    ddir,
                    dname,
                    std::fs::File::from(fd),
                    uid,
                    gid,
                    mode,
                    &x,
                    mtime,
                )
                .map_err(|e| match e {
                    CopyError::Io { op, source, .. } => CopyError::Io {
                        path: format!("{shown} ({ctx_rel})"),
                        op,
                        source,
                    },
                    e => e,
                })
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(sdir, os(sname), Vec::new())
                    .map_err(ioe(&shown, "readlink"))?;
                self.clear_for_file(ddir, dname, dcomps)?;
                rustix::fs::symlinkat(&target, ddir, os(dname)).map_err(ioe(&shown, "symlink"))?;
                rustix::fs::chownat(
                    ddir,
                    os(dname),
                    Some(Uid::from_raw(uid)),
                    Some(Gid::from_raw(gid)),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(ioe(&shown, "chown"))?;
                let _ = rustix::fs::utimensat(ddir, os(dname), &mtime, AtFlags::SYMLINK_NOFOLLOW);
                self.report.symlinks += 1;
                Ok(())
            }
            // Device nodes from the build context are not copied (a tenant's upload has
            // no business carrying them), nor is a character device 0/0 from anywhere: in
            // the step's upper directory it is an overlay whiteout, and would delete the
            // lower layers' file of that name from the image.
            FileType::CharacterDevice | FileType::BlockDevice
                if self.meta.context || st.st_rdev == 0 =>
            {
                Ok(())
            }
            ft @ (FileType::CharacterDevice | FileType::BlockDevice | FileType::Fifo) => {
                self.clear_for_file(ddir, dname, dcomps)?;
                rustix::fs::mknodat(ddir, os(dname), ft, Mode::from_raw_mode(0o600), st.st_rdev)
                    .map_err(ioe(&shown, "mknod"))?;
                rustix::fs::chownat(
                    ddir,
                    os(dname),
                    Some(Uid::from_raw(uid)),
                    Some(Gid::from_raw(gid)),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(ioe(&shown, "chown"))?;
                rustix::fs::chmodat(
                    ddir,
                    os(dname),
                    Mode::from_raw_mode(self.meta.mode(st.st_mode, false)),
                    AtFlags::empty(),
                )
                .map_err(ioe(&shown, "chmod"))?;
                let _ = rustix::fs::utimensat(ddir, os(dname), &mtime, AtFlags::SYMLINK_NOFOLLOW);
                self.report.specials += 1;
                Ok(())
            }
            // Sockets and unknown types are not copied (Docker's context skips sockets).
            _ => Ok(()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn make_dir(
        &mut self,
        ddir: BorrowedFd<'_>,
        name: &[u8],
        uid: u32,
        gid: u32,
        mode: u32,
        src: &OwnedFd,
        comps: Vec<Vec<u8>>,
    ) -> Result<(OwnedFd, Vec<Vec<u8>>), CopyError> {
        check_name(name, &self.shown)?;
        let shown = self.shown.clone();
        let fd = create_owned_dir(ddir, name, uid, gid, mode, &shown)?;
        for (k, v) in xattrs(src.as_fd()) {
            rustix::fs::fsetxattr(&fd, os(&k), &v, XattrFlags::empty())
                .map_err(ioe(&shown, "setxattr"))?;
        }
        self.report.dirs += 1;
        Ok((fd, comps))
    }

    /// Writes `data` as the new regular file `name` in `dir` (replacing a non-directory),
    /// with owner, mode, xattrs and times, within the size bounds.
    #[allow(clippy::too_many_arguments)]
    fn write_file(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &[u8],
        data: impl Read,
        uid: u32,
        gid: u32,
        mode: u32,
        xattrs: &[(Vec<u8>, Vec<u8>)],
        times: Timestamps,
    ) -> Result<(), CopyError> {
        check_name(name, &self.shown)?;
        self.count_entry()?;
        let shown = self.shown.clone();
        let dcomps: Vec<Vec<u8>> = Vec::new();
        self.clear_for_file(dir, name, &dcomps)?;
        let fd = rustix::fs::openat(
            dir,
            os(name),
            OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(ioe(&shown, "create"))?;
        let mut out = std::fs::File::from(fd);
        let file_max = self.limits.max_file_bytes;
        let total_left = self
            .limits
            .max_total_bytes
            .saturating_sub(self.report.bytes);
        let cap = file_max.min(total_left);
        let n = io::copy(&mut data.take(cap.saturating_add(1)), &mut out).map_err(|e| {
            CopyError::Io {
                path: shown.clone(),
                op: "copy",
                source: e,
            }
        })?;
        if n > cap {
            let (what, max) = if n > file_max {
                ("file size (bytes)", file_max)
            } else {
                ("total size (bytes)", self.limits.max_total_bytes)
            };
            return Err(CopyError::Limit {
                path: shown,
                what,
                max,
            });
        }
        self.report.bytes += n;
        let fd = out.as_fd();
        rustix::fs::fchown(fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(ioe(&shown, "chown"))?;
        rustix::fs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(ioe(&shown, "chmod"))?;
        for (k, v) in xattrs {
            rustix::fs::fsetxattr(fd, os(k), v, XattrFlags::empty())
                .map_err(ioe(&shown, "setxattr"))?;
        }
        rustix::fs::futimens(fd, &times).map_err(ioe(&shown, "utimens"))?;
        self.report.files += 1;
        Ok(())
    }
}

/// Refuses a name that is not one plain path component. Every `*at` call of the copy takes
/// a name relative to a directory fd it resolved inside the root; a name holding `/` or `..`
/// would make the kernel resolve it, following symlinks and climbing out of the root.
/// Names read from a directory are always plain; a heredoc delimiter (`COPY <<../../x /d/`)
/// or a destination ending in `..` are not.
fn check_name(name: &[u8], shown: &str) -> Result<(), CopyError> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(CopyError::BadName {
            path: shown.to_string(),
            name: String::from_utf8_lossy(name).into_owned(),
        });
    }
    Ok(())
}

/// Splits a file target into its parent directory and name; the root cannot be a file.
fn split_target<'t>(
    target: &'t [Vec<u8>],
    dest_shown: &str,
) -> Result<(&'t [Vec<u8>], &'t [u8]), CopyError> {
    match target.split_last() {
        Some((name, parent)) => Ok((parent, name)),
        None => Err(CopyError::NotADirectory {
            dest: dest_shown.to_string(),
        }),
    }
}

/// Whether the file looks like a tar archive (plain, gzip, zstd, xz or bzip2): its first 512-byte
/// block, once decompressed, is a tar header with a valid checksum (POSIX `ustar` and old
/// V7 headers alike; pax(1) "ustar Interchange Format"). The file offset is restored.
pub(crate) fn is_tar(fd: &OwnedFd) -> bool {
    use crate::layer::Compression;
    let Ok(dup) = fd.try_clone() else {
        return false;
    };
    let mut f = std::fs::File::from(dup);
    let mut head = [0u8; 8];
    let n = read_full(&mut f, &mut head).unwrap_or(0);
    let mut block = [0u8; 512];
    let ok = (|| -> io::Result<bool> {
        rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(0))?;
        let mut decoded = Compression::sniff(&head[..n]).decoder(io::BufReader::new(&mut f))?;
        let got = read_full(&mut decoded, &mut block)?;
        Ok(got == 512 && tar_checksum_ok(&block))
    })()
    .unwrap_or(false);
    let _ = rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(0));
    ok
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Whether `block` is a tar header whose checksum field matches its bytes (POSIX.1-2017
/// `ustar` "chksum", as the tar crate reads and computes it). An all-zero block (end of
/// archive) is not a header.
fn tar_checksum_ok(block: &[u8; 512]) -> bool {
    let header = tar::Header::from_byte_slice(block);
    let Ok(want) = header.cksum() else {
        return false;
    };
    let mut computed = header.clone();
    computed.set_cksum();
    computed.cksum().is_ok_and(|sum| sum == want) && block.iter().any(|b| *b != 0)
}

#[cfg(test)]
mod git_tests;
#[cfg(test)]
mod tests;
