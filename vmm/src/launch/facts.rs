//! What a QEMU binary says of itself, remembered per host: its version (`--version`, for
//! [`Host`]) and its jail's root plan (`ldd` and `-L help`, [`crate::jail::root`]). Each of
//! those is a process run before every QEMU of a `kiln start`: measured under load (issue
//! 35, busybox snapshot, `strace -f -tt` of a warm start), 100, 50 and 90 ms, one after the
//! other; quiet, 10–30 ms each.
//!
//! The file (JSON, at most [`FACTS_MAX`] bytes) holds a [`BinaryKey`] and the [`Facts`]
//! learnt under it. A file whose key is not this binary's now, or that is unreadable or not
//! the expected JSON, is ignored: the facts are read again and the file replaced (written to
//! a temporary name in the same directory and renamed over it, so a reader never sees half
//! a file). Two processes updating it at once may each lose the other's field: it is then
//! read again by a later start. A failure to write it is logged, never an error.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{LaunchError, io_err};
use crate::jail::root::RootPlan;

/// Largest facts (or probe) file read, bytes: far above what either holds (a root plan of
/// QEMU 10.0 on Debian 12 is about 5 KiB).
pub(crate) const FACTS_MAX: u64 = 64 << 10;

/// What the facts were read from: the binary (resolved path, device, inode, size, mtime and
/// ctime, stat(2)), the dynamic loader's cache `ldd` consults (`/etc/ld.so.cache`: size and
/// mtime, `None` when absent) and the host's boot. A new QEMU package replaces the binary
/// (another inode); a library installed or removed runs ldconfig(8), which rewrites the
/// cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BinaryKey {
    /// The host's boot id (random(4)).
    pub boot_id: String,
    /// The binary, absolute.
    pub path: PathBuf,
    /// stat(2) of the binary: `st_dev`, `st_ino`, `st_size`, mtime and ctime (seconds,
    /// nanoseconds).
    pub stat: (u64, u64, u64, (i64, i64), (i64, i64)),
    /// `/etc/ld.so.cache`'s size and mtime (seconds, nanoseconds).
    pub ld_cache: Option<(u64, (i64, i64))>,
}

/// The loader's cache ([`BinaryKey::ld_cache`]).
const LD_CACHE: &str = "/etc/ld.so.cache";

