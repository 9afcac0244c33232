//! The kernel and initramfs a restore hands QEMU in place of the snapshot's.
//!
//! A QEMU started `-incoming` for a snapshot never runs the kernel it is given: the guest's
//! kernel is in the snapshot's memory, and the ROM blobs `-kernel` and `-initrd` make are not
//! written into guest RAM while a migration is incoming. What the migration does need is the
//! machine the kernel shaped: `-M microvm` loads an ELF kernel through the PVH option ROM
//! (`genroms/pvh.bin`, whose RAM block and fw_cfg entry are in the vmstate), so the file must
//! be an ELF with a PVH entry note (`XEN_ELFNOTE_PHYS32_ENTRY`, Xen's `elfnote.h`; QEMU
//! `hw/i386/x86-common.c`, `load_elfboot`). [`pvh_stub`] is such an ELF, 200 bytes, whose one
//! loadable segment is its note. The initramfs is one byte: fw_cfg's data is not migrated.
//!
//! Measured (issue 35, busybox snapshot under TCG, QEMU 10.0): clones restored with these
//! run as those restored with the real files (same kernel release, command line and root);
//! a cold start from S3 no longer fetches the 53 MB kernel and 3 MB initramfs before QEMU,
//! and QEMU's start no longer reads them.

use std::path::{Path, PathBuf};

use super::{LaunchError, io_err};

/// Where the PVH entry note says the kernel starts, a guest-physical address: Linux's
/// (`0x1000000`, `LOAD_PHYSICAL_ADDR`). Never jumped to: a restore resumes the saved CPUs.
const ENTRY: u32 = 0x0100_0000;

/// `XEN_ELFNOTE_PHYS32_ENTRY` (Xen `public/elfnote.h`).
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// The stub kernel: an ELF64 x86-64 executable (header, then a `PT_LOAD` and a `PT_NOTE`
/// program header, then one note `Xen`/18 whose 8-byte descriptor is [`ENTRY`]), 200 bytes (ELF layout: the System V gABI, "ELF Header", "Program Header", "Note
/// Section").
pub fn pvh_stub() -> Vec<u8> {
    const EHDR: u64 = 64;
    const PHDR: u64 = 56;
    let note_off = EHDR + 2 * PHDR;
    // namesz, descsz, type, "Xen\0", descriptor (8 bytes: QEMU reads a u64 for an ELF64).
    let mut note = Vec::new();
    note.extend(4u32.to_le_bytes());
    note.extend(8u32.to_le_bytes());
    note.extend(XEN_ELFNOTE_PHYS32_ENTRY.to_le_bytes());
    note.extend(b"Xen\0");
    note.extend(u64::from(ENTRY).to_le_bytes());
    let note_len = note.len() as u64;
    let mut b = Vec::with_capacity((note_off + note_len) as usize);
    // e_ident: magic, ELFCLASS64, ELFDATA2LSB, EV_CURRENT, ELFOSABI_NONE, padding.
    b.extend(b"\x7fELF\x02\x01\x01\x00");
    b.extend([0u8; 8]);
    b.extend(2u16.to_le_bytes()); // e_type: ET_EXEC
    b.extend(62u16.to_le_bytes()); // e_machine: EM_X86_64
    b.extend(1u32.to_le_bytes()); // e_version
    b.extend(u64::from(ENTRY).to_le_bytes()); // e_entry
    b.extend(EHDR.to_le_bytes()); // e_phoff
    b.extend(0u64.to_le_bytes()); // e_shoff: no sections
    b.extend(0u32.to_le_bytes()); // e_flags
    b.extend((EHDR as u16).to_le_bytes()); // e_ehsize
    b.extend((PHDR as u16).to_le_bytes()); // e_phentsize
    b.extend(2u16.to_le_bytes()); // e_phnum
    b.extend(64u16.to_le_bytes()); // e_shentsize
    b.extend(0u16.to_le_bytes()); // e_shnum
    b.extend(0u16.to_le_bytes()); // e_shstrndx
    // (p_type, p_flags): PT_LOAD R+X, then PT_NOTE R; both cover the note, 4-aligned (QEMU
    // aligns the note's name to the PT_NOTE's p_align).
    for (p_type, p_flags) in [(1u32, 5u32), (4, 4)] {
        b.extend(p_type.to_le_bytes());
        b.extend(p_flags.to_le_bytes());
        b.extend(note_off.to_le_bytes()); // p_offset
        b.extend(u64::from(ENTRY).to_le_bytes()); // p_vaddr
        b.extend(u64::from(ENTRY).to_le_bytes()); // p_paddr
        b.extend(note_len.to_le_bytes()); // p_filesz
        b.extend(note_len.to_le_bytes()); // p_memsz
        b.extend(4u64.to_le_bytes()); // p_align
    }
    b.extend(note);
    b
}

/// The stub kernel and initramfs, written under `dir` (`restore-vmlinux`,
/// `restore-initramfs`) unless already there with these bytes (a copy that differs is
/// replaced: [`crate::replace_file`]).
///
/// Errors: creating `dir` or writing either file ([`LaunchError::Io`]).
pub fn restore_stub(dir: &Path) -> Result<(PathBuf, PathBuf), LaunchError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let kernel = dir.join("restore-vmlinux");
    let initramfs = dir.join("restore-initramfs");
    for (path, bytes) in [(&kernel, pvh_stub()), (&initramfs, vec![0u8])] {
        if std::fs::read(path).is_ok_and(|b| b == bytes) {
            continue;
        }
        crate::replace_file(path, &bytes).map_err(io_err(path))?;
    }
    Ok((kernel, initramfs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stub_is_an_elf_with_a_pvh_entry_note() {
        let b = pvh_stub();
        assert_eq!(b.len(), 200);
        assert_eq!(&b[..4], b"\x7fELF");
        // readelf(1) agrees, where binutils is installed.
        let d = tempfile::tempdir().unwrap();
        let (k, i) = restore_stub(d.path()).unwrap();
        assert_eq!(std::fs::read(&k).unwrap(), b);
        assert_eq!(std::fs::read(&i).unwrap(), vec![0u8]);
        if let Ok(out) = std::process::Command::new("readelf")
            .args(["-lnW"])
            .arg(&k)
            .output()
        {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{text}");
            assert!(text.contains("LOAD") && text.contains("NOTE"), "{text}");
            assert!(text.contains("Xen"), "{text}");
            assert!(text.contains("0x00000008"), "descriptor size: {text}");
        }
        // Written again only when it differs.
        std::fs::write(&k, b"old").unwrap();
        restore_stub(d.path()).unwrap();
        assert_eq!(std::fs::read(&k).unwrap(), b);
    }
}
