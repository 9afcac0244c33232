//! The guest initramfs: a deterministic cpio "newc" archive holding the static guest init as
//! `/init`, the kernel modules it loads (`/lib/modules/<name>.ko`, listed in load order in
//! `/kiln/modules`), `/dev/console` and the mount points the init uses.
//!
//! Format: cpio newc (the kernel's Documentation/driver-api/early-userspace/buffer-format.rst):
//! per entry a 110-byte ASCII header (`070701` and 13 eight-digit hex fields), the NUL-ended
//! name padded to 4 bytes, the data padded to 4 bytes; then a `TRAILER!!!` entry. Uncompressed
//! (the kernel reads it directly; the init dominates its size anyway). The headers, padding
//! and trailer are written by the `cpio` crate (`cpio::newc`); [`Cpio`] only chooses the
//! entries, their order and their fields.
//!
//! Determinism: entries sorted by path (parents before children), inode numbers assigned in
//! that order, mtime 0, uid/gid 0; identical inputs give identical bytes.
//!
//! The init binary: [`build_guest_init`] builds `kiln-guest-init` static
//! ([`INIT_RUSTFLAGS`]: `+crt-static`, stripped; `--target x86_64-unknown-linux-gnu` so build
//! scripts and proc macros stay dynamic) into its own target directory; `KILN_GUEST_INIT`
//! names a prebuilt one instead.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::kernel::{self, Kernel, KernelError};
use crate::replace_file;

/// Where the init finds its module list (must match kiln-guest-init's `MODULE_LIST`).
pub const MODULE_LIST: &str = "kiln/modules";

/// The target triple the init is built for (the gnu target is the one installed; glibc
/// links statically with `+crt-static`).
pub const INIT_TARGET: &str = "x86_64-unknown-linux-gnu";

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    /// A path is not a relative path of normal components.
    #[error("bad archive path {0:?}")]
    BadPath(String),
    /// The kernel's modules could not be gathered.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// Building the init failed.
    #[error("building kiln-guest-init: {0}")]
    Build(String),
    /// The init binary is not static.
    #[error("{0} is not a static executable (it has a PT_INTERP program header)")]
    NotStatic(PathBuf),
    /// The init binary is not an x86-64 ELF executable (the file, what it is instead).
    #[error("{0} cannot be the guest's init: {1}")]
    NotX86_64(PathBuf, String),
    /// I/O.
    #[error("{0}: {1}")]
    Io(String, io::Error),
}

#[derive(Debug, Clone)]
enum Entry {
    Dir { mode: u32 },
    File { mode: u32, data: Vec<u8> },
    CharDev { mode: u32, major: u32, minor: u32 },
}

/// The archive's length is a multiple of this many bytes (one 4 KiB page), padded with NULs
/// after the trailer. Why: QEMU's x86 loader puts a PVH kernel's initrd at the top of the RAM
/// below 4 GiB, starting on a page boundary, and on `-M microvm` keeps no room there for the
/// ACPI tables, which the machine's firmware (SeaBIOS, with `acpi=on`) writes into the last
/// page of that RAM. An initrd of `4096·q + r` bytes therefore ends `r` bytes into that page,
/// and once `r` reaches the tables (about 2.5 KiB from the end with the disks a build step's
/// VM has, less with fewer devices) it overwrites them: measured with QEMU 10.0 and Linux 6.1,
/// the kernel read a garbage DSDT (`ACPI: 0000 0x000000000FFFFD00`) and hung at `ACPI: Core
/// revision` on every boot with `r` = 4000, and booted every time with `r` = 0 or 100. With
/// the archive page-aligned the initrd ends where that last page starts, whatever its size.
/// Since kiln boots qboot instead ([`crate::launch::MACHINE`]), whose ACPI tables are in low
/// memory, nothing is written there; the alignment stays, costing at most a page, so that the
/// archive never depends on the firmware's layout again.
pub const ARCHIVE_ALIGN: u64 = 4096;

