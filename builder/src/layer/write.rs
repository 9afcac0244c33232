//! Writing a directory tree as a deterministic, gzip-compressed layer tar.
//!
//! Entries are sorted by name (bytes), directories before their contents; names are relative
//! with no `./` prefix and directories end in `/`. Owners, permission bits (with
//! setuid/setgid/sticky), devices, FIFOs, symlinks, hard links (the first path of an inode in
//! walk order carries the data, later ones are `Link` entries) and xattrs (PAX
//! `SCHILY.xattr.*`, except `security.selinux`) are kept; user and group names are left empty;
//! mtimes are clamped to `SOURCE_DATE_EPOCH` when given. Sockets are skipped (tar cannot hold
//! them). The tar is compressed as one zstd frame (RFC 8878) at a pinned level
//! ([`ZSTD_LEVEL`]) with a content checksum, on one thread, so the same tree gives the same
//! bytes; its media type is [`crate::build::OCI_LAYER_ZSTD`] (OCI image spec v1.1,
//! `media-types.md`), which Docker 23+, containerd 1.5+, podman and skopeo read.
//!
//! Why zstd and not gzip (issue 34): a layer is written once and read again by the publish
//! (the ext4 flatten), so it was compressed and then inflated in the same build. Measured on
//! the 172 MB tar of the Debian fixture's base layer (`zstd -q -3 -T1`, `gzip -6`, `zstd -dc`,
//! `gzip -dc`, load about 3 on 2 cores): zstd level 3 compresses it in 0.70 s to 52.8 MB and
//! decompresses it in 0.18 s; gzip level 6 takes 5.82 s (one core; [`super::pgzip`]
//! halves that on two) to 60.7 MB and 1.15 s to inflate.
//!
//! The tar is made and hashed on the calling thread and compressed, hashed again and written
//! on a second one ([`write_tree`]), so the walk (reading the files, the kernel's copies, the
//! diff id's sha256) and zstd overlap on two cores: zstd took about half of a step's
//! capture, measured with `perf record` on the peer's `multistage` case (a 158 MB layer, about
//! 3.5 s to capture on one thread under load). zstd's streaming output does not depend on how
//! its input is cut into writes (it compresses whole blocks of its own buffer), so the bytes,
//! and every digest, are the ones one thread made (tested:
//! `layer::tests::a_layer_is_the_one_thread_zstd_frame_of_its_tar`).
//!
//! A regular file with holes (fewer allocated blocks than its size, and `SEEK_DATA` /
//! `SEEK_HOLE` find a hole: `truncate -s 16G`, `useradd`'s `/var/log/lastlog`) is written as
//! a GNU sparse entry ([`set_sparse`]): its map, then only its data, so a 16 GiB file of
//! holes is a few hundred bytes of layer and the holes stay holes wherever it is read (GNU
//! tar, containerd's and Go's `archive/tar`, libarchive, and kiln's own reader,
//! [`super::apply_layer`] and the ext4 flattener). Its pieces of data are widened to whole
//! 4 KiB blocks, so the map does not depend on a file system reporting holes at a finer
//! granularity. A file without holes is a plain entry, as before.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use crate::exec::rootless::overlay_opaque_xattr;

use sha2::{Digest as _, Sha256};

/// The zstd level layers are written with: 3, zstd's own default (zstd manual,
/// `ZSTD_CLEVEL_DEFAULT`), pinned so a layer's bytes do not follow the library's default.
/// Part of the output's format: changing it changes every layer's digest.
pub const ZSTD_LEVEL: i32 = 3;

/// What [`write_layer`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// `sha256:` of the compressed bytes (the layer's descriptor digest, its blob's name).
    pub digest: kiln_store::BlobDigest,
    /// `sha256:` of the uncompressed tar (the config's `rootfs.diff_ids` entry). Not a
    /// [`kiln_store::BlobDigest`]: the store holds the compressed bytes, so this digest names
    /// no store object.
    pub diff_id: kiln_store::digest::Sha256Hash,
    /// Compressed size, bytes.
    pub size: u64,
    /// The layer's media type ([`crate::build::OCI_LAYER_ZSTD`]).
    pub media_type: &'static str,
}

