//! Verify: check that everything reachable is present and well-formed, and list orphans.
//!
//! From every tag (and every live lease and cache entry, as GC sees them): each reachable
//! manifest must read, hash to its name and parse (including chunk-table validation); each
//! chunk and blob it names must exist; with `deep`, each chunk must decompress and hash to its
//! name and each blob must hash to its name. Every OCI reference ([`crate::ociref`]) must hold
//! a digest, and its manifest or index, and each config and layer of an image manifest it
//! reaches, must be present (and, with `deep`, hash to its name). Problems are [`Finding`]s in the report, never
//! errors: a store full of damage still yields a complete report. Orphans are unreachable
//! objects, marked with whether GC would collect them now (older than the grace period).
//! An object held only at its fossil key (`fossil/<key>`, mid-GC or after a GC that
//! stopped; see [`crate::gc`]) is present, since every read falls back to it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::SystemTime;

use futures::StreamExt;
use serde::Serialize;

use crate::backend::Backend;
use crate::digest::{BlobDigest, ChunkDigest, ManifestDigest};
use crate::gc::{GcOptions, Marked};
use crate::manifest::{Manifest, ManifestError, ObjectRef, references};
use crate::{Store, StoreError};

/// One problem found by verify.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "finding", rename_all = "camelCase")]
pub enum Finding {
    /// A tag object that does not parse.
    TagCorrupt {
        /// The tag key.
        key: String,
        /// Why.
        reason: String,
    },
    /// A tag naming a manifest the store does not have.
    TagMissingManifest {
        /// `name:tag`.
        tag: String,
        /// The manifest named.
        manifest: ManifestDigest,
    },
    /// A manifest named by another manifest but absent.
    MissingManifest {
        /// The manifest that names it.
        parent: ManifestDigest,
        /// The absent one.
        manifest: ManifestDigest,
    },
    /// A manifest that does not read, hash right or parse.
    UnparseableManifest {
        /// The manifest.
        manifest: ManifestDigest,
        /// Why.
        reason: String,
    },
    /// A manifest whose chunk table has gaps, overlaps or bad lengths.
    InvalidChunkTable {
        /// The manifest.
        manifest: ManifestDigest,
        /// Why.
        reason: String,
    },
    /// A chunk named by a manifest but absent.
    MissingChunk {
        /// The manifest naming it.
        manifest: ManifestDigest,
        /// The chunk.
        chunk: ChunkDigest,
    },
    /// A chunk that does not decompress or hash to its name (deep only).
    CorruptChunk {
        /// The chunk.
        chunk: ChunkDigest,
        /// Why.
        reason: String,
    },
    /// A blob named by a manifest but absent.
    MissingBlob {
        /// The manifest naming it.
        manifest: ManifestDigest,
        /// The blob.
        blob: BlobDigest,
    },
    /// A blob whose bytes do not hash to its name (deep only).
    CorruptBlob {
        /// The blob.
        blob: BlobDigest,
        /// Why.
        reason: String,
    },
    /// An OCI reference that does not hold a digest.
    OciRefCorrupt {
        /// The reference key.
        key: String,
        /// Why.
        reason: String,
    },
    /// A blob an OCI reference reaches (its manifest or index, or a config or layer of an
    /// image manifest) that is absent.
    OciRefMissingBlob {
        /// `registry/repository:tag`.
        reference: String,
        /// The absent blob.
        blob: BlobDigest,
    },
    /// A file of the backend's own layout that is damaged (the local backend's pack index
    /// that is torn, altered, or names bytes past its pack's end): the objects it would
    /// hold are not served, so any a manifest names are also reported missing.
    CorruptStoreFile {
        /// The file.
        file: String,
        /// Why.
        reason: String,
    },
    /// A backend error while checking an object.
    Unreachable {
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
}

/// An unreachable object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Orphan {
    /// Its key.
    pub key: String,
    /// Stored size in bytes.
    pub size: u64,
    /// True when GC would delete it now (older than the grace period).
    pub collectable: bool,
}

/// The outcome of [`Store::verify`].
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyReport {
    /// Problems, in discovery order.
    pub findings: Vec<Finding>,
    /// Unreachable objects.
    pub orphans: Vec<Orphan>,
    /// Manifests checked.
    pub manifests: usize,
    /// Distinct chunks checked.
    pub chunks: usize,
    /// Distinct blobs checked.
    pub blobs: usize,
    /// Fossils: objects a GC run condemned and has not judged yet (see [`crate::gc`]); each
    /// counts as presence of its object, and none is a finding.
    pub fossils: usize,
    /// Bytes of pack files that serve no chunk ([`crate::backend::LayoutReport::dead_bytes`]:
    /// deleted chunks, chunks an upload wrote that another writer had published first, and
    /// on S3 copies of chunks another pack serves, such as a prefetch list's older copies,
    /// [`crate::Store::pack_together`]): what a compaction would reclaim.
    pub pack_dead_bytes: u64,
}

