//! The flattener's second pass: the final tree written as one tar stream for `mke2fs -d`
//! ([`Writer`]), directories before their entries, each shared inode once and hard links
//! after it, file data copied from the kept layers with its length checked.

use super::*;

pub(super) enum WriteFail {
    Read(io::Error),
    Out(Ext4Error),
}

impl WriteFail {
    /// The failure of an entry with no body to read (a directory, a hard link), as the
    /// output's: a read error there can only be the empty body's, so it is reported as one
    /// of writing the stream.
    fn into_output(self) -> Ext4Error {
        match self {
            WriteFail::Out(e) => e,
            WriteFail::Read(e) => Ext4Error::output(e),
        }
    }
}

pub(super) struct Writer<'a, W: Write> {
    pub(super) b: tar::Builder<W>,
    pub(super) emitted: HashSet<Vec<u8>>,
    pub(super) flat: &'a Flat,
}

const ROOT_DIR_MODE: u32 = 0o755;

impl<W: Write> Writer<'_, W> {
    /// Writes the directories above `path` that are not written yet.
    fn parents(&mut self, path: &[u8]) -> Result<(), Ext4Error> {
        for (i, b) in path.iter().enumerate() {
            if *b == b'/' {
                let p = &path[..i];
                if !self.emitted.contains(p) {
                    self.dir(p)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn dir(&mut self, path: &[u8]) -> Result<(), Ext4Error> {
        if self.emitted.contains(path) {
            return Ok(());
        }
        self.parents(path)?;
        let meta = match self.flat.paths.get(path) {
            Some(Node::Dir { meta: Some(m), .. }) => m.clone(),
            _ => Meta {
                mode: ROOT_DIR_MODE,
                uid: 0,
                gid: 0,
                mtime: self.flat.default_mtime,
                xattrs: Vec::new(),
            },
        };
        let mut name = path.to_vec();
        name.push(b'/');
        self.header(
            &name,
            tar::EntryType::Directory,
            &meta,
            0,
            None,
            (0, 0),
            None,
            io::empty(),
        )
        .map_err(WriteFail::into_output)?;
        self.emitted.insert(path.to_vec());
        Ok(())
    }

    /// A hard link. It carries the inode's metadata: mke2fs applies a link entry's mode,
    /// owner and times to the shared inode.
    pub(super) fn link(
        &mut self,
        name: &[u8],
        target: &[u8],
        meta: &Meta,
    ) -> Result<(), Ext4Error> {
        self.parents(name)?;
        self.header(
            name,
            tar::EntryType::Link,
            meta,
            0,
            Some(target),
            (0, 0),
            None,
            io::empty(),
        )
        .map_err(WriteFail::into_output)
    }

    pub(super) fn inode(
        &mut self,
        name: &[u8],
        inode: &Inode,
        data: impl Read,
    ) -> Result<(), WriteFail> {
        self.parents(name).map_err(WriteFail::Out)?;
        use tar::EntryType as T;
        match &inode.kind {
            Kind::File { size, map } => self.header(
                name,
                T::Regular,
                &inode.meta,
                *size,
                None,
                (0, 0),
                map.as_deref(),
                data,
            ),
            Kind::Symlink(t) => self.header(
                name,
                T::Symlink,
                &inode.meta,
                0,
                Some(t),
                (0, 0),
                None,
                io::empty(),
            ),
            Kind::Char(a, b) => self.header(
                name,
                T::Char,
                &inode.meta,
                0,
                None,
                (*a, *b),
                None,
                io::empty(),
            ),
            Kind::Block(a, b) => self.header(
                name,
                T::Block,
                &inode.meta,
                0,
                None,
                (*a, *b),
                None,
                io::empty(),
            ),
            Kind::Fifo => self.header(
                name,
                T::Fifo,
                &inode.meta,
                0,
                None,
                (0, 0),
                None,
                io::empty(),
            ),
        }
    }

    /// Writes a GNU long-name record of `kind` (`L` for the next entry's name, `K` for its
    /// link target): a header named `././@LongLink` whose data is `value` and a NUL, as GNU
    /// tar writes it (GNU tar manual, "GNU tar format").
    fn long_name(&mut self, kind: tar::EntryType, value: &[u8]) -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut()
            .ok_or_else(|| io::Error::other("gnu header"))?
            .name[..13]
            .copy_from_slice(b"././@LongLink");
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_size(value.len() as u64 + 1);
        h.set_cksum();
        self.b.append(&h, io::Cursor::new(value).chain(&[0u8][..]))
    }

    /// Writes one entry: GNU long-name records when needed (long name or link), a PAX
    /// header for xattrs, then the GNU header and `size` bytes of `data`.
    #[allow(clippy::too_many_arguments)]
    fn header(
        &mut self,
        name: &[u8],
        kind: tar::EntryType,
        meta: &Meta,
        size: u64,
        link: Option<&[u8]>,
        dev: (u32, u32),
        sparse: Option<&[(u64, u64)]>,
        data: impl Read,
    ) -> Result<(), WriteFail> {
        let out = |e: io::Error| WriteFail::Out(Ext4Error::output(e));
        let mut pax: Vec<(String, Vec<u8>)> = Vec::new();
        let mut h = tar::Header::new_gnu();
        // A name or link target over the header's 100 bytes goes in a GNU long-name record
        // (`L`, `K`), which holds any bytes: a PAX `path` record cannot hold a newline for
        // the `tar` crate, which splits records on newlines. Neither holds a NUL
        // (`split_name`, `read_meta`).
        if name.len() > 100 {
            self.long_name(tar::EntryType::GNULongName, name)
                .map_err(out)?;
        }
        if let Some(l) = link
            && l.len() > 100
        {
            self.long_name(tar::EntryType::GNULongLink, l)
                .map_err(out)?;
        }
        for (k, v) in &meta.xattrs {
            let k = String::from_utf8(k.clone()).map_err(|_| {
                WriteFail::Out(Ext4Error::XattrName(
                    String::from_utf8_lossy(name).into_owned(),
                ))
            })?;
            pax.push((format!("SCHILY.xattr.{k}"), v.clone()));
        }
        if !pax.is_empty() {
            self.b
                .append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                .map_err(out)?;
        }
        {
            let g = h
                .as_gnu_mut()
                .ok_or_else(|| out(io::Error::other("gnu header")))?;
            let n = name.len().min(100);
            g.name[..n].copy_from_slice(&name[..n]);
            if let Some(l) = link {
                let n = l.len().min(100);
                g.linkname[..n].copy_from_slice(&l[..n]);
            }
            // mke2fs sets atime and ctime from the entry (0 when absent): make them mtime.
            g.set_atime(meta.mtime);
            g.set_ctime(meta.mtime);
        }
        h.set_entry_type(kind);
        h.set_mode(meta.mode);
        h.set_uid(meta.uid as u64);
        h.set_gid(meta.gid as u64);
        h.set_mtime(meta.mtime);
        h.set_size(size);
        if matches!(kind, tar::EntryType::Char | tar::EntryType::Block) {
            h.set_device_major(dev.0).map_err(out)?;
            h.set_device_minor(dev.1).map_err(out)?;
        }
        // A sparse file: its map in the header and the extension headers that follow it,
        // then only its data ([`set_sparse`]).
        let (ext, want) = match sparse {
            Some(map) => {
                let ext = set_sparse(&mut h, size, map).map_err(out)?;
                let data: u64 = map.iter().map(|(_, l)| l).sum();
                let n = ext.len() as u64;
                (ext, n + data)
            }
            None => (Vec::new(), size),
        };
        h.set_cksum();
        let mut counted = CountRead {
            inner: io::Cursor::new(ext).chain(data),
            n: 0,
            err: None,
        };
        let r = self.b.append(&h, &mut counted);
        if let Some(e) = counted.err {
            return Err(WriteFail::Read(e));
        }
        r.map_err(out)?;
        if counted.n != want {
            return Err(WriteFail::Read(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file data shorter than its header says",
            )));
        }
        Ok(())
    }
}

/// Counts bytes read and keeps the reader's own error apart from the writer's.
struct CountRead<R> {
    inner: R,
    n: u64,
    err: Option<io::Error>,
}

impl<R: Read> Read for CountRead<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inner.read(buf) {
            Ok(n) => {
                self.n += n as u64;
                Ok(n)
            }
            Err(e) => {
                let msg = e.to_string();
                self.err = Some(e);
                Err(io::Error::other(msg))
            }
        }
    }
}
