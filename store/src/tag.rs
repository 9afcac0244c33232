//! Tags: the only mutable objects. `tags/<name>/<tag>` holds a JSON [`TagRecord`] naming a
//! manifest; it moves only by compare-and-swap against the digest the caller expects (or
//! expects absent). Every move is appended to `tags/<name>/<tag>~history` (JSON lines of
//! [`HistoryEntry`]: time, host, previous and new digest), itself updated by compare-and-swap.
//! Manifests hold no times; the history does.
//!
//! Grammar (OCI distribution spec v1.1, "Pulling manifests": the `<name>` and `<reference>`
//! rules, as `docker build -t` takes them, without a registry host): a name is one or more
//! `/`-separated path components `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`, up to 255 bytes in all
//! (the total Docker's reference grammar allows) with each `/` counted as the 3 bytes of its
//! escape below; a tag is `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
//! Written `name:tag`; a name alone means `name:latest`, as in Docker.
//!
//! In keys the name is one segment: each `/` is written `~2f`, the escape OCI references use
//! ([`crate::ociref`]). A path component never holds `~`, so the encoding is one-to-one and a
//! tag key is always `tags/<one segment>/<one segment>`: `a/b:t` (`tags/a~2fb/t`) can neither
//! collide with the tag `b` of `a` (`tags/a/b`) nor reach outside `tags/`. Names without a `/`
//! keep the keys they always had.
//!
//! A tag is set only after its manifest exists (publish order). Untagging checks the expected
//! digest then deletes; backends have no conditional delete, so an untag racing a move can
//! remove the newer value (the history records both).

use std::fmt;
use std::str::FromStr;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, BackendError};
use crate::digest::ManifestDigest;
use crate::{Store, StoreError, hostname, unix_now};

/// Largest tag record accepted, in bytes (4 KiB; a record is about 150 bytes).
pub const MAX_TAG_RECORD_LEN: usize = 4096;

/// Errors about tags.
#[derive(Debug, thiserror::Error)]
pub enum TagError {
    /// A `name:tag` string that breaks the grammar.
    #[error(
        "invalid tag reference {0:?} (expected NAME[:TAG]: NAME is /-separated components of \
         [a-z0-9] joined by . _ __ or -, up to 255 bytes (a / counts 3), without a registry \
         host; \
         TAG is [A-Za-z0-9_][A-Za-z0-9._-], up to 128 bytes)"
    )]
    Invalid(String),
    /// No such tag.
    #[error("tag {tag} not found in {store}")]
    NotFound {
        /// The tag.
        tag: TagRef,
        /// The store.
        store: String,
    },
    /// The tag did not hold what the caller expected: another writer moved it first.
    #[error("tag {tag} in {store} is stale: expected {}, found {}", show(.expected), show(.actual))]
    Stale {
        /// The tag.
        tag: TagRef,
        /// The store.
        store: String,
        /// What the caller expected (`None`: absent).
        expected: Option<ManifestDigest>,
        /// What the tag held (`None`: absent, or unknown when the CAS itself lost).
        actual: Option<ManifestDigest>,
    },
    /// Setting a tag to a manifest the store does not have.
    #[error("tag {tag}: manifest {manifest} is not in {store}")]
    MissingManifest {
        /// The tag.
        tag: TagRef,
        /// The manifest named.
        manifest: ManifestDigest,
        /// The store.
        store: String,
    },
    /// A tag or history object that does not parse.
    #[error("tag {tag} in {store}: corrupt record: {reason}")]
    Corrupt {
        /// The tag.
        tag: TagRef,
        /// The store.
        store: String,
        /// The parser's message.
        reason: String,
    },
}

fn show(d: &Option<ManifestDigest>) -> String {
    d.map_or_else(|| "absent".to_string(), |d| d.to_string())
}

/// The tag a name alone means (`app` is `app:latest`), as in Docker.
pub const DEFAULT_TAG: &str = "latest";

/// Longest name, in bytes, each `/` counting 3 (Docker's reference grammar allows 255,
/// `NameTotalLengthMax`; the key segment of a name must also fit one file name).
pub const MAX_NAME_LEN: usize = 255;

/// `name:tag`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TagRef {
    /// Repository name: `/`-separated path components (`myorg/app`).
    pub name: String,
    /// Tag within the name.
    pub tag: String,
}

