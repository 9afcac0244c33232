//! kiln-vmm: VMM backends, boot-once snapshots, restore and clone, compatibility keys.
//!
//! QEMU is the one backend for now. Layers, bottom up:
//! - [`qmp`]: a QMP client (JSON lines over a unix socket, typed errors, bounded waits).
//! - [`channel`]: the host end of the guest protocol (framed JSON over virtio-serial).
//! - [`launch`]: host facts, the accelerator probe, QEMU's command line, the process.
//! - [`jail`]: the unprivileged user every QEMU runs as, and the files handed to it.
//! - [`compat`]: compatibility keys.
//! - [`egress`]: the host end of a build step VM's egress port (its proxy connections).
//! - [`kernel`]: the guest kernel (Debian's cloud kernel, fetched by name, uncompressed vmlinux).
//! - [`initramfs`]: the guest initramfs (the static kiln-guest-init and the virtio modules).
//! - [`snapshot`]: boot once → snapshot into the store.
//! - [`clone`]: clone start from a stored snapshot; clones running on this host.
//! - [`builder`]: the per-host builder snapshot a build step's VM is restored from.
//! - [`exec`]: commands in a running clone (the guest protocol's `exec`), from any process.

// Errors carry paths and QEMU's messages; large, but only on the error path.
#![allow(clippy::result_large_err)]

pub mod builder;
pub mod channel;
pub mod clone;
pub mod compat;
pub mod egress;
pub mod exec;
pub mod initramfs;
pub mod jail;
pub mod kernel;
pub mod launch;
pub mod lazy;
pub mod qmp;
pub mod snapshot;

pub use channel::ChannelError;
pub use clone::CloneError;
pub use compat::{CompatError, CompatKey};
pub use exec::ExecError;
pub use initramfs::InitramfsError;
pub use kernel::KernelError;
pub use launch::LaunchError;
pub use qmp::QmpError;
pub use snapshot::SnapshotError;

/// Any error from this crate.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// QMP.
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// The guest channel.
    #[error(transparent)]
    Channel(#[from] ChannelError),
    /// Launching QEMU.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Compatibility keys.
    #[error(transparent)]
    Compat(#[from] CompatError),
    /// The guest kernel.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The guest initramfs.
    #[error(transparent)]
    Initramfs(#[from] InitramfsError),
    /// Boot-once snapshots.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// Clones.
    #[error(transparent)]
    Clone(#[from] CloneError),
    /// Commands in clones.
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// Replaces `out` with `bytes` (mode 0644): written to a temporary file of this call's own in
/// `out`'s directory, then renamed over it. Writers running at once (two `kiln kernel`s on one
/// cache, two clone starts in one server process, tests) each rename a whole file, and a
/// reader (a QEMU opening an initramfs, a start reading a cache file) sees one of them whole.
/// (One fixed temporary name let a second builder truncate the file the first was about to
/// rename, so a VM could boot a torn initramfs; a name made of the pid alone is shared by the
/// tasks of one process.)
///
/// Errors: I/O creating, writing or renaming the temporary file.
pub(crate) fn replace_file(out: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = out
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let mut tmp = tempfile::Builder::new().prefix(".kiln-").tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    tmp.persist(out).map_err(|e| e.error)?;
    Ok(())
}
