//! Copies of blobs in the snapshot cache known to hold their blob without hashing them on
//! every start: [`holds`] and the stamp it keeps beside each copy.

use std::path::{Path, PathBuf};

/// Whether the file at `path` holds exactly the bytes of blob `digest`. Without reading it
/// when its stamp (`<path>.verified`, [`stamp_verified`]) names this digest and the file's
/// identity now; else it is read and hashed now, and stamped when it holds the blob. A
/// missing or unreadable file does not.
///
/// Why a stamp may stand for a hash: it is written only after the bytes were hashed, and it
/// names the file by device, inode, size, mtime and ctime (stat(2)). A copy replaced by
/// rename has another inode; a write in place moves mtime and ctime, and ctime cannot be set
/// back by any call (utimensat(2) sets it to now). What a stamp does not catch is what a
/// hash of the page cache would not either: media that rot under an unchanged inode.
/// Measured (issue 35, busybox snapshot, warm `kiln start`): hashing the 53 MB kernel took
/// about 100 ms of every start, before QEMU could be spawned.
pub(super) fn holds(path: &Path, digest: &kiln_store::BlobDigest) -> bool {
    if std::fs::read_to_string(stamp_path(path))
        .is_ok_and(|s| Some(s.trim()) == file_identity(path, digest).as_deref())
    {
        return true;
    }
    let ok = kiln_store::digest::Sha256Hash::of_file(path).is_ok_and(|h| h == digest.0);
    if ok {
        stamp_verified(path, digest);
    }
    ok
}

/// `<path>.verified`: where [`holds`] keeps what it last verified of `path`.
fn stamp_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".verified");
    PathBuf::from(p)
}

/// The stamp of `path` holding `digest`: the digest, then the file's device, inode, size,
/// mtime and ctime (seconds and nanoseconds), space-separated; `None` when `path` cannot be
/// stat'ed.
fn file_identity(path: &Path, digest: &kiln_store::BlobDigest) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(format!(
        "{digest} {} {} {} {} {} {} {}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

/// Records that `path` was just verified to hold `digest` ([`holds`]), replacing the stamp
/// ([`crate::replace_file`]). A stamp that cannot be written is only
/// logged: the next start hashes the file again.
pub(super) fn stamp_verified(path: &Path, digest: &kiln_store::BlobDigest) {
    let Some(line) = file_identity(path, digest) else {
        return;
    };
    let stamp = stamp_path(path);
    if let Err(e) = crate::replace_file(&stamp, line.as_bytes()) {
        tracing::debug!(path = %stamp.display(), error = %e, "not stamping a verified copy");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_stamp_stands_for_a_hash_only_while_the_file_is_the_one_hashed() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("vmlinux");
        std::fs::write(&f, b"kernel bytes").unwrap();
        let digest = kiln_store::BlobDigest(kiln_store::digest::Sha256Hash::of(b"kernel bytes"));
        let other = kiln_store::BlobDigest(kiln_store::digest::Sha256Hash::of(b"other"));
        assert!(!holds(&f, &other), "another blob's digest");
        assert!(
            !stamp_path(&f).exists(),
            "no stamp for a file that does not hold it"
        );
        assert!(holds(&f, &digest));
        let stamp = std::fs::read_to_string(stamp_path(&f)).unwrap();
        assert!(stamp.starts_with(&digest.to_string()), "{stamp}");
        // The stamp answers now: a file whose bytes the hash would refuse but whose identity
        // is the stamped one cannot be made without changing ctime, so fake the stamp of a
        // file that does not hold the blob to show that it is trusted as written.
        let liar = d.path().join("liar");
        std::fs::write(&liar, b"not the kernel").unwrap();
        std::fs::write(stamp_path(&liar), file_identity(&liar, &digest).unwrap()).unwrap();
        assert!(
            holds(&liar, &digest),
            "a stamp matching the file is trusted"
        );
        // A write in place, even of the same length: mtime and ctime move, the stamp no
        // longer matches, and the hash refuses it.
        std::thread::sleep(Duration::from_millis(10));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .write_all_at(b"K", 0)
            .unwrap();
        assert!(!holds(&f, &digest), "changed in place");
        // Replaced by rename with the right bytes: another inode, hashed again and stamped.
        let tmp = d.path().join("vmlinux.tmp");
        std::fs::write(&tmp, b"kernel bytes").unwrap();
        std::fs::rename(&tmp, &f).unwrap();
        assert!(holds(&f, &digest));
        assert_ne!(std::fs::read_to_string(stamp_path(&f)).unwrap(), stamp);
        // A stamp naming another digest does not stand for this one.
        std::fs::write(stamp_path(&f), file_identity(&f, &other).unwrap()).unwrap();
        assert!(holds(&f, &digest), "hashed again");
        assert!(
            std::fs::read_to_string(stamp_path(&f))
                .unwrap()
                .starts_with(&digest.to_string())
        );
    }
}
