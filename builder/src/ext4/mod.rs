//! ext4 root file system images from an image's layers, deterministically, without root.
//!
//! [`build`] flattens the layer blobs ([`flatten`], bottom first, whiteouts applied) into one
//! tar stream written straight into `mke2fs -d -` (e2fsprogs ≥ 1.47.1 reads a tarball from
//! standard input when libarchive is installed; nothing is unpacked to disk and nothing is
//! mounted; each compressed layer is inflated once, its plain stream kept from the first
//! pass for the second in the build's scratch directory, within [`Keep::in_dir`]'s bound;
//! the first pass over a build's base image can run while its steps do, [`Prescan`] and
//! [`build_from`], and the steps' unpack of the base reads that pass's plain stream,
//! [`crate::layer::shared`]), then indexes its directories with `e2fsck -fpD` and checks the result with
//! `e2fsck -fn`; a failing check is an error. [`build_unchecked`] returns once the check has
//! started ([`Check`]), so that a publish chunks the image while it is checked and publishes
//! nothing made of it before the check passed. The e2fsprogs run with their syncs skipped
//! (`nosync`: every image is a scratch file the caller chunks into a store and removes).
//!
//! ## Directories
//! mke2fs 1.47.2 writes every directory of a tarball linear (no htree index, even with
//! `dir_index`), which makes lookups in a directory of thousands of entries a scan of all
//! its blocks, and it counts every subdirectory into its parent's link count, past the
//! 65,000 where ext4 with `dir_nlink` keeps 1 ([`LINK_MAX`]). So after mke2fs (and the
//! xattrs, below) one `debugfs -w` run sets the link count of each directory past
//! [`LINK_MAX`] to 1 ([`Flat::link_max_dirs`]), and `e2fsck -fpD` indexes every directory
//! of more than one block (hash-ordered with the pinned hash seed, so reproducible). That
//! pass must find nothing to repair (exit 0): anything it would fix is reported as
//! [`Ext4Error::Index`], not repaired silently. Its cost, measured (2026-12-01, 2-core
//! machine under a CI run, `nice -n 19`) on the Debian bookworm fixture's layer (6,688
//! inodes, 512 MiB image; `/usr/bin` was linear before): 0.7–1.3 s wall, 0.03 s CPU, against
//! 11 s for mke2fs and 0.1 s for `e2fsck -fn`.
//!
//! ## Determinism
//! The same layers and options give a byte-identical image (tested). What mke2fs would take
//! from the machine is pinned:
//! - a configuration file written by kiln ([`MKE2FS_CONF`], through `MKE2FS_CONFIG`), so the
//!   host's `/etc/mke2fs.conf` does not matter; the environment is cleared;
//! - the file system's identity: the UUID (`-U`), the metadata checksum seed and the
//!   directory hash seed (`-E hash_seed=`) are the same for every image kiln makes, derived
//!   from [`ROOTFS_SEED`] with sha256 ([`fs_uuid`], [`hash_seed`]); no caller chooses them
//!   ([`Ext4Options`] has no such field), so the CLI, the HTTP API and the nightly get the
//!   same bytes for the same layers. See [`ROOTFS_SEED`] for why it is one constant;
//! - every time mke2fs makes up (superblock times, inode crtime, lost+found, the root
//!   directory) comes from `E2FSPROGS_FAKE_TIME`, set to the build's `SOURCE_DATE_EPOCH` or
//!   [`DEFAULT_EPOCH`], and the superblock times `e2fsck -fpD` writes (last write, last
//!   check) from `E2FSCK_TIME`, set alike; file mtimes come from the layers (atime and ctime = mtime), clamped
//!   to `SOURCE_DATE_EPOCH` when the build sets one (then also passed to mke2fs, which in
//!   1.47.2 clamps every file time to it; without one it is not set, or the layers' times
//!   would be clamped to the default epoch);
//! - block size 4096 (`-b`: below 512 MiB mke2fs would pick 1 KiB), inode size 256, the
//!   inode count (`-N`), journal size (`-J size=`), reserved ratio 5% (`-m`), root owner 0:0
//!   (mke2fs would use the caller's uid), inode tables and journal zeroed at creation
//!   (`lazy_itable_init=0,lazy_journal_init=0`, so the guest kernel has nothing to write
//!   lazily after boot), `nodiscard`.
//!
//! ## Features ([`FEATURES`])
//! `sparse_super large_file filetype resize_inode dir_index ext_attr has_journal extent
//! huge_file flex_bg metadata_csum metadata_csum_seed 64bit dir_nlink extra_isize`: Debian
//! bookworm's ext4 set plus `metadata_csum_seed`, minus `orphan_file`. With
//! `metadata_csum_seed` the metadata checksums use the seed stored in the superblock
//! (`s_checksum_seed`, set by mke2fs to crc32c of the UUID it was made with) instead of the
//! UUID itself (kernel `Documentation/filesystems/ext4/superblock.rst`, `INCOMPAT_CSUM_SEED`),
//! so a copy of an image can be given its own UUID (`tune2fs -U random`) by rewriting the
//! superblock alone, not every checksummed block. Every feature is supported by Linux 6.1
//! (the guest kernel; `metadata_csum` since 3.18, `metadata_csum_seed` since 4.4) and by
//! e2fsprogs ≥ 1.43, so `resize2fs` on any current host can grow the image (`resize_inode`
//! reserves room for growth to 1024×). `orphan_file` (1.47) is left out so older e2fsprogs
//! can still check and resize the images. The list is recorded in the image manifest
//! ([`kiln_store::Filesystem`]).
//!
//! ## Size
//! [`Ext4Options::disk_mib`] when given (the recipe's `disk_mib`, the default image's 3072,
//! or `--disk-mib`); otherwise the smallest whole MiB that holds the tree plus headroom
//! ([`size_estimate`]): the tree's blocks (file data, directory blocks: one at least per
//! directory, an empty one too; long symlinks, xattr blocks) + 10% + 16 MiB (block group
//! metadata, reserved GDT blocks, allocation slack) + the journal + inode tables (256 bytes per inode, at least one inode per 16 KiB, at least
//! 1.25× the tree's inodes + 1024). A tree that does not fit the given or the largest allowed
//! size is [`Ext4Error::TooLarge`]: "image too large: needs N MiB, limit M MiB". If mke2fs
//! still runs out of room inside the image on a computed size ("Could not allocate"), the
//! build is retried at 1.5× (twice at most); when that is not enough, or on a given size,
//! the error is [`Ext4Error::ImageFull`], naming what ran out (blocks or inodes) and the
//! sizes tried, and [`Ext4Error::TooLarge`] only when the next size would pass the limit. A full host file system (`ENOSPC`, "No space
//! left on device") is [`Ext4Error::NoSpace`], with the image's path and the free space, and
//! is not retried.