impl VerifyReport {
    /// True when nothing is wrong (orphans are not problems).
    pub fn is_ok(&self) -> bool {
        self.findings.is_empty()
    }
}

impl Store {
    /// Verifies the store (see the module doc). `gc` supplies the grace period used to mark
    /// orphans collectable and the cache TTL. Errors only when listing the store fails.
    pub async fn verify(&self, deep: bool, gc: &GcOptions) -> Result<VerifyReport, StoreError> {
        let mut report = VerifyReport::default();
        // The backend's own files (pack indexes) first: a refused one hides its chunks.
        let layout = self.backend.layout_report().await?;
        report.pack_dead_bytes = layout.dead_bytes;
        for (file, reason) in layout.problems {
            report
                .findings
                .push(Finding::CorruptStoreFile { file, reason });
        }
        // Tags, including corrupt ones (list_tags skips those).
        let mut roots: Vec<(ManifestDigest, Option<String>)> = Vec::new();
        for o in self.backend.list("tags/").await? {
            if crate::tag::is_side_key(&o.key) {
                continue;
            }
            if !o.key.trim_start_matches("tags/").contains('/') {
                continue;
            }
            let Some(t) = crate::TagRef::from_key(&o.key) else {
                report.findings.push(Finding::TagCorrupt {
                    key: o.key.clone(),
                    reason: "invalid tag name".into(),
                });
                continue;
            };
            match self.get_tag(&t).await {
                Ok(Some(r)) => roots.push((r.manifest, Some(t.to_string()))),
                Ok(None) => {}
                Err(e) => report.findings.push(Finding::TagCorrupt {
                    key: o.key.clone(),
                    reason: e.to_string(),
                }),
            }
        }
        // Other roots: as GC sees them (manifests only; their blobs/chunks follow).
        let Marked { live, objects, .. } = self.mark_live(gc, false, false).await?;
        // An object GC condemned and has not judged yet is still there for readers (see
        // [`crate::gc`]): its fossil counts as presence. Fossils are no findings or orphans.
        let fossils = self.backend.list(crate::gc::FOSSIL_PREFIX).await?;
        report.fossils = fossils.len();
        let mut present: HashMap<&str, u64> = fossils
            .iter()
            .filter_map(|o| Some((crate::gc::unfossil(&o.key)?, o.size)))
            .collect();
        present.extend(objects.iter().map(|o| (o.key.as_str(), o.size)));
        for r in &live {
            if let ObjectRef::Manifest(d) = r {
                roots.push((*d, None));
            }
        }
        // Walk manifests.
        let mut seen: HashSet<ManifestDigest> = HashSet::new();
        let mut queue: VecDeque<(ManifestDigest, Option<String>, Option<ManifestDigest>)> =
            roots.into_iter().map(|(d, t)| (d, t, None)).collect();
        let mut chunks: HashMap<ChunkDigest, (ManifestDigest, u64)> = HashMap::new();
        let mut blobs: HashMap<BlobDigest, ManifestDigest> = HashMap::new();
        while let Some((d, tag, parent)) = queue.pop_front() {
            if !present.contains_key(d.key().as_str()) {
                match (tag, parent) {
                    (Some(tag), _) => report
                        .findings
                        .push(Finding::TagMissingManifest { tag, manifest: d }),
                    (None, Some(parent)) => report.findings.push(Finding::MissingManifest {
                        parent,
                        manifest: d,
                    }),
                    (None, None) => {}
                }
                continue;
            }
            if !seen.insert(d) {
                continue;
            }
            report.manifests += 1;
            let m = match self.get_manifest(&d).await {
                Ok(m) => m,
                Err(StoreError::Manifest(ManifestError::Table { source, .. })) => {
                    report.findings.push(Finding::InvalidChunkTable {
                        manifest: d,
                        reason: source.to_string(),
                    });
                    continue;
                }
                Err(e) => {
                    report.findings.push(Finding::UnparseableManifest {
                        manifest: d,
                        reason: e.to_string(),
                    });
                    continue;
                }
            };
            let max_len = max_raw_lens(&m);
            for r in references(&m) {
                match r {
                    ObjectRef::Manifest(c) => queue.push_back((c, None, Some(d))),
                    ObjectRef::Blob(b) => {
                        blobs.entry(b).or_insert(d);
                    }
                    ObjectRef::Chunk(c) => {
                        let len = max_len.get(&c).copied().unwrap_or(0);
                        chunks.entry(c).or_insert((d, len));
                    }
                }
            }
        }
        report.chunks = chunks.len();
        report.blobs = blobs.len();
        let mut checked_oci: HashSet<BlobDigest> = HashSet::new();
        let mut to_check = Vec::new();
        for (c, (m, len)) in &chunks {
            if !present.contains_key(c.key().as_str()) {
                report.findings.push(Finding::MissingChunk {
                    manifest: *m,
                    chunk: *c,
                });
            } else if deep {
                to_check.push((*c, *len));
            }
        }
        for (b, m) in &blobs {
            if !present.contains_key(b.key().as_str()) {
                report.findings.push(Finding::MissingBlob {
                    manifest: *m,
                    blob: *b,
                });
            } else if deep && let Err(e) = self.check_blob(b).await {
                report.findings.push(Finding::CorruptBlob {
                    blob: *b,
                    reason: e.to_string(),
                });
            }
        }
        // OCI references: what each reaches must be present (and hash right, deep).
        for (r, d) in self.list_oci_refs().await? {
            let d = match d {
                Ok(d) => d,
                Err(reason) => {
                    report.findings.push(Finding::OciRefCorrupt {
                        key: r.key(),
                        reason,
                    });
                    continue;
                }
            };
            let c = self.oci_closure(d, false).await?;
            let missing: HashSet<BlobDigest> = c.missing.iter().map(|(b, _)| *b).collect();
            if !c.top_present {
                report.findings.push(Finding::OciRefMissingBlob {
                    reference: r.to_string(),
                    blob: d,
                });
                continue;
            }
            for b in &c.missing {
                report.findings.push(Finding::OciRefMissingBlob {
                    reference: r.to_string(),
                    blob: b.0,
                });
            }
            for b in c.blobs {
                if missing.contains(&b) || blobs.contains_key(&b) || !checked_oci.insert(b) {
                    continue;
                }
                report.blobs += 1;
                if deep && let Err(e) = self.check_blob(&b).await {
                    report.findings.push(Finding::CorruptBlob {
                        blob: b,
                        reason: e.to_string(),
                    });
                }
            }
        }
        if deep {
            let results: Vec<_> = futures::stream::iter(to_check)
                .map(|(c, len)| async move {
                    // Bypass the read cache: verify what the store holds.
                    // (bounded: a planted huge object is a finding, not an OOM).
                    let r = match self.get_chunk_stored(&c).await {
                        Ok(stored) => {
                            let url = self.url().to_string();
                            tokio::task::spawn_blocking(move || {
                                crate::chunk::decode(&c, &stored, len, &url).map(|_| ())
                            })
                            .await
                            .map_err(|e| e.to_string())
                            .and_then(|r| r.map_err(|e| e.to_string()))
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    (c, r)
                })
                .buffer_unordered(self.parallelism)
                .collect()
                .await;
            for (c, r) in results {
                if let Err(reason) = r {
                    report
                        .findings
                        .push(Finding::CorruptChunk { chunk: c, reason });
                }
            }
        }
        // Orphans.
        let cutoff = SystemTime::now()
            .checked_sub(gc.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        for o in &objects {
            if let Some(r) = ObjectRef::from_key(&o.key)
                && !live.contains(&r)
            {
                report.orphans.push(Orphan {
                    key: o.key.clone(),
                    size: o.size,
                    collectable: o.modified <= cutoff,
                });
            }
        }
        Ok(report)
    }

    /// Streams a blob in ranges and checks its digest, without keeping it.
    pub async fn check_blob(&self, digest: &BlobDigest) -> Result<u64, StoreError> {
        let key = digest.key();
        let size = self
            .read_head(&key)
            .await?
            .ok_or_else(|| crate::BackendError::NotFound {
                store: self.url().to_string(),
                key: key.clone(),
            })?
            .size;
        let mut h = crate::digest::Hasher::new();
        let mut pos = 0;
        while pos < size {
            let end = (pos + crate::blob::BLOB_READ_RANGE).min(size);
            let part = self.read_range(&key, pos..end).await?;
            if part.is_empty() {
                break;
            }
            h.update(&part);
            pos += part.len() as u64;
        }
        let actual = BlobDigest(h.finish());
        if actual != *digest {
            return Err(crate::BlobError::DigestMismatch {
                digest: *digest,
                store: self.url().to_string(),
                actual,
                len: pos,
            }
            .into());
        }
        Ok(pos)
    }
}

/// Largest raw length each chunk is used with in a manifest's tables.
pub(crate) fn max_raw_lens(m: &Manifest) -> HashMap<ChunkDigest, u64> {
    let tables = match m {
        Manifest::Image(i) => vec![&i.disk],
        Manifest::Snapshot(s) => vec![&s.memory, &s.disk],
    };
    let mut out: HashMap<ChunkDigest, u64> = HashMap::new();
    for t in tables {
        for e in &t.entries {
            if let Some(d) = e.digest {
                let v = out.entry(d).or_insert(0);
                *v = (*v).max(e.raw_len);
            }
        }
    }
    out
}