/// A writer that counts the bytes written through it.
struct Counting<'a, W: Write> {
    inner: &'a mut W,
    bytes: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A cpio newc archive being assembled. Paths are relative (`init`, `dev/console`); missing
/// parent directories are added (mode 0755).
#[derive(Debug, Default, Clone)]
pub struct Cpio {
    entries: BTreeMap<String, Entry>,
}

fn check_path(path: &str) -> Result<String, InitramfsError> {
    let p = path.trim_start_matches('/');
    if p.is_empty()
        || p.len() > 4096
        || p.split('/').any(|c| c.is_empty() || c == "." || c == "..")
        || p.contains('\0')
    {
        return Err(InitramfsError::BadPath(path.into()));
    }
    Ok(p.to_string())
}

impl Cpio {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn parents(&mut self, path: &str) {
        let mut at = 0;
        while let Some(i) = path[at..].find('/') {
            let dir = &path[..at + i];
            self.entries
                .entry(dir.to_string())
                .or_insert(Entry::Dir { mode: 0o755 });
            at += i + 1;
        }
    }

    /// Add a directory (permission bits `mode`).
    ///
    /// Errors: [`InitramfsError::BadPath`].
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), InitramfsError> {
        let p = check_path(path)?;
        self.parents(&p);
        self.entries.insert(
            p,
            Entry::Dir {
                mode: mode & 0o7777,
            },
        );
        Ok(())
    }

    /// Add a regular file.
    ///
    /// Errors: [`InitramfsError::BadPath`].
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) -> Result<(), InitramfsError> {
        let p = check_path(path)?;
        self.parents(&p);
        self.entries.insert(
            p,
            Entry::File {
                mode: mode & 0o7777,
                data,
            },
        );
        Ok(())
    }

    /// Add a character device node.
    ///
    /// Errors: [`InitramfsError::BadPath`].
    pub fn char_dev(
        &mut self,
        path: &str,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), InitramfsError> {
        let p = check_path(path)?;
        self.parents(&p);
        self.entries.insert(
            p,
            Entry::CharDev {
                mode: mode & 0o7777,
                major,
                minor,
            },
        );
        Ok(())
    }

    /// Write the archive (entries by the `cpio` crate's newc writer, then its trailer), then
    /// NUL bytes up to a multiple of [`ARCHIVE_ALIGN`] bytes (the kernel's unpacker skips
    /// NULs between and after archives: buffer-format.rst, "may be padded with NULs").
    ///
    /// Errors: I/O from `w`; a file over 4 GiB (the newc size field is 32 bits).
    pub fn write_to<W: Write>(&self, w: &mut W) -> io::Result<()> {
        let mut w = Counting { inner: w, bytes: 0 };
        let w = &mut w;
        for (ino, (path, entry)) in (1u32..).zip(&self.entries) {
            let (mode, nlink, data, rmaj, rmin): (u32, u32, &[u8], u32, u32) = match entry {
                Entry::Dir { mode } => (0o040000 | mode, 2, &[], 0, 0),
                Entry::File { mode, data } => (0o100000 | mode, 1, data, 0, 0),
                Entry::CharDev { mode, major, minor } => (0o020000 | mode, 1, &[], *major, *minor),
            };
            let size = u32::try_from(data.len())
                .map_err(|_| io::Error::other(format!("{path}: larger than 4 GiB")))?;
            // uid, gid, mtime and the device of the file itself default to 0.
            let mut out = cpio::newc::Builder::new(path)
                .ino(ino)
                .mode(mode)
                .nlink(nlink)
                .rdev_major(rmaj)
                .rdev_minor(rmin)
                .write(&mut *w, size);
            out.write_all(data)?;
            out.finish()?;
        }
        cpio::newc::trailer(&mut *w)?;
        let pad = (ARCHIVE_ALIGN - w.bytes % ARCHIVE_ALIGN) % ARCHIVE_ALIGN;
        w.write_all(&vec![0; pad as usize])?;
        Ok(())
    }

    /// The archive's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Writing to a Vec cannot fail, and every size was bounded when added... except files
        // over 4 GiB, which callers here never add (the init and modules are MiB).
        let _ = self.write_to(&mut out);
        out
    }
}

