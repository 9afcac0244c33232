//! Base images from a distribution archive: `from: {bootstrap: {distro: debian, suite:
//! bookworm, mirror: URL, variant: minbase, include: [...]}}`, built with `debootstrap` and
//! packed as an ordinary one-layer OCI image in the blob cache.
//!
//! The result is cached by a key made of its inputs: distro, suite, mirror, variant, the
//! sorted package list, and the sha256 of the archive's `dists/<suite>/Release` file (so a
//! point release or security update makes a new image). The image is found again under the
//! reference `localhost/kiln-bootstrap/<distro>:<key>`; callers also tag it under the name
//! the recipe was built as.
//!
//! What is normalised after debootstrap: `/etc/hostname` and `/etc/resolv.conf` (copied from
//! the build host by debootstrap) are emptied, downloaded `.deb` files are removed, and mtimes
//! are clamped to the Release file's `Date:` (used as `SOURCE_DATE_EPOCH`).

use std::path::{Path, PathBuf};

use kiln_store::BlobDigest;
use kiln_store::digest::Sha256Hash;
use serde_json::json;

use crate::cache::{BlobCache, CacheError, digest_of};
use crate::layer::write::{Written, write_layer};

/// Errors building a bootstrap base.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// A field of the spec is not acceptable.
    #[error("bootstrap: invalid {field} {value:?}: {reason}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why.
        reason: &'static str,
    },
    /// Only Debian-family archives are supported.
    #[error("bootstrap: distro {0:?} is not supported (debian only)")]
    Distro(String),
    /// The Release file could not be fetched.
    #[error("bootstrap: fetching {url}: {detail}")]
    Release {
        /// The URL.
        url: String,
        /// What failed.
        detail: String,
    },
    /// debootstrap failed.
    #[error("bootstrap: debootstrap exited with {status}; last lines:\n{log}")]
    Debootstrap {
        /// Exit status.
        status: String,
        /// Tail of its output.
        log: String,
    },
    /// Not host root (a build without root, [`crate::exec::rootless`]).
    #[error(
        "bootstrap: debootstrap needs host root (it makes device nodes, which need CAP_MKNOD \
         in the host's user namespace): run this build as root, or start FROM an image"
    )]
    NeedsRoot,
    /// A local file operation failed.
    #[error("bootstrap: {path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A cache problem.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// What to bootstrap (the recipe's `from.bootstrap`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapSpec {
    /// `debian` (Ubuntu archives work the same way with debootstrap; `ubuntu` is accepted).
    pub distro: String,
    /// Suite, e.g. `bookworm`.
    pub suite: String,
    /// Archive URL (`http://` or `https://`).
    pub mirror: String,
    /// debootstrap variant, e.g. `minbase`.
    pub variant: Option<String>,
    /// Extra packages.
    pub include: Vec<String>,
}

/// The result of [`bootstrap`].
#[derive(Debug, Clone)]
pub struct Bootstrapped {
    /// Manifest digest in the cache.
    pub digest: BlobDigest,
    /// The cache key (hex).
    pub key: String,
    /// Whether it came from the cache (no debootstrap run).
    pub cached: bool,
}

fn word_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 100
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'+' | b'.' | b'-')
        })
}

impl BootstrapSpec {
    /// Checks every field: names are Debian package/suite names (`[a-z0-9][a-z0-9+.-]*`),
    /// the mirror is an http(s) URL with no whitespace or quotes.
    pub fn validate(&self) -> Result<(), BootstrapError> {
        if self.distro != "debian" && self.distro != "ubuntu" {
            return Err(BootstrapError::Distro(self.distro.clone()));
        }
        let bad = |field, value: &str, reason| BootstrapError::Invalid {
            field,
            value: value.to_string(),
            reason,
        };
        if !word_ok(&self.suite) {
            return Err(bad("suite", &self.suite, "not a suite name"));
        }
        if let Some(v) = &self.variant
            && !word_ok(v)
        {
            return Err(bad("variant", v, "not a variant name"));
        }
        for p in &self.include {
            if !word_ok(p) {
                return Err(bad("package", p, "not a package name"));
            }
        }
        let m = &self.mirror;
        if !(m.starts_with("http://") || m.starts_with("https://"))
            || m.chars()
                .any(|c| c.is_whitespace() || c == '"' || c == '\'' || c.is_control())
        {
            return Err(bad("mirror", m, "not an http(s) URL"));
        }
        Ok(())
    }