/// A writer that hashes (sha256) and counts what passes through it to `inner`.
pub(crate) struct HashWriter<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W> HashWriter<W> {
    /// Hashing what is written to `inner`.
    pub(crate) fn new(inner: W) -> Self {
        HashWriter {
            inner,
            hash: Sha256::new(),
            len: 0,
        }
    }

    /// `inner`, the sha256 of the bytes written and their count.
    pub(crate) fn finish(self) -> (W, kiln_store::digest::Sha256Hash, u64) {
        let hash = kiln_store::digest::Sha256Hash(self.hash.finalize().into());
        (self.inner, hash, self.len)
    }
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the tree under `root` (the root's own metadata excluded) as a zstd layer into
/// `out`. `source_date_epoch` clamps mtimes (seconds since 1970).
pub fn write_layer(
    root: &Path,
    out: impl Write + Send,
    source_date_epoch: Option<u64>,
) -> io::Result<Written> {
    write_tree(root, out, source_date_epoch, false)
}

/// Writes an overlayfs upper directory as a zstd layer into `out`, like [`write_layer`] but
/// with overlayfs' change markers turned into the OCI image spec's (`layer.md`,
/// "Whiteouts"; Linux `Documentation/filesystems/overlayfs.rst`, "whiteouts and opaque
/// directories"): a character device 0/0 named `x` becomes an empty regular file `.wh.x`,
/// a directory with the xattr `trusted.overlay.opaque=y` (`user.overlay.opaque` in a user
/// namespace: [`overlay_opaque_xattr`]) gets a `.wh..wh..opq` entry first inside it, and no
/// overlayfs marker reaches the layer, while an xattr of overlayfs' namespace that the step
/// set itself does, under its own name ([`crate::exec::overlay::upper_xattr_name`]).
pub fn write_upper_layer(
    root: &Path,
    out: impl Write + Send,
    source_date_epoch: Option<u64>,
) -> io::Result<Written> {
    write_tree(root, out, source_date_epoch, true)
}

/// Gives every entry below the upper directory `root` (`root` too) the times its layer holds
/// for it, as [`write_upper_layer`] wrote them with `source_date_epoch`: the modification
/// time in whole seconds, at most `source_date_epoch`, and the access time equal to it (what
/// [`super::apply_layer`] sets). Called before the upper directory becomes its layer's
/// directory (`crate::build::lower::LayerDirs::adopt`), so that the layer's directory is
/// the same whether a step just made it or it was unpacked from the blob: the steps over it,
/// a stage's tree for `COPY --from` and `RUN --mount=from=` made of its files, show the
/// layer's times, never the time the step ran at under a `SOURCE_DATE_EPOCH`. Symlinks are
/// never followed.
///
/// Errors: reading the tree or setting a time (`utimensat(2)`).
pub fn settle_times(root: &Path, source_date_epoch: Option<u64>) -> io::Result<()> {
    let md = std::fs::symlink_metadata(root)?;
    // A directory's own times last: reading it moves its access time.
    if md.is_dir() {
        for e in std::fs::read_dir(root)? {
            settle_times(&e?.path(), source_date_epoch)?;
        }
    }
    let secs = md.mtime().max(0) as u64;
    set_times(root, source_date_epoch.map_or(secs, |e| secs.min(e)))
}

/// Sets `path`'s access and modification times to `secs` (whole seconds since the epoch),
/// not following a symlink (`utimensat(2)` with `AT_SYMLINK_NOFOLLOW`).
pub(crate) fn set_times(path: &Path, secs: u64) -> io::Result<()> {
    let t = rustix::fs::Timespec {
        tv_sec: secs.min(i64::MAX as u64) as i64,
        tv_nsec: 0,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

/// Bytes of tar handed to the compressing thread at a time, and how many such pieces may
/// wait for it (so at most about 2 MiB of tar is held between the two threads).
const PIECE: usize = 256 << 10;
const PIECES_IN_FLIGHT: usize = 8;

/// The tar side of [`write_tree`]'s two threads: collects what the tar builder writes into
/// pieces of [`PIECE`] bytes and sends each to the compressing thread.
struct PieceSender {
    tx: std::sync::mpsc::SyncSender<Vec<u8>>,
    piece: Vec<u8>,
}

impl PieceSender {
    fn send(&mut self) -> io::Result<()> {
        if self.piece.is_empty() {
            return Ok(());
        }
        let piece = std::mem::replace(&mut self.piece, Vec::with_capacity(PIECE));
        self.tx
            .send(piece)
            .map_err(|_| io::Error::other("the layer's compressing thread stopped"))
    }
}

impl Write for PieceSender {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.piece.extend_from_slice(buf);
        if self.piece.len() >= PIECE {
            self.send()?;
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes the tree as a zstd layer into `out`: the walk, the tar and its sha256 (the diff
/// id) on this thread; zstd, the compressed bytes' sha256 and `out` on a scoped second
/// thread, fed in pieces through a bounded channel (the module documentation). An error of
/// the compressing side (`out` full, say) is the one returned, as it was first.
fn write_tree(
    root: &Path,
    out: impl Write + Send,
    source_date_epoch: Option<u64>,
    overlay: bool,
) -> io::Result<Written> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(PIECES_IN_FLIGHT);
    std::thread::scope(|scope| {
        let compressor = std::thread::Builder::new()
            .name("kiln-layer-zstd".into())
            .spawn_scoped(scope, move || -> io::Result<_> {
                let mut z = zstd::stream::write::Encoder::new(HashWriter::new(out), ZSTD_LEVEL)?;
                z.include_checksum(true)?;
                for piece in rx {
                    z.write_all(&piece)?;
                }
                let mut outer = z.finish()?;
                outer.flush()?;
                let (_, digest, size) = outer.finish();
                Ok((digest, size))
            })?;
        let tar = (|| -> io::Result<_> {
            let inner = HashWriter::new(PieceSender {
                tx,
                piece: Vec::with_capacity(PIECE),
            });
            let mut b = tar::Builder::new(inner);
            b.mode(tar::HeaderMode::Complete);
            b.follow_symlinks(false);
            let mut links: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
            walk(
                root,
                Vec::new(),
                &mut b,
                &mut links,
                source_date_epoch,
                overlay,
            )?;
            let (mut sender, diff_id, _) = b.into_inner()?.finish();
            sender.send()?;
            // Dropping the sender ends the compressor's input.
            Ok(diff_id)
        })();
        let compressed = compressor
            .join()
            .map_err(|_| io::Error::other("the layer's compressing thread panicked"))?;
        let (digest, size) = compressed?;
        let diff_id = tar?;
        Ok(Written {
            digest: kiln_store::BlobDigest(digest),
            diff_id,
            size,
            media_type: crate::build::OCI_LAYER_ZSTD,
        })
    })
}

fn walk<W: Write>(
    dir: &Path,
    prefix: Vec<u8>,
    b: &mut tar::Builder<W>,
    links: &mut HashMap<(u64, u64), Vec<u8>>,
    epoch: Option<u64>,
    overlay: bool,
) -> io::Result<()> {
    // (name in the layer, name on disk), sorted by the former.
    let mut names: Vec<(Vec<u8>, std::ffi::OsString)> = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        if name
            .as_bytes()
            .starts_with(super::whiteout::PREFIX.as_bytes())
        {
            // In a layer the name is a whiteout (or an opaque marker): stored as it is, the
            // file would delete what it names from the image, which the build never showed.
            let mut shown = prefix.clone();
            shown.extend_from_slice(name.as_bytes());
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "/{}: a file whose name starts with {} cannot be stored in an OCI layer, \
                     where that name marks a deletion (OCI image spec, layer.md, \"Whiteouts\")",
                    String::from_utf8_lossy(&shown),
                    super::whiteout::PREFIX
                ),
            ));
        }
        let mut out_name = name.as_bytes().to_vec();
        if overlay {
            let md = std::fs::symlink_metadata(e.path())?;
            if md.file_type().is_char_device() && md.rdev() == 0 {
                out_name = [super::whiteout::PREFIX.as_bytes(), name.as_bytes()].concat();
            }
        }
        names.push((out_name, name));
    }
    names.sort_by(|a, b| a.0.cmp(&b.0));
    if overlay && !prefix.is_empty() && is_opaque(dir)? {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(0);
        h.set_mtime(epoch.unwrap_or(0));
        let mut rel = prefix.clone();
        rel.extend_from_slice(super::whiteout::OPAQUE.as_bytes());
        b.append_data(
            &mut h,
            Path::new(std::ffi::OsStr::from_bytes(&rel)),
            io::empty(),
        )?;
    }
    for (out_name, name) in names {
        let path = dir.join(&name);
        let md = std::fs::symlink_metadata(&path)?;
        let ft = md.file_type();
        if ft.is_socket() {
            continue;
        }
        let mut rel = prefix.clone();
        rel.extend_from_slice(&out_name);
        if overlay && ft.is_char_device() && md.rdev() == 0 {
            // An overlayfs whiteout: an empty regular `.wh.<name>`.
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(0);
            let mtime = md.mtime().max(0) as u64;
            h.set_mtime(epoch.map_or(mtime, |e| mtime.min(e)));
            b.append_data(
                &mut h,
                Path::new(std::ffi::OsStr::from_bytes(&rel)),
                io::empty(),
            )?;
            continue;
        }
        let mut xattrs: Vec<(String, Vec<u8>)> = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let n = rustix::fs::llistxattr(&path, &mut buf[..]).map_err(io::Error::from)?;
        for k in buf[..n].split(|c| *c == 0).filter(|s| !s.is_empty()) {
            let k = String::from_utf8_lossy(k).into_owned();
            let name = match overlay {
                true => match crate::exec::overlay::upper_xattr_name(&k) {
                    Some(n) => n,
                    None => continue,
                },
                false => k.clone(),
            };
            if name == "security.selinux" {
                continue;
            }
            let mut v = vec![0u8; 64 << 10];
            let m =
                rustix::fs::lgetxattr(&path, k.as_str(), &mut v[..]).map_err(io::Error::from)?;
            v.truncate(m);
            xattrs.push((format!("SCHILY.xattr.{name}"), v));
        }
        xattrs.sort();
        if !xattrs.is_empty() {
            b.append_pax_extensions(xattrs.iter().map(|(k, v)| (k.as_str(), v.as_slice())))?;
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(md.mode() & 0o7777);
        h.set_uid(md.uid() as u64);
        h.set_gid(md.gid() as u64);
        let mtime = md.mtime().max(0) as u64;
        h.set_mtime(epoch.map_or(mtime, |e| mtime.min(e)));
        h.set_size(0);
        let rel_path = Path::new(std::ffi::OsStr::from_bytes(&rel)).to_path_buf();
        if ft.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            let mut dname = rel.clone();
            dname.push(b'/');
            b.append_data(
                &mut h,
                Path::new(std::ffi::OsStr::from_bytes(&dname)),
                io::empty(),
            )?;
            let mut p = rel.clone();
            p.push(b'/');
            walk(&path, p, b, links, epoch, overlay)?;
        } else if ft.is_symlink() {
            h.set_entry_type(tar::EntryType::Symlink);
            let target = std::fs::read_link(&path)?;
            b.append_link(&mut h, &rel_path, &target)?;
        } else if ft.is_file() {
            if md.nlink() > 1 {
                if let Some(first) = links.get(&(md.dev(), md.ino())) {
                    h.set_entry_type(tar::EntryType::Link);
                    b.append_link(
                        &mut h,
                        &rel_path,
                        Path::new(std::ffi::OsStr::from_bytes(first)),
                    )?;
                    continue;
                }
                links.insert((md.dev(), md.ino()), rel.clone());
            }
            h.set_entry_type(tar::EntryType::Regular);
            let f = std::fs::File::open(&path)?;
            match data_segments(&f, &md)? {
                Some(segments) => {
                    let ext = set_sparse(&mut h, md.len(), &segments)?;
                    let data = SegmentReader {
                        file: &f,
                        segments: &segments,
                        idx: 0,
                        done: 0,
                    };
                    b.append_data(&mut h, &rel_path, io::Cursor::new(ext).chain(data))
                        .map_err(|e| {
                            io::Error::new(e.kind(), format!("{}: {e}", path.display()))
                        })?;
                }
                None => {
                    h.set_size(md.len());
                    b.append_data(&mut h, &rel_path, f)?;
                }
            }
        } else if ft.is_char_device() || ft.is_block_device() || ft.is_fifo() {
            h.set_entry_type(if ft.is_char_device() {
                tar::EntryType::Char
            } else if ft.is_block_device() {
                tar::EntryType::Block
            } else {
                tar::EntryType::Fifo
            });
            if !ft.is_fifo() {
                h.set_device_major(rustix::fs::major(md.rdev()))?;
                h.set_device_minor(rustix::fs::minor(md.rdev()))?;
            }
            b.append_data(&mut h, &rel_path, io::empty())?;
        }
    }
    Ok(())
}

/// Whether `dir` carries overlayfs' opaque marker ([`overlay_opaque_xattr`] = `y`).
pub fn is_opaque(dir: &Path) -> io::Result<bool> {
    let mut v = [0u8; 8];
    opaque_value(
        rustix::fs::lgetxattr(dir, overlay_opaque_xattr(), &mut v[..]),
        &v,
    )
}

/// [`is_opaque`] of an open directory.
pub(crate) fn is_opaque_fd(dir: std::os::fd::BorrowedFd<'_>) -> io::Result<bool> {
    let mut v = [0u8; 8];
    opaque_value(
        rustix::fs::fgetxattr(dir, overlay_opaque_xattr(), &mut v[..]),
        &v,
    )
}

/// What a read of the opaque marker into `v` says (no such xattr: not opaque).
fn opaque_value(read: rustix::io::Result<usize>, v: &[u8]) -> io::Result<bool> {
    match read {
        Ok(n) => Ok(&v[..n] == b"y"),
        Err(rustix::io::Errno::NODATA) | Err(rustix::io::Errno::NOTSUP) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Block size the pieces of a sparse file's data are widened to, bytes (ext4's block and
/// the page size: holes a file system reports are at least this coarse).
const SPARSE_BLOCK: u64 = 4096;

/// The pieces of data of the regular file `f` ((offset, length), in file order) when it has
/// holes, by `SEEK_DATA` / `SEEK_HOLE` (Linux `lseek(2)`), each widened to whole
/// [`SPARSE_BLOCK`]s (clamped to the file's end) and merged when they touch; `None` for a
/// file without holes (or on a file system without `SEEK_DATA`). The last piece ends at the
/// file's size: a zero-length one at the end is added when the file ends in a hole (the
/// GNU sparse map says the file's end that way; the `tar` crate's reader needs it).
pub(crate) fn data_segments(
    f: &std::fs::File,
    md: &std::fs::Metadata,
) -> io::Result<Option<Vec<(u64, u64)>>> {
    use rustix::fs::SeekFrom;
    use rustix::io::Errno;
    let size = md.len();
    if size == 0 || md.blocks() * 512 >= size {
        return Ok(None);
    }
    let mut segments: Vec<(u64, u64)> = Vec::new();
    let mut off = 0u64;
    while off < size {
        let start = match rustix::fs::seek(f, SeekFrom::Data(off)) {
            Ok(p) => p,
            Err(Errno::NXIO) => break,
            Err(Errno::INVAL) if off == 0 => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if start >= size {
            break;
        }
        let end = rustix::fs::seek(f, SeekFrom::Hole(start))?.min(size);
        let s = start / SPARSE_BLOCK * SPARSE_BLOCK;
        let e = end
            .div_ceil(SPARSE_BLOCK)
            .saturating_mul(SPARSE_BLOCK)
            .min(size);
        match segments.last_mut() {
            Some(last) if s <= last.0 + last.1 => last.1 = last.1.max(e - last.0),
            _ => segments.push((s, e - s)),
        }
        if end <= off {
            return Err(io::Error::other("lseek(SEEK_HOLE) did not advance"));
        }
        off = end;
    }
    if segments.as_slice() == [(0, size)] {
        return Ok(None);
    }
    if segments.last().is_none_or(|(o, l)| o + l < size) {
        segments.push((size, 0));
    }
    Ok(Some(segments))
}

/// Makes `h` (a GNU header; name, owner, mode and times set or to be set by the caller) a
/// GNU sparse entry (type `S`) of a file of `real_size` bytes whose data is `segments`
/// ((offset, length) in file order; every length but the last a multiple of 512; the last
/// piece ending at `real_size`), and returns the extension headers that must follow the
/// header, before the data. The format is the "old GNU" one of the GNU tar manual, section
/// "Sparse Formats": the header's `size` is the data's length, `realsize` the file's, up to
/// 4 (offset, numbytes) slots in the header and `isextended` set when 512-byte extension
/// headers of 21 slots each follow. It is the format the `tar` crate reads (and writes for
/// `append_file`, whose headers kiln cannot give its own mtimes and owners).
///
/// Errors: `InvalidInput` when `h` is not a GNU header.
pub(crate) fn set_sparse(
    h: &mut tar::Header,
    real_size: u64,
    segments: &[(u64, u64)],
) -> io::Result<Vec<u8>> {
    h.set_entry_type(tar::EntryType::GNUSparse);
    h.set_size(segments.iter().map(|(_, l)| l).sum());
    let g = h
        .as_gnu_mut()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a GNU header"))?;
    g.set_real_size(real_size);
    let (first, rest) = segments.split_at(segments.len().min(g.sparse.len()));
    for (slot, (off, len)) in g.sparse.iter_mut().zip(first) {
        slot.set_offset(*off);
        slot.set_length(*len);
    }
    g.set_is_extended(!rest.is_empty());
    let mut ext = Vec::new();
    let mut chunks = rest.chunks(21).peekable();
    while let Some(chunk) = chunks.next() {
        let mut e = tar::GnuExtSparseHeader::new();
        for (slot, (off, len)) in e.sparse_mut().iter_mut().zip(chunk) {
            slot.set_offset(*off);
            slot.set_length(*len);
        }
        e.set_is_extended(chunks.peek().is_some());
        ext.extend_from_slice(e.as_bytes());
    }
    Ok(ext)
}

/// Reads the pieces of data of a file, in order, with `pread`.
struct SegmentReader<'a> {
    file: &'a std::fs::File,
    segments: &'a [(u64, u64)],
    idx: usize,
    /// Bytes of the current piece read.
    done: u64,
}

impl Read for SegmentReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        loop {
            let Some(&(off, len)) = self.segments.get(self.idx) else {
                return Ok(0);
            };
            if self.done == len {
                self.idx += 1;
                self.done = 0;
                continue;
            }
            let want = (len - self.done).min(buf.len() as u64) as usize;
            let n = self.file.read_at(&mut buf[..want], off + self.done)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the file shrank while it was written into the layer",
                ));
            }
            self.done += n as u64;
            return Ok(n);
        }
    }
}
