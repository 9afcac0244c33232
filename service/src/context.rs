//! Build contexts: tarballs (plain or gzip) stored by content address under the state
//! directory, `blobs/sha256/<hex>`, written to `blobs/tmp/` while the digest is computed and
//! renamed into place only once it matches (containerd's ingest-then-commit).
//!
//! When the server's store is remote (S3: several nodes share it), a context is also a blob
//! of the store (`blobs/sha256/<hex>`, the same digest): an upload puts it there, and a
//! build that has it holds it with a shared lease, [`lease_id`], from its submission to its
//! end ([`crate::Db::add_context_lease`], renewed and deleted by every node's sweep), so
//! that whichever node claims the build fetches it ([`BlobDir::fetch`]), and GC keeps it
//! while the build is queued or running. The blob directory is then that node's cache.
//!
//! A context is hostile input. Unpacking ([`unpack`]) takes only regular files, directories,
//! symbolic links and hard links, refuses paths that leave the directory (`..`, absolute
//! paths, writes through a symlink: the `tar` crate's `unpack_in`), keeps modes and mtimes
//! (so a context gives the same layers as the same directory given to `kiln build`), and
//! stops past [`crate::ServiceConfig::max_unpacked_bytes`].

use std::io::Read;
use std::path::{Component, Path, PathBuf};

use futures_util::{Stream, StreamExt as _};
use sha2::{Digest as _, Sha256};

