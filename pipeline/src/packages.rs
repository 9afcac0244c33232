//! Which Debian packages changed between two images: both images' dpkg status files
//! (`/var/lib/dpkg/status`, deb822 stanzas as dpkg(1) and deb-control(5) describe them), read
//! from their ext4 disks without booting, and compared by package name.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_store::{Manifest, ManifestDigest, Store};
use serde::Serialize;

/// Where dpkg keeps what is installed (dpkg(1), "FILES").
pub const DPKG_STATUS: &str = "/var/lib/dpkg/status";

/// The largest status file read, bytes (a full Debian desktop's is about 3 MiB).
pub const MAX_STATUS_BYTES: usize = 64 << 20;

/// One package at one version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PackageVersion {
    /// `Package:`, with `:ARCH` for a package of a foreign architecture (`libc6:i386`).
    pub name: String,
    /// `Version:`, as dpkg writes it (`[epoch:]upstream[-revision]`).
    pub version: String,
}

/// One package installed in both images at different versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PackageChange {
    /// The package (as [`PackageVersion::name`]).
    pub name: String,
    /// Its version in the older image.
    pub from: String,
    /// Its version in the newer one.
    pub to: String,
}

/// The packages of a newer image against an older one, each list sorted by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PackageChanges {
    /// Installed only in the newer image.
    pub added: Vec<PackageVersion>,
    /// Installed only in the older image.
    pub removed: Vec<PackageVersion>,
    /// Installed in both at different versions.
    pub changed: Vec<PackageChange>,
}

