//! The S3 backend's packs: the batch being written and the per-process view of every
//! committed pack. The layout, the write order and why GC stays safe are in [`super::s3`]
//! ("Packs"); the index format is [`super::pack`]'s, shared with the local backend.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use super::ObjectInfo;
pub(crate) use super::pack::{IdxEntry, Loc};
use crate::digest::Sha256Hash;

/// The prefix of every pack object.
pub(crate) const PACK_PREFIX: &str = "packs/";

/// A pack is closed (uploaded, then its index) once it holds this many bytes (32 MiB): 500
/// or more 64 KiB chunks (about 1,000 compressed), so an image of 3 GiB is about 100 PUTs
/// instead of 50,000, while one pack's upload (one PUT; S3 takes up to 5 GiB in one) stays
/// short enough to retry whole, and the memory a batch holds stays bounded: the pack being
/// filled plus the closed ones in flight, at most one per stager.
pub const PACK_TARGET: u64 = 32 << 20;

/// A pack object without an index older than this (24 h) is a crash's leftover, removed by
/// [`super::Backend::compact`]. A writer never puts an index more than
/// [`INDEX_DEADLINE`] after its pack, so no upload still in progress can lose its pack.
pub const ORPHAN_AGE: Duration = Duration::from_secs(24 * 3600);

/// Longest time between a pack's PUT and its index's PUT: past it the writer gives up
/// (its upload fails) rather than publish an index whose pack a compaction may have
/// taken for a crash's leftover ([`ORPHAN_AGE`], twice as long).
pub const INDEX_DEADLINE: Duration = Duration::from_secs(12 * 3600);

/// How stale the view may be for a writer's look-up (a stale miss only costs a duplicate
/// write; a hit is always checked afresh).
pub const WRITE_RELIST: Duration = Duration::from_secs(1);

/// `packs/<name>.pack`.
pub(crate) fn pack_key(name: &str) -> String {
    format!("{PACK_PREFIX}{name}.pack")
}

/// `packs/<name>.idx`.
pub(crate) fn idx_key(name: &str) -> String {
    format!("{PACK_PREFIX}{name}.idx")
}

/// `packs/<name>.dead/`: the prefix of a pack's dead markers.
pub(crate) fn dead_prefix(name: &str) -> String {
    format!("{PACK_PREFIX}{name}.dead/")
}

/// `packs/<name>.dead/<hex>`: the empty object that says chunk `d` of pack `name` is deleted.
pub(crate) fn dead_key(name: &str, d: &Sha256Hash) -> String {
    format!("{}{}", dead_prefix(name), d.hex())
}

/// `packs/<name>.`: the prefix of every object of one pack (dead markers, index, pack, in
/// that key order).
pub(crate) fn pack_prefix(name: &str) -> String {
    format!("{PACK_PREFIX}{name}.")
}