    fn release_url(&self) -> String {
        format!(
            "{}/dists/{}/Release",
            self.mirror.trim_end_matches('/'),
            self.suite
        )
    }

    /// The cache key (hex sha256) for this spec and a Release file digest.
    pub fn key(&self, release_digest: &Sha256Hash) -> String {
        let mut pkgs = self.include.clone();
        pkgs.sort();
        pkgs.dedup();
        let canon = json!({
            "distro": self.distro,
            "suite": self.suite,
            "mirror": self.mirror.trim_end_matches('/'),
            "variant": self.variant,
            "include": pkgs,
            "release": release_digest.to_string(),
            "format": 1,
        });
        digest_of(canon.to_string().as_bytes())
            .to_string()
            .trim_start_matches("sha256:")
            .to_string()
    }
}

/// Reads the `Date:` field of a Release file as seconds since 1970 (RFC 2822 date in UTC).
fn release_epoch(release: &str) -> Option<u64> {
    let line = release
        .lines()
        .find_map(|l| l.strip_prefix("Date:"))?
        .trim();
    // e.g. "Sat, 10 Aug 2024 09:22:51 UTC"
    let parts: Vec<&str> = line.split_whitespace().collect();
    let [_, day, mon, year, time, ..] = parts.as_slice() else {
        return None;
    };
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let m = months.iter().position(|x| x == mon)? + 1;
    let d: u32 = day.parse().ok()?;
    let y: u32 = year.parse().ok()?;
    let t = humantime::parse_rfc3339(&format!("{y:04}-{m:02}-{d:02}T{time}Z")).ok()?;
    t.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs())
}

async fn fetch_release(spec: &BootstrapSpec) -> Result<Vec<u8>, BootstrapError> {
    let url = spec.release_url();
    let err = |detail: String| BootstrapError::Release {
        url: url.clone(),
        detail,
    };
    crate::registry::crypto_provider();
    let client = reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(30))
        .timeout(std::time::Duration::from_secs(120))
        .build()
        .map_err(|e| err(e.to_string()))?;
    let resp = client
        .get(&url)
        .send()
        .await
        .map_err(|e| err(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(err(format!("HTTP {}", resp.status())));
    }
    let b = resp.bytes().await.map_err(|e| err(e.to_string()))?;
    if b.len() > 16 << 20 {
        return Err(err("Release file larger than 16 MiB".into()));
    }
    Ok(b.to_vec())
}