/// The guest initramfs: `init` (the static init's bytes), the `modules` (name, ELF bytes) in
/// load order under `lib/modules/`, their list in [`MODULE_LIST`], `dev/console` (5:1, so the
/// kernel gives the init a console before devtmpfs is mounted), and the directories `dev`,
/// `proc`, `sys`, `newroot`.
///
/// Errors: [`InitramfsError::BadPath`] for a module name with a `/`.
pub fn guest_initramfs(
    init: Vec<u8>,
    modules: Vec<(String, Vec<u8>)>,
) -> Result<Cpio, InitramfsError> {
    let mut c = Cpio::new();
    for d in ["dev", "proc", "sys", "newroot", "kiln", "lib/modules"] {
        c.dir(d, 0o755)?;
    }
    c.char_dev("dev/console", 0o600, 5, 1)?;
    c.file("init", 0o755, init)?;
    let mut list = String::new();
    for (name, bytes) in modules {
        if name.contains('/') {
            return Err(InitramfsError::BadPath(name));
        }
        let path = format!("lib/modules/{name}.ko");
        list.push_str(&format!("/{path}\n"));
        c.file(&path, 0o644, bytes)?;
    }
    c.file(MODULE_LIST, 0o644, list.into_bytes())?;
    Ok(c)
}

/// What [`build`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Initramfs {
    /// The archive file.
    pub path: PathBuf,
    /// `sha256:<hex>` of its bytes.
    pub sha256: String,
    /// Its size, bytes.
    pub size: u64,
    /// The modules in it, in load order.
    pub modules: Vec<String>,
}

/// Build the initramfs for `kernel` with the init at `init` into `out` (written to a temporary
/// file of its own in `out`'s directory and renamed, so concurrent builds never tear it): `modules` (e.g. [`kernel::GUEST_MODULES`]) and their
/// dependencies.
///
/// Errors: [`InitramfsError`]: an init that is not static, a missing module, I/O.
pub fn build(
    kernel: &Kernel,
    init: &Path,
    modules: &[&str],
    out: &Path,
) -> Result<Initramfs, InitramfsError> {
    let init_bytes =
        fs::read(init).map_err(|e| InitramfsError::Io(init.display().to_string(), e))?;
    check_init(init, &init_bytes)?;
    let mods = kernel::module_closure(&kernel.modules_dir(), modules)?;
    let mut loaded = Vec::new();
    for m in &mods {
        loaded.push((m.name.clone(), kernel::module_bytes(&m.path)?));
    }
    let bytes = guest_initramfs(init_bytes, loaded)?.to_bytes();
    replace_file(out, &bytes).map_err(|e| InitramfsError::Io(out.display().to_string(), e))?;
    Ok(Initramfs {
        path: out.into(),
        sha256: kernel::sha256_digest(&bytes),
        size: bytes.len() as u64,
        modules: mods.into_iter().map(|m| m.name).collect(),
    })
}

/// The guest kernel and initramfs, ready for `-kernel` and `-initrd`.
#[derive(Debug, Clone)]
pub struct GuestArtifacts {
    /// The kernel (its `vmlinux()` and digests).
    pub kernel: Kernel,
    /// The initramfs.
    pub initramfs: Initramfs,
}

