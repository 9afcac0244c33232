//! One inflation of a compressed layer blob, shared by the readers of its plain tar in this
//! process.
//!
//! A cold build reads its base layer twice at once: the flattener's first pass
//! ([`crate::ext4::Prescan`]) while the steps run, and the unpack of the same blob into its
//! layer directory ([`crate::build::lower`]) for the steps' overlay. Both used to inflate
//! it (the Debian base: 51 MB of gzip, 172 MB of tar, about 1.15 s of one core under load).
//! Now the scan is the one that inflates: the plain stream its tar reader reads is what it
//! already keeps for its second pass ([`crate::ext4::Keep`], an unlinked temporary file),
//! and that copy is published here under the layer's digest while it grows
//! ([`Inflation`]). A reader of the same layer that comes while the copy is alive
//! ([`follow`]) reads the copy instead, waiting for the bytes not written yet.
//!
//! The copy may stop short: the scan fails or is cancelled, the copy outgrows its bound
//! ([`crate::ext4::Keep::max_bytes`]) or cannot be written, or the scan's tar reader stops at
//! the end-of-archive blocks before the end of the stream. A follower that reaches the end
//! of what was copied without the copy having seen the stream's end ([`Follow`]) inflates
//! the blob itself from the start and drops the bytes it had already read, so it always
//! reads exactly the blob's inflated stream. What a follower reads is plain tar: its
//! consumer reads it with its own [`super::Limits`] as it would the blob's inflated stream
//! (the byte bound counts the same bytes), and must not sniff it for compression (a plain
//! tar whose first name starts like a gzip member would be taken for one).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

/// How far a copy got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Still being written.
    Open,
    /// Finished: `eof` when the copy holds the whole inflated stream (its reader saw the end).
    Complete { eof: bool },
    /// Given up: only the bytes written so far are in the file.
    Abandoned,
}

#[derive(Debug)]
struct State {
    /// Bytes of the stream in the file, from its start.
    written: u64,
    end: End,
}

/// A compressed layer's inflated stream being copied into an unlinked file, readable by
/// followers while it grows ([`follow`]).
#[derive(Debug)]
pub(crate) struct Inflation {
    digest: String,
    file: File,
    state: Mutex<State>,
    grew: Condvar,
}

/// The live copies of this process by layer digest (`sha256:<hex>`). An entry goes when its
/// last holder (the writer, the scan's kept copy, a follower) drops it.
static LIVE: Mutex<Option<HashMap<String, Weak<Inflation>>>> = Mutex::new(None);

fn live() -> MutexGuard<'static, Option<HashMap<String, Weak<Inflation>>>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inflation {
    /// A new copy of layer `digest`'s inflated stream into `file` (empty, unlinked),
    /// published for [`follow`]. A live copy of the same digest stays the one followed.
    pub(crate) fn publish(digest: &str, file: File) -> Arc<Inflation> {
        let inf = Arc::new(Inflation {
            digest: digest.to_string(),
            file,
            state: Mutex::new(State {
                written: 0,
                end: End::Open,
            }),
            grew: Condvar::new(),
        });
        let mut live = live();
        let map = live.get_or_insert_with(HashMap::new);
        map.retain(|_, w| w.strong_count() > 0);
        if !map.contains_key(digest) {
            map.insert(digest.to_string(), Arc::downgrade(&inf));
        }
        inf
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The file the copy is in (read it with positioned reads: it is shared).
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Appends `buf` (the next bytes of the stream) to the copy and tells the followers.
    /// Nothing is written to a copy that is finished or abandoned. Errors: the write's.
    pub(crate) fn append(&self, buf: &[u8]) -> io::Result<()> {
        let at = {
            let s = self.state();
            if s.end != End::Open {
                return Ok(());
            }
            s.written
        };
        // Only this copy's one writer appends: `at` stays the end while it writes.
        self.file.write_all_at(buf, at)?;
        self.state().written = at + buf.len() as u64;
        self.grew.notify_all();
        Ok(())
    }

    /// Ends the copy: `eof` when its writer read the stream to its end.
    pub(crate) fn complete(&self, eof: bool) {
        self.finish(End::Complete { eof });
    }

    /// Gives the copy up: followers read the rest from the blob. No-op on a finished copy.
    pub(crate) fn abandon(&self) {
        self.finish(End::Abandoned);
    }

    fn finish(&self, end: End) {
        let mut s = self.state();
        if s.end == End::Open {
            s.end = end;
        }
        drop(s);
        self.grew.notify_all();
    }

    /// Bytes written so far.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.state().written
    }
}