/// Errors about contexts.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// The body's sha256 is not the one its URL names.
    #[error("digest mismatch: the body's sha256 is {actual}")]
    DigestMismatch {
        /// `sha256:<hex>` of what arrived.
        actual: String,
    },
    /// The body is larger than the limit.
    #[error("the context is larger than {limit} bytes")]
    TooLarge {
        /// The limit, bytes.
        limit: u64,
    },
    /// A digest that is not `sha256:<64 lowercase hex>`.
    #[error("invalid digest {0:?}: expected sha256:<64 lowercase hex digits>")]
    InvalidDigest(String),
    /// The tarball is not a valid (plain or gzip) tar, or holds something refused.
    #[error("context tarball: {0}")]
    BadTar(String),
    /// The request body could not be read.
    #[error("reading the body: {0}")]
    Body(String),
    /// Reading or writing the blob in the store failed.
    #[error("{what}: {source}")]
    Store {
        /// What.
        what: String,
        /// Why.
        source: Box<kiln_store::StoreError>,
    },
    /// A file operation on the state directory failed.
    #[error("{what}: {source}")]
    Io {
        /// What.
        what: String,
        /// Why.
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ContextError {
    let what = what.into();
    move |source| ContextError::Io { what, source }
}

/// Checks `sha256:<hex>` and returns the hex.
pub fn parse_digest(d: &str) -> Result<&str, ContextError> {
    let hex = d
        .strip_prefix("sha256:")
        .filter(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
        .ok_or_else(|| ContextError::InvalidDigest(d.to_string()))?;
    Ok(hex)
}

/// The id of the store lease that holds build `build`'s context: `context-<build id>`.
pub fn lease_id(build: &str) -> String {
    format!("context-{build}")
}

/// The store's object for context `digest` (`sha256:<hex>`, checked).
pub fn store_object(digest: &str) -> Result<kiln_store::ObjectRef, ContextError> {
    parse_digest(digest)?;
    let d: kiln_store::BlobDigest = digest
        .parse()
        .map_err(|_| ContextError::InvalidDigest(digest.to_string()))?;
    Ok(kiln_store::ObjectRef::Blob(d))
}

fn store_err(what: String) -> impl FnOnce(kiln_store::StoreError) -> ContextError {
    move |e| ContextError::Store {
        what,
        source: Box::new(e),
    }
}

/// The blob directory.
#[derive(Debug, Clone)]
pub struct BlobDir {
    root: PathBuf,
}

impl BlobDir {
    /// Opens (creating) `root` with its `sha256/` and `tmp/` directories.
    pub fn open(root: &Path) -> std::io::Result<BlobDir> {
        std::fs::create_dir_all(root.join("sha256"))?;
        std::fs::create_dir_all(root.join("tmp"))?;
        Ok(BlobDir {
            root: root.to_path_buf(),
        })
    }

    /// The file of blob `digest` (`sha256:<hex>`, checked).
    pub fn path(&self, digest: &str) -> Result<PathBuf, ContextError> {
        Ok(self.root.join("sha256").join(parse_digest(digest)?))
    }

    /// Whether the blob is stored.
    pub fn exists(&self, digest: &str) -> bool {
        self.path(digest).map(|p| p.is_file()).unwrap_or(false)
    }

    /// Stores `body`, at most `limit` bytes, checking its sha256 against `expected` when
    /// given. Returns `sha256:<hex>` and the size.
    pub async fn put<S, E>(
        &self,
        mut body: S,
        expected: Option<&str>,
        limit: u64,
    ) -> Result<(String, u64), ContextError>
    where
        S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        if let Some(e) = expected {
            parse_digest(e)?;
        }
        let tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp"))
            .map_err(io("creating a temporary blob"))?;
        let (file, tmp_path) = tmp.into_parts();
        let mut file = tokio::fs::File::from_std(file);
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| ContextError::Body(e.to_string()))?;
            size += chunk.len() as u64;
            if size > limit {
                return Err(ContextError::TooLarge { limit });
            }
            hasher.update(&chunk);
            tokio::io::AsyncWriteExt::write_all(&mut file, &chunk)
                .await
                .map_err(io("writing a blob"))?;
        }
        tokio::io::AsyncWriteExt::flush(&mut file)
            .await
            .map_err(io("writing a blob"))?;
        file.sync_all().await.map_err(io("syncing a blob"))?;
        let digest = format!("sha256:{}", hex::encode(hasher.finalize()));
        if let Some(e) = expected
            && e != digest
        {
            return Err(ContextError::DigestMismatch { actual: digest });
        }
        let dest = self.path(&digest)?;
        tmp_path.persist(&dest).map_err(|e| ContextError::Io {
            what: "storing a blob".into(),
            source: e.error,
        })?;
        Ok((digest, size))
    }

    /// Makes blob `digest` a file here: true when it already is, or once it was fetched
    /// from `store` (verified against its digest, written to `tmp/` and renamed into place);
    /// false when `store` does not hold it either.
    pub async fn fetch(
        &self,
        store: &kiln_store::Store,
        digest: &str,
    ) -> Result<bool, ContextError> {
        let dest = self.path(digest)?;
        if dest.is_file() {
            return Ok(true);
        }
        let obj = store_object(digest)?;
        let kiln_store::ObjectRef::Blob(d) = obj else {
            return Err(ContextError::InvalidDigest(digest.to_string()));
        };
        let what = format!("fetching context {digest} from {}", store.url());
        if !store.has(&obj).await.map_err(store_err(what.clone()))? {
            return Ok(false);
        }
        let tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp"))
            .map_err(io("creating a temporary blob"))?;
        store
            .get_blob_to_file(&d, tmp.path())
            .await
            .map_err(store_err(what))?;
        tmp.persist(&dest).map_err(|e| ContextError::Io {
            what: "storing a blob".into(),
            source: e.error,
        })?;
        Ok(true)
    }

    /// Puts blob `digest` (a file here) into `store`, if it is not there already.
    pub async fn upload(
        &self,
        store: &kiln_store::Store,
        digest: &str,
    ) -> Result<(), ContextError> {
        let path = self.path(digest)?;
        store.put_blob_file(&path).await.map_err(store_err(format!(
            "storing context {digest} in {}",
            store.url()
        )))?;
        Ok(())
    }

    /// Stores bytes already in memory.
    pub async fn put_bytes(
        &self,
        b: bytes::Bytes,
        limit: u64,
    ) -> Result<(String, u64), ContextError> {
        let s = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(b)]);
        self.put(s, None, limit).await
    }
}

