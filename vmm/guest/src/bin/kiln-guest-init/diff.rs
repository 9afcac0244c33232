//! `diff`: a build step's VM sends its changes, the overlay's upper directory, to the host.
//!
//! 1. Every process but the init is killed (`kill(-1, SIGKILL)`), and the init waits (up to
//!    [`QUIET_WAIT`]) until `/proc` lists none but kernel threads and zombies, so nothing
//!    writes while the tree is read; then `sync`.
//! 2. The upper directory (kept open since boot, [`crate::boot::step_upper`]) is walked in
//!    name order and written as an uncompressed tar stream in OCI layer form (image spec
//!    `layer.md`, "Whiteouts"; Linux `Documentation/filesystems/overlayfs.rst`): a character
//!    device 0/0 named `x` becomes an empty regular file `.wh.x`, a directory with the xattr
//!    `trusted.overlay.opaque=y` gets an empty `.wh..wh..opq` right after it, and no
//!    `trusted.overlay.*` xattr is written; other xattrs go as PAX `SCHILY.xattr.*` records.
//!    Owners, permission bits and mtimes (seconds) are the files' own; a file with several
//!    links is written once, the other names as hard links to it. Sockets are skipped.
//! 3. The stream goes out as `diff_data` frames of at most [`MAX_CHUNK_LEN`] bytes, numbered
//!    from 0, and one `diff_end` with the count and the bytes, or the error that cut it.
//!
//! The host trusts none of it: it bounds the stream and unpacks it with its own layer reader.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kiln_guest::protocol::{DiffData, DiffEnd, MAX_CHUNK_LEN, MAX_ERROR_LEN, Message};

use crate::log;
use crate::serve::Sender;

/// How long the init waits for killed processes to go before it reads the tree anyway.
const QUIET_WAIT: Duration = Duration::from_secs(5);
/// `PF_KTHREAD` (include/linux/sched.h): the `flags` field of `/proc/<pid>/stat` marks a
/// kernel thread.
const PF_KTHREAD: u64 = 0x0020_0000;
/// overlayfs' xattr namespace, never written.
const OVERLAY_XATTRS: &[u8] = b"trusted.overlay.";
/// overlayfs' opaque directory marker.
const OPAQUE: &str = "trusted.overlay.opaque";

/// Answers a `diff` on a thread of its own.
pub fn start(tx: Sender) {
    std::thread::spawn(move || {
        let mut out = Chunks {
            tx: &tx,
            seq: 0,
            bytes: 0,
            buf: Vec::with_capacity(MAX_CHUNK_LEN),
        };
        let r = run(&mut out);
        let error = match r {
            Ok(()) => None,
            Err(e) => {
                log!("diff: {e}");
                let mut m = e.to_string();
                m.truncate(MAX_ERROR_LEN.min(m.len()));
                while !m.is_char_boundary(m.len()) {
                    m.pop();
                }
                Some(m)
            }
        };
        let (seq, bytes) = (out.seq, out.bytes);
        log!("diff: {seq} frames, {bytes} bytes");
        tx.send(&Message::DiffEnd(DiffEnd { seq, bytes, error }));
    });
}

fn run(out: &mut Chunks<'_>) -> io::Result<()> {
    let Some(upper) = crate::boot::step_upper() else {
        return Err(io::Error::other("not a build step's VM (no kiln.step=)"));
    };
    end_all_processes();
    let root = PathBuf::from(format!("/proc/self/fd/{}", upper.as_raw_fd()));
    let mut b = tar::Builder::new(&mut *out);
    let mut links = HashMap::new();
    walk(&mut b, &root, Path::new(""), &mut links)?;
    b.finish()?;
    drop(b);
    out.flush_all()
}

/// Kills every process but the init and waits until none is left (see the module doc).
fn end_all_processes() {
    // SAFETY: kill(2) with pid -1 signals every process but the caller and init.
    unsafe { libc::kill(-1, libc::SIGKILL) };
    let start = Instant::now();
    while start.elapsed() < QUIET_WAIT && others_alive() {
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: sync(2) has no arguments.
    unsafe { libc::sync() };
}

/// Whether `/proc` lists a process other than the init that is neither a kernel thread nor
/// a zombie.
fn others_alive() -> bool {
    let Ok(dir) = fs::read_dir("/proc") else {
        return false;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == 1 {
            continue;
        }
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp session tty_nr tpgid flags …; comm may hold anything.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let f: Vec<&str> = rest.split_ascii_whitespace().collect();
        let state = f.first().copied().unwrap_or("");
        let flags: u64 = f.get(6).and_then(|x| x.parse().ok()).unwrap_or(0);
        if flags & PF_KTHREAD != 0 || state == "Z" || state == "X" {
            continue;
        }
        return true;
    }
    false
}

/// The tar stream as `diff_data` frames.
struct Chunks<'a> {
    tx: &'a Sender,
    seq: u64,
    bytes: u64,
    buf: Vec<u8>,
}