/// A copy published before its writer starts ([`Reserved::new`]), so that a reader of the
/// layer that comes first follows it rather than inflating the blob on its own: a build's
/// prescan reserves its base's copies before the steps' unpack can start. Dropped without
/// [`Reserved::take`] (the layer turned out plain, or is not kept), the copy is abandoned and
/// its followers read the blob.
pub(crate) struct Reserved(Option<Arc<Inflation>>);

impl Reserved {
    /// Publishes an empty copy of layer `digest` into `file` ([`Inflation::publish`]).
    pub(crate) fn new(digest: &str, file: File) -> Reserved {
        Reserved(Some(Inflation::publish(digest, file)))
    }

    /// The copy, for its writer.
    pub(crate) fn take(mut self) -> Option<Arc<Inflation>> {
        self.0.take()
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(inf) = self.0.take() {
            inf.abandon();
        }
    }
}

/// A reader of layer `digest`'s inflated stream (blob at `blob`) from its live copy, when
/// one is being made or kept ([`Inflation::publish`]); `None` otherwise (the caller
/// inflates the blob as usual).
pub(crate) fn follow(digest: &str, blob: &Path) -> Option<Follow> {
    let inf = live().as_ref()?.get(digest)?.upgrade()?;
    Some(Follow {
        inf,
        pos: 0,
        blob: blob.to_path_buf(),
        own: None,
    })
}

/// Reads a layer's inflated stream from its live copy ([`follow`]), waiting for bytes not
/// written yet; past what the copy holds when it stopped short, from the blob inflated
/// again (the bytes already read skipped). See the module doc.
pub(crate) struct Follow {
    inf: Arc<Inflation>,
    pos: u64,
    blob: PathBuf,
    own: Option<Box<dyn Read>>,
}

impl Follow {
    /// The blob inflated from the start, the `pos` bytes already read dropped.
    fn inflate_from_blob(&self) -> io::Result<Box<dyn Read>> {
        let named = |e: io::Error| {
            io::Error::new(
                e.kind(),
                format!(
                    "layer {} (blob {}), read again past its shared copy: {e}",
                    self.inf.digest,
                    self.blob.display()
                ),
            )
        };
        let mut raw =
            io::BufReader::with_capacity(256 << 10, File::open(&self.blob).map_err(named)?);
        let head = io::BufRead::fill_buf(&mut raw).map_err(named)?;
        let mut r = super::Compression::sniff(head)
            .decoder(raw)
            .map_err(named)?;
        let skipped = io::copy(&mut (&mut r).take(self.pos), &mut io::sink()).map_err(named)?;
        if skipped != self.pos {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "layer {} (blob {}): the blob inflates to {skipped} bytes, its shared copy \
                     had {}",
                    self.inf.digest,
                    self.blob.display(),
                    self.pos
                ),
            ));
        }
        Ok(r)
    }
}