/// A reader of the tarball `path`, gunzipped when it starts with gzip's magic.
/// The tarball `path` decompressed (gzip when it starts with gzip's magic bytes), reading
/// at most `max` bytes of tar stream: past them it fails with [`ContextError::BadTar`]
/// ("passes the context byte bound"), so that no caller decompresses more than the bound
/// plus one buffer, whatever the archive holds. The counter tells how many were read.
fn open_tar(path: &Path, max: u64) -> Result<(Bounded<Box<dyn Read>>, ReadCount), ContextError> {
    let mut f = std::fs::File::open(path).map_err(io(format!("opening {}", path.display())))?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic).map_err(io("reading a context"))?;
    let f = std::fs::File::open(path).map_err(io(format!("opening {}", path.display())))?;
    let r = std::io::BufReader::new(f);
    let inner: Box<dyn Read> = if n == 2 && magic == [0x1f, 0x8b] {
        Box::new(flate2::read::GzDecoder::new(r))
    } else {
        Box::new(r)
    };
    let read = std::rc::Rc::new(std::cell::Cell::new(0));
    Ok((
        Bounded {
            inner,
            max,
            read: read.clone(),
        },
        read,
    ))
}

/// How many bytes went through a [`Bounded`] reader, read while it is in use.
type ReadCount = std::rc::Rc<std::cell::Cell<u64>>;

/// A reader that fails once more than `max` bytes went through it.
struct Bounded<R> {
    inner: R,
    max: u64,
    read: ReadCount,
}

/// The message of [`Bounded`]'s error, recognised by [`tar_error`].
const PAST_BOUND: &str = "kiln: past the context byte bound";

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let total = self.read.get() + n as u64;
        self.read.set(total);
        if total > self.max {
            return Err(std::io::Error::other(PAST_BOUND));
        }
        Ok(n)
    }
}

/// A tar error as a tenant may read it: the byte bound, "not a tar archive" at the first
/// entry, else a malformed entry after `last` (the last good entry's name). Never the raw
/// bytes of a header.
fn tar_error(e: &std::io::Error, last: Option<&str>, max: u64) -> ContextError {
    let past = e.to_string().contains(PAST_BOUND)
        || e.get_ref()
            .is_some_and(|i| i.to_string().contains(PAST_BOUND));
    ContextError::BadTar(if past {
        format!("the tar stream passes the context byte bound of {max} bytes")
    } else {
        match last {
            None => "not a tar archive (or a gzip of one)".into(),
            Some(name) => format!("a malformed tar entry after {name:?}"),
        }
    })
}

/// Checks a recipe path within a context: relative, no `..`, not empty.
pub fn check_member_path(p: &str) -> Result<PathBuf, String> {
    let path = Path::new(p);
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => {
                return Err(format!(
                    "recipe path {p:?}: expected a relative path inside the context"
                ));
            }
        }
    }
    if out.as_os_str().is_empty() {
        return Err(format!("recipe path {p:?}: empty"));
    }
    Ok(out)
}

/// The bytes of the regular file `member` (a path checked by [`check_member_path`]) in the
/// tarball `path`, at most `limit` bytes; `None` when the tarball has no such file. It stops
/// at the first entry of that name (what is built is these bytes), and reads at most `max`
/// bytes of tar stream (the context byte bound): a request path's work is bounded by them
/// whatever the archive holds.
pub fn read_member(
    path: &Path,
    member: &Path,
    limit: u64,
    max: u64,
) -> Result<Option<Vec<u8>>, ContextError> {
    read_member_counted(path, member, limit, max).map(|(found, _)| found)
}