impl PackageChanges {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// The installed packages a dpkg status file lists: name → version. A stanza counts when its
/// `Status:` ends in `installed` (`install ok installed`); stanzas without `Package:` or
/// `Version:` are skipped, as are continuation lines (leading space or tab). Lossy: the file
/// is text, and a stray byte must not hide the rest.
pub fn installed(status: &[u8]) -> BTreeMap<String, String> {
    let text = String::from_utf8_lossy(status);
    // (name, architecture) → version; a name with one architecture goes by its bare name,
    // one installed for several (multiarch) as `name:arch` each, whatever the stanzas' order.
    let mut by_arch: BTreeMap<(String, String), String> = BTreeMap::new();
    for stanza in text.split("\n\n") {
        let (mut name, mut arch, mut version, mut state) = (None, None, None, None);
        for line in stanza.lines() {
            if line.starts_with([' ', '\t']) {
                continue;
            }
            let Some((field, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match field.to_ascii_lowercase().as_str() {
                "package" => name = Some(value),
                "architecture" => arch = Some(value),
                "version" => version = Some(value),
                "status" => state = Some(value),
                _ => {}
            }
        }
        let (Some(name), Some(version)) = (name, version) else {
            continue;
        };
        if name.is_empty() || state.is_none_or(|s| s.split_whitespace().last() != Some("installed"))
        {
            continue;
        }
        by_arch.insert(
            (name.to_string(), arch.unwrap_or_default().to_string()),
            version.to_string(),
        );
    }
    let mut archs: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, _) in by_arch.keys() {
        *archs.entry(name).or_default() += 1;
    }
    by_arch
        .iter()
        .map(|((name, arch), version)| {
            let key = if archs[name.as_str()] > 1 {
                format!("{name}:{arch}")
            } else {
                name.clone()
            };
            (key, version.clone())
        })
        .collect()
}

/// `new` against `old` (see [`PackageChanges`]).
pub fn diff(old: &BTreeMap<String, String>, new: &BTreeMap<String, String>) -> PackageChanges {
    let mut c = PackageChanges::default();
    for (name, version) in new {
        match old.get(name) {
            None => c.added.push(PackageVersion {
                name: name.clone(),
                version: version.clone(),
            }),
            Some(from) if from != version => c.changed.push(PackageChange {
                name: name.clone(),
                from: from.clone(),
                to: version.clone(),
            }),
            Some(_) => {}
        }
    }
    for (name, version) in old {
        if !new.contains_key(name) {
            c.removed.push(PackageVersion {
                name: name.clone(),
                version: version.clone(),
            });
        }
    }
    c
}

/// The installed packages of the image (or snapshot) `digest` names: its disk is written to
/// a sparse file under `scratch` (removed afterwards) and its dpkg status read. `None` when
/// the image has no dpkg status (not a Debian image). Errors: the manifest or a chunk cannot
/// be read, or debugfs fails; as text, for a report.
pub async fn image_packages(
    store: &Store,
    digest: &ManifestDigest,
    scratch: &Path,
) -> Result<Option<BTreeMap<String, String>>, String> {
    let disk = match store
        .get_manifest(digest)
        .await
        .map_err(|e| format!("{digest}: {e}"))?
    {
        Manifest::Image(m) => m.disk,
        Manifest::Snapshot(m) => m.disk,
    };
    let dir = tempfile::tempdir_in(scratch).map_err(|e| format!("{}: {e}", scratch.display()))?;
    let file = dir.path().join("disk.ext4");
    store
        .materialize(&disk, &file, None)
        .await
        .map_err(|e| format!("{digest}: writing its disk: {e}"))?;
    let status = tokio::task::spawn_blocking(move || {
        kiln_builder::ext4::read_file(&file, DPKG_STATUS, MAX_STATUS_BYTES)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("{digest}: {e}"))?;
    drop(dir);
    Ok(status.map(|s| installed(&s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "Package: base-files\nStatus: install ok installed\nVersion: 12.4+deb12u5\nDescription: x\n continued: not a field\n\nPackage: curl\nStatus: install ok installed\nArchitecture: amd64\nVersion: 7.88.1-10+deb12u7\n\nPackage: gone\nStatus: install ok installed\nVersion: 1.0\n\nPackage: removed-but-config\nStatus: deinstall ok config-files\nVersion: 2.0\n";
    const NEW: &str = "Package: base-files\nStatus: install ok installed\nVersion: 12.4+deb12u5\n\nPackage: curl\nStatus: install ok installed\nArchitecture: amd64\nVersion: 7.88.1-10+deb12u8\n\nPackage: curl\nStatus: install ok installed\nArchitecture: i386\nVersion: 7.88.1-10+deb12u8\n\nPackage: kiln-test\nStatus: install ok installed\nVersion: 1:0.2\n";

    #[test]
    fn installed_reads_names_versions_and_skips_what_is_not_installed() {
        let old = installed(OLD.as_bytes());
        assert_eq!(old.len(), 3, "{old:?}");
        assert_eq!(old["curl"], "7.88.1-10+deb12u7");
        assert!(!old.contains_key("removed-but-config"));
        let new = installed(NEW.as_bytes());
        assert_eq!(new["curl:i386"], "7.88.1-10+deb12u8");
        assert_eq!(new["curl:amd64"], "7.88.1-10+deb12u8");
    }

    #[test]
    fn diff_names_added_removed_and_changed_packages() {
        let c = diff(&installed(OLD.as_bytes()), &installed(NEW.as_bytes()));
        let names = |v: &[PackageVersion]| v.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&c.added), ["curl:amd64", "curl:i386", "kiln-test"]);
        assert_eq!(names(&c.removed), ["curl", "gone"]);
        assert!(c.changed.is_empty(), "{c:?}");
        let mut one = installed(OLD.as_bytes());
        one.insert("curl".into(), "7.88.1-10+deb12u8".into());
        assert_eq!(
            diff(&installed(OLD.as_bytes()), &one).changed,
            [PackageChange {
                name: "curl".into(),
                from: "7.88.1-10+deb12u7".into(),
                to: "7.88.1-10+deb12u8".into(),
            }]
        );
        assert!(diff(&installed(OLD.as_bytes()), &installed(OLD.as_bytes())).is_empty());
    }

    #[test]
    fn a_status_file_with_crlf_or_junk_does_not_panic() {
        let junk = b"\xff\xfe\n\n:\n\nPackage:\n\nPackage: a\r\nVersion: 1\r\nStatus: install ok installed\r\n";
        let m = installed(junk);
        assert_eq!(m.get("a").map(String::as_str), Some("1"));
    }
}
