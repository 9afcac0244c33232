//! The S3 backend's pack methods (issue 33; the layout, write order and argument are in
//! [`super`]'s module doc, "Packs"): the view of the committed packs and its refresh, the
//! fresh liveness check, reads of packed chunks (one and many), deletes and renames of packed
//! chunks, and sending a batch's packs.

use super::*;

/// Sends a batch's closed pack back to the batch if its sending stops short (an error, or the
/// future dropped: a cancelled or timed-out stage), so a retry or the commit sends it.
pub(super) struct GiveBack<'a> {
    pub(super) batch: &'a S3Batch,
    pub(super) pack: Option<Sealed>,
}

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.pack.take() {
            self.batch.give_back(p);
        }
    }
}

/// The packs ([`crate::backend::s3_pack`]): look-ups, the fresh liveness check, sending a batch's packs.
impl S3Backend {
    pub(super) fn view(&self) -> std::sync::RwLockReadGuard<'_, View> {
        self.packs.view.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn view_mut(&self) -> std::sync::RwLockWriteGuard<'_, View> {
        self.packs.view.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Every object whose key starts with `prefix` (a plain string prefix, not a directory),
    /// in key order, through as many ListObjectsV2 pages as it takes.
    pub(super) async fn list_prefix_raw(
        &self,
        prefix: &str,
    ) -> Result<Vec<ObjectInfo>, BackendError> {
        let full = if self.prefix.is_empty() {
            prefix.to_string()
        } else {
            format!("{}/{prefix}", self.prefix)
        };
        let mut out = Vec::new();
        let mut token = None;
        loop {
            let opts = PaginatedListOptions {
                max_keys: Some(LIST_PAGE_MAX),
                page_token: token.take(),
                ..PaginatedListOptions::default()
            };
            let r = self
                .lister
                .list_paginated(Some(&full), opts)
                .await
                .map_err(|e| self.err("list", prefix, e))?;
            out.extend(
                r.result
                    .objects
                    .into_iter()
                    .filter_map(|m| self.info(m))
                    .filter(|o| o.key.starts_with(prefix)),
            );
            match r.page_token {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Lists `packs/` and loads the indexes not seen yet (each once: they are immutable),
    /// unless a listing that began at or after `since` is in the view already (one listing
    /// at a time; callers waiting for it share it).
    pub(super) async fn refresh(&self, since: Instant) -> Result<(), BackendError> {
        let _one = self.packs.relist.lock().await;
        if self.view().listed_at.is_some_and(|t| t >= since) {
            return Ok(());
        }
        let started = Instant::now();
        let listing = Listing::of(&self.list_prefix_raw(PACK_PREFIX).await?);
        let to_load: Vec<String> = {
            let v = self.view();
            listing
                .indexes
                .keys()
                .filter(|n| {
                    !v.packs.contains_key(n.as_str()) && !v.problems.contains_key(&idx_key(n))
                })
                .cloned()
                .collect()
        };
        let loaded: Vec<(String, Option<Decoded>)> = futures::stream::iter(to_load)
            .map(|n| async move {
                match self.get_raw(&idx_key(&n)).await {
                    Ok(b) => Ok((n, Some(decode_index(&b)))),
                    Err(e) if e.is_not_found() => Ok((n, None)),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(INDEX_LOADS_IN_FLIGHT)
            .try_collect()
            .await?;
        let mut v = self.view_mut();
        v.packs
            .retain(|n, _| listing.indexes.contains_key(&**n) && listing.packs.contains_key(&**n));
        v.problems.retain(|k, _| {
            matches!(parse_key(k), Some(PackObject::Index(n)) if listing.indexes.contains_key(n))
        });
        for (name, r) in loaded {
            let Some(r) = r else { continue };
            let checked = r.and_then(|entries| {
                let Some(&(pack_len, _)) = listing.packs.get(&name) else {
                    return Err(format!("its pack {} is missing", pack_key(&name)));
                };
                let end = entries.iter().map(|e| e.offset + e.len).max().unwrap_or(0);
                if end > pack_len {
                    return Err(format!(
                        "its pack {} is {pack_len} bytes, the index names bytes up to {end}",
                        pack_key(&name)
                    ));
                }
                Ok((entries, pack_len))
            });
            match checked {
                Ok((entries, pack_len)) => {
                    let name: Arc<str> = Arc::from(name.as_str());
                    let modified = listing.indexes[&*name];
                    v.packs.insert(
                        name.clone(),
                        PackMeta {
                            name,
                            entries,
                            dead: Default::default(),
                            modified,
                            pack_len,
                        },
                    );
                }
                Err(reason) => {
                    let key = idx_key(&name);
                    tracing::warn!(store = %self.url, %key, %reason, "pack index refused: its chunks are not served");
                    v.problems.insert(key, reason);
                }
            }
        }
        for p in v.packs.values_mut() {
            p.dead = listing.dead.get(&*p.name).cloned().unwrap_or_default();
        }
        v.orphans = listing
            .packs
            .iter()
            .filter(|(n, _)| !listing.indexes.contains_key(*n))
            .map(|(n, m)| (n.clone(), *m))
            .collect();
        v.stray_dead = listing
            .dead
            .keys()
            .filter(|n| !listing.indexes.contains_key(*n) && !listing.packs.contains_key(*n))
            .cloned()
            .collect();
        v.rebuild();
        v.listed_at = Some(started);
        Ok(())
    }

    /// Pack `name`'s dead markers as of now (`None`: its index is gone), from one listing of
    /// `packs/<name>.`, which returns the markers before the index (key order): an index
    /// seen after the markers means no retirement had removed markers before they were read
    /// (a retirement removes the index first). The view is updated with what it shows.
    pub(super) async fn pack_now(
        &self,
        name: &str,
    ) -> Result<Option<HashSet<Sha256Hash>>, BackendError> {
        let listing = Listing::of(&self.list_prefix_raw(&pack_prefix(name)).await?);
        let dead = listing
            .indexes
            .contains_key(name)
            .then(|| listing.dead.get(name).cloned().unwrap_or_default());
        self.view_mut().set_dead(name, dead.clone());
        Ok(dead)
    }

    /// Where chunk `d` is packed and live *now* (the view's location, checked with
    /// [`S3Backend::pack_now`]), after a listing of `packs/` that began at `since` or later
    /// when the view has no location for it. `None`: not packed (it may be a loose object).
    pub(super) async fn packed_live(
        &self,
        d: &Sha256Hash,
        since: Option<Instant>,
    ) -> Result<Option<Loc>, BackendError> {
        let mut listed = false;
        for _ in 0..3 {
            let hit = self.view().map.get(d).cloned();
            match hit {
                Some(loc) => match self.pack_now(&loc.pack).await? {
                    Some(dead) if !dead.contains(d) => return Ok(Some(loc)),
                    // Dead or gone there: the view now says so; another pack may serve it.
                    _ => {}
                },
                None => match since {
                    Some(s) if !listed => {
                        self.refresh(s).await?;
                        listed = true;
                    }
                    _ => return Ok(None),
                },
            }
        }
        Ok(None)
    }

    /// Bytes `range` (clipped to the entry) of packed chunk `d`, read from its pack with one
    /// ranged GET, its dead marker checked by a HEAD at the same time. `None`: not packed
    /// live as far as the view knows after a listing that began at `since` (when given).
    pub(super) async fn get_packed(
        &self,
        d: &Sha256Hash,
        range: Range<u64>,
        since: Option<Instant>,
    ) -> Result<Option<Bytes>, BackendError> {
        let mut listed = false;
        for _ in 0..3 {
            let hit = self.view().map.get(d).cloned();
            let Some(loc) = hit else {
                match since {
                    Some(s) if !listed => {
                        self.refresh(s).await?;
                        listed = true;
                        continue;
                    }
                    _ => return Ok(None),
                }
            };
            let end = range.end.min(loc.len);
            let start = range.start.min(end);
            let (pk, dk) = (pack_key(&loc.pack), dead_key(&loc.pack, d));
            let (bytes, marker) = futures::join!(
                self.get_range_raw(&pk, loc.offset + start..loc.offset + end),
                self.head_raw(&dk)
            );
            if marker?.is_some() {
                self.pack_now(&loc.pack).await?;
                continue;
            }
            match bytes {
                Ok(b) => return Ok(Some(b)),
                // The pack retired under us: look again.
                Err(e) if e.is_not_found() => {
                    self.refresh(Instant::now()).await?;
                    listed = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Which of `digests` the view has packed and are live now: one listing of each pack
    /// holding some ([`S3Backend::pack_now`]), made after the call began.
    pub(super) async fn live_now(&self, digests: &[Sha256Hash]) -> Result<Vec<bool>, BackendError> {
        let mut out = vec![false; digests.len()];
        let mut by_pack: HashMap<Arc<str>, Vec<usize>> = HashMap::new();
        {
            let v = self.view();
            for (i, d) in digests.iter().enumerate() {
                if let Some(loc) = v.map.get(d) {
                    by_pack.entry(loc.pack.clone()).or_default().push(i);
                }
            }
        }
        let checked: Vec<(Vec<usize>, Option<HashSet<Sha256Hash>>)> =
            futures::stream::iter(by_pack)
                .map(|(name, at)| async move { Ok((at, self.pack_now(&name).await?)) })
                .buffer_unordered(PACK_CHECKS_IN_FLIGHT)
                .try_collect()
                .await?;
        for (at, dead) in checked {
            let Some(dead) = dead else { continue };
            for i in at {
                out[i] = !dead.contains(&digests[i]);
            }
        }
        Ok(out)
    }

    /// Marks `d` dead in every pack that holds it live (one empty marker object each).
    pub(super) async fn delete_packed(&self, d: &Sha256Hash) -> Result<(), BackendError> {
        // Fresh: a pack another writer published a moment ago is seen (one listing of
        // `packs/`, shared by the deletes that wait for it).
        self.refresh(Instant::now()).await?;
        let holders = self.view().holders(d);
        for name in holders {
            self.put_raw(&dead_key(&name, d), Bytes::new()).await?;
            let mut v = self.view_mut();
            if let Some(p) = v.packs.get_mut(&name) {
                p.dead.insert(*d);
            }
            v.rebuild();
        }
        Ok(())
    }

    /// [`S3Backend::delete_packed`] of each of `ds`: one listing of `packs/` (made after the
    /// call began), then a dead marker in every pack that holds one of them live,
    /// [`MARKERS_IN_FLIGHT`] at once; except that a pack left serving nothing once `ds` are
    /// gone is retired whole instead ([`S3Backend::retire_pack`]: its index, its pack, its
    /// markers), which makes every entry of it absent at once.
    ///
    /// GC's condemn step, which deletes every chunk of an untagged snapshot, then writes a
    /// few requests a pack rather than one a chunk: measured on the local S3 server
    /// (`vm_lazy`'s last GC, 875 packed chunks in whole packs; the server's request log, to
    /// the second), 837 marker PUTs took 2.3 s of the run's 6.1 s; retiring the packs
    /// instead, the run took 3 to 4 s, most of it the 875 fossil PUTs. The view says which pack serves each live chunk
    /// ([`View::map`](super::super::s3_pack::View)), so a pack serving nothing holds only
    /// chunks of `ds`, dead ones, and copies another pack serves: retiring it loses no
    /// chunk that is not deleted, as compaction's retirement ([`Backend::compact`]) does
    /// later anyway.
    pub(super) async fn delete_packed_many(&self, ds: &[Sha256Hash]) -> Result<(), BackendError> {
        self.refresh(Instant::now()).await?;
        let gone: HashSet<Sha256Hash> = ds.iter().copied().collect();
        // (pack, its bytes) to retire; (pack, chunk) markers to write.
        type Marks = Vec<(Arc<str>, Sha256Hash)>;
        let (retire, marks): (Vec<(Arc<str>, u64)>, Marks) = {
            let v = self.view();
            let mut holders: Marks = ds
                .iter()
                .flat_map(|d| v.holders(d).into_iter().map(move |n| (n, *d)))
                .collect();
            let mut retire: Vec<(Arc<str>, u64)> = holders
                .iter()
                .map(|(n, _)| (n.clone(), v.packs[n].pack_len))
                .collect();
            retire.sort();
            retire.dedup();
            retire.retain(|(n, _)| v.serving_bytes(&v.packs[n], &gone) == 0);
            holders.retain(|(n, _)| !retire.iter().any(|(r, _)| r == n));
            (retire, holders)
        };
        let written: Vec<Result<(Arc<str>, Sha256Hash), BackendError>> =
            futures::stream::iter(marks)
                .map(|(name, d)| async move {
                    self.put_raw(&dead_key(&name, &d), Bytes::new()).await?;
                    Ok((name, d))
                })
                .buffer_unordered(MARKERS_IN_FLIGHT)
                .collect()
                .await;
        let mut first_err = None;
        {
            let mut v = self.view_mut();
            for w in written {
                match w {
                    Ok((name, d)) => {
                        if let Some(p) = v.packs.get_mut(&name) {
                            p.dead.insert(d);
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            v.rebuild();
        }
        for (name, len) in &retire {
            match self.retire_pack(name).await {
                Ok(()) => self.packs.retired_early.note(*len),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Retires pack `name`, which serves no chunk: its index first (the pack is invisible
    /// from then on), then the pack, then its markers (a look-up that still sees a marker
    /// also sees no index), and drops it from the view.
    pub(super) async fn retire_pack(&self, name: &str) -> Result<(), BackendError> {
        self.delete_raw(&idx_key(name)).await?;
        self.delete_raw(&pack_key(name)).await?;
        self.delete_markers(name).await?;
        self.view_mut().set_dead(name, None);
        Ok(())
    }

    /// Sends every closed pack of `batch` not sent yet: its pack (one PUT), then its index
    /// (put-if-absent), so an index is never seen before its whole pack.
    pub(super) async fn send_unsent(&self, batch: &S3Batch) -> Result<(), BackendError> {
        while let Some(p) = batch.take_unsent() {
            let mut g = GiveBack {
                batch,
                pack: Some(p),
            };
            let Some(p) = g.pack.as_mut() else { break };
            if p.pack_put.is_none() {
                self.put_raw(&pack_key(&p.name), p.bytes.clone()).await?;
                p.pack_put = Some(Instant::now());
            }
            if p.pack_put.is_some_and(|t| t.elapsed() > INDEX_DEADLINE) {
                return Err(BackendError::Other {
                    store: self.url.clone(),
                    op: "put",
                    key: idx_key(&p.name),
                    message: format!(
                        "its pack was sent more than {} s ago: a compaction may take it for a \
                         crash's leftover, so the index is not written",
                        INDEX_DEADLINE.as_secs()
                    ),
                });
            }
            let mut entries = p.entries.clone();
            let idx = Bytes::from(encode_index(&mut entries));
            // Before the request: once sent, the index may be stored even if this call
            // fails (an answer lost, a timeout, the future dropped), and a discard must then
            // leave the pack ([`S3Batch::discard`]).
            batch.index_begun(&p.name);
            self.put_if_absent_raw(&idx_key(&p.name), idx, None).await?;
            // Published: out of the guard, so that a failure below (the HEAD) neither hands
            // it back to be sent again nor leaves it to a discard.
            let Some(p) = g.pack.take() else { break };
            batch.published(&p.name);
            // This process's own pack joins its view at once (its time from the server).
            if let Some(info) = self.head_raw(&idx_key(&p.name)).await? {
                let name: Arc<str> = Arc::from(p.name.as_str());
                let mut entries = p.entries.clone();
                entries.sort_by_key(|e| e.digest);
                let mut v = self.view_mut();
                v.packs.insert(
                    name.clone(),
                    PackMeta {
                        name,
                        entries,
                        dead: HashSet::new(),
                        modified: info.modified,
                        pack_len: p.bytes.len() as u64,
                    },
                );
                v.rebuild();
            }
        }
        Ok(())
    }

    /// The batch's last pack closed and everything sent. The chunks of the last pack that
    /// another writer published since they were staged are left out of it (checked afresh,
    /// one listing of `packs/` and one of each pack holding some), as the local commit does;
    /// commits of one process take turns here, so two uploads in one process never publish
    /// one chunk twice. (Across processes two racing uploads may: harmless, one copy
    /// serves and the other is dead weight, [`LayoutReport::dead_bytes`].)
    pub(super) async fn flush_batch(&self, batch: &S3Batch) -> Result<(), BackendError> {
        static COMMITS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _turn = COMMITS.lock().await;
        let filling = batch.filling_digests();
        let mut present = HashSet::new();
        if !filling.is_empty() {
            self.refresh(Instant::now()).await?;
            let live = self.live_now(&filling).await?;
            present.extend(
                filling
                    .iter()
                    .zip(live)
                    .filter(|(_, l)| *l)
                    .map(|(d, _)| *d),
            );
        }
        batch.seal_without(&present);
        self.send_unsent(batch).await?;
        if !batch.all_sent() {
            return Err(BackendError::Other {
                store: self.url.clone(),
                op: "commit_staged",
                key: PACK_PREFIX.into(),
                message: "a pack of this upload is still being sent by a stage that has not \
                          returned"
                    .into(),
            });
        }
        Ok(())
    }
}

/// Where one pair of [`S3Backend::rename_many_impl`] stands after its destination's write.
enum Step {
    /// Written (from a pack's bytes when `packed`); its source still to go.
    Written {
        /// Read from a pack: its entries are to be marked dead.
        packed: bool,
    },
    /// Finished, by a failure or by a rename of its own.
    Done(Result<(), BackendError>),
}

/// An index read and decoded (`Err`: refused, why).
type Decoded = Result<Vec<IdxEntry>, String>;

/// One ranged GET of [`Backend::get_many`]: a pack, and the entries read from it (index in
/// the keys asked, location), in pack order.
type Span = (Arc<str>, Vec<(usize, Loc)>);

/// Entries of one pack at most this many bytes apart (256 KiB) are read by one ranged GET
/// in [`Backend::get_many`]: reading a gap costs less than a request (moto serves about 400
/// requests a second; 256 KiB at 100 MB/s is 2.5 ms).
pub const GET_MANY_GAP: u64 = 256 << 10;
/// Longest span one ranged GET of [`Backend::get_many`] reads (8 MiB, boto3's part size):
/// long enough for about 250 compressed 64 KiB chunks, short enough that a few in flight
/// keep memory small and a retried read repeats little.
pub const GET_MANY_SPAN: u64 = 8 << 20;

/// Index GETs in flight at once while the view loads new packs.
const INDEX_LOADS_IN_FLIGHT: usize = 8;
/// Packs whose dead markers are listed at once ([`Backend::packed_present`]).
const PACK_CHECKS_IN_FLIGHT: usize = 8;
/// Writes [`Backend::rename_many`] and [`Backend::delete_many`] have in flight at once on
/// S3 (destinations, dead markers): 32.
const MARKERS_IN_FLIGHT: usize = 32;

/// What [`Backend::head`] says of a packed chunk: its stored length, and its index's time.
pub(super) fn packed_info(key: &str, loc: &Loc) -> ObjectInfo {
    ObjectInfo {
        key: key.to_string(),
        size: loc.len,
        modified: loc.modified,
        version: None,
    }
}

impl S3Backend {
    /// [`Backend::get`] (`range` `None`) or [`Backend::get_range`] of any key: a chunk from
    /// its pack when the view has it live; else the loose object; a loose miss looks for
    /// packs written since (one listing of `packs/`) before it is `NotFound`. A store
    /// written before packs is read as it was, with no request more.
    pub(super) async fn get_range_or_all(
        &self,
        key: &str,
        range: Option<Range<u64>>,
    ) -> Result<Bytes, BackendError> {
        let raw = |range: Option<Range<u64>>| async move {
            match range {
                Some(r) => self.get_range_raw(key, r).await,
                None => self.get_raw(key).await,
            }
        };
        let Some(d) = chunk_digest(key) else {
            return raw(range).await;
        };
        let r = range.clone().unwrap_or(0..u64::MAX);
        if let Some(b) = self.get_packed(&d, r.clone(), None).await? {
            return Ok(b);
        }
        match raw(range).await {
            Err(e) if e.is_not_found() => {
                match self.get_packed(&d, r, Some(Instant::now())).await? {
                    Some(b) => Ok(b),
                    None => Err(e),
                }
            }
            other => other,
        }
    }

    /// [`Backend::rename`] of packed chunk `d` (its stored bytes `bytes`): the bytes written
    /// at `to`, then the entry marked dead (and a loose copy, two writers', deleted), so an
    /// interruption leaves both keys, never neither.
    pub(super) async fn rename_packed(
        &self,
        from: &str,
        to: &str,
        d: &Sha256Hash,
        bytes: Bytes,
    ) -> Result<(), BackendError> {
        self.put_raw(to, bytes).await?;
        self.delete_packed(d).await?;
        self.delete_raw(from).await
    }

    /// [`Backend::get_many`]'s packed part: the live entries among `keys` that the view
    /// places, grouped by pack; per pack one listing of its dead markers (fresh, as every
    /// read: made after `since`, when the call began), then its live entries in pack order
    /// read in spans: entries at most [`GET_MANY_GAP`] apart share a ranged GET, up to
    /// [`GET_MANY_SPAN`] bytes. Returns (index in `keys`, stored bytes) for those read; the
    /// caller reads the rest one by one.
    ///
    /// No pack is listed again when the view itself comes from a listing of `packs/` begun
    /// after `since` (its dead markers are that fresh): a clone's prefetch, whose batches
    /// start on an empty view and share one listing, then makes no other. Measured on the
    /// local S3 server, where a listing scans the bucket (12 to 17 ms with 5,600 keys): a
    /// cold Debian start made 11 listings, one of them of `packs/`.
    pub(super) async fn get_many_packed(
        &self,
        keys: &[String],
        limit: u64,
        since: Instant,
    ) -> Vec<(usize, Bytes)> {
        let mut by_pack: HashMap<Arc<str>, Vec<(usize, Sha256Hash, Loc)>> = HashMap::new();
        let fresh;
        {
            let v = self.view();
            fresh = v.listed_at.is_some_and(|t| t >= since);
            for (i, k) in keys.iter().enumerate() {
                if let Some(d) = chunk_digest(k)
                    && let Some(loc) = v.map.get(&d)
                    && loc.len <= limit
                {
                    by_pack
                        .entry(loc.pack.clone())
                        .or_default()
                        .push((i, d, loc.clone()));
                }
            }
        }
        let spans: Vec<Span> = futures::stream::iter(by_pack)
            .map(|(name, items)| async move {
                let dead = if fresh {
                    // The view's entries are live as of that listing.
                    HashSet::new()
                } else {
                    let Ok(Some(dead)) = self.pack_now(&name).await else {
                        return Vec::new();
                    };
                    dead
                };
                let mut live: Vec<(usize, Loc)> = items
                    .into_iter()
                    .filter(|(_, d, _)| !dead.contains(d))
                    .map(|(i, _, l)| (i, l))
                    .collect();
                live.sort_by_key(|(_, l)| l.offset);
                let mut spans: Vec<Span> = Vec::new();
                for (i, l) in live {
                    let joins = spans.last().is_some_and(|(_, s)| {
                        let (first, last) = (&s[0].1, &s[s.len() - 1].1);
                        let end = last.offset + last.len;
                        l.offset <= end + GET_MANY_GAP
                            && (l.offset + l.len).saturating_sub(first.offset) <= GET_MANY_SPAN
                    });
                    match spans.last_mut() {
                        Some((_, s)) if joins => s.push((i, l)),
                        _ => spans.push((name.clone(), vec![(i, l)])),
                    }
                }
                spans
            })
            .buffer_unordered(PACK_CHECKS_IN_FLIGHT)
            .flat_map(futures::stream::iter)
            .collect()
            .await;
        futures::stream::iter(spans)
            .map(|(name, items)| async move {
                let start = items[0].1.offset;
                let end = items
                    .iter()
                    .map(|(_, l)| l.offset + l.len)
                    .max()
                    .unwrap_or(start);
                let Ok(b) = self.get_range_raw(&pack_key(&name), start..end).await else {
                    return Vec::new();
                };
                items
                    .into_iter()
                    .filter_map(|(i, l)| {
                        let at = (l.offset - start) as usize;
                        let to = at + l.len as usize;
                        (to <= b.len()).then(|| (i, b.slice(at..to)))
                    })
                    .collect::<Vec<_>>()
            })
            .buffer_unordered(super::super::GET_MANY_IN_FLIGHT)
            .flat_map(futures::stream::iter)
            .collect()
            .await
    }

    /// Removes every dead marker of pack `name`: one listing, then DeleteObjects requests
    /// of up to [`DELETE_OBJECTS_MAX`] markers each.
    pub(super) async fn delete_markers(&self, name: &str) -> Result<(), BackendError> {
        let markers: Vec<String> = self
            .list_prefix_raw(&dead_prefix(name))
            .await?
            .into_iter()
            .map(|o| o.key)
            .collect();
        self.delete_raw_many(&markers).await.into_iter().collect()
    }

    /// [`Backend::rename_many`]: each pair keeps [`Backend::rename`]'s promise (the
    /// destination written before the source goes), in four steps over all of them:
    /// 1. the packed chunks among the sources are read as [`Backend::get_many`] reads them
    ///    (each pack's dead markers listed once, fresh; ranged GETs of spans of entries);
    /// 2. every destination is written, [`MARKERS_IN_FLIGHT`] at once: a packed chunk's
    ///    stored bytes by a PUT, any other source by CopyObject (a loose chunk not found is
    ///    renamed alone by [`Backend::rename`], which looks for packs written since);
    /// 3. the packed chunks written are marked dead in every pack holding them
    ///    ([`S3Backend::delete_packed_many`]: one listing of `packs/`);
    /// 4. the sources written are deleted with DeleteObjects (a packed chunk's loose copy,
    ///    two writers', goes with it).
    ///
    /// A failure stops its own pair at its step (so it never loses its source before its
    /// destination is written); the others go on.
    pub(super) async fn rename_many_impl(
        &self,
        pairs: &[(String, String)],
    ) -> Vec<Result<(), BackendError>> {
        let mut out: Vec<Option<Result<(), BackendError>>> = pairs
            .iter()
            .map(|(_, to)| validate_key(to).err().map(Err))
            .collect();
        let froms: Vec<String> = pairs.iter().map(|(f, _)| f.clone()).collect();
        let packed: HashMap<usize, Bytes> = self
            .get_many_packed(&froms, u64::MAX, Instant::now())
            .await
            .into_iter()
            .collect();
        let todo: Vec<usize> = (0..pairs.len()).filter(|i| out[*i].is_none()).collect();
        let packed = &packed;
        let steps: Vec<(usize, Step)> = futures::stream::iter(todo)
            .map(|i| async move {
                let (from, to) = &pairs[i];
                let step = match packed.get(&i) {
                    Some(b) => match self.put_raw(to, b.clone()).await {
                        Ok(_) => Step::Written { packed: true },
                        Err(e) => Step::Done(Err(e)),
                    },
                    None => match self.copy_raw(from, to).await {
                        Ok(()) => Step::Written { packed: false },
                        // Not a loose object: maybe in a pack written since the view was
                        // listed, so renamed alone, whole.
                        Err(e) if e.is_not_found() && chunk_digest(from).is_some() => {
                            Step::Done(self.rename(from, to).await)
                        }
                        Err(e) => Step::Done(Err(e)),
                    },
                };
                (i, step)
            })
            .buffer_unordered(MARKERS_IN_FLIGHT)
            .collect()
            .await;
        let (mut marked, mut sources) = (Vec::new(), Vec::new());
        for (i, step) in steps {
            match step {
                Step::Done(r) => out[i] = Some(r),
                Step::Written { packed } => {
                    if packed {
                        marked.push(i);
                    }
                    sources.push(i);
                }
            }
        }
        if !marked.is_empty() {
            let ds: Vec<Sha256Hash> = marked
                .iter()
                .filter_map(|i| chunk_digest(&pairs[*i].0))
                .collect();
            if let Err(e) = self.delete_packed_many(&ds).await {
                for i in marked {
                    out[i] = Some(Err(self.again(&e, "rename", &pairs[i].0)));
                }
            }
        }
        sources.retain(|i| out[*i].is_none());
        sources.sort_unstable();
        let keys: Vec<String> = sources.iter().map(|i| pairs[*i].0.clone()).collect();
        for (i, r) in sources.into_iter().zip(self.delete_raw_many(&keys).await) {
            out[i] = Some(r);
        }
        out.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
    }
}

/// Chunks [`Backend::pack_together`] reads with one [`Backend::get_many`] at a time (256:
/// 16 MiB of 64 KiB chunks raw, about half a pack stored), so it holds at most one pack
/// being filled and one group read.
const TOGETHER_READ: usize = 256;

impl S3Backend {
    /// [`Backend::pack_together`] ([`super`], "Packing together"): the chunks read in groups
    /// of [`TOGETHER_READ`] as [`Backend::get_many`] reads them (fresh dead markers, spans of
    /// their packs), appended in the order given to a batch of their own ([`S3Batch`], the
    /// uploads' own), each pack sent as it closes and the last one at the end by the uploads'
    /// send path ([`S3Backend::send_unsent`]: the pack's PUT, then its index's within
    /// [`INDEX_DEADLINE`]). Unlike an upload's commit it leaves out no chunk another pack
    /// holds: the copy is the point. On a failure nothing sent is removed: a pack without its
    /// index is invisible and a compaction removes it after [`ORPHAN_AGE`]; a pack whose
    /// index PUT failed may have its index after all (a lost answer), and is then a whole
    /// duplicate, which removing its pack would make damage.
    pub(super) async fn pack_together_impl(
        &self,
        keys: &[String],
    ) -> Result<PackedTogether, BackendError> {
        let mut seen = HashSet::new();
        let mut order: Vec<(String, Sha256Hash)> = Vec::with_capacity(keys.len());
        for k in keys {
            let d = chunk_digest(k).ok_or_else(|| BackendError::Other {
                store: self.url.clone(),
                op: "pack_together",
                key: k.clone(),
                message: "not a chunk's key".into(),
            })?;
            if seen.insert(d) {
                order.push((k.clone(), d));
            }
        }
        let batch = S3Batch::new(self.pack_target);
        let limit = crate::chunk::MAX_STORED_CHUNK_LEN;
        let mut bytes = 0u64;
        for group in order.chunks(TOGETHER_READ) {
            let ks: Vec<String> = group.iter().map(|(k, _)| k.clone()).collect();
            let got = self.get_many(&ks, limit + 1).await;
            for ((k, d), r) in group.iter().zip(got) {
                let b = r?;
                if b.len() as u64 > limit {
                    return Err(BackendError::Other {
                        store: self.url.clone(),
                        op: "pack_together",
                        key: k.clone(),
                        message: format!("over the {limit}-byte limit for a stored chunk"),
                    });
                }
                bytes += b.len() as u64;
                if batch.append(*d, &b).1 {
                    self.send_unsent(&batch).await?;
                }
            }
        }
        batch.seal_without(&HashSet::new());
        self.send_unsent(&batch).await?;
        Ok(PackedTogether {
            packs: batch.published_names(),
            chunks: order.len() as u64,
            bytes,
        })
    }
}
