//! Compatibility keys: what a host must offer for a snapshot to wake on it.
//!
//! A snapshot's memory and device state are only meaningful to the same VMM (version), the
//! same accelerator, the same guest-visible CPU (model and feature flags), the same kernel and
//! initramfs, the same vCPU count and memory size, and the same machine type and device
//! layout. [`CompatKey`] holds them; its rendering ([`CompatKey::render`]) is a stable,
//! sorted `key=value;...` string stored in the snapshot manifest's `compatibilityKey`, and
//! [`CompatKey::parse`] reads it back so a mismatch can name the fields that differ.

use std::collections::BTreeMap;
use std::fmt;

/// Errors about compatibility keys.
#[derive(Debug, thiserror::Error)]
pub enum CompatError {
    /// A stored key that does not parse.
    #[error("compatibility key {key:?} does not parse: {reason}")]
    Parse {
        /// The key as stored.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The host's key differs from the snapshot's.
    #[error(
        "this host cannot restore the snapshot: its compatibility key differs in {}",
        .differences.iter().map(|(k, s, h)| format!("{k} (snapshot {s:?}, host {h:?})")).collect::<Vec<_>>().join(", ")
    )]
    Mismatch {
        /// (field, snapshot value, host value) for each differing field.
        differences: Vec<(String, String, String)>,
    },
}

/// Everything a restore depends on. Field values never contain `;` (checked by
/// [`CompatKey::render`] callers through [`CompatKey::parse`] round trips in tests); they may
/// contain `=` (`microvm,pit=off`): a pair splits at its first `=`, and field names have none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompatKey {
    /// VMM name (`qemu`).
    pub vmm: String,
    /// VMM version (`10.0.2`), from `qemu-system-x86_64 --version`.
    pub vmm_version: String,
    /// Accelerator (`tcg` or `kvm`).
    pub accel: String,
    /// CPU model with its feature adjustments, as passed to `-cpu` (without `enforce`).
    pub cpu: String,
    /// Guest kernel digest (`sha256:<hex>` of the vmlinux).
    pub kernel: String,
    /// Initramfs digest.
    pub initramfs: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM, bytes.
    pub memory_bytes: u64,
    /// Machine type with the options that change what the guest sees, as passed to `-M`
    /// (`microvm,pit=off,firmware=qboot.rom`: [`crate::launch::MACHINE`]).
    pub machine: String,
    /// Device layout (see [`crate::launch::DEVICE_LAYOUT`]).
    pub devices: String,
}

impl CompatKey {
    fn fields(&self) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("accel", self.accel.clone()),
            ("cpu", self.cpu.clone()),
            ("devices", self.devices.clone()),
            ("initramfs", self.initramfs.clone()),
            ("kernel", self.kernel.clone()),
            ("machine", self.machine.clone()),
            ("memory", self.memory_bytes.to_string()),
            ("vcpus", self.vcpus.to_string()),
            ("vmm", self.vmm.clone()),
            ("vmm_version", self.vmm_version.clone()),
        ])
    }

    /// The stable string form: `field=value` pairs sorted by field, joined by `;`.
    pub fn render(&self) -> String {
        self.fields()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";")
    }

    /// Parses [`CompatKey::render`]'s output. Unknown or missing fields are errors (a key
    /// from a newer kiln is not silently half-compared).
    pub fn parse(s: &str) -> Result<Self, CompatError> {
        let err = |reason: String| CompatError::Parse {
            key: s.to_string(),
            reason,
        };
        let mut m = BTreeMap::new();
        for part in s.split(';') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| err(format!("{part:?} is not field=value")))?;
            if m.insert(k.to_string(), v.to_string()).is_some() {
                return Err(err(format!("field {k} twice")));
            }
        }
        let mut take = |k: &str| m.remove(k).ok_or_else(|| err(format!("no field {k}")));
        let key = CompatKey {
            accel: take("accel")?,
            cpu: take("cpu")?,
            devices: take("devices")?,
            initramfs: take("initramfs")?,
            kernel: take("kernel")?,
            machine: take("machine")?,
            memory_bytes: take("memory")?
                .parse()
                .map_err(|e| err(format!("memory: {e}")))?,
            vcpus: take("vcpus")?
                .parse()
                .map_err(|e| err(format!("vcpus: {e}")))?,
            vmm: take("vmm")?,
            vmm_version: take("vmm_version")?,
        };
        if let Some(k) = m.keys().next() {
            return Err(err(format!("unknown field {k}")));
        }
        Ok(key)
    }

    /// Ok when `self` (the host's key) equals the snapshot's `stored` key string; else a
    /// [`CompatError::Mismatch`] naming every differing field.
    pub fn check(&self, stored: &str) -> Result<(), CompatError> {
        let snap = CompatKey::parse(stored)?;
        let (a, b) = (snap.fields(), self.fields());
        let differences: Vec<_> = a
            .iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| (k.to_string(), v.clone(), b[k].clone()))
            .collect();
        if differences.is_empty() {
            Ok(())
        } else {
            Err(CompatError::Mismatch { differences })
        }
    }
}

