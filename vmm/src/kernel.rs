//! The guest kernel: Debian's `linux-image-cloud-amd64`, fetched by name, unpacked into an
//! uncompressed `vmlinux` (PVH entry) and its module tree, cached by package and version.
//!
//! Steps ([`fetch`]):
//! 1. resolve the metapackage (`linux-image-cloud-amd64`) to the versioned image package it
//!    depends on (`apt-cache depends`; bookworm: `linux-image-6.1.0-N-cloud-amd64`). Old
//!    versions vanish from the archive, so kiln pins the *name* and records what it resolved to.
//! 2. look in the cache: `<cache>/kernel/<package>_<version>/kernel.json`;
//! 3. else `apt-get download` the package, record the .deb's sha256 and its control fields
//!    (`dpkg-deb -f`), unpack it (`dpkg-deb -x`);
//! 4. decompress the bzImage's payload into `vmlinux` ([`extract_vmlinux`]): the payload is
//!    located by the x86 boot protocol header (`payload_offset`/`payload_length`,
//!    Documentation/arch/x86/boot.rst, protocol 2.08+), else by scanning for a compression
//!    magic as the kernel's `scripts/extract-vmlinux` does; the result must be an x86-64
//!    ELF64 file with a PVH entry note ([`pvh_entry`]);
//! 5. keep `lib/modules/<release>` beside it for the initramfs ([`module_closure`]).
//!
//! Formats, and which crate reads them:
//! - LZ4 blocks: the `lz4_flex` crate's block decoder. The framing around them is read here,
//!   in `lz4_legacy_decompress`'s loop of a few lines: the kernel's payload is an LZ4
//!   *legacy* frame (magic 0x184C2102; `lz4 -l`) followed by a 4-byte decompressed size that
//!   the kernel build appends (`size_append`, scripts/Makefile.lib). `lz4_flex`'s frame
//!   decoder (0.14) reads legacy frames, but it takes every 4-byte word after a block as the
//!   next block's size, so that trailing word ends it with `BlockTooBig` (checked on
//!   `linux-image-6.1.0-57-cloud-amd64`: its 14 MB payload decodes only with the last 4
//!   bytes cut off), and a payload found by the magic scan has no known end to cut at. The
//!   loop here stops at that word and checks it against the bytes decompressed, which also
//!   catches a truncated payload.
//! - ELF (the vmlinux's PT_NOTE segments, modules' `.modinfo` section): the `object` crate
//!   (read-only ELF: its `read_core` and `elf` features).
//! - The x86 boot protocol header and the `.modinfo` strings: a few fixed offsets and a split
//!   on NUL, read here; no crate parses bzImage headers.
//!
//! Cache entry layout:
//! ```text
//! <cache>/kernel/<package>_<version>/
//!     kernel.json       Kernel, minus paths (written last: its presence marks the entry whole)
//!     vmlinux           uncompressed ELF kernel
//!     modules/          lib/modules/<release> from the package
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The Debian metapackage kiln's guest kernel comes from.
pub const DEFAULT_PACKAGE: &str = "linux-image-cloud-amd64";

/// The modules the guest needs (virtio-mmio transport, the root disk, the host port, and
/// overlayfs for a build step's root); their dependencies are added by [`module_closure`].
pub const GUEST_MODULES: [&str; 4] = ["virtio_mmio", "virtio_blk", "virtio_console", "overlay"];

/// Largest decompressed kernel accepted, bytes (512 MiB).
const MAX_VMLINUX: usize = 512 << 20;

/// Largest bzImage or module read, bytes (256 MiB).
const MAX_INPUT: u64 = 256 << 20;

/// `base-images/kernel.yaml`: which kernel, modules, command line and init the guest gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRecipe {
    /// Always `kernel`.
    pub kind: String,
    /// The Debian metapackage to resolve ([`DEFAULT_PACKAGE`]).
    pub package: String,
    /// The suite it is meant to come from (recorded, not enforced).
    pub suite: String,
    /// Modules for the initramfs (dependencies are added).
    pub modules: Vec<String>,
    /// Kernel command line words (the VMM adds accelerator-specific ones).
    pub cmdline: Vec<String>,
    /// How the init is built.
    pub init: InitRecipe,
}

/// The `init:` section of [`KernelRecipe`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitRecipe {
    /// Cargo package (`kiln-guest`).
    pub package: String,
    /// Binary (`kiln-guest-init`).
    pub bin: String,
    /// Target triple.
    pub target: String,
    /// RUSTFLAGS for the build.
    pub rustflags: String,
}

impl KernelRecipe {
    /// The recipe shipped in `base-images/kernel.yaml` (compiled in).
    pub fn shipped() -> Self {
        // The shipped file is parsed by a unit test: it cannot fail here.
        Self::parse(include_str!("../../base-images/kernel.yaml")).unwrap_or_else(|_| Self {
            kind: "kernel".into(),
            package: DEFAULT_PACKAGE.into(),
            suite: "bookworm".into(),
            modules: GUEST_MODULES.iter().map(|m| m.to_string()).collect(),
            cmdline: vec!["console=ttyS0".into()],
            init: InitRecipe {
                package: "kiln-guest".into(),
                bin: "kiln-guest-init".into(),
                target: "x86_64-unknown-linux-gnu".into(),
                rustflags: crate::initramfs::INIT_RUSTFLAGS.into(),
            },
        })
    }

    /// Parse a kernel recipe (YAML).
    ///
    /// Errors: [`KernelError::Recipe`] for bad YAML, unknown keys or another `kind`.
    pub fn parse(text: &str) -> Result<Self, KernelError> {
        let r: KernelRecipe =
            serde_saphyr::from_str(text).map_err(|e| KernelError::Recipe(e.to_string()))?;
        if r.kind != "kernel" {
            return Err(KernelError::Recipe(format!(
                "kind is {:?}, not kernel",
                r.kind
            )));
        }
        Ok(r)
    }
}

