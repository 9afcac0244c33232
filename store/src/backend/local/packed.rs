//! The local backend's packed chunks (issue 33; the layout, commit order and promise are in
//! [`super`]'s module doc, "Packs"): look-up, reads, the commit of a batch, deletion, and
//! compaction.

use super::*;

/// Packed chunks ([`local_pack`]): look-up, reads, the commit of a batch, deletion.
impl Ctx {
    /// Where `key` is packed, when it is a packed-eligible key held by a live pack entry.
    pub(super) fn packed(&self, key: &str) -> Result<Option<local_pack::Loc>, BackendError> {
        let Some(d) = chunk_digest(key) else {
            return Ok(None);
        };
        self.packs
            .lookup(&d)
            .map_err(|e| other(&self.url, "resolve", key, e))
    }

    /// Bytes `range` of `key` when it is packed (`None`: not packed). A pack deleted under
    /// the read is looked up again once.
    pub(super) fn read_packed(
        &self,
        key: &str,
        range: Range<u64>,
    ) -> Result<Option<Bytes>, BackendError> {
        for _ in 0..2 {
            let Some(loc) = self.packed(key)? else {
                return Ok(None);
            };
            match self.packs.read_at(&loc, range.clone()) {
                Ok(b) => return Ok(Some(Bytes::from(b))),
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    self.packs.drop_pack(&loc.pack);
                    self.packs
                        .rescan()
                        .map_err(|e| other(&self.url, "get", key, e))?;
                }
                Err(e) => return Err(other(&self.url, "get", key, e)),
            }
        }
        Ok(None)
    }

    /// The exclusive lock of pack commits and deletions (`.locks/#packs`).
    pub(super) fn lock_packs(&self, key: &str) -> Result<File, BackendError> {
        no_symlink(&self.url, key, &self.root.join(LOCK_DIR))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.root.join(LOCK_DIR).join(PACK_LOCK))
            .map_err(|e| other(&self.url, "lock", key, e))?;
        lock.lock().map_err(|e| other(&self.url, "lock", key, e))?;
        Ok(lock)
    }

    /// [`Backend::commit_staged`] of a batch's packed chunks (`staged`: the batch's entries,
    /// in the caller's order). See the module doc ("Packs") for the order and why.
    pub(super) fn commit_pack(
        &self,
        batch: &PackBatch,
        staged: &[StagedPut],
    ) -> Result<Vec<PutOutcome>, BackendError> {
        let err = |op: &'static str, e: std::io::Error| other(&self.url, op, &batch.name, e);
        // 1. The pack's bytes are on stable storage before any index names them.
        if !staged.is_empty()
            && let Some(f) = batch.file()
        {
            f.sync_all().map_err(|e| err("fsync", e))?;
        }
        // 2. Chunks found present as loose files: their names, linked by another writer
        //    that may not have fsynced their directory yet.
        let loose_dir = self.root.join("chunks/sha256");
        let loose_dir_exists = no_symlink(&self.url, "chunks/sha256", &self.root.join("chunks"))?
            && no_symlink(&self.url, "chunks/sha256", &loose_dir)?;
        if loose_dir_exists {
            fsync_dir(&loose_dir).map_err(|e| err("fsync", e))?;
        }
        // 3. Under the lock: every index committed before is durable (its committer
        //    fsynced `.packs` before releasing), and seen here.
        let _lock = self.lock_packs(&batch.name)?;
        no_symlink(&self.url, PACK_DIR, self.packs.dir())?;
        self.packs.rescan().map_err(|e| err("resolve", e))?;
        let mut outcomes = Vec::with_capacity(staged.len());
        let mut created = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for s in staged {
            let (Some(d), Some(offset)) = (chunk_digest(&s.key), s.packed) else {
                return Err(other(
                    &self.url,
                    "commit_staged",
                    &s.key,
                    "not a packed chunk",
                ));
            };
            // The view was just rescanned under the lock, and deletions take the lock too.
            let present = !seen.insert(d)
                || self.packs.contains(&d)
                || (loose_dir_exists
                    && fs::symlink_metadata(self.root.join(&s.key)).is_ok_and(|m| m.is_file()));
            if present {
                outcomes.push(PutOutcome::AlreadyExists);
            } else {
                outcomes.push(PutOutcome::Created);
                created.push(IdxEntry {
                    digest: d,
                    offset,
                    len: s.len,
                });
            }
        }
        if created.is_empty() {
            // Nothing new: the batch's file goes as it drops.
            return Ok(outcomes);
        }
        let pack_len = batch.len();
        let live: u64 = created.iter().map(|e| e.len).sum();
        let idx_bytes = local_pack::encode_index(&mut created);
        let idx_tmp = self.root.join(TMP_DIR).join(format!("{}.idx", batch.name));
        let done = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&idx_tmp)?;
            f.write_all(&idx_bytes)?;
            f.sync_all()?;
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(self.packs.path(&batch.name, "dead"))?;
            fs::rename(&batch.tmp, self.packs.path(&batch.name, "pack"))?;
            // The pack's name is durable before an index can name it (a file system
            // without a journal does not order the two renames).
            fsync_dir(self.packs.dir())?;
            fs::rename(&idx_tmp, self.packs.path(&batch.name, "idx"))?;
            fsync_dir(self.packs.dir())?;
            fs::symlink_metadata(self.packs.path(&batch.name, "idx"))?.modified()
        })();
        let modified = match done {
            Ok(m) => m,
            Err(e) => {
                let _ = fs::remove_file(&idx_tmp);
                if fs::symlink_metadata(self.packs.path(&batch.name, "idx")).is_err() {
                    let _ = fs::remove_file(self.packs.path(&batch.name, "pack"));
                    let _ = fs::remove_file(self.packs.path(&batch.name, "dead"));
                }
                return Err(if crate::space::is_no_space(&e) {
                    self.write_err(&batch.name, e)
                } else {
                    err("commit_staged", e)
                });
            }
        };
        tracing::debug!(
            store = %self.url,
            pack = %batch.name,
            chunks = created.len(),
            bytes = pack_len,
            dead_bytes = pack_len - live,
            "committed a pack"
        );
        self.packs.add(&batch.name, created, pack_len, modified);
        Ok(outcomes)
    }

    /// Deletes the packed entries of `key`, if any, under the lock: its digest appended to
    /// each holding pack's dead file (fsynced; a chunk held by two packs, a compaction's
    /// leftover, is deleted from both); a pack is retired once every entry is dead
    /// ([`Ctx::retire_pack`]). Returns whether an entry was deleted.
    pub(super) fn delete_packed(&self, key: &str) -> Result<bool, BackendError> {
        let Some(d) = chunk_digest(key) else {
            return Ok(false);
        };
        if self.packed(key)?.is_none() {
            return Ok(false);
        }
        let _lock = self.lock_packs(key)?;
        let err = |e: std::io::Error| other(&self.url, "delete", key, e);
        // Under the lock no pack is committed, compacted or retired: this view, refreshed
        // if `.packs` changed since it was read, is current.
        self.packs.rescan_if_changed().map_err(err)?;
        let mut done: Vec<Arc<str>> = Vec::new();
        while let Some(loc) = self.packed(key)? {
            if done.contains(&loc.pack) {
                return Err(other(
                    &self.url,
                    "delete",
                    key,
                    format!("still served by pack {} after its delete", loc.pack),
                ));
            }
            let dead_path = self.packs.path(&loc.pack, "dead");
            let dead_len = {
                use std::os::unix::fs::OpenOptionsExt;
                let mut f = OpenOptions::new()
                    .append(true)
                    .create(true)
                    .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                    .open(&dead_path)
                    .map_err(err)?;
                f.write_all(&d.0).map_err(err)?;
                f.sync_all().map_err(err)?;
                f.metadata().map_err(err)?.len()
            };
            if let Some(pack_len) = self.packs.mark_dead(&loc.pack, d, dead_len) {
                self.retire_pack(&loc.pack).map_err(err)?;
                self.packs.retired_early.note(pack_len);
            }
            done.push(loc.pack);
        }
        Ok(!done.is_empty())
    }

    /// Removes pack `name` (under the lock): its index first, made durable by an fsync of
    /// `.packs` before its pack and dead file go, so that no crash or power loss leaves the
    /// index without its pack (a pack without an index is invisible, and reaped).
    pub(super) fn retire_pack(&self, name: &str) -> std::io::Result<()> {
        remove_if_present(&self.packs.path(name, "idx"))?;
        fsync_dir(self.packs.dir())?;
        self.packs.drop_pack(name);
        remove_if_present(&self.packs.path(name, "pack"))?;
        remove_if_present(&self.packs.path(name, "dead"))?;
        fsync_dir(self.packs.dir())
    }

    /// [`Backend::compact`]: see the module doc ("Compaction").
    pub(super) fn compact(
        &self,
        dry_run: bool,
        also_dead: &[String],
    ) -> Result<CompactReport, BackendError> {
        let err = |e: std::io::Error| other(&self.url, "compact", PACK_DIR, e);
        no_symlink(&self.url, PACK_DIR, self.packs.dir())?;
        self.packs.rescan().map_err(err)?;
        let also: std::collections::HashSet<Sha256Hash> =
            also_dead.iter().filter_map(|k| chunk_digest(k)).collect();
        let plans = self.packs.plan_compaction(&also);
        let mut r = CompactReport::default();
        if dry_run {
            for p in &plans {
                r.packs += 1;
                r.bytes_before += p.pack_len;
                r.bytes_copied += p.live_bytes;
                r.bytes_reclaimed += p.pack_len - p.live_bytes;
            }
            return Ok(r);
        }
        {
            // Under the lock every pack file without an index is a crash's leftover: a
            // commit renames a pack and its index under the lock, a retirement removes
            // them under it.
            let _lock = self.lock_packs(PACK_DIR)?;
            let (files, bytes) = reap_unindexed(self.packs.dir()).map_err(err)?;
            if files > 0 {
                fsync_dir(self.packs.dir()).map_err(err)?;
            }
            r.orphan_files = files;
            r.bytes_reclaimed += bytes;
        }
        for p in &plans {
            match self.compact_one(p) {
                Ok(Some(copied)) => {
                    r.packs += 1;
                    r.bytes_before += p.pack_len;
                    r.bytes_copied += copied;
                    r.bytes_reclaimed += p.pack_len - copied;
                }
                Ok(None) => {}
                Err(BackendError::NoSpace { space, .. }) => {
                    // The file system is full: the packs done so far stay done.
                    tracing::warn!(store = %self.url, pack = %p.name, %space, "compaction stopped: no space for a copy");
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        self.packs.retired_early.report_into(&mut r);
        if r.packs > 0 {
            tracing::info!(
                store = %self.url,
                packs = r.packs,
                copied = r.bytes_copied,
                reclaimed = r.bytes_reclaimed,
                "compacted packs"
            );
        }
        Ok(r)
    }

    /// Compacts one pack: its serving entries copied (outside the lock) into a new pack,
    /// which is committed as an upload's batch is, then the old pack retired, both under
    /// the lock. Returns the bytes copied, or `None` when the pack was left as it is (gone
    /// meanwhile, or it now serves a chunk the plan did not copy).
    pub(super) fn compact_one(
        &self,
        plan: &local_pack::CompactPlan,
    ) -> Result<Option<u64>, BackendError> {
        let old: &str = &plan.name;
        let err = |op: &'static str, e: std::io::Error| {
            if crate::space::is_no_space(&e) {
                BackendError::NoSpace {
                    store: self.url.clone(),
                    op: "compact",
                    key: old.to_string(),
                    space: crate::space::NoSpace::at("compacting", &self.root.join(TMP_DIR), None),
                }
            } else {
                other(&self.url, op, old, e)
            }
        };
        let name = fresh_name();
        let tmp_pack = self.root.join(TMP_DIR).join(format!("{name}.pack"));
        let mut guard = RemoveOnDrop(None);
        let mut entries = Vec::with_capacity(plan.live.len());
        let mut new_len = 0u64;
        // 1. The copy, outside the lock: commits and deletes go on meanwhile.
        if !plan.live.is_empty() {
            use std::os::unix::fs::FileExt;
            no_symlink(&self.url, old, &self.root.join(TMP_DIR))?;
            let src = match local_pack::open_nofollow(&self.packs.path(old, "pack")) {
                Ok(f) => f,
                Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(err("compact", e)),
            };
            let mut dst = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp_pack)
                .map_err(|e| err("compact", e))?;
            guard = RemoveOnDrop(Some(tmp_pack.clone()));
            let biggest = plan.live.iter().map(|e| e.len).max().unwrap_or(0);
            let mut buf = vec![0u8; biggest.min(COMPACT_BUF) as usize];
            for e in &plan.live {
                let mut done = 0u64;
                while done < e.len {
                    let n = (e.len - done).min(buf.len() as u64) as usize;
                    src.read_exact_at(&mut buf[..n], e.offset + done)
                        .and_then(|_| dst.write_all(&buf[..n]))
                        .map_err(|e| err("compact", e))?;
                    done += n as u64;
                }
                entries.push(IdxEntry {
                    digest: e.digest,
                    offset: new_len,
                    len: e.len,
                });
                new_len += e.len;
            }
            // The copy's bytes are on stable storage before any index names them.
            dst.sync_all().map_err(|e| err("fsync", e))?;
        }
        #[cfg(test)]
        tests::before_compaction_commit(&self.root);
        // 2. Under the lock, on a view rescanned under it.
        let _lock = self.lock_packs(old)?;
        no_symlink(&self.url, PACK_DIR, self.packs.dir())?;
        self.packs.rescan().map_err(|e| err("resolve", e))?;
        let Some(now) = self.packs.serving_entries(old) else {
            return Ok(None);
        };
        let copied: std::collections::HashSet<Sha256Hash> =
            entries.iter().map(|e| e.digest).collect();
        if now.iter().any(|e| !copied.contains(&e.digest)) {
            // Served by another pack at the plan, whose copy went since: not copied, so
            // this pack stays (the next compaction takes it).
            return Ok(None);
        }
        // Chunks deleted meanwhile are not indexed again (their bytes are dead weight in
        // the new pack).
        let serving: std::collections::HashSet<Sha256Hash> = now.iter().map(|e| e.digest).collect();
        entries.retain(|e| serving.contains(&e.digest));
        if !entries.is_empty() {
            let idx_bytes = local_pack::encode_index(&mut entries);
            let idx_tmp = self.root.join(TMP_DIR).join(format!("{name}.idx"));
            let mut idx_guard = RemoveOnDrop(Some(idx_tmp.clone()));
            let published = (|| {
                let f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&idx_tmp)?;
                (&f).write_all(&idx_bytes)?;
                // The old index's mtime: no chunk's `modified` changes.
                f.set_modified(plan.modified)?;
                f.sync_all()?;
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(self.packs.path(&name, "dead"))?;
                fs::rename(&tmp_pack, self.packs.path(&name, "pack"))?;
                fsync_dir(self.packs.dir())?;
                fs::rename(&idx_tmp, self.packs.path(&name, "idx"))?;
                fsync_dir(self.packs.dir())
            })();
            if let Err(e) = published {
                if fs::symlink_metadata(self.packs.path(&name, "idx")).is_err() {
                    let _ = fs::remove_file(self.packs.path(&name, "pack"));
                    let _ = fs::remove_file(self.packs.path(&name, "dead"));
                }
                return Err(err("compact", e));
            }
            idx_guard.keep();
            guard.keep();
            self.packs.add(&name, entries, new_len, plan.modified);
        }
        // 3. The new index is in place (and durable): the old pack goes.
        self.retire_pack(old).map_err(|e| err("compact", e))?;
        tracing::debug!(
            store = %self.url,
            pack = %old,
            into = %name,
            bytes = plan.pack_len,
            copied = new_len,
            "compacted a pack"
        );
        Ok(Some(new_len))
    }
}

/// Removes the pack and dead files of `.packs` that have no index; returns the files and
/// bytes removed. Only under the packs lock (see [`Ctx::compact`]).
fn reap_unindexed(packs: &Path) -> std::io::Result<(u64, u64)> {
    let names: Vec<String> = fs::read_dir(packs)?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    let indexed: std::collections::HashSet<&str> = names
        .iter()
        .filter_map(|n| n.strip_suffix(".idx"))
        .collect();
    let (mut files, mut bytes) = (0, 0);
    for n in &names {
        let Some(stem) = n.strip_suffix(".pack").or_else(|| n.strip_suffix(".dead")) else {
            continue;
        };
        if indexed.contains(stem) {
            continue;
        }
        let p = packs.join(n);
        let len = fs::symlink_metadata(&p).map(|m| m.len()).unwrap_or(0);
        if fs::remove_file(&p).is_ok() {
            files += 1;
            bytes += len;
        }
    }
    Ok((files, bytes))
}
