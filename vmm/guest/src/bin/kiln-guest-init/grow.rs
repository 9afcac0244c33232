//! Growing the root file system online, after the host grew the root disk (`kiln start
//! --disk-mib`, carried by `restore` as [`kiln_guest::protocol::Restore::disk_bytes`]).
//!
//! The host grows the disk with QMP `block_resize` once the clone runs; QEMU then tells the
//! guest's virtio-blk driver that its capacity changed (a configuration-change interrupt,
//! virtio spec 1.2 §2.5.2 and §5.2.4), and the driver updates the block device's size from a
//! work queue, so the new size shows up a little after the resize returns. This module waits
//! for it (seeking to the end of the root device, which reports the block device's current
//! size), then grows the mounted ext4 with `EXT4_IOC_RESIZE_FS`: "Resize the filesystem to a
//! new size. The number of blocks of resized filesystem is passed in via 64 bit integer
//! argument" (Linux `Documentation/admin-guide/ext4.rst`, "ioctls"; before 4.19
//! `Documentation/filesystems/ext4.txt`, "Table of Ext4 specific ioctls"). The kernel adds
//! the block groups itself (with `resize_inode`, which kiln's images have, into the
//! reserved GDT blocks); no `resize2fs` is needed in the image.

use std::fs;
use std::io::{self, Seek, SeekFrom};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::log;

/// How long to wait for the root device to show the size the host asked for.
const DEVICE_WAIT: Duration = Duration::from_secs(10);

/// Why the root file system could not be grown.
#[derive(Debug, thiserror::Error)]
pub enum GrowError {
    /// The root device could not be read.
    #[error("{device}: {source}")]
    Device {
        /// The root device.
        device: String,
        /// Why.
        source: io::Error,
    },
    /// The device did not reach the size in time.
    #[error(
        "{device} is {have} bytes after {ms} ms, the host grew it to {want} bytes (no capacity change reached the guest)"
    )]
    NotGrown {
        /// The root device.
        device: String,
        /// Its size now, bytes.
        have: u64,
        /// The size asked for, bytes.
        want: u64,
        /// How long we waited.
        ms: u128,
    },
    /// statfs(2) or `EXT4_IOC_RESIZE_FS` on `/` failed.
    #[error("{what} on /: {source}")]
    Resize {
        /// Which call.
        what: &'static str,
        /// Why.
        source: io::Error,
    },
}

/// The size of the block device `device`, bytes (lseek to its end).
fn device_bytes(device: &Path) -> io::Result<u64> {
    fs::File::open(device)?.seek(SeekFrom::End(0))
}

/// Waits (up to [`DEVICE_WAIT`]) until `device` is at least `want` bytes, then grows the
/// ext4 mounted at `/` to the device's whole size (in whole file system blocks). Returns the
/// file system's size afterwards (statfs(2) `f_blocks × f_bsize`, bytes: what `df` shows,
/// which excludes the file system's own metadata).
///
/// Errors: [`GrowError`] naming the device or the call.
pub fn grow_root(device: &str, want: u64) -> Result<u64, GrowError> {
    let dev = Path::new(device);
    let dev_err = |source| GrowError::Device {
        device: device.to_string(),
        source,
    };
    let t0 = Instant::now();
    let have = loop {
        let have = device_bytes(dev).map_err(dev_err)?;
        if have >= want {
            break have;
        }
        if t0.elapsed() > DEVICE_WAIT {
            return Err(GrowError::NotGrown {
                device: device.to_string(),
                have,
                want,
                ms: t0.elapsed().as_millis(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let root = fs::File::open("/").map_err(|source| GrowError::Resize {
        what: "open",
        source,
    })?;
    let st = rustix::fs::fstatfs(&root).map_err(|e| GrowError::Resize {
        what: "statfs",
        source: e.into(),
    })?;
    let block = st.f_bsize as u64;
    let blocks = have / block;
    rustix::fs::ext4_ioc_resize_fs(&root, blocks).map_err(|e| GrowError::Resize {
        what: "EXT4_IOC_RESIZE_FS",
        source: e.into(),
    })?;
    let st = rustix::fs::fstatfs(&root).map_err(|e| GrowError::Resize {
        what: "statfs",
        source: e.into(),
    })?;
    let fs_bytes = st.f_blocks * st.f_bsize as u64;
    log!(
        "grew / to {blocks} blocks of {block} bytes ({device} is {have} bytes; df size {fs_bytes}) in {} ms",
        t0.elapsed().as_millis()
    );
    Ok(fs_bytes)
}