mod flatten;
mod nosync;

pub use flatten::{Flat, FlatStats, KEEP_FREE_DIVISOR, Keep, LINK_MAX, MAX_SCAN_BYTES, Meta, Scan};

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use sha2::{Digest as _, Sha256};

use crate::layer::{LayerError, Limits};

/// Block size of every image, bytes.
pub const BLOCK_SIZE: u32 = 4096;
/// Inode size, bytes.
pub const INODE_SIZE: u32 = 256;
/// Bytes per inode at least (`-i`), i.e. one inode per 16 KiB.
pub const INODE_RATIO: u64 = 16384;
/// The pinned feature list (`mke2fs -O`), see the module doc.
pub const FEATURES: &[&str] = &[
    "sparse_super",
    "large_file",
    "filetype",
    "resize_inode",
    "dir_index",
    "ext_attr",
    "has_journal",
    "extent",
    "huge_file",
    "flex_bg",
    "metadata_csum",
    "metadata_csum_seed",
    "64bit",
    "dir_nlink",
    "extra_isize",
];
/// The seed of every image's file-system identity: its UUID ([`fs_uuid`]), through it the
/// metadata checksum seed, and its directory hash seed ([`hash_seed`]).
///
/// One constant, not a value per image, per base or per caller:
/// - with `metadata_csum` the UUID (or the checksum seed made from it) is in every inode,
///   directory, extent, bitmap and group descriptor checksum. A UUID per image digest made
///   about 1,200–1,500 scattered 4 KiB blocks differ between two builds of nearly the same
///   tree, so 14–23% of a rebuilt image's chunk bytes were new (issue 16); a UUID per base
///   image would do the same to every image when its base is rebuilt (a nightly), and would
///   keep images on different bases from sharing metadata chunks. A constant is trivially a
///   function of the build's inputs that every caller computes alike;
/// - what it costs: every kiln image has the same UUID. The guest mounts its root as
///   `/dev/vda`, never by UUID, and Linux's ext4 does not refuse two mounted file systems
///   of one UUID. A host that attaches two images at once and mounts by UUID (udev's
///   `/dev/disk/by-uuid` names one of them) must not rely on it; `tune2fs -U random` on a
///   copy gives it its own UUID cheaply ([`FEATURES`]: `metadata_csum_seed`);
/// - a known directory hash seed lets whoever writes a directory choose names that collide
///   in its htree index, which makes lookups in that directory slower (a linear scan of the
///   colliding blocks), never wrong. Image trees come from the recipe's own author, and in
///   the guest the seed is readable from the superblock by root anyway, so a secret seed
///   would protect nothing there.
///
/// A new value would be a new on-disk identity for every image: change it only with the
/// format.
pub const ROOTFS_SEED: &str = "kiln-rootfs-v1";
/// Version of what the flattener makes of given layers and options (the tar it feeds mke2fs,
/// the mke2fs arguments, the debugfs edits, the indexing pass): part of the publish's
/// flatten key ([`crate::publish::flatten_key`]), so an image cache entry made by another
/// version is not reused. Bump it with any change that makes the same inputs give other
/// image bytes.
pub const FLATTEN_VERSION: u32 = 2;
/// The epoch used when the build sets no `SOURCE_DATE_EPOCH`: 2024-01-01T00:00:00Z.
pub const DEFAULT_EPOCH: u64 = 1_704_067_200;
/// Largest computed image size, MiB (64 GiB).
pub const DEFAULT_MAX_MIB: u64 = 64 * 1024;
/// Oldest e2fsprogs that reads a tarball with `-d` (1.47.1; 1.47.0 cannot).
pub const MIN_E2FSPROGS: (u32, u32, u32) = (1, 47, 1);
/// What to install when tar input does not work.
pub const INSTALL_HINT: &str = "install e2fsprogs >= 1.47.1 and libarchive13 (Debian \
    bookworm: add bookworm-backports to the apt sources, then `apt-get install -t \
    bookworm-backports e2fsprogs libarchive13`; ci/setup.sh does this)";

/// The mke2fs configuration kiln runs with (`MKE2FS_CONFIG`), replacing the host's.
pub const MKE2FS_CONF: &str = "[defaults]
\tbase_features = sparse_super,large_file,filetype,resize_inode,dir_index,ext_attr
\tdefault_mntopts = acl,user_xattr
\tenable_periodic_fsck = 0
\tblocksize = 4096
\tinode_size = 256
\tinode_ratio = 16384
\treserved_ratio = 5.0
\thash_alg = half_md4
\terrors = continue

[fs_types]
\text4 = {
\t\tfeatures = has_journal,extent,huge_file,flex_bg,metadata_csum,metadata_csum_seed,64bit,dir_nlink,extra_isize
\t}
\tdefault = {
\t}
";

/// One layer blob: its digest (for errors) and where the verified file is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    /// `sha256:<hex>` of the blob.
    pub digest: String,
    /// The blob file (gzip, zstd or plain tar).
    pub path: PathBuf,
}

