//! The cache-key digest of a copy's sources (issue 5, "Cache").

use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd};

use kiln_recipes::plan::CopyStep;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;
use sha2::{Digest, Sha256};

use super::{
    CopyError, CopyLimits, Filter, Item, Sources, Verdict, ioe, join, list, open_regular, select,
    xattrs,
};
use crate::rootfs::Root;
use crate::rootfs::root::os;

/// `sha256:<hex>` over the sources `step` selects from `src`, after `.dockerignore` and
/// `--exclude`: for each source in order, its text as written, then every selected entry
/// (depth first, names sorted bytewise) as its path relative to the source, type, permission
/// bits, uid and gid (those the copy gives it: 0 for the build context), kept xattrs, and
/// the sha256 of a file's bytes, a symlink's target or a device's numbers. Times are never
/// part of it. Downloaded URLs count by URL and content digest, heredocs by name, mode and
/// content. Every field is length-prefixed, so no two selections share an encoding.
///
/// Errors: as [`super::copy_into`] for selection (missing source, escape, bounds of
/// [`CopyLimits::default`]); place them with [`CopyError::at`].
pub fn sources_digest(step: &CopyStep, src: &Sources) -> Result<String, CopyError> {
    Ok(sources_digest_with_files(step, src)?.0)
}

/// How many build-context entries [`ContextFiles`] names one by one.
pub const MAX_CONTEXT_FILES: usize = 10_000;

/// How many bytes of paths [`ContextFiles`] names at most (2 MiB: so that a record stays
/// under the store's bound whatever the paths' lengths).
pub const MAX_CONTEXT_PATH_BYTES: usize = 2 << 20;

/// The build-context entries a copy (or bind mount) selected, each by its path relative to
/// the context and the digest of what the cache key took of it (type, permission bits,
/// content, link target), at most [`MAX_CONTEXT_FILES`] of them (and
/// [`MAX_CONTEXT_PATH_BYTES`] of paths) in walk order; the rest
/// counted and digested together. JSON: `{"files": {"src/app.py": "sha256:…"}, "rest":
/// null | {"count": N, "digest": "sha256:…"}}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ContextFiles {
    /// Path → digest.
    pub files: std::collections::BTreeMap<String, String>,
    /// The entries beyond the bound.
    pub rest: Option<RestFiles>,
    /// Bytes of the paths in `files`.
    #[serde(skip)]
    path_bytes: usize,
}

/// The entries of a [`ContextFiles`] beyond its bound.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RestFiles {
    /// How many.
    pub count: u64,
    /// `sha256:<hex>` over their paths and digests, in walk order.
    pub digest: String,
}

impl ContextFiles {
    fn add(&mut self, path: String, digest: String, rest: &mut Sha256) {
        if self.files.contains_key(&path)
            || (self.files.len() < MAX_CONTEXT_FILES
                && self.path_bytes + path.len() <= MAX_CONTEXT_PATH_BYTES)
        {
            self.path_bytes += path.len();
            self.files.insert(path, digest);
            return;
        }
        rest.update((path.len() as u64).to_be_bytes());
        rest.update(path.as_bytes());
        rest.update(digest.as_bytes());
        self.rest.get_or_insert_with(RestFiles::default).count += 1;
    }

    /// Adds `other`'s entries (a step that reads the context more than once).
    pub fn merge(&mut self, other: ContextFiles) {
        let mut rest = Sha256::new();
        if let Some(r) = &self.rest {
            rest.update(r.digest.as_bytes());
        }
        for (p, d) in other.files {
            self.add(p, d, &mut rest);
        }
        if let Some(o) = other.rest {
            rest.update(o.digest.as_bytes());
            self.rest.get_or_insert_with(RestFiles::default).count += o.count;
        }
        if let Some(r) = &mut self.rest {
            r.digest = format!("sha256:{}", hex::encode(rest.finalize()));
        }
    }
}

/// [`sources_digest`] and, for a source in the build context, the entries it selected
/// ([`ContextFiles`]; empty for other sources). One walk.
pub fn sources_digest_with_files(
    step: &CopyStep,
    src: &Sources,
) -> Result<(String, ContextFiles), CopyError> {
    super::on_walk_stack(|| digest_inner(step, src))
}