/// One path component: `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`.
fn valid_component(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let mut i = 0;
    loop {
        // A run of [a-z0-9]+.
        let start = i;
        while i < b.len() && alnum(b[i]) {
            i += 1;
        }
        if i == start {
            return false;
        }
        if i == b.len() {
            return true;
        }
        // A separator: `.`, `_`, `__` or `-+`, followed by another run.
        match b[i] {
            b'.' => i += 1,
            b'_' => i += if b.get(i + 1) == Some(&b'_') { 2 } else { 1 },
            b'-' => {
                while b.get(i) == Some(&b'-') {
                    i += 1;
                }
            }
            _ => return false,
        }
    }
}

/// A repository name: `/`-separated [`valid_component`]s whose key segment (the name with
/// each `/` written as the 3 bytes `~2f`) is at most [`MAX_NAME_LEN`] bytes, so that it is
/// one file name in a local store (`NAME_MAX`, 255 on Linux).
fn valid_name(s: &str) -> bool {
    s.len() + 2 * s.matches('/').count() <= MAX_NAME_LEN && s.split('/').all(valid_component)
}

fn valid_tag(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

impl TagRef {
    /// Builds and validates.
    pub fn new(name: &str, tag: &str) -> Result<Self, TagError> {
        if valid_name(name) && valid_tag(tag) {
            Ok(Self {
                name: name.to_string(),
                tag: tag.to_string(),
            })
        } else {
            Err(TagError::Invalid(format!("{name}:{tag}")))
        }
    }

    /// `tags/<name>/<tag>`, the name's `/` written `~2f` (see the module doc).
    pub fn key(&self) -> String {
        format!("{}{}", name_prefix(&self.name), self.tag)
    }

    /// `tags/<name>/<tag>~history`.
    pub fn history_key(&self) -> String {
        format!("{}~history", self.key())
    }

    /// `tags/<name>/<tag>~reports` ([`Store::append_tag_report`]).
    pub fn reports_key(&self) -> String {
        format!("{}~reports", self.key())
    }
}

/// Whether `key` is one of a tag's side objects (its history or its reports), not a tag.
pub(crate) fn is_side_key(key: &str) -> bool {
    key.ends_with("~history") || key.ends_with("~reports")
}

impl TagRef {
    /// The tag a key names (`None` for a history key or anything that is not a tag key:
    /// exactly `tags/<segment>/<segment>`, decoding to a valid name and tag, and written the
    /// one way [`TagRef::key`] writes it).
    pub(crate) fn from_key(key: &str) -> Option<Self> {
        let rest = key.strip_prefix("tags/")?;
        let (name, tag) = rest.split_once('/')?;
        let t = TagRef::new(&crate::ociref::decode_segment(name)?, tag).ok()?;
        (t.key() == key).then_some(t)
    }
}

/// `tags/<encoded name>/`: the prefix of every key of `name`'s tags.
fn name_prefix(name: &str) -> String {
    let mut k = String::from("tags/");
    crate::ociref::encode_segment(name, &mut k);
    k.push('/');
    k
}

impl FromStr for TagRef {
    type Err = TagError;
    /// `NAME:TAG`, or `NAME` for `NAME:latest` ([`DEFAULT_TAG`]). A name holds no `:`, so the
    /// first `:` ends it.
    fn from_str(s: &str) -> Result<Self, TagError> {
        let (n, t) = s.split_once(':').unwrap_or((s, DEFAULT_TAG));
        TagRef::new(n, t).map_err(|_| TagError::Invalid(s.to_string()))
    }
}

impl fmt::Display for TagRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

/// What `tags/<name>/<tag>` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagRecord {
    /// The manifest the tag names.
    pub manifest: ManifestDigest,
    /// When it was set, unix seconds.
    pub time: u64,
    /// Host that set it.
    pub host: String,
}

/// One line of a tag's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryEntry {
    /// When, unix seconds.
    pub time: u64,
    /// Which host.
    pub host: String,
    /// Digest before the move (`None`: the tag was absent).
    pub previous: Option<ManifestDigest>,
    /// Digest after the move (`None`: untagged).
    pub new: Option<ManifestDigest>,
}

