//! OCI references: the store's second kind of name, for OCI images kept as blobs.
//!
//! A [`TagRef`](crate::TagRef) names a kiln manifest; an [`OciRef`] names an OCI image
//! manifest or index stored as a blob, under the registry reference it was pulled or imported
//! as (`registry/repository:tag`, e.g. `127.0.0.1:5000/debian:bookworm` or
//! `docker.io/library/debian:bookworm`). Key: `refs/oci/<registry>/<repo...>/<tag>`, each
//! segment encoded into the key alphabet (`[A-Za-z0-9._-]` kept, a leading `.` and every other
//! byte as `~xx`, two lower-case hex digits), holding one line: the blob digest.
//!
//! Like tags, OCI references are roots for GC ([`crate::gc`]) together with what their blob
//! names (config, layers, and the manifests of an index that are stored); verify checks them,
//! [`crate::copy::copy_oci_ref`] copies one between stores, and [`Store::list_oci_refs`]
//! lists them (`kiln tags`). They are moved by a plain atomic replace (last writer wins), as a
//! registry's tags are.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;

use crate::backend::Backend;
use crate::digest::BlobDigest;
use crate::{Store, StoreError};

/// Largest OCI reference object read, in bytes (a digest line is 72).
pub const MAX_OCI_REF_LEN: u64 = 1024;

/// Largest blob parsed as an OCI manifest or index when following a reference (bytes, 4 MiB:
/// the limit the builder applies to manifests it fetches).
pub const MAX_OCI_MANIFEST_BYTES: u64 = 4 << 20;

/// Errors about OCI references.
#[derive(Debug, thiserror::Error)]
pub enum OciRefError {
    /// A name that is not `registry/repository:tag` with sane segments.
    #[error("invalid OCI reference name {0:?} (expected registry/repository:tag)")]
    Invalid(String),
    /// A reference object that does not hold a digest.
    #[error("OCI reference {reference} in {store}: corrupt: {reason}")]
    Corrupt {
        /// The reference.
        reference: OciRef,
        /// The store.
        store: String,
        /// What is wrong.
        reason: String,
    },
}

/// `registry/repository:tag`: the name of an OCI image in the store.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OciRef {
    /// `registry/repository` (at least two `/`-separated segments).
    pub repository: String,
    /// The tag.
    pub tag: String,
}

impl OciRef {
    /// Builds and validates: `repository` is `/`-separated non-empty segments other than `.`
    /// and `..`, without NUL; `tag` is non-empty without `/`; the key fits 512 bytes.
    pub fn new(repository: &str, tag: &str) -> Result<Self, OciRefError> {
        let bad = || OciRefError::Invalid(format!("{repository}:{tag}"));
        let ok = |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains('\0');
        if !repository.split('/').all(ok) || !ok(tag) || tag.contains('/') {
            return Err(bad());
        }
        let r = OciRef {
            repository: repository.to_string(),
            tag: tag.to_string(),
        };
        crate::backend::validate_key(&r.key()).map_err(|_| bad())?;
        Ok(r)
    }

    /// `refs/oci/<encoded segments>/<encoded tag>`.
    pub fn key(&self) -> String {
        let mut k = String::from("refs/oci");
        for seg in self.repository.split('/').chain([self.tag.as_str()]) {
            k.push('/');
            encode_segment(seg, &mut k);
        }
        k
    }

    /// The reference a key names, `None` for a key that is not one.
    pub fn from_key(key: &str) -> Option<Self> {
        let rest = key.strip_prefix("refs/oci/")?;
        let segs: Vec<String> = rest.split('/').map(decode_segment).collect::<Option<_>>()?;
        let (tag, repo) = segs.split_last()?;
        let r = OciRef::new(&repo.join("/"), tag).ok()?;
        (r.key() == key).then_some(r)
    }
}

/// Appends `seg` in the key alphabet: `[A-Za-z0-9_-]` and a `.` after the first byte kept,
/// every other byte as `~xx` (two lower-case hex digits).
pub(crate) fn encode_segment(seg: &str, out: &mut String) {
    for (i, b) in seg.bytes().enumerate() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && i > 0) {
            out.push(b as char);
        } else {
            out.push_str(&format!("~{b:02x}"));
        }
    }
}

