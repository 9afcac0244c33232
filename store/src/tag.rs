//! Tags: the only mutable objects. `tags/<name>/<tag>` holds a JSON [`TagRecord`] naming a
//! manifest; it moves only by compare-and-swap against the digest the caller expects (or
//! expects absent). Every move is appended to `tags/<name>/<tag>~history` (JSON lines of
//! [`HistoryEntry`]: time, host, previous and new digest), itself updated by compare-and-swap.
//! Manifests hold no times; the history does.
//!
//! Grammar (OCI distribution spec, "Pulling manifests", tag and repository name rules,
//! restricted to one path segment so that the key layout stays unambiguous):
//! name `[a-z0-9]+([._-][a-z0-9]+)*` up to 128 bytes; tag `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
//! Written `name:tag`.
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
        "invalid tag reference {0:?} (expected name:tag, name [a-z0-9._-], tag [A-Za-z0-9._-])"
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

/// `name:tag`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TagRef {
    /// Repository-like name.
    pub name: String,
    /// Tag within the name.
    pub tag: String,
}

fn valid_name(s: &str) -> bool {
    s.len() <= 128
        && !s.is_empty()
        && s.split(['.', '_', '-']).all(|p| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        })
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

    /// `tags/<name>/<tag>`.
    pub fn key(&self) -> String {
        format!("tags/{}/{}", self.name, self.tag)
    }

    /// `tags/<name>/<tag>~history`.
    pub fn history_key(&self) -> String {
        format!("tags/{}/{}~history", self.name, self.tag)
    }

    fn from_key(key: &str) -> Option<Self> {
        let rest = key.strip_prefix("tags/")?;
        let (name, tag) = rest.split_once('/')?;
        TagRef::new(name, tag).ok()
    }
}

impl FromStr for TagRef {
    type Err = TagError;
    fn from_str(s: &str) -> Result<Self, TagError> {
        let (n, t) = s
            .split_once(':')
            .ok_or_else(|| TagError::Invalid(s.to_string()))?;
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
        if self.backend.head(&new.key()).await?.is_none() {
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
            Some(n) if valid_name(n) => format!("tags/{n}/"),
            Some(n) => return Err(TagError::Invalid(n.to_string()).into()),
            None => "tags/".to_string(),
        };
        let mut out = Vec::new();
        for o in self.backend.list(&prefix).await? {
            let Some(t) = TagRef::from_key(&o.key) else {
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
        bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                serde_json::from_slice(l).map_err(|e| {
                    TagError::Corrupt {
                        tag: t.clone(),
                        store: self.url().to_string(),
                        reason: format!("history: {e}"),
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
        let key = t.history_key();
        for _ in 0..20 {
            let (mut bytes, version) = match self.backend.get_versioned(&key).await {
                Ok((b, v)) => (b.to_vec(), Some(v)),
                Err(e) if e.is_not_found() => (Vec::new(), None),
                Err(e) => return Err(e.into()),
            };
            bytes.extend_from_slice(&line);
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
            "x",
            ":t",
            "n:",
            "N:t",
            "n/x:t",
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
}
