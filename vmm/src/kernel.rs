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
//!    magic as the kernel's `scripts/extract-vmlinux` does; the result must be an ELF file
//!    with a PVH entry note ([`pvh_entry`]);
//! 5. keep `lib/modules/<release>` beside it for the initramfs ([`module_closure`]).
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

/// The modules the guest needs (virtio-mmio transport, the root disk, the host port); their
/// dependencies are added by [`module_closure`].
pub const GUEST_MODULES: [&str; 3] = ["virtio_mmio", "virtio_blk", "virtio_console"];

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
                rustflags: "-C target-feature=+crt-static".into(),
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
    #[error("bzImage: {0}")]
    BzImage(String),
    /// The decompressed kernel is not a PVH-bootable ELF.
    #[error("vmlinux: {0}")]
    Vmlinux(String),
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
    let mut buf = Vec::new();
    f.take(MAX_INPUT + 1)
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
        .ok_or_else(|| KernelError::BzImage("no /boot/vmlinuz-* in the package".into()))?;
    let release = vmlinuz
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("vmlinuz-"))
        .unwrap_or_default()
        .to_string();
    let bz = read_bounded(&vmlinuz)?;
    let (vmlinux, compression) = extract_vmlinux(&bz)?;
    let pvh = pvh_entry(&vmlinux)?;

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
fn le64(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
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
///
/// Only LZ4 (Debian cloud kernels: `CONFIG_KERNEL_LZ4`) is decompressed; another format is
/// named in the error.
///
/// Errors: [`KernelError::BzImage`] (no payload, unsupported or corrupt compression),
/// [`KernelError::Vmlinux`] (the result is not ELF).
pub fn extract_vmlinux(bz: &[u8]) -> Result<(Vec<u8>, &'static str), KernelError> {
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
    let mut last = String::from("no compressed payload found");
    for payload in candidates {
        let Some((name, _)) = MAGICS.iter().find(|(_, m)| payload.starts_with(m)) else {
            continue;
        };
        if *name != "lz4" {
            last = format!("payload is {name}-compressed; only lz4 is supported");
            continue;
        }
        match lz4_legacy_decompress(payload) {
            Ok(out) if out.starts_with(b"\x7fELF") => return Ok((out, "lz4")),
            Ok(_) => last = "lz4 payload does not decompress to an ELF file".into(),
            Err(e) => last = e,
        }
    }
    Err(KernelError::BzImage(last))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Decompress an LZ4 legacy-format stream (magic 0x184C2102, then blocks of `u32 LE
/// compressed size` + LZ4 block, each at most 8 MiB decompressed; lz4's
/// doc/lz4_Frame_format.md, "Legacy frame"). Stops at the end of input or at a block size
/// that does not fit (the kernel appends the decompressed size after the stream).
fn lz4_legacy_decompress(input: &[u8]) -> Result<Vec<u8>, String> {
    const BLOCK_MAX: usize = 8 << 20;
    let mut pos = 4;
    let mut out = Vec::new();
    while let Some(size) = le32(input, pos) {
        if size.to_le_bytes() == LZ4_LEGACY_MAGIC {
            pos += 4;
            continue;
        }
        let size = size as usize;
        // The kernel appends the decompressed length after the stream (scripts/Makefile.lib,
        // size_append): reaching it ends the stream even when bytes follow (a signature).
        if !out.is_empty() && size == out.len() {
            break;
        }
        let Some(block) = input.get(pos + 4..pos + 4 + size) else {
            break;
        };
        if size == 0 {
            break;
        }
        lz4_block(block, &mut out, BLOCK_MAX)?;
        if out.len() > MAX_VMLINUX {
            return Err("decompressed kernel larger than 512 MiB".into());
        }
        pos += 4 + size;
    }
    if out.is_empty() {
        return Err("empty lz4 stream".into());
    }
    Ok(out)
}

/// Decompress one LZ4 block (lz4's doc/lz4_Block_format.md) onto `out`, at most `max` bytes.
/// Matches may reach back into earlier blocks' output (the legacy format links blocks).
fn lz4_block(src: &[u8], out: &mut Vec<u8>, max: usize) -> Result<(), String> {
    let start = out.len();
    let mut i = 0;
    let byte = |i: &mut usize| -> Result<u8, String> {
        let b = *src.get(*i).ok_or("lz4 block truncated")?;
        *i += 1;
        Ok(b)
    };
    let ext = |i: &mut usize, mut n: usize| -> Result<usize, String> {
        loop {
            let b = byte(i)?;
            n += b as usize;
            if b != 255 {
                return Ok(n);
            }
        }
    };
    loop {
        let token = byte(&mut i)?;
        let mut lit = (token >> 4) as usize;
        if lit == 15 {
            lit = ext(&mut i, lit)?;
        }
        let lits = src.get(i..i + lit).ok_or("lz4 literals past the block")?;
        out.extend_from_slice(lits);
        i += lit;
        if i == src.len() {
            break;
        }
        let off = le16(src, i).ok_or("lz4 offset truncated")? as usize;
        i += 2;
        let mut mlen = (token & 15) as usize;
        if mlen == 15 {
            mlen = ext(&mut i, mlen)?;
        }
        mlen += 4;
        if off == 0 || off > out.len() {
            return Err("lz4 match offset out of range".into());
        }
        if out.len() - start + mlen > max {
            return Err("lz4 block decompresses past its limit".into());
        }
        let from = out.len() - off;
        for k in 0..mlen {
            let b = out[from + k];
            out.push(b);
        }
    }
    if out.len() - start > max {
        return Err("lz4 block decompresses past its limit".into());
    }
    Ok(())
}

/// The PVH entry point of an ELF64 kernel: the `Xen` note of type
/// XEN_ELFNOTE_PHYS32_ENTRY (18; xen/include/public/elfnote.h) in a PT_NOTE segment.
///
/// Errors: [`KernelError::Vmlinux`] for a non-ELF64 file or no such note.
pub fn pvh_entry(elf: &[u8]) -> Result<u64, KernelError> {
    let bad = |m: &str| KernelError::Vmlinux(m.into());
    if !elf.starts_with(b"\x7fELF") || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err(bad("not a little-endian ELF64 file"));
    }
    let phoff = le64(elf, 0x20).ok_or_else(|| bad("short header"))? as usize;
    let phentsize = le16(elf, 0x36).ok_or_else(|| bad("short header"))? as usize;
    let phnum = le16(elf, 0x38).ok_or_else(|| bad("short header"))? as usize;
    for n in 0..phnum {
        let ph = phoff + n * phentsize;
        if le32(elf, ph) != Some(4) {
            continue; // not PT_NOTE
        }
        let off = le64(elf, ph + 0x08).ok_or_else(|| bad("short phdr"))? as usize;
        let size = le64(elf, ph + 0x20).ok_or_else(|| bad("short phdr"))? as usize;
        let notes = elf
            .get(off..off.saturating_add(size))
            .ok_or_else(|| bad("note segment past the end"))?;
        let mut p = 0;
        while p + 12 <= notes.len() {
            let namesz = le32(notes, p).unwrap_or(0) as usize;
            let descsz = le32(notes, p + 4).unwrap_or(0) as usize;
            let ty = le32(notes, p + 8).unwrap_or(0);
            let name_at = p + 12;
            let desc_at = name_at + namesz.div_ceil(4) * 4;
            let next = desc_at + descsz.div_ceil(4) * 4;
            if next > notes.len() {
                break;
            }
            if ty == 18 && notes.get(name_at..name_at + namesz) == Some(b"Xen\0") {
                let desc = &notes[desc_at..desc_at + descsz];
                return match descsz {
                    4 => Ok(le32(desc, 0).unwrap_or(0).into()),
                    8 => Ok(le64(desc, 0).unwrap_or(0)),
                    _ => Err(bad("PVH note of unexpected size")),
                };
            }
            p = next;
        }
    }
    Err(bad(
        "no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY): the kernel lacks CONFIG_PVH",
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

/// The plain ELF bytes of a module file (`.ko`; `.ko.xz` is decompressed with `xz -dc`,
/// for kernels that cannot load compressed modules themselves).
pub fn module_bytes(path: &Path) -> Result<Vec<u8>, KernelError> {
    let name = path.display().to_string();
    if name.ends_with(".ko") {
        return read_bounded(path);
    }
    if name.ends_with(".ko.xz") {
        let out = Command::new("xz")
            .arg("-dc")
            .arg(path)
            .output()
            .map_err(|e| KernelError::Module(name.clone(), format!("xz: {e}")))?;
        if !out.status.success() {
            return Err(KernelError::Module(name, "xz -dc failed".into()));
        }
        return Ok(out.stdout);
    }
    Err(KernelError::Module(
        name,
        "unsupported module compression".into(),
    ))
}

/// The `depends=` list of a module's `.modinfo` section (ELF64 section headers).
pub fn module_depends(ko: &[u8]) -> Result<Vec<String>, String> {
    if !ko.starts_with(b"\x7fELF") || ko.get(4) != Some(&2) {
        return Err("not an ELF64 file".into());
    }
    let shoff = le64(ko, 0x28).ok_or("short header")? as usize;
    let shentsize = le16(ko, 0x3a).ok_or("short header")? as usize;
    let shnum = le16(ko, 0x3c).ok_or("short header")? as usize;
    let shstrndx = le16(ko, 0x3e).ok_or("short header")? as usize;
    let sect = |n: usize| -> Option<(u32, usize, usize)> {
        let sh = shoff.checked_add(n.checked_mul(shentsize)?)?;
        Some((
            le32(ko, sh)?,
            le64(ko, sh + 0x18)? as usize,
            le64(ko, sh + 0x20)? as usize,
        ))
    };
    let (_, str_off, str_size) = sect(shstrndx).ok_or("bad section string table")?;
    let strtab = ko
        .get(str_off..str_off.saturating_add(str_size))
        .ok_or("section string table past the end")?;
    for n in 0..shnum {
        let (name_off, off, size) = sect(n).ok_or("bad section header")?;
        let name = strtab
            .get(name_off as usize..)
            .and_then(|s| s.split(|b| *b == 0).next())
            .unwrap_or_default();
        if name != b".modinfo" {
            continue;
        }
        let data = ko
            .get(off..off.saturating_add(size))
            .ok_or(".modinfo past the end")?;
        for kv in data.split(|b| *b == 0) {
            if let Some(deps) = kv.strip_prefix(b"depends=") {
                return Ok(String::from_utf8_lossy(deps)
                    .split(',')
                    .filter(|d| !d.is_empty())
                    .map(|d| d.replace('-', "_"))
                    .collect());
            }
        }
        return Ok(Vec::new());
    }
    Err("no .modinfo section".into())
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

    /// An LZ4 legacy stream of one literal-only block holding `data` (< 15 bytes), then the
    /// kernel's appended decompressed size.
    fn lz4_literals(data: &[u8]) -> Vec<u8> {
        let mut s = LZ4_LEGACY_MAGIC.to_vec();
        let mut blk = vec![(data.len() as u8) << 4];
        blk.extend_from_slice(data);
        s.extend_from_slice(&(blk.len() as u32).to_le_bytes());
        s.extend_from_slice(&blk);
        s.extend_from_slice(&(data.len() as u32).to_le_bytes());
        s
    }

    #[test]
    fn bzimage_payload_is_found_by_header_or_by_magic() {
        let payload = lz4_literals(b"\x7fELF-kernel");
        let mut bz = vec![0u8; 1024];
        bz[0x1f1] = 1; // setup_sects: protected-mode code at (1 + 1) * 512
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        bz[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        bz[0x248..0x24c].copy_from_slice(&16u32.to_le_bytes());
        bz[0x24c..0x250].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        bz.extend_from_slice(&[0u8; 16]);
        bz.extend_from_slice(&payload);
        bz.extend_from_slice(b"trailing signature bytes");
        assert_eq!(payload_by_header(&bz), Some(&payload[..]));
        let (out, format) = extract_vmlinux(&bz).unwrap();
        assert_eq!((out.as_slice(), format), (&b"\x7fELF-kernel"[..], "lz4"));
        // A header pointing past the file: the magic scan still finds the payload.
        let mut lying = bz.clone();
        lying[0x24c..0x250].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(payload_by_header(&lying), None);
        assert_eq!(extract_vmlinux(&lying).unwrap().0, b"\x7fELF-kernel");
        // A payload that is not an ELF file once decompressed is refused.
        let mut not_elf = vec![0u8; 8];
        not_elf.extend_from_slice(&lz4_literals(b"MZ-not-elf"));
        assert!(extract_vmlinux(&not_elf).is_err());
        for n in 0..bz.len() {
            let _ = extract_vmlinux(&bz[..n]);
        }
    }

    #[test]
    fn non_elf_and_note_less_elf_are_refused() {
        assert!(pvh_entry(b"MZ not elf").is_err());
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        assert!(matches!(pvh_entry(&elf), Err(KernelError::Vmlinux(_))));
        assert!(extract_vmlinux(b"no kernel here").is_err());
        // A gzip payload is named, not decoded.
        let err = extract_vmlinux(&[0, 0, 0x1f, 0x8b, 0x08, 0, 0]).unwrap_err();
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
        let mut f = vec![0u8; 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        let str_off = f.len();
        f.extend_from_slice(shstrtab);
        let info_off = f.len();
        f.extend_from_slice(modinfo);
        while !f.len().is_multiple_of(8) {
            f.push(0);
        }
        let shoff = f.len();
        let mut sh = |name: u32, off: usize, size: usize| {
            let mut h = [0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            f.extend_from_slice(&h);
        };
        sh(0, 0, 0);
        sh(1, str_off, shstrtab.len());
        sh(11, info_off, modinfo.len());
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

    #[test]
    fn pvh_note_is_found_in_a_note_segment() {
        // ELF64 header + one PT_NOTE phdr + a "Xen" note of type 18 with an 8-byte entry.
        let mut f = vec![0u8; 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
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
        assert_eq!(pvh_entry(&f).unwrap(), 0x0100_0850);
        for n in 0..f.len() {
            let _ = pvh_entry(&f[..n]);
        }
        // A segment claiming to run past the file.
        let mut bad = f.clone();
        bad[64 + 0x20..64 + 0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(pvh_entry(&bad).is_err());
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