static PACK_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new pack name, unique per writer: `<host>-<pid>-<n>-<nanos>` (host reduced to the key
/// alphabet).
pub(crate) fn fresh_name() -> String {
    let host: String = crate::hostname()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(64)
        .collect();
    let n = PACK_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{host}-{}-{n}-{nanos}", std::process::id())
}

/// What one object under `packs/` is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PackObject<'a> {
    Pack(&'a str),
    Index(&'a str),
    Dead(&'a str, Sha256Hash),
}

/// Parses a key under `packs/` (`None`: not one of ours).
pub(crate) fn parse_key(key: &str) -> Option<PackObject<'_>> {
    let rest = key.strip_prefix(PACK_PREFIX)?;
    if let Some((name, hex)) = rest.split_once(".dead/") {
        return Some(PackObject::Dead(name, Sha256Hash::from_hex(hex).ok()?));
    }
    if rest.contains('/') {
        return None;
    }
    if let Some(name) = rest.strip_suffix(".idx") {
        return Some(PackObject::Index(name));
    }
    rest.strip_suffix(".pack").map(PackObject::Pack)
}

/// One committed pack, as last seen.
#[derive(Debug)]
pub(crate) struct PackMeta {
    pub(crate) name: Arc<str>,
    /// Sorted by digest.
    pub(crate) entries: Vec<IdxEntry>,
    pub(crate) dead: HashSet<Sha256Hash>,
    pub(crate) modified: SystemTime,
    pub(crate) pack_len: u64,
}

impl PackMeta {
    pub(crate) fn holds(&self, d: &Sha256Hash) -> Option<&IdxEntry> {
        self.entries
            .binary_search_by_key(d, |e| e.digest)
            .ok()
            .map(|i| &self.entries[i])
    }

    fn loc(&self, e: &IdxEntry) -> Loc {
        Loc::of(&self.name, e, self.modified)
    }

    /// Which of two packs holding a live chunk serves it: the smaller, then the lower name
    /// (a rule of the packs alone, as locally).
    fn rank(&self) -> (u64, &str) {
        (self.pack_len, &self.name)
    }
}

/// What one LIST of `packs/` showed.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// Index name → last-modified.
    pub(crate) indexes: BTreeMap<String, SystemTime>,
    /// Pack name → (size, last-modified).
    pub(crate) packs: BTreeMap<String, (u64, SystemTime)>,
    /// Pack name → dead markers.
    pub(crate) dead: HashMap<String, HashSet<Sha256Hash>>,
}

impl Listing {
    pub(crate) fn of(objects: &[ObjectInfo]) -> Self {
        let mut l = Listing::default();
        for o in objects {
            match parse_key(&o.key) {
                Some(PackObject::Index(n)) => {
                    l.indexes.insert(n.to_string(), o.modified);
                }
                Some(PackObject::Pack(n)) => {
                    l.packs.insert(n.to_string(), (o.size, o.modified));
                }
                Some(PackObject::Dead(n, d)) => {
                    l.dead.entry(n.to_string()).or_default().insert(d);
                }
                None => {}
            }
        }
        l
    }
}

/// The process's view of the committed packs.
#[derive(Debug, Default)]
pub(crate) struct View {
    pub(crate) packs: HashMap<Arc<str>, PackMeta>,
    /// Where each live chunk is served from (one pack, by [`PackMeta::rank`]).
    pub(crate) map: HashMap<Sha256Hash, Loc>,
    /// Refused index keys → why: their chunks are not served.
    pub(crate) problems: BTreeMap<String, String>,
    /// Packs without an index: name → (size, last-modified).
    pub(crate) orphans: BTreeMap<String, (u64, SystemTime)>,
    /// Dead marker sets of names with neither index nor pack (a retirement cut short).
    pub(crate) stray_dead: Vec<String>,
    /// When the listing this view comes from started.
    pub(crate) listed_at: Option<Instant>,
}

impl View {
    /// Rebuilds the serving map from the packs.
    pub(crate) fn rebuild(&mut self) {
        let mut map: HashMap<Sha256Hash, Loc> = HashMap::new();
        for p in self.packs.values() {
            for e in &p.entries {
                if p.dead.contains(&e.digest) {
                    continue;
                }
                match map.get(&e.digest) {
                    Some(cur) if self.packs[&cur.pack].rank() <= p.rank() => {}
                    _ => {
                        map.insert(e.digest, p.loc(e));
                    }
                }
            }
        }
        self.map = map;
    }

    /// Notes the dead markers of pack `name` as just listed (`None`: the pack is gone).
    pub(crate) fn set_dead(&mut self, name: &str, dead: Option<HashSet<Sha256Hash>>) {
        match dead {
            Some(dead) => {
                let Some(p) = self.packs.get_mut(name) else {
                    return;
                };
                if p.dead == dead {
                    return;
                }
                p.dead = dead;
            }
            None => {
                if self.packs.remove(name).is_none() {
                    return;
                }
            }
        }
        self.rebuild();
    }

    /// Every pack holding `d` live (all of them take a dead marker at a delete).
    pub(crate) fn holders(&self, d: &Sha256Hash) -> Vec<Arc<str>> {
        self.packs
            .values()
            .filter(|p| !p.dead.contains(d) && p.holds(d).is_some())
            .map(|p| p.name.clone())
            .collect()
    }

    /// Bytes of pack `p` that serve a chunk.
    pub(crate) fn serving_bytes(&self, p: &PackMeta, also_dead: &HashSet<Sha256Hash>) -> u64 {
        p.entries
            .iter()
            .filter(|e| {
                !also_dead.contains(&e.digest)
                    && self.map.get(&e.digest).is_some_and(|l| l.pack == p.name)
            })
            .map(|e| e.len)
            .sum()
    }
}

/// A closed pack of a batch, on its way up.
#[derive(Debug)]
pub(crate) struct Sealed {
    pub(crate) name: String,
    pub(crate) bytes: Bytes,
    pub(crate) entries: Vec<IdxEntry>,
    /// When its pack's PUT returned (`None`: not yet).
    pub(crate) pack_put: Option<Instant>,
}

#[derive(Debug, Default)]
struct Filling {
    name: String,
    buf: Vec<u8>,
    entries: Vec<IdxEntry>,
}

#[derive(Debug, Default)]
struct BatchState {
    filling: Filling,
    /// Closed packs not yet published (pack or index PUT still to do).
    unsent: Vec<Sealed>,
    /// Packs whose PUT returned but whose index PUT has not (a discard removes those whose
    /// index PUT was never begun, [`BatchState::index_begun`]).
    pack_only: HashSet<String>,
    /// Packs whose index PUT was begun: the index may be in the store whatever that PUT's
    /// caller saw (an error after the server stored it: a lost answer, a timeout, a reset
    /// connection, a future dropped with its request sent), so another writer may already
    /// rely on its chunks. A discard never deletes such a pack (see [`S3Batch::discard`]).
    index_begun: HashSet<String>,
    /// Every chunk this batch holds (a retried stage finds its chunk here).
    digests: HashSet<Sha256Hash>,
    /// Chunks left out at the last pack's closing: published by another writer first.
    raced: HashSet<Sha256Hash>,
    /// Packs published (index PUT returned), in that order.
    published: Vec<String>,
}

/// One upload's packs on S3 ([`super::StageBatch`]).
#[derive(Debug)]
pub(crate) struct S3Batch {
    state: Mutex<BatchState>,
    /// Bytes at which a pack closes.
    target: u64,
}

impl S3Batch {
    pub(crate) fn new(target: u64) -> Self {
        Self {
            state: Mutex::default(),
            target,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BatchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the batch holds `d` already.
    pub(crate) fn holds(&self, d: &Sha256Hash) -> bool {
        self.lock().digests.contains(d)
    }

    /// Appends chunk `d`'s stored bytes (unless the batch holds it). Returns the offset in
    /// its pack (`None`: held already) and whether the pack just closed (then the caller
    /// sends the unsent packs).
    pub(crate) fn append(&self, d: Sha256Hash, data: &[u8]) -> (Option<u64>, bool) {
        let mut s = self.lock();
        if !s.digests.insert(d) {
            return (None, false);
        }
        if s.filling.name.is_empty() {
            s.filling.name = fresh_name();
        }
        let offset = s.filling.buf.len() as u64;
        s.filling.buf.extend_from_slice(data);
        s.filling.entries.push(IdxEntry {
            digest: d,
            offset,
            len: data.len() as u64,
        });
        let closed = s.filling.buf.len() as u64 >= self.target;
        if closed {
            Self::seal_locked(&mut s);
        }
        (Some(offset), closed)
    }

    fn seal_locked(s: &mut BatchState) {
        if s.filling.entries.is_empty() {
            return;
        }
        let f = std::mem::take(&mut s.filling);
        s.unsent.push(Sealed {
            name: f.name,
            bytes: Bytes::from(f.buf),
            entries: f.entries,
            pack_put: None,
        });
    }

    /// The chunks of the pack being filled (not sent yet).
    pub(crate) fn filling_digests(&self) -> Vec<Sha256Hash> {
        self.lock()
            .filling
            .entries
            .iter()
            .map(|e| e.digest)
            .collect()
    }

    /// Closes the pack being filled, without the chunks of `present` (found published by
    /// another writer since they were staged: their commit outcome is
    /// [`super::PutOutcome::AlreadyExists`], as locally).
    pub(crate) fn seal_without(&self, present: &HashSet<Sha256Hash>) {
        let mut s = self.lock();
        if !present.is_empty() {
            let f = std::mem::take(&mut s.filling);
            let mut kept = Filling {
                name: f.name,
                ..Filling::default()
            };
            for e in f.entries {
                if present.contains(&e.digest) {
                    s.raced.insert(e.digest);
                    continue;
                }
                let at = e.offset as usize..(e.offset + e.len) as usize;
                kept.entries.push(IdxEntry {
                    digest: e.digest,
                    offset: kept.buf.len() as u64,
                    len: e.len,
                });
                kept.buf.extend_from_slice(&f.buf[at]);
            }
            s.filling = kept;
        }
        Self::seal_locked(&mut s);
    }

    /// Whether chunk `d` was left out of this batch's packs (another writer's copy serves).
    pub(crate) fn raced(&self, d: &Sha256Hash) -> bool {
        self.lock().raced.contains(d)
    }

    /// One closed pack to send (taken: no other sender sends it meanwhile).
    pub(crate) fn take_unsent(&self) -> Option<Sealed> {
        self.lock().unsent.pop()
    }

    /// Gives back a pack whose sending failed (a retry sends it again).
    pub(crate) fn give_back(&self, s: Sealed) {
        let mut g = self.lock();
        if s.pack_put.is_some() {
            g.pack_only.insert(s.name.clone());
        }
        g.unsent.push(s);
    }

    /// Notes that pack `name`'s index PUT is about to be sent: from then on the index may be
    /// in the store, whatever the PUT returns, and a discard leaves the pack.
    pub(crate) fn index_begun(&self, name: &str) {
        self.lock().index_begun.insert(name.to_string());
    }

    /// Notes pack `name` published (its index PUT returned).
    pub(crate) fn published(&self, name: &str) {
        let mut s = self.lock();
        s.pack_only.remove(name);
        s.published.push(name.to_string());
    }

    /// The packs published, in the order their indexes' PUTs returned.
    pub(crate) fn published_names(&self) -> Vec<String> {
        self.lock().published.clone()
    }

    /// Whether anything is left to send.
    pub(crate) fn all_sent(&self) -> bool {
        let s = self.lock();
        s.unsent.is_empty() && s.filling.entries.is_empty()
    }

    /// Forgets everything. Returns, sorted, the packs the discard deletes (their PUT
    /// returned and their index PUT was never begun: no index can ever name them, so no
    /// reader or writer can see them) and the packs it must leave (their index PUT was begun
    /// and did not return success, so the index may be in the store: a published pack that
    /// another writer may already rely on, garbage for GC to collect once nothing references
    /// it; or, if the index never arrived, a pack without an index, which a compaction
    /// removes after [`ORPHAN_AGE`]). A pack whose index PUT returned is published and
    /// in neither list.
    pub(crate) fn discard(&self) -> Discarded {
        let mut s = self.lock();
        let mut sent: Vec<String> = s.pack_only.drain().collect();
        sent.extend(
            s.unsent
                .drain(..)
                .filter(|u| u.pack_put.is_some())
                .map(|u| u.name),
        );
        s.filling = Filling::default();
        sent.sort();
        sent.dedup();
        let (left, delete) = sent.into_iter().partition(|n| s.index_begun.contains(n));
        Discarded { delete, left }
    }
}

/// What [`S3Batch::discard`] found of a batch's packs sent but not published.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Discarded {
    /// Packs no index names or ever will: the discard deletes them.
    pub(crate) delete: Vec<String>,
    /// Packs whose index may be in the store (its PUT's outcome unknown): left as they are.
    pub(crate) left: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_keys_parse_and_are_valid() {
        let n = fresh_name();
        let d = Sha256Hash::of(b"x");
        for k in [pack_key(&n), idx_key(&n), dead_key(&n, &d)] {
            super::super::validate_key(&k).unwrap();
        }
        assert_eq!(parse_key(&pack_key(&n)), Some(PackObject::Pack(&n)));
        assert_eq!(parse_key(&idx_key(&n)), Some(PackObject::Index(&n)));
        assert_eq!(parse_key(&dead_key(&n, &d)), Some(PackObject::Dead(&n, d)));
        assert_eq!(parse_key("packs/x.dead/zz"), None);
        assert_eq!(parse_key("chunks/sha256/ab"), None);
        // Key order within one pack: markers, index, pack (the fresh check relies on it).
        assert!(dead_key(&n, &d) < idx_key(&n) && idx_key(&n) < pack_key(&n));
    }

    #[test]
    fn a_batch_closes_its_pack_at_the_target_and_a_retry_appends_nothing() {
        let b = S3Batch::new(PACK_TARGET);
        let big = vec![7u8; (PACK_TARGET / 2) as usize];
        let (d1, d2) = (Sha256Hash::of(b"1"), Sha256Hash::of(b"2"));
        assert_eq!(b.append(d1, &big), (Some(0), false));
        assert_eq!(b.append(d1, &big), (None, false));
        assert_eq!(b.append(d2, &big), (Some(PACK_TARGET / 2), true));
        let s = b.take_unsent().unwrap();
        assert_eq!(s.entries.len(), 2);
        assert!(b.all_sent());
    }

    #[test]
    fn a_discard_deletes_only_packs_whose_index_put_was_never_begun() {
        // Packs close at one byte: three chunks, three packs, each one's PUT returned.
        let b = S3Batch::new(1);
        for x in [b"1", b"2", b"3"] {
            assert!(b.append(Sha256Hash::of(x), x).1);
        }
        let mut sealed: Vec<Sealed> = std::iter::from_fn(|| b.take_unsent()).collect();
        for s in &mut sealed {
            s.pack_put = Some(Instant::now());
        }
        let names: Vec<String> = sealed.iter().map(|s| s.name.clone()).collect();
        // The first's index PUT failed (its outcome unknown), the second's was never sent,
        // the third's returned.
        b.index_begun(&names[0]);
        b.index_begun(&names[2]);
        b.published(&names[2]);
        let mut sealed = sealed.into_iter();
        b.give_back(sealed.next().unwrap());
        b.give_back(sealed.next().unwrap());
        assert_eq!(
            b.discard(),
            Discarded {
                delete: vec![names[1].clone()],
                left: vec![names[0].clone()],
            }
        );
    }
}