/// Options of [`build`].
#[derive(Debug, Clone)]
pub struct Ext4Options {
    /// Image size, MiB; `None`: computed ([`size_estimate`]).
    pub disk_mib: Option<u64>,
    /// Largest computed size, MiB (ignored when `disk_mib` is set).
    pub max_mib: u64,
    /// `SOURCE_DATE_EPOCH` of the build, seconds; `None`: [`DEFAULT_EPOCH`] for mke2fs's
    /// own times, and layer mtimes kept as they are.
    pub source_date_epoch: Option<u64>,
    /// Bounds applied to each layer while reading it.
    pub limits: Limits,
}

/// A built and checked image.
#[derive(Debug, Clone)]
pub struct Ext4Image {
    /// Size of the image file, bytes.
    pub size_bytes: u64,
    /// How it was made (recorded in the image manifest).
    pub filesystem: kiln_store::Filesystem,
    /// Counts of the flattened tree.
    pub stats: FlatStats,
    /// The size computation.
    pub estimate: SizeEstimate,
}

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Ext4Error {
    /// A layer is unreadable or hostile.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// e2fsprogs is missing, too old, or cannot read a tarball.
    #[error("{problem}: {INSTALL_HINT}")]
    Tools {
        /// What was found.
        problem: String,
    },
    /// The tree does not fit.
    #[error("image too large: needs {needs_mib} MiB, limit {limit_mib} MiB")]
    TooLarge {
        /// Estimated size needed, MiB.
        needs_mib: u64,
        /// The size asked for or the largest allowed, MiB.
        limit_mib: u64,
    },
    /// mke2fs ran out of blocks or inodes inside the image at the size asked for, or at
    /// every size tried although the estimate said the tree fits (the estimate is then
    /// wrong for this tree). Not a full host file system, and not "too large".
    #[error(
        "mke2fs ran out of {what} inside the image at {mib} MiB ({inodes} inodes; sizes \
         tried: {tried} MiB; estimated {estimate_mib} MiB, limit {limit_mib} MiB): {stderr}"
    )]
    ImageFull {
        /// `blocks` or `inodes` (from mke2fs's "Could not allocate block/inode"), or
        /// `blocks or inodes` when it says neither.
        what: &'static str,
        /// The last size tried, MiB.
        mib: u64,
        /// The inode count given to mke2fs at that size (`-N`).
        inodes: u64,
        /// Every size tried, MiB, comma-separated.
        tried: String,
        /// [`SizeEstimate::min_mib`].
        estimate_mib: u64,
        /// The size asked for or the largest allowed, MiB.
        limit_mib: u64,
        /// mke2fs's standard error (last 64 KiB).
        stderr: String,
    },
    /// `e2fsck -fpD` (indexing directories) found something to repair in the new image.
    #[error(
        "e2fsck -fpD (indexing directories) found problems in the new image ({status}): \
         {output}"
    )]
    Index {
        /// Exit status.
        status: String,
        /// Its output (last 64 KiB).
        output: String,
    },
    /// The host file system holding the image is full (not the image).
    #[error(transparent)]
    NoSpace(#[from] kiln_store::space::NoSpace),
    /// mke2fs failed.
    #[error("mke2fs failed ({status}): {stderr}")]
    Mke2fs {
        /// Exit status.
        status: String,
        /// Its standard error (last 64 KiB).
        stderr: String,
    },
    /// `e2fsck -fn` found a problem in the new image.
    #[error("e2fsck -fn found problems in the new image ({status}): {output}")]
    Fsck {
        /// Exit status.
        status: String,
        /// Its output (last 64 KiB).
        output: String,
    },
    /// debugfs failed to set an xattr mke2fs does not copy.
    #[error("debugfs could not set xattrs: {0}")]
    Debugfs(String),
    /// A layer blob read differently in the second pass than in the first.
    #[error("layer {0} changed while it was being read")]
    LayerChanged(String),
    /// The layers' names, link targets and xattrs together exceed what the scan may hold.
    #[error(
        "layer {digest}: entry {entry}: names, link targets and xattrs of the image exceed {limit} bytes"
    )]
    ScanTooLarge {
        /// Layer digest.
        digest: String,
        /// Entry being read.
        entry: String,
        /// [`MAX_SCAN_BYTES`].
        limit: u64,
    },
    /// An xattr name that is not UTF-8 (PAX records are UTF-8).
    #[error("{0}: an xattr name is not UTF-8")]
    XattrName(String),
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
}

impl Ext4Error {
    fn output(source: std::io::Error) -> Self {
        Ext4Error::Io {
            path: PathBuf::from("(flattened tar stream)"),
            source,
        }
    }
}

/// The e2fsprogs found by [`check_tools`].
#[derive(Debug, Clone)]
pub struct Tools {
    /// `mke2fs -V`'s version, e.g. `1.47.2`.
    pub version: String,
}

fn parse_version(s: &str) -> Option<(u32, u32, u32)> {
    let mut it = s.split('.').map(|p| p.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// The `PATH` e2fsprogs are run with: Debian installs them in `/sbin`, which a non-root
/// user's `PATH` lacks.
pub const TOOL_PATH: &str = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin";

/// A clean environment for e2fsprogs: `E2FSPROGS_FAKE_TIME` = `epoch` (mke2fs's own times),
/// `E2FSCK_TIME` = `epoch` (the superblock times a repairing e2fsck writes),
/// `SOURCE_DATE_EPOCH` only when the build sets one (mke2fs 1.47.2 then also clamps file
/// times to it, which [`Flat`] has already done), the pinned configuration when given; and
/// without syncs ([`nosync`]: the images are scratch files).
fn tool_env(cmd: &mut Command, epoch: u64, sde: Option<u64>, conf: Option<&Path>) {
    nosync::without_syncs(cmd);
    cmd.env_clear()
        .env("PATH", TOOL_PATH)
        .env("LC_ALL", "C")
        .env("E2FSPROGS_FAKE_TIME", epoch.to_string())
        .env("E2FSCK_TIME", epoch.to_string());
    if let Some(sde) = sde {
        cmd.env("SOURCE_DATE_EPOCH", sde.to_string());
    }
    if let Some(c) = conf {
        cmd.env("MKE2FS_CONFIG", c);
    }
}

fn tail(b: &[u8]) -> String {
    let s = &b[b.len().saturating_sub(64 << 10)..];
    String::from_utf8_lossy(s).trim().to_string()
}

/// Checks once per process that `mke2fs` is ≥ 1.47.1 and really reads a tarball on standard
/// input (it needs libarchive at run time), by making a tiny image from a one-file tar and
/// reading the file back with `debugfs`. Errors: [`Ext4Error::Tools`], saying what to install.
pub fn check_tools() -> Result<Tools, Ext4Error> {
    static CHECKED: OnceLock<Result<Tools, String>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            probe().map_err(|e| match e {
                Ext4Error::Tools { problem } => problem,
                other => other.to_string(),
            })
        })
        .clone()
        .map_err(|problem| Ext4Error::Tools { problem })
}