/// A guest kernel in the local cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernel {
    /// The metapackage asked for (`linux-image-cloud-amd64`).
    pub requested: String,
    /// The package it resolved to (`linux-image-6.1.0-57-cloud-amd64`).
    pub package: String,
    /// The package version (`6.1.192-3`).
    pub version: String,
    /// The kernel release (`uname -r`, `6.1.0-57-cloud-amd64`).
    pub release: String,
    /// `sha256:<hex>` of the downloaded .deb.
    pub deb_sha256: String,
    /// `sha256:<hex>` of the bzImage in the package (`/boot/vmlinuz-<release>`).
    pub bzimage_sha256: String,
    /// `sha256:<hex>` of the extracted `vmlinux`.
    pub vmlinux_sha256: String,
    /// The compression of the bzImage payload (`lz4`).
    pub compression: String,
    /// PVH entry point (XEN_ELFNOTE_PHYS32_ENTRY), a guest physical address.
    pub pvh_entry: u64,
    /// The cache entry directory (not serialised: set when loaded).
    #[serde(skip)]
    pub dir: PathBuf,
}

impl Kernel {
    /// The uncompressed kernel.
    pub fn vmlinux(&self) -> PathBuf {
        self.dir.join("vmlinux")
    }

    /// The module tree (`lib/modules/<release>` of the package).
    pub fn modules_dir(&self) -> PathBuf {
        self.dir.join("modules")
    }
}

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A tool (apt-cache, apt-get, dpkg-deb) failed.
    #[error("{tool} failed: {detail}")]
    Tool {
        /// The command.
        tool: String,
        /// Its stderr, or the spawn error.
        detail: String,
    },
    /// The metapackage does not name an image package.
    #[error("{0} depends on no linux-image package (apt-cache depends)")]
    Unresolved(String),
    /// The bzImage is not one this code can unpack.
    #[error("bzImage {}: {detail}", file.display())]
    BzImage {
        /// The bzImage (`boot/vmlinuz-<release>` of the package), or the package when it has
        /// none.
        file: PathBuf,
        /// What is wrong (truncated or corrupt LZ4, another compression, no payload).
        detail: String,
    },
    /// The decompressed kernel is not a PVH-bootable x86-64 ELF.
    #[error("vmlinux decompressed from {}: {detail}", file.display())]
    Vmlinux {
        /// The bzImage it came from.
        file: PathBuf,
        /// What is wrong (not x86-64 ELF64, no PVH note).
        detail: String,
    },
    /// A module is missing or malformed.
    #[error("module {0}: {1}")]
    Module(String, String),
    /// A module dependency cycle.
    #[error("module dependency cycle through {0}")]
    Cycle(String),
    /// I/O.
    #[error("{0}: {1}")]
    Io(String, io::Error),
    /// A kernel recipe does not parse.
    #[error("kernel recipe: {0}")]
    Recipe(String),
    /// The cache entry's metadata is unreadable.
    #[error("cache entry {0}: {1}")]
    Cache(PathBuf, String),
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> KernelError {
    move |e| KernelError::Io(what.to_string(), e)
}