/// Builds (or finds in the cache) the base image for `spec`. `work` is a scratch directory
/// for the root tree (removed afterwards). Needs host root ([`BootstrapError::NeedsRoot`]) and
/// `debootstrap`.
pub async fn bootstrap(
    spec: &BootstrapSpec,
    cache: &dyn BlobCache,
    work: &Path,
) -> Result<Bootstrapped, BootstrapError> {
    spec.validate()?;
    // Its cache fills only by bootstrapping, which a user namespace cannot do.
    if crate::exec::rootless::in_user_namespace() {
        return Err(BootstrapError::NeedsRoot);
    }
    let release = fetch_release(spec).await?;
    let release_digest = digest_of(&release);
    let key = spec.key(&release_digest);
    let refname = format!("localhost/kiln-bootstrap/{}:{key}", spec.distro);
    if let Some(d) = cache.get_ref(&refname)?
        && cache.blob_path(&d)?.is_some()
    {
        return Ok(Bootstrapped {
            digest: d,
            key,
            cached: true,
        });
    }
    let epoch = release_epoch(&String::from_utf8_lossy(&release));
    let rootfs = work.join(format!("bootstrap-{}", &key[..16]));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BootstrapError::Io { path, source }
    };
    if rootfs.exists() {
        std::fs::remove_dir_all(&rootfs).map_err(io(&rootfs))?;
    }
    std::fs::create_dir_all(&rootfs).map_err(io(&rootfs))?;
    let mut cmd = tokio::process::Command::new("debootstrap");
    if let Some(v) = &spec.variant {
        cmd.arg(format!("--variant={v}"));
    }
    if !spec.include.is_empty() {
        cmd.arg(format!("--include={}", spec.include.join(",")));
    }
    cmd.arg(&spec.suite).arg(&rootfs).arg(&spec.mirror);
    let out = cmd.output().await.map_err(io(Path::new("debootstrap")))?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        let _ = std::fs::remove_dir_all(&rootfs);
        return Err(BootstrapError::Debootstrap {
            status: out.status.to_string(),
            log: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        });
    }
    for f in ["etc/hostname", "etc/resolv.conf"] {
        let p = rootfs.join(f);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_file()) {
            std::fs::write(&p, b"").map_err(io(&p))?;
        }
    }
    let archives = rootfs.join("var/cache/apt/archives");
    if let Ok(rd) = std::fs::read_dir(&archives) {
        for e in rd.flatten() {
            if e.path().extension().is_some_and(|x| x == "deb") {
                std::fs::remove_file(e.path()).map_err(io(&e.path()))?;
            }
        }
    }
    let scratch = cache.scratch_path(&format!("bootstrap-{}", &key[..16]));
    let written: Written = {
        let f = std::fs::File::create(&scratch).map_err(io(&scratch))?;
        let w = write_layer(&rootfs, std::io::BufWriter::new(f), epoch).map_err(io(&rootfs))?;
        std::fs::remove_dir_all(&rootfs).map_err(io(&rootfs))?;
        w
    };
    cache.commit(&scratch, &written.digest)?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Cmd": ["bash"],
            "Labels": {
                "org.kiln.bootstrap.distro": spec.distro,
                "org.kiln.bootstrap.suite": spec.suite,
                "org.kiln.bootstrap.release": release_digest.to_string(),
            },
        },
        "rootfs": { "type": "layers", "diff_ids": [written.diff_id.to_string()] },
        "history": [{
            "created_by": format!(
                "kiln bootstrap {} {} {}{}",
                spec.distro,
                spec.suite,
                spec.variant.as_deref().unwrap_or("default"),
                if spec.include.is_empty() { String::new() } else { format!(" +{}", spec.include.join(",")) }
            ),
        }],
    });
    // JSON values always serialize.
    let config_bytes = serde_json::to_vec(&config).expect("JSON values serialize");
    let config_digest = BlobDigest::of(&config_bytes);
    cache.put_bytes(&config_digest, &config_bytes)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": crate::image::OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest.to_string(),
            "size": config_bytes.len(),
        },
        "layers": [{
            "mediaType": written.media_type,
            "digest": written.digest.to_string(),
            "size": written.size,
        }],
    });
    let manifest_bytes = serde_json::to_vec(&manifest).expect("JSON values serialize");
    let digest = BlobDigest::of(&manifest_bytes);
    cache.put_bytes(&digest, &manifest_bytes)?;
    cache.set_ref(&refname, &digest)?;
    Ok(Bootstrapped {
        digest,
        key,
        cached: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> BootstrapSpec {
        BootstrapSpec {
            distro: "debian".into(),
            suite: "bookworm".into(),
            mirror: "http://mirror.invalid/debian".into(),
            variant: Some("minbase".into()),
            include: vec!["ca-certificates".into(), "curl".into()],
        }
    }

    #[test]
    fn validation() {
        assert!(spec().validate().is_ok());
        let mut s = spec();
        s.include.push("--root=/".into());
        assert!(matches!(
            s.validate(),
            Err(BootstrapError::Invalid {
                field: "package",
                ..
            })
        ));
        let mut s = spec();
        s.mirror = "file:///etc".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.suite = "../x".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.distro = "alpine".into();
        assert!(matches!(s.validate(), Err(BootstrapError::Distro(_))));
    }

    #[test]
    fn key_covers_inputs() {
        let (a, b) = (digest_of(b"Release a"), digest_of(b"Release b"));
        let base = spec().key(&a);
        assert_ne!(base, spec().key(&b), "Release digest");
        let mut s = spec();
        s.include.reverse();
        assert_eq!(base, s.key(&a), "package order does not matter");
        s.include.push("git".into());
        assert_ne!(base, s.key(&a));
        let mut s = spec();
        s.variant = None;
        assert_ne!(base, s.key(&a));
        let mut s = spec();
        s.mirror.push('/');
        assert_eq!(base, s.key(&a), "a trailing slash is the same mirror");
    }

    #[test]
    fn release_dates() {
        assert_eq!(
            release_epoch("Origin: Debian\nDate: Thu, 01 Jan 1970 00:01:00 UTC\n"),
            Some(60)
        );
        assert_eq!(
            release_epoch("Date: Sat, 29 Jun 2024 09:05:39 UTC\n"),
            Some(1_719_651_939)
        );
        assert_eq!(release_epoch("Suite: x\n"), None);
    }
}
