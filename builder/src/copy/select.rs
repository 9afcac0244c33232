//! Which sources a copy takes: the items of a `COPY`/`ADD`, the `--exclude` filter and the
//! selection of paths (wildcards, `--parents`) inside the source root.

use super::*;

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
    pub(super) ignore: Option<&'a Dockerignore>,
    pub(super) exclude: Dockerignore,
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

pub(super) fn lossy(c: &[Vec<u8>]) -> String {
    c.iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// How errors name an entry of a copy source: the source as the recipe wrote it, then the
/// entry's path below it (`./secret/key` for `COPY . /app`), or the source alone for its
/// own top.
pub(super) fn entry_shown(source: &str, src_rel: &str) -> String {
    if src_rel.is_empty() {
        source.to_string()
    } else {
        format!("{}/{src_rel}", source.trim_end_matches('/'))
    }
}

pub(super) fn join(a: &str, b: &[u8]) -> String {
    let b = String::from_utf8_lossy(b);
    if a.is_empty() {
        b.into_owned()
    } else {
        format!("{a}/{b}")
    }
}

/// Lists the names in `dir` (without `.` and `..`), sorted bytewise.
pub(crate) fn list(dir: BorrowedFd<'_>, shown: &str) -> Result<Vec<Vec<u8>>, CopyError> {
    let mut out = crate::rootfs::root::dir_names(dir).map_err(ioe(shown, "readdir"))?;
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

pub(super) fn select_path(
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