fn probe() -> Result<Tools, Ext4Error> {
    let tools = |problem: String| Ext4Error::Tools { problem };
    let mut cmd = Command::new("mke2fs");
    tool_env(&mut cmd, DEFAULT_EPOCH, None, None);
    let out = cmd
        .arg("-V")
        .output()
        .map_err(|e| tools(format!("cannot run mke2fs ({e})")))?;
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let version = text
        .split_whitespace()
        .skip_while(|w| *w != "mke2fs")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    match parse_version(&version) {
        Some(v) if v >= MIN_E2FSPROGS => {}
        _ => {
            return Err(tools(format!(
                "mke2fs {version:?} cannot read a tarball (1.47.1 or newer needed)"
            )));
        }
    }
    let dir = tempfile::tempdir().map_err(|source| Ext4Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let img = dir.path().join("probe.ext4");
    let conf = dir.path().join("mke2fs.conf");
    std::fs::write(&conf, MKE2FS_CONF).map_err(|source| Ext4Error::Io {
        path: conf.clone(),
        source,
    })?;
    let mut tar = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_size(5);
    h.set_mode(0o644);
    h.set_cksum();
    let io = |source| Ext4Error::Io {
        path: img.clone(),
        source,
    };
    tar.append_data(&mut h, "kiln-probe", &b"probe"[..])
        .map_err(io)?;
    let tar = tar.into_inner().map_err(io)?;
    let mut cmd = Command::new("mke2fs");
    tool_env(&mut cmd, DEFAULT_EPOCH, None, Some(&conf));
    cmd.args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d", "-"])
        .arg(&img)
        .arg("4M")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| tools(format!("cannot run mke2fs ({e})")))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(&tar);
    }
    let out = child.wait_with_output().map_err(io)?;
    if !out.status.success() {
        return Err(tools(format!(
            "mke2fs {version} cannot read a tarball ({})",
            tail(&out.stderr)
        )));
    }
    let mut cmd = Command::new("debugfs");
    tool_env(&mut cmd, DEFAULT_EPOCH, None, None);
    let out = cmd
        .args(["-R", "cat /kiln-probe"])
        .arg(&img)
        .output()
        .map_err(|e| tools(format!("cannot run debugfs ({e})")))?;
    if out.stdout != b"probe" {
        return Err(tools(format!(
            "mke2fs {version} made an image without the tarball's file ({})",
            tail(&out.stderr)
        )));
    }
    Ok(Tools { version })
}

/// Reads the regular file at absolute `path` from the ext4 image file `image` without
/// mounting it, with `debugfs -R "cat PATH"` (e2fsprogs' debugfs(8)). Returns `None` when the
/// image has no such file. Errors: [`Ext4Error::Debugfs`] for a path debugfs cannot quote
/// (whitespace, quotes, not absolute) or any other debugfs complaint, [`Ext4Error::Tools`] when
/// debugfs cannot run. At most `limit` bytes are kept; a longer file is an error.
pub fn read_file(image: &Path, path: &str, limit: usize) -> Result<Option<Vec<u8>>, Ext4Error> {
    if !path.starts_with('/')
        || path
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '\'' || c == '\\')
    {
        return Err(Ext4Error::Debugfs(format!(
            "{path:?}: not an absolute path debugfs can read"
        )));
    }
    let mut cmd = Command::new("debugfs");
    tool_env(&mut cmd, DEFAULT_EPOCH, None, None);
    let out = cmd
        .arg("-R")
        .arg(format!("cat {path}"))
        .arg(image)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Ext4Error::Tools {
            problem: format!("cannot run debugfs ({e})"),
        })?;
    let complaint = debugfs_complaints(&out.stderr);
    if complaint.contains("File not found by ext2_lookup") {
        return Ok(None);
    }
    if !out.status.success() || !complaint.is_empty() {
        return Err(Ext4Error::Debugfs(format!(
            "{}: cat {path}: {complaint} ({})",
            image.display(),
            out.status
        )));
    }
    if out.stdout.len() > limit {
        return Err(Ext4Error::Debugfs(format!(
            "{}: {path} is larger than {limit} bytes",
            image.display()
        )));
    }
    Ok(Some(out.stdout))
}
/// The UUID of an image: the first 16 bytes of sha256(`kiln-ext4-uuid:` + seed), marked as a
/// version 4 (random) UUID per RFC 9562 section 5.4.
pub fn fs_uuid(seed: &str) -> String {
    uuid_from(&format!("kiln-ext4-uuid:{seed}"))
}

/// The directory hash seed of an image, derived like [`fs_uuid`] with another prefix.
pub fn hash_seed(seed: &str) -> String {
    uuid_from(&format!("kiln-ext4-hash-seed:{seed}"))
}