/// [`read_member`], and the bytes of tar stream it read (decompressed).
fn read_member_counted(
    path: &Path,
    member: &Path,
    limit: u64,
    max: u64,
) -> Result<(Option<Vec<u8>>, u64), ContextError> {
    let (reader, read) = open_tar(path, max)?;
    let mut ar = tar::Archive::new(reader);
    let mut last: Option<String> = None;
    let entries = ar.entries().map_err(|e| tar_error(&e, None, max))?;
    for e in entries {
        let mut e = e.map_err(|e| tar_error(&e, last.as_deref(), max))?;
        let p = e
            .path()
            .map_err(|e| tar_error(&e, last.as_deref(), max))?
            .into_owned();
        let p: PathBuf = p
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        if p == member && e.header().entry_type().is_file() {
            if e.size() > limit {
                return Err(ContextError::BadTar(format!(
                    "{} is larger than {limit} bytes",
                    member.display()
                )));
            }
            let mut b = Vec::new();
            e.read_to_end(&mut b)
                .map_err(|err| tar_error(&err, last.as_deref(), max))?;
            return Ok((Some(b), read.get()));
        }
        last = Some(p.display().to_string());
    }
    Ok((None, read.get()))
}

/// Most entries a context may hold (an inode bomb of empty files is refused past it).
pub const MAX_ENTRIES: u64 = 1_000_000;

/// Unpacks the tarball `path` into the empty directory `dest` (see the module doc for what
/// is refused). `limit`: most bytes of file data; at most [`MAX_ENTRIES`] entries.
/// `recipe`: the recipe's path in the context (checked by [`check_member_path`]) when the
/// build reads it from there: a second entry of that path is refused, since the request
/// read the first ([`read_member`]) and unpacking would leave the last.
pub fn unpack(
    path: &Path,
    dest: &Path,
    limit: u64,
    recipe: Option<&Path>,
) -> Result<(), ContextError> {
    // The tar stream: the files' bytes, and headers and padding of at most 1,536 bytes per
    // entry (a 512-byte header, a long-name header and its block, and the data's padding).
    let max = limit.saturating_add(MAX_ENTRIES.saturating_mul(3 * 512));
    let (reader, _) = open_tar(path, max)?;
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_mtime(true);
    ar.set_unpack_xattrs(false);
    ar.set_preserve_ownerships(false);
    ar.set_overwrite(true);
    let (mut total, mut count, mut recipe_seen) = (0u64, 0u64, 0u32);
    let entries = ar.entries().map_err(|e| tar_error(&e, None, max))?;
    let mut last: Option<String> = None;
    for e in entries {
        let mut e = e.map_err(|e| tar_error(&e, last.as_deref(), max))?;
        let kind = e.header().entry_type();
        let name = e
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "?".into());
        use tar::EntryType as T;
        match kind {
            T::Regular | T::Directory | T::Symlink | T::Link | T::Continuous => {}
            // Metadata entries of the pax and GNU formats are read by the tar crate itself.
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => continue,
            other => {
                return Err(ContextError::BadTar(format!(
                    "{name}: entry type {other:?} is not allowed (only files, directories and links)"
                )));
            }
        }
        count += 1;
        if count > MAX_ENTRIES {
            return Err(ContextError::BadTar(format!(
                "more than {MAX_ENTRIES} entries"
            )));
        }
        total += e.size();
        if total > limit {
            return Err(ContextError::BadTar(format!(
                "unpacks to more than {limit} bytes"
            )));
        }
        check_entry(&e, &name, dest)?;
        if let Some(r) = recipe {
            let p: PathBuf = e
                .path()
                .map(|p| {
                    p.components()
                        .filter(|c| matches!(c, Component::Normal(_)))
                        .collect()
                })
                .unwrap_or_default();
            if p == r {
                recipe_seen += 1;
                if recipe_seen > 1 {
                    return Err(ContextError::BadTar(format!(
                        "{name}: the recipe {} is in the context more than once; a context \
                         holds it once",
                        r.display()
                    )));
                }
            }
        }
        // The error names the entry and the kind of failure, never a path of the server.
        let ok = e.unpack_in(dest).map_err(|err| {
            ContextError::BadTar(format!("{name}: cannot unpack: {}", err.kind()))
        })?;
        if !ok {
            return Err(ContextError::BadTar(format!(
                "{name}: path leaves the context"
            )));
        }
        last = Some(name);
    }
    Ok(())
}