impl Store {
    async fn read_tag(
        &self,
        t: &TagRef,
    ) -> Result<Option<(TagRecord, crate::backend::Version)>, StoreError> {
        match self.backend.get_versioned(&t.key()).await {
            Ok((bytes, _)) if bytes.len() > MAX_TAG_RECORD_LEN => Err(TagError::Corrupt {
                tag: t.clone(),
                store: self.url().to_string(),
                reason: format!(
                    "{} bytes, over the {MAX_TAG_RECORD_LEN}-byte limit",
                    bytes.len()
                ),
            }
            .into()),
            Ok((bytes, v)) => {
                let rec: TagRecord =
                    serde_json::from_slice(&bytes).map_err(|e| TagError::Corrupt {
                        tag: t.clone(),
                        store: self.url().to_string(),
                        reason: e.to_string(),
                    })?;
                Ok(Some((rec, v)))
            }
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The tag's record, or `None` when absent.
    pub async fn get_tag(&self, t: &TagRef) -> Result<Option<TagRecord>, StoreError> {
        Ok(self.read_tag(t).await?.map(|(r, _)| r))
    }

    /// The manifest a tag names. Errors: [`TagError::NotFound`].
    pub async fn resolve_tag(&self, t: &TagRef) -> Result<ManifestDigest, StoreError> {
        match self.get_tag(t).await? {
            Some(r) => Ok(r.manifest),
            None => Err(TagError::NotFound {
                tag: t.clone(),
                store: self.url().to_string(),
            }
            .into()),
        }
    }

    /// Moves `t` from `expected` (`None`: must be absent) to `new` by compare-and-swap, then
    /// appends to its history. `new` must already be in the store. Errors:
    /// [`TagError::Stale`] when the tag held something else or another writer won the race,
    /// [`TagError::MissingManifest`].
    pub async fn set_tag(
        &self,
        t: &TagRef,
        expected: Option<ManifestDigest>,
        new: ManifestDigest,
    ) -> Result<(), StoreError> {
        // As a reader sees it: a manifest GC condemned during this publish is still there.
        if self.read_head(&new.key()).await?.is_none() {
            return Err(TagError::MissingManifest {
                tag: t.clone(),
                manifest: new,
                store: self.url().to_string(),
            }
            .into());
        }
        let current = self.read_tag(t).await?;
        let actual = current.as_ref().map(|(r, _)| r.manifest);
        if actual != expected {
            return Err(self.stale(t, expected, actual));
        }
        let rec = TagRecord {
            manifest: new,
            time: unix_now(),
            host: hostname(),
        };
        // Serializing these plain types cannot fail.
        let bytes = Bytes::from(serde_json::to_vec(&rec).unwrap_or_default());
        match self
            .backend
            .compare_and_swap(&t.key(), current.as_ref().map(|(_, v)| v), bytes)
            .await
        {
            Ok(_) => {}
            Err(BackendError::Conflict { .. }) => {
                let now = self.get_tag(t).await.ok().flatten().map(|r| r.manifest);
                return Err(self.stale(t, expected, now));
            }
            Err(e) => return Err(e.into()),
        }
        self.append_history(t, actual, Some(new)).await
    }

    /// Sets `t` to `new` whatever it holds now (a few compare-and-swap attempts). Returns the
    /// previous digest.
    pub async fn force_tag(
        &self,
        t: &TagRef,
        new: ManifestDigest,
    ) -> Result<Option<ManifestDigest>, StoreError> {
        let mut last = None;
        for _ in 0..5 {
            let prev = self.get_tag(t).await?.map(|r| r.manifest);
            match self.set_tag(t, prev, new).await {
                Ok(()) => return Ok(prev),
                Err(StoreError::Tag(e @ TagError::Stale { .. })) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        // The loop ran at least once and only continues after setting `last`.
        Err(last
            .map(StoreError::Tag)
            .unwrap_or_else(|| self.stale(t, None, None)))
    }

    /// Removes `t` if it names `expected` (`None`: whatever it names). Errors:
    /// [`TagError::NotFound`], [`TagError::Stale`].
    pub async fn untag(
        &self,
        t: &TagRef,
        expected: Option<ManifestDigest>,
    ) -> Result<ManifestDigest, StoreError> {
        let Some((rec, _)) = self.read_tag(t).await? else {
            return Err(TagError::NotFound {
                tag: t.clone(),
                store: self.url().to_string(),
            }
            .into());
        };
        if let Some(e) = expected
            && e != rec.manifest
        {
            return Err(self.stale(t, Some(e), Some(rec.manifest)));
        }
        self.backend.delete(&t.key()).await?;
        self.append_history(t, Some(rec.manifest), None).await?;
        Ok(rec.manifest)
    }

    /// Every tag (optionally only those of `name`) with the manifest it names, sorted.
    /// Unparseable tag objects are skipped here (verify reports them).
    pub async fn list_tags(
        &self,
        name: Option<&str>,
    ) -> Result<Vec<(TagRef, ManifestDigest)>, StoreError> {
        let prefix = match name {
            Some(n) if valid_name(n) => name_prefix(n),
            Some(n) => return Err(TagError::Invalid(n.to_string()).into()),
            None => "tags/".to_string(),
        };
        self.tags_under(&prefix, "").await
    }

    /// Every tag whose name starts with `start` (a workspace's `<ws>.`), with the manifest it
    /// names, sorted; one listing of the keys under `tags/<start, encoded>`. Unparseable tag
    /// objects are skipped, as by [`Store::list_tags`].
    pub async fn list_tags_named_from(
        &self,
        start: &str,
    ) -> Result<Vec<(TagRef, ManifestDigest)>, StoreError> {
        // The key alphabet encodes byte by byte, so the encoded start of a name is the start
        // of its encoding.
        let mut prefix = String::from("tags/");
        crate::ociref::encode_segment(start, &mut prefix);
        self.tags_under(&prefix, start).await
    }

    /// The tags whose keys start with `prefix` and names with `start`, with their manifests.
    async fn tags_under(
        &self,
        prefix: &str,
        start: &str,
    ) -> Result<Vec<(TagRef, ManifestDigest)>, StoreError> {
        let mut out = Vec::new();
        for o in self.backend.list(prefix).await? {
            let Some(t) = TagRef::from_key(&o.key).filter(|t| t.name.starts_with(start)) else {
                continue;
            };
            if let Ok(Some(r)) = self.get_tag(&t).await {
                out.push((t, r.manifest));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The tag's history, oldest first (empty when never set).
    pub async fn tag_history(&self, t: &TagRef) -> Result<Vec<HistoryEntry>, StoreError> {
        let bytes = match self.backend.get(&t.history_key()).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        self.parse_history(t, &bytes)
    }

    fn parse_history(&self, t: &TagRef, bytes: &[u8]) -> Result<Vec<HistoryEntry>, StoreError> {
        self.parse_json_lines(t, bytes, "history")
    }

    /// One JSON value per non-empty line of `t`'s side object `what` (`history`, `reports`);
    /// a bad line is [`TagError::Corrupt`].
    fn parse_json_lines<T: serde::de::DeserializeOwned>(
        &self,
        t: &TagRef,
        bytes: &[u8],
        what: &str,
    ) -> Result<Vec<T>, StoreError> {
        bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                serde_json::from_slice(l).map_err(|e| {
                    TagError::Corrupt {
                        tag: t.clone(),
                        store: self.url().to_string(),
                        reason: format!("{what}: {e}"),
                    }
                    .into()
                })
            })
            .collect()
    }

    async fn append_history(
        &self,
        t: &TagRef,
        previous: Option<ManifestDigest>,
        new: Option<ManifestDigest>,
    ) -> Result<(), StoreError> {
        let entry = HistoryEntry {
            time: unix_now(),
            host: hostname(),
            previous,
            new,
        };
        // Serializing these plain types cannot fail.
        let mut line = serde_json::to_vec(&entry).unwrap_or_default();
        line.push(b'\n');
        self.append_line(t.history_key(), &line).await
    }

    /// Appends one report (a JSON value, written as one line) to `t`'s reports,
    /// `tags/<name>/<tag>~reports`: what the nightly job keeps of each night beside the
    /// tag's history. Not copied by `kiln store push`; GC and verify leave it alone.
    pub async fn append_tag_report(
        &self,
        t: &TagRef,
        report: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let mut line = serde_json::to_vec(report).unwrap_or_default();
        line.push(b'\n');
        self.append_line(t.reports_key(), &line).await
    }

    /// `t`'s reports ([`Store::append_tag_report`]), oldest first.
    pub async fn tag_reports(&self, t: &TagRef) -> Result<Vec<serde_json::Value>, StoreError> {
        let bytes = match self.backend.get(&t.reports_key()).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        self.parse_json_lines(t, &bytes, "reports")
    }

    /// Appends `line` to the object `key` by compare-and-swap (a few attempts).
    async fn append_line(&self, key: String, line: &[u8]) -> Result<(), StoreError> {
        for _ in 0..20 {
            let (mut bytes, version) = match self.backend.get_versioned(&key).await {
                Ok((b, v)) => (b.to_vec(), Some(v)),
                Err(e) if e.is_not_found() => (Vec::new(), None),
                Err(e) => return Err(e.into()),
            };
            bytes.extend_from_slice(line);
            match self
                .backend
                .compare_and_swap(&key, version.as_ref(), Bytes::from(bytes))
                .await
            {
                Ok(_) => return Ok(()),
                Err(BackendError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(BackendError::Conflict {
            store: self.url().to_string(),
            key,
        }
        .into())
    }

    fn stale(
        &self,
        t: &TagRef,
        expected: Option<ManifestDigest>,
        actual: Option<ManifestDigest>,
    ) -> StoreError {
        TagError::Stale {
            tag: t.clone(),
            store: self.url().to_string(),
            expected,
            actual,
        }
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar() {
        let t: TagRef = "my-img.x:v1.0_rc-1".parse().unwrap();
        assert_eq!(t.key(), "tags/my-img.x/v1.0_rc-1");
        for bad in [
            ":t",
            "n:",
            "N:t",
            "n:.t",
            "n:-t",
            "../x:t",
            "n:t/../../x",
            "a..b:t",
            "n:t~history",
        ] {
            assert!(bad.parse::<TagRef>().is_err(), "{bad}");
        }
        assert_eq!(TagRef::from_key("tags/n/t~history"), None);
        assert_eq!(
            TagRef::from_key("tags/n/t"),
            Some(TagRef::new("n", "t").unwrap())
        );
    }

    /// Issue 17, item 6: `-t myorg/app:v1` and `-t app` as Docker users write them.
    #[test]
    fn docker_repository_paths_and_the_default_tag() {
        let t: TagRef = "myorg/app:v1".parse().unwrap();
        assert_eq!((t.name.as_str(), t.tag.as_str()), ("myorg/app", "v1"));
        assert_eq!(t.to_string(), "myorg/app:v1");
        assert_eq!(
            "app".parse::<TagRef>().unwrap(),
            TagRef::new("app", "latest").unwrap()
        );
        assert_eq!(
            "myorg/team/app".parse::<TagRef>().unwrap().to_string(),
            "myorg/team/app:latest"
        );
        // The separators of the OCI distribution spec's path-component rule.
        for ok in [
            "a__b",
            "a--b",
            "a---b",
            "a.b-c_d",
            "0/1/2",
            "docker.io/library/busybox",
        ] {
            assert!(TagRef::new(ok, "t").is_ok(), "{ok}");
        }
        let longest = format!("{}/{}", "a".repeat(126), "b".repeat(126));
        assert!(TagRef::new(&longest, &"t".repeat(128)).is_ok());
        assert!(TagRef::new(&"a/".repeat(85)[..169], "t").is_err());
        for bad in [
            "a/",
            "/a",
            "a//b",
            "a/../b",
            "a/./b",
            "..",
            "a/.b",
            "a/b.",
            "a/_b",
            "a/b_",
            "a/-b",
            "a___b",
            "a_-b",
            "a.-b",
            "a..b",
            "A/b",
            "a/B",
            "a~2fb",
            "a%2fb",
            "a b",
            "a\\b",
            "127.0.0.1:5000/app",
            "localhost:5000/app",
            "a/b@sha256",
        ] {
            assert!(TagRef::new(bad, "t").is_err(), "{bad}");
        }
        assert!(TagRef::new(&format!("{longest}c"), "t").is_err());
        for bad in ["127.0.0.1:5000/app:v1", "a/b:c/d", "a/b:", "a/:t", "a:b:c"] {
            assert!(bad.parse::<TagRef>().is_err(), "{bad}");
        }
    }

    /// A name's `/` cannot escape `tags/` or collide with another name's tag.
    #[test]
    fn slashed_names_have_their_own_key_segment() {
        let nested = TagRef::new("a/b", "t").unwrap();
        let sibling = TagRef::new("a", "b").unwrap();
        assert_eq!(nested.key(), "tags/a~2fb/t");
        assert_eq!(nested.history_key(), "tags/a~2fb/t~history");
        assert_eq!(sibling.key(), "tags/a/b");
        assert!(!nested.key().starts_with(&format!("{}/", sibling.key())));
        for t in [&nested, &sibling] {
            crate::backend::validate_key(&t.key()).unwrap();
            crate::backend::validate_key(&t.history_key()).unwrap();
            assert_eq!(TagRef::from_key(&t.key()).as_ref(), Some(t));
        }
        let longest = TagRef::new(
            &format!("{}/{}", "a".repeat(126), "b".repeat(126)),
            &"t".repeat(128),
        )
        .unwrap();
        assert_eq!(
            longest.key().split('/').nth(1).map(str::len),
            Some(MAX_NAME_LEN)
        );
        crate::backend::validate_key(&longest.history_key()).unwrap();
        // Keys not written by `key`: nested segments, other escapes, a raw `/` in the name.
        for k in [
            "tags/a/b/t",
            "tags/a~2Fb/t",
            "tags/a~2e~2e/t",
            "tags/~2e~2e/t",
            "tags/a~2f~2fb/t",
            "tags/a~2f/t",
            "tags/a~2fb~2f~2e~2e/t",
            "tags/a~2fb/t~history",
            "tags/a~2",
        ] {
            assert_eq!(TagRef::from_key(k), None, "{k}");
        }
    }

    /// `a:b`, `a/b:t`, `a/b/c:t` and the longest name live side by side in one local store:
    /// each resolves to its own manifest, listing by name is exact, GC keeps all four
    /// images, verify finds nothing wrong, untag removes only the one named.
    #[tokio::test]
    async fn nested_names_and_their_neighbours_in_one_local_store() {
        use crate::artifact::PutArtifactOptions;
        use crate::manifest::{ImageManifest, Manifest};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let longest = format!(
            "{}/{}:{}",
            "a".repeat(126),
            "b".repeat(126),
            "t".repeat(128)
        );
        let names = ["a:b", "a/b:t", "a/b/c:t", longest.as_str()];
        let mut want = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let data = vec![i as u8 + 1; 5000];
            let (table, _) = store
                .put_artifact_reader(std::io::Cursor::new(data), &PutArtifactOptions::default())
                .await
                .unwrap();
            let raw = store
                .put_manifest(&Manifest::Image(ImageManifest::new(table)))
                .await
                .unwrap();
            let t: TagRef = n.parse().unwrap();
            store.set_tag(&t, None, raw.digest).await.unwrap();
            store.force_tag(&t, raw.digest).await.unwrap();
            want.push((t, raw.digest));
        }
        for (t, d) in &want {
            assert_eq!(store.resolve_tag(t).await.unwrap(), *d, "{t}");
            assert_eq!(store.tag_history(t).await.unwrap().len(), 2, "{t}");
        }
        let mut sorted = want.clone();
        sorted.sort();
        assert_eq!(store.list_tags(None).await.unwrap(), sorted);
        assert_eq!(store.list_tags(Some("a")).await.unwrap(), want[..1]);
        assert_eq!(store.list_tags(Some("a/b")).await.unwrap(), want[1..2]);
        assert!(store.list_tags(Some("a/")).await.is_err());
        // By the start of the name: `a/` takes the names nested in `a`, not `a` itself nor
        // `aaa…/b…`; a start nothing has lists nothing.
        assert_eq!(store.list_tags_named_from("a/").await.unwrap(), want[1..3]);
        assert_eq!(store.list_tags_named_from("a").await.unwrap(), sorted);
        assert!(store.list_tags_named_from("b").await.unwrap().is_empty());
        let gc = crate::gc::GcOptions {
            grace: std::time::Duration::ZERO,
            ..Default::default()
        };
        let report = store.gc(&gc).await.unwrap();
        assert!(report.collected.is_empty(), "{:?}", report.collected);
        let v = store.verify(true, &gc).await.unwrap();
        assert!(v.is_ok(), "{:?}", v.findings);
        store.untag(&want[0].0, None).await.unwrap();
        assert_eq!(store.list_tags(None).await.unwrap().len(), 3);
        assert_eq!(store.resolve_tag(&want[1].0).await.unwrap(), want[1].1);
    }
}