fn uuid_from(s: &str) -> String {
    let d = Sha256::digest(s.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// How big an image must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeEstimate {
    /// Blocks of the tree itself ([`FlatStats::blocks`]), bytes.
    pub tree_bytes: u64,
    /// Inodes the tree needs (with the 11 reserved ones and lost+found).
    pub tree_inodes: u64,
    /// The smallest size that holds the tree with the headroom, MiB.
    pub min_mib: u64,
}

const MIB: u64 = 1 << 20;

/// Journal size for an image of `mib` MiB: 4 MiB below 128 MiB, 16 below 1 GiB, 32 below
/// 2 GiB, 64 below 16 GiB, else 128 (e2fsprogs' `ext2fs_default_journal_size` steps).
pub fn journal_mib(mib: u64) -> u64 {
    match mib {
        0..128 => 4,
        128..1024 => 16,
        1024..2048 => 32,
        2048..16384 => 64,
        _ => 128,
    }
}

/// The inode count given to mke2fs for an image of `mib` MiB holding `tree_inodes`.
pub fn inode_count(mib: u64, tree_inodes: u64) -> u64 {
    (mib * MIB / INODE_RATIO).max(tree_inodes + tree_inodes / 4 + 1024)
}

/// The size computation described in the module doc.
pub fn size_estimate(s: &FlatStats) -> SizeEstimate {
    let tree_bytes = s.blocks * BLOCK_SIZE as u64;
    let tree_inodes = 12 + s.dirs + s.files + s.symlinks + s.specials;
    let base = tree_bytes + tree_bytes / 10 + 16 * MIB;
    let mut mib = base.div_ceil(MIB);
    // Journal and inode tables depend on the size: iterate to a fixed point (a few rounds).
    for _ in 0..8 {
        let inodes = inode_count(mib, tree_inodes);
        let total = base + journal_mib(mib) * MIB + inodes * INODE_SIZE as u64;
        let next = total.div_ceil(MIB);
        if next <= mib {
            break;
        }
        mib = next;
    }
    SizeEstimate {
        tree_bytes,
        tree_inodes,
        min_mib: mib,
    }
}

/// Writes the flattened tar of `layers` to `out` (both passes of [`Flat`]). Returns the
/// counts of the tree. `source_date_epoch` clamps mtimes as in [`build`].
pub fn flatten(
    layers: &[LayerBlob],
    out: impl Write,
    limits: &Limits,
    source_date_epoch: Option<u64>,
) -> Result<FlatStats, Ext4Error> {
    let epoch = source_date_epoch.unwrap_or(DEFAULT_EPOCH);
    let flat = Flat::scan(layers, limits, source_date_epoch, epoch)?;
    flat.write(out)?;
    Ok(flat.stats)
}

/// Makes the ext4 image of `layers` at `dest` (replaced if present) and checks it. See the
/// module doc for what is pinned and how the size is chosen. Blocking; runs `mke2fs` and
/// `e2fsck`, without their syncs ([`nosync`]): the image is not made durable, a caller that
/// keeps it must sync it. Errors: see [`Ext4Error`]; on error `dest` is removed.
pub fn build(
    layers: &[LayerBlob],
    dest: &Path,
    opts: &Ext4Options,
) -> Result<Ext4Image, Ext4Error> {
    build_from(None, layers, dest, opts)
}

/// [`build`] continuing `started`, a scan of the bottom of `layers` (a [`Prescan`] of the
/// build's base), when it was made with `opts`' settings ([`Scan::resume`]); otherwise, or
/// with `None`, as [`build`].
pub fn build_from(
    started: Option<Scan>,
    layers: &[LayerBlob],
    dest: &Path,
    opts: &Ext4Options,
) -> Result<Ext4Image, Ext4Error> {
    let r = build_inner(started, layers, dest, opts, None);
    if r.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    r
}

/// [`build_from`] up to and with the indexing pass (`e2fsck -fpD`), returning as soon as
/// the final check (`e2fsck -fn`) has started on a thread of its own: the image at `dest` is
/// complete and will not change, so a caller may read it (chunk it into a store) while it is
/// checked, but must not publish anything made of it before [`Check::wait`] says it passed.
/// On an error of this function `dest` is removed; when the check fails, the caller removes
/// it.
pub fn build_unchecked(
    started: Option<Scan>,
    layers: &[LayerBlob],
    dest: &Path,
    opts: &Ext4Options,
) -> Result<(Ext4Image, Check), Ext4Error> {
    let r = make_inner(started, layers, dest, opts, None);
    if r.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    r
}

/// The `e2fsck -fn` check of an image [`build_unchecked`] made, running on a thread of its
/// own. Dropping it without [`Check::wait`] leaves the check to finish unobserved.
#[derive(Debug)]
pub struct Check(std::thread::JoinHandle<Result<(), Ext4Error>>);

impl Check {
    /// Starts `e2fsck -fn IMG` on a new thread (in [`tool_env`] with `epoch` and `sde`).
    fn start(img: &Path, epoch: u64, sde: Option<u64>) -> Result<Check, Ext4Error> {
        let img = img.to_path_buf();
        std::thread::Builder::new()
            .name("kiln-e2fsck".into())
            .spawn(move || fsck(&img, epoch, sde))
            .map(Check)
            .map_err(|source| Ext4Error::Io {
                path: PathBuf::from("(e2fsck thread)"),
                source,
            })
    }

    /// Waits for the check: `Ok` when `e2fsck -fn` exited 0, else [`Ext4Error::Fsck`] (or
    /// [`Ext4Error::Tools`] when it could not run). Blocking.
    pub fn wait(self) -> Result<(), Ext4Error> {
        self.0.join().unwrap_or_else(|_| {
            Err(Ext4Error::Tools {
                problem: "the e2fsck -fn thread panicked".into(),
            })
        })
    }
}

/// [`build_from`] without removing `dest` on error: [`make_inner`], then its check.
fn build_inner(
    started: Option<Scan>,
    layers: &[LayerBlob],
    dest: &Path,
    opts: &Ext4Options,
    keep_max: Option<u64>,
) -> Result<Ext4Image, Ext4Error> {
    let (image, check) = make_inner(started, layers, dest, opts, keep_max)?;
    check.wait()?;
    Ok(image)
}

/// Test-only corruption of images between the indexing pass and the check, to prove that an
/// image failing `e2fsck -fn` is never published: every image made under a directory listed
/// here gets 64 bytes of 0xff over its first group descriptor (offset 4096, block 1).
#[cfg(test)]
pub(crate) static CORRUPT_UNDER: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// The image of [`build_unchecked`] without removing `dest` on error. `keep_max`: the most
/// bytes of inflated layers a new scan keeps for pass 2 ([`Keep`]); `None`: [`Keep::in_dir`]
/// of the scratch directory.
fn make_inner(
    started: Option<Scan>,
    layers: &[LayerBlob],
    dest: &Path,
    opts: &Ext4Options,
    keep_max: Option<u64>,
) -> Result<(Ext4Image, Check), Ext4Error> {
    let tools = check_tools()?;
    let epoch = opts.source_date_epoch.unwrap_or(DEFAULT_EPOCH);
    let scratch = tempfile::tempdir().map_err(|source| Ext4Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let sde = opts.source_date_epoch;
    let had = started.is_some();
    let mut scan = match started.and_then(|s| s.resume(layers, &opts.limits, sde, epoch)) {
        Some(s) => {
            tracing::debug!(layers = s.layers().len(), "continuing the prescan");
            s
        }
        None => {
            if had {
                tracing::debug!("the prescan was made with other settings; scanning anew");
            }
            let mut keep = Keep::in_dir(scratch.path());
            if let Some(max) = keep_max {
                keep.max_bytes = max;
            }
            Scan::new(&opts.limits, sde, epoch, Some(keep))
        }
    };
    let t0 = std::time::Instant::now();
    for l in &layers[scan.layers().len()..] {
        scan = scan.layer(l)?;
    }
    let flat = scan.finish();
    let scanned = t0.elapsed();
    let estimate = size_estimate(&flat.stats);
    let (mut mib, fixed) = match opts.disk_mib {
        Some(d) => (d, true),
        None => (estimate.min_mib, false),
    };
    let limit = opts.disk_mib.unwrap_or(opts.max_mib);
    if estimate.min_mib > limit {
        return Err(Ext4Error::TooLarge {
            needs_mib: estimate.min_mib,
            limit_mib: limit,
        });
    }
    let conf = scratch.path().join("mke2fs.conf");
    std::fs::write(&conf, MKE2FS_CONF).map_err(|source| Ext4Error::Io {
        path: conf.clone(),
        source,
    })?;
    let uuid = fs_uuid(ROOTFS_SEED);
    let mut tried: Vec<u64> = Vec::new();
    loop {
        tried.push(mib);
        let args = mke2fs_args(mib, estimate.tree_inodes);
        let sde = opts.source_date_epoch;
        match run_mke2fs(&flat, dest, &args, mib, epoch, sde, &conf) {
            Ok(()) => {
                let made = t0.elapsed();
                debugfs_edits(&flat, dest, epoch, sde, scratch.path())?;
                index_dirs(dest, epoch, sde)?;
                tracing::debug!(
                    scan_ms = scanned.as_millis() as u64,
                    mke2fs_ms = (made - scanned).as_millis() as u64,
                    edits_and_index_ms = (t0.elapsed() - made).as_millis() as u64,
                    mib,
                    "ext4 image made"
                );
                #[cfg(test)]
                corrupt_if_asked(dest);
                let check = Check::start(dest, epoch, sde)?;
                let mut tool = BTreeMap::new();
                tool.insert("mke2fs".to_string(), tools.version.clone());
                tool.insert("args".to_string(), args.join(" "));
                let image = Ext4Image {
                    size_bytes: mib * MIB,
                    filesystem: kiln_store::Filesystem {
                        kind: "ext4".into(),
                        block_size: BLOCK_SIZE,
                        features: FEATURES.iter().map(|f| f.to_string()).collect(),
                        uuid,
                        tool,
                    },
                    stats: flat.stats,
                    estimate,
                };
                return Ok((image, check));
            }
            Err(Ext4Error::Mke2fs { stderr, .. }) if host_full(&stderr) => {
                // The free space that matters is what is left without the partial image.
                let _ = std::fs::remove_file(dest);
                let needs = estimate.tree_bytes
                    + inode_count(mib, estimate.tree_inodes) * u64::from(INODE_SIZE)
                    + journal_mib(mib) * MIB;
                return Err(kiln_store::space::NoSpace::at(
                    "writing the ext4 image",
                    dest,
                    Some(needs),
                )
                .into());
            }
            Err(Ext4Error::Mke2fs { stderr, status }) if image_full(&stderr) => {
                let next = mib + mib / 2;
                tracing::debug!(%status, %stderr, "mke2fs ran out of room inside the image");
                if !fixed && tried.len() <= 2 && next > limit {
                    return Err(Ext4Error::TooLarge {
                        needs_mib: next,
                        limit_mib: limit,
                    });
                }
                if fixed || tried.len() > 2 {
                    return Err(ran_out(
                        &stderr,
                        &tried,
                        estimate.min_mib,
                        limit,
                        estimate.tree_inodes,
                    ));
                }
                tracing::info!(mib, next, "mke2fs ran out of space; retrying larger");
                mib = next;
            }
            Err(e) => return Err(e),
        }
    }
}

/// [`CORRUPT_UNDER`]'s corruption of `img` when it lies under one of its directories.
#[cfg(test)]
fn corrupt_if_asked(img: &Path) {
    use std::os::unix::fs::FileExt as _;
    let asked = CORRUPT_UNDER
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|d| img.starts_with(d));
    if asked {
        let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
        f.write_all_at(&[0xff; 64], u64::from(BLOCK_SIZE)).unwrap();
    }
}

/// The error for mke2fs running out of room inside the image at the last of the sizes
/// `tried` (MiB): what ran out, from its "Could not allocate block/inode" message.
fn ran_out(
    stderr: &str,
    tried: &[u64],
    estimate_mib: u64,
    limit_mib: u64,
    tree_inodes: u64,
) -> Ext4Error {
    let what = if stderr.contains("Could not allocate block") {
        "blocks"
    } else if stderr.contains("Could not allocate inode") {
        "inodes"
    } else {
        "blocks or inodes"
    };
    let mib = tried.last().copied().unwrap_or(estimate_mib);
    Ext4Error::ImageFull {
        what,
        mib,
        inodes: inode_count(mib, tree_inodes),
        tried: tried
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        estimate_mib,
        limit_mib,
        stderr: stderr.to_string(),
    }
}

/// mke2fs ran out of blocks or inodes inside the image (libext2fs's
/// `EXT2_ET_BLOCK_ALLOC_FAIL`, `EXT2_ET_INODE_ALLOC_FAIL`: "Could not allocate block/inode in
/// ext2 filesystem").
fn image_full(stderr: &str) -> bool {
    stderr.contains("Could not allocate")
}

/// mke2fs could not write the image file: `ENOSPC` from the host (`strerror`: "No space left
/// on device"; libext2fs's own errors never read so).
fn host_full(stderr: &str) -> bool {
    stderr.contains("No space left on device")
}

/// The mke2fs arguments (without `-d`, the device and the size).
fn mke2fs_args(mib: u64, tree_inodes: u64) -> Vec<String> {
    vec![
        "-q".into(),
        "-F".into(),
        "-t".into(),
        "ext4".into(),
        "-T".into(),
        "default".into(),
        "-o".into(),
        "Linux".into(),
        "-b".into(),
        BLOCK_SIZE.to_string(),
        "-I".into(),
        INODE_SIZE.to_string(),
        "-N".into(),
        inode_count(mib, tree_inodes).to_string(),
        "-m".into(),
        "5".into(),
        "-J".into(),
        format!("size={}", journal_mib(mib)),
        "-O".into(),
        format!("none,{}", FEATURES.join(",")),
        "-U".into(),
        fs_uuid(ROOTFS_SEED),
        "-E".into(),
        format!(
            "hash_seed={},root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0,nodiscard",
            hash_seed(ROOTFS_SEED)
        ),
    ]
}

#[allow(clippy::too_many_arguments)]
fn run_mke2fs(
    flat: &Flat,
    dest: &Path,
    args: &[String],
    mib: u64,
    epoch: u64,
    sde: Option<u64>,
    conf: &Path,
) -> Result<(), Ext4Error> {
    let io = |source: std::io::Error| {
        if kiln_store::space::is_no_space(&source) {
            kiln_store::space::NoSpace::at("writing the ext4 image", dest, None).into()
        } else {
            Ext4Error::Io {
                path: dest.to_path_buf(),
                source,
            }
        }
    };
    // A fresh, empty file: mke2fs writes only what it needs, the rest stays a hole.
    match std::fs::remove_file(dest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    std::fs::File::create(dest).map_err(io)?;
    let mut cmd = Command::new("mke2fs");
    tool_env(&mut cmd, epoch, sde, Some(conf));
    cmd.args(args)
        .args(["-d", "-"])
        .arg(dest)
        .arg(format!("{}k", mib * 1024))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| Ext4Error::Tools {
        problem: format!("cannot run mke2fs ({e})"),
    })?;
    let mut stderr = child.stderr.take();
    let mut stdout = child.stdout.take();
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.read_to_end(&mut buf);
        }
        if let Some(s) = stdout.as_mut() {
            let _ = s.read_to_end(&mut buf);
        }
        buf
    });
    let written = match child.stdin.take() {
        Some(stdin) => {
            // mke2fs reads the tarball in 4 KiB pieces; a 1 MiB pipe lets the writer run
            // ahead (best effort: the default 64 KiB works too).
            let _ = rustix::pipe::fcntl_setpipe_size(&stdin, 1 << 20);
            flat.write(std::io::BufWriter::with_capacity(1 << 20, stdin))
        }
        None => Ok(()),
    };
    let status = child.wait().map_err(io)?;
    let stderr = err_reader.join().unwrap_or_default();
    if !status.success() {
        return Err(Ext4Error::Mke2fs {
            status: status.to_string(),
            stderr: tail(&stderr),
        });
    }
    written
}

