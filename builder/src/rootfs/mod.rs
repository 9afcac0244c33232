//! Paths inside a root: the builder's one root-confined resolver and its one set of limits.
//!
//! - [`walk`](walk::walk) is the one walk of a path inside a root, over any [`walk::Tree`]:
//!   the host directories `COPY` reads and writes and layers are applied to ([`root`],
//!   through descriptors, never a path), and the ext4 flattener's model of the image
//!   (`crate::ext4`), which must place entries exactly as the applier does; and, following
//!   no symlink, the passes that put a layer in overlayfs' form (`crate::build::lower`).
//! - [`open_in_root`] opens one path inside a root: `openat2(2)` with `RESOLVE_IN_ROOT`
//!   where the kernel has it (Linux 5.6 and later), the walk where not. Every `openat2`
//!   call of the builder is here.
//!
//! A root-confined resolution never opens anything outside its root, whatever symlinks the
//! tree holds, and a symlink swapped in between a lookup and an open makes the open fail
//! instead of being followed (`O_NOFOLLOW` at every step).

pub mod root;
pub(crate) mod walk;

mod open;

pub(crate) use open::open_in_root;
pub use root::{Create, Resolved, Root, RootError, components, read_bounded};

/// How many symlinks one resolution may follow (Linux's `MAXSYMLINKS`, 40,
/// `include/linux/namei.h`).
pub const MAX_SYMLINK_HOPS: usize = 40;
/// How many directories below the root a resolved path may enter, and how deep a removal
/// may recurse.
pub const MAX_DEPTH: usize = 1024;

#[cfg(test)]
mod tests;