fn digest_inner(step: &CopyStep, src: &Sources) -> Result<(String, ContextFiles), CopyError> {
    let root = Root::open(src.dir()).map_err(|e| CopyError::Io {
        path: src.dir().display().to_string(),
        op: "open source root",
        source: e,
    })?;
    let filter = Filter::new(step, src)?;
    let items = select(step, src, &root, &filter)?;
    let mut h = Hasher {
        sha: Sha256::new(),
        limits: CopyLimits::default(),
        bytes: 0,
        entries: 0,
        context: src.is_context(),
        filter: &filter,
        shown: String::new(),
        files: ContextFiles::default(),
        rest: Sha256::new(),
    };
    h.field(b"kiln copy sources v1");
    for item in &items {
        match item {
            Item::Path {
                shown, node, keep, ..
            } => {
                h.shown = shown.clone();
                h.field(b"path");
                h.field(shown.as_bytes());
                for k in keep {
                    h.field(k);
                }
                let st = node.stat.expect("selected items exist");
                match &node.name {
                    None => {
                        let fd = node.open_dir().map_err(|e| CopyError::Io {
                            path: shown.clone(),
                            op: "open",
                            source: e,
                        })?;
                        h.entry(fd.as_fd(), None, &st, b"", &node.rel(), "", 0)?;
                    }
                    Some(name) => h.entry(
                        node.parent.as_fd(),
                        Some(name),
                        &st,
                        b"",
                        &node.rel(),
                        "",
                        0,
                    )?,
                }
            }
            Item::Git { url, commit, .. } => {
                // The commit stands for the tree: a moved branch is a new key, a pinned
                // commit the same one.
                h.field(b"git");
                h.field(url.as_bytes());
                h.field(commit.as_bytes());
                h.field(&[u8::from(step.keep_git_dir)]);
            }
            Item::Download { url, file, .. } => {
                h.field(b"url");
                h.field(url.as_bytes());
                let d = src.downloads.get(url).map(|d| d.digest.to_string());
                match d {
                    Some(d) => h.field(d.as_bytes()),
                    None => h.field(file.display().to_string().as_bytes()),
                }
            }
            Item::Inline { name, data, mode } => {
                h.field(b"inline");
                h.field(name.as_bytes());
                h.field(&mode.to_be_bytes());
                h.field(&Sha256::digest(data));
            }
        }
    }
    if let Some(r) = &mut h.files.rest {
        r.digest = format!("sha256:{}", hex::encode(h.rest.finalize()));
    }
    Ok((format!("sha256:{}", hex::encode(h.sha.finalize())), h.files))
}

struct Hasher<'a> {
    sha: Sha256,
    limits: CopyLimits,
    bytes: u64,
    entries: u64,
    context: bool,
    filter: &'a Filter<'a>,
    shown: String,
    /// The context entries hashed (only when `context`).
    files: ContextFiles,
    /// Digest of those beyond the bound.
    rest: Sha256,
}