/// The rules an entry of a context breaks, named with the entry, before it is unpacked into
/// `dest`: a path with `..` or a root; a path through a symbolic link an earlier entry made
/// (it could lead out of the context); a hard link whose target is outside the context or
/// reached through a symbolic link.
fn check_entry<R: Read>(
    e: &tar::Entry<'_, R>,
    name: &str,
    dest: &Path,
) -> Result<(), ContextError> {
    let bad = |rule: String| Err(ContextError::BadTar(format!("{name}: {rule}")));
    let inside = |p: &Path| {
        p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
    };
    let path = e
        .path()
        .map_err(|_| ContextError::BadTar(format!("{name}: a path that is not UTF-8")))?;
    if !inside(&path) {
        return bad("the path leaves the context (`..` or an absolute path)".into());
    }
    let through_link = |p: &Path| -> Option<String> {
        let mut cur = dest.to_path_buf();
        let mut rel = PathBuf::new();
        let parents: Vec<_> = p
            .parent()
            .map(|d| d.components().collect())
            .unwrap_or_default();
        for c in parents {
            cur.push(c);
            rel.push(c);
            if std::fs::symlink_metadata(&cur).is_ok_and(|m| m.file_type().is_symlink()) {
                return Some(rel.display().to_string());
            }
        }
        None
    };
    if let Some(link) = through_link(&path) {
        return bad(format!(
            "the path goes through the symbolic link {link:?} of the context, which may lead \
             outside it"
        ));
    }
    if e.header().entry_type() == tar::EntryType::Link {
        let target = match e.link_name() {
            Ok(Some(t)) => t.into_owned(),
            _ => return bad("a hard link without a target".into()),
        };
        if !inside(&target) {
            return bad(format!(
                "hard link to {:?}: the target is outside the context",
                target.display().to_string()
            ));
        }
        if let Some(link) = through_link(&target) {
            return bad(format!(
                "hard link to {:?}: the target goes through the symbolic link {link:?}",
                target.display().to_string()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tarball(dir: &Path, f: impl FnOnce(&mut tar::Builder<std::fs::File>)) -> PathBuf {
        let p = dir.join("ctx.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&p).expect("create"));
        f(&mut b);
        b.finish().expect("finish");
        p
    }

    fn file(b: &mut tar::Builder<std::fs::File>, name: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, data).expect("append");
    }

    #[test]
    fn unpacks_files_and_reads_the_recipe() {
        let t = tempfile::tempdir().expect("tmp");
        let p = tarball(t.path(), |b| {
            file(b, "Dockerfile", b"FROM scratch\n");
            file(b, "sub/a.txt", b"a");
        });
        let member = check_member_path("./Dockerfile").expect("ok");
        assert_eq!(
            read_member(&p, &member, 1 << 20, 1 << 30).expect("read"),
            Some(b"FROM scratch\n".to_vec())
        );
        assert_eq!(
            read_member(&p, Path::new("nope"), 1 << 20, 1 << 30).expect("read"),
            None
        );
        let d = t.path().join("out");
        std::fs::create_dir(&d).expect("mkdir");
        unpack(&p, &d, 1 << 20, None).expect("unpack");
        assert_eq!(std::fs::read(d.join("sub/a.txt")).expect("a"), b"a");
    }

    #[test]
    fn refuses_escapes_devices_and_bombs() {
        let t = tempfile::tempdir().expect("tmp");
        // A symlink to the outside, then a file written through it.
        let p = tarball(t.path(), |b| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, "out", "/tmp").expect("link");
            file(b, "out/kiln-escape-test", b"x");
        });
        let d = t.path().join("d1");
        std::fs::create_dir(&d).expect("mkdir");
        assert!(unpack(&p, &d, 1 << 20, None).is_err());
        assert!(!Path::new("/tmp/kiln-escape-test").exists());

        let p = tarball(t.path(), |b| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Char);
            h.set_size(0);
            h.set_device_major(1).expect("major");
            h.set_device_minor(3).expect("minor");
            b.append_data(&mut h, "null", &[][..]).expect("dev");
        });
        let d = t.path().join("d2");
        std::fs::create_dir(&d).expect("mkdir");
        let e = unpack(&p, &d, 1 << 20, None).expect_err("device refused");
        assert!(e.to_string().contains("not allowed"), "{e}");

        // A hard link to a host file.
        let p = tarball(t.path(), |b| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Link);
            h.set_size(0);
            b.append_link(&mut h, "passwd", "/etc/passwd")
                .expect("link");
        });
        let d = t.path().join("d4");
        std::fs::create_dir(&d).expect("mkdir");
        assert!(unpack(&p, &d, 1 << 20, None).is_err());
        assert!(!d.join("passwd").exists());

        let p = tarball(t.path(), |b| file(b, "big", &[0u8; 4096]));
        let d = t.path().join("d3");
        std::fs::create_dir(&d).expect("mkdir");
        assert!(unpack(&p, &d, 1000, None).is_err());

        for bad in ["../x", "/etc/passwd", "", "."] {
            assert!(check_member_path(bad).is_err(), "{bad}");
        }
    }

    /// Each refusal names the entry and the rule it broke, and no path of the server
    /// (issue 44 §6): a hard link out, a path through an outward symlink, a write through a
    /// symlink to the host, and bytes that are not a tar.
    #[test]
    fn refusals_name_the_entry_and_the_rule() {
        let t = tempfile::tempdir().expect("tmp");
        fn link(b: &mut tar::Builder<std::fs::File>, kind: tar::EntryType, name: &str, to: &str) {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(0);
            b.append_link(&mut h, name, to).expect("link");
        }
        type Make = Box<dyn Fn(&mut tar::Builder<std::fs::File>)>;
        let cases: Vec<(Make, &str)> = vec![
            (
                Box::new(|b| link(b, tar::EntryType::Link, "pw", "/etc/passwd")),
                "pw: hard link to \"/etc/passwd\": the target is outside the context",
            ),
            (
                Box::new(|b| {
                    link(b, tar::EntryType::Symlink, "up", "../../..");
                    file(b, "up/X", b"x");
                }),
                "up/X: the path goes through the symbolic link \"up\"",
            ),
            (
                Box::new(|b| {
                    link(b, tar::EntryType::Symlink, "out", "/tmp");
                    file(b, "out/kiln-escape-test", b"x");
                }),
                "out/kiln-escape-test: the path goes through the symbolic link \"out\"",
            ),
            (
                Box::new(|b| {
                    link(b, tar::EntryType::Symlink, "d", "/etc");
                    link(b, tar::EntryType::Link, "h", "d/passwd");
                }),
                "h: hard link to \"d/passwd\": the target goes through the symbolic link \"d\"",
            ),
        ];
        for (i, (make, want)) in cases.into_iter().enumerate() {
            let p = tarball(t.path(), make);
            let d = t.path().join(format!("case{i}"));
            std::fs::create_dir(&d).expect("mkdir");
            let e = unpack(&p, &d, 1 << 20, None).expect_err(want).to_string();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains(t.path().to_str().expect("utf-8")), "{e}");
        }
        assert!(!Path::new("/tmp/kiln-escape-test").exists());
        // The recipe twice (also as `./Dockerfile`): refused when the build reads it from the
        // context; another file twice is not.
        let p = tarball(t.path(), |b| {
            file(b, "Dockerfile", b"FROM scratch\n");
            file(b, "a", b"1");
            file(b, "a", b"2");
            file(b, "./Dockerfile", b"FROM busybox\n");
        });
        let d = t.path().join("dup");
        std::fs::create_dir(&d).expect("mkdir");
        let recipe = check_member_path("Dockerfile").expect("path");
        let e = unpack(&p, &d, 1 << 20, Some(&recipe))
            .expect_err("twice")
            .to_string();
        assert!(
            e.contains("the recipe Dockerfile is in the context more than once"),
            "{e}"
        );
        let d = t.path().join("dup-ok");
        std::fs::create_dir(&d).expect("mkdir");
        unpack(&p, &d, 1 << 20, None).expect("no recipe read from the context");
        // Not a tar: said so, without the bytes.
        let p = t.path().join("junk");
        std::fs::write(
            &p,
            b"\x7fELF\x02\x01 not a tarball at all, just some bytes".repeat(40),
        )
        .expect("write");
        let d = t.path().join("junk-out");
        std::fs::create_dir(&d).expect("mkdir");
        for e in [
            unpack(&p, &d, 1 << 20, None).expect_err("junk"),
            read_member(&p, Path::new("Dockerfile"), 1 << 20, 1 << 30).expect_err("junk"),
        ] {
            assert_eq!(
                e.to_string(),
                "context tarball: not a tar archive (or a gzip of one)"
            );
        }
    }

    /// The request path reads at most the byte bound of a compressed context, and stops at
    /// the recipe (issue 44 §5): a gzip of a 64 MiB entry of zeros with the Dockerfile behind
    /// it reads no more than the bound plus one buffer; with the Dockerfile first, it reads
    /// only that far.
    #[test]
    fn the_request_path_reads_at_most_the_byte_bound() {
        let t = tempfile::tempdir().expect("tmp");
        let gz = |name: &str, first_recipe: bool| {
            let p = t.path().join(name);
            let enc = flate2::write::GzEncoder::new(
                std::fs::File::create(&p).expect("create"),
                flate2::Compression::fast(),
            );
            let mut b = tar::Builder::new(enc);
            let mut big = tar::Header::new_gnu();
            big.set_size(64 << 20);
            big.set_mode(0o644);
            big.set_entry_type(tar::EntryType::Regular);
            let recipe = |b: &mut tar::Builder<_>| {
                let mut h = tar::Header::new_gnu();
                h.set_size(13);
                h.set_mode(0o644);
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, "Dockerfile", &b"FROM scratch\n"[..])
                    .expect("append");
            };
            if first_recipe {
                recipe(&mut b);
            }
            b.append_data(&mut big, "zeros", std::io::repeat(0).take(64 << 20))
                .expect("append");
            if !first_recipe {
                recipe(&mut b);
            }
            b.into_inner().expect("tar").finish().expect("gzip");
            p
        };
        let bound = 1u64 << 20;
        let behind = gz("behind.tar.gz", false);
        let e = read_member(&behind, Path::new("Dockerfile"), 1 << 20, bound)
            .expect_err("past the bound");
        assert!(
            e.to_string().contains("passes the context byte bound"),
            "{e}"
        );
        // Read through a counter: at most the bound and one buffer (64 KiB, with margin).
        let counted = {
            let (reader, read) = open_tar(&behind, bound).expect("open");
            let mut ar = tar::Archive::new(reader);
            let _ = ar.entries().map(|es| es.count());
            read.get()
        };
        assert!(counted <= bound + (64 << 10), "{counted}");
        let first = gz("first.tar.gz", true);
        let (found, read) =
            read_member_counted(&first, Path::new("Dockerfile"), 1 << 20, bound).expect("read");
        assert_eq!(found.as_deref(), Some(&b"FROM scratch\n"[..]));
        assert!(read < 64 << 10, "{read}");
        // The worker's unpack bounds the same archive by its file bytes.
        let d = t.path().join("out");
        std::fs::create_dir(&d).expect("mkdir");
        let e = unpack(&behind, &d, bound, None).expect_err("past the bound");
        assert!(e.to_string().contains("unpacks to more than"), "{e}");
    }
}