impl Chunks<'_> {
    fn send(&mut self, n: usize) {
        let data: Vec<u8> = self.buf.drain(..n).collect();
        self.bytes += data.len() as u64;
        self.tx.send(&Message::DiffData(DiffData {
            seq: self.seq,
            data,
        }));
        self.seq += 1;
    }

    fn flush_all(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.send(self.buf.len());
        }
        Ok(())
    }
}

impl Write for Chunks<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        while self.buf.len() >= MAX_CHUNK_LEN {
            self.send(MAX_CHUNK_LEN);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The xattrs of `path` (not followed) but overlayfs' own, sorted by name.
fn xattrs(path: &Path) -> io::Result<Vec<(String, Vec<u8>)>> {
    let mut names = vec![0u8; 64 << 10];
    let n = match rustix::fs::llistxattr(path, &mut names[..]) {
        Ok(n) => n,
        Err(rustix::io::Errno::NOTSUP) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if name.starts_with(OVERLAY_XATTRS) {
            continue;
        }
        let mut value = vec![0u8; 64 << 10];
        let len = rustix::fs::lgetxattr(path, std::ffi::OsStr::from_bytes(name), &mut value[..])?;
        value.truncate(len);
        out.push((String::from_utf8_lossy(name).into_owned(), value));
    }
    out.sort();
    Ok(out)
}

fn is_opaque(path: &Path) -> bool {
    let mut v = [0u8; 4];
    matches!(rustix::fs::lgetxattr(path, OPAQUE, &mut v[..]), Ok(1) if v[0] == b'y')
}

/// An empty regular file entry named `name` (a whiteout marker).
fn marker(b: &mut tar::Builder<&mut Chunks<'_>>, name: &Path, mtime: u64) -> io::Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(mtime);
    h.set_size(0);
    b.append_data(&mut h, name, io::empty())
}

fn walk(
    b: &mut tar::Builder<&mut Chunks<'_>>,
    abs: &Path,
    rel: &Path,
    links: &mut HashMap<(u64, u64), PathBuf>,
) -> io::Result<()> {
    let mut names: Vec<OsString> = fs::read_dir(abs)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for name in names {
        let path = abs.join(&name);
        let name_rel = rel.join(&name);
        let md = fs::symlink_metadata(&path)?;
        let ft = md.file_type();
        let mtime = md.mtime().max(0) as u64;
        if ft.is_char_device() && md.rdev() == 0 {
            let mut wh = OsString::from(".wh.");
            wh.push(&name);
            marker(b, &rel.join(wh), mtime)?;
            continue;
        }
        if ft.is_socket() {
            continue;
        }
        let ext = xattrs(&path)?;
        if !ext.is_empty() {
            let records: Vec<(String, Vec<u8>)> = ext
                .into_iter()
                .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v))
                .collect();
            b.append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), v.as_slice())))?;
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(md.mode() & 0o7777);
        h.set_uid(md.uid().into());
        h.set_gid(md.gid().into());
        h.set_mtime(mtime);
        h.set_size(0);
        if ft.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            b.append_data(&mut h, &name_rel, io::empty())?;
            if is_opaque(&path) {
                marker(b, &name_rel.join(".wh..wh..opq"), mtime)?;
            }
            walk(b, &path, &name_rel, links)?;
        } else if ft.is_symlink() {
            h.set_entry_type(tar::EntryType::Symlink);
            let target = fs::read_link(&path)?;
            b.append_link(&mut h, &name_rel, &target)?;
        } else if ft.is_file() {
            if md.nlink() > 1 {
                if let Some(first) = links.get(&(md.dev(), md.ino())) {
                    h.set_entry_type(tar::EntryType::Link);
                    b.append_link(&mut h, &name_rel, first)?;
                    continue;
                }
                links.insert((md.dev(), md.ino()), name_rel.clone());
            }
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(md.len());
            let f = fs::File::open(&path)?;
            b.append_data(&mut h, &name_rel, f)?;
        } else {
            h.set_entry_type(if ft.is_char_device() {
                tar::EntryType::Char
            } else if ft.is_block_device() {
                tar::EntryType::Block
            } else {
                tar::EntryType::Fifo
            });
            if ft.is_char_device() || ft.is_block_device() {
                let rdev = md.rdev();
                h.set_device_major(libc::major(rdev))?;
                h.set_device_minor(libc::minor(rdev))?;
            }
            b.append_data(&mut h, &name_rel, io::empty())?;
        }
    }
    Ok(())
}
