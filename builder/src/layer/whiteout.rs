//! Whiteouts: how a layer deletes what lower layers hold.
//!
//! The rules, from the OCI image spec (`layer.md`, "Representing Changes" and "Whiteouts"):
//!
//! - A regular entry named `<dir>/.wh.<name>` is a **whiteout**: after the layer is applied,
//!   `<dir>/<name>` (and everything below it, if it is a directory) no longer exists. The
//!   whiteout itself is never materialised in the tree.
//! - A regular entry named `<dir>/.wh..wh..opq` is an **opaque whiteout**: every entry of
//!   `<dir>` that came from a lower layer is hidden; `<dir>` itself stays (with the metadata the
//!   layer gives it), and entries this layer adds to `<dir>` stay.
//! - Whiteouts apply only to lower layers: an entry that the same layer adds is never hidden by
//!   a whiteout in that layer, whatever the order of the two in the tar stream (the spec lets
//!   them appear in any order). kiln takes a layer's entries in stream order (as containerd
//!   does), tracks the paths the layer has made so far, with their ancestors ([`Created`]),
//!   and a whiteout removes what it names and everything below it except those paths: a
//!   directory the layer wrote into stays, with what the layer wrote, and loses the lower
//!   layers' entries. A whiteout's parent is resolved in the tree as it stands at that point
//!   of the stream (through a symlink the layer made before it, too). The applier
//!   ([`crate::layer::apply_layer`]) and the ext4 flattener (`crate::ext4::flatten`) both
//!   work this way, so that an image holds the tree the applier unpacks.
//! - Other names with the `.wh..wh.` prefix are AUFS bookkeeping (e.g. `.wh..wh.plnk`); they
//!   are skipped, as containerd and umoci do.
//! - A whiteout whose name is empty, `.` or `..` is malformed and refused
//!   ([`WhiteoutKind::parse`] returns an error), since honouring it would delete the directory
//!   that holds it or its parent.
//! - A whiteout for a name that does not exist is not an error.

use std::collections::HashMap;

/// The whiteout prefix (`layer.md`).
pub const PREFIX: &str = ".wh.";
/// The opaque whiteout name (`layer.md`).
pub const OPAQUE: &str = ".wh..wh..opq";
/// The prefix of AUFS metadata names, ignored.
pub const META_PREFIX: &str = ".wh..wh.";

/// What a file name means for whiteout purposes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WhiteoutKind<'a> {
    /// An ordinary entry.
    None,
    /// `.wh.<name>`: delete `<name>` from the same directory.
    Remove(&'a [u8]),
    /// `.wh..wh..opq`: hide the lower layers' contents of the directory.
    Opaque,
    /// `.wh..wh.<other>`: AUFS metadata, skipped.
    Meta,
}

/// A malformed whiteout name (empty, `.` or `..` after the prefix).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed whiteout {0:?}")]
pub struct WhiteoutError(pub String);

impl<'a> WhiteoutKind<'a> {
    /// Classifies the last component of an entry name.
    pub fn parse(base: &'a [u8]) -> Result<WhiteoutKind<'a>, WhiteoutError> {
        if base == OPAQUE.as_bytes() {
            return Ok(WhiteoutKind::Opaque);
        }
        if base.starts_with(META_PREFIX.as_bytes()) {
            return Ok(WhiteoutKind::Meta);
        }
        match base.strip_prefix(PREFIX.as_bytes()) {
            None => Ok(WhiteoutKind::None),
            Some(name)
                if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') =>
            {
                Err(WhiteoutError(String::from_utf8_lossy(base).into_owned()))
            }
            Some(name) => Ok(WhiteoutKind::Remove(name)),
        }
    }
}

/// The paths a layer made so far, with their ancestors, as a tree of components (the paths
/// symlinks resolved, so that the applier and the flattener, which name a node by the path
/// that leads to it, agree): what a whiteout of the same layer spares. Recording or
/// looking up a path costs one map operation per component. (A set of joined prefixes costs
/// depth² × name length per entry: one entry 1024 components deep with 255-byte names is
/// 134 MB of copying and hashing, and a small layer can hold thousands of them.)
#[derive(Default)]
pub(crate) struct Created {
    /// (parent node, name) → node; node 0 is the root.
    nodes: HashMap<(usize, Vec<u8>), usize>,
}

impl Created {
    pub(crate) fn insert(&mut self, comps: &[Vec<u8>]) {
        let mut cur = 0;
        for c in comps {
            let next = self.nodes.len() + 1;
            cur = *self.nodes.entry((cur, c.clone())).or_insert(next);
        }
    }

    pub(crate) fn contains(&self, comps: &[Vec<u8>]) -> bool {
        let mut cur = 0;
        for c in comps {
            match self.nodes.get(&(cur, c.clone())) {
                Some(n) => cur = *n,
                None => return false,
            }
        }
        true
    }

    /// Bytes of names held (for the bound's test).
    #[cfg(test)]
    pub(crate) fn name_bytes(&self) -> usize {
        self.nodes.keys().map(|(_, n)| n.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify() {
        assert_eq!(WhiteoutKind::parse(b"foo"), Ok(WhiteoutKind::None));
        assert_eq!(
            WhiteoutKind::parse(b".wh.foo"),
            Ok(WhiteoutKind::Remove(b"foo"))
        );
        assert_eq!(
            WhiteoutKind::parse(b".wh..wh..opq"),
            Ok(WhiteoutKind::Opaque)
        );
        assert_eq!(WhiteoutKind::parse(b".wh..wh.plnk"), Ok(WhiteoutKind::Meta));
        assert!(WhiteoutKind::parse(b".wh.").is_err());
        assert!(WhiteoutKind::parse(b".wh..").is_err());
        assert!(WhiteoutKind::parse(b".wh...").is_err());
        assert_eq!(
            WhiteoutKind::parse(b".wh.x.y"),
            Ok(WhiteoutKind::Remove(b"x.y"))
        );
    }
}
