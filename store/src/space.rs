//! A full host file system (`ENOSPC`, "No space left on device") reported as what it is: the
//! path being written and the free space of the file system holding it, measured when the
//! error is made. Never retried: a bigger attempt cannot fit where a smaller one did not.
//! Used by the local backend and by the builder (layers, ext4 images).

use std::path::{Path, PathBuf};

/// The host file system holding `path` ran out of space while kiln wrote `path`.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "no space left on device: {what} {}: {}{}",
    path.display(),
    free_text(*free_bytes, *total_bytes),
    needs_text(*needs_bytes)
)]
pub struct NoSpace {
    /// What was being done (`writing the ext4 image`).
    pub what: &'static str,
    /// The file being written.
    pub path: PathBuf,
    /// Bytes available on its file system (`statvfs` `f_bavail × f_frsize`, what `df` calls
    /// available); `None` when `statvfs` failed.
    pub free_bytes: Option<u64>,
    /// Size of that file system in bytes (`f_blocks × f_frsize`).
    pub total_bytes: Option<u64>,
    /// About how many bytes the write needed, when known.
    pub needs_bytes: Option<u64>,
}

impl NoSpace {
    /// Measures the file system holding `path` (its nearest existing ancestor) now.
    pub fn at(what: &'static str, path: &Path, needs_bytes: Option<u64>) -> Self {
        let fs = path.ancestors().find_map(|p| rustix::fs::statvfs(p).ok());
        NoSpace {
            what,
            path: path.to_path_buf(),
            free_bytes: fs.as_ref().map(|s| s.f_bavail.saturating_mul(s.f_frsize)),
            total_bytes: fs.as_ref().map(|s| s.f_blocks.saturating_mul(s.f_frsize)),
            needs_bytes,
        }
    }
}

/// Whether an I/O error is `ENOSPC` (also when wrapped by a library that kept its kind,
/// [`std::io::ErrorKind::StorageFull`]).
pub fn is_no_space(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error())
        || e.kind() == std::io::ErrorKind::StorageFull
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn free_text(free: Option<u64>, total: Option<u64>) -> String {
    match (free, total) {
        (Some(f), Some(t)) => format!(
            "the file system holding it has {} free of {}",
            mib(f),
            mib(t)
        ),
        _ => "the free space of the file system holding it is unknown".to_string(),
    }
}

fn needs_text(needs: Option<u64>) -> String {
    needs.map_or_else(String::new, |n| format!(" (about {} needed)", mib(n)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_path_and_the_free_space() {
        let d = tempfile::tempdir().unwrap();
        let e = NoSpace::at("writing", &d.path().join("not/yet/there"), Some(3 << 20));
        assert!(e.free_bytes.is_some() && e.total_bytes.is_some());
        let msg = e.to_string();
        assert!(
            msg.starts_with("no space left on device: writing ")
                && msg.contains("not/yet/there: the file system holding it has ")
                && msg.ends_with(" (about 3.0 MiB needed)"),
            "{msg}"
        );
        assert!(is_no_space(&std::io::Error::from_raw_os_error(28)));
        assert!(!is_no_space(&std::io::Error::from_raw_os_error(5)));
    }
}