/// Fetch the kernel of `recipe` and build (or reuse) its initramfs with the init at `init`,
/// both cached under `cache_dir`: the initramfs at
/// `<cache>/initramfs/<hex of sha256(vmlinux digest, init bytes, module names)>.cpio`.
///
/// Errors: [`InitramfsError`] (kernel fetch errors inside [`InitramfsError::Kernel`]).
pub fn guest_artifacts(
    cache_dir: &Path,
    recipe: &kernel::KernelRecipe,
    init: &Path,
) -> Result<GuestArtifacts, InitramfsError> {
    use sha2::{Digest, Sha256};
    // Check the init before fetching anything.
    let init_bytes =
        fs::read(init).map_err(|e| InitramfsError::Io(init.display().to_string(), e))?;
    check_init(init, &init_bytes)?;
    let k = kernel::fetch(cache_dir, &recipe.package)?;
    let mut h = Sha256::new();
    h.update(k.vmlinux_sha256.as_bytes());
    h.update([0]);
    h.update(Sha256::digest(&init_bytes));
    for m in &recipe.modules {
        h.update(m.as_bytes());
        h.update([0]);
    }
    let dir = cache_dir.join("initramfs");
    fs::create_dir_all(&dir).map_err(|e| InitramfsError::Io(dir.display().to_string(), e))?;
    let out = dir.join(format!("{}.cpio", hex::encode(h.finalize())));
    let modules: Vec<&str> = recipe.modules.iter().map(String::as_str).collect();
    // Rebuilding is cheap (a few MiB) and deterministic: the bytes are the same each time,
    // so the cached file is only an optimisation for callers that hash it.
    let initramfs = build(&k, init, &modules, &out)?;
    Ok(GuestArtifacts {
        kernel: k,
        initramfs,
    })
}

/// The static init to put in initramfs files outside a source checkout: `KILN_GUEST_INIT`
/// when set, else `kiln-guest-init` beside the running executable (where a release ships it).
///
/// Errors: [`InitramfsError::Io`] when neither exists, [`InitramfsError::NotStatic`],
/// [`InitramfsError::NotX86_64`].
pub fn find_guest_init() -> Result<PathBuf, InitramfsError> {
    let path = match std::env::var_os("KILN_GUEST_INIT") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()
            .map_err(|e| InitramfsError::Io("the running executable".into(), e))?
            .with_file_name("kiln-guest-init"),
    };
    let bytes = fs::read(&path).map_err(|e| {
        InitramfsError::Io(
            format!(
                "{} (build it: RUSTFLAGS='-C target-feature=+crt-static -C strip=symbols' cargo build --release \
                 -p kiln-guest --bin kiln-guest-init --target {INIT_TARGET}; or set KILN_GUEST_INIT)",
                path.display()
            ),
            e,
        )
    })?;
    check_init(&path, &bytes)?;
    Ok(path)
}

/// Check that `bytes`, the file at `path`, can be the guest's `/init`: an x86-64 ELF64
/// executable with no PT_INTERP program header (statically linked; [`is_static`]).
///
/// Errors: [`InitramfsError::NotX86_64`], [`InitramfsError::NotStatic`].
pub fn check_init(path: &Path, bytes: &[u8]) -> Result<(), InitramfsError> {
    match is_static(bytes) {
        Ok(true) => Ok(()),
        Ok(false) => Err(InitramfsError::NotStatic(path.into())),
        Err(why) => Err(InitramfsError::NotX86_64(path.into(), why)),
    }
}

/// Whether an x86-64 ELF64 executable has no PT_INTERP program header (is statically
/// linked); program headers read with the `object` crate.
///
/// Errors (a message): not an x86-64 ELF64 file, malformed program headers.
pub fn is_static(elf: &[u8]) -> Result<bool, String> {
    use object::read::elf::{FileHeader, ProgramHeader};
    let (header, endian) = kernel::elf_x86_64(elf)?;
    let phdrs = header
        .program_headers(endian, elf)
        .map_err(|e| format!("program headers: {e}"))?;
    Ok(phdrs
        .iter()
        .all(|ph| ph.p_type(endian) != object::elf::PT_INTERP))
}

/// RUSTFLAGS of the init's build: static (glibc's `+crt-static`), symbols stripped (the guest
/// never reads them: the init is 2.4 MB unstripped, 2.0 MB stripped).
/// The boots that an unstripped init's archive (3.03 MB) made hang were the initrd overlapping
/// the ACPI tables, which [`ARCHIVE_ALIGN`] rules out for every size.
pub const INIT_RUSTFLAGS: &str = "-C target-feature=+crt-static -C strip=symbols";