fn run(cmd: &mut Command) -> Result<String, KernelError> {
    let tool = format!("{:?}", cmd.get_program());
    let out = cmd.output().map_err(|e| KernelError::Tool {
        tool: tool.clone(),
        detail: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(KernelError::Tool {
            tool,
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Resolve `metapackage` to the versioned `linux-image-*` package it depends on and that
/// package's candidate version, from apt's local lists (no network).
///
/// Errors: [`KernelError::Tool`], [`KernelError::Unresolved`].
pub fn resolve(metapackage: &str) -> Result<(String, String), KernelError> {
    let deps = run(Command::new("apt-cache").args(["depends", metapackage]))?;
    let package =
        parse_image_dependency(&deps).ok_or_else(|| KernelError::Unresolved(metapackage.into()))?;
    let show = run(Command::new("apt-cache").args(["show", "--no-all-versions", &package]))?;
    let version =
        control_field(&show, "Version").ok_or_else(|| KernelError::Unresolved(package.clone()))?;
    Ok((package, version))
}

/// The first `Depends: linux-image-…` of `apt-cache depends` output.
fn parse_image_dependency(out: &str) -> Option<String> {
    out.lines().find_map(|l| {
        let dep = l
            .trim()
            .trim_start_matches('|')
            .strip_prefix("Depends:")?
            .trim();
        let dep = dep.trim_start_matches('<').trim_end_matches('>');
        (dep.starts_with("linux-image-") && !dep.contains(' ')).then(|| dep.to_string())
    })
}

/// The value of `Field:` in Debian control-format text.
fn control_field(text: &str, field: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim().to_string())
    })
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, KernelError> {
    let f = fs::File::open(path).map_err(io_err(path.display()))?;
    read_bounded_from(f, path)
}

/// Everything `r` yields (the contents of `path`, or what its bytes decompress to), at most
/// [`MAX_INPUT`] bytes: more is an error naming `path`, so that a decompression bomb stops
/// at the bound.
fn read_bounded_from(r: impl Read, path: &Path) -> Result<Vec<u8>, KernelError> {
    let mut buf = Vec::new();
    r.take(MAX_INPUT + 1)
        .read_to_end(&mut buf)
        .map_err(io_err(path.display()))?;
    if buf.len() as u64 > MAX_INPUT {
        return Err(KernelError::Io(
            path.display().to_string(),
            io::Error::other("larger than 256 MiB"),
        ));
    }
    Ok(buf)
}

/// Fetch (or find in `cache_dir`) the kernel of `metapackage`: see the module doc.
///
/// Errors: [`KernelError`]: apt or dpkg failing, an unexpected package layout, a kernel
/// that does not decompress to a PVH ELF.
pub fn fetch(cache_dir: &Path, metapackage: &str) -> Result<Kernel, KernelError> {
    let (package, version) = resolve(metapackage)?;
    let entry = cache_dir
        .join("kernel")
        .join(format!("{package}_{}", version.replace([':', '/'], "_")));
    if let Some(k) = load(&entry)? {
        return Ok(k);
    }
    let parent = cache_dir.join("kernel");
    fs::create_dir_all(&parent).map_err(io_err(parent.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(&parent)
        .map_err(io_err(parent.display()))?;
    // apt-get download writes into the current directory; `pkg=version` pins what we resolved.
    run(Command::new("apt-get")
        .args(["download", "-q", &format!("{package}={version}")])
        .current_dir(tmp.path()))?;
    let deb = fs::read_dir(tmp.path())
        .map_err(io_err(tmp.path().display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| KernelError::Tool {
            tool: "apt-get download".into(),
            detail: "no .deb written".into(),
        })?;
    let deb_sha256 = {
        let mut h = Sha256::new();
        let mut f = fs::File::open(&deb).map_err(io_err(deb.display()))?;
        io::copy(&mut f, &mut h).map_err(io_err(deb.display()))?;
        format!("sha256:{}", hex::encode(h.finalize()))
    };
    let fields = run(Command::new("dpkg-deb").arg("-f").arg(&deb))?;
    let got_version = control_field(&fields, "Version").unwrap_or_default();
    if got_version != version {
        return Err(KernelError::Unresolved(format!(
            "{package}: asked for {version}, downloaded {got_version}"
        )));
    }
    let root = tmp.path().join("root");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    let boot = root.join("boot");
    let vmlinuz = fs::read_dir(&boot)
        .map_err(io_err(boot.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .ok_or_else(|| KernelError::BzImage {
            file: deb.clone(),
            detail: "no /boot/vmlinuz-* in the package".into(),
        })?;
    let release = vmlinuz
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("vmlinuz-"))
        .unwrap_or_default()
        .to_string();
    let bz = read_bounded(&vmlinuz)?;
    let (vmlinux, compression) = extract_vmlinux(&vmlinuz, &bz)?;
    let pvh = pvh_entry(&vmlinuz, &vmlinux)?;

    let staging = tmp.path().join("entry");
    fs::create_dir_all(&staging).map_err(io_err(staging.display()))?;
    fs::write(staging.join("vmlinux"), &vmlinux).map_err(io_err("vmlinux"))?;
    let modules = root.join("lib/modules").join(&release);
    let modules = if modules.is_dir() {
        modules
    } else {
        root.join("usr/lib/modules").join(&release)
    };
    fs::rename(&modules, staging.join("modules")).map_err(io_err(modules.display()))?;
    let kernel = Kernel {
        requested: metapackage.into(),
        package,
        version,
        release,
        deb_sha256,
        bzimage_sha256: sha256_digest(&bz),
        vmlinux_sha256: sha256_digest(&vmlinux),
        compression: compression.into(),
        pvh_entry: pvh,
        dir: entry.clone(),
    };
    let json = serde_json::to_vec_pretty(&kernel)
        .map_err(|e| KernelError::Cache(entry.clone(), e.to_string()))?;
    fs::write(staging.join("kernel.json"), json).map_err(io_err("kernel.json"))?;
    match fs::rename(&staging, &entry) {
        Ok(()) => {}
        // Another process filled the entry meanwhile: use theirs.
        Err(_) if entry.join("kernel.json").exists() => {}
        Err(e) => return Err(KernelError::Io(entry.display().to_string(), e)),
    }
    load(&entry)?.ok_or_else(|| KernelError::Cache(entry, "vanished after writing".into()))
}

/// The cached kernel in `entry`, if complete. The vmlinux digest is checked.
fn load(entry: &Path) -> Result<Option<Kernel>, KernelError> {
    let meta = entry.join("kernel.json");
    let bytes = match fs::read(&meta) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(KernelError::Io(meta.display().to_string(), e)),
    };
    let mut k: Kernel = serde_json::from_slice(&bytes)
        .map_err(|e| KernelError::Cache(entry.into(), e.to_string()))?;
    k.dir = entry.into();
    let vmlinux = read_bounded(&k.vmlinux())?;
    if sha256_digest(&vmlinux) != k.vmlinux_sha256 {
        return Err(KernelError::Cache(
            entry.into(),
            "vmlinux does not match its recorded digest; delete the entry".into(),
        ));
    }
    Ok(Some(k))
}

// --- bzImage ------------------------------------------------------------------------------

const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
/// Compression magics as `scripts/extract-vmlinux` lists them (format name, magic).
const MAGICS: [(&str, &[u8]); 7] = [
    ("lz4", &LZ4_LEGACY_MAGIC),
    ("gzip", &[0x1f, 0x8b, 0x08]),
    ("xz", &[0xfd, b'7', b'z', b'X', b'Z', 0x00]),
    ("bzip2", b"BZh"),
    ("lzma", &[0x5d, 0x00, 0x00, 0x00]),
    ("lzo", &[0x89, b'L', b'Z', b'O']),
    ("zstd", &[0x28, 0xb5, 0x2f, 0xfd]),
];

fn le32(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn le16(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
}

/// The compressed payload of a bzImage located by its boot protocol header (`HdrS` at
/// 0x202, protocol ≥ 2.08: `setup_sects` at 0x1f1, `payload_offset` at 0x248 and
/// `payload_length` at 0x24c, relative to the protected-mode code at `(setup_sects+1)*512`).
fn payload_by_header(bz: &[u8]) -> Option<&[u8]> {
    if bz.get(0x202..0x206)? != b"HdrS" || le16(bz, 0x206)? < 0x0208 {
        return None;
    }
    let setup_sects = match *bz.get(0x1f1)? {
        0 => 4,
        n => n as usize,
    };
    let start = (setup_sects + 1) * 512 + le32(bz, 0x248)? as usize;
    let len = le32(bz, 0x24c)? as usize;
    bz.get(start..start.checked_add(len)?)
}

/// Decompress a bzImage's payload into the vmlinux ELF; returns it and the compression name.
/// `file` names the bzImage in errors.
///
/// Only LZ4 (Debian cloud kernels: `CONFIG_KERNEL_LZ4`) is decompressed; another format is
/// named in the error.
///
/// Errors: [`KernelError::BzImage`] (no payload, unsupported, truncated or corrupt
/// compression), [`KernelError::Vmlinux`] (the result is not an x86-64 ELF file).
pub fn extract_vmlinux(file: &Path, bz: &[u8]) -> Result<(Vec<u8>, &'static str), KernelError> {
    let mut candidates: Vec<&[u8]> = Vec::new();
    if let Some(p) = payload_by_header(bz) {
        candidates.push(p);
    }
    // extract-vmlinux's way: every place a magic occurs, in file order.
    for (_, magic) in MAGICS {
        let mut from = 0;
        while let Some(i) = find(&bz[from..], magic) {
            candidates.push(&bz[from + i..]);
            from += i + 1;
            if candidates.len() > 64 {
                break;
            }
        }
    }
    // The first LZ4 payload's error is the one to report (the header's payload comes first):
    // a truncated kernel must not be reported as another format because its compressed
    // bytes happen to hold another format's magic further on.
    let mut lz4_err = None;
    let mut other = None;
    for payload in candidates {
        let Some((name, _)) = MAGICS.iter().find(|(_, m)| payload.starts_with(m)) else {
            continue;
        };
        if *name != "lz4" {
            other.get_or_insert_with(|| {
                format!("payload is {name}-compressed; only lz4 is supported")
            });
            continue;
        }
        let err = match lz4_legacy_decompress(payload) {
            Ok(out) => match elf_x86_64(&out) {
                Ok(_) => return Ok((out, "lz4")),
                Err(e) if out.starts_with(&object::elf::ELFMAG) => {
                    return Err(KernelError::Vmlinux {
                        file: file.into(),
                        detail: e,
                    });
                }
                Err(_) => "lz4 payload does not decompress to an ELF file".into(),
            },
            Err(e) => e,
        };
        lz4_err.get_or_insert(err);
    }
    Err(KernelError::BzImage {
        file: file.into(),
        detail: lz4_err
            .or(other)
            .unwrap_or_else(|| "no compressed payload found".into()),
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Decompressed size of one legacy-frame block, bytes (lz4's doc/lz4_Frame_format.md,
/// "Legacy frame": 8 MiB).
const LZ4_LEGACY_BLOCK: usize = 8 << 20;

/// The largest compressed size of one legacy block: `LZ4_COMPRESSBOUND(8 MiB)` = n + n/255 +
/// 16 (lz4.h). lz4's own legacy reader takes a larger size field as the start of the next
/// frame, not as a block.
const LZ4_LEGACY_BOUND: usize = LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK / 255 + 16;

/// Decompress the kernel's LZ4 stream: a legacy frame (magic 0x184C2102, then blocks of `u32
/// LE compressed size` + one independent LZ4 block of at most 8 MiB decompressed; lz4's
/// doc/lz4_Frame_format.md, "Legacy frame") and the `u32 LE` decompressed size the kernel
/// build appends (`size_append` in scripts/Makefile.lib, `cmd_lz4_with_size`, which
/// arch/x86/boot/compressed uses). Each block is decoded by `lz4_flex`'s block decoder; the
/// framing is read here (see the module doc for why not `lz4_flex`'s frame decoder).
///
/// The stream ends at the size word, which must equal the bytes decompressed; bytes after it
/// (a signature, the rest of the bzImage when the payload was found by scanning) are ignored.
///
/// Errors (a message): a corrupt block, a block running past the input or a stream without
/// its size word (truncated), a size word that disagrees, more than 512 MiB of output.
fn lz4_legacy_decompress(input: &[u8]) -> Result<Vec<u8>, String> {
    let mut pos = 4;
    let mut out = Vec::new();
    let mut blocks = 0usize;
    // One block's output, grown to what the largest block so far can hold: at most 8 MiB,
    // and at most 255 bytes per input byte (a sequence's length bytes add 255 each, its
    // literals one per byte; lz4's doc/lz4_Block_format.md).
    let mut window = Vec::new();
    loop {
        let Some(size) = le32(input, pos) else {
            return Err(format!(
                "lz4 stream truncated: it ends at byte {pos} after {blocks} blocks ({} bytes \
                 decompressed) without the kernel's decompressed-size word",
                out.len()
            ));
        };
        if size.to_le_bytes() == LZ4_LEGACY_MAGIC {
            // Concatenated legacy frames (lib/decompress_unlz4.c skips the magic too).
            pos += 4;
            continue;
        }
        let size = size as usize;
        if !out.is_empty() && size == out.len() {
            return Ok(out);
        }
        if size == 0 || size > LZ4_LEGACY_BOUND {
            return Err(format!(
                "lz4 stream ends at byte {pos} after {blocks} blocks with the word {size}, \
                 not its decompressed size {} (corrupt or truncated)",
                out.len()
            ));
        }
        let block = input.get(pos + 4..pos + 4 + size).ok_or_else(|| {
            format!(
                "lz4 stream truncated or corrupt: after {blocks} blocks ({} bytes) the word at \
                 byte {pos} is {size}, neither the decompressed size nor a block that fits the \
                 {} bytes left",
                out.len(),
                input.len() - pos - 4
            )
        })?;
        let room = LZ4_LEGACY_BLOCK.min(size * 255);
        if window.len() < room {
            window.resize(room, 0);
        }
        let n = lz4_flex::block::decompress_into(block, &mut window[..room])
            .map_err(|e| format!("lz4 block {blocks} at byte {pos} is corrupt: {e}"))?;
        out.extend_from_slice(&window[..n]);
        if out.len() > MAX_VMLINUX {
            return Err("decompressed kernel larger than 512 MiB".into());
        }
        pos += 4 + size;
        blocks += 1;
    }
}

// --- ELF ----------------------------------------------------------------------------------

type Elf64 = object::elf::FileHeader64<object::Endianness>;

/// The header of a little-endian ELF64 file for x86-64 (`e_machine` EM_X86_64, 62), read by
/// the `object` crate, and its byte order.
///
/// Errors (a message): not ELF, not ELF64 little-endian, another machine.
pub(crate) fn elf_x86_64(elf: &[u8]) -> Result<(&Elf64, object::Endianness), String> {
    use object::read::elf::FileHeader;
    if !elf.starts_with(&object::elf::ELFMAG) {
        return Err("not an ELF file (no \\x7fELF magic)".into());
    }
    let header = Elf64::parse(elf).map_err(|e| format!("not an ELF64 file: {e}"))?;
    let endian = header
        .endian()
        .map_err(|e| format!("not an ELF64 file: {e}"))?;
    if !header.is_little_endian() {
        return Err("a big-endian ELF file, not x86-64".into());
    }
    let machine = header.e_machine(endian);
    if machine != object::elf::EM_X86_64 {
        return Err(format!(
            "an ELF file for machine {} (e_machine), not x86-64 (EM_X86_64, 62)",
            machine.0
        ));
    }
    Ok((header, endian))
}

/// The PVH entry point of an x86-64 ELF64 kernel: the `Xen` note of type
/// XEN_ELFNOTE_PHYS32_ENTRY (18; xen/include/public/elfnote.h) in a PT_NOTE segment, read
/// with the `object` crate. `file` names the kernel in errors.
///
/// Errors: [`KernelError::Vmlinux`] for a file that is not an x86-64 ELF64 one, a malformed
/// program header or note, or no such note.
pub fn pvh_entry(file: &Path, elf: &[u8]) -> Result<u64, KernelError> {
    use object::read::elf::{FileHeader, ProgramHeader};
    const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
    let bad = |detail: String| KernelError::Vmlinux {
        file: file.into(),
        detail,
    };
    let (header, endian) = elf_x86_64(elf).map_err(bad)?;
    let phdrs = header
        .program_headers(endian, elf)
        .map_err(|e| bad(format!("program headers: {e}")))?;
    for ph in phdrs {
        let Some(mut notes) = ph
            .notes(endian, elf)
            .map_err(|e| bad(format!("note segment: {e}")))?
        else {
            continue;
        };
        while let Some(note) = notes.next().map_err(|e| bad(format!("note: {e}")))? {
            if note.name() != b"Xen" || note.n_type(endian).0 != XEN_ELFNOTE_PHYS32_ENTRY {
                continue;
            }
            let desc = note.desc();
            return match desc.len() {
                4 => Ok(le32(desc, 0).unwrap_or(0).into()),
                8 => Ok(u64::from_le_bytes(desc.try_into().unwrap_or_default())),
                n => Err(bad(format!("PVH note of {n} bytes, not 4 or 8"))),
            };
        }
    }
    Err(bad(
        "no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY): the kernel lacks CONFIG_PVH".into(),
    ))
}

// --- modules ------------------------------------------------------------------------------

/// A kernel module chosen for the initramfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// Module name (`virtio_blk`).
    pub name: String,
    /// Its file in the module tree.
    pub path: PathBuf,
}

fn module_name(file: &str) -> Option<String> {
    let stem = file
        .strip_suffix(".ko")
        .or_else(|| file.strip_suffix(".ko.xz"))
        .or_else(|| file.strip_suffix(".ko.zst"))
        .or_else(|| file.strip_suffix(".ko.gz"))?;
    Some(stem.replace('-', "_"))
}

fn index_modules(dir: &Path, index: &mut BTreeMap<String, PathBuf>) -> Result<(), KernelError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir.display()))? {
        let entry = entry.map_err(io_err(dir.display()))?;
        let ty = entry.file_type().map_err(io_err(entry.path().display()))?;
        if ty.is_dir() {
            index_modules(&entry.path(), index)?;
        } else if let Some(name) = entry.file_name().to_str().and_then(module_name) {
            index.entry(name).or_insert(entry.path());
        }
    }
    Ok(())
}

/// The plain ELF bytes of a module file: a `.ko` as it is, a `.ko.xz` decompressed (the
/// `liblzma` crate, every stream of the file, as `xz -dc` does), for kernels that cannot
/// load compressed modules themselves. At most [`MAX_INPUT`] bytes either way.
///
/// Errors, each naming the file: [`KernelError::Io`] (unreadable, not xz, corrupt or cut
/// short, larger than the bound), [`KernelError::Module`] (another compression).
pub fn module_bytes(path: &Path) -> Result<Vec<u8>, KernelError> {
    let name = path.display().to_string();
    if name.ends_with(".ko") {
        return read_bounded(path);
    }
    if name.ends_with(".ko.xz") {
        let f = fs::File::open(path).map_err(io_err(path.display()))?;
        let xz = liblzma::read::XzDecoder::new_multi_decoder(io::BufReader::new(f));
        return read_bounded_from(xz, path);
    }
    Err(KernelError::Module(
        name,
        "unsupported module compression".into(),
    ))
}

/// The `depends=` list of an x86-64 module's `.modinfo` section (`NUL`-separated `key=value`
/// strings; section headers read with the `object` crate), names normalised (`-` → `_`).
///
/// Errors (a message): not an x86-64 ELF64 file, malformed section headers, no `.modinfo`.
pub fn module_depends(ko: &[u8]) -> Result<Vec<String>, String> {
    use object::read::elf::{FileHeader, SectionHeader};
    let (header, endian) = elf_x86_64(ko)?;
    let sections = header
        .sections(endian, ko)
        .map_err(|e| format!("section headers: {e}"))?;
    let (_, modinfo) = sections
        .section_by_name(endian, b".modinfo")
        .ok_or("no .modinfo section")?;
    let data = modinfo
        .data(endian, ko)
        .map_err(|e| format!(".modinfo: {e}"))?;
    for kv in data.split(|b| *b == 0) {
        if let Some(deps) = kv.strip_prefix(b"depends=") {
            return Ok(String::from_utf8_lossy(deps)
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.replace('-', "_"))
                .collect());
        }
    }
    Ok(Vec::new())
}

/// `wanted` modules and everything they depend on (read from each module's `.modinfo`, so no
/// `modules.dep` is needed: the package ships none), dependencies first: the order to load
/// them in.
///
/// Errors: [`KernelError::Module`] for a missing or malformed module, [`KernelError::Cycle`].
pub fn module_closure(modules_dir: &Path, wanted: &[&str]) -> Result<Vec<Module>, KernelError> {
    let mut index = BTreeMap::new();
    index_modules(modules_dir, &mut index)?;
    let mut order = Vec::new();
    let mut done = BTreeSet::new();
    let mut visiting = BTreeSet::new();
    fn visit(
        name: &str,
        index: &BTreeMap<String, PathBuf>,
        order: &mut Vec<Module>,
        done: &mut BTreeSet<String>,
        visiting: &mut BTreeSet<String>,
    ) -> Result<(), KernelError> {
        if done.contains(name) {
            return Ok(());
        }
        if !visiting.insert(name.to_string()) {
            return Err(KernelError::Cycle(name.into()));
        }
        let path = index.get(name).ok_or_else(|| {
            KernelError::Module(name.into(), "not in the package's module tree".into())
        })?;
        let bytes = module_bytes(path)?;
        let deps = module_depends(&bytes).map_err(|e| KernelError::Module(name.into(), e))?;
        for d in deps {
            visit(&d, index, order, done, visiting)?;
        }
        visiting.remove(name);
        done.insert(name.to_string());
        order.push(Module {
            name: name.into(),
            path: path.clone(),
        });
        Ok(())
    }
    for w in wanted {
        visit(
            &w.replace('-', "_"),
            &index,
            &mut order,
            &mut done,
            &mut visiting,
        )?;
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apt_cache_depends_output_is_parsed() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(
            parse_image_dependency(out).as_deref(),
            Some("linux-image-6.1.0-57-cloud-amd64")
        );
        assert_eq!(parse_image_dependency("x\n  Depends: <virtual>\n"), None);
        assert_eq!(
            control_field("Package: a\nVersion: 1.2-3\n", "Version").as_deref(),
            Some("1.2-3")
        );
    }

    /// LZ4 blocks made by hand: literals only, then a literal + overlapping match.
    #[test]
    fn lz4_legacy_stream_decodes_and_hostile_blocks_are_refused() {
        // Block 1: token 0x50 = 5 literals, "hello". Block 2: token 0x11 = 1 literal 'a', then a
        // match of 1+4 = 5 bytes at offset 1 (run of 'a'), ending with 5 literals "aaaaa"
        // (LZ4 needs the last 5 bytes as literals).
        let mut s = LZ4_LEGACY_MAGIC.to_vec();
        let b1 = [0x50, b'h', b'e', b'l', b'l', b'o'];
        let b2 = [0x11, b'a', 1, 0, 0x50, b'a', b'a', b'a', b'a', b'a'];
        for b in [&b1[..], &b2[..]] {
            s.extend_from_slice(&(b.len() as u32).to_le_bytes());
            s.extend_from_slice(b);
        }
        // The kernel's trailing size field (does not fit as a block: stops the stream).
        s.extend_from_slice(&16u32.to_le_bytes());
        assert_eq!(lz4_legacy_decompress(&s).unwrap(), b"helloaaaaaaaaaaa");

        // Offset pointing before the output.
        let mut bad = LZ4_LEGACY_MAGIC.to_vec();
        let blk = [0x10, b'a', 9, 0, 0x00];
        bad.extend_from_slice(&(blk.len() as u32).to_le_bytes());
        bad.extend_from_slice(&blk);
        assert!(lz4_legacy_decompress(&bad).is_err());
        // Literal run past the block.
        let mut bad = LZ4_LEGACY_MAGIC.to_vec();
        let blk = [0xf0, 200];
        bad.extend_from_slice(&(blk.len() as u32).to_le_bytes());
        bad.extend_from_slice(&blk);
        assert!(lz4_legacy_decompress(&bad).is_err());
        // A match that would blow past the block limit.
        let mut big = vec![0x1f, b'a', 1, 0];
        big.extend(std::iter::repeat_n(255u8, 40_000));
        big.push(0);
        let mut bad = LZ4_LEGACY_MAGIC.to_vec();
        bad.extend_from_slice(&(big.len() as u32).to_le_bytes());
        bad.extend_from_slice(&big);
        assert!(lz4_legacy_decompress(&bad).is_err());
    }

    /// One LZ4 block holding `data` as literals only (lz4's doc/lz4_Block_format.md: a token
    /// of 15 literals, then length bytes of 255 and a last one below 255).
    fn lz4_literal_block(data: &[u8]) -> Vec<u8> {
        let mut blk = Vec::new();
        if data.len() < 15 {
            blk.push((data.len() as u8) << 4);
        } else {
            blk.push(0xf0);
            let mut rest = data.len() - 15;
            while rest >= 255 {
                blk.push(255);
                rest -= 255;
            }
            blk.push(rest as u8);
        }
        blk.extend_from_slice(data);
        blk
    }

    /// An LZ4 legacy stream of one literal-only block per item of `blocks`, then the kernel's
    /// appended decompressed size.
    fn lz4_stream(blocks: &[&[u8]]) -> Vec<u8> {
        let mut s = LZ4_LEGACY_MAGIC.to_vec();
        let mut total = 0;
        for data in blocks {
            let blk = lz4_literal_block(data);
            s.extend_from_slice(&(blk.len() as u32).to_le_bytes());
            s.extend_from_slice(&blk);
            total += data.len();
        }
        s.extend_from_slice(&(total as u32).to_le_bytes());
        s
    }

    /// [`lz4_stream`] of one block.
    fn lz4_literals(data: &[u8]) -> Vec<u8> {
        lz4_stream(&[data])
    }

    /// A minimal little-endian ELF64 header (64 bytes) for machine `e_machine`.
    fn elf_header(e_machine: u16) -> Vec<u8> {
        let mut f = vec![0u8; 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2; // ELFCLASS64
        f[5] = 1; // ELFDATA2LSB
        f[6] = 1; // EV_CURRENT
        f[0x12..0x14].copy_from_slice(&e_machine.to_le_bytes());
        f[0x14..0x18].copy_from_slice(&1u32.to_le_bytes());
        f[0x34..0x36].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        f
    }

    /// What the test bzImages decompress to: an x86-64 ELF header and some bytes.
    fn kernel_elf() -> Vec<u8> {
        let mut k = elf_header(62);
        k.extend_from_slice(b"kernel text");
        k
    }

    /// A bzImage (boot protocol 2.15) whose header points at `payload`, with trailing bytes.
    fn bzimage(payload: &[u8]) -> Vec<u8> {
        let mut bz = vec![0u8; 1024];
        bz[0x1f1] = 1; // setup_sects: protected-mode code at (1 + 1) * 512
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        bz[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        bz[0x248..0x24c].copy_from_slice(&16u32.to_le_bytes());
        bz[0x24c..0x250].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        bz.extend_from_slice(&[0u8; 16]);
        bz.extend_from_slice(payload);
        bz.extend_from_slice(b"trailing signature bytes");
        bz
    }

    const BZ: &str = "/boot/vmlinuz-test";

    #[test]
    fn bzimage_payload_is_found_by_header_or_by_magic() {
        let payload = lz4_literals(&kernel_elf());
        let bz = bzimage(&payload);
        let file = Path::new(BZ);
        assert_eq!(payload_by_header(&bz), Some(&payload[..]));
        let (out, format) = extract_vmlinux(file, &bz).unwrap();
        assert_eq!((out, format), (kernel_elf(), "lz4"));
        // A header pointing past the file: the magic scan still finds the payload.
        let mut lying = bz.clone();
        lying[0x24c..0x250].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(payload_by_header(&lying), None);
        assert_eq!(extract_vmlinux(file, &lying).unwrap().0, kernel_elf());
        // A payload that is not an ELF file once decompressed is refused.
        let mut not_elf = vec![0u8; 8];
        not_elf.extend_from_slice(&lz4_literals(b"MZ-not-elf"));
        assert!(extract_vmlinux(file, &not_elf).is_err());
        for n in 0..bz.len() {
            let _ = extract_vmlinux(file, &bz[..n]);
        }
    }

    /// A truncated kernel file (a download cut short) or a corrupt LZ4 payload is an error
    /// that names the bzImage; none decodes to a shortened kernel, none panics.
    #[test]
    fn truncated_or_corrupt_kernel_lz4_is_an_error_naming_the_bzimage() {
        let elf = kernel_elf();
        let filler: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
        // Two blocks, so that a cut can fall between them.
        let payload = lz4_stream(&[&elf, &filler]);
        let bz = bzimage(&payload);
        let file = Path::new(BZ);
        let whole = [elf.clone(), filler.clone()].concat();
        assert_eq!(extract_vmlinux(file, &bz).unwrap().0, whole);
        let payload_end = 1024 + 16 + payload.len();
        for n in 0..payload_end {
            let err = extract_vmlinux(file, &bz[..n]).expect_err(&format!(
                "a bzImage cut at byte {n} of {payload_end} decoded"
            ));
            assert!(err.to_string().contains(BZ), "cut at {n}: {err}");
        }
        // Cut after the first block: named as truncated.
        let first_block_end = 1024 + 16 + 4 + 4 + lz4_literal_block(&elf).len();
        let err = extract_vmlinux(file, &bz[..first_block_end]).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        // Compressed bytes that hold another format's magic (as a real kernel's do: the
        // first half of 6.1.0-57-cloud-amd64's holds a zstd one) do not turn a truncated LZ4
        // payload into "zstd-compressed".
        let magic_filler = [&b"data "[..], &[0x28, 0xb5, 0x2f, 0xfd], &b" more data"[..]].concat();
        let bz = bzimage(&lz4_stream(&[&elf, &magic_filler, &filler]));
        let cut = 1024 + 16 + 4 + 4 + lz4_literal_block(&elf).len() + 4 + 10;
        let err = extract_vmlinux(file, &bz[..cut]).unwrap_err();
        assert!(err.to_string().contains("lz4 stream truncated"), "{err}");
        // A match reaching before the block's start (legacy blocks are independent).
        let mut corrupt = LZ4_LEGACY_MAGIC.to_vec();
        let blk = [0x10, b'a', 9, 0, 0x00];
        corrupt.extend_from_slice(&(blk.len() as u32).to_le_bytes());
        corrupt.extend_from_slice(&blk);
        corrupt.extend_from_slice(&1u32.to_le_bytes());
        let err = extract_vmlinux(file, &bzimage(&corrupt)).unwrap_err();
        assert!(matches!(err, KernelError::BzImage { .. }), "{err}");
        assert!(
            err.to_string().contains(BZ) && err.to_string().contains("corrupt"),
            "{err}"
        );
        // The size word disagreeing with what the blocks hold.
        let mut wrong = payload.clone();
        let at = wrong.len() - 4;
        wrong[at..].copy_from_slice(&(whole.len() as u32 + 1).to_le_bytes());
        let err = extract_vmlinux(file, &bzimage(&wrong)).unwrap_err();
        assert!(err.to_string().contains("decompressed size"), "{err}");
        // Every one-byte corruption of the payload: an error naming the file, or a decode.
        for i in 0..payload.len() {
            let mut c = bz.clone();
            c[1024 + 16 + i] ^= 0xa5;
            if let Err(e) = extract_vmlinux(file, &c) {
                assert!(e.to_string().contains(BZ), "byte {i}: {e}");
            }
        }
    }

    /// A kernel or module built for another machine is refused, saying so.
    #[test]
    fn elf_for_another_machine_than_x86_64_is_refused_by_name() {
        let aarch64 = elf_header(183);
        let err = elf_x86_64(&aarch64).unwrap_err();
        assert!(
            err.contains("machine 183") && err.contains("x86-64"),
            "{err}"
        );
        // A bzImage whose payload is an aarch64 ELF: a vmlinux error, not "no payload".
        let err = extract_vmlinux(Path::new(BZ), &bzimage(&lz4_literals(&aarch64))).unwrap_err();
        assert!(matches!(err, KernelError::Vmlinux { .. }), "{err}");
        assert!(err.to_string().contains("not x86-64"), "{err}");
        assert!(err.to_string().contains(BZ), "{err}");
        // A PVH note does not make an aarch64 kernel bootable here.
        let err = pvh_entry(Path::new(BZ), &pvh_kernel(183)).unwrap_err();
        assert!(err.to_string().contains("not x86-64"), "{err}");
        assert_eq!(
            pvh_entry(Path::new(BZ), &pvh_kernel(62)).unwrap(),
            0x0100_0850
        );
        // A module built for another machine.
        let mut ko = fake_module(b"depends=\0");
        ko[0x12..0x14].copy_from_slice(&183u16.to_le_bytes());
        assert!(module_depends(&ko).unwrap_err().contains("not x86-64"));
        // Big-endian and 32-bit files.
        let mut be = elf_header(62);
        be[5] = 2;
        assert!(elf_x86_64(&be).is_err());
        let mut elf32 = elf_header(62);
        elf32[4] = 1;
        assert!(elf_x86_64(&elf32).is_err());
    }

    #[test]
    fn non_elf_and_note_less_elf_are_refused() {
        let file = Path::new(BZ);
        assert!(pvh_entry(file, b"MZ not elf").is_err());
        let err = pvh_entry(file, &elf_header(62)).unwrap_err();
        assert!(matches!(err, KernelError::Vmlinux { .. }), "{err}");
        assert!(err.to_string().contains("no PVH entry note"), "{err}");
        assert!(extract_vmlinux(file, b"no kernel here").is_err());
        // A gzip payload is named, not decoded.
        let err = extract_vmlinux(file, &[0, 0, 0x1f, 0x8b, 0x08, 0, 0]).unwrap_err();
        assert!(err.to_string().contains("gzip"), "{err}");
    }

    #[test]
    fn shipped_recipe_parses_and_matches_the_defaults() {
        let r = KernelRecipe::parse(include_str!("../../base-images/kernel.yaml")).unwrap();
        assert_eq!(r.package, DEFAULT_PACKAGE);
        assert_eq!(r.modules, GUEST_MODULES);
        assert_eq!(r.init.target, crate::initramfs::INIT_TARGET);
        assert_eq!(KernelRecipe::shipped(), r);
        let typo = include_str!("../../base-images/kernel.yaml").replace("modules:", "modulse:");
        assert!(KernelRecipe::parse(&typo).is_err());
        assert!(KernelRecipe::parse("kind: image\npackage: x\n").is_err());
    }

    /// A minimal ELF64 relocatable with `.shstrtab` and a `.modinfo` holding `modinfo`.
    fn fake_module(modinfo: &[u8]) -> Vec<u8> {
        let shstrtab = b"\0.shstrtab\0.modinfo\0";
        let mut f = elf_header(62);
        f[0x10..0x12].copy_from_slice(&1u16.to_le_bytes()); // ET_REL
        let str_off = f.len();
        f.extend_from_slice(shstrtab);
        let info_off = f.len();
        f.extend_from_slice(modinfo);
        while !f.len().is_multiple_of(8) {
            f.push(0);
        }
        let shoff = f.len();
        let mut sh = |name: u32, ty: u32, off: usize, size: usize| {
            let mut h = [0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[4..8].copy_from_slice(&ty.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            f.extend_from_slice(&h);
        };
        sh(0, 0, 0, 0);
        sh(1, 3, str_off, shstrtab.len()); // SHT_STRTAB
        sh(11, 1, info_off, modinfo.len()); // SHT_PROGBITS
        f[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        f[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        f
    }

    #[test]
    fn module_closure_orders_dependencies_first_and_refuses_cycles_and_gaps() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("kernel/drivers");
        fs::create_dir_all(&sub).unwrap();
        let put = |name: &str, deps: &str| {
            let info = format!("license=GPL\0depends={deps}\0name={name}\0");
            fs::write(sub.join(format!("{name}.ko")), fake_module(info.as_bytes())).unwrap();
        };
        put("virtio_ring", "");
        put("virtio", "virtio_ring");
        put("virtio_blk", "virtio,virtio_ring");
        put("crc-x", "");
        put("uses_crc", "crc-x");
        let order: Vec<String> = module_closure(dir.path(), &["virtio_blk", "uses_crc"])
            .unwrap()
            .into_iter()
            .map(|m| m.name)
            .collect();
        assert_eq!(
            order,
            ["virtio_ring", "virtio", "virtio_blk", "crc_x", "uses_crc"]
        );

        put("loop_a", "loop_b");
        put("loop_b", "loop_a");
        assert!(matches!(
            module_closure(dir.path(), &["loop_a"]),
            Err(KernelError::Cycle(_))
        ));
        put("needs_ghost", "ghost");
        assert!(matches!(
            module_closure(dir.path(), &["needs_ghost"]),
            Err(KernelError::Module(name, _)) if name == "ghost"
        ));
    }

    #[test]
    fn hostile_module_files_are_errors_not_panics() {
        let good = fake_module(b"depends=a,b\0");
        assert_eq!(module_depends(&good).unwrap(), ["a", "b"]);
        // Every truncation, and garbage offsets in the header.
        for n in 0..good.len() {
            let _ = module_depends(&good[..n]);
        }
        for at in [0x28, 0x3a, 0x3c, 0x3e] {
            let mut bad = good.clone();
            bad[at] = 0xff;
            bad[at + 1] = 0xff;
            let _ = module_depends(&bad);
        }
        assert!(module_depends(b"\x7fELF").is_err());
        assert!(module_depends(&fake_module(b"")).unwrap().is_empty());
    }

    /// An ELF64 kernel for machine `e_machine`: header + one PT_NOTE phdr + a "Xen" note of
    /// type 18 (XEN_ELFNOTE_PHYS32_ENTRY) with an 8-byte entry, 0x0100_0850.
    fn pvh_kernel(e_machine: u16) -> Vec<u8> {
        let mut f = elf_header(e_machine);
        f[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        f[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        f[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let mut note = Vec::new();
        for v in [4u32, 8, 18] {
            note.extend_from_slice(&v.to_le_bytes());
        }
        note.extend_from_slice(b"Xen\0");
        note.extend_from_slice(&0x0100_0850u64.to_le_bytes());
        let mut ph = [0u8; 56];
        ph[..4].copy_from_slice(&4u32.to_le_bytes());
        ph[0x08..0x10].copy_from_slice(&(120u64).to_le_bytes());
        ph[0x20..0x28].copy_from_slice(&(note.len() as u64).to_le_bytes());
        f.extend_from_slice(&ph);
        f.extend_from_slice(&note);
        f
    }

    #[test]
    fn pvh_note_is_found_in_a_note_segment() {
        let file = Path::new(BZ);
        let f = pvh_kernel(62);
        assert_eq!(pvh_entry(file, &f).unwrap(), 0x0100_0850);
        for n in 0..f.len() {
            let _ = pvh_entry(file, &f[..n]);
        }
        // A segment claiming to run past the file.
        let mut bad = f.clone();
        bad[64 + 0x20..64 + 0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(pvh_entry(file, &bad).is_err());
    }

    #[test]
    fn xz_compressed_modules_are_decompressed() {
        let dir = tempfile::tempdir().unwrap();
        let plain = fake_module(b"depends=\0");
        let ko = dir.path().join("m.ko");
        fs::write(&ko, &plain).unwrap();
        let st = Command::new("xz")
            .arg("-k")
            .arg(&ko)
            .status()
            .expect("xz (xz-utils)");
        assert!(st.success());
        assert_eq!(module_bytes(&dir.path().join("m.ko.xz")).unwrap(), plain);
        assert!(module_bytes(&dir.path().join("m.ko.zst")).is_err());
        // Not xz, or cut short: an error naming the file.
        fs::write(dir.path().join("bad.ko.xz"), b"not xz at all").unwrap();
        let e = module_bytes(&dir.path().join("bad.ko.xz")).unwrap_err();
        assert!(e.to_string().contains("bad.ko.xz"), "{e}");
        let whole = fs::read(dir.path().join("m.ko.xz")).unwrap();
        fs::write(dir.path().join("cut.ko.xz"), &whole[..whole.len() / 2]).unwrap();
        let e = module_bytes(&dir.path().join("cut.ko.xz")).unwrap_err();
        assert!(e.to_string().contains("cut.ko.xz"), "{e}");
    }

    #[test]
    fn module_names_normalise_dashes_and_suffixes() {
        assert_eq!(module_name("virtio_blk.ko").as_deref(), Some("virtio_blk"));
        assert_eq!(
            module_name("crc-t10dif.ko.xz").as_deref(),
            Some("crc_t10dif")
        );
        assert_eq!(module_name("README"), None);
    }
}
