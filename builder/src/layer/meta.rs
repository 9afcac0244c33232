//! An entry's name and metadata as a layer gives them: components, owners, mode, times
//! and the xattrs kept.

use super::*;

/// Splits an entry name (or a hard link's target) into its components, relative to the
/// root: empty and `.` components, leading `/`s included, are dropped, so `/`, `./` and `//`
/// name the root and `/etc/x` is `etc/x`; a `..` component is refused, and so is a NUL
/// byte (no Linux file name holds one; a C reader of the same stream, such as libarchive
/// under `mke2fs -d`, would cut the name there and see another file).
pub(crate) fn split_name(name: &[u8]) -> Split {
    if name.contains(&0) {
        return Split::Nul;
    }
    let mut out = Vec::new();
    for c in name.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Split::DotDot,
            c => out.push(c.to_vec()),
        }
    }
    Split::Ok(out)
}

pub(super) fn os(c: &[u8]) -> &OsStr {
    OsStr::from_bytes(c)
}

/// Metadata of one layer entry as [`read_meta`] reads it: the header's fields with PAX
/// overrides applied. The ext4 flattener carries the same type (`ext4::Meta`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits (`& 0o7777`: setuid, setgid and sticky included).
    pub mode: u32,
    /// Owner, a valid Linux uid ([`owner_id`]).
    pub uid: u32,
    /// Group, a valid Linux gid.
    pub gid: u32,
    /// Modification time, seconds since the epoch (PAX `mtime`, fraction dropped).
    pub mtime: u64,
    /// Extended attributes kept ([`keep_xattr`]), in stream order, each name once (a
    /// repeated name keeps its last value, as setting them in order would).
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Reads one entry's metadata: the one reader of owners, modes, times and xattrs that layer
/// apply and the ext4 flattener share, so that they cannot diverge. PAX `uid`/`gid` override
/// the header's, `mtime` too, `SCHILY.xattr.*` records give the xattrs (POSIX.1-2008 pax
/// format; the xattr key form is GNU tar's and star's).
///
/// Errors (`InvalidData`): an owner id that is not a Linux id ([`owner_id`]), a PAX
/// `uid`/`gid` that is not a number, a PAX sparse file (`GNU.sparse.*` records), a link
/// target holding a NUL byte (as a name, [`split_name`]); the header's own read errors.
pub(crate) fn read_meta(entry: &mut tar::Entry<'_, impl Read>) -> io::Result<Meta> {
    if entry.link_name_bytes().is_some_and(|l| l.contains(&0)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "link target holds a NUL byte",
        ));
    }
    let h = entry.header();
    let mut m = Meta {
        mode: h.mode()? & 0o7777,
        uid: owner_id("uid", h.uid()?)?,
        gid: owner_id("gid", h.gid()?)?,
        mtime: h.mtime()?,
        xattrs: Vec::new(),
    };
    if let Some(exts) = entry.pax_extensions()? {
        for ext in exts {
            let ext = ext?;
            let key = ext.key_bytes();
            let val = ext.value_bytes();
            let num = || {
                std::str::from_utf8(val)
                    .ok()
                    .and_then(|s| s.split('.').next())
                    .and_then(|s| s.parse::<u64>().ok())
            };
            match key {
                b"uid" | b"gid" => {
                    let what = if key == b"uid" { "uid" } else { "gid" };
                    let v = num().ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("PAX {what} is not a number"),
                        )
                    })?;
                    let id = owner_id(what, v)?;
                    if key == b"uid" {
                        m.uid = id;
                    } else {
                        m.gid = id;
                    }
                }
                b"mtime" => m.mtime = num().unwrap_or(m.mtime),
                // PAX sparse files (GNU tar manual, "Sparse Formats": 0.0, 0.1 and 1.0, as
                // `tar --posix --sparse` writes) are regular files whose name and data hide a
                // map; read as plain files they would land as `GNUSparseFile.N/...` holding
                // the map. The tar crate does not read them, so they are refused.
                k if k.starts_with(b"GNU.sparse.") => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "a PAX sparse file (record {}): not supported; expected a plain file or an old GNU sparse ('S') entry",
                            String::from_utf8_lossy(k)
                        ),
                    ));
                }
                k if k.starts_with(b"SCHILY.xattr.") => {
                    let name = &k[b"SCHILY.xattr.".len()..];
                    if keep_xattr(name) {
                        m.xattrs.retain(|(n, _)| n != name);
                        m.xattrs.push((name.to_vec(), val.to_vec()));
                    }
                }
                _ => {}
            }
        }
    }
    // `user.*` xattrs exist on regular files and directories only (xattr(7)): the kernel
    // refuses them on a symlink, device or FIFO (`EPERM`), and containerd drops them there.
    // Dropped here, in the one reader, so that the applier does not refuse a layer whose
    // xattr the flattener would write into the image.
    use tar::EntryType as T;
    if !matches!(
        entry.header().entry_type(),
        T::Regular | T::Continuous | T::GNUSparse | T::Directory
    ) {
        m.xattrs.retain(|(n, _)| !n.starts_with(b"user."));
    }
    Ok(m)
}

/// A tar owner id as a Linux uid/gid. Ids that do not fit 32 bits would wrap (4294967296 is
/// root), and 4294967295 is `(uid_t)-1`, which `chown` reads as "leave unchanged": both are
/// refused as invalid data rather than truncated.
pub(super) fn owner_id(what: &str, v: u64) -> io::Result<u32> {
    u32::try_from(v)
        .ok()
        .filter(|&id| id != u32::MAX)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{what} {v} is not a valid id (0 to 4294967294)"),
            )
        })
}

/// Whether an xattr from a layer is applied: `system.*` (ACLs are kernel-encoded) and
/// `security.selinux` (host policy) are not, as umoci and containerd skip them; nor are
/// overlayfs's own `trusted.overlay.*` and `user.overlay.*` (opaque, redirect, metacopy,
/// origin...: Linux `Documentation/filesystems/overlayfs.rst`), which would change what an
/// overlay mounted over the unpacked tree shows (a planted `redirect` or `metacopy` points it
/// at other files). Whiteouts reach the tree only through the OCI `.wh.` entries.
pub(crate) fn keep_xattr(name: &[u8]) -> bool {
    !(name.starts_with(b"system.")
        || name == b"security.selinux"
        || name.starts_with(b"trusted.overlay.")
        || name.starts_with(b"user.overlay."))
}