impl Read for Follow {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if let Some(r) = &mut self.own {
            let n = r.read(buf)?;
            self.pos += n as u64;
            return Ok(n);
        }
        let (written, end) = {
            let mut s = self.inf.state();
            while s.written <= self.pos && s.end == End::Open {
                s = self.inf.grew.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            (s.written, s.end)
        };
        if written > self.pos {
            let want = (buf.len() as u64).min(written - self.pos) as usize;
            let n = self.inf.file.read_at(&mut buf[..want], self.pos)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "layer {}: its shared copy is shorter than the {written} bytes written",
                        self.inf.digest
                    ),
                ));
            }
            self.pos += n as u64;
            return Ok(n);
        }
        if end == (End::Complete { eof: true }) {
            return Ok(0);
        }
        // Stopped short of the stream's end: the rest comes from the blob.
        self.own = Some(self.inflate_from_blob()?);
        self.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn stream(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    /// A blob file holding `data` gzipped, and a unique digest for it.
    fn blob(dir: &Path, name: &str, data: &[u8]) -> (PathBuf, String) {
        let p = dir.join(name);
        std::fs::write(&p, gz(data)).unwrap();
        (p, format!("sha256:test-{name}-{}", std::process::id()))
    }

    /// A follower started before the writer reads, while it writes in pieces, exactly the
    /// stream.
    #[test]
    fn follower_reads_the_copy_while_it_grows() {
        let dir = tempfile::tempdir().unwrap();
        let data = stream(3 << 20);
        let (path, digest) = blob(dir.path(), "grow", &data);
        let inf = Inflation::publish(&digest, tempfile::tempfile().unwrap());
        let mut f = follow(&digest, &path).unwrap();
        let writer = {
            let (inf, data) = (inf.clone(), data.clone());
            std::thread::spawn(move || {
                for piece in data.chunks(100_000) {
                    inf.append(piece).unwrap();
                }
                inf.complete(true);
            })
        };
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        writer.join().unwrap();
        assert_eq!(got, data);
        assert!(f.own.is_none(), "the blob was not inflated again");
        assert_eq!(inf.len(), data.len() as u64);
    }

    /// A copy given up half way, or finished before the stream's end, is followed to its
    /// end and then continued from the blob: the follower still reads exactly the stream.
    #[test]
    fn a_short_copy_is_continued_from_the_blob() {
        let dir = tempfile::tempdir().unwrap();
        let data = stream(1 << 20);
        for (name, end) in [("abandoned", None), ("stopped", Some(false))] {
            let (path, digest) = blob(dir.path(), name, &data);
            let inf = Inflation::publish(&digest, tempfile::tempfile().unwrap());
            inf.append(&data[..300_000]).unwrap();
            match end {
                None => inf.abandon(),
                Some(eof) => inf.complete(eof),
            }
            // Nothing is appended once it ended.
            inf.append(b"never").unwrap();
            let mut got = Vec::new();
            follow(&digest, &path)
                .unwrap()
                .read_to_end(&mut got)
                .unwrap();
            assert_eq!(got, data, "{name}");
        }
    }

    /// A blob shorter than what its copy says is an error naming the layer, not a short
    /// stream.
    #[test]
    fn a_blob_shorter_than_its_copy_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (path, digest) = blob(dir.path(), "short", b"tiny");
        let inf = Inflation::publish(&digest, tempfile::tempfile().unwrap());
        inf.append(&stream(10_000)).unwrap();
        inf.abandon();
        let e = follow(&digest, &path)
            .unwrap()
            .read_to_end(&mut Vec::new())
            .unwrap_err();
        assert!(e.to_string().contains(&digest), "{e}");
    }

    /// A copy reserved and then not written (its layer turned out plain, or is not kept) is
    /// abandoned when dropped: its follower reads the blob.
    #[test]
    fn a_reserved_copy_dropped_unwritten_sends_its_followers_to_the_blob() {
        let dir = tempfile::tempdir().unwrap();
        let data = stream(200_000);
        let (path, digest) = blob(dir.path(), "reserved", &data);
        let r = Reserved::new(&digest, tempfile::tempfile().unwrap());
        let (following, wait) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut f = follow(&digest, &path).unwrap();
            following.send(()).unwrap();
            let mut got = Vec::new();
            f.read_to_end(&mut got).unwrap();
            got
        });
        wait.recv().unwrap();
        drop(r);
        assert_eq!(reader.join().unwrap(), data);
        // Taken, it is the writer's: not abandoned.
        let (path, digest) = blob(dir.path(), "taken", &data);
        let inf = Reserved::new(&digest, tempfile::tempfile().unwrap())
            .take()
            .unwrap();
        inf.append(&data).unwrap();
        inf.complete(true);
        let mut got = Vec::new();
        let mut f = follow(&digest, &path).unwrap();
        f.read_to_end(&mut got).unwrap();
        assert!(got == data && f.own.is_none());
    }

    /// A copy is followed only while someone holds it; then readers inflate on their own.
    #[test]
    fn a_dropped_copy_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let (path, digest) = blob(dir.path(), "gone", b"data");
        let inf = Inflation::publish(&digest, tempfile::tempfile().unwrap());
        assert!(follow(&digest, &path).is_some());
        drop(inf);
        assert!(follow(&digest, &path).is_none());
    }
}