/// What mke2fs gets wrong or leaves out, set with one `debugfs -w` run: the xattrs it does
/// not copy from a tarball (1.47.2 copies only `security.capability`,
/// `misc/create_inode_libarchive.c`) as `ea_set -f VALUEFILE PATH NAME` commands in path
/// order, then `set_inode_field PATH links_count 1` for each directory past [`LINK_MAX`]
/// ([`Flat::link_max_dirs`]).
fn debugfs_edits(
    flat: &Flat,
    img: &Path,
    epoch: u64,
    sde: Option<u64>,
    scratch: &Path,
) -> Result<(), Ext4Error> {
    let todo: Vec<_> = flat
        .xattrs()
        .into_iter()
        .filter(|(_, k, _)| k != b"security.capability")
        .collect();
    if todo.is_empty() && flat.link_max_dirs().is_empty() {
        return Ok(());
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Ext4Error::Io { path, source }
    };
    let mut script = String::new();
    let quoted = |path: &[u8], b: &[u8]| -> Result<String, Ext4Error> {
        let s = std::str::from_utf8(b)
            .ok()
            .filter(|s| !s.contains(['\n', '"', '\\']))
            .ok_or_else(|| {
                Ext4Error::Debugfs(format!(
                    "{}: a path or xattr name debugfs cannot quote",
                    String::from_utf8_lossy(path)
                ))
            })?;
        Ok(format!("\"{s}\""))
    };
    for (i, (path, name, value)) in todo.iter().enumerate() {
        let quoted = |b: &[u8]| quoted(path, b);
        let vf = scratch.join(format!("xattr-{i}"));
        std::fs::write(&vf, value).map_err(io(&vf))?;
        let mut abs = b"/".to_vec();
        abs.extend_from_slice(path);
        script.push_str(&format!(
            "ea_set -f {} {} {}\n",
            quoted(vf.as_os_str().as_encoded_bytes())?,
            quoted(&abs)?,
            quoted(name)?
        ));
    }
    for dir in flat.link_max_dirs() {
        let mut abs = b"/".to_vec();
        abs.extend_from_slice(dir);
        script.push_str(&format!(
            "set_inode_field {} links_count 1\n",
            quoted(dir, &abs)?
        ));
    }
    let cmds = scratch.join("edits.debugfs");
    std::fs::write(&cmds, script).map_err(io(&cmds))?;
    let mut cmd = Command::new("debugfs");
    tool_env(&mut cmd, epoch, sde, None);
    let out = cmd
        .arg("-w")
        .arg("-f")
        .arg(&cmds)
        .arg(img)
        .output()
        .map_err(|e| Ext4Error::Tools {
            problem: format!("cannot run debugfs ({e})"),
        })?;
    let errors = debugfs_complaints(&out.stderr);
    if !out.status.success() || !errors.is_empty() {
        return Err(Ext4Error::Debugfs(errors));
    }
    Ok(())
}