impl fmt::Display for CompatKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CompatKey {
        CompatKey {
            vmm: "qemu".into(),
            vmm_version: "10.0.2".into(),
            accel: "tcg".into(),
            cpu: "Haswell-v4,-pcid".into(),
            kernel: "sha256:aa".into(),
            initramfs: "sha256:bb".into(),
            vcpus: 1,
            memory_bytes: 512 << 20,
            machine: "microvm,pit=off,firmware=qboot.rom".into(),
            devices: "virtio-blk-device,virtio-serial-device".into(),
        }
    }

    #[test]
    fn snapshot_taken_with_other_machine_options_is_refused_by_name() {
        // A snapshot of a kiln whose microvm still had its PIT (the machine string had no
        // options then), or still booted SeaBIOS (no `firmware=`: its ROM is in the
        // migration stream), must not wake on a host that boots otherwise.
        let host = key();
        for old in ["microvm", "microvm,pit=off"] {
            let mut snap = key();
            snap.machine = old.into();
            let msg = host.check(&snap.render()).unwrap_err().to_string();
            assert!(
                msg.contains(&format!(
                    r#"machine (snapshot "{old}", host "microvm,pit=off,firmware=qboot.rom")"#
                )),
                "{msg}"
            );
        }
        assert_eq!(
            CompatKey::parse(&host.render()).unwrap().machine,
            crate::launch::MACHINE
        );
    }

    #[test]
    fn render_is_stable_and_parses_back() {
        let k = key();
        assert_eq!(
            k.render(),
            "accel=tcg;cpu=Haswell-v4,-pcid;devices=virtio-blk-device,virtio-serial-device;\
             initramfs=sha256:bb;kernel=sha256:aa;machine=microvm,pit=off,firmware=qboot.rom;\
             memory=536870912;vcpus=1;\
             vmm=qemu;vmm_version=10.0.2"
        );
        assert_eq!(CompatKey::parse(&k.render()).unwrap(), k);
        assert!(k.check(&k.render()).is_ok());
    }

    #[test]
    fn mismatch_names_each_field() {
        let host = key();
        let mut snap = key();
        snap.accel = "kvm".into();
        snap.vmm_version = "7.2.0".into();
        match host.check(&snap.render()) {
            Err(CompatError::Mismatch { differences }) => {
                let names: Vec<_> = differences.iter().map(|d| d.0.as_str()).collect();
                assert_eq!(names, ["accel", "vmm_version"]);
                let msg = CompatError::Mismatch { differences }.to_string();
                assert!(
                    msg.contains("accel (snapshot \"kvm\", host \"tcg\")"),
                    "{msg}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_keys_are_refused() {
        let good = key().render();
        for bad in [
            String::new(),
            "garbage".to_string(),
            format!("{good};extra=1"),
            good.replace("vcpus=1", "vcpus=x"),
            good.replace(";vmm=qemu", ""),
            format!("{good};vmm=qemu"),
        ] {
            assert!(
                matches!(key().check(&bad), Err(CompatError::Parse { .. })),
                "{bad}"
            );
        }
    }
}