/// Build `kiln-guest-init` static from the workspace at `workspace` into `target_dir`
/// (`cargo build --locked --release -p kiln-guest --bin kiln-guest-init --target
/// x86_64-unknown-linux-gnu` with `RUSTFLAGS=`[`INIT_RUSTFLAGS`]), or take the
/// file named by `KILN_GUEST_INIT` when set. Returns the binary's path, checked static.
///
/// `cargo` is `$CARGO` when set (as under `cargo test`), else `cargo` from `PATH`.
///
/// Errors: [`InitramfsError::Build`] (cargo failed; its stderr), [`InitramfsError::NotStatic`],
/// [`InitramfsError::NotX86_64`].
pub fn build_guest_init(workspace: &Path, target_dir: &Path) -> Result<PathBuf, InitramfsError> {
    if let Some(p) = std::env::var_os("KILN_GUEST_INIT") {
        let p = PathBuf::from(p);
        let bytes = fs::read(&p).map_err(|e| InitramfsError::Io(p.display().to_string(), e))?;
        check_init(&p, &bytes)?;
        return Ok(p);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace)
        .args([
            "build",
            "--locked",
            "--release",
            "-p",
            "kiln-guest",
            "--bin",
            "kiln-guest-init",
            "--target",
            INIT_TARGET,
        ])
        .env("CARGO_TARGET_DIR", target_dir)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env("RUSTFLAGS", INIT_RUSTFLAGS)
        .output()
        .map_err(|e| InitramfsError::Build(e.to_string()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(30).collect();
        return Err(InitramfsError::Build(
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        ));
    }
    let bin = target_dir
        .join(INIT_TARGET)
        .join("release")
        .join("kiln-guest-init");
    let bytes = fs::read(&bin).map_err(|e| InitramfsError::Io(bin.display().to_string(), e))?;
    check_init(&bin, &bytes)?;
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, mode, (rdev major, minor), data).
    type Parsed = (String, u32, (u32, u32), Vec<u8>);

    /// Parse a newc archive back (test-side reader), in order.
    fn parse(mut b: &[u8]) -> Vec<Parsed> {
        let mut out = Vec::new();
        let total = b.len();
        loop {
            assert_eq!(&b[..6], b"070701");
            let f = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&b[6 + i * 8..14 + i * 8]).unwrap(), 16)
                    .unwrap()
            };
            let (mode, size, rmaj, rmin, namesize) = (f(1), f(6), f(9), f(10), f(11));
            assert_eq!(f(5), 0, "mtime");
            let name = std::str::from_utf8(&b[110..110 + namesize as usize - 1])
                .unwrap()
                .to_string();
            let mut at = 110 + namesize as usize;
            at += (4 - (total - b.len() + at) % 4) % 4;
            let data = b[at..at + size as usize].to_vec();
            at += size as usize;
            at += (4 - (total - b.len() + at) % 4) % 4;
            b = &b[at..];
            if name == "TRAILER!!!" {
                assert!(b.iter().all(|&x| x == 0), "only NULs after the trailer");
                assert!(
                    b.len() < ARCHIVE_ALIGN as usize,
                    "{} bytes of padding",
                    b.len()
                );
                assert_eq!(total as u64 % ARCHIVE_ALIGN, 0, "{total} bytes");
                return out;
            }
            out.push((name, mode, (rmaj, rmin), data));
        }
    }

    #[test]
    fn archive_is_sorted_with_parents_and_deterministic() {
        let mk = || {
            guest_initramfs(
                b"\x7fELFinit".to_vec(),
                vec![
                    ("virtio".into(), b"a".to_vec()),
                    ("virtio_blk".into(), b"bb".to_vec()),
                ],
            )
            .unwrap()
            .to_bytes()
        };
        let bytes = mk();
        assert_eq!(bytes, mk());
        // Pinned, because the snapshot compatibility key holds the initramfs digest: the
        // `cpio` crate's entries are those of the hand-written writer before it, and the last
        // change was the page padding after the trailer (ARCHIVE_ALIGN).
        assert_eq!(
            kernel::sha256_digest(&bytes),
            "sha256:e8151a4f332006b1b3cfeaa57b40fd2e81da844a54a9715078f3a97e3fb1aaf1"
        );
        let entries = parse(&bytes);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(names.contains(&"lib"));
        let init = entries.iter().find(|e| e.0 == "init").unwrap();
        assert_eq!(init.1, 0o100755);
        assert_eq!(init.3, b"\x7fELFinit");
        let console = entries.iter().find(|e| e.0 == "dev/console").unwrap();
        assert_eq!((console.1, console.2), (0o020600, (5, 1)));
        let list = entries.iter().find(|e| e.0 == MODULE_LIST).unwrap();
        assert_eq!(
            std::str::from_utf8(&list.3).unwrap(),
            "/lib/modules/virtio.ko\n/lib/modules/virtio_blk.ko\n"
        );
    }

    /// Writers replacing one file at once while a reader opens it: the reader only ever sees
    /// one writer's whole content (the bug: a shared temporary name let a writer truncate
    /// the file another then renamed into place).
    #[test]
    fn concurrent_replacements_never_show_a_torn_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("i.cpio");
        let whole: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i; 1 << 20]).collect();
        replace_file(&out, &whole[0]).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let mut seen = 0usize;
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut reads = 0usize;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let got = fs::read(&out).unwrap();
                    assert!(whole.contains(&got), "a torn file of {} bytes", got.len());
                    reads += 1;
                }
                reads
            });
            let writers: Vec<_> = whole
                .iter()
                .map(|w| {
                    let out = &out;
                    s.spawn(move || {
                        for _ in 0..40 {
                            replace_file(out, w).unwrap();
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            seen = reader.join().unwrap();
        });
        assert!(seen > 0);
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&fs::metadata(&out).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o644);
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
    }

    #[test]
    fn escaping_paths_are_refused() {
        let mut c = Cpio::new();
        for p in ["../x", "a/../b", "a//b", "", "/", "a/./b"] {
            assert!(c.file(p, 0o644, vec![]).is_err(), "{p}");
        }
        assert!(guest_initramfs(vec![], vec![("../evil".into(), vec![])]).is_err());
    }

    /// A minimal x86-64 (`e_machine` 62, or `machine`) ELF64 executable with one program
    /// header of type `p_type`.
    fn elf_exec(machine: u16, p_type: u32) -> Vec<u8> {
        let mut f = vec![0u8; 64 + 56];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[6] = 1;
        f[0x10..0x12].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        f[0x12..0x14].copy_from_slice(&machine.to_le_bytes());
        f[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        f[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        f[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        f[64..68].copy_from_slice(&p_type.to_le_bytes());
        f
    }

    #[test]
    fn static_check_reads_program_headers() {
        assert!(is_static(b"#!/bin/sh").is_err());
        let me = fs::read("/proc/self/exe").unwrap();
        // The test binary is dynamically linked (it has an interpreter).
        assert_eq!(is_static(&me), Ok(false));
        assert_eq!(is_static(&elf_exec(62, 1)), Ok(true)); // PT_LOAD only
        assert_eq!(is_static(&elf_exec(62, 3)), Ok(false)); // PT_INTERP
        let p = Path::new("/x/init");
        assert!(matches!(
            check_init(p, &me),
            Err(InitramfsError::NotStatic(q)) if q == p
        ));
        assert!(check_init(p, &elf_exec(62, 1)).is_ok());
    }

    /// An init built for another machine is refused as such, naming the file (before, it
    /// passed as "static" when it had no PT_INTERP).
    #[test]
    fn init_for_another_machine_is_refused_naming_the_file() {
        let p = Path::new("/x/aarch64-init");
        let err = check_init(p, &elf_exec(183, 1)).unwrap_err();
        assert!(matches!(err, InitramfsError::NotX86_64(..)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("/x/aarch64-init") && msg.contains("not x86-64"),
            "{msg}"
        );
        let err = check_init(p, b"#!/bin/sh\n").unwrap_err();
        assert!(err.to_string().contains("not an ELF file"), "{err}");
    }
}
