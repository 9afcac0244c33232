//! kiln-guest: the guest side of a kiln microVM.
//!
//! - [`protocol`]: the messages the host (kiln-vmm) and the guest init exchange over the
//!   virtio-serial port [`protocol::PORT_NAME`], their framing and versioning. Both sides use
//!   this module; it depends on serde, serde_json, base64 and thiserror only.
//! - [`egress`]: the multiplexed byte streams of a build step's egress port
//!   ([`egress::PORT_NAME`]): the guest's proxy connections carried to the host's egress proxy.
//! - the binary `kiln-guest-init` (`src/bin/kiln-guest-init/`): the static PID 1 that lives in
//!   the initramfs, mounts the image's root, starts its start command, runs its ready check and
//!   serves the host's requests (restore, ping, exec: commands with streamed output).

pub mod egress;
pub mod protocol;