/// The inverse of [`encode_segment`] (`None` for a bad escape or bytes that are not UTF-8).
pub(crate) fn decode_segment(seg: &str) -> Option<String> {
    let b = seg.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'~' {
            let h = seg.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl FromStr for OciRef {
    type Err = OciRefError;
    /// Parses `registry/repository:tag` (the tag is after the last `:` that has no `/` after
    /// it, so a registry port is not taken for a tag).
    fn from_str(s: &str) -> Result<Self, OciRefError> {
        let (repo, tag) = s
            .rsplit_once(':')
            .filter(|(r, t)| !r.is_empty() && !t.contains('/'))
            .ok_or_else(|| OciRefError::Invalid(s.to_string()))?;
        OciRef::new(repo, tag)
    }
}

impl fmt::Display for OciRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.repository, self.tag)
    }
}

/// Parses a reference object's content: one `sha256:<hex>` line.
pub(crate) fn parse_ref_object(bytes: &[u8]) -> Result<BlobDigest, String> {
    if bytes.len() as u64 > MAX_OCI_REF_LEN {
        return Err(format!(
            "{} bytes is over the {MAX_OCI_REF_LEN}-byte limit for a reference",
            bytes.len()
        ));
    }
    std::str::from_utf8(bytes)
        .map_err(|e| e.to_string())
        .and_then(|t| t.trim().parse::<BlobDigest>().map_err(|e| e.to_string()))
}

/// The descriptors of an OCI image manifest or index that the store follows (OCI image spec,
/// manifest.md `config` and `layers`, image-index.md `manifests`); every other field is
/// ignored.
#[derive(serde::Deserialize)]
pub(crate) struct OciDocument {
    #[serde(default)]
    pub(crate) config: Option<OciDescriptor>,
    #[serde(default)]
    pub(crate) layers: Vec<OciDescriptor>,
    #[serde(default)]
    pub(crate) manifests: Vec<OciDescriptor>,
}

#[derive(serde::Deserialize)]
pub(crate) struct OciDescriptor {
    pub(crate) digest: String,
}

/// What an OCI reference reaches, for GC, verify and copy.
#[derive(Debug, Default)]
pub(crate) struct OciClosure {
    /// Every blob reached: the top blob, stored index children, configs and layers.
    pub(crate) blobs: Vec<BlobDigest>,
    /// Blobs an image manifest names (config, layers) that the store does not have, with the
    /// manifest naming them. (Index children not stored are platforms never pulled: fine.)
    pub(crate) missing: Vec<(BlobDigest, BlobDigest)>,
    /// Whether the top blob is present.
    pub(crate) top_present: bool,
}

impl Store {
    /// Points `r` at the OCI manifest or index blob `digest` (atomic replace). The blob
    /// should be stored first (publish order).
    pub async fn set_oci_ref(&self, r: &OciRef, digest: BlobDigest) -> Result<(), StoreError> {
        self.backend
            .put(&r.key(), Bytes::from(format!("{digest}\n")))
            .await?;
        Ok(())
    }

