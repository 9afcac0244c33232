//! kiln-vmm: VMM backends, boot-once snapshots, restore and clone, compatibility keys.