impl Hasher<'_> {
    fn field(&mut self, b: &[u8]) {
        self.sha.update((b.len() as u64).to_be_bytes());
        self.sha.update(b);
    }

    /// Hashes one entry: `name` in `dir`, or (`name` None) the directory `dir` itself.
    #[allow(clippy::too_many_arguments)]
    fn entry(
        &mut self,
        dir: BorrowedFd<'_>,
        name: Option<&[u8]>,
        st: &Stat,
        rel: &[u8],
        ctx_rel: &str,
        src_rel: &str,
        depth: usize,
    ) -> Result<(), CopyError> {
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(CopyError::Limit {
                path: self.shown.clone(),
                what: "entry count",
                max: self.limits.max_entries,
            });
        }
        if depth > super::MAX_TREE_DEPTH {
            return Err(CopyError::Limit {
                path: self.shown.clone(),
                what: "directory depth",
                max: super::MAX_TREE_DEPTH as u64,
            });
        }
        let shown = super::select::entry_shown(&self.shown, src_rel);
        let ft = FileType::from_raw_mode(st.st_mode);
        let (uid, gid) = if self.context {
            (0, 0)
        } else {
            (st.st_uid, st.st_gid)
        };
        // The path as bytes: names need not be UTF-8, and a lossy conversion would give
        // two names (`\xff`, `\xfe`) one encoding.
        self.field(rel);
        self.field(&[type_byte(ft)]);
        self.field(&(st.st_mode & 0o7777).to_be_bytes());
        self.field(&uid.to_be_bytes());
        self.field(&gid.to_be_bytes());
        // The entry's own digest, for ContextFiles: type, bits and what follows for it.
        let mut own = Sha256::new();
        own.update([type_byte(ft)]);
        own.update((st.st_mode & 0o7777).to_be_bytes());
        match ft {
            FileType::Directory => {
                let fd = match name {
                    None => dir.try_clone_to_owned().map_err(|e| CopyError::Io {
                        path: shown.clone(),
                        op: "dup",
                        source: e,
                    })?,
                    Some(n) => rustix::fs::openat(
                        dir,
                        os(n),
                        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(ioe(&shown, "open"))?,
                };
                self.xattrs(fd.as_fd());
                for child in list(fd.as_fd(), &shown)? {
                    let cst = match rustix::fs::statat(&fd, os(&child), AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(s) => s,
                        Err(Errno::NOENT) => continue,
                        Err(e) => return Err(ioe(&shown, "stat")(e)),
                    };
                    let crel = join(ctx_rel, &child);
                    let srel = join(src_rel, &child);
                    let is_dir = FileType::from_raw_mode(cst.st_mode) == FileType::Directory;
                    if self.filter.verdict(&crel, &srel, is_dir) == Verdict::Skip {
                        continue;
                    }
                    let mut r = rel.to_vec();
                    if !r.is_empty() {
                        r.push(b'/');
                    }
                    r.extend_from_slice(&child);
                    self.entry(fd.as_fd(), Some(&child), &cst, &r, &crel, &srel, depth + 1)?;
                }
                self.field(b"end");
            }
            FileType::RegularFile => {
                let n = name.unwrap_or_default();
                let (fd, _) = open_regular(dir, n, &shown)?;
                self.xattrs(fd.as_fd());
                let mut f = std::fs::File::from(fd);
                let mut sha = Sha256::new();
                let mut buf = vec![0u8; 128 << 10];
                let mut size = 0u64;
                loop {
                    let k = f.read(&mut buf).map_err(|e| CopyError::Io {
                        path: shown.clone(),
                        op: "read",
                        source: e,
                    })?;
                    if k == 0 {
                        break;
                    }
                    size += k as u64;
                    self.bytes += k as u64;
                    if size > self.limits.max_file_bytes || self.bytes > self.limits.max_total_bytes
                    {
                        return Err(CopyError::Limit {
                            path: shown,
                            what: "size (bytes)",
                            max: self.limits.max_file_bytes.min(self.limits.max_total_bytes),
                        });
                    }
                    sha.update(&buf[..k]);
                }
                let content = sha.finalize();
                own.update(content);
                self.field(&content);
            }
            FileType::Symlink => {
                let n = name.unwrap_or_default();
                let t = rustix::fs::readlinkat(dir, os(n), Vec::new())
                    .map_err(ioe(&shown, "readlink"))?;
                own.update(t.as_bytes());
                self.field(t.as_bytes());
            }
            FileType::CharacterDevice | FileType::BlockDevice => {
                self.field(&st.st_rdev.to_be_bytes());
            }
            _ => {}
        }
        if self.context {
            let path = if ctx_rel.is_empty() { "." } else { ctx_rel };
            let d = format!("sha256:{}", hex::encode(own.finalize()));
            self.files.add(path.to_string(), d, &mut self.rest);
        }
        Ok(())
    }

    fn xattrs(&mut self, fd: BorrowedFd<'_>) {
        let x = xattrs(fd);
        self.field(&(x.len() as u64).to_be_bytes());
        for (k, v) in x {
            self.field(&k);
            self.field(&v);
        }
    }
}

fn type_byte(ft: FileType) -> u8 {
    match ft {
        FileType::RegularFile => b'f',
        FileType::Directory => b'd',
        FileType::Symlink => b'l',
        FileType::CharacterDevice => b'c',
        FileType::BlockDevice => b'b',
        FileType::Fifo => b'p',
        FileType::Socket => b's',
        _ => b'?',
    }
}