    /// The blob `r` names, `None` when there is no such reference.
    pub async fn get_oci_ref(&self, r: &OciRef) -> Result<Option<BlobDigest>, StoreError> {
        // At most one byte past the bound is read, so a planted huge object is never loaded.
        match self
            .backend
            .get_range(&r.key(), 0..MAX_OCI_REF_LEN + 1)
            .await
        {
            Ok(b) => parse_ref_object(&b)
                .map(Some)
                .map_err(|reason| self.corrupt_ref(r, reason)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes `r` (absent is fine). What it named stays until GC.
    pub async fn delete_oci_ref(&self, r: &OciRef) -> Result<(), StoreError> {
        self.backend.delete(&r.key()).await?;
        Ok(())
    }

    /// Every OCI reference, sorted, with what it names or why it cannot be read.
    pub async fn list_oci_refs(
        &self,
    ) -> Result<Vec<(OciRef, Result<BlobDigest, String>)>, StoreError> {
        let mut out = Vec::new();
        for o in self.backend.list("refs/oci/").await? {
            let Some(r) = OciRef::from_key(&o.key) else {
                continue;
            };
            let d = match self.backend.get_range(&o.key, 0..MAX_OCI_REF_LEN + 1).await {
                Ok(b) => parse_ref_object(&b),
                Err(e) => Err(e.to_string()),
            };
            out.push((r, d));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    fn corrupt_ref(&self, r: &OciRef, reason: String) -> StoreError {
        OciRefError::Corrupt {
            reference: r.clone(),
            store: self.url().to_string(),
            reason,
        }
        .into()
    }

    /// Follows the OCI manifest or index `top`: stored index children in turn, and each image
    /// manifest's config and layers. Only blobs of at most [`MAX_OCI_MANIFEST_BYTES`] are
    /// parsed; layers and configs are never read. `strict`: a manifest blob that cannot be
    /// read is an error (GC), else it is treated as naming nothing.
    pub(crate) async fn oci_closure(
        &self,
        top: BlobDigest,
        strict: bool,
    ) -> Result<OciClosure, StoreError> {
        let mut out = OciClosure::default();
        let mut seen = HashSet::new();
        let mut queue = vec![(top, true)];
        while let Some((d, is_top)) = queue.pop() {
            if !seen.insert(d) {
                continue;
            }
            let Some(info) = self.read_head(&d.key()).await? else {
                if is_top {
                    out.blobs.push(d);
                }
                continue;
            };
            out.blobs.push(d);
            if is_top {
                out.top_present = true;
            }
            if info.size > MAX_OCI_MANIFEST_BYTES {
                continue;
            }
            let bytes = match self.get_blob(&d).await {
                Ok(b) => b,
                Err(e) if strict => {
                    return Err(crate::GcError::Unreadable {
                        object: d.key(),
                        reason: e.to_string(),
                    }
                    .into());
                }
                Err(_) => continue,
            };
            let Ok(doc) = serde_json::from_slice::<OciDocument>(&bytes) else {
                continue;
            };
            for desc in doc.config.iter().chain(&doc.layers) {
                if let Ok(c) = desc.digest.parse::<BlobDigest>()
                    && seen.insert(c)
                {
                    out.blobs.push(c);
                    if self.read_head(&c.key()).await?.is_none() {
                        out.missing.push((c, d));
                    }
                }
            }
            for desc in &doc.manifests {
                if let Ok(m) = desc.digest.parse::<BlobDigest>() {
                    queue.push((m, false));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_keys() {
        for s in [
            "127.0.0.1:5000/x/y:t",
            "docker.io/library/debian:bookworm",
            "localhost/a.b_c-d:V1.2",
            "r/.hidden:_t",
        ] {
            let r: OciRef = s.parse().expect(s);
            assert_eq!(r.to_string(), s);
            let k = r.key();
            crate::backend::validate_key(&k).expect(&k);
            assert_eq!(OciRef::from_key(&k), Some(r), "{k}");
        }
        assert_eq!(
            "127.0.0.1:5000/x/y:t".parse::<OciRef>().unwrap().key(),
            "refs/oci/127.0.0.1~3a5000/x/y/t"
        );
        for bad in [
            "a/../../b:t",
            "a/./b:t",
            "a//b:t",
            "nocolon",
            ":t",
            "a/b:",
            "a/b:t/u",
        ] {
            assert!(bad.parse::<OciRef>().is_err(), "{bad}");
        }
        // Keys that are not the canonical encoding of a name are not references.
        for k in [
            "refs/oci/a/b~zz",
            "refs/oci/a/b~2",
            "refs/oci/onlytag",
            "refs/other/a/b",
            "refs/oci/a/~2e~2e/t",
            "refs/oci/a/~61/t",
        ] {
            assert_eq!(OciRef::from_key(k), None, "{k}");
        }
    }

    #[tokio::test]
    async fn set_get_list_delete() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let r: OciRef = "127.0.0.1:5000/busybox:1".parse().unwrap();
        assert_eq!(store.get_oci_ref(&r).await.unwrap(), None);
        let b = store.put_blob(Bytes::from_static(b"{}")).await.unwrap();
        store.set_oci_ref(&r, b.digest).await.unwrap();
        assert_eq!(store.get_oci_ref(&r).await.unwrap(), Some(b.digest));
        let listed = store.list_oci_refs().await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].0, r);
        assert_eq!(listed[0].1, Ok(b.digest));
        std::fs::write(dir.path().join(r.key()), b"not a digest").unwrap();
        let err = store.get_oci_ref(&r).await.unwrap_err();
        assert!(err.to_string().contains("corrupt"), "{err}");
        assert!(store.list_oci_refs().await.unwrap()[0].1.is_err());
        // A planted 1 TiB sparse reference is refused unread.
        let p = dir.path().join(r.key());
        std::fs::remove_file(&p).unwrap();
        std::fs::File::create(&p).unwrap().set_len(1 << 40).unwrap();
        let err = store.get_oci_ref(&r).await.unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        assert!(store.list_oci_refs().await.unwrap()[0].1.is_err());
        store.delete_oci_ref(&r).await.unwrap();
        assert!(store.list_oci_refs().await.unwrap().is_empty());
    }

    /// An OCI image (index → manifest → config + layer, and a platform never pulled):
    /// GC keeps what the reference reaches, verify names a missing layer, copy moves the
    /// blobs and the reference.
    #[tokio::test]
    async fn gc_verify_and_copy_know_oci_references() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).await.unwrap();
        let put = |b: &'static [u8]| {
            let store = store.clone();
            async move { store.put_blob(Bytes::from_static(b)).await.unwrap().digest }
        };
        let config = put(b"{\"config\":{}}").await;
        let layer = put(b"layer bytes").await;
        let manifest = store
            .put_blob(Bytes::from(format!(
                r#"{{"schemaVersion":2,"config":{{"digest":"{config}","size":1}},"layers":[{{"digest":"{layer}","size":1}}]}}"#
            )))
            .await
            .unwrap()
            .digest;
        let absent = BlobDigest::of(b"arm64 manifest never pulled");
        let index = store
            .put_blob(Bytes::from(format!(
                r#"{{"schemaVersion":2,"manifests":[{{"digest":"{manifest}","size":1}},{{"digest":"{absent}","size":1}}]}}"#
            )))
            .await
            .unwrap()
            .digest;
        let orphan = put(b"orphan").await;
        let r: OciRef = "127.0.0.1:5000/multi:latest".parse().unwrap();
        store.set_oci_ref(&r, index).await.unwrap();
        let gc = crate::gc::GcOptions {
            grace: std::time::Duration::ZERO,
            ..Default::default()
        };
        let report = store.gc(&gc).await.unwrap();
        let gone: Vec<&str> = report.collected.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(gone, [orphan.key().as_str()]);
        let v = store.verify(true, &gc).await.unwrap();
        assert!(v.is_ok(), "{:?}", v.findings);
        assert_eq!(v.blobs, 4, "index, manifest, config, layer");

        // Copy into another store: blobs first, then the reference.
        let dir2 = tempfile::tempdir().unwrap();
        let dst = Store::open(dir2.path().to_str().unwrap()).await.unwrap();
        let c = crate::copy::copy_oci_ref(&store, &dst, &r, &Default::default())
            .await
            .unwrap();
        assert_eq!(c.digest, index);
        assert_eq!(c.stats.blobs_transferred, 4);
        assert_eq!(dst.get_oci_ref(&r).await.unwrap(), Some(index));
        for b in [index, manifest, config, layer] {
            assert_eq!(
                dst.get_blob(&b).await.unwrap(),
                store.get_blob(&b).await.unwrap()
            );
        }
        assert!(dst.verify(true, &gc).await.unwrap().is_ok());

        // A lost layer is a finding naming the reference; copying it then fails.
        std::fs::remove_file(dir.path().join(layer.key())).unwrap();
        let v = store.verify(false, &gc).await.unwrap();
        assert_eq!(
            v.findings,
            [crate::verify::Finding::OciRefMissingBlob {
                reference: r.to_string(),
                blob: layer
            }]
        );
        let dir3 = tempfile::tempdir().unwrap();
        let dst3 = Store::open(dir3.path().to_str().unwrap()).await.unwrap();
        let err = crate::copy::copy_oci_ref(&store, &dst3, &r, &Default::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains(&layer.hex()), "{err}");
        assert_eq!(dst3.get_oci_ref(&r).await.unwrap(), None);
        // A corrupt reference stops GC and is a verify finding.
        std::fs::write(dir.path().join(r.key()), b"garbage").unwrap();
        assert!(store.gc(&gc).await.is_err());
        let v = store.verify(false, &gc).await.unwrap();
        assert!(
            matches!(&v.findings[..], [crate::verify::Finding::OciRefCorrupt { key, .. }] if *key == r.key()),
            "{:?}",
            v.findings
        );
    }
}