/// What debugfs complained of, `; `-joined (empty when nothing): debugfs exits 0 even when a
/// command fails, and writes its errors to stderr after its version banner
/// (`debugfs 1.47.2 (1-Jan-2025)`).
fn debugfs_complaints(stderr: &[u8]) -> String {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| !l.starts_with("debugfs ") && !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// `e2fsck -fpD IMAGE`: indexes (htree) and compacts every directory of more than one block
/// (e2fsck(8), `-D`). Preen mode (`-p`) exits 0 when it found nothing to repair, 1 when it
/// repaired something, 4 when it would need a question answered (e2fsck(8), "EXIT CODE");
/// anything but 0 is [`Ext4Error::Index`]: this pass indexes, it must not hide a fault.
fn index_dirs(img: &Path, epoch: u64, sde: Option<u64>) -> Result<(), Ext4Error> {
    e2fsck(img, "-fpD", epoch, sde)?.map_or(Ok(()), |(status, output)| {
        Err(Ext4Error::Index { status, output })
    })
}

/// `e2fsck -fn IMAGE`: exit status 0 means clean (e2fsck(8), "EXIT CODE").
fn fsck(img: &Path, epoch: u64, sde: Option<u64>) -> Result<(), Ext4Error> {
    e2fsck(img, "-fn", epoch, sde)?.map_or(Ok(()), |(status, output)| {
        Err(Ext4Error::Fsck { status, output })
    })
}

/// Runs `e2fsck FLAGS IMAGE` in [`tool_env`]: `None` on exit 0, else its exit status and the
/// last 64 KiB of its stdout and stderr.
fn e2fsck(
    img: &Path,
    flags: &str,
    epoch: u64,
    sde: Option<u64>,
) -> Result<Option<(String, String)>, Ext4Error> {
    let mut cmd = Command::new("e2fsck");
    tool_env(&mut cmd, epoch, sde, None);
    let out = cmd
        .arg(flags)
        .arg(img)
        .output()
        .map_err(|e| Ext4Error::Tools {
            problem: format!("cannot run e2fsck ({e})"),
        })?;
    if out.status.success() {
        return Ok(None);
    }
    let mut all = out.stdout;
    all.extend_from_slice(&out.stderr);
    Ok(Some((out.status.to_string(), tail(&all))))
}

/// A [`Scan`] of an image's bottom layers (a build's base image) on a thread of its own,
/// started while the build's steps run, so that publishing continues it with the steps'
/// layers ([`build_from`]) instead of reading the base again: the first pass over the base
/// leaves the publish's critical path. Cloning shares it; it is taken once ([`Prescan::take`]).
/// Dropping the last clone untaken stops the thread (through the cancel flag of its
/// [`Limits`], checked on each read) and waits for it; what it kept ([`Keep`]: unlinked
/// temporary files) goes with it. A scan that failed is not reported: the flatten that
/// would continue it scans from the start and reports the error then.
#[derive(Clone)]
pub struct Prescan(std::sync::Arc<std::sync::Mutex<Option<Running>>>);

struct Running {
    thread: Option<std::thread::JoinHandle<Option<Scan>>>,
    cancel: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.cancel
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Prescan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Prescan")
    }
}