impl BinaryKey {
    /// The key of `program` (a bare name is looked up in `PATH`) now; `None` when a part of
    /// it cannot be read (then nothing is remembered).
    pub fn current(program: &Path) -> Option<BinaryKey> {
        use std::os::unix::fs::MetadataExt;
        let path = super::resolve_program(program)?;
        let m = std::fs::metadata(&path).ok()?;
        let boot_id = std::fs::read_to_string(super::probe::BOOT_ID)
            .ok()?
            .trim()
            .to_string();
        let ld_cache = match std::fs::metadata(LD_CACHE) {
            Ok(c) => Some((c.size(), (c.mtime(), c.mtime_nsec()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(_) => return None,
        };
        Some(BinaryKey {
            boot_id,
            stat: (
                m.dev(),
                m.ino(),
                m.size(),
                (m.mtime(), m.mtime_nsec()),
                (m.ctime(), m.ctime_nsec()),
            ),
            path,
            ld_cache,
        })
    }
}

/// What has been learnt of one binary; each field `None` until first read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Facts {
    /// [`Host::qemu_version`](super::Host::qemu_version).
    pub version: Option<String>,
    /// Its jail's root plan ([`crate::jail::root::plan_for`]).
    pub plan: Option<RootPlan>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Cached {
    key: BinaryKey,
    facts: Facts,
}

/// The facts `file` holds for `key`; empty when it holds none for it.
pub fn read(file: &Path, key: &BinaryKey) -> Facts {
    match read_json::<Cached>(file) {
        Some(c) if c.key == *key => c.facts,
        _ => Facts::default(),
    }
}

/// Sets what `learn` sets in the facts `file` holds for `key` (starting from none when it
/// holds another key's). Never fails: a file that cannot be written is logged.
pub fn update(file: &Path, key: &BinaryKey, learn: impl FnOnce(&mut Facts)) {
    let mut facts = read(file, key);
    learn(&mut facts);
    let c = Cached {
        key: key.clone(),
        facts,
    };
    if let Err(e) = write_json(file, &c) {
        tracing::warn!(error = %e, "not remembering QEMU's facts");
    }
}

/// `file` as JSON of a `T`, at most [`FACTS_MAX`] bytes read; `None` when it is missing,
/// unreadable or not a `T` (logged at debug).
pub(crate) fn read_json<T: DeserializeOwned>(file: &Path) -> Option<T> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(file)
        .ok()?
        .take(FACTS_MAX)
        .read_to_end(&mut bytes)
        .ok()?;
    serde_json::from_slice(&bytes)
        .inspect_err(|e| tracing::debug!(file = %file.display(), error = %e, "ignoring a corrupt cache file"))
        .ok()
}

/// Replaces `file` with `value` as JSON ([`crate::replace_file`]; its directory made
/// first).
///
/// Errors: the directory, the write or the rename ([`LaunchError::Io`]).
pub(crate) fn write_json<T: Serialize>(file: &Path, value: &T) -> Result<(), LaunchError> {
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    // Serializing strings, paths and integers cannot fail.
    let bytes = serde_json::to_vec_pretty(value).unwrap_or_default();
    crate::replace_file(file, &bytes).map_err(io_err(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> RootPlan {
        RootPlan {
            exe: "/usr/bin/qemu-system-x86_64".into(),
            files: vec!["/usr/bin/qemu-system-x86_64".into(), "/lib/x.so".into()],
            dirs: vec!["/usr/share/qemu".into()],
        }
    }

    #[test]
    fn facts_are_kept_per_binary_and_merged_field_by_field() {
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("qemu");
        std::fs::write(&bin, b"#!/bin/sh\n").unwrap();
        let file = d.path().join("cache/qemu.json");
        let key = BinaryKey::current(&bin).expect("a key for a file that exists");
        assert_eq!(read(&file, &key), Facts::default(), "no file yet");
        update(&file, &key, |f| f.version = Some("10.0.2".into()));
        update(&file, &key, |f| f.plan = Some(plan()));
        let got = read(&file, &key);
        assert_eq!(got.version.as_deref(), Some("10.0.2"));
        assert_eq!(got.plan, Some(plan()));

        // Another binary at the same path (replaced by rename: another inode) learns afresh.
        let tmp = d.path().join("qemu.new");
        std::fs::write(&tmp, b"#!/bin/sh\n").unwrap();
        std::fs::rename(&tmp, &bin).unwrap();
        let key2 = BinaryKey::current(&bin).unwrap();
        assert_ne!(key, key2);
        assert_eq!(read(&file, &key2), Facts::default());
        update(&file, &key2, |f| f.version = Some("10.1.0".into()));
        assert_eq!(
            read(&file, &key2).plan,
            None,
            "the old binary's plan is not kept"
        );

        // A corrupt or oversized file is ignored, then replaced.
        std::fs::write(&file, b"{not json").unwrap();
        assert_eq!(read(&file, &key2), Facts::default());
        std::fs::write(&file, vec![b' '; FACTS_MAX as usize + 10]).unwrap();
        assert_eq!(read(&file, &key2), Facts::default());
        update(&file, &key2, |f| f.version = Some("10.1.0".into()));
        assert_eq!(read(&file, &key2).version.as_deref(), Some("10.1.0"));
    }

    #[test]
    fn no_key_for_a_binary_that_is_not_there() {
        assert_eq!(BinaryKey::current(Path::new("/nonexistent/qemu")), None);
        assert_eq!(
            BinaryKey::current(Path::new("kiln-no-such-program-on-path")),
            None
        );
    }
}