impl Prescan {
    /// Starts scanning `layers` (bottom first) with `limits` (their cancel flag replaced by
    /// the prescan's own), `source_date_epoch` as in [`Ext4Options`], keeping inflated
    /// streams as `keep` says.
    pub fn start(
        layers: Vec<LayerBlob>,
        limits: &Limits,
        source_date_epoch: Option<u64>,
        keep: Keep,
    ) -> Prescan {
        let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let limits = Limits {
            cancel: Some(cancel.clone()),
            ..limits.clone()
        };
        let epoch = source_date_epoch.unwrap_or(DEFAULT_EPOCH);
        // The copies are published before the thread starts, so the steps' unpack of the
        // base, which may start first, follows them (crate::layer::shared).
        let mut s = Scan::new(&limits, source_date_epoch, epoch, Some(keep));
        s.reserve(&layers);
        let thread = std::thread::Builder::new()
            .name("kiln-prescan".into())
            .spawn(move || {
                for l in &layers {
                    s = match s.layer(l) {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::debug!(layer = %l.digest, error = %e, "prescan stopped");
                            return None;
                        }
                    };
                }
                Some(s)
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::debug!(error = %e, "no prescan thread");
                None
            }
        };
        Prescan(std::sync::Arc::new(std::sync::Mutex::new(Some(Running {
            thread,
            cancel,
        }))))
    }

    /// Waits for the scan and takes it: `None` when it failed, was taken already or could
    /// not start. Blocking.
    pub fn take(&self) -> Option<Scan> {
        let mut running = self.0.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        running.thread.take()?.join().ok().flatten()
    }
}

#[cfg(test)]
mod equivalence_tests;
#[cfg(test)]
mod keep_tests;
#[cfg(test)]
mod tests;
